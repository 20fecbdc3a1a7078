//! The running config: what a request consults, swapped whole on reload.

use pier_config::{
    Config, HeaderRules, HostHeader, HostMatch, LimitFail, LimitKeyPart, LimitKind, LimitRule,
    PathMatch,
};
use pier_http::HeadLimits;
use pier_lb::Group;
use pier_limits::{ConcurrencyLimit, ConcurrencyLimiter, GlobalRate, RateLimit, RateLimiter};
use pier_log::Metrics;
use pier_shdict::Registry;
use pier_tls::{ClientTls, ServerTls};
use std::sync::Arc;

#[derive(Clone)]
pub struct RouteRt {
    pub name: String,
    pub host: Option<HostMatch>,
    pub path: PathMatch,
    pub group: usize,
    /// Stable metrics slot.
    pub metric: usize,
    /// Header rules: the upstream's, then the route's (each applied in the
    /// order remove, set, add); empty ones are skipped.
    pub header_rules: Vec<HeaderRules>,
    pub request_rules: bool,
    pub response_rules: bool,
    /// The Host sent upstream: the route's, else the upstream's.
    pub host_header: HostHeader,
    /// Root sampling threshold (`pier_trace::threshold`): the route's
    /// `[route.tracing] sample`, else `[tracing] sample`.
    pub trace_threshold: u64,
}

pub struct State {
    pub cfg: Config,
    pub routes: Vec<RouteRt>,
    pub groups: Vec<Arc<Group>>,
    pub head_limits: HeadLimits,
    pub generation: u64,
    /// Bumped by every [`crate::Shared::install`] and
    /// [`crate::Shared::install_peers`] (a DNS answer that changed a group's
    /// servers keeps `generation`, so Lua and other per-generation parts are
    /// not set up again); what connections compare to refresh their state.
    pub epoch: u64,
    /// Per-generation data of the phase implementation (for `pier-phases`:
    /// the compiled Lua setup), set by whoever builds the state; the engine
    /// itself never looks inside.
    pub scripts: Option<Arc<dyn std::any::Any + Send + Sync>>,
    /// `pier.shared.NAME` dictionaries (contents survive reloads).
    pub shdicts: Arc<Registry>,
    /// `[[limit]]` rules (counters survive reloads when a rule is unchanged).
    pub limits: Vec<Arc<LimitRt>>,
    /// Per route: rules checked before the upstream / once a peer is chosen.
    pub route_limits: Vec<Vec<usize>>,
    pub peer_limits: Vec<Vec<usize>>,
    /// Per listener (as `cfg.listeners`): its TLS, certificates loaded.
    /// Rebuilt on reload: new handshakes use the new certificates, open
    /// connections keep theirs.
    pub listener_tls: Vec<Option<Arc<ServerTls>>>,
    /// Per group (as `groups`): TLS to its servers.
    pub upstream_tls: Vec<Option<ClientTls>>,
    /// `[cache.NAME]` zones (as `cfg.caches`); a zone whose name and sizes
    /// did not change keeps its contents across reloads.
    pub cache_zones: Vec<Arc<pier_cache::Zone>>,
    /// Per zone (as `cache_zones`): its `parents`, a group hashed on the
    /// cache key (`crate::tier`).
    pub cache_parents: Vec<Option<Arc<Group>>>,
    /// `[tracing]`'s exporter (None: tracing off).
    pub tracer: Option<Arc<pier_trace::Exporter>>,
    /// `[tracing] sample` as a threshold (requests without a route).
    pub trace_threshold: u64,
}

/// A `[[limit]]` rule with its counters.
pub struct LimitRt {
    pub rule: LimitRule,
    pub rate: Option<RateLimiter>,
    pub conc: Option<ConcurrencyLimiter>,
    /// `scope = "global"`: the fleet's count, checked after `rate` (the
    /// first tier, which holds each node to the rate on its own).
    pub global: Option<Arc<GlobalRate>>,
}

impl LimitRt {
    fn new(rule: &LimitRule, redis: Option<&pier_config::Redis>) -> Self {
        let mut global = None;
        let (rate, conc) = match rule.kind {
            LimitKind::Rate { per_sec, burst } => {
                let cfg = RateLimit {
                    rate_per_sec: per_sec,
                    burst,
                    dry_run: rule.dry_run,
                };
                // Validated: a global rule comes with [redis].
                if let (true, Some(r)) = (rule.global, redis) {
                    let g = Arc::new(GlobalRate::new(
                        &rule.name,
                        cfg,
                        rule.fail == LimitFail::Closed,
                        r.stale_after().as_millis() as u64,
                        pier_limits::global::DEFAULT_MAX_KEYS,
                        pier_limits::clock::now_ms(),
                    ));
                    g.register();
                    global = Some(g);
                }
                (Some(RateLimiter::new(cfg)), None)
            }
            LimitKind::Concurrent { max } => {
                let mut c = ConcurrencyLimit::new(max as usize);
                c.dry_run = rule.dry_run;
                (None, Some(ConcurrencyLimiter::new(c)))
            }
        };
        LimitRt {
            rule: rule.clone(),
            rate,
            conc,
            global,
        }
    }

    pub fn denied_total(&self) -> u64 {
        self.rate.as_ref().map(|r| r.denied_total()).unwrap_or(0)
            + self.conc.as_ref().map(|c| c.denied_total()).unwrap_or(0)
            + self
                .global
                .as_ref()
                .map(|g| g.stats().denied.load(std::sync::atomic::Ordering::Relaxed))
                .unwrap_or(0)
    }
}

impl State {
    /// Build the running state; with `prev`, upstream groups keep the health
    /// and in-flight counts of servers that did not change.
    pub fn build(
        cfg: Config,
        metrics: &Metrics,
        generation: u64,
        prev: Option<&State>,
    ) -> Result<State, String> {
        let names: Vec<&String> = cfg.upstreams.keys().collect();
        let groups: Vec<Arc<Group>> = cfg
            .upstreams
            .iter()
            .map(|(name, u)| {
                let old = prev.and_then(|p| p.groups.iter().find(|g| g.name() == name));
                Arc::new(match old {
                    Some(g) => Group::reload(u, g),
                    None => Group::new(u),
                })
            })
            .collect();
        let routes: Vec<RouteRt> = cfg
            .routes
            .iter()
            .map(|r| {
                let up = cfg.upstreams.get(&r.upstream);
                let header_rules: Vec<HeaderRules> = up
                    .map(|u| &u.headers)
                    .into_iter()
                    .chain(std::iter::once(&r.headers))
                    .filter(|h| !h.is_empty())
                    .cloned()
                    .collect();
                let request_rules = header_rules.iter().any(|h| {
                    !(h.request_set.is_empty()
                        && h.request_add.is_empty()
                        && h.request_remove.is_empty())
                });
                let response_rules = header_rules.iter().any(|h| {
                    !(h.response_set.is_empty()
                        && h.response_add.is_empty()
                        && h.response_remove.is_empty())
                });
                RouteRt {
                    name: r.name.clone(),
                    host: r.host.clone(),
                    path: r.path.clone(),
                    // Validated by pier-config: the upstream exists.
                    group: names.iter().position(|n| **n == r.upstream).unwrap_or(0),
                    metric: metrics.route_index(&r.name),
                    header_rules,
                    request_rules,
                    response_rules,
                    host_header: r
                        .host_header
                        .clone()
                        .or_else(|| up.map(|u| u.host_header.clone()))
                        .unwrap_or_default(),
                    trace_threshold: pier_trace::threshold(
                        r.trace_sample
                            .or(cfg.tracing.as_ref().map(|t| t.sample))
                            .unwrap_or(0.0),
                    ),
                }
            })
            .collect();
        let head_limits = HeadLimits {
            max_header_bytes: cfg.limits.max_header_bytes,
            max_headers: cfg.limits.max_headers,
            max_uri_bytes: cfg.limits.max_uri_bytes,
        };
        let specs: Vec<(&str, usize)> = cfg
            .lua
            .shared
            .iter()
            .map(|(n, c)| (n.as_str(), *c))
            .collect();
        let shdicts = match prev {
            Some(p) => p.shdicts.reload(&specs),
            None => Registry::new(&specs),
        }
        .map_err(|e| format!("lua.shared: {e}"))?;
        let limits: Vec<Arc<LimitRt>> = cfg
            .rate_limits
            .iter()
            .map(|rule| {
                prev.and_then(|p| p.limits.iter().find(|l| l.rule == *rule).cloned())
                    .unwrap_or_else(|| Arc::new(LimitRt::new(rule, cfg.redis.as_ref())))
            })
            .collect();
        let per_route = |peer: bool| -> Vec<Vec<usize>> {
            routes
                .iter()
                .map(|r| {
                    limits
                        .iter()
                        .enumerate()
                        .filter(|(_, l)| {
                            l.rule.applies_to(&r.name)
                                && l.rule.key.contains(&LimitKeyPart::UpstreamServer) == peer
                        })
                        .map(|(i, _)| i)
                        .collect()
                })
                .collect()
        };
        let route_limits = per_route(false);
        let peer_limits = per_route(true);
        let listener_tls = cfg
            .listeners
            .iter()
            .map(|l| match &l.tls {
                Some(t) => ServerTls::build(&l.name, t).map(|s| {
                    // `[listener.tls.acme]`: the stored certificate now, a
                    // manager to obtain and renew it.
                    if let Some(acme) = &t.acme {
                        pier_acme::manage_listener(&s, acme);
                    }
                    Some(Arc::new(s))
                }),
                None => Ok(None),
            })
            .collect::<Result<Vec<_>, String>>()?;
        let upstream_tls = cfg
            .upstreams
            .iter()
            .map(|(name, u)| match &u.tls {
                Some(t) => {
                    let mut c =
                        ClientTls::build(name, t, u.protocol == pier_config::UpstreamProtocol::H2)?;
                    if u.protocol == pier_config::UpstreamProtocol::Auto {
                        // `auto`: the server picks h2 or http/1.1 (upstream_h2.rs).
                        let mut cfg = (*c.config).clone();
                        cfg.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
                        c.config = Arc::new(cfg);
                    }
                    if !t.verify && prev.is_none() {
                        tracing::warn!(
                            upstream = %name,
                            "tls verify = false: origin certificates are not checked"
                        );
                    }
                    Ok(Some(c))
                }
                None => Ok(None),
            })
            .collect::<Result<Vec<_>, String>>()?;
        let cache_zones = cfg
            .caches
            .iter()
            .map(|z| {
                let old = prev.and_then(|p| {
                    p.cfg
                        .caches
                        .iter()
                        .position(|o| o.same_storage(z))
                        .map(|i| p.cache_zones[i].clone())
                });
                match old {
                    Some(zone) => Ok(zone),
                    None => pier_cache::Zone::open(
                        &z.name,
                        z.memory,
                        z.max_object,
                        z.disk.as_ref().map(|d| pier_cache::DiskConfig {
                            dir: d.dir.clone(),
                            max_bytes: d.max_bytes,
                            promote_hits: d.promote_hits,
                            min_ttl: d.min_ttl.as_secs(),
                            queue: d.queue,
                        }),
                    )
                    .inspect(|zone| zone.set_max_variants(z.max_variants))
                    .map_err(|e| {
                        let dir = z.disk.as_ref().map(|d| d.dir.display().to_string());
                        format!(
                            "cache `{}`: disk_dir {}: {e}",
                            z.name,
                            dir.unwrap_or_default()
                        )
                    }),
                }
            })
            .collect::<Result<Vec<_>, String>>()?;
        let cache_parents = crate::tier::groups(&cfg, prev);
        Ok(State {
            routes,
            groups,
            head_limits,
            generation,
            epoch: 0,
            scripts: None,
            shdicts: Arc::new(shdicts),
            limits,
            route_limits,
            peer_limits,
            listener_tls,
            upstream_tls,
            cache_zones,
            cache_parents,
            tracer: cfg
                .tracing
                .as_ref()
                .map(|t| pier_trace::exporter(&t.endpoint, &t.service_name, t.queue)),
            trace_threshold: pier_trace::threshold(cfg.tracing.as_ref().map_or(0.0, |t| t.sample)),
            cfg,
        })
    }

    /// This state with upstream `name`'s servers replaced by `servers` (a
    /// new DNS answer): the group is rebuilt keeping the peers that stay
    /// ([`Group::reload`]); everything else is shared with `self`. Requests
    /// holding `self` finish on its groups, so a peer that went away drains.
    /// None if the upstream is gone.
    pub fn with_servers(
        &self,
        name: &str,
        servers: Vec<pier_config::UpstreamServer>,
    ) -> Option<State> {
        let gi = self.groups.iter().position(|g| g.name() == name)?;
        let mut cfg = self.cfg.clone();
        let u = cfg.upstreams.get_mut(name)?;
        u.servers = servers;
        let mut groups = self.groups.clone();
        groups[gi] = Arc::new(Group::reload(u, &self.groups[gi]));
        Some(State {
            cfg,
            routes: self.routes.clone(),
            groups,
            head_limits: self.head_limits,
            generation: self.generation,
            epoch: self.epoch,
            scripts: self.scripts.clone(),
            shdicts: self.shdicts.clone(),
            limits: self.limits.clone(),
            route_limits: self.route_limits.clone(),
            peer_limits: self.peer_limits.clone(),
            listener_tls: self.listener_tls.clone(),
            upstream_tls: self.upstream_tls.clone(),
            cache_zones: self.cache_zones.clone(),
            cache_parents: self.cache_parents.clone(),
            tracer: self.tracer.clone(),
            trace_threshold: self.trace_threshold,
        })
    }

    /// How request paths are made canonical (`[http]`).
    pub fn path_policy(&self) -> pier_http::PathPolicy {
        pier_http::PathPolicy {
            escaped_slashes: match self.cfg.escaped_slashes {
                pier_config::EscapedSlashes::Reject => pier_http::EscapedSlashes::Reject,
                pier_config::EscapedSlashes::Decode => pier_http::EscapedSlashes::Decode,
                pier_config::EscapedSlashes::Keep => pier_http::EscapedSlashes::Keep,
            },
            merge_slashes: self.cfg.merge_slashes,
        }
    }

    /// A client's request head, parsed and made canonical: the one place
    /// every downstream protocol gets a request's authority, target and
    /// framing from (pier_http::canon; docs/security.md).
    pub fn parse_request(
        &self,
        head: &mut pier_http::RequestHead,
        buf: &[u8],
    ) -> Result<Option<usize>, pier_error::Kind> {
        let n = head.parse(buf, &self.head_limits)?;
        if n.is_some() {
            head.canonicalize(&self.path_policy())?;
        }
        Ok(n)
    }

    /// A request head from a codec's decoded fields (HTTP/2, HTTP/3:
    /// `RequestHead::from_parts`), under the same limits and then the same
    /// canonical form as [`Self::parse_request`]'s.
    pub fn request_from_parts<'f>(
        &self,
        head: &mut pier_http::RequestHead,
        method: &[u8],
        target: &[u8],
        authority: Option<&[u8]>,
        fields: impl Iterator<Item = (&'f [u8], &'f [u8])>,
        stream_body: bool,
    ) -> Result<(), pier_error::Kind> {
        head.from_parts(
            method,
            target,
            authority,
            fields,
            stream_body,
            &self.head_limits,
        )?;
        head.canonicalize(&self.path_policy())
    }

    /// First route (in file order) whose host and path match.
    pub fn match_route(&self, host: Option<&[u8]>, path: &[u8]) -> Option<usize> {
        let host = host.map(strip_port);
        self.routes.iter().position(|r| {
            let host_ok = match (&r.host, host) {
                (None, _) => true,
                (Some(_), None) => false,
                (Some(HostMatch::Exact(h)), Some(x)) => x.eq_ignore_ascii_case(h.as_bytes()),
                (Some(HostMatch::Suffix(s)), Some(x)) => {
                    x.len() > s.len() && x[x.len() - s.len()..].eq_ignore_ascii_case(s.as_bytes())
                }
            };
            host_ok && path_matches(&r.path, path)
        })
    }
}

fn strip_port(h: &[u8]) -> &[u8] {
    if h.first() == Some(&b'[') {
        // [v6]:port
        return match memchr::memchr(b']', h) {
            Some(i) => &h[..=i],
            None => h,
        };
    }
    match memchr::memrchr(b':', h) {
        Some(i) => &h[..i],
        None => h,
    }
}

fn path_matches(m: &PathMatch, p: &[u8]) -> bool {
    match m {
        PathMatch::Any => true,
        PathMatch::Exact(s) => p == s.as_bytes(),
        PathMatch::Prefix(s) => p.starts_with(s.as_bytes()),
        PathMatch::Suffix(s) => p.ends_with(s.as_bytes()),
        PathMatch::Regex(re) => std::str::from_utf8(p).is_ok_and(|p| re.is_match(p)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn routing_order_host_and_path() {
        let cfg = pier_config::load_str(
            r#"
[[listener]]
name = "main"
listen = "127.0.0.1:0"
[[route]]
name = "api"
host = "*.example.com"
path = "/api/"
upstream = "a"
[[route]]
name = "exact"
exact = "/x"
upstream = "a"
[[route]]
name = "png"
regex = "\\.png$"
upstream = "a"
[[route]]
name = "re"
regex = "^/r[0-9]+$"
upstream = "a"
[upstream.a]
servers = ["127.0.0.1:1"]
"#,
            "t.toml",
        )
        .unwrap();
        let m = Metrics::new(1);
        let s = State::build(cfg, &m, 1, None).unwrap();
        assert_eq!(
            s.match_route(Some(b"www.example.com:8080"), b"/api/v1"),
            Some(0)
        );
        assert_eq!(s.match_route(Some(b"example.com"), b"/api/v1"), None);
        assert_eq!(s.match_route(Some(b"h"), b"/x"), Some(1));
        assert_eq!(s.match_route(Some(b"h"), b"/x/"), None);
        assert_eq!(s.match_route(None, b"/a/b.png"), Some(2));
        assert_eq!(s.match_route(None, b"/r12"), Some(3));
        assert_eq!(s.match_route(None, b"/r1x"), None);
        assert_eq!(strip_port(b"[::1]:80"), b"[::1]");
    }
}
