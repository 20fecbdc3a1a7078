//! The tiered cache (issue 37): lower-tier Piers with `[cache.NAME]
//! parents` ask the parent that owns a key on a consistent-hash ring
//! before the origin. 1,000 objects requested through three lower tiers
//! reach the origin once each; a parent stopped moves only its own keys to
//! the next parent, each fetched from the origin once more; a request
//! carrying the hop mark is filled from the origin, never from parents
//! again, and the origin never sees the mark.

mod common;

use std::net::SocketAddr;
use std::time::Duration;

use common::*;

fn tier(origin: SocketAddr, parents: &[SocketAddr]) -> PierProcess {
    pier(&tier_config(origin, parents, None))
}

/// A tier's config: listening on `port` (0: any).
fn tier_config(origin: SocketAddr, parents: &[SocketAddr], port: Option<u16>) -> String {
    let port = port.unwrap_or(0);
    let parents = if parents.is_empty() {
        String::new()
    } else {
        let list: Vec<String> = parents.iter().map(|a| format!("\"{a}\"")).collect();
        format!("parents = [{}]\n", list.join(", "))
    };
    format!(
        r#"[server]
workers = 1

[admin]
listen = "127.0.0.1:0"

[log]
access = "off"

[cache.main]
memory = "32m"
{parents}
[[listener]]
name = "main"
listen = "127.0.0.1:{port}"

[[route]]
name = "site"
upstream = "app"
[route.cache]
zone = "main"

[upstream.app]
servers = ["{origin}"]
"#
    )
}

/// GETs `/cache/600?o=N` for every N in `objects` on `p`, over one
/// keep-alive connection: the Cache-Status of each.
fn fetch_all(p: &PierProcess, objects: std::ops::Range<u32>) -> Vec<String> {
    let mut c = RawConn::connect(p.listener("main"));
    objects
        .map(|n| {
            let r = c
                .request(
                    "GET",
                    &format!("/cache/600?o={n}"),
                    &[("host", "tier.test")],
                    b"",
                )
                .unwrap();
            assert_eq!(r.status, 200, "{}", r.body_str());
            r.header("cache-status").unwrap_or("").to_string()
        })
        .collect()
}

/// Objects `p` stored, once it has stored `want` (a store completes
/// after the client has its answer): the count then, or after 10 s.
fn stored_reaches(p: &PierProcess, want: f64) -> f64 {
    wait_until(Duration::from_secs(10), || stored(p) >= want);
    stored(p)
}

fn stored(p: &PierProcess) -> f64 {
    p.metric_value("pier_cache_stored_total{zone=\"main\"}")
        .unwrap_or(0.0)
}

#[test]
fn three_lower_tiers_reach_the_origin_once_per_object() {
    let origin = Origin::start();
    let parents: Vec<PierProcess> = (0..2).map(|_| tier(origin.addr(), &[])).collect();
    let addrs: Vec<SocketAddr> = parents.iter().map(|p| p.listener("main")).collect();
    let children: Vec<PierProcess> = (0..3).map(|_| tier(origin.addr(), &addrs)).collect();

    // Every object through every lower tier, the three at once.
    std::thread::scope(|s| {
        for c in &children {
            s.spawn(move || fetch_all(c, 0..1000));
        }
    });
    assert_eq!(origin.requests(), 1000, "each object from the origin once");
    // The ring spread the keys over both parents, each stored once.
    assert!(
        wait_until(Duration::from_secs(10), || stored(&parents[0])
            + stored(&parents[1])
            >= 1000.0),
        "the parents stored every object"
    );
    let (a, b) = (stored(&parents[0]), stored(&parents[1]));
    assert_eq!(a + b, 1000.0);
    assert!((300.0..=700.0).contains(&a), "parent 1 owns {a} of 1000");
    for c in &children {
        assert_eq!(stored_reaches(c, 1000.0), 1000.0);
    }

    // Parent 1 stopped, lower tiers started afresh (empty caches): the
    // keys parent 1 owned go to parent 2, each from the origin once more;
    // parent 2's own keys are hits there.
    let owned_by_first = a as u64;
    let mut parents = parents;
    drop(parents.remove(0));
    drop(children);
    let children: Vec<PierProcess> = (0..3).map(|_| tier(origin.addr(), &addrs)).collect();
    std::thread::scope(|s| {
        for c in &children {
            s.spawn(move || fetch_all(c, 0..1000));
        }
    });
    assert_eq!(origin.requests(), 1000 + owned_by_first);
}

#[test]
fn tiers_that_name_each_other_do_not_loop() {
    let origin = Origin::start();
    // A's parent is B and B's is A: without the mark a miss would go
    // round. With it, A asks B, and B (asked by a tier) fills from the
    // origin.
    let (pa, pb) = (free_port(), free_port());
    let a_addr: SocketAddr = ([127, 0, 0, 1], pa).into();
    let b_addr: SocketAddr = ([127, 0, 0, 1], pb).into();
    let a = pier(&tier_config(origin.addr(), &[b_addr], Some(pa)));
    let b = pier(&tier_config(origin.addr(), &[a_addr], Some(pb)));
    fetch_all(&a, 0..20);
    assert_eq!(origin.requests(), 20);
    assert_eq!(stored_reaches(&b, 20.0), 20.0, "A asked B for each");
    // B's own misses go to A, which fills them from the origin.
    fetch_all(&b, 100..110);
    assert_eq!(origin.requests(), 30);
    // (B stores its own clients' objects too.)
    assert_eq!(
        (stored_reaches(&a, 30.0), stored_reaches(&b, 30.0)),
        (30.0, 30.0)
    );

    // The origin never sees the mark, and a client that sends it makes
    // only its own miss skip the parents.
    let mut c = RawConn::connect(a.listener("main"));
    let r = c
        .request(
            "GET",
            "/echo",
            &[("host", "tier.test"), ("pier-tier", "1")],
            b"",
        )
        .unwrap();
    assert_eq!(r.status, 200);
    assert!(
        !r.body_str().to_ascii_lowercase().contains("pier-tier"),
        "{}",
        r.body_str()
    );
    let r = c
        .request(
            "GET",
            "/cache/600?o=marked",
            &[("host", "tier.test"), ("pier-tier", "1")],
            b"",
        )
        .unwrap();
    assert_eq!(r.status, 200);
    // A marked miss is stored on A and never reaches B: B's count stays
    // (a check that can only fail if B was asked).
    assert_eq!(stored_reaches(&a, 31.0), 31.0);
    assert!(
        !wait_until(Duration::from_secs(2), || stored(&b) > 30.0),
        "B was not asked"
    );
    assert_eq!(origin.requests(), 32);
}

#[test]
fn a_dead_parent_falls_back_to_the_origin() {
    let origin = Origin::start();
    let p = tier(origin.addr(), &[dead_addr()]);
    let mut c = RawConn::connect(p.listener("main"));
    for n in 0..3 {
        let r = c
            .request(
                "GET",
                &format!("/cache/600?o={n}"),
                &[("host", "tier.test")],
                b"",
            )
            .unwrap();
        assert_eq!(r.status, 200);
    }
    assert_eq!(origin.requests(), 3);
}
