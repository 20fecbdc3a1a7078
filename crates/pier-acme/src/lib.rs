//! Certificates from an ACME CA (RFC 8555) for `[listener.tls.acme]`.
//!
//! [`manage`] gives a listener's [`Managed`] slot the certificate stored on
//! disk at once (so a restart serves without asking the CA), and makes sure
//! one manager runs for its names and directory. The manager, a thread with
//! its own single-threaded runtime (ACME is a few requests a month, not
//! worth a worker's time), orders a certificate when there is none or when
//! `renew_before` of its life is left: it answers the CA's TLS-ALPN-01
//! validation (RFC 8737) on every TLS listener through
//! [`pier_tls::managed::add_challenge`], finalizes with a new P-256 key,
//! stores chain and key (`<storage>/<first domain>/`, key mode 0600) and
//! swaps the certificate into every slot for those names, so every worker
//! and a reloaded config serve it from their next handshake. A failed order
//! is retried after 1 minute, doubling to 6 hours (the CA's rate limits are
//! tight), and counted (`pier_acme_orders_total`); the certificate served
//! until then stays. Successful orders are an hour apart at least. The
//! account key is kept beside the certificates and reused.
//!
//! The protocol is instant-acme's; what is Pier's is when to ask, where to
//! keep it and how the listener serves it.

use instant_acme::{
    Account, AccountCredentials, AuthorizationStatus, ChallengeType, Identifier, NewAccount,
    NewOrder, OrderStatus, RetryPolicy,
};
use pier_config::Acme;
use pier_tls::Managed;
use rustls::sign::CertifiedKey;
use std::collections::HashMap;
use std::path::{Path, PathBuf};
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
    loop {
        let due = {
            let mut s = lock(&shared);
            s.users.retain(|w| w.strong_count() > 0);
            (!s.users.is_empty()).then(|| renew_at(&cfg, s.current.as_ref().map(|c| c.1)))
        };
        let Some(due) = due else {
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
        let due = due.max(earliest);
        let now = unix_now();
        if now < due {
            // Woken each minute to notice a dropped listener.
            std::thread::sleep(Duration::from_secs((due - now).min(60) as u64));
            continue;
        }
        match rt.block_on(obtain(&cfg)) {
            Ok((ck, not_after)) => {
                pier_tls::managed::count_order(true);
                failures = 0;
                earliest = unix_now() + 3600;
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
                std::thread::sleep(wait);
            }
        }
    }
}

/// The challenge certificates of an order, withdrawn however it ends.
struct Challenges(Vec<String>);

impl Drop for Challenges {
    fn drop(&mut self) {
        for n in &self.0 {
            pier_tls::managed::remove_challenge(n);
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
async fn obtain(cfg: &Acme) -> Result<(Arc<CertifiedKey>, i64), String> {
    let account = account(cfg).await?;
    let ids: Vec<Identifier> = cfg.domains.iter().cloned().map(Identifier::Dns).collect();
    let mut order = account
        .new_order(&NewOrder::new(&ids))
        .await
        .map_err(|e| format!("new order: {e}"))?;
    let mut answering = Challenges(Vec::new());
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
                .challenge(ChallengeType::TlsAlpn01)
                .ok_or("the CA offers no tls-alpn-01 challenge")?;
            let Identifier::Dns(name) = ch.identifier().identifier.clone() else {
                return Err("an identifier that is not a DNS name".into());
            };
            let digest = ch.key_authorization().digest();
            pier_tls::managed::add_challenge(&name, challenge_cert(&name, digest.as_ref())?);
            answering.0.push(name);
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
        }
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
