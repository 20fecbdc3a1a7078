//! `pier.resp.*`.

use std::os::raw::{c_char, c_int};

use super::req::{apply_header, collect_headers};
use super::{arg, copy_out, with_view, PierPair, E_INVAL};
use crate::phase::mask;
use crate::view::HttpView;

pub(super) extern "C" fn status() -> c_int {
    with_view(mask::RESP_READ, |v, _| c_int::from(v.status()))
}

pub(super) extern "C" fn set_status(status: c_int) -> c_int {
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
pub(super) extern "C" fn header(
    name: *const c_char,
    nlen: usize,
    buf: *mut c_char,
    cap: usize,
) -> c_int {
    let name = arg(name, nlen);
    with_view(mask::RESP_READ, |v, _| match v.resp_header(name) {
        Some(val) => copy_out(val, buf, cap),
        None => -1,
    })
}

pub(super) extern "C" fn headers(outp: *mut *const PierPair) -> c_int {
    with_view(mask::RESP_READ, |v, _| {
        collect_headers(|f| v.resp_headers(f), outp)
    })
}

pub(super) extern "C" fn set_header(
    name: *const c_char,
    nlen: usize,
    val: *const c_char,
    vlen: usize,
    mode: c_int,
) -> c_int {
    let (name, val) = (arg(name, nlen), arg(val, vlen));
    with_view(mask::RESP_WRITE, |v, _| {
        let vp: *mut dyn HttpView = v;
        apply_header(
            name,
            val,
            mode,
            // SAFETY: only one of the two closures runs, once, while `v` is unused.
            |k, x| unsafe { (*vp).set_resp_header(k, x) },
            |k, x| unsafe { (*vp).add_resp_header(k, x) },
        )
    })
}
