//! The origin server, checked with the raw client directly (no Pier in between).

use std::io::{Read, Write};
use std::time::{Duration, Instant};

use pier_test_support::{get, is_pattern, ws, Origin, RawConn};

#[test]
fn hello_and_keep_alive_on_one_connection() {
    let o = Origin::start_named("alpha");
    let mut c = RawConn::connect(o.addr());
    for _ in 0..3 {
        let r = c.get("/hello").unwrap();
        assert_eq!(r.status, 200);
        assert_eq!(r.body, b"hello world\n");
        assert_eq!(r.header("content-length"), Some("12"));
        assert_eq!(r.header("x-origin"), Some("alpha"));
    }
    assert_eq!(o.connections(), 1);
    assert_eq!(o.requests(), 3);
    assert_eq!(get(o.addr(), "/name").body, b"alpha");
    assert_eq!(get(o.addr(), "/prefix/x/name").body, b"alpha");
    assert_eq!(o.connections(), 3);
}

#[test]
fn head_204_304_and_status_passthrough() {
    let o = Origin::start();
    let mut c = RawConn::connect(o.addr());
    let r = c.request("HEAD", "/bytes/5000", &[], b"").unwrap();
    assert_eq!(r.status, 200);
    assert_eq!(r.header("content-length"), Some("5000"));
    assert!(r.body.is_empty());
    let r = c.get("/status/204").unwrap();
    assert_eq!((r.status, r.body.len()), (204, 0));
    let r = c.get("/status/304").unwrap();
    assert_eq!((r.status, r.body.len()), (304, 0));
    let r = c.get("/status/999").unwrap();
    assert_eq!(r.status, 999);
    assert_eq!(r.body, b"status 999\n");
    let r = c.get("/status/103").unwrap();
    assert_eq!(r.status, 200);
    assert_eq!(r.interim.len(), 1);
    assert_eq!(r.interim[0].0, 103);
    assert_eq!(r.body, b"after 1xx\n");
    // Still in sync after all of that.
    assert_eq!(c.get("/hello").unwrap().body, b"hello world\n");
    assert_eq!(o.connections(), 1);
}

#[test]
fn bytes_and_chunked_with_trailer() {
    let o = Origin::start();
    let mut c = RawConn::connect(o.addr());
    let r = c.get("/bytes/300000").unwrap();
    assert_eq!(r.body.len(), 300_000);
    assert!(is_pattern(0, &r.body));
    let r = c.get("/chunked/100000").unwrap();
    assert!(r.chunked);
    assert_eq!(r.body.len(), 100_000);
    assert!(is_pattern(0, &r.body));
    assert_eq!(r.trailer("x-trailer"), Some("done"));
    let r = c.get("/chunked/0").unwrap();
    assert!(r.body.is_empty());
    assert_eq!(r.trailer("x-trailer"), Some("done"));
}

#[test]
fn echo_content_length_and_chunked() {
    let o = Origin::start();
    let mut c = RawConn::connect(o.addr());
    let body = pier_test_support::pattern(7, 200_000);
    let r = c.request("POST", "/echo", &[], &body).unwrap();
    assert_eq!(r.header("content-length"), Some("200000"));
    assert_eq!(r.body, body);
    c.send(b"POST /echo HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\n5\r\nhello\r\n6;ext=1\r\n world\r\n0\r\nx-sum: 11\r\n\r\n");
    let r = c.read_response().unwrap();
    assert!(r.chunked);
    assert_eq!(r.body, b"hello world");
    assert_eq!(r.trailer("x-sum"), Some("11"));
    let r = c.request("POST", "/echo", &[], b"").unwrap();
    assert_eq!(r.body, b"");
}

#[test]
fn echo_streams_without_waiting_for_the_whole_body() {
    let o = Origin::start();
    let mut c = RawConn::connect(o.addr());
    c.send(b"POST /echo HTTP/1.1\r\nhost: x\r\ncontent-length: 1000000\r\n\r\n");
    c.send(&[b'a'; 1000]);
    // The head and the first bytes come back before the rest of the body is sent.
    let mut s = c.writer();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let mut got = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(5);
    while !got.ends_with(&[b'a'; 1000]) && Instant::now() < deadline {
        let mut b = [0u8; 4096];
        let n = s.read(&mut b).unwrap();
        assert!(n > 0);
        got.extend_from_slice(&b[..n]);
    }
    assert!(got.starts_with(b"HTTP/1.1 200"));
    assert!(got.ends_with(&[b'a'; 1000]));
    s.write_all(&[b'b'; 999_000]).unwrap();
}

#[test]
fn expect_100_continue() {
    let o = Origin::start();
    let mut c = RawConn::connect(o.addr());
    c.send(
        b"POST /expect HTTP/1.1\r\nhost: x\r\ncontent-length: 4\r\nexpect: 100-continue\r\n\r\n",
    );
    // The 100 comes before any body byte is sent.
    let mut s = c.writer();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let mut b = [0u8; 25];
    s.read_exact(&mut b).unwrap();
    assert_eq!(&b, b"HTTP/1.1 100 Continue\r\n\r\n");
    c.send(b"abcd");
    let r = c.read_response().unwrap();
    assert_eq!(r.body_str(), "expect: 100-continue\nbytes: 4\n");
}

#[test]
fn headers_echoes_the_head_received() {
    let o = Origin::start();
    let mut c = RawConn::connect(o.addr());
    let r = c
        .request("GET", "/headers?q=1", &[("x-test", "yes")], b"")
        .unwrap();
    assert_eq!(
        r.body_str(),
        "GET /headers?q=1 HTTP/1.1\r\nhost: pier.test\r\nx-test: yes\r\n\r\n"
    );
}

#[test]
fn die_close_and_connection_close() {
    let o = Origin::start();
    let mut c = RawConn::connect(o.addr());
    let e = c.get("/die").unwrap_err();
    assert_eq!(e.kind(), std::io::ErrorKind::UnexpectedEof, "{e}");
    assert!(e.to_string().contains("got 10 of 1000"), "{e}");

    let mut c = RawConn::connect(o.addr());
    let e = c.request("POST", "/drop", &[], b"body").unwrap_err();
    assert!(e.to_string().contains("closed before a response"), "{e}");
    assert_eq!(o.requests(), 2);

    let mut c = RawConn::connect(o.addr());
    let r = c.get("/close").unwrap();
    assert!(r.has_token("connection", "close"));
    assert!(c.is_closed(Duration::from_secs(5)));

    let mut c = RawConn::connect(o.addr());
    let r = c
        .request("GET", "/hello", &[("connection", "close")], b"")
        .unwrap();
    assert!(r.has_token("connection", "close"));
    assert!(c.is_closed(Duration::from_secs(5)));
}

#[test]
fn slow_and_slowbody() {
    let o = Origin::start();
    let t = Instant::now();
    assert_eq!(get(o.addr(), "/slow/200").body, b"slow\n");
    assert!(t.elapsed() >= Duration::from_millis(200));
    let t = Instant::now();
    assert_eq!(get(o.addr(), "/slowbody/20").body, b"0123456789");
    assert!(t.elapsed() >= Duration::from_millis(200));
}

#[test]
fn healthz_follows_set_healthy_and_is_counted_apart() {
    let o = Origin::start();
    assert_eq!(get(o.addr(), "/healthz").status, 200);
    o.set_healthy(false);
    assert_eq!(get(o.addr(), "/healthz").status, 500);
    o.set_healthy(true);
    assert_eq!(get(o.addr(), "/healthz").status, 200);
    assert_eq!(o.health_checks(), 3);
    assert_eq!(o.requests(), 0);
}

#[test]
fn malformed_requests_are_counted() {
    let o = Origin::start();
    let mut c = RawConn::connect(o.addr());
    c.send(b"GET /hello HTTP/1.1\r\nbad header\r\n\r\n");
    let r = c.read_response().unwrap();
    assert_eq!(r.status, 400);
    assert_eq!(o.requests(), 1);
}

#[test]
fn websocket_echo() {
    let o = Origin::start();
    let mut c = RawConn::connect(o.addr());
    let r = c
        .request(
            "GET",
            "/ws",
            &[
                ("upgrade", "websocket"),
                ("connection", "Upgrade"),
                ("sec-websocket-key", "dGhlIHNhbXBsZSBub25jZQ=="),
                ("sec-websocket-version", "13"),
            ],
            b"",
        )
        .unwrap();
    assert_eq!(r.status, 101);
    assert_eq!(
        r.header("sec-websocket-accept"),
        Some("s3pPLMBiTxaQ9kYGzzhZRbK+xOo=")
    );
    c.send(&ws::encode_frame(
        true,
        ws::OP_TEXT,
        b"hi there",
        Some([9, 8, 7, 6]),
    ));
    let f = c.read_ws_frame().unwrap();
    assert_eq!(
        (f.opcode, f.masked, f.payload.as_slice()),
        (ws::OP_TEXT, false, &b"hi there"[..])
    );
    let big = vec![42u8; 100_000];
    c.send(&ws::encode_frame(
        true,
        ws::OP_BINARY,
        &big,
        Some([1, 2, 3, 4]),
    ));
    assert_eq!(c.read_ws_frame().unwrap().payload, big);
    c.send(&ws::encode_frame(
        true,
        ws::OP_CLOSE,
        b"",
        Some([1, 2, 3, 4]),
    ));
    assert_eq!(c.read_ws_frame().unwrap().opcode, ws::OP_CLOSE);
    assert!(c.is_closed(Duration::from_secs(5)));
}

#[test]
fn stop_closes_listener_and_connections_and_start_at_reuses_the_address() {
    let o = Origin::start_named("first");
    let addr = o.addr();
    let mut c = RawConn::connect(addr);
    assert_eq!(c.get("/hello").unwrap().status, 200);
    assert_eq!(o.active_connections(), 1);
    o.stop();
    assert!(c.is_closed(Duration::from_secs(5)));
    assert!(RawConn::try_connect(addr).is_err());
    o.stop();
    let o2 = Origin::start_at("second", addr).unwrap();
    assert_eq!(get(addr, "/name").body, b"second");
    drop(o2);
}

#[test]
fn curl_talks_to_the_origin() {
    let o = Origin::start();
    let out = pier_test_support::curl(&[&format!("http://{}/hello", o.addr())]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(out.stdout, b"hello world\n");
}

#[test]
fn idle_timeout_closes_keep_alive_connections() {
    let o = Origin::start();
    o.set_idle_timeout(Some(Duration::from_millis(100)));
    let mut c = RawConn::connect(o.addr());
    assert_eq!(c.get("/hello").unwrap().status, 200);
    let t = Instant::now();
    assert!(c.is_closed(Duration::from_secs(5)));
    assert!(t.elapsed() >= Duration::from_millis(80));
    assert!(pier_test_support::wait_until(
        Duration::from_secs(2),
        || o.active_connections() == 0
    ));
}

#[test]
fn bad_responses_are_bad() {
    let o = Origin::start();
    for kind in ["garbage", "status", "header"] {
        let e = RawConn::connect(o.addr())
            .get(&format!("/bad/{kind}"))
            .unwrap_err();
        assert_eq!(e.kind(), std::io::ErrorKind::InvalidData, "{kind}: {e}");
    }
    // The origin really sends two differing Content-Lengths (the head alone shows
    // them); a whole read refuses the ambiguous framing, as Pier's codec does.
    let mut c = RawConn::connect(o.addr());
    c.send(b"GET /bad/two-cl HTTP/1.1\r\nhost: t\r\n\r\n");
    let r = c.read_head_only().unwrap();
    assert_eq!(r.header_all("content-length"), vec!["5", "6"]);
    let e = RawConn::connect(o.addr()).get("/bad/two-cl").unwrap_err();
    assert_eq!(e.kind(), std::io::ErrorKind::InvalidData, "{e}");
    let e = RawConn::connect(o.addr())
        .get("/bad/bad-chunk")
        .unwrap_err();
    assert_eq!(e.kind(), std::io::ErrorKind::InvalidData, "{e}");
}

#[test]
fn hop_sends_hop_by_hop_headers() {
    let o = Origin::start();
    let r = get(o.addr(), "/hop");
    assert_eq!(r.header("x-hop-secret"), Some("1"));
    assert_eq!(r.header("x-kept"), Some("yes"));
    assert_eq!(r.body, b"hop\n");
}

#[test]
fn eof_body_and_cookies() {
    let o = Origin::start();
    let mut c = RawConn::connect(o.addr());
    let r = c.get("/eof/100000").unwrap();
    assert!(r.close_delimited);
    assert_eq!(r.body.len(), 100_000);
    assert!(is_pattern(0, &r.body));
    let r = get(o.addr(), "/cookies");
    assert_eq!(
        r.header_all("set-cookie"),
        vec!["a=1", "b=2", "c=3; Path=/"]
    );
}
