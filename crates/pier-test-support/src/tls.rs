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

/// A blocking rustls client for tests: one TLS connection, raw HTTP/1.1
/// requests on it, and what the handshake agreed on.
pub struct TlsClient {
    stream: rustls::StreamOwned<rustls::ClientConnection, std::net::TcpStream>,
    buf: Vec<u8>,
}

/// Client settings; one `ClientConfig` keeps its session cache, so a second
/// connection made from the same `TlsClientConfig` can resume.
#[derive(Clone)]
pub struct TlsClientConfig(pub std::sync::Arc<rustls::ClientConfig>);

impl TlsClientConfig {
    /// Trust `ca`; present `client` if given; offer `alpn`; restrict the
    /// signature schemes offered to `schemes` when given (RSA/ECDSA choice).
    pub fn new(
        ca: &Path,
        client: Option<&CertPair>,
        alpn: &[&str],
        schemes: Option<Vec<rustls::SignatureScheme>>,
    ) -> TlsClientConfig {
        use rustls::pki_types::pem::PemObject;
        use rustls::pki_types::{CertificateDer, PrivateKeyDer};
        let mut roots = rustls::RootCertStore::empty();
        for c in CertificateDer::pem_file_iter(ca).unwrap() {
            roots.add(c.unwrap()).unwrap();
        }
        let mut provider = rustls::crypto::aws_lc_rs::default_provider();
        if let Some(s) = schemes {
            // Only what the client may verify: the server must sign with one.
            let algs = provider.signature_verification_algorithms;
            let mapping: &'static [(
                rustls::SignatureScheme,
                &'static [&'static dyn rustls::pki_types::SignatureVerificationAlgorithm],
            )] = Box::leak(
                algs.mapping
                    .iter()
                    .filter(|(k, _)| s.contains(k))
                    .cloned()
                    .collect::<Vec<_>>()
                    .into_boxed_slice(),
            );
            provider.signature_verification_algorithms =
                rustls::crypto::WebPkiSupportedAlgorithms {
                    all: algs.all,
                    mapping,
                };
        }
        let b = rustls::ClientConfig::builder_with_provider(std::sync::Arc::new(provider))
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_root_certificates(roots);
        let mut cfg = match client {
            Some(c) => b
                .with_client_auth_cert(
                    CertificateDer::pem_file_iter(&c.cert)
                        .unwrap()
                        .map(|c| c.unwrap())
                        .collect(),
                    PrivateKeyDer::from_pem_file(&c.key).unwrap(),
                )
                .unwrap(),
            None => b.with_no_client_auth(),
        };
        cfg.alpn_protocols = alpn.iter().map(|a| a.as_bytes().to_vec()).collect();
        TlsClientConfig(std::sync::Arc::new(cfg))
    }
}

impl TlsClient {
    /// Connect and finish the handshake (10 s limits).
    pub fn connect(
        addr: std::net::SocketAddr,
        sni: &str,
        cfg: &TlsClientConfig,
    ) -> std::io::Result<TlsClient> {
        TlsClient::connect_after(addr, sni, cfg, b"")
    }

    /// As [`TlsClient::connect`], sending `preface` on the TCP connection
    /// before the handshake (a PROXY protocol header, as a balancer does).
    pub fn connect_after(
        addr: std::net::SocketAddr,
        sni: &str,
        cfg: &TlsClientConfig,
        preface: &[u8],
    ) -> std::io::Result<TlsClient> {
        use std::io::Write;
        let mut tcp =
            std::net::TcpStream::connect_timeout(&addr, std::time::Duration::from_secs(10))?;
        tcp.write_all(preface)?;
        tcp.set_read_timeout(Some(std::time::Duration::from_secs(10)))?;
        tcp.set_write_timeout(Some(std::time::Duration::from_secs(10)))?;
        let name = rustls::pki_types::ServerName::try_from(sni.to_string())
            .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidInput, e))?;
        let conn = rustls::ClientConnection::new(cfg.0.clone(), name)
            .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidInput, e))?;
        let mut stream = rustls::StreamOwned::new(conn, tcp);
        while stream.conn.is_handshaking() {
            stream.conn.complete_io(&mut stream.sock)?;
        }
        Ok(TlsClient {
            stream,
            buf: Vec::new(),
        })
    }

    pub fn conn(&self) -> &rustls::ClientConnection {
        &self.stream.conn
    }

    /// The server certificate's DER (to compare with a file's).
    pub fn peer_cert(&self) -> Vec<u8> {
        self.stream
            .conn
            .peer_certificates()
            .and_then(|c| c.first())
            .map(|c| c.to_vec())
            .unwrap_or_default()
    }

    pub fn resumed(&self) -> bool {
        self.stream.conn.handshake_kind() == Some(rustls::HandshakeKind::Resumed)
    }

    /// Send a GET with `Connection: close` and read until the server closes:
    /// the bytes, or `UnexpectedEof` when it closed without a TLS
    /// close_notify (rustls tells a clean close from a truncation).
    pub fn get_until_close(&mut self, host: &str, path: &str) -> std::io::Result<Vec<u8>> {
        use std::io::{Read, Write};
        let req = format!("GET {path} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n");
        self.stream.write_all(req.as_bytes())?;
        self.stream.flush()?;
        let mut all = std::mem::take(&mut self.buf);
        self.stream.read_to_end(&mut all)?;
        Ok(all)
    }

    /// Send a GET with Host `host`; read one response with a Content-Length
    /// or chunked body (Pier's codec). Returns (status, headers, body).
    pub fn get(&mut self, host: &str, path: &str) -> std::io::Result<crate::Response> {
        use std::io::{Read, Write};
        let req = format!("GET {path} HTTP/1.1\r\nHost: {host}\r\n\r\n");
        self.stream.write_all(req.as_bytes())?;
        self.stream.flush()?;
        let limits = pier_http::HeadLimits::default();
        loop {
            let mut head = pier_http::ResponseHead::default();
            if let Ok(Some(n)) = head.parse(&self.buf, &limits) {
                let len = match head.body_len(pier_http::Method::Get) {
                    Ok(pier_http::BodyLen::Length(l)) => l as usize,
                    _ => 0,
                };
                while self.buf.len() < n + len {
                    let mut b = [0u8; 16384];
                    let k = self.stream.read(&mut b)?;
                    if k == 0 {
                        return Err(std::io::ErrorKind::UnexpectedEof.into());
                    }
                    self.buf.extend_from_slice(&b[..k]);
                }
                let body = self.buf[n..n + len].to_vec();
                let headers = head
                    .headers
                    .iter()
                    .map(|(k, v)| {
                        (
                            String::from_utf8_lossy(k).into_owned(),
                            String::from_utf8_lossy(v).into_owned(),
                        )
                    })
                    .collect();
                self.buf.drain(..n + len);
                return Ok(crate::Response {
                    status: head.status,
                    headers,
                    body_len: body.len() as u64,
                    body,
                    ..Default::default()
                });
            }
            let mut b = [0u8; 16384];
            let k = self.stream.read(&mut b)?;
            if k == 0 {
                return Err(std::io::ErrorKind::UnexpectedEof.into());
            }
            self.buf.extend_from_slice(&b[..k]);
        }
    }
}

/// The DER of the first certificate in a PEM file.
pub fn cert_der(pem: &Path) -> Vec<u8> {
    use rustls::pki_types::pem::PemObject;
    rustls::pki_types::CertificateDer::pem_file_iter(pem)
        .unwrap()
        .next()
        .unwrap()
        .unwrap()
        .to_vec()
}

/// A rustls server config for a test's own TLS server (an origin that is
/// not Pier): `pair`'s chain and key, offering `alpn`.
pub fn server_config(pair: &CertPair, alpn: &[&[u8]]) -> std::sync::Arc<rustls::ServerConfig> {
    use rustls::pki_types::pem::PemObject;
    use rustls::pki_types::{CertificateDer, PrivateKeyDer};
    let chain: Vec<CertificateDer<'static>> = CertificateDer::pem_file_iter(&pair.cert)
        .unwrap()
        .map(|c| c.unwrap())
        .collect();
    let key = PrivateKeyDer::from_pem_file(&pair.key).unwrap();
    let mut cfg = rustls::ServerConfig::builder()
        .with_no_client_auth()
        .with_single_cert(chain, key)
        .unwrap();
    cfg.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
    std::sync::Arc::new(cfg)
}
