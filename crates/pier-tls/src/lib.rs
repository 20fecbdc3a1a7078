//! Pier's TLS, on rustls (aws-lc-rs provider).
//!
//! - [`ServerTls`]: a listener's TLS: certificates chosen by SNI (exact
//!   names and `*.` wildcards read from each certificate's own SAN list,
//!   a default certificate; an RSA and an ECDSA certificate for one name
//!   chosen by the signature schemes the client offers), TLS 1.2/1.3 with a
//!   configurable minimum, ALPN, resumption by tickets (keys shared by every
//!   worker and across reloads, rotated every 6 hours by rustls) and by a
//!   bounded session cache, optional client certificates. The handshake
//!   itself ([`ServerTls::accept`]) is bounded in time and in how many run at
//!   once, tells plain HTTP from TLS, and counts every outcome ([`stats`]).
//! - [`ClientTls`]: an upstream's TLS: the system's trust store or a CA
//!   file, an optional client certificate, resumption to origins; a
//!   `verify = false` upstream gets a verifier that accepts anything and a
//!   warning at start.
//!
//! Certificate selection and the handshake bounds are Pier's own (they
//! depend on config and metrics); the protocol is rustls's.

mod certs;
mod client;
#[cfg(not(feature = "ring"))]
mod hkdf;
pub mod managed;
mod ocsp;
mod server;
pub mod stats;
pub mod tickets;

pub use certs::{certified_key_from_pem, load_certified_key, subject_of, CertSummary};
pub use client::{ClientTls, NoVerify};
pub use managed::Managed;
pub use server::{Accepted, ServerTls, Transport};
/// A server-side TLS connection over transport `T`.
pub use tokio_rustls::server::TlsStream as ServerStream;

use std::sync::Arc;

/// What a finished handshake agreed on: for the access log, hooks and
/// `X-Forwarded-Proto`. One per connection, shared by its requests.
#[derive(Debug, Clone, Default)]
pub struct TlsInfo {
    /// "TLSv1.2" / "TLSv1.3".
    pub version: &'static str,
    /// IANA name of the cipher suite, e.g. "TLS13_AES_128_GCM_SHA256".
    pub cipher: &'static str,
    pub sni: Option<Box<str>>,
    pub alpn: Option<Box<str>>,
    /// Subject of a verified client certificate (RFC 4514 form).
    pub client_subject: Option<Box<str>>,
    /// The handshake resumed an earlier session (ticket or cache).
    pub resumed: bool,
}

/// The crypto provider every config is built with: aws-lc-rs, or ring with
/// the `ring` feature (built only to measure the two side by side:
/// BENCHMARKS.md, "TLS (issue 9)").
pub fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    static P: std::sync::OnceLock<Arc<rustls::crypto::CryptoProvider>> = std::sync::OnceLock::new();
    #[cfg(not(feature = "ring"))]
    let make = || hkdf::keyed(rustls::crypto::aws_lc_rs::default_provider());
    #[cfg(feature = "ring")]
    let make = rustls::crypto::ring::default_provider;
    P.get_or_init(|| Arc::new(make())).clone()
}

/// Validate a config's TLS without serving it (`pier check`): every
/// certificate and key loads and matches, every CA file parses. Returns
/// warnings (certificates expiring within 14 days, `verify = false`).
pub fn check(cfg: &pier_config::Config, now_unix: i64) -> Result<Vec<String>, Vec<String>> {
    let mut errors = Vec::new();
    let mut warnings = Vec::new();
    let admin = cfg.admin_tls.as_ref().map(|t| ("admin", t));
    let listeners = cfg
        .listeners
        .iter()
        .filter_map(|l| Some((l.name.as_str(), l.tls.as_ref()?)));
    for (name, t) in listeners.chain(admin) {
        match ServerTls::build(name, t) {
            Ok(s) => {
                for c in s.certificates() {
                    let left = c.not_after - now_unix;
                    if left < 0 {
                        warnings.push(format!(
                            "listener `{}`: certificate {} ({}) expired {} days ago",
                            name,
                            c.file.display(),
                            c.name,
                            -left / 86_400
                        ));
                    } else if left < 14 * 86_400 {
                        warnings.push(format!(
                            "listener `{}`: certificate {} ({}) expires in {} days",
                            name,
                            c.file.display(),
                            c.name,
                            left / 86_400
                        ));
                    }
                }
            }
            Err(e) => errors.push(e),
        }
    }
    for (name, u) in &cfg.upstreams {
        let Some(t) = &u.tls else { continue };
        match ClientTls::build(name, t, u.protocol == pier_config::UpstreamProtocol::H2) {
            Ok(_) if !t.verify => warnings.push(format!(
                "upstream `{name}`: tls verify = false: origin certificates are not checked"
            )),
            Ok(_) => {}
            Err(e) => errors.push(e),
        }
    }
    if errors.is_empty() {
        Ok(warnings)
    } else {
        Err(errors)
    }
}
