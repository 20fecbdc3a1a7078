//! [`GlobalRate`]: a rate limit counted across a fleet of nodes through a
//! shared store (Redis, in `pier-fleet`), without a round trip per request.
//!
//! Each node decides every request from memory. Per key it holds the
//! fleet's counts for the current and previous window as of its last
//! exchange with the store (the *snapshot*), plus its own admissions since
//! then. Every `sync_interval` a sync thread sends each key's new
//! admissions, which the store adds to the fleet's counts in one script
//! per batch, and brings back the new totals and the number of nodes alive
//! in the fleet (`N`, from each node's heartbeat in the same script).
//!
//! ```text
//!   request ──▶ local sketch (RateLimiter, the same rate) ──deny──▶ 429
//!                  │ allow
//!                  ▼
//!   snapshot(prev, curr) + N × own admissions since the snapshot < limit ?  ──no──▶ 429
//!                  │ yes: own += 1
//!   sync thread, every sync_interval:  own ──INCRBY──▶ store ──totals, N──▶ snapshot
//! ```
//!
//! # Why `N ×` own admissions
//! Between two exchanges a node cannot see what the others admit. It
//! assumes each of the N − 1 others admitted as many as it did: exact when
//! traffic is spread evenly over the nodes (what a load balancer in front
//! does), and on the safe side when it is not (a node with all the
//! traffic takes a 1/N share of the room left each interval, and so fills
//! the limit geometrically: 1 − (1 − 1/N)^k of it after k exchanges).
//! Without that factor N nodes that see the same snapshot would each admit
//! the whole room left, and the fleet N times the rate.
//!
//! # Error
//! With traffic spread evenly, the fleet admits within the limit plus
//! what the nodes admit in one exchange's flight (`N × rate × RTT`), and
//! up to N − 1 requests of rounding. `global_limit_error` runs a simulated
//! fleet (fake store, injected clock) of 3 nodes at 100/s for 10 s, 15
//! times the rate offered: 1,063 admitted spread evenly or skewed 10:3:1,
//! 928 all on one node, 1,123 with exchanges every 250 ms; a sliding
//! window alone admits about 1,000, and 3 unshared ones 3,000. The
//! sliding count assumes the previous window's requests were spread evenly
//! over it, as [`crate::RateLimiter`] does. Windows are numbered on the
//! wall clock (`unix ms / interval`), so nodes on different machines need
//! clocks in step (NTP) to the precision they want from the limit.
//!
//! # When the store is out of reach
//! A snapshot older than `stale_after` (no successful exchange) makes the
//! limit *unavailable*: fail-open decides on the node's own counts alone
//! (its local sketch, so each node admits up to the rate); fail-closed
//! refuses. Both are counted. Admissions made meanwhile are kept (those of
//! the last two windows) and sent once the store answers again.
//!
//! # Bounds
//! At most `max_keys` keys per limit and process (a key idle for two
//! windows is dropped at the next exchange); a new key past that is
//! decided by the local sketch alone, counted as an overflow.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError, Weak};
use std::time::{SystemTime, UNIX_EPOCH};

use crate::limiter::{Decision, RateLimit};

const SHARDS: usize = 16;

/// Keys are spread over shards so workers rarely wait on one another.
type Shard = Mutex<HashMap<Box<[u8]>, Entry, foldhash::fast::RandomState>>;

/// Keys kept per limit and process by default.
pub const DEFAULT_MAX_KEYS: usize = 65_536;

/// One key's state on this node.
#[derive(Debug, Default, Clone)]
struct Entry {
    /// Window of the snapshot, and the fleet's counts then.
    snap_w: u64,
    snap_prev: u64,
    snap_curr: u64,
    /// This node's admissions not yet sent, per window (`[w & 1]`).
    own: [(u64, u64); 2],
    /// Sent, answer not back yet.
    sent: [(u64, u64); 2],
    /// The last window a request or an exchange touched the key.
    seen_w: u64,
}

impl Entry {
    fn mine(&self, w: u64) -> u64 {
        let s = (w & 1) as usize;
        let o = if self.own[s].0 == w { self.own[s].1 } else { 0 };
        let t = if self.sent[s].0 == w {
            self.sent[s].1
        } else {
            0
        };
        o + t
    }

    fn add_own(&mut self, w: u64, n: u64) {
        let s = (w & 1) as usize;
        if self.own[s].0 != w {
            // A window two back: it no longer counts anywhere.
            self.own[s] = (w, 0);
        }
        self.own[s].1 += n;
    }
}

/// One key's change for the store: this node's admissions in window `w`
/// and `w - 1` since the last exchange (either may be 0: the exchange then
/// only reads the fleet's counts).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Delta {
    /// The limit key (as the proxy built it).
    pub key: Box<[u8]>,
    /// Admissions in window `w`.
    pub curr: u64,
    /// Admissions in window `w - 1`.
    pub prev: u64,
}

/// The store's answer for one key: the fleet's counts in `w - 1` and `w`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Totals {
    /// The fleet's count in window `w - 1`.
    pub prev: u64,
    /// The fleet's count in window `w`.
    pub curr: u64,
}

/// A rate limit whose counts are shared through a store (module docs).
pub struct GlobalRate {
    name: String,
    limit: u64,
    interval_ms: u64,
    dry_run: bool,
    fail_closed: bool,
    stale_after_ms: u64,
    max_keys_per_shard: usize,
    /// Wall-clock milliseconds minus [`crate::clock::now_ms`]: windows are
    /// numbered on the wall clock, the same on every node.
    unix_offset: u64,
    shards: [Shard; SHARDS],
    hasher: foldhash::fast::RandomState,
    /// Monotonic ms of the last successful exchange (creation to start).
    last_ok_ms: AtomicU64,
    nodes: AtomicU64,
    stats: GlobalStats,
}

/// Counters of a [`GlobalRate`].
#[derive(Debug, Default)]
pub struct GlobalStats {
    /// Requests the fleet's count refused (or, in dry run, would have).
    pub denied: AtomicU64,
    /// Requests decided while the store was out of reach.
    pub unavailable: AtomicU64,
    /// Requests of new keys past `max_keys`, decided locally.
    pub overflow: AtomicU64,
    /// Exchanges with the store that succeeded.
    pub syncs: AtomicU64,
    /// Exchanges that failed (or rounds the store could not be reached).
    pub sync_errors: AtomicU64,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

impl GlobalRate {
    /// A global limit named `name` (the store's keys are named after it)
    /// for `cfg`; unavailable after `stale_after_ms` without an exchange.
    pub fn new(
        name: &str,
        cfg: RateLimit,
        fail_closed: bool,
        stale_after_ms: u64,
        max_keys: usize,
        now_ms: u64,
    ) -> Self {
        let unix = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_millis() as u64)
            .unwrap_or(0);
        Self {
            name: name.to_string(),
            limit: cfg.limit(),
            interval_ms: cfg.interval_ms(),
            dry_run: cfg.dry_run,
            fail_closed,
            stale_after_ms,
            max_keys_per_shard: max_keys.div_ceil(SHARDS).max(1),
            unix_offset: unix.saturating_sub(now_ms),
            shards: std::array::from_fn(|_| Mutex::new(HashMap::default())),
            hasher: foldhash::fast::RandomState::default(),
            last_ok_ms: AtomicU64::new(now_ms),
            nodes: AtomicU64::new(1),
            stats: GlobalStats::default(),
        }
    }

    /// The limit's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The counting interval (1 s, or 60 s under 1 request per second).
    pub fn interval_ms(&self) -> u64 {
        self.interval_ms
    }

    /// The counters.
    pub fn stats(&self) -> &GlobalStats {
        &self.stats
    }

    /// Nodes that counted for this limit, as of the last exchange.
    pub fn nodes(&self) -> u64 {
        self.nodes.load(Relaxed)
    }

    /// Keys held.
    pub fn keys(&self) -> usize {
        self.shards.iter().map(|s| lock(s).len()).sum()
    }

    /// Whether the last exchange is recent enough to decide on.
    pub fn available(&self, now_ms: u64) -> bool {
        now_ms.saturating_sub(self.last_ok_ms.load(Relaxed)) <= self.stale_after_ms
    }

    /// The window `now_ms` (monotonic, [`crate::clock::now_ms`]) falls in,
    /// and how far into it, on the wall clock.
    pub fn window(&self, now_ms: u64) -> (u64, u64) {
        let t = now_ms + self.unix_offset;
        (t / self.interval_ms, t % self.interval_ms)
    }

    fn shard(&self, key: &[u8]) -> &Shard {
        use std::hash::BuildHasher;
        &self.shards[(self.hasher.hash_one(key) as usize) % SHARDS]
    }

    /// Decide one request for `key` (already allowed by the local sketch)
    /// at `now_ms`, the request's clock snapshot.
    pub fn check(&self, key: &[u8], now_ms: u64) -> Decision {
        let available = self.available(now_ms);
        if !available {
            self.stats.unavailable.fetch_add(1, Relaxed);
            if self.fail_closed {
                return self.deny(1);
            }
        }
        let (w, elapsed) = self.window(now_ms);
        let n = self.nodes.load(Relaxed).max(1);
        let mut shard = lock(self.shard(key));
        if shard.len() >= self.max_keys_per_shard && !shard.contains_key(key) {
            self.stats.overflow.fetch_add(1, Relaxed);
            return Decision::Allow;
        }
        let e = match shard.get_mut(key) {
            Some(e) => e,
            None => shard.entry(key.into()).or_default(),
        };
        e.seen_w = w;
        if !available {
            // Fail-open: the local sketch decided; the admission is still
            // sent once the store answers.
            e.add_own(w, 1);
            return Decision::Allow;
        }
        let (rp, rc) = if e.snap_w == w {
            (e.snap_prev, e.snap_curr)
        } else if e.snap_w + 1 == w {
            (e.snap_curr, 0)
        } else {
            (0, 0)
        };
        let prev = rp + n * e.mine(w.wrapping_sub(1));
        let curr = rc + n * e.mine(w);
        // As RateLimiter: the sliding count before this request, scaled by
        // the interval, compared in integers.
        let i = u128::from(self.interval_ms);
        let left = u128::from(self.interval_ms - 1 - elapsed);
        let before = u128::from(prev) * left + u128::from(curr) * i;
        if before < u128::from(self.limit) * i {
            e.add_own(w, 1);
            return Decision::Allow;
        }
        drop(shard);
        // The current window's count starts to fall once it becomes the
        // previous one.
        self.deny(((self.interval_ms - elapsed).div_ceil(1000)).max(1) as u32)
    }

    fn deny(&self, retry_after_secs: u32) -> Decision {
        self.stats.denied.fetch_add(1, Relaxed);
        if self.dry_run {
            Decision::DryRunDeny { retry_after_secs }
        } else {
            Decision::Deny { retry_after_secs }
        }
    }

    /// For the sync thread: the window the exchange is for, and the keys to
    /// send, with this node's admissions since the last exchange (moved to
    /// "sent"). A key goes when it has admissions to send; a key without
    /// any but asked for in this window or the last (refused here, say) goes
    /// only when `refresh_idle`, to learn the others' counts. At most `max`
    /// keys go; the rest keep their admissions for the next exchange. Keys
    /// idle for two windows are dropped. Returns the window.
    ///
    /// Why not every key every time: a flood of distinct keys, each asked
    /// once, would otherwise cost Redis one read per key per exchange for
    /// two windows (40 reads each at 1 s windows and 50 ms exchanges).
    pub fn take(&self, now_ms: u64, refresh_idle: bool, max: usize, out: &mut Vec<Delta>) -> u64 {
        let (w, _) = self.window(now_ms);
        let prev = w.wrapping_sub(1);
        for s in &self.shards {
            let mut shard = lock(s);
            shard.retain(|key, e| {
                let owes = e
                    .own
                    .iter()
                    .any(|&(win, n)| n > 0 && (win == w || win == prev));
                if e.seen_w + 1 < w && !owes && e.mine(w) == 0 && e.mine(prev) == 0 {
                    return false;
                }
                if out.len() >= max || !(owes || (refresh_idle && e.seen_w + 1 >= w)) {
                    return true;
                }
                let mut d = Delta {
                    key: key.clone(),
                    curr: 0,
                    prev: 0,
                };
                for win in [w, prev] {
                    let slot = (win & 1) as usize;
                    let n = if e.own[slot].0 == win {
                        e.own[slot].1
                    } else {
                        0
                    };
                    e.own[slot] = (win, 0);
                    // A previous send that never came back was given back
                    // by `failed`; whatever is in `sent` now is replaced.
                    e.sent[slot] = (win, n);
                    if win == w {
                        d.curr = n;
                    } else {
                        d.prev = n;
                    }
                }
                out.push(d);
                true
            });
        }
        w
    }

    /// The store's answer to the last [`GlobalRate::take`] for window `w`:
    /// `totals[i]` for `deltas[i]`, and the number of nodes counting.
    pub fn apply(&self, w: u64, deltas: &[Delta], totals: &[Totals], nodes: u64, now_ms: u64) {
        for (d, t) in deltas.iter().zip(totals) {
            let mut shard = lock(self.shard(&d.key));
            if let Some(e) = shard.get_mut(&d.key) {
                // A newer snapshot never goes back to an older window.
                if e.snap_w <= w {
                    e.snap_w = w;
                    e.snap_prev = t.prev;
                    e.snap_curr = t.curr;
                }
                e.sent = [(0, 0); 2];
            }
        }
        self.nodes.store(nodes.max(1), Relaxed);
        self.last_ok_ms.store(now_ms, Relaxed);
        self.stats.syncs.fetch_add(1, Relaxed);
    }

    /// The exchange for `deltas` failed: its admissions go back to the
    /// unsent ones (the store may have counted them already; counting them
    /// twice refuses a little early, dropping them would admit a little
    /// more — the first errs on the limit's side).
    pub fn failed(&self, deltas: &[Delta]) {
        for d in deltas {
            let mut shard = lock(self.shard(&d.key));
            if let Some(e) = shard.get_mut(&d.key) {
                for slot in 0..2 {
                    let (win, n) = e.sent[slot];
                    if n > 0 {
                        e.add_own(win, n);
                    }
                }
                e.sent = [(0, 0); 2];
            }
        }
        self.stats.sync_errors.fetch_add(1, Relaxed);
    }

    /// Makes this limit known to the sync thread ([`registered`]).
    pub fn register(self: &Arc<Self>) {
        let mut r = lock(&REGISTRY);
        r.retain(|w| w.strong_count() > 0);
        r.push(Arc::downgrade(self));
    }
}

static REGISTRY: Mutex<Vec<Weak<GlobalRate>>> = Mutex::new(Vec::new());

/// The global limits alive in this process (a reload drops the old ones).
pub fn registered() -> Vec<Arc<GlobalRate>> {
    let mut r = lock(&REGISTRY);
    r.retain(|w| w.strong_count() > 0);
    r.iter().filter_map(Weak::upgrade).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The store as the Redis script keeps it: count per (key, window),
    /// and the nodes that sent something.
    #[derive(Default)]
    struct FakeStore {
        counts: HashMap<(Vec<u8>, u64), u64>,
        /// Node -> the time of its last exchange.
        nodes: HashMap<usize, u64>,
        node_ttl: u64,
    }

    impl FakeStore {
        /// As the script: counts, and the nodes seen in the last
        /// `node_ttl` ms.
        fn exchange(
            &mut self,
            node: usize,
            t: u64,
            w: u64,
            deltas: &[Delta],
        ) -> (u64, Vec<Totals>) {
            self.nodes.insert(node, t);
            let live = self
                .nodes
                .values()
                .filter(|&&s| s + self.node_ttl >= t)
                .count() as u64;
            let totals = deltas
                .iter()
                .map(|d| {
                    let c = self.counts.entry((d.key.to_vec(), w)).or_default();
                    *c += d.curr;
                    let curr = *c;
                    let p = self.counts.entry((d.key.to_vec(), w - 1)).or_default();
                    *p += d.prev;
                    Totals { prev: *p, curr }
                })
                .collect();
            (live, totals)
        }
    }

    fn node(rate: u32, fail_closed: bool) -> GlobalRate {
        let mut g = GlobalRate::new(
            "t",
            RateLimit::per_second(rate),
            fail_closed,
            600,
            DEFAULT_MAX_KEYS,
            0,
        );
        // Windows start at 0 for the simulation.
        g.unix_offset = 0;
        g
    }

    /// Runs `nodes` nodes for `ms` of simulated time: `offered[i]`
    /// requests per ms to node i, an exchange every `sync_ms` (staggered
    /// per node), answers delayed by `rtt_ms`. Returns requests admitted.
    fn simulate(rate: u32, offered: &[u64], sync_ms: u64, rtt_ms: u64, ms: u64) -> u64 {
        let nodes: Vec<GlobalRate> = offered.iter().map(|_| node(rate, false)).collect();
        let mut store = FakeStore {
            node_ttl: 4 * sync_ms,
            ..FakeStore::default()
        };
        // Per node, an answer on its way: (due, window, deltas, totals, nodes).
        type Answer = (u64, u64, Vec<Delta>, Vec<Totals>, u64);
        let mut pending: Vec<Option<Answer>> = offered.iter().map(|_| None).collect();
        let mut admitted = 0;
        // Exchanges start before the traffic, as the sync thread's do (its
        // heartbeat tells each node the fleet's size).
        for t in 1..1_000 + ms {
            for (i, g) in nodes.iter().enumerate() {
                for _ in 0..if t >= 1_000 { offered[i] } else { 0 } {
                    if g.check(b"k", t) == Decision::Allow {
                        admitted += 1;
                    }
                }
                if let Some((due, w, d, tot, live)) = pending[i].take() {
                    if due == t {
                        g.apply(w, &d, &tot, live, t);
                    } else {
                        pending[i] = Some((due, w, d, tot, live));
                    }
                }
                if pending[i].is_none() && (t + i as u64 * 7).is_multiple_of(sync_ms) {
                    let mut d = Vec::new();
                    let w = g.take(t, (t / sync_ms).is_multiple_of(4), usize::MAX, &mut d);
                    let (live, tot) = store.exchange(i, t, w, &d);
                    pending[i] = Some((t + rtt_ms.max(1), w, d, tot, live));
                }
            }
        }
        admitted
    }

    #[test]
    fn global_limit_error() {
        // 3 nodes, 100/s, 10 s, far more offered than the limit.
        let even = simulate(100, &[5, 5, 5], 50, 2, 10_000);
        // A sliding window admits about rate x seconds, plus the first
        // window's full count.
        assert!((1_000..=1_150).contains(&even), "even: {even}");
        // All traffic on one node: still held to the rate.
        let one = simulate(100, &[15, 0, 0], 50, 2, 10_000);
        assert!((850..=1_150).contains(&one), "one node: {one}");
        // Uneven spread.
        let skew = simulate(100, &[10, 3, 1], 50, 2, 10_000);
        assert!((950..=1_150).contains(&skew), "skewed: {skew}");
        // Slow exchanges (250 ms) stay within a documented error too.
        let slow = simulate(100, &[5, 5, 5], 250, 20, 10_000);
        assert!((950..=1_250).contains(&slow), "slow: {slow}");
        // Without the store, each node would admit the rate on its own:
        // three times as much. The fleet's count is what holds it.
        assert!(even * 2 < 3 * 1_000);
    }

    #[test]
    fn unavailable_store_fails_open_or_closed() {
        for closed in [false, true] {
            let g = node(1, closed);
            // The limit is fresh for `stale_after` from creation.
            assert_eq!(g.check(b"k", 100), Decision::Allow);
            let d = g.check(b"k", 1_000);
            assert_eq!(d.is_allowed(), !closed, "closed={closed}");
            assert_eq!(g.stats().unavailable.load(Relaxed), 1);
            // An exchange brings it back: the admission made while cut
            // off is still sent, and the fleet's count decides again.
            let mut deltas = Vec::new();
            let w = g.take(1_001, true, usize::MAX, &mut deltas);
            assert_eq!(deltas.len(), 1);
            let sent: u64 = deltas.iter().map(|d| d.curr + d.prev).sum();
            assert_eq!(sent, 1 + u64::from(!closed));
            g.apply(w, &deltas, &[Totals { prev: 0, curr: 5 }], 1, 1_001);
            assert!(!g.check(b"k", 1_002).is_allowed());
        }
    }

    #[test]
    fn failed_exchanges_keep_the_admissions() {
        let g = node(10, false);
        for _ in 0..3 {
            assert!(g.check(b"k", 5).is_allowed());
        }
        let mut d = Vec::new();
        g.take(6, true, usize::MAX, &mut d);
        assert_eq!((d[0].curr, d[0].prev), (3, 0));
        // In flight: still counted.
        for _ in 0..7 {
            assert!(g.check(b"k", 7).is_allowed());
        }
        assert!(!g.check(b"k", 7).is_allowed());
        g.failed(&d);
        let mut d2 = Vec::new();
        g.take(8, true, usize::MAX, &mut d2);
        assert_eq!(d2[0].curr, 10);
        assert_eq!(g.stats().sync_errors.load(Relaxed), 1);
    }

    #[test]
    fn idle_keys_are_dropped_and_keys_are_bounded() {
        let mut g = node(10, false);
        g.max_keys_per_shard = 1;
        let mut admitted_new = 0;
        for i in 0..100u32 {
            if g.check(&i.to_be_bytes(), 10).is_allowed() {
                admitted_new += 1;
            }
        }
        assert_eq!(admitted_new, 100);
        assert!(g.keys() <= SHARDS);
        assert!(g.stats().overflow.load(Relaxed) >= 100 - SHARDS as u64);
        let mut d = Vec::new();
        g.take(20, true, usize::MAX, &mut d);
        g.apply(0, &d, &vec![Totals { prev: 0, curr: 1 }; d.len()], 1, 20);
        // Two windows later, untouched keys go.
        let mut d = Vec::new();
        g.take(3_000, true, usize::MAX, &mut d);
        assert_eq!(g.keys(), 0, "{d:?}");
    }

    #[test]
    fn idle_keys_are_read_only_on_refresh_rounds_and_rounds_are_bounded() {
        let g = node(10, false);
        for i in 0..10u32 {
            assert!(g.check(&i.to_be_bytes(), 10).is_allowed());
        }
        let mut d = Vec::new();
        // At most 4 a round; the others keep their admissions.
        g.take(11, false, 4, &mut d);
        assert_eq!(d.len(), 4);
        let mut rest = Vec::new();
        g.take(12, false, usize::MAX, &mut rest);
        assert_eq!(rest.len(), 6);
        assert!(rest.iter().all(|x| x.curr == 1));
        // Nothing owed: an ordinary round sends nothing, a refresh round
        // reads every key asked for lately.
        g.apply(0, &d, &vec![Totals { prev: 0, curr: 1 }; d.len()], 1, 12);
        g.apply(
            0,
            &rest,
            &vec![Totals { prev: 0, curr: 1 }; rest.len()],
            1,
            12,
        );
        let mut none = Vec::new();
        g.take(13, false, usize::MAX, &mut none);
        assert!(none.is_empty());
        g.take(14, true, usize::MAX, &mut none);
        assert_eq!(none.len(), 10);
        assert!(none.iter().all(|x| x.curr == 0 && x.prev == 0));
    }

    #[test]
    fn registry_forgets_dropped_limits() {
        let named = || {
            registered()
                .iter()
                .filter(|g| g.name() == "registry-test")
                .count()
        };
        let a = Arc::new(GlobalRate::new(
            "registry-test",
            RateLimit::per_second(1),
            false,
            1,
            1,
            0,
        ));
        a.register();
        assert_eq!(named(), 1);
        drop(a);
        assert_eq!(named(), 0);
    }
}
