//! The proxy's side of the contract: one request/response as the hooks see it.

use std::net::SocketAddr;
use std::task::{Context, Poll};

/// A request (and, from `header_filter` on, its response) as seen by Lua.
///
/// The proxy implements it over its own request type. All names are
/// case-insensitive; values are raw bytes. Methods must not panic (a panic
/// is caught at the FFI boundary and raised in Lua as an internal error).
///
/// Response setters called before a response exists (in `access` or
/// `content`) record headers the proxy adds to the eventual response,
/// whether it comes from the origin or from [`crate::Flow::Respond`]; the
/// getters then see what was recorded so far, and [`status`](Self::status)
/// returns 0.
pub trait HttpView {
    // === request ===
    /// The request method, e.g. `GET`.
    fn method(&self) -> &[u8];
    /// The request target as received: `path?query`.
    fn uri(&self) -> &[u8];
    /// Replaces the request method (an HTTP token, checked by the caller);
    /// false if this view cannot change it.
    fn set_method(&mut self, _method: &[u8]) -> bool {
        false
    }
    /// Replaces the request target (`path?query`); always starts with `/`.
    fn set_uri(&mut self, uri: &[u8]);
    /// The first value of request header `name` (case-insensitive).
    fn req_header(&self, name: &[u8]) -> Option<&[u8]>;
    /// Calls `f(name, value)` for each request header line, in order.
    fn req_headers(&self, f: &mut dyn FnMut(&[u8], &[u8]));
    /// Replaces all values of `name` by `value`; `None` removes the header.
    fn set_req_header(&mut self, name: &[u8], value: Option<&[u8]>);
    /// Appends one more `name: value` line.
    fn add_req_header(&mut self, name: &[u8], value: &[u8]);
    /// The client's address.
    fn client_addr(&self) -> SocketAddr;
    /// The connection's peer: the client, or the proxy that named it
    /// (`real_ip_header`; nginx's `$realip_remote_addr`).
    fn peer_addr(&self) -> SocketAddr {
        self.client_addr()
    }
    /// `http` or `https`.
    fn scheme(&self) -> &[u8];
    /// TLS facts of the connection by nginx variable name (`https`,
    /// `ssl_protocol`, `ssl_cipher`, `ssl_server_name`, `ssl_alpn_protocol`,
    /// `ssl_client_s_dn`, `ssl_session_reused`); None when unknown or
    /// absent (a cleartext connection has only `https` = "").
    fn tls_var(&self, _name: &[u8]) -> Option<&[u8]> {
        None
    }
    /// `ngx.var.trace_id` and `span_id` with `[tracing]` (hex); None
    /// without a trace context.
    fn trace_var(&self, _name: &[u8]) -> Option<&[u8]> {
        None
    }
    /// The `traceparent` for a request a hook makes (`pier.http`): the
    /// request's trace, its server span as the parent; None without one.
    fn trace_child(&self) -> Option<[u8; 55]> {
        None
    }
    /// `pier.trace.set_attribute` / `add_event`: `op` 0 sets attribute
    /// `key` of the request's server span, 1 adds an event named `key`, 2
    /// an attribute of the latest event. Ok(()) also when the request is
    /// not traced or not sampled (nothing is kept); Err(true) past a bound,
    /// Err(false) for a bad key or value.
    fn trace_add(&mut self, _op: u8, _key: &[u8], _value: pier_trace::Value) -> Result<(), bool> {
        Ok(())
    }
    /// The request's host (Host header or absolute-form authority, without port).
    fn host(&self) -> &[u8];
    /// The local port the request arrived on.
    fn server_port(&self) -> u16;
    /// `ngx.var.server_protocol`: "HTTP/1.0", "HTTP/1.1", "HTTP/2.0" or
    /// "HTTP/3.0".
    fn server_protocol(&self) -> &'static [u8] {
        b"HTTP/1.1"
    }

    /// `ngx.req.read_body`: `Ready` once the request body is in memory, or
    /// at once when there is none or this view can't read one. Pending
    /// while the proxy reads it (`cx`'s waker is woken when it is in); a
    /// body that can't be read ends the hook (the proxy answers 413, 408…).
    fn poll_read_body(&mut self, _cx: &mut Context<'_>) -> Poll<()> {
        Poll::Ready(())
    }
    /// The body [`poll_read_body`](Self::poll_read_body) read; None before,
    /// or when there is none.
    fn req_body(&self) -> Option<&[u8]> {
        None
    }
    /// `ngx.req.raw_header`: the request head as received, in HTTP/1 form
    /// (an HTTP/2 request's is rebuilt), appended to `out`; without the
    /// request line when `no_request_line`. The default rebuilds it from
    /// this view.
    fn raw_header(&self, no_request_line: bool, out: &mut Vec<u8>) {
        if !no_request_line {
            out.extend_from_slice(self.method());
            out.push(b' ');
            out.extend_from_slice(self.uri());
            out.extend_from_slice(b" HTTP/1.1\r\n");
        }
        self.req_headers(&mut |n, v| {
            out.extend_from_slice(n);
            out.extend_from_slice(b": ");
            out.extend_from_slice(v);
            out.extend_from_slice(b"\r\n");
        });
        out.extend_from_slice(b"\r\n");
    }

    // === response ===
    /// The response status; 0 before a response exists.
    fn status(&self) -> u16;
    /// Sets the response status.
    fn set_status(&mut self, status: u16);
    /// The first value of response header `name` (case-insensitive).
    fn resp_header(&self, name: &[u8]) -> Option<&[u8]>;
    /// Calls `f(name, value)` for each response header line, in order.
    fn resp_headers(&self, f: &mut dyn FnMut(&[u8], &[u8]));
    /// Replaces all values of response header `name`; `None` removes it.
    fn set_resp_header(&mut self, name: &[u8], value: Option<&[u8]>);
    /// Appends one more response header line.
    fn add_resp_header(&mut self, name: &[u8], value: &[u8]);

    // === time ===
    /// The request's clock snapshot: nanoseconds since the Unix epoch.
    fn now_ns(&self) -> u64;

    // === cache ===
    /// `pier.cache`: apply a cache control to this request (checked by the
    /// caller: phase, key bytes, TTL range); false when the proxy has no
    /// cache controls for this view.
    fn cache(&mut self, _op: CacheOp<'_>) -> bool {
        false
    }
}

/// A `pier.cache` call, validated.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum CacheOp<'a> {
    /// `pier.cache.bypass()` (access): no lookup, no store.
    Bypass,
    /// `pier.cache.set_key(key)` (access): the key instead of the route's.
    Key(&'a [u8]),
    /// `pier.cache.set_ttl(secs)` (access, header_filter): the stored
    /// response's lifetime; 0 means do not store.
    Ttl(u64),
    /// `pier.cache.set_cacheable(bool)` (header_filter).
    Cacheable(bool),
}
