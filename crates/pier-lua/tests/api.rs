//! The pier.* request/response API, flows, ctx and errors, against the
//! in-memory `TestView`.
#![allow(unsafe_code)] // `LuaEngine::lua`, whose handle must not outlive the engine; nothing else

mod support;

use bytes::BytesMut;
use pier_lua::{Flow, Phase, RequestCtx, RouteHooks};
use support::*;

#[test]
fn request_reads() {
    let e = access_engine(
        r#"
        local req = pier.req
        assert(req.get_method() == "GET")
        assert(req.get_uri() == "/api/items?id=7&tag=a&tag=b&flag&q=hello%20world+x", req.get_uri())
        assert(req.get_path() == "/api/items")
        assert(req.get_header("user-agent") == "curl/8.0")
        assert(req.get_header("USER-AGENT") == "curl/8.0")
        assert(req.get_header("x-missing") == nil)
        assert(req.get_header("x-multi") == "one")
        local h = req.get_headers()
        assert(h["user-agent"] == "curl/8.0")
        assert(h.User_Agent == "curl/8.0")
        assert(type(h["x-multi"]) == "table" and h["x-multi"][2] == "two")
        local a = req.get_uri_args()
        assert(a.id == "7")
        assert(a.tag[1] == "a" and a.tag[2] == "b")
        assert(a.flag == true)
        assert(a.q == "hello world x", a.q)
        local v = pier.var
        assert(v.remote_addr == "192.0.2.7", v.remote_addr)
        assert(v.remote_port == "51000")
        assert(v.host == "example.test")
        assert(v.request_uri == req.get_uri())
        assert(v.uri == "/api/items")
        assert(v.args == "id=7&tag=a&tag=b&flag&q=hello%20world+x")
        assert(v.is_args == "?")
        assert(v.scheme == "http")
        assert(v.request_method == "GET")
        assert(v.server_port == "8080")
        assert(v.http_user_agent == "curl/8.0")
        assert(v.http_x_nope == nil)
        assert(v.no_such_variable == nil)
        assert(pier.now() == 1700000000.123, string.format("%.6f", pier.now()))
        assert(pier.get_phase() == "access")
        "#,
    );
    let mut v = TestView::default();
    let mut ctx = RequestCtx::new();
    assert_eq!(run(e.access(0, &mut v, &mut ctx)).unwrap(), Flow::Continue);
}

#[test]
fn request_writes() {
    let e = access_engine(
        r#"
        local req = pier.req
        req.set_header("X-Added", "1")
        req.set_header("X-Num", 42)
        req.set_header("User-Agent", nil)
        req.add_header("X-Multi", "three")
        req.set_header("X-List", {"a", "b"})
        req.clear_header("host")
        req.set_uri("/rewritten")
        assert(req.get_uri() == "/rewritten?id=7&tag=a&tag=b&flag&q=hello%20world+x")
        req.set_uri_args({ k = "a b" })
        assert(req.get_uri() == "/rewritten?k=a%20b", req.get_uri())
        req.set_uri_args("x=1")
        local ok, err = pcall(req.set_header, "X-Bad", "a\r\nb")
        assert(not ok and err:find("bad argument"), err)
        ok, err = pcall(req.set_uri, "no-slash")
        assert(not ok)
        "#,
    );
    let mut v = TestView::default();
    let mut ctx = RequestCtx::new();
    run(e.access(0, &mut v, &mut ctx)).unwrap();
    assert_eq!(v.req("x-added").as_deref(), Some("1"));
    assert_eq!(v.req("x-num").as_deref(), Some("42"));
    assert_eq!(v.req("user-agent"), None);
    assert_eq!(v.req("host"), None);
    assert_eq!(v.headers.iter().filter(|(k, _)| k == b"X-Multi").count(), 3);
    assert_eq!(
        v.headers
            .iter()
            .filter(|(k, _)| k.eq_ignore_ascii_case(b"x-list"))
            .count(),
        2
    );
    assert_eq!(v.uri, b"/rewritten?x=1");
}

#[test]
fn response_headers_in_access_and_header_filter() {
    let e = engine(setup(RouteHooks {
        access: src("route t access", "pier.resp.set_header('X-Lua', 1)"),
        header_filter: src(
            "route t header_filter",
            r#"
            assert(pier.resp.get_status() == 200)
            assert(pier.resp.get_header("x-lua") == "1")
            assert(pier.resp.get_headers()["content-type"] == "text/plain")
            pier.resp.set_status(201)
            pier.resp.set_header("Server", "pier")
            pier.resp.add_header("Set-Cookie", "a=1")
            pier.resp.add_header("Set-Cookie", "b=2")
            pier.resp.clear_header("Content-Type")
            "#,
        ),
        ..Default::default()
    }));
    let mut v = TestView::default();
    let mut ctx = RequestCtx::new();
    run(e.access(0, &mut v, &mut ctx)).unwrap();
    assert_eq!(v.resp("x-lua").as_deref(), Some("1"));
    v.status = 200;
    v.resp_headers
        .push((b"Content-Type".to_vec(), b"text/plain".to_vec()));
    e.header_filter(0, &mut v, &mut ctx).unwrap();
    assert_eq!(v.status, 201);
    assert_eq!(v.resp("server").as_deref(), Some("pier"));
    assert_eq!(v.resp("content-type"), None);
    assert_eq!(
        v.resp_headers
            .iter()
            .filter(|(k, _)| k == b"Set-Cookie")
            .count(),
        2
    );
}

#[test]
fn exit_redirect_say_flows() {
    let mut v = TestView::default();
    let mut ctx = RequestCtx::new();

    let e = access_engine(
        "if pier.req.get_header('x-block') then pier.exit(403, 'denied') end error('not reached')",
    );
    v.headers.push((b"X-Block".to_vec(), b"1".to_vec()));
    let flow = run(e.access(0, &mut v, &mut ctx)).unwrap();
    assert_eq!(
        flow,
        Flow::Respond {
            status: 403,
            headers: vec![],
            body: "denied".into()
        }
    );

    // exit(0) ends the hook and continues.
    let e = access_engine("pier.exit(pier.OK) error('not reached')");
    assert_eq!(run(e.access(0, &mut v, &mut ctx)).unwrap(), Flow::Continue);

    let e = access_engine("pier.redirect('/login?next=1', 301)");
    let flow = run(e.access(0, &mut v, &mut ctx)).unwrap();
    assert_eq!(
        flow,
        Flow::Respond {
            status: 301,
            headers: vec![(b"location".to_vec(), b"/login?next=1".to_vec())],
            body: "".into()
        }
    );

    // exit from inside pcall still ends the hook.
    let e = access_engine("pcall(pier.exit, 401) error('not reached')");
    let flow = run(e.access(0, &mut v, &mut ctx)).unwrap();
    assert!(
        matches!(flow, Flow::Respond { status: 401, .. }),
        "{flow:?}"
    );

    let e = engine(setup(RouteHooks {
        content: src(
            "route t content",
            "pier.say('hello ', 42, {' a', ' b'}) pier.print('x') pier.resp.set_status(202)",
        ),
        ..Default::default()
    }));
    let flow = run(e.content(0, &mut v, &mut ctx)).unwrap();
    assert_eq!(
        flow,
        Flow::Respond {
            status: 202,
            headers: vec![],
            body: "hello 42 a b\nx".into()
        }
    );

    // say then exit(status): the said body goes with that status.
    v.status = 0;
    let e = engine(setup(RouteHooks {
        content: src("route t content", "pier.say('gone') pier.exit(410)"),
        ..Default::default()
    }));
    let flow = run(e.content(0, &mut v, &mut ctx)).unwrap();
    assert_eq!(
        flow,
        Flow::Respond {
            status: 410,
            headers: vec![],
            body: "gone\n".into()
        }
    );
}

#[test]
fn ctx_across_phases_and_released() {
    let e = engine(setup(RouteHooks {
        access: src(
            "route t access",
            "pier.ctx.user = pier.req.get_header('user-agent') pier.ctx.n = 1",
        ),
        header_filter: src(
            "route t header_filter",
            "pier.ctx.n = pier.ctx.n + 1 pier.resp.set_header('x-user', pier.ctx.user)",
        ),
        body_filter: src("route t body_filter", "pier.ctx.n = pier.ctx.n + 1"),
        log: src(
            "route t log",
            "assert(pier.ctx.n == 3) pier.ctx.logged = true",
        ),
        ..Default::default()
    }));
    for i in 0..50 {
        let mut v = TestView::default();
        v.headers[1].1 = format!("agent-{i}").into_bytes();
        let mut ctx = RequestCtx::new();
        run(e.access(0, &mut v, &mut ctx)).unwrap();
        e.header_filter(0, &mut v, &mut ctx).unwrap();
        e.body_filter(0, &mut v, &mut ctx, &mut BytesMut::from("x"), true)
            .unwrap();
        e.log(0, &mut v, &mut ctx);
        assert_eq!(v.resp("x-user"), Some(format!("agent-{i}")));
    }
    // Sequential requests reuse one slot.
    assert_eq!(e.ctx_slots_high_water(), 1);
    // Two live requests get distinct tables.
    let e = engine(setup(RouteHooks {
        access: src(
            "route t access",
            "assert(pier.ctx.v == nil) pier.ctx.v = pier.req.get_uri()",
        ),
        log: src(
            "route t log",
            "assert(pier.ctx.v == pier.req.get_uri(), 'ctx mixed')",
        ),
        ..Default::default()
    }));
    let (mut v1, mut v2) = (TestView::default(), TestView::default());
    v2.uri = b"/other".to_vec();
    let (mut c1, mut c2) = (RequestCtx::new(), RequestCtx::new());
    run(e.access(0, &mut v1, &mut c1)).unwrap();
    run(e.access(0, &mut v2, &mut c2)).unwrap();
    e.log(0, &mut v2, &mut c2);
    e.log(0, &mut v1, &mut c1);
    // The log hook's assert would have been logged, not returned: check directly.
    let ok: bool = {
        let mut ctx = RequestCtx::new();
        let e2 = engine(setup(RouteHooks {
            access: src("route t access", "pier.ctx.x = 1"),
            header_filter: src("route t header_filter", "assert(pier.ctx.x == 1)"),
            ..Default::default()
        }));
        run(e2.access(0, &mut v1, &mut ctx)).unwrap();
        e2.header_filter(0, &mut v1, &mut ctx).is_ok()
    };
    assert!(ok);
}

#[test]
fn body_filter_rewrites_chunks() {
    let e = engine(setup(RouteHooks {
        body_filter: src(
            "route t body_filter",
            r#"
            local chunk, eof = pier.arg[1], pier.arg[2]
            pier.arg[1] = chunk:upper()
            if eof then pier.arg[1] = pier.arg[1] .. "<END>" end
            "#,
        ),
        ..Default::default()
    }));
    let mut v = TestView::default();
    let mut ctx = RequestCtx::new();
    let mut c = BytesMut::from("hello ");
    e.body_filter(0, &mut v, &mut ctx, &mut c, false).unwrap();
    assert_eq!(&c[..], b"HELLO ");
    let mut c = BytesMut::from("world");
    e.body_filter(0, &mut v, &mut ctx, &mut c, true).unwrap();
    assert_eq!(&c[..], b"WORLD<END>");
}

#[test]
fn balancer_choice() {
    let e = engine(setup(RouteHooks {
        balancer: src(
            "route t balancer",
            "pier.balancer.set_peer('127.0.0.1', 9001) pier.balancer.set_retries(2)",
        ),
        ..Default::default()
    }));
    let mut v = TestView::default();
    let mut ctx = RequestCtx::new();
    let c = run(e.balancer(0, &mut v, &mut ctx)).unwrap();
    assert_eq!(c.peer, Some("127.0.0.1:9001".parse().unwrap()));
    assert_eq!(c.retries, Some(2));
}

#[test]
fn phase_gating_errors() {
    let cases: &[(Phase, &str, &str)] = &[
        (
            Phase::HeaderFilter,
            "pier.req.set_header('a', 'b')",
            "API pier.req.set_header is disabled in phase header_filter",
        ),
        (
            Phase::BodyFilter,
            "pier.resp.set_status(500)",
            "API pier.resp.set_status is disabled in phase body_filter",
        ),
        (
            Phase::HeaderFilter,
            "pier.exit(403)",
            "API pier.exit is disabled in phase header_filter",
        ),
        (
            Phase::HeaderFilter,
            "pier.say('x')",
            "API pier.say is disabled in phase header_filter",
        ),
        (
            Phase::Access,
            "local _ = pier.arg[1]",
            "API pier.arg is disabled in phase access",
        ),
        (
            Phase::HeaderFilter,
            "pier.sleep(0)",
            "API pier.sleep is disabled in phase header_filter",
        ),
        (
            Phase::BodyFilter,
            "pier.balancer.set_retries(1)",
            "API pier.balancer.set_retries is disabled in phase body_filter",
        ),
        (
            Phase::Access,
            "pier.balancer.set_retries(1)",
            "API pier.balancer.set_retries is disabled in phase access",
        ),
        (
            Phase::HeaderFilter,
            "pier.redirect('/x')",
            "API pier.redirect is disabled in phase header_filter",
        ),
        (
            Phase::Access,
            "pier.analytics.field('user', 'alice')",
            "API pier.analytics.field is disabled in phase access (log phase only)",
        ),
    ];
    for (phase, code, want) in cases {
        let mut hooks = RouteHooks::default();
        let s = src(&format!("route t {phase}"), &format!("local x = 1\n{code}"));
        match phase {
            Phase::Access => hooks.access = s,
            Phase::HeaderFilter => hooks.header_filter = s,
            Phase::BodyFilter => hooks.body_filter = s,
            _ => unreachable!(),
        }
        let e = engine(setup(hooks));
        let mut v = TestView::default();
        let mut ctx = RequestCtx::new();
        let err = match phase {
            Phase::Access => run(e.access(0, &mut v, &mut ctx)).map(|_| ()),
            Phase::BodyFilter => e.body_filter(0, &mut v, &mut ctx, &mut BytesMut::new(), true),
            _ => e.header_filter(0, &mut v, &mut ctx),
        }
        .expect_err(code);
        // The error points at the user's line (2), not at the wrapper.
        let loc = format!("route t {phase}:2: ");
        assert!(err.message.contains(want), "{code}: {}", err.message);
        assert!(err.message.starts_with(&loc), "{code}: {}", err.message);
    }
}

#[test]
fn lua_errors_carry_chunk_and_line() {
    let e = access_engine("local a = 1\nlocal b = nil\nreturn b.field");
    let mut v = TestView::default();
    let mut ctx = RequestCtx::new();
    let err = run(e.access(0, &mut v, &mut ctx)).unwrap_err();
    assert_eq!(err.phase, Some(Phase::Access));
    assert!(
        err.message
            .starts_with("route t access:3: attempt to index local 'b'"),
        "{}",
        err.message
    );
    assert!(
        err.to_string()
            .starts_with("lua access hook failed: route t access:3:"),
        "{err}"
    );
    // The engine is still usable after an error.
    let e2 = access_engine("error('boom')");
    let err = run(e2.access(0, &mut v, &mut ctx)).unwrap_err();
    assert!(
        err.message.starts_with("route t access:1: boom"),
        "{}",
        err.message
    );
    let err = run(e2.access(0, &mut v, &mut ctx)).unwrap_err();
    assert!(err.message.contains("boom"));
}

#[test]
fn file_sources_and_validate() {
    let dir = std::env::temp_dir().join(format!("pier-lua-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("hook.lua");
    std::fs::write(
        &path,
        "pier.resp.set_header('x-file', 'yes')\nerror('from file')\n",
    )
    .unwrap();
    let mut s = setup(RouteHooks {
        access: Some(pier_lua::Source::File(path.clone())),
        ..Default::default()
    });
    assert!(s.validate().is_ok());
    let e = engine(s.clone());
    let mut v = TestView::default();
    let mut ctx = RequestCtx::new();
    let err = run(e.access(0, &mut v, &mut ctx)).unwrap_err();
    assert!(
        err.message.contains("hook.lua:2: from file"),
        "{}",
        err.message
    );

    s.routes.push(RouteHooks {
        log: src("route bad log", "if then end"),
        ..Default::default()
    });
    s.routes.push(RouteHooks {
        content: Some(pier_lua::Source::File(dir.join("missing.lua"))),
        ..Default::default()
    });
    let errs = s.validate().unwrap_err();
    assert_eq!(errs.len(), 2, "{errs:?}");
    assert!(
        errs[0].starts_with("route 1 log: route bad log:1:"),
        "{errs:?}"
    );
    assert!(errs[1].contains("missing.lua"), "{errs:?}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn has_hook_and_init_phases() {
    let mut s = setup(RouteHooks {
        access: src(
            "route t access",
            "assert(greet() == 'hi from init') assert(WORKER_READY)",
        ),
        ..Default::default()
    });
    s.init = src(
        "init",
        "function greet() return 'hi from init' end assert(pier.get_phase() == 'init')",
    );
    s.init_worker = src(
        "init_worker",
        "WORKER_READY = pier.get_phase() == 'init_worker'",
    );
    let e = engine(s);
    assert!(e.has_hook(0, Phase::Access));
    assert!(!e.has_hook(0, Phase::Content));
    assert!(!e.has_hook(7, Phase::Access));
    let mut v = TestView::default();
    let mut ctx = RequestCtx::new();
    run(e.access(0, &mut v, &mut ctx)).unwrap();

    // Request APIs fail in init, with the phase named.
    let mut s = setup(RouteHooks::default());
    s.init = src("init", "pier.req.get_method()");
    let err = pier_lua::LuaEngine::new(std::sync::Arc::new(s), registry(&[]))
        .err()
        .unwrap();
    assert!(
        err.message
            .contains("API pier.req.get_method is disabled in phase init"),
        "{}",
        err.message
    );
}

#[test]
fn log_phase_errors_are_logged_not_returned() {
    let reg = registry(&[("cache", 1 << 20)]);
    let s = setup(RouteHooks {
        log: src(
            "route t log",
            r#"
            local ok, err = pcall(pier.exit, 500)
            pier.shared.cache:set("exit_err", err)
            ok, err = pcall(pier.sleep, 1)
            pier.shared.cache:set("sleep_err", err)
            assert(pier.req.get_method() == "GET")
            error("log failure is only logged")
            "#,
        ),
        ..Default::default()
    });
    let e = pier_lua::LuaEngine::new(std::sync::Arc::new(s), reg.clone()).unwrap();
    let mut v = TestView::default();
    let mut ctx = RequestCtx::new();
    e.log(0, &mut v, &mut ctx);
    let got = dict_str(&reg, "exit_err");
    assert!(
        got.contains("API pier.exit is disabled in phase log"),
        "{got}"
    );
    let got = dict_str(&reg, "sleep_err");
    assert!(
        got.contains("API pier.sleep is disabled in phase log"),
        "{got}"
    );
}

#[test]
fn large_values_grow_the_copy_buffer() {
    let e = access_engine(
        r#"
        local big = pier.req.get_header("x-big")
        assert(#big == 10000 and big == string.rep("b", 10000), #big)
        assert(pier.var.http_x_big == big)
        pier.resp.set_header("x-echo", big)
        assert(pier.resp.get_header("x-echo") == big)
        assert(pier.req.get_header("user-agent") == "curl/8.0")
        "#,
    );
    let mut v = TestView::default();
    v.headers.push((b"X-Big".to_vec(), vec![b'b'; 10000]));
    run(e.access(0, &mut v, &mut RequestCtx::new())).unwrap();
    assert_eq!(v.resp("x-echo").map(|s| s.len()), Some(10000));
}

#[test]
fn hook_coroutines_are_reused_only_after_a_normal_return() {
    let e = access_engine(
        r#"
        local mode = pier.req.get_header("x-mode")
        COUNT = (COUNT or 0) + 1
        if mode == "exit" then pier.exit(403) end
        if mode == "error" then error("boom") end
        if mode == "sleep" then pier.sleep(0.001) end
        local x = 1 -- locals of one run never leak into the next
        assert(seen == nil)
        "#,
    );
    let req = |mode: &str| {
        let mut v = TestView::default();
        v.headers
            .push((b"X-Mode".to_vec(), mode.as_bytes().to_vec()));
        run(e.access(0, &mut v, &mut RequestCtx::new()))
    };
    assert_eq!(e.idle_runners(), 0);
    req("plain").unwrap();
    assert_eq!(e.idle_runners(), 1);
    for _ in 0..10 {
        req("plain").unwrap();
        req("sleep").unwrap();
    }
    assert_eq!(e.idle_runners(), 1);
    assert!(matches!(
        req("exit").unwrap(),
        Flow::Respond { status: 403, .. }
    ));
    // The exited coroutine is not returned; the idle one was used and dropped.
    assert_eq!(e.idle_runners(), 0);
    assert!(req("error").unwrap_err().message.contains("boom"));
    assert_eq!(e.idle_runners(), 0);
    req("plain").unwrap();
    assert_eq!(e.idle_runners(), 1);
    // SAFETY: used while `e` lives, not kept.
    let count: i64 = unsafe { e.lua() }.globals().get("COUNT").unwrap();
    assert_eq!(count, 24);
}

#[test]
fn upstream_request_phase_edits_or_answers() {
    let e = engine(setup(RouteHooks {
        upstream_request: src(
            "route t upstream_request",
            r#"
            assert(pier.get_phase() == "upstream_request")
            pier.req.set_header("X-Forwarded-By", "pier")
            pier.req.set_uri("/origin" .. pier.req.get_path())
            if pier.req.get_header("x-cached") then pier.exit(304) end
            local ok, err = pcall(pier.resp.set_header, "x", "y")
            assert(not ok and err:find("disabled in phase upstream_request"), err)
            "#,
        ),
        ..Default::default()
    }));
    let mut v = TestView::default();
    assert_eq!(
        run(e.upstream_request(0, &mut v, &mut RequestCtx::new())).unwrap(),
        Flow::Continue
    );
    assert_eq!(v.req("x-forwarded-by").as_deref(), Some("pier"));
    assert!(v.uri.starts_with(b"/origin/api/items?id=7"));
    let mut v = TestView::default();
    v.headers.push((b"X-Cached".to_vec(), b"1".to_vec()));
    let flow = run(e.upstream_request(0, &mut v, &mut RequestCtx::new())).unwrap();
    assert!(matches!(flow, Flow::Respond { status: 304, .. }));
    // No hook: nothing to do.
    assert_eq!(
        run(e.access(0, &mut v, &mut RequestCtx::new())).unwrap(),
        Flow::Continue
    );
}

#[test]
fn setup_is_send_and_sync() {
    fn assert_send_sync<T: Send + Sync>() {}
    assert_send_sync::<pier_lua::LuaSetup>();
    assert_send_sync::<pier_lua::LuaError>();
}

#[test]
fn ctx_does_not_cross_engines() {
    // A request that started on one engine (before a reload) and continues
    // on another must not see another request's pier.ctx there.
    let hooks = || RouteHooks {
        access: src("a", "pier.ctx.owner = pier.req.get_uri()"),
        header_filter: src(
            "h",
            "pier.resp.set_header('x-owner', tostring(pier.ctx.owner))",
        ),
        ..Default::default()
    };
    let (old, new) = (engine(setup(hooks())), engine(setup(hooks())));
    let mut other = TestView {
        uri: b"/other".to_vec(),
        ..Default::default()
    };
    let mut other_ctx = RequestCtx::new();
    run(new.access(0, &mut other, &mut other_ctx)).unwrap();

    let mut v = TestView::default();
    let mut ctx = RequestCtx::new();
    run(old.access(0, &mut v, &mut ctx)).unwrap();
    new.header_filter(0, &mut v, &mut ctx).unwrap();
    assert_eq!(v.resp("x-owner").as_deref(), Some("nil"));
    new.header_filter(0, &mut other, &mut other_ctx).unwrap();
    assert_eq!(other.resp("x-owner").as_deref(), Some("/other"));
}

/// A view that keeps no status before a response exists (as a proxy may).
struct NoStatus(TestView);

impl pier_lua::HttpView for NoStatus {
    fn method(&self) -> &[u8] {
        self.0.method()
    }
    fn uri(&self) -> &[u8] {
        self.0.uri()
    }
    fn set_uri(&mut self, u: &[u8]) {
        self.0.set_uri(u)
    }
    fn req_header(&self, n: &[u8]) -> Option<&[u8]> {
        self.0.req_header(n)
    }
    fn req_headers(&self, f: &mut dyn FnMut(&[u8], &[u8])) {
        self.0.req_headers(f)
    }
    fn set_req_header(&mut self, n: &[u8], v: Option<&[u8]>) {
        self.0.set_req_header(n, v)
    }
    fn add_req_header(&mut self, n: &[u8], v: &[u8]) {
        self.0.add_req_header(n, v)
    }
    fn client_addr(&self) -> std::net::SocketAddr {
        self.0.client_addr()
    }
    fn scheme(&self) -> &[u8] {
        self.0.scheme()
    }
    fn host(&self) -> &[u8] {
        self.0.host()
    }
    fn server_port(&self) -> u16 {
        self.0.server_port()
    }
    fn status(&self) -> u16 {
        0
    }
    fn set_status(&mut self, _: u16) {}
    fn resp_header(&self, n: &[u8]) -> Option<&[u8]> {
        self.0.resp_header(n)
    }
    fn resp_headers(&self, f: &mut dyn FnMut(&[u8], &[u8])) {
        self.0.resp_headers(f)
    }
    fn set_resp_header(&mut self, n: &[u8], v: Option<&[u8]>) {
        self.0.set_resp_header(n, v)
    }
    fn add_resp_header(&mut self, n: &[u8], v: &[u8]) {
        self.0.add_resp_header(n, v)
    }
    fn now_ns(&self) -> u64 {
        self.0.now_ns()
    }
}

#[test]
fn content_status_from_set_status_without_view_status() {
    let e = engine(setup(RouteHooks {
        content: src(
            "route t content",
            "pier.resp.set_status(201) pier.say('created')",
        ),
        access: src(
            "route t access",
            "if pier.req.get_header('x-deny') then pier.resp.set_status(451) pier.say('no') end",
        ),
        ..Default::default()
    }));
    let flow = run(e.content(
        0,
        &mut NoStatus(TestView::default()),
        &mut RequestCtx::new(),
    ))
    .unwrap();
    assert_eq!(
        flow,
        Flow::Respond {
            status: 201,
            headers: vec![],
            body: "created\n".into()
        }
    );
    let mut v = TestView::default();
    v.headers.push((b"X-Deny".to_vec(), b"1".to_vec()));
    let flow = run(e.access(0, &mut NoStatus(v), &mut RequestCtx::new())).unwrap();
    assert_eq!(
        flow,
        Flow::Respond {
            status: 451,
            headers: vec![],
            body: "no\n".into()
        }
    );
    // Without set_status: 200.
    let e = engine(setup(RouteHooks {
        content: src("c", "pier.say('x')"),
        ..Default::default()
    }));
    let flow = run(e.content(
        0,
        &mut NoStatus(TestView::default()),
        &mut RequestCtx::new(),
    ))
    .unwrap();
    assert!(matches!(flow, Flow::Respond { status: 200, .. }));
}

/// `pier.analytics.field` in the log phase fills the request's analytics
/// fields (pier_log::fields), bounded and checked.
#[test]
fn analytics_fields_from_the_log_phase() {
    pier_log::fields::enable(true);
    let reg = registry(&[("cache", 1 << 20)]);
    let s = setup(RouteHooks {
        log: src(
            "route t log",
            r#"
            pier.analytics.field("user", "alice")
            pier.analytics.field("plan", 42)
            pier.shared.cache:set("bad_name", select(2, pcall(pier.analytics.field, "a b", "x")))
            pier.shared.cache:set("bad_value", select(2, pcall(pier.analytics.field, "v", string.rep("x", 300))))
            pier.shared.cache:set("not_string", select(2, pcall(pier.analytics.field, {}, "x")))
            "#,
        ),
        ..Default::default()
    });
    let e = pier_lua::LuaEngine::new(std::sync::Arc::new(s), reg.clone()).unwrap();
    let mut v = TestView::default();
    let mut ctx = RequestCtx::new();
    e.log(0, &mut v, &mut ctx);
    pier_log::fields::take(|f| {
        assert_eq!(
            f,
            &[(&b"user"[..], &b"alice"[..]), (&b"plan"[..], &b"42"[..])]
        )
    });
    for key in ["bad_name", "bad_value", "not_string"] {
        let got = dict_str(&reg, key);
        assert!(got.contains("pier.analytics.field"), "{key}: {got}");
    }
}
