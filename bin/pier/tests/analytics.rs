//! Built-in analytics end to end (issue 12): real requests from many source
//! addresses in 127.0.0.0/8 through Pier, read back from the admin API and
//! the dashboard; history kept across a restart; the admin credentials.

mod common;

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::time::{Duration, Instant};

use common::*;
use pier_test_support::browser::Browser;

/// Distinct client addresses the requests come from.
const CLIENTS: u32 = 40;

fn analytics_config(origin: SocketAddr, db: &std::path::Path, admin_extra: &str) -> String {
    format!(
        r#"[server]
workers = 2
grace_period = "5s"

[admin]
listen = "127.0.0.1:0"
{admin_extra}

[analytics]
path = "{}"

[log]
access = "off"

[[listener]]
name = "main"
listen = "127.0.0.1:0"

[[route]]
name = "api"
path = "/api/"
upstream = "app"

[[route]]
name = "web"
upstream = "app"

[upstream.app]
servers = ["{origin}"]
"#,
        db.display()
    )
}

/// An origin, a temporary directory for the store, and Pier in front with
/// `admin_extra` under `[admin]` (the first two live as long as the test).
fn start(admin_extra: &str) -> (Origin, TempDir, PierProcess) {
    let origin = Origin::start();
    let dir = TempDir::new();
    let p = pier(&analytics_config(
        origin.addr(),
        &dir.path().join("a.db"),
        admin_extra,
    ));
    (origin, dir, p)
}

/// Wall-clock Unix seconds.
fn now_s() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs()
}

/// An admin request with optional extra headers; the raw response.
fn admin_get(p: &PierProcess, path: &str, headers: &[(&str, &str)]) -> Response {
    let mut c = RawConn::connect(p.admin());
    let host = p.admin().to_string();
    let mut h = vec![("host", host.as_str())];
    h.extend_from_slice(headers);
    c.request("GET", path, &h, b"")
        .unwrap_or_else(|e| panic!("admin GET {path}: {e}"))
}

fn json(r: &Response) -> serde_json::Value {
    serde_json::from_slice(&r.body).unwrap_or_else(|e| panic!("{e}: {}", r.body_str()))
}

/// What the test sent: per host, requests and the bytes Pier answered with.
#[derive(Default)]
struct Sent {
    requests: u64,
    not_found: u64,
    clients: std::collections::BTreeSet<IpAddr>,
}

/// `n` requests spread over CLIENTS source addresses, two hosts, a few
/// paths (one in five a 404).
fn send_traffic(p: &PierProcess, n: u32, sent: &mut Sent) {
    let addr = p.listener("main");
    for i in 0..n {
        let src = IpAddr::V4(Ipv4Addr::new(
            127,
            0,
            1 + (i % CLIENTS / 250) as u8,
            1 + (i % CLIENTS % 250) as u8,
        ));
        let mut c = RawConn::try_connect_from(src, addr)
            .unwrap_or_else(|e| panic!("connect from {src}: {e}"));
        let host = if i % 3 == 0 { "b.example" } else { "a.example" };
        let path = match i % 5 {
            0 => "/status/404",
            1 => "/api/hello",
            _ => "/hello",
        };
        let r = c
            .request(
                "GET",
                path,
                &[("host", host), ("user-agent", "analytics-test/1")],
                b"",
            )
            .unwrap_or_else(|e| panic!("GET {path}: {e}"));
        if path == "/status/404" {
            assert_eq!(r.status, 404);
            sent.not_found += 1;
        } else {
            assert_eq!(r.status, 200, "{}", r.body_str());
        }
        sent.requests += 1;
        sent.clients.insert(src);
    }
}

/// Polls the API over the last hour until it counts `want` requests (the
/// workers hand events over once a second).
fn wait_requests(p: &PierProcess, want: u64, headers: &[(&str, &str)]) -> serde_json::Value {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let r = admin_get(p, "/api/analytics?top=10", headers);
        assert_eq!(r.status, 200, "{}", r.body_str());
        let v = json(&r);
        let got = v["total"]["requests"].as_u64().unwrap_or(0);
        if got == want {
            return v;
        }
        assert!(
            got < want,
            "analytics counts {got} requests, {want} were sent: {v}"
        );
        assert!(
            Instant::now() < deadline,
            "analytics counts {got} of {want} requests after 20 s: {v}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

fn top(v: &serde_json::Value, list: &str, key: &str) -> Option<u64> {
    v[list]
        .as_array()?
        .iter()
        .find(|e| e[0] == key)
        .and_then(|e| e[1].as_u64())
}

#[test]
fn counts_are_exact_and_history_survives_a_restart() {
    let origin = Origin::start();
    let dir = TempDir::new();
    let db = dir.path().join("analytics.db");
    let cfg = analytics_config(origin.addr(), &db, "");
    let mut p = pier(&cfg);
    let mut sent = Sent::default();
    send_traffic(&p, 150, &mut sent);

    let v = wait_requests(&p, sent.requests, &[]);
    let total = &v["total"];
    // Every request is counted once, with its status class.
    assert_eq!(total["status"][3].as_u64(), Some(sent.not_found), "{v}");
    assert_eq!(
        total["status"][1].as_u64(),
        Some(sent.requests - sent.not_found),
        "{v}"
    );
    // Bytes: what Pier's own metrics say it sent, exactly.
    let unique = total["unique_clients"].as_u64().unwrap();
    assert_eq!(
        unique,
        sent.clients.len() as u64,
        "HyperLogLog is exact at this size (sparse)"
    );
    // Hosts are lower-cased without port; routes by name; the 404s are a path.
    assert_eq!(top(&v, "top_hosts", "b.example"), Some(50), "{v}");
    assert_eq!(top(&v, "top_hosts", "a.example"), Some(100), "{v}");
    assert_eq!(top(&v, "top_routes", "api"), Some(30), "{v}");
    assert_eq!(top(&v, "top_paths", "/status/404"), Some(30), "{v}");
    assert_eq!(top(&v, "top_agents", "analytics-test/1"), Some(150), "{v}");
    assert!(total["p99_us"].as_u64().unwrap() > 0, "{v}");
    assert!(total["bytes_in"].as_u64().unwrap() > 150 * 30, "{v}");
    let bytes_out = total["bytes_out"].as_u64().unwrap();
    assert!(bytes_out > 150 * 12, "{v}");
    // A host filter.
    let r = admin_get(&p, "/api/analytics?host=b.example", &[]);
    assert_eq!(json(&r)["total"]["requests"].as_u64(), Some(50));
    // Pier's metrics agree.
    assert_eq!(p.metric_value("pier_analytics_events_total"), Some(150.0));
    assert_eq!(
        p.metric_value("pier_analytics_events_dropped_total"),
        Some(0.0)
    );

    // SIGTERM writes the open minutes; a new process on the same file has them.
    p.signal(libc::SIGTERM);
    assert!(
        p.wait_exit(Duration::from_secs(15)).is_some(),
        "pier did not exit"
    );
    let p2 = pier(&cfg);
    let r = admin_get(&p2, "/api/analytics", &[]);
    let v2 = json(&r);
    assert_eq!(
        v2["total"]["requests"].as_u64(),
        Some(150),
        "after restart: {v2}"
    );
    assert_eq!(v2["total"]["bytes_out"].as_u64(), Some(bytes_out), "{v2}");
    assert_eq!(v2["total"]["unique_clients"].as_u64(), Some(unique), "{v2}");
    // Hours and days hold the same totals as the minutes (written with them).
    for step in ["hour", "day"] {
        let now = now_s();
        let r = admin_get(
            &p2,
            &format!(
                "/api/analytics?step={step}&from={}&to={}",
                now - 2 * 86_400,
                now + 86_400
            ),
            &[],
        );
        let v = json(&r);
        assert_eq!(v["total"]["requests"].as_u64(), Some(150), "{step}: {v}");
        assert_eq!(
            v["total"]["unique_clients"].as_u64(),
            Some(unique),
            "{step}: {v}"
        );
    }
    // More traffic adds to the history.
    send_traffic(&p2, 30, &mut sent);
    wait_requests(&p2, 180, &[]);
}

#[test]
fn bad_parameters_get_400_with_a_reason() {
    let (_origin, _dir, p) = start("");
    for q in [
        "from=abc",
        "from=100&to=50",
        "step=week",
        "top=9999",
        "from=0&to=99999999&step=minute",
        "from=2025-13-01T00:00:00Z",
    ] {
        let r = admin_get(&p, &format!("/api/analytics?{q}"), &[]);
        assert_eq!(r.status, 400, "{q}: {}", r.body_str());
        assert!(json(&r)["error"].is_string(), "{q}");
    }
    let r = admin_get(
        &p,
        "/api/analytics?from=2025-11-25T10:00:00Z&to=2025-11-25T11:00:00%2B01:00&step=minute",
        &[],
    );
    assert_eq!(r.status, 400, "to == from: {}", r.body_str());
    let r = admin_get(
        &p,
        "/api/analytics?from=2025-11-25T10:00:00Z&to=2025-11-25T12:00:00%2B01:00",
        &[],
    );
    assert_eq!(r.status, 200, "{}", r.body_str());
    let v = json(&r);
    assert_eq!(
        (v["from"].as_i64(), v["to"].as_i64()),
        (Some(1_764_064_800), Some(1_764_068_400))
    );
}

#[test]
fn admin_credentials_are_required_but_not_for_healthz() {
    let (_origin, _dir, p) = start("token = \"tok-0123456789\"\nuser = \"ops\"\npassword = \"pw\"");
    assert_eq!(admin_get(&p, "/healthz", &[]).status, 200);
    // The dashboard page holds no data (its requests carry the credentials).
    assert_eq!(admin_get(&p, "/dashboard", &[]).status, 200);
    for path in ["/metrics", "/api/analytics", "/api/status"] {
        let r = admin_get(&p, path, &[]);
        assert_eq!(r.status, 401, "{path}");
        assert_eq!(
            r.header("www-authenticate"),
            Some("Basic realm=\"pier admin\"")
        );
        assert_eq!(
            admin_get(&p, path, &[("authorization", "Bearer tok-0123456788")]).status,
            401,
            "{path} with a wrong token"
        );
        assert_eq!(
            admin_get(&p, path, &[("authorization", "Bearer tok-0123456789")]).status,
            200,
            "{path} with the token"
        );
        // ops:pw
        assert_eq!(
            admin_get(&p, path, &[("authorization", "Basic b3BzOnB3")]).status,
            200,
            "{path} with basic"
        );
        assert_eq!(
            admin_get(&p, path, &[("authorization", "Basic b3BzOnB4")]).status,
            401,
            "{path} with a wrong password"
        );
    }
    // Issue 31: never from a query string or a cookie, which a link or a
    // form on another site could make a browser send.
    let r = admin_get(&p, "/dashboard?token=tok-0123456789", &[]);
    assert_eq!(r.header("set-cookie"), None);
    assert_eq!(
        admin_get(&p, "/api/analytics?token=tok-0123456789", &[]).status,
        401
    );
    assert_eq!(
        admin_get(
            &p,
            "/api/analytics",
            &[("cookie", "pier_admin_token=tok-0123456789")]
        )
        .status,
        401
    );
}

/// The live stream: a history event at once, then one `second` event a second.
#[test]
fn live_stream_sends_history_then_seconds() {
    let (_origin, _dir, p) = start("");
    let mut sent = Sent::default();
    send_traffic(&p, 20, &mut sent);
    wait_requests(&p, 20, &[]);
    let mut c = RawConn::connect(p.admin());
    c.send(b"GET /api/analytics/live HTTP/1.1\r\nhost: 127.0.0.1\r\n\r\n");
    c.set_timeout(Duration::from_secs(10));
    let mut got = String::new();
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut buf = [0u8; 8192];
    use std::io::Read;
    let mut s = c.stream();
    // Requests counted by the history and the seconds after it: the history
    // ends two seconds back, so the last requests may come in `second` events.
    let counted = |got: &str| -> u64 {
        got.split("\ndata: ")
            .skip(1)
            .filter_map(|rest| rest.split("\n\n").next())
            .filter_map(|d| serde_json::from_str::<serde_json::Value>(d).ok())
            .filter_map(|v| v.as_array().cloned())
            .flatten()
            .map(|s| s["requests"].as_u64().unwrap_or(0))
            .sum()
    };
    while !(got.contains("event: history")
        && got.contains("event: second")
        && got.contains("event: status")
        && counted(&got) >= 20)
    {
        assert!(Instant::now() < deadline, "live stream so far: {got}");
        let n = s.read(&mut buf).expect("live stream read");
        assert!(n > 0, "live stream closed: {got}");
        got.push_str(&String::from_utf8_lossy(&buf[..n]));
    }
    assert!(got.starts_with("HTTP/1.1 200 OK\r\n"), "{got}");
    assert!(got.contains("Content-Type: text/event-stream"), "{got}");
    assert_eq!(counted(&got), 20, "{got}");
}

/// The page loads, shows for a fixed window the figures the API gives for
/// it, and updates live; a screenshot is kept in target/test-artifacts/.
#[test]
fn dashboard_shows_the_api_figures_and_updates_live() {
    let (_origin, _dir, p) = start("token = \"dash-token-123\"");
    let mut sent = Sent::default();
    send_traffic(&p, 60, &mut sent);
    let auth = [("authorization", "Bearer dash-token-123")];
    wait_requests(&p, 60, &auth);
    let now = now_s();
    let window = format!("from={}&to={}&step=minute", now - 1800, now + 60);
    let api = json(&admin_get(&p, &format!("/api/analytics?{window}"), &auth));
    // The token in the fragment, which never leaves the browser; the page
    // sends it in the Authorization header.
    let url = format!(
        "http://{}/dashboard?{window}#token=dash-token-123",
        p.admin()
    );

    let mut b = Browser::open(&url);
    b.wait_for(
        "document.body && document.body.dataset.loaded === '1'",
        "the window loaded",
    );
    let shown = b.eval(
        "JSON.stringify(['total-requests','unique-clients','total-bytes','errors'].map(id => document.getElementById(id).dataset.value).concat([document.getElementById('latency').dataset.p99]))",
    );
    let want = serde_json::json!([
        api["total"]["requests"].to_string(),
        api["total"]["unique_clients"].to_string(),
        api["total"]["bytes_out"].to_string(),
        api["total"]["status"][4].to_string(),
        api["total"]["p99_us"].to_string(),
    ])
    .to_string();
    assert_eq!(shown.as_str(), Some(want.as_str()), "page vs API: {api}");
    let tables = b.eval("document.getElementById('top-hosts').innerText + document.getElementById('top-paths').innerText");
    let tables = tables.as_str().unwrap_or("");
    assert!(
        tables.contains("a.example") && tables.contains("/status/404"),
        "top lists: {tables:?}"
    );
    // Live: `second` events arrive over the event stream, more traffic shows up.
    b.wait_for(
        "+document.getElementById('live-updates').dataset.n >= 2",
        "two live updates",
    );
    send_traffic(&p, 10, &mut sent);
    b.wait_for(
        "live.reduce((n, s) => n + s.requests, 0) >= 70",
        "the live seconds counting all 70 requests",
    );

    let shot = b.call(
        "Page.captureScreenshot",
        serde_json::json!({ "format": "png" }),
    );
    use base64::Engine as _;
    let png = base64::engine::general_purpose::STANDARD
        .decode(shot["data"].as_str().expect("screenshot data"))
        .expect("screenshot base64");
    assert!(
        png.starts_with(b"\x89PNG") && png.len() > 10_000,
        "{} bytes",
        png.len()
    );
    let dir = std::path::Path::new(env!("CARGO_TARGET_TMPDIR"))
        .join("..")
        .join("test-artifacts");
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("dashboard.png"), &png).unwrap();
}

/// `[analytics.kafka]` with no broker listening: requests are served as
/// ever, the embedded figures are exact, and the events Kafka cannot take
/// are dropped past the sink's queue and counted, never waited for.
#[test]
fn kafka_down_costs_requests_nothing() {
    let origin = Origin::start();
    let dir = TempDir::new();
    let dead = dead_addr();
    let cfg = analytics_config(origin.addr(), &dir.path().join("a.db"), "").replace(
        "[log]",
        &format!(
            "[analytics.kafka]\nbrokers = [\"{dead}\"]\nqueue = 50\nlinger = \"5ms\"\n\n[log]"
        ),
    );
    let p = pier(&cfg);
    let mut sent = Sent::default();
    let t = Instant::now();
    send_traffic(&p, 200, &mut sent);
    let took = t.elapsed();
    wait_requests(&p, 200, &[]);
    // The sink holds at most 50; the rest were dropped and counted.
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let dropped = p.metric_value("pier_analytics_kafka_events_total{result=\"dropped\"}");
        if dropped.is_some_and(|d| d >= 150.0) {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "kafka drops counted: {dropped:?}\n{}",
            p.metrics()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    assert_eq!(
        p.metric_value("pier_analytics_kafka_events_total{result=\"sent\"}"),
        Some(0.0)
    );
    eprintln!("200 requests with Kafka down took {took:?}");
}

/// Two admin requests in one write get two answers (the second was left
/// unread until more bytes came).
#[test]
fn admin_answers_pipelined_requests() {
    let (_origin, _dir, p) = start("");
    let mut c = RawConn::connect(p.admin());
    c.send(b"GET /healthz HTTP/1.1\r\nhost: x\r\n\r\nGET /api/status HTTP/1.1\r\nhost: localhost\r\n\r\n");
    let a = c.read_response().expect("first answer");
    assert_eq!((a.status, a.body_str().as_str()), (200, "ok\n"));
    let b = c.read_response().expect("second answer");
    assert_eq!(b.status, 200);
    assert!(json(&b)["upstreams"].is_array(), "{}", b.body_str());
}
