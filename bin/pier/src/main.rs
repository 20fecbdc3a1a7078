//! `pier`: the CLI and the wiring of the crates. Everything with behaviour
//! lives in crates/; this file only decides what runs where:
//!
//! - N worker threads (pier-core), each accepting on its own reuseport
//!   socket and running the proxy driver (pier-proxy) with its own hooks;
//! - one control thread (this one): signals, config reload, health checks,
//!   the admin listener, the readiness file.

mod demo;

use clap::{Parser, Subcommand};
use pier_config::Config;
use pier_phases::ConfigPhases;
use pier_proxy::{Shared, State};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::signal::unix::{signal, SignalKind};
use tokio::sync::watch;

#[derive(Parser)]
#[command(name = "pier", version, about = "Pier: a programmable edge reverse proxy", long_about = None)]
struct Cli {
    #[command(subcommand)]
    cmd: Option<Cmd>,
}

#[derive(Subcommand)]
// `Proxy` carries every quick-mode flag; the enum is parsed once at start.
#[allow(clippy::large_enum_variant)]
enum Cmd {
    /// Run the proxy on a config file (or the embedded quickstart config).
    Serve {
        /// Config file (TOML). Without it, the embedded quickstart config runs.
        #[arg(short = 'c', long = "config")]
        config: Option<PathBuf>,
    },
    /// One-line reverse proxy: round robin over the given origins, health-checked.
    Proxy {
        /// Address to listen on, e.g. 127.0.0.1:8080.
        #[arg(long)]
        listen: String,
        /// Origins, comma separated: HOST:PORT (cleartext) or a URL with
        /// scheme http, https (HTTP/2 or HTTP/1.1 by ALPN) or h2c (cleartext
        /// HTTP/2): 127.0.0.1:3000,https://origin.example:443.
        #[arg(long, value_delimiter = ',', required = true)]
        to: Vec<String>,
        /// Admin listener (metrics, health), e.g. 127.0.0.1:9901.
        #[arg(long)]
        admin: Option<String>,
        /// The admin endpoint's bearer token (`[admin] token`): needed to
        /// purge the cache, and to listen off loopback. PIER_ADMIN_TOKEN in
        /// the environment does the same without showing it in `ps`.
        #[arg(long, requires = "admin")]
        admin_token: Option<String>,
        /// Serve HTTPS on --listen with this certificate chain (PEM).
        #[arg(long, requires = "tls_key")]
        tls_cert: Option<PathBuf>,
        /// The private key of --tls-cert (PEM).
        #[arg(long, requires = "tls_cert")]
        tls_key: Option<PathBuf>,
        /// Serve HTTPS on --listen with a certificate for this name from an
        /// ACME CA (Let's Encrypt unless --acme-directory), obtained and
        /// renewed by TLS-ALPN-01; repeatable: one certificate for all.
        #[arg(long, value_name = "NAME", conflicts_with = "tls_cert")]
        acme_domain: Vec<String>,
        /// The ACME account's contact e-mail.
        #[arg(long, requires = "acme_domain")]
        acme_email: Option<String>,
        /// The ACME CA's directory URL (https://).
        #[arg(long, requires = "acme_domain")]
        acme_directory: Option<String>,
        /// CA certificates (PEM) for the directory's HTTPS (a test CA).
        #[arg(long, requires = "acme_domain")]
        acme_ca: Option<PathBuf>,
        /// Where the account and certificates are kept (default ./pier-acme).
        #[arg(long, requires = "acme_domain")]
        acme_storage: Option<PathBuf>,
        /// Accept cleartext HTTP/2 with prior knowledge on --listen, beside
        /// HTTP/1.1 (with --tls-cert, HTTP/2 is chosen by ALPN instead).
        #[arg(long)]
        h2c: bool,
        /// Serve HTTP/3 (QUIC) on --listen's port over UDP too, with the
        /// --tls-cert certificate; TCP responses get Alt-Svc.
        #[arg(long, requires = "tls_cert")]
        http3: bool,
        /// Every connection on --listen opens with a PROXY protocol header
        /// (v1 or v2) from a --trusted-proxy.
        #[arg(long, requires = "trusted_proxy")]
        proxy_protocol: bool,
        /// A balancer (CIDR) whose PROXY headers and Forwarded /
        /// X-Forwarded-* headers are believed; repeatable.
        #[arg(long, value_name = "CIDR")]
        trusted_proxy: Vec<String>,
        /// Convert gRPC-web requests to gRPC for the origins and the answers
        /// back (needs h2c:// or https:// origins).
        #[arg(long)]
        grpc_web: bool,
        /// A CA to trust for https origins (else the system trust store).
        #[arg(long)]
        upstream_ca: Option<PathBuf>,
        /// Put a shared memory cache of this size in front of the origins
        /// (e.g. 256MiB); responses are cached as their headers allow.
        #[arg(long)]
        cache: Option<String>,
        /// A disk tier for --cache in this directory (kept across restarts);
        /// objects reach it once they have been hit twice.
        #[arg(long, requires = "cache")]
        cache_dir: Option<PathBuf>,
        /// The disk tier's size (default 1GiB), e.g. 10GiB.
        #[arg(long, requires = "cache_dir")]
        cache_disk: Option<String>,
        /// Responses with Set-Cookie: `pass` (default: not stored unless
        /// public, as Varnish and nginx) or `store` (stored with the cookie,
        /// as RFC 9111 allows).
        #[arg(long, requires = "cache", value_parser = ["pass", "store"])]
        cache_set_cookie: Option<String>,
    },
    /// Consume Pier's analytics events from Kafka in a consumer group,
    /// aggregate them per minute and merge them into PostgreSQL (hll).
    Aggregate {
        /// Kafka bootstrap brokers, comma separated: HOST:PORT,...
        #[arg(long, value_delimiter = ',', required = true)]
        kafka: Vec<String>,
        /// The topic Pier's [analytics.kafka] sink writes to.
        #[arg(long, default_value = "pier-events")]
        topic: String,
        /// Consumer group; aggregators in one group share the partitions.
        #[arg(long, default_value = "pier-aggregate")]
        group: String,
        /// PostgreSQL connection string or URL (the hll extension installed),
        /// without a password: every local user can read a command line.
        /// The password comes from --postgres-password-file or PGPASSWORD.
        #[arg(long, required = true)]
        postgres: String,
        /// A file holding the PostgreSQL password (its first line).
        #[arg(long)]
        postgres_password_file: Option<PathBuf>,
        /// How often rollups are merged into PostgreSQL.
        #[arg(long, default_value = "5s")]
        flush: String,
        /// (host, route) rows kept per minute; past it events count in "(other)".
        #[arg(long, default_value_t = 10_000)]
        max_keys: usize,
    },
    /// Replace the running Pier with this binary, dropping nothing: the
    /// config is checked, the running Pier (at `[server] upgrade_socket`)
    /// hands over its listening sockets, this process starts serving on
    /// them, and only then does the old one stop accepting and drain. If
    /// this one fails to start, the old one goes on serving. This process
    /// then runs in the foreground as `serve` does.
    Upgrade {
        #[arg(short = 'c', long = "config")]
        config: Option<PathBuf>,
        /// The file may also be given without -c.
        file: Option<PathBuf>,
    },
    /// Validate a config file and print every error with its location.
    Check {
        #[arg(short = 'c', long = "config")]
        config: Option<PathBuf>,
        /// The file may also be given without -c.
        file: Option<PathBuf>,
    },
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    // Test only (docs/testing.md): the cache's clock moved by a file's seconds.
    if let Some(file) = std::env::var_os("PIER_TEST_CLOCK").filter(|f| !f.is_empty()) {
        tracing::warn!(file = ?file, "PIER_TEST_CLOCK is set: the cache clock is moved by the seconds in this file (for tests only)");
        pier_clock::install_test_clock(file.into());
    }
    match cli.cmd.unwrap_or(Cmd::Serve { config: None }) {
        Cmd::Aggregate {
            kafka,
            topic,
            group,
            postgres,
            postgres_password_file,
            flush,
            max_keys,
        } => {
            match pier_kafka::aggregate::has_password(&postgres) {
                Ok(false) => {}
                Ok(true) => return usage_error(
                    "--postgres: no password on the command line (every local user can read it): give it in PGPASSWORD or --postgres-password-file",
                ),
                Err(e) => return usage_error(&format!("--postgres: {e}")),
            }
            let password = match &postgres_password_file {
                Some(f) => match std::fs::read_to_string(f) {
                    Ok(t) => Some(t.lines().next().unwrap_or("").to_string()),
                    Err(e) => {
                        return usage_error(&format!(
                            "--postgres-password-file {}: {e}",
                            f.display()
                        ))
                    }
                },
                None => std::env::var("PGPASSWORD").ok().filter(|p| !p.is_empty()),
            };
            let flush = match pier_kafka::parse_duration(&flush) {
                Ok(d) => d,
                Err(e) => return usage_error(&format!("--flush: {e}")),
            };
            let cfg = pier_kafka::AggregateConfig {
                brokers: kafka,
                topic,
                group,
                postgres,
                password,
                flush,
                max_keys,
            };
            match pier_kafka::aggregate::run_until_signal(&cfg) {
                Ok(()) => ExitCode::SUCCESS,
                Err(e) => {
                    eprintln!("{e}");
                    ExitCode::from(1)
                }
            }
        }
        Cmd::Check { config, file } => {
            let Some(path) = config.or(file) else {
                eprintln!("pier check: give a config file: pier check -c FILE");
                return ExitCode::from(2);
            };
            match pier_config::load_file(&path) {
                Ok(cfg) if check_lua(&cfg).is_err() => {
                    eprintln!("{}", check_lua(&cfg).unwrap_err());
                    eprintln!("pier: configuration {} has Lua errors", path.display());
                    ExitCode::from(1)
                }
                Ok(cfg) => match pier_tls::check(&cfg, unix_now()) {
                    Ok(warnings) => {
                        for w in &warnings {
                            eprintln!("warning: {w}");
                        }
                        println!("pier: configuration {} is ok", path.display());
                        ExitCode::SUCCESS
                    }
                    Err(errs) => {
                        for e in &errs {
                            eprintln!("error: {e}");
                        }
                        eprintln!(
                            "pier: configuration {} has {} TLS error(s)",
                            path.display(),
                            errs.len()
                        );
                        ExitCode::from(1)
                    }
                },
                Err(errs) => {
                    eprintln!("{}", errs.to_string().trim_end());
                    eprintln!(
                        "pier: configuration {} has {} error(s)",
                        path.display(),
                        errs.0.len()
                    );
                    ExitCode::from(1)
                }
            }
        }
        Cmd::Serve { config } => {
            let (cfg, path) = match &config {
                Some(p) => match pier_config::load_file(p) {
                    Ok(c) => (c, Some(p.clone())),
                    Err(errs) => {
                        eprintln!("{}", errs.to_string().trim_end());
                        return ExitCode::from(1);
                    }
                },
                None => match pier_config::load_str(
                    pier_config::DEFAULT_CONFIG,
                    "<embedded quickstart.toml>",
                ) {
                    Ok(c) => (c, None),
                    Err(errs) => {
                        eprintln!("{}", errs.to_string().trim_end());
                        return ExitCode::from(1);
                    }
                },
            };
            if let Err(e) = check_lua(&cfg) {
                eprintln!("{e}");
                return ExitCode::from(1);
            }
            run(cfg, path, None)
        }
        Cmd::Upgrade { config, file } => {
            let Some(path) = config.or(file) else {
                eprintln!(
                    "pier upgrade: give the running Pier's config file: pier upgrade -c FILE"
                );
                return ExitCode::from(2);
            };
            let cfg = match pier_config::load_file(&path) {
                Ok(c) => c,
                Err(errs) => {
                    eprintln!("{}", errs.to_string().trim_end());
                    eprintln!(
                        "pier upgrade: configuration {} refused; the running Pier goes on serving",
                        path.display()
                    );
                    return ExitCode::from(1);
                }
            };
            if let Err(e) = check_lua(&cfg) {
                eprintln!("{e}");
                eprintln!(
                    "pier upgrade: configuration {} refused; the running Pier goes on serving",
                    path.display()
                );
                return ExitCode::from(1);
            }
            let Some(socket) = cfg.upgrade_socket.clone() else {
                eprintln!("pier upgrade: {} has no [server] upgrade_socket: the running Pier cannot be asked for its sockets", path.display());
                return ExitCode::from(2);
            };
            match pier_core::handover::Handover::connect(&socket) {
                Ok(h) => {
                    eprintln!(
                        "pier: upgrade: {} listening socket(s) handed over by the running Pier",
                        h.len()
                    );
                    run(cfg, Some(path), Some(h))
                }
                Err(e) => {
                    eprintln!("pier upgrade: {e}");
                    ExitCode::from(1)
                }
            }
        }
        Cmd::Proxy {
            listen,
            to,
            admin,
            admin_token,
            tls_cert,
            tls_key,
            acme_domain,
            acme_email,
            acme_directory,
            acme_ca,
            acme_storage,
            h2c,
            http3,
            proxy_protocol,
            trusted_proxy,
            grpc_web,
            upstream_ca,
            cache,
            cache_dir,
            cache_disk,
            cache_set_cookie,
        } => {
            let parse = |s: &str| pier_config::parse_listen_addr(s.trim());
            let listen = match parse(&listen) {
                Ok(a) => a,
                Err(e) => return usage_error(&format!("--listen {listen}: {e}")),
            };
            let mut origins = Vec::new();
            let mut scheme = None;
            for t in &to {
                match pier_config::parse_origin(t) {
                    Ok(o) => {
                        if scheme.is_some_and(|s| s != (o.tls, o.h2c)) {
                            return usage_error(
                                "--to: origins are either all https, all h2c or all cleartext HTTP/1",
                            );
                        }
                        scheme = Some((o.tls, o.h2c));
                        origins.push(o);
                    }
                    Err(e) => return usage_error(&format!("--to {t}: {e}")),
                }
            }
            let admin = match admin.as_deref().map(parse).transpose() {
                Ok(a) => a,
                Err(e) => return usage_error(&format!("--admin: {e}")),
            };
            let tls = match (tls_cert, tls_key) {
                (Some(cert), Some(key)) => Some(pier_config::CertFiles { cert, key }),
                _ => None,
            };
            let cache = match cache
                .as_deref()
                .map(|c| pier_config::parse_size(c.trim_end_matches("iB").trim_end_matches("IB")))
            {
                None => None,
                Some(Ok(n)) if n >= 4096 => Some(n as usize),
                Some(Ok(_)) => return usage_error("--cache: at least 4k"),
                Some(Err(e)) => return usage_error(&format!("--cache: {e}")),
            };
            let disk = match cache_disk
                .as_deref()
                .map(|c| pier_config::parse_size(c.trim_end_matches("iB").trim_end_matches("IB")))
            {
                None => 1 << 30,
                Some(Ok(n)) if n >= 1 << 20 => n,
                Some(Ok(_)) => return usage_error("--cache-disk: at least 1m"),
                Some(Err(e)) => return usage_error(&format!("--cache-disk: {e}")),
            };
            let acme = if acme_domain.is_empty() {
                None
            } else {
                match Config::quick_acme(
                    &acme_domain,
                    acme_email,
                    acme_directory,
                    acme_ca,
                    acme_storage.unwrap_or_else(|| PathBuf::from("pier-acme")),
                ) {
                    Ok(a) => Some(a),
                    Err(e) => return usage_error(&e),
                }
            };
            match Config::quick_with(listen, origins, admin, tls, upstream_ca) {
                Ok(mut cfg) => {
                    if let Some(t) = acme {
                        cfg.listeners[0].tls = Some(t);
                    }
                    if let Err(e) = cfg.enable_quick_http2(h2c, grpc_web) {
                        return usage_error(&e);
                    }
                    let mut trusted = Vec::new();
                    for c in &trusted_proxy {
                        match pier_config::Cidr::parse(c) {
                            Ok(c) => trusted.push(c),
                            Err(e) => return usage_error(&format!("--trusted-proxy {c}: {e}")),
                        }
                    }
                    for l in &mut cfg.listeners {
                        l.http3 = http3;
                        l.proxy_protocol = proxy_protocol;
                        l.trusted_proxies = trusted.clone();
                    }
                    let token = admin_token.or_else(|| {
                        std::env::var("PIER_ADMIN_TOKEN")
                            .ok()
                            .filter(|t| !t.is_empty())
                    });
                    if let Some(t) = token {
                        if let Err(e) = pier_config::check_admin_token(&t) {
                            return usage_error(&format!("--admin-token {e}"));
                        }
                        cfg.admin_auth.token = Some(t);
                    }
                    if let Some(a) = cfg.admin {
                        if pier_config::check_admin_exposure(a, &cfg.admin_auth).is_err() {
                            return usage_error(&format!(
                                "--admin {a} is not a loopback address: give --admin-token (or PIER_ADMIN_TOKEN), or listen on 127.0.0.1"
                            ));
                        }
                    }
                    if let Some(bytes) = cache {
                        cfg.enable_quick_cache(
                            bytes,
                            cache_dir.map(|d| (d, disk)),
                            cache_set_cookie.as_deref() == Some("store"),
                        );
                    }
                    run(cfg, None, None)
                }
                Err(e) => usage_error(&e),
            }
        }
    }
}

use pier_core::handover::{Handover, HandoverServer, Kind};

/// The sockets a binary upgrade handed over for a listener, if they are
/// bound where this config wants it.
fn inherit(
    handover: &mut Option<Handover>,
    kind: Kind,
    name: &str,
    addr: SocketAddr,
) -> Vec<std::os::fd::OwnedFd> {
    match handover {
        Some(h) => h.take_bound(kind, name, addr),
        None => Vec::new(),
    }
}

type HandoverSet = Vec<(Kind, String, std::os::fd::OwnedFd)>;

/// Copies of every listening socket (the workers own the originals), in
/// worker order, for the next binary upgrade.
fn handover_set(
    tcp: &[Vec<(String, std::net::TcpListener)>],
    udp: &[Vec<(String, std::net::UdpSocket)>],
    admin: Option<&std::net::TcpListener>,
) -> std::io::Result<HandoverSet> {
    let mut set = Vec::new();
    for (name, l) in tcp.iter().flatten() {
        set.push((Kind::Tcp, name.clone(), l.try_clone()?.into()));
    }
    for (name, s) in udp.iter().flatten() {
        set.push((Kind::Udp, name.clone(), s.try_clone()?.into()));
    }
    if let Some(a) = admin {
        set.push((Kind::Admin, "admin".to_string(), a.try_clone()?.into()));
    }
    Ok(set)
}

/// Compile every Lua chunk of the config in a scratch state (check, start, reload).
fn check_lua(cfg: &Config) -> Result<(), String> {
    match pier_phases::lua_setup(cfg) {
        None => Ok(()),
        Some(setup) => setup.validate().map_err(|errs| errs.join("\n")),
    }
}

fn unix_now() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs() as i64)
        .unwrap_or(0)
}

fn usage_error(msg: &str) -> ExitCode {
    eprintln!("pier: {msg}");
    ExitCode::from(2)
}

/// Start everything, then serve signals until exit. With `handover` (a
/// binary upgrade), the listening sockets are the old process's.
fn run(
    mut cfg: Config,
    path: Option<PathBuf>,
    mut handover: Option<pier_core::handover::Handover>,
) -> ExitCode {
    let workers = cfg.workers.max(1);
    let embedded = path.is_none() && cfg.demo_origin.is_some();
    if let Some(addr) = cfg.demo_origin {
        match demo::start(addr) {
            Ok(a) => {
                eprintln!("pier: demo origin serving on http://{a}");
                // `PIER_DEMO_PORT=0` picks a free port: point the upstreams at it.
                for u in cfg.upstreams.values_mut() {
                    for srv in u.servers.iter_mut().filter(|srv| srv.addr == addr) {
                        srv.addr = a;
                    }
                }
            }
            Err(e) => {
                eprintln!("pier: cannot start the demo origin on {addr}: {e} (set PIER_DEMO_PORT to another port)");
                return ExitCode::from(1);
            }
        }
    }
    let listeners: Vec<(String, SocketAddr)> = cfg
        .listeners
        .iter()
        .map(|l| (l.name.clone(), l.addr))
        .collect();
    let (sockets, bound) = match pier_core::bind_all(workers, &listeners, &mut |name, addr| {
        inherit(&mut handover, Kind::Tcp, name, addr)
            .into_iter()
            .map(std::net::TcpListener::from)
            .collect()
    }) {
        Ok(x) => x,
        Err(e) => {
            eprintln!("pier: {e}");
            if e.kind() == std::io::ErrorKind::AddrInUse {
                eprintln!("pier: another process already listens there; stop it or change `listen` in the config");
            }
            return ExitCode::from(1);
        }
    };
    // HTTP/3: UDP on the port each listener with `http3` got for TCP.
    let quic: Vec<(String, SocketAddr)> = bound
        .iter()
        .filter(|(name, _)| cfg.listeners.iter().any(|l| &l.name == name && l.http3))
        .cloned()
        .collect();
    let udp = match pier_core::bind_udp_all(workers, &quic, &mut |name, addr| {
        inherit(&mut handover, Kind::Udp, name, addr)
            .into_iter()
            .map(std::net::UdpSocket::from)
            .collect()
    }) {
        Ok(u) => u,
        Err(e) => {
            eprintln!("pier: {e}");
            return ExitCode::from(1);
        }
    };
    for (name, addr) in &quic {
        eprintln!("pier: listening on https://{addr} over HTTP/3 (udp, listener {name})");
    }
    let admin_listener = match cfg
        .admin
        .map(
            |a| match inherit(&mut handover, Kind::Admin, "admin", a).pop() {
                Some(fd) => Ok(std::net::TcpListener::from(fd)),
                None => std::net::TcpListener::bind(a),
            },
        )
        .transpose()
    {
        Ok(l) => l,
        Err(e) => {
            eprintln!(
                "pier: cannot listen on admin address {}: {e}",
                cfg.admin.unwrap_or(([0, 0, 0, 0], 0).into())
            );
            return ExitCode::from(1);
        }
    };
    let admin_addr = admin_listener.as_ref().and_then(|l| l.local_addr().ok());
    // `[admin.tls]`: built as a listener's TLS is (a bad certificate stops the start).
    let admin_tls = match cfg
        .admin_tls
        .as_ref()
        .map(|t| {
            let s = pier_tls::ServerTls::build("admin", t)?;
            if let Some(acme) = &t.acme {
                pier_acme::manage_listener(&s, acme);
            }
            Ok::<_, String>(s)
        })
        .transpose()
    {
        Ok(t) => t.map(Arc::new),
        Err(e) => {
            eprintln!("pier: [admin.tls]: {e}");
            return ExitCode::from(1);
        }
    };

    let access = match open_access_log(&cfg.access_log) {
        Ok(a) => a,
        Err(e) => {
            eprintln!("pier: {e}");
            return ExitCode::from(1);
        }
    };
    let metrics = pier_log::Metrics::new(workers);
    let pool = pier_core::Pool::new(pier_core::PoolConfig {
        workers,
        max_idle_per_server: pool_idle(&cfg),
        idle_timeout: cfg.timeouts.upstream_idle,
    });
    let grace = cfg.grace_period;
    // The control thread's runtime, made now so that host names are
    // resolved (with the resolver the DNS task goes on using) before the
    // first request.
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("control runtime");
    if let Err(e) = rt.block_on(seed_names(&mut cfg, None)) {
        eprintln!("pier: {e}");
        return ExitCode::from(1);
    }
    let state = match State::build(cfg, &metrics, 1, None) {
        Ok(mut s) => {
            pier_phases::prepare(&mut s);
            s
        }
        Err(e) => {
            eprintln!("pier: {e}");
            return ExitCode::from(1);
        }
    };
    let analytics = if state.cfg.analytics.enabled {
        let sink = match kafka_sink(&state.cfg.analytics) {
            Ok(s) => s,
            Err(e) => {
                eprintln!("pier: [analytics.kafka]: {e}");
                return ExitCode::from(1);
            }
        };
        match pier_analytics::hub::Hub::start(&state.cfg.analytics, sink) {
            Ok(h) => Some(Arc::new(h)),
            Err(e) => {
                eprintln!("pier: {e}");
                return ExitCode::from(1);
            }
        }
    } else {
        None
    };
    let mut shared = Shared::new(state, pool, metrics, access);
    shared.analytics = analytics;
    let shared = Arc::new(shared);
    // A fleet's Redis (`[redis]`, read at start): purges other nodes publish
    // are applied to this node's cache, on the fleet's own thread; global
    // limits exchange their counts on another.
    // Lua's `pier.cache.purge`: the running config's zones, then (with
    // [redis]) the fleet's publish queue; a worker never waits on Redis.
    {
        let s = shared.clone();
        pier_lua::set_purger(Box::new(move |zone, what, v| {
            let asks = vec![(what.to_string(), v.to_string())];
            let n = pier_proxy::purge::apply(&s.state.load(), zone, &asks).map_err(|(_, e)| e)?;
            if let Some(f) = pier_fleet::get() {
                f.publish_soon(pier_fleet::Purge {
                    zone: zone.map(str::to_string),
                    asks,
                });
            }
            Ok(n)
        }));
    }
    let redis = shared.state.load().cfg.redis.clone();
    if let Some(redis) = redis {
        let s = shared.clone();
        let apply: pier_fleet::Apply =
            Box::new(move |p| pier_admin::apply_fleet_purge(&s.state.load(), p));
        let started = pier_fleet::start(&redis, apply)
            .and_then(|f| pier_fleet::start_limits(&redis, f.node()));
        if let Err(e) = started {
            eprintln!("pier: {e}");
            return ExitCode::from(1);
        }
    }

    // Binary upgrades: a copy of every listening socket for the next
    // binary, and the socket it asks on. Bound before the workers start,
    // so a start that cannot offer upgrades fails as a bad config does;
    // after an upgrade, taken over once the old process has let go.
    let upgrade_path = shared.state.load().cfg.upgrade_socket.clone();
    let mut upgrade_set = None;
    let mut upgrade_server = None;
    if let Some(p) = &upgrade_path {
        match handover_set(&sockets, &udp, admin_listener.as_ref()) {
            Ok(s) => upgrade_set = Some(s),
            Err(e) => {
                eprintln!("pier: upgrade_socket: cannot keep the listening sockets: {e}");
                return ExitCode::from(1);
            }
        }
        if handover.is_none() {
            match HandoverServer::bind(p) {
                Ok(s) => upgrade_server = Some(s),
                Err(e) => {
                    eprintln!("pier: cannot listen on upgrade_socket {}: {e}", p.display());
                    return ExitCode::from(1);
                }
            }
        }
    }
    let worker_shared = shared.clone();
    let handles = match pier_core::spawn_workers(sockets, udp, move |ctx| {
        let shared = worker_shared.clone();
        pier_lua::set_worker(ctx.id, workers);
        async move { pier_proxy::run_worker(ctx, shared, ConfigPhases::new()).await }
    }) {
        Ok(h) => h,
        Err(e) => {
            eprintln!("pier: cannot start workers: {e}");
            return ExitCode::from(1);
        }
    };

    for (name, addr) in &bound {
        let tls = shared
            .state
            .load()
            .cfg
            .listeners
            .iter()
            .any(|l| &l.name == name && l.tls.is_some());
        let scheme = if tls { "https" } else { "http" };
        eprintln!("pier: listening on {scheme}://{addr} (listener {name}, {workers} workers)");
    }
    if let Some(a) = admin_addr {
        eprintln!("pier: admin on http://{a} (/metrics, /healthz, /dashboard, /api/analytics)");
    }
    // The old process stops accepting only now, with these workers
    // accepting on the same sockets: no connection finds nobody.
    let upgraded = handover.is_some();
    if let (Some(h), Some(p)) = (handover.take(), &upgrade_path) {
        upgrade_server = match h.ready(p) {
            Ok(s) => Some(s),
            Err(e) => {
                tracing::warn!("upgrade: the old process did not confirm ({e}); serving anyway");
                HandoverServer::bind(p)
                    .map_err(|e| tracing::error!("upgrade_socket {}: {e}", p.display()))
                    .ok()
            }
        };
        eprintln!("pier: upgrade done: process {} serves", std::process::id());
    }
    notify_systemd(upgraded);
    if embedded {
        eprintln!(
            "pier: running the embedded quickstart config; try: curl -i http://{}/",
            bound[0].1
        );
        eprintln!("pier: to proxy to your own origin: pier proxy --listen 127.0.0.1:8080 --to 127.0.0.1:3000");
        eprintln!("pier:   or write a config (see examples/quickstart.toml, docs/config.md) and run: pier serve -c FILE");
    }

    let local = tokio::task::LocalSet::new();
    let code = local.block_on(
        &rt,
        control(
            shared,
            path,
            bound,
            (admin_listener, admin_tls),
            admin_addr,
            grace,
            upgrade_server.zip(upgrade_set),
        ),
    );
    drop(handles); // worker threads end with the process
    code
}

/// `[analytics.kafka]`: the Kafka sink the analytics thread also hands
/// every event to (pier-kafka; pier-analytics knows only its trait).
struct KafkaSink(pier_kafka::Sink);

impl pier_analytics::hub::EventSink for KafkaSink {
    fn offer(&self, e: &pier_analytics::EventRef<'_>) {
        self.0.offer(e)
    }
    fn stats(&self) -> (u64, u64, u64, u64) {
        let s = self.0.stats();
        (s.sent, s.dropped, s.errors, s.queued)
    }
    fn flush(&self, timeout: Duration) {
        self.0.flush(timeout)
    }
}

fn kafka_sink(
    a: &pier_config::Analytics,
) -> Result<Option<Arc<dyn pier_analytics::hub::EventSink>>, String> {
    let Some(k) = &a.kafka else { return Ok(None) };
    let sink = pier_kafka::Sink::start(&pier_kafka::SinkConfig {
        brokers: k.brokers.clone(),
        topic: k.topic.clone(),
        batch_size: k.batch_size,
        linger: k.linger,
        compression: k.compression.clone(),
        queue: k.queue,
    })?;
    Ok(Some(Arc::new(KafkaSink(sink))))
}

fn pool_idle(cfg: &Config) -> usize {
    cfg.upstreams
        .values()
        .map(|u| u.pool_idle_per_server)
        .max()
        .unwrap_or(256)
}

fn open_access_log(a: &pier_config::AccessLog) -> Result<pier_log::AccessLog, String> {
    Ok(match a {
        pier_config::AccessLog::Off => pier_log::AccessLog::off(),
        pier_config::AccessLog::Stdout => pier_log::AccessLog::start(Box::new(std::io::stdout())),
        pier_config::AccessLog::File(p) => pier_log::AccessLog::file(p.clone())?,
    })
}

/// The control loop: health checks, admin, readiness file, signals.
async fn control(
    shared: Arc<Shared>,
    path: Option<PathBuf>,
    bound: Vec<(String, SocketAddr)>,
    (admin_listener, admin_tls): (
        Option<std::net::TcpListener>,
        Option<Arc<pier_tls::ServerTls>>,
    ),
    admin_addr: Option<SocketAddr>,
    mut grace: Duration,
    upgrades: Option<(HandoverServer, HandoverSet)>,
) -> ExitCode {
    if let Some(l) = admin_listener {
        let _ = l.set_nonblocking(true);
        match tokio::net::TcpListener::from_std(l) {
            Ok(l) => {
                tokio::task::spawn_local(pier_admin::serve(l, shared.clone(), admin_tls));
            }
            Err(e) => tracing::error!("admin listener: {e}"),
        }
    }
    let mut health_stop = start_health(&shared);
    // Host names re-resolved as their TTLs run out; a changed answer swaps
    // a group's peers, whose health checkers are then restarted.
    let (dns_tx, mut dns_rx) = tokio::sync::mpsc::channel(1);
    tokio::task::spawn_local(pier_lb::dns::run(shared.clone(), dns_tx));
    let mut generation = 1u64;
    write_ready(&bound, admin_addr, generation);

    // A binary upgrade's handover runs on a thread of its own (blocking
    // socket calls); when a new process serves, this one drains and exits.
    let (upgraded_tx, mut upgraded_rx) = tokio::sync::oneshot::channel::<()>();
    let upgrade_path = upgrades.as_ref().map(|(s, _)| s.path().to_path_buf());
    if let Some((server, set)) = upgrades {
        let shared = shared.clone();
        let spawned = std::thread::Builder::new()
            .name("pier-upgrade".into())
            .spawn(move || {
                server.serve(&set, || {
                    shared.lifecycle.hand_over();
                    let _ = upgraded_tx.send(());
                });
            });
        if let Err(e) = spawned {
            tracing::error!("upgrade socket thread: {e}");
        }
    }
    let exe = std::env::current_exe().ok();
    let (mut hup, mut term, mut int, mut usr2, mut usr1) = match (
        signal(SignalKind::hangup()),
        signal(SignalKind::terminate()),
        signal(SignalKind::interrupt()),
        signal(SignalKind::user_defined2()),
        signal(SignalKind::user_defined1()),
    ) {
        (Ok(a), Ok(b), Ok(c), Ok(d), Ok(e)) => (a, b, c, d, e),
        _ => {
            eprintln!("pier: cannot install signal handlers");
            return ExitCode::from(1);
        }
    };
    loop {
        tokio::select! {
            _ = hup.recv() => {
                let Some(p) = &path else {
                    tracing::warn!("SIGHUP: running the embedded config; nothing to reload");
                    continue;
                };
                match reload(&shared, p, generation + 1).await {
                    Ok(new_grace) => {
                        generation += 1;
                        grace = new_grace;
                        let _ = health_stop.send(true);
                        health_stop = start_health(&shared);
                        write_ready(&bound, admin_addr, generation);
                        tracing::info!("reloaded {} (generation {generation})", p.display());
                    }
                    Err(e) => tracing::error!("reload refused, old config keeps serving:\n{e}"),
                }
            }
            Some(()) = dns_rx.recv() => {
                let _ = health_stop.send(true);
                health_stop = start_health(&shared);
            }
            _ = usr1.recv() => {
                // Log rotation, as nginx's USR1: the access log file is
                // opened again (error logs go to stderr, the journal's).
                tracing::info!("SIGUSR1: reopening the access log");
                shared.access.reopen();
            }
            _ = usr2.recv() => match (&exe, &path, &upgrade_path) {
                (Some(exe), Some(config), Some(_)) => spawn_upgrade(exe, config),
                _ => tracing::warn!("SIGUSR2: a binary upgrade needs a config file with [server] upgrade_socket"),
            },
            Ok(()) = &mut upgraded_rx => {
                tracing::info!("upgrade: the new process serves; draining (grace period {grace:?})");
                return drain_and_exit(&shared, grace).await;
            }
            _ = term.recv() => {
                tracing::info!("SIGTERM: draining (grace period {grace:?})");
                shared.start_drain();
                if let Some(p) = &upgrade_path {
                    pier_core::handover::remove_if_ours(p);
                }
                return drain_and_exit(&shared, grace).await;
            }
            _ = int.recv() => {
                tracing::info!("SIGINT: exiting now");
                return ExitCode::from(130);
            }
        }
    }
}

/// Wait (up to `grace`) for the open connections to finish, flush the
/// logs and analytics, and exit.
async fn drain_and_exit(shared: &Arc<Shared>, grace: Duration) -> ExitCode {
    let deadline = Instant::now() + grace;
    while shared.metrics.active_connections.load(Relaxed) > 0 && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let left = shared.metrics.active_connections.load(Relaxed);
    if left > 0 {
        tracing::warn!("grace period over with {left} connection(s) open; exiting");
    }
    shared.access.flush();
    // Give the access log thread a moment to write what it got
    // (and the workers to hand over their last analytics batch).
    tokio::time::sleep(Duration::from_millis(50)).await;
    if let Some(a) = &shared.analytics {
        // Writes the minutes still open: a restart keeps them.
        a.stop();
    }
    // The spans of the last requests go to the collector (a second at most:
    // a collector that is down must not hold the exit).
    if let Some(t) = shared.state.load().tracer.clone() {
        let _ = tokio::task::spawn_blocking(move || t.flush(Duration::from_secs(1))).await;
    }
    ExitCode::SUCCESS
}

/// SIGUSR2: start the binary at this process's path (a package upgrade
/// put the new one there) as `pier upgrade -c CONFIG`; it asks this
/// process for the sockets. Its exit is waited for, so a failed upgrade
/// leaves no zombie and is logged.
fn spawn_upgrade(exe: &Path, config: &Path) {
    tracing::info!(
        "SIGUSR2: starting {} upgrade -c {}",
        exe.display(),
        config.display()
    );
    let child = std::process::Command::new(exe)
        .arg("upgrade")
        .arg("-c")
        .arg(config)
        .stdin(std::process::Stdio::null())
        .spawn();
    match child {
        Ok(mut c) => {
            let _ = std::thread::Builder::new()
                .name("pier-upgrade-child".into())
                .spawn(move || match c.wait() {
                    Ok(s) if s.success() => {}
                    Ok(s) => tracing::error!(
                        "SIGUSR2: the new binary exited with {s}; this process goes on serving"
                    ),
                    Err(e) => tracing::error!("SIGUSR2: waiting for the new binary: {e}"),
                });
        }
        Err(e) => tracing::error!("SIGUSR2: cannot start {}: {e}", exe.display()),
    }
}

/// systemd's readiness (`Type=notify`, `NotifyAccess=all`): READY=1 once
/// serving; after a binary upgrade also MAINPID=, so systemd follows the
/// new process as the service's main one when the old one exits.
fn notify_systemd(upgraded: bool) {
    let Some(addr) = std::env::var_os("NOTIFY_SOCKET") else {
        return;
    };
    let msg = if upgraded {
        format!("MAINPID={}\nREADY=1", std::process::id())
    } else {
        "READY=1".to_string()
    };
    let sent = std::os::unix::net::UnixDatagram::unbound().and_then(|s| {
        let bytes = addr.as_encoded_bytes();
        match bytes.strip_prefix(b"@") {
            Some(name) => {
                use std::os::linux::net::SocketAddrExt;
                let a = std::os::unix::net::SocketAddr::from_abstract_name(name)?;
                s.send_to_addr(msg.as_bytes(), &a)
            }
            None => s.send_to(msg.as_bytes(), &addr),
        }
    });
    if let Err(e) = sent {
        tracing::warn!("NOTIFY_SOCKET: {e}");
    }
}

fn start_health(shared: &Arc<Shared>) -> watch::Sender<bool> {
    let (tx, rx) = watch::channel(false);
    let state = shared.state.load();
    // TLS upstreams are checked over TLS with their own client config.
    let tls: Vec<Option<pier_lb::CheckTls>> = state
        .upstream_tls
        .iter()
        .map(|t| {
            t.as_ref().map(|t| pier_lb::CheckTls {
                config: t.config.clone(),
                server_name: t.server_name.clone(),
            })
        })
        .collect();
    pier_lb::spawn_health_checks(&state.groups, &tls, rx);
    tx
}

/// Fill in the addresses of the servers given by host name (`resolve =
/// true`): those `prev` has for the same name, else resolved now.
async fn seed_names(cfg: &mut Config, prev: Option<&State>) -> Result<(), String> {
    if cfg.upstreams.values().all(|u| u.resolve.is_empty()) {
        return Ok(());
    }
    let dns = pier_lb::dns::Dns::new(&cfg.resolver)?;
    pier_lb::dns::seed(cfg, prev.map(|p| &p.cfg), &dns).await;
    Ok(())
}

async fn reload(shared: &Arc<Shared>, path: &Path, generation: u64) -> Result<Duration, String> {
    let mut cfg = pier_config::load_file(path).map_err(|e| e.to_string())?;
    let running = shared.state.load_full();
    seed_names(&mut cfg, Some(&running)).await?;
    // After the await: the DNS task may have swapped peers meanwhile.
    let old = shared.state.load();
    if cfg.listeners.iter().map(|l| (&l.name, l.addr)).ne(old
        .cfg
        .listeners
        .iter()
        .map(|l| (&l.name, l.addr)))
        && !cfg.listeners.iter().all(|l| l.addr.port() == 0)
    {
        tracing::warn!(
            "listener changes need a restart; routes, upstreams, limits and timeouts were reloaded"
        );
    }
    let grace = cfg.grace_period;
    shared
        .pool
        .reconfigure(pool_idle(&cfg), cfg.timeouts.upstream_idle);
    check_lua(&cfg)?;
    let mut state = State::build(cfg, &shared.metrics, generation, Some(&old))?;
    pier_phases::prepare(&mut state);
    if let Some(setup) = pier_phases::setup_of(&state) {
        // Run `init` once here: a reload whose Lua can't start is refused.
        pier_lua::LuaEngine::with_limits(
            setup,
            state.shdicts.clone(),
            pier_phases::lua_limits(&state.cfg),
        )
        .map_err(|e| format!("lua: {e}"))?;
    }
    shared.install(state);
    Ok(grace)
}

/// `PIER_READY_FILE`: tells tests and supervisors the real bound addresses.
fn write_ready(bound: &[(String, SocketAddr)], admin: Option<SocketAddr>, generation: u64) {
    let Ok(path) = std::env::var("PIER_READY_FILE") else {
        return;
    };
    let mut s = String::from("{\"pid\":");
    s.push_str(&std::process::id().to_string());
    s.push_str(",\"generation\":");
    s.push_str(&generation.to_string());
    s.push_str(",\"listeners\":{");
    for (i, (name, addr)) in bound.iter().enumerate() {
        if i > 0 {
            s.push(',');
        }
        s.push_str(&format!("\"{name}\":\"{addr}\""));
    }
    s.push_str("},\"admin\":");
    match admin {
        Some(a) => s.push_str(&format!("\"{a}\"")),
        None => s.push_str("null"),
    }
    s.push_str("}\n");
    let tmp = format!("{path}.tmp");
    if std::fs::write(&tmp, s)
        .and_then(|_| std::fs::rename(&tmp, &path))
        .is_err()
    {
        tracing::error!("cannot write ready file {path}");
    }
}
