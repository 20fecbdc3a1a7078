//! Lua hooks at every phase, through a real Pier process and real origins: access
//! (read headers, deny, redirect, rewrite the URI and request headers), content (answers
//! without the origin), balancer (chooses the peer), upstream_request, header_filter,
//! body_filter (re-framed as chunked), log, `pier.ctx` across phases, `pier.var`,
//! `pier.now()`, and the two Lua examples.

mod common;

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use common::*;

/// Upstream `app` with these servers.
fn upstream(name: &str, addrs: &[std::net::SocketAddr]) -> String {
    format!("[upstream.{name}]\nservers = {}\n\n", servers(addrs))
}

fn req(p: &PierProcess, method: &str, path: &str, headers: &[(&str, &str)]) -> Response {
    RawConn::connect(p.listener("main"))
        .request(method, path, headers, b"")
        .unwrap_or_else(|e| panic!("{method} {path}: {e}\n{}", p.logs()))
}

fn access_reads_headers_denies_redirects_and_rewrites_over(p: Proto) {
    let access = r#"
local ua = pier.req.get_header("User-Agent")
if pier.req.get_header("X-Block") then
  pier.exit(403)
end
local path = pier.req.get_path()
if path == "/a/go" then
  pier.redirect("/elsewhere?x=1", 301)
end
if path == "/a/rewrite" then
  pier.req.set_uri("/a/rewritten/headers")
end
pier.req.set_header("X-From-Lua", "ua=" .. (ua or "none"))
pier.req.clear_header("X-Secret")
pier.resp.set_header("x-lua", "1")
"#;
    let s = scenario()
        .over(p)
        .routes(&lua_route("a", "/a/", "app", &hook("access", access)))
        .start();

    // Proxied, with a header the origin sees and one the client sees.
    let r = s
        .request(
            "GET",
            "/a/headers",
            &[("User-Agent", "tester/1.0"), ("X-Secret", "hunter2")],
            b"",
        )
        .expect_status(200)
        .expect_header("x-lua", "1");
    let seen = r.body_str().to_ascii_lowercase();
    assert!(seen.starts_with("get /a/headers http/1.1\r\n"), "{seen}");
    assert!(seen.contains("\r\nx-from-lua: ua=tester/1.0\r\n"), "{seen}");
    assert!(
        !seen.contains("hunter2"),
        "cleared header reached the origin: {seen}"
    );
    assert_eq!(s.origin_requests(), 1);

    // Denied: 403 from the hook, the origin never sees it.
    s.request("GET", "/a/hello", &[("X-Block", "yes")], b"")
        .expect_status(403);
    assert_eq!(s.origin_requests(), 1);

    // Redirect with the status asked for.
    s.get("/a/go")
        .expect_status(301)
        .expect_header("location", "/elsewhere?x=1");
    assert_eq!(s.origin_requests(), 1);

    // set_uri replaces the path the origin sees and keeps the query.
    s.get("/a/rewrite?q=1&r=two")
        .expect_status(200)
        .expect_body_prefix("GET /a/rewritten/headers?q=1&r=two HTTP/1.1\r\n");
    assert_eq!(s.origin_requests(), 2);
}

#[test]
fn access_reads_headers_denies_redirects_and_rewrites() {
    access_reads_headers_denies_redirects_and_rewrites_over(Proto::Http1)
}

#[test]
fn access_reads_headers_denies_redirects_and_rewrites_h3() {
    access_reads_headers_denies_redirects_and_rewrites_over(Proto::Http3)
}

/// Content routes: `/c/` (content before an upstream), `/teapot` (content only),
/// `/st/` (status from `pier.resp.set_status`).
/// Over `p`.
fn content_scenario(p: Proto) -> Running {
    let content = r#"
pier.resp.set_header("x-content", "yes")
pier.say("hello from ", pier.req.get_method(), " ", pier.req.get_path())
pier.print("arg a=", pier.req.get_uri_args().a)
"#;
    let teapot = r#"
pier.exit(418, "short and stout\n")
"#;
    let status = r#"
pier.resp.set_status(201)
pier.say("created")
"#;
    scenario()
        .over(p)
        // content first even though the route has an upstream.
        .routes(&lua_route("c", "/c/", "app", &hook("content", content)))
        .routes(&lua_route(
            "teapot",
            "/teapot",
            "",
            &hook("content", teapot),
        ))
        .routes(&lua_route("st", "/st/", "app", &hook("content", status)))
        .start()
}

fn content_answers_without_calling_the_origin_over(p: Proto) {
    let s = content_scenario(p);
    let mut conn = s.conn();
    for _ in 0..3 {
        conn.get("/c/x/y?a=7")
            .expect_status(200)
            .expect_header("x-content", "yes")
            .expect_body("hello from GET /c/x/y\narg a=7");
        conn.get("/teapot")
            .expect_status(418)
            .expect_body("short and stout\n");
    }
    assert_eq!(
        s.origin_requests(),
        0,
        "a content hook must not call the origin"
    );
    assert_eq!(s.origin().connections(), 0);
}

#[test]
fn content_answers_without_calling_the_origin() {
    content_answers_without_calling_the_origin_over(Proto::Http1)
}

#[test]
fn content_answers_without_calling_the_origin_h3() {
    content_answers_without_calling_the_origin_over(Proto::Http3)
}

/// docs/lua.md: "A `content` hook always answers (status: `pier.exit`'s, else
/// `pier.resp.set_status`'s, else 200)".
fn content_status_comes_from_resp_set_status_over(p: Proto) {
    let s = content_scenario(p);
    s.get("/st/x").expect_status(201).expect_body("created\n");
    assert_eq!(s.origin_requests(), 0);
}

#[test]
fn content_status_comes_from_resp_set_status() {
    content_status_comes_from_resp_set_status_over(Proto::Http1)
}

#[test]
fn content_status_comes_from_resp_set_status_h3() {
    content_status_comes_from_resp_set_status_over(Proto::Http3)
}

#[test]
fn balancer_chooses_the_peer() {
    let a = Origin::start_named("alpha");
    let b = Origin::start_named("beta");
    let bal = format!(
        r#"
pier.balancer.set_peer("127.0.0.1", {})
"#,
        b.addr().port()
    );
    let cfg = base_config(
        "",
        &format!(
            "{}{}{}",
            lua_route("bal", "/bal/", "two", &hook("balancer", &bal)),
            // The same upstream without the hook: round robin over both.
            "[[route]]\nname = \"rr\"\npath = \"/rr/\"\nupstream = \"two\"\n\n",
            upstream("two", &[a.addr(), b.addr()])
        ),
    );
    let p = pier(&cfg);
    for _ in 0..8 {
        let r = req(&p, "GET", "/bal/name", &[]);
        assert_eq!(r.status, 200, "{}", r.body_str());
        assert_eq!(r.body_str(), "beta");
    }
    assert_eq!(a.requests(), 0);
    let mut names: Vec<String> = (0..4)
        .map(|_| req(&p, "GET", "/rr/name", &[]).body_str())
        .collect();
    names.sort();
    names.dedup();
    assert_eq!(names, ["alpha", "beta"], "without the hook both serve");
}

fn upstream_request_edits_what_the_origin_gets_over(p: Proto) {
    let ur = r#"
pier.req.set_header("x-upstream-req", pier.req.get_method() .. " " .. pier.var.remote_addr)
pier.req.add_header("x-multi", "one")
pier.req.add_header("x-multi", "two")
"#;
    scenario()
        .over(p)
        .routes(&lua_route(
            "ur",
            "/ur/",
            "app",
            &hook("upstream_request", ur),
        ))
        .start()
        .get("/ur/headers")
        .expect_status(200)
        .expect_body_contains("\r\nx-upstream-req: GET 127.0.0.1\r\n")
        .expect_body_contains("\r\nx-multi: one\r\n")
        .expect_body_contains("\r\nx-multi: two\r\n");
}

#[test]
fn upstream_request_edits_what_the_origin_gets() {
    upstream_request_edits_what_the_origin_gets_over(Proto::Http1)
}

#[test]
fn upstream_request_edits_what_the_origin_gets_h3() {
    upstream_request_edits_what_the_origin_gets_over(Proto::Http3)
}

fn header_filter_sets_clears_and_changes_status_over(p: Proto) {
    let hf = r#"
pier.resp.set_header("x-hf", tostring(pier.resp.get_status()) .. " " .. (pier.resp.get_header("x-origin") or "none"))
pier.resp.clear_header("x-origin")
pier.resp.add_header("x-added", "a")
pier.resp.add_header("x-added", "b")
pier.resp.set_status(202)
"#;
    let s = scenario()
        .over(p)
        .origin_named("orig")
        .routes(&lua_route("hf", "/hf/", "app", &hook("header_filter", hf)))
        .start();
    let mut conn = s.conn();
    for _ in 0..2 {
        let r = conn
            .get("/hf/hello")
            .expect_status(202)
            .expect_header("x-hf", "200 orig")
            .expect_no_header("x-origin")
            .expect_body("hello world\n");
        assert_eq!(r.header_all("x-added"), ["a", "b"]);
    }
}

#[test]
fn header_filter_sets_clears_and_changes_status() {
    header_filter_sets_clears_and_changes_status_over(Proto::Http1)
}

#[test]
fn header_filter_sets_clears_and_changes_status_h3() {
    header_filter_sets_clears_and_changes_status_over(Proto::Http3)
}

#[test]
fn body_filter_uppercases_and_reframes_as_chunked() {
    let o = Origin::start();
    let bf = r#"
local c = pier.arg[1] or ""
c = c:upper()
if pier.arg[2] then
  c = c .. "[eof]"
end
pier.arg[1] = c
"#;
    let cfg = base_config(
        "",
        &format!(
            "{}{}",
            lua_route("bf", "/bf/", "app", &hook("body_filter", bf)),
            upstream("app", &[o.addr()])
        ),
    );
    let p = pier(&cfg);
    let mut conn = RawConn::connect(p.listener("main"));
    let r = conn.get("/bf/hello").unwrap();
    assert_eq!(r.status, 200);
    assert!(
        r.chunked,
        "a filtered body is re-framed as chunked: {:?}",
        r.headers
    );
    assert_eq!(r.header("content-length"), None);
    assert_eq!(r.body_str(), "HELLO WORLD\n[eof]");

    // A body in many pieces, on the same connection (the framing must be exact).
    const N: usize = 300_000;
    let r = conn.get(&format!("/bf/bytes/{N}")).unwrap();
    assert_eq!(r.status, 200);
    assert!(r.chunked);
    let mut want = pattern(0, N).to_ascii_uppercase();
    want.extend_from_slice(b"[eof]");
    assert_eq!(r.body.len(), want.len());
    assert!(r.body == want, "uppercased pattern body differs");

    // A chunked origin body too, and the connection is still usable.
    let r = conn.get("/bf/chunked/5000").unwrap();
    assert!(r.chunked);
    let mut want = pattern(0, 5000).to_ascii_uppercase();
    want.extend_from_slice(b"[eof]");
    assert!(r.body == want, "uppercased chunked body differs");
    let r = conn.get("/bf/hello").unwrap();
    assert_eq!(r.body_str(), "HELLO WORLD\n[eof]");
}

fn log_phase_writes_a_shared_dict_a_later_request_reads_over(p: Proto) {
    let log = r#"
pier.shared.logd:incr("n", 1, 0)
pier.shared.logd:set("last", pier.var.uri .. " " .. tostring(pier.var.status))
"#;
    let read = r#"
pier.say(pier.shared.logd:get("last") or "none", " ", pier.shared.logd:get("n") or 0)
"#;
    let s = scenario()
        .over(p)
        .top("[lua.shared]\nlogd = \"1m\"\n")
        .routes(&lua_route("lg", "/lg/", "app", &hook("log", log)))
        .routes(&lua_route("read", "/read", "", &hook("content", read)))
        .start();
    s.get("/read").expect_body("none 0\n");
    s.get("/lg/hello").expect_status(200);
    // The log phase runs after the response: poll (bounded).
    s.wait_body("/read", "/lg/hello 200 1\n");
    s.get("/lg/status/404").expect_status(404);
    s.wait_body("/read", "/lg/status/404 404 2\n");
}

#[test]
fn log_phase_writes_a_shared_dict_a_later_request_reads() {
    log_phase_writes_a_shared_dict_a_later_request_reads_over(Proto::Http1)
}

#[test]
fn log_phase_writes_a_shared_dict_a_later_request_reads_h3() {
    log_phase_writes_a_shared_dict_a_later_request_reads_over(Proto::Http3)
}

#[test]
fn ctx_is_carried_from_access_to_header_filter() {
    let o = Origin::start();
    let access = r#"
pier.ctx.tag = pier.req.get_header("x-tag") or "none"
pier.ctx.n = 40
"#;
    let bal = r#"
pier.ctx.n = pier.ctx.n + 1
"#;
    let hf = r#"
pier.ctx.n = pier.ctx.n + 1
pier.resp.set_header("x-ctx", pier.ctx.tag .. ":" .. pier.ctx.n)
"#;
    let cfg = base_config(
        "",
        &format!(
            "{}{}",
            lua_route(
                "ctx",
                "/ctx/",
                "app",
                &format!(
                    "{}{}{}",
                    hook("access", access),
                    hook("balancer", bal),
                    hook("header_filter", hf)
                )
            ),
            upstream("app", &[o.addr()])
        ),
    );
    let p = pier(&cfg);
    let mut conn = RawConn::connect(p.listener("main"));
    for tag in ["abc", "def", "ghi"] {
        let r = conn
            .request("GET", "/ctx/hello", &[("x-tag", tag)], b"")
            .unwrap();
        assert_eq!(r.status, 200, "{}", r.body_str());
        assert_eq!(r.header("x-ctx"), Some(format!("{tag}:42").as_str()));
    }
    // A fresh request gets a fresh ctx.
    let r = req(&p, "GET", "/ctx/hello", &[]);
    assert_eq!(r.header("x-ctx"), Some("none:42"));
}

#[test]
fn var_and_now_describe_the_request() {
    let vars = r#"
local v = pier.var
pier.say(v.remote_addr, "|", v.host, "|", v.uri, "|", v.request_uri, "|",
  v.request_method, "|", v.args or "nil", "|", v.http_x_thing or "nil", "|",
  v.scheme, "|", v.server_port, "|", v.no_such_var == nil)
pier.say(string.format("%.3f", pier.now()))
"#;
    let cfg = base_config("", &lua_route("vars", "/vars/", "", &hook("content", vars)));
    let p = pier(&cfg);
    let port = p.listener("main").port();
    let before = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_secs_f64();
    let r = req(&p, "GET", "/vars/x?a=1&b=2", &[("X-Thing", "val")]);
    let after = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_secs_f64();
    assert_eq!(r.status, 200, "{}", r.body_str());
    let body = r.body_str();
    let mut lines = body.lines();
    assert_eq!(
        lines.next().unwrap(),
        format!("127.0.0.1|pier.test|/vars/x|/vars/x?a=1&b=2|GET|a=1&b=2|val|http|{port}|true")
    );
    let now: f64 = lines.next().unwrap().parse().unwrap();
    // Millisecond precision, within the request's lifetime (with slack for rounding).
    assert!(
        now >= before - 0.01 && now <= after + 0.01,
        "pier.now() {now} not within [{before}, {after}]"
    );
}

/// Pier on `examples/NAME`, its listener, admin and origin given as the example's
/// environment variables say.
fn example(name: &str, o: &Origin) -> PierProcess {
    let text = std::fs::read_to_string(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../../examples")
            .join(name),
    )
    .unwrap();
    let origin = o.addr().to_string();
    PierProcess::launch_env(
        bin(),
        Some(&text),
        &["serve", "-c", "{config}"],
        &[
            ("PIER_LISTEN", "127.0.0.1:0"),
            ("PIER_ADMIN", "127.0.0.1:0"),
            ("PIER_ORIGIN", &origin),
        ],
    )
    .unwrap_or_else(|e| panic!("{name}: {e}"))
}

#[test]
fn example_lua_access_runs_as_documented() {
    let o = Origin::start();
    let p = example("lua-access.toml", &o);
    let r = req(&p, "GET", "/hello", &[("User-Agent", "curl/8")]);
    assert_eq!(r.status, 200);
    assert_eq!(r.header("x-lua"), Some("1"));
    assert_eq!(r.body_str(), "hello world\n");
    let r = req(&p, "GET", "/hello", &[("X-Block", "1")]);
    assert_eq!(r.status, 403);
    assert_eq!(o.requests(), 1);
}

#[test]
fn example_lua_ratelimit_answers_429_past_ten_per_second() {
    let o = Origin::start();
    let p = example("lua-ratelimit.toml", &o);
    // 25 quick requests span at most two one-second windows (checked below), each
    // letting 10 through: 10 to 20 pass, the rest are refused.
    let mut conn = RawConn::connect(p.listener("main"));
    let t0 = std::time::Instant::now();
    let statuses: Vec<u16> = (0..25)
        .map(|_| conn.get("/hello").unwrap().status)
        .collect();
    if t0.elapsed() < Duration::from_millis(900) {
        let refused = statuses.iter().filter(|s| **s == 429).count();
        let ok = statuses.iter().filter(|s| **s == 200).count();
        assert_eq!(refused + ok, 25, "{statuses:?}");
        assert!((5..=15).contains(&refused), "{statuses:?}");
        assert!(ok >= 10, "{statuses:?}");
        assert_eq!(o.requests() as usize, ok);
    }
}

#[test]
fn access_flow_variants_and_request_api() {
    let o = Origin::start();
    let access = r#"
local path = pier.req.get_path()
pier.resp.set_header("x-lua", "1")
if pier.req.get_header("X-Block") then
  pier.exit(403, "blocked\n")
end
if path == "/f/say" then
  pier.say("from access")
  return
end
if path == "/f/redirect" then
  pier.redirect("https://example.test/")
end
if path == "/f/headers" then
  local h = pier.req.get_headers()
  local multi = h["x-multi"]
  pier.req.set_header("x-seen", table.concat({
    type(multi) == "table" and table.concat(multi, "+") or tostring(multi),
    h.x_under or "nil",
    h["X-UNDER"] or "nil",
  }, ","))
  local args = pier.req.get_uri_args()
  local list = args.k
  pier.req.set_uri_args({ count = type(list) == "table" and #list or 0, flag = tostring(args.flag), sp = "a b&c" })
end
pier.exit(pier.OK)
pier.resp.set_header("x-unreachable", "1")
"#;
    let cfg = base_config(
        "",
        &format!(
            "{}{}",
            lua_route("f", "/f/", "app", &hook("access", access)),
            upstream("app", &[o.addr()])
        ),
    );
    let p = pier(&cfg);

    // Response headers set before pier.exit go out with the hook's own response.
    let r = req(&p, "GET", "/f/hello", &[("X-Block", "1")]);
    assert_eq!(r.status, 403);
    assert_eq!(r.header("x-lua"), Some("1"));
    assert_eq!(r.body_str(), "blocked\n");

    // An access hook that buffered output answers 200 with it.
    let r = req(&p, "GET", "/f/say", &[]);
    assert_eq!(r.status, 200);
    assert_eq!(r.body_str(), "from access\n");
    assert_eq!(r.header("x-lua"), Some("1"));

    // pier.redirect defaults to 302.
    let r = req(&p, "GET", "/f/redirect", &[]);
    assert_eq!(r.status, 302);
    assert_eq!(r.header("location"), Some("https://example.test/"));
    assert_eq!(o.requests(), 0);

    // pier.exit(pier.OK) ends the hook (the line after it never runs) and proxies.
    let r = req(&p, "GET", "/f/hello", &[]);
    assert_eq!(r.status, 200);
    assert_eq!(r.body_str(), "hello world\n");
    assert_eq!(r.header("x-lua"), Some("1"));
    assert_eq!(r.header("x-unreachable"), None);

    // get_headers (repeated names as a list, `_` for `-`, any case), get_uri_args
    // (repeated keys, bare flags) and set_uri_args (encoded) as the origin sees them.
    let r = req(
        &p,
        "GET",
        "/f/headers?k=1&k=2&k=3&flag",
        &[("X-Multi", "a"), ("X-Multi", "b"), ("X-Under", "u")],
    );
    assert_eq!(r.status, 200);
    let seen = r.body_str();
    let line1 = seen.lines().next().unwrap();
    assert!(line1.starts_with("GET /f/headers?"), "{seen}");
    let query = line1
        .trim_start_matches("GET /f/headers?")
        .trim_end_matches(" HTTP/1.1");
    let mut pairs: Vec<&str> = query.split('&').collect();
    pairs.sort_unstable();
    assert_eq!(pairs, ["count=3", "flag=true", "sp=a%20b%26c"], "{seen}");
    assert!(
        seen.to_ascii_lowercase()
            .contains("\r\nx-seen: a+b,u,u\r\n"),
        "{seen}"
    );
}

#[test]
fn body_filter_with_head_http10_and_an_error_mid_body() {
    let o = Origin::start();
    let bf = r#"
local c = pier.arg[1]
if c and pier.req.get_header("x-fail") and #c > 0 then
  error("filter broke")
end
if c then pier.arg[1] = c:upper() end
"#;
    let cfg = base_config(
        "",
        &format!(
            "{}{}",
            lua_route("bf", "/bf/", "app", &hook("body_filter", bf)),
            upstream("app", &[o.addr()])
        ),
    );
    let p = pier(&cfg);
    let mut conn = RawConn::connect(p.listener("main"));
    // HEAD: no body to filter, and the connection stays in sync.
    let r = conn.request("HEAD", "/bf/hello", &[], b"").unwrap();
    assert_eq!(r.status, 200);
    assert!(r.body.is_empty());
    let r = conn.get("/bf/status/204").unwrap();
    assert_eq!(r.status, 204);
    let r = conn.get("/bf/hello").unwrap();
    assert_eq!(r.body_str(), "HELLO WORLD\n");

    // HTTP/1.0 cannot read chunked: the filtered body is close-delimited.
    let mut c10 = RawConn::connect(p.listener("main"));
    c10.send(b"GET /bf/hello HTTP/1.0\r\nHost: pier.test\r\n\r\n");
    let r = c10.read_response().unwrap();
    assert_eq!(r.status, 200);
    assert!(!r.chunked && r.close_delimited, "{:?}", r.headers);
    assert_eq!(r.body_str(), "HELLO WORLD\n");

    // An error after the head went out: the response cannot become a 500, so the
    // body must not look complete (no final chunk), and the error is logged.
    let mut bad = RawConn::connect(p.listener("main"));
    let res = bad.request("GET", "/bf/bytes/100000", &[("x-fail", "1")], b"");
    match res {
        Ok(r) => assert_eq!(
            r.status, 500,
            "a failed body filter produced a complete {} response of {} bytes",
            r.status, r.body_len
        ),
        Err(e) => assert_eq!(e.kind(), std::io::ErrorKind::UnexpectedEof, "{e}"),
    }
    let ok = wait_until(Duration::from_secs(5), || {
        p.logs().contains("route bf body_filter:4: filter broke")
    });
    assert!(ok, "{}", p.logs());
    // Pier goes on.
    let r = req(&p, "GET", "/bf/hello", &[]);
    assert_eq!(r.body_str(), "HELLO WORLD\n");
}

fn log_phase_runs_for_hook_answers_too_over(p: Proto) {
    let access = r#"
if pier.req.get_header("x-deny") then pier.exit(401) end
"#;
    let log = r#"
pier.shared.seen:set("last", pier.var.request_uri .. " " .. tostring(pier.var.status))
"#;
    let read = r#"
pier.print(pier.shared.seen:get("last") or "none")
"#;
    let s = scenario()
        .over(p)
        .top("[lua.shared]\nseen = \"64k\"\n")
        .routes(&lua_route(
            "l",
            "/l/",
            "app",
            &format!("{}{}", hook("access", access), hook("log", log)),
        ))
        .routes(&lua_route("read", "/read", "", &hook("content", read)))
        .start();
    s.request("GET", "/l/hello?x=1", &[("x-deny", "1")], b"")
        .expect_status(401);
    // After a hook's 401, and after a proxied 503.
    s.wait_body("/read", "/l/hello?x=1 401");
    s.get("/l/status/503").expect_status(503);
    s.wait_body("/read", "/l/status/503 503");
}

#[test]
fn log_phase_runs_for_hook_answers_too() {
    log_phase_runs_for_hook_answers_too_over(Proto::Http1)
}

#[test]
fn log_phase_runs_for_hook_answers_too_h3() {
    log_phase_runs_for_hook_answers_too_over(Proto::Http3)
}

#[test]
fn init_file_and_pier_log() {
    let dir = TempDir::new();
    let init = dir.write(
        "init.lua",
        "function GREET(who) return \"hello, \" .. who end\nSTARTED_PHASE = pier.get_phase()\n",
    );
    let content = r#"
pier.log(pier.WARN, "greeting ", pier.req.get_uri_args().who)
pier.say(GREET(pier.req.get_uri_args().who), " ", STARTED_PHASE, " ", pier.get_phase())
"#;
    let top = format!("[lua]\ninit_file = \"{}\"\n", init.display());
    let cfg = base_config(&top, &lua_route("g", "/g", "", &hook("content", content)));
    let p = pier(&cfg);
    let r = req(&p, "GET", "/g?who=pier", &[]);
    assert_eq!(r.status, 200, "{}", r.body_str());
    assert_eq!(r.body_str(), "hello, pier init content\n");
    // pier.log goes to Pier's log with the hook's chunk name and line.
    let ok = wait_until(Duration::from_secs(5), || {
        p.logs().contains("route g content:2: greeting pier")
    });
    assert!(ok, "{}", p.logs());
}

/// docs/config.md: `[lua] package_path` adds `package.path` patterns for `require`.
#[test]
fn package_path_lets_hooks_require_modules() {
    let dir = TempDir::new();
    std::fs::create_dir_all(dir.path().join("lua")).unwrap();
    dir.write(
        "lua/greeter.lua",
        "local M = {}\nfunction M.greet(who) return \"hello, \" .. who end\nreturn M\n",
    );
    let content = r#"
local greeter = require("greeter")
pier.say(greeter.greet(pier.req.get_uri_args().who))
"#;
    let top = format!(
        "[lua]\npackage_path = [\"{}/lua/?.lua\"]\n",
        dir.path().display()
    );
    let cfg = base_config(&top, &lua_route("g", "/g", "", &hook("content", content)));
    let p = pier(&cfg);
    let r = req(&p, "GET", "/g?who=pier", &[]);
    assert_eq!(r.status, 200, "{}", r.body_str());
    assert_eq!(r.body_str(), "hello, pier\n");
}

/// docs/config.md: "an allocation past it fails (the hook errors, the request gets 500)";
/// docs/lua.md: "raises \"not enough memory\" in that hook only".
#[test]
fn memory_limit_fails_only_the_greedy_request() {
    let greedy = r#"
local t = {}
for i = 1, 1e7 do
  t[i] = string.rep("x", 64) .. i
end
pier.say(#t)
"#;
    let modest = r#"
pier.say("fine")
"#;
    let cfg = base_config(
        "[lua]\nmemory_limit = \"8m\"\n",
        &format!(
            "{}{}",
            lua_route("greedy", "/greedy", "", &hook("content", greedy)),
            lua_route("modest", "/modest", "", &hook("content", modest))
        ),
    );
    let p = pier(&cfg);
    let mut conn = RawConn::connect(p.listener("main"));
    let r = conn.get("/modest").unwrap();
    assert_eq!(r.status, 200, "before: {}", r.body_str());
    for _ in 0..2 {
        let r = conn.get("/greedy").unwrap();
        assert_local(&r, 500, "hook-error");
        let r = conn.get("/modest").unwrap();
        assert_eq!(r.status, 200);
        assert_eq!(r.body_str(), "fine\n");
    }
    assert!(p.logs().contains("not enough memory"), "{}", p.logs());
}

#[test]
fn ctx_reaches_body_filter_and_log() {
    let o = Origin::start();
    let access = r#"
pier.ctx.id = pier.req.get_uri_args().id
pier.ctx.bytes = 0
"#;
    let bf = r#"
local c = pier.arg[1]
if c then pier.ctx.bytes = pier.ctx.bytes + #c end
if pier.arg[2] then
  pier.arg[1] = (c or "") .. "[" .. pier.ctx.id .. "]"
end
"#;
    let log = r#"
pier.shared.ctxlog:set(pier.ctx.id, pier.ctx.bytes)
"#;
    let cfg = base_config(
        "[lua.shared]\nctxlog = \"64k\"\n",
        &format!(
            "{}{}{}",
            lua_route(
                "c",
                "/c/",
                "app",
                &format!(
                    "{}{}{}",
                    hook("access", access),
                    hook("body_filter", bf),
                    hook("log", log)
                )
            ),
            lua_route(
                "read",
                "/read",
                "",
                &hook(
                    "content",
                    "pier.print(tostring(pier.shared.ctxlog:get(pier.req.get_uri_args().id)))"
                )
            ),
            upstream("app", &[o.addr()])
        ),
    );
    let p = pier(&cfg);
    let mut conn = RawConn::connect(p.listener("main"));
    for (id, n) in [("a", 10usize), ("b", 70_000), ("c", 0)] {
        let r = conn.get(&format!("/c/bytes/{n}?id={id}")).unwrap();
        assert_eq!(r.status, 200);
        let mut want = pattern(0, n);
        want.extend_from_slice(format!("[{id}]").as_bytes());
        assert!(r.body == want, "body of {id}");
        let mut last = String::new();
        let ok = wait_until(Duration::from_secs(5), || {
            last = req(&p, "GET", &format!("/read?id={id}"), &[]).body_str();
            last == n.to_string()
        });
        assert!(ok, "log saw ctx.bytes {last:?} for {id}, want {n}");
    }
}

/// OpenResty runs header_filter and body_filter on every response, including those
/// produced by content handlers; Pier's docs put header_filter at "response head".
#[test]

fn filters_run_on_responses_made_by_hooks() {
    let hf = r#"
pier.resp.set_header("x-hf", tostring(pier.resp.get_status()))
"#;
    let bf = r#"
if pier.arg[1] then pier.arg[1] = pier.arg[1]:upper() end
"#;
    let cfg = base_config(
        "",
        &lua_route(
            "c",
            "/c",
            "",
            &format!(
                "{}{}{}",
                hook("content", "pier.say(\"made by content\")"),
                hook("header_filter", hf),
                hook("body_filter", bf)
            ),
        ),
    );
    let p = pier(&cfg);
    let r = req(&p, "GET", "/c", &[]);
    assert_eq!(r.status, 200);
    assert_eq!(r.header("x-hf"), Some("200"), "{:?}", r.headers);
    assert_eq!(r.body_str(), "MADE BY CONTENT\n");
}

#[test]
fn upstream_request_and_balancer_may_yield_and_answer() {
    let a = Origin::start_named("alpha");
    let b = Origin::start_named("beta");
    let bal = format!(
        r#"
pier.sleep(0.01)
if pier.req.get_header("x-beta") then
  pier.balancer.set_peer("127.0.0.1", {})
end
"#,
        b.addr().port()
    );
    let ur = r#"
pier.sleep(0.01)
if pier.req.get_header("x-deny") then
  pier.exit(401, "denied late\n")
end
pier.req.set_header("x-late", "yes")
"#;
    let cfg = base_config(
        "",
        &format!(
            "{}{}",
            lua_route(
                "y",
                "/",
                "one",
                &format!("{}{}", hook("balancer", &bal), hook("upstream_request", ur))
            ),
            upstream("one", &[a.addr()])
        ),
    );
    let p = pier(&cfg);
    let mut conn = RawConn::connect(p.listener("main"));
    let r = conn.get("/name").unwrap();
    assert_eq!(r.body_str(), "alpha");
    // The balancer may pick a server outside the upstream's list.
    let r = conn
        .request("GET", "/name", &[("x-beta", "1")], b"")
        .unwrap();
    assert_eq!(r.body_str(), "beta");
    let r = conn.get("/headers").unwrap();
    assert!(
        r.body_str()
            .to_ascii_lowercase()
            .contains("\r\nx-late: yes\r\n"),
        "{}",
        r.body_str()
    );
    let before = a.requests() + b.requests();
    let r = conn
        .request("GET", "/name", &[("x-deny", "1")], b"")
        .unwrap();
    assert_eq!((r.status, r.body_str().as_str()), (401, "denied late\n"));
    assert_eq!(a.requests() + b.requests(), before);
    // Still in sync after the hook's answer.
    let r = conn.get("/name").unwrap();
    assert_eq!(r.body_str(), "alpha");
}
