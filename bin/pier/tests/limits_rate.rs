//! `[[limit]]` rate rules through a real Pier process: 429 with `Retry-After` past the
//! rate, keys counted apart (client IP, header, composite), burst, recovery after the
//! window, dry run, and rules restricted to routes.
//!
//! Rates are per second on a sliding window aligned to Pier's own clock, which a test
//! cannot see. A count can shift by one only when requests for a key go on for a while
//! after a window boundary: the previous window is weighed by the part of it still
//! inside the last second, so for 10/s the next request passes only ≥ 99 ms into the
//! new window (for rate + burst 15, ≥ 66 ms). Every run of requests here takes a few
//! milliseconds on loopback; on a loaded machine it may not, so each scenario runs
//! under [`conclusive`]: judged strictly when its runs were fast, run again on a fresh
//! Pier when one was slow enough to straddle and it failed.

mod common;

use std::cell::Cell;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::panic::{catch_unwind, resume_unwind, AssertUnwindSafe};
use std::time::{Duration, Instant};

use common::*;

const OTHER_IP: IpAddr = IpAddr::V4(Ipv4Addr::new(127, 0, 0, 2));
const LOCAL_IP: IpAddr = IpAddr::V4(Ipv4Addr::LOCALHOST);

/// Runs of counted requests no longer than this cannot shift a count (the least
/// margin above is 66 ms).
const SAFE_RUN: Duration = Duration::from_millis(60);
/// Attempts before a failure stands even though a run was slow.
const ATTEMPTS: u32 = 5;

thread_local! {
    /// When the current run of counted requests began (reset by [`new_run`]).
    static RUN_START: Cell<Option<Instant>> = const { Cell::new(None) };
    /// The longest run of counted requests in this attempt so far.
    static LONGEST_RUN: Cell<Duration> = const { Cell::new(Duration::ZERO) };
}

/// One counted request (or several), timed as part of the current run.
fn counted<T>(f: impl FnOnce() -> T) -> T {
    let before = Instant::now();
    let start = RUN_START.with(|s| *s.get().get_or_insert(before));
    RUN_START.with(|s| s.set(Some(start)));
    let r = f();
    let run = start.elapsed();
    LONGEST_RUN.with(|l| l.set(l.get().max(run)));
    r
}

/// Starts a new run of counted requests (after waiting out a window on purpose).
fn new_run() {
    RUN_START.with(|s| s.set(None));
}

/// Runs a scenario (which starts its own origin and Pier) until it is conclusive: a
/// failure stands when every run of counted requests was shorter than [`SAFE_RUN`]
/// (no window boundary can explain it), or after [`ATTEMPTS`]; a failure with a slow
/// run is tried again on a fresh Pier. A pass always stands.
fn conclusive(scenario: impl Fn()) {
    for attempt in 1..=ATTEMPTS {
        new_run();
        LONGEST_RUN.with(|l| l.set(Duration::ZERO));
        let result = catch_unwind(AssertUnwindSafe(&scenario));
        let longest = LONGEST_RUN.with(Cell::get);
        match result {
            Ok(()) => return,
            Err(_) if longest > SAFE_RUN && attempt < ATTEMPTS => eprintln!(
                "attempt {attempt} inconclusive: a run of requests took {longest:?} (over \
                 {SAFE_RUN:?}, it may have straddled a rate window); trying again"
            ),
            Err(e) => resume_unwind(e),
        }
    }
}

/// A catch-all route `default` and a route `api` (`/api/`), both to the origin, with
/// `limits` (`[[limit]]` blocks) after them.
fn limit_config(o: &Origin, limits: &str) -> String {
    base_config(
        "",
        &format!(
            r#"[[route]]
name = "api"
path = "/api/"
upstream = "app"

[[route]]
name = "default"
upstream = "app"

[upstream.app]
servers = ["{}"]

{limits}
"#,
            o.addr()
        ),
    )
}

/// One request on a fresh connection from `from`, with extra headers.
fn req_from(from: IpAddr, addr: SocketAddr, path: &str, headers: &[(&str, &str)]) -> Response {
    counted(|| {
        RawConn::connect_from(from, addr)
            .request("GET", path, headers, b"")
            .unwrap_or_else(|e| panic!("GET {path} from {from}: {e}"))
    })
}

fn req(addr: SocketAddr, path: &str, headers: &[(&str, &str)]) -> Response {
    req_from(LOCAL_IP, addr, path, headers)
}

/// Asserts a 429 rate-limited refusal with a sane `Retry-After` (whole seconds, at
/// least 1, at most 2 for a per-second limit: the window plus rounding).
#[track_caller]
fn assert_rate_limited(r: &Response) {
    assert_local(r, 429, "rate-limited");
    let ra = r
        .header("retry-after")
        .unwrap_or_else(|| panic!("429 without Retry-After: {:?}", r.headers));
    let secs: u64 = ra
        .trim()
        .parse()
        .unwrap_or_else(|_| panic!("Retry-After is not whole seconds: {ra:?}"));
    assert!(
        (1..=2).contains(&secs),
        "Retry-After {secs} for a 10/s limit"
    );
}

/// Sends `n` requests (fresh connections) and returns their statuses.
fn statuses(n: usize, mut one: impl FnMut() -> Response) -> Vec<u16> {
    (0..n).map(|_| one().status).collect()
}

fn denied(p: &PierProcess, limit: &str, dry_run: bool) -> f64 {
    p.metric_sum(
        "pier_limit_denied_total",
        &[
            ("limit", limit),
            ("dry_run", if dry_run { "true" } else { "false" }),
        ],
    )
}

#[test]
fn client_over_the_rate_gets_429_while_another_client_is_unaffected() {
    conclusive(|| {
        let o = Origin::start();
        let p = pier(&limit_config(
            &o,
            r#"[[limit]]
    name = "per-ip"
    key = "client_ip"
    rate = "10/s"
    "#,
        ));
        let a = p.listener("main");
        for i in 0..10 {
            let r = req(a, "/hello", &[]);
            assert_eq!(r.status, 200, "request {i} of 10 within the rate");
            assert_eq!(r.body_str(), "hello world\n");
        }
        for _ in 0..5 {
            assert_rate_limited(&req(a, "/hello", &[]));
        }
        // Another client IP has its own count: all 10 of its requests pass, even while the
        // first one is over the limit.
        for i in 0..10 {
            let r = req_from(OTHER_IP, a, "/hello", &[]);
            assert_eq!(r.status, 200, "request {i} from {OTHER_IP}");
        }
        assert_rate_limited(&req_from(OTHER_IP, a, "/hello", &[]));
        assert_rate_limited(&req(a, "/hello", &[]));
        // Refused requests never reach the origin.
        assert_eq!(o.requests(), 20);
        assert_eq!(wait_local_count(&p, 429, "rate-limited", 7.0), 7.0);
        assert_eq!(denied(&p, "per-ip", false), 7.0);
    });
}

#[test]
fn header_keyed_limit_counts_each_value_apart() {
    conclusive(|| {
        let o = Origin::start();
        let p = pier(&limit_config(
            &o,
            r#"[[limit]]
    name = "per-client"
    key = "header:X-Client"
    rate = "10/s"
    "#,
        ));
        let a = p.listener("main");
        let ok_a = statuses(10, || req(a, "/hello", &[("X-Client", "a")]));
        assert_eq!(ok_a, vec![200; 10]);
        assert_rate_limited(&req(a, "/hello", &[("X-Client", "a")]));
        // Header names are case-insensitive; the value "b" is another key.
        let ok_b = statuses(10, || req(a, "/hello", &[("x-client", "b")]));
        assert_eq!(ok_b, vec![200; 10], "X-Client: b is a different key");
        assert_rate_limited(&req(a, "/hello", &[("X-CLIENT", "b")]));
        assert_rate_limited(&req(a, "/hello", &[("X-Client", "a")]));
        // A request without the header has no key: the rule does not apply to it.
        let none = statuses(15, || req(a, "/hello", &[]));
        assert_eq!(none, vec![200; 15], "requests without the key header");
        assert_eq!(o.requests(), 35);
        assert_eq!(denied(&p, "per-client", false), 3.0);
    });
}

#[test]
fn burst_allows_exactly_rate_plus_burst_then_recovers_after_the_window() {
    conclusive(|| {
        let o = Origin::start();
        let p = pier(&limit_config(
            &o,
            r#"[[limit]]
    name = "bursty"
    key = "client_ip"
    rate = "10/s"
    burst = 5
    "#,
        ));
        let a = p.listener("main");
        // On one keep-alive connection: a refusal must not cost the connection either.
        let mut c = RawConn::connect(a);
        let first: Vec<u16> = (0..22)
            .map(|_| counted(|| c.get("/hello").unwrap().status))
            .collect();
        let mut want = vec![200; 15];
        want.extend([429; 7]);
        assert_eq!(first, want, "10/s with burst 5: exactly 15 pass at once");
        assert_rate_limited(&counted(|| c.get("/hello").unwrap()));

        // Two windows later nothing of the burst counts any more (its window is neither
        // current nor previous): the full allowance again, exactly.
        // The wait is what is tested; it starts after the last response, so a slow
        // machine only lengthens it.
        std::thread::sleep(Duration::from_millis(2100));
        new_run();
        let again: Vec<u16> = (0..17)
            .map(|_| counted(|| c.get("/hello").unwrap().status))
            .collect();
        let mut want = vec![200; 15];
        want.extend([429; 2]);
        assert_eq!(again, want, "after the window: 15 again, then refused");
        assert_eq!(o.requests(), 30);
        assert_eq!(denied(&p, "bursty", false), 10.0);
    });
}

#[test]
fn dry_run_counts_but_never_blocks() {
    conclusive(|| {
        let o = Origin::start();
        let p = pier(&limit_config(
            &o,
            r#"[[limit]]
    name = "watch"
    key = "client_ip"
    rate = "10/s"
    dry_run = true
    "#,
        ));
        let a = p.listener("main");
        assert_eq!(denied(&p, "watch", true), 0.0);
        let all = statuses(25, || req(a, "/hello", &[]));
        assert_eq!(all, vec![200; 25], "a dry-run limit never refuses");
        assert_eq!(o.requests(), 25);
        // The 15 requests past 10/s are counted as would-be refusals, under dry_run="true".
        let mut n = 0.0;
        wait_until(Duration::from_secs(5), || {
            n = denied(&p, "watch", true);
            n >= 15.0
        });
        assert_eq!(n, 15.0, "{}", p.metrics());
        assert_eq!(denied(&p, "watch", false), 0.0);
        assert_eq!(local_count(&p, 429, "rate-limited"), 0.0);
    });
}

#[test]
fn limit_restricted_to_a_route_leaves_other_routes_alone() {
    conclusive(|| {
        let o = Origin::start();
        let p = pier(&limit_config(
            &o,
            r#"[[limit]]
    name = "api-only"
    key = "client_ip"
    rate = "10/s"
    routes = ["api"]
    "#,
        ));
        let a = p.listener("main");
        let api = statuses(14, || req(a, "/api/hello", &[]));
        let mut want = vec![200; 10];
        want.extend([429; 4]);
        assert_eq!(api, want, "the api route is limited");
        // The same client, over the limit on `api`, is not limited on `default`.
        let other = statuses(20, || req(a, "/hello", &[]));
        assert_eq!(other, vec![200; 20], "the default route has no limit");
        assert_rate_limited(&req(a, "/api/hello", &[]));
        assert_eq!(o.requests(), 30);
        assert_eq!(denied(&p, "api-only", false), 5.0);
    });
}

#[test]
fn composite_key_counts_each_combination_apart() {
    conclusive(|| {
        let o = Origin::start();
        let p = pier(&limit_config(
            &o,
            r#"[[limit]]
    name = "ip-and-key"
    key = ["client_ip", "header:X-Api-Key"]
    rate = "5/s"
    "#,
        ));
        let a = p.listener("main");
        let k1 = [("X-Api-Key", "k1")];
        let k2 = [("X-Api-Key", "k2")];
        assert_eq!(statuses(5, || req(a, "/hello", &k1)), vec![200; 5]);
        assert_rate_limited(&req(a, "/hello", &k1));
        // Same IP, other key: its own count.
        assert_eq!(statuses(5, || req(a, "/hello", &k2)), vec![200; 5]);
        assert_rate_limited(&req(a, "/hello", &k2));
        // Same key, other IP: its own count.
        assert_eq!(
            statuses(5, || req_from(OTHER_IP, a, "/hello", &k1)),
            vec![200; 5]
        );
        assert_rate_limited(&req_from(OTHER_IP, a, "/hello", &k1));
        // A request lacking one part has no key and is not limited.
        assert_eq!(statuses(8, || req(a, "/hello", &[])), vec![200; 8]);
        assert_eq!(o.requests(), 23);
        assert_eq!(denied(&p, "ip-and-key", false), 3.0);
    });
}

#[test]
fn path_and_cookie_keys_count_each_value_apart() {
    conclusive(|| {
        let o = Origin::start();
        let p = pier(&limit_config(
            &o,
            r#"[[limit]]
    name = "per-path"
    key = "path"
    rate = "3/s"

    [[limit]]
    name = "per-session"
    key = "cookie:sid"
    rate = "4/s"
    "#,
        ));
        let a = p.listener("main");
        // Paths: each its own count (the query string is not part of the path).
        assert_eq!(statuses(3, || req(a, "/hello?x=1", &[])), vec![200; 3]);
        assert_rate_limited(&req(a, "/hello?x=2", &[]));
        assert_eq!(statuses(3, || req(a, "/name", &[])), vec![200; 3]);
        assert_rate_limited(&req(a, "/name", &[]));
        // Cookies: each session its own count, on paths of their own so the path rule stays
        // under its rate (4 requests on 2 paths per session).
        let s1 = [("Cookie", "theme=dark; sid=one")];
        let s2 = [("Cookie", "sid=two")];
        let mut got = Vec::new();
        for path in ["/echo/1", "/echo/2", "/echo/1", "/echo/2"] {
            got.push(req(a, path, &s1).status);
        }
        assert_eq!(got, vec![200; 4], "session one within its rate");
        assert_rate_limited(&req(a, "/echo/3", &s1));
        got.clear();
        for path in ["/echo/3", "/echo/4", "/echo/4", "/echo/5"] {
            got.push(req(a, path, &s2).status);
        }
        assert_eq!(got, vec![200; 4], "session two has its own count");
        assert_eq!(denied(&p, "per-path", false), 2.0);
        assert_eq!(denied(&p, "per-session", false), 1.0);
    });
}

fn custom_status_config(o: &Origin) -> String {
    limit_config(
        o,
        r#"[[limit]]
name = "strict"
key = "route"
rate = "2/s"
status = 503
"#,
    )
}

#[test]
fn custom_status_is_used_for_refusals() {
    conclusive(|| {
        let o = Origin::start();
        let p = pier(&custom_status_config(&o));
        let a = p.listener("main");
        assert_eq!(statuses(2, || req(a, "/hello", &[])), vec![200; 2]);
        let r = req(a, "/hello", &[]);
        assert_local(&r, 503, "rate-limited");
        assert!(r.header("retry-after").is_some(), "{:?}", r.headers);
        // The `route` key: another route has its own count.
        assert_eq!(statuses(2, || req(a, "/api/hello", &[])), vec![200; 2]);
        assert_eq!(req(a, "/api/hello", &[]).status, 503);
        assert_eq!(denied(&p, "strict", false), 2.0);
    });
}

#[test]

fn custom_status_refusals_are_counted_under_that_status() {
    conclusive(|| {
        let o = Origin::start();
        let p = pier(&custom_status_config(&o));
        let a = p.listener("main");
        assert_eq!(statuses(2, || req(a, "/hello", &[])), vec![200; 2]);
        assert_eq!(req(a, "/hello", &[]).status, 503);
        assert_eq!(wait_local_count(&p, 503, "rate-limited", 1.0), 1.0);
        assert_eq!(local_count(&p, 429, "rate-limited"), 0.0);
    });
}

/// Two origins behind round robin, a rate per upstream server.
fn upstream_server_config(a: &Origin, b: &Origin, extra: &str) -> String {
    base_config(
        "",
        &format!(
            r#"[[route]]
name = "default"
upstream = "app"

[upstream.app]
servers = ["{}", "{}"]
retries = 0

[[limit]]
name = "per-server"
key = "upstream_server"
rate = "3/s"
{extra}
"#,
            a.addr(),
            b.addr()
        ),
    )
}

#[test]
fn upstream_server_key_limits_each_server_apart() {
    conclusive(|| {
        let (oa, ob) = (Origin::start_named("a"), Origin::start_named("b"));
        let p = pier(&upstream_server_config(&oa, &ob, ""));
        let a = p.listener("main");
        let all = statuses(12, || req(a, "/hello", &[]));
        let ok = all.iter().filter(|s| **s == 200).count();
        let limited = all.iter().filter(|s| **s == 429).count();
        assert_eq!(
            (ok, limited),
            (6, 6),
            "3/s per server, two servers: {all:?}"
        );
        assert_eq!((oa.requests(), ob.requests()), (3, 3));
        assert_eq!(denied(&p, "per-server", false), 6.0);
        assert_eq!(wait_local_count(&p, 429, "rate-limited", 6.0), 6.0);
    });
}

#[test]
fn upstream_server_key_refusal_has_retry_after_and_the_rule_status() {
    conclusive(|| {
        let (oa, ob) = (Origin::start_named("a"), Origin::start_named("b"));
        let p = pier(&upstream_server_config(&oa, &ob, "status = 503"));
        let a = p.listener("main");
        let all: Vec<Response> = (0..8).map(|_| req(a, "/hello", &[])).collect();
        let refused: Vec<&Response> = all.iter().filter(|r| r.status != 200).collect();
        assert_eq!(
            refused.len(),
            2,
            "{:?}",
            all.iter().map(|r| r.status).collect::<Vec<_>>()
        );
        for r in refused {
            assert_local(r, 503, "rate-limited");
            assert!(r.header("retry-after").is_some(), "{:?}", r.headers);
        }
    });
}

#[test]
fn counters_survive_a_reload_that_keeps_the_rule() {
    let o = Origin::start();
    let limit = r#"[[limit]]
name = "per-minute"
key = "client_ip"
rate = "10/m"
"#;
    let mut p = pier(&limit_config(&o, limit));
    let a = p.listener("main");
    assert_eq!(statuses(10, || req(a, "/hello", &[])), vec![200; 10]);
    let r = req(a, "/hello", &[]);
    assert_local(&r, 429, "rate-limited");
    // Reload with an unrelated change (one more route): the rule is the same, so its
    // counts are kept and the client stays limited.
    let text = limit_config(&o, limit).replace(
        "[[route]]\nname = \"default\"",
        "[[route]]\nname = \"extra\"\nexact = \"/name\"\nupstream = \"app\"\n\n[[route]]\nname = \"default\"",
    );
    assert_ne!(text, limit_config(&o, limit));
    p.rewrite_config(&text);
    p.signal(sig::SIGHUP);
    p.wait_generation(2);
    let a = p.listener("main");
    assert_local(&req(a, "/hello", &[]), 429, "rate-limited");
    assert_eq!(
        req(a, "/name", &[]).status,
        429,
        "the limit covers the new route too"
    );
    let r = req_from(OTHER_IP, a, "/name", &[]);
    assert_eq!((r.status, r.body_str().as_str()), (200, "origin"));
}
