//! The connector: an upstream session for a peer. It takes the pools
//! (HTTP/1 idle connections, HTTP/2 shared connections), dials when they
//! have nothing, settles `protocol = "auto"` by ALPN, and types connect
//! and TLS failures, so that the driver's one attempt function sees only
//! an [`UpstreamSession`](pier_session::UpstreamSession).

use crate::session::Session;
use crate::state::State;
use crate::Worker;
use bytes::BytesMut;
use pier_config::UpstreamProtocol;
use pier_core::{Alpn, PeerKey};
use pier_error::{Error, Kind};
use pier_h1::H1Upstream;
use pier_h2::client::{H2Upstream, Leased};
use pier_session::UpstreamSession;
use std::net::SocketAddr;

/// An upstream session, by protocol: the one place that knows them (a new
/// protocol is a variant here and an `UpstreamSession`, not a driver edit).
pub enum Upstream<'b> {
    H1(H1Upstream<'b>),
    H2(H2Upstream),
}

/// What runs on a session, whatever its protocol (the driver's attempt).
pub trait OnSession {
    type Ok;
    #[allow(async_fn_in_trait)]
    async fn run<U: UpstreamSession>(self, up: U) -> Result<Self::Ok, Error>;
}

impl<'b> Upstream<'b> {
    /// Run `f` on the session [`connect`] made, or give back its failure.
    /// A plain function choosing a future rather than an `async fn`
    /// awaiting one: that would be a layer of state of its own, keeping the
    /// session twice (as its argument and as `f`'s) for the whole exchange;
    /// taking the connector's result whole lets the caller's future drop it
    /// (a match on it there kept it, 168 bytes, until the exchange ended).
    pub fn run<F: OnSession>(
        up: Result<Self, Error>,
        f: F,
    ) -> impl std::future::Future<Output = Result<F::Ok, Error>> + use<'b, F> {
        use either::Either::{Left, Right};
        match up {
            Ok(Upstream::H1(u)) => Left(Left(f.run(u))),
            // Boxed: the HTTP/1 path's future (every request's) does not
            // carry the HTTP/2 exchange's state.
            Ok(Upstream::H2(u)) => Left(Right(crate::boxed_in_place(|| f.run(u)))),
            Err(e) => Right(std::future::ready(Err(e))),
        }
    }
}

/// `send_proxy_protocol`: the header naming this request's client
/// connection (its client as Pier took it, the address it reached, its
/// TLS server name, version and cipher).
fn proxy_header(v: pier_config::SendProxy, sess: &Session) -> std::sync::Arc<[u8]> {
    let tls = sess.conn.tls.as_deref();
    crate::proxy_protocol::encode(
        v,
        sess.client,
        sess.local,
        tls.and_then(|t| t.sni.as_deref()),
        tls.map(|t| (t.version, t.cipher)),
    )
    .into()
}

/// The request's buffers an HTTP/1 session reads and writes through.
pub struct H1Bufs<'b> {
    pub ubuf: &'b mut BytesMut,
    pub head: &'b mut Vec<u8>,
}

/// A session to `addr` for this request's route: over TLS when its group
/// has `[upstream.NAME.tls]`, in the group's `protocol`. `fresh_only`: not
/// from a pool (a pooled connection just died while idle).
pub async fn connect<'b, P: crate::Phases>(
    w: &'b Worker<P>,
    state: &'b State,
    sess: &Session,
    addr: SocketAddr,
    fresh_only: bool,
    bufs: H1Bufs<'b>,
) -> Result<Upstream<'b>, Error> {
    let t = &state.cfg.timeouts;
    // A cache parent is a Pier: plain HTTP/1, whatever the origin speaks.
    let route = sess.route.filter(|_| !sess.to_parent);
    let tls = route.and_then(|r| state.upstream_tls[state.routes[r].group].as_ref());
    let group = route.map(|r| &state.groups[state.routes[r].group]);
    let protocol = group.map(|g| g.config().protocol).unwrap_or_default();
    let h2 = protocol != UpstreamProtocol::Http1;
    let alpn = if h2 { Alpn::H2 } else { Alpn::Http1 };
    let proxy = group
        .and_then(|g| g.config().send_proxy_protocol)
        .map(|v| proxy_header(v, sess));
    let mut key = match tls {
        None => PeerKey {
            alpn,
            proxy,
            ..PeerKey::plain(addr)
        },
        Some(t) => PeerKey {
            addr,
            sni: Some(pier_lb::tls_server_name(
                t.server_name.as_ref(),
                sess.upstream_host.as_ref(),
                addr,
            )),
            alpn,
            proxy,
        },
    };
    // `auto`: a new connection the server took for HTTP/1.1, or an idle
    // one to a server known to have done so.
    let mut probed = None;
    let mut idle_h1 = None;
    if h2 {
        let auto = protocol == UpstreamProtocol::Auto;
        let h1_key = PeerKey {
            alpn: Alpn::Http1,
            ..key.clone()
        };
        // A peer known to have chosen HTTP/1.1 is served from the HTTP/1
        // pool while it has an idle connection; a new one asks again.
        if auto && !fresh_only && w.shared.h2pool.chose_h2(&key) == Some(false) {
            idle_h1 = w.shared.pool.take(&h1_key, w.id);
        }
        if idle_h1.is_none() {
            let max = group.map(|g| g.config().h2_max_streams).unwrap_or(100);
            // Boxed: the HTTP/1 path's future (every request's) does not
            // carry its state.
            let leased = Box::pin(w.shared.h2pool.lease(
                w.id,
                &key,
                &w.shared.connector,
                t.upstream_connect,
                tls.map(|t| &t.config),
                max,
                auto,
            ))
            .await;
            match leased {
                Ok(Leased::H2(lease, reused)) => {
                    return Ok(Upstream::H2(H2Upstream {
                        lease,
                        reused,
                        tls: tls.is_some(),
                        timeout: t.upstream_response,
                    }))
                }
                Ok(Leased::Http1(c)) => {
                    tls_stats(&c);
                    probed = Some(c);
                }
                Err(e) => return Err(connect_error(tls.is_some(), addr, &e)),
            }
        }
        key = h1_key;
    }
    let pooled = if idle_h1.is_some() {
        idle_h1
    } else if fresh_only || probed.is_some() {
        None
    } else {
        w.shared.pool.take(&key, w.id)
    };
    let reused = pooled.is_some();
    let conn = match pooled.or(probed) {
        Some(s) => s,
        // Boxed: a new connection (a TLS handshake's state included) is
        // rare next to pooled ones, and its future is larger than the rest
        // of the exchange.
        None => match Box::pin(w.shared.connector.connect(
            &key,
            t.upstream_connect,
            tls.map(|t| &t.config),
        ))
        .await
        {
            Ok(s) => {
                tls_stats(&s);
                s
            }
            Err(e) => return Err(connect_error(tls.is_some(), addr, &e)),
        },
    };
    bufs.ubuf.clear();
    if bufs.ubuf.capacity() == 0 {
        *bufs.ubuf = w.bufs.borrow_mut().take();
    }
    if bufs.head.capacity() == 0 {
        *bufs.head = w.bufs.borrow_mut().take_vec();
    }
    Ok(Upstream::H1(H1Upstream {
        conn,
        key,
        reused,
        pool: &w.shared.pool,
        worker: w.id,
        ubuf: bufs.ubuf,
        head: bufs.head,
        limits: &state.head_limits,
        timeout: t.upstream_response,
    }))
}

/// A new TLS connection counts in the handshake stats (resumed or full).
fn tls_stats(c: &pier_core::Conn) {
    if let pier_core::Conn::Tls(t) = c {
        let resumed = t.get_ref().1.handshake_kind() == Some(rustls::HandshakeKind::Resumed);
        pier_tls::stats::stats().upstream(true, resumed);
    }
}

/// A failed connect as the error it is: nothing was sent, so any method
/// may go to another peer, and it is a 502 (docs/config.md). A failed TLS
/// handshake (verification or protocol) is told apart from a refused or
/// timed-out connect.
fn connect_error(tls: bool, addr: SocketAddr, e: &std::io::Error) -> Error {
    if tls && is_tls_failure(e) {
        pier_tls::stats::stats().upstream(false, false);
        tracing::warn!("upstream TLS to {addr}: {e}");
        return Error::upstream(Kind::UpstreamTls);
    }
    tracing::debug!("connect {addr}: {e}");
    Error::upstream(Kind::UpstreamConnect)
}

/// A failed TLS handshake (as opposed to a refused or timed-out connect).
fn is_tls_failure(e: &std::io::Error) -> bool {
    e.get_ref()
        .is_some_and(|i| i.downcast_ref::<rustls::Error>().is_some())
        || matches!(
            e.kind(),
            std::io::ErrorKind::InvalidData | std::io::ErrorKind::UnexpectedEof
        )
}
