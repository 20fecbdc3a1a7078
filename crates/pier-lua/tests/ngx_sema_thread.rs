//! `ngx.semaphore` (`require "ngx.semaphore"`), light threads
//! (`require "pier.ngx_thread"`: spawn / wait / kill) and the timer
//! pending / running counts, with several requests in flight on one engine.

mod support;

use std::rc::Rc;
use std::sync::Arc;
use std::time::Duration;

use pier_lua::{Flow, LuaEngine, LuaError, LuaSetup, RequestCtx, RouteHooks};
use pier_shdict::Registry;
use support::*;

/// Route 0's access hook dispatches on `x-op`; `S` is a per-state semaphore
/// created in `init`; waits log `id:ok:err` to list `log` of dict `cache`.
const SEMA_HOOK: &str = r#"
    local op = pier.req.get_header("x-op")
    local d = pier.shared.cache
    if op == "wait" then
        local id = pier.req.get_header("x-id")
        local ok, err = S:wait(tonumber(pier.req.get_header("x-timeout") or "5"))
        d:rpush("log", id .. ":" .. tostring(ok) .. ":" .. tostring(err))
    elseif op == "post" then
        assert(S:post(tonumber(pier.req.get_header("x-n") or "1")) == true)
    elseif op == "count" then
        d:set("count", S:count())
    end
"#;

fn sema_engine(reg: &Arc<Registry>) -> Rc<LuaEngine> {
    let mut s = setup(RouteHooks {
        access: src("route t access", SEMA_HOOK),
        ..Default::default()
    });
    s.init = src("init", "S = require('ngx.semaphore').new(0)");
    Rc::new(LuaEngine::new(Arc::new(s), reg.clone()).unwrap())
}

/// Runs one access request with headers `h`.
async fn req(e: Rc<LuaEngine>, h: &[(&str, &str)]) -> Result<Flow, LuaError> {
    let mut view = TestView::default();
    for (k, v) in h {
        view.headers
            .push((k.as_bytes().to_vec(), v.as_bytes().to_vec()));
    }
    let mut ctx = RequestCtx::new();
    e.access(0, &mut view, &mut ctx).await
}

fn log(reg: &Registry) -> Vec<String> {
    let d = reg.get("cache").unwrap();
    let mut out = Vec::new();
    while let Ok(Some(pier_shdict::ListItem::Str(s))) = d.lpop(b"log", 0) {
        out.push(String::from_utf8(s.into_vec()).unwrap());
    }
    out
}

fn num(reg: &Registry, key: &str) -> Option<f64> {
    let mut out = Vec::new();
    match reg.get("cache")?.get(key.as_bytes(), 0, &mut out)?.value {
        pier_shdict::HitValue::Number(n) => Some(n),
        _ => None,
    }
}

async fn count(e: &Rc<LuaEngine>, reg: &Registry) -> f64 {
    req(e.clone(), &[("x-op", "count")]).await.unwrap();
    num(reg, "count").unwrap()
}

/// Lets the other tasks run until `count()` is `want` (bounded).
async fn until_count(e: &Rc<LuaEngine>, reg: &Registry, want: f64) {
    for _ in 0..2000 {
        if count(e, reg).await == want {
            return;
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    panic!("semaphore count never reached {want}");
}

/// Lets the other tasks run until list `log` has `n` entries (bounded).
async fn until_logged(reg: &Registry, n: usize) {
    let d = reg.get("cache").unwrap();
    for _ in 0..2000 {
        if d.llen(b"log", 0).unwrap() >= n {
            return;
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    panic!("log never reached {n} entries");
}

fn spawn_wait(e: &Rc<LuaEngine>, id: &str, timeout: &str) -> tokio::task::JoinHandle<()> {
    let (e, id, timeout) = (e.clone(), id.to_owned(), timeout.to_owned());
    tokio::task::spawn_local(async move {
        req(
            e,
            &[("x-op", "wait"), ("x-id", &id), ("x-timeout", &timeout)],
        )
        .await
        .unwrap();
    })
}

#[test]
fn waiters_are_served_in_order_by_posts_from_other_requests() {
    let reg = registry(&[("cache", 1 << 20)]);
    let e = sema_engine(&reg);
    run(async {
        let mut tasks = Vec::new();
        for (i, id) in ["a", "b", "c"].into_iter().enumerate() {
            tasks.push(spawn_wait(&e, id, "5"));
            // Queued one after the other: the queue order is known.
            until_count(&e, &reg, -(i as f64 + 1.0)).await;
        }
        req(e.clone(), &[("x-op", "post")]).await.unwrap();
        until_logged(&reg, 1).await;
        assert_eq!(log(&reg), ["a:true:nil"]);
        assert_eq!(count(&e, &reg).await, -2.0);
        req(e.clone(), &[("x-op", "post"), ("x-n", "3")])
            .await
            .unwrap();
        for t in tasks {
            t.await.unwrap();
        }
        assert_eq!(log(&reg), ["b:true:nil", "c:true:nil"]);
        // The third resource of that post was not taken.
        assert_eq!(count(&e, &reg).await, 1.0);
        // A wait with a free resource and nobody queued does not yield.
        req(e.clone(), &[("x-op", "wait"), ("x-id", "d")])
            .await
            .unwrap();
        assert_eq!(log(&reg), ["d:true:nil"]);
        assert_eq!(count(&e, &reg).await, 0.0);
    });
}

#[test]
fn a_waiter_times_out_and_takes_nothing() {
    let reg = registry(&[("cache", 1 << 20)]);
    let e = sema_engine(&reg);
    run(async {
        // Timeout 0 with nothing free: nil, "timeout" at once.
        req(
            e.clone(),
            &[("x-op", "wait"), ("x-id", "now"), ("x-timeout", "0")],
        )
        .await
        .unwrap();
        assert_eq!(log(&reg), ["now:nil:timeout"]);
        // Long enough for `until_count` to see both waiting on a loaded machine.
        let slow = spawn_wait(&e, "slow", "1");
        let patient = spawn_wait(&e, "patient", "30");
        until_count(&e, &reg, -2.0).await;
        slow.await.unwrap();
        // ngx_lua's values after a wait that timed out: false, "timeout".
        assert_eq!(log(&reg), ["slow:false:timeout"]);
        assert_eq!(count(&e, &reg).await, -1.0);
        req(e.clone(), &[("x-op", "post")]).await.unwrap();
        patient.await.unwrap();
        assert_eq!(log(&reg), ["patient:true:nil"]);
        assert_eq!(count(&e, &reg).await, 0.0);
    });
}

#[test]
fn a_dropped_waiting_request_leaves_the_queue() {
    let reg = registry(&[("cache", 1 << 20)]);
    let e = sema_engine(&reg);
    run(async {
        let gone = spawn_wait(&e, "gone", "5");
        until_count(&e, &reg, -1.0).await;
        let next = spawn_wait(&e, "next", "5");
        until_count(&e, &reg, -2.0).await;
        // The client goes away: the request's future and ctx are dropped.
        gone.abort();
        assert!(gone.await.unwrap_err().is_cancelled());
        assert_eq!(count(&e, &reg).await, -1.0);
        // The post goes to the live waiter, not to the dropped one.
        req(e.clone(), &[("x-op", "post")]).await.unwrap();
        next.await.unwrap();
        assert_eq!(log(&reg), ["next:true:nil"]);
        assert_eq!(count(&e, &reg).await, 0.0);
    });
}

#[test]
fn a_post_granted_to_a_request_dropped_before_it_ran_is_passed_on() {
    let reg = registry(&[("cache", 1 << 20)]);
    let e = sema_engine(&reg);
    run(async {
        let first = spawn_wait(&e, "first", "5");
        until_count(&e, &reg, -1.0).await;
        let second = spawn_wait(&e, "second", "5");
        until_count(&e, &reg, -2.0).await;
        // The post grants `first` (its task is woken, has not run yet)...
        req(e.clone(), &[("x-op", "post")]).await.unwrap();
        // ... and it is dropped before it runs: the resource moves on.
        first.abort();
        assert!(first.await.unwrap_err().is_cancelled());
        second.await.unwrap();
        assert_eq!(log(&reg), ["second:true:nil"]);
        assert_eq!(count(&e, &reg).await, 0.0);
    });
}

fn access(code: &str) -> (LuaEngine, Arc<Registry>) {
    let reg = registry(&[("cache", 1 << 20)]);
    let s = setup(RouteHooks {
        access: src("route t access", code),
        ..Default::default()
    });
    (LuaEngine::new(Arc::new(s), reg.clone()).unwrap(), reg)
}

fn run_ok(e: &LuaEngine) -> Flow {
    run(e.access(0, &mut TestView::default(), &mut RequestCtx::new()))
        .unwrap_or_else(|err| panic!("{err}"))
}

#[test]
fn semaphore_api_values_and_errors() {
    let (e, _) = access(
        r#"
        local semaphore = require "ngx.semaphore"
        local s = semaphore.new()
        assert(s:count() == 0)
        local ok, err = s:wait(0)
        assert(ok == nil and err == "timeout", tostring(err))
        assert(s:post() == true and s:count() == 1)
        assert(s:wait(0) == true and s:count() == 0)
        s = semaphore.new(2)
        assert(s:count() == 2)
        assert(s:wait(1) == true and s:wait(1) == true)
        local pok, e = pcall(semaphore.new, -1)
        assert(not pok and e:find("no negative number", 1, true), e)
        pok, e = pcall(s.post, s, 0)
        assert(not pok and e:find("no negative number", 1, true), e)
        pok, e = pcall(s.wait, s, -1)
        assert(not pok and e:find("no negative number", 1, true), e)
        pok, e = pcall(s.wait, {}, 1)
        assert(not pok and e:find("not a semaphore instance", 1, true), e)
        pok, e = pcall(s.count, nil)
        assert(not pok and e:find("not a semaphore instance", 1, true), e)
        -- a semaphore made in a hook is usable from a timer (same thread)
        S2 = s
        "#,
    );
    run_ok(&e);

    // wait is refused where ngx_lua cannot yield, with ngx_lua's message.
    let reg = registry(&[("cache", 1 << 20)]);
    let mut s = setup(RouteHooks {
        log: src(
            "route t log",
            r#"
            local ok, err = S:wait(0)
            pier.shared.cache:set("log_err", err)
            pier.shared.cache:set("log_post", S:post())
            "#,
        ),
        ..Default::default()
    });
    s.init = src(
        "init",
        r#"
        S = require('ngx.semaphore').new(1)
        local ok, e = pcall(S.wait, S, 0)
        assert(not ok and e:find("no request found", 1, true), e)
        "#,
    );
    let e = LuaEngine::new(Arc::new(s), reg.clone()).unwrap();
    e.log(0, &mut TestView::default(), &mut RequestCtx::new());
    assert_eq!(
        dict_str(&reg, "log_err"),
        "API disabled in the context of log_by_lua*"
    );
}

#[test]
fn spawn_runs_at_once_and_wait_returns_results() {
    let (e, _) = access(
        r#"
        local th = require "pier.ngx_thread"
        local log = {}
        local t1 = th.spawn(function(a)
            log[#log + 1] = "c1 start " .. a
            -- far longer than c2's: the order below holds on a loaded machine
            pier.sleep(0.5)
            log[#log + 1] = "c1 end"
            return "r1", 1
        end, "x")
        assert(type(t1) == "thread")
        log[#log + 1] = "parent"
        local t2 = th.spawn(function()
            pier.sleep(0.01)
            log[#log + 1] = "c2 end"
            error("boom")
        end)
        local t3 = th.spawn(function() return "sync" end)
        local ok, a, b = th.wait(t1)
        assert(ok == true and a == "r1" and b == 1, tostring(a))
        -- t2 ended (with an error) while the parent waited for t1
        ok, a = th.wait(t2)
        assert(ok == false and a:find("boom", 1, true), tostring(a))
        ok, a = th.wait(t3)
        assert(ok == true and a == "sync")
        assert(table.concat(log, ",") == "c1 start x,parent,c2 end,c1 end", table.concat(log, ","))
        -- waited threads are dead
        ok, a = th.wait(t1)
        assert(ok == nil and a == "already waited or killed", tostring(a))
        -- argument checks
        local pok, e = pcall(th.wait, 42)
        assert(not pok and e:find("bad argument #1 to 'wait' (lua thread expected)", 1, true), e)
        pok, e = pcall(th.wait, coroutine.create(print))
        assert(not pok and e:find("not a user thread", 1, true), e)
        pok, e = pcall(th.spawn, 42)
        assert(not pok and e:find("Lua function expected", 1, true), e)
        "#,
    );
    run_ok(&e);
}

#[test]
fn children_run_while_the_parent_does_its_own_io() {
    let (e, _) = access(
        r#"
        local th = require "pier.ngx_thread"
        local done = {}
        local ts = {}
        for i = 1, 3 do
            ts[i] = th.spawn(function()
                pier.sleep(0.01 * i)
                done[#done + 1] = i
                return i
            end)
        end
        -- the parent's own yielding call: the children progress meanwhile
        -- (0.5 s against their 0.03 s at most: room for a loaded machine)
        pier.sleep(0.5)
        assert(#done == 3, #done)
        for i = 1, 3 do
            local ok, v = th.wait(ts[i])
            assert(ok and v == i)
        end
        -- wait for the first of several
        local slow = th.spawn(function() pier.sleep(30) return "slow" end)
        local fast = th.spawn(function() pier.sleep(0.01) return "fast" end)
        local ok, v = th.wait(slow, fast)
        assert(ok and v == "fast", tostring(v))
        assert(th.kill(slow) == 1)
        "#,
    );
    let t0 = std::time::Instant::now();
    run_ok(&e);
    // The slow thread (30 s) was killed, not waited for.
    assert!(t0.elapsed() < Duration::from_secs(10), "{:?}", t0.elapsed());
}

#[test]
fn kill_releases_a_semaphore_wait_and_reports_states() {
    let (e, _) = access(
        r#"
        local th = require "pier.ngx_thread"
        local sem = require("ngx.semaphore").new(0)
        local got = false
        local t = th.spawn(function() got = sem:wait(5) end)
        assert(sem:count() == -1)
        assert(th.kill(t) == 1)
        -- the killed thread left the queue: the post stays available
        assert(sem:count() == 0)
        sem:post()
        assert(sem:count() == 1)
        pier.sleep(0.01)
        assert(got == false and sem:count() == 1)
        local r, err = th.kill(t)
        assert(r == nil and err == "already waited or killed", tostring(err))
        local z = th.spawn(function() return 1 end)
        r, err = th.kill(z)
        assert(r == nil and err == "already terminated", tostring(err))
        r, err = th.kill(coroutine.create(print))
        assert(r == nil and err == "not user thread", tostring(err))
        -- threads waiting on one semaphore are woken in order
        local order = {}
        local ws = {}
        for i = 1, 3 do
            ws[i] = th.spawn(function() assert(sem:wait(5)) order[#order + 1] = i end)
        end
        -- one resource was left: the first waiter took it without queueing
        assert(sem:count() == -2, sem:count())
        sem:post(2)
        for i = 1, 3 do assert(th.wait(ws[i])) end
        assert(table.concat(order, ",") == "1,2,3", table.concat(order, ","))
        "#,
    );
    run_ok(&e);
}

#[test]
fn exit_from_a_thread_ends_the_request() {
    let (e, reg) = access(
        r#"
        local th = require "pier.ngx_thread"
        local t = th.spawn(function()
            pier.sleep(0.01)
            pier.exit(403)
        end)
        th.wait(t)
        pier.shared.cache:set("after", "ran")
        "#,
    );
    let flow = run_ok(&e);
    assert!(
        matches!(flow, Flow::Respond { status: 403, .. }),
        "{flow:?}"
    );
    let mut out = Vec::new();
    assert!(reg
        .get("cache")
        .unwrap()
        .get(b"after", 0, &mut out)
        .is_none());
}

#[test]
fn threads_of_concurrent_requests_stay_apart() {
    let (e, _) = access(
        r#"
        local th = require "pier.ngx_thread"
        local me = pier.req.get_uri()
        local ts = {}
        for i = 1, 4 do
            ts[i] = th.spawn(function()
                pier.sleep(0.005 * i)
                return me, pier.req.get_uri()
            end)
        end
        for i = 1, 4 do
            local ok, a, b = th.wait(ts[i])
            assert(ok and a == me and b == me, tostring(a) .. " " .. tostring(b))
        end
        "#,
    );
    let e = Rc::new(e);
    run(async {
        let mut tasks = Vec::new();
        for i in 0..4 {
            let e = e.clone();
            tasks.push(tokio::task::spawn_local(async move {
                let mut view = TestView {
                    uri: format!("/r{i}").into_bytes(),
                    ..TestView::default()
                };
                let mut ctx = RequestCtx::new();
                e.access(0, &mut view, &mut ctx)
                    .await
                    .unwrap_or_else(|err| panic!("{err}"));
            }));
        }
        for t in tasks {
            t.await.unwrap();
        }
    });
}

#[test]
fn timer_threads_finish_and_timer_counts() {
    let reg = registry(&[("cache", 1 << 20)]);
    let mut s: LuaSetup = setup(RouteHooks {
        access: src(
            "route t access",
            r#"
            local native = require "pier.native"
            assert(pier.timer.at(0.01, function()
                local d = pier.shared.cache
                d:set("in_timer_running", native.timer_running())
                d:set("in_timer_pending", native.timer_pending())
                local th = require "pier.ngx_thread"
                -- left running when the callback returns: the run waits for it
                th.spawn(function()
                    pier.sleep(0.02)
                    d:set("thread_done", 1)
                end)
            end))
            assert(pier.timer.at(5, function() end))
            local d = pier.shared.cache
            d:set("pending", native.timer_pending())
            d:set("running", native.timer_running())
            "#,
        ),
        ..Default::default()
    });
    s.init = None;
    let e = LuaEngine::new(Arc::new(s), reg.clone()).unwrap();
    run(async {
        e.access(0, &mut TestView::default(), &mut RequestCtx::new())
            .await
            .unwrap();
        assert_eq!(
            (num(&reg, "pending"), num(&reg, "running")),
            (Some(2.0), Some(0.0))
        );
        for _ in 0..2000 {
            if num(&reg, "thread_done").is_some() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        assert_eq!(num(&reg, "thread_done"), Some(1.0));
        assert_eq!(
            (num(&reg, "in_timer_running"), num(&reg, "in_timer_pending")),
            (Some(1.0), Some(1.0))
        );
    });
}
