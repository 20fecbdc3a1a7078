//! Connection-level bounds through a real Pier process: `max_connections` (the oldest
//! connection waiting for a head evicted, else the excess refused at accept; slots
//! freed when connections close), `max_connections_per_ip`,
//! and `body_min_rate` (a trickling upload gets 408).

mod common;

use std::net::{IpAddr, Ipv4Addr};
use std::time::{Duration, Instant};

use common::*;

const OTHER_IP: IpAddr = IpAddr::V4(Ipv4Addr::new(127, 0, 0, 2));
const LOCAL_IP: IpAddr = IpAddr::V4(Ipv4Addr::LOCALHOST);

/// A head cut short: Pier holds the connection while it waits for the rest.
const PARTIAL: &[u8] = b"GET /hello HTTP/1.1\r\nhost: pier.test\r\n";

/// Waits (20 s at most: generous for a loaded machine) for `pier_active_connections`
/// to equal `n`.
#[track_caller]
fn wait_active(p: &PierProcess, n: f64) {
    let mut last = None;
    let ok = wait_until(Duration::from_secs(20), || {
        last = p.metric_value("pier_active_connections");
        last == Some(n)
    });
    assert!(ok, "pier_active_connections is {last:?}, waiting for {n}");
}

/// A connection Pier refused at accept: closed without a response byte.
#[track_caller]
fn assert_refused(mut c: RawConn) {
    c.set_timeout(Duration::from_secs(3));
    let _ = c.try_send(b"GET /hello HTTP/1.1\r\nhost: pier.test\r\n\r\n");
    match c.read_response() {
        Ok(r) => panic!(
            "a connection past the limit was served: {} {:?}",
            r.status,
            r.body_str()
        ),
        Err(e) => assert!(
            matches!(
                e.kind(),
                std::io::ErrorKind::UnexpectedEof | std::io::ErrorKind::ConnectionReset
            ),
            "expected a close, got {e}"
        ),
    }
    assert!(
        c.buffered().is_empty(),
        "refused with bytes: {:?}",
        c.buffered()
    );
}

fn finish_and_get(mut c: RawConn) -> Response {
    c.send(b"\r\n");
    c.read_response().expect("response on a held connection")
}

#[test]
fn max_connections_refuses_the_excess_at_accept_and_frees_slots_on_close() {
    let o = Origin::start();
    let p = pier(&simple_config(
        &[o.addr()],
        "[limits]\nmax_connections = 4\n\n[timeouts]\nclient_header = \"10s\"",
        "",
    ));
    let a = p.listener("main");
    // Four connections in the middle of a request: none may be evicted.
    let mut held: Vec<RawConn> = (0..4)
        .map(|_| {
            let mut c = RawConn::connect(a);
            c.send(b"GET /slow/1500 HTTP/1.1\r\nhost: pier.test\r\n\r\n");
            c
        })
        .collect();
    wait_active(&p, 4.0);
    assert!(
        wait_until(Duration::from_secs(20), || o.requests() == 4),
        "the held requests did not reach the origin"
    );
    assert_eq!(p.metric_value("pier_refused_connections_total"), Some(0.0));
    // The fifth is refused, from any address, and counted.
    assert_refused(RawConn::connect(a));
    assert_refused(RawConn::connect_from(OTHER_IP, a));
    assert_eq!(p.metric_value("pier_refused_connections_total"), Some(2.0));
    assert_eq!(p.metric_value("pier_evicted_connections_total"), Some(0.0));
    // The held requests are unharmed.
    for c in &mut held {
        assert_eq!(c.read_response().expect("held request").status, 200);
    }
    // Closing connections frees their slots.
    drop(held.pop());
    drop(held.pop());
    drop(held.pop());
    wait_active(&p, 1.0);
    for _ in 0..5 {
        assert_eq!(get(a, "/hello").status, 200);
    }
    assert_eq!(p.metric_value("pier_refused_connections_total"), Some(2.0));
}

/// At `max_connections` a new connection takes the slot of the oldest one still
/// waiting for a head (as nginx reclaims idle connections), so connections that
/// hold slots without sending a request cannot lock clients out.
#[test]
fn max_connections_evicts_the_oldest_connection_waiting_for_a_head() {
    let o = Origin::start();
    // One worker: eviction is among a worker's own connections.
    let cfg = simple_config(
        &[o.addr()],
        "[limits]\nmax_connections = 4\n\n[timeouts]\nclient_header = \"10s\"",
        "",
    )
    .replace("workers = 2", "workers = 1");
    let p = pier(&cfg);
    let a = p.listener("main");
    let mut held: Vec<RawConn> = Vec::new();
    for i in 0..4 {
        let mut c = RawConn::connect(a);
        c.send(PARTIAL);
        held.push(c);
        // Accepted (counted) before the next one connects, so ages follow connect order;
        // then the clock must move on for the next one to be younger (ages are in ms).
        // Waiting longer on a loaded machine only spreads the ages further.
        wait_active(&p, f64::from(i + 1));
        std::thread::sleep(Duration::from_millis(20));
    }
    // Eviction takes a connection only once it has waited a few ms (MIN_AGE_MS, 5):
    // the time must pass, and the 20 ms above already let it for the youngest.
    // A new client is served...
    assert_eq!(get(a, "/hello").status, 200);
    assert_eq!(p.metric_value("pier_evicted_connections_total"), Some(1.0));
    assert_eq!(p.metric_value("pier_refused_connections_total"), Some(0.0));
    // ...in the place of the oldest waiting connection, closed without a word.
    let mut oldest = held.remove(0);
    assert!(
        oldest.is_closed(Duration::from_secs(5)),
        "oldest not evicted"
    );
    // The others are unharmed: finishing a head gets an answer.
    for c in held {
        assert_eq!(finish_and_get(c).status, 200);
    }
}

#[test]
fn max_connections_per_ip_closes_the_excess_from_one_address_only() {
    let o = Origin::start();
    let p = pier(&simple_config(
        &[o.addr()],
        "[limits]\nmax_connections_per_ip = 2\n\n[timeouts]\nclient_header = \"10s\"",
        "",
    ));
    let a = p.listener("main");
    let mut held: Vec<RawConn> = (0..2)
        .map(|_| {
            let mut c = RawConn::connect_from(LOCAL_IP, a);
            c.send(PARTIAL);
            c
        })
        .collect();
    wait_active(&p, 2.0);
    assert_refused(RawConn::connect_from(LOCAL_IP, a));
    // Another address has its own allowance.
    let mut other: Vec<RawConn> = (0..2).map(|_| RawConn::connect_from(OTHER_IP, a)).collect();
    for c in &mut other {
        assert_eq!(c.get("/hello").unwrap().status, 200);
    }
    assert_refused(RawConn::connect_from(OTHER_IP, a));
    drop(other);
    assert!(p.metric_value("pier_refused_connections_total") >= Some(2.0));
    // One of 127.0.0.1's connections closes: a new one from it is accepted.
    drop(held.pop());
    wait_active(&p, 1.0);
    let r = RawConn::connect_from(LOCAL_IP, a).get("/hello").unwrap();
    assert_eq!(r.status, 200);
    assert_eq!(finish_and_get(held.pop().unwrap()).status, 200);
}

#[test]
fn trickling_upload_below_body_min_rate_gets_408_after_the_grace_time() {
    let o = Origin::start();
    let p = pier(&simple_config(
        &[o.addr()],
        "[limits]\nbody_min_rate = \"1k\"\n\n[timeouts]\nupstream_response = \"30s\"",
        "",
    ));
    let mut c = RawConn::connect(p.listener("main"));
    c.set_timeout(Duration::from_secs(40));
    // The origin waits 20 s before answering, so only the body's pace can end this early.
    c.send(b"POST /slow/20000 HTTP/1.1\r\nhost: pier.test\r\ncontent-length: 100000\r\n\r\n");
    let mut writer = c.writer();
    let start = Instant::now();
    let trickle = std::thread::spawn(move || {
        use std::io::Write;
        // 20 bytes a second, far below 1 KiB/s: the pace is what is tested, so this
        // sleep stays. Stops when Pier closes (bounded: 30 s).
        for _ in 0..120 {
            if writer.write_all(&[b'x'; 5]).is_err() {
                break;
            }
            std::thread::sleep(Duration::from_millis(250));
        }
    });
    let r = c.read_response().expect("an answer to the slow upload");
    let took = start.elapsed();
    assert_local(&r, 408, "body-timeout");
    // The rate applies after the first 10 s (slow starts are normal). Not before; and
    // soon after, with room for a loaded machine (the origin never answers: it waits
    // for the whole body, and upstream_response is 30 s).
    assert!(
        took >= Duration::from_secs(9) && took < Duration::from_secs(25),
        "408 after {took:?}"
    );
    assert!(
        c.is_closed(Duration::from_secs(10)),
        "connection kept after 408"
    );
    drop(c);
    let _ = trickle.join();
    assert_eq!(wait_local_count(&p, 408, "body-timeout", 1.0), 1.0);
}
