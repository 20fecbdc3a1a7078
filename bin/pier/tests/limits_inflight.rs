//! In-flight limits through a real Pier process: a `[[limit]]` with `concurrent = N`
//! (503 concurrency-limited) and `max_inflight_per_server` on an upstream (503
//! upstream-limited, Pingora's origin protection); both recover once requests finish.

mod common;

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::thread::JoinHandle;
use std::time::Duration;

use common::*;

const OTHER_IP: IpAddr = IpAddr::V4(Ipv4Addr::new(127, 0, 0, 2));

/// Starts `GET path` on a fresh connection in a thread.
fn spawn_get(addr: SocketAddr, path: &'static str) -> JoinHandle<Response> {
    std::thread::spawn(move || get(addr, path))
}

/// Waits (20 s at most) until the origin has received `n` requests.
#[track_caller]
fn wait_origin_requests(o: &Origin, n: u64) {
    assert!(
        wait_until(Duration::from_secs(20), || o.requests() >= n),
        "origin got {} requests, waiting for {n}",
        o.requests()
    );
}

/// Waits (20 s at most: generous for a loaded machine) until Pier has no request in
/// flight: every request's guards, limit slots included, are released by then (the
/// gauge drops after the request's handling returns).
#[track_caller]
fn wait_no_active_requests(p: &PierProcess) {
    let last = wait_metric_for(p, "pier_active_requests", 0.0, Duration::from_secs(20));
    assert_eq!(last, Some(0.0), "pier_active_requests never reached 0");
}

/// Polls a metric until it equals `want` or `timeout` passes; returns the last value.
fn wait_metric_for(p: &PierProcess, query: &str, want: f64, timeout: Duration) -> Option<f64> {
    let mut last = None;
    wait_until(timeout, || {
        last = p.metric_value(query);
        last == Some(want)
    });
    last
}

/// Asserts the answer came while every slow request was still in flight: refused at
/// once, not queued behind them (a condition, not a wall-clock bound that a loaded
/// machine could break).
#[track_caller]
fn assert_while_in_flight(slow: &[JoinHandle<Response>]) {
    assert!(
        slow.iter().all(|h| !h.is_finished()),
        "the refusal came only after the slow requests finished"
    );
}

/// A 503 with this reason and a `Retry-After` of whole seconds, at least 1.
#[track_caller]
fn assert_503_retry_after(r: &Response, reason: &str) {
    assert_local(r, 503, reason);
    let ra = r
        .header("retry-after")
        .unwrap_or_else(|| panic!("503 {reason} without Retry-After: {:?}", r.headers));
    let secs: u64 = ra
        .trim()
        .parse()
        .unwrap_or_else(|_| panic!("Retry-After is not whole seconds: {ra:?}"));
    assert!(secs >= 1, "Retry-After {secs}");
}

fn concurrent_config(o: &Origin, key: &str) -> String {
    simple_config(
        &[o.addr()],
        "",
        &format!(
            r#"
[[limit]]
name = "conc"
key = "{key}"
concurrent = 2
"#
        ),
    )
}

#[test]
fn concurrent_limit_refuses_the_third_request_and_recovers() {
    let o = Origin::start();
    let p = pier(&concurrent_config(&o, "client_ip"));
    let a = p.listener("main");
    let slow: Vec<_> = (0..2).map(|_| spawn_get(a, "/slow/2000")).collect();
    wait_origin_requests(&o, 2);
    // Both slots of 127.0.0.1 are taken: the third is refused at once.
    let r = get(a, "/hello");
    assert_503_retry_after(&r, "concurrency-limited");
    assert_while_in_flight(&slow);
    // Another client IP has its own slots.
    let r = RawConn::connect_from(OTHER_IP, a).get("/hello").unwrap();
    assert_eq!(r.status, 200, "another client is not limited");
    for h in slow {
        let r = h.join().unwrap();
        assert_eq!((r.status, r.body_str().as_str()), (200, "slow\n"));
    }
    // The slots are released when the requests end (just after their responses are sent).
    wait_no_active_requests(&p);
    let again: Vec<_> = (0..2).map(|_| spawn_get(a, "/slow/300")).collect();
    wait_origin_requests(&o, 5);
    for h in again {
        assert_eq!(h.join().unwrap().status, 200, "slots are free again");
    }
    wait_no_active_requests(&p);
    for _ in 0..5 {
        assert_eq!(get(a, "/hello").status, 200);
    }
    assert_eq!(
        o.requests(),
        10,
        "the refused request never reached the origin"
    );
    assert_eq!(wait_local_count(&p, 503, "concurrency-limited", 1.0), 1.0);
    assert_eq!(
        p.metric_sum(
            "pier_limit_denied_total",
            &[("limit", "conc"), ("dry_run", "false")]
        ),
        1.0
    );
}

#[test]
fn concurrent_slot_is_released_when_the_client_gives_up() {
    let o = Origin::start();
    let p = pier(&concurrent_config(&o, "route"));
    let a = p.listener("main");
    // Two clients send a slow request and hang up before the answer.
    let mut gone = Vec::new();
    for _ in 0..2 {
        let mut c = RawConn::connect(a);
        c.send(b"GET /slow/2000 HTTP/1.1\r\nhost: pier.test\r\n\r\n");
        gone.push(c);
    }
    wait_origin_requests(&o, 2);
    assert_503_retry_after(&get(a, "/hello"), "concurrency-limited");
    drop(gone);
    // Once the origin has answered (2 s), the abandoned requests end and free the slots.
    let mut last = 0;
    let freed = wait_until(Duration::from_secs(20), || {
        last = get(a, "/hello").status;
        last == 200
    });
    assert!(
        freed,
        "slots still taken after the clients left: last status {last}"
    );
    let both: Vec<_> = (0..2).map(|_| spawn_get(a, "/slow/200")).collect();
    for h in both {
        assert_eq!(h.join().unwrap().status, 200);
    }
}

fn inflight_config(o: &Origin) -> String {
    simple_config(
        &[o.addr()],
        "[timeouts]\nupstream_response = \"10s\"",
        "max_inflight_per_server = 2\nretries = 0",
    )
}

#[test]
fn max_inflight_per_server_answers_503_upstream_limited_and_recovers() {
    let o = Origin::start();
    let p = pier(&inflight_config(&o));
    let a = p.listener("main");
    let slow: Vec<_> = (0..2).map(|_| spawn_get(a, "/slow/2000")).collect();
    wait_origin_requests(&o, 2);
    let r = get(a, "/hello");
    assert_local(&r, 503, "upstream-limited");
    assert_while_in_flight(&slow);
    // Not from any client IP: the limit protects the origin from everyone.
    let r = RawConn::connect_from(OTHER_IP, a).get("/hello").unwrap();
    assert_local(&r, 503, "upstream-limited");
    assert_eq!(o.requests(), 2, "nothing past the limit reached the origin");
    for h in slow {
        assert_eq!(h.join().unwrap().status, 200);
    }
    let server_active = format!(
        "pier_upstream_active_requests{{upstream=\"app\",server=\"{}\"}}",
        o.addr()
    );
    wait_no_active_requests(&p);
    assert_eq!(
        wait_metric_for(&p, &server_active, 0.0, Duration::from_secs(20)),
        Some(0.0)
    );
    let again: Vec<_> = (0..2).map(|_| spawn_get(a, "/slow/300")).collect();
    wait_origin_requests(&o, 4);
    for h in again {
        assert_eq!(
            h.join().unwrap().status,
            200,
            "in-flight slots are free again"
        );
    }
    wait_no_active_requests(&p);
    for _ in 0..5 {
        assert_eq!(get(a, "/hello").status, 200);
    }
    assert_eq!(o.requests(), 9);
    assert_eq!(wait_local_count(&p, 503, "upstream-limited", 2.0), 2.0);
    assert_eq!(p.metric_value(&server_active), Some(0.0));
}

#[test]
fn upstream_limited_answer_carries_retry_after() {
    let o = Origin::start();
    let p = pier(&inflight_config(&o));
    let a = p.listener("main");
    let slow: Vec<_> = (0..2).map(|_| spawn_get(a, "/slow/2000")).collect();
    wait_origin_requests(&o, 2);
    assert_503_retry_after(&get(a, "/hello"), "upstream-limited");
    for h in slow {
        assert_eq!(h.join().unwrap().status, 200);
    }
}

#[test]
fn dry_run_concurrency_limit_counts_but_never_refuses() {
    let o = Origin::start();
    let p = pier(&simple_config(
        &[o.addr()],
        "",
        r#"
[[limit]]
name = "conc-watch"
key = "route"
concurrent = 1
dry_run = true
"#,
    ));
    let a = p.listener("main");
    // One after another (each in flight before the next is sent): the
    // count-min estimate can under-count increments that race on two
    // workers (see the issue note), which this test is not about.
    let slow: Vec<_> = (1..=3)
        .map(|i| {
            let h = spawn_get(a, "/slow/2000");
            wait_origin_requests(&o, i);
            h
        })
        .collect();
    assert_eq!(
        get(a, "/hello").status,
        200,
        "a dry-run limit never refuses"
    );
    // All four overlapped, so exactly three found the one slot taken.
    assert_while_in_flight(&slow);
    for h in slow {
        assert_eq!(h.join().unwrap().status, 200);
    }
    // Three requests found the one slot taken.
    let mut n = 0.0;
    wait_until(Duration::from_secs(20), || {
        n = p.metric_sum(
            "pier_limit_denied_total",
            &[("limit", "conc-watch"), ("dry_run", "true")],
        );
        n >= 3.0
    });
    assert_eq!(n, 3.0, "{}", p.metrics());
    assert_eq!(local_count(&p, 503, "concurrency-limited"), 0.0);
}

#[test]
fn max_inflight_per_server_sends_to_a_free_server_before_refusing() {
    let (oa, ob) = (Origin::start_named("a"), Origin::start_named("b"));
    let p = pier(&simple_config(
        &[oa.addr(), ob.addr()],
        "[timeouts]\nupstream_response = \"10s\"",
        "max_inflight_per_server = 1\nretries = 0",
    ));
    let a = p.listener("main");
    let slow = spawn_get(a, "/slow/800");
    let started = || oa.requests() + ob.requests() == 1;
    assert!(wait_until(Duration::from_secs(20), started));
    // One server is busy, the other free: every quick request must be served.
    let quick: Vec<u16> = (0..4).map(|_| get(a, "/hello").status).collect();
    assert_eq!(quick, vec![200; 4], "one server was free for each of them");
    assert_eq!(slow.join().unwrap().status, 200);
}
