//! `ngx.req.read_body` and friends through a real Pier process: the hook sees the whole
//! body (Content-Length, chunked, HTTP/2, `Expect: 100-continue`), the origin still gets
//! it byte for byte, a body over `max_buffered_body_bytes` gets 413, bodies no hook reads
//! still stream past that bound, and `ngx.req.raw_header` gives the head as received.

mod common;

use common::*;
use std::time::Duration;

/// The buffering bound the tests use.
const CAP: usize = 64 * 1024;

/// `access` on `/rb/` reads the body and reports what it saw in response headers; the
/// origin's `/echo` sends back what it received. `/late/` reads it in `content` and
/// answers it itself. `/stream/` has a hook that never reads the body. `/raw/` answers
/// `ngx.req.raw_header()`.
fn config() -> (Origin, PierProcess) {
    config_with(CAP)
}

fn config_with(cap: usize) -> (Origin, PierProcess) {
    let o = Origin::start();
    let cfg = format!(
        r#"[server]
workers = 1
grace_period = "5s"

[admin]
listen = "127.0.0.1:0"

[log]
access = "off"

[limits]
max_buffered_body_bytes = "{cap}"

[[listener]]
name = "main"
listen = "127.0.0.1:0"
h2c = true

[[route]]
name = "rb"
path = "/rb/"
upstream = "app"
[route.lua]
access = '''
ngx.req.read_body()
local d = ngx.req.get_body_data()
ngx.header["x-body-len"] = d and #d or "nil"
ngx.header["x-body-file"] = tostring(ngx.req.get_body_file())
local ct = ngx.var.http_content_type or ""
if ct:find("urlencoded", 1, true) then
  local args, err = ngx.req.get_post_args(3)
  local a = args.a
  if type(a) == "table" then a = table.concat(a, ",") end
  ngx.header["x-post-a"] = tostring(a)
  ngx.header["x-post-err"] = tostring(err)
end
'''
header_filter = '''
ngx.header["x-hf-len"] = #(ngx.req.get_body_data() or "")
'''

[[route]]
name = "late"
path = "/late/"
[route.lua]
content = '''
local before = ngx.req.get_body_data()
ngx.req.read_body()
ngx.req.read_body()
local d = ngx.req.get_body_data()
ngx.header["x-before"] = tostring(before)
ngx.print(d or "<nil>")
'''

[[route]]
name = "stream"
path = "/stream/"
upstream = "app"
[route.lua]
access = '''
ngx.header["x-body-data"] = tostring(ngx.req.get_body_data())
local ok, err = pcall(ngx.req.get_post_args)
ngx.header["x-post-err"] = tostring(err):sub(1, 40)
'''

[[route]]
name = "raw"
path = "/raw/"
[route.lua]
content = '''
ngx.header["x-ver"] = tostring(ngx.req.http_version())
if ngx.var.arg_nrl then
  ngx.print(ngx.req.raw_header(true))
else
  ngx.print(ngx.req.raw_header())
end
'''

[[route]]
name = "up"
path = "/up/"
[route.lua]
content = '''
local ct = ngx.var.http_content_type or ""
local boundary = ct:match("boundary=([^;]+)")
local sock = assert(ngx.req.socket())
sock:settimeout(5000)
assert(sock:receive("*l") == "--" .. boundary)
local name
while true do
  local line = assert(sock:receive("*l"))
  if line == "" then break end
  name = line:match('filename="([^"]+)"') or name
end
local reader = sock:receiveuntil("\r\n--" .. boundary)
local n, parts = 0, {{}}
while true do
  local data, err = reader(4096)
  if not data then assert(not err, err) break end
  n = n + 1
  parts[#parts + 1] = data
end
ngx.header["x-file"] = name
ngx.header["x-pieces"] = n
ngx.print(table.concat(parts))
'''

[upstream.app]
servers = ["{}"]
"#,
        o.addr()
    );
    let p = pier(&cfg);
    (o, p)
}

fn body_of(n: usize) -> Vec<u8> {
    pattern(0, n)
}

fn post(c: &mut RawConn, path: &str, headers: &[(&str, &str)], body: &[u8]) -> Response {
    c.request("POST", path, headers, body).unwrap()
}

#[test]
fn read_body_sees_the_whole_body_and_the_origin_still_gets_it() {
    let (_o, p) = config();
    let mut c = RawConn::connect(p.listener("main"));
    // Several sizes on one keep-alive connection: 1 byte, a few KiB, just under the cap.
    for n in [1, 3000, 20_000, CAP - 1] {
        let body = body_of(n);
        let r = post(&mut c, "/rb/echo", &[], &body);
        assert_eq!(r.status, 200, "{n}: {}", p.logs());
        assert_eq!(r.header("x-body-len"), Some(n.to_string().as_str()), "{n}");
        assert_eq!(r.header("x-body-file"), Some("nil"));
        assert_eq!(r.header("x-hf-len"), Some(n.to_string().as_str()), "{n}");
        assert_eq!(r.body.len(), n);
        assert!(r.body == body, "{n}: origin got other bytes");
    }
    // No body: nothing to read, get_body_data is nil (as ngx_lua's).
    let r = c.request("GET", "/rb/echo", &[], b"").unwrap();
    assert_eq!(r.status, 200);
    assert_eq!(r.header("x-body-len"), Some("nil"));
    // Form bodies: get_post_args, repeated names, truncation at max_args.
    let r = post(
        &mut c,
        "/rb/echo",
        &[("Content-Type", "application/x-www-form-urlencoded")],
        b"a=1&b=%20x&a=3",
    );
    assert_eq!(r.header("x-post-a"), Some("1,3"));
    assert_eq!(r.header("x-post-err"), Some("nil"));
    assert_eq!(r.body, b"a=1&b=%20x&a=3");
    let r = post(
        &mut c,
        "/rb/echo",
        &[("Content-Type", "application/x-www-form-urlencoded")],
        b"a=1&b=2&c=3&a=4",
    );
    assert_eq!(r.header("x-post-err"), Some("truncated"));
    assert_eq!(r.header("x-post-a"), Some("1"));
}

#[test]
fn chunked_body_is_read_and_forwarded_with_its_trailers() {
    let (_o, p) = config();
    let mut c = RawConn::connect(p.listener("main"));
    let want: Vec<u8> = body_of(5000);
    let mut raw =
        b"POST /rb/echo HTTP/1.1\r\nhost: t\r\ntransfer-encoding: chunked\r\n\r\n".to_vec();
    for part in want.chunks(1700) {
        raw.extend_from_slice(format!("{:x}\r\n", part.len()).as_bytes());
        raw.extend_from_slice(part);
        raw.extend_from_slice(b"\r\n");
    }
    raw.extend_from_slice(b"0\r\nx-sum: 42\r\n\r\n");
    // In two writes: the hook waits for the rest.
    let (a, b) = raw.split_at(raw.len() / 2);
    c.send(a);
    c.send(b);
    let r = c.read_response().unwrap();
    assert_eq!(r.status, 200, "{}", p.logs());
    assert_eq!(r.header("x-body-len"), Some("5000"));
    assert!(r.body == want);
    assert_eq!(r.trailer("x-sum"), Some("42"), "{r:?}");
    // The connection carries on; an empty chunked body reads as nil (as ngx_lua's).
    let r = c.get("/rb/hello").unwrap();
    assert_eq!(r.status, 200);
    c.send(b"POST /rb/echo HTTP/1.1\r\nhost: t\r\ntransfer-encoding: chunked\r\n\r\n0\r\n\r\n");
    let r = c.read_response().unwrap();
    assert_eq!(r.status, 200);
    assert_eq!(r.header("x-body-len"), Some("nil"));
    assert!(r.body.is_empty());
}

#[test]
fn over_the_bound_is_413_unless_no_hook_reads_it() {
    let (o, p) = config();
    let big = body_of(CAP + 1);
    // Content-Length over the bound: 413 without reading it, nothing upstream.
    let before = o.requests();
    let mut c = RawConn::connect(p.listener("main"));
    let r = post(&mut c, "/rb/echo", &[], &big);
    assert_local(&r, 413, "body-too-large");
    assert_eq!(o.requests(), before);
    // Chunked, found too large while reading.
    let mut c = RawConn::connect(p.listener("main"));
    let mut raw =
        b"POST /rb/echo HTTP/1.1\r\nhost: t\r\ntransfer-encoding: chunked\r\n\r\n".to_vec();
    for part in big.chunks(16 * 1024) {
        raw.extend_from_slice(format!("{:x}\r\n", part.len()).as_bytes());
        raw.extend_from_slice(part);
        raw.extend_from_slice(b"\r\n");
    }
    raw.extend_from_slice(b"0\r\n\r\n");
    c.send(&raw);
    let r = c.read_response().unwrap();
    assert_local(&r, 413, "body-too-large");
    assert!(c.is_closed(Duration::from_secs(5)));
    assert_eq!(o.requests(), before);
    // A route whose hook does not read it streams it, past the bound.
    let body = body_of(4 * CAP);
    let mut c = RawConn::connect(p.listener("main"));
    let r = post(&mut c, "/stream/echo", &[], &body);
    assert_eq!(r.status, 200);
    assert!(r.body == body);
    assert_eq!(r.header("x-body-data"), Some("nil"));
    assert_eq!(
        r.header("x-post-err"),
        Some("no request body found; maybe you should")
    );
}

#[test]
fn content_reads_the_body_and_the_connection_is_kept() {
    let (o, p) = config();
    let mut c = RawConn::connect(p.listener("main"));
    for n in [0usize, 10, 40_000] {
        let body = body_of(n);
        let r = post(&mut c, "/late/x", &[], &body);
        assert_eq!(r.status, 200, "{}", p.logs());
        assert_eq!(r.header("x-before"), Some("nil"));
        if n == 0 {
            assert_eq!(r.body, b"<nil>");
        } else {
            assert!(r.body == body, "{n}");
        }
    }
    assert_eq!(o.requests(), 0);
    // Expect: 100-continue: Pier says 100 itself before reading, as nginx does.
    let dir = TempDir::new();
    let file = dir.path().join("in");
    std::fs::write(&file, body_of(30_000)).unwrap();
    let out = curl(&[
        "-H",
        "Expect: 100-continue",
        "--expect100-timeout",
        "20",
        "--data-binary",
        &format!("@{}", file.display()),
        "-w",
        "%{time_total}",
        "-o",
        "/dev/null",
        &format!("http://{}/late/e", p.listener("main")),
    ]);
    assert!(out.status.success(), "{out:?}");
    // curl waited for the 100 for at most 20 s: it came well before that.
    let t: f64 = String::from_utf8_lossy(&out.stdout).trim().parse().unwrap();
    assert!(t < 10.0, "{t}");
}

#[test]
fn http2_bodies_are_read_and_forwarded() {
    let (_o, p) = config();
    let dir = TempDir::new();
    let addr = p.listener("main");
    for n in [1usize, 17_000, CAP] {
        let body = body_of(n);
        let file = dir.path().join("in");
        std::fs::write(&file, &body).unwrap();
        let out_file = dir.path().join("out");
        let hdrs = dir.path().join("hdrs");
        let out = curl(&[
            "--http2-prior-knowledge",
            "--data-binary",
            &format!("@{}", file.display()),
            "-D",
            hdrs.to_str().unwrap(),
            "-o",
            out_file.to_str().unwrap(),
            &format!("http://{addr}/rb/echo"),
        ]);
        assert!(out.status.success(), "{out:?}");
        let head = std::fs::read_to_string(&hdrs).unwrap().to_ascii_lowercase();
        assert!(head.starts_with("http/2 200"), "{head}");
        assert!(head.contains(&format!("x-body-len: {n}\r\n")), "{head}");
        assert!(std::fs::read(&out_file).unwrap() == body, "{n}");
    }
    // Over the bound: 413, then RST_STREAM(NO_ERROR) for the rest of the upload (RFC 9113
    // §8.1). nghttp, as curl 7.88 reports that reset as an error while it still uploads.
    let file = dir.path().join("big");
    std::fs::write(&file, body_of(CAP + 10)).unwrap();
    let out = run_with_timeout(
        std::process::Command::new("nghttp").args([
            "-v",
            "-d",
            file.to_str().unwrap(),
            &format!("http://{addr}/rb/echo"),
        ]),
        Duration::from_secs(40),
    );
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains(":status: 413"), "{text}");
    // HTTP/2 without a content-length (curl reads stdin in pieces): read as it comes.
    let body = body_of(9000);
    std::fs::write(dir.path().join("in9"), &body).unwrap();
    let out = run_with_timeout(
        std::process::Command::new("sh").arg("-c").arg(format!(
            "cat {} | curl -sS --max-time 30 --http2-prior-knowledge -T - -X POST \
             -D {} -o {} http://{addr}/rb/echo",
            dir.path().join("in9").display(),
            dir.path().join("h9").display(),
            dir.path().join("o9").display(),
        )),
        Duration::from_secs(40),
    );
    assert!(out.status.success(), "{out:?}");
    let head = std::fs::read_to_string(dir.path().join("h9")).unwrap();
    assert!(head.contains("x-body-len: 9000\r\n"), "{head}");
    assert!(std::fs::read(dir.path().join("o9")).unwrap() == body);
}

#[test]
fn raw_header_is_the_head_as_received() {
    let (_o, p) = config();
    let mut c = RawConn::connect(p.listener("main"));
    let head = "GET /raw/x?a=1 HTTP/1.1\r\nHost: t.example\r\nX-Mixed-Case: Two Words\r\nx-dup: 1\r\nx-dup: 2\r\n\r\n";
    c.send(head.as_bytes());
    let r = c.read_response().unwrap();
    assert_eq!(r.status, 200);
    assert_eq!(r.body_str(), head);
    assert_eq!(r.header("x-ver"), Some("1.1"));
    let head = "GET /raw/x?nrl=1 HTTP/1.0\r\nHost: t\r\nConnection: keep-alive\r\n\r\n";
    c.send(head.as_bytes());
    let r = c.read_response().unwrap();
    assert_eq!(r.body_str(), "Host: t\r\nConnection: keep-alive\r\n\r\n");
    assert_eq!(r.header("x-ver"), Some("1"));
    // HTTP/2: rebuilt in HTTP/1 form.
    let out = curl(&[
        "--http2-prior-knowledge",
        "-D",
        "/dev/stderr",
        "-H",
        "X-Test: h2",
        &format!("http://{}/raw/y", p.listener("main")),
    ]);
    assert!(out.status.success(), "{out:?}");
    let got = String::from_utf8_lossy(&out.stdout);
    assert!(got.starts_with("GET /raw/y HTTP/2.0\r\n"), "{got}");
    assert!(got.contains("\r\nx-test: h2\r\n"), "{got}");
    assert!(got.ends_with("\r\n\r\n"), "{got}");
    let head = String::from_utf8_lossy(&out.stderr).to_ascii_lowercase();
    assert!(head.contains("x-ver: 2\r\n"), "{head}");
}

#[test]
fn request_socket_parses_a_multipart_upload() {
    let (o, p) = config();
    let dir = TempDir::new();
    let addr = p.listener("main");
    let body = body_of(20_000);
    let file = dir.path().join("up.bin");
    std::fs::write(&file, &body).unwrap();
    for proto in ["--http1.1", "--http2-prior-knowledge"] {
        let out_file = dir.path().join("out");
        let hdrs = dir.path().join("hdrs");
        let out = curl(&[
            proto,
            "-F",
            &format!("f=@{}", file.display()),
            "-D",
            hdrs.to_str().unwrap(),
            "-o",
            out_file.to_str().unwrap(),
            &format!("http://{addr}/up/x"),
        ]);
        assert!(out.status.success(), "{out:?}");
        let head = std::fs::read_to_string(&hdrs).unwrap().to_ascii_lowercase();
        assert!(head.contains(" 200"), "{proto}: {head}\n{}", p.logs());
        assert!(head.contains("x-file: up.bin\r\n"), "{head}");
        // 20,000 bytes in pieces of at most 4096: five of them.
        assert!(head.contains("x-pieces: 5\r\n"), "{head}");
        assert!(std::fs::read(&out_file).unwrap() == body, "{proto}");
    }
    assert_eq!(o.requests(), 0);
}
