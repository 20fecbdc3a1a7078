//! Pier's configuration: a TOML file (schema in [`schema`]) checked and
//! turned into the internal [`Config`] (in [`model`]) the server runs on.
//!
//! ```
//! let cfg = pier_config::load_str(pier_config::DEFAULT_CONFIG, "quickstart.toml").unwrap();
//! assert_eq!(cfg.listeners.len(), 1);
//! ```
//!
//! Errors are all collected and printed one per line as `FILE:LINE:COL: message`.
//! Key reference: docs/config.md.
#![forbid(unsafe_code)]

pub mod cidr;
pub mod env;
pub mod error;
pub mod matchers;
pub mod model;
pub mod schema;
pub mod units;
mod validate;

use std::net::SocketAddr;
use std::path::Path;
use std::time::Duration;

pub use cidr::{denied, normalize};
pub use error::{ConfigError, ConfigErrors, Location};
pub use model::*;
pub use units::{parse_duration, parse_size};
pub use validate::{acme_domain, parse_listen_addr};

use error::{Locator, RawError};

/// The embedded default config (`pier` with no arguments runs it).
pub const DEFAULT_CONFIG: &str = include_str!("../../../examples/quickstart.toml");

/// Reads and checks a config file. Errors name the file.
pub fn load_file(path: &Path) -> Result<Config, ConfigErrors> {
    let label = path.display().to_string();
    match std::fs::read_to_string(path) {
        Ok(text) => load_str(&text, &label),
        Err(e) => Err(ConfigErrors(vec![ConfigError {
            file: label,
            location: None,
            message: format!("cannot read config file: {e}"),
        }])),
    }
}

/// Checks config text; `source` labels it in errors (usually the file name)
/// and its directory is where relative `*_file` paths (Lua code) are found.
/// Environment variables are read from the process environment.
pub fn load_str(text: &str, source: &str) -> Result<Config, ConfigErrors> {
    load_str_with_env(text, source, &|name| std::env::var(name).ok())
}

/// [`load_str`] with an explicit variable lookup (tests, `pier check --env`).
pub fn load_str_with_env(
    text: &str,
    source: &str,
    lookup: &dyn Fn(&str) -> Option<String>,
) -> Result<Config, ConfigErrors> {
    let (expanded, map) = match env::expand(text, lookup) {
        Ok(v) => v,
        Err(errs) => {
            let loc = Locator {
                file: source,
                original: text,
                map: &env::SourceMap::default(),
            };
            return Err(ConfigErrors(
                errs.into_iter()
                    .map(|e| loc.error(RawError::at(Some(e.offset..e.offset), e.message)))
                    .collect(),
            ));
        }
    };
    let loc = Locator {
        file: source,
        original: text,
        map: &map,
    };
    let to_errors = |raw: Vec<RawError>| {
        let mut errs: Vec<ConfigError> = raw.into_iter().map(|r| loc.error(r)).collect();
        // File order (errors without a position last); stable for equal positions.
        errs.sort_by_key(|e| e.location.map_or((u32::MAX, u32::MAX), |l| (l.line, l.col)));
        ConfigErrors(errs)
    };
    let (file, schema_errors) = schema::parse(&expanded).map_err(|e| to_errors(vec![e]))?;
    // `*_file` paths are relative to the config file's directory.
    let base = Path::new(source).parent().unwrap_or(Path::new(""));
    validate::validate(file, schema_errors, base).map_err(to_errors)
}

impl Config {
    /// The one-line mode, `pier proxy --listen ADDR --to ADDR...`: one
    /// listener, one catch-all route to one round-robin upstream with a TCP
    /// health check (every 2s, rise 2, fall 2), passive max_fails 3, one
    /// retry; everything else at its default.
    pub fn quick(listen: SocketAddr, to: Vec<SocketAddr>, admin: Option<SocketAddr>) -> Config {
        let servers = to
            .into_iter()
            .map(|addr| UpstreamServer::new(addr, 1))
            .collect();
        Config::quick_servers(listen, servers, admin)
    }

    /// The one-line mode with TLS: `--tls-cert/--tls-key` serve HTTPS on the
    /// listener (ALPN `h2` and `http/1.1`); `https://` origins get verified
    /// TLS (the system's trust store, or `upstream_ca`), their host name as
    /// SNI, and HTTP/2 or HTTP/1.1 as their ALPN answer picks
    /// (`protocol = "auto"`); `h2c://` origins get cleartext HTTP/2 with
    /// prior knowledge.
    pub fn quick_with(
        listen: SocketAddr,
        to: Vec<Origin>,
        admin: Option<SocketAddr>,
        tls: Option<CertFiles>,
        upstream_ca: Option<std::path::PathBuf>,
    ) -> Result<Config, String> {
        let https = to.iter().any(|o| o.tls);
        let h2c = to.iter().any(|o| o.h2c);
        if to.iter().any(|o| (o.tls, o.h2c) != (https, h2c)) {
            return Err("origins are either all https, all h2c or all cleartext HTTP/1".into());
        }
        if upstream_ca.is_some() && !https {
            return Err("--upstream-ca is for https:// origins".into());
        }
        let names: Vec<&str> = to.iter().filter_map(|o| o.name.as_deref()).collect();
        if https && names.iter().any(|n| *n != names[0]) {
            return Err("https origins given by name must share one name (it is the SNI)".into());
        }
        let server_name = names.first().map(|n| n.to_string());
        // Resolved once, here; the name stays the Host and SNI.
        let servers = to
            .iter()
            .flat_map(|o| {
                let host: Option<std::sync::Arc<str>> = o.name.as_deref().map(Into::into);
                o.addrs.iter().map(move |&addr| UpstreamServer {
                    addr,
                    weight: 1,
                    host: host.clone(),
                })
            })
            .collect();
        let mut c = Config::quick_servers(listen, servers, admin);
        if let Some(u) = c.upstreams.get_mut("default") {
            if https {
                u.tls = Some(UpstreamTls {
                    server_name,
                    ca: upstream_ca,
                    ..UpstreamTls::system()
                });
                u.protocol = UpstreamProtocol::Auto;
            } else if h2c {
                u.protocol = UpstreamProtocol::H2c;
            }
        }
        if let Some(files) = tls {
            let mut t = ListenerTls::single(files);
            t.alpn = vec!["h2".to_string(), "http/1.1".to_string()];
            c.listeners[0].tls = Some(t);
        }
        Ok(c)
    }

    /// `pier proxy --acme-domain NAME…`: the listener's TLS, a certificate
    /// for those names from an ACME CA (`[listener.tls.acme]`), HTTP/2 or
    /// HTTP/1.1 by ALPN.
    pub fn quick_acme(
        domains: &[String],
        email: Option<String>,
        directory: Option<String>,
        directory_ca: Option<std::path::PathBuf>,
        storage: std::path::PathBuf,
    ) -> Result<ListenerTls, String> {
        let mut names = Vec::new();
        for d in domains {
            let n = validate::acme_domain(d).map_err(|e| format!("--acme-domain: {e}"))?;
            if !names.contains(&n) {
                names.push(n);
            }
        }
        let directory = directory.unwrap_or_else(|| LETS_ENCRYPT.to_string());
        if !directory.starts_with("https://") {
            return Err(format!(
                "--acme-directory {directory:?}: expected an https:// URL"
            ));
        }
        let mut t = ListenerTls::single(CertFiles {
            cert: Default::default(),
            key: Default::default(),
        });
        t.certificates.clear();
        t.alpn = vec!["h2".to_string(), "http/1.1".to_string()];
        t.acme = Some(Acme {
            domains: names,
            email,
            directory,
            directory_ca,
            storage,
            renew_before: std::time::Duration::from_secs(30 * 86_400),
            challenge: AcmeChallenge::TlsAlpn01,
            ari: true,
            on_demand: None,
        });
        Ok(t)
    }

    /// `pier proxy --h2c` (cleartext HTTP/2 with prior knowledge on the
    /// listener, beside HTTP/1.1) and `--grpc-web` (gRPC-web clients
    /// converted to gRPC, which needs an HTTP/2 origin: `h2c://` or
    /// `https://`).
    pub fn enable_quick_http2(&mut self, h2c: bool, grpc_web: bool) -> Result<(), String> {
        if h2c {
            if self.listeners[0].tls.is_some() {
                return Err(
                    "--h2c is for a cleartext listener (with --tls-cert, HTTP/2 goes by ALPN)"
                        .into(),
                );
            }
            self.listeners[0].h2c = true;
        }
        if grpc_web {
            if self
                .upstreams
                .values()
                .any(|u| u.protocol == UpstreamProtocol::Http1)
            {
                return Err("--grpc-web sends gRPC upstream, which needs HTTP/2: give --to as h2c://HOST:PORT or https://HOST:PORT".into());
            }
            for r in &mut self.routes {
                r.grpc_web = true;
            }
        }
        Ok(())
    }

    /// `pier proxy --cache SIZE`: one memory zone `quick` of `bytes`, used by
    /// the catch-all route; freshness only from the origin's headers.
    /// With `disk`, a disk tier (`--cache-dir`, `--cache-disk`) behind it,
    /// with the defaults of `[cache.NAME]`. `store_set_cookie`:
    /// `--cache-set-cookie store` (`[route.cache] set_cookie`).
    pub fn enable_quick_cache(
        &mut self,
        bytes: usize,
        disk: Option<(std::path::PathBuf, u64)>,
        store_set_cookie: bool,
    ) {
        self.caches.push(CacheZone {
            name: "quick".into(),
            memory: bytes,
            max_object: (bytes / 8).min(64 << 20),
            max_variants: 32,
            disk: disk.map(|(dir, max_bytes)| CacheDisk {
                dir,
                max_bytes,
                promote_hits: 2,
                min_ttl: Duration::from_secs(60),
                queue: 256,
            }),
            parents: Vec::new(),
        });
        let zone = self.caches.len() - 1;
        for r in &mut self.routes {
            r.cache = Some(RouteCache {
                zone,
                ttl: Vec::new(),
                override_origin: false,
                lock_timeout: Duration::from_secs(5),
                hit_for_miss: Duration::from_secs(120),
                grace: Duration::ZERO,
                key: None,
                strip_tags: true,
                store_set_cookie,
            });
        }
    }

    fn quick_servers(
        listen: SocketAddr,
        servers: Vec<UpstreamServer>,
        admin: Option<SocketAddr>,
    ) -> Config {
        // Passive ejection only with somewhere else to go: one origin marked
        // down would turn its every error into 503s for everyone (nginx
        // ignores max_fails for a single server likewise).
        let max_fails = if servers.len() > 1 { 3 } else { 0 };
        let mut upstream = Upstream::with_defaults("default", servers);
        upstream.health_check = Some(HealthCheck {
            kind: HealthKind::Tcp,
            interval: Duration::from_secs(2),
            timeout: HealthCheck::DEFAULT_TIMEOUT,
            rise: 2,
            fall: 2,
        });
        upstream.max_fails = max_fails;
        upstream.retries = 1;
        Config {
            workers: validate::cores(),
            grace_period: validate::DEFAULT_GRACE_PERIOD,
            upgrade_socket: None,
            io_uring: true,
            listeners: vec![Listener::plain("main", listen)],
            admin,
            admin_auth: AdminAuth::default(),
            admin_tls: None,
            analytics: Analytics::default(),
            routes: vec![Route {
                name: "default".into(),
                host: None,
                path: PathMatch::Any,
                upstream: "default".into(),
                lua: RouteLua::default(),
                headers: HeaderRules::default(),
                host_header: None,
                grpc_web: false,
                cors: None,
                cache: None,
                compress: None,
                trace_sample: None,
            }],
            upstreams: [("default".to_string(), upstream)].into_iter().collect(),
            limits: Limits::default(),
            timeouts: Timeouts::default(),
            access_log: AccessLog::Off,
            deny_origins: Vec::new(),
            demo_origin: None,
            lua: LuaConfig::default(),
            rate_limits: Vec::new(),
            upgrade: validate::default_upgrade(),
            escaped_slashes: EscapedSlashes::Reject,
            merge_slashes: true,
            allow_trace: false,
            forwarded: false,
            http2: Http2::default(),
            caches: Vec::new(),
            resolver: Resolver::default(),
            tracing: None,
            redis: None,
        }
    }
}

/// A `pier proxy --to` origin: `HOST:PORT`, or a URL `http://HOST[:PORT]`,
/// `https://HOST[:PORT]` or `h2c://HOST[:PORT]` (ports 80 / 443 / 80 by
/// default). A host name is resolved now; with https it is the SNI and the
/// name verified.
#[derive(Debug, Clone, PartialEq)]
pub struct Origin {
    pub addrs: Vec<SocketAddr>,
    /// The host name, when the origin was given by name (not an IP).
    pub name: Option<String>,
    pub tls: bool,
    /// `h2c://`: cleartext HTTP/2 with prior knowledge.
    pub h2c: bool,
}

pub fn parse_origin(s: &str) -> Result<Origin, String> {
    let s = s.trim();
    let (tls, h2c, rest, default_port) = if let Some(r) = strip_prefix_ci(s, "https://") {
        (true, false, r, 443)
    } else if let Some(r) = strip_prefix_ci(s, "http://") {
        (false, false, r, 80)
    } else if let Some(r) = strip_prefix_ci(s, "h2c://") {
        (false, true, r, 80)
    } else if s.contains("://") {
        return Err(format!("{s:?}: the scheme must be http, https or h2c"));
    } else {
        (false, false, s, 0)
    };
    let authority = rest.strip_suffix('/').unwrap_or(rest);
    if authority.contains('/') {
        return Err(format!("{s:?}: an origin has no path"));
    }
    // Add the scheme's default port when none is given.
    let has_port = match authority.rfind(':') {
        Some(i) => !authority[i..].contains(']'),
        None => false,
    };
    let hostport = if has_port || default_port == 0 {
        authority.to_string()
    } else {
        format!("{authority}:{default_port}")
    };
    let addrs = validate::resolve_upstream_addr(&hostport)?;
    let host = hostport
        .rsplit_once(':')
        .map(|(h, _)| h)
        .unwrap_or("")
        .trim_start_matches('[')
        .trim_end_matches(']');
    let name = (host.parse::<std::net::IpAddr>().is_err() && !host.is_empty())
        .then(|| host.to_ascii_lowercase());
    Ok(Origin {
        addrs,
        name,
        tls,
        h2c,
    })
}

fn strip_prefix_ci<'a>(s: &'a str, p: &str) -> Option<&'a str> {
    (s.len() >= p.len() && s.is_char_boundary(p.len()) && s[..p.len()].eq_ignore_ascii_case(p))
        .then(|| &s[p.len()..])
}

#[cfg(test)]
mod tests;
