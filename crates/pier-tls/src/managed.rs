//! Certificates Pier obtains itself (`[listener.tls.acme]`): the slot a
//! listener serves them from, swapped in place when one is issued or
//! renewed, and the TLS-ALPN-01 challenge certificates (RFC 8737) a CA's
//! validation is answered with. The ACME protocol itself is `pier-acme`'s;
//! this is the part the handshake reads.

use arc_swap::ArcSwapOption;
use rustls::sign::CertifiedKey;
use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicI64, AtomicU64, AtomicUsize, Ordering::Relaxed};
use std::sync::{Arc, Mutex, OnceLock};

/// One listener's managed certificate: empty until the first is issued
/// (handshakes for its names fail until then, as Caddy's do).
pub struct Managed {
    /// Lower-case DNS names, as configured.
    pub domains: Vec<String>,
    current: ArcSwapOption<CertifiedKey>,
    /// notAfter of the current certificate, Unix seconds (0: none).
    not_after: AtomicI64,
    /// Orders for these names that failed, and the handshakes waiting for
    /// the first certificate (on-demand names) woken by either outcome.
    failures: AtomicU64,
    ready: tokio::sync::Notify,
}

impl std::fmt::Debug for Managed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Managed")
            .field("domains", &self.domains)
            .field("not_after", &self.not_after())
            .finish()
    }
}

/// Every managed slot alive, for the expiry gauge.
static ALL: Mutex<Vec<std::sync::Weak<Managed>>> = Mutex::new(Vec::new());

/// Orders that gave a certificate, and those that did not.
static ORDERS: [std::sync::atomic::AtomicU64; 2] = [
    std::sync::atomic::AtomicU64::new(0),
    std::sync::atomic::AtomicU64::new(0),
];

/// Count an ACME order's outcome (`pier-acme` calls it).
pub fn count_order(ok: bool) {
    ORDERS[!ok as usize].fetch_add(1, Relaxed);
}

/// `pier_acme_*` metrics, Prometheus text.
pub(crate) fn render(out: &mut String) {
    use std::fmt::Write as _;
    let _ = writeln!(
        out,
        "# TYPE pier_acme_orders_total counter\npier_acme_orders_total{{result=\"ok\"}} {}\npier_acme_orders_total{{result=\"failed\"}} {}",
        ORDERS[0].load(Relaxed),
        ORDERS[1].load(Relaxed)
    );
    let mut all = ALL.lock().unwrap_or_else(|e| e.into_inner());
    all.retain(|w| w.strong_count() > 0);
    let mut seen: Vec<(String, i64)> = Vec::new();
    for m in all.iter().filter_map(std::sync::Weak::upgrade) {
        let Some(name) = m.domains.first() else {
            continue;
        };
        match seen.iter_mut().find(|(n, _)| n == name) {
            Some(s) => s.1 = s.1.max(m.not_after()),
            None => seen.push((name.clone(), m.not_after())),
        }
    }
    drop(all);
    out.push_str("# TYPE pier_acme_on_demand_total counter\n");
    for (name, c) in ON_DEMAND_RESULTS.iter().zip(&ON_DEMAND) {
        let _ = writeln!(
            out,
            "pier_acme_on_demand_total{{result=\"{name}\"}} {}",
            c.load(Relaxed)
        );
    }
    out.push_str("# TYPE pier_acme_certificate_expiry_seconds gauge\n");
    for (name, t) in seen {
        let _ = writeln!(
            out,
            "pier_acme_certificate_expiry_seconds{{name=\"{name}\"}} {t}"
        );
    }
}

impl Managed {
    pub fn new(domains: Vec<String>) -> Arc<Managed> {
        let m = Arc::new(Managed {
            domains,
            current: ArcSwapOption::empty(),
            not_after: AtomicI64::new(0),
            failures: AtomicU64::new(0),
            ready: tokio::sync::Notify::new(),
        });
        let mut all = ALL.lock().unwrap_or_else(|e| e.into_inner());
        all.retain(|w| w.strong_count() > 0);
        all.push(Arc::downgrade(&m));
        m
    }

    /// Serve `ck` from the next handshake on.
    pub fn set(&self, ck: Arc<CertifiedKey>, not_after: i64) {
        self.current.store(Some(ck));
        self.not_after.store(not_after, Relaxed);
        self.ready.notify_waiters();
    }

    /// An order for these names failed (`pier-acme` calls it).
    pub fn failed(&self) {
        self.failures.fetch_add(1, Relaxed);
        self.ready.notify_waiters();
    }

    /// The certificate, once there is one: `None` if the order for it
    /// failed (now or before: a name in backoff does not hold handshakes).
    /// The caller bounds the wait (the handshake's timeout).
    pub async fn wait(&self) -> Option<Arc<CertifiedKey>> {
        loop {
            let notified = self.ready.notified();
            tokio::pin!(notified);
            // Registered before the checks, so a `set` between them wakes it.
            notified.as_mut().enable();
            if let Some(ck) = self.get() {
                return Some(ck);
            }
            if self.failures.load(Relaxed) > 0 {
                return None;
            }
            notified.await;
        }
    }

    pub fn get(&self) -> Option<Arc<CertifiedKey>> {
        self.current.load_full()
    }

    /// notAfter of the certificate served now (0: none yet).
    pub fn not_after(&self) -> i64 {
        self.not_after.load(Relaxed)
    }
}

/// Names outside a listener's `domains` asked for by a ClientHello
/// (`on_demand = true`): `pier-acme` approves them (the `ask` URL, the
/// rate) and orders their certificates.
pub trait OnDemand: Send + Sync {
    /// The slot serving `name` (lower-case, without a trailing dot), or
    /// `None` if it is not to have one.
    fn slot<'a>(
        &'a self,
        name: &'a str,
    ) -> Pin<Box<dyn Future<Output = Option<Arc<Managed>>> + Send + 'a>>;
}

/// What became of on-demand names: `approved`, `refused` (by the ask URL,
/// or not a DNS name), `rate_limited`, `full` (`on_demand_max` held),
/// `ask_failed` (the URL did not answer).
pub const ON_DEMAND_RESULTS: [&str; 5] =
    ["approved", "refused", "rate_limited", "full", "ask_failed"];

static ON_DEMAND: [AtomicU64; 5] = [
    AtomicU64::new(0),
    AtomicU64::new(0),
    AtomicU64::new(0),
    AtomicU64::new(0),
    AtomicU64::new(0),
];

/// Count an on-demand decision, by its index in [`ON_DEMAND_RESULTS`].
pub fn count_on_demand(result: usize) {
    if let Some(c) = ON_DEMAND.get(result) {
        c.fetch_add(1, Relaxed);
    }
}

/// HTTP-01 answers (RFC 8555 §8.3): token → key authorization.
fn http_challenges() -> &'static Mutex<HashMap<String, String>> {
    static C: OnceLock<Mutex<HashMap<String, String>>> = OnceLock::new();
    C.get_or_init(Default::default)
}

/// How many HTTP-01 answers are up: the request path reads this one
/// atomic, not the lock, while no order runs.
static HTTP_PENDING: AtomicUsize = AtomicUsize::new(0);

/// The prefix of HTTP-01 validation requests.
pub const HTTP_CHALLENGE_PREFIX: &[u8] = b"/.well-known/acme-challenge/";

/// Answer `GET /.well-known/acme-challenge/<token>` with `key_authorization`
/// on every plain HTTP listener until [`remove_http_challenge`].
pub fn add_http_challenge(token: &str, key_authorization: &str) {
    let mut g = http_challenges().lock().unwrap_or_else(|e| e.into_inner());
    g.insert(token.to_string(), key_authorization.to_string());
    HTTP_PENDING.store(g.len(), Relaxed);
}

pub fn remove_http_challenge(token: &str) {
    let mut g = http_challenges().lock().unwrap_or_else(|e| e.into_inner());
    g.remove(token);
    HTTP_PENDING.store(g.len(), Relaxed);
}

/// The key authorization for a request to `path`, if it is an HTTP-01
/// validation of an order in progress. Any Host: the token alone names it
/// (random, and what it answers is public once asked for).
pub fn http_challenge(path: &[u8]) -> Option<String> {
    let token = path.strip_prefix(HTTP_CHALLENGE_PREFIX)?;
    if HTTP_PENDING.load(Relaxed) == 0 {
        return None;
    }
    let token = std::str::from_utf8(token).ok()?;
    http_challenges()
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .get(token)
        .cloned()
}

/// The ALPN protocol of TLS-ALPN-01 validations.
pub const ACME_TLS_ALPN: &[u8] = b"acme-tls/1";

fn challenges() -> &'static Mutex<HashMap<String, Arc<CertifiedKey>>> {
    static C: OnceLock<Mutex<HashMap<String, Arc<CertifiedKey>>>> = OnceLock::new();
    C.get_or_init(Default::default)
}

/// Answer TLS-ALPN-01 validations for `name` with `ck` (a self-signed
/// certificate carrying the acmeIdentifier extension) until
/// [`remove_challenge`]. Every listener answers them: the CA connects to
/// port 443 of the name, whichever listener that is.
pub fn add_challenge(name: &str, ck: Arc<CertifiedKey>) {
    challenges()
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .insert(name.to_ascii_lowercase(), ck);
}

pub fn remove_challenge(name: &str) {
    challenges()
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .remove(&name.to_ascii_lowercase());
}

/// The challenge certificate for a ClientHello that offers `acme-tls/1`
/// and names a name under validation.
pub(crate) fn challenge_for(hello: &rustls::server::ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
    let offers = hello
        .alpn()
        .is_some_and(|mut a| a.any(|p| p == ACME_TLS_ALPN));
    if !offers {
        return None;
    }
    let sni = hello.server_name()?;
    let g = challenges().lock().unwrap_or_else(|e| e.into_inner());
    // Any client may offer `acme-tls/1`: with no order running that costs
    // it a lock, not an allocation.
    if g.is_empty() {
        return None;
    }
    g.get(&sni.trim_end_matches('.').to_ascii_lowercase())
        .cloned()
}
