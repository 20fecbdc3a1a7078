//! `pier.shared` dictionaries through a real Pier with two worker threads: concurrent
//! increments from every thread (none lost), the dictionary API end to end, timers
//! (`pier.timer.at` from `init_worker` and from a hook, `pier.timer.every`), and a
//! SIGHUP reload that swaps the Lua code while the dictionary keeps its contents.

mod common;

use std::time::Duration;

use common::*;

fn upstream(addrs: &[std::net::SocketAddr]) -> String {
    format!("[upstream.app]\nservers = {}\n\n", servers(addrs))
}

/// A content route at `/get` answering `pier.shared.DICT:get(<query arg k>)`.
fn getter(dict: &str) -> String {
    lua_route(
        "get",
        "/get",
        "",
        &hook(
            "content",
            &format!(
                "local v = pier.shared.{dict}:get(pier.req.get_uri_args().k)\npier.print(tostring(v))"
            ),
        ),
    )
}

fn get_key(p: &PierProcess, key: &str) -> String {
    let r = RawConn::connect(p.listener("main"))
        .get(&format!("/get?k={key}"))
        .unwrap_or_else(|e| panic!("GET /get?k={key}: {e}\n{}", p.logs()));
    assert_eq!(r.status, 200, "{}", r.body_str());
    r.body_str()
}

/// Polls `/get?k=key` until it answers `want` (5 s at most); returns the last answer.
fn wait_key(p: &PierProcess, key: &str, want: &str) -> String {
    let mut last = String::new();
    wait_until(Duration::from_secs(5), || {
        last = get_key(p, key);
        last == want
    });
    last
}

#[test]
fn concurrent_increments_from_both_workers_are_not_lost() {
    const THREADS: usize = 4;
    const PER_THREAD: usize = 250;
    let o = Origin::start();
    let count = r#"
local n, err = pier.shared.counters:incr("hits", 1, 0)
if not n then
  pier.exit(500, "incr failed: " .. tostring(err))
end
-- Which Lua state (worker thread) ran this hook, and its own count so far.
STATE_HITS = STATE_HITS + 1
pier.resp.set_header("x-state", STATE_ID .. " " .. STATE_HITS)
"#;
    // `init` runs once per state: number the states through the shared dict.
    let init = r#"
STATE_ID = pier.shared.counters:incr("states", 1, 0)
STATE_HITS = 0
"#;
    let cfg = base_config(
        &format!(
            "[lua]\n{}\n[lua.shared]\ncounters = \"1m\"\n",
            hook("init", init)
        ),
        &format!(
            "{}{}{}",
            lua_route("count", "/count/", "app", &hook("access", count)),
            getter("counters"),
            upstream(&[o.addr()])
        ),
    );
    let p = pier(&cfg);
    let addr = p.listener("main");
    let handles: Vec<_> = (0..THREADS)
        .map(|t| {
            std::thread::spawn(move || {
                let mut seen = Vec::new();
                // A few connections per thread so both workers get some of them.
                let mut conn = RawConn::connect(addr);
                for i in 0..PER_THREAD {
                    if i % 50 == 0 {
                        conn = RawConn::connect(addr);
                    }
                    let r = conn
                        .get(&format!("/count/hello?t={t}"))
                        .unwrap_or_else(|e| panic!("request {i} of thread {t}: {e}"));
                    assert_eq!(r.status, 200, "{}", r.body_str());
                    assert_eq!(r.body_str(), "hello world\n");
                    let (state, hits) = r
                        .header("x-state")
                        .and_then(|v| v.split_once(' '))
                        .map(|(s, h)| (s.to_string(), h.parse::<u64>().unwrap()))
                        .expect("x-state");
                    seen.push((state, hits));
                }
                seen
            })
        })
        .collect();
    let mut seen: Vec<(String, u64)> = Vec::new();
    for h in handles {
        seen.extend(h.join().expect("client thread"));
    }
    let n = THREADS * PER_THREAD;
    assert_eq!(get_key(&p, "hits"), n.to_string());
    assert_eq!(o.requests() as usize, n);
    // Both worker threads' states took part (20 connections over 2 workers), and each
    // state's private count ends at exactly the number of responses it gave.
    let mut states: std::collections::HashMap<String, (u64, u64)> = Default::default();
    for (state, hits) in &seen {
        let e = states.entry(state.clone()).or_default();
        e.0 += 1;
        e.1 = e.1.max(*hits);
    }
    assert_eq!(states.len(), 2, "states seen: {states:?}");
    for (state, (responses, max)) in &states {
        assert_eq!(responses, max, "state {state}");
    }
    assert_eq!(get_key(&p, "states"), "2");
}

#[test]
fn dictionary_api_end_to_end() {
    let code = r#"
local d = pier.shared.store
local op = pier.req.get_uri_args().op
if op == "fill" then
  assert(d:set("s", "text"))
  assert(d:set("n", 41))
  assert(d:set("b", true))
  assert(d:set("ttl", "soon", 0.2))
  local ok, err = d:add("s", "again")
  pier.say("add ", tostring(ok), " ", tostring(err))
  ok, err = d:replace("missing", 1)
  pier.say("replace ", tostring(ok), " ", tostring(err))
  pier.say("incr ", (d:incr("n", 1)))
  pier.say("cap ", d:capacity() > 0, " free ", d:free_space() <= d:capacity())
elseif op == "read" then
  local keys = d:get_keys(0)
  table.sort(keys)
  pier.say(table.concat(keys, ","))
  pier.say(tostring(d:get("s")), " ", tostring(d:get("n")), " ", tostring(d:get("b")), " ", tostring(d:get("ttl")))
elseif op == "delete" then
  d:delete("s")
  pier.say(tostring(d:get("s")))
elseif op == "flush" then
  d:flush_all()
  pier.say(#d:get_keys(0))
end
"#;
    let cfg = base_config(
        "[lua.shared]\nstore = \"1m\"\n",
        &lua_route("dict", "/dict", "", &hook("content", code)),
    );
    let p = pier(&cfg);
    let call = |op: &str| {
        let r = RawConn::connect(p.listener("main"))
            .get(&format!("/dict?op={op}"))
            .unwrap();
        assert_eq!(r.status, 200, "{op}: {}", r.body_str());
        r.body_str()
    };
    assert_eq!(
        call("fill"),
        "add false exists\nreplace false not found\nincr 42\ncap true free true\n"
    );
    // Seen by every worker (new connections may land on either thread).
    for _ in 0..4 {
        let r = call("read");
        let mut lines = r.lines();
        let keys = lines.next().unwrap();
        assert!(keys == "b,n,s,ttl" || keys == "b,n,s", "{r}");
        let vals = lines.next().unwrap();
        assert!(
            vals == "text 42 true soon" || vals == "text 42 true nil",
            "{r}"
        );
    }
    // The 0.2 s entry expires.
    let mut last = String::new();
    let ok = wait_until(Duration::from_secs(5), || {
        last = call("read");
        last == "b,n,s\ntext 42 true nil\n"
    });
    assert!(ok, "ttl entry did not expire: {last:?}");
    assert_eq!(call("delete"), "nil\n");
    assert_eq!(call("flush"), "0\n");
}

#[test]
fn timers_from_init_worker_and_hooks_write_the_dict() {
    let init_worker = r#"
pier.timer.at(0.05, function(premature)
  pier.shared.t:incr("init_worker_timers", 1, 0)
end)
"#;
    let access = r#"
local key = pier.req.get_uri_args().key
assert(pier.timer.at(0.05, function(premature, k, phase)
  pier.shared.t:set(k, "fired after " .. phase .. " premature=" .. tostring(premature))
end, key, pier.get_phase()))
pier.exit(204)
"#;
    let every = r#"
if pier.shared.t:add("every_started", true) then
  assert(pier.timer.every(0.05, function()
    pier.shared.t:incr("ticks", 1, 0)
  end))
end
pier.exit(204)
"#;
    let cfg = base_config(
        &format!(
            "[lua]\n{}\n[lua.shared]\nt = \"1m\"\n",
            hook("init_worker", init_worker)
        ),
        &format!(
            "{}{}{}",
            // A content-only route needs a content hook; the access hook exits first.
            lua_route(
                "sched",
                "/sched",
                "",
                &format!(
                    "{}{}",
                    hook("access", access),
                    hook("content", "pier.say(\"unreachable\")")
                ),
            ),
            lua_route("every", "/every", "", &hook("content", every)),
            getter("t"),
        ),
    );
    let p = pier(&cfg);
    // One init_worker per worker thread.
    assert_eq!(wait_key(&p, "init_worker_timers", "2"), "2");

    let r = RawConn::connect(p.listener("main"))
        .get("/sched?key=k1")
        .unwrap();
    assert_eq!(r.status, 204, "{}", r.body_str());
    assert_eq!(
        wait_key(&p, "k1", "fired after access premature=false"),
        "fired after access premature=false"
    );

    let r = RawConn::connect(p.listener("main")).get("/every").unwrap();
    assert_eq!(r.status, 204);
    let mut ticks = 0u64;
    let ok = wait_until(Duration::from_secs(5), || {
        ticks = get_key(&p, "ticks").parse().unwrap_or(0);
        ticks >= 5
    });
    assert!(ok, "pier.timer.every ticked {ticks} times");
    // It keeps ticking.
    let later = wait_until(Duration::from_secs(5), || {
        get_key(&p, "ticks").parse::<u64>().unwrap_or(0) > ticks
    });
    assert!(later);
    // Still exactly two init_worker timers.
    assert_eq!(get_key(&p, "init_worker_timers"), "2");
}

#[test]
fn reload_swaps_lua_code_and_keeps_dict_contents() {
    let o = Origin::start();
    let config = |version: &str| {
        let access = format!(
            r#"
pier.shared.keep:incr("n", 1, 0)
pier.resp.set_header("x-version", "{version}")
"#
        );
        let content = format!(
            r#"
pier.say("{version} ", pier.shared.keep:get("n") or 0)
"#
        );
        base_config(
            "[lua.shared]\nkeep = \"1m\"\n",
            &format!(
                "{}{}{}",
                lua_route("inc", "/inc/", "app", &hook("access", &access)),
                lua_route("show", "/show", "", &hook("content", &content)),
                upstream(&[o.addr()])
            ),
        )
    };
    let mut p = pier(&config("v1"));
    for _ in 0..5 {
        let r = RawConn::connect(p.listener("main"))
            .get("/inc/hello")
            .unwrap();
        assert_eq!(r.status, 200);
        assert_eq!(r.header("x-version"), Some("v1"));
    }
    let r = RawConn::connect(p.listener("main")).get("/show").unwrap();
    assert_eq!(r.body_str(), "v1 5\n");

    p.rewrite_config(&config("v2"));
    p.signal(sig::SIGHUP);
    p.wait_generation(2);
    for i in 0..3 {
        let r = RawConn::connect(p.listener("main"))
            .get("/inc/hello")
            .unwrap();
        assert_eq!(r.status, 200);
        assert_eq!(
            r.header("x-version"),
            Some("v2"),
            "request {i} after reload"
        );
    }
    let r = RawConn::connect(p.listener("main")).get("/show").unwrap();
    assert_eq!(r.body_str(), "v2 8\n", "new code, and the dict kept its 5");

    // A reload with broken Lua is refused: the old code keeps serving.
    let broken = config("v3").replace("pier.say(", "pier.say((");
    p.rewrite_config(&broken);
    p.signal(sig::SIGHUP);
    assert!(!p.try_wait_generation(3, Duration::from_secs(2)));
    let r = RawConn::connect(p.listener("main")).get("/show").unwrap();
    assert_eq!(r.body_str(), "v2 8\n");
}

#[test]
fn reload_with_a_new_dict_size_starts_it_empty() {
    let config = |size: &str| {
        base_config(
            &format!("[lua.shared]\nd = \"{size}\"\n"),
            &format!(
                "{}{}",
                lua_route(
                    "put",
                    "/put",
                    "",
                    &hook("content", "pier.say((pier.shared.d:set(\"k\", \"v\")))"),
                ),
                getter("d")
            ),
        )
    };
    let mut p = pier(&config("1m"));
    let r = RawConn::connect(p.listener("main")).get("/put").unwrap();
    assert_eq!(r.body_str(), "true\n");
    assert_eq!(get_key(&p, "k"), "v");
    // docs/config.md: contents are kept only if the size is unchanged.
    p.rewrite_config(&config("2m"));
    p.signal(sig::SIGHUP);
    p.wait_generation(2);
    assert_eq!(get_key(&p, "k"), "nil");
}

/// Config whose `init_worker` calls the origin once (`/hello?from=VERSION`) and ticks
/// `ticks_VERSION` in dict `t` every 50 ms; `/get?k=KEY` reads the dict.
fn timer_config(o: &Origin, version: &str) -> String {
    let init_worker = format!(
        r#"
pier.timer.at(0, function()
  pier.http.request{{ url = "http://{origin}/hello?from={version}" }}
end)
pier.timer.every(0.05, function()
  pier.shared.t:incr("ticks_{version}", 1, 0)
end)
"#,
        origin = o.addr()
    );
    base_config(
        &format!(
            "[lua]\n{}\n[lua.shared]\nt = \"1m\"\n",
            hook("init_worker", &init_worker)
        ),
        &getter("t"),
    )
}

/// After a reload (and traffic on the workers) the new `init_worker` runs and the old
/// engine's timers stop.
#[test]
fn reload_replaces_init_worker_timers() {
    let o = Origin::start();
    let mut p = pier(&timer_config(&o, "v1"));
    // Each worker's init_worker reached the origin.
    assert!(
        wait_until(Duration::from_secs(5), || o.requests() == 2),
        "init_worker timers at start: {} origin requests",
        o.requests()
    );
    p.rewrite_config(&timer_config(&o, "v2"));
    p.signal(sig::SIGHUP);
    p.wait_generation(2);
    // Traffic on both threads (30 new connections spread over the workers).
    for _ in 0..30 {
        get_key(&p, "x");
    }
    let mut ticks = String::new();
    let ok = wait_until(Duration::from_secs(5), || {
        ticks = get_key(&p, "ticks_v2");
        ticks != "nil"
    });
    assert!(ok, "v2 timers do not tick");
    assert!(
        wait_until(Duration::from_secs(5), || o.requests() >= 3),
        "the v2 init_worker never called the origin"
    );
    // Old timers have stopped: their count no longer moves.
    let mut v1 = get_key(&p, "ticks_v1");
    let still = wait_until(Duration::from_secs(5), || {
        std::thread::sleep(Duration::from_millis(200));
        let now = get_key(&p, "ticks_v1");
        let same = now == v1;
        v1 = now;
        same
    });
    assert!(still, "v1 timers still tick after the reload");
}

/// docs/config.md: `init` runs in every state "at start and on each reload" and
/// `init_worker` after it; background timers must not wait for a client request.
#[test]

fn reload_runs_the_new_init_worker_without_traffic() {
    let o = Origin::start();
    let mut p = pier(&timer_config(&o, "v1"));
    assert!(
        wait_until(Duration::from_secs(5), || o.requests() == 2),
        "init_worker timers at start: {} origin requests",
        o.requests()
    );
    p.rewrite_config(&timer_config(&o, "v2"));
    p.signal(sig::SIGHUP);
    p.wait_generation(2);
    // No request to Pier: the new states start on their own (one per worker).
    let started = wait_until(Duration::from_secs(5), || o.requests() == 4);
    assert!(
        started,
        "the new init_worker did not run: {} origin requests (want 4)",
        o.requests()
    );
}
