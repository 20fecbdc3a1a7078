//! `pier.limit`: rate counters for Lua on the same lock-free count-min
//! sketch as `[[limit]]` rules (pier-limits), shared by every worker thread
//! and costing fixed memory whatever the number of keys.

use pier_limits::Rate;
use std::ffi::c_char;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::OnceLock;
use std::time::Duration;

/// One-second windows, sliding: `incr` returns the events counted for the
/// key in the current window, `rate` the sliding per-second estimate.
fn counters() -> &'static Rate {
    static RATE: OnceLock<Rate> = OnceLock::new();
    RATE.get_or_init(|| Rate::new(Duration::from_secs(1)))
}

/// The largest `n` one `pier.limit.incr` call may add.
const MAX_INCR: f64 = 1e9;

/// # Safety
/// `k` is NULL or valid for reads of `klen` bytes while the slice lives.
unsafe fn key<'a>(k: *const c_char, klen: usize) -> Option<&'a [u8]> {
    if k.is_null() {
        return None;
    }
    // SAFETY: the caller's contract (a Lua string alive for the call; the
    // slice is not kept).
    Some(unsafe { super::arg(k, klen) })
}

/// `pier.limit.incr(key, n)`: add `n` events; returns the key's count in
/// the current window (never less than the true count), or -1 on error.
pub(super) unsafe extern "C" fn incr(k: *const c_char, klen: usize, n: f64) -> f64 {
    // SAFETY: `(ptr, len)` arguments from Lua are valid for the call (ffi contract).
    let Some(key) = (unsafe { key(k, klen) }) else {
        return -1.0;
    };
    // A count from Lua: a whole number of events, bounded (no saturating
    // float-to-int cast of NaN or 1e20 reaches the counters).
    if !(0.0..=MAX_INCR).contains(&n) || n.fract() != 0.0 {
        return -1.0;
    }
    catch_unwind(AssertUnwindSafe(|| {
        counters().observe(key, n as isize) as f64
    }))
    .unwrap_or(-1.0)
}

/// `pier.limit.rate(key)`: events per second, sliding over two windows.
pub(super) unsafe extern "C" fn rate(k: *const c_char, klen: usize) -> f64 {
    // SAFETY: `(ptr, len)` arguments from Lua are valid for the call (ffi contract).
    let Some(key) = (unsafe { key(k, klen) }) else {
        return -1.0;
    };
    catch_unwind(AssertUnwindSafe(|| counters().rate(key))).unwrap_or(-1.0)
}
