//! Proxy basics: methods, bodiless responses, 1xx, unusual statuses, keep-alive and
//! upstream connection reuse, X-Forwarded-*, hop-by-hop headers, Connection: close.

mod common;

use std::time::Duration;

use common::*;

/// Pier in front of the stock origin, named `alpha`.
fn alpha() -> Running {
    scenario().origin_named("alpha").start()
}

#[test]
fn get_post_and_head() {
    let s = alpha();
    let mut c = s.conn();
    c.get("/hello")
        .expect_status(200)
        .expect_body("hello world\n")
        .expect_header("x-origin", "alpha");
    let body = pattern(0, 50_000);
    c.request("POST", "/echo", &[], &body)
        .expect_status(200)
        .expect_body(&body);
    c.request("PUT", "/echo", &[], b"put body")
        .expect_body("put body");
    // HEAD: the GET head (with its Content-Length), no body, and the connection stays
    // in sync for the next request.
    c.request("HEAD", "/bytes/5000", &[], b"")
        .expect_status(200)
        .expect_header("content-length", "5000")
        .expect_body("");
    c.get("/hello").expect_body("hello world\n");
    assert_eq!(s.origin_requests(), 5);
}

#[test]
fn no_body_statuses_keep_the_connection_in_sync() {
    let s = alpha();
    let mut c = s.conn();
    for code in [204u16, 304] {
        // Not framed: a body after a 204/304 would be read as the start of the next
        // response.
        c.get(&format!("/status/{code}"))
            .expect_status(code)
            .expect_no_header("transfer-encoding");
        c.get("/hello")
            .expect_status(200)
            .expect_body("hello world\n");
    }
    assert!(c.raw().buffered().is_empty());
}

#[test]
fn unusual_statuses_pass_through() {
    let s = alpha();
    let mut c = s.conn();
    for code in [299u16, 418, 599, 999] {
        c.get(&format!("/status/{code}"))
            .expect_status(code)
            .expect_body(format!("status {code}\n"));
    }
}

#[test]
fn interim_1xx_responses_are_forwarded() {
    let s = alpha();
    let mut c = s.conn();
    let r = c
        .get("/status/103")
        .expect_status(200)
        .expect_body("after 1xx\n");
    assert_eq!(
        r.interim.iter().map(|(s, _)| *s).collect::<Vec<_>>(),
        vec![103],
        "a proxy must forward 1xx responses (RFC 9110 section 15.2)"
    );
    let link = r.interim[0]
        .1
        .iter()
        .find(|(n, _)| n.eq_ignore_ascii_case("link"));
    assert!(link.is_some(), "103 headers: {:?}", r.interim[0].1);
    c.get("/hello").expect_status(200);
}

#[test]
fn keep_alive_reuses_upstream_connections() {
    let s = alpha();
    let (o, p) = (s.origin(), s.pier());
    // One client connection, many requests.
    let mut c = RawConn::connect(p.listener("main"));
    for _ in 0..20 {
        assert_eq!(c.get("/hello").unwrap().status, 200);
    }
    assert_eq!(
        o.connections(),
        1,
        "one upstream connection for 20 requests"
    );
    drop(c);
    // New client connections each time (landing on either worker): the shared pool
    // still reuses. Each waits for the upstream connection to be back in the pool,
    // which may happen a moment after the client has the response.
    for _ in 0..20 {
        wait_until(Duration::from_secs(5), || {
            p.metric_value("pier_upstream_idle_connections")
                .unwrap_or(0.0)
                >= 1.0
        });
        assert_eq!(get(p.listener("main"), "/hello").status, 200);
    }
    assert!(
        o.connections() <= 3,
        "40 sequential requests opened {} upstream connections",
        o.connections()
    );
    assert_eq!(o.requests(), 40);
    let created = p.metric_sum("pier_upstream_connections_created_total", &[]);
    assert_eq!(created, o.connections() as f64);
    let mut reused = 0.0;
    wait_until(Duration::from_secs(5), || {
        reused = p.metric_sum("pier_upstream_connections_reused_total", &[]);
        reused >= 37.0
    });
    assert!(reused >= 37.0, "reused {reused}");
}

#[test]
fn pipelined_requests_are_answered_in_order() {
    let s = alpha();
    let mut c = RawConn::connect(s.addr());
    c.send(
        b"GET /name HTTP/1.1\r\nhost: a\r\n\r\nGET /bytes/3 HTTP/1.1\r\nhost: a\r\n\r\nGET /hello HTTP/1.1\r\nhost: a\r\n\r\n",
    );
    assert_eq!(c.read_response().unwrap().body, b"alpha");
    assert_eq!(c.read_response().unwrap().body, pattern(0, 3));
    assert_eq!(c.read_response().unwrap().body, b"hello world\n");
}

/// The lines of the request head the origin received.
fn origin_saw(r: &Response) -> Vec<String> {
    r.body_str().split("\r\n").map(|l| l.to_string()).collect()
}

fn header_lines<'a>(lines: &'a [String], name: &str) -> Vec<&'a str> {
    let prefix = format!("{}:", name.to_ascii_lowercase());
    lines
        .iter()
        .filter(|l| l.to_ascii_lowercase().starts_with(&prefix))
        .map(|l| l[prefix.len()..].trim())
        .collect()
}

#[test]
fn x_forwarded_headers_are_added() {
    let s = alpha();
    let p = s.pier();
    let mut c = RawConn::connect(p.listener("main"));
    let r = c
        .request("GET", "/headers", &[("host", "example.com")], b"")
        .unwrap();
    let lines = origin_saw(&r);
    assert_eq!(
        header_lines(&lines, "x-forwarded-for"),
        vec!["127.0.0.1"],
        "{lines:?}"
    );
    assert_eq!(
        header_lines(&lines, "x-forwarded-proto"),
        vec!["http"],
        "{lines:?}"
    );
    assert_eq!(
        header_lines(&lines, "x-forwarded-host"),
        vec!["example.com"],
        "{lines:?}"
    );
    // The original Host reaches the origin.
    assert_eq!(
        header_lines(&lines, "host"),
        vec!["example.com"],
        "{lines:?}"
    );

    // An existing X-Forwarded-For ends with the address Pier saw.
    let r = c
        .request(
            "GET",
            "/headers",
            &[("x-forwarded-for", "203.0.113.9")],
            b"",
        )
        .unwrap();
    let lines = origin_saw(&r);
    let xff = header_lines(&lines, "x-forwarded-for").join(", ");
    assert!(xff.ends_with("127.0.0.1"), "x-forwarded-for: {xff:?}");
}

#[test]
fn hop_by_hop_request_headers_are_removed() {
    let s = alpha();
    let p = s.pier();
    let mut c = RawConn::connect(p.listener("main"));
    let r = c
        .request(
            "GET",
            "/headers",
            &[
                ("connection", "keep-alive, x-private"),
                ("x-private", "secret"),
                ("keep-alive", "timeout=5"),
                ("proxy-connection", "keep-alive"),
                ("x-end-to-end", "kept"),
            ],
            b"",
        )
        .unwrap();
    assert_eq!(r.status, 200);
    let lines = origin_saw(&r);
    for gone in ["x-private", "keep-alive", "proxy-connection"] {
        assert!(
            header_lines(&lines, gone).is_empty(),
            "{gone} must not be forwarded: {lines:?}"
        );
    }
    for v in header_lines(&lines, "connection") {
        assert!(!v.contains("x-private"), "connection: {v}");
    }
    assert_eq!(header_lines(&lines, "x-end-to-end"), vec!["kept"]);
    // The client connection is still keep-alive.
    assert_eq!(c.get("/hello").unwrap().status, 200);
}

#[test]
fn client_connection_close_is_honoured() {
    let s = alpha();
    let mut c = s.conn();
    let r = c
        .request("GET", "/hello", &[("connection", "close")], b"")
        .expect_body("hello world\n");
    // The response says so, and (RFC 9112 section 9.6: MUST) Pier closes after it.
    assert!(r.has_token("connection", "close"), "{:?}", r.headers);
    assert!(
        c.raw().is_closed(Duration::from_secs(5)),
        "pier kept the connection open"
    );
}

#[test]
fn http_1_0_client_gets_a_closed_connection() {
    let s = alpha();
    let p = s.pier();
    let mut c = RawConn::connect(p.listener("main"));
    c.send(b"GET /hello HTTP/1.0\r\nhost: a\r\n\r\n");
    let r = c.read_response().unwrap();
    assert_eq!(r.status, 200);
    assert_eq!(r.body, b"hello world\n");
    assert!(c.is_closed(Duration::from_secs(5)));
}

#[test]
fn origin_connection_close_does_not_close_the_client() {
    let s = alpha();
    let mut c = s.conn();
    c.get("/close").expect_body("closing\n");
    let before = s.origin().connections();
    // The upstream connection was closed by the origin: not reused, but the client's
    // keep-alive connection goes on.
    c.get("/hello").expect_body("hello world\n");
    assert_eq!(s.origin().connections(), before + 1);
}

#[test]
fn curl_through_pier() {
    let s = alpha();
    let p = s.pier();
    let url = format!("http://{}/hello", p.listener("main"));
    let out = curl(&["-i", &url, &url]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8_lossy(&out.stdout);
    assert_eq!(text.matches("hello world\n").count(), 2, "{text}");
    assert!(text.starts_with("HTTP/1.1 200"), "{text}");
}

#[test]
fn admin_healthz() {
    let s = alpha();
    let r = get(s.admin(), "/healthz");
    assert_eq!(r.status, 200);
    assert_eq!(r.body_str().trim(), "ok");
}

#[test]
fn requests_are_counted_by_route_and_class() {
    let s = alpha();
    for _ in 0..3 {
        s.get("/hello").expect_status(200);
    }
    s.get("/status/404").expect_status(404);
    let class = |c: &str| format!(r#"pier_requests_total{{route="default",class="{c}"}}"#);
    assert_eq!(wait_metric(&s, &class("2xx"), 3.0), Some(3.0));
    assert_eq!(wait_metric(&s, &class("4xx"), 1.0), Some(1.0));
    assert!(s.metrics().contains("pier_request_duration_seconds"));
}

#[test]
fn access_log_is_json_lines() {
    let o = Origin::start();
    let dir = TempDir::new();
    let log = dir.path().join("access.log");
    let cfg = simple_config(&[o.addr()], "", "").replace(
        "access = \"off\"",
        &format!("access = \"{}\"", log.display()),
    );
    assert!(cfg.contains("access.log"));
    let p = pier(&cfg);
    let mut c = RawConn::connect(p.listener("main"));
    assert_eq!(c.get("/hello").unwrap().status, 200);
    assert_eq!(c.get("/status/404").unwrap().status, 404);
    let mut lines = Vec::new();
    let flushed = wait_until(Duration::from_secs(5), || {
        lines = std::fs::read_to_string(&log)
            .unwrap_or_default()
            .lines()
            .map(str::to_string)
            .collect();
        lines.len() >= 2
    });
    assert!(flushed, "access log not written within 5 s: {lines:?}");
    let entries: Vec<serde_json::Value> = lines
        .iter()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("not JSON ({e}): {l}")))
        .collect();
    let upstream = o.addr().to_string();
    let want = [("/hello", 200u64), ("/status/404", 404)];
    for (e, (uri, status)) in entries.iter().zip(want) {
        assert_eq!(e["method"], "GET", "{e}");
        assert_eq!(e["uri"], uri, "{e}");
        assert_eq!(e["status"], status, "{e}");
        assert_eq!(e["route"], "default", "{e}");
        assert_eq!(e["upstream"], upstream.as_str(), "{e}");
    }
    // Body or total bytes (the field is not specified further): at least the body.
    let bytes = entries[0]["bytes"].as_u64();
    assert!(bytes.is_some_and(|b| b >= 12), "{}", entries[0]);
}

#[test]
fn head_of_a_chunked_response_has_no_body() {
    let s = alpha();
    let mut c = s.conn();
    c.request("HEAD", "/chunked/5000", &[], b"")
        .expect_status(200);
    // In sync after the HEAD.
    c.get("/hello").expect_body("hello world\n");
}

#[test]
fn absolute_form_request_target_is_accepted() {
    // RFC 9112 section 3.2.2: a server MUST accept the absolute form.
    let s = alpha();
    let p = s.pier();
    let mut c = RawConn::connect(p.listener("main"));
    c.send(b"GET http://example.com/headers?x=1 HTTP/1.1\r\nhost: example.com\r\n\r\n");
    let r = c.read_response().unwrap();
    assert_eq!(r.status, 200, "{}", r.body_str());
    let first = r.body_str().lines().next().unwrap_or("").to_string();
    assert!(
        first.starts_with("GET ") && first.contains("/headers?x=1") && first.ends_with(" HTTP/1.1"),
        "{first:?}"
    );
}

#[test]
fn obs_text_header_values_pass_through_unchanged() {
    // Permissive where harmless: bytes 0x80-0xFF in a value are valid (obs-text).
    let s = alpha();
    let p = s.pier();
    let mut c = RawConn::connect(p.listener("main"));
    c.send(b"GET /headers HTTP/1.1\r\nhost: a\r\nx-latin: caf\xe9 \xc3\xa9t\xc3\xa9\r\nx-empty:\r\n\r\n");
    let r = c.read_response().unwrap();
    assert_eq!(r.status, 200);
    let needle = b"x-latin: caf\xe9 \xc3\xa9t\xc3\xa9\r\n";
    assert!(
        r.body.windows(needle.len()).any(|w| w == needle),
        "{:?}",
        String::from_utf8_lossy(&r.body)
    );
}

#[test]
fn hop_by_hop_response_headers_are_removed() {
    let s = alpha();
    let mut c = s.conn();
    let r = c
        .get("/hop")
        .expect_status(200)
        .expect_header("x-kept", "yes")
        .expect_no_header("x-hop-secret")
        .expect_no_header("keep-alive")
        .expect_no_header("proxy-connection");
    for v in r.header_all("connection") {
        assert!(!v.contains("x-hop-secret"), "connection: {v}");
    }
    // The origin's keep-alive parameters say nothing about this connection: still open.
    c.get("/hello").expect_status(200);
}

#[test]
fn close_delimited_origin_body_is_relayed_whole() {
    let s = alpha();
    let mut c = s.conn();
    let r = c
        .get("/eof/300000")
        .expect_status(200)
        .expect_body(pattern(0, 300_000));
    // Re-framed (chunked) the client connection lives on; close-delimited it ends.
    if r.close_delimited {
        assert!(c.raw().is_closed(Duration::from_secs(5)));
    } else {
        c.get("/hello").expect_status(200);
    }
}

#[test]
fn repeated_headers_keep_every_value_in_order() {
    let s = alpha();
    let p = s.pier();
    let mut c = RawConn::connect(p.listener("main"));
    let r = c.get("/cookies").unwrap();
    assert_eq!(
        r.header_all("set-cookie"),
        vec!["a=1", "b=2", "c=3; Path=/"]
    );
    let r = c
        .request(
            "GET",
            "/headers",
            &[("x-multi", "one"), ("x-other", "z"), ("x-multi", "two")],
            b"",
        )
        .unwrap();
    let lines = origin_saw(&r);
    let multi = header_lines(&lines, "x-multi").join(", ");
    assert_eq!(multi, "one, two", "{lines:?}");
}

#[test]
fn pipelined_posts_with_bodies() {
    let s = alpha();
    let p = s.pier();
    let mut c = RawConn::connect(p.listener("main"));
    c.send(
        b"POST /echo HTTP/1.1\r\nhost: a\r\ncontent-length: 5\r\n\r\nfirstPOST /echo HTTP/1.1\r\nhost: a\r\ntransfer-encoding: chunked\r\n\r\n6\r\nsecond\r\n0\r\n\r\nGET /hello HTTP/1.1\r\nhost: a\r\n\r\n",
    );
    assert_eq!(c.read_response().unwrap().body, b"first");
    assert_eq!(c.read_response().unwrap().body, b"second");
    assert_eq!(c.read_response().unwrap().body, b"hello world\n");
}
