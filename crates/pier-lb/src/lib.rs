//! Upstream groups: peer selection, passive and active health, retry budget,
//! and the discovery of servers given by host name ([`dns`]).
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
//! * Unhealthy, already-tried or full (`max_connections_per_server`) peers
//!   are skipped without rebuilding anything: the ring is walked to the next
//!   distinct eligible peer; round robin and the weighted schedule re-draw
//!   at random, which spreads a missing peer's share over the others in
//!   proportion to their weights (stepping to the next slot would hand all
//!   of it to one neighbour).
//! * The counters every thread writes (round-robin position, each peer's
//!   in-flight count) sit on their own cache line so they do not
//!   false-share with read-mostly data. `least_conn` and `random_two` use a
//!   thread-local xorshift (ties, draws) and write no shared counter.
//! * `least_conn` and `random_two` compare `active / weight`, and break
//!   ties / draw candidates by weight, so weights mean the same thing for
//!   every algorithm.
//! * Health transitions are rare and may log and take the slow path; the
//!   selection path only loads flags.
//!
//! The retry budget (as Finagle and linkerd) bounds retries to a fraction of
//! requests over a sliding ~10 s window made of ten one-second buckets of
//! atomic counters, so a failing origin cannot be hit with `1 + retries`
//! times the offered load.
//!
//! Passive health (`max_fails`, [`Group::report`]) and active checks
//! ([`spawn_health_checks`]) drive the same `healthy` flag. Without an
//! active check, a passively-downed peer gets one probe request per
//! `passive_recover`; with one, only `rise` good checks bring it back.
//! [`Group::reload`] carries peer state over a config reload.
//!
//! Times are integer milliseconds on [`clock_ms`]'s monotonic timeline.
//!
//! ```
//! # use pier_config::*;
//! # let cfg = Upstream::with_defaults("app", vec![
//! #     UpstreamServer::new(([127, 0, 0, 1], 8001).into(), 1),
//! #     UpstreamServer::new(([127, 0, 0, 1], 8002).into(), 1)]);
//! let group = pier_lb::Group::new(&cfg);
//! let now = pier_lb::clock_ms();
//! group.on_request_at(now);
//! let mut tried = Vec::new();
//! while let Some(idx) = group.select_at(None, &tried, now) {
//!     let _in_flight = group.begin(idx);
//!     let ok = idx == 1; // ... proxy to group.peers()[idx].addr ...
//!     group.report(idx, ok, pier_lb::clock_ms());
//!     if ok || !group.try_retry_at(pier_lb::clock_ms()) {
//!         break;
//!     }
//!     tried.push(idx);
//! }
//! ```

#![forbid(unsafe_code)]

mod budget;
pub mod dns;
mod group;
mod health;
mod key;
mod peer;
mod ring;
mod select;

pub use budget::RetryBudget;
pub use group::Group;
pub use health::{spawn_health_checks, CheckTls};
pub use key::{extract_hash_key, find_cookie};
pub use peer::{tls_server_name, ActiveGuard, Peer};

use std::sync::OnceLock;
use std::time::Instant;

static EPOCH: OnceLock<Instant> = OnceLock::new();

/// Milliseconds since the first call in this process, on a monotonic clock.
///
/// This is the timeline of every `now_ms` argument in this crate: pass a
/// snapshot of it (one read per request phase) or let the crate read it.
pub fn clock_ms() -> u64 {
    ms_at(Instant::now())
}

/// [`clock_ms`] at the worker's last clock read ([`pier_clock::recent`]):
/// no read of its own, for a worker thread's request path (on other threads,
/// whose last read may be old, use [`clock_ms`]).
pub fn recent_ms() -> u64 {
    ms_at(pier_clock::recent())
}

fn ms_at(t: Instant) -> u64 {
    let epoch = *EPOCH.get_or_init(|| t);
    // Starts at 1 so that 0 can mean "never" in atomics.
    t.saturating_duration_since(epoch).as_millis() as u64 + 1
}
