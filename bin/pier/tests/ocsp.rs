//! OCSP stapling (issue 35, item 5) against OpenSSL's own responder
//! (`openssl ocsp`), read back with `openssl s_client -status`, TLS 1.3 and
//! 1.2. Certificates, the CA's index and the responders are made here.

mod common;

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use common::*;

fn openssl(dir: &Path, args: &[&str]) {
    let out = Command::new("openssl")
        .args(args)
        .current_dir(dir)
        .output()
        .expect("run openssl");
    assert!(
        out.status.success(),
        "openssl {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A P-256 key and a certificate for `name` signed by `ca` (`ca.pem`,
/// `ca.key` in `dir`), its chain file (certificate, then the CA), and its
/// serial in hex. `ext` are extra x509v3 lines.
fn issue(dir: &Path, ca: &str, name: &str, ext: &str) -> (PathBuf, PathBuf, String) {
    openssl(
        dir,
        &[
            "req",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:P-256",
            "-nodes",
            "-keyout",
            &format!("{name}.key"),
            "-out",
            &format!("{name}.csr"),
            "-subj",
            &format!("/CN={name}"),
        ],
    );
    std::fs::write(dir.join(format!("{name}.ext")), ext).unwrap();
    openssl(
        dir,
        &[
            "x509",
            "-req",
            "-in",
            &format!("{name}.csr"),
            "-CA",
            &format!("{ca}.pem"),
            "-CAkey",
            &format!("{ca}.key"),
            "-CAcreateserial",
            "-days",
            "30",
            "-out",
            &format!("{name}.pem"),
            "-extfile",
            &format!("{name}.ext"),
        ],
    );
    let chain = [
        std::fs::read_to_string(dir.join(format!("{name}.pem"))).unwrap(),
        std::fs::read_to_string(dir.join(format!("{ca}.pem"))).unwrap(),
    ]
    .concat();
    std::fs::write(dir.join(format!("{name}.chain.pem")), chain).unwrap();
    let out = Command::new("openssl")
        .args(["x509", "-noout", "-serial", "-in", &format!("{name}.pem")])
        .current_dir(dir)
        .output()
        .unwrap();
    let serial = String::from_utf8_lossy(&out.stdout)
        .trim()
        .trim_start_matches("serial=")
        .to_string();
    (
        dir.join(format!("{name}.chain.pem")),
        dir.join(format!("{name}.key")),
        serial,
    )
}

fn self_signed_ca(dir: &Path, name: &str) {
    openssl(
        dir,
        &[
            "req",
            "-x509",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:P-256",
            "-nodes",
            "-keyout",
            &format!("{name}.key"),
            "-out",
            &format!("{name}.pem"),
            "-subj",
            &format!("/CN={name}"),
            "-days",
            "30",
            "-addext",
            "basicConstraints=critical,CA:TRUE",
            "-addext",
            "keyUsage=critical,keyCertSign,cRLSign,digitalSignature",
        ],
    );
}

/// `openssl ocsp` on `port`, answering from `index.txt`, signing with
/// `signer` (`.pem`/`.key`). Killed on drop.
struct Responder(Child);

impl Responder {
    fn start(dir: &Path, port: u16, signer: &str) -> Responder {
        let log = std::fs::File::create(dir.join(format!("ocsp-{port}.log"))).unwrap();
        let mut child = Command::new("openssl")
            .args([
                "ocsp",
                "-index",
                "index.txt",
                "-port",
                &port.to_string(),
                "-rsigner",
                &format!("{signer}.pem"),
                "-rkey",
                &format!("{signer}.key"),
                "-CA",
                "ca.pem",
                "-nmin",
                "60",
                "-ignore_err",
            ])
            .current_dir(dir)
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .expect("start openssl ocsp");
        // Ready when it says so: a connection opened and closed to probe it
        // wedges `openssl ocsp` (it serves one connection at a time).
        let log = dir.join(format!("ocsp-{port}.log"));
        let up = wait_until(Duration::from_secs(10), || {
            matches!(child.try_wait(), Ok(Some(_)))
                || std::fs::read_to_string(&log)
                    .is_ok_and(|l| l.contains("waiting for OCSP client connections"))
        });
        assert!(
            up && matches!(child.try_wait(), Ok(None)),
            "openssl ocsp did not start on {port}: {}",
            std::fs::read_to_string(dir.join(format!("ocsp-{port}.log"))).unwrap_or_default()
        );
        Responder(child)
    }
}

impl Drop for Responder {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// What `openssl s_client -status` says of the staple for `name`.
fn status_of(addr: SocketAddr, name: &str, tls12: bool) -> String {
    let connect = addr.to_string();
    let mut args = vec![
        "s_client",
        "-connect",
        &connect,
        "-servername",
        name,
        "-status",
    ];
    if tls12 {
        args.push("-tls1_2");
    }
    let out = run_with_timeout(
        Command::new("openssl").args(&args).stdin(Stdio::null()),
        Duration::from_secs(20),
    );
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    if text.contains("OCSP response: no response sent") {
        return "none".into();
    }
    for s in ["good", "revoked", "unknown"] {
        if text.contains(&format!("Cert Status: {s}")) {
            return s.into();
        }
    }
    format!("unexpected s_client output:\n{text}")
}

fn config(origin: SocketAddr, certs: &[(&Path, &Path)], extra: &str) -> String {
    let list: Vec<String> = certs
        .iter()
        .map(|(c, k)| {
            format!(
                "{{ cert = \"{}\", key = \"{}\" }}",
                c.display(),
                k.display()
            )
        })
        .collect();
    format!(
        r#"[server]
workers = 2
grace_period = "5s"
[admin]
listen = "127.0.0.1:0"
[log]
access = "off"

[[listener]]
name = "main"
listen = "127.0.0.1:0"
[listener.tls]
certificates = [{}]
{extra}

[[route]]
name = "default"
upstream = "app"

[upstream.app]
servers = ["{origin}"]
"#,
        list.join(", ")
    )
}

fn fetched(p: &PierProcess, result: &str) -> f64 {
    p.metric_value(&format!(
        "pier_tls_ocsp_fetches_total{{result=\"{result}\"}}"
    ))
    .unwrap_or(0.0)
}

#[test]
fn staples_good_and_revoked_refuses_forged_and_keeps_staples_across_a_reload() {
    let dir = TempDir::new();
    let d = dir.path();
    self_signed_ca(d, "ca");
    // The responder signs with a certificate the CA delegated OCSP to.
    issue(
        d,
        "ca",
        "responder",
        "extendedKeyUsage=OCSPSigning\nbasicConstraints=CA:FALSE\n",
    );
    // A second responder signs with a key the CA never vouched for.
    self_signed_ca(d, "mallory");
    let (good_port, forged_port) = (free_port(), free_port());
    let down = dead_addr();
    let leaf = |port: u16, name: &str| {
        format!(
            "subjectAltName=DNS:{name}\nextendedKeyUsage=serverAuth\nauthorityInfoAccess=OCSP;URI:http://127.0.0.1:{port}/\n"
        )
    };
    let good = issue(d, "ca", "good.test", &leaf(good_port, "good.test"));
    let revoked = issue(d, "ca", "revoked.test", &leaf(good_port, "revoked.test"));
    let forged = issue(d, "ca", "forged.test", &leaf(forged_port, "forged.test"));
    let unreachable = issue(d, "ca", "down.test", &leaf(down.port(), "down.test"));
    let plain = issue(d, "ca", "plain.test", "subjectAltName=DNS:plain.test\n");
    // OpenSSL's CA index: V(alid) or R(evoked), expiry, revocation time, serial.
    let index = [
        format!("V\t301231235959Z\t\t{}\tunknown\t/CN=good.test\n", good.2),
        format!(
            "R\t301231235959Z\t260101000000Z\t{}\tunknown\t/CN=revoked.test\n",
            revoked.2
        ),
        format!(
            "V\t301231235959Z\t\t{}\tunknown\t/CN=forged.test\n",
            forged.2
        ),
    ]
    .concat();
    std::fs::write(d.join("index.txt"), index).unwrap();
    std::fs::write(d.join("index.txt.attr"), "unique_subject = no\n").unwrap();
    let _ok = Responder::start(d, good_port, "responder");
    let _forger = Responder::start(d, forged_port, "mallory");

    let origin = Origin::start_named("behind-tls");
    let certs: Vec<(&Path, &Path)> = [&good, &revoked, &forged, &unreachable, &plain]
        .iter()
        .map(|c| (c.0.as_path(), c.1.as_path()))
        .collect();
    let mut pier = pier(&config(origin.addr(), &certs, ""));
    let addr = pier.listener("main");

    // Two good answers (good, revoked); the forged one and the unreachable
    // responder fail, and are tried again later.
    assert!(
        wait_until(Duration::from_secs(20), || fetched(&pier, "ok") >= 2.0
            && fetched(&pier, "failed") >= 2.0),
        "fetches: ok {} failed {}\n{}",
        fetched(&pier, "ok"),
        fetched(&pier, "failed"),
        pier.logs()
    );
    assert_eq!(pier.metric_value("pier_tls_ocsp_stapled"), Some(2.0));
    assert_eq!(pier.metric_value("pier_tls_ocsp_certificates"), Some(4.0));
    for tls12 in [false, true] {
        assert_eq!(
            status_of(addr, "good.test", tls12),
            "good",
            "TLS 1.2: {tls12}"
        );
        assert_eq!(status_of(addr, "revoked.test", tls12), "revoked");
        assert_eq!(status_of(addr, "forged.test", tls12), "none");
        assert_eq!(status_of(addr, "down.test", tls12), "none");
        assert_eq!(status_of(addr, "plain.test", tls12), "none");
    }
    let logs = pier.logs();
    assert!(logs.contains("bad response signature"), "{logs}");
    assert!(logs.contains("REVOKED"), "{logs}");

    // A reload staples at once from what the process holds: no new fetch
    // is needed before the first handshake.
    let ok_before = fetched(&pier, "ok");
    pier.rewrite_config(&config(origin.addr(), &certs, ""));
    pier.signal(sig::SIGHUP);
    pier.wait_generation(2);
    assert_eq!(status_of(addr, "good.test", false), "good");
    assert_eq!(fetched(&pier, "ok"), ok_before);

    // Off: no staple, and nothing more fetched for it.
    pier.rewrite_config(&config(origin.addr(), &certs, "ocsp_stapling = false"));
    pier.signal(sig::SIGHUP);
    pier.wait_generation(3);
    assert_eq!(status_of(addr, "good.test", false), "none");
    assert!(wait_until(Duration::from_secs(10), || pier
        .metric_value("pier_tls_ocsp_certificates")
        == Some(0.0)));
}

#[test]
fn ocsp_responder_overrides_the_certificates_own_and_a_chain_without_issuer_is_served_plain() {
    let dir = TempDir::new();
    let d = dir.path();
    self_signed_ca(d, "ca");
    let port = free_port();
    // The certificate names a responder that is down; the config's is up.
    let down = dead_addr();
    let site = issue(
        d,
        "ca",
        "site.test",
        &format!(
            "subjectAltName=DNS:site.test\nauthorityInfoAccess=OCSP;URI:http://127.0.0.1:{}/\n",
            down.port()
        ),
    );
    std::fs::write(
        d.join("index.txt"),
        format!("V\t301231235959Z\t\t{}\tunknown\t/CN=site.test\n", site.2),
    )
    .unwrap();
    let _r = Responder::start(d, port, "ca");
    // Only the leaf: its issuer cannot be named to a responder.
    let leaf_only = d.join("site.test.pem");
    let origin = Origin::start_named("behind-tls");
    let extra = format!("ocsp_responder = \"http://127.0.0.1:{port}/ocsp\"");
    let pier = pier(&config(origin.addr(), &[(&site.0, &site.1)], &extra));
    let addr = pier.listener("main");
    assert!(wait_until(Duration::from_secs(20), || fetched(&pier, "ok") >= 1.0));
    assert_eq!(status_of(addr, "site.test", false), "good");
    assert_eq!(fetched(&pier, "failed"), 0.0);
    drop(pier);

    let pier = common::pier(&config(origin.addr(), &[(&leaf_only, &site.1)], &extra));
    assert_eq!(status_of(pier.listener("main"), "site.test", false), "none");
    assert!(
        pier.logs().contains("needs the issuer's certificate"),
        "{}",
        pier.logs()
    );
}
