//! The exchange behind `[[limit]] scope = "global"`: one thread per
//! process that, every `[redis] sync_interval`, sends each global limit's
//! new admissions to Redis and brings back the fleet's totals
//! ([`pier_limits::global`] explains the counting). Workers never wait on
//! Redis: they decide from the last totals.
//!
//! One `EVALSHA` per limit and interval (more past [`BATCH`] keys) does
//! everything in Redis, atomically: the node's heartbeat in a sorted set
//! (`PREFIX:nodes`, so every node knows the fleet's size), `INCRBY` of
//! `PREFIX:rl:LIMIT:KEY|WINDOW` for the current and previous windows, and
//! the totals read back. Counters expire two intervals after their window.
//! The keys a script touches are built inside it, so this runs on one
//! Redis (or a primary with replicas), not on Redis Cluster.

use parking_lot::Mutex;
use pier_config::Redis;
use pier_limits::global::{registered, Delta, GlobalRate, Totals};
use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use std::sync::{Arc, OnceLock};
use std::time::{Instant, SystemTime, UNIX_EPOCH};

/// Keys per script call: a script blocks Redis while it runs, so a batch
/// stays around a millisecond of its time.
pub const BATCH: usize = 1000;

/// Keys one limit sends in one exchange, at most (the rest wait for the
/// next): bounds what a flood of distinct keys costs Redis per node.
pub const MAX_KEYS_PER_EXCHANGE: usize = 10_000;

/// Keys without admissions to send are read back every this many
/// exchanges (to learn the other nodes' counts for them).
const REFRESH_EVERY: u64 = 4;

/// KEYS: one per limit key. ARGV: window, counter ttl ms, now (unix ms),
/// node ttl ms, nodes key, node id, then (curr, prev) admissions per key.
/// Returns the live node count, then (prev, curr) totals per key.
const SCRIPT: &str = r#"
local w = tonumber(ARGV[1])
local ttl = tonumber(ARGV[2])
local now = tonumber(ARGV[3])
redis.call('ZADD', ARGV[5], now, ARGV[6])
redis.call('ZREMRANGEBYSCORE', ARGV[5], '-inf', now - tonumber(ARGV[4]))
redis.call('PEXPIRE', ARGV[5], tonumber(ARGV[4]) * 2)
local out = { redis.call('ZCARD', ARGV[5]) }
for i, k in ipairs(KEYS) do
  local counts = {}
  for j, win in ipairs({ w - 1, w }) do
    local name = k .. '|' .. win
    local d = tonumber(ARGV[6 + 2 * i - (j - 1)])
    if d > 0 then
      counts[j] = redis.call('INCRBY', name, d)
      redis.call('PEXPIRE', name, ttl)
    else
      counts[j] = tonumber(redis.call('GET', name) or '0')
    end
  end
  out[#out + 1] = counts[1]
  out[#out + 1] = counts[2]
end
return out
"#;

struct Link {
    con: redis::Connection,
    sha: String,
}

/// The sync thread's state, for metrics.
pub struct LimitSync {
    cfg: Redis,
    node: String,
    target: crate::target::Target,
    link: Mutex<Option<Link>>,
    connected: AtomicBool,
    stop: AtomicBool,
}

static SYNC: OnceLock<Arc<LimitSync>> = OnceLock::new();

/// The running sync, once [`start_limits`] ran.
pub fn sync() -> Option<&'static Arc<LimitSync>> {
    SYNC.get()
}

/// Starts the sync thread for `cfg` (once per process; `[redis]` is read
/// at start). It idles while no limit is global.
pub fn start_limits(cfg: &Redis, node: &str) -> Result<Arc<LimitSync>, String> {
    if let Some(s) = SYNC.get() {
        return Ok(s.clone());
    }
    let target = crate::target::Target::new(cfg)?;
    let s = SYNC
        .get_or_init(|| {
            Arc::new(LimitSync {
                cfg: cfg.clone(),
                node: node.to_string(),
                target,
                link: Mutex::new(None),
                connected: AtomicBool::new(false),
                stop: AtomicBool::new(false),
            })
        })
        .clone();
    let t = s.clone();
    std::thread::Builder::new()
        .name("pier-limit-sync".into())
        .spawn(move || t.run())
        .map_err(|e| format!("limit sync thread: {e}"))?;
    Ok(s)
}

fn unix_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

impl LimitSync {
    /// True while the last exchange succeeded.
    pub fn connected(&self) -> bool {
        self.connected.load(Relaxed)
    }

    /// Ends the thread at its next interval.
    pub fn stop(&self) {
        self.stop.store(true, Relaxed);
    }

    fn run(&self) {
        let mut next = Instant::now();
        let mut round = 0u64;
        while !self.stop.load(Relaxed) {
            next += self.cfg.sync_interval;
            let now = Instant::now();
            if next > now {
                std::thread::sleep(next - now);
            } else {
                // Late (a slow Redis): start counting intervals from now.
                next = now;
            }
            let limits = registered();
            if limits.is_empty() {
                continue;
            }
            round += 1;
            let ok = self.exchange_all(&limits, round.is_multiple_of(REFRESH_EVERY));
            if self.connected.swap(ok, Relaxed) != ok {
                if ok {
                    tracing::info!("global limits: exchanging counts with Redis");
                } else {
                    tracing::warn!("global limits: Redis out of reach; limits fail open or closed as configured");
                }
            }
        }
    }

    /// One round: every limit's admissions out, totals in. False if Redis
    /// failed (the limits keep their admissions for the next round).
    fn exchange_all(&self, limits: &[Arc<GlobalRate>], refresh: bool) -> bool {
        let mut link = self.link.lock();
        if link.is_none() {
            match self.connect() {
                Ok(l) => *link = Some(l),
                Err(e) => {
                    tracing::debug!("global limits: {e}");
                    for g in limits {
                        g.failed(&[]);
                    }
                    return false;
                }
            }
        }
        let Some(l) = link.as_mut() else {
            return false;
        };
        let mut deltas = Vec::new();
        for (n, g) in limits.iter().enumerate() {
            deltas.clear();
            let now = pier_limits::clock::now_ms();
            let w = g.take(now, refresh, MAX_KEYS_PER_EXCHANGE, &mut deltas);
            if let Err(e) = self.exchange(l, g, w, &deltas) {
                tracing::debug!("global limits: {}: {e}", g.name());
                g.failed(&deltas);
                // This limit's keys went back; the others were not taken.
                for g in &limits[n + 1..] {
                    g.failed(&[]);
                }
                *link = None;
                return false;
            }
        }
        true
    }

    /// One limit's keys, in batches of [`BATCH`]; an empty limit still
    /// sends the heartbeat and learns the fleet's size.
    fn exchange(
        &self,
        l: &mut Link,
        g: &GlobalRate,
        w: u64,
        deltas: &[Delta],
    ) -> Result<(), String> {
        let interval = g.interval_ms();
        let prefix = &self.cfg.key_prefix;
        let node_ttl = (self.cfg.sync_interval.as_millis() as u64 * 4)
            .max(1000)
            .max(self.cfg.timeout.as_millis() as u64 * 2);
        let chunks: Vec<&[Delta]> = if deltas.is_empty() {
            vec![&[]]
        } else {
            deltas.chunks(BATCH).collect()
        };
        let mut name = Vec::new();
        for chunk in chunks {
            let mut cmd = redis::cmd("EVALSHA");
            cmd.arg(&l.sha).arg(chunk.len());
            for d in chunk {
                name.clear();
                name.extend_from_slice(prefix.as_bytes());
                name.extend_from_slice(b":rl:");
                name.extend_from_slice(g.name().as_bytes());
                name.push(b':');
                name.extend_from_slice(&d.key);
                cmd.arg(&name[..]);
            }
            cmd.arg(w)
                .arg(interval * 2 + 1000)
                .arg(unix_ms())
                .arg(node_ttl)
                .arg(format!("{prefix}:nodes"))
                .arg(&self.node);
            for d in chunk {
                cmd.arg(d.curr).arg(d.prev);
            }
            let out: Vec<u64> = cmd.query(&mut l.con).map_err(|e| e.to_string())?;
            if out.len() != 1 + 2 * chunk.len() {
                return Err(format!("script answered {} values", out.len()));
            }
            let totals: Vec<Totals> = out[1..]
                .chunks(2)
                .map(|p| Totals {
                    prev: p[0],
                    curr: p[1],
                })
                .collect();
            g.apply(w, chunk, &totals, out[0], pier_limits::clock::now_ms());
        }
        Ok(())
    }

    fn connect(&self) -> Result<Link, String> {
        let mut con = self.target.connect()?;
        // Loaded on every new connection: a restarted Redis has forgotten it.
        let sha: String = redis::cmd("SCRIPT")
            .arg("LOAD")
            .arg(SCRIPT)
            .query(&mut con)
            .map_err(|e| format!("redis: SCRIPT LOAD: {e}"))?;
        Ok(Link { con, sha })
    }
}
