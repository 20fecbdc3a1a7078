//! HTTP/3 for clients (`[[listener]] http3 = true`): a real QUIC client
//! (quinn + h3, the stack of hyperium's h3) against Pier's UDP port, which
//! is its TLS listener's TCP port. The same route steps as over TCP: the
//! origin gets the request, a body streams up, Lua runs, metrics and the
//! access log name the protocol; TCP responses carry Alt-Svc.

mod common;

use bytes::{Buf, Bytes};
use common::*;
use pier_test_support::pattern;
use pier_test_support::tls::{Alg, CertPair, TestCa, TlsClientConfig};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

struct Site {
    _dir: TempDir,
    ca: TestCa,
    cert: CertPair,
}

fn site() -> Site {
    let dir = TempDir::new();
    let ca = TestCa::new(dir.path(), "h3");
    let cert = ca.server("site", &["localhost"], Alg::EcdsaP256, 30);
    Site {
        _dir: dir,
        ca,
        cert,
    }
}

/// A TLS listener with `http3 = true` in front of `origin`; `route` lines
/// go under the route, `top` before the listener.
fn config(s: &Site, origin: SocketAddr, top: &str, route: &str) -> String {
    base_config(
        top,
        &format!(
            "[[route]]\nname = \"default\"\nupstream = \"app\"\n{route}\n\n[upstream.app]\nservers = [\"{origin}\"]\n"
        ),
    )
    .replace(
        "[[listener]]\nname = \"main\"\nlisten = \"127.0.0.1:0\"\n",
        &format!(
            "[[listener]]\nname = \"main\"\nlisten = \"127.0.0.1:0\"\nhttp3 = true\n[listener.tls]\ncert = \"{}\"\nkey = \"{}\"\n",
            s.cert.cert.display(),
            s.cert.key.display()
        ),
    )
}

/// A Pier with an HTTP/3 listener (`config`) in front of a fresh origin.
struct Fixture {
    s: Site,
    o: Origin,
    p: PierProcess,
    /// The listener: TCP and UDP on one port.
    addr: SocketAddr,
}

fn start(top: &str, route: &str) -> Fixture {
    start_with(top, route, |_, text| text)
}

/// As [`start`], the config text edited by `edit` first.
fn start_with(top: &str, route: &str, edit: impl FnOnce(&Site, String) -> String) -> Fixture {
    let s = site();
    let o = Origin::start();
    let p = pier(&edit(&s, config(&s, o.addr(), top, route)));
    let addr = p.listener("main");
    Fixture { s, o, p, addr }
}

/// The requests Pier counted over HTTP/3.
fn h3_requests(p: &PierProcess) -> Option<f64> {
    p.metric_value("pier_requests_by_protocol_total{protocol=\"h3\"}")
}

/// A response as an HTTP/3 client got it.
struct H3Response {
    status: u16,
    headers: http::HeaderMap,
    body: Vec<u8>,
    trailers: Option<http::HeaderMap>,
}

type Send = h3::client::SendRequest<h3_quinn::OpenStreams, Bytes>;

/// An HTTP/3 client connection to `addr`, trusting `ca`: the QUIC
/// connection, its request sender, and the task driving it.
struct Client {
    _ep: quinn::Endpoint,
    conn: quinn::Connection,
    send: Send,
    drive: tokio::task::JoinHandle<h3::error::ConnectionError>,
}

async fn connect(addr: SocketAddr, ca: &std::path::Path) -> Client {
    connect_as(addr, ca, None).await
}

/// As [`connect`], presenting `client`'s certificate when given.
async fn connect_as(addr: SocketAddr, ca: &std::path::Path, client: Option<&CertPair>) -> Client {
    try_connect_as(addr, ca, client)
        .await
        .expect("QUIC handshake and HTTP/3 connection")
}

/// A QUIC client endpoint trusting `ca` (presenting `client` when given),
/// offering ALPN h3; `early`: it resumes sessions with 0-RTT; `idle`: its
/// own idle timeout (quinn's default otherwise).
fn client_endpoint(
    ca: &std::path::Path,
    client: Option<&CertPair>,
    early: bool,
    idle: Option<Duration>,
) -> quinn::Endpoint {
    let mut tls = (*TlsClientConfig::new(ca, client, &["h3"], None).0).clone();
    tls.enable_early_data = early;
    let quic = quinn::crypto::rustls::QuicClientConfig::try_from(tls).unwrap();
    let mut cfg = quinn::ClientConfig::new(Arc::new(quic));
    if let Some(idle) = idle {
        let mut t = quinn::TransportConfig::default();
        t.max_idle_timeout(Some(idle.try_into().unwrap()));
        cfg.transport_config(Arc::new(t));
    }
    let mut ep = quinn::Endpoint::client("127.0.0.1:0".parse().unwrap()).unwrap();
    ep.set_default_client_config(cfg);
    ep
}

/// HTTP/3 on a QUIC connection: its request sender and the task driving
/// it; None when the HTTP/3 connection fails.
async fn h3_on(
    conn: &quinn::Connection,
) -> Option<(Send, tokio::task::JoinHandle<h3::error::ConnectionError>)> {
    let (mut driver, send) = h3::client::new(h3_quinn::Connection::new(conn.clone()))
        .await
        .ok()?;
    let drive = tokio::spawn(async move { std::future::poll_fn(|cx| driver.poll_close(cx)).await });
    Some((send, drive))
}

/// As [`connect_as`]; None when the handshake or the HTTP/3 connection fails.
async fn try_connect_as(
    addr: SocketAddr,
    ca: &std::path::Path,
    client: Option<&CertPair>,
) -> Option<Client> {
    let ep = client_endpoint(ca, client, false, None);
    let conn = ep.connect(addr, "localhost").unwrap().await.ok()?;
    let (send, drive) = h3_on(&conn).await?;
    Some(Client {
        _ep: ep,
        conn,
        send,
        drive,
    })
}

/// One request on `send`: `body` streamed in two pieces, the whole response
/// read (trailers too).
async fn request(send: &mut Send, port: u16, method: &str, path: &str, body: &[u8]) -> H3Response {
    let mut req = http::Request::builder()
        .method(method)
        .uri(format!("https://localhost:{port}{path}"));
    if !body.is_empty() {
        req = req.header("content-length", body.len());
    }
    let mut stream = send
        .send_request(req.body(()).unwrap())
        .await
        .expect("send the request");
    if !body.is_empty() {
        // In two pieces: the body streams.
        let (a, b) = body.split_at(body.len() / 2);
        stream.send_data(Bytes::copy_from_slice(a)).await.unwrap();
        stream.send_data(Bytes::copy_from_slice(b)).await.unwrap();
    }
    stream.finish().await.expect("end the request");
    let resp = stream.recv_response().await.expect("a response");
    let mut got = Vec::new();
    while let Some(mut chunk) = stream.recv_data().await.expect("the body") {
        while chunk.has_remaining() {
            let c = chunk.chunk();
            got.extend_from_slice(c);
            let n = c.len();
            chunk.advance(n);
        }
    }
    let trailers = stream.recv_trailers().await.expect("trailers");
    H3Response {
        status: resp.status().as_u16(),
        headers: resp.headers().clone(),
        body: got,
        trailers,
    }
}

/// `f` on a current-thread runtime, bounded at 60 s.
fn run<F: std::future::Future>(f: F) -> F::Output {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    block(&rt, f)
}

/// `f` on `rt` (which keeps its connections between calls), bounded at 60 s.
fn block<F: std::future::Future>(rt: &tokio::runtime::Runtime, f: F) -> F::Output {
    rt.block_on(async {
        tokio::time::timeout(Duration::from_secs(60), f)
            .await
            .expect("the HTTP/3 exchange timed out")
    })
}

/// `requests` (method, path, body) in turn on one QUIC connection to `addr`,
/// trusting `ca`.
fn h3(addr: SocketAddr, ca: &std::path::Path, requests: &[(&str, &str, &[u8])]) -> Vec<H3Response> {
    run(async {
        let mut c = connect(addr, ca).await;
        let mut out = Vec::new();
        for (method, path, body) in requests {
            out.push(request(&mut c.send, addr.port(), method, path, body).await);
        }
        c.drive.abort();
        c.conn.close(0u32.into(), b"done");
        out
    })
}

#[test]
fn requests_over_http3_take_the_route_steps_to_the_origin() {
    let Fixture { s, o: _o, p, addr } = start(
        "",
        "[route.headers]\nresponse_add = { \"X-Route\" = \"r\" }\n",
    );
    let body = b"twelve bytes";
    let r = h3(
        addr,
        &s.ca.cert,
        &[
            ("GET", "/hello", b""),
            ("POST", "/echo", body),
            ("GET", "/headers", b""),
        ],
    );
    assert_eq!(r[0].status, 200);
    assert_eq!(r[0].body, b"hello world\n");
    assert_eq!(r[0].headers.get("x-route").unwrap(), "r");
    // Over HTTP/3 there is nothing to upgrade to.
    assert!(r[0].headers.get("alt-svc").is_none());
    assert_eq!(r[1].status, 200);
    assert_eq!(r[1].body, body, "the request body reached the origin");
    // The origin saw an HTTP/1.1 request: the authority as Host, and the
    // scheme as X-Forwarded-Proto.
    let head = String::from_utf8_lossy(&r[2].body).to_ascii_lowercase();
    assert!(head.starts_with("get /headers http/1.1\r\n"), "{head}");
    assert!(
        head.contains(&format!("\r\nhost: localhost:{}\r\n", addr.port())),
        "{head}"
    );
    assert!(head.contains("\r\nx-forwarded-proto: https\r\n"), "{head}");
    assert_eq!(h3_requests(&p), Some(3.0));
}

#[test]
fn tcp_responses_point_browsers_to_http3() {
    use pier_test_support::tls::TlsClient;
    let Fixture {
        s,
        o: _o,
        p: _p,
        addr,
    } = start("", "");
    let tls = TlsClientConfig::new(&s.ca.cert, None, &["http/1.1"], None);
    let mut c = TlsClient::connect(addr, "localhost", &tls).expect("TLS");
    let r = c.get("localhost", "/hello").expect("HTTPS over TCP");
    assert_eq!(r.status, 200);
    let want = format!("h3=\":{}\"; ma=86400", addr.port());
    assert_eq!(r.header("alt-svc"), Some(want.as_str()), "{:?}", r.headers);
}

#[test]
fn lua_hooks_run_on_http3_requests() {
    let Fixture { s, o: _o, p: _p, addr } = start("", "[route.lua]\naccess = '''\nngx.req.set_header(\"X-Proto\", ngx.var.server_protocol)\n'''\nheader_filter = '''\nngx.header[\"X-Seen\"] = ngx.var.server_protocol\n'''\n");
    let r = h3(addr, &s.ca.cert, &[("GET", "/headers", b"")]);
    assert_eq!(r[0].status, 200);
    assert_eq!(r[0].headers.get("x-seen").unwrap(), "HTTP/3.0");
    let head = String::from_utf8_lossy(&r[0].body).to_ascii_lowercase();
    assert!(head.contains("\r\nx-proto: http/3.0\r\n"), "{head}");
}

#[test]
fn quick_mode_serves_http3_with_its_certificate() {
    let s = site();
    let o = Origin::start();
    let (cert, key, to) = (
        s.cert.cert.display().to_string(),
        s.cert.key.display().to_string(),
        o.addr().to_string(),
    );
    let p = PierProcess::start_args(
        bin(),
        &[
            "proxy",
            "--listen",
            "127.0.0.1:0",
            "--to",
            &to,
            "--tls-cert",
            &cert,
            "--tls-key",
            &key,
            "--http3",
        ],
    );
    let addr = p.listeners()[0].1;
    let r = h3(addr, &s.ca.cert, &[("GET", "/hello", b"")]);
    assert_eq!(r[0].status, 200);
    assert_eq!(r[0].body, b"hello world\n");
}

/// The base64 SHA-256 of a certificate's public key (SubjectPublicKeyInfo),
/// as Chromium's `--ignore-certificate-errors-spki-list` takes it.
fn spki_hash(cert: &std::path::Path) -> String {
    let out = run_with_timeout(
        std::process::Command::new("sh").arg("-c").arg(format!(
            "openssl x509 -in '{}' -pubkey -noout | openssl pkey -pubin -outform der \
             | openssl dgst -sha256 -binary | base64",
            cert.display()
        )),
        Duration::from_secs(20),
    );
    let h = String::from_utf8_lossy(&out.stdout).trim().to_string();
    assert_eq!(h.len(), 44, "an SPKI hash from openssl: {h:?}");
    h
}

/// Headless Chromium loads a page through Pier over HTTP/3 (QUIC forced for
/// this origin, the test certificate allowed by its key's hash) and the page
/// says which protocol it came over.
#[test]
fn chromium_loads_a_page_over_http3() {
    use pier_test_support::browser::Browser;
    let Fixture { s, o: _o, p, addr } = start("", "");
    let origin = format!("localhost:{}", addr.port());
    let force = format!("--origin-to-force-quic-on={origin}");
    let spki = format!(
        "--ignore-certificate-errors-spki-list={}",
        spki_hash(&s.cert.cert)
    );
    let mut b = Browser::open_with(
        &format!("https://{origin}/hello"),
        &[
            "--enable-quic",
            &force,
            &spki,
            "--host-resolver-rules=MAP localhost 127.0.0.1",
        ],
    );
    b.wait_for(
        "document.readyState === 'complete' && document.body.innerText.includes('hello world')",
        "the page loaded",
    );
    let proto = b.eval("performance.getEntriesByType('navigation')[0].nextHopProtocol");
    assert_eq!(proto, "h3", "the page came over {proto}");
    let n = h3_requests(&p).unwrap_or(0.0);
    assert!(n >= 1.0, "Pier counted {n} HTTP/3 requests");
}

#[test]
fn large_bodies_and_trailers_cross_http3() {
    let Fixture {
        s,
        o: _o,
        p,
        addr: _addr,
    } = start("", "");
    let n = 2_000_000;
    let up = pattern(7, 1 << 20);
    let r = h3(
        p.listener("main"),
        &s.ca.cert,
        &[
            ("GET", &format!("/bytes/{n}"), b""),
            ("GET", "/chunked/100000", b""),
            ("POST", "/echo", &up),
        ],
    );
    assert_eq!(r[0].status, 200);
    assert_eq!(r[0].body.len(), n);
    assert!(r[0].body == pattern(0, n), "the 2 MB body arrived intact");
    // A chunked origin body and its trailer field, as HTTP/3 trailers.
    assert_eq!(r[1].status, 200);
    assert!(r[1].body == pattern(0, 100_000));
    let t = r[1].trailers.as_ref().expect("trailers over HTTP/3");
    assert_eq!(t.get("x-trailer").unwrap(), "done");
    // 1 MiB up, streamed, and back.
    assert_eq!(r[2].status, 200);
    assert!(r[2].body == up, "the 1 MiB request body came back intact");
}

#[test]
fn many_streams_at_once_on_one_connection() {
    let Fixture { s, o: _o, p, addr } = start("", "");
    let statuses = run(async {
        let c = connect(addr, &s.ca.cert).await;
        let mut tasks = tokio::task::JoinSet::new();
        for i in 0..64 {
            let mut send = c.send.clone();
            tasks.spawn(async move {
                let r = request(
                    &mut send,
                    addr.port(),
                    "GET",
                    &format!("/bytes/{}", 1000 + i),
                    b"",
                )
                .await;
                (r.status, r.body.len(), 1000 + i)
            });
        }
        let mut got = Vec::new();
        while let Some(r) = tasks.join_next().await {
            got.push(r.unwrap());
        }
        c.drive.abort();
        got
    });
    assert_eq!(statuses.len(), 64);
    for (status, len, want) in statuses {
        assert_eq!((status, len), (200, want));
    }
    assert_eq!(h3_requests(&p), Some(64.0));
}

#[test]
fn a_stream_reset_mid_body_costs_only_that_stream() {
    let Fixture { s, o: _o, p, addr } = start("", "");
    let after = run(async {
        let mut c = connect(addr, &s.ca.cert).await;
        let req = http::Request::get(format!("https://localhost:{}/bytes/50000000", addr.port()))
            .body(())
            .unwrap();
        let mut stream = c.send.send_request(req).await.unwrap();
        stream.finish().await.unwrap();
        let resp = stream.recv_response().await.unwrap();
        assert_eq!(resp.status(), 200);
        let first = stream.recv_data().await.unwrap();
        assert!(first.is_some_and(|b| b.has_remaining()));
        // Gone mid-body: STOP_SENDING, and the stream dropped.
        stream.stop_sending(h3::error::Code::H3_REQUEST_CANCELLED);
        drop(stream);
        // The connection goes on.
        let r = request(&mut c.send, addr.port(), "GET", "/hello", b"").await;
        c.drive.abort();
        r
    });
    assert_eq!(after.status, 200);
    assert_eq!(after.body, b"hello world\n");
    assert_eq!(p.metric_value("pier_panics_total"), Some(0.0));
}

#[test]
fn an_idle_http3_connection_is_closed() {
    let Fixture {
        s,
        o: _o,
        p: _p,
        addr,
    } = start("[timeouts]\nclient_idle = \"300ms\"\n", "");
    let closed = run(async {
        let mut c = connect(addr, &s.ca.cert).await;
        let r = request(&mut c.send, addr.port(), "GET", "/hello", b"").await;
        assert_eq!(r.status, 200);
        // Nothing more is sent: Pier's idle timeout ends the connection
        // (waited for as the close itself, within the run's 60 s bound).
        c.conn.closed().await
    });
    assert!(
        matches!(
            closed,
            quinn::ConnectionError::TimedOut | quinn::ConnectionError::ApplicationClosed(_)
        ),
        "{closed:?}"
    );
}

/// `quic_retry = true`: every new client proves its address first (a Retry
/// round trip), then is served as usual; both are counted.
#[test]
fn quic_retry_validates_every_new_client() {
    let Fixture { s, o: _o, p, addr } = start_with("", "", |_, text| {
        text.replace("http3 = true\n", "http3 = true\nquic_retry = true\n")
    });
    for _ in 0..2 {
        let r = h3(addr, &s.ca.cert, &[("GET", "/hello", b"")]);
        assert_eq!(r[0].status, 200);
    }
    assert_eq!(p.metric_value("pier_http3_retries_total"), Some(2.0));
    assert_eq!(
        p.metric_value("pier_http3_handshakes_total{result=\"ok\"}"),
        Some(2.0)
    );
}

/// The route's cache over HTTP/3: a miss fills it, a hit answers from it
/// (small and large bodies), the origin asked once per object.
#[test]
fn the_cache_serves_http3_clients() {
    let Fixture {
        s,
        o,
        p,
        addr: _addr,
    } = start(
        "[cache.main]\nmemory = \"64m\"\nmax_object = \"8m\"\n",
        "[route.cache]\nzone = \"main\"\nttl = { \"200\" = \"10m\" }\n",
    );
    let n = 3_000_000;
    let big = format!("/bytes/{n}");
    let r = h3(
        p.listener("main"),
        &s.ca.cert,
        &[
            ("GET", "/hello", b""),
            ("GET", "/hello", b""),
            ("GET", &big, b""),
            ("GET", &big, b""),
        ],
    );
    let status = |i: usize| {
        r[i].headers
            .get("cache-status")
            .map(|v| v.to_str().unwrap().to_string())
            .unwrap_or_default()
    };
    assert!(status(0).contains("fwd=miss"), "{}", status(0));
    assert!(status(1).contains("hit"), "{}", status(1));
    assert_eq!(r[1].body, b"hello world\n");
    assert!(status(3).contains("hit"), "{}", status(3));
    assert!(
        r[3].body == pattern(0, n),
        "the stored 3 MB body came back intact"
    );
    assert_eq!(o.requests(), 2, "one origin fetch per object");
}

/// A listener that asks for client certificates asks over QUIC too, and
/// Lua reads the subject (`ngx.var.ssl_client_s_dn`) as over TCP.
#[test]
fn client_certificates_over_http3() {
    let lua = "[route.lua]\nheader_filter = '''\nngx.header[\"X-Subject\"] = ngx.var.ssl_client_s_dn or \"none\"\n'''\n";
    let Fixture {
        s,
        o: _o,
        p: _p,
        addr,
    } = start_with("", lua, |s, text| {
        text.replace(
            "[listener.tls]\n",
            &format!(
                "[listener.tls]\nclient_ca = \"{}\"\nclient_auth = \"required\"\n",
                s.ca.cert.display()
            ),
        )
    });
    let client = s.ca.client("alice", "alice");
    let r = run(async {
        let mut c = connect_as(addr, &s.ca.cert, Some(&client)).await;
        let r = request(&mut c.send, addr.port(), "GET", "/hello", b"").await;
        c.drive.abort();
        r
    });
    assert_eq!(r.status, 200);
    let subject = r.headers.get("x-subject").unwrap().to_str().unwrap();
    assert!(subject.contains("CN=alice"), "{subject}");
    // Without a certificate the connection is refused.
    let served = run(async {
        let got = tokio::time::timeout(Duration::from_secs(20), async {
            let mut c = try_connect_as(addr, &s.ca.cert, None).await?;
            let req = http::Request::get(format!("https://localhost:{}/hello", addr.port()))
                .body(())
                .unwrap();
            let mut st = c.send.send_request(req).await.ok()?;
            st.finish().await.ok()?;
            st.recv_response().await.ok()
        })
        .await;
        matches!(got, Ok(Some(_)))
    });
    assert!(!served, "a client without a certificate was served");
}

/// An extended CONNECT (RFC 9220) to `path`: the response status, and (when
/// 200) the frames echoed back for `messages`.
fn connect_ws(f: &Fixture, path: &str, messages: &[&[u8]]) -> (u16, Vec<Vec<u8>>) {
    use pier_test_support::ws;
    run(async {
        let mut c = connect(f.addr, &f.s.ca.cert).await;
        let mut req = http::Request::builder()
            .method("CONNECT")
            .uri(format!("https://localhost:{}{path}", f.addr.port()))
            .header("sec-websocket-version", "13")
            .body(())
            .unwrap();
        req.extensions_mut().insert(h3::ext::Protocol::WEBSOCKET);
        let mut stream = c.send.send_request(req).await.expect("send the CONNECT");
        let resp = stream.recv_response().await.expect("a response");
        let status = resp.status().as_u16();
        let mut echoed = Vec::new();
        if status == 200 {
            let mut buf = Vec::new();
            for m in messages {
                let frame = ws::encode_frame(true, 1, m, Some([9, 8, 7, 6]));
                stream.send_data(Bytes::from(frame)).await.unwrap();
                loop {
                    if let Ok(Some((f, used))) = ws::decode_frame(&buf, 1 << 20) {
                        buf.drain(..used);
                        echoed.push(f.payload);
                        break;
                    }
                    let mut data = stream.recv_data().await.expect("an echo").expect("data");
                    while data.has_remaining() {
                        let n = data.chunk().len();
                        buf.extend_from_slice(data.chunk());
                        data.advance(n);
                    }
                }
            }
            stream.finish().await.unwrap();
        }
        c.drive.abort();
        c.conn.close(0u32.into(), b"done");
        (status, echoed)
    })
}

/// WebSocket over HTTP/3 (RFC 9220): the extended CONNECT reaches the
/// HTTP/1.1 WebSocket origin as an Upgrade, its 101 is the client's 200,
/// and frames cross the stream both ways (one larger than a QUIC packet
/// and than the tunnel's 16 KiB buffer).
#[test]
fn websocket_over_http3_reaches_an_http1_origin() {
    let f = start("", "");
    let (status, echoed) = connect_ws(&f, "/ws", &[b"hello", &[b'x'; 70_000]]);
    assert_eq!(status, 200, "RFC 9220: the origin's 101 is a 200");
    assert_eq!(echoed, vec![b"hello".to_vec(), vec![b'x'; 70_000]]);
    assert_eq!(f.p.metric_value("pier_tunnels_total"), Some(1.0));
}

/// The `[http] upgrade` allow-list holds over HTTP/3 as over HTTP/1.1: a
/// WebSocket CONNECT it does not list reaches the origin as a plain GET
/// (which refuses the handshake), and no tunnel is opened.
#[test]
fn websocket_over_http3_obeys_the_upgrade_allow_list() {
    let f = start("[http]\nupgrade = []\n", "");
    let (status, _) = connect_ws(&f, "/ws", &[]);
    assert_eq!(status, 400);
    assert_eq!(f.p.metric_value("pier_tunnels_total").unwrap_or(0.0), 0.0);
}

/// A reload (SIGHUP) with a new certificate: the next QUIC handshake gets
/// it, as the next TLS handshake over TCP does, and a connection opened
/// before the reload keeps serving.
#[test]
fn a_reload_gives_new_quic_handshakes_the_new_certificate() {
    let Fixture { s, o, mut p, addr } = start("", "");
    let dir = TempDir::new();
    let ca2 = TestCa::new(dir.path(), "h3-next");
    let next = ca2.server("site", &["localhost"], Alg::EcdsaP256, 30);
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let mut open = block(&rt, connect(addr, &s.ca.cert));

    let text = config(&s, o.addr(), "", "")
        .replace(
            &s.cert.cert.display().to_string(),
            &next.cert.display().to_string(),
        )
        .replace(
            &s.cert.key.display().to_string(),
            &next.key.display().to_string(),
        );
    p.rewrite_config(&text);
    let g = p.generation();
    p.signal(sig::SIGHUP);
    p.wait_generation(g + 1);

    let old_ca = block(&rt, try_connect_as(addr, &s.ca.cert, None));
    assert!(
        old_ca.is_none(),
        "a new handshake still got the old certificate"
    );
    let mut fresh = block(&rt, try_connect_as(addr, &ca2.cert, None)).expect("new cert");
    let r = block(
        &rt,
        request(&mut fresh.send, addr.port(), "GET", "/hello", b""),
    );
    assert_eq!(r.status, 200);
    let r = block(
        &rt,
        request(&mut open.send, addr.port(), "GET", "/hello", b""),
    );
    assert_eq!(
        r.status, 200,
        "the connection from before the reload serves on"
    );
}

/// A QUIC variable-length integer at the start of `b`: its value and length.
fn varint(b: &[u8]) -> Option<(usize, usize)> {
    let first = *b.first()?;
    let len = 1usize << (first >> 6);
    let mut v = (first & 0x3f) as usize;
    for x in b.get(1..len)? {
        v = (v << 8) | *x as usize;
    }
    Some((v, len))
}

/// Whether a client's datagram carries a Handshake or a 1-RTT packet (the
/// client's Finished, or anything after it), walking coalesced long-header
/// packets (RFC 9000 §17.2). Unparsable: true (held).
fn past_the_first_flight(d: &[u8]) -> bool {
    let mut i = 0;
    while i < d.len() {
        let Some(step) = (|| {
            let first = d[i];
            if first & 0x80 == 0 {
                return None; // a short header: 1-RTT
            }
            let kind = (first >> 4) & 0x03; // 0 Initial, 1 0-RTT, 2 Handshake
            if kind >= 2 {
                return None;
            }
            let mut j = i + 5;
            j += 1 + *d.get(j)? as usize;
            j += 1 + *d.get(j)? as usize;
            if kind == 0 {
                let (token, n) = varint(d.get(j..)?)?;
                j += n + token;
            }
            let (len, n) = varint(d.get(j..)?)?;
            Some(j + n + len)
        })() else {
            return true;
        };
        i = step;
    }
    false
}

/// A UDP relay to `server` that passes a client's first flight (Initial
/// and 0-RTT packets) but holds every later datagram of the client (its
/// Finished and what follows) until `release` turns true: the server
/// cannot finish the handshake, so whatever it does with the 0-RTT
/// requests it does while they are still early, however the machine
/// schedules it.
async fn holding_relay(
    server: SocketAddr,
    mut release: tokio::sync::watch::Receiver<bool>,
) -> SocketAddr {
    let front = tokio::net::UdpSocket::bind("127.0.0.1:0").await.unwrap();
    let back = tokio::net::UdpSocket::bind("127.0.0.1:0").await.unwrap();
    back.connect(server).await.unwrap();
    let addr = front.local_addr().unwrap();
    tokio::spawn(async move {
        let (mut a, mut b) = (vec![0u8; 65536], vec![0u8; 65536]);
        let mut client = None;
        let mut held: Vec<Vec<u8>> = Vec::new();
        let mut holding = true;
        loop {
            tokio::select! {
                r = front.recv_from(&mut a) => {
                    let Ok((n, from)) = r else { return };
                    client = Some(from);
                    if holding && past_the_first_flight(&a[..n]) {
                        held.push(a[..n].to_vec());
                    } else {
                        let _ = back.send(&a[..n]).await;
                    }
                }
                r = back.recv(&mut b) => {
                    let Ok(n) = r else { return };
                    if let Some(c) = client {
                        let _ = front.send_to(&b[..n], c).await;
                    }
                }
                r = release.changed(), if holding => {
                    if r.is_err() || *release.borrow() {
                        holding = false;
                        for d in held.drain(..) {
                            let _ = back.send(&d).await;
                        }
                    }
                }
            }
        }
    });
    addr
}

/// A QUIC client endpoint that resumes sessions and offers 0-RTT.
fn early_client(ca: &std::path::Path) -> quinn::Endpoint {
    client_endpoint(ca, None, true, None)
}

/// A full handshake and one request on `ep` (it keeps the session ticket).
async fn first_visit(ep: &quinn::Endpoint, addr: SocketAddr) {
    let conn = ep.connect(addr, "localhost").unwrap().await.unwrap();
    let (mut send, drive) = h3_on(&conn).await.unwrap();
    let r = request(&mut send, addr.port(), "GET", "/hello", b"").await;
    assert_eq!(r.status, 200);
    drive.abort();
    conn.close(0u32.into(), b"done");
}

/// `quic_early_data = true`: a resumed client's requests in 0-RTT are
/// served only for replay-safe methods (the GET reaches the origin marked
/// `Early-Data: 1`, RFC 8470), a POST gets 425 Too Early, and once the
/// handshake is done the same POST on the same connection is served.
#[test]
fn zero_rtt_serves_only_replay_safe_requests() {
    let Fixture { s, o: _o, p, addr } = start_with("", "", |_, text| {
        text.replace("http3 = true\n", "http3 = true\nquic_early_data = true\n")
    });
    let early = |result: &str| {
        p.metric_value(&format!(
            "pier_http3_early_data_total{{result=\"{result}\"}}"
        ))
        .unwrap_or(0.0)
    };
    run(async {
        let ep = early_client(&s.ca.cert);
        first_visit(&ep, addr).await;
        let (release, hold) = tokio::sync::watch::channel(false);
        let relay = holding_relay(addr, hold).await;
        let (conn, _accepted) = ep
            .connect(relay, "localhost")
            .unwrap()
            .into_0rtt()
            .unwrap_or_else(|_| panic!("the session resumes with 0-RTT"));
        let (send, drive) = h3_on(&conn).await.unwrap();
        let port = addr.port();
        let (mut s1, mut s2) = (send.clone(), send.clone());
        let get = tokio::spawn(async move { request(&mut s1, port, "GET", "/headers", b"").await });
        let post =
            tokio::spawn(async move { request(&mut s2, port, "POST", "/echo", b"once").await });
        // Both requests reached Pier in 0-RTT (the relay holds the
        // client's Finished): wait for Pier to have judged them.
        while early("served") < 1.0 || early("refused") < 1.0 {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        release.send(true).unwrap();
        let (get, post) = (get.await.unwrap(), post.await.unwrap());
        assert_eq!(get.status, 200);
        let head = String::from_utf8_lossy(&get.body).to_ascii_lowercase();
        assert!(head.contains("\r\nearly-data: 1\r\n"), "{head}");
        assert_eq!(post.status, 425, "a POST in 0-RTT could be a replay");
        let mut again = send.clone();
        let r = request(&mut again, port, "POST", "/echo", b"once").await;
        assert_eq!(r.status, 200, "after the handshake the POST is served");
        assert_eq!(r.body, b"once");
        drive.abort();
        conn.close(0u32.into(), b"done");
    });
    assert_eq!(early("served"), 1.0);
    assert_eq!(early("refused"), 1.0);
}

/// Without `quic_early_data` a resumed client gets no 0-RTT: the tickets
/// Pier issues allow no early data.
#[test]
fn zero_rtt_is_off_by_default() {
    let Fixture {
        s,
        o: _o,
        p: _p,
        addr,
    } = start("", "");
    run(async {
        let ep = early_client(&s.ca.cert);
        first_visit(&ep, addr).await;
        let second = ep.connect(addr, "localhost").unwrap();
        assert!(second.into_0rtt().is_err(), "0-RTT was offered");
    });
}

/// Address validation under load: with 64 handshakes in progress on the
/// worker (clients behind a relay that never lets their Finished through,
/// as a flood of spoofed Initials would), the next new client is sent a
/// Retry before Pier spends anything on it, proves its address with the
/// token and is served; the stalled handshakes end at `handshake_timeout`.
#[test]
fn a_retry_is_asked_for_under_handshake_load() {
    let Fixture { s, o: _o, p, addr } = start_with("", "", |_, text| {
        text.replace("workers = 2", "workers = 1").replace(
            "[listener.tls]\n",
            "[listener.tls]\nhandshake_timeout = \"5s\"\n",
        )
    });
    let in_progress = || {
        p.metric_value("pier_http3_handshakes_in_progress")
            .unwrap_or(0.0)
    };
    run(async {
        let (_release, hold) = tokio::sync::watch::channel(false);
        let relay = holding_relay(addr, hold).await;
        let ep = client_endpoint(&s.ca.cert, None, false, None);
        let stalled: Vec<_> = (0..64)
            .map(|_| ep.connect(relay, "localhost").unwrap())
            .collect();
        while in_progress() < 64.0 {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert_eq!(p.metric_value("pier_http3_retries_total"), Some(0.0));
        let mut c = connect(addr, &s.ca.cert).await;
        let r = request(&mut c.send, addr.port(), "GET", "/hello", b"").await;
        assert_eq!(r.status, 200, "a validated client is served under load");
        assert_eq!(p.metric_value("pier_http3_retries_total"), Some(1.0));
        c.drive.abort();
        c.conn.close(0u32.into(), b"done");
        drop(stalled);
        // The stalled handshakes end by Pier's bound, not by the client.
        while in_progress() > 0.0 {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    });
    assert!(
        p.metric_value("pier_http3_handshakes_total{result=\"failed\"}")
            .unwrap_or(0.0)
            >= 64.0
    );
}

/// Connection migration is refused, as docs/config.md says: a client that
/// moves to a new address (here: its socket rebound to a new port) gets
/// no answer there and its connection ends (its own idle timeout, 1 s);
/// a new connection from the new address is served.
#[test]
fn a_migrating_connection_is_refused() {
    let Fixture {
        s,
        o: _o,
        p: _p,
        addr,
    } = start("", "");
    run(async {
        let ep = client_endpoint(&s.ca.cert, None, false, Some(Duration::from_secs(1)));
        let conn = ep.connect(addr, "localhost").unwrap().await.unwrap();
        let (mut send, drive) = h3_on(&conn).await.unwrap();
        let r = request(&mut send, addr.port(), "GET", "/hello", b"").await;
        assert_eq!(r.status, 200);

        ep.rebind(std::net::UdpSocket::bind("127.0.0.1:0").unwrap())
            .unwrap();
        let port = addr.port();
        let after = tokio::spawn(async move {
            let req = http::Request::get(format!("https://localhost:{port}/hello"))
                .body(())
                .unwrap();
            match send.send_request(req).await {
                Ok(mut st) => {
                    let _ = st.finish().await;
                    st.recv_response().await.is_ok()
                }
                Err(_) => false,
            }
        });
        let closed = conn.closed().await;
        assert!(
            matches!(
                closed,
                quinn::ConnectionError::TimedOut | quinn::ConnectionError::Reset
            ),
            "{closed:?}"
        );
        assert!(
            !after.await.unwrap(),
            "a request after the move was answered"
        );
        drive.abort();

        let conn = ep.connect(addr, "localhost").unwrap().await.unwrap();
        let (mut send, drive) = h3_on(&conn).await.unwrap();
        let r = request(&mut send, addr.port(), "GET", "/hello", b"").await;
        assert_eq!(r.status, 200, "a new connection from the new address");
        drive.abort();
        conn.close(0u32.into(), b"done");
    });
}

/// Compression, a rate limit and the access log work over HTTP/3 as over
/// TCP: the same route steps, and the log line names the protocol.
#[test]
fn compression_limits_and_the_access_log_over_http3() {
    use std::io::Read;
    let dir = TempDir::new();
    let log = dir.path().join("access.log");
    let f = start_with(
        "[[limit]]\nname = \"few\"\nkey = \"client_ip\"\nrate = \"3/m\"\n",
        "[route.compress]\nalgorithms = [\"gzip\"]\ntypes = [\"*\"]\nmin_size = 1\n",
        |_, text| {
            text.replace(
                "access = \"off\"",
                &format!("access = \"{}\"", log.display()),
            )
        },
    );
    let mut c = H3Conn::connect_named(f.addr, &f.s.ca.cert, "localhost").unwrap();
    let host = format!("localhost:{}", f.addr.port());
    let h = [("host", host.as_str()), ("accept-encoding", "gzip")];
    let text = "a line of text that compresses\n".repeat(64);
    let echo = [h[0], h[1], ("content-type", "text/plain")];
    let r = c.request("POST", "/echo", &echo, text.as_bytes()).unwrap();
    assert_eq!(r.status, 200);
    assert_eq!(r.header("content-encoding"), Some("gzip"), "{r:?}");
    assert!(r.body.len() < text.len() / 4, "{} bytes", r.body.len());
    let mut plain = String::new();
    flate2::read::GzDecoder::new(&r.body[..])
        .read_to_string(&mut plain)
        .unwrap();
    assert_eq!(plain, text);
    for _ in 0..2 {
        assert_eq!(c.request("GET", "/hello", &h, b"").unwrap().status, 200);
    }
    let refused = c.request("GET", "/hello", &h, b"").unwrap();
    assert_eq!(refused.status, 429, "the fourth in a minute: {refused:?}");
    assert!(refused.header("retry-after").is_some());
    let lines = wait_for_lines(&log, 4);
    for l in &lines {
        let v: serde_json::Value = serde_json::from_str(l).unwrap();
        assert_eq!(v["protocol"], "HTTP/3.0", "{l}");
        assert_eq!(v["tls"]["alpn"], "h3", "{l}");
    }
    let statuses: Vec<_> = lines
        .iter()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap()["status"].clone())
        .collect();
    assert_eq!(statuses, [200, 200, 200, 429]);
}

/// The first `n` lines of the access log at `path`, waited for (the log is
/// written by its own thread, flushed every second).
fn wait_for_lines(path: &std::path::Path, n: usize) -> Vec<String> {
    let mut lines = Vec::new();
    let ok = wait_until(Duration::from_secs(10), || {
        lines = std::fs::read_to_string(path)
            .unwrap_or_default()
            .lines()
            .map(String::from)
            .collect();
        lines.len() >= n
    });
    assert!(ok, "{n} access log lines; got {lines:?}");
    lines.truncate(n);
    lines
}
