//! HTTP/2 to origins: multiplexed connections, each worker's own (a new one
//! only when each of the worker's open ones carries `h2_max_streams`), and
//! the upstream halves of the session interfaces over an h2 stream.
//!
//! A connection's I/O task runs on the worker that opened it, and only that
//! worker's requests use it, as nginx's and HAProxy's do: a stream and its
//! connection's task wake each other on one thread, and h2's lock on the
//! connection's state stays in one core's cache. Shared by every worker, a
//! gRPC call woke the other worker twice (its frames out, the answer back)
//! and the lock went between the cores for every frame.

use bytes::Bytes;
use pier_core::{Connector, PeerKey};
use pier_error::{Error, Kind};
use pier_http::known;
use pier_http::{Headers, ResponseHead};
use pier_session::{BodySize, FieldWriter, RequestSink, ResponseSource, UpstreamRequest};
use std::future::poll_fn;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::time::Duration;

struct Conn {
    send: h2::client::SendRequest<Bytes>,
    /// Streams in flight on it (leases).
    open: AtomicUsize,
    /// Its I/O task ended: take no new streams.
    closed: Arc<AtomicBool>,
}

/// Every worker's HTTP/2 upstream connections, by peer.
/// The pool's maps are looked up at every request (`room`): foldhash, not
/// SipHash (~500 instructions a gRPC call), as pier-core's pool does, and
/// for the same reason: keys are the configured origins, not chosen by
/// clients.
type HashMap<K, V> = std::collections::HashMap<K, V, foldhash::fast::RandomState>;

pub struct H2Pool {
    /// By worker (modulo [`SHARDS`]), then by peer.
    conns: [Shard; SHARDS],
    /// `protocol = "auto"`: what each peer (keyed with `Alpn::H2`) chose by
    /// ALPN the last time a connection was opened to it (`true` = h2).
    chosen: Mutex<HashMap<PeerKey, bool>>,
    /// One connect at a time per peer: requests that find every connection
    /// full while one is being opened wait for it instead of each opening
    /// their own (a burst of streams at start-up would open one apiece).
    dialing: Mutex<HashMap<(usize, PeerKey), Gate>>,
}

/// A (shard, peer)'s turn to open a connection.
type Gate = Arc<tokio::sync::Mutex<()>>;

/// Workers past this many share the shards (each still finds room on a
/// connection of its shard; only the thread the I/O runs on may differ).
const SHARDS: usize = 64;

/// One worker's connections, on a cache line of its own.
#[derive(Default)]
#[repr(align(128))]
struct Shard(Mutex<HashMap<PeerKey, Vec<Arc<Conn>>>>);

impl Default for H2Pool {
    fn default() -> Self {
        H2Pool {
            conns: std::array::from_fn(|_| Shard::default()),
            chosen: Default::default(),
            dialing: Default::default(),
        }
    }
}

/// Peers whose ALPN choice is remembered; past it the memory starts over
/// (peers come from config and DNS, so this is only a bound).
const MAX_REMEMBERED: usize = 4096;

/// A stream slot on a connection, given back when dropped.
pub struct Lease {
    conn: Arc<Conn>,
}

impl Drop for Lease {
    fn drop(&mut self) {
        self.conn.open.fetch_sub(1, Relaxed);
    }
}

/// What [`H2Pool::lease`] got: a stream slot, or (`auto` only) a new
/// connection on which the server chose HTTP/1.1.
pub enum Leased {
    /// The slot and whether its connection was already open.
    H2(Lease, bool),
    Http1(pier_core::Conn),
}

impl H2Pool {
    /// A stream slot to `key`: on an open connection with room, else on a
    /// new one. With `auto`, a new TLS connection on which the server did
    /// not choose h2 is handed back for HTTP/1.1, and the choice is
    /// remembered (see [`H2Pool::chose_h2`]).
    #[allow(clippy::too_many_arguments)]
    pub async fn lease(
        &self,
        worker: usize,
        key: &PeerKey,
        connector: &Connector,
        limit: Duration,
        tls: Option<&pier_core::stream::ClientConfig>,
        max_streams: usize,
        auto: bool,
    ) -> Result<Leased, std::io::Error> {
        let shard = &self.conns[worker % SHARDS].0;
        if let Some(l) = room(shard, key, max_streams) {
            return Ok(Leased::H2(l, true));
        }
        // A peer known (or about to be found) to speak HTTP/1.1 gets its
        // connections side by side, as the HTTP/1 pool would.
        let serial = !auto || self.chose_h2(key) == Some(true);
        let gate = serial.then(|| {
            let mut map = self.dialing.lock().unwrap_or_else(|e| e.into_inner());
            let k = (worker % SHARDS, key.clone());
            if map.len() >= MAX_REMEMBERED && !map.contains_key(&k) {
                map.retain(|_, g| Arc::strong_count(g) > 1);
            }
            map.entry(k).or_default().clone()
        });
        let _turn = match &gate {
            Some(g) => Some(
                pier_clock::timeout(limit, g.lock())
                    .await
                    .map_err(|_| std::io::Error::from(std::io::ErrorKind::TimedOut))?,
            ),
            None => None,
        };
        if gate.is_some() {
            // Opened while this one waited?
            if let Some(l) = room(shard, key, max_streams) {
                return Ok(Leased::H2(l, true));
            }
        }
        let io = connector.connect(key, limit, tls).await?;
        if let pier_core::Conn::Tls(t) = &io {
            let h2 = t.get_ref().1.alpn_protocol() == Some(b"h2");
            if auto {
                self.remember(key, h2);
                if !h2 {
                    return Ok(Leased::Http1(io));
                }
            } else if !h2 {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::InvalidData,
                    "the origin did not agree to h2 by ALPN",
                ));
            }
        }
        // Request heads go with HPACK's static table only (no dynamic
        // table kept per origin connection), as nginx's grpc_pass sends
        // them: CPU over header bytes on the origin's link.
        let handshake = h2::client::Builder::new()
            .hpack_dynamic_table(false)
            .handshake(io);
        let (send, conn) = pier_clock::timeout(limit, handshake)
            .await
            .map_err(|_| std::io::Error::from(std::io::ErrorKind::TimedOut))?
            .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidData, e))?;
        let closed = Arc::new(AtomicBool::new(false));
        let flag = closed.clone();
        tokio::task::spawn_local(async move {
            let _ = conn.await;
            flag.store(true, Relaxed);
        });
        let c = Arc::new(Conn {
            send,
            open: AtomicUsize::new(1),
            closed,
        });
        let mut map = shard.lock().unwrap_or_else(|e| e.into_inner());
        map.entry(key.clone()).or_default().push(c.clone());
        Ok(Leased::H2(Lease { conn: c }, false))
    }

    /// `protocol = "auto"`: whether `key`'s server chose h2 the last time
    /// (None: not asked yet, or forgotten).
    pub fn chose_h2(&self, key: &PeerKey) -> Option<bool> {
        let map = self.chosen.lock().unwrap_or_else(|e| e.into_inner());
        map.get(key).copied()
    }

    fn remember(&self, key: &PeerKey, h2: bool) {
        let mut map = self.chosen.lock().unwrap_or_else(|e| e.into_inner());
        if map.len() >= MAX_REMEMBERED && !map.contains_key(key) {
            map.clear();
        }
        map.insert(key.clone(), h2);
    }

    /// Open HTTP/2 connections (metrics).
    pub fn connections(&self) -> usize {
        self.conns
            .iter()
            .map(|s| {
                let map = s.0.lock().unwrap_or_else(|e| e.into_inner());
                map.values()
                    .flatten()
                    .filter(|c| !c.closed.load(Relaxed))
                    .count()
            })
            .sum()
    }
}

/// A stream slot on an open connection of the shard with room.
fn room(
    shard: &Mutex<HashMap<PeerKey, Vec<Arc<Conn>>>>,
    key: &PeerKey,
    max_streams: usize,
) -> Option<Lease> {
    let mut map = shard.lock().unwrap_or_else(|e| e.into_inner());
    let list = map.get_mut(key)?;
    list.retain(|c| !c.closed.load(Relaxed));
    let c = list.iter().find(|c| c.open.load(Relaxed) < max_streams)?;
    c.open.fetch_add(1, Relaxed);
    Some(Lease { conn: c.clone() })
}

/// Send the request head on a leased connection: the response to come and
/// the request body's sink.
pub async fn send_request(
    lease: &Lease,
    req: http::Request<()>,
    end_of_stream: bool,
    limit: Duration,
) -> Result<(h2::client::ResponseFuture, h2::SendStream<Bytes>), Error> {
    let ready = pier_clock::timeout(limit, lease.conn.send.clone().ready()).await;
    let mut send = match ready {
        Ok(Ok(s)) => s,
        Ok(Err(_)) => {
            lease.conn.closed.store(true, Relaxed);
            return Err(Error::upstream(Kind::UpstreamClosed));
        }
        Err(_) => return Err(Error::upstream(Kind::UpstreamTimeout)),
    };
    send.send_request(req, end_of_stream).map_err(|_| {
        lease.conn.closed.store(true, Relaxed);
        Error::upstream(Kind::UpstreamClosed)
    })
}

/// The origin's response on an h2 stream.
pub struct H2ResponseSource {
    fut: Option<h2::client::ResponseFuture>,
    recv: Option<h2::RecvStream>,
    buf: Bytes,
    trailers: Option<Headers>,
    size: BodySize,
    timeout: Duration,
    /// When the wait for the head ends: for gRPC, the call's deadline.
    deadline: tokio::time::Instant,
    done: bool,
    head_only: bool,
}

impl H2ResponseSource {
    pub fn new(fut: h2::client::ResponseFuture, timeout: Duration, head_only: bool) -> Self {
        H2ResponseSource {
            fut: Some(fut),
            recv: None,
            buf: Bytes::new(),
            trailers: None,
            size: BodySize::Stream,
            timeout,
            // The worker's last clock read, no read of its own; saturating.
            deadline: pier_clock::tokio_deadline(timeout),
            done: false,
            head_only,
        }
    }

    /// What an origin's reset means. An origin that enforces the same
    /// deadline (grpc-go resets with CANCEL when a call's `grpc-timeout`
    /// passes) received the call after Pier did, so its reset comes at or
    /// after Pier's deadline, possibly before Pier's own timer (millisecond
    /// granularity) fires: that is a timeout (504, DEADLINE_EXCEEDED), not a
    /// broken origin (502, UNAVAILABLE).
    fn reset_kind(&self, e: &h2::Error) -> Kind {
        reset_kind(e.reason(), self.deadline, tokio::time::Instant::now())
    }
}

fn reset_kind(
    reason: Option<h2::Reason>,
    deadline: tokio::time::Instant,
    now: tokio::time::Instant,
) -> Kind {
    if reason == Some(h2::Reason::CANCEL) && now >= deadline {
        Kind::UpstreamTimeout
    } else {
        Kind::UpstreamClosed
    }
}

impl ResponseSource for H2ResponseSource {
    async fn read_head(&mut self, head: &mut ResponseHead) -> Result<(), Error> {
        let Some(fut) = self.fut.take() else {
            return Err(Error::new(Kind::UpstreamProtocol));
        };
        let resp = match tokio::time::timeout_at(self.deadline, fut).await {
            Err(_) => return Err(Error::new(Kind::UpstreamTimeout)),
            // A stream refused before any processing may go elsewhere.
            Ok(Err(e)) if e.reason() == Some(h2::Reason::REFUSED_STREAM) => {
                return Err(Error::upstream(Kind::UpstreamClosed))
            }
            Ok(Err(e)) => return Err(Error::new(self.reset_kind(&e))),
            Ok(Ok(r)) => r,
        };
        let (parts, recv) = resp.into_parts();
        head.headers.clear();
        head.set_status(parts.status.as_u16());
        head.version = 1;
        pier_session::http_types::to_headers(&parts.headers, &mut head.headers);
        self.size = if self.head_only || recv.is_end_stream() {
            self.done = recv.is_end_stream();
            // A gRPC trailers-only answer must reach an HTTP/2 client as
            // one HEADERS frame that ends the stream.
            if self.head_only || parts.headers.contains_key("grpc-status") {
                BodySize::None
            } else {
                BodySize::Length(0)
            }
        } else {
            match parts
                .headers
                .get(http::header::CONTENT_LENGTH)
                .and_then(|v| v.to_str().ok())
                .and_then(|v| v.parse::<u64>().ok())
            {
                Some(n) => BodySize::Length(n),
                None => BodySize::Stream,
            }
        };
        self.recv = Some(recv);
        Ok(())
    }

    fn body_size(&self) -> BodySize {
        self.size
    }

    async fn read_body(&mut self) -> Result<Option<(&[u8], bool)>, Error> {
        let Some(recv) = self.recv.as_mut() else {
            return Ok(None);
        };
        if self.done {
            return Ok(None);
        }
        match pier_clock::timeout(self.timeout, recv.data()).await {
            Err(_) => Err(Error::answered(Kind::UpstreamTimeout)),
            Ok(Some(Err(e))) => Err(Error::answered(self.reset_kind(&e))),
            Ok(Some(Ok(data))) => {
                let _ = recv.flow_control().release_capacity(data.len());
                let last = recv.is_end_stream();
                self.buf = data;
                Ok(Some((&self.buf[..], last)))
            }
            Ok(None) => {
                self.done = true;
                if let Ok(Ok(Some(t))) = pier_clock::timeout(self.timeout, recv.trailers()).await {
                    let mut h = Headers::default();
                    pier_session::http_types::to_headers(&t, &mut h);
                    self.trailers = Some(h);
                }
                Ok(None)
            }
        }
    }

    fn trailers(&self) -> Option<&Headers> {
        self.trailers.as_ref()
    }

    fn reusable(&self) -> bool {
        // The connection is multiplexed; the stream ends with the lease.
        true
    }
}

/// The request body on an h2 stream, paced by the origin's window.
pub struct H2RequestSink {
    send: h2::SendStream<Bytes>,
    timeout: Duration,
    /// The origin answered and reset the stream with NO_ERROR: the rest of
    /// the body is dropped, the response stands.
    stopped: bool,
}

impl H2RequestSink {
    pub fn new(send: h2::SendStream<Bytes>, timeout: Duration) -> Self {
        H2RequestSink {
            send,
            timeout,
            stopped: false,
        }
    }

    /// A failed send: an origin that answered before the whole request came
    /// may reset the stream with NO_ERROR to stop the body (RFC 9113 §8.1;
    /// grpc-go does for an unknown method); clients must keep the response.
    /// Any other reset or error fails the exchange.
    fn failed(&mut self) -> Result<(), Error> {
        let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
        match self.send.poll_reset(&mut cx) {
            std::task::Poll::Ready(Ok(h2::Reason::NO_ERROR)) => {
                self.stopped = true;
                Ok(())
            }
            _ => Err(Error::new(Kind::UpstreamClosed)),
        }
    }
}

impl RequestSink for H2RequestSink {
    async fn write_body(&mut self, data: &[u8]) -> Result<(), Error> {
        if self.stopped {
            return Ok(());
        }
        let mut data = Bytes::copy_from_slice(data);
        while !data.is_empty() {
            self.send.reserve_capacity(data.len());
            let cap =
                pier_clock::timeout(self.timeout, poll_fn(|cx| self.send.poll_capacity(cx))).await;
            let n = match cap {
                Ok(Some(Ok(n))) => n.min(data.len()),
                Err(_) => return Err(Error::new(Kind::UpstreamTimeout)),
                _ => return self.failed(),
            };
            if n == 0 {
                continue;
            }
            if self.send.send_data(data.split_to(n), false).is_err() {
                return self.failed();
            }
        }
        Ok(())
    }

    async fn finish(&mut self, trailers: Option<&Headers>) -> Result<(), Error> {
        if self.stopped {
            return Ok(());
        }
        let map = pier_session::http_types::trailer_map(trailers);
        let r = if map.is_empty() {
            self.send.send_data(Bytes::new(), true)
        } else {
            self.send.send_trailers(map)
        };
        match r {
            Ok(()) => Ok(()),
            Err(_) => self.failed(),
        }
    }
}

/// A stream on a shared HTTP/2 connection to an origin, for one attempt
/// (the engine's connector); its slot is given back when it is dropped.
pub struct H2Upstream {
    pub lease: Lease,
    pub reused: bool,
    pub tls: bool,
    pub timeout: Duration,
}

impl pier_session::UpstreamSession for H2Upstream {
    type Source<'a> = H2ResponseSource;
    type Sink<'a> = H2RequestSink;

    fn reused(&self) -> bool {
        self.reused
    }

    async fn send(
        &mut self,
        out: &impl UpstreamRequest,
    ) -> Result<(H2ResponseSource, H2RequestSink), Error> {
        let req = request(out, self.tls)?;
        let bodiless = out.body() == pier_http::BodyLen::None;
        let head_only = out.head().method_kind() == pier_http::Method::Head;
        let (fut, send) = send_request(&self.lease, req, bodiless, self.timeout).await?;
        // For gRPC, the call's deadline bounds the wait for the head.
        let wait = pier_grpc::timeout(out.client_head(), self.timeout);
        Ok((
            H2ResponseSource::new(fut, wait, head_only),
            H2RequestSink::new(send, self.timeout),
        ))
    }

    fn release(self, _reusable: bool) {
        // The connection is shared; this stream's slot goes with the lease.
    }
}

/// The upstream request as an HTTP/2 request: what the engine's [`UpstreamRequest`] says, with
/// its authority as `:authority`, `te: trailers` kept (gRPC needs it), and
/// `content-length` from the body that is sent.
pub fn request(o: &impl UpstreamRequest, tls: bool) -> Result<http::Request<()>, Error> {
    let req = o.head();
    fn bad<E>(_: E) -> Error {
        Error::new(Kind::InvalidHeader)
    }
    // Built from parts (no text URI to format and parse again).
    let authority = match o.client_authority() {
        Some(h) => http::uri::Authority::from_maybe_shared(Bytes::copy_from_slice(h)),
        None => {
            let mut a = Vec::with_capacity(48);
            o.write_peer_authority(&mut a);
            http::uri::Authority::from_maybe_shared(Bytes::from(a))
        }
    }
    .map_err(|_| Error::new(Kind::InvalidHost))?;
    let mut parts = http::uri::Parts::default();
    parts.scheme = Some(if tls {
        http::uri::Scheme::HTTPS
    } else {
        http::uri::Scheme::HTTP
    });
    parts.authority = Some(authority);
    parts.path_and_query = Some(
        http::uri::PathAndQuery::from_maybe_shared(Bytes::copy_from_slice(req.uri()))
            .map_err(|_| Error::new(Kind::InvalidRequestLine))?,
    );
    let uri = http::Uri::from_parts(parts).map_err(|_| Error::new(Kind::InvalidRequestLine))?;
    let mut r = http::Request::builder()
        .method(
            http::Method::from_bytes(req.method())
                .map_err(|_| Error::new(Kind::InvalidRequestLine))?,
        )
        .uri(uri)
        .version(http::Version::HTTP_2)
        .body(())
        .map_err(|_| Error::new(Kind::InvalidHost))?;
    let h = r.headers_mut();
    // Room for the received fields and the ones added below (TE,
    // Content-Length, the forwarding fields): one allocation, not a
    // growth when the forwarding fields come.
    h.reserve(req.headers.len() + 6);
    // A field the `http` crate refuses fails the request, as it did when
    // fields were converted one by one (pier-http's parser lets few by).
    if !pier_session::http_types::http_fields(&req.headers, |k, n| !o.keeps(k, n), h) {
        return Err(bad(()));
    }
    if req.headers.has_token(known::TE, b"trailers") {
        h.insert(http::header::TE, http::HeaderValue::from_static("trailers"));
    }
    if let pier_http::BodyLen::Length(n) = o.body() {
        h.insert(http::header::CONTENT_LENGTH, http::HeaderValue::from(n));
    }
    let mut fields = MapFields { map: h, ok: true };
    o.forwarding(&mut fields);
    if !fields.ok {
        return Err(bad(()));
    }
    Ok(r)
}

/// Pier's fields into an `http` header map.
struct MapFields<'m> {
    map: &'m mut http::HeaderMap,
    ok: bool,
}

impl FieldWriter for MapFields<'_> {
    fn field(&mut self, name: &'static [u8], value: &[u8]) {
        match (
            pier_session::http_types::header_name(known::lookup(name), name),
            http::HeaderValue::from_bytes(value),
        ) {
            (Ok(n), Ok(v)) => {
                self.map.insert(n, v);
            }
            _ => self.ok = false,
        }
    }
    fn composed(&mut self, name: &'static [u8], value: impl FnOnce(&mut Vec<u8>)) {
        let mut v = Vec::with_capacity(64);
        value(&mut v);
        self.field(name, &v);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use h2::Reason;

    /// A worker's requests go on its own connections: reused by it, never
    /// by another worker, which opens its own (and a new one when its are
    /// full, though another worker's has room).
    #[test]
    fn each_worker_has_its_own_connections() {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        tokio::task::LocalSet::new().block_on(&rt, async {
            let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
            let addr = l.local_addr().unwrap();
            tokio::spawn(async move {
                while let Ok((s, _)) = l.accept().await {
                    tokio::spawn(async move {
                        if let Ok(mut c) = h2::server::handshake(s).await {
                            while let Some(Ok(_)) = c.accept().await {}
                        }
                    });
                }
            });
            let pool = H2Pool::default();
            let key = PeerKey::plain(addr);
            let connector = Connector::tcp();
            let limit = Duration::from_secs(30);
            let lease = async |worker, max| match pool
                .lease(worker, &key, &connector, limit, None, max, false)
                .await
                .unwrap()
            {
                Leased::H2(l, reused) => (l, reused),
                Leased::Http1(_) => panic!("h2c is not asked"),
            };
            let (a, reused) = lease(0, 2).await;
            assert!(!reused);
            let (b, reused) = lease(0, 2).await;
            assert!(
                reused && Arc::ptr_eq(&a.conn, &b.conn),
                "worker 0 reuses its own"
            );
            drop(b);
            let (c, reused) = lease(1, 2).await;
            assert!(!reused, "worker 1 took worker 0's connection");
            assert!(!Arc::ptr_eq(&a.conn, &c.conn));
            // Worker 1's is full (two streams): it opens another, although
            // worker 0's has room.
            let (_d, _) = lease(1, 2).await;
            let (e, reused) = lease(1, 2).await;
            assert!(!reused && !Arc::ptr_eq(&e.conn, &a.conn));
            assert_eq!(pool.connections(), 3);
        });
    }

    /// vendor/h2's `check_headers` (one pass over the names, patched)
    /// refuses what the published one does: a connection-specific field in
    /// a header block sent, TE other than "trailers".
    #[test]
    fn the_patched_h2_still_refuses_connection_specific_fields() {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async {
            let (a, b) = tokio::io::duplex(64 * 1024);
            tokio::spawn(async move {
                let mut c = h2::server::handshake(b).await.unwrap();
                while let Some(Ok(_)) = c.accept().await {}
            });
            let (send, conn) = h2::client::handshake(a).await.unwrap();
            tokio::spawn(conn);
            let mut send = send.ready().await.unwrap();
            let bad = [
                ("connection", "close"),
                ("keep-alive", "5"),
                ("proxy-connection", "keep-alive"),
                ("transfer-encoding", "chunked"),
                ("upgrade", "websocket"),
                ("te", "gzip"),
            ];
            for (n, v) in bad {
                let req = http::Request::builder()
                    .uri("http://x.test/")
                    .header("x-before", "1")
                    .header(n, v)
                    .body(())
                    .unwrap();
                assert!(send.send_request(req, true).is_err(), "{n}: {v}");
            }
            let ok = http::Request::builder()
                .uri("http://x.test/")
                .header("te", "trailers")
                .header("x-fine", "1")
                .body(())
                .unwrap();
            assert!(send.send_request(ok, true).is_ok());
        });
    }

    #[test]
    fn a_cancel_at_the_deadline_is_a_timeout_and_any_other_reset_a_closed_origin() {
        let t0 = tokio::time::Instant::now();
        let deadline = t0 + Duration::from_millis(5);
        let after = deadline + Duration::from_micros(1);
        assert_eq!(
            reset_kind(Some(Reason::CANCEL), deadline, after),
            Kind::UpstreamTimeout
        );
        assert_eq!(
            reset_kind(Some(Reason::CANCEL), deadline, deadline),
            Kind::UpstreamTimeout
        );
        assert_eq!(
            reset_kind(Some(Reason::CANCEL), deadline, t0),
            Kind::UpstreamClosed
        );
        for r in [
            Reason::INTERNAL_ERROR,
            Reason::PROTOCOL_ERROR,
            Reason::NO_ERROR,
        ] {
            assert_eq!(reset_kind(Some(r), deadline, after), Kind::UpstreamClosed);
        }
        assert_eq!(reset_kind(None, deadline, after), Kind::UpstreamClosed);
    }
}
