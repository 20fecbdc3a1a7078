//! The point of the FFI API: hot loops over pier.* calls must be compiled by
//! LuaJIT. Each hook runs a 10k-iteration loop under `jit.attach` trace
//! events; we require at least one trace to complete ("stop") and no trace
//! abort located in, or naming, our wrappers (`@pier/*.lua`) other than the
//! trace-shape ones (see HARNESS).
#![allow(unsafe_code)] // `LuaEngine::lua`, whose handle must not outlive the engine; nothing else

mod support;

use std::sync::Arc;

use mlua::Table;
use pier_lua::{LuaEngine, RequestCtx, RouteHooks};
use support::*;

const HARNESS: &str = r#"
local jutil = require("jit.util")
local ok_vmdef, vmdef = pcall(require, "jit.vmdef")
local res = { stops = 0, aborts = {}, api_aborts = 0 }
local function where(func, pc)
  local fi = jutil.funcinfo(func, pc)
  return (fi.source or "?") .. ":" .. tostring(fi.currentline or fi.linedefined or "?")
end
local function on_trace(what, tr, func, pc, otr, oex)
  if what == "stop" then
    res.stops = res.stops + 1
  elseif what == "abort" then
    -- lj_traceerr.h order; the vendored build has no jit.vmdef.
    local names = { [0] = "error during recording", "trace too short", "trace too long",
      "trace too deep", "too many snapshots", "blacklisted", "retry recording",
      "NYI: bytecode", "leaving loop in root trace", "inner loop in root trace",
      "loop unroll limit reached", "bad argument type", "JIT compilation disabled for function",
      "call unroll limit reached", "down-recursion, restarting", "NYI: unsupported variant of FastFunc",
      "NYI: return to lower frame" }
    local reason = (names[otr] or "code") .. " (" .. tostring(otr) .. ")"
    if ok_vmdef and vmdef.traceerr[otr] then
      reason = vmdef.traceerr[otr]
      if oex then reason = reason:gsub("%%d", tostring(oex)):gsub("%%s", tostring(oex)) end
    end
    if type(oex) == "function" then reason = reason .. " " .. where(oex, 0) end
    local at = where(func, pc)
    res.aborts[#res.aborts + 1] = at .. ": " .. reason
    -- Trace-shape aborts (where a root trace happened to start and end, which
    -- varies with LuaJIT's hashed hot counters) are not caused by what the
    -- API does: leaving/inner loop (8, 9), unroll limit (10), down-recursion
    -- (14), return to lower frame (16). Everything else located in or naming
    -- our wrappers counts: NYI bytecodes and fast functions, bad argument
    -- types, unsupported C conversions or calls, type instability...
    local shape = otr == 8 or otr == 9 or otr == 10 or otr == 14 or otr == 16
    if not shape and (at:find("pier/", 1, true) or reason:find("pier/", 1, true)) then
      res.api_aborts = res.api_aborts + 1
    end
  end
end
jit.flush()
jit.attach(on_trace, "trace")
local ok, err = pcall(BODY)
jit.attach(on_trace)
assert(ok, err)
JIT_RESULT = res
"#;

fn check_compiles(name: &str, body: &str) {
    let code = format!("BODY = function()\n{body}\nend\n{HARNESS}");
    let reg = registry(&[("cache", 1 << 20)]);
    let e = LuaEngine::new(
        Arc::new(setup(RouteHooks {
            access: src(&format!("route jit {name}"), &code),
            ..Default::default()
        })),
        reg,
    )
    .unwrap();
    let mut v = TestView::default();
    run(e.access(0, &mut v, &mut RequestCtx::new())).unwrap();
    // SAFETY: used while `e` lives, not kept.
    let res: Table = unsafe { e.lua() }.globals().get("JIT_RESULT").unwrap();
    let stops: i64 = res.get("stops").unwrap();
    let api_aborts: i64 = res.get("api_aborts").unwrap();
    let aborts: Vec<String> = res
        .get::<Table>("aborts")
        .unwrap()
        .sequence_values()
        .map(Result::unwrap)
        .collect();
    eprintln!("{name}: {stops} traces, aborts: {aborts:?}");
    assert!(stops >= 1, "{name}: no trace compiled; aborts: {aborts:?}");
    assert_eq!(
        api_aborts, 0,
        "{name}: trace aborts in the pier API: {aborts:?}"
    );
}

#[test]
fn jit_header_get_set() {
    check_compiles(
        "headers",
        r#"
        local req, resp = pier.req, pier.resp
        local n = 0
        for i = 1, 10000 do
          local ua = req.get_header("user-agent")
          if ua then n = n + #ua end
          req.set_header("x-ua", ua)
          resp.set_header("x-lua", "1")
          if resp.get_header("x-lua") ~= "1" then error("lost header") end
        end
        assert(n == 80000)
        "#,
    );
}

#[test]
fn jit_uri_method_var_now() {
    check_compiles(
        "request",
        r#"
        local req, var = pier.req, pier.var
        local total = 0
        for i = 1, 10000 do
          total = total + #req.get_method() + #req.get_uri() + #req.get_path() + #var.host
          total = total + pier.now() - pier.now()
        end
        assert(total > 0)
        "#,
    );
}

#[test]
fn jit_ctx() {
    check_compiles(
        "ctx",
        r#"
        for i = 1, 10000 do
          local ctx = pier.ctx
          ctx.n = (ctx.n or 0) + 1
        end
        assert(pier.ctx.n == 10000)
        "#,
    );
}

#[test]
fn jit_shared_dict() {
    check_compiles(
        "shdict",
        r#"
        local d = pier.shared.cache
        d:set("s", "value")
        local last
        for i = 1, 10000 do
          last = d:incr("hits", 1, 0)
          local v = d:get("s")
          if v ~= "value" then error("bad get") end
        end
        assert(last == 10000)
        "#,
    );
}

#[test]
fn jit_limit_counters() {
    check_compiles(
        "limit",
        r#"
        local last
        for i = 1, 10000 do
          last = pier.limit.incr("jit-client")
        end
        assert(last >= 10000)
        "#,
    );
}

/// A hook without a loop, run once per request: the pooled runner coroutine
/// (`lua/pier/runner.lua`) gives the JIT a loop spanning requests, so the
/// hook and the API calls compile across requests too.
#[test]
fn jit_one_shot_hook_across_requests() {
    let e = access_engine(
        "local ua = pier.req.get_header('user-agent') if ua == nil then pier.exit(403) end pier.resp.set_header('x-lua', '1') pier.ctx.n = 1",
    );
    // SAFETY: used while `e` lives, not kept.
    unsafe { e.lua() }
        .load(
            r#"
            EV = { stops = 0, aborts = {} }
            jit.attach(function(what, tr, func, pc, otr, oex)
              if what == "stop" then EV.stops = EV.stops + 1 end
              if what == "abort" then
                local fi = require("jit.util").funcinfo(func, pc)
                EV.aborts[#EV.aborts + 1] = tostring(fi.source) .. ":" .. tostring(fi.currentline) .. " code " .. tostring(otr)
              end
            end, "trace")
            "#,
        )
        .exec()
        .unwrap();
    run(async {
        for _ in 0..500 {
            let mut v = TestView::default();
            e.access(0, &mut v, &mut RequestCtx::new()).await.unwrap();
            assert_eq!(v.resp("x-lua").as_deref(), Some("1"));
        }
    });
    // SAFETY: used while `e` lives, not kept.
    let ev: Table = unsafe { e.lua() }.globals().get("EV").unwrap();
    let stops: i64 = ev.get("stops").unwrap();
    let aborts: Vec<String> = ev
        .get::<Table>("aborts")
        .unwrap()
        .sequence_values()
        .map(Result::unwrap)
        .collect();
    eprintln!("one-shot: {stops} traces, aborts: {aborts:?}");
    assert!(stops >= 1, "no trace compiled across requests: {aborts:?}");
    // Same rule as HARNESS: trace-shape aborts (codes 8, 9, 10, 14, 16) are not the API's.
    let api = |a: &&String| {
        a.contains("pier/")
            && ![" code 8", " code 9", " code 10", " code 14", " code 16"]
                .iter()
                .any(|c| a.ends_with(c))
    };
    assert!(!aborts.iter().any(|a| api(&a)), "{aborts:?}");
}
