//! Real Kafka and PostgreSQL for tests and benchmarks (feature `testenv`):
//! a single-node KRaft broker from Apache Kafka's jars and a throwaway
//! PostgreSQL cluster, each on free 127.0.0.1 ports in a temporary
//! directory, stopped and removed on drop.
//!
//! They read (and fail clearly without):
//! - `PIER_KAFKA_LIBS`: a directory of Kafka's jars (`kafka_2.13`, its
//!   dependencies and `slf4j-reload4j`), as `.ci/run` downloads them.
//! - `PIER_PG_BIN`: PostgreSQL 15's `bin` directory (`initdb`, `pg_ctl`),
//!   with the `hll` extension installed (Debian: `postgresql-15-hll`).

use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::ClientConfig;
use std::fs;
use std::io::Write as _;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

/// An environment variable the tests need; panics with how to set it.
pub fn required_env(name: &str, what: &str) -> PathBuf {
    match std::env::var_os(name) {
        Some(v) if !v.is_empty() => PathBuf::from(v),
        _ => panic!(
            "{name} is not set: it must point to {what}. `.ci/run` installs it and exports \
             {name}; run its analytics-kafka block (or set {name} by hand) before these tests"
        ),
    }
}

/// A port nothing listens on now, below the ephemeral range, from the
/// tests' one allocator (so Kafka's and PostgreSQL's ports and the test's
/// own never collide, and no outgoing connection takes one meanwhile).
pub fn free_port() -> u16 {
    pier_test_support::free_port()
}

fn unique_dir(prefix: &str) -> PathBuf {
    static N: AtomicU64 = AtomicU64::new(0);
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or(0);
    let dir = std::env::temp_dir().join(format!(
        "{prefix}-{}-{}-{nanos}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    ));
    fs::create_dir_all(&dir).expect("create temp dir");
    dir
}

/// Waits for `cond` until `deadline`, polling every 50 ms.
pub fn wait_for(what: &str, timeout: Duration, mut cond: impl FnMut() -> bool) {
    let deadline = Instant::now() + timeout;
    while !cond() {
        assert!(
            Instant::now() < deadline,
            "timed out after {timeout:?} waiting for {what}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn tail(path: &Path, lines: usize) -> String {
    let s = fs::read_to_string(path).unwrap_or_default();
    let v: Vec<&str> = s.lines().collect();
    v[v.len().saturating_sub(lines)..].join("\n")
}

/// A random Kafka cluster id: 16 bytes, base64url without padding.
fn cluster_id() -> String {
    let mut seed = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(1)
        ^ (u64::from(std::process::id()) << 32);
    let mut bytes = [0u8; 16];
    for b in &mut bytes {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        *b = seed as u8;
    }
    const A: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_";
    let mut out = String::new();
    let mut acc = 0u32;
    let mut bits = 0;
    for b in bytes {
        acc = (acc << 8) | u32::from(b);
        bits += 8;
        while bits >= 6 {
            bits -= 6;
            out.push(A[((acc >> bits) & 63) as usize] as char);
        }
    }
    if bits > 0 {
        out.push(A[((acc << (6 - bits)) & 63) as usize] as char);
    }
    // An id starting with '-' reads as an option to the storage tool's
    // argument parser ("--cluster-id: expected one argument"): one start in
    // 64 failed so. Kafka's own Uuid.randomUuid refuses such ids as well.
    if out.starts_with('-') {
        out.replace_range(..1, "A");
    }
    out
}

/// Runs the shell snippet `cleanup` once this process is gone, even if it
/// was killed or never dropped its fixtures (statics are never dropped).
/// Kill the returned child to cancel it.
pub fn cleanup_at_exit(cleanup: &str) -> Option<Child> {
    let pid = std::process::id();
    Command::new("sh")
        .arg("-c")
        .arg(format!(
            "while kill -0 {pid} 2>/dev/null; do sleep 1; done; {cleanup}"
        ))
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .ok()
}

fn cancel(watchdog: &mut Option<Child>) {
    if let Some(mut w) = watchdog.take() {
        let _ = w.kill();
        let _ = w.wait();
    }
}

/// A single-node Kafka (broker and controller in one JVM, KRaft).
pub struct Kafka {
    libs: PathBuf,
    dir: PathBuf,
    pub port: u16,
    child: Option<Child>,
    watchdog: Option<Child>,
    /// How long the last start took.
    pub started_in: Duration,
}

impl Kafka {
    /// Partitions of a topic created on first use.
    pub const PARTITIONS: i32 = 4;

    /// Formats the storage and starts the broker; returns once it answers
    /// metadata requests (about 10-20 s).
    pub fn start() -> Kafka {
        let libs = required_env(
            "PIER_KAFKA_LIBS",
            "a directory with Apache Kafka 3.9's jars (org.apache.kafka:kafka_2.13:3.9.1 and \
             its dependencies, plus org.slf4j:slf4j-reload4j)",
        );
        assert!(
            libs.join("kafka_2.13-3.9.1.jar").exists(),
            "PIER_KAFKA_LIBS={} has no kafka_2.13-3.9.1.jar",
            libs.display()
        );
        let dir = unique_dir("pier-kafka");
        let port = free_port();
        let cport = free_port();
        let props = format!(
            "process.roles=broker,controller\n\
             node.id=1\n\
             controller.quorum.voters=1@127.0.0.1:{cport}\n\
             listeners=PLAINTEXT://127.0.0.1:{port},CONTROLLER://127.0.0.1:{cport}\n\
             advertised.listeners=PLAINTEXT://127.0.0.1:{port}\n\
             controller.listener.names=CONTROLLER\n\
             inter.broker.listener.name=PLAINTEXT\n\
             listener.security.protocol.map=CONTROLLER:PLAINTEXT,PLAINTEXT:PLAINTEXT\n\
             log.dirs={data}\n\
             num.partitions=4\n\
             auto.create.topics.enable=true\n\
             offsets.topic.replication.factor=1\n\
             offsets.topic.num.partitions=4\n\
             transaction.state.log.replication.factor=1\n\
             transaction.state.log.min.isr=1\n\
             group.initial.rebalance.delay.ms=0\n\
             group.min.session.timeout.ms=1000\n\
             broker.session.timeout.ms=2000\n\
             broker.heartbeat.interval.ms=500\n",
            data = dir.join("data").display()
        );
        fs::write(dir.join("server.properties"), props).unwrap();
        fs::write(
            dir.join("log4j.properties"),
            "log4j.rootLogger=WARN, stdout\n\
             log4j.appender.stdout=org.apache.log4j.ConsoleAppender\n\
             log4j.appender.stdout.layout=org.apache.log4j.PatternLayout\n\
             log4j.appender.stdout.layout.ConversionPattern=[%d] %p %m (%c)%n\n\
             log4j.logger.kafka.server.KafkaServer=INFO\n\
             log4j.logger.kafka.server.BrokerServer=INFO\n",
        )
        .unwrap();
        let out = Command::new("java")
            .arg("-cp")
            .arg(libs.join("*"))
            .arg(format!(
                "-Dlog4j.configuration=file:{}",
                dir.join("log4j.properties").display()
            ))
            .args([
                "kafka.tools.StorageTool",
                "format",
                "-t",
                &cluster_id(),
                "-c",
            ])
            .arg(dir.join("server.properties"))
            .output()
            .expect("run java (Java 17 is needed for Kafka)");
        assert!(
            out.status.success(),
            "kafka storage format failed: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        let watchdog = cleanup_at_exit(&format!(
            "kill -9 $(cat '{d}/java.pid' 2>/dev/null) 2>/dev/null; rm -rf '{d}'",
            d = dir.display()
        ));
        let mut k = Kafka {
            libs,
            dir,
            port,
            child: None,
            watchdog,
            started_in: Duration::ZERO,
        };
        k.restart();
        k
    }

    pub fn bootstrap(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    /// Kills the broker (SIGKILL: Kafka down, as abruptly as it gets).
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Starts the broker again on the same ports and data; returns once it
    /// answers.
    pub fn restart(&mut self) {
        self.kill();
        let t = Instant::now();
        let log = fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.dir.join("kafka.log"))
            .unwrap();
        let child = Command::new("java")
            .args([
                "-Xmx512m",
                "-Xms128m",
                "-XX:+UseSerialGC",
                "-Djava.awt.headless=true",
            ])
            .arg(format!(
                "-Dlog4j.configuration=file:{}",
                self.dir.join("log4j.properties").display()
            ))
            .arg("-cp")
            .arg(self.libs.join("*"))
            .arg("kafka.Kafka")
            .arg(self.dir.join("server.properties"))
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .expect("start java");
        let _ = fs::write(self.dir.join("java.pid"), child.id().to_string());
        self.child = Some(child);
        let deadline = Instant::now() + Duration::from_secs(120);
        let probe: BaseConsumer = ClientConfig::new()
            .set("bootstrap.servers", self.bootstrap())
            .set("log_level", "0")
            .create()
            .expect("metadata client");
        loop {
            if let Some(Ok(Some(status))) = self.child.as_mut().map(|c| c.try_wait()) {
                panic!(
                    "kafka exited with {status} while starting:\n{}",
                    tail(&self.dir.join("kafka.log"), 40)
                );
            }
            if let Ok(md) = probe.fetch_metadata(None, Duration::from_millis(500)) {
                if !md.brokers().is_empty() {
                    break;
                }
            }
            assert!(
                Instant::now() < deadline,
                "kafka did not answer within 120 s:\n{}",
                tail(&self.dir.join("kafka.log"), 40)
            );
            std::thread::sleep(Duration::from_millis(100));
        }
        self.started_in = t.elapsed();
    }

    /// Creates `topic` with the broker's default of [`Kafka::PARTITIONS`]
    /// partitions (auto-creation on a metadata request), waiting until each
    /// partition has a leader.
    pub fn create_topic(&self, topic: &str) {
        let probe: BaseConsumer = ClientConfig::new()
            .set("bootstrap.servers", self.bootstrap())
            .set("allow.auto.create.topics", "true")
            .create()
            .expect("metadata client");
        let _ = probe.fetch_metadata(Some(topic), Duration::from_secs(5));
        self.wait_topic(topic, Self::PARTITIONS);
    }

    /// Waits until `topic` has `partitions` partitions, each with a leader.
    pub fn wait_topic(&self, topic: &str, partitions: i32) {
        let probe: BaseConsumer = ClientConfig::new()
            .set("bootstrap.servers", self.bootstrap())
            .create()
            .expect("metadata client");
        wait_for(&format!("topic {topic}"), Duration::from_secs(30), || {
            probe
                .fetch_metadata(Some(topic), Duration::from_secs(1))
                .ok()
                .and_then(|md| {
                    md.topics().first().map(|t| {
                        t.error().is_none()
                            && t.partitions().len() == partitions as usize
                            && t.partitions().iter().all(|p| p.leader() >= 0)
                    })
                })
                .unwrap_or(false)
        });
    }

    /// Messages in `topic` (high minus low watermark, over its partitions).
    pub fn message_count(&self, topic: &str) -> i64 {
        let probe: BaseConsumer = ClientConfig::new()
            .set("bootstrap.servers", self.bootstrap())
            .create()
            .expect("metadata client");
        let md = probe
            .fetch_metadata(Some(topic), Duration::from_secs(5))
            .expect("metadata");
        md.topics()[0]
            .partitions()
            .iter()
            .map(|p| {
                let (lo, hi) = probe
                    .fetch_watermarks(topic, p.id(), Duration::from_secs(5))
                    .expect("watermarks");
                hi - lo
            })
            .sum()
    }

    pub fn log_tail(&self, lines: usize) -> String {
        tail(&self.dir.join("kafka.log"), lines)
    }
}

impl Drop for Kafka {
    fn drop(&mut self) {
        cancel(&mut self.watchdog);
        self.kill();
        let _ = fs::remove_dir_all(&self.dir);
    }
}

/// Whether this process runs as root (PostgreSQL refuses to).
fn is_root() -> bool {
    fs::metadata("/proc/self")
        .map(|m| m.uid() == 0)
        .unwrap_or(false)
}

/// A throwaway PostgreSQL cluster.
pub struct Postgres {
    bin: PathBuf,
    dir: PathBuf,
    pub port: u16,
    watchdog: Option<Child>,
}

impl Postgres {
    pub fn start() -> Postgres {
        let bin = required_env(
            "PIER_PG_BIN",
            "PostgreSQL 15's bin directory (Debian: /usr/lib/postgresql/15/bin, from \
             postgresql-15, with postgresql-15-hll installed)",
        );
        assert!(
            bin.join("initdb").exists() && bin.join("pg_ctl").exists(),
            "PIER_PG_BIN={} has no initdb/pg_ctl",
            bin.display()
        );
        let dir = unique_dir("pier-pg");
        let port = free_port();
        let mut pg = Postgres {
            bin,
            dir,
            port,
            watchdog: None,
        };
        if is_root() {
            let st = Command::new("chown")
                .args(["-R", "postgres:postgres"])
                .arg(&pg.dir)
                .status()
                .expect("chown");
            assert!(st.success(), "chown postgres {}", pg.dir.display());
        }
        let data = pg.dir.join("data");
        let out = pg
            .cmd("initdb")
            .arg("-D")
            .arg(&data)
            .args(["-A", "trust", "-U", "postgres", "--no-sync", "-E", "UTF8"])
            .output()
            .expect("initdb");
        assert!(
            out.status.success(),
            "initdb: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        let opts = format!(
            "-p {port} -k {} -c listen_addresses=127.0.0.1 -c fsync=off \
             -c synchronous_commit=off -c full_page_writes=off -c max_connections=50",
            pg.dir.display()
        );
        let out = pg
            .cmd("pg_ctl")
            .arg("-D")
            .arg(&data)
            .args(["-o", &opts, "-l"])
            .arg(pg.dir.join("postgres.log"))
            .args(["-w", "-t", "60", "start"])
            .output()
            .expect("pg_ctl start");
        assert!(
            out.status.success(),
            "pg_ctl start: {}{}\n{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr),
            tail(&pg.dir.join("postgres.log"), 20)
        );
        let stop = format!(
            "{} '{}' -D '{}/data' -m immediate -w stop",
            if is_root() {
                "runuser -u postgres --"
            } else {
                ""
            },
            pg.bin.join("pg_ctl").display(),
            pg.dir.display()
        );
        pg.watchdog = cleanup_at_exit(&format!("{stop}; rm -rf '{}'", pg.dir.display()));
        let mut c = pg.client();
        c.batch_execute("CREATE EXTENSION IF NOT EXISTS hll")
            .unwrap_or_else(|e| {
                panic!(
                "CREATE EXTENSION hll failed ({e:?}): install postgresql-15-hll (Debian) for the \
                 PostgreSQL in PIER_PG_BIN"
            )
            });
        pg
    }

    fn cmd(&self, tool: &str) -> Command {
        let path = self.bin.join(tool);
        if is_root() {
            let mut c = Command::new("runuser");
            c.args(["-u", "postgres", "--"]).arg(path);
            c
        } else {
            Command::new(path)
        }
    }

    /// Connection string for `pier aggregate --postgres`.
    pub fn url(&self) -> String {
        format!(
            "host=127.0.0.1 port={} user=postgres dbname=postgres connect_timeout=10",
            self.port
        )
    }

    pub fn client(&self) -> postgres::Client {
        postgres::Client::connect(&self.url(), postgres::NoTls)
            .unwrap_or_else(|e| panic!("connect to postgres on {}: {e}", self.port))
    }

    /// Creates a database (one per test keeps tests independent).
    pub fn create_db(&self, name: &str) -> String {
        self.client()
            .batch_execute(&format!("CREATE DATABASE \"{name}\""))
            .unwrap();
        format!(
            "host=127.0.0.1 port={} user=postgres dbname={name} connect_timeout=10",
            self.port
        )
    }
}

impl Drop for Postgres {
    fn drop(&mut self) {
        cancel(&mut self.watchdog);
        let _ = self
            .cmd("pg_ctl")
            .arg("-D")
            .arg(self.dir.join("data"))
            .args(["-m", "immediate", "-w", "stop"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status();
        let _ = fs::remove_dir_all(&self.dir);
    }
}

/// Appends a line to `path` (bench and test logs).
pub fn append(path: &Path, line: &str) {
    if let Ok(mut f) = fs::OpenOptions::new().create(true).append(true).open(path) {
        let _ = writeln!(f, "{line}");
    }
}

#[cfg(test)]
mod tests {
    /// Never an id the storage tool would read as an option.
    #[test]
    fn cluster_ids_never_start_with_a_dash() {
        for _ in 0..20_000 {
            let id = super::cluster_id();
            assert_eq!(id.len(), 22, "{id}");
            assert!(!id.starts_with('-'), "{id}");
        }
    }
}
