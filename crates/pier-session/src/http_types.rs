//! Pier's heads and the `http` crate's types, both ways, for the protocols
//! whose crates speak `http` (HTTP/2 through `h2`, HTTP/3 through `h3`):
//! one mapping, so the multiplexed protocols share their field rules (which
//! response fields never go, Date, Content-Length, trailers) rather than
//! each keeping a copy.

use crate::{BodySize, RequestParts};
use bytes::Bytes;
use pier_error::Kind;
use pier_http::known::{self, Known};
use pier_http::{Headers, ResponseHead};

/// A request head as an `http`-speaking protocol received it: the engine
/// reads it as [`RequestParts`] (`:authority` as its Host, RFC 9113
/// §8.3.1, RFC 9114 §4.3.1).
pub struct HttpHead {
    parts: http::request::Parts,
    has_body: bool,
    /// An extended CONNECT (RFC 8441, RFC 9220) for this protocol, read as
    /// the HTTP/1.1 Upgrade it stands for: the fields an origin needs for
    /// one (`Upgrade`, `Connection`, a fresh `Sec-WebSocket-Key`).
    upgrade: Option<Upgrade>,
}

struct Upgrade {
    protocol: http::HeaderValue,
    key: [u8; 24],
}

impl HttpHead {
    /// `has_body`: the stream did not end with its head.
    pub fn new(parts: http::request::Parts, has_body: bool) -> HttpHead {
        HttpHead {
            parts,
            has_body,
            upgrade: None,
        }
    }

    /// An extended CONNECT whose `:protocol` is `protocol` (WebSocket over
    /// HTTP/2 or HTTP/3): the engine sees the GET with `Upgrade` that an
    /// HTTP/1.1 client would send, so the same allow-list, idle timeout
    /// and drain rules apply, and the origin gets an ordinary Upgrade. The
    /// protocol's `Downstream::tunnel` answers its 101 with a 200.
    pub fn upgrade(parts: http::request::Parts, protocol: &str) -> HttpHead {
        let upgrade = http::HeaderValue::from_str(protocol)
            .ok()
            .map(|protocol| Upgrade {
                protocol,
                key: websocket_key(),
            });
        HttpHead {
            parts,
            has_body: false,
            upgrade,
        }
    }
}

/// A `Sec-WebSocket-Key`: 16 random bytes in base64 (a nonce, RFC 6455
/// §4.1; the origin's `Sec-WebSocket-Accept` answers it).
fn websocket_key() -> [u8; 24] {
    use std::hash::{BuildHasher, Hasher};
    let mut raw = [0u8; 16];
    for (i, half) in raw.chunks_mut(8).enumerate() {
        let mut h = std::collections::hash_map::RandomState::new().build_hasher();
        h.write_usize(i);
        half.copy_from_slice(&h.finish().to_le_bytes());
    }
    const B64: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = [b'='; 24];
    for (i, c) in raw.chunks(3).enumerate() {
        let n = c.iter().fold(0u32, |n, &b| n << 8 | b as u32) << (8 * (3 - c.len()));
        for j in 0..=c.len() {
            out[i * 4 + j] = B64[(n >> (18 - 6 * j) & 63) as usize];
        }
    }
    out
}

impl RequestParts for HttpHead {
    fn method(&self) -> &[u8] {
        if self.upgrade.is_some() {
            return b"GET";
        }
        self.parts.method.as_str().as_bytes()
    }
    fn target(&self) -> &[u8] {
        match self.parts.uri.path_and_query().map(|p| p.as_str()) {
            Some(pq) if !pq.is_empty() => pq.as_bytes(),
            _ => b"/",
        }
    }
    fn authority(&self) -> Option<&[u8]> {
        self.parts.uri.authority().map(|a| a.as_str().as_bytes())
    }
    fn fields(&self) -> impl Iterator<Item = (&[u8], &[u8])> {
        let upgrade = self.upgrade.iter().flat_map(|u| {
            [
                (&b"upgrade"[..], u.protocol.as_bytes()),
                (b"connection", b"upgrade"),
                (b"sec-websocket-key", &u.key[..]),
            ]
        });
        self.parts
            .headers
            .iter()
            .map(|(k, v)| (k.as_str().as_bytes(), v.as_bytes()))
            .chain(upgrade)
    }
    fn has_body(&self) -> bool {
        self.has_body
    }
    fn refused(&self) -> Option<Kind> {
        // A CONNECT other than an extended one for an upgrade (`upgrade`)
        // is not carried: Pier is no forward proxy.
        (self.upgrade.is_none() && self.parts.method == http::Method::CONNECT)
            .then_some(Kind::InvalidRequestLine)
    }
}

/// An `http` map's fields appended to Pier's.
pub fn to_headers(map: &http::HeaderMap, out: &mut Headers) {
    let bytes = map.iter().map(|(k, v)| k.as_str().len() + v.len()).sum();
    out.reserve(map.len(), bytes);
    for (k, v) in map {
        out.append(k.as_str().as_bytes(), v.as_bytes());
    }
}

/// `headers` (less those `skip` names) appended to an `http` map, every
/// value a slice of one shared buffer: one allocation for the values, not
/// one per field. Fields the `http` crate refuses are left out: `false`
/// when there were any.
pub fn http_fields(
    headers: &Headers,
    skip: impl Fn(Known, &[u8]) -> bool,
    out: &mut http::HeaderMap,
) -> bool {
    let (mut total, mut count) = (0, 0);
    for (k, n, v) in headers.iter_known() {
        if !skip(k, n) {
            total += v.len();
            count += 1;
        }
    }
    // Sized once: grown field by field, the map reallocated its tables
    // on the way.
    out.reserve(count);
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
            header_name(k, name),
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

/// `name` (whose slot is `k`) as the `http` crate's: a well-known one, or
/// one of gRPC's, is a constant (no parse, and no copy of a name the `http`
/// crate does not know into a buffer of its own: eight a gRPC call).
pub fn header_name(
    k: Known,
    name: &[u8],
) -> Result<http::HeaderName, http::header::InvalidHeaderName> {
    if let Some(n) = KNOWN_NAMES.get(k as usize) {
        return Ok(n.clone());
    }
    for n in &GRPC_NAMES {
        if n.as_str().as_bytes().eq_ignore_ascii_case(name) {
            return Ok(n.clone());
        }
    }
    http::HeaderName::from_bytes(name)
}

/// The fields of gRPC's protocol (gRPC over HTTP/2: its request, response
/// and trailer fields).
static GRPC_NAMES: [http::HeaderName; 6] = [
    http::HeaderName::from_static("grpc-status"),
    http::HeaderName::from_static("grpc-message"),
    http::HeaderName::from_static("grpc-timeout"),
    http::HeaderName::from_static("grpc-encoding"),
    http::HeaderName::from_static("grpc-accept-encoding"),
    http::HeaderName::from_static("grpc-status-details-bin"),
];

/// The `http` crate's name for each of Pier's well-known slots, in
/// `known::NAMES` order (a test holds the two together). A static, not a
/// const: a const of a type with drop glue is built afresh at each use.
static KNOWN_NAMES: [http::HeaderName; known::COUNT] = {
    use http::header::*;
    [
        HOST,
        CONTENT_LENGTH,
        TRANSFER_ENCODING,
        CONNECTION,
        HeaderName::from_static("keep-alive"),
        HeaderName::from_static("proxy-connection"),
        TE,
        TRAILER,
        UPGRADE,
        EXPECT,
        DATE,
        SERVER,
        HeaderName::from_static("x-forwarded-for"),
        HeaderName::from_static("x-forwarded-proto"),
        HeaderName::from_static("x-forwarded-host"),
        COOKIE,
        USER_AGENT,
        CONTENT_TYPE,
        ACCEPT,
        ACCEPT_ENCODING,
        CACHE_CONTROL,
        AUTHORIZATION,
        PROXY_AUTHORIZATION,
        PROXY_AUTHENTICATE,
        SET_COOKIE,
        LOCATION,
        VIA,
        ETAG,
        LAST_MODIFIED,
        IF_NONE_MATCH,
        IF_MODIFIED_SINCE,
        CONTENT_ENCODING,
        VARY,
        AGE,
        RANGE,
        RETRY_AFTER,
        EXPIRES,
        PRAGMA,
        HeaderName::from_static("surrogate-control"),
        HeaderName::from_static("surrogate-key"),
        HeaderName::from_static("cache-tag"),
        HeaderName::from_static("cache-status"),
        HeaderName::from_static("pier-cache-control"),
        HeaderName::from_static("cdn-cache-control"),
        HeaderName::from_static("x-pier-cache-refresh"),
        HeaderName::from_static("pier-tier"),
    ]
};

/// The Date field's value for the second of `now_ns`, made once a second
/// per thread (then a reference count per response, not a copy and a
/// check of its 29 bytes).
fn date_value(now_ns: u64) -> Option<http::HeaderValue> {
    thread_local! {
        static DATE: std::cell::RefCell<(u64, Option<http::HeaderValue>)> =
            const { std::cell::RefCell::new((u64::MAX, None)) };
    }
    let sec = now_ns / 1_000_000_000;
    DATE.with(|d| {
        let mut d = d.borrow_mut();
        if d.0 != sec {
            let v = pier_http::date::with_date(now_ns, |b| {
                http::HeaderValue::from_maybe_shared(Bytes::copy_from_slice(b)).ok()
            });
            *d = (sec, v);
        }
        d.1.clone()
    })
}

/// Trailer fields as an HTTP/2 trailers block, for either side (fields
/// the `http` crate refuses are left out).
pub fn trailer_map(trailers: Option<&Headers>) -> http::HeaderMap {
    let mut map = http::HeaderMap::new();
    if let Some(t) = trailers {
        // Sized once, the values one shared buffer (three a gRPC call).
        http_fields(t, |_, _| false, &mut map);
    }
    map
}

/// A gRPC or gRPC-web response (its content-type starts `application/grpc`):
/// its body ends with trailers, never early.
pub fn is_grpc(head: &ResponseHead) -> bool {
    head.headers
        .get_known(known::CONTENT_TYPE)
        .is_some_and(|v| v.len() >= 16 && v[..16].eq_ignore_ascii_case(b"application/grpc"))
}

/// Response fields the multiplexed protocols do not carry (RFC 9113
/// §8.2.2, RFC 9114 §4.2): the hop-by-hop ones and Transfer-Encoding.
fn skip_response_field(k: Known) -> bool {
    pier_http::hop_by_hop(k) || k == known::TRANSFER_ENCODING
}

/// The head's status and the fields a multiplexed protocol carries (an
/// interim head as it is; a field `http` refuses is left out).
pub fn response_fields(head: &ResponseHead) -> http::Response<()> {
    let mut r = http::Response::new(());
    *r.status_mut() =
        http::StatusCode::from_u16(head.status).unwrap_or(http::StatusCode::BAD_GATEWAY);
    let _ = http_fields(
        &head.headers,
        |k, _| skip_response_field(k),
        r.headers_mut(),
    );
    r
}

/// A final response head: its fields, a Date (the cached one of `now_ns`)
/// unless it has one, and the body's length when known.
pub fn response(head: &ResponseHead, size: BodySize, now_ns: u64) -> http::Response<()> {
    let mut r = response_fields(head);
    let h = r.headers_mut();
    if !head.headers.has_known(known::DATE) {
        if let Some(v) = date_value(now_ns) {
            h.insert(http::header::DATE, v);
        }
    }
    if let BodySize::Length(n) = size {
        if !head.headers.has_known(known::CONTENT_LENGTH) {
            h.insert(http::header::CONTENT_LENGTH, http::HeaderValue::from(n));
        }
    }
    r
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn known_names_match_the_slots() {
        assert_eq!(KNOWN_NAMES.len(), known::NAMES.len());
        for (n, name) in KNOWN_NAMES.iter().zip(known::NAMES) {
            assert_eq!(n.as_str(), *name);
        }
    }

    #[test]
    fn names_come_from_the_tables_or_are_parsed() {
        let n = |name: &[u8]| header_name(known::lookup(name), name).unwrap();
        assert_eq!(n(b"X-Forwarded-For").as_str(), "x-forwarded-for");
        assert_eq!(n(b"grpc-status").as_str(), "grpc-status");
        assert_eq!(n(b"Grpc-Message").as_str(), "grpc-message");
        assert_eq!(n(b"x-custom").as_str(), "x-custom");
        assert!(header_name(known::UNKNOWN, b"bad name").is_err());
    }

    #[test]
    fn trailers_keep_every_value_in_order_and_leave_out_what_http_refuses() {
        let mut t = Headers::new();
        t.append(b"grpc-status", b"0");
        t.append(b"Grpc-Message", b"fine");
        t.append(b"x-t", b"1");
        t.append(b"bad name", b"v");
        t.append(b"x-t", b"2");
        t.append(b"x-bad", b"a\x01b");
        let m = trailer_map(Some(&t));
        assert_eq!(m.len(), 4);
        assert_eq!(m["grpc-status"], "0");
        assert_eq!(m["grpc-message"], "fine");
        let xt: Vec<_> = m.get_all("x-t").iter().collect();
        assert_eq!(xt, ["1", "2"]);
        assert!(trailer_map(None).is_empty());
    }

    #[test]
    fn the_date_is_the_seconds_own() {
        let a = date_value(784_111_777 * 1_000_000_000).unwrap();
        assert_eq!(a.as_bytes(), b"Sun, 06 Nov 1994 08:49:37 GMT");
        let b = date_value(784_111_778 * 1_000_000_000 + 5).unwrap();
        assert_eq!(b.as_bytes(), b"Sun, 06 Nov 1994 08:49:38 GMT");
    }

    #[test]
    fn an_extended_connect_reads_as_an_http1_upgrade() {
        let (parts, ()) = http::Request::builder()
            .method("CONNECT")
            .uri("https://example.test/chat?room=1")
            .header("sec-websocket-version", "13")
            .body(())
            .unwrap()
            .into_parts();
        let h = HttpHead::upgrade(parts, "websocket");
        assert_eq!(h.method(), b"GET");
        assert_eq!(h.target(), b"/chat?room=1");
        assert_eq!(h.refused(), None);
        assert!(!h.has_body());
        let fields: Vec<(&[u8], &[u8])> = h.fields().collect();
        assert!(fields.contains(&(&b"upgrade"[..], &b"websocket"[..])));
        assert!(fields.contains(&(&b"connection"[..], &b"upgrade"[..])));
        let key = fields
            .iter()
            .find(|(n, _)| *n == b"sec-websocket-key")
            .unwrap()
            .1;
        // 16 bytes in base64: 22 characters and "==".
        assert_eq!(key.len(), 24);
        assert!(key.ends_with(b"=="));
        assert!(key[..22]
            .iter()
            .all(|c| c.is_ascii_alphanumeric() || b"+/".contains(c)));
        // A plain CONNECT is still refused.
        let (parts, ()) = http::Request::builder()
            .method("CONNECT")
            .uri("example.test:443")
            .body(())
            .unwrap()
            .into_parts();
        assert!(HttpHead::new(parts, true).refused().is_some());
    }
}
