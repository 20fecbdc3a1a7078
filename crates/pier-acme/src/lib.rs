//! Certificates from an ACME CA (RFC 8555) for `[listener.tls.acme]`.
//!
//! [`manage`] gives a listener's [`Managed`] slot the certificate stored on
//! disk at once (so a restart serves without asking the CA), and makes sure
//! one manager runs for its names and directory. The manager, a thread with
//! its own single-threaded runtime (ACME is a few requests a month, not
//! worth a worker's time), orders a certificate when there is none or when
//! `renew_before` of its life is left, or when the CA's renewal window
//! (ARI, RFC 9773) opens, whichever is first: it answers the CA's
//! TLS-ALPN-01 validation (RFC 8737) on every TLS listener through
//! [`pier_tls::managed::add_challenge`], or its HTTP-01 validation (RFC 8555
//! §8.3) on every plain HTTP listener through
//! [`pier_tls::managed::add_http_challenge`], finalizes with a new P-256 key,
//! stores chain and key (`<storage>/<first domain>/`, key mode 0600) and
//! swaps the certificate into every slot for those names, so every worker
//! and a reloaded config serve it from their next handshake. A failed order
//! is retried after 1 minute, doubling to 6 hours (the CA's rate limits are
//! tight), and counted (`pier_acme_orders_total`); the certificate served
//! until then stays. An order has 10 minutes in all. Successful orders are
//! an hour apart at least. The account key is kept beside the certificates
//! and reused.
//!
//! `on_demand = true` ([`Issuer`]): a ClientHello naming a name outside the
//! listener's certificates has it approved by the `ask` URL (within
//! `on_demand_rate` new names a minute and `on_demand_max` names in all),
//! and the handshake waits for its certificate, which is then stored and
//! renewed like the others (Caddy's on-demand TLS).
//!
//! The protocol is instant-acme's; what is Pier's is when to ask, where to
//! keep it and how the listener serves it.

use instant_acme::{
    Account, AccountCredentials, AuthorizationStatus, CertificateIdentifier, ChallengeType,
    Identifier, NewAccount, NewOrder, OrderStatus, RetryPolicy,
};
use pier_config::{Acme, AcmeChallenge};
use pier_tls::{Managed, ServerTls};
use rustls::sign::CertifiedKey;
use std::collections::HashMap;
use std::future::Future;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::{Arc, Mutex, OnceLock, Weak};
use std::time::{Duration, SystemTime};

/// One manager per (directory, names): the listeners (and the reloaded
/// configs) that serve those names share its certificate.
struct Shared {
    users: Vec<Weak<Managed>>,
    current: Option<(Arc<CertifiedKey>, i64)>,
}

type Key = (String, Vec<String>);

fn registry() -> &'static Mutex<HashMap<Key, Arc<Mutex<Shared>>>> {
    static R: OnceLock<Mutex<HashMap<Key, Arc<Mutex<Shared>>>>> = OnceLock::new();
    R.get_or_init(Default::default)
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

fn unix_now() -> i64 {
    SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .map(|d| d.as_secs() as i64)
        .unwrap_or(0)
}

/// Where the certificate of `cfg` is kept.
fn cert_dir(cfg: &Acme) -> PathBuf {
    cfg.storage
        .join(cfg.domains.first().map(String::as_str).unwrap_or("_"))
}

/// The account of `cfg.directory`, one file per directory URL.
fn account_file(cfg: &Acme) -> PathBuf {
    let name: String = cfg
        .directory
        .trim_start_matches("https://")
        .chars()
        .map(|c| if c.is_ascii_alphanumeric() { c } else { '_' })
        .collect();
    cfg.storage.join(format!("account-{name}.json"))
}

/// The stored certificate, if it parses and names every domain asked for.
fn load_stored(cfg: &Acme) -> Option<(Arc<CertifiedKey>, i64)> {
    let dir = cert_dir(cfg);
    let chain = std::fs::read_to_string(dir.join("cert.pem")).ok()?;
    let key = std::fs::read_to_string(dir.join("key.pem")).ok()?;
    match pier_tls::certified_key_from_pem(&chain, &key) {
        Ok(c) => Some(c),
        Err(e) => {
            tracing::warn!("acme: stored certificate in {}: {e}", dir.display());
            None
        }
    }
}

/// A listener's `[listener.tls.acme]`: the certificate for its `domains`
/// (see [`manage`]) and, with `on_demand = true`, an [`Issuer`] for the
/// names a ClientHello asks for.
pub fn manage_listener(tls: &ServerTls, cfg: &Acme) {
    if let Some(slot) = tls.managed().filter(|_| !cfg.domains.is_empty()) {
        manage(slot, cfg);
    }
    if cfg.on_demand.is_some() {
        tls.set_on_demand(Arc::new(Issuer::new(cfg)));
    }
}

/// Serve `slot` the certificate of `cfg` (stored, or the manager's), and
/// have a manager obtain and renew it. Called for each listener with
/// `[listener.tls.acme]` when it is built (start and every reload).
pub fn manage(slot: &Arc<Managed>, cfg: &Acme) {
    let key = (cfg.directory.clone(), cfg.domains.clone());
    let mut reg = lock(registry());
    if let Some(shared) = reg.get(&key) {
        let mut s = lock(shared);
        s.users.retain(|w| w.strong_count() > 0);
        s.users.push(Arc::downgrade(slot));
        if let Some((ck, t)) = &s.current {
            slot.set(ck.clone(), *t);
        }
        if !s.users.is_empty() {
            return;
        }
    }
    let current = load_stored(cfg);
    if let Some((ck, t)) = &current {
        slot.set(ck.clone(), *t);
    }
    let shared = Arc::new(Mutex::new(Shared {
        users: vec![Arc::downgrade(slot)],
        current,
    }));
    reg.insert(key.clone(), shared.clone());
    drop(reg);
    let cfg = cfg.clone();
    let spawned = std::thread::Builder::new()
        .name("pier-acme".into())
        .spawn(move || run(key, shared, cfg));
    if let Err(e) = spawned {
        tracing::error!("acme: cannot start its thread: {e}");
    }
}

/// After `failures` failed orders in a row (≥ 1): 1 minute doubling to 6 hours.
fn backoff(failures: u32) -> Duration {
    Duration::from_secs((60u64 << failures.saturating_sub(1).min(9)).min(6 * 3600))
}

/// When to order: now without a certificate, else `renew_before` ahead of
/// its expiry.
fn renew_at(cfg: &Acme, not_after: Option<i64>) -> i64 {
    match not_after {
        None => 0,
        Some(t) => t - cfg.renew_before.as_secs() as i64,
    }
}

/// An order has this long, start to finish (a CA that stops answering
/// mid-order must not stall renewals forever).
const ORDER_DEADLINE: Duration = Duration::from_secs(600);

/// The CA's renewal window (ARI) of the certificate served, as last asked.
struct Ari {
    /// When to ask again (Unix seconds); `i64::MAX`: the CA has no ARI.
    check_at: i64,
    /// When to renew within the window, if asked.
    renew_at: Option<i64>,
    /// The certificate's ARI identifier, for the renewal order's `replaces`.
    id: Option<CertificateIdentifier<'static>>,
}

/// A time within [start, end] (RFC 9773 §4.2: uniformly random, so a
/// fleet's renewals spread), or now if the window has passed.
fn pick_in_window(start: i64, end: i64, now: i64, noise: u64) -> i64 {
    if end <= now {
        return now;
    }
    let span = (end - start).max(0) as u64;
    start + (noise % (span + 1)) as i64
}

fn noise() -> u64 {
    SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .map(|d| d.subsec_nanos() as u64 ^ d.as_secs().rotate_left(17))
        .unwrap_or(0)
}

/// Ask the CA for the renewal window of `leaf`: when to renew, the
/// certificate's identifier, when to ask again. `Err(None)`: the CA has no
/// ARI.
async fn renewal_window(
    cfg: &Acme,
    leaf: &rustls::pki_types::CertificateDer<'_>,
) -> Result<(i64, CertificateIdentifier<'static>, Duration), Option<String>> {
    let id = CertificateIdentifier::try_from(leaf)
        .map_err(Some)?
        .into_owned();
    let account = account(cfg).await.map_err(Some)?;
    let (info, retry) = match account.renewal_info(&id).await {
        Ok(r) => r,
        Err(instant_acme::Error::Unsupported(_)) => return Err(None),
        Err(e) => return Err(Some(e.to_string())),
    };
    let w = info.suggested_window;
    let at = pick_in_window(
        w.start.unix_timestamp(),
        w.end.unix_timestamp(),
        unix_now(),
        noise(),
    );
    Ok((at, id, retry))
}

fn run(key: Key, shared: Arc<Mutex<Shared>>, cfg: Acme) {
    let rt = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            tracing::error!("acme: runtime: {e}");
            return;
        }
    };
    let name = cfg.domains.join(", ");
    let mut failures = 0u32;
    // Not two orders within an hour: a `renew_before` longer than the CA's
    // certificates live would otherwise order again at once, forever.
    let mut earliest = 0i64;
    let mut ari = Ari {
        check_at: if cfg.ari { 0 } else { i64::MAX },
        renew_at: None,
        id: None,
    };
    loop {
        let due = {
            let mut s = lock(&shared);
            s.users.retain(|w| w.strong_count() > 0);
            (!s.users.is_empty()).then(|| {
                (
                    renew_at(&cfg, s.current.as_ref().map(|c| c.1)),
                    s.current.as_ref().map(|c| c.0.cert[0].clone()),
                )
            })
        };
        let Some((due, leaf)) = due else {
            // No listener serves these names any more (a reload dropped
            // them): this manager ends, unless one registered meanwhile.
            // Locks in `manage`'s order (registry, then names).
            let mut reg = lock(registry());
            let s = lock(&shared);
            if s.users.iter().all(|w| w.strong_count() == 0) {
                if reg.get(&key).is_some_and(|r| Arc::ptr_eq(r, &shared)) {
                    reg.remove(&key);
                }
                return;
            }
            continue;
        };
        let now = unix_now();
        if let Some(leaf) = leaf.as_ref().filter(|_| now >= ari.check_at) {
            let asked = rt.block_on(async {
                tokio::time::timeout(Duration::from_secs(60), renewal_window(&cfg, leaf)).await
            });
            match asked {
                Ok(Ok((at, id, retry))) => {
                    // Asked again when the CA says (within a minute and a day).
                    ari.check_at = now + retry.as_secs().clamp(60, 86_400) as i64;
                    if ari.renew_at != Some(at) {
                        tracing::info!(
                            "acme: {name}: the CA's renewal window says renew at {at} (Unix time)"
                        );
                    }
                    ari.renew_at = Some(at);
                    ari.id = Some(id);
                }
                Ok(Err(None)) => ari.check_at = i64::MAX,
                Ok(Err(Some(e))) => {
                    tracing::warn!("acme: {name}: renewal window: {e}");
                    ari.check_at = now + 3600;
                }
                Err(_) => {
                    tracing::warn!("acme: {name}: renewal window: no answer within 60 s");
                    ari.check_at = now + 3600;
                }
            }
        }
        let due = due.min(ari.renew_at.unwrap_or(i64::MAX)).max(earliest);
        if now < due {
            // Woken each minute to notice a dropped listener.
            let wake = (due - now).min(60).min((ari.check_at - now).max(1));
            std::thread::sleep(Duration::from_secs(wake as u64));
            continue;
        }
        let replaces = ari.id.take();
        let ordered = rt
            .block_on(async { tokio::time::timeout(ORDER_DEADLINE, obtain(&cfg, replaces)).await });
        match ordered.unwrap_or_else(|_| Err("no certificate within 10 minutes".into())) {
            Ok((ck, not_after)) => {
                pier_tls::managed::count_order(true);
                failures = 0;
                earliest = unix_now() + 3600;
                // The new certificate's window is asked for at once.
                ari.renew_at = None;
                if ari.check_at != i64::MAX {
                    ari.check_at = 0;
                }
                tracing::info!(
                    "acme: certificate for {name} issued, valid until {not_after} (Unix time)"
                );
                let mut s = lock(&shared);
                for u in s.users.iter().filter_map(Weak::upgrade) {
                    u.set(ck.clone(), not_after);
                }
                s.current = Some((ck, not_after));
            }
            Err(e) => {
                pier_tls::managed::count_order(false);
                failures += 1;
                let wait = backoff(failures);
                tracing::warn!(
                    "acme: certificate for {name} from {}: {e}; trying again in {}s",
                    cfg.directory,
                    wait.as_secs()
                );
                for u in lock(&shared).users.iter().filter_map(Weak::upgrade) {
                    u.failed();
                }
                std::thread::sleep(wait);
            }
        }
    }
}

/// The challenge answers of an order (TLS-ALPN-01 names, HTTP-01 tokens),
/// withdrawn however it ends.
#[derive(Default)]
struct Challenges {
    names: Vec<String>,
    tokens: Vec<String>,
}

impl Drop for Challenges {
    fn drop(&mut self) {
        for n in &self.names {
            pier_tls::managed::remove_challenge(n);
        }
        for t in &self.tokens {
            pier_tls::managed::remove_http_challenge(t);
        }
    }
}

async fn account(cfg: &Acme) -> Result<Account, String> {
    // instant-acme's client builds its rustls config on the process's default
    // provider: Pier's own, installed once (an error means one is set).
    let _ = rustls::crypto::CryptoProvider::install_default((*pier_tls::provider()).clone());
    let builder = || match &cfg.directory_ca {
        Some(ca) => Account::builder_with_root(ca).map_err(|e| format!("{}: {e}", ca.display())),
        None => Account::builder().map_err(|e| e.to_string()),
    };
    let file = account_file(cfg);
    if let Ok(text) = std::fs::read_to_string(&file) {
        match serde_json::from_str::<AccountCredentials>(&text) {
            Ok(creds) => {
                return builder()?
                    .from_credentials(creds)
                    .await
                    .map_err(|e| format!("account {}: {e}", file.display()))
            }
            Err(e) => tracing::warn!("acme: {}: {e}; making a new account", file.display()),
        }
    }
    let contact = cfg.email.as_ref().map(|e| format!("mailto:{e}"));
    let contacts: Vec<&str> = contact.iter().map(String::as_str).collect();
    let (account, creds) = builder()?
        .create(
            &NewAccount {
                contact: &contacts,
                terms_of_service_agreed: true,
                only_return_existing: false,
            },
            cfg.directory.clone(),
            None,
        )
        .await
        .map_err(|e| format!("new account: {e}"))?;
    let text = serde_json::to_string(&creds).map_err(|e| e.to_string())?;
    write_private(&file, text.as_bytes())?;
    Ok(account)
}

/// One order, start to finish: the certificate and its notAfter.
/// `replaces`: the certificate it renews, for a CA with ARI.
async fn obtain(
    cfg: &Acme,
    replaces: Option<CertificateIdentifier<'static>>,
) -> Result<(Arc<CertifiedKey>, i64), String> {
    let account = account(cfg).await?;
    let ids: Vec<Identifier> = cfg.domains.iter().cloned().map(Identifier::Dns).collect();
    let mut order = match replaces {
        Some(r) => match account.new_order(&NewOrder::new(&ids).replaces(r)).await {
            Ok(o) => o,
            // A CA may refuse the hint (the certificate already replaced):
            // a plain order is as good.
            Err(e) => {
                tracing::info!("acme: order replacing the current certificate: {e}; ordering anew");
                account
                    .new_order(&NewOrder::new(&ids))
                    .await
                    .map_err(|e| format!("new order: {e}"))?
            }
        },
        None => account
            .new_order(&NewOrder::new(&ids))
            .await
            .map_err(|e| format!("new order: {e}"))?,
    };
    let mut answering = Challenges::default();
    let kind = match cfg.challenge {
        AcmeChallenge::TlsAlpn01 => ChallengeType::TlsAlpn01,
        AcmeChallenge::Http01 => ChallengeType::Http01,
    };
    {
        let mut authzs = order.authorizations();
        while let Some(a) = authzs.next().await {
            let mut a = a.map_err(|e| format!("authorization: {e}"))?;
            match a.status {
                AuthorizationStatus::Valid => continue,
                AuthorizationStatus::Pending => {}
                s => return Err(format!("authorization is {s:?}")),
            }
            let mut ch = a
                .challenge(kind.clone())
                .ok_or_else(|| format!("the CA offers no {kind:?} challenge"))?;
            let Identifier::Dns(name) = ch.identifier().identifier.clone() else {
                return Err("an identifier that is not a DNS name".into());
            };
            match cfg.challenge {
                AcmeChallenge::TlsAlpn01 => {
                    let digest = ch.key_authorization().digest();
                    pier_tls::managed::add_challenge(
                        &name,
                        challenge_cert(&name, digest.as_ref())?,
                    );
                    answering.names.push(name);
                }
                AcmeChallenge::Http01 => {
                    let token = ch.token.clone();
                    pier_tls::managed::add_http_challenge(&token, ch.key_authorization().as_str());
                    answering.tokens.push(token);
                }
            }
            ch.set_ready()
                .await
                .map_err(|e| format!("challenge ready: {e}"))?;
        }
    }
    let retry = RetryPolicy::default();
    match order.poll_ready(&retry).await {
        Ok(OrderStatus::Ready) => {}
        Ok(s) => return Err(format!("order is {s:?} (validation failed?)")),
        Err(e) => return Err(format!("order: {e}")),
    }
    drop(answering);
    let key = rcgen::KeyPair::generate().map_err(|e| e.to_string())?;
    let mut params =
        rcgen::CertificateParams::new(cfg.domains.clone()).map_err(|e| e.to_string())?;
    params.distinguished_name = rcgen::DistinguishedName::new();
    let csr = params.serialize_request(&key).map_err(|e| e.to_string())?;
    order
        .finalize_csr(csr.der())
        .await
        .map_err(|e| format!("finalize: {e}"))?;
    let chain = order
        .poll_certificate(&retry)
        .await
        .map_err(|e| format!("certificate: {e}"))?;
    let key_pem = key.serialize_pem();
    let (ck, not_after) = pier_tls::certified_key_from_pem(&chain, &key_pem)?;
    let dir = cert_dir(cfg);
    write_private(&dir.join("key.pem"), key_pem.as_bytes())?;
    write_private(&dir.join("cert.pem"), chain.as_bytes())?;
    Ok((ck, not_after))
}

/// The self-signed certificate of a TLS-ALPN-01 answer: the name as its one
/// SAN and the key authorization's SHA-256 in a critical acmeIdentifier.
fn challenge_cert(name: &str, digest: &[u8]) -> Result<Arc<CertifiedKey>, String> {
    let key = rcgen::KeyPair::generate().map_err(|e| e.to_string())?;
    let mut p = rcgen::CertificateParams::new(vec![name.to_string()]).map_err(|e| e.to_string())?;
    p.custom_extensions = vec![rcgen::CustomExtension::new_acme_identifier(digest)];
    let cert = p.self_signed(&key).map_err(|e| e.to_string())?;
    // Not CertifiedKey::from_der: its consistency check parses the
    // certificate with webpki, which refuses the critical acmeIdentifier.
    let der = rustls::pki_types::PrivateKeyDer::Pkcs8(key.serialize_der().into());
    let signing = pier_tls::provider()
        .key_provider
        .load_private_key(der)
        .map_err(|e| e.to_string())?;
    Ok(Arc::new(CertifiedKey::new(
        vec![cert.der().clone()],
        signing,
    )))
}

/// On-demand certificates for one listener (`on_demand = true`): the names
/// approved so far, each with its slot and its manager (as a `domains` name
/// has), and the rate at which new names are asked about.
pub struct Issuer {
    template: Acme,
    ask: String,
    per_minute: u32,
    max: usize,
    names: Mutex<HashMap<String, Arc<Managed>>>,
    /// The rate's theoretical arrival time (GCRA), Unix milliseconds.
    window: Mutex<i64>,
}

impl Issuer {
    pub fn new(cfg: &Acme) -> Issuer {
        let od = cfg.on_demand.clone().unwrap_or(pier_config::OnDemand {
            ask: String::new(),
            per_minute: 0,
            max: 0,
        });
        Issuer {
            template: cfg.clone(),
            ask: od.ask,
            per_minute: od.per_minute,
            max: od.max,
            names: Mutex::new(HashMap::new()),
            window: Mutex::new(0),
        }
    }

    async fn decide(&self, name: &str) -> Option<Arc<Managed>> {
        use pier_tls::managed::count_on_demand;
        const APPROVED: usize = 0;
        const REFUSED: usize = 1;
        const RATE_LIMITED: usize = 2;
        const FULL: usize = 3;
        const ASK_FAILED: usize = 4;
        if let Some(m) = lock(&self.names).get(name) {
            return Some(m.clone());
        }
        // Anyone can send any SNI: what is not a DNS name is not asked about.
        if pier_config::acme_domain(name).as_deref() != Ok(name) {
            count_on_demand(REFUSED);
            return None;
        }
        if lock(&self.names).len() >= self.max {
            count_on_demand(FULL);
            return None;
        }
        if !admit(&mut lock(&self.window), self.per_minute, unix_ms()) {
            count_on_demand(RATE_LIMITED);
            return None;
        }
        match ask(&self.ask, name).await {
            Ok(true) => {}
            Ok(false) => {
                count_on_demand(REFUSED);
                return None;
            }
            Err(e) => {
                tracing::warn!("acme: on-demand {name}: ask {}: {e}", self.ask);
                count_on_demand(ASK_FAILED);
                return None;
            }
        }
        let mut names = lock(&self.names);
        if let Some(m) = names.get(name) {
            return Some(m.clone());
        }
        if names.len() >= self.max {
            count_on_demand(FULL);
            return None;
        }
        let slot = Managed::new(vec![name.to_string()]);
        let mut cfg = self.template.clone();
        cfg.domains = vec![name.to_string()];
        manage(&slot, &cfg);
        names.insert(name.to_string(), slot.clone());
        count_on_demand(APPROVED);
        tracing::info!("acme: on-demand {name}: approved by {}", self.ask);
        Some(slot)
    }
}

impl pier_tls::managed::OnDemand for Issuer {
    fn slot<'a>(
        &'a self,
        name: &'a str,
    ) -> Pin<Box<dyn Future<Output = Option<Arc<Managed>>> + Send + 'a>> {
        Box::pin(self.decide(name))
    }
}

/// GCRA for `per_minute` new names a minute with a burst of as many: true
/// if one more is admitted at `now_ms` (and it is counted).
fn admit(tat: &mut i64, per_minute: u32, now_ms: i64) -> bool {
    let interval = 60_000 / i64::from(per_minute.max(1));
    let burst = interval * (i64::from(per_minute.max(1)) - 1);
    if *tat - now_ms > burst {
        return false;
    }
    *tat = (*tat).max(now_ms) + interval;
    true
}

fn unix_ms() -> i64 {
    SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .map(|d| d.as_millis() as i64)
        .unwrap_or(0)
}

/// `GET <ask>?domain=NAME` (Caddy's question): a 2xx approves. Bounded by
/// 5 seconds in all; only the status line is read.
async fn ask(url: &str, name: &str) -> Result<bool, String> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let u = pier_http::url::parse_http(url, 80, "/")?;
    let (hostport, path, addr) = (u.authority, &*u.path, &*u.connect);
    let sep = if path.contains('?') { '&' } else { '?' };
    // `name` is a checked DNS name: nothing in it needs escaping.
    let request = format!(
        "GET {path}{sep}domain={name} HTTP/1.0\r\nHost: {hostport}\r\nUser-Agent: pier\r\nConnection: close\r\n\r\n"
    );
    let exchange = async {
        let mut s = tokio::net::TcpStream::connect(addr)
            .await
            .map_err(|e| e.to_string())?;
        s.write_all(request.as_bytes())
            .await
            .map_err(|e| e.to_string())?;
        let mut buf = Vec::with_capacity(256);
        let mut chunk = [0u8; 256];
        while !buf.contains(&b'\n') && buf.len() < 4096 {
            let n = s.read(&mut chunk).await.map_err(|e| e.to_string())?;
            if n == 0 {
                break;
            }
            buf.extend_from_slice(&chunk[..n]);
        }
        // "HTTP/1.1 200 OK"
        let line = buf.split(|&b| b == b'\n').next().unwrap_or(&[]);
        let mut parts = line.split(|&b| b == b' ');
        let version = parts.next().unwrap_or(&[]);
        let code = parts
            .next()
            .and_then(|c| std::str::from_utf8(c).ok())
            .and_then(|c| c.trim().parse::<u16>().ok());
        match code {
            Some(c) if version.starts_with(b"HTTP/") => Ok((200..300).contains(&c)),
            _ => Err("not an HTTP answer".to_string()),
        }
    };
    tokio::time::timeout(Duration::from_secs(5), exchange)
        .await
        .map_err(|_| "no answer within 5 s".to_string())?
}

/// Write a file only its owner reads (mode 0600, its directory 0700),
/// through a temporary name, so a crash leaves the old one whole.
fn write_private(path: &Path, data: &[u8]) -> Result<(), String> {
    use std::io::Write;
    use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
    let err = |e: std::io::Error| format!("{}: {e}", path.display());
    if let Some(dir) = path.parent() {
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(dir)
            .map_err(err)?;
    }
    let tmp = path.with_extension("tmp");
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(&tmp)
        .map_err(err)?;
    f.write_all(data).map_err(err)?;
    f.sync_all().map_err(err)?;
    std::fs::rename(&tmp, path).map_err(err)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg() -> Acme {
        Acme {
            domains: vec!["a.example".into(), "b.example".into()],
            email: None,
            directory: "https://acme.example:14000/dir".into(),
            directory_ca: None,
            storage: PathBuf::from("/var/lib/pier/acme"),
            renew_before: Duration::from_secs(30 * 86_400),
            challenge: AcmeChallenge::TlsAlpn01,
            ari: true,
            on_demand: None,
        }
    }

    #[test]
    fn on_demand_names_are_admitted_at_the_rate_with_a_burst() {
        let mut tat = 0;
        let t0 = 1_000_000;
        assert!((0..3).all(|_| admit(&mut tat, 3, t0)));
        assert!(!admit(&mut tat, 3, t0));
        assert!(!admit(&mut tat, 3, t0 + 19_999));
        assert!(admit(&mut tat, 3, t0 + 20_000));
        assert!(!admit(&mut tat, 3, t0 + 20_000));
        let mut tat = 0;
        assert!(admit(&mut tat, 1, t0));
        assert!(!admit(&mut tat, 1, t0 + 59_999));
        assert!(admit(&mut tat, 1, t0 + 60_000));
    }

    #[test]
    fn a_renewal_window_is_sampled_within_and_a_past_one_is_now() {
        assert_eq!(pick_in_window(100, 200, 50, 0), 100);
        assert_eq!(pick_in_window(100, 200, 50, 100), 200);
        assert_eq!(pick_in_window(100, 200, 50, 101), 100);
        for n in 0..1000 {
            let t = pick_in_window(100, 200, 150, n * 7919);
            assert!((100..=200).contains(&t));
        }
        assert_eq!(pick_in_window(10, 20, 500, 3), 500);
        assert_eq!(pick_in_window(10, 20, 20, 3), 20);
    }

    #[test]
    fn schedule_and_paths() {
        let c = cfg();
        assert_eq!(renew_at(&c, None), 0);
        assert_eq!(renew_at(&c, Some(90 * 86_400)), 60 * 86_400);
        let b: Vec<u64> = (1..=11).map(|f| backoff(f).as_secs()).collect();
        assert_eq!(
            b,
            [60, 120, 240, 480, 960, 1920, 3840, 7680, 15360, 21600, 21600]
        );
        assert_eq!(cert_dir(&c), PathBuf::from("/var/lib/pier/acme/a.example"));
        assert_eq!(
            account_file(&c),
            PathBuf::from("/var/lib/pier/acme/account-acme_example_14000_dir.json")
        );
    }

    #[test]
    fn challenge_certificate_names_the_domain_and_carries_the_digest() {
        let ck = challenge_cert("a.example", &[7u8; 32]).unwrap();
        let (_, cert) = x509_parser::parse_x509_certificate(&ck.cert[0]).unwrap();
        let san = cert.subject_alternative_name().unwrap().unwrap();
        assert_eq!(san.value.general_names.len(), 1);
        let ext = cert
            .extensions()
            .iter()
            .find(|e| e.oid.to_id_string() == "1.3.6.1.5.5.7.1.31")
            .expect("acmeIdentifier");
        assert!(ext.critical);
        // OCTET STRING of the 32-byte digest.
        assert_eq!(&ext.value[..2], &[0x04, 32]);
        assert_eq!(&ext.value[2..], &[7u8; 32]);
    }
}
