//! Active health checks against real origin sockets on 127.0.0.1:0.

mod common;

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU16, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::upstream_with;
use pier_config::{Balance, HealthCheck, HealthKind, UpstreamServer};
use pier_http::{HeadLimits, RequestHead};
use pier_lb::{clock_ms, spawn_health_checks, Group};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::task::JoinHandle;

/// What the origin does with a check.
const CLOSE: u16 = 0;
const HANG: u16 = 1;

/// A tiny origin: answers every request with the current `status`
/// (or closes / hangs), counting good and bad answers.
struct Origin {
    addr: SocketAddr,
    status: Arc<AtomicU16>,
    good: Arc<AtomicUsize>,
    bad: Arc<AtomicUsize>,
    first_request: Arc<Mutex<Vec<u8>>>,
    /// Connections accepted and not yet answered.
    in_flight: Arc<AtomicUsize>,
    task: JoinHandle<()>,
}

impl Origin {
    async fn start(status: u16) -> Origin {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        Origin::serve(listener, status)
    }

    fn serve(listener: TcpListener, status: u16) -> Origin {
        let addr = listener.local_addr().unwrap();
        let status = Arc::new(AtomicU16::new(status));
        let good = Arc::new(AtomicUsize::new(0));
        let bad = Arc::new(AtomicUsize::new(0));
        let first_request = Arc::new(Mutex::new(Vec::new()));
        let in_flight = Arc::new(AtomicUsize::new(0));
        let (s, g, b, f, i) = (
            status.clone(),
            good.clone(),
            bad.clone(),
            first_request.clone(),
            in_flight.clone(),
        );
        let task = tokio::spawn(async move {
            loop {
                let Ok((conn, _)) = listener.accept().await else {
                    return;
                };
                i.fetch_add(1, Ordering::SeqCst);
                let (s, g, b, f, i) = (s.clone(), g.clone(), b.clone(), f.clone(), i.clone());
                tokio::spawn(async move {
                    answer(conn, &s, &g, &b, &f).await;
                    i.fetch_sub(1, Ordering::SeqCst);
                });
            }
        });
        Origin {
            addr,
            status,
            good,
            bad,
            first_request,
            in_flight,
            task,
        }
    }

    fn set(&self, status: u16) {
        self.status.store(status, Ordering::SeqCst);
    }

    /// Stop listening: connects are refused from here on.
    async fn stop(self) -> SocketAddr {
        self.task.abort();
        let _ = self.task.await;
        self.addr
    }
}

async fn answer(
    mut conn: TcpStream,
    status: &AtomicU16,
    good: &AtomicUsize,
    bad: &AtomicUsize,
    first: &Mutex<Vec<u8>>,
) {
    let mut buf = Vec::with_capacity(512);
    let mut chunk = [0u8; 512];
    // Read the whole request head (pier-http's parser says when it is there).
    let read = tokio::time::timeout(Duration::from_secs(2), async {
        let mut head = RequestHead::default();
        while buf.len() < 8192 && !matches!(head.parse(&buf, &HeadLimits::default()), Ok(Some(_))) {
            match conn.read(&mut chunk).await {
                Ok(0) | Err(_) => break,
                Ok(n) => buf.extend_from_slice(&chunk[..n]),
            }
        }
    })
    .await;
    if read.is_err() {
        return;
    }
    {
        let mut f = first.lock().unwrap();
        if f.is_empty() {
            *f = buf;
        }
    }
    match status.load(Ordering::SeqCst) {
        CLOSE => {
            bad.fetch_add(1, Ordering::SeqCst);
        }
        HANG => {
            bad.fetch_add(1, Ordering::SeqCst);
            tokio::time::sleep(Duration::from_secs(3)).await;
        }
        code => {
            let head =
                format!("HTTP/1.1 {code} X\r\nContent-Length: 0\r\nConnection: close\r\n\r\n");
            if (200..300).contains(&code) {
                good.fetch_add(1, Ordering::SeqCst);
            } else {
                bad.fetch_add(1, Ordering::SeqCst);
            }
            let _ = conn.write_all(head.as_bytes()).await;
        }
    }
}

fn http_check(rise: u32, fall: u32) -> HealthCheck {
    HealthCheck {
        kind: HealthKind::Http {
            path: "/healthz".into(),
            host: None,
            expect_min: 200,
            expect_max: 299,
        },
        interval: Duration::from_millis(50),
        // Far above a check's time on a loaded machine: a check that timed
        // out while the origin answered would count against the peer
        // unseen by the origin's counters the tests compare with.
        timeout: Duration::from_secs(2),
        rise,
        fall,
    }
}

fn group(addrs: &[SocketAddr], hc: Option<HealthCheck>) -> Arc<Group> {
    let servers = addrs
        .iter()
        .map(|&addr| UpstreamServer::new(addr, 1))
        .collect();
    Arc::new(Group::new(&upstream_with(Balance::RoundRobin, servers, hc)))
}

/// Poll `cond` every 5 ms for at most 20 s (generous: a loaded machine is slow, and
/// a condition that holds costs no more than its own time).
async fn wait_for(what: &str, cond: impl Fn() -> bool) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    while !cond() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "timed out waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

async fn stop_checks(tx: watch::Sender<bool>, tasks: Vec<JoinHandle<()>>) {
    tx.send(true).unwrap();
    for t in tasks {
        tokio::time::timeout(Duration::from_secs(2), t)
            .await
            .expect("checker stops on shutdown")
            .unwrap();
    }
}

#[tokio::test]
async fn http_check_follows_fall_and_rise() {
    let origin = Origin::start(200).await;
    let g = group(&[origin.addr], Some(http_check(2, 3)));
    let (tx, rx) = watch::channel(false);
    let tasks = spawn_health_checks(std::slice::from_ref(&g), &[], rx);
    assert_eq!(tasks.len(), 1);
    let peer = g.peers()[0].clone();

    wait_for("first check", || origin.good.load(Ordering::SeqCst) >= 2).await;
    assert!(peer.is_healthy());
    let req = String::from_utf8(origin.first_request.lock().unwrap().clone()).unwrap();
    assert_eq!(
        req,
        format!(
            "GET /healthz HTTP/1.1\r\nHost: {}\r\nConnection: close\r\nUser-Agent: pier-health\r\n\r\n",
            origin.addr
        )
    );

    // Read before the switch: every bad answer counts after it.
    let bad_before = origin.bad.load(Ordering::SeqCst);
    origin.set(500);
    wait_for("peer down", || !peer.is_healthy()).await;
    let bad = origin.bad.load(Ordering::SeqCst) - bad_before;
    assert!(bad >= 3, "down after {bad} bad checks, fall is 3");
    assert_eq!(g.select(None, &[]), None);

    let good_before = origin.good.load(Ordering::SeqCst);
    origin.set(204);
    wait_for("peer up", || peer.is_healthy()).await;
    let good = origin.good.load(Ordering::SeqCst) - good_before;
    assert!(good >= 2, "up after {good} good checks, rise is 2");
    assert_eq!(g.select(None, &[]), Some(0));

    stop_checks(tx, tasks).await;
}

#[tokio::test]
async fn http_check_closed_and_hung_connections_fail() {
    let closing = Origin::start(CLOSE).await;
    let hanging = Origin::start(HANG).await;
    let mut hc = http_check(1, 2);
    // Far below the hanging origin's 3 s, far above a check's time on a loaded machine.
    hc.timeout = Duration::from_millis(1000);
    let g = group(&[closing.addr, hanging.addr], Some(hc));
    let (tx, rx) = watch::channel(false);
    let tasks = spawn_health_checks(std::slice::from_ref(&g), &[], rx);
    wait_for("closing peer down", || !g.peers()[0].is_healthy()).await;
    wait_for("hanging peer down", || !g.peers()[1].is_healthy()).await;
    assert!(closing.bad.load(Ordering::SeqCst) >= 2);
    assert!(hanging.bad.load(Ordering::SeqCst) >= 2);

    closing.set(200);
    wait_for("closing peer back", || g.peers()[0].is_healthy()).await;
    assert!(!g.peers()[1].is_healthy());
    stop_checks(tx, tasks).await;
}

#[tokio::test]
async fn http_check_host_override_and_expect_range() {
    let origin = Origin::start(302).await;
    let mut hc = http_check(1, 1);
    hc.kind = HealthKind::Http {
        path: "/".into(),
        host: Some("svc.internal".into()),
        expect_min: 200,
        expect_max: 399,
    };
    let g = group(&[origin.addr], Some(hc));
    g.peers()[0].set_healthy(false);
    let (tx, rx) = watch::channel(false);
    let tasks = spawn_health_checks(std::slice::from_ref(&g), &[], rx);
    wait_for("302 within 200..=399", || g.peers()[0].is_healthy()).await;
    let req = origin.first_request.lock().unwrap().clone();
    assert!(req.starts_with(b"GET / HTTP/1.1\r\nHost: svc.internal\r\n"));
    origin.set(404);
    wait_for("404 outside the range", || !g.peers()[0].is_healthy()).await;
    stop_checks(tx, tasks).await;
}

#[tokio::test]
async fn tcp_check_follows_listener() {
    let origin = Origin::start(200).await;
    let hc = HealthCheck {
        kind: HealthKind::Tcp,
        ..http_check(2, 2)
    };
    let g = group(&[origin.addr], Some(hc));
    let (tx, rx) = watch::channel(false);
    let tasks = spawn_health_checks(std::slice::from_ref(&g), &[], rx);
    let peer = g.peers()[0].clone();
    // Connects count as good answers at the origin: two checks have passed.
    wait_for("two tcp checks", || origin.good.load(Ordering::SeqCst) >= 2).await;
    assert!(peer.is_healthy());

    let addr = origin.stop().await;
    wait_for("refused peer down", || !peer.is_healthy()).await;

    // Listen on the same port again (std sets SO_REUSEADDR on Unix).
    let listener = TcpListener::bind(addr).await.unwrap();
    let origin = Origin::serve(listener, 200);
    wait_for("peer back up", || peer.is_healthy()).await;
    stop_checks(tx, tasks).await;
    drop(origin);
}

#[tokio::test]
async fn active_check_restores_passively_downed_peer() {
    let origin = Origin::start(200).await;
    let g = group(&[origin.addr], Some(http_check(3, 3)));
    let (tx, rx) = watch::channel(false);
    let tasks = spawn_health_checks(std::slice::from_ref(&g), &[], rx);
    wait_for("checks running", || origin.good.load(Ordering::SeqCst) >= 3).await;

    // No good answer may be in flight when the peer goes down (one answered
    // before `good_before` but applied after the down would count towards
    // the rise unseen): answer 500 until a check has seen it. Checks of a
    // peer run one at a time, so every earlier good one has been applied.
    let bad_before = origin.bad.load(Ordering::SeqCst);
    origin.set(500);
    wait_for("a bad check", || {
        origin.bad.load(Ordering::SeqCst) > bad_before
    })
    .await;

    // The proxy saw max_fails (3) failed attempts in a row.
    for _ in 0..3 {
        g.report(0, false, clock_ms());
    }
    assert!(!g.peers()[0].is_healthy());
    let good_before = origin.good.load(Ordering::SeqCst);
    origin.set(200);
    wait_for("active check brings it back", || g.peers()[0].is_healthy()).await;
    let good = origin.good.load(Ordering::SeqCst) - good_before;
    assert!(good >= 3, "back after {good} checks, rise is 3");
    assert_eq!(g.peers()[0].consecutive_fails(), 0);
    stop_checks(tx, tasks).await;
}

#[tokio::test]
async fn checkers_stop_when_sender_dropped_and_skip_unchecked_groups() {
    let origin = Origin::start(200).await;
    let checked = group(&[origin.addr, origin.addr], Some(http_check(1, 1)));
    let unchecked = group(&[origin.addr], None);
    let (tx, rx) = watch::channel(false);
    let tasks = spawn_health_checks(&[checked, unchecked], &[], rx);
    assert_eq!(tasks.len(), 2, "one task per peer of checked groups only");
    wait_for("both checked", || origin.good.load(Ordering::SeqCst) >= 2).await;
    drop(tx);
    for t in tasks {
        tokio::time::timeout(Duration::from_secs(2), t)
            .await
            .expect("checker stops when the sender is gone")
            .unwrap();
    }
    // A check may have connected just before the stop. Our own request, answered,
    // means the origin has accepted every connection before it (the backlog is FIFO);
    // once every answer is done, nothing new may arrive: that watch is what is tested
    // (the checkers ran every 50 ms).
    let mut sentinel = TcpStream::connect(origin.addr).await.unwrap();
    sentinel
        .write_all(b"GET /sentinel HTTP/1.1\r\nHost: t\r\n\r\n")
        .await
        .unwrap();
    let mut answer = Vec::new();
    let _ = sentinel.read_to_end(&mut answer).await;
    assert!(answer.starts_with(b"HTTP/1.1 200"), "{answer:?}");
    wait_for("answers to finish", || {
        origin.in_flight.load(Ordering::SeqCst) == 0
    })
    .await;
    let after = origin.good.load(Ordering::SeqCst);
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(
        origin.in_flight.load(Ordering::SeqCst),
        0,
        "a check connected after stop"
    );
    assert_eq!(
        origin.good.load(Ordering::SeqCst),
        after,
        "no checks after stop"
    );
}
