//! Upstream groups: peer selection, passive and active health, retry budget.
//!
//! # Design
//!
//! Pier runs one tokio `current_thread` runtime per core and every thread
//! serves requests for every upstream group, so a [`Group`] is shared
//! (`Arc<Group>`) by all of them. Selection runs once per request attempt,
//! so it must not take a lock (a mutex would serialise every core on the
//! busiest group) and must not allocate:
//!
//! * Per-peer state (`healthy`, in-flight `active`, consecutive failures,
//!   passive recovery deadline) lives in atomics on [`Peer`]. Readers load
//!   with `Relaxed`/`Acquire`; a stale read costs at most one request going
//!   to a peer that has just changed state, which the retry path absorbs.
//! * Algorithms that would need mutable shared state in their textbook form
//!   are precomputed once when the group is built. nginx's smooth weighted
//!   round robin mutates `current_weight` of every peer under a lock; here the
//!   same algorithm is run `sum(weights)` times up front and the resulting
//!   interleaved schedule is indexed by one atomic counter. Consistent
//!   hashing is a ketama-style ring (160 points per weight unit) sorted once;
//!   a lookup is a binary search.
//! * Unhealthy or already-tried peers are skipped without rebuilding
//!   anything: the ring is walked to the next distinct eligible peer, the
//!   weighted schedule is re-drawn at random (which keeps the weights
//!   proportional among the remaining peers), round robin scans onwards.
//! * The single counters every thread bumps (round robin position) sit on
//!   their own cache line so they do not false-share with read-mostly data.
//!   `random_two` uses a thread-local xorshift and touches no shared counter.
//! * Health transitions are rare and may log and take the slow path; the
//!   selection path only loads flags.
//!
//! The retry budget (as Finagle and linkerd) bounds retries to a fraction of
//! requests over a sliding ~10 s window made of ten one-second buckets of
//! atomic counters, so a failing origin cannot be hit with `1 + retries`
//! times the offered load.
//!
//! Times are integer milliseconds on [`clock_ms`]'s monotonic timeline.

#![forbid(unsafe_code)]

mod budget;
mod group;
mod health;
mod key;
mod peer;
mod ring;
mod select;

pub use budget::RetryBudget;
pub use group::Group;
pub use health::spawn_health_checks;
pub use key::{extract_hash_key, find_cookie};
pub use peer::{ActiveGuard, Peer};

use std::sync::OnceLock;
use std::time::Instant;

/// Milliseconds since the first call in this process, on a monotonic clock.
///
/// This is the timeline of every `now_ms` argument in this crate: pass a
/// snapshot of it (one read per request phase) or let the crate read it.
pub fn clock_ms() -> u64 {
    static EPOCH: OnceLock<Instant> = OnceLock::new();
    let epoch = *EPOCH.get_or_init(Instant::now);
    // Starts at 1 so that 0 can mean "never" in atomics.
    epoch.elapsed().as_millis() as u64 + 1
}
