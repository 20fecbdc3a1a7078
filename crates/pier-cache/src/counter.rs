//! Counters each thread bumps in a cache line of its own, summed when
//! read. A zone is shared by every worker, and one atomic per counter
//! would move its cache line between cores on every lookup (every hit
//! counts one); `/metrics` reads are rare.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering::Relaxed};

const SHARDS: usize = 8;

/// 128 bytes: the adjacent-line prefetcher pairs 64-byte lines.
#[repr(align(128))]
#[derive(Debug, Default)]
struct Slot(AtomicU64);

#[derive(Debug, Default)]
pub struct Counter([Slot; SHARDS]);

static NEXT: AtomicUsize = AtomicUsize::new(0);

thread_local! {
    /// This thread's shard, handed out in turn (workers get distinct ones
    /// up to `SHARDS` threads).
    static SHARD: usize = NEXT.fetch_add(1, Relaxed) % SHARDS;
}

impl Counter {
    #[inline]
    pub fn add(&self, n: u64) {
        // A thread being torn down counts in shard 0.
        let i = SHARD.try_with(|s| *s).unwrap_or(0);
        self.0[i].0.fetch_add(n, Relaxed);
    }

    /// The sum over the shards.
    pub fn get(&self) -> u64 {
        self.0.iter().map(|s| s.0.load(Relaxed)).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn threads_add_up() {
        let c = std::sync::Arc::new(Counter::default());
        let ts: Vec<_> = (0..12)
            .map(|_| {
                let c = c.clone();
                std::thread::spawn(move || (0..1000).for_each(|_| c.add(1)))
            })
            .collect();
        ts.into_iter().for_each(|t| t.join().unwrap());
        c.add(5);
        assert_eq!(c.get(), 12_005);
    }
}
