//! `ngx.socket.udp()`: connected datagram cosockets (UDP or unix), as
//! ngx_lua has them. They live in the TCP sockets' slab (same handles,
//! owners and limits, see `table.rs`); `lua/pier/ngx_socket.lua` wraps the
//! natives in objects.

use std::cell::RefCell;
use std::net::{Ipv4Addr, Ipv6Addr, SocketAddr};
use std::rc::Rc;
use std::time::Duration;

use mlua::{IntoLuaMulti, Lua, LuaString, MultiValue, Value};
use tokio::net::{UdpSocket, UnixDatagram};

use super::table::{self, Sock};
use super::tcp::{self, io_err};

/// ngx_lua's `lua_socket_read_timeout` default.
const DEFAULT_TIMEOUT: Duration = Duration::from_secs(60);
/// The largest datagram `receive` returns (ngx_lua's cap and default).
const MAX_DGRAM: usize = 8192;
/// A `send` buffer above this is released after the send.
const KEEP_WBUF: usize = 64 << 10;

enum Dgram {
    Inet(UdpSocket),
    Unix(UnixDatagram),
}

pub(crate) struct UdpSock {
    sock: Option<Dgram>,
    read_timeout: Duration,
    /// `receive`'s buffer, made at the first receive and reused.
    rbuf: Vec<u8>,
    wbuf: Vec<u8>,
    max_buf: usize,
}

type Ret = mlua::Result<MultiValue>;

fn fail(lua: &Lua, err: &str) -> Ret {
    (Value::Nil, lua.create_string(err)?).into_lua_multi(lua)
}

impl UdpSock {
    fn new(max_buf: usize) -> Self {
        UdpSock {
            sock: None,
            read_timeout: DEFAULT_TIMEOUT,
            rbuf: Vec::new(),
            wbuf: Vec::new(),
            max_buf,
        }
    }

    async fn setpeername(&mut self, lua: &Lua, host: LuaString, port: i64) -> Ret {
        self.sock = None;
        let host_b = host.as_bytes();
        let Ok(host) = std::str::from_utf8(&host_b) else {
            return fail(lua, "failed to parse host name");
        };
        if host.len() >= 5 && host[..5].eq_ignore_ascii_case("unix:") {
            let r = UnixDatagram::unbound().and_then(|s| {
                s.connect(&host[5..])?;
                Ok(s)
            });
            return match r {
                Ok(s) => {
                    self.sock = Some(Dgram::Unix(s));
                    1.into_lua_multi(lua)
                }
                Err(e) => fail(lua, &io_err(&e)),
            };
        }
        let Ok(port) = u16::try_from(port) else {
            return fail(lua, "missing the port number");
        };
        let deadline = tokio::time::Instant::now() + self.read_timeout;
        let addr = match tcp::resolve(host, port, deadline).await {
            Ok(a) => a,
            Err(e) => return fail(lua, &e),
        };
        let local: SocketAddr = if addr.is_ipv4() {
            (Ipv4Addr::UNSPECIFIED, 0).into()
        } else {
            (Ipv6Addr::UNSPECIFIED, 0).into()
        };
        let s = match UdpSocket::bind(local).await {
            Ok(s) => s,
            Err(e) => return fail(lua, &io_err(&e)),
        };
        if let Err(e) = s.connect(addr).await {
            return fail(lua, &io_err(&e));
        }
        self.sock = Some(Dgram::Inet(s));
        1.into_lua_multi(lua)
    }

    async fn send(&mut self, lua: &Lua, data: &Value) -> Ret {
        let Some(sock) = self.sock.as_ref() else {
            return fail(lua, "closed");
        };
        let mut wbuf = std::mem::take(&mut self.wbuf);
        wbuf.clear();
        let mut num = itoa::Buffer::new();
        let s;
        let bytes: &[u8] = match data {
            Value::String(v) => {
                s = v.as_bytes();
                &s
            }
            Value::Table(_) => {
                flatten(lua, data, &mut wbuf, 0, self.max_buf)?;
                &wbuf
            }
            _ => match scalar(lua, data, &mut num)? {
                Some(Scalar::Static(b)) | Some(Scalar::Num(b)) => b,
                Some(Scalar::Lua(v)) => {
                    wbuf.extend_from_slice(&v.as_bytes());
                    &wbuf
                }
                None => {
                    return Err(mlua::Error::runtime(format!(
                        "bad argument #1 to 'send' (string, number, boolean, nil, or array table expected, got {})",
                        data.type_name()
                    )))
                }
            },
        };
        // A datagram socket is always writable unless the kernel buffer
        // is full: the read timeout bounds that wait too.
        let r = tokio::time::timeout(self.read_timeout, async {
            match sock {
                Dgram::Inet(s) => s.send(bytes).await,
                Dgram::Unix(s) => s.send(bytes).await,
            }
        })
        .await;
        if wbuf.capacity() > KEEP_WBUF {
            wbuf = Vec::new();
        }
        self.wbuf = wbuf;
        match r {
            Ok(Ok(_)) => 1.into_lua_multi(lua),
            Ok(Err(e)) => fail(lua, &io_err(&e)),
            Err(_) => fail(lua, "timeout"),
        }
    }

    async fn receive(&mut self, lua: &Lua, size: usize) -> Ret {
        let Some(sock) = self.sock.as_ref() else {
            return fail(lua, "closed");
        };
        if self.rbuf.len() < MAX_DGRAM {
            self.rbuf = vec![0; MAX_DGRAM];
        }
        let buf = &mut self.rbuf[..size];
        let r = tokio::time::timeout(self.read_timeout, async {
            match sock {
                Dgram::Inet(s) => s.recv(buf).await,
                Dgram::Unix(s) => s.recv(buf).await,
            }
        })
        .await;
        match r {
            Ok(Ok(n)) => lua.create_string(&self.rbuf[..n])?.into_lua_multi(lua),
            Ok(Err(e)) => fail(lua, &io_err(&e)),
            Err(_) => fail(lua, "timeout"),
        }
    }
}

// === send data ===

/// Deepest nesting of tables `send` flattens (a table may contain itself).
const MAX_SEND_DEPTH: usize = 100;

/// A scalar `send` value's bytes.
enum Scalar<'a> {
    Static(&'static [u8]),
    Num(&'a [u8]),
    Lua(LuaString),
}

/// nil, booleans, numbers and `ngx.null` as ngx_lua's `send` writes them;
/// `None` for other types.
fn scalar<'a>(lua: &Lua, v: &Value, num: &'a mut itoa::Buffer) -> mlua::Result<Option<Scalar<'a>>> {
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
fn flatten(lua: &Lua, v: &Value, out: &mut Vec<u8>, depth: usize, max: usize) -> mlua::Result<()> {
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

macro_rules! with_udp {
    ($id:expr, $s:ident, $body:block) => {{
        let Sock::Udp(rc) = table::lookup($id)? else {
            return Err(mlua::Error::runtime(
                "bad socket (closed: collected, or its request ended)",
            ));
        };
        let Ok(mut guard) = rc.try_borrow_mut() else {
            return Err(mlua::Error::runtime("socket busy"));
        };
        let $s: &mut UdpSock = &mut guard;
        $body
    }};
}

/// The UDP natives.
// Holding a socket's `RefCell` across awaits is the point: a socket belongs
// to one coroutine at a time, and a second user gets "socket busy"
// (`try_borrow_mut`), never a panic.
#[allow(clippy::await_holding_refcell_ref)]
pub(crate) fn register(lua: &Lua, natives: &mlua::Table) -> mlua::Result<()> {
    natives.set(
        "udp_new",
        lua.create_function(|lua, ()| {
            table::new_sock(lua, &|l| {
                Sock::Udp(Rc::new(RefCell::new(UdpSock::new(l.socket_buffer))))
            })
        })?,
    )?;
    natives.set("udp_free", table::free_native(lua)?)?;
    natives.set(
        "udp_setpeername",
        lua.create_async_function(|lua, (id, host, port): (u64, LuaString, i64)| async move {
            with_udp!(id, this, { this.setpeername(&lua, host, port).await })
        })?,
    )?;
    natives.set(
        "udp_send",
        lua.create_async_function(|lua, (id, data): (u64, Value)| async move {
            with_udp!(id, this, { this.send(&lua, &data).await })
        })?,
    )?;
    natives.set(
        "udp_receive",
        lua.create_async_function(|lua, (id, size): (u64, Option<f64>)| async move {
            let size = match size {
                None => MAX_DGRAM,
                // Larger asks get the cap (ngx_lua).
                Some(n) if n >= 1.0 => (n.min(MAX_DGRAM as f64)) as usize,
                Some(_) => {
                    return Err(mlua::Error::runtime(
                        "bad argument #1 to 'receive' (bad size)",
                    ))
                }
            };
            with_udp!(id, this, { this.receive(&lua, size).await })
        })?,
    )?;
    natives.set(
        "udp_settimeout",
        lua.create_function(|_, (id, ms): (u64, f64)| {
            with_udp!(id, this, {
                let d = crate::limits::lua_ms(ms, "bad timeout")?;
                this.read_timeout = if d.is_zero() { DEFAULT_TIMEOUT } else { d };
                Ok(())
            })
        })?,
    )?;
    natives.set(
        "udp_close",
        lua.create_function(|lua, id: u64| {
            with_udp!(id, this, {
                if this.sock.take().is_none() {
                    return fail(lua, "closed");
                }
                1.into_lua_multi(lua)
            })
        })?,
    )?;
    Ok(())
}
