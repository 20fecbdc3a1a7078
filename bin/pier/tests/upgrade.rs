//! Binary upgrades (`pier upgrade`, SIGUSR2): the running Pier hands its
//! listening sockets to a new process, which serves before the old one
//! stops accepting. Under a load of HTTP/1.1 (kept-alive and new
//! connections), HTTP/1.1 over TLS (new connections, full handshakes) and
//! HTTP/2 over TLS, through five upgrades and two failed ones, nothing is
//! refused or failed, a request in flight on the old process finishes, and
//! the descriptors other than connections stay the same in number.

mod common;

use std::collections::HashSet;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::*;
use pier_test_support::tls::{Alg, TestCa, TlsClient, TlsClientConfig};

fn config(origin: SocketAddr, cert: &Path, key: &Path, sock: &Path, extra: &str) -> String {
    format!(
        r#"[server]
workers = 2
grace_period = "10s"
upgrade_socket = "{sock}"

[admin]
listen = "127.0.0.1:0"

[log]
access = "off"

[[listener]]
name = "main"
listen = "127.0.0.1:0"

[[listener]]
name = "tls"
listen = "127.0.0.1:0"
[listener.tls]
cert = "{cert}"
key = "{key}"
alpn = ["h2", "http/1.1"]
{extra}
[[route]]
name = "default"
upstream = "app"

[upstream.app]
servers = ["{origin}"]
"#,
        sock = sock.display(),
        cert = cert.display(),
        key = key.display(),
    )
}

/// The pid in Pier's ready file.
fn ready_pid(ready: &Path) -> Option<u32> {
    let v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(ready).ok()?).ok()?;
    v.get("pid")?.as_u64().map(|p| p as u32)
}

/// Descriptors of `pid` that are not connections: listening TCP sockets,
/// UDP and Unix sockets, files, pipes, epoll… — what a leak would grow. A
/// socket in no table but TCP's connections (or in none at all: one just
/// made, or one closed but not yet dropped) is a connection.
fn fixed_fds(pid: u32) -> usize {
    let mut fixed = HashSet::new();
    for (table, inode_col) in [
        ("/proc/net/tcp", 9),
        ("/proc/net/tcp6", 9),
        ("/proc/net/udp", 9),
        ("/proc/net/udp6", 9),
        ("/proc/net/unix", 6),
    ] {
        let tcp = table.contains("tcp");
        for line in std::fs::read_to_string(table)
            .unwrap_or_default()
            .lines()
            .skip(1)
        {
            let f: Vec<&str> = line.split_whitespace().collect();
            // TCP: only st 0A, LISTEN.
            if f.len() > inode_col && (!tcp || f[3] == "0A") {
                fixed.insert(f[inode_col].to_string());
            }
        }
    }
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .unwrap()
        .filter_map(|e| std::fs::read_link(e.ok()?.path()).ok())
        .filter(|l| {
            let l = l.to_string_lossy();
            match l.strip_prefix("socket:[").and_then(|s| s.strip_suffix(']')) {
                Some(ino) => fixed.contains(ino),
                None => true,
            }
        })
        .count()
}

/// A process started by `pier upgrade` (generation 2 on); killed on drop.
struct Next {
    child: Child,
    log: PathBuf,
}

impl Drop for Next {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn upgrade(p: &PierProcess, n: usize) -> Child {
    let log = p.dir().join(format!("upgrade-{n}.log"));
    Command::new(bin())
        .args(["upgrade", "-c"])
        .arg(p.config_path())
        .env("PIER_READY_FILE", p.dir().join("ready.json"))
        .env("RUST_LOG", "info")
        .stdin(Stdio::null())
        .stdout(std::fs::File::create(&log).unwrap())
        .stderr(std::fs::File::create(p.dir().join(format!("upgrade-{n}.err"))).unwrap())
        .spawn()
        .expect("spawn pier upgrade")
}

fn logs_of(p: &PierProcess, n: usize) -> String {
    std::fs::read_to_string(p.dir().join(format!("upgrade-{n}.err"))).unwrap_or_default()
}

/// Load, until `stop`: what succeeded, and every failure named.
#[derive(Default)]
struct Tally {
    ok: AtomicU64,
    retried: AtomicU64,
    failures: Mutex<Vec<String>>,
}

impl Tally {
    fn fail(&self, what: String) {
        self.failures.lock().unwrap().push(what);
    }
}

/// HTTP/1.1 cleartext: a kept-alive connection, and a new connection every
/// fourth request. A kept-alive request that gets no byte back (the server
/// closed the idle connection as it drained, as every server may) is sent
/// again on a new connection, as RFC 9112 §9.3.1 lets a client do; a new
/// connection that fails, or a response cut short, is a failure.
fn http1_load(addr: SocketAddr, stop: Arc<AtomicBool>, t: Arc<Tally>) {
    let mut kept = RawConn::connect(addr);
    let started = Instant::now();
    for i in 0..1_000_000u64 {
        if stop.load(Ordering::SeqCst) || started.elapsed() > Duration::from_secs(120) {
            break;
        }
        if i % 4 == 0 {
            match try_get(addr, "/hello") {
                Ok(r) if r.status == 200 => t.ok.fetch_add(1, Ordering::SeqCst),
                Ok(r) => {
                    t.fail(format!("http/1 new connection: status {}", r.status));
                    0
                }
                Err(e) => {
                    t.fail(format!("http/1 new connection: {e}"));
                    0
                }
            };
            continue;
        }
        match kept.get("/hello") {
            Ok(r) if r.status == 200 => {
                t.ok.fetch_add(1, Ordering::SeqCst);
                if r.has_token("connection", "close") {
                    kept = RawConn::connect(addr);
                }
            }
            Ok(r) => t.fail(format!("http/1 kept-alive: status {}", r.status)),
            Err(_) if kept.buffered().is_empty() => {
                t.retried.fetch_add(1, Ordering::SeqCst);
                kept = RawConn::connect(addr);
                match kept.get("/hello") {
                    Ok(r) if r.status == 200 => t.ok.fetch_add(1, Ordering::SeqCst),
                    other => {
                        t.fail(format!("http/1 retry on a new connection: {other:?}"));
                        0
                    }
                };
            }
            Err(e) => {
                t.fail(format!("http/1 kept-alive, response cut: {e}"));
                kept = RawConn::connect(addr);
            }
        }
    }
}

/// HTTP/1.1 over TLS, a new connection (a full handshake) per request.
fn tls_load(addr: SocketAddr, ca: PathBuf, stop: Arc<AtomicBool>, t: Arc<Tally>) {
    let cfg = TlsClientConfig::new(&ca, None, &["http/1.1"], None);
    let started = Instant::now();
    for _ in 0..1_000_000u64 {
        if stop.load(Ordering::SeqCst) || started.elapsed() > Duration::from_secs(120) {
            break;
        }
        let r = TlsClient::connect(addr, "site.test", &cfg)
            .and_then(|mut c| c.get("site.test", "/hello"));
        match r {
            Ok(r) if r.status == 200 => {
                t.ok.fetch_add(1, Ordering::SeqCst);
            }
            Ok(r) => t.fail(format!("tls: status {}", r.status)),
            Err(e) => t.fail(format!("tls: {e}")),
        }
    }
}

/// HTTP/2 over TLS: one connection, one request at a time. A GOAWAY from
/// a draining process sends the client to a new connection; a stream the
/// server refused unprocessed (GOAWAY) is sent again there, as RFC 9113
/// §6.8 allows; any other error is a failure.
fn h2_load(addr: SocketAddr, ca: PathBuf, stop: Arc<AtomicBool>, t: Arc<Tally>) {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let cfg = TlsClientConfig::new(&ca, None, &["h2"], None).0;
    rt.block_on(async move {
        let connector = tokio_rustls::TlsConnector::from(cfg);
        let connect = || async {
            let tcp = tokio::net::TcpStream::connect(addr).await?;
            let name = rustls::pki_types::ServerName::try_from("site.test").unwrap();
            let tls = connector.connect(name, tcp).await?;
            let (send, conn) = h2::client::handshake(tls)
                .await
                .map_err(std::io::Error::other)?;
            tokio::spawn(async move {
                let _ = conn.await;
            });
            Ok::<_, std::io::Error>(send)
        };
        let mut send = match connect().await {
            Ok(s) => s,
            Err(e) => return t.fail(format!("h2: connect: {e}")),
        };
        let started = Instant::now();
        let mut refused_in_a_row = 0;
        while !stop.load(Ordering::SeqCst) && started.elapsed() < Duration::from_secs(120) {
            let attempt = async {
                let mut s = send.clone().ready().await?;
                let req = http::Request::get("https://site.test/hello")
                    .body(())
                    .unwrap();
                let (resp, _) = s.send_request(req, true)?;
                let resp = resp.await?;
                let status = resp.status();
                let mut body = resp.into_body();
                while let Some(chunk) = body.data().await {
                    let chunk = chunk?;
                    let _ = body.flow_control().release_capacity(chunk.len());
                }
                Ok::<_, h2::Error>(status)
            };
            match tokio::time::timeout(Duration::from_secs(20), attempt).await {
                Ok(Ok(s)) if s == 200 => {
                    refused_in_a_row = 0;
                    t.ok.fetch_add(1, Ordering::SeqCst);
                }
                Ok(Ok(s)) => t.fail(format!("h2: status {s}")),
                Ok(Err(e)) if (e.is_go_away() || e.is_io()) && refused_in_a_row < 3 => {
                    refused_in_a_row += 1;
                    t.retried.fetch_add(1, Ordering::SeqCst);
                    match connect().await {
                        Ok(s) => send = s,
                        Err(e) => t.fail(format!("h2: new connection after GOAWAY: {e}")),
                    }
                }
                Ok(Err(e)) => t.fail(format!("h2: {e}")),
                Err(_) => t.fail("h2: no answer in 20 s".into()),
            }
        }
    });
}

#[test]
fn five_upgrades_under_load_drop_nothing_and_a_failed_one_changes_nothing() {
    let origin = Origin::start_named("app");
    let dir = TempDir::new();
    let ca = TestCa::new(dir.path(), "pier");
    let cert = ca.server("site", &["site.test"], Alg::EcdsaP256, 30);
    let sock = dir.path().join("upgrade.sock");
    let good = config(origin.addr(), &cert.cert, &cert.key, &sock, "");
    let mut first = pier(&good);
    let plain = first.listener("main");
    let tls = first.listener("tls");
    let admin = first.admin();
    let ready = first.dir().join("ready.json");

    let stop = Arc::new(AtomicBool::new(false));
    let tally = Arc::new(Tally::default());
    let mut load = Vec::new();
    for _ in 0..2 {
        let (s, t) = (stop.clone(), tally.clone());
        load.push(std::thread::spawn(move || http1_load(plain, s, t)));
    }
    {
        let (s, t, ca) = (stop.clone(), tally.clone(), ca.cert.clone());
        load.push(std::thread::spawn(move || tls_load(tls, ca, s, t)));
    }
    {
        let (s, t, ca) = (stop.clone(), tally.clone(), ca.cert.clone());
        load.push(std::thread::spawn(move || h2_load(tls, ca, s, t)));
    }
    let served = |n: u64| {
        let from = tally.ok.load(Ordering::SeqCst);
        assert!(
            wait_until(Duration::from_secs(20), || tally.ok.load(Ordering::SeqCst)
                >= from + n),
            "the load stalled: {:?}",
            tally.failures.lock().unwrap()
        );
    };
    served(200);
    let mut fds = vec![fixed_fds(first.pid())];
    let mut old_pid = first.pid();
    let mut current: Option<Next> = None;
    for n in 1..=5usize {
        // A request in flight on the old process while it is replaced.
        let mut slow = RawConn::connect(plain);
        slow.send(b"GET /slow/1500 HTTP/1.1\r\nHost: a\r\n\r\n");
        let child = upgrade(&first, n);
        let new_pid = child.id();
        let next = Next {
            child,
            log: first.dir().join(format!("upgrade-{n}.log")),
        };
        assert!(
            wait_until(Duration::from_secs(30), || ready_pid(&ready)
                == Some(new_pid)),
            "upgrade {n} did not become ready\n{}\n{}",
            logs_of(&first, n),
            first.logs()
        );
        let r = slow
            .read_response()
            .expect("the in-flight request finishes");
        assert_eq!((r.status, r.body_str().as_str()), (200, "slow\n"));
        // The old process drains and exits on its own.
        let gone = match current.take() {
            None => first.wait_exit(Duration::from_secs(20)).is_some(),
            Some(mut prev) => wait_until(Duration::from_secs(20), || {
                matches!(prev.child.try_wait(), Ok(Some(_)))
            }),
        };
        assert!(gone, "process {old_pid} did not exit after upgrade {n}");
        // The listeners and the admin stay where they were.
        assert_eq!(get(plain, "/hello").status, 200);
        assert_eq!(get(admin, "/healthz").status, 200);
        served(100);
        fds.push(fixed_fds(new_pid));
        assert!(next.log.exists());
        old_pid = new_pid;
        current = Some(next);
        let _ = &mut current;
    }
    // A new binary with a bad config: refused before it asks for anything.
    let bad_config = first.dir().join("bad.toml");
    std::fs::write(&bad_config, good.replace("[[route]]", "[[route]\n")).unwrap();
    let out = run_with_timeout(
        Command::new(bin()).args(["upgrade", "-c"]).arg(&bad_config),
        Duration::from_secs(20),
    );
    assert_eq!(
        out.status.code(),
        Some(1),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // A new binary that dies during its start, with the sockets in hand (a
    // listener it cannot bind): the old one goes on serving, untouched.
    let busy = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let dying = config(
        origin.addr(),
        &cert.cert,
        &cert.key,
        &sock,
        &format!(
            "\n[[listener]]\nname = \"busy\"\nlisten = \"{}\"\n",
            busy.local_addr().unwrap()
        ),
    );
    let dying_path = first.dir().join("dying.toml");
    std::fs::write(&dying_path, dying).unwrap();
    let out = run_with_timeout(
        Command::new(bin()).args(["upgrade", "-c"]).arg(&dying_path),
        Duration::from_secs(30),
    );
    assert_eq!(
        out.status.code(),
        Some(1),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("handed over"),
        "it got the sockets before it died: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    served(100);
    let last = current.as_mut().unwrap();
    assert!(
        matches!(last.child.try_wait(), Ok(None)),
        "the running Pier stays"
    );
    assert_eq!(ready_pid(&ready), Some(old_pid));
    // And the next good upgrade still works.
    let child = upgrade(&first, 6);
    let new_pid = child.id();
    let _sixth = Next {
        child,
        log: first.dir().join("upgrade-6.log"),
    };
    assert!(
        wait_until(Duration::from_secs(30), || ready_pid(&ready)
            == Some(new_pid)),
        "upgrade 6 did not become ready\n{}",
        logs_of(&first, 6)
    );
    assert!(wait_until(Duration::from_secs(20), || matches!(
        last.child.try_wait(),
        Ok(Some(_))
    )));
    served(100);
    fds.push(fixed_fds(new_pid));

    stop.store(true, Ordering::SeqCst);
    for t in load {
        t.join().unwrap();
    }
    let failures = tally.failures.lock().unwrap();
    assert!(
        failures.is_empty(),
        "{} failed of {} ({} retried as clients may):\n{}",
        failures.len(),
        tally.ok.load(Ordering::SeqCst),
        tally.retried.load(Ordering::SeqCst),
        failures.join("\n")
    );
    assert!(
        fds.windows(2).all(|w| w[0] == w[1]),
        "descriptors other than connections, generation by generation: {fds:?}"
    );
}

#[test]
fn sigusr2_starts_the_new_binary_itself() {
    let origin = Origin::start_named("app");
    let dir = TempDir::new();
    let ca = TestCa::new(dir.path(), "pier");
    let cert = ca.server("site", &["site.test"], Alg::EcdsaP256, 30);
    let sock = dir.path().join("upgrade.sock");
    // systemd's notification socket, as `Type=notify` gives it.
    let notify_path = dir.path().join("notify.sock");
    let notify = std::os::unix::net::UnixDatagram::bind(&notify_path).unwrap();
    notify
        .set_read_timeout(Some(Duration::from_secs(20)))
        .unwrap();
    let mut p = PierProcess::launch_env(
        bin(),
        Some(&config(origin.addr(), &cert.cert, &cert.key, &sock, "")),
        &["serve", "-c", "{config}"],
        &[("NOTIFY_SOCKET", notify_path.to_str().unwrap())],
    )
    .unwrap();
    let mut buf = [0u8; 256];
    let n = notify.recv(&mut buf).unwrap();
    assert_eq!(&buf[..n], b"READY=1");
    let addr = p.listener("main");
    let ready = p.dir().join("ready.json");
    let mut kept = RawConn::connect(addr);
    assert_eq!(kept.get("/hello").unwrap().status, 200);
    p.signal(libc::SIGUSR2);
    assert!(
        wait_until(Duration::from_secs(30), || ready_pid(&ready)
            .is_some_and(|n| n != p.pid())),
        "no new process after SIGUSR2\n{}",
        p.logs()
    );
    let new_pid = ready_pid(&ready).unwrap();
    // systemd follows the new process as the service's main one.
    let n = notify.recv(&mut buf).unwrap();
    assert_eq!(
        String::from_utf8_lossy(&buf[..n]),
        format!("MAINPID={new_pid}\nREADY=1")
    );
    assert!(
        p.wait_exit(Duration::from_secs(20)).is_some(),
        "the old process exits"
    );
    // Its kept-alive connection was closed between requests.
    assert!(kept.get("/hello").is_err());
    assert_eq!(get(addr, "/hello").status, 200);
    // The new process is nobody's child here: stop it by its pid.
    assert!(Command::new("kill")
        .arg(new_pid.to_string())
        .status()
        .unwrap()
        .success());
    assert!(wait_until(Duration::from_secs(20), || !Path::new(
        &format!("/proc/{new_pid}")
    )
    .exists()
        || std::fs::read_to_string(format!("/proc/{new_pid}/stat"))
            .is_ok_and(|s| s.contains(") Z "))));
    // SIGTERM removed the upgrade socket it owned.
    assert!(!sock.exists());
}

#[test]
fn upgrade_without_a_running_pier_says_so() {
    let origin = Origin::start_named("app");
    let dir = TempDir::new();
    let ca = TestCa::new(dir.path(), "pier");
    let cert = ca.server("site", &["site.test"], Alg::EcdsaP256, 30);
    let cfg = dir.write(
        "pier.toml",
        &config(
            origin.addr(),
            &cert.cert,
            &cert.key,
            &dir.path().join("none.sock"),
            "",
        ),
    );
    let out = run_with_timeout(
        Command::new(bin()).args(["upgrade", "-c"]).arg(&cfg),
        Duration::from_secs(20),
    );
    assert_eq!(out.status.code(), Some(1));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("no running Pier answers"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}
