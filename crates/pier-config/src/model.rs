//! The validated internal config: what the rest of Pier consumes.
//!
//! Two layers (as River and Varnish do): `schema` is what serde reads from the
//! file; this module is what the server runs on, with every default filled in,
//! every duration an integer number of milliseconds/nanoseconds and every
//! cross-reference (route -> upstream) checked.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

#[derive(Debug, Clone)]
pub struct Config {
    /// Worker threads; 0 in the file means "one per core" and is resolved here.
    pub workers: usize,
    /// How long SIGTERM waits for in-flight requests before exiting.
    pub grace_period: Duration,
    /// `[server] upgrade_socket`: where a running Pier hands its listening
    /// sockets to a new binary (`pier upgrade`, SIGUSR2); None: no upgrades.
    pub upgrade_socket: Option<std::path::PathBuf>,
    /// `[server] io_uring` (default true): cleartext HTTP/1 clients are
    /// served through each worker's io_uring (pier-uring) instead of epoll;
    /// a worker whose ring cannot be set up stays on epoll. `PIER_IO_URING=1` (or `0`) in the
    /// environment overrides the file.
    pub io_uring: bool,
    pub listeners: Vec<Listener>,
    pub admin: Option<SocketAddr>,
    /// `[admin]` credentials: a request must carry one of them when set.
    pub admin_auth: AdminAuth,
    /// `[admin.tls]`: the admin listener serves HTTPS.
    pub admin_tls: Option<ListenerTls>,
    /// `[analytics]`.
    pub analytics: Analytics,
    pub routes: Vec<Route>,
    /// Upstream groups by name (BTreeMap: stable iteration order for metrics).
    pub upstreams: BTreeMap<String, Upstream>,
    pub limits: Limits,
    pub timeouts: Timeouts,
    pub access_log: AccessLog,
    /// CIDR ranges no upstream address may fall into (checked on the
    /// normalised address: ::ffff:a.b.c.d is checked as a.b.c.d).
    pub deny_origins: Vec<Cidr>,
    /// Start the in-process demo origin (the embedded default config only).
    pub demo_origin: Option<SocketAddr>,
    /// `[lua]`: global hooks, memory limit, shared dictionaries.
    pub lua: LuaConfig,
    /// `[[limit]]` rules, in file order.
    pub rate_limits: Vec<LimitRule>,
    /// `[http] upgrade`: lower-cased protocol tokens a client may switch to
    /// with `Upgrade` (default `["websocket"]`); never contains "h2c".
    pub upgrade: Vec<String>,
    /// `[http] escaped_slashes`: an encoded `/` (`%2F`) or `\` (`%5C`) in
    /// a path is refused (default), decoded, or kept as it is.
    pub escaped_slashes: EscapedSlashes,
    /// `[http] merge_slashes` (default true): `//a` is `/a`.
    pub merge_slashes: bool,
    /// `[http] allow_trace` (default false): TRACE goes upstream instead
    /// of a 405 (it echoes the request, credentials included).
    pub allow_trace: bool,
    /// `[http] forwarded` (default false): an RFC 7239 `Forwarded` field
    /// (`for`, `proto`, `host`) goes upstream beside `X-Forwarded-*`.
    pub forwarded: bool,
    /// `[http2]`.
    pub http2: Http2,
    /// `[cache.NAME]` zones.
    pub caches: Vec<CacheZone>,
    /// `[resolver]`: re-resolution of upstream host names.
    pub resolver: Resolver,
    /// `[tracing]`: None = off (no trace context read or written).
    pub tracing: Option<Tracing>,
    /// `[redis]`: the fleet's Redis; None = this Pier is on its own.
    pub redis: Option<Redis>,
}

/// `[tracing]`.
#[derive(Debug, Clone, PartialEq)]
pub struct Tracing {
    /// Where spans go: OTLP/HTTP (`http://HOST:4318/v1/traces`).
    pub endpoint: String,
    /// The ratio of root requests (no sampled parent) that are sampled.
    pub sample: f64,
    pub service_name: String,
    /// Spans waiting for export at most; past it they are dropped, counted.
    pub queue: usize,
}

/// `[redis]`: the Redis every Pier of a fleet talks to.
#[derive(Debug, Clone, PartialEq)]
pub struct Redis {
    /// `redis://[:password@]HOST[:PORT][/DB]`.
    pub url: String,
    /// The pub/sub channel purges and bans travel on.
    pub channel: String,
    /// Connecting to Redis and each command give up after this.
    pub timeout: Duration,
    /// How often a node exchanges its global limits' counts with Redis.
    pub sync_interval: Duration,
    /// Prefix of the keys global limits count under (`PREFIX:rl:...`).
    pub key_prefix: String,
    /// Redis Sentinel addresses ("HOST:PORT"): the primary is the one they
    /// name `master_name`, asked at each new connection. Empty: `url`.
    pub sentinels: Vec<String>,
    pub master_name: String,
}

impl Redis {
    /// How long a global limit decides on its last totals from Redis
    /// before it counts as cut off: two missed exchanges and one timeout.
    pub fn stale_after(&self) -> Duration {
        self.sync_interval * 2 + self.timeout
    }
}

/// Credentials the admin endpoint asks for (it shows client addresses),
/// always in the `Authorization` header: never a cookie or a query string,
/// which a link or a form on another site could send.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct AdminAuth {
    /// `Authorization: Bearer TOKEN`.
    pub token: Option<String>,
    /// `Authorization: Basic` user and password.
    pub basic: Option<(String, String)>,
    /// Host names (lower case) the admin endpoint answers to, besides IP
    /// literals and, on loopback, `localhost` (DNS rebinding).
    pub hosts: Vec<String>,
}

impl AdminAuth {
    pub fn any(&self) -> bool {
        self.token.is_some() || self.basic.is_some()
    }
}

/// What a `[admin] token` (or `pier proxy --admin-token`) must look like:
/// it goes in a header, compared as bytes.
pub fn check_admin_token(t: &str) -> Result<(), String> {
    if t.len() < 8 {
        Err("must be at least 8 characters".into())
    } else if !t
        .bytes()
        .all(|b| b.is_ascii_graphic() && !matches!(b, b';' | b',' | b'"' | b'\\'))
    {
        Err("must be visible ASCII without spaces, quotes, backslashes, ';' or ','".into())
    } else {
        Ok(())
    }
}

/// An admin endpoint reachable from other machines must ask for
/// credentials: it shows client addresses and can purge the cache.
pub fn check_admin_exposure(addr: std::net::SocketAddr, auth: &AdminAuth) -> Result<(), String> {
    if addr.ip().is_loopback() || auth.any() {
        return Ok(());
    }
    Err(format!(
        "the admin endpoint on {addr} is not on a loopback address: set `[admin] token` (or `user` and `password`), or listen on 127.0.0.1"
    ))
}

/// `[analytics]`: per-minute rollups of every request, kept on disk.
#[derive(Debug, Clone, PartialEq)]
pub struct Analytics {
    pub enabled: bool,
    /// The SQLite file; None keeps the history in memory only.
    pub path: Option<PathBuf>,
    pub keep_minutes: Duration,
    pub keep_hours: Duration,
    pub keep_days: Duration,
    /// (host, route) rows per minute; past it, events count in "(other)".
    pub max_keys: usize,
    /// Events waiting for the analytics thread; past it they are dropped
    /// and counted, never waited for.
    pub queue: usize,
    pub kafka: Option<AnalyticsKafka>,
}

impl Default for Analytics {
    fn default() -> Analytics {
        Analytics {
            enabled: true,
            path: None,
            keep_minutes: Duration::from_secs(2 * 86_400),
            keep_hours: Duration::from_secs(90 * 86_400),
            keep_days: Duration::from_secs(3 * 365 * 86_400),
            max_keys: 1000,
            queue: 65_536,
            kafka: None,
        }
    }
}

/// `[analytics.kafka]`.
#[derive(Debug, Clone, PartialEq)]
pub struct AnalyticsKafka {
    pub brokers: Vec<String>,
    pub topic: String,
    pub batch_size: usize,
    pub linger: Duration,
    /// none, gzip, snappy, lz4 or zstd.
    pub compression: String,
    pub queue: usize,
}

/// `[resolver]`: how upstream servers given by host name are re-resolved
/// while running.
#[derive(Debug, Clone, PartialEq)]
pub struct Resolver {
    /// DNS servers asked (UDP, then TCP); empty = the system's
    /// (`/etc/resolv.conf`).
    pub nameservers: Vec<SocketAddr>,
    /// Floor and ceiling on a record's TTL: how soon and how late a name is
    /// asked again.
    pub min_ttl: Duration,
    pub max_ttl: Duration,
    /// One resolution (every query and retry of it) gives up after this.
    pub timeout: Duration,
}

impl Default for Resolver {
    fn default() -> Resolver {
        Resolver {
            nameservers: Vec::new(),
            min_ttl: Duration::from_secs(5),
            max_ttl: Duration::from_secs(300),
            timeout: Duration::from_secs(5),
        }
    }
}

/// `[cache.NAME]`: a memory cache zone, shared by every worker.
#[derive(Debug, Clone, PartialEq)]
pub struct CacheZone {
    pub name: String,
    pub memory: usize,
    pub max_object: usize,
    /// `max_variants`: Vary variants kept per key (the oldest goes).
    pub max_variants: usize,
    /// `disk_dir` and its settings: a disk tier behind the memory tier.
    pub disk: Option<CacheDisk>,
    /// `parents`: a tiered cache; a miss asks the parent Pier that owns the
    /// key on a consistent-hash ring before the origin (docs/fleet.md).
    pub parents: Vec<SocketAddr>,
}

impl CacheZone {
    /// Whether `other` stores the same way, so that a reload keeps the
    /// contents (a change of `parents` does not empty the cache).
    pub fn same_storage(&self, other: &CacheZone) -> bool {
        self.name == other.name
            && self.memory == other.memory
            && self.max_object == other.max_object
            && self.max_variants == other.max_variants
            && self.disk == other.disk
    }
}

/// A zone's disk tier (`disk_dir`, `disk`, `promote_hits`, `disk_min_ttl`,
/// `disk_queue`).
#[derive(Debug, Clone, PartialEq)]
pub struct CacheDisk {
    pub dir: std::path::PathBuf,
    pub max_bytes: u64,
    pub promote_hits: u32,
    pub min_ttl: Duration,
    pub queue: usize,
}

/// `[route.cache]`.
#[derive(Debug, Clone, PartialEq)]
pub struct RouteCache {
    /// Index into `Config::caches`.
    pub zone: usize,
    /// TTL by status for responses with no freshness of their own.
    pub ttl: Vec<(u16, Duration)>,
    pub override_origin: bool,
    pub lock_timeout: Duration,
    pub hit_for_miss: Duration,
    /// `grace`: how long past its freshness a stored response may still be
    /// served when the origin fails (connect error, timeout, 5xx).
    pub grace: Duration,
    /// `key`: what the cache key holds beyond scheme, host, path (and query).
    pub key: Option<CacheKey>,
    /// `strip_tags`: drop `Surrogate-Key` / `Cache-Tag` from client responses.
    pub strip_tags: bool,
    /// `set_cookie = "store"`: responses carrying `Set-Cookie` are stored
    /// (and the cookie replayed), as RFC 9111 allows; the default `"pass"`
    /// does not store them unless they are `public`, as Varnish and nginx.
    pub store_set_cookie: bool,
}

/// `[route.cache.key]`: the cache key's parts beyond scheme + host + path.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct CacheKey {
    /// Request headers whose values join the key (lower-cased names).
    pub headers: Vec<String>,
    /// Cookies whose values join the key.
    pub cookies: Vec<String>,
    pub query: QueryKey,
    /// Only these query parameters count (empty: all).
    pub query_include: Vec<String>,
    /// These query parameters never count.
    pub query_exclude: Vec<String>,
}

/// `[route.cache.key] query`: the query string as received, its
/// parameters sorted, or none of it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum QueryKey {
    #[default]
    Keep,
    Sort,
    Drop,
}

/// A content coding Pier makes and undoes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Coding {
    Gzip,
    Br,
    Zstd,
}

impl Coding {
    /// The token in `Content-Encoding` / `Accept-Encoding`.
    pub fn token(self) -> &'static str {
        match self {
            Coding::Gzip => "gzip",
            Coding::Br => "br",
            Coding::Zstd => "zstd",
        }
    }
    pub fn from_token(t: &[u8]) -> Option<Coding> {
        if t.eq_ignore_ascii_case(b"gzip") || t.eq_ignore_ascii_case(b"x-gzip") {
            Some(Coding::Gzip)
        } else if t.eq_ignore_ascii_case(b"br") {
            Some(Coding::Br)
        } else if t.eq_ignore_ascii_case(b"zstd") {
            Some(Coding::Zstd)
        } else {
            None
        }
    }
}

/// `[route.compress]`: response compression.
#[derive(Debug, Clone, PartialEq)]
pub struct Compress {
    /// Media types compressed (`text/*` style wildcards allowed).
    pub types: Vec<String>,
    /// Bodies of a known length below this are sent as they are.
    pub min_size: u64,
    /// One level for every coding, clamped to each one's range; None: each
    /// coding's default (gzip 6, br 5, zstd 3).
    pub level: Option<i32>,
    /// Codings offered, in the server's order of preference.
    pub algorithms: Vec<Coding>,
    /// The coding of the one copy a cache keeps (with `[route.cache]`).
    pub store: Coding,
}

/// `[http2]`: HTTP/2 SETTINGS Pier sends and the bounds of its defences.
#[derive(Debug, Clone, PartialEq)]
pub struct Http2 {
    pub max_concurrent_streams: u32,
    /// Per-stream receive window (the connection's is at least this).
    pub initial_window_size: u32,
    pub max_frame_size: u32,
    /// Largest decoded header list (CONTINUATION floods end here).
    pub max_header_list_size: u32,
    /// Bytes buffered for sending per stream.
    pub max_send_buffer: usize,
    /// Streams reset by the client kept for protocol purposes.
    pub max_concurrent_reset_streams: usize,
    /// Streams opened and reset before Pier accepted them (rapid reset,
    /// CVE-2023-44487): past it, GOAWAY.
    pub max_pending_accept_reset_streams: usize,
    /// Streams Pier itself had to reset for protocol errors: past it, GOAWAY.
    pub max_local_error_reset_streams: usize,
    /// Response header blocks encoded with HPACK's dynamic table (fewer
    /// bytes for fields repeated across a connection's responses) instead
    /// of the static table only (less CPU, as nginx and HAProxy encode).
    pub hpack_dynamic_table: bool,
}

impl Default for Http2 {
    fn default() -> Http2 {
        Http2 {
            max_concurrent_streams: 128,
            initial_window_size: 1 << 20,
            max_frame_size: 16_384,
            max_header_list_size: 64 * 1024,
            max_send_buffer: 256 * 1024,
            max_concurrent_reset_streams: 50,
            max_pending_accept_reset_streams: 50,
            max_local_error_reset_streams: 64,
            hpack_dynamic_table: false,
        }
    }
}

#[derive(Debug, Clone)]
pub struct Listener {
    pub name: String,
    pub addr: SocketAddr,
    /// `tls`: HTTPS on this listener.
    pub tls: Option<ListenerTls>,
    /// `redirect_https`: every request is answered with a redirect to the
    /// same URL over https.
    pub redirect_https: Option<HttpsRedirect>,
    /// `h2c`: cleartext HTTP/2 with prior knowledge is accepted too.
    pub h2c: bool,
    /// `h2c = "only"`: and HTTP/1 is not (a connection that does not open
    /// with the HTTP/2 preface is closed).
    pub h2c_only: bool,
    /// `http3`: HTTP/3 over QUIC on the same port (UDP), and `Alt-Svc` on
    /// the TCP responses that points browsers to it. TLS listeners only.
    pub http3: bool,
    /// `quic_retry`: a Retry for every new QUIC client, not only under load.
    pub quic_retry: bool,
    /// `quic_early_data`: 0-RTT on QUIC resumptions, for replay-safe
    /// requests only (others get 425 Too Early).
    pub quic_early_data: bool,
    /// `proxy_protocol`: a PROXY protocol header (v1 or v2) opens every
    /// connection, from one of `trusted_proxies`.
    pub proxy_protocol: bool,
    /// `real_ip_header`: the client is the right-most address of this
    /// header that is not one of `trusted_proxies` (nginx's `real_ip_header`
    /// with `set_real_ip_from` and `real_ip_recursive on`).
    pub real_ip_header: Option<RealIpHeader>,
    /// `trusted_proxies`: clients whose Forwarded / X-Forwarded-* headers
    /// are passed on (extended); from anyone else they are replaced.
    pub trusted_proxies: Vec<Cidr>,
}

/// `[[listener]] real_ip_header`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RealIpHeader {
    XForwardedFor,
    /// RFC 7239's `for=` parameters.
    Forwarded,
}

/// `[http] escaped_slashes`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum EscapedSlashes {
    #[default]
    Reject,
    Decode,
    Keep,
}

impl Listener {
    pub fn plain(name: impl Into<String>, addr: SocketAddr) -> Listener {
        Listener {
            name: name.into(),
            addr,
            tls: None,
            redirect_https: None,
            h2c: false,
            h2c_only: false,
            http3: false,
            quic_retry: false,
            quic_early_data: false,
            proxy_protocol: false,
            real_ip_header: None,
            trusted_proxies: Vec::new(),
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HttpsRedirect {
    /// 301, 302, 307 or 308.
    pub status: u16,
    /// Port in the Location; None = the https default (443).
    pub port: Option<u16>,
}

/// A certificate chain and its private key (PEM files).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CertFiles {
    pub cert: PathBuf,
    pub key: PathBuf,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum UnknownSni {
    /// Serve the default (first) certificate.
    Default,
    /// Fail the handshake (unrecognized_name).
    Refuse,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum TlsVersion {
    Tls12,
    Tls13,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ClientAuth {
    Off,
    /// Asked for; a client without one gets in, one with a bad one does not.
    Optional,
    Required,
}

/// `[listener.tls]`.
#[derive(Debug, Clone)]
pub struct ListenerTls {
    /// The first is the default certificate. Names come from each
    /// certificate's own subjectAltName list.
    pub certificates: Vec<CertFiles>,
    pub unknown_sni: UnknownSni,
    pub min_version: TlsVersion,
    /// ALPN protocols offered, in preference order.
    pub alpn: Vec<String>,
    /// Server-side session cache entries (0 = none).
    pub session_cache: usize,
    /// Stateless resumption tickets (keys shared by all workers, rotated).
    pub session_tickets: bool,
    /// Ticket key files shared by a fleet (the first encrypts); empty:
    /// the process makes its own keys.
    pub session_ticket_keys: Vec<PathBuf>,
    pub client_ca: Option<PathBuf>,
    pub client_auth: ClientAuth,
    pub handshake_timeout: Duration,
    /// Handshakes in progress at once, all workers together, counted from
    /// a complete ClientHello; more are closed (dropped and counted).
    pub max_handshakes: usize,
    /// Connections still waiting for their ClientHello, all workers
    /// together; past it the oldest is closed for the new one.
    pub max_pending_hellos: usize,
    /// Staple OCSP responses for certificates whose chain names a
    /// responder (nginx's `ssl_stapling`, on by default as in Caddy).
    pub ocsp_stapling: bool,
    /// A responder URL (`http://…`) used instead of the certificates' own
    /// (nginx's `ssl_stapling_responder`).
    pub ocsp_responder: Option<String>,
    /// A certificate for these names obtained and renewed from an ACME CA.
    pub acme: Option<Acme>,
}

/// `[listener.tls.acme]`.
#[derive(Debug, Clone, PartialEq)]
pub struct Acme {
    /// DNS names, lower-case; the first names the stored files.
    pub domains: Vec<String>,
    pub email: Option<String>,
    /// The CA's directory URL.
    pub directory: String,
    /// CA certificates (PEM) that sign the directory's HTTPS certificate,
    /// instead of the system's (a test CA such as Pebble).
    pub directory_ca: Option<PathBuf>,
    /// Where the account and the certificates are kept.
    pub storage: PathBuf,
    /// Renew this long before the certificate expires.
    pub renew_before: Duration,
    /// How the CA's validation is answered.
    pub challenge: AcmeChallenge,
    /// Follow the CA's renewal windows (ARI, RFC 9773) when it offers them.
    pub ari: bool,
    /// Names outside `domains` get a certificate at their first handshake,
    /// if the `ask` URL approves them.
    pub on_demand: Option<OnDemand>,
}

/// `challenge` of `[listener.tls.acme]`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AcmeChallenge {
    /// RFC 8737, on the TLS listener itself (port 443).
    TlsAlpn01,
    /// RFC 8555 §8.3, `/.well-known/acme-challenge/` on a plain HTTP
    /// listener (port 80).
    Http01,
}

/// `on_demand = true` of `[listener.tls.acme]` (Caddy's on-demand TLS).
#[derive(Debug, Clone, PartialEq)]
pub struct OnDemand {
    /// `http://…`: `GET <ask>?domain=NAME`, a 2xx approves the name.
    pub ask: String,
    /// New names (asks) per minute, for the process.
    pub per_minute: u32,
    /// Names held at most (each has its certificate and its renewals).
    pub max: usize,
}

/// Let's Encrypt's production directory.
pub const LETS_ENCRYPT: &str = "https://acme-v02.api.letsencrypt.org/directory";

impl ListenerTls {
    /// One certificate, every other setting at its documented default.
    pub fn single(files: CertFiles) -> ListenerTls {
        ListenerTls {
            certificates: vec![files],
            unknown_sni: UnknownSni::Default,
            min_version: TlsVersion::Tls12,
            alpn: vec!["http/1.1".to_string()],
            session_cache: 20_000,
            session_tickets: true,
            session_ticket_keys: Vec::new(),
            client_ca: None,
            client_auth: ClientAuth::Off,
            handshake_timeout: Duration::from_secs(10),
            max_handshakes: 1024,
            max_pending_hellos: 4096,
            ocsp_stapling: true,
            ocsp_responder: None,
            acme: None,
        }
    }
}

/// `[upstream.NAME.tls]`.
#[derive(Debug, Clone, PartialEq)]
pub struct UpstreamTls {
    /// SNI and the name verified; None = each server's host name, or its IP.
    pub server_name: Option<String>,
    pub verify: bool,
    /// Trust these CAs; None = the system's trust store.
    pub ca: Option<PathBuf>,
    /// Client certificate for mTLS to the origin.
    pub client_cert: Option<CertFiles>,
    pub session_resumption: bool,
}

impl UpstreamTls {
    /// Verified TLS with the system's trust store.
    pub fn system() -> UpstreamTls {
        UpstreamTls {
            server_name: None,
            verify: true,
            ca: None,
            client_cert: None,
            session_resumption: true,
        }
    }
}

#[derive(Debug, Clone)]
pub struct Route {
    pub name: String,
    /// None = any host. Lower-cased; a leading "*." matches any subdomain.
    pub host: Option<HostMatch>,
    pub path: PathMatch,
    /// Name of an entry in `Config::upstreams` (validated to exist), or ""
    /// when the route has no upstream: then it has a `content` hook, which
    /// answers every request.
    pub upstream: String,
    /// `[route.lua]` hooks.
    pub lua: RouteLua,
    /// `[route.headers]`: applied after the upstream's rules (so the
    /// route's `set` wins).
    pub headers: HeaderRules,
    /// The Host header sent upstream; None = use the upstream's `host_header`.
    pub host_header: Option<HostHeader>,
    /// `grpc_web`: gRPC-web requests go upstream as gRPC, answers come back
    /// as gRPC-web (the trailers as the body's last frame).
    pub grpc_web: bool,
    /// `[route.cors]`.
    pub cors: Option<Cors>,
    /// `[route.cache]`.
    pub cache: Option<RouteCache>,
    /// `[route.compress]`.
    pub compress: Option<Compress>,
    /// `[route.tracing] sample`: this route's root sampling ratio instead
    /// of `[tracing] sample`.
    pub trace_sample: Option<f64>,
}

/// `[route.cors]`.
#[derive(Debug, Clone, PartialEq)]
pub struct Cors {
    /// Exact origins (`https://app.example`), or `*`.
    pub allow_origins: Vec<String>,
    pub allow_methods: Vec<String>,
    pub allow_headers: Vec<String>,
    pub expose_headers: Vec<String>,
    pub max_age: Duration,
    pub allow_credentials: bool,
}

/// Header rewrite rules (`[route.headers]`, `[upstream.NAME.headers]`).
/// Names keep the case they were written in and are compared
/// case-insensitively; within one table they are distinct (ignoring case).
/// Within one scope the rules apply in the order remove, set, add; a
/// name is never both removed and set/added in one scope.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct HeaderRules {
    /// Replace (or add) these request headers before the request goes upstream.
    pub request_set: Vec<(String, String)>,
    /// Append these request headers (keeping any already there).
    pub request_add: Vec<(String, String)>,
    /// Remove these request headers (names, compared case-insensitively).
    pub request_remove: Vec<String>,
    /// Replace (or add) these headers in every response of the route.
    pub response_set: Vec<(String, String)>,
    /// Append these headers to every response of the route.
    pub response_add: Vec<(String, String)>,
    /// Remove these headers from every response of the route.
    pub response_remove: Vec<String>,
}

impl HeaderRules {
    /// No rule at all.
    pub fn is_empty(&self) -> bool {
        self.request_set.is_empty()
            && self.request_add.is_empty()
            && self.request_remove.is_empty()
            && self.response_set.is_empty()
            && self.response_add.is_empty()
            && self.response_remove.is_empty()
    }
}

/// The Host header sent upstream.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub enum HostHeader {
    /// The client's Host (default; when the client sent none, the upstream server's host:port).
    #[default]
    Preserve,
    /// The upstream server's host:port (nginx's default `$proxy_host`).
    Upstream,
    /// This literal value.
    Literal(String),
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HostMatch {
    Exact(String),
    /// "*.example.com" stored as ".example.com".
    Suffix(String),
}

/// Path matchers. Regexes that are really exact/prefix/suffix comparisons
/// (`^/a$`, `^/a`, `\.jpg$` with no other metacharacters) are compiled to the
/// plain variants at load time (the Varnish lesson).
#[derive(Debug, Clone)]
pub enum PathMatch {
    Any,
    Exact(String),
    Prefix(String),
    Suffix(String),
    Regex(regex::Regex),
}

#[derive(Debug, Clone)]
pub struct Upstream {
    pub name: String,
    pub servers: Vec<UpstreamServer>,
    pub balance: Balance,
    pub health_check: Option<HealthCheck>,
    /// Passive health: mark a server down after this many consecutive
    /// failures (0 = off); it comes back through the active check, or after
    /// `passive_recover` when no active check is configured.
    pub max_fails: u32,
    pub passive_recover: Duration,
    /// Extra attempts after the first (0 = no retry).
    pub retries: u32,
    /// Retries may add at most this fraction of requests (plus `retry_min_per_sec`).
    pub retry_budget_ratio: f64,
    pub retry_min_per_sec: u32,
    /// Idle upstream connections kept per server (shared by all threads).
    pub pool_idle_per_server: usize,
    /// 0 = unlimited.
    pub max_connections_per_server: usize,
    /// In-flight requests per server (0 = off); past it Pier answers 503
    /// instead of piling more on the origin (Pingora's origin protection).
    pub max_inflight_per_server: u32,
    /// `[upstream.NAME.headers]`: applied before the route's rules.
    pub headers: HeaderRules,
    /// The Host header sent upstream, unless the route sets its own.
    pub host_header: HostHeader,
    /// `[upstream.NAME.tls]`: None = cleartext.
    pub tls: Option<UpstreamTls>,
    /// `protocol`: HTTP/1.1, or HTTP/2 over TLS (`h2`) or cleartext (`h2c`).
    pub protocol: UpstreamProtocol,
    /// Streams per HTTP/2 connection before another connection is opened.
    pub h2_max_streams: usize,
    /// `send_proxy_protocol`: each connection to a server opens with a
    /// PROXY protocol header naming the client (and is then the client's
    /// alone: never reused for another).
    pub send_proxy_protocol: Option<SendProxy>,
    /// Servers given by host name with `resolve = true`: their addresses
    /// (in `servers`, each with `host` set) are re-resolved while running.
    /// Validation does not resolve them: whoever builds the running state
    /// fills `servers` (see pier-proxy's `dns`).
    pub resolve: Vec<NamedServer>,
}

/// An upstream server given by host name, re-resolved while running.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct NamedServer {
    /// Lower-cased host name, no trailing dot.
    pub host: std::sync::Arc<str>,
    pub port: u16,
    pub weight: u32,
}

/// The PROXY protocol version sent to an upstream.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum SendProxy {
    V1,
    V2,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum UpstreamProtocol {
    #[default]
    Http1,
    /// HTTP/2 over TLS (ALPN h2).
    H2,
    /// HTTP/2 over cleartext TCP, prior knowledge.
    H2c,
    /// Over TLS, ALPN offers `h2` then `http/1.1`; the server's pick is
    /// remembered per peer.
    Auto,
}

#[derive(Debug, Clone)]
pub struct UpstreamServer {
    pub addr: SocketAddr,
    pub weight: u32,
    /// The host name `addr` was resolved from (None for an IP literal): the
    /// SNI and the Host sent to it.
    pub host: Option<std::sync::Arc<str>>,
}

impl UpstreamServer {
    /// A server given as an IP address.
    pub fn new(addr: SocketAddr, weight: u32) -> UpstreamServer {
        UpstreamServer {
            addr,
            weight,
            host: None,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Balance {
    RoundRobin,
    WeightedRoundRobin,
    LeastConn,
    /// Power of two random choices.
    Random2,
    /// Consistent hashing (ring) on a key taken from the request.
    Hash(HashKey),
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HashKey {
    Header(String),
    Cookie(String),
    ClientIp,
    Path,
}

#[derive(Debug, Clone)]
pub struct HealthCheck {
    pub kind: HealthKind,
    pub interval: Duration,
    pub timeout: Duration,
    /// Consecutive successes to mark up / failures to mark down.
    pub rise: u32,
    pub fall: u32,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HealthKind {
    Tcp,
    /// GET `path`, healthy on a status in `expect_min..=expect_max`.
    Http {
        path: String,
        host: Option<String>,
        expect_min: u16,
        expect_max: u16,
    },
    /// `grpc.health.v1.Health/Check` over cleartext HTTP/2: healthy when the
    /// answer is SERVING with grpc-status 0. `service` "" = the whole server.
    Grpc {
        service: String,
    },
}

#[derive(Debug, Clone)]
pub struct Limits {
    pub max_header_bytes: usize,
    pub max_headers: usize,
    pub max_uri_bytes: usize,
    /// 0 = unlimited.
    pub max_body_bytes: u64,
    /// Largest request body a hook may read into memory
    /// (`ngx.req.read_body`); larger gets 413.
    pub max_buffered_body_bytes: u64,
    pub max_connections: usize,
    /// Bytes per second a client must sustain while sending a request body,
    /// checked after its first 10 s (0 = off).
    pub body_min_rate: u64,
    /// Open connections per client IP (0 = off).
    pub max_connections_per_ip: u32,
}

#[derive(Debug, Clone)]
pub struct Timeouts {
    pub client_header: Duration,
    pub client_idle: Duration,
    pub upstream_connect: Duration,
    pub upstream_response: Duration,
    pub upstream_idle: Duration,
    /// Idle timeout of an upgraded connection (e.g. WebSocket): closed
    /// after this long with no byte in either direction.
    pub tunnel_idle: Duration,
    /// How long an HTTP/2 connection is kept after its GOAWAY once no
    /// stream is open (the client may never acknowledge the PING).
    pub client_goaway: Duration,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AccessLog {
    Off,
    Stdout,
    File(std::path::PathBuf),
}

/// An IP network; `contains` normalises IPv4-mapped IPv6 before comparing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Cidr {
    pub addr: std::net::IpAddr,
    pub prefix: u8,
}

// === Lua ===

/// Lua code from the config: inline, or a file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LuaSource {
    /// `name` is the Lua chunk name in error messages, e.g. "route api access".
    Inline { code: String, name: String },
    /// Resolved against the config file's directory; checked to exist at load.
    File(PathBuf),
}

/// `[lua]`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LuaConfig {
    /// Runs once in every Lua state when it is created.
    pub init: Option<LuaSource>,
    /// Runs in every Lua state after `init`.
    pub init_worker: Option<LuaSource>,
    /// Lua heap bytes per state (0 = unlimited).
    pub memory_limit: usize,
    /// Extra `package.path` patterns for `require` (e.g. "/etc/pier/lua/?.lua");
    /// relative ones are made absolute against the config file's directory.
    pub package_path: Vec<String>,
    /// `[lua.shared] NAME = "10m"`: shared dictionaries, `(name, capacity
    /// bytes)`, sorted by name.
    pub shared: Vec<(String, usize)>,
    /// Bytes a hook may buffer as a local response body (`pier.say`,
    /// `pier.print`, `pier.exit`'s body).
    pub max_response_body: usize,
    /// Bytes a cosocket may buffer while receiving.
    pub socket_buffer: usize,
    /// Bytes of a `pier.http` response body.
    pub http_max_body: usize,
    /// Cosockets one request (or timer run) may hold at once.
    pub max_sockets_per_request: usize,
    /// Cosockets alive at once on one worker thread.
    pub max_sockets_per_worker: usize,
    /// Longest a cosocket connect waits for a pooled connection to be given
    /// back when the pool has none idle and as many in use as it keeps
    /// (zero: it opens one at once, as ngx_lua does).
    pub socket_pool_wait: std::time::Duration,
}

/// `[route.lua]`: a route's hooks, one per request phase.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RouteLua {
    pub access: Option<LuaSource>,
    pub content: Option<LuaSource>,
    pub balancer: Option<LuaSource>,
    pub upstream_request: Option<LuaSource>,
    pub header_filter: Option<LuaSource>,
    pub body_filter: Option<LuaSource>,
    pub log: Option<LuaSource>,
}

// === limits ===

/// One part of a limit key; a key is one or more parts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LimitKeyPart {
    ClientIp,
    /// Header name, lower-cased.
    Header(String),
    Cookie(String),
    Path,
    /// The matched route's name.
    Route,
    /// The upstream server chosen for the request.
    UpstreamServer,
}

#[derive(Debug, Clone, Copy, PartialEq)]
pub enum LimitKind {
    /// Requests per second per key, with `burst` extra requests allowed.
    Rate { per_sec: f64, burst: u32 },
    /// Concurrent requests per key.
    Concurrent { max: u32 },
}

/// A `[[limit]]` rule.
#[derive(Debug, Clone, PartialEq)]
pub struct LimitRule {
    /// Unique; counted in metrics under this name.
    pub name: String,
    /// Composite key (never empty, no repeated part).
    pub key: Vec<LimitKeyPart>,
    pub kind: LimitKind,
    /// Route names it applies to (each validated to exist); None = every route.
    pub routes: Option<Vec<String>>,
    /// Count only; never refuse.
    pub dry_run: bool,
    /// Status of a refused request (429 for rate, 503 for concurrent by default).
    pub status: u16,
    /// `scope = "global"`: counted across the fleet through `[redis]`.
    pub global: bool,
    /// With `global`: what to do while Redis is out of reach.
    pub fail: LimitFail,
}

/// `[[limit]] fail`: a global limit's answer while Redis is out of reach.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum LimitFail {
    /// Decide on this node's counts alone (each node admits up to the rate).
    #[default]
    Open,
    /// Refuse the requests the limit applies to, with its `status`.
    Closed,
}

impl RouteLua {
    /// The hooks that are set, with their phase names ("access", ...), in
    /// request order.
    pub fn iter(&self) -> impl Iterator<Item = (&'static str, &LuaSource)> {
        [
            ("access", &self.access),
            ("content", &self.content),
            ("balancer", &self.balancer),
            ("upstream_request", &self.upstream_request),
            ("header_filter", &self.header_filter),
            ("body_filter", &self.body_filter),
            ("log", &self.log),
        ]
        .into_iter()
        .filter_map(|(n, s)| s.as_ref().map(|s| (n, s)))
    }

    pub fn is_empty(&self) -> bool {
        self.iter().next().is_none()
    }
}

impl LimitRule {
    /// Does this rule apply to requests matched by the route named `route`?
    pub fn applies_to(&self, route: &str) -> bool {
        self.routes
            .as_ref()
            .is_none_or(|r| r.iter().any(|n| n == route))
    }
}
