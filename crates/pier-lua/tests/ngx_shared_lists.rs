//! `pier.shared.DICT` lists (`lpush` / `rpush` / `lpop` / `rpop` / `llen`)
//! and the return values of the whole dict API, checked against
//! lua-resty-core's `resty/core/shdict.lua` and ngx_lua's list functions.

mod support;

use pier_lua::{LuaEngine, RequestCtx, RouteHooks};
use support::*;

/// Runs `code` as an access hook on a fresh engine with dicts `cache`
/// (1 MiB) and `tiny` (4 KiB, one shard), failing the test on a Lua error.
fn run_access(code: &str) {
    let reg = registry(&[("cache", 1 << 20), ("tiny", 4096)]);
    let s = setup(RouteHooks {
        access: src("route t access", code),
        ..Default::default()
    });
    let e = LuaEngine::new(std::sync::Arc::new(s), reg).unwrap();
    let mut view = TestView::default();
    let mut ctx = RequestCtx::new();
    run(async {
        e.access(0, &mut view, &mut ctx)
            .await
            .unwrap_or_else(|err| panic!("{err}"));
    });
}

#[test]
fn lists_push_pop_len() {
    run_access(
        r##"
        local d = require("pier.shared").cache
        assert(d == pier.shared.cache)
        assert(d:lpush("l", "b") == 1)
        assert(d:lpush("l", "a") == 2)
        assert(d:rpush("l", 3.5) == 3)
        assert(d:rpush("l", "") == 4)
        assert(d:llen("l") == 4)
        assert(d:lpop("l") == "a")
        assert(d:rpop("l") == "")
        local n = d:rpop("l")
        assert(n == 3.5 and type(n) == "number", tostring(n))
        assert(d:lpop("l") == "b")
        -- the last pop deleted the key
        assert(d:llen("l") == 0)
        local v, err = d:lpop("l")
        assert(v == nil and err == nil)
        assert(select("#", d:rpop("missing")) == 1)
        -- a long string round-trips (bigger than any reused buffer)
        local big = string.rep("x", 100000) .. "end"
        assert(d:rpush("big", big) == 1)
        assert(d:lpop("big") == big)
        -- numeric keys go through tostring, as in ngx_lua
        assert(d:rpush(7, "seven") == 1 and d:lpop("7") == "seven")
    "##,
    );
}

#[test]
fn lists_errors_match_ngx_lua() {
    run_access(
        r##"
        local d = pier.shared.cache
        assert(d:set("scalar", "v"))
        local r, err = d:lpush("scalar", "x")
        assert(r == nil and err == "value not a list", err)
        r, err = d:rpush("scalar", 1)
        assert(r == nil and err == "value not a list", err)
        r, err = d:lpop("scalar")
        assert(r == nil and err == "value not a list", err)
        r, err = d:rpop("scalar")
        assert(r == nil and err == "value not a list", err)
        r, err = d:llen("scalar")
        assert(r == nil and err == "value not a list", err)
        assert(d:get("scalar") == "v")

        assert(d:rpush("list", "x") == 1)
        r, err = d:get("list")
        assert(r == nil and err == "value is a list", err)
        r, err = d:get_stale("list")
        assert(r == nil and err == "value is a list", err)
        r, err = d:incr("list", 1)
        assert(r == nil and err == "not a number", err)
        r, err = d:add("list", 1)
        assert(r == false and err == "exists", err)

        -- bad values and keys
        r, err = d:rpush("list", true)
        assert(r == nil and err == "bad value type", err)
        r, err = d:lpush("list", {})
        assert(r == nil and err == "bad value type", err)
        r, err = d:lpush(nil, "x")
        assert(r == nil and err == "nil key", err)
        r, err = d:rpush("", "x")
        assert(r == nil and err == "empty key", err)
        r, err = d:lpop(string.rep("k", 65536))
        assert(r == nil and err == "key too long", err)
        r, err = d:llen("")
        assert(r == nil and err == "empty key", err)

        -- argument counts are checked, as ngx_lua's C functions do
        local ok, e = pcall(d.lpush, d, "list")
        assert(not ok and e:find("expecting 3 arguments, but only seen 2", 1, true), e)
        ok, e = pcall(d.rpop, d)
        assert(not ok and e:find("expecting 2 arguments, but only seen 1", 1, true), e)
        ok, e = pcall(d.llen, d, "a", "b")
        assert(not ok and e:find("expecting 2 arguments, but only seen 3", 1, true), e)
        -- a bad self is a bad zone
        ok, e = pcall(d.lpush, "list", "x", "y")
        assert(not ok and e:find('bad "zone" argument', 1, true), e)

        -- set and replace overwrite a list
        assert(d:set("list", 5))
        assert(d:get("list") == 5)
        assert(d:rpush("l2", "a"))
        assert(d:replace("l2", "s") and d:get("l2") == "s")
    "##,
    );
}

#[test]
fn lists_use_dict_memory() {
    run_access(
        r##"
        local d = pier.shared.tiny
        local free = d:free_space()
        assert(d:rpush("q", "x") == 1)
        assert(d:free_space() < free)
        local n, r, err = 1
        repeat
            r, err = d:rpush("q", "0123456789")
            if r then n = r end
        until not r
        assert(err == "no memory", err)
        assert(d:llen("q") == n and n > 10, n)
        -- pops give the memory back
        while d:lpop("q") do end
        assert(d:free_space() == free, d:free_space() .. " vs " .. free)
        -- a value bigger than the dict
        r, err = d:lpush("big", string.rep("x", 8192))
        assert(r == nil and err == "no memory", err)
        assert(d:llen("big") == 0)
    "##,
    );
}

#[test]
fn lists_expire_ttl_delete_flush_like_other_keys() {
    run_access(
        r##"
        local d = pier.shared.cache
        assert(d:rpush("l", "a") == 1)
        assert(d:ttl("l") == 0)            -- no TTL
        assert(d:expire("l", 5))
        assert(d:ttl("l") == 5)
        local keys = d:get_keys()
        assert(#keys == 1 and keys[1] == "l")
        assert(d:delete("l"))
        assert(d:llen("l") == 0)
        local r, err = d:ttl("l")
        assert(r == nil and err == "not found")

        assert(d:rpush("l", "a") == 1 and d:rpush("m", 1) == 1)
        d:flush_all()
        assert(d:llen("l") == 0 and d:lpop("m") == nil)
        assert(#d:get_keys(0) == 0)
        assert(d:flush_expired() >= 0)
        assert(d:lpush("l", "fresh") == 1, "an expired list starts over")
        assert(d:ttl("l") == 0)
    "##,
    );
}

#[test]
fn lists_expire_on_the_request_clock() {
    // Two requests 10 s apart on the view's clock: a list with a 5 s TTL is
    // gone for the second.
    let reg = registry(&[("cache", 1 << 20)]);
    let s = setup(RouteHooks {
        access: src(
            "route t access",
            r##"
            local d = pier.shared.cache
            if pier.req.get_header("x-step") == "1" then
                assert(d:rpush("l", "a") == 1)
                assert(d:expire("l", 5))
                assert(d:llen("l") == 1)
            else
                assert(d:llen("l") == 0)
                assert(d:lpop("l") == nil)
                assert(d:get_stale("l") == nil or true)
            end
            "##,
        ),
        ..Default::default()
    });
    let e = LuaEngine::new(std::sync::Arc::new(s), reg).unwrap();
    for (step, now) in [
        ("1", 1_700_000_000_000_000_000u64),
        ("2", 1_700_000_010_000_000_000),
    ] {
        let mut view = TestView {
            now_ns: now,
            ..TestView::default()
        };
        view.headers
            .push((b"x-step".to_vec(), step.as_bytes().to_vec()));
        let mut ctx = RequestCtx::new();
        run(async {
            e.access(0, &mut view, &mut ctx)
                .await
                .unwrap_or_else(|err| panic!("step {step}: {err}"));
        });
    }
}

#[test]
fn dict_api_return_values_match_lua_resty_core() {
    run_access(
        r##"
        local d = pier.shared.cache
        local function n(...) return select("#", ...), ... end

        -- key checks: nil key, empty key, key too long (returned, not raised)
        local long = string.rep("k", 65536)
        for _, f in ipairs({ "get", "get_stale", "ttl", "delete" }) do
            local c, a, b = n(d[f](d, nil))
            assert(a == nil and b == "nil key", f)
            c, a, b = n(d[f](d, ""))
            assert(a == nil and b == "empty key", f)
            c, a, b = n(d[f](d, long))
            assert(a == nil and b == "key too long", f)
        end
        for _, f in ipairs({ "set", "safe_set", "add", "safe_add", "replace" }) do
            local c, a, b = n(d[f](d, nil, 1))
            assert(a == nil and b == "nil key", f)
            c, a, b = n(d[f](d, "", 1))
            assert(a == nil and b == "empty key", f)
            c, a, b = n(d[f](d, long, 1))
            assert(a == nil and b == "key too long", f)
            c, a, b = n(d[f](d, "k", {}))
            assert(a == nil and b == "bad value type", f)
        end
        local c, a, b = n(d:incr(nil, 1))
        assert(a == nil and b == "nil key")
        c, a, b = n(d:incr("", 1))
        assert(a == nil and b == "empty key")
        c, a, b = n(d:expire("", 1))
        assert(a == nil and b == "empty key")

        -- stores: true, nil, forcible / false, err, false
        local c1, ok, err, forcible = n(d:set("k", "v"))
        assert(c1 == 3 and ok == true and err == nil and forcible == false)
        c1, ok, err, forcible = n(d:add("k", "v"))
        assert(c1 == 3 and ok == false and err == "exists" and forcible == false)
        c1, ok, err, forcible = n(d:replace("nope", "v"))
        assert(c1 == 3 and ok == false and err == "not found" and forcible == false)
        -- delete is set(key, nil)
        c1, ok, err, forcible = n(d:delete("k"))
        assert(c1 == 3 and ok == true and err == nil and forcible == false)
        -- exptime checks
        local pok, e = pcall(d.set, d, "k", "v", -1)
        assert(not pok and e:find('bad "exptime" argument', 1, true), e)
        pok, e = pcall(d.expire, d, "k")
        assert(not pok and e:find('bad "exptime" argument', 1, true), e)

        -- get: value, flags only when non-zero
        assert(d:set("f", "v", 0, 3))
        c1, a, b = n(d:get("f"))
        assert(c1 == 2 and a == "v" and b == 3)
        assert(d:set("g", "v"))
        c1 = n(d:get("g"))
        assert(c1 == 1)
        c1 = n(d:get("missing"))
        assert(c1 == 1)
        -- get_stale: value, flags, stale
        c1, a, b, c = n(d:get_stale("g"))
        assert(c1 == 3 and a == "v" and b == nil and c == false)

        -- incr: one value without init, three with it
        assert(d:set("cnt", 1))
        c1, a = n(d:incr("cnt", 2))
        assert(c1 == 1 and a == 3)
        c1, a, b, c = n(d:incr("new", 2, 10))
        assert(c1 == 3 and a == 12 and b == nil and c == false)
        c1, a, b = n(d:incr("nope", 1))
        assert(c1 == 2 and a == nil and b == "not found")
        pok, e = pcall(d.incr, d, "x", 1, nil, 10)
        assert(not pok and e:find('must provide "init" when providing "init_ttl"', 1, true), e)
        pok, e = pcall(d.incr, d, "x", 1, 0, -1)
        assert(not pok and e:find('bad "init_ttl" argument', 1, true), e)
        pok, e = pcall(d.incr, d, "x", 1, "zz")
        assert(not pok and e:find("bad init arg: number expected, got string", 1, true), e)
        pok, e = pcall(d.incr, d, "x", 1, 0, "zz")
        assert(not pok and e:find("bad init_ttl arg: number expected, got string", 1, true), e)
        assert(d:incr("ttl", 1, 0, 30) == 1 and d:ttl("ttl") == 30)

        -- ttl / expire
        c1, a, b = n(d:ttl("missing"))
        assert(c1 == 2 and a == nil and b == "not found")
        c1, a, b = n(d:expire("missing", 1))
        assert(c1 == 2 and a == nil and b == "not found")
        c1, a = n(d:expire("g", 1))
        assert(c1 == 1 and a == true)

        -- the rest
        assert(n(d:flush_all()) == 0)
        assert(type(d:flush_expired()) == "number")
        assert(type(d:get_keys()) == "table")
        assert(d:capacity() == 1048576)
        assert(type(d:free_space()) == "number")
        pok, e = pcall(d.get, nil, "k")
        assert(not pok and e:find('bad "zone" argument', 1, true), e)
    "##,
    );
}
