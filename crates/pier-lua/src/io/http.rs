//! `pier.http.request{method, url, headers, body, timeout}`: a small HTTP/1.1
//! client (http:// only) over tokio, with connections kept alive in the
//! per-thread pool. Returns `{status, headers, body}` or `nil, err`.

use std::time::Duration;

use bytes::{Buf, BytesMut};
use mlua::{IntoLuaMulti, Lua, MultiValue, Table, Value};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use super::pool;

const MAX_HEAD: usize = 64 << 10;
const MAX_BODY: usize = 64 << 20;
const POOL_IDLE: Duration = Duration::from_secs(30);
const POOL_SIZE: usize = 32;

pub(crate) struct Request {
    method: String,
    host: String,
    port: u16,
    path: String,
    headers: Vec<(String, Vec<u8>)>,
    body: Option<Vec<u8>>,
    timeout: Duration,
}

pub(crate) struct Response {
    status: u16,
    headers: Vec<(String, Vec<u8>)>,
    body: BytesMut,
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

impl Request {
    pub fn from_table(opts: &Table) -> Result<Request, String> {
        let url: String = opts
            .get("url")
            .map_err(|_| "url (string) is required".to_owned())?;
        let (host, port, path) = parse_url(&url).map_err(str::to_owned)?;
        let method: Option<String> = opts.get("method").map_err(|e| e.to_string())?;
        let method = method
            .unwrap_or_else(|| "GET".to_owned())
            .to_ascii_uppercase();
        if method.is_empty() || !method.bytes().all(|c| c.is_ascii_alphabetic()) {
            return Err("bad method".into());
        }
        let mut headers = Vec::new();
        if let Some(h) = opts
            .get::<Option<Table>>("headers")
            .map_err(|e| e.to_string())?
        {
            for pair in h.pairs::<String, Value>() {
                let (k, v) = pair.map_err(|e| e.to_string())?;
                let v = match v {
                    Value::String(s) => s.as_bytes().to_vec(),
                    Value::Integer(n) => n.to_string().into_bytes(),
                    Value::Number(n) => n.to_string().into_bytes(),
                    _ => return Err(format!("bad value for header {k}")),
                };
                if !crate::ffi::valid_name(k.as_bytes()) || !crate::ffi::valid_value(&v) {
                    return Err(format!("bad header {k}"));
                }
                headers.push((k, v));
            }
        }
        let body = opts
            .get::<Option<mlua::LuaString>>("body")
            .map_err(|e| e.to_string())?
            .map(|b| b.as_bytes().to_vec());
        let timeout = match opts
            .get::<Option<f64>>("timeout")
            .map_err(|e| e.to_string())?
        {
            Some(ms) if ms.is_finite() && ms > 0.0 => Duration::from_secs_f64(ms / 1000.0),
            _ => Duration::from_secs(60),
        };
        Ok(Request {
            method,
            host,
            port,
            path,
            headers,
            body,
            timeout,
        })
    }

    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    fn key(&self) -> String {
        format!("http {}:{}", self.host, self.port)
    }

    fn head(&self) -> Vec<u8> {
        let mut h = Vec::with_capacity(256);
        h.extend_from_slice(self.method.as_bytes());
        h.push(b' ');
        h.extend_from_slice(self.path.as_bytes());
        h.extend_from_slice(b" HTTP/1.1\r\n");
        let has = |n: &str| self.headers.iter().any(|(k, _)| k.eq_ignore_ascii_case(n));
        if !has("host") {
            h.extend_from_slice(b"Host: ");
            h.extend_from_slice(self.host.as_bytes());
            if self.port != 80 {
                h.push(b':');
                h.extend_from_slice(itoa::Buffer::new().format(self.port).as_bytes());
            }
            h.extend_from_slice(b"\r\n");
        }
        for (k, v) in &self.headers {
            if k.eq_ignore_ascii_case("content-length") {
                continue;
            }
            h.extend_from_slice(k.as_bytes());
            h.extend_from_slice(b": ");
            h.extend_from_slice(v);
            h.extend_from_slice(b"\r\n");
        }
        if let Some(b) = &self.body {
            h.extend_from_slice(b"Content-Length: ");
            h.extend_from_slice(itoa::Buffer::new().format(b.len()).as_bytes());
            h.extend_from_slice(b"\r\n");
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
    pub async fn send(&self) -> Result<Response, String> {
        let key = self.key();
        let wire = self.head();
        if let Some((s, _)) = pool::take(&key) {
            match self.exchange(s, &wire).await {
                Ok(r) => return Ok(r),
                Err(Failure::BeforeResponse(_)) => {}
                Err(Failure::After(e)) => return Err(e),
            }
        }
        let s = TcpStream::connect((self.host.as_str(), self.port))
            .await
            .map_err(|e| format!("connect: {e}"))?;
        let _ = s.set_nodelay(true);
        self.exchange(s, &wire).await.map_err(|e| match e {
            Failure::BeforeResponse(e) | Failure::After(e) => e,
        })
    }

    async fn exchange(&self, mut s: TcpStream, wire: &[u8]) -> Result<Response, Failure> {
        s.write_all(wire)
            .await
            .map_err(|e| Failure::BeforeResponse(format!("send: {e}")))?;
        let mut buf = BytesMut::with_capacity(8192);
        // Head
        let (status, headers, head_len, keep_alive) = loop {
            let n = s
                .read_buf(&mut buf)
                .await
                .map_err(|e| Failure::BeforeResponse(format!("receive: {e}")))?;
            if n == 0 {
                return Err(if buf.is_empty() {
                    Failure::BeforeResponse("closed".into())
                } else {
                    Failure::After("closed in response head".into())
                });
            }
            let mut hs = [httparse::EMPTY_HEADER; 100];
            let mut resp = httparse::Response::new(&mut hs);
            match resp.parse(&buf) {
                Ok(httparse::Status::Complete(len)) => {
                    let status = resp.code.unwrap_or(0);
                    let mut keep = resp.version == Some(1);
                    let headers: Vec<(String, Vec<u8>)> = resp
                        .headers
                        .iter()
                        .map(|h| (h.name.to_ascii_lowercase(), h.value.to_vec()))
                        .collect();
                    if headers
                        .iter()
                        .any(|(k, v)| k == "connection" && v.eq_ignore_ascii_case(b"close"))
                    {
                        keep = false;
                    }
                    break (status, headers, len, keep);
                }
                Ok(httparse::Status::Partial) if buf.len() < MAX_HEAD => {}
                Ok(httparse::Status::Partial) => {
                    return Err(Failure::After("response head too large".into()))
                }
                Err(e) => return Err(Failure::After(format!("bad response: {e}"))),
            }
        };
        buf.advance(head_len);
        let header = |n: &str| {
            headers
                .iter()
                .find(|(k, _)| k == n)
                .map(|(_, v)| v.as_slice())
        };
        let no_body =
            self.method == "HEAD" || status == 204 || status == 304 || (100..200).contains(&status);
        let after = |e: std::io::Error| Failure::After(format!("receive: {e}"));
        let mut reusable = keep_alive;
        let body = if no_body {
            BytesMut::new()
        } else if header("transfer-encoding").is_some_and(|v| v.eq_ignore_ascii_case(b"chunked")) {
            read_chunked(&mut s, &mut buf).await?
        } else if let Some(cl) = header("content-length") {
            let n: usize = std::str::from_utf8(cl)
                .ok()
                .and_then(|x| x.trim().parse().ok())
                .filter(|n| *n <= MAX_BODY)
                .ok_or_else(|| Failure::After("bad content-length".into()))?;
            while buf.len() < n {
                if s.read_buf(&mut buf).await.map_err(after)? == 0 {
                    return Err(Failure::After("closed in body".into()));
                }
            }
            buf.split_to(n)
        } else {
            reusable = false;
            while s.read_buf(&mut buf).await.map_err(after)? > 0 {
                if buf.len() > MAX_BODY {
                    return Err(Failure::After("body too large".into()));
                }
            }
            buf.split()
        };
        if reusable && buf.is_empty() {
            pool::put(self.key(), s, 0, POOL_IDLE, POOL_SIZE);
        }
        Ok(Response {
            status,
            headers,
            body,
        })
    }
}

enum Failure {
    /// Nothing of a response arrived: a pooled connection may just be stale.
    BeforeResponse(String),
    After(String),
}

async fn more(s: &mut TcpStream, buf: &mut BytesMut) -> Result<(), Failure> {
    if buf.len() > MAX_HEAD + MAX_BODY {
        return Err(Failure::After("body too large".into()));
    }
    match s.read_buf(buf).await {
        Ok(0) => Err(Failure::After("closed in chunked body".into())),
        Ok(_) => Ok(()),
        Err(e) => Err(Failure::After(format!("receive: {e}"))),
    }
}

async fn read_chunked(s: &mut TcpStream, buf: &mut BytesMut) -> Result<BytesMut, Failure> {
    let mut body = BytesMut::new();
    loop {
        let Some(eol) = memchr::memmem::find(buf, b"\r\n") else {
            more(s, buf).await?;
            continue;
        };
        let line = std::str::from_utf8(&buf[..eol])
            .map_err(|_| Failure::After("bad chunk size".into()))?;
        let size_hex = line.split(';').next().unwrap_or("").trim();
        let size = usize::from_str_radix(size_hex, 16)
            .map_err(|_| Failure::After("bad chunk size".into()))?;
        if size > MAX_BODY || body.len() + size > MAX_BODY {
            return Err(Failure::After("body too large".into()));
        }
        if size == 0 {
            // Trailers end with an empty line.
            loop {
                if let Some(end) = memchr::memmem::find(&buf[eol..], b"\r\n\r\n") {
                    buf.advance(eol + end + 4);
                    return Ok(body);
                }
                more(s, buf).await?;
            }
        }
        while buf.len() < eol + 2 + size + 2 {
            more(s, buf).await?;
        }
        buf.advance(eol + 2);
        body.extend_from_slice(&buf[..size]);
        buf.advance(size + 2);
    }
}

/// The Lua result: `res` or `nil, err`.
pub(crate) fn to_lua(lua: &Lua, r: Result<Response, String>) -> mlua::Result<MultiValue> {
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
