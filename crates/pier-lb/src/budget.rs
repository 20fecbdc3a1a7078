//! Retry budget (Finagle's `RetryBudget`, linkerd's retry budgets).
//!
//! Retries are allowed while, over a sliding window of ~10 s,
//! `retries + 1 <= ratio * requests + min_per_sec * 10`. The window is ten
//! one-second buckets of atomic counters; a bucket is recycled (CAS on its
//! second, then zeroed) the first time a new second lands on it. The race
//! between recycling and a concurrent increment can lose a count or two,
//! which a budget tolerates; what it buys is no lock on any request.

use std::sync::atomic::{AtomicU64, Ordering};

const BUCKETS: u64 = 10;

#[derive(Debug)]
struct Bucket {
    /// The second (clock_ms / 1000) this bucket counts; u64::MAX = unused.
    sec: AtomicU64,
    requests: AtomicU64,
    retries: AtomicU64,
}

#[derive(Debug)]
pub struct RetryBudget {
    /// ratio in millionths (integer arithmetic on the retry path).
    ratio_ppm: u64,
    /// min_per_sec * window seconds: the reserve that lets a quiet group
    /// still retry.
    reserve: u64,
    buckets: [Bucket; BUCKETS as usize],
}

impl RetryBudget {
    pub fn new(ratio: f64, min_per_sec: u32) -> RetryBudget {
        let ratio = if ratio.is_finite() {
            ratio.max(0.0)
        } else {
            0.0
        };
        RetryBudget {
            ratio_ppm: (ratio * 1_000_000.0) as u64,
            reserve: u64::from(min_per_sec) * BUCKETS,
            buckets: std::array::from_fn(|_| Bucket {
                sec: AtomicU64::new(u64::MAX),
                requests: AtomicU64::new(0),
                retries: AtomicU64::new(0),
            }),
        }
    }

    fn bucket(&self, sec: u64) -> &Bucket {
        let b = &self.buckets[(sec % BUCKETS) as usize];
        let cur = b.sec.load(Ordering::Acquire);
        if cur != sec
            && (cur == u64::MAX || cur < sec)
            && b.sec
                .compare_exchange(cur, sec, Ordering::AcqRel, Ordering::Acquire)
                .is_ok()
        {
            b.requests.store(0, Ordering::Relaxed);
            b.retries.store(0, Ordering::Relaxed);
        }
        b
    }

    /// Count one request (first attempts only).
    pub fn on_request(&self, now_ms: u64) {
        self.bucket(now_ms / 1000)
            .requests
            .fetch_add(1, Ordering::Relaxed);
    }

    /// (requests, retries) in the window ending at `now_ms`.
    pub fn window(&self, now_ms: u64) -> (u64, u64) {
        let sec = now_ms / 1000;
        let (mut req, mut ret) = (0, 0);
        for b in &self.buckets {
            let s = b.sec.load(Ordering::Acquire);
            if s != u64::MAX && s <= sec && sec - s < BUCKETS {
                req += b.requests.load(Ordering::Relaxed);
                ret += b.retries.load(Ordering::Relaxed);
            }
        }
        (req, ret)
    }

    /// May this request retry? Counts the retry when it may.
    pub fn try_retry(&self, now_ms: u64) -> bool {
        let (req, ret) = self.window(now_ms);
        let allowed = req.saturating_mul(self.ratio_ppm) / 1_000_000 + self.reserve;
        if ret < allowed {
            self.bucket(now_ms / 1000)
                .retries
                .fetch_add(1, Ordering::Relaxed);
            true
        } else {
            false
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ratio_bounds_retries() {
        let b = RetryBudget::new(0.2, 0);
        let t = 5_000;
        for _ in 0..100 {
            b.on_request(t);
        }
        let granted = (0..100).filter(|_| b.try_retry(t)).count();
        assert_eq!(granted, 20);
    }

    #[test]
    fn reserve_allows_retries_without_traffic() {
        let b = RetryBudget::new(0.2, 1);
        let granted = (0..100).filter(|_| b.try_retry(1_000)).count();
        assert_eq!(granted, 10, "1/s over a 10 s window");
    }

    #[test]
    fn window_slides() {
        let b = RetryBudget::new(0.5, 0);
        for _ in 0..10 {
            b.on_request(1_000);
        }
        assert_eq!((0..10).filter(|_| b.try_retry(1_500)).count(), 5);
        assert!(!b.try_retry(9_999));
        // 10 s later those requests and retries have left the window.
        assert_eq!(b.window(11_000), (0, 0));
        assert!(!b.try_retry(11_000), "no requests, no reserve");
        for _ in 0..4 {
            b.on_request(11_000);
        }
        assert_eq!((0..10).filter(|_| b.try_retry(11_200)).count(), 2);
    }

    #[test]
    fn buckets_recycle() {
        let b = RetryBudget::new(1.0, 0);
        for s in 0..35u64 {
            b.on_request(s * 1000 + 1);
        }
        assert_eq!(b.window(34_500).0, 10);
    }

    #[test]
    fn concurrent_requests_counted() {
        let b = std::sync::Arc::new(RetryBudget::new(0.1, 0));
        let threads: Vec<_> = (0..4)
            .map(|_| {
                let b = b.clone();
                std::thread::spawn(move || {
                    for _ in 0..10_000 {
                        b.on_request(42_000);
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        // The bucket was claimed before the threads started racing on it
        // only if one of them won the CAS first; allow the documented loss.
        let (req, _) = b.window(42_000);
        assert!(req > 39_900 && req <= 40_000, "{req}");
    }
}
