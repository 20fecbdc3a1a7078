//! The cosockets' C boundary: `extern "C"` functions in a table Lua casts
//! to `const pier_sock_api_t*` (reached through the LuaJIT FFI, like the
//! rest of the API: their call sites get compiled), and the calls that run
//! interpreted on every request as classic C functions (see the end of
//! this file). Arguments are converted and checked here; the operations
//! are `TcpSock`'s (`tcp.rs` and its modules).
//!
//! Every function follows the FFI conventions of `crate::ffi` (status as
//! an `int`, panics caught, every pointer argument NULL or valid for the
//! call: "the ffi contract"), and raises no Lua error: results are codes
//! (`tcp.rs`, "result codes"), and the Lua wrapper raises.

use std::os::raw::{c_char, c_int};
use std::task::Context;

use super::recv::{FIN, LINE, OK, SIZE, UNTIL, UNTIL_INCLUSIVE};
use super::{TcpSock, APPEND, DEFAULT_POOL_SIZE, DEFAULT_TIMEOUT, E_BADREQ, E_BADSOCK, E_BUSY};
use super::{E_CLOSED, E_IO, E_NEED, E_TIMEOUT, E_TOOLARGE, KEEP_RBUF};
use crate::current;
use crate::ffi::{arg, guard, put, E_PHASE};
use crate::io::table::{self, lookup_raw, try_new_tcp, Bad, Full, NoSock, Sock};
use crate::phase::mask;

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

// === the FFI table ===

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
    connect: unsafe extern "C" fn(
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
    sslhandshake: unsafe extern "C" fn(f64, *const c_char, usize, c_int, c_int) -> c_int,
    close: unsafe extern "C" fn(f64) -> c_int,
    setoption: unsafe extern "C" fn(f64, c_int, f64) -> c_int,
    getoption: unsafe extern "C" fn(f64, c_int) -> c_int,
}

static SOCK_API: SockApi = SockApi {
    new,
    recv,
    send,
    errmsg,
    setkeepalive,
    reused,
    connect,
    sslhandshake,
    close,
    setoption,
    getoption,
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
    assert!(((table::GEN_MASK as u64) << table::INDEX_BITS | table::MAX_SLOTS as u64) < ANCHOR);

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
        return with_tcp(h, |s| s.append(data));
    }
    if data.len() > c_int::MAX as usize {
        return E_TOOLARGE;
    }
    with_cx(|cx| with_tcp(h, |s| s.send(cx, data, flags)))
}

/// The text of the socket's last [`E_IO`] or [`E_RAISE`](super::E_RAISE), copied to `(out, cap)`.
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
        // nil: 60 s; 0: never expires (ngx_lua).
        let idle = if idle_ms.is_nan() {
            DEFAULT_TIMEOUT
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
            DEFAULT_POOL_SIZE
        } else if (1.0..=1e9).contains(&size) {
            size as usize
        } else {
            return crate::ffi::E_INVAL;
        };
        s.keepalive(idle, size)
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

/// `connect`: see [`TcpSock::connect`] (`port` -1: `unix:` without one;
/// `pool_name` empty: none; `pool_size` 0: none given; `backlog` -1: none
/// given; `retry` non-zero after an [`AGAIN`](super::AGAIN)).
#[allow(clippy::too_many_arguments)]
unsafe extern "C" fn connect(
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
            s.connect(cx, host, port, pool_name, pool_size, backlog, retry != 0)
        })
    })
}

/// `sslhandshake(server_name|NULL, ssl_verify)`: see [`TcpSock::sslhandshake`].
unsafe extern "C" fn sslhandshake(
    h: f64,
    name: *const c_char,
    nlen: usize,
    verify: c_int,
    retry: c_int,
) -> c_int {
    // SAFETY: `(ptr, len)` arguments from Lua are valid for the call (ffi contract).
    let name = unsafe { arg(name, nlen) };
    with_cx(|cx| with_tcp(h, |s| s.sslhandshake(cx, name, verify != 0, retry != 0)))
}

/// `close()`: 1, or [`E_CLOSED`].
unsafe extern "C" fn close(h: f64) -> c_int {
    with_tcp(h, TcpSock::close)
}

/// `setoption(option, value)` (options numbered by the wrapper): 1 or an error.
unsafe extern "C" fn setoption(h: f64, opt: c_int, val: f64) -> c_int {
    with_tcp(h, |s| s.setoption(opt, val))
}

/// `getoption(option)`: the value, or an error.
unsafe extern "C" fn getoption(h: f64, opt: c_int) -> c_int {
    with_tcp(h, |s| s.getoption(opt))
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
/// code (a bad duration, a socket not this request's) the wrapper raises.
pub(super) unsafe extern "C-unwind" fn l_settimeouts(l: *mut lua::lua_State) -> c_int {
    // SAFETY: called by LuaJIT with its state (the lua_CFunction contract).
    let (h, c, s, r) = unsafe { (num(l, 1), num(l, 2), num(l, 3), num(l, 4)) };
    let rc = with_tcp(h, |t| {
        let ms = |v: f64| match crate::limits::duration_from_ms(v) {
            Ok(d) if d.is_zero() => Ok(DEFAULT_TIMEOUT),
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
        let _ = std::panic::catch_unwind(|| table::free_sock(h as u64));
    }
    0
}

/// Registers the classic C functions; `lua/pier/socket.lua` wraps them and
/// the FFI table in objects.
pub(crate) fn register(lua: &mlua::Lua, natives: &mlua::Table) -> mlua::Result<()> {
    // SAFETY: each is a `lua_CFunction` that reads its arguments with the
    // C API's checked accessors, pushes only its results and raises no
    // Lua error (above).
    unsafe {
        natives.set("tcp_recv_c", lua.create_c_function(l_recv)?)?;
        natives.set("tcp_send_c", lua.create_c_function(l_send)?)?;
        natives.set("tcp_settimeouts_c", lua.create_c_function(l_settimeouts)?)?;
        natives.set("tcp_free_c", lua.create_c_function(l_free)?)?;
        natives.set("tcp_setkeepalive_c", lua.create_c_function(l_setkeepalive)?)?;
    }
    Ok(())
}
