//! Upstreams: load balancing (round robin, weighted, hash, least connections, random of
//! two), retries and failover, active and passive health, and the origin deny list.

mod common;

use std::collections::HashMap;
use std::net::SocketAddr;
use std::time::Duration;

use common::*;

/// Which origin answered `/name`, counted over `n` requests on new connections.
fn spread(p: &PierProcess, n: usize, headers: &[(&str, &str)]) -> HashMap<String, usize> {
    let mut m = HashMap::new();
    for _ in 0..n {
        let r = RawConn::connect(p.listener("main"))
            .request("GET", "/name", headers, b"")
            .unwrap();
        assert_eq!(r.status, 200, "{}", r.body_str());
        *m.entry(r.body_str()).or_insert(0) += 1;
    }
    m
}

fn count(m: &HashMap<String, usize>, name: &str) -> usize {
    m.get(name).copied().unwrap_or(0)
}

fn healthy(p: &PierProcess, server: SocketAddr) -> Option<f64> {
    p.metric_value(&format!(
        r#"pier_upstream_healthy{{upstream="app",server="{server}"}}"#
    ))
}

/// Waits until Pier reports `server` healthy (1) or not (0).
#[track_caller]
fn wait_health(p: &PierProcess, server: SocketAddr, want: f64) {
    let mut last = None;
    let ok = wait_until(Duration::from_secs(10), || {
        last = healthy(p, server);
        last == Some(want)
    });
    assert!(
        ok,
        "pier_upstream_healthy for {server} is {last:?}, wanted {want}"
    );
}

/// Pier in front of two stock origins, `alpha` and `beta`, with `upstream_extra`
/// under `[upstream.app]`.
fn alpha_beta(upstream_extra: &str) -> (Origin, Origin, PierProcess) {
    let a = Origin::start_named("alpha");
    let b = Origin::start_named("beta");
    let p = pier(&simple_config(&[a.addr(), b.addr()], "", upstream_extra));
    (a, b, p)
}

#[test]
fn round_robin_alternates() {
    let (_a, _b, p) = alpha_beta("balance = \"round_robin\"");
    let m = spread(&p, 20, &[]);
    assert!((9..=11).contains(&count(&m, "alpha")), "{m:?}");
    assert!((9..=11).contains(&count(&m, "beta")), "{m:?}");
    // On one keep-alive client connection too: balancing is per request.
    let mut c = RawConn::connect(p.listener("main"));
    let names: Vec<String> = (0..10)
        .map(|_| c.get("/name").unwrap().body_str())
        .collect();
    let alphas = names.iter().filter(|n| *n == "alpha").count();
    assert!((4..=6).contains(&alphas), "{names:?}");
}

#[test]
fn weighted_round_robin_follows_weights() {
    let a = Origin::start_named("alpha");
    let b = Origin::start_named("beta");
    let p = pier(&base_config(
        "",
        &format!(
            r#"[[route]]
upstream = "app"

[upstream.app]
balance = "weighted_round_robin"
servers = [{{ addr = "{}", weight = 3 }}, {{ addr = "{}", weight = 1 }}]"#,
            a.addr(),
            b.addr()
        ),
    ));
    let m = spread(&p, 40, &[]);
    assert!((28..=32).contains(&count(&m, "alpha")), "{m:?}");
    assert!((8..=12).contains(&count(&m, "beta")), "{m:?}");
}

#[test]
fn hash_on_a_header_is_sticky() {
    let os: Vec<Origin> = ["o0", "o1", "o2"]
        .iter()
        .map(|n| Origin::start_named(n))
        .collect();
    let addrs: Vec<SocketAddr> = os.iter().map(|o| o.addr()).collect();
    let p = pier(&simple_config(
        &addrs,
        "",
        "balance = \"hash\"\nhash_key = \"header:x-user\"",
    ));
    let mut used = std::collections::HashSet::new();
    for u in 0..12 {
        let user = format!("user-{u}");
        let m = spread(&p, 4, &[("x-user", &user)]);
        assert_eq!(m.len(), 1, "{user} went to several servers: {m:?}");
        used.extend(m.into_keys());
    }
    assert!(used.len() >= 2, "12 users all hashed to {used:?}");
}

#[test]
fn hash_on_a_cookie_is_sticky() {
    let (_a, _b, p) = alpha_beta("balance = \"hash\"\nhash_key = \"cookie:session\"");
    let mut used = std::collections::HashSet::new();
    // The ring is laid out by the servers' addresses, whose ports change
    // every run: 10 sessions all landed on one server in a CI run; 64 do
    // with odds of about 2^-60 on an even ring.
    for s in 0..64 {
        let cookie = format!("theme=dark; session=s{s}; lang=en");
        let m = spread(&p, 3, &[("cookie", &cookie)]);
        assert_eq!(m.len(), 1, "{cookie} went to several servers: {m:?}");
        used.extend(m.into_keys());
    }
    assert_eq!(used.len(), 2, "64 sessions all hashed to {used:?}");
}

#[test]
fn least_conn_avoids_the_busy_server() {
    let (a, b, p) = alpha_beta("balance = \"least_conn\"");
    let addr = p.listener("main");
    let slow = std::thread::spawn(move || get(addr, "/slow/1500"));
    assert!(wait_until(Duration::from_secs(5), || a.requests()
        + b.requests()
        == 1));
    let busy = if a.requests() == 1 { "alpha" } else { "beta" };
    // Quick requests one at a time, each once the previous one has left Pier's
    // in-flight count (the client can see its response a moment before that).
    let mut m = HashMap::new();
    for _ in 0..6 {
        let mut in_flight = 0.0;
        let settled = wait_until(Duration::from_secs(5), || {
            in_flight = p.metric_sum("pier_upstream_active_requests", &[]);
            in_flight == 1.0
        });
        assert!(
            settled,
            "{in_flight} requests in flight, not just the slow one"
        );
        *m.entry(get(p.listener("main"), "/name").body_str())
            .or_insert(0) += 1;
    }
    assert_eq!(
        count(&m, busy),
        0,
        "least_conn sent to the busy {busy}: {m:?}"
    );
    let r = slow.join().unwrap();
    assert_eq!(r.header("x-origin"), Some(busy));
}

#[test]
fn random_two_uses_both_servers() {
    let (_a, _b, p) = alpha_beta("balance = \"random_two\"");
    let m = spread(&p, 40, &[]);
    assert!(count(&m, "alpha") >= 5 && count(&m, "beta") >= 5, "{m:?}");
}

#[test]
fn failover_when_a_server_is_down() {
    let (_a, b, p) = alpha_beta(
        "balance = \"round_robin\"\nretries = 2\nretry_budget = 1.0\nretry_min_per_sec = 100",
    );
    b.stop();
    // Every request succeeds: a connect failure is retried on the other server.
    let m = spread(&p, 20, &[]);
    assert_eq!(count(&m, "alpha"), 20, "{m:?}");
    // Connect failures are retried for non-idempotent requests too (nothing was sent).
    for _ in 0..10 {
        let r = RawConn::connect(p.listener("main"))
            .request("POST", "/echo", &[], b"payload")
            .unwrap();
        assert_eq!((r.status, r.body.as_slice()), (200, &b"payload"[..]));
    }
}

#[test]
fn active_http_health_check_takes_a_server_out_and_back() {
    let (a, b, p) = alpha_beta(
        r#"balance = "round_robin"
[upstream.app.health_check]
type = "http"
path = "/healthz"
expect = "200-399"
interval = "100ms"
timeout = "1s"
rise = 2
fall = 2"#,
    );
    wait_health(&p, b.addr(), 1.0);
    b.set_healthy(false);
    wait_health(&p, b.addr(), 0.0);
    assert_eq!(healthy(&p, a.addr()), Some(1.0));
    let before = b.requests();
    let m = spread(&p, 10, &[]);
    assert_eq!(count(&m, "alpha"), 10, "{m:?}");
    assert_eq!(b.requests(), before);
    assert!(b.health_checks() >= 2);

    b.set_healthy(true);
    wait_health(&p, b.addr(), 1.0);
    let m = spread(&p, 10, &[]);
    assert!(count(&m, "beta") >= 4, "beta is back: {m:?}");
}

#[test]
fn active_tcp_health_check_sees_a_server_die_and_return() {
    let a = Origin::start_named("alpha");
    let b = Origin::start_named("beta");
    let b_addr = b.addr();
    let p = pier(&simple_config(
        &[a.addr(), b_addr],
        "",
        r#"balance = "round_robin"
[upstream.app.health_check]
type = "tcp"
interval = "100ms"
timeout = "500ms"
rise = 1
fall = 1"#,
    ));
    wait_health(&p, b_addr, 1.0);
    b.stop();
    wait_health(&p, b_addr, 0.0);
    let m = spread(&p, 10, &[]);
    assert_eq!(count(&m, "alpha"), 10, "{m:?}");
    let b2 = Origin::start_at("beta-again", b_addr).expect("rebind beta's address");
    wait_health(&p, b_addr, 1.0);
    let m = spread(&p, 10, &[]);
    assert!(count(&m, "beta-again") >= 4, "{m:?}");
    drop(b2);
}

#[test]
fn passive_failures_mark_a_server_down_until_it_recovers() {
    let a = Origin::start_named("alpha");
    let b = Origin::start_named("beta");
    let b_addr = b.addr();
    let p = pier(&simple_config(
        &[a.addr(), b_addr],
        "",
        "balance = \"round_robin\"\nmax_fails = 2\npassive_recover = \"500ms\"\nretries = 1",
    ));
    b.stop();
    // All succeed (retried on alpha) and beta gets marked down.
    let m = spread(&p, 10, &[]);
    assert_eq!(count(&m, "alpha"), 10, "{m:?}");
    wait_health(&p, b_addr, 0.0);
    // Back up: after passive_recover Pier tries it again.
    let _b2 = Origin::start_at("beta-again", b_addr).expect("rebind beta's address");
    let seen = wait_until(Duration::from_secs(5), || {
        get(p.listener("main"), "/name").body_str() == "beta-again"
    });
    assert!(seen, "beta never got traffic again after it came back");
    wait_health(&p, b_addr, 1.0);
}

fn deny_config(server: &str, deny: &str) -> String {
    deny_route_config("", server, deny)
}

/// One route to `server` with `route_lua` under `[route.lua]` (if any), behind a
/// deny list.
fn deny_route_config(route_lua: &str, server: &str, deny: &str) -> String {
    let lua = if route_lua.is_empty() {
        String::new()
    } else {
        format!("[route.lua]\n{route_lua}\n")
    };
    base_config(
        &format!("[security]\ndeny_origins = [\"{deny}\"]"),
        &format!(
            "[[route]]\nupstream = \"app\"\n\n{lua}\n[upstream.app]\nservers = [\"{server}\"]\nretries = 0"
        ),
    )
}

#[test]
fn deny_origins_refuses_loopback_in_every_spelling() {
    // Pier checks configured servers against the deny list when it loads the config
    // (after resolving and normalising them), so a denied origin is a config error with
    // its location, and Pier never starts on it nor connects to it.
    let o = Origin::start();
    let port = o.addr().port();
    let dir = TempDir::new();
    for server in [
        format!("127.0.0.1:{port}"),
        format!("[::ffff:127.0.0.1]:{port}"),
        format!("[::ffff:7f00:1]:{port}"),
        format!("localhost:{port}"),
    ] {
        let cfg = deny_config(&server, "127.0.0.0/8");
        let line = cfg.lines().position(|l| l.starts_with("servers")).unwrap() + 1;
        let path = dir.write("deny.toml", &cfg);
        let out = run_with_timeout(
            std::process::Command::new(bin()).args(["check", "-c", path.to_str().unwrap()]),
            Duration::from_secs(20),
        );
        let text = String::from_utf8_lossy(&out.stderr).into_owned()
            + &String::from_utf8_lossy(&out.stdout);
        assert_eq!(out.status.code(), Some(1), "{server}: {text}");
        assert!(
            text.contains(&format!("deny.toml:{line}:")) && text.contains("deny_origins"),
            "{server}: {text}"
        );
        let started = PierProcess::launch(bin(), Some(&cfg), &["serve", "-c", "{config}"]);
        assert!(
            started.is_err(),
            "pier started with a denied origin {server}"
        );
    }
    assert_eq!(o.connections(), 0, "a denied origin was connected to");
}

#[test]
fn deny_origins_lets_other_ranges_through() {
    // The control for the test above: the same mapped address is reachable when the
    // deny list does not cover it.
    let o = Origin::start();
    let server = format!("[::ffff:127.0.0.1]:{}", o.addr().port());
    let p = pier(&deny_config(&server, "10.0.0.0/8"));
    let r = get(p.listener("main"), "/hello");
    assert_eq!(r.status, 200, "{:?}", r.body_str());
    assert_eq!(o.requests(), 1);
}

/// A route whose Lua balancer picks `ip:port` at request time, behind a deny list.
fn lua_peer_config(ip: &str, port: u16, deny: &str) -> String {
    // The configured server is never used: the balancer picks the peer. TEST-NET-1,
    // outside every deny list here.
    deny_route_config(
        &format!("balancer = 'pier.balancer.set_peer(\"{ip}\", {port})'"),
        "192.0.2.1:80",
        deny,
    )
}

#[test]
fn deny_origins_at_request_time_is_503_in_every_spelling() {
    // A peer chosen at request time (here by Lua) is checked after normalising it: an
    // IPv4-mapped IPv6 address is checked as the IPv4 address it maps.
    let o = Origin::start();
    let port = o.addr().port();
    for ip in [
        "127.0.0.1",
        "::ffff:127.0.0.1",
        "::ffff:7f00:1",
        "127.1.2.3",
    ] {
        let p = pier(&lua_peer_config(ip, port, "127.0.0.0/8"));
        let r = get(p.listener("main"), "/hello");
        assert_local(&r, 503, "origin-denied");
        assert_eq!(wait_local_count(&p, 503, "origin-denied", 1.0), 1.0, "{ip}");
    }
    assert_eq!(o.connections(), 0, "a denied origin was connected to");
    // Control: the same mapped address is reached when the list does not cover it.
    let p = pier(&lua_peer_config("::ffff:127.0.0.1", port, "10.0.0.0/8"));
    assert_eq!(get(p.listener("main"), "/hello").status, 200);
    assert_eq!(o.requests(), 1);
}

#[test]
fn retries_are_bounded_by_the_retry_budget() {
    let a = Origin::start_named("alpha");
    let dead = dead_addr();
    // No budget at all: a connect failure is not retried even though retries = 3.
    let p = pier(&simple_config(
        &[a.addr(), dead],
        "",
        "balance = \"round_robin\"\nmax_fails = 0\nretries = 3\nretry_budget = 0.0\nretry_min_per_sec = 0",
    ));
    let mut failed = 0;
    for _ in 0..10 {
        let r = get(p.listener("main"), "/name");
        match r.status {
            200 => assert_eq!(r.body_str(), "alpha"),
            _ => {
                assert_local(&r, 502, "upstream-connect");
                failed += 1;
            }
        }
    }
    assert!(
        (3..=7).contains(&failed),
        "{failed} of 10 failed with round robin over one dead server"
    );
    assert_eq!(p.metric_sum("pier_upstream_retries_total", &[]), 0.0);

    // With a budget, the same requests all succeed: a failure is retried once, on the
    // other server (a retry advances the round robin too, so the dead server may be
    // every request's first pick).
    let p = pier(&simple_config(
        &[a.addr(), dead],
        "",
        "balance = \"round_robin\"\nmax_fails = 0\nretries = 3\nretry_budget = 1.0\nretry_min_per_sec = 100",
    ));
    for _ in 0..10 {
        assert_eq!(get(p.listener("main"), "/name").body_str(), "alpha");
    }
    let retries = p.metric_sum("pier_upstream_retries_total", &[]);
    assert!((3.0..=10.0).contains(&retries), "retries {retries}");
}

#[test]
fn only_idempotent_requests_are_retried_after_being_sent() {
    let (a, b, p) = alpha_beta("balance = \"round_robin\"\nmax_fails = 0\nretries = 1\nretry_budget = 1.0\nretry_min_per_sec = 100");
    let sent = || a.requests() + b.requests();
    // POST reached an origin that then closed without answering: it may have acted on
    // it, so Pier must not send it again.
    let r = RawConn::connect(p.listener("main"))
        .request("POST", "/drop", &[], b"charge the card")
        .unwrap();
    assert_local(&r, 502, "upstream-closed");
    // `/drop` counts a request before it closes, and Pier answers only once every
    // attempt it made was closed on it: a second send was counted before the 502.
    // Waiting for the request to be logged covers any attempt still on its way.
    assert_eq!(wait_logged(&p, 1.0), 1.0);
    assert_eq!(upstream_exchanges(&p), 1.0, "a POST was sent twice");
    assert_eq!(sent(), 1, "a POST was sent twice");
    // GET is idempotent: retried once on the other server.
    let r = get(p.listener("main"), "/drop");
    assert_eq!(r.status, 502);
    assert_eq!(wait_logged(&p, 2.0), 2.0);
    assert_eq!(upstream_exchanges(&p), 3.0, "the GET was not retried once");
    assert_eq!(
        sent(),
        3,
        "the GET was not retried (or retried more than once)"
    );
    // The retry went to the other server: both were tried.
    assert!(a.requests() >= 1 && b.requests() >= 1);
}
