//! pier.shared.NAME over pier-shdict: every operation, and concurrent
//! increments from two threads, each with its own engine.

mod support;

use std::sync::Arc;

use pier_lua::{LuaEngine, RequestCtx, RouteHooks};
use support::*;

#[test]
fn dict_operations() {
    let reg = registry(&[("cache", 1 << 20), ("small", 8192)]);
    let s = setup(RouteHooks {
        access: src(
            "route t access",
            r#"
            local d = pier.shared.cache
            assert(pier.shared.nope == nil)
            assert(d:get("k") == nil)
            assert(d:set("k", "v"))
            assert(d:get("k") == "v")
            assert(d:set("n", 1.5, 0, 7))
            local v, flags = d:get("n")
            assert(v == 1.5 and flags == 7)
            assert(d:set("b", false))
            assert(d:get("b") == false)
            assert(d:set(12, "numeric key"))
            assert(d:get(12) == "numeric key")
            -- add / replace
            local ok, err = d:add("k", "x")
            assert(not ok and err == "exists", err)
            assert(d:add("k2", "x"))
            ok, err = d:replace("nokey", 1)
            assert(not ok and err == "not found")
            assert(d:replace("k2", "y") and d:get("k2") == "y")
            assert(d:safe_set("s", "1") and d:safe_add("s2", "2"))
            -- incr
            local n, e = d:incr("cnt", 1)
            assert(n == nil and e == "not found")
            assert(d:incr("cnt", 1, 10) == 11)
            assert(d:incr("cnt", -5) == 6)
            n, e = d:incr("k", 1)
            assert(n == nil and e == "not a number", e)
            -- ttl / expire (the request clock is fixed: TTLs are exact)
            assert(d:set("t", "x", 2.5))
            assert(d:ttl("t") == 2.5, d:ttl("t"))
            assert(d:ttl("k") == 0)
            assert(d:expire("k", 10) and d:ttl("k") == 10)
            ok, err = d:ttl("missing")
            assert(ok == nil and err == "not found")
            assert(d:incr("tt", 1, 0, 30) == 1 and d:ttl("tt") == 30)
            -- delete, nil set
            assert(d:delete("k2") and d:get("k2") == nil)
            assert(d:set("s", nil) and d:get("s") == nil)
            -- keys
            local keys = d:get_keys(0)
            local seen = {}
            for _, k in ipairs(keys) do seen[k] = true end
            assert(seen.k and seen.n and seen.cnt and not seen.k2, #keys)
            assert(#d:get_keys(2) == 2)
            -- capacity
            assert(d:capacity() == 1048576)
            assert(d:free_space() < d:capacity())
            -- bad values
            ok, err = d:set("f", function() end)
            assert(ok == nil and err == "bad value type")
            ok, err = d:set("", "x")
            assert(not ok, "empty key accepted")
            -- no memory: a value larger than the whole small dict
            local ok2, err2 = pier.shared.small:set("big", string.rep("x", 100000))
            assert(not ok2 and err2 == "no memory", err2)
            -- get_stale / flush_all
            d:flush_all()
            assert(d:get("n") == nil)
            local sv, sf, stale = d:get_stale("n")
            assert(sv == 1.5 and stale == true)
            assert(d:flush_expired(0) > 0)
            "#,
        ),
        ..Default::default()
    });
    let e = LuaEngine::new(Arc::new(s), reg.clone()).unwrap();
    let mut v = TestView::default();
    let mut ctx = RequestCtx::new();
    run(e.access(0, &mut v, &mut ctx)).unwrap();
    assert!(reg.get("cache").unwrap().is_empty());
}

#[test]
fn values_written_by_rust_are_seen_by_lua_and_back() {
    let reg = registry(&[("cache", 1 << 20)]);
    reg.get("cache")
        .unwrap()
        .set(b"from_rust", pier_shdict::Value::Str(b"hello"), 0, 0, 0);
    let e = LuaEngine::new(
        Arc::new(setup(RouteHooks {
            access: src(
                "a",
                "pier.shared.cache:set('from_lua', pier.shared.cache:get('from_rust') .. '!')",
            ),
            ..Default::default()
        })),
        reg.clone(),
    )
    .unwrap();
    run(e.access(0, &mut TestView::default(), &mut RequestCtx::new())).unwrap();
    assert_eq!(dict_str(&reg, "from_lua"), "hello!");
}

#[test]
fn ttl_follows_the_request_clock() {
    let reg = registry(&[("cache", 1 << 20)]);
    let e = LuaEngine::new(
        Arc::new(setup(RouteHooks {
            access: src(
                "a",
                "local d = pier.shared.cache if pier.req.get_header('x-set') then d:set('k', 'v', 1) else pier.ctx.got = d:get('k') pier.resp.set_header('x-got', tostring(d:get('k'))) end",
            ),
            ..Default::default()
        })),
        reg,
    )
    .unwrap();
    let mut v = TestView::default();
    v.headers.push((b"X-Set".to_vec(), b"1".to_vec()));
    run(e.access(0, &mut v, &mut RequestCtx::new())).unwrap();
    for (dt_ms, want) in [(999u64, "v"), (1000, "nil")] {
        let mut v = TestView {
            now_ns: TestView::default().now_ns + dt_ms * 1_000_000,
            ..Default::default()
        };
        run(e.access(0, &mut v, &mut RequestCtx::new())).unwrap();
        assert_eq!(v.resp("x-got").as_deref(), Some(want), "after {dt_ms} ms");
    }
}

#[test]
fn concurrent_incr_from_two_engines_loses_nothing() {
    let reg = registry(&[("counters", 1 << 20)]);
    const REQUESTS: usize = 200;
    const PER_HOOK: usize = 500;
    let threads: Vec<_> = (0..2)
        .map(|_| {
            let reg = reg.clone();
            std::thread::spawn(move || {
                let s = setup(RouteHooks {
                    access: src(
                        "route t access",
                        &format!(
                            "local d = pier.shared.counters for i = 1, {PER_HOOK} do assert(d:incr('hits', 1, 0)) end"
                        ),
                    ),
                    ..Default::default()
                });
                let e = LuaEngine::new(Arc::new(s), reg).unwrap();
                run(async {
                    for _ in 0..REQUESTS {
                        let mut v = TestView::default();
                        e.access(0, &mut v, &mut RequestCtx::new()).await.unwrap();
                    }
                });
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    let mut out = Vec::new();
    let hit = reg
        .get("counters")
        .unwrap()
        .get(b"hits", 0, &mut out)
        .unwrap();
    assert_eq!(
        hit.value,
        pier_shdict::HitValue::Number((2 * REQUESTS * PER_HOOK) as f64)
    );
}

#[test]
fn registry_from_setup_keeps_dicts_across_reload() {
    let mut s = pier_lua::LuaSetup {
        shared_dicts: vec![("a".into(), 1 << 16), ("b".into(), 1 << 16)],
        ..Default::default()
    };
    let reg = s.build_registry(None).unwrap();
    reg.get("a")
        .unwrap()
        .set(b"k", pier_shdict::Value::Number(1.0), 0, 0, 0);
    reg.get("b")
        .unwrap()
        .set(b"k", pier_shdict::Value::Number(2.0), 0, 0, 0);
    s.shared_dicts[1].1 = 1 << 17; // b resized: starts empty
    let reg2 = s.build_registry(Some(&reg)).unwrap();
    let mut out = Vec::new();
    assert!(reg2.get("a").unwrap().get(b"k", 0, &mut out).is_some());
    assert!(reg2.get("b").unwrap().get(b"k", 0, &mut out).is_none());
    s.shared_dicts.push(("a".into(), 10));
    assert!(s.build_registry(None).is_err());
    assert!(s.validate().is_err());
}

#[test]
fn large_string_values_grow_the_copy_buffer() {
    let e = engine(setup(RouteHooks {
        access: src(
            "a",
            r#"
            local d = pier.shared.cache
            local big = string.rep("v", 20000)
            assert(d:set("big", big))
            assert(d:get("big") == big)
            assert(d:set("small", "s"))
            assert(d:get("small") == "s")
            d:flush_all()
            local v, _, stale = d:get_stale("big")
            assert(v == big and stale)
            assert(#pier.req.get_uri() > 0 and pier.req.get_method() == "GET" and pier.req.get_path() == "/api/items")
            "#,
        ),
        ..Default::default()
    }));
    run(e.access(0, &mut TestView::default(), &mut RequestCtx::new())).unwrap();
    let mut v = TestView {
        uri: format!("/{}", "p".repeat(9000)).into_bytes(),
        ..Default::default()
    };
    let e = access_engine("assert(#pier.req.get_uri() == 9001 and #pier.req.get_path() == 9001)");
    run(e.access(0, &mut v, &mut RequestCtx::new())).unwrap();
}

/// `pier.limit` over pier-limits: counts never undercount, keys are
/// independent, the rate estimate follows the counts, and the calls
/// JIT-compile inside a hot loop.
#[test]
fn limit_counters_from_lua() {
    let reg = registry(&[]);
    let s = setup(RouteHooks {
        access: src(
            "route t access",
            r#"
            local key = "client-" .. tostring(math.random(1, 1e9))
            local last
            for i = 1, 200 do last = pier.limit.incr(key) end
            assert(last >= 200, last)
            assert(pier.limit.incr(key, 10) >= 210)
            local other = key .. "-other"
            assert(pier.limit.incr(other) >= 1)
            assert(pier.limit.rate(key) > 0)
            assert(pier.limit.rate("never-seen-" .. key) >= 0)
            "#,
        ),
        ..Default::default()
    });
    let e = LuaEngine::new(Arc::new(s), reg).unwrap();
    let mut v = TestView::default();
    let mut ctx = RequestCtx::new();
    run(e.access(0, &mut v, &mut ctx)).unwrap();
}
