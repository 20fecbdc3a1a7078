//! Routing by host and path (prefix, exact, regex) in file order, several listeners,
//! and `${VAR}` expansion in the config file.

mod common;

use common::*;

fn name_of(p: &PierProcess, host: &str, path: &str) -> (u16, String) {
    let r = RawConn::connect(p.listener("main"))
        .request("GET", path, &[("host", host)], b"")
        .unwrap();
    (r.status, r.body_str())
}

#[test]
fn host_path_exact_and_regex_routes_in_file_order() {
    let names = ["by-host", "by-prefix", "by-exact", "by-regex", "fallback"];
    let os: Vec<Origin> = names.iter().map(|n| Origin::start_named(n)).collect();
    let mut body = String::new();
    for (i, (route, matcher)) in [
        ("host", "host = \"api.example.com\""),
        ("prefix", "path = \"/api\""),
        ("exact", "exact = \"/name\""),
        ("regex", "regex = '^/r[0-9]+/name$'"),
        ("fallback", ""),
    ]
    .iter()
    .enumerate()
    {
        body.push_str(&format!(
            "[[route]]\nname = \"{route}\"\n{matcher}\nupstream = \"u{i}\"\n\n"
        ));
    }
    for (i, o) in os.iter().enumerate() {
        body.push_str(&format!(
            "[upstream.u{i}]\nservers = [\"{}\"]\n\n",
            o.addr()
        ));
    }
    let p = pier(&base_config("", &body));
    let ok = |who: &str| (200u16, who.to_string());
    // Host wins over everything below it, whatever the path.
    assert_eq!(name_of(&p, "api.example.com", "/api/name"), ok("by-host"));
    assert_eq!(name_of(&p, "api.example.com:8080", "/name"), ok("by-host"));
    assert_eq!(name_of(&p, "API.Example.COM", "/name"), ok("by-host"));
    // Prefix.
    assert_eq!(name_of(&p, "other.test", "/api/name"), ok("by-prefix"));
    assert_eq!(
        name_of(&p, "other.test", "/api"),
        (404, "no such path\n".into())
    );
    // Exact: only that path (a query string does not count).
    assert_eq!(name_of(&p, "other.test", "/name"), ok("by-exact"));
    assert_eq!(name_of(&p, "other.test", "/name?x=1"), ok("by-exact"));
    assert_eq!(name_of(&p, "other.test", "/x/name"), ok("fallback"));
    // Regex.
    assert_eq!(name_of(&p, "other.test", "/r42/name"), ok("by-regex"));
    assert_eq!(name_of(&p, "other.test", "/r4x/name"), ok("fallback"));
    // Fallback.
    assert_eq!(name_of(&p, "other.test", "/zzz/name"), ok("fallback"));
    // Each request went where the route said and nowhere else.
    let counts: Vec<u64> = os.iter().map(|o| o.requests()).collect();
    assert_eq!(counts, vec![3, 2, 2, 1, 3]);
}

#[test]
fn several_listeners() {
    let o = Origin::start_named("alpha");
    let cfg = simple_config(&[o.addr()], "", "").replace(
        "[[listener]]\nname = \"main\"\nlisten = \"127.0.0.1:0\"",
        "[[listener]]\nname = \"main\"\nlisten = \"127.0.0.1:0\"\n\n[[listener]]\nname = \"alt\"\nlisten = \"127.0.0.1:0\"",
    );
    assert!(cfg.contains("\"alt\""));
    let p = pier(&cfg);
    assert_ne!(p.listener("main"), p.listener("alt"));
    assert_eq!(get(p.listener("main"), "/name").body, b"alpha");
    assert_eq!(get(p.listener("alt"), "/name").body, b"alpha");
}

#[test]
fn environment_variables_are_expanded() {
    let o = Origin::start_named("alpha");
    let cfg = simple_config(&[], "", "")
        .replace("servers = []", "servers = [\"${PIER_TEST_ORIGIN}\"]")
        .replace(
            "listen = \"127.0.0.1:0\"\n\n[[route]]",
            "listen = \"${PIER_TEST_UNSET_LISTEN:-127.0.0.1:0}\"\n\n[[route]]",
        );
    assert!(
        cfg.contains("${PIER_TEST_ORIGIN}") && cfg.contains(":-127.0.0.1:0}"),
        "{cfg}"
    );
    let origin = o.addr().to_string();
    let p = PierProcess::launch_env(
        bin(),
        Some(&cfg),
        &["serve", "-c", "{config}"],
        &[("PIER_TEST_ORIGIN", &origin)],
    )
    .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(get(p.listener("main"), "/name").body, b"alpha");
}
