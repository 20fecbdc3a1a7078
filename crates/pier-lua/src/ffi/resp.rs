//! `pier.resp.*`.

use std::os::raw::{c_char, c_int};

use super::req::{apply_header, collect_headers};
use super::{arg, copy_out, with_view, PierPair, E_INVAL};
use crate::phase::mask;
use crate::view::HttpView;

pub(super) unsafe extern "C" fn status() -> c_int {
    with_view(mask::RESP_READ, |v, _| c_int::from(v.status()))
}

pub(super) unsafe extern "C" fn set_status(status: c_int) -> c_int {
    if !(100..=999).contains(&status) {
        return E_INVAL;
    }
    with_view(mask::RESP_WRITE, |v, cur| {
        v.set_status(status as u16);
        if let (Some(mut ctx), Some(crate::Phase::Access | crate::Phase::Content)) =
            (cur.ctx, cur.phase)
        {
            // SAFETY: published with the view, for the duration of the hook call.
            unsafe { ctx.as_mut() }.status = Some(status as u16);
        }
        0
    })
}

/// The first value of response header `name` copied to `buf` (see `copy_out`), or -1.
pub(super) unsafe extern "C" fn header(
    name: *const c_char,
    nlen: usize,
    buf: *mut c_char,
    cap: usize,
) -> c_int {
    // SAFETY: `(ptr, len)` arguments from Lua are valid for the call (ffi contract).
    let name = unsafe { arg(name, nlen) };
    with_view(mask::RESP_READ, |v, _| match v.resp_header(name) {
        // SAFETY: out-pointers from Lua are NULL or writable (ffi contract).
        Some(val) => unsafe { copy_out(val, buf, cap) },
        None => -1,
    })
}

pub(super) unsafe extern "C" fn headers(outp: *mut *const PierPair) -> c_int {
    with_view(mask::RESP_READ, |v, _| {
        // SAFETY: out-pointers from Lua are NULL or writable (ffi contract).
        unsafe { collect_headers(|f| v.resp_headers(f), outp) }
    })
}

pub(super) unsafe extern "C" fn set_header(
    name: *const c_char,
    nlen: usize,
    val: *const c_char,
    vlen: usize,
    mode: c_int,
) -> c_int {
    // SAFETY: `(ptr, len)` arguments from Lua are valid for the call (ffi contract).
    let (name, val) = unsafe { (arg(name, nlen), arg(val, vlen)) };
    with_view(mask::RESP_WRITE, |v, _| {
        let vp: *mut dyn HttpView = v;
        apply_header(
            name,
            val,
            mode,
            // SAFETY: only one of the two closures runs, once, while `v` is unused.
            |k, x| unsafe { (*vp).set_resp_header(k, x) },
            // SAFETY: as above.
            |k, x| unsafe { (*vp).add_resp_header(k, x) },
        )
    })
}
