//! The validated internal config: what the rest of Pier consumes.
//!
//! Two layers (as River and Varnish do): `schema` is what serde reads from the
//! file; this module is what the server runs on, with every default filled in,
//! every duration an integer number of milliseconds/nanoseconds and every
//! cross-reference (route -> upstream) checked.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::time::Duration;

#[derive(Debug, Clone)]
pub struct Config {
    /// Worker threads; 0 in the file means "one per core" and is resolved here.
    pub workers: usize,
    /// How long SIGTERM waits for in-flight requests before exiting.
    pub grace_period: Duration,
    pub listeners: Vec<Listener>,
    pub admin: Option<SocketAddr>,
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
}

#[derive(Debug, Clone)]
pub struct Listener {
    pub name: String,
    pub addr: SocketAddr,
}

#[derive(Debug, Clone)]
pub struct Route {
    pub name: String,
    /// None = any host. Lower-cased; a leading "*." matches any subdomain.
    pub host: Option<HostMatch>,
    pub path: PathMatch,
    /// Name of an entry in `Config::upstreams` (validated to exist).
    pub upstream: String,
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
}

#[derive(Debug, Clone)]
pub struct UpstreamServer {
    pub addr: SocketAddr,
    pub weight: u32,
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
}

#[derive(Debug, Clone)]
pub struct Limits {
    pub max_header_bytes: usize,
    pub max_headers: usize,
    pub max_uri_bytes: usize,
    /// 0 = unlimited.
    pub max_body_bytes: u64,
    pub max_connections: usize,
}

#[derive(Debug, Clone)]
pub struct Timeouts {
    pub client_header: Duration,
    pub client_idle: Duration,
    pub upstream_connect: Duration,
    pub upstream_response: Duration,
    pub upstream_idle: Duration,
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
