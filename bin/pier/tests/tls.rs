//! TLS on both sides (issue 9), with real clients: a rustls client, curl and
//! `openssl s_client`. Certificates are made at test time (rcgen), in the
//! test's own directory.

mod common;

use std::net::SocketAddr;
use std::path::Path;
use std::process::Command;
use std::time::Duration;

use common::*;
use pier_test_support::tls::{cert_der, Alg, CertPair, TestCa, TlsClient, TlsClientConfig};

fn p(path: &Path) -> String {
    path.display().to_string()
}

/// A config with one TLS listener `main` (its `[listener.tls]` body given)
/// proxying to `origin`.
fn tls_config(origin: SocketAddr, tls: &str, top: &str) -> String {
    let top = if top.contains("[log]") {
        top.to_string()
    } else {
        format!("[log]\naccess = \"off\"\n{top}")
    };
    format!(
        r#"[server]
workers = 2
grace_period = "5s"

[admin]
listen = "127.0.0.1:0"

{top}

[[listener]]
name = "main"
listen = "127.0.0.1:0"
[listener.tls]
{tls}

[[route]]
name = "default"
upstream = "app"

[upstream.app]
servers = ["{origin}"]
"#
    )
}

/// A test CA in a temp dir of its own, and a `site.test` certificate from it.
struct Site {
    dir: TempDir,
    ca: TestCa,
    cert: CertPair,
}

impl Site {
    fn new() -> Site {
        let dir = TempDir::new();
        let ca = TestCa::new(dir.path(), "pier");
        let cert = ca.server("site", &["site.test"], Alg::EcdsaP256, 30);
        Site { dir, ca, cert }
    }
}

/// A `[listener.tls]` body: this certificate and key, then `extra` lines.
fn tls_lines(cert: &CertPair, extra: &str) -> String {
    format!(
        "cert = \"{}\"\nkey = \"{}\"\n{extra}",
        p(&cert.cert),
        p(&cert.key)
    )
}

fn client(ca: &Path) -> TlsClientConfig {
    TlsClientConfig::new(ca, None, &["http/1.1"], None)
}

/// `openssl s_client` against `addr` with extra args; its stdout+stderr.
fn s_client(addr: SocketAddr, args: &[&str]) -> String {
    let out = run_with_timeout(
        Command::new("openssl")
            .args(["s_client", "-connect", &addr.to_string()])
            .args(args)
            .stdin(std::process::Stdio::null()),
        Duration::from_secs(20),
    );
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

#[test]
fn certificates_by_sni_exact_wildcard_and_default() {
    let dir = TempDir::new();
    let ca = TestCa::new(dir.path(), "pier");
    let default = ca.server("default", &["default.test"], Alg::EcdsaP256, 30);
    let exact = ca.server("exact", &["a.example.test"], Alg::EcdsaP384, 30);
    let wild = ca.server("wild", &["*.wild.test"], Alg::Ed25519, 30);
    let o = Origin::start_named("alpha");
    let tls = format!(
        "cert = \"{}\"\nkey = \"{}\"\ncertificates = [{{ cert = \"{}\", key = \"{}\" }}, {{ cert = \"{}\", key = \"{}\" }}]",
        p(&default.cert),
        p(&default.key),
        p(&exact.cert),
        p(&exact.key),
        p(&wild.cert),
        p(&wild.key)
    );
    let pier = pier(&tls_config(o.addr(), &tls, ""));
    let addr = pier.listener("main");
    let cfg = client(&ca.cert);
    for (sni, want) in [
        ("a.example.test", &exact),
        ("x.wild.test", &wild),
        ("default.test", &default),
    ] {
        let mut c = TlsClient::connect(addr, sni, &cfg).unwrap();
        assert_eq!(c.peer_cert(), cert_der(&want.cert), "certificate for {sni}");
        let r = c.get(sni, "/headers").unwrap();
        assert_eq!(r.status, 200);
        // The origin learns the request came over https.
        assert!(
            r.body_str()
                .to_ascii_lowercase()
                .contains("x-forwarded-proto: https"),
            "{}",
            r.body_str()
        );
    }
    // A wildcard covers one label only; unknown names get the default
    // certificate (which the client then refuses: wrong name).
    let deep = TlsClient::connect(addr, "a.b.wild.test", &cfg);
    assert!(deep.is_err(), "a.b.wild.test must not match *.wild.test");
    let out = s_client(addr, &["-servername", "unknown.test"]);
    assert!(out.contains("CN = default.test"), "{out}");
    // curl, verifying against the test CA.
    let out = curl(&[
        "--cacert",
        &p(&ca.cert),
        "--resolve",
        &format!("a.example.test:{}:127.0.0.1", addr.port()),
        &format!("https://a.example.test:{}/hello", addr.port()),
    ]);
    assert_eq!(String::from_utf8_lossy(&out.stdout), "hello world\n");
}

#[test]
fn unknown_sni_refused_when_configured() {
    let dir = TempDir::new();
    let ca = TestCa::new(dir.path(), "pier");
    let only = ca.server("only", &["only.test"], Alg::EcdsaP256, 30);
    let o = Origin::start();
    let tls = format!(
        "cert = \"{}\"\nkey = \"{}\"\nunknown_sni = \"refuse\"",
        p(&only.cert),
        p(&only.key)
    );
    let pier = pier(&tls_config(o.addr(), &tls, ""));
    let addr = pier.listener("main");
    let cfg = client(&ca.cert);
    assert!(TlsClient::connect(addr, "other.test", &cfg).is_err());
    assert!(wait_until(Duration::from_secs(10), || pier.metric_value(
        "pier_tls_handshake_failures_total{reason=\"unknown_sni\"}"
    ) == Some(1.0)));
    let mut c = TlsClient::connect(addr, "only.test", &cfg).unwrap();
    assert_eq!(c.get("only.test", "/hello").unwrap().status, 200);
}

#[test]
fn rsa_or_ecdsa_by_what_the_client_supports() {
    let dir = TempDir::new();
    let ca = TestCa::new(dir.path(), "pier");
    let ec = ca.server("dual-ec", &["dual.test"], Alg::EcdsaP256, 30);
    let rsa = ca.server("dual-rsa", &["dual.test"], Alg::Rsa2048, 30);
    let o = Origin::start();
    let tls = format!(
        "certificates = [{{ cert = \"{}\", key = \"{}\" }}, {{ cert = \"{}\", key = \"{}\" }}]",
        p(&ec.cert),
        p(&ec.key),
        p(&rsa.cert),
        p(&rsa.key)
    );
    let pier = pier(&tls_config(o.addr(), &tls, ""));
    let addr = pier.listener("main");
    use rustls::SignatureScheme as S;
    let only_rsa = TlsClientConfig::new(
        &ca.cert,
        None,
        &[],
        Some(vec![S::RSA_PSS_SHA256, S::RSA_PKCS1_SHA256]),
    );
    let only_ec = TlsClientConfig::new(&ca.cert, None, &[], Some(vec![S::ECDSA_NISTP256_SHA256]));
    let c = TlsClient::connect(addr, "dual.test", &only_rsa).unwrap();
    assert_eq!(c.peer_cert(), cert_der(&rsa.cert));
    let c = TlsClient::connect(addr, "dual.test", &only_ec).unwrap();
    assert_eq!(c.peer_cert(), cert_der(&ec.cert));
    let c = TlsClient::connect(addr, "dual.test", &client(&ca.cert)).unwrap();
    assert_eq!(
        c.peer_cert(),
        cert_der(&ec.cert),
        "listed first, and supported"
    );
    // openssl says the same.
    let out = s_client(
        addr,
        &[
            "-servername",
            "dual.test",
            "-sigalgs",
            "RSA-PSS+SHA256",
            "-tls1_3",
        ],
    );
    assert!(out.contains("Peer signature type: RSA-PSS"), "{out}");
}

#[test]
fn alpn_versions_and_resumption() {
    let Site {
        dir: _dir,
        ca,
        cert,
    } = Site::new();
    let o = Origin::start();
    let tls = tls_lines(&cert, "");
    let pier = pier(&tls_config(o.addr(), &tls, ""));
    let addr = pier.listener("main");
    let cfg = client(&ca.cert);
    let mut first = TlsClient::connect(addr, "site.test", &cfg).unwrap();
    assert_eq!(first.conn().alpn_protocol(), Some(&b"http/1.1"[..]));
    assert_eq!(
        first.conn().protocol_version(),
        Some(rustls::ProtocolVersion::TLSv1_3)
    );
    // Reading a response also takes in the session tickets sent after the handshake.
    assert_eq!(first.get("site.test", "/hello").unwrap().status, 200);
    assert!(!first.resumed());
    // The same client config resumes with a ticket (any worker takes it).
    for _ in 0..4 {
        let mut again = TlsClient::connect(addr, "site.test", &cfg).unwrap();
        assert!(again.resumed(), "ticket resumption");
        assert_eq!(again.get("site.test", "/hello").unwrap().status, 200);
    }
    // TLS 1.2 session-ID resumption through the session cache, as openssl shows.
    let out = s_client(addr, &["-servername", "site.test", "-tls1_2", "-reconnect"]);
    assert!(out.contains("Reused, TLSv1.2"), "{out}");
    assert!(
        pier.metric_sum("pier_tls_handshakes_total", &[("result", "resumed")]) >= 4.0,
        "{}",
        pier.metrics()
    );
    // min_version = "1.3" refuses TLS 1.2.
    let tls13 = format!("{tls}\nmin_version = \"1.3\"");
    let pier13 = common::pier(&tls_config(o.addr(), &tls13, ""));
    let out = s_client(
        pier13.listener("main"),
        &["-servername", "site.test", "-tls1_2"],
    );
    assert!(!out.contains("New, TLSv1.2"), "{out}");
    assert!(wait_until(Duration::from_secs(10), || pier13
        .metric_value("pier_tls_handshake_failures_total{reason=\"no_shared_cipher\"}")
        .unwrap_or(0.0)
        >= 1.0));
}

#[test]
fn client_certificates_required_and_optional() {
    let dir = TempDir::new();
    let ca = TestCa::new(dir.path(), "pier");
    let other_ca = TestCa::new(dir.path(), "stranger");
    let cert = ca.server("site", &["site.test"], Alg::EcdsaP256, 30);
    let alice = ca.client("alice", "alice");
    let mallory = other_ca.client("mallory", "mallory");
    let o = Origin::start();
    let log = dir.path().join("access.log");
    for mode in ["required", "optional"] {
        let tls = format!(
            "cert = \"{}\"\nkey = \"{}\"\nclient_ca = \"{}\"\nclient_auth = \"{mode}\"",
            p(&cert.cert),
            p(&cert.key),
            p(&ca.cert)
        );
        let _ = std::fs::remove_file(&log);
        let pier = pier(&tls_config(
            o.addr(),
            &tls,
            &format!("[log]\naccess = \"{}\"", p(&log)),
        ));
        let addr = pier.listener("main");
        let with = TlsClientConfig::new(&ca.cert, Some(&alice), &[], None);
        let mut c = TlsClient::connect(addr, "site.test", &with).unwrap();
        assert_eq!(c.get("site.test", "/hello").unwrap().status, 200);
        // A certificate from another CA is refused either way.
        let bad = TlsClientConfig::new(&ca.cert, Some(&mallory), &[], None);
        let refused = TlsClient::connect(addr, "site.test", &bad)
            .and_then(|mut c| c.get("site.test", "/hello"));
        assert!(refused.is_err(), "{mode}: a stranger's certificate got in");
        // Without one: refused when required, let in when optional.
        let none = client(&ca.cert);
        let anon = TlsClient::connect(addr, "site.test", &none)
            .and_then(|mut c| c.get("site.test", "/hello"));
        assert_eq!(anon.is_ok(), mode == "optional", "{mode}");
        assert!(wait_until(Duration::from_secs(10), || pier
            .metric_value("pier_tls_handshake_failures_total{reason=\"bad_client_cert\"}")
            .unwrap_or(0.0)
            >= 1.0));
        // The verified subject reaches the access log.
        assert!(wait_until(Duration::from_secs(10), || {
            std::fs::read_to_string(&log)
                .map(|s| s.contains("CN=alice"))
                .unwrap_or(false)
        }));
        let line = std::fs::read_to_string(&log).unwrap();
        // Workers flush their own buffers: find alice's line, not the first.
        let alices = line.lines().find(|l| l.contains("CN=alice")).unwrap();
        let first: serde_json::Value = serde_json::from_str(alices).unwrap();
        assert_eq!(first["tls"]["version"], "TLSv1.3");
        assert_eq!(first["tls"]["sni"], "site.test");
        assert_eq!(first["tls"]["alpn"], "");
    }
}

#[test]
fn plain_http_on_the_tls_port_gets_400() {
    let Site {
        dir: _dir,
        ca: _ca,
        cert,
    } = Site::new();
    let o = Origin::start();
    let tls = tls_lines(&cert, "");
    let pier = pier(&tls_config(o.addr(), &tls, ""));
    let mut c = RawConn::connect(pier.listener("main"));
    let r = c.get("/hello").unwrap();
    assert_eq!(r.status, 400);
    assert_eq!(
        r.body_str(),
        "The plain HTTP request was sent to HTTPS port\n"
    );
    assert!(c.is_closed(Duration::from_secs(10)));
    // Counted once the connection is done (after the answer went out).
    assert!(wait_until(Duration::from_secs(10), || pier.metric_value(
        "pier_tls_handshake_failures_total{reason=\"not_tls\"}"
    ) == Some(1.0)));
    assert_eq!(o.requests(), 0);
}

#[test]
fn stalled_handshakes_time_out_and_a_flood_is_bounded() {
    let Site {
        dir: _dir,
        ca,
        cert,
    } = Site::new();
    let o = Origin::start();
    let tls = tls_lines(&cert, "handshake_timeout = \"1s\"\nmax_handshakes = 16");
    let pier = pier(&tls_config(o.addr(), &tls, ""));
    let addr = pier.listener("main");
    let rss_before = pier.rss_kib().unwrap_or(0);
    // 300 connections that start a TLS record and never finish it.
    let mut stalled = Vec::new();
    for _ in 0..300 {
        let mut c = RawConn::connect(addr);
        c.send(&[0x16, 0x03, 0x01, 0x02, 0x00, 0x01]);
        stalled.push(c);
    }
    // No ClientHello, so no handshake slot (issue 31): all of them wait,
    // and close at the timeout.
    assert!(wait_until(Duration::from_secs(20), || {
        pier.metric_value("pier_tls_handshake_failures_total{reason=\"timeout\"}")
            .unwrap_or(0.0)
            >= 300.0
    }));
    assert_eq!(
        pier.metric_value("pier_tls_handshake_failures_total{reason=\"overload\"}"),
        Some(0.0)
    );
    for c in stalled.iter_mut() {
        assert!(c.is_closed(Duration::from_secs(10)));
    }
    if let (Some(after), true) = (pier.rss_kib(), rss_before > 0) {
        assert!(
            after < rss_before + 32 * 1024,
            "RSS grew from {rss_before} to {after} KiB"
        );
    }
    // Served connections are not affected.
    let mut c = TlsClient::connect(addr, "site.test", &client(&ca.cert)).unwrap();
    assert_eq!(c.get("site.test", "/hello").unwrap().status, 200);
}

#[test]
fn reload_swaps_the_certificate_without_dropping_connections() {
    let dir = TempDir::new();
    let ca = TestCa::new(dir.path(), "pier");
    let old = ca.server("old", &["site.test"], Alg::EcdsaP256, 30);
    let new = ca.server("new", &["site.test"], Alg::EcdsaP256, 60);
    let o = Origin::start();
    let tls_old = format!("cert = \"{}\"\nkey = \"{}\"", p(&old.cert), p(&old.key));
    let mut pier = pier(&tls_config(o.addr(), &tls_old, ""));
    let addr = pier.listener("main");
    let cfg = client(&ca.cert);
    let mut open = TlsClient::connect(addr, "site.test", &cfg).unwrap();
    assert_eq!(open.get("site.test", "/hello").unwrap().status, 200);
    assert_eq!(open.peer_cert(), cert_der(&old.cert));

    // A config whose certificate does not load is refused; the old one stays.
    let broken = format!("cert = \"{}\"\nkey = \"{}\"", p(&old.cert), p(&new.key));
    pier.rewrite_config(&tls_config(o.addr(), &broken, ""));
    pier.signal(sig::SIGHUP);
    assert!(wait_until(Duration::from_secs(10), || pier
        .logs()
        .contains("does not belong")));
    let tls_new = format!("cert = \"{}\"\nkey = \"{}\"", p(&new.cert), p(&new.key));
    pier.rewrite_config(&tls_config(o.addr(), &tls_new, ""));
    let g = pier.generation();
    pier.signal(sig::SIGHUP);
    pier.wait_generation(g + 1);
    // New handshakes get the new certificate...
    let fresh = TlsClient::connect(addr, "site.test", &client(&ca.cert)).unwrap();
    assert_eq!(fresh.peer_cert(), cert_der(&new.cert));
    // ...and the connection opened before the reload still works.
    assert_eq!(open.get("site.test", "/hello").unwrap().status, 200);
}

/// Pier B serves TLS in front of the origin; Pier A proxies to B over TLS.
fn tls_origin(ca: &TestCa, dir: &Path, client_ca: Option<&Path>) -> (Origin, PierProcess) {
    let cert = ca.server("origin", &["origin.test", "127.0.0.1"], Alg::EcdsaP256, 30);
    let _ = dir;
    let o = Origin::start_named("behind-tls");
    let mut tls = tls_lines(&cert, "");
    if let Some(ca) = client_ca {
        tls.push_str(&format!("\nclient_ca = \"{}\"", p(ca)));
    }
    let b = pier(&tls_config(o.addr(), &tls, ""));
    (o, b)
}

#[test]
fn upstream_tls_verifies_the_origin() {
    let dir = TempDir::new();
    let ca = TestCa::new(dir.path(), "pier");
    let stranger = TestCa::new(dir.path(), "stranger");
    let (o, b) = tls_origin(&ca, dir.path(), None);
    let cases = [
        // (tls table, expected status)
        (
            format!("server_name = \"origin.test\"\nca = \"{}\"", p(&ca.cert)),
            200,
        ),
        // No server_name: the address, checked against the IP SAN.
        (format!("ca = \"{}\"", p(&ca.cert)), 200),
        (
            format!("server_name = \"wrong.test\"\nca = \"{}\"", p(&ca.cert)),
            502,
        ),
        (
            format!(
                "server_name = \"origin.test\"\nca = \"{}\"",
                p(&stranger.cert)
            ),
            502,
        ),
        (
            format!(
                "server_name = \"wrong.test\"\nca = \"{}\"\nverify = false",
                p(&stranger.cert)
            ),
            200,
        ),
    ];
    for (table, want) in cases {
        let a = pier(&simple_config(
            &[b.listener("main")],
            "",
            &format!("retries = 0\n[upstream.app.tls]\n{table}"),
        ));
        let mut c = RawConn::connect(a.listener("main"));
        for _ in 0..3 {
            let r = c.get("/hello").unwrap();
            assert_eq!(r.status, want, "{table}: {r:?}");
            if want == 200 {
                assert_eq!(r.header("x-origin"), Some("behind-tls"));
            } else {
                assert_local(&r, 502, "upstream-tls");
            }
        }
        if want == 200 {
            // One TLS connection, reused from the pool.
            assert_eq!(
                a.metric_value("pier_tls_upstream_handshakes_total{result=\"ok\"}"),
                Some(1.0),
                "{table}"
            );
        }
    }
    assert!(o.requests() >= 9);
}

#[test]
fn upstream_mtls_and_resumption() {
    let dir = TempDir::new();
    let ca = TestCa::new(dir.path(), "pier");
    let (_o, b) = tls_origin(&ca, dir.path(), Some(&ca.cert));
    let edge = ca.client("edge", "pier-edge");
    let base = format!("server_name = \"origin.test\"\nca = \"{}\"", p(&ca.cert));
    // Without a client certificate the origin refuses.
    let a = pier(&simple_config(
        &[b.listener("main")],
        "",
        &format!("retries = 0\n[upstream.app.tls]\n{base}"),
    ));
    let r = RawConn::connect(a.listener("main")).get("/hello").unwrap();
    assert_eq!(r.status, 502, "{r:?}");
    // With one, it answers; connections closed by the client resume.
    let a = pier(&simple_config(
        &[b.listener("main")],
        "",
        &format!(
            "retries = 0\npool_idle_per_server = 0\n[upstream.app.tls]\n{base}\ncert = \"{}\"\nkey = \"{}\"",
            p(&edge.cert),
            p(&edge.key)
        ),
    ));
    for _ in 0..4 {
        // No idle pool (pool_idle_per_server = 0): every request makes a
        // new TLS connection to B, which resumes the last session.
        let r = RawConn::connect(a.listener("main")).get("/hello").unwrap();
        assert_eq!(r.status, 200, "{r:?}");
    }
    assert!(
        a.metric_value("pier_tls_upstream_handshakes_total{result=\"resumed\"}")
            .unwrap_or(0.0)
            >= 1.0,
        "{}",
        a.metrics()
    );
}

#[test]
fn redirect_to_https() {
    let o = Origin::start();
    let cfg = simple_config(&[o.addr()], "", "").replace(
        "name = \"main\"\nlisten = \"127.0.0.1:0\"\n",
        "name = \"main\"\nlisten = \"127.0.0.1:0\"\nredirect_https = 308\nhttps_port = 8443\n",
    );
    let pier = pier(&cfg);
    let mut c = RawConn::connect(pier.listener("main"));
    let r = c
        .request("GET", "/a/b?c=d", &[("Host", "shop.test:8080")], b"")
        .unwrap();
    assert_eq!(r.status, 308);
    assert_eq!(r.header("location"), Some("https://shop.test:8443/a/b?c=d"));
    assert_eq!(o.requests(), 0);
}

/// A connection Pier closes ends with a TLS close_notify, not a bare FIN:
/// without it OpenSSL clients treat the close as a truncation and drop the
/// session instead of resuming it (`openssl s_time -reuse` never resumed).
#[test]
fn closing_sends_close_notify() {
    let Site {
        dir: _dir,
        ca,
        cert,
    } = Site::new();
    let o = Origin::start();
    let pier = pier(&tls_config(o.addr(), &tls_lines(&cert, ""), ""));
    let cfg = client(&ca.cert);
    let mut c = TlsClient::connect(pier.listener("main"), "site.test", &cfg).unwrap();
    let all = c
        .get_until_close("site.test", "/hello")
        .expect("a clean TLS close (close_notify), not a truncation");
    let text = String::from_utf8_lossy(&all);
    assert!(text.starts_with("HTTP/1.1 200"), "{text}");
    assert!(text.ends_with("hello world\n"), "{text}");
}

/// Active health checks of a TLS upstream go over TLS, verified as its
/// traffic is: a cleartext check to the TLS port would mark every server
/// down (and did: the origin's 400 to plain HTTP failed the check).
#[test]
fn health_checks_of_a_tls_upstream_use_tls() {
    let dir = TempDir::new();
    let ca = TestCa::new(dir.path(), "pier");
    let (o, b) = tls_origin(&ca, dir.path(), None);
    let healthy = |a: &PierProcess| {
        a.metrics()
            .lines()
            .find(|l| l.starts_with("pier_upstream_healthy{upstream=\"app\""))
            .and_then(|l| l.rsplit(' ').next())
            .map(|v| v.trim().to_string())
    };
    // fall = 1: a generous check timeout, so that one slow handshake on a
    // loaded machine does not take the server down between the reads below.
    let check = "[upstream.app.health_check]\ntype = \"http\"\npath = \"/hello\"\ninterval = \"50ms\"\ntimeout = \"10s\"\nrise = 1\nfall = 1\n";
    let a = pier(&simple_config(
        &[b.listener("main")],
        "",
        &format!(
            "retries = 0\n[upstream.app.tls]\nserver_name = \"origin.test\"\nca = \"{}\"\n{check}",
            p(&ca.cert)
        ),
    ));
    // The checks reach the origin behind `b`'s TLS, and the server stays up.
    assert!(
        wait_until(Duration::from_secs(20), || o.requests() >= 3),
        "no check got through: {}",
        a.logs()
    );
    assert_eq!(healthy(&a).as_deref(), Some("1"), "{}", a.metrics());
    let r = RawConn::connect(a.listener("main")).get("/hello").unwrap();
    assert_eq!(r.status, 200);
    // Verified like requests: a name the certificate lacks fails the checks.
    let bad = pier(&simple_config(
        &[b.listener("main")],
        "",
        &format!(
            "retries = 0\n[upstream.app.tls]\nserver_name = \"wrong.test\"\nca = \"{}\"\n{check}",
            p(&ca.cert)
        ),
    ));
    assert!(
        wait_until(Duration::from_secs(20), || healthy(&bad).as_deref()
            == Some("0")),
        "{}",
        bad.metrics()
    );
    assert!(bad.logs().contains("tls:"), "{}", bad.logs());
}

#[test]
fn quick_mode_https_both_sides() {
    let dir = TempDir::new();
    let ca = TestCa::new(dir.path(), "pier");
    let front = ca.server("front", &["localhost"], Alg::EcdsaP256, 30);
    let (o, b) = tls_origin(&ca, dir.path(), None);
    let b_port = b.listener("main").port();
    // `localhost` is not in the origin's certificate; its IP is. A URL with
    // an IP address sends no SNI and is verified against the IP SAN.
    let a = PierProcess::start_args(
        bin(),
        &[
            "proxy",
            "--listen",
            "127.0.0.1:0",
            "--tls-cert",
            &p(&front.cert),
            "--tls-key",
            &p(&front.key),
            "--to",
            &format!("https://127.0.0.1:{b_port}"),
            "--upstream-ca",
            &p(&ca.cert),
        ],
    );
    let port = a.listener("main").port();
    let out = curl(&[
        "--cacert",
        &p(&ca.cert),
        "-D",
        "-",
        &format!("https://localhost:{port}/hello"),
    ]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("x-origin: behind-tls"), "{text}");
    assert!(text.ends_with("hello world\n"), "{text}");
    assert!(o.requests() >= 1);
    assert!(a.logs().contains("listening on https://"));
}

#[test]
fn check_verifies_keys_and_warns_about_expiry() {
    let dir = TempDir::new();
    let ca = TestCa::new(dir.path(), "pier");
    let good = ca.server("good", &["good.test"], Alg::EcdsaP256, 5);
    let other = ca.server("other", &["other.test"], Alg::EcdsaP256, 30);
    let run = |tls: &str| {
        let cfg = dir.write(
            "check.toml",
            &tls_config("127.0.0.1:9".parse().unwrap(), tls, ""),
        );
        run_with_timeout(
            Command::new(bin()).args(["check", "-c", &p(&cfg)]),
            Duration::from_secs(20),
        )
    };
    let out = run(&format!(
        "cert = \"{}\"\nkey = \"{}\"",
        p(&good.cert),
        p(&good.key)
    ));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    assert!(
        err.contains("expires in 4 days") || err.contains("expires in 5 days"),
        "{err}"
    );
    let out = run(&format!(
        "cert = \"{}\"\nkey = \"{}\"",
        p(&good.cert),
        p(&other.key)
    ));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        err.contains("the key does not belong to the certificate"),
        "{err}"
    );
    let out = run(&format!(
        "cert = \"{}\"\nkey = \"{}\"",
        p(&dir.path().join("missing.pem")),
        p(&good.key)
    ));
    assert!(!out.status.success());
    // The expiry gauge.
    let o = Origin::start();
    let pier = pier(&tls_config(
        o.addr(),
        &format!("cert = \"{}\"\nkey = \"{}\"", p(&good.cert), p(&good.key)),
        "",
    ));
    let left = pier
        .metric_value("pier_tls_certificate_expiry_seconds{listener=\"main\",name=\"good.test\"}")
        .unwrap();
    assert!(left > 3.0 * 86_400.0 && left <= 5.0 * 86_400.0, "{left}");
    let _ = CertPair {
        cert: good.cert.clone(),
        key: good.key.clone(),
    };
}

#[test]
fn lua_reads_tls_variables() {
    let Site {
        dir: _dir,
        ca,
        cert,
    } = Site::new();
    let alice = ca.client("alice", "alice");
    let o = Origin::start();
    let tls = format!(
        "cert = \"{}\"\nkey = \"{}\"\nclient_ca = \"{}\"\nclient_auth = \"optional\"",
        p(&cert.cert),
        p(&cert.key),
        p(&ca.cert)
    );
    let hook = r#"[route.lua]
access = '''
local v = pier.var
pier.req.set_header("x-tls", table.concat({v.https, v.scheme, v.ssl_protocol,
  v.ssl_server_name, v.ssl_alpn_protocol or "-", v.ssl_client_s_dn or "-",
  v.ssl_session_reused, #v.ssl_cipher > 0 and "cipher" or ""}, "|"))
'''
"#;
    let cfg = tls_config(o.addr(), &tls, "").replace(
        "upstream = \"app\"\n",
        &format!("upstream = \"app\"\n{hook}"),
    );
    let pier = pier(&cfg);
    let with = TlsClientConfig::new(&ca.cert, Some(&alice), &["http/1.1"], None);
    let mut c = TlsClient::connect(pier.listener("main"), "site.test", &with).unwrap();
    let r = c.get("site.test", "/headers").unwrap();
    let body = r.body_str();
    assert!(
        body.contains(
            "x-tls: on|https|TLSv1.3|site.test|http/1.1|CN=alice, O=pier clients|.|cipher"
        ),
        "{body}"
    );
}

/// Issue 31, hole 5: sockets that send nothing, or only a record header,
/// must not take the handshake slots. With `max_handshakes = 8`, 20 silent
/// connections (held open for the whole test, with a handshake timeout far
/// longer than it) used to take all 8 slots and have every real client
/// refused as `overload`; waiting for a ClientHello now holds no slot.
#[test]
fn silent_connections_hold_no_handshake_slot() {
    let Site {
        dir: _dir,
        ca,
        cert,
    } = Site::new();
    let o = Origin::start();
    let tls = tls_lines(&cert, "handshake_timeout = \"60s\"\nmax_handshakes = 8");
    let pier = pier(&tls_config(o.addr(), &tls, ""));
    let addr = pier.listener("main");
    let mut silent = Vec::new();
    for i in 0..20 {
        let mut c = RawConn::connect(addr);
        if i % 2 == 1 {
            // A handshake record's header, and nothing of its body.
            c.send(&[0x16, 0x03, 0x01, 0x02, 0x00]);
        }
        silent.push(c);
    }
    // Every one of them accepted and waiting (20, plus none other).
    assert!(
        wait_until(Duration::from_secs(10), || pier
            .metric_value("pier_active_connections")
            == Some(20.0)),
        "{}",
        pier.metrics()
    );
    // Real clients get through, several in a row (more than the slots).
    let cfg = client(&ca.cert);
    for _ in 0..10 {
        let mut c = TlsClient::connect(addr, "site.test", &cfg)
            .unwrap_or_else(|e| panic!("a real client was refused: {e}\n{}", pier.metrics()));
        assert_eq!(c.get("site.test", "/hello").unwrap().status, 200);
    }
    assert_eq!(
        pier.metric_value("pier_tls_handshake_failures_total{reason=\"overload\"}"),
        Some(0.0)
    );
    // The silent ones are still there (bounded elsewhere: see below).
    for c in silent.iter_mut() {
        assert!(!c.is_closed(Duration::from_millis(1)));
    }
}

/// Silent connections are bounded per listener (`max_pending_hellos`), the
/// oldest closed first. One worker, so that "oldest" is one order.
#[test]
fn silent_connections_are_bounded_oldest_first() {
    let Site {
        dir: _dir,
        ca,
        cert,
    } = Site::new();
    let o = Origin::start();
    let tls = tls_lines(
        &cert,
        "handshake_timeout = \"60s\"\nmax_pending_hellos = 10",
    );
    let cfg = tls_config(o.addr(), &tls, "").replace("workers = 2", "workers = 1");
    let pier = pier(&cfg);
    let addr = pier.listener("main");
    let open = |n: usize| -> Vec<RawConn> {
        (0..n)
            .map(|_| {
                let mut c = RawConn::connect(addr);
                c.send(&[0x16, 0x03, 0x01]);
                c
            })
            .collect()
    };
    let active = |n: f64| {
        assert!(
            wait_until(Duration::from_secs(10), || pier
                .metric_value("pier_active_connections")
                == Some(n)),
            "want {n} active: {}",
            pier.metrics()
        )
    };
    let mut first = open(10);
    active(10.0);
    // Eviction spares connections younger than 5 ms (evict.rs MIN_AGE_MS):
    // age the first ten past it. Not a synchronisation: nothing is awaited.
    std::thread::sleep(Duration::from_millis(50));
    let mut second = open(5);
    // Five of the first are closed for the second five: 10 waiting.
    let evicted = |n: f64| {
        assert!(
            wait_until(Duration::from_secs(10), || pier.metric_value(
                "pier_tls_handshake_failures_total{reason=\"evicted\"}"
            ) == Some(n)),
            "want {n} evicted: {}",
            pier.metrics()
        )
    };
    evicted(5.0);
    active(10.0);
    // The oldest go first (which five of the first ten: those accepted in
    // one millisecond have no order).
    assert_eq!(closed(&mut first, 5), 5);
    assert_eq!(closed(&mut second, 0), 0);
    // A real client still gets in (taking the place of the next oldest).
    let mut c = TlsClient::connect(addr, "site.test", &client(&ca.cert)).unwrap();
    assert_eq!(c.get("site.test", "/hello").unwrap().status, 200);
    drop(c);
    evicted(6.0);
    assert_eq!(closed(&mut first, 6), 6);
    assert_eq!(closed(&mut second, 0), 0);
    assert_eq!(
        pier.metric_value("pier_tls_handshake_failures_total{reason=\"overload\"}"),
        Some(0.0)
    );
}

/// At `limits.max_connections`, a connection still waiting for its
/// ClientHello is evicted for a new one, oldest first, as an idle HTTP/1
/// connection is (it used to be unevictable: ten silent sockets refused
/// every client).
#[test]
fn silent_connections_are_evicted_at_max_connections() {
    let Site {
        dir: _dir,
        ca,
        cert,
    } = Site::new();
    let o = Origin::start();
    let tls = tls_lines(&cert, "handshake_timeout = \"60s\"");
    let cfg = tls_config(o.addr(), &tls, "[limits]\nmax_connections = 10\n")
        .replace("workers = 2", "workers = 1");
    let pier = pier(&cfg);
    let addr = pier.listener("main");
    let mut silent: Vec<RawConn> = (0..10).map(|_| RawConn::connect(addr)).collect();
    assert!(wait_until(Duration::from_secs(10), || pier
        .metric_value("pier_active_connections")
        == Some(10.0)));
    // Older than eviction's 5 ms minimum age (evict.rs MIN_AGE_MS).
    std::thread::sleep(Duration::from_millis(50));
    let cfg = client(&ca.cert);
    // Kept open, so that each new one makes room by one eviction.
    let mut served = Vec::new();
    for _ in 0..3 {
        let mut c = TlsClient::connect(addr, "site.test", &cfg)
            .unwrap_or_else(|e| panic!("refused at max_connections: {e}\n{}", pier.metrics()));
        assert_eq!(c.get("site.test", "/hello").unwrap().status, 200);
        served.push(c);
    }
    assert_eq!(closed(&mut silent, 3), 3);
    assert_eq!(
        pier.metric_value("pier_evicted_connections_total"),
        Some(3.0)
    );
}

/// How many of `conns` Pier has closed: polled until `want` are (10 s at
/// most), then counted once more.
fn closed(conns: &mut [RawConn], want: usize) -> usize {
    let mut gone = vec![false; conns.len()];
    let mut count = || {
        for (c, g) in conns.iter_mut().zip(gone.iter_mut()) {
            *g = *g || c.is_closed(Duration::from_millis(1));
        }
        gone.iter().filter(|g| **g).count()
    };
    wait_until(Duration::from_secs(10), || count() >= want);
    count()
}

/// A fleet's shared session ticket keys (issue 37): a session made on one
/// Pier resumes on another that reads the same key file; a Pier with other
/// keys makes a full handshake; during a rotation (new key first, old
/// second) tickets of the old key still resume, and new tickets are the
/// new key's.
#[test]
fn shared_ticket_keys_resume_a_session_on_another_process() {
    let Site { dir, ca, cert } = Site::new();
    let o = Origin::start();
    let key = |name: &str, seed: u8| {
        let path = dir.path().join(name);
        let bytes: Vec<u8> = (0..80u8)
            .map(|i| i.wrapping_mul(37).wrapping_add(seed))
            .collect();
        std::fs::write(&path, bytes).unwrap();
        path
    };
    let (old, new) = (key("old.key", 1), key("new.key", 2));
    let node = |keys: &[&Path]| {
        let list: Vec<String> = keys.iter().map(|k| format!("\"{}\"", p(k))).collect();
        let extra = format!("session_ticket_keys = [{}]", list.join(", "));
        pier(&tls_config(o.addr(), &tls_lines(&cert, &extra), ""))
    };
    let node1 = node(&[&old]);
    let node2 = node(&[&old]);
    let stranger = node(&[&new]);
    let rotated = node(&[&new, &old]);
    let own_keys = pier(&tls_config(o.addr(), &tls_lines(&cert, ""), ""));
    // A client's session (its tickets) made on `on`.
    let session_on = |on: &PierProcess| {
        let cfg = client(&ca.cert);
        let mut c = TlsClient::connect(on.listener("main"), "site.test", &cfg).unwrap();
        // Reading a response takes in the tickets sent after the handshake.
        assert_eq!(c.get("site.test", "/hello").unwrap().status, 200);
        assert!(!c.resumed());
        cfg
    };
    let resumes = |cfg: &TlsClientConfig, at: &PierProcess| {
        let mut c = TlsClient::connect(at.listener("main"), "site.test", cfg).unwrap();
        assert_eq!(c.get("site.test", "/hello").unwrap().status, 200);
        c.resumed()
    };
    assert!(
        resumes(&session_on(&node1), &node2),
        "node 1's session on node 2"
    );
    assert!(resumes(&session_on(&node2), &node1), "and the reverse");
    assert!(
        !resumes(&session_on(&node1), &stranger),
        "other keys: full handshake"
    );
    assert!(
        !resumes(&session_on(&node1), &own_keys),
        "a process's own keys"
    );
    assert!(!resumes(&session_on(&own_keys), &node1));
    assert!(
        resumes(&session_on(&node1), &rotated),
        "the old key still decrypts"
    );
    assert!(
        resumes(&session_on(&rotated), &stranger),
        "the new key encrypts"
    );
    assert!(
        node2.metric_sum("pier_tls_handshakes_total", &[("result", "resumed")]) >= 1.0,
        "{}",
        node2.metrics()
    );
    // A key file of the wrong size is a config error naming it.
    let bad = dir.path().join("bad.key");
    std::fs::write(&bad, [0u8; 32]).unwrap();
    let cfg_path = dir.path().join("bad.toml");
    let extra = format!("session_ticket_keys = [\"{}\"]", p(&bad));
    std::fs::write(
        &cfg_path,
        tls_config(o.addr(), &tls_lines(&cert, &extra), ""),
    )
    .unwrap();
    let out = Command::new(bin())
        .args(["check", "-c", cfg_path.to_str().unwrap()])
        .output()
        .unwrap();
    let text =
        String::from_utf8_lossy(&out.stderr).to_string() + &String::from_utf8_lossy(&out.stdout);
    assert!(!out.status.success() && text.contains("bad.key"), "{text}");
}

/// TLS clients are on the worker's io_uring (`[server] io_uring`, the
/// default) where the kernel allows one: HTTP/1.1 and HTTP/2 (by ALPN), a
/// body of several megabytes each way (the ring's read pause and write
/// wait engage under rustls), keep-alive, plain HTTP refused with its 400
/// (the first byte peeked from the ring), and close_notify at the end.
#[test]
fn tls_clients_on_io_uring() {
    let Site {
        dir: _dir,
        ca,
        cert,
    } = Site::new();
    let o = Origin::start();
    let tls = tls_lines(&cert, "alpn = [\"h2\", \"http/1.1\"]");
    let pier = pier(&tls_config(o.addr(), &tls, ""));
    let addr = pier.listener("main");
    let resolve = format!("site.test:{}:127.0.0.1", addr.port());
    const LEN: u64 = 3 << 20;
    let upload = std::env::temp_dir().join(format!("pier-tls-uring-{}", std::process::id()));
    std::fs::write(&upload, vec![b'u'; LEN as usize]).unwrap();
    let echo_body = format!("@{}", upload.display());
    for http in ["--http1.1", "--http2"] {
        // Three transfers on one connection (`--next`), each with the same
        // options: 3 MiB down, 3 MiB up and echoed back, then /hello.
        let mut args: Vec<String> = Vec::new();
        for (i, (path, extra)) in [
            (format!("/bytes/{LEN}"), None),
            ("/echo".to_string(), Some(&echo_body)),
            ("/hello".to_string(), None),
        ]
        .iter()
        .enumerate()
        {
            if i > 0 {
                args.push("--next".into());
            }
            args.extend([http, "--cacert", &p(&ca.cert), "--resolve", &resolve].map(String::from));
            args.extend(
                [
                    "-w",
                    "%{http_code} %{size_download} %{http_version}\n",
                    "-o",
                    "/dev/null",
                ]
                .map(String::from),
            );
            if let Some(body) = extra {
                args.extend(["--data-binary".to_string(), body.to_string()]);
            }
            args.push(format!("https://site.test:{}{path}", addr.port()));
        }
        let out = curl(&args.iter().map(String::as_str).collect::<Vec<_>>());
        let want_version = if http == "--http2" { "2" } else { "1.1" };
        assert_eq!(
            String::from_utf8_lossy(&out.stdout),
            format!("200 {LEN} {want_version}\n200 {LEN} {want_version}\n200 12 {want_version}\n"),
            "{http}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    std::fs::remove_file(&upload).ok();
    // A rustls client reads the bytes themselves (a pattern, so a lost or
    // reordered record would show).
    let mut c = TlsClient::connect(addr, "site.test", &client(&ca.cert)).unwrap();
    for _ in 0..2 {
        let r = c.get("site.test", "/bytes/1000000").unwrap();
        assert_eq!(r.status, 200);
        assert_eq!(r.body.len(), 1_000_000);
        assert!(r
            .body
            .iter()
            .enumerate()
            .all(|(i, &b)| b == pattern_byte(i as u64)));
    }
    drop(c);
    let mut raw = RawConn::connect(addr);
    let r = raw.get("/hello").unwrap();
    assert_eq!(r.status, 400);
    if io_uring_expected() {
        // Only TLS connections were made, so a ring means they were on it.
        assert!(rings(pier.pid()) >= 1, "no io_uring in pier");
    }
}
