//! Helpers shared by the end-to-end test files (each file is its own test binary, so
//! not every helper is used by every file).
#![allow(dead_code)]

use std::net::SocketAddr;
use std::path::Path;

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

/// A port free a moment ago, for a peer that must be told its port before it
/// starts (a responder named in a certificate, Pebble's validation port, a
/// server that cannot report the port 0 gave it). Taken in between by
/// someone else, that peer fails to bind and says so.
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
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
