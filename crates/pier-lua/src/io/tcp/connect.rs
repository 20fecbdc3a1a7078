//! `connect`: an idle connection of the socket's pool, else a new one (to
//! an address, a name looked up, or a unix socket) within the pool's
//! bounds, as ngx_lua's pools (`pool`, `pool_size`, `backlog`) have them.
//! One polled operation whatever the peer: the steps that wait (a pool
//! with none idle, a backlog queue, a name lookup, a connection opening)
//! keep their state in [`Connecting`] across [`AGAIN`]s.

use std::borrow::Cow;
use std::cell::RefCell;
use std::future::Future;
use std::io;
use std::net::{IpAddr, SocketAddr};
use std::os::raw::c_int;
use std::pin::Pin;
use std::rc::Rc;
use std::task::{Context, Poll};
use std::time::Duration;
use std::vec;

use tokio::net::{TcpStream, UnixStream};

use super::pool::{self, Acquired, Spool};
use super::{io_err, Conn, TcpSock, AGAIN, E_BUSY, E_CLOSED, E_RAISE, E_TIMEOUT};

thread_local! {
    /// The pool key being built (no allocation once pools exist).
    static KEY: RefCell<Vec<u8>> = const { RefCell::new(Vec::new()) };
}

/// Where a connect goes.
pub(super) enum Peer {
    Ip(IpAddr, u16),
    /// A name to look up (each address it has is tried in turn:
    /// `localhost` may list ::1 first).
    Name(Box<str>, u16),
    Unix(Box<str>),
}

impl Peer {
    /// `unix:path`, an address literal (`[v6]` too) or a name, with `port`.
    fn parse(host: &[u8], port: c_int) -> Result<Peer, &'static str> {
        let Ok(h) = std::str::from_utf8(host) else {
            return Err("failed to parse host name");
        };
        if host.len() >= 5 && host[..5].eq_ignore_ascii_case(b"unix:") {
            return Ok(Peer::Unix(h[5..].into()));
        }
        let Ok(port) = u16::try_from(port) else {
            return Err("missing the port number");
        };
        Ok(match literal(h).parse::<IpAddr>() {
            Ok(ip) => Peer::Ip(ip, port),
            Err(_) => Peer::Name(h.into(), port),
        })
    }
}

/// A name looked up.
type Lookup = Pin<Box<dyn Future<Output = io::Result<Vec<SocketAddr>>>>>;

/// A connect under way, kept across [`AGAIN`]s.
pub(super) enum Connecting {
    /// A pool with none idle and some in use: see [`TcpSock::defer`].
    Deferred(Peer, Rc<Spool>),
    /// In the pool's backlog queue (as many open as it keeps).
    Queued(Peer, pool::Queued),
    /// Looking up a name (the name, for the error).
    Resolving(Box<str>, Lookup),
    /// A new connection opening (registered, waiting to become writable),
    /// its peer's address, and the addresses left to try after it.
    Opening(Conn, Option<IpAddr>, vec::IntoIter<SocketAddr>),
}

impl TcpSock {
    /// `connect(host, port|-1, pool|"", pool_size|0, backlog|-1)`, started
    /// or polled again (`retry`; arguments already checked by the Lua
    /// side): 1 once connected, [`AGAIN`] while under way, else an error.
    #[allow(clippy::too_many_arguments)] // the C function's arguments, plus the context
    pub(super) fn connect(
        &mut self,
        cx: &mut Context<'_>,
        host: &[u8],
        port: c_int,
        pool_name: &[u8],
        pool_size: c_int,
        backlog: c_int,
        retry: bool,
    ) -> c_int {
        if retry {
            return self.connect_again(cx);
        }
        if self.busy() {
            return E_BUSY;
        }
        self.close_conn();
        self.spool = None;
        let spool = match self.pool_for(host, port, pool_name, pool_size, backlog) {
            Ok(s) => s,
            Err(e) => {
                self.op.err = e.into();
                return E_RAISE;
            }
        };
        // The common case first: an idle connection of the pool.
        if let Some(sp) = &spool {
            if let Some((c, slot, reused)) = sp.take_idle() {
                self.reuse(c, slot, reused, sp.clone());
                return 1;
            }
        }
        let peer = match Peer::parse(host, port) {
            Ok(p) => p,
            Err(e) => return self.fail(e),
        };
        match spool {
            None => self.open(cx, peer),
            Some(sp) if sp.in_use() > 0 && !sp.queues() => self.defer(cx, peer, sp),
            Some(sp) => self.place(cx, peer, sp),
        }
    }

    /// The pool of a connect: `pool`, else `host:port` (`unix:path` alone),
    /// found, or made when `pool_size` > 0 (with `backlog` >= 0 if given);
    /// sets the socket's pool key.
    fn pool_for(
        &mut self,
        host: &[u8],
        port: c_int,
        pool_name: &[u8],
        pool_size: c_int,
        backlog: c_int,
    ) -> Result<Option<Rc<Spool>>, String> {
        KEY.with_borrow_mut(|key| {
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
            if key.len() > pool::MAX_KEY {
                return Err(format!(
                    "bad pool name (longer than {} bytes)",
                    pool::MAX_KEY
                ));
            }
            let spool = if pool_size > 0 {
                let backlog = usize::try_from(backlog).ok();
                pool::find_or_create(key, pool_size as usize, backlog)
            } else {
                pool::find(key)
            };
            self.key = Some(match &spool {
                Some(s) => s.key().clone(),
                // First use of this key (no pool yet): its own copy.
                None => Rc::from(&key[..]),
            });
            Ok(spool)
        })
    }

    /// None idle, some in use: their hooks may have a reply read, or
    /// about to be. This connect first lets them give their connections
    /// back rather than opening another (which a full pool closes later):
    /// one pass through the run queue, or, with as many in use as the
    /// pool keeps (one opened now would be closed after its use), a wait
    /// of at most `[lua] socket_pool_wait` for one given back.
    fn defer(&mut self, cx: &mut Context<'_>, peer: Peer, sp: Rc<Spool>) -> c_int {
        self.op.armed = false;
        let wait = self.pool_wait.min(self.connect_timeout);
        if sp.in_use() >= sp.size()
            && !wait.is_zero()
            && sp.wait_release(&self.op.release_flag(), cx.waker())
        {
            let _ = self.timed_out(cx, wait);
        } else {
            cx.waker().wake_by_ref();
        }
        self.op.connect = Some(Connecting::Deferred(peer, sp));
        AGAIN
    }

    /// A place in `sp` for a new connection (or an idle one), queueing in
    /// the pool's backlog when it has one and is full.
    fn place(&mut self, cx: &mut Context<'_>, peer: Peer, sp: Rc<Spool>) -> c_int {
        if let Some(a) = sp.try_acquire() {
            return self.placed(cx, peer, sp, a);
        }
        let Some(q) = pool::Queued::enter(&sp) else {
            return self.fail("too many waiting connect operations");
        };
        self.op.armed = false;
        let _ = self.timed_out(cx, self.connect_timeout);
        q.wait(&self.op.release_flag(), cx.waker());
        self.op.connect = Some(Connecting::Queued(peer, q));
        AGAIN
    }

    fn placed(&mut self, cx: &mut Context<'_>, peer: Peer, sp: Rc<Spool>, a: Acquired) -> c_int {
        match a {
            Acquired::Reused(c, slot, reused) => {
                self.reuse(c, slot, reused, sp);
                1
            }
            Acquired::Open(slot) => {
                self.slot = Some(slot);
                self.spool = Some(sp);
                self.open(cx, peer)
            }
        }
    }

    /// The connect under way, polled again.
    fn connect_again(&mut self, cx: &mut Context<'_>) -> c_int {
        match self.op.connect.take() {
            // Closed meanwhile (another light thread's `close`).
            None => E_CLOSED,
            Some(Connecting::Deferred(peer, sp)) => {
                if let Some((c, slot, reused)) = sp.take_idle() {
                    self.op.armed = false;
                    self.op.end_wait();
                    self.reuse(c, slot, reused, sp);
                    return 1;
                }
                if self.op.armed && sp.in_use() >= sp.size() && !self.timed_out(cx, Duration::ZERO)
                {
                    let flag = self.op.release_flag();
                    if sp.wait_release(&flag, cx.waker()) {
                        self.op.connect = Some(Connecting::Deferred(peer, sp));
                        return AGAIN;
                    }
                }
                self.op.armed = false;
                self.op.end_wait();
                self.place(cx, peer, sp)
            }
            Some(Connecting::Queued(peer, q)) => {
                if let Some(a) = q.try_acquire() {
                    self.op.armed = false;
                    self.op.end_wait();
                    let sp = q.spool().clone();
                    // Leaves the queue before the connection opens.
                    drop(q);
                    return self.placed(cx, peer, sp, a);
                }
                if self.timed_out(cx, self.connect_timeout) {
                    self.op.armed = false;
                    self.op.end_wait();
                    return E_TIMEOUT;
                }
                q.wait(&self.op.release_flag(), cx.waker());
                self.op.connect = Some(Connecting::Queued(peer, q));
                AGAIN
            }
            Some(Connecting::Resolving(host, mut lookup)) => match lookup.as_mut().poll(cx) {
                Poll::Ready(Ok(addrs)) => {
                    self.open_next(cx, None, addrs.into_iter(), unresolved(&host))
                }
                Poll::Ready(Err(_)) => {
                    self.connect_failed();
                    self.fail(unresolved(&host))
                }
                Poll::Pending => {
                    if self.timed_out(cx, self.connect_timeout) {
                        self.connect_failed();
                        return E_TIMEOUT;
                    }
                    self.op.connect = Some(Connecting::Resolving(host, lookup));
                    AGAIN
                }
            },
            Some(Connecting::Opening(conn, ip, rest)) => self.poll_open(cx, conn, ip, rest),
        }
    }

    /// Opens a new connection to `peer` (its pool place, if any, taken).
    /// One deadline for the name's lookup and all its addresses.
    fn open(&mut self, cx: &mut Context<'_>, peer: Peer) -> c_int {
        self.op.armed = false;
        match peer {
            Peer::Ip(ip, port) => self.open_next(
                cx,
                Some(SocketAddr::new(ip, port)),
                Vec::new().into_iter(),
                Cow::Borrowed("closed"),
            ),
            Peer::Unix(path) => match open_unix(&path) {
                Ok((s, true)) => {
                    self.op.fresh = true;
                    self.connected(Conn::Unix(s), None)
                }
                Ok((s, false)) => self.poll_open(cx, Conn::Unix(s), None, Vec::new().into_iter()),
                Err(e) => {
                    self.connect_failed();
                    self.fail(io_err(&e))
                }
            },
            Peer::Name(host, port) => {
                let name = host.clone();
                let lookup: Lookup = Box::pin(async move {
                    Ok(tokio::net::lookup_host((&*name, port)).await?.collect())
                });
                self.op.connect = Some(Connecting::Resolving(host, lookup));
                self.connect_again(cx)
            }
        }
    }

    /// Opens a connection to `next`, else to each of `rest` in turn until
    /// one opens or is under way; all failed: the last error (`last` if
    /// there was no address).
    fn open_next(
        &mut self,
        cx: &mut Context<'_>,
        mut next: Option<SocketAddr>,
        mut rest: vec::IntoIter<SocketAddr>,
        mut last: Cow<'static, str>,
    ) -> c_int {
        while let Some(addr) = next.take().or_else(|| rest.next()) {
            match open_tcp(addr) {
                Ok((s, true)) => {
                    self.op.fresh = true;
                    return self.connected(Conn::Tcp(s), Some(addr.ip()));
                }
                Ok((s, false)) => return self.poll_open(cx, Conn::Tcp(s), Some(addr.ip()), rest),
                Err(e) => last = io_err(&e),
            }
        }
        self.connect_failed();
        self.fail(last)
    }

    /// A connection opening: 1 once it is open; a failure tries the next
    /// address.
    fn poll_open(
        &mut self,
        cx: &mut Context<'_>,
        conn: Conn,
        ip: Option<IpAddr>,
        rest: vec::IntoIter<SocketAddr>,
    ) -> c_int {
        let ready = match &conn {
            Conn::Tcp(s) => s.poll_write_ready(cx),
            Conn::Unix(s) => s.poll_write_ready(cx),
            Conn::TlsTcp(_) | Conn::TlsUnix(_) => Poll::Ready(Ok(())),
        };
        match ready {
            // Writable with an error pending is a refused or reset
            // connect (what tokio's own connect checks too).
            Poll::Ready(r) => match r.and_then(|()| conn.sock_ref().take_error()) {
                Ok(None) => self.connected(conn, ip),
                Ok(Some(e)) | Err(e) => {
                    drop(conn);
                    self.open_next(cx, None, rest, io_err(&e))
                }
            },
            Poll::Pending => {
                if self.timed_out(cx, self.connect_timeout) {
                    self.connect_failed();
                    return E_TIMEOUT;
                }
                self.op.connect = Some(Connecting::Opening(conn, ip, rest));
                AGAIN
            }
        }
    }

    /// A new connection is open: it becomes the socket's.
    fn connected(&mut self, conn: Conn, ip: Option<IpAddr>) -> c_int {
        self.op.armed = false;
        self.conn = Some(conn);
        self.peer_ip = ip;
        self.reused = 0;
        1
    }

    /// A new connection that did not open: its pool place is freed.
    fn connect_failed(&mut self) {
        self.op.armed = false;
        self.slot = None;
        self.spool = None;
        self.peer_ip = None;
    }
}

/// A non-blocking connect to `addr`, and whether it is already open.
///
/// To a local address the handshake completes inside `connect(2)` (the
/// kernel runs the peer's side in the same call), so the socket is
/// usually open when it returns "in progress": checked with
/// `getpeername`, the request goes on at once instead of waiting for
/// the poller to report it writable, which costs a trip through the
/// whole run queue (under load, hundreds of tasks) while the hook holds
/// its pool place.
fn open_tcp(addr: SocketAddr) -> io::Result<(TcpStream, bool)> {
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
    Ok((TcpStream::from_std(sock.into())?, open))
}

/// A non-blocking connect to the unix socket `path`, and whether it is
/// already open (a unix connect completes in the call, or fails).
fn open_unix(path: &str) -> io::Result<(UnixStream, bool)> {
    use socket2::{Domain, SockAddr, Socket, Type};
    let sock = Socket::new(Domain::UNIX, Type::STREAM.nonblocking(), None)?;
    let open = match sock.connect(&SockAddr::unix(path)?) {
        Ok(()) => true,
        Err(e) if e.raw_os_error() == Some(libc::EINPROGRESS) => false,
        Err(e) => return Err(e),
    };
    let std: std::os::unix::net::UnixStream = sock.into();
    Ok((UnixStream::from_std(std)?, open))
}

/// `host` (an address, `[v6]`, or a name looked up) with `port`: UDP's
/// `setpeername`.
pub(in crate::io) async fn resolve(
    host: &str,
    port: u16,
    deadline: tokio::time::Instant,
) -> Result<SocketAddr, Cow<'static, str>> {
    let h = literal(host);
    if let Ok(ip) = h.parse::<IpAddr>() {
        return Ok(SocketAddr::new(ip, port));
    }
    let found = match tokio::time::timeout_at(deadline, tokio::net::lookup_host((h, port))).await {
        Err(_) => return Err("timeout".into()),
        Ok(Ok(mut addrs)) => addrs.next(),
        Ok(Err(_)) => None,
    };
    found.ok_or_else(|| unresolved(host))
}

fn unresolved(host: &str) -> Cow<'static, str> {
    Cow::Owned(format!("{host} could not be resolved (3: Host not found)"))
}

/// An address literal without IPv6's brackets.
fn literal(host: &str) -> &str {
    host.strip_prefix('[')
        .and_then(|h| h.strip_suffix(']'))
        .unwrap_or(host)
}
