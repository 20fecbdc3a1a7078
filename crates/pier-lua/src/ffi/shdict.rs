//! `pier.shared.NAME:*` over [`pier_shdict`]. Times cross as seconds
//! (doubles, as ngx.shared) and are converted to the dict's integer ms.

use std::cell::RefCell;
use std::os::raw::{c_char, c_int};
use std::sync::Arc;

use pier_shdict::{IncrError, ListError, ListItem, SetResult, SharedDict, Value};

use super::{
    arg, copy_out, guard, out, put, OutLen, OutPtr, PierPair, E_DURATION, E_EXISTS, E_INVAL, E_NAN,
    E_NOMEM, E_NOTFOUND, E_PHASE, SCRATCH,
};

/// List operations: the key holds a value that is not a list ("value not a
/// list"). Local to the list functions (`lua/pier/shared.lua` maps it).
const E_NOT_LIST: c_int = -20;
use crate::current::{self, Current};

thread_local! {
    /// Reused by every `get`: a hit copies the value here, allocation-free
    /// once it has grown to the largest value read.
    static VALUE: RefCell<Vec<u8>> = const { RefCell::new(Vec::new()) };
}

fn now_ms(cur: &Current) -> u64 {
    match cur.view {
        // SAFETY: see `with_view`; `now_ns` takes `&self` and cannot outlive the scope.
        Some(v) => unsafe { v.as_ref() }.now_ns() / 1_000_000,
        None => super::ctx::wall_ns() / 1_000_000,
    }
}

/// Seconds (Lua) to whole milliseconds (see [`crate::limits::secs_to_ms`]).
fn secs_to_ms(s: f64) -> Option<u64> {
    crate::limits::secs_to_ms(s).ok()
}

/// Runs `f` on dict `idx` of the engine running the current hook.
#[inline(always)]
fn with_dict(idx: c_int, f: impl FnOnce(&Arc<SharedDict>, &Current) -> c_int) -> c_int {
    let cur = current::get();
    let Some(engine) = cur.engine else {
        return E_PHASE;
    };
    guard(|| {
        // SAFETY: the engine outlives every hook call it runs.
        let engine = unsafe { engine.as_ref() };
        match u32::try_from(idx)
            .ok()
            .and_then(|i| engine.shared.by_index(i))
        {
            Some(d) => f(d, &cur),
            None => E_INVAL,
        }
    })
}

/// The index of dict `name`, or -1.
pub(super) unsafe extern "C" fn index(name: *const c_char, n: usize) -> c_int {
    // SAFETY: `(ptr, len)` arguments from Lua are valid for the call (ffi contract).
    let name = unsafe { arg(name, n) };
    let cur = current::get();
    let Some(engine) = cur.engine else {
        return E_PHASE;
    };
    // SAFETY: as in `with_dict`.
    let engine = unsafe { engine.as_ref() };
    engine
        .shared
        .index_of_bytes(name)
        .map_or(-1, |i| i as c_int)
}

/// A string value is copied to `out_buf` when it fits (its length goes to
/// `*len` either way; see `copy_out`).
/// Returns the Lua type code of the value (0 nil, 1 boolean, 3 number,
/// 4 string) plus 16 if it is stale (only with `stale != 0`).
#[allow(clippy::too_many_arguments)]
pub(super) unsafe extern "C" fn get(
    idx: c_int,
    key: *const c_char,
    klen: usize,
    stale: c_int,
    out_buf: *mut c_char,
    cap: usize,
    len: *mut c_int,
    num: *mut f64,
    flags: *mut u32,
) -> c_int {
    // SAFETY: `(ptr, len)` arguments from Lua are valid for the call (ffi contract).
    let key = unsafe { arg(key, klen) };
    with_dict(idx, |d, cur| {
        VALUE.with_borrow_mut(|buf| {
            let now = now_ms(cur);
            let hit = if stale != 0 {
                d.get_stale(key, now, buf)
            } else {
                d.get(key, now, buf)
            };
            let Some(hit) = hit else { return 0 };
            // SAFETY: out-pointers from Lua are NULL or writable (ffi contract).
            unsafe { put(flags, hit.flags) };
            let code = match hit.value {
                pier_shdict::HitValue::Bool(b) => {
                    // SAFETY: out-pointers from Lua are NULL or writable (ffi contract).
                    unsafe { put(num, if b { 1.0 } else { 0.0 }) };
                    1
                }
                pier_shdict::HitValue::Number(x) => {
                    // SAFETY: out-pointers from Lua are NULL or writable (ffi contract).
                    unsafe { put(num, x) };
                    3
                }
                pier_shdict::HitValue::Str => {
                    // SAFETY: out-pointers from Lua are NULL or writable (ffi contract).
                    unsafe { put(len, copy_out(buf, out_buf, cap)) };
                    4
                }
                // The wrapper answers nil, "value is a list".
                pier_shdict::HitValue::List => 5,
            };
            code + if hit.stale { 16 } else { 0 }
        })
    })
}

/// `op`: 0 set, 1 safe_set, 2 add, 3 safe_add, 4 replace. `vtype` is the
/// Lua type code. Returns 0 stored, 1 stored with a live entry evicted.
#[allow(clippy::too_many_arguments)]
pub(super) unsafe extern "C" fn store(
    idx: c_int,
    op: c_int,
    key: *const c_char,
    klen: usize,
    vtype: c_int,
    vp: *const c_char,
    vlen: usize,
    vnum: f64,
    ttl: f64,
    flags: u32,
) -> c_int {
    // SAFETY: `(ptr, len)` arguments from Lua are valid for the call (ffi contract).
    let key = unsafe { arg(key, klen) };
    let value = match vtype {
        0 => Value::Nil,
        1 => Value::Bool(vnum != 0.0),
        3 => Value::Number(vnum),
        // SAFETY: `(ptr, len)` arguments from Lua are valid for the call (ffi contract).
        4 => Value::Str(unsafe { arg(vp, vlen) }),
        _ => return E_INVAL,
    };
    let Some(ttl_ms) = secs_to_ms(ttl) else {
        return E_DURATION;
    };
    with_dict(idx, |d, cur| {
        let now = now_ms(cur);
        let r = match op {
            0 => d.set(key, value, ttl_ms, flags, now),
            1 => d.safe_set(key, value, ttl_ms, flags, now),
            2 => d.add(key, value, ttl_ms, flags, now),
            3 => d.safe_add(key, value, ttl_ms, flags, now),
            4 => d.replace(key, value, ttl_ms, flags, now),
            _ => return E_INVAL,
        };
        match r {
            SetResult::Stored => 0,
            SetResult::StoredEvicted => 1,
            SetResult::Exists => E_EXISTS,
            SetResult::NotFound => E_NOTFOUND,
            SetResult::NoMemory => E_NOMEM,
            SetResult::InvalidKey => E_INVAL,
        }
    })
}

/// `incr(key, by, init?, init_ttl?)`: the new value in `*outv`; returns 0,
/// or 1 if storing `init` evicted a live entry.
#[allow(clippy::too_many_arguments)]
pub(super) unsafe extern "C" fn incr(
    idx: c_int,
    key: *const c_char,
    klen: usize,
    by: f64,
    init: f64,
    has_init: c_int,
    init_ttl: f64,
    outv: *mut f64,
) -> c_int {
    // SAFETY: `(ptr, len)` arguments from Lua are valid for the call (ffi contract).
    let key = unsafe { arg(key, klen) };
    let Some(ttl_ms) = secs_to_ms(init_ttl) else {
        return E_DURATION;
    };
    with_dict(idx, |d, cur| {
        let init = (has_init != 0).then_some(init);
        match d.incr(key, by, init, ttl_ms, now_ms(cur)) {
            Ok(r) => {
                // SAFETY: out-pointers from Lua are NULL or writable (ffi contract).
                unsafe { put(outv, r.value) };
                c_int::from(r.forcible)
            }
            Err(IncrError::NotFound) => E_NOTFOUND,
            Err(IncrError::NotANumber) => E_NAN,
            Err(IncrError::NoMemory) => E_NOMEM,
            Err(IncrError::InvalidKey) => E_INVAL,
        }
    })
}

pub(super) unsafe extern "C" fn delete(idx: c_int, key: *const c_char, klen: usize) -> c_int {
    // SAFETY: `(ptr, len)` arguments from Lua are valid for the call (ffi contract).
    let key = unsafe { arg(key, klen) };
    with_dict(idx, |d, cur| c_int::from(d.delete(key, now_ms(cur))))
}

/// 1 and the remaining seconds (0 = never expires) if live, else 0.
pub(super) unsafe extern "C" fn ttl(
    idx: c_int,
    key: *const c_char,
    klen: usize,
    outv: *mut f64,
) -> c_int {
    // SAFETY: `(ptr, len)` arguments from Lua are valid for the call (ffi contract).
    let key = unsafe { arg(key, klen) };
    with_dict(idx, |d, cur| match d.ttl(key, now_ms(cur)) {
        Some(t) => {
            // SAFETY: out-pointers from Lua are NULL or writable (ffi contract).
            unsafe { put(outv, t.map_or(0.0, |ms| ms as f64 / 1000.0)) };
            1
        }
        None => 0,
    })
}

/// 1 if the key was live and its TTL is now `ttl` seconds (0 = never), else 0.
pub(super) unsafe extern "C" fn expire(
    idx: c_int,
    key: *const c_char,
    klen: usize,
    ttl: f64,
) -> c_int {
    // SAFETY: `(ptr, len)` arguments from Lua are valid for the call (ffi contract).
    let key = unsafe { arg(key, klen) };
    let Some(ttl_ms) = secs_to_ms(ttl) else {
        return E_DURATION;
    };
    with_dict(idx, |d, cur| {
        c_int::from(d.expire(key, ttl_ms, now_ms(cur)))
    })
}

pub(super) unsafe extern "C" fn flush_all(idx: c_int) -> c_int {
    with_dict(idx, |d, _| {
        d.flush_all();
        0
    })
}

pub(super) unsafe extern "C" fn flush_expired(idx: c_int, max: c_int) -> c_int {
    with_dict(idx, |d, cur| {
        let n = d.flush_expired(usize::try_from(max).unwrap_or(0), now_ms(cur));
        c_int::try_from(n).unwrap_or(c_int::MAX)
    })
}

/// Up to `max` live keys (0 = all) as pairs (key only).
pub(super) unsafe extern "C" fn keys(idx: c_int, max: c_int, outp: *mut *const PierPair) -> c_int {
    with_dict(idx, |d, cur| {
        let keys = d.get_keys(usize::try_from(max).unwrap_or(0), now_ms(cur));
        SCRATCH.with_borrow_mut(|s| {
            s.bytes.clear();
            s.spans.clear();
            for k in &keys {
                let at = s.bytes.len();
                s.bytes.extend_from_slice(k);
                s.spans.push((at, k.len(), at, 0));
            }
            // SAFETY: out-pointers from Lua are NULL or writable (ffi contract).
            unsafe { s.publish(outp) }
        })
    })
}

pub(super) unsafe extern "C" fn capacity(idx: c_int, cap: *mut f64, free: *mut f64) -> c_int {
    with_dict(idx, |d, _| {
        // SAFETY: out-pointers from Lua are NULL or writable (ffi contract).
        unsafe { put(cap, d.capacity() as f64) };
        // SAFETY: out-pointers from Lua are NULL or writable (ffi contract).
        unsafe { put(free, d.free_space() as f64) };
        0
    })
}

fn list_status(e: ListError) -> c_int {
    match e {
        ListError::NotAList => E_NOT_LIST,
        ListError::NoMemory => E_NOMEM,
        ListError::BadValue | ListError::InvalidKey => E_INVAL,
    }
}

/// `lpush` (`front != 0`) / `rpush`: `vtype` 3 (number `vnum`) or 4 (string
/// `(vp, vlen)`). Returns the list's new length.
#[allow(clippy::too_many_arguments)]
pub(super) unsafe extern "C" fn push(
    idx: c_int,
    front: c_int,
    key: *const c_char,
    klen: usize,
    vtype: c_int,
    vp: *const c_char,
    vlen: usize,
    vnum: f64,
) -> c_int {
    // SAFETY: `(ptr, len)` arguments from Lua are valid for the call (ffi contract).
    let key = unsafe { arg(key, klen) };
    let value = match vtype {
        3 => Value::Number(vnum),
        // SAFETY: `(ptr, len)` arguments from Lua are valid for the call (ffi contract).
        4 => Value::Str(unsafe { arg(vp, vlen) }),
        _ => return E_INVAL,
    };
    with_dict(idx, |d, cur| {
        let now = now_ms(cur);
        let r = if front != 0 {
            d.lpush(key, value, now)
        } else {
            d.rpush(key, value, now)
        };
        match r {
            Ok(n) => c_int::try_from(n).unwrap_or(c_int::MAX),
            Err(e) => list_status(e),
        }
    })
}

/// `lpop` (`front != 0`) / `rpop`: 0 if the key holds no live value, 3 with
/// the number in `*num`, or 4 with the string in `(*outp, *outl)` (a
/// per-thread buffer, valid until the next call: a pop cannot be retried
/// with a bigger buffer).
pub(super) unsafe extern "C" fn pop(
    idx: c_int,
    front: c_int,
    key: *const c_char,
    klen: usize,
    outp: OutPtr,
    outl: OutLen,
    num: *mut f64,
) -> c_int {
    // SAFETY: `(ptr, len)` arguments from Lua are valid for the call (ffi contract).
    let key = unsafe { arg(key, klen) };
    with_dict(idx, |d, cur| {
        let now = now_ms(cur);
        let r = if front != 0 {
            d.lpop(key, now)
        } else {
            d.rpop(key, now)
        };
        match r {
            Ok(None) => 0,
            Ok(Some(ListItem::Number(n))) => {
                // SAFETY: out-pointers from Lua are NULL or writable (ffi contract).
                unsafe { put(num, n) };
                3
            }
            Ok(Some(ListItem::Str(v))) => VALUE.with_borrow_mut(|buf| {
                // Keep the popped buffer until the next call: Lua copies it.
                *buf = v.into_vec();
                // SAFETY: out-pointers from Lua are NULL or writable (ffi contract).
                unsafe { out(buf, outp, outl) };
                4
            }),
            Err(e) => list_status(e),
        }
    })
}

/// `llen`: the list's length (0 if the key holds no live value).
pub(super) unsafe extern "C" fn llen(idx: c_int, key: *const c_char, klen: usize) -> c_int {
    // SAFETY: `(ptr, len)` arguments from Lua are valid for the call (ffi contract).
    let key = unsafe { arg(key, klen) };
    with_dict(idx, |d, cur| match d.llen(key, now_ms(cur)) {
        Ok(n) => c_int::try_from(n).unwrap_or(c_int::MAX),
        Err(e) => list_status(e),
    })
}
