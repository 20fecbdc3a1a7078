//! The counters compared by `benches/estimator.rs` and the examples: the same
//! `incr(key)` over Pier's estimator, pingora-limits', a `Mutex<HashMap>` and
//! a `DashMap`. Keys are `u64`; maps use foldhash so the hash is not what
//! differs.
#![allow(dead_code)]

use std::collections::HashMap;
use std::sync::atomic::{AtomicIsize, Ordering};
use std::sync::Mutex;

use dashmap::DashMap;

/// Sketch size for both estimators in the comparison: pingora-limits' own
/// benchmark setting (3 x 1024, 24 KiB).
pub const HASHES: usize = 3;
pub const SLOTS: usize = 1024;
/// Distinct keys in the stream.
pub const KEYS: u64 = 1_000_000;

type Fold = foldhash::fast::RandomState;

pub trait Counter: Sync {
    fn name(&self) -> &'static str;
    fn incr(&self, key: u64);
}

pub struct Pier(pub pier_limits::Estimator);
impl Counter for Pier {
    fn name(&self) -> &'static str {
        "pier Estimator"
    }
    #[inline]
    fn incr(&self, key: u64) {
        self.0.incr(key, 1);
    }
}

pub struct PierConservative(pub pier_limits::Estimator);
impl Counter for PierConservative {
    fn name(&self) -> &'static str {
        "pier Estimator (conservative)"
    }
    #[inline]
    fn incr(&self, key: u64) {
        self.0.incr_conservative(key, 1);
    }
}

pub struct Pingora(pub pingora_limits::estimator::Estimator);
impl Counter for Pingora {
    fn name(&self) -> &'static str {
        "pingora-limits Estimator"
    }
    #[inline]
    fn incr(&self, key: u64) {
        self.0.incr(key, 1);
    }
}

#[derive(Default)]
pub struct Naive(pub Mutex<HashMap<u64, isize, Fold>>);
impl Counter for Naive {
    fn name(&self) -> &'static str {
        "Mutex<HashMap>"
    }
    #[inline]
    fn incr(&self, key: u64) {
        *self.0.lock().unwrap().entry(key).or_insert(0) += 1;
    }
}

#[derive(Default)]
pub struct Dash(pub DashMap<u64, AtomicIsize, Fold>);
impl Counter for Dash {
    fn name(&self) -> &'static str {
        "DashMap"
    }
    #[inline]
    fn incr(&self, key: u64) {
        // Existing keys take a shard read lock and an atomic add, as in
        // pingora-limits' "optimized" counter; new keys take the write lock.
        if let Some(v) = self.0.get(&key) {
            v.fetch_add(1, Ordering::Relaxed);
            return;
        }
        self.0
            .entry(key)
            .or_insert_with(|| AtomicIsize::new(0))
            .fetch_add(1, Ordering::Relaxed);
    }
}

pub fn pier() -> Pier {
    Pier(pier_limits::Estimator::with_seed(HASHES, SLOTS, 42))
}
pub fn pier_conservative() -> PierConservative {
    PierConservative(pier_limits::Estimator::with_seed(HASHES, SLOTS, 42))
}
pub fn pingora() -> Pingora {
    Pingora(pingora_limits::estimator::Estimator::new(HASHES, SLOTS))
}

/// wyrand: a 1 ns generator so that key generation costs the same, and
/// little, for every counter.
pub struct Rng(pub u64);
impl Rng {
    #[inline]
    pub fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0xa076_1d64_78bd_642f);
        let t = (self.0 as u128) * ((self.0 ^ 0xe703_7ed1_a0b4_28db) as u128);
        ((t >> 64) as u64) ^ (t as u64)
    }
    /// Uniform in `0..KEYS`.
    #[inline]
    pub fn key(&mut self) -> u64 {
        ((self.next() as u128 * KEYS as u128) >> 64) as u64
    }
}

/// A pregenerated stream of `len` (a power of two) uniform keys over `KEYS`.
pub fn key_stream(len: usize, seed: u64) -> Vec<u64> {
    assert!(len.is_power_of_two());
    let mut rng = Rng(seed);
    (0..len).map(|_| rng.key()).collect()
}
