//! Retries a phase decides (issue 32): after a failed attempt the driver's `Step::Fail`
//! asks `Phases::fail_to_connect` / `error_while_proxy`, which for Lua run the route's
//! `balancer` hook again (as OpenResty's `balancer_by_lua*` runs per try), with
//! `pier.balancer.get_last_failure()` saying what failed. A peer it sets is a
//! `Flow::Retry` there, carrying the request as the hook changed it. Real Pier, real
//! origins, a refused port for the connect failure.

mod common;

use common::*;

fn route(name: &str, path: &str, upstream: &str, balancer: &str) -> String {
    format!(
        "[[route]]\nname = \"{name}\"\npath = \"{path}\"\nupstream = \"{upstream}\"\n\n\
         [route.lua]\nbalancer = '''\n{balancer}\n'''\n\n"
    )
}

/// Pier with route `/r/` to upstream `app` (`app` servers, the `balancer` hook `bal`),
/// then `extra` config.
fn start(bal: &str, app: &[std::net::SocketAddr], extra: &str) -> PierProcess {
    pier(&base_config(
        "",
        &format!(
            "{}[upstream.app]\nservers = {}\n\n{extra}",
            route("r", "/r/", "app", bal),
            servers(app)
        ),
    ))
}

fn get(p: &PierProcess, method: &str, path: &str) -> Response {
    RawConn::connect(p.listener("main"))
        .request(method, path, &[], b"")
        .unwrap_or_else(|e| panic!("{method} {path}: {e}\n{}", p.logs()))
}

/// The first attempt goes to a port that refuses; the hook, run again with
/// `get_last_failure() == "failed", 502`, sends the retry to the live origin with a
/// header saying so.
#[test]
fn a_failed_connect_is_retried_where_the_balancer_says_with_a_changed_header() {
    let dead = dead_addr();
    let live = Origin::start_named("live");
    let bal = format!(
        r#"
local state, status = pier.balancer.get_last_failure()
if not state then
  pier.balancer.set_peer("127.0.0.1", {dead})
  pier.balancer.set_retries(1)
else
  pier.req.set_header("x-retried", state .. " " .. tostring(status))
  pier.balancer.set_peer("127.0.0.1", {live})
end
"#,
        dead = dead.port(),
        live = live.addr().port()
    );
    let p = start(&bal, &[dead], "");
    let r = get(&p, "GET", "/r/headers");
    assert_eq!(
        r.status,
        200,
        "{:?} {}\n{}",
        r.headers,
        r.body_str(),
        p.logs()
    );
    let seen = r.body_str().to_ascii_lowercase();
    assert!(
        seen.contains("x-retried: failed 502"),
        "the retried request carries the hook's header: {seen}"
    );
    assert_eq!(live.requests(), 1);
    assert_eq!(p.metric_value("pier_upstream_retries_total"), Some(1.0));
}

/// The origin takes the request and closes without answering: the hook, told
/// `"next"`, retries on another origin with the request's path and a header changed —
/// for a POST too, which the driver's own policy never retries.
#[test]
fn an_origin_failing_the_request_is_retried_elsewhere_changed_even_for_a_post() {
    let first = Origin::start_named("first");
    let second = Origin::start_named("second");
    let bal = format!(
        r#"
local state, status = pier.balancer.get_last_failure()
if not state then
  pier.balancer.set_peer("127.0.0.1", {first})
  pier.balancer.set_retries(2)
elseif pier.req.get_method() == "POST" or pier.req.get_header("x-retry-me") then
  pier.req.set_uri("/r/headers")
  pier.req.set_header("x-retried", state .. " " .. tostring(status))
  pier.balancer.set_peer("127.0.0.1", {second})
end
"#,
        first = first.addr().port(),
        second = second.addr().port()
    );
    // The same origin without the hook, on /plain/: the driver's own policy.
    let plain = format!(
        "[[route]]\nname = \"plain\"\npath = \"/plain/\"\nupstream = \"one\"\n\n\
         [upstream.one]\nservers = {}\n\n",
        servers(&[first.addr()])
    );
    let p = start(&bal, &[first.addr()], &plain);

    let r = get(&p, "POST", "/r/drop");
    assert_eq!(
        r.status,
        200,
        "{:?} {}\n{}",
        r.headers,
        r.body_str(),
        p.logs()
    );
    let seen = r.body_str().to_ascii_lowercase();
    assert!(
        seen.starts_with("post /r/headers "),
        "the path changed: {seen}"
    );
    assert!(seen.contains("x-retried: next 502"), "{seen}");
    assert_eq!(second.requests(), 1);

    // A GET the hook leaves to the driver: the peer was the hook's choice, which the
    // driver does not re-pick for itself: one attempt, 502.
    let r = get(&p, "GET", "/r/drop");
    assert_local(&r, 502, "upstream-closed");
    assert_eq!(second.requests(), 1, "the hook did not send it there");

    // Without a hook a POST that reached the origin is not retried.
    let before = first.requests();
    let r = get(&p, "POST", "/plain/drop");
    assert_local(&r, 502, "upstream-closed");
    assert_eq!(first.requests(), before + 1, "one attempt only");
}

/// A hook that always picks the same peer (written before the hook ran per try) is not
/// turned into a retry loop on that peer: its failed peer set again is the driver's
/// policy, which does not re-pick a hook's peer — one attempt, 502.
#[test]
fn the_failed_peer_set_again_is_not_retried() {
    let dead = dead_addr();
    let bal = format!(
        "pier.balancer.set_peer(\"127.0.0.1\", {})\npier.balancer.set_retries(2)",
        dead.port()
    );
    let p = start(&bal, &[dead], "");
    let r = get(&p, "POST", "/r/x");
    assert_local(&r, 502, "upstream-connect");
    assert_eq!(p.metric_value("pier_upstream_retries_total"), Some(0.0));
}
