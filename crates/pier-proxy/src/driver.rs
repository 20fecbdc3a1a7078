//! The driver: one downstream HTTP/1.1 connection, request after request,
//! through the phases. The whole life of a request is readable here, top to
//! bottom (docs/phases.md draws the same chart):
//!
//! ```text
//! read_head ─► route ─► request_filter ─► [upstream_peer ─► connect/reuse ─►
//!   upstream_request_filter ─► send head (+ body, concurrently with) ─►
//!   read response head ─► response_filter ─► send head ─► relay body]
//!   ─► logging ─► keep-alive? ─► read_head …
//! ```
//! The bracket is one attempt; a failed attempt that sent nothing to the
//! client may be retried on another peer (bounded by the route's retries and
//! the group's retry budget).

use crate::forward::Outgoing;
use crate::phases::{Flow, LocalResponse, Phases, Step};
use crate::session::{ConnInfo, Session};
use crate::state::State;
use crate::Worker;
use bytes::{Buf, BytesMut};
use pier_clock::timeout;
use pier_config::HostHeader;
use pier_core::Stream;
use pier_error::{Error, Kind};
use pier_h1::{H1Downstream, H1RequestSink};
use pier_http::known;
use pier_http::{BodyLen, ResponseHead};
use pier_log::metrics::GaugeGuard;
use pier_session::{
    BodySize, Downstream, DownstreamOpts, RequestSink, RequestSource, ResponseSink, ResponseSource,
    UpstreamSession,
};
use std::cell::RefCell;
use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;
use tokio::io::AsyncReadExt;

use pier_h1::READ_CHUNK;

/// Per-connection buffers, reused for every request on the connection.
struct Bufs {
    /// Client bytes not yet consumed (head, body, pipelined requests).
    rbuf: BytesMut,
    /// What goes to the client (heads, framed body pieces).
    out: Vec<u8>,
    work: Work,
}

/// A request's own buffers, beside the downstream's.
pub(crate) struct Work {
    /// Origin bytes not yet relayed.
    ubuf: BytesMut,
    /// The response head (the origin's, or Pier's own).
    resp: ResponseHead,
    /// The upstream request head.
    head: Vec<u8>,
    /// This request's cache fill, if its answer may be stored.
    cache: Option<Box<crate::cache::CacheFill>>,
}

impl Work {
    /// A request's buffers from the worker's pool (HTTP/2 streams; an
    /// HTTP/1 connection keeps its own between requests).
    pub(crate) fn take(pool: &RefCell<BufPool>) -> Work {
        let mut p = pool.borrow_mut();
        Work {
            ubuf: BytesMut::new(),
            resp: p.take_resp(),
            head: Vec::new(),
            cache: None,
        }
    }
    /// Back to the pool, with the session's heads.
    pub(crate) fn release(&mut self, sess: &mut Session, pool: &RefCell<BufPool>) {
        let mut p = pool.borrow_mut();
        p.put(std::mem::take(&mut self.ubuf));
        p.put_vec(std::mem::take(&mut self.head));
        p.put_head(std::mem::take(&mut sess.req));
        p.put_head(std::mem::take(&mut sess.up_req));
        p.put_resp(std::mem::take(&mut self.resp));
    }
}

/// Heads whose storage grew past this are freed between requests rather
/// than kept in the worker's pool (a big head is rare).
const KEEP_HEAD_BYTES: usize = 2048;

/// A worker's spare I/O buffers (single-threaded, like the worker), bounded
/// in count and in the size of what it keeps.
#[derive(Default)]
pub struct BufPool {
    /// HTTP/1 connections' sessions and buffers, between their requests.
    /// Boxed on purpose: a connection holds the box while busy, so taking
    /// and returning one moves a pointer, not the ~1 KB it points to.
    #[allow(clippy::vec_box)]
    busy: Vec<Box<Busy>>,
    /// The fewest boxes `busy` held since the last `trim_busy`: that many
    /// sat unused for a whole period.
    busy_low: usize,
    bytes: Vec<BytesMut>,
    vecs: Vec<Vec<u8>>,
    heads: Vec<pier_http::RequestHead>,
    resps: Vec<ResponseHead>,
}

impl BufPool {
    /// Buffers kept per worker; past it, returned buffers are freed.
    const MAX: usize = 64;
    /// Buffers that grew past this (large bodies) are freed, not kept.
    const MAX_CAP: usize = 64 * 1024;

    /// Sessions kept at most. Above `MAX`: with hundreds of connections
    /// per worker, as many sessions are out at once and their number swings
    /// by more than `MAX` between polls; with the old bound of `MAX`, 42% of
    /// requests allocated a new session and its 16 KiB read buffer at 500
    /// cosocket connections (callgrind, BENCHMARKS.md stop 26). What a swing
    /// leaves beyond `MAX` is freed by `trim_busy` once unused for a period.
    const MAX_BUSY: usize = 512;

    /// A pooled session (with its buffers), if any.
    fn take_busy(&mut self) -> Option<Box<Busy>> {
        let bz = self.busy.pop();
        self.busy_low = self.busy_low.min(self.busy.len());
        bz
    }

    /// Once a period (the worker's one-second tick): free the sessions above
    /// `MAX` that none took during the whole period, so a burst's sessions
    /// do not outlive it by more than two periods.
    pub(crate) fn trim_busy(&mut self) {
        let spare = self.busy_low.min(self.busy.len().saturating_sub(Self::MAX));
        self.busy.truncate(self.busy.len() - spare);
        self.busy_low = self.busy.len();
    }

    /// Whether a returned buffer of `cap` bytes joins a list holding `held`.
    fn keeps(cap: usize, held: usize) -> bool {
        cap > 0 && cap <= Self::MAX_CAP && held < Self::MAX
    }
    fn put(&mut self, mut b: BytesMut) {
        if Self::keeps(b.capacity(), self.bytes.len()) {
            b.clear();
            self.bytes.push(b);
        }
    }
    fn put_vec(&mut self, mut v: Vec<u8>) {
        if Self::keeps(v.capacity(), self.vecs.len()) {
            v.clear();
            self.vecs.push(v);
        }
    }
    fn put_head(&mut self, h: pier_http::RequestHead) {
        let cap = h.headers.capacity_bytes();
        if Self::keeps(cap, self.heads.len()) && cap <= KEEP_HEAD_BYTES {
            self.heads.push(h);
        }
    }
    pub(crate) fn take_head(&mut self) -> pier_http::RequestHead {
        self.heads.pop().unwrap_or_default()
    }
    fn put_resp(&mut self, h: ResponseHead) {
        let cap = h.headers.capacity_bytes();
        if Self::keeps(cap, self.resps.len()) && cap <= KEEP_HEAD_BYTES {
            self.resps.push(h);
        }
    }
    fn take_resp(&mut self) -> ResponseHead {
        self.resps.pop().unwrap_or_default()
    }
    pub(crate) fn take(&mut self) -> BytesMut {
        self.bytes
            .pop()
            .unwrap_or_else(|| BytesMut::with_capacity(READ_CHUNK))
    }
    pub(crate) fn take_vec(&mut self) -> Vec<u8> {
        self.vecs.pop().unwrap_or_else(|| Vec::with_capacity(1024))
    }
}

enum Relayed {
    /// Response done. `upstream_reusable`, `client_keep`.
    Done(bool, bool),
    /// 101 sent; tunnel the rest.
    Upgrade,
}

/// What a connection holds only while it has a request to serve (a head
/// arriving, a request running, pipelined bytes): the session and the
/// buffers. Boxed, and pooled per worker in between, so an idle keep-alive
/// connection holds neither (its task keeps only the stream and a few
/// words), and a busy one takes them back in one step, buffers attached.
struct Busy {
    sess: Session,
    b: Bufs,
}

impl Busy {
    fn new(client: SocketAddr, local: SocketAddr) -> Box<Busy> {
        Box::new(Busy {
            sess: Session::new(client, local),
            b: Bufs {
                rbuf: BytesMut::new(),
                out: Vec::new(),
                work: Work {
                    ubuf: BytesMut::new(),
                    resp: ResponseHead::default(),
                    head: Vec::new(),
                    cache: None,
                },
            },
        })
    }
}

/// The connection's own facts, lent to its `Busy` while it is taken (two
/// swaps instead of a clone and a format per request).
struct Lent {
    client: SocketAddr,
    local: SocketAddr,
    conn: ConnInfo,
    client_ip: String,
    /// The connection's admission slots, released with the task.
    _slot: Option<crate::Slot>,
}

impl Lent {
    fn lend(&mut self, bz: &mut Busy) {
        bz.sess.client = self.client;
        bz.sess.peer = self.client;
        bz.sess.local = self.local;
        std::mem::swap(&mut bz.sess.conn, &mut self.conn);
        std::mem::swap(&mut bz.sess.client_ip, &mut self.client_ip);
    }
    fn take_back(&mut self, bz: &mut Busy) {
        std::mem::swap(&mut bz.sess.conn, &mut self.conn);
        std::mem::swap(&mut bz.sess.client_ip, &mut self.client_ip);
    }
}

/// Serve one client connection until it closes, idles out, or errs. The
/// stream is any byte stream (TCP, TLS, an in-memory pipe): the driver never
/// names a socket type.
///
/// While the connection idles between requests, its task waits for the
/// first byte holding only the stream and its own facts; the session and
/// buffers ([`Busy`]) come from the worker's pool when bytes arrive and go
/// back when the request is done and nothing else was sent.
pub fn serve_connection<P: Phases, S: Stream>(
    w: Arc<Worker<P>>,
    stream: S,
    client: SocketAddr,
    local: SocketAddr,
    conn: ConnInfo,
    slot: Option<crate::Slot>,
) -> impl Future<Output = ()> {
    // Not an `async fn`: its arguments would stay in the task for its whole
    // life beside `Lent`, which holds them (~100 bytes per connection).
    let lent = Lent {
        client,
        local,
        conn,
        client_ip: crate::session::ip_text(client.ip()),
        _slot: slot,
    };
    connection_loop(w, stream, lent)
}

async fn connection_loop<P: Phases, S: Stream>(w: Arc<Worker<P>>, mut stream: S, mut lent: Lent) {
    let mut drain = w.shared.drain_rx();
    let mut state = w.shared.state.load_full();
    let mut first = true;
    let mut busy: Option<Box<Busy>> = None;
    loop {
        w.shared.refresh(&mut state);
        if busy.is_none() {
            // Waiting for a head: evictable when the worker is full, and
            // evicted when it idles out (`client_header` for a new
            // connection, which must start talking, `client_idle` for a
            // kept-alive one), by the worker's sweeper (evict.rs): the
            // connection holds no timer while it idles.
            let t = &state.cfg.timeouts;
            let idle = if first {
                t.client_header
            } else {
                t.client_idle
            };
            let now = pier_lb::recent_ms();
            let deadline = now.saturating_add(idle.as_millis().min(u64::MAX as u128) as u64);
            let waiting = if first {
                pier_core::evict::Waiting::enter_until(&w.waiting, now, deadline)
            } else {
                pier_core::evict::Waiting::enter_kept_until(&w.waiting, now, deadline)
            };
            if w.waiting.borrow_mut().claim_sweeper() {
                let w = w.clone();
                tokio::task::spawn_local(async move {
                    pier_core::evict::sweep(&w.waiting, pier_lb::recent_ms).await
                });
            }
            // A drain closes kept-alive connections between requests (the
            // drainer evicts them), but not one accepted and not yet
            // heard: its client connected to be served (at a binary
            // upgrade, to a socket both processes share) and is probably
            // sending its first request right now. It gets that one
            // request (with `Connection: close`), within `client_header`.
            if *drain.borrow() && !first {
                break;
            }
            // A drain reaches an idle connection as an eviction too
            // (`run_worker` evicts every waiting connection), so this holds
            // no watch waiter; nor a readiness waiter node (`poll_readable`).
            let ready = tokio::select! {
                r = std::future::poll_fn(|cx| stream.poll_readable(cx)) => r.is_ok(),
                // Evicted (for a new connection, idled out, draining): close
                // without a word, as nginx does.
                _ = waiting.evicted() => false,
            };
            drop(waiting);
            if !ready {
                break;
            }
            // A reload while this connection waited applies to its next request.
            w.shared.refresh(&mut state);
        }
        let mut bz = match busy.take() {
            Some(bz) => bz,
            None => {
                let mut bz = w
                    .bufs
                    .borrow_mut()
                    .take_busy()
                    .unwrap_or_else(|| Busy::new(lent.client, lent.local));
                lent.lend(&mut bz);
                bz
            }
        };
        // Boxed: the connection's task stays small while it idles; the
        // request's (larger) state machine, its phase context included,
        // exists only while it runs.
        let keep = crate::boxed_in_place(|| {
            serve_request(&w, &state, &mut stream, &mut bz, &mut drain, first)
        })
        .await;
        first = false;
        bz.sess.forget_named_client();
        if keep && !bz.b.rbuf.is_empty() {
            // Pipelined bytes: the next head is (partly) here already.
            busy = Some(bz);
            continue;
        }
        lent.take_back(&mut bz);
        w.put_busy(bz);
        if !keep {
            break;
        }
    }
    if let Some(mut bz) = busy {
        lent.take_back(&mut bz);
        w.put_busy(bz);
    }
    // TLS: close_notify (bounded: a client that reads nothing cannot hold
    // the connection open by it). Boxed: its timer would otherwise be part
    // of every idle connection's future.
    let _ = Box::pin(timeout(CLOSE_NOTIFY_WAIT, stream.close())).await;
}

/// How long a closing connection may take to send its goodbye (TLS
/// close_notify) before it is dropped anyway.
const CLOSE_NOTIFY_WAIT: Duration = Duration::from_secs(1);

impl<P: Phases> Worker<P> {
    /// A connection's `Busy` back to the worker's pool (at most
    /// `BufPool::MAX_BUSY`), its buffers trimmed to what the pool keeps.
    fn put_busy(&self, mut bz: Box<Busy>) {
        let mut pool = self.bufs.borrow_mut();
        if pool.busy.len() >= BufPool::MAX_BUSY {
            return;
        }
        let b = &mut bz.b;
        b.work.cache = None;
        for buf in [&mut b.rbuf, &mut b.work.ubuf] {
            buf.clear();
            if buf.capacity() > BufPool::MAX_CAP {
                *buf = BytesMut::new();
            }
        }
        for v in [&mut b.out, &mut b.work.head] {
            v.clear();
            if v.capacity() > BufPool::MAX_CAP {
                *v = Vec::new();
            }
        }
        if b.work.resp.headers.capacity_bytes() > KEEP_HEAD_BYTES {
            b.work.resp = ResponseHead::default();
        }
        for h in [&mut bz.sess.req, &mut bz.sess.up_req] {
            if h.headers.capacity_bytes() > KEEP_HEAD_BYTES {
                *h = pier_http::RequestHead::default();
            }
        }
        pool.busy.push(bz);
    }
}

/// One request on an HTTP/1 connection whose first bytes are here: its
/// head, the steps, the logging step. Whether the connection goes on.
async fn serve_request<P: Phases, S: Stream>(
    w: &Arc<Worker<P>>,
    state: &Arc<State>,
    stream: &mut S,
    bz: &mut Busy,
    drain: &mut tokio::sync::watch::Receiver<bool>,
    first: bool,
) -> bool {
    let Busy { sess, b } = bz;
    let r = {
        // A head still arriving is evictable too (a slowloris).
        let waiting = pier_core::evict::Waiting::enter(&w.waiting, pier_lb::recent_ms());
        tokio::select! {
            r = read_head(stream, &mut b.rbuf, &w.bufs, sess, state, first) => r,
            _ = waiting.evicted() => Ok(false),
        }
    };
    match r {
        Ok(true) => {}
        Ok(false) => return false,
        Err(kind) => {
            sess.begin_now();
            sess.step = Step::Fail;
            answer_plain(state, stream, b, sess, kind).await;
            w.shared.metrics.local_response(kind);
            finish(w, state, sess, None);
            return false;
        }
    }
    {
        let mut pool = w.bufs.borrow_mut();
        if sess.up_req.headers.capacity_bytes() == 0 {
            sess.up_req = pool.take_head();
        }
        if b.work.resp.headers.capacity_bytes() == 0 {
            b.work.resp = pool.take_resp();
        }
        if b.out.capacity() == 0 {
            b.out = pool.take_vec();
        }
    }
    sess.begin_now();
    // Released on every path out, a panic's unwinding included.
    let active = GaugeGuard::enter(&w.shared.metrics.active_requests);
    let mut down = H1Downstream {
        stream: &mut *stream,
        rbuf: &mut b.rbuf,
        out: &mut b.out,
    };
    // A panic in the request (a bug) costs this request and its connection
    // only: its guards are released as the future is dropped.
    // Pinned in place, not boxed: this future is itself in the request's
    // box (`serve_connection`), so a second allocation per request buys
    // nothing. The block drops it (and its guards) before anything else.
    let keep = {
        let run = std::pin::pin!(run_request(w, state, &mut down, &mut b.work, sess));
        CatchUnwind(run).await
    };
    let keep = match keep {
        Ok(keep) => keep,
        Err(()) => {
            w.shared
                .metrics
                .panics
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            tracing::error!(step = ?sess.step, "request task panicked; connection closed");
            if sess.bytes_sent == 0 {
                answer_plain(state, stream, b, sess, Kind::Internal).await;
            } else {
                sess.status = 500;
            }
            sess.reason = Kind::Internal.reason();
            false
        }
    };
    drop(active);
    let route = sess.route;
    finish(w, state, sess, route);
    keep && !*drain.borrow()
}

/// A request through the steps, a panic in it turned into a 500 (when
/// nothing was sent yet) that costs this request only. For downstreams
/// that own no connection-level state (an HTTP/2 stream).
pub(crate) async fn run_guarded<P: Phases, D: Downstream>(
    w: &Worker<P>,
    state: &Arc<State>,
    down: &mut D,
    b: &mut Work,
    sess: &mut Session,
) {
    if sess.up_req.headers.capacity_bytes() == 0 {
        sess.up_req = w.bufs.borrow_mut().take_head();
        sess.up_req.copy_from(&sess.req);
    }
    let active = GaugeGuard::enter(&w.shared.metrics.active_requests);
    let r = {
        let run = std::pin::pin!(run_request(w, state, down, b, sess));
        CatchUnwind(run).await
    };
    if r.is_err() {
        w.shared
            .metrics
            .panics
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        tracing::error!(step = ?sess.step, "request task panicked");
        if sess.bytes_sent == 0 {
            answer_error(w, state, down, b, sess, Kind::Internal).await;
        } else {
            sess.status = 500;
        }
        sess.reason = Kind::Internal.reason();
    }
    drop(active);
}

/// One request of a multiplexed connection (an HTTP/2 stream; any protocol
/// whose crate implements `pier_session::Engine`'s caller): its head made
/// from `parts` by the HTTP/1 parser's rules and limits, through the steps,
/// logged, its buffers back to the worker's pool.
pub(crate) async fn serve_stream<P: Phases, D: Downstream>(
    w: &Worker<P>,
    down: &mut D,
    parts: &impl pier_session::RequestParts,
    client: SocketAddr,
    local: SocketAddr,
    conn: &ConnInfo,
) {
    let state = w.shared.state.load_full();
    // A session and buffers from the worker's pool, as an HTTP/1
    // connection takes them: a fresh session for each stream cost two
    // allocations for its box and strings, two more as its upstream head
    // grew, and their frees (callgrind, h2c /hello).
    let taken = w.bufs.borrow_mut().take_busy();
    let mut bz = taken.unwrap_or_else(|| Busy::new(client, local));
    let Busy { sess, b } = &mut *bz;
    sess.client = client;
    sess.peer = client;
    sess.local = local;
    sess.conn.clone_from(conn);
    crate::session::ip_text_into(client.ip(), &mut sess.client_ip);
    let made = match parts.refused() {
        Some(kind) => Err(kind),
        None => state.request_from_parts(
            &mut sess.req,
            parts.method(),
            parts.target(),
            parts.authority(),
            parts.fields(),
            parts.has_body(),
        ),
    };
    sess.begin(pier_http::date::now_ns());
    match made {
        Ok(()) => {
            run_guarded(w, &state, down, &mut b.work, sess).await;
            let route = sess.route;
            finish(w, &state, sess, route);
        }
        Err(kind) => {
            answer_error(w, &state, down, &mut b.work, sess, kind).await;
            finish(w, &state, sess, None);
        }
    }
    w.put_busy(bz);
}

/// Answer an error no route sees (a malformed request, a panic) on any
/// downstream.
pub(crate) async fn answer_error<P: Phases, D: Downstream>(
    w: &Worker<P>,
    state: &State,
    down: &mut D,
    b: &mut Work,
    sess: &mut Session,
    kind: Kind,
) {
    let r = local_error(kind);
    crate::local::local_head(&mut b.resp, &r);
    let _ = write_local(state, down, &mut b.resp, sess, r.reason, &r.body, true).await;
    w.shared.metrics.local_response(kind);
}

/// One request, its phase context and its logging step.
async fn run_request<P: Phases, D: Downstream>(
    w: &Worker<P>,
    state: &Arc<State>,
    down: &mut D,
    b: &mut Work,
    sess: &mut Session,
) -> bool {
    let mut ctx = P::Ctx::default();
    let keep = handle_request(w, state, down, b, sess, &mut ctx).await;
    // A fill lock never outlives its request.
    b.cache = None;
    sess.step = Step::Logging;
    w.phases.logging(state, sess, &mut ctx);
    keep
}

/// Stale-while-revalidate: the request that refreshes a key, run through
/// the steps on its own task (the client already has the stale answer), its
/// response stored by the cache step and otherwise dropped. One per key
/// (`guard`, released when the task ends).
fn spawn_refresh<P: Phases>(
    w: &Worker<P>,
    state: &Arc<State>,
    sess: &Session,
    req: pier_http::RequestHead,
    guard: crate::cache::RefreshGuard,
) {
    let Some(w) = w.me.upgrade() else {
        return;
    };
    let state = state.clone();
    let mut s = Box::new(Session::new(sess.client, sess.local));
    s.peer = sess.peer;
    s.client_ip.clone_from(&sess.client_ip);
    // Not from a listener: listener-level rules (an https redirect) do not
    // apply, and the cache step knows it for Pier's own.
    s.conn = crate::session::ConnInfo {
        listener: None,
        ..sess.conn.clone()
    };
    s.req = req;
    tokio::task::spawn_local(async move {
        let _guard = guard;
        let mut work = Work::take(&w.bufs);
        let mut down = crate::cache::NullDownstream::default();
        s.begin(pier_http::date::now_ns());
        run_guarded(&w, &state, &mut down, &mut work, &mut s).await;
        let route = s.route;
        finish(&w, &state, &mut s, route);
        work.release(&mut s, &w.bufs);
    });
}

/// Answer an error that no route's filters see (a bad head, a panic) and
/// close.
async fn answer_plain<S: Stream>(
    state: &State,
    stream: &mut S,
    b: &mut Bufs,
    sess: &mut Session,
    kind: Kind,
) {
    let r = local_error(kind);
    crate::local::local_head(&mut b.work.resp, &r);
    let mut down = H1Downstream {
        stream,
        rbuf: &mut b.rbuf,
        out: &mut b.out,
    };
    let _ = write_local(
        state,
        &mut down,
        &mut b.work.resp,
        sess,
        r.reason,
        &r.body,
        true,
    )
    .await;
}

/// A future that turns a panic inside it into `Err(())`, so that the
/// connection can answer 500 and close instead of vanishing.
struct CatchUnwind<F>(F);

impl<F: Future + Unpin> Future for CatchUnwind<F> {
    type Output = Result<F::Output, ()>;
    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let f = &mut self.0;
        match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| Pin::new(f).poll(cx))) {
            Ok(Poll::Ready(v)) => Poll::Ready(Ok(v)),
            Ok(Poll::Pending) => Poll::Pending,
            Err(_) => Poll::Ready(Err(())),
        }
    }
}

/// Metrics and access log for one finished request.
pub(crate) fn finish<P: Phases>(
    w: &Worker<P>,
    state: &State,
    sess: &mut Session,
    route: Option<usize>,
) {
    // The request's second (and last) precise clock read.
    let dur_us = pier_clock::now()
        .saturating_duration_since(sess.started)
        .as_micros() as u64;
    crate::trace::finish(state, sess, route, dur_us);
    let sess = &*sess;
    let metric = route
        .map(|r| state.routes[r].metric)
        .unwrap_or(pier_log::metrics::MAX_ROUTES - 1);
    w.shared.metrics.request(metric, sess.status, dur_us);
    crate::trace::exemplar(&w.shared.metrics, sess, dur_us);
    if sess.conn.proto != pier_session::Protocol::Http1 {
        // Only the multiplexed protocols are counted apart: HTTP/1.x is the
        // rest of pier_requests_total, and its hot path pays no shared atomic.
        w.shared.metrics.by_protocol[sess.conn.proto.index()]
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    }
    if let Some(a) = &w.shared.analytics {
        record_event(a, state, sess, route, dur_us);
    }
    let log = &w.shared.access;
    if log.enabled() {
        let mut up = [0u8; 64];
        let up_len = sess.upstream.map(|a| fmt_addr(&mut up, a)).unwrap_or(0);
        let mut peer = [0u8; 64];
        let trace = crate::trace::of(sess);
        let peer_len = if sess.client != sess.peer {
            fmt_addr(&mut peer, sess.peer)
        } else {
            0
        };
        let dropped = log.log(&pier_log::AccessRecord {
            ts_ms: sess.now_ns / 1_000_000,
            client: sess.client_ip.as_bytes(),
            method: sess.req.method(),
            uri: sess.req.uri(),
            protocol: sess.conn.proto.version(sess.req.version),
            host: sess.req.host().unwrap_or(b""),
            status: sess.status,
            bytes_sent: sess.bytes_sent,
            duration_us: dur_us,
            route: route.map(|r| state.routes[r].name.as_str()).unwrap_or(""),
            upstream: &up[..up_len],
            reason: sess.reason,
            tls: sess.conn.tls.as_deref().map(|t| pier_log::TlsFields {
                version: t.version,
                cipher: t.cipher,
                sni: t.sni.as_deref().unwrap_or(""),
                alpn: t.alpn.as_deref().unwrap_or(""),
                client: t.client_subject.as_deref().unwrap_or(""),
            }),
            peer: &peer[..peer_len],
            cache: sess.cache.as_str(),
            trace_id: trace.map_or(&b""[..], |t| t.trace_hex()),
            span_id: trace.map_or(&b""[..], |t| t.span_hex()),
        });
        if dropped > 0 {
            w.shared.metrics.log_dropped(dropped);
        }
    }
}

/// The logging step's hand-off to the analytics thread (pier_analytics::hub).
fn record_event(
    a: &pier_analytics::hub::Hub,
    state: &State,
    sess: &Session,
    route: Option<usize>,
    dur_us: u64,
) {
    let protocol = sess.conn.proto.version(sess.req.version);
    let tls = sess
        .conn
        .tls
        .as_deref()
        .map(|t| pier_analytics::hub::tls_version(t.version))
        .unwrap_or("");
    let ua = sess
        .req
        .headers
        .get_known(pier_http::known::USER_AGENT)
        .unwrap_or(b"");
    let trace = crate::trace::of(sess);
    pier_log::fields::take(|extra| {
        a.record(
            &pier_analytics::EventRef {
                ts_ms: sess.now_ns / 1_000_000 + dur_us / 1000,
                host: sess.req.host().unwrap_or(b""),
                route: route.map(|r| state.routes[r].name.as_str()).unwrap_or(""),
                method: sess.req.method(),
                path: sess.req.path(),
                status: sess.status,
                bytes_in: sess.bytes_received,
                bytes_out: sess.bytes_sent,
                duration_us: dur_us,
                upstream_us: sess.upstream_us as u64,
                client_ip: pier_config::normalize(sess.client.ip()),
                user_agent: ua,
                listener: sess
                    .conn
                    .listener
                    .and_then(|i| state.cfg.listeners.get(i))
                    .map(|l| l.name.as_str())
                    .unwrap_or(""),
                // Formatted on the analytics thread, and only for a sink:
                // the rollups don't use it.
                upstream: b"",
                cache: sess.cache.as_str(),
                protocol: "",
                tls_version: "",
                extra,
                trace_id: trace.map_or(&b""[..], |t| t.trace_hex()),
                span_id: trace.map_or(&b""[..], |t| t.span_hex()),
            },
            protocol,
            tls,
            sess.upstream,
        )
    });
}

fn fmt_addr(buf: &mut [u8; 64], a: SocketAddr) -> usize {
    use std::io::Write;
    let mut c = std::io::Cursor::new(&mut buf[..]);
    let _ = write!(c, "{a}");
    c.position() as usize
}

// === reading the request head ===

/// `Ok(true)`: a head is parsed into `sess.req` and consumed from `rbuf`.
/// `Ok(false)`: the client went away or idled out between requests: close
/// quietly.
async fn read_head<S: Stream>(
    stream: &mut S,
    rbuf: &mut BytesMut,
    pool: &RefCell<BufPool>,
    sess: &mut Session,
    state: &State,
    first: bool,
) -> Result<bool, Kind> {
    let t = &state.cfg.timeouts;
    // A new connection gets `client_header` to start talking (a silent
    // connection is a slowloris too); a kept-alive one gets `client_idle`.
    let idle = if first {
        t.client_header
    } else {
        t.client_idle
    };
    let mut header_deadline: Option<tokio::time::Instant> = None;
    loop {
        if !rbuf.is_empty() {
            if sess.req.headers.capacity_bytes() == 0 {
                sess.req = pool.borrow_mut().take_head();
            }
            if let Some(n) = state.parse_request(&mut sess.req, rbuf)? {
                rbuf.advance(n);
                return Ok(true);
            }
        }
        if rbuf.is_empty() && header_deadline.is_none() {
            // The first bytes of a head (the connection's idle wait saw
            // them coming): a buffer only now. Then
            // `read_buf`, not `try_read_buf`: a short read must clear the
            // readiness, or the next idle wait would wake at once.
            // Not stopped by a drain: the head's first bytes are here or
            // on their way (connection_loop saw the socket readable, or
            // the connection is new), and the request is answered, with
            // `Connection: close`.
            let first_bytes = async {
                stream.readable().await?;
                if rbuf.capacity() == 0 {
                    *rbuf = pool.borrow_mut().take();
                }
                rbuf.reserve(4096);
                stream.read_buf(rbuf).await
            };
            match timeout(idle, first_bytes).await {
                Ok(Ok(0)) | Ok(Err(_)) | Err(_) => return Ok(false),
                Ok(Ok(_)) => header_deadline = Some(pier_clock::tokio_deadline(t.client_header)),
            }
        } else {
            rbuf.reserve(4096);
            let deadline =
                *header_deadline.get_or_insert_with(|| pier_clock::tokio_deadline(t.client_header));
            match tokio::time::timeout_at(deadline, stream.read_buf(rbuf)).await {
                Ok(Ok(0)) | Ok(Err(_)) => return Ok(false),
                Ok(Ok(_)) => {}
                Err(_) => return Err(Kind::HeaderTimeout),
            }
        }
    }
}

// === one request ===

/// What a request carries from step to step: the driver's locals, named.
struct Walk {
    /// Body bytes the client may still send (the connection closes after
    /// an answer that leaves them unread).
    body_pending: bool,
    route: usize,
    retries: u32,
    /// Peers tried (by index in the group), skipped by the next pick.
    tried: [usize; 16],
    ntried: usize,
    attempt: u32,
    stale_retry_used: bool,
    /// The error to answer when no peer is left.
    last: Kind,
    /// A peer a phase chose (the balancer hook, or a `Flow::Retry`).
    forced: Option<SocketAddr>,
    /// The attempt `Step::Fail` decides about: its peer, and how it failed.
    failed: Option<(SocketAddr, Error)>,
    /// A miss asking the zone's cache parents first (`crate::tier`).
    tier: Option<crate::tier::Tier>,
}

impl Walk {
    fn tried(&mut self, i: usize) -> bool {
        if self.ntried < self.tried.len() {
            self.tried[self.ntried] = i;
            self.ntried += 1;
            return true;
        }
        false
    }
}

/// Where a step leads.
enum Next {
    /// On to this step.
    Go(Step),
    /// Answer with a Pier-made response (`respond`).
    Answer(LocalResponse),
    /// Answer this error (`local_fail`); `true`: close the connection after.
    Error(Kind, bool),
    /// The request is over: whether the connection may carry another.
    Done(bool),
}

/// A phase's `Flow` where only `Continue` and `Respond` mean anything.
fn flow(r: Result<Flow, Error>, then: Step, w: &Walk) -> Next {
    match r {
        Ok(Flow::Continue) => Next::Go(then),
        Ok(Flow::Respond(r)) => Next::Answer(r),
        // `Flow::Retry` answers a failed attempt, and there is none here.
        Ok(Flow::Retry { .. }) => Next::Error(Kind::HookError, w.body_pending),
        Err(e) => Next::Error(e.kind, w.body_pending),
    }
}

/// One request, from its routing to its answer: a loop over the steps
/// (`Step`, docs/phases.md box for box), one function a step. The head was
/// read by the downstream session (`serve_connection`, `serve_h2`:
/// `Step::ReadHead`); the exchange's steps (`Step::Send` to `Step::Write`)
/// are `Attempt`'s, the request body streaming beside them; logging
/// follows the request (`finish`).
pub(crate) async fn handle_request<P: Phases, D: Downstream>(
    w: &Worker<P>,
    state: &Arc<State>,
    down: &mut D,
    b: &mut Work,
    sess: &mut Session,
    ctx: &mut P::Ctx,
) -> bool {
    sess.client_keep = sess.req.keep_alive();
    crate::forward::real_client(state, sess);
    let mut walk = Walk {
        body_pending: sess.req.body_len() != BodyLen::None,
        route: 0,
        retries: 0,
        tried: [0; 16],
        ntried: 0,
        attempt: 0,
        stale_retry_used: false,
        last: Kind::NoHealthyUpstream,
        forced: None,
        failed: None,
        tier: None,
    };
    let mut step = Step::Route;
    loop {
        sess.step = step;
        let next = match step {
            Step::Route => route(state, down, sess, &mut walk).await,
            Step::RequestFilter => request_filter(w, state, down, sess, ctx, &mut walk).await,
            Step::CacheLookup => cache_lookup(w, state, down, b, sess, ctx, &mut walk).await,
            Step::UpstreamPeer => upstream_peer(w, state, sess, ctx, &mut walk).await,
            Step::UpstreamRequestFilter => {
                apply_request_rules(state, walk.route, &mut sess.up_req);
                let r = w.phases.upstream_request_filter(state, sess, ctx).await;
                flow(r, Step::Connect, &walk)
            }
            Step::Connect => connect(w, state, down, b, sess, ctx, &mut walk).await,
            Step::Fail => fail(w, state, sess, ctx, &mut walk).await,
            // Not steps of this loop: the downstream session's, the
            // exchange's (`Attempt`), and the request's end (`finish`).
            Step::ReadHead
            | Step::Send
            | Step::UpstreamResponseFilter
            | Step::CacheStore
            | Step::ResponseFilter
            | Step::Write
            | Step::Logging => Next::Error(Kind::Internal, true),
        };
        match next {
            Next::Go(s) => step = s,
            Next::Answer(r) => {
                return respond(w, state, down, b, sess, ctx, &r, walk.body_pending).await
            }
            Next::Error(k, close) => {
                return local_fail(w, state, down, b, sess, ctx, k, close).await
            }
            Next::Done(keep) => return keep,
        }
    }
}

/// `Step::Route`: the request's one authority and canonical path to a
/// route; what can be refused before any phase runs is refused here.
async fn route<D: Downstream>(
    state: &State,
    down: &mut D,
    sess: &mut Session,
    walk: &mut Walk,
) -> Next {
    build_upstream_request(state, sess);
    // CONNECT would make Pier a tunnel to anywhere, and TRACE echoes the
    // request (credentials included) to whoever can make a browser send it.
    let m = sess.req.method_kind();
    if m == pier_http::Method::Connect || (m == pier_http::Method::Trace && !state.cfg.allow_trace)
    {
        return Next::Error(Kind::MethodNotAllowed, walk.body_pending);
    }
    // An ACME CA's HTTP-01 validation (`challenge = "http-01"`) is answered
    // ahead of routes and of `redirect_https`, on any Host, as Caddy does.
    if matches!(m, pier_http::Method::Get | pier_http::Method::Head) {
        if let Some(key_auth) = pier_tls::managed::http_challenge(sess.up_req.path()) {
            return Next::Answer(LocalResponse {
                status: 200,
                headers: vec![(
                    b"Content-Type".to_vec(),
                    b"application/octet-stream".to_vec(),
                )],
                body: key_auth.into_bytes(),
                reason: "acme-http-01",
                kind: None,
            });
        }
    }
    if let Some(r) = sess
        .conn
        .listener
        .and_then(|i| state.cfg.listeners.get(i))
        .and_then(|l| l.redirect_https)
    {
        return Next::Answer(https_redirect(sess, r));
    }
    let Some(route) = state.match_route(sess.up_req.host(), sess.up_req.path()) else {
        crate::trace::start(state, sess);
        return Next::Error(Kind::NoRoute, walk.body_pending);
    };
    sess.route = Some(route);
    crate::trace::start(state, sess);
    walk.route = route;
    let rc = &state.cfg.routes[route];
    if let Some(cors) = &rc.cors {
        if let Some(r) = crate::cors::preflight(cors, &sess.req) {
            return Next::Answer(r);
        }
    }
    if rc.grpc_web {
        if let Some(form) = pier_grpc::web::form_of(&sess.req) {
            sess.grpc_web = Some(form);
            pier_grpc::web::to_grpc_request(&mut sess.up_req, form);
        }
    }
    // Body bound known up front.
    let body = sess.req.body_len();
    let max_body = state.cfg.limits.max_body_bytes;
    if let BodyLen::Length(n) = body {
        if max_body > 0 && n > max_body {
            return Next::Error(Kind::BodyTooLarge, true);
        }
    }
    // A chunked body's framing is vetted before its head goes anywhere: the
    // bytes already read, and at least the first size line (unless the client
    // waits for 100-continue). A bad chunk later in a streamed body cuts the
    // origin connection mid-body instead (it is never reused).
    if body == BodyLen::Chunked {
        let wait = !sess.req.expects_continue();
        match down
            .vet_body(body, wait, state.cfg.timeouts.client_header)
            .await
        {
            Ok(()) => {}
            Err(Kind::ClientClosed) => return Next::Done(false),
            Err(k) => return Next::Error(k, true),
        }
    }
    Next::Go(Step::RequestFilter)
}

/// `Step::RequestFilter`: limits, Lua access/content.
async fn request_filter<P: Phases, D: Downstream>(
    w: &Worker<P>,
    state: &State,
    down: &mut D,
    sess: &mut Session,
    ctx: &mut P::Ctx,
    walk: &mut Walk,
) -> Next {
    // A phase may read the body in full first (Lua `ngx.req.read_body`):
    // that path is boxed, keeping this future small.
    let filtered = if walk.body_pending && w.phases.req_body(state, sess, ctx).is_some() {
        let o = down_opts(state, sess, sess.client_keep);
        let r = crate::req_body::request_filter(&w.phases, state, sess, ctx, down, &o);
        let r = Box::pin(r).await;
        walk.body_pending = !w
            .phases
            .req_body(state, sess, ctx)
            .is_some_and(|b| b.is_read());
        r
    } else {
        Ok(w.phases.request_filter(state, sess, ctx).await)
    };
    match filtered {
        Ok(r) => flow(r, Step::CacheLookup, walk),
        Err(Kind::ClientClosed) => Next::Done(false),
        Err(k) => Next::Error(k, true),
    }
}

/// `Step::CacheLookup`: the phases' lookup, then the route's cache; a hit
/// answers here (through the same relay as a proxied response).
async fn cache_lookup<P: Phases, D: Downstream>(
    w: &Worker<P>,
    state: &Arc<State>,
    down: &mut D,
    b: &mut Work,
    sess: &mut Session,
    ctx: &mut P::Ctx,
    walk: &mut Walk,
) -> Next {
    match w.phases.cache_lookup(state, sess, ctx).await {
        Ok(Flow::Continue) => {}
        r => return flow(r, Step::UpstreamPeer, walk),
    }
    b.cache = None;
    let route = walk.route;
    // A phase may bypass the cache or set the key (Lua `pier.cache`).
    let bypass = w.phases.cache_ctl(ctx).is_some_and(|c| c.bypass);
    if state.cfg.routes[route].cache.is_none() || bypass {
        return Next::Go(Step::UpstreamPeer);
    }
    let ctl = w.phases.cache_ctl(ctx).map(|c| &*c);
    match crate::cache::lookup(state, sess, route, ctl).await {
        crate::cache::Lookup::Hit(mut src) => {
            if let Some((req, guard)) = crate::cache::refresh_request(state, &mut src, sess) {
                spawn_refresh(w, state, sess, req, guard);
            }
            sess.step = Step::Write;
            let none: Option<&mut H1RequestSink<tokio::io::Sink>> = None;
            let r = exchange(
                w,
                state,
                down,
                &mut src,
                none,
                &mut b.resp,
                sess,
                ctx,
                &mut None,
            )
            .await;
            Next::Done(match r {
                Ok(Relayed::Done(_, keep)) => keep && !walk.body_pending && sess.client_keep,
                _ => false,
            })
        }
        crate::cache::Lookup::NotCached => Next::Error(Kind::UpstreamTimeout, walk.body_pending),
        crate::cache::Lookup::Miss(fill) => {
            walk.tier = crate::tier::begin(state, sess, route, fill.as_ref().map(|f| f.key()));
            b.cache = fill;
            Next::Go(Step::UpstreamPeer)
        }
    }
}

/// `Step::UpstreamPeer`: the balancer (or a hook) may choose the peer and
/// the retries.
async fn upstream_peer<P: Phases>(
    w: &Worker<P>,
    state: &State,
    sess: &mut Session,
    ctx: &mut P::Ctx,
    walk: &mut Walk,
) -> Next {
    let group = &state.groups[state.routes[walk.route].group];
    group.on_request_at(pier_lb::recent_ms());
    match w.phases.upstream_peer(state, sess, ctx).await {
        Ok(c) => {
            walk.forced = c.addr;
            walk.retries = c.retries.unwrap_or_else(|| group.retries());
            Next::Go(Step::UpstreamRequestFilter)
        }
        Err(e) => Next::Error(e.kind, walk.body_pending),
    }
}

/// `Step::Connect`: a peer (the forced one, else the balancer's pick past
/// the tried ones, within the servers' in-flight caps), then one attempt
/// on it. A failure goes to `Step::Fail`.
async fn connect<P: Phases, D: Downstream>(
    w: &Worker<P>,
    state: &State,
    down: &mut D,
    b: &mut Work,
    sess: &mut Session,
    ctx: &mut P::Ctx,
    walk: &mut Walk,
) -> Next {
    // A miss of a zone with parents asks the parent owning its key first
    // (`crate::tier`); none left: the origin.
    let parent = walk.tier.as_ref().and_then(|t| crate::tier::pick(state, t));
    if parent.is_none() {
        crate::tier::give_up(&mut walk.tier, sess);
    }
    sess.to_parent = parent.is_some();
    let group = match parent {
        Some((g, _)) => g,
        None => &state.groups[state.routes[walk.route].group],
    };
    let (addr, idx) = match (parent, walk.forced) {
        (Some((g, i)), _) => (g.peers()[i].addr, Some(i)),
        (None, Some(a)) => (a, None),
        (None, None) => {
            let key = group.hash_key().and_then(|k| {
                pier_lb::extract_hash_key(
                    k,
                    |name| sess.up_req.headers.get(name.as_bytes()),
                    sess.client_ip.as_bytes(),
                    sess.up_req.path(),
                )
            });
            let tried = &walk.tried[..walk.ntried];
            match group.select_at(key, tried, pier_lb::recent_ms()) {
                Some(i) => (group.peers()[i].addr, Some(i)),
                None => {
                    if walk.last == Kind::NoHealthyUpstream && group.at_capacity(tried) {
                        walk.last = Kind::UpstreamLimited;
                    }
                    return Next::Error(walk.last, walk.body_pending);
                }
            }
        }
    };
    if pier_config::denied(&state.cfg.deny_origins, addr.ip()) {
        return Next::Error(Kind::OriginDenied, walk.body_pending);
    }
    // In flight on the server until its response is read (dropped then,
    // before the last write to the client, so that a client that got its
    // response finds the server free). Taken atomically against the
    // server's caps (`max_connections_per_server`, and Pingora-style
    // origin protection `max_inflight_per_server`): a full server is
    // skipped like a tried one; 503 upstream-limited only when all are.
    let max_inflight = group.config().max_inflight_per_server as usize;
    let mut inflight = match idx {
        Some(i) => match group.try_begin(i, max_inflight) {
            Some(g) => Some(g),
            None => {
                walk.last = Kind::UpstreamLimited;
                if walk.tried(i) {
                    return Next::Go(Step::Connect);
                }
                return Next::Error(walk.last, walk.body_pending);
            }
        },
        None => None,
    };
    match w.phases.peer_selected(state, sess, ctx, addr) {
        Ok(Flow::Continue) => {}
        r => return flow(r, Step::Connect, walk),
    }
    sess.upstream = Some(addr);
    // An Arc clone only for servers given by name.
    sess.upstream_host = idx.and_then(|i| group.peers()[i].host.clone());
    // One attempt: a session from the connector, then the one exchange on
    // it, whatever its protocol (`Attempt`). In this function, not one of
    // its own: each async layer copies the exchange's whole future once.
    let bufs = crate::upstream::H1Bufs {
        ubuf: &mut b.ubuf,
        head: &mut b.head,
    };
    crate::trace::begin_attempt(sess, addr, walk.attempt);
    let up = crate::upstream::connect(w, state, sess, addr, walk.stale_retry_used, bufs).await;
    let attempt = Attempt {
        w,
        state,
        down,
        resp: &mut b.resp,
        cache: &mut b.cache,
        sess,
        ctx,
        addr,
        inflight: &mut inflight,
    };
    let res = crate::upstream::Upstream::run(up, attempt).await;
    drop(inflight);
    if sess.trace.is_some() {
        let failed = res.as_ref().err().map(|e| e.kind.reason());
        crate::trace::end_attempt(sess, failed);
    }
    match res {
        Ok(keep) => {
            if let Some(i) = idx {
                group.report(i, true, pier_lb::recent_ms());
            }
            Next::Done(keep && sess.client_keep)
        }
        Err(f) => {
            if f.stale && !walk.stale_retry_used && f.retryable {
                // The pooled connection had died while idle: not the
                // origin's fault and not a retry in the budget's sense.
                walk.stale_retry_used = true;
                return Next::Go(Step::Connect);
            }
            if let (Some(i), true) = (idx, f.blames_upstream()) {
                group.report(i, false, pier_lb::recent_ms());
            }
            if f.answered {
                return Next::Done(false);
            }
            if let (Some(t), Some(i)) = (walk.tier.as_mut(), idx) {
                // A parent that failed before answering: the next parent,
                // or the origin; not a retry of the route's.
                if f.retryable && t.tried(i) {
                    return Next::Go(Step::Connect);
                }
                crate::tier::give_up(&mut walk.tier, sess);
            } else if let Some(i) = idx {
                walk.tried(i);
            }
            walk.failed = Some((addr, f));
            Next::Go(Step::Fail)
        }
    }
}

/// `Step::Fail`: a failed attempt, nothing sent to the client. The phases
/// decide (`fail_to_connect`, `error_while_proxy`): retry, maybe on another
/// peer, maybe with the request changed; answer; or the driver's policy.
async fn fail<P: Phases>(
    w: &Worker<P>,
    state: &State,
    sess: &mut Session,
    ctx: &mut P::Ctx,
    walk: &mut Walk,
) -> Next {
    let Some((addr, f)) = walk.failed.take() else {
        return Next::Error(Kind::Internal, true);
    };
    walk.last = f.kind;
    // Boxed: a rare path, kept out of every request's future.
    let asked = if matches!(f.kind, Kind::UpstreamConnect | Kind::UpstreamTls) {
        Box::pin(w.phases.fail_to_connect(state, sess, ctx, addr, &f)).await
    } else {
        Box::pin(w.phases.error_while_proxy(state, sess, ctx, addr, &f)).await
    };
    // An answer now closes the connection unless the client's body was
    // all read (or there was none).
    let close = !f.retryable || walk.body_pending;
    let idempotent = sess.req.method_kind().idempotent();
    let retry_on = match asked {
        Ok(Flow::Continue) => (f.may_retry(idempotent) && walk.forced.is_none()).then_some(None),
        // The phase answers for the method's safety; a body already
        // streamed can't be sent again.
        Ok(Flow::Retry { peer }) => f.retryable.then_some(peer),
        Ok(Flow::Respond(r)) => {
            walk.body_pending = close;
            return Next::Answer(r);
        }
        Err(e) => return Next::Error(e.kind, true),
    };
    let group = &state.groups[state.routes[walk.route].group];
    if let Some(peer) = retry_on {
        if walk.attempt < walk.retries && group.try_retry_at(pier_lb::recent_ms()) {
            walk.attempt += 1;
            w.shared.metrics.retry();
            walk.forced = peer;
            return Next::Go(Step::Connect);
        }
    }
    Next::Error(f.kind, close)
}

/// Answer with a Pier-made response (see `respond_inner`). Boxed, so its
/// state is not part of every request's future (which is copied into its
/// box on every request); a hook's answer pays one allocation instead.
#[allow(clippy::too_many_arguments)]
async fn respond<P: Phases, D: Downstream>(
    w: &Worker<P>,
    state: &State,
    down: &mut D,
    b: &mut Work,
    sess: &mut Session,
    ctx: &mut P::Ctx,
    r: &LocalResponse,
    body_pending: bool,
) -> bool {
    crate::boxed_in_place(|| respond_inner(w, state, down, b, sess, ctx, r, body_pending)).await
}

/// Answer with a response a phase made; counted by its kind (or as a hook answer).
#[allow(clippy::too_many_arguments)]
async fn respond_inner<P: Phases, D: Downstream>(
    w: &Worker<P>,
    state: &State,
    down: &mut D,
    b: &mut Work,
    sess: &mut Session,
    ctx: &mut P::Ctx,
    r: &LocalResponse,
    body_pending: bool,
) -> bool {
    match r.kind {
        Some(k) => w.shared.metrics.local_response_status(k, r.status),
        None => w.shared.metrics.local_extra(0),
    }
    let close = body_pending || !sess.client_keep;
    let ok = send_answer(w, state, down, b, sess, ctx, r, close).await;
    ok && !close
}

/// Answer a failure (see `local_fail_inner`).
/// Boxed: a rare path whose state would otherwise be part of every
/// request's future (copied into its box on every request).
#[allow(clippy::too_many_arguments)]
async fn local_fail<P: Phases, D: Downstream>(
    w: &Worker<P>,
    state: &State,
    down: &mut D,
    b: &mut Work,
    sess: &mut Session,
    ctx: &mut P::Ctx,
    kind: Kind,
    close: bool,
) -> bool {
    crate::boxed_in_place(|| local_fail_inner(w, state, down, b, sess, ctx, kind, close)).await
}

/// Answer with an error; `close` when the connection can't continue (e.g.
/// an unread body). Returns whether the connection may continue.
#[allow(clippy::too_many_arguments)]
async fn local_fail_inner<P: Phases, D: Downstream>(
    w: &Worker<P>,
    state: &State,
    down: &mut D,
    b: &mut Work,
    sess: &mut Session,
    ctx: &mut P::Ctx,
    kind: Kind,
    close: bool,
) -> bool {
    // The origin failed: a stored response may answer instead
    // (stale-if-error, the route's grace).
    if let Some(mut src) = crate::cache::stale_on_error(state, sess, kind).await {
        sess.reason = kind.reason();
        sess.step = Step::Write;
        let none: Option<&mut H1RequestSink<tokio::io::Sink>> = None;
        let r = exchange(
            w,
            state,
            down,
            &mut src,
            none,
            &mut b.resp,
            sess,
            ctx,
            &mut None,
        )
        .await;
        return matches!(r, Ok(Relayed::Done(_, true))) && !close && sess.client_keep;
    }
    w.shared.metrics.local_response(kind);
    sess.reason = kind.reason();
    sess.step = Step::Fail;
    if kind == Kind::ClientClosed {
        // 499 is a log code (nginx's): nobody is left to read an answer,
        // so none is sent; the connection closes.
        sess.status = kind.status();
        return false;
    }
    let close = close || !sess.client_keep;
    let ok = send_answer(w, state, down, b, sess, ctx, &local_error(kind), close).await;
    ok && !close
}

/// Send a Pier-made response (an error, a limit's refusal, a Lua
/// `content`/`pier.exit` answer) down the one response pipeline a proxied
/// one takes (`relay`, with `local::LocalSource`): the route's response
/// rules and CORS, its `response_filter` and `body_filter` (as OpenResty
/// runs header and body filters on every response), compression, then the
/// session's writer. `close`: the connection closes after it.
#[allow(clippy::too_many_arguments)]
async fn send_answer<P: Phases, D: Downstream>(
    w: &Worker<P>,
    state: &State,
    down: &mut D,
    b: &mut Work,
    sess: &mut Session,
    ctx: &mut P::Ctx,
    r: &LocalResponse,
    close: bool,
) -> bool {
    if !r.reason.is_empty() {
        sess.reason = r.reason;
    }
    let mut src = crate::local::LocalSource::new(r, grpc_answer(sess, r.status));
    let o = down_opts(state, sess, !close);
    let (body_src, snk) = down.open(&o);
    // The raw sink even for gRPC-web: the answer is shaped for it already.
    let body_src = crate::req_body::BodyIn::new(body_src, None, &mut sess.bytes_received);
    let none: Option<&mut H1RequestSink<tokio::io::Sink>> = None;
    let r = exchange_with(
        w,
        state,
        body_src,
        snk,
        &mut src,
        none,
        &mut b.resp,
        sess,
        ctx,
        &mut None,
    )
    .await;
    matches!(r, Ok(Relayed::Done(..)))
}

/// A gRPC client reads grpc-status, not the HTTP status: Pier's own errors
/// reach it as trailers-only gRPC answers (logged with the HTTP status
/// they stand for). The content type to answer with, if so.
fn grpc_answer(sess: &Session, status: u16) -> Option<&'static [u8]> {
    if status == 200 {
        None
    } else if let Some(form) = sess.grpc_web {
        Some(match form {
            pier_grpc::web::Form::Text => b"application/grpc-web-text",
            pier_grpc::web::Form::Binary => b"application/grpc-web",
        })
    } else if pier_grpc::is_grpc(&sess.req) {
        Some(b"application/grpc")
    } else {
        None
    }
}

/// Write a Pier-made response through the session's writer, no phase
/// seeing it: an error no route sees (a bad head, a panic).
#[allow(clippy::too_many_arguments)]
async fn write_local<D: Downstream>(
    state: &State,
    down: &mut D,
    head: &mut ResponseHead,
    sess: &mut Session,
    reason: &'static str,
    body: &[u8],
    close: bool,
) -> Result<(), Error> {
    // The writer frames the body itself.
    head.headers.remove_known(known::CONTENT_LENGTH);
    head.headers.remove_known(known::TRANSFER_ENCODING);
    if !reason.is_empty() {
        sess.reason = reason;
    }
    sess.status = head.status;
    sess.step = Step::Write;
    let grpc_ct = grpc_answer(sess, head.status);
    let (body, size) = if let Some(ct) = grpc_ct {
        pier_grpc::shape(head, reason, ct);
        (&[][..], BodySize::None)
    } else {
        (body, BodySize::Length(body.len() as u64))
    };
    let o = down_opts(state, sess, !close);
    let (_, mut snk) = down.open(&o);
    let r = async {
        snk.write_head(head, size).await?;
        snk.write_body(body).await?;
        snk.finish(None).await
    }
    .await;
    sess.bytes_sent += snk.bytes_sent();
    r
}

/// What the downstream session needs of this request.
fn down_opts(state: &State, sess: &Session, keep: bool) -> DownstreamOpts {
    DownstreamOpts {
        version: sess.req.version,
        method: sess.req.method_kind(),
        keep,
        body: sess.req.body_len(),
        max_body: state.cfg.limits.max_body_bytes,
        idle: state.cfg.timeouts.client_idle,
        min_rate: state.cfg.limits.body_min_rate,
        now_ns: sess.now_ns,
    }
}

pub(crate) fn local_error(kind: Kind) -> LocalResponse {
    let mut body = Vec::with_capacity(48);
    let mut n = itoa::Buffer::new();
    body.extend_from_slice(n.format(kind.status()).as_bytes());
    body.push(b' ');
    body.extend_from_slice(kind.reason().as_bytes());
    body.push(b'\n');
    // Refusals that will pass tell the client when to come back.
    let headers = match kind {
        Kind::RateLimited | Kind::ConcurrencyLimited | Kind::UpstreamLimited => {
            vec![(b"Retry-After".to_vec(), b"1".to_vec())]
        }
        _ => Vec::new(),
    };
    LocalResponse {
        status: kind.status(),
        headers,
        body,
        reason: kind.reason(),
        kind: Some(kind),
    }
}

// === one attempt against one origin ===

/// `redirect_https`: the same URL over https (nginx's
/// `return 301 https://$host$request_uri`). Not a hot path.
fn https_redirect(sess: &Session, r: pier_config::HttpsRedirect) -> LocalResponse {
    let (authority, target) = (sess.req.host().unwrap_or(b""), sess.req.uri());
    // The host without its port ([v6] kept whole).
    let host = match authority.iter().rposition(|&c| c == b':') {
        Some(i) if !authority[i..].contains(&b']') => &authority[..i],
        _ => authority,
    };
    let mut loc = b"https://".to_vec();
    if host.is_empty() {
        let ip = sess.local.ip().to_string();
        match sess.local.ip() {
            std::net::IpAddr::V6(_) => loc.extend_from_slice(format!("[{ip}]").as_bytes()),
            _ => loc.extend_from_slice(ip.as_bytes()),
        }
    } else {
        loc.extend_from_slice(host);
    }
    if let Some(p) = r.port {
        loc.push(b':');
        loc.extend_from_slice(itoa::Buffer::new().format(p).as_bytes());
    }
    loc.extend_from_slice(if target.is_empty() { b"/" } else { target });
    LocalResponse {
        status: r.status,
        headers: vec![(b"Location".to_vec(), loc)],
        body: b"Moved to https\n".to_vec(),
        reason: "https-redirect",
        kind: None,
    }
}

/// One attempt, run on whichever session the connector made
/// (`upstream::OnSession`): the request as policy made it
/// (`forward::Outgoing`), its body streaming while the response is relayed,
/// a cacheable miss kept as it streams; the session back to its pool, or a
/// tunnel after a 101.
struct Attempt<'x, P: Phases, D> {
    w: &'x Worker<P>,
    state: &'x State,
    down: &'x mut D,
    resp: &'x mut ResponseHead,
    cache: &'x mut Option<Box<crate::cache::CacheFill>>,
    sess: &'x mut Session,
    ctx: &'x mut P::Ctx,
    addr: SocketAddr,
    inflight: &'x mut Option<pier_lb::ActiveGuard>,
}

impl<P: Phases, D: Downstream> crate::upstream::OnSession for Attempt<'_, P, D> {
    type Ok = bool;
    // Not an `async fn`: its arguments would be stored twice in the future
    // (as arguments and as the body's locals), `up` alone 168 bytes.
    #[allow(clippy::manual_async_fn)]
    fn run<U: UpstreamSession>(
        self,
        mut up: U,
    ) -> impl std::future::Future<Output = Result<bool, Error>> {
        async move {
            let Attempt {
                w,
                state,
                down,
                resp,
                cache,
                sess,
                ctx,
                addr,
                inflight,
            } = self;
            w.shared.metrics.pool(up.reused());
            if sess.trace.is_some() {
                crate::trace::attempt_reused(sess, up.reused());
            }
            sess.step = Step::Send;
            let bodiless = crate::forward::body(sess) == BodyLen::None;
            let (mut src, mut body_snk) = up.send(&Outgoing::new(state, sess, addr)).await?;
            let relayed = if bodiless {
                let none: Option<&mut U::Sink<'_>> = None;
                match cache.take() {
                    None => {
                        exchange(w, state, down, &mut src, none, resp, sess, ctx, inflight).await
                    }
                    // A cacheable miss: kept as it streams, stored when complete.
                    // In place on HTTP/1, whose request future is in its
                    // connection's box already (`serve_connection`; a box per miss
                    // cost an allocation and a copy of the whole exchange's
                    // state); boxed by a multiplexed downstream, whose every
                    // stream would otherwise allocate and copy this variant, the
                    // attempt's largest (`Downstream::hold`).
                    Some(fill) => {
                        D::hold(async {
                            // Compressed before it is stored (`[route.compress]`).
                            let enc = pier_compress::EncodeSource::new(
                                &mut src,
                                route_compress(state, sess),
                            );
                            let mut tee = crate::cache::TeeSource::new(enc, fill);
                            let r =
                                exchange(w, state, down, &mut tee, none, resp, sess, ctx, inflight)
                                    .await;
                            // A client gone mid-body does not end the fill for others.
                            tee.finish_detached().await;
                            r
                        })
                        .await
                    }
                }
            } else {
                *cache = None;
                let snk = Some(&mut body_snk);
                exchange(w, state, down, &mut src, snk, resp, sess, ctx, inflight).await
            };
            match relayed? {
                Relayed::Done(upstream_reusable, client_keep) => {
                    drop((src, body_snk));
                    up.release(upstream_reusable);
                    Ok(client_keep)
                }
                Relayed::Upgrade => {
                    // A tunnel both ways until either side closes or both idle out
                    // (WebSocket etc.).
                    let m = &w.shared.metrics;
                    m.tunnels.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    let _tunnel = GaugeGuard::enter(&m.active_tunnels);
                    let idle = tunnel_idle(state);
                    let sent = D::hold(U::tunnel(src, body_snk, down, resp, idle)).await?;
                    sess.bytes_sent += sent;
                    Ok(false)
                }
            }
        }
    }
}

/// The response relayed to the client while (when there is one) the
/// request body streams to the origin: an origin may answer (100-continue,
/// early errors, echo) before the body ends. Any upstream protocol.
#[allow(clippy::too_many_arguments)]
async fn exchange<P: Phases, D: Downstream, Src: ResponseSource, Bsnk: RequestSink>(
    w: &Worker<P>,
    state: &State,
    down: &mut D,
    src: &mut Src,
    body_snk: Option<&mut Bsnk>,
    resp: &mut ResponseHead,
    sess: &mut Session,
    ctx: &mut P::Ctx,
    inflight: &mut Option<pier_lb::ActiveGuard>,
) -> Result<Relayed, Error> {
    let o = down_opts(state, sess, sess.client_keep);
    let (body_src, snk) = down.open(&o);
    let read = match o.body {
        BodyLen::None => None,
        _ => w.phases.req_body(state, sess, ctx).map(|b| &*b),
    };
    let body_src = crate::req_body::BodyIn::new(body_src, read, &mut sess.bytes_received);
    match sess.grpc_web {
        None => {
            exchange_with(
                w, state, body_src, snk, src, body_snk, resp, sess, ctx, inflight,
            )
            .await
        }
        // gRPC-web's framing makes the larger future: held where the
        // downstream keeps rarer steps (`Downstream::hold`).
        Some(form) => {
            let body_src = pier_grpc::web::WebSource::new(body_src, form);
            let snk = pier_grpc::web::WebSink::new(snk, form);
            D::hold(exchange_with(
                w, state, body_src, snk, src, body_snk, resp, sess, ctx, inflight,
            ))
            .await
        }
    }
}

#[allow(clippy::too_many_arguments)]
async fn exchange_with<
    P: Phases,
    Bsrc: RequestSource,
    Snk: ResponseSink,
    Src: ResponseSource,
    Bsnk: RequestSink,
>(
    w: &Worker<P>,
    state: &State,
    mut body_src: Bsrc,
    mut snk: Snk,
    src: &mut Src,
    body_snk: Option<&mut Bsnk>,
    resp: &mut ResponseHead,
    sess: &mut Session,
    ctx: &mut P::Ctx,
    inflight: &mut Option<pier_lb::ActiveGuard>,
) -> Result<Relayed, Error> {
    let mut body_in = 0u64;
    let relayed = match body_snk {
        None if Bsrc::WATCHES_GONE => {
            // A client that closes its connection cancels the request: the
            // origin connection is dropped with this future (a cache fill
            // goes on detached, `TeeSource::finish_detached`).
            let relay = relay(w, state, src, &mut snk, resp, sess, ctx, inflight);
            tokio::select! {
                biased;
                r = relay => r,
                _ = after_a_moment(body_src.client_gone()) => Err(Error::answered(Kind::ClientClosed)),
            }
        }
        None => relay(w, state, src, &mut snk, resp, sess, ctx, inflight).await,
        Some(body_snk) => {
            let pump = pump(&mut body_src, body_snk, &mut body_in);
            let relay = relay(w, state, src, &mut snk, resp, sess, ctx, inflight);
            tokio::pin!(pump, relay);
            let mut pump_done = false;
            loop {
                tokio::select! {
                    p = &mut pump, if !pump_done => {
                        pump_done = true;
                        if let Err(e) = p {
                            // The client's body is bad or too big, or the origin
                            // stopped reading it: nothing useful can follow.
                            break Err(e.retryable(false));
                        }
                    }
                    r = &mut relay => {
                        break match r {
                            // An origin that answered before the body ended can't be
                            // reused, and neither can the client connection.
                            Ok(Relayed::Done(up_ok, keep)) => Ok(Relayed::Done(up_ok && pump_done, keep && pump_done)),
                            Ok(Relayed::Upgrade) => Err(Error::upstream(Kind::UpstreamProtocol)),
                            Err(f) => Err(f.retryable(false)),
                        };
                    }
                }
            }
        }
    };
    sess.bytes_sent += snk.bytes_sent();
    sess.bytes_received += body_in;
    relayed
}

/// How long an origin may take before the driver starts watching for the
/// client to go away: answers within it pay a timer, not a read on the
/// client's socket (a system call) or the HTTP/2 stream lock.
const CLIENT_GONE_AFTER: Duration = Duration::from_millis(50);

/// `watch`, after [`CLIENT_GONE_AFTER`].
async fn after_a_moment(watch: impl Future<Output = ()>) {
    tokio::time::sleep_until(pier_clock::tokio_deadline(CLIENT_GONE_AFTER)).await;
    watch.await
}

/// The request body from the client to the origin, piece by piece;
/// `read` counts its bytes.
async fn pump<Src: RequestSource, Snk: RequestSink>(
    src: &mut Src,
    snk: &mut Snk,
    read: &mut u64,
) -> Result<(), Error> {
    while let Some(piece) = src.read_body().await? {
        *read += piece.len() as u64;
        snk.write_body(piece).await?;
    }
    snk.finish(src.trailers()).await
}

/// The response, whatever the protocols on either side: heads (interim
/// ones passed through), the response steps, then the body through the
/// route's body filter when it has one. The origin's in-flight slot is
/// released as soon as its body is read (before the last client write).
#[allow(clippy::too_many_arguments)]
async fn relay<P: Phases, Src: ResponseSource, Snk: ResponseSink>(
    w: &Worker<P>,
    state: &State,
    src: &mut Src,
    snk: &mut Snk,
    resp: &mut ResponseHead,
    sess: &mut Session,
    ctx: &mut P::Ctx,
    inflight: &mut Option<pier_lb::ActiveGuard>,
) -> Result<Relayed, Error> {
    loop {
        if Snk::WATCHES_GONE {
            tokio::select! {
                biased;
                r = src.read_head(resp) => r?,
                _ = after_a_moment(snk.client_gone()) => return Err(Error::answered(Kind::ClientClosed)),
            }
        } else {
            src.read_head(resp).await?;
        }
        if (100..200).contains(&resp.status) && resp.status != 101 {
            // 100 Continue, 103 Early Hints.
            snk.write_interim(resp).await?;
            continue;
        }
        break;
    }
    if let Some(r) = src.cache_result() {
        sess.cache = r;
    }
    if Src::FROM_ORIGIN && w.shared.analytics.is_some() {
        // One more clock read, only for the analytics that report it.
        sess.upstream_us = pier_clock::now()
            .saturating_duration_since(sess.started)
            .as_micros()
            .min(u32::MAX as u128) as u32;
    }
    let upgrade = resp.status == 101;
    if upgrade && !sess.upgrade {
        return Err(Error::upstream(Kind::UpstreamProtocol));
    }
    if Src::FROM_ORIGIN {
        // A hit's steps ran when it was stored (`ResponseSource::STORED`).
        if !Src::STORED {
            sess.step = Step::UpstreamResponseFilter;
            if let Err(e) = w.phases.upstream_response_filter(state, sess, resp, ctx) {
                return Err(Error::new(e.kind).retryable(false));
            }
        }
        if !upgrade {
            if !Src::STORED {
                // The origin's hop-by-hop fields go before the cache steps:
                // the stored copy and this client's head are cleaned once,
                // here (the strip after `response_filter` below then finds
                // only what a hook added).
                if resp.headers.has_known(known::CONNECTION) {
                    pier_http::remove_hop_by_hop(&mut resp.headers);
                }
                sess.step = Step::CacheStore;
                w.phases.cache_store(state, sess, resp, ctx);
                // What a fill stores: the head as the origin's steps left it.
                src.origin_head(resp, &sess.req.headers);
            }
            if sess
                .route
                .is_some_and(|r| state.cfg.routes[r].cache.is_some())
            {
                crate::cache::after_response(state, sess, resp);
            }
        }
    }
    if !upgrade {
        apply_response_rules(state, sess.route, resp);
        crate::cors::apply(state, sess, resp);
        crate::alt_svc::apply(state, sess, resp);
    }
    sess.step = Step::ResponseFilter;
    let mut filtered = true;
    if let Err(e) = w.phases.response_filter(state, sess, resp, ctx) {
        if Src::FROM_ORIGIN {
            return Err(Error::new(e.kind).retryable(false));
        }
        // Pier's own answer is due already: a filter that fails leaves it
        // as it was (the hook layer logged the error), unfiltered.
        src.read_head(resp).await?;
        filtered = false;
    }
    if upgrade {
        sess.status = resp.status;
        return Ok(Relayed::Upgrade);
    }
    if let Some(ctl) = w.phases.cache_ctl(ctx) {
        // The header_filter's cache verdict reaches a fill (if any).
        src.cache_override(resp, ctl);
    }
    crate::cache_key::strip_tags(state, sess, resp);
    // A Connection field here is a hook's (or, for a stored or generated
    // answer, its source's): what it names goes too.
    if resp.headers.has_known(known::CONNECTION) {
        pier_http::remove_hop_by_hop(&mut resp.headers);
    }
    let mut size = src.body_size();
    let lua_filter = filtered && size != BodySize::None && w.phases.has_body_filter(state, sess);
    // Compression (`[route.compress]`): after the Lua body filter, which
    // sees the body decoded.
    let mut codec = pier_compress::plan(route_compress(state, sess), &sess.req, resp, size);
    let filtering = lua_filter || codec.is_some();
    if filtering {
        // A body filter may change the length.
        size = BodySize::Stream;
    }
    if size == BodySize::Stream {
        // The writer frames it (chunked, or close-delimited for HTTP/1.0);
        // RFC 9112 §6.3: a Content-Length beside chunked must not pass.
        resp.headers.remove_known(known::CONTENT_LENGTH);
        resp.headers.remove_known(known::TRANSFER_ENCODING);
    }
    // Pier's own answer is at hand whole: filtered in full, then sent with
    // its length, as it was made.
    let mut whole = (!Src::FROM_ORIGIN && filtering).then(Vec::new);
    sess.step = Step::Write;
    sess.status = resp.status;
    if whole.is_none() {
        snk.write_head(resp, size).await?;
    }
    let mut piece = filtering.then(BytesMut::new);
    if piece.is_none() {
        // A cached body in a mapping of its own leaves as its pages.
        if let Some(f) = src.take_spliceable() {
            inflight.take();
            snk.write_spliced(&f).await?;
        }
    }
    loop {
        let Some((data, last)) = src.read_body().await? else {
            break;
        };
        if last {
            inflight.take();
        }
        match &mut piece {
            None => snk.write_body(data).await?,
            Some(p) => {
                let mut input = data;
                loop {
                    // A decoder hands on bounded pieces of what it expands.
                    p.clear();
                    let more = match &mut codec {
                        Some(c) => c.decode_into(&mut input, p)?,
                        None => {
                            p.extend_from_slice(input);
                            false
                        }
                    };
                    if lua_filter {
                        w.phases
                            .body_filter(state, sess, ctx, p, false)
                            .map_err(|e| Error::answered(e.kind))?;
                    }
                    if let Some(c) = &mut codec {
                        c.encode(p)?;
                    }
                    match &mut whole {
                        Some(all) => all.extend_from_slice(p),
                        None => snk.write_body(p).await?,
                    }
                    if !more {
                        break;
                    }
                }
            }
        }
    }
    inflight.take();
    if let Some(p) = &mut piece {
        p.clear();
        if let Some(c) = &mut codec {
            c.decode_finish(p)?;
        }
        if lua_filter {
            w.phases
                .body_filter(state, sess, ctx, p, true)
                .map_err(|e| Error::answered(e.kind))?;
        }
        if let Some(c) = &mut codec {
            c.encode_finish(p)?;
        }
        match &mut whole {
            Some(all) => {
                all.extend_from_slice(p);
                snk.write_head(resp, BodySize::Length(all.len() as u64))
                    .await?;
                snk.write_body(all).await?;
            }
            None => snk.write_body(p).await?,
        }
    }
    snk.finish(src.trailers()).await?;
    if Src::FROM_ORIGIN && (sess.grpc_web.is_some() || pier_grpc::is_grpc(&sess.req)) {
        // The call's outcome: in the trailers, or in the head of a
        // trailers-only answer.
        let code = src
            .trailers()
            .and_then(|t| t.get(b"grpc-status"))
            .or_else(|| resp.headers.get(b"grpc-status"));
        w.shared.metrics.grpc_status(code);
    }
    Ok(Relayed::Done(src.reusable(), snk.keep_alive()))
}

/// Idle timeout of an upgraded connection.
/// The route's compression settings (`[route.compress]`), if it has any and
/// the request may have its response transformed at all: not a Range
/// request, gRPC or gRPC-web.
fn route_compress<'a>(state: &'a State, sess: &Session) -> Option<&'a pier_config::Compress> {
    let c = state.cfg.routes.get(sess.route?)?.compress.as_ref()?;
    if sess.req.headers.get(b"range").is_some()
        || sess.grpc_web.is_some()
        || pier_grpc::is_grpc(&sess.req)
    {
        return None;
    }
    Some(c)
}

fn tunnel_idle(state: &State) -> Duration {
    state.cfg.timeouts.tunnel_idle
}

/// Build `sess.up_req` from the request as received (already canonical:
/// origin-form, one authority; `State::parse_request`): the headers
/// `Connection` names go (RFC 9110 §7.6.1), and whether an Upgrade goes
/// through is decided. The rest of the upstream policy is `forward`'s.
fn build_upstream_request(state: &State, sess: &mut Session) {
    sess.upgrade = upgrade_allowed(state, &sess.req);
    let up = &mut sess.up_req;
    if up.headers.has_known(known::CONNECTION) {
        pier_http::remove_hop_by_hop(&mut up.headers);
    }
}

/// An Upgrade goes to the origin only with `Connection: upgrade`, over
/// HTTP/1.1, and when every protocol it names is allowed (`[http] upgrade`,
/// default `websocket`). `h2c` never is: an h2c upgrade would let the client
/// talk HTTP/2 to the origin past the route's hooks (h2c smuggling).
fn upgrade_allowed(state: &State, req: &pier_http::RequestHead) -> bool {
    if req.version != 1 || !req.is_upgrade() {
        return false;
    }
    let Some(v) = req.headers.get_known(known::UPGRADE) else {
        return false;
    };
    let allowed = upgrade_list(state);
    let mut any = false;
    for proto in v.split(|&c| c == b',') {
        let proto = pier_http::headers::trim(proto);
        let name = proto.split(|&c| c == b'/').next().unwrap_or(b"");
        if name.is_empty() {
            continue;
        }
        if name.eq_ignore_ascii_case(b"h2c")
            || !allowed
                .iter()
                .any(|a| a.as_bytes().eq_ignore_ascii_case(name))
        {
            return false;
        }
        any = true;
    }
    any
}

fn upgrade_list(state: &State) -> &[String] {
    &state.cfg.upgrade
}

/// `[route.headers]` / `[upstream.NAME.headers]` request rules, and a literal
/// `host_header`, onto the upstream request.
fn apply_request_rules(state: &State, route: usize, req: &mut pier_http::RequestHead) {
    let r = &state.routes[route];
    if r.request_rules {
        for rules in &r.header_rules {
            for n in &rules.request_remove {
                req.headers.remove(n.as_bytes());
            }
            for (n, v) in &rules.request_set {
                req.headers.insert(n.as_bytes(), v.as_bytes());
            }
            for (n, v) in &rules.request_add {
                req.headers.append(n.as_bytes(), v.as_bytes());
            }
        }
    }
    if let HostHeader::Literal(h) = &r.host_header {
        req.headers.insert(b"Host", h.as_bytes());
    }
}

/// Response rules onto a response head (proxied or Pier-made).
fn apply_response_rules(state: &State, route: Option<usize>, resp: &mut ResponseHead) {
    let Some(r) = route.map(|i| &state.routes[i]) else {
        return;
    };
    if !r.response_rules {
        return;
    }
    for rules in &r.header_rules {
        for n in &rules.response_remove {
            resp.headers.remove(n.as_bytes());
        }
        for (n, v) in &rules.response_set {
            resp.headers.insert(n.as_bytes(), v.as_bytes());
        }
        for (n, v) in &rules.response_add {
            resp.headers.append(n.as_bytes(), v.as_bytes());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn addr() -> SocketAddr {
        SocketAddr::from(([127, 0, 0, 1], 1))
    }

    #[test]
    fn pooled_sessions_a_burst_left_unused_are_freed_after_a_period() {
        let mut pool = BufPool::default();
        for _ in 0..300 {
            pool.busy.push(Busy::new(addr(), addr()));
        }
        pool.trim_busy(); // a period starts with 300 pooled
        assert_eq!(pool.busy.len(), 300);
        // During it, 100 are taken and given back: 200 were never used.
        let taken: Vec<_> = (0..100).map(|_| pool.take_busy().unwrap()).collect();
        pool.busy.extend(taken);
        pool.trim_busy();
        assert_eq!(pool.busy.len(), 100);
        // A period with none taken: down to the floor, and no further.
        pool.trim_busy();
        assert_eq!(pool.busy.len(), BufPool::MAX);
        pool.trim_busy();
        assert_eq!(pool.busy.len(), BufPool::MAX);
        // A pool below the floor is never trimmed.
        let mut small = BufPool::default();
        small.busy.push(Busy::new(addr(), addr()));
        small.trim_busy();
        small.trim_busy();
        assert_eq!(small.busy.len(), 1);
    }
}
