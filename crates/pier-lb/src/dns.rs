//! Upstream servers given by host name, resolved while running.
//!
//! One task per process ([`run`], on the control thread) asks for each
//! name's A and AAAA records when its last answer's TTL (clamped to
//! `[resolver] min_ttl..max_ttl`) runs out. An answer that changes a
//! group's addresses installs a new state of the same generation
//! ([`Running::install_servers`]; pier-proxy's `Shared` implements it): the
//! request path keeps reading its state lock-free through the epoch check,
//! addresses that stay keep their `Arc<Peer>` (health, in-flight counts;
//! the pool is keyed by address and SNI, so their idle connections stay
//! usable), and requests already running hold the old state, so a peer that
//! went away drains. A failed resolution keeps the last good addresses.
//!
//! [`seed`] fills in the addresses before a config is first served (at start
//! and on reload), so a reload does not wait a TTL for its servers.

use std::collections::{BTreeMap, HashMap};
use std::net::{IpAddr, SocketAddr};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use hickory_resolver::config::{
    ConnectionConfig, LookupIpStrategy, NameServerConfig, ProtocolConfig, ResolverConfig,
};
use hickory_resolver::net::runtime::TokioRuntimeProvider;
use hickory_resolver::net::{DnsError, NetError};
use hickory_resolver::proto::op::ResponseCode;
use hickory_resolver::TokioResolver;
use pier_config::{Config, NamedServer, Upstream, UpstreamServer};
use tokio::sync::{mpsc, watch};
use tokio::time::Instant;

/// The running state that discovery reads and swaps servers into
/// (pier-proxy's `Shared`: the proxy depends on this crate, not the other way).
pub trait Running {
    /// One installed state (an `Arc`): read whole, replaced, never changed in place.
    type State;
    /// The state served now.
    fn load(&self) -> Self::State;
    /// Its config.
    fn config(state: &Self::State) -> &Config;
    /// Config generations as they are installed (a reload may name other hosts).
    fn reloads(&self) -> watch::Receiver<u64>;
    /// Install `state` with upstream `name`'s servers replaced by `servers`,
    /// in the same generation (nothing per-generation is set up again);
    /// false, installing nothing, if `state` has no such upstream.
    fn install_servers(
        &self,
        state: &Self::State,
        name: &str,
        servers: Vec<UpstreamServer>,
    ) -> bool;
}

/// Most addresses taken from one answer (the rest are dropped): a group's
/// size, its schedules and health checkers stay bounded whatever DNS says.
pub const MAX_ADDRESSES: usize = 64;

/// A failure is logged at most this often per name.
const LOG_EVERY: Duration = Duration::from_secs(60);

/// How one resolution ended (`result` label of `pier_dns_resolutions_total`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// Same addresses as before.
    Ok,
    /// Other addresses than before (or the first answer).
    Changed,
    Timeout,
    NxDomain,
    ServFail,
    /// The name exists but has no A/AAAA record (or every address was
    /// filtered out).
    Empty,
    Error,
}

impl Outcome {
    pub fn label(self) -> &'static str {
        match self {
            Outcome::Ok => "ok",
            Outcome::Changed => "changed",
            Outcome::Timeout => "timeout",
            Outcome::NxDomain => "nxdomain",
            Outcome::ServFail => "servfail",
            Outcome::Empty => "empty",
            Outcome::Error => "error",
        }
    }
}

/// Resolutions by upstream and outcome, process-wide (the seeding at start
/// runs before `Shared` exists). Written by the control thread only, a few
/// times per TTL: a mutex is fine here, no request touches it.
pub struct Stats {
    counts: Mutex<BTreeMap<(String, &'static str), u64>>,
}

pub fn stats() -> &'static Stats {
    static S: OnceLock<Stats> = OnceLock::new();
    S.get_or_init(|| Stats {
        counts: Mutex::new(BTreeMap::new()),
    })
}

impl Stats {
    fn count(&self, upstream: &str, o: Outcome) {
        if let Ok(mut m) = self.counts.lock() {
            *m.entry((upstream.to_string(), o.label())).or_insert(0) += 1;
        }
    }

    /// Resolutions of `upstream`'s names that ended with `result`.
    pub fn get(&self, upstream: &str, result: &str) -> u64 {
        self.counts
            .lock()
            .map(|m| {
                m.iter()
                    .filter(|((u, r), _)| u == upstream && *r == result)
                    .map(|(_, n)| *n)
                    .sum()
            })
            .unwrap_or(0)
    }

    pub fn render(&self, out: &mut String) {
        use std::fmt::Write;
        let Ok(m) = self.counts.lock() else { return };
        if m.is_empty() {
            return;
        }
        out.push_str("# HELP pier_dns_resolutions_total Resolutions of upstream server host names by result.\n# TYPE pier_dns_resolutions_total counter\n");
        for ((u, r), n) in m.iter() {
            let _ = writeln!(
                out,
                "pier_dns_resolutions_total{{upstream=\"{u}\",result=\"{r}\"}} {n}"
            );
        }
    }
}

/// A resolver built from `[resolver]`.
pub struct Dns {
    resolver: TokioResolver,
    cfg: pier_config::Resolver,
}

impl Dns {
    /// Must be called inside a tokio runtime (the resolver spawns its
    /// connections' tasks there).
    pub fn new(cfg: &pier_config::Resolver) -> Result<Dns, String> {
        let mut builder = if cfg.nameservers.is_empty() {
            TokioResolver::builder_tokio()
                .map_err(|e| format!("resolver: cannot read the system's DNS configuration: {e}"))?
        } else {
            let servers = cfg
                .nameservers
                .iter()
                .map(|a| {
                    let conn = |p| {
                        let mut c = ConnectionConfig::new(p);
                        c.port = a.port();
                        c
                    };
                    NameServerConfig::new(
                        a.ip(),
                        true,
                        vec![conn(ProtocolConfig::Udp), conn(ProtocolConfig::Tcp)],
                    )
                })
                .collect();
            TokioResolver::builder_with_config(
                ResolverConfig::from_name_servers(servers),
                TokioRuntimeProvider::default(),
            )
        };
        let o = builder.options_mut();
        o.timeout = cfg.timeout;
        o.ip_strategy = LookupIpStrategy::Ipv4AndIpv6;
        // The resolver's cache honours the same bounds, so an answer is
        // never served past the time we ask again; a negative answer is not
        // kept past the retry.
        o.positive_min_ttl = Some(cfg.min_ttl);
        o.positive_max_ttl = Some(cfg.max_ttl);
        o.negative_min_ttl = Some(Duration::ZERO);
        o.negative_max_ttl = Some(cfg.min_ttl);
        o.cache_size = 256;
        let resolver = builder.build().map_err(|e| format!("resolver: {e}"))?;
        Ok(Dns {
            resolver,
            cfg: cfg.clone(),
        })
    }

    /// The name's addresses (sorted, deduplicated, at most
    /// [`MAX_ADDRESSES`]) and how long they may be used.
    pub async fn lookup(&self, host: &str) -> Result<(Vec<IpAddr>, Duration), Outcome> {
        let r = tokio::time::timeout(self.cfg.timeout, self.resolver.lookup_ip(host)).await;
        let lookup = match r {
            Err(_) => return Err(Outcome::Timeout),
            Ok(Err(e)) => return Err(classify(&e)),
            Ok(Ok(l)) => l,
        };
        let mut ips: Vec<IpAddr> = lookup.iter().collect();
        ips.sort();
        ips.dedup();
        ips.truncate(MAX_ADDRESSES);
        if ips.is_empty() {
            return Err(Outcome::Empty);
        }
        let ttl = lookup
            .valid_until()
            .saturating_duration_since(std::time::Instant::now());
        Ok((ips, self.clamp(ttl)))
    }

    fn clamp(&self, ttl: Duration) -> Duration {
        ttl.clamp(self.cfg.min_ttl, self.cfg.max_ttl.max(self.cfg.min_ttl))
    }
}

fn classify(e: &NetError) -> Outcome {
    match e {
        NetError::Timeout => Outcome::Timeout,
        NetError::Dns(DnsError::NoRecordsFound(nr))
            if nr.response_code == ResponseCode::NXDomain =>
        {
            Outcome::NxDomain
        }
        NetError::Dns(DnsError::NoRecordsFound(_)) => Outcome::Empty,
        NetError::Dns(DnsError::ResponseCode(ResponseCode::ServFail)) => Outcome::ServFail,
        _ => Outcome::Error,
    }
}

/// Addresses an answer may not bring in: `deny_origins` and Pier's own
/// listeners (a request there would loop).
fn allowed(cfg: &Config, addr: SocketAddr) -> bool {
    if pier_config::denied(&cfg.deny_origins, addr.ip()) {
        return false;
    }
    !cfg.listeners.iter().any(|l| {
        l.addr.port() == addr.port() && (l.addr.ip() == addr.ip() || l.addr.ip().is_unspecified())
    })
}

/// The servers of `n` for these addresses.
fn servers_of(cfg: &Config, n: &NamedServer, ips: &[IpAddr]) -> Vec<UpstreamServer> {
    ips.iter()
        .map(|&ip| SocketAddr::new(ip, n.port))
        .filter(|&a| allowed(cfg, a))
        .map(|addr| UpstreamServer {
            addr,
            weight: n.weight,
            host: Some(n.host.clone()),
        })
        .collect()
}

/// Whether `s` came from name `n`.
fn from_name(s: &UpstreamServer, n: &NamedServer) -> bool {
    s.host.as_deref() == Some(&*n.host) && s.addr.port() == n.port && s.weight == n.weight
}

/// `u`'s servers with those of name `n` replaced by `new`, in a stable
/// order: the other servers first as they were, then each name's in config
/// order.
fn replace(u: &Upstream, n: &NamedServer, new: Vec<UpstreamServer>) -> Vec<UpstreamServer> {
    let mut out: Vec<UpstreamServer> = u
        .servers
        .iter()
        .filter(|s| !u.resolve.iter().any(|m| from_name(s, m)))
        .cloned()
        .collect();
    for m in &u.resolve {
        if m == n {
            out.extend(new.iter().cloned());
        } else {
            out.extend(u.servers.iter().filter(|s| from_name(s, m)).cloned());
        }
    }
    out
}

fn same(a: &[UpstreamServer], b: &[UpstreamServer]) -> bool {
    a.len() == b.len()
        && a.iter()
            .zip(b)
            .all(|(x, y)| x.addr == y.addr && x.weight == y.weight && x.host == y.host)
}

/// Fill in the servers of every name in `cfg` before it is served: the
/// addresses `prev` (the running config) has for the same name, else a
/// resolution now. A name that does not resolve leaves its servers out
/// (logged, counted); the background task keeps asking.
pub async fn seed(cfg: &mut Config, prev: Option<&Config>, dns: &Dns) {
    let snapshot = cfg.clone();
    for (uname, u) in cfg.upstreams.iter_mut() {
        let names = u.resolve.clone();
        for n in &names {
            let kept: Vec<UpstreamServer> = prev
                .and_then(|p| p.upstreams.get(uname))
                .filter(|pu| pu.resolve.contains(n))
                .map(|pu| {
                    pu.servers
                        .iter()
                        .filter(|s| from_name(s, n) && allowed(&snapshot, s.addr))
                        .cloned()
                        .collect()
                })
                .unwrap_or_default();
            let new = if !kept.is_empty() {
                kept
            } else {
                match dns.lookup(&n.host).await {
                    Ok((ips, _)) => {
                        stats().count(uname, Outcome::Changed);
                        servers_of(&snapshot, n, &ips)
                    }
                    Err(o) => {
                        stats().count(uname, o);
                        tracing::warn!(upstream = %uname, host = %n.host, result = o.label(), "cannot resolve upstream server; it gets no traffic until it resolves");
                        Vec::new()
                    }
                }
            };
            let servers = replace(u, n, new);
            u.servers = servers;
        }
    }
}

/// One name to keep resolved.
#[derive(Clone, PartialEq, Eq, Hash)]
struct Key {
    upstream: String,
    name: NamedServer,
}

/// Re-resolve every name of the running config as its TTL runs out, for as
/// long as the process runs. `changed` gets a message after each swap of a
/// group's servers (the caller restarts the health checkers).
pub async fn run<R: Running>(shared: Arc<R>, changed: mpsc::Sender<()>) {
    let mut reloads = shared.reloads();
    let mut dns: Option<Dns> = None;
    // When each name is next asked; when its last failure was logged.
    let mut due: HashMap<Key, Instant> = HashMap::new();
    let mut logged: HashMap<Key, Instant> = HashMap::new();
    loop {
        let state = shared.load();
        let cfg = R::config(&state);
        // The names of this config: new ones were just seeded, so they are
        // first asked after the floor; gone ones are forgotten.
        let now = Instant::now();
        let min_ttl = cfg.resolver.min_ttl;
        let keys: Vec<Key> = cfg
            .upstreams
            .iter()
            .flat_map(|(u, up)| {
                up.resolve.iter().map(move |n| Key {
                    upstream: u.clone(),
                    name: n.clone(),
                })
            })
            .collect();
        due.retain(|k, _| keys.contains(k));
        logged.retain(|k, _| keys.contains(k));
        for k in &keys {
            due.entry(k.clone()).or_insert(now + min_ttl);
        }
        // A resolver only for configs that name servers (a machine without
        // /etc/resolv.conf then logs nothing).
        if keys.is_empty() {
            dns = None;
        } else if dns.as_ref().is_none_or(|d| d.cfg != cfg.resolver) {
            match Dns::new(&cfg.resolver) {
                Ok(d) => dns = Some(d),
                Err(e) => {
                    tracing::error!("{e}");
                    dns = None;
                }
            }
        }
        let next = due.values().min().copied();
        let Some(d) = dns.as_ref() else {
            // No name, or no usable resolver: wait for a reload.
            if reloads.changed().await.is_err() {
                return;
            }
            continue;
        };
        tokio::select! {
            r = reloads.changed() => {
                if r.is_err() {
                    return;
                }
                continue;
            }
            _ = sleep_until(next) => {}
        }
        let now = Instant::now();
        let ready: Vec<Key> = due
            .iter()
            .filter(|(_, t)| **t <= now)
            .map(|(k, _)| k.clone())
            .collect();
        // Names are asked one after another: each is bounded by `timeout`,
        // and the control thread has nothing better to do meanwhile.
        for k in ready {
            let result = d.lookup(&k.name.host).await;
            let wait = match &result {
                Ok((_, ttl)) => *ttl,
                Err(_) => d.cfg.min_ttl,
            };
            due.insert(k.clone(), Instant::now() + wait);
            let outcome = apply(&*shared, &k, result, &changed);
            stats().count(&k.upstream, outcome);
            match outcome {
                Outcome::Ok => {}
                Outcome::Changed => {
                    tracing::info!(upstream = %k.upstream, host = %k.name.host, "upstream server addresses changed")
                }
                o => {
                    let t = Instant::now();
                    if logged
                        .get(&k)
                        .is_none_or(|l| t.duration_since(*l) >= LOG_EVERY)
                    {
                        logged.insert(k.clone(), t);
                        tracing::warn!(upstream = %k.upstream, host = %k.name.host, result = o.label(), "cannot resolve upstream server; keeping its last addresses");
                    }
                }
            }
        }
    }
}

async fn sleep_until(t: Option<Instant>) {
    match t {
        Some(t) => tokio::time::sleep_until(t).await,
        None => std::future::pending().await,
    }
}

/// Apply one answer to the state running now (it may have been reloaded
/// while the question was out). No await between the load and the install:
/// nothing else installs meanwhile on this thread.
fn apply<R: Running>(
    shared: &R,
    k: &Key,
    result: Result<(Vec<IpAddr>, Duration), Outcome>,
    changed: &mpsc::Sender<()>,
) -> Outcome {
    let (ips, _) = match result {
        Ok(r) => r,
        Err(o) => return o,
    };
    let state = shared.load();
    let cfg = R::config(&state);
    let Some(u) = cfg.upstreams.get(&k.upstream) else {
        return Outcome::Ok;
    };
    if !u.resolve.contains(&k.name) {
        return Outcome::Ok;
    }
    let new = servers_of(cfg, &k.name, &ips);
    if new.is_empty() {
        // Every address was filtered out: keep the last good ones.
        return Outcome::Empty;
    }
    let servers = replace(u, &k.name, new);
    if same(&servers, &u.servers) {
        return Outcome::Ok;
    }
    if shared.install_servers(&state, &k.upstream, servers) {
        let _ = changed.try_send(());
        Outcome::Changed
    } else {
        Outcome::Ok
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn server(a: &str, host: Option<&str>) -> UpstreamServer {
        UpstreamServer {
            addr: a.parse().unwrap(),
            weight: 1,
            host: host.map(Into::into),
        }
    }

    #[test]
    fn replace_keeps_other_servers_and_order() {
        let n = NamedServer {
            host: "a.test".into(),
            port: 80,
            weight: 1,
        };
        let m = NamedServer {
            host: "b.test".into(),
            port: 80,
            weight: 1,
        };
        let mut u = Upstream::with_defaults(
            "u",
            vec![
                server("10.0.0.9:80", None),
                server("10.0.0.1:80", Some("a.test")),
                server("10.0.0.2:80", Some("b.test")),
            ],
        );
        u.resolve = vec![n.clone(), m];
        let out = replace(
            &u,
            &n,
            vec![
                server("10.0.0.3:80", Some("a.test")),
                server("10.0.0.4:80", Some("a.test")),
            ],
        );
        let addrs: Vec<String> = out.iter().map(|s| s.addr.to_string()).collect();
        assert_eq!(
            addrs,
            ["10.0.0.9:80", "10.0.0.3:80", "10.0.0.4:80", "10.0.0.2:80"]
        );
        assert!(!same(&out, &u.servers));
        assert!(same(&u.servers, &u.servers.clone()));
    }
}
