//! One request's state as it moves through the phases.

pub use pier_cache::CacheResult;
use pier_http::RequestHead;
use pier_tls::TlsInfo;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Instant;

/// What a connection brings to each of its requests: which listener took
/// it and, over TLS, what the handshake agreed on.
#[derive(Clone, Default)]
pub struct ConnInfo {
    /// Index into `Config::listeners` (None: not from a listener, as in tests).
    pub listener: Option<usize>,
    pub tls: Option<Arc<TlsInfo>>,
    /// The protocol the connection speaks.
    pub proto: pier_session::Protocol,
}

pub struct Session {
    /// The request as the client sent it: logs and (later) cache keys see
    /// this, whatever hooks and header rules do.
    pub req: RequestHead,
    /// The request as it will go upstream, built from `req` once routed:
    /// hop-by-hop headers dropped, an absolute-form target made origin-form,
    /// header rules and hooks (`pier.req.set_uri`, `set_header`) applied.
    pub up_req: RequestHead,
    /// The step the request is at (docs/phases.md; logs of a failure).
    pub step: crate::phases::Step,
    /// The client: the connection's peer, or the address a trusted proxy
    /// named (`real_ip_header`; its port then 0). Limits, logs, Lua and
    /// the forwarding headers' client read it.
    pub client: SocketAddr,
    /// The connection's peer (the proxy, when `real_ip_header` named
    /// another client): whom `trusted_proxies` is asked about.
    pub peer: SocketAddr,
    pub local: SocketAddr,
    /// The connection's listener and TLS.
    pub conn: ConnInfo,
    /// Client IP as text, formatted once per connection (X-Forwarded-For, logs).
    pub client_ip: String,
    /// Index into `State::routes` once routed.
    pub route: Option<usize>,
    /// The per-request clock snapshot: wall-clock ns, read once at the head.
    pub now_ns: u64,
    pub started: Instant,
    /// What went back to the client (for logging).
    pub status: u16,
    /// From the request's head to the upstream's response head, in µs
    /// (0: no upstream answered). For analytics; u32 fits ~71 minutes.
    pub upstream_us: u32,
    pub bytes_sent: u64,
    /// The request head (as decoded) and the body bytes read from the client.
    pub bytes_received: u64,
    pub upstream: Option<SocketAddr>,
    /// The host name of the chosen peer (a server given by name): the SNI
    /// and the Host sent to it. None for an IP literal or a hook's address.
    pub upstream_host: Option<Arc<str>>,
    /// The attempt goes to a cache parent (`crate::tier`): plain HTTP/1,
    /// the client's Host, whatever the route's upstream says.
    pub to_parent: bool,
    pub reason: &'static str,
    /// The client asked to keep the connection (read before hop-by-hop
    /// headers are stripped for the upstream request).
    pub client_keep: bool,
    /// An Upgrade (WebSocket) is allowed through for this request.
    pub upgrade: bool,
    /// A gRPC-web request converted to gRPC (route `grpc_web`).
    pub grpc_web: Option<pier_grpc::web::Form>,
    /// What the cache step did with the request (analytics events).
    pub cache: CacheResult,
    /// `[tracing]`: the request's trace context and spans (kept for the
    /// connection's next request).
    pub trace: Option<Box<crate::trace::RequestTrace>>,
}

/// An address as text, as `IpAddr`'s `Display` writes it; IPv4 without
/// the formatting machinery. Each HTTP/2 and HTTP/3 stream writes its
/// client's, and `to_string` cost ~1,300 instructions a stream (callgrind,
/// h2c /hello).
pub(crate) fn ip_text(ip: std::net::IpAddr) -> String {
    let mut s = String::with_capacity(15);
    ip_text_into(ip, &mut s);
    s
}

/// [`ip_text`] into `s`, replacing what it held (no allocation once it has
/// room for one).
pub(crate) fn ip_text_into(ip: std::net::IpAddr, s: &mut String) {
    s.clear();
    let std::net::IpAddr::V4(v4) = ip else {
        use std::fmt::Write;
        let _ = write!(s, "{ip}");
        return;
    };
    for (i, o) in v4.octets().into_iter().enumerate() {
        if i > 0 {
            s.push('.');
        }
        if o >= 100 {
            s.push(char::from(b'0' + o / 100));
        }
        if o >= 10 {
            s.push(char::from(b'0' + o / 10 % 10));
        }
        s.push(char::from(b'0' + o % 10));
    }
}

impl Session {
    pub fn new(client: SocketAddr, local: SocketAddr) -> Self {
        Session {
            req: RequestHead::default(),
            up_req: RequestHead::default(),
            step: crate::phases::Step::ReadHead,
            client,
            peer: client,
            local,
            conn: ConnInfo::default(),
            client_ip: ip_text(client.ip()),
            route: None,
            now_ns: 0,
            started: Instant::now(),
            status: 0,
            upstream_us: 0,
            bytes_sent: 0,
            bytes_received: 0,
            upstream: None,
            upstream_host: None,
            to_parent: false,
            reason: "",
            client_keep: true,
            upgrade: false,
            grpc_web: None,
            cache: CacheResult::None,
            trace: None,
        }
    }

    /// The client a proxy named for a request (`real_ip_header`) is that
    /// request's only: the next one on the connection (pipelined or kept
    /// alive) starts from the peer again.
    pub(crate) fn forget_named_client(&mut self) {
        if self.client != self.peer {
            self.client = self.peer;
            ip_text_into(self.peer.ip(), &mut self.client_ip);
        }
    }

    /// `https` when the connection is TLS.
    pub fn scheme(&self) -> &'static str {
        if self.conn.tls.is_some() {
            "https"
        } else {
            "http"
        }
    }

    /// [`Session::begin`] at a fresh clock read: the request's start, the
    /// one precise read it takes before the access log's (see pier_clock).
    pub(crate) fn begin_now(&mut self) {
        let t = pier_clock::now();
        self.begin(pier_clock::wall_ns(t));
        self.started = t;
    }

    /// Reset per-request fields, keeping buffers (keep-alive).
    pub(crate) fn begin(&mut self, now_ns: u64) {
        self.up_req.copy_from(&self.req);
        self.step = crate::phases::Step::ReadHead;
        self.route = None;
        self.now_ns = now_ns;
        self.started = pier_clock::recent();
        self.status = 0;
        self.upstream_us = 0;
        self.bytes_sent = 0;
        self.bytes_received = self.req.headers.arena().len() as u64;
        self.upstream = None;
        self.upstream_host = None;
        self.reason = "";
        if let Some(t) = self.trace.as_deref_mut() {
            t.active = false;
        }
        self.client_keep = true;
        self.upgrade = false;
        self.to_parent = false;
        self.grpc_web = None;
        self.cache = CacheResult::None;
    }
}

#[cfg(test)]
mod tests {
    use super::{ip_text, ip_text_into};
    use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

    #[test]
    fn ip_text_writes_what_display_writes() {
        for o in [0u8, 1, 9, 10, 42, 99, 100, 109, 199, 200, 255] {
            for ip in [
                Ipv4Addr::new(o, 0, o, 255),
                Ipv4Addr::new(127, o, 1, o),
                Ipv4Addr::new(o, o, o, o),
            ] {
                assert_eq!(ip_text(IpAddr::V4(ip)), ip.to_string());
            }
        }
        for ip in [
            Ipv6Addr::LOCALHOST,
            "2001:db8::1".parse().unwrap(),
            "::ffff:192.0.2.1".parse().unwrap(),
        ] {
            assert_eq!(ip_text(IpAddr::V6(ip)), ip.to_string());
        }
        // Into a string that held a longer address: replaced, not appended.
        let mut s = ip_text(IpAddr::V6("2001:db8::1".parse().unwrap()));
        ip_text_into(IpAddr::V4(Ipv4Addr::new(10, 0, 0, 7)), &mut s);
        assert_eq!(s, "10.0.0.7");
    }
}
