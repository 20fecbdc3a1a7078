//! Schema -> model: fills defaults, parses units and addresses, checks
//! cross-references. Every problem is recorded; nothing stops at the first.

use std::collections::{BTreeMap, HashSet};
use std::net::{IpAddr, Ipv4Addr, SocketAddr, ToSocketAddrs};
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::cidr::normalize;
use crate::error::RawError;
use crate::matchers::{compile_path_regex, parse_host};
use crate::model::*;
use crate::schema::*;
use crate::units::{parse_duration, parse_size};

// === defaults (one place; docs/config.md lists the same values) ===

pub const DEFAULT_GRACE_PERIOD: Duration = Duration::from_secs(30);

impl Default for Limits {
    fn default() -> Limits {
        Limits {
            max_header_bytes: 16 * 1024,
            max_headers: 100,
            max_uri_bytes: 8 * 1024,
            max_body_bytes: 0,
            max_buffered_body_bytes: 1024 * 1024,
            max_connections: 10_000,
            body_min_rate: 0,
            max_connections_per_ip: 0,
        }
    }
}

impl Default for LuaConfig {
    fn default() -> LuaConfig {
        LuaConfig {
            init: None,
            init_worker: None,
            memory_limit: 128 << 20,
            package_path: Vec::new(),
            shared: Vec::new(),
            // The same defaults as `pier_lua::LuaLimits::DEFAULT`.
            max_response_body: 16 << 20,
            socket_buffer: 16 << 20,
            http_max_body: 16 << 20,
            max_sockets_per_request: 64,
            max_sockets_per_worker: 16384,
            socket_pool_wait: Duration::from_millis(30),
        }
    }
}

impl Default for Timeouts {
    fn default() -> Timeouts {
        Timeouts {
            client_header: Duration::from_secs(10),
            client_idle: Duration::from_secs(60),
            upstream_connect: Duration::from_secs(3),
            upstream_response: Duration::from_secs(60),
            upstream_idle: Duration::from_secs(60),
            tunnel_idle: Duration::from_secs(300),
            client_goaway: Duration::from_secs(5),
        }
    }
}

impl Upstream {
    /// An upstream with every setting at its documented default.
    pub fn with_defaults(name: impl Into<String>, servers: Vec<UpstreamServer>) -> Upstream {
        Upstream {
            name: name.into(),
            servers,
            balance: Balance::RoundRobin,
            health_check: None,
            max_fails: 3,
            passive_recover: Duration::from_secs(10),
            retries: 1,
            retry_budget_ratio: 0.2,
            retry_min_per_sec: 10,
            pool_idle_per_server: 1024,
            max_connections_per_server: 0,
            max_inflight_per_server: 0,
            headers: HeaderRules::default(),
            host_header: HostHeader::Preserve,
            tls: None,
            protocol: UpstreamProtocol::Http1,
            h2_max_streams: 100,
            send_proxy_protocol: None,
            resolve: Vec::new(),
        }
    }
}

/// `[http] upgrade` when the key is absent.
pub fn default_upgrade() -> Vec<String> {
    vec!["websocket".to_string()]
}

impl HealthCheck {
    pub const DEFAULT_INTERVAL: Duration = Duration::from_secs(2);
    pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(1);
    pub const DEFAULT_RISE: u32 = 2;
    pub const DEFAULT_FALL: u32 = 3;
}

/// Worker threads for `workers = 0`.
pub fn cores() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

// === addresses ===

/// "IP:PORT", "[IPv6]:PORT" or "localhost:PORT" (127.0.0.1; no DNS, so a
/// listener never depends on the resolver).
pub fn parse_listen_addr(s: &str) -> Result<SocketAddr, String> {
    if let Ok(a) = s.parse::<SocketAddr>() {
        return Ok(a);
    }
    match s.rsplit_once(':') {
        Some((host, port)) if host.eq_ignore_ascii_case("localhost") => port
            .parse::<u16>()
            .map(|p| SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), p))
            .map_err(|_| format!("invalid address {s:?}: bad port {port:?}")),
        Some((host, _)) if !host.is_empty() && host.parse::<IpAddr>().is_err() => Err(format!(
            "invalid address {s:?}: the host must be an IP address or \"localhost\" (write IPv6 as [::1]:8080)"
        )),
        _ => Err(format!(
            "invalid address {s:?}: expected IP:PORT, e.g. \"127.0.0.1:8080\" or \"[::1]:8080\""
        )),
    }
}

/// Like [`parse_listen_addr`] but other host names are resolved (once, at
/// load time, as nginx does); every address they resolve to becomes a server.
pub(crate) fn resolve_upstream_addr(s: &str) -> Result<Vec<SocketAddr>, String> {
    match parse_listen_addr(s) {
        Ok(a) => Ok(vec![a]),
        Err(e) => {
            let Some((host, port)) = s.rsplit_once(':') else {
                return Err(e);
            };
            if host.is_empty() || port.parse::<u16>().is_err() {
                return Err(e);
            }
            let mut addrs: Vec<SocketAddr> = s
                .to_socket_addrs()
                .map_err(|err| format!("cannot resolve upstream server {s:?}: {err}"))?
                .collect();
            addrs.sort();
            addrs.dedup();
            if addrs.is_empty() {
                return Err(format!("upstream server {s:?} resolved to no address"));
            }
            Ok(addrs)
        }
    }
}

// === the checker ===

struct Check {
    errors: Vec<RawError>,
}

type Span = Option<Range<usize>>;

fn sp<T>(v: &Spanned<T>) -> Span {
    Some(v.span())
}

impl Check {
    fn err(&mut self, span: Span, msg: impl Into<String>) {
        self.errors.push(RawError::at(span, msg));
    }

    fn duration(&mut self, v: &Option<Spanned<String>>, key: &str, default: Duration) -> Duration {
        let Some(v) = v else { return default };
        match parse_duration(v.get_ref()) {
            Ok(d) if d.is_zero() => {
                self.err(sp(v), format!("`{key}` must be greater than zero"));
                default
            }
            Ok(d) => d,
            Err(e) => {
                self.err(sp(v), format!("`{key}`: {e}"));
                default
            }
        }
    }

    fn int(
        &mut self,
        v: &Option<Spanned<i64>>,
        key: &str,
        default: u64,
        min: u64,
        max: u64,
    ) -> u64 {
        let Some(v) = v else { return default };
        let n = *v.get_ref();
        if n < min as i64 || n as u64 > max {
            self.err(
                sp(v),
                format!("`{key}` must be between {min} and {max}, got {n}"),
            );
            return default;
        }
        n as u64
    }

    fn size(&mut self, v: &Option<Spanned<SizeValue>>, key: &str, default: u64, min: u64) -> u64 {
        let Some(v) = v else { return default };
        let n = match v.get_ref() {
            SizeValue::Int(n) if *n < 0 => Err(format!("invalid size {n}: must not be negative")),
            SizeValue::Int(n) => Ok(*n as u64),
            SizeValue::Str(s) => parse_size(s),
        };
        match n {
            Ok(n) if n < min => {
                self.err(sp(v), format!("`{key}` must be at least {min} bytes"));
                default
            }
            Ok(n) => n,
            Err(e) => {
                self.err(sp(v), format!("`{key}`: {e}"));
                default
            }
        }
    }

    fn listen_addr(&mut self, v: &Spanned<String>, key: &str) -> Option<SocketAddr> {
        match parse_listen_addr(v.get_ref()) {
            Ok(a) => Some(a),
            Err(e) => {
                self.err(sp(v), format!("`{key}`: {e}"));
                None
            }
        }
    }
}

/// Validates the whole file. `errors` holds the schema errors already found;
/// the result is Ok only if there are none at all.
/// Relative `*_file` paths are resolved against `base` (the config file's
/// directory).
pub(crate) fn validate(
    file: RawFile,
    errors: Vec<RawError>,
    base: &Path,
) -> Result<Config, Vec<RawError>> {
    let schema_failed = !errors.is_empty();
    let mut c = Check { errors };

    let server = file.server.unwrap_or_default();
    let workers = match c.int(&server.workers, "workers", 0, 0, 4096) {
        0 => cores(),
        n => n as usize,
    };
    let grace_period = c.duration(&server.grace_period, "grace_period", DEFAULT_GRACE_PERIOD);
    let upgrade_socket = server
        .upgrade_socket
        .as_ref()
        .filter(|p| !p.get_ref().is_empty())
        .map(|p| path_of(base, p));
    let io_uring = server.io_uring.as_ref().is_none_or(|b| *b.get_ref());
    // Every socket Pier binds, to catch two things on one port.
    let mut bound = Bound::default();
    let mut admin_auth = AdminAuth::default();
    let mut admin_tls = None;
    let admin = file.admin.and_then(|a| {
        admin_auth = admin_auth_of(&mut c, &a);
        admin_tls = a.tls.as_ref().map(|t| {
            let mut t = listener_tls(&mut c, "admin", t, base);
            // The admin plane speaks HTTP/1.1 only.
            t.alpn = vec!["http/1.1".to_string()];
            t
        });
        let addr = c.listen_addr(&a.listen, "listen")?;
        if let Err(e) = check_admin_exposure(addr, &admin_auth) {
            c.err(sp(&a.listen), e);
        }
        bound.add(&mut c, addr, "the admin endpoint", sp(&a.listen));
        Some(addr)
    });
    let analytics = analytics(&mut c, file.analytics.unwrap_or_default(), base);
    let demo_origin = file.demo.and_then(|d| {
        let addr = c.listen_addr(&d.origin, "origin")?;
        bound.add(&mut c, addr, "the demo origin", sp(&d.origin));
        Some(addr)
    });
    let access_log = access_log(&mut c, file.log.and_then(|l| l.access));
    let limits = limits(&mut c, file.limits.unwrap_or_default());
    let timeouts = timeouts(&mut c, file.timeouts.unwrap_or_default());
    let http = file.http.unwrap_or_default();
    let escaped_slashes = match http.escaped_slashes.as_ref().map(|s| s.get_ref().as_str()) {
        None | Some("reject") => EscapedSlashes::Reject,
        Some("decode") => EscapedSlashes::Decode,
        Some("keep") => EscapedSlashes::Keep,
        Some(other) => {
            c.err(
                http.escaped_slashes.as_ref().and_then(sp),
                format!(
                    "`escaped_slashes` = {other:?}: expected \"reject\", \"decode\" or \"keep\""
                ),
            );
            EscapedSlashes::Reject
        }
    };
    let merge_slashes = http.merge_slashes.unwrap_or(true);
    let allow_trace = http.allow_trace.unwrap_or(false);
    let forwarded = http.forwarded.unwrap_or(false);
    let upgrade = upgrade(&mut c, http.upgrade);
    let http2 = http2(&mut c, file.http2.unwrap_or_default());
    let lua = lua_config(&mut c, file.lua.unwrap_or_default(), base);

    let resolver = resolver(&mut c, file.resolver.unwrap_or_default());
    let tracing = file.tracing.as_ref().and_then(|t| tracing_of(&mut c, t));
    let redis = file.redis.as_ref().and_then(|r| redis_of(&mut c, r));
    let mut deny_origins = Vec::new();
    for v in file
        .security
        .and_then(|s| s.deny_origins)
        .unwrap_or_default()
    {
        match Cidr::parse(v.get_ref()) {
            Ok(cidr) => deny_origins.push(cidr),
            Err(e) => c.err(sp(&v), format!("`deny_origins`: {e}")),
        }
    }

    if file.listener_count == 0 {
        c.err(
            None,
            "no listener: add a [[listener]] with `listen = \"127.0.0.1:8080\"`",
        );
    }
    let mut listeners = Vec::new();
    let mut listener_names = HashSet::new();
    for (i, l) in file.listeners.iter().enumerate() {
        let name = unique_name(&mut c, &l.name, "listener", i, &mut listener_names);
        if let Some(addr) = c.listen_addr(&l.listen, "listen") {
            bound.add(&mut c, addr, &format!("listener `{name}`"), sp(&l.listen));
            let tls = l.tls.as_ref().map(|t| listener_tls(&mut c, &name, t, base));
            let redirect_https = listener_redirect(&mut c, l);
            if l.https_port.is_some() && l.redirect_https.is_none() {
                c.err(
                    l.https_port.as_ref().and_then(sp),
                    "`https_port` is only used with `redirect_https`",
                );
            }
            if tls.is_some() && redirect_https.is_some() {
                c.err(
                    l.redirect_https.as_ref().and_then(sp),
                    "`redirect_https` on a TLS listener would redirect https to itself",
                );
            }
            let (h2c, h2c_only) = match &l.h2c {
                None | Some(H2cValue::Flag(false)) => (false, false),
                Some(H2cValue::Flag(true)) => (true, false),
                Some(H2cValue::Mode(m)) if m == "only" => (true, true),
                Some(H2cValue::Mode(m)) => {
                    c.err(
                        sp(&l.listen),
                        format!("h2c = {m:?}: expected true, false or \"only\""),
                    );
                    (false, false)
                }
            };
            if h2c && tls.is_some() {
                c.err(
                    sp(&l.listen),
                    "`h2c` is for cleartext listeners; a TLS listener offers HTTP/2 with `alpn = [\"h2\", \"http/1.1\"]`",
                );
            }
            let http3 = l.http3.as_ref().is_some_and(|v| *v.get_ref());
            if http3 && tls.is_none() {
                c.err(
                    l.http3.as_ref().and_then(sp),
                    "`http3` needs TLS: add [listener.tls] (QUIC is always encrypted)",
                );
            }
            let quic_retry = l.quic_retry.as_ref().is_some_and(|v| *v.get_ref());
            if quic_retry && !http3 {
                c.err(
                    l.quic_retry.as_ref().and_then(sp),
                    "`quic_retry` is for listeners with `http3 = true`",
                );
            }
            let quic_early_data = l.quic_early_data.as_ref().is_some_and(|v| *v.get_ref());
            if quic_early_data && !http3 {
                c.err(
                    l.quic_early_data.as_ref().and_then(sp),
                    "`quic_early_data` is for listeners with `http3 = true`",
                );
            }
            if quic_early_data
                && tls
                    .as_ref()
                    .is_some_and(|t| !matches!(t.client_auth, ClientAuth::Off))
            {
                c.err(
                    l.quic_early_data.as_ref().and_then(sp),
                    "`quic_early_data` with client certificates: a 0-RTT request arrives before the client's certificate, so it would pass unauthenticated",
                );
            }
            if quic_early_data && tls.as_ref().is_some_and(|t| t.session_cache == 0) {
                c.err(
                    l.quic_early_data.as_ref().and_then(sp),
                    "`quic_early_data` needs `session_cache` > 0: 0-RTT tickets are single-use entries of the session cache",
                );
            }
            let mut trusted_proxies = Vec::new();
            for v in l.trusted_proxies.iter().flatten() {
                match Cidr::parse(v.get_ref()) {
                    Ok(cidr) => trusted_proxies.push(cidr),
                    Err(e) => c.err(sp(v), format!("`trusted_proxies`: {e}")),
                }
            }
            let proxy_protocol = l.proxy_protocol.as_ref().is_some_and(|v| *v.get_ref());
            if proxy_protocol && trusted_proxies.is_empty() {
                c.err(
                    l.proxy_protocol.as_ref().and_then(sp),
                    "`proxy_protocol` needs `trusted_proxies`: the balancers whose headers are believed (anyone else could name any address)",
                );
            }
            let real_ip_header = match l.real_ip_header.as_ref() {
                None => None,
                Some(v) => {
                    match v.get_ref().to_ascii_lowercase().as_str() {
                        "x-forwarded-for" => Some(crate::model::RealIpHeader::XForwardedFor),
                        "forwarded" => Some(crate::model::RealIpHeader::Forwarded),
                        other => {
                            c.err(
                            sp(v),
                            format!("real_ip_header {other:?}: \"X-Forwarded-For\" or \"Forwarded\""),
                        );
                            None
                        }
                    }
                }
            };
            if real_ip_header.is_some() && trusted_proxies.is_empty() {
                c.err(
                    l.real_ip_header.as_ref().and_then(sp),
                    "`real_ip_header` needs `trusted_proxies`: the proxies whose header is believed",
                );
            }
            listeners.push(Listener {
                name,
                addr,
                tls,
                redirect_https,
                h2c,
                h2c_only,
                http3,
                quic_retry,
                quic_early_data,
                proxy_protocol,
                real_ip_header,
                trusted_proxies,
            });
        }
    }

    let mut upstreams = BTreeMap::new();
    for u in &file.upstreams {
        if let Some(entry) = &u.entry {
            let up = upstream(&mut c, &u.name, entry, &deny_origins, &listeners, base);
            upstreams.insert(u.name.clone(), up);
        }
    }

    let mut caches = Vec::new();
    for (name, z) in &file.caches {
        let Some(z) = z else { continue };
        let memory = c.size(&Some(z.memory.clone()), "memory", 0, 4096) as usize;
        let max_object = c.size(
            &z.max_object,
            "max_object",
            (memory as u64 / 8).min(64 << 20),
            1,
        ) as usize;
        let disk = match (&z.disk_dir, &z.disk) {
            (Some(dir), size) => Some(CacheDisk {
                dir: path_of(base, dir),
                max_bytes: c.size(size, "disk", 1 << 30, 1 << 20),
                promote_hits: c.int(&z.promote_hits, "promote_hits", 2, 0, 1_000_000) as u32,
                min_ttl: match &z.disk_min_ttl {
                    None => Duration::from_secs(60),
                    Some(v) => parse_duration(v.get_ref()).unwrap_or_else(|e| {
                        c.err(sp(v), format!("`disk_min_ttl`: {e}"));
                        Duration::ZERO
                    }),
                },
                queue: c.int(&z.disk_queue, "disk_queue", 256, 1, 65_536) as usize,
            }),
            (None, Some(v)) => {
                c.err(sp(v), "`disk` needs `disk_dir`".to_string());
                None
            }
            (None, None) => None,
        };
        let mut parents = Vec::new();
        if let Some(list) = &z.parents {
            if list.get_ref().is_empty() || list.get_ref().len() > 64 {
                c.err(
                    sp(list),
                    format!("cache `{name}`: `parents`: 1 to 64 \"HOST:PORT\" (leave it out for no parents)"),
                );
            }
            for v in list.get_ref() {
                match resolve_upstream_addr(v.get_ref()) {
                    Ok(addrs) => {
                        for a in addrs {
                            if !parents.contains(&a) {
                                parents.push(a);
                            }
                        }
                    }
                    Err(e) => c.err(sp(v), format!("cache `{name}`: parent: {e}")),
                }
            }
        }
        caches.push(CacheZone {
            name: name.clone(),
            memory,
            max_object,
            max_variants: c.int(&z.max_variants, "max_variants", 32, 1, 1024) as usize,
            disk,
            parents,
        });
    }

    let mut routes = Vec::new();
    let mut route_names = HashSet::new();
    for (i, (r, span)) in file.routes.iter().enumerate() {
        let name = unique_name(&mut c, &r.name, "route", i, &mut route_names);
        let mut rt = route(
            &mut c,
            name,
            r,
            span.clone(),
            &file.upstreams,
            file.upstreams_malformed,
            base,
        );
        rt.cache = r
            .cache
            .as_ref()
            .and_then(|x| route_cache(&mut c, &rt.name, x, &caches));
        routes.push(rt);
    }

    for r in &routes {
        if r.grpc_web
            && upstreams
                .get(&r.upstream)
                .is_some_and(|u| u.protocol == UpstreamProtocol::Http1)
        {
            c.err(
                None,
                format!(
                    "route `{}`: grpc_web sends gRPC upstream, which needs HTTP/2: set protocol = \"h2\" or \"h2c\" on upstream `{}`",
                    r.name, r.upstream
                ),
            );
        }
    }

    let mut rate_limits = Vec::new();
    let mut limit_names = HashSet::new();
    for (i, (e, span)) in file.limit_rules.iter().enumerate() {
        let name = unique_name(&mut c, &e.name, "limit", i, &mut limit_names);
        if let Some(rule) = limit_rule(&mut c, name, e, span.clone(), &routes, redis.is_some()) {
            rate_limits.push(rule);
        }
    }

    if !c.errors.is_empty() || schema_failed {
        return Err(c.errors);
    }
    Ok(Config {
        workers,
        grace_period,
        upgrade_socket,
        io_uring,
        listeners,
        admin,
        routes,
        upstreams,
        limits,
        timeouts,
        access_log,
        deny_origins,
        demo_origin,
        lua,
        rate_limits,
        upgrade,
        escaped_slashes,
        merge_slashes,
        allow_trace,
        forwarded,
        http2,
        caches,
        resolver,
        tracing,
        redis,
        admin_auth,
        admin_tls,
        analytics,
    })
}

fn admin_auth_of(c: &mut Check, a: &AdminSection) -> AdminAuth {
    let text = |v: &Option<Spanned<String>>| v.as_ref().map(|v| v.get_ref().clone());
    let token = text(&a.token);
    if let Some(t) = &a.token {
        if let Err(e) = check_admin_token(t.get_ref()) {
            c.err(sp(t), format!("`token` {e}"));
        }
    }
    let mut hosts = Vec::new();
    for h in a.hosts.iter().flatten() {
        let name = h.get_ref().trim_end_matches('.').to_ascii_lowercase();
        if name.is_empty()
            || !name
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'.')
        {
            c.err(
                sp(h),
                "`hosts` lists host names (letters, digits, '-' and '.'), without a port",
            );
        } else {
            hosts.push(name);
        }
    }
    let basic = match (text(&a.user), text(&a.password)) {
        (Some(u), Some(p)) => {
            if u.contains(':') {
                c.err(a.user.as_ref().and_then(sp), "`user` must not contain ':'");
            }
            Some((u, p))
        }
        (None, None) => None,
        _ => {
            c.err(
                sp(&a.listen),
                "`user` and `password` go together: set both or neither",
            );
            None
        }
    };
    AdminAuth {
        token,
        basic,
        hosts,
    }
}

fn analytics(c: &mut Check, a: AnalyticsSection, base: &Path) -> Analytics {
    let d = Analytics::default();
    let kafka = a.kafka.map(|k| {
        if k.brokers.is_empty() {
            c.err(
                None,
                "`[analytics.kafka] brokers` must list at least one broker",
            );
        }
        let compression = k
            .compression
            .as_ref()
            .map(|v| v.get_ref().to_ascii_lowercase())
            .unwrap_or_else(|| "lz4".into());
        if !["none", "gzip", "snappy", "lz4", "zstd"].contains(&compression.as_str()) {
            c.err(
                k.compression.as_ref().and_then(sp),
                format!(
                    "`compression` must be none, gzip, snappy, lz4 or zstd, got {compression:?}"
                ),
            );
        }
        AnalyticsKafka {
            brokers: k.brokers.iter().map(|b| b.get_ref().clone()).collect(),
            topic: k
                .topic
                .as_ref()
                .map(|t| t.get_ref().clone())
                .unwrap_or_else(|| "pier-events".into()),
            batch_size: c.int(&k.batch_size, "batch_size", 10_000, 1, 1_000_000) as usize,
            linger: k
                .linger
                .as_ref()
                .map(|_| c.duration(&k.linger, "linger", Duration::from_millis(100)))
                .unwrap_or(Duration::from_millis(100)),
            compression,
            queue: c.int(&k.queue, "queue", 100_000, 1, 10_000_000) as usize,
        }
    });
    Analytics {
        enabled: a.enabled.map(|v| *v.get_ref()).unwrap_or(d.enabled),
        path: a.path.as_ref().map(|p| path_of(base, p)),
        keep_minutes: c.duration(&a.keep_minutes, "keep_minutes", d.keep_minutes),
        keep_hours: c.duration(&a.keep_hours, "keep_hours", d.keep_hours),
        keep_days: c.duration(&a.keep_days, "keep_days", d.keep_days),
        max_keys: c.int(&a.max_keys, "max_keys", d.max_keys as u64, 1, 1_000_000) as usize,
        queue: c.int(&a.queue, "queue", d.queue as u64, 1, 10_000_000) as usize,
        kafka,
    }
}

fn route_cache(
    c: &mut Check,
    route: &str,
    x: &RouteCacheSection,
    zones: &[CacheZone],
) -> Option<RouteCache> {
    let Some(zone) = zones.iter().position(|z| z.name == *x.zone.get_ref()) else {
        c.err(
            sp(&x.zone),
            format!(
                "route `{route}`: no cache zone `{}`: add a [cache.{}] table",
                x.zone.get_ref(),
                x.zone.get_ref()
            ),
        );
        return None;
    };
    let mut ttl = Vec::new();
    for (status, v) in x.ttl.iter().flatten() {
        match status.parse::<u16>() {
            Ok(s) if (100..=599).contains(&s) => {
                ttl.push((s, c.duration(&Some(v.clone()), "ttl", Duration::ZERO)))
            }
            _ => c.err(
                sp(v),
                format!("route `{route}`: cache ttl key {status:?} is not an HTTP status"),
            ),
        }
    }
    let store_set_cookie = match x.set_cookie.as_ref().map(|s| (s, s.get_ref().as_str())) {
        None | Some((_, "pass")) => false,
        Some((_, "store")) => true,
        Some((s, other)) => {
            c.err(
                sp(s),
                format!("route `{route}`: cache set_cookie {other:?}: \"pass\" or \"store\""),
            );
            false
        }
    };
    Some(RouteCache {
        zone,
        ttl,
        override_origin: x.override_origin.unwrap_or(false),
        lock_timeout: c.duration(&x.lock_timeout, "lock_timeout", Duration::from_secs(5)),
        hit_for_miss: c.duration(&x.hit_for_miss, "hit_for_miss", Duration::from_secs(120)),
        grace: c.duration(&x.grace, "grace", Duration::ZERO),
        key: x.key.as_ref().map(|k| cache_key(c, route, k)),
        strip_tags: x.strip_tags.unwrap_or(true),
        store_set_cookie,
    })
}

fn http2(c: &mut Check, h: Http2Section) -> Http2 {
    let d = Http2::default();
    Http2 {
        max_concurrent_streams: c.int(
            &h.max_concurrent_streams,
            "max_concurrent_streams",
            d.max_concurrent_streams.into(),
            1,
            100_000,
        ) as u32,
        initial_window_size: c
            .size(
                &h.initial_window_size,
                "initial_window_size",
                d.initial_window_size.into(),
                1,
            )
            .min((1 << 31) - 1) as u32,
        max_frame_size: c
            .size(
                &h.max_frame_size,
                "max_frame_size",
                d.max_frame_size.into(),
                16_384,
            )
            .min((1 << 24) - 1) as u32,
        max_header_list_size: c
            .size(
                &h.max_header_list_size,
                "max_header_list_size",
                d.max_header_list_size.into(),
                1024,
            )
            .min(u32::MAX as u64) as u32,
        max_send_buffer: c.size(
            &h.max_send_buffer,
            "max_send_buffer",
            d.max_send_buffer as u64,
            1024,
        ) as usize,
        max_concurrent_reset_streams: c.int(
            &h.max_concurrent_reset_streams,
            "max_concurrent_reset_streams",
            d.max_concurrent_reset_streams as u64,
            0,
            100_000,
        ) as usize,
        max_pending_accept_reset_streams: c.int(
            &h.max_pending_accept_reset_streams,
            "max_pending_accept_reset_streams",
            d.max_pending_accept_reset_streams as u64,
            1,
            100_000,
        ) as usize,
        max_local_error_reset_streams: c.int(
            &h.max_local_error_reset_streams,
            "max_local_error_reset_streams",
            d.max_local_error_reset_streams as u64,
            1,
            100_000,
        ) as usize,
        hpack_dynamic_table: h.hpack_dynamic_table.unwrap_or(d.hpack_dynamic_table),
    }
}

fn access_log(c: &mut Check, v: Option<Spanned<String>>) -> AccessLog {
    let Some(v) = v else { return AccessLog::Off };
    match v.get_ref().as_str() {
        "off" => AccessLog::Off,
        "stdout" => AccessLog::Stdout,
        "" => {
            c.err(
                sp(&v),
                "`access` must be \"off\", \"stdout\" or a file path",
            );
            AccessLog::Off
        }
        path => AccessLog::File(PathBuf::from(path)),
    }
}

fn limits(c: &mut Check, l: LimitsSection) -> Limits {
    let d = Limits::default();
    Limits {
        max_header_bytes: c.size(
            &l.max_header_bytes,
            "max_header_bytes",
            d.max_header_bytes as u64,
            1024,
        ) as usize,
        max_headers: c.int(
            &l.max_headers,
            "max_headers",
            d.max_headers as u64,
            1,
            10_000,
        ) as usize,
        max_uri_bytes: c.size(
            &l.max_uri_bytes,
            "max_uri_bytes",
            d.max_uri_bytes as u64,
            16,
        ) as usize,
        max_body_bytes: c.size(&l.max_body_bytes, "max_body_bytes", d.max_body_bytes, 0),
        max_buffered_body_bytes: c.size(
            &l.max_buffered_body_bytes,
            "max_buffered_body_bytes",
            d.max_buffered_body_bytes,
            1024,
        ),
        max_connections: c.int(
            &l.max_connections,
            "max_connections",
            d.max_connections as u64,
            1,
            10_000_000,
        ) as usize,
        body_min_rate: c.size(&l.body_min_rate, "body_min_rate", d.body_min_rate, 0),
        max_connections_per_ip: c.int(
            &l.max_connections_per_ip,
            "max_connections_per_ip",
            d.max_connections_per_ip.into(),
            0,
            10_000_000,
        ) as u32,
    }
}

fn timeouts(c: &mut Check, t: TimeoutsSection) -> Timeouts {
    let d = Timeouts::default();
    Timeouts {
        client_header: c.duration(&t.client_header, "client_header", d.client_header),
        client_idle: c.duration(&t.client_idle, "client_idle", d.client_idle),
        upstream_connect: c.duration(&t.upstream_connect, "upstream_connect", d.upstream_connect),
        upstream_response: c.duration(
            &t.upstream_response,
            "upstream_response",
            d.upstream_response,
        ),
        upstream_idle: c.duration(&t.upstream_idle, "upstream_idle", d.upstream_idle),
        tunnel_idle: c.duration(&t.tunnel_idle, "tunnel_idle", d.tunnel_idle),
        client_goaway: c.duration(&t.client_goaway, "client_goaway", d.client_goaway),
    }
}

/// `[http] upgrade`: protocol tokens, lower-cased; never h2c.
fn upgrade(c: &mut Check, v: Option<Vec<Spanned<String>>>) -> Vec<String> {
    let Some(list) = v else {
        return default_upgrade();
    };
    let mut out: Vec<String> = Vec::new();
    for p in &list {
        let s = p.get_ref();
        if !is_token(s) {
            c.err(
                sp(p),
                format!("`upgrade`: {s:?} is not a protocol name (an HTTP token such as \"websocket\", without a version)"),
            );
            continue;
        }
        let lower = s.to_ascii_lowercase();
        if lower == "h2c" {
            c.err(
                sp(p),
                "`upgrade`: h2c upgrades are never forwarded: they let a client talk past the route's hooks",
            );
        } else if out.contains(&lower) {
            c.err(sp(p), format!("`upgrade`: {s:?} is given twice"));
        } else {
            out.push(lower);
        }
    }
    out
}

// === header rules ===

/// Why a header rule may not name this header, if it may not.
/// `request`: a request rule; `remove`: a remove list.
fn managed_header(name: &str, request: bool, remove: bool) -> Option<&'static str> {
    let n = name.to_ascii_lowercase();
    match n.as_str() {
        "host" if request => Some("use `host_header` to choose the Host sent upstream"),
        "content-length" | "transfer-encoding" => {
            Some("Pier writes it from the body (it frames the message)")
        }
        "connection" if !request => Some("it is a hop-by-hop header Pier manages itself"),
        "connection" | "upgrade" | "te" | "keep-alive" if request && !remove => {
            Some("it is a hop-by-hop header Pier manages itself")
        }
        _ => None,
    }
}

/// A header value: no CR, LF, NUL or other control character (tab is fine).
fn check_header_value(v: &str) -> Result<(), String> {
    match v.chars().find(|&ch| ch.is_ascii_control() && ch != '\t') {
        None => Ok(()),
        Some(ch) => Err(format!(
            "header value {v:?} contains the control character {ch:?} (no CR, LF, NUL or other control characters)"
        )),
    }
}

/// `[route.headers]` or `[upstream.NAME.headers]`; `scope` is "route `api`"
/// or "upstream `b`".
fn header_rules(c: &mut Check, scope: &str, h: Option<&HeadersSection>) -> HeaderRules {
    let Some(h) = h else {
        return HeaderRules::default();
    };
    let table = |c: &mut Check, key: &str, t: &Option<HeaderTable>, request: bool| {
        let mut out: Vec<(String, String)> = Vec::new();
        for (name, value) in t.iter().flat_map(|t| &t.0) {
            let n = name.get_ref();
            let ok = header_name(c, scope, key, name, request, false, &out_names(&out));
            if let Err(msg) = check_header_value(value.get_ref()) {
                c.err(sp(value), format!("{scope}: `headers.{key}`: {msg}"));
            } else if ok {
                out.push((n.clone(), value.get_ref().clone()));
            }
        }
        out
    };
    let request_set = table(c, "request_set", &h.request_set, true);
    let request_add = table(c, "request_add", &h.request_add, true);
    let response_set = table(c, "response_set", &h.response_set, false);
    let response_add = table(c, "response_add", &h.response_add, false);
    let list = |c: &mut Check,
                key: &str,
                l: &Option<Vec<Spanned<String>>>,
                request: bool,
                set: &[(String, String)],
                add: &[(String, String)]| {
        let mut out: Vec<String> = Vec::new();
        for name in l.iter().flatten() {
            let seen: Vec<&str> = out.iter().map(String::as_str).collect();
            if !header_name(c, scope, key, name, request, true, &seen) {
                continue;
            }
            let n = name.get_ref();
            let other = if request { "request" } else { "response" };
            if let Some(op) = [("set", set), ("add", add)]
                .into_iter()
                .find(|(_, rules)| rules.iter().any(|(x, _)| x.eq_ignore_ascii_case(n)))
                .map(|(op, _)| op)
            {
                c.err(
                    sp(name),
                    format!("{scope}: `headers.{key}`: {n:?} is also in `{other}_{op}`; remove it or set it, not both"),
                );
                continue;
            }
            out.push(n.clone());
        }
        out
    };
    let request_remove = list(
        c,
        "request_remove",
        &h.request_remove,
        true,
        &request_set,
        &request_add,
    );
    let response_remove = list(
        c,
        "response_remove",
        &h.response_remove,
        false,
        &response_set,
        &response_add,
    );
    HeaderRules {
        request_set,
        request_add,
        request_remove,
        response_set,
        response_add,
        response_remove,
    }
}

fn out_names(v: &[(String, String)]) -> Vec<&str> {
    v.iter().map(|(n, _)| n.as_str()).collect()
}

/// Checks one header name of `headers.{key}`; false (error recorded) when
/// it is unusable. `seen`: names earlier in the same table or list.
fn header_name(
    c: &mut Check,
    scope: &str,
    key: &str,
    name: &Spanned<String>,
    request: bool,
    remove: bool,
    seen: &[&str],
) -> bool {
    let n = name.get_ref();
    let msg = if !is_token(n) {
        format!(
            "{n:?} is not a valid header name (an HTTP token: letters, digits and !#$%&'*+-.^_`|~)"
        )
    } else if let Some(why) = managed_header(n, request, remove) {
        let what = if request { "request" } else { "response" };
        format!("the {what} header `{n}` cannot be changed by a header rule: {why}")
    } else if seen.iter().any(|s| s.eq_ignore_ascii_case(n)) {
        format!("{n:?} is given twice (header names are case-insensitive)")
    } else {
        return true;
    };
    c.err(sp(name), format!("{scope}: `headers.{key}`: {msg}"));
    false
}

/// `host_header = "preserve" | "upstream" | "HOST[:PORT]"`.
fn host_header(c: &mut Check, scope: &str, v: &Spanned<String>) -> Option<HostHeader> {
    match parse_host_header(v.get_ref()) {
        Ok(h) => Some(h),
        Err(msg) => {
            c.err(sp(v), format!("{scope}: `host_header`: {msg}"));
            None
        }
    }
}

fn parse_host_header(s: &str) -> Result<HostHeader, String> {
    match s {
        "preserve" => return Ok(HostHeader::Preserve),
        "upstream" => return Ok(HostHeader::Upstream),
        _ => {}
    }
    let bad = |why: &str| {
        format!("{s:?} is not \"preserve\", \"upstream\" or a host[:port] ({why}), e.g. \"api.example.com\" or \"10.0.0.1:8080\"")
    };
    let port = if let Some(rest) = s.strip_prefix('[') {
        let (v6, after) = rest.split_once(']').ok_or_else(|| bad("no `]`"))?;
        if v6.parse::<std::net::Ipv6Addr>().is_err() {
            return Err(bad("bad IPv6 address"));
        }
        match after {
            "" => None,
            a => Some(a.strip_prefix(':').ok_or_else(|| bad("junk after `]`"))?),
        }
    } else {
        let (h, p) = match s.rsplit_once(':') {
            Some((h, p)) => (h, Some(p)),
            None => (s, None),
        };
        if h.is_empty() {
            return Err(bad("empty host"));
        }
        if !h
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"-._~".contains(&b))
        {
            return Err(bad(
                "a host is letters, digits, `-`, `.`, `_` and `~`; no spaces, `/` or control characters",
            ));
        }
        p
    };
    if let Some(p) = port {
        if p.is_empty() || !p.bytes().all(|b| b.is_ascii_digit()) || p.parse::<u16>().is_err() {
            return Err(bad("bad port"));
        }
    }
    Ok(HostHeader::Literal(s.to_string()))
}

/// `upstreams_malformed`: `upstream` was not a table (reported), so
/// references to it cannot be checked.
fn route(
    c: &mut Check,
    name: String,
    r: &RouteEntry,
    span: Span,
    upstreams: &[NamedUpstream],
    upstreams_malformed: bool,
    base: &Path,
) -> Route {
    let lua = route_lua(c, &name, r.lua.as_ref(), base);
    let target = match &r.upstream {
        Some(u) => {
            // Upstreams whose body failed still count as defined: their
            // error was reported already.
            let target = u.get_ref();
            if !upstreams_malformed && !upstreams.iter().any(|x| &x.name == target) {
                let defined: Vec<&str> = upstreams.iter().map(|x| x.name.as_str()).collect();
                let defined = if defined.is_empty() {
                    "none".to_string()
                } else {
                    defined.join(", ")
                };
                c.err(
                    sp(u),
                    format!("route `{name}`: unknown upstream `{target}` (defined: {defined})"),
                );
            }
            target.clone()
        }
        None => {
            if lua.content.is_none() {
                c.err(
                    span.clone(),
                    format!("route `{name}`: missing `upstream` (only a route with a `content` Lua hook may leave it out)"),
                );
            }
            // Hooks that act on the upstream request could never run.
            if let Some(l) = &r.lua {
                for (phase, inline, file) in l.phases() {
                    if matches!(phase, "balancer" | "upstream_request") {
                        for v in [inline, file].into_iter().flatten() {
                            c.err(
                                sp(v),
                                format!("route `{name}`: the `{phase}` hook needs an `upstream`"),
                            );
                        }
                    }
                }
            }
            String::new()
        }
    };
    let host = match &r.host {
        None => None,
        Some(h) => parse_host(h.get_ref()).unwrap_or_else(|e| {
            c.err(sp(h), e);
            None
        }),
    };
    let given: Vec<&Spanned<String>> = [&r.path, &r.exact, &r.regex]
        .into_iter()
        .flatten()
        .collect();
    if given.len() > 1 {
        c.err(
            sp(given[1]),
            format!("route `{name}`: give at most one of `path`, `exact` and `regex`"),
        );
    }
    let path = if let Some(p) = &r.path {
        match p.get_ref().as_str() {
            // Every origin-form path starts with "/"; Any also takes `OPTIONS *`.
            "/" => PathMatch::Any,
            s if s.starts_with('/') => PathMatch::Prefix(s.to_string()),
            _ => {
                c.err(sp(p), "`path` must start with `/`");
                PathMatch::Any
            }
        }
    } else if let Some(p) = &r.exact {
        if !p.get_ref().starts_with('/') {
            c.err(sp(p), "`exact` must start with `/`");
        }
        PathMatch::Exact(p.get_ref().clone())
    } else if let Some(p) = &r.regex {
        compile_path_regex(p.get_ref()).unwrap_or_else(|e| {
            c.err(sp(p), format!("`regex`: {e}"));
            PathMatch::Any
        })
    } else {
        PathMatch::Any
    };
    let scope = format!("route `{name}`");
    let headers = header_rules(c, &scope, r.headers.as_ref());
    let host_header = r
        .host_header
        .as_ref()
        .and_then(|h| host_header(c, &scope, h));
    // Without an upstream no request goes out: request rules could never apply.
    if r.upstream.is_none() {
        if let Some(h) = &r.host_header {
            c.err(
                sp(h),
                format!("route `{name}`: `host_header` needs an `upstream`"),
            );
        }
        if !headers.request_set.is_empty()
            || !headers.request_add.is_empty()
            || !headers.request_remove.is_empty()
        {
            c.err(
                span,
                format!(
                    "route `{name}`: request header rules (`headers.request_*`) need an `upstream`"
                ),
            );
        }
    }
    let grpc_web = r.grpc_web.unwrap_or(false);
    let cors = r.cors.as_ref().map(|x| cors(c, &name, x, grpc_web));
    let compress = r.compress.as_ref().map(|x| compress(c, &name, x));
    Route {
        name,
        host,
        path,
        upstream: target,
        lua,
        headers,
        host_header,
        grpc_web,
        cors,
        cache: None,
        compress,
        trace_sample: r
            .tracing
            .as_ref()
            .and_then(|t| t.sample.as_ref())
            .map(|v| ratio(c, v, "route.tracing.sample")),
    }
}

/// A sampling ratio, 0.0..=1.0.
fn ratio(c: &mut Check, v: &Spanned<f64>, key: &str) -> f64 {
    let x = *v.get_ref();
    if !(0.0..=1.0).contains(&x) {
        c.err(
            sp(v),
            format!("`{key}` must be between 0.0 and 1.0, got {x}"),
        );
        return 0.0;
    }
    x
}

/// `[tracing]`.
fn tracing_of(c: &mut Check, t: &TracingSection) -> Option<Tracing> {
    let endpoint = match &t.endpoint {
        None => {
            c.err(
                None,
                "[tracing] needs `endpoint = \"http://HOST:4318/v1/traces\"` (OTLP/HTTP) or `\"grpc://HOST:4317\"` (OTLP/gRPC)",
            );
            return None;
        }
        Some(v) if v.get_ref().starts_with("http://") || v.get_ref().starts_with("grpc://") => {
            v.get_ref().clone()
        }
        Some(v) => {
            c.err(
                sp(v),
                format!(
                    "[tracing] `endpoint` {:?}: expected an http:// URL (OTLP/HTTP, `http://HOST:4318/v1/traces`) or a grpc:// one (OTLP/gRPC, `grpc://HOST:4317`)",
                    v.get_ref()
                ),
            );
            return None;
        }
    };
    Some(Tracing {
        endpoint,
        sample: t
            .sample
            .as_ref()
            .map(|v| ratio(c, v, "sample"))
            .unwrap_or(1.0),
        service_name: t
            .service_name
            .as_ref()
            .map(|v| v.get_ref().clone())
            .unwrap_or_else(|| "pier".to_string()),
        queue: c.int(&t.queue, "queue", 8192, 1, 1 << 24) as usize,
    })
}

/// `[redis]`.
fn redis_of(c: &mut Check, r: &RedisSection) -> Option<Redis> {
    let mut sentinels = Vec::new();
    if let Some(list) = &r.sentinels {
        if list.get_ref().is_empty() || list.get_ref().len() > 16 {
            c.err(sp(list), "[redis] `sentinels`: 1 to 16 \"HOST:PORT\"");
            return None;
        }
        for s in list.get_ref() {
            let ok = s
                .get_ref()
                .rsplit_once(':')
                .is_some_and(|(h, p)| !h.is_empty() && p.parse::<u16>().is_ok_and(|p| p > 0));
            if !ok {
                c.err(sp(s), "[redis] sentinel: \"HOST:PORT\"");
            }
            sentinels.push(s.get_ref().clone());
        }
    }
    let master_name = match (&r.master_name, sentinels.is_empty()) {
        (Some(v), false) if !v.get_ref().is_empty() => v.get_ref().clone(),
        (None, true) => String::new(),
        (Some(v), true) => {
            c.err(sp(v), "[redis] `master_name` goes with `sentinels`");
            String::new()
        }
        (v, false) => {
            c.err(
                v.as_ref().and_then(sp),
                "[redis] `sentinels` need `master_name` (the name they monitor the primary under)",
            );
            String::new()
        }
    };
    let url = match &r.url {
        // Plain TCP only: the fleet's Redis is on its private network
        // (docs/fleet.md); rediss:// (TLS) is not built in.
        Some(v) if v.get_ref().starts_with("redis://") => v.get_ref().clone(),
        // With sentinels the URL gives only the password and database.
        None if !sentinels.is_empty() => "redis://127.0.0.1:6379".to_string(),
        other => {
            c.err(
                other.as_ref().and_then(sp),
                "[redis] needs `url = \"redis://HOST:6379\"` (rediss://, Redis over TLS, is not supported)",
            );
            return None;
        }
    };
    let channel = match &r.channel {
        None => "pier:purge".to_string(),
        Some(v) if !v.get_ref().is_empty() && v.get_ref().len() <= 256 => v.get_ref().clone(),
        Some(v) => {
            c.err(sp(v), "[redis] `channel`: 1 to 256 bytes");
            return None;
        }
    };
    let key_prefix = match &r.key_prefix {
        None => "pier".to_string(),
        Some(v) if !v.get_ref().is_empty() && v.get_ref().len() <= 64 => v.get_ref().clone(),
        Some(v) => {
            c.err(sp(v), "[redis] `key_prefix`: 1 to 64 bytes");
            return None;
        }
    };
    let sync_interval = c.duration(&r.sync_interval, "sync_interval", Duration::from_millis(50));
    if !(Duration::from_millis(5)..=Duration::from_secs(10)).contains(&sync_interval) {
        c.err(
            r.sync_interval.as_ref().and_then(sp),
            "[redis] `sync_interval`: 5ms to 10s",
        );
    }
    Some(Redis {
        url,
        channel,
        timeout: c.duration(&r.timeout, "timeout", Duration::from_secs(1)),
        sync_interval,
        key_prefix,
        sentinels,
        master_name,
    })
}

/// `[route.compress]`.
fn compress(c: &mut Check, route: &str, x: &CompressSection) -> Compress {
    let coding = |c: &mut Check, v: &Spanned<String>| {
        let k = Coding::from_token(v.get_ref().as_bytes());
        if k.is_none() {
            c.err(
                sp(v),
                format!(
                    "route `{route}`: compress: unknown coding {:?} (gzip, br or zstd)",
                    v.get_ref()
                ),
            );
        }
        k
    };
    let mut algorithms = Vec::new();
    match &x.algorithms {
        None => algorithms.extend([Coding::Br, Coding::Zstd, Coding::Gzip]),
        Some(v) => {
            for a in v {
                if let Some(k) = coding(c, a) {
                    if !algorithms.contains(&k) {
                        algorithms.push(k);
                    }
                }
            }
        }
    }
    let store = match &x.store {
        None if algorithms.contains(&Coding::Gzip) || algorithms.is_empty() => Coding::Gzip,
        None => algorithms[0],
        Some(v) => coding(c, v).unwrap_or(Coding::Gzip),
    };
    let types = match &x.types {
        None => [
            "text/*",
            "application/json",
            "application/javascript",
            "application/xml",
            "application/wasm",
            "image/svg+xml",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect(),
        Some(v) => v
            .iter()
            .map(|t| t.get_ref().trim().to_ascii_lowercase())
            .collect(),
    };
    Compress {
        types,
        min_size: c.size(&x.min_size, "min_size", 256, 0),
        level: x
            .level
            .as_ref()
            .map(|_| c.int(&x.level, "level", 6, 0, 22) as i32),
        algorithms,
        store,
    }
}

/// `[route.cache.key]`.
fn cache_key(c: &mut Check, route: &str, x: &CacheKeySection) -> CacheKey {
    let list = |v: &Option<Vec<Spanned<String>>>, lower: bool| -> Vec<String> {
        v.iter()
            .flatten()
            .map(|s| {
                let s = s.get_ref().trim();
                if lower {
                    s.to_ascii_lowercase()
                } else {
                    s.to_string()
                }
            })
            .filter(|s| !s.is_empty())
            .collect()
    };
    let query = match x.query.as_ref().map(|q| (q, q.get_ref().as_str())) {
        None | Some((_, "keep")) => QueryKey::Keep,
        Some((_, "sort")) => QueryKey::Sort,
        Some((_, "drop")) => QueryKey::Drop,
        Some((q, other)) => {
            c.err(
                sp(q),
                format!("route `{route}`: cache key query {other:?}: keep, sort or drop"),
            );
            QueryKey::Keep
        }
    };
    CacheKey {
        headers: list(&x.headers, true),
        cookies: list(&x.cookies, false),
        query,
        query_include: list(&x.query_include, false),
        query_exclude: list(&x.query_exclude, false),
    }
}

fn cors(c: &mut Check, route: &str, x: &CorsSection, grpc_web: bool) -> Cors {
    let list = |c: &mut Check, v: &Option<Vec<Spanned<String>>>, key: &str, d: &[&str]| {
        let Some(v) = v else {
            return d.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        };
        let mut out = Vec::new();
        for item in v {
            let s = item.get_ref().trim();
            if s.is_empty() || s.bytes().any(|b| b.is_ascii_control() || b == b',') {
                c.err(
                    sp(item),
                    format!("route `{route}`: cors `{key}`: {s:?} is not a single value"),
                );
            } else {
                out.push(s.to_string());
            }
        }
        out
    };
    let allow_origins = list(c, &x.allow_origins, "allow_origins", &["*"]);
    let allow_methods = list(
        c,
        &x.allow_methods,
        "allow_methods",
        &["GET", "POST", "OPTIONS"],
    );
    let grpc_headers: &[&str] = if grpc_web {
        &[
            "content-type",
            "x-grpc-web",
            "x-user-agent",
            "grpc-timeout",
            "authorization",
        ]
    } else {
        &["content-type", "authorization"]
    };
    let allow_headers = list(c, &x.allow_headers, "allow_headers", grpc_headers);
    let grpc_expose: &[&str] = if grpc_web {
        &["grpc-status", "grpc-message"]
    } else {
        &[]
    };
    let expose_headers = list(c, &x.expose_headers, "expose_headers", grpc_expose);
    let allow_credentials = x.allow_credentials.unwrap_or(false);
    if allow_credentials && allow_origins.iter().any(|o| o == "*") {
        c.err(
            x.allow_origins.as_ref().and_then(|v| v.first()).and_then(sp),
            format!("route `{route}`: cors `allow_credentials` needs explicit `allow_origins` (browsers refuse `*` with credentials)"),
        );
    }
    Cors {
        allow_origins,
        allow_methods,
        allow_headers,
        expose_headers,
        max_age: c.duration(&x.max_age, "max_age", Duration::from_secs(600)),
        allow_credentials,
    }
}

fn path_of(base: &Path, v: &Spanned<String>) -> PathBuf {
    let p = Path::new(v.get_ref());
    if p.is_absolute() {
        p.to_path_buf()
    } else {
        base.join(p)
    }
}

fn upstream_tls(c: &mut Check, name: &str, t: &UpstreamTlsSection, base: &Path) -> UpstreamTls {
    let client_cert = match (&t.cert, &t.key) {
        (Some(cert), Some(key)) => Some(CertFiles {
            cert: path_of(base, cert),
            key: path_of(base, key),
        }),
        (None, None) => None,
        (Some(v), None) | (None, Some(v)) => {
            c.err(
                sp(v),
                format!("upstream `{name}`: tls `cert` and `key` go together (a client certificate and its key)"),
            );
            None
        }
    };
    let server_name = t.server_name.as_ref().and_then(|v| {
        let s = v.get_ref().trim().to_ascii_lowercase();
        if s.is_empty()
            || s.len() > 253
            || !s
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'.' || b == b':')
        {
            c.err(
                sp(v),
                format!(
                    "upstream `{name}`: tls `server_name` {s:?} is not a host name or IP address"
                ),
            );
            None
        } else {
            Some(s)
        }
    });
    UpstreamTls {
        server_name,
        verify: t.verify.unwrap_or(true),
        ca: t.ca.as_ref().map(|v| path_of(base, v)),
        client_cert,
        session_resumption: t.session_resumption.unwrap_or(true),
    }
}

fn listener_tls(c: &mut Check, name: &str, t: &ListenerTlsSection, base: &Path) -> ListenerTls {
    let mut certificates = Vec::new();
    match (&t.cert, &t.key) {
        (Some(cert), Some(key)) => certificates.push(CertFiles {
            cert: path_of(base, cert),
            key: path_of(base, key),
        }),
        (None, None) => {}
        (Some(v), None) | (None, Some(v)) => c.err(
            sp(v),
            format!("listener `{name}`: tls `cert` and `key` go together"),
        ),
    }
    for e in t.certificates.iter().flatten() {
        certificates.push(CertFiles {
            cert: path_of(base, &e.cert),
            key: path_of(base, &e.key),
        });
    }
    let acme = t.acme.as_ref().map(|a| listener_acme(c, name, a, base));
    if certificates.is_empty() && t.cert.is_none() && t.key.is_none() && acme.is_none() {
        c.err(
            None,
            format!("listener `{name}`: [listener.tls] needs a certificate: `cert` and `key`, `certificates = [{{ cert = \"FILE\", key = \"FILE\" }}]`, or `[listener.tls.acme]`"),
        );
    }
    let unknown_sni = match t.unknown_sni.as_ref().map(|v| (v, v.get_ref().as_str())) {
        None | Some((_, "default")) => UnknownSni::Default,
        Some((_, "refuse")) => UnknownSni::Refuse,
        Some((v, other)) => {
            c.err(
                sp(v),
                format!("`unknown_sni` {other:?}: expected \"default\" or \"refuse\""),
            );
            UnknownSni::Default
        }
    };
    let min_version = match t.min_version.as_ref().map(|v| (v, v.get_ref().as_str())) {
        None | Some((_, "1.2")) => TlsVersion::Tls12,
        Some((_, "1.3")) => TlsVersion::Tls13,
        Some((v, other)) => {
            c.err(
                sp(v),
                format!("`min_version` {other:?}: expected \"1.2\" or \"1.3\""),
            );
            TlsVersion::Tls12
        }
    };
    let mut alpn = Vec::new();
    match &t.alpn {
        None => alpn.push("http/1.1".to_string()),
        Some(list) => {
            for v in list {
                match v.get_ref().as_str() {
                    p @ ("http/1.1" | "h2") if !alpn.iter().any(|a| a == p) => {
                        alpn.push(p.to_string())
                    }
                    other => c.err(
                        sp(v),
                        format!("`alpn` {other:?}: expected \"h2\" or \"http/1.1\", each once"),
                    ),
                }
            }
        }
    }
    let client_ca = t.client_ca.as_ref().map(|v| path_of(base, v));
    let client_auth = match t.client_auth.as_ref().map(|v| (v, v.get_ref().as_str())) {
        None if client_ca.is_some() => ClientAuth::Required,
        None => ClientAuth::Off,
        Some((_, "off")) => ClientAuth::Off,
        Some((_, "optional")) => ClientAuth::Optional,
        Some((_, "required")) => ClientAuth::Required,
        Some((v, other)) => {
            c.err(
                sp(v),
                format!("`client_auth` {other:?}: expected \"off\", \"optional\" or \"required\""),
            );
            ClientAuth::Off
        }
    };
    if client_auth != ClientAuth::Off && client_ca.is_none() {
        c.err(
            t.client_auth.as_ref().and_then(sp),
            format!("listener `{name}`: `client_auth` needs `client_ca` (the CA that signs client certificates)"),
        );
    }
    let ocsp_responder = t.ocsp_responder.as_ref().and_then(|v| {
        let u = v.get_ref();
        if u.strip_prefix("http://").is_some_and(|r| !r.is_empty()) {
            Some(u.clone())
        } else {
            c.err(
                sp(v),
                format!("`ocsp_responder` {u:?}: expected an http:// URL (OCSP is fetched over plain HTTP, RFC 6960)"),
            );
            None
        }
    });
    let session_ticket_keys: Vec<PathBuf> = t
        .session_ticket_keys
        .iter()
        .flatten()
        .map(|v| path_of(base, v))
        .collect();
    if let Some(list) = &t.session_ticket_keys {
        let at = list.first().and_then(sp);
        if list.is_empty() || list.len() > 16 {
            c.err(
                at,
                format!("listener `{name}`: `session_ticket_keys` takes 1 to 16 files"),
            );
        } else if t.session_tickets == Some(false) {
            c.err(
                at,
                format!("listener `{name}`: `session_ticket_keys` with `session_tickets = false`"),
            );
        }
    }
    ListenerTls {
        certificates,
        unknown_sni,
        min_version,
        alpn,
        session_cache: c.int(&t.session_cache, "session_cache", 20_000, 0, 10_000_000) as usize,
        session_tickets: t.session_tickets.unwrap_or(true),
        session_ticket_keys,
        client_ca,
        client_auth,
        handshake_timeout: c.duration(
            &t.handshake_timeout,
            "handshake_timeout",
            Duration::from_secs(10),
        ),
        max_handshakes: c.int(&t.max_handshakes, "max_handshakes", 1024, 1, 1_000_000) as usize,
        max_pending_hellos: c.int(
            &t.max_pending_hellos,
            "max_pending_hellos",
            4096,
            1,
            10_000_000,
        ) as usize,
        ocsp_stapling: t.ocsp_stapling.unwrap_or(true),
        ocsp_responder,
        acme,
    }
}

/// An ACME certificate's name, lower-cased: a DNS name of two labels or
/// more (no wildcards: those need DNS-01).
pub fn acme_domain(d: &str) -> Result<String, String> {
    let n = d.trim_end_matches('.').to_ascii_lowercase();
    let label_ok = |l: &str| {
        !l.is_empty()
            && l.len() <= 63
            && !l.starts_with('-')
            && !l.ends_with('-')
            && l.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-')
    };
    if n.len() > 253 || !n.contains('.') || !n.split('.').all(label_ok) {
        return Err(format!("acme domain {d:?}: expected a DNS name such as \"example.com\" (no wildcards: they need DNS-01)"));
    }
    Ok(n)
}

fn listener_acme(c: &mut Check, name: &str, a: &AcmeSection, base: &Path) -> Acme {
    let mut domains: Vec<String> = Vec::new();
    for d in &a.domains {
        match acme_domain(d.get_ref()) {
            Err(e) => c.err(sp(d), format!("listener `{name}`: {e}")),
            Ok(n) if !domains.contains(&n) => domains.push(n),
            Ok(_) => {}
        }
    }
    if a.domains.is_empty() && a.on_demand != Some(true) {
        c.err(
            None,
            format!(
                "listener `{name}`: [listener.tls.acme] needs `domains = [\"example.com\", …]`"
            ),
        );
    }
    let directory = match &a.directory {
        Some(v) if v.get_ref().starts_with("https://") => v.get_ref().clone(),
        Some(v) => {
            c.err(
                sp(v),
                format!(
                    "listener `{name}`: acme `directory` {:?}: expected an https:// URL",
                    v.get_ref()
                ),
            );
            String::new()
        }
        None => LETS_ENCRYPT.to_string(),
    };
    let storage = match &a.storage {
        Some(v) => path_of(base, v),
        None => base.join("acme"),
    };
    let challenge = match a.challenge.as_ref().map(|v| v.get_ref().as_str()) {
        None | Some("tls-alpn-01") => AcmeChallenge::TlsAlpn01,
        Some("http-01") => AcmeChallenge::Http01,
        Some(other) => {
            c.err(
                a.challenge.as_ref().and_then(sp),
                format!("listener `{name}`: acme `challenge` {other:?}: expected \"tls-alpn-01\" or \"http-01\""),
            );
            AcmeChallenge::TlsAlpn01
        }
    };
    let on_demand = match (a.on_demand, &a.ask) {
        (Some(true), Some(ask)) if ask.get_ref().starts_with("http://") => Some(OnDemand {
            ask: ask.get_ref().clone(),
            per_minute: c.int(&a.on_demand_rate, "on_demand_rate", 10, 1, 100_000) as u32,
            max: c.int(&a.on_demand_max, "on_demand_max", 100, 1, 100_000) as usize,
        }),
        (Some(true), Some(ask)) => {
            c.err(
                sp(ask),
                format!(
                    "listener `{name}`: acme `ask` {:?}: expected an http:// URL",
                    ask.get_ref()
                ),
            );
            None
        }
        (Some(true), None) => {
            c.err(
                None,
                format!("listener `{name}`: acme `on_demand = true` needs `ask = \"http://…\"`, the URL that approves each name (anyone can send any SNI)"),
            );
            None
        }
        _ => None,
    };
    Acme {
        challenge,
        ari: a.ari.unwrap_or(true),
        on_demand,
        domains,
        email: a.email.as_ref().map(|e| e.get_ref().clone()),
        directory,
        directory_ca: a.directory_ca.as_ref().map(|v| path_of(base, v)),
        storage,
        renew_before: c.duration(
            &a.renew_before,
            "renew_before",
            Duration::from_secs(30 * 86_400),
        ),
    }
}

fn listener_redirect(c: &mut Check, l: &ListenerEntry) -> Option<HttpsRedirect> {
    let status = l.redirect_https.as_ref()?;
    let s = *status.get_ref();
    if ![301, 302, 307, 308].contains(&s) {
        c.err(sp(status), "`redirect_https` must be 301, 302, 307 or 308");
    }
    let port = l
        .https_port
        .as_ref()
        .map(|p| c.int(&Some(p.clone()), "https_port", 443, 1, 65535) as u16)
        .filter(|&p| p != 443);
    Some(HttpsRedirect {
        status: s as u16,
        port,
    })
}

/// Sockets bound so far (port 0 excluded: the OS picks distinct ports).
#[derive(Default)]
struct Bound(Vec<(SocketAddr, String)>);

impl Bound {
    fn add(&mut self, c: &mut Check, addr: SocketAddr, what: &str, span: Span) {
        if addr.port() == 0 {
            return;
        }
        if let Some((_, other)) = self
            .0
            .iter()
            .find(|(a, _)| reaches(*a, addr) || reaches(addr, *a))
        {
            c.err(span, format!("{addr} is also used by {other}"));
            return;
        }
        self.0.push((addr, what.to_string()));
    }
}

/// Would connecting to `to` reach a socket bound on `bound`? (Same port, and
/// the same IP or a wildcard bind of the same family.)
fn reaches(bound: SocketAddr, to: SocketAddr) -> bool {
    bound.port() != 0
        && bound.port() == to.port()
        && (bound.ip() == to.ip()
            || (bound.ip().is_unspecified() && bound.is_ipv4() == to.is_ipv4()))
}

/// Is an upstream server at `to` certainly this Pier's listener on `bound`?
/// (A wildcard bind is only known to cover loopback addresses.)
fn loops(bound: SocketAddr, to: SocketAddr) -> bool {
    let to_ip = normalize(to.ip());
    bound.port() != 0
        && bound.port() == to.port()
        && (bound.ip() == to_ip
            || (bound.ip().is_unspecified() && (to_ip.is_loopback() || to_ip.is_unspecified())))
}

/// The entry's name, or "listener-3" style when absent; duplicates are errors.
fn unique_name(
    c: &mut Check,
    name: &Option<Spanned<String>>,
    kind: &str,
    index: usize,
    seen: &mut HashSet<String>,
) -> String {
    let (value, span) = match name {
        Some(n) => (n.get_ref().clone(), sp(n)),
        None => (format!("{kind}-{}", index + 1), None),
    };
    if value.is_empty() {
        c.err(span.clone(), format!("{kind} `name` must not be empty"));
    }
    if seen.contains(&value) {
        c.err(span, format!("duplicate {kind} name `{value}`"));
    } else {
        seen.insert(value.clone());
    }
    value
}

fn upstream(
    c: &mut Check,
    name: &str,
    e: &UpstreamEntry,
    deny: &[Cidr],
    listeners: &[Listener],
    base: &Path,
) -> Upstream {
    let mut servers = Vec::new();
    let mut resolve_names = Vec::new();
    let resolve = e.resolve.unwrap_or(true);
    if e.servers.get_ref().is_empty() {
        c.err(
            sp(&e.servers),
            format!("upstream `{name}`: `servers` must not be empty"),
        );
    }
    for s in e.servers.get_ref() {
        let (addr_s, addr_span, weight) = match s.get_ref() {
            ServerSpec::Addr(a) => (a.as_str(), sp(s), 1),
            ServerSpec::Table(t) => (
                t.addr.get_ref().as_str(),
                sp(&t.addr),
                c.int(&t.weight, "weight", 1, 1, 1000) as u32,
            ),
        };
        // A host name with `resolve` on is resolved while running (pier-proxy's
        // dns module), not here: `pier check` needs no DNS and a name that
        // does not resolve yet does not stop the start.
        if resolve && parse_listen_addr(addr_s).is_err() {
            match split_host_port(addr_s) {
                Ok((host, port)) => resolve_names.push(NamedServer {
                    host: host.into(),
                    port,
                    weight,
                }),
                Err(msg) => c.err(addr_span, format!("upstream `{name}`: {msg}")),
            }
            continue;
        }
        let host: Option<std::sync::Arc<str>> = match parse_listen_addr(addr_s) {
            Ok(_) => None,
            Err(_) => split_host_port(addr_s).ok().map(|(h, _)| h.into()),
        };
        match resolve_upstream_addr(addr_s) {
            Ok(addrs) => {
                for addr in addrs {
                    if let Some(rule) = deny.iter().find(|r| r.contains(addr.ip())) {
                        c.err(
                            addr_span.clone(),
                            format!("upstream `{name}`: server {addr} is in security.deny_origins ({rule})"),
                        );
                    }
                    if let Some(l) = listeners.iter().find(|l| loops(l.addr, addr)) {
                        c.err(
                            addr_span.clone(),
                            format!(
                                "upstream `{name}`: server {addr} is Pier's own listener `{}` (requests would loop)",
                                l.name
                            ),
                        );
                    }
                    servers.push(UpstreamServer {
                        addr,
                        weight,
                        host: host.clone(),
                    });
                }
            }
            Err(msg) => c.err(addr_span, format!("upstream `{name}`: {msg}")),
        }
    }

    let weighted =
        servers.iter().any(|s| s.weight != 1) || resolve_names.iter().any(|s| s.weight != 1);
    let balance = match &e.balance {
        // Weights given but no balancer named: the user wants them honoured.
        None if weighted => Balance::WeightedRoundRobin,
        None => Balance::RoundRobin,
        Some(b) => match b.get_ref().as_str() {
            "round_robin" => Balance::RoundRobin,
            "weighted_round_robin" => Balance::WeightedRoundRobin,
            "least_conn" => Balance::LeastConn,
            "random_two" => Balance::Random2,
            // The key is filled in below.
            "hash" => Balance::Hash(HashKey::Path),
            other => {
                c.err(
                    sp(b),
                    format!(
                        "unknown balance {other:?}: expected round_robin, weighted_round_robin, least_conn, random_two or hash"
                    ),
                );
                Balance::RoundRobin
            }
        },
    };
    // least_conn and random_two weigh their choices; plain round robin cannot.
    if weighted && balance == Balance::RoundRobin && e.balance.is_some() {
        c.err(
            e.balance.as_ref().and_then(sp),
            format!(
                "upstream `{name}`: server weights are ignored by round_robin; use \"weighted_round_robin\" (or least_conn, random_two, hash)"
            ),
        );
    }
    let balance = match (balance, &e.hash_key) {
        (Balance::Hash(_), Some(k)) => match parse_hash_key(k.get_ref()) {
            Ok(key) => Balance::Hash(key),
            Err(msg) => {
                c.err(sp(k), msg);
                Balance::Hash(HashKey::Path)
            }
        },
        (Balance::Hash(_), None) => {
            c.err(
                e.balance.as_ref().and_then(sp),
                format!("upstream `{name}`: balance = \"hash\" needs a `hash_key` (header:NAME, cookie:NAME, client_ip or path)"),
            );
            Balance::Hash(HashKey::Path)
        }
        (b, Some(k)) => {
            c.err(
                sp(k),
                format!("upstream `{name}`: `hash_key` is only used with balance = \"hash\""),
            );
            b
        }
        (b, None) => b,
    };

    let d = Upstream::with_defaults(name, Vec::new());
    let scope = format!("upstream `{name}`");
    let headers = header_rules(c, &scope, e.headers.as_ref());
    let host_header = e
        .host_header
        .as_ref()
        .and_then(|h| host_header(c, &scope, h))
        .unwrap_or(d.host_header.clone());
    let health_check = e.health_check.as_ref().map(|h| health(c, name, h));
    let retry_budget_ratio = match &e.retry_budget {
        None => d.retry_budget_ratio,
        Some(v) if (0.0..=1.0).contains(v.get_ref()) => *v.get_ref(),
        Some(v) => {
            c.err(
                sp(v),
                "`retry_budget` must be between 0.0 and 1.0 (a fraction of requests)",
            );
            d.retry_budget_ratio
        }
    };
    Upstream {
        name: name.to_string(),
        servers,
        balance,
        health_check,
        max_fails: c.int(&e.max_fails, "max_fails", d.max_fails.into(), 0, 1000) as u32,
        passive_recover: c.duration(&e.passive_recover, "passive_recover", d.passive_recover),
        retries: c.int(&e.retries, "retries", d.retries.into(), 0, 10) as u32,
        retry_budget_ratio,
        retry_min_per_sec: c.int(
            &e.retry_min_per_sec,
            "retry_min_per_sec",
            d.retry_min_per_sec.into(),
            0,
            1_000_000,
        ) as u32,
        pool_idle_per_server: c.int(
            &e.pool_idle_per_server,
            "pool_idle_per_server",
            d.pool_idle_per_server as u64,
            0,
            1_000_000,
        ) as usize,
        max_connections_per_server: c.int(
            &e.max_connections_per_server,
            "max_connections_per_server",
            0,
            0,
            10_000_000,
        ) as usize,
        max_inflight_per_server: c.int(
            &e.max_inflight_per_server,
            "max_inflight_per_server",
            d.max_inflight_per_server.into(),
            0,
            10_000_000,
        ) as u32,
        headers,
        host_header,
        tls: e.tls.as_ref().map(|t| upstream_tls(c, name, t, base)),
        protocol: match e.protocol.as_ref().map(|v| (v, v.get_ref().as_str())) {
            None | Some((_, "http1")) => UpstreamProtocol::Http1,
            Some((v, "h2")) => {
                if e.tls.is_none() {
                    c.err(sp(v), format!("upstream `{name}`: protocol = \"h2\" is HTTP/2 over TLS: add an [upstream.{name}.tls] table, or use \"h2c\" for cleartext"));
                }
                UpstreamProtocol::H2
            }
            Some((v, "h2c")) => {
                if e.tls.is_some() {
                    c.err(sp(v), format!("upstream `{name}`: protocol = \"h2c\" is cleartext HTTP/2; with TLS use \"h2\""));
                }
                UpstreamProtocol::H2c
            }
            Some((v, "auto")) => {
                if e.tls.is_none() {
                    c.err(sp(v), format!("upstream `{name}`: protocol = \"auto\" picks HTTP/2 or HTTP/1.1 by ALPN over TLS: add an [upstream.{name}.tls] table, or use \"h2c\" or \"http1\" for cleartext"));
                }
                UpstreamProtocol::Auto
            }
            Some((v, other)) => {
                c.err(
                    sp(v),
                    format!("unknown protocol {other:?}: expected \"http1\", \"h2\", \"h2c\" or \"auto\""),
                );
                UpstreamProtocol::Http1
            }
        },
        h2_max_streams: c.int(
            &e.h2_max_streams,
            "h2_max_streams",
            d.h2_max_streams as u64,
            1,
            10_000,
        ) as usize,
        send_proxy_protocol: match e
            .send_proxy_protocol
            .as_ref()
            .map(|v| (v, v.get_ref().as_str()))
        {
            None | Some((_, "off")) => None,
            Some((_, "v1")) => Some(SendProxy::V1),
            Some((_, "v2")) => Some(SendProxy::V2),
            Some((v, other)) => {
                c.err(
                    sp(v),
                    format!(
                        "unknown send_proxy_protocol {other:?}: expected \"v1\", \"v2\" or \"off\""
                    ),
                );
                None
            }
        },
        resolve: resolve_names,
    }
}

/// "name:port" of a server to resolve: the host lower-cased, checked to be
/// a DNS name (letters, digits, `-`, `_`, dots; at most 253 bytes).
fn split_host_port(s: &str) -> Result<(String, u16), String> {
    // Not even HOST:PORT: the address parser says what is expected.
    let bad = || parse_listen_addr(s).err().unwrap_or_default();
    let (host, port) = s.rsplit_once(':').ok_or_else(bad)?;
    let port: u16 = port.parse().map_err(|_| bad())?;
    let host = host.strip_suffix('.').unwrap_or(host).to_ascii_lowercase();
    let label_ok = |l: &str| {
        !l.is_empty()
            && l.len() <= 63
            && l.bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
    };
    if host.is_empty() || host.len() > 253 || !host.split('.').all(label_ok) {
        return Err(format!("invalid server {s:?}: {host:?} is not a host name"));
    }
    Ok((host, port))
}

fn resolver(c: &mut Check, r: ResolverSection) -> Resolver {
    let d = Resolver::default();
    let mut nameservers = Vec::new();
    for v in r.nameservers.unwrap_or_default() {
        // A bare IP means port 53.
        let parsed = v
            .get_ref()
            .parse::<IpAddr>()
            .map(|ip| SocketAddr::new(ip, 53))
            .or_else(|_| v.get_ref().parse::<SocketAddr>());
        match parsed {
            Ok(a) => nameservers.push(a),
            Err(_) => c.err(
                sp(&v),
                format!(
                    "`nameservers`: invalid address {:?}: expected IP or IP:PORT",
                    v.get_ref()
                ),
            ),
        }
    }
    let min_ttl = c.duration(&r.min_ttl, "min_ttl", d.min_ttl);
    let max_ttl = c.duration(&r.max_ttl, "max_ttl", d.max_ttl);
    if max_ttl < min_ttl {
        c.err(
            r.max_ttl.as_ref().and_then(sp),
            "`max_ttl` must not be less than `min_ttl`",
        );
    }
    Resolver {
        nameservers,
        min_ttl,
        max_ttl,
        timeout: c.duration(&r.timeout, "timeout", d.timeout),
    }
}

fn parse_hash_key(s: &str) -> Result<HashKey, String> {
    let bad = || {
        format!("invalid hash_key {s:?}: expected \"header:NAME\", \"cookie:NAME\", \"client_ip\" or \"path\"")
    };
    match s {
        "client_ip" => Ok(HashKey::ClientIp),
        "path" => Ok(HashKey::Path),
        _ => match s.split_once(':') {
            // Header names are case-insensitive: store them lower-cased.
            Some(("header", n)) if is_token(n) => Ok(HashKey::Header(n.to_ascii_lowercase())),
            Some(("cookie", n)) if is_token(n) => Ok(HashKey::Cookie(n.to_string())),
            _ => Err(bad()),
        },
    }
}

/// An HTTP token (RFC 9110 tchar), the syntax of header and cookie names.
fn is_token(s: &str) -> bool {
    !s.is_empty()
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b))
}

fn health(c: &mut Check, name: &str, h: &HealthCheckSection) -> HealthCheck {
    let kind = match h.kind.as_ref().map(|k| (k.get_ref().as_str(), sp(k))) {
        None | Some(("http", _)) => {
            let (expect_min, expect_max) = match &h.expect {
                None => (200, 399),
                Some(e) => parse_expect(e.get_ref()).unwrap_or_else(|msg| {
                    c.err(sp(e), msg);
                    (200, 399)
                }),
            };
            let path = match &h.path {
                None => "/".to_string(),
                Some(p) if p.get_ref().starts_with('/') => p.get_ref().clone(),
                Some(p) => {
                    c.err(sp(p), "health check `path` must start with `/`");
                    "/".to_string()
                }
            };
            HealthKind::Http {
                path,
                host: h.host.as_ref().map(|v| v.get_ref().clone()),
                expect_min,
                expect_max,
            }
        }
        Some(("tcp", _)) => {
            for (key, v) in [("path", &h.path), ("host", &h.host), ("expect", &h.expect)] {
                if let Some(v) = v {
                    c.err(
                        sp(v),
                        format!("upstream `{name}`: `{key}` only applies to type = \"http\""),
                    );
                }
            }
            HealthKind::Tcp
        }
        Some(("grpc", _)) => {
            for (key, v) in [("path", &h.path), ("host", &h.host), ("expect", &h.expect)] {
                if let Some(v) = v {
                    c.err(
                        sp(v),
                        format!("upstream `{name}`: `{key}` only applies to type = \"http\""),
                    );
                }
            }
            HealthKind::Grpc {
                service: h
                    .service
                    .as_ref()
                    .map(|v| v.get_ref().clone())
                    .unwrap_or_default(),
            }
        }
        Some((other, span)) => {
            c.err(
                span,
                format!(
                    "unknown health check type {other:?}: expected \"http\", \"tcp\" or \"grpc\""
                ),
            );
            HealthKind::Tcp
        }
    };
    if let (Some(v), false) = (&h.service, matches!(kind, HealthKind::Grpc { .. })) {
        c.err(
            sp(v),
            format!("upstream `{name}`: `service` only applies to type = \"grpc\""),
        );
    }
    HealthCheck {
        kind,
        interval: c.duration(&h.interval, "interval", HealthCheck::DEFAULT_INTERVAL),
        timeout: c.duration(&h.timeout, "timeout", HealthCheck::DEFAULT_TIMEOUT),
        rise: c.int(&h.rise, "rise", HealthCheck::DEFAULT_RISE.into(), 1, 1000) as u32,
        fall: c.int(&h.fall, "fall", HealthCheck::DEFAULT_FALL.into(), 1, 1000) as u32,
    }
}

/// "200", "200-399".
fn parse_expect(s: &str) -> Result<(u16, u16), String> {
    let bad = || {
        format!("invalid expect {s:?}: expected a status or a range, e.g. \"200\" or \"200-399\"")
    };
    let (a, b) = s.split_once('-').unwrap_or((s, s));
    let a: u16 = a.trim().parse().map_err(|_| bad())?;
    let b: u16 = b.trim().parse().map_err(|_| bad())?;
    if !(100..=999).contains(&a) || !(100..=999).contains(&b) || a > b {
        return Err(bad());
    }
    Ok((a, b))
}

// === Lua ===

/// The Lua source of `key` (inline code) or `{key}_file`; `chunk` names
/// inline code in Lua error messages.
fn lua_source(
    c: &mut Check,
    key: &str,
    inline: &Option<Spanned<String>>,
    file: &Option<Spanned<String>>,
    chunk: impl FnOnce() -> String,
    base: &Path,
) -> Option<LuaSource> {
    match (inline, file) {
        (None, None) => None,
        (Some(_), Some(f)) => {
            c.err(sp(f), format!("give `{key}` or `{key}_file`, not both"));
            None
        }
        (Some(code), None) => Some(LuaSource::Inline {
            code: code.get_ref().clone(),
            name: chunk(),
        }),
        (None, Some(f)) => {
            if f.get_ref().is_empty() {
                c.err(sp(f), format!("`{key}_file` must not be empty"));
                return None;
            }
            let joined = base.join(f.get_ref());
            // Absolute, so a later change of working directory (or a reload)
            // still finds it.
            let path = std::path::absolute(&joined).unwrap_or(joined);
            match std::fs::metadata(&path) {
                Ok(m) if m.is_file() => Some(LuaSource::File(path)),
                Ok(_) => {
                    c.err(
                        sp(f),
                        format!("`{key}_file`: {} is not a file", path.display()),
                    );
                    None
                }
                Err(e) => {
                    c.err(
                        sp(f),
                        format!("`{key}_file`: cannot read {}: {e}", path.display()),
                    );
                    None
                }
            }
        }
    }
}

fn lua_config(c: &mut Check, l: LuaSection, base: &Path) -> LuaConfig {
    let d = LuaConfig::default();
    let init = lua_source(c, "init", &l.init, &l.init_file, || "init".into(), base);
    let init_worker = lua_source(
        c,
        "init_worker",
        &l.init_worker,
        &l.init_worker_file,
        || "init_worker".into(),
        base,
    );
    let memory_limit = c.size(&l.memory_limit, "memory_limit", d.memory_limit as u64, 0);
    let memory_limit = if memory_limit != 0 && memory_limit < MIN_LUA_MEMORY {
        c.err(
            l.memory_limit.as_ref().and_then(sp),
            "`memory_limit` must be 0 (unlimited) or at least 1m",
        );
        d.memory_limit
    } else {
        usize::try_from(memory_limit).unwrap_or(usize::MAX)
    };
    let mut shared = Vec::new();
    for (name, size) in l.shared.iter().flatten() {
        if !is_dict_name(name) {
            c.err(
                sp(size),
                format!("shared dict name {name:?}: use letters, digits and `_` (not starting with a digit), so that `pier.shared.{name}` works"),
            );
        }
        let cap = c.size(&Some(size.clone()), name, 0, MIN_SHARED_DICT);
        if cap >= MIN_SHARED_DICT {
            shared.push((name.clone(), usize::try_from(cap).unwrap_or(usize::MAX)));
        }
    }
    let mut package_path = Vec::new();
    for p in l.package_path.iter().flatten() {
        let s = p.get_ref();
        if !s.contains('?') || s.contains(';') {
            c.err(
                sp(p),
                format!("`package_path` entry {s:?}: a pattern with `?` for the module name and no `;`, e.g. \"lua/?.lua\""),
            );
            continue;
        }
        let joined = base.join(s);
        let abs = std::path::absolute(&joined).unwrap_or(joined);
        match abs.to_str() {
            Some(a) => package_path.push(a.to_string()),
            None => c.err(
                sp(p),
                "`package_path`: the config file's directory is not UTF-8",
            ),
        }
    }
    let mut bytes = |v: &Option<Spanned<SizeValue>>, key: &str, default: usize| {
        let n = c.size(v, key, default as u64, MIN_LUA_BUFFER);
        usize::try_from(n).unwrap_or(usize::MAX)
    };
    let max_response_body = bytes(
        &l.max_response_body,
        "max_response_body",
        d.max_response_body,
    );
    let socket_buffer = bytes(&l.socket_buffer, "socket_buffer", d.socket_buffer);
    let http_max_body = bytes(&l.http_max_body, "http_max_body", d.http_max_body);
    let max_sockets_per_request = c.int(
        &l.max_sockets_per_request,
        "max_sockets_per_request",
        d.max_sockets_per_request as u64,
        1,
        1_000_000,
    ) as usize;
    let max_sockets_per_worker = c.int(
        &l.max_sockets_per_worker,
        "max_sockets_per_worker",
        d.max_sockets_per_worker as u64,
        1,
        16_000_000,
    ) as usize;
    // Zero is allowed: connects then open at once (ngx_lua's rule).
    let socket_pool_wait = match &l.socket_pool_wait {
        None => d.socket_pool_wait,
        Some(v) => match parse_duration(v.get_ref()) {
            Ok(w) if w <= MAX_SOCKET_POOL_WAIT => w,
            Ok(_) => {
                c.err(sp(v), "`socket_pool_wait` must be at most 60s");
                d.socket_pool_wait
            }
            Err(e) => {
                c.err(sp(v), format!("`socket_pool_wait`: {e}"));
                d.socket_pool_wait
            }
        },
    };
    LuaConfig {
        init,
        init_worker,
        memory_limit,
        package_path,
        shared,
        max_response_body,
        socket_buffer,
        http_max_body,
        max_sockets_per_request,
        max_sockets_per_worker,
        socket_pool_wait,
    }
}

/// Longest `[lua] socket_pool_wait`.
const MAX_SOCKET_POOL_WAIT: Duration = Duration::from_secs(60);

/// Smallest Lua body / socket buffer bound.
const MIN_LUA_BUFFER: u64 = 1 << 10;

/// A Lua state needs some heap before any user code runs.
const MIN_LUA_MEMORY: u64 = 1 << 20;
/// Smallest shared dictionary (as nginx's `lua_shared_dict`).
const MIN_SHARED_DICT: u64 = 8 << 10;

/// A Lua identifier.
fn is_dict_name(s: &str) -> bool {
    s.bytes().next().is_some_and(|b| !b.is_ascii_digit())
        && s.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_')
}

fn route_lua(c: &mut Check, route: &str, l: Option<&RouteLuaSection>, base: &Path) -> RouteLua {
    let Some(l) = l else {
        return RouteLua::default();
    };
    let [access, content, balancer, upstream_request, header_filter, body_filter, log] =
        l.phases().map(|(phase, inline, file)| {
            lua_source(
                c,
                phase,
                inline,
                file,
                || format!("route {route} {phase}"),
                base,
            )
        });
    RouteLua {
        access,
        content,
        balancer,
        upstream_request,
        header_filter,
        body_filter,
        log,
    }
}

// === [[limit]] ===

fn limit_rule(
    c: &mut Check,
    name: String,
    e: &LimitEntry,
    span: Span,
    routes: &[Route],
    has_redis: bool,
) -> Option<LimitRule> {
    if !name
        .bytes()
        .all(|b| b.is_ascii_alphanumeric() || b"_-.".contains(&b))
    {
        c.err(
            e.name.as_ref().and_then(sp),
            format!("limit name {name:?}: use letters, digits, `_`, `-` and `.` (it is a metrics label)"),
        );
    }
    let mut key = Vec::new();
    let parts: Vec<(&str, Span)> = match e.key.get_ref() {
        OneOrMany::One(s) => vec![(s.as_str(), sp(&e.key))],
        OneOrMany::Many(v) => {
            if v.is_empty() {
                c.err(
                    sp(&e.key),
                    format!("limit `{name}`: `key` must not be empty"),
                );
            }
            v.iter().map(|s| (s.get_ref().as_str(), sp(s))).collect()
        }
    };
    for (s, part_span) in parts {
        match parse_limit_key(s) {
            Ok(part) if key.contains(&part) => c.err(
                part_span,
                format!("limit `{name}`: key part {s:?} is given twice"),
            ),
            Ok(part) => key.push(part),
            Err(msg) => c.err(part_span, msg),
        }
    }

    let kind = match (&e.rate, &e.concurrent) {
        (Some(_), Some(n)) => {
            c.err(
                sp(n),
                format!("limit `{name}`: give `rate` or `concurrent`, not both"),
            );
            None
        }
        (None, None) => {
            c.err(
                span,
                format!("limit `{name}`: give `rate` (e.g. \"10/s\") or `concurrent` (e.g. 100)"),
            );
            None
        }
        (Some(r), None) => {
            let burst = c.int(&e.burst, "burst", 0, 0, 1_000_000) as u32;
            match parse_rate(r.get_ref()) {
                Ok(per_sec) => Some(LimitKind::Rate { per_sec, burst }),
                Err(msg) => {
                    c.err(sp(r), msg);
                    None
                }
            }
        }
        (None, Some(_)) => {
            if let Some(b) = &e.burst {
                c.err(
                    sp(b),
                    format!("limit `{name}`: `burst` only applies to `rate`"),
                );
            }
            let max = c.int(&e.concurrent, "concurrent", 0, 1, 10_000_000) as u32;
            // 0: out of range, reported by `int`.
            (max > 0).then_some(LimitKind::Concurrent { max })
        }
    };

    let rule_routes = e.routes.as_ref().map(|list| {
        if list.get_ref().is_empty() {
            c.err(
                sp(list),
                format!("limit `{name}`: `routes` must not be empty (leave it out to apply to every route)"),
            );
        }
        let mut names = Vec::new();
        for r in list.get_ref() {
            let target = r.get_ref();
            if !routes.iter().any(|x| &x.name == target) {
                let defined: Vec<&str> = routes.iter().map(|x| x.name.as_str()).collect();
                let defined = if defined.is_empty() {
                    "none".to_string()
                } else {
                    defined.join(", ")
                };
                c.err(
                    sp(r),
                    format!("limit `{name}`: unknown route `{target}` (defined: {defined})"),
                );
            } else if !names.contains(target) {
                names.push(target.clone());
            }
        }
        names
    });

    let default_status = match kind {
        Some(LimitKind::Concurrent { .. }) => 503,
        _ => 429,
    };
    let status = c.int(&e.status, "status", default_status, 400, 599) as u16;
    let global = match e.scope.as_ref().map(|v| v.get_ref().as_str()) {
        None | Some("local") => false,
        Some("global") => {
            if matches!(kind, Some(LimitKind::Concurrent { .. })) {
                c.err(
                    e.scope.as_ref().and_then(sp),
                    format!("limit `{name}`: `scope = \"global\"` applies to `rate` limits"),
                );
            }
            if !has_redis {
                c.err(
                    e.scope.as_ref().and_then(sp),
                    format!("limit `{name}`: `scope = \"global\"` counts through Redis: add a [redis] table"),
                );
            }
            true
        }
        Some(other) => {
            c.err(
                e.scope.as_ref().and_then(sp),
                format!("limit `{name}`: scope {other:?}: \"local\" or \"global\""),
            );
            false
        }
    };
    let fail = match e.fail.as_ref().map(|v| v.get_ref().as_str()) {
        None | Some("open") => LimitFail::Open,
        Some("closed") => LimitFail::Closed,
        Some(other) => {
            c.err(
                e.fail.as_ref().and_then(sp),
                format!("limit `{name}`: fail {other:?}: \"open\" or \"closed\""),
            );
            LimitFail::Open
        }
    };
    if e.fail.is_some() && !global {
        c.err(
            e.fail.as_ref().and_then(sp),
            format!("limit `{name}`: `fail` applies to `scope = \"global\"` limits"),
        );
    }
    Some(LimitRule {
        name,
        key,
        kind: kind?,
        routes: rule_routes,
        dry_run: e.dry_run.unwrap_or(false),
        status,
        global,
        fail,
    })
}

fn parse_limit_key(s: &str) -> Result<LimitKeyPart, String> {
    let bad = || {
        format!("invalid limit key {s:?}: expected \"client_ip\", \"header:NAME\", \"cookie:NAME\", \"path\", \"route\" or \"upstream_server\"")
    };
    match s {
        "client_ip" => Ok(LimitKeyPart::ClientIp),
        "path" => Ok(LimitKeyPart::Path),
        "route" => Ok(LimitKeyPart::Route),
        "upstream_server" => Ok(LimitKeyPart::UpstreamServer),
        _ => match s.split_once(':') {
            Some(("header", n)) if is_token(n) => Ok(LimitKeyPart::Header(n.to_ascii_lowercase())),
            Some(("cookie", n)) if is_token(n) => Ok(LimitKeyPart::Cookie(n.to_string())),
            _ => Err(bad()),
        },
    }
}

/// "10/s", "600/m", "5r/s", "0.5/s", "3600/h" -> requests per second.
pub(crate) fn parse_rate(s: &str) -> Result<f64, String> {
    let bad = || {
        format!("invalid rate {s:?}: expected requests per second, minute or hour, e.g. \"10/s\", \"600/m\", \"5r/s\"")
    };
    let (n, unit) = s.trim().split_once('/').ok_or_else(bad)?;
    let n = n.trim();
    let n = n.strip_suffix('r').unwrap_or(n);
    // Plain decimal only: no "inf", "NaN", exponents or signs.
    if n.is_empty() || !n.bytes().all(|b| b.is_ascii_digit() || b == b'.') {
        return Err(bad());
    }
    let n: f64 = n.parse().map_err(|_| bad())?;
    let secs = match unit.trim() {
        "s" => 1.0,
        "m" => 60.0,
        "h" => 3600.0,
        _ => return Err(bad()),
    };
    let per_sec = n / secs;
    if !(per_sec > 0.0 && per_sec <= 1e9) {
        return Err(format!(
            "rate {s:?} must be more than zero and at most 1000000000/s"
        ));
    }
    Ok(per_sec)
}
