//! 100M events over 1M uniform keys: ns per event for each counter, on one
//! thread and on all threads (the benchmark, after pingora-limits').
//!
//! `cargo run -p pier-limits --release --example throughput [-- EVENTS]`

use std::time::Instant;

#[path = "../benches/common/mod.rs"]
mod common;
use common::*;

/// Each thread does `events / threads` events; returns ns per event per
/// thread (each thread's average, as pingora-limits reports) and the
/// aggregate ns per event (wall time / all events).
fn run(counter: &dyn Counter, events: u64, threads: u64) -> (f64, f64) {
    let per_thread = events / threads;
    let start = Instant::now();
    std::thread::scope(|s| {
        for t in 0..threads {
            s.spawn(move || {
                let mut rng = Rng(0x1234 + t);
                for _ in 0..per_thread {
                    counter.incr(rng.key());
                }
            });
        }
    });
    let ns = start.elapsed().as_nanos() as f64;
    (ns / per_thread as f64, ns / (per_thread * threads) as f64)
}

fn main() {
    let events: u64 = std::env::args()
        .nth(1)
        .map(|a| a.parse().expect("EVENTS must be an integer"))
        .unwrap_or(100_000_000);
    let threads = std::thread::available_parallelism().map_or(2, |n| n.get()) as u64;
    println!(
        "{events} events, {KEYS} uniform keys, estimators {HASHES}x{SLOTS}, {threads} threads"
    );
    println!(
        "{:32} {:>14} {:>22} {:>20}",
        "counter", "1 thread ns/ev", "N threads ns/ev/thread", "N threads wall ns/ev"
    );
    let makers: [fn() -> Box<dyn Counter>; 5] = [
        || Box::new(pier()),
        || Box::new(pier_conservative()),
        || Box::new(pingora()),
        || Box::new(Naive::default()),
        || Box::new(Dash::default()),
    ];
    for make in makers {
        let single = make();
        let (one, _) = run(single.as_ref(), events, 1);
        drop(single);
        let multi = make();
        let (per_thread, wall) = run(multi.as_ref(), events, threads);
        println!(
            "{:32} {one:>14.1} {per_thread:>22.1} {wall:>20.1}",
            multi.name()
        );
    }
}
