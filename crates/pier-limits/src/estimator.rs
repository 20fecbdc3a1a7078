//! [`Estimator`]: a lock-free count-min sketch.

use std::collections::hash_map::RandomState as StdRandomState;
use std::hash::{BuildHasher, Hash};
use std::sync::atomic::{AtomicIsize, Ordering};

use foldhash::fast::FixedState;

/// A key hashed once by an [`Estimator`]'s seeded hash. Every row's column is
/// derived from it, so callers that touch several estimators sharing a seed
/// (as [`crate::Rate`] does) hash the key only once.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct KeyHash(pub u64);

/// A count-min sketch of `hashes` (H) rows by `slots` (N) `AtomicIsize`
/// counters.
///
/// Each event adds to one counter per row; a key's estimate is the minimum of
/// its H counters. Counters only ever receive the key's own events plus those
/// of colliding keys, so with only increments the estimate never undercounts;
/// it overcounts by at most `e/N * total` with probability `1 - e^-H`
/// (see [`Estimator::with_error`]).
///
/// All operations are a handful of relaxed atomic adds: no lock, no
/// allocation after construction, memory fixed at `H * N * 8` bytes.
pub struct Estimator {
    /// Row-major: row `r` is `cells[r * slots..(r + 1) * slots]`.
    cells: Box<[AtomicIsize]>,
    slots: usize,
    /// Each row's `(a, b)` for its multiply-add-shift hash.
    row_seeds: Box<[(u128, u128)]>,
    hasher: FixedState,
    seed: u64,
}

impl Estimator {
    /// A sketch with `hashes` rows of `slots` counters each, seeded randomly
    /// (per process and per instance) so that colliding keys cannot be
    /// precomputed by a client.
    ///
    /// # Panics
    /// If `hashes` or `slots` is zero.
    pub fn new(hashes: usize, slots: usize) -> Self {
        Self::with_seed(hashes, slots, random_seed())
    }

    /// A sketch sized from a target error: `slots = ceil(e / epsilon)`,
    /// `hashes = ceil(ln(1 / delta))`. Then for any key, with probability at
    /// least `1 - delta`, `estimate <= true count + epsilon * total`, where
    /// total is the sum of all increments (Cormode and Muthukrishnan 2005).
    ///
    /// Memory is `H * N * 8` bytes: `epsilon` is clamped to `[1e-6, 1)`
    /// (at most 2.7M slots a row) and `delta` to `[1e-9, 1)` (at most 21 rows).
    pub fn with_error(epsilon: f64, delta: f64) -> Self {
        let (hashes, slots) = dimensions(epsilon, delta);
        Self::new(hashes, slots)
    }

    /// As [`Estimator::new`] with a given seed (reproducible tests, benches,
    /// and estimators that must share row hashes, such as a [`crate::Rate`]'s).
    /// Uses a process-independent hash: do not expose a fixed seed to clients.
    ///
    /// # Panics
    /// If `hashes` or `slots` is zero.
    pub fn with_seed(hashes: usize, slots: usize, seed: u64) -> Self {
        assert!(
            hashes > 0 && slots > 0,
            "estimator needs at least one row and one slot"
        );
        let mut sm = seed;
        let mut wide = || (u128::from(splitmix64(&mut sm)) << 64) | u128::from(splitmix64(&mut sm));
        let row_seeds = (0..hashes)
            .map(|_| (wide(), wide()))
            .collect::<Vec<_>>()
            .into_boxed_slice();
        let cells = (0..hashes * slots)
            .map(|_| AtomicIsize::new(0))
            .collect::<Vec<_>>()
            .into_boxed_slice();
        Self {
            cells,
            slots,
            row_seeds,
            hasher: FixedState::with_seed(splitmix64(&mut sm)),
            seed,
        }
    }

    /// Number of rows (H).
    pub fn hashes(&self) -> usize {
        self.row_seeds.len()
    }

    /// Counters per row (N).
    pub fn slots(&self) -> usize {
        self.slots
    }

    /// The seed this estimator hashes with.
    pub fn seed(&self) -> u64 {
        self.seed
    }

    /// Bytes held by the counters (`H * N * 8` on 64-bit targets).
    pub fn memory_bytes(&self) -> usize {
        std::mem::size_of_val(&*self.cells)
            + std::mem::size_of_val(&*self.row_seeds)
            + std::mem::size_of::<Self>()
    }

    /// Hash `key` once; pass the result to the `*_hashed` methods.
    #[inline]
    pub fn hash<K: Hash>(&self, key: K) -> KeyHash {
        KeyHash(self.hasher.hash_one(&key))
    }

    /// Add `n` to `key` and return the new estimate (the minimum over rows).
    ///
    /// Overflow wraps (as in pingora-limits); callers with counts near
    /// `isize::MAX` must check for a negative result.
    #[inline]
    pub fn incr<K: Hash>(&self, key: K, n: isize) -> isize {
        self.incr_hashed(self.hash(key), n)
    }

    /// Subtract `n` from `key`: undoes an earlier [`Estimator::incr`] of the
    /// same amount (used by in-flight counts).
    #[inline]
    pub fn decr<K: Hash>(&self, key: K, n: isize) {
        self.decr_hashed(self.hash(key), n)
    }

    /// The estimated count of `key`.
    #[inline]
    pub fn get<K: Hash>(&self, key: K) -> isize {
        self.get_hashed(self.hash(key))
    }

    /// [`Estimator::incr`] for an already hashed key.
    #[inline]
    pub fn incr_hashed(&self, key: KeyHash, n: isize) -> isize {
        let mut min = isize::MAX;
        for (row, seeds) in self.row_seeds.iter().enumerate() {
            let cell = &self.cells[row * self.slots + column(key.0, *seeds, self.slots)];
            let now = cell.fetch_add(n, Ordering::Relaxed).wrapping_add(n);
            min = min.min(now);
        }
        min
    }

    /// Add `n` to every row, then read the estimate again: the count an
    /// admission check (`concurrent = N`) must compare.
    ///
    /// The minimum of the values each row's `fetch_add` returned is not
    /// enough there: two increments racing on two threads can each see the
    /// other on one row only, and both read 1. Reading every row after all
    /// of ours are done fixes that: of k racing callers, the one whose read
    /// comes last sees all k (each finished its adds before its own read), the
    /// one before it at least k-1, and so on, so no more than N are ever
    /// admitted. Races can only over-count (refuse), never under-count.
    /// SeqCst puts every add and read in one order; on x86 the adds are
    /// locked either way and the loads stay plain.
    #[inline]
    pub fn incr_then_get_hashed(&self, key: KeyHash, n: isize) -> isize {
        for (row, seeds) in self.row_seeds.iter().enumerate() {
            let cell = &self.cells[row * self.slots + column(key.0, *seeds, self.slots)];
            cell.fetch_add(n, Ordering::SeqCst);
        }
        let mut min = isize::MAX;
        for (row, seeds) in self.row_seeds.iter().enumerate() {
            let cell = &self.cells[row * self.slots + column(key.0, *seeds, self.slots)];
            min = min.min(cell.load(Ordering::SeqCst));
        }
        min
    }

    /// [`Estimator::decr`] for an already hashed key.
    #[inline]
    pub fn decr_hashed(&self, key: KeyHash, n: isize) {
        for (row, seeds) in self.row_seeds.iter().enumerate() {
            let cell = &self.cells[row * self.slots + column(key.0, *seeds, self.slots)];
            cell.fetch_sub(n, Ordering::Relaxed);
        }
    }

    /// [`Estimator::get`] for an already hashed key.
    #[inline]
    pub fn get_hashed(&self, key: KeyHash) -> isize {
        let mut min = isize::MAX;
        for (row, seeds) in self.row_seeds.iter().enumerate() {
            let cell = &self.cells[row * self.slots + column(key.0, *seeds, self.slots)];
            min = min.min(cell.load(Ordering::Relaxed));
        }
        min
    }

    /// Conservative update: add `n > 0` to `key` but raise each of its
    /// counters only as far as `old estimate + n` (Estan and Varghese 2002).
    /// Counters that already exceed that because of collisions are left
    /// alone, which about halves the total overcount on skewed traffic (the
    /// `conservative_update_reduces_error` test).
    ///
    /// Lock-free: an attempt reads the key's counters, then compare-and-swaps
    /// each one it must raise from the value it read; if any changed in
    /// between, it retries from a fresh read (a plain `fetch_max` would lose
    /// one of two racing increments that read the same minimum). Counters only
    /// grow, so a swap that succeeds proves nobody raised that counter since
    /// the read; a committed attempt raised its minimum counter from exactly
    /// the estimate it read, so two racing increments cannot both build on
    /// the same old estimate. Concurrent increments may overcount by a few;
    /// `tests/concurrency.rs` checks that none is lost with 8 threads.
    ///
    /// Only valid for increment-only use: never mix with
    /// [`Estimator::decr`] on the same estimator (a decrement after a
    /// conservative update can undercount). `n <= 0` falls back to
    /// [`Estimator::incr_hashed`].
    pub fn incr_conservative_hashed(&self, key: KeyHash, n: isize) -> isize {
        if n <= 0 {
            return self.incr_hashed(key, n);
        }
        let rows = self.row_seeds.len();
        // Up to 16 rows on the stack; larger sketches fall back to plain incr
        // (16 rows already means a 1e-7 failure probability).
        if rows > MAX_CU_ROWS {
            return self.incr_hashed(key, n);
        }
        let mut idx = [0usize; MAX_CU_ROWS];
        for (row, seeds) in self.row_seeds.iter().enumerate() {
            idx[row] = row * self.slots + column(key.0, *seeds, self.slots);
        }
        let mut seen = [0isize; MAX_CU_ROWS];
        'retry: loop {
            let mut min = isize::MAX;
            for r in 0..rows {
                seen[r] = self.cells[idx[r]].load(Ordering::Relaxed);
                min = min.min(seen[r]);
            }
            let target = min.saturating_add(n);
            for r in 0..rows {
                if seen[r] >= target {
                    continue;
                }
                if self.cells[idx[r]]
                    .compare_exchange(seen[r], target, Ordering::Relaxed, Ordering::Relaxed)
                    .is_err()
                {
                    continue 'retry;
                }
            }
            return target;
        }
    }

    /// [`Estimator::incr_conservative_hashed`] for an unhashed key.
    pub fn incr_conservative<K: Hash>(&self, key: K, n: isize) -> isize {
        self.incr_conservative_hashed(self.hash(key), n)
    }

    /// Zero every counter. Concurrent increments may survive or be lost;
    /// callers rotate estimators so that nobody writes one being reset
    /// (see [`crate::Rate`]).
    pub fn reset(&self) {
        for c in self.cells.iter() {
            c.store(0, Ordering::Relaxed);
        }
    }
}

impl std::fmt::Debug for Estimator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Estimator")
            .field("hashes", &self.hashes())
            .field("slots", &self.slots)
            .finish_non_exhaustive()
    }
}

const MAX_CU_ROWS: usize = 16;

/// `(H, N)` for a target error: `N = ceil(e / epsilon)`, `H = ceil(ln(1 / delta))`.
pub fn dimensions(epsilon: f64, delta: f64) -> (usize, usize) {
    let eps = epsilon.clamp(1e-6, 1.0 - f64::EPSILON);
    let delta = delta.clamp(1e-9, 1.0 - f64::EPSILON);
    let slots = (std::f64::consts::E / eps).ceil() as usize;
    let hashes = (1.0 / delta).ln().ceil().max(1.0) as usize;
    (hashes, slots.max(1))
}

/// Column of a key hash in one row: Dietzfelbinger's multiply-add-shift,
/// `((a * h + b) mod 2^128) >> 64` with the row's random 128-bit `a` and `b`,
/// which is strongly universal (pairwise independent) over 64-bit inputs, as
/// the count-min bound assumes; then mapped onto `0..slots` by a 64x64
/// multiply (no division, any `slots`). Rows draw `a`, `b` independently, so
/// two keys share all H counters with probability `N^-H` (plus 2^-64 for
/// equal key hashes).
#[inline(always)]
fn column(h: u64, (a, b): (u128, u128), slots: usize) -> usize {
    let x = (a.wrapping_mul(u128::from(h)).wrapping_add(b) >> 64) as u64;
    ((u128::from(x) * slots as u128) >> 64) as usize
}

fn splitmix64(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// A fresh random seed: std's `RandomState` is keyed from the OS RNG per
/// process and varies per instance, so no RNG dependency is needed.
pub(crate) fn random_seed() -> u64 {
    StdRandomState::new().hash_one(0x5049_4552u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn incr_get_decr() {
        let e = Estimator::with_seed(4, 64, 7);
        assert_eq!(e.incr("a", 1), 1);
        assert_eq!(e.incr("b", 1), 1);
        assert_eq!(e.incr("a", 2), 3);
        assert_eq!(e.get("a"), 3);
        e.decr("a", 3);
        assert_eq!(e.get("a"), 0);
        assert_eq!(e.get("b"), 1);
        e.reset();
        assert_eq!(e.get("b"), 0);
    }

    #[test]
    fn byte_slice_keys() {
        let e = Estimator::with_seed(2, 1024, 1);
        e.incr(&b"10.0.0.1"[..], 5);
        assert_eq!(e.get(&b"10.0.0.1"[..]), 5);
    }

    #[test]
    fn dimensions_follow_the_formula() {
        assert_eq!(dimensions(0.01, 0.01), (5, 272));
        assert_eq!(dimensions(0.001, 1e-6), (14, 2719));
        let e = Estimator::with_error(0.01, 0.05);
        assert_eq!((e.hashes(), e.slots()), (3, 272));
        assert!(e.memory_bytes() >= 3 * 272 * 8);
    }

    #[test]
    fn conservative_update_is_exact_without_collisions() {
        let e = Estimator::with_seed(4, 4096, 3);
        for i in 1..=100 {
            assert_eq!(e.incr_conservative("k", 1), i);
        }
        assert_eq!(e.get("k"), 100);
    }

    #[test]
    fn one_slot_sums_everything() {
        let e = Estimator::with_seed(3, 1, 3);
        e.incr("a", 2);
        e.incr("b", 3);
        assert_eq!(e.get("zzz"), 5);
    }

    /// Rows behave as independent uniform hashes: two keys share a row's
    /// counter with probability 1/N and both rows' with 1/N^2.
    #[test]
    fn rows_collide_independently() {
        let e = Estimator::with_seed(2, 16, 99);
        let col = |k: u64, row: usize| column(e.hash(k).0, e.row_seeds[row], e.slots);
        let pairs = 40_000u64;
        let (mut one, mut both) = (0u64, 0u64);
        for i in 0..pairs {
            let (x, y) = (2 * i, 2 * i + 1);
            let r0 = col(x, 0) == col(y, 0);
            let r1 = col(x, 1) == col(y, 1);
            one += u64::from(r0);
            both += u64::from(r0 && r1);
        }
        // Expected 2500 and 156; bounds are ~5 standard deviations.
        assert!((2250..2750).contains(&one), "one row: {one}");
        assert!((95..220).contains(&both), "both rows: {both}");
    }

    #[test]
    fn columns_cover_all_slots_evenly() {
        let e = Estimator::with_seed(1, 10, 5);
        let mut hist = [0u32; 10];
        for k in 0..100_000u64 {
            hist[column(e.hash(k).0, e.row_seeds[0], e.slots)] += 1;
        }
        assert!(
            hist.iter().all(|&n| (9_500..10_500).contains(&n)),
            "{hist:?}"
        );
    }

    #[test]
    fn seeds_differ_per_instance() {
        assert_ne!(Estimator::new(1, 1).seed(), Estimator::new(1, 1).seed());
    }
}
