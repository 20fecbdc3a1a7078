//! ns per `pier.*` call from a hot Lua loop: the FFI path against an mlua
//! `create_function` doing the same header lookup, plus the fixed cost of
//! running a hook (one coroutine per request). Results go in docs/lua.md.
#![allow(unsafe_code)] // `LuaEngine::lua`, whose handle must not outlive the engine; nothing else

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, Criterion};
use pier_lua::{HttpView, LuaEngine, LuaSetup, RequestCtx, RouteHooks, Source};

struct View {
    headers: Vec<(Vec<u8>, Vec<u8>)>,
    resp: Vec<(Vec<u8>, Vec<u8>)>,
}

impl HttpView for View {
    fn method(&self) -> &[u8] {
        b"GET"
    }
    fn uri(&self) -> &[u8] {
        b"/bench?x=1"
    }
    fn set_uri(&mut self, _: &[u8]) {}
    fn req_header(&self, name: &[u8]) -> Option<&[u8]> {
        self.headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_slice())
    }
    fn req_headers(&self, f: &mut dyn FnMut(&[u8], &[u8])) {
        for (k, v) in &self.headers {
            f(k, v);
        }
    }
    fn set_req_header(&mut self, _: &[u8], _: Option<&[u8]>) {}
    fn add_req_header(&mut self, _: &[u8], _: &[u8]) {}
    fn client_addr(&self) -> SocketAddr {
        SocketAddr::from(([127, 0, 0, 1], 1))
    }
    fn scheme(&self) -> &[u8] {
        b"http"
    }
    fn host(&self) -> &[u8] {
        b"bench"
    }
    fn server_port(&self) -> u16 {
        80
    }
    fn status(&self) -> u16 {
        0
    }
    fn set_status(&mut self, _: u16) {}
    fn resp_header(&self, name: &[u8]) -> Option<&[u8]> {
        self.resp
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_slice())
    }
    fn resp_headers(&self, _: &mut dyn FnMut(&[u8], &[u8])) {}
    fn set_resp_header(&mut self, name: &[u8], value: Option<&[u8]>) {
        self.resp.retain(|(k, _)| !k.eq_ignore_ascii_case(name));
        if let Some(v) = value {
            self.resp.push((name.to_vec(), v.to_vec()));
        }
    }
    fn add_resp_header(&mut self, _: &[u8], _: &[u8]) {}
    fn now_ns(&self) -> u64 {
        1
    }
}

fn view() -> View {
    View {
        headers: vec![
            (b"Host".to_vec(), b"bench".to_vec()),
            (b"Accept".to_vec(), b"*/*".to_vec()),
            (b"User-Agent".to_vec(), b"criterion/0.8".to_vec()),
        ],
        resp: Vec::new(),
    }
}

/// An engine whose route 0 access hook is `code` (reading the global `N`).
fn engine(code: &str) -> LuaEngine {
    let setup = LuaSetup {
        routes: vec![RouteHooks {
            access: Some(Source::Inline {
                code: code.to_owned(),
                name: "bench".to_owned(),
            }),
            ..Default::default()
        }],
        ..Default::default()
    };
    let reg = Arc::new(pier_shdict::Registry::new(&[("cache", 1 << 20)]).unwrap());
    let e = LuaEngine::new(Arc::new(setup), reg).unwrap();
    // SAFETY: the handle is used here only, while `e` lives.
    pier_lua::bench_support::register_classic_get_header(unsafe { e.lua() }).unwrap();
    e
}

fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

/// Times one hook call running the loop `iters` times.
fn loop_bench(c: &mut Criterion, name: &str, code: &str) {
    let e = engine(code);
    let rt = rt();
    c.bench_function(name, |b| {
        b.iter_custom(|iters| {
            // SAFETY: used while `e` lives, not kept.
            unsafe { e.lua() }.globals().set("N", iters).unwrap();
            let mut v = view();
            let t0 = Instant::now();
            rt.block_on(e.access(0, &mut v, &mut RequestCtx::new()))
                .unwrap();
            t0.elapsed()
        })
    });
}

fn benches(c: &mut Criterion) {
    loop_bench(
        c,
        "ffi get_header (per call)",
        "local get, n = pier.req.get_header, 0 for i = 1, N do n = n + #get('user-agent') end",
    );
    loop_bench(
        c,
        "mlua create_function get_header (per call)",
        "local get, n = classic_get_header, 0 for i = 1, N do n = n + #get('user-agent') end",
    );
    loop_bench(
        c,
        "ffi resp set_header (per call)",
        "local set = pier.resp.set_header for i = 1, N do set('x-lua', '1') end",
    );
    loop_bench(
        c,
        "ffi pier.ctx field (per access)",
        "for i = 1, N do local c = pier.ctx c.n = i end",
    );
    loop_bench(
        c,
        "ffi shared incr (per call)",
        "local d = pier.shared.cache for i = 1, N do d:incr('k', 1, 0) end",
    );
    loop_bench(
        c,
        "ffi pier.now (per call)",
        "local now, t = pier.now, 0 for i = 1, N do t = t + now() end",
    );

    // Fixed cost per request: a coroutine plus publishing the request.
    per_request(
        c,
        "access hook call, empty hook (per request)",
        "local x = 1",
    );
    per_request(
        c,
        "access hook call, get_header + compare (per request)",
        "local ua = pier.req.get_header('user-agent') if ua == nil then pier.exit(403) end",
    );
    per_request(
        c,
        "access hook call, pier.exit(403) (per request)",
        "pier.exit(403)",
    );
    loop_bench(
        c,
        "ffi get_header, interpreter only (per call)",
        "jit.off(true, true) local get, n = pier.req.get_header, 0 for i = 1, N do n = n + #get('user-agent') end jit.on(true, true)",
    );
}

fn per_request(c: &mut Criterion, name: &str, code: &str) {
    let e = engine(code);
    let rt = rt();
    c.bench_function(name, |b| {
        b.iter_custom(|iters| {
            let mut v = view();
            let t0 = Instant::now();
            rt.block_on(async {
                for _ in 0..iters {
                    std::hint::black_box(
                        e.access(0, &mut v, &mut RequestCtx::new()).await.unwrap(),
                    );
                }
            });
            t0.elapsed()
        })
    });
}

criterion_group! {
    name = ffi;
    config = Criterion::default()
        .sample_size(10)
        .warm_up_time(Duration::from_millis(300))
        .measurement_time(Duration::from_secs(1));
    targets = benches
}
criterion_main!(ffi);
