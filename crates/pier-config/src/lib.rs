//! Pier's configuration: a TOML file (schema in [`schema`]) checked and
//! turned into the internal [`Config`] (in [`model`]) the server runs on.
//!
//! ```
//! let cfg = pier_config::load_str(pier_config::DEFAULT_CONFIG, "quickstart.toml").unwrap();
//! assert_eq!(cfg.listeners.len(), 1);
//! ```
//!
//! Errors are all collected and printed one per line as `FILE:LINE:COL: message`.
//! Key reference: docs/config.md.
#![forbid(unsafe_code)]

pub mod cidr;
pub mod env;
pub mod error;
pub mod matchers;
pub mod model;
pub mod schema;
pub mod units;
mod validate;

use std::net::SocketAddr;
use std::path::Path;
use std::time::Duration;

pub use cidr::{denied, normalize};
pub use error::{ConfigError, ConfigErrors, Location};
pub use model::*;
pub use units::{parse_duration, parse_size};
pub use validate::parse_listen_addr;

use error::{Locator, RawError};

/// The embedded default config (`pier` with no arguments runs it).
pub const DEFAULT_CONFIG: &str = include_str!("../../../examples/quickstart.toml");

/// Reads and checks a config file. Errors name the file.
pub fn load_file(path: &Path) -> Result<Config, ConfigErrors> {
    let label = path.display().to_string();
    match std::fs::read_to_string(path) {
        Ok(text) => load_str(&text, &label),
        Err(e) => Err(ConfigErrors(vec![ConfigError {
            file: label,
            location: None,
            message: format!("cannot read config file: {e}"),
        }])),
    }
}

/// Checks config text; `source` labels it in errors (usually the file name)
/// and its directory is where relative `*_file` paths (Lua code) are found.
/// Environment variables are read from the process environment.
pub fn load_str(text: &str, source: &str) -> Result<Config, ConfigErrors> {
    load_str_with_env(text, source, &|name| std::env::var(name).ok())
}

/// [`load_str`] with an explicit variable lookup (tests, `pier check --env`).
pub fn load_str_with_env(
    text: &str,
    source: &str,
    lookup: &dyn Fn(&str) -> Option<String>,
) -> Result<Config, ConfigErrors> {
    let (expanded, map) = match env::expand(text, lookup) {
        Ok(v) => v,
        Err(errs) => {
            let loc = Locator {
                file: source,
                original: text,
                map: &env::SourceMap::default(),
            };
            return Err(ConfigErrors(
                errs.into_iter()
                    .map(|e| loc.error(RawError::at(Some(e.offset..e.offset), e.message)))
                    .collect(),
            ));
        }
    };
    let loc = Locator {
        file: source,
        original: text,
        map: &map,
    };
    let to_errors = |raw: Vec<RawError>| {
        let mut errs: Vec<ConfigError> = raw.into_iter().map(|r| loc.error(r)).collect();
        // File order (errors without a position last); stable for equal positions.
        errs.sort_by_key(|e| e.location.map_or((u32::MAX, u32::MAX), |l| (l.line, l.col)));
        ConfigErrors(errs)
    };
    let (file, schema_errors) = schema::parse(&expanded).map_err(|e| to_errors(vec![e]))?;
    // `*_file` paths are relative to the config file's directory.
    let base = Path::new(source).parent().unwrap_or(Path::new(""));
    validate::validate(file, schema_errors, base).map_err(to_errors)
}

impl Config {
    /// The one-line mode, `pier proxy --listen ADDR --to ADDR...`: one
    /// listener, one catch-all route to one round-robin upstream with a TCP
    /// health check (every 2s, rise 2, fall 2), passive max_fails 3, one
    /// retry; everything else at its default.
    pub fn quick(listen: SocketAddr, to: Vec<SocketAddr>, admin: Option<SocketAddr>) -> Config {
        let servers = to
            .into_iter()
            .map(|addr| UpstreamServer { addr, weight: 1 })
            .collect();
        let mut upstream = Upstream::with_defaults("default", servers);
        upstream.health_check = Some(HealthCheck {
            kind: HealthKind::Tcp,
            interval: Duration::from_secs(2),
            timeout: HealthCheck::DEFAULT_TIMEOUT,
            rise: 2,
            fall: 2,
        });
        upstream.max_fails = 3;
        upstream.retries = 1;
        Config {
            workers: validate::cores(),
            grace_period: validate::DEFAULT_GRACE_PERIOD,
            listeners: vec![Listener {
                name: "main".into(),
                addr: listen,
            }],
            admin,
            routes: vec![Route {
                name: "default".into(),
                host: None,
                path: PathMatch::Any,
                upstream: "default".into(),
                lua: RouteLua::default(),
                headers: HeaderRules::default(),
                host_header: None,
            }],
            upstreams: [("default".to_string(), upstream)].into_iter().collect(),
            limits: Limits::default(),
            timeouts: Timeouts::default(),
            access_log: AccessLog::Off,
            deny_origins: Vec::new(),
            demo_origin: None,
            lua: LuaConfig::default(),
            rate_limits: Vec::new(),
            upgrade: validate::default_upgrade(),
        }
    }
}

#[cfg(test)]
mod tests;
