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

/// What `pier.cache.purge` does: (zone or every zone, kind, value) to the
/// objects removed, or why nothing was. Set by the binary, which holds the
/// running config and the fleet (`pier_proxy::purge::apply`, then the
/// fleet's publish queue): the Lua crate knows neither.
pub type Purger = Box<dyn Fn(Option<&str>, &str, &str) -> Result<usize, String> + Send + Sync>;

static PURGER: std::sync::OnceLock<Purger> = std::sync::OnceLock::new();

/// Installs the purger (once per process; later calls are ignored).
pub fn set_purger(p: Purger) {
    let _ = PURGER.set(p);
}

thread_local! {
    /// The last refusal's reason, read by the Lua wrapper at once.
    static PURGE_ERR: std::cell::RefCell<String> = const { std::cell::RefCell::new(String::new()) };
}

/// `pier.cache.purge(kind, value[, zone])`: `kind` 0 url, 1 prefix, 2 tag,
/// 3 key, 4 ban. The objects removed, or -1 with the reason in `(errp,
/// errl)` (valid until the next call on this thread).
pub(super) unsafe extern "C" fn purge(
    kind: c_int,
    p: *const c_char,
    n: usize,
    zp: *const c_char,
    zn: usize,
    errp: super::OutPtr,
    errl: super::OutLen,
) -> f64 {
    // SAFETY: `(ptr, len)` arguments from Lua are valid for the call (ffi contract).
    let (v, z) = unsafe { (arg(p, n), arg(zp, zn)) };
    let what = match kind {
        0 => "url",
        1 => "prefix",
        2 => "tag",
        3 => "key",
        4 => "ban",
        _ => "",
    };
    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        let (Ok(v), Ok(z)) = (std::str::from_utf8(v), std::str::from_utf8(z)) else {
            return Err("value and zone must be UTF-8".to_string());
        };
        if what.is_empty() {
            return Err("kind: url, prefix, tag, key or ban".to_string());
        }
        let Some(f) = PURGER.get() else {
            return Err("no cache to purge in this process".to_string());
        };
        f((!z.is_empty()).then_some(z), what, v)
    }))
    .unwrap_or_else(|_| Err("purge failed".to_string()));
    match r {
        Ok(n) => n as f64,
        Err(e) => PURGE_ERR.with(|b| {
            let mut b = b.borrow_mut();
            *b = e;
            // SAFETY: out-pointers from Lua are NULL or writable (ffi
            // contract); the string lives in this thread's buffer until the
            // next call, and the wrapper copies it at once.
            unsafe { super::out(b.as_bytes(), errp, errl) };
            -1.0
        }),
    }
}
