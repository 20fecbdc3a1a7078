//! Scenarios: an end-to-end test as origin behaviour, Pier config, client
//! requests and expectations, in a few lines (in the spirit of varnishtest).
//!
//! ```no_run
//! # use pier_test_support::{Scenario, Reply};
//! # let bin = std::path::Path::new("pier");
//! let s = Scenario::new(bin)
//!     .origin(|_req| Reply::ok("hi").header("cache-control", "max-age=60"))
//!     .top("[cache.main]\nmemory = \"16m\"")
//!     .route("[route.cache]\nzone = \"main\"")
//!     .start();
//! s.get("/a").expect_status(200).expect_body("hi");
//! s.get("/a").expect_header_prefix("cache-status", "pier; hit");
//! assert_eq!(s.origin_requests(), 1);
//! ```
//!
//! Without [`Scenario::origin`] the stock [`Origin`] serves (`/hello`, `/echo`,
//! `/status/N`…). [`Scenario::over`] names the protocol the client speaks
//! to Pier (HTTP/1.1 by default, or HTTP/3 on a TLS listener made for the
//! scenario), so one test body runs over each. Every expectation panics with the whole response; Pier's
//! output follows when the test fails ([`PierProcess`] prints it on drop).

use std::net::SocketAddr;
use std::ops::Deref;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use crate::client::{RawConn, Response};
use crate::config::{base_config, route_config, servers};
use crate::origin::Origin;
use crate::process::PierProcess;
use crate::script::{Reply, Request, Script, ScriptFn};

/// The protocol a scenario's client speaks to Pier.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Proto {
    /// HTTP/1.1 over TCP (the listener as configured).
    Http1,
    /// HTTP/3 over QUIC: the `main` listener gets TLS (a test CA's
    /// certificate for `pier.test`) and `http3 = true`.
    Http3,
}

/// What a scenario says before Pier starts.
pub struct Scenario {
    bin: PathBuf,
    proto: Proto,
    script: Option<Arc<ScriptFn>>,
    origin_name: String,
    top: String,
    route: String,
    routes: String,
    upstream: String,
    config: Option<String>,
}

impl std::fmt::Debug for Scenario {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Scenario")
            .field("scripted", &self.script.is_some())
            .field("top", &self.top)
            .field("route", &self.route)
            .field("upstream", &self.upstream)
            .finish_non_exhaustive()
    }
}

impl Scenario {
    /// A scenario for the `pier` binary at `bin`: a stock origin named `origin`
    /// behind one catch-all route (`default`, upstream `app`).
    pub fn new(bin: &Path) -> Scenario {
        Scenario {
            bin: bin.to_path_buf(),
            proto: Proto::Http1,
            script: None,
            origin_name: "origin".into(),
            top: String::new(),
            route: String::new(),
            routes: String::new(),
            upstream: String::new(),
            config: None,
        }
    }

    /// The protocol the client speaks (HTTP/1.1 unless told).
    pub fn over(mut self, proto: Proto) -> Self {
        self.proto = proto;
        self
    }

    /// A scripted origin: `answer` says what to reply to each request.
    pub fn origin(mut self, answer: impl Fn(&Request) -> Reply + Send + Sync + 'static) -> Self {
        self.script = Some(Arc::new(answer));
        self
    }

    /// The stock origin's name (its `/name` and `x-origin`).
    pub fn origin_named(mut self, name: &str) -> Self {
        self.origin_name = name.into();
        self
    }

    /// Whole sections before the listener (`[limits]`, `[cache.main]`…).
    pub fn top(mut self, toml: &str) -> Self {
        self.top.push_str(toml);
        self.top.push('\n');
        self
    }

    /// Lines under the catch-all route (`[route.cache]`… as its last tables).
    pub fn route(mut self, toml: &str) -> Self {
        self.route.push_str(toml);
        self.route.push('\n');
        self
    }

    /// Route sections of their own instead of the catch-all route (see
    /// [`crate::lua_route`]); upstream `app` is still the origin.
    pub fn routes(mut self, toml: &str) -> Self {
        self.routes.push_str(toml);
        self.routes.push('\n');
        self
    }

    /// Lines under `[upstream.app]` (`retries = 0`…).
    pub fn upstream(mut self, toml: &str) -> Self {
        self.upstream.push_str(toml);
        self.upstream.push('\n');
        self
    }

    /// The whole config instead (`{origin}` stands for the origin's address).
    pub fn config(mut self, text: &str) -> Self {
        self.config = Some(text.into());
        self
    }

    /// Starts the origin and Pier (panics, with Pier's output, unless it is ready).
    pub fn start(self) -> Running {
        let (origin, addr) = match self.script {
            Some(f) => {
                let s = Script::start_arc(f);
                let a = s.addr();
                (Backend::Script(s), a)
            }
            None => {
                let o = Origin::start_named(&self.origin_name);
                let a = o.addr();
                (Backend::Stock(o), a)
            }
        };
        let config = match self.config {
            Some(text) => text.replace("{origin}", &addr.to_string()),
            None if !self.routes.is_empty() => base_config(
                &self.top,
                &format!(
                    "{}\n[upstream.app]\nservers = {}\n{}",
                    self.routes,
                    servers(&[addr]),
                    self.upstream
                ),
            ),
            None => route_config(&[addr], &self.top, &self.route, &self.upstream),
        };
        let (config, tls) = match self.proto {
            Proto::Http1 => (config, None),
            Proto::Http3 => {
                let dir = crate::TempDir::new();
                let ca = crate::tls::TestCa::new(dir.path(), "scenario");
                let cert = ca.server(
                    "pier",
                    &["pier.test", "localhost"],
                    crate::tls::Alg::EcdsaP256,
                    30,
                );
                let listener = "[[listener]]\nname = \"main\"\nlisten = \"127.0.0.1:0\"\n";
                assert!(
                    config.contains(listener),
                    "an HTTP/3 scenario needs its `main` listener as base_config writes it"
                );
                let config = config.replacen(
                    listener,
                    &format!(
                        "{listener}http3 = true\n[listener.tls]\ncert = \"{}\"\nkey = \"{}\"\n",
                        cert.cert.display(),
                        cert.key.display()
                    ),
                    1,
                );
                (config, Some((dir, ca)))
            }
        };
        let pier = PierProcess::start(&self.bin, &config);
        Running {
            pier,
            origin,
            proto: self.proto,
            tls,
        }
    }
}

enum Backend {
    Stock(Origin),
    Script(Script),
}

/// A started scenario: Pier (its methods through `Deref`) and its origin.
pub struct Running {
    pier: PierProcess,
    origin: Backend,
    proto: Proto,
    /// HTTP/3: the certificate's directory and the CA the client trusts.
    tls: Option<(crate::TempDir, crate::tls::TestCa)>,
}

impl std::fmt::Debug for Running {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Running")
            .field("pier", &self.pier.pid())
            .finish_non_exhaustive()
    }
}

impl Deref for Running {
    type Target = PierProcess;
    fn deref(&self) -> &PierProcess {
        &self.pier
    }
}

impl Running {
    /// The `main` listener's address.
    pub fn addr(&self) -> SocketAddr {
        self.pier.listener("main")
    }

    /// The stock origin; panics for a scripted one.
    pub fn origin(&self) -> &Origin {
        match &self.origin {
            Backend::Stock(o) => o,
            Backend::Script(_) => panic!("this scenario's origin is scripted"),
        }
    }

    /// The origin's address.
    pub fn origin_addr(&self) -> SocketAddr {
        match &self.origin {
            Backend::Stock(o) => o.addr(),
            Backend::Script(s) => s.addr(),
        }
    }

    /// Requests the origin has read (the stock origin: all but `/healthz`).
    pub fn origin_requests(&self) -> u64 {
        match &self.origin {
            Backend::Stock(o) => o.requests(),
            Backend::Script(s) => s.requests() as u64,
        }
    }

    /// `GET path` on a new connection.
    #[track_caller]
    pub fn get(&self, path: &str) -> Exchange {
        self.request("GET", path, &[], b"")
    }

    /// A request on a new connection (Host `pier.test` unless given).
    #[track_caller]
    pub fn request(
        &self,
        method: &str,
        path: &str,
        headers: &[(&str, &str)],
        body: &[u8],
    ) -> Exchange {
        self.conn().request(method, path, headers, body)
    }

    /// A keep-alive client connection (over HTTP/3: one QUIC connection).
    pub fn conn(&self) -> Conn {
        match (&self.proto, &self.tls) {
            (Proto::Http3, Some((_, ca))) => Conn(Kind::H3(Box::new(
                crate::H3Conn::connect(self.addr(), &ca.cert)
                    .unwrap_or_else(|e| panic!("HTTP/3 connection: {e}")),
            ))),
            _ => Conn(Kind::H1(RawConn::connect(self.addr()))),
        }
    }

    /// The protocol the client speaks.
    pub fn proto(&self) -> Proto {
        self.proto
    }

    /// Polls `GET path` (on new connections) until its body is `want`, 5 s at
    /// most; panics with the last body otherwise. For what Pier does after the
    /// response (the log phase, a background refresh).
    #[track_caller]
    pub fn wait_body(&self, path: &str, want: &str) {
        let mut last = String::new();
        let ok = crate::wait_until(Duration::from_secs(5), || {
            last = self.get(path).body_str();
            last == want
        });
        assert!(ok, "GET {path}: body {last:?}, waited for {want:?}");
    }

    /// The started Pier.
    pub fn pier(&self) -> &PierProcess {
        &self.pier
    }
}

/// A client connection of a scenario: requests on one connection, in order.
#[derive(Debug)]
pub struct Conn(Kind);

#[derive(Debug)]
enum Kind {
    H1(RawConn),
    H3(Box<crate::H3Conn>),
}

impl Conn {
    #[track_caller]
    pub fn get(&mut self, path: &str) -> Exchange {
        self.request("GET", path, &[], b"")
    }

    #[track_caller]
    pub fn request(
        &mut self,
        method: &str,
        path: &str,
        headers: &[(&str, &str)],
        body: &[u8],
    ) -> Exchange {
        let what = format!("{method} {path}");
        let resp = match &mut self.0 {
            Kind::H1(c) => c.request(method, path, headers, body),
            Kind::H3(c) => c.request(method, path, headers, body),
        }
        .unwrap_or_else(|e| panic!("{what}: {e}"));
        Exchange { what, resp }
    }

    /// The raw connection (to send bytes, check it closed…); HTTP/1 only.
    pub fn raw(&mut self) -> &mut RawConn {
        match &mut self.0 {
            Kind::H1(c) => c,
            Kind::H3(_) => panic!("an HTTP/3 scenario has no raw TCP connection"),
        }
    }
}

/// One response, with expectations that return it for more.
#[derive(Debug)]
pub struct Exchange {
    what: String,
    resp: Response,
}

impl Deref for Exchange {
    type Target = Response;
    fn deref(&self) -> &Response {
        &self.resp
    }
}

impl Exchange {
    #[track_caller]
    fn check(self, ok: bool, want: impl std::fmt::Display) -> Self {
        assert!(
            ok,
            "{}: wanted {want}; got {} {:?}, headers {:?}, body {:?}",
            self.what,
            self.resp.status,
            self.resp.reason,
            self.resp.headers,
            self.resp.body_str()
        );
        self
    }

    #[track_caller]
    pub fn expect_status(self, status: u16) -> Self {
        let ok = self.resp.status == status;
        self.check(ok, format_args!("status {status}"))
    }

    #[track_caller]
    pub fn expect_body(self, body: impl AsRef<[u8]>) -> Self {
        let body = body.as_ref();
        let ok = self.resp.body == body;
        self.check(ok, format_args!("body {:?}", String::from_utf8_lossy(body)))
    }

    #[track_caller]
    pub fn expect_body_prefix(self, prefix: &str) -> Self {
        let ok = self.resp.body_str().starts_with(prefix);
        self.check(ok, format_args!("a body starting {prefix:?}"))
    }

    #[track_caller]
    pub fn expect_body_contains(self, part: &str) -> Self {
        let ok = self.resp.body_str().contains(part);
        self.check(ok, format_args!("a body with {part:?}"))
    }

    /// The header's first value is `value`.
    #[track_caller]
    pub fn expect_header(self, name: &str, value: &str) -> Self {
        let ok = self.resp.header(name) == Some(value);
        self.check(ok, format_args!("{name}: {value}"))
    }

    /// The header's first value starts with `prefix`.
    #[track_caller]
    pub fn expect_header_prefix(self, name: &str, prefix: &str) -> Self {
        let ok = self
            .resp
            .header(name)
            .is_some_and(|v| v.starts_with(prefix));
        self.check(ok, format_args!("{name}: {prefix}…"))
    }

    /// The header's first value contains `part`.
    #[track_caller]
    pub fn expect_header_contains(self, name: &str, part: &str) -> Self {
        let ok = self.resp.header(name).is_some_and(|v| v.contains(part));
        self.check(ok, format_args!("{name}: …{part}…"))
    }

    #[track_caller]
    pub fn expect_no_header(self, name: &str) -> Self {
        let ok = self.resp.header(name).is_none();
        self.check(ok, format_args!("no {name}"))
    }

    /// A response Pier made: this status, `x-pier-reason: reason`, and a body
    /// that starts with the status code.
    #[track_caller]
    pub fn expect_local(self, status: u16, reason: &str) -> Self {
        let ok = self.resp.status == status
            && self.resp.pier_reason() == Some(reason)
            && self.resp.body_str().starts_with(&status.to_string());
        self.check(ok, format_args!("a local {status} {reason}"))
    }

    /// The response itself.
    pub fn response(self) -> Response {
        self.resp
    }
}
