//! gRPC end to end through Pier (issue 10) with grpc-go's interop server and
//! client (`go install google.golang.org/grpc/interop/{server,client}`;
//! `.ci/run` installs them): every RPC shape over HTTP/2 both sides, with
//! trailers, deadlines and cancellations; Pier's own errors gRPC-shaped.

mod common;

use std::net::{SocketAddr, TcpListener};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use common::*;

fn go_bin(name: &str) -> PathBuf {
    let var = format!("GRPC_INTEROP_{}", name.to_ascii_uppercase());
    if let Ok(p) = std::env::var(&var) {
        return PathBuf::from(p);
    }
    let home = std::env::var("HOME").unwrap_or_default();
    let p = PathBuf::from(format!("{home}/go/bin/{name}"));
    assert!(
        p.exists(),
        "{} not found: `.ci/run` installs grpc-go's interop {name} (go install google.golang.org/grpc/interop/{name}@v1.85.0)",
        p.display()
    );
    p
}

struct Server(Child, SocketAddr);
impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// grpc-go's interop server on a free port, once it accepts connections.
/// The port is picked by binding port 0 and letting it go, so a test running
/// beside this one may pick the same port: a server that exits (it could
/// not bind) is started again on another port.
fn interop_server() -> Server {
    interop_server_with(&[])
}

/// The interop server with more arguments (TLS).
fn interop_server_with(extra: &[&str]) -> Server {
    for _ in 0..5 {
        let port = {
            let l = TcpListener::bind("127.0.0.1:0").unwrap();
            l.local_addr().unwrap().port()
        };
        let mut child = Command::new(go_bin("server"))
            .args(["-port", &port.to_string()])
            .args(extra)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let addr: SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
        let mut exited = false;
        let up = wait_until(Duration::from_secs(30), || {
            if matches!(child.try_wait(), Ok(Some(_))) {
                exited = true;
                return true;
            }
            std::net::TcpStream::connect(addr).is_ok()
        });
        if up && !exited {
            return Server(child, addr);
        }
        let _ = child.kill();
        let _ = child.wait();
        assert!(exited, "interop server did not start");
    }
    panic!("interop server exited five times (no free port?)");
}

fn config(upstream: SocketAddr) -> String {
    format!(
        r#"[server]
workers = 2

[admin]
listen = "127.0.0.1:0"

[log]
access = "off"

[[listener]]
name = "clear"
listen = "127.0.0.1:0"
h2c = true

[[route]]
name = "grpc"
upstream = "svc"

[upstream.svc]
servers = ["{upstream}"]
protocol = "h2c"
retries = 0
"#
    )
}

fn client(to: SocketAddr, case: &str) -> (bool, String) {
    client_with(to, case, &[])
}

fn client_with(to: SocketAddr, case: &str, extra: &[&str]) -> (bool, String) {
    let out = run_with_timeout(
        Command::new(go_bin("client"))
            .args([
                "-server_host",
                "127.0.0.1",
                "-server_port",
                &to.port().to_string(),
                "-test_case",
                case,
            ])
            .args(extra),
        Duration::from_secs(60),
    );
    (
        out.status.success(),
        format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ),
    )
}

const CASES: [&str; 14] = [
    "empty_unary",
    "large_unary",
    "client_streaming",
    "server_streaming",
    "ping_pong",
    "empty_stream",
    "custom_metadata",
    "status_code_and_message",
    "special_status_message",
    "unimplemented_method",
    "unimplemented_service",
    "cancel_after_begin",
    "cancel_after_first_response",
    "timeout_on_sleeping_server",
];

/// The 14 cases over TLS on both legs: the client to Pier (ALPN h2, a test
/// CA), Pier to the interop server over TLS with `protocol = "auto"` (the
/// server's ALPN picks h2).
#[test]
fn interop_cases_through_pier_over_tls() {
    let dir = TempDir::new();
    let ca = pier_test_support::tls::TestCa::new(dir.path(), "pier");
    let alg = pier_test_support::tls::Alg::EcdsaP256;
    let front = ca.server("front", &["localhost"], alg, 30);
    let back = ca.server("back", &["grpc.test"], alg, 30);
    let s = interop_server_with(&[
        "-use_tls",
        "-tls_cert_file",
        &back.cert.display().to_string(),
        "-tls_key_file",
        &back.key.display().to_string(),
    ]);
    let cfg = config(s.1)
        .replace(
            "h2c = true\n",
            &format!(
                "[listener.tls]\ncert = \"{}\"\nkey = \"{}\"\nalpn = [\"h2\", \"http/1.1\"]\n",
                front.cert.display(),
                front.key.display()
            ),
        )
        .replace("protocol = \"h2c\"\n", "protocol = \"auto\"\n")
        + &format!(
            "[upstream.svc.tls]\nserver_name = \"grpc.test\"\nca = \"{}\"\n",
            ca.cert.display()
        );
    let pier = pier(&cfg);
    let to = pier.listener("clear");
    let ca_file = ca.cert.display().to_string();
    let tls = [
        "-use_tls",
        "-use_test_ca",
        "-ca_file",
        &ca_file,
        "-server_host_override",
        "localhost",
    ];
    for case in CASES {
        let (ok, out) = client_with(to, case, &tls);
        assert!(ok, "{case} (TLS): {out}\n--- pier:\n{}", pier.logs());
    }
    assert_eq!(pier.metric_value("pier_panics_total"), Some(0.0));
    assert!(
        pier.metric_value("pier_grpc_responses_total{status=\"0\"}")
            .unwrap_or(0.0)
            >= 6.0,
        "{}",
        pier.metrics()
    );
    // One multiplexed TLS connection upstream carried them all.
    let n = pier
        .metric_value("pier_upstream_connections_created_total")
        .unwrap();
    assert!(n <= 2.0, "{n} upstream connections");
}

#[test]
fn interop_cases_through_pier() {
    let s = interop_server();
    let pier = pier(&config(s.1));
    let to = pier.listener("clear");
    for case in CASES {
        let (ok, out) = client(to, case);
        assert!(ok, "{case}: {out}\n--- pier:\n{}", pier.logs());
    }
    assert_eq!(pier.metric_value("pier_panics_total"), Some(0.0));
    // Outcomes by grpc-status: OK for most, UNIMPLEMENTED (12), UNKNOWN (2)
    // from status_code_and_message, CANCELLED/DEADLINE_EXCEEDED may not reach
    // the relay's end (the client went away).
    assert!(
        pier.metric_value("pier_grpc_responses_total{status=\"0\"}")
            .unwrap_or(0.0)
            >= 6.0,
        "{}",
        pier.metrics()
    );
    assert!(
        pier.metric_value("pier_grpc_responses_total{status=\"12\"}")
            .unwrap_or(0.0)
            >= 2.0,
        "{}",
        pier.metrics()
    );
}

#[test]
fn pier_errors_are_grpc_shaped() {
    // Nothing listens upstream: Pier answers, a gRPC client reads UNAVAILABLE.
    let dead = dead_addr();
    let pier = pier(&config(dead));
    let out = run_with_timeout(
        Command::new("curl").args([
            "-sS",
            "--http2-prior-knowledge",
            "-D",
            "-",
            "-H",
            "content-type: application/grpc",
            "-H",
            "te: trailers",
            "--data-binary",
            "",
            &format!(
                "http://{}/grpc.testing.TestService/EmptyCall",
                pier.listener("clear")
            ),
        ]),
        Duration::from_secs(30),
    );
    let text = String::from_utf8_lossy(&out.stdout).to_ascii_lowercase();
    assert!(text.starts_with("http/2 200"), "{text}");
    assert!(text.contains("content-type: application/grpc"), "{text}");
    assert!(text.contains("grpc-status: 14"), "{text}");
    assert!(
        text.contains("grpc-message: upstream-connect (http 502)"),
        "{text}"
    );
    // And the interop client sees UNAVAILABLE, not a protocol error.
    let (ok, out) = client(pier.listener("clear"), "empty_unary");
    assert!(!ok);
    assert!(out.contains("Unavailable"), "{out}");
}

/// gRPC-web frames of a body: (flag, payload).
fn frames(mut b: &[u8]) -> Vec<(u8, Vec<u8>)> {
    let mut out = Vec::new();
    while b.len() >= 5 {
        let n = u32::from_be_bytes([b[1], b[2], b[3], b[4]]) as usize;
        assert!(b.len() >= 5 + n, "truncated frame");
        out.push((b[0], b[5..5 + n].to_vec()));
        b = &b[5 + n..];
    }
    assert!(b.is_empty(), "trailing bytes");
    out
}

fn web_config(upstream: SocketAddr) -> String {
    config(upstream).replace(
        "upstream = \"svc\"\n",
        "upstream = \"svc\"\ngrpc_web = true\n[route.cors]\nallow_origins = [\"https://app.test\"]\n",
    )
}

/// gRPC-web from a real client: Connect's gRPC-web transport under node
/// (`grpc_web_client.cjs`; `.ci/run` installs the npm packages), over
/// HTTP/1.1: unary, server streaming, and an error sent as trailers only.
#[test]
fn grpc_web_from_connect_client() {
    let modules = std::env::var("GRPC_WEB_CLIENT_MODULES").unwrap_or_else(|_| {
        format!(
            "{}/../../target/grpc-web-client",
            env!("CARGO_MANIFEST_DIR")
        )
    });
    assert!(
        std::path::Path::new(&modules)
            .join("node_modules/@connectrpc/connect-web")
            .exists(),
        "{modules}/node_modules has no @connectrpc/connect-web: `.ci/run` installs it"
    );
    let s = interop_server();
    let pier = pier(&web_config(s.1));
    let script = format!("{}/tests/grpc_web_client.cjs", env!("CARGO_MANIFEST_DIR"));
    let out = run_with_timeout(
        Command::new("node").args([
            script.as_str(),
            modules.as_str(),
            &format!("http://{}", pier.listener("clear")),
        ]),
        Duration::from_secs(60),
    );
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "{text}\n--- pier:\n{}", pier.logs());
    for want in [
        "ok unary",
        "ok server streaming",
        "ok error INVALID_ARGUMENT",
    ] {
        assert!(text.contains(want), "{text}");
    }
    // The calls went upstream as gRPC: OK twice, INVALID_ARGUMENT (3) once.
    assert!(
        wait_metric_at_least(&pier, "pier_grpc_responses_total{status=\"3\"}", 1.0) >= 1.0,
        "{}",
        pier.metrics()
    );
    assert_eq!(pier.metric_value("pier_panics_total"), Some(0.0));
}

fn web_call(pier: &PierProcess, method: &str, ct: &str, body: &[u8]) -> (String, Vec<u8>) {
    web_call_to(pier.listener("clear"), method, ct, body)
}

fn web_call_to(to: SocketAddr, method: &str, ct: &str, body: &[u8]) -> (String, Vec<u8>) {
    let dir = TempDir::new();
    let f = dir.path().join("req.bin");
    std::fs::write(&f, body).unwrap();
    let hdr = dir.path().join("head.txt");
    let out = run_with_timeout(
        Command::new("curl").args([
            "-sS",
            "--http1.1",
            "-D",
            &hdr.display().to_string(),
            "-H",
            &format!("content-type: {ct}"),
            "-H",
            "x-grpc-web: 1",
            "-H",
            "origin: https://app.test",
            "--data-binary",
            &format!("@{}", f.display()),
            &format!("http://{to}/grpc.testing.TestService/{method}"),
        ]),
        Duration::from_secs(30),
    );
    (
        std::fs::read_to_string(&hdr)
            .unwrap_or_default()
            .to_ascii_lowercase(),
        out.stdout,
    )
}

#[test]
fn grpc_web_binary_and_text() {
    use pier_test_support::base64::Engine as _;
    let b64 = pier_test_support::base64::engine::general_purpose::STANDARD;
    let s = interop_server();
    let pier = pier(&web_config(s.1));
    // Unary, binary form: one empty message, then the trailer frame.
    let (head, body) = web_call(
        &pier,
        "EmptyCall",
        "application/grpc-web+proto",
        &[0, 0, 0, 0, 0],
    );
    assert!(head.starts_with("http/1.1 200"), "{head}");
    assert!(
        head.contains("content-type: application/grpc-web+proto"),
        "{head}"
    );
    assert!(
        head.contains("access-control-allow-origin: https://app.test"),
        "{head}"
    );
    assert!(
        head.contains("access-control-expose-headers: grpc-status, grpc-message"),
        "{head}"
    );
    let f = frames(&body);
    assert_eq!(f.len(), 2, "{f:?}");
    assert_eq!(f[0], (0, vec![]));
    assert_eq!(f[1].0, 0x80);
    let trailer = String::from_utf8_lossy(&f[1].1).to_string();
    assert!(trailer.contains("grpc-status:0"), "{trailer}");
    // Server streaming, text form: two messages (10 and 20 payload bytes).
    let msg = [0x12, 0x02, 0x08, 0x0a, 0x12, 0x02, 0x08, 0x14];
    let mut req = vec![0, 0, 0, 0, msg.len() as u8];
    req.extend_from_slice(&msg);
    let (head, body) = web_call(
        &pier,
        "StreamingOutputCall",
        "application/grpc-web-text",
        b64.encode(&req).as_bytes(),
    );
    assert!(
        head.contains("content-type: application/grpc-web-text"),
        "{head}"
    );
    let mut raw = Vec::new();
    let text: Vec<u8> = body
        .iter()
        .copied()
        .filter(|c| !c.is_ascii_whitespace())
        .collect();
    for g in text.chunks(4) {
        b64.decode_vec(g, &mut raw).unwrap();
    }
    let f = frames(&raw);
    assert_eq!(f.len(), 3, "{f:?}");
    assert_eq!((f[0].0, f[0].1.len()), (0, 14));
    assert_eq!((f[1].0, f[1].1.len()), (0, 24));
    assert!(String::from_utf8_lossy(&f[2].1).contains("grpc-status:0"));
    // An error status arrives in the trailer frame.
    let (_, body) = web_call(
        &pier,
        "UnimplementedCall",
        "application/grpc-web",
        &[0, 0, 0, 0, 0],
    );
    let f = frames(&body);
    let last = String::from_utf8_lossy(&f.last().unwrap().1).to_string();
    assert!(last.contains("grpc-status:12"), "{last}");
}

/// Quick mode: `pier proxy --h2c --grpc-web --to h2c://…` carries gRPC
/// (cleartext HTTP/2 both sides) and converts gRPC-web, with no config file.
#[test]
fn quick_mode_grpc_and_grpc_web() {
    let s = interop_server();
    let pier = PierProcess::start_args(
        bin(),
        &[
            "proxy",
            "--listen",
            "127.0.0.1:0",
            "--h2c",
            "--grpc-web",
            "--to",
            &format!("h2c://{}", s.1),
            "--admin",
            "127.0.0.1:0",
        ],
    );
    let to = pier.listener("main");
    for case in [
        "empty_unary",
        "large_unary",
        "server_streaming",
        "ping_pong",
    ] {
        let (ok, out) = client(to, case);
        assert!(ok, "{case}: {out}\n--- pier:\n{}", pier.logs());
    }
    let (head, body) = web_call_to(to, "EmptyCall", "application/grpc-web+proto", &[0; 5]);
    assert!(head.starts_with("http/1.1 200"), "{head}");
    let f = frames(&body);
    assert_eq!(f.len(), 2, "{f:?}");
    assert!(String::from_utf8_lossy(&f[1].1).contains("grpc-status:0"));
    // One multiplexed connection upstream (plus none per call).
    let n = pier
        .metric_value("pier_upstream_connections_created_total")
        .unwrap();
    assert!(n <= 2.0, "{n} upstream connections");
    // gRPC-web needs an HTTP/2 origin: a cleartext HTTP/1 one is refused
    // before anything starts.
    let out = run_with_timeout(
        Command::new(bin()).args([
            "proxy",
            "--listen",
            "127.0.0.1:0",
            "--grpc-web",
            "--to",
            &s.1.to_string(),
        ]),
        Duration::from_secs(20),
    );
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("h2c://"));
}

#[test]
fn cors_preflight_from_config() {
    let s = interop_server();
    let pier = pier(&web_config(s.1));
    let url = format!(
        "http://{}/grpc.testing.TestService/EmptyCall",
        pier.listener("clear")
    );
    let pre = |origin: &str| {
        let out = run_with_timeout(
            Command::new("curl").args([
                "-sS",
                "-D",
                "-",
                "-o",
                "/dev/null",
                "-X",
                "OPTIONS",
                "-H",
                &format!("origin: {origin}"),
                "-H",
                "access-control-request-method: POST",
                "-H",
                "access-control-request-headers: content-type,x-grpc-web",
                &url,
            ]),
            Duration::from_secs(30),
        );
        String::from_utf8_lossy(&out.stdout).to_ascii_lowercase()
    };
    let ok = pre("https://app.test");
    assert!(ok.starts_with("http/1.1 204"), "{ok}");
    assert!(
        ok.contains("access-control-allow-origin: https://app.test"),
        "{ok}"
    );
    assert!(ok.contains("access-control-allow-headers: content-type, x-grpc-web, x-user-agent, grpc-timeout, authorization"), "{ok}");
    assert!(ok.contains("access-control-max-age: 600"), "{ok}");
    let no = pre("https://evil.test");
    assert!(no.starts_with("http/1.1 403"), "{no}");
}

/// A gRPC health server (grpc.health.v1.Health/Check over h2c) whose answer
/// the test switches between SERVING and NOT_SERVING.
fn health_server(serving: std::sync::Arc<std::sync::atomic::AtomicBool>) -> SocketAddr {
    health_server_tls(serving, None)
}

/// The health server, over TLS (ALPN h2) when `tls` is given.
fn health_server_tls(
    serving: std::sync::Arc<std::sync::atomic::AtomicBool>,
    tls: Option<std::sync::Arc<rustls::ServerConfig>>,
) -> SocketAddr {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    l.set_nonblocking(true).unwrap();
    let addr = l.local_addr().unwrap();
    std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async move {
            let l = tokio::net::TcpListener::from_std(l).unwrap();
            loop {
                let Ok((tcp, _)) = l.accept().await else {
                    return;
                };
                let serving = serving.clone();
                let tls = tls.clone();
                tokio::spawn(async move {
                    match tls {
                        None => serve_health(tcp, serving).await,
                        Some(cfg) => {
                            let acceptor = tokio_rustls::TlsAcceptor::from(cfg);
                            if let Ok(s) = acceptor.accept(tcp).await {
                                serve_health(s, serving).await;
                            }
                        }
                    }
                });
            }
        });
    });
    addr
}

/// One HTTP/2 connection of the health server: each call gets SERVING (1)
/// or NOT_SERVING (2) as `serving` says, then grpc-status 0.
async fn serve_health<T>(io: T, serving: std::sync::Arc<std::sync::atomic::AtomicBool>)
where
    T: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
{
    let Ok(mut conn) = h2::server::handshake(io).await else {
        return;
    };
    while let Some(Ok((req, mut respond))) = conn.accept().await {
        let serving = serving.clone();
        tokio::spawn(async move {
            let mut body = req.into_body();
            while let Some(Ok(d)) = body.data().await {
                let _ = body.flow_control().release_capacity(d.len());
            }
            let status = if serving.load(std::sync::atomic::Ordering::SeqCst) {
                1
            } else {
                2
            };
            let resp = http::Response::builder()
                .status(200)
                .header("content-type", "application/grpc")
                .body(())
                .unwrap();
            let Ok(mut send) = respond.send_response(resp, false) else {
                return;
            };
            let _ = send.send_data(bytes::Bytes::from(vec![0, 0, 0, 0, 2, 0x08, status]), false);
            let mut t = http::HeaderMap::new();
            t.insert("grpc-status", http::HeaderValue::from_static("0"));
            let _ = send.send_trailers(t);
        });
    }
}

#[test]
fn grpc_health_check_follows_serving() {
    use std::sync::atomic::AtomicBool;
    let serving = std::sync::Arc::new(AtomicBool::new(true));
    let addr = health_server(serving.clone());
    let cfg = config(addr).replace(
        "retries = 0\n",
        "retries = 0\n[upstream.svc.health_check]\ntype = \"grpc\"\ninterval = \"100ms\"\ntimeout = \"2s\"\nrise = 1\nfall = 1\n",
    );
    let pier = pier(&cfg);
    assert!(server_healthy(&pier, addr, 1.0), "{}", pier.metrics());
    follows_serving(&pier, addr, &serving);
}

/// Whether `addr` of upstream `svc` reaches `want` in pier_upstream_healthy
/// within 30 s.
fn server_healthy(pier: &PierProcess, addr: SocketAddr, want: f64) -> bool {
    wait_until(Duration::from_secs(30), || {
        pier.metric_value(&format!(
            "pier_upstream_healthy{{upstream=\"svc\",server=\"{addr}\"}}"
        )) == Some(want)
    })
}

/// NOT_SERVING marks the server down, SERVING brings it back (each seen by
/// the active grpc check).
fn follows_serving(pier: &PierProcess, addr: SocketAddr, serving: &std::sync::atomic::AtomicBool) {
    use std::sync::atomic::Ordering;
    serving.store(false, Ordering::SeqCst);
    assert!(
        server_healthy(pier, addr, 0.0),
        "NOT_SERVING must mark the server down: {}",
        pier.logs()
    );
    serving.store(true, Ordering::SeqCst);
    assert!(
        server_healthy(pier, addr, 1.0),
        "SERVING again: {}",
        pier.logs()
    );
}

/// Over TLS: a `grpc` check of an upstream with `[upstream.NAME.tls]` runs
/// `grpc.health.v1.Health/Check` over TLS with ALPN h2, verified against the
/// upstream's CA and name (a cleartext check would fail every time).
#[test]
fn grpc_health_check_over_tls() {
    use pier_test_support::tls::{server_config, Alg, TestCa};
    use std::sync::atomic::AtomicBool;
    let dir = TempDir::new();
    let ca = TestCa::new(dir.path(), "pier");
    let cert = ca.server("grpc", &["grpc.test"], Alg::EcdsaP256, 30);
    let serving = std::sync::Arc::new(AtomicBool::new(true));
    let addr = health_server_tls(serving.clone(), Some(server_config(&cert, &[b"h2"])));
    let cfg = config(addr).replace(
        "protocol = \"h2c\"\nretries = 0\n",
        &format!(
            "protocol = \"h2\"\nretries = 0\n[upstream.svc.tls]\nserver_name = \"grpc.test\"\nca = \"{}\"\n\
             [upstream.svc.health_check]\ntype = \"grpc\"\ninterval = \"100ms\"\ntimeout = \"2s\"\nrise = 1\nfall = 1\n",
            ca.cert.display()
        ),
    );
    let pier = pier(&cfg);
    // Down, then up again: the second proves a check passed over TLS.
    follows_serving(&pier, addr, &serving);
}
