//! A client that goes away cancels its upstream request (issue 31, hole 7): a closed
//! HTTP/1 connection, an HTTP/2 RST_STREAM or a closed HTTP/2 connection ends the
//! request at once (the upstream connection closed, the stream reset), so an
//! attacker cannot keep more requests in flight than its connections and streams
//! allow. The origin here takes 30 s to answer; every wait below is bounded at 5 s.

mod common;

use std::net::SocketAddr;

use common::*;

const SLOW: &str = "/slow/30000";

fn active(p: &PierProcess) -> f64 {
    p.metric_value("pier_active_requests").unwrap_or(-1.0)
}

#[track_caller]
fn wait_active(p: &PierProcess, want: f64, what: &str) {
    assert_eq!(
        wait_metric(p, "pier_active_requests", want),
        Some(want),
        "{what}: pier_active_requests"
    );
}

#[test]
fn a_closed_http1_connection_cancels_its_request() {
    let o = Origin::start();
    let p = pier(&simple_config(&[o.addr()], "", ""));
    let mut conns = Vec::new();
    for _ in 0..5 {
        let mut c = RawConn::connect(p.listener("main"));
        c.send(format!("GET {SLOW} HTTP/1.1\r\nHost: a\r\n\r\n").as_bytes());
        conns.push(c);
    }
    wait_active(&p, 5.0, "five requests waiting on the origin");
    drop(conns);
    wait_active(&p, 0.0, "their clients gone");
    // Pier still serves, and pipelining is not mistaken for a client gone.
    let mut c = RawConn::connect(p.listener("main"));
    c.send(b"GET /hello HTTP/1.1\r\nHost: a\r\n\r\nGET /hello HTTP/1.1\r\nHost: a\r\n\r\n");
    assert_eq!(c.read_response().unwrap().status, 200);
    assert_eq!(c.read_response().unwrap().status, 200);
}

fn h2_runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime")
}

async fn h2_connect(
    addr: SocketAddr,
) -> (
    h2::client::SendRequest<bytes::Bytes>,
    tokio::task::JoinHandle<()>,
) {
    let tcp = tokio::net::TcpStream::connect(addr).await.expect("connect");
    let (send, conn) = h2::client::handshake(tcp).await.expect("h2 handshake");
    let task = tokio::spawn(async move {
        let _ = conn.await;
    });
    (send, task)
}

fn h2_get(path: &str) -> http::Request<()> {
    http::Request::builder()
        .uri(format!("http://a{path}"))
        .body(())
        .unwrap()
}

#[test]
fn http2_resets_and_closed_connections_cancel_their_requests() {
    let o = Origin::start();
    let cfg = h2c_main(&simple_config(
        &[o.addr()],
        "[http2]\nmax_concurrent_streams = 4",
        "",
    ));
    let p = pier(&cfg);
    let addr = p.listener("main");
    let rt = h2_runtime();
    rt.block_on(async {
        let (mut send, task) = h2_connect(addr).await;
        // Rounds of four streams, each round reset: in flight never passes the
        // stream limit, and reset streams end their requests.
        for round in 0..3 {
            let mut streams = Vec::new();
            for _ in 0..4 {
                send = send.ready().await.expect("ready");
                let (resp, _) = send.send_request(h2_get(SLOW), true).expect("send");
                streams.push(resp);
            }
            let p = &p;
            wait_active_async(p, 4.0, &format!("round {round}: four in flight")).await;
            // Dropping a response future resets its stream (RST_STREAM CANCEL).
            drop(streams);
            wait_active_async(p, 0.0, &format!("round {round}: all reset")).await;
        }
        // A whole connection closed with its streams in flight.
        for _ in 0..4 {
            send = send.ready().await.expect("ready");
            let (resp, _) = send.send_request(h2_get(SLOW), true).expect("send");
            std::mem::forget(resp);
        }
        wait_active_async(&p, 4.0, "four in flight before the close").await;
        task.abort();
        drop(send);
    });
    drop(rt);
    wait_active(&p, 0.0, "the connection closed");
    assert_eq!(active(&p), 0.0);
}

/// `wait_active` without blocking the runtime that drives the HTTP/2 client.
async fn wait_active_async(p: &PierProcess, want: f64, what: &str) {
    let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(5);
    let mut last = None;
    while tokio::time::Instant::now() < deadline {
        let admin = p.admin();
        last = tokio::task::spawn_blocking(move || {
            // The admin endpoint answers a Host that names it.
            let host = admin.to_string();
            let r = RawConn::connect(admin)
                .request("GET", "/metrics", &[("host", &host)], b"")
                .expect("GET /metrics");
            r.body_str()
                .lines()
                .find(|l| l.starts_with("pier_active_requests "))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|v| v.parse::<f64>().ok())
        })
        .await
        .unwrap();
        if last == Some(want) {
            return;
        }
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    panic!("{what}: pier_active_requests {last:?}, wanted {want}");
}
