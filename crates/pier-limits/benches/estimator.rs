//! `cargo bench -p pier-limits`: ns per `incr` for Pier's count-min sketch,
//! pingora-limits' (the peer), a `Mutex<HashMap>` and a `DashMap`, single
//! thread and 2 threads, over 1M uniform keys; then each structure's memory
//! after 1M keys. Short measurements (3 s) keep the run near 2 minutes; the
//! 100M-event run is `examples/throughput.rs`, peak heap `examples/memory.rs`.

use std::hint::black_box;
use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, Criterion};

mod common;
use common::*;

const STREAM: usize = 1 << 20;

fn run_single(c: &mut Criterion, counter: &dyn Counter, keys: &[u64]) {
    let mask = keys.len() - 1;
    c.bench_function(&format!("incr/1 thread/{}", counter.name()), |b| {
        b.iter_custom(|iters| {
            let start = Instant::now();
            for i in 0..iters as usize {
                counter.incr(black_box(keys[i & mask]));
            }
            start.elapsed()
        })
    });
}

/// Time per iteration is wall time for each of 2 threads doing one event:
/// ns per event per thread, as pingora-limits reports its threaded numbers.
fn run_threads(c: &mut Criterion, counter: &dyn Counter, keys: &[u64], threads: usize) {
    let mask = keys.len() - 1;
    c.bench_function(&format!("incr/{threads} threads/{}", counter.name()), |b| {
        b.iter_custom(|iters| {
            let start = Instant::now();
            std::thread::scope(|s| {
                for t in 0..threads {
                    s.spawn(move || {
                        let off = t * (keys.len() / threads);
                        for i in 0..iters as usize {
                            counter.incr(black_box(keys[(i + off) & mask]));
                        }
                    });
                }
            });
            start.elapsed()
        })
    });
}

fn benches(c: &mut Criterion) {
    let keys = key_stream(STREAM, 7);
    let threads = 2;

    let pier = pier();
    let cons = pier_conservative();
    let ping = pingora();
    let naive = Naive::default();
    let dash = Dash::default();
    // Fill the maps with all 1M keys first so they are measured at full size.
    for k in 0..KEYS {
        naive.incr(k);
        dash.incr(k);
    }
    let all: [&dyn Counter; 5] = [&pier, &cons, &ping, &naive, &dash];
    for counter in all {
        run_single(c, counter, &keys);
    }
    for counter in all {
        run_threads(c, counter, &keys, threads);
    }

    // What a proxy pays per request: hash a composite key, rotate if due,
    // read the previous window, count, compare. 16 requests per ms (16k
    // req/s) over 1M client keys, limiter sized for that rate.
    let limiter = pier_limits::RateLimiter::sized_for(
        pier_limits::RateLimit::per_second(10).burst(5),
        16_000,
    );
    // Request counter across criterion's calls, so that time only moves on.
    let mut n = 0usize;
    c.bench_function("RateLimiter::check/1 thread", |b| {
        b.iter_custom(|iters| {
            let mut key = *b"route:api|ip:00000000";
            let start = Instant::now();
            for _ in 0..iters {
                key[13..].copy_from_slice(&keys[n & (STREAM - 1)].to_le_bytes());
                black_box(limiter.check(black_box(&key), (n >> 4) as u64));
                n += 1;
            }
            start.elapsed()
        })
    });
    println!(
        "RateLimiter::check: {} of {n} requests denied",
        limiter.denied_total()
    );

    // Memory after 1M keys. Estimators: the counter array. Maps: capacity x
    // (key + value + control byte), a lower bound; examples/memory.rs
    // measures real peak heap with a counting allocator.
    let naive_cap = naive.0.lock().unwrap().capacity();
    let dash_cap = dash.0.capacity();
    println!("\nmemory after {KEYS} keys:");
    println!(
        "  pier Estimator {HASHES}x{SLOTS}: {} bytes",
        pier.0.memory_bytes()
    );
    println!(
        "  pingora-limits Estimator {HASHES}x{SLOTS}: {} bytes (counters)",
        HASHES * SLOTS * 8
    );
    println!(
        "  Mutex<HashMap<u64,isize>>: capacity {naive_cap}, >= {} bytes",
        naive_cap * (8 + 8 + 1)
    );
    println!(
        "  DashMap<u64,AtomicIsize>: capacity {dash_cap}, >= {} bytes",
        dash_cap * (8 + 8 + 1)
    );
}

criterion_group! {
    name = group;
    config = Criterion::default()
        .sample_size(10)
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(3));
    targets = benches
}
criterion_main!(group);
