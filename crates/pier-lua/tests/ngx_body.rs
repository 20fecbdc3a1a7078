//! `ngx.req.read_body` (yields until the proxy has the body), `get_body_data`,
//! `get_post_args`, `raw_header`, `http_version` and their phase rules, against the
//! in-memory `TestView` (the proxy side is tested end to end in bin/pier/tests/lua_body.rs).

mod support;

use pier_lua::{Flow, RequestCtx, RouteHooks};
use support::*;

fn with_body(
    code: &str,
    body: Option<&[u8]>,
    ct: &str,
) -> (Result<Flow, pier_lua::LuaError>, TestView) {
    let e = access_engine(code);
    let mut v = TestView {
        method: b"POST".to_vec(),
        uri: b"/f".to_vec(),
        body: body.map(<[u8]>::to_vec),
        body_pending: 3,
        ..TestView::default()
    };
    v.headers
        .push((b"Content-Type".to_vec(), ct.as_bytes().to_vec()));
    if let Some(b) = body {
        v.headers
            .push((b"Content-Length".to_vec(), b.len().to_string().into_bytes()));
    }
    let mut ctx = RequestCtx::new();
    let r = run(e.access(0, &mut v, &mut ctx));
    (r, v)
}

#[test]
fn read_body_yields_then_sees_the_body() {
    let (r, v) = with_body(
        r#"
        assert(ngx.req.get_body_data() == nil)
        local ok, err = pcall(ngx.req.get_post_args)
        assert(not ok and err:find("no request body found", 1, true), err)
        ngx.req.read_body()
        assert(ngx.req.get_body_data() == "a=1&b=x%20y&a=2&c")
        assert(ngx.req.get_body_file() == nil)
        local args = ngx.req.get_post_args()
        assert(args.a[1] == "1" and args.a[2] == "2" and args.b == "x y" and args.c == true)
        local t, e = ngx.req.get_post_args(2)
        assert(e == "truncated" and t.a == "1" and t.b == "x y" and t.c == nil)
        ok, err = pcall(ngx.req.get_post_args, "x")
        assert(not ok and err:find("number expected", 1, true), err)
        ngx.req.discard_body()
        "#,
        Some(b"a=1&b=x%20y&a=2&c"),
        "application/x-www-form-urlencoded",
    );
    assert_eq!(r.unwrap(), Flow::Continue);
    assert!(v.body_read);
    assert_eq!(v.body_pending, 0, "the hook waited for the body");
}

#[test]
fn without_a_body_read_body_returns_and_post_args_are_empty() {
    let (r, _) = with_body(
        r#"
        ngx.req.read_body()
        assert(ngx.req.get_body_data() == nil)
        assert(next(ngx.req.get_post_args()) == nil)
        "#,
        None,
        "text/plain",
    );
    assert_eq!(r.unwrap(), Flow::Continue);
}

#[test]
fn raw_header_and_http_version() {
    let (r, _) = with_body(
        r#"
        local h = ngx.req.raw_header()
        assert(h:sub(1, 17) == "POST /f HTTP/1.1\r", h)
        assert(h:find("\r\nUser-Agent: curl/8.0\r\n", 1, true), h)
        assert(h:sub(-4) == "\r\n\r\n", h)
        local n = ngx.req.raw_header(true)
        assert(n:sub(1, 19) == "Host: example.test\r", n)
        assert(ngx.req.http_version() == 1.1)
        "#,
        Some(b"x"),
        "text/plain",
    );
    assert_eq!(r.unwrap(), Flow::Continue);
}

#[test]
fn body_calls_follow_ngx_phase_rules() {
    let e = engine(setup(RouteHooks {
        header_filter: src(
            "hf",
            r#"
            local ok, err = pcall(ngx.req.read_body)
            assert(not ok and err:find("API disabled", 1, true), err)
            ok, err = pcall(ngx.req.discard_body)
            assert(not ok and err:find("API disabled", 1, true), err)
            ngx.header["x-ok"] = "1"
            "#,
        ),
        ..Default::default()
    }));
    let mut v = TestView {
        status: 200,
        ..TestView::default()
    };
    let mut ctx = RequestCtx::new();
    e.header_filter(0, &mut v, &mut ctx).unwrap();
    assert_eq!(v.resp("x-ok").as_deref(), Some("1"));
}

#[test]
fn request_socket_reads_the_body_like_a_cosocket() {
    let body: &[u8] =
        b"--XB\r\nContent-Disposition: form-data; name=\"f\"\r\n\r\nhello world\r\n--XB--\r\ntail";
    let (r, v) = with_body(
        r#"
        local sock, err = ngx.req.socket(true)
        assert(sock == nil and err:find("raw", 1, true), err)
        sock = assert(ngx.req.socket())
        sock:settimeout(1000)
        assert(sock:receive("*l") == "--XB")
        assert(sock:receive() == 'Content-Disposition: form-data; name="f"')
        assert(sock:receive("*l") == "")
        -- lua-resty-upload's loop: pieces of at most 4 bytes, then nil at the boundary.
        local reader = sock:receiveuntil("\r\n--XB")
        local parts = {}
        while true do
          local data, e = reader(4)
          if not data then assert(e == nil, e) break end
          assert(#data <= 4)
          parts[#parts + 1] = data
        end
        assert(table.concat(parts) == "hello world", table.concat(parts, "|"))
        assert(sock:receive(2) == "--")
        local incl = sock:receiveuntil("\n", { inclusive = true })
        assert(incl() == "\r\n")
        assert(sock:receiveany(100) == "tail")
        local d, e2, partial = sock:receive(1)
        assert(d == nil and e2 == "closed" and partial == "")
        d, e2 = sock:receiveany(1)
        assert(d == nil and e2 == "closed")
        local ok, perr = pcall(sock.receive, sock, -1)
        assert(not ok and perr:find("bad pattern", 1, true), perr)
        -- A second socket over the same body starts again; a missing pattern ends "closed".
        local s2 = assert(ngx.req.socket())
        local r2 = s2:receiveuntil("nope")
        d, e2, partial = r2()
        assert(d == nil and e2 == "closed" and #partial == #ngx.req.get_body_data())
        "#,
        Some(body),
        "multipart/form-data; boundary=XB",
    );
    assert_eq!(r.unwrap(), Flow::Continue);
    assert!(v.body_read);
}

#[test]
fn request_socket_without_a_body() {
    let (r, _) = with_body(
        r#"
        local sock, err = ngx.req.socket()
        assert(sock == nil and err == "no body", err)
        "#,
        None,
        "text/plain",
    );
    assert_eq!(r.unwrap(), Flow::Continue);
}
