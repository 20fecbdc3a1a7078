//! Cosockets, as ngx_lua's `ngx.socket.tcp()` has them: calls yield the
//! hook's coroutine, never the thread; results follow ngx_lua (`nil,
//! err[, partial]` on failure, its error strings). TCP (host names
//! resolved), unix sockets, TLS (`sslhandshake`, rustls) and keep-alive
//! pools with ngx_lua's `pool` / `pool_size` / `backlog` (see `pool.rs`).
//!
//! One implementation, polled. Every method is a call from Lua (through
//! the LuaJIT FFI, or a classic C function: see `ffi.rs`) that tries its
//! operation at once, against the socket's buffer and the connection,
//! polling with the waker of the task that runs the hook
//! (`current::with_waker`). When it cannot finish it arms the socket's
//! deadline and returns [`AGAIN`]; the Lua wrapper (`lua/pier/socket.lua`)
//! then yields mlua's pending marker, the task sleeps until the connection
//! or the deadline wakes it, and the wrapper calls again with `retry` set:
//! the operation goes on where it stopped (its state is [`OpState`]).
//! Nothing is allocated per call in steady state: results are copied into
//! the caller's buffer, and each socket's buffers and timer are reused, as
//! are the sockets themselves (see [`recycle`]). No mlua future, userdata
//! or result value is made per call (mlua async functions box a future and
//! build result values on every call: the malloc/free and GC work seen in
//! profiles; until issue 32 the rarer operations — names, unix sockets,
//! backlog queues, TLS, options — still took that second path).
//!
//! Here: the connection, the socket and its state, `send`, `setkeepalive`,
//! `close` and options. `connect.rs`: pools, new connections, names and
//! unix sockets; `recv.rs`: the receive patterns; `tls.rs`: `sslhandshake`;
//! `ffi.rs`: the C boundary. The socket table (handles, owners) is
//! `io/table.rs`, shared with UDP.

use std::borrow::Cow;
use std::cell::RefCell;
use std::io;
use std::net::IpAddr;
use std::os::raw::c_int;
use std::pin::Pin;
use std::rc::Rc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::BytesMut;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpStream, UnixStream};
use tokio::time::{Instant, Sleep};
use tokio_rustls::client::TlsStream;

mod connect;
mod ffi;
mod recv;
mod tls;

pub(super) use connect::resolve;
pub(crate) use ffi::{register, sock_api_addr};

use super::pool::{self, Counted, Spool};
use super::table::Sock;

/// ngx_lua's `lua_socket_{connect,send,read}_timeout` and
/// `lua_socket_keepalive_timeout` defaults.
const DEFAULT_TIMEOUT: Duration = Duration::from_secs(60);
/// `lua_socket_pool_size`'s default.
const DEFAULT_POOL_SIZE: usize = 30;
/// A `send` buffer above this is released after the send.
const KEEP_WBUF: usize = 64 << 10;
/// Receive buffers larger than this are not kept by a recycled socket.
const KEEP_RBUF: usize = 64 << 10;

// === result codes ===
//
// What every operation returns to the Lua wrapper (`lua/pier/socket.lua`
// has the same table): a count or 1 when done, else one of these.

/// Would block: yield the pending marker, then call again with `retry`.
pub(crate) const AGAIN: c_int = -11;
const E_TIMEOUT: c_int = -20;
const E_CLOSED: c_int = -21;
/// Another error: its text from `errmsg` (returned as `nil, err`).
const E_IO: c_int = -22;
const E_BADSOCK: c_int = -23;
const E_BADREQ: c_int = -24;
/// Another coroutine is reading (or writing, or connecting) this socket.
const E_BUSY: c_int = -25;
/// The receive buffer or a send reached `[lua] socket_buffer`: raised.
const E_TOOLARGE: c_int = -26;
/// The result is larger than the caller's buffer: its size is in `*outlen`.
const E_NEED: c_int = -27;
/// A bad argument: its text from `errmsg`, raised.
const E_RAISE: c_int = -28;
/// Another coroutine is connecting this socket (ngx_lua's "socket busy
/// connecting", which its send, receive*, close, setkeepalive and
/// sslhandshake answer too).
const E_CONNECTING: c_int = -29;

// === connections ===

/// A cosocket's connection: TCP or unix, cleartext or TLS.
pub(crate) enum Conn {
    Tcp(TcpStream),
    Unix(UnixStream),
    TlsTcp(Box<TlsStream<TcpStream>>),
    TlsUnix(Box<TlsStream<UnixStream>>),
}

macro_rules! each_conn {
    ($self:expr, $s:ident => $e:expr) => {
        match $self {
            Conn::Tcp($s) => $e,
            Conn::Unix($s) => $e,
            Conn::TlsTcp($s) => $e,
            Conn::TlsUnix($s) => $e,
        }
    };
}

impl AsyncRead for Conn {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        each_conn!(self.get_mut(), s => Pin::new(s).poll_read(cx, buf))
    }
}

impl AsyncWrite for Conn {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        each_conn!(self.get_mut(), s => Pin::new(s).poll_write(cx, buf))
    }
    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        each_conn!(self.get_mut(), s => Pin::new(s).poll_flush(cx))
    }
    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        each_conn!(self.get_mut(), s => Pin::new(s).poll_shutdown(cx))
    }
}

impl Conn {
    /// An idle connection must have nothing to read: data or EOF means the
    /// peer closed it or broke the protocol. One non-blocking read through
    /// the TLS layer too, so a TLS 1.3 session ticket is not "data".
    pub fn still_open(&mut self) -> bool {
        let mut cx = Context::from_waker(std::task::Waker::noop());
        // No readiness event since the last read that would block: nothing
        // arrived (no data, no FIN), so no read is needed to know (this is
        // checked on every pooled connect and every setkeepalive).
        let quiet = match self {
            Conn::Tcp(s) => s.poll_read_ready(&mut cx).is_pending(),
            Conn::Unix(s) => s.poll_read_ready(&mut cx).is_pending(),
            Conn::TlsTcp(_) | Conn::TlsUnix(_) => false,
        };
        if quiet {
            return true;
        }
        let mut b = [0u8; 1];
        let mut rb = ReadBuf::new(&mut b);
        matches!(Pin::new(self).poll_read(&mut cx, &mut rb), Poll::Pending)
    }

    fn is_tls(&self) -> bool {
        matches!(self, Conn::TlsTcp(_) | Conn::TlsUnix(_))
    }

    fn sock_ref(&self) -> socket2::SockRef<'_> {
        match self {
            Conn::Tcp(s) => socket2::SockRef::from(s),
            Conn::Unix(s) => socket2::SockRef::from(s),
            Conn::TlsTcp(s) => socket2::SockRef::from(s.get_ref().0),
            Conn::TlsUnix(s) => socket2::SockRef::from(s.get_ref().0),
        }
    }
}

/// An I/O error as ngx_lua words it: the lowercased `strerror` text.
pub(super) fn io_err(e: &io::Error) -> Cow<'static, str> {
    use io::ErrorKind as K;
    Cow::Borrowed(match e.kind() {
        K::TimedOut => "timeout",
        K::ConnectionRefused => "connection refused",
        K::ConnectionReset => "connection reset by peer",
        K::BrokenPipe => "broken pipe",
        K::NotFound => "no such file or directory",
        K::PermissionDenied => "permission denied",
        K::AddrNotAvailable => "cannot assign requested address",
        K::HostUnreachable => "no route to host",
        K::NetworkUnreachable => "network is unreachable",
        K::UnexpectedEof => "closed",
        _ => {
            let s = e.to_string();
            let s = s.split(" (os error").next().unwrap_or("error");
            return Cow::Owned(s.to_ascii_lowercase());
        }
    })
}

// === the socket ===

pub(crate) struct TcpSock {
    conn: Option<Conn>,
    /// The connection's place in its pool's connection count.
    slot: Option<Counted>,
    /// The pool found (or made) at connect, else the pool key.
    spool: Option<Rc<Spool>>,
    key: Option<Rc<[u8]>>,
    buf: BytesMut,
    /// `send`'s buffer: a table's pieces, or what a send left (reused).
    wbuf: Vec<u8>,
    connect_timeout: Duration,
    send_timeout: Duration,
    read_timeout: Duration,
    reused: u32,
    /// TLS without a server name names the peer by its address.
    peer_ip: Option<IpAddr>,
    /// Most bytes buffered (`[lua] socket_buffer`): a peer that never sends
    /// the delimiter, or `*a` on an endless stream, cannot grow the buffer
    /// without bound.
    max_buf: usize,
    /// `[lua] socket_pool_wait` (see `connect::TcpSock::defer`).
    pool_wait: Duration,
    /// The operation in progress.
    op: OpState,
}

/// The state of the operation in progress, kept across [`AGAIN`]s.
#[derive(Default)]
struct OpState {
    reading: bool,
    writing: bool,
    /// Bytes of `buf` already searched for the delimiter.
    scanned: usize,
    /// The running operation's timer is armed.
    armed: bool,
    /// Taken from this thread's spare timers the first time the socket
    /// waits; given back when the socket is dropped.
    sleep: Option<Pin<Box<Sleep>>>,
    /// A finished receive whose result did not fit the caller's buffer and
    /// cannot be computed again (an error with partial data): its code.
    parked: Option<c_int>,
    /// Result bytes that are not a slice of `buf` (CRs dropped, parked).
    scratch: Vec<u8>,
    /// The text of the last [`E_IO`] or [`E_RAISE`].
    err: Cow<'static, str>,
    /// Flushed bytes of `wbuf`, and the size of the send in progress.
    wpos: usize,
    wtotal: usize,
    /// A connect under way.
    connect: Option<connect::Connecting>,
    /// A TLS handshake under way (the connection is in it).
    tls: Option<Box<tls::Handshake>>,
    /// The connection opened inside `connect(2)` and nothing was written
    /// yet: the poller has not reported it writable, so the first write
    /// is tried directly (see [`write_some`]).
    fresh: bool,
    /// Set while a connect waits for a connection given back to its pool
    /// (its entries in the pool's wait list are skipped once cleared).
    release: Option<Rc<std::cell::Cell<bool>>>,
}

impl OpState {
    /// A connect stops waiting for a connection given back (it got one,
    /// opens one, gave up, or the socket closed).
    fn end_wait(&mut self) {
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

/// A socket for `tcp()`: a recycled one if there is one.
pub(super) fn new_tcp(max_buf: usize, pool_wait: Duration) -> Rc<RefCell<TcpSock>> {
    if let Some(s) = SPARE_SOCKS.with_borrow_mut(Vec::pop) {
        if let Ok(mut t) = s.try_borrow_mut() {
            t.max_buf = max_buf;
            t.pool_wait = pool_wait;
        }
        return s;
    }
    Rc::new(RefCell::new(TcpSock {
        conn: None,
        slot: None,
        spool: None,
        key: None,
        buf: BytesMut::new(),
        wbuf: Vec::new(),
        connect_timeout: DEFAULT_TIMEOUT,
        send_timeout: DEFAULT_TIMEOUT,
        read_timeout: DEFAULT_TIMEOUT,
        reused: 0,
        peer_ip: None,
        max_buf,
        pool_wait,
        op: OpState::default(),
    }))
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
            t.buf = BytesMut::new();
        }
        t.wbuf.clear();
        t.connect_timeout = DEFAULT_TIMEOUT;
        t.send_timeout = DEFAULT_TIMEOUT;
        t.read_timeout = DEFAULT_TIMEOUT;
        t.reused = 0;
        t.peer_ip = None;
        let op = &mut t.op;
        op.reading = false;
        op.writing = false;
        op.scanned = 0;
        op.armed = false;
        op.parked = None;
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

impl TcpSock {
    /// Closes the connection (and frees its pool place); a connect or
    /// handshake under way ends too.
    fn close_conn(&mut self) {
        // Before the pool place is freed: the wake it gives goes to
        // another waiting connect, not this one.
        self.op.end_wait();
        self.op.connect = None;
        self.op.tls = None;
        self.conn = None;
        self.slot = None;
        self.buf.clear();
        self.op.fresh = false;
    }

    /// Takes an idle connection of `spool` (every connect path's reuse).
    fn reuse(&mut self, conn: Conn, slot: Counted, reused: u32, spool: Rc<Spool>) {
        self.conn = Some(conn);
        self.slot = Some(slot);
        self.reused = reused + 1;
        self.spool = Some(spool);
    }

    /// An operation is under way on another light thread.
    fn busy(&self) -> bool {
        self.op.reading || self.op.writing || self.op.connect.is_some() || self.op.tls.is_some()
    }

    /// Fails with [`E_IO`] and its text.
    fn fail(&mut self, err: impl Into<Cow<'static, str>>) -> c_int {
        self.op.err = err.into();
        E_IO
    }

    /// Arms the operation's deadline the first time it waits; true once it
    /// has passed. The timer is registered with `cx` either way.
    fn timed_out(&mut self, cx: &mut Context<'_>, timeout: Duration) -> bool {
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
            Some(t) => std::future::Future::poll(t.as_mut(), cx).is_ready(),
            None => false,
        }
    }
}

// === send ===

/// `send` flags: append to the socket's send buffer without I/O, or go on
/// with a send that returned [`AGAIN`].
const APPEND: c_int = 1;
const RETRY: c_int = 2;
/// The data is a table's content: bounded by `[lua] socket_buffer` as
/// appended pieces are (a string is sent as it is, whatever its size).
const BOUNDED: c_int = 4;

/// A write to `c`, the first one of a connection opened inside
/// `connect(2)` tried directly: tokio writes only once its poller has
/// reported a socket writable, and waiting for that report puts the
/// hook at the back of the run queue with its pool place held.
fn write_some(
    c: &mut Conn,
    fresh: &mut bool,
    cx: &mut Context<'_>,
    buf: &[u8],
) -> Poll<io::Result<usize>> {
    // Cleartext only: a TLS connection's bytes go through its session.
    if std::mem::take(fresh) && !c.is_tls() {
        match c.sock_ref().send_with_flags(buf, libc::MSG_NOSIGNAL) {
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
            r => return Poll::Ready(r),
        }
    }
    Pin::new(c).poll_write(cx, buf)
}

impl TcpSock {
    /// `data` appended to the send buffer (a table's piece).
    fn append(&mut self, data: &[u8]) -> c_int {
        if self.op.connect.is_some() {
            return E_CONNECTING;
        }
        if self.op.writing {
            return E_BUSY;
        }
        if self.wbuf.len() + data.len() > self.max_buf {
            self.wbuf.clear();
            return E_TOOLARGE;
        }
        self.wbuf.extend_from_slice(data);
        0
    }

    /// A send of `data` (after what was appended), started or continued.
    fn send(&mut self, cx: &mut Context<'_>, data: &[u8], flags: c_int) -> c_int {
        if flags & RETRY == 0 {
            if self.op.connect.is_some() {
                self.end_send();
                return E_CONNECTING;
            }
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
                            self.close_conn();
                            return self.fail("broken pipe");
                        }
                        Poll::Ready(Ok(k)) => done += k,
                        Poll::Ready(Err(e)) => {
                            self.close_conn();
                            return self.fail(io_err(&e));
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
                    Poll::Ready(Err(e)) => Poll::Ready(Err(io_err(&e))),
                    Poll::Pending => Poll::Pending,
                }
            } else {
                Pin::new(c).poll_flush(cx).map_err(|e| io_err(&e))
            };
            return match r {
                Poll::Ready(Ok(())) => {
                    let total = self.op.wtotal;
                    self.end_send();
                    c_int::try_from(total).unwrap_or(c_int::MAX)
                }
                Poll::Ready(Err(e)) => {
                    self.end_send();
                    self.close_conn();
                    self.fail(e)
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

    fn end_send(&mut self) {
        self.wbuf.clear();
        if self.wbuf.capacity() > KEEP_WBUF {
            self.wbuf = Vec::new();
        }
        self.op.wpos = 0;
        self.op.wtotal = 0;
        self.op.writing = false;
        self.op.armed = false;
    }
}

// === keep-alive, close, options ===

/// `setoption` / `getoption` names, as the Lua wrapper numbers them.
const OPT_KEEPALIVE: c_int = 1;
const OPT_REUSEADDR: c_int = 2;
const OPT_NODELAY: c_int = 3;
const OPT_SNDBUF: c_int = 4;
const OPT_RCVBUF: c_int = 5;

impl TcpSock {
    /// Puts the connection in its pool (`setkeepalive`); the socket is
    /// then closed. Errors as ngx_lua words them.
    fn keepalive(&mut self, idle: Duration, size: usize) -> c_int {
        if self.op.connect.is_some() {
            return E_CONNECTING;
        }
        if self.busy() {
            return E_BUSY;
        }
        let Some(mut conn) = self.conn.take() else {
            return E_CLOSED;
        };
        if !self.buf.is_empty() {
            // Unread data: the connection's state is unknown, close it.
            self.close_conn();
            return self.fail("unread data in buffer");
        }
        if !conn.still_open() {
            self.close_conn();
            return self.fail("invalid connection");
        }
        let spool = match self.spool.take() {
            Some(s) => Some(s),
            None => self
                .key
                .as_ref()
                .and_then(|k| pool::find_or_create(k, size, None)),
        };
        match spool {
            Some(s) => s.put(conn, self.slot.take(), self.reused, idle),
            // Too many pools on this thread: the connection just closes.
            None => self.close_conn(),
        }
        1
    }

    /// `close()`: 1, or [`E_CLOSED`] when there was no connection (a
    /// connect under way is not cut short: [`E_CONNECTING`]).
    fn close(&mut self) -> c_int {
        if self.op.connect.is_some() {
            return E_CONNECTING;
        }
        let open = self.conn.is_some();
        self.close_conn();
        if open {
            1
        } else {
            E_CLOSED
        }
    }

    /// `setoption(opt, val)`: 1, or an error.
    fn setoption(&mut self, opt: c_int, val: f64) -> c_int {
        let Some(c) = self.conn.as_ref() else {
            return E_CLOSED;
        };
        if !(0.0..=f64::from(i32::MAX)).contains(&val) {
            return self.fail("bad option value");
        }
        let s = c.sock_ref();
        let on = val != 0.0;
        let r = match opt {
            OPT_KEEPALIVE => s.set_keepalive(on),
            OPT_REUSEADDR => s.set_reuse_address(on),
            OPT_NODELAY => s.set_tcp_nodelay(on),
            OPT_SNDBUF => s.set_send_buffer_size(val as usize),
            OPT_RCVBUF => s.set_recv_buffer_size(val as usize),
            _ => return self.fail("unsupported option"),
        };
        match r {
            Ok(()) => 1,
            Err(e) => self.fail(io_err(&e)),
        }
    }

    /// `getoption(opt)`: the value (0 or 1 for flags), or an error.
    fn getoption(&mut self, opt: c_int) -> c_int {
        let Some(c) = self.conn.as_ref() else {
            return E_CLOSED;
        };
        let s = c.sock_ref();
        let r = match opt {
            OPT_KEEPALIVE => s.keepalive().map(usize::from),
            OPT_REUSEADDR => s.reuse_address().map(usize::from),
            OPT_NODELAY => s.tcp_nodelay().map(usize::from),
            OPT_SNDBUF => s.send_buffer_size(),
            OPT_RCVBUF => s.recv_buffer_size(),
            _ => return self.fail("unsupported option"),
        };
        match r {
            Ok(v) => c_int::try_from(v).unwrap_or(c_int::MAX),
            Err(e) => self.fail(io_err(&e)),
        }
    }
}
