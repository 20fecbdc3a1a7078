//! The unit-test harness of the Lua layer: an in-memory request/response
//! implementing `HttpView`, and helpers to build engines and run hooks.
#![allow(dead_code)]

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;

use pier_lua::{HttpView, LuaEngine, LuaSetup, RouteHooks, Source};
use pier_shdict::Registry;

#[derive(Debug, Clone)]
pub struct TestView {
    pub method: Vec<u8>,
    pub uri: Vec<u8>,
    pub headers: Vec<(Vec<u8>, Vec<u8>)>,
    pub client: SocketAddr,
    pub scheme: Vec<u8>,
    pub host: Vec<u8>,
    pub port: u16,
    pub status: u16,
    pub resp_headers: Vec<(Vec<u8>, Vec<u8>)>,
    pub now_ns: u64,
    /// A request body `ngx.req.read_body` reads after `body_pending` polls
    /// that return Pending (as the proxy's reader would); `body_read` once in.
    pub body: Option<Vec<u8>>,
    pub body_pending: usize,
    pub body_read: bool,
}

impl Default for TestView {
    fn default() -> Self {
        TestView {
            method: b"GET".to_vec(),
            uri: b"/api/items?id=7&tag=a&tag=b&flag&q=hello%20world+x".to_vec(),
            headers: vec![
                (b"Host".to_vec(), b"example.test".to_vec()),
                (b"User-Agent".to_vec(), b"curl/8.0".to_vec()),
                (b"X-Multi".to_vec(), b"one".to_vec()),
                (b"X-Multi".to_vec(), b"two".to_vec()),
            ],
            client: "192.0.2.7:51000".parse().unwrap(),
            scheme: b"http".to_vec(),
            host: b"example.test".to_vec(),
            port: 8080,
            status: 0,
            resp_headers: Vec::new(),
            now_ns: 1_700_000_000_123_456_789,
            body: None,
            body_pending: 0,
            body_read: false,
        }
    }
}

fn find<'a>(list: &'a [(Vec<u8>, Vec<u8>)], name: &[u8]) -> Option<&'a [u8]> {
    list.iter()
        .find(|(k, _)| k.eq_ignore_ascii_case(name))
        .map(|(_, v)| v.as_slice())
}

fn set(list: &mut Vec<(Vec<u8>, Vec<u8>)>, name: &[u8], value: Option<&[u8]>) {
    let pos = list.iter().position(|(k, _)| k.eq_ignore_ascii_case(name));
    list.retain(|(k, _)| !k.eq_ignore_ascii_case(name));
    if let Some(v) = value {
        let at = pos.unwrap_or(list.len()).min(list.len());
        list.insert(at, (name.to_vec(), v.to_vec()));
    }
}

impl HttpView for TestView {
    fn method(&self) -> &[u8] {
        &self.method
    }
    fn uri(&self) -> &[u8] {
        &self.uri
    }
    fn set_uri(&mut self, uri: &[u8]) {
        self.uri = uri.to_vec();
    }
    fn set_method(&mut self, method: &[u8]) -> bool {
        self.method = method.to_vec();
        true
    }
    fn req_header(&self, name: &[u8]) -> Option<&[u8]> {
        find(&self.headers, name)
    }
    fn req_headers(&self, f: &mut dyn FnMut(&[u8], &[u8])) {
        for (k, v) in &self.headers {
            f(k, v);
        }
    }
    fn set_req_header(&mut self, name: &[u8], value: Option<&[u8]>) {
        set(&mut self.headers, name, value);
    }
    fn add_req_header(&mut self, name: &[u8], value: &[u8]) {
        self.headers.push((name.to_vec(), value.to_vec()));
    }
    fn client_addr(&self) -> SocketAddr {
        self.client
    }
    fn scheme(&self) -> &[u8] {
        &self.scheme
    }
    fn host(&self) -> &[u8] {
        &self.host
    }
    fn server_port(&self) -> u16 {
        self.port
    }
    fn status(&self) -> u16 {
        self.status
    }
    fn set_status(&mut self, s: u16) {
        self.status = s;
    }
    fn resp_header(&self, name: &[u8]) -> Option<&[u8]> {
        find(&self.resp_headers, name)
    }
    fn resp_headers(&self, f: &mut dyn FnMut(&[u8], &[u8])) {
        for (k, v) in &self.resp_headers {
            f(k, v);
        }
    }
    fn set_resp_header(&mut self, name: &[u8], value: Option<&[u8]>) {
        set(&mut self.resp_headers, name, value);
    }
    fn add_resp_header(&mut self, name: &[u8], value: &[u8]) {
        self.resp_headers.push((name.to_vec(), value.to_vec()));
    }
    fn now_ns(&self) -> u64 {
        self.now_ns
    }
    fn poll_read_body(&mut self, cx: &mut std::task::Context<'_>) -> std::task::Poll<()> {
        if self.body.is_some() && self.body_pending > 0 {
            self.body_pending -= 1;
            cx.waker().wake_by_ref();
            return std::task::Poll::Pending;
        }
        self.body_read = self.body.is_some();
        std::task::Poll::Ready(())
    }
    fn req_body(&self) -> Option<&[u8]> {
        self.body.as_deref().filter(|_| self.body_read)
    }
}

impl TestView {
    pub fn req(&self, name: &str) -> Option<String> {
        find(&self.headers, name.as_bytes()).map(|v| String::from_utf8_lossy(v).into_owned())
    }
    pub fn resp(&self, name: &str) -> Option<String> {
        find(&self.resp_headers, name.as_bytes()).map(|v| String::from_utf8_lossy(v).into_owned())
    }
}

pub fn src(name: &str, code: &str) -> Option<Source> {
    Some(Source::Inline {
        code: code.to_owned(),
        name: name.to_owned(),
    })
}

/// A setup with one route (index 0) whose hooks are `hooks`.
pub fn setup(hooks: RouteHooks) -> LuaSetup {
    LuaSetup {
        routes: vec![hooks],
        ..Default::default()
    }
}

pub fn registry(dicts: &[(&str, usize)]) -> Arc<Registry> {
    Arc::new(Registry::new(dicts).unwrap())
}

pub fn engine(setup: LuaSetup) -> LuaEngine {
    LuaEngine::new(Arc::new(setup), registry(&[("cache", 1 << 20)])).unwrap()
}

/// An engine whose route 0 has just an access hook.
pub fn access_engine(code: &str) -> LuaEngine {
    engine(setup(RouteHooks {
        access: src("route t access", code),
        ..Default::default()
    }))
}

/// Runs `f` on a current-thread runtime inside a LocalSet, as the proxy does.
pub fn run<F: Future>(f: F) -> F::Output {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    tokio::task::LocalSet::new().block_on(&rt, f)
}

/// The string at `key` in dict `cache` of `reg`.
pub fn dict_str(reg: &Registry, key: &str) -> String {
    let mut out = Vec::new();
    reg.get("cache")
        .unwrap()
        .get(key.as_bytes(), 0, &mut out)
        .expect(key);
    String::from_utf8(out).unwrap()
}
