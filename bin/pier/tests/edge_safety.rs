//! Issue 31's holes in how a request is read and passed on, each as the attack that
//! opened it (docs/security.md points here): framing named in `Connection`, a second
//! authority in an absolute-form target, path forms that skip a route's hook,
//! forwarding headers that origins trust, CONNECT and TRACE. And the differential
//! check behind them: for a corpus of request forms, the origin, the router and the
//! access log agree on the method, the authority and the path.

mod common;

use std::time::Duration;

use common::*;

/// Sends `raw` on a fresh connection; the response.
fn raw(addr: std::net::SocketAddr, raw: &[u8]) -> Response {
    let mut c = RawConn::connect(addr);
    let _ = c.try_send(raw);
    let r = if raw.starts_with(b"HEAD ") {
        c.read_response_no_body()
    } else {
        c.read_response()
    };
    r.unwrap_or_else(|e| panic!("{:?}: no response: {e}", String::from_utf8_lossy(raw)))
}

// === 1. framing named in Connection ===

#[test]
fn connection_naming_framing_host_or_a_pseudo_header_is_refused_and_nothing_reaches_the_origin() {
    let smuggled = b"GET /smuggled HTTP/1.1\r\nHost: a\r\n\r\n";
    assert_eq!(smuggled.len(), 35);
    let mut attack =
        b"POST /x HTTP/1.1\r\nHost: a\r\nConnection: content-length\r\nContent-Length: 35\r\n\r\n"
            .to_vec();
    attack.extend_from_slice(smuggled);
    let mut chunked = b"POST /x HTTP/1.1\r\nHost: a\r\nConnection: transfer-encoding\r\nTransfer-Encoding: chunked\r\n\r\n23\r\n".to_vec();
    chunked.extend_from_slice(smuggled);
    chunked.extend_from_slice(b"\r\n0\r\n\r\n");
    let cases: Vec<(&str, Vec<u8>)> = vec![
        ("the issue's recipe", attack.clone()),
        ("chunked, listed", chunked),
        (
            "listed among others, odd case",
            b"POST /x HTTP/1.1\r\nHost: a\r\nConnection: keep-alive, Content-LENGTH\r\nContent-Length: 35\r\n\r\n"
                .iter()
                .chain(smuggled.iter())
                .copied()
                .collect(),
        ),
        (
            "a second Connection field",
            b"POST /x HTTP/1.1\r\nHost: a\r\nConnection: close\r\nConnection: content-length\r\nContent-Length: 35\r\n\r\n"
                .iter()
                .chain(smuggled.iter())
                .copied()
                .collect(),
        ),
        (
            "Host",
            b"GET /x HTTP/1.1\r\nHost: a\r\nConnection: host\r\n\r\n".to_vec(),
        ),
        (
            "a pseudo-header",
            b"GET /x HTTP/1.1\r\nHost: a\r\nConnection: :authority\r\n\r\n".to_vec(),
        ),
    ];
    let o = Origin::start();
    let p = pier(&simple_config(&[o.addr()], "", ""));
    for (i, (what, bytes)) in cases.iter().enumerate() {
        let r = raw(p.listener("main"), bytes);
        assert_local(&r, 400, "connection-names-framing");
        assert_eq!(
            wait_local_count(&p, 400, "connection-names-framing", (i + 1) as f64),
            (i + 1) as f64,
            "{what}: counted"
        );
    }
    // Nothing of any of them reached the origin: the next request is its first.
    assert_eq!(get(p.listener("main"), "/hello").status, 200);
    assert_eq!(o.requests(), 1, "a refused request reached the origin");
}

/// The upstream request's framing is the codec's: a hook that sets Content-Length
/// or Transfer-Encoding cannot make the origin read the body as a second request.
#[test]
fn a_hook_cannot_set_the_upstream_framing() {
    let o = Origin::start();
    let body = format!(
        r#"[[route]]
name = "default"
upstream = "app"
[route.lua]
access = '''
ngx.req.set_header("Content-Length", "0")
ngx.req.set_header("Transfer-Encoding", "chunked")
'''

[upstream.app]
servers = ["{}"]
"#,
        o.addr()
    );
    let p = pier(&base_config("", &body));
    let smuggled = b"GET /smuggled HTTP/1.1\r\nHost: a\r\n\r\n";
    let mut c = RawConn::connect(p.listener("main"));
    let r = c.request("POST", "/echo", &[], smuggled).unwrap();
    assert_eq!(r.status, 200, "{r:?}");
    assert_eq!(r.body, smuggled, "the body went as a body");
    assert_eq!(o.requests(), 1, "and not as a second request");
    // The head the origin got states the body's real length, once.
    let r = c.request("POST", "/headers", &[], b"abcde").unwrap();
    let head = r.body_str().to_ascii_lowercase();
    assert_eq!(head.matches("content-length").count(), 1, "{head}");
    assert!(head.contains("content-length: 5\r\n"), "{head}");
    assert!(!head.contains("transfer-encoding"), "{head}");
}

// === 2. one authority ===

fn two_hosts_cached(evil: &Origin, victim: &Origin) -> String {
    base_config(
        "[cache.main]\nmemory = \"4m\"\nmax_object = \"64k\"",
        &format!(
            r#"[[route]]
name = "evil"
host = "evil.example"
upstream = "evil"
[route.cache]
zone = "main"
ttl = {{ "200" = "60s" }}

[[route]]
name = "victim"
host = "victim.example"
upstream = "victim"
[route.cache]
zone = "main"
ttl = {{ "200" = "60s" }}

[upstream.evil]
servers = ["{}"]

[upstream.victim]
servers = ["{}"]
"#,
            evil.addr(),
            victim.addr()
        ),
    )
}

#[test]
fn an_absolute_form_target_is_the_one_authority_for_routing_the_cache_and_the_origin() {
    let evil = Origin::start_named("evil");
    let victim = Origin::start_named("victim");
    let p = pier(&two_hosts_cached(&evil, &victim));
    let addr = p.listener("main");
    // The poisoning attempt: evil's page under victim's Host.
    let r = raw(
        addr,
        b"GET http://evil.example/name HTTP/1.1\r\nHost: victim.example\r\n\r\n",
    );
    assert_eq!((r.status, r.body_str().trim()), (200, "evil"));
    // victim's own request is victim's page, not a hit on evil's.
    let r = raw(addr, b"GET /name HTTP/1.1\r\nHost: victim.example\r\n\r\n");
    assert_eq!((r.status, r.body_str().trim()), (200, "victim"), "{r:?}");
    // And evil's stored page is evil's key's: a plain request for it hits.
    let r = raw(addr, b"GET /name HTTP/1.1\r\nHost: evil.example\r\n\r\n");
    assert_eq!(r.body_str().trim(), "evil");
    assert!(
        r.header("cache-status").is_some_and(|v| v.contains("hit")),
        "{r:?}"
    );
    // The origin sees one Host, the target's authority, in origin-form.
    let r = raw(
        addr,
        b"GET http://EVIL.example./headers?q=1 HTTP/1.1\r\nHost: victim.example\r\n\r\n",
    );
    let head = r.body_str();
    assert!(head.starts_with("GET /headers?q=1 HTTP/1.1\r\n"), "{head}");
    let lower = head.to_ascii_lowercase();
    assert_eq!(lower.matches("\r\nhost:").count(), 1, "{head}");
    assert!(lower.contains("\r\nhost: evil.example\r\n"), "{head}");
    assert!(
        lower.contains("\r\nx-forwarded-host: evil.example\r\n"),
        "{head}"
    );
}

#[test]
fn an_authority_that_is_not_host_and_port_is_refused() {
    let o = Origin::start();
    let p = pier(&simple_config(&[o.addr()], "", ""));
    for bad in [
        "GET http://a:b/ HTTP/1.1\r\nHost: a\r\n\r\n",
        "GET http://a:99999/ HTTP/1.1\r\nHost: a\r\n\r\n",
        "GET http://a%2f@b/ HTTP/1.1\r\nHost: a\r\n\r\n",
        "GET / HTTP/1.1\r\nHost: a:1:2\r\n\r\n",
        "GET / HTTP/1.1\r\nHost: [nothex]\r\n\r\n",
        "GET / HTTP/1.1\r\nHost: a]b\r\n\r\n",
    ] {
        let r = raw(p.listener("main"), bad.as_bytes());
        assert_eq!(r.status, 400, "{bad:?}: {r:?}");
    }
    for bad in [
        "GET ftp://a/ HTTP/1.1\r\nHost: a\r\n\r\n",
        "GET a/b HTTP/1.1\r\nHost: a\r\n\r\n",
    ] {
        let r = raw(p.listener("main"), bad.as_bytes());
        assert_local(&r, 400, "invalid-request-line");
    }
    assert_eq!(get(p.listener("main"), "/hello").status, 200);
    assert_eq!(o.requests(), 1);
}

// === 8. path forms ===

fn admin_config(o: &Origin, extra_http: &str) -> String {
    base_config(
        &format!("[http]\n{extra_http}\n"),
        &format!(
            r#"[[route]]
name = "public"
path = "/public/"
upstream = "app"
[route.headers]
response_set = {{ "x-route" = "public" }}

[[route]]
name = "admin"
path = "/admin/"
upstream = "app"
[route.lua]
access = '''return ngx.exit(403)'''

[[route]]
name = "rest"
upstream = "app"
[route.headers]
response_set = {{ "x-route" = "rest" }}

[upstream.app]
servers = ["{}"]
"#,
            o.addr()
        ),
    )
}

#[test]
fn no_path_form_skips_a_route_hook() {
    let o = Origin::start();
    let p = pier(&admin_config(&o, ""));
    let addr = p.listener("main");
    for path in [
        "/admin/secret",
        "/public/../admin/secret",
        "/public/%2e%2e/admin/secret",
        "/public/%2E%2E/admin/secret",
        "//admin/secret",
        "/admin%2fsecret",
        "/public/..%2fadmin/secret",
        "/%61dmin/secret",
        "/./admin/secret",
        "/public/./../admin/secret",
        "/public//..//admin/secret",
        "/%2e/admin/secret",
        "/admin%5csecret",
        "/public/..%5cadmin/secret",
    ] {
        let req = format!("GET {path} HTTP/1.1\r\nHost: pier.test\r\n\r\n");
        let r = raw(addr, req.as_bytes());
        assert!(
            r.status == 403 || (r.status == 400 && r.pier_reason() == Some("invalid-path")),
            "{path}: {} {:?} {:?}",
            r.status,
            r.headers,
            r.body_str()
        );
    }
    // Climbing above the root is refused, as nginx does.
    let r = raw(
        addr,
        b"GET /../admin/secret HTTP/1.1\r\nHost: pier.test\r\n\r\n",
    );
    assert_local(&r, 400, "invalid-path");
    assert_eq!(o.requests(), 0, "no form reached the origin");
}

/// What goes upstream is what was routed, byte for byte.
#[test]
fn the_origin_gets_the_path_the_router_matched() {
    let o = Origin::start();
    let p = pier(&admin_config(&o, ""));
    let addr = p.listener("main");
    for (sent, routed, upstream) in [
        ("/public/x/../headers", "public", "/public/headers"),
        ("/public/%68eaders?a=%2F", "public", "/public/headers?a=%2F"),
        ("//public//headers", "public", "/public/headers"),
        ("/public/./headers", "public", "/public/headers"),
        ("/x/%7e/..//headers", "rest", "/x/headers"),
        ("/a%20b/%3f/../headers", "rest", "/a%20b/headers"),
        ("/headers/%c3%a9", "rest", "/headers/%C3%A9"),
    ] {
        let req = format!("GET {sent} HTTP/1.1\r\nHost: pier.test\r\n\r\n");
        let r = raw(addr, req.as_bytes());
        assert_eq!(r.status, 200, "{sent}: {r:?}");
        assert_eq!(r.header("x-route"), Some(routed), "{sent}");
        let line = r.body_str().lines().next().unwrap_or("").to_string();
        assert_eq!(line, format!("GET {upstream} HTTP/1.1"), "{sent}");
    }
}

#[test]
fn escaped_slashes_decoded_or_kept_when_configured() {
    let o = Origin::start();
    let p = pier(&admin_config(&o, "escaped_slashes = \"decode\""));
    let r = raw(
        p.listener("main"),
        b"GET /admin%2fsecret HTTP/1.1\r\nHost: pier.test\r\n\r\n",
    );
    assert_eq!(r.status, 403, "decoded, then routed to admin");
    let r = raw(
        p.listener("main"),
        b"GET /public%2Fheaders HTTP/1.1\r\nHost: pier.test\r\n\r\n",
    );
    assert_eq!(r.header("x-route"), Some("public"));
    assert!(r.body_str().starts_with("GET /public/headers HTTP/1.1"));
    drop(p);
    let p = pier(&admin_config(&o, "escaped_slashes = \"keep\""));
    let r = raw(
        p.listener("main"),
        b"GET /headers/a%2fb HTTP/1.1\r\nHost: pier.test\r\n\r\n",
    );
    assert_eq!(r.header("x-route"), Some("rest"));
    assert!(
        r.body_str().starts_with("GET /headers/a%2Fb HTTP/1.1"),
        "{:?}",
        r.body_str()
    );
}

// === 10. forwarding headers ===

const CLIENT_FORWARDING: &[(&str, &str)] = &[
    ("Forwarded", "for=6.6.6.6;host=evil"),
    ("X-Forwarded-For", "6.6.6.6"),
    ("X-Forwarded-Proto", "https"),
    ("X-Forwarded-Host", "evil.example"),
    ("X-Forwarded-Port", "443"),
    ("X-Forwarded-Prefix", "/evil"),
    ("X-Real-IP", "6.6.6.6"),
    ("X-Original-URL", "/admin"),
    ("X-Rewrite-URL", "/admin"),
];

#[test]
fn forwarding_headers_from_a_client_are_replaced_unless_it_is_a_trusted_proxy() {
    let o = Origin::start();
    let p = pier(&simple_config(&[o.addr()], "", ""));
    let mut c = RawConn::connect(p.listener("main"));
    let r = c
        .request("GET", "/headers", CLIENT_FORWARDING, b"")
        .unwrap();
    let head = r.body_str().to_ascii_lowercase();
    for (n, _) in CLIENT_FORWARDING {
        let n = n.to_ascii_lowercase();
        assert_eq!(
            head.matches(&format!("\r\n{n}:")).count(),
            usize::from(matches!(
                n.as_str(),
                "x-forwarded-for" | "x-forwarded-proto" | "x-forwarded-host"
            )),
            "{n} in {head}"
        );
    }
    assert!(
        head.contains("\r\nx-forwarded-for: 127.0.0.1\r\n"),
        "{head}"
    );
    assert!(head.contains("\r\nx-forwarded-proto: http\r\n"), "{head}");
    assert!(
        head.contains("\r\nx-forwarded-host: pier.test\r\n"),
        "{head}"
    );
    assert!(
        !head.contains("6.6.6.6") && !head.contains("evil"),
        "{head}"
    );
    drop(p);

    // Behind a trusted proxy (here: the test itself), they are the proxy's.
    let cfg = simple_config(&[o.addr()], "", "").replace(
        "name = \"main\"\nlisten = \"127.0.0.1:0\"\n",
        "name = \"main\"\nlisten = \"127.0.0.1:0\"\ntrusted_proxies = [\"127.0.0.0/8\"]\n",
    );
    let p = pier(&cfg);
    let mut c = RawConn::connect(p.listener("main"));
    let r = c
        .request("GET", "/headers", CLIENT_FORWARDING, b"")
        .unwrap();
    let head = r.body_str().to_ascii_lowercase();
    assert!(
        head.contains("\r\nx-forwarded-for: 6.6.6.6, 127.0.0.1\r\n"),
        "{head}"
    );
    assert!(head.contains("\r\nx-forwarded-proto: https\r\n"), "{head}");
    assert!(
        head.contains("\r\nx-forwarded-host: evil.example\r\n"),
        "{head}"
    );
    assert!(head.contains("\r\nx-original-url: /admin\r\n"), "{head}");
    assert!(
        head.contains("\r\nforwarded: for=6.6.6.6;host=evil\r\n"),
        "{head}"
    );
    drop(p);

    // `[http] forwarded`: Pier's own RFC 7239 field, after a trusted proxy's.
    let p = pier(&cfg.replace("[[listener]]", "[http]\nforwarded = true\n\n[[listener]]"));
    let mut c = RawConn::connect(p.listener("main"));
    let r = c
        .request("GET", "/headers", CLIENT_FORWARDING, b"")
        .unwrap();
    let head = r.body_str().to_ascii_lowercase();
    assert!(
        head.contains(
            "\r\nforwarded: for=6.6.6.6;host=evil, for=127.0.0.1;proto=http;host=\"pier.test\"\r\n"
        ),
        "{head}"
    );
    assert_eq!(head.matches("\r\nforwarded:").count(), 1, "{head}");
}

// === 11. CONNECT and TRACE ===

#[test]
fn connect_and_trace_are_refused_with_405() {
    let o = Origin::start();
    let p = pier(&simple_config(&[o.addr()], "", ""));
    for req in [
        "CONNECT 127.0.0.1:22 HTTP/1.1\r\nHost: 127.0.0.1:22\r\n\r\n",
        "TRACE / HTTP/1.1\r\nHost: pier.test\r\n\r\n",
    ] {
        let r = raw(p.listener("main"), req.as_bytes());
        assert_local(&r, 405, "method-not-allowed");
    }
    assert_eq!(o.requests(), 0);
    drop(p);
    let p = pier(&simple_config(
        &[o.addr()],
        "[http]\nallow_trace = true",
        "",
    ));
    let r = raw(
        p.listener("main"),
        b"TRACE /hello HTTP/1.1\r\nHost: pier.test\r\n\r\n",
    );
    assert_eq!(r.status, 200);
    assert_eq!(o.requests(), 1);
}

// === the differential check ===

/// For each request form, the origin's request line and Host, the route that
/// matched and the access log's `method`, `host` and `uri` are one request.
#[test]
fn origin_router_and_access_log_agree_on_every_request_form() {
    let o = Origin::start();
    let dir = TempDir::new();
    let log = dir.path().join("access.log");
    let cfg = admin_config(&o, "").replace(
        "[log]\naccess = \"off\"",
        &format!("[log]\naccess = {:?}", log.display().to_string()),
    );
    let p = pier(&cfg);
    let addr = p.listener("main");
    // (request head, expected route, method, host, path as the origin gets it)
    let corpus: &[(&str, &str, &str, &str, &str)] = &[
        ("GET /headers HTTP/1.1\r\nHost: a.example\r\n\r\n", "rest", "GET", "a.example", "/headers"),
        ("GET http://b.example/public/headers HTTP/1.1\r\nHost: a.example\r\n\r\n", "public", "GET", "b.example", "/public/headers"),
        ("GET http://B.Example:8080?x HTTP/1.1\r\nHost: a.example\r\n\r\n", "rest", "GET", "b.example:8080", "/?x"),
        ("GET HTTP://c.example/headers?x=1 HTTP/1.1\r\nHost: a\r\n\r\n", "rest", "GET", "c.example", "/headers?x=1"),
        ("GET /public/%2E/headers HTTP/1.1\r\nHost: A.EXAMPLE.\r\n\r\n", "public", "GET", "a.example", "/public/headers"),
        ("GET //public///headers HTTP/1.1\r\nHost: a.example\r\n\r\n", "public", "GET", "a.example", "/public/headers"),
        ("HEAD /public/headers HTTP/1.1\r\nHost: a.example\r\n\r\n", "public", "HEAD", "a.example", "/public/headers"),
        ("POST /%70ublic/headers HTTP/1.1\r\nHost: a.example\r\nContent-Length: 2\r\n\r\nhi", "public", "POST", "a.example", "/public/headers"),
        ("GET /public/headers HTTP/1.0\r\nHost: a.example\r\n\r\n", "public", "GET", "a.example", "/public/headers"),
        ("GET /public/headers HTTP/1.1\r\nHost: [::1]:9\r\nConnection: x-drop\r\nX-Drop: 1\r\n\r\n", "public", "GET", "[::1]:9", "/public/headers"),
    ];
    for (i, (req, route, method, host, path)) in corpus.iter().enumerate() {
        let r = raw(addr, req.as_bytes());
        assert_eq!(r.header("x-route"), Some(*route), "{req:?}: {r:?}");
        if *method != "HEAD" && path.contains("headers") {
            let head = r.body_str();
            let mut lines = head.split("\r\n");
            assert_eq!(
                lines.next(),
                Some(format!("{method} {path} HTTP/1.1").as_str()),
                "{req:?}"
            );
            let hosts: Vec<&str> = lines
                .filter(|l| l.to_ascii_lowercase().starts_with("host:"))
                .collect();
            assert_eq!(hosts.len(), 1, "{req:?}: {head}");
            assert_eq!(hosts[0][5..].trim(), *host, "{req:?}");
            assert!(!head.to_ascii_lowercase().contains("x-drop"), "{head}");
        }
        // The access log's line for it (written as the request ends).
        let mut line = String::new();
        wait_until(Duration::from_secs(5), || {
            let text = std::fs::read_to_string(&log).unwrap_or_default();
            match text.lines().nth(i) {
                Some(l) => {
                    line = l.to_string();
                    true
                }
                None => false,
            }
        });
        let v: serde_json::Value =
            serde_json::from_str(&line).unwrap_or_else(|e| panic!("{line:?}: {e}"));
        assert_eq!(v["method"], *method, "{line}");
        assert_eq!(v["host"], *host, "{line}");
        assert_eq!(v["uri"], *path, "{line}");
        assert_eq!(v["route"], *route, "{line}");
    }
}
