//! The `extern "C"` functions behind the hot `pier.*` calls.
//!
//! Lua reaches them through one `#[repr(C)]` table of function pointers,
//! [`PierApi`], whose address the bootstrap receives once as a number and
//! casts with `ffi.cast("const pier_api_t*", addr)` (see `lua/pier/base.lua`
//! for the matching C declaration — keep the two in the same order). This is
//! linker-proof (no `--export-dynamic`, nothing for the linker to drop) and
//! calls through these pointers are compiled by the JIT like `ffi.C` calls.
//!
//! Every function is an `unsafe extern "C" fn`, reachable only through the
//! crate-private table (Lua casts its address). Their common safety
//! contract ("the ffi contract" in `SAFETY` comments): every `(ptr, len)`
//! argument is NULL or valid for reads of `len` bytes for the duration of
//! the call, and every out-pointer is NULL or valid for writes of its type
//! (the Lua wrappers pass Lua strings and `ffi.new` arrays).
//!
//! Conventions, for every function:
//! * no request pointer: the request comes from [`crate::current`];
//! * strings in as `(ptr, len)`, strings out through `(*ptr, *len)`
//!   out-parameters pointing into the request or a per-thread scratch buffer,
//!   valid until the next API call (the Lua wrapper copies with `ffi.string`);
//! * an `int` status: `>= 0` success, [`E_PHASE`] when the call is not
//!   allowed in the current phase, [`E_INVAL`] for a bad argument,
//!   [`E_INTERNAL`] if Rust panicked (caught: nothing unwinds into Lua);
//! * structs only by pointer.

pub(crate) mod cache;
mod ctx;
mod limit;
mod ngx;
mod req;
mod resp;
mod shdict;
pub(crate) mod strings;

use std::cell::RefCell;
use std::os::raw::{c_char, c_int};
use std::panic::{catch_unwind, AssertUnwindSafe};

use crate::current::{self, Current};
use crate::view::HttpView;

pub(crate) use ctx::l_say;
pub(crate) use ngx::{ngx_api_addr, set_worker};

/// Not allowed in the current phase (or no request is running).
pub const E_PHASE: c_int = -2;
/// Bad argument (e.g. a header value with CR/LF).
pub const E_INVAL: c_int = -3;
/// Rust panicked; the panic was caught at the boundary.
pub const E_INTERNAL: c_int = -4;
/// Shared dict: no memory.
pub const E_NOMEM: c_int = -5;
/// Shared dict: the key exists (`add`) / not found (`replace`, `incr`).
pub const E_EXISTS: c_int = -6;
pub const E_NOTFOUND: c_int = -7;
/// Shared dict: `incr` on a non-number.
pub const E_NAN: c_int = -8;
/// A time argument (TTL) that is NaN, infinite, negative or over a year.
pub const E_DURATION: c_int = -9;
/// A body past its bound (`[lua] max_response_body`).
pub const E_TOO_LARGE: c_int = -10;

/// A key/value pair handed to Lua in bulk (`get_headers`, `get_uri_args`).
/// `vlen < 0` means "no value" (a query arg without `=`, i.e. `true`).
#[repr(C)]
pub struct PierPair {
    pub k: *const c_char,
    pub klen: usize,
    pub v: *const c_char,
    pub vlen: isize,
}

/// Out-parameter types, spelled as in the C declarations.
pub type OutPtr = *mut *const c_char;
pub type OutLen = *mut usize;

/// The API table. Field order and types must match `pier_api_t` in
/// `lua/pier/base.lua`. Crate-private, as are the functions: only Lua (and
/// the crate's own tests) can call them, through the address [`api_addr`]
/// gives, which takes `unsafe` to use.
#[repr(C)]
pub(crate) struct PierApi {
    phase: unsafe extern "C" fn() -> c_int,
    phase_allowed: unsafe extern "C" fn(u32) -> c_int,
    now: unsafe extern "C" fn() -> f64,
    log: unsafe extern "C" fn(c_int, *const c_char, usize) -> c_int,
    // request
    req_method: unsafe extern "C" fn(*mut c_char, usize) -> c_int,
    req_uri: unsafe extern "C" fn(*mut c_char, usize) -> c_int,
    req_path: unsafe extern "C" fn(*mut c_char, usize) -> c_int,
    req_set_path: unsafe extern "C" fn(*const c_char, usize) -> c_int,
    req_set_args: unsafe extern "C" fn(*const c_char, usize) -> c_int,
    req_args: unsafe extern "C" fn(*mut *const PierPair) -> c_int,
    req_header: unsafe extern "C" fn(*const c_char, usize, *mut c_char, usize) -> c_int,
    req_headers: unsafe extern "C" fn(*mut *const PierPair) -> c_int,
    req_set_header:
        unsafe extern "C" fn(*const c_char, usize, *const c_char, usize, c_int) -> c_int,
    var: unsafe extern "C" fn(*const c_char, usize, *mut c_char, usize) -> c_int,
    // response
    resp_status: unsafe extern "C" fn() -> c_int,
    resp_set_status: unsafe extern "C" fn(c_int) -> c_int,
    resp_header: unsafe extern "C" fn(*const c_char, usize, *mut c_char, usize) -> c_int,
    resp_headers: unsafe extern "C" fn(*mut *const PierPair) -> c_int,
    resp_set_header:
        unsafe extern "C" fn(*const c_char, usize, *const c_char, usize, c_int) -> c_int,
    // per-request state and flow
    ctx_ref: unsafe extern "C" fn() -> c_int,
    ctx_new_ref: unsafe extern "C" fn() -> c_int,
    exit: unsafe extern "C" fn(c_int, *const c_char, usize, c_int) -> c_int,
    redirect: unsafe extern "C" fn(*const c_char, usize, c_int) -> c_int,
    say: unsafe extern "C" fn(*const c_char, usize) -> c_int,
    body_chunk: unsafe extern "C" fn(OutPtr, OutLen, *mut c_int) -> c_int,
    body_set_chunk: unsafe extern "C" fn(*const c_char, usize) -> c_int,
    balancer_set_peer: unsafe extern "C" fn(*const c_char, usize, c_int) -> c_int,
    balancer_set_retries: unsafe extern "C" fn(c_int) -> c_int,
    balancer_last_failure: unsafe extern "C" fn(*mut c_int) -> c_int,
    // shared dicts
    shdict_index: unsafe extern "C" fn(*const c_char, usize) -> c_int,
    shdict_get: unsafe extern "C" fn(
        c_int,
        *const c_char,
        usize,
        c_int,
        *mut c_char,
        usize,
        *mut c_int,
        *mut f64,
        *mut u32,
    ) -> c_int,
    shdict_store: unsafe extern "C" fn(
        c_int,
        c_int,
        *const c_char,
        usize,
        c_int,
        *const c_char,
        usize,
        f64,
        f64,
        u32,
    ) -> c_int,
    shdict_incr:
        unsafe extern "C" fn(c_int, *const c_char, usize, f64, f64, c_int, f64, *mut f64) -> c_int,
    shdict_delete: unsafe extern "C" fn(c_int, *const c_char, usize) -> c_int,
    shdict_ttl: unsafe extern "C" fn(c_int, *const c_char, usize, *mut f64) -> c_int,
    shdict_expire: unsafe extern "C" fn(c_int, *const c_char, usize, f64) -> c_int,
    shdict_flush_all: unsafe extern "C" fn(c_int) -> c_int,
    shdict_flush_expired: unsafe extern "C" fn(c_int, c_int) -> c_int,
    shdict_keys: unsafe extern "C" fn(c_int, c_int, *mut *const PierPair) -> c_int,
    shdict_capacity: unsafe extern "C" fn(c_int, *mut f64, *mut f64) -> c_int,
    hook_done: unsafe extern "C" fn() -> c_int,
    // pier.limit: count-min sketch counters shared by all threads
    limit_incr: unsafe extern "C" fn(*const c_char, usize, f64) -> f64,
    limit_rate: unsafe extern "C" fn(*const c_char, usize) -> f64,
    // shared dict lists
    shdict_push: unsafe extern "C" fn(
        c_int,
        c_int,
        *const c_char,
        usize,
        c_int,
        *const c_char,
        usize,
        f64,
    ) -> c_int,
    shdict_pop:
        unsafe extern "C" fn(c_int, c_int, *const c_char, usize, OutPtr, OutLen, *mut f64) -> c_int,
    shdict_llen: unsafe extern "C" fn(c_int, *const c_char, usize) -> c_int,
    // pier.analytics.field (log phase)
    analytics_field: unsafe extern "C" fn(*const c_char, usize, *const c_char, usize) -> c_int,
    // pier.cache (access, header_filter)
    cache_set: unsafe extern "C" fn(c_int, *const c_char, usize, f64) -> c_int,
    trace_add: unsafe extern "C" fn(
        c_int,
        *const c_char,
        usize,
        c_int,
        *const c_char,
        usize,
        f64,
    ) -> c_int,
    // pier.cache.purge (any phase, timers)
    cache_purge: unsafe extern "C" fn(
        c_int,
        *const c_char,
        usize,
        *const c_char,
        usize,
        OutPtr,
        OutLen,
    ) -> f64,
}

/// The one API table; its address is what Lua casts.
static API: PierApi = PierApi {
    phase: ctx::phase,
    phase_allowed: ctx::phase_allowed,
    now: ctx::now,
    log: ctx::log,
    req_method: req::method,
    req_uri: req::uri,
    req_path: req::path,
    req_set_path: req::set_path,
    req_set_args: req::set_args,
    req_args: req::args,
    req_header: req::header,
    req_headers: req::headers,
    req_set_header: req::set_header,
    var: req::var,
    resp_status: resp::status,
    resp_set_status: resp::set_status,
    resp_header: resp::header,
    resp_headers: resp::headers,
    resp_set_header: resp::set_header,
    ctx_ref: ctx::ctx_ref,
    ctx_new_ref: ctx::ctx_new_ref,
    exit: ctx::exit,
    redirect: ctx::redirect,
    say: ctx::say,
    body_chunk: ctx::body_chunk,
    body_set_chunk: ctx::body_set_chunk,
    balancer_set_peer: ctx::balancer_set_peer,
    balancer_set_retries: ctx::balancer_set_retries,
    balancer_last_failure: ctx::balancer_last_failure,
    shdict_index: shdict::index,
    shdict_get: shdict::get,
    shdict_store: shdict::store,
    shdict_incr: shdict::incr,
    shdict_delete: shdict::delete,
    shdict_ttl: shdict::ttl,
    shdict_expire: shdict::expire,
    shdict_flush_all: shdict::flush_all,
    shdict_flush_expired: shdict::flush_expired,
    shdict_keys: shdict::keys,
    shdict_capacity: shdict::capacity,
    hook_done: ctx::hook_done,
    limit_incr: limit::incr,
    limit_rate: limit::rate,
    shdict_push: shdict::push,
    shdict_pop: shdict::pop,
    shdict_llen: shdict::llen,
    analytics_field: ctx::analytics_field,
    cache_set: cache::set,
    trace_add: ctx::trace_add,
    cache_purge: cache::purge,
};

/// The address Lua casts to `const pier_api_t*` (fits a double: user-space
/// addresses are below 2^47). A plain number: calling through it takes
/// `unsafe` code (or LuaJIT's FFI).
pub(crate) fn api_addr() -> usize {
    &API as *const PierApi as usize
}

// === helpers shared by the ffi modules ===

/// Runs `f`, turning a panic into [`E_INTERNAL`] so nothing unwinds into Lua.
#[inline(always)]
pub(crate) fn guard(f: impl FnOnce() -> c_int) -> c_int {
    catch_unwind(AssertUnwindSafe(f)).unwrap_or(E_INTERNAL)
}

/// The `traceparent` a hook's `pier.http` request carries: its request's
/// context (the server span as the parent), if the request has one.
pub(crate) fn trace_header() -> Option<[u8; 55]> {
    let mut out = None;
    with_view(crate::phase::mask::REQ_READ, |v, _| {
        out = v.trace_child();
        0
    });
    out
}

/// Runs `f` on the current request if the phase is in `mask`.
#[inline(always)]
pub(crate) fn with_view(mask: u32, f: impl FnOnce(&mut dyn HttpView, &Current) -> c_int) -> c_int {
    let cur = current::get();
    if !cur.allows(mask) {
        return E_PHASE;
    }
    let Some(mut view) = cur.view else {
        return E_PHASE;
    };
    // SAFETY: the view pointer is only published (by a `current::Scope`)
    // while the `&mut dyn HttpView` it came from is borrowed by the running
    // hook call, and nothing else touches the view during this FFI call.
    guard(|| f(unsafe { view.as_mut() }, &cur))
}

/// The bytes of a `(ptr, len)` argument from Lua.
///
/// # Safety
/// `p` is NULL or valid for reads of `n` bytes, unchanged while the slice
/// lives (a Lua string or cdata buffer passed to the running call).
#[inline(always)]
pub(crate) unsafe fn arg<'a>(p: *const c_char, n: usize) -> &'a [u8] {
    if p.is_null() || n == 0 {
        return &[];
    }
    // SAFETY: the caller's contract (above).
    unsafe { std::slice::from_raw_parts(p.cast::<u8>(), n) }
}

/// Writes a string result to the out-parameters.
///
/// # Safety
/// `p` and `n` are NULL or valid for writes (the wrappers pass `ffi.new`
/// one-element arrays).
#[inline(always)]
pub(crate) unsafe fn out(s: &[u8], p: OutPtr, n: OutLen) {
    if p.is_null() || n.is_null() {
        return;
    }
    // SAFETY: non-NULL (checked above) and writable (the caller's contract).
    unsafe {
        *p = s.as_ptr().cast();
        *n = s.len();
    }
}

/// Copies a string result into the caller's buffer `(buf, cap)` if it fits
/// and returns its length either way (the wrapper grows its buffer and
/// calls again when the length exceeds `cap`). Used by the hottest getters:
/// copying a header value is cheaper than handing Lua a pointer and a
/// boxed 64-bit length, which costs two cdata allocations per call when the
/// code runs in the interpreter.
///
/// # Safety
/// `buf` is NULL or valid for writes of `cap` bytes and does not overlap `s`.
#[inline(always)]
pub(crate) unsafe fn copy_out(s: &[u8], buf: *mut c_char, cap: usize) -> c_int {
    if s.len() <= cap && !buf.is_null() {
        // SAFETY: `buf` is writable for `cap >= s.len()` bytes and disjoint
        // from `s` (the caller's contract).
        unsafe { std::ptr::copy_nonoverlapping(s.as_ptr(), buf.cast::<u8>(), s.len()) };
    }
    c_int::try_from(s.len()).unwrap_or(E_INVAL)
}

/// Writes a value to an out-parameter if it is not NULL.
///
/// # Safety
/// `p` is NULL or valid for writes of a `T`.
#[inline(always)]
pub(crate) unsafe fn put<T>(p: *mut T, v: T) {
    if !p.is_null() {
        // SAFETY: non-NULL and writable (the caller's contract).
        unsafe { *p = v }
    }
}

/// Per-thread buffers for results that are not slices of the request:
/// `bytes` holds copied/lowercased/decoded text, `pairs` the bulk results.
#[derive(Default)]
pub(crate) struct Scratch {
    pub bytes: Vec<u8>,
    pub spans: Vec<(usize, usize, usize, isize)>,
    pub pairs: Vec<PierPair>,
}

thread_local! {
    pub(crate) static SCRATCH: RefCell<Scratch> = RefCell::new(Scratch::default());
}

impl Scratch {
    /// Turns `spans` (offsets into `bytes`) into `pairs` and publishes them.
    ///
    /// # Safety
    /// `outp` is NULL or valid for writes of a pointer.
    pub(crate) unsafe fn publish(&mut self, outp: *mut *const PierPair) -> c_int {
        self.pairs.clear();
        let base = self.bytes.as_ptr();
        for &(k, kl, v, vl) in &self.spans {
            // SAFETY (pointer arithmetic): offsets were taken from `bytes`
            // while filling it and `bytes` is not modified afterwards.
            self.pairs.push(PierPair {
                k: base.wrapping_add(k).cast(),
                klen: kl,
                v: base.wrapping_add(v).cast(),
                vlen: vl,
            });
        }
        // SAFETY: the caller's contract (above).
        unsafe { put(outp, self.pairs.as_ptr()) };
        c_int::try_from(self.pairs.len()).unwrap_or(c_int::MAX)
    }
}

/// A header name: an HTTP token.
pub(crate) fn valid_name(name: &[u8]) -> bool {
    !name.is_empty()
        && name
            .iter()
            .all(|&c| c.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&c))
}

/// A header value: no CR, LF or NUL (header injection).
pub(crate) fn valid_value(v: &[u8]) -> bool {
    !v.iter().any(|&c| c == b'\r' || c == b'\n' || c == 0)
}
