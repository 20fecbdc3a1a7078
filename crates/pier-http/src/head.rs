//! Request and response heads, their parsers (httparse underneath) and the
//! checks that keep requests from being smuggled: a request whose framing is
//! ambiguous is refused with 400, never forwarded.

use std::mem::MaybeUninit;

use crate::headers::{trim, Headers};
use crate::known::*;
use pier_error::Kind;

/// How a message body is delimited on the wire.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BodyLen {
    None,
    Length(u64),
    Chunked,
    /// Response only: until the origin closes.
    UntilClose,
}

/// Parser bounds from config (`[limits]`).
#[derive(Debug, Clone, Copy)]
pub struct HeadLimits {
    pub max_header_bytes: usize,
    pub max_headers: usize,
    pub max_uri_bytes: usize,
}

impl Default for HeadLimits {
    fn default() -> Self {
        HeadLimits {
            max_header_bytes: 16384,
            max_headers: 100,
            max_uri_bytes: 8192,
        }
    }
}

/// httparse needs a header array; the largest config allows this many.
pub const MAX_HEADERS_HARD: usize = 512;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Method {
    Get,
    Head,
    Post,
    Put,
    Delete,
    Options,
    Patch,
    Connect,
    Trace,
    Other,
}

impl Method {
    fn from_bytes(m: &[u8]) -> Method {
        match m {
            b"GET" => Method::Get,
            b"HEAD" => Method::Head,
            b"POST" => Method::Post,
            b"PUT" => Method::Put,
            b"DELETE" => Method::Delete,
            b"OPTIONS" => Method::Options,
            b"PATCH" => Method::Patch,
            b"CONNECT" => Method::Connect,
            b"TRACE" => Method::Trace,
            _ => Method::Other,
        }
    }
    /// RFC 9110 §9.2.2: safe to send twice.
    pub fn idempotent(self) -> bool {
        matches!(
            self,
            Method::Get
                | Method::Head
                | Method::Put
                | Method::Delete
                | Method::Options
                | Method::Trace
        )
    }
}

/// A parsed request head. Method and target are spans into the header arena;
/// `set_uri` moves the target into the arena's tail.
#[derive(Debug, Clone, Default)]
pub struct RequestHead {
    pub headers: Headers,
    method: (u32, u32),
    uri: (u32, u32),
    pub method_kind: Option<Method>,
    /// 0 for HTTP/1.0, 1 for HTTP/1.1.
    pub version: u8,
    pub body: Option<BodyLen>,
}

impl RequestHead {
    pub fn method(&self) -> &[u8] {
        &self.headers.arena()[self.method.0 as usize..(self.method.0 + self.method.1) as usize]
    }
    pub fn method_kind(&self) -> Method {
        self.method_kind.unwrap_or(Method::Other)
    }
    /// Request target as received (origin-form `path?query`, or absolute-form).
    pub fn uri(&self) -> &[u8] {
        &self.headers.arena()[self.uri.0 as usize..(self.uri.0 + self.uri.1) as usize]
    }
    pub fn path(&self) -> &[u8] {
        let u = self.uri();
        match memchr::memchr(b'?', u) {
            Some(i) => &u[..i],
            None => u,
        }
    }
    pub fn query(&self) -> Option<&[u8]> {
        let u = self.uri();
        memchr::memchr(b'?', u).map(|i| &u[i + 1..])
    }
    /// Become a copy of `other`, reusing storage.
    pub fn copy_from(&mut self, other: &RequestHead) {
        self.headers.copy_from(&other.headers);
        self.method = other.method;
        self.uri = other.uri;
        self.method_kind = other.method_kind;
        self.version = other.version;
        self.body = other.body;
    }

    /// The authority of an absolute-form target (`http://host[:port]/p`),
    /// which RFC 9112 §3.2.2 says replaces the Host header; with the
    /// origin-form target that goes upstream.
    pub fn absolute_form(&self) -> Option<(&[u8], &[u8])> {
        let u = self.uri();
        let rest = if u.len() > 7 && u[..7].eq_ignore_ascii_case(b"http://") {
            &u[7..]
        } else if u.len() > 8 && u[..8].eq_ignore_ascii_case(b"https://") {
            &u[8..]
        } else {
            return None;
        };
        let end = rest
            .iter()
            .position(|&b| b == b'/' || b == b'?' || b == b'#')
            .unwrap_or(rest.len());
        let authority = &rest[..end];
        // userinfo is not allowed in http(s) URIs sent to a proxy.
        if authority.is_empty() || authority.contains(&b'@') {
            return None;
        }
        Some((authority, &rest[end..]))
    }

    /// Replaces the method (a token, checked by the caller), e.g. from a Lua
    /// hook's `ngx.req.set_method`: the new bytes go to the arena as
    /// [`set_uri`](Self::set_uri)'s do.
    pub fn set_method(&mut self, method: &[u8]) {
        let arena = self.headers.arena_mut();
        let off = arena.len();
        arena.extend_from_slice(method);
        self.method = (off as u32, method.len() as u32);
        self.method_kind = Some(Method::from_bytes(method));
    }
    pub fn set_uri(&mut self, uri: &[u8]) {
        let arena = self.headers.arena_mut();
        let off = arena.len();
        arena.extend_from_slice(uri);
        self.uri = (off as u32, uri.len() as u32);
    }
    pub fn host(&self) -> Option<&[u8]> {
        self.headers.get_known(HOST)
    }
    pub fn body_len(&self) -> BodyLen {
        self.body.unwrap_or(BodyLen::None)
    }
    /// Does the client want the connection kept open after this request?
    pub fn keep_alive(&self) -> bool {
        if self.version == 0 {
            self.headers.has_token(CONNECTION, b"keep-alive")
        } else {
            !self.headers.has_token(CONNECTION, b"close")
        }
    }
    pub fn is_upgrade(&self) -> bool {
        self.headers.has_known(UPGRADE) && self.headers.has_token(CONNECTION, b"upgrade")
    }
    pub fn expects_continue(&self) -> bool {
        self.headers
            .get_known(EXPECT)
            .is_some_and(|v| trim(v).eq_ignore_ascii_case(b"100-continue"))
    }

    /// Parse a request head from the start of `buf`. `Ok(None)` means more
    /// bytes are needed; `Ok(Some(n))` means the head is the first `n` bytes.
    pub fn parse(&mut self, buf: &[u8], limits: &HeadLimits) -> Result<Option<usize>, Kind> {
        // Uninitialised slots: zeroing 512 of them (16 KiB) cost more than
        // the parse itself.
        let mut raw = [const { MaybeUninit::<httparse::Header>::uninit() }; MAX_HEADERS_HARD];
        let max = limits.max_headers.clamp(1, MAX_HEADERS_HARD);
        let mut req = httparse::Request::new(&mut []);
        let status = match req.parse_with_uninit_headers(buf, &mut raw[..max]) {
            Ok(s) => s,
            Err(httparse::Error::TooManyHeaders) => return Err(Kind::HeadersTooLarge),
            Err(httparse::Error::Token | httparse::Error::Version) => {
                return Err(if req.method.is_some() && req.path.is_none() {
                    uri_or_line(buf, limits)
                } else {
                    Kind::InvalidRequestLine
                })
            }
            Err(httparse::Error::NewLine) => return Err(Kind::InvalidRequestLine),
            Err(_) => return Err(Kind::InvalidHeader),
        };
        let n = match status {
            httparse::Status::Partial => {
                if buf.len() > limits.max_header_bytes {
                    // Still inside the request line? Then it's the URI.
                    return Err(if memchr::memchr(b'\n', buf).is_none() {
                        Kind::UriTooLong
                    } else {
                        Kind::HeadersTooLarge
                    });
                }
                return Ok(None);
            }
            httparse::Status::Complete(n) => n,
        };
        let path = req.path.unwrap_or("");
        if path.len() > limits.max_uri_bytes {
            return Err(Kind::UriTooLong);
        }
        if n > limits.max_header_bytes {
            return Err(Kind::HeadersTooLarge);
        }
        let method = req.method.unwrap_or("");
        let version = req.version.unwrap_or(1);
        let base = buf.as_ptr() as usize;
        self.headers.clear();
        self.headers.arena_mut().extend_from_slice(&buf[..n]);
        self.method = (
            (method.as_ptr() as usize - base) as u32,
            method.len() as u32,
        );
        self.uri = ((path.as_ptr() as usize - base) as u32, path.len() as u32);
        self.method_kind = Some(Method::from_bytes(method.as_bytes()));
        self.version = version;
        for h in req.headers.iter() {
            let no = h.name.as_ptr() as usize - base;
            let vo = h.value.as_ptr() as usize - base;
            self.headers.push_span(no, h.name.len(), vo, h.value.len());
        }
        if path.is_empty() || path.bytes().any(|b| b <= b' ' || b == 0x7f) {
            return Err(Kind::InvalidRequestLine);
        }
        self.body = Some(self.validate()?);
        Ok(Some(n))
    }

    /// A request head from the fields a codec other than HTTP/1 decoded
    /// (HTTP/2, HTTP/3): method, target, authority and fields, as they
    /// came. The same rules as a parsed HTTP/1.1 head apply, by the same
    /// functions (limits, field syntax, [`Self::validate`]); nothing is
    /// turned into HTTP/1 text to be parsed again. The authority becomes
    /// Host (a Host field naming another is refused: two authorities are
    /// two parsers' views). Cookie crumbs are joined into one field (RFC
    /// 9113 §8.2.3, RFC 9114 §4.2.1). `stream_body`: a body follows that no
    /// field gives a length to (it goes to an HTTP/1 origin chunked).
    pub fn from_parts<'f>(
        &mut self,
        method: &[u8],
        target: &[u8],
        authority: Option<&[u8]>,
        fields: impl Iterator<Item = (&'f [u8], &'f [u8])>,
        stream_body: bool,
        limits: &HeadLimits,
    ) -> Result<(), Kind> {
        if target.len() > limits.max_uri_bytes {
            return Err(Kind::UriTooLong);
        }
        if method.is_empty() || !method.iter().all(|&b| is_tchar(b)) {
            return Err(Kind::InvalidRequestLine);
        }
        if target.is_empty() || target.iter().any(|&b| b <= b' ' || b == 0x7f) {
            return Err(Kind::InvalidRequestLine);
        }
        self.headers.clear();
        self.version = 1;
        let mut size = method.len() + target.len() + 12;
        let mut count = 0usize;
        let arena = self.headers.arena_mut();
        arena.extend_from_slice(method);
        arena.extend_from_slice(target);
        self.method = (0, method.len() as u32);
        self.uri = (method.len() as u32, target.len() as u32);
        self.method_kind = Some(Method::from_bytes(method));
        let mut push = |h: &mut Headers, n: &[u8], v: &[u8]| -> Result<(), Kind> {
            size += n.len() + v.len() + 4;
            count += 1;
            if size > limits.max_header_bytes || count > limits.max_headers.min(MAX_HEADERS_HARD) {
                return Err(Kind::HeadersTooLarge);
            }
            if !valid_field_name(n) || !valid_field_value(v) {
                return Err(Kind::InvalidHeader);
            }
            let a = h.arena_mut();
            let no = a.len();
            a.extend_from_slice(n);
            let vo = a.len();
            a.extend_from_slice(v);
            h.push_span(no, n.len(), vo, v.len());
            Ok(())
        };
        if let Some(a) = authority {
            push(&mut self.headers, b"host", a)?;
        }
        // Crumbs kept aside (no allocation for a request without).
        let mut crumbs: Vec<&[u8]> = Vec::new();
        for (n, v) in fields {
            match lookup(n) {
                COOKIE => {
                    crumbs.push(v);
                    continue;
                }
                HOST if authority.is_some() => {
                    if !authority.is_some_and(|a| a.eq_ignore_ascii_case(v)) {
                        return Err(Kind::InvalidHost);
                    }
                    continue;
                }
                // Connection-specific in HTTP/2 and /3 (RFC 9113 §8.2.2); a
                // decoder that let it by must not have it frame a body here.
                TRANSFER_ENCODING => return Err(Kind::InvalidHeader),
                // Only `te: trailers` is allowed there; it is hop-by-hop.
                TE => continue,
                _ => {}
            }
            push(&mut self.headers, n, v)?;
        }
        if !crumbs.is_empty() {
            let joined = crumbs.join(&b"; "[..]);
            push(&mut self.headers, b"cookie", &joined)?;
        }
        let body = self.validate()?;
        self.body = Some(match body {
            BodyLen::None if stream_body && !self.headers.has_known(CONTENT_LENGTH) => {
                BodyLen::Chunked
            }
            b => b,
        });
        Ok(())
    }

    /// Framing and Host checks (RFC 9112 §6.3, the desync lessons).
    fn validate(&self) -> Result<BodyLen, Kind> {
        let h = &self.headers;
        // Values need no scan here: httparse refuses NUL, CR, LF and other
        // controls in them (its HEADER_VALUE_MAP), and this runs only on
        // heads it parsed (tested by `control_bytes_in_values_refused`).
        for (n, _) in h.iter() {
            // `Content_Length` / `Transfer_Encoding`: servers that map `_` to
            // `-` would frame the body differently than we do. Only those two
            // lengths can match, so most names cost one compare.
            if (n.len() == 14 || n.len() == 17)
                && (n.eq_ignore_ascii_case(b"content_length")
                    || n.eq_ignore_ascii_case(b"transfer_encoding"))
            {
                return Err(Kind::InvalidHeader);
            }
        }
        if self.version == 1 {
            let mut hosts = h.get_all_known(HOST);
            match (hosts.next(), hosts.next()) {
                (Some(v), None) if valid_host(v) => {}
                _ => return Err(Kind::InvalidHost),
            }
        } else if let Some(v) = h.get_known(HOST) {
            if !valid_host(v) || h.get_all_known(HOST).count() > 1 {
                return Err(Kind::InvalidHost);
            }
        }
        if h.has_known(CONNECTION) {
            connection_names_nothing_decided_here(h)?;
        }
        let cl = content_length(h, true)?;
        if h.has_known(TRANSFER_ENCODING) {
            if cl.is_some() {
                return Err(Kind::ConflictingLength);
            }
            if self.version == 0 {
                // HTTP/1.0 has no chunked; a TE here is a smuggling attempt.
                return Err(Kind::UnsupportedTransferEncoding);
            }
            return match transfer_encoding(h) {
                Some(true) => Ok(BodyLen::Chunked),
                _ => Err(Kind::UnsupportedTransferEncoding),
            };
        }
        Ok(match cl {
            Some(0) | None => BodyLen::None,
            Some(n) => BodyLen::Length(n),
        })
    }
}

/// A `Connection` header may make hop-by-hop only what is the client's to
/// drop. Framing (Content-Length, Transfer-Encoding), Host and
/// pseudo-headers are decided by the proxy, once: a proxy that strips a
/// listed Content-Length forwards the body unframed, and the origin reads
/// it as a second request (docs/security.md, "Smuggling").
fn connection_names_nothing_decided_here(h: &Headers) -> Result<(), Kind> {
    for v in h.get_all_known(CONNECTION) {
        for t in v.split(|&b| b == b',') {
            let t = trim(t);
            if t.first() == Some(&b':') {
                return Err(Kind::ConnectionNamesFraming);
            }
            if matches!(lookup(t), CONTENT_LENGTH | TRANSFER_ENCODING | HOST) {
                return Err(Kind::ConnectionNamesFraming);
            }
        }
    }
    Ok(())
}

fn uri_or_line(buf: &[u8], limits: &HeadLimits) -> Kind {
    if buf.len() > limits.max_uri_bytes && memchr::memchr(b'\n', buf).is_none() {
        Kind::UriTooLong
    } else {
        Kind::InvalidRequestLine
    }
}

/// Host: reg-name / IP-literal with optional port; no whitespace, no '@',
/// no '/' (absolute-form confusion).
fn valid_host(v: &[u8]) -> bool {
    !v.is_empty()
        && v.iter().all(|&b| {
            b.is_ascii_alphanumeric()
                || matches!(b, b'.' | b'-' | b'_' | b':' | b'[' | b']' | b'~' | b'%')
        })
}

/// All Content-Length values must be the same decimal number (duplicates
/// with equal values are tolerated, as RFC 9112 §6.3 permits).
/// Requests (`strict`) must not carry a comma list at all: an origin may read
/// `5,5` as 5, as an error, or by its first digits (a desync corpus Severe).
fn content_length(h: &Headers, strict: bool) -> Result<Option<u64>, Kind> {
    let mut found: Option<u64> = None;
    for v in h.get_all_known(CONTENT_LENGTH) {
        if strict && v.contains(&b',') {
            return Err(Kind::InvalidContentLength);
        }
        for part in v.split(|&b| b == b',') {
            let part = trim(part);
            let n = parse_u64(part).ok_or(Kind::InvalidContentLength)?;
            match found {
                Some(prev) if prev != n => return Err(Kind::ConflictingLength),
                _ => found = Some(n),
            }
        }
    }
    Ok(found)
}

/// Strict decimal: digits only, no sign, no overflow.
pub fn parse_u64(s: &[u8]) -> Option<u64> {
    if s.is_empty() || s.len() > 19 {
        return None;
    }
    let mut n: u64 = 0;
    for &b in s {
        if !b.is_ascii_digit() {
            return None;
        }
        n = n * 10 + (b - b'0') as u64;
    }
    Some(n)
}

/// `Some(true)` if the codings end in exactly one `chunked` (the only coding
/// a proxy frames by); `Some(false)` if chunked is absent; `None` if the
/// header is malformed or chunked appears other than last.
fn transfer_encoding(h: &Headers) -> Option<bool> {
    let mut last_chunked = false;
    let mut any = false;
    for v in h.get_all_known(TRANSFER_ENCODING) {
        for t in v.split(|&b| b == b',') {
            let t = trim(t);
            if t.is_empty() {
                continue;
            }
            if last_chunked {
                return None; // something after chunked
            }
            if !t.iter().all(|&b| b.is_ascii_alphanumeric() || b == b'-') {
                return None;
            }
            any = true;
            last_chunked = t.eq_ignore_ascii_case(b"chunked");
        }
    }
    if !any {
        return None;
    }
    Some(last_chunked)
}

/// RFC 9110 §5.6.2 `tchar`: what a method or a field name is made of.
pub fn is_tchar(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b)
}

/// A field name: one or more `tchar`s.
pub fn valid_field_name(n: &[u8]) -> bool {
    !n.is_empty() && n.iter().all(|&b| is_tchar(b))
}

/// A field value as a parsed HTTP/1 head admits it (httparse's table):
/// visible ASCII, space, tab and obs-text; no NUL, CR, LF or other
/// control, and no leading or trailing whitespace (RFC 9110 §5.5).
pub fn valid_field_value(v: &[u8]) -> bool {
    v.iter()
        .all(|&b| b == b'\t' || (b' '..=b'~').contains(&b) || b >= 0x80)
        && !matches!(v.first(), Some(b' ' | b'\t'))
        && !matches!(v.last(), Some(b' ' | b'\t'))
}

/// A parsed response head.
#[derive(Debug, Clone, Default)]
pub struct ResponseHead {
    pub headers: Headers,
    pub status: u16,
    pub version: u8,
    reason: (u32, u32),
}

impl ResponseHead {
    pub fn reason(&self) -> &[u8] {
        &self.headers.arena()[self.reason.0 as usize..(self.reason.0 + self.reason.1) as usize]
    }

    /// Change the status; the reason phrase becomes the standard one.
    pub fn set_status(&mut self, status: u16) {
        self.status = status;
        self.reason = (0, 0);
    }

    /// Build a response head locally (errors, Lua, admin).
    pub fn local(status: u16) -> Self {
        ResponseHead {
            status,
            version: 1,
            ..Default::default()
        }
    }

    /// Parse a response head from an origin. Permissive where harmless: any
    /// three-digit status 100–999 passes (the Pingora lesson), odd reason
    /// phrases too.
    pub fn parse(&mut self, buf: &[u8], limits: &HeadLimits) -> Result<Option<usize>, Kind> {
        let mut raw = [const { MaybeUninit::<httparse::Header>::uninit() }; MAX_HEADERS_HARD];
        let mut resp = httparse::Response::new(&mut []);
        let status = httparse::ParserConfig::default()
            .allow_spaces_after_header_name_in_responses(true)
            .allow_multiple_spaces_in_response_status_delimiters(true)
            .parse_response_with_uninit_headers(&mut resp, buf, &mut raw)
            .map_err(|_| Kind::UpstreamProtocol)?;
        let n = match status {
            httparse::Status::Partial => {
                if buf.len() > limits.max_header_bytes.max(65536) {
                    return Err(Kind::UpstreamProtocol);
                }
                return Ok(None);
            }
            httparse::Status::Complete(n) => n,
        };
        let code = resp.code.unwrap_or(0);
        if !(100..=999).contains(&code) {
            return Err(Kind::UpstreamProtocol);
        }
        let base = buf.as_ptr() as usize;
        self.headers.clear();
        self.headers.arena_mut().extend_from_slice(&buf[..n]);
        self.status = code;
        self.version = resp.version.unwrap_or(1);
        let reason = resp.reason.unwrap_or("");
        self.reason = if reason.is_empty() {
            (0, 0)
        } else {
            (
                (reason.as_ptr() as usize - base) as u32,
                reason.len() as u32,
            )
        };
        for h in resp.headers.iter() {
            let no = h.name.as_ptr() as usize - base;
            let vo = h.value.as_ptr() as usize - base;
            self.headers.push_span(no, h.name.len(), vo, h.value.len());
        }
        Ok(Some(n))
    }

    /// Body framing of this response to a request with `method`.
    pub fn body_len(&self, method: Method) -> Result<BodyLen, Kind> {
        if method == Method::Head
            || (100..200).contains(&self.status)
            || self.status == 204
            || self.status == 304
        {
            return Ok(BodyLen::None);
        }
        let h = &self.headers;
        if h.has_known(TRANSFER_ENCODING) {
            return match transfer_encoding(h) {
                Some(true) => Ok(BodyLen::Chunked),
                Some(false) => Ok(BodyLen::UntilClose),
                None => Err(Kind::UpstreamProtocol),
            };
        }
        match content_length(h, false) {
            Ok(Some(n)) => Ok(BodyLen::Length(n)),
            Ok(None) => Ok(BodyLen::UntilClose),
            Err(_) => Err(Kind::UpstreamProtocol),
        }
    }

    pub fn keep_alive(&self) -> bool {
        if self.version == 0 {
            self.headers.has_token(CONNECTION, b"keep-alive")
        } else {
            !self.headers.has_token(CONNECTION, b"close")
        }
    }
}

/// The one table of always-hop-by-hop fields (RFC 9110 §7.6.1, and the
/// obsolete ones peers still send), besides what `Connection` names. Every
/// writer, both directions and every protocol, skips these.
pub const HOP_BY_HOP: [Known; 6] = [
    CONNECTION,
    KEEP_ALIVE,
    PROXY_CONNECTION,
    TE,
    UPGRADE,
    PROXY_AUTHENTICATE,
];

/// `k` is in [`HOP_BY_HOP`].
#[inline]
pub fn hop_by_hop(k: Known) -> bool {
    matches!(
        k,
        CONNECTION | KEEP_ALIVE | PROXY_CONNECTION | TE | UPGRADE | PROXY_AUTHENTICATE
    )
}

/// Remove hop-by-hop headers (RFC 9110 §7.6.1): the fixed list plus every
/// header named in `Connection`. `Transfer-Encoding` is left to the caller
/// (it's framing, which the proxy re-states itself).
pub fn remove_hop_by_hop(h: &mut Headers) {
    if h.has_known(CONNECTION) {
        // Collect named headers first: the arena can't be borrowed while removing.
        let mut named: [(u32, u32); 16] = [(0, 0); 16];
        let mut n = 0;
        let arena_base = h.arena().as_ptr() as usize;
        for v in h.get_all_known(CONNECTION) {
            for t in v.split(|&b| b == b',') {
                let t = trim(t);
                // The usual token names a field removed below anyway: no
                // lookup (~110 instructions a response).
                if t.eq_ignore_ascii_case(b"keep-alive") {
                    continue;
                }
                if !t.is_empty() && n < named.len() {
                    named[n] = ((t.as_ptr() as usize - arena_base) as u32, t.len() as u32);
                    n += 1;
                }
            }
        }
        for &(off, len) in &named[..n] {
            match lookup(&h.arena()[off as usize..(off + len) as usize]) {
                // Never dropped by a peer's say-so: the codec states framing
                // itself, and Host is the request's authority.
                HOST | CONTENT_LENGTH | TRANSFER_ENCODING => {}
                UNKNOWN => h.remove_arena_name(off as usize, len as usize),
                k => {
                    h.remove_known(k);
                }
            }
        }
        h.remove_known(CONNECTION);
    }
    for k in HOP_BY_HOP {
        h.remove_known(k);
    }
    // A stored or rebuilt message announces no trailers of its own.
    h.remove_known(TRAILER);
}

#[cfg(test)]
mod tests {
    fn parts(
        authority: Option<&str>,
        fields: &[(&str, &str)],
        stream: bool,
    ) -> Result<RequestHead, Kind> {
        let mut h = RequestHead::default();
        let f = fields.iter().map(|(n, v)| (n.as_bytes(), v.as_bytes()));
        h.from_parts(
            b"POST",
            b"/p?q",
            authority.map(str::as_bytes),
            f,
            stream,
            &HeadLimits::default(),
        )?;
        Ok(h)
    }

    #[test]
    fn a_head_from_parts_is_held_to_the_http1_rules() {
        let h = parts(
            Some("a.example"),
            &[
                ("cookie", "a=1"),
                ("x", "y"),
                ("cookie", "b=2"),
                ("te", "trailers"),
            ],
            true,
        )
        .unwrap();
        assert_eq!((h.method(), h.uri()), (&b"POST"[..], &b"/p?q"[..]));
        assert_eq!(h.host(), Some(&b"a.example"[..]));
        assert_eq!(h.headers.get(b"cookie"), Some(&b"a=1; b=2"[..]));
        assert!(!h.headers.has_known(TE), "hop-by-hop te is not kept");
        // A body of no stated length streams (chunked to an HTTP/1 origin).
        assert_eq!(h.body_len(), BodyLen::Chunked);
        let h = parts(Some("a.example"), &[("content-length", "5")], true).unwrap();
        assert_eq!(h.body_len(), BodyLen::Length(5));
        assert_eq!(
            parts(Some("a.example"), &[], false).unwrap().body_len(),
            BodyLen::None
        );
        // The same Host as the authority is one authority; another is refused.
        assert!(parts(Some("a.example"), &[("host", "A.example")], false).is_ok());
        assert_eq!(
            parts(Some("a.example"), &[("host", "b.example")], false).err(),
            Some(Kind::InvalidHost)
        );
        assert_eq!(parts(None, &[], false).err(), Some(Kind::InvalidHost));
        for bad in [
            ("transfer-encoding", "chunked"),
            ("x", "a\r\nb"),
            ("x", "nul\0"),
            ("bad name", "v"),
            ("content_length", "5"),
        ] {
            assert!(parts(Some("a.example"), &[bad], true).is_err(), "{bad:?}");
        }
        assert_eq!(
            parts(
                Some("a.example"),
                &[("content-length", "1"), ("content-length", "2")],
                true
            )
            .err(),
            Some(Kind::ConflictingLength)
        );
        let many: Vec<(&str, &str)> = (0..600).map(|_| ("x", "y")).collect();
        assert_eq!(
            parts(Some("a.example"), &many, false).err(),
            Some(Kind::HeadersTooLarge)
        );
        let mut h = RequestHead::default();
        let f = std::iter::empty();
        assert_eq!(
            h.from_parts(
                b"GET",
                b"/a b",
                Some(b"a"),
                f,
                false,
                &HeadLimits::default()
            ),
            Err(Kind::InvalidRequestLine)
        );
    }

    use super::*;

    fn req(s: &str) -> Result<Option<(usize, RequestHead)>, Kind> {
        let mut h = RequestHead::default();
        h.parse(s.as_bytes(), &HeadLimits::default())
            .map(|o| o.map(|n| (n, h)))
    }

    #[test]
    fn simple_get() {
        let (n, h) = req("GET /a?b=1 HTTP/1.1\r\nHost: x\r\nUser-Agent: t\r\n\r\nrest")
            .unwrap()
            .unwrap();
        assert_eq!(n, 47);
        assert_eq!(h.method(), b"GET");
        assert_eq!(h.path(), b"/a");
        assert_eq!(h.query(), Some(&b"b=1"[..]));
        assert_eq!(h.host(), Some(&b"x"[..]));
        assert_eq!(h.body_len(), BodyLen::None);
        assert!(h.keep_alive());
    }

    #[test]
    fn partial() {
        assert!(req("GET / HTTP/1.1\r\nHost: x\r\n").unwrap().is_none());
    }

    #[test]
    fn smuggling_shapes_are_refused() {
        let bad = [
            ("POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n", Kind::ConflictingLength),
            ("POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\nContent-Length: 6\r\n\r\n", Kind::ConflictingLength),
            ("POST / HTTP/1.1\r\nHost: x\r\nContent-Length: +5\r\n\r\n", Kind::InvalidContentLength),
            ("POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: xchunked\r\n\r\n", Kind::UnsupportedTransferEncoding),
            ("POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked, identity\r\n\r\n", Kind::UnsupportedTransferEncoding),
            ("POST / HTTP/1.0\r\nTransfer-Encoding: chunked\r\n\r\n", Kind::UnsupportedTransferEncoding),
            ("GET / HTTP/1.1\r\n\r\n", Kind::InvalidHost),
            ("GET / HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n", Kind::InvalidHost),
            ("GET / HTTP/1.1\r\nHost: x\r\nX: a\r\n b\r\n\r\n", Kind::InvalidHeader),
            ("GET / HTTP/1.1\r\nHost: x\r\nBad Name: a\r\n\r\n", Kind::InvalidHeader),
            ("GET / HTTP/1.1\r\nHost: x\r\nX: a\0b\r\n\r\n", Kind::InvalidHeader),
            ("GET / HTTP/1.1\r\nHost: x\r\nX: a\rb\r\n\r\n", Kind::InvalidHeader),
            ("POST /x HTTP/1.1\r\nHost: a\r\nConnection: content-length\r\nContent-Length: 3\r\n\r\n", Kind::ConnectionNamesFraming),
            ("POST /x HTTP/1.1\r\nHost: a\r\nConnection: keep-alive, Content-Length\r\n\r\n", Kind::ConnectionNamesFraming),
            ("POST /x HTTP/1.1\r\nHost: a\r\nConnection: close\r\nConnection: transfer-encoding\r\n\r\n", Kind::ConnectionNamesFraming),
            ("GET /x HTTP/1.1\r\nHost: a\r\nConnection: host\r\n\r\n", Kind::ConnectionNamesFraming),
            ("GET /x HTTP/1.1\r\nHost: a\r\nConnection: :authority\r\n\r\n", Kind::ConnectionNamesFraming),
        ];
        for (s, k) in bad {
            assert_eq!(req(s).err(), Some(k), "{s:?}");
        }
        let (_, h) =
            req("POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\nContent-Length: 5\r\n\r\n")
                .unwrap()
                .unwrap();
        assert_eq!(h.body_len(), BodyLen::Length(5));
        let (_, h) = req("POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: gzip, chunked\r\n\r\n")
            .unwrap()
            .unwrap();
        assert_eq!(h.body_len(), BodyLen::Chunked);
    }

    #[test]
    fn limits() {
        let l = HeadLimits {
            max_header_bytes: 100,
            max_headers: 2,
            max_uri_bytes: 20,
        };
        let mut h = RequestHead::default();
        let long_uri = format!("GET /{} HTTP/1.1\r\nHost: x\r\n\r\n", "a".repeat(30));
        assert_eq!(h.parse(long_uri.as_bytes(), &l), Err(Kind::UriTooLong));
        let partial_long = format!("GET /{}", "a".repeat(200));
        assert_eq!(h.parse(partial_long.as_bytes(), &l), Err(Kind::UriTooLong));
        let many = "GET / HTTP/1.1\r\nHost: x\r\nA: 1\r\nB: 2\r\n\r\n";
        assert_eq!(h.parse(many.as_bytes(), &l), Err(Kind::HeadersTooLarge));
        let big = format!("GET / HTTP/1.1\r\nHost: x\r\nA: {}\r\n", "b".repeat(200));
        assert_eq!(h.parse(big.as_bytes(), &l), Err(Kind::HeadersTooLarge));
    }

    #[test]
    fn responses() {
        let mut r = ResponseHead::default();
        let n = r
            .parse(
                b"HTTP/1.1 999 Odd\r\nContent-Length: 3\r\n\r\nabc",
                &HeadLimits::default(),
            )
            .unwrap()
            .unwrap();
        assert_eq!(n, 39);
        assert_eq!(r.status, 999);
        assert_eq!(r.reason(), b"Odd");
        assert_eq!(r.body_len(Method::Get), Ok(BodyLen::Length(3)));
        assert_eq!(r.body_len(Method::Head), Ok(BodyLen::None));
        r.parse(b"HTTP/1.1 200 OK\r\n\r\n", &HeadLimits::default())
            .unwrap();
        assert_eq!(r.body_len(Method::Get), Ok(BodyLen::UntilClose));
        r.parse(
            b"HTTP/1.1 204 No\r\nContent-Length: 3\r\n\r\n",
            &HeadLimits::default(),
        )
        .unwrap();
        assert_eq!(r.body_len(Method::Get), Ok(BodyLen::None));
    }

    #[test]
    fn hop_by_hop() {
        let (_, mut h) = req("GET / HTTP/1.1\r\nHost: x\r\nConnection: keep-alive, X-Secret, Upgrade\r\nX-Secret: 1\r\nx-secret: 2\r\nKeep-Alive: 5\r\nTE: trailers\r\nX-Ok: 1\r\n\r\n").unwrap().unwrap();
        remove_hop_by_hop(&mut h.headers);
        let names: Vec<_> = h.headers.iter().map(|(n, _)| n.to_vec()).collect();
        assert_eq!(names, vec![b"Host".to_vec(), b"X-Ok".to_vec()]);
        // What a peer may not drop (a response's Connection is not refused
        // as a request's is): framing and Host stay.
        let mut h = Headers::new();
        h.append(
            b"Connection",
            b"host, content-length, Transfer-Encoding, x-a",
        );
        h.append(b"Host", b"x");
        h.append(b"Content-Length", b"3");
        h.append(b"Transfer-Encoding", b"chunked");
        h.append(b"X-A", b"1");
        remove_hop_by_hop(&mut h);
        let names: Vec<_> = h.iter().map(|(n, _)| n.to_vec()).collect();
        assert_eq!(
            names,
            vec![
                b"Host".to_vec(),
                b"Content-Length".to_vec(),
                b"Transfer-Encoding".to_vec()
            ]
        );
    }

    #[test]
    fn control_bytes_in_values_refused() {
        for b in [0u8, b'\r', 0x01, 0x7f, 0x1b] {
            let mut raw = b"GET / HTTP/1.1\r\nHost: x\r\nX-A: a".to_vec();
            raw.push(b);
            raw.extend_from_slice(b"b\r\n\r\n");
            let mut h = RequestHead::default();
            assert!(
                h.parse(&raw, &HeadLimits::default()).is_err(),
                "byte {b:#x}"
            );
        }
        // A bare LF ends the line (httparse accepts LF line endings), so the
        // value never holds it; what follows must still parse as a header.
        let mut h = RequestHead::default();
        assert!(h
            .parse(
                b"GET / HTTP/1.1\r\nHost: x\r\nX-A: a\nb\r\n\r\n",
                &HeadLimits::default()
            )
            .is_err());
    }
}
