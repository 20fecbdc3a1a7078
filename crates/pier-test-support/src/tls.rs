//! Test certificates, generated at test time with rcgen: a CA, server
//! certificates with chosen names and key types, client certificates.
//! Written as PEM files into a directory the test owns.

use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
    KeyUsagePurpose,
};
use std::path::{Path, PathBuf};

/// Key types of test certificates.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Alg {
    EcdsaP256,
    EcdsaP384,
    Rsa2048,
    Ed25519,
}

impl Alg {
    fn key(self) -> KeyPair {
        match self {
            Alg::EcdsaP256 => KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256),
            Alg::EcdsaP384 => KeyPair::generate_for(&rcgen::PKCS_ECDSA_P384_SHA384),
            Alg::Ed25519 => KeyPair::generate_for(&rcgen::PKCS_ED25519),
            Alg::Rsa2048 => {
                KeyPair::generate_rsa_for(&rcgen::PKCS_RSA_SHA256, rcgen::RsaKeySize::_2048)
            }
        }
        .expect("generate a test key")
    }
}

/// A certificate and key written to disk.
#[derive(Debug, Clone)]
pub struct CertPair {
    pub cert: PathBuf,
    pub key: PathBuf,
}

/// A test CA that signs server and client certificates.
pub struct TestCa {
    dir: PathBuf,
    name: String,
    issuer: Issuer<'static, KeyPair>,
    pub cert: PathBuf,
}

impl TestCa {
    /// A new CA (ECDSA P-256) named `name`; its certificate goes to
    /// `DIR/NAME-ca.pem`.
    pub fn new(dir: &Path, name: &str) -> TestCa {
        let key = Alg::EcdsaP256.key();
        let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params
            .distinguished_name
            .push(DnType::CommonName, format!("{name} test CA"));
        params.key_usages = vec![
            KeyUsagePurpose::KeyCertSign,
            KeyUsagePurpose::CrlSign,
            KeyUsagePurpose::DigitalSignature,
        ];
        let cert = params.self_signed(&key).expect("self-sign CA");
        let path = dir.join(format!("{name}-ca.pem"));
        std::fs::write(&path, cert.pem()).unwrap();
        TestCa {
            dir: dir.to_path_buf(),
            name: name.to_string(),
            issuer: Issuer::new(params, key),
            cert: path,
        }
    }

    /// A server certificate for `names` (DNS names, `*.` wildcards or IP
    /// addresses), valid from yesterday for `days` days.
    pub fn server(&self, stem: &str, names: &[&str], alg: Alg, days: i64) -> CertPair {
        let names: Vec<String> = names.iter().map(|s| s.to_string()).collect();
        let mut p = CertificateParams::new(names.clone()).unwrap();
        p.distinguished_name.push(
            DnType::CommonName,
            names.first().cloned().unwrap_or_default(),
        );
        p.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
        self.sign(stem, p, alg, days)
    }

    /// A client certificate with this common name.
    pub fn client(&self, stem: &str, common_name: &str) -> CertPair {
        let mut p = CertificateParams::new(Vec::<String>::new()).unwrap();
        p.distinguished_name.push(DnType::CommonName, common_name);
        p.distinguished_name
            .push(DnType::OrganizationName, format!("{} clients", self.name));
        p.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
        self.sign(stem, p, Alg::EcdsaP256, 30)
    }

    fn sign(&self, stem: &str, mut p: CertificateParams, alg: Alg, days: i64) -> CertPair {
        let now = time::OffsetDateTime::now_utc();
        p.not_before = now - time::Duration::days(1);
        p.not_after = now + time::Duration::days(days);
        let key = alg.key();
        let cert = p.signed_by(&key, &self.issuer).expect("sign test cert");
        let pair = CertPair {
            cert: self.dir.join(format!("{stem}.pem")),
            key: self.dir.join(format!("{stem}.key")),
        };
        std::fs::write(&pair.cert, cert.pem()).unwrap();
        std::fs::write(&pair.key, key.serialize_pem()).unwrap();
        pair
    }
}
