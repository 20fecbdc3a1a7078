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
fn interop_server() -> Server {
    let port = {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    let child = Command::new(go_bin("server"))
        .args(["-port", &port.to_string()])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let addr: SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
    assert!(
        wait_until(Duration::from_secs(30), || std::net::TcpStream::connect(
            addr
        )
        .is_ok()),
        "interop server did not start"
    );
    Server(child, addr)
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
    let out = run_with_timeout(
        Command::new(go_bin("client")).args([
            "-server_host",
            "127.0.0.1",
            "-server_port",
            &to.port().to_string(),
            "-test_case",
            case,
        ]),
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

#[test]
fn interop_cases_through_pier() {
    let s = interop_server();
    let pier = pier(&config(s.1));
    let to = pier.listener("clear");
    for case in [
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
    ] {
        let (ok, out) = client(to, case);
        assert!(ok, "{case}: {out}\n--- pier:\n{}", pier.logs());
    }
    assert_eq!(pier.metric_value("pier_panics_total"), Some(0.0));
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
