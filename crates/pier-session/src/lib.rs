//! The session interfaces the driver is written against: the four halves of
//! an exchange, each independent of the wire protocol.
//!
//! ```text
//!   client ──► RequestSource ──► driver ──► RequestSink  ──► origin
//!   client ◄── ResponseSink  ◄── driver ◄── ResponseSource ◄── origin
//! ```
//!
//! Bodies cross as decoded bytes (framing is each side's own), heads as
//! `RequestHead`/`ResponseHead`. HTTP/1 implements them in pier-h1, HTTP/2
//! (both sides) in pier-h2; the engine (pier-proxy) adds a cache hit and its
//! own answers as more `ResponseSource`s. A new protocol is one more crate
//! implementing [`Downstream`] (and [`UpstreamSession`] towards origins),
//! with no edit to the engine's driver. Futures need not be `Send`
//! (thread-per-core).
#![allow(async_fn_in_trait)]

pub mod http_types;

use pier_error::{Error, Kind};
use pier_http::known::Known;
use pier_http::{BodyLen, Headers, Method, RequestHead, ResponseHead};
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

/// The protocol a client connection speaks: logs, metrics and Lua's
/// `ngx.var.server_protocol` read its name from here, so the engine names no
/// protocol itself.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Protocol {
    #[default]
    Http1,
    Http2,
    Http3,
}

impl Protocol {
    /// Every protocol, in `index` order.
    pub const ALL: [Protocol; 3] = [Protocol::Http1, Protocol::Http2, Protocol::Http3];
    /// The request's protocol as HTTP spells it (`minor`: HTTP/1's minor
    /// version).
    pub fn version(self, minor: u8) -> &'static str {
        match (self, minor) {
            (Protocol::Http1, 0) => "HTTP/1.0",
            (Protocol::Http1, _) => "HTTP/1.1",
            (Protocol::Http2, _) => "HTTP/2.0",
            (Protocol::Http3, _) => "HTTP/3.0",
        }
    }
    /// Its ALPN token (the `protocol` label of Pier's metrics).
    pub fn alpn(self) -> &'static str {
        match self {
            Protocol::Http1 => "http/1.1",
            Protocol::Http2 => "h2",
            Protocol::Http3 => "h3",
        }
    }
    pub fn index(self) -> usize {
        self as usize
    }
}

/// `Box::pin(make())`, with the future written straight into its box: a
/// future built first and then moved is copied whole (its full size, a few
/// KB for a request's, not just the arguments it starts with). For the
/// engine and the protocol crates, which hand requests' futures around.
#[inline(always)]
pub fn boxed_in_place<F: std::future::Future>(make: impl FnOnce() -> F) -> std::pin::Pin<Box<F>> {
    Box::into_pin(Box::write(Box::new_uninit(), make()))
}

/// How much body follows a response head, as far as the writer can tell.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BodySize {
    /// No body (HEAD, 204, 304, …).
    None,
    /// Exactly this many bytes.
    Length(u64),
    /// Unknown until it ends (chunked, close-delimited, or filtered).
    Stream,
}

/// A body that lies in a mapping of its own (a large cached object):
/// `bytes` are the mapping's bytes from `offset` (the writer splices its
/// pages where it can, else writes `bytes`).
pub struct SpliceBody {
    pub mapped: std::sync::Arc<pier_cache::MappedBody>,
    pub offset: u64,
    pub bytes: bytes::Bytes,
}

/// The client's request body, decoded.
pub trait RequestSource {
    /// The next piece of the body; `Ok(None)` at its end.
    async fn read_body(&mut self) -> Result<Option<&[u8]>, Error>;
    /// Trailer fields, once the body ended (where the protocol has them).
    fn trailers(&self) -> Option<&Headers>;
    /// Whether [`client_gone`](Self::client_gone) can tell (the driver pays
    /// for a watch only then).
    const WATCHES_GONE: bool = false;
    /// Resolves when the client is known gone (its connection closed) while
    /// a bodiless request waits on the origin; never where the source can't
    /// tell, or while a body is still to be read (its reads tell then).
    async fn client_gone(&mut self) {
        std::future::pending::<()>().await
    }
}

/// Where the request goes: the upstream connection's writer.
pub trait RequestSink {
    /// A piece of the request body (already decoded).
    async fn write_body(&mut self, data: &[u8]) -> Result<(), Error>;
    /// The body ended (trailers, when the protocol carries them).
    async fn finish(&mut self, trailers: Option<&Headers>) -> Result<(), Error>;
}

/// The origin's response (or a cache's, or Pier's own: `local::LocalSource`).
pub trait ResponseSource {
    /// The response comes from an origin (or a cache of one): the origin's
    /// steps run on it (`upstream_response_filter`, the cache store, its
    /// timing). False for Pier's own answers.
    const FROM_ORIGIN: bool = true;
    /// The next response head into `head`: interim (1xx) heads come first,
    /// each returned on its own.
    async fn read_head(&mut self, head: &mut ResponseHead) -> Result<(), Error>;
    /// The body's size as the origin framed it (after `read_head`).
    fn body_size(&self) -> BodySize;
    /// The next piece of the body, decoded, and whether it is known to be
    /// the last (the origin's slot can then be released before it is
    /// written); `Ok(None)` at the end.
    async fn read_body(&mut self) -> Result<Option<(&[u8], bool)>, Error>;
    /// Trailer fields, once the body ended.
    fn trailers(&self) -> Option<&Headers>;
    /// Whether the connection can carry another request (the body was read
    /// to its end and nothing followed it).
    fn reusable(&self) -> bool;
    /// The response was read from a store (a cache hit), not from the
    /// origin now: the steps that edit what an origin sent
    /// (`upstream_response_filter`, the cache-store step) ran when it was
    /// stored and do not run on it again.
    const STORED: bool = false;
    /// The origin's final head as `upstream_response_filter` and the
    /// cache-store step left it (before `response_filter`, which edits what
    /// this client gets), with the request it answers (whose values of the
    /// fields the response's Vary names select it): what a cache fill
    /// stores. Other sources ignore it.
    fn origin_head(&mut self, _head: &mut ResponseHead, _req: &pier_http::Headers) {}
    /// A phase's cache verdict on this response (after `response_filter`,
    /// before the head is written): a cache fill applies it to what it
    /// stores and to `head`'s Cache-Status. Other sources ignore it.
    fn cache_override(&mut self, _head: &mut ResponseHead, _ctl: &pier_cache::CacheCtl) {}
    /// What a cache fill turned into once the origin answered (its 304
    /// revalidated the stored object, or its 5xx was replaced by it); None
    /// for other sources.
    fn cache_result(&self) -> Option<pier_cache::CacheResult> {
        None
    }
    /// The whole body at once when it lies in a mapping (a cache hit
    /// on a large object); it then counts as read. None for other sources.
    fn take_spliceable(&mut self) -> Option<SpliceBody> {
        None
    }
}

/// A borrowed source is a source (wrappers such as the cache's tee take one).
impl<S: ResponseSource> ResponseSource for &mut S {
    const FROM_ORIGIN: bool = S::FROM_ORIGIN;
    const STORED: bool = S::STORED;
    fn origin_head(&mut self, head: &mut ResponseHead, req: &pier_http::Headers) {
        (**self).origin_head(head, req)
    }
    async fn read_head(&mut self, head: &mut ResponseHead) -> Result<(), Error> {
        (**self).read_head(head).await
    }
    fn body_size(&self) -> BodySize {
        (**self).body_size()
    }
    async fn read_body(&mut self) -> Result<Option<(&[u8], bool)>, Error> {
        (**self).read_body().await
    }
    fn trailers(&self) -> Option<&Headers> {
        (**self).trailers()
    }
    fn reusable(&self) -> bool {
        (**self).reusable()
    }
    fn cache_override(&mut self, head: &mut ResponseHead, ctl: &pier_cache::CacheCtl) {
        (**self).cache_override(head, ctl)
    }
    fn cache_result(&self) -> Option<pier_cache::CacheResult> {
        (**self).cache_result()
    }
    fn take_spliceable(&mut self) -> Option<SpliceBody> {
        (**self).take_spliceable()
    }
}

/// Where the response goes: the client connection's writer.
pub trait ResponseSink {
    /// An interim (1xx) response; dropped where the client can't take one.
    async fn write_interim(&mut self, head: &ResponseHead) -> Result<(), Error>;
    /// The final head. The writer frames the body from `size`; a head may
    /// wait to go out with the first body bytes (one write).
    async fn write_head(&mut self, head: &ResponseHead, size: BodySize) -> Result<(), Error>;
    async fn write_body(&mut self, data: &[u8]) -> Result<(), Error>;
    /// A body in a mapping: where the writer can, its pages go to the
    /// socket as they are (HTTP/1 over plain TCP: `vmsplice` + `splice`);
    /// otherwise its bytes are written as `write_body` writes them.
    async fn write_spliced(&mut self, body: &SpliceBody) -> Result<(), Error> {
        self.write_body(&body.bytes).await
    }
    /// The response ended; trailers where the protocol carries them.
    async fn finish(&mut self, trailers: Option<&Headers>) -> Result<(), Error>;
    /// Whether the client connection can take another request afterwards.
    fn keep_alive(&self) -> bool;
    /// Bytes written to the client so far (access log).
    fn bytes_sent(&self) -> u64;
    /// Whether [`client_gone`](Self::client_gone) can tell.
    const WATCHES_GONE: bool = false;
    /// Resolves when the client is known gone (HTTP/2: the stream reset,
    /// or the connection closed) before the response head went; never
    /// where the sink can't tell.
    async fn client_gone(&mut self) {
        std::future::pending::<()>().await
    }
}

/// What the downstream needs to know of the request it serves.
#[derive(Debug, Clone, Copy)]
pub struct DownstreamOpts {
    /// The client's HTTP minor version (HTTP/1: 0 or 1).
    pub version: u8,
    /// The client's method (a HEAD response has no body).
    pub method: Method,
    /// The client may keep the connection after this response.
    pub keep: bool,
    /// The request body's framing as the client sent it.
    pub body: BodyLen,
    /// Largest request body (0: unlimited).
    pub max_body: u64,
    /// Per-read idle time of the request body and per-write time of the
    /// response.
    pub idle: Duration,
    /// Minimum average request body rate after a grace period (0: off).
    pub min_rate: u64,
    /// The request's clock (Date headers).
    pub now_ns: u64,
}

/// What the two halves of a multiplexed stream (HTTP/2, HTTP/3) keep of
/// [`DownstreamOpts`]: each half holds a copy.
#[derive(Debug, Clone, Copy)]
pub struct StreamOpts {
    /// Largest request body (0: unlimited).
    pub max_body: u64,
    /// Per-read idle time of the request body, per-write time of the response.
    pub idle: Duration,
    /// The request's clock (Date headers).
    pub now_ns: u64,
    /// A HEAD request: the response goes without its body.
    pub head_only: bool,
}

impl StreamOpts {
    /// Before the request is opened: `idle` only.
    pub fn new(idle: Duration) -> StreamOpts {
        StreamOpts {
            max_body: 0,
            idle,
            now_ns: 0,
            head_only: false,
        }
    }
}

impl From<&DownstreamOpts> for StreamOpts {
    fn from(o: &DownstreamOpts) -> StreamOpts {
        StreamOpts {
            max_body: o.max_body,
            idle: o.idle,
            now_ns: o.now_ns,
            head_only: o.method == Method::Head,
        }
    }
}

/// The client side of one request, whatever its protocol: the driver's
/// whole view of it (HTTP/1 implements it in `h1`; an HTTP/2 stream is one
/// more implementation).
pub trait Downstream {
    type Source<'a>: RequestSource
    where
        Self: 'a;
    type Sink<'a>: ResponseSink
    where
        Self: 'a;
    /// Check the request body's framing before anything goes upstream
    /// (HTTP/1: the first chunk of a chunked body); `wait` reads more when
    /// needed, within `limit`.
    async fn vet_body(&mut self, body: BodyLen, wait: bool, limit: Duration) -> Result<(), Kind>;
    /// This request's body source and response sink.
    fn open(&mut self, opts: &DownstreamOpts) -> (Self::Source<'_>, Self::Sink<'_>);
    /// Switch protocols (an HTTP/1 Upgrade such as WebSocket): send `head`
    /// and the origin's `early` bytes, then carry bytes both ways between
    /// the client and the origin's `ur`/`uw` until either side closes or
    /// nothing moves for `idle`. Returns the bytes of the head sent.
    async fn tunnel<R: AsyncRead + Unpin, W: AsyncWrite + Unpin>(
        &mut self,
        head: &ResponseHead,
        early: &[u8],
        ur: &mut R,
        uw: &mut W,
        idle: Duration,
    ) -> Result<u64, Error>;
    /// Where the engine keeps a rarer step's large future (a cache fill's
    /// exchange, a tunnel): in place by default, for a downstream whose
    /// request futures live in one box per connection already (HTTP/1);
    /// boxed by the multiplexed ones, whose every stream allocates and
    /// copies its request's whole future, so that the common path's future
    /// is the size of the common path (an HTTP/2 stream's was 7,688 bytes,
    /// a cache fill's variant the largest).
    fn hold<F: std::future::Future>(f: F) -> impl std::future::Future<Output = F::Output> {
        f
    }
}

/// The origin side of one attempt, whatever its protocol: an HTTP/1
/// connection (pooled or new) or a stream on a shared HTTP/2 connection.
/// The connector (`upstream::connect`) makes one for a peer; the driver's
/// one attempt function drives it and gives it back. A new upstream
/// protocol is one more implementation.
pub trait UpstreamSession {
    type Source<'a>: ResponseSource
    where
        Self: 'a;
    type Sink<'a>: RequestSink
    where
        Self: 'a;
    /// It came from a pool: an idle HTTP/1 connection (which may have died
    /// while idle), or an HTTP/2 connection already open.
    fn reused(&self) -> bool;
    /// Send the request head as policy made it; then the response's source
    /// and the request body's sink (left unused for a bodiless request).
    async fn send<'a>(
        &'a mut self,
        out: &impl UpstreamRequest,
    ) -> Result<(Self::Source<'a>, Self::Sink<'a>), Error>;
    /// After the exchange: the connection goes back to its pool when it can
    /// carry another request (`reusable`: the response was read cleanly).
    fn release(self, reusable: bool);
    /// The origin switched protocols (101) for an allowed Upgrade: carry
    /// bytes both ways through `down` (which sends `head` first). Returns
    /// the bytes of the head sent. Protocols without upgrades refuse.
    async fn tunnel<'a, D: Downstream>(
        _src: Self::Source<'a>,
        _snk: Self::Sink<'a>,
        _down: &mut D,
        _head: &ResponseHead,
        _idle: Duration,
    ) -> Result<u64, Error>
    where
        Self: 'a,
    {
        Err(Error::upstream(Kind::UpstreamProtocol))
    }
}

/// The upstream request as the engine's policy decided it, for one attempt
/// (pier-proxy's `forward::Outgoing`): which received fields go, the
/// authority, the engine's forwarding fields and the body's framing. A codec
/// writes the method, the target, then [`fields`](Self::fields), the
/// authority (its Host or `:authority`), [`forwarding`](Self::forwarding)
/// and its own framing from [`body`](Self::body), and decides nothing
/// itself: no protocol has a hop-by-hop list or a Host rule of its own.
pub trait UpstreamRequest {
    /// The request as it goes (routed, rewritten, hooks applied).
    fn head(&self) -> &RequestHead;
    /// The request as the client sent it (deadlines it stated, such as
    /// `grpc-timeout`).
    fn client_head(&self) -> &RequestHead;
    /// Whether a received field goes as it is.
    fn keeps(&self, k: Known, name: &[u8]) -> bool;
    /// The received fields that go, in order.
    fn fields(&self) -> impl Iterator<Item = (Known, &[u8], &[u8])> + '_ {
        self.head()
            .headers
            .iter_known()
            .filter(|(k, n, _)| self.keeps(*k, n))
    }
    /// The authority when it is the client's (its Host); None: the peer's,
    /// written by [`write_peer_authority`](Self::write_peer_authority).
    fn client_authority(&self) -> Option<&[u8]>;
    /// The peer's authority (its configured name and port, or its address).
    fn write_peer_authority(&self, out: &mut Vec<u8>);
    /// The body as it goes, which the codec's framing states.
    fn body(&self) -> BodyLen;
    /// A bodiless request that still says `Content-Length: 0`.
    fn says_empty(&self) -> bool;
    /// The Upgrade to ask for (an allowed one), if any.
    fn upgrade(&self) -> Option<&[u8]>;
    /// The engine's forwarding fields (X-Forwarded-*, Forwarded) into `w`.
    fn forwarding(&self, w: &mut impl FieldWriter);
}

/// Where a codec takes the fields the engine writes.
pub trait FieldWriter {
    fn field(&mut self, name: &'static [u8], value: &[u8]);
    /// A field whose value the engine composes: `value` appends it to the
    /// buffer given (HTTP/1 composes it in the head itself).
    fn composed(&mut self, name: &'static [u8], value: impl FnOnce(&mut Vec<u8>));
}

/// A request head as a multiplexed protocol receives it (an HTTP/2 or
/// HTTP/3 stream): pseudo-headers and a field list, never HTTP/1 text. The
/// engine makes its one request head of it by the HTTP/1 parser's rules
/// (`RequestHead::from_parts`).
pub trait RequestParts {
    fn method(&self) -> &[u8];
    /// `:path` (origin form; `/` when it was empty).
    fn target(&self) -> &[u8];
    /// `:authority`, the request's Host.
    fn authority(&self) -> Option<&[u8]>;
    /// The fields, as received.
    fn fields(&self) -> impl Iterator<Item = (&[u8], &[u8])>;
    /// A body follows the head (the stream did not end with it).
    fn has_body(&self) -> bool;
    /// Refused by the protocol before the engine sees it (a form the
    /// engine does not carry, such as an extended CONNECT).
    fn refused(&self) -> Option<Kind> {
        None
    }
}

/// The engine as a multiplexed protocol's connection sees it (pier-proxy
/// implements it per connection): the worker's connection bookkeeping, and
/// where each stream's request goes. A protocol crate's connection loop
/// (pier-h2's `server::serve`, and HTTP/3's next) accepts streams and hands
/// each to [`serve_stream`](Self::serve_stream), on a task of its own.
pub trait Engine: Clone + 'static {
    /// The worker's registry of connections waiting for a request:
    /// evictable when the worker is full, and evicted by a drain.
    fn waiting(&self) -> &std::cell::RefCell<pier_core::evict::Registry>;
    /// The worker's clock, in the registry's milliseconds.
    fn now_ms(&self) -> u64;
    /// Turns true when the worker drains (reload, shutdown): say GOAWAY.
    fn drain(&self) -> tokio::sync::watch::Receiver<bool>;
    /// A connection was closed after its GOAWAY grace ran out (counted).
    fn goaway_timeout(&self);
    /// One stream's request: its head from `parts` (or the answer to its
    /// [`refused`](RequestParts::refused)), through the engine's steps, its
    /// response written to `down`.
    fn serve_stream<D, H>(
        self,
        down: D,
        parts: H,
    ) -> impl std::future::Future<Output = ()> + 'static
    where
        D: Downstream + 'static,
        H: RequestParts + 'static;
}

/// Copy both ways until either side closes (its write side is then shut
/// down) and the other finishes, or until nothing moved either way for
/// `idle`. A drain does not cut tunnels; the end of its grace period does
/// (the process exits).
pub async fn tunnel<CR, CW, UR, UW>(
    cr: &mut CR,
    cw: &mut CW,
    ur: &mut UR,
    uw: &mut UW,
    idle: Duration,
) where
    CR: AsyncRead + Unpin,
    CW: AsyncWrite + Unpin,
    UR: AsyncRead + Unpin,
    UW: AsyncWrite + Unpin,
{
    let last = std::cell::Cell::new(tokio::time::Instant::now());
    async fn pump<R: AsyncRead + Unpin, W: AsyncWrite + Unpin>(
        r: &mut R,
        w: &mut W,
        last: &std::cell::Cell<tokio::time::Instant>,
    ) {
        let mut buf = vec![0u8; 16 * 1024];
        loop {
            match r.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => {
                    last.set(tokio::time::Instant::now());
                    // Flushed: a writer that buffers (an HTTP/3 stream's,
                    // TLS) sends now, not with the next piece.
                    if w.write_all(&buf[..n]).await.is_err() || w.flush().await.is_err() {
                        break;
                    }
                }
            }
        }
        let _ = w.shutdown().await;
    }
    let both = async {
        tokio::join!(pump(cr, uw, &last), pump(ur, cw, &last));
    };
    let watchdog = async {
        loop {
            let deadline = last.get() + idle;
            tokio::time::sleep_until(deadline).await;
            if last.get() + idle <= tokio::time::Instant::now() {
                return;
            }
        }
    };
    tokio::select! {
        _ = both => {}
        _ = watchdog => {}
    }
}
