//! Distributed tracing for `[tracing]`: the W3C trace context
//! (`traceparent`, RFC-level "Trace Context" Level 1) of each request,
//! continued from the client's or started here, sampled parent-based with a
//! root ratio, and sent on to every upstream attempt with that attempt's
//! own span id; sampled requests become OpenTelemetry spans (a server span,
//! a client span per attempt) exported over OTLP/HTTP ([`export`]).
//!
//! Written here rather than with the opentelemetry crates: a request's
//! context is three integers and a flag that live in its session, spans
//! are built only for sampled requests, and the exporter is one thread
//! with a bounded queue; the crates' context propagation and span
//! machinery (a `Context` map, boxed attributes, a batch processor task)
//! cost per request what Pier spends on a whole phase.

pub mod export;
pub mod span;

use std::cell::Cell;

pub use export::{exporter, Exporter};
pub use span::{Event, Span, SpanKind, Value};

/// A request's trace context.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Context {
    pub trace_id: [u8; 16],
    /// The client's span (from its `traceparent`), None for a root.
    pub parent: Option<[u8; 8]>,
    /// This request's server span.
    pub span_id: [u8; 8],
    pub sampled: bool,
}

/// Parse a `traceparent` value (W3C Trace Context §3.2): `None` for
/// anything invalid, which the spec says to treat as absent (a new trace
/// starts). Version `00` is exactly 55 bytes; a later version may carry
/// more after a `-`, read as version 00; `ff` is invalid.
pub fn parse_traceparent(v: &[u8]) -> Option<([u8; 16], [u8; 8], u8)> {
    let v = trim(v);
    if v.len() < 55 || v[2] != b'-' || v[35] != b'-' || v[52] != b'-' {
        return None;
    }
    let version = hex_byte(&v[0..2])?;
    if version == 0xff || (version == 0 && v.len() != 55) || (v.len() > 55 && v[55] != b'-') {
        return None;
    }
    let mut trace = [0u8; 16];
    for (i, b) in trace.iter_mut().enumerate() {
        *b = hex_byte(&v[3 + 2 * i..5 + 2 * i])?;
    }
    let mut parent = [0u8; 8];
    for (i, b) in parent.iter_mut().enumerate() {
        *b = hex_byte(&v[36 + 2 * i..38 + 2 * i])?;
    }
    let flags = hex_byte(&v[53..55])?;
    if trace == [0; 16] || parent == [0; 8] {
        return None;
    }
    Some((trace, parent, flags))
}

fn trim(v: &[u8]) -> &[u8] {
    let s = v
        .iter()
        .position(|b| !b.is_ascii_whitespace())
        .unwrap_or(v.len());
    let e = v
        .iter()
        .rposition(|b| !b.is_ascii_whitespace())
        .map_or(s, |e| e + 1);
    &v[s..e]
}

/// Two lower-case hex digits (the spec allows no upper case).
fn hex_byte(h: &[u8]) -> Option<u8> {
    let d = |c: u8| match c {
        b'0'..=b'9' => Some(c - b'0'),
        b'a'..=b'f' => Some(c - b'a' + 10),
        _ => None,
    };
    Some(d(h[0])? << 4 | d(h[1])?)
}

const HEX: &[u8; 16] = b"0123456789abcdef";

/// Lower-case hex of `b` into `out` (twice its length).
pub fn hex_into(b: &[u8], out: &mut [u8]) {
    for (i, x) in b.iter().enumerate() {
        out[2 * i] = HEX[(x >> 4) as usize];
        out[2 * i + 1] = HEX[(x & 15) as usize];
    }
}

/// `00-<trace>-<span>-<flags>`: what goes upstream, naming `span` (the
/// attempt's client span) as the parent.
pub fn traceparent(trace: &[u8; 16], span: &[u8; 8], sampled: bool) -> [u8; 55] {
    let mut out = *b"00-00000000000000000000000000000000-0000000000000000-00";
    hex_into(trace, &mut out[3..35]);
    hex_into(span, &mut out[36..52]);
    if sampled {
        out[54] = b'1';
    }
    out
}

thread_local! {
    static RNG: Cell<u64> = Cell::new(seed());
}

fn seed() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u64(std::process::id() as u64);
    h.finish() | 1
}

/// A random u64 (wyrand: a multiply and two xors a call; ids need to be
/// unique, not secret).
pub fn random() -> u64 {
    RNG.with(|s| {
        let x = s.get().wrapping_add(0xa076_1d64_78bd_642f);
        s.set(x);
        let t = (x as u128).wrapping_mul((x ^ 0xe703_7ed1_a0b4_28db) as u128);
        (t >> 64) as u64 ^ t as u64
    })
}

/// A span id: 8 random bytes, never all zero.
pub fn span_id() -> [u8; 8] {
    loop {
        let x = random();
        if x != 0 {
            return x.to_be_bytes();
        }
    }
}

fn trace_id() -> [u8; 16] {
    let mut t = [0u8; 16];
    t[..8].copy_from_slice(&random().to_be_bytes());
    t[8..].copy_from_slice(&span_id());
    t
}

/// A root ratio as a threshold on the trace id's last 8 bytes (as
/// OpenTelemetry's TraceIdRatioBased sampler compares them), so every
/// proxy with the same ratio decides alike for one trace.
pub fn threshold(ratio: f64) -> u64 {
    if ratio >= 1.0 {
        u64::MAX
    } else if ratio <= 0.0 {
        0
    } else {
        (ratio * u64::MAX as f64) as u64
    }
}

impl Context {
    /// The request's context: continued from a valid incoming `traceparent`
    /// (sampled as its parent was), or a new root, sampled when its trace id
    /// falls under `root_threshold`.
    pub fn start(incoming: Option<&[u8]>, root_threshold: u64) -> Context {
        if let Some((trace_id, parent, flags)) = incoming.and_then(parse_traceparent) {
            return Context {
                trace_id,
                parent: Some(parent),
                span_id: span_id(),
                sampled: flags & 1 == 1,
            };
        }
        let trace_id = trace_id();
        let low = u64::from_be_bytes(trace_id[8..].try_into().unwrap_or([0; 8]));
        Context {
            trace_id,
            parent: None,
            span_id: span_id(),
            sampled: root_threshold == u64::MAX || low < root_threshold,
        }
    }

    /// The trace id, 32 hex digits (logs, Lua).
    pub fn trace_hex(&self) -> [u8; 32] {
        let mut out = [0u8; 32];
        hex_into(&self.trace_id, &mut out);
        out
    }

    pub fn span_hex(&self) -> [u8; 16] {
        let mut out = [0u8; 16];
        hex_into(&self.span_id, &mut out);
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GOOD: &[u8] = b"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

    #[test]
    fn traceparent_as_the_spec_reads_it() {
        let (t, p, f) = parse_traceparent(GOOD).unwrap();
        assert_eq!(t[0], 0x4b);
        assert_eq!(p, [0x00, 0xf0, 0x67, 0xaa, 0x0b, 0xa9, 0x02, 0xb7]);
        assert_eq!(f, 1);
        assert_eq!(&traceparent(&t, &p, true)[..], GOOD);
        // A later version with more fields is read as 00.
        let mut v = GOOD.to_vec();
        v[1] = b'1';
        v.extend_from_slice(b"-what-comes");
        assert!(parse_traceparent(&v).is_some());
        for bad in [
            &b"00-4BF92F3577B34DA6A3CE929D0E0E4736-00F067AA0BA902B7-01"[..],
            b"ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            b"00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            b"00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
            b"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-x",
            b"00-4bf92f3577b34da6a3ce929d0e0e473-600f067aa0ba902b7-01",
            b"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-0",
            b"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-g1",
            b"",
        ] {
            assert!(
                parse_traceparent(bad).is_none(),
                "{}",
                String::from_utf8_lossy(bad)
            );
        }
    }

    #[test]
    fn parent_based_with_a_root_ratio() {
        let c = Context::start(Some(GOOD), 0);
        assert!(c.sampled && c.parent.is_some());
        assert_eq!(c.trace_hex(), *b"4bf92f3577b34da6a3ce929d0e0e4736");
        let unsampled = b"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00";
        assert!(!Context::start(Some(unsampled), u64::MAX).sampled);
        // Roots: none at 0, all at 1, about a tenth at 0.1.
        assert!((0..100).all(|_| !Context::start(None, threshold(0.0)).sampled));
        assert!((0..100).all(|_| Context::start(None, threshold(1.0)).sampled));
        let n = (0..10_000)
            .filter(|_| Context::start(None, threshold(0.1)).sampled)
            .count();
        assert!((700..1300).contains(&n), "{n}");
        // A bad parent is a new root.
        let c = Context::start(Some(b"garbage"), u64::MAX);
        assert!(c.parent.is_none() && c.sampled);
        assert_ne!(c.span_id, [0; 8]);
    }
}
