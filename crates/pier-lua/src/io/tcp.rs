//! `pier.socket.tcp()`: OpenResty-style cosockets over tokio, as mlua async
//! userdata. Calls yield the hook's coroutine, never the thread. Results
//! follow ngx.socket.tcp: `nil, err[, partial]` on failure.

use std::time::Duration;

use bytes::{Buf, BytesMut};
use std::cell::RefCell;
use std::rc::Rc;

use mlua::{Lua, MultiValue, Value};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use super::pool;

const DEFAULT_TIMEOUT: Duration = Duration::from_secs(60);
/// Largest `*l` line / `receiveuntil` chunk buffered (a peer that never
/// sends the delimiter cannot grow the buffer without bound).
const MAX_BUFFER: usize = 16 << 20;

pub(crate) struct TcpSock {
    stream: Option<TcpStream>,
    key: String,
    buf: BytesMut,
    timeout: Duration,
    reused: u32,
}

type Ret = mlua::Result<MultiValue>;

fn fail(lua: &Lua, err: &str) -> Ret {
    (Value::Nil, lua.create_string(err)?).into_lua_multi(lua)
}

use mlua::IntoLuaMulti;

fn io_err(e: &std::io::Error) -> &'static str {
    match e.kind() {
        std::io::ErrorKind::ConnectionRefused => "connection refused",
        std::io::ErrorKind::ConnectionReset | std::io::ErrorKind::BrokenPipe => "closed",
        std::io::ErrorKind::TimedOut => "timeout",
        _ => "io error",
    }
}

impl TcpSock {
    pub fn new() -> Self {
        TcpSock {
            stream: None,
            key: String::new(),
            buf: BytesMut::new(),
            timeout: DEFAULT_TIMEOUT,
            reused: 0,
        }
    }

    /// Reads more into `buf`: Ok(false) on EOF.
    async fn fill(&mut self) -> Result<bool, &'static str> {
        let Some(s) = self.stream.as_mut() else {
            return Err("closed");
        };
        if self.buf.len() >= MAX_BUFFER {
            return Err("buffer too large");
        }
        self.buf.reserve(8192);
        match tokio::time::timeout(self.timeout, s.read_buf(&mut self.buf)).await {
            Err(_) => Err("timeout"),
            Ok(Err(e)) => Err(io_err(&e)),
            Ok(Ok(0)) => Ok(false),
            Ok(Ok(_)) => Ok(true),
        }
    }

    /// Data up to `delim` (consumed, not returned).
    async fn read_until(&mut self, delim: &[u8]) -> Result<BytesMut, (&'static str, BytesMut)> {
        let mut scanned = 0;
        loop {
            if let Some(i) = memchr::memmem::find(&self.buf[scanned..], delim) {
                let data = self.buf.split_to(scanned + i);
                self.buf.advance(delim.len());
                return Ok(data);
            }
            scanned = self.buf.len().saturating_sub(delim.len() - 1);
            match self.fill().await {
                Ok(true) => {}
                Ok(false) => return Err(("closed", self.buf.split())),
                Err(e) => return Err((e, self.buf.split())),
            }
        }
    }

    async fn receive(&mut self, lua: &Lua, pattern: Value) -> Ret {
        let r = match &pattern {
            Value::Nil => self.read_line().await,
            Value::String(s) if s.as_bytes().starts_with(b"*l") => self.read_line().await,
            Value::String(s) if s.as_bytes().starts_with(b"*a") => loop {
                match self.fill().await {
                    Ok(true) => {}
                    Ok(false) => break Ok(self.buf.split()),
                    Err(e) => break Err((e, self.buf.split())),
                }
            },
            Value::Integer(_) | Value::Number(_) => {
                let n = match pattern {
                    Value::Integer(n) => n as f64,
                    Value::Number(n) => n,
                    _ => unreachable!(),
                };
                if !(0.0..=MAX_BUFFER as f64).contains(&n) {
                    return Err(mlua::Error::runtime(
                        "bad argument #1 to receive (bad size)",
                    ));
                }
                let n = n as usize;
                loop {
                    if self.buf.len() >= n {
                        break Ok(self.buf.split_to(n));
                    }
                    match self.fill().await {
                        Ok(true) => {}
                        Ok(false) => break Err(("closed", self.buf.split())),
                        Err(e) => break Err((e, self.buf.split())),
                    }
                }
            }
            _ => {
                return Err(mlua::Error::runtime(
                    "bad argument #1 to receive (bad pattern)",
                ))
            }
        };
        match r {
            Ok(data) => lua.create_string(&data[..])?.into_lua_multi(lua),
            Err((e, partial)) => {
                if e != "timeout" {
                    self.stream = None;
                }
                (Value::Nil, e, lua.create_string(&partial[..])?).into_lua_multi(lua)
            }
        }
    }

    async fn read_line(&mut self) -> Result<BytesMut, (&'static str, BytesMut)> {
        let mut line = self.read_until(b"\n").await?;
        if line.last() == Some(&b'\r') {
            line.truncate(line.len() - 1);
        }
        Ok(line)
    }
}

// === the socket table ===
//
// Sockets live in a per-thread slab and Lua holds only their integer id
// (plus an `ffi.gc` anchor that frees the slot). Not mlua userdata: a Rust
// `__gc` finalizer compiled at the workspace's dev `opt-level = 1` crashes
// LuaJIT on collection (see docs/lua.md), and ids keep Lua-side objects plain.

thread_local! {
    static SOCKS: RefCell<Slab> = RefCell::new(Slab::default());
}

#[derive(Default)]
struct Slab {
    socks: Vec<Option<Rc<RefCell<TcpSock>>>>,
    free: Vec<usize>,
}

fn new_sock() -> usize {
    SOCKS.with_borrow_mut(|s| {
        let sock = Some(Rc::new(RefCell::new(TcpSock::new())));
        match s.free.pop() {
            Some(i) => {
                s.socks[i] = sock;
                i
            }
            None => {
                s.socks.push(sock);
                s.socks.len() - 1
            }
        }
    })
}

fn free_sock(id: usize) {
    // `try_with`: finalizers may run while the thread is being torn down.
    let _ = SOCKS.try_with(|s| {
        let mut s = s.borrow_mut();
        if let Some(slot) = s.socks.get_mut(id) {
            if slot.take().is_some() {
                s.free.push(id);
            }
        }
    });
}

/// The socket `id`, exclusively (one coroutine at a time per socket).
fn sock(id: usize) -> mlua::Result<Rc<RefCell<TcpSock>>> {
    SOCKS
        .with_borrow(|s| s.socks.get(id).and_then(Clone::clone))
        .ok_or_else(|| mlua::Error::runtime("bad socket"))
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

/// The socket natives; `lua/pier/socket.lua` wraps them in objects.
// Holding a socket's `RefCell` across awaits is the point: a socket belongs
// to one coroutine at a time, and a second user gets "socket busy"
// (`try_borrow_mut`), never a panic.
#[allow(clippy::await_holding_refcell_ref)]
pub(crate) fn register(lua: &Lua, natives: &mlua::Table) -> mlua::Result<()> {
    natives.set("tcp_new", lua.create_function(|_, ()| Ok(new_sock()))?)?;
    natives.set(
        "tcp_free",
        lua.create_function(|_, id: usize| {
            free_sock(id);
            Ok(())
        })?,
    )?;
    natives.set(
        "tcp_connect",
        lua.create_async_function(|lua, (id, host, port): (usize, String, u16)| async move {
            with_sock!(id, this, {
                this.stream = None;
                this.buf.clear();
                let key = format!("{host}:{port}");
                if let Some((s, reused)) = pool::take(&key) {
                    this.stream = Some(s);
                    this.reused = reused + 1;
                    this.key = key;
                    return 1.into_lua_multi(&lua);
                }
                match tokio::time::timeout(this.timeout, TcpStream::connect((host.as_str(), port)))
                    .await
                {
                    Err(_) => fail(&lua, "timeout"),
                    Ok(Err(e)) => fail(&lua, io_err(&e)),
                    Ok(Ok(s)) => {
                        let _ = s.set_nodelay(true);
                        this.stream = Some(s);
                        this.reused = 0;
                        this.key = key;
                        1.into_lua_multi(&lua)
                    }
                }
            })
        })?,
    )?;
    natives.set(
        "tcp_send",
        lua.create_async_function(|lua, (id, data): (usize, Value)| async move {
            let mut bytes = Vec::new();
            flatten(&data, &mut bytes)?;
            with_sock!(id, this, {
                let timeout = this.timeout;
                let Some(s) = this.stream.as_mut() else {
                    return fail(&lua, "closed");
                };
                match tokio::time::timeout(timeout, s.write_all(&bytes)).await {
                    Err(_) => fail(&lua, "timeout"),
                    Ok(Err(e)) => {
                        this.stream = None;
                        fail(&lua, io_err(&e))
                    }
                    Ok(Ok(())) => (bytes.len() as i64).into_lua_multi(&lua),
                }
            })
        })?,
    )?;
    natives.set(
        "tcp_receive",
        lua.create_async_function(|lua, (id, pattern): (usize, Value)| async move {
            with_sock!(id, this, { this.receive(&lua, pattern).await })
        })?,
    )?;
    natives.set(
        "tcp_receiveuntil",
        lua.create_async_function(|lua, (id, delim): (usize, mlua::LuaString)| async move {
            let delim = delim.as_bytes().to_vec();
            if delim.is_empty() {
                return Err(mlua::Error::runtime(
                    "bad argument #1 to receiveuntil (empty pattern)",
                ));
            }
            with_sock!(id, this, {
                match this.read_until(&delim).await {
                    Ok(data) => lua.create_string(&data[..])?.into_lua_multi(&lua),
                    Err((e, partial)) => {
                        (Value::Nil, e, lua.create_string(&partial[..])?).into_lua_multi(&lua)
                    }
                }
            })
        })?,
    )?;
    natives.set(
        "tcp_settimeout",
        lua.create_function(|_, (id, ms): (usize, f64)| {
            with_sock!(id, this, {
                if ms.is_finite() && ms > 0.0 {
                    this.timeout = Duration::from_secs_f64(ms / 1000.0);
                }
                Ok(())
            })
        })?,
    )?;
    natives.set(
        "tcp_setkeepalive",
        lua.create_function(
            |lua, (id, idle_ms, size): (usize, Option<f64>, Option<u32>)| {
                with_sock!(id, this, {
                    let Some(s) = this.stream.take() else {
                        return fail(lua, "closed");
                    };
                    if !this.buf.is_empty() {
                        // Unread data: the connection's state is unknown, close it.
                        this.buf.clear();
                        return fail(lua, "unread data in buffer");
                    }
                    let idle = match idle_ms {
                        Some(ms) if ms.is_finite() && ms > 0.0 => {
                            Duration::from_secs_f64(ms / 1000.0)
                        }
                        _ => DEFAULT_TIMEOUT,
                    };
                    pool::put(
                        std::mem::take(&mut this.key),
                        s,
                        this.reused,
                        idle,
                        size.unwrap_or(30) as usize,
                    );
                    1.into_lua_multi(lua)
                })
            },
        )?,
    )?;
    natives.set(
        "tcp_reused",
        lua.create_function(|_, id: usize| with_sock!(id, this, { Ok(this.reused) }))?,
    )?;
    natives.set(
        "tcp_close",
        lua.create_function(|lua, id: usize| {
            with_sock!(id, this, {
                this.buf.clear();
                if this.stream.take().is_none() {
                    return fail(lua, "closed");
                }
                1.into_lua_multi(lua)
            })
        })?,
    )?;
    Ok(())
}

/// `send` accepts a string, a number, or a (nested) list of them.
fn flatten(v: &Value, out: &mut Vec<u8>) -> mlua::Result<()> {
    match v {
        Value::String(s) => out.extend_from_slice(&s.as_bytes()),
        Value::Integer(n) => out.extend_from_slice(itoa::Buffer::new().format(*n).as_bytes()),
        Value::Number(n) => out.extend_from_slice(n.to_string().as_bytes()),
        Value::Table(t) => {
            for item in t.sequence_values::<Value>() {
                flatten(&item?, out)?;
            }
        }
        _ => {
            return Err(mlua::Error::runtime(
                "bad argument #1 to send (string or table expected)",
            ))
        }
    }
    Ok(())
}
