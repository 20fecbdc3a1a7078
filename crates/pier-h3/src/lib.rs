//! HTTP/3 for clients: QUIC (quinn, on rustls — Pier's TLS stack, with the
//! listener's certificates and SNI selection) and HTTP/3 framing and QPACK
//! (h3), behind the session interfaces (pier-session). Like pier-h2's
//! server, a connection is one task that accepts request streams and hands
//! each to the [`Engine`], which runs it through the same steps as any
//! request; nothing in the engine's driver knows this protocol.
//! WebSocket rides an extended CONNECT (RFC 9220) as over HTTP/2: the
//! engine sends the origin an HTTP/1.1 Upgrade and [`H3Downstream`]'s
//! tunnel carries the bytes in the stream's DATA frames (h3 is patched to
//! receive `:protocol = websocket`: vendor/h3/PIER-PATCH.md).
//!
//! QUIC's own defences, and where they come from:
//! - address validation: while more than `retry_above` handshakes are in
//!   progress on the endpoint, a client whose address is not validated gets
//!   a Retry (one small packet, no state kept) before anything else; quinn
//!   holds every unvalidated peer to three times what it sent
//!   (amplification limit, RFC 9000 §8);
//! - stateless reset: every worker's endpoint derives reset tokens from one
//!   key, so a worker that receives a packet of another worker's connection
//!   can end it cleanly;
//! - bounded state: request streams per connection (`max_streams`), three
//!   unidirectional streams (control and QPACK's two), header sections
//!   (`max_field_section_size`); h3 keeps no QPACK dynamic table (it
//!   advertises a capacity of 0), so a peer cannot make Pier hold one;
//! - timeouts: the handshake (`handshake_timeout`), the request head
//!   (`client_header`), an idle connection (QUIC's idle timeout,
//!   `client_idle`) and a draining one (`client_goaway` after GOAWAY);
//! - 0-RTT is off unless the listener asks (`early_data`); then a resumed
//!   client's requests that arrive before the handshake is done are
//!   served only for the replay-safe methods (GET, HEAD, OPTIONS), marked
//!   `Early-Data: 1` towards the origin (RFC 8470), and any other gets
//!   425 Too Early, so a replayed 0-RTT packet cannot repeat a POST;
//! - connection migration is refused: workers share the UDP port by
//!   `SO_REUSEPORT`, which steers datagrams by address, so a migrated
//!   client's packets reach a worker that does not know the connection
//!   (which answers with a stateless reset; the client starts over);
//! - GSO/GRO are used where the kernel has them (quinn-udp).

use bytes::{Buf, Bytes};
use pier_core::evict;
use pier_error::{Error, Kind};
use pier_http::{BodyLen, Headers, ResponseHead};
use pier_session::http_types::{self, HttpHead};
use pier_session::{
    BodySize, Downstream, DownstreamOpts, Engine, RequestSource, ResponseSink, SpliceBody,
    StreamOpts,
};
use std::cell::Cell;
use std::net::SocketAddr;
use std::rc::Rc;
use std::sync::Arc;
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncWrite};

/// Process-wide QUIC counters (`pier_http3_*` in /metrics).
pub mod stats {
    use std::sync::atomic::AtomicU64;
    /// Retry packets sent (address validation).
    pub static RETRIES: AtomicU64 = AtomicU64::new(0);
    /// Handshakes that completed.
    pub static HANDSHAKES: AtomicU64 = AtomicU64::new(0);
    /// Handshakes that failed or timed out.
    pub static HANDSHAKE_FAILURES: AtomicU64 = AtomicU64::new(0);
    /// Handshakes in progress now, every worker's endpoint together.
    pub static IN_PROGRESS: AtomicU64 = AtomicU64::new(0);
    /// Requests that arrived in 0-RTT and were served (replay-safe).
    pub static EARLY_SERVED: AtomicU64 = AtomicU64::new(0);
    /// Requests that arrived in 0-RTT and got 425 Too Early.
    pub static EARLY_REFUSED: AtomicU64 = AtomicU64::new(0);
}

type SendHalf = h3::server::RequestStream<h3_quinn::SendStream<Bytes>, Bytes>;
type RecvHalf = h3::server::RequestStream<h3_quinn::RecvStream, Bytes>;
type BidiRequest = h3::server::RequestStream<h3_quinn::BidiStream<Bytes>, Bytes>;
type Resolver = h3::server::RequestResolver<h3_quinn::Connection, Bytes>;

/// HTTP/3's settings on a listener (from `[http2]`, the timeouts and the
/// listener's TLS; the names say which).
#[derive(Debug, Clone)]
pub struct Settings {
    /// Request streams a client may have open at once.
    pub max_streams: u32,
    /// Largest header section (QPACK-decoded), bytes.
    pub max_field_section_size: u64,
    pub handshake_timeout: Duration,
    pub client_header: Duration,
    pub client_idle: Duration,
    pub client_goaway: Duration,
    /// Handshakes in progress on the endpoint above which new clients must
    /// prove their address first (a Retry); 0: every new client does.
    pub retry_above: usize,
    /// 0-RTT for resumed clients, replay-safe requests only.
    pub early_data: bool,
}

/// One worker's QUIC endpoint on a listener's UDP socket, serving with
/// `server` ([`server_config`]); `reset_key` is shared by every worker
/// (stateless resets).
pub fn endpoint(
    socket: std::net::UdpSocket,
    server: quinn::ServerConfig,
    reset_key: &[u8; 32],
) -> std::io::Result<quinn::Endpoint> {
    let key = aws_lc_rs::hmac::Key::new(aws_lc_rs::hmac::HMAC_SHA256, reset_key);
    let config = quinn::EndpointConfig::new(Arc::new(key));
    socket.set_nonblocking(true)?;
    quinn::Endpoint::new(config, Some(server), socket, Arc::new(quinn::TokioRuntime))
}

/// What new connections on an endpoint get: QUIC over `tls`, the
/// listener's (certificates, SNI, client certificates), with ALPN `h3`,
/// TLS 1.3 only and no early data, and `s`'s stream and idle bounds. Built again on a
/// reload ([`Current`]).
pub fn server_config(
    tls: &rustls::ServerConfig,
    s: &Settings,
) -> std::io::Result<quinn::ServerConfig> {
    let io = |e: String| std::io::Error::new(std::io::ErrorKind::InvalidInput, e);
    let mut tls = tls.clone();
    tls.alpn_protocols = vec![b"h3".to_vec()];
    // QUIC takes all of 0-RTT or none (RFC 9001 §4.6.1).
    tls.max_early_data_size = if s.early_data { u32::MAX } else { 0 };
    if s.early_data {
        // rustls allows early data only on stateful resumption: tickets
        // are ids into the listener's session cache (shared by the
        // workers), each taken once, so a ticket is good for one 0-RTT
        // attempt (RFC 8446 §8.1) — on top of the replay-safe methods.
        tls.ticketer = Arc::new(NoTickets);
    }
    let crypto = quinn::crypto::rustls::QuicServerConfig::try_from(tls)
        .map_err(|e| io(format!("TLS for QUIC: {e}")))?;
    let mut server = quinn::ServerConfig::with_crypto(Arc::new(crypto));
    let mut t = quinn::TransportConfig::default();
    t.max_concurrent_bidi_streams(s.max_streams.into())
        .max_concurrent_uni_streams(3u8.into())
        .max_idle_timeout(Some(
            s.client_idle
                .try_into()
                .map_err(|_| io("client_idle too long for QUIC".into()))?,
        ));
    server.transport_config(Arc::new(t));
    server.migration(false);
    Ok(server)
}

/// No stateless tickets (see [`server_config`]).
#[derive(Debug)]
struct NoTickets;

impl rustls::server::ProducesTickets for NoTickets {
    fn enabled(&self) -> bool {
        false
    }
    fn lifetime(&self) -> u32 {
        0
    }
    fn encrypt(&self, _: &[u8]) -> Option<Vec<u8>> {
        None
    }
    fn decrypt(&self, _: &[u8]) -> Option<Vec<u8>> {
        None
    }
}

/// What a new connection is served with: QUIC's configuration (from
/// [`server_config`]) and the settings. [`serve`] asks for it at each new
/// connection, so a reload's certificates and bounds apply to the next
/// handshake, and open connections keep theirs, as TLS over TCP does.
pub type Current = Rc<(Arc<quinn::ServerConfig>, Settings)>;

/// What a new connection tells the engine before it is served.
pub struct NewConnection {
    pub remote: SocketAddr,
    pub local: SocketAddr,
    /// The server name the client asked for (SNI).
    pub server_name: Option<String>,
    /// The client's certificate, when the listener asks for one and the
    /// client sent it (verified by the handshake).
    pub client_cert: Option<rustls::pki_types::CertificateDer<'static>>,
}

/// Serve `endpoint` until `drain` turns true (then GOAWAY on every
/// connection, which end as their requests do). `admit` makes the engine of
/// a connection whose handshake is done, or refuses it (None: closed with
/// H3_EXCESSIVE_LOAD). `current` is what the next connection gets.
pub async fn serve<E: Engine>(
    endpoint: quinn::Endpoint,
    mut drain: tokio::sync::watch::Receiver<bool>,
    current: impl Fn() -> Current + 'static,
    admit: impl Fn(NewConnection) -> Option<E> + 'static,
) {
    let admit = Rc::new(admit);
    let handshakes = Rc::new(Cell::new(0usize));
    let local = endpoint.local_addr().ok();
    loop {
        let incoming = tokio::select! {
            i = endpoint.accept() => i,
            _ = drain.changed() => break,
        };
        let Some(incoming) = incoming else { break };
        let now = current();
        if handshakes.get() >= now.1.retry_above && !incoming.remote_address_validated() {
            // Under load (or always, `quic_retry`): prove the address
            // first, statelessly.
            if incoming.retry().is_ok() {
                stats::RETRIES.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            }
            continue;
        }
        let (admit, handshakes) = (admit.clone(), handshakes.clone());
        let local = local.unwrap_or_else(|| incoming.remote_address());
        tokio::task::spawn_local(async move {
            let (config, s) = &*now;
            let Some((conn, early)) = handshake(incoming, config, s, &handshakes).await else {
                return;
            };
            let info = NewConnection {
                remote: conn.remote_address(),
                local,
                server_name: conn
                    .handshake_data()
                    .and_then(|d| d.downcast::<quinn::crypto::rustls::HandshakeData>().ok())
                    .and_then(|d| d.server_name),
                client_cert: conn
                    .peer_identity()
                    .and_then(|i| {
                        i.downcast::<Vec<rustls::pki_types::CertificateDer<'static>>>()
                            .ok()
                    })
                    .and_then(|certs| certs.into_iter().next()),
            };
            match admit(info) {
                Some(engine) => connection(engine, conn, s, early).await,
                None => conn.close(H3_EXCESSIVE_LOAD, b"busy"),
            }
        });
    }
    // New connections are refused from here; open ones drain on their own.
    endpoint.set_server_config(None);
}

/// Close every connection of `endpoint` now (H3_NO_ERROR, `reason`) and
/// wait until they are gone, so the UDP socket is no longer read.
pub async fn close_all(endpoint: &quinn::Endpoint, reason: &[u8]) {
    endpoint.close(H3_NO_ERROR, reason);
    endpoint.wait_idle().await;
}

/// RFC 9114 §8.1 error codes.
const H3_NO_ERROR: quinn::VarInt = quinn::VarInt::from_u32(0x100);
const H3_EXCESSIVE_LOAD: quinn::VarInt = quinn::VarInt::from_u32(0x107);

/// Whether a connection's handshake is done yet: a request read before
/// then came in 0-RTT (it can be a replay).
type Confirmed = Rc<Cell<bool>>;

/// The QUIC handshake, within `handshake_timeout`, counted while it runs.
/// With `early_data` the connection is served at once (its 0-RTT requests
/// with it) and the handshake finishes beside it, setting the
/// [`Confirmed`] it returns.
async fn handshake(
    incoming: quinn::Incoming,
    config: &Arc<quinn::ServerConfig>,
    s: &Settings,
    handshakes: &Rc<Cell<usize>>,
) -> Option<(quinn::Connection, Option<Confirmed>)> {
    let count = InHandshake::enter(handshakes);
    use std::sync::atomic::Ordering::Relaxed;
    let connecting = match incoming.accept_with(config.clone()) {
        Ok(c) => c,
        Err(_) => {
            stats::HANDSHAKE_FAILURES.fetch_add(1, Relaxed);
            return None;
        }
    };
    let connecting = if s.early_data {
        // A server's `into_0rtt` always succeeds (RFC 9001 0.5-RTT); its
        // future resolves when the handshake is done.
        match connecting.into_0rtt() {
            Ok((conn, done)) => {
                let confirmed = Rc::new(Cell::new(false));
                let (c, flag, bound) = (conn.clone(), confirmed.clone(), s.handshake_timeout);
                tokio::task::spawn_local(async move {
                    let _count = count;
                    if tokio::time::timeout(bound, done).await.is_ok() {
                        flag.set(true);
                        stats::HANDSHAKES.fetch_add(1, Relaxed);
                    } else {
                        stats::HANDSHAKE_FAILURES.fetch_add(1, Relaxed);
                        c.close(H3_NO_ERROR, b"handshake timeout");
                    }
                });
                return Some((conn, Some(confirmed)));
            }
            Err(connecting) => connecting,
        }
    } else {
        connecting
    };
    let _count = count;
    match tokio::time::timeout(s.handshake_timeout, connecting).await {
        Ok(Ok(c)) => {
            stats::HANDSHAKES.fetch_add(1, Relaxed);
            Some((c, None))
        }
        _ => {
            stats::HANDSHAKE_FAILURES.fetch_add(1, Relaxed);
            None
        }
    }
}

/// A count held for as long as the guard lives.
struct Counted(Rc<Cell<usize>>);

impl Counted {
    fn enter(c: &Rc<Cell<usize>>) -> Counted {
        c.set(c.get() + 1);
        Counted(c.clone())
    }
}

impl Drop for Counted {
    fn drop(&mut self) {
        self.0.set(self.0.get().saturating_sub(1));
    }
}

/// A handshake in progress: the endpoint's count (which decides Retry)
/// and the process's gauge, both released on every path.
struct InHandshake {
    _endpoint: Counted,
}

impl InHandshake {
    fn enter(c: &Rc<Cell<usize>>) -> InHandshake {
        stats::IN_PROGRESS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        InHandshake {
            _endpoint: Counted::enter(c),
        }
    }
}

impl Drop for InHandshake {
    fn drop(&mut self) {
        stats::IN_PROGRESS.fetch_sub(1, std::sync::atomic::Ordering::Relaxed);
    }
}

/// One connection: request streams until the client goes, an error, or a
/// drain (GOAWAY, then what is open finishes within `client_goaway`).
async fn connection<E: Engine>(
    engine: E,
    conn: quinn::Connection,
    s: &Settings,
    early: Option<Confirmed>,
) {
    let mut b = h3::server::builder();
    // Extended CONNECT (RFC 9220) for WebSocket; the engine's `[http]
    // upgrade` allow-list decides which protocols pass.
    b.max_field_section_size(s.max_field_section_size)
        .enable_extended_connect(true);
    let built = tokio::time::timeout(
        s.client_header,
        b.build::<_, Bytes>(h3_quinn::Connection::new(conn.clone())),
    )
    .await;
    let Ok(Ok(mut h3c)) = built else {
        conn.close(H3_NO_ERROR, b"");
        return;
    };
    let mut drain = engine.drain();
    let mut draining = *drain.borrow();
    let open = Rc::new(Cell::new(0usize));
    let ended = Rc::new(tokio::sync::Notify::new());
    let mut goaway_at: Option<tokio::time::Instant> = None;
    // Registered while no stream is open: evictable when the worker is
    // full, as an idle HTTP/1 or HTTP/2 connection is.
    let mut waiting: Option<evict::Waiting<'_>> = None;
    if draining {
        let _ = h3c.shutdown(0).await;
        goaway_at = Some(tokio::time::Instant::now());
    }
    loop {
        let none_open = open.get() == 0;
        if none_open != waiting.is_some() {
            waiting = none_open.then(|| evict::Waiting::enter(engine.waiting(), engine.now_ms()));
        }
        tokio::select! {
            r = h3c.accept() => match r {
                Ok(Some(resolver)) => {
                    let engine = engine.clone();
                    let guard = Counted::enter(&open);
                    let ended = ended.clone();
                    let (header, idle) = (s.client_header, s.client_idle);
                    let early = early.clone();
                    tokio::task::spawn_local(async move {
                        let _guard = guard;
                        request(engine, resolver, header, idle, early).await;
                        ended.notify_one();
                    });
                }
                // GOAWAY sent and every request done, or the client went.
                Ok(None) | Err(_) => break,
            },
            _ = drain.changed(), if !draining => {
                draining = true;
                goaway_at = Some(tokio::time::Instant::now());
                let _ = h3c.shutdown(0).await;
            }
            _ = async {
                let at = goaway_at.unwrap_or_else(tokio::time::Instant::now);
                tokio::time::sleep_until(at + s.client_goaway).await
            }, if draining && none_open => {
                engine.goaway_timeout();
                break;
            }
            _ = evicted(waiting.as_ref()) => break,
            _ = ended.notified(), if !none_open => {}
        }
    }
    conn.close(H3_NO_ERROR, b"");
}

async fn evicted(w: Option<&evict::Waiting<'_>>) {
    match w {
        Some(w) => w.evicted().await,
        None => std::future::pending().await,
    }
}

/// One request stream: its head within `client_header`, then the engine.
async fn request<E: Engine>(
    engine: E,
    resolver: Resolver,
    header: Duration,
    idle: Duration,
    early: Option<Confirmed>,
) {
    let Ok(Ok((req, mut stream))) = tokio::time::timeout(header, resolver.resolve_request()).await
    else {
        return;
    };
    let (mut parts, ()) = req.into_parts();
    if early.is_some_and(|done| !done.get()) {
        // In 0-RTT: whoever captured the packet can send it again.
        use std::sync::atomic::Ordering::Relaxed;
        let replay_safe = matches!(
            parts.method,
            http::Method::GET | http::Method::HEAD | http::Method::OPTIONS
        );
        if !replay_safe {
            stats::EARLY_REFUSED.fetch_add(1, Relaxed);
            too_early(&mut stream, idle).await;
            return;
        }
        stats::EARLY_SERVED.fetch_add(1, Relaxed);
        // RFC 8470 §5.1: the origin may answer 425 itself.
        parts
            .headers
            .insert("early-data", http::HeaderValue::from_static("1"));
    }
    let (send, mut recv) = stream.split();
    // An extended CONNECT (RFC 9220) is the Upgrade it stands for; its
    // stream's data is the tunnel's, read once the origin switched.
    let protocol = (parts.method == http::Method::CONNECT)
        .then(|| parts.extensions.get::<h3::ext::Protocol>().copied())
        .flatten();
    if let Some(p) = protocol {
        let head = HttpHead::upgrade(parts, p.as_str());
        let down = H3Downstream::new(recv, None, send, idle, false);
        return pier_session::boxed_in_place(|| engine.serve_stream(down, head)).await;
    }
    // Whether a body follows: the stream already ended with its head (a
    // bodiless request's FIN comes in the HEADERS frame's packet), or a
    // first piece is here; else what the head says (a length, or a method
    // that carries one).
    let peek = std::future::poll_fn(|cx| std::task::Poll::Ready(recv.poll_recv_data(cx))).await;
    let (has_body, first, ended) = match peek {
        std::task::Poll::Ready(Ok(None)) | std::task::Poll::Ready(Err(_)) => (false, None, true),
        std::task::Poll::Ready(Ok(Some(mut b))) => {
            (true, Some(b.copy_to_bytes(b.remaining())), false)
        }
        std::task::Poll::Pending => {
            let says = parts
                .headers
                .get(http::header::CONTENT_LENGTH)
                .is_some_and(|v| v.as_bytes() != b"0");
            let bodiless = matches!(parts.method, http::Method::GET | http::Method::HEAD);
            (says || !bodiless, None, false)
        }
    };
    let head = HttpHead::new(parts, has_body);
    let down = H3Downstream::new(recv, first, send, idle, ended || !has_body);
    // The request's future written straight into its box (pier-h2 says why).
    pier_session::boxed_in_place(|| engine.serve_stream(down, head)).await
}

/// 425 Too Early (RFC 8470): the client retries once its handshake is done.
async fn too_early(stream: &mut BidiRequest, idle: Duration) {
    stream.stop_sending(h3::error::Code::H3_REQUEST_REJECTED);
    let resp = http::Response::builder()
        .status(425)
        .header("content-type", "text/plain")
        .header("content-length", "10")
        .body(())
        .expect("a static response");
    let _ = tokio::time::timeout(idle, async {
        stream.send_response(resp).await?;
        stream.send_data(Bytes::from_static(b"Too Early\n")).await?;
        stream.finish().await
    })
    .await;
}

/// One HTTP/3 request stream as the engine's downstream: the request body
/// and the response, apart, so the body can stream up while the response
/// comes down.
pub struct H3Downstream {
    rx: H3Rx,
    tx: H3Tx,
}

pub struct H3Rx {
    recv: RecvHalf,
    /// The piece read to learn whether a body follows.
    first: Option<Bytes>,
    buf: Bytes,
    trailers: Option<Headers>,
    received: u64,
    o: StreamOpts,
    done: bool,
}

pub struct H3Tx {
    send: SendHalf,
    sent: u64,
    head_sent: bool,
    finished: bool,
    o: StreamOpts,
}

impl H3Downstream {
    fn new(
        recv: RecvHalf,
        first: Option<Bytes>,
        send: SendHalf,
        idle: Duration,
        done: bool,
    ) -> H3Downstream {
        H3Downstream {
            rx: H3Rx {
                recv,
                first,
                buf: Bytes::new(),
                trailers: None,
                received: 0,
                o: StreamOpts::new(idle),
                done,
            },
            tx: H3Tx {
                send,
                sent: 0,
                head_sent: false,
                finished: false,
                o: StreamOpts::new(idle),
            },
        }
    }
}

impl Downstream for H3Downstream {
    type Source<'a> = &'a mut H3Rx;
    type Sink<'a> = &'a mut H3Tx;

    /// Boxed: each stream allocates its request's future, which should not
    /// carry a rarer step's state (`Downstream::hold`).
    fn hold<F: std::future::Future>(f: F) -> impl std::future::Future<Output = F::Output> {
        Box::pin(f)
    }

    async fn vet_body(&mut self, _: BodyLen, _: bool, _: Duration) -> Result<(), Kind> {
        // DATA frames are framed by h3.
        Ok(())
    }

    fn open(&mut self, opts: &DownstreamOpts) -> (&mut H3Rx, &mut H3Tx) {
        self.rx.o = opts.into();
        self.tx.o = self.rx.o;
        (&mut self.rx, &mut self.tx)
    }

    /// The origin switched protocols for an extended CONNECT (RFC 9220):
    /// the client gets a 200 and the stream's DATA frames carry the
    /// tunnel's bytes both ways (there is no Upgrade in HTTP/3 itself).
    async fn tunnel<R: AsyncRead + Unpin, W: AsyncWrite + Unpin>(
        &mut self,
        head: &ResponseHead,
        early: &[u8],
        ur: &mut R,
        uw: &mut W,
        idle: Duration,
    ) -> Result<u64, Error> {
        use tokio::io::AsyncWriteExt;
        let mut ok = head.clone();
        ok.set_status(200);
        ok.headers.remove_known(pier_http::known::UPGRADE);
        ok.headers.remove(b"sec-websocket-accept");
        let resp = http_types::response_fields(&ok);
        gone(tokio::time::timeout(idle, self.tx.send.send_response(resp)).await)?;
        self.tx.head_sent = true;
        if !early.is_empty() {
            let early = Bytes::copy_from_slice(early);
            gone(tokio::time::timeout(idle, self.tx.send.send_data(early)).await)?;
        }
        if let Some(first) = self.rx.first.take() {
            if uw.write_all(&first).await.is_err() {
                return Err(Error::answered(Kind::UpstreamClosed));
            }
        }
        let mut cr = H3Read {
            recv: &mut self.rx.recv,
            buf: Bytes::new(),
        };
        let mut cw = H3Write(WriteState::Ready(&mut self.tx.send));
        pier_session::tunnel(&mut cr, &mut cw, ur, uw, idle).await;
        self.tx.finished = true;
        Ok(0)
    }
}

/// A tunnelled stream's receiving half as a byte stream.
struct H3Read<'a> {
    recv: &'a mut RecvHalf,
    buf: Bytes,
}

impl AsyncRead for H3Read<'_> {
    fn poll_read(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        out: &mut tokio::io::ReadBuf<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        use std::task::Poll;
        let me = self.get_mut();
        if me.buf.is_empty() {
            match me.recv.poll_recv_data(cx) {
                Poll::Pending => return Poll::Pending,
                // The client ended its side: end of the stream.
                Poll::Ready(Ok(None)) => return Poll::Ready(Ok(())),
                Poll::Ready(Err(e)) => return Poll::Ready(Err(std::io::Error::other(e))),
                Poll::Ready(Ok(Some(mut b))) => me.buf = b.copy_to_bytes(b.remaining()),
            }
        }
        let n = me.buf.len().min(out.remaining());
        out.put_slice(&me.buf.split_to(n));
        Poll::Ready(Ok(()))
    }
}

/// A send in flight on a tunnelled stream; it hands the stream back.
type Sending<'a> =
    std::pin::Pin<Box<dyn std::future::Future<Output = (&'a mut SendHalf, bool)> + 'a>>;

enum WriteState<'a> {
    Ready(&'a mut SendHalf),
    Busy(Sending<'a>),
    Gone,
}

/// A tunnelled stream's sending half as a byte stream. h3 sends only
/// from async functions, so a write is taken whole into one send in
/// flight (its future holds the stream and gives it back), which the
/// next write, a flush or the shutdown finishes first: one write
/// buffered, as a `BufWriter` of one chunk.
struct H3Write<'a>(WriteState<'a>);

impl<'a> H3Write<'a> {
    /// Finish the send in flight; Ok with the stream when it is idle.
    fn settle(
        &mut self,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<&'a mut SendHalf>> {
        use std::task::Poll;
        match std::mem::replace(&mut self.0, WriteState::Gone) {
            WriteState::Ready(s) => Poll::Ready(Ok(s)),
            WriteState::Gone => Poll::Ready(Err(std::io::ErrorKind::BrokenPipe.into())),
            WriteState::Busy(mut f) => match f.as_mut().poll(cx) {
                Poll::Pending => {
                    self.0 = WriteState::Busy(f);
                    Poll::Pending
                }
                Poll::Ready((s, true)) => Poll::Ready(Ok(s)),
                Poll::Ready((_, false)) => Poll::Ready(Err(std::io::ErrorKind::BrokenPipe.into())),
            },
        }
    }
}

impl AsyncWrite for H3Write<'_> {
    fn poll_write(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        data: &[u8],
    ) -> std::task::Poll<std::io::Result<usize>> {
        use std::task::Poll;
        let me = self.get_mut();
        let send = match me.settle(cx) {
            Poll::Ready(Ok(s)) => s,
            Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
            Poll::Pending => return Poll::Pending,
        };
        if data.is_empty() {
            me.0 = WriteState::Ready(send);
            return Poll::Ready(Ok(0));
        }
        let chunk = Bytes::copy_from_slice(data);
        me.0 = WriteState::Busy(Box::pin(async move {
            let ok = send.send_data(chunk).await.is_ok();
            (send, ok)
        }));
        Poll::Ready(Ok(data.len()))
    }

    fn poll_flush(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        let me = self.get_mut();
        me.settle(cx).map(|r| {
            r.map(|s| {
                me.0 = WriteState::Ready(s);
            })
        })
    }

    fn poll_shutdown(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        use std::task::Poll;
        let me = self.get_mut();
        // A finish in flight is a Busy whose stream comes back as Gone.
        let send = match me.settle(cx) {
            Poll::Ready(Ok(s)) => s,
            Poll::Ready(Err(_)) => return Poll::Ready(Ok(())),
            Poll::Pending => return Poll::Pending,
        };
        let mut fin: Sending<'_> = Box::pin(async move {
            let _ = send.finish().await;
            (send, false)
        });
        match fin.as_mut().poll(cx) {
            Poll::Ready(_) => Poll::Ready(Ok(())),
            Poll::Pending => {
                me.0 = WriteState::Busy(fin);
                Poll::Pending
            }
        }
    }
}

impl H3Rx {
    fn take(&mut self, data: Bytes) -> Result<Option<&[u8]>, Error> {
        self.received += data.len() as u64;
        if self.o.max_body > 0 && self.received > self.o.max_body {
            return Err(Error::new(Kind::BodyTooLarge));
        }
        self.buf = data;
        Ok(Some(&self.buf[..]))
    }
}

impl RequestSource for &mut H3Rx {
    async fn read_body(&mut self) -> Result<Option<&[u8]>, Error> {
        if let Some(first) = self.first.take() {
            return self.take(first);
        }
        if self.done {
            return Ok(None);
        }
        match tokio::time::timeout(self.o.idle, self.recv.recv_data()).await {
            Err(_) => Err(Error::new(Kind::BodyTimeout)),
            Ok(Err(_)) => Err(Error::new(Kind::ClientClosed)),
            Ok(Ok(None)) => {
                self.done = true;
                let t = tokio::time::timeout(self.o.idle, self.recv.recv_trailers()).await;
                if let Ok(Ok(Some(t))) = t {
                    let mut h = Headers::default();
                    http_types::to_headers(&t, &mut h);
                    self.trailers = Some(h);
                }
                Ok(None)
            }
            Ok(Ok(Some(mut data))) => {
                let data = data.copy_to_bytes(data.remaining());
                self.take(data)
            }
        }
    }
    fn trailers(&self) -> Option<&Headers> {
        self.trailers.as_ref()
    }
}

/// A write to the client that did not finish within `idle`, or failed: the
/// client is gone (the response was under way).
fn gone<T, E>(r: Result<Result<T, E>, tokio::time::error::Elapsed>) -> Result<T, Error> {
    match r {
        Ok(Ok(v)) => Ok(v),
        _ => Err(Error::answered(Kind::ClientClosed)),
    }
}

impl H3Tx {
    async fn send(&mut self, data: Bytes) -> Result<(), Error> {
        if self.o.head_only || self.finished || data.is_empty() {
            return Ok(());
        }
        self.sent += data.len() as u64;
        gone(tokio::time::timeout(self.o.idle, self.send.send_data(data)).await)
    }

    async fn end(&mut self) -> Result<(), Error> {
        if self.finished {
            return Ok(());
        }
        self.finished = true;
        gone(tokio::time::timeout(self.o.idle, self.send.finish()).await)
    }
}

impl ResponseSink for &mut H3Tx {
    async fn write_interim(&mut self, head: &ResponseHead) -> Result<(), Error> {
        // 100 Continue and 103 Early Hints, as HEADERS frames before the
        // final one (RFC 9114 §4.1). No 101: HTTP/3 has no Upgrade.
        if !(100..200).contains(&head.status) || head.status == 101 || self.head_sent {
            return Ok(());
        }
        let r = http_types::response_fields(head);
        gone(tokio::time::timeout(self.o.idle, self.send.send_response(r)).await)
    }

    async fn write_head(&mut self, head: &ResponseHead, size: BodySize) -> Result<(), Error> {
        let r = http_types::response(head, size, self.o.now_ns);
        self.head_sent = true;
        match tokio::time::timeout(self.o.idle, self.send.send_response(r)).await {
            Ok(Ok(())) => {}
            _ => return Err(Error::new(Kind::ClientClosed)),
        }
        if self.o.head_only || size == BodySize::None {
            self.end().await?;
        }
        Ok(())
    }

    async fn write_body(&mut self, data: &[u8]) -> Result<(), Error> {
        self.send(Bytes::copy_from_slice(data)).await
    }

    /// A cached body's bytes go to the frames as they are (no copy).
    async fn write_spliced(&mut self, body: &SpliceBody) -> Result<(), Error> {
        self.send(body.bytes.clone()).await
    }

    async fn finish(&mut self, trailers: Option<&Headers>) -> Result<(), Error> {
        if self.finished {
            return Ok(());
        }
        let map = http_types::trailer_map(trailers);
        if !map.is_empty() {
            gone(tokio::time::timeout(self.o.idle, self.send.send_trailers(map)).await)?;
        }
        self.end().await
    }

    fn keep_alive(&self) -> bool {
        true
    }

    fn bytes_sent(&self) -> u64 {
        self.sent
    }
}
