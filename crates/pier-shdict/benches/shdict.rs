//! get-hit and incr, on one thread and on two threads sharing the dict.
//!
//! The two-thread cases report the wall time for *each* thread to do one
//! operation (so half the per-op cost means perfect scaling).

use std::hint::black_box;
use std::sync::{Arc, Barrier};
use std::thread;
use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, Criterion};
use pier_shdict::{SharedDict, Value};

const KEYS: usize = 1024;

fn keys() -> Vec<Vec<u8>> {
    (0..KEYS)
        .map(|i| format!("client:10.0.{}.{}", i / 256, i % 256).into_bytes())
        .collect()
}

fn filled() -> Arc<SharedDict> {
    let d = SharedDict::new("bench", 8 << 20);
    let val = vec![b'v'; 32];
    for k in keys() {
        d.set(&k, Value::Str(&val), 0, 0, 1);
        // Numbers under a different key prefix for incr.
        let mut n = k.clone();
        n.push(b'#');
        d.set(&n, Value::Number(0.0), 0, 0, 1);
    }
    Arc::new(d)
}

fn two_threads(
    d: &Arc<SharedDict>,
    iters: u64,
    op: fn(&SharedDict, &[u8], &mut Vec<u8>),
) -> Duration {
    let barrier = Arc::new(Barrier::new(2));
    let handles: Vec<_> = (0..2)
        .map(|t| {
            let d = Arc::clone(d);
            let barrier = Arc::clone(&barrier);
            thread::spawn(move || {
                let keys = keys();
                let mut out = Vec::with_capacity(64);
                barrier.wait();
                let start = Instant::now();
                for i in 0..iters as usize {
                    op(&d, &keys[(i * 7 + t * 13) % KEYS], &mut out);
                }
                start.elapsed()
            })
        })
        .collect();
    handles
        .into_iter()
        .map(|h| h.join().expect("bench thread"))
        .max()
        .unwrap_or_default()
}

fn get_op(d: &SharedDict, k: &[u8], out: &mut Vec<u8>) {
    black_box(d.get(k, 2, out));
}

fn incr_op(d: &SharedDict, k: &[u8], out: &mut Vec<u8>) {
    // Reuse `out` as the key buffer: key + '#' without allocating.
    out.clear();
    out.extend_from_slice(k);
    out.push(b'#');
    black_box(d.incr(out, 1.0, Some(0.0), 0, 2).ok());
}

fn bench(c: &mut Criterion) {
    let d = filled();
    let keys = keys();
    let mut g = c.benchmark_group("shdict");
    g.measurement_time(Duration::from_secs(2));
    g.warm_up_time(Duration::from_millis(500));

    g.bench_function("get_hit/1_thread", |b| {
        let mut out = Vec::with_capacity(64);
        let mut i = 0;
        b.iter(|| {
            i = (i + 7) % KEYS;
            get_op(&d, &keys[i], &mut out);
        })
    });
    g.bench_function("incr/1_thread", |b| {
        let mut out = Vec::with_capacity(64);
        let mut i = 0;
        b.iter(|| {
            i = (i + 7) % KEYS;
            incr_op(&d, &keys[i], &mut out);
        })
    });
    g.bench_function("get_hit/2_threads", |b| {
        b.iter_custom(|iters| two_threads(&d, iters, get_op))
    });
    g.bench_function("incr/2_threads", |b| {
        b.iter_custom(|iters| two_threads(&d, iters, incr_op))
    });
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
