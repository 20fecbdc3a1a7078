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

/// A real HAProxy (Debian's) on a free port with `accept-proxy`, in front
/// of `origin`: it takes the client's address from the PROXY header Pier
/// sends and hands it to the origin as `x-pp-src` / `x-pp-dst` /
/// `x-pp-authority`. Killed on drop.
struct Haproxy {
    child: std::process::Child,
    addr: SocketAddr,
    _dir: TempDir,
}

impl Drop for Haproxy {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn haproxy_bin() -> std::path::PathBuf {
    ["/usr/sbin/haproxy", "/usr/bin/haproxy"]
        .iter()
        .map(std::path::PathBuf::from)
        .find(|p| p.exists())
        .expect("haproxy is not installed: apt-get install haproxy (.ci/install does)")
}

impl Haproxy {
    fn start(origin: SocketAddr) -> Haproxy {
        let dir = TempDir::new();
        // A free port: HAProxy cannot say which one port 0 gave it. Taken
        // again (by a test elsewhere) in between, HAProxy fails to bind and
        // the next port is tried.
        for _ in 0..10 {
            let port = std::net::TcpListener::bind("127.0.0.1:0")
                .unwrap()
                .local_addr()
                .unwrap()
                .port();
            let addr: SocketAddr = ([127, 0, 0, 1], port).into();
            let cfg = dir.write(
                "haproxy.cfg",
                &format!(
                    "global\n  maxconn 100\n\
                     defaults\n  mode http\n  timeout connect 5s\n  timeout client 30s\n  timeout server 30s\n\
                     frontend fe\n  bind {addr} accept-proxy\n\
                     \x20 http-request set-header x-pp-src %[src]:%[src_port]\n\
                     \x20 http-request set-header x-pp-dst %[dst]:%[dst_port]\n\
                     \x20 http-request set-header x-pp-authority %[fc_pp_authority]\n\
                     \x20 default_backend be\n\
                     backend be\n  server o {origin}\n"
                ),
            );
            let mut child = std::process::Command::new(haproxy_bin())
                .args(["-db", "-f"])
                .arg(&cfg)
                .stdin(std::process::Stdio::null())
                .stdout(std::process::Stdio::null())
                .stderr(std::fs::File::create(dir.path().join("haproxy.err")).unwrap())
                .spawn()
                .expect("start haproxy");
            let up = wait_until(Duration::from_secs(10), || {
                matches!(child.try_wait(), Ok(Some(_)))
                    || std::net::TcpStream::connect(addr).is_ok()
            });
            if up && matches!(child.try_wait(), Ok(None)) {
                return Haproxy {
                    child,
                    addr,
                    _dir: dir,
                };
            }
            let _ = child.kill();
            let _ = child.wait();
        }
        panic!(
            "haproxy did not start: {}",
            std::fs::read_to_string(dir.path().join("haproxy.err")).unwrap_or_default()
        );
    }
}

fn header_of<'a>(body: &'a str, name: &str) -> Option<&'a str> {
    body.lines().find_map(|l| {
        let (n, v) = l.split_once(':')?;
        n.eq_ignore_ascii_case(name).then(|| v.trim())
    })
}

#[test]
fn send_proxy_protocol_names_each_client_to_haproxy() {
    let origin = Origin::start_named("behind-haproxy");
    let haproxy = Haproxy::start(origin.addr());
    let dir = TempDir::new();
    let ca = TestCa::new(dir.path(), "pier");
    let cert = ca.server("site", &["site.test"], Alg::EcdsaP256, 30);
    for version in ["v2", "v1"] {
        let cfg = format!(
            r#"[admin]
listen = "127.0.0.1:0"
[log]
access = "off"

[[listener]]
name = "main"
listen = "127.0.0.1:0"

[[listener]]
name = "tls"
listen = "127.0.0.1:0"
[listener.tls]
cert = "{cert}"
key = "{key}"

[[route]]
name = "default"
upstream = "app"

[upstream.app]
servers = ["{haproxy}"]
send_proxy_protocol = "{version}"
pool_idle_per_server = 3
[upstream.app.health_check]
type = "http"
path = "/healthz"
interval = "100ms"
"#,
            cert = cert.cert.display(),
            key = cert.key.display(),
            haproxy = haproxy.addr,
        );
        let p = pier(&cfg);
        // Health checks carry a LOCAL header: HAProxy takes them, and
        // passes them to the origin.
        assert!(
            wait_until(Duration::from_secs(10), || origin.health_checks() > 0),
            "{version}: no health check got through HAProxy\n{}",
            p.logs()
        );
        let main = p.listener("main");
        // Two requests on one client connection: one upstream connection,
        // its header naming this client.
        let mut a = RawConn::connect(main);
        let first = a.get("/headers").unwrap();
        assert_eq!(first.status, 200, "{version}: {}", first.body_str());
        let body = first.body_str();
        assert_eq!(
            header_of(&body, "x-pp-src"),
            Some(a.local_addr().to_string().as_str()),
            "{version}: {body}"
        );
        assert_eq!(
            header_of(&body, "x-pp-dst"),
            Some(main.to_string().as_str())
        );
        let again = a.get("/headers").unwrap().body_str();
        assert_eq!(
            header_of(&again, "x-pp-src"),
            Some(a.local_addr().to_string().as_str())
        );
        // Another client is named as itself: the first one's upstream
        // connection (idle in the pool now) is never lent to it.
        let mut b = RawConn::connect(main);
        let other = b.get("/headers").unwrap().body_str();
        assert_eq!(
            header_of(&other, "x-pp-src"),
            Some(b.local_addr().to_string().as_str()),
            "{version}: a connection named for one client went to another: {other}"
        );
        // Clients that come and go each leave a private connection idle;
        // together they stay within the server's one bound, however many
        // clients (each its own pool key) there were.
        drop((a, b));
        for _ in 0..12 {
            let mut c = RawConn::connect(main);
            let r = c.get("/headers").unwrap();
            assert_eq!(r.status, 200);
        }
        let idle = p.metric_value("pier_upstream_idle_connections").unwrap();
        assert!(idle <= 3.0, "{version}: {idle} idle private connections");
        // Over TLS, v2 names the server name the client asked for.
        if version == "v2" {
            let tls = p.listener("tls");
            let cfg = TlsClientConfig::new(&ca.cert, None, &["http/1.1"], None);
            let mut c = pier_test_support::tls::TlsClient::connect(tls, "site.test", &cfg).unwrap();
            let r = c.get("site.test", "/headers").unwrap();
            let body = r.body_str();
            assert_eq!(
                header_of(&body, "x-pp-authority"),
                Some("site.test"),
                "{body}"
            );
            assert_eq!(header_of(&body, "x-pp-dst"), Some(tls.to_string().as_str()));
        }
    }
}
