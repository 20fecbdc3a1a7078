//! HTTP/2 to origins: multiplexed connections shared by every worker thread
//! (a new one only when each open one carries `h2_max_streams`), and the
//! upstream halves of the session interfaces over an h2 stream.
//!
//! A connection's I/O task runs on the worker that opened it; other workers
//! send on it through the h2 handle (`SendRequest` is `Send`), so one
//! connection serves the whole process — the sharing an HTTP/2 origin wants.

use crate::protocol::{BodySize, RequestSink, ResponseSource};
use crate::session::Session;
use crate::state::State;
use bytes::Bytes;
use pier_config::HostHeader;
use pier_core::{Connector, PeerKey};
use pier_error::{Error, Kind};
use pier_http::known;
use pier_http::{Headers, ResponseHead};
use std::collections::HashMap;
use std::future::poll_fn;
use std::net::SocketAddr;
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
#[derive(Default)]
pub struct H2Pool {
    conns: Mutex<HashMap<PeerKey, Vec<Arc<Conn>>>>,
}

/// A stream slot on a connection, given back when dropped.
pub struct Lease {
    conn: Arc<Conn>,
}

impl Drop for Lease {
    fn drop(&mut self) {
        self.conn.open.fetch_sub(1, Relaxed);
    }
}

impl H2Pool {
    /// A stream slot to `key`: on an open connection with room, else on a
    /// new one. `Ok((lease, reused))`.
    pub async fn lease(
        &self,
        key: &PeerKey,
        connector: &Connector,
        limit: Duration,
        tls: Option<&pier_core::stream::ClientConfig>,
        max_streams: usize,
    ) -> Result<(Lease, bool), std::io::Error> {
        {
            let mut map = self.conns.lock().unwrap_or_else(|e| e.into_inner());
            if let Some(list) = map.get_mut(key) {
                list.retain(|c| !c.closed.load(Relaxed));
                for c in list.iter() {
                    if c.open.load(Relaxed) < max_streams {
                        c.open.fetch_add(1, Relaxed);
                        return Ok((Lease { conn: c.clone() }, true));
                    }
                }
            }
        }
        let io = connector.connect(key, limit, tls).await?;
        if let pier_core::Conn::Tls(t) = &io {
            if t.get_ref().1.alpn_protocol() != Some(b"h2") {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::InvalidData,
                    "the origin did not agree to h2 by ALPN",
                ));
            }
        }
        let (send, conn) = tokio::time::timeout(limit, h2::client::handshake(io))
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
        let mut map = self.conns.lock().unwrap_or_else(|e| e.into_inner());
        map.entry(key.clone()).or_default().push(c.clone());
        Ok((Lease { conn: c }, false))
    }

    /// Open HTTP/2 connections (metrics).
    pub fn connections(&self) -> usize {
        let map = self.conns.lock().unwrap_or_else(|e| e.into_inner());
        map.values()
            .flatten()
            .filter(|c| !c.closed.load(Relaxed))
            .count()
    }
}

/// Send the request head on a leased connection: the response to come and
/// the request body's sink.
pub async fn send_request(
    lease: &Lease,
    req: http::Request<()>,
    end_of_stream: bool,
    limit: Duration,
) -> Result<(h2::client::ResponseFuture, h2::SendStream<Bytes>), Error> {
    let ready = tokio::time::timeout(limit, lease.conn.send.clone().ready()).await;
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
            done: false,
            head_only,
        }
    }
}

fn to_headers(map: &http::HeaderMap, out: &mut Headers) {
    for (k, v) in map {
        out.append(k.as_str().as_bytes(), v.as_bytes());
    }
}

impl ResponseSource for H2ResponseSource {
    async fn read_head(&mut self, head: &mut ResponseHead) -> Result<(), Error> {
        let Some(fut) = self.fut.take() else {
            return Err(Error::new(Kind::UpstreamProtocol));
        };
        let resp = match tokio::time::timeout(self.timeout, fut).await {
            Err(_) => return Err(Error::new(Kind::UpstreamTimeout)),
            // A stream refused before any processing may go elsewhere.
            Ok(Err(e)) if e.reason() == Some(h2::Reason::REFUSED_STREAM) => {
                return Err(Error::upstream(Kind::UpstreamClosed))
            }
            Ok(Err(_)) => return Err(Error::new(Kind::UpstreamClosed)),
            Ok(Ok(r)) => r,
        };
        let (parts, recv) = resp.into_parts();
        head.headers.clear();
        head.set_status(parts.status.as_u16());
        head.version = 1;
        to_headers(&parts.headers, &mut head.headers);
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
        match tokio::time::timeout(self.timeout, recv.data()).await {
            Err(_) => Err(Error::answered(Kind::UpstreamTimeout)),
            Ok(Some(Err(_))) => Err(Error::answered(Kind::UpstreamClosed)),
            Ok(Some(Ok(data))) => {
                let _ = recv.flow_control().release_capacity(data.len());
                let last = recv.is_end_stream();
                self.buf = data;
                Ok(Some((&self.buf[..], last)))
            }
            Ok(None) => {
                self.done = true;
                if let Ok(Ok(Some(t))) = tokio::time::timeout(self.timeout, recv.trailers()).await {
                    let mut h = Headers::default();
                    to_headers(&t, &mut h);
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
}

impl H2RequestSink {
    pub fn new(send: h2::SendStream<Bytes>, timeout: Duration) -> Self {
        H2RequestSink { send, timeout }
    }
}

impl RequestSink for H2RequestSink {
    async fn write_body(&mut self, data: &[u8]) -> Result<(), Error> {
        let mut data = Bytes::copy_from_slice(data);
        while !data.is_empty() {
            self.send.reserve_capacity(data.len());
            let cap =
                tokio::time::timeout(self.timeout, poll_fn(|cx| self.send.poll_capacity(cx))).await;
            let n = match cap {
                Ok(Some(Ok(n))) => n.min(data.len()),
                Err(_) => return Err(Error::new(Kind::UpstreamTimeout)),
                _ => return Err(Error::new(Kind::UpstreamClosed)),
            };
            if n == 0 {
                continue;
            }
            self.send
                .send_data(data.split_to(n), false)
                .map_err(|_| Error::new(Kind::UpstreamClosed))?;
        }
        Ok(())
    }

    async fn finish(&mut self, trailers: Option<&Headers>) -> Result<(), Error> {
        let mut map = http::HeaderMap::new();
        for (k, v) in trailers.into_iter().flat_map(|t| t.iter()) {
            if let (Ok(n), Ok(v)) = (
                http::HeaderName::from_bytes(k),
                http::HeaderValue::from_bytes(v),
            ) {
                map.append(n, v);
            }
        }
        let r = if map.is_empty() {
            self.send.send_data(Bytes::new(), true)
        } else {
            self.send.send_trailers(map)
        };
        r.map_err(|_| Error::new(Kind::UpstreamClosed))
    }
}

/// The upstream request as an HTTP/2 request: `:authority` from the Host
/// the engine would send, connection-specific fields dropped, `te:
/// trailers` kept (gRPC needs it), X-Forwarded-* as over HTTP/1.
pub(crate) fn request(
    state: &State,
    sess: &Session,
    addr: SocketAddr,
    tls: bool,
) -> Result<http::Request<()>, Error> {
    let req = &sess.up_req;
    let host_is_peer = matches!(
        sess.route.map(|r| &state.routes[r].host_header),
        Some(HostHeader::Upstream)
    );
    let authority = match req.host() {
        Some(h) if !host_is_peer => String::from_utf8_lossy(h).into_owned(),
        _ => match &sess.upstream_host {
            Some(h) => format!("{h}:{}", addr.port()),
            None => addr.to_string(),
        },
    };
    let target = String::from_utf8_lossy(req.uri());
    let uri = format!(
        "{}://{authority}{target}",
        if tls { "https" } else { "http" }
    );
    fn bad<E>(_: E) -> Error {
        Error::new(Kind::InvalidHeader)
    }
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
    for (k, name, value) in req.headers.iter_known() {
        if crate::driver::skip_request_header(k)
            || k == known::HOST
            || k == known::TRANSFER_ENCODING
        {
            continue;
        }
        h.append(
            http::HeaderName::from_bytes(name).map_err(bad)?,
            http::HeaderValue::from_bytes(value).map_err(bad)?,
        );
    }
    if req.headers.has_token(known::TE, b"trailers") {
        h.insert(http::header::TE, http::HeaderValue::from_static("trailers"));
    }
    let mut xff = Vec::new();
    for v in req.headers.get_all_known(known::X_FORWARDED_FOR) {
        xff.extend_from_slice(v);
        xff.extend_from_slice(b", ");
    }
    xff.extend_from_slice(sess.client_ip.as_bytes());
    h.insert(
        "x-forwarded-for",
        http::HeaderValue::from_bytes(&xff).map_err(bad)?,
    );
    h.insert(
        "x-forwarded-proto",
        http::HeaderValue::from_static(sess.scheme()),
    );
    if let Some(a) = sess.req.absolute_form().map(|(a, _)| a).or(sess.req.host()) {
        h.insert(
            "x-forwarded-host",
            http::HeaderValue::from_bytes(a).map_err(bad)?,
        );
    }
    Ok(r)
}
