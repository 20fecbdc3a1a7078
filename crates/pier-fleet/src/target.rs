//! Where the fleet's Redis is: `[redis] url`, or the primary that Redis
//! Sentinel names (`sentinels`, `master_name`), asked again on every new
//! connection so that after a failover the nodes follow the new primary.

use pier_config::Redis;
use redis::{ConnectionAddr, ConnectionInfo, IntoConnectionInfo};

pub(crate) struct Target {
    /// The URL's address, password and database.
    base: ConnectionInfo,
    sentinels: Vec<String>,
    master: String,
    timeout: std::time::Duration,
}

impl Target {
    pub(crate) fn new(cfg: &Redis) -> Result<Target, String> {
        let base = cfg
            .url
            .as_str()
            .into_connection_info()
            .map_err(|e| format!("[redis] url: {e}"))?;
        Ok(Target {
            base,
            sentinels: cfg.sentinels.clone(),
            master: cfg.master_name.clone(),
            timeout: cfg.timeout,
        })
    }

    /// A new connection, with reads and writes bounded by the timeout.
    pub(crate) fn connect(&self) -> Result<redis::Connection, String> {
        let info = if self.sentinels.is_empty() {
            self.base.clone()
        } else {
            self.primary()?
        };
        let c = redis::Client::open(info)
            .and_then(|c| c.get_connection_with_timeout(self.timeout))
            .map_err(|e| format!("redis: {e}"))?;
        c.set_read_timeout(Some(self.timeout))
            .and_then(|_| c.set_write_timeout(Some(self.timeout)))
            .map_err(|e| format!("redis: {e}"))?;
        Ok(c)
    }

    /// The primary's address from the first sentinel that knows it
    /// (`SENTINEL get-master-addr-by-name`), with the URL's password and
    /// database.
    fn primary(&self) -> Result<ConnectionInfo, String> {
        let mut why = String::from("no sentinel answered");
        for s in &self.sentinels {
            let asked = (|| -> Result<Option<(String, u16)>, String> {
                let info = format!("redis://{s}")
                    .into_connection_info()
                    .map_err(|e| e.to_string())?;
                let mut c = redis::Client::open(info)
                    .and_then(|c| c.get_connection_with_timeout(self.timeout))
                    .map_err(|e| e.to_string())?;
                c.set_read_timeout(Some(self.timeout))
                    .map_err(|e| e.to_string())?;
                redis::cmd("SENTINEL")
                    .arg("get-master-addr-by-name")
                    .arg(&self.master)
                    .query(&mut c)
                    .map_err(|e| e.to_string())
            })();
            match asked {
                Ok(Some((host, port))) => {
                    return Ok(self.base.clone().set_addr(ConnectionAddr::Tcp(host, port)))
                }
                Ok(None) => why = format!("sentinel {s} does not know {:?}", self.master),
                Err(e) => why = format!("sentinel {s}: {e}"),
            }
        }
        Err(format!("redis: {why}"))
    }
}
