//! ACME (issue 35, item 4) against Pebble, Let's Encrypt's test CA, with
//! pebble-challtestsrv as its DNS (every name → 127.0.0.1): Pier orders a
//! certificate for two names, answers Pebble's TLS-ALPN-01 validations on
//! its own listener, serves what it got (curl verifies it against Pebble's
//! root), and a restarted Pier serves the stored one without a new order.
//! `.ci/install` installs both (`go install`) and names them in
//! PEBBLE, PEBBLE_CHALLTESTSRV and PEBBLE_CERTS.

mod common;

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use common::*;

fn env_path(var: &str) -> PathBuf {
    PathBuf::from(std::env::var(var).unwrap_or_else(|_| {
        panic!(
            "{var} is not set: run .ci/install (it installs Pebble) and source target/test-env.sh"
        )
    }))
}

/// Pebble and its DNS, killed on drop.
struct Pebble {
    children: Vec<Child>,
    directory: String,
    /// CA file for Pebble's own HTTPS (directory and management).
    minica: PathBuf,
    /// The root that signs what Pebble issues (new at every start).
    root: PathBuf,
    /// `https://127.0.0.1:PORT`, its management address (roots, ARI).
    mgmt: String,
    _dir: TempDir,
}

impl Drop for Pebble {
    fn drop(&mut self) {
        for c in &mut self.children {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

impl Pebble {
    /// Validations go to `tls_port` on 127.0.0.1.
    fn start(tls_port: u16) -> Pebble {
        Pebble::start_ports(tls_port, free_port())
    }

    /// TLS-ALPN-01 validations go to `tls_port`, HTTP-01 to `http`.
    fn start_ports(tls_port: u16, http: u16) -> Pebble {
        let dir = TempDir::new();
        let certs = env_path("PEBBLE_CERTS");
        let d = dir.path();
        for (from, to) in [
            ("localhost/cert.pem", "cert.pem"),
            ("localhost/key.pem", "key.pem"),
            ("pebble.minica.pem", "minica.pem"),
        ] {
            std::fs::write(d.join(to), std::fs::read(certs.join(from)).unwrap()).unwrap();
        }
        let (acme, mgmt, dns, cts) = (free_port(), free_port(), free_port(), free_port());
        let cfg = d.join("pebble.json");
        std::fs::write(
            &cfg,
            format!(
                r#"{{"pebble":{{"listenAddress":"127.0.0.1:{acme}","managementListenAddress":"127.0.0.1:{mgmt}",
"certificate":"{c}","privateKey":"{k}","httpPort":{http},"tlsPort":{tls_port},
"ocspResponderURL":"","externalAccountBindingRequired":false,"keyAlgorithm":"ecdsa"}}}}"#,
                c = d.join("cert.pem").display(),
                k = d.join("key.pem").display(),
            ),
        )
        .unwrap();
        let log = |name: &str| std::fs::File::create(d.join(name)).unwrap();
        let dns_addr = format!("127.0.0.1:{dns}");
        let challtestsrv = Command::new(env_path("PEBBLE_CHALLTESTSRV"))
            .args(["-dnsserver", &dns_addr])
            .args(["-management", &format!("127.0.0.1:{cts}")])
            .args(["-defaultIPv4", "127.0.0.1", "-defaultIPv6", ""])
            .args(["-http01", "", "-https01", "", "-tlsalpn01", "", "-doh", ""])
            .stdin(Stdio::null())
            .stdout(log("challtestsrv.log"))
            .stderr(log("challtestsrv.err"))
            .spawn()
            .expect("start pebble-challtestsrv");
        let pebble = Command::new(env_path("PEBBLE"))
            .arg("-config")
            .arg(&cfg)
            .args(["-dnsserver", &dns_addr])
            .env("PEBBLE_VA_NOSLEEP", "1")
            .env("PEBBLE_WFE_NONCEREJECT", "0")
            .env("PEBBLE_AUTHZREUSE", "0")
            .stdin(Stdio::null())
            .stdout(log("pebble.log"))
            .stderr(log("pebble.err"))
            .spawn()
            .expect("start pebble");
        let p = Pebble {
            children: vec![challtestsrv, pebble],
            directory: format!("https://127.0.0.1:{acme}/dir"),
            mgmt: format!("https://127.0.0.1:{mgmt}"),
            minica: d.join("minica.pem"),
            root: d.join("root.pem"),
            _dir: dir,
        };
        let d = p._dir.path().to_path_buf();
        let up = wait_until(Duration::from_secs(20), || {
            [acme, mgmt, cts]
                .iter()
                .all(|port| std::net::TcpStream::connect(("127.0.0.1", *port)).is_ok())
        });
        assert!(
            up,
            "pebble did not start: {}{}",
            std::fs::read_to_string(d.join("pebble.log")).unwrap_or_default(),
            std::fs::read_to_string(d.join("challtestsrv.log")).unwrap_or_default()
        );
        let out = curl(&[
            "-sS",
            "--cacert",
            &p.minica.display().to_string(),
            "-o",
            &p.root.display().to_string(),
            &format!("https://127.0.0.1:{mgmt}/roots/0"),
        ]);
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        p
    }
}

fn config(origin: SocketAddr, listen: &str, directory: &str, ca: &Path, storage: &Path) -> String {
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
listen = "{listen}"
[listener.tls]
[listener.tls.acme]
domains = ["site.test", "www.site.test"]
email = "ops@site.test"
directory = "{directory}"
directory_ca = "{ca}"
storage = "{storage}"

[[route]]
name = "default"
upstream = "app"

[upstream.app]
servers = ["{origin}"]
"#,
        ca = ca.display(),
        storage = storage.display(),
    )
}

/// GET /hello on `name` through Pier at `port`, verifying its certificate
/// against `root` (curl's own TLS, OpenSSL).
fn get_verified(name: &str, port: u16, root: &Path) -> std::process::Output {
    curl(&[
        "-sS",
        "--max-time",
        "10",
        "--cacert",
        &root.display().to_string(),
        "-o",
        "/dev/null",
        "-w",
        "%{http_code}",
        "--resolve",
        &format!("{name}:{port}:127.0.0.1"),
        &format!("https://{name}:{port}/hello"),
    ])
}

fn orders(p: &PierProcess, result: &str) -> f64 {
    p.metric_value(&format!("pier_acme_orders_total{{result=\"{result}\"}}"))
        .unwrap_or(0.0)
}

#[test]
fn certificates_are_obtained_by_tls_alpn_01_served_and_kept_across_a_restart() {
    let port = free_port();
    let pebble = Pebble::start(port);
    let origin = Origin::start_named("behind-acme");
    let store = TempDir::new();
    let storage = store.path().join("acme");
    let cfg = config(
        origin.addr(),
        &format!("127.0.0.1:{port}"),
        &pebble.directory,
        &pebble.minica,
        &storage,
    );
    let pier = pier(&cfg);
    assert!(
        wait_until(Duration::from_secs(60), || orders(&pier, "ok") >= 1.0),
        "no certificate: ok {} failed {}\n{}",
        orders(&pier, "ok"),
        orders(&pier, "failed"),
        pier.logs()
    );
    // Both names, verified against Pebble's root.
    for name in ["site.test", "www.site.test"] {
        let out = get_verified(name, port, &pebble.root);
        assert!(
            out.status.success(),
            "{name}: {}\n{}",
            String::from_utf8_lossy(&out.stderr),
            pier.logs()
        );
        assert_eq!(String::from_utf8_lossy(&out.stdout), "200");
    }
    // Each of the two validations was answered (Pebble asks from several
    // vantage points), then withdrawn.
    assert!(
        pier.metric_value("pier_tls_handshake_failures_total{reason=\"acme_challenge\"}")
            .unwrap_or(0.0)
            >= 2.0
    );
    let expiry = pier
        .metric_value("pier_acme_certificate_expiry_seconds{name=\"site.test\"}")
        .unwrap_or(0.0);
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs() as f64;
    assert!(expiry > now + 86_400.0, "expiry {expiry}");
    // Stored: the key only its owner reads.
    let key = storage.join("site.test/key.pem");
    let mode =
        std::os::unix::fs::PermissionsExt::mode(&std::fs::metadata(&key).unwrap().permissions());
    assert_eq!(mode & 0o777, 0o600);
    assert!(storage.join("site.test/cert.pem").exists());
    drop(pier);

    // A restart serves the stored certificate at once, without an order.
    let pier = common::pier(&cfg);
    let out = get_verified("www.site.test", port, &pebble.root);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(String::from_utf8_lossy(&out.stdout), "200");
    assert_eq!(orders(&pier, "ok") + orders(&pier, "failed"), 0.0);
    drop(pier);

    // Renewal: with more than the certificate's life as `renew_before`,
    // the stored one is due at once; the new one replaces it on disk and
    // in the handshake, and no second order follows within the hour.
    let stored = std::fs::read_to_string(storage.join("site.test/cert.pem")).unwrap();
    let renewing = cfg.replace(
        &format!("storage = \"{}\"\n", storage.display()),
        &format!(
            "storage = \"{}\"\nrenew_before = \"1000d\"\n",
            storage.display()
        ),
    );
    assert_ne!(renewing, cfg);
    let pier = common::pier(&renewing);
    assert!(
        wait_until(Duration::from_secs(60), || orders(&pier, "ok") >= 1.0),
        "{}",
        pier.logs()
    );
    let renewed = std::fs::read_to_string(storage.join("site.test/cert.pem")).unwrap();
    assert_ne!(renewed, stored);
    let out = get_verified("site.test", port, &pebble.root);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // An order takes Pebble well under a second: without the hour's floor,
    // a second one would be counted within these 3 s.
    assert!(!wait_until(Duration::from_secs(3), || orders(&pier, "ok")
        + orders(&pier, "failed")
        > 1.0));
    drop(pier);

    // The CA down when renewal is due: counted, and the certificate Pier
    // has goes on serving.
    let root = store.path().join("root.pem");
    std::fs::copy(&pebble.root, &root).unwrap();
    drop(pebble);
    let pier = common::pier(&renewing);
    assert!(
        wait_until(Duration::from_secs(30), || orders(&pier, "failed") >= 1.0),
        "{}",
        pier.logs()
    );
    let out = get_verified("www.site.test", port, &root);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(String::from_utf8_lossy(&out.stdout), "200");
}

/// Pebble validates on a port where Pier is not: the order is invalid,
/// counted as failed, and nothing is stored.
#[test]
fn a_failed_validation_is_counted_and_stores_nothing() {
    let elsewhere = dead_addr();
    let pebble = Pebble::start(elsewhere.port());
    let origin = Origin::start();
    let store = TempDir::new();
    let storage = store.path().join("acme");
    let cfg = config(
        origin.addr(),
        "127.0.0.1:0",
        &pebble.directory,
        &pebble.minica,
        &storage,
    );
    let pier = pier(&cfg);
    assert!(
        wait_until(Duration::from_secs(60), || orders(&pier, "failed") >= 1.0),
        "{}",
        pier.logs()
    );
    assert_eq!(orders(&pier, "ok"), 0.0);
    assert!(
        pier.logs().contains("trying again in 60s"),
        "{}",
        pier.logs()
    );
    assert!(storage_empty(&storage));
    // The account was made, and is kept for the next attempt.
    assert!(std::fs::read_dir(&storage).unwrap().any(|e| e
        .unwrap()
        .file_name()
        .to_string_lossy()
        .starts_with("account-")));
}

#[test]
fn an_unreachable_ca_is_counted_and_retried_and_the_listener_refuses_handshakes_meanwhile() {
    let origin = Origin::start();
    let store = TempDir::new();
    let dead = dead_addr();
    let ca = store.path().join("none.pem");
    let cfg = config(
        origin.addr(),
        "127.0.0.1:0",
        &format!("https://{dead}/dir"),
        &ca,
        &store.path().join("acme"),
    )
    // The system's roots: the CA is unreachable anyway.
    .replace(&format!("directory_ca = \"{}\"\n", ca.display()), "");
    let pier = pier(&cfg);
    assert!(
        wait_until(Duration::from_secs(20), || orders(&pier, "failed") >= 1.0),
        "{}",
        pier.logs()
    );
    assert!(
        pier.logs().contains("trying again in 60s"),
        "{}",
        pier.logs()
    );
    let port = pier.listener("main").port();
    let out = get_verified("site.test", port, &ca);
    assert!(!out.status.success());
    assert!(storage_empty(&store.path().join("acme")));
}

fn storage_empty(p: &Path) -> bool {
    !p.join("site.test").exists()
}

#[test]
fn quick_mode_takes_acme_domain() {
    let port = free_port();
    let pebble = Pebble::start(port);
    let origin = Origin::start();
    let store = TempDir::new();
    let (listen, to) = (format!("127.0.0.1:{port}"), origin.addr().to_string());
    let (ca, storage) = (
        pebble.minica.display().to_string(),
        store.path().join("acme").display().to_string(),
    );
    let pier = PierProcess::start_args(
        bin(),
        &[
            "proxy",
            "--listen",
            &listen,
            "--to",
            &to,
            "--admin",
            "127.0.0.1:0",
            "--acme-domain",
            "quick.test",
            "--acme-directory",
            &pebble.directory,
            "--acme-ca",
            &ca,
            "--acme-storage",
            &storage,
        ],
    );
    assert!(
        wait_until(Duration::from_secs(60), || orders(&pier, "ok") >= 1.0),
        "{}",
        pier.logs()
    );
    let out = get_verified("quick.test", port, &pebble.root);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(String::from_utf8_lossy(&out.stdout), "200");
    // A name that is not a DNS name is refused before anything starts.
    let out = Command::new(bin())
        .args(["proxy", "--listen", "127.0.0.1:0", "--to", &to])
        .args(["--acme-domain", "*.quick.test"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("no wildcards"));
}

/// The serial of the certificate curl is served for `name` at `port`.
fn served_serial(name: &str, port: u16, root: &Path) -> String {
    let out = curl(&[
        "-sS",
        "--max-time",
        "10",
        "--cacert",
        &root.display().to_string(),
        "-o",
        "/dev/null",
        "-w",
        "%{certs}",
        "--resolve",
        &format!("{name}:{port}:127.0.0.1"),
        &format!("https://{name}:{port}/hello"),
    ]);
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    text.lines()
        .find_map(|l| l.strip_prefix("Serial Number:"))
        .map(|s| s.trim().to_string())
        .unwrap_or_else(|| {
            panic!(
                "no serial for {name}: {text} {}",
                String::from_utf8_lossy(&out.stderr)
            )
        })
}

/// HTTP-01 (RFC 8555 §8.3): Pebble validates on the plain listener, whose
/// every other request is redirected to https; the challenge is answered
/// ahead of that redirect, and only while the order runs. Then the CA's
/// renewal window (ARI, RFC 9773) moved into the past makes the next start
/// renew a certificate that is far from its `renew_before`.
#[test]
fn http_01_is_answered_ahead_of_the_redirect_and_ari_renews_early() {
    let (tls, http) = (free_port(), free_port());
    let pebble = Pebble::start_ports(tls, http);
    let origin = Origin::start_named("behind-acme");
    let store = TempDir::new();
    let storage = store.path().join("acme");
    let cfg = config(
        origin.addr(),
        &format!("127.0.0.1:{tls}"),
        &pebble.directory,
        &pebble.minica,
        &storage,
    )
    .replace(
        "[listener.tls.acme]\n",
        "[listener.tls.acme]\nchallenge = \"http-01\"\n",
    )
    .replace(
        "[[route]]",
        &format!("[[listener]]\nname = \"plain\"\nlisten = \"127.0.0.1:{http}\"\nredirect_https = 301\nhttps_port = {tls}\n\n[[route]]"),
    );
    let pier = pier(&cfg);
    assert!(
        wait_until(Duration::from_secs(60), || orders(&pier, "ok") >= 1.0),
        "no certificate: ok {} failed {}\n{}",
        orders(&pier, "ok"),
        orders(&pier, "failed"),
        pier.logs()
    );
    for name in ["site.test", "www.site.test"] {
        let out = get_verified(name, tls, &pebble.root);
        assert!(
            out.status.success(),
            "{name}: {}\n{}",
            String::from_utf8_lossy(&out.stderr),
            pier.logs()
        );
        assert_eq!(String::from_utf8_lossy(&out.stdout), "200");
    }
    // Validated over HTTP, not TLS-ALPN-01.
    assert_eq!(
        pier.metric_value("pier_tls_handshake_failures_total{reason=\"acme_challenge\"}")
            .unwrap_or(0.0),
        0.0
    );
    // With the order done its tokens are withdrawn: the path is the
    // listener's like any other (redirected).
    let out = curl(&[
        "-s",
        "-o",
        "/dev/null",
        "-w",
        "%{http_code}",
        &format!("http://127.0.0.1:{http}/.well-known/acme-challenge/x"),
    ]);
    assert_eq!(String::from_utf8_lossy(&out.stdout), "301");
    let first = served_serial("site.test", tls, &pebble.root);
    drop(pier);

    // The CA says: renew now (a window in the past), for a certificate with
    // weeks left and the default `renew_before` of 30 days.
    let pem = std::fs::read_to_string(storage.join("site.test/cert.pem")).unwrap();
    let leaf = &pem[..pem.find("-----END CERTIFICATE-----").unwrap() + 25];
    let body = serde_json::json!({
        "Certificate": leaf,
        "ARIResponse": r#"{"suggestedWindow":{"start":"2020-01-01T00:00:00Z","end":"2020-01-02T00:00:00Z"}}"#,
    })
    .to_string();
    let out = curl(&[
        "-sS",
        "-w",
        "%{http_code}",
        "--cacert",
        &pebble.minica.display().to_string(),
        "-H",
        "Content-Type: application/json",
        "--data",
        &body,
        &format!("{}/set-renewal-info/", pebble.mgmt),
    ]);
    let said = String::from_utf8_lossy(&out.stdout);
    assert!(
        said.ends_with("200"),
        "{said} {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let pier = common::pier(&cfg);
    assert!(
        wait_until(Duration::from_secs(60), || orders(&pier, "ok") >= 1.0),
        "no ARI renewal: ok {} failed {}\n{}",
        orders(&pier, "ok"),
        orders(&pier, "failed"),
        pier.logs()
    );
    assert!(
        pier.logs().contains("renewal window says renew"),
        "{}",
        pier.logs()
    );
    let second = served_serial("site.test", tls, &pebble.root);
    assert_ne!(first, second);
    // The renewed certificate's own window is in the future: no third order.
    assert!(!wait_until(Duration::from_secs(3), || orders(&pier, "ok")
        + orders(&pier, "failed")
        > 1.0));
}

/// An `ask` endpoint that approves `allowed.site.test` and nothing else,
/// and keeps the names it was asked about.
fn ask_server() -> (SocketAddr, std::sync::Arc<std::sync::Mutex<Vec<String>>>) {
    use std::io::{BufRead, BufReader, Write};
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    let asked = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let seen = asked.clone();
    std::thread::spawn(move || {
        for s in l.incoming() {
            let Ok(mut s) = s else { continue };
            let mut line = String::new();
            let _ = BufReader::new(&s).read_line(&mut line);
            let name = line
                .split_once("domain=")
                .map(|(_, r)| r.split([' ', '&']).next().unwrap_or("").to_string())
                .unwrap_or_default();
            let ok = line.starts_with("GET /check?domain=") && name == "allowed.site.test";
            seen.lock().unwrap().push(name);
            let status = if ok { "200 OK" } else { "403 Forbidden" };
            let _ = write!(
                s,
                "HTTP/1.1 {status}\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
            );
        }
    });
    (addr, asked)
}

fn on_demand(p: &PierProcess, result: &str) -> f64 {
    p.metric_value(&format!("pier_acme_on_demand_total{{result=\"{result}\"}}"))
        .unwrap_or(0.0)
}

/// On-demand TLS: a name outside the certificates is asked about once; an
/// approved one is issued during its first handshake (which waits for it)
/// and served from then on; a refused one, a name that is not a DNS name,
/// and a new name beyond the rate fail their handshakes, counted.
#[test]
fn on_demand_names_are_asked_about_issued_in_their_first_handshake_or_refused() {
    let port = free_port();
    let pebble = Pebble::start(port);
    let origin = Origin::start_named("on-demand");
    let store = TempDir::new();
    let (ask, asked) = ask_server();
    let acme = |rate: u32| {
        format!(
            "[listener.tls.acme]\non_demand = true\nask = \"http://{ask}/check\"\non_demand_rate = {rate}\nemail = \"ops@site.test\"\ndirectory = \"{}\"\ndirectory_ca = \"{}\"\nstorage = \"{}\"\n",
            pebble.directory,
            pebble.minica.display(),
            store.path().join("acme").display()
        )
    };
    let cfg = format!(
        r#"[server]
workers = 2
[admin]
listen = "127.0.0.1:0"
[log]
access = "off"

[[listener]]
name = "main"
listen = "127.0.0.1:{port}"
[listener.tls]
handshake_timeout = "60s"
{main}
[[listener]]
name = "strict"
listen = "127.0.0.1:0"
[listener.tls]
{strict}
[[route]]
name = "default"
upstream = "app"

[upstream.app]
servers = ["{origin}"]
"#,
        main = acme(10),
        strict = acme(1),
        origin = origin.addr(),
    );
    let pier = pier(&cfg);
    let asked_n = || asked.lock().unwrap().len();
    // The first handshake for an approved name waits for its certificate.
    let out = get_verified("allowed.site.test", port, &pebble.root);
    assert!(
        out.status.success(),
        "{}\n{}",
        String::from_utf8_lossy(&out.stderr),
        pier.logs()
    );
    assert_eq!(String::from_utf8_lossy(&out.stdout), "200");
    assert_eq!(orders(&pier, "ok"), 1.0);
    assert_eq!(on_demand(&pier, "approved"), 1.0);
    // Asked about once: the next handshake is served from the slot.
    let out = get_verified("allowed.site.test", port, &pebble.root);
    assert_eq!(String::from_utf8_lossy(&out.stdout), "200");
    assert_eq!(asked_n(), 1);
    assert!(store
        .path()
        .join("acme/allowed.site.test/cert.pem")
        .exists());

    // Refused by the ask URL: no certificate, no order.
    let out = get_verified("denied.site.test", port, &pebble.root);
    assert!(!out.status.success());
    assert_eq!(asked_n(), 2);
    assert_eq!(on_demand(&pier, "refused"), 1.0);
    // Not a DNS name: refused without asking.
    let out = get_verified("nodot", port, &pebble.root);
    assert!(!out.status.success());
    assert_eq!(asked_n(), 2);
    assert_eq!(on_demand(&pier, "refused"), 2.0);
    assert_eq!(orders(&pier, "ok") + orders(&pier, "failed"), 1.0);
    assert!(
        pier.metric_value("pier_tls_handshake_failures_total{reason=\"acme_refused\"}")
            .unwrap_or(0.0)
            >= 2.0
    );

    // One new name a minute on "strict": the second, right after the
    // first, is not even asked about.
    let strict = pier.listener("strict").port();
    let out = get_verified("one.site.test", strict, &pebble.root);
    assert!(!out.status.success());
    assert_eq!(asked_n(), 3);
    let out = get_verified("two.site.test", strict, &pebble.root);
    assert!(!out.status.success());
    assert_eq!(asked_n(), 3);
    assert_eq!(on_demand(&pier, "rate_limited"), 1.0);
}
