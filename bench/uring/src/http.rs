//! The HTTP/1.1 framing both modes share: find a request head, check it is a GET
//! without a body, find a response's length. Deliberately minimal (issue 34 item 5
//! measures the I/O path, not the parser): heads are forwarded to the origin as they
//! came, responses are framed by Content-Length only.

/// Largest request or response head accepted.
pub const MAX_HEAD: usize = 16 * 1024;
/// Largest response (head + body) the proxy buffers; larger ones are refused with 502.
pub const MAX_RESPONSE: usize = 8 * 1024 * 1024;

pub const RESP_400: &[u8] =
    b"HTTP/1.1 400 Bad Request\r\ncontent-length: 0\r\nconnection: close\r\n\r\n";
pub const RESP_502: &[u8] =
    b"HTTP/1.1 502 Bad Gateway\r\ncontent-length: 0\r\nconnection: close\r\n\r\n";

/// Offset just past the first "\r\n\r\n" of `buf`.
pub fn head_end(buf: &[u8]) -> Option<usize> {
    buf.windows(4).position(|w| w == b"\r\n\r\n").map(|i| i + 4)
}

fn lines(head: &[u8]) -> impl Iterator<Item = &[u8]> {
    head.split(|&b| b == b'\n')
        .map(|l| l.strip_suffix(b"\r").unwrap_or(l))
}

fn header(line: &[u8]) -> Option<(&[u8], &[u8])> {
    let colon = line.iter().position(|&b| b == b':')?;
    Some((&line[..colon], line[colon + 1..].trim_ascii()))
}

fn has_token(value: &[u8], token: &[u8]) -> bool {
    value
        .split(|&b| b == b',')
        .any(|t| t.trim_ascii().eq_ignore_ascii_case(token))
}

#[derive(Debug, PartialEq, Eq)]
pub struct Request {
    /// The client asked to close after this response (Connection: close, or HTTP/1.0
    /// without keep-alive).
    pub close: bool,
}

/// Checks a request head (including its final "\r\n\r\n"): GET, HTTP/1.x, no body.
pub fn parse_request(head: &[u8]) -> Result<Request, ()> {
    let mut it = lines(head);
    let first = it.next().ok_or(())?;
    let mut parts = first.split(|&b| b == b' ');
    let (method, target, version) = (parts.next(), parts.next(), parts.next());
    if method != Some(b"GET") || parts.next().is_some() || target.is_none_or(|t| t.is_empty()) {
        return Err(());
    }
    let http10 = match version {
        Some(b"HTTP/1.1") => false,
        Some(b"HTTP/1.0") => true,
        _ => return Err(()),
    };
    let mut close = http10;
    for line in it {
        if line.is_empty() {
            break;
        }
        let (name, value) = header(line).ok_or(())?;
        if name.eq_ignore_ascii_case(b"content-length") {
            if value != b"0" {
                return Err(());
            }
        } else if name.eq_ignore_ascii_case(b"transfer-encoding") {
            return Err(());
        } else if name.eq_ignore_ascii_case(b"connection") {
            if has_token(value, b"close") {
                close = true;
            } else if has_token(value, b"keep-alive") {
                close = false;
            }
        }
    }
    Ok(Request { close })
}

#[derive(Debug, PartialEq, Eq)]
pub struct Response {
    /// Head plus body: the response ends here.
    pub total: usize,
    /// The origin connection may carry another request afterwards.
    pub reusable: bool,
}

/// Frames a response whose head is `buf[..head_len]`: Content-Length only
/// (1xx, 204 and 304 have no body). Chunked or close-delimited bodies are refused.
pub fn parse_response(buf: &[u8], head_len: usize) -> Result<Response, ()> {
    let mut it = lines(&buf[..head_len]);
    let first = it.next().ok_or(())?;
    let mut parts = first.splitn(3, |&b| b == b' ');
    let version = parts.next().ok_or(())?;
    let status = parts.next().ok_or(())?;
    let status: u16 = std::str::from_utf8(status)
        .map_err(|_| ())?
        .parse()
        .map_err(|_| ())?;
    let mut reusable = match version {
        b"HTTP/1.1" => true,
        b"HTTP/1.0" => false,
        _ => return Err(()),
    };
    if (100..200).contains(&status) {
        return Err(()); // interim responses: not for a GET to nginx
    }
    let mut length = None;
    for line in it {
        if line.is_empty() {
            break;
        }
        let (name, value) = header(line).ok_or(())?;
        if name.eq_ignore_ascii_case(b"content-length") {
            let n: usize = std::str::from_utf8(value)
                .map_err(|_| ())?
                .parse()
                .map_err(|_| ())?;
            if length.is_some_and(|m| m != n) {
                return Err(());
            }
            length = Some(n);
        } else if name.eq_ignore_ascii_case(b"transfer-encoding") {
            return Err(());
        } else if name.eq_ignore_ascii_case(b"connection") {
            if has_token(value, b"close") {
                reusable = false;
            } else if has_token(value, b"keep-alive") && version == b"HTTP/1.0" {
                reusable = true;
            }
        }
    }
    let body = match (status, length) {
        (204 | 304, _) => 0,
        (_, Some(n)) => n,
        (_, None) => return Err(()),
    };
    let total = head_len.checked_add(body).ok_or(())?;
    if total > MAX_RESPONSE {
        return Err(());
    }
    Ok(Response { total, reusable })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests() {
        let h = b"GET /hello HTTP/1.1\r\nHost: x\r\n\r\n";
        assert_eq!(head_end(h), Some(h.len()));
        assert_eq!(parse_request(h), Ok(Request { close: false }));
        let h = b"GET / HTTP/1.1\r\nConnection: close\r\n\r\n";
        assert_eq!(parse_request(h), Ok(Request { close: true }));
        assert_eq!(
            parse_request(b"GET / HTTP/1.0\r\n\r\n"),
            Ok(Request { close: true })
        );
        assert!(parse_request(b"POST / HTTP/1.1\r\nContent-Length: 3\r\n\r\n").is_err());
        assert!(parse_request(b"GET / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n").is_err());
        assert!(parse_request(b"GET /\r\n\r\n").is_err());
        assert!(head_end(b"GET / HTTP/1.1\r\n").is_none());
    }

    #[test]
    fn responses() {
        let r = b"HTTP/1.1 200 OK\r\nContent-Length: 12\r\n\r\nhello world\n";
        let h = head_end(r).unwrap();
        assert_eq!(
            parse_response(r, h),
            Ok(Response {
                total: r.len(),
                reusable: true
            })
        );
        let r = b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\nConnection: close\r\n\r\n";
        assert_eq!(
            parse_response(r, r.len()),
            Ok(Response {
                total: r.len(),
                reusable: false
            })
        );
        let r = b"HTTP/1.1 304 Not Modified\r\n\r\n";
        assert_eq!(parse_response(r, r.len()).unwrap().total, r.len());
        assert!(parse_response(b"HTTP/1.1 200 OK\r\n\r\n", 19).is_err());
        let r = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n";
        assert!(parse_response(r, r.len()).is_err());
    }
}
