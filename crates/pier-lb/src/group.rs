//! An upstream group: its peers, how one is chosen, passive health and the
//! retry budget.

use std::cell::Cell;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use pier_config::{Balance, HashKey, Upstream};

use crate::budget::RetryBudget;
use crate::peer::{ActiveGuard, CachePadded, Peer};
use crate::ring::{key_point, Ring};
use crate::select::{self, Avail, Selector};

/// One upstream group, shared by every worker thread (`Arc<Group>`).
#[derive(Debug)]
pub struct Group {
    name: String,
    peers: Vec<Arc<Peer>>,
    selector: Selector,
    /// Round-robin / weighted schedule position.
    counter: CachePadded<AtomicUsize>,
    budget: RetryBudget,
    max_fails: u32,
    passive_recover_ms: u64,
    /// With an active check, a down peer comes back only through it;
    /// without, through a passive-recovery probe request.
    active_check: bool,
    /// `max_connections_per_server` (0 = unlimited): peers with this many
    /// requests in flight are skipped, as nginx's `max_conns`.
    max_conns: usize,
    cfg: Upstream,
}

impl Group {
    pub fn new(cfg: &Upstream) -> Group {
        let peers = cfg
            .servers
            .iter()
            .map(|s| Arc::new(Peer::new(s.addr, s.weight, s.host.clone())))
            .collect();
        Group::build(cfg, peers)
    }

    /// Build the group for a reloaded config (or a new DNS answer), keeping
    /// the state of servers that did not change (same address, weight and
    /// host name): the very same `Arc<Peer>`, so health, failure streaks and
    /// the in-flight counts of requests still running on `prev` carry over.
    /// A server whose weight or name changed keeps its up/down state. Peers
    /// of `prev` not in `cfg` live on in `prev` (and in the guards of their
    /// requests) until those requests end. The caller stops `prev`'s health
    /// checkers and spawns new ones for this group.
    pub fn reload(cfg: &Upstream, prev: &Group) -> Group {
        let peers = cfg
            .servers
            .iter()
            .map(|s| {
                let old = prev.peers.iter().find(|p| p.addr == s.addr);
                match old {
                    Some(p) if p.weight == s.weight.max(1) && p.host == s.host => p.clone(),
                    Some(p) => {
                        let fresh = Peer::new(s.addr, s.weight, s.host.clone());
                        if !p.is_healthy() {
                            fresh.set_healthy(false);
                            fresh
                                .retry_at_ms
                                .store(p.retry_at_ms.load(Ordering::Acquire), Ordering::Release);
                        }
                        Arc::new(fresh)
                    }
                    None => Arc::new(Peer::new(s.addr, s.weight, s.host.clone())),
                }
            })
            .collect();
        Group::build(cfg, peers)
    }

    fn build(cfg: &Upstream, peers: Vec<Arc<Peer>>) -> Group {
        let selector = match &cfg.balance {
            Balance::RoundRobin => Selector::RoundRobin,
            Balance::WeightedRoundRobin => Selector::Weighted(select::smooth_schedule(
                &peers.iter().map(|p| p.weight).collect::<Vec<_>>(),
            )),
            Balance::LeastConn => Selector::LeastConn,
            Balance::Random2 => {
                let weights: Vec<u32> = peers.iter().map(|p| p.weight).collect();
                let uniform = weights.windows(2).all(|w| w[0] == w[1]);
                Selector::Random2((!uniform).then(|| select::smooth_schedule(&weights)))
            }
            Balance::Hash(_) => Selector::Hash(Ring::new(
                &peers.iter().map(|p| (p.addr, p.weight)).collect::<Vec<_>>(),
            )),
        };
        Group {
            name: cfg.name.clone(),
            peers,
            selector,
            counter: CachePadded(AtomicUsize::new(0)),
            budget: RetryBudget::new(cfg.retry_budget_ratio, cfg.retry_min_per_sec),
            max_fails: cfg.max_fails,
            passive_recover_ms: cfg.passive_recover.as_millis() as u64,
            active_check: cfg.health_check.is_some(),
            max_conns: cfg.max_connections_per_server,
            cfg: cfg.clone(),
        }
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    pub fn peers(&self) -> &[Arc<Peer>] {
        &self.peers
    }

    /// The config this group was built from.
    pub fn config(&self) -> &Upstream {
        &self.cfg
    }

    /// Extra attempts after the first allowed per request (before the budget).
    pub fn retries(&self) -> u32 {
        self.cfg.retries
    }

    /// The key to extract for `Balance::Hash` (see [`crate::extract_hash_key`]).
    pub fn hash_key(&self) -> Option<&HashKey> {
        match &self.cfg.balance {
            Balance::Hash(k) => Some(k),
            _ => None,
        }
    }

    /// Peers currently marked up.
    pub fn healthy_count(&self) -> usize {
        self.peers.iter().filter(|p| p.is_healthy()).count()
    }

    // === selection ===

    /// Pick a healthy peer whose index is not in `tried` (and below
    /// `max_connections_per_server` in flight). `key` is used by
    /// `Balance::Hash` only (`None` hashes to a stable default). `None` when
    /// no peer can take the attempt: the caller answers 503.
    ///
    /// Reads the clock only when it meets a passively-downed peer.
    pub fn select(&self, key: Option<&[u8]>, tried: &[usize]) -> Option<usize> {
        self.pick(key, tried, &Cell::new(0))
    }

    /// [`Group::select`] with the caller's [`crate::clock_ms`] snapshot.
    pub fn select_at(&self, key: Option<&[u8]>, tried: &[usize], now_ms: u64) -> Option<usize> {
        self.pick(key, tried, &Cell::new(now_ms.max(1)))
    }

    /// [`Group::select_at`] with bounded loads on a hash ring (Mirrokni,
    /// Thorup and Zadimoghaddam, "Consistent Hashing with Bounded Loads",
    /// as Vimeo and HAProxy's `hash-balance-factor` use it): a peer whose
    /// requests in flight have reached `factor` times the average over the
    /// healthy peers (this request counted), and at least `floor`, is
    /// passed over for the next one on the ring, so one hot key's owner
    /// does not take the whole load. Keys stay where they are below that.
    /// Other policies: [`Group::select_at`].
    pub fn select_bounded(
        &self,
        key: Option<&[u8]>,
        tried: &[usize],
        now_ms: u64,
        factor: f64,
        floor: usize,
    ) -> Option<usize> {
        let Selector::Hash(ring) = &self.selector else {
            return self.select_at(key, tried, now_ms);
        };
        let now = Cell::new(now_ms.max(1));
        let (mut total, mut up) = (0usize, 0usize);
        for p in &self.peers {
            if p.healthy.load(Ordering::Acquire) {
                total += p.active();
                up += 1;
            }
        }
        let cap = ((factor * (total + 1) as f64 / up.max(1) as f64).ceil() as usize).max(floor);
        let point = key_point(key);
        ring.walk(point, |i| {
            self.peers[i].active() < cap && self.avail(i, tried, &now) != Avail::No
        })
        // Every peer at its bound (threads racing past it): the owner.
        .or_else(|| ring.walk(point, |i| self.avail(i, tried, &now) != Avail::No))
    }

    fn pick(&self, key: Option<&[u8]>, tried: &[usize], now: &Cell<u64>) -> Option<usize> {
        let n = self.peers.len();
        if n == 0 {
            return None;
        }
        let avail = |i: usize| self.avail(i, tried, now);
        match &self.selector {
            Selector::RoundRobin => select::round_robin(n, &self.counter.0, avail),
            Selector::Weighted(schedule) => select::weighted(schedule, n, &self.counter.0, avail),
            Selector::LeastConn => select::least_conn(&self.peers, avail),
            Selector::Random2(schedule) => {
                select::random_two(&self.peers, schedule.as_deref(), avail)
            }
            Selector::Hash(ring) => ring.walk(key_point(key), |i| avail(i) != Avail::No),
        }
    }

    /// After [`Group::select`] found no peer: whether some healthy, untried
    /// peer was passed over only for being at `max_connections_per_server`.
    /// Then the answer is "busy, come back" (503 upstream-limited with
    /// Retry-After), not "no healthy upstream".
    pub fn at_capacity(&self, tried: &[usize]) -> bool {
        self.max_conns != 0
            && self.peers.iter().enumerate().any(|(i, p)| {
                !tried.contains(&i)
                    && p.healthy.load(Ordering::Acquire)
                    && p.active() >= self.max_conns
            })
    }

    fn avail(&self, i: usize, tried: &[usize], now: &Cell<u64>) -> Avail {
        if tried.contains(&i) {
            return Avail::No;
        }
        let p = &self.peers[i];
        // A soft limit: threads selecting at the same instant may each take
        // the last slot, overshooting by at most their number.
        if self.max_conns != 0 && p.active() >= self.max_conns {
            return Avail::No;
        }
        if p.healthy.load(Ordering::Acquire) {
            return Avail::Up;
        }
        if self.active_check || self.max_fails == 0 {
            return Avail::No;
        }
        // Passively down without an active check: let one request through
        // once the recovery delay has passed. Whoever wins the CAS on the
        // deadline sends the probe; the new deadline bounds the wait if the
        // probe's outcome is never reported.
        let at = p.retry_at_ms.load(Ordering::Acquire);
        if now.get() == 0 {
            now.set(crate::clock_ms());
        }
        let t = now.get();
        if t < at {
            return Avail::No;
        }
        match p.retry_at_ms.compare_exchange(
            at,
            t.saturating_add(self.passive_recover_ms),
            Ordering::AcqRel,
            Ordering::Relaxed,
        ) {
            Ok(_) => {
                p.probing.store(true, Ordering::Release);
                Avail::Probe
            }
            Err(_) => Avail::No,
        }
    }

    /// [`Group::begin`], unless the peer is already at its cap: the smaller
    /// of `max_connections_per_server` and `extra_cap` that is set (`0` =
    /// unset). The check and the count are one atomic step, so concurrent
    /// workers never take the last slot twice (`select` alone is a soft,
    /// racy filter).
    pub fn try_begin(&self, idx: usize, extra_cap: usize) -> Option<ActiveGuard> {
        let cap = match (self.max_conns, extra_cap) {
            (0, c) | (c, 0) => c,
            (a, b) => a.min(b),
        };
        ActiveGuard::try_new(self.peers[idx].clone(), idx, cap)
    }

    /// Count a request in flight on peer `idx` until the guard drops
    /// (least_conn and random_two read it; metrics too). Panics on an index
    /// that [`Group::select`] did not return.
    pub fn begin(&self, idx: usize) -> ActiveGuard {
        ActiveGuard::new(self.peers[idx].clone(), idx)
    }

    // === passive health ===

    /// Report an attempt's outcome (`ok = false` for a connect failure,
    /// timeout or protocol error). After `max_fails` consecutive failures the
    /// peer is marked down; without an active check it is let through again
    /// after `passive_recover` (one probe request: success marks it up,
    /// failure keeps it down for another `passive_recover`).
    /// `now_ms` is on the [`crate::clock_ms`] timeline.
    pub fn report(&self, idx: usize, ok: bool, now_ms: u64) {
        let Some(p) = self.peers.get(idx) else {
            return;
        };
        if ok {
            // Load first: the common case writes nothing to a shared line.
            if p.consecutive_fails.load(Ordering::Relaxed) != 0 {
                p.consecutive_fails.store(0, Ordering::Relaxed);
            }
            if p.probing.load(Ordering::Relaxed)
                && p.probing.swap(false, Ordering::AcqRel)
                && !p.healthy.swap(true, Ordering::AcqRel)
            {
                tracing::info!(upstream = %self.name, peer = %p.addr, "peer up: passive recovery probe succeeded");
            }
            return;
        }
        p.fails_total.fetch_add(1, Ordering::Relaxed);
        if self.max_fails == 0 {
            return;
        }
        let fails = p.consecutive_fails.fetch_add(1, Ordering::AcqRel) + 1;
        if !self.active_check && p.probing.swap(false, Ordering::AcqRel) {
            // The probe failed: stay down for another period.
            p.retry_at_ms.store(
                now_ms.saturating_add(self.passive_recover_ms),
                Ordering::Release,
            );
            return;
        }
        if fails >= self.max_fails && p.healthy.load(Ordering::Acquire) {
            if !self.active_check {
                // Deadline first, so a selector never sees "down" with a
                // stale deadline and probes at once.
                p.retry_at_ms.store(
                    now_ms.saturating_add(self.passive_recover_ms),
                    Ordering::Release,
                );
            }
            if p.healthy.swap(false, Ordering::AcqRel) {
                tracing::warn!(upstream = %self.name, peer = %p.addr, fails, "peer down: consecutive failures reached max_fails");
            }
        }
    }

    // === retry budget ===

    /// Count a request (call once per request, not per attempt).
    pub fn on_request(&self) {
        self.budget.on_request(crate::clock_ms());
    }

    pub fn on_request_at(&self, now_ms: u64) {
        self.budget.on_request(now_ms);
    }

    /// May this request retry now? Counts the retry if so.
    pub fn try_retry(&self) -> bool {
        self.budget.try_retry(crate::clock_ms())
    }

    pub fn try_retry_at(&self, now_ms: u64) -> bool {
        self.budget.try_retry(now_ms)
    }

    pub fn retry_budget(&self) -> &RetryBudget {
        &self.budget
    }
}
