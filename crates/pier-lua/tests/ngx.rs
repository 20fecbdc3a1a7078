//! The `ngx` compatibility layer (lua/pier/ngx.lua): request, variables,
//! response, flow, time, phase rules — against the in-memory `TestView`.

mod support;

use pier_lua::{Flow, RequestCtx, RouteHooks};
use support::*;

fn access(code: &str) -> (Result<Flow, pier_lua::LuaError>, TestView) {
    let e = access_engine(code);
    let mut v = TestView {
        headers: vec![
            (b"Host".to_vec(), b"example.test".to_vec()),
            (b"User-Agent".to_vec(), b"curl/8.0".to_vec()),
            (
                b"Cookie".to_vec(),
                b"session=abc123; theme=dark; xsession=no".to_vec(),
            ),
        ],
        ..TestView::default()
    };
    let mut ctx = RequestCtx::new();
    let r = run(e.access(0, &mut v, &mut ctx));
    (r, v)
}

#[test]
fn request_and_variables() {
    let (r, v) = access(
        r#"
        assert(ngx.get_phase() == "access")
        assert(ngx.req.get_method() == "GET")
        local h = ngx.req.get_headers()
        assert(h["user-agent"] == "curl/8.0" and h.user_agent == "curl/8.0")
        local a = ngx.req.get_uri_args()
        assert(a.id == "7" and a.tag[2] == "b" and a.flag == true and a.q == "hello world x")
        local var = ngx.var
        assert(var.remote_addr == "192.0.2.7")
        assert(var.binary_remote_addr == "\192\0\2\7")
        assert(var.uri == "/api/items")
        assert(var.request_uri == "/api/items?id=7&tag=a&tag=b&flag&q=hello%20world+x")
        assert(var.args == "id=7&tag=a&tag=b&flag&q=hello%20world+x")
        assert(var.request_method == "GET" and var.scheme == "http" and var.server_port == "8080")
        assert(var.http_user_agent == "curl/8.0")
        -- $cookie_NAME: exact name, not a suffix of another
        assert(var.cookie_session == "abc123", var.cookie_session)
        assert(var.cookie_theme == "dark")
        assert(var.cookie_nope == nil)
        -- $arg_NAME: raw value, case-insensitive name
        assert(var.arg_q == "hello%20world+x", var.arg_q)
        assert(var.arg_ID == "7")
        assert(var.arg_flag == "")
        assert(var.arg_missing == nil)
        assert(tonumber(var.request_time) >= 0)
        assert(var.hostname and #var.hostname > 0)
        -- user variables
        ngx.var.my_var = "x1"
        assert(ngx.var.my_var == "x1")
        local ok, err = pcall(function() ngx.var.uri = "/x" end)
        assert(not ok and err:find('variable "uri" not changeable', 1, true), err)
        -- writes
        ngx.req.set_header("X-Added", "1")
        ngx.req.set_header("User-Agent", nil)
        ngx.req.set_method(ngx.HTTP_POST)
        assert(ngx.req.get_method() == "POST")
        ngx.req.set_uri("/rewritten")
        ngx.req.set_uri_args({ a = 1 })
        assert(ngx.var.request_uri == "/rewritten?a=1", ngx.var.request_uri)
        assert(ngx.req.start_time() == 1700000000.123)
        ngx.header["X-Resp"] = "r"
        ngx.header.content_type = "text/plain"
        assert(ngx.header["x-resp"] == "r")
        assert(ngx.header["Content-Type"] == "text/plain")
        ngx.ctx.k = "v"
        assert(ngx.ctx.k == "v")
        assert(ngx.null ~= nil and ngx.null == ngx.null and type(ngx.null) == "userdata")
        assert(ngx.worker.id() == 0 and ngx.worker.count() == 1 and ngx.worker.pid() > 0)
        assert(ngx.config.subsystem == "http" and ngx.config.ngx_lua_version >= 10000)
        ngx.log(ngx.INFO, "one ", 2, " ", true, " ", nil, " ", ngx.null)
        "#,
    );
    assert_eq!(r.unwrap(), Flow::Continue);
    assert_eq!(v.req("x-added").as_deref(), Some("1"));
    assert_eq!(v.req("user-agent"), None);
    assert_eq!(v.method, b"POST");
    assert_eq!(v.uri, b"/rewritten?a=1");
    assert_eq!(v.resp("x-resp").as_deref(), Some("r"));
    assert_eq!(v.resp("content-type").as_deref(), Some("text/plain"));
}

#[test]
fn time_functions() {
    let (r, _) = access(
        r#"
        local now = ngx.now()
        assert(now > 1.7e9 and ngx.time() == math.floor(ngx.now()) or ngx.time() + 1 >= now)
        assert(ngx.http_time(1290079655) == "Thu, 18 Nov 2010 11:27:35 GMT", ngx.http_time(1290079655))
        assert(ngx.cookie_time(1290079655) == "Thu, 18-Nov-10 11:27:35 GMT", ngx.cookie_time(1290079655))
        assert(ngx.parse_http_time("Thu, 18 Nov 2010 11:27:35 GMT") == 1290079655)
        assert(ngx.parse_http_time("Thursday, 18-Nov-10 11:27:35 GMT") == 1290079655)
        assert(ngx.parse_http_time("Thu Nov 18 11:27:35 2010") == 1290079655)
        assert(ngx.parse_http_time("Thu, 29 Feb 2024 00:00:00 GMT") == 1709164800)
        assert(ngx.parse_http_time("garbage") == nil)
        assert(ngx.utctime():match("^%d%d%d%d%-%d%d%-%d%d %d%d:%d%d:%d%d$"))
        assert(ngx.localtime():match("^%d%d%d%d%-%d%d%-%d%d %d%d:%d%d:%d%d$"))
        assert(ngx.today():match("^%d%d%d%d%-%d%d%-%d%d$"))
        ngx.update_time()
        ngx.sleep(0.001)
        assert(ngx.now() >= now)
        "#,
    );
    assert_eq!(r.unwrap(), Flow::Continue);
}

#[test]
fn exit_and_say() {
    let e = engine(setup(RouteHooks {
        content: src(
            "route t content",
            r#"
            ngx.status = 201
            assert(ngx.say("a", 1, { "b", { "c" } }, nil, true, ngx.null) == 1)
            ngx.print("x")
            -- one string or number (emit's short path), and the others alone
            assert(ngx.say(42) == 1 and ngx.say(1.5) == 1 and ngx.say("s") == 1)
            -- integers as their digits; past 14 digits, -0 and fractions as %.14g
            ngx.say(-3) ngx.say(1e14) ngx.say(-0.0) ngx.say(99999999999999) ngx.say(2^53)
            ngx.print(7) ngx.print("p") ngx.say() ngx.say(nil) ngx.print(false) ngx.say({ "t" })
            ngx.flush(true)
            ngx.exit(ngx.HTTP_OK)
            error("not reached")
            "#,
        ),
        ..Default::default()
    }));
    let mut v = TestView::default();
    let mut ctx = RequestCtx::new();
    match run(e.content(0, &mut v, &mut ctx)).unwrap() {
        Flow::Respond { status, body, .. } => {
            assert_eq!(status, 201);
            assert_eq!(
                &body[..],
                b"a1bcniltruenull\nx42\n1.5\ns\n-3\n1e+14\n-0\n99999999999999\n9.007199254741e+15\n7p\nnil\nfalset\n"
            );
        }
        f => panic!("{f:?}"),
    }
    // ngx.exit(403) from access answers 403.
    let (r, _) = access("ngx.exit(ngx.HTTP_FORBIDDEN)");
    match r.unwrap() {
        Flow::Respond { status, .. } => assert_eq!(status, 403),
        f => panic!("{f:?}"),
    }
    // ngx.exit(ngx.OK) goes on.
    let (r, _) = access("ngx.exit(ngx.OK) error('not reached')");
    assert_eq!(r.unwrap(), Flow::Continue);
    let (r, _) = access("ngx.redirect('/login')");
    match r.unwrap() {
        Flow::Respond {
            status, headers, ..
        } => {
            assert_eq!(status, 302);
            assert!(headers
                .iter()
                .any(|(k, v)| k.eq_ignore_ascii_case(b"location") && v == b"/login"));
        }
        f => panic!("{f:?}"),
    }
}

#[test]
fn phase_rules_raise_ngx_errors() {
    // ngx.sleep and ngx.say are not allowed in header_filter; ngx.exit is not
    // allowed in log: each raises ngx_lua's error at the caller's line.
    let e = engine(setup(RouteHooks {
        header_filter: src(
            "route t header_filter",
            "local ok, err = pcall(ngx.sleep, 1)\n\
             assert(not ok and err:find('API disabled in the context of header_filter_by_lua*', 1, true), err)\n\
             ok, err = pcall(ngx.say, 'x')\n\
             assert(not ok and err:find('API disabled in the context of header_filter_by_lua*', 1, true), err)\n\
             assert(ngx.get_phase() == 'header_filter')\n\
             ngx.header['X-HF'] = ngx.status\n\
             ngx.sleep(1)",
        ),
        log: src("route t log", "ngx.exit(500)"),
        ..Default::default()
    }));
    let mut v = TestView {
        status: 200,
        ..TestView::default()
    };
    let mut ctx = RequestCtx::new();
    let err = e.header_filter(0, &mut v, &mut ctx).unwrap_err();
    let msg = err.to_string();
    assert!(
        msg.contains("route t header_filter:7:")
            && msg.contains("API disabled in the context of header_filter_by_lua*"),
        "{msg}"
    );
    assert_eq!(v.resp("x-hf").as_deref(), Some("200"));
    e.log(0, &mut v, &mut ctx);
}

#[test]
fn unsupported_calls_say_what_to_use() {
    let (r, _) = access(
        r#"
        local ok, err = pcall(ngx.location.capture, "/x")
        assert(not ok and err:find("not supported by Pier", 1, true), err)
        ok, err = pcall(ngx.req.set_uri, "/x", true)
        assert(not ok and err:find("jump", 1, true), err)
        assert(ngx.req.get_body_data() == nil)
        "#,
    );
    assert_eq!(r.unwrap(), Flow::Continue);
}

#[test]
fn timers_and_shared_dicts() {
    let e = engine(LuaSetup {
        init: src(
            "init",
            "assert(ngx.get_phase() == 'init')\n\
             ngx.shared.cache:set('from_init', 'yes')",
        ),
        ..setup(RouteHooks {
            access: src(
                "route t access",
                r#"
                assert(ngx.shared.cache:get("from_init") == "yes")
                local fired = false
                local ok, err = ngx.timer.at(0, function(premature, a)
                    assert(premature == false and a == "arg")
                    assert(ngx.get_phase() == "timer")
                    ngx.shared.cache:set("timer", a)
                end, "arg")
                assert(ok, err)
                assert(ngx.timer.running_count() >= 0)
                for _ = 1, 100 do
                    if ngx.shared.cache:get("timer") then break end
                    ngx.sleep(0.01)
                end
                assert(ngx.shared.cache:get("timer") == "arg")
                "#,
            ),
            ..Default::default()
        })
    });
    let mut v = TestView::default();
    let mut ctx = RequestCtx::new();
    assert_eq!(run(e.access(0, &mut v, &mut ctx)).unwrap(), Flow::Continue);
}

use pier_lua::LuaSetup;
