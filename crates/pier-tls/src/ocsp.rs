//! OCSP stapling (RFC 6960 responses, sent in the handshake as RFC 6066's
//! `status_request` and TLS 1.3's certificate entry extension).
//!
//! Every served certificate is a [`Served`] slot: its key and chain, and the
//! latest staple swapped in beside them, so a refresh reaches the next
//! handshake without a reload and costs a handshake one atomic load. One
//! `pier-ocsp` thread for the process fetches the responses (blocking HTTP/1.0
//! POST: OCSP is plain HTTP, one small request an hour or so, not worth a
//! runtime), checks them (status, times, the signature by the issuer or by a
//! responder the issuer delegated to) and refreshes them halfway through their
//! validity; failures back off from 5 s to 10 min and keep the old staple
//! until its `nextUpdate`, after which handshakes go without one (a stale
//! staple is worse than none). Responses are kept per certificate and
//! responder for the life of the process, so a reload staples at once.
//!
//! DER is read with asn1-rs (already here through x509-parser) and the two
//! small structures Pier sends are written by hand: an OCSP crate would bring
//! a second ASN.1 stack for ~40 lines.

use arc_swap::ArcSwap;
use rustls::pki_types::CertificateDer;
use rustls::sign::CertifiedKey;
use std::collections::HashMap;
use std::io::{Read, Write};
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Condvar, Mutex, OnceLock, Weak};
use std::time::{Duration, Instant, SystemTime};
use x509_parser::asn1_rs::{Any, Class, FromDer};
use x509_parser::certificate::X509Certificate;
use x509_parser::extensions::{GeneralName, ParsedExtension};

/// A certificate as the SNI resolver serves it.
pub(crate) struct Served {
    /// Key and chain without a staple.
    base: Arc<CertifiedKey>,
    current: ArcSwap<CertifiedKey>,
}

impl Served {
    pub(crate) fn new(ck: Arc<CertifiedKey>) -> Arc<Served> {
        Arc::new(Served {
            current: ArcSwap::new(ck.clone()),
            base: ck,
        })
    }

    /// Whether its key can sign with one of `schemes` (the staple does
    /// not change the key).
    pub(crate) fn signs_with(&self, schemes: &[rustls::SignatureScheme]) -> bool {
        self.base.key.choose_scheme(schemes).is_some()
    }

    /// What a handshake serves now (with the current staple, if any).
    pub(crate) fn get(&self) -> Arc<CertifiedKey> {
        self.current.load_full()
    }

    fn staple(&self, der: Option<&Arc<[u8]>>) {
        let ck = match der {
            Some(d) => {
                let mut ck = (*self.base).clone();
                ck.ocsp = Some(d.to_vec());
                Arc::new(ck)
            }
            None => self.base.clone(),
        };
        self.current.store(ck);
    }
}

/// Fetches that gave a usable staple, and those that did not.
static FETCHED: [AtomicU64; 2] = [AtomicU64::new(0), AtomicU64::new(0)];

/// `pier_tls_ocsp_*` metrics, Prometheus text.
pub(crate) fn render(out: &mut String) {
    use std::fmt::Write as _;
    let (stapled, total) = stapled();
    let _ = writeln!(
        out,
        "# TYPE pier_tls_ocsp_fetches_total counter\npier_tls_ocsp_fetches_total{{result=\"ok\"}} {}\npier_tls_ocsp_fetches_total{{result=\"failed\"}} {}\n# TYPE pier_tls_ocsp_stapled gauge\npier_tls_ocsp_stapled {stapled}\n# TYPE pier_tls_ocsp_certificates gauge\npier_tls_ocsp_certificates {total}",
        FETCHED[0].load(Relaxed),
        FETCHED[1].load(Relaxed),
    );
}

/// Certificates served with a valid staple now, of those served with a
/// responder.
fn stapled() -> (usize, usize) {
    let Some(s) = STAPLER.get() else {
        return (0, 0);
    };
    let g = s.entries.lock().unwrap_or_else(|e| e.into_inner());
    let live = || {
        g.values()
            .filter(|e| e.users.iter().any(|u| u.strong_count() > 0))
    };
    (
        live().filter(|e| e.staple.is_some()).count(),
        live().count(),
    )
}

/// Where and what to ask for one certificate.
pub(crate) struct Target {
    pub url: String,
    request: Vec<u8>,
    id: CertId,
    /// The issuer's subjectPublicKeyInfo (DER), which signs the responses
    /// or the responder certificate it delegates to.
    issuer_spki: Vec<u8>,
    /// For log lines.
    pub name: String,
}

#[derive(Clone, PartialEq, Eq, Debug)]
struct CertId {
    name_hash: Vec<u8>,
    key_hash: Vec<u8>,
    serial: Vec<u8>,
}

/// What to ask for `chain[0]`: `None` when no responder is named (by the
/// certificate's authorityInfoAccess or `responder`) or the chain lacks the
/// issuer, whose name and key identify the certificate to the responder.
pub(crate) fn target(
    chain: &[CertificateDer<'_>],
    responder: Option<&str>,
    name: &str,
) -> Result<Option<Target>, String> {
    let Some(leaf) = chain.first() else {
        return Ok(None);
    };
    let (_, leaf) =
        x509_parser::parse_x509_certificate(leaf).map_err(|e| format!("certificate: {e}"))?;
    let url = match responder {
        Some(u) => Some(u.to_string()),
        None => responder_of(&leaf),
    };
    let Some(url) = url else { return Ok(None) };
    let Some(issuer) = chain.get(1) else {
        return Err(format!(
            "{name}: OCSP stapling needs the issuer's certificate after the certificate in its chain file"
        ));
    };
    let (_, issuer) =
        x509_parser::parse_x509_certificate(issuer).map_err(|e| format!("issuer: {e}"))?;
    let id = CertId {
        name_hash: sha1(leaf.issuer().as_raw()),
        key_hash: sha1(&issuer.public_key().subject_public_key.data),
        serial: leaf.raw_serial().to_vec(),
    };
    Ok(Some(Target {
        request: request_der(&id),
        id,
        issuer_spki: issuer.public_key().raw.to_vec(),
        url,
        name: name.to_string(),
    }))
}

/// The first OCSP responder of the authorityInfoAccess extension.
fn responder_of(cert: &X509Certificate<'_>) -> Option<String> {
    cert.extensions()
        .iter()
        .find_map(|e| match e.parsed_extension() {
            ParsedExtension::AuthorityInfoAccess(aia) => {
                aia.accessdescs.iter().find_map(|d| {
                    match (&d.access_location, d.access_method.to_id_string().as_str()) {
                        (GeneralName::URI(u), "1.3.6.1.5.5.7.48.1") if u.starts_with("http://") => {
                            Some(u.to_string())
                        }
                        _ => None,
                    }
                })
            }
            _ => None,
        })
}

fn sha1(b: &[u8]) -> Vec<u8> {
    aws_lc_rs::digest::digest(&aws_lc_rs::digest::SHA1_FOR_LEGACY_USE_ONLY, b)
        .as_ref()
        .to_vec()
}

const SHA1_ALG: &[u8] = &[
    0x30, 0x09, 0x06, 0x05, 0x2b, 0x0e, 0x03, 0x02, 0x1a, 0x05, 0x00,
];

fn push_tlv(out: &mut Vec<u8>, tag: u8, body: &[u8]) {
    out.push(tag);
    let n = body.len();
    if n < 0x80 {
        out.push(n as u8);
    } else {
        let bytes = n.to_be_bytes();
        let skip = bytes.iter().take_while(|b| **b == 0).count();
        out.push(0x80 | (bytes.len() - skip) as u8);
        out.extend_from_slice(&bytes[skip..]);
    }
    out.extend_from_slice(body);
}

fn seq(body: &[u8]) -> Vec<u8> {
    let mut v = Vec::with_capacity(body.len() + 4);
    push_tlv(&mut v, 0x30, body);
    v
}

/// OCSPRequest { TBSRequest { requestList { Request { CertID } } } }, unsigned,
/// without a nonce (responders that cache their answers ignore nonces; RFC 5019).
fn request_der(id: &CertId) -> Vec<u8> {
    let mut cert_id = SHA1_ALG.to_vec();
    push_tlv(&mut cert_id, 0x04, &id.name_hash);
    push_tlv(&mut cert_id, 0x04, &id.key_hash);
    push_tlv(&mut cert_id, 0x02, &id.serial);
    seq(&seq(&seq(&seq(&seq(&cert_id)))))
}

/// A response checked and ready to staple.
#[derive(Debug)]
pub(crate) struct Staple {
    der: Arc<[u8]>,
    /// Unix seconds.
    this_update: i64,
    next_update: Option<i64>,
    revoked: bool,
}

fn der(b: &[u8]) -> Result<(Any<'_>, &[u8]), String> {
    let (rest, any) = Any::from_der(b).map_err(|e| format!("bad DER: {e}"))?;
    Ok((any, rest))
}

/// The contents of a SEQUENCE.
fn seq_of<'a>(a: &Any<'a>, what: &str) -> Result<&'a [u8], String> {
    if a.header.tag().0 == 16 && a.header.class() == Class::Universal {
        Ok(a.data)
    } else {
        Err(format!("{what}: not a SEQUENCE"))
    }
}

fn is_context(a: &Any<'_>, n: u32) -> bool {
    a.header.class() == Class::ContextSpecific && a.header.tag().0 == n
}

/// Check a responder's answer for `t` at `now` (Unix seconds): a
/// successful basic response, signed by the issuer or by a responder
/// certificate the issuer signed for OCSP, with a status for this very
/// certificate, issued no later than 5 minutes ahead and not yet expired.
pub(crate) fn check(t: &Target, body: &[u8], now: i64) -> Result<Staple, String> {
    let (resp, _) = der(body)?;
    let (status, rest) = der(seq_of(&resp, "OCSPResponse")?)?;
    if status.header.tag().0 != 10 {
        return Err("OCSPResponse: no responseStatus".into());
    }
    match status.data {
        [0] => {}
        [1] => return Err("responder: malformedRequest".into()),
        [2] => return Err("responder: internalError".into()),
        [3] => return Err("responder: tryLater".into()),
        [5] => return Err("responder: sigRequired".into()),
        [6] => return Err("responder: unauthorized".into()),
        s => return Err(format!("responder: status {s:?}")),
    }
    let (bytes, _) = der(rest)?;
    if !is_context(&bytes, 0) {
        return Err("OCSPResponse: no responseBytes".into());
    }
    let (rb, _) = der(bytes.data)?;
    let (kind, rest) = der(seq_of(&rb, "ResponseBytes")?)?;
    // id-pkix-ocsp-basic, 1.3.6.1.5.5.7.48.1.1
    if kind.data != [0x2b, 0x06, 0x01, 0x05, 0x05, 0x07, 0x30, 0x01, 0x01] {
        return Err("not a basic OCSP response".into());
    }
    let (octets, _) = der(rest)?;
    let (basic, _) = der(octets.data)?;
    let body_of_basic = seq_of(&basic, "BasicOCSPResponse")?;
    let (tbs, rest) = der(body_of_basic)?;
    let tbs_raw = &body_of_basic[..body_of_basic.len() - rest.len()];
    let (sig_alg, rest) = der(rest)?;
    let (sig, rest) = der(rest)?;
    let sig_alg = oid_of(seq_of(&sig_alg, "signatureAlgorithm")?)?;
    let sig = sig.data.get(1..).ok_or("empty signature")?;
    verify_signer(t, tbs_raw, sig_alg, sig, rest)?;

    // ResponseData: version [0] EXPLICIT (optional), responderID, producedAt,
    // responses, extensions [1] (optional).
    let mut rd = seq_of(&tbs, "ResponseData")?;
    let (mut f, mut r) = der(rd)?;
    if is_context(&f, 0) {
        (f, r) = der(r)?;
    }
    let _responder_id = f;
    let (_produced, r) = der(r)?;
    let (responses, _) = der(r)?;
    rd = seq_of(&responses, "responses")?;
    while !rd.is_empty() {
        let (single, r) = der(rd)?;
        rd = r;
        let (cid, r) = der(seq_of(&single, "SingleResponse")?)?;
        if parse_cert_id(seq_of(&cid, "CertID")?)? != t.id {
            continue;
        }
        let (st, r) = der(r)?;
        let revoked = match (st.header.class(), st.header.tag().0) {
            (Class::ContextSpecific, 0) => false,
            (Class::ContextSpecific, 1) => true,
            (Class::ContextSpecific, 2) => {
                return Err("responder: the certificate's status is unknown".into())
            }
            _ => return Err("SingleResponse: bad certStatus".into()),
        };
        let (this, r) = der(r)?;
        let this_update = time_of(&this)?;
        let next_update = match der(r) {
            Ok((n, _)) if is_context(&n, 0) => Some(time_of(&der(n.data)?.0)?),
            _ => None,
        };
        if this_update > now + 300 {
            return Err(format!("thisUpdate is {}s ahead", this_update - now));
        }
        if let Some(n) = next_update {
            if n <= now {
                return Err("the response has expired (nextUpdate passed)".into());
            }
        }
        return Ok(Staple {
            der: Arc::from(body),
            this_update,
            next_update,
            revoked,
        });
    }
    Err("no status for this certificate in the response".into())
}

fn oid_of(alg: &[u8]) -> Result<&[u8], String> {
    let (oid, _) = der(alg)?;
    if oid.header.tag().0 != 6 {
        return Err("AlgorithmIdentifier: no OID".into());
    }
    Ok(oid.data)
}

fn parse_cert_id(b: &[u8]) -> Result<CertId, String> {
    let (alg, r) = der(b)?;
    let (name_hash, r) = der(r)?;
    let (key_hash, r) = der(r)?;
    let (serial, _) = der(r)?;
    // Responders answer with the hash asked for; another one cannot match.
    if oid_of(seq_of(&alg, "hashAlgorithm")?)? != [0x2b, 0x0e, 0x03, 0x02, 0x1a] {
        return Err("CertID: not SHA-1".into());
    }
    Ok(CertId {
        name_hash: name_hash.data.to_vec(),
        key_hash: key_hash.data.to_vec(),
        serial: serial.data.to_vec(),
    })
}

/// GeneralizedTime `YYYYMMDDHHMMSS[.f]Z` → Unix seconds.
fn time_of(a: &Any<'_>) -> Result<i64, String> {
    let s = a.data;
    if a.header.tag().0 != 24 || s.len() < 15 || s.last() != Some(&b'Z') {
        return Err("bad GeneralizedTime".into());
    }
    let n = |i: usize, w: usize| -> Result<i64, String> {
        s[i..i + w].iter().try_fold(0i64, |acc, d| {
            if d.is_ascii_digit() {
                Ok(acc * 10 + (d - b'0') as i64)
            } else {
                Err("bad GeneralizedTime".to_string())
            }
        })
    };
    let (y, m, d) = (n(0, 4)?, n(4, 2)?, n(6, 2)?);
    let (hh, mm, ss) = (n(8, 2)?, n(10, 2)?, n(12, 2)?);
    if !(1..=12).contains(&m) || !(1..=31).contains(&d) || hh > 23 || mm > 59 || ss > 60 {
        return Err("bad GeneralizedTime".into());
    }
    // Days from civil (Howard Hinnant's algorithm).
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let mp = (m + 9) % 12;
    let doy = (153 * mp + 2) / 5 + d - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    let days = era * 146_097 + doe - 719_468;
    Ok(days * 86_400 + hh * 3600 + mm * 60 + ss)
}

/// The response is signed by the issuer itself, or by one of the
/// certificates it carries (`certs [0]`) that the issuer signed and marked
/// for OCSP signing (RFC 6960 §4.2.2.2).
fn verify_signer(
    t: &Target,
    tbs: &[u8],
    alg: &[u8],
    sig: &[u8],
    certs: &[u8],
) -> Result<(), String> {
    if verify(&t.issuer_spki, alg, tbs, sig).is_ok() {
        return Ok(());
    }
    let mut why = "the signature is not the issuer's".to_string();
    if let Ok((wrap, _)) = der(certs) {
        if is_context(&wrap, 0) {
            let (list, _) = der(wrap.data)?;
            let mut rest = seq_of(&list, "certs")?;
            while !rest.is_empty() {
                let (_, r) = der(rest)?;
                let raw = &rest[..rest.len() - r.len()];
                rest = r;
                let Ok((_, cert)) = x509_parser::parse_x509_certificate(raw) else {
                    continue;
                };
                let ocsp_signer = matches!(
                    cert.extended_key_usage(), Ok(Some(e)) if e.value.ocsp_signing
                );
                if !ocsp_signer {
                    why = "its responder certificate is not marked for OCSP signing".into();
                    continue;
                }
                let signed_by_issuer = verify(
                    &t.issuer_spki,
                    cert.signature_algorithm.algorithm.as_bytes(),
                    cert.tbs_certificate.as_ref(),
                    &cert.signature_value.data,
                );
                if signed_by_issuer.is_err() {
                    why = "its responder certificate is not signed by the issuer".into();
                    continue;
                }
                if !cert.validity().is_valid() {
                    why = "its responder certificate is out of its validity".into();
                    continue;
                }
                if verify(cert.public_key().raw, alg, tbs, sig).is_ok() {
                    return Ok(());
                }
            }
        }
    }
    Err(format!("bad response signature: {why}"))
}

/// Verify `sig` over `msg` with the key of `spki` (DER), by the signature
/// algorithm OID `alg` (RSA PKCS#1 and PSS are not told apart by the key).
fn verify(spki: &[u8], alg: &[u8], msg: &[u8], sig: &[u8]) -> Result<(), ()> {
    use aws_lc_rs::signature as s;
    let (_, info) = x509_parser::x509::SubjectPublicKeyInfo::from_der(spki).map_err(|_| ())?;
    let key: &[u8] = &info.subject_public_key.data;
    let curve = info
        .algorithm
        .parameters
        .as_ref()
        .map(|p| p.data)
        .unwrap_or(&[]);
    const P256: &[u8] = &[0x2a, 0x86, 0x48, 0xce, 0x3d, 0x03, 0x01, 0x07];
    const P384: &[u8] = &[0x2b, 0x81, 0x04, 0x00, 0x22];
    let a: &dyn s::VerificationAlgorithm = match alg {
        // sha256/384/512WithRSAEncryption
        [0x2a, 0x86, 0x48, 0x86, 0xf7, 0x0d, 0x01, 0x01, 0x0b] => &s::RSA_PKCS1_2048_8192_SHA256,
        [0x2a, 0x86, 0x48, 0x86, 0xf7, 0x0d, 0x01, 0x01, 0x0c] => &s::RSA_PKCS1_2048_8192_SHA384,
        [0x2a, 0x86, 0x48, 0x86, 0xf7, 0x0d, 0x01, 0x01, 0x0d] => &s::RSA_PKCS1_2048_8192_SHA512,
        // sha1WithRSAEncryption: still what many responders sign with.
        [0x2a, 0x86, 0x48, 0x86, 0xf7, 0x0d, 0x01, 0x01, 0x05] => {
            &s::RSA_PKCS1_2048_8192_SHA1_FOR_LEGACY_USE_ONLY
        }
        // ecdsa-with-SHA256/384, on the key's curve
        [0x2a, 0x86, 0x48, 0xce, 0x3d, 0x04, 0x03, 0x02] if curve == P256 => {
            &s::ECDSA_P256_SHA256_ASN1
        }
        [0x2a, 0x86, 0x48, 0xce, 0x3d, 0x04, 0x03, 0x02] if curve == P384 => {
            &s::ECDSA_P384_SHA256_ASN1
        }
        [0x2a, 0x86, 0x48, 0xce, 0x3d, 0x04, 0x03, 0x03] if curve == P256 => {
            &s::ECDSA_P256_SHA384_ASN1
        }
        [0x2a, 0x86, 0x48, 0xce, 0x3d, 0x04, 0x03, 0x03] if curve == P384 => {
            &s::ECDSA_P384_SHA384_ASN1
        }
        // Ed25519
        [0x2b, 0x65, 0x70] => &s::ED25519,
        _ => return Err(()),
    };
    s::UnparsedPublicKey::new(a, key)
        .verify(msg, sig)
        .map_err(|_| ())
}

/// When to ask again after a good response: halfway through its validity
/// (as Caddy does), within 5 s to 24 h of now; hourly without `nextUpdate`.
pub(crate) fn refresh_in(s: &Staple, now: i64) -> Duration {
    let at = match s.next_update {
        Some(n) => s.this_update + (n - s.this_update) / 2,
        None => now + 3600,
    };
    Duration::from_secs((at - now).clamp(5, 86_400) as u64)
}

/// After `failures` failed fetches in a row (≥ 1): 5 s doubling to 10 min.
pub(crate) fn backoff(failures: u32) -> Duration {
    Duration::from_secs((5u64 << failures.saturating_sub(1).min(10)).min(600))
}

struct Entry {
    target: Target,
    staple: Option<Staple>,
    due: Instant,
    failures: u32,
    users: Vec<Weak<Served>>,
}

impl Entry {
    fn push(&self) {
        let der = self.staple.as_ref().map(|s| &s.der);
        for u in self.users.iter().filter_map(Weak::upgrade) {
            u.staple(der);
        }
    }
}

struct Stapler {
    /// By certificate (DER) and responder.
    entries: Mutex<HashMap<(Vec<u8>, String), Entry>>,
    wake: Condvar,
}

static STAPLER: OnceLock<Arc<Stapler>> = OnceLock::new();

fn unix_now() -> i64 {
    SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .map(|d| d.as_secs() as i64)
        .unwrap_or(0)
}

/// Staple `served` from now on: it gets the response already held for its
/// certificate (a reload), and the fetch thread is told of it.
pub(crate) fn register(served: &Arc<Served>, leaf: &[u8], t: Target) {
    let s = STAPLER.get_or_init(|| {
        let s = Arc::new(Stapler {
            entries: Mutex::new(HashMap::new()),
            wake: Condvar::new(),
        });
        let run = s.clone();
        if let Err(e) = std::thread::Builder::new()
            .name("pier-ocsp".into())
            .spawn(move || run.run())
        {
            tracing::error!("OCSP stapling thread: {e}");
        }
        s
    });
    let mut g = s.entries.lock().unwrap_or_else(|e| e.into_inner());
    let e = g
        .entry((leaf.to_vec(), t.url.clone()))
        .or_insert_with(|| Entry {
            target: t,
            staple: None,
            due: Instant::now(),
            failures: 0,
            users: Vec::new(),
        });
    e.users.retain(|w| w.strong_count() > 0);
    e.users.push(Arc::downgrade(served));
    if let Some(st) = &e.staple {
        served.staple(Some(&st.der));
    }
    s.wake.notify_one();
}

impl Stapler {
    fn run(&self) {
        let mut g = self.entries.lock().unwrap_or_else(|e| e.into_inner());
        loop {
            // Certificates no listener serves any more are forgotten.
            g.retain(|_, e| {
                e.users.retain(|w| w.strong_count() > 0);
                !e.users.is_empty()
            });
            let now = Instant::now();
            let unix = unix_now();
            for e in g.values_mut() {
                if e.staple
                    .as_ref()
                    .and_then(|s| s.next_update)
                    .is_some_and(|n| n <= unix)
                {
                    tracing::warn!(
                        "OCSP: the staple of {} expired; serving it without one",
                        e.target.name
                    );
                    e.staple = None;
                    e.push();
                }
            }
            let due: Vec<(Vec<u8>, String)> = g
                .iter()
                .filter(|(_, e)| e.due <= now)
                .map(|(k, _)| k.clone())
                .collect();
            if due.is_empty() {
                // Woken by a registration, the next due fetch, a staple's
                // expiry, or a minute (to forget dropped certificates).
                let mut wait = Duration::from_secs(60);
                for e in g.values() {
                    wait = wait.min(e.due.saturating_duration_since(now));
                    if let Some(n) = e.staple.as_ref().and_then(|s| s.next_update) {
                        wait = wait.min(Duration::from_secs((n - unix).max(0) as u64));
                    }
                }
                g = self
                    .wake
                    .wait_timeout(g, wait.max(Duration::from_millis(10)))
                    .unwrap_or_else(|e| e.into_inner())
                    .0;
                continue;
            }
            for key in due {
                let Some(e) = g.get_mut(&key) else { continue };
                // Not fetched again before this one is answered.
                e.due = now + Duration::from_secs(3600);
                let (url, request) = (e.target.url.clone(), e.target.request.clone());
                drop(g);
                let got = fetch(&url, &request);
                g = self.entries.lock().unwrap_or_else(|e| e.into_inner());
                let Some(e) = g.get_mut(&key) else { continue };
                let unix = unix_now();
                match got.and_then(|body| check(&e.target, &body, unix)) {
                    Ok(st) => {
                        FETCHED[0].fetch_add(1, Relaxed);
                        if st.revoked {
                            tracing::warn!(
                                "OCSP: {} is REVOKED, says {}; stapling that",
                                e.target.name,
                                url
                            );
                        }
                        e.failures = 0;
                        e.due = Instant::now() + refresh_in(&st, unix);
                        e.staple = Some(st);
                        e.push();
                    }
                    Err(why) => {
                        FETCHED[1].fetch_add(1, Relaxed);
                        e.failures += 1;
                        let wait = backoff(e.failures);
                        tracing::warn!(
                            "OCSP: {} from {url}: {why}; trying again in {}s",
                            e.target.name,
                            wait.as_secs()
                        );
                        e.due = Instant::now() + wait;
                    }
                }
            }
        }
    }
}

/// Responses larger than this are refused (real ones are 1–3 KiB).
const MAX_RESPONSE: usize = 64 * 1024;

/// POST the request to an `http://` responder and return the body of a
/// 200 answer. Blocking, bounded by 10 s per step, 30 s for the answer,
/// and `MAX_RESPONSE`.
fn fetch(url: &str, request: &[u8]) -> Result<Vec<u8>, String> {
    use std::net::ToSocketAddrs;
    let u = pier_http::url::parse_http(url, 80, "/")?;
    let (hostport, path) = (u.authority, &*u.path);
    let step = Duration::from_secs(10);
    let addr = u
        .connect
        .to_socket_addrs()
        .map_err(|e| format!("{hostport}: {e}"))?
        .next()
        .ok_or_else(|| format!("{hostport}: no address"))?;
    let mut s = std::net::TcpStream::connect_timeout(&addr, step).map_err(|e| e.to_string())?;
    s.set_read_timeout(Some(step)).map_err(|e| e.to_string())?;
    s.set_write_timeout(Some(step)).map_err(|e| e.to_string())?;
    let mut head = Vec::with_capacity(200 + request.len());
    let _ = write!(
        head,
        "POST {path} HTTP/1.0\r\nHost: {hostport}\r\nContent-Type: application/ocsp-request\r\nAccept: application/ocsp-response\r\nContent-Length: {}\r\nUser-Agent: pier\r\n\r\n",
        request.len()
    );
    head.extend_from_slice(request);
    s.write_all(&head).map_err(|e| e.to_string())?;
    // Read to the end of the body the head announces (OpenSSL's responder
    // keeps the connection open), or to EOF without a Content-Length.
    let mut buf = Vec::with_capacity(4096);
    let mut chunk = [0u8; 4096];
    // A responder dripping its answer is given 30 s in all, not 10 s a read.
    let deadline = Instant::now() + 3 * step;
    let read = |s: &mut std::net::TcpStream, chunk: &mut [u8]| {
        if Instant::now() > deadline {
            return Err("no answer within 30 s".to_string());
        }
        s.read(chunk).map_err(|e| e.to_string())
    };
    let (head_len, len) = loop {
        let n = read(&mut s, &mut chunk)?;
        buf.extend_from_slice(&chunk[..n]);
        if buf.len() > MAX_RESPONSE {
            return Err(format!("response over {MAX_RESPONSE} bytes"));
        }
        let mut headers = [httparse::EMPTY_HEADER; 32];
        let mut r = httparse::Response::new(&mut headers);
        match r.parse(&buf) {
            Ok(httparse::Status::Complete(h)) => {
                if r.code != Some(200) {
                    return Err(format!("HTTP {}", r.code.unwrap_or(0)));
                }
                let len = match r
                    .headers
                    .iter()
                    .find(|h| h.name.eq_ignore_ascii_case("content-length"))
                {
                    Some(h) => Some(
                        std::str::from_utf8(h.value)
                            .ok()
                            .and_then(|v| v.trim().parse::<usize>().ok())
                            .filter(|l| *l <= MAX_RESPONSE)
                            .ok_or("bad Content-Length")?,
                    ),
                    None => None,
                };
                break (h, len);
            }
            Ok(httparse::Status::Partial) if n > 0 => {}
            _ => return Err("bad HTTP response".into()),
        }
    };
    loop {
        if len.is_some_and(|l| buf.len() >= head_len + l) {
            break;
        }
        let n = read(&mut s, &mut chunk)?;
        if n == 0 {
            if len.is_some() {
                return Err("response cut short".into());
            }
            break;
        }
        buf.extend_from_slice(&chunk[..n]);
        if buf.len() > head_len + MAX_RESPONSE {
            return Err(format!("response over {MAX_RESPONSE} bytes"));
        }
    }
    let mut body = buf.split_off(head_len);
    if let Some(l) = len {
        body.truncate(l);
    }
    Ok(body)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn generalized_time() {
        let t = |s: &str| {
            let mut d = Vec::new();
            push_tlv(&mut d, 24, s.as_bytes());
            time_of(&der(&d).unwrap().0)
        };
        assert_eq!(t("19700101000000Z"), Ok(0));
        assert_eq!(t("20261202143000Z"), Ok(1_796_221_800));
        assert_eq!(t("20000229235959Z"), Ok(951_868_799));
        assert!(t("2026120214300Z").is_err());
        assert!(t("20261302143000Z").is_err());
    }

    #[test]
    fn refresh_halfway_and_backoff() {
        let s = Staple {
            der: Arc::from(&[][..]),
            this_update: 1000,
            next_update: Some(1000 + 86_400),
            revoked: false,
        };
        // Halfway through a day: 12 hours after thisUpdate.
        assert_eq!(refresh_in(&s, 1000), Duration::from_secs(43_200));
        assert_eq!(
            refresh_in(&s, 1000 + 43_200 - 100),
            Duration::from_secs(100)
        );
        // Past halfway: soon, not at once.
        assert_eq!(refresh_in(&s, 1000 + 50_000), Duration::from_secs(5));
        // A week's response is asked for again within a day.
        let week = Staple {
            next_update: Some(1000 + 7 * 86_400),
            ..s
        };
        assert_eq!(refresh_in(&week, 1000), Duration::from_secs(86_400));
        let s = week;
        let none = Staple {
            next_update: None,
            ..s
        };
        assert_eq!(refresh_in(&none, 50), Duration::from_secs(3600));
        let b: Vec<u64> = (1..=10).map(|f| backoff(f).as_secs()).collect();
        assert_eq!(b, [5, 10, 20, 40, 80, 160, 320, 600, 600, 600]);
    }

    #[test]
    fn request_is_der_of_the_cert_id() {
        let id = CertId {
            name_hash: vec![1; 20],
            key_hash: vec![2; 20],
            serial: vec![0x01, 0x02],
        };
        let r = request_der(&id);
        // Five nested SEQUENCEs around the CertID, lengths short-form.
        assert_eq!(&r[..2], &[0x30, (r.len() - 2) as u8]);
        let mut inner = &r[..];
        for _ in 0..5 {
            let (a, _) = der(inner).unwrap();
            inner = seq_of(&a, "x").unwrap();
        }
        assert_eq!(parse_cert_id(inner).unwrap(), id);
        let mut long = Vec::new();
        push_tlv(&mut long, 0x04, &[0; 300]);
        assert_eq!(&long[..4], &[0x04, 0x82, 0x01, 0x2c]);
    }
}
