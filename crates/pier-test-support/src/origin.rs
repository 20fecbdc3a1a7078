//! A real HTTP/1.1 origin server, written on raw sockets so it can misbehave on purpose.
//!
//! It runs on its own thread with its own tokio runtime, so sync and async tests can use
//! it alike. Endpoints are matched on the first path segment that names one, so a route
//! prefix in front works: `/api/v1/name` is served as `/name`.
//!
//! | path | behaviour |
//! |---|---|
//! | `/hello` | 200, `hello world\n` (12 bytes) |
//! | `/echo` | streams the request body back, chunked (with the request's trailers) or with the request's Content-Length |
//! | `/bytes/N` | N pattern bytes ([`crate::pattern_byte`]), Content-Length, streamed |
//! | `/chunked/N` | N pattern bytes chunked, trailer `x-trailer: done` |
//! | `/slow/MS` | sleeps MS ms before the head, then `slow\n` |
//! | `/slowbody/MS` | head (Content-Length 10) at once, then one byte of `0123456789` every MS ms |
//! | `/status/NNN` | that status; 1xx: the interim response (with a `link` header) then 200 `after 1xx\n`; 204/304: no body |
//! | `/headers` | the request head exactly as received, as the body |
//! | `/die` | head with Content-Length 1000, 10 bytes, then closes |
//! | `/drop` | reads the request, then closes without a response |
//! | `/eof/N` | N pattern bytes with neither Content-Length nor chunked: the body ends when the origin closes |
//! | `/cookies` | three `set-cookie` headers (`a=1`, `b=2`, `c=3; Path=/`) |
//! | `/hop` | 200 with hop-by-hop headers: `connection: x-hop-secret`, `x-hop-secret`, `keep-alive`, `proxy-connection`, and an end-to-end `x-kept: yes` |
//! | `/bad/KIND` | a malformed response, then closes: `garbage`, `two-cl` (differing Content-Lengths), `cl-te` (both), `status` (4-digit status), `header` (space in a header name), `bad-chunk` (head fine, then an invalid chunk size) |
//! | `/close` | `Connection: close`, `closing\n`, then closes |
//! | `/healthz` | 200 `ok\n`, or 500 while [`Origin::set_healthy`]`(false)`; counted apart |
//! | `/ws` | WebSocket handshake (101 with a correct accept key), then echoes every frame |
//! | `/name` | the origin's name |
//! | `/expect` | reports the `Expect` header it got and the body size |
//!
//! Any request with `Expect: 100-continue` and a body gets `100 Continue` before the body
//! is read. Every response carries `x-origin: <name>`. HEAD gets the GET head, no body.

use std::io;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use bytes::{Buf, Bytes, BytesMut};
use pier_error::Kind;
use pier_http::head::MAX_HEADERS_HARD;
use pier_http::{write, BodyDecoder, BodyLen, HeadLimits, RequestHead};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::oneshot;

use crate::ws;

/// Largest request head the origin accepts (Pier's limits are tested below this).
const MAX_HEAD: usize = 1 << 20;
/// Largest piece of body handled at once: streaming, never the whole body.
const PIECE: usize = 64 * 1024;

#[derive(Debug)]
struct State {
    name: String,
    connections: AtomicU64,
    active: AtomicI64,
    requests: AtomicU64,
    health_checks: AtomicU64,
    healthy: AtomicBool,
    /// Close a keep-alive connection idle this long (0: never), as real origins do.
    idle_close_ms: AtomicU64,
}

/// A running origin server. Stopped (listener and every connection closed) on
/// [`Origin::stop`] or drop.
pub struct Origin {
    addr: SocketAddr,
    state: Arc<State>,
    shutdown: Mutex<Option<(oneshot::Sender<()>, JoinHandle<()>)>>,
}

impl std::fmt::Debug for Origin {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Origin")
            .field("name", &self.state.name)
            .field("addr", &self.addr)
            .finish()
    }
}

impl Origin {
    /// Starts an origin named `origin` on 127.0.0.1:0.
    pub fn start() -> Origin {
        Self::start_named("origin")
    }

    /// Starts an origin with a name (returned by `/name` and in `x-origin`).
    pub fn start_named(name: &str) -> Origin {
        Self::start_at(name, "127.0.0.1:0".parse().expect("addr"))
            .expect("bind origin on 127.0.0.1:0")
    }

    /// Starts an origin on a given address, e.g. the address of an origin that was
    /// stopped, to bring "the same server" back.
    pub fn start_at(name: &str, addr: SocketAddr) -> io::Result<Origin> {
        // Bound here, synchronously, so the address is known and connectable on return.
        let std_listener = std::net::TcpListener::bind(addr)?;
        std_listener.set_nonblocking(true)?;
        let addr = std_listener.local_addr()?;
        let state = Arc::new(State {
            name: name.to_string(),
            connections: AtomicU64::new(0),
            active: AtomicI64::new(0),
            requests: AtomicU64::new(0),
            health_checks: AtomicU64::new(0),
            healthy: AtomicBool::new(true),
            idle_close_ms: AtomicU64::new(0),
        });
        let (tx, rx) = oneshot::channel::<()>();
        let st = state.clone();
        let thread = std::thread::Builder::new()
            .name(format!("origin-{name}"))
            .spawn(move || {
                let rt = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .expect("origin runtime");
                rt.block_on(async move {
                    let listener = TcpListener::from_std(std_listener).expect("listener");
                    accept_loop(listener, st, rx).await;
                });
                // Dropping the runtime here drops every connection task: "origin dies".
                drop(rt);
            })?;
        Ok(Origin {
            addr,
            state,
            shutdown: Mutex::new(Some((tx, thread))),
        })
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    pub fn name(&self) -> &str {
        &self.state.name
    }

    /// Connections accepted so far.
    pub fn connections(&self) -> u64 {
        self.state.connections.load(Ordering::SeqCst)
    }

    /// Connections open right now.
    pub fn active_connections(&self) -> i64 {
        self.state.active.load(Ordering::SeqCst)
    }

    /// Requests received (every path except `/healthz`), including heads that failed to
    /// parse: a request Pier should have refused shows up here.
    pub fn requests(&self) -> u64 {
        self.state.requests.load(Ordering::SeqCst)
    }

    /// Requests to `/healthz`.
    pub fn health_checks(&self) -> u64 {
        self.state.health_checks.load(Ordering::SeqCst)
    }

    /// Makes `/healthz` answer 500 (false) or 200 (true).
    pub fn set_healthy(&self, healthy: bool) {
        self.state.healthy.store(healthy, Ordering::SeqCst);
    }

    /// Closes keep-alive connections that stay idle for `t` between requests (`None`:
    /// never), like an origin with a keep-alive timeout; for testing stale pooled
    /// connections.
    pub fn set_idle_timeout(&self, t: Option<Duration>) {
        let ms = t.map_or(0, |t| t.as_millis().max(1) as u64);
        self.state.idle_close_ms.store(ms, Ordering::SeqCst);
    }

    /// Closes the listener and every open connection, and waits until that is done.
    /// Idempotent.
    pub fn stop(&self) {
        let taken = self
            .shutdown
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take();
        if let Some((tx, thread)) = taken {
            let _ = tx.send(());
            let _ = thread.join();
        }
    }
}

impl Drop for Origin {
    fn drop(&mut self) {
        self.stop();
    }
}

async fn accept_loop(listener: TcpListener, st: Arc<State>, mut stop: oneshot::Receiver<()>) {
    loop {
        tokio::select! {
            _ = &mut stop => return,
            r = listener.accept() => {
                let Ok((sock, _)) = r else {
                    // EMFILE and friends: back off rather than spin.
                    tokio::time::sleep(Duration::from_millis(10)).await;
                    continue;
                };
                st.connections.fetch_add(1, Ordering::SeqCst);
                st.active.fetch_add(1, Ordering::SeqCst);
                let st = st.clone();
                tokio::spawn(async move {
                    let _ = sock.set_nodelay(true);
                    let mut c = Conn { s: sock, buf: BytesMut::with_capacity(PIECE), st: st.clone() };
                    let _ = c.serve().await;
                    st.active.fetch_sub(1, Ordering::SeqCst);
                });
            }
        }
    }
}

// === request head ===

/// Parser bounds: far above Pier's, so Pier's own limits are what tests meet.
const LIMITS: HeadLimits = HeadLimits {
    max_header_bytes: MAX_HEAD,
    max_headers: MAX_HEADERS_HARD,
    max_uri_bytes: MAX_HEAD,
};

/// A request head as parsed by Pier's codec, plus owned copies for convenience.
struct Head {
    req: RequestHead,
    method: String,
    path: String,
    headers: Vec<(String, String)>,
    raw: Bytes,
}

impl Head {
    fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }

    fn has_token(&self, name: &str, token: &str) -> bool {
        self.headers
            .iter()
            .filter(|(n, _)| n.eq_ignore_ascii_case(name))
            .flat_map(|(_, v)| v.split(','))
            .any(|t| t.trim().eq_ignore_ascii_case(token))
    }

    fn body_kind(&self) -> BodyLen {
        self.req.body_len()
    }

    fn wants_close(&self) -> bool {
        !self.req.keep_alive()
    }
}

// === connection ===

struct Conn {
    s: TcpStream,
    buf: BytesMut,
    st: Arc<State>,
}

/// Whether the connection may serve another request.
enum Next {
    KeepAlive,
    Close,
}

impl Conn {
    async fn fill(&mut self) -> io::Result<usize> {
        self.buf.reserve(PIECE);
        self.s.read_buf(&mut self.buf).await
    }

    async fn serve(&mut self) -> io::Result<()> {
        loop {
            let idle_ms = self.st.idle_close_ms.load(Ordering::SeqCst);
            let head = if idle_ms > 0 && self.buf.is_empty() {
                match tokio::time::timeout(Duration::from_millis(idle_ms), self.read_head()).await {
                    Ok(r) => r?,
                    // Idle too long: close without a word, as origins do.
                    Err(_) => return Ok(()),
                }
            } else {
                self.read_head().await?
            };
            let Some(head) = head else { return Ok(()) };
            match self.respond(head).await? {
                Next::KeepAlive => continue,
                Next::Close => {
                    let _ = self.s.shutdown().await;
                    return Ok(());
                }
            }
        }
    }

    /// Reads one request head; `None` on a clean close between requests.
    async fn read_head(&mut self) -> io::Result<Option<Head>> {
        loop {
            // Tolerate empty lines between requests (RFC 9112 section 2.2).
            while self.buf.starts_with(b"\r\n") {
                self.buf.advance(2);
            }
            if !self.buf.is_empty() {
                let mut req = RequestHead::default();
                match req.parse(&self.buf, &LIMITS) {
                    Ok(Some(n)) => {
                        let lossy = |b: &[u8]| String::from_utf8_lossy(b).into_owned();
                        let head = Head {
                            method: lossy(req.method()),
                            path: lossy(req.uri()),
                            headers: req
                                .headers
                                .iter()
                                .map(|(n, v)| (lossy(n), lossy(v)))
                                .collect(),
                            raw: self.buf.split_to(n).freeze(),
                            req,
                        };
                        return Ok(Some(head));
                    }
                    Ok(None) => {}
                    Err(Kind::HeadersTooLarge | Kind::UriTooLong) => {
                        self.write_simple(
                            431,
                            "Too Large",
                            &[("connection", "close")],
                            b"head too large\n",
                        )
                        .await?;
                        return Err(io::Error::new(io::ErrorKind::InvalidData, "head too large"));
                    }
                    Err(e) => {
                        // Counted: a malformed request that reached the origin was forwarded.
                        self.st.requests.fetch_add(1, Ordering::SeqCst);
                        let body = format!("origin could not parse the request: {e:?}\n");
                        self.write_simple(
                            400,
                            "Bad Request",
                            &[("connection", "close")],
                            body.as_bytes(),
                        )
                        .await?;
                        return Err(io::Error::new(io::ErrorKind::InvalidData, format!("{e:?}")));
                    }
                }
            }
            if self.fill().await? == 0 {
                if self.buf.is_empty() {
                    return Ok(None);
                }
                return Err(io::ErrorKind::UnexpectedEof.into());
            }
        }
    }

    async fn respond(&mut self, head: Head) -> io::Result<Next> {
        let path = head.path.split('?').next().unwrap_or("").to_string();
        let (endpoint, arg) = route(&path);
        if endpoint == "healthz" {
            self.st.health_checks.fetch_add(1, Ordering::SeqCst);
        } else {
            self.st.requests.fetch_add(1, Ordering::SeqCst);
        }
        let is_head = head.method.eq_ignore_ascii_case("HEAD");
        let close = head.wants_close();
        let kind = head.body_kind();
        let has_body =
            matches!(kind, BodyLen::Chunked) || matches!(kind, BodyLen::Length(n) if n > 0);
        if has_body && head.has_token("expect", "100-continue") {
            self.s.write_all(b"HTTP/1.1 100 Continue\r\n\r\n").await?;
        }
        let conn_hdr: &[(&str, &str)] = if close {
            &[("connection", "close")]
        } else {
            &[]
        };

        match endpoint {
            "echo" => {
                self.echo(&head, kind, is_head, conn_hdr).await?;
            }
            "ws" => return self.websocket(&head).await,
            "die" => {
                self.discard_body(kind).await?;
                let h = self.head_bytes(200, "OK", &[("content-length", "1000")]);
                self.s.write_all(&h).await?;
                if !is_head {
                    self.s.write_all(b"0123456789").await?;
                }
                self.s.flush().await?;
                return Ok(Next::Close);
            }
            "bad" => {
                self.discard_body(kind).await?;
                let kind = path.rsplit('/').next().unwrap_or("");
                let raw: &[u8] = match kind {
                    "two-cl" => b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\ncontent-length: 6\r\n\r\nhello!",
                    "cl-te" => b"HTTP/1.1 200 OK\r\ncontent-length: 3\r\ntransfer-encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n",
                    "status" => b"HTTP/1.1 2000 OK\r\ncontent-length: 2\r\n\r\nok",
                    "header" => b"HTTP/1.1 200 OK\r\nbad header: x\r\ncontent-length: 2\r\n\r\nok",
                    "bad-chunk" => b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nhello\r\nzz\r\nmore\r\n0\r\n\r\n",
                    _ => b"NOT HTTP AT ALL\r\n\r\n",
                };
                self.s.write_all(raw).await?;
                self.s.flush().await?;
                return Ok(Next::Close);
            }
            "eof" => {
                self.discard_body(kind).await?;
                let n = arg.and_then(|a| a.parse::<u64>().ok()).unwrap_or(0);
                let h = self.head_bytes(200, "OK", &[("connection", "close")]);
                self.s.write_all(&h).await?;
                if !is_head {
                    self.write_pattern(n, false).await?;
                }
                self.s.flush().await?;
                // The close is what ends this body.
                return Ok(Next::Close);
            }
            "drop" => {
                self.discard_body(kind).await?;
                return Ok(Next::Close);
            }
            "close" => {
                self.discard_body(kind).await?;
                self.write_full(200, "OK", &[("connection", "close")], b"closing\n", is_head)
                    .await?;
                return Ok(Next::Close);
            }
            _ => {
                let mut body_len = 0u64;
                let mut reader = BodyReader::new(kind);
                while let Some(p) = reader.next(self).await? {
                    body_len += p.len() as u64;
                }
                self.serve_endpoint(&head, endpoint, arg, body_len, is_head, conn_hdr)
                    .await?;
            }
        }
        Ok(if close { Next::Close } else { Next::KeepAlive })
    }

    async fn serve_endpoint(
        &mut self,
        head: &Head,
        endpoint: &str,
        arg: Option<&str>,
        body_len: u64,
        is_head: bool,
        conn_hdr: &[(&str, &str)],
    ) -> io::Result<()> {
        let num = arg.and_then(|a| a.parse::<u64>().ok());
        match (endpoint, num) {
            ("hello", _) => {
                self.write_full(200, "OK", conn_hdr, b"hello world\n", is_head)
                    .await
            }
            ("cookies", _) => {
                let mut hdrs = vec![
                    ("set-cookie", "a=1"),
                    ("set-cookie", "b=2"),
                    ("set-cookie", "c=3; Path=/"),
                ];
                hdrs.extend_from_slice(conn_hdr);
                self.write_full(200, "OK", &hdrs, b"cookies\n", is_head)
                    .await
            }
            ("hop", _) => {
                let mut hdrs = vec![
                    ("connection", "x-hop-secret"),
                    ("x-hop-secret", "1"),
                    ("keep-alive", "timeout=5, max=100"),
                    ("proxy-connection", "keep-alive"),
                    ("x-kept", "yes"),
                ];
                hdrs.extend_from_slice(conn_hdr);
                self.write_full(200, "OK", &hdrs, b"hop\n", is_head).await
            }
            ("name", _) => {
                let name = self.st.name.clone();
                self.write_full(200, "OK", conn_hdr, name.as_bytes(), is_head)
                    .await
            }
            ("headers", _) => {
                let raw = head.raw.clone();
                self.write_full(200, "OK", conn_hdr, &raw, is_head).await
            }
            ("expect", _) => {
                let body = format!(
                    "expect: {}\nbytes: {body_len}\n",
                    head.header("expect").unwrap_or("-")
                );
                self.write_full(200, "OK", conn_hdr, body.as_bytes(), is_head)
                    .await
            }
            ("healthz", _) => {
                if self.st.healthy.load(Ordering::SeqCst) {
                    self.write_full(200, "OK", conn_hdr, b"ok\n", is_head).await
                } else {
                    self.write_full(500, "Unhealthy", conn_hdr, b"unhealthy\n", is_head)
                        .await
                }
            }
            ("bytes", Some(n)) => {
                let len = n.to_string();
                let mut hdrs = vec![("content-length", len.as_str())];
                hdrs.extend_from_slice(conn_hdr);
                let h = self.head_bytes(200, "OK", &hdrs);
                self.s.write_all(&h).await?;
                if !is_head {
                    self.write_pattern(n, false).await?;
                }
                self.s.flush().await
            }
            ("chunked", Some(n)) => {
                let mut hdrs = vec![("transfer-encoding", "chunked"), ("trailer", "x-trailer")];
                hdrs.extend_from_slice(conn_hdr);
                let h = self.head_bytes(200, "OK", &hdrs);
                self.s.write_all(&h).await?;
                if !is_head {
                    self.write_pattern(n, true).await?;
                    self.s.write_all(b"0\r\nx-trailer: done\r\n\r\n").await?;
                }
                self.s.flush().await
            }
            ("cache", Some(secs)) => {
                // Cacheable for `secs` with an ETag; the body names the
                // request number, so a test sees which fill it got.
                let n = self.st.requests.load(Ordering::SeqCst);
                let cc = format!("max-age={secs}");
                let mut hdrs = vec![("cache-control", cc.as_str()), ("etag", "\"v1\"")];
                hdrs.extend_from_slice(conn_hdr);
                let body = format!("fill {n}\n");
                self.write_full(200, "OK", &hdrs, body.as_bytes(), is_head)
                    .await
            }
            ("slow", Some(ms)) => {
                tokio::time::sleep(Duration::from_millis(ms)).await;
                self.write_full(200, "OK", conn_hdr, b"slow\n", is_head)
                    .await
            }
            ("slowbody", Some(ms)) => {
                let mut hdrs = vec![("content-length", "10")];
                hdrs.extend_from_slice(conn_hdr);
                let h = self.head_bytes(200, "OK", &hdrs);
                self.s.write_all(&h).await?;
                self.s.flush().await?;
                if !is_head {
                    for b in b"0123456789" {
                        tokio::time::sleep(Duration::from_millis(ms)).await;
                        self.s.write_all(&[*b]).await?;
                        self.s.flush().await?;
                    }
                }
                Ok(())
            }
            ("status", Some(code)) if (100..=999).contains(&code) => {
                let code = code as u16;
                if code < 200 {
                    let mut interim = Vec::with_capacity(128);
                    write::status_line(&mut interim, code, b"Interim");
                    write::header(&mut interim, b"link", b"</style.css>; rel=preload");
                    write::header(&mut interim, b"x-origin", self.st.name.as_bytes());
                    interim.extend_from_slice(b"\r\n");
                    self.s.write_all(&interim).await?;
                    self.write_full(200, "OK", conn_hdr, b"after 1xx\n", is_head)
                        .await
                } else if code == 204 || code == 304 {
                    let h = self.head_bytes(code, "No Body", conn_hdr);
                    self.s.write_all(&h).await?;
                    self.s.flush().await
                } else {
                    let body = format!("status {code}\n");
                    self.write_full(code, "Status", conn_hdr, body.as_bytes(), is_head)
                        .await
                }
            }
            _ => {
                self.write_full(404, "Not Found", conn_hdr, b"no such path\n", is_head)
                    .await
            }
        }
    }

    // --- writing ---

    fn head_bytes(&self, status: u16, reason: &str, headers: &[(&str, &str)]) -> Vec<u8> {
        let mut h = Vec::with_capacity(256);
        write::status_line(&mut h, status, reason.as_bytes());
        write::header(&mut h, b"x-origin", self.st.name.as_bytes());
        for (n, v) in headers {
            write::header(&mut h, n.as_bytes(), v.as_bytes());
        }
        h.extend_from_slice(b"\r\n");
        h
    }

    async fn write_full(
        &mut self,
        status: u16,
        reason: &str,
        headers: &[(&str, &str)],
        body: &[u8],
        is_head: bool,
    ) -> io::Result<()> {
        let len = body.len().to_string();
        let mut hdrs = vec![("content-length", len.as_str())];
        hdrs.extend_from_slice(headers);
        let mut out = self.head_bytes(status, reason, &hdrs);
        if !is_head {
            out.extend_from_slice(body);
        }
        self.s.write_all(&out).await?;
        self.s.flush().await
    }

    async fn write_simple(
        &mut self,
        status: u16,
        reason: &str,
        headers: &[(&str, &str)],
        body: &[u8],
    ) -> io::Result<()> {
        self.write_full(status, reason, headers, body, false).await
    }

    /// Writes `n` pattern bytes, as chunks of varying size when `chunked`.
    async fn write_pattern(&mut self, n: u64, chunked: bool) -> io::Result<()> {
        let mut off = 0u64;
        let mut piece = vec![0u8; PIECE];
        let mut step = 0u64;
        while off < n {
            // Vary chunk sizes so framing bugs at odd boundaries show up.
            let max = if chunked {
                1000 + (step * 7919) % 15000
            } else {
                PIECE as u64
            };
            let len = (n - off).min(max) as usize;
            for (i, b) in piece[..len].iter_mut().enumerate() {
                *b = crate::pattern_byte(off + i as u64);
            }
            if chunked {
                self.s.write_all(format!("{len:x}\r\n").as_bytes()).await?;
                self.s.write_all(&piece[..len]).await?;
                self.s.write_all(b"\r\n").await?;
            } else {
                self.s.write_all(&piece[..len]).await?;
            }
            off += len as u64;
            step += 1;
        }
        Ok(())
    }

    // --- bodies ---

    async fn discard_body(&mut self, kind: BodyLen) -> io::Result<()> {
        let mut r = BodyReader::new(kind);
        while r.next(self).await?.is_some() {}
        Ok(())
    }

    async fn echo(
        &mut self,
        head: &Head,
        kind: BodyLen,
        is_head: bool,
        conn_hdr: &[(&str, &str)],
    ) -> io::Result<()> {
        let ct = head
            .header("content-type")
            .unwrap_or("application/octet-stream")
            .to_string();
        let mut hdrs: Vec<(&str, &str)> = vec![("content-type", ct.as_str())];
        let len_s;
        match kind {
            BodyLen::Chunked => hdrs.push(("transfer-encoding", "chunked")),
            BodyLen::Length(n) => {
                len_s = n.to_string();
                hdrs.push(("content-length", len_s.as_str()));
            }
            BodyLen::None | BodyLen::UntilClose => hdrs.push(("content-length", "0")),
        }
        hdrs.extend_from_slice(conn_hdr);
        let h = self.head_bytes(200, "OK", &hdrs);
        self.s.write_all(&h).await?;
        let mut r = BodyReader::new(kind);
        while let Some(p) = r.next(self).await? {
            if is_head {
                continue;
            }
            if kind == BodyLen::Chunked {
                self.s
                    .write_all(format!("{:x}\r\n", p.len()).as_bytes())
                    .await?;
                self.s.write_all(&p).await?;
                self.s.write_all(b"\r\n").await?;
            } else {
                self.s.write_all(&p).await?;
            }
        }
        if kind == BodyLen::Chunked && !is_head {
            let mut end = b"0\r\n".to_vec();
            for (n, v) in &r.trailers {
                end.extend_from_slice(format!("{n}: {v}\r\n").as_bytes());
            }
            end.extend_from_slice(b"\r\n");
            self.s.write_all(&end).await?;
        }
        self.s.flush().await
    }

    async fn websocket(&mut self, head: &Head) -> io::Result<Next> {
        let key = head.header("sec-websocket-key").map(str::to_string);
        let (true, Some(key)) = (head.has_token("upgrade", "websocket"), key) else {
            self.write_simple(
                400,
                "Bad Request",
                &[("connection", "close")],
                b"not a websocket handshake\n",
            )
            .await?;
            return Ok(Next::Close);
        };
        let accept = ws::accept_key(&key);
        let h = self.head_bytes(
            101,
            "Switching Protocols",
            &[
                ("upgrade", "websocket"),
                ("connection", "Upgrade"),
                ("sec-websocket-accept", &accept),
            ],
        );
        self.s.write_all(&h).await?;
        loop {
            match ws::decode_frame(&self.buf, 16 << 20) {
                Ok(Some((f, used))) => {
                    self.buf.advance(used);
                    let out = ws::encode_frame(f.fin, f.opcode, &f.payload, None);
                    self.s.write_all(&out).await?;
                    if f.opcode == ws::OP_CLOSE {
                        return Ok(Next::Close);
                    }
                }
                Ok(None) => {
                    if self.fill().await? == 0 {
                        return Ok(Next::Close);
                    }
                }
                Err(_) => return Ok(Next::Close),
            }
        }
    }
}

/// Splits a path into the endpoint and its argument: the first segment naming an
/// endpoint, and the segment after it.
fn route(path: &str) -> (&str, Option<&str>) {
    const ENDPOINTS: &[&str] = &[
        "hello", "echo", "bytes", "chunked", "slow", "slowbody", "status", "headers", "die",
        "drop", "bad", "hop", "eof", "cookies", "close", "healthz", "ws", "name", "expect",
        "cache",
    ];
    let segs: Vec<&str> = path.split('/').filter(|s| !s.is_empty()).collect();
    for (i, s) in segs.iter().enumerate() {
        if let Some(e) = ENDPOINTS.iter().find(|e| **e == *s) {
            return (e, segs.get(i + 1).copied());
        }
    }
    ("", None)
}

/// Streams a request body out of a connection piece by piece, decoded by Pier's codec
/// (`BodyDecoder`: Content-Length, or chunked through the validating scanner).
struct BodyReader {
    dec: BodyDecoder,
    trailers: Vec<(String, String)>,
}

impl BodyReader {
    fn new(kind: BodyLen) -> BodyReader {
        BodyReader {
            dec: BodyDecoder::new(kind),
            trailers: Vec::new(),
        }
    }

    /// The next piece of payload (what one read brought, at most a buffer's worth);
    /// `None` at the end of the body.
    async fn next(&mut self, c: &mut Conn) -> io::Result<Option<Bytes>> {
        loop {
            if self.dec.is_done() {
                return Ok(None);
            }
            if c.buf.is_empty() && c.fill().await? == 0 {
                return Err(io::ErrorKind::UnexpectedEof.into());
            }
            let mut piece = BytesMut::new();
            let used = self
                .dec
                .decode(&c.buf, |p| piece.extend_from_slice(p))
                .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, format!("{e:?}")))?;
            c.buf.advance(used);
            if self.dec.is_done() {
                let trailers = self
                    .dec
                    .trailers()
                    .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, format!("{e:?}")))?;
                let lossy = |b: &[u8]| String::from_utf8_lossy(b).trim().to_string();
                self.trailers = trailers.iter().map(|(n, v)| (lossy(n), lossy(v))).collect();
            }
            if !piece.is_empty() {
                return Ok(Some(piece.freeze()));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::route;

    #[test]
    fn routes_on_first_endpoint_segment() {
        assert_eq!(route("/hello"), ("hello", None));
        assert_eq!(route("/api/v1/bytes/100"), ("bytes", Some("100")));
        assert_eq!(route("/a/name"), ("name", None));
        assert_eq!(route("/nothing/here"), ("", None));
    }
}
