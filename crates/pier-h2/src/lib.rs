//! HTTP/2 on both sides of the engine, behind the session interfaces
//! (pier-session): [`server`] serves a client connection and hands each
//! stream to the engine; [`client`] keeps multiplexed connections to origins
//! and carries one attempt as a stream on one of them. The `h2` crate does
//! the framing, HPACK and flow control on both sides; what this crate adds
//! is the mapping between its `http` types and Pier's heads, bounded
//! buffering, and the connection's lifecycle (idle, GOAWAY, eviction).
//!
//! No policy lives here: which fields go upstream and the authority come
//! from the engine's [`UpstreamRequest`](pier_session::UpstreamRequest),
//! which fields a response never carries from the one hop-by-hop table.

pub mod client;
pub mod server;

use bytes::Bytes;
use pier_http::known::Known;
use pier_http::Headers;

/// `headers` (less those `skip` names) appended to an `http` map, every
/// value a slice of one shared buffer: one allocation for the values, not
/// one per field. Fields the `http` crate refuses are left out: `false`
/// when there were any.
pub fn http_fields(
    headers: &Headers,
    skip: impl Fn(Known, &[u8]) -> bool,
    out: &mut http::HeaderMap,
) -> bool {
    let total: usize = headers
        .iter_known()
        .filter(|(k, n, _)| !skip(*k, n))
        .map(|(_, _, v)| v.len())
        .sum();
    let mut all = Vec::with_capacity(total);
    for (k, n, v) in headers.iter_known() {
        if !skip(k, n) {
            all.extend_from_slice(v);
        }
    }
    let all = Bytes::from(all);
    let mut at = 0;
    let mut all_taken = true;
    for (k, name, value) in headers.iter_known() {
        if skip(k, name) {
            continue;
        }
        let v = all.slice(at..at + value.len());
        at += value.len();
        match (
            http::HeaderName::from_bytes(name),
            http::HeaderValue::from_maybe_shared(v),
        ) {
            (Ok(n), Ok(v)) => {
                out.append(n, v);
            }
            _ => all_taken = false,
        }
    }
    all_taken
}

/// Trailer fields as an HTTP/2 trailers block, for either side (fields
/// the `http` crate refuses are left out).
pub fn trailer_map(trailers: Option<&Headers>) -> http::HeaderMap {
    let mut map = http::HeaderMap::new();
    for (k, v) in trailers.into_iter().flat_map(|t| t.iter()) {
        if let (Ok(n), Ok(v)) = (
            http::HeaderName::from_bytes(k),
            http::HeaderValue::from_bytes(v),
        ) {
            map.append(n, v);
        }
    }
    map
}
