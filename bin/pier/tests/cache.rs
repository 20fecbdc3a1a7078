//! The HTTP cache (issue 11, first part): hits, freshness, Age and
//! Cache-Status, HEAD from GET, conditional requests (304 from the cache,
//! synthetic Last-Modified), invalidation by unsafe methods, coalescing of
//! concurrent misses, objects too big to store, Vary.

mod common;

use std::net::SocketAddr;
use std::time::Duration;

use common::*;

fn cache_config(origin: SocketAddr, route_extra: &str) -> String {
    base_config(
        "[cache.main]\nmemory = \"16m\"\nmax_object = \"64k\"",
        &format!(
            r#"[[route]]
name = "default"
upstream = "app"
[route.cache]
zone = "main"
ttl = {{ "200" = "60s" }}
{route_extra}

[upstream.app]
servers = ["{origin}"]
"#
        ),
    )
}

#[test]
fn hits_age_head_and_cache_status() {
    let o = Origin::start();
    let pier = pier(&cache_config(o.addr(), ""));
    let mut c = RawConn::connect(pier.listener("main"));
    let first = c.get("/cache/60").unwrap();
    assert_eq!(first.status, 200);
    assert_eq!(first.header("cache-status"), Some("pier; fwd=miss; stored"));
    for _ in 0..5 {
        let r = c.get("/cache/60").unwrap();
        assert_eq!(r.body, first.body, "served from the cache");
        assert!(
            r.header("cache-status")
                .unwrap()
                .starts_with("pier; hit; ttl="),
            "{r:?}"
        );
        assert!(r.header("age").is_some());
        assert_eq!(r.header("etag"), Some("\"v1\""));
    }
    // HEAD from the stored GET.
    let r = c.request("HEAD", "/cache/60", &[], b"").unwrap();
    assert_eq!(r.status, 200);
    assert_eq!(r.header("content-length"), Some("7"));
    assert!(r.body.is_empty());
    assert_eq!(o.requests(), 1);
    // No freshness of its own: the route's TTL for 200 applies.
    c.get("/hello").unwrap();
    let r = c.get("/hello").unwrap();
    assert_eq!(r.body, b"hello world\n");
    assert!(r.header("cache-status").unwrap().contains("hit"));
    assert_eq!(o.requests(), 2);
    // A client's no-cache goes to the origin (and refreshes the object).
    let r = c
        .request("GET", "/cache/60", &[("Cache-Control", "no-cache")], b"")
        .unwrap();
    assert_eq!(r.status, 200);
    assert_eq!(o.requests(), 3);
    assert!(pier.metrics().contains("pier_cache_lookups_total"));
}

#[test]
fn a_head_miss_is_not_stored_as_the_get() {
    let o = Origin::start();
    let pier = pier(&cache_config(o.addr(), ""));
    let mut c = RawConn::connect(pier.listener("main"));
    let r = c.request("HEAD", "/cache/60", &[], b"").unwrap();
    assert_eq!(r.status, 200);
    // The GET after it gets the whole body (from the origin, then stored).
    let r = c.get("/cache/60").unwrap();
    assert_eq!(
        r.body.len(),
        r.header("content-length")
            .unwrap()
            .parse::<usize>()
            .unwrap()
    );
    assert!(!r.body.is_empty());
    let r2 = c.get("/cache/60").unwrap();
    assert_eq!(r2.body, r.body);
    assert!(r2.header("cache-status").unwrap().contains("hit"));
    assert_eq!(o.requests(), 2);
}

#[test]
fn conditional_requests_get_304_from_the_cache() {
    let o = Origin::start();
    let pier = pier(&cache_config(o.addr(), ""));
    let mut c = RawConn::connect(pier.listener("main"));
    c.get("/cache/60").unwrap();
    let r = c
        .request("GET", "/cache/60", &[("If-None-Match", "\"v1\"")], b"")
        .unwrap();
    assert_eq!(r.status, 304);
    assert!(r.body.is_empty());
    let r = c
        .request("GET", "/cache/60", &[("If-None-Match", "\"other\"")], b"")
        .unwrap();
    assert_eq!(r.status, 200);
    // /hello has no validator: Pier stores a synthetic Last-Modified.
    let r = c.get("/hello").unwrap();
    let r2 = c.get("/hello").unwrap();
    let lm = r2
        .header("last-modified")
        .expect("synthetic Last-Modified")
        .to_string();
    let _ = r;
    let r = c
        .request("GET", "/hello", &[("If-Modified-Since", &lm)], b"")
        .unwrap();
    assert_eq!(r.status, 304);
    assert_eq!(o.requests(), 2);
}

#[test]
fn unsafe_methods_invalidate_and_big_objects_stream_through() {
    let o = Origin::start();
    let pier = pier(&cache_config(o.addr(), ""));
    let mut c = RawConn::connect(pier.listener("main"));
    c.get("/cache/60").unwrap();
    c.get("/cache/60").unwrap();
    assert_eq!(o.requests(), 1);
    let r = c.request("POST", "/cache/60", &[], b"x").unwrap();
    assert_eq!(r.status, 200);
    let r = c.get("/cache/60").unwrap();
    assert_eq!(r.header("cache-status"), Some("pier; fwd=miss; stored"));
    assert_eq!(o.requests(), 3);
    // Larger than max_object (64k): relayed whole, never stored.
    for _ in 0..2 {
        let r = c.get("/bytes/200000").unwrap();
        assert_eq!(r.body.len(), 200_000);
    }
    assert_eq!(o.requests(), 5);
}

#[test]
fn concurrent_misses_reach_the_origin_once() {
    let o = Origin::start();
    let pier = pier(&cache_config(o.addr(), ""));
    let addr = pier.listener("main");
    let threads: Vec<_> = (0..50)
        .map(|_| {
            std::thread::spawn(move || {
                let r = RawConn::connect(addr).get("/slow/300").unwrap();
                (r.status, r.body)
            })
        })
        .collect();
    for t in threads {
        let (status, body) = t.join().unwrap();
        assert_eq!((status, body.as_slice()), (200, &b"slow\n"[..]));
    }
    assert_eq!(o.requests(), 1, "one fill for 50 concurrent misses");
    assert!(
        pier.metric_value("pier_cache_lookups_total{zone=\"main\",result=\"coalesced\"}")
            .unwrap_or(0.0)
            >= 1.0,
        "{}",
        pier.metrics()
    );
    let _ = Duration::ZERO;
}

#[test]
fn quick_mode_cache() {
    let o = Origin::start();
    let p = PierProcess::start_args(
        bin(),
        &[
            "proxy",
            "--listen",
            "127.0.0.1:0",
            "--to",
            &o.addr().to_string(),
            "--cache",
            "16MiB",
        ],
    );
    let mut c = RawConn::connect(p.listener("main"));
    for _ in 0..3 {
        assert_eq!(c.get("/cache/60").unwrap().status, 200);
    }
    // Without freshness of its own, /hello is not stored in quick mode.
    c.get("/hello").unwrap();
    c.get("/hello").unwrap();
    assert_eq!(o.requests(), 3);
}
