//! An upstream's TLS: the rustls client config its connections are made with.

use crate::certs::{read_chain, read_key, roots_from};
use pier_config::UpstreamTls;
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use rustls::{ClientConfig, DigitallySignedStruct, SignatureScheme};
use std::sync::{Arc, OnceLock};

/// One upstream group's TLS (shared by every worker; rebuilt on reload).
#[derive(Debug, Clone)]
pub struct ClientTls {
    pub config: Arc<ClientConfig>,
    /// SNI and verified name when configured; else each server's host name
    /// (or its IP address, verified against the certificate's IP SANs).
    pub server_name: Option<Arc<str>>,
    pub verify: bool,
}

/// The system's trust store, read once (it is tens of files).
fn system_roots() -> Result<Arc<rustls::RootCertStore>, String> {
    static R: OnceLock<Result<Arc<rustls::RootCertStore>, String>> = OnceLock::new();
    R.get_or_init(|| {
        let found = rustls_native_certs::load_native_certs();
        let mut roots = rustls::RootCertStore::empty();
        let (added, _) = roots.add_parsable_certificates(found.certs);
        if added == 0 {
            return Err(format!(
                "the system trust store has no usable CA certificate ({} error(s)); install ca-certificates or set `ca`",
                found.errors.len()
            ));
        }
        Ok(Arc::new(roots))
    })
    .clone()
}

impl ClientTls {
    /// `h2`: offer ALPN `h2` (HTTP/2 upstream) instead of `http/1.1`.
    pub fn build(upstream: &str, cfg: &UpstreamTls, h2: bool) -> Result<ClientTls, String> {
        let provider = crate::provider();
        let ctx = |e: String| format!("upstream `{upstream}`: tls: {e}");
        let roots = match &cfg.ca {
            Some(ca) => Arc::new(roots_from(ca).map_err(ctx)?),
            None if cfg.verify => system_roots().map_err(ctx)?,
            None => Arc::new(rustls::RootCertStore::empty()),
        };
        let builder = ClientConfig::builder_with_provider(provider.clone())
            .with_safe_default_protocol_versions()
            .map_err(|e| ctx(e.to_string()))?
            .with_root_certificates(roots);
        let mut config = match &cfg.client_cert {
            Some(f) => {
                let chain = read_chain(&f.cert).map_err(ctx)?;
                let key = read_key(&f.key).map_err(ctx)?;
                builder
                    .with_client_auth_cert(chain, key)
                    .map_err(|e| ctx(format!("client certificate: {e}")))?
            }
            None => builder.with_no_client_auth(),
        };
        if !cfg.verify {
            config
                .dangerous()
                .set_certificate_verifier(Arc::new(NoVerify(provider)));
        }
        config.alpn_protocols = vec![if h2 {
            b"h2".to_vec()
        } else {
            b"http/1.1".to_vec()
        }];
        config.resumption = if cfg.session_resumption {
            rustls::client::Resumption::in_memory_sessions(1024)
        } else {
            rustls::client::Resumption::disabled()
        };
        if let Some(n) = &cfg.server_name {
            ServerName::try_from(n.as_str()).map_err(|e| ctx(format!("server_name {n:?}: {e}")))?;
        }
        Ok(ClientTls {
            config: Arc::new(config),
            server_name: cfg.server_name.as_deref().map(Arc::from),
            verify: cfg.verify,
        })
    }
}

/// `verify = false`: accepts any certificate (signatures are still checked,
/// so the session keys belong to whoever holds the certificate's key).
/// Also behind Lua cosockets' `sslhandshake(..., ssl_verify = false)`.
#[derive(Debug)]
pub struct NoVerify(pub Arc<rustls::crypto::CryptoProvider>);

impl ServerCertVerifier for NoVerify {
    fn verify_server_cert(
        &self,
        _end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp: &[u8],
        _now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        Ok(ServerCertVerified::assertion())
    }
    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }
    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }
    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.0.signature_verification_algorithms.supported_schemes()
    }
}
