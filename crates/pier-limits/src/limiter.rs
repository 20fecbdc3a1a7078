//! The proxy's limits: requests per second/minute with burst ([`RateLimiter`])
//! and concurrent requests ([`ConcurrencyLimiter`]), keyed by bytes.
//!
//! Keys are `&[u8]`: the proxy writes a composite key (route, client IP,
//! header value, ...) into a reusable buffer and passes a slice.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use crate::inflight::{Guard, Inflight};
use crate::rate::Rate;

/// A request-rate limit, as nginx `limit_req zone=.. rate=R burst=B nodelay`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RateLimit {
    /// Sustained rate. Under 1/s, the limit counts over a minute instead of a
    /// second (`per_minute(30)` is 0.5/s over 60 s windows).
    pub rate_per_sec: f64,
    /// Extra requests allowed on top of one interval's worth.
    pub burst: u32,
    /// Decide and count, but never deny (reports [`Decision::DryRunDeny`]).
    pub dry_run: bool,
}

impl RateLimit {
    /// `n` requests per second.
    pub fn per_second(n: u32) -> Self {
        Self {
            rate_per_sec: f64::from(n),
            burst: 0,
            dry_run: false,
        }
    }

    /// `n` requests per minute.
    pub fn per_minute(n: u32) -> Self {
        Self {
            rate_per_sec: f64::from(n) / 60.0,
            burst: 0,
            dry_run: false,
        }
    }

    /// With `burst` extra requests.
    pub fn burst(self, burst: u32) -> Self {
        Self { burst, ..self }
    }

    /// In dry-run mode.
    pub fn dry_run(self, dry_run: bool) -> Self {
        Self { dry_run, ..self }
    }

    /// The counting interval: one second, or a minute for rates under 1/s.
    pub fn interval_ms(&self) -> u64 {
        if self.rate_per_sec >= 1.0 {
            1000
        } else {
            60_000
        }
    }

    /// Requests allowed in any sliding interval: `rate * interval + burst`,
    /// at least 1.
    pub fn limit(&self) -> u64 {
        let per_interval = self.rate_per_sec * self.interval_ms() as f64 / 1000.0;
        // `as` saturates NaN to 0 and infinity to u64::MAX.
        (per_interval.floor().max(0.0) as u64)
            .saturating_add(u64::from(self.burst))
            .max(1)
    }
}

/// The answer for one request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Decision {
    /// Under the limit (and counted).
    Allow,
    /// Over the limit: answer 429 (rate) or 503 (concurrency) with `Retry-After`.
    Deny {
        /// Seconds until a request would be allowed again (at least 1).
        retry_after_secs: u32,
    },
    /// Over the limit in dry-run mode: let it through, count it in metrics.
    DryRunDeny {
        /// What `Retry-After` would have said.
        retry_after_secs: u32,
    },
}

impl Decision {
    /// Whether the request goes ahead (`Allow` or `DryRunDeny`).
    #[inline]
    pub fn is_allowed(&self) -> bool {
        !matches!(self, Decision::Deny { .. })
    }
}

/// Applies a [`RateLimit`] per key, on a sliding two-window [`Rate`].
///
/// A request is allowed if the key's sliding count including it,
/// `prev * (1 - elapsed) + curr`, stays within [`RateLimit::limit`]. Denied
/// requests are not charged (the observation is undone), so a client over
/// the limit still gets the configured rate through, as with nginx
/// `limit_req`. Under concurrency the increment comes first and its result
/// decides, so exactly `limit` requests of one key pass however many threads
/// race.
#[derive(Debug)]
pub struct RateLimiter {
    cfg: RateLimit,
    limit: u64,
    rate: Rate,
    denied: AtomicU64,
}

impl RateLimiter {
    /// With the default sketch ([`crate::rate::DEFAULT_HASHES`] x
    /// [`crate::rate::DEFAULT_SLOTS`], 192 KiB), which suits up to about
    /// `limit * 512` requests per interval over all keys (7.5k req/s at
    /// 15 per second); use [`RateLimiter::sized_for`] above that.
    pub fn new(cfg: RateLimit) -> Self {
        Self::with_estimator(cfg, crate::rate::DEFAULT_HASHES, crate::rate::DEFAULT_SLOTS)
    }

    /// Sized for up to `peak_per_sec` requests per second over all keys: 4
    /// rows of `N = 4 * requests per interval / limit` slots (at least 1024,
    /// at most 2^20), so that other keys add on average at most a quarter of
    /// the limit to a key's counter in a row. An idle key is then wrongly
    /// denied only if all 4 of its counters collect a full limit of others'
    /// requests: at most `(1/4)^4 = 0.4%` whatever the traffic (Markov), and
    /// about 1e-15 for evenly spread keys. Memory: `3 * 4 * N * 8` bytes
    /// (10 r/s per key at 100k req/s: N = 40000, 3.8 MB).
    pub fn sized_for(cfg: RateLimit, peak_per_sec: u64) -> Self {
        let per_interval = peak_per_sec.saturating_mul(cfg.interval_ms()) / 1000;
        let slots = per_interval
            .saturating_mul(4)
            .div_ceil(cfg.limit())
            .clamp(1024, 1 << 20);
        Self::with_estimator(cfg, 4, slots as usize)
    }

    /// With a `hashes` x `slots` sketch per window (see the crate docs for sizing).
    pub fn with_estimator(cfg: RateLimit, hashes: usize, slots: usize) -> Self {
        Self::from_rate(
            cfg,
            Rate::with_estimator(Duration::from_millis(cfg.interval_ms()), hashes, slots),
        )
    }

    /// Over a given rate counter, whose interval should be `cfg.interval_ms()`.
    pub fn from_rate(cfg: RateLimit, rate: Rate) -> Self {
        Self {
            cfg,
            limit: cfg.limit(),
            rate,
            denied: AtomicU64::new(0),
        }
    }

    /// The configuration.
    pub fn config(&self) -> &RateLimit {
        &self.cfg
    }

    /// Requests denied (or, in dry run, that would have been) so far.
    pub fn denied_total(&self) -> u64 {
        self.denied.load(Ordering::Relaxed)
    }

    /// Bytes held by the sketches.
    pub fn memory_bytes(&self) -> usize {
        self.rate.memory_bytes()
    }

    /// Decide one request for `key` at `now_ms` (the request's clock
    /// snapshot, from a fixed monotonic base such as [`crate::clock::now_ms`]).
    pub fn check(&self, key: &[u8], now_ms: u64) -> Decision {
        let h = self.rate.hash(key);
        let w = self.rate.observe_window(h, 1, now_ms);
        // Allowed if fewer than `limit` requests came in the last interval
        // before this one: sliding count without it < limit, in integers.
        let before = w.sliding_scaled() - i128::from(w.interval_ms);
        if before < i128::from(self.limit) * i128::from(w.interval_ms) {
            return Decision::Allow;
        }
        self.rate.undo(&w, 1);
        self.denied.fetch_add(1, Ordering::Relaxed);
        let retry_after_secs = self.retry_after_secs(w.prev, w.curr - 1, w.elapsed());
        if self.cfg.dry_run {
            Decision::DryRunDeny { retry_after_secs }
        } else {
            Decision::Deny { retry_after_secs }
        }
    }

    /// Seconds until one more request fits, given the previous window's
    /// count, the current one's (without the denied request) and the elapsed
    /// fraction: the previous window's weight shrinks linearly, and the
    /// current window's count starts shrinking once it becomes previous.
    fn retry_after_secs(&self, prev: isize, curr: isize, elapsed: f64) -> u32 {
        let limit = self.limit as f64;
        let (prev, curr) = (prev.max(0) as f64, curr.max(0) as f64);
        // Fraction of an interval to wait until `prev * (1 - f) + curr < limit`.
        let wait = if curr < limit {
            let f = if prev > 0.0 {
                1.0 - (limit - curr) / prev
            } else {
                elapsed
            };
            (f - elapsed).max(0.0)
        } else {
            // Must wait into the next window, where curr becomes previous.
            let g = 1.0 - limit / curr;
            (1.0 - elapsed) + g.max(0.0)
        };
        let ms = wait * self.cfg.interval_ms() as f64;
        ((ms / 1000.0).ceil() as u32).max(1)
    }
}

/// A concurrency limit: at most `max` requests of one key in flight.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ConcurrencyLimit {
    /// Requests allowed in flight per key.
    pub max: usize,
    /// `Retry-After` for a rejected request.
    pub retry_after_secs: u32,
    /// Count, but never reject (see [`ConcurrencyLimiter::denied_total`]).
    pub dry_run: bool,
}

impl ConcurrencyLimit {
    /// At most `max` in flight, `Retry-After: 1`.
    pub fn new(max: usize) -> Self {
        Self {
            max,
            retry_after_secs: 1,
            dry_run: false,
        }
    }
}

/// Rejection by a [`ConcurrencyLimiter`]: answer 503 with `Retry-After`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Rejected {
    /// Seconds for `Retry-After`.
    pub retry_after_secs: u32,
}

/// Applies a [`ConcurrencyLimit`] per key, on an [`Inflight`] sketch.
#[derive(Debug)]
pub struct ConcurrencyLimiter {
    cfg: ConcurrencyLimit,
    inflight: Inflight,
    denied: AtomicU64,
}

impl ConcurrencyLimiter {
    /// With the default in-flight sketch ([`crate::inflight::DEFAULT_SLOTS`]).
    pub fn new(cfg: ConcurrencyLimit) -> Self {
        Self::from_inflight(cfg, Inflight::new())
    }

    /// Over a given in-flight counter.
    pub fn from_inflight(cfg: ConcurrencyLimit, inflight: Inflight) -> Self {
        Self {
            cfg,
            inflight,
            denied: AtomicU64::new(0),
        }
    }

    /// The configuration.
    pub fn config(&self) -> &ConcurrencyLimit {
        &self.cfg
    }

    /// Requests rejected (or, in dry run, that would have been) so far.
    pub fn denied_total(&self) -> u64 {
        self.denied.load(Ordering::Relaxed)
    }

    /// Admit one request of `key`: the guard holds its slot until dropped
    /// (drop it when the response is done).
    pub fn acquire(&self, key: &[u8]) -> Result<Guard, Rejected> {
        let (guard, count) = self.inflight.incr(key);
        if count.max(0) as usize <= self.cfg.max {
            return Ok(guard);
        }
        self.denied.fetch_add(1, Ordering::Relaxed);
        if self.cfg.dry_run {
            return Ok(guard);
        }
        drop(guard);
        Err(Rejected {
            retry_after_secs: self.cfg.retry_after_secs,
        })
    }

    /// The key's current in-flight estimate.
    pub fn in_flight(&self, key: &[u8]) -> isize {
        self.inflight.get(key)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limiter(cfg: RateLimit) -> RateLimiter {
        let rate = Rate::with_seed(Duration::from_millis(cfg.interval_ms()), 4, 1024, 9);
        RateLimiter::from_rate(cfg, rate)
    }

    #[test]
    fn limits_from_config() {
        assert_eq!(RateLimit::per_second(10).limit(), 10);
        assert_eq!(RateLimit::per_second(10).burst(5).limit(), 15);
        assert_eq!(RateLimit::per_minute(30).interval_ms(), 60_000);
        assert_eq!(RateLimit::per_minute(30).limit(), 30);
        assert_eq!(RateLimit::per_minute(0).limit(), 1);
        let huge = RateLimit {
            rate_per_sec: f64::INFINITY,
            burst: u32::MAX,
            dry_run: false,
        };
        assert_eq!(huge.limit(), u64::MAX);
    }

    #[test]
    fn allows_rate_plus_burst_then_denies_then_recovers() {
        let l = limiter(RateLimit::per_second(10).burst(5));
        for i in 0..15 {
            assert_eq!(l.check(b"ip", 1000 + i), Decision::Allow, "request {i}");
        }
        let d = l.check(b"ip", 1020);
        // The window is full: 980 ms to the boundary.
        assert_eq!(
            d,
            Decision::Deny {
                retry_after_secs: 1
            }
        );
        assert!(!d.is_allowed());
        // Other keys are unaffected.
        assert_eq!(l.check(b"other", 1020), Decision::Allow);
        // Just after the boundary the previous window still weighs ~15:
        // the request at 1000 ms has aged out, so one more fits.
        assert!(l.check(b"ip", 2000).is_allowed());
        assert!(!l.check(b"ip", 2000).is_allowed());
        // Half way through, half of it is left: 7.485 + before < 15 admits 7
        // more (8 in this window).
        let allowed = (0..20)
            .filter(|_| l.check(b"ip", 2500).is_allowed())
            .count();
        assert_eq!(allowed, 7);
        // Two intervals later everything is forgotten.
        let allowed = (0..20)
            .filter(|_| l.check(b"ip", 4000).is_allowed())
            .count();
        assert_eq!(allowed, 15);
        assert_eq!(l.denied_total(), 1 + 1 + 13 + 5);
    }

    #[test]
    fn sized_for_scales_the_sketch() {
        let small = RateLimiter::sized_for(RateLimit::per_second(10), 100);
        let big = RateLimiter::sized_for(RateLimit::per_second(10), 100_000);
        assert_eq!(small.memory_bytes() / 1024, 3 * 4 * 1024 * 8 / 1024);
        assert!(big.memory_bytes() >= 3 * 4 * 40_000 * 8);
        assert!(big.memory_bytes() < 4_000_000);
    }

    /// A flood of distinct keys at the sized rate does not push an innocent
    /// client over its limit.
    #[test]
    fn innocent_key_survives_a_flood_of_others() {
        let cfg = RateLimit::per_second(10);
        let l = RateLimiter::sized_for(cfg, 50_000);
        for now in 0..3000u64 {
            // 50 requests per ms from distinct clients (50k req/s)...
            for i in 0..50u64 {
                let k = (now * 50 + i).to_le_bytes();
                l.check(&k, now);
            }
            // ...and one well-behaved client at 5 r/s.
            if now % 200 == 0 {
                assert!(l.check(b"good client", now).is_allowed(), "at {now} ms");
            }
        }
    }

    #[test]
    fn steady_client_at_the_rate_is_never_denied() {
        let l = limiter(RateLimit::per_second(10));
        // One request every 100 ms for 5 s.
        for t in 0..50u64 {
            assert_eq!(l.check(b"ip", 10_000 + t * 100), Decision::Allow, "t={t}");
        }
    }

    #[test]
    fn retry_after_points_to_when_a_request_fits() {
        let l = limiter(RateLimit::per_second(2));
        assert!(l.check(b"k", 0).is_allowed());
        assert!(l.check(b"k", 0).is_allowed());
        let Decision::Deny { retry_after_secs } = l.check(b"k", 0) else {
            panic!("expected deny");
        };
        assert_eq!(retry_after_secs, 1);
        // Per minute: full minute used at once -> wait for the next window.
        let l = limiter(RateLimit::per_minute(6));
        for _ in 0..6 {
            assert!(l.check(b"k", 0).is_allowed());
        }
        let Decision::Deny { retry_after_secs } = l.check(b"k", 0) else {
            panic!("expected deny");
        };
        // 60 s to the boundary, when the requests made at 0 age out.
        assert_eq!(retry_after_secs, 60);
        assert!(!l.check(b"k", 59_999).is_allowed());
        assert!(l.check(b"k", 60_000).is_allowed());
        // At 70 s 5/6 of the previous minute is left (5) plus 1: one more fits.
        assert!(!l.check(b"k", 60_000).is_allowed());
        assert!(l.check(b"k", 70_001).is_allowed());
        assert!(!l.check(b"k", 70_001).is_allowed());
    }

    #[test]
    fn dry_run_never_denies_but_counts() {
        let l = limiter(RateLimit::per_second(3).dry_run(true));
        let decisions: Vec<_> = (0..10).map(|_| l.check(b"k", 5)).collect();
        assert!(decisions.iter().all(Decision::is_allowed));
        assert_eq!(
            decisions.iter().filter(|d| **d == Decision::Allow).count(),
            3
        );
        assert!(matches!(
            decisions[9],
            Decision::DryRunDeny {
                retry_after_secs: 1
            }
        ));
        assert_eq!(l.denied_total(), 7);
    }

    #[test]
    fn concurrency_limit_rejects_past_max_and_recovers() {
        let l = ConcurrencyLimiter::new(ConcurrencyLimit::new(2));
        let a = l.acquire(b"origin").unwrap();
        let _b = l.acquire(b"origin").unwrap();
        assert_eq!(l.acquire(b"origin").unwrap_err().retry_after_secs, 1);
        assert_eq!(l.in_flight(b"origin"), 2);
        let _c = l.acquire(b"other").unwrap();
        drop(a);
        let _d = l.acquire(b"origin").unwrap();
        assert_eq!(l.denied_total(), 1);
    }

    #[test]
    fn unbounded_concurrency_limit_admits() {
        let l = ConcurrencyLimiter::new(ConcurrencyLimit::new(usize::MAX));
        assert!(l.acquire(b"k").is_ok());
    }

    #[test]
    fn concurrency_dry_run_admits_and_counts() {
        let l = ConcurrencyLimiter::new(ConcurrencyLimit {
            dry_run: true,
            ..ConcurrencyLimit::new(1)
        });
        let guards: Vec<_> = (0..4).map(|_| l.acquire(b"k").unwrap()).collect();
        assert_eq!(l.in_flight(b"k"), 4);
        assert_eq!(l.denied_total(), 3);
        drop(guards);
        assert_eq!(l.in_flight(b"k"), 0);
    }
}
