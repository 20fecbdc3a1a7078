//! Benchmark for bench/analytics_kafka.sh (issue 12): starts its own Kafka
//! and PostgreSQL (testenv), then
//! 1. sink throughput: N events offered as fast as one thread can, per
//!    compression codec; events acknowledged per second and per CPU-second
//!    of this process (the offering thread plus librdkafka's threads), and
//!    the offering thread's own cost per event;
//! 2. end-to-end lag: events at a fixed rate through the sink, `pier
//!    aggregate`'s loop (aggregate::run, in a thread) into PostgreSQL; each
//!    100 ms slot of events has its own host, and a poller records when
//!    PostgreSQL's row for it is complete. Lag = that time minus the time
//!    the slot's last event was offered.
//!
//! Env: PIER_KAFKA_LIBS, PIER_PG_BIN (as the tests), BENCH_EVENTS (sink
//! phase, default 2000000), BENCH_RATE (events/s, default 20000),
//! BENCH_SECS (lag phase, default 30), BENCH_FLUSH (aggregator flush
//! intervals, default "1s,200ms").

use pier_analytics::EventRef;
use pier_kafka::aggregate::{self, AggregateConfig};
use pier_kafka::testenv::{Kafka, Postgres};
use pier_kafka::{Sink, SinkConfig};
use std::collections::HashMap;
use std::net::{IpAddr, Ipv4Addr};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

fn env_or<T: std::str::FromStr>(name: &str, default: T) -> T {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// CPU seconds (user + system) from a /proc stat file.
fn cpu(path: &str) -> f64 {
    let s = std::fs::read_to_string(path).unwrap_or_default();
    // Fields after the command name (which is in parentheses).
    let rest = s.rsplit_once(')').map(|x| x.1).unwrap_or("");
    let f: Vec<&str> = rest.split_whitespace().collect();
    let ticks: f64 = f.get(11).and_then(|v| v.parse::<f64>().ok()).unwrap_or(0.0)
        + f.get(12).and_then(|v| v.parse::<f64>().ok()).unwrap_or(0.0);
    ticks / 100.0
}

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

fn event(i: u64, ts_ms: u64, host: &[u8], f: impl FnOnce(&EventRef)) {
    let path = format!("/api/v1/items/{}", i % 1000);
    f(&EventRef {
        ts_ms,
        host,
        route: "api",
        method: b"GET",
        path: path.as_bytes(),
        status: if i.is_multiple_of(50) { 503 } else { 200 },
        bytes_in: 350 + i % 100,
        bytes_out: 2000 + (i * 7919) % 60_000,
        duration_us: 800 + (i * 31) % 20_000,
        upstream_us: 700 + (i * 29) % 19_000,
        client_ip: IpAddr::V4(Ipv4Addr::from(0x0a00_0000u32 + (i % 100_000) as u32)),
        user_agent: b"Mozilla/5.0 (X11; Linux x86_64) AppleWebKit/537.36 (KHTML, like Gecko) Chrome/120.0 Safari/537.36",
        listener: "main",
        upstream: b"10.1.2.3:8080",
        cache: "MISS",
        protocol: "HTTP/1.1",
        tls_version: "TLSv1.3",
        extra: &[],
        trace_id: b"",
        span_id: b"",
    })
}

fn pct(v: &mut [f64], q: f64) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[((v.len() as f64 - 1.0) * q).round() as usize]
}

fn main() {
    let n: u64 = env_or("BENCH_EVENTS", 2_000_000);
    let rate: u64 = env_or("BENCH_RATE", 20_000);
    let secs: u64 = env_or("BENCH_SECS", 30);
    let flushes: String = env_or("BENCH_FLUSH", "1s,200ms".to_string());
    let t = Instant::now();
    let kafka = Kafka::start();
    let pg = Postgres::start();
    println!(
        "kafka ready in {:.1?}, postgres ready, {:.1?} in all",
        kafka.started_in,
        t.elapsed()
    );
    let mut bytes = 0usize;
    event(1, now_ms(), b"www.example.com", |e| {
        bytes = pier_kafka::event::encode(e).len()
    });
    let mut enc = pier_kafka::event::Encoder::new();
    let (tc0, m) = (cpu("/proc/thread-self/stat"), 1_000_000u64);
    let ts = now_ms();
    let mut total = 0usize;
    for i in 0..m {
        event(i, ts, b"www.example.com", |e| total += enc.encode(e).len());
    }
    let enc_ns = (cpu("/proc/thread-self/stat") - tc0) * 1e9 / m as f64;
    println!(
        "event size: {bytes} bytes (Cap'n Proto, packed; 100-byte user agent, 20-byte path); \
         building + encoding one: {enc_ns:.0} ns ({total} bytes for {m})"
    );

    println!("\n## sink throughput ({n} events, one offering thread, batch 10000, linger 50 ms)");
    println!("| compression | events/s (acked) | events per CPU-second (process) | offer cost (thread CPU) | dropped |");
    println!("|---|---|---|---|---|");
    for codec in ["none", "lz4", "zstd"] {
        let topic = format!("tput-{codec}");
        kafka.create_topic(&topic);
        let sink = Sink::start(&SinkConfig {
            brokers: vec![kafka.bootstrap()],
            topic,
            batch_size: 10_000,
            linger: Duration::from_millis(50),
            compression: codec.into(),
            queue: n as usize,
        })
        .unwrap();
        let ts = now_ms();
        let (cpu0, tcpu0, t0) = (
            cpu("/proc/self/stat"),
            cpu("/proc/thread-self/stat"),
            Instant::now(),
        );
        for i in 0..n {
            event(i, ts, b"www.example.com", |e| sink.offer(e));
        }
        let tcpu = cpu("/proc/thread-self/stat") - tcpu0;
        while sink.stats().queued > 0 {
            sink.flush(Duration::from_millis(100));
        }
        let wall = t0.elapsed().as_secs_f64();
        let pcpu = cpu("/proc/self/stat") - cpu0;
        let s = sink.stats();
        println!(
            "| {codec} | {:.0} | {:.0} | {:.0} ns/event | {} |",
            s.sent as f64 / wall,
            s.sent as f64 / pcpu,
            tcpu * 1e9 / n as f64,
            s.dropped
        );
    }

    for flush in flushes.split(',') {
        let flush_d = pier_kafka::parse_duration(flush).unwrap();
        let topic = format!("lag-{flush}");
        kafka.create_topic(&topic);
        let url = pg.create_db(&format!(
            "lag_{}",
            flush.replace(|c: char| !c.is_alphanumeric(), "_")
        ));
        let stop = Arc::new(AtomicBool::new(false));
        let agg = {
            let cfg = AggregateConfig {
                brokers: vec![kafka.bootstrap()],
                topic: topic.clone(),
                group: "bench".into(),
                postgres: url.clone(),
                password: None,
                flush: flush_d,
                max_keys: 10_000,
            };
            let stop = stop.clone();
            std::thread::spawn(move || aggregate::run(&cfg, &stop).unwrap())
        };
        let sink = Sink::start(&SinkConfig {
            brokers: vec![kafka.bootstrap()],
            topic,
            batch_size: 10_000,
            linger: Duration::from_millis(20),
            compression: "lz4".into(),
            queue: 1_000_000,
        })
        .unwrap();
        // Wait until the aggregator has joined and PostgreSQL has a row.
        let mut c = postgres::Client::connect(&url, postgres::NoTls).unwrap();
        let warm = Instant::now();
        loop {
            event(0, now_ms(), b"warmup", |e| sink.offer(e));
            sink.flush(Duration::from_secs(1));
            let ok = c
                .query_opt("SELECT 1 FROM pier_minute WHERE host = 'warmup'", &[])
                .map(|r| r.is_some())
                .unwrap_or(false);
            if ok {
                break;
            }
            assert!(
                warm.elapsed() < Duration::from_secs(60),
                "aggregator did not start"
            );
            std::thread::sleep(Duration::from_millis(200));
        }
        // slot -> (events, time of its last offer)
        let slots: Arc<Mutex<HashMap<String, (i64, Instant)>>> = Arc::default();
        let done: Arc<Mutex<HashMap<String, Instant>>> = Arc::default();
        let producing = Arc::new(AtomicBool::new(true));
        let poller = {
            let (slots, done, producing, url) =
                (slots.clone(), done.clone(), producing.clone(), url.clone());
            std::thread::spawn(move || {
                let mut c = postgres::Client::connect(&url, postgres::NoTls).unwrap();
                let deadline = Instant::now() + Duration::from_secs(120);
                loop {
                    let rows = c
                        .query(
                            "SELECT host, sum(requests)::int8 FROM pier_minute \
                             WHERE host LIKE 'slot%' GROUP BY host",
                            &[],
                        )
                        .unwrap();
                    let now = Instant::now();
                    let slots = slots.lock().unwrap();
                    let mut done = done.lock().unwrap();
                    for r in &rows {
                        let host: String = r.get(0);
                        let got: i64 = r.get(1);
                        if let Some(&(want, _)) = slots.get(&host) {
                            if got >= want && !done.contains_key(&host) {
                                done.insert(host, now);
                            }
                        }
                    }
                    let finished = !producing.load(Ordering::Relaxed) && done.len() == slots.len();
                    drop((slots, done));
                    if finished || Instant::now() > deadline {
                        break;
                    }
                    std::thread::sleep(Duration::from_millis(10));
                }
            })
        };
        let start = Instant::now();
        let total = rate * secs;
        let per_slot = rate / 10;
        let (cpu0, t0) = (cpu("/proc/self/stat"), Instant::now());
        for i in 0..total {
            let slot = i / per_slot;
            // Pace: event i is due at i / rate seconds.
            let due = start + Duration::from_secs_f64(i as f64 / rate as f64);
            let now = Instant::now();
            if due > now {
                std::thread::sleep(due - now);
            }
            let host = format!("slot{slot:05}");
            event(i, now_ms(), host.as_bytes(), |e| sink.offer(e));
            if (i + 1).is_multiple_of(per_slot) {
                slots
                    .lock()
                    .unwrap()
                    .insert(host, (per_slot as i64, Instant::now()));
            }
        }
        producing.store(false, Ordering::Relaxed);
        poller.join().unwrap();
        let wall = t0.elapsed().as_secs_f64();
        let pcpu = cpu("/proc/self/stat") - cpu0;
        stop.store(true, Ordering::Relaxed);
        agg.join().unwrap();
        let slots = slots.lock().unwrap();
        let done = done.lock().unwrap();
        let mut lags: Vec<f64> = slots
            .iter()
            .filter_map(|(h, (_, sent))| {
                done.get(h)
                    .map(|d| d.duration_since(*sent).as_secs_f64() * 1000.0)
            })
            .collect();
        let s = sink.stats();
        let rows: i64 = c
            .query_one(
                "SELECT sum(requests)::int8 FROM pier_minute WHERE host LIKE 'slot%'",
                &[],
            )
            .unwrap()
            .get(0);
        println!(
            "\n## end-to-end lag, {rate} events/s for {secs} s, aggregator flush {flush}\n\
             slots complete: {}/{}; rows hold {rows} of {total} events (sink: {s:?})\n\
             lag event -> PostgreSQL row: p50 {:.0} ms, p99 {:.0} ms, max {:.0} ms",
            lags.len(),
            slots.len(),
            pct(&mut lags, 0.5),
            pct(&mut lags, 0.99),
            pct(&mut lags, 1.0),
        );
        let _ = (wall, pcpu);
    }
}
