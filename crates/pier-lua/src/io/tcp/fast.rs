//! The cosocket fast path: `send`, `receive*`, `setkeepalive`,
//! `getreusedtimes`, connects served from a pool and new connections to an
//! address, as `extern "C"` functions (reached through the LuaJIT FFI like
//! the rest of the API, or wrapped as classic C functions: see the end of
//! this file) instead of mlua async functions (which box a future and build
//! result values on every call: the malloc/free and GC work seen in
//! profiles).
//!
//! A call tries its operation at once, against the socket's buffer and the
//! connection, polling with the waker of the task that runs the hook
//! (`current::with_waker`). When it cannot finish it arms the socket's
//! deadline and returns [`AGAIN`]; the Lua wrapper (`lua/pier/socket.lua`)
//! then yields mlua's pending marker, the task sleeps until the connection
//! or the deadline wakes it, and the wrapper calls again with `retry` set.
//! Nothing is allocated per call in steady state: results are copied into
//! the caller's buffer, and each socket's buffers and timer are reused, as
//! are the sockets themselves (see `recycle`).
//!
//! Every function follows the FFI conventions of `crate::ffi` (status as
//! an `int`, panics caught, every pointer argument NULL or valid for the
//! call: "the ffi contract").

use std::borrow::Cow;
use std::cell::RefCell;
use std::future::Future;
use std::os::raw::{c_char, c_int};
use std::pin::Pin;
use std::rc::Rc;
use std::task::{Context, Poll};

use bytes::{Buf, BufMut};
use tokio::io::AsyncWrite;
use tokio::time::{Instant, Sleep};

use super::{lookup_raw, pool, try_new_tcp, Bad, Full, NoSock, Sock, TcpSock, KEY, TOO_LARGE};
use crate::current;
use crate::ffi::{arg, guard, put, E_PHASE};
use crate::phase::mask;

/// Would block: yield the pending marker, then call again with `retry`.
pub(crate) const AGAIN: c_int = -11;
const E_TIMEOUT: c_int = -20;
const E_CLOSED: c_int = -21;
/// Another error: its text from `errmsg`.
const E_IO: c_int = -22;
const E_BADSOCK: c_int = -23;
const E_BADREQ: c_int = -24;
/// Another coroutine is reading (or writing) this socket.
const E_BUSY: c_int = -25;
/// The receive buffer or a send reached `[lua] socket_buffer`: raised.
const E_TOOLARGE: c_int = -26;
/// The result is larger than the caller's buffer: its size is in `*outlen`.
const E_NEED: c_int = -27;

/// `recv` modes.
const LINE: c_int = 0;
const ALL: c_int = 1;
const SIZE: c_int = 2;
const ANY: c_int = 3;
const UNTIL: c_int = 4;
const UNTIL_INCLUSIVE: c_int = 5;

/// `recv` results besides errors: data, data ending at the pattern
/// (`receiveuntil`), and "nothing" (a sized `receiveuntil` at the pattern).
const OK: c_int = 0;
const FIN: c_int = 1;
const NOTHING: c_int = 2;

/// `send` flags: append to the socket's send buffer without I/O, or go on
/// with a send that returned [`AGAIN`].
const APPEND: c_int = 1;
const RETRY: c_int = 2;
/// The data is a table's content: bounded by `[lua] socket_buffer` as
/// appended pieces are (a string is sent as it is, whatever its size).
const BOUNDED: c_int = 4;

/// The state of the operation in progress, kept across `AGAIN`s.
#[derive(Default)]
pub(super) struct OpState {
    reading: bool,
    writing: bool,
    /// Bytes of `buf` already searched for the delimiter.
    scanned: usize,
    /// The running operation's timer is armed.
    armed: bool,
    /// Taken from this thread's spare timers the first time the socket
    /// waits; given back when the socket is recycled.
    sleep: Option<Pin<Box<Sleep>>>,
    /// A finished receive whose result did not fit the caller's buffer and
    /// cannot be computed again (an error with partial data): its code.
    parked: Option<c_int>,
    /// Result bytes that are not a slice of `buf` (CRs dropped, parked).
    scratch: Vec<u8>,
    /// The text of the last [`E_IO`].
    err: Cow<'static, str>,
    /// Flushed bytes of `wbuf`, and the size of the send in progress.
    wpos: usize,
    wtotal: usize,
    /// A new connection being opened by [`connect_new`] (registered,
    /// waiting to become writable).
    pub(super) connecting: Option<tokio::net::TcpStream>,
    /// The connection opened inside `connect(2)` and nothing was written
    /// yet: the poller has not reported it writable, so the first write
    /// is tried directly (see [`open_tcp`]).
    pub(super) fresh: bool,
    /// A connect that found its pool empty with connections of the pool
    /// in use, put back once in the run queue before opening one: the
    /// port to connect to (see [`TcpSock::connect_new`]).
    pub(super) deferred: Option<u16>,
    /// Set while a deferred connect waits for a connection given back
    /// (its entries in the pool's wait list are skipped once cleared).
    pub(super) release: Option<Rc<std::cell::Cell<bool>>>,
}

impl OpState {
    /// A deferred connect ends (it got a connection, opens one, or the
    /// socket closed).
    pub(super) fn end_deferred(&mut self) {
        self.deferred = None;
        if let Some(f) = self.release.take() {
            f.set(false);
        }
    }

    /// The flag of this socket's wait for a connection given back.
    fn release_flag(&mut self) -> Rc<std::cell::Cell<bool>> {
        self.release
            .get_or_insert_with(|| Rc::new(std::cell::Cell::new(true)))
            .clone()
    }
}

thread_local! {
    /// Spare timers and recycled sockets (bounded): a request that opens a
    /// socket per request (lua-resty-redis does) allocates none of them.
    static SPARE_SLEEPS: RefCell<Vec<Pin<Box<Sleep>>>> = const { RefCell::new(Vec::new()) };
    static SPARE_SOCKS: RefCell<Vec<Rc<RefCell<TcpSock>>>> = const { RefCell::new(Vec::new()) };
}
const MAX_SPARE: usize = 256;
/// Receive buffers larger than this are not kept by a recycled socket.
const KEEP_RBUF: usize = 64 << 10;

/// A non-blocking connect to `addr`, and whether it is already open.
///
/// To a local address the handshake completes inside `connect(2)` (the
/// kernel runs the peer's side in the same call), so the socket is
/// usually open when it returns "in progress": checked with
/// `getpeername`, the request goes on at once instead of waiting for
/// the poller to report it writable, which costs a trip through the
/// whole run queue (under load, hundreds of tasks) while the hook holds
/// its pool place.
fn open_tcp(addr: std::net::SocketAddr) -> std::io::Result<(tokio::net::TcpStream, bool)> {
    use socket2::{Domain, Protocol, Socket, Type};
    let sock = Socket::new(
        Domain::for_address(addr),
        Type::STREAM.nonblocking(),
        Some(Protocol::TCP),
    )?;
    let _ = sock.set_tcp_nodelay(true);
    let open = match sock.connect(&addr.into()) {
        Ok(()) => true,
        Err(e) if e.raw_os_error() == Some(libc::EINPROGRESS) => sock.peer_addr().is_ok(),
        Err(e) => return Err(e),
    };
    Ok((tokio::net::TcpStream::from_std(sock.into())?, open))
}

/// A write to `c`, the first one of a connection opened inside
/// `connect(2)` tried directly: tokio writes only once its poller has
/// reported a socket writable, and waiting for that report puts the
/// hook at the back of the run queue with its pool place held.
fn write_some(
    c: &mut super::Conn,
    fresh: &mut bool,
    cx: &mut Context<'_>,
    buf: &[u8],
) -> Poll<std::io::Result<usize>> {
    // Plain TCP only: a TLS connection's bytes go through its session.
    if std::mem::take(fresh) && matches!(c, super::Conn::Tcp(_)) {
        match c.sock_ref().send_with_flags(buf, libc::MSG_NOSIGNAL) {
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
            r => return Poll::Ready(r),
        }
    }
    Pin::new(c).poll_write(cx, buf)
}

/// A socket for `tcp_new`: a recycled one if there is one.
pub(super) fn new_tcp(max_buf: usize, pool_wait: std::time::Duration) -> Rc<RefCell<TcpSock>> {
    if let Some(s) = SPARE_SOCKS.with_borrow_mut(Vec::pop) {
        if let Ok(mut t) = s.try_borrow_mut() {
            t.max_buf = max_buf;
            t.pool_wait = pool_wait;
        }
        return s;
    }
    Rc::new(RefCell::new(TcpSock::new(max_buf, pool_wait)))
}

/// Takes a freed socket back for reuse (its connection, if any, closes).
pub(super) fn recycle(sock: Sock) {
    let Sock::Tcp(rc) = sock else {
        return;
    };
    if Rc::strong_count(&rc) != 1 {
        return;
    }
    {
        let Ok(mut t) = rc.try_borrow_mut() else {
            return;
        };
        t.close_conn();
        t.spool = None;
        t.key = None;
        if t.buf.capacity() > KEEP_RBUF {
            t.buf = bytes::BytesMut::new();
        }
        t.wbuf.clear();
        t.connect_timeout = super::DEFAULT_TIMEOUT;
        t.send_timeout = super::DEFAULT_TIMEOUT;
        t.read_timeout = super::DEFAULT_TIMEOUT;
        t.reused = 0;
        t.peer_ip = None;
        let op = &mut t.op;
        op.reading = false;
        op.writing = false;
        op.scanned = 0;
        op.armed = false;
        op.parked = None;
        op.connecting = None;
        op.fresh = false;
        op.scratch.clear();
        op.wpos = 0;
        op.wtotal = 0;
    }
    let _ = SPARE_SOCKS.try_with(|s| {
        if let Ok(mut s) = s.try_borrow_mut() {
            if s.len() < MAX_SPARE {
                s.push(rc);
            }
        }
    });
}

impl Drop for OpState {
    fn drop(&mut self) {
        if let Some(t) = self.sleep.take() {
            let _ = SPARE_SLEEPS.try_with(|s| {
                if let Ok(mut s) = s.try_borrow_mut() {
                    if s.len() < MAX_SPARE {
                        s.push(t);
                    }
                }
            });
        }
    }
}

/// Runs `f` on the TCP socket `h` names, if the current request owns it.
fn with_tcp(h: f64, f: impl FnOnce(&mut TcpSock) -> c_int) -> c_int {
    // A handle is below 2^53 (see `INDEX_BITS`); anything else is no socket.
    if !(0.0..9.007_199_254_740_992e15).contains(&h) {
        return E_BADSOCK;
    }
    let rc = match lookup_raw(h as u64) {
        Ok(Sock::Tcp(s)) => s,
        Ok(Sock::Udp(_)) | Err(Bad::Socket) => return E_BADSOCK,
        Err(Bad::Request) => return E_BADREQ,
    };
    let Ok(mut s) = rc.try_borrow_mut() else {
        return E_BUSY;
    };
    guard(|| f(&mut s))
}

/// Where a receive's result is.
enum Src {
    Buf(usize, usize),
    Scratch,
}

/// What happens to the buffer once the result is delivered.
enum After {
    Advance(usize),
    Clear,
    ClearClose,
}

struct Outcome {
    code: c_int,
    src: Src,
    after: After,
}

impl TcpSock {
    /// Reads more into `buf` without waiting; `Ready(Ok(false))` at EOF.
    fn poll_fill(&mut self, cx: &mut Context<'_>) -> Poll<Result<bool, Cow<'static, str>>> {
        let Some(c) = self.conn.as_mut() else {
            return Poll::Ready(Err("closed".into()));
        };
        let room = self.max_buf.saturating_sub(self.buf.len());
        if room == 0 {
            return Poll::Ready(Err(TOO_LARGE.into()));
        }
        self.buf.reserve(room.min(8192));
        // Never past the bound (a read fills all spare capacity).
        let mut limited = (&mut self.buf).limit(room);
        match tokio_util::io::poll_read_buf(Pin::new(c), cx, &mut limited) {
            Poll::Pending => Poll::Pending,
            Poll::Ready(Err(e)) => Poll::Ready(Err(super::io_err(&e))),
            Poll::Ready(Ok(0)) => Poll::Ready(Ok(false)),
            Poll::Ready(Ok(_)) => Poll::Ready(Ok(true)),
        }
    }

    /// Arms the operation's deadline the first time it waits; true once it
    /// has passed. The timer is registered with `cx` either way.
    fn timed_out(&mut self, cx: &mut Context<'_>, timeout: std::time::Duration) -> bool {
        let op = &mut self.op;
        if !op.armed {
            let deadline = Instant::now() + timeout;
            match op.sleep.as_mut() {
                Some(t) => t.as_mut().reset(deadline),
                None => {
                    op.sleep = Some(match SPARE_SLEEPS.with_borrow_mut(Vec::pop) {
                        Some(mut t) => {
                            t.as_mut().reset(deadline);
                            t
                        }
                        None => Box::pin(tokio::time::sleep_until(deadline)),
                    })
                }
            }
            op.armed = true;
        }
        match op.sleep.as_mut() {
            Some(t) => t.as_mut().poll(cx).is_ready(),
            None => false,
        }
    }

    /// The receive `mode` from what is buffered, if it can end now.
    fn complete(&mut self, mode: c_int, n: usize, pat: &[u8]) -> Option<Outcome> {
        let len = self.buf.len();
        match mode {
            LINE => {
                let from = self.op.scanned.min(len);
                let Some(i) = memchr::memchr(b'\n', &self.buf[from..]) else {
                    self.op.scanned = len;
                    return None;
                };
                let end = from + i;
                let mut line_end = end;
                if line_end > 0 && self.buf[line_end - 1] == b'\r' {
                    line_end -= 1;
                }
                // CRs inside a line are dropped too (ngx_lua), at a copy's cost.
                let src = if memchr::memchr(b'\r', &self.buf[..line_end]).is_some() {
                    self.op.scratch.clear();
                    let buf = &self.buf[..line_end];
                    self.op.scratch.extend(buf.iter().filter(|&&b| b != b'\r'));
                    Src::Scratch
                } else {
                    Src::Buf(0, line_end)
                };
                Some(Outcome {
                    code: OK,
                    src,
                    after: After::Advance(end + 1),
                })
            }
            ALL => None,
            SIZE => (len >= n).then_some(Outcome {
                code: OK,
                src: Src::Buf(0, n),
                after: After::Advance(n),
            }),
            ANY => (len > 0).then(|| {
                let k = n.min(len);
                Outcome {
                    code: OK,
                    src: Src::Buf(0, k),
                    after: After::Advance(k),
                }
            }),
            _ => self.complete_until(n, pat, mode == UNTIL_INCLUSIVE),
        }
    }

    /// `receiveuntil`'s iterator step: the data before `pat` (with it when
    /// `inclusive`), or at most `size` bytes of it when `size` > 0.
    fn complete_until(&mut self, size: usize, pat: &[u8], inclusive: bool) -> Option<Outcome> {
        let len = self.buf.len();
        let from = self.op.scanned.min(len);
        if let Some(i) = memchr::memmem::find(&self.buf[from..], pat) {
            let i = from + i;
            let end = if inclusive { i + pat.len() } else { i };
            if size == 0 || end <= size {
                if end == 0 && size != 0 {
                    // Sized reads: nothing before the pattern, done.
                    return Some(Outcome {
                        code: NOTHING,
                        src: Src::Buf(0, 0),
                        after: After::Advance(pat.len()),
                    });
                }
                return Some(Outcome {
                    code: FIN,
                    src: Src::Buf(0, end),
                    after: After::Advance(i + pat.len()),
                });
            }
            if i > 0 {
                // The data before the pattern, in pieces of `size`.
                let k = i.min(size);
                return Some(Outcome {
                    code: OK,
                    src: Src::Buf(0, k),
                    after: After::Advance(k),
                });
            }
            // Inclusive, a pattern longer than `size`: it comes whole.
            return Some(Outcome {
                code: FIN,
                src: Src::Buf(0, pat.len()),
                after: After::Advance(pat.len()),
            });
        }
        // Bytes that cannot start a match are data.
        let safe = len.saturating_sub(pat.len() - 1);
        if size != 0 && safe >= size {
            return Some(Outcome {
                code: OK,
                src: Src::Buf(0, size),
                after: After::Advance(size),
            });
        }
        self.op.scanned = safe;
        None
    }

    /// A receive that failed with `code`: the buffered data is its partial
    /// result (CRs dropped for `*l`); any error but a timeout closes.
    fn failed(&mut self, code: c_int, mode: c_int) -> Outcome {
        let src = if mode == LINE && memchr::memchr(b'\r', &self.buf).is_some() {
            self.op.scratch.clear();
            let buf = &self.buf[..];
            self.op.scratch.extend(buf.iter().filter(|&&b| b != b'\r'));
            Src::Scratch
        } else {
            Src::Buf(0, self.buf.len())
        };
        Outcome {
            code,
            src,
            after: if code == E_TIMEOUT {
                After::Clear
            } else {
                After::ClearClose
            },
        }
    }

    /// Copies the outcome's bytes to `(out, cap)`, or reports their size
    /// ([`E_NEED`]): a success is then computed again by the next call (the
    /// buffer is left as it is), an error is parked for it.
    fn deliver(&mut self, o: Outcome, out: *mut c_char, cap: usize, outlen: *mut c_int) -> c_int {
        let data: &[u8] = match o.src {
            Src::Buf(a, b) => &self.buf[a..b],
            Src::Scratch => &self.op.scratch,
        };
        let n = data.len();
        let Ok(n32) = c_int::try_from(n) else {
            return E_TOOLARGE;
        };
        // SAFETY: `outlen` is NULL or writable (the ffi contract).
        unsafe { put(outlen, n32) };
        if n > cap || (out.is_null() && n > 0) {
            if o.code < 0 {
                if let Src::Buf(a, b) = o.src {
                    let (buf, scratch) = (&self.buf, &mut self.op.scratch);
                    scratch.clear();
                    scratch.extend_from_slice(&buf[a..b]);
                }
                self.op.parked = Some(o.code);
                self.finish_recv(o.after);
            }
            return E_NEED;
        }
        if n > 0 {
            // SAFETY: `out` is writable for `cap >= n` bytes (ffi contract)
            // and does not overlap the socket's buffers.
            unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), out.cast::<u8>(), n) };
        }
        self.finish_recv(o.after);
        o.code
    }

    fn finish_recv(&mut self, after: After) {
        match after {
            After::Advance(k) => self.buf.advance(k),
            After::Clear => self.buf.clear(),
            After::ClearClose => self.close_conn(),
        }
        self.op.reading = false;
        self.op.scanned = 0;
        self.op.armed = false;
    }

    #[allow(clippy::too_many_arguments)] // the C function's arguments, plus the context
    fn recv(
        &mut self,
        cx: &mut Context<'_>,
        mode: c_int,
        n: usize,
        pat: &[u8],
        retry: bool,
        out: *mut c_char,
        cap: usize,
        outlen: *mut c_int,
    ) -> c_int {
        if let Some(code) = self.op.parked {
            let n = self.op.scratch.len();
            let Ok(n32) = c_int::try_from(n) else {
                return E_TOOLARGE;
            };
            // SAFETY: `outlen` is NULL or writable (the ffi contract).
            unsafe { put(outlen, n32) };
            if n > cap || (out.is_null() && n > 0) {
                return E_NEED;
            }
            if n > 0 {
                // SAFETY: `out` is writable for `cap >= n` bytes (ffi contract).
                unsafe {
                    std::ptr::copy_nonoverlapping(self.op.scratch.as_ptr(), out.cast::<u8>(), n)
                };
            }
            self.op.parked = None;
            return code;
        }
        if !retry {
            if self.op.reading {
                return E_BUSY;
            }
            self.op.scanned = 0;
            self.op.armed = false;
        }
        if self.conn.is_none() {
            self.op.reading = false;
            // SAFETY: `outlen` is NULL or writable (the ffi contract).
            unsafe { put(outlen, 0) };
            return E_CLOSED;
        }
        loop {
            if let Some(o) = self.complete(mode, n, pat) {
                return self.deliver(o, out, cap, outlen);
            }
            match self.poll_fill(cx) {
                Poll::Ready(Ok(true)) => {}
                Poll::Ready(Ok(false)) => {
                    let o = if mode == ALL {
                        Outcome {
                            code: OK,
                            src: Src::Buf(0, self.buf.len()),
                            after: After::Clear,
                        }
                    } else {
                        self.failed(E_CLOSED, mode)
                    };
                    return self.deliver(o, out, cap, outlen);
                }
                Poll::Ready(Err(e)) => {
                    if e == TOO_LARGE {
                        self.close_conn();
                        self.buf = bytes::BytesMut::new();
                        self.op.reading = false;
                        return E_TOOLARGE;
                    }
                    let code = if e == "closed" { E_CLOSED } else { E_IO };
                    self.op.err = e;
                    let o = self.failed(code, mode);
                    return self.deliver(o, out, cap, outlen);
                }
                Poll::Pending => {
                    if self.timed_out(cx, self.read_timeout) {
                        let o = self.failed(E_TIMEOUT, mode);
                        return self.deliver(o, out, cap, outlen);
                    }
                    self.op.reading = true;
                    return AGAIN;
                }
            }
        }
    }

    /// Writes `wbuf[wpos..]` and flushes; the size of the send when done.
    fn flush_send(&mut self, cx: &mut Context<'_>) -> c_int {
        loop {
            let Some(c) = self.conn.as_mut() else {
                self.end_send();
                return E_CLOSED;
            };
            let r = if self.op.wpos < self.wbuf.len() {
                match write_some(c, &mut self.op.fresh, cx, &self.wbuf[self.op.wpos..]) {
                    Poll::Ready(Ok(0)) => Poll::Ready(Err(Cow::Borrowed("broken pipe"))),
                    Poll::Ready(Ok(k)) => {
                        self.op.wpos += k;
                        continue;
                    }
                    Poll::Ready(Err(e)) => Poll::Ready(Err(super::io_err(&e))),
                    Poll::Pending => Poll::Pending,
                }
            } else {
                Pin::new(c).poll_flush(cx).map_err(|e| super::io_err(&e))
            };
            return match r {
                Poll::Ready(Ok(())) => {
                    let total = self.op.wtotal;
                    self.end_send();
                    c_int::try_from(total).unwrap_or(c_int::MAX)
                }
                Poll::Ready(Err(e)) => {
                    self.op.err = e;
                    self.end_send();
                    self.close_conn();
                    E_IO
                }
                Poll::Pending => {
                    if self.timed_out(cx, self.send_timeout) {
                        // The rest is dropped, the connection kept (ngx_lua).
                        self.end_send();
                        return E_TIMEOUT;
                    }
                    self.op.writing = true;
                    AGAIN
                }
            };
        }
    }

    /// `connect` opening a new connection to an address literal: started
    /// (`retry` false) or polled again. 1 once connected, [`AGAIN`] while
    /// it is under way, 0 when this path does not apply (a name to
    /// resolve, `unix:`, a pool whose backlog queues the connect, a pool
    /// name too long): the wrapper then calls the async connect, which
    /// handles those.
    #[allow(clippy::too_many_arguments)]
    fn connect_new(
        &mut self,
        cx: &mut Context<'_>,
        host: &[u8],
        port: c_int,
        pool_name: &[u8],
        pool_size: c_int,
        backlog: c_int,
        retry: bool,
    ) -> c_int {
        if !retry {
            if self.op.reading
                || self.op.writing
                || self.op.connecting.is_some()
                || self.op.deferred.is_some()
            {
                return E_BUSY;
            }
            let ip = std::str::from_utf8(host)
                .ok()
                .and_then(|h| super::literal(h).parse::<std::net::IpAddr>().ok());
            let (Some(ip), Ok(port)) = (ip, u16::try_from(port)) else {
                return 0;
            };
            self.close_conn();
            self.spool = None;
            let pool = (!pool_name.is_empty()).then_some(pool_name);
            let Ok(spool) = self.pool_for(
                host,
                i64::from(port),
                pool,
                i64::from(pool_size),
                i64::from(backlog),
            ) else {
                return 0;
            };
            if let Some(sp) = &spool {
                if let Some((c, slot, reused)) = sp.take_idle() {
                    self.reuse(c, slot, reused, sp.clone());
                    return 1;
                }
                if sp.in_use() > 0 && !sp.queues() {
                    // None idle, some in use: their hooks may have a reply
                    // read, or about to be. This connect first lets them
                    // give their connections back rather than opening
                    // another (which a full pool closes later).
                    self.spool = Some(sp.clone());
                    self.peer_ip = Some(ip);
                    self.op.deferred = Some(port);
                    self.op.armed = false;
                    let wait = self.pool_wait.min(self.connect_timeout);
                    if sp.in_use() >= sp.size()
                        && !wait.is_zero()
                        && sp.wait_release(&self.op.release_flag(), cx.waker())
                    {
                        // As many in use as the pool keeps: one opened now
                        // would be closed after its use. Wait (at most
                        // `[lua] socket_pool_wait`) for one given back.
                        let _ = self.timed_out(cx, wait);
                    } else {
                        cx.waker().wake_by_ref();
                    }
                    return AGAIN;
                }
            }
            let rc = self.open_new(spool, ip, port);
            if rc != AGAIN {
                return rc;
            }
        } else if let Some(port) = self.op.deferred.take() {
            let (Some(ip), Some(sp)) = (self.peer_ip, self.spool.take()) else {
                self.op.end_deferred();
                return E_CLOSED;
            };
            if let Some((c, slot, reused)) = sp.take_idle() {
                self.op.armed = false;
                self.op.end_deferred();
                self.reuse(c, slot, reused, sp);
                return 1;
            }
            if self.op.armed
                && sp.in_use() >= sp.size()
                && !self.timed_out(cx, std::time::Duration::ZERO)
            {
                let flag = self.op.release_flag();
                if sp.wait_release(&flag, cx.waker()) {
                    self.spool = Some(sp);
                    self.op.deferred = Some(port);
                    return AGAIN;
                }
            }
            self.op.armed = false;
            self.op.end_deferred();
            let rc = self.open_new(Some(sp), ip, port);
            if rc != AGAIN {
                return rc;
            }
        }
        let ready = match self.op.connecting.as_ref() {
            Some(stream) => stream.poll_write_ready(cx),
            // Closed meanwhile (another light thread's `close`).
            None => return E_CLOSED,
        };
        match ready {
            Poll::Ready(r) => {
                let Some(stream) = self.op.connecting.take() else {
                    return E_CLOSED;
                };
                // Writable with an error pending is a refused or reset
                // connect (what tokio's own connect checks too).
                match r.and_then(|()| stream.take_error()) {
                    Ok(None) => self.connected(stream),
                    Ok(Some(e)) | Err(e) => {
                        self.op.err = super::io_err(&e);
                        self.connect_failed();
                        E_IO
                    }
                }
            }
            Poll::Pending => {
                if self.timed_out(cx, self.connect_timeout) {
                    self.connect_failed();
                    return E_TIMEOUT;
                }
                AGAIN
            }
        }
    }

    /// Counts a new connection in `spool` (unless its backlog queues it:
    /// 0, the async connect then waits) and opens it.
    fn open_new(
        &mut self,
        spool: Option<Rc<pool::Spool>>,
        ip: std::net::IpAddr,
        port: u16,
    ) -> c_int {
        if let Some(sp) = &spool {
            match sp.try_acquire() {
                Some(pool::Acquired::Reused(c, slot, reused)) => {
                    self.reuse(c, slot, reused, sp.clone());
                    return 1;
                }
                Some(pool::Acquired::Open(slot)) => self.slot = Some(slot),
                _ => {
                    self.spool = None;
                    self.peer_ip = None;
                    return 0;
                }
            }
        }
        self.spool = spool;
        self.peer_ip = Some(ip);
        self.op.armed = false;
        match open_tcp(std::net::SocketAddr::new(ip, port)) {
            Ok((stream, true)) => {
                self.op.fresh = true;
                self.connected(stream)
            }
            // Registered when the caller polls it.
            Ok((stream, false)) => {
                self.op.connecting = Some(stream);
                AGAIN
            }
            Err(e) => {
                self.op.err = super::io_err(&e);
                self.connect_failed();
                E_IO
            }
        }
    }

    /// A new connection is open: it becomes the socket's.
    fn connected(&mut self, stream: tokio::net::TcpStream) -> c_int {
        self.op.connecting = None;
        self.op.armed = false;
        self.conn = Some(super::Conn::Tcp(stream));
        self.reused = 0;
        1
    }

    /// A new connection that did not open: its pool place is freed.
    fn connect_failed(&mut self) {
        self.op.connecting = None;
        self.op.armed = false;
        self.slot = None;
        self.spool = None;
        self.peer_ip = None;
    }

    fn end_send(&mut self) {
        self.wbuf.clear();
        if self.wbuf.capacity() > super::KEEP_WBUF {
            self.wbuf = Vec::new();
        }
        self.op.wpos = 0;
        self.op.wtotal = 0;
        self.op.writing = false;
        self.op.armed = false;
    }

    /// A send of `data` (after what was appended), started or continued.
    fn send(&mut self, cx: &mut Context<'_>, data: &[u8], flags: c_int) -> c_int {
        if flags & RETRY == 0 {
            if self.op.writing {
                return E_BUSY;
            }
            if flags & BOUNDED != 0 && self.wbuf.len() + data.len() > self.max_buf {
                self.end_send();
                return E_TOOLARGE;
            }
            if self.conn.is_none() {
                self.end_send();
                return E_CLOSED;
            }
            self.op.armed = false;
            self.op.wpos = 0;
            if self.wbuf.is_empty() && !data.is_empty() {
                // A string alone: straight from Lua's memory while the
                // socket takes it.
                let Some(c) = self.conn.as_mut() else {
                    return E_CLOSED;
                };
                let mut done = 0;
                while done < data.len() {
                    match write_some(c, &mut self.op.fresh, cx, &data[done..]) {
                        Poll::Ready(Ok(0)) => {
                            self.op.err = "broken pipe".into();
                            self.close_conn();
                            return E_IO;
                        }
                        Poll::Ready(Ok(k)) => done += k,
                        Poll::Ready(Err(e)) => {
                            self.op.err = super::io_err(&e);
                            self.close_conn();
                            return E_IO;
                        }
                        Poll::Pending => break,
                    }
                }
                self.wbuf.extend_from_slice(&data[done..]);
                self.op.wpos = 0;
                self.op.wtotal = data.len();
            } else {
                if self.wbuf.len() + data.len() > self.max_buf {
                    self.end_send();
                    return E_TOOLARGE;
                }
                self.wbuf.extend_from_slice(data);
                self.op.wtotal = self.wbuf.len();
            }
        }
        self.flush_send(cx)
    }
}

/// The polling task's context for `f`, if a hook is being polled in a
/// phase that may yield.
fn with_cx(f: impl FnOnce(&mut Context<'_>) -> c_int) -> c_int {
    if !current::get().allows(mask::YIELD) {
        return E_PHASE;
    }
    current::with_waker(|w| match w {
        Some(w) => f(&mut Context::from_waker(w)),
        None => E_PHASE,
    })
}

// === the C side ===

#[repr(C)]
pub(crate) struct SockApi {
    new: unsafe extern "C" fn() -> f64,
    recv: unsafe extern "C" fn(
        f64,
        c_int,
        f64,
        *const c_char,
        usize,
        c_int,
        *mut c_char,
        usize,
        *mut c_int,
    ) -> c_int,
    send: unsafe extern "C" fn(f64, *const c_char, usize, c_int) -> c_int,
    errmsg: unsafe extern "C" fn(f64, *mut c_char, usize) -> c_int,
    setkeepalive: unsafe extern "C" fn(f64, f64, f64) -> c_int,
    reused: unsafe extern "C" fn(f64) -> c_int,
    connect_pooled:
        unsafe extern "C" fn(f64, *const c_char, usize, c_int, *const c_char, usize) -> c_int,
    connect_new: unsafe extern "C" fn(
        f64,
        *const c_char,
        usize,
        c_int,
        *const c_char,
        usize,
        c_int,
        c_int,
        c_int,
    ) -> c_int,
}

static SOCK_API: SockApi = SockApi {
    new,
    recv,
    send,
    errmsg,
    setkeepalive,
    reused,
    connect_pooled,
    connect_new,
};

/// The address Lua casts to `const pier_sock_api_t*`.
pub(crate) fn sock_api_addr() -> usize {
    &SOCK_API as *const SockApi as usize
}

/// `ngx.socket.tcp()`: the new socket's handle, plus [`ANCHOR`] when its
/// Lua object needs an `ffi.gc` anchor (`UNANCHORED_PER_REQUEST`); or -1
/// (no request), -2 (`[lua] max_sockets_per_request` reached), -3
/// (`max_sockets_per_worker`); when full the wrapper collects garbage
/// (collected sockets free their slots) and asks once more.
unsafe extern "C" fn new() -> f64 {
    let r = std::panic::catch_unwind(|| match try_new_tcp() {
        Ok((h, anchor)) => (h + if anchor { ANCHOR } else { 0 }) as f64,
        Err(NoSock::NoRequest) => -1.0,
        Err(NoSock::Full(Full::Request)) => -2.0,
        Err(NoSock::Full(Full::Worker)) => -3.0,
    });
    r.unwrap_or(-4.0)
}

/// Added to a new socket's handle (below 2^52: 28 bits of generation, 24 of
/// index) when it needs an anchor; the sum stays below 2^53, exact in a double.
const ANCHOR: u64 = 1 << 52;
const _: () =
    assert!(((super::GEN_MASK as u64) << super::INDEX_BITS | super::MAX_SLOTS as u64) < ANCHOR);

/// `receive` (`*l`, `*a`, a size), `receiveany(max)` and `receiveuntil`'s
/// iterator (`pat`, `inclusive`, `size`): see the module's comment.
#[allow(clippy::too_many_arguments)]
unsafe extern "C" fn recv(
    h: f64,
    mode: c_int,
    n: f64,
    pat: *const c_char,
    patlen: usize,
    retry: c_int,
    out: *mut c_char,
    cap: usize,
    outlen: *mut c_int,
) -> c_int {
    // SAFETY: `(ptr, len)` arguments from Lua are valid for the call (ffi contract).
    let pat = unsafe { arg(pat, patlen) };
    if !(LINE..=UNTIL_INCLUSIVE).contains(&mode) || (mode >= UNTIL && pat.is_empty()) {
        return crate::ffi::E_INVAL;
    }
    // NaN and negatives are refused by the wrapper; clamp whatever comes.
    let n = if n.is_nan() || n < 0.0 { 0.0 } else { n };
    with_cx(|cx| {
        with_tcp(h, |s| {
            let n = if n >= s.max_buf as f64 {
                s.max_buf
            } else {
                n as usize
            };
            if mode == SIZE && n == 0 {
                // SAFETY: `outlen` is NULL or writable (the ffi contract).
                unsafe { put(outlen, 0) };
                return if s.conn.is_some() { OK } else { E_CLOSED };
            }
            s.recv(cx, mode, n, pat, retry != 0, out, cap, outlen)
        })
    })
}

/// `send`: `flags` [`APPEND`] adds `data` to the socket's send buffer
/// (the pieces of a table), 0 sends it (after what was appended), and
/// [`RETRY`] goes on after [`AGAIN`]. The bytes sent when done.
unsafe extern "C" fn send(h: f64, p: *const c_char, n: usize, flags: c_int) -> c_int {
    // SAFETY: `(ptr, len)` arguments from Lua are valid for the call (ffi contract).
    let data = unsafe { arg(p, n) };
    if flags & APPEND != 0 {
        return with_tcp(h, |s| {
            if s.op.writing {
                return E_BUSY;
            }
            if s.wbuf.len() + data.len() > s.max_buf {
                s.wbuf.clear();
                return E_TOOLARGE;
            }
            s.wbuf.extend_from_slice(data);
            OK
        });
    }
    if data.len() > c_int::MAX as usize {
        return E_TOOLARGE;
    }
    with_cx(|cx| with_tcp(h, |s| s.send(cx, data, flags)))
}

/// The text of the socket's last [`E_IO`], copied to `(out, cap)`.
unsafe extern "C" fn errmsg(h: f64, out: *mut c_char, cap: usize) -> c_int {
    with_tcp(h, |s| {
        // SAFETY: `out` is NULL or writable for `cap` bytes (the ffi contract).
        unsafe { crate::ffi::copy_out(s.op.err.as_bytes(), out, cap) }
    })
}

/// `setkeepalive(idle_ms, pool_size)` (NaN: not given; checked by the
/// wrapper): 1, or an error ([`E_IO`] with its text).
unsafe extern "C" fn setkeepalive(h: f64, idle_ms: f64, size: f64) -> c_int {
    with_tcp(h, |s| {
        if s.op.reading || s.op.writing {
            return E_BUSY;
        }
        // nil: 60 s; 0: never expires (ngx_lua).
        let idle = if idle_ms.is_nan() {
            super::DEFAULT_TIMEOUT
        } else {
            match crate::limits::duration_from_ms(idle_ms) {
                Ok(d) if d.is_zero() => {
                    std::time::Duration::from_secs_f64(crate::limits::MAX_DURATION_SECS)
                }
                Ok(d) => d,
                Err(_) => return crate::ffi::E_DURATION,
            }
        };
        let size = if size.is_nan() {
            super::DEFAULT_POOL_SIZE
        } else if (1.0..=1e9).contains(&size) {
            size as usize
        } else {
            return crate::ffi::E_INVAL;
        };
        match s.keepalive(idle, size) {
            Ok(()) => 1,
            Err(e) if e == "closed" => E_CLOSED,
            Err(e) => {
                s.op.err = e;
                E_IO
            }
        }
    })
}

/// `getreusedtimes()`.
unsafe extern "C" fn reused(h: f64) -> c_int {
    with_tcp(h, |s| {
        if s.conn.is_none() {
            return E_CLOSED;
        }
        c_int::try_from(s.reused).unwrap_or(c_int::MAX)
    })
}

/// `connect` served from an existing pool: 1 with an idle connection of
/// the pool (`pool`, else `host:port`; `port` < 0 for `unix:`), 0 when
/// there is none (the wrapper then calls the async connect, which opens
/// one, or queues with `backlog`).
unsafe extern "C" fn connect_pooled(
    h: f64,
    host: *const c_char,
    hlen: usize,
    port: c_int,
    pool_name: *const c_char,
    plen: usize,
) -> c_int {
    // SAFETY: `(ptr, len)` arguments from Lua are valid for the call (ffi contract).
    let (host, pool_name) = unsafe { (arg(host, hlen), arg(pool_name, plen)) };
    with_tcp(h, |s| {
        if s.op.reading || s.op.writing || s.op.connecting.is_some() {
            return E_BUSY;
        }
        let spool = KEY.with_borrow_mut(|key| {
            key.clear();
            if pool_name.is_empty() {
                key.extend_from_slice(host);
                if port >= 0 {
                    key.push(b':');
                    key.extend_from_slice(itoa::Buffer::new().format(port).as_bytes());
                }
            } else {
                key.extend_from_slice(pool_name);
            }
            pool::find(key)
        });
        let Some(sp) = spool else {
            return 0;
        };
        let Some((c, slot, reused)) = sp.take_idle() else {
            return 0;
        };
        s.close_conn();
        s.key = Some(sp.key().clone());
        s.reuse(c, slot, reused, sp);
        1
    })
}

/// `connect` opening a new connection without mlua's async machinery:
/// see [`TcpSock::connect_new`] (`pool_size` 0: none given; `backlog` -1:
/// none given; `retry` non-zero after an [`AGAIN`]).
#[allow(clippy::too_many_arguments)]
unsafe extern "C" fn connect_new(
    h: f64,
    host: *const c_char,
    hlen: usize,
    port: c_int,
    pool_name: *const c_char,
    plen: usize,
    pool_size: c_int,
    backlog: c_int,
    retry: c_int,
) -> c_int {
    // SAFETY: `(ptr, len)` arguments from Lua are valid for the call (ffi contract).
    let (host, pool_name) = unsafe { (arg(host, hlen), arg(pool_name, plen)) };
    with_cx(|cx| {
        with_tcp(h, |s| {
            s.connect_new(cx, host, port, pool_name, pool_size, backlog, retry != 0)
        })
    })
}

// === classic C functions ===
//
// The calls that run interpreted on every request (`receive` and `send`
// around the yield that waits for the peer, `settimeout`, the anchor's
// finalizer) as `lua_CFunction`s, the way ngx_lua registers its cosocket
// methods: an interpreted FFI call converts and checks every argument
// against its C type (`lj_ccall_func`, `lj_cconv_*`: about 1,400
// instructions per call with these signatures, callgrind), a C function
// reads its few arguments off the stack. A yield ends the trace, so these
// call sites are not compiled whatever the calling convention. No Lua
// error is raised from here: results are codes, and the wrappers raise.

use mlua::ffi as lua;

thread_local! {
    /// `l_recv`'s result bytes (reused; taken out while in use).
    static RECV_OUT: std::cell::Cell<Vec<u8>> = const { std::cell::Cell::new(Vec::new()) };
}

/// A handle or number argument (`nil` and non-numbers read as 0).
///
/// # Safety
/// `l` is the state LuaJIT called the C function with.
unsafe fn num(l: *mut lua::lua_State, i: c_int) -> f64 {
    // SAFETY: any index within the call's frame is acceptable to lua_tonumber.
    unsafe { lua::lua_tonumber(l, i) }
}

/// A string argument (NULL, 0 when it is not a string): valid while it is
/// on the stack, i.e. for the call.
///
/// # Safety
/// As [`num`].
unsafe fn lstr(l: *mut lua::lua_State, i: c_int) -> (*const c_char, usize) {
    let mut n = 0usize;
    // SAFETY: the type is checked first, so lua_tolstring converts nothing
    // in place.
    unsafe {
        if lua::lua_type(l, i) != lua::LUA_TSTRING {
            return (std::ptr::null(), 0);
        }
        (lua::lua_tolstring(l, i, &mut n), n)
    }
}

/// An `int` argument: out of range or fractional reads as -1.
fn int_arg(v: f64) -> c_int {
    if v.fract() == 0.0 && (f64::from(c_int::MIN)..=f64::from(c_int::MAX)).contains(&v) {
        v as c_int
    } else {
        -1
    }
}

/// `recv(handle, mode, n, pattern|nil, retry)` -> `code[, data]`: the data
/// with [`OK`] and [`FIN`], the partial data with a timeout, `closed` or
/// I/O error ([`recv`]'s codes otherwise; no [`E_NEED`]).
pub(super) unsafe extern "C-unwind" fn l_recv(l: *mut lua::lua_State) -> c_int {
    // SAFETY: called by LuaJIT with its state (the lua_CFunction contract).
    let (h, mode, n, (pat, plen), retry) = unsafe {
        (
            num(l, 1),
            num(l, 2),
            num(l, 3),
            lstr(l, 4),
            lua::lua_toboolean(l, 5),
        )
    };
    let mut buf = RECV_OUT.take();
    let mut outlen: c_int = 0;
    let mut again = retry;
    let mut rc = E_NEED;
    // A result larger than the buffer: grow it and take the result again
    // (kept by the socket meanwhile, see `deliver`); twice is enough.
    for _ in 0..3 {
        // SAFETY: `pat` is the Lua string on the stack (valid for the
        // call), `buf` has `capacity()` writable bytes, `outlen` is local.
        rc = unsafe {
            recv(
                h,
                int_arg(mode),
                n,
                pat,
                plen,
                again,
                buf.as_mut_ptr().cast(),
                buf.capacity(),
                &mut outlen,
            )
        };
        if rc != E_NEED {
            break;
        }
        buf.reserve(usize::try_from(outlen).unwrap_or(0));
        again = 1;
    }
    if rc == E_NEED {
        rc = crate::ffi::E_INTERNAL;
    }
    let data = matches!(rc, OK | FIN | E_TIMEOUT | E_CLOSED | E_IO);
    let len = usize::try_from(outlen).unwrap_or(0).min(buf.capacity());
    // SAFETY: two pushes fit LUA_MINSTACK; `buf` holds `len` bytes written
    // by `recv`. The string is copied before `buf` goes back (if the push
    // fails for memory, LuaJIT unwinds through this frame: `buf` is only
    // lost, and the cell is empty until the next call fills it again).
    unsafe {
        lua::lua_pushnumber(l, f64::from(rc));
        if data {
            lua::lua_pushlstring_(l, buf.as_ptr().cast(), len);
        }
    }
    if buf.capacity() <= KEEP_RBUF {
        RECV_OUT.set(buf);
    }
    1 + c_int::from(data)
}

/// `send(handle, data|nil, flags)` -> code, as [`send`].
pub(super) unsafe extern "C-unwind" fn l_send(l: *mut lua::lua_State) -> c_int {
    // SAFETY: called by LuaJIT with its state (the lua_CFunction contract);
    // `p` is the Lua string on the stack, valid for the call.
    unsafe {
        let (h, (p, n), flags) = (num(l, 1), lstr(l, 2), num(l, 3));
        let rc = send(h, p, n, int_arg(flags));
        lua::lua_pushnumber(l, f64::from(rc));
    }
    1
}

/// `settimeouts(handle, connect_ms, send_ms, read_ms)` -> 0, or an error
/// code: the wrapper then calls the checked native, which raises the
/// error with its message (a bad duration, a socket not this request's).
pub(super) unsafe extern "C-unwind" fn l_settimeouts(l: *mut lua::lua_State) -> c_int {
    // SAFETY: called by LuaJIT with its state (the lua_CFunction contract).
    let (h, c, s, r) = unsafe { (num(l, 1), num(l, 2), num(l, 3), num(l, 4)) };
    let rc = with_tcp(h, |t| {
        let ms = |v: f64| match crate::limits::duration_from_ms(v) {
            Ok(d) if d.is_zero() => Ok(super::DEFAULT_TIMEOUT),
            Ok(d) => Ok(d),
            Err(_) => Err(()),
        };
        match (ms(c), ms(s), ms(r)) {
            (Ok(c), Ok(s), Ok(r)) => {
                t.connect_timeout = c;
                t.send_timeout = s;
                t.read_timeout = r;
                OK
            }
            _ => crate::ffi::E_DURATION,
        }
    });
    // SAFETY: one push fits LUA_MINSTACK.
    unsafe { lua::lua_pushnumber(l, f64::from(rc)) };
    1
}

/// `setkeepalive(handle, idle_ms|NaN, pool_size|NaN)` -> [`setkeepalive`]'s
/// code: the call right after the last receive of a request (the reply),
/// so it runs interpreted more often than not.
pub(super) unsafe extern "C-unwind" fn l_setkeepalive(l: *mut lua::lua_State) -> c_int {
    // SAFETY: called by LuaJIT with its state (the lua_CFunction contract);
    // one push fits LUA_MINSTACK.
    unsafe {
        let rc = setkeepalive(num(l, 1), num(l, 2), num(l, 3));
        lua::lua_pushnumber(l, f64::from(rc));
    }
    1
}

/// `free(handle)`: the anchor's finalizer (frees the socket's slot).
pub(super) unsafe extern "C-unwind" fn l_free(l: *mut lua::lua_State) -> c_int {
    // SAFETY: called by LuaJIT with its state (the lua_CFunction contract).
    let h = unsafe { num(l, 1) };
    if (0.0..9.007_199_254_740_992e15).contains(&h) {
        // A panic must not cross into LuaJIT (free_sock is not expected to).
        let _ = std::panic::catch_unwind(|| super::free_sock(h as u64));
    }
    0
}
