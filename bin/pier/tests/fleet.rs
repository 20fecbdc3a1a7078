//! A fleet of Piers (issue 37): three processes sharing a real redis-server
//! the test starts. A purge on one node's admin API reaches the others
//! through Redis pub/sub and is acknowledged by count; Redis gone: the
//! purge is still made locally and the API says the fleet was not told;
//! Redis back: the nodes subscribe again.

mod common;

use std::time::Duration;

use common::*;

const TOKEN: &str = "fleet-token-0123";

fn node(origin: std::net::SocketAddr, redis: std::net::SocketAddr) -> PierProcess {
    pier(&format!(
        r#"[server]
workers = 1

[admin]
listen = "127.0.0.1:0"
token = "{TOKEN}"

[log]
access = "off"

[redis]
url = "redis://{redis}"
timeout = "500ms"

[cache.main]
memory = "8m"

[[listener]]
name = "main"
listen = "127.0.0.1:0"

[[route]]
name = "site"
upstream = "app"
[route.cache]
zone = "main"

[upstream.app]
servers = ["{origin}"]
"#
    ))
}

fn cache_status(p: &PierProcess, path: &str) -> String {
    let mut c = RawConn::connect(p.listener("main"));
    let r = c
        .request("GET", path, &[("host", "fleet.test")], b"")
        .unwrap();
    assert_eq!(r.status, 200);
    r.header("cache-status").unwrap_or("").to_string()
}

fn is_hit(p: &PierProcess, path: &str) -> bool {
    cache_status(p, path).contains("hit")
}

/// POST a purge to `p`'s admin API: the JSON answer.
fn purge(p: &PierProcess, query: &str) -> serde_json::Value {
    let auth = format!("Bearer {TOKEN}");
    let r = RawConn::connect(p.admin())
        .request(
            "POST",
            &format!("/api/cache/purge{query}"),
            &[("host", "127.0.0.1"), ("authorization", &auth)],
            b"",
        )
        .unwrap();
    assert_eq!(r.status, 200, "{}", r.body_str());
    serde_json::from_slice(&r.body).unwrap()
}

/// `/metrics` (the admin endpoint wants the token here) and one series'
/// value in it, by its exact name and labels.
fn metrics(p: &PierProcess) -> String {
    let auth = format!("Bearer {TOKEN}");
    let r = RawConn::connect(p.admin())
        .request(
            "GET",
            "/metrics",
            &[("host", "127.0.0.1"), ("authorization", &auth)],
            b"",
        )
        .unwrap();
    assert_eq!(r.status, 200);
    r.body_str()
}

fn metric(p: &PierProcess, series: &str) -> Option<f64> {
    metrics(p)
        .lines()
        .find_map(|l| l.strip_prefix(series)?.strip_prefix(' ')?.parse().ok())
}

fn subscribed(p: &PierProcess) -> bool {
    metric(p, "pier_fleet_redis_connected") == Some(1.0)
}

#[test]
fn a_purge_on_one_node_reaches_every_node() {
    let redis = redis_server();
    let origin = Origin::start();
    let nodes: Vec<PierProcess> = (0..3).map(|_| node(origin.addr(), redis.addr)).collect();
    assert!(
        wait_until(Duration::from_secs(20), || nodes.iter().all(subscribed)),
        "every node subscribes"
    );
    let paths = ["/cache/600", "/cache/601"];
    for n in &nodes {
        for p in paths {
            cache_status(n, p);
            assert!(is_hit(n, p), "{p} cached on each node");
        }
    }
    // A purge by URL on node 1: applied there, acknowledged by the three
    // subscriptions (node 1's own included), applied by nodes 2 and 3.
    let answer = purge(&nodes[0], "?url=http://fleet.test/cache/600");
    assert_eq!(answer["purged"], 1, "{answer}");
    assert_eq!(answer["nodes"], 3, "{answer}");
    assert!(!is_hit(&nodes[0], paths[0]));
    for n in &nodes[1..] {
        assert!(
            wait_until(Duration::from_secs(10), || metric(
                n,
                "pier_fleet_purged_objects_total"
            ) == Some(1.0)),
            "{}",
            metrics(n)
        );
        assert!(!is_hit(n, paths[0]), "purged on every node");
        assert!(is_hit(n, paths[1]), "the other object stays");
    }
    assert_eq!(
        metric(&nodes[0], "pier_fleet_purged_objects_total"),
        Some(0.0),
        "a node does not apply its own message twice"
    );
    // A prefix purge from node 3 takes /cache/ everywhere.
    let answer = purge(&nodes[2], "?prefix=http://fleet.test/cache/");
    assert_eq!(answer["nodes"], 3, "{answer}");
    for n in &nodes[..2] {
        assert!(wait_until(Duration::from_secs(10), || !is_hit(n, paths[1])));
    }

    // Redis gone: the purge is made here and the answer says the fleet
    // was not told; nothing else changes for clients.
    let port = redis.addr.port();
    drop(redis);
    cache_status(&nodes[0], paths[1]);
    assert!(is_hit(&nodes[0], paths[1]));
    let answer = purge(&nodes[0], "?url=http://fleet.test/cache/601");
    assert_eq!(answer["purged"], 1, "{answer}");
    assert!(answer["fleet_error"].is_string(), "{answer}");
    assert!(answer.get("nodes").is_none(), "{answer}");
    assert!(
        metric(
            &nodes[0],
            "pier_fleet_purges_total{result=\"publish_failed\"}"
        ) >= Some(1.0)
    );
    assert!(wait_until(Duration::from_secs(10), || nodes
        .iter()
        .all(|n| !subscribed(n))));
    cache_status(&nodes[1], "/hello");

    // Redis back on its port: every node subscribes again, and purges
    // travel again.
    let child = std::process::Command::new(server_bin("redis-server"))
        .args(["--port", &port.to_string(), "--bind", "127.0.0.1"])
        .args(["--save", "", "--appendonly", "no"])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let addr: std::net::SocketAddr = ([127, 0, 0, 1], port).into();
    // Dropped (killed) at the end, as the first.
    let _redis = Server { child, addr };
    assert!(wait_until(Duration::from_secs(10), || {
        std::net::TcpStream::connect(addr).is_ok()
    }));
    assert!(
        wait_until(Duration::from_secs(30), || nodes.iter().all(subscribed)),
        "resubscribed"
    );
    for n in &nodes {
        cache_status(n, paths[0]);
        assert!(is_hit(n, paths[0]));
    }
    let answer = purge(&nodes[1], "?url=http://fleet.test/cache/600");
    assert_eq!(answer["nodes"], 3, "{answer}");
    for n in [&nodes[0], &nodes[2]] {
        assert!(wait_until(Duration::from_secs(10), || !is_hit(n, paths[0])));
    }
}
