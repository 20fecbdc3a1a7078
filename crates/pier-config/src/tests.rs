//! Loader tests: whole files in, `Config` or `FILE:LINE:COL` errors out.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::time::Duration;

use super::*;

fn no_env(_: &str) -> Option<String> {
    None
}

fn load(text: &str) -> Result<Config, ConfigErrors> {
    load_str_with_env(text, "t.toml", &no_env)
}

fn ok(text: &str) -> Config {
    match load(text) {
        Ok(c) => c,
        Err(e) => panic!("unexpected errors:\n{e}\n--- in:\n{text}"),
    }
}

/// The error lines for `text`.
fn errors(text: &str) -> Vec<String> {
    match load(text) {
        Ok(_) => panic!("expected errors in:\n{text}"),
        Err(e) => e.to_string().lines().map(str::to_string).collect(),
    }
}

/// Asserts `text` has exactly one error, at `at` ("LINE:COL"), whose
/// message contains `needle`.
#[track_caller]
fn one_error(text: &str, at: &str, needle: &str) {
    let errs = errors(text);
    assert_eq!(
        errs.len(),
        1,
        "expected one error, got:\n{}",
        errs.join("\n")
    );
    let prefix = format!("t.toml:{at}: ");
    assert!(
        errs[0].starts_with(&prefix) && errs[0].contains(needle),
        "expected `{prefix}...{needle}...`, got `{}`",
        errs[0]
    );
}

fn addr(s: &str) -> SocketAddr {
    s.parse().unwrap()
}

/// A minimal valid file: 7 lines; tests append after it.
const BASE: &str = r#"[[listener]]
listen = "127.0.0.1:0"
[[route]]
upstream = "b"
[upstream.b]
servers = ["127.0.0.1:9000"]

"#;

// === defaults ===

#[test]
fn defaults() {
    let c = ok(BASE);
    assert_eq!(c.workers, validate::cores());
    assert!(c.workers >= 1);
    assert_eq!(c.grace_period, Duration::from_secs(30));
    assert!(
        c.io_uring,
        "cleartext HTTP/1 clients are on io_uring by default"
    );
    assert_eq!(c.admin, None);
    assert_eq!(c.demo_origin, None);
    assert_eq!(c.access_log, AccessLog::Off);
    assert!(c.deny_origins.is_empty());
    assert_eq!(c.listeners.len(), 1);
    assert_eq!(c.listeners[0].name, "listener-1");
    assert_eq!(c.listeners[0].addr, addr("127.0.0.1:0"));
    let l = &c.limits;
    assert_eq!(
        (
            l.max_header_bytes,
            l.max_headers,
            l.max_uri_bytes,
            l.max_body_bytes,
            l.max_connections
        ),
        (16384, 100, 8192, 0, 10_000)
    );
    let t = &c.timeouts;
    assert_eq!(t.client_header, Duration::from_secs(10));
    assert_eq!(t.client_idle, Duration::from_secs(60));
    assert_eq!(t.upstream_connect, Duration::from_secs(3));
    assert_eq!(t.upstream_response, Duration::from_secs(60));
    assert_eq!(t.upstream_idle, Duration::from_secs(60));
    let r = &c.routes[0];
    assert_eq!(
        (r.name.as_str(), r.upstream.as_str(), &r.host),
        ("route-1", "b", &None)
    );
    assert!(matches!(r.path, PathMatch::Any));
    let u = &c.upstreams["b"];
    assert_eq!(u.name, "b");
    assert_eq!(u.servers.len(), 1);
    assert_eq!(
        (u.servers[0].addr, u.servers[0].weight),
        (addr("127.0.0.1:9000"), 1)
    );
    assert_eq!(u.balance, Balance::RoundRobin);
    assert!(u.health_check.is_none());
    assert_eq!(u.max_fails, 3);
    assert_eq!(u.passive_recover, Duration::from_secs(10));
    assert_eq!(u.retries, 1);
    assert_eq!(u.retry_budget_ratio, 0.2);
    assert_eq!(u.retry_min_per_sec, 10);
    assert_eq!(u.pool_idle_per_server, 1024);
    assert_eq!(u.max_connections_per_server, 0);
    assert_eq!(u.max_inflight_per_server, 0);
    assert_eq!((l.body_min_rate, l.max_connections_per_ip), (0, 0));
    assert_eq!(c.lua, LuaConfig::default());
    assert_eq!(
        (c.lua.init.as_ref(), c.lua.memory_limit, c.lua.shared.len()),
        (None, 128 << 20, 0)
    );
    assert!(r.lua.is_empty() && r.lua == RouteLua::default());
    assert!(c.rate_limits.is_empty());
}

#[test]
fn every_key_set() {
    let text = r#"
[server]
workers = 3
grace_period = "1m30s"
io_uring = false
[admin]
listen = "localhost:9901"
[log]
access = "/tmp/pier-access.log"
[limits]
max_header_bytes = "32k"
max_headers = 50
max_uri_bytes = 4096
max_body_bytes = "10m"
max_connections = 500
body_min_rate = "1k"
max_connections_per_ip = 20
[timeouts]
client_header = "5s"
client_idle = "2m"
upstream_connect = "150ms"
upstream_response = "1h"
upstream_idle = "30s"
tunnel_idle = "45s"
[http]
upgrade = ["websocket"]
[security]
deny_origins = ["10.0.0.0/8", "::ffff:192.168.0.0/112"]
[demo]
origin = "[::1]:0"
[[listener]]
name = "public"
listen = "[::1]:8080"
[[listener]]
name = "other"
listen = "127.0.0.1:0"
[[route]]
name = "img"
host = "*.Example.com"
regex = '^/img/.*\.png$'
upstream = "b"
[[route]]
name = "api"
host = "api.example.com"
path = "/api/"
upstream = "b"
[[route]]
name = "login"
exact = "/login"
upstream = "b"
[upstream.b]
servers = ["127.0.0.1:9000", { addr = "127.0.0.1:9001", weight = 3 }]
balance = "hash"
hash_key = "header:X-User"
max_fails = 0
passive_recover = "5s"
retries = 2
retry_budget = 0.5
retry_min_per_sec = 3
pool_idle_per_server = 8
max_connections_per_server = 100
max_inflight_per_server = 50
[upstream.b.health_check]
type = "http"
path = "/healthz"
host = "health.local"
expect = "200-299"
interval = "500ms"
timeout = "250ms"
rise = 1
fall = 5
"#;
    let c = ok(text);
    assert_eq!(c.workers, 3);
    assert_eq!(c.grace_period, Duration::from_secs(90));
    assert!(!c.io_uring);
    assert_eq!(c.admin, Some(addr("127.0.0.1:9901")));
    assert_eq!(c.access_log, AccessLog::File("/tmp/pier-access.log".into()));
    let l = &c.limits;
    assert_eq!(
        (
            l.max_header_bytes,
            l.max_headers,
            l.max_uri_bytes,
            l.max_body_bytes,
            l.max_connections
        ),
        (32768, 50, 4096, 10 << 20, 500)
    );
    assert_eq!(c.timeouts.client_header, Duration::from_secs(5));
    assert_eq!(c.timeouts.client_idle, Duration::from_secs(120));
    assert_eq!(c.timeouts.upstream_connect, Duration::from_millis(150));
    assert_eq!(c.timeouts.upstream_response, Duration::from_secs(3600));
    assert_eq!(c.timeouts.upstream_idle, Duration::from_secs(30));
    assert_eq!(c.timeouts.tunnel_idle, Duration::from_secs(45));
    assert_eq!(c.upgrade, ["websocket"]);
    assert_eq!(c.deny_origins.len(), 2);
    assert_eq!(c.deny_origins[1], Cidr::parse("192.168.0.0/16").unwrap());
    assert_eq!(c.demo_origin, Some(addr("[::1]:0")));
    assert_eq!(c.listeners[0].name, "public");
    assert_eq!(c.listeners[0].addr, addr("[::1]:8080"));
    assert_eq!(c.listeners[1].name, "other");
    let names: Vec<&str> = c.routes.iter().map(|r| r.name.as_str()).collect();
    assert_eq!(names, ["img", "api", "login"]);
    assert_eq!(
        c.routes[0].host,
        Some(HostMatch::Suffix(".example.com".into()))
    );
    assert!(matches!(c.routes[0].path, PathMatch::Regex(_)));
    assert_eq!(
        c.routes[1].host,
        Some(HostMatch::Exact("api.example.com".into()))
    );
    assert!(matches!(&c.routes[1].path, PathMatch::Prefix(p) if p == "/api/"));
    assert!(matches!(&c.routes[2].path, PathMatch::Exact(p) if p == "/login"));
    let u = &c.upstreams["b"];
    assert_eq!(u.servers[1].weight, 3);
    assert_eq!(u.balance, Balance::Hash(HashKey::Header("x-user".into())));
    assert_eq!(
        (
            u.max_fails,
            u.passive_recover,
            u.retries,
            u.retry_budget_ratio,
            u.retry_min_per_sec
        ),
        (0, Duration::from_secs(5), 2, 0.5, 3)
    );
    assert_eq!(
        (
            u.pool_idle_per_server,
            u.max_connections_per_server,
            u.max_inflight_per_server
        ),
        (8, 100, 50)
    );
    assert_eq!(
        (c.limits.body_min_rate, c.limits.max_connections_per_ip),
        (1024, 20)
    );
    let h = u.health_check.as_ref().unwrap();
    assert_eq!(
        h.kind,
        HealthKind::Http {
            path: "/healthz".into(),
            host: Some("health.local".into()),
            expect_min: 200,
            expect_max: 299
        }
    );
    assert_eq!(
        (h.interval, h.timeout, h.rise, h.fall),
        (Duration::from_millis(500), Duration::from_millis(250), 1, 5)
    );

    // Routing: file order, first match wins.
    let route = |host: Option<&str>, path: &str| c.find_route(host, path).map(|r| r.name.as_str());
    assert_eq!(route(Some("cdn.example.com"), "/img/a.png"), Some("img"));
    assert_eq!(route(Some("API.example.com:443"), "/api/x"), Some("api"));
    assert_eq!(route(Some("api.example.com"), "/img/a.png"), Some("img"));
    assert_eq!(route(Some("other.org"), "/api/x"), None);
    assert_eq!(route(None, "/login"), Some("login"));
    assert_eq!(route(None, "/login/x"), None);
}

#[test]
fn health_check_defaults_and_tcp() {
    let c = ok(&format!("{BASE}[upstream.b.health_check]\n"));
    let h = c.upstreams["b"].health_check.clone().unwrap();
    assert_eq!(
        h.kind,
        HealthKind::Http {
            path: "/".into(),
            host: None,
            expect_min: 200,
            expect_max: 399
        }
    );
    assert_eq!(
        (h.interval, h.timeout, h.rise, h.fall),
        (Duration::from_secs(2), Duration::from_secs(1), 2, 3)
    );
    let c = ok(&format!(
        "{BASE}[upstream.b.health_check]\ntype = \"tcp\"\n"
    ));
    assert_eq!(
        c.upstreams["b"].health_check.as_ref().unwrap().kind,
        HealthKind::Tcp
    );
}

#[test]
fn weights_pick_weighted_round_robin() {
    let c = ok(&BASE.replace(
        r#"servers = ["127.0.0.1:9000"]"#,
        r#"servers = ["127.0.0.1:9000", { addr = "127.0.0.1:9001", weight = 2 }]"#,
    ));
    assert_eq!(c.upstreams["b"].balance, Balance::WeightedRoundRobin);
    // A table without weight is weight 1, plain round robin.
    let c = ok(&BASE.replace(r#"["127.0.0.1:9000"]"#, r#"[{ addr = "127.0.0.1:9000" }]"#));
    assert_eq!(c.upstreams["b"].balance, Balance::RoundRobin);
}

#[test]
fn hash_keys() {
    for (key, want) in [
        ("header:X-User", HashKey::Header("x-user".into())),
        ("cookie:sid", HashKey::Cookie("sid".into())),
        ("client_ip", HashKey::ClientIp),
        ("path", HashKey::Path),
    ] {
        let c = ok(&format!("{BASE}balance = \"hash\"\nhash_key = \"{key}\"\n"));
        assert_eq!(c.upstreams["b"].balance, Balance::Hash(want));
    }
}

#[test]
fn root_path_is_any_and_regex_is_simplified() {
    let text = BASE.replace("upstream = \"b\"", "path = \"/\"\nupstream = \"b\"");
    assert!(matches!(ok(&text).routes[0].path, PathMatch::Any));
    let text = BASE.replace("upstream = \"b\"", "regex = '\\.css$'\nupstream = \"b\"");
    assert!(matches!(&ok(&text).routes[0].path, PathMatch::Suffix(s) if s == ".css"));
}

// === env expansion through the loader ===

#[test]
fn env_expansion() {
    let vars: HashMap<&str, &str> = [("L", "127.0.0.1:7000"), ("W", "4")].into_iter().collect();
    let lookup = |n: &str| vars.get(n).map(|v| v.to_string());
    let text = "[server]\nworkers = ${W}\n[[listener]]\nlisten = \"${L}\"\nname = \"$${L}\"\n[[listener]]\nlisten = \"${NOPE:-127.0.0.1:7001}\"\n";
    let c = load_str_with_env(text, "t.toml", &lookup).unwrap();
    assert_eq!(c.workers, 4);
    assert_eq!(c.listeners[0].addr, addr("127.0.0.1:7000"));
    assert_eq!(c.listeners[0].name, "${L}");
    assert_eq!(c.listeners[1].addr, addr("127.0.0.1:7001"));

    // Unset without default: every one reported, at its own `${`.
    let text = "[[listener]]\n# ${IN_COMMENT}\nlisten = \"${UNSET_A}\"\n[server]\ngrace_period = \"${UNSET_B}\"\n";
    let errs = load_str_with_env(text, "t.toml", &lookup)
        .unwrap_err()
        .to_string();
    let lines: Vec<&str> = errs.lines().collect();
    assert_eq!(lines.len(), 2, "{errs}");
    assert!(
        lines[0].starts_with("t.toml:3:11: environment variable `UNSET_A` is not set"),
        "{errs}"
    );
    assert!(
        lines[1].starts_with("t.toml:5:17: environment variable `UNSET_B` is not set"),
        "{errs}"
    );
}

#[test]
fn env_values_cannot_inject_toml() {
    // The issue's value, and one whose quotes balance so that textual
    // substitution would have produced valid TOML with an `[admin]` table.
    for evil in [
        "x\"\n[admin]\nlisten=\"0.0.0.0:1\"",
        "x\"\n[admin]\nlisten=\"0.0.0.0:1",
    ] {
        let lookup = |n: &str| (n == "EVIL").then(|| evil.to_string());
        let text = "[[listener]]\nlisten = \"127.0.0.1:7000\"\nname = \"${EVIL}\"\n";
        let c = load_str_with_env(text, "t.toml", &lookup).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(c.listeners[0].name, evil);
        assert_eq!(c.admin, None, "a variable opened an [admin] table");
        // Outside a string it cannot be a value at all: refused, at its `${`.
        let text = "[server]\nworkers = ${EVIL}\n";
        let errs = load_str_with_env(text, "t.toml", &lookup)
            .unwrap_err()
            .to_string();
        assert!(
            errs.starts_with("t.toml:2:11: environment variable `EVIL` is not a bare"),
            "{errs}"
        );
    }
}

#[test]
fn positions_after_expansion_point_into_the_original_text() {
    let lookup = |n: &str| (n == "LONG").then(|| "x".repeat(50));
    // The error on line 3 sits after a 50-byte substitution on line 2.
    let text = "[[listener]]\nname = \"${LONG}\"\nlisten = \"nope\"\n";
    let errs = load_str_with_env(text, "t.toml", &lookup)
        .unwrap_err()
        .to_string();
    assert!(
        errs.starts_with("t.toml:3:10: `listen`: invalid address \"nope\""),
        "{errs}"
    );
    // An error inside a substituted value points at its `${`.
    let lookup = |n: &str| (n == "BAD").then(|| "not-an-addr".to_string());
    let text = "[[listener]]\nlisten = \"  ${BAD}\"\n";
    let errs = load_str_with_env(text, "t.toml", &lookup)
        .unwrap_err()
        .to_string();
    assert!(errs.starts_with("t.toml:2:10: "), "{errs}");
}

#[test]
fn env_from_the_process() {
    // A name no other test uses; std serialises env access internally.
    std::env::set_var("PIER_CONFIG_TEST_LISTEN", "127.0.0.1:7123");
    let c = load_str(
        &DEFAULT_CONFIG.replace("PIER_LISTEN", "PIER_CONFIG_TEST_LISTEN"),
        "q.toml",
    )
    .unwrap();
    assert_eq!(c.listeners[0].addr, addr("127.0.0.1:7123"));
    std::env::remove_var("PIER_CONFIG_TEST_LISTEN");
}

// === validation errors, one by one, with positions ===

#[test]
fn schema_errors() {
    one_error(
        &format!("{BASE}[sever]\n"),
        "8:2",
        "unknown section `sever`, expected one of: server,",
    );
    one_error(
        &format!("[server]\nwokers = 2\n{BASE}"),
        "2:1",
        "unknown field `wokers`, expected one of `workers`, `grace_period`, `upgrade_socket`, `io_uring`",
    );
    one_error(
        &format!("{BASE}[limits]\nmax_headers = \"x\"\n"),
        "9:15",
        "expected an integer",
    );
    one_error(
        &format!("{BASE}[limits]\nmax_headers = 1.5\n"),
        "9:15",
        "expected an integer",
    );
    one_error(
        &format!("{BASE}[timeouts]\nclient_idle = 10\n"),
        "9:15",
        "expected a string",
    );
    one_error(&format!("{BASE}[admin]\n"), "8:1", "missing field `listen`");
    // Appended keys land in [upstream.b].
    one_error(
        &format!("{BASE}retries = \"2\"\n"),
        "8:11",
        "expected an integer",
    );
    one_error(
        &format!("{BASE}server = [\"127.0.0.1:1\"]\n"),
        "8:1",
        "unknown field `server`",
    );
    one_error(
        &format!("{BASE}[upstream.b.health_check]\nintervall = \"1s\"\n"),
        "9:1",
        "unknown field `intervall`",
    );
    one_error(
        &BASE.replace(
            r#"["127.0.0.1:9000"]"#,
            r#"[{ addr = "127.0.0.1:9000", wieght = 2 }]"#,
        ),
        "6:39",
        "unknown field `wieght`, expected `addr` or `weight`",
    );
    one_error(
        &BASE.replace(r#"["127.0.0.1:9000"]"#, "[9000]"),
        "6:12",
        "an address \"IP:PORT\" or a table",
    );
    one_error(
        &format!("listener = 1\n{}", &BASE[BASE.find("[[route]]").unwrap()..]),
        "1:12",
        "write [[listener]]",
    );
    one_error(
        &format!(
            "upstream = 1\n{}",
            &BASE[..BASE.find("[upstream.b]").unwrap()]
        ),
        "1:12",
        "write [upstream.NAME]",
    );
    one_error(
        &format!("[[route]]\nupstream = \"b\"\nhots = \"x\"\n{BASE}"),
        "3:1",
        "unknown field `hots`",
    );
    one_error(
        &format!("[[route]]\nname = \"x\"\n{BASE}"),
        "1:1",
        "route `x`: missing `upstream` (only a route with a `content` Lua hook may leave it out)",
    );
}

#[test]
fn toml_syntax_error() {
    one_error(&format!("{BASE}[limits\n"), "8:8", "TOML syntax error");
    one_error("[server]\nworkers = \n", "2:11", "TOML syntax error");
    one_error(&format!("{BASE}servers = []\n"), "8:1", "TOML syntax error");
}

#[test]
fn value_errors() {
    let lst = |v: &str| BASE.replace("\"127.0.0.1:0\"", v);
    one_error(
        &lst("\"example.com:80\""),
        "2:10",
        "must be an IP address or \"localhost\"",
    );
    one_error(&lst("\"127.0.0.1\""), "2:10", "expected IP:PORT");
    one_error(&lst("\"127.0.0.1:99999\""), "2:10", "invalid address");
    one_error(&lst("\"localhost:x\""), "2:10", "bad port");
    one_error(
        &format!("{BASE}[admin]\nlisten = \"::1:80\"\n"),
        "9:10",
        "invalid address",
    );
    one_error(
        &format!("{BASE}[demo]\norigin = \"x\"\n"),
        "9:10",
        "`origin`: invalid address",
    );

    one_error(
        &format!("{BASE}[server]\nworkers = -1\n"),
        "9:11",
        "`workers` must be between 0 and 4096, got -1",
    );
    one_error(
        &format!("{BASE}[server]\ngrace_period = \"30\"\n"),
        "9:16",
        "invalid duration \"30\"",
    );
    one_error(
        &format!("{BASE}[timeouts]\nclient_header = \"0s\"\n"),
        "9:17",
        "must be greater than zero",
    );
    one_error(
        &format!("{BASE}[limits]\nmax_body_bytes = \"10x\"\n"),
        "9:18",
        "invalid size \"10x\"",
    );
    one_error(
        &format!("{BASE}[limits]\nmax_body_bytes = -5\n"),
        "9:18",
        "must not be negative",
    );
    one_error(
        &format!("{BASE}[limits]\nmax_header_bytes = 100\n"),
        "9:20",
        "at least 1024 bytes",
    );
    one_error(
        &format!("{BASE}[limits]\nmax_connections = 0\n"),
        "9:19",
        "between 1 and",
    );
    one_error(
        &format!("{BASE}[log]\naccess = \"\"\n"),
        "9:10",
        "\"off\", \"stdout\" or a file path",
    );
    one_error(
        &format!("{BASE}[security]\ndeny_origins = [\"10.0.0.0/8\", \"10.0.0.0/33\"]\n"),
        "9:31",
        "prefix length must be 0..=32",
    );
    one_error(
        &format!("{BASE}[security]\ndeny_origins = [\"::ffff:127.0.0.1/128\"]\n"),
        "6:12",
        "server 127.0.0.1:9000 is in security.deny_origins (127.0.0.1/32)",
    );

    // Routes.
    let route =
        |extra: &str| BASE.replace("upstream = \"b\"", &format!("{extra}\nupstream = \"b\""));
    one_error(
        &BASE.replace("upstream = \"b\"", "upstream = \"c\""),
        "4:12",
        "route `route-1`: unknown upstream `c` (defined: b)",
    );
    one_error(
        &route("regex = '^/a('"),
        "4:9",
        "`regex`: invalid regex: unclosed group (at character 4 of the pattern)",
    );
    one_error(
        &route("path = \"/a\"\nexact = \"/b\""),
        "5:9",
        "at most one of `path`, `exact` and `regex`",
    );
    one_error(&route("path = \"a/\""), "4:8", "`path` must start with `/`");
    one_error(
        &route("exact = \"a\""),
        "4:9",
        "`exact` must start with `/`",
    );
    one_error(&route("host = \"example.com/x\""), "4:8", "invalid host");
    one_error(
        &route("name = \"\""),
        "4:8",
        "route `name` must not be empty",
    );
    one_error(
        &format!(
            "{BASE}[[route]]\nupstream = \"b\"\n[[route]]\nname = \"route-1\"\nupstream = \"b\"\n"
        ),
        "11:8",
        "duplicate route name `route-1`",
    );
    one_error(
        &format!("{BASE}[[listener]]\nname = \"listener-1\"\nlisten = \"127.0.0.1:0\"\n"),
        "9:8",
        "duplicate listener name `listener-1`",
    );

    // Upstreams.
    let servers = |v: &str| BASE.replace(r#"["127.0.0.1:9000"]"#, v);
    one_error(
        &servers("[]"),
        "6:11",
        "upstream `b`: `servers` must not be empty",
    );
    one_error(
        &servers(r#"[{ addr = "127.0.0.1:1", weight = 0 }]"#),
        "6:45",
        "`weight` must be between 1 and 1000, got 0",
    );
    one_error(
        &servers(r#"["127.0.0.1"]"#),
        "6:12",
        "upstream `b`: invalid address",
    );
    one_error(
        &format!("{BASE}balance = \"fastest\"\n"),
        "8:11",
        "unknown balance \"fastest\"",
    );
    one_error(
        &format!("{BASE}balance = \"hash\"\n"),
        "8:11",
        "needs a `hash_key`",
    );
    one_error(
        &format!("{BASE}hash_key = \"path\"\n"),
        "8:12",
        "only used with balance = \"hash\"",
    );
    one_error(
        &format!("{BASE}balance = \"hash\"\nhash_key = \"header:\"\n"),
        "9:12",
        "invalid hash_key",
    );
    one_error(
        &format!("{BASE}balance = \"hash\"\nhash_key = \"query:x\"\n"),
        "9:12",
        "invalid hash_key",
    );
    let weighted = servers(r#"["127.0.0.1:1", { addr = "127.0.0.1:2", weight = 2 }]"#);
    one_error(
        &weighted.replace("servers", "balance = \"round_robin\"\nservers"),
        "6:11",
        "weights are ignored by round_robin",
    );
    // least_conn and random_two honour weights (pier-lb).
    for (b, want) in [
        ("least_conn", Balance::LeastConn),
        ("random_two", Balance::Random2),
    ] {
        let c = ok(&weighted.replace("servers", &format!("balance = \"{b}\"\nservers")));
        let u = &c.upstreams["b"];
        assert_eq!(u.balance, want);
        assert_eq!(
            u.servers.iter().map(|s| s.weight).collect::<Vec<_>>(),
            [1, 2]
        );
    }
    one_error(
        &format!("{BASE}retry_budget = 1.5\n"),
        "8:16",
        "between 0.0 and 1.0",
    );
    one_error(&format!("{BASE}retries = 11\n"), "8:11", "between 0 and 10");
    one_error(
        &format!("{BASE}passive_recover = \"soon\"\n"),
        "8:19",
        "invalid duration",
    );

    // Health checks.
    let hc = |body: &str| format!("{BASE}[upstream.b.health_check]\n{body}\n");
    one_error(
        &hc("rise = 0"),
        "9:8",
        "`rise` must be between 1 and 1000, got 0",
    );
    one_error(
        &hc("fall = 0"),
        "9:8",
        "`fall` must be between 1 and 1000, got 0",
    );
    one_error(
        &hc("type = \"udp\""),
        "9:8",
        "unknown health check type \"udp\"",
    );
    one_error(
        &hc("type = \"tcp\"\npath = \"/h\""),
        "10:8",
        "`path` only applies to type = \"http\"",
    );
    one_error(&hc("expect = \"2xx\""), "9:10", "invalid expect \"2xx\"");
    one_error(&hc("expect = \"399-200\""), "9:10", "invalid expect");
    one_error(&hc("path = \"healthz\""), "9:8", "must start with `/`");
    one_error(&hc("interval = \"0ms\""), "9:12", "greater than zero");
}

#[test]
fn no_listener() {
    let errs = errors(&BASE.replace("[[listener]]\nlisten = \"127.0.0.1:0\"\n", ""));
    assert_eq!(
        errs,
        ["t.toml: no listener: add a [[listener]] with `listen = \"127.0.0.1:8080\"`"]
    );
    // A broken listener entry is reported once, not also as "no listener".
    let errs = errors(&BASE.replace("listen = \"127.0.0.1:0\"", "lisen = \"127.0.0.1:0\""));
    assert_eq!(errs.len(), 1, "{errs:?}");
    assert!(
        errs[0].starts_with("t.toml:2:1: unknown field `lisen`"),
        "{errs:?}"
    );
}

#[test]
fn broken_upstream_body_is_not_also_unknown() {
    // The route refers to `b`, whose body has a schema error: one error only.
    let errs = errors(&format!("{BASE}colour = 1\n"));
    assert_eq!(errs.len(), 1, "{errs:?}");
}

#[test]
fn all_errors_are_collected_in_file_order() {
    let text = r#"[server]
wokers = 3
grace_period = "x"

[limits]
max_headers = "many"

[[listener]]
listen = "127.0.0.1:0"
bogus = 1

[[listener]]
name = "b"
listen = "nowhere"

[[route]]
upstream = "nope"
regex = "("

[upstream.a]
servers = []
balance = "hash"

[upstream.a.health_check]
rise = 0
fall = 0
"#;
    let errs = errors(text);
    let at: Vec<&str> = errs.iter().map(|e| e.split(": ").next().unwrap()).collect();
    assert_eq!(
        at,
        [
            "t.toml:2:1",
            "t.toml:6:15",
            "t.toml:10:1",
            "t.toml:14:10",
            "t.toml:17:12",
            "t.toml:18:9",
            "t.toml:21:11",
            "t.toml:22:11",
            "t.toml:25:8",
            "t.toml:26:8",
        ],
        "{}",
        errs.join("\n")
    );
    // The [server] section stopped at its unknown key; `grace_period` there
    // is not checked, but everything else is.
    assert!(errs[0].contains("wokers"));
}

#[test]
fn error_display_format() {
    let e = ConfigErrors(vec![
        ConfigError {
            file: "a.toml".into(),
            location: Some(Location { line: 3, col: 7 }),
            message: "bad".into(),
        },
        ConfigError {
            file: "a.toml".into(),
            location: None,
            message: "worse".into(),
        },
    ]);
    assert_eq!(e.to_string(), "a.toml:3:7: bad\na.toml: worse");
    assert_eq!(e.len(), 2);
    // Columns count characters, not bytes.
    one_error(
        &format!("{BASE}[log]\n# é\naccess = \"\" # é\n"),
        "10:10",
        "file path",
    );
    one_error(
        "[[listener]]\nname = \"é\"; listen = \"x\"\n",
        "2:11",
        "TOML syntax error",
    );
}

#[test]
fn missing_file() {
    let path = std::path::Path::new("/nonexistent/pier-config-test/pier.toml");
    let e = load_file(path).unwrap_err();
    let s = e.to_string();
    assert!(
        s.starts_with("/nonexistent/pier-config-test/pier.toml: cannot read config file: "),
        "{s}"
    );
    assert!(s.contains("No such file or directory"), "{s}");
}

#[test]
fn load_file_reads_and_labels() {
    let dir = std::env::temp_dir().join(format!("pier-config-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let good = dir.join("good.toml");
    std::fs::write(&good, BASE).unwrap();
    assert_eq!(load_file(&good).unwrap().listeners.len(), 1);
    let bad = dir.join("bad.toml");
    std::fs::write(&bad, format!("{BASE}retries = -1\n")).unwrap();
    let s = load_file(&bad).unwrap_err().to_string();
    assert_eq!(
        s,
        format!(
            "{}:8:11: `retries` must be between 0 and 10, got -1",
            bad.display()
        )
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

// === quick() and the quickstart ===

#[test]
fn quick_mode() {
    let to = vec![addr("127.0.0.1:9000"), addr("127.0.0.1:9001")];
    let c = Config::quick(
        addr("127.0.0.1:8080"),
        to.clone(),
        Some(addr("127.0.0.1:9901")),
    );
    assert_eq!(c.listeners.len(), 1);
    assert_eq!(c.listeners[0].addr, addr("127.0.0.1:8080"));
    assert_eq!(c.admin, Some(addr("127.0.0.1:9901")));
    assert_eq!(c.routes.len(), 1);
    let r = &c.routes[0];
    assert!(r.host.is_none() && matches!(r.path, PathMatch::Any));
    assert_eq!(
        c.find_route(Some("any.host"), "/any/path")
            .map(|r| r.name.as_str()),
        Some("default")
    );
    let u = &c.upstreams[&r.upstream];
    assert_eq!(u.servers.iter().map(|s| s.addr).collect::<Vec<_>>(), to);
    assert!(u.servers.iter().all(|s| s.weight == 1));
    assert_eq!(u.balance, Balance::RoundRobin);
    let h = u.health_check.as_ref().unwrap();
    assert_eq!(
        (h.kind.clone(), h.interval, h.rise, h.fall),
        (HealthKind::Tcp, Duration::from_secs(2), 2, 2)
    );
    assert_eq!((u.max_fails, u.retries), (3, 1));
    // Everything else as a file with the same content would give.
    let file = ok(BASE);
    let fu = &file.upstreams["b"];
    assert_eq!(
        (u.passive_recover, u.retry_budget_ratio, u.retry_min_per_sec),
        (
            fu.passive_recover,
            fu.retry_budget_ratio,
            fu.retry_min_per_sec
        )
    );
    assert_eq!(
        (u.pool_idle_per_server, u.max_connections_per_server),
        (fu.pool_idle_per_server, fu.max_connections_per_server)
    );
    assert_eq!(c.timeouts.upstream_connect, file.timeouts.upstream_connect);
    assert_eq!(c.limits.max_header_bytes, file.limits.max_header_bytes);
    assert_eq!(
        (c.workers, c.grace_period, &c.access_log),
        (file.workers, file.grace_period, &file.access_log)
    );
    assert!(c.demo_origin.is_none() && c.deny_origins.is_empty());
    assert_eq!(Config::quick(addr("127.0.0.1:1"), to, None).admin, None);
}

#[test]
fn quickstart_parses_without_env() {
    let c = load_str_with_env(DEFAULT_CONFIG, "quickstart.toml", &no_env).unwrap();
    assert_eq!(c.listeners.len(), 1);
    assert_eq!(c.listeners[0].addr, addr("127.0.0.1:8080"));
    assert_eq!(c.admin, Some(addr("127.0.0.1:9901")));
    assert_eq!(c.demo_origin, Some(addr("127.0.0.1:9000")));
    assert_eq!(c.access_log, AccessLog::Stdout);
    let r = &c.routes[0];
    assert!(r.host.is_none() && matches!(r.path, PathMatch::Any));
    let u = &c.upstreams[&r.upstream];
    assert_eq!(u.servers[0].addr, addr("127.0.0.1:9000"));
    match &u.health_check.as_ref().unwrap().kind {
        HealthKind::Http { path, .. } => assert_eq!(path, "/healthz"),
        other => panic!("{other:?}"),
    }
}

#[test]
fn quickstart_follows_env() {
    let vars: HashMap<&str, &str> = [
        ("PIER_DEMO_PORT", "19000"),
        ("PIER_LISTEN", "0.0.0.0:80"),
        ("PIER_ADMIN", "[::1]:9999"),
    ]
    .into_iter()
    .collect();
    let lookup = |n: &str| vars.get(n).map(|v| v.to_string());
    let c = load_str_with_env(DEFAULT_CONFIG, "quickstart.toml", &lookup).unwrap();
    assert_eq!(c.listeners[0].addr, addr("0.0.0.0:80"));
    assert_eq!(c.admin, Some(addr("[::1]:9999")));
    assert_eq!(c.demo_origin, Some(addr("127.0.0.1:19000")));
    // The upstream follows the demo port, so the demo works on any port.
    assert_eq!(
        c.upstreams[&c.routes[0].upstream].servers[0].addr,
        addr("127.0.0.1:19000")
    );
    // A bad value is reported at its reference in the file.
    let lookup = |n: &str| (n == "PIER_LISTEN").then(|| "nope".to_string());
    let e = load_str_with_env(DEFAULT_CONFIG, "quickstart.toml", &lookup).unwrap_err();
    assert_eq!(e.len(), 1);
    let line = DEFAULT_CONFIG
        .lines()
        .position(|l| l.contains("${PIER_LISTEN"))
        .unwrap()
        + 1;
    assert!(
        e.to_string().starts_with(&format!(
            "quickstart.toml:{line}:10: `listen`: invalid address"
        )),
        "{e}"
    );
}

// === docs/config.md stays in step with the schema ===

const DOCS: &str = include_str!("../../../docs/config.md");

/// (heading in docs/config.md, the schema struct's fields)
fn documented_tables() -> Vec<(&'static str, Vec<&'static str>)> {
    use schema::*;
    vec![
        ("## `[server]`", schema::fields_of::<ServerSection>()),
        ("## `[admin]`", fields_of::<AdminSection>()),
        ("## `[analytics]`", fields_of::<AnalyticsSection>()),
        (
            "### `[analytics.kafka]`",
            fields_of::<AnalyticsKafkaSection>(),
        ),
        ("## `[log]`", fields_of::<LogSection>()),
        ("## `[limits]`", fields_of::<LimitsSection>()),
        ("## `[timeouts]`", fields_of::<TimeoutsSection>()),
        ("## `[http]`", fields_of::<HttpSection>()),
        ("## `[http2]`", fields_of::<Http2Section>()),
        ("## `[security]`", fields_of::<SecuritySection>()),
        ("## `[resolver]`", fields_of::<ResolverSection>()),
        ("## `[tracing]`", fields_of::<TracingSection>()),
        ("## `[redis]`", fields_of::<RedisSection>()),
        ("## `[demo]`", fields_of::<DemoSection>()),
        ("## `[[listener]]`", fields_of::<ListenerEntry>()),
        ("### `[listener.tls]`", fields_of::<ListenerTlsSection>()),
        ("### `certificates` entries", fields_of::<CertTable>()),
        ("### `[listener.tls.acme]`", fields_of::<AcmeSection>()),
        (
            "### `[upstream.NAME.tls]`",
            fields_of::<UpstreamTlsSection>(),
        ),
        ("## `[[route]]`", fields_of::<RouteEntry>()),
        ("### `[route.lua]`", fields_of::<RouteLuaSection>()),
        ("### `[route.cors]`", fields_of::<CorsSection>()),
        ("### `[route.cache]`", fields_of::<RouteCacheSection>()),
        ("### `[route.cache.key]`", fields_of::<CacheKeySection>()),
        ("### `[route.compress]`", fields_of::<CompressSection>()),
        ("### `[route.tracing]`", fields_of::<RouteTracingSection>()),
        ("## `[cache.NAME]`", fields_of::<CacheZoneSection>()),
        (
            "### `[route.headers]` and `[upstream.NAME.headers]`",
            fields_of::<HeadersSection>(),
        ),
        ("## `[upstream.NAME]`", fields_of::<UpstreamEntry>()),
        ("### `servers` entries", fields_of::<ServerTable>()),
        (
            "## `[upstream.NAME.health_check]`",
            fields_of::<HealthCheckSection>(),
        ),
        ("## `[lua]`", fields_of::<LuaSection>()),
        ("## `[[limit]]`", fields_of::<LimitEntry>()),
    ]
}

/// The text under `heading`, up to the next heading.
fn doc_section(heading: &str) -> &'static str {
    let start = DOCS
        .lines()
        .position(|l| l == heading)
        .unwrap_or_else(|| panic!("docs/config.md has no heading {heading:?}"));
    let mut end = DOCS.lines().count();
    for (i, l) in DOCS.lines().enumerate().skip(start + 1) {
        if l.starts_with("## ") || l.starts_with("### ") {
            end = i;
            break;
        }
    }
    let begin = DOCS.lines().take(start).map(|l| l.len() + 1).sum::<usize>();
    let stop = DOCS.lines().take(end).map(|l| l.len() + 1).sum::<usize>();
    &DOCS[begin..stop.min(DOCS.len())]
}

#[test]
fn docs_list_every_key_and_only_real_keys() {
    for (heading, fields) in documented_tables() {
        assert!(
            !fields.is_empty(),
            "{heading}: no fields read from the schema"
        );
        let text = doc_section(heading);
        let rows: Vec<&str> = text
            .lines()
            .filter_map(|l| l.strip_prefix("| `"))
            .filter_map(|l| l.split('`').next())
            .collect();
        for f in &fields {
            assert!(
                rows.contains(f),
                "docs/config.md {heading}: key `{f}` is not documented"
            );
        }
        for r in &rows {
            assert!(
                fields.contains(r),
                "docs/config.md {heading}: documents `{r}`, which the schema does not have"
            );
        }
    }
    for s in schema::SECTIONS {
        assert!(
            documented_tables()
                .iter()
                .any(|(h, _)| h.contains(&format!("[{s}")) || h.contains(&format!("[[{s}"))),
            "section `{s}` has no table in docs/config.md"
        );
    }
}

#[test]
fn docs_example_is_valid() {
    let start = DOCS.find("## Example").unwrap();
    let block = &DOCS[start..];
    let body = &block[block.find("```toml\n").unwrap() + 8..];
    let body = &body[..body.find("```").unwrap()];
    let c = load_str_with_env(body, "docs/config.md", &no_env).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(c.routes.len(), 2);
    assert!(matches!(c.routes[0].path, PathMatch::Regex(_)));
    assert!(c.routes[0].lua.is_empty());
    assert!(
        matches!(&c.routes[1].lua.access, Some(LuaSource::Inline { name, .. }) if name == "route api access")
    );
    assert_eq!(c.lua.shared, [("sessions".to_string(), 10 << 20)]);
    assert_eq!(c.rate_limits[0].routes, Some(vec!["api".to_string()]));
    assert_eq!(c.upgrade, ["websocket"]);
    assert_eq!(
        c.routes[1].headers.response_add,
        [(
            "Strict-Transport-Security".to_string(),
            "max-age=63072000".to_string()
        )]
    );
    assert_eq!(c.upstreams["backend"].host_header, HostHeader::Upstream);
}

/// The smaller ```toml examples under the key tables are valid too, next
/// to a minimal file (a route `api` and an upstream `backend`).
#[test]
fn docs_snippets_are_valid() {
    let dir = Scratch::new("docs-snippets");
    std::fs::create_dir_all(dir.0.join("lua")).unwrap();
    std::fs::write(dir.0.join("lua/add-headers.lua"), "").unwrap();
    let base = "[[listener]]\nlisten = \"127.0.0.1:0\"\n[upstream.backend]\nservers = [\"127.0.0.1:9000\"]\n";
    let api = "[[route]]\nname = \"api\"\nupstream = \"backend\"\n";
    let mut checked = 0;
    for heading in [
        "### `[route.lua]`",
        "### `[route.headers]` and `[upstream.NAME.headers]`",
        "### `[lua.shared]`",
        "## `[[limit]]`",
    ] {
        let text = &DOCS[DOCS.find(heading).unwrap()..];
        let body = &text[text.find("```toml\n").unwrap() + 8..];
        let body = &body[..body.find("```").unwrap()];
        // The [route.lua] example brings its own route.
        let extra = if body.contains("[[route]]") { "" } else { api };
        let file = dir.0.join("pier.toml");
        std::fs::write(&file, format!("{base}{extra}{body}")).unwrap();
        load_file(&file).unwrap_or_else(|e| panic!("{heading}: {e}"));
        checked += 1;
    }
    assert_eq!(checked, 4);
}

#[test]
fn other_spellings() {
    // Inline array of tables instead of [[listener]].
    let text = BASE.replace(
        "[[listener]]\nlisten = \"127.0.0.1:0\"\n",
        "listener = [{ name = \"a\", listen = \"127.0.0.1:0\" }, { listen = \"localhost:1\" }]\n",
    );
    let c = ok(&text);
    assert_eq!(c.listeners[1].addr, addr("127.0.0.1:1"));
    assert_eq!(c.listeners[1].name, "listener-2");
    one_error(
        &text.replace("name = \"a\"", "nmae = \"a\""),
        "1:15",
        "unknown field `nmae`",
    );
    // Integer where a float is expected; sizes as plain strings.
    let c = ok(&format!(
        "{BASE}retry_budget = 1\n[limits]\nmax_uri_bytes = \"4096\"\n"
    ));
    assert_eq!(c.upstreams["b"].retry_budget_ratio, 1.0);
    assert_eq!(c.limits.max_uri_bytes, 4096);
    one_error(
        &format!("{BASE}[limits]\nmax_uri_bytes = 1.5\n"),
        "9:17",
        "expected a size",
    );
    // `localhost` upstream servers need no resolver.
    let c = ok(&BASE.replace("\"127.0.0.1:9000\"", "\"localhost:9000\""));
    assert_eq!(c.upstreams["b"].servers[0].addr, addr("127.0.0.1:9000"));
    // No route at all is allowed (everything gets 404); an unused upstream too.
    let c = ok(&BASE.replace("[[route]]\nupstream = \"b\"\n", ""));
    assert!(c.routes.is_empty() && c.upstreams.contains_key("b"));
}

#[test]
fn deny_list_catches_mapped_upstreams() {
    // An upstream written as IPv4-mapped IPv6 is checked as the IPv4 address.
    let text = format!(
        "[security]\ndeny_origins = [\"127.0.0.0/8\"]\n{}",
        BASE.replace("\"127.0.0.1:9000\"", "\"[::ffff:127.0.0.1]:9000\"")
    );
    one_error(
        &text,
        "8:12",
        "server [::ffff:127.0.0.1]:9000 is in security.deny_origins (127.0.0.0/8)",
    );
    let c = load(&text.replace("127.0.0.0/8", "10.0.0.0/8")).unwrap();
    assert!(!denied(
        &c.deny_origins,
        "::ffff:127.0.0.1".parse().unwrap()
    ));
    assert!(denied(&c.deny_origins, "::ffff:10.1.1.1".parse().unwrap()));
}

#[test]
fn port_clashes_and_proxy_loops() {
    let text = "[admin]\nlisten = \"127.0.0.1:8080\"\n[demo]\norigin = \"127.0.0.1:9000\"\n[[listener]]\nlisten = \"0.0.0.0:9000\"\n[[listener]]\nlisten = \"127.0.0.1:8080\"\n[upstream.b]\nservers = [\"127.0.0.1:9000\"]\n";
    let errs = errors(text);
    assert_eq!(
        errs,
        [
            "t.toml:6:10: 0.0.0.0:9000 is also used by the demo origin",
            "t.toml:8:10: 127.0.0.1:8080 is also used by the admin endpoint",
            "t.toml:10:12: upstream `b`: server 127.0.0.1:9000 is Pier's own listener `listener-1` (requests would loop)",
        ]
    );
    // A wildcard listener is only known to cover loopback.
    let wild = "[[listener]]\nlisten = \"0.0.0.0:8080\"\n[upstream.b]\nservers = [\"SERVER\"]\n";
    ok(&wild.replace("SERVER", "10.0.0.1:8080"));
    one_error(
        &wild.replace("SERVER", "localhost:8080"),
        "4:12",
        "requests would loop",
    );
    one_error(
        &wild.replace("SERVER", "[::ffff:127.0.0.1]:8080"),
        "4:12",
        "requests would loop",
    );
    // Port 0 never clashes; other IPs on the same port are fine.
    ok("[admin]\nlisten = \"127.0.0.1:0\"\n[[listener]]\nlisten = \"127.0.0.1:0\"\n[[listener]]\nlisten = \"127.0.0.2:9000\"\n[upstream.b]\nservers = [\"127.0.0.1:9000\"]\n");
}

// === Lua ===

fn inline(code: &str, name: &str) -> Option<LuaSource> {
    Some(LuaSource::Inline {
        code: code.into(),
        name: name.into(),
    })
}

#[test]
fn lua_inline_hooks_every_phase() {
    let text = r#"
[lua]
init = "x = 1"
init_worker = "y = 2"
memory_limit = "64m"
package_path = ["/etc/pier/lua/?.lua", "lib/?/init.lua"]
[lua.shared]
ratelimit = "10m"
cache = 65536
[[listener]]
listen = "127.0.0.1:0"
[[route]]
name = "api"
upstream = "b"
[route.lua]
access = "a()"
content = "c()"
balancer = "b()"
upstream_request = "u()"
header_filter = "h()"
body_filter = "bf()"
log = '''
l()
'''
[[route]]
name = "plain"
upstream = "b"
[upstream.b]
servers = ["127.0.0.1:9000"]
"#;
    let c = ok(text);
    assert_eq!(c.lua.init, inline("x = 1", "init"));
    assert_eq!(c.lua.init_worker, inline("y = 2", "init_worker"));
    assert_eq!(c.lua.memory_limit, 64 << 20);
    let cwd = std::env::current_dir().unwrap();
    assert_eq!(
        c.lua.package_path,
        [
            "/etc/pier/lua/?.lua".to_string(),
            cwd.join("lib/?/init.lua").display().to_string()
        ]
    );
    // Sorted by name.
    assert_eq!(
        c.lua.shared,
        [
            ("cache".to_string(), 65536),
            ("ratelimit".to_string(), 10 << 20)
        ]
    );
    let l = &c.routes[0].lua;
    assert_eq!(l.access, inline("a()", "route api access"));
    assert_eq!(l.content, inline("c()", "route api content"));
    assert_eq!(l.balancer, inline("b()", "route api balancer"));
    assert_eq!(
        l.upstream_request,
        inline("u()", "route api upstream_request")
    );
    assert_eq!(l.header_filter, inline("h()", "route api header_filter"));
    assert_eq!(l.body_filter, inline("bf()", "route api body_filter"));
    // TOML drops the newline right after '''.
    assert_eq!(l.log, inline("l()\n", "route api log"));
    let phases: Vec<&str> = l.iter().map(|(p, _)| p).collect();
    assert_eq!(
        phases,
        [
            "access",
            "content",
            "balancer",
            "upstream_request",
            "header_filter",
            "body_filter",
            "log"
        ]
    );
    // `[route.lua]` belongs to the [[route]] above it only.
    assert!(c.routes[1].lua.is_empty());
    // The inline-table spelling and 0 = unlimited memory.
    let c = ok(&BASE
        .replace(
            "upstream = \"b\"\n",
            "upstream = \"b\"\nlua = { access = \"pier.exit(403)\" }\n",
        )
        .replace("[[listener]]", "[lua]\nmemory_limit = 0\n[[listener]]"));
    assert_eq!(
        c.routes[0].lua.access,
        inline("pier.exit(403)", "route route-1 access")
    );
    assert_eq!(c.lua.memory_limit, 0);
    // Inline code is config text: `$$` and `${NAME}` are expanded in it.
    let text = format!("{BASE}[lua]\ninit = \"s = '$$ ${{X:-x}} $1'\"\n");
    assert_eq!(ok(&text).lua.init, inline("s = '$ x $1'", "init"));
}

#[test]
fn lua_content_route_needs_no_upstream() {
    let text = "[[listener]]\nlisten = \"127.0.0.1:0\"\n[[route]]\nname = \"hello\"\n[route.lua]\ncontent = 'pier.say(\"hi\")'\n";
    let c = ok(text);
    assert_eq!(c.routes[0].upstream, "");
    assert!(c.upstreams.is_empty());
    assert!(c.routes[0].lua.content.is_some());
    // Without `content`, `upstream` is required, reported at the route.
    one_error(
        &text.replace("content", "access"),
        "3:1",
        "route `hello`: missing `upstream`",
    );
    // Hooks on the upstream request could never run.
    let errs = errors(&format!(
        "{text}balancer = \"x()\"\nupstream_request_file = \"no.lua\"\n"
    ));
    assert_eq!(errs.len(), 3, "{errs:#?}");
    assert!(
        errs[0].starts_with("t.toml:7:12: route `hello`: the `balancer` hook needs an `upstream`")
    );
    assert!(errs[1].starts_with("t.toml:8:25: `upstream_request_file`: cannot read"));
    assert!(errs[2].starts_with(
        "t.toml:8:25: route `hello`: the `upstream_request` hook needs an `upstream`"
    ));
    // `content` with an upstream is fine.
    let c = ok(&BASE.replace(
        "upstream = \"b\"\n",
        "upstream = \"b\"\n[route.lua]\ncontent = \"pier.say(1)\"\n",
    ));
    assert_eq!(c.routes[0].upstream, "b");
}

/// A scratch directory, removed on drop.
struct Scratch(std::path::PathBuf);

impl Scratch {
    fn new(tag: &str) -> Scratch {
        let dir = std::env::temp_dir().join(format!(
            "pier-config-{tag}-{}-{:?}",
            std::process::id(),
            std::thread::current().id()
        ));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        Scratch(dir)
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

#[test]
fn lua_files_resolve_against_the_config_directory() {
    let dir = Scratch::new("lua-files");
    std::fs::create_dir_all(dir.0.join("lua")).unwrap();
    std::fs::write(dir.0.join("lua/access.lua"), "pier.exit(403)\n").unwrap();
    std::fs::write(dir.0.join("init.lua"), "x = 1\n").unwrap();
    let abs = dir.0.join("init.lua");
    let text = format!(
        "[lua]\ninit_file = \"init.lua\"\ninit_worker_file = \"{}\"\n{}",
        abs.display(),
        BASE.replace(
            "upstream = \"b\"\n",
            "upstream = \"b\"\n[route.lua]\naccess_file = \"lua/access.lua\"\n",
        )
    );
    let file = dir.0.join("pier.toml");
    std::fs::write(&file, &text).unwrap();
    let c = load_file(&file).unwrap_or_else(|e| panic!("{e}"));
    let want = |p: &str| Some(LuaSource::File(std::path::absolute(dir.0.join(p)).unwrap()));
    assert_eq!(c.lua.init, want("init.lua"));
    assert_eq!(c.lua.init_worker, want("init.lua"));
    assert_eq!(c.routes[0].lua.access, want("lua/access.lua"));
    match &c.routes[0].lua.access {
        Some(LuaSource::File(p)) => {
            assert!(p.is_absolute());
            assert_eq!(std::fs::read_to_string(p).unwrap(), "pier.exit(403)\n");
        }
        other => panic!("{other:?}"),
    }
    // The same text read from elsewhere does not find the relative files.
    let errs = errors(&text);
    assert_eq!(errs.len(), 2, "{errs:#?}");
    assert!(
        errs[0].starts_with("t.toml:2:13: `init_file`: cannot read "),
        "{errs:?}"
    );
    assert!(errs[0].ends_with("init.lua: No such file or directory (os error 2)"));
    assert!(
        errs[1].starts_with("t.toml:9:15: `access_file`: cannot read "),
        "{errs:#?}"
    );
    // A directory is not a file.
    std::fs::write(&file, text.replace("\"init.lua\"", "\"lua\"")).unwrap();
    let e = load_file(&file).unwrap_err().to_string();
    assert!(
        e.starts_with(&format!("{}:2:13: `init_file`: ", file.display()))
            && e.ends_with("lua is not a file"),
        "{e}"
    );
}

#[test]
fn lua_errors() {
    // Inline and file for one phase.
    one_error(
        &format!("{BASE}[lua]\ninit = \"x\"\ninit_file = \"x.lua\"\n"),
        "10:13",
        "give `init` or `init_file`, not both",
    );
    one_error(
        &BASE.replace(
            "upstream = \"b\"\n",
            "upstream = \"b\"\n[route.lua]\nlog = \"x\"\nlog_file = \"x.lua\"\n",
        ),
        "7:12",
        "give `log` or `log_file`, not both",
    );
    one_error(
        &format!("{BASE}[lua]\ninit_worker_file = \"\"\n"),
        "9:20",
        "`init_worker_file` must not be empty",
    );
    // Unknown phase key: the route entry is reported at the key.
    one_error(
        &BASE.replace(
            "upstream = \"b\"\n",
            "upstream = \"b\"\n[route.lua]\nacess = \"x\"\n",
        ),
        "6:1",
        "unknown field `acess`, expected one of `access`, `access_file`",
    );
    one_error(
        &format!("{BASE}[lua]\npackage_path = [\"lua/x.lua\"]\n"),
        "9:17",
        "`package_path` entry \"lua/x.lua\": a pattern with `?`",
    );
    one_error(
        &format!("{BASE}[lua]\ninit = 3\n"),
        "9:8",
        "expected a string",
    );
    // Sizes.
    one_error(
        &format!("{BASE}[lua]\nmemory_limit = \"512k\"\n"),
        "9:16",
        "`memory_limit` must be 0 (unlimited) or at least 1m",
    );
    one_error(
        &format!("{BASE}[lua.shared]\nd = \"4k\"\n"),
        "9:5",
        "`d` must be at least 8192 bytes",
    );
    one_error(
        &format!("{BASE}[lua.shared]\nd = \"lots\"\n"),
        "9:5",
        "invalid size \"lots\"",
    );
    one_error(
        &format!("{BASE}[lua.shared]\n\"rate-limit\" = \"1m\"\n"),
        "9:16",
        "shared dict name \"rate-limit\": use letters, digits and `_`",
    );
    one_error(
        &format!("{BASE}[lua]\nshared = \"1m\"\n"),
        "9:10",
        "expected a map",
    );
}

// === [[limit]] ===

#[test]
fn limit_rules() {
    let text = format!(
        r#"{BASE}[[limit]]
name = "per-ip"
key = "client_ip"
rate = "10/s"
[[limit]]
key = ["client_ip", "header:X-Api-Key", "cookie:sid", "path", "route", "upstream_server"]
rate = "600r/m"
burst = 20
routes = ["route-1"]
dry_run = true
status = 503
[[limit]]
name = "conc"
key = "route"
concurrent = 100
"#
    );
    let c = ok(&text);
    let r = &c.rate_limits;
    assert_eq!(r.len(), 3);
    assert_eq!(
        r[0],
        LimitRule {
            name: "per-ip".into(),
            key: vec![LimitKeyPart::ClientIp],
            kind: LimitKind::Rate {
                per_sec: 10.0,
                burst: 0
            },
            routes: None,
            dry_run: false,
            status: 429,
            global: false,
            fail: LimitFail::Open,
        }
    );
    assert_eq!(r[1].name, "limit-2");
    assert_eq!(
        r[1].key,
        [
            LimitKeyPart::ClientIp,
            LimitKeyPart::Header("x-api-key".into()),
            LimitKeyPart::Cookie("sid".into()),
            LimitKeyPart::Path,
            LimitKeyPart::Route,
            LimitKeyPart::UpstreamServer,
        ]
    );
    assert_eq!(
        r[1].kind,
        LimitKind::Rate {
            per_sec: 10.0,
            burst: 20
        }
    );
    assert_eq!(r[1].routes, Some(vec!["route-1".to_string()]));
    assert!(r[1].dry_run);
    assert_eq!(r[1].status, 503);
    assert_eq!(r[2].kind, LimitKind::Concurrent { max: 100 });
    assert_eq!(r[2].status, 503);
    assert!(r[0].applies_to("route-1") && r[0].applies_to("anything"));
    assert!(r[1].applies_to("route-1") && !r[1].applies_to("other"));
}

#[test]
fn rates() {
    for (s, want) in [
        ("10/s", 10.0),
        ("5r/s", 5.0),
        (" 600/m ", 10.0),
        ("3600/h", 1.0),
        ("0.5/s", 0.5),
        ("1r/m", 1.0 / 60.0),
    ] {
        assert_eq!(validate::parse_rate(s), Ok(want), "{s}");
    }
    for bad in [
        "",
        "10",
        "10/",
        "/s",
        "10/d",
        "10/sec",
        "-1/s",
        "0/s",
        "inf/s",
        "NaN/s",
        "1e3/s",
        "10 r/s",
        "r/s",
        "1.2.3/s",
        "2000000000/s",
    ] {
        assert!(validate::parse_rate(bad).is_err(), "{bad:?}");
    }
}

#[test]
fn limit_errors() {
    let limit = |body: &str| format!("{BASE}[[limit]]\n{body}\n");
    one_error(
        &limit("key = \"client_ip\""),
        "8:1",
        "limit `limit-1`: give `rate` (e.g. \"10/s\") or `concurrent` (e.g. 100)",
    );
    one_error(
        &limit("key = \"client_ip\"\nrate = \"1/s\"\nconcurrent = 3"),
        "11:14",
        "give `rate` or `concurrent`, not both",
    );
    one_error(
        &limit("key = \"client_ip\"\nrate = \"fast\""),
        "10:8",
        "invalid rate \"fast\"",
    );
    one_error(
        &limit("key = \"client_ip\"\nconcurrent = 3\nburst = 1"),
        "11:9",
        "`burst` only applies to `rate`",
    );
    one_error(
        &limit("key = \"client_ip\"\nconcurrent = 0"),
        "10:14",
        "`concurrent` must be between 1 and 10000000, got 0",
    );
    one_error(
        &limit("key = \"client_ip\"\nrate = \"1/s\"\nburst = -1"),
        "11:9",
        "`burst` must be between 0 and 1000000",
    );
    one_error(
        &limit("key = \"client_ip\"\nrate = \"1/s\"\nstatus = 200"),
        "11:10",
        "`status` must be between 400 and 599, got 200",
    );
    one_error(
        &limit("key = \"ip\"\nrate = \"1/s\""),
        "9:7",
        "invalid limit key \"ip\": expected \"client_ip\"",
    );
    one_error(
        &limit("key = [\"path\", \"header:\"]\nrate = \"1/s\""),
        "9:16",
        "invalid limit key \"header:\"",
    );
    one_error(
        &limit("key = [\"path\", \"path\"]\nrate = \"1/s\""),
        "9:16",
        "key part \"path\" is given twice",
    );
    one_error(
        &limit("key = []\nrate = \"1/s\""),
        "9:7",
        "`key` must not be empty",
    );
    one_error(&limit("rate = \"1/s\""), "8:1", "missing field `key`");
    one_error(
        &limit("key = 3\nrate = \"1/s\""),
        "9:7",
        "expected a string or an array of strings",
    );
    one_error(
        &limit("key = \"path\"\nrate = \"1/s\"\nroutes = [\"route-1\", \"api\"]"),
        "11:22",
        "limit `limit-1`: unknown route `api` (defined: route-1)",
    );
    one_error(
        &limit("key = \"path\"\nrate = \"1/s\"\nroutes = []"),
        "11:10",
        "`routes` must not be empty (leave it out to apply to every route)",
    );
    one_error(
        &limit("name = \"a b\"\nkey = \"path\"\nrate = \"1/s\""),
        "9:8",
        "limit name \"a b\": use letters, digits",
    );
    one_error(
        &limit("key = \"path\"\nrate = \"1/s\"\ndryrun = true"),
        "11:1",
        "unknown field `dryrun`",
    );
    let twice = format!(
        "{}[[limit]]\nname = \"x\"\nkey = \"path\"\nrate = \"1/s\"\n",
        limit("name = \"x\"\nkey = \"path\"\nrate = \"1/s\"")
    );
    one_error(&twice, "13:8", "duplicate limit name `x`");
    one_error(
        "limit = 3\n[[listener]]\nlisten = \"127.0.0.1:0\"\n",
        "1:9",
        "`limit` must be an array of tables: write [[limit]]",
    );
}

// === upstream and [limits] additions ===

#[test]
fn inflight_and_connection_limits() {
    let c = ok(&format!(
        "{BASE}max_inflight_per_server = 7\n[limits]\nbody_min_rate = 100\nmax_connections_per_ip = 4\n"
    ));
    assert_eq!(c.upstreams["b"].max_inflight_per_server, 7);
    assert_eq!(
        (c.limits.body_min_rate, c.limits.max_connections_per_ip),
        (100, 4)
    );
    one_error(
        &format!("{BASE}max_inflight_per_server = -1\n"),
        "8:27",
        "`max_inflight_per_server` must be between 0 and 10000000, got -1",
    );
    one_error(
        &format!("{BASE}[limits]\nbody_min_rate = \"fast\"\n"),
        "9:17",
        "`body_min_rate`: invalid size",
    );
    one_error(
        &format!("{BASE}[limits]\nmax_connections_per_ip = -3\n"),
        "9:26",
        "`max_connections_per_ip` must be between 0 and 10000000, got -3",
    );
}

// === the examples ===

const EXAMPLES: &[(&str, &str)] = &[
    (
        "lua-access.toml",
        include_str!("../../../examples/lua-access.toml"),
    ),
    (
        "lua-ratelimit.toml",
        include_str!("../../../examples/lua-ratelimit.toml"),
    ),
    (
        "rate-limit.toml",
        include_str!("../../../examples/rate-limit.toml"),
    ),
];

#[test]
fn examples_load_with_and_without_env() {
    let vars: HashMap<&str, &str> = [
        ("PIER_LISTEN", "127.0.0.1:0"),
        ("PIER_ORIGIN", "127.0.0.1:19000"),
        ("PIER_ADMIN", "127.0.0.1:0"),
    ]
    .into_iter()
    .collect();
    let with_env = |n: &str| vars.get(n).map(|v| v.to_string());
    for (name, text) in EXAMPLES {
        let c = load_str_with_env(text, name, &no_env).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(c.listeners[0].addr, addr("127.0.0.1:8080"), "{name}");
        assert_eq!(c.admin, Some(addr("127.0.0.1:9901")), "{name}");
        let up = &c.upstreams[&c.routes[0].upstream];
        assert_eq!(up.servers[0].addr, addr("127.0.0.1:9000"), "{name}");
        let c = load_str_with_env(text, name, &with_env).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(c.listeners[0].addr, addr("127.0.0.1:0"), "{name}");
        assert_eq!(c.admin, Some(addr("127.0.0.1:0")), "{name}");
        let up = &c.upstreams[&c.routes[0].upstream];
        assert_eq!(up.servers[0].addr, addr("127.0.0.1:19000"), "{name}");
        // From disk too (relative Lua files, if any, resolve there).
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../../examples")
            .join(name);
        load_file(&path).unwrap_or_else(|e| panic!("{e}"));
    }
}

#[test]
fn examples_say_what_they_do() {
    let get = |n: &str| {
        let text = EXAMPLES.iter().find(|(name, _)| *name == n).unwrap().1;
        load_str_with_env(text, n, &no_env).unwrap()
    };
    let code = |s: &Option<LuaSource>| match s {
        Some(LuaSource::Inline { code, .. }) => code.clone(),
        other => panic!("{other:?}"),
    };

    let c = get("lua-access.toml");
    let l = &c.routes[0].lua;
    let access = code(&l.access);
    assert!(access.contains("pier.req.get_header(\"User-Agent\")"));
    assert!(access.contains("pier.req.get_header(\"X-Block\")"));
    assert!(access.contains("pier.exit(403)"));
    assert!(access.contains("pier.resp.set_header(\"x-lua\", \"1\")"));
    assert_eq!(l.iter().count(), 1);
    assert!(c.rate_limits.is_empty() && c.lua.shared.is_empty());

    let c = get("lua-ratelimit.toml");
    assert_eq!(c.lua.shared, [("ratelimit".to_string(), 10 << 20)]);
    let access = code(&c.routes[0].lua.access);
    assert!(access.contains("pier.shared.ratelimit:incr(key, 1, 0, 1)"));
    assert!(access.contains("pier.var.remote_addr"));
    assert!(access.contains("pier.exit(429)"));

    let c = get("rate-limit.toml");
    assert_eq!(
        c.rate_limits,
        [LimitRule {
            name: "per-ip".into(),
            key: vec![LimitKeyPart::ClientIp],
            kind: LimitKind::Rate {
                per_sec: 10.0,
                burst: 0
            },
            routes: None,
            dry_run: false,
            status: 429,
            global: false,
            fail: LimitFail::Open,
        }]
    );
    assert!(c
        .routes
        .iter()
        .all(|r| c.rate_limits[0].applies_to(&r.name) && r.lua.is_empty()));
}

// === header rules, host_header, [http] upgrade, tunnel_idle ===

fn pairs(v: &[(&str, &str)]) -> Vec<(String, String)> {
    v.iter()
        .map(|(n, v)| (n.to_string(), v.to_string()))
        .collect()
}

fn names(v: &[&str]) -> Vec<String> {
    v.iter().map(|s| s.to_string()).collect()
}

#[test]
fn header_rules_defaults() {
    let c = ok(BASE);
    assert_eq!(c.upgrade, ["websocket"]);
    assert_eq!(c.timeouts.tunnel_idle, Duration::from_secs(300));
    assert_eq!(c.timeouts.tunnel_idle, Timeouts::default().tunnel_idle);
    let r = &c.routes[0];
    assert!(r.headers.is_empty() && r.headers == HeaderRules::default());
    assert_eq!(r.host_header, None);
    let u = &c.upstreams["b"];
    assert!(u.headers.is_empty());
    assert_eq!(u.host_header, HostHeader::Preserve);
    assert_eq!(HostHeader::default(), HostHeader::Preserve);
    let q = Config::quick(addr("127.0.0.1:0"), vec![addr("127.0.0.1:1")], None);
    assert_eq!(q.upgrade, ["websocket"]);
    assert!(q.routes[0].headers.is_empty() && q.routes[0].host_header.is_none());
    assert_eq!(q.upstreams["default"].host_header, HostHeader::Preserve);
}

#[test]
fn header_rules_parse_in_file_order() {
    let text = r#"
[[listener]]
listen = "127.0.0.1:0"
[http]
upgrade = ["WebSocket", "x-custom"]
[timeouts]
tunnel_idle = "10m"
[[route]]
name = "api"
upstream = "b"
host_header = "upstream"
[route.headers]
request_set = { "X-Env" = "prod", "A-First" = "1", "x-zed" = "" }
request_add = { "X-Tag" = "a b\tc", "Forwarded" = "for=\"_hidden\"" }
request_remove = ["X-Debug", "cookie", "Connection", "Upgrade"]
response_set = { "Cache-Control" = "no-store", "Upgrade" = "websocket" }
response_add = { "Strict-Transport-Security" = "max-age=63072000" }
response_remove = ["Server", "X-Powered-By"]
[[route]]
name = "lit"
upstream = "c"
host_header = "internal.example:8443"
[route.headers.request_set]
"X-B" = "2"
"X-A" = "1"
[[route]]
name = "keep"
upstream = "c"
host_header = "preserve"
[upstream.b]
servers = ["127.0.0.1:9000"]
host_header = "upstream"
[upstream.b.headers]
request_set = { "X-Via" = "pier" }
response_remove = ["X-Internal"]
[upstream.c]
servers = ["127.0.0.1:9001"]
host_header = "[::1]:80"
"#;
    let c = ok(text);
    assert_eq!(c.upgrade, ["websocket", "x-custom"]);
    assert_eq!(c.timeouts.tunnel_idle, Duration::from_secs(600));
    let api = &c.routes[0];
    assert_eq!(api.host_header, Some(HostHeader::Upstream));
    assert_eq!(
        api.headers,
        HeaderRules {
            request_set: pairs(&[("X-Env", "prod"), ("A-First", "1"), ("x-zed", "")]),
            request_add: pairs(&[("X-Tag", "a b\tc"), ("Forwarded", "for=\"_hidden\"")]),
            request_remove: names(&["X-Debug", "cookie", "Connection", "Upgrade"]),
            response_set: pairs(&[("Cache-Control", "no-store"), ("Upgrade", "websocket")]),
            response_add: pairs(&[("Strict-Transport-Security", "max-age=63072000")]),
            response_remove: names(&["Server", "X-Powered-By"]),
        }
    );
    assert!(!api.headers.is_empty());
    let lit = &c.routes[1];
    assert_eq!(
        lit.host_header,
        Some(HostHeader::Literal("internal.example:8443".into()))
    );
    // A [route.headers.request_set] table keeps its order too.
    assert_eq!(
        lit.headers.request_set,
        pairs(&[("X-B", "2"), ("X-A", "1")])
    );
    assert_eq!(c.routes[2].host_header, Some(HostHeader::Preserve));
    assert!(c.routes[2].headers.is_empty());
    let b = &c.upstreams["b"];
    assert_eq!(b.host_header, HostHeader::Upstream);
    assert_eq!(b.headers.request_set, pairs(&[("X-Via", "pier")]));
    assert_eq!(b.headers.response_remove, names(&["X-Internal"]));
    assert_eq!(
        c.upstreams["c"].host_header,
        HostHeader::Literal("[::1]:80".into())
    );

    // Any single non-empty rule makes the set non-empty.
    for key in [
        "request_set = { A = \"1\" }",
        "request_add = { A = \"1\" }",
        "request_remove = [\"A\"]",
        "response_set = { A = \"1\" }",
        "response_add = { A = \"1\" }",
        "response_remove = [\"A\"]",
    ] {
        let c = ok(&format!("{BASE}[upstream.b.headers]\n{key}\n"));
        assert!(!c.upstreams["b"].headers.is_empty(), "{key}");
    }
    // Empty tables and lists are fine and mean nothing.
    let c = ok(&format!(
        "{BASE}[upstream.b.headers]\nrequest_set = {{}}\nresponse_remove = []\n[http]\nupgrade = []\n"
    ));
    assert!(c.upstreams["b"].headers.is_empty());
    assert!(c.upgrade.is_empty());
}

#[test]
fn host_header_values() {
    let up = |v: &str| format!("{BASE}host_header = {v:?}\n");
    for (v, want) in [
        ("preserve", HostHeader::Preserve),
        ("upstream", HostHeader::Upstream),
        ("example.com", HostHeader::Literal("example.com".into())),
        (
            "Example.COM:8080",
            HostHeader::Literal("Example.COM:8080".into()),
        ),
        ("10.0.0.1", HostHeader::Literal("10.0.0.1".into())),
        ("[2001:db8::1]", HostHeader::Literal("[2001:db8::1]".into())),
        ("[::1]:443", HostHeader::Literal("[::1]:443".into())),
    ] {
        assert_eq!(ok(&up(v)).upstreams["b"].host_header, want, "{v}");
    }
    for v in [
        "",
        "a b",
        "a/b",
        "example.com/",
        "a\r\nX-Evil: 1",
        "host:",
        "host:99999",
        "host:8x",
        ":80",
        "[::1",
        "[nope]:80",
        "[::1]x",
        "user@host",
    ] {
        one_error(&up(v), "8:15", "upstream `b`: `host_header`:");
        let errs = errors(&up(v));
        assert!(errs[0].contains("is not \"preserve\", \"upstream\" or a host[:port]"));
    }
    one_error(
        &BASE.replace(
            "upstream = \"b\"\n",
            "upstream = \"b\"\nhost_header = \"a b\"\n",
        ),
        "5:15",
        "route `route-1`: `host_header`: \"a b\" is not",
    );
}

#[test]
fn header_rule_errors() {
    // A second route (lines 8-11); the rule under test is on line 12.
    let route = |body: &str| {
        format!("{BASE}[[route]]\nname = \"r\"\nupstream = \"b\"\n[route.headers]\n{body}\n")
    };
    one_error(
        &route("request_set = { \"Bad Name\" = \"x\" }"),
        "12:17",
        "route `r`: `headers.request_set`: \"Bad Name\" is not a valid header name",
    );
    one_error(
        &route("response_remove = [\"X:Y\"]"),
        "12:20",
        "route `r`: `headers.response_remove`: \"X:Y\" is not a valid header name",
    );
    one_error(
        &route("request_add = { \"\" = \"x\" }"),
        "12:17",
        "is not a valid header name",
    );
    for v in [r"a\rb", r"a\nb", r"a\u0000b", r"a\u0007b", r"\u007f"] {
        one_error(
            &route(&format!("request_add = {{ \"X-A\" = \"{v}\" }}")),
            "12:25",
            "route `r`: `headers.request_add`: header value",
        );
    }
    one_error(
        &route("response_set = { \"X-A\" = \"a\\r\\nSet-Cookie: x=1\" }"),
        "12:26",
        "(no CR, LF, NUL or other control characters)",
    );
    // Host: use host_header.
    for key in ["request_set", "request_add", "request_remove"] {
        let body = if key == "request_remove" {
            format!("{key} = [\"host\"]")
        } else {
            format!("{key} = {{ \"Host\" = \"x\" }}")
        };
        let errs = errors(&route(&body));
        assert_eq!(errs.len(), 1, "{errs:#?}");
        assert!(
            errs[0].contains(&format!("route `r`: `headers.{key}`: the request header `"))
                && errs[0].contains("use `host_header`"),
            "{}",
            errs[0]
        );
    }
    // Framing and hop-by-hop request headers, in any case.
    for name in [
        "Content-Length",
        "transfer-encoding",
        "Connection",
        "Upgrade",
        "TE",
        "Keep-Alive",
    ] {
        for key in ["request_set", "request_add"] {
            one_error(
                &route(&format!("{key} = {{ \"{name}\" = \"x\" }}")),
                "12:17",
                &format!("`headers.{key}`: the request header `{name}` cannot be changed by a header rule"),
            );
        }
    }
    for name in ["Content-Length", "Transfer-Encoding"] {
        one_error(
            &route(&format!("request_remove = [\"{name}\"]")),
            "12:19",
            "it frames the message",
        );
    }
    // Response rules on framing headers and Connection.
    for name in ["Content-Length", "Transfer-Encoding", "Connection"] {
        for key in ["response_set", "response_add"] {
            one_error(
                &route(&format!("{key} = {{ \"{name}\" = \"x\" }}")),
                "12:18",
                &format!("`headers.{key}`: the response header `{name}` cannot be changed"),
            );
        }
        one_error(
            &route(&format!("response_remove = [\"{}\"]", name.to_lowercase())),
            "12:20",
            "`headers.response_remove`: the response header",
        );
    }
    // Names are case-insensitive: one table may not name a header twice.
    one_error(
        &route("request_set = { \"X-A\" = \"1\", \"x-a\" = \"2\" }"),
        "12:30",
        "`headers.request_set`: \"x-a\" is given twice (header names are case-insensitive)",
    );
    one_error(
        &route("response_remove = [\"Server\", \"SERVER\"]"),
        "12:30",
        "\"SERVER\" is given twice",
    );
    // Removed and set in one scope: contradictory.
    one_error(
        &route("request_add = { \"X-A\" = \"1\" }\nrequest_remove = [\"x-a\"]"),
        "13:19",
        "`headers.request_remove`: \"x-a\" is also in `request_add`",
    );
    one_error(
        &route("response_set = { \"X-A\" = \"1\" }\nresponse_remove = [\"X-A\"]"),
        "13:20",
        "is also in `response_set`",
    );
    // Request and response rules are separate: the same name in both is fine.
    ok(&route(
        "request_remove = [\"X-A\"]\nresponse_set = { \"X-A\" = \"1\" }",
    ));
    // Schema: a table, not an array of pairs; string values; known keys only.
    one_error(
        &route("request_set = [[\"X-A\", \"1\"]]"),
        "12:15",
        "a table of header names and values",
    );
    one_error(
        &route("request_set = { \"X-A\" = 1 }"),
        "12:25",
        "expected a string",
    );
    one_error(
        &route("request_sett = {}"),
        "12:1",
        "unknown field `request_sett`",
    );
    one_error(
        &route("request_remove = \"X-A\""),
        "12:18",
        "expected an array",
    );
    // The same checks on an upstream, named after it.
    one_error(
        &format!("{BASE}[upstream.b.headers]\nrequest_set = {{ \"Host\" = \"x\" }}\n"),
        "9:17",
        "upstream `b`: `headers.request_set`: the request header `Host`",
    );
    one_error(
        &format!("{BASE}[upstream.b.headers]\nresponse_add = {{ \"X Y\" = \"x\" }}\n"),
        "9:18",
        "upstream `b`: `headers.response_add`:",
    );
}

#[test]
fn header_rules_on_a_content_route() {
    let text = "[[listener]]\nlisten = \"127.0.0.1:0\"\n[[route]]\nname = \"hello\"\n[route.lua]\ncontent = 'pier.say(\"hi\")'\n[route.headers]\n";
    // Response rules apply to Pier-made responses too.
    let c = ok(&format!("{text}response_set = {{ \"X-A\" = \"1\" }}\n"));
    assert_eq!(c.routes[0].headers.response_set, pairs(&[("X-A", "1")]));
    // Request rules and host_header could never apply.
    one_error(
        &format!("{text}request_set = {{ \"X-A\" = \"1\" }}\n"),
        "3:1",
        "route `hello`: request header rules (`headers.request_*`) need an `upstream`",
    );
    one_error(
        &text.replace(
            "name = \"hello\"\n",
            "name = \"hello\"\nhost_header = \"upstream\"\n",
        ),
        "5:15",
        "route `hello`: `host_header` needs an `upstream`",
    );
}

#[test]
fn upgrade_and_tunnel_errors() {
    one_error(
        &format!("{BASE}[http]\nupgrade = [\"websocket\", \"h2c\"]\n"),
        "9:25",
        "`upgrade`: h2c upgrades are never forwarded: they let a client talk past the route's hooks",
    );
    one_error(
        &format!("{BASE}[http]\nupgrade = [\"H2C\"]\n"),
        "9:12",
        "h2c upgrades are never forwarded",
    );
    one_error(
        &format!("{BASE}[http]\nupgrade = [\"web socket\"]\n"),
        "9:12",
        "`upgrade`: \"web socket\" is not a protocol name",
    );
    one_error(
        &format!("{BASE}[http]\nupgrade = [\"HTTP/2.0\"]\n"),
        "9:12",
        "is not a protocol name",
    );
    one_error(
        &format!("{BASE}[http]\nupgrade = [\"websocket\", \"WebSocket\"]\n"),
        "9:25",
        "`upgrade`: \"WebSocket\" is given twice",
    );
    one_error(
        &format!("{BASE}[http]\nupgrade = \"websocket\"\n"),
        "9:11",
        "expected an array",
    );
    one_error(
        &format!("{BASE}[http]\nupgrades = []\n"),
        "9:1",
        "unknown field `upgrades`, expected one of `upgrade`",
    );
    one_error(
        &format!("{BASE}[timeouts]\ntunnel_idle = \"0s\"\n"),
        "9:15",
        "`tunnel_idle` must be greater than zero",
    );
}

#[test]
fn lua_bounds() {
    let d = LuaConfig::default();
    assert_eq!(
        (
            d.max_response_body,
            d.socket_buffer,
            d.http_max_body,
            d.max_sockets_per_request,
            d.max_sockets_per_worker
        ),
        (16 << 20, 16 << 20, 16 << 20, 64, 16384)
    );
    let c = ok(&format!(
        "{BASE}[lua]\nmax_response_body = \"1m\"\nsocket_buffer = \"64k\"\nhttp_max_body = 4096\nmax_sockets_per_request = 8\nmax_sockets_per_worker = 100\n"
    ));
    assert_eq!(
        (
            c.lua.max_response_body,
            c.lua.socket_buffer,
            c.lua.http_max_body,
            c.lua.max_sockets_per_request,
            c.lua.max_sockets_per_worker
        ),
        (1 << 20, 64 << 10, 4096, 8, 100)
    );
    one_error(
        &format!("{BASE}[lua]\nsocket_buffer = \"512\"\n"),
        "9:17",
        "`socket_buffer` must be at least 1024 bytes",
    );
    assert_eq!(d.socket_pool_wait, Duration::from_millis(30));
    let c = ok(&format!("{BASE}[lua]\nsocket_pool_wait = \"0s\"\n"));
    assert_eq!(c.lua.socket_pool_wait, Duration::ZERO);
    let c = ok(&format!("{BASE}[lua]\nsocket_pool_wait = \"250ms\"\n"));
    assert_eq!(c.lua.socket_pool_wait, Duration::from_millis(250));
    one_error(
        &format!("{BASE}[lua]\nsocket_pool_wait = \"61s\"\n"),
        "9:20",
        "`socket_pool_wait` must be at most 60s",
    );
    one_error(
        &format!("{BASE}[lua]\nmax_sockets_per_request = 0\n"),
        "9:27",
        "`max_sockets_per_request` must be between 1 and 1000000",
    );
}

// === TLS ===

const TLS_BASE: &str = r#"[[listener]]
name = "https"
listen = "127.0.0.1:0"
[listener.tls]
"#;

const TLS_TAIL: &str = r#"
[[route]]
upstream = "app"
[upstream.app]
servers = ["127.0.0.1:9000"]
"#;

fn tls_file(tls: &str, upstream_tls: &str) -> String {
    format!("{TLS_BASE}{tls}\n{TLS_TAIL}{upstream_tls}")
}

#[test]
fn listener_tls_defaults_and_certificates() {
    let c = ok(&tls_file(
        "cert = \"/c/a.pem\"\nkey = \"a.key\"\ncertificates = [{ cert = \"b.pem\", key = \"/k/b.key\" }]",
        "",
    ));
    let t = c.listeners[0].tls.as_ref().unwrap();
    assert_eq!(t.certificates.len(), 2);
    assert_eq!(t.certificates[0].cert, std::path::PathBuf::from("/c/a.pem"));
    assert!(t.certificates[1].cert.ends_with("b.pem"));
    assert_eq!(t.certificates[1].key, std::path::PathBuf::from("/k/b.key"));
    assert_eq!(t.unknown_sni, UnknownSni::Default);
    assert_eq!(t.min_version, TlsVersion::Tls12);
    assert_eq!(t.alpn, vec!["http/1.1".to_string()]);
    assert_eq!((t.session_cache, t.session_tickets), (20_000, true));
    assert_eq!(t.client_auth, ClientAuth::Off);
    assert_eq!(t.handshake_timeout, Duration::from_secs(10));
    assert_eq!((t.max_handshakes, t.max_pending_hellos), (1024, 4096));
    assert_eq!((t.ocsp_stapling, &t.ocsp_responder), (true, &None));
    assert!(c.upstreams["app"].tls.is_none());
    let c = ok(&tls_file(
        "cert = \"a\"\nkey = \"b\"\nocsp_stapling = false\nocsp_responder = \"http://ocsp.example:8080/x\"",
        "",
    ));
    let t = c.listeners[0].tls.as_ref().unwrap();
    assert!(!t.ocsp_stapling);
    assert_eq!(
        t.ocsp_responder.as_deref(),
        Some("http://ocsp.example:8080/x")
    );
    let e = errors(&tls_file(
        "cert = \"a\"\nkey = \"b\"\nocsp_responder = \"https://x\"",
        "",
    ));
    assert!(
        e.len() == 1 && e[0].contains("expected an http:// URL"),
        "{e:?}"
    );
    // A client CA alone means "required".
    let c = ok(&tls_file("cert = \"a\"\nkey = \"b\"\nclient_ca = \"ca.pem\"\nmin_version = \"1.3\"\nunknown_sni = \"refuse\"", ""));
    let t = c.listeners[0].tls.as_ref().unwrap();
    assert_eq!(t.client_auth, ClientAuth::Required);
    assert_eq!(t.min_version, TlsVersion::Tls13);
    assert_eq!(t.unknown_sni, UnknownSni::Refuse);
}

#[test]
fn listener_tls_acme() {
    let c = ok(&tls_file(
        "[listener.tls.acme]\ndomains = [\"Example.com\", \"www.example.com.\", \"example.com\"]\nemail = \"ops@example.com\"",
        "",
    ));
    let t = c.listeners[0].tls.as_ref().unwrap();
    assert!(t.certificates.is_empty());
    let a = t.acme.as_ref().unwrap();
    assert_eq!(a.domains, ["example.com", "www.example.com"]);
    assert_eq!(a.email.as_deref(), Some("ops@example.com"));
    assert_eq!(a.directory, LETS_ENCRYPT);
    assert_eq!(a.directory_ca, None);
    assert!(a.storage.ends_with("acme"));
    assert_eq!(a.renew_before, Duration::from_secs(30 * 86_400));
    let c = ok(&tls_file(
        "cert = \"a\"\nkey = \"b\"\n[listener.tls.acme]\ndomains = [\"x.example\"]\ndirectory = \"https://127.0.0.1:14000/dir\"\ndirectory_ca = \"/ca.pem\"\nstorage = \"/var/lib/pier/acme\"\nrenew_before = \"10d\"",
        "",
    ));
    let a = c.listeners[0].tls.as_ref().unwrap().acme.clone().unwrap();
    assert_eq!(a.directory, "https://127.0.0.1:14000/dir");
    assert_eq!(a.directory_ca, Some(std::path::PathBuf::from("/ca.pem")));
    assert_eq!(a.storage, std::path::PathBuf::from("/var/lib/pier/acme"));
    assert_eq!(a.renew_before, Duration::from_secs(10 * 86_400));
    assert_eq!(a.challenge, AcmeChallenge::TlsAlpn01);
    assert!(a.ari && a.on_demand.is_none());
    let c = ok(&tls_file(
        "[listener.tls.acme]\nchallenge = \"http-01\"\nari = false\non_demand = true\nask = \"http://127.0.0.1:5555/check\"\non_demand_rate = 3",
        "",
    ));
    let a = c.listeners[0].tls.as_ref().unwrap().acme.clone().unwrap();
    assert!(a.domains.is_empty() && !a.ari);
    assert_eq!(a.challenge, AcmeChallenge::Http01);
    assert_eq!(
        a.on_demand,
        Some(OnDemand {
            ask: "http://127.0.0.1:5555/check".into(),
            per_minute: 3,
            max: 100
        })
    );
    for (acme, why) in [
        (
            "domains = [\"a.example\"]\nchallenge = \"dns-01\"",
            "expected \"tls-alpn-01\"",
        ),
        ("on_demand = true", "needs `ask"),
        (
            "on_demand = true\nask = \"https://x/\"",
            "expected an http:// URL",
        ),
        (
            "on_demand = true\nask = \"http://x/\"\non_demand_max = 0",
            "`on_demand_max` must be between",
        ),
        ("domains = [\"*.example.com\"]", "no wildcards"),
        ("domains = [\"localhost\"]", "expected a DNS name"),
        ("domains = [\"a_b.example\"]", "expected a DNS name"),
        ("domains = []", "needs `domains"),
        (
            "domains = [\"a.example\"]\ndirectory = \"http://x/dir\"",
            "expected an https:// URL",
        ),
        ("domains = [\"a.example\"]\nport = 1", "unknown field"),
    ] {
        let e = errors(&tls_file(&format!("[listener.tls.acme]\n{acme}"), ""));
        assert!(e.len() == 1 && e[0].contains(why), "{acme}: {e:?}");
    }
}

#[test]
fn tracing_section() {
    let c = ok("[tracing]\nendpoint = \"http://127.0.0.1:4318/v1/traces\"\nsample = 0.01\nservice_name = \"edge\"\n[[listener]]\nlisten = \"127.0.0.1:0\"\n[[route]]\nupstream = \"a\"\n[route.tracing]\nsample = 0.5\n[upstream.a]\nservers = [\"127.0.0.1:1\"]\n");
    let t = c.tracing.clone().unwrap();
    assert_eq!(t.endpoint, "http://127.0.0.1:4318/v1/traces");
    assert_eq!(
        (t.sample, t.service_name.as_str(), t.queue),
        (0.01, "edge", 8192)
    );
    assert_eq!(c.routes[0].trace_sample, Some(0.5));
    let g = ok("[tracing]\nendpoint = \"grpc://127.0.0.1:4317\"\n[[listener]]\nlisten = \"127.0.0.1:0\"\n[[route]]\nupstream = \"a\"\n[upstream.a]\nservers = [\"127.0.0.1:1\"]\n");
    assert_eq!(g.tracing.unwrap().endpoint, "grpc://127.0.0.1:4317");
    for (t, why) in [
        ("", "needs `endpoint"),
        (
            "endpoint = \"https://x/v1/traces\"",
            "expected an http:// URL",
        ),
        (
            "endpoint = \"http://x/\"\nsample = 1.5",
            "between 0.0 and 1.0",
        ),
        (
            "endpoint = \"http://x/\"\nqueue = 0",
            "`queue` must be between",
        ),
        ("endpoint = \"http://x/\"\nratio = 1", "unknown field"),
    ] {
        let e = errors(&format!("[tracing]\n{t}\n[[listener]]\nlisten = \"127.0.0.1:0\"\n[[route]]\nupstream = \"a\"\n[upstream.a]\nservers = [\"127.0.0.1:1\"]\n"));
        assert!(e.len() == 1 && e[0].contains(why), "{t}: {e:?}");
    }
}

#[test]
fn redis_section() {
    let rest = "[[listener]]\nlisten = \"127.0.0.1:0\"\n[[route]]\nupstream = \"a\"\n[upstream.a]\nservers = [\"127.0.0.1:1\"]\n";
    let c = ok(&format!("[redis]\nurl = \"redis://10.0.0.5:6379\"\n{rest}"));
    let r = c.redis.unwrap();
    assert_eq!(
        (r.url.as_str(), r.channel.as_str(), r.timeout),
        (
            "redis://10.0.0.5:6379",
            "pier:purge",
            Duration::from_secs(1)
        )
    );
    assert!(ok(rest).redis.is_none());
    for (t, why) in [
        ("", "needs `url"),
        ("url = \"rediss://x\"", "not supported"),
        ("url = \"http://x\"", "needs `url"),
        ("url = \"redis://x\"\nchannel = \"\"", "1 to 256 bytes"),
        ("url = \"redis://x\"\nnodes = []", "unknown field"),
        ("url = \"redis://x\"\nsync_interval = \"1ms\"", "5ms to 10s"),
        ("url = \"redis://x\"\nkey_prefix = \"\"", "1 to 64 bytes"),
        ("sentinels = [\"10.0.0.1:26379\"]", "need `master_name`"),
        (
            "url = \"redis://x\"\nmaster_name = \"m\"",
            "goes with `sentinels`",
        ),
        (
            "sentinels = [\"10.0.0.1\"]\nmaster_name = \"m\"",
            "\"HOST:PORT\"",
        ),
        ("sentinels = []\nmaster_name = \"m\"", "1 to 16"),
    ] {
        let e = errors(&format!("[redis]\n{t}\n{rest}"));
        assert!(e.len() == 1 && e[0].contains(why), "{t}: {e:?}");
    }
    assert_eq!(
        (r.sync_interval, r.key_prefix.as_str()),
        (Duration::from_millis(50), "pier")
    );
    assert!(r.sentinels.is_empty());
    // Sentinels: the URL is optional (its password and database only).
    let c = ok(&format!(
        "[redis]\nsentinels = [\"10.0.0.1:26379\", \"sentinel.example:26379\"]\nmaster_name = \"fleet\"\n{rest}"
    ));
    let r = c.redis.unwrap();
    assert_eq!((r.sentinels.len(), r.master_name.as_str()), (2, "fleet"));
}

#[test]
fn global_limits() {
    let rest = "[[listener]]\nlisten = \"127.0.0.1:0\"\n[[route]]\nupstream = \"a\"\n[upstream.a]\nservers = [\"127.0.0.1:1\"]\n";
    let redis = "[redis]\nurl = \"redis://127.0.0.1:6379\"\n";
    let c = ok(&format!(
        "{redis}[[limit]]\nkey = \"client_ip\"\nrate = \"10/s\"\nscope = \"global\"\nfail = \"closed\"\n{rest}"
    ));
    assert_eq!(
        (c.rate_limits[0].global, c.rate_limits[0].fail),
        (true, LimitFail::Closed)
    );
    let c = ok(&format!(
        "[[limit]]\nkey = \"client_ip\"\nrate = \"10/s\"\nscope = \"local\"\n{rest}"
    ));
    assert!(!c.rate_limits[0].global);
    for (t, why) in [
        ("rate = \"1/s\"\nscope = \"global\"", "add a [redis] table"),
        (
            "rate = \"1/s\"\nscope = \"fleet\"",
            "\"local\" or \"global\"",
        ),
        (
            "rate = \"1/s\"\nfail = \"closed\"",
            "applies to `scope = \"global\"`",
        ),
    ] {
        let e = errors(&format!("[[limit]]\nkey = \"client_ip\"\n{t}\n{rest}"));
        assert!(e.len() == 1 && e[0].contains(why), "{t}: {e:?}");
    }
    for (t, why) in [
        (
            "concurrent = 5\nscope = \"global\"",
            "applies to `rate` limits",
        ),
        (
            "rate = \"1/s\"\nscope = \"global\"\nfail = \"maybe\"",
            "\"open\" or \"closed\"",
        ),
    ] {
        let e = errors(&format!(
            "{redis}[[limit]]\nkey = \"client_ip\"\n{t}\n{rest}"
        ));
        assert!(e.len() == 1 && e[0].contains(why), "{t}: {e:?}");
    }
}

#[test]
fn listener_tls_mistakes() {
    let e = errors(&tls_file("", ""));
    assert!(
        e.len() == 1 && e[0].contains("needs a certificate"),
        "{e:?}"
    );
    one_error(
        &tls_file("cert = \"a\"", ""),
        "5:8",
        "`cert` and `key` go together",
    );
    one_error(
        &tls_file("cert = \"a\"\nkey = \"b\"\nmin_version = \"1.1\"", ""),
        "7:15",
        "expected \"1.2\" or \"1.3\"",
    );
    one_error(
        &tls_file("cert = \"a\"\nkey = \"b\"\nclient_auth = \"optional\"", ""),
        "7:15",
        "needs `client_ca`",
    );
    one_error(
        &tls_file("cert = \"a\"\nkey = \"b\"\nalpn = [\"h2\", \"h3\"]", ""),
        "7:15",
        "expected \"h2\" or \"http/1.1\"",
    );
    let redirect_on_tls = tls_file("cert = \"a\"\nkey = \"b\"", "").replace(
        "listen = \"127.0.0.1:0\"\n",
        "listen = \"127.0.0.1:0\"\nredirect_https = 301\n",
    );
    one_error(&redirect_on_tls, "4:18", "redirect https to itself");
}

#[test]
fn redirect_https_and_upstream_tls() {
    let text = format!(
        "[[listener]]\nlisten = \"127.0.0.1:0\"\nredirect_https = 308\nhttps_port = 8443\n{TLS_TAIL}[upstream.app.tls]\nserver_name = \"Api.Example\"\nca = \"/ca.pem\"\ncert = \"c.pem\"\nkey = \"c.key\"\n"
    );
    let c = ok(&text);
    assert_eq!(
        c.listeners[0].redirect_https,
        Some(HttpsRedirect {
            status: 308,
            port: Some(8443)
        })
    );
    let t = c.upstreams["app"].tls.as_ref().unwrap();
    assert_eq!(t.server_name.as_deref(), Some("api.example"));
    assert!(t.verify && t.session_resumption);
    assert_eq!(t.ca, Some(std::path::PathBuf::from("/ca.pem")));
    assert!(t.client_cert.as_ref().unwrap().key.ends_with("c.key"));
    one_error(
        &text.replace("redirect_https = 308", "redirect_https = 303"),
        "3:18",
        "301, 302, 307 or 308",
    );
    one_error(
        &text.replace("key = \"c.key\"\n", ""),
        "13:8",
        "go together",
    );
    // Quick mode origins.
    let o = parse_origin("https://127.0.0.1").unwrap();
    assert_eq!(
        (o.addrs[0], o.tls, o.name),
        (addr("127.0.0.1:443"), true, None)
    );
    let o = parse_origin("http://localhost:8080/").unwrap();
    assert_eq!((o.addrs[0], o.tls), (addr("127.0.0.1:8080"), false));
    assert_eq!(o.name.as_deref(), Some("localhost"));
    assert!(parse_origin("ftp://127.0.0.1:21").is_err());
    assert!(parse_origin("https://127.0.0.1/path").is_err());
    let c = Config::quick_with(
        addr("127.0.0.1:0"),
        vec![parse_origin("https://localhost:9443").unwrap()],
        None,
        None,
        None,
    )
    .unwrap();
    let t = c.upstreams["default"].tls.as_ref().unwrap();
    assert_eq!(t.server_name.as_deref(), Some("localhost"));
    // https origins: HTTP/2 or HTTP/1.1 by their ALPN answer.
    assert_eq!(c.upstreams["default"].protocol, UpstreamProtocol::Auto);
}

#[test]
fn quick_mode_http2_schemes_and_flags() {
    let o = parse_origin("h2c://127.0.0.1:50051").unwrap();
    assert_eq!(
        (o.addrs[0], o.tls, o.h2c),
        (addr("127.0.0.1:50051"), false, true)
    );
    assert_eq!(
        parse_origin("H2C://127.0.0.1").unwrap().addrs[0],
        addr("127.0.0.1:80")
    );
    assert!(!parse_origin("127.0.0.1:80").unwrap().h2c);
    let quick = |to: &[&str]| {
        Config::quick_with(
            addr("127.0.0.1:0"),
            to.iter().map(|t| parse_origin(t).unwrap()).collect(),
            None,
            None,
            None,
        )
    };
    let mut c = quick(&["h2c://127.0.0.1:50051", "h2c://127.0.0.1:50052"]).unwrap();
    assert_eq!(c.upstreams["default"].protocol, UpstreamProtocol::H2c);
    assert!(c.upstreams["default"].tls.is_none());
    c.enable_quick_http2(true, true).unwrap();
    assert!(c.listeners[0].h2c && !c.listeners[0].h2c_only);
    assert!(c.routes[0].grpc_web);
    // Mixed schemes are refused: one upstream speaks one protocol.
    assert!(quick(&["h2c://127.0.0.1:1", "127.0.0.1:2"]).is_err());
    assert!(quick(&["https://127.0.0.1:1", "h2c://127.0.0.1:2"]).is_err());
    // gRPC-web needs an HTTP/2 origin.
    let mut c = quick(&["127.0.0.1:3000"]).unwrap();
    assert_eq!(c.upstreams["default"].protocol, UpstreamProtocol::Http1);
    let e = c.enable_quick_http2(false, true).unwrap_err();
    assert!(e.contains("h2c://"), "{e}");
    assert!(!c.routes[0].grpc_web);
    // A TLS listener offers h2 by ALPN; --h2c is for cleartext ones.
    let mut c = Config::quick_with(
        addr("127.0.0.1:0"),
        vec![parse_origin("127.0.0.1:3000").unwrap()],
        None,
        Some(CertFiles {
            cert: "c.pem".into(),
            key: "k.pem".into(),
        }),
        None,
    )
    .unwrap();
    assert_eq!(
        c.listeners[0].tls.as_ref().unwrap().alpn,
        vec!["h2".to_string(), "http/1.1".to_string()]
    );
    assert!(c.enable_quick_http2(true, false).is_err());
}

#[test]
fn analytics_and_admin_credentials() {
    let c = ok(BASE);
    assert!(c.analytics.enabled && c.analytics.path.is_none() && c.analytics.kafka.is_none());
    assert_eq!(c.admin_auth, AdminAuth::default());
    let c = ok(&format!(
        "{BASE}[admin]\nlisten = \"127.0.0.1:0\"\ntoken = \"s3cret-token\"\nuser = \"ops\"\npassword = \"pw\"\n\
         [analytics]\npath = \"/var/lib/pier/a.db\"\nkeep_minutes = \"1h\"\nmax_keys = 10\n\
         [analytics.kafka]\nbrokers = [\"127.0.0.1:9092\"]\ncompression = \"zstd\"\nlinger = \"5ms\"\n"
    ));
    assert_eq!(c.admin_auth.token.as_deref(), Some("s3cret-token"));
    assert_eq!(c.admin_auth.basic, Some(("ops".into(), "pw".into())));
    assert_eq!(
        c.analytics.path.as_deref(),
        Some(std::path::Path::new("/var/lib/pier/a.db"))
    );
    assert_eq!(c.analytics.keep_minutes, Duration::from_secs(3600));
    assert_eq!(c.analytics.max_keys, 10);
    let k = c.analytics.kafka.expect("kafka");
    assert_eq!(
        (
            k.brokers,
            k.topic.as_str(),
            k.compression.as_str(),
            k.linger
        ),
        (
            vec!["127.0.0.1:9092".to_string()],
            "pier-events",
            "zstd",
            Duration::from_millis(5)
        )
    );
    one_error(
        &format!("{BASE}[admin]\nlisten = \"127.0.0.1:0\"\ntoken = \"short\"\n"),
        "10:9",
        "at least 8 characters",
    );
    one_error(
        &format!("{BASE}[admin]\nlisten = \"127.0.0.1:0\"\ntoken = \"long enough; x\"\n"),
        "10:9",
        "visible ASCII",
    );
    one_error(
        &format!("{BASE}[admin]\nlisten = \"127.0.0.1:0\"\nuser = \"ops\"\n"),
        "9:10",
        "go together",
    );
    // Issue 31: an admin endpoint off loopback must ask for credentials;
    // the error names the key.
    one_error(
        &format!("{BASE}[admin]\nlisten = \"0.0.0.0:9901\"\n"),
        "9:10",
        "set `[admin] token`",
    );
    one_error(
        &format!("{BASE}[admin]\nlisten = \"[::]:9901\"\n"),
        "9:10",
        "not on a loopback address",
    );
    let c = ok(&format!(
        "{BASE}[admin]\nlisten = \"0.0.0.0:9901\"\ntoken = \"s3cret-token\"\nhosts = [\"Admin.Example.\"]\n"
    ));
    assert_eq!(c.admin_auth.hosts, vec!["admin.example".to_string()]);
    ok(&format!("{BASE}[admin]\nlisten = \"[::1]:0\"\n"));
    one_error(
        &format!("{BASE}[admin]\nlisten = \"127.0.0.1:0\"\nhosts = [\"a.example:80\"]\n"),
        "10:10",
        "`hosts` lists host names",
    );
    one_error(
        &format!("{BASE}[analytics]\nmax_keys = 0\n"),
        "9:12",
        "`max_keys` must be between",
    );
    one_error(
        &format!("{BASE}[analytics.kafka]\nbrokers = [\"b:1\"]\ncompression = \"brotli\"\n"),
        "10:15",
        "`compression` must be",
    );
}

// === HTTP/2 keys (issue 10) ===

#[test]
fn h2c_only_and_protocol_auto() {
    let only = ok(&BASE.replace(
        "listen = \"127.0.0.1:0\"\n",
        "listen = \"127.0.0.1:0\"\nh2c = \"only\"\n",
    ));
    assert!(only.listeners[0].h2c && only.listeners[0].h2c_only);
    let both = ok(&BASE.replace(
        "listen = \"127.0.0.1:0\"\n",
        "listen = \"127.0.0.1:0\"\nh2c = true\n",
    ));
    assert!(both.listeners[0].h2c && !both.listeners[0].h2c_only);
    one_error(
        &BASE.replace(
            "listen = \"127.0.0.1:0\"\n",
            "listen = \"127.0.0.1:0\"\nh2c = \"sometimes\"\n",
        ),
        "2:10",
        "h2c = \"sometimes\": expected true, false or \"only\"",
    );
    let auto = ok(
        &format!("{BASE}protocol = \"auto\"\n[upstream.b.tls]\nverify = false\n")
            .replace("\n\nprotocol", "\nprotocol"),
    );
    assert_eq!(auto.upstreams["b"].protocol, UpstreamProtocol::Auto);
    one_error(
        &format!("{BASE}protocol = \"auto\"\n").replace("\n\nprotocol", "\nprotocol"),
        "7:12",
        "protocol = \"auto\" picks HTTP/2 or HTTP/1.1 by ALPN over TLS",
    );
}

#[test]
fn cache_zone_disk_tier_keys() {
    let base = "[[listener]]\nlisten = \"127.0.0.1:8080\"\n[[route]]\nupstream = \"u\"\n[upstream.u]\nservers = [\"127.0.0.1:1\"]\n";
    let c = ok(&format!(
        "{base}[cache.a]\nmemory = \"64m\"\n[cache.b]\nmemory = \"64m\"\ndisk_dir = \"d\"\n[cache.c]\nmemory = \"1m\"\ndisk_dir = \"/x\"\ndisk = \"2g\"\npromote_hits = 0\ndisk_min_ttl = \"0s\"\ndisk_queue = 8\n"
    ));
    assert_eq!(c.caches[0].disk, None);
    let b = c.caches[1].disk.as_ref().unwrap();
    // Relative to the config file's directory.
    assert!(b.dir.ends_with("d"), "{:?}", b.dir);
    assert_eq!(
        (b.max_bytes, b.promote_hits, b.min_ttl, b.queue),
        (1 << 30, 2, Duration::from_secs(60), 256)
    );
    let d = c.caches[2].disk.as_ref().unwrap();
    assert_eq!(
        (
            d.dir.as_path(),
            d.max_bytes,
            d.promote_hits,
            d.min_ttl,
            d.queue
        ),
        (std::path::Path::new("/x"), 2 << 30, 0, Duration::ZERO, 8)
    );
    let errs = errors(&format!(
        "{base}[cache.a]\nmemory = \"1m\"\ndisk = \"2g\"\n"
    ));
    assert!(
        errs.iter().any(|e| e.contains("`disk` needs `disk_dir`")),
        "{errs:?}"
    );
    let errs = errors(&format!(
        "{base}[cache.a]\nmemory = \"1m\"\ndisk_dir = \"/x\"\ndisk_queue = 0\ndisk_min_ttl = \"soon\"\n"
    ));
    assert!(errs.iter().any(|e| e.contains("disk_queue")), "{errs:?}");
    assert!(errs.iter().any(|e| e.contains("disk_min_ttl")), "{errs:?}");
}

/// `max_variants`: Vary variants per key, 32 unless set, 1 to 1024.
#[test]
fn cache_zone_max_variants() {
    let base = "[[listener]]\nlisten = \"127.0.0.1:8080\"\n[[route]]\nupstream = \"u\"\n[upstream.u]\nservers = [\"127.0.0.1:1\"]\n";
    let c = ok(&format!(
        "{base}[cache.a]\nmemory = \"1m\"\n[cache.b]\nmemory = \"1m\"\nmax_variants = 4\n"
    ));
    assert_eq!(
        (c.caches[0].max_variants, c.caches[1].max_variants),
        (32, 4)
    );
    for bad in ["0", "1025"] {
        let errs = errors(&format!(
            "{base}[cache.a]\nmemory = \"1m\"\nmax_variants = {bad}\n"
        ));
        assert!(errs.iter().any(|e| e.contains("max_variants")), "{errs:?}");
    }
}

#[test]
fn max_buffered_body_bytes() {
    assert_eq!(ok(BASE).limits.max_buffered_body_bytes, 1024 * 1024);
    let c = ok(&format!(
        "{BASE}[limits]\nmax_buffered_body_bytes = \"8m\"\n"
    ));
    assert_eq!(c.limits.max_buffered_body_bytes, 8 * 1024 * 1024);
    one_error(
        &format!("{BASE}[limits]\nmax_buffered_body_bytes = 100\n"),
        "9:27",
        "at least 1024 bytes",
    );
}

#[test]
fn route_cache_set_cookie() {
    let text = |v: &str| {
        format!(
            "[[listener]]\nlisten = \"127.0.0.1:0\"\n[cache.c]\nmemory = \"1m\"\n\
             [[route]]\nupstream = \"u\"\n[route.cache]\nzone = \"c\"\n{v}\n\
             [upstream.u]\nservers = [\"127.0.0.1:1\"]\n"
        )
    };
    let store = |c: &Config| c.routes[0].cache.as_ref().unwrap().store_set_cookie;
    assert!(!store(&ok(&text(""))));
    assert!(!store(&ok(&text("set_cookie = \"pass\""))));
    assert!(store(&ok(&text("set_cookie = \"store\""))));
    one_error(
        &text("set_cookie = \"strip\""),
        "9:14",
        "cache set_cookie \"strip\": \"pass\" or \"store\"",
    );
}

#[test]
fn http3_needs_a_tls_listener() {
    one_error(
        "[[listener]]\nlisten = \"127.0.0.1:0\"\nhttp3 = true\n[[route]]\nupstream = \"b\"\n[upstream.b]\nservers = [\"127.0.0.1:9000\"]\n",
        "3:9",
        "`http3` needs TLS",
    );
    let c = load_str(
        "[[listener]]\nlisten = \"127.0.0.1:0\"\nhttp3 = false\n[[route]]\nupstream = \"b\"\n[upstream.b]\nservers = [\"127.0.0.1:9000\"]\n",
        "t.toml",
    )
    .unwrap();
    assert!(!c.listeners[0].http3);
}

#[test]
fn quic_early_data_needs_http3_a_session_cache_and_no_client_certificates() {
    let listener = |keys: &str, tls: &str| {
        tls_file(&format!("cert = \"a\"\nkey = \"b\"\n{tls}"), "").replace(
            "listen = \"127.0.0.1:0\"\n",
            &format!("listen = \"127.0.0.1:0\"\n{keys}"),
        )
    };
    let c = ok(&listener("http3 = true\nquic_early_data = true\n", ""));
    assert!(c.listeners[0].quic_early_data);
    assert!(!ok(&listener("http3 = true\n", "")).listeners[0].quic_early_data);
    one_error(
        &listener("quic_early_data = true\n", ""),
        "4:19",
        "`quic_early_data` is for listeners with `http3 = true`",
    );
    one_error(
        &listener(
            "http3 = true\nquic_early_data = true\n",
            "session_cache = 0",
        ),
        "5:19",
        "needs `session_cache` > 0",
    );
    one_error(
        &listener(
            "http3 = true\nquic_early_data = true\n",
            "client_ca = \"ca.pem\"",
        ),
        "5:19",
        "with client certificates",
    );
}

#[test]
fn proxy_protocol_needs_trusted_proxies() {
    let text = |keys: &str| {
        format!(
            "[[listener]]\nlisten = \"127.0.0.1:0\"\n{keys}[[route]]\nupstream = \"b\"\n[upstream.b]\nservers = [\"127.0.0.1:9000\"]\n"
        )
    };
    let c = ok(&text(
        "proxy_protocol = true\ntrusted_proxies = [\"10.0.0.0/8\"]\n",
    ));
    assert!(c.listeners[0].proxy_protocol);
    assert!(!ok(&text("")).listeners[0].proxy_protocol);
    one_error(
        &text("proxy_protocol = true\n"),
        "3:18",
        "`proxy_protocol` needs `trusted_proxies`",
    );
}

#[test]
fn real_ip_header_needs_trusted_proxies_and_a_known_header() {
    let text = |keys: &str| {
        format!(
            "[[listener]]\nlisten = \"127.0.0.1:0\"\n{keys}[[route]]\nupstream = \"b\"\n[upstream.b]\nservers = [\"127.0.0.1:9000\"]\n"
        )
    };
    let trusted = "trusted_proxies = [\"10.0.0.0/8\"]\n";
    let c = ok(&text(&format!(
        "real_ip_header = \"x-forwarded-for\"\n{trusted}"
    )));
    assert_eq!(
        c.listeners[0].real_ip_header,
        Some(RealIpHeader::XForwardedFor)
    );
    let c = ok(&text(&format!("real_ip_header = \"Forwarded\"\n{trusted}")));
    assert_eq!(c.listeners[0].real_ip_header, Some(RealIpHeader::Forwarded));
    assert_eq!(ok(&text("")).listeners[0].real_ip_header, None);
    one_error(
        &text("real_ip_header = \"X-Forwarded-For\"\n"),
        "3:18",
        "`real_ip_header` needs `trusted_proxies`",
    );
    one_error(
        &text(&format!("real_ip_header = \"X-Real-IP\"\n{trusted}")),
        "3:18",
        "\"X-Forwarded-For\" or \"Forwarded\"",
    );
}

#[test]
fn upgrade_socket_and_send_proxy_protocol() {
    let c = ok(BASE);
    assert_eq!(c.upgrade_socket, None);
    assert_eq!(c.upstreams["b"].send_proxy_protocol, None);
    let c = ok(&format!(
        "[server]\nupgrade_socket = \"/run/pier/upgrade.sock\"\n{BASE}send_proxy_protocol = \"v2\"\n"
    ));
    assert_eq!(
        c.upgrade_socket.as_deref(),
        Some(std::path::Path::new("/run/pier/upgrade.sock"))
    );
    assert_eq!(c.upstreams["b"].send_proxy_protocol, Some(SendProxy::V2));
    let c = ok(&format!("{BASE}send_proxy_protocol = \"v1\"\n"));
    assert_eq!(c.upstreams["b"].send_proxy_protocol, Some(SendProxy::V1));
    let c = ok(&format!("{BASE}send_proxy_protocol = \"off\"\n"));
    assert_eq!(c.upstreams["b"].send_proxy_protocol, None);
    one_error(
        &format!("{BASE}send_proxy_protocol = \"v3\"\n"),
        "8:23",
        "unknown send_proxy_protocol \"v3\"",
    );
}

#[test]
fn http2_hpack_dynamic_table_is_off_unless_asked_for() {
    assert!(!ok(BASE).http2.hpack_dynamic_table);
    let on = format!("{BASE}\n[http2]\nhpack_dynamic_table = true\n");
    assert!(ok(&on).http2.hpack_dynamic_table);
    let bad = format!("{BASE}\n[http2]\nhpack_dynamic_table = \"yes\"\n");
    assert!(!errors(&bad).is_empty());
}
