//! Helpers for tests/analytics_kafka.rs: one Kafka broker and one PostgreSQL
//! cluster per test binary (each test takes its own topic and database),
//! `pier aggregate` processes, synthetic events.
#![allow(dead_code)]

use pier_analytics::EventRef;
pub use pier_kafka::testenv::{wait_for, Kafka, Postgres};
use std::net::{IpAddr, Ipv4Addr};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

pub struct Env {
    pub kafka: Kafka,
    pub pg: Postgres,
}

/// The shared broker and database server, started by the first test that
/// asks (Kafka takes 10-20 s).
pub fn env() -> &'static Env {
    static ENV: OnceLock<Env> = OnceLock::new();
    ENV.get_or_init(|| {
        let t = Instant::now();
        let pg = Postgres::start();
        let kafka = Kafka::start();
        eprintln!(
            "kafka on {} (ready in {:?}), postgres on {}, in {:?}",
            kafka.bootstrap(),
            kafka.started_in,
            pg.port,
            t.elapsed()
        );
        Env { kafka, pg }
    })
}

/// A `pier aggregate` process; killed on drop.
pub struct Aggregator {
    child: Option<Child>,
    pub log: PathBuf,
}

impl Aggregator {
    pub fn start(
        kafka: &str,
        topic: &str,
        group: &str,
        pg_url: &str,
        flush: &str,
        extra_env: &[(&str, &str)],
    ) -> Aggregator {
        static N: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let log = std::env::temp_dir().join(format!(
            "pier-aggregate-{}-{topic}-{n}.log",
            std::process::id()
        ));
        let out = std::fs::File::create(&log).unwrap();
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_pier"));
        cmd.args([
            "aggregate",
            "--kafka",
            kafka,
            "--topic",
            topic,
            "--group",
            group,
        ])
        .args(["--postgres", pg_url, "--flush", flush])
        .env("RUST_LOG", "info,pier_kafka=debug")
        .env("NO_COLOR", "1")
        .stdin(Stdio::null())
        .stdout(out.try_clone().unwrap())
        .stderr(out);
        for (k, v) in extra_env {
            cmd.env(k, v);
        }
        Aggregator {
            child: Some(cmd.spawn().expect("spawn pier aggregate")),
            log,
        }
    }

    pub fn output(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// The last partition list this aggregator logged as assigned.
    pub fn assigned(&self) -> Option<Vec<i32>> {
        let out = self.output();
        let line = out
            .lines()
            .rev()
            .find(|l| l.contains("assigned partitions ["))?;
        let start = line.find("assigned partitions [")? + "assigned partitions [".len();
        let end = start + line[start..].find(']')?;
        Some(
            line[start..end]
                .split(',')
                .filter_map(|s| s.trim().parse().ok())
                .collect(),
        )
    }

    /// SIGKILL, as a crash.
    pub fn kill9(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Waits for the process to exit by itself (e.g. an abort), up to
    /// `timeout`.
    pub fn wait_exit(&mut self, timeout: Duration) -> std::process::ExitStatus {
        let c = self.child.as_mut().expect("running");
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(st) = c.try_wait().unwrap() {
                self.child = None;
                return st;
            }
            assert!(
                Instant::now() < deadline,
                "aggregator still running after {timeout:?}:\n{}",
                self.output()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// SIGTERM and wait for a clean exit.
    pub fn stop(&mut self) -> std::process::ExitStatus {
        let pid = self.child.as_ref().expect("running").id();
        let _ = Command::new("kill")
            .args(["-TERM", &pid.to_string()])
            .status();
        self.wait_exit(Duration::from_secs(30))
    }

    pub fn is_running(&mut self) -> bool {
        self.child
            .as_mut()
            .is_some_and(|c| c.try_wait().ok().flatten().is_none())
    }
}

impl Drop for Aggregator {
    fn drop(&mut self) {
        self.kill9();
        if !std::thread::panicking() {
            let _ = std::fs::remove_file(&self.log);
        } else {
            eprintln!("--- {} ---\n{}", self.log.display(), self.output());
        }
    }
}

/// 2025-01-01T10:00:00Z in milliseconds: events get fixed times so their
/// minute, hour and day are known.
pub const T0_MS: u64 = 1_735_725_600_000;

pub const HOSTS: [&[u8]; 3] = [b"a.example", b"B.example:8080", b"c.example"];
pub const ROUTES: [&str; 2] = ["api", "web"];

/// The i-th synthetic event: spread over hosts, routes, statuses and bytes,
/// `step_ms` apart from T0_MS, client 10.0.0.0 + (i % clients).
pub fn synth(i: u64, step_ms: u64, clients: u64, f: impl FnOnce(&EventRef)) {
    let statuses = [200u16, 201, 304, 404, 503, 101, 200, 200];
    let ip = IpAddr::V4(Ipv4Addr::from(
        0x0a00_0000u32.wrapping_add((i % clients) as u32),
    ));
    let path = format!("/p/{}", i % 17);
    let extra: [(&[u8], &[u8]); 1] = [(b"k", b"v")];
    f(&EventRef {
        ts_ms: T0_MS + i * step_ms,
        host: HOSTS[(i % 3) as usize],
        route: ROUTES[(i / 3 % 2) as usize],
        method: b"GET",
        path: path.as_bytes(),
        status: statuses[(i % 8) as usize],
        bytes_in: 100 + i % 7,
        bytes_out: 1000 + (i * 7919) % 100_000,
        duration_us: 500 + (i * 31) % 50_000,
        upstream_us: if i.is_multiple_of(5) {
            0
        } else {
            400 + i % 1000
        },
        client_ip: ip,
        user_agent: b"bench/1.0",
        listener: "main",
        upstream: b"127.0.0.1:3000",
        cache: "",
        protocol: "HTTP/1.1",
        tls_version: "",
        extra: &extra,
        trace_id: b"",
        span_id: b"",
    })
}

/// A name unique within this test binary run.
pub fn unique(prefix: &str) -> String {
    format!("{prefix}_{}", std::process::id())
}

/// Sum of a column over a table.
pub fn sum(c: &mut postgres::Client, table: &str, col: &str) -> i64 {
    c.query_one(
        &format!("SELECT coalesce(sum({col}), 0)::int8 FROM {table}"),
        &[],
    )
    .map(|r| r.get(0))
    .unwrap_or(-1)
}

/// Sum of the next offsets PostgreSQL has for a topic (= events consumed
/// and written, as partitions start at offset 0).
pub fn offsets_sum(c: &mut postgres::Client, topic: &str) -> i64 {
    c.query_one(
        "SELECT coalesce(sum(next_offset), 0)::int8 FROM pier_kafka_offsets WHERE topic = $1",
        &[&topic],
    )
    .map(|r| r.get(0))
    .unwrap_or(-1)
}

pub fn pg_client(url: &str) -> postgres::Client {
    postgres::Client::connect(url, postgres::NoTls).unwrap()
}

/// The path's bytes as a file name fragment (logs).
pub fn show(p: &Path) -> String {
    p.display().to_string()
}
