//! `sslhandshake` on cosockets (rustls) against local rustls servers with
//! certificates from a CA made here (rcgen): verification with and without
//! a server name, SNI, a name mismatch, an untrusted CA, no verification,
//! a TLS connection kept alive and reused, a cleartext peer.
//!
//! Its own test binary: the trust store is the system's, read once per
//! process, and this test points it (`SSL_CERT_FILE`) at its CA first.

mod support;

use std::io::{BufRead, BufReader, Write};
use std::net::TcpListener;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use pier_lua::{Flow, RequestCtx};
use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, Issuer, KeyPair};
use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer};
use support::*;

struct Ca {
    issuer: Issuer<'static, KeyPair>,
    pem: String,
}

fn ca(name: &str) -> Ca {
    let key = KeyPair::generate().unwrap();
    let mut p = CertificateParams::new(Vec::<String>::new()).unwrap();
    p.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    p.distinguished_name.push(DnType::CommonName, name);
    let cert = p.self_signed(&key).unwrap();
    Ca {
        pem: cert.pem(),
        issuer: Issuer::new(p, key),
    }
}

/// A TLS line server (`ECHO x` → `x\r\n`) with a certificate for
/// `localhost` and 127.0.0.1 from `ca`; its port, accept count, and the SNI
/// of each handshake.
/// The SNI of each completed handshake.
type Snis = Arc<Mutex<Vec<Option<String>>>>;

fn tls_server(ca: &Ca) -> (u16, Arc<AtomicUsize>, Snis) {
    let key = KeyPair::generate().unwrap();
    let p = CertificateParams::new(vec!["localhost".to_owned(), "127.0.0.1".to_owned()]).unwrap();
    let cert = p.signed_by(&key, &ca.issuer).unwrap();
    let cfg = Arc::new(
        rustls::ServerConfig::builder_with_provider(Arc::new(
            rustls::crypto::aws_lc_rs::default_provider(),
        ))
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_no_client_auth()
        .with_single_cert(
            vec![CertificateDer::from(cert.der().to_vec())],
            PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(key.serialize_der())),
        )
        .unwrap(),
    );
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = l.local_addr().unwrap().port();
    let accepts = Arc::new(AtomicUsize::new(0));
    let snis: Snis = Arc::default();
    let (a2, s2) = (accepts.clone(), snis.clone());
    std::thread::spawn(move || {
        for s in l.incoming().take(20) {
            let Ok(mut s) = s else { continue };
            a2.fetch_add(1, Ordering::SeqCst);
            let (cfg, snis) = (cfg.clone(), s2.clone());
            std::thread::spawn(move || {
                s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
                let mut conn = rustls::ServerConnection::new(cfg).unwrap();
                while conn.is_handshaking() {
                    if conn.complete_io(&mut s).is_err() {
                        return;
                    }
                }
                snis.lock()
                    .unwrap()
                    .push(conn.server_name().map(str::to_owned));
                let mut tls = BufReader::new(rustls::StreamOwned::new(conn, s));
                let mut line = String::new();
                loop {
                    line.clear();
                    match tls.read_line(&mut line) {
                        Ok(0) | Err(_) => return,
                        Ok(_) => {}
                    }
                    let x = line.trim_end().strip_prefix("ECHO ").unwrap_or("?");
                    let out = format!("{x}\r\n");
                    let w = tls.get_mut();
                    if w.write_all(out.as_bytes())
                        .and_then(|()| w.flush())
                        .is_err()
                    {
                        return;
                    }
                }
            });
        }
    });
    (port, accepts, snis)
}

#[test]
fn sslhandshake_verification_sni_and_pooled_tls() {
    let dir = std::env::temp_dir().join(format!("pier-ngxsock-tls-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let good = ca("pier good CA");
    let bad = ca("pier untrusted CA");
    let bundle = dir.join("ca.pem");
    std::fs::write(&bundle, &good.pem).unwrap();
    // Before any handshake in this process: the trust store is read once.
    std::env::set_var("SSL_CERT_FILE", &bundle);
    std::env::remove_var("SSL_CERT_DIR");

    let (port, accepts, snis) = tls_server(&good);
    let (bad_port, _, _) = tls_server(&bad);
    let plain = TcpListener::bind("127.0.0.1:0").unwrap();
    let plain_port = plain.local_addr().unwrap().port();
    std::thread::spawn(move || {
        if let Ok((mut s, _)) = plain.accept() {
            let _ = s.write_all(b"HTTP/1.0 400 Bad Request\r\n\r\n");
        }
    });

    let e = access_engine(&format!(
        r#"
        local socket = require "pier.ngx_socket"
        local function tcp()
          local s = socket.tcp()
          s:settimeouts(3000, 3000, 3000)
          return s
        end
        local s = tcp()
        assert(s:connect("127.0.0.1", {port}))
        local sess, err = s:sslhandshake(nil, "localhost", true)
        assert(sess, err)
        assert(tostring(sess) == "ssl session")
        assert(s:send("ECHO tls\n") == 9)
        assert(s:receive() == "tls")
        assert(s:setkeepalive())

        -- the pooled connection comes back TLS: sslhandshake returns at once
        local s2 = tcp()
        assert(s2:connect("127.0.0.1", {port}))
        assert(s2:getreusedtimes() == 1)
        assert(s2:sslhandshake(false, "localhost", true) == true)
        assert(s2:send("ECHO again\n") and s2:receive() == "again")
        s2:close()

        -- the certificate does not name other.test
        local m = tcp()
        assert(m:connect("127.0.0.1", {port}))
        local ok, err = m:sslhandshake(false, "other.test", true)
        assert(ok == nil and err == "certificate host mismatch", tostring(err))
        assert(select(2, m:send("x")) == "closed")

        -- no server name: the chain is verified, no SNI is sent
        local c = tcp()
        assert(c:connect("127.0.0.1", {port}))
        assert(c:sslhandshake(false, nil, true) == true)
        assert(c:send("ECHO chain\n") and c:receive() == "chain")

        -- an untrusted CA fails verification, passes without it
        local u = tcp()
        assert(u:connect("127.0.0.1", {bad_port}))
        local ok, err = u:sslhandshake(false, "localhost", true)
        assert(ok == nil and err == "20: unable to get local issuer certificate", tostring(err))
        local u2 = tcp()
        assert(u2:connect("127.0.0.1", {bad_port}))
        assert(u2:sslhandshake(false, "localhost", false))
        assert(u2:send("ECHO nv\n") and u2:receive() == "nv")

        -- a cleartext peer
        local p = tcp()
        assert(p:connect("127.0.0.1", {plain_port}))
        local ok, err = p:sslhandshake(false, "localhost", false)
        assert(ok == nil and err == "handshake failed", tostring(err))

        assert(not pcall(s.sslhandshake, s, nil, 42))
        assert(select(2, s:sslhandshake()) == "closed")
        pier.exit(204)
        "#
    ));
    let flow = run(e.access(0, &mut TestView::default(), &mut RequestCtx::new())).unwrap();
    assert!(
        matches!(flow, Flow::Respond { status: 204, .. }),
        "{flow:?}"
    );
    // s (reused by s2), m, c.
    assert_eq!(accepts.load(Ordering::SeqCst), 3);
    // SNI as given; none without a name (the mismatch never completed).
    assert_eq!(
        *snis.lock().unwrap(),
        vec![Some("localhost".to_owned()), None]
    );
    let _ = std::fs::remove_dir_all(&dir);
}
