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

use crate::phases::{Flow, Hooks, LocalResponse};
use crate::session::Session;
use crate::state::State;
use crate::Worker;
use bytes::{Buf, BytesMut};
use pier_error::Kind;
use pier_http::known::{self, Known};
use pier_http::{date, write, BodyLen, ChunkedScanner, Method, ResponseHead};
use std::cell::RefCell;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::time::timeout;

const READ_CHUNK: usize = 16 * 1024;

/// Per-connection buffers, reused for every request on the connection.
struct Bufs {
    /// Client bytes not yet consumed (head, body, pipelined requests).
    rbuf: BytesMut,
    /// Origin bytes not yet relayed.
    ubuf: BytesMut,
    /// Outgoing heads.
    out: Vec<u8>,
    resp: ResponseHead,
}

/// Heads whose storage grew past this are dropped between requests rather
/// than kept by an idle connection (a big head is rare; a kept one is memory
/// every idle connection would hold).
const KEEP_HEAD_BYTES: usize = 2048;

impl Bufs {
    /// Between requests: hand the byte buffers back to the worker's pool, so
    /// an idle keep-alive connection holds none (10,000 idle connections
    /// cost little more than their sockets) while a busy one gets them back
    /// at once. Freed buffers would otherwise sit in the allocator between
    /// long-lived allocations (fragmentation: measured ~19 MB held but free
    /// with 10,000 idle connections).
    /// Heads are kept (parsing reuses their storage) unless they grew large.
    fn release(&mut self, req: &mut pier_http::RequestHead, pool: &RefCell<BufPool>) {
        let mut p = pool.borrow_mut();
        p.put(std::mem::take(&mut self.rbuf));
        p.put(std::mem::take(&mut self.ubuf));
        p.put_vec(std::mem::take(&mut self.out));
        if self.resp.headers.capacity_bytes() > KEEP_HEAD_BYTES {
            self.resp = ResponseHead::default();
        }
        if req.headers.capacity_bytes() > KEEP_HEAD_BYTES {
            *req = pier_http::RequestHead::default();
        }
    }
}

/// A worker's spare I/O buffers (single-threaded, like the worker), bounded
/// in count and in the size of what it keeps.
#[derive(Default)]
pub struct BufPool {
    bytes: Vec<BytesMut>,
    vecs: Vec<Vec<u8>>,
}

impl BufPool {
    /// Buffers kept per worker; past it, returned buffers are freed.
    const MAX: usize = 64;
    /// Buffers that grew past this (large bodies) are freed, not kept.
    const MAX_CAP: usize = 64 * 1024;

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
    fn take(&mut self) -> BytesMut {
        self.bytes
            .pop()
            .unwrap_or_else(|| BytesMut::with_capacity(READ_CHUNK))
    }
    fn take_vec(&mut self) -> Vec<u8> {
        self.vecs.pop().unwrap_or_else(|| Vec::with_capacity(1024))
    }
}

/// Why an attempt failed, and what that allows.
struct Fail {
    kind: Kind,
    /// Bytes of the response already went to the client: nothing to retry,
    /// nothing to answer; the connection must close.
    client_touched: bool,
    /// The request can be replayed (nothing of a body was streamed).
    replayable: bool,
    /// A reused pooled connection failed before any response byte: the
    /// origin closed it while idle. Retried once on a fresh connection.
    stale: bool,
    /// The origin (not the client) is at fault: counts as a passive failure.
    upstream_fault: bool,
}

impl Fail {
    fn up(kind: Kind) -> Fail {
        Fail {
            kind,
            client_touched: false,
            replayable: true,
            stale: false,
            upstream_fault: true,
        }
    }
}

enum Relayed {
    /// Response done. `upstream_reusable`, `client_keep`.
    Done(bool, bool),
    /// 101 sent; tunnel the rest.
    Upgrade,
}

/// Serve one client connection until it closes, idles out, or errs.
pub async fn serve_connection<H: Hooks>(
    w: Arc<Worker<H>>,
    mut stream: TcpStream,
    client: SocketAddr,
) {
    let local = stream.local_addr().unwrap_or(client);
    let _ = stream.set_nodelay(true);
    let mut sess = Session::new(client, local);
    let mut b = Bufs {
        rbuf: BytesMut::new(),
        ubuf: BytesMut::new(),
        out: Vec::new(),
        resp: ResponseHead::default(),
    };
    let mut drain = w.shared.drain_rx();
    let mut state = w.shared.state.load_full();
    let mut first = true;
    loop {
        w.shared.refresh(&mut state);
        // Waiting for a head: evictable when the worker is full (evict.rs).
        let waiting = crate::evict::Waiting::enter(&w.waiting, pier_lb::clock_ms());
        if b.rbuf.is_empty() && !first {
            // Between requests: the buffers go back to the worker's pool.
            b.release(&mut sess.req, &w.bufs);
        }
        let r = tokio::select! {
            r = read_head(&mut stream, &mut b.rbuf, &w.bufs, &mut sess, &state, &mut drain, first) => r,
            // Evicted for a new connection: close without a word, as nginx does.
            _ = waiting.evicted() => break,
        };
        drop(waiting);
        first = false;
        // A reload while this connection waited applies to its next request.
        w.shared.refresh(&mut state);
        match r {
            Ok(true) => {}
            Ok(false) => break,
            Err(kind) => {
                sess.begin(date::now_ns());
                let _ =
                    send_local(&mut stream, &mut b.out, &mut sess, &local_error(kind), true).await;
                w.shared.metrics.local_response(kind);
                finish(&w, &state, &sess, None);
                break;
            }
        }
        sess.begin(date::now_ns());
        w.shared
            .metrics
            .active_requests
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let mut ctx = H::Ctx::default();
        // Boxed: the connection's task stays small while it idles; the
        // request's (larger) state machine exists only while it runs.
        let keep = Box::pin(handle_request(
            &w,
            &state,
            &mut stream,
            &mut b,
            &mut sess,
            &mut ctx,
        ))
        .await;
        w.hooks.logging(&state, &mut sess, &mut ctx);
        w.shared
            .metrics
            .active_requests
            .fetch_sub(1, std::sync::atomic::Ordering::Relaxed);
        finish(&w, &state, &sess, sess.route);
        if !keep || *drain.borrow() {
            break;
        }
    }
    // The next connection reuses them.
    b.release(&mut sess.req, &w.bufs);
}

/// Metrics and access log for one finished request.
fn finish<H: Hooks>(w: &Worker<H>, state: &State, sess: &Session, route: Option<usize>) {
    let dur_us = sess.started.elapsed().as_micros() as u64;
    let metric = route
        .map(|r| state.routes[r].metric)
        .unwrap_or(pier_log::metrics::MAX_ROUTES - 1);
    w.shared.metrics.request(metric, sess.status, dur_us);
    let log = &w.shared.access;
    if log.enabled() {
        let mut up = [0u8; 64];
        let up_len = sess.upstream.map(|a| fmt_addr(&mut up, a)).unwrap_or(0);
        let dropped = log.log(&pier_log::AccessRecord {
            ts_ms: sess.now_ns / 1_000_000,
            client: sess.client_ip.as_bytes(),
            method: sess.req.method(),
            uri: sess.req.uri(),
            host: sess.req.host().unwrap_or(b""),
            status: sess.status,
            bytes_sent: sess.bytes_sent,
            duration_us: dur_us,
            route: route.map(|r| state.routes[r].name.as_str()).unwrap_or(""),
            upstream: &up[..up_len],
            reason: sess.reason,
        });
        if dropped > 0 {
            w.shared.metrics.log_dropped(dropped);
        }
    }
}

fn fmt_addr(buf: &mut [u8; 64], a: SocketAddr) -> usize {
    use std::io::Write;
    let mut c = std::io::Cursor::new(&mut buf[..]);
    let _ = write!(c, "{a}");
    c.position() as usize
}

// === reading the request head ===

/// `Ok(true)`: a head is parsed into `sess.req` and consumed from `rbuf`.
/// `Ok(false)`: the client went away or idled out between requests, or we
/// are draining: close quietly.
async fn read_head(
    stream: &mut TcpStream,
    rbuf: &mut BytesMut,
    pool: &RefCell<BufPool>,
    sess: &mut Session,
    state: &State,
    drain: &mut tokio::sync::watch::Receiver<bool>,
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
            if let Some(n) = sess.req.parse(rbuf, &state.head_limits)? {
                rbuf.advance(n);
                return Ok(true);
            }
        }
        if rbuf.is_empty() && header_deadline.is_none() {
            // Idle keep-alive connection: wait for a first byte, or drain.
            // Wait for readiness *without* a buffer and allocate it only
            // once bytes are there: a 4 KiB read buffer held by every idle
            // connection was most of its memory. Then `read_buf`, not
            // `try_read_buf`: a short read must clear the readiness, or the
            // next idle wait would wake at once.
            if *drain.borrow() {
                return Ok(false);
            }
            let first_bytes = async {
                stream.readable().await?;
                if rbuf.capacity() == 0 {
                    *rbuf = pool.borrow_mut().take();
                }
                rbuf.reserve(4096);
                stream.read_buf(rbuf).await
            };
            tokio::select! {
                r = timeout(idle, first_bytes) => match r {
                    Ok(Ok(0)) | Ok(Err(_)) | Err(_) => return Ok(false),
                    Ok(Ok(_)) => header_deadline = Some(tokio::time::Instant::now() + t.client_header),
                },
                _ = drain.changed() => return Ok(false),
            }
        } else {
            rbuf.reserve(4096);
            let deadline = *header_deadline
                .get_or_insert_with(|| tokio::time::Instant::now() + t.client_header);
            match tokio::time::timeout_at(deadline, stream.read_buf(rbuf)).await {
                Ok(Ok(0)) | Ok(Err(_)) => return Ok(false),
                Ok(Ok(_)) => {}
                Err(_) => return Err(Kind::HeaderTimeout),
            }
        }
    }
}

// === one request ===

/// Returns whether the client connection may carry another request.
async fn handle_request<H: Hooks>(
    w: &Worker<H>,
    state: &Arc<State>,
    stream: &mut TcpStream,
    b: &mut Bufs,
    sess: &mut Session,
    ctx: &mut H::Ctx,
) -> bool {
    let body = sess.req.body_len();
    let body_pending = body != BodyLen::None;
    let client_keep = sess.req.keep_alive();
    sess.client_keep = client_keep;

    // Route.
    let Some(route) = state.match_route(sess.req.host(), sess.req.path()) else {
        return local_fail(w, state, stream, b, sess, ctx, Kind::NoRoute, body_pending).await
            && client_keep;
    };
    sess.route = Some(route);

    // Body bound known up front.
    let max_body = state.cfg.limits.max_body_bytes;
    if let BodyLen::Length(n) = body {
        if max_body > 0 && n > max_body {
            return local_fail(w, state, stream, b, sess, ctx, Kind::BodyTooLarge, true).await;
        }
    }

    // A chunked body's framing is vetted before its head goes anywhere: the
    // bytes already read, and at least the first size line (unless the client
    // waits for 100-continue). A bad chunk later in a streamed body cuts the
    // origin connection mid-body instead (it is never reused).
    if body == BodyLen::Chunked {
        let wait = !sess.req.expects_continue();
        match vet_chunked(stream, &mut b.rbuf, state.cfg.timeouts.client_header, wait).await {
            Ok(()) => {}
            Err(Kind::ClientClosed) => return false,
            Err(k) => return local_fail(w, state, stream, b, sess, ctx, k, true).await,
        }
    }

    // request_filter (Lua access/content, limits).
    match w.hooks.request_filter(state, sess, ctx).await {
        Ok(Flow::Continue) => {}
        Ok(Flow::Respond(r)) => {
            return respond(w, state, stream, b, sess, ctx, &r, body_pending).await
        }
        Err(e) => {
            return local_fail(w, state, stream, b, sess, ctx, e.kind, body_pending).await
                && client_keep
        }
    }

    let group = state.groups[state.routes[route].group].clone();
    let now_ms = pier_lb::clock_ms();
    group.on_request_at(now_ms);

    let choice = match w.hooks.upstream_peer(state, sess, ctx).await {
        Ok(c) => c,
        Err(e) => {
            return local_fail(w, state, stream, b, sess, ctx, e.kind, body_pending).await
                && client_keep
        }
    };
    match w.hooks.upstream_request_filter(state, sess, ctx).await {
        Ok(Flow::Continue) => {}
        Ok(Flow::Respond(r)) => {
            return respond(w, state, stream, b, sess, ctx, &r, body_pending).await
        }
        Err(e) => {
            return local_fail(w, state, stream, b, sess, ctx, e.kind, body_pending).await
                && client_keep
        }
    }

    let retries = choice.retries.unwrap_or_else(|| group.retries());
    let idempotent = sess.req.method_kind().idempotent();
    let mut tried = [0usize; 16];
    let mut ntried = 0;
    let mut attempt = 0u32;
    let mut stale_retry_used = false;
    let mut last = Kind::NoHealthyUpstream;
    loop {
        let (addr, idx) = match choice.addr {
            Some(a) => (a, None),
            None => {
                let key = group.hash_key().and_then(|k| {
                    pier_lb::extract_hash_key(
                        k,
                        |name| sess.req.headers.get(name.as_bytes()),
                        sess.client_ip.as_bytes(),
                        sess.req.path(),
                    )
                });
                match group.select_at(key, &tried[..ntried], now_ms) {
                    Some(i) => (group.peers()[i].addr, Some(i)),
                    None => {
                        if last == Kind::NoHealthyUpstream && group.at_capacity(&tried[..ntried]) {
                            last = Kind::UpstreamLimited;
                        }
                        return local_fail(w, state, stream, b, sess, ctx, last, body_pending)
                            .await
                            && client_keep;
                    }
                }
            }
        };
        if pier_config::denied(&state.cfg.deny_origins, addr.ip()) {
            return local_fail(
                w,
                state,
                stream,
                b,
                sess,
                ctx,
                Kind::OriginDenied,
                body_pending,
            )
            .await
                && client_keep;
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
                    last = Kind::UpstreamLimited;
                    if ntried < tried.len() {
                        tried[ntried] = i;
                        ntried += 1;
                        continue;
                    }
                    return local_fail(w, state, stream, b, sess, ctx, last, body_pending).await;
                }
            },
            None => None,
        };
        match w.hooks.peer_selected(state, sess, ctx, addr) {
            Ok(Flow::Continue) => {}
            Ok(Flow::Respond(r)) => {
                return respond(w, state, stream, b, sess, ctx, &r, body_pending).await
            }
            Err(e) => {
                return local_fail(w, state, stream, b, sess, ctx, e.kind, body_pending).await
            }
        }
        sess.upstream = Some(addr);
        let res = attempt_once(
            w,
            state,
            stream,
            b,
            sess,
            ctx,
            addr,
            stale_retry_used,
            &mut inflight,
        )
        .await;
        drop(inflight);
        match res {
            Ok(keep) => {
                if let Some(i) = idx {
                    group.report(i, true, pier_lb::clock_ms());
                }
                return keep && client_keep;
            }
            Err(f) => {
                if f.stale && !stale_retry_used && f.replayable {
                    // The pooled connection had died while idle: not the
                    // origin's fault and not a retry in the budget's sense.
                    stale_retry_used = true;
                    continue;
                }
                if let (Some(i), true) = (idx, f.upstream_fault) {
                    group.report(i, false, pier_lb::clock_ms());
                }
                if f.client_touched {
                    return false;
                }
                last = f.kind;
                let safe = f.replayable && (idempotent || f.kind == Kind::UpstreamConnect);
                if let Some(i) = idx {
                    if ntried < tried.len() {
                        tried[ntried] = i;
                        ntried += 1;
                    }
                }
                if attempt < retries
                    && safe
                    && choice.addr.is_none()
                    && group.try_retry_at(pier_lb::clock_ms())
                {
                    attempt += 1;
                    w.shared.metrics.retry();
                    continue;
                }
                let consumed = f.replayable && !body_pending;
                return local_fail(w, state, stream, b, sess, ctx, f.kind, !consumed).await
                    && client_keep;
            }
        }
    }
}

/// Answer with a response a phase made; counted by its kind (or as a hook answer).
#[allow(clippy::too_many_arguments)]
async fn respond<H: Hooks>(
    w: &Worker<H>,
    state: &State,
    stream: &mut TcpStream,
    b: &mut Bufs,
    sess: &mut Session,
    ctx: &mut H::Ctx,
    r: &LocalResponse,
    body_pending: bool,
) -> bool {
    match r.kind {
        Some(k) => w.shared.metrics.local_response_status(k, r.status),
        None => w.shared.metrics.local_extra(0),
    }
    let close = body_pending || !sess.client_keep;
    let ok = send_answer(w, state, stream, b, sess, ctx, r, close).await;
    ok && !close
}

/// Answer with an error; `close` when the connection can't continue (e.g.
/// an unread body). Returns whether the connection may continue.
#[allow(clippy::too_many_arguments)]
async fn local_fail<H: Hooks>(
    w: &Worker<H>,
    state: &State,
    stream: &mut TcpStream,
    b: &mut Bufs,
    sess: &mut Session,
    ctx: &mut H::Ctx,
    kind: Kind,
    close: bool,
) -> bool {
    w.shared.metrics.local_response(kind);
    sess.reason = kind.reason();
    let close = close || !sess.client_keep;
    let ok = send_answer(w, state, stream, b, sess, ctx, &local_error(kind), close).await;
    ok && !close
}

/// Send a locally made response of a routed request, through the route's
/// response filters first when it has any (as OpenResty runs header and body
/// filters on every response, `ngx.exit`/`ngx.say` ones and error pages too).
#[allow(clippy::too_many_arguments)]
async fn send_answer<H: Hooks>(
    w: &Worker<H>,
    state: &State,
    stream: &mut TcpStream,
    b: &mut Bufs,
    sess: &mut Session,
    ctx: &mut H::Ctx,
    r: &LocalResponse,
    close: bool,
) -> bool {
    if sess.route.is_none() || !w.hooks.filters_local(state, sess) {
        return send_local(stream, &mut b.out, sess, r, close).await.is_ok();
    }
    let filtered = filter_local(w, state, &mut b.resp, sess, ctx, r);
    send_local(
        stream,
        &mut b.out,
        sess,
        filtered.as_ref().unwrap_or(r),
        close,
    )
    .await
    .is_ok()
}

/// `r` after the route's `response_filter` and `body_filter` (the whole body
/// in one piece, marked last). A filter that fails leaves the response as it
/// was (its error is logged by the hook layer): an answer is already due.
fn filter_local<H: Hooks>(
    w: &Worker<H>,
    state: &State,
    head: &mut ResponseHead,
    sess: &mut Session,
    ctx: &mut H::Ctx,
    r: &LocalResponse,
) -> Option<LocalResponse> {
    *head = ResponseHead::default();
    head.version = 1;
    head.set_status(r.status);
    for (n, v) in &r.headers {
        head.headers.append(n, v);
    }
    w.hooks.response_filter(state, sess, head, ctx).ok()?;
    let mut body = BytesMut::from(&r.body[..]);
    if w.hooks.has_body_filter(state, sess) {
        w.hooks
            .body_filter(state, sess, ctx, &mut body, true)
            .ok()?;
    }
    Some(LocalResponse {
        status: head.status,
        headers: head
            .headers
            .iter()
            .filter(|(n, _)| !n.eq_ignore_ascii_case(b"content-length"))
            .map(|(n, v)| (n.to_vec(), v.to_vec()))
            .collect(),
        body: body.to_vec(),
        reason: r.reason,
        kind: r.kind,
    })
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

/// Write a locally generated response.
async fn send_local(
    stream: &mut TcpStream,
    out: &mut Vec<u8>,
    sess: &mut Session,
    r: &LocalResponse,
    close: bool,
) -> std::io::Result<()> {
    out.clear();
    write::status_line(out, r.status, b"");
    date::with_date(sess.now_ns, |d| write::header(out, b"Date", d));
    write::header(out, b"Server", b"pier");
    let mut has_ct = false;
    for (n, v) in &r.headers {
        has_ct |= n.eq_ignore_ascii_case(b"content-type");
        write::header(out, n, v);
    }
    if !has_ct {
        write::header(out, b"Content-Type", b"text/plain");
    }
    if !r.reason.is_empty() {
        write::header(out, b"x-pier-reason", r.reason.as_bytes());
        sess.reason = r.reason;
    }
    write::header_u64(out, b"Content-Length", r.body.len() as u64);
    if close {
        write::header(out, b"Connection", b"close");
    } else if sess.req.version == 0 {
        write::header(out, b"Connection", b"keep-alive");
    }
    out.extend_from_slice(b"\r\n");
    if sess.req.method_kind() != Method::Head {
        out.extend_from_slice(&r.body);
    }
    sess.status = r.status;
    sess.bytes_sent += out.len() as u64;
    stream.write_all(out).await
}

// === one attempt against one origin ===

/// Request headers Pier writes itself or never forwards.
fn skip_request_header(k: Known) -> bool {
    matches!(
        k,
        known::CONNECTION
            | known::KEEP_ALIVE
            | known::PROXY_CONNECTION
            | known::TE
            | known::UPGRADE
            | known::X_FORWARDED_FOR
            | known::X_FORWARDED_PROTO
            | known::X_FORWARDED_HOST
    )
}

fn skip_response_header(k: Known) -> bool {
    matches!(
        k,
        known::CONNECTION
            | known::KEEP_ALIVE
            | known::PROXY_CONNECTION
            | known::TE
            | known::UPGRADE
            | known::PROXY_AUTHENTICATE
    )
}

#[allow(clippy::too_many_arguments)]
async fn attempt_once<H: Hooks>(
    w: &Worker<H>,
    state: &State,
    stream: &mut TcpStream,
    b: &mut Bufs,
    sess: &mut Session,
    ctx: &mut H::Ctx,
    addr: SocketAddr,
    fresh_only: bool,
    inflight: &mut Option<pier_lb::ActiveGuard>,
) -> Result<bool, Fail> {
    let t = &state.cfg.timeouts;
    let pooled = if fresh_only {
        None
    } else {
        w.shared.pool.take(addr, w.id)
    };
    let reused = pooled.is_some();
    let mut up = match pooled {
        Some(s) => s,
        None => match timeout(t.upstream_connect, TcpStream::connect(addr)).await {
            Ok(Ok(s)) => {
                let _ = s.set_nodelay(true);
                s
            }
            Ok(Err(e)) => {
                tracing::debug!("connect {addr}: {e}");
                return Err(Fail::up(Kind::UpstreamConnect));
            }
            Err(_) => {
                let mut f = Fail::up(Kind::UpstreamConnect);
                f.kind = Kind::UpstreamTimeout;
                return Err(f);
            }
        },
    };
    w.shared.metrics.pool(reused);
    b.ubuf.clear();
    if b.ubuf.capacity() == 0 {
        b.ubuf = w.bufs.borrow_mut().take();
    }
    if b.out.capacity() == 0 {
        b.out = w.bufs.borrow_mut().take_vec();
    }

    // The upstream request head.
    let req = &mut sess.req;
    if req.headers.has_known(known::CONNECTION) {
        // Headers named in Connection are hop-by-hop too (RFC 9110 §7.6.1).
        let upgrade = if req.is_upgrade() {
            req.headers.get_known(known::UPGRADE).map(<[u8]>::to_vec)
        } else {
            None
        };
        pier_http::remove_hop_by_hop(&mut req.headers);
        if let Some(u) = upgrade {
            req.headers.append(b"Upgrade", &u);
            req.headers.append(b"Connection", b"upgrade");
        }
    }
    let upgrade = req.headers.has_known(known::UPGRADE);
    let out = &mut b.out;
    out.clear();
    write::request_head(out, req, req.uri(), skip_request_header);
    // X-Forwarded-For: append the client to whatever the client sent.
    out.extend_from_slice(b"X-Forwarded-For: ");
    for v in req.headers.get_all_known(known::X_FORWARDED_FOR) {
        out.extend_from_slice(v);
        out.extend_from_slice(b", ");
    }
    out.extend_from_slice(sess.client_ip.as_bytes());
    out.extend_from_slice(b"\r\nX-Forwarded-Proto: http\r\n");
    if let Some(h) = req.host() {
        write::header(out, b"X-Forwarded-Host", h);
    }
    if upgrade {
        if let Some(u) = req.headers.get_known(known::UPGRADE) {
            write::header(out, b"Upgrade", u);
        }
        out.extend_from_slice(b"Connection: upgrade\r\n");
    }
    out.extend_from_slice(b"\r\n");

    let body = req.body_len();
    let method = req.method_kind();
    let (mut cr, mut cw) = stream.split();
    let (mut ur, mut uw) = up.split();

    let stale = |kind: Kind| Fail {
        kind,
        client_touched: false,
        replayable: true,
        stale: reused,
        upstream_fault: !reused,
    };

    let relayed = if body == BodyLen::None {
        if uw.write_all(out).await.is_err() {
            return Err(stale(Kind::UpstreamClosed));
        }
        relay_response(
            w,
            state,
            &mut ur,
            &mut cw,
            &mut b.ubuf,
            out,
            &mut b.resp,
            sess,
            ctx,
            method,
            reused,
            inflight,
        )
        .await?
    } else {
        if uw.write_all(out).await.is_err() {
            return Err(stale(Kind::UpstreamClosed));
        }
        // Stream the request body while reading the response: an origin may
        // answer (100-continue, early errors, echo) before the body ends.
        let max_body = state.cfg.limits.max_body_bytes;
        let pace = BodyPace {
            read_timeout: t.client_idle,
            min_rate: state.cfg.limits.body_min_rate,
            started: Instant::now(),
            got: 0,
        };
        let pump = pump_body(&mut cr, &mut b.rbuf, &mut uw, body, max_body, pace);
        let relay = relay_response(
            w,
            state,
            &mut ur,
            &mut cw,
            &mut b.ubuf,
            out,
            &mut b.resp,
            sess,
            ctx,
            method,
            false,
            inflight,
        );
        tokio::pin!(pump, relay);
        let mut pump_done = false;
        let r = loop {
            tokio::select! {
                p = &mut pump, if !pump_done => {
                    pump_done = true;
                    if let Err(k) = p {
                        // The client's body is bad or too big: nothing useful can follow.
                        break Err(Fail { kind: k, client_touched: false, replayable: false, stale: false, upstream_fault: false });
                    }
                }
                r = &mut relay => {
                    break match r {
                        // An origin that answered before the body ended can't be
                        // reused, and neither can the client connection.
                        Ok(Relayed::Done(up_ok, keep)) => Ok(Relayed::Done(up_ok && pump_done, keep && pump_done)),
                        Ok(Relayed::Upgrade) => Err(Fail::up(Kind::UpstreamProtocol)),
                        Err(mut f) => { f.replayable = false; Err(f) }
                    };
                }
            }
        };
        r?
    };
    match relayed {
        Relayed::Done(upstream_reusable, client_keep) => {
            if upstream_reusable {
                w.shared.pool.put(addr, w.id, up);
            }
            Ok(client_keep)
        }
        Relayed::Upgrade => {
            // Tunnel both ways until either side closes (WebSocket etc.).
            if !b.rbuf.is_empty() {
                let _ = uw.write_all(&b.rbuf).await;
                b.rbuf.clear();
            }
            let a = async {
                let _ = tokio::io::copy(&mut cr, &mut uw).await;
                let _ = uw.shutdown().await;
            };
            let c = async {
                let _ = tokio::io::copy(&mut ur, &mut cw).await;
                let _ = cw.shutdown().await;
            };
            tokio::join!(a, c);
            Ok(false)
        }
    }
}

/// Read the origin's response head (passing 1xx through), run
/// `response_filter`, send the head and relay the body.
#[allow(clippy::too_many_arguments)]
async fn relay_response<H: Hooks, R, W>(
    w: &Worker<H>,
    state: &State,
    ur: &mut R,
    cw: &mut W,
    ubuf: &mut BytesMut,
    out: &mut Vec<u8>,
    resp: &mut ResponseHead,
    sess: &mut Session,
    ctx: &mut H::Ctx,
    method: Method,
    reused: bool,
    inflight: &mut Option<pier_lb::ActiveGuard>,
) -> Result<Relayed, Fail>
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin,
{
    let t = &state.cfg.timeouts;
    let deadline = tokio::time::Instant::now() + t.upstream_response;
    let mut got_any = false;
    // Head (and any 1xx before it).
    loop {
        let parsed = if ubuf.is_empty() {
            None
        } else {
            resp.parse(ubuf, &state.head_limits).map_err(Fail::up)?
        };
        match parsed {
            Some(n) => {
                ubuf.advance(n);
                if resp.status == 101 {
                    break;
                }
                if (100..200).contains(&resp.status) {
                    // 100 Continue, 103 Early Hints: pass to HTTP/1.1 clients.
                    if sess.req.version == 1 {
                        out.clear();
                        write::response_head(out, resp, skip_response_header);
                        out.extend_from_slice(b"\r\n");
                        if cw.write_all(out).await.is_err() {
                            return Err(Fail {
                                kind: Kind::ClientClosed,
                                client_touched: true,
                                replayable: false,
                                stale: false,
                                upstream_fault: false,
                            });
                        }
                    }
                    continue;
                }
                break;
            }
            None => {
                ubuf.reserve(READ_CHUNK);
                match tokio::time::timeout_at(deadline, ur.read_buf(ubuf)).await {
                    Ok(Ok(0)) | Ok(Err(_)) => {
                        let kind = if got_any {
                            Kind::UpstreamProtocol
                        } else {
                            Kind::UpstreamClosed
                        };
                        return Err(Fail {
                            kind,
                            client_touched: false,
                            replayable: true,
                            stale: reused && !got_any,
                            upstream_fault: !reused || got_any,
                        });
                    }
                    Ok(Ok(_)) => got_any = true,
                    Err(_) => return Err(Fail::up(Kind::UpstreamTimeout)),
                }
            }
        }
    }
    let body = resp.body_len(method).map_err(Fail::up)?;
    let upgrade = resp.status == 101;
    if upgrade && !sess.req.headers.has_known(known::UPGRADE) {
        return Err(Fail::up(Kind::UpstreamProtocol));
    }
    if let Err(e) = w.hooks.response_filter(state, sess, resp, ctx) {
        return Err(Fail {
            kind: e.kind,
            client_touched: false,
            replayable: false,
            stale: false,
            upstream_fault: false,
        });
    }
    if body == BodyLen::Chunked && resp.headers.has_known(known::CONTENT_LENGTH) {
        // RFC 9112 §6.3: Transfer-Encoding wins; a Content-Length beside it
        // must not reach the client.
        resp.headers.remove_known(known::CONTENT_LENGTH);
    }
    if resp.headers.has_known(known::CONNECTION) && !upgrade {
        pier_http::remove_hop_by_hop(&mut resp.headers);
    }
    let mut client_keep = sess.client_keep && body != BodyLen::UntilClose;
    // An HTTP/1.0 client can't read chunked framing: close-delimit instead.
    if sess.req.version == 0 && body == BodyLen::Chunked {
        client_keep = false;
    }
    let upstream_keep = resp.keep_alive() && body != BodyLen::UntilClose && !upgrade;
    // A body filter may change the length: re-frame as chunked (or close-delimited for HTTP/1.0).
    // An HTTP/1.0 client can't read chunked framing either: decode it for them.
    let filtering = body != BodyLen::None
        && !upgrade
        && ((sess.req.version == 0 && body == BodyLen::Chunked)
            || w.hooks.has_body_filter(state, sess));
    if filtering {
        resp.headers.remove_known(known::CONTENT_LENGTH);
        resp.headers.remove_known(known::TRANSFER_ENCODING);
        if sess.req.version == 0 {
            client_keep = false;
        }
    }

    out.clear();
    if upgrade {
        write::response_head(out, resp, |k| {
            matches!(k, known::KEEP_ALIVE | known::PROXY_CONNECTION)
        });
    } else {
        write::response_head(out, resp, skip_response_header);
        if !resp.headers.has_known(known::DATE) {
            date::with_date(sess.now_ns, |d| write::header(out, b"Date", d));
        }
        if filtering && sess.req.version == 1 {
            out.extend_from_slice(b"Transfer-Encoding: chunked\r\n");
        }
        if !client_keep {
            out.extend_from_slice(b"Connection: close\r\n");
        } else if sess.req.version == 0 {
            out.extend_from_slice(b"Connection: keep-alive\r\n");
        }
    }
    out.extend_from_slice(b"\r\n");
    sess.status = resp.status;
    if upgrade {
        if !ubuf.is_empty() {
            out.extend_from_slice(ubuf);
            ubuf.clear();
        }
        sess.bytes_sent += out.len() as u64;
        cw.write_all(out).await.map_err(|_| Fail {
            kind: Kind::ClientClosed,
            client_touched: true,
            replayable: false,
            stale: false,
            upstream_fault: false,
        })?;
        return Ok(Relayed::Upgrade);
    }

    if filtering {
        let chunked_out = sess.req.version == 1;
        let up_ok =
            relay_filtered(w, state, ur, cw, ubuf, out, sess, ctx, body, chunked_out).await?;
        return Ok(Relayed::Done(upstream_keep && up_ok, client_keep));
    }
    let touched = |kind: Kind, upstream_fault: bool| Fail {
        kind,
        client_touched: true,
        replayable: false,
        stale: false,
        upstream_fault,
    };
    let send_timeout = t.client_idle;
    let idle_read = t.upstream_response;
    let mut upstream_reusable = upstream_keep;
    match body {
        BodyLen::None => {
            inflight.take();
            sess.bytes_sent += out.len() as u64;
            cw.write_all(out)
                .await
                .map_err(|_| touched(Kind::ClientClosed, false))?;
            if !ubuf.is_empty() {
                upstream_reusable = false; // bytes after a bodiless response
            }
        }
        BodyLen::Length(n) => {
            // Head and whatever body already arrived go out in one write.
            let take = (ubuf.len() as u64).min(n) as usize;
            out.extend_from_slice(&ubuf[..take]);
            ubuf.advance(take);
            let mut remaining = n - take as u64;
            if remaining == 0 {
                inflight.take();
            }
            sess.bytes_sent += out.len() as u64;
            write_timed(cw, out, send_timeout)
                .await
                .map_err(|_| touched(Kind::ClientClosed, false))?;
            while remaining > 0 {
                ubuf.reserve(READ_CHUNK);
                let got = match timeout(idle_read, ur.read_buf(ubuf)).await {
                    Ok(Ok(0)) | Ok(Err(_)) => return Err(touched(Kind::UpstreamClosed, true)),
                    Ok(Ok(g)) => g,
                    Err(_) => return Err(touched(Kind::UpstreamTimeout, true)),
                };
                let _ = got;
                let take = (ubuf.len() as u64).min(remaining) as usize;
                if take as u64 == remaining {
                    inflight.take();
                }
                write_timed(cw, &ubuf[..take], send_timeout)
                    .await
                    .map_err(|_| touched(Kind::ClientClosed, false))?;
                ubuf.advance(take);
                remaining -= take as u64;
                sess.bytes_sent += take as u64;
            }
            if !ubuf.is_empty() {
                upstream_reusable = false;
            }
        }
        BodyLen::Chunked => {
            let mut sc = ChunkedScanner::new();
            let n = sc
                .feed(ubuf)
                .map_err(|_| Fail::up(Kind::UpstreamProtocol))?;
            out.extend_from_slice(&ubuf[..n]);
            ubuf.advance(n);
            if sc.is_done() {
                inflight.take();
            }
            sess.bytes_sent += out.len() as u64;
            write_timed(cw, out, send_timeout)
                .await
                .map_err(|_| touched(Kind::ClientClosed, false))?;
            while !sc.is_done() {
                ubuf.reserve(READ_CHUNK);
                match timeout(idle_read, ur.read_buf(ubuf)).await {
                    Ok(Ok(0)) | Ok(Err(_)) => return Err(touched(Kind::UpstreamClosed, true)),
                    Ok(Ok(_)) => {}
                    Err(_) => return Err(touched(Kind::UpstreamTimeout, true)),
                }
                let n = sc
                    .feed(ubuf)
                    .map_err(|_| touched(Kind::UpstreamProtocol, true))?;
                if sc.is_done() {
                    inflight.take();
                }
                write_timed(cw, &ubuf[..n], send_timeout)
                    .await
                    .map_err(|_| touched(Kind::ClientClosed, false))?;
                ubuf.advance(n);
                sess.bytes_sent += n as u64;
            }
            if !ubuf.is_empty() {
                upstream_reusable = false;
            }
        }
        BodyLen::UntilClose => {
            out.extend_from_slice(ubuf);
            ubuf.clear();
            sess.bytes_sent += out.len() as u64;
            write_timed(cw, out, send_timeout)
                .await
                .map_err(|_| touched(Kind::ClientClosed, false))?;
            loop {
                ubuf.reserve(READ_CHUNK);
                match timeout(idle_read, ur.read_buf(ubuf)).await {
                    Ok(Ok(0)) => break,
                    Ok(Err(_)) => return Err(touched(Kind::UpstreamClosed, true)),
                    Ok(Ok(_)) => {}
                    Err(_) => return Err(touched(Kind::UpstreamTimeout, true)),
                }
                write_timed(cw, ubuf, send_timeout)
                    .await
                    .map_err(|_| touched(Kind::ClientClosed, false))?;
                sess.bytes_sent += ubuf.len() as u64;
                ubuf.clear();
            }
        }
    }
    Ok(Relayed::Done(upstream_reusable, client_keep))
}

/// Relay a response body through `Hooks::body_filter`: decode the origin's
/// framing, filter each piece, re-frame for the client (chunked, or
/// close-delimited for HTTP/1.0). Returns whether the origin connection ended
/// cleanly (reusable).
#[allow(clippy::too_many_arguments)]
async fn relay_filtered<H: Hooks, R, W>(
    w: &Worker<H>,
    state: &State,
    ur: &mut R,
    cw: &mut W,
    ubuf: &mut BytesMut,
    out: &mut Vec<u8>,
    sess: &mut Session,
    ctx: &mut H::Ctx,
    body: BodyLen,
    chunked_out: bool,
) -> Result<bool, Fail>
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin,
{
    let t = &state.cfg.timeouts;
    let touched = |kind: Kind, upstream_fault: bool| Fail {
        kind,
        client_touched: true,
        replayable: false,
        stale: false,
        upstream_fault,
    };
    // The head goes first, alone.
    sess.bytes_sent += out.len() as u64;
    write_timed(cw, out, t.client_idle)
        .await
        .map_err(|_| touched(Kind::ClientClosed, false))?;
    let mut remaining = match body {
        BodyLen::Length(n) => n,
        _ => u64::MAX,
    };
    let mut scanner = ChunkedScanner::new();
    let mut piece = BytesMut::with_capacity(READ_CHUNK);
    let mut origin_closed = false;
    loop {
        // Decode what has arrived into `piece`.
        piece.clear();
        let eof = match body {
            BodyLen::Chunked => {
                let n = scanner
                    .feed_data(ubuf, |r| piece.extend_from_slice(&ubuf[r]))
                    .map_err(|_| touched(Kind::UpstreamProtocol, true))?;
                ubuf.advance(n);
                scanner.is_done()
            }
            BodyLen::UntilClose => {
                piece.extend_from_slice(ubuf);
                ubuf.clear();
                origin_closed
            }
            _ => {
                let take = (ubuf.len() as u64).min(remaining) as usize;
                piece.extend_from_slice(&ubuf[..take]);
                ubuf.advance(take);
                remaining -= take as u64;
                remaining == 0
            }
        };
        if !piece.is_empty() || eof {
            w.hooks
                .body_filter(state, sess, ctx, &mut piece, eof)
                .map_err(|e| touched(e.kind, false))?;
            out.clear();
            if chunked_out {
                if !piece.is_empty() {
                    let mut hex = [0u8; 16];
                    out.extend_from_slice(hex_len(&mut hex, piece.len()));
                    out.extend_from_slice(b"\r\n");
                    out.extend_from_slice(&piece);
                    out.extend_from_slice(b"\r\n");
                }
                if eof {
                    out.extend_from_slice(b"0\r\n\r\n");
                }
            } else {
                out.extend_from_slice(&piece);
            }
            if !out.is_empty() {
                sess.bytes_sent += out.len() as u64;
                write_timed(cw, out, t.client_idle)
                    .await
                    .map_err(|_| touched(Kind::ClientClosed, false))?;
            }
        }
        if eof {
            return Ok(!origin_closed && ubuf.is_empty());
        }
        ubuf.reserve(READ_CHUNK);
        match timeout(t.upstream_response, ur.read_buf(ubuf)).await {
            Ok(Ok(0)) if body == BodyLen::UntilClose => origin_closed = true,
            Ok(Ok(0)) | Ok(Err(_)) => return Err(touched(Kind::UpstreamClosed, true)),
            Ok(Ok(_)) => {}
            Err(_) => return Err(touched(Kind::UpstreamTimeout, true)),
        }
    }
}

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

async fn write_timed<W: AsyncWrite + Unpin>(
    w: &mut W,
    data: &[u8],
    t: Duration,
) -> std::io::Result<()> {
    match timeout(t, w.write_all(data)).await {
        Ok(r) => r,
        Err(_) => Err(std::io::ErrorKind::TimedOut.into()),
    }
}

/// Minimum body rate applies after this grace time (slow starts are normal).
const MIN_RATE_GRACE: Duration = Duration::from_secs(10);

/// How a request body must arrive: per-read idle timeout, and (after a grace
/// period) a minimum average rate, so a trickling upload can't hold a
/// connection and an origin slot forever (slow-POST attacks).
struct BodyPace {
    read_timeout: Duration,
    min_rate: u64,
    started: Instant,
    got: u64,
}

impl BodyPace {
    async fn read_more<R: AsyncRead + Unpin>(
        &mut self,
        cr: &mut R,
        rbuf: &mut BytesMut,
    ) -> Result<(), Kind> {
        rbuf.reserve(READ_CHUNK);
        match timeout(self.read_timeout, cr.read_buf(rbuf)).await {
            Ok(Ok(0)) | Ok(Err(_)) => Err(Kind::ClientClosed),
            Ok(Ok(n)) => {
                self.got += n as u64;
                if self.min_rate > 0 {
                    let el = self.started.elapsed();
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
}

/// Scan the chunked body bytes already buffered (and, with `wait`, read until
/// the first size line is whole, within `limit`), so that a body whose framing
/// is bad from the start is refused before anything reaches an origin.
/// Nothing is consumed: `pump_body` scans the same bytes again as it sends.
async fn vet_chunked(
    stream: &mut TcpStream,
    rbuf: &mut BytesMut,
    limit: Duration,
    wait: bool,
) -> Result<(), Kind> {
    let mut sc = ChunkedScanner::new();
    let mut scanned = 0;
    let deadline = tokio::time::Instant::now() + limit;
    loop {
        if rbuf.len() > scanned {
            scanned += sc.feed(&rbuf[scanned..])?;
        }
        if sc.is_done() || sc.past_first_size() || !wait {
            return Ok(());
        }
        // The first size line is bounded (16 digits + 4 KiB of extensions).
        rbuf.reserve(4096);
        match tokio::time::timeout_at(deadline, stream.read_buf(rbuf)).await {
            Ok(Ok(0)) | Ok(Err(_)) => return Err(Kind::ClientClosed),
            Ok(Ok(_)) => {}
            Err(_) => return Err(Kind::BodyTimeout),
        }
    }
}

/// Stream the request body from the client to the origin, exactly as framed
/// (chunked bodies verbatim, validated by the scanner).
async fn pump_body<R, W>(
    cr: &mut R,
    rbuf: &mut BytesMut,
    uw: &mut W,
    body: BodyLen,
    max_body: u64,
    mut pace: BodyPace,
) -> Result<(), Kind>
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin,
{
    match body {
        BodyLen::None | BodyLen::UntilClose => Ok(()),
        BodyLen::Length(mut remaining) => loop {
            let take = (rbuf.len() as u64).min(remaining) as usize;
            if take > 0 {
                uw.write_all(&rbuf[..take])
                    .await
                    .map_err(|_| Kind::UpstreamClosed)?;
                rbuf.advance(take);
                remaining -= take as u64;
            }
            if remaining == 0 {
                return Ok(());
            }
            pace.read_more(cr, rbuf).await?;
        },
        BodyLen::Chunked => {
            let mut sc = ChunkedScanner::new();
            let mut total = 0u64;
            loop {
                if !rbuf.is_empty() {
                    let n = sc.feed(rbuf)?;
                    total += n as u64;
                    if max_body > 0 && total > max_body {
                        return Err(Kind::BodyTooLarge);
                    }
                    uw.write_all(&rbuf[..n])
                        .await
                        .map_err(|_| Kind::UpstreamClosed)?;
                    rbuf.advance(n);
                }
                if sc.is_done() {
                    return Ok(());
                }
                pace.read_more(cr, rbuf).await?;
            }
        }
    }
}

#[cfg(test)]
mod size_tests {
    use super::*;

    fn size_of_future<F, Fut>(_: F) -> usize
    where
        F: FnOnce(Arc<Worker<crate::PierHooks>>, TcpStream, SocketAddr) -> Fut,
    {
        std::mem::size_of::<Fut>()
    }

    /// Every connection's task holds this future for its whole life, idle or
    /// not: its size is most of an idle keep-alive connection's memory.
    #[test]
    fn connection_future_stays_small() {
        let n = size_of_future(serve_connection::<crate::PierHooks>);
        eprintln!("serve_connection future: {n} bytes");
        assert!(n <= 1536, "serve_connection future grew to {n} bytes");
    }
}
