//! The admin plane, closed by default (issue 31, hole 9): mutating
//! endpoints need credentials, credentials only in the Authorization
//! header, the Host must name the listener (DNS rebinding), no cross-site
//! or form POST (CSRF), no unauthenticated listener off loopback.

mod common;

use common::*;

/// A cache in front of the origin, so that a purge has something to do;
/// `admin` lines go under `[admin]`.
fn config(origin: std::net::SocketAddr, admin: &str) -> String {
    base_config(
        "[cache.main]\nmemory = \"16m\"",
        &format!(
            "[[route]]\nname = \"r\"\nupstream = \"app\"\n[route.cache]\nzone = \"main\"\n\n[upstream.app]\nservers = [\"{origin}\"]\n"
        ),
    )
    .replace(
        "[admin]\nlisten = \"127.0.0.1:0\"",
        &format!("[admin]\nlisten = \"127.0.0.1:0\"\n{admin}"),
    )
}

fn admin(p: &PierProcess, method: &str, path: &str, headers: &[(&str, &str)]) -> Response {
    let host = p.admin().to_string();
    let mut h = vec![("host", host.as_str())];
    h.extend_from_slice(headers);
    RawConn::connect(p.admin())
        .request(method, path, &h, b"")
        .unwrap_or_else(|e| panic!("admin {method} {path}: {e}"))
}

fn refused(p: &PierProcess, reason: &str) -> f64 {
    p.metric_value(&format!("pier_admin_refused_total{{reason=\"{reason}\"}}"))
        .unwrap_or(0.0)
}

/// As `refused`, on an admin endpoint that asks for this bearer token.
fn refused_with(p: &PierProcess, token: &str, reason: &str) -> f64 {
    let auth = format!("Bearer {token}");
    let r = admin(p, "GET", "/metrics", &[("authorization", &auth)]);
    assert_eq!(r.status, 200);
    let want = format!("pier_admin_refused_total{{reason=\"{reason}\"}} ");
    r.body_str()
        .lines()
        .find_map(|l| l.strip_prefix(&want).and_then(|v| v.parse().ok()))
        .unwrap_or(0.0)
}

#[test]
fn purge_needs_credentials_even_on_loopback() {
    let o = Origin::start();
    let p = pier(&config(o.addr(), ""));
    let r = admin(&p, "POST", "/api/cache/purge?prefix=http://", &[]);
    assert_eq!(r.status, 403, "{}", r.body_str());
    assert!(r.body_str().contains("[admin] token"), "{}", r.body_str());
    assert_eq!(refused(&p, "no_credentials"), 1.0);
    // Read-only endpoints answer on loopback without a token, as nginx's
    // stub_status does.
    assert_eq!(admin(&p, "GET", "/metrics", &[]).status, 200);
    assert_eq!(admin(&p, "GET", "/api/status", &[]).status, 200);
}

#[test]
fn an_admin_listener_off_loopback_needs_credentials() {
    let o = Origin::start();
    let open = config(o.addr(), "").replace(
        "[admin]\nlisten = \"127.0.0.1:0\"",
        "[admin]\nlisten = \"0.0.0.0:0\"",
    );
    let Err(e) = PierProcess::launch(bin(), Some(&open), &["serve", "-c", "{config}"]) else {
        panic!("an open admin listener must not start");
    };
    assert!(e.contains("[admin] token"), "{e}");
    // With a token it starts.
    let closed = open.replace(
        "[admin]\nlisten = \"0.0.0.0:0\"",
        "[admin]\nlisten = \"0.0.0.0:0\"\ntoken = \"tok-0123456789\"",
    );
    let p = pier(&closed);
    assert_eq!(get(p.admin(), "/healthz").status, 200);
}

#[test]
fn quick_mode_takes_an_admin_token() {
    let o = Origin::start();
    let to = o.addr().to_string();
    let quick = |extra: &[&str]| {
        let mut a = vec![
            "proxy",
            "--listen",
            "127.0.0.1:0",
            "--to",
            &to,
            "--cache",
            "1m",
        ];
        a.extend_from_slice(extra);
        a.iter().map(|s| s.to_string()).collect::<Vec<_>>()
    };
    let args = quick(&["--admin", "0.0.0.0:0"]);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let Err(e) = PierProcess::launch(bin(), None, &args) else {
        panic!("--admin off loopback without a token must not start");
    };
    assert!(e.contains("--admin-token"), "{e}");
    let args = quick(&["--admin", "127.0.0.1:0", "--admin-token", "tok-0123456789"]);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let p = PierProcess::start_args(bin(), &args);
    assert_eq!(get(p.listener("main"), "/hello").status, 200);
    assert_eq!(
        admin(&p, "POST", "/api/cache/purge?prefix=http://", &[]).status,
        401
    );
    let r = admin(
        &p,
        "POST",
        "/api/cache/purge?prefix=http://",
        &[("authorization", "Bearer tok-0123456789")],
    );
    assert_eq!(r.status, 200, "{}", r.body_str());
}

/// DNS rebinding: a page on a name that re-resolves to 127.0.0.1 sends
/// that name as Host; only the listener's own names are answered.
#[test]
fn the_host_must_name_the_admin_listener() {
    let o = Origin::start();
    let p = pier(&config(o.addr(), ""));
    let port = p.admin().port();
    let get_with = |host: &str| {
        RawConn::connect(p.admin())
            .request("GET", "/metrics", &[("host", host)], b"")
            .unwrap()
            .status
    };
    for bad in [
        "evil.example",
        "evil.example:9901",
        "127.0.0.1.evil.example",
        "10.1.2.3",
        "[::2]",
    ] {
        assert_eq!(get_with(bad), 421, "Host: {bad}");
    }
    for good in [
        format!("127.0.0.1:{port}"),
        "127.0.0.1".into(),
        "localhost".into(),
        format!("LocalHost:{port}"),
        format!("[::1]:{port}"),
    ] {
        assert_eq!(get_with(&good), 200, "Host: {good}");
    }
    assert_eq!(refused(&p, "host"), 5.0);
    // Health checks are answered whatever the Host.
    assert_eq!(get(p.admin(), "/healthz").status, 200);
}

/// CSRF: with basic credentials a browser remembers, a form or a no-cors
/// fetch on another site could POST a purge. Refused: a form's content
/// types, a cross-site Origin or Sec-Fetch-Site. Credentials only in the
/// Authorization header, never a query string or a cookie.
#[test]
fn no_cross_site_purge() {
    let o = Origin::start();
    let p = pier(&config(
        o.addr(),
        "token = \"tok-0123456789\"\nuser = \"ops\"\npassword = \"pw\"",
    ));
    let basic = ("authorization", "Basic b3BzOnB3");
    let purge = |headers: &[(&str, &str)]| {
        let host = p.admin().to_string();
        let mut h = vec![("host", host.as_str())];
        h.extend_from_slice(headers);
        RawConn::connect(p.admin())
            .request("POST", "/api/cache/purge", &h, b"{\"prefix\": \"http://\"}")
            .unwrap()
    };
    let origin_self = format!("http://{}", p.admin());
    for (what, h) in [
        (
            "a form",
            vec![basic, ("content-type", "application/x-www-form-urlencoded")],
        ),
        (
            "a multipart form",
            vec![basic, ("content-type", "multipart/form-data; boundary=x")],
        ),
        (
            "text/plain",
            vec![basic, ("content-type", "text/plain;charset=UTF-8")],
        ),
        (
            "another origin",
            vec![
                basic,
                ("content-type", "application/json"),
                ("origin", "http://evil.example"),
            ],
        ),
        (
            "origin null",
            vec![
                basic,
                ("content-type", "application/json"),
                ("origin", "null"),
            ],
        ),
        (
            "same-site",
            vec![
                basic,
                ("content-type", "application/json"),
                ("sec-fetch-site", "same-site"),
            ],
        ),
    ] {
        let r = purge(&h);
        assert_eq!(r.status, 403, "{what}: {}", r.body_str());
    }
    assert_eq!(refused_with(&p, "tok-0123456789", "cross_site"), 6.0);
    // Credentials in a query string or a cookie are none.
    let r = RawConn::connect(p.admin())
        .request(
            "POST",
            "/api/cache/purge?prefix=http://&token=tok-0123456789",
            &[("host", &p.admin().to_string())],
            b"",
        )
        .unwrap();
    assert_eq!(r.status, 401);
    let r = purge(&[
        ("cookie", "pier_admin_token=tok-0123456789"),
        ("content-type", "application/json"),
    ]);
    assert_eq!(r.status, 401);
    // The page's own request (same origin, JSON) and a script's go through.
    let r = purge(&[
        basic,
        ("content-type", "application/json"),
        ("origin", &origin_self),
        ("sec-fetch-site", "same-origin"),
    ]);
    assert_eq!(r.status, 200, "{}", r.body_str());
    let r = purge(&[
        ("authorization", "Bearer tok-0123456789"),
        ("content-type", "application/json"),
    ]);
    assert_eq!(r.status, 200, "{}", r.body_str());
}

/// `[admin] hosts`: more names for the admin endpoint (behind a name).
#[test]
fn admin_hosts_lists_more_names() {
    let o = Origin::start();
    let p = pier(&config(o.addr(), "hosts = [\"admin.example\"]"));
    let status = |host: &str| {
        RawConn::connect(p.admin())
            .request("GET", "/metrics", &[("host", host)], b"")
            .unwrap()
            .status
    };
    assert_eq!(status("admin.example"), 200);
    assert_eq!(status("ADMIN.example.:9901"), 200);
    assert_eq!(status("other.example"), 421);
}

/// `[admin.tls]`: the admin plane over HTTPS, with a listener's TLS
/// settings; credentials and the Host check hold over it as over plain
/// HTTP, and plain HTTP to it gets the TLS port's 400.
#[test]
fn the_admin_plane_serves_https() {
    use pier_test_support::tls::{Alg, TestCa, TlsClient, TlsClientConfig};
    let dir = TempDir::new();
    let ca = TestCa::new(dir.path(), "admin");
    let cert = ca.server("admin", &["localhost"], Alg::EcdsaP256, 30);
    let o = Origin::start();
    let p = pier(&config(
        o.addr(),
        &format!(
            "token = \"tok-0123456789\"\n[admin.tls]\ncert = \"{}\"\nkey = \"{}\"\n",
            cert.cert.display(),
            cert.key.display()
        ),
    ));
    let tls = TlsClientConfig::new(&ca.cert, None, &["http/1.1"], None);
    let mut c = TlsClient::connect(p.admin(), "localhost", &tls).expect("TLS handshake");
    assert_eq!(c.conn().alpn_protocol(), Some(&b"http/1.1"[..]));
    let r = c.get("localhost", "/healthz").expect("healthz over TLS");
    assert_eq!(r.status, 200, "{}", r.body_str());
    // The same connection, the next request: credentials are still asked for.
    let r = c.get("localhost", "/api/status").expect("status over TLS");
    assert_eq!(r.status, 401, "{}", r.body_str());
    // A Host that names another site is refused over TLS too.
    let mut c = TlsClient::connect(p.admin(), "localhost", &tls).expect("TLS handshake");
    let r = c
        .get("evil.example", "/api/status")
        .expect("status, foreign Host");
    assert_eq!(r.status, 421, "{}", r.body_str());
    // Plain HTTP to the HTTPS admin port.
    let r = RawConn::connect(p.admin())
        .request("GET", "/healthz", &[("host", "localhost")], b"")
        .expect("plain request");
    assert_eq!(r.status, 400, "{}", r.body_str());
}
