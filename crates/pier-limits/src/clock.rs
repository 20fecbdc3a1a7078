//! A process-wide monotonic clock in integer milliseconds.
//!
//! Limits take the caller's per-request clock snapshot (`*_at(.., now_ms)`);
//! this is the base the convenience methods use when the caller has none.

use std::sync::OnceLock;
use std::time::Instant;

static BASE: OnceLock<Instant> = OnceLock::new();

/// Milliseconds since the first call in this process (monotonic).
#[inline]
pub fn now_ms() -> u64 {
    let base = *BASE.get_or_init(Instant::now);
    base.elapsed().as_millis() as u64
}

#[cfg(test)]
mod tests {
    #[test]
    fn monotonic() {
        let a = super::now_ms();
        std::thread::sleep(std::time::Duration::from_millis(3));
        let b = super::now_ms();
        assert!(b >= a + 3, "{a} -> {b}");
    }
}
