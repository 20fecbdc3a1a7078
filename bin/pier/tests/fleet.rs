//! A fleet of Piers (issue 37): three processes sharing a real redis-server
//! the test starts. A purge on one node's admin API reaches the others
//! through Redis pub/sub and is acknowledged by count; Redis gone: the
//! purge is still made locally and the API says the fleet was not told;
//! Redis back: the nodes subscribe again. A global rate limit sent to all
//! three at once admits about its rate for the fleet, fails open or
//! closed as configured while Redis is gone, and recovers with it.

mod common;

use std::time::Duration;

use common::*;

const TOKEN: &str = "fleet-token-0123";

fn node(origin: std::net::SocketAddr, redis: std::net::SocketAddr) -> PierProcess {
    node_with(origin, redis, "")
}

fn node_with(
    origin: std::net::SocketAddr,
    redis: std::net::SocketAddr,
    extra: &str,
) -> PierProcess {
    node_redis(
        origin,
        &format!("url = \"redis://{redis}\"\ntimeout = \"500ms\""),
        extra,
    )
}

/// A node whose `[redis]` table holds `redis` (its keys).
fn node_redis(origin: std::net::SocketAddr, redis: &str, extra: &str) -> PierProcess {
    pier(&format!(
        r#"[server]
workers = 1

[admin]
listen = "127.0.0.1:0"
token = "{TOKEN}"

[log]
access = "off"

[redis]
{redis}

[cache.main]
memory = "8m"

[[listener]]
name = "main"
listen = "127.0.0.1:0"
{extra}
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

    // A ban (a regular expression over keys) from node 2 takes the keys it
    // matches everywhere, and only those.
    let ban_paths = ["/cache/602", "/cache/603"];
    for n in &nodes {
        for p in ban_paths {
            cache_status(n, p);
            assert!(is_hit(n, p));
        }
    }
    let answer = purge(&nodes[1], "?ban=%5Ehttp://fleet%5C.test/cache/602");
    assert_eq!(
        (answer["purged"].as_u64(), answer["nodes"].as_u64()),
        (Some(1), Some(3)),
        "{answer}"
    );
    for n in [&nodes[0], &nodes[2]] {
        assert!(wait_until(Duration::from_secs(10), || !is_hit(
            n,
            ban_paths[0]
        )));
        assert!(is_hit(n, ban_paths[1]), "not matched, kept");
    }
    // A ban that does not compile is refused before anything is purged.
    let auth = format!("Bearer {TOKEN}");
    let r = RawConn::connect(nodes[0].admin())
        .request(
            "POST",
            "/api/cache/purge?ban=%28",
            &[("host", "127.0.0.1"), ("authorization", &auth)],
            b"",
        )
        .unwrap();
    assert_eq!(r.status, 400, "{}", r.body_str());

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
    // Dropped (killed) at the end, as the first.
    let _redis = redis_server_on(port);
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

/// A GET with one header: the status, or 0 when the connection failed.
fn status_with(p: &PierProcess, header: (&str, &str)) -> u16 {
    let Ok(mut c) = RawConn::try_connect(p.listener("main")) else {
        return 0;
    };
    c.request("GET", "/hello", &[("host", "fleet.test"), header], b"")
        .map(|r| r.status)
        .unwrap_or(0)
}

const GLOBAL_LIMITS: &str = r#"
[[limit]]
name = "closed"
key = "header:x-closed"
rate = "20/s"
scope = "global"
fail = "closed"

[[limit]]
name = "open"
key = "header:x-open"
rate = "20/s"
scope = "global"
"#;

#[test]
fn a_global_rate_limit_holds_across_three_nodes() {
    let redis = redis_server();
    let origin = Origin::start();
    let nodes: Vec<PierProcess> = (0..3)
        .map(|_| node_with(origin.addr(), redis.addr, GLOBAL_LIMITS))
        .collect();
    let fleet_of =
        |p: &PierProcess, l: &str| metric(p, &format!("pier_limit_global_nodes{{limit=\"{l}\"}}"));
    assert!(
        wait_until(Duration::from_secs(20), || nodes.iter().all(|n| fleet_of(
            n, "closed"
        ) == Some(
            3.0
        ) && fleet_of(n, "open")
            == Some(3.0))),
        "each node learns the fleet's size from its heartbeat"
    );

    // 20/s for the fleet: three clients, one per node, each offering about
    // 100 requests a second for 3 seconds (15 times the rate).
    let started = std::time::Instant::now();
    let admitted: u64 = std::thread::scope(|s| {
        let hs: Vec<_> = nodes
            .iter()
            .map(|n| {
                s.spawn(move || {
                    let mut ok = 0u64;
                    let t0 = std::time::Instant::now();
                    for _ in 0..1000 {
                        if t0.elapsed() >= Duration::from_secs(3) {
                            break;
                        }
                        match status_with(n, ("x-closed", "client-1")) {
                            200 => ok += 1,
                            429 => {}
                            other => panic!("status {other}"),
                        }
                        std::thread::sleep(Duration::from_millis(10));
                    }
                    ok
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).sum()
    });
    let secs = started.elapsed().as_secs_f64();
    eprintln!("global limit: {admitted} admitted in {secs:.2}s at 20/s over 3 nodes");
    // A sliding window admits about rate x seconds, plus up to one more
    // interval's worth where the run starts in a fresh window (3 s can
    // touch 4 windows); three nodes counting alone would admit three
    // times that.
    let most = 20.0 * (secs + 1.0);
    assert!(
        (admitted as f64) >= 0.5 * 20.0 * secs && (admitted as f64) <= 1.3 * most,
        "admitted {admitted} in {secs:.1}s, expected at most about {most:.0} (alone: {:.0})",
        3.0 * most
    );

    // Redis gone: once the last totals are older than two exchanges and
    // a timeout, "closed" refuses and "open" admits on each node's own
    // count; both counted.
    let port = redis.addr.port();
    drop(redis);
    let unavailable = |p: &PierProcess, l: &str| {
        metric(
            p,
            &format!("pier_limit_global_unavailable_total{{limit=\"{l}\"}}"),
        )
        .unwrap_or(0.0)
    };
    for (i, n) in nodes.iter().enumerate() {
        assert!(
            wait_until(Duration::from_secs(20), || {
                status_with(n, ("x-closed", &format!("cut-{i}"))) == 429
                    && unavailable(n, "closed") >= 1.0
            }),
            "fail closed"
        );
        // A key never seen: refused all the same.
        assert_eq!(status_with(n, ("x-closed", &format!("new-{i}"))), 429);
        assert_eq!(
            status_with(n, ("x-open", &format!("new-{i}"))),
            200,
            "fail open"
        );
        assert!(unavailable(n, "open") >= 1.0);
    }
    assert!(
        metric(
            &nodes[0],
            "pier_limit_global_syncs_total{limit=\"closed\",result=\"error\"}"
        ) >= Some(1.0)
    );

    // Redis back on its port: the limits decide on the fleet's count again.
    let _redis = redis_server_on(port);
    assert!(
        wait_until(Duration::from_secs(30), || status_with(
            &nodes[0],
            ("x-closed", "client-4")
        ) == 200),
        "recovers when Redis returns"
    );
    let before = unavailable(&nodes[0], "closed");
    assert_eq!(status_with(&nodes[0], ("x-closed", "client-5")), 200);
    assert_eq!(unavailable(&nodes[0], "closed"), before);
}

/// `redis-cli -p PORT ARGS...`: its output, trimmed.
fn redis_cli(port: u16, args: &[&str]) -> String {
    let out = std::process::Command::new(server_bin("redis-cli"))
        .args(["-h", "127.0.0.1", "-p", &port.to_string()])
        .args(args)
        .output()
        .unwrap();
    String::from_utf8_lossy(&out.stdout).trim().to_string()
}

#[test]
fn nodes_follow_the_primary_redis_sentinel_names() {
    let primary = redis_server();
    let primary_port = primary.addr.port().to_string();
    let replica = redis_server_with(&["--replicaof", "127.0.0.1", &primary_port]);
    let dir = std::env::temp_dir().join(format!("pier-sentinel-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let conf = dir.join("sentinel.conf");
    let sentinel = Server::start(&server_bin("redis-server"), |port| {
        // Sentinel rewrites its file: written anew for each attempt.
        std::fs::write(
            &conf,
            format!(
                "port {port}\nbind 127.0.0.1\ndir {}\nsentinel monitor fleet 127.0.0.1 {} 1\nsentinel down-after-milliseconds fleet 1000\nsentinel failover-timeout fleet 10000\n",
                dir.display(),
                primary.addr.port()
            ),
        )
        .unwrap();
        vec![conf.display().to_string(), "--sentinel".into()]
    });
    let sport = sentinel.addr.port();
    let origin = Origin::start();
    let redis = format!(
        "sentinels = [\"{}\"]\nmaster_name = \"fleet\"\ntimeout = \"500ms\"",
        sentinel.addr
    );
    let nodes: Vec<PierProcess> = (0..2)
        .map(|_| node_redis(origin.addr(), &redis, ""))
        .collect();
    assert!(
        wait_until(Duration::from_secs(20), || nodes.iter().all(subscribed)),
        "every node finds the primary through the sentinel"
    );
    let path = "/cache/610";
    let purged_everywhere = |from: &PierProcess| {
        for n in &nodes {
            cache_status(n, path);
            assert!(is_hit(n, path));
        }
        let answer = purge(from, "?url=http://fleet.test/cache/610");
        let other = if std::ptr::eq(from, &nodes[0]) {
            &nodes[1]
        } else {
            &nodes[0]
        };
        answer["nodes"] == 2 && wait_until(Duration::from_secs(10), || !is_hit(other, path))
    };
    assert!(purged_everywhere(&nodes[0]));

    // The primary dies; the sentinel promotes the replica (once it knows
    // it), and the nodes' new connections go where the sentinel says.
    assert!(
        wait_until(Duration::from_secs(30), || redis_cli(
            sport,
            &["SENTINEL", "replicas", "fleet"]
        )
        .contains(&replica.addr.port().to_string())),
        "the sentinel learns of the replica"
    );
    drop(primary);
    let promoted = replica.addr.port().to_string();
    assert!(
        wait_until(Duration::from_secs(60), || redis_cli(
            sport,
            &["SENTINEL", "get-master-addr-by-name", "fleet"]
        )
        .contains(&promoted)),
        "failover"
    );
    assert!(
        wait_until(Duration::from_secs(30), || nodes.iter().all(subscribed)
            && purged_everywhere(&nodes[1])),
        "the nodes follow the new primary"
    );
    drop(replica);
    let _ = std::fs::remove_dir_all(&dir);
}

/// A route whose Lua purges what the request's `?kind=K&v=V` says, and
/// answers the count or the reason.
const LUA_PURGE: &str = r#"
[[route]]
name = "purge"
host = "purge.test"
upstream = "app"
[route.lua]
content = '''
local args = pier.req.get_uri_args()
local n, err = pier.cache.purge(args.kind, args.v)
pier.say(n and ("purged " .. n) or ("refused " .. err))
'''
"#;

#[test]
fn a_purge_from_lua_reaches_every_node() {
    let redis = redis_server();
    let origin = Origin::start();
    let nodes: Vec<PierProcess> = (0..2)
        .map(|_| node_with(origin.addr(), redis.addr, LUA_PURGE))
        .collect();
    assert!(wait_until(Duration::from_secs(20), || nodes
        .iter()
        .all(subscribed)));
    let paths = ["/cache/620", "/cache/621"];
    for n in &nodes {
        for p in paths {
            cache_status(n, p);
            assert!(is_hit(n, p));
        }
    }
    let lua = |n: &PierProcess, q: &str| {
        let r = RawConn::connect(n.listener("main"))
            .request("GET", &format!("/?{q}"), &[("host", "purge.test")], b"")
            .unwrap();
        assert_eq!(r.status, 200, "{}", r.body_str());
        r.body_str().trim().to_string()
    };
    assert_eq!(
        lua(&nodes[0], "kind=url&v=http://fleet.test/cache/620"),
        "purged 1"
    );
    assert!(!is_hit(&nodes[0], paths[0]));
    assert!(
        wait_until(Duration::from_secs(10), || !is_hit(&nodes[1], paths[0])),
        "the other node purged it too"
    );
    assert!(is_hit(&nodes[1], paths[1]));
    // Refusals are answers, not errors: a ban that does not compile, an
    // unknown kind (a Lua error: 500).
    assert!(lua(&nodes[0], "kind=ban&v=(").starts_with("refused ban:"));
    let r = RawConn::connect(nodes[0].listener("main"))
        .request(
            "GET",
            "/?kind=everything&v=x",
            &[("host", "purge.test")],
            b"",
        )
        .unwrap();
    assert_eq!(r.status, 500);
    assert_eq!(
        metric(&nodes[0], "pier_fleet_purges_total{result=\"published\"}"),
        Some(1.0)
    );
}
