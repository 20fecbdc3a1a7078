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
}

impl<P: Phases> Clone for Mux<P> {
    fn clone(&self) -> Self {
        Mux {
            w: self.w.clone(),
            conn: self.conn.clone(),
            client: self.client,
            local: self.local,
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
    async fn serve_stream<D, H>(self, down: D, parts: H)
    where
        D: Downstream + 'static,
        H: RequestParts + 'static,
    {
        driver::serve_stream(&self.w, down, &parts, self.client, self.local, &self.conn).await
    }
}

/// Serve one HTTP/2 connection (after TLS with ALPN `h2`, or cleartext with
/// prior knowledge) until the client goes away, an error, or a drain.
pub async fn serve_h2<P: Phases, S: pier_core::Stream>(
    w: Arc<Worker<P>>,
    stream: S,
    client: SocketAddr,
    local: SocketAddr,
    conn: ConnInfo,
) {
    let state = w.shared.state.load_full();
    let mux = Mux {
        w,
        conn: Arc::new(ConnInfo { h2: true, ..conn }),
        client,
        local,
    };
    pier_h2::server::serve(mux, stream, client, &state.cfg.http2, &state.cfg.timeouts).await
}
