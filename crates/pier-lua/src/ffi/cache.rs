//! `pier.cache.*`: this request's cache controls (docs/cache.md). Values
//! are checked here, before the proxy sees them: a key of 1 to 4096 bytes
//! without CR, LF or NUL; a TTL that is a number of seconds from 0 to a
//! year (NaN, infinities and negatives refused).

use std::os::raw::{c_char, c_int};

use super::{arg, valid_value, with_view, E_DURATION, E_INVAL, E_PHASE};
use crate::phase::mask;
use crate::view::CacheOp;
use crate::MAX_DURATION_SECS;

/// Longest key a hook may set.
const MAX_KEY: usize = 4096;

/// `op`: 0 bypass, 1 set the key (`p`, `n`), 2 set the TTL (`num`
/// seconds), 3 cacheable (`num` != 0).
pub(super) unsafe extern "C" fn set(op: c_int, p: *const c_char, n: usize, num: f64) -> c_int {
    // SAFETY: `(ptr, len)` arguments from Lua are valid for the call (ffi contract).
    let key = unsafe { arg(p, n) };
    let (m, op) = match op {
        0 => (mask::CACHE_REQ, CacheOp::Bypass),
        1 => {
            if key.is_empty() || key.len() > MAX_KEY || !valid_value(key) {
                return E_INVAL;
            }
            (mask::CACHE_REQ, CacheOp::Key(key))
        }
        2 => {
            // `contains` is false for NaN.
            if !(0.0..=MAX_DURATION_SECS).contains(&num) {
                return E_DURATION;
            }
            // A fraction of a second still stores: rounded up.
            (mask::CACHE_TTL, CacheOp::Ttl(num.ceil() as u64))
        }
        3 => (mask::CACHE_RESP, CacheOp::Cacheable(num != 0.0)),
        _ => return E_INVAL,
    };
    with_view(m, |v, _| if v.cache(op) { 0 } else { E_PHASE })
}
