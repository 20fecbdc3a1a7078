//! [`Rate`]: events per key over a sliding interval, on rotating estimators.

use std::hash::Hash;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use crate::estimator::{random_seed, Estimator, KeyHash};

/// Default sketch for a `Rate`: 4 rows x 2048 slots (64 KiB per estimator).
pub const DEFAULT_HASHES: usize = 4;
/// See [`DEFAULT_HASHES`].
pub const DEFAULT_SLOTS: usize = 2048;

// `state` packs the window number and which estimator plays which part, so
// one atomic load tells a caller everything (no torn reads across fields):
//   bits 4..  window number (now_ms / interval_ms) of the current estimator
//   bits 2..4 index (0..3) of the current estimator; previous is cur+2, spare cur+1 (mod 3)
//   bit 1     PREV_VALID: the previous estimator holds window-1 (not an older one)
//   bit 0     SPARE_DIRTY: the rotator is still zeroing the spare; no rotation until done
const SPARE_DIRTY: u64 = 1;
const PREV_VALID: u64 = 2;
const WINDOW_SHIFT: u32 = 4;

#[inline]
fn window_of(s: u64) -> u64 {
    s >> WINDOW_SHIFT
}
#[inline]
fn cur_of(s: u64) -> usize {
    ((s >> 2) & 3) as usize
}

/// What one observation saw: counts of the current and previous window and
/// how far into the current window it was. Enough to compute any weighting.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Window {
    /// Estimate for the key in the previous window (0 if it saw no events).
    pub prev: isize,
    /// Estimate for the key in the current window (after this observation).
    pub curr: isize,
    /// Milliseconds elapsed in the current window, in `0..interval_ms`.
    pub elapsed_ms: u64,
    /// The window length.
    pub interval_ms: u64,
    /// Which estimator was current (to undo the observation).
    slot: usize,
    key: KeyHash,
}

impl Window {
    /// Events in `(now - interval, now]`, weighting the previous window by
    /// the part of it still inside that span: `prev * (interval - elapsed -
    /// 1ms) / interval + curr` (its events assumed evenly spread).
    #[inline]
    pub fn sliding(&self) -> f64 {
        self.sliding_scaled() as f64 / self.interval_ms as f64
    }

    /// [`Window::sliding`] times `interval_ms`, in exact integers (limiters
    /// compare it with `limit * interval_ms`, free of rounding).
    #[inline]
    pub fn sliding_scaled(&self) -> i128 {
        let left = (self.interval_ms - 1 - self.elapsed_ms) as i128;
        self.prev as i128 * left + self.curr as i128 * self.interval_ms as i128
    }

    /// Elapsed part of the current window, in `[0, 1)`.
    #[inline]
    pub fn elapsed(&self) -> f64 {
        self.elapsed_ms as f64 / self.interval_ms as f64
    }
}

/// Events per key over a sliding `interval`.
///
/// Two windows are kept, current and previous (pingora-limits' red/blue),
/// plus a third estimator, the spare, that is zeroed while nobody uses it: at
/// a window boundary the first caller to see it swaps roles with one
/// compare-and-swap on a packed atomic state, and the spare becomes current
/// already clean. Counting never waits; the rotator then zeroes the new spare
/// (the window before previous). If a boundary arrives before that zeroing is
/// done, rotation is deferred to the next caller and the few events in
/// between land in the window that just ended.
///
/// Times are integer milliseconds from any fixed monotonic base ([`crate::clock::now_ms`]
/// by default); `*_at` variants take the caller's per-request snapshot so that
/// a request reads the clock once. A snapshot older than the current window is
/// counted in the current window.
pub struct Rate {
    est: [Estimator; 3],
    interval_ms: u64,
    state: AtomicU64,
    conservative: bool,
}

impl Rate {
    /// A rate over `interval` with the default sketch size.
    ///
    /// # Panics
    /// If `interval` is under 1 ms.
    pub fn new(interval: Duration) -> Self {
        Self::with_estimator(interval, DEFAULT_HASHES, DEFAULT_SLOTS)
    }

    /// A rate over `interval` with estimators of `hashes` x `slots`
    /// (memory: `3 * hashes * slots * 8` bytes).
    ///
    /// # Panics
    /// If `interval` is under 1 ms or a dimension is zero.
    pub fn with_estimator(interval: Duration, hashes: usize, slots: usize) -> Self {
        Self::with_seed(interval, hashes, slots, random_seed())
    }

    /// As [`Rate::with_estimator`] with a fixed hash seed.
    ///
    /// # Panics
    /// If `interval` is under 1 ms or a dimension is zero.
    pub fn with_seed(interval: Duration, hashes: usize, slots: usize, seed: u64) -> Self {
        let interval_ms = interval.as_millis() as u64;
        assert!(interval_ms > 0, "rate interval must be at least 1 ms");
        // All three share a seed so a key is hashed once per call.
        let est = std::array::from_fn(|_| Estimator::with_seed(hashes, slots, seed));
        Self {
            est,
            interval_ms,
            state: AtomicU64::new(0),
            conservative: false,
        }
    }

    /// Count with conservative update ([`Estimator::incr_conservative_hashed`]):
    /// less overcount on skewed traffic, at the price of a compare-and-swap
    /// loop. Observations can then no longer be undone, so
    /// [`crate::RateLimiter`] does not use it.
    pub fn conservative(mut self, on: bool) -> Self {
        self.conservative = on;
        self
    }

    /// The interval in milliseconds.
    pub fn interval_ms(&self) -> u64 {
        self.interval_ms
    }

    /// Bytes held by the three estimators.
    pub fn memory_bytes(&self) -> usize {
        self.est.iter().map(Estimator::memory_bytes).sum::<usize>() + std::mem::size_of::<Self>()
    }

    /// Hash a key for the `*_hashed` calls.
    #[inline]
    pub fn hash<K: Hash>(&self, key: K) -> KeyHash {
        self.est[0].hash(key)
    }

    /// Add `n` events for `key` now; returns the key's count in the current window.
    pub fn observe<K: Hash>(&self, key: K, n: isize) -> isize {
        self.observe_at(key, n, crate::clock::now_ms())
    }

    /// Add `n` events for `key` at `now_ms`; returns the key's count in the
    /// current window.
    pub fn observe_at<K: Hash>(&self, key: K, n: isize, now_ms: u64) -> isize {
        let h = self.hash(key);
        let s = self.advance(now_ms);
        self.add(cur_of(s), h, n)
    }

    /// Add `n` events for a hashed key at `now_ms`, returning both windows'
    /// counts (for limiters that weigh them).
    pub fn observe_window(&self, key: KeyHash, n: isize, now_ms: u64) -> Window {
        let s = self.advance(now_ms);
        let slot = cur_of(s);
        let curr = self.add(slot, key, n);
        let prev = if s & PREV_VALID != 0 {
            self.est[(slot + 2) % 3].get_hashed(key)
        } else {
            0
        };
        Window {
            prev,
            curr,
            elapsed_ms: self.elapsed_ms(window_of(s), now_ms),
            interval_ms: self.interval_ms,
            slot,
            key,
        }
    }

    /// Take back an observation made by [`Rate::observe_window`] (a limiter
    /// that denies does not charge the key). Not for conservative rates.
    pub fn undo(&self, w: &Window, n: isize) {
        debug_assert!(!self.conservative, "conservative updates cannot be undone");
        self.est[w.slot].decr_hashed(w.key, n);
    }

    /// Events per second for `key` over the last interval, now.
    pub fn rate<K: Hash>(&self, key: K) -> f64 {
        self.rate_at(key, crate::clock::now_ms())
    }

    /// Events per second for `key` over the interval ending at `now_ms`
    /// (see [`Window::sliding`]). Read-only (no rotation).
    pub fn rate_at<K: Hash>(&self, key: K, now_ms: u64) -> f64 {
        self.count_at(self.hash(key), now_ms) * 1000.0 / self.interval_ms as f64
    }

    /// Sliding count for a hashed key over the interval ending at `now_ms`.
    pub fn count_at(&self, key: KeyHash, now_ms: u64) -> f64 {
        let s = self.state.load(Ordering::Acquire);
        let cw = window_of(s);
        let w = now_ms / self.interval_ms;
        let slot = cur_of(s);
        if w > cw + 1 {
            // Nothing observed for a whole interval.
            return 0.0;
        }
        // Same span as `Window::sliding`: (now - interval, now].
        let left = (self.interval_ms - 1 - self.elapsed_ms(cw.max(w), now_ms)) as f64;
        let frac_left = left / self.interval_ms as f64;
        if w == cw + 1 {
            // The current estimator is about to become previous.
            return self.est[slot].get_hashed(key) as f64 * frac_left;
        }
        let prev = if s & PREV_VALID != 0 {
            self.est[(slot + 2) % 3].get_hashed(key)
        } else {
            0
        };
        prev as f64 * frac_left + self.est[slot].get_hashed(key) as f64
    }

    #[inline]
    fn add(&self, slot: usize, key: KeyHash, n: isize) -> isize {
        if self.conservative {
            self.est[slot].incr_conservative_hashed(key, n)
        } else {
            self.est[slot].incr_hashed(key, n)
        }
    }

    /// Milliseconds into window `w` at `now_ms` (0 for snapshots before it).
    #[inline]
    fn elapsed_ms(&self, w: u64, now_ms: u64) -> u64 {
        let start = w * self.interval_ms;
        now_ms.saturating_sub(start).min(self.interval_ms - 1)
    }

    /// Rotate to `now_ms`'s window if it is newer; return the state to use.
    #[inline]
    fn advance(&self, now_ms: u64) -> u64 {
        let w = now_ms / self.interval_ms;
        let mut s = self.state.load(Ordering::Acquire);
        loop {
            let cw = window_of(s);
            if w <= cw || s & SPARE_DIRTY != 0 {
                return s;
            }
            let cur = (cur_of(s) + 1) % 3; // the spare, already zero
            let prev_valid = if w == cw + 1 { PREV_VALID } else { 0 };
            let next = (w << WINDOW_SHIFT) | ((cur as u64) << 2) | prev_valid | SPARE_DIRTY;
            match self
                .state
                .compare_exchange(s, next, Ordering::AcqRel, Ordering::Acquire)
            {
                Ok(_) => {
                    // The new spare held the window before the new previous:
                    // nobody reads it any more. Zero it, then allow rotation.
                    self.est[(cur + 1) % 3].reset();
                    self.state.fetch_and(!SPARE_DIRTY, Ordering::Release);
                    return next & !SPARE_DIRTY;
                }
                Err(actual) => s = actual,
            }
        }
    }
}

impl std::fmt::Debug for Rate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Rate")
            .field("interval_ms", &self.interval_ms)
            .field("estimator", &self.est[0])
            .finish_non_exhaustive()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn close(a: f64, b: f64) {
        assert!((a - b).abs() < 1e-9, "{a} != {b}");
    }

    fn rate() -> Rate {
        Rate::with_seed(Duration::from_secs(1), 4, 256, 11)
    }

    #[test]
    fn windows_rotate_with_injected_time() {
        let r = rate();
        assert_eq!(r.observe_at("k", 3, 0), 3);
        assert_eq!(r.observe_at("k", 2, 500), 5);
        close(r.rate_at("k", 999), 5.0);
        // Next window: previous (5) weighted by the part of it in (now - 1 s, now].
        assert_eq!(r.observe_at("k", 4, 1000), 4);
        close(r.rate_at("k", 1000), 5.0 * 0.999 + 4.0);
        close(r.rate_at("k", 1500), 5.0 * 0.499 + 4.0);
        close(r.rate_at("k", 1750), 5.0 * 0.249 + 4.0);
        // Window 2 not yet observed: window 1 (4) is the previous one.
        close(r.rate_at("k", 2250), 4.0 * 0.749);
        // Two empty windows: nothing left.
        assert_eq!(r.rate_at("k", 3000), 0.0);
        assert_eq!(r.observe_at("k", 1, 3100), 1);
        close(r.rate_at("k", 3100), 1.0);
        // Other keys unaffected.
        assert_eq!(r.rate_at("other", 3100), 0.0);
    }

    #[test]
    fn a_jump_forgets_old_windows() {
        let r = rate();
        r.observe_at("k", 7, 100);
        r.observe_at("k", 1, 1100); // window 1: prev = 7
        assert_eq!(r.observe_window(r.hash("k"), 0, 1100).prev, 7);
        r.observe_at("k", 1, 5000); // window 5: previous is empty
        let w = r.observe_window(r.hash("k"), 0, 5000);
        assert_eq!((w.prev, w.curr), (0, 1));
        // Long after, each estimator has been zeroed on its way through.
        for t in 6..12 {
            r.observe_at("k", 1, t * 1000);
        }
        let w = r.observe_window(r.hash("k"), 0, 11_000);
        assert_eq!((w.prev, w.curr), (1, 1));
    }

    #[test]
    fn real_clock_variants() {
        // A 1-hour window so the test cannot straddle a boundary that matters.
        let r = Rate::new(Duration::from_secs(3600));
        assert_eq!(r.observe("k", 3), 3);
        assert_eq!(r.observe("k", 2), 5);
        let per_sec = r.rate("k");
        assert!(
            (5.0 / 3600.0 * 0.999..=10.0 / 3600.0).contains(&per_sec),
            "{per_sec}"
        );
        assert_eq!(r.rate("absent"), 0.0);
    }

    #[test]
    fn stale_snapshots_count_in_the_current_window() {
        let r = rate();
        r.observe_at("k", 1, 2000);
        assert_eq!(r.observe_at("k", 1, 1500), 2);
    }

    #[test]
    fn undo_takes_back() {
        let r = rate();
        let h = r.hash("k");
        let w = r.observe_window(h, 1, 10);
        assert_eq!(w.curr, 1);
        r.undo(&w, 1);
        assert_eq!(r.observe_at("k", 0, 20), 0);
    }

    #[test]
    fn conservative_rate_counts_the_same_single_key() {
        let r = rate().conservative(true);
        for i in 1..=10 {
            assert_eq!(r.observe_at("k", 1, 10), i);
        }
        close(r.rate_at("k", 10), 10.0);
    }
}
