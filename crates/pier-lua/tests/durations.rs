//! A number from Lua never panics: every API taking a time rejects NaN,
//! infinities, negatives and values over a year with a Lua error (the hook
//! fails, the engine stays usable).

mod support;

use pier_lua::{LuaEngine, RequestCtx};
use support::*;

/// The Lua expressions of the bad durations tried on every API.
const BAD: [&str; 5] = ["1e20", "-1", "0/0", "math.huge", "-math.huge"];

/// Runs the access hook of `e` with `x-d: <expr>`; the hook reads the
/// expression as `D`.
async fn run_with(e: &LuaEngine, expr: &str) -> Result<(), String> {
    let mut view = TestView::default();
    view.headers
        .push((b"x-d".to_vec(), expr.as_bytes().to_vec()));
    e.access(0, &mut view, &mut RequestCtx::new())
        .await
        .map(|_| ())
        .map_err(|e| e.to_string())
}

/// An engine whose access hook evaluates header `x-d` into `D`, then runs `body`.
fn engine_for(body: &str) -> LuaEngine {
    access_engine(&format!(
        "local D = assert(load('return ' .. pier.req.get_header('x-d')))()\n{body}"
    ))
}

/// Each bad value fails the hook with "invalid duration"; `good` still works
/// on the same engine afterwards.
fn check(body: &str, good: &str) {
    let e = engine_for(body);
    run(async {
        for bad in BAD {
            let err = run_with(&e, bad).await.expect_err(bad);
            assert!(err.contains("invalid duration"), "{bad}: {err}");
            run_with(&e, good)
                .await
                .unwrap_or_else(|err| panic!("after {bad}: {err}"));
        }
    });
}

#[test]
fn sleep_rejects_bad_durations_and_the_engine_stays_usable() {
    check("pier.sleep(D)", "0");
    // Just over a year is refused too; a year is accepted (not slept here).
    let e = engine_for("pier.sleep(D)");
    run(async {
        let err = run_with(&e, &format!("{} + 1", pier_lua::MAX_DURATION_SECS))
            .await
            .unwrap_err();
        assert!(err.contains("invalid duration"), "{err}");
        run_with(&e, "0.001").await.unwrap();
    });
}

#[test]
fn timers_reject_bad_durations() {
    check("assert(pier.timer.at(D, function() end))", "0");
    check("assert(pier.timer.every(D, function() end))", "3600");
}

#[test]
fn cosocket_timeouts_reject_bad_durations() {
    check("pier.socket.tcp():settimeout(D)", "100");
    // setkeepalive checks its idle time before needing a connection.
    check(
        "local s = pier.socket.tcp(); local ok, err = s:setkeepalive(D); assert(err == 'closed')",
        "1000",
    );
}

#[test]
fn http_timeout_rejects_bad_durations() {
    // Checked before any connection is attempted (port 9 on 127.0.0.1 is
    // never reached for the bad values; the good value may fail to connect).
    check(
        "pier.http.request{ url = 'http://127.0.0.1:9/', timeout = D }",
        "1",
    );
}

#[test]
fn shared_dict_ttls_reject_bad_durations() {
    check("pier.shared.cache:set('k', 1, D)", "10");
    check("pier.shared.cache:incr('n', 1, 0, D)", "10");
    check(
        "pier.shared.cache:set('e', 1); pier.shared.cache:expire('e', D)",
        "10",
    );
}

#[test]
fn limit_incr_rejects_bad_counts() {
    let e = access_engine(
        r#"
        for _, n in ipairs({ 1e20, -1, 0/0, math.huge }) do
            local ok, err = pcall(pier.limit.incr, "k", n)
            assert(not ok and err:find("bad argument #2", 1, true), tostring(n))
        end
        assert(pier.limit.incr("k", 2) >= 2)
        "#,
    );
    run(async {
        e.access(0, &mut TestView::default(), &mut RequestCtx::new())
            .await
            .unwrap();
    });
}
