//! The engine as a multiplexed protocol's connection sees it
//! ([`pier_session::Engine`]): one per client connection, cloned into each
//! stream's task. A protocol crate (pier-h2 today) owns the connection loop
//! and hands each stream here; the stream runs through the driver's steps
//! like an HTTP/1 request (`driver::serve_stream`).

use crate::session::ConnInfo;
use crate::{driver, Phases, Worker};
use pier_session::{Downstream, Engine, RequestParts};
use std::cell::RefCell;
use std::net::SocketAddr;
use std::sync::Arc;

/// One client connection of a worker, as its streams' engine.
pub struct Mux<P: Phases> {
    pub w: Arc<Worker<P>>,
    pub conn: Arc<ConnInfo>,
    pub client: SocketAddr,
    pub local: SocketAddr,
    /// The connection's admission slots (HTTP/3, which is admitted here
    /// rather than at a TCP accept), released with its last stream.
    slot: Option<std::rc::Rc<crate::Slot>>,
}

impl<P: Phases> Clone for Mux<P> {
    fn clone(&self) -> Self {
        Mux {
            w: self.w.clone(),
            conn: self.conn.clone(),
            client: self.client,
            local: self.local,
            slot: self.slot.clone(),
        }
    }
}

impl<P: Phases> Engine for Mux<P> {
    fn waiting(&self) -> &RefCell<pier_core::evict::Registry> {
        &self.w.waiting
    }
    fn now_ms(&self) -> u64 {
        pier_lb::recent_ms()
    }
    fn drain(&self) -> tokio::sync::watch::Receiver<bool> {
        self.w.shared.drain_rx()
    }
    fn goaway_timeout(&self) {
        self.w.shared.metrics.goaway_timeout();
    }
    // Not an `async fn`: its future would keep its arguments twice (as
    // arguments and as the body's locals; the stream's downstream and head
    // are ~670 bytes), and this future is allocated and copied per stream.
    // The driver borrows the downstream rather than taking it, for the same
    // reason one layer down.
    #[allow(clippy::manual_async_fn)]
    fn serve_stream<D, H>(
        self,
        mut down: D,
        parts: H,
    ) -> impl std::future::Future<Output = ()> + 'static
    where
        D: Downstream + 'static,
        H: RequestParts + 'static,
    {
        async move {
            let Mux {
                w,
                conn,
                client,
                local,
                ..
            } = &self;
            driver::serve_stream(w, &mut down, &parts, *client, *local, conn).await
        }
    }
}

/// Serve one HTTP/2 connection (after TLS with ALPN `h2`, or cleartext with
/// prior knowledge) until the client goes away, an error, or a drain.
///
/// Not an `async fn`, as `pier_h2::server::serve` is not: an async fn's
/// future keeps a slot for each argument, the stream's (a TLS stream is
/// ~1.2 KiB) included, for the whole connection.
pub fn serve_h2<P: Phases, S: pier_core::Stream>(
    w: Arc<Worker<P>>,
    stream: S,
    client: SocketAddr,
    local: SocketAddr,
    conn: ConnInfo,
) -> impl std::future::Future<Output = ()> {
    let state = w.shared.state.load_full();
    let mux = Mux {
        w,
        conn: Arc::new(ConnInfo {
            proto: pier_session::Protocol::Http2,
            ..conn
        }),
        client,
        local,
        slot: None,
    };
    pier_h2::server::serve(mux, stream, client, &state.cfg.http2, &state.cfg.timeouts)
}

/// Handshakes in progress on one worker's QUIC endpoint above which a new
/// client must first prove its address (a Retry round trip).
const RETRY_ABOVE: usize = 64;

/// The key every worker's QUIC endpoint derives stateless resets from (one
/// per process, so any worker can reset another's connection).
fn reset_key() -> &'static [u8; 32] {
    static KEY: std::sync::OnceLock<[u8; 32]> = std::sync::OnceLock::new();
    KEY.get_or_init(|| {
        let mut k = [0u8; 32];
        // A failing system RNG leaves a fixed key: resets still work,
        // only they become forgeable by whoever knows it.
        let _ = aws_lc_rs::rand::fill(&mut k);
        k
    })
}

/// Serve HTTP/3 on this worker's UDP socket of listener `name` (its TLS,
/// with ALPN h3), each connection admitted as a TCP one is
/// (`limits.max_connections`, per-IP caps), until a drain.
pub async fn serve_h3<P: Phases>(w: Arc<Worker<P>>, name: String, socket: std::net::UdpSocket) {
    let state = w.shared.state.load_full();
    let Some((index, tls, s)) = h3_settings(&state, &name) else {
        tracing::error!("listener {name}: http3 without TLS");
        return;
    };
    let (endpoint, config) = match pier_h3::server_config(tls.config(), &s)
        .and_then(|c| Ok((pier_h3::endpoint(socket, c.clone(), reset_key())?, c)))
    {
        Ok(e) => e,
        Err(e) => {
            tracing::error!("listener {name}: http3: {e}");
            return;
        }
    };
    let drain = w.shared.drain_rx();
    // A reload's certificates and bounds, for the next QUIC connection (as
    // the next TLS handshake over TCP gets them): built again when the
    // state's generation moved. Listeners are bound once and keep their
    // place in the list, so `index` stays valid for admission.
    let current = {
        let shared = w.shared.clone();
        let config = Arc::new(config);
        let built = RefCell::new((state.generation, std::rc::Rc::new((config, s))));
        move || {
            let state = shared.state.load();
            let mut b = built.borrow_mut();
            if b.0 != state.generation {
                b.0 = state.generation;
                match h3_settings(&state, &name)
                    .map(|(_, tls, s)| pier_h3::server_config(tls.config(), &s).map(|c| (c, s)))
                {
                    Some(Ok((c, s))) => b.1 = std::rc::Rc::new((Arc::new(c), s)),
                    Some(Err(e)) => tracing::error!("listener {name}: http3 reload: {e}"),
                    None => tracing::error!("listener {name}: http3 reload: no TLS"),
                }
            }
            b.1.clone()
        }
    };
    let admit = {
        let w = w.clone();
        move |c: pier_h3::NewConnection| {
            use pier_core::lifecycle::{Admission, Admitted};
            let slot = match crate::Admit(w.clone(), Some(index)).admit(c.remote, false) {
                Admitted::Yes(s) => s,
                _ => return None,
            };
            let info = pier_tls::TlsInfo {
                version: "TLSv1.3",
                // quinn does not say which suite QUIC's handshake chose.
                cipher: "unknown",
                sni: c.server_name.map(String::into_boxed_str),
                alpn: Some("h3".into()),
                client_subject: c.client_cert.as_ref().and_then(pier_tls::subject_of),
                resumed: false,
            };
            Some(Mux {
                w: w.clone(),
                conn: Arc::new(ConnInfo {
                    listener: Some(index),
                    tls: Some(Arc::new(info)),
                    proto: pier_session::Protocol::Http3,
                }),
                client: c.remote,
                local: c.local,
                slot: Some(std::rc::Rc::new(slot)),
            })
        }
    };
    let ep = endpoint.clone();
    pier_h3::serve(endpoint, drain, current, admit).await;
    if w.shared.lifecycle.handed_over() {
        // A binary upgrade: the new process reads this UDP socket too, so
        // this one stops reading it as soon as it can. QUIC connections
        // cannot drain across two readers; they are closed (H3_NO_ERROR)
        // and their clients connect again, to the new process.
        pier_h3::close_all(&ep, b"upgrade").await;
    }
}

/// Listener `name`'s index, TLS and HTTP/3 settings in `state`; None when
/// it is not there or has no TLS.
fn h3_settings(
    state: &crate::state::State,
    name: &str,
) -> Option<(usize, Arc<pier_tls::ServerTls>, pier_h3::Settings)> {
    let index = state.cfg.listeners.iter().position(|l| l.name == name)?;
    let l = &state.cfg.listeners[index];
    let tls = state.listener_tls.get(index).cloned().flatten()?;
    let lt = l.tls.as_ref()?;
    let t = &state.cfg.timeouts;
    let s = pier_h3::Settings {
        max_streams: state.cfg.http2.max_concurrent_streams,
        max_field_section_size: state.cfg.http2.max_header_list_size as u64,
        handshake_timeout: lt.handshake_timeout,
        client_header: t.client_header,
        client_idle: t.client_idle,
        client_goaway: t.client_goaway,
        retry_above: if l.quic_retry { 0 } else { RETRY_ABOVE },
        early_data: l.quic_early_data,
    };
    Some((index, tls, s))
}
