//! Upstream servers given by host name, re-resolved while running: a tiny
//! DNS server in the test answers for `origin.pier.test` with addresses the
//! test changes (TTL 1 s), then fails, and Pier follows (or keeps the last
//! good set).

mod common;

use std::collections::HashMap;
use std::net::{Ipv4Addr, SocketAddr, UdpSocket};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::*;

/// What the DNS server does with the next question for an A record.
#[derive(Clone, Debug)]
enum Mode {
    /// These addresses, TTL 1 s.
    Answer(Vec<Ipv4Addr>),
    /// RCODE 2.
    ServFail,
    /// No answer at all (the resolver times out).
    Silent,
}

/// A DNS server on 127.0.0.1 (UDP) answering every name the same way:
/// A questions per `mode`, anything else with an empty NOERROR answer.
struct DnsServer {
    addr: SocketAddr,
    mode: Arc<Mutex<Mode>>,
    stop: Arc<AtomicBool>,
}

impl DnsServer {
    fn start(mode: Mode) -> DnsServer {
        let sock = UdpSocket::bind("127.0.0.1:0").unwrap();
        // Wakes the loop now and then to see `stop`.
        sock.set_read_timeout(Some(Duration::from_millis(100)))
            .unwrap();
        let addr = sock.local_addr().unwrap();
        let mode = Arc::new(Mutex::new(mode));
        let stop = Arc::new(AtomicBool::new(false));
        let (m, s) = (mode.clone(), stop.clone());
        std::thread::spawn(move || {
            let mut buf = [0u8; 1500];
            while !s.load(Ordering::Relaxed) {
                let Ok((n, from)) = sock.recv_from(&mut buf) else {
                    continue;
                };
                let mode = m.lock().unwrap().clone();
                if let Some(reply) = answer(&buf[..n], &mode) {
                    let _ = sock.send_to(&reply, from);
                }
            }
        });
        DnsServer { addr, mode, stop }
    }

    fn set(&self, mode: Mode) {
        *self.mode.lock().unwrap() = mode;
    }
}

impl Drop for DnsServer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}

/// The reply to one query, or None to stay silent (or for a packet that is
/// not a query).
fn answer(q: &[u8], mode: &Mode) -> Option<Vec<u8>> {
    if q.len() < 12 || q[2] & 0x80 != 0 {
        return None;
    }
    // The question: labels up to a zero byte, then type and class.
    let mut i = 12;
    while i < q.len() && q[i] != 0 {
        i += 1 + q[i] as usize;
    }
    let end = i + 5;
    if end > q.len() {
        return None;
    }
    let qtype = u16::from_be_bytes([q[i + 1], q[i + 2]]);
    let (rcode, ips) = match (qtype, mode) {
        (_, Mode::Silent) => return None,
        (_, Mode::ServFail) => (2u8, Vec::new()),
        (1, Mode::Answer(ips)) => (0, ips.clone()),
        _ => (0, Vec::new()),
    };
    let mut r = Vec::with_capacity(end + 16 * ips.len());
    r.extend_from_slice(&q[..2]);
    // QR, the query's RD, RA; the rcode.
    r.push(0x80 | (q[2] & 0x01));
    r.push(0x80 | rcode);
    r.extend_from_slice(&1u16.to_be_bytes());
    r.extend_from_slice(&(ips.len() as u16).to_be_bytes());
    r.extend_from_slice(&[0, 0, 0, 0]);
    r.extend_from_slice(&q[12..end]);
    for ip in ips {
        // Name: a pointer to the question's; A, IN, TTL 1 s, 4 bytes.
        r.extend_from_slice(&[0xc0, 12, 0, 1, 0, 1, 0, 0, 0, 1, 0, 4]);
        r.extend_from_slice(&ip.octets());
    }
    Some(r)
}

fn config(dns: SocketAddr, port: u16) -> String {
    base_config(
        &format!(
            r#"[resolver]
nameservers = ["{dns}"]
min_ttl = "1s"
max_ttl = "2s"
timeout = "500ms"
"#
        ),
        &format!(
            r#"[[route]]
name = "default"
upstream = "app"

[upstream.app]
servers = ["origin.pier.test:{port}"]
host_header = "upstream"
"#
        ),
    )
}

/// Which origin answered `/name`, over `n` requests on new connections.
fn spread(p: &PierProcess, n: usize) -> HashMap<String, usize> {
    let mut m = HashMap::new();
    for _ in 0..n {
        let r = RawConn::connect(p.listener("main"))
            .request("GET", "/name", &[], b"")
            .unwrap();
        assert_eq!(r.status, 200, "{}\n{}", r.body_str(), p.logs());
        *m.entry(r.body_str()).or_insert(0) += 1;
    }
    m
}

fn resolutions(p: &PierProcess, result: &str) -> f64 {
    p.metric_sum(
        "pier_dns_resolutions_total",
        &[("upstream", "app"), ("result", result)],
    )
}

fn failures(p: &PierProcess) -> f64 {
    ["timeout", "nxdomain", "servfail", "empty", "error"]
        .iter()
        .map(|r| resolutions(p, r))
        .sum()
}

#[test]
fn names_follow_dns_answers_and_keep_the_last_good_set() {
    // Two origins on one port of two loopback addresses: a name gives the
    // addresses, the port comes from the config.
    let first = Origin::start_named("first");
    let port = first.addr().port();
    let second = Origin::start_at("second", SocketAddr::from(([127, 0, 0, 2], port)))
        .unwrap_or_else(|e| {
            panic!(
                "cannot bind 127.0.0.2:{port} ({e}): the test needs a second loopback address \
                 (Linux routes all of 127.0.0.0/8 to lo; elsewhere add it, e.g. \
                 `ifconfig lo0 alias 127.0.0.2`)"
            )
        });
    let dns = DnsServer::start(Mode::Answer(vec![Ipv4Addr::new(127, 0, 0, 1)]));
    let p = pier(&config(dns.addr, port));
    let wait = Duration::from_secs(15);

    // Resolved before serving: the first origin, by name.
    assert_eq!(spread(&p, 4).get("first"), Some(&4), "{}", p.logs());
    let r = RawConn::connect(p.listener("main"))
        .get("/headers")
        .unwrap();
    let head = r.body_str().to_ascii_lowercase();
    assert!(
        head.contains(&format!("host: origin.pier.test:{port}\r\n")),
        "{head}"
    );
    assert_eq!(
        p.metric_value(r#"pier_upstream_peers{upstream="app"}"#),
        Some(1.0)
    );

    // The answer changes: traffic moves to the second origin.
    dns.set(Mode::Answer(vec![Ipv4Addr::new(127, 0, 0, 2)]));
    let moved = wait_until(wait, || {
        RawConn::connect(p.listener("main"))
            .get("/name")
            .is_ok_and(|r| r.body_str() == "second")
    });
    assert!(
        moved,
        "traffic never reached the second origin\n{}",
        p.logs()
    );
    assert_eq!(spread(&p, 4).get("second"), Some(&4));
    assert!(resolutions(&p, "changed") >= 2.0, "{}", p.metrics());

    // Both addresses: both are peers of the group.
    dns.set(Mode::Answer(vec![
        Ipv4Addr::new(127, 0, 0, 1),
        Ipv4Addr::new(127, 0, 0, 2),
    ]));
    let both = wait_until(wait, || {
        p.metric_value(r#"pier_upstream_peers{upstream="app"}"#) == Some(2.0)
    });
    assert!(both, "{}", p.metrics());
    let m = spread(&p, 10);
    assert_eq!(m.get("first"), Some(&5), "{m:?}");
    assert_eq!(m.get("second"), Some(&5), "{m:?}");

    // Back to the second only, then SERVFAIL: the last good set stays and
    // the failures are counted.
    dns.set(Mode::Answer(vec![Ipv4Addr::new(127, 0, 0, 2)]));
    let one = wait_until(wait, || {
        p.metric_value(r#"pier_upstream_peers{upstream="app"}"#) == Some(1.0)
    });
    assert!(one, "{}", p.metrics());
    dns.set(Mode::ServFail);
    let before = resolutions(&p, "servfail");
    let counted = wait_until(wait, || resolutions(&p, "servfail") >= before + 2.0);
    assert!(counted, "{}", p.metrics());
    assert_eq!(spread(&p, 4).get("second"), Some(&4));

    // No answer at all: timeouts, same servers.
    dns.set(Mode::Silent);
    let before = resolutions(&p, "timeout");
    let timed_out = wait_until(wait, || resolutions(&p, "timeout") >= before + 1.0);
    assert!(timed_out, "{}", p.metrics());
    assert_eq!(spread(&p, 4).get("second"), Some(&4));
    assert_eq!(
        p.metric_value(r#"pier_upstream_peers{upstream="app"}"#),
        Some(1.0)
    );
    drop(second);
}

#[test]
fn a_name_that_does_not_resolve_at_start_gets_its_servers_later() {
    let origin = Origin::start_named("late");
    let dns = DnsServer::start(Mode::ServFail);
    let p = pier(&config(dns.addr, origin.addr().port()));
    // No server yet: 503, and the failure is counted.
    let r = RawConn::connect(p.listener("main")).get("/name").unwrap();
    assert_eq!(r.status, 503, "{}", r.body_str());
    assert!(failures(&p) >= 1.0, "{}", p.metrics());
    dns.set(Mode::Answer(vec![Ipv4Addr::new(127, 0, 0, 1)]));
    let up = wait_until(Duration::from_secs(15), || {
        RawConn::connect(p.listener("main"))
            .get("/name")
            .is_ok_and(|r| r.body_str() == "late")
    });
    assert!(up, "{}", p.logs());
}
