//! Many threads at once (bounded: a fixed number of threads and events):
//! nothing is lost, limits hold exactly for one key.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Barrier;
use std::time::Duration;

use pier_limits::{
    ConcurrencyLimit, ConcurrencyLimiter, Estimator, Inflight, Rate, RateLimit, RateLimiter,
};

const THREADS: usize = 8;

/// Deterministic per-thread key streams over a shared key space.
fn keys(thread: usize, n: usize, space: u64) -> Vec<u64> {
    let mut x = 0x2545_F491_4F6C_DD1Du64 ^ (thread as u64 + 1).wrapping_mul(0x9E37_79B9);
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x % space
        })
        .collect()
}

#[test]
fn concurrent_increments_lose_nothing() {
    for conservative in [false, true] {
        let e = Estimator::with_seed(4, 256, 17);
        let barrier = Barrier::new(THREADS);
        std::thread::scope(|s| {
            for t in 0..THREADS {
                let (e, barrier) = (&e, &barrier);
                s.spawn(move || {
                    barrier.wait();
                    for k in keys(t, 20_000, 5_000) {
                        if conservative {
                            e.incr_conservative(k, 1);
                        } else {
                            e.incr(k, 1);
                        }
                        // A shared hot key too.
                        if k % 4 == 0 {
                            if conservative {
                                e.incr_conservative("hot", 1);
                            } else {
                                e.incr("hot", 1);
                            }
                        }
                    }
                });
            }
        });
        let mut truth: HashMap<u64, isize> = HashMap::new();
        let mut hot = 0;
        for t in 0..THREADS {
            for k in keys(t, 20_000, 5_000) {
                *truth.entry(k).or_default() += 1;
                hot += isize::from(k % 4 == 0);
            }
        }
        for (k, n) in &truth {
            assert!(
                e.get(k) >= *n,
                "key {k}: {} < {n} (conservative {conservative})",
                e.get(k)
            );
        }
        assert!(e.get("hot") >= hot);
    }
}

#[test]
fn single_key_is_exact_under_contention() {
    let e = Estimator::with_seed(4, 1024, 1);
    let per = 50_000;
    let barrier = Barrier::new(THREADS);
    std::thread::scope(|s| {
        for _ in 0..THREADS {
            let (e, barrier) = (&e, &barrier);
            s.spawn(move || {
                barrier.wait();
                for _ in 0..per {
                    e.incr(b"only".as_slice(), 1);
                }
            });
        }
    });
    assert_eq!(e.get(b"only".as_slice()), (THREADS * per) as isize);
}

#[test]
fn inflight_returns_to_zero() {
    let f = Inflight::from_estimator(Estimator::with_seed(4, 512, 2));
    let peak = AtomicUsize::new(0);
    std::thread::scope(|s| {
        for t in 0..THREADS {
            let (f, peak) = (&f, &peak);
            s.spawn(move || {
                for k in keys(t, 5_000, 64) {
                    let (_g, n) = f.incr(k);
                    peak.fetch_max(n as usize, Ordering::Relaxed);
                }
            });
        }
    });
    for k in 0..64u64 {
        assert_eq!(f.get(k), 0);
    }
    assert!(peak.load(Ordering::Relaxed) >= 1);
}

#[test]
fn rate_limit_admits_exactly_the_limit_across_threads() {
    // All threads in one window: exactly rate + burst pass, however they race.
    let l = RateLimiter::from_rate(
        RateLimit::per_second(100).burst(20),
        Rate::with_seed(Duration::from_secs(1), 4, 1024, 3),
    );
    let allowed = AtomicUsize::new(0);
    std::thread::scope(|s| {
        for _ in 0..THREADS {
            let (l, allowed) = (&l, &allowed);
            s.spawn(move || {
                for _ in 0..100 {
                    if l.check(b"10.0.0.1", 5_000).is_allowed() {
                        allowed.fetch_add(1, Ordering::Relaxed);
                    }
                }
            });
        }
    });
    assert_eq!(allowed.load(Ordering::Relaxed), 120);
    assert_eq!(l.denied_total(), (THREADS * 100 - 120) as u64);
}

#[test]
fn rate_rotates_under_concurrent_observers() {
    // Threads observe while time (injected) moves through windows: each
    // window's count is at least what was observed in it, and a window that
    // saw no events reports none.
    let r = Rate::with_seed(Duration::from_millis(100), 4, 1024, 4);
    let windows = 20u64;
    let per_window = 500usize;
    for w in 0..windows {
        let barrier = Barrier::new(THREADS);
        std::thread::scope(|s| {
            for t in 0..THREADS {
                let (r, barrier) = (&r, &barrier);
                s.spawn(move || {
                    barrier.wait();
                    for i in 0..per_window {
                        // Times spread over the window, slightly out of order.
                        let now = w * 100 + ((i + t * 7) % 100) as u64;
                        r.observe_at("k", 1, now);
                    }
                });
            }
        });
        let h = r.hash("k");
        let seen = r.observe_window(h, 0, w * 100 + 99);
        assert_eq!(seen.curr, (THREADS * per_window) as isize, "window {w}");
        if w > 0 {
            assert_eq!(seen.prev, (THREADS * per_window) as isize, "window {w}");
        }
    }
    // After a gap, nothing remains.
    assert_eq!(r.rate_at("k", windows * 100 + 250), 0.0);
}

#[test]
fn concurrency_limit_holds_under_threads() {
    let l = ConcurrencyLimiter::new(ConcurrencyLimit::new(3));
    let max_seen = AtomicUsize::new(0);
    let live = AtomicUsize::new(0);
    std::thread::scope(|s| {
        for _ in 0..THREADS {
            let (l, max_seen, live) = (&l, &max_seen, &live);
            s.spawn(move || {
                for _ in 0..2_000 {
                    if let Ok(g) = l.acquire(b"origin:10.0.0.9:80") {
                        let n = live.fetch_add(1, Ordering::SeqCst) + 1;
                        max_seen.fetch_max(n, Ordering::SeqCst);
                        live.fetch_sub(1, Ordering::SeqCst);
                        drop(g);
                    }
                }
            });
        }
    });
    assert!(max_seen.load(Ordering::SeqCst) <= 3);
    assert_eq!(l.in_flight(b"origin:10.0.0.9:80"), 0);
}
