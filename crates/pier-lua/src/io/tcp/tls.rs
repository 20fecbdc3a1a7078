//! `sslhandshake` over rustls, polled like every other operation: the
//! connection goes into the handshake, and comes back TLS.

use std::future::Future;
use std::io;
use std::net::{IpAddr, Ipv4Addr};
use std::os::raw::c_int;
use std::pin::Pin;
use std::sync::{Arc, OnceLock};
use std::task::{Context, Poll};

use tokio::net::{TcpStream, UnixStream};
use tokio_rustls::Connect;

use super::{Conn, TcpSock, AGAIN, E_BUSY, E_CLOSED, E_CONNECTING, E_TIMEOUT};

/// A handshake under way, holding the connection.
pub(super) enum Handshake {
    Tcp(Connect<TcpStream>),
    Unix(Connect<UnixStream>),
}

impl TcpSock {
    /// `sslhandshake(server_name, ssl_verify)` (`name` empty: none),
    /// started or polled again (`retry`): 1 once the connection is TLS
    /// (at once for a pooled one that already is), [`AGAIN`], or an error
    /// (the connection is closed).
    pub(super) fn sslhandshake(
        &mut self,
        cx: &mut Context<'_>,
        name: &[u8],
        verify: bool,
        retry: bool,
    ) -> c_int {
        if !retry {
            if self.op.connect.is_some() {
                return E_CONNECTING;
            }
            if self.busy() {
                return E_BUSY;
            }
            let Some(conn) = self.conn.take() else {
                return E_CLOSED;
            };
            let hs = match conn {
                // A pooled connection, already TLS (ngx_lua returns at once).
                c @ (Conn::TlsTcp(_) | Conn::TlsUnix(_)) => {
                    self.conn = Some(c);
                    return 1;
                }
                Conn::Tcp(s) => self
                    .start(name, verify)
                    .map(|c| Handshake::Tcp(c.connect_with(s))),
                Conn::Unix(s) => self
                    .start(name, verify)
                    .map(|c| Handshake::Unix(c.connect_with(s))),
            };
            match hs {
                Ok(hs) => self.op.tls = Some(Box::new(hs)),
                Err(e) => {
                    self.close_conn();
                    return self.fail(e);
                }
            }
            self.op.armed = false;
        }
        let r = match self.op.tls.as_deref_mut() {
            Some(Handshake::Tcp(f)) => Pin::new(f)
                .poll(cx)
                .map(|r| r.map(|s| Conn::TlsTcp(Box::new(s)))),
            Some(Handshake::Unix(f)) => Pin::new(f)
                .poll(cx)
                .map(|r| r.map(|s| Conn::TlsUnix(Box::new(s)))),
            // Closed meanwhile (another light thread's `close`).
            None => return E_CLOSED,
        };
        match r {
            Poll::Ready(Ok(c)) => {
                self.op.tls = None;
                self.op.armed = false;
                self.conn = Some(c);
                1
            }
            Poll::Ready(Err(e)) => {
                self.close_conn();
                self.fail(tls_err(&e))
            }
            Poll::Pending => {
                if self.timed_out(cx, self.connect_timeout) {
                    self.close_conn();
                    return E_TIMEOUT;
                }
                AGAIN
            }
        }
    }

    /// The server name and client config of a handshake.
    fn start(&self, name: &[u8], verify: bool) -> Result<Starter, &'static str> {
        let server_name = if name.is_empty() {
            // No SNI (rustls sends none for an address), no name check.
            rustls::pki_types::ServerName::IpAddress(
                self.peer_ip
                    .unwrap_or(IpAddr::V4(Ipv4Addr::UNSPECIFIED))
                    .into(),
            )
        } else {
            std::str::from_utf8(name)
                .ok()
                .and_then(|n| rustls::pki_types::ServerName::try_from(n.to_owned()).ok())
                .ok_or("bad server name")?
        };
        let cfg = tls_config(verify, !name.is_empty())?;
        Ok(Starter(tokio_rustls::TlsConnector::from(cfg), server_name))
    }
}

/// A connector and the server name it is for.
struct Starter(
    tokio_rustls::TlsConnector,
    rustls::pki_types::ServerName<'static>,
);

impl Starter {
    fn connect_with<IO>(self, io: IO) -> Connect<IO>
    where
        IO: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
    {
        self.0.connect(self.1, io)
    }
}

/// The three client configs (`ssl_verify` with a server name, without
/// one, no verification), built once per process. Sessions are cached by
/// rustls (in memory, per server name): `reused_session` is not needed.
fn tls_config(verify: bool, named: bool) -> Result<Arc<rustls::ClientConfig>, &'static str> {
    static CFG: OnceLock<[Option<Arc<rustls::ClientConfig>>; 3]> = OnceLock::new();
    let cfgs = CFG.get_or_init(build_tls_configs);
    let i = match (verify, named) {
        (true, true) => 0,
        (true, false) => 1,
        (false, _) => 2,
    };
    cfgs[i]
        .clone()
        .ok_or("20: unable to get local issuer certificate")
}

fn build_tls_configs() -> [Option<Arc<rustls::ClientConfig>>; 3] {
    let provider = Arc::new(rustls::crypto::aws_lc_rs::default_provider());
    let builder = || {
        rustls::ClientConfig::builder_with_provider(provider.clone())
            .with_safe_default_protocol_versions()
            .ok()
    };
    // The system trust store (`SSL_CERT_FILE` / `SSL_CERT_DIR` override it).
    let mut roots = rustls::RootCertStore::empty();
    let (added, _) =
        roots.add_parsable_certificates(rustls_native_certs::load_native_certs().certs);
    let roots = Arc::new(roots);
    let webpki = (added > 0)
        .then(|| {
            rustls::client::WebPkiServerVerifier::builder_with_provider(
                roots.clone(),
                provider.clone(),
            )
            .build()
            .ok()
        })
        .flatten();
    let named = webpki.as_ref().and_then(|_| {
        Some(Arc::new(
            builder()?
                .with_root_certificates(roots.clone())
                .with_no_client_auth(),
        ))
    });
    let chain_only = webpki.and_then(|v| {
        Some(Arc::new(
            builder()?
                .dangerous()
                .with_custom_certificate_verifier(Arc::new(ChainOnly(v)))
                .with_no_client_auth(),
        ))
    });
    let none = builder().map(|b| {
        Arc::new(
            b.dangerous()
                .with_custom_certificate_verifier(Arc::new(pier_tls::NoVerify(provider.clone())))
                .with_no_client_auth(),
        )
    });
    [named, chain_only, none]
}

use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use rustls::{CertificateError, DigitallySignedStruct, SignatureScheme};

/// `ssl_verify` without a server name: the chain is verified, not the
/// name (ngx_lua checks the name only when one is given).
#[derive(Debug)]
struct ChainOnly(Arc<rustls::client::WebPkiServerVerifier>);

impl ServerCertVerifier for ChainOnly {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &ServerName<'_>,
        ocsp: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        match self
            .0
            .verify_server_cert(end_entity, intermediates, server_name, ocsp, now)
        {
            Err(rustls::Error::InvalidCertificate(
                CertificateError::NotValidForName | CertificateError::NotValidForNameContext { .. },
            )) => Ok(ServerCertVerified::assertion()),
            r => r,
        }
    }
    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.0.verify_tls12_signature(message, cert, dss)
    }
    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.0.verify_tls13_signature(message, cert, dss)
    }
    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.0.supported_verify_schemes()
    }
}

/// A failed handshake as ngx_lua reports it (OpenSSL's verify codes).
fn tls_err(e: &io::Error) -> &'static str {
    let Some(re) = e.get_ref().and_then(|i| i.downcast_ref::<rustls::Error>()) else {
        return "handshake failed";
    };
    match re {
        rustls::Error::InvalidCertificate(c) => match c {
            CertificateError::UnknownIssuer => "20: unable to get local issuer certificate",
            CertificateError::Expired | CertificateError::ExpiredContext { .. } => {
                "10: certificate has expired"
            }
            CertificateError::NotValidYet | CertificateError::NotValidYetContext { .. } => {
                "9: certificate is not yet valid"
            }
            CertificateError::NotValidForName | CertificateError::NotValidForNameContext { .. } => {
                "certificate host mismatch"
            }
            CertificateError::Revoked => "23: certificate revoked",
            CertificateError::BadSignature => "7: certificate signature failure",
            _ => "certificate verify failed",
        },
        _ => "handshake failed",
    }
}
