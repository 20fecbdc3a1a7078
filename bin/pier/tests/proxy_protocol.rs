//! The PROXY protocol on a listener (`proxy_protocol = true`, issue 35):
//! a balancer's v1 or v2 header names the client, whose address then is
//! the one limits, logs and the origin's X-Forwarded-For see; only from
//! `trusted_proxies`; a bad header, or one from anyone else, closes the
//! connection and is counted; TLS follows the header as it would an
//! accept.

mod common;

use common::*;
use pier_test_support::tls::{Alg, TestCa, TlsClientConfig};
use std::net::SocketAddr;
use std::time::Duration;

/// The listener with `proxy_protocol` from `trusted`, in front of `origin`;
/// `top` before it, `listener` lines under it.
fn config(origin: SocketAddr, trusted: &str, top: &str, listener: &str) -> String {
    simple_config(&[origin], top, "").replace(
        "name = \"main\"\nlisten = \"127.0.0.1:0\"\n",
        &format!(
            "name = \"main\"\nlisten = \"127.0.0.1:0\"\nproxy_protocol = true\ntrusted_proxies = [\"{trusted}\"]\n{listener}"
        ),
    )
}

/// A v2 PROXY header (TCP over IPv4 or IPv6) from `src` to `dst`, with one
/// TLV after the addresses (Pier skips it).
fn v2(src: SocketAddr, dst: SocketAddr) -> Vec<u8> {
    let mut body = Vec::new();
    let fam = match (src, dst) {
        (SocketAddr::V4(s), SocketAddr::V4(d)) => {
            body.extend_from_slice(&s.ip().octets());
            body.extend_from_slice(&d.ip().octets());
            0x11
        }
        (SocketAddr::V6(s), SocketAddr::V6(d)) => {
            body.extend_from_slice(&s.ip().octets());
            body.extend_from_slice(&d.ip().octets());
            0x21
        }
        _ => panic!("one family"),
    };
    body.extend_from_slice(&src.port().to_be_bytes());
    body.extend_from_slice(&dst.port().to_be_bytes());
    body.extend_from_slice(&[0x02, 0x00, 0x04, b'a', b'.', b'b', b'c']);
    let mut h = b"\r\n\r\n\0\r\nQUIT\n".to_vec();
    h.extend_from_slice(&[0x21, fam]);
    h.extend_from_slice(&(body.len() as u16).to_be_bytes());
    h.extend_from_slice(&body);
    h
}

fn counted(p: &PierProcess, result: &str) -> f64 {
    p.metric_value(&format!("pier_proxy_protocol_total{{result=\"{result}\"}}"))
        .unwrap_or(0.0)
}

/// `header`, then a GET of /headers on one connection: what the origin saw.
fn through(p: &PierProcess, header: &[u8]) -> String {
    let mut c = RawConn::connect(p.listener("main"));
    c.send(header);
    let r = c.get("/headers").expect("a response after the header");
    assert_eq!(r.status, 200, "{r:?}");
    r.body_str().to_ascii_lowercase()
}

#[test]
fn v1_and_v2_headers_name_the_client() {
    let o = Origin::start();
    let dir = TempDir::new();
    let log = dir.path().join("access.log");
    let p = pier(&config(o.addr(), "127.0.0.1/32", "", "").replace(
        "access = \"off\"",
        &format!("access = \"{}\"", log.display()),
    ));
    let seen = through(&p, b"PROXY TCP4 192.0.2.7 127.0.0.1 56324 80\r\n");
    assert!(
        seen.contains("\r\nx-forwarded-for: 192.0.2.7\r\n"),
        "{seen}"
    );
    let dst: SocketAddr = "[2001:db8::2]:443".parse().unwrap();
    let seen = through(&p, &v2("[2001:db8::1]:4000".parse().unwrap(), dst));
    assert!(
        seen.contains("\r\nx-forwarded-for: 2001:db8::1\r\n"),
        "{seen}"
    );
    let seen = through(
        &p,
        &v2(
            "198.51.100.9:1".parse().unwrap(),
            "10.0.0.1:80".parse().unwrap(),
        ),
    );
    assert!(
        seen.contains("\r\nx-forwarded-for: 198.51.100.9\r\n"),
        "{seen}"
    );
    // A balancer's health check (v2 LOCAL): its own address.
    let mut local = b"\r\n\r\n\0\r\nQUIT\n".to_vec();
    local.extend_from_slice(&[0x20, 0x00, 0x00, 0x00]);
    let seen = through(&p, &local);
    assert!(
        seen.contains("\r\nx-forwarded-for: 127.0.0.1\r\n"),
        "{seen}"
    );
    assert_eq!(counted(&p, "ok"), 3.0);
    assert_eq!(counted(&p, "local"), 1.0);
    // The access log's client is the named one.
    let ok = wait_until(Duration::from_secs(10), || {
        std::fs::read_to_string(&log)
            .unwrap_or_default()
            .lines()
            .count()
            >= 4
    });
    assert!(ok);
    // (Each worker writes its own lines: sorted.)
    let mut clients: Vec<String> = std::fs::read_to_string(&log)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap()["client"].to_string())
        .collect();
    clients.sort();
    assert_eq!(
        clients,
        [
            "\"127.0.0.1\"",
            "\"192.0.2.7\"",
            "\"198.51.100.9\"",
            "\"2001:db8::1\""
        ]
    );
}

#[test]
fn a_missing_bad_or_untrusted_header_closes_the_connection() {
    let o = Origin::start();
    let p = pier(&config(o.addr(), "127.0.0.1/32", "", ""));
    for bad in [
        &b"GET /hello HTTP/1.1\r\nHost: a\r\n\r\n"[..],
        b"PROXY TCP4 192.0.2.7 127.0.0.1 99999 80\r\nGET /hello HTTP/1.1\r\nHost: a\r\n\r\n",
        b"PROXY TCP4 192.0.2.7\r\n",
    ] {
        let mut c = RawConn::connect(p.listener("main"));
        c.send(bad);
        assert!(
            c.is_closed(Duration::from_secs(10)),
            "{:?}",
            String::from_utf8_lossy(bad)
        );
    }
    assert_eq!(counted(&p, "invalid"), 3.0);
    assert_eq!(o.requests(), 0);

    // Headers from a client that is not a trusted balancer are not read.
    let p = pier(&config(o.addr(), "10.0.0.0/8", "", ""));
    let mut c = RawConn::connect(p.listener("main"));
    c.send(b"PROXY TCP4 192.0.2.7 127.0.0.1 1 80\r\nGET /hello HTTP/1.1\r\nHost: a\r\n\r\n");
    assert!(c.is_closed(Duration::from_secs(10)));
    assert_eq!(counted(&p, "untrusted"), 1.0);
    assert_eq!(o.requests(), 0);
}

/// `max_connections_per_ip` counts the clients the balancer names, not the
/// balancer: two clients behind one balancer each get their connection,
/// a second one of the same client does not.
#[test]
fn the_per_ip_cap_counts_the_named_clients() {
    let o = Origin::start();
    let p = pier(&config(
        o.addr(),
        "127.0.0.1/32",
        "[limits]\nmax_connections_per_ip = 1\n",
        "",
    ));
    let open = |src: &str| {
        let mut c = RawConn::connect(p.listener("main"));
        c.send(format!("PROXY TCP4 {src} 127.0.0.1 1000 80\r\n").as_bytes());
        c
    };
    let (mut a, mut b) = (open("192.0.2.1"), open("192.0.2.2"));
    assert_eq!(a.get("/hello").unwrap().status, 200);
    assert_eq!(b.get("/hello").unwrap().status, 200);
    let mut again = open("192.0.2.1");
    assert!(
        again.is_closed(Duration::from_secs(10)),
        "a second connection of 192.0.2.1"
    );
    assert_eq!(a.get("/hello").unwrap().status, 200);
}

/// On a TLS listener the header comes before the ClientHello (as an NLB's
/// does): the handshake and the request follow it.
#[test]
fn tls_follows_the_header() {
    let dir = TempDir::new();
    let ca = TestCa::new(dir.path(), "pp");
    let cert = ca.server("site", &["site.test"], Alg::EcdsaP256, 30);
    let o = Origin::start();
    let tls = format!(
        "[listener.tls]\ncert = \"{}\"\nkey = \"{}\"\n",
        cert.cert.display(),
        cert.key.display()
    );
    let p = pier(&config(o.addr(), "127.0.0.1/32", "", &tls));
    let cfg = TlsClientConfig::new(&ca.cert, None, &["http/1.1"], None);
    let header = v2(
        "203.0.113.5:777".parse().unwrap(),
        "10.0.0.1:443".parse().unwrap(),
    );
    let mut c = pier_test_support::tls::TlsClient::connect_after(
        p.listener("main"),
        "site.test",
        &cfg,
        &header,
    )
    .expect("TLS after the PROXY header");
    let r = c.get("site.test", "/headers").unwrap();
    assert_eq!(r.status, 200);
    let seen = r.body_str().to_ascii_lowercase();
    assert!(
        seen.contains("\r\nx-forwarded-for: 203.0.113.5\r\n"),
        "{seen}"
    );
    assert_eq!(counted(&p, "ok"), 1.0);
}

/// Quick mode: `--proxy-protocol` with `--trusted-proxy CIDR`.
#[test]
fn quick_mode_takes_proxy_protocol() {
    let o = Origin::start();
    let to = o.addr().to_string();
    let p = PierProcess::start_args(
        bin(),
        &[
            "proxy",
            "--listen",
            "127.0.0.1:0",
            "--to",
            &to,
            "--proxy-protocol",
            "--trusted-proxy",
            "127.0.0.0/8",
        ],
    );
    let mut c = RawConn::connect(p.listeners()[0].1);
    c.send(b"PROXY TCP4 192.0.2.44 127.0.0.1 9 80\r\n");
    let r = c.get("/headers").unwrap();
    assert_eq!(r.status, 200);
    let seen = r.body_str().to_ascii_lowercase();
    assert!(
        seen.contains("\r\nx-forwarded-for: 192.0.2.44\r\n"),
        "{seen}"
    );
}
