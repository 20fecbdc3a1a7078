//! The HTTP cache (issue 11, first part): hits, freshness, Age and
//! Cache-Status, HEAD from GET, conditional requests (304 from the cache,
//! synthetic Last-Modified), invalidation by unsafe methods, coalescing of
//! concurrent misses, objects too big to store, Vary.

mod common;

use std::net::SocketAddr;
use std::time::Duration;

use common::*;

const CACHE_TOP: &str = "[cache.main]\nmemory = \"16m\"\nmax_object = \"64k\"";

/// The catch-all route's cache table (a TTL of 60 s for 200s), then `extra`.
fn cache_route(extra: &str) -> String {
    format!("[route.cache]\nzone = \"main\"\nttl = {{ \"200\" = \"60s\" }}\n{extra}")
}

fn cache_config(origin: SocketAddr, route_extra: &str) -> String {
    route_config(&[origin], CACHE_TOP, &cache_route(route_extra), "")
}

/// A scenario behind the config of [`cache_config`].
fn cache_scenario(route_extra: &str) -> Scenario {
    scenario().top(CACHE_TOP).route(&cache_route(route_extra))
}

fn hits_age_head_and_cache_status_over(p: Proto) {
    let s = cache_scenario("").over(p).start();
    let mut c = s.conn();
    let first = c
        .get("/cache/60")
        .expect_status(200)
        .expect_header("cache-status", "pier; fwd=miss; stored");
    for _ in 0..5 {
        let r = c
            .get("/cache/60")
            .expect_body(&first.body)
            .expect_header_prefix("cache-status", "pier; hit; ttl=")
            .expect_header("etag", "\"v1\"");
        assert!(r.header("age").is_some(), "{r:?}");
    }
    // HEAD from the stored GET.
    c.request("HEAD", "/cache/60", &[], b"")
        .expect_status(200)
        .expect_header("content-length", "7")
        .expect_body("");
    assert_eq!(s.origin_requests(), 1);
    // No freshness of its own: the route's TTL for 200 applies.
    c.get("/hello");
    c.get("/hello")
        .expect_body("hello world\n")
        .expect_header_contains("cache-status", "hit");
    assert_eq!(s.origin_requests(), 2);
    // A client's no-cache goes to the origin (and refreshes the object).
    c.request("GET", "/cache/60", &[("Cache-Control", "no-cache")], b"")
        .expect_status(200);
    assert_eq!(s.origin_requests(), 3);
    assert!(s.metrics().contains("pier_cache_lookups_total"));
}

#[test]
fn hits_age_head_and_cache_status() {
    hits_age_head_and_cache_status_over(Proto::Http1)
}

#[test]
fn hits_age_head_and_cache_status_h3() {
    hits_age_head_and_cache_status_over(Proto::Http3)
}

/// The cache step's result reaches the access log (`"cache"`, nginx's
/// `$upstream_cache_status`) and the analytics events.
#[test]
fn cache_results_are_logged() {
    let o = Origin::start();
    let dir = TempDir::new();
    let log = dir.path().join("access.log");
    let cfg = cache_config(o.addr(), "").replace(
        "access = \"off\"",
        &format!("access = \"{}\"", log.display()),
    );
    let pier = pier(&cfg);
    let mut c = RawConn::connect(pier.listener("main"));
    for _ in 0..2 {
        assert_eq!(c.get("/cache/60").unwrap().status, 200);
    }
    assert_eq!(
        c.request("POST", "/cache/60", &[], b"x").unwrap().status,
        200
    );
    let want = ["MISS", "HIT", "PASS"];
    let mut lines = Vec::new();
    assert!(
        wait_until(Duration::from_secs(10), || {
            lines = std::fs::read_to_string(&log)
                .unwrap_or_default()
                .lines()
                .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
                .collect();
            lines.len() >= want.len()
        }),
        "{lines:?}"
    );
    // One connection, one worker: its records in order.
    let got: Vec<&str> = lines
        .iter()
        .map(|v| v["cache"].as_str().unwrap_or(""))
        .collect();
    assert_eq!(got, want, "{lines:?}");
}

fn a_head_miss_is_not_stored_as_the_get_over(p: Proto) {
    let s = cache_scenario("").over(p).start();
    let mut c = s.conn();
    c.request("HEAD", "/cache/60", &[], b"").expect_status(200);
    // The GET after it gets the whole body (from the origin, then stored).
    let r = c.get("/cache/60").expect_header("content-length", "7");
    assert_eq!(r.body.len(), 7, "{r:?}");
    c.get("/cache/60")
        .expect_body(&r.body)
        .expect_header_contains("cache-status", "hit");
    assert_eq!(s.origin_requests(), 2);
}

#[test]
fn a_head_miss_is_not_stored_as_the_get() {
    a_head_miss_is_not_stored_as_the_get_over(Proto::Http1)
}

#[test]
fn a_head_miss_is_not_stored_as_the_get_h3() {
    a_head_miss_is_not_stored_as_the_get_over(Proto::Http3)
}

fn conditional_requests_get_304_from_the_cache_over(p: Proto) {
    let s = cache_scenario("").over(p).start();
    let mut c = s.conn();
    c.get("/cache/60");
    c.request("GET", "/cache/60", &[("If-None-Match", "\"v1\"")], b"")
        .expect_status(304)
        .expect_body("");
    c.request("GET", "/cache/60", &[("If-None-Match", "\"other\"")], b"")
        .expect_status(200);
    // /hello has no validator: Pier stores a synthetic Last-Modified.
    c.get("/hello");
    let r = c.get("/hello");
    let lm = r.header("last-modified").expect("synthetic Last-Modified");
    c.request("GET", "/hello", &[("If-Modified-Since", lm)], b"")
        .expect_status(304);
    assert_eq!(s.origin_requests(), 2);
}

#[test]
fn conditional_requests_get_304_from_the_cache() {
    conditional_requests_get_304_from_the_cache_over(Proto::Http1)
}

#[test]
fn conditional_requests_get_304_from_the_cache_h3() {
    conditional_requests_get_304_from_the_cache_over(Proto::Http3)
}

fn unsafe_methods_invalidate_and_big_objects_stream_through_over(p: Proto) {
    let s = cache_scenario("").over(p).start();
    let mut c = s.conn();
    c.get("/cache/60");
    c.get("/cache/60");
    assert_eq!(s.origin_requests(), 1);
    c.request("POST", "/cache/60", &[], b"x").expect_status(200);
    c.get("/cache/60")
        .expect_header("cache-status", "pier; fwd=miss; stored");
    assert_eq!(s.origin_requests(), 3);
    // Larger than max_object (64k): relayed whole, never stored.
    for _ in 0..2 {
        c.get("/bytes/200000").expect_body(pattern(0, 200_000));
    }
    assert_eq!(s.origin_requests(), 5);
}

#[test]
fn unsafe_methods_invalidate_and_big_objects_stream_through() {
    unsafe_methods_invalidate_and_big_objects_stream_through_over(Proto::Http1)
}

#[test]
fn unsafe_methods_invalidate_and_big_objects_stream_through_h3() {
    unsafe_methods_invalidate_and_big_objects_stream_through_over(Proto::Http3)
}

#[test]
fn concurrent_misses_reach_the_origin_once() {
    let fill = Gate::new();
    let held = fill.clone();
    let s = cache_scenario("lock_timeout = \"20s\"")
        .origin(move |_| Reply::ok("slow\n").after(&held))
        .start();
    for (status, body) in all_at_once(&s, &fill, 50, "/slow") {
        assert_eq!((status, body.as_slice()), (200, &b"slow\n"[..]));
    }
    assert_eq!(s.origin_requests(), 1, "one fill for 50 concurrent misses");
    assert_eq!(
        s.metric_value("pier_cache_lookups_total{zone=\"main\",result=\"coalesced\"}"),
        Some(49.0),
        "every follower waited on the one fill: {}",
        s.metrics()
    );
}

/// `n` clients GET `path` at once; `gate` (which holds the origin's answer)
/// opens once all `n` are in flight in Pier, so each of them came while the
/// first was at the origin. Their statuses and bodies.
fn all_at_once(s: &Running, gate: &Gate, n: usize, path: &str) -> Vec<(u16, Vec<u8>)> {
    let addr = s.addr();
    let threads: Vec<_> = (0..n)
        .map(|_| {
            let path = path.to_string();
            std::thread::spawn(move || {
                let mut c = RawConn::connect(addr);
                c.set_timeout(Duration::from_secs(30));
                let r = c.get(&path).unwrap();
                (r.status, r.body)
            })
        })
        .collect();
    let mut active = None;
    let all_in = wait_until(Duration::from_secs(20), || {
        active = s.metric_value("pier_active_requests");
        active == Some(n as f64)
    });
    gate.open();
    assert!(all_in, "{active:?} requests in flight, wanted {n}");
    threads.into_iter().map(|t| t.join().unwrap()).collect()
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

/// A file of the suite's engine: at the top of the npm package (0.4.5),
/// under `test-engine/` in the repository since (the version `.ci/run`
/// installs, which has the RFC 9213 and RFC 9111 §5.1 tests).
fn suite_file(pkg: &std::path::Path, f: &str) -> String {
    if pkg.join("test-engine").join(f).exists() {
        format!("test-engine/{f}")
    } else {
        f.to_string()
    }
}

/// The `http-cache-tests` origin (`server/server.mjs`), on a free port;
/// killed when dropped.
struct SuiteOrigin {
    child: std::process::Child,
    port: u16,
}

impl SuiteOrigin {
    fn start(pkg: &std::path::Path, dir: &std::path::Path) -> SuiteOrigin {
        use std::io::BufRead;
        let mut child = std::process::Command::new("node")
            .arg(suite_file(pkg, "server/server.mjs"))
            .current_dir(pkg)
            // What `npm run server` would pass, with port 0: the kernel
            // picks a free one and the server prints it.
            .env("npm_config_protocol", "http")
            .env("npm_config_port", "0")
            .env("npm_config_pidfile", dir.join("server.pid"))
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::null())
            .spawn()
            .expect("node (apt-get install nodejs; .ci/run does)");
        let out = child.stdout.take().expect("stdout");
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in std::io::BufReader::new(out).lines().map_while(Result::ok) {
                // "Listening on http://[::]:PORT/"
                if let Some(p) = line
                    .strip_prefix("Listening on ")
                    .and_then(|u| u.trim_end_matches('/').rsplit(':').next())
                    .and_then(|p| p.parse::<u16>().ok())
                {
                    let _ = tx.send(p);
                }
            }
        });
        let port = match rx.recv_timeout(Duration::from_secs(30)) {
            Ok(p) => p,
            Err(_) => {
                let _ = child.kill();
                panic!("the http-cache-tests server did not say where it listens");
            }
        };
        SuiteOrigin { child, port }
    }
}

impl Drop for SuiteOrigin {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Required tests Pier does not pass on purpose (each with its reason; see
/// docs/cache.md "http-cache-tests"). None today: the eight required tests
/// it does not pass depend on tests of other kinds (cache-tests.fyi counts
/// them so), listed there.
const SUITE_DEVIATIONS: &[(&str, &str)] = &[];

/// The `http-cache-tests` suite (github.com/http-tests/cache-tests at the
/// commit `.ci/run` pins) against `pier proxy --cache`: every test it marks
/// required passes (or depends on one Pier does not support, as
/// cache-tests.fyi counts them), but for SUITE_DEVIATIONS, and at least as
/// many required and optimal tests pass as on this branch.
/// Responses with Set-Cookie are stored (`--cache-set-cookie store`, the
/// RFC's reading, which two required tests need); the default, `pass`, is
/// Varnish's and nginx's and is covered by `set_cookie_pass_and_store`.
/// `HTTP_CACHE_TESTS` is the suite's directory (`.ci/run` installs it).
#[test]
fn http_cache_tests_suite() {
    let pkg = std::path::PathBuf::from(std::env::var("HTTP_CACHE_TESTS").expect(
        "HTTP_CACHE_TESTS: the http-cache-tests npm package's directory (.ci/run installs it)",
    ));
    let summary = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/http-cache-tests/summary.mjs");
    let dir = TempDir::new();
    let origin = SuiteOrigin::start(&pkg, dir.path());
    let p = PierProcess::start_args(
        bin(),
        &[
            "proxy",
            "--listen",
            "127.0.0.1:0",
            "--to",
            &format!("127.0.0.1:{}", origin.port),
            "--cache",
            "256MiB",
            "--cache-set-cookie",
            "store",
        ],
    );
    let base = format!("http://{}", p.listener("main"));
    let out = run_with_timeout(
        std::process::Command::new("node")
            .args(["--no-warnings", &suite_file(&pkg, "cli.mjs")])
            .current_dir(&pkg)
            .env("npm_config_base", &base)
            // `npm run cli` sets this to "" (all tests).
            .env("npm_package_config_id", ""),
        Duration::from_secs(600),
    );
    let results = dir.path().join("results.json");
    std::fs::write(&results, &out.stdout).unwrap();
    assert!(
        out.stdout.starts_with(b"{"),
        "the suite printed no results: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let s = run_with_timeout(
        std::process::Command::new("node")
            .arg(&summary)
            .arg(&pkg)
            .arg(&results),
        Duration::from_secs(60),
    );
    let text = String::from_utf8_lossy(&s.stdout).to_string();
    let mut bad = Vec::new();
    let (mut passed, mut total, mut required, mut optimal) = (0, 0, 0, 0);
    for line in text.lines() {
        let f: Vec<&str> = line.splitn(3, '\t').collect();
        if f.len() < 3 {
            continue;
        }
        total += 1;
        if f[1] == "pass" || f[1] == "yes" {
            passed += 1;
        }
        match (f[0], f[1]) {
            ("required", "pass") => required += 1,
            ("optimal", "pass") => optimal += 1,
            ("required" | "optimal", _) => println!("{line}"),
            _ => {}
        }
        let id = f[2].split(' ').next().unwrap_or("");
        if f[0] == "required"
            && !matches!(f[1], "pass" | "dependency_fail")
            && !SUITE_DEVIATIONS.iter().any(|(d, _)| *d == id)
        {
            bad.push(f[2].to_string());
        }
    }
    let totals: Vec<&str> = text.lines().filter(|l| l.starts_with("TOTAL")).collect();
    println!("http-cache-tests against pier proxy --cache: {passed} of {total} pass");
    for t in &totals {
        println!("{t}");
    }
    assert!(
        total > 300,
        "too few results:\n{text}\n{}",
        String::from_utf8_lossy(&s.stderr)
    );
    // What this branch reaches (docs/cache.md); a change that loses a
    // test shows here. The npm package (0.4.5) has neither RFC 9213's
    // tests nor RFC 9111's reading of Age, and scores lower.
    if pkg.join("test-engine").exists() {
        assert!(
            required >= 152,
            "required tests passing: {required} (was 152)"
        );
        assert!(optimal >= 90, "optimal tests passing: {optimal} (was 90)");
    }
    assert!(
        bad.is_empty(),
        "required tests not passing:\n{}",
        bad.join("\n")
    );
}

/// `[route.cache] set_cookie`: `pass` (the default) does not store a
/// response carrying Set-Cookie (one client's cookie would reach every
/// client) unless it is `public`; `store` stores it, cookie included, as
/// RFC 9111 allows.
#[test]
fn set_cookie_pass_and_store() {
    let o = Script::start(|r: &Request| {
        let path = r.path.as_str();
        let n = r.n;
        let cc = if path == "/public" {
            "public, max-age=60"
        } else {
            "max-age=60"
        };
        let body = format!("n{n}");
        Reply::wire(
            format!(
                "HTTP/1.1 200 OK\r\nCache-Control: {cc}\r\nSet-Cookie: s={n}\r\nContent-Length: {}",
                body.len()
            ),
            vec![(Duration::ZERO, body.into_bytes())],
        )
    });
    let pass = pier(&cache_config(o.addr(), ""));
    let mut c = RawConn::connect(pass.listener("main"));
    for i in 1..=2 {
        let r = c.get("/private-cookie").unwrap();
        assert_eq!(r.header("set-cookie"), Some(format!("s={i}").as_str()));
        assert_eq!(r.body, format!("n{i}").as_bytes(), "not stored");
    }
    let first = c.get("/public").unwrap();
    let again = c.get("/public").unwrap();
    assert_eq!(again.body, first.body, "public: stored");
    assert_eq!(o.requests(), 3);
    drop(c);
    drop(pass);

    let store = pier(&cache_config(o.addr(), "set_cookie = \"store\""));
    let mut c = RawConn::connect(store.listener("main"));
    let first = c.get("/cookie").unwrap();
    let again = c.get("/cookie").unwrap();
    assert_eq!(again.body, first.body, "stored");
    assert_eq!(again.header("set-cookie"), first.header("set-cookie"));
    assert!(again.header("cache-status").unwrap().contains("hit"));
    assert_eq!(o.requests(), 4);
    o.stop();
}

/// An origin's hop-by-hop fields (the fixed ones and those its Connection
/// names) reach neither the client of the miss nor the stored object, so no
/// hit either; the end-to-end fields around them stay. They are removed
/// once, before the cache steps read the head.
#[test]
fn hop_by_hop_fields_are_neither_forwarded_nor_stored() {
    let o = Script::start(|_r: &Request| {
        Reply::wire(
            "HTTP/1.1 200 OK\r\nCache-Control: max-age=60\r\nConnection: keep-alive, X-Hop\r\n\
             X-Hop: secret\r\nKeep-Alive: timeout=5\r\nX-End: kept\r\nContent-Length: 2"
                .to_string(),
            vec![(Duration::ZERO, b"ok".to_vec())],
        )
    });
    let p = pier(&cache_config(o.addr(), ""));
    let mut c = RawConn::connect(p.listener("main"));
    for want in ["stored", "hit"] {
        let r = c.get("/hop").unwrap();
        assert!(r.header("cache-status").unwrap().contains(want), "{r:?}");
        assert_eq!(r.header("x-end"), Some("kept"), "{r:?}");
        assert_eq!(r.header("x-hop"), None, "{r:?}");
        assert_eq!(r.header("keep-alive"), None, "{r:?}");
        assert_eq!(r.body, b"ok");
    }
    assert_eq!(o.requests(), 1);
    o.stop();
}

fn ok(cc: &str, body: &str) -> Reply {
    Reply::wire(
        format!(
            "HTTP/1.1 200 OK\r\nCache-Control: {cc}\r\nETag: \"{body}\"\r\nContent-Length: {}",
            body.len()
        ),
        vec![(Duration::ZERO, body.as_bytes().to_vec())],
    )
}

/// Reads a response head and then body bytes from a raw stream until
/// `want` body bytes came; returns the head text and the body.
fn read_response(s: &mut std::net::TcpStream, want: usize) -> (String, Vec<u8>) {
    use std::io::Read;
    let mut buf = Vec::new();
    let mut b = [0u8; 4096];
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    loop {
        if let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            if buf.len() >= end + 4 + want {
                let head = String::from_utf8_lossy(&buf[..end]).to_string();
                return (head, buf[end + 4..].to_vec());
            }
        }
        assert!(std::time::Instant::now() < deadline, "timed out: {buf:?}");
        match s.read(&mut b) {
            Ok(0) => panic!("closed after {buf:?}"),
            Ok(n) => buf.extend_from_slice(&b[..n]),
            Err(e) => panic!("read: {e}"),
        }
    }
}

#[test]
fn a_slow_fill_streams_to_followers_as_it_arrives() {
    use std::io::Write;
    // 10 bytes, one every 300 ms; the leader's client leaves after the
    // head: the fill goes on for the others and is stored.
    let o = Script::start(|_: &Request| {
        Reply::wire(
            "HTTP/1.1 200 OK\r\nCache-Control: max-age=60\r\nContent-Length: 10",
            (0..10)
                .map(|i| (Duration::from_millis(300), vec![b'0' + i]))
                .collect(),
        )
    });
    let pier = pier(&cache_config(o.addr(), ""));
    let addr = pier.listener("main");
    let mut leader = std::net::TcpStream::connect(addr).unwrap();
    // The Host RawConn sends, so that the last request has the same key.
    let req = "GET /slow HTTP/1.1\r\nHost: pier.test\r\n\r\n";
    leader.write_all(req.as_bytes()).unwrap();
    let (head, _) = read_response(&mut leader, 1);
    assert!(head.contains("fwd=miss; stored"), "{head}");
    drop(leader);
    // A follower joins mid-fill: it gets its first bytes before the origin
    // has sent the last one (the fill takes 1.5 s; it follows the writer).
    let mut f = std::net::TcpStream::connect(addr).unwrap();
    f.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    f.write_all(req.as_bytes()).unwrap();
    let (head, first) = read_response(&mut f, 1);
    assert!(head.contains("detail=coalesced"), "{head}");
    assert!(
        head.to_ascii_lowercase().contains("content-length: 10"),
        "{head}"
    );
    let early = first.len();
    assert!(
        early < 10,
        "the follower waited for the whole body: {first:?}"
    );
    let mut all = first;
    while all.len() < 10 {
        use std::io::Read;
        let mut b = [0u8; 64];
        match f.read(&mut b) {
            Ok(0) | Err(_) => break,
            Ok(n) => all.extend_from_slice(&b[..n]),
        }
    }
    assert_eq!(all, b"0123456789");
    // Stored whole although the leader's client left.
    let r = RawConn::connect(addr).get("/slow").unwrap();
    assert_eq!(r.body, b"0123456789");
    assert!(
        r.header("cache-status").unwrap().starts_with("pier; hit"),
        "{r:?}"
    );
    assert_eq!(o.requests(), 1);
}

#[test]
fn a_hundred_concurrent_cold_requests_reach_the_origin_once() {
    // The head at once, the body once all hundred are in: the followers
    // join a fill whose head they already have.
    let body = Gate::new();
    let held = body.clone();
    let s = cache_scenario("lock_timeout = \"20s\"")
        .origin(move |_| {
            let held = held.clone();
            Reply::raw(move |conn| {
                use std::io::Write;
                let _ = conn.write_all(
                    b"HTTP/1.1 200 OK\r\nCache-Control: max-age=60\r\nContent-Length: 5\r\n\r\n",
                );
                held.wait(Duration::from_secs(30));
                let _ = conn.write_all(b"cold\n");
            })
        })
        .start();
    for r in all_at_once(&s, &body, 100, "/cold") {
        assert_eq!(r, (200, b"cold\n".to_vec()));
    }
    assert_eq!(
        s.origin_requests(),
        1,
        "one origin request for 100 concurrent misses"
    );
}

/// A synthetic Last-Modified answers revalidations but gives no heuristic
/// freshness: a `public` response without validators or a lifetime is
/// revalidated on every use, also after a 304 (whose Date, a day ahead,
/// would make a Last-Modified-based heuristic lifetime of hours).
#[test]
fn a_synthetic_last_modified_gives_no_heuristic_freshness() {
    let o = Script::start(|r: &Request| {
        let n = r.n;
        if n == 1 {
            Reply::wire(
                "HTTP/1.1 200 OK\r\nCache-Control: public\r\nContent-Length: 2",
                vec![(Duration::ZERO, b"v1".to_vec())],
            )
        } else {
            let tomorrow = std::time::SystemTime::now() + Duration::from_secs(86_400);
            Reply::wire(
                format!(
                    "HTTP/1.1 304 Not Modified\r\nDate: {}",
                    httpdate::fmt_http_date(tomorrow)
                ),
                Vec::new(),
            )
        }
    });
    // No route TTL: the response's own freshness (none) decides.
    let cfg = cache_config(o.addr(), "").replace("ttl = { \"200\" = \"60s\" }\n", "");
    assert!(!cfg.contains("ttl ="), "{cfg}");
    let pier = pier(&cfg);
    let addr = pier.listener("main");
    let r = RawConn::connect(addr).get("/p").unwrap();
    assert_eq!(r.body, b"v1");
    assert!(r.header("last-modified").is_none(), "{r:?}");
    for want in 2..=4 {
        let r = RawConn::connect(addr).get("/p").unwrap();
        assert_eq!((r.status, &r.body[..]), (200, &b"v1"[..]), "{r:?}");
        assert!(r.header("last-modified").is_some(), "{r:?}");
        assert_eq!(o.requests(), want, "revalidated on every use: {r:?}");
    }
}

#[test]
fn stale_while_revalidate_serves_stale_and_refreshes_once_in_the_background() {
    // v1, then v2 from a refresh held at the origin until the test opens the
    // gate (a slow refresh the clients must not wait on). v2 stays fresh.
    let refresh = Gate::new();
    let held = refresh.clone();
    let s = cache_scenario("")
        .origin(move |r| match r.n {
            1 => Reply::ok("v1").header("cache-control", "max-age=1, stale-while-revalidate=60"),
            _ => Reply::ok("v2")
                .header("cache-control", "max-age=60")
                .after(&held),
        })
        .start();
    s.get("/swr").expect_body("v1");
    // Past max-age (a second, as the Age arithmetic is in seconds).
    s.advance_clock(Duration::from_secs(2));
    for _ in 0..5 {
        s.get("/swr")
            .expect_body("v1")
            .expect_header_contains("cache-status", "stale-while-revalidate");
    }
    // One refresh for the key, in the background, held all along; once it
    // is let go, v2 is a hit.
    assert!(wait_until(Duration::from_secs(10), || s.origin_requests() == 2));
    refresh.open();
    s.wait_body("/swr", "v2");
    s.get("/swr")
        .expect_header_prefix("cache-status", "pier; hit; ttl=");
    assert_eq!(s.origin_requests(), 2, "one background refresh");
    let m = s.metrics();
    assert!(m.contains("result=\"updating\"} 1"), "{m}");
}

/// `X-Pier-Cache-Refresh` marks Pier's own background refresh. A client
/// that sends it (in any case) gets what anyone would: a fresh object is a
/// hit, a stale-while-revalidate one is served stale, and the origin never
/// sees the mark.
#[test]
fn a_clients_refresh_mark_forces_nothing_and_never_reaches_the_origin() {
    let s = cache_scenario("")
        .origin(|r| {
            let marked = r.header("x-pier-cache-refresh").is_some();
            Reply::ok(if marked { "marked" } else { "v1" })
                .header("cache-control", "max-age=1, stale-while-revalidate=60")
        })
        .start();
    for name in [
        "X-Pier-Cache-Refresh",
        "x-pier-cache-refresh",
        "X-PIER-CACHE-REFRESH",
    ] {
        s.request("GET", "/mark", &[(name, "1")], b"")
            .expect_body("v1");
    }
    // The first stored it; the others were hits.
    assert_eq!(s.origin_requests(), 1);
    s.advance_clock(Duration::from_secs(2));
    s.request("GET", "/mark", &[("X-Pier-Cache-Refresh", "1")], b"")
        .expect_body("v1")
        .expect_header_contains("cache-status", "stale-while-revalidate");
    // Pier's own refresh reached the origin, without a client's mark: once
    // it is stored (a fresh hit), it is what the unmarked origin sent.
    assert!(wait_until(Duration::from_secs(10), || s.origin_requests() == 2));
    assert!(wait_until(Duration::from_secs(10), || s
        .get("/mark")
        .header("cache-status")
        .is_some_and(|v| v.starts_with("pier; hit; ttl="))));
    s.get("/mark").expect_body("v1");
    assert_eq!(s.origin_requests(), 2);
}

#[test]
fn stale_if_error_and_grace_serve_stale_when_the_origin_fails() {
    // /sie: stale-if-error; /grace: none (the route's grace applies);
    // /mr: must-revalidate (never stale). After the first request of each,
    // the origin answers 503, then closes without answering.
    let o = Script::start(|r: &Request| {
        let path = r.path.as_str();
        use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};
        static SEEN: [AtomicUsize; 3] = [
            AtomicUsize::new(0),
            AtomicUsize::new(0),
            AtomicUsize::new(0),
        ];
        let (i, cc) = match path {
            "/sie" => (0, "max-age=1, stale-if-error=60"),
            "/grace" => (1, "max-age=1"),
            _ => (2, "max-age=1, must-revalidate"),
        };
        match SEEN[i].fetch_add(1, SeqCst) {
            0 => ok(cc, "good"),
            1 => Reply::wire(
                "HTTP/1.1 503 Service Unavailable\r\nContent-Length: 4",
                vec![(Duration::ZERO, b"down".to_vec())],
            ),
            _ => Reply::close(),
        }
    });
    let pier = pier(&cache_config(o.addr(), "grace = \"30s\""));
    let addr = pier.listener("main");
    for p in ["/sie", "/grace", "/mr"] {
        assert_eq!(RawConn::connect(addr).get(p).unwrap().body, b"good");
    }
    // Past max-age (whole seconds).
    pier.advance_clock(Duration::from_secs(2));
    for p in ["/sie", "/grace"] {
        // A 503, then a closed connection: the stored response both times.
        for _ in 0..2 {
            let r = RawConn::connect(addr).get(p).unwrap();
            assert_eq!(
                (r.status, r.body.as_slice()),
                (200, &b"good"[..]),
                "{p}: {r:?}"
            );
            assert!(
                r.header("cache-status").unwrap().contains("stale-on-error"),
                "{r:?}"
            );
        }
    }
    let r = RawConn::connect(addr).get("/mr").unwrap();
    assert_eq!(r.status, 503, "must-revalidate is never served stale");
    let r = RawConn::connect(addr).get("/mr").unwrap();
    assert_eq!(r.status, 502);
    // The origin gone altogether: still the stored response.
    o.stop();
    let r = RawConn::connect(addr).get("/sie").unwrap();
    assert_eq!(r.body, b"good");
}

#[test]
fn ranges_from_a_stored_object_and_location_invalidation() {
    let o = Script::start(|r: &Request| {
        let method = r.method.as_str();
        let path = r.path.as_str();
        let n = r.n;
        match (method, path) {
        ("POST", _) => Reply::wire(
            "HTTP/1.1 201 Created\r\nLocation: /other\r\nContent-Location: http://elsewhere.example/a\r\nContent-Length: 0",
            vec![],
        ),
        _ => ok("max-age=60", &format!("0123456789-{n}")),
    }
    });
    let pier = pier(&cache_config(o.addr(), ""));
    let mut c = RawConn::connect(pier.listener("main"));
    let full = c.get("/r").unwrap().body;
    assert_eq!(full, b"0123456789-1");
    let r = c
        .request("GET", "/r", &[("Range", "bytes=2-5")], b"")
        .unwrap();
    assert_eq!((r.status, r.body.as_slice()), (206, &b"2345"[..]));
    assert_eq!(r.header("content-range"), Some("bytes 2-5/12"));
    let r = c
        .request("GET", "/r", &[("Range", "bytes=-2")], b"")
        .unwrap();
    assert_eq!((r.status, r.body.as_slice()), (206, &b"-1"[..]));
    let r = c
        .request("GET", "/r", &[("Range", "bytes=50-")], b"")
        .unwrap();
    assert_eq!(r.status, 416);
    assert_eq!(r.header("content-range"), Some("bytes */12"));
    // Several ranges: the whole object, 200.
    let r = c
        .request("GET", "/r", &[("Range", "bytes=0-1,4-5")], b"")
        .unwrap();
    assert_eq!((r.status, r.body.len()), (200, 12));
    // If-Range that does not match: the whole object.
    let r = c
        .request(
            "GET",
            "/r",
            &[("Range", "bytes=0-1"), ("If-Range", "\"nope\"")],
            b"",
        )
        .unwrap();
    assert_eq!(r.status, 200);
    assert_eq!(o.requests(), 1, "ranges served from the stored object");
    // POST answered 201 with Location /other: /other is dropped, /r (the
    // POST's own URL is /p) stays.
    c.get("/other").unwrap();
    assert_eq!(o.requests(), 2);
    let r = c.request("POST", "/p", &[], b"x").unwrap();
    assert_eq!(r.status, 201);
    let r = c.get("/other").unwrap();
    assert!(
        r.header("cache-status").unwrap().contains("fwd=miss"),
        "{r:?}"
    );
    let r = c.get("/r").unwrap();
    assert!(
        r.header("cache-status").unwrap().starts_with("pier; hit"),
        "{r:?}"
    );
    assert_eq!(o.requests(), 4);
}

/// A large stored body lives in a read-only mapping of its own and a plain
/// HTTP/1 hit splices its pages to the socket (`pier_splice_bytes_total`):
/// whole, as a range, after a HEAD, pipelined behind another hit on one
/// connection; an HTTP/2 hit of it (no splice there) gets the same bytes.
/// With io_uring off (`PIER_IO_URING=0`) clients are on epoll; the
/// listener is h2c's, for the HTTP/2 hit.
#[test]
fn large_hits_are_spliced_from_their_mapping() {
    large_hits_spliced(true);
}

/// The same on a plain listener, whose clients are on the worker's
/// io_uring (`[server] io_uring`, the default): the splice waits for the
/// ring's queued bytes, then for room in the socket by POLL_ADD.
#[test]
fn large_hits_are_spliced_from_their_mapping_on_io_uring() {
    large_hits_spliced(false);
}

fn large_hits_spliced(h2c: bool) {
    const LEN: usize = 300_000;
    let body: Vec<u8> = (0..LEN).map(|i| (i * 7 % 251) as u8).collect();
    let served = body.clone();
    let o = Script::start(move |_: &Request| {
        Reply::wire(
            format!("HTTP/1.1 200 OK\r\nCache-Control: max-age=600\r\nContent-Length: {LEN}"),
            vec![(Duration::ZERO, served.clone())],
        )
    });
    let cfg = base_config(
        "[cache.main]\nmemory = \"16m\"\nmax_object = \"1m\"",
        &format!(
            "[[route]]\nname = \"default\"\nupstream = \"app\"\n[route.cache]\nzone = \"main\"\n\n[upstream.app]\nservers = [\"{}\"]\n",
            o.addr()
        ),
    );
    let pier = if h2c {
        pier_env(&h2c_main(&cfg), &[("PIER_IO_URING", "0")])
    } else {
        pier(&cfg)
    };
    let mut c = RawConn::connect(pier.listener("main"));
    let r = c.get("/big").unwrap();
    assert_eq!((r.status, r.body.len()), (200, LEN));
    // Where the kernel allows io_uring, the plain listener's connection is on
    // a ring (set up by the worker's first such connection).
    if !h2c && io_uring_expected() {
        assert!(rings(pier.pid()) >= 1, "no io_uring in pier");
    }
    assert!(r.body == body, "the miss relays the origin's bytes");
    // Stored once the client had the whole body.
    wait_metric_at_least(&pier, "pier_cache_stored_total{zone=\"main\"}", 1.0);
    assert!(wait_metric_at_least(&pier, "pier_cache_mapped_bodies", 1.0) >= 1.0);
    let sent0 = pier.metric_value("pier_splice_bytes_total").unwrap_or(0.0);
    for _ in 0..3 {
        let r = c.get("/big").unwrap();
        assert_eq!(r.status, 200);
        assert!(r.header("cache-status").unwrap().starts_with("pier; hit"));
        assert_eq!(r.header("content-length"), Some("300000"));
        assert!(r.body == body, "a hit sends the stored bytes");
    }
    let r = c
        .request("GET", "/big", &[("Range", "bytes=1001-201000")], b"")
        .unwrap();
    assert_eq!(r.status, 206);
    assert!(r.body == body[1001..201001], "a range, from an odd offset");
    let r = c.request("HEAD", "/big", &[], b"").unwrap();
    assert_eq!((r.status, r.body.len()), (200, 0));
    // Two hits pipelined: the second head follows the first file exactly.
    {
        use std::io::Write;
        let mut s = std::net::TcpStream::connect(pier.listener("main")).unwrap();
        s.write_all(b"GET /big HTTP/1.1\r\nHost: pier.test\r\n\r\nGET /big HTTP/1.1\r\nHost: pier.test\r\nRange: bytes=0-9\r\n\r\n")
            .unwrap();
        let (head, rest) = read_response(&mut s, LEN);
        assert!(head.starts_with("HTTP/1.1 200"), "{head}");
        assert!(rest[..LEN] == body[..]);
        let mut tail = rest[LEN..].to_vec();
        let mut b = [0u8; 4096];
        while !tail.windows(4).any(|w| w == b"\r\n\r\n")
            || tail.len() < tail.windows(4).position(|w| w == b"\r\n\r\n").unwrap() + 4 + 10
        {
            use std::io::Read;
            let n = s.read(&mut b).unwrap();
            assert!(n > 0, "closed");
            tail.extend_from_slice(&b[..n]);
        }
        let end = tail.windows(4).position(|w| w == b"\r\n\r\n").unwrap();
        assert!(tail.starts_with(b"HTTP/1.1 206"), "{tail:?}");
        assert_eq!(&tail[end + 4..end + 14], &body[..10]);
    }
    // Counted just after each `splice` returns: possibly after the client read.
    let want = sent0 + (4 * LEN + 200_000 + 10) as f64;
    let sent = wait_metric_at_least(&pier, "pier_splice_bytes_total", want) - sent0;
    assert!(sent + sent0 >= want, "hits were spliced: {sent}");
    // Clients that leave mid-body (the socket's buffer full, the rest
    // unread) cost nothing but their own response, and leak no pipe.
    let fds = || std::fs::read_dir(format!("/proc/{}/fd", pier.pid())).map_or(0, |d| d.count());
    let fds0 = fds();
    for _ in 0..60 {
        use std::io::{Read, Write};
        let mut s = std::net::TcpStream::connect(pier.listener("main")).unwrap();
        s.write_all(b"GET /big HTTP/1.1\r\nHost: pier.test\r\n\r\n")
            .unwrap();
        let mut b = [0u8; 1000];
        assert!(s.read(&mut b).unwrap() > 0);
    }
    let r = c.get("/big").unwrap();
    assert!(r.body == body, "still served");
    // At most 16 spare pipes per worker (2 workers, 2 descriptors each).
    let bound = fds0 + 2 * 16 * 2 + 4;
    let mut now = fds();
    wait_until(Duration::from_secs(10), || {
        now = fds();
        now <= bound
    });
    assert!(now <= bound, "descriptors {fds0} -> {now}");
    if !h2c {
        assert_eq!(o.requests(), 1, "every hit from the one stored copy");
        return;
    }
    // HTTP/2 hands the mapping's bytes to its frames.
    let dir = pier_test_support::TempDir::new();
    let out_path = dir.path().join("body");
    let out = pier_test_support::curl(&[
        "-sS",
        "--http2-prior-knowledge",
        "-H",
        "Host: pier.test",
        "-o",
        out_path.to_str().unwrap(),
        &format!("http://{}/big", pier.listener("main")),
    ]);
    assert!(out.status.success(), "{out:?}");
    assert!(std::fs::read(&out_path).unwrap() == body);
    assert_eq!(o.requests(), 1, "every hit from the one stored copy");
}

/// An origin whose first answer is held at two gates: its head waits for
/// the first sender, the end of its body for the second. Every later
/// request gets `later(n)` at once.
fn gated_origin(
    head: String,
    first: &'static [u8],
    rest: &'static [u8],
    later: impl Fn(usize) -> Reply + Send + Sync + 'static,
) -> (
    Script,
    std::sync::mpsc::Sender<()>,
    std::sync::mpsc::Sender<()>,
) {
    use std::io::Write;
    let (head_tx, head_rx) = std::sync::mpsc::channel::<()>();
    let (rest_tx, rest_rx) = std::sync::mpsc::channel::<()>();
    let gates = std::sync::Mutex::new(Some((head_rx, rest_rx)));
    let o = Script::start(move |r: &Request| {
        let n = r.n;
        let Some((h, r)) = (n == 1).then(|| gates.lock().unwrap().take()).flatten() else {
            return later(n);
        };
        let head = head.clone();
        Reply::raw(move |conn| {
            // A gate whose sender is gone (the test failed) opens.
            let _ = h.recv_timeout(Duration::from_secs(20));
            let _ = conn.write_all(format!("{head}\r\n\r\n").as_bytes());
            let _ = conn.write_all(first);
            let _ = r.recv_timeout(Duration::from_secs(20));
            let _ = conn.write_all(rest);
        })
    });
    (o, head_tx, rest_tx)
}

/// Reads the rest of a response whose head and first body bytes
/// `read_response` returned, up to its Content-Length.
fn read_rest(s: &mut std::net::TcpStream, head: &str, mut body: Vec<u8>) -> Vec<u8> {
    use std::io::Read;
    let len: usize = head
        .lines()
        .find_map(|l| {
            let (k, v) = l.split_once(':')?;
            k.eq_ignore_ascii_case("content-length")
                .then(|| v.trim().parse().ok())?
        })
        .expect("a Content-Length");
    s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    while body.len() < len {
        let mut b = [0u8; 4096];
        match s.read(&mut b) {
            Ok(0) | Err(_) => break,
            Ok(n) => body.extend_from_slice(&b[..n]),
        }
    }
    body
}

/// Issue 31, hole 3: a request that joins a fill in flight is served from
/// it only if the fill's response, once its head arrives, selects it under
/// that response's Vary (RFC 9111 §4.1); otherwise it goes to the origin.
/// The second client asks while the origin holds the first answer (no
/// timing: the origin waits on the test, which waits on Pier's gauge of
/// requests in flight), without the first client's cookie.
#[test]
fn a_fill_serves_only_the_followers_its_vary_selects() {
    use std::io::Write;
    let vary_head = |len: usize| {
        format!(
            "HTTP/1.1 200 OK\r\nCache-Control: public, max-age=60\r\nVary: Cookie\r\nContent-Length: {len}"
        )
    };
    let (o, head_tx, rest_tx) =
        gated_origin(vary_head(18), b"cookie=sid=VICTIM", b"\n", move |n| {
            let body = format!("cookie=none n={n}\n");
            Reply::wire(
                vary_head(body.len()),
                vec![(Duration::ZERO, body.into_bytes())],
            )
        });
    let pier = pier(&cache_config(o.addr(), "lock_timeout = \"20s\""));
    let addr = pier.listener("main");
    let mut victim = std::net::TcpStream::connect(addr).unwrap();
    victim
        .write_all(b"GET /slow HTTP/1.1\r\nHost: pier.test\r\nCookie: sid=VICTIM\r\n\r\n")
        .unwrap();
    assert!(wait_until(Duration::from_secs(10), || o.requests() == 1));
    let mut other = std::net::TcpStream::connect(addr).unwrap();
    other
        .write_all(b"GET /slow HTTP/1.1\r\nHost: pier.test\r\n\r\n")
        .unwrap();
    // Both requests are in Pier: the second one is at (or on its way to)
    // the fill's lock.
    assert_eq!(
        wait_metric_at_least(&pier, "pier_active_requests", 2.0),
        2.0
    );
    head_tx.send(()).unwrap();
    let (head, first) = read_response(&mut other, 1);
    rest_tx.send(()).unwrap();
    let body = read_rest(&mut other, &head, first);
    let body = String::from_utf8_lossy(&body);
    assert!(
        !body.contains("VICTIM"),
        "another user's variant: {head}\n{body}"
    );
    assert!(!head.contains("coalesced"), "{head}");
    assert_eq!(body, "cookie=none n=2\n");
    let (vhead, vfirst) = read_response(&mut victim, 1);
    assert_eq!(
        read_rest(&mut victim, &vhead, vfirst),
        b"cookie=sid=VICTIM\n"
    );
    assert_eq!(o.requests(), 2);
    // Each variant was stored, and each answers its own requests.
    let mut c = RawConn::connect(addr);
    let r = c
        .request("GET", "/slow", &[("Cookie", "sid=VICTIM")], b"")
        .unwrap();
    assert_eq!(r.body, b"cookie=sid=VICTIM\n");
    assert!(
        r.header("cache-status").unwrap().starts_with("pier; hit"),
        "{r:?}"
    );
    let r = c.get("/slow").unwrap();
    assert_eq!(r.body, b"cookie=none n=2\n");
    assert!(
        r.header("cache-status").unwrap().starts_with("pier; hit"),
        "{r:?}"
    );
    assert_eq!(o.requests(), 2);
    drop(pier);
    o.stop();

    // A follower whose request the response does select still streams the
    // fill: one origin request for both.
    let (o, head_tx, rest_tx) = gated_origin(vary_head(18), b"cookie=sid=SHARED", b"\n", |_| {
        Reply::close()
    });
    let p = common::pier(&cache_config(o.addr(), "lock_timeout = \"20s\""));
    let addr = p.listener("main");
    let req = b"GET /slow HTTP/1.1\r\nHost: pier.test\r\nCookie: sid=SHARED\r\n\r\n";
    let mut a = std::net::TcpStream::connect(addr).unwrap();
    a.write_all(req).unwrap();
    assert!(wait_until(Duration::from_secs(10), || o.requests() == 1));
    let mut b = std::net::TcpStream::connect(addr).unwrap();
    b.write_all(req).unwrap();
    assert_eq!(wait_metric_at_least(&p, "pier_active_requests", 2.0), 2.0);
    head_tx.send(()).unwrap();
    let (bhead, bfirst) = read_response(&mut b, 1);
    assert!(bhead.contains("detail=coalesced"), "{bhead}");
    rest_tx.send(()).unwrap();
    assert_eq!(read_rest(&mut b, &bhead, bfirst), b"cookie=sid=SHARED\n");
    let (ahead, afirst) = read_response(&mut a, 1);
    assert_eq!(read_rest(&mut a, &ahead, afirst), b"cookie=sid=SHARED\n");
    assert_eq!(o.requests(), 1);
    o.stop();
}

/// Issue 31, hole 4: a 304 that would make the stored object unstorable
/// (here one user's Set-Cookie, merged into it) answers its own client and
/// leaves the stored object as it was; nothing Pier decided not to store
/// is served later (`max-stale` here; stale-if-error and grace read the
/// same store).
#[test]
fn a_304_that_makes_the_object_unstorable_is_not_stored() {
    let o = Script::start(|r: &Request| {
        let n = r.n;
        match n {
        // Stale at once, so every use revalidates.
        1 => Reply::wire(
            "HTTP/1.1 200 OK\r\nCache-Control: max-age=0\r\nETag: \"e1\"\r\nContent-Length: 6",
            vec![(Duration::ZERO, b"shared".to_vec())],
        ),
        2 => Reply::wire(
            "HTTP/1.1 304 Not Modified\r\nCache-Control: max-age=0\r\nETag: \"e1\"\r\nSet-Cookie: sid=VICTIM",
            vec![],
        ),
        _ => Reply::wire(
            "HTTP/1.1 304 Not Modified\r\nCache-Control: max-age=0\r\nETag: \"e1\"",
            vec![],
        ),
    }
    });
    let pier = pier(&cache_config(o.addr(), ""));
    let mut c = RawConn::connect(pier.listener("main"));
    let r = c.get("/r").unwrap();
    assert_eq!(r.header("cache-status"), Some("pier; fwd=miss; stored"));
    // The victim's revalidation: its own Set-Cookie reaches it.
    let r = c
        .request("GET", "/r", &[("Cookie", "sid=VICTIM")], b"")
        .unwrap();
    assert_eq!(r.status, 200);
    assert_eq!(r.body, b"shared");
    assert_eq!(r.header("set-cookie"), Some("sid=VICTIM"));
    assert_eq!(o.requests(), 2);
    // Anyone else, served stale from the store: the object as it was.
    let r = c
        .request("GET", "/r", &[("Cache-Control", "max-stale")], b"")
        .unwrap();
    assert_eq!(r.status, 200);
    assert_eq!(r.body, b"shared");
    assert_eq!(r.header("set-cookie"), None, "{r:?}");
    assert!(
        r.header("cache-status").unwrap().starts_with("pier; hit"),
        "{r:?}"
    );
    assert_eq!(o.requests(), 2);
    // A 304 that keeps it storable still refreshes it.
    let r = c.get("/r").unwrap();
    assert_eq!(r.header("set-cookie"), None, "{r:?}");
    assert_eq!(
        r.header("cache-status"),
        Some("pier; fwd=stale; fwd-status=304")
    );
    assert_eq!(o.requests(), 3);
    drop(c);
    drop(pier);
    o.stop();

    // The stored response's `public` does not make the 304's cookie
    // everyone's.
    let o = Script::start(|r: &Request| {
        let n = r.n;
        match n {
        1 => Reply::wire(
            "HTTP/1.1 200 OK\r\nCache-Control: public, max-age=0\r\nETag: \"e1\"\r\nContent-Length: 6",
            vec![(Duration::ZERO, b"shared".to_vec())],
        ),
        _ => Reply::wire(
            "HTTP/1.1 304 Not Modified\r\nETag: \"e1\"\r\nSet-Cookie: sid=VICTIM",
            vec![],
        ),
    }
    });
    let pier = common::pier(&cache_config(o.addr(), ""));
    let mut c = RawConn::connect(pier.listener("main"));
    c.get("/p").unwrap();
    let r = c.get("/p").unwrap();
    assert_eq!(r.header("set-cookie"), Some("sid=VICTIM"));
    let r = c
        .request("GET", "/p", &[("Cache-Control", "max-stale")], b"")
        .unwrap();
    assert_eq!(r.header("set-cookie"), None, "{r:?}");
    assert_eq!(o.requests(), 2);
}

/// RFC 9213 end to end: `Pier-Cache-Control` is Pier's policy (over
/// `CDN-Cache-Control` and `Cache-Control`) and never reaches a client;
/// `CDN-Cache-Control` is passed on; `Cache-Control` goes to clients as the
/// origin wrote it.
#[test]
fn targeted_cache_control_end_to_end() {
    let o = Script::start(|r: &Request| {
        let path = r.path.as_str();
        let n = r.n;
        let fields = match path {
            "/pier" => "Cache-Control: no-store\r\nCDN-Cache-Control: no-store\r\nPier-Cache-Control: max-age=600",
            "/cdn" => "Cache-Control: max-age=0, private\r\nCDN-Cache-Control: max-age=600",
            // Not a valid dictionary: ignored, Cache-Control applies.
            _ => "Cache-Control: no-store\r\nCDN-Cache-Control: max-age =600",
        };
        let body = format!("n{n}");
        Reply::wire(
            format!(
                "HTTP/1.1 200 OK\r\n{fields}\r\nContent-Length: {}",
                body.len()
            ),
            vec![(Duration::ZERO, body.into_bytes())],
        )
    });
    let pier = pier(&cache_config(o.addr(), ""));
    let mut c = RawConn::connect(pier.listener("main"));
    for path in ["/pier", "/cdn"] {
        let first = c.get(path).unwrap();
        let again = c.get(path).unwrap();
        assert_eq!(again.body, first.body, "{path}: stored");
        assert!(
            again
                .header("cache-status")
                .unwrap()
                .starts_with("pier; hit"),
            "{again:?}"
        );
        for r in [&first, &again] {
            assert_eq!(r.header("pier-cache-control"), None, "{r:?}");
            assert!(r.header("cache-control").is_some(), "{r:?}");
        }
    }
    assert_eq!(
        c.get("/cdn").unwrap().header("cdn-cache-control"),
        Some("max-age=600")
    );
    let first = c.get("/bad").unwrap();
    assert_ne!(c.get("/bad").unwrap().body, first.body, "not stored");
    assert_eq!(o.requests(), 4);
}
