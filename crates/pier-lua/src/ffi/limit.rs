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

fn key<'a>(k: *const c_char, klen: usize) -> Option<&'a [u8]> {
    if k.is_null() {
        return None;
    }
    // SAFETY: Lua passes a string's pointer and length; the string is alive
    // for the duration of this call and we don't keep the slice.
    Some(unsafe { std::slice::from_raw_parts(k.cast::<u8>(), klen) })
}

/// `pier.limit.incr(key, n)`: add `n` events; returns the key's count in
/// the current window (never less than the true count), or -1 on error.
pub(super) extern "C" fn incr(k: *const c_char, klen: usize, n: f64) -> f64 {
    let Some(key) = key(k, klen) else { return -1.0 };
    catch_unwind(AssertUnwindSafe(|| {
        counters().observe(key, n as isize) as f64
    }))
    .unwrap_or(-1.0)
}

/// `pier.limit.rate(key)`: events per second, sliding over two windows.
pub(super) extern "C" fn rate(k: *const c_char, klen: usize) -> f64 {
    let Some(key) = key(k, klen) else { return -1.0 };
    catch_unwind(AssertUnwindSafe(|| counters().rate(key))).unwrap_or(-1.0)
}
