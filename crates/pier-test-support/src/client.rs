//! Clients that show exactly what came over the wire: a raw TCP HTTP/1.1 client that
//! keeps one socket across requests, and a `curl` wrapper.
//!
//! Requests are raw bytes on purpose (tests send malformed ones); responses are read
//! with Pier's own codec (`pier_http`): heads with `ResponseHead::parse`, framing with
//! `body_len`, bodies with `BodyDecoder` (the validating chunked scanner underneath).

use std::io::{self, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpStream};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use pier_http::{write, BodyDecoder, BodyLen, HeadLimits, Method, ResponseHead};

use crate::ws;

/// Default read timeout of a [`RawConn`].
const DEFAULT_TIMEOUT: Duration = Duration::from_secs(10);
/// Largest response head the client accepts.
const MAX_HEAD: usize = 1 << 20;

/// Receives a streamed body piece by piece.
pub type BodySink<'a> = &'a mut dyn FnMut(&[u8]);

/// One parsed response.
#[derive(Debug, Clone, Default)]
pub struct Response {
    pub status: u16,
    pub reason: String,
    /// HTTP minor version (1 for HTTP/1.1).
    pub minor_version: u8,
    pub headers: Vec<(String, String)>,
    /// The body, unless it was streamed to a sink.
    pub body: Vec<u8>,
    /// Body bytes received (also counted when streamed to a sink).
    pub body_len: u64,
    pub trailers: Vec<(String, String)>,
    /// 1xx interim responses received before this one: status and headers.
    pub interim: Vec<(u16, Vec<(String, String)>)>,
    pub chunked: bool,
    /// The body ran until the connection closed (no Content-Length, not chunked).
    pub close_delimited: bool,
}

impl Response {
    /// First value of a header (names compare case-insensitively).
    pub fn header(&self, name: &str) -> Option<&str> {
        find(&self.headers, name)
    }

    /// Every value of a header, in order.
    pub fn header_all(&self, name: &str) -> Vec<&str> {
        self.headers
            .iter()
            .filter(|(n, _)| n.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
            .collect()
    }

    pub fn trailer(&self, name: &str) -> Option<&str> {
        find(&self.trailers, name)
    }

    /// Whether a comma-separated header has a token, e.g. `connection: close`.
    pub fn has_token(&self, name: &str, token: &str) -> bool {
        self.header_all(name)
            .iter()
            .flat_map(|v| v.split(','))
            .any(|t| t.trim().eq_ignore_ascii_case(token))
    }

    pub fn body_str(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }

    /// The `x-pier-reason` header of a locally generated response.
    pub fn pier_reason(&self) -> Option<&str> {
        self.header("x-pier-reason")
    }
}

fn find<'a>(list: &'a [(String, String)], name: &str) -> Option<&'a str> {
    list.iter()
        .find(|(n, _)| n.eq_ignore_ascii_case(name))
        .map(|(_, v)| v.as_str())
}

/// A raw HTTP/1.1 client on one TCP connection.
#[derive(Debug)]
pub struct RawConn {
    stream: TcpStream,
    buf: Vec<u8>,
    eof: bool,
}

fn err(kind: io::ErrorKind, msg: impl Into<String>) -> io::Error {
    io::Error::new(kind, msg.into())
}

fn lossy(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

impl RawConn {
    /// Connects (10 s timeout) or panics.
    pub fn connect(addr: SocketAddr) -> RawConn {
        Self::try_connect(addr).unwrap_or_else(|e| panic!("connect to {addr}: {e}"))
    }

    pub fn try_connect(addr: SocketAddr) -> io::Result<RawConn> {
        let stream = TcpStream::connect_timeout(&addr, DEFAULT_TIMEOUT)?;
        stream.set_read_timeout(Some(DEFAULT_TIMEOUT))?;
        stream.set_write_timeout(Some(DEFAULT_TIMEOUT))?;
        stream.set_nodelay(true)?;
        Ok(RawConn {
            stream,
            buf: Vec::with_capacity(64 * 1024),
            eof: false,
        })
    }

    /// Sets the read and write timeout of each socket operation.
    pub fn set_timeout(&mut self, t: Duration) {
        let _ = self.stream.set_read_timeout(Some(t));
        let _ = self.stream.set_write_timeout(Some(t));
    }

    /// The socket, e.g. to `try_clone` a writer for a concurrent upload.
    pub fn stream(&self) -> &TcpStream {
        &self.stream
    }

    /// A second handle on the socket for writing from another thread.
    pub fn writer(&self) -> TcpStream {
        self.stream.try_clone().expect("clone socket")
    }

    pub fn local_addr(&self) -> SocketAddr {
        self.stream.local_addr().expect("local addr")
    }

    /// Writes all bytes or panics.
    pub fn send(&mut self, bytes: &[u8]) {
        self.try_send(bytes).unwrap_or_else(|e| panic!("send: {e}"))
    }

    pub fn try_send(&mut self, bytes: &[u8]) -> io::Result<()> {
        self.stream.write_all(bytes)?;
        self.stream.flush()
    }

    /// Half-closes the write side (the server sees EOF).
    pub fn shutdown_write(&self) {
        let _ = self.stream.shutdown(Shutdown::Write);
    }

    /// Sends a request with `Host: pier.test`, the given headers, and a Content-Length body
    /// when `body` is not empty, then reads the response.
    pub fn request(
        &mut self,
        method: &str,
        path: &str,
        headers: &[(&str, &str)],
        body: &[u8],
    ) -> io::Result<Response> {
        let mut bytes = Vec::with_capacity(256 + body.len());
        write::request_line(&mut bytes, method.as_bytes(), path.as_bytes());
        if !headers.iter().any(|(n, _)| n.eq_ignore_ascii_case("host")) {
            write::header(&mut bytes, b"host", b"pier.test");
        }
        for (n, v) in headers {
            write::header(&mut bytes, n.as_bytes(), v.as_bytes());
        }
        if !body.is_empty() {
            write::header_u64(&mut bytes, b"content-length", body.len() as u64);
        }
        bytes.extend_from_slice(b"\r\n");
        bytes.extend_from_slice(body);
        self.try_send(&bytes)?;
        if method.eq_ignore_ascii_case("HEAD") {
            self.read_response_no_body()
        } else {
            self.read_response()
        }
    }

    /// `GET path` on this connection.
    pub fn get(&mut self, path: &str) -> io::Result<Response> {
        self.request("GET", path, &[], b"")
    }

    /// Reads one response head, whatever its status (a 1xx too), and no body.
    pub fn read_head_only(&mut self) -> io::Result<Response> {
        Ok(self.read_head()?.0)
    }

    /// Reads one response (skipping and recording 1xx interim ones).
    pub fn read_response(&mut self) -> io::Result<Response> {
        self.read_response_with(false, None)
    }

    /// Reads the response to a HEAD request: never a body.
    pub fn read_response_no_body(&mut self) -> io::Result<Response> {
        self.read_response_with(true, None)
    }

    /// Reads a response, passing the body to `sink` piece by piece instead of keeping it.
    pub fn read_response_streaming(&mut self, sink: &mut dyn FnMut(&[u8])) -> io::Result<Response> {
        self.read_response_with(false, Some(sink))
    }

    /// Reads a response whose body should be the pattern from offset 0
    /// ([`crate::pattern`]), checking it piece by piece instead of keeping it:
    /// the response (`body_len` counted, `body` empty) and whether every byte matched.
    pub fn read_pattern_response(&mut self) -> io::Result<(Response, bool)> {
        let (mut off, mut good) = (0u64, true);
        let r = self.read_response_streaming(&mut |piece| {
            good &= crate::is_pattern(off, piece);
            off += piece.len() as u64;
        })?;
        Ok((r, good))
    }

    /// Reads a response. Errors: `UnexpectedEof` when the connection closed before or
    /// inside the response (the message says which), `TimedOut`/`WouldBlock` on timeout,
    /// `InvalidData` on a malformed response.
    pub fn read_response_with(
        &mut self,
        no_body: bool,
        mut sink: Option<BodySink<'_>>,
    ) -> io::Result<Response> {
        let mut interim = Vec::new();
        loop {
            let (mut resp, head) = self.read_head()?;
            if (100..200).contains(&resp.status) && resp.status != 101 {
                interim.push((resp.status, resp.headers));
                continue;
            }
            resp.interim = interim;
            let framing = if no_body {
                BodyLen::None
            } else {
                head.body_len(Method::Get).map_err(|e| {
                    err(
                        io::ErrorKind::InvalidData,
                        format!(
                            "bad body framing ({e:?}): content-length {:?}, transfer-encoding {:?}",
                            resp.header_all("content-length"),
                            resp.header_all("transfer-encoding")
                        ),
                    )
                })?
            };
            resp.chunked = framing == BodyLen::Chunked;
            resp.close_delimited = framing == BodyLen::UntilClose;
            let mut body = BodyDecoder::new(framing);
            while !body.is_done() {
                if self.buf.is_empty() && self.fill()? == 0 {
                    if body.eof() {
                        break;
                    }
                    let msg = match body.remaining() {
                        Some(left) => {
                            let cl = match framing {
                                BodyLen::Length(n) => n,
                                _ => 0,
                            };
                            format!(
                                "connection closed inside the body: got {} of {cl} bytes (status {})",
                                cl - left,
                                resp.status
                            )
                        }
                        None => "connection closed inside a chunk".to_string(),
                    };
                    return Err(err(io::ErrorKind::UnexpectedEof, msg));
                }
                let used = body
                    .decode(&self.buf, |piece| {
                        resp.body_len += piece.len() as u64;
                        match sink.as_mut() {
                            Some(s) => s(piece),
                            None => resp.body.extend_from_slice(piece),
                        }
                    })
                    .map_err(|e| {
                        err(
                            io::ErrorKind::InvalidData,
                            format!(
                                "bad chunked body ({e:?}) near {:?}",
                                String::from_utf8_lossy(&self.buf[..self.buf.len().min(200)])
                            ),
                        )
                    })?;
                self.buf.drain(..used);
            }
            let trailers = body
                .trailers()
                .map_err(|e| err(io::ErrorKind::InvalidData, format!("bad trailers ({e:?})")))?;
            resp.trailers = trailers.iter().map(|(n, v)| (lossy(n), lossy(v))).collect();
            return Ok(resp);
        }
    }

    /// Reads one response head with Pier's codec: the client's view of it, and the codec's.
    fn read_head(&mut self) -> io::Result<(Response, ResponseHead)> {
        let limits = HeadLimits {
            max_header_bytes: MAX_HEAD,
            ..HeadLimits::default()
        };
        loop {
            if !self.buf.is_empty() {
                let mut head = ResponseHead::default();
                match head.parse(&self.buf, &limits) {
                    Ok(Some(n)) => {
                        let resp = Response {
                            status: head.status,
                            reason: lossy(head.reason()),
                            minor_version: head.version,
                            headers: head
                                .headers
                                .iter()
                                .map(|(n, v)| (lossy(n), lossy(v)))
                                .collect(),
                            ..Response::default()
                        };
                        self.buf.drain(..n);
                        return Ok((resp, head));
                    }
                    Ok(None) => {}
                    Err(e) => {
                        return Err(err(
                            io::ErrorKind::InvalidData,
                            format!(
                                "bad response head ({e:?}): {:?}",
                                String::from_utf8_lossy(&self.buf[..self.buf.len().min(200)])
                            ),
                        ))
                    }
                }
            }
            if self.fill()? == 0 {
                let msg = if self.buf.is_empty() {
                    "connection closed before a response".to_string()
                } else {
                    format!(
                        "connection closed inside a response head: {:?}",
                        String::from_utf8_lossy(&self.buf)
                    )
                };
                return Err(err(io::ErrorKind::UnexpectedEof, msg));
            }
        }
    }

    /// Reads more bytes into the buffer; 0 at EOF. A reset counts as EOF.
    fn fill(&mut self) -> io::Result<usize> {
        if self.eof {
            return Ok(0);
        }
        let mut tmp = [0u8; 64 * 1024];
        let n = match self.stream.read(&mut tmp) {
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::ConnectionReset => 0,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => return self.fill(),
            Err(e) => return Err(e),
        };
        if n == 0 {
            self.eof = true;
        }
        self.buf.extend_from_slice(&tmp[..n]);
        Ok(n)
    }

    /// Waits up to `timeout` for the peer to close the connection (EOF or reset), and
    /// says whether it did. Bytes received meanwhile are kept in the buffer.
    pub fn is_closed(&mut self, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        let old = self.stream.read_timeout().ok().flatten();
        let mut closed = false;
        for _ in 0..10_000 {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                break;
            }
            let _ = self
                .stream
                .set_read_timeout(Some(left.max(Duration::from_millis(1))));
            match self.fill() {
                Ok(0) => {
                    closed = true;
                    break;
                }
                Ok(_) => {}
                Err(_) => break,
            }
        }
        let _ = self.stream.set_read_timeout(old);
        closed
    }

    /// Bytes received but not consumed by a parsed response.
    pub fn buffered(&self) -> &[u8] {
        &self.buf
    }

    /// Reads one WebSocket frame.
    pub fn read_ws_frame(&mut self) -> io::Result<ws::Frame> {
        loop {
            match ws::decode_frame(&self.buf, 64 << 20) {
                Ok(Some((f, used))) => {
                    self.buf.drain(..used);
                    return Ok(f);
                }
                Ok(None) => {
                    if self.fill()? == 0 {
                        return Err(err(
                            io::ErrorKind::UnexpectedEof,
                            "closed inside a ws frame",
                        ));
                    }
                }
                Err(e) => return Err(err(io::ErrorKind::InvalidData, e)),
            }
        }
    }
}

/// `GET path` on a new connection; panics on an I/O error.
pub fn get(addr: SocketAddr, path: &str) -> Response {
    try_get(addr, path).unwrap_or_else(|e| panic!("GET {path} via {addr}: {e}"))
}

/// `GET path` on a new connection.
pub fn try_get(addr: SocketAddr, path: &str) -> io::Result<Response> {
    RawConn::try_connect(addr)?.get(path)
}

/// Runs a command with its output captured, killing it after `timeout`.
pub fn run_with_timeout(cmd: &mut Command, timeout: Duration) -> Output {
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("spawn {cmd:?}: {e}"));
    // Drained on threads so a full pipe never blocks the child.
    let mut out = child.stdout.take().expect("stdout");
    let mut errp = child.stderr.take().expect("stderr");
    let t_out = std::thread::spawn(move || {
        let mut v = Vec::new();
        let _ = out.read_to_end(&mut v);
        v
    });
    let t_err = std::thread::spawn(move || {
        let mut v = Vec::new();
        let _ = errp.read_to_end(&mut v);
        v
    });
    let deadline = Instant::now() + timeout;
    let status = loop {
        if let Some(s) = child.try_wait().expect("try_wait") {
            break s;
        }
        if Instant::now() >= deadline {
            let _ = child.kill();
            break child.wait().expect("wait");
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    Output {
        status,
        stdout: t_out.join().unwrap_or_default(),
        stderr: t_err.join().unwrap_or_default(),
    }
}

/// Runs `curl -sS --max-time 30 ARGS…` (killed after 40 s).
pub fn curl(args: &[&str]) -> Output {
    run_with_timeout(
        Command::new("curl")
            .args(["-sS", "--max-time", "30"])
            .args(args),
        Duration::from_secs(40),
    )
}

// === connecting from a chosen local address ===

thread_local! {
    /// A small runtime for bind-before-connect (std's `TcpStream` cannot bind first; this
    /// crate forbids the `unsafe` that libc would need).
    static CONNECT_RT: tokio::runtime::Runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("connect runtime");
}

impl RawConn {
    /// A client on an already connected socket, set up as [`RawConn::try_connect`] does
    /// (blocking, 10 s timeouts, no delay).
    pub fn from_stream(stream: TcpStream) -> io::Result<RawConn> {
        stream.set_nonblocking(false)?;
        stream.set_read_timeout(Some(DEFAULT_TIMEOUT))?;
        stream.set_write_timeout(Some(DEFAULT_TIMEOUT))?;
        stream.set_nodelay(true)?;
        Ok(RawConn {
            stream,
            buf: Vec::with_capacity(64 * 1024),
            eof: false,
        })
    }

    /// Connects from `local_ip` (port chosen by the OS): on Linux every address of
    /// 127.0.0.0/8 is local, so one test can act as several clients to per-IP limits.
    pub fn try_connect_from(local_ip: std::net::IpAddr, addr: SocketAddr) -> io::Result<RawConn> {
        let stream = CONNECT_RT.with(|rt| {
            rt.block_on(async {
                let sock = if addr.is_ipv4() {
                    tokio::net::TcpSocket::new_v4()?
                } else {
                    tokio::net::TcpSocket::new_v6()?
                };
                sock.bind(SocketAddr::new(local_ip, 0))?;
                let s = tokio::time::timeout(DEFAULT_TIMEOUT, sock.connect(addr))
                    .await
                    .map_err(|_| err(io::ErrorKind::TimedOut, format!("connect to {addr}")))??;
                s.into_std()
            })
        })?;
        Self::from_stream(stream)
    }

    /// [`RawConn::try_connect_from`] or panic.
    pub fn connect_from(local_ip: std::net::IpAddr, addr: SocketAddr) -> RawConn {
        Self::try_connect_from(local_ip, addr)
            .unwrap_or_else(|e| panic!("connect from {local_ip} to {addr}: {e}"))
    }
}
