//! `pier.http.request{method, url, headers, body, timeout}`: a small HTTP/1.1
//! client (http:// only) over tokio, with connections kept alive in the
//! per-thread pool. Returns `{status, headers, body}` or `nil, err`.
//!
//! No HTTP/1 parsing of its own: response heads, body framing and bodies go
//! through the proxy's codec (`pier-http`: `ResponseHead::parse`,
//! `ResponseHead::body_len`, `BodyDecoder` over the validating
//! `ChunkedScanner`), and the request line and headers are written by
//! `pier_http::write`. What Lua gives is checked first:
//! a path, host, method or header with bytes that could end the line (CR,
//! LF, NUL, spaces in the path) raises a Lua error (request injection).

use std::time::Duration;

use bytes::{Buf, BytesMut};
use mlua::{IntoLuaMulti, Lua, MultiValue, Table, Value};
use pier_http::{BodyDecoder, BodyLen, HeadLimits, Method, ResponseHead};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use super::pool;

const POOL_IDLE: Duration = Duration::from_secs(30);
const POOL_SIZE: usize = 32;
const DEFAULT_TIMEOUT: Duration = Duration::from_secs(60);

pub(crate) struct Request {
    method: String,
    host: String,
    port: u16,
    path: String,
    headers: Vec<(String, Vec<u8>)>,
    /// `[tracing]`: the hook's request's context, sent on unless the hook
    /// gave its own `traceparent`.
    traceparent: Option<[u8; 55]>,
    body: Option<Vec<u8>>,
    timeout: Duration,
    /// `[lua] http_max_body`.
    max_body: usize,
}

pub(crate) struct Response {
    status: u16,
    headers: Vec<(String, Vec<u8>)>,
    body: BytesMut,
}

/// Why a request failed.
enum Failure {
    /// Nothing of a response arrived: a pooled connection may just be stale.
    BeforeResponse(String),
    After(String),
    /// The body is larger than `[lua] http_max_body`: a Lua error.
    TooLarge,
}

/// `http://host[:port][/path]`
fn parse_url(url: &str) -> Result<(String, u16, String), &'static str> {
    let rest = url
        .strip_prefix("http://")
        .ok_or("only http:// URLs are supported")?;
    let (auth, path) = match rest.find(['/', '?']) {
        Some(i) => (&rest[..i], &rest[i..]),
        None => (rest, "/"),
    };
    let path = if path.starts_with('?') {
        format!("/{path}")
    } else {
        path.to_owned()
    };
    let (host, port) = match auth.rsplit_once(':') {
        Some((h, p)) if !h.ends_with(']') || h.starts_with('[') => {
            (h, p.parse().map_err(|_| "bad port in URL")?)
        }
        _ => (auth, 80),
    };
    if host.is_empty() {
        return Err("no host in URL");
    }
    Ok((
        host.trim_start_matches('[')
            .trim_end_matches(']')
            .to_owned(),
        port,
        path,
    ))
}

/// A request target Pier will write: visible ASCII only (no CR, LF, NUL,
/// space or other control byte that would end or split the request line).
fn valid_path(p: &[u8]) -> bool {
    p.first() == Some(&b'/') && p.iter().all(|&c| c > b' ' && c < 0x7f)
}

/// A host name or IP literal (IPv6 without its brackets).
fn valid_host(h: &[u8]) -> bool {
    !h.is_empty()
        && h.iter().all(|&c| {
            c.is_ascii_alphanumeric() || matches!(c, b'.' | b'-' | b'_' | b':' | b'~' | b'%')
        })
}

fn injection(what: &str) -> mlua::Error {
    mlua::Error::runtime(format!(
        "pier.http.request: bad {what} (CR, LF, NUL, spaces or control bytes would inject into the request)"
    ))
}

/// `opts.timeout` (ms) checked by the one duration conversion: a Lua error
/// for NaN, infinite, negative or over a year.
pub(crate) fn timeout_of(opts: &Table) -> mlua::Result<Duration> {
    match opts.get::<Option<f64>>("timeout")? {
        Some(ms) => crate::limits::lua_ms(ms, "bad timeout to pier.http.request"),
        None => Ok(Duration::ZERO),
    }
}

impl Request {
    /// The request `opts` describe: `Err` raises (bad types, request
    /// injection, a bad timeout), `Ok(Err)` is returned as `nil, err`.
    pub fn from_table(opts: &Table, max_body: usize) -> mlua::Result<Result<Request, String>> {
        let url: String = opts
            .get::<Option<String>>("url")?
            .ok_or_else(|| mlua::Error::runtime("pier.http.request: url (string) is required"))?;
        let (host, port, path) = match parse_url(&url) {
            Ok(u) => u,
            Err(e) => return Ok(Err(e.to_owned())),
        };
        if !valid_path(path.as_bytes()) {
            return Err(injection("path"));
        }
        if !valid_host(host.as_bytes()) {
            return Err(injection("host"));
        }
        let method: Option<String> = opts.get("method")?;
        let method = method
            .unwrap_or_else(|| "GET".to_owned())
            .to_ascii_uppercase();
        if method.is_empty() || !method.bytes().all(|c| c.is_ascii_alphabetic()) {
            return Err(injection("method"));
        }
        let mut headers = Vec::new();
        if let Some(h) = opts.get::<Option<Table>>("headers")? {
            for pair in h.pairs::<mlua::LuaString, Value>() {
                let (k, v) = pair?;
                let k = k.to_str()?.to_owned();
                let v = match v {
                    Value::String(s) => s.as_bytes().to_vec(),
                    Value::Integer(n) => n.to_string().into_bytes(),
                    Value::Number(n) => n.to_string().into_bytes(),
                    _ => return Ok(Err(format!("bad value for header {k}"))),
                };
                if !crate::ffi::valid_name(k.as_bytes()) || !crate::ffi::valid_value(&v) {
                    return Err(injection(&format!("header {k:?}")));
                }
                headers.push((k, v));
            }
        }
        let body = opts
            .get::<Option<mlua::LuaString>>("body")?
            .map(|b| b.as_bytes().to_vec());
        // 0 or none: the default.
        let timeout = match timeout_of(opts)? {
            d if d.is_zero() => DEFAULT_TIMEOUT,
            d => d,
        };
        Ok(Ok(Request {
            method,
            host,
            port,
            path,
            headers,
            body,
            timeout,
            max_body,
            traceparent: crate::ffi::trace_header(),
        }))
    }

    fn key(&self) -> String {
        format!("http {}:{}", self.host, self.port)
    }

    /// The request on the wire (every part checked in `from_table`).
    fn head(&self) -> Vec<u8> {
        use pier_http::write::{header, header_u64, request_line};
        let mut h = Vec::with_capacity(256);
        request_line(&mut h, self.method.as_bytes(), self.path.as_bytes());
        let has = |n: &str| self.headers.iter().any(|(k, _)| k.eq_ignore_ascii_case(n));
        if !has("host") {
            let mut host = self.host.clone();
            if host.contains(':') {
                host = format!("[{host}]");
            }
            if self.port != 80 {
                host.push(':');
                host.push_str(itoa::Buffer::new().format(self.port));
            }
            header(&mut h, b"Host", host.as_bytes());
        }
        if let Some(tp) = self.traceparent.as_ref().filter(|_| !has("traceparent")) {
            header(&mut h, b"traceparent", tp);
        }
        for (k, v) in &self.headers {
            // Framing is Pier's to state.
            if k.eq_ignore_ascii_case("content-length")
                || k.eq_ignore_ascii_case("transfer-encoding")
            {
                continue;
            }
            header(&mut h, k.as_bytes(), v);
        }
        if let Some(b) = &self.body {
            header_u64(&mut h, b"Content-Length", b.len() as u64);
        }
        h.extend_from_slice(b"\r\n");
        if let Some(b) = &self.body {
            h.extend_from_slice(b);
        }
        h
    }

    /// Sends the request, on a pooled connection if there is one (retrying
    /// once on a fresh one if the pooled one turns out dead before any byte
    /// of response).
    async fn send(&self) -> Result<Response, Failure> {
        let key = self.key();
        let wire = self.head();
        if let Some((s, _)) = pool::take(&key) {
            match self.exchange(s, &wire).await {
                Err(Failure::BeforeResponse(_)) => {}
                r => return r,
            }
        }
        let s = TcpStream::connect((self.host.as_str(), self.port))
            .await
            .map_err(|e| Failure::After(format!("connect: {e}")))?;
        let _ = s.set_nodelay(true);
        self.exchange(s, &wire).await.map_err(|e| match e {
            Failure::BeforeResponse(e) => Failure::After(e),
            e => e,
        })
    }

    async fn exchange(&self, mut s: TcpStream, wire: &[u8]) -> Result<Response, Failure> {
        s.write_all(wire)
            .await
            .map_err(|e| Failure::BeforeResponse(format!("send: {e}")))?;
        let mut buf = BytesMut::with_capacity(8192);
        let after = |e: std::io::Error| Failure::After(format!("receive: {e}"));
        // The head, skipping interim (1xx) responses.
        let limits = HeadLimits::default();
        let mut head = ResponseHead::default();
        let mut got_any = false;
        loop {
            if !buf.is_empty() {
                match head.parse(&buf, &limits) {
                    Ok(Some(n)) => {
                        buf.advance(n);
                        if (100..200).contains(&head.status) && head.status != 101 {
                            continue;
                        }
                        break;
                    }
                    Ok(None) => {}
                    Err(_) => return Err(Failure::After("bad response head".into())),
                }
            }
            let n = s.read_buf(&mut buf).await.map_err(|e| {
                if got_any {
                    after(e)
                } else {
                    Failure::BeforeResponse(format!("receive: {e}"))
                }
            })?;
            if n == 0 {
                return Err(if got_any {
                    Failure::After("closed in response head".into())
                } else {
                    Failure::BeforeResponse("closed".into())
                });
            }
            got_any = true;
        }
        let method = if self.method == "HEAD" {
            Method::Head
        } else {
            Method::Get
        };
        let framing = head
            .body_len(method)
            .map_err(|_| Failure::After("bad response framing".into()))?;
        let max = self.max_body;
        // A Content-Length body known to be too large fails before any read.
        if matches!(framing, BodyLen::Length(n) if n > max as u64) {
            return Err(Failure::TooLarge);
        }
        let mut decoder = BodyDecoder::new(framing);
        let mut body = BytesMut::new();
        loop {
            let mut over = false;
            let used = decoder
                .decode(&buf, |data| {
                    if body.len() + data.len() > max {
                        over = true;
                    } else {
                        body.extend_from_slice(data);
                    }
                })
                .map_err(|_| Failure::After("bad chunked body".into()))?;
            if over {
                return Err(Failure::TooLarge);
            }
            buf.advance(used);
            if decoder.is_done() {
                break;
            }
            if s.read_buf(&mut buf).await.map_err(after)? == 0 {
                if decoder.eof() {
                    break;
                }
                return Err(Failure::After(
                    if framing == BodyLen::Chunked {
                        "closed in chunked body"
                    } else {
                        "closed in body"
                    }
                    .into(),
                ));
            }
        }
        let reusable = head.keep_alive() && framing != BodyLen::UntilClose;
        if reusable && buf.is_empty() {
            pool::put(self.key(), s, 0, POOL_IDLE, POOL_SIZE);
        }
        let headers = head
            .headers
            .iter()
            .map(|(k, v)| (String::from_utf8_lossy(k).to_ascii_lowercase(), v.to_vec()))
            .collect();
        Ok(Response {
            status: head.status,
            headers,
            body,
        })
    }
}

/// `pier.http.request(opts)`: `res` or `nil, err`; raises for bad
/// arguments and for a body over `max_body`.
pub(crate) async fn request(lua: &Lua, opts: Table, max_body: usize) -> mlua::Result<MultiValue> {
    let req = match Request::from_table(&opts, max_body)? {
        Ok(r) => r,
        Err(e) => return (Value::Nil, e).into_lua_multi(lua),
    };
    let r = match tokio::time::timeout(req.timeout, req.send()).await {
        Err(_) => Err("timeout".to_owned()),
        Ok(Ok(r)) => Ok(r),
        Ok(Err(Failure::TooLarge)) => {
            return Err(mlua::Error::runtime(format!(
                "pier.http.request: response body larger than {max_body} bytes (lua.http_max_body)"
            )))
        }
        Ok(Err(Failure::BeforeResponse(e) | Failure::After(e))) => Err(e),
    };
    to_lua(lua, r)
}

/// The Lua result: `res` or `nil, err`.
fn to_lua(lua: &Lua, r: Result<Response, String>) -> mlua::Result<MultiValue> {
    match r {
        Err(e) => (Value::Nil, e).into_lua_multi(lua),
        Ok(resp) => {
            let t = lua.create_table()?;
            t.set("status", resp.status)?;
            let h = lua.create_table()?;
            for (k, v) in resp.headers {
                let v = lua.create_string(&v)?;
                match h.get::<Value>(k.as_str())? {
                    Value::Nil => h.set(k, v)?,
                    Value::Table(list) => list.push(v)?,
                    old => h.set(k, lua.create_sequence_from([old, Value::String(v)])?)?,
                }
            }
            t.set("headers", h)?;
            t.set("body", lua.create_string(&resp.body[..])?)?;
            t.into_lua_multi(lua)
        }
    }
}
