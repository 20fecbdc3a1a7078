//! The worker's clock: one read per phase, the rest from a per-thread cache.
//!
//! A proxied request used to read the clock ~15 times (request start, each
//! `tokio::time::timeout`, the pool's idle stamps, the balancer, the access
//! log), each a `clock_gettime` of 20–50 ns on a VM: ~10% of Pier's user CPU
//! per request at 50 connections. nginx reads the clock once per event-loop
//! turn (`ngx_time_update`); so does Pier now. A worker reads the clock when
//! its thread wakes from the poller ([`now`], from the runtime's
//! `on_thread_unpark`) and at the two points that need a precise figure (a
//! request's start and end); everything else takes [`recent`], the last read
//! on this thread. A deadline made from [`recent`] can only be early, by at
//! most the work the thread has done since its last read: microseconds
//! under load, and never more than one request's processing.
//!
//! Wall-clock time ([`wall_ns`]) is derived from the monotonic read and a
//! per-thread base re-read from the system clock once a second, so the `Date`
//! header, logs and analytics cost no second read either.
//!
//! Cache freshness is counted in whole Unix seconds ([`unix_secs`]). A test can
//! move that clock forward without waiting: [`install_test_clock`] (the `pier`
//! binary calls it when `PIER_TEST_CLOCK` names a file; docs/testing.md) adds
//! the seconds written in a file to every reading.

use std::cell::Cell;
use std::path::PathBuf;
use std::sync::OnceLock;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

thread_local! {
    static RECENT: Cell<Option<Instant>> = const { Cell::new(None) };
    /// (monotonic base, wall-clock ns at that base).
    static WALL: Cell<Option<(Instant, u64)>> = const { Cell::new(None) };
}

/// How long a wall-clock base is used before the system clock is re-read
/// (bounds the drift between the two clocks, and picks up a clock step).
const REBASE: Duration = Duration::from_secs(1);

/// Read the monotonic clock, and remember the reading for [`recent`].
#[inline]
pub fn now() -> Instant {
    let t = Instant::now();
    RECENT.with(|r| r.set(Some(t)));
    t
}

/// The last reading on this thread (reads the clock if there was none).
/// For deadlines and idle stamps, where being a few microseconds early
/// does not matter.
#[inline]
pub fn recent() -> Instant {
    match RECENT.with(Cell::get) {
        Some(t) => t,
        None => now(),
    }
}

/// `recent() + d`, saturating far in the future instead of overflowing.
#[inline]
pub fn deadline(d: Duration) -> Instant {
    let t = recent();
    t.checked_add(d)
        .unwrap_or_else(|| t + Duration::from_secs(86_400 * 365))
}

/// `tokio::time::timeout` with its deadline from [`recent`] instead of a
/// clock read of its own.
#[inline]
pub fn timeout<F: std::future::IntoFuture>(
    d: Duration,
    f: F,
) -> tokio::time::Timeout<F::IntoFuture> {
    tokio::time::timeout_at(tokio::time::Instant::from_std(deadline(d)), f)
}

/// [`deadline`] as tokio's `Instant`, for `timeout_at` / `sleep_until`.
#[inline]
pub fn tokio_deadline(d: Duration) -> tokio::time::Instant {
    tokio::time::Instant::from_std(deadline(d))
}

/// Nanoseconds since the Unix epoch at the monotonic instant `at` (taken on
/// this thread, recently).
pub fn wall_ns(at: Instant) -> u64 {
    WALL.with(|w| {
        if let Some((base, base_ns)) = w.get() {
            if let Some(d) = at.checked_duration_since(base) {
                if d < REBASE {
                    return base_ns + d.as_nanos() as u64;
                }
            }
        }
        let ns = system_ns();
        w.set(Some((at, ns)));
        ns
    })
}

/// The system's wall clock, read now.
pub fn system_ns() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0)
}

/// The file of [`install_test_clock`], if a test installed one.
static TEST_CLOCK: OnceLock<PathBuf> = OnceLock::new();

/// Test only: from now on [`unix_secs`] adds the whole number of seconds
/// written in `file` (an integer, negative too; a missing or unreadable file
/// counts as 0), read afresh at every call, so a test that rewrites the file
/// moves the clock before its next request. Once per process; false if a
/// clock was already installed.
pub fn install_test_clock(file: PathBuf) -> bool {
    TEST_CLOCK.set(file).is_ok()
}

/// The test clock's offset in seconds (0 without one).
fn test_offset_secs() -> i64 {
    let Some(file) = TEST_CLOCK.get() else {
        return 0;
    };
    std::fs::read_to_string(file)
        .ok()
        .and_then(|t| t.trim().parse().ok())
        .unwrap_or(0)
}

/// Unix seconds now (the clock of cache freshness), moved by the test clock
/// when one is installed.
pub fn unix_secs() -> u64 {
    let secs = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    secs.saturating_add_signed(test_offset_secs())
}

/// [`unix_secs`] from [`recent`] and the wall-clock base of [`wall_ns`]: no
/// clock read. For a worker's hot path (the cache's lookup and fill), whose
/// runtime refreshes `recent` at every wake and every request's start, so
/// the figure lags the system clock by at most one request's processing
/// (`unix_secs` read twice a stored miss cost ~220 instructions). Not for
/// threads that never call [`now`]: their `recent` is their first reading.
pub fn recent_unix_secs() -> u64 {
    (wall_ns(recent()) / 1_000_000_000).saturating_add_signed(test_offset_secs())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn recent_is_the_last_read() {
        let a = now();
        assert_eq!(recent(), a);
        let b = now();
        assert!(b >= a);
        assert_eq!(recent(), b);
    }

    #[test]
    fn wall_follows_the_monotonic_clock() {
        let t = now();
        let w1 = wall_ns(t);
        let sys = system_ns();
        // Same moment within a generous margin (a loaded machine).
        assert!(w1.abs_diff(sys) < 1_000_000_000, "{w1} vs {sys}");
        let later = t + Duration::from_millis(300);
        assert_eq!(wall_ns(later), w1 + 300_000_000);
        // Past the rebase interval the system clock is read again.
        let much_later = t + Duration::from_secs(5);
        let w3 = wall_ns(much_later);
        assert!(w3 >= system_ns() - 1_000_000_000);
    }

    #[test]
    fn the_test_clock_adds_its_file_s_seconds() {
        assert_eq!(test_offset_secs(), 0);
        let file = std::env::temp_dir().join(format!("pier-clock-{}", std::process::id()));
        std::fs::write(&file, "3600\n").unwrap();
        assert!(install_test_clock(file.clone()));
        assert!(!install_test_clock(file.clone()));
        let sys = system_ns() / 1_000_000_000;
        let t = unix_secs();
        assert!((sys + 3600..=sys + 3601).contains(&t), "{t} vs {sys}");
        std::fs::write(&file, "-60").unwrap();
        assert!(unix_secs() < sys);
        std::fs::remove_file(&file).unwrap();
        assert_eq!(test_offset_secs(), 0);
    }

    #[test]
    fn recent_unix_secs_is_the_system_clock_without_a_read() {
        now();
        let sys = system_ns() / 1_000_000_000;
        let t = recent_unix_secs();
        // `the_test_clock_adds_its_file_s_seconds` may have its offset
        // installed meanwhile (one clock per process): any of its values.
        let ok = [0i64, 3600, -60]
            .iter()
            .any(|&o| t.abs_diff(sys.saturating_add_signed(o)) <= 1);
        assert!(ok, "{t} vs {sys}");
    }

    #[test]
    fn deadline_saturates() {
        let d = deadline(Duration::MAX);
        assert!(d > recent());
        assert!(deadline(Duration::from_secs(1)) > recent());
    }
}
