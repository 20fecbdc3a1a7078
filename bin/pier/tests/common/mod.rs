//! Helpers shared by the end-to-end test files (each file is its own test binary, so
//! not every helper is used by every file).
#![allow(dead_code)]

use std::io::Read;
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

pub use pier_test_support::*;

/// The `pier` binary under test.
pub fn bin() -> &'static Path {
    Path::new(env!("CARGO_BIN_EXE_pier"))
}

/// A scenario on the `pier` binary under test (docs/testing.md).
pub fn scenario() -> Scenario {
    Scenario::new(bin())
}

/// Starts Pier on a config.
pub fn pier(config: &str) -> PierProcess {
    PierProcess::start(bin(), config)
}

/// The config with its `main` listener (the test configs' first, on port 0)
/// made an h2c one (HTTP/2 with prior knowledge, or HTTP/1.1 beside it).
pub fn h2c_main(config: &str) -> String {
    const MAIN: &str = "name = \"main\"\nlisten = \"127.0.0.1:0\"\n";
    assert!(config.contains(MAIN), "no main listener on port 0");
    config.replacen(
        MAIN,
        "name = \"main\"\nlisten = \"127.0.0.1:0\"\nh2c = true\n",
        1,
    )
}

/// Starts Pier on a config with extra environment variables.
pub fn pier_env(config: &str, env: &[(&str, &str)]) -> PierProcess {
    PierProcess::launch_env(bin(), Some(config), &["serve", "-c", "{config}"], env)
        .unwrap_or_else(|e| panic!("{e}"))
}

/// The io_uring instances a process holds (each an `anon_inode:[io_uring]`
/// fd; a Pier worker sets one up for its first client on the ring).
pub fn rings(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd")).map_or(0, |d| {
        d.filter_map(|e| std::fs::read_link(e.ok()?.path()).ok())
            .filter(|l| l.to_string_lossy().contains("io_uring"))
            .count()
    })
}

/// Pier's clients should be on io_uring here: the kernel allows it and the
/// environment does not turn it off (`PIER_IO_URING=0`).
pub fn io_uring_expected() -> bool {
    std::fs::read_to_string("/proc/sys/kernel/io_uring_disabled").is_ok_and(|v| v.trim() == "0")
        && std::env::var("PIER_IO_URING").as_deref() != Ok("0")
}

/// An address on which nothing listens, held for the test process's life: a socket
/// bound to it without listening, so connects are refused and the kernel gives the port
/// to nothing else. (A port bound and then closed went to the next `bind` on port 0:
/// once to the Pier a test then started, whose Kafka sink, pointed at this "dead"
/// broker, sent its requests to Pier's own listener.)
pub fn dead_addr() -> SocketAddr {
    static HELD: std::sync::Mutex<Vec<socket2::Socket>> = std::sync::Mutex::new(Vec::new());
    let s = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None).unwrap();
    s.bind(&SocketAddr::from(([127, 0, 0, 1], 0)).into())
        .unwrap();
    let addr = s.local_addr().unwrap().as_socket().unwrap();
    HELD.lock().unwrap_or_else(|e| e.into_inner()).push(s);
    addr
}

/// Asserts a locally generated response: status, `x-pier-reason`, and a plain-text body
/// starting with the status code.
#[track_caller]
pub fn assert_local(r: &Response, status: u16, reason: &str) {
    assert_eq!(
        (r.status, r.pier_reason()),
        (status, Some(reason)),
        "expected a local {status} {reason}; got {} {:?} headers {:?} body {:?}",
        r.status,
        r.reason,
        r.headers,
        r.body_str()
    );
    assert!(
        r.body_str().starts_with(&status.to_string()),
        "body of a local {status} should start with the status: {:?}",
        r.body_str()
    );
}

/// The number of local responses Pier counted with this status and reason.
pub fn local_count(p: &PierProcess, status: u16, reason: &str) -> f64 {
    p.metric_sum(
        "pier_local_responses_total",
        &[("status", &status.to_string()), ("reason", reason)],
    )
}

/// Polls a metric (Pier counts a request when it is logged, which may be just after the
/// client got the response) until it equals `want` or 5 s pass; returns the last value.
pub fn wait_metric(p: &PierProcess, query: &str, want: f64) -> Option<f64> {
    let mut last = None;
    wait_until(std::time::Duration::from_secs(5), || {
        last = p.metric_value(query);
        last == Some(want)
    });
    last
}

/// Polls a metric until it reaches `at_least` (5 s at most); its last value.
/// For counters updated as a request is logged, after the client has its
/// answer.
#[allow(dead_code)]
pub fn wait_metric_at_least(p: &PierProcess, query: &str, at_least: f64) -> f64 {
    let mut last = 0.0;
    wait_until(std::time::Duration::from_secs(5), || {
        last = p.metric_value(query).unwrap_or(0.0);
        last >= at_least
    });
    last
}

/// Polls the local-response count for (status, reason) until it reaches `at_least`.
pub fn wait_local_count(p: &PierProcess, status: u16, reason: &str, at_least: f64) -> f64 {
    let mut last = 0.0;
    wait_until(std::time::Duration::from_secs(5), || {
        last = local_count(p, status, reason);
        last >= at_least
    });
    last
}

/// Upstream exchanges Pier began: connections it opened plus pooled ones it reused
/// (each counted as the exchange starts, before a byte is sent).
pub fn upstream_exchanges(p: &PierProcess) -> f64 {
    p.metric_sum("pier_upstream_connections_created_total", &[])
        + p.metric_sum("pier_upstream_connections_reused_total", &[])
}

/// Polls until Pier has logged `n` requests in all (`pier_requests_total`, which
/// counts a request once it is over: after everything Pier sent upstream for it),
/// 5 s at most; the last count.
pub fn wait_logged(p: &PierProcess, n: f64) -> f64 {
    let mut last = 0.0;
    wait_until(std::time::Duration::from_secs(5), || {
        last = p.metric_sum("pier_requests_total", &[]);
        last >= n
    });
    last
}

// ---------------------------------------------------------------- servers the tests start

/// A server binary (`redis-server`, `memcached`): required when the libraries are.
pub fn server_bin(name: &str) -> PathBuf {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .chain([PathBuf::from("/usr/bin"), PathBuf::from("/usr/sbin")])
        .map(|d| d.join(name))
        .find(|p| p.is_file())
        .unwrap_or_else(|| {
            panic!("{name} not found: apt-get install {name} (./test.sh and .ci/install do)")
        })
}

/// A server process the test started; killed (and reaped) on drop.
pub struct Server {
    pub child: Child,
    pub addr: SocketAddr,
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Server {
    /// Starts `bin` with `args(port)` on a free port and waits (10 s at most) until it
    /// accepts; tries a few ports in case another process took the chosen one meanwhile.
    pub fn start(bin: &Path, args: impl Fn(u16) -> Vec<String>) -> Server {
        let mut last = String::new();
        for _ in 0..3 {
            let port = free_port();
            let addr: SocketAddr = ([127, 0, 0, 1], port).into();
            let mut child = Command::new(bin)
                .args(args(port))
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(Stdio::piped())
                .spawn()
                .unwrap_or_else(|e| panic!("spawn {}: {e}", bin.display()));
            let mut exited = None;
            let up = wait_until(Duration::from_secs(10), || {
                if let Ok(Some(st)) = child.try_wait() {
                    exited = Some(st);
                    return true;
                }
                TcpStream::connect_timeout(&addr, Duration::from_millis(200)).is_ok()
            });
            if up && exited.is_none() {
                return Server { child, addr };
            }
            let mut err = String::new();
            if exited.is_none() {
                let _ = child.kill();
            }
            let _ = child.wait();
            if let Some(mut e) = child.stderr.take() {
                let _ = e.read_to_string(&mut err);
            }
            last = format!("{} on port {port}: {exited:?} {err}", bin.display());
        }
        panic!("server did not start: {last}");
    }
}

/// redis-server's arguments for a test's own instance on `port` (no
/// persistence), then `extra`.
fn redis_args(port: u16, extra: &[&str]) -> Vec<String> {
    let port = port.to_string();
    [
        "--port",
        port.as_str(),
        "--bind",
        "127.0.0.1",
        "--save",
        "",
        "--appendonly",
        "no",
        "--daemonize",
        "no",
        "--maxclients",
        "1000",
    ]
    .iter()
    .chain(extra)
    .map(|s| s.to_string())
    .collect()
}

/// A redis-server of the test's own (no persistence), on a free port.
pub fn redis_server() -> Server {
    redis_server_with(&[])
}

/// [`redis_server`] with more arguments (`--replicaof HOST PORT`, ...).
pub fn redis_server_with(extra: &[&str]) -> Server {
    Server::start(&server_bin("redis-server"), |port| redis_args(port, extra))
}

/// A redis-server started again on `port` (one a test killed), once it
/// accepts (10 s at most).
pub fn redis_server_on(port: u16) -> Server {
    let child = Command::new(server_bin("redis-server"))
        .args(redis_args(port, &[]))
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap_or_else(|e| panic!("spawn redis-server: {e}"));
    let addr: SocketAddr = ([127, 0, 0, 1], port).into();
    let server = Server { child, addr };
    assert!(
        wait_until(Duration::from_secs(10), || TcpStream::connect(addr).is_ok()),
        "redis-server back on {port}"
    );
    server
}
