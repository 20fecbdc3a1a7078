//! Issue 11, items 7–9 and the configurable key: compression as a body
//! filter (negotiation, q=0, no-transform, Range, HEAD, already-encoded
//! bodies, HTTP/1 and HTTP/2, Pier-made answers), the cache's one
//! compressed copy decoded for clients that don't take it, purge by URL,
//! prefix and tag through the admin API (with its credentials), cache key
//! options, and `pier.cache` from Lua in access and header_filter.

mod common;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use common::*;

// === a small origin with the fields these tests need ===

/// The text every compressible page carries (4 KiB+, compresses well).
fn page_text(path: &str) -> String {
    let mut s = format!("<html><body><h1>{path}</h1>\n");
    while s.len() < 4096 {
        s.push_str("<p>a paragraph of text that compresses rather well</p>\n");
    }
    s.push_str("</body></html>\n");
    s
}

fn gzip(data: &[u8]) -> Vec<u8> {
    let mut e = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
    e.write_all(data).unwrap();
    e.finish().unwrap()
}

fn decode(coding: Option<&str>, body: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    match coding {
        None => out.extend_from_slice(body),
        Some("gzip") => {
            flate2::read::GzDecoder::new(body)
                .read_to_end(&mut out)
                .expect("valid gzip");
        }
        Some("br") => {
            brotli::Decompressor::new(body, 4096)
                .read_to_end(&mut out)
                .expect("valid brotli");
        }
        Some("zstd") => out = zstd::stream::decode_all(body).expect("valid zstd"),
        Some(other) => panic!("unexpected coding {other}"),
    }
    out
}

/// An origin on 127.0.0.1:0. Paths (the first segment names the kind):
/// `/page/X` text/html, max-age=60, ETag, `Surrogate-Key: pages page-X`,
/// `Cache-Tag: site,kind-page`; `/nt/X` the same with no-transform;
/// `/img/X` image/png; `/small` 10 bytes of text; `/gz/X` a gzip-encoded
/// text page; `/count/X` text/plain max-age=60 whose body is the request
/// number; `/nostore/X` text/plain no-store with the request number.
struct MiniOrigin {
    addr: SocketAddr,
    requests: Arc<AtomicU64>,
}

impl MiniOrigin {
    fn start() -> MiniOrigin {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        let requests = Arc::new(AtomicU64::new(0));
        let n = requests.clone();
        std::thread::spawn(move || {
            for s in l.incoming() {
                let Ok(s) = s else { continue };
                let n = n.clone();
                std::thread::spawn(move || serve(s, n));
            }
        });
        MiniOrigin { addr, requests }
    }
    fn requests(&self) -> u64 {
        self.requests.load(Ordering::SeqCst)
    }
}

fn serve(s: TcpStream, n: Arc<AtomicU64>) {
    s.set_read_timeout(Some(Duration::from_secs(30))).ok();
    let mut w = s.try_clone().unwrap();
    let mut r = BufReader::new(s);
    loop {
        let mut line = String::new();
        if r.read_line(&mut line).unwrap_or(0) == 0 {
            return;
        }
        let mut parts = line.split_whitespace();
        let method = parts.next().unwrap_or("").to_string();
        let target = parts.next().unwrap_or("/").to_string();
        loop {
            let mut h = String::new();
            if r.read_line(&mut h).unwrap_or(0) == 0 {
                return;
            }
            if h == "\r\n" {
                break;
            }
        }
        let count = n.fetch_add(1, Ordering::SeqCst) + 1;
        let path = target.split('?').next().unwrap_or("/").to_string();
        let kind = path.split('/').nth(1).unwrap_or("").to_string();
        let name = path.split('/').nth(2).unwrap_or("").to_string();
        let mut headers: Vec<(String, String)> = Vec::new();
        let body: Vec<u8> = match kind.as_str() {
            "page" | "nt" => {
                headers.push(("Content-Type".into(), "text/html; charset=utf-8".into()));
                let cc = if kind == "nt" {
                    "max-age=60, no-transform"
                } else {
                    "max-age=60"
                };
                headers.push(("Cache-Control".into(), cc.into()));
                headers.push(("ETag".into(), format!("\"{name}-v1\"")));
                headers.push(("Surrogate-Key".into(), format!("pages page-{name}")));
                headers.push(("Cache-Tag".into(), "site,kind-page".into()));
                page_text(&path).into_bytes()
            }
            "img" => {
                headers.push(("Content-Type".into(), "image/png".into()));
                headers.push(("Cache-Control".into(), "max-age=60".into()));
                page_text(&path).into_bytes()
            }
            "small" => {
                headers.push(("Content-Type".into(), "text/plain".into()));
                b"0123456789".to_vec()
            }
            "gz" => {
                headers.push(("Content-Type".into(), "text/plain".into()));
                headers.push(("Content-Encoding".into(), "gzip".into()));
                headers.push(("Cache-Control".into(), "max-age=60".into()));
                gzip(page_text(&path).as_bytes())
            }
            "count" => {
                headers.push(("Content-Type".into(), "application/octet-stream".into()));
                headers.push(("Cache-Control".into(), "max-age=60".into()));
                headers.push(("Surrogate-Key".into(), format!("count-{name}")));
                format!("n={count}").into_bytes()
            }
            "nostore" => {
                headers.push(("Content-Type".into(), "text/plain".into()));
                headers.push(("Cache-Control".into(), "no-store".into()));
                format!("n={count}").into_bytes()
            }
            _ => b"not found".to_vec(),
        };
        let status = if kind.is_empty() {
            "404 Not Found"
        } else {
            "200 OK"
        };
        let mut out = format!("HTTP/1.1 {status}\r\nContent-Length: {}\r\n", body.len());
        for (k, v) in &headers {
            out.push_str(&format!("{k}: {v}\r\n"));
        }
        out.push_str(&format!("X-Count: {count}\r\n\r\n"));
        let mut bytes = out.into_bytes();
        if method != "HEAD" {
            bytes.extend_from_slice(&body);
        }
        if w.write_all(&bytes).is_err() {
            return;
        }
    }
}

// === configs ===

const COMPRESS: &str = r#"[route.compress]
types = ["text/*", "application/json"]
min_size = 100
"#;

fn config(origin: SocketAddr, top: &str, route: &str) -> String {
    base_config(
        top,
        &format!(
            r#"{route}
[upstream.app]
servers = ["{origin}"]
"#
        ),
    )
}

fn get(c: &mut RawConn, path: &str, ae: Option<&str>) -> Response {
    let mut h = vec![];
    if let Some(ae) = ae {
        h.push(("Accept-Encoding", ae));
    }
    c.request("GET", path, &h, b"").unwrap()
}

// === compression ===

#[test]
fn negotiation_q_values_and_exclusions() {
    let o = MiniOrigin::start();
    let route = format!("[[route]]\nname = \"r\"\nupstream = \"app\"\n{COMPRESS}");
    let pier = pier(&config(o.addr, "", &route));
    let mut c = RawConn::connect(pier.listener("main"));
    let plain = page_text("/page/a").into_bytes();

    for (ae, want) in [
        ("gzip", Some("gzip")),
        ("gzip, deflate, br, zstd", Some("br")),
        ("br;q=0.5, gzip;q=1.0", Some("gzip")),
        ("zstd", Some("zstd")),
        ("*;q=0.1, br;q=0", Some("zstd")),
        ("gzip;q=0", None),
        ("br;q=0, gzip;q=0, zstd;q=0, *;q=0", None),
        ("identity", None),
    ] {
        let r = get(&mut c, "/page/a", Some(ae));
        assert_eq!(r.status, 200);
        assert_eq!(r.header("content-encoding"), want, "Accept-Encoding: {ae}");
        assert!(r.has_token("vary", "accept-encoding"), "{ae}: {r:?}");
        assert_eq!(decode(want, &r.body), plain, "{ae}");
        if want.is_some() {
            assert!(r.header("content-length").is_none(), "streamed: {r:?}");
            assert_eq!(r.header("etag"), Some("W/\"a-v1\""));
            assert!(r.body.len() < plain.len() / 4);
        } else {
            assert_eq!(r.header("etag"), Some("\"a-v1\""));
        }
    }
    // No Accept-Encoding: identity, length kept.
    let r = get(&mut c, "/page/a", None);
    assert_eq!(r.header("content-encoding"), None);
    assert_eq!(r.header("content-length"), Some(&*plain.len().to_string()));
    assert_eq!(r.body, plain);
    // no-transform, Range, HEAD, a type not listed, a small body: as they are.
    let r = get(&mut c, "/nt/a", Some("gzip"));
    assert_eq!(r.header("content-encoding"), None);
    assert_eq!(r.body, page_text("/nt/a").into_bytes());
    let r = c
        .request(
            "GET",
            "/page/a",
            &[("Accept-Encoding", "gzip"), ("Range", "bytes=0-9")],
            b"",
        )
        .unwrap();
    assert_eq!(r.header("content-encoding"), None);
    let r = c
        .request("HEAD", "/page/a", &[("Accept-Encoding", "gzip")], b"")
        .unwrap();
    assert_eq!(r.header("content-encoding"), None);
    let r = get(&mut c, "/img/a", Some("gzip"));
    assert_eq!(r.header("content-encoding"), None);
    assert!(!r.has_token("vary", "accept-encoding"));
    let r = get(&mut c, "/small", Some("gzip"));
    assert_eq!(r.header("content-encoding"), None);
    assert_eq!(r.body, b"0123456789");
    // Already encoded: passed through to a client that takes it, decoded
    // for one that doesn't (and re-encoded in a coding it does take).
    let r = get(&mut c, "/gz/a", Some("gzip"));
    assert_eq!(r.header("content-encoding"), Some("gzip"));
    let plain_gz = page_text("/gz/a").into_bytes();
    assert_eq!(decode(Some("gzip"), &r.body), plain_gz);
    let r = get(&mut c, "/gz/a", None);
    assert_eq!(r.header("content-encoding"), None);
    assert_eq!(r.body, plain_gz);
    let r = get(&mut c, "/gz/a", Some("br"));
    assert_eq!(r.header("content-encoding"), Some("br"));
    assert_eq!(decode(Some("br"), &r.body), plain_gz);
}

#[test]
fn http2_and_pier_made_answers_are_compressed() {
    let o = MiniOrigin::start();
    let route = format!(
        r#"[[route]]
name = "made"
path = "/made"
[route.lua]
content = '''
pier.resp.set_header("Content-Type", "text/plain")
pier.say(string.rep("made by pier ", 400))
'''
{COMPRESS}
[[route]]
name = "r"
upstream = "app"
{COMPRESS}"#
    );
    let cfg = common::h2c_main(&config(o.addr, "", &route));
    let pier = pier(&cfg);
    let addr = pier.listener("main");
    let want = "made by pier ".repeat(400) + "\n";
    // HTTP/1.1, a Lua content answer.
    let mut c = RawConn::connect(addr);
    let r = get(&mut c, "/made", Some("gzip"));
    assert_eq!(r.status, 200);
    assert_eq!(r.header("content-encoding"), Some("gzip"), "{r:?}");
    assert_eq!(decode(Some("gzip"), &r.body), want.as_bytes());
    // HTTP/2 (h2c), proxied and Pier-made: curl keeps the bytes as sent.
    let dir = TempDir::new();
    for (path, ae, want) in [
        ("/page/h2", "br", page_text("/page/h2").into_bytes()),
        ("/made", "zstd", want.clone().into_bytes()),
    ] {
        let url = format!("http://{addr}{path}");
        let body = dir.path().join("body");
        let hdrs = dir.path().join("hdrs");
        let out = curl(&[
            "--http2-prior-knowledge",
            "-H",
            &format!("Accept-Encoding: {ae}"),
            "-D",
            hdrs.to_str().unwrap(),
            "-o",
            body.to_str().unwrap(),
            &url,
        ]);
        assert!(out.status.success(), "{out:?}");
        let head = std::fs::read_to_string(&hdrs).unwrap().to_ascii_lowercase();
        assert!(head.starts_with("http/2 200"), "{head}");
        assert!(head.contains(&format!("content-encoding: {ae}")), "{head}");
        let got = std::fs::read(&body).unwrap();
        // Streamed (proxied: no length), or whole (Pier-made: its length).
        let cl = head
            .lines()
            .find_map(|l| l.strip_prefix("content-length: "))
            .map(|v| v.trim().parse::<usize>().unwrap());
        match path {
            "/made" => assert_eq!(cl, Some(got.len()), "{head}"),
            _ => assert_eq!(cl, None, "{head}"),
        }
        assert_eq!(decode(Some(ae), &got), want);
    }
}

#[test]
fn the_cache_keeps_one_compressed_copy() {
    let o = MiniOrigin::start();
    let route = format!(
        r#"[[route]]
name = "r"
upstream = "app"
[route.cache]
zone = "main"
{COMPRESS}store = "gzip"
"#
    );
    let pier = pier(&config(
        o.addr,
        "[cache.main]\nmemory = \"16m\"\nmax_object = \"1m\"",
        &route,
    ));
    let mut c = RawConn::connect(pier.listener("main"));
    let plain = page_text("/page/x").into_bytes();
    // A client without compression fills the cache: what is stored is gzip.
    let r = get(&mut c, "/page/x", None);
    assert_eq!(r.header("cache-status"), Some("pier; fwd=miss; stored"));
    assert_eq!(r.header("content-encoding"), None);
    assert_eq!(r.body, plain);
    // The one copy serves every client: gzip as stored, identity decoded,
    // br and zstd decoded and re-encoded.
    for ae in [
        Some("gzip"),
        None,
        Some("br"),
        Some("zstd"),
        Some("gzip;q=0"),
    ] {
        let r = get(&mut c, "/page/x", ae);
        assert!(
            r.header("cache-status").unwrap().contains("hit"),
            "{ae:?}: {r:?}"
        );
        let want = match ae {
            Some("gzip;q=0") | None => None,
            a => a,
        };
        assert_eq!(r.header("content-encoding"), want, "{ae:?}");
        assert!(r.has_token("vary", "accept-encoding"));
        assert_eq!(decode(want, &r.body), plain, "{ae:?}");
    }
    // HEAD from the stored copy says what a GET would get.
    let r = c.request("HEAD", "/page/x", &[], b"").unwrap();
    assert_eq!(r.status, 200);
    assert_eq!(r.header("content-encoding"), None, "{r:?}");
    assert_eq!(r.header("content-length"), None, "{r:?}");
    let r = c
        .request("HEAD", "/page/x", &[("Accept-Encoding", "gzip")], b"")
        .unwrap();
    assert_eq!(r.header("content-encoding"), Some("gzip"), "{r:?}");
    assert_eq!(o.requests(), 1, "one fill served them all");
    // The stored copy is the compressed one: its bytes count, not the page's.
    let bytes = pier.metric_sum("pier_cache_bytes", &[("zone", "main")]);
    assert!(bytes < plain.len() as f64, "stored {bytes} bytes");
}

// === purge ===

#[test]
fn purge_by_url_prefix_and_tag_with_credentials() {
    let o = MiniOrigin::start();
    let route = r#"[[route]]
name = "keep"
path = "/count/keep"
upstream = "app"
[route.cache]
zone = "main"
strip_tags = false

[[route]]
name = "r"
upstream = "app"
[route.cache]
zone = "main"
"#;
    let pier = pier(
        &config(
            o.addr,
            "[cache.main]\nmemory = \"16m\"\nmax_object = \"1m\"",
            route,
        )
        .replace(
            "[admin]\nlisten = \"127.0.0.1:0\"",
            "[admin]\nlisten = \"127.0.0.1:0\"\ntoken = \"purge-token-1\"",
        ),
    );
    let mut c = RawConn::connect(pier.listener("main"));
    let fill = |c: &mut RawConn, paths: &[&str]| {
        for p in paths {
            let r = c.get(p).unwrap();
            assert_eq!(r.status, 200);
            let r = c.get(p).unwrap();
            assert!(
                r.header("cache-status").unwrap().contains("hit"),
                "{p}: {r:?}"
            );
        }
    };
    let is_hit = |c: &mut RawConn, p: &str| {
        c.get(p)
            .unwrap()
            .header("cache-status")
            .unwrap()
            .contains("hit")
    };
    fill(
        &mut c,
        &["/page/a", "/page/b", "/count/1", "/count/2", "/count/keep"],
    );
    // Tags are Pier's: stripped from clients unless the route keeps them.
    let r = c.get("/page/a").unwrap();
    assert_eq!(r.header("surrogate-key"), None);
    assert_eq!(r.header("cache-tag"), None);
    let r = c.get("/count/keep").unwrap();
    assert_eq!(r.header("surrogate-key"), Some("count-keep"));

    let mut admin = RawConn::connect(pier.admin());
    let auth = ("Authorization", "Bearer purge-token-1");
    // The admin endpoint answers a Host naming it (issue 31).
    let host = ("Host", "127.0.0.1");
    let purge = |admin: &mut RawConn, q: &str, body: &[u8]| {
        let mut h = vec![auth, host];
        if !body.is_empty() {
            h.push(("Content-Type", "application/json"));
        }
        let r = admin
            .request("POST", &format!("/api/cache/purge{q}"), &h, body)
            .unwrap();
        assert_eq!(r.status, 200, "{}", r.body_str());
        let v: serde_json::Value = serde_json::from_slice(&r.body).unwrap();
        v["purged"].as_u64().unwrap()
    };
    // Without credentials: refused, nothing purged.
    let r = admin
        .request("POST", "/api/cache/purge?prefix=http://", &[host], b"")
        .unwrap();
    assert_eq!(r.status, 401);
    assert!(is_hit(&mut c, "/page/a"));
    // GET is not a purge.
    let r = admin
        .request("GET", "/api/cache/purge?tag=pages", &[auth, host], b"")
        .unwrap();
    assert_eq!(r.status, 405);
    // By URL.
    assert_eq!(purge(&mut admin, "?url=http://pier.test/count/1", b""), 1);
    assert!(!is_hit(&mut c, "/count/1"), "purged, filled again");
    assert!(is_hit(&mut c, "/count/1"));
    assert!(is_hit(&mut c, "/count/2"));
    // By tag, in a JSON body (Surrogate-Key and Cache-Tag both count).
    assert_eq!(purge(&mut admin, "", br#"{"tag": "pages"}"#), 2);
    assert!(!is_hit(&mut c, "/page/a"));
    assert!(!is_hit(&mut c, "/page/b"));
    assert!(is_hit(&mut c, "/count/2"));
    assert_eq!(purge(&mut admin, "?tag=kind-page", b""), 2);
    assert_eq!(purge(&mut admin, "?tag=kind-page", b""), 0);
    // By prefix: every /count/ key.
    assert_eq!(purge(&mut admin, "?prefix=http://pier.test/count/", b""), 3);
    assert!(!is_hit(&mut c, "/count/2"));
    // Bad requests answer 400 with a reason.
    let r = admin
        .request("POST", "/api/cache/purge?url=ftp://x/", &[auth, host], b"")
        .unwrap();
    assert_eq!(r.status, 400);
    let r = admin
        .request("POST", "/api/cache/purge", &[auth, host], b"{\"nope\": 1}")
        .unwrap();
    assert_eq!(r.status, 400);
    // The admin connection still works after bodies (pipelining kept).
    assert_eq!(purge(&mut admin, "?key=nothing-here", b""), 0);
}

// === key options ===

#[test]
fn key_options_headers_cookies_and_query() {
    let o = MiniOrigin::start();
    let route = r#"[[route]]
name = "r"
upstream = "app"
[route.cache]
zone = "main"
[route.cache.key]
headers = ["X-Variant"]
cookies = ["ab"]
query = "sort"
query_exclude = ["utm_source"]
"#;
    let pier = pier(
        &config(
            o.addr,
            "[cache.main]\nmemory = \"16m\"\nmax_object = \"1m\"",
            route,
        )
        .replace(
            "[admin]\nlisten = \"127.0.0.1:0\"",
            "[admin]\nlisten = \"127.0.0.1:0\"\ntoken = \"purge-token-2\"",
        ),
    );
    let mut c = RawConn::connect(pier.listener("main"));
    let body = |c: &mut RawConn, p: &str, h: &[(&str, &str)]| {
        String::from_utf8(c.request("GET", p, h, b"").unwrap().body).unwrap()
    };
    let first = body(&mut c, "/count/k?a=1&b=2", &[]);
    // Sorted, utm_source dropped: the same key.
    assert_eq!(body(&mut c, "/count/k?b=2&utm_source=mail&a=1", &[]), first);
    assert_eq!(o.requests(), 1);
    // Another parameter value: another key.
    assert_ne!(body(&mut c, "/count/k?a=2&b=2", &[]), first);
    // The header and the cookie are parts of the key.
    let v1 = body(&mut c, "/count/k?a=1&b=2", &[("X-Variant", "one")]);
    assert_ne!(v1, first);
    assert_eq!(
        body(&mut c, "/count/k?b=2&a=1", &[("X-Variant", "one")]),
        v1
    );
    let ck = body(&mut c, "/count/k?a=1&b=2", &[("Cookie", "x=1; ab=green")]);
    assert_ne!(ck, first);
    assert_eq!(
        body(&mut c, "/count/k?a=1&b=2", &[("Cookie", "ab=green; y=2")]),
        ck
    );
    // Other cookies don't matter.
    assert_eq!(
        body(&mut c, "/count/k?a=1&b=2", &[("Cookie", "z=9")]),
        first
    );
    let before = o.requests();
    assert_eq!(before, 4);
    // A purge by URL reaches every variant of it (query normalised too).
    let mut admin = RawConn::connect(pier.admin());
    let r = admin
        .request(
            "POST",
            "/api/cache/purge",
            &[
                ("Host", "127.0.0.1"),
                ("Authorization", "Bearer purge-token-2"),
            ],
            br#"{"url": "http://pier.test/count/k?b=2&a=1"}"#,
        )
        .unwrap();
    assert_eq!(r.status, 200);
    let v: serde_json::Value = serde_json::from_slice(&r.body).unwrap();
    assert_eq!(v["purged"], 3, "{v}");
    assert_ne!(body(&mut c, "/count/k?a=1&b=2", &[]), first);
    assert_eq!(o.requests(), before + 1);
}

// === pier.cache from Lua ===

#[test]
fn pier_cache_in_access_and_header_filter() {
    let o = MiniOrigin::start();
    let route = r#"[[route]]
name = "r"
upstream = "app"
[route.cache]
zone = "main"
[route.lua]
access = '''
local h = pier.req.get_headers()
if h["x-bypass"] then pier.cache.bypass() end
if h["x-key"] then pier.cache.set_key("custom:" .. h["x-key"]) end
if h["x-ttl"] then pier.cache.set_ttl(tonumber(h["x-ttl"])) end
-- Hostile values are refused, not stored.
local errs = {}
for _, v in ipairs({0/0, -1, 1/0, 1e12}) do
  if pcall(pier.cache.set_ttl, v) then errs[#errs + 1] = tostring(v) end
end
if pcall(pier.cache.set_key, "") or pcall(pier.cache.set_key, "a\nb")
  or pcall(pier.cache.set_key, string.rep("k", 5000)) then
  errs[#errs + 1] = "key"
end
if pcall(pier.cache.set_cacheable, true) then errs[#errs + 1] = "cacheable in access" end
pier.ctx.errs = table.concat(errs, ",")
'''
header_filter = '''
pier.resp.set_header("X-Lua-Errs", pier.ctx.errs)
if pcall(pier.cache.bypass) then pier.resp.set_header("X-Lua-Errs", "bypass in header_filter") end
local p = pier.var.uri
if p:find("^/nostore/") then
  pier.cache.set_cacheable(true)
  pier.cache.set_ttl(30)
elseif p:find("^/count/never") then
  pier.cache.set_cacheable(false)
end
'''
"#;
    let pier = pier(&config(
        o.addr,
        "[cache.main]\nmemory = \"16m\"\nmax_object = \"1m\"",
        route,
    ));
    let mut c = RawConn::connect(pier.listener("main"));
    let req = |c: &mut RawConn, p: &str, h: &[(&str, &str)]| c.request("GET", p, h, b"").unwrap();

    // Bad values were all refused.
    let r = req(&mut c, "/count/a", &[]);
    assert_eq!(r.header("x-lua-errs"), Some(""), "{r:?}");
    assert_eq!(r.header("cache-status"), Some("pier; fwd=miss; stored"));
    assert!(req(&mut c, "/count/a", &[])
        .header("cache-status")
        .unwrap()
        .contains("hit"));
    // access: bypass goes to the origin and stores nothing.
    let n = o.requests();
    let r = req(&mut c, "/count/a", &[("X-Bypass", "1")]);
    assert_eq!(r.header("cache-status"), None);
    assert_eq!(o.requests(), n + 1);
    assert!(req(&mut c, "/count/a", &[])
        .header("cache-status")
        .unwrap()
        .contains("hit"));
    // access: a key of its own: two URLs share it.
    let a = req(&mut c, "/count/k1", &[("X-Key", "shared")]).body;
    let b = req(&mut c, "/count/k2", &[("X-Key", "shared")]).body;
    assert_eq!(a, b, "one key, one object");
    // access: a TTL of 0 stores nothing; a TTL shows in the hit's ttl.
    let r = req(&mut c, "/count/t0", &[("X-Ttl", "0")]);
    assert_eq!(r.header("cache-status"), Some("pier; fwd=miss"));
    req(&mut c, "/count/t5", &[("X-Ttl", "5")]);
    let r = req(&mut c, "/count/t5", &[]);
    let cs = r.header("cache-status").unwrap().to_string();
    assert!(cs.starts_with("pier; hit; ttl="), "{cs}");
    let ttl: i64 = cs.rsplit('=').next().unwrap().parse().unwrap();
    assert!((0..=5).contains(&ttl), "{cs}");
    // header_filter: a no-store answer stored after all, for 30 s.
    let r = req(&mut c, "/nostore/x", &[]);
    assert_eq!(r.header("cache-status"), Some("pier; fwd=miss; stored"));
    let r2 = req(&mut c, "/nostore/x", &[]);
    assert!(r2.header("cache-status").unwrap().contains("hit"), "{r2:?}");
    assert_eq!(r2.body, r.body);
    // header_filter: a cacheable answer not stored.
    let r = req(&mut c, "/count/never", &[]);
    assert_eq!(r.header("cache-status"), Some("pier; fwd=miss"));
    let r2 = req(&mut c, "/count/never", &[]);
    assert_ne!(r2.body, r.body, "went to the origin again");
}
