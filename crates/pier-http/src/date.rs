//! The `Date` header value, formatted at most once a second per thread.

use std::cell::RefCell;
use std::time::{SystemTime, UNIX_EPOCH};

thread_local! {
    static CACHE: RefCell<(u64, [u8; 29])> = const { RefCell::new((0, [0; 29])) };
}

/// Wall-clock nanoseconds since the epoch (one read per phase; callers keep it).
#[inline]
pub fn now_ns() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0)
}

/// Call `f` with the IMF-fixdate for the second containing `now_ns`.
pub fn with_date<R>(now_ns: u64, f: impl FnOnce(&[u8]) -> R) -> R {
    let sec = now_ns / 1_000_000_000;
    CACHE.with(|c| {
        let mut c = c.borrow_mut();
        if c.0 != sec {
            let s = httpdate::fmt_http_date(UNIX_EPOCH + std::time::Duration::from_secs(sec));
            let b = s.as_bytes();
            if b.len() == 29 {
                c.1.copy_from_slice(b);
            }
            c.0 = sec;
        }
        f(&c.1)
    })
}

#[cfg(test)]
mod tests {
    #[test]
    fn formats_and_caches() {
        let d = super::with_date(784_111_777 * 1_000_000_000, |d| d.to_vec());
        assert_eq!(d, b"Sun, 06 Nov 1994 08:49:37 GMT");
        let n = super::now_ns();
        let a = super::with_date(n, |d| d.to_vec());
        let b = super::with_date(n, |d| d.to_vec());
        assert_eq!(a, b);
    }
}
