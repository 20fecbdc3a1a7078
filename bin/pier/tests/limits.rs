//! Connection limits: client connections (total and per IP), upstream connections per
//! server, idle connections kept in the pool.

mod common;

use std::time::Duration;

use common::*;

#[test]
fn max_connections_per_ip_closes_the_extra_ones() {
    let o = Origin::start();
    let p = pier(&simple_config(
        &[o.addr()],
        "[limits]\nmax_connections_per_ip = 2",
        "",
    ));
    let addr = p.listener("main");
    let mut kept: Vec<RawConn> = (0..2)
        .map(|_| {
            let mut c = RawConn::connect(addr);
            assert_eq!(c.get("/hello").unwrap().status, 200);
            c
        })
        .collect();
    let mut extra = RawConn::connect(addr);
    let _ = extra.try_send(b"GET /hello HTTP/1.1\r\nhost: a\r\n\r\n");
    assert!(
        extra.read_response().is_err(),
        "a third connection from one IP was served"
    );
    assert!(extra.is_closed(Duration::from_secs(20)));
    // The first two are unaffected; a slot freed is usable again.
    assert_eq!(kept[0].get("/hello").unwrap().status, 200);
    kept.pop();
    let mut again = None;
    assert!(wait_until(Duration::from_secs(20), || {
        again = try_get(addr, "/hello").ok();
        again.as_ref().is_some_and(|r| r.status == 200)
    }));
}

#[test]

fn max_connections_per_server_caps_upstream_connections() {
    let o = Origin::start();
    let p = pier(&simple_config(
        &[o.addr()],
        "",
        "max_connections_per_server = 1\nretries = 0",
    ));
    let addr = p.listener("main");
    let threads: Vec<_> = (0..3)
        .map(|_| std::thread::spawn(move || get(addr, "/slow/2000")))
        .collect();
    // Sample the origin's open connections for as long as any request runs (not for a
    // fixed time that a loaded machine could outlast). The pause is the sampling pace.
    let mut peak = 0;
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    while threads.iter().any(|t| !t.is_finished()) && std::time::Instant::now() < deadline {
        peak = peak.max(o.active_connections());
        std::thread::sleep(Duration::from_millis(2));
    }
    for t in threads {
        let r = t.join().unwrap();
        // Served in turn, or refused with a reason; never over the cap.
        assert!(
            r.status == 200 || r.pier_reason() == Some("upstream-limited"),
            "{} {:?} {}",
            r.status,
            r.pier_reason(),
            r.body_str()
        );
    }
    assert!(peak <= 1, "{peak} upstream connections open at once");
    assert_eq!(o.connections(), 1);
}

#[test]

fn pool_keeps_at_most_pool_idle_per_server() {
    let o = Origin::start();
    let p = pier(&simple_config(&[o.addr()], "", "pool_idle_per_server = 1"));
    let addr = p.listener("main");
    let threads: Vec<_> = (0..4)
        .map(|_| std::thread::spawn(move || get(addr, "/slow/300")))
        .collect();
    for t in threads {
        assert_eq!(t.join().unwrap().status, 200);
    }
    assert_eq!(
        o.connections(),
        4,
        "four requests at once need four connections"
    );
    assert!(
        wait_until(Duration::from_secs(20), || o.active_connections() == 1),
        "{} idle upstream connections kept with pool_idle_per_server = 1",
        o.active_connections()
    );
}
