//! Bounds on what Lua can make Rust do: durations given as Lua numbers, and
//! the memory and sockets a hook can make Rust hold.

use std::time::Duration;

/// The longest duration accepted from Lua anywhere (`pier.sleep`, timers,
/// cosocket and `pier.http` timeouts, keep-alive idle times, shared dict
/// TTLs): one year. Longer values are rejected, not clamped, so a typo (ms
/// given as seconds, `1e20`) is an error the operator sees.
pub const MAX_DURATION_SECS: f64 = 365.0 * 24.0 * 3600.0;

/// A duration Lua gave that is NaN, infinite, negative or above
/// [`MAX_DURATION_SECS`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct InvalidDuration(pub f64);

impl std::fmt::Display for InvalidDuration {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "invalid duration {} (must be a number of seconds from 0 to {MAX_DURATION_SECS})",
            self.0
        )
    }
}

/// The one conversion of a Lua number of seconds to a [`Duration`]: never
/// panics (`Duration::from_secs_f64` does on overflow, NaN and negatives).
pub(crate) fn duration_from_secs(secs: f64) -> Result<Duration, InvalidDuration> {
    // NaN is in no range.
    if !(0.0..=MAX_DURATION_SECS).contains(&secs) {
        return Err(InvalidDuration(secs));
    }
    Ok(Duration::from_secs_f64(secs))
}

/// [`duration_from_secs`] for APIs that take milliseconds (cosockets,
/// `pier.http`); the error shows the value as given.
pub(crate) fn duration_from_ms(ms: f64) -> Result<Duration, InvalidDuration> {
    // Whole milliseconds (what clients pass, often on every request:
    // lua-resty-redis sets its timeouts per connect) skip the float
    // division and `from_secs_f64` (about 200 instructions a call).
    if (0.0..=MAX_DURATION_SECS * 1000.0).contains(&ms) && ms.fract() == 0.0 {
        return Ok(Duration::from_millis(ms as u64));
    }
    duration_from_secs(ms / 1000.0).map_err(|_| InvalidDuration(ms))
}

/// [`duration_from_secs`] as a Lua error naming the API and argument.
pub(crate) fn lua_secs(secs: f64, what: &str) -> mlua::Result<Duration> {
    duration_from_secs(secs).map_err(|e| mlua::Error::runtime(format!("{what}: {e}")))
}

/// [`duration_from_ms`] as a Lua error naming the API and argument.
pub(crate) fn lua_ms(ms: f64, what: &str) -> mlua::Result<Duration> {
    duration_from_ms(ms).map_err(|_| {
        mlua::Error::runtime(format!(
            "{what}: invalid duration {ms} ms (must be from 0 to {} ms)",
            MAX_DURATION_SECS * 1000.0
        ))
    })
}

/// Seconds (Lua) to whole milliseconds, a positive sub-ms value rounded up
/// (shared dict TTLs).
pub(crate) fn secs_to_ms(secs: f64) -> Result<u64, InvalidDuration> {
    let d = duration_from_secs(secs)?;
    let ms = d.as_nanos().div_ceil(1_000_000);
    Ok(u64::try_from(ms).unwrap_or(u64::MAX))
}

/// Per-engine bounds (`[lua]` keys of the config; see docs/config.md).
/// Exceeding one raises a Lua error in the hook.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LuaLimits {
    /// Bytes a hook may buffer as a local response body (`pier.say`,
    /// `pier.print`, `pier.exit`'s body). `max_response_body` in `[lua]`.
    pub max_response_body: usize,
    /// Bytes a cosocket may buffer while receiving (a `*l` line, a
    /// `receiveuntil` chunk, `*a`, a byte count). `socket_buffer` in `[lua]`.
    pub socket_buffer: usize,
    /// Bytes of a `pier.http` response body. `http_max_body` in `[lua]`.
    pub http_max_body: usize,
    /// Cosockets one request (or one timer run) may hold at once.
    /// `max_sockets_per_request` in `[lua]`.
    pub max_sockets_per_request: usize,
    /// Cosockets alive at once on one worker thread.
    /// `max_sockets_per_worker` in `[lua]`.
    pub max_sockets_per_worker: usize,
    /// Longest a cosocket connect waits for a connection of its pool to be
    /// given back when none is idle and the pool has as many in use as it
    /// keeps (a connection opened then would be closed by a later
    /// `setkeepalive`). Zero: open at once, as ngx_lua. `socket_pool_wait`
    /// in `[lua]`.
    pub socket_pool_wait: Duration,
}

impl LuaLimits {
    pub const DEFAULT: LuaLimits = LuaLimits {
        max_response_body: 16 << 20,
        socket_buffer: 16 << 20,
        http_max_body: 16 << 20,
        max_sockets_per_request: 64,
        max_sockets_per_worker: 16384,
        socket_pool_wait: Duration::from_millis(30),
    };
}

impl Default for LuaLimits {
    fn default() -> Self {
        Self::DEFAULT
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations() {
        for bad in [
            -1.0,
            -0.001,
            f64::NAN,
            f64::INFINITY,
            f64::NEG_INFINITY,
            1e20,
            MAX_DURATION_SECS + 1.0,
        ] {
            assert!(duration_from_secs(bad).is_err(), "{bad}");
            assert!(secs_to_ms(bad).is_err(), "{bad}");
        }
        assert!(duration_from_ms(1e20).is_err());
        assert_eq!(duration_from_secs(0.0), Ok(Duration::ZERO));
        assert_eq!(duration_from_secs(1.5), Ok(Duration::from_millis(1500)));
        assert_eq!(duration_from_ms(250.0), Ok(Duration::from_millis(250)));
        assert_eq!(duration_from_ms(100.0), Ok(Duration::from_millis(100)));
        assert_eq!(duration_from_ms(0.5), Ok(Duration::from_micros(500)));
        assert_eq!(duration_from_ms(-0.0), Ok(Duration::ZERO));
        assert!(duration_from_ms(-1.0).is_err());
        assert!(duration_from_ms(f64::NAN).is_err());
        assert!(duration_from_ms(MAX_DURATION_SECS * 1000.0).is_ok());
        assert!(duration_from_ms(MAX_DURATION_SECS * 1000.0 + 1.0).is_err());
        assert!(duration_from_secs(MAX_DURATION_SECS).is_ok());
        assert_eq!(secs_to_ms(0.0001), Ok(1));
        assert_eq!(secs_to_ms(2.0), Ok(2000));
    }
}
