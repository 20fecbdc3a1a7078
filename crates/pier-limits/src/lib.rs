//! Counting for Pier's limits: a lock-free count-min sketch ([`Estimator`]),
//! sliding rates ([`Rate`]) and in-flight counts ([`Inflight`]) built on it,
//! and the limiters the proxy applies ([`RateLimiter`], [`ConcurrencyLimiter`]).
//!
//! ```
//! use pier_limits::{clock, ConcurrencyLimit, ConcurrencyLimiter, Decision, RateLimit, RateLimiter};
//!
//! // 10 requests per second per client with a burst of 5, like nginx
//! // `limit_req rate=10r/s burst=5 nodelay`.
//! let per_client = RateLimiter::new(RateLimit::per_second(10).burst(5));
//! // At most 100 requests in flight per upstream server (503 past it).
//! let per_origin = ConcurrencyLimiter::new(ConcurrencyLimit::new(100));
//!
//! let now = clock::now_ms(); // one clock read per request
//! let mut key = Vec::with_capacity(64); // reused across requests
//! key.extend_from_slice(b"route:api|ip:");
//! key.extend_from_slice(b"192.0.2.7");
//! for _ in 0..15 {
//!     assert_eq!(per_client.check(&key, now), Decision::Allow);
//! }
//! assert!(matches!(per_client.check(&key, now), Decision::Deny { retry_after_secs: 1 }));
//!
//! let guard = per_origin.acquire(b"10.0.0.9:8080").expect("under the limit");
//! // ... proxy the request; the slot is released when `guard` drops.
//! drop(guard);
//! ```
//!
//! # Why a count-min sketch
//! A limit must count events for every key it sees (client IPs, composite
//! keys). A hash map grows with the number of keys, so a flood of distinct
//! keys grows memory without bound, and concurrent inserts need a lock. A
//! count-min sketch has a fixed `H x N` array of counters: memory is a
//! function of the config, not of the traffic, and an event is H relaxed
//! atomic adds — no lock, no allocation, no waiting on another thread. The
//! price is that colliding keys share counters, so an estimate may be high;
//! it is never low.
//!
//! # Why lock-free
//! Every request on every worker thread touches the same limiter, so a lock
//! would serialize all workers on it (a `Mutex<HashMap>` costs 10x the
//! sketch per event on one thread and more with two; see bench/limits.md),
//! and a worker descheduled while holding it would stall the others. The
//! sketch needs none: counters are independent and only their values
//! matter, so each is a relaxed `fetch_add`, and no code relies on an order
//! between counters. A [`Rate`] changes windows with one compare-and-swap on a
//! packed state word, and its counting never waits for that.
//!
//! # Choosing H and N
//! Each event adds to one counter in each of H rows, at a column chosen by a
//! per-row hash; the estimate is the minimum of the key's H counters. In one
//! row a key's counter also holds, on average, `total / N` of other keys'
//! events; by Markov's inequality it exceeds `e * total / N` with probability
//! at most `1/e`, and all H rows do so with probability at most `e^-H`. So
//! for a target overcount `epsilon * total` with failure probability `delta`:
//!
//! ```text
//! N = ceil(e / epsilon)        H = ceil(ln(1 / delta))
//! ```
//!
//! ([`Estimator::with_error`]). Examples: `epsilon = 0.001, delta = 0.01` gives
//! 5 x 2719 (106 KiB); the [`Rate`] default 4 x 2048 (64 KiB per window) keeps
//! the overcount under 0.13% of the window's events with probability 98%.
//! For limits, what matters is the chance an innocent key is pushed over its
//! limit `L`: a row's extra count averages `total / N`, so N must grow with
//! `events per window / L`; [`RateLimiter::sized_for`] takes
//! `N = 4 * events per window / L` (e.g. 100k req/s against a 10 r/s limit:
//! N = 40000, 3.8 MB), which keeps a wrong denial under 0.4% for any traffic
//! and far rarer for evenly spread keys. A sketch sized below that fills up:
//! under a flood of distinct keys far beyond its size it denies everyone,
//! though its memory still stays put.
//! Two unrelated keys share all H counters with probability `N^-H`
//! ([`Inflight`]'s 4 x 8192 default: 2^-52, the pingora-limits choice), which
//! is what matters when the threshold is far above a healthy key's count.
//!
//! Hashing: a key is hashed once to 64 bits (foldhash, seeded randomly per
//! instance so clients cannot precompute collisions with someone else's key)
//! and each row takes its column from that hash with its own strongly
//! universal multiply-add-shift function (random 128-bit `a`, `b` per row),
//! which gives the pairwise independence the bound above assumes for two
//! multiplies per row. A [`Rate`]'s three estimators and all rows cost one hash.
//!
//! # Conservative update
//! [`Estimator::incr_conservative`] raises a key's counters only to the old
//! estimate plus n (Estan and Varghese), which about halves the total
//! overcount on skewed traffic (the `conservative_update_reduces_error` test)
//! for ~3x the cost per event;
//! it is increment-only, so limiters that undo a denied request's count
//! ([`RateLimiter`]) and in-flight counts use the plain update.
//!
//! # Time
//! Integer milliseconds from a fixed monotonic base ([`clock::now_ms`]);
//! every `*_at` method takes the caller's per-request snapshot so a request
//! reads the clock once.
#![forbid(unsafe_code)]
#![warn(missing_docs)]

pub mod clock;
pub mod estimator;
pub mod global;
pub mod inflight;
pub mod limiter;
pub mod rate;

pub use estimator::{Estimator, KeyHash};
pub use global::GlobalRate;
pub use inflight::{Guard, Inflight};
pub use limiter::{
    ConcurrencyLimit, ConcurrencyLimiter, Decision, RateLimit, RateLimiter, Rejected,
};
pub use rate::{Rate, Window};
