//! Headless Chromium driven over the DevTools protocol (a WebSocket): a
//! real browser for the tests that need one (the dashboard, HTTP/3). The
//! tests wait on conditions in the page, never on time.

use crate::{ws, RawConn, TempDir};
use std::net::SocketAddr;
use std::time::{Duration, Instant};

/// Headless Chromium (Debian `chromium`, installed by .ci/run): the binary's path.
pub fn chromium() -> std::path::PathBuf {
    let p = std::env::var_os("PIER_CHROMIUM")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| "/usr/bin/chromium".into());
    assert!(
        p.exists(),
        "{} not found: install Debian's chromium (.ci/run does) or set PIER_CHROMIUM",
        p.display()
    );
    p
}

/// A headless Chromium showing one page, driven over the DevTools protocol
/// (a WebSocket): the test waits on conditions in the page, not on time.
pub struct Browser {
    child: std::process::Child,
    ws: RawConn,
    next_id: u64,
    _profile: TempDir,
}

impl Drop for Browser {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Browser {
    /// Chromium showing `url`, with QUIC off.
    pub fn open(url: &str) -> Browser {
        Browser::open_with(url, &["--disable-quic"])
    }

    /// Chromium showing `url`, with `extra` flags (`--enable-quic`,
    /// `--origin-to-force-quic-on=…`, `--ignore-certificate-errors-spki-list=…`).
    pub fn open_with(url: &str, extra: &[&str]) -> Browser {
        let profile = TempDir::new();
        let child = std::process::Command::new(chromium())
            .args(extra)
            .args([
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                "--no-first-run",
                "--disable-background-networking",
                "--disable-component-update",
                "--disable-sync",
                "--disable-dev-shm-usage",
                "--window-size=1400,2000",
                "--remote-debugging-address=127.0.0.1",
                "--remote-debugging-port=0",
            ])
            .arg(format!("--user-data-dir={}", profile.path().display()))
            .arg(url)
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .expect("start chromium");
        // Chromium writes the port it chose to DevToolsActivePort.
        let port_file = profile.path().join("DevToolsActivePort");
        let deadline = Instant::now() + Duration::from_secs(60);
        let port: u16 = loop {
            if let Some(p) = std::fs::read_to_string(&port_file)
                .ok()
                .and_then(|t| t.lines().next().and_then(|l| l.trim().parse().ok()))
            {
                break p;
            }
            assert!(
                Instant::now() < deadline,
                "chromium gave no DevTools port in 60 s"
            );
            std::thread::sleep(Duration::from_millis(50));
        };
        let devtools: SocketAddr = ([127, 0, 0, 1], port).into();
        // The page target's WebSocket path.
        let path = loop {
            // DevTools accepts only an IP or localhost as Host.
            let host = format!("127.0.0.1:{port}");
            let list = RawConn::connect(devtools)
                .request("GET", "/json/list", &[("host", &host)], b"")
                .expect("devtools /json/list");
            let v: serde_json::Value = serde_json::from_slice(&list.body).unwrap_or_default();
            let found = v.as_array().and_then(|a| {
                a.iter()
                    .find(|t| t["type"] == "page")
                    .and_then(|t| t["webSocketDebuggerUrl"].as_str())
                    .and_then(|u| {
                        u.split_once("/devtools/")
                            .map(|(_, p)| format!("/devtools/{p}"))
                    })
            });
            if let Some(p) = found {
                break p;
            }
            assert!(
                Instant::now() < deadline,
                "no page target: {}",
                list.body_str()
            );
            std::thread::sleep(Duration::from_millis(50));
        };
        let mut ws = RawConn::connect(devtools);
        ws.set_timeout(Duration::from_secs(30));
        ws.send(
            format!(
                "GET {path} HTTP/1.1\r\nhost: 127.0.0.1:{port}\r\nupgrade: websocket\r\nconnection: Upgrade\r\n\
                 sec-websocket-key: dGhlIHNhbXBsZSBub25jZQ==\r\nsec-websocket-version: 13\r\n\r\n"
            )
            .as_bytes(),
        );
        let r = ws.read_head_only().expect("devtools handshake");
        assert_eq!(r.status, 101, "devtools handshake");
        Browser {
            child,
            ws,
            next_id: 1,
            _profile: profile,
        }
    }

    /// Calls a DevTools method; its `result`.
    pub fn call(&mut self, method: &str, params: serde_json::Value) -> serde_json::Value {
        let id = self.next_id;
        self.next_id += 1;
        let msg = serde_json::json!({ "id": id, "method": method, "params": params }).to_string();
        self.ws.send(&ws::encode_frame(
            true,
            1,
            msg.as_bytes(),
            Some([1, 2, 3, 4]),
        ));
        loop {
            let f = self.ws.read_ws_frame().expect("devtools frame");
            let Ok(v) = serde_json::from_slice::<serde_json::Value>(&f.payload) else {
                continue;
            };
            if v["id"] == id {
                assert!(v["error"].is_null(), "{method}: {v}");
                return v["result"].clone();
            }
        }
    }

    /// Evaluates `expr` in the page; its value.
    pub fn eval(&mut self, expr: &str) -> serde_json::Value {
        let r = self.call(
            "Runtime.evaluate",
            serde_json::json!({ "expression": expr, "returnByValue": true }),
        );
        r["result"]["value"].clone()
    }

    /// Polls `expr` until it is true (deadline 30 s).
    pub fn wait_for(&mut self, expr: &str, what: &str) {
        let deadline = Instant::now() + Duration::from_secs(30);
        while self.eval(expr) != serde_json::Value::Bool(true) {
            assert!(
                Instant::now() < deadline,
                "page: {what} not true after 30 s"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}
