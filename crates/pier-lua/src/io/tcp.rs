//! Cosockets over tokio, as ngx_lua's `ngx.socket.tcp()` has them: calls
//! yield the hook's coroutine, never the thread; results follow ngx_lua
//! (`nil, err[, partial]` on failure, its error strings). TCP (host names
//! resolved), unix sockets, TLS (`sslhandshake`, rustls) and keep-alive
//! pools with ngx_lua's `pool` / `pool_size` / `backlog` (see `pool.rs`).
//! `lua/pier/socket.lua` wraps the natives in objects and checks the
//! arguments.

use std::borrow::Cow;
use std::cell::RefCell;
use std::collections::HashMap;
use std::io;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::pin::Pin;
use std::rc::Rc;
use std::sync::{Arc, OnceLock};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::BytesMut;
use mlua::{IntoLuaMulti, Lua, LuaString, MultiValue, Value};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpStream, UnixStream};
use tokio_rustls::client::TlsStream;

mod fast;

pub(crate) use fast::sock_api_addr;

use super::pool::{self, Acquired, Counted, Spool};
use super::udp::UdpSock;
use crate::current;
use crate::limits::LuaLimits;

/// ngx_lua's `lua_socket_{connect,send,read}_timeout` and
/// `lua_socket_keepalive_timeout` defaults.
const DEFAULT_TIMEOUT: Duration = Duration::from_secs(60);
/// `lua_socket_pool_size`'s default.
const DEFAULT_POOL_SIZE: usize = 30;
/// `fill`'s error when the receive buffer is full: raised as a Lua error.
const TOO_LARGE: &str = "receive buffer full";
/// Deepest nesting of tables `send` flattens (a table may contain itself).
const MAX_SEND_DEPTH: usize = 100;
/// A `send` buffer above this is released after the send.
const KEEP_WBUF: usize = 64 << 10;

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
    /// `send`'s buffer for tables (reused).
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
    /// `[lua] socket_pool_wait` (see `fast::TcpSock::connect_new`).
    pub(super) pool_wait: std::time::Duration,
    /// The fast path's operation in progress (`fast.rs`).
    op: fast::OpState,
}

type Ret = mlua::Result<MultiValue>;

fn fail(lua: &Lua, err: &str) -> Ret {
    (Value::Nil, lua.create_string(err)?).into_lua_multi(lua)
}

fn ok1(lua: &Lua) -> Ret {
    1.into_lua_multi(lua)
}

impl TcpSock {
    pub fn new(max_buf: usize, pool_wait: std::time::Duration) -> Self {
        TcpSock {
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
            op: fast::OpState::default(),
        }
    }

    /// Closes the connection (and frees its pool place).
    fn close_conn(&mut self) {
        self.conn = None;
        self.slot = None;
        self.buf.clear();
        // A connect under way (`fast::connect_new`) ends too.
        self.op.connecting = None;
        self.op.end_deferred();
        self.op.fresh = false;
    }

    /// Takes an idle connection of `spool` (every connect path's reuse).
    fn reuse(&mut self, conn: Conn, slot: Counted, reused: u32, spool: Rc<Spool>) {
        self.conn = Some(conn);
        self.slot = Some(slot);
        self.reused = reused + 1;
        self.spool = Some(spool);
    }
}

/// A scalar `send` value's bytes.
pub(super) enum Scalar<'a> {
    Static(&'static [u8]),
    Num(&'a [u8]),
    Lua(LuaString),
}

/// nil, booleans, numbers and `ngx.null` as ngx_lua's `send` writes them;
/// `None` for other types.
pub(super) fn scalar<'a>(
    lua: &Lua,
    v: &Value,
    num: &'a mut itoa::Buffer,
) -> mlua::Result<Option<Scalar<'a>>> {
    Ok(Some(match v {
        Value::Nil => Scalar::Static(b"nil"),
        Value::Boolean(true) => Scalar::Static(b"true"),
        Value::Boolean(false) => Scalar::Static(b"false"),
        Value::LightUserData(p) if p.0.is_null() => Scalar::Static(b"null"),
        Value::Integer(n) => Scalar::Num(num.format(*n).as_bytes()),
        // Whole numbers without allocating; others as Lua prints them (%.14g).
        Value::Number(f) if f.fract() == 0.0 && f.abs() < 1e15 && *f != 0.0 => {
            Scalar::Num(num.format(*f as i64).as_bytes())
        }
        Value::Number(_) => match lua.coerce_string(v.clone())? {
            Some(s) => Scalar::Lua(s),
            None => return Ok(None),
        },
        _ => return Ok(None),
    }))
}

/// Appends `v` (a string, scalar or array of them, nested) to `out`,
/// at most `max` bytes.
pub(super) fn flatten(
    lua: &Lua,
    v: &Value,
    out: &mut Vec<u8>,
    depth: usize,
    max: usize,
) -> mlua::Result<()> {
    let too_big =
        || mlua::Error::runtime("bad argument #1 to 'send' (data over lua.socket_buffer bytes)");
    match v {
        Value::String(s) => {
            let b = s.as_bytes();
            if out.len() + b.len() > max {
                return Err(too_big());
            }
            out.extend_from_slice(&b);
        }
        Value::Table(t) => {
            if depth >= MAX_SEND_DEPTH {
                return Err(mlua::Error::runtime(
                    "bad argument #1 to 'send' (tables nested too deeply)",
                ));
            }
            let n = t.raw_len();
            for i in 1..=n {
                let item: Value = t.raw_get(i)?;
                if matches!(item, Value::Nil) {
                    return Err(mlua::Error::runtime(
                        "bad argument #1 to 'send' (non-array table found)",
                    ));
                }
                flatten(lua, &item, out, depth + 1, max)?;
            }
        }
        _ => {
            let mut num = itoa::Buffer::new();
            match scalar(lua, v, &mut num)? {
                Some(Scalar::Static(b)) | Some(Scalar::Num(b)) => out.extend_from_slice(b),
                Some(Scalar::Lua(s)) => out.extend_from_slice(&s.as_bytes()),
                None => {
                    return Err(mlua::Error::runtime(format!(
                        "bad argument #1 to 'send' (bad data type {} found)",
                        v.type_name()
                    )))
                }
            }
            if out.len() > max {
                return Err(too_big());
            }
        }
    }
    Ok(())
}

// === connecting ===

thread_local! {
    /// The pool key being built (no allocation once pools exist).
    static KEY: RefCell<Vec<u8>> = const { RefCell::new(Vec::new()) };
}

/// Where to connect.
enum Target<'a> {
    Unix(&'a str),
    Inet(&'a str, u16),
}

/// `host` (an address, `[v6]`, or a name looked up) with `port`.
pub(super) async fn resolve(
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

async fn open(
    target: Target<'_>,
    timeout: Duration,
) -> Result<(Conn, Option<IpAddr>), Cow<'static, str>> {
    match target {
        Target::Unix(path) => {
            match tokio::time::timeout(timeout, UnixStream::connect(path)).await {
                Err(_) => Err("timeout".into()),
                Ok(Err(e)) => Err(io_err(&e)),
                Ok(Ok(s)) => Ok((Conn::Unix(s), None)),
            }
        }
        Target::Inet(host, port) => {
            let deadline = tokio::time::Instant::now() + timeout;
            if literal(host).parse::<IpAddr>().is_ok() {
                let addr = resolve(host, port, deadline).await?;
                return connect_addr(addr, deadline).await;
            }
            // A name: each address in turn (`localhost` may list ::1 first).
            let addrs = match tokio::time::timeout_at(
                deadline,
                tokio::net::lookup_host((host, port)),
            )
            .await
            {
                Err(_) => return Err("timeout".into()),
                Ok(Ok(a)) => a,
                Ok(Err(_)) => return Err(unresolved(host)),
            };
            let mut last = unresolved(host);
            for addr in addrs {
                match connect_addr(addr, deadline).await {
                    Ok(c) => return Ok(c),
                    Err(e) if e == "timeout" => return Err(e),
                    Err(e) => last = e,
                }
            }
            Err(last)
        }
    }
}

async fn connect_addr(
    addr: SocketAddr,
    deadline: tokio::time::Instant,
) -> Result<(Conn, Option<IpAddr>), Cow<'static, str>> {
    match tokio::time::timeout_at(deadline, TcpStream::connect(addr)).await {
        Err(_) => Err("timeout".into()),
        Ok(Err(e)) => Err(io_err(&e)),
        Ok(Ok(s)) => {
            let _ = s.set_nodelay(true);
            Ok((Conn::Tcp(s), Some(addr.ip())))
        }
    }
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

impl TcpSock {
    /// The pool of a connect: `pool`, else `host:port` (`unix:path` alone),
    /// found, or made when `pool_size` > 0 (with `backlog` >= 0 if given);
    /// sets the socket's pool key. Shared by both connect paths.
    fn pool_for(
        &mut self,
        host: &[u8],
        port: i64,
        pool_name: Option<&[u8]>,
        pool_size: i64,
        backlog: i64,
    ) -> Result<Option<Rc<Spool>>, String> {
        KEY.with_borrow_mut(|key| {
            key.clear();
            match pool_name {
                Some(p) => key.extend_from_slice(p),
                None => {
                    key.extend_from_slice(host);
                    if port >= 0 {
                        key.push(b':');
                        key.extend_from_slice(itoa::Buffer::new().format(port).as_bytes());
                    }
                }
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

    /// `connect(host, port|-1, pool, pool_size|0, backlog|-1)`; arguments
    /// already checked by the Lua side.
    async fn connect(
        &mut self,
        lua: &Lua,
        host: LuaString,
        port: i64,
        pool_name: Option<LuaString>,
        pool_size: i64,
        backlog: i64,
    ) -> Ret {
        self.close_conn();
        self.spool = None;
        let host_b = host.as_bytes();
        let Ok(host_s) = std::str::from_utf8(&host_b) else {
            return fail(lua, "failed to parse host name");
        };
        let unix = host_s.len() >= 5 && host_s[..5].eq_ignore_ascii_case("unix:");
        let pool_name = pool_name.as_ref().map(|p| p.as_bytes());
        let spool = self
            .pool_for(&host_b, port, pool_name.as_deref(), pool_size, backlog)
            .map_err(mlua::Error::runtime)?;
        if let Some(sp) = &spool {
            match sp.acquire(self.connect_timeout).await {
                Acquired::Reused(c, slot, reused) => {
                    self.reuse(c, slot, reused, sp.clone());
                    return ok1(lua);
                }
                Acquired::Open(slot) => self.slot = Some(slot),
                Acquired::Full => return fail(lua, "too many waiting connect operations"),
                Acquired::Timeout => return fail(lua, "timeout"),
            }
        }
        let target = if unix {
            Target::Unix(&host_s[5..])
        } else {
            Target::Inet(host_s, port as u16)
        };
        match open(target, self.connect_timeout).await {
            Ok((c, ip)) => {
                self.conn = Some(c);
                self.peer_ip = ip;
                self.reused = 0;
                self.spool = spool;
                ok1(lua)
            }
            Err(e) => {
                // Frees the pool place taken for it.
                self.slot = None;
                fail(lua, &e)
            }
        }
    }

    /// Puts the connection in its pool (`setkeepalive`); the socket is
    /// then closed. Errors as ngx_lua words them.
    fn keepalive(&mut self, idle: Duration, size: usize) -> Result<(), Cow<'static, str>> {
        let Some(mut conn) = self.conn.take() else {
            return Err("closed".into());
        };
        if !self.buf.is_empty() {
            // Unread data: the connection's state is unknown, close it.
            self.close_conn();
            return Err("unread data in buffer".into());
        }
        if !conn.still_open() {
            self.close_conn();
            return Err("invalid connection".into());
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
        Ok(())
    }

    async fn sslhandshake(&mut self, lua: &Lua, name: Option<LuaString>, verify: bool) -> Ret {
        let Some(conn) = self.conn.take() else {
            return fail(lua, "closed");
        };
        if conn.is_tls() {
            // A pooled connection, already TLS (ngx_lua returns at once).
            self.conn = Some(conn);
            return ok1(lua);
        }
        let name_b = name.as_ref().map(|n| n.as_bytes());
        let server_name = match name_b.as_deref().filter(|n| !n.is_empty()) {
            Some(n) => match std::str::from_utf8(n)
                .ok()
                .and_then(|n| rustls::pki_types::ServerName::try_from(n.to_owned()).ok())
            {
                Some(n) => n,
                None => {
                    self.close_conn();
                    return fail(lua, "bad server name");
                }
            },
            // No SNI (rustls sends none for an address), no name check.
            None => rustls::pki_types::ServerName::IpAddress(
                self.peer_ip
                    .unwrap_or(IpAddr::V4(Ipv4Addr::UNSPECIFIED))
                    .into(),
            ),
        };
        let cfg = match tls_config(verify, name_b.as_deref().is_some_and(|n| !n.is_empty())) {
            Ok(c) => c,
            Err(e) => {
                self.close_conn();
                return fail(lua, e);
            }
        };
        let connector = tokio_rustls::TlsConnector::from(cfg);
        let t = self.connect_timeout;
        let r = match conn {
            Conn::Tcp(s) => tokio::time::timeout(t, connector.connect(server_name, s))
                .await
                .map(|r| r.map(|s| Conn::TlsTcp(Box::new(s)))),
            Conn::Unix(s) => tokio::time::timeout(t, connector.connect(server_name, s))
                .await
                .map(|r| r.map(|s| Conn::TlsUnix(Box::new(s)))),
            // Already TLS (checked above; kept as it is).
            c @ (Conn::TlsTcp(_) | Conn::TlsUnix(_)) => {
                self.conn = Some(c);
                return ok1(lua);
            }
        };
        match r {
            Ok(Ok(c)) => {
                self.conn = Some(c);
                ok1(lua)
            }
            Ok(Err(e)) => {
                self.close_conn();
                fail(lua, tls_err(&e))
            }
            Err(_) => {
                self.close_conn();
                fail(lua, "timeout")
            }
        }
    }

    fn setoption(&mut self, lua: &Lua, opt: u8, val: f64) -> Ret {
        let Some(c) = self.conn.as_ref() else {
            return fail(lua, "closed");
        };
        if !(0.0..=f64::from(i32::MAX)).contains(&val) {
            return fail(lua, "bad option value");
        }
        let s = c.sock_ref();
        let on = val != 0.0;
        let r = match opt {
            1 => s.set_keepalive(on),
            2 => s.set_reuse_address(on),
            3 => s.set_tcp_nodelay(on),
            4 => s.set_send_buffer_size(val as usize),
            5 => s.set_recv_buffer_size(val as usize),
            _ => return fail(lua, "unsupported option"),
        };
        match r {
            Ok(()) => true.into_lua_multi(lua),
            Err(e) => fail(lua, &io_err(&e)),
        }
    }

    fn getoption(&mut self, lua: &Lua, opt: u8) -> Ret {
        let Some(c) = self.conn.as_ref() else {
            return fail(lua, "closed");
        };
        let s = c.sock_ref();
        let r = match opt {
            1 => s.keepalive().map(i64::from),
            2 => s.reuse_address().map(i64::from),
            3 => s.tcp_nodelay().map(i64::from),
            4 => s.send_buffer_size().map(|n| n as i64),
            5 => s.recv_buffer_size().map(|n| n as i64),
            _ => return fail(lua, "unsupported option"),
        };
        match r {
            Ok(v) => v.into_lua_multi(lua),
            Err(e) => fail(lua, &io_err(&e)),
        }
    }
}

// === TLS ===

/// The three client configs (`ssl_verify` with a server name, without
/// one, no verification), built once per process. Sessions are cached by
/// rustls (in memory, per server name): `reused_session` is not needed.
fn tls_config(verify: bool, named: bool) -> Result<Arc<rustls::ClientConfig>, &'static str> {
    static CFG: OnceLock<[Option<Arc<rustls::ClientConfig>>; 3]> = OnceLock::new();
    let cfgs = CFG.get_or_init(build_tls_configs);
    let i = match (verify, named) {
        (true, true) => 0,
        (true, false) => 1,
        (false, _) => 2,
    };
    cfgs[i]
        .clone()
        .ok_or("20: unable to get local issuer certificate")
}

fn build_tls_configs() -> [Option<Arc<rustls::ClientConfig>>; 3] {
    let provider = Arc::new(rustls::crypto::aws_lc_rs::default_provider());
    let builder = || {
        rustls::ClientConfig::builder_with_provider(provider.clone())
            .with_safe_default_protocol_versions()
            .ok()
    };
    // The system trust store (`SSL_CERT_FILE` / `SSL_CERT_DIR` override it).
    let mut roots = rustls::RootCertStore::empty();
    let (added, _) =
        roots.add_parsable_certificates(rustls_native_certs::load_native_certs().certs);
    let roots = Arc::new(roots);
    let webpki = (added > 0)
        .then(|| {
            rustls::client::WebPkiServerVerifier::builder_with_provider(
                roots.clone(),
                provider.clone(),
            )
            .build()
            .ok()
        })
        .flatten();
    let named = webpki.as_ref().and_then(|_| {
        Some(Arc::new(
            builder()?
                .with_root_certificates(roots.clone())
                .with_no_client_auth(),
        ))
    });
    let chain_only = webpki.and_then(|v| {
        Some(Arc::new(
            builder()?
                .dangerous()
                .with_custom_certificate_verifier(Arc::new(ChainOnly(v)))
                .with_no_client_auth(),
        ))
    });
    let none = builder().map(|b| {
        Arc::new(
            b.dangerous()
                .with_custom_certificate_verifier(Arc::new(pier_tls::NoVerify(provider.clone())))
                .with_no_client_auth(),
        )
    });
    [named, chain_only, none]
}

use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use rustls::{CertificateError, DigitallySignedStruct, SignatureScheme};

/// `ssl_verify` without a server name: the chain is verified, not the
/// name (ngx_lua checks the name only when one is given).
#[derive(Debug)]
struct ChainOnly(Arc<rustls::client::WebPkiServerVerifier>);

impl ServerCertVerifier for ChainOnly {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &ServerName<'_>,
        ocsp: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        match self
            .0
            .verify_server_cert(end_entity, intermediates, server_name, ocsp, now)
        {
            Err(rustls::Error::InvalidCertificate(
                CertificateError::NotValidForName | CertificateError::NotValidForNameContext { .. },
            )) => Ok(ServerCertVerified::assertion()),
            r => r,
        }
    }
    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.0.verify_tls12_signature(message, cert, dss)
    }
    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.0.verify_tls13_signature(message, cert, dss)
    }
    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.0.supported_verify_schemes()
    }
}

/// A failed handshake as ngx_lua reports it (OpenSSL's verify codes).
fn tls_err(e: &io::Error) -> &'static str {
    let Some(re) = e.get_ref().and_then(|i| i.downcast_ref::<rustls::Error>()) else {
        return "handshake failed";
    };
    match re {
        rustls::Error::InvalidCertificate(c) => match c {
            CertificateError::UnknownIssuer => "20: unable to get local issuer certificate",
            CertificateError::Expired | CertificateError::ExpiredContext { .. } => {
                "10: certificate has expired"
            }
            CertificateError::NotValidYet | CertificateError::NotValidYetContext { .. } => {
                "9: certificate is not yet valid"
            }
            CertificateError::NotValidForName | CertificateError::NotValidForNameContext { .. } => {
                "certificate host mismatch"
            }
            CertificateError::Revoked => "23: certificate revoked",
            CertificateError::BadSignature => "7: certificate signature failure",
            _ => "certificate verify failed",
        },
        _ => "handshake failed",
    }
}

// === the socket table ===
//
// Sockets (TCP and UDP) live in a per-thread slab and Lua holds only a
// handle: the slot index plus the slot's generation, bumped whenever the
// slot is freed, so a handle to a freed socket never reaches the socket
// that reuses its slot (`bad socket`). Each socket records its owner (the
// request or timer run that created it, see `Current::owner`): another one
// using it gets `bad request`, as OpenResty answers. A request's sockets
// are freed when it ends (`RequestCtx` drop), a timer run's when it
// returns, and (past a request's first `UNANCHORED_PER_REQUEST`) earlier
// when Lua collects the object (an `ffi.gc` anchor). Lua never holds a
// pointer to a socket, only this checked handle.

/// Bits of the slot index in a handle: a handle is `gen << INDEX_BITS | index`,
/// below 2^53 so that Lua's doubles hold it exactly.
const INDEX_BITS: u32 = 24;
const GEN_MASK: u32 = (1 << 28) - 1;
/// No more slots than the index bits can name.
const MAX_SLOTS: usize = (1 << INDEX_BITS) - 1;

thread_local! {
    static SOCKS: RefCell<Slab> = RefCell::new(Slab::default());
}

#[derive(Clone)]
pub(super) enum Sock {
    Tcp(Rc<RefCell<TcpSock>>),
    Udp(Rc<RefCell<UdpSock>>),
}

struct Slot {
    gen: u32,
    owner: u64,
    sock: Option<Sock>,
    /// The owner's other live sockets: a doubly linked list through the
    /// slots ([`NIL`] ends it), so a request's end frees its sockets
    /// without scanning the slab.
    prev: u32,
    next: u32,
}

/// No slot (list ends).
const NIL: u32 = u32::MAX;

/// An owner's live sockets: how many, and the first of its list.
#[derive(Clone, Copy)]
struct Owned {
    count: usize,
    head: u32,
}

/// Owner ids are a per-thread counter: one multiplication spreads them
/// (SipHash was a visible part of each request's socket bookkeeping).
#[derive(Default)]
struct OwnerHasher(u64);

impl std::hash::Hasher for OwnerHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0.rotate_left(8) ^ u64::from(b)).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        }
    }
    fn write_u64(&mut self, n: u64) {
        self.0 = (self.0 ^ n).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    }
}

#[derive(Default)]
struct Slab {
    slots: Vec<Slot>,
    free: Vec<usize>,
    /// Live sockets, and live sockets per owner.
    live: usize,
    per_owner: HashMap<u64, Owned, std::hash::BuildHasherDefault<OwnerHasher>>,
}

fn split(handle: u64) -> (usize, u32) {
    (
        (handle & ((1 << INDEX_BITS) - 1)) as usize,
        (handle >> INDEX_BITS) as u32,
    )
}

/// Why a socket could not be created.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Full {
    Request,
    Worker,
}

impl Slab {
    fn alloc(
        &mut self,
        owner: u64,
        limits: &LuaLimits,
        make: &dyn Fn(&LuaLimits) -> Sock,
    ) -> Result<(u64, usize), Full> {
        if self.live >= limits.max_sockets_per_worker.min(MAX_SLOTS) {
            return Err(Full::Worker);
        }
        let mine = self.per_owner.get(&owner).map_or(0, |o| o.count);
        if mine >= limits.max_sockets_per_request {
            return Err(Full::Request);
        }
        let sock = Some(make(limits));
        let i = match self.free.pop() {
            Some(i) => i,
            None => {
                self.slots.push(Slot {
                    gen: 0,
                    owner: 0,
                    sock: None,
                    prev: NIL,
                    next: NIL,
                });
                self.slots.len() - 1
            }
        };
        // Below MAX_SLOTS < 2^24: fits the list links.
        let link = i as u32;
        let owned = self.per_owner.entry(owner).or_insert(Owned {
            count: 0,
            head: NIL,
        });
        let old_head = owned.head;
        owned.count += 1;
        owned.head = link;
        if old_head != NIL {
            self.slots[old_head as usize].prev = link;
        }
        let slot = &mut self.slots[i];
        slot.owner = owner;
        slot.sock = sock;
        slot.prev = NIL;
        slot.next = old_head;
        self.live += 1;
        Ok((u64::from(slot.gen) << INDEX_BITS | i as u64, mine))
    }

    /// Frees slot `i` if it holds a socket; its generation moves on. The
    /// socket is returned, to be dropped after the slab's borrow ends.
    fn release(&mut self, i: usize) -> Option<Sock> {
        let slot = self.slots.get_mut(i)?;
        let sock = slot.sock.take()?;
        slot.gen = (slot.gen + 1) & GEN_MASK;
        let owner = std::mem::take(&mut slot.owner);
        let (prev, next) = (slot.prev, slot.next);
        slot.prev = NIL;
        slot.next = NIL;
        if next != NIL {
            self.slots[next as usize].prev = prev;
        }
        if prev != NIL {
            self.slots[prev as usize].next = next;
        }
        self.live -= 1;
        if let Some(o) = self.per_owner.get_mut(&owner) {
            o.count -= 1;
            if o.count == 0 {
                self.per_owner.remove(&owner);
            } else if prev == NIL {
                o.head = next;
            }
        }
        self.free.push(i);
        Some(sock)
    }

    /// Frees the first socket of `owner`'s list, if it has one.
    fn release_first(&mut self, owner: u64) -> Option<Sock> {
        if self.live == 0 {
            // Every request end comes here: no hashing when no socket is alive.
            return None;
        }
        let head = self.per_owner.get(&owner)?.head;
        self.release(head as usize)
    }
}

/// Frees the socket `handle` names, unless its slot has moved on.
fn free_sock(handle: u64) {
    let (i, gen) = split(handle);
    // `try_with`: finalizers may run while the thread is being torn down.
    // `try_borrow_mut`: never panic in a finalizer (nothing borrows the
    // slab while Lua runs, so this does not skip in practice).
    let freed = SOCKS.try_with(|s| {
        let Ok(mut s) = s.try_borrow_mut() else {
            return None;
        };
        if s.slots.get(i).is_some_and(|slot| slot.gen == gen) {
            s.release(i)
        } else {
            None
        }
    });
    // After the slab's borrow: closing a connection may wake a queued connect.
    if let Ok(Some(sock)) = freed {
        fast::recycle(sock);
    }
}

/// Frees every socket of `owner` (a request ended, a timer run returned).
pub(crate) fn free_owner(owner: u64) {
    // One at a time, each dropped after the slab's borrow ends (closing a
    // connection may wake a queued connect); nothing is collected in a Vec.
    loop {
        // Never panic in a `Drop` (see `free_sock`).
        let freed = SOCKS.try_with(|s| {
            let Ok(mut s) = s.try_borrow_mut() else {
                return None;
            };
            s.release_first(owner)
        });
        match freed {
            Ok(Some(sock)) => fast::recycle(sock),
            _ => break,
        }
    }
}

/// The socket `handle`, if it is still that socket and belongs to the
/// request (or timer run) now running.
pub(super) fn lookup(handle: u64) -> mlua::Result<Sock> {
    lookup_raw(handle).map_err(|bad| match bad {
        Bad::Request => mlua::Error::runtime("bad request"),
        Bad::Socket => bad_socket(),
    })
}

/// Why a handle does not name a usable socket.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Bad {
    /// Another request's (or timer run's) socket.
    Request,
    /// Freed: collected, closed with its request, or never a socket.
    Socket,
}

/// [`lookup`] without building an error (the FFI fast path).
pub(super) fn lookup_raw(handle: u64) -> Result<Sock, Bad> {
    let (i, gen) = split(handle);
    let owner = current::get().owner;
    SOCKS.with_borrow(|s| match s.slots.get(i) {
        Some(Slot {
            gen: g,
            owner: o,
            sock: Some(sock),
            ..
        }) if *g == gen => {
            if *o != owner || owner == 0 {
                Err(Bad::Request)
            } else {
                Ok(sock.clone())
            }
        }
        _ => Err(Bad::Socket),
    })
}

fn bad_socket() -> mlua::Error {
    mlua::Error::runtime("bad socket (closed: collected, or its request ended)")
}

fn sock(handle: u64) -> mlua::Result<Rc<RefCell<TcpSock>>> {
    match lookup(handle)? {
        Sock::Tcp(s) => Ok(s),
        Sock::Udp(_) => Err(bad_socket()),
    }
}

/// A new socket for the current request or timer run.
pub(super) fn new_sock(lua: &Lua, make: &dyn Fn(&LuaLimits) -> Sock) -> mlua::Result<u64> {
    let cur = current::get();
    let Some(engine) = cur.engine else {
        return Err(mlua::Error::runtime("no request"));
    };
    // SAFETY: the engine outlives every hook call it runs (see `Current`).
    let limits = unsafe { engine.as_ref() }.limits;
    if cur.owner == 0 {
        return Err(mlua::Error::runtime("no request"));
    }
    let mut r = SOCKS.with_borrow_mut(|s| s.alloc(cur.owner, &limits, make));
    if r.is_err() {
        // Sockets Lua no longer references may just not be collected yet:
        // collect (their anchors free them) and try once more.
        lua.gc_collect()?;
        r = SOCKS.with_borrow_mut(|s| s.alloc(cur.owner, &limits, make));
    }
    r.map(|(h, _)| h).map_err(|full| {
        mlua::Error::runtime(match full {
            Full::Request => "too many sockets in this request (lua.max_sockets_per_request)",
            Full::Worker => "too many sockets in this worker (lua.max_sockets_per_worker)",
        })
    })
}

/// Why [`try_new_tcp`] made no socket.
pub(super) enum NoSock {
    NoRequest,
    Full(Full),
}

/// A request's first sockets that need no `ffi.gc` anchor: the request's
/// end frees them. Registering a finalizer and running it when the object
/// is collected cost about 2k instructions per `ngx.socket.tcp()` (the
/// finalizer table's insert, the collector's resurrection and its protected
/// call; callgrind, BENCHMARKS.md stop 27), for a socket that the request's
/// end frees anyway. Past these, a hook creating sockets in a loop gets
/// anchored ones that the collector frees, so a request holds at most this
/// many abandoned sockets beyond what Lua still references. Timer runs (which
/// may loop for the worker's life) always anchor.
pub(super) const UNANCHORED_PER_REQUEST: usize = 4;

/// A new TCP socket for the current request or timer run, without the
/// collection [`new_sock`] tries when full (the FFI caller collects and
/// asks again); and whether its Lua object needs an anchor
/// ([`UNANCHORED_PER_REQUEST`]).
pub(super) fn try_new_tcp() -> Result<(u64, bool), NoSock> {
    let cur = current::get();
    let Some(engine) = cur.engine else {
        return Err(NoSock::NoRequest);
    };
    if cur.owner == 0 {
        return Err(NoSock::NoRequest);
    }
    // SAFETY: the engine outlives every hook call it runs (see `Current`).
    let limits = unsafe { engine.as_ref() }.limits;
    let (h, before) = SOCKS
        .with_borrow_mut(|s| {
            s.alloc(cur.owner, &limits, &|l| {
                Sock::Tcp(fast::new_tcp(l.socket_buffer, l.socket_pool_wait))
            })
        })
        .map_err(NoSock::Full)?;
    Ok((h, cur.ctx.is_none() || before >= UNANCHORED_PER_REQUEST))
}

/// Frees a socket (its Lua object was collected); shared with UDP.
pub(super) fn free_native(lua: &Lua) -> mlua::Result<mlua::Function> {
    lua.create_function(|_, id: u64| {
        free_sock(id);
        Ok(())
    })
}

macro_rules! with_sock {
    ($id:expr, $s:ident, $body:block) => {{
        let rc = sock($id)?;
        let Ok(mut guard) = rc.try_borrow_mut() else {
            return Err(mlua::Error::runtime("socket busy"));
        };
        let $s: &mut TcpSock = &mut guard;
        $body
    }};
}

/// A duration in ms from Lua; 0 means `default`.
fn ms_or(ms: f64, default: Duration, what: &str) -> mlua::Result<Duration> {
    let d = crate::limits::lua_ms(ms, what)?;
    Ok(if d.is_zero() { default } else { d })
}

/// The socket natives; `lua/pier/socket.lua` wraps them in objects.
// Holding a socket's `RefCell` across awaits is the point: a socket belongs
// to one coroutine at a time, and a second user gets "socket busy"
// (`try_borrow_mut`), never a panic.
#[allow(clippy::await_holding_refcell_ref)]
pub(crate) fn register(lua: &Lua, natives: &mlua::Table) -> mlua::Result<()> {
    natives.set("tcp_free", free_native(lua)?)?;
    // SAFETY: each is a `lua_CFunction` that reads its arguments with the
    // C API's checked accessors, pushes only its results and raises no
    // Lua error (see `fast`'s classic C functions).
    unsafe {
        natives.set("tcp_recv_c", lua.create_c_function(fast::l_recv)?)?;
        natives.set("tcp_send_c", lua.create_c_function(fast::l_send)?)?;
        natives.set(
            "tcp_settimeouts_c",
            lua.create_c_function(fast::l_settimeouts)?,
        )?;
        natives.set("tcp_free_c", lua.create_c_function(fast::l_free)?)?;
        natives.set(
            "tcp_setkeepalive_c",
            lua.create_c_function(fast::l_setkeepalive)?,
        )?;
    }
    natives.set(
        "tcp_connect",
        lua.create_async_function(
            |lua,
             (id, host, port, pool, pool_size, backlog): (
                u64,
                LuaString,
                i64,
                Option<LuaString>,
                i64,
                i64,
            )| async move {
                with_sock!(id, this, {
                    this.connect(&lua, host, port, pool, pool_size, backlog)
                        .await
                })
            },
        )?,
    )?;
    natives.set(
        "tcp_sslhandshake",
        lua.create_async_function(
            |lua, (id, name, verify): (u64, Option<LuaString>, bool)| async move {
                with_sock!(id, this, { this.sslhandshake(&lua, name, verify).await })
            },
        )?,
    )?;
    natives.set(
        "tcp_settimeouts",
        lua.create_function(|_, (id, c, s, r): (u64, f64, f64, f64)| {
            with_sock!(id, this, {
                this.connect_timeout = ms_or(c, DEFAULT_TIMEOUT, "bad timeout")?;
                this.send_timeout = ms_or(s, DEFAULT_TIMEOUT, "bad timeout")?;
                this.read_timeout = ms_or(r, DEFAULT_TIMEOUT, "bad timeout")?;
                Ok(())
            })
        })?,
    )?;
    natives.set(
        "tcp_close",
        lua.create_function(|lua, id: u64| {
            with_sock!(id, this, {
                if this.conn.is_none() {
                    this.close_conn();
                    return fail(lua, "closed");
                }
                this.close_conn();
                ok1(lua)
            })
        })?,
    )?;
    natives.set(
        "tcp_setoption",
        lua.create_function(|lua, (id, opt, val): (u64, u8, f64)| {
            with_sock!(id, this, { this.setoption(lua, opt, val) })
        })?,
    )?;
    natives.set(
        "tcp_getoption",
        lua.create_function(|lua, (id, opt): (u64, u8)| {
            with_sock!(id, this, { this.getoption(lua, opt) })
        })?,
    )?;
    Ok(())
}
