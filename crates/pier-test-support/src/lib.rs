//! Test support for Pier's end-to-end tests (dev-dependency only).
//!
//! - [`Origin`]: a real HTTP/1.1 origin on `127.0.0.1:0`, handwritten on raw sockets so
//!   it can misbehave on purpose (die mid-body, trickle, stall, echo the head it got).
//! - [`RawConn`], [`get`], [`curl`]: clients that show exactly what came over the wire.
//! - [`PierProcess`]: runs the `pier` binary on a config and waits for its ready file.
//! - [`Script`]: an origin whose answers a test writes as a function of the request.
//! - [`Scenario`]: origin, config, requests and expectations in a few lines
//!   (docs/testing.md).
//!
//! Every wait here is bounded; every address is on port 0.
#![forbid(unsafe_code)]

pub mod browser;
mod client;
mod config;
mod h3client;
mod origin;
pub mod ports;
mod process;
mod scenario;
mod script;
pub mod tls;
pub mod ws;

/// For tests that encode or decode base64 (gRPC-web text) without a dependency of their own.
pub use base64;
/// For tests that parse JSON (access logs) without a dependency of their own.
pub use serde_json;

pub use client::{curl, get, run_with_timeout, try_get, BodySink, RawConn, Response};
pub use config::{base_config, hook, lua_route, route_config, servers, simple_config};
pub use h3client::H3Conn;
pub use origin::Origin;
pub use ports::free_port;
pub use process::{parse_metric_line, rss_kib, MetricSample, PierProcess, TempDir};
pub use scenario::{Conn, Exchange, Proto, Running, Scenario};
pub use script::{Gate, RawReply, Reply, Request, Script};

/// Signal numbers for [`PierProcess::signal`], so tests need no `libc` of their own.
pub mod sig {
    pub use libc::{SIGHUP, SIGINT, SIGKILL, SIGTERM};
}

/// Polls `cond` every 20 ms until it holds or `timeout` passes; says whether it held.
pub fn wait_until(timeout: std::time::Duration, mut cond: impl FnMut() -> bool) -> bool {
    let deadline = std::time::Instant::now() + timeout;
    loop {
        if cond() {
            return true;
        }
        if std::time::Instant::now() >= deadline {
            return false;
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
}

/// The deterministic byte at `offset` of every pattern body (`/bytes/N`, `/chunked/N`).
/// 251 is prime so the pattern does not line up with power-of-two buffer sizes.
#[inline]
pub fn pattern_byte(offset: u64) -> u8 {
    (offset % 251) as u8
}

/// `len` pattern bytes starting at `offset`.
pub fn pattern(offset: u64, len: usize) -> Vec<u8> {
    (0..len as u64).map(|i| pattern_byte(offset + i)).collect()
}

/// Whether `data` equals the pattern starting at `offset`.
pub fn is_pattern(offset: u64, data: &[u8]) -> bool {
    data.iter()
        .enumerate()
        .all(|(i, &b)| b == pattern_byte(offset + i as u64))
}

#[cfg(test)]
mod tests {
    #[test]
    fn pattern_is_consistent() {
        let p = super::pattern(1000, 600);
        assert!(super::is_pattern(1000, &p));
        assert!(!super::is_pattern(1001, &p));
    }
}
