//! HTTP/2 downstream: the `h2` crate's server behind the session interfaces
//! (pier-session). A connection is one task that accepts streams; each
//! stream is a request that the [`Engine`] runs through the same steps as an
//! HTTP/1 request, in a task of its own.
//!
//! The h2 crate does the framing, HPACK, flow control and the protocol's
//! own defences (rapid reset: `max_pending_accept_reset_streams` and
//! `max_local_error_reset_streams`; CONTINUATION floods: the header list
//! bound); the settings come from `[http2]`.

use bytes::Bytes;
use pier_core::{evict, Stream};
use pier_error::{Error, Kind};
use pier_http::{BodyLen, Headers, ResponseHead};
use pier_session::http_types::{self, trailer_map, HttpHead};
use pier_session::{
    BodySize, Downstream, DownstreamOpts, Engine, RequestSource, ResponseSink, SpliceBody,
    StreamOpts,
};
use std::future::poll_fn;
use std::net::SocketAddr;
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt};

/// Serve one HTTP/2 connection (after TLS with ALPN `h2`, or cleartext with
/// prior knowledge) until the client goes away, an error, or a drain.
/// Each stream's request goes to `engine` on a task of its own (`client`
/// names the connection in logs).
///
/// Not an `async fn`: the stream goes into the (boxed) handshake here, so
/// the connection's future, which lives as long as the connection, holds
/// neither a slot for the stream argument nor the handshake's state beside
/// the connection it became (10.8 KiB of future a connection over TLS, down
/// to the connection and the loop's state).
pub fn serve<E: Engine, S: Stream>(
    engine: E,
    stream: S,
    client: SocketAddr,
    c: &pier_config::Http2,
    t: &pier_config::Timeouts,
) -> impl std::future::Future<Output = ()> {
    let mut b = h2::server::Builder::new();
    b.max_concurrent_streams(c.max_concurrent_streams)
        .initial_window_size(c.initial_window_size)
        .initial_connection_window_size(c.initial_window_size.max(65_535))
        .max_frame_size(c.max_frame_size)
        .max_header_list_size(c.max_header_list_size)
        .max_send_buffer_size(c.max_send_buffer)
        .max_concurrent_reset_streams(c.max_concurrent_reset_streams)
        .max_pending_accept_reset_streams(c.max_pending_accept_reset_streams)
        .max_local_error_reset_streams(Some(c.max_local_error_reset_streams))
        .hpack_dynamic_table(c.hpack_dynamic_table)
        // WebSocket over HTTP/2 (RFC 8441): SETTINGS_ENABLE_CONNECT_PROTOCOL.
        .enable_connect_protocol();
    let handshake = Box::pin(b.handshake::<S, Bytes>(stream));
    let times = Times {
        header: t.client_header,
        idle: t.client_idle,
        goaway: t.client_goaway,
    };
    run(engine, handshake, client, times)
}

/// The timeouts a connection uses (`[timeouts]`), copied out of the config.
struct Times {
    header: Duration,
    idle: Duration,
    goaway: Duration,
}

async fn run<E: Engine, S: Stream>(
    engine: E,
    handshake: std::pin::Pin<Box<h2::server::Handshake<S, Bytes>>>,
    client: SocketAddr,
    t: Times,
) {
    // The preface and SETTINGS within `client_header`, evictable meanwhile
    // as a connection waiting for a head is.
    let handshake = {
        let waiting = evict::Waiting::enter(engine.waiting(), engine.now_ms());
        tokio::select! {
            r = tokio::time::timeout(t.header, handshake) => {
                r.ok().and_then(|r| r.ok())
            }
            _ = waiting.evicted() => None,
        }
    };
    let Some(mut h2c): Option<h2::server::Connection<S, Bytes>> = handshake else {
        return;
    };
    let mut drain = engine.drain();
    let mut draining = false;
    // Streams running now, and a wake-up when one ends: a connection with
    // none for `client_idle` gets GOAWAY and closes, as an idle HTTP/1
    // keep-alive connection does.
    let open = std::rc::Rc::new(std::cell::Cell::new(0usize));
    let ended = std::rc::Rc::new(tokio::sync::Notify::new());
    let idle = t.idle;
    // After GOAWAY the client is owed nothing but its open streams: once
    // none is left it has `client_goaway` more, whether or not it ever
    // acknowledges the GOAWAY's PING (h2 waits for that ACK unbounded).
    let goaway = t.goaway;
    let mut goaway_at: Option<tokio::time::Instant> = None;
    // Registered while no stream is open: evictable when the worker is
    // full, oldest first, as an idle HTTP/1 connection is (evict.rs).
    let mut waiting: Option<evict::Waiting<'_>> = None;
    loop {
        let none_open = open.get() == 0;
        if none_open != waiting.is_some() {
            waiting = none_open.then(|| evict::Waiting::enter(engine.waiting(), engine.now_ms()));
        }
        let quiet = none_open && !draining;
        let next = tokio::select! {
            r = h2c.accept() => r,
            _ = drain.changed(), if !draining => {
                // GOAWAY; open streams finish, then `accept` returns None.
                draining = true;
                goaway_at = Some(tokio::time::Instant::now());
                h2c.graceful_shutdown();
                continue;
            }
            // Lazy: select! builds disabled branches' futures too, and a
            // Sleep reads the clock when built (once per stream otherwise).
            _ = async { tokio::time::sleep(idle).await }, if quiet => {
                draining = true;
                goaway_at = Some(tokio::time::Instant::now());
                h2c.graceful_shutdown();
                continue;
            }
            _ = async {
                let at = goaway_at.unwrap_or_else(tokio::time::Instant::now);
                tokio::time::sleep_until(at + goaway).await
            }, if draining && none_open => {
                engine.goaway_timeout();
                tracing::debug!(%client, "http2 connection: closed {goaway:?} after GOAWAY");
                break;
            }
            _ = evicted(waiting.as_ref()) => {
                // Room for a new connection, or a drain: say GOAWAY (one
                // poll writes it if the socket takes it, waiting for no
                // one) and close.
                h2c.abrupt_shutdown(h2::Reason::NO_ERROR);
                let _ = poll_fn(|cx| {
                    let _ = h2c.poll_accept(cx);
                    std::task::Poll::Ready(())
                })
                .await;
                break;
            }
            // The last open stream ended: look again whether the
            // connection is idle.
            _ = ended.notified(), if !none_open => continue,
        };
        match next {
            Some(Ok((req, respond))) => {
                let (parts, body) = req.into_parts();
                // An extended CONNECT (RFC 8441) is the Upgrade it stands for.
                let protocol = (parts.method == http::Method::CONNECT)
                    .then(|| parts.extensions.get::<h2::ext::Protocol>())
                    .flatten()
                    .map(|p| p.as_str().to_string());
                let head = match protocol {
                    Some(p) => HttpHead::upgrade(parts, &p),
                    None => HttpHead::new(parts, !body.is_end_stream()),
                };
                let down = H2Downstream::new(body, respond, idle);
                let engine = engine.clone();
                let guard = StreamGuard::enter(&open, &ended);
                // The request's future (kilobytes) is written straight into
                // its box, and the task holds the box and the guard only.
                // Built on the stack and moved, it was copied whole four
                // times on its way into the task (callgrind: 170k
                // instructions a request, 73% memcpy); boxed inside the
                // task, the task kept a dead copy of its arguments (~700
                // bytes) beside the box.
                let fut = pier_session::boxed_in_place(|| engine.serve_stream(down, head));
                tokio::task::spawn_local(async move {
                    let _guard = guard;
                    fut.await
                });
            }
            Some(Err(e)) => {
                tracing::debug!(%client, "http2 connection: {e}");
                break;
            }
            None => break,
        }
    }
}

/// Resolves when the connection registered as `w` is evicted (never when
/// it is not registered).
async fn evicted(w: Option<&evict::Waiting<'_>>) {
    match w {
        Some(w) => w.evicted().await,
        None => std::future::pending().await,
    }
}

/// One running stream of a connection (released however its task ends).
struct StreamGuard {
    open: std::rc::Rc<std::cell::Cell<usize>>,
    ended: std::rc::Rc<tokio::sync::Notify>,
}

impl StreamGuard {
    fn enter(
        open: &std::rc::Rc<std::cell::Cell<usize>>,
        ended: &std::rc::Rc<tokio::sync::Notify>,
    ) -> Self {
        open.set(open.get() + 1);
        StreamGuard {
            open: open.clone(),
            ended: ended.clone(),
        }
    }
}

impl Drop for StreamGuard {
    fn drop(&mut self) {
        let left = self.open.get().saturating_sub(1);
        self.open.set(left);
        // Only the last stream's end can make the connection idle: waking
        // the connection's task at every stream's end cost it a pass of
        // its loop per request.
        if left == 0 {
            self.ended.notify_one();
        }
    }
}

/// On an `h2c` listener: does the client open with the HTTP/2 preface
/// ("PRI * HTTP/2.0")? Peeked, so an HTTP/1 client loses nothing. Waits at
/// most `client_header` for the first bytes, woken by the socket's
/// readiness only (a preface arriving in pieces costs one wake-up a piece).
pub async fn prior_knowledge(tcp: &tokio::net::TcpStream, limit: Duration) -> bool {
    use std::io::ErrorKind::WouldBlock;
    const PRI: &[u8] = b"PRI * HTTP/2.0";
    // A second handle on the socket for a plain peek inside `try_io`
    // (tokio's own peek is async only).
    let Ok(fd) = std::os::fd::AsFd::as_fd(tcp).try_clone_to_owned() else {
        return false;
    };
    let dup = std::net::TcpStream::from(fd);
    let look = async {
        let mut b = [0u8; 14];
        loop {
            if tcp.readable().await.is_err() {
                return false;
            }
            // A prefix of the preface so far: WouldBlock clears the
            // readiness this peek saw, so `readable` waits for more bytes
            // rather than returning at once.
            let peeked = tcp.try_io(tokio::io::Interest::READABLE, || {
                let n = dup.peek(&mut b)?;
                if n > 0 && n < PRI.len() && b[..n] == PRI[..n] {
                    return Err(WouldBlock.into());
                }
                Ok(n)
            });
            match peeked {
                Ok(n) => return n == PRI.len() && b[..] == *PRI,
                Err(e) if e.kind() == WouldBlock => continue,
                Err(_) => return false,
            }
        }
    };
    tokio::time::timeout(limit, look).await.unwrap_or(false)
}

/// [`prior_knowledge`] for a connection on the worker's io_uring.
pub async fn prior_knowledge_uring(s: &pier_core::uring::UringStream, limit: Duration) -> bool {
    matches!(
        tokio::time::timeout(limit, s.starts_with(b"PRI * HTTP/2.0")).await,
        Ok(Ok(true))
    )
}

/// On an `h2c = "only"` listener, a connection that does not open with the
/// preface: closed with a FIN (write side first, then what the client sent
/// is read and dropped, up to 64 KiB or a second), not a reset, so the
/// client sees the close (RFC 9113 §3.4).
pub async fn close_gently<S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin>(mut tcp: S) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let _ = tcp.shutdown().await;
    let drain = async {
        let mut buf = [0u8; 4096];
        let mut left = 64 * 1024usize;
        while left > 0 {
            match tcp.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => left = left.saturating_sub(n),
            }
        }
    };
    let _ = tokio::time::timeout(Duration::from_secs(1), drain).await;
}

/// One HTTP/2 stream as the driver's downstream: its receiving half (the
/// request body) and its sending half (the response), apart, so the body
/// can stream up while the response comes down.
pub struct H2Downstream {
    rx: H2Rx,
    tx: H2Tx,
}

pub struct H2Rx {
    recv: h2::RecvStream,
    /// The body piece last handed out.
    buf: Bytes,
    trailers: Option<Headers>,
    received: u64,
    o: StreamOpts,
    done: bool,
}

pub struct H2Tx {
    respond: h2::server::SendResponse<Bytes>,
    send: Option<h2::SendStream<Bytes>>,
    sent: u64,
    /// A body of known length: the DATA frame that completes it ends the
    /// stream (no empty frame after it).
    end_at: Option<u64>,
    /// The final head went: no more interim ones.
    head_sent: bool,
    o: StreamOpts,
}

impl H2Downstream {
    fn new(recv: h2::RecvStream, respond: h2::server::SendResponse<Bytes>, idle: Duration) -> Self {
        H2Downstream {
            rx: H2Rx {
                recv,
                buf: Bytes::new(),
                trailers: None,
                received: 0,
                o: StreamOpts::new(idle),
                done: false,
            },
            tx: H2Tx {
                respond,
                send: None,
                sent: 0,
                end_at: None,
                head_sent: false,
                o: StreamOpts::new(idle),
            },
        }
    }
}

impl Downstream for H2Downstream {
    type Source<'a> = &'a mut H2Rx;
    type Sink<'a> = &'a mut H2Tx;

    /// Boxed: each stream allocates its request's future, which should not
    /// carry a rarer step's state (`Downstream::hold`).
    fn hold<F: std::future::Future>(f: F) -> impl std::future::Future<Output = F::Output> {
        Box::pin(f)
    }

    async fn vet_body(&mut self, _: BodyLen, _: bool, _: Duration) -> Result<(), Kind> {
        // DATA frames are framed and checked by h2.
        Ok(())
    }

    fn open(&mut self, opts: &DownstreamOpts) -> (&mut H2Rx, &mut H2Tx) {
        self.rx.o = opts.into();
        self.tx.o = self.rx.o;
        (&mut self.rx, &mut self.tx)
    }

    /// An extended CONNECT the origin switched (RFC 8441 §5): its 101 is a
    /// 200 here, then the stream's DATA frames carry the bytes both ways.
    async fn tunnel<R: AsyncRead + Unpin, W: AsyncWrite + Unpin>(
        &mut self,
        head: &ResponseHead,
        early: &[u8],
        ur: &mut R,
        uw: &mut W,
        idle: Duration,
    ) -> Result<u64, Error> {
        let mut ok = head.clone();
        ok.set_status(200);
        ok.headers.remove_known(pier_http::known::UPGRADE);
        ok.headers.remove(b"sec-websocket-accept");
        let resp = http_types::response_fields(&ok);
        let send = self
            .tx
            .respond
            .send_response(resp, false)
            .map_err(|_| Error::answered(Kind::ClientClosed))?;
        let mut cw = H2Write { send };
        if !early.is_empty() && cw.write_all(early).await.is_err() {
            return Err(Error::answered(Kind::ClientClosed));
        }
        let mut cr = H2Read {
            recv: &mut self.rx.recv,
            buf: Bytes::new(),
        };
        pier_session::tunnel(&mut cr, &mut cw, ur, uw, idle).await;
        Ok(0)
    }
}

/// A tunnelled stream's receiving half as a byte stream.
struct H2Read<'a> {
    recv: &'a mut h2::RecvStream,
    buf: Bytes,
}

impl AsyncRead for H2Read<'_> {
    fn poll_read(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        out: &mut tokio::io::ReadBuf<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        use std::task::Poll;
        let me = self.get_mut();
        if me.buf.is_empty() {
            match me.recv.poll_data(cx) {
                Poll::Pending => return Poll::Pending,
                // The client ended its side: end of the stream.
                Poll::Ready(None) => return Poll::Ready(Ok(())),
                Poll::Ready(Some(Err(e))) => return Poll::Ready(Err(std::io::Error::other(e))),
                Poll::Ready(Some(Ok(b))) => {
                    let _ = me.recv.flow_control().release_capacity(b.len());
                    me.buf = b;
                }
            }
        }
        let n = me.buf.len().min(out.remaining());
        out.put_slice(&me.buf.split_to(n));
        Poll::Ready(Ok(()))
    }
}

/// A tunnelled stream's sending half as a byte stream: writes take what
/// the flow-control window allows.
struct H2Write {
    send: h2::SendStream<Bytes>,
}

impl AsyncWrite for H2Write {
    fn poll_write(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        data: &[u8],
    ) -> std::task::Poll<std::io::Result<usize>> {
        use std::task::Poll;
        let me = self.get_mut();
        if data.is_empty() {
            return Poll::Ready(Ok(0));
        }
        me.send.reserve_capacity(data.len());
        match me.send.poll_capacity(cx) {
            Poll::Pending => Poll::Pending,
            Poll::Ready(None) => Poll::Ready(Err(std::io::ErrorKind::BrokenPipe.into())),
            Poll::Ready(Some(Err(e))) => Poll::Ready(Err(std::io::Error::other(e))),
            Poll::Ready(Some(Ok(n))) => {
                let n = n.min(data.len());
                match me.send.send_data(Bytes::copy_from_slice(&data[..n]), false) {
                    Ok(()) => Poll::Ready(Ok(n)),
                    Err(e) => Poll::Ready(Err(std::io::Error::other(e))),
                }
            }
        }
    }

    fn poll_flush(
        self: std::pin::Pin<&mut Self>,
        _cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::task::Poll::Ready(Ok(()))
    }

    fn poll_shutdown(
        self: std::pin::Pin<&mut Self>,
        _cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        let _ = self.get_mut().send.send_data(Bytes::new(), true);
        std::task::Poll::Ready(Ok(()))
    }
}

impl RequestSource for &mut H2Rx {
    async fn read_body(&mut self) -> Result<Option<&[u8]>, Error> {
        if self.done {
            return Ok(None);
        }
        let next = tokio::time::timeout(self.o.idle, self.recv.data()).await;
        match next {
            Err(_) => Err(Error::new(Kind::BodyTimeout)),
            Ok(None) => {
                self.done = true;
                // Trailers, if the client sent any.
                if let Ok(Ok(Some(t))) =
                    tokio::time::timeout(self.o.idle, self.recv.trailers()).await
                {
                    let mut h = Headers::default();
                    http_types::to_headers(&t, &mut h);
                    self.trailers = Some(h);
                }
                Ok(None)
            }
            Ok(Some(Err(_))) => Err(Error::new(Kind::ClientClosed)),
            Ok(Some(Ok(data))) => {
                // Let the client send more as this is taken.
                let _ = self.recv.flow_control().release_capacity(data.len());
                self.received += data.len() as u64;
                if self.o.max_body > 0 && self.received > self.o.max_body {
                    return Err(Error::new(Kind::BodyTooLarge));
                }
                self.buf = data;
                Ok(Some(&self.buf[..]))
            }
        }
    }
    fn trailers(&self) -> Option<&Headers> {
        self.trailers.as_ref()
    }
}

impl H2Tx {
    /// Send `data` as the window allows (h2 would otherwise queue it all:
    /// memory per stream stays bounded by the flow-control window).
    async fn send_all(&mut self, mut data: Bytes, last: bool) -> Result<(), Error> {
        let Some(s) = self.send.as_mut() else {
            return Ok(());
        };
        while !data.is_empty() {
            s.reserve_capacity(data.len());
            // h2 assigns what the windows allow as the capacity is reserved:
            // a timer (a clock read, a scheduler handle) only when it must
            // be waited for.
            let n = match s.capacity() {
                0 => {
                    let cap =
                        tokio::time::timeout(self.o.idle, poll_fn(|cx| s.poll_capacity(cx))).await;
                    match cap {
                        Ok(Some(Ok(n))) => n,
                        _ => return Err(Error::answered(Kind::ClientClosed)),
                    }
                }
                n => n,
            }
            .min(data.len());
            if n == 0 {
                continue;
            }
            let piece = data.split_to(n);
            self.sent += piece.len() as u64;
            s.send_data(piece, last && data.is_empty())
                .map_err(|_| Error::answered(Kind::ClientClosed))?;
        }
        Ok(())
    }

    async fn write_bytes(&mut self, data: Bytes) -> Result<(), Error> {
        let last = self
            .end_at
            .is_some_and(|n| self.sent + data.len() as u64 >= n);
        self.send_all(data, last).await?;
        if last {
            self.send = None;
        }
        Ok(())
    }
}

impl ResponseSink for &mut H2Tx {
    async fn write_interim(&mut self, head: &ResponseHead) -> Result<(), Error> {
        // 100 Continue and 103 Early Hints, as HEADERS without END_STREAM
        // (RFC 9113 §8.1). The driver passes no 101: HTTP/2 has no Upgrade.
        if !(100..200).contains(&head.status) || head.status == 101 || self.head_sent {
            return Ok(());
        }
        self.respond
            .send_informational(http_types::response_fields(head))
            .map_err(|_| Error::new(Kind::ClientClosed))
    }

    async fn write_head(&mut self, head: &ResponseHead, size: BodySize) -> Result<(), Error> {
        let resp = http_types::response(head, size, self.o.now_ns);
        let end = self.o.head_only || size == BodySize::None;
        // gRPC (and gRPC-web) bodies end with trailers, never early.
        self.end_at = match size {
            BodySize::Length(n) if n > 0 && !http_types::is_grpc(head) => Some(n),
            _ => None,
        };
        self.head_sent = true;
        match self.respond.send_response(resp, end) {
            Ok(s) => {
                if !end {
                    self.send = Some(s);
                }
                Ok(())
            }
            Err(_) => Err(Error::new(Kind::ClientClosed)),
        }
    }

    async fn write_body(&mut self, data: &[u8]) -> Result<(), Error> {
        if self.o.head_only || data.is_empty() || self.send.is_none() {
            return Ok(());
        }
        self.write_bytes(Bytes::copy_from_slice(data)).await
    }

    /// A cached body's bytes go to the frames as they are (no copy).
    async fn write_spliced(&mut self, body: &SpliceBody) -> Result<(), Error> {
        if self.o.head_only || body.bytes.is_empty() || self.send.is_none() {
            return Ok(());
        }
        self.write_bytes(body.bytes.clone()).await
    }

    async fn finish(&mut self, trailers: Option<&Headers>) -> Result<(), Error> {
        let Some(mut s) = self.send.take() else {
            return Ok(());
        };
        let map = trailer_map(trailers);
        let r = if map.is_empty() {
            s.send_data(Bytes::new(), true)
        } else {
            s.send_trailers(map)
        };
        r.map_err(|_| Error::answered(Kind::ClientClosed))
    }

    fn keep_alive(&self) -> bool {
        true
    }

    fn bytes_sent(&self) -> u64 {
        self.sent
    }
    const WATCHES_GONE: bool = true;
    /// The stream reset by the client, or its connection gone (h2 resets
    /// every open stream then). Before the head only: afterwards the
    /// stream's send side has one waiter, the body's writes, which fail.
    async fn client_gone(&mut self) {
        if self.head_sent {
            return std::future::pending().await;
        }
        std::future::poll_fn(|cx| self.respond.poll_reset(cx).map(|_| ())).await
    }
}
