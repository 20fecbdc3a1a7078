//! HTTP/1.1 behind the session interfaces (pier-session), both sides:
//! parsing and framing come from pier-http (the one HTTP/1 codec in the
//! tree); this crate adds the I/O — buffers, timeouts, pacing, splicing a
//! mapped body — over any stream half. The engine's connection loop
//! (pier-proxy's driver: request after request, sessions pooled per worker)
//! opens an [`H1Downstream`] per request; its connector opens an
//! [`H1Upstream`] per attempt.
//!
//! Bodies are decoded on the way in and framed again on the way out, as
//! Pingora does: the two sides' framings are independent (a chunked origin
//! body reaches an HTTP/1.0 client close-delimited, a body filter's output
//! is re-chunked), and nothing of one side's framing can leak to the other.

use bytes::{Buf, BytesMut};
use pier_clock::timeout;
use pier_core::Stream;
use pier_error::{Error, Kind};
use pier_http::known::{self, Known};
use pier_http::{
    date, write, BodyDecoder, BodyLen, ChunkedScanner, HeadLimits, Headers, Method, ResponseHead,
};
use pier_session::{
    BodySize, Downstream, DownstreamOpts, RequestSink, RequestSource, ResponseSink, ResponseSource,
    SpliceBody, UpstreamRequest,
};
use std::time::{Duration, Instant};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

pub const READ_CHUNK: usize = 16 * 1024;

/// `data`, all of it, within `t`, flushed: a writer that buffers sends now. TLS does (tokio-rustls takes
/// the plaintext and keeps what the socket would not take as records of
/// its own until the next write or flush); without the flush the end of a
/// response to a slow reader would wait in rustls for the next request.
/// For a socket it costs nothing.
async fn write_timed<W: AsyncWrite + Unpin>(
    w: &mut W,
    data: &[u8],
    t: Duration,
) -> std::io::Result<()> {
    let all = async {
        w.write_all(data).await?;
        w.flush().await
    };
    match timeout(t, all).await {
        Ok(r) => r,
        Err(_) => Err(std::io::ErrorKind::TimedOut.into()),
    }
}

/// `a` then `b` with vectored writes (a head and a large body piece go out
/// together without copying the body behind the head), within `t`;
/// flushed as [`write_timed`] is.
async fn write2_timed<W: AsyncWrite + Unpin>(
    w: &mut W,
    mut a: &[u8],
    mut b: &[u8],
    t: Duration,
) -> std::io::Result<()> {
    let all = async {
        while !a.is_empty() {
            let bufs = [std::io::IoSlice::new(a), std::io::IoSlice::new(b)];
            let n = w.write_vectored(&bufs).await?;
            if n == 0 {
                return Err(std::io::ErrorKind::WriteZero.into());
            }
            if n < a.len() {
                a = &a[n..];
            } else {
                b = &b[n - a.len()..];
                a = &[];
            }
        }
        w.write_all(b).await?;
        w.flush().await
    };
    match timeout(t, all).await {
        Ok(r) => r,
        Err(_) => Err(std::io::ErrorKind::TimedOut.into()),
    }
}

/// Cached body bytes this process spliced to clients (no copy).
pub static SPLICE_BYTES: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// A pipe the pages of a body pass through on their way to a socket.
struct Pipe {
    r: std::os::fd::OwnedFd,
    w: std::os::fd::OwnedFd,
    /// Bytes it holds at most.
    cap: usize,
}

thread_local! {
    /// Empty pipes, kept for the next large hit on this worker (a pipe
    /// that still holds bytes when its send fails is closed instead).
    static PIPES: std::cell::RefCell<Vec<Pipe>> = const { std::cell::RefCell::new(Vec::new()) };
    /// Pipes this worker's sends hold now.
    static PIPES_IN_USE: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
}
const MAX_SPARE_PIPES: usize = 16;
/// A pipe is grown to this (one `tee` + one `splice` per MiB, not per
/// 64 KiB); where the kernel refuses, it keeps its default size.
const PIPE_SIZE: usize = 1 << 20;

/// How many pipes one worker's sends may hold at once (two descriptors
/// each, for as long as a slow client takes): a sixteenth of the
/// descriptor limit, 16 to 256. Past it a body is written as usual.
fn max_pipes_in_use() -> usize {
    (pier_cache::mapped::descriptor_limit() / 16).clamp(16, 256) as usize
}

/// A pipe held by one send: back to the spares when the send emptied it,
/// closed otherwise (it may still hold a body's pages).
struct PipeLease {
    pipe: Option<Pipe>,
    empty: bool,
}

impl PipeLease {
    /// A spare or a new pipe; None past the worker's bound or when the
    /// kernel refuses one (the caller writes the body instead).
    fn take() -> Option<PipeLease> {
        if PIPES_IN_USE.get() >= max_pipes_in_use() {
            return None;
        }
        let pipe = match PIPES.with_borrow_mut(Vec::pop) {
            Some(p) => p,
            None => {
                use rustix::pipe::PipeFlags;
                let (r, w) =
                    rustix::pipe::pipe_with(PipeFlags::NONBLOCK | PipeFlags::CLOEXEC).ok()?;
                let cap = rustix::pipe::fcntl_setpipe_size(&w, PIPE_SIZE)
                    .or_else(|_| rustix::pipe::fcntl_getpipe_size(&w))
                    .unwrap_or(64 << 10);
                Pipe { r, w, cap }
            }
        };
        PIPES_IN_USE.set(PIPES_IN_USE.get() + 1);
        Some(PipeLease {
            pipe: Some(pipe),
            empty: false,
        })
    }
}

impl Drop for PipeLease {
    fn drop(&mut self) {
        PIPES_IN_USE.set(PIPES_IN_USE.get().saturating_sub(1));
        if let Some(p) = self.pipe.take().filter(|_| self.empty) {
            PIPES.with_borrow_mut(|v| {
                if v.len() < MAX_SPARE_PIPES {
                    v.push(p);
                }
            });
        }
    }
}

/// `head` (held back with MSG_MORE, so that it leaves with the body's first
/// segment), then the body's pages: into a pipe by reference (`tee` from
/// the body's own pipe, else `vmsplice`) and from it to the socket
/// (`splice`), which keeps references to them as `sendfile` does. Within
/// `t`, waiting for the socket as any write does.
async fn splice_timed(
    out: pier_core::SpliceOut<'_>,
    mut head: &[u8],
    body: &SpliceBody,
    mut lease: PipeLease,
    t: Duration,
) -> std::io::Result<()> {
    use rustix::pipe::SpliceFlags;
    use std::os::fd::AsFd;
    let all = async {
        out.ready().await?;
        let tcp = out.fd()?;
        while !head.is_empty() {
            let n = out
                .write_with(|| {
                    rustix::net::send(
                        tcp,
                        head,
                        rustix::net::SendFlags::MORE | rustix::net::SendFlags::NOSIGNAL,
                    )
                    .map_err(std::io::Error::from)
                })
                .await?;
            head = &head[n..];
        }
        let Some(p) = lease.pipe.as_ref() else {
            return Err(std::io::ErrorKind::BrokenPipe.into());
        };
        let mut pos = body.offset as usize;
        let end = pos + body.bytes.len();
        let mut held = 0;
        while pos < end || held > 0 {
            if held == 0 {
                let room = (end - pos).min(p.cap);
                // From the start of the body, its own pipe lends the page
                // references; otherwise the pages are pinned here.
                let n = match (pos == 0).then(|| body.mapped.tee_into(p.w.as_fd(), room)) {
                    Some(Some(r)) => r?,
                    _ => body.mapped.splice_into(p.w.as_fd(), pos, room)?,
                };
                if n == 0 {
                    return Err(std::io::ErrorKind::WriteZero.into());
                }
                pos += n;
                held = n;
            }
            let more = if pos < end {
                SpliceFlags::MORE
            } else {
                SpliceFlags::empty()
            };
            let n = out
                .write_with(|| {
                    rustix::pipe::splice(&p.r, None, tcp, None, held, SpliceFlags::NONBLOCK | more)
                        .map_err(std::io::Error::from)
                })
                .await?;
            if n == 0 {
                return Err(std::io::ErrorKind::WriteZero.into());
            }
            SPLICE_BYTES.fetch_add(n as u64, std::sync::atomic::Ordering::Relaxed);
            held -= n;
        }
        // Empty: fit for the next send (on any error it closes instead).
        lease.empty = true;
        Ok(())
    };
    match timeout(t, all).await {
        Ok(r) => r,
        Err(_) => Err(std::io::ErrorKind::TimedOut.into()),
    }
}

/// A first body piece up to this size is copied behind the head (one
/// write); a larger one (a cached object, served whole) goes by `writev`.
const COALESCE_MAX: usize = 16 * 1024;

/// Lower-case hex of `n` without allocating (chunk sizes).
fn hex_len(buf: &mut [u8; 16], mut n: usize) -> &[u8] {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    let mut i = buf.len();
    loop {
        i -= 1;
        buf[i] = HEX[n & 15];
        n >>= 4;
        if n == 0 {
            return &buf[i..];
        }
    }
}

fn chunk_prefix(out: &mut Vec<u8>, len: usize) {
    let mut hex = [0u8; 16];
    out.extend_from_slice(hex_len(&mut hex, len));
    out.extend_from_slice(b"\r\n");
}

fn write_trailers(out: &mut Vec<u8>, trailers: Option<&Headers>) {
    out.extend_from_slice(b"0\r\n");
    if let Some(t) = trailers {
        for (n, v) in t.iter() {
            write::header(out, n, v);
        }
    }
    out.extend_from_slice(b"\r\n");
}

/// Decode what `buf` holds of a chunked body with pier-http's decoder (its
/// scanner bounds extensions and the trailer section): data into `piece`,
/// the trailer fields into `fields` once the body ends.
fn feed_chunked(
    dec: &mut BodyDecoder,
    buf: &[u8],
    piece: &mut Vec<u8>,
    fields: &mut Headers,
) -> Result<usize, Kind> {
    let was_done = dec.is_done();
    let n = dec.decode(buf, |d| piece.extend_from_slice(d))?;
    if !was_done && dec.is_done() {
        for (name, value) in dec.trailers()? {
            fields.append(name, value);
        }
    }
    Ok(n)
}

/// Response headers Pier writes itself or never forwards.
pub fn skip_response_header(k: Known) -> bool {
    pier_http::hop_by_hop(k)
}

// === client side ===

/// Minimum body rate applies after this grace time (slow starts are normal).
const MIN_RATE_GRACE: Duration = Duration::from_secs(10);

/// The client's request body over HTTP/1.1: Content-Length or chunked,
/// read with a per-read idle timeout and (after a grace period) a minimum
/// average rate, so a trickling upload can't hold a connection and an
/// origin slot forever (slow-POST attacks).
pub struct H1RequestSource<'a, R> {
    pub r: R,
    pub buf: &'a mut BytesMut,
    framing: BodyLen,
    remaining: u64,
    chunked: BodyDecoder,
    /// Decoded bytes of a chunked body (data ranges between framing).
    piece: Vec<u8>,
    trailers: Headers,
    /// Bytes of `buf` handed out by the last read, consumed at the next.
    lent: usize,
    total: u64,
    max_body: u64,
    read_timeout: Duration,
    min_rate: u64,
    started: Instant,
    got: u64,
}

impl<'a, R: AsyncRead + Unpin> H1RequestSource<'a, R> {
    pub fn new(
        r: R,
        buf: &'a mut BytesMut,
        framing: BodyLen,
        max_body: u64,
        read_timeout: Duration,
        min_rate: u64,
    ) -> Self {
        H1RequestSource {
            r,
            buf,
            framing,
            remaining: match framing {
                BodyLen::Length(n) => n,
                _ => 0,
            },
            chunked: BodyDecoder::new(BodyLen::Chunked),
            piece: Vec::new(),
            trailers: Headers::new(),
            lent: 0,
            total: 0,
            max_body,
            read_timeout,
            min_rate,
            started: pier_clock::recent(),
            got: 0,
        }
    }

    async fn read_more(&mut self) -> Result<(), Kind> {
        self.buf.reserve(READ_CHUNK);
        match timeout(self.read_timeout, self.r.read_buf(self.buf)).await {
            Ok(Ok(0)) | Ok(Err(_)) => Err(Kind::ClientClosed),
            Ok(Ok(n)) => {
                self.got += n as u64;
                if self.min_rate > 0 {
                    let el = pier_clock::now().saturating_duration_since(self.started);
                    if el > MIN_RATE_GRACE
                        && self.got * 1000 / (el.as_millis() as u64).max(1) < self.min_rate
                    {
                        return Err(Kind::BodyTimeout);
                    }
                }
                Ok(())
            }
            Err(_) => Err(Kind::BodyTimeout),
        }
    }

    async fn next(&mut self) -> Result<Option<&[u8]>, Kind> {
        self.buf.advance(std::mem::take(&mut self.lent));
        match self.framing {
            BodyLen::None | BodyLen::UntilClose => Ok(None),
            BodyLen::Length(_) => {
                if self.remaining == 0 {
                    return Ok(None);
                }
                if self.buf.is_empty() {
                    self.read_more().await?;
                }
                let take = (self.buf.len() as u64).min(self.remaining) as usize;
                self.remaining -= take as u64;
                self.lent = take;
                Ok(Some(&self.buf[..take]))
            }
            BodyLen::Chunked => loop {
                if self.chunked.is_done() {
                    return Ok(None);
                }
                if !self.buf.is_empty() {
                    self.piece.clear();
                    let n = feed_chunked(
                        &mut self.chunked,
                        self.buf,
                        &mut self.piece,
                        &mut self.trailers,
                    )?;
                    self.buf.advance(n);
                    self.total += self.piece.len() as u64;
                    if self.max_body > 0 && self.total > self.max_body {
                        return Err(Kind::BodyTooLarge);
                    }
                    if !self.piece.is_empty() {
                        return Ok(Some(&self.piece));
                    }
                    if self.chunked.is_done() {
                        return Ok(None);
                    }
                }
                self.read_more().await?;
            },
        }
    }
}

impl<R: AsyncRead + Unpin> RequestSource for H1RequestSource<'_, R> {
    async fn read_body(&mut self) -> Result<Option<&[u8]>, Error> {
        self.next()
            .await
            .map_err(|k| Error::new(k).retryable(false))
    }
    fn trailers(&self) -> Option<&Headers> {
        (!self.trailers.is_empty()).then_some(&self.trailers)
    }
    const WATCHES_GONE: bool = true;
    /// A bodiless request's connection, read while the origin is waited
    /// on: EOF (or an error) means the client went away. Bytes mean it
    /// pipelined its next request: kept in the buffer for it, and the
    /// client is alive.
    async fn client_gone(&mut self) {
        if self.framing != BodyLen::None {
            return std::future::pending().await;
        }
        self.buf.reserve(1024);
        match self.r.read_buf(self.buf).await {
            Ok(0) | Err(_) => {}
            Ok(_) => std::future::pending().await,
        }
    }
}

/// The response to an HTTP/1.x client. The head waits in `out` for the
/// first body bytes, so a small response is one write.
pub struct H1ResponseSink<'a, W> {
    pub w: W,
    out: &'a mut Vec<u8>,
    /// The client's minor version: 0 for HTTP/1.0.
    version: u8,
    head_only: bool,
    keep: bool,
    chunked: bool,
    pending: bool,
    sent: u64,
    timeout: Duration,
    now_ns: u64,
}

impl<'a, W: AsyncWrite + Unpin> H1ResponseSink<'a, W> {
    /// `keep`: the client wants the connection kept (and may have it).
    pub fn new(
        w: W,
        out: &'a mut Vec<u8>,
        version: u8,
        method: Method,
        keep: bool,
        timeout: Duration,
        now_ns: u64,
    ) -> Self {
        H1ResponseSink {
            w,
            out,
            version,
            head_only: method == Method::Head,
            keep,
            chunked: false,
            pending: false,
            sent: 0,
            timeout,
            now_ns,
        }
    }

    async fn flush_out(&mut self) -> Result<(), Error> {
        self.pending = false;
        if self.out.is_empty() {
            return Ok(());
        }
        self.sent += self.out.len() as u64;
        let r = write_timed(&mut self.w, self.out, self.timeout).await;
        self.out.clear();
        r.map_err(|_| Error::answered(Kind::ClientClosed))
    }

    /// A 101 head as the origin sent it, with any bytes that followed it
    /// (the tunnel's first), in one write.
    pub async fn write_switch(&mut self, head: &ResponseHead, early: &[u8]) -> Result<(), Error> {
        self.out.clear();
        write::response_head(self.out, head, |k| {
            matches!(k, known::KEEP_ALIVE | known::PROXY_CONNECTION)
        });
        self.out.extend_from_slice(b"\r\n");
        self.out.extend_from_slice(early);
        self.keep = false;
        self.flush_out().await
    }
}

impl<W: AsyncWrite + Unpin + pier_core::RawSocket> ResponseSink for H1ResponseSink<'_, W> {
    async fn write_interim(&mut self, head: &ResponseHead) -> Result<(), Error> {
        // 100 Continue, 103 Early Hints: HTTP/1.0 clients can't take them.
        if self.version == 0 {
            return Ok(());
        }
        self.out.clear();
        write::response_head(self.out, head, skip_response_header);
        self.out.extend_from_slice(b"\r\n");
        self.flush_out().await
    }

    async fn write_head(&mut self, head: &ResponseHead, size: BodySize) -> Result<(), Error> {
        let out = &mut *self.out;
        out.clear();
        write::response_head(out, head, skip_response_header);
        if !head.headers.has_known(known::DATE) {
            date::with_date(self.now_ns, |d| write::header(out, b"Date", d));
        }
        match size {
            BodySize::None => {}
            BodySize::Length(n) => {
                if !head.headers.has_known(known::CONTENT_LENGTH) {
                    write::header_u64(out, b"Content-Length", n);
                }
            }
            BodySize::Stream if self.head_only => {}
            BodySize::Stream => {
                if self.version == 1 {
                    out.extend_from_slice(b"Transfer-Encoding: chunked\r\n");
                    self.chunked = true;
                } else {
                    // HTTP/1.0 can't read chunked framing: close-delimit.
                    self.keep = false;
                }
            }
        }
        if !self.keep {
            out.extend_from_slice(b"Connection: close\r\n");
        } else if self.version == 0 {
            out.extend_from_slice(b"Connection: keep-alive\r\n");
        }
        out.extend_from_slice(b"\r\n");
        self.pending = true;
        Ok(())
    }

    async fn write_body(&mut self, data: &[u8]) -> Result<(), Error> {
        if self.head_only || data.is_empty() {
            return Ok(());
        }
        if self.chunked {
            chunk_prefix(self.out, data.len());
            self.out.extend_from_slice(data);
            self.out.extend_from_slice(b"\r\n");
            return self.flush_out().await;
        }
        if self.pending {
            // Head and the first body bytes in one write.
            if data.len() <= COALESCE_MAX {
                self.out.extend_from_slice(data);
                return self.flush_out().await;
            }
            self.pending = false;
            self.sent += (self.out.len() + data.len()) as u64;
            let r = write2_timed(&mut self.w, self.out, data, self.timeout).await;
            self.out.clear();
            return r.map_err(|_| Error::answered(Kind::ClientClosed));
        }
        self.sent += data.len() as u64;
        write_timed(&mut self.w, data, self.timeout)
            .await
            .map_err(|_| Error::answered(Kind::ClientClosed))
    }

    async fn write_spliced(&mut self, body: &SpliceBody) -> Result<(), Error> {
        if self.head_only || body.bytes.is_empty() {
            return Ok(());
        }
        let Some(out) = self.w.raw_socket().filter(|_| !self.chunked) else {
            return self.write_body(&body.bytes).await;
        };
        let Some(pipe) = PipeLease::take() else {
            return self.write_body(&body.bytes).await;
        };
        // The head (if still held back) goes first, then the body's pages.
        let head_len = if self.pending { self.out.len() } else { 0 };
        self.pending = false;
        self.sent += (head_len + body.bytes.len()) as u64;
        let r = splice_timed(out, &self.out[..head_len], body, pipe, self.timeout).await;
        self.out.clear();
        r.map_err(|_| Error::answered(Kind::ClientClosed))
    }

    async fn finish(&mut self, trailers: Option<&Headers>) -> Result<(), Error> {
        if self.chunked && !self.head_only {
            write_trailers(self.out, trailers);
        }
        self.flush_out().await
    }

    fn keep_alive(&self) -> bool {
        self.keep
    }

    fn bytes_sent(&self) -> u64 {
        self.sent
    }
}

// === origin side ===

/// The request body to an HTTP/1.1 origin, framed as its head announced
/// (Content-Length as is, or chunked again).
pub struct H1RequestSink<W> {
    pub w: W,
    chunked: bool,
}

impl<W: AsyncWrite + Unpin> H1RequestSink<W> {
    pub fn new(w: W, framing: BodyLen) -> Self {
        H1RequestSink {
            w,
            chunked: framing == BodyLen::Chunked,
        }
    }
}

impl<W: AsyncWrite + Unpin> RequestSink for H1RequestSink<W> {
    async fn write_body(&mut self, data: &[u8]) -> Result<(), Error> {
        if data.is_empty() {
            return Ok(());
        }
        let r = if self.chunked {
            let mut hex = [0u8; 16];
            let mut pre = [0u8; 18];
            let h = hex_len(&mut hex, data.len());
            pre[..h.len()].copy_from_slice(h);
            pre[h.len()..h.len() + 2].copy_from_slice(b"\r\n");
            let n = h.len() + 2;
            async {
                self.w.write_all(&pre[..n]).await?;
                self.w.write_all(data).await?;
                self.w.write_all(b"\r\n").await?;
                self.w.flush().await
            }
            .await
        } else {
            // Flushed as `write_timed` is: to a TLS origin the last piece
            // would otherwise wait in rustls while the origin waits for it.
            async {
                self.w.write_all(data).await?;
                self.w.flush().await
            }
            .await
        };
        r.map_err(|_| Error::new(Kind::UpstreamClosed).retryable(false))
    }

    async fn finish(&mut self, trailers: Option<&Headers>) -> Result<(), Error> {
        if !self.chunked {
            return Ok(());
        }
        let mut out = Vec::with_capacity(8);
        write_trailers(&mut out, trailers);
        async {
            self.w.write_all(&out).await?;
            self.w.flush().await
        }
        .await
        .map_err(|_| Error::new(Kind::UpstreamClosed).retryable(false))
    }
}

/// An HTTP/1.1 origin's response: heads (1xx first), then the body decoded
/// from Content-Length, chunked or close-delimited framing.
pub struct H1ResponseSource<'a, R> {
    pub r: R,
    pub buf: &'a mut BytesMut,
    limits: &'a HeadLimits,
    method: Method,
    /// A pooled connection: an EOF before any byte means it died idle.
    reused: bool,
    head_deadline: tokio::time::Instant,
    read_timeout: Duration,
    framing: BodyLen,
    keep: bool,
    remaining: u64,
    chunked: BodyDecoder,
    piece: Vec<u8>,
    trailers: Headers,
    lent: usize,
    done: bool,
    eof: bool,
}

impl<'a, R: AsyncRead + Unpin> H1ResponseSource<'a, R> {
    pub fn new(
        r: R,
        buf: &'a mut BytesMut,
        limits: &'a HeadLimits,
        method: Method,
        reused: bool,
        read_timeout: Duration,
    ) -> Self {
        H1ResponseSource {
            r,
            buf,
            limits,
            method,
            reused,
            head_deadline: pier_clock::tokio_deadline(read_timeout),
            read_timeout,
            framing: BodyLen::None,
            keep: false,
            remaining: 0,
            chunked: BodyDecoder::new(BodyLen::Chunked),
            piece: Vec::new(),
            trailers: Headers::new(),
            lent: 0,
            done: false,
            eof: false,
        }
    }

    /// Bytes read past the 101 head (the tunnel's first).
    pub fn take_early(&mut self) -> BytesMut {
        self.buf.split()
    }

    async fn read_more(&mut self) -> Result<usize, Kind> {
        self.buf.reserve(READ_CHUNK);
        match timeout(self.read_timeout, self.r.read_buf(self.buf)).await {
            Ok(Ok(n)) => Ok(n),
            Ok(Err(_)) => Err(Kind::UpstreamClosed),
            Err(_) => Err(Kind::UpstreamTimeout),
        }
    }

    async fn next(&mut self) -> Result<Option<(&[u8], bool)>, Kind> {
        self.buf.advance(std::mem::take(&mut self.lent));
        if self.done {
            return Ok(None);
        }
        match self.framing {
            BodyLen::None => {
                self.done = true;
                Ok(None)
            }
            BodyLen::Length(_) => {
                if self.remaining == 0 {
                    self.done = true;
                    return Ok(None);
                }
                if self.buf.is_empty() && self.read_more().await? == 0 {
                    return Err(Kind::UpstreamClosed);
                }
                let take = (self.buf.len() as u64).min(self.remaining) as usize;
                self.remaining -= take as u64;
                self.lent = take;
                Ok(Some((&self.buf[..take], self.remaining == 0)))
            }
            BodyLen::UntilClose => {
                if self.buf.is_empty() && self.read_more().await? == 0 {
                    self.done = true;
                    self.eof = true;
                    return Ok(None);
                }
                self.lent = self.buf.len();
                Ok(Some((&self.buf[..], false)))
            }
            BodyLen::Chunked => loop {
                if !self.buf.is_empty() {
                    self.piece.clear();
                    let n = feed_chunked(
                        &mut self.chunked,
                        self.buf,
                        &mut self.piece,
                        &mut self.trailers,
                    )
                    .map_err(|_| Kind::UpstreamProtocol)?;
                    self.buf.advance(n);
                    if !self.piece.is_empty() {
                        return Ok(Some((&self.piece, self.chunked.is_done())));
                    }
                }
                if self.chunked.is_done() {
                    self.done = true;
                    return Ok(None);
                }
                if self.read_more().await? == 0 {
                    return Err(Kind::UpstreamClosed);
                }
            },
        }
    }
}

impl<R: AsyncRead + Unpin> ResponseSource for H1ResponseSource<'_, R> {
    async fn read_head(&mut self, head: &mut ResponseHead) -> Result<(), Error> {
        let mut got_any = !self.buf.is_empty();
        loop {
            if !self.buf.is_empty() {
                if let Some(n) = head.parse(self.buf, self.limits).map_err(Error::upstream)? {
                    self.buf.advance(n);
                    if head.status >= 200 {
                        self.framing = head.body_len(self.method).map_err(Error::upstream)?;
                        self.keep = head.keep_alive() && self.framing != BodyLen::UntilClose;
                        if let BodyLen::Length(n) = self.framing {
                            self.remaining = n;
                        }
                    }
                    // A fresh deadline for whatever head comes next.
                    self.head_deadline = pier_clock::tokio_deadline(self.read_timeout);
                    return Ok(());
                }
            }
            self.buf.reserve(READ_CHUNK);
            match tokio::time::timeout_at(self.head_deadline, self.r.read_buf(self.buf)).await {
                Ok(Ok(0)) | Ok(Err(_)) => {
                    let kind = if got_any {
                        Kind::UpstreamProtocol
                    } else {
                        Kind::UpstreamClosed
                    };
                    return Err(Error {
                        stale: self.reused && !got_any,
                        ..Error::upstream(kind)
                    });
                }
                Ok(Ok(_)) => got_any = true,
                Err(_) => return Err(Error::upstream(Kind::UpstreamTimeout)),
            }
        }
    }

    fn body_size(&self) -> BodySize {
        match self.framing {
            BodyLen::None => BodySize::None,
            BodyLen::Length(n) => BodySize::Length(n),
            BodyLen::Chunked | BodyLen::UntilClose => BodySize::Stream,
        }
    }

    async fn read_body(&mut self) -> Result<Option<(&[u8], bool)>, Error> {
        self.next().await.map_err(Error::answered)
    }

    fn trailers(&self) -> Option<&Headers> {
        (!self.trailers.is_empty()).then_some(&self.trailers)
    }

    fn reusable(&self) -> bool {
        self.done && self.keep && !self.eof && self.buf.len() == self.lent
    }
}

// === the client connection ===

/// One request's view of an HTTP/1 client connection: its stream, the bytes
/// read ahead (body, pipelined requests) and the output buffer.
pub struct H1Downstream<'a, S> {
    pub stream: &'a mut S,
    pub rbuf: &'a mut BytesMut,
    pub out: &'a mut Vec<u8>,
}

impl<S: Stream> Downstream for H1Downstream<'_, S> {
    type Source<'b>
        = H1RequestSource<'b, S::Read<'b>>
    where
        Self: 'b;
    type Sink<'b>
        = H1ResponseSink<'b, S::Write<'b>>
    where
        Self: 'b;

    /// Scan the chunked body bytes already buffered (and, with `wait`, read
    /// until the first size line is whole, within `limit`), so that a body
    /// whose framing is bad from the start is refused before anything
    /// reaches an origin. Nothing is consumed.
    async fn vet_body(&mut self, body: BodyLen, wait: bool, limit: Duration) -> Result<(), Kind> {
        if body != BodyLen::Chunked {
            return Ok(());
        }
        let mut sc = ChunkedScanner::new();
        let mut scanned = 0;
        let deadline = pier_clock::tokio_deadline(limit);
        loop {
            if self.rbuf.len() > scanned {
                scanned += sc.feed(&self.rbuf[scanned..])?;
            }
            if sc.is_done() || sc.past_first_size() || !wait {
                return Ok(());
            }
            // The first size line is bounded (16 digits + 4 KiB of extensions).
            self.rbuf.reserve(4096);
            match tokio::time::timeout_at(deadline, self.stream.read_buf(self.rbuf)).await {
                Ok(Ok(0)) | Ok(Err(_)) => return Err(Kind::ClientClosed),
                Ok(Ok(_)) => {}
                Err(_) => return Err(Kind::BodyTimeout),
            }
        }
    }

    fn open(&mut self, o: &DownstreamOpts) -> (Self::Source<'_>, Self::Sink<'_>) {
        let (r, w) = self.stream.split();
        (
            H1RequestSource::new(r, self.rbuf, o.body, o.max_body, o.idle, o.min_rate),
            H1ResponseSink::new(w, self.out, o.version, o.method, o.keep, o.idle, o.now_ns),
        )
    }

    async fn tunnel<R: AsyncRead + Unpin, W: AsyncWrite + Unpin>(
        &mut self,
        head: &ResponseHead,
        early: &[u8],
        ur: &mut R,
        uw: &mut W,
        idle: Duration,
    ) -> Result<u64, Error> {
        self.out.clear();
        write::response_head(self.out, head, |k| {
            matches!(k, known::KEEP_ALIVE | known::PROXY_CONNECTION)
        });
        self.out.extend_from_slice(b"\r\n");
        self.out.extend_from_slice(early);
        let sent = self.out.len() as u64;
        let (mut cr, mut cw) = self.stream.split();
        write_timed(&mut cw, self.out, idle)
            .await
            .map_err(|_| Error::answered(Kind::ClientClosed))?;
        self.out.clear();
        // What the client sent after its request head is the tunnel's first.
        if !self.rbuf.is_empty() {
            if uw.write_all(self.rbuf).await.is_ok() {
                let _ = uw.flush().await;
            }
            self.rbuf.clear();
        }
        pier_session::tunnel(&mut cr, &mut cw, ur, uw, idle).await;
        Ok(sent)
    }
}

/// An HTTP/1.1 connection to an origin, for one attempt: from the pool or
/// new (`upstream::connect`), back to the pool when the exchange leaves it
/// clean. The head and read buffers are the request's own (`driver::Work`).
pub struct H1Upstream<'b> {
    pub conn: pier_core::Conn,
    pub key: pier_core::PeerKey,
    pub reused: bool,
    pub pool: &'b pier_core::Pool,
    pub worker: usize,
    pub ubuf: &'b mut BytesMut,
    pub head: &'b mut Vec<u8>,
    pub limits: &'b HeadLimits,
    pub timeout: Duration,
}

impl pier_session::UpstreamSession for H1Upstream<'_> {
    type Source<'a>
        = H1ResponseSource<'a, <pier_core::Conn as Stream>::Read<'a>>
    where
        Self: 'a;
    type Sink<'a>
        = H1RequestSink<<pier_core::Conn as Stream>::Write<'a>>
    where
        Self: 'a;

    fn reused(&self) -> bool {
        self.reused
    }

    async fn send<'a>(
        &'a mut self,
        out: &impl UpstreamRequest,
    ) -> Result<(Self::Source<'a>, Self::Sink<'a>), Error> {
        write_request_head(self.head, out);
        let body = out.body();
        let method = out.head().method_kind();
        let (ur, mut uw) = self.conn.split();
        // Flushed (`write_timed` says why): a TLS origin that never gets
        // the whole head would never answer.
        if uw.write_all(self.head).await.is_err() || uw.flush().await.is_err() {
            return Err(Error {
                stale: self.reused,
                ..Error::upstream(Kind::UpstreamClosed)
            });
        }
        // A pooled connection that closes before answering died while idle;
        // retried once on a fresh one, but only when no body was consumed.
        let src = H1ResponseSource::new(
            ur,
            self.ubuf,
            self.limits,
            method,
            self.reused && body == BodyLen::None,
            self.timeout,
        );
        Ok((src, H1RequestSink::new(uw, body)))
    }

    fn release(self, reusable: bool) {
        if reusable {
            self.pool.put(&self.key, self.worker, self.conn);
        }
    }

    async fn tunnel<'a, D: Downstream>(
        mut src: Self::Source<'a>,
        mut snk: Self::Sink<'a>,
        down: &mut D,
        head: &ResponseHead,
        idle: Duration,
    ) -> Result<u64, Error>
    where
        Self: 'a,
    {
        // The 101 and whatever followed it, then bytes both ways.
        let early = src.take_early();
        down.tunnel(head, &early, &mut src.r, &mut snk.w, idle)
            .await
    }
}

/// The upstream request head as HTTP/1.1 text: what the engine's policy
/// ([`UpstreamRequest`]) says, and framing from the body that is sent, never
/// from what was received.
pub fn write_request_head(out: &mut Vec<u8>, o: &impl UpstreamRequest) {
    let req = o.head();
    out.clear();
    // The received head plus what Pier adds (framing, Host, X-Forwarded-*),
    // at once: growing it as it is written copied it twice a request.
    out.reserve(req.headers.arena().len() + 192);
    write::request_line(out, req.method(), req.uri());
    out.extend_from_slice(b"Host: ");
    match o.client_authority() {
        Some(h) => out.extend_from_slice(h),
        None => o.write_peer_authority(out),
    }
    out.extend_from_slice(b"\r\n");
    for (_, n, v) in o.fields() {
        write::header(out, n, v);
    }
    match o.body() {
        BodyLen::Length(n) => write::header_u64(out, b"Content-Length", n),
        BodyLen::Chunked => out.extend_from_slice(b"Transfer-Encoding: chunked\r\n"),
        BodyLen::None | BodyLen::UntilClose => {
            if o.says_empty() {
                out.extend_from_slice(b"Content-Length: 0\r\n");
            }
        }
    }
    o.forwarding(&mut HeadFields(out));
    if let Some(u) = o.upgrade() {
        write::header(out, b"Upgrade", u);
        out.extend_from_slice(b"Connection: upgrade\r\n");
    }
    out.extend_from_slice(b"\r\n");
}

/// Fields written straight into an HTTP/1 head.
struct HeadFields<'o>(&'o mut Vec<u8>);

impl pier_session::FieldWriter for HeadFields<'_> {
    fn field(&mut self, name: &'static [u8], value: &[u8]) {
        write::header(self.0, name, value);
    }
    fn composed(&mut self, name: &'static [u8], value: impl FnOnce(&mut Vec<u8>)) {
        self.0.extend_from_slice(name);
        self.0.extend_from_slice(b": ");
        value(self.0);
        self.0.extend_from_slice(b"\r\n");
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::pin::Pin;
    use std::task::{Context, Poll};

    /// A writer that holds what it is given until it is flushed, as
    /// tokio-rustls does with records the socket would not take.
    #[derive(Default)]
    struct Holding {
        held: Vec<u8>,
        sent: Vec<u8>,
    }

    impl AsyncWrite for Holding {
        fn poll_write(
            mut self: Pin<&mut Self>,
            _: &mut Context<'_>,
            buf: &[u8],
        ) -> Poll<std::io::Result<usize>> {
            self.held.extend_from_slice(buf);
            Poll::Ready(Ok(buf.len()))
        }
        fn poll_flush(mut self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<std::io::Result<()>> {
            let held = std::mem::take(&mut self.held);
            self.sent.extend_from_slice(&held);
            Poll::Ready(Ok(()))
        }
        fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
            self.poll_flush(cx)
        }
    }

    impl pier_core::RawSocket for Holding {}

    fn run<F: std::future::Future>(f: F) -> F::Output {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap()
            .block_on(f)
    }

    /// Every piece of a response is out of a buffering writer once its
    /// write returns: the head with a small body, large pieces, chunked
    /// pieces and the last chunk, and a 100 Continue (the client waits for
    /// it before it sends the body).
    #[test]
    fn response_pieces_are_flushed() {
        run(async {
            let t = Duration::from_secs(5);
            for (size, body_len) in [(BodySize::Length(70_000), 70_000), (BodySize::Stream, 0)] {
                let mut out = Vec::new();
                let mut sink =
                    H1ResponseSink::new(Holding::default(), &mut out, 1, Method::Get, true, t, 0);
                sink.write_interim(&ResponseHead::local(100)).await.unwrap();
                assert!(sink.w.held.is_empty() && sink.w.sent.starts_with(b"HTTP/1.1 100"));
                sink.write_head(&ResponseHead::local(200), size)
                    .await
                    .unwrap();
                sink.write_body(b"small").await.unwrap();
                assert!(sink.w.held.is_empty());
                sink.write_body(&vec![b'x'; 60_000]).await.unwrap();
                assert!(sink.w.held.is_empty());
                if body_len == 0 {
                    sink.write_body(&vec![b'y'; 9_995]).await.unwrap();
                }
                sink.finish(None).await.unwrap();
                assert!(sink.w.held.is_empty(), "{} bytes held", sink.w.held.len());
                let sent = String::from_utf8_lossy(&sink.w.sent).into_owned();
                assert!(sent.contains("HTTP/1.1 200"));
                if body_len == 0 {
                    assert!(sent.ends_with("0\r\n\r\n"), "the last chunk went out");
                }
            }
        });
    }

    /// The request head and body to an origin are out of a buffering
    /// writer (TLS to the origin) once written.
    #[test]
    fn request_pieces_are_flushed() {
        run(async {
            for framing in [BodyLen::Length(100_005), BodyLen::Chunked] {
                let mut sink = H1RequestSink::new(Holding::default(), framing);
                sink.write_body(&vec![b'x'; 100_000]).await.unwrap();
                assert!(sink.w.held.is_empty());
                sink.write_body(b"tail!").await.unwrap();
                sink.finish(None).await.unwrap();
                assert!(sink.w.held.is_empty());
            }
        });
    }
}
