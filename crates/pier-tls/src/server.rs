//! A listener's TLS: certificate selection, the rustls server config, and
//! the bounded handshake.

use crate::certs::{load_certified_key, roots_from, subject_of, CertSummary};
use crate::managed::{self, Managed};
use crate::ocsp::{self, Served};
use crate::stats::{stats, Failure};
use crate::TlsInfo;
use pier_config::{ClientAuth, ListenerTls, TlsVersion, UnknownSni};
use rustls::server::{ClientHello, ResolvesServerCert};
use rustls::sign::CertifiedKey;
use rustls::{HandshakeKind, ProtocolVersion, ServerConfig, ServerConnection};
use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};
use std::sync::{Arc, OnceLock};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio_rustls::server::TlsStream;
use tokio_rustls::LazyConfigAcceptor;

/// A finished server handshake.
pub type Accepted<T = TcpStream> = (TlsStream<T>, TlsInfo);

/// The TCP connection a handshake runs over: on tokio's poller, or on the
/// worker's io_uring (`pier_uring`, `[server] io_uring`).
pub trait Transport: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin {
    /// The first byte the client sent, left unread; None if it closed.
    fn peek_first(&mut self) -> impl std::future::Future<Output = std::io::Result<Option<u8>>>;
}

impl Transport for TcpStream {
    async fn peek_first(&mut self) -> std::io::Result<Option<u8>> {
        let mut first = [0u8; 1];
        Ok((self.peek(&mut first).await? > 0).then_some(first[0]))
    }
}

impl Transport for pier_uring::UringStream {
    async fn peek_first(&mut self) -> std::io::Result<Option<u8>> {
        pier_uring::UringStream::peek_first(self).await
    }
}

/// Certificates by name. Each name maps to every certificate that covers it,
/// in config order: the first whose key can sign with a scheme the client
/// offers wins (so an ECDSA certificate listed before an RSA one for the
/// same name serves ECDSA-capable clients, and the RSA one the others).
#[derive(Default)]
struct Sni {
    exact: HashMap<String, Vec<Arc<Served>>>,
    /// `*.example.com` stored under `example.com`: one label deep, as
    /// RFC 6125 wildcards match.
    wild: HashMap<String, Vec<Arc<Served>>>,
    default: Vec<Arc<Served>>,
    /// `[listener.tls.acme]`: its names are served its certificate, and so
    /// is every name when there is no other certificate.
    managed: Option<Arc<Managed>>,
}

impl std::fmt::Debug for Sni {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Sni")
            .field("exact", &self.exact.keys().collect::<Vec<_>>())
            .field("wild", &self.wild.keys().collect::<Vec<_>>())
            .finish()
    }
}

impl Sni {
    fn candidates(&self, name: &str) -> Option<&[Arc<Served>]> {
        let name = name.trim_end_matches('.');
        // Names arrive lower-case from rustls-checked SNI almost always;
        // lower-casing only when needed keeps the common case free.
        let lowered;
        let name = if name.bytes().any(|b| b.is_ascii_uppercase()) {
            lowered = name.to_ascii_lowercase();
            lowered.as_str()
        } else {
            name
        };
        if let Some(v) = self.exact.get(name) {
            return Some(v);
        }
        let parent = name.split_once('.')?.1;
        self.wild.get(parent).map(|v| v.as_slice())
    }
}

/// Signature schemes decide between an RSA and an ECDSA certificate.
fn pick(list: &[Arc<Served>], hello: &ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
    let schemes = hello.signature_schemes();
    list.iter()
        .find(|c| c.signs_with(schemes))
        .or(list.first())
        .map(|c| c.get())
}

impl Sni {
    fn managed_for(&self, name: &str) -> Option<&Arc<Managed>> {
        let m = self.managed.as_ref()?;
        let name = name.trim_end_matches('.');
        m.domains
            .iter()
            .any(|d| d.eq_ignore_ascii_case(name))
            .then_some(m)
    }

    fn known(&self, name: &str) -> bool {
        self.managed_for(name).is_some() || self.candidates(name).is_some()
    }
}

impl ResolvesServerCert for Sni {
    fn resolve(&self, hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        if let Some(m) = hello.server_name().and_then(|n| self.managed_for(n)) {
            return m.get();
        }
        // `unknown_sni = "refuse"` is decided before this (accept), where it
        // is counted; here an unknown name gets the default.
        let list = hello
            .server_name()
            .and_then(|n| self.candidates(n))
            .unwrap_or(&self.default);
        if list.is_empty() {
            return self.managed.as_ref().and_then(|m| m.get());
        }
        pick(list, &hello)
    }
}

/// The one certificate of a TLS-ALPN-01 answer, or of an on-demand name.
#[derive(Debug)]
struct Fixed(Arc<CertifiedKey>);

impl ResolvesServerCert for Fixed {
    fn resolve(&self, _: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        Some(self.0.clone())
    }
}

/// Ticket keys: one rotating ticketer for the process, so every worker and
/// every reloaded config accept each other's tickets.
fn ticketer() -> Result<Arc<dyn rustls::server::ProducesTickets>, String> {
    static T: OnceLock<Arc<dyn rustls::server::ProducesTickets>> = OnceLock::new();
    if let Some(t) = T.get() {
        return Ok(t.clone());
    }
    #[cfg(not(feature = "ring"))]
    let t = rustls::crypto::aws_lc_rs::Ticketer::new();
    #[cfg(feature = "ring")]
    let t = rustls::crypto::ring::Ticketer::new();
    let t = t.map_err(|e| format!("ticket keys: {e}"))?;
    Ok(T.get_or_init(|| t).clone())
}

/// One listener's TLS, shared by every worker (and replaced on reload;
/// connections keep the one they started with).
pub struct ServerTls {
    listener: String,
    config: Arc<ServerConfig>,
    /// The `[listener.tls.acme]` certificate's slot, which `pier-acme` fills.
    managed: Option<Arc<Managed>>,
    sni: Arc<Sni>,
    refuse_unknown: bool,
    certs: Vec<CertSummary>,
    handshake_timeout: std::time::Duration,
    max_handshakes: usize,
    in_progress: AtomicUsize,
    max_pending_hellos: usize,
    /// Connections waiting for (the rest of) their ClientHello.
    pending_hellos: AtomicUsize,
    /// `on_demand = true`: certificates for names the ClientHello asks
    /// for, set once by `pier-acme` after the build.
    on_demand: OnceLock<Arc<dyn managed::OnDemand>>,
}

impl std::fmt::Debug for ServerTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ServerTls")
            .field("listener", &self.listener)
            .field("certs", &self.certs)
            .finish()
    }
}

const PLAIN_HTTP: &[u8] = b"HTTP/1.1 400 Bad Request\r\nContent-Type: text/plain\r\nContent-Length: 46\r\nConnection: close\r\n\r\nThe plain HTTP request was sent to HTTPS port\n";

impl ServerTls {
    /// Load every certificate and build the rustls config. Errors name the
    /// file and what is wrong with it.
    pub fn build(listener: &str, cfg: &ListenerTls) -> Result<ServerTls, String> {
        let provider = crate::provider();
        let mut sni = Sni::default();
        let mut certs = Vec::new();
        for f in &cfg.certificates {
            let (ck, summary) =
                load_certified_key(f).map_err(|e| format!("listener `{listener}`: {e}"))?;
            let ck = Served::new(ck);
            if cfg.ocsp_stapling {
                let base = ck.get();
                match ocsp::target(&base.cert, cfg.ocsp_responder.as_deref(), &summary.name) {
                    Ok(Some(t)) => ocsp::register(&ck, &base.cert[0], t),
                    Ok(None) => {}
                    Err(e) => tracing::warn!("listener `{listener}`: {e}; served without a staple"),
                }
            }
            for n in &summary.names {
                match n.strip_prefix("*.") {
                    Some(parent) => sni.wild.entry(parent.to_string()).or_default(),
                    None => sni.exact.entry(n.clone()).or_default(),
                }
                .push(ck.clone());
            }
            certs.push((ck, summary));
        }
        sni.managed = cfg.acme.as_ref().map(|a| Managed::new(a.domains.clone()));
        match certs.first() {
            None if sni.managed.is_none() => {
                return Err(format!("listener `{listener}`: no certificate"))
            }
            None => {}
            // The default: the first certificate, plus any other certificate
            // for its first name (its RSA/ECDSA twin).
            Some((first, first_summary)) => {
                sni.default = match first_summary.names.first() {
                    Some(n) => match n.strip_prefix("*.") {
                        Some(p) => sni.wild.get(p).cloned(),
                        None => sni.exact.get(n).cloned(),
                    }
                    .unwrap_or_else(|| vec![first.clone()]),
                    None => vec![first.clone()],
                };
            }
        }
        let managed = sni.managed.clone();
        let versions: &[&rustls::SupportedProtocolVersion] = match cfg.min_version {
            TlsVersion::Tls13 => &[&rustls::version::TLS13],
            TlsVersion::Tls12 => &[&rustls::version::TLS13, &rustls::version::TLS12],
        };
        let builder = ServerConfig::builder_with_provider(provider.clone())
            .with_protocol_versions(versions)
            .map_err(|e| format!("listener `{listener}`: {e}"))?;
        let sni = Arc::new(sni);
        let builder = match (&cfg.client_ca, cfg.client_auth) {
            (Some(ca), auth) if auth != ClientAuth::Off => {
                let roots =
                    Arc::new(roots_from(ca).map_err(|e| format!("listener `{listener}`: {e}"))?);
                let v = rustls::server::WebPkiClientVerifier::builder_with_provider(
                    roots,
                    provider.clone(),
                );
                let v = if auth == ClientAuth::Optional {
                    v.allow_unauthenticated()
                } else {
                    v
                };
                builder.with_client_cert_verifier(
                    v.build()
                        .map_err(|e| format!("listener `{listener}`: client_ca: {e}"))?,
                )
            }
            _ => builder.with_no_client_auth(),
        };
        let mut config = builder.with_cert_resolver(sni.clone() as Arc<dyn ResolvesServerCert>);
        config.alpn_protocols = cfg.alpn.iter().map(|a| a.as_bytes().to_vec()).collect();
        config.session_storage = if cfg.session_cache > 0 {
            rustls::server::ServerSessionMemoryCache::new(cfg.session_cache)
        } else {
            Arc::new(rustls::server::NoServerSessionStorage {})
        };
        if !cfg.session_ticket_keys.is_empty() {
            // Read again at every reload: that is how keys rotate.
            config.ticketer = Arc::new(crate::tickets::FileTicketer::from_files(
                &cfg.session_ticket_keys,
            )?);
        } else if cfg.session_tickets {
            config.ticketer = ticketer()?;
        }
        Ok(ServerTls {
            listener: listener.to_string(),
            config: Arc::new(config),
            managed,
            sni,
            refuse_unknown: cfg.unknown_sni == UnknownSni::Refuse,
            certs: certs.into_iter().map(|(_, s)| s).collect(),
            handshake_timeout: cfg.handshake_timeout,
            max_handshakes: cfg.max_handshakes,
            in_progress: AtomicUsize::new(0),
            max_pending_hellos: cfg.max_pending_hellos,
            pending_hellos: AtomicUsize::new(0),
            on_demand: OnceLock::new(),
        })
    }

    pub fn listener(&self) -> &str {
        &self.listener
    }

    /// The loaded certificates (names and expiry), in config order.
    pub fn certificates(&self) -> &[CertSummary] {
        &self.certs
    }

    pub fn config(&self) -> &Arc<ServerConfig> {
        &self.config
    }

    /// The slot of `[listener.tls.acme]`'s certificate, if it has one.
    pub fn managed(&self) -> Option<&Arc<Managed>> {
        self.managed.as_ref()
    }

    /// Serve names outside the certificates through `issuer` (once; a
    /// second call is ignored).
    pub fn set_on_demand(&self, issuer: Arc<dyn managed::OnDemand>) {
        let _ = self.on_demand.set(issuer);
    }

    /// Whether `max_pending_hellos` connections already wait for their
    /// ClientHello on this listener: the caller then makes room (evicts the
    /// oldest of them) or refuses the new one.
    pub fn hellos_full(&self) -> bool {
        self.pending_hellos.load(Relaxed) >= self.max_pending_hellos
    }

    /// Run the server handshake on an accepted connection, within
    /// `handshake_timeout`; every outcome is counted. Waiting for the
    /// ClientHello costs nothing but a socket, so it holds no handshake
    /// slot (a silent connection must not lock real clients out): a slot
    /// among `max_handshakes` is taken once the whole ClientHello is in,
    /// for the handshake's CPU work. `evicted` resolves when the caller
    /// wants the connection gone (the worker is full, or this listener has
    /// `max_pending_hellos` waiting): it is then closed, counted as
    /// `evicted`. `None`: the connection is done (refused, failed, or plain
    /// HTTP, which got a 400 as nginx gives).
    pub async fn accept<T: Transport>(
        &self,
        tcp: T,
        evicted: impl std::future::Future<Output = ()>,
    ) -> Option<Accepted<T>> {
        let r = tokio::select! {
            r = tokio::time::timeout(self.handshake_timeout, self.handshake(tcp)) => r,
            _ = evicted => Ok(Err(Failure::Evicted)),
        };
        match r {
            Err(_) => {
                stats().failure(Failure::Timeout);
                None
            }
            Ok(Err(f)) => {
                stats().failure(f);
                None
            }
            Ok(Ok(a)) => {
                stats().handshake(&a.1);
                Some(a)
            }
        }
    }

    async fn handshake<T: Transport>(&self, tcp: T) -> Result<Accepted<T>, Failure> {
        let start = {
            let _pending = Count::enter(&self.pending_hellos);
            self.client_hello(tcp).await?
        };
        if let Some(ck) = managed::challenge_for(&start.client_hello()) {
            return self.answer_challenge(start, ck).await;
        }
        // An on-demand name: its certificate (ordered at its first
        // handshake, which waits for it within `handshake_timeout`), served
        // through this listener's config with only the resolver replaced.
        let mut config = None;
        if let Some(od) = self.on_demand.get() {
            let name = start
                .client_hello()
                .server_name()
                .filter(|n| !self.sni.known(n))
                .map(|n| n.trim_end_matches('.').to_ascii_lowercase());
            if let Some(name) = name {
                let ck = match od.slot(&name).await {
                    Some(slot) => slot.wait().await,
                    None => None,
                };
                let ck = ck.ok_or(Failure::AcmeRefused)?;
                let mut c = (*self.config).clone();
                c.cert_resolver = Arc::new(Fixed(ck));
                config = Some(Arc::new(c));
            }
        }
        if self.refuse_unknown && config.is_none() {
            if let Some(name) = start.client_hello().server_name() {
                if !self.sni.known(name) {
                    return Err(Failure::UnknownSni);
                }
            }
        }
        // A slot among the handshakes in progress, released on every path.
        let _slot = Count::enter(&self.in_progress);
        if _slot.before >= self.max_handshakes {
            return Err(Failure::Overload);
        }
        let stream = start
            .into_stream(config.unwrap_or_else(|| self.config.clone()))
            .await
            .map_err(|e| Failure::of(&e))?;
        let info = info_of(stream.get_ref().1);
        Ok((stream, info))
    }

    /// A CA's TLS-ALPN-01 validation (RFC 8737): the handshake with the
    /// challenge certificate and `acme-tls/1`, then close; no HTTP.
    async fn answer_challenge<T: Transport>(
        &self,
        start: tokio_rustls::StartHandshake<T>,
        ck: Arc<CertifiedKey>,
    ) -> Result<Accepted<T>, Failure> {
        let mut config = ServerConfig::builder_with_provider(crate::provider())
            .with_protocol_versions(&[&rustls::version::TLS13, &rustls::version::TLS12])
            .map_err(|_| Failure::Other)?
            .with_no_client_auth()
            .with_cert_resolver(Arc::new(Fixed(ck)));
        config.alpn_protocols = vec![managed::ACME_TLS_ALPN.to_vec()];
        let mut stream = start
            .into_stream(Arc::new(config))
            .await
            .map_err(|e| Failure::of(&e))?;
        let _ = stream.shutdown().await;
        Err(Failure::AcmeChallenge)
    }

    /// Read up to the end of the ClientHello (rustls's `Acceptor` buffers
    /// it, however many records it spans, and does nothing else).
    async fn client_hello<T: Transport>(
        &self,
        mut tcp: T,
    ) -> Result<tokio_rustls::StartHandshake<T>, Failure> {
        let first = match tcp.peek_first().await {
            Ok(Some(b)) => b,
            Ok(None) | Err(_) => return Err(Failure::Closed),
        };
        // A TLS connection starts with a handshake record (type 22).
        if first != 0x16 {
            if first.is_ascii_uppercase() {
                // Plain HTTP on the TLS port: say so, as nginx does. Read
                // what arrived first, so closing does not reset the answer.
                let mut sink = [0u8; 2048];
                let _ = tcp.read(&mut sink).await;
                let _ = tcp.write_all(PLAIN_HTTP).await;
                let _ = tcp.shutdown().await;
            }
            return Err(Failure::NotTls);
        }
        LazyConfigAcceptor::new(rustls::server::Acceptor::default(), tcp)
            .await
            .map_err(|e| Failure::of(&e))
    }
}

/// One in a counter of connections (handshakes in progress, ClientHello
/// waits), given back however the future holding it ends.
struct Count<'a> {
    n: &'a AtomicUsize,
    /// The count before this one.
    before: usize,
}

impl<'a> Count<'a> {
    fn enter(n: &'a AtomicUsize) -> Self {
        let before = n.fetch_add(1, Relaxed);
        Count { n, before }
    }
}

impl Drop for Count<'_> {
    fn drop(&mut self) {
        self.n.fetch_sub(1, Relaxed);
    }
}

fn info_of(c: &ServerConnection) -> TlsInfo {
    TlsInfo {
        version: match c.protocol_version() {
            Some(ProtocolVersion::TLSv1_3) => "TLSv1.3",
            Some(ProtocolVersion::TLSv1_2) => "TLSv1.2",
            _ => "unknown",
        },
        cipher: c
            .negotiated_cipher_suite()
            .and_then(|s| s.suite().as_str())
            .unwrap_or("unknown"),
        sni: c.server_name().map(Box::from),
        alpn: c
            .alpn_protocol()
            .map(|a| String::from_utf8_lossy(a).into_owned().into_boxed_str()),
        client_subject: c
            .peer_certificates()
            .and_then(|certs| certs.first())
            .and_then(subject_of),
        resumed: c.handshake_kind() == Some(HandshakeKind::Resumed),
    }
}
