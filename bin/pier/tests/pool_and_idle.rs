//! Keep-alive edges: origins that close idle pooled connections, Pier's own upstream and
//! client idle timeouts.

mod common;

use std::time::Duration;

use common::*;

#[test]
fn a_pooled_connection_the_origin_closed_is_not_a_failure() {
    let o = Origin::start();
    // The origin drops idle keep-alive connections after 100 ms; Pier's pool keeps
    // them longer, so the next request finds a dead pooled connection.
    o.set_idle_timeout(Some(Duration::from_millis(100)));
    let p = pier(&simple_config(
        &[o.addr()],
        "[timeouts]\nupstream_idle = \"60s\"",
        "retries = 0",
    ));
    let addr = p.listener("main");
    // After each request: the connection back in Pier's pool, then closed by the origin.
    let pooled_then_closed = |round: &str| {
        assert!(
            wait_until(Duration::from_secs(5), || {
                p.metric_value("pier_upstream_idle_connections") >= Some(1.0)
            }),
            "{round}: the upstream connection never went back to the pool"
        );
        assert!(
            wait_until(Duration::from_secs(5), || o.active_connections() == 0),
            "{round}: the origin did not close its idle connection"
        );
    };
    for round in 0..3 {
        assert_eq!(get(addr, "/hello").status, 200, "GET round {round}");
        pooled_then_closed(&format!("GET round {round}"));
    }
    for round in 0..3 {
        let r = RawConn::connect(addr)
            .request("POST", "/echo", &[], b"body")
            .unwrap();
        assert_eq!(
            (r.status, r.body.as_slice()),
            (200, &b"body"[..]),
            "POST round {round}"
        );
        pooled_then_closed(&format!("POST round {round}"));
    }
}

#[test]
fn idle_upstream_connections_are_closed_after_upstream_idle() {
    let o = Origin::start();
    let p = pier(&simple_config(
        &[o.addr()],
        "[timeouts]\nupstream_idle = \"200ms\"",
        "",
    ));
    assert_eq!(get(p.listener("main"), "/hello").status, 200);
    assert!(
        wait_until(Duration::from_secs(5), || o.active_connections() == 0),
        "pier kept {} idle upstream connection(s) past upstream_idle",
        o.active_connections()
    );
    // And the next request simply opens a new one.
    assert_eq!(get(p.listener("main"), "/hello").status, 200);
    assert_eq!(o.connections(), 2);
}

#[test]
fn idle_client_connections_are_closed_after_client_idle() {
    let o = Origin::start();
    let p = pier(&simple_config(
        &[o.addr()],
        "[timeouts]\nclient_idle = \"2s\"",
        "",
    ));
    let mut c = RawConn::connect(p.listener("main"));
    assert_eq!(c.get("/hello").unwrap().status, 200);
    // Within the idle time the connection is still usable (a pause well
    // inside it, so that a stalled machine cannot cross it).
    std::thread::sleep(Duration::from_millis(100));
    assert_eq!(c.get("/hello").unwrap().status, 200);
    assert!(
        c.is_closed(Duration::from_secs(10)),
        "idle client connection not closed"
    );
    assert!(
        c.buffered().is_empty(),
        "pier sent {:?} on an idle close",
        String::from_utf8_lossy(c.buffered())
    );
}

#[test]
fn active_connections_gauge_follows_clients() {
    let o = Origin::start();
    let p = pier(&simple_config(&[o.addr()], "", ""));
    let conns: Vec<RawConn> = (0..5)
        .map(|_| {
            let mut c = RawConn::connect(p.listener("main"));
            assert_eq!(c.get("/hello").unwrap().status, 200);
            c
        })
        .collect();
    assert_eq!(wait_metric(&p, "pier_active_connections", 5.0), Some(5.0));
    drop(conns);
    assert_eq!(wait_metric(&p, "pier_active_connections", 0.0), Some(0.0));
}

/// Cleartext upstream connections are on the worker's io_uring (`[server]
/// io_uring`, the default): pooled and reused there, bodies both ways. The
/// clients are kept on epoll (`PIER_IO_URING=0`, the origin leg turned back
/// on alone), so the ring Pier holds is the upstream leg's.
#[test]
fn upstream_connections_on_io_uring_are_pooled_and_reused() {
    let o = Origin::start();
    let cfg = simple_config(&[o.addr()], "", "");
    let p = pier_env(
        &cfg,
        &[("PIER_IO_URING", "0"), ("PIER_IO_URING_UPSTREAM", "1")],
    );
    let mut c = RawConn::connect(p.listener("main"));
    for i in 0..20 {
        assert_eq!(c.get("/hello").unwrap().status, 200, "request {i}");
    }
    // 1 MiB up and back down through the same pooled connection.
    let body: Vec<u8> = (0..1 << 20).map(|i: u32| (i % 251) as u8).collect();
    let r = c.request("POST", "/echo", &[], &body).unwrap();
    assert_eq!(r.status, 200);
    assert!(r.body == body, "the echo came back changed");
    assert_eq!(o.connections(), 1, "the pooled connection was not reused");
    if io_uring_expected() {
        assert!(rings(p.pid()) >= 1, "no io_uring in pier");
    }
}
