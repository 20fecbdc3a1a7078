//! Yielding APIs: pier.sleep, timers, and the memory limit.

mod support;

use std::sync::Arc;
use std::time::{Duration, Instant};

use pier_lua::{LuaEngine, LuaSetup, RequestCtx, RouteHooks};
use support::*;

fn engine_with(reg: &Arc<pier_shdict::Registry>, s: LuaSetup) -> LuaEngine {
    LuaEngine::new(Arc::new(s), reg.clone()).unwrap()
}

fn dict_num(reg: &pier_shdict::Registry, key: &str) -> Option<f64> {
    let mut out = Vec::new();
    match reg
        .get("cache")
        .unwrap()
        .get(key.as_bytes(), 0, &mut out)?
        .value
    {
        pier_shdict::HitValue::Number(n) => Some(n),
        _ => None,
    }
}

#[test]
fn sleep_yields_and_interleaves_requests() {
    let e = access_engine(
        r#"
        pier.ctx.id = pier.req.get_uri()
        pier.sleep(1)
        assert(pier.ctx.id == pier.req.get_uri(), "ctx mixed up across a yield")
        pier.resp.set_header("x-after", pier.var.request_uri)
        "#,
    );
    let (mut v1, mut v2) = (TestView::default(), TestView::default());
    v2.uri = b"/second".to_vec();
    let (mut c1, mut c2) = (RequestCtx::new(), RequestCtx::new());
    let t0 = Instant::now();
    let (r1, r2) =
        run(async { tokio::join!(e.access(0, &mut v1, &mut c1), e.access(0, &mut v2, &mut c2)) });
    let took = t0.elapsed();
    r1.unwrap();
    r2.unwrap();
    assert!(took >= Duration::from_secs(1), "{took:?}");
    // Both slept at once on one thread (one after the other would be >= 2 s).
    assert!(took < Duration::from_millis(1900), "{took:?}");
    assert_eq!(v2.resp("x-after").as_deref(), Some("/second"));
    assert!(v1.resp("x-after").unwrap().starts_with("/api/items"));
}

#[test]
fn exit_after_sleep() {
    let e = access_engine("pier.sleep(0.01) pier.exit(429, 'slow down')");
    let flow = run(e.access(0, &mut TestView::default(), &mut RequestCtx::new())).unwrap();
    assert!(matches!(flow, pier_lua::Flow::Respond { status: 429, .. }));
}

#[test]
fn timers_at_and_every() {
    let reg = registry(&[("cache", 1 << 20)]);
    let e = engine_with(
        &reg,
        setup(RouteHooks {
            access: src(
                "route t access",
                r#"
                assert(pier.timer.at(0.02, function(premature, key, val)
                    assert(premature == false)
                    assert(pier.get_phase() == "timer")
                    local ok, err = pcall(pier.req.get_method)
                    pier.shared.cache:set("timer_req_err", err)
                    pier.sleep(0.01) -- timers may yield
                    pier.shared.cache:set(key, val)
                end, "at_key", 42))
                assert(pier.timer.every(0.02, function()
                    pier.shared.cache:incr("ticks", 1, 0)
                end))
                local ok, err = pcall(pier.timer.every, 0, function() end)
                assert(not ok and tostring(err):find("invalid duration", 1, true), tostring(err))
                "#,
            ),
            ..Default::default()
        }),
    );
    let t0 = Instant::now();
    run(async {
        e.access(0, &mut TestView::default(), &mut RequestCtx::new())
            .await
            .unwrap();
        // Until the one-shot timer has run and the repeating one ticked twice.
        while t0.elapsed() < Duration::from_secs(10)
            && !(dict_num(&reg, "at_key").is_some() && dict_num(&reg, "ticks") >= Some(2.0))
        {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    });
    let took = t0.elapsed();
    assert_eq!(dict_num(&reg, "at_key"), Some(42.0));
    assert!(dict_str(&reg, "timer_req_err")
        .contains("API pier.req.get_method is disabled in phase timer"));
    let ticks = dict_num(&reg, "ticks").unwrap();
    // At a 20 ms interval: never more ticks than intervals elapsed.
    let most = (took.as_millis() / 20) as f64 + 1.0;
    assert!((2.0..=most).contains(&ticks), "{ticks} ticks in {took:?}");
}

#[test]
fn timers_stop_when_the_engine_is_dropped() {
    let reg = registry(&[("cache", 1 << 20)]);
    let mut s = setup(RouteHooks::default());
    // Started in init_worker: pending until the engine runs in the LocalSet.
    s.init_worker = src(
        "init_worker",
        "assert(pier.timer.every(0.01, function() pier.shared.cache:incr('w', 1, 0) end))",
    );
    let e = engine_with(&reg, s);
    run(async {
        e.start_timers();
        tokio::time::sleep(Duration::from_millis(80)).await;
        drop(e);
        let at_drop = dict_num(&reg, "w").unwrap();
        assert!(at_drop >= 2.0, "{at_drop}");
        tokio::time::sleep(Duration::from_millis(60)).await;
        // At most one run that was already sleeping when the engine went.
        assert!(dict_num(&reg, "w").unwrap() <= at_drop + 1.0);
    });
}

#[test]
fn timer_not_allowed_in_init() {
    let mut s = setup(RouteHooks::default());
    s.init = src("init", "pier.timer.at(0, function() end)");
    let err = LuaEngine::new(Arc::new(s), registry(&[])).err().unwrap();
    assert!(
        err.message
            .contains("init:1: API pier.timer.at is disabled in phase init"),
        "{}",
        err.message
    );
}

#[test]
fn memory_limit_fails_the_hook_not_the_engine() {
    let mut s = setup(RouteHooks {
        access: src(
            "route t access",
            "if pier.req.get_header('x-hog') then local t = {} for i = 1, 1e8 do t[i] = {i} end end pier.resp.set_header('x-ok', 1)",
        ),
        ..Default::default()
    });
    s.memory_limit = 16 << 20;
    let e = LuaEngine::new(Arc::new(s), registry(&[])).unwrap();
    let mut v = TestView::default();
    v.headers.push((b"X-Hog".to_vec(), b"1".to_vec()));
    let err = run(e.access(0, &mut v, &mut RequestCtx::new())).unwrap_err();
    assert!(err.message.contains("memory"), "{}", err.message);
    // The very next hook on the state works (the failed run's garbage was
    // released and collected), and so do the following ones.
    for _ in 0..3 {
        let mut v = TestView::default();
        run(e.access(0, &mut v, &mut RequestCtx::new())).unwrap();
        assert_eq!(v.resp("x-ok").as_deref(), Some("1"));
        let mut v = TestView::default();
        v.headers.push((b"X-Hog".to_vec(), b"1".to_vec()));
        assert!(run(e.access(0, &mut v, &mut RequestCtx::new())).is_err());
    }
    assert!(e.used_memory() < 8 << 20, "{}", e.used_memory());
}

#[test]
fn memory_limit_garbage_of_a_failed_hook_is_collected_at_once() {
    // Strings this time, 8 MiB: the failed hook leaves ~7 MiB of garbage,
    // below the 90% threshold; LuaJIT does no emergency GC on a failed
    // allocation, so without a collection after the failure the next hook
    // would fail too.
    let greedy = "local t = {} for i = 1, 1e7 do t[i] = string.rep('x', 64) .. i end pier.say(#t)";
    let s = LuaSetup {
        routes: vec![
            RouteHooks {
                content: src("greedy", greedy),
                ..Default::default()
            },
            RouteHooks {
                content: src("modest", "pier.say('fine')"),
                ..Default::default()
            },
        ],
        memory_limit: 8 << 20,
        ..Default::default()
    };
    let e = LuaEngine::new(Arc::new(s), registry(&[])).unwrap();
    run(async {
        for _ in 0..2 {
            let err = e
                .content(0, &mut TestView::default(), &mut RequestCtx::new())
                .await
                .unwrap_err();
            assert!(err.message.contains("not enough memory"), "{}", err.message);
            let flow = e
                .content(1, &mut TestView::default(), &mut RequestCtx::new())
                .await
                .unwrap();
            assert!(matches!(flow, pier_lua::Flow::Respond { status: 200, .. }));
        }
    });
    assert!(e.used_memory() < 2 << 20, "{}", e.used_memory());
}

/// Resident set of this process, in bytes (`/proc/self/statm`).
fn rss() -> usize {
    let statm = std::fs::read_to_string("/proc/self/statm").unwrap();
    let pages: usize = statm.split_whitespace().nth(1).unwrap().parse().unwrap();
    pages * 4096
}

#[test]
fn dropped_engines_give_their_lua_heap_back() {
    // The state runs on LuaJIT's own allocator, in its own mappings; closing
    // it must destroy that arena (an engine is dropped on every reload).
    // Each engine below holds ~4 MiB of Lua data: 60 leaked would be 240 MiB.
    let make = || {
        let mut s = setup(RouteHooks::default());
        s.init = src(
            "init",
            "HOLD = {} for i = 1, 1e5 do HOLD[i] = string.rep('x', 24) .. i end",
        );
        let e = LuaEngine::new(Arc::new(s), registry(&[])).unwrap();
        assert!(e.used_memory() > 4 << 20, "{}", e.used_memory());
        e
    };
    for _ in 0..5 {
        drop(make());
    }
    let before = rss();
    for _ in 0..60 {
        drop(make());
    }
    let grown = rss().saturating_sub(before);
    assert!(
        grown < 48 << 20,
        "RSS grew by {grown} bytes over 60 engines"
    );
}
