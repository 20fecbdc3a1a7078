//! gRPC awareness in the engine: Pier-made answers to a gRPC request are
//! gRPC-shaped (a gRPC client reads `grpc-status`, not the HTTP status), and
//! `grpc-timeout` bounds the wait for the origin; and gRPC-web ([`web`]),
//! wrappers over the session interfaces that carry a browser's gRPC-web
//! request to the origin as gRPC.

pub mod web;

use pier_http::known;
use pier_http::{RequestHead, ResponseHead};
use std::time::Duration;

/// `content-type: application/grpc[+proto|…]` (not gRPC-web).
pub fn is_grpc(req: &RequestHead) -> bool {
    req.headers
        .get_known(known::CONTENT_TYPE)
        .is_some_and(|ct| {
            ct.len() >= 16
                && ct[..16].eq_ignore_ascii_case(b"application/grpc")
                && !ct[16..].starts_with(b"-web")
        })
}

/// The gRPC status code for a Pier-made HTTP status.
pub fn status_for(http: u16) -> u8 {
    match http {
        502 | 503 => 14, // UNAVAILABLE
        504 => 4,        // DEADLINE_EXCEEDED
        429 => 8,        // RESOURCE_EXHAUSTED
        401 => 16,       // UNAUTHENTICATED
        403 => 7,        // PERMISSION_DENIED
        _ => 13,         // INTERNAL
    }
}

/// Turn a Pier-made error head into a trailers-only gRPC answer: HTTP 200,
/// `content-type: application/grpc`, `grpc-status`, `grpc-message`.
pub fn shape(head: &mut ResponseHead, reason: &str, content_type: &[u8]) {
    let code = status_for(head.status);
    let http = head.status;
    head.set_status(200);
    head.headers.remove_known(known::CONTENT_TYPE);
    head.headers.append(b"content-type", content_type);
    head.headers
        .append(b"grpc-status", itoa::Buffer::new().format(code).as_bytes());
    let mut msg = Vec::with_capacity(32);
    msg.extend_from_slice(if reason.is_empty() {
        b"error".as_slice()
    } else {
        reason.as_bytes()
    });
    msg.extend_from_slice(b" (HTTP ");
    msg.extend_from_slice(itoa::Buffer::new().format(http).as_bytes());
    msg.push(b')');
    head.headers.append(b"grpc-message", &msg);
}

/// `grpc-timeout` (RFC: digits then H, M, S, m, u or n), capped at `max`.
pub fn timeout(req: &RequestHead, max: Duration) -> Duration {
    let Some(v) = req.headers.get(b"grpc-timeout") else {
        return max;
    };
    if v.len() < 2 || v.len() > 9 {
        return max;
    }
    let (digits, unit) = v.split_at(v.len() - 1);
    let Some(n) = pier_http::head::parse_u64(digits) else {
        return max;
    };
    let d = match unit[0] {
        b'H' => Duration::from_secs(n.saturating_mul(3600)),
        b'M' => Duration::from_secs(n.saturating_mul(60)),
        b'S' => Duration::from_secs(n),
        b'm' => Duration::from_millis(n),
        b'u' => Duration::from_micros(n),
        b'n' => Duration::from_nanos(n),
        _ => return max,
    };
    d.min(max)
}

#[cfg(test)]
mod tests {
    use super::*;
    use pier_http::HeadLimits;

    fn req(extra: &str) -> RequestHead {
        let mut r = RequestHead::default();
        let text = format!("POST /s.S/M HTTP/1.1\r\nhost: x\r\n{extra}\r\n");
        r.parse(text.as_bytes(), &HeadLimits::default())
            .unwrap()
            .unwrap();
        r
    }

    #[test]
    fn grpc_detection_timeouts_and_shapes() {
        assert!(is_grpc(&req("content-type: application/grpc\r\n")));
        assert!(is_grpc(&req("content-type: application/grpc+proto\r\n")));
        assert!(!is_grpc(&req("content-type: application/grpc-web\r\n")));
        assert!(!is_grpc(&req("content-type: text/plain\r\n")));
        let max = Duration::from_secs(60);
        let t = |v: &str| timeout(&req(&format!("grpc-timeout: {v}\r\n")), max);
        assert_eq!(t("100m"), Duration::from_millis(100));
        assert_eq!(t("2S"), Duration::from_secs(2));
        assert_eq!(t("5M"), max);
        assert_eq!(t("x"), max);
        assert_eq!(t("12Q"), max);
        assert_eq!(timeout(&req(""), max), max);
        for (http, code) in [
            (502, 14),
            (503, 14),
            (504, 4),
            (429, 8),
            (401, 16),
            (403, 7),
            (500, 13),
            (404, 13),
        ] {
            assert_eq!(status_for(http), code);
        }
        let mut h = ResponseHead::local(503);
        shape(&mut h, "no-healthy-upstream", b"application/grpc");
        assert_eq!(h.status, 200);
        assert_eq!(h.headers.get(b"grpc-status"), Some(&b"14"[..]));
        assert_eq!(
            h.headers.get(b"grpc-message"),
            Some(&b"no-healthy-upstream (HTTP 503)"[..])
        );
    }
}
