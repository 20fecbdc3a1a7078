//! Pier's request engine: the phase trait and the step enum (`phases`), the
//! driver that takes a request through the steps (`driver`), the policy an
//! upstream request is built by (`forward`), the connector that opens
//! upstream sessions (`upstream`) and the running config (`state`). The
//! protocols are crates of their own behind pier-session's interfaces
//! (pier-h1, pier-h2); `mux` is the engine a multiplexed connection hands
//! its streams to. Phase implementations (the config's limits and
//! Lua hooks: `pier-phases`) plug in from outside, and the admin listener
//! (`pier-admin`) reads [`Shared`] from outside; this crate builds no LuaJIT.
#![forbid(unsafe_code)]

mod alt_svc;
pub mod cache;
pub mod cache_key;
mod cors;
pub mod driver;
pub mod forward;
pub mod local;
pub mod mux;
pub mod phases;
pub mod proxy_protocol;
pub mod purge;
pub mod req_body;
pub mod session;
pub mod state;
pub mod tier;
pub mod trace;
pub mod upstream;

pub use cache_key::CacheCtl;
pub use phases::{Flow, LocalResponse, NoPhases, PeerChoice, Phases};
pub use req_body::ReqBody;
pub use session::Session;
pub use state::State;

use arc_swap::ArcSwap;
use pier_core::evict;
use pier_core::lifecycle::{Admission, Admitted, Lifecycle};
use pier_core::{Connector, Pool, WorkerContext};
use pier_log::{AccessLog, Metrics};
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::watch;

/// What all workers share.
pub struct Shared {
    /// Read through `current()`; replaced whole by `install()` on reload.
    pub state: ArcSwap<State>,
    /// The installed state's `epoch`, bumped on every reload and every DNS
    /// change of a group, so connections re-load the state only then (one
    /// uncontended atomic read per request instead of an Arc clone).
    epoch: std::sync::atomic::AtomicU64,
    pub pool: Pool,
    /// Opens upstream connections (TCP; an in-memory dialer in tests).
    pub connector: Connector,
    /// HTTP/2 upstream connections, multiplexed, each worker's own.
    pub h2pool: pier_h2::client::H2Pool,
    pub metrics: Metrics,
    pub access: AccessLog,
    /// Built-in analytics (`[analytics]`); None when off. Set up at start:
    /// a reload keeps it as it is.
    pub analytics: Option<Arc<pier_analytics::hub::Hub>>,
    /// Open connections per client IP (`limits.max_connections_per_ip`).
    pub per_ip: pier_limits::Inflight,
    /// Drain, and the generation just installed (so that workers set up a
    /// reloaded config's per-thread parts — Lua `init`/`init_worker` and
    /// timers — at once rather than at their next request).
    pub lifecycle: Lifecycle,
}

impl Shared {
    pub fn new(state: State, pool: Pool, metrics: Metrics, access: AccessLog) -> Self {
        let lifecycle = Lifecycle::new(state.generation);
        let mut state = state;
        state.epoch = 1;
        let connector = Connector::tcp();
        connector.set_io_uring(io_uring_upstream(&state.cfg));
        Shared {
            state: ArcSwap::from_pointee(state),
            epoch: std::sync::atomic::AtomicU64::new(1),
            pool,
            connector,
            h2pool: Default::default(),
            metrics,
            access,
            analytics: None,
            per_ip: pier_limits::Inflight::new(),
            lifecycle,
        }
    }
    /// Swap in a new config generation.
    pub fn install(&self, state: State) {
        let g = state.generation;
        self.store(state);
        self.lifecycle.announce_reload(g);
    }
    /// Swap in the same generation with other upstream servers (a new DNS
    /// answer, see [`State::with_servers`]): connections pick it up at their
    /// next request; nothing per-generation is set up again.
    pub fn install_peers(&self, state: State) {
        self.store(state);
    }
    fn store(&self, mut state: State) {
        // Installs come from the control thread only, one at a time.
        let epoch = self.epoch.load(Relaxed) + 1;
        state.epoch = epoch;
        self.connector.set_io_uring(io_uring_upstream(&state.cfg));
        self.state.store(Arc::new(state));
        self.epoch.store(epoch, Relaxed);
    }
    /// Refresh `cached` if a reload or a DNS change happened since it was loaded.
    #[inline]
    pub fn refresh(&self, cached: &mut Arc<State>) {
        if self.epoch.load(Relaxed) != cached.epoch {
            *cached = self.state.load_full();
        }
    }
    pub fn drain_rx(&self) -> watch::Receiver<bool> {
        self.lifecycle.drain_rx()
    }
    /// Stop accepting, close idle keep-alive connections, finish in-flight requests.
    pub fn start_drain(&self) {
        self.lifecycle.start_drain();
    }
    pub fn draining(&self) -> bool {
        self.lifecycle.draining()
    }
}

/// DNS discovery (pier-lb) reads the running config and swaps a group's
/// servers in, the same generation.
impl pier_lb::dns::Running for Shared {
    type State = Arc<State>;
    fn load(&self) -> Arc<State> {
        self.state.load_full()
    }
    fn config(state: &Arc<State>) -> &pier_config::Config {
        &state.cfg
    }
    fn reloads(&self) -> watch::Receiver<u64> {
        self.lifecycle.reloads()
    }
    fn install_servers(
        &self,
        state: &Arc<State>,
        name: &str,
        servers: Vec<pier_config::UpstreamServer>,
    ) -> bool {
        match state.with_servers(name, servers) {
            Some(next) => {
                self.install_peers(next);
                true
            }
            None => false,
        }
    }
}

/// QUIC's process-wide counters: Retry packets sent, handshakes done and
/// failed, 0-RTT requests served and refused, handshakes in progress
/// (`pier_http3_retries_total`, `pier_http3_handshakes_total`,
/// `pier_http3_early_data_total`, `pier_http3_handshakes_in_progress`).
pub fn quic_stats() -> [u64; 6] {
    use pier_h3::stats;
    [
        stats::RETRIES.load(Relaxed),
        stats::HANDSHAKES.load(Relaxed),
        stats::HANDSHAKE_FAILURES.load(Relaxed),
        stats::EARLY_SERVED.load(Relaxed),
        stats::EARLY_REFUSED.load(Relaxed),
        stats::IN_PROGRESS.load(Relaxed),
    ]
}

/// Cached body bytes spliced to clients without a copy, process-wide
/// (`pier_splice_bytes_total`).
pub fn splice_bytes() -> u64 {
    pier_h1::SPLICE_BYTES.load(Relaxed)
}

/// One worker thread's view: shared state plus its own hooks instance
/// (a Lua engine is per thread).
pub struct Worker<P: Phases> {
    pub id: usize,
    pub shared: Arc<Shared>,
    pub phases: P,
    /// This worker's connections waiting for a request head (evictable at
    /// `max_connections`).
    pub waiting: std::cell::RefCell<evict::Registry>,
    /// This worker's spare I/O buffers (idle connections hold none).
    pub bufs: std::cell::RefCell<driver::BufPool>,
    /// Itself, for tasks a request spawns (a cache's background refresh).
    pub me: std::sync::Weak<Worker<P>>,
}

/// Run a worker: accept on its listeners until draining, serving each
/// connection as a local task. Returns once draining and every connection
/// of this worker is closed.
pub async fn run_worker<P: Phases>(ctx: WorkerContext, shared: Arc<Shared>, phases: P) {
    pier_log::WORKER_ID.with(|w| w.set(ctx.id));
    phases.init_worker(&shared.state.load());
    let w = Arc::new_cyclic(|me| Worker {
        id: ctx.id,
        shared: shared.clone(),
        phases,
        waiting: Default::default(),
        bufs: Default::default(),
        me: me.clone(),
    });
    let mut accepts = Vec::new();
    for (name, l) in ctx.listeners {
        let listener = match tokio::net::TcpListener::from_std(l) {
            Ok(l) => l,
            Err(e) => {
                tracing::error!("listener {name}: {e}");
                continue;
            }
        };
        let index = shared
            .state
            .load()
            .cfg
            .listeners
            .iter()
            .position(|l| l.name == name);
        accepts.push(tokio::task::spawn_local(pier_core::lifecycle::accept_loop(
            listener,
            shared.drain_rx(),
            Admit(w.clone(), index),
        )));
    }
    // HTTP/3: this worker's QUIC endpoint on each listener that has it.
    for (name, socket) in ctx.udp {
        accepts.push(tokio::task::spawn_local(mux::serve_h3(
            w.clone(),
            name,
            socket,
        )));
    }
    // A reload sets up this thread's hooks for the new config right away
    // (Lua init/init_worker, timers), as OpenResty's new workers do. Holds
    // the worker weakly: draining waits for the last strong reference.
    let reloads = {
        let weak = Arc::downgrade(&w);
        let mut rx = shared.lifecycle.reloads();
        tokio::task::spawn_local(async move {
            while rx.changed().await.is_ok() {
                let Some(w) = weak.upgrade() else { break };
                let st = w.shared.state.load_full();
                w.phases.init_worker(&st);
            }
        })
    };
    // A drain closes the idle connections now: they wait as evictable
    // (evict.rs), so one eviction each instead of a watch waiter each.
    let drainer = {
        let weak = Arc::downgrade(&w);
        let mut rx = shared.drain_rx();
        tokio::task::spawn_local(async move {
            while !*rx.borrow_and_update() {
                if rx.changed().await.is_err() {
                    return;
                }
            }
            if let Some(w) = weak.upgrade() {
                w.waiting.borrow_mut().evict_kept();
            }
        })
    };
    // Hand the access log buffer over at least once a second, and free the
    // pooled sessions a burst left behind.
    let flusher = {
        let shared = shared.clone();
        let weak = Arc::downgrade(&w);
        tokio::task::spawn_local(async move {
            let mut tick = tokio::time::interval(Duration::from_secs(1));
            loop {
                tick.tick().await;
                let dropped = shared.access.flush();
                if dropped > 0 {
                    shared.metrics.log_dropped(dropped);
                }
                if let Some(a) = &shared.analytics {
                    a.flush();
                }
                if ctx.id == 0 {
                    shared.pool.sweep();
                }
                if let Some(w) = weak.upgrade() {
                    w.bufs.borrow_mut().trim_busy();
                }
            }
        })
    };
    for a in accepts {
        let _ = a.await;
    }
    // Draining: wait for this worker's connections (the main thread enforces the grace period).
    while Arc::strong_count(&w) > 1 {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    shared.access.flush();
    if let Some(a) = &shared.analytics {
        a.flush();
    }
    flusher.abort();
    reloads.abort();
    drainer.abort();
}

/// Who gets in: `limits.max_connections` (evicting the oldest connection
/// waiting for a head before refusing) and `limits.max_connections_per_ip`;
/// admitted connections are served by the HTTP/1 driver, over TLS when
/// their listener (the index into `cfg.listeners`) has it.
pub(crate) struct Admit<P: Phases>(pub(crate) Arc<Worker<P>>, pub(crate) Option<usize>);

/// A connection's slots (`pier_active_connections`, its per-IP count),
/// released however its task ends (a panic included). Held by the
/// connection's future itself rather than by a wrapping `async` block, whose
/// captured arguments would stay in the task beside the future they were
/// moved into (measured: a 896-byte task for a 584-byte future).
pub struct Slot {
    _active: ActiveConnection,
    _per_ip: Option<pier_limits::Guard>,
}

impl<P: Phases> Admission for Admit<P> {
    type Slot = Slot;

    fn admit(&self, peer: std::net::SocketAddr, may_wait: bool) -> Admitted<Slot> {
        let w = &self.0;
        let max = w.shared.state.load().cfg.limits.max_connections as i64;
        let before = w.shared.metrics.active_connections.fetch_add(1, Relaxed);
        // Counted from here; a refusal below gives it back as it drops.
        let active = ActiveConnection(w.shared.clone());
        if before >= max {
            // Full: the oldest connection waiting for a head gives up its
            // slot (evict.rs; it closes at its next poll, briefly leaving one
            // more open than the limit); with none old enough, refuse at
            // accept. Either way memory stays a function of the config.
            let now = pier_lb::recent_ms();
            let mut reg = w.waiting.borrow_mut();
            if reg.evict_oldest(now, evict::MIN_AGE_MS) {
                w.shared.metrics.evicted_connection();
            } else {
                // Waiting connections too young to evict: one will be old
                // enough within MIN_AGE_MS, so hold this socket that long
                // (lifecycle::accept_loop) rather than refuse it.
                match reg.ms_until_evictable(now, evict::MIN_AGE_MS) {
                    Some(ms) if may_wait => return Admitted::Wait(ms.max(1)),
                    _ => {
                        w.shared.metrics.refused_connection();
                        return Admitted::No;
                    }
                }
            }
        }
        // Per-client-IP connection cap (a sketch: fixed memory whatever the
        // IP count). Behind the PROXY protocol the peer is the balancer:
        // the cap is taken once the header names the client (`serve`).
        let per_ip = if self.proxy_protocol() {
            None
        } else {
            match per_ip(w, peer) {
                Ok(g) => g,
                Err(()) => return Admitted::No,
            }
        };
        Admitted::Yes(Slot {
            _active: active,
            _per_ip: per_ip,
        })
    }

    fn serve(&self, mut stream: tokio::net::TcpStream, peer: std::net::SocketAddr, mut slot: Slot) {
        let w = self.0.clone();
        let listener = self.1;
        let _ = stream.set_nodelay(true);
        if self.proxy_protocol() {
            // The header first, then the connection as any other, its
            // client the one the balancer named.
            let me = Admit(w.clone(), listener);
            tokio::task::spawn_local(async move {
                let (trusted, within) = {
                    let state = w.shared.state.load();
                    let l = listener.and_then(|i| state.cfg.listeners.get(i));
                    let ip = pier_config::normalize(peer.ip());
                    let trusted = l.is_some_and(|l| pier_config::denied(&l.trusted_proxies, ip));
                    (trusted, state.cfg.timeouts.client_header)
                };
                let header = if trusted {
                    // Waiting for the header is waiting for a head:
                    // evictable when the worker is full.
                    let waiting = evict::Waiting::enter(&w.waiting, pier_lb::recent_ms());
                    tokio::select! {
                        h = proxy_protocol::read(&mut stream, within) => h,
                        _ = waiting.evicted() => Err(proxy_protocol::Refused::Timeout),
                    }
                } else {
                    Err(proxy_protocol::Refused::Untrusted)
                };
                proxy_protocol::count(header.as_ref().map_err(|e| *e));
                let client = match header {
                    Ok(proxy_protocol::Header::Proxied { src, .. }) => src,
                    Ok(proxy_protocol::Header::Local) => peer,
                    Err(_) => return,
                };
                match per_ip(&w, client) {
                    Ok(g) => slot._per_ip = g,
                    Err(()) => return,
                }
                me.dispatch(stream, client, slot);
            });
            return;
        }
        self.dispatch(stream, peer, slot);
    }
}

/// The per-IP connection count of `peer` (`limits.max_connections_per_ip`);
/// Err (counted as refused) past it.
fn per_ip<P: Phases>(
    w: &Arc<Worker<P>>,
    peer: std::net::SocketAddr,
) -> Result<Option<pier_limits::Guard>, ()> {
    let max_ip = w.shared.state.load().cfg.limits.max_connections_per_ip;
    if max_ip == 0 {
        return Ok(None);
    }
    let ip = pier_config::normalize(peer.ip());
    let (g, n) = match ip {
        std::net::IpAddr::V4(v4) => w.shared.per_ip.incr(&v4.octets()[..]),
        std::net::IpAddr::V6(v6) => w.shared.per_ip.incr(&v6.octets()[..]),
    };
    if n > max_ip as isize {
        w.shared.metrics.refused_connection();
        return Err(());
    }
    Ok(Some(g))
}

/// Clients (cleartext HTTP/1 and h2c, and TLS) and cleartext upstream
/// connections go through the worker's io_uring: `[server] io_uring`, or
/// `PIER_IO_URING=1`/`0` overriding it.
fn io_uring_wanted(cfg: &pier_config::Config) -> bool {
    static ENV: std::sync::OnceLock<Option<bool>> = std::sync::OnceLock::new();
    ENV.get_or_init(|| match std::env::var("PIER_IO_URING").as_deref() {
        Ok("1") => Some(true),
        Ok("0") => Some(false),
        _ => None,
    })
    .unwrap_or(cfg.io_uring)
}

/// [`io_uring_wanted`] for connections to origins: `PIER_IO_URING_UPSTREAM`
/// (`0` or `1`) overrides it for them alone (to measure one leg's ring).
fn io_uring_upstream(cfg: &pier_config::Config) -> bool {
    static ENV: std::sync::OnceLock<Option<bool>> = std::sync::OnceLock::new();
    ENV.get_or_init(
        || match std::env::var("PIER_IO_URING_UPSTREAM").as_deref() {
            Ok("1") => Some(true),
            Ok("0") => Some(false),
            _ => None,
        },
    )
    .unwrap_or_else(|| io_uring_wanted(cfg))
}

/// [`io_uring_wanted`], and this worker's ring is there (set up on first
/// use; a worker without one stays on epoll).
fn io_uring(cfg: &pier_config::Config) -> bool {
    io_uring_wanted(cfg) && pier_core::uring::ready()
}

impl<P: Phases> Admit<P> {
    /// The listener reads a PROXY protocol header first.
    fn proxy_protocol(&self) -> bool {
        self.1.is_some_and(|i| {
            self.0
                .shared
                .state
                .load()
                .cfg
                .listeners
                .get(i)
                .is_some_and(|l| l.proxy_protocol)
        })
    }

    /// Serve an admitted connection whose client is `peer`: HTTP/1, h2c or
    /// TLS, as its listener says.
    fn dispatch(&self, stream: tokio::net::TcpStream, peer: std::net::SocketAddr, slot: Slot) {
        let w = self.0.clone();
        let listener = self.1;
        let local = stream.local_addr().unwrap_or(peer);
        // The listener's TLS as of now: a reload changes it for later
        // connections only.
        let tls =
            listener.and_then(|i| w.shared.state.load().listener_tls.get(i).cloned().flatten());
        let (h2c, h2c_only) = match listener {
            Some(i) if tls.is_none() => w
                .shared
                .state
                .load()
                .cfg
                .listeners
                .get(i)
                .map_or((false, false), |l| (l.h2c, l.h2c_only)),
            _ => (false, false),
        };
        let conn = session::ConnInfo {
            listener,
            tls: None,
            proto: pier_session::Protocol::Http1,
        };
        // One task per connection, its future as small as the plain HTTP/1
        // path allows: an idle keep-alive connection holds only that. The
        // TLS and h2c paths (a rustls acceptor, an h2 connection: kilobytes
        // inline) are boxed, so they cost only the connections that use them.
        match tls {
            None if !h2c && io_uring(&w.shared.state.load().cfg) => {
                if let Some(s) = on_ring(stream) {
                    tokio::task::spawn_local(driver::serve_connection(
                        w,
                        s,
                        peer,
                        local,
                        conn,
                        Some(slot),
                    ));
                }
            }
            None if !h2c => {
                tokio::task::spawn_local(driver::serve_connection(
                    w,
                    stream,
                    peer,
                    local,
                    conn,
                    Some(slot),
                ));
            }
            None if io_uring(&w.shared.state.load().cfg) => {
                if let Some(s) = on_ring(stream) {
                    tokio::task::spawn_local(Box::pin(serve_h2c(
                        w, s, peer, local, conn, slot, h2c_only,
                    )));
                }
            }
            None => {
                tokio::task::spawn_local(Box::pin(serve_h2c(
                    w, stream, peer, local, conn, slot, h2c_only,
                )));
            }
            Some(t) if io_uring(&w.shared.state.load().cfg) => {
                if let Some(s) = on_ring(stream) {
                    tokio::task::spawn_local(serve_tls(w, t, s, listener, peer, local, conn, slot));
                }
            }
            Some(t) => {
                tokio::task::spawn_local(serve_tls(
                    w, t, stream, listener, peer, local, conn, slot,
                ));
            }
        }
    }
}

/// A client connection moved onto the worker's ring; None (logged) when it
/// could not be, and the connection is then gone.
fn on_ring(stream: tokio::net::TcpStream) -> Option<pier_core::uring::UringStream> {
    pier_core::uring::UringStream::new(stream)
        .map_err(|e| tracing::debug!("io_uring: a connection could not move to the ring: {e}"))
        .ok()
}

/// A client of an h2c listener, which tells whether it opens with HTTP/2's
/// preface without consuming it: on tokio's poller or the worker's ring.
trait H2cClient: pier_core::Stream {
    fn preface(&self, limit: std::time::Duration) -> impl std::future::Future<Output = bool> + '_;
}

impl H2cClient for tokio::net::TcpStream {
    fn preface(&self, limit: std::time::Duration) -> impl std::future::Future<Output = bool> + '_ {
        pier_h2::server::prior_knowledge(self, limit)
    }
}

impl H2cClient for pier_core::uring::UringStream {
    fn preface(&self, limit: std::time::Duration) -> impl std::future::Future<Output = bool> + '_ {
        pier_h2::server::prior_knowledge_uring(self, limit)
    }
}

/// A connection of an h2c listener: HTTP/2 with prior knowledge, or (not
/// `h2c = "only"`) HTTP/1.1, which may ask to upgrade.
async fn serve_h2c<P: Phases, S: H2cClient>(
    w: Arc<Worker<P>>,
    stream: S,
    peer: std::net::SocketAddr,
    local: std::net::SocketAddr,
    conn: session::ConnInfo,
    slot: Slot,
    h2c_only: bool,
) {
    let _slot = slot;
    // Waiting for the first bytes is waiting for a head: evictable when the
    // worker is full.
    let h2 = {
        let waiting = evict::Waiting::enter(&w.waiting, pier_lb::recent_ms());
        let limit = w.shared.state.load().cfg.timeouts.client_header;
        tokio::select! {
            h2 = stream.preface(limit) => Some(h2),
            _ = waiting.evicted() => None,
        }
    };
    let Some(h2) = h2 else { return };
    if h2 {
        mux::serve_h2(w, stream, peer, local, conn).await
    } else if h2c_only {
        // No HTTP/1 here: a connection without the preface is closed.
        pier_h2::server::close_gently(stream).await
    } else {
        driver::serve_connection(w, stream, peer, local, conn, None).await
    }
}

/// A TLS connection: the bounded handshake, then HTTP/2 or HTTP/1 as ALPN
/// says, over TCP on tokio's poller or on the worker's io_uring.
#[allow(clippy::too_many_arguments)]
async fn serve_tls<P: Phases, T>(
    w: Arc<Worker<P>>,
    t: Arc<pier_tls::ServerTls>,
    stream: T,
    listener: Option<usize>,
    peer: std::net::SocketAddr,
    local: std::net::SocketAddr,
    conn: session::ConnInfo,
    slot: Slot,
) where
    T: pier_tls::Transport + 'static,
    pier_tls::ServerStream<T>: pier_core::Stream,
{
    let _slot = slot;
    // Until its handshake is done a TLS connection is as evictable as one
    // waiting for a head: a silent socket holds a connection slot (the
    // oldest such goes first when the worker is full), never a handshake
    // slot. Its listener's ClientHello waits are bounded too, by evicting
    // the oldest of them here.
    let tag = listener.map_or(u32::MAX, |i| i as u32 + 1);
    if t.hellos_full() {
        let now = pier_lb::recent_ms();
        let room = w
            .waiting
            .borrow_mut()
            .evict_oldest_tagged(tag, now, evict::MIN_AGE_MS);
        if room {
            w.shared.metrics.evicted_connection();
        } else {
            w.shared.metrics.refused_connection();
            pier_tls::stats::stats().failure(pier_tls::stats::Failure::Overload);
            return;
        }
    }
    let waiting = evict::Waiting::enter_tagged(&w.waiting, pier_lb::recent_ms(), tag);
    // Bounded in time and in number, counted (pier-tls).
    let accepted = Box::pin(t.accept(stream, waiting.evicted())).await;
    drop(waiting);
    let Some((stream, info)) = accepted else {
        return;
    };
    drop(t);
    let is_h2 = info.alpn.as_deref() == Some("h2");
    let conn = session::ConnInfo {
        tls: Some(Arc::new(info)),
        ..conn
    };
    if is_h2 {
        Box::pin(mux::serve_h2(w, stream, peer, local, conn)).await
    } else {
        // The TLS stream lives in this box (rustls state).
        Box::pin(driver::serve_connection(w, stream, peer, local, conn, None)).await
    }
}

/// One accepted connection in `pier_active_connections` (counted at accept,
/// released on every path out of its task).
struct ActiveConnection(Arc<Shared>);

impl Drop for ActiveConnection {
    fn drop(&mut self) {
        self.0.metrics.active_connections.fetch_sub(1, Relaxed);
    }
}

pub(crate) use pier_session::boxed_in_place;
