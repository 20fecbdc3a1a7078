//! `pier.socket.tcp()`: OpenResty-style cosockets over tokio, as mlua async
//! userdata. Calls yield the hook's coroutine, never the thread. Results
//! follow ngx.socket.tcp: `nil, err[, partial]` on failure.

use std::time::Duration;

use bytes::{Buf, BytesMut};
use std::cell::RefCell;
use std::collections::HashMap;
use std::rc::Rc;

use mlua::{Lua, MultiValue, Value};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use super::pool;
use crate::current;
use crate::limits::LuaLimits;

const DEFAULT_TIMEOUT: Duration = Duration::from_secs(60);
/// `fill`'s error when the receive buffer is full: raised as a Lua error.
const TOO_LARGE: &str = "receive buffer full";

pub(crate) struct TcpSock {
    stream: Option<TcpStream>,
    key: String,
    buf: BytesMut,
    timeout: Duration,
    reused: u32,
    /// Most bytes buffered (`[lua] socket_buffer`): a peer that never sends
    /// the delimiter, or `*a` on an endless stream, cannot grow the buffer
    /// without bound.
    max_buf: usize,
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
    pub fn new(max_buf: usize) -> Self {
        TcpSock {
            stream: None,
            key: String::new(),
            buf: BytesMut::new(),
            timeout: DEFAULT_TIMEOUT,
            reused: 0,
            max_buf,
        }
    }

    /// Reads more into `buf`: Ok(false) on EOF.
    async fn fill(&mut self) -> Result<bool, &'static str> {
        let Some(s) = self.stream.as_mut() else {
            return Err("closed");
        };
        let room = self.max_buf.saturating_sub(self.buf.len());
        if room == 0 {
            return Err(TOO_LARGE);
        }
        self.buf.reserve(room.min(8192));
        // Never read past the bound (`read_buf` fills all spare capacity).
        let mut limited = (&mut *s).take(room as u64);
        match tokio::time::timeout(self.timeout, limited.read_buf(&mut self.buf)).await {
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
                if !(0.0..=self.max_buf as f64).contains(&n) {
                    return Err(mlua::Error::runtime(
                        "bad argument #1 to receive (bad size, or over lua.socket_buffer)",
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
            Err((e, _)) if e == TOO_LARGE => Err(too_large(self)),
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

/// The Lua error for a full receive buffer; the connection is closed (its
/// state is unknown) and the buffer released.
fn too_large(sock: &mut TcpSock) -> mlua::Error {
    sock.stream = None;
    sock.buf = BytesMut::new();
    mlua::Error::runtime(format!(
        "receive buffer full: more than {} bytes (lua.socket_buffer)",
        sock.max_buf
    ))
}

// === the socket table ===
//
// Sockets live in a per-thread slab and Lua holds only a handle: the slot
// index plus the slot's generation, bumped whenever the slot is freed, so a
// handle to a freed socket never reaches the socket that reuses its slot
// (`bad socket`). Each socket records its owner (the request or timer run
// that created it, see `Current::owner`): another one using it gets `bad
// request`, as OpenResty answers. A request's sockets are freed when it
// ends (`RequestCtx` drop), a timer run's when it returns, and any of them
// earlier when Lua collects the object (an `ffi.gc` anchor). Lua never
// holds a pointer to a socket, only this checked handle.

/// Bits of the slot index in a handle: a handle is `gen << INDEX_BITS | index`,
/// below 2^53 so that Lua's doubles hold it exactly.
const INDEX_BITS: u32 = 24;
const GEN_MASK: u32 = (1 << 28) - 1;
/// No more slots than the index bits can name.
const MAX_SLOTS: usize = (1 << INDEX_BITS) - 1;

thread_local! {
    static SOCKS: RefCell<Slab> = RefCell::new(Slab::default());
}

struct Slot {
    gen: u32,
    owner: u64,
    sock: Option<Rc<RefCell<TcpSock>>>,
}

#[derive(Default)]
struct Slab {
    slots: Vec<Slot>,
    free: Vec<usize>,
    /// Live sockets, and live sockets per owner.
    live: usize,
    per_owner: HashMap<u64, usize>,
}

fn split(handle: u64) -> (usize, u32) {
    (
        (handle & ((1 << INDEX_BITS) - 1)) as usize,
        (handle >> INDEX_BITS) as u32,
    )
}

/// Why a socket could not be created.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Full {
    Request,
    Worker,
}

impl Slab {
    fn alloc(&mut self, owner: u64, limits: &LuaLimits) -> Result<u64, Full> {
        if self.live >= limits.max_sockets_per_worker.min(MAX_SLOTS) {
            return Err(Full::Worker);
        }
        let mine = self.per_owner.get(&owner).copied().unwrap_or(0);
        if mine >= limits.max_sockets_per_request {
            return Err(Full::Request);
        }
        let sock = Some(Rc::new(RefCell::new(TcpSock::new(limits.socket_buffer))));
        let i = match self.free.pop() {
            Some(i) => i,
            None => {
                self.slots.push(Slot {
                    gen: 0,
                    owner: 0,
                    sock: None,
                });
                self.slots.len() - 1
            }
        };
        let slot = &mut self.slots[i];
        slot.owner = owner;
        slot.sock = sock;
        self.live += 1;
        *self.per_owner.entry(owner).or_default() += 1;
        Ok(u64::from(slot.gen) << INDEX_BITS | i as u64)
    }

    /// Frees slot `i` if it holds a socket; its generation moves on.
    fn release(&mut self, i: usize) {
        let Some(slot) = self.slots.get_mut(i) else {
            return;
        };
        if slot.sock.take().is_none() {
            return;
        }
        slot.gen = (slot.gen + 1) & GEN_MASK;
        let owner = std::mem::take(&mut slot.owner);
        self.live -= 1;
        if let Some(n) = self.per_owner.get_mut(&owner) {
            *n -= 1;
            if *n == 0 {
                self.per_owner.remove(&owner);
            }
        }
        self.free.push(i);
    }
}

/// Frees the socket `handle` names, unless its slot has moved on.
fn free_sock(handle: u64) {
    let (i, gen) = split(handle);
    // `try_with`: finalizers may run while the thread is being torn down.
    // `try_borrow_mut`: never panic in a finalizer (nothing borrows the
    // slab while Lua runs, so this does not skip in practice).
    let _ = SOCKS.try_with(|s| {
        let Ok(mut s) = s.try_borrow_mut() else {
            return;
        };
        if s.slots.get(i).is_some_and(|slot| slot.gen == gen) {
            s.release(i);
        }
    });
}

/// Frees every socket of `owner` (a request ended, a timer run returned).
pub(crate) fn free_owner(owner: u64) {
    let _ = SOCKS.try_with(|s| {
        // Never panic in a `Drop` (see `free_sock`).
        let Ok(mut s) = s.try_borrow_mut() else {
            return;
        };
        // Every request end comes here: no hashing when no socket is alive.
        if s.live == 0 || !s.per_owner.contains_key(&owner) {
            return;
        }
        for i in 0..s.slots.len() {
            if s.slots[i].sock.is_some() && s.slots[i].owner == owner {
                s.release(i);
            }
        }
    });
}

/// The socket `handle`, if it is still that socket and belongs to the
/// request (or timer run) now running.
fn sock(handle: u64) -> mlua::Result<Rc<RefCell<TcpSock>>> {
    let (i, gen) = split(handle);
    let owner = current::get().owner;
    SOCKS.with_borrow(|s| match s.slots.get(i) {
        Some(Slot {
            gen: g,
            owner: o,
            sock: Some(sock),
        }) if *g == gen => {
            if *o != owner || owner == 0 {
                Err(mlua::Error::runtime("bad request"))
            } else {
                Ok(sock.clone())
            }
        }
        _ => Err(mlua::Error::runtime(
            "bad socket (closed: collected, or its request ended)",
        )),
    })
}

/// `pier.socket.tcp()`: a new socket for the current request or timer run.
fn new_sock(lua: &Lua) -> mlua::Result<u64> {
    let cur = current::get();
    let Some(engine) = cur.engine else {
        return Err(mlua::Error::runtime("no request"));
    };
    // SAFETY: the engine outlives every hook call it runs (see `Current`).
    let limits = unsafe { engine.as_ref() }.limits;
    if cur.owner == 0 {
        return Err(mlua::Error::runtime("no request"));
    }
    let mut r = SOCKS.with_borrow_mut(|s| s.alloc(cur.owner, &limits));
    if r.is_err() {
        // Sockets Lua no longer references may just not be collected yet:
        // collect (their anchors free them) and try once more.
        lua.gc_collect()?;
        r = SOCKS.with_borrow_mut(|s| s.alloc(cur.owner, &limits));
    }
    r.map_err(|full| {
        mlua::Error::runtime(match full {
            Full::Request => "too many sockets in this request (lua.max_sockets_per_request)",
            Full::Worker => "too many sockets in this worker (lua.max_sockets_per_worker)",
        })
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

/// The socket natives; `lua/pier/socket.lua` wraps them in objects.
// Holding a socket's `RefCell` across awaits is the point: a socket belongs
// to one coroutine at a time, and a second user gets "socket busy"
// (`try_borrow_mut`), never a panic.
#[allow(clippy::await_holding_refcell_ref)]
pub(crate) fn register(lua: &Lua, natives: &mlua::Table) -> mlua::Result<()> {
    natives.set("tcp_new", lua.create_function(|lua, ()| new_sock(lua))?)?;
    natives.set(
        "tcp_free",
        lua.create_function(|_, id: u64| {
            free_sock(id);
            Ok(())
        })?,
    )?;
    natives.set(
        "tcp_connect",
        lua.create_async_function(|lua, (id, host, port): (u64, String, u16)| async move {
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
        lua.create_async_function(|lua, (id, data): (u64, Value)| async move {
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
        lua.create_async_function(|lua, (id, pattern): (u64, Value)| async move {
            with_sock!(id, this, { this.receive(&lua, pattern).await })
        })?,
    )?;
    natives.set(
        "tcp_receiveuntil",
        lua.create_async_function(|lua, (id, delim): (u64, mlua::LuaString)| async move {
            let delim = delim.as_bytes().to_vec();
            if delim.is_empty() {
                return Err(mlua::Error::runtime(
                    "bad argument #1 to receiveuntil (empty pattern)",
                ));
            }
            with_sock!(id, this, {
                match this.read_until(&delim).await {
                    Ok(data) => lua.create_string(&data[..])?.into_lua_multi(&lua),
                    Err((e, _)) if e == TOO_LARGE => Err(too_large(this)),
                    Err((e, partial)) => {
                        (Value::Nil, e, lua.create_string(&partial[..])?).into_lua_multi(&lua)
                    }
                }
            })
        })?,
    )?;
    natives.set(
        "tcp_settimeout",
        lua.create_function(|_, (id, ms): (u64, f64)| {
            with_sock!(id, this, {
                // 0 (or no number) keeps the current timeout.
                let d = crate::limits::lua_ms(ms, "bad argument #1 to settimeout")?;
                if !d.is_zero() {
                    this.timeout = d;
                }
                Ok(())
            })
        })?,
    )?;
    natives.set(
        "tcp_setkeepalive",
        lua.create_function(
            |lua, (id, idle_ms, size): (u64, Option<f64>, Option<u32>)| {
                with_sock!(id, this, {
                    // 0 or nil: the default idle time.
                    let idle = match idle_ms {
                        Some(ms) => crate::limits::lua_ms(ms, "bad argument #1 to setkeepalive")?,
                        None => Duration::ZERO,
                    };
                    let idle = if idle.is_zero() {
                        DEFAULT_TIMEOUT
                    } else {
                        idle
                    };
                    let Some(s) = this.stream.take() else {
                        return fail(lua, "closed");
                    };
                    if !this.buf.is_empty() {
                        // Unread data: the connection's state is unknown, close it.
                        this.buf.clear();
                        return fail(lua, "unread data in buffer");
                    }
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
        lua.create_function(|_, id: u64| with_sock!(id, this, { Ok(this.reused) }))?,
    )?;
    natives.set(
        "tcp_close",
        lua.create_function(|lua, id: u64| {
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
