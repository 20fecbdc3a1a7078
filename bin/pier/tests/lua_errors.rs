//! Lua hooks that go wrong, through a real Pier: an API called outside its phases, a
//! runtime error (inline and from a file), and `pier check` on Lua syntax errors. Each
//! answers 500 `hook-error` with the error (chunk name and line) in Pier's log, and
//! Pier keeps serving.

mod common;

use std::process::Command;
use std::time::Duration;

use common::*;

/// A route to upstream `app` with these hooks.
fn route(name: &str, path: &str, hooks: &str) -> String {
    lua_route(name, path, "app", hooks)
}

fn config(o: &Origin, routes: &str) -> String {
    base_config(
        "",
        &format!(
            "{routes}[upstream.app]\nservers = {}\n",
            servers(&[o.addr()])
        ),
    )
}

/// Waits (bounded) until Pier's output contains every one of `needles`.
#[track_caller]
fn wait_log(p: &PierProcess, needles: &[&str]) {
    let ok = wait_until(Duration::from_secs(5), || {
        let l = p.logs();
        needles.iter().all(|n| l.contains(n))
    });
    assert!(ok, "pier's log lacks {needles:?}:\n{}", p.logs());
}

#[test]
fn api_outside_its_phase_is_a_hook_error() {
    let o = Origin::start();
    let routes = [
        route(
            "hfexit",
            "/hfexit/",
            &hook("header_filter", "pier.exit(403)"),
        ),
        route(
            "accbal",
            "/accbal/",
            &hook("access", "pier.balancer.set_peer(\"127.0.0.1\", 1)"),
        ),
        route(
            "balsay",
            "/balsay/",
            &hook("balancer", "pier.say(\"not here\")"),
        ),
        route(
            "urarg",
            "/urarg/",
            &hook("upstream_request", "local c = pier.arg[1]"),
        ),
    ]
    .concat();
    let p = pier(&config(&o, &routes));
    // New connections: after a header_filter error the origin's body is unread, so
    // Pier closes that client connection (with `Connection: close`).
    for round in 0..2 {
        for (path, api, phase) in [
            ("/hfexit/hello", "pier.exit", "header_filter"),
            ("/accbal/hello", "pier.balancer.set_peer", "access"),
            ("/balsay/hello", "pier.say", "balancer"),
            ("/urarg/hello", "pier.arg", "upstream_request"),
        ] {
            let r = RawConn::connect(p.listener("main")).get(path).unwrap();
            assert_local(&r, 500, "hook-error");
            if round == 0 {
                wait_log(&p, &[&format!("API {api} is disabled in phase {phase}")]);
            }
        }
    }
    // Only the header_filter request reached the origin (twice); the workers survived.
    assert_eq!(o.requests(), 2);
    assert_eq!(local_count(&p, 500, "hook-error"), 8.0);
}

#[test]
fn api_outside_its_phase_in_log_is_logged_and_the_response_stands() {
    let o = Origin::start();
    let routes = route(
        "lg",
        "/lg/",
        &hook("log", "local a = 1\npier.req.set_uri(\"/other\")"),
    );
    let p = pier(&config(&o, &routes));
    let mut conn = RawConn::connect(p.listener("main"));
    // The log phase runs after the response: the client got it whole.
    let r = conn.get("/lg/hello").unwrap();
    assert_eq!(r.status, 200);
    assert_eq!(r.body_str(), "hello world\n");
    wait_log(
        &p,
        &[
            "API pier.req.set_uri is disabled in phase log",
            "route lg log:2:",
        ],
    );
    let r = conn.get("/lg/hello").unwrap();
    assert_eq!(r.status, 200);
}

#[test]
fn runtime_error_answers_500_logs_chunk_and_line_and_pier_goes_on() {
    let o = Origin::start();
    let access = r#"
if pier.req.get_header("x-ok") then
  return
end
local t = nil
return t.field
"#;
    let hooks_dir = TempDir::new();
    let file = hooks_dir.write(
        "bad-filter.lua",
        "local s = pier.resp.get_status()\nerror(\"kaboom \" .. s)\n",
    );
    let routes = [
        route("boom", "/boom/", &hook("access", access)),
        route(
            "file",
            "/file/",
            &format!("header_filter_file = \"{}\"\n", file.display()),
        ),
    ]
    .concat();
    let p = pier(&config(&o, &routes));
    let mut conn = RawConn::connect(p.listener("main"));
    let r = conn.get("/boom/hello").unwrap();
    assert_local(&r, 500, "hook-error");
    // Inline code is named "route NAME PHASE"; the leading newline makes `t.field` line 6.
    wait_log(&p, &["route boom access:6:", "attempt to index"]);
    assert_eq!(o.requests(), 0);

    // The same connection, the same Lua state: the next request is proxied.
    let r = conn
        .request("GET", "/boom/hello", &[("x-ok", "1")], b"")
        .unwrap();
    assert_eq!(r.status, 200, "{}", r.body_str());
    assert_eq!(r.body_str(), "hello world\n");

    // An error raised with error() from a hook file names the file and line.
    let r = conn.get("/file/hello").unwrap();
    assert_local(&r, 500, "hook-error");
    wait_log(&p, &["bad-filter.lua:2:", "kaboom 200"]);

    // Many errors in a row do not take the workers down.
    for _ in 0..20 {
        let r = RawConn::connect(p.listener("main")).get("/boom/x").unwrap();
        assert_local(&r, 500, "hook-error");
    }
    let r = RawConn::connect(p.listener("main"))
        .request("GET", "/boom/hello", &[("x-ok", "1")], b"")
        .unwrap();
    assert_eq!(r.status, 200);
    assert_eq!(local_count(&p, 500, "hook-error"), 22.0);
}

#[test]
fn check_reports_lua_syntax_errors() {
    let dir = TempDir::new();
    std::fs::create_dir_all(dir.path().join("hooks")).unwrap();
    let bad_file = dir.write("hooks/bad.lua", "local a = 1\nlocal b = = 2\n");
    let inline = dir.write(
        "inline.toml",
        r#"[[listener]]
name = "main"
listen = "127.0.0.1:0"

[[route]]
name = "api"
upstream = "app"

[route.lua]
access = '''
local x = 1
if x then
  pier.exit(403
end
'''

[upstream.app]
servers = ["127.0.0.1:9"]
"#,
    );
    let from_file = dir.write(
        "file.toml",
        &format!(
            r#"[[listener]]
name = "main"
listen = "127.0.0.1:0"

[[route]]
name = "api"
upstream = "app"

[route.lua]
header_filter_file = "{}"

[upstream.app]
servers = ["127.0.0.1:9"]
"#,
            bad_file.display()
        ),
    );
    let good = dir.write(
        "good.toml",
        r#"[[listener]]
name = "main"
listen = "127.0.0.1:0"

[[route]]
name = "api"
upstream = "app"

[route.lua]
access = 'pier.resp.set_header("x", "1")'

[upstream.app]
servers = ["127.0.0.1:9"]
"#,
    );
    let check = |path: &std::path::Path| {
        let out = run_with_timeout(
            Command::new(bin()).arg("check").arg("-c").arg(path),
            Duration::from_secs(30),
        );
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        (out.status.code(), text)
    };
    let (code, text) = check(&inline);
    assert_eq!(code, Some(1), "{text}");
    assert!(text.contains("route api access:4:"), "{text}");
    assert!(text.contains("')' expected"), "{text}");

    let (code, text) = check(&from_file);
    assert_eq!(code, Some(1), "{text}");
    assert!(text.contains("bad.lua:2:"), "{text}");
    assert!(text.contains("unexpected symbol"), "{text}");

    let (code, text) = check(&good);
    assert_eq!(code, Some(0), "{text}");
}

/// A config whose `[lua] init` raises: how Pier starts with it, and a reload to it.
fn init_config(o: &Origin, init: &str, content: &str) -> String {
    base_config(
        &format!("[lua]\ninit = '''\n{init}\n'''\n"),
        &format!(
            "[[route]]\nname = \"c\"\npath = \"/c\"\n\n[route.lua]\ncontent = '''\n{content}\n'''\n\n[[route]]\nname = \"p\"\npath = \"/\"\nupstream = \"app\"\n\n[upstream.app]\nservers = {}\n",
            servers(&[o.addr()])
        ),
    )
}

#[test]
fn failing_init_at_start_is_visible() {
    let o = Origin::start();
    let cfg = init_config(
        &o,
        "local x = 1\nerror(\"init exploded\")",
        "pier.say(\"c\")",
    );
    match PierProcess::launch(bin(), Some(&cfg), &["serve", "-c", "{config}"]) {
        // Refusing to start is fine, if it says why.
        Err(out) => assert!(out.contains("init exploded"), "{out}"),
        // Starting is fine if Lua routes answer 500 and the log says why.
        Ok(p) => {
            let r = RawConn::connect(p.listener("main")).get("/c").unwrap();
            assert_local(&r, 500, "hook-error");
            wait_log(&p, &["init:2:", "init exploded"]);
        }
    }
}

/// nginx runs `init_by_lua` while loading the config, so a reload whose init fails is
/// refused and the old workers keep serving; Pier's docs say a bad reload is refused.
#[test]
fn reload_with_a_failing_init_is_refused() {
    let o = Origin::start();
    let mut p = pier(&init_config(&o, "GREETING = \"v1\"", "pier.say(GREETING)"));
    let r = RawConn::connect(p.listener("main")).get("/c").unwrap();
    assert_eq!(r.body_str(), "v1\n");
    p.rewrite_config(&init_config(
        &o,
        "GREETING = \"v2\"\nerror(\"init exploded\")",
        "pier.say(GREETING)",
    ));
    p.signal(sig::SIGHUP);
    let reloaded = p.try_wait_generation(2, Duration::from_secs(3));
    let r = RawConn::connect(p.listener("main")).get("/c").unwrap();
    assert_eq!(
        (r.status, r.body_str().as_str()),
        (200, "v1\n"),
        "reloaded: {reloaded}"
    );
    assert!(!reloaded, "the reload was accepted");
}

/// Issue 8: `pier.sleep(1e20)` in a hook used to panic the connection's task
/// and leak its connection and request slots, so that with
/// `max_connections = 4` four such requests left Pier refusing everyone.
/// Hostile numbers from Lua now end the request with 500 and release every
/// slot; the next clients are served.
#[test]
fn huge_sleep_costs_no_slot() {
    let o = Origin::start();
    let routes = route(
        "sleepy",
        "/sleepy/",
        &hook(
            "access",
            "local d = ({ ['1'] = 1e20, ['2'] = -1, ['3'] = 0/0, ['4'] = math.huge })[pier.req.get_uri_args().d or '1']\npier.sleep(d)",
        ),
    );
    let cfg = base_config(
        "[limits]\nmax_connections = 4\n",
        &format!(
            "{routes}[[route]]\nname = \"rest\"\nupstream = \"app\"\n\n[upstream.app]\nservers = {}\n",
            servers(&[o.addr()])
        ),
    );
    let p = pier(&cfg);
    for round in 0..3 {
        for d in 1..=4 {
            let r = RawConn::connect(p.listener("main"))
                .get(&format!("/sleepy/x?d={d}"))
                .unwrap();
            assert_eq!(r.status, 500, "round {round}, d={d}");
        }
    }
    assert_eq!(wait_metric(&p, "pier_active_connections", 0.0), Some(0.0));
    assert_eq!(wait_metric(&p, "pier_active_requests", 0.0), Some(0.0));
    assert_eq!(p.metric_value("pier_refused_connections_total"), Some(0.0));
    let r = RawConn::connect(p.listener("main")).get("/hello").unwrap();
    assert_eq!(r.status, 200);
}

/// `[lua] max_response_body` reaches the engine: a body past it is a hook
/// error, one within it is served.
#[test]
fn lua_body_bound_comes_from_config() {
    let s = scenario()
        .top("[lua]\nmax_response_body = \"1k\"\n")
        .routes(&route(
            "big",
            "/big/",
            &hook("content", "pier.say(string.rep('x', 2000))"),
        ))
        .routes(&route(
            "small",
            "/small/",
            &hook("content", "pier.say(string.rep('x', 500))"),
        ))
        .start();
    s.get("/big/x").expect_local(500, "hook-error");
    let r = s.get("/small/x").expect_status(200);
    assert_eq!(r.body.len(), 501);
}
