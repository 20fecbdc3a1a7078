//! The engine driven over in-memory streams on both sides: no socket
//! anywhere, which is what proves the driver protocol- and stream-neutral.
//! The client end is a `tokio::io::duplex` pipe handed to `serve_connection`;
//! every upstream connection is a pipe made by `Connector::memory`, with an
//! origin task on its other end.

use pier_core::{Connector, PeerKey, Pool, PoolConfig};
use pier_error::Error;
use pier_http::{BodyLen, HeadLimits, Method, RequestHead, ResponseHead};
use pier_log::{AccessLog, Metrics};
use pier_proxy::{driver, Flow, Phases, Session, Shared, State, Worker};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt, DuplexStream};

const A: &str = "10.9.0.1:80";
const B: &str = "10.9.0.2:80";

/// Phases for the test: panic on `/panic` (a bug in a phase).
struct TestPhases;

impl Phases for TestPhases {
    type Ctx = ();
    async fn request_filter(
        &self,
        _st: &State,
        s: &mut Session,
        _ctx: &mut (),
    ) -> Result<Flow, Error> {
        if s.req.path() == b"/panic" {
            panic!("a phase panicked");
        }
        Ok(Flow::Continue)
    }

    /// On `/stored`: marks the origin's head (what a cache stores) and
    /// counts its runs.
    fn upstream_response_filter(
        &self,
        _st: &State,
        s: &mut Session,
        resp: &mut ResponseHead,
        _ctx: &mut (),
    ) -> Result<(), Error> {
        if s.req.path() == b"/stored" {
            let n = UPSTREAM_FILTERED.fetch_add(1, Relaxed) + 1;
            resp.headers
                .append(b"X-Origin-Step", n.to_string().as_bytes());
        }
        Ok(())
    }

    /// On `/stored`: this client's own field (never stored for others).
    fn response_filter(
        &self,
        _st: &State,
        s: &mut Session,
        resp: &mut ResponseHead,
        _ctx: &mut (),
    ) -> Result<(), Error> {
        if s.req.path() == b"/stored" {
            let who = s.req.headers.get(b"x-client").unwrap_or(b"?").to_vec();
            resp.headers.append(b"Set-Cookie", &who);
        }
        Ok(())
    }
}

/// Runs of `upstream_response_filter` on `/stored` (one test uses it).
static UPSTREAM_FILTERED: AtomicUsize = AtomicUsize::new(0);

/// What the in-memory origins saw.
#[derive(Default)]
struct Seen {
    heads: Mutex<Vec<String>>,
    dials: AtomicUsize,
}

/// An HTTP/1.1 origin on one pipe: answers every request with 200 and the
/// request head it received as the body.
async fn origin(mut s: DuplexStream, seen: Arc<Seen>) {
    let mut buf = Vec::new();
    let limits = HeadLimits::default();
    loop {
        let mut req = RequestHead::default();
        let n = loop {
            if let Ok(Some(n)) = req.parse(&buf, &limits) {
                break n;
            }
            let mut chunk = [0u8; 4096];
            match s.read(&mut chunk).await {
                Ok(0) | Err(_) => return,
                Ok(k) => buf.extend_from_slice(&chunk[..k]),
            }
        };
        let head = String::from_utf8_lossy(&buf[..n]).into_owned();
        buf.drain(..n);
        // Bodies: only Content-Length ones in these tests.
        if let BodyLen::Length(len) = req.body_len() {
            while (buf.len() as u64) < len {
                let mut chunk = [0u8; 4096];
                match s.read(&mut chunk).await {
                    Ok(0) | Err(_) => return,
                    Ok(k) => buf.extend_from_slice(&chunk[..k]),
                }
            }
            buf.drain(..len as usize);
        }
        seen.heads.lock().unwrap().push(head.clone());
        if head.contains("Upgrade: websocket\r\n") {
            // Switch, then echo whatever comes until the other side closes.
            let _ = s
                .write_all(b"HTTP/1.1 101 Switching Protocols\r\nConnection: upgrade\r\nUpgrade: websocket\r\n\r\n")
                .await;
            let mut chunk = [0u8; 4096];
            loop {
                match s.read(&mut chunk).await {
                    Ok(0) | Err(_) => return,
                    Ok(k) => {
                        if s.write_all(&chunk[..k]).await.is_err() {
                            return;
                        }
                    }
                }
            }
        }
        let resp = format!(
            "HTTP/1.1 200 OK\r\nContent-Length: {}\r\n\r\n{}",
            head.len(),
            head
        );
        if s.write_all(resp.as_bytes()).await.is_err() {
            return;
        }
    }
}

struct Engine {
    worker: Arc<Worker<TestPhases>>,
    seen: Arc<Seen>,
}

/// An engine whose upstream connections are pipes; dials to `down` fail as
/// a connect timeout would.
fn engine(extra: &str, down: Option<&'static str>) -> Engine {
    engine_with("", "", extra, down)
}

fn engine_with(top: &str, route: &str, upstream: &str, down: Option<&'static str>) -> Engine {
    let text = format!(
        r#"
{top}
[[listener]]
name = "main"
listen = "127.0.0.1:0"

[[route]]
name = "all"
upstream = "o"
{route}

[upstream.o]
servers = ["{A}", "{B}"]
{upstream}
"#
    );
    let cfg = pier_config::load_str(&text, "engine.toml").expect("config");
    let metrics = Metrics::new(1);
    let pool = Pool::new(PoolConfig {
        workers: 1,
        max_idle_per_server: 8,
        idle_timeout: Duration::from_secs(30),
    });
    let state = State::build(cfg, &metrics, 1, None).expect("state");
    let mut shared = Shared::new(state, pool, metrics, AccessLog::off());
    let seen = Arc::new(Seen::default());
    let s2 = seen.clone();
    let down: Option<SocketAddr> = down.map(|d| d.parse().unwrap());
    shared.connector = Connector::memory(Arc::new(move |key: &PeerKey| {
        s2.dials.fetch_add(1, Relaxed);
        if Some(key.addr) == down {
            return Err(std::io::ErrorKind::TimedOut.into());
        }
        let (ours, theirs) = tokio::io::duplex(64 * 1024);
        tokio::task::spawn_local(origin(theirs, s2.clone()));
        Ok(ours)
    }));
    // A worker is one thread's (RefCell inside), as in pier-core's runtime.
    #[allow(clippy::arc_with_non_send_sync)]
    let worker = Arc::new_cyclic(|me| Worker {
        id: 0,
        shared: Arc::new(shared),
        phases: TestPhases,
        waiting: Default::default(),
        bufs: Default::default(),
        me: me.clone(),
    });
    Engine { worker, seen }
}

/// A client connection: its end of the pipe, the connection served on the other.
fn connect(e: &Engine) -> DuplexStream {
    let (client, server) = tokio::io::duplex(64 * 1024);
    let peer: SocketAddr = "192.0.2.7:50000".parse().unwrap();
    let local: SocketAddr = "192.0.2.1:80".parse().unwrap();
    tokio::task::spawn_local(driver::serve_connection(
        e.worker.clone(),
        server,
        peer,
        local,
        Default::default(),
        None,
    ));
    client
}

/// Read one response; `None` if the connection closed first.
async fn response(c: &mut DuplexStream, buf: &mut Vec<u8>) -> Option<(u16, String, String)> {
    loop {
        let mut head = ResponseHead::default();
        if let Ok(Some(n)) = head.parse(buf, &HeadLimits::default()) {
            let len = match head.body_len(Method::Get).ok()? {
                BodyLen::Length(l) => l as usize,
                _ => 0,
            };
            while buf.len() < n + len {
                let mut chunk = [0u8; 4096];
                let k = c.read(&mut chunk).await.ok()?;
                if k == 0 {
                    return None;
                }
                buf.extend_from_slice(&chunk[..k]);
            }
            let h = String::from_utf8_lossy(&buf[..n]).into_owned();
            let body = String::from_utf8_lossy(&buf[n..n + len]).into_owned();
            buf.drain(..n + len);
            return Some((head.status, h, body));
        }
        let mut chunk = [0u8; 4096];
        let k = c.read(&mut chunk).await.ok()?;
        if k == 0 {
            return None;
        }
        buf.extend_from_slice(&chunk[..k]);
    }
}

async fn read_to_end(c: &mut DuplexStream) -> Vec<u8> {
    let mut all = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(10), c.read_to_end(&mut all)).await;
    all
}

fn run<F: std::future::Future<Output = ()>>(f: F) {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    tokio::task::LocalSet::new().block_on(&rt, async {
        tokio::time::timeout(Duration::from_secs(30), f)
            .await
            .expect("test timed out");
    });
}

#[test]
fn proxies_over_pipes_with_keep_alive_and_pooling() {
    run(async {
        let e = engine("", None);
        let mut c = connect(&e);
        let mut buf = Vec::new();
        for i in 0..3 {
            let req = format!("GET /x/{i}?q=1 HTTP/1.1\r\nHost: example.test\r\n\r\n");
            c.write_all(req.as_bytes()).await.unwrap();
            let (status, _, body) = response(&mut c, &mut buf).await.expect("response");
            assert_eq!(status, 200);
            assert!(
                body.starts_with(&format!("GET /x/{i}?q=1 HTTP/1.1\r\n")),
                "{body}"
            );
            assert!(body.contains("Host: example.test\r\n"), "{body}");
            assert!(body.contains("X-Forwarded-For: 192.0.2.7\r\n"), "{body}");
        }
        // Round robin over two servers, each connection pooled and reused.
        assert_eq!(e.seen.dials.load(Relaxed), 2);
        assert_eq!(e.seen.heads.lock().unwrap().len(), 3);
    });
}

#[test]
fn absolute_form_goes_upstream_in_origin_form_with_its_authority() {
    run(async {
        let e = engine("", None);
        let mut c = connect(&e);
        let mut buf = Vec::new();
        c.write_all(b"GET http://Other.Test:8080/p?a=b HTTP/1.1\r\nHost: ignored.test\r\n\r\n")
            .await
            .unwrap();
        let (status, _, body) = response(&mut c, &mut buf).await.expect("response");
        assert_eq!(status, 200);
        assert!(body.starts_with("GET /p?a=b HTTP/1.1\r\n"), "{body}");
        // One authority, canonical: lower-cased (docs/security.md).
        assert!(body.contains("Host: other.test:8080\r\n"), "{body}");
        assert!(!body.contains("ignored.test\r\n"), "{body}");
        // No path at all: "/".
        c.write_all(b"GET http://o.test HTTP/1.1\r\nHost: o.test\r\n\r\n")
            .await
            .unwrap();
        let (_, _, body) = response(&mut c, &mut buf).await.expect("response");
        assert!(body.starts_with("GET / HTTP/1.1\r\n"), "{body}");
    });
}

#[test]
fn http10_without_host_gets_the_upstream_host() {
    run(async {
        let e = engine("", None);
        let mut c = connect(&e);
        c.write_all(b"GET /old HTTP/1.0\r\n\r\n").await.unwrap();
        let all = String::from_utf8(read_to_end(&mut c).await).unwrap();
        assert!(all.starts_with("HTTP/1.1 200"), "{all}");
        assert!(all.contains("GET /old HTTP/1.1\r\n"), "{all}");
        assert!(
            all.contains(&format!("Host: {A}\r\n")) || all.contains(&format!("Host: {B}\r\n")),
            "{all}"
        );
    });
}

#[test]
fn a_panicking_phase_costs_only_its_request() {
    run(async {
        let e = engine("", None);
        let m = &e.worker.shared.metrics;
        for _ in 0..5 {
            let mut c = connect(&e);
            c.write_all(b"GET /panic HTTP/1.1\r\nHost: a\r\n\r\n")
                .await
                .unwrap();
            let all = String::from_utf8(read_to_end(&mut c).await).unwrap();
            assert!(all.starts_with("HTTP/1.1 500 "), "{all}");
            assert!(all.contains("Connection: close\r\n"), "{all}");
        }
        assert_eq!(m.panics.load(Relaxed), 5);
        assert_eq!(m.active_requests.load(Relaxed), 0, "request slots leaked");
        // The worker goes on serving.
        let mut c = connect(&e);
        let mut buf = Vec::new();
        c.write_all(b"GET /fine HTTP/1.1\r\nHost: a\r\n\r\n")
            .await
            .unwrap();
        assert_eq!(response(&mut c, &mut buf).await.unwrap().0, 200);
    });
}

#[test]
fn connect_timeout_is_retried_even_for_post() {
    run(async {
        // A's connects time out; with a retry the POST lands on B.
        let e = engine("retries = 1", Some(A));
        let mut c = connect(&e);
        let mut buf = Vec::new();
        for _ in 0..2 {
            c.write_all(b"POST /p HTTP/1.1\r\nHost: a\r\nContent-Length: 3\r\n\r\nabc")
                .await
                .unwrap();
            let (status, head, _) = response(&mut c, &mut buf).await.expect("response");
            assert_eq!(status, 200, "{head}");
        }
    });
}

#[test]
fn connect_timeout_answers_502() {
    run(async {
        let e = engine("retries = 0", Some(A));
        let mut c = connect(&e);
        let mut buf = Vec::new();
        let mut statuses = Vec::new();
        for _ in 0..2 {
            c.write_all(b"GET /p HTTP/1.1\r\nHost: a\r\n\r\n")
                .await
                .unwrap();
            let (status, head, _) = response(&mut c, &mut buf).await.expect("response");
            if status != 200 {
                assert!(
                    head.contains("x-pier-reason: upstream-connect\r\n"),
                    "{head}"
                );
            }
            statuses.push(status);
        }
        statuses.sort();
        assert_eq!(statuses, [200, 502]);
    });
}

#[test]
fn only_allowed_upgrades_reach_the_origin() {
    run(async {
        let e = engine("", None);
        let mut buf = Vec::new();
        for (req, why) in [
            (
                "GET /u HTTP/1.1\r\nHost: a\r\nConnection: Upgrade, HTTP2-Settings\r\nUpgrade: h2c\r\nHTTP2-Settings: AAMAAABkAARAAAAAAAIAAAAA\r\n\r\n",
                "h2c",
            ),
            (
                "GET /u HTTP/1.1\r\nHost: a\r\nUpgrade: websocket\r\n\r\n",
                "no Connection: upgrade",
            ),
            (
                "GET /u HTTP/1.1\r\nHost: a\r\nConnection: upgrade\r\nUpgrade: foo\r\n\r\n",
                "not in the allow-list",
            ),
        ] {
            let mut c = connect(&e);
            c.write_all(req.as_bytes()).await.unwrap();
            let (status, _, body) = response(&mut c, &mut buf).await.expect("response");
            assert_eq!(status, 200, "{why}");
            let lower = body.to_ascii_lowercase();
            assert!(!lower.contains("upgrade"), "{why}: forwarded {body}");
            assert!(!lower.contains("http2-settings"), "{why}: forwarded {body}");
        }
    });
}

#[test]
fn client_closing_mid_body_gets_no_499_on_the_wire() {
    run(async {
        let e = engine("", None);
        let mut c = connect(&e);
        c.write_all(b"POST /p HTTP/1.1\r\nHost: a\r\nContent-Length: 100\r\n\r\nabc")
            .await
            .unwrap();
        c.shutdown().await.unwrap();
        let all = read_to_end(&mut c).await;
        assert!(all.is_empty(), "sent: {:?}", String::from_utf8_lossy(&all));
    });
}

#[test]
fn header_rules_and_host_header() {
    run(async {
        let e = engine_with(
            "",
            "host_header = \"upstream\"\n[route.headers]\nrequest_remove = [\"X-Debug\"]\nrequest_set = { \"X-Env\" = \"route\" }\nresponse_add = { \"X-Resp\" = \"r\" }\nresponse_remove = [\"X-Secret\"]\n",
            "[upstream.o.headers]\nrequest_set = { \"X-Env\" = \"upstream\", \"X-Up\" = \"1\" }\nrequest_add = { \"X-Multi\" = \"b\" }\n",
            None,
        );
        let mut c = connect(&e);
        let mut buf = Vec::new();
        c.write_all(b"GET /h HTTP/1.1\r\nHost: client.test\r\nX-Debug: 1\r\nX-Multi: a\r\n\r\n")
            .await
            .unwrap();
        let (status, head, body) = response(&mut c, &mut buf).await.expect("response");
        assert_eq!(status, 200);
        // Upstream rules, then the route's: the route's set wins.
        assert!(body.contains("X-Env: route\r\n"), "{body}");
        assert!(!body.contains("X-Env: upstream"), "{body}");
        assert!(body.contains("X-Up: 1\r\n"), "{body}");
        assert!(
            body.contains("X-Multi: a\r\n") && body.contains("X-Multi: b\r\n"),
            "{body}"
        );
        assert!(!body.contains("X-Debug"), "{body}");
        // host_header = "upstream": the server's address; the client's host
        // is still told in X-Forwarded-Host.
        assert!(
            body.contains(&format!("Host: {A}\r\n")) || body.contains(&format!("Host: {B}\r\n")),
            "{body}"
        );
        assert!(!body.contains("\nHost: client.test\r\n"), "{body}");
        assert!(body.contains("X-Forwarded-Host: client.test\r\n"), "{body}");
        assert!(head.contains("X-Resp: r\r\n"), "{head}");
        // The request as received is kept for logs: the session's `req`.
    });
}

#[test]
fn response_rules_apply_to_pier_made_answers() {
    run(async {
        // A refuses: its request gets a 502 made by Pier, with the route's headers.
        let e = engine_with(
            "",
            "[route.headers]\nresponse_set = { \"Strict-Transport-Security\" = \"max-age=60\" }\n",
            "retries = 0\n",
            Some(A),
        );
        let mut c = connect(&e);
        let mut buf = Vec::new();
        let mut statuses = Vec::new();
        for _ in 0..2 {
            c.write_all(b"GET /h HTTP/1.1\r\nHost: a\r\n\r\n")
                .await
                .unwrap();
            let (status, head, _) = response(&mut c, &mut buf).await.expect("response");
            // Proxied and Pier-made alike.
            assert!(
                head.contains("Strict-Transport-Security: max-age=60\r\n"),
                "{head}"
            );
            statuses.push(status);
        }
        statuses.sort();
        assert_eq!(statuses, [200, 502]);
    });
}

#[test]
fn literal_host_header() {
    run(async {
        let e = engine_with("", "host_header = \"backend.internal:8443\"", "", None);
        let mut c = connect(&e);
        let mut buf = Vec::new();
        c.write_all(b"GET /h HTTP/1.1\r\nHost: client.test\r\n\r\n")
            .await
            .unwrap();
        let (_, _, body) = response(&mut c, &mut buf).await.expect("response");
        assert!(body.contains("Host: backend.internal:8443\r\n"), "{body}");
    });
}

#[test]
fn upgrades_can_be_switched_off() {
    run(async {
        let e = engine_with("[http]\nupgrade = []\n", "", "", None);
        let mut c = connect(&e);
        let mut buf = Vec::new();
        c.write_all(
            b"GET /ws HTTP/1.1\r\nHost: a\r\nConnection: upgrade\r\nUpgrade: websocket\r\n\r\n",
        )
        .await
        .unwrap();
        let (status, _, body) = response(&mut c, &mut buf).await.expect("response");
        assert_eq!(status, 200);
        assert!(!body.to_ascii_lowercase().contains("upgrade"), "{body}");
    });
}

#[test]
fn tunnels_are_counted_and_idle_out() {
    run(async {
        let e = engine_with("[timeouts]\ntunnel_idle = \"300ms\"\n", "", "", None);
        let m = &e.worker.shared.metrics;
        let mut c = connect(&e);
        let mut buf = Vec::new();
        c.write_all(
            b"GET /ws HTTP/1.1\r\nHost: a\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n\r\n",
        )
        .await
        .unwrap();
        let (status, _, _) = response(&mut c, &mut buf).await.expect("101");
        assert_eq!(status, 101);
        c.write_all(b"ping").await.unwrap();
        let mut got = [0u8; 4];
        c.read_exact(&mut got).await.unwrap();
        assert_eq!(&got, b"ping");
        assert_eq!(m.active_tunnels.load(Relaxed), 1);
        // Nothing moves: the tunnel closes (bounded by run's deadline).
        let rest = read_to_end(&mut c).await;
        assert!(rest.is_empty());
        assert_eq!(m.tunnels.load(Relaxed), 1);
        let t0 = std::time::Instant::now();
        while m.active_tunnels.load(Relaxed) != 0 && t0.elapsed() < Duration::from_secs(10) {
            tokio::task::yield_now().await;
        }
        assert_eq!(m.active_tunnels.load(Relaxed), 0);
    });
}

/// The cache stores the origin's head as `upstream_response_filter` left it,
/// never what `response_filter` made for one client; a hit does not run the
/// origin's steps again.
#[test]
fn the_cache_stores_what_the_origin_steps_left() {
    run(async {
        let e = engine_with(
            "[cache.c]\nmemory = \"1m\"\n",
            "[route.cache]\nzone = \"c\"\nttl = { \"200\" = \"10m\" }\n",
            "",
            None,
        );
        let mut c = connect(&e);
        let mut buf = Vec::new();
        for (who, cache) in [("alice", "fwd=miss; stored"), ("bob", "hit")] {
            let req = format!("GET /stored HTTP/1.1\r\nHost: c.test\r\nX-Client: {who}\r\n\r\n");
            c.write_all(req.as_bytes()).await.unwrap();
            let (status, head, _) = response(&mut c, &mut buf).await.expect("response");
            assert_eq!(status, 200, "{head}");
            assert!(head.contains(cache), "{who}: {head}");
            // The origin's step ran once, on the miss; the hit carries its edit.
            assert!(head.contains("X-Origin-Step: 1\r\n"), "{who}: {head}");
            // Each client gets its own field, and only its own.
            assert!(
                head.contains(&format!("Set-Cookie: {who}\r\n")),
                "{who}: {head}"
            );
            assert_eq!(head.matches("Set-Cookie").count(), 1, "{who}: {head}");
        }
        assert_eq!(UPSTREAM_FILTERED.load(Relaxed), 1);
        assert_eq!(e.seen.heads.lock().unwrap().len(), 1, "one origin fetch");
    });
}

/// An Upgrade request on a cached route goes to the origin: a stored answer
/// for the same URL is not a switch of protocols, and a tunnel fills nothing.
#[test]
fn an_upgrade_is_never_answered_from_the_cache() {
    run(async {
        let e = engine_with(
            "[cache.c]\nmemory = \"1m\"\n",
            "[route.cache]\nzone = \"c\"\nttl = { \"200\" = \"10m\" }\n",
            "",
            None,
        );
        let mut c = connect(&e);
        let mut buf = Vec::new();
        c.write_all(b"GET /chat HTTP/1.1\r\nHost: c.test\r\n\r\n")
            .await
            .unwrap();
        let (status, head, _) = response(&mut c, &mut buf).await.expect("response");
        assert_eq!(status, 200);
        assert!(head.contains("stored"), "{head}");
        let mut c = connect(&e);
        c.write_all(
            b"GET /chat HTTP/1.1\r\nHost: c.test\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n\r\n",
        )
        .await
        .unwrap();
        let mut got = Vec::new();
        while !got.windows(4).any(|w| w == b"\r\n\r\n") {
            let mut chunk = [0u8; 1024];
            let n = c.read(&mut chunk).await.unwrap();
            assert!(n > 0, "closed before a response head");
            got.extend_from_slice(&chunk[..n]);
        }
        let text = String::from_utf8_lossy(&got);
        assert!(text.starts_with("HTTP/1.1 101 "), "{text}");
        assert_eq!(
            e.seen.heads.lock().unwrap().len(),
            2,
            "the upgrade reached the origin"
        );
    });
}
