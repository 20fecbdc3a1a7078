//! Serialising heads into a reusable output buffer, without `format!`.

use crate::head::{RequestHead, ResponseHead};
use crate::known::{self, Known};

/// Write `METHOD uri HTTP/1.1\r\n` + headers (skipping those for which
/// `skip` is true) without the final CRLF, so callers can add their own.
pub fn request_head(
    out: &mut Vec<u8>,
    req: &RequestHead,
    uri: &[u8],
    skip: impl Fn(Known) -> bool,
) {
    request_line(out, req.method(), uri);
    for (k, n, v) in req.headers.iter_known() {
        if k != known::UNKNOWN && skip(k) {
            continue;
        }
        header(out, n, v);
    }
}

/// `METHOD uri HTTP/1.1\r\n`, for clients building a request from parts
/// (follow with [`header`]s and a final CRLF).
pub fn request_line(out: &mut Vec<u8>, method: &[u8], uri: &[u8]) {
    out.extend_from_slice(method);
    out.push(b' ');
    out.extend_from_slice(uri);
    out.extend_from_slice(b" HTTP/1.1\r\n");
}

/// Status line + headers (minus skipped), no final CRLF.
pub fn response_head(out: &mut Vec<u8>, resp: &ResponseHead, skip: impl Fn(Known) -> bool) {
    status_line(out, resp.status, resp.reason());
    for (k, n, v) in resp.headers.iter_known() {
        if k != known::UNKNOWN && skip(k) {
            continue;
        }
        header(out, n, v);
    }
}

pub fn status_line(out: &mut Vec<u8>, status: u16, reason: &[u8]) {
    out.extend_from_slice(b"HTTP/1.1 ");
    let mut b = itoa::Buffer::new();
    out.extend_from_slice(b.format(status).as_bytes());
    out.push(b' ');
    if reason.is_empty() {
        out.extend_from_slice(default_reason(status).as_bytes());
    } else {
        out.extend_from_slice(reason);
    }
    out.extend_from_slice(b"\r\n");
}

#[inline]
pub fn header(out: &mut Vec<u8>, name: &[u8], value: &[u8]) {
    out.extend_from_slice(name);
    out.extend_from_slice(b": ");
    out.extend_from_slice(value);
    out.extend_from_slice(b"\r\n");
}

pub fn header_u64(out: &mut Vec<u8>, name: &[u8], value: u64) {
    let mut b = itoa::Buffer::new();
    header(out, name, b.format(value).as_bytes());
}

pub fn default_reason(status: u16) -> &'static str {
    match status {
        100 => "Continue",
        101 => "Switching Protocols",
        200 => "OK",
        201 => "Created",
        204 => "No Content",
        206 => "Partial Content",
        301 => "Moved Permanently",
        302 => "Found",
        303 => "See Other",
        304 => "Not Modified",
        307 => "Temporary Redirect",
        308 => "Permanent Redirect",
        400 => "Bad Request",
        401 => "Unauthorized",
        403 => "Forbidden",
        404 => "Not Found",
        405 => "Method Not Allowed",
        408 => "Request Timeout",
        413 => "Content Too Large",
        414 => "URI Too Long",
        429 => "Too Many Requests",
        431 => "Request Header Fields Too Large",
        499 => "Client Closed Request",
        500 => "Internal Server Error",
        501 => "Not Implemented",
        502 => "Bad Gateway",
        503 => "Service Unavailable",
        504 => "Gateway Timeout",
        _ => "Unknown",
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::head::{BodyLen, HeadLimits, Method};

    #[test]
    fn built_request_parses_back() {
        let mut out = Vec::new();
        request_line(&mut out, b"POST", b"/a?b=1");
        header(&mut out, b"Host", b"x.test");
        header_u64(&mut out, b"Content-Length", 5);
        out.extend_from_slice(b"\r\n");
        assert_eq!(
            out,
            b"POST /a?b=1 HTTP/1.1\r\nHost: x.test\r\nContent-Length: 5\r\n\r\n"
        );
        let mut req = RequestHead::default();
        let n = req.parse(&out, &HeadLimits::default()).unwrap().unwrap();
        assert_eq!(n, out.len());
        assert_eq!(req.method_kind(), Method::Post);
        assert_eq!(req.uri(), b"/a?b=1");
        assert_eq!(req.body_len(), BodyLen::Length(5));
        // And the head writer reproduces it.
        let mut again = Vec::new();
        request_head(&mut again, &req, req.uri(), |_| false);
        again.extend_from_slice(b"\r\n");
        assert_eq!(again, out);
    }

    #[test]
    fn status_lines() {
        let mut out = Vec::new();
        status_line(&mut out, 404, b"");
        status_line(&mut out, 299, b"Odd");
        assert_eq!(out, b"HTTP/1.1 404 Not Found\r\nHTTP/1.1 299 Odd\r\n");
        let mut resp = ResponseHead::default();
        out.clear();
        status_line(&mut out, 204, b"");
        out.extend_from_slice(b"\r\n");
        resp.parse(&out, &HeadLimits::default()).unwrap().unwrap();
        assert_eq!(resp.status, 204);
        assert_eq!(resp.body_len(Method::Get), Ok(BodyLen::None));
    }
}
