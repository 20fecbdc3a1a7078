//! PEM files → rustls keys, and what Pier needs to know of a certificate
//! (its names, its expiry).

use pier_config::CertFiles;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::sign::CertifiedKey;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// One loaded certificate, for SNI selection, the expiry gauge and `pier check`.
#[derive(Debug, Clone)]
pub struct CertSummary {
    pub file: PathBuf,
    /// The first name of its SAN list (or its subject CN), for metrics.
    pub name: String,
    /// DNS names from the SAN list, lower-cased (wildcards as `*.x.y`).
    pub names: Vec<String>,
    /// notAfter, Unix seconds.
    pub not_after: i64,
}

pub(crate) fn read_chain(path: &Path) -> Result<Vec<CertificateDer<'static>>, String> {
    let chain: Vec<CertificateDer<'static>> = CertificateDer::pem_file_iter(path)
        .map_err(|e| format!("{}: {e}", path.display()))?
        .collect::<Result<_, _>>()
        .map_err(|e| format!("{}: {e}", path.display()))?;
    if chain.is_empty() {
        return Err(format!("{}: no PEM certificate in it", path.display()));
    }
    Ok(chain)
}

pub(crate) fn read_key(path: &Path) -> Result<PrivateKeyDer<'static>, String> {
    PrivateKeyDer::from_pem_file(path).map_err(|e| {
        format!(
            "{}: no usable private key (PKCS#8, PKCS#1 or SEC1 PEM): {e}",
            path.display()
        )
    })
}

/// Load a chain and its key, check that the key belongs to the chain's
/// first certificate, and read the names and expiry of that certificate.
pub fn load_certified_key(f: &CertFiles) -> Result<(Arc<CertifiedKey>, CertSummary), String> {
    let chain = read_chain(&f.cert)?;
    let key = read_key(&f.key)?;
    let summary = summarize(&f.cert, &chain[0])?;
    for (i, c) in chain.iter().enumerate().skip(1) {
        x509_parser::parse_x509_certificate(c).map_err(|e| {
            format!(
                "{}: certificate {} of the chain does not parse: {e}",
                f.cert.display(),
                i + 1
            )
        })?;
    }
    let ck = CertifiedKey::from_der(chain, key, &crate::provider()).map_err(|e| {
        format!(
            "{} with key {}: {}",
            f.cert.display(),
            f.key.display(),
            match e {
                rustls::Error::InconsistentKeys(_) =>
                    "the key does not belong to the certificate".to_string(),
                e => e.to_string(),
            }
        )
    })?;
    Ok((Arc::new(ck), summary))
}

/// A chain and key in PEM text (an ACME CA's answer, or the files Pier
/// stored it in) → a servable key and the chain's notAfter (Unix seconds).
pub fn certified_key_from_pem(chain: &str, key: &str) -> Result<(Arc<CertifiedKey>, i64), String> {
    let chain: Vec<CertificateDer<'static>> = CertificateDer::pem_slice_iter(chain.as_bytes())
        .collect::<Result<_, _>>()
        .map_err(|e| format!("certificate chain: {e}"))?;
    let first = chain.first().ok_or("no certificate in the chain")?;
    let (_, cert) = x509_parser::parse_x509_certificate(first)
        .map_err(|e| format!("certificate does not parse: {e}"))?;
    let not_after = cert.validity().not_after.timestamp();
    let key = PrivateKeyDer::from_pem_slice(key.as_bytes()).map_err(|e| format!("key: {e}"))?;
    let ck = CertifiedKey::from_der(chain, key, &crate::provider()).map_err(|e| e.to_string())?;
    Ok((Arc::new(ck), not_after))
}

fn summarize(file: &Path, der: &CertificateDer<'_>) -> Result<CertSummary, String> {
    let (_, cert) = x509_parser::parse_x509_certificate(der)
        .map_err(|e| format!("{}: certificate does not parse: {e}", file.display()))?;
    let mut names = Vec::new();
    if let Ok(Some(san)) = cert.subject_alternative_name() {
        for n in &san.value.general_names {
            if let x509_parser::extensions::GeneralName::DNSName(d) = n {
                names.push(d.trim_end_matches('.').to_ascii_lowercase());
            }
        }
    }
    let cn = cert
        .subject()
        .iter_common_name()
        .next()
        .and_then(|c| c.as_str().ok())
        .map(|s| s.to_ascii_lowercase());
    // Clients match SAN only (RFC 6125); the CN is only a label then.
    let name = names
        .first()
        .cloned()
        .or(cn)
        .unwrap_or_else(|| file.display().to_string());
    Ok(CertSummary {
        file: file.to_path_buf(),
        name,
        names,
        not_after: cert.validity().not_after.timestamp(),
    })
}

/// Subject of a certificate, RFC 4514 style ("CN=client,O=Example").
pub fn subject_of(der: &CertificateDer<'_>) -> Option<Box<str>> {
    let (_, cert) = x509_parser::parse_x509_certificate(der).ok()?;
    Some(cert.subject().to_string().into_boxed_str())
}

/// A root store from a CA file (every certificate in it).
pub(crate) fn roots_from(path: &Path) -> Result<rustls::RootCertStore, String> {
    let mut roots = rustls::RootCertStore::empty();
    for c in read_chain(path)? {
        roots
            .add(c)
            .map_err(|e| format!("{}: not a usable CA certificate: {e}", path.display()))?;
    }
    Ok(roots)
}
