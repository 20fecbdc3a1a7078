//! A fleet of Piers sharing one Redis (`[redis]`): a purge or ban made on
//! any node (the admin API) is published on a pub/sub channel, and every
//! node subscribed to it applies the same purge to its own cache.
//!
//! ```text
//!   admin API ──purge──▶ node 1 ──PUBLISH pier:purge──▶ Redis ──▶ node 2, node 3 (SUBSCRIBE)
//!                          │ (applied here at once)               └─ each applies it locally
//!                          └── answer: {"purged": n, "nodes": N}  (N: subscribers that got it)
//! ```
//!
//! One thread per process keeps the subscription (reconnecting with
//! backoff when Redis goes away); publishing is a command on a connection
//! kept for it, made on the caller's blocking thread. Workers never touch
//! Redis. A node skips its own messages (it applied the purge already).
//! `PUBLISH`'s answer, the number of subscribers that received the message
//! (this node's own subscription included), is the acknowledgement count
//! the API returns: Redis delivers to a live subscription or reports it
//! absent, so a node that was disconnected is not counted.

pub mod limits;
mod target;
pub use limits::start_limits;

use parking_lot::Mutex;
use pier_config::Redis;
use serde::{Deserialize, Serialize};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

/// A purge as it travels: the zone (None: every zone) and what to purge,
/// (`url` | `prefix` | `tag` | `key` | `ban`, value) pairs, as the admin
/// API takes.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Purge {
    pub zone: Option<String>,
    pub asks: Vec<(String, String)>,
}

/// A message on the channel.
#[derive(Debug, Serialize, Deserialize)]
struct Message {
    /// The node that published it (a random id per process).
    from: String,
    purge: Purge,
}

/// Messages larger than this, or with more asks, are dropped (counted):
/// the API takes at most 1000 asks a request.
const MAX_MESSAGE: usize = 1 << 20;
pub const MAX_ASKS: usize = 1000;
const SOON_QUEUE: usize = 1024;
const BACKOFF_MIN: Duration = Duration::from_millis(100);
const BACKOFF_MAX: Duration = Duration::from_secs(5);

/// What a node does with a purge another node published.
pub type Apply = Box<dyn Fn(&Purge) -> usize + Send + Sync>;

pub struct Fleet {
    cfg: Redis,
    node: String,
    target: target::Target,
    publisher: Mutex<Option<redis::Connection>>,
    /// Purges to publish from a thread that must not wait (Lua's).
    soon: Mutex<Option<std::sync::mpsc::SyncSender<Purge>>>,
    stop: AtomicBool,
    stats: Stats,
}

#[derive(Default)]
struct Stats {
    published: AtomicU64,
    publish_failed: AtomicU64,
    received: AtomicU64,
    malformed: AtomicU64,
    /// Objects removed by purges from other nodes.
    purged_objects: AtomicU64,
    connected: AtomicBool,
    reconnects: AtomicU64,
}

static FLEET: OnceLock<Arc<Fleet>> = OnceLock::new();

/// The process's fleet, once [`start`] ran with a `[redis]` table.
pub fn get() -> Option<&'static Arc<Fleet>> {
    FLEET.get()
}

/// Starts the subscription thread for `cfg` (once per process; a later
/// call returns the running fleet: `[redis]` is read at start).
pub fn start(cfg: &Redis, apply: Apply) -> Result<Arc<Fleet>, String> {
    if let Some(f) = FLEET.get() {
        return Ok(f.clone());
    }
    let target = target::Target::new(cfg)?;
    let node = format!("{:016x}", rand::random::<u64>());
    let fleet = Arc::new(Fleet {
        cfg: cfg.clone(),
        node,
        target,
        publisher: Mutex::new(None),
        soon: Mutex::new(None),
        stop: AtomicBool::new(false),
        stats: Stats::default(),
    });
    let f = FLEET.get_or_init(|| fleet).clone();
    // Purges queued by workers (Lua), published in order on a thread of
    // their own; bounded: past SOON_QUEUE waiting, one is dropped (counted).
    let (tx, rx) = std::sync::mpsc::sync_channel::<Purge>(SOON_QUEUE);
    *f.soon.lock() = Some(tx);
    let publ = f.clone();
    std::thread::Builder::new()
        .name("pier-fleet-pub".into())
        .spawn(move || {
            for p in rx {
                if let Err(e) = publ.publish(&p) {
                    tracing::warn!("fleet: purge not published: {e}");
                }
            }
        })
        .map_err(|e| format!("fleet thread: {e}"))?;
    let sub = f.clone();
    std::thread::Builder::new()
        .name("pier-fleet".into())
        .spawn(move || sub.subscribe_loop(apply))
        .map_err(|e| format!("fleet thread: {e}"))?;
    Ok(f)
}

impl Fleet {
    /// Publishes `p` to the other nodes: the number of subscribed nodes
    /// that received it (this one included), or why it was not sent.
    /// Blocks for up to `[redis] timeout` (twice when a kept connection
    /// turns out dead): call it off the workers.
    pub fn publish(&self, p: &Purge) -> Result<u64, String> {
        let msg = serde_json::to_vec(&Message {
            from: self.node.clone(),
            purge: p.clone(),
        })
        .map_err(|e| e.to_string())?;
        let mut slot = self.publisher.lock();
        // A kept connection may have died since; one retry on a new one.
        for attempt in 0..2 {
            if slot.is_none() {
                match self.connect() {
                    Ok(c) => *slot = Some(c),
                    Err(e) => {
                        self.stats.publish_failed.fetch_add(1, Relaxed);
                        return Err(e);
                    }
                }
            }
            let Some(con) = slot.as_mut() else { continue };
            match redis::cmd("PUBLISH")
                .arg(&self.cfg.channel)
                .arg(&msg)
                .query::<u64>(con)
            {
                Ok(n) => {
                    self.stats.published.fetch_add(1, Relaxed);
                    return Ok(n);
                }
                Err(e) => {
                    *slot = None;
                    if attempt == 1 {
                        self.stats.publish_failed.fetch_add(1, Relaxed);
                        return Err(format!("redis: {e}"));
                    }
                }
            }
        }
        self.stats.publish_failed.fetch_add(1, Relaxed);
        Err("redis: not connected".into())
    }

    fn connect(&self) -> Result<redis::Connection, String> {
        self.target.connect()
    }

    /// Queues `p` for publishing without waiting (a worker's caller);
    /// false when the queue is full (counted as a failed publish).
    pub fn publish_soon(&self, p: Purge) -> bool {
        let queued = self
            .soon
            .lock()
            .as_ref()
            .is_some_and(|tx| tx.try_send(p).is_ok());
        if !queued {
            self.stats.publish_failed.fetch_add(1, Relaxed);
        }
        queued
    }

    /// Ends the subscription thread (within a second).
    pub fn stop(&self) {
        self.stop.store(true, Relaxed);
    }

    fn subscribe_loop(&self, apply: Apply) {
        let mut backoff = BACKOFF_MIN;
        while !self.stop.load(Relaxed) {
            match self.subscribed(&apply) {
                // Stopped.
                Ok(()) => return,
                Err(e) => {
                    // A subscription that was up starts the backoff over.
                    if self.stats.connected.swap(false, Relaxed) {
                        tracing::warn!("fleet: lost Redis ({e}); reconnecting");
                        backoff = BACKOFF_MIN;
                    }
                    self.stats.reconnects.fetch_add(1, Relaxed);
                }
            }
            std::thread::sleep(backoff);
            backoff = (backoff * 2).min(BACKOFF_MAX);
        }
    }

    /// One subscription, until Redis fails (Err) or the fleet stops (Ok).
    fn subscribed(&self, apply: &Apply) -> Result<(), String> {
        let mut con = self.connect()?;
        let mut ps = con.as_pubsub();
        ps.subscribe(&self.cfg.channel)
            .map_err(|e| format!("subscribe: {e}"))?;
        // Wake up every second to notice a stop.
        ps.set_read_timeout(Some(Duration::from_secs(1)))
            .map_err(|e| e.to_string())?;
        self.stats.connected.store(true, Relaxed);
        tracing::info!("fleet: subscribed to {}", self.cfg.channel);
        while !self.stop.load(Relaxed) {
            let msg = match ps.get_message() {
                Ok(m) => m,
                Err(e) if e.is_timeout() => continue,
                Err(e) => return Err(e.to_string()),
            };
            self.handle(msg.get_payload_bytes(), apply);
        }
        Ok(())
    }

    /// A message from the channel: anyone who can publish there can send
    /// anything, so it is checked before use.
    fn handle(&self, payload: &[u8], apply: &Apply) {
        self.stats.received.fetch_add(1, Relaxed);
        let m: Message = match (payload.len() <= MAX_MESSAGE)
            .then(|| serde_json::from_slice(payload).ok())
            .flatten()
        {
            Some(m) => m,
            None => {
                self.stats.malformed.fetch_add(1, Relaxed);
                return;
            }
        };
        if m.from == self.node {
            return;
        }
        let valid = !m.purge.asks.is_empty()
            && m.purge.asks.len() <= MAX_ASKS
            && m.purge.asks.iter().all(|(what, v)| {
                matches!(what.as_str(), "url" | "prefix" | "tag" | "key" | "ban") && !v.is_empty()
            });
        if !valid {
            self.stats.malformed.fetch_add(1, Relaxed);
            return;
        }
        let n = apply(&m.purge);
        self.stats.purged_objects.fetch_add(n as u64, Relaxed);
    }

    /// This process's id in the fleet (random per start).
    pub fn node(&self) -> &str {
        &self.node
    }

    /// True while the subscription is up.
    pub fn connected(&self) -> bool {
        self.stats.connected.load(Relaxed)
    }

    /// `pier_fleet_*` metrics.
    pub fn render(&self, out: &mut String) {
        use std::fmt::Write;
        let s = &self.stats;
        let _ = write!(
            out,
            "# HELP pier_fleet_purges_total Fleet purges: published by this node, failed to publish, received from the channel, malformed (dropped).\n# TYPE pier_fleet_purges_total counter\npier_fleet_purges_total{{result=\"published\"}} {}\npier_fleet_purges_total{{result=\"publish_failed\"}} {}\npier_fleet_purges_total{{result=\"received\"}} {}\npier_fleet_purges_total{{result=\"malformed\"}} {}\n# HELP pier_fleet_purged_objects_total Cached objects removed by purges other nodes published.\n# TYPE pier_fleet_purged_objects_total counter\npier_fleet_purged_objects_total {}\n# HELP pier_fleet_redis_connected 1 while the subscription to the fleet's Redis is up.\n# TYPE pier_fleet_redis_connected gauge\npier_fleet_redis_connected {}\n# HELP pier_fleet_redis_reconnects_total Subscriptions lost or refused, each followed by a retry.\n# TYPE pier_fleet_redis_reconnects_total counter\npier_fleet_redis_reconnects_total {}\n",
            s.published.load(Relaxed),
            s.publish_failed.load(Relaxed),
            s.received.load(Relaxed),
            s.malformed.load(Relaxed),
            s.purged_objects.load(Relaxed),
            s.connected.load(Relaxed) as u8,
            s.reconnects.load(Relaxed),
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicUsize;

    fn fleet() -> Fleet {
        let cfg = Redis {
            url: "redis://127.0.0.1:9".into(),
            channel: "c".into(),
            timeout: Duration::from_millis(200),
            sync_interval: Duration::from_millis(50),
            key_prefix: "pier".into(),
            sentinels: Vec::new(),
            master_name: String::new(),
        };
        Fleet {
            target: target::Target::new(&cfg).unwrap(),
            cfg,
            node: "self".into(),
            publisher: Mutex::new(None),
            soon: Mutex::new(None),
            stop: AtomicBool::new(false),
            stats: Stats::default(),
        }
    }

    #[test]
    fn messages_are_checked_and_own_ones_skipped() {
        let f = fleet();
        let applied = Arc::new(AtomicUsize::new(0));
        let a = applied.clone();
        let apply: Apply = Box::new(move |p| {
            a.fetch_add(p.asks.len(), Relaxed);
            7
        });
        let msg = |from: &str, asks: Vec<(&str, &str)>| {
            serde_json::to_vec(&Message {
                from: from.into(),
                purge: Purge {
                    zone: None,
                    asks: asks
                        .into_iter()
                        .map(|(a, b)| (a.into(), b.into()))
                        .collect(),
                },
            })
            .unwrap()
        };
        f.handle(
            &msg("other", vec![("url", "http://x/a"), ("tag", "t")]),
            &apply,
        );
        assert_eq!(applied.load(Relaxed), 2);
        f.handle(&msg("self", vec![("url", "http://x/a")]), &apply);
        f.handle(&msg("other", vec![("drop", "tables")]), &apply);
        f.handle(&msg("other", vec![("url", "")]), &apply);
        f.handle(&msg("other", vec![]), &apply);
        f.handle(b"\xff not json", &apply);
        f.handle(&vec![b' '; MAX_MESSAGE + 1], &apply);
        assert_eq!(applied.load(Relaxed), 2, "only the first was applied");
        let s = &f.stats;
        assert_eq!(s.received.load(Relaxed), 7);
        assert_eq!(s.malformed.load(Relaxed), 5);
        assert_eq!(s.purged_objects.load(Relaxed), 7);
    }

    #[test]
    fn publishing_without_redis_is_an_error_not_a_hang() {
        let f = fleet();
        let p = Purge {
            zone: None,
            asks: vec![("key".into(), "k".into())],
        };
        let e = f.publish(&p).unwrap_err();
        assert!(e.starts_with("redis"), "{e}");
        assert_eq!(f.stats.publish_failed.load(Relaxed), 1);
    }
}
