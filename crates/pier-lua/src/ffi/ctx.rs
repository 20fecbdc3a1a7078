//! Phase, time, logging, `pier.ctx`, the flow calls (`exit`, `redirect`,
//! `say`), the body chunk and the balancer choice.

use std::net::{IpAddr, SocketAddr};
use std::os::raw::{c_char, c_int};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::ptr::NonNull;
use std::time::{SystemTime, UNIX_EPOCH};

use super::{arg, guard, out, put, with_view, OutLen, OutPtr, E_INVAL, E_PHASE, E_TOO_LARGE};
use crate::current::{self, Current};
use crate::engine::RequestCtx;
use crate::phase::mask;

pub(super) unsafe extern "C" fn phase() -> c_int {
    current::get().phase.map_or(-1, |p| p as c_int)
}

pub(super) unsafe extern "C" fn phase_allowed(m: u32) -> c_int {
    c_int::from(current::get().allows(m))
}

/// Seconds since the epoch, millisecond precision, from the request's clock
/// snapshot (wall clock outside a request).
pub(super) unsafe extern "C" fn now() -> f64 {
    let ns = current::get()
        .view
        // SAFETY: see `with_view`; `now_ns` takes `&self`.
        .and_then(|v| catch_unwind(AssertUnwindSafe(|| unsafe { v.as_ref() }.now_ns())).ok())
        .unwrap_or_else(wall_ns);
    (ns / 1_000_000) as f64 / 1000.0
}

pub(crate) fn wall_ns() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64)
}

/// `pier.log(level, msg)`: levels as nginx (4 err, 5 warn, 6 notice, 7 info, 8 debug).
pub(super) unsafe extern "C" fn log(level: c_int, p: *const c_char, n: usize) -> c_int {
    // SAFETY: `(ptr, len)` arguments from Lua are valid for the call (ffi contract).
    let msg = String::from_utf8_lossy(unsafe { arg(p, n) });
    let phase = current::get().phase.map_or("none", |p| p.name());
    guard(|| {
        match level {
            ..=4 => tracing::error!(target: "pier::lua", phase, "{msg}"),
            5 => tracing::warn!(target: "pier::lua", phase, "{msg}"),
            6 | 7 => tracing::info!(target: "pier::lua", phase, "{msg}"),
            _ => tracing::debug!(target: "pier::lua", phase, "{msg}"),
        }
        0
    })
}

/// `pier.analytics.field(name, value)`: a field of this request's analytics
/// event (pier_log::fields). -11: already 16 fields.
pub(super) unsafe extern "C" fn analytics_field(
    np: *const c_char,
    nn: usize,
    vp: *const c_char,
    vn: usize,
) -> c_int {
    if !current::get().allows(mask::LOG) {
        return E_PHASE;
    }
    // SAFETY: `(ptr, len)` arguments from Lua are valid for the call (ffi contract).
    let (name, value) = unsafe { (arg(np, nn), arg(vp, vn)) };
    guard(|| match pier_log::fields::set(name, value) {
        Ok(()) => 0,
        Err(pier_log::fields::Refused::TooMany) => -11,
        Err(_) => E_INVAL,
    })
}

/// `pier.trace`: `op` 0 a span attribute, 1 an event, 2 an attribute of
/// the latest event; the value is a string (`vt` 0), a number (1: an
/// integer when it is one, else a double) or a boolean (2, `num` 0 or 1).
/// -11: past a bound.
pub(super) unsafe extern "C" fn trace_add(
    op: c_int,
    kp: *const c_char,
    kn: usize,
    vt: c_int,
    vp: *const c_char,
    vn: usize,
    num: f64,
) -> c_int {
    // SAFETY: `(ptr, len)` arguments from Lua are valid for the call (ffi contract).
    let (key, text) = unsafe { (arg(kp, kn), arg(vp, vn)) };
    let op = match op {
        0..=2 => op as u8,
        _ => return E_INVAL,
    };
    let value = match vt {
        0 => pier_trace::Value::Str(String::from_utf8_lossy(text).into_owned()),
        1 if num.fract() == 0.0 && num.abs() < 9.0e15 => pier_trace::Value::Int(num as i64),
        1 => pier_trace::Value::Double(num),
        2 => pier_trace::Value::Bool(num != 0.0),
        _ => return E_INVAL,
    };
    with_view(mask::REQ_READ, |v, _| match v.trace_add(op, key, value) {
        Ok(()) => 0,
        Err(true) => -11,
        Err(false) => E_INVAL,
    })
}

/// Runs `f` on the current request's [`RequestCtx`] if the phase is in `m`.
#[inline(always)]
fn with_ctx(m: u32, f: impl FnOnce(&mut RequestCtx, &Current) -> c_int) -> c_int {
    let cur = current::get();
    if !cur.allows(m) {
        return E_PHASE;
    }
    let Some(mut ctx) = cur.ctx else {
        return E_PHASE;
    };
    // SAFETY: like the view, the ctx pointer is published only while the
    // hook call holding its `&mut RequestCtx` is being polled.
    guard(|| f(unsafe { ctx.as_mut() }, &cur))
}

/// The slot of this request's `pier.ctx` table, -1 if none yet (or if the
/// slot belongs to another engine: a request that outlived a reload must
/// not read a slot number in the new state's table).
pub(super) unsafe extern "C" fn ctx_ref() -> c_int {
    with_ctx(mask::CTX, |c, cur| match (&c.slots, cur.engine) {
        // SAFETY: the engine outlives every hook call it runs.
        (Some(slots), Some(e)) if std::rc::Rc::ptr_eq(slots, &unsafe { e.as_ref() }.ctx_slots) => {
            c.ctx_ref
        }
        _ => -1,
    })
}

/// Allocates a slot for this request's `pier.ctx` table (the Lua side
/// stores the table at that index of its slot array).
pub(super) unsafe extern "C" fn ctx_new_ref() -> c_int {
    with_ctx(mask::CTX, |c, cur| {
        let Some(engine) = cur.engine else {
            return E_PHASE;
        };
        // SAFETY: the engine outlives every hook call it runs.
        let engine = unsafe { engine.as_ref() };
        if let Some(old) = c.slots.take() {
            old.release(c.ctx_ref);
        }
        c.ctx_ref = engine.ctx_slots.alloc();
        c.slots = Some(engine.ctx_slots.clone());
        c.ctx_ref
    })
}

/// Called by the runner coroutine when a pooled hook run has finished.
pub(super) unsafe extern "C" fn hook_done() -> c_int {
    with_ctx(crate::phase::mask::ANY, |c, _| {
        c.done = true;
        0
    })
}

/// `pier.exit(status[, body])`: 0 ends the hook and continues; 100..=599
/// answers. The wrapper yields right after, and the engine stops the hook.
pub(super) unsafe extern "C" fn exit(
    status: c_int,
    body: *const c_char,
    blen: usize,
    has_body: c_int,
) -> c_int {
    if status != 0 && !(100..=599).contains(&status) {
        return E_INVAL;
    }
    // SAFETY: `(ptr, len)` arguments from Lua are valid for the call (ffi contract).
    let body = unsafe { arg(body, blen) };
    with_ctx(mask::EXIT, |c, cur| {
        if has_body != 0 && body.len() > max_body(cur) {
            return E_TOO_LARGE;
        }
        c.exit = Some(status as u16);
        if has_body != 0 {
            c.body.clear();
            c.body.extend_from_slice(body);
        }
        0
    })
}

pub(super) unsafe extern "C" fn redirect(uri: *const c_char, n: usize, status: c_int) -> c_int {
    // SAFETY: `(ptr, len)` arguments from Lua are valid for the call (ffi contract).
    let uri = unsafe { arg(uri, n) };
    if uri.is_empty() || !super::valid_value(uri) || !matches!(status, 301 | 302 | 303 | 307 | 308)
    {
        return E_INVAL;
    }
    with_ctx(mask::EXIT, |c, _| {
        c.exit = Some(status as u16);
        c.location = Some(uri.to_vec());
        0
    })
}

pub(super) unsafe extern "C" fn say(p: *const c_char, n: usize) -> c_int {
    // SAFETY: `(ptr, len)` arguments from Lua are valid for the call (ffi contract).
    let s = unsafe { arg(p, n) };
    with_ctx(mask::SAY, |c, cur| push_body(c, cur, s, false))
}

/// Appends `s` (and a newline) to the hook's response body, within
/// `[lua] max_response_body`: all of it, or nothing and [`E_TOO_LARGE`].
fn push_body(c: &mut RequestCtx, cur: &Current, s: &[u8], nl: bool) -> c_int {
    let add = s.len() + usize::from(nl);
    if c.body.len().saturating_add(add) > max_body(cur) {
        return E_TOO_LARGE;
    }
    c.body.extend_from_slice(s);
    if nl {
        c.body.push(b'\n');
    }
    0
}

/// `say_c(value, newline)`, a classic Lua C function: `ngx.say` /
/// `ngx.print` of one string or number (a number as Lua writes it,
/// `%.14g`), with the newline. Pushes the code: [`say`]'s, or 1 when the
/// value is of another type (the wrapper then builds the output itself).
/// A C function because its call site comes right after a cosocket wait,
/// which ends traces: interpreted, an FFI call costs far more (see
/// `io/tcp/ffi.rs`, "classic C functions"). Raises no Lua error of its
/// own; converting a number may fail for memory, and LuaJIT then unwinds
/// through this frame, which holds nothing to drop at that point.
pub(crate) unsafe extern "C-unwind" fn l_say(l: *mut mlua::ffi::lua_State) -> c_int {
    use mlua::ffi as lua;
    // SAFETY: called by LuaJIT with its state (the lua_CFunction contract);
    // the value's type is checked before lua_tolstring, which converts a
    // number in place in its own argument slot (it stays a valid string
    // for the call); one push fits LUA_MINSTACK.
    unsafe {
        let t = lua::lua_type(l, 1);
        let whole = if t == lua::LUA_TNUMBER {
            whole_number(lua::lua_tonumber(l, 1))
        } else {
            None
        };
        let rc = if let Some(v) = whole {
            // An integer prints as its digits under `%.14g`: formatted here,
            // without LuaJIT's float formatter and a new interned string.
            let nl = lua::lua_toboolean(l, 2) != 0;
            let mut b = itoa::Buffer::new();
            let s = b.format(v).as_bytes();
            with_ctx(mask::SAY, |c, cur| push_body(c, cur, s, nl))
        } else if t == lua::LUA_TSTRING || t == lua::LUA_TNUMBER {
            let nl = lua::lua_toboolean(l, 2) != 0;
            let mut n = 0usize;
            let p = lua::lua_tolstring(l, 1, &mut n);
            let s = arg(p, n);
            with_ctx(mask::SAY, |c, cur| push_body(c, cur, s, nl))
        } else {
            1
        };
        lua::lua_pushinteger(l, rc as lua::lua_Integer);
    }
    1
}

/// `v` as an integer when `%.14g` prints it as its plain digits: a whole
/// number below 10^14 in magnitude (longer ones take an exponent), not -0.
fn whole_number(v: f64) -> Option<i64> {
    if v.fract() == 0.0 && v.abs() < 1e14 && !(v == 0.0 && v.is_sign_negative()) {
        Some(v as i64)
    } else {
        None
    }
}

/// `[lua] max_response_body` of the engine running the hook.
fn max_body(cur: &Current) -> usize {
    match cur.engine {
        // SAFETY: the engine outlives every hook call it runs.
        Some(e) => unsafe { e.as_ref() }.limits.max_response_body,
        None => crate::limits::LuaLimits::DEFAULT.max_response_body,
    }
}

fn chunk(cur: &Current) -> Option<NonNull<bytes::BytesMut>> {
    if cur.allows(mask::BODY) {
        cur.chunk
    } else {
        None
    }
}

/// The current body chunk and its eof flag (`pier.arg[1]`, `pier.arg[2]`).
pub(super) unsafe extern "C" fn body_chunk(p: OutPtr, n: OutLen, eof: *mut c_int) -> c_int {
    let cur = current::get();
    let Some(ch) = chunk(&cur) else {
        return E_PHASE;
    };
    // SAFETY: the chunk is published by `body_filter` for the duration of
    // the hook call; out-pointers from Lua are NULL or writable (ffi contract).
    unsafe { out(ch.as_ref(), p, n) };
    // SAFETY: out-pointers from Lua are NULL or writable (ffi contract).
    unsafe { put(eof, c_int::from(cur.eof)) };
    0
}

/// Replaces the current body chunk (`pier.arg[1] = s`).
pub(super) unsafe extern "C" fn body_set_chunk(p: *const c_char, n: usize) -> c_int {
    let cur = current::get();
    let Some(mut ch) = chunk(&cur) else {
        return E_PHASE;
    };
    guard(|| {
        // Copy before write: `(p, n)` may point into the chunk itself (a
        // hook passing the pointer `body_chunk` gave it, or a part of it),
        // so it is read in full before the chunk is touched, and no `&mut`
        // to the chunk exists while the argument slice is alive.
        CHUNK_COPY.with_borrow_mut(|copy| {
            copy.clear();
            // SAFETY: `(ptr, len)` arguments from Lua are valid for the call
            // (ffi contract); the slice is dropped before the chunk is borrowed.
            copy.extend_from_slice(unsafe { arg(p, n) });
            // SAFETY: as in `body_chunk`; no other reference to the chunk is alive.
            let ch = unsafe { ch.as_mut() };
            ch.clear();
            ch.extend_from_slice(copy);
            // Do not keep a huge chunk's copy around.
            if copy.capacity() > 1 << 20 {
                *copy = Vec::new();
            }
        });
        0
    })
}

thread_local! {
    /// `body_set_chunk`'s copy of its argument.
    static CHUNK_COPY: std::cell::RefCell<Vec<u8>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// `pier.balancer.set_peer(ip, port)`: an IP literal (no DNS here).
pub(super) unsafe extern "C" fn balancer_set_peer(
    p: *const c_char,
    n: usize,
    port: c_int,
) -> c_int {
    let Ok(port) = u16::try_from(port) else {
        return E_INVAL;
    };
    // SAFETY: `(ptr, len)` arguments from Lua are valid for the call (ffi contract).
    let Some(ip) = std::str::from_utf8(unsafe { arg(p, n) })
        .ok()
        .and_then(|s| s.parse::<IpAddr>().ok())
    else {
        return E_INVAL;
    };
    with_ctx(mask::BALANCER, |c, _| {
        c.peer = Some(SocketAddr::new(ip, port));
        0
    })
}

pub(super) unsafe extern "C" fn balancer_set_retries(n: c_int) -> c_int {
    let Ok(n) = u32::try_from(n) else {
        return E_INVAL;
    };
    with_ctx(mask::BALANCER, |c, _| {
        c.retries = Some(n);
        0
    })
}

/// `pier.balancer.get_last_failure()`: 0 on the first attempt, else 1
/// (`"failed"`: the connect failed) or 2 (`"next"`: the origin failed the
/// request), with the status the failure stands for in `*status`.
pub(super) unsafe extern "C" fn balancer_last_failure(status: *mut c_int) -> c_int {
    with_ctx(mask::BALANCER, |c, _| match c.last_failure {
        None => 0,
        Some((state, code)) => {
            // SAFETY: `status` points at an int the Lua caller allocated
            // for this call (ffi contract).
            unsafe { *status = c_int::from(code) };
            c_int::from(state)
        }
    })
}

#[cfg(test)]
mod tests {
    #[test]
    fn whole_numbers_print_as_percent_14g_does() {
        use super::whole_number as w;
        assert_eq!(w(0.0), Some(0));
        assert_eq!(w(42.0), Some(42));
        assert_eq!(w(-7.0), Some(-7));
        assert_eq!(w(99_999_999_999_999.0), Some(99_999_999_999_999));
        // "1e+14", "-0", "0.5", "nan", "inf" under %.14g: left to Lua.
        assert_eq!(w(1e14), None);
        assert_eq!(w(-0.0), None);
        assert_eq!(w(0.5), None);
        assert_eq!(w(f64::NAN), None);
        assert_eq!(w(f64::INFINITY), None);
    }
}
