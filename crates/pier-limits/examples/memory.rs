//! Peak heap of each counter after 1M distinct keys, measured with dhat's
//! counting allocator (the tool pingora-limits' numbers came from).
//!
//! `cargo run -p pier-limits --release --example memory`

#[global_allocator]
static ALLOC: dhat::Alloc = dhat::Alloc;

#[path = "../benches/common/mod.rs"]
mod common;
use common::*;

fn measure<C: Counter>(make: impl FnOnce() -> C) {
    let profiler = dhat::Profiler::builder().testing().build();
    let counter = make();
    let name = counter.name();
    let mut rng = Rng(1);
    // Every key at least once, then 1M more uniform events.
    for k in 0..KEYS {
        counter.incr(k);
    }
    for _ in 0..KEYS {
        counter.incr(rng.key());
    }
    let stats = dhat::HeapStats::get();
    drop(counter);
    drop(profiler);
    println!(
        "{name:32} peak {:>12} bytes  now {:>12} bytes  allocated {:>12} bytes in {:>5} blocks",
        stats.max_bytes, stats.curr_bytes, stats.total_bytes, stats.total_blocks
    );
}

fn main() {
    println!("heap after {KEYS} distinct keys (estimators {HASHES}x{SLOTS}):");
    measure(pier);
    measure(pingora);
    measure(Naive::default);
    measure(Dash::default);
    // A limiter under a flood of distinct keys: heap is what construction took.
    let profiler = dhat::Profiler::builder().testing().build();
    let limiter = pier_limits::RateLimiter::new(pier_limits::RateLimit::per_second(10));
    let built = dhat::HeapStats::get().curr_bytes;
    let mut key = [0u8; 8];
    for k in 0..KEYS {
        key.copy_from_slice(&k.to_le_bytes());
        let _ = limiter.check(&key, k / 1000);
    }
    let stats = dhat::HeapStats::get();
    println!(
        "{:32} built {built:>11} bytes  peak {:>12} bytes after {KEYS} distinct keys over {} s",
        "RateLimiter (default sketch)",
        stats.max_bytes,
        KEYS / 1_000_000
    );
    drop(limiter);
    drop(profiler);
}
