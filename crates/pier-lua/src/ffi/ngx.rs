//! The few `extern "C"` functions the `ngx` layer (`lua/pier/ngx.lua`)
//! needs beyond `pier.*`: the wall clock (`ngx.now` advances during a hook,
//! as nginx's cached time does between events, while `pier.now` is the
//! request's start), `ngx.req.set_method`, and the worker's identity.
//!
//! A table of its own, like [`super::PierApi`] (same conventions and
//! safety contract), so the `ngx` layer does not reorder the `pier` one.

use std::cell::Cell;
use std::os::raw::{c_char, c_int};

use super::{arg, valid_name, with_view, E_INVAL};
use crate::phase::mask;

#[repr(C)]
pub(crate) struct NgxApi {
    wall_now: unsafe extern "C" fn() -> f64,
    req_set_method: unsafe extern "C" fn(*const c_char, usize) -> c_int,
    worker_id: unsafe extern "C" fn() -> c_int,
    worker_count: unsafe extern "C" fn() -> c_int,
}

static NGX_API: NgxApi = NgxApi {
    wall_now,
    req_set_method,
    worker_id,
    worker_count,
};

/// The address Lua casts to `const pier_ngx_api_t*`.
pub(crate) fn ngx_api_addr() -> usize {
    &NGX_API as *const NgxApi as usize
}

thread_local! {
    /// `(id, count)` of the worker this thread is (see [`crate::set_worker`]).
    static WORKER: Cell<(i32, i32)> = const { Cell::new((0, 1)) };
}

/// Records which worker this thread is, for `ngx.worker.id()`/`count()`.
pub(crate) fn set_worker(id: usize, count: usize) {
    let id = i32::try_from(id).unwrap_or(i32::MAX);
    let count = i32::try_from(count.max(1)).unwrap_or(i32::MAX);
    WORKER.with(|w| w.set((id, count)));
}

/// Seconds since the epoch with millisecond precision (as `ngx.now`).
unsafe extern "C" fn wall_now() -> f64 {
    (super::ctx::wall_ns() / 1_000_000) as f64 / 1000.0
}

/// `ngx.req.set_method`: the method name (an HTTP token) for the request
/// sent upstream.
unsafe extern "C" fn req_set_method(p: *const c_char, n: usize) -> c_int {
    // SAFETY: `(ptr, len)` arguments from Lua are valid for the call (ffi contract).
    let m = unsafe { arg(p, n) };
    if !valid_name(m) || m.len() > 32 {
        return E_INVAL;
    }
    with_view(
        mask::REQ_WRITE,
        |v, _| {
            if v.set_method(m) {
                0
            } else {
                E_INVAL
            }
        },
    )
}

unsafe extern "C" fn worker_id() -> c_int {
    WORKER.with(|w| w.get().0)
}

unsafe extern "C" fn worker_count() -> c_int {
    WORKER.with(|w| w.get().1)
}
