//! [`Inflight`]: concurrent count per key, released by an RAII [`Guard`].

use std::hash::Hash;
use std::sync::Arc;

use crate::estimator::{Estimator, KeyHash};

/// Default sketch for `Inflight`: 4 rows x 8192 slots (256 KiB), the
/// pingora-limits choice: two unrelated keys share all four counters with
/// probability 8192^-4 = 2^-52.
pub const DEFAULT_HASHES: usize = 4;
/// See [`DEFAULT_HASHES`].
pub const DEFAULT_SLOTS: usize = 8192;

/// Concurrent events per key (requests in flight, connections open).
///
/// [`Inflight::incr`] adds one and returns a [`Guard`] that takes it back when
/// dropped, so an early return or a panic cannot leak a count.
#[derive(Clone, Debug)]
pub struct Inflight {
    est: Arc<Estimator>,
}

impl Default for Inflight {
    fn default() -> Self {
        Self::new()
    }
}

impl Inflight {
    /// With the default sketch size.
    pub fn new() -> Self {
        Self::with_estimator(DEFAULT_HASHES, DEFAULT_SLOTS)
    }

    /// With a `hashes` x `slots` sketch.
    ///
    /// # Panics
    /// If a dimension is zero.
    pub fn with_estimator(hashes: usize, slots: usize) -> Self {
        Self::from_estimator(Estimator::new(hashes, slots))
    }

    /// Over a given estimator (for a fixed seed in tests).
    pub fn from_estimator(est: Estimator) -> Self {
        Self { est: Arc::new(est) }
    }

    /// Count one more for `key`; returns the guard and the new estimate.
    pub fn incr<K: Hash>(&self, key: K) -> (Guard, isize) {
        self.incr_by(key, 1)
    }

    /// Count `n` more for `key` until the guard drops.
    pub fn incr_by<K: Hash>(&self, key: K, n: isize) -> (Guard, isize) {
        let key = self.est.hash(key);
        // Not `incr_hashed`: its estimate can under-count increments that
        // race on two threads (see `incr_then_get_hashed`).
        let count = self.est.incr_then_get_hashed(key, n);
        (
            Guard {
                est: Arc::clone(&self.est),
                key,
                n,
            },
            count,
        )
    }

    /// The current estimate for `key`.
    pub fn get<K: Hash>(&self, key: K) -> isize {
        self.est.get(key)
    }

    /// Bytes held by the sketch.
    pub fn memory_bytes(&self) -> usize {
        self.est.memory_bytes()
    }
}

/// Holds a key's in-flight count until dropped. Keeps the key's hash, not the
/// key, so it is a fixed 24 bytes whatever the key.
#[derive(Debug)]
#[must_use = "the count is released when the guard drops"]
pub struct Guard {
    est: Arc<Estimator>,
    key: KeyHash,
    n: isize,
}

impl Guard {
    /// The key's current estimate (including this guard).
    pub fn get(&self) -> isize {
        self.est.get_hashed(self.key)
    }
}

impl Drop for Guard {
    fn drop(&mut self) {
        self.est.decr_hashed(self.key, self.n);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Racing increments never admit more than the limit: every thread
    /// that reads a count <= MAX holds a slot, and the slots held at once
    /// never exceed MAX. (With the minimum of the per-row `fetch_add`
    /// results, two racers could both read 1.)
    #[test]
    fn racing_increments_never_exceed_the_limit() {
        use std::sync::atomic::{AtomicUsize, Ordering};
        const MAX: isize = 1;
        let f = Inflight::from_estimator(Estimator::with_seed(4, 1024, 5));
        let live = Arc::new(AtomicUsize::new(0));
        let admitted = Arc::new(AtomicUsize::new(0));
        let start = Arc::new(std::sync::Barrier::new(4));
        let threads: Vec<_> = (0..4)
            .map(|_| {
                let (f, live, admitted) = (f.clone(), live.clone(), admitted.clone());
                let start = start.clone();
                std::thread::spawn(move || {
                    start.wait();
                    for _ in 0..1_000_000 {
                        let (g, n) = f.incr("k");
                        if n <= MAX {
                            let now = live.fetch_add(1, Ordering::SeqCst) + 1;
                            assert!(now <= MAX as usize, "{now} holders, limit {MAX}");
                            admitted.fetch_add(1, Ordering::Relaxed);
                            live.fetch_sub(1, Ordering::SeqCst);
                        }
                        drop(g);
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        assert!(admitted.load(Ordering::Relaxed) > 0);
        assert_eq!(f.get("k"), 0);
    }

    #[test]
    fn guard_releases_on_drop() {
        let f = Inflight::from_estimator(Estimator::with_seed(4, 1024, 5));
        let (g1, n) = f.incr("a");
        assert_eq!(n, 1);
        let (g2, n) = f.incr_by("a", 2);
        assert_eq!(n, 3);
        drop(g1);
        assert_eq!(g2.get(), 2);
        drop(g2);
        assert_eq!(f.get("a"), 0);
        let (_g, n) = f.incr("a");
        assert_eq!(n, 1);
    }

    #[test]
    fn guard_is_small() {
        assert_eq!(std::mem::size_of::<Guard>(), 24);
    }

    #[test]
    fn guard_released_by_unwinding() {
        let f = Inflight::from_estimator(Estimator::with_seed(4, 1024, 5));
        let f2 = f.clone();
        let r = std::thread::spawn(move || {
            let (_g, _) = f2.incr("a");
            panic!("handler failed");
        })
        .join();
        assert!(r.is_err());
        assert_eq!(f.get("a"), 0);
    }
}
