//! Every locally generated error status of the contract, with its `x-pier-reason`, and
//! each counted in /metrics.

mod common;

use std::time::{Duration, Instant};

use common::*;

#[track_caller]
fn assert_counted(p: &PierProcess, status: u16, reason: &str) {
    let n = wait_local_count(p, status, reason, 1.0);
    assert!(
        n >= 1.0,
        "pier_local_responses_total{{status=\"{status}\",reason=\"{reason}\"}} is {n}"
    );
}

#[test]
fn origin_down_is_502_upstream_connect() {
    let p = pier(&simple_config(&[dead_addr()], "", "retries = 0"));
    let r = get(p.listener("main"), "/hello");
    assert_local(&r, 502, "upstream-connect");
    assert_counted(&p, 502, "upstream-connect");
}

#[test]
fn origin_dying_mid_response_truncates_and_pier_keeps_serving() {
    let o = Origin::start();
    let p = pier(&simple_config(&[o.addr()], "", ""));
    let mut c = RawConn::connect(p.listener("main"));
    let e = c
        .get("/die")
        .expect_err("a response cut short by the origin must reach the client cut short");
    assert_eq!(e.kind(), std::io::ErrorKind::UnexpectedEof, "{e}");
    // The client connection cannot be reused after a truncated body.
    assert!(c.is_closed(Duration::from_secs(5)));
    // Pier itself is fine.
    for _ in 0..5 {
        let r = get(p.listener("main"), "/hello");
        assert_eq!(r.status, 200);
    }
}

#[test]
fn origin_dying_before_the_head_is_502_upstream_closed() {
    let o = Origin::start();
    let p = pier(&simple_config(
        &[o.addr()],
        "[timeouts]\nupstream_response = \"10s\"",
        "retries = 0",
    ));
    let addr = p.listener("main");
    let t = std::thread::spawn(move || try_get(addr, "/slow/5000"));
    assert!(wait_until(Duration::from_secs(5), || o.requests() == 1));
    o.stop();
    let r = t.join().unwrap().unwrap();
    assert_local(&r, 502, "upstream-closed");
    assert_counted(&p, 502, "upstream-closed");
}

#[test]
fn slow_origin_is_504_upstream_timeout() {
    let o = Origin::start();
    let p = pier(&simple_config(
        &[o.addr()],
        "[timeouts]\nupstream_response = \"300ms\"",
        "retries = 0",
    ));
    let t = Instant::now();
    let r = get(p.listener("main"), "/slow/3000");
    assert_local(&r, 504, "upstream-timeout");
    assert!(
        t.elapsed() < Duration::from_millis(2500),
        "504 took {:?}",
        t.elapsed()
    );
    assert_counted(&p, 504, "upstream-timeout");
}

#[test]
fn all_servers_unhealthy_is_503_no_healthy_upstream() {
    let o = Origin::start();
    let p = pier(&simple_config(
        &[o.addr()],
        "",
        r#"[upstream.app.health_check]
type = "http"
path = "/healthz"
interval = "100ms"
timeout = "1s"
rise = 1
fall = 1"#,
    ));
    assert_eq!(get(p.listener("main"), "/hello").status, 200);
    o.set_healthy(false);
    let mut last = None;
    assert!(
        wait_until(Duration::from_secs(5), || {
            let r = get(p.listener("main"), "/hello");
            let done = r.status == 503;
            last = Some(r);
            done
        }),
        "still {:?} after the only server failed its checks",
        last.map(|r| r.status)
    );
    assert_local(last.as_ref().unwrap(), 503, "no-healthy-upstream");
    assert_counted(&p, 503, "no-healthy-upstream");
}

#[test]
fn no_route_is_404() {
    let o = Origin::start();
    let p = pier(&base_config(
        "",
        &format!(
            r#"[[route]]
name = "app"
path = "/app"
upstream = "app"

[upstream.app]
servers = ["{}"]"#,
            o.addr()
        ),
    ));
    assert_eq!(get(p.listener("main"), "/app/hello").status, 200);
    let r = get(p.listener("main"), "/other");
    assert_local(&r, 404, "no-route");
    assert_eq!(o.requests(), 1);
    assert_counted(&p, 404, "no-route");
}

fn limited() -> (Origin, PierProcess) {
    let o = Origin::start();
    let p = pier(&simple_config(
        &[o.addr()],
        r#"[limits]
max_header_bytes = 2048
max_headers = 20
max_uri_bytes = 512
max_body_bytes = 1000"#,
        "",
    ));
    (o, p)
}

#[test]
fn oversized_header_is_431() {
    let (o, p) = limited();
    let big = "x".repeat(4000);
    let mut c = RawConn::connect(p.listener("main"));
    let r = c.request("GET", "/hello", &[("x-big", &big)], b"").unwrap();
    assert_local(&r, 431, "headers-too-large");
    assert_counted(&p, 431, "headers-too-large");
    assert_eq!(o.requests(), 0);
    // Just under the limit is fine.
    let ok = "x".repeat(1500);
    let r = RawConn::connect(p.listener("main"))
        .request("GET", "/hello", &[("x-big", &ok)], b"")
        .unwrap();
    assert_eq!(r.status, 200);
}

#[test]
fn too_many_headers_is_431() {
    let (o, p) = limited();
    let mut req = "GET /hello HTTP/1.1\r\nhost: a\r\n".to_string();
    for i in 0..40 {
        req.push_str(&format!("x-h{i}: v\r\n"));
    }
    req.push_str("\r\n");
    let mut c = RawConn::connect(p.listener("main"));
    c.send(req.as_bytes());
    let r = c.read_response().unwrap();
    assert_local(&r, 431, "headers-too-large");
    assert_eq!(o.requests(), 0);
}

#[test]
fn long_uri_is_414() {
    let (o, p) = limited();
    let path = format!("/hello?{}", "q".repeat(1000));
    let r = get(p.listener("main"), &path);
    assert_local(&r, 414, "uri-too-long");
    assert_counted(&p, 414, "uri-too-long");
    assert_eq!(o.requests(), 0);
}

#[test]
fn big_body_is_413() {
    let (o, p) = limited();
    let mut c = RawConn::connect(p.listener("main"));
    let r = c.request("POST", "/echo", &[], &[b'a'; 5000]).unwrap();
    assert_local(&r, 413, "body-too-large");
    assert_counted(&p, 413, "body-too-large");
    assert_eq!(o.requests(), 0);
    // At the limit is fine.
    let r = RawConn::connect(p.listener("main"))
        .request("POST", "/echo", &[], &[b'a'; 1000])
        .unwrap();
    assert_eq!((r.status, r.body.len()), (200, 1000));
}

#[test]
fn header_timeout_is_408() {
    let o = Origin::start();
    let p = pier(&simple_config(
        &[o.addr()],
        "[timeouts]\nclient_header = \"300ms\"",
        "",
    ));
    let mut c = RawConn::connect(p.listener("main"));
    let t = Instant::now();
    c.send(b"GET /hello HTTP/1.1\r\nhost: a\r\n");
    let r = c.read_response().unwrap();
    assert_local(&r, 408, "header-timeout");
    assert!(
        t.elapsed() < Duration::from_secs(3),
        "408 took {:?}",
        t.elapsed()
    );
    assert!(c.is_closed(Duration::from_secs(5)));
    assert_counted(&p, 408, "header-timeout");
    assert_eq!(o.requests(), 0);
}

#[test]
fn malformed_origin_responses_are_502_upstream_protocol() {
    let o = Origin::start();
    // Passive health off: five failures in a row would otherwise mark the server down.
    let p = pier(&simple_config(
        &[o.addr()],
        "",
        "retries = 0\nmax_fails = 0",
    ));
    for kind in ["garbage", "status", "header", "two-cl"] {
        let r = get(p.listener("main"), &format!("/bad/{kind}"));
        assert!(
            r.status == 502 && r.pier_reason() == Some("upstream-protocol"),
            "/bad/{kind}: {} {:?} {:?}",
            r.status,
            r.headers,
            r.body_str()
        );
    }
    assert!(wait_local_count(&p, 502, "upstream-protocol", 4.0) >= 4.0);
    // A bad chunk after a good head: a 502 if Pier saw it before relaying the head,
    // else a response cut short; never a complete 200.
    match RawConn::connect(p.listener("main")).get("/bad/bad-chunk") {
        Ok(r) => assert!(
            r.status == 502 && r.pier_reason() == Some("upstream-protocol"),
            "a response with a bad chunk was relayed: {} {:?} {:?}",
            r.status,
            r.headers,
            r.body_str()
        ),
        Err(e) => assert!(
            matches!(
                e.kind(),
                std::io::ErrorKind::UnexpectedEof | std::io::ErrorKind::InvalidData
            ),
            "{e}"
        ),
    }
    assert_eq!(get(p.listener("main"), "/hello").status, 200);
}

#[test]
fn origin_response_with_content_length_and_chunked_is_not_relayed_as_is() {
    let o = Origin::start();
    let p = pier(&simple_config(
        &[o.addr()],
        "",
        "retries = 0\nmax_fails = 0",
    ));
    let r = get(p.listener("main"), "/bad/cl-te");
    let refused = r.status == 502 && r.pier_reason() == Some("upstream-protocol");
    let cleaned = r.status == 200 && r.body == b"hello" && r.header("content-length").is_none();
    assert!(
        refused || cleaned,
        "{} {:?} {:?}",
        r.status,
        r.headers,
        r.body_str()
    );
}

#[test]
fn big_body_announced_with_expect_gets_413_before_any_upload() {
    let (o, p) = limited();
    let mut c = RawConn::connect(p.listener("main"));
    c.send(
        b"POST /echo HTTP/1.1\r\nhost: a\r\ncontent-length: 5000\r\nexpect: 100-continue\r\n\r\n",
    );
    // The client has not sent a byte of the body: the answer is the 413, not a 100.
    let r = c.read_head_only().unwrap();
    assert_eq!(r.status, 413, "{:?}", r.headers);
    assert_eq!(r.pier_reason(), Some("body-too-large"));
    assert_eq!(o.requests(), 0);
}
