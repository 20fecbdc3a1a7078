//! The command line: `check`, `--version`, `--help`, clear failures (missing file, port
//! in use), and quick mode `pier proxy --listen … --to …`.

mod common;

use std::process::{Command, Output};
use std::time::Duration;

use common::*;

fn run(args: &[&str]) -> Output {
    run_with_timeout(Command::new(bin()).args(args), Duration::from_secs(20))
}

fn text(o: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

/// Whether `out` has a `FILE:LINE:COL: …` line for this file and line.
fn has_location(out: &str, file: &str, line: u32) -> bool {
    let prefix = format!("{file}:{line}:");
    out.lines().any(|l| {
        l.find(&prefix).is_some_and(|i| {
            let rest = &l[i + prefix.len()..];
            let digits = rest.chars().take_while(|c| c.is_ascii_digit()).count();
            digits > 0 && rest[digits..].starts_with(':')
        })
    })
}

const GOOD: &str = r#"[admin]
listen = "127.0.0.1:0"

[[listener]]
name = "main"
listen = "127.0.0.1:0"

[[route]]
upstream = "app"

[upstream.app]
servers = ["127.0.0.1:9", { addr = "127.0.0.1:10", weight = 2 }]
"#;

#[test]
fn check_accepts_a_good_config() {
    let dir = TempDir::new();
    let path = dir.write("good.toml", GOOD);
    let out = run(&["check", "-c", path.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out));
}

#[test]
fn check_reports_every_error_with_its_location() {
    let dir = TempDir::new();
    let bad = r#"[[listener]]
name = "main"
listen = "127.0.0.1:99999"

[[route]]
upstream = "app"

[upstream.app]
servers = ["127.0.0.1:80"]
balance = "fastest"
"#;
    let path = dir.write("bad.toml", bad);
    let p = path.to_str().unwrap();
    let out = run(&["check", "-c", p]);
    let t = text(&out);
    assert_eq!(out.status.code(), Some(1), "{t}");
    assert!(
        has_location(&t, "bad.toml", 3),
        "no bad.toml:3:COL: line in:\n{t}"
    );
    assert!(
        has_location(&t, "bad.toml", 10),
        "no bad.toml:10:COL: line in:\n{t}"
    );
}

#[test]
fn check_prints_one_error_per_line() {
    let dir = TempDir::new();
    let path = dir.write(
        "one.toml",
        "[[listener]]\nname = \"main\"\nlisten = \"127.0.0.1:99999\"\n",
    );
    let out = run(&["check", "-c", path.to_str().unwrap()]);
    let t = text(&out);
    let loc = t
        .lines()
        .find(|l| l.contains("one.toml:3:"))
        .unwrap_or_else(|| panic!("no error line:\n{t}"));
    assert!(
        loc.starts_with(path.to_str().unwrap()),
        "the error line does not start with the file: {loc:?}"
    );
    assert!(!loc.contains("pier:"), "two messages on one line: {loc:?}");
}

#[test]
fn check_reports_a_toml_syntax_error_with_its_location() {
    let dir = TempDir::new();
    let path = dir.write(
        "syntax.toml",
        "[[listener]]\nname = \"main\"\nlisten = \"127.0.0.1:0\n",
    );
    let out = run(&["check", "-c", path.to_str().unwrap()]);
    let t = text(&out);
    assert_eq!(out.status.code(), Some(1), "{t}");
    assert!(has_location(&t, "syntax.toml", 3), "{t}");
}

#[test]
fn version_and_help() {
    let out = run(&["--version"]);
    assert!(out.status.success(), "{}", text(&out));
    let t = text(&out);
    assert!(
        t.contains("pier") && t.contains(env!("CARGO_PKG_VERSION")),
        "{t}"
    );

    let out = run(&["--help"]);
    assert!(out.status.success(), "{}", text(&out));
    let t = text(&out);
    for cmd in ["serve", "proxy", "check"] {
        assert!(t.contains(cmd), "--help does not mention {cmd}:\n{t}");
    }
}

#[test]
fn unknown_subcommand_fails() {
    let out = run(&["frobnicate"]);
    assert!(!out.status.success(), "{}", text(&out));
}

#[test]
fn missing_config_file_is_named() {
    let dir = TempDir::new();
    let missing = dir.path().join("does-not-exist.toml");
    let m = missing.to_str().unwrap();
    for args in [vec!["serve", "-c", m], vec!["check", "-c", m]] {
        let out = run(&args);
        let t = text(&out);
        assert!(
            !out.status.success() && out.status.code().is_some(),
            "{args:?}: {t}"
        );
        assert!(
            t.contains("does-not-exist.toml"),
            "{args:?}: message does not name the file:\n{t}"
        );
    }
}

#[test]
fn port_in_use_is_reported() {
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = taken.local_addr().unwrap();
    let dir = TempDir::new();
    let cfg = GOOD.replacen(
        "name = \"main\"\nlisten = \"127.0.0.1:0\"",
        &format!("name = \"main\"\nlisten = \"{addr}\""),
        1,
    );
    assert!(cfg.contains(&addr.to_string()));
    let path = dir.write("busy.toml", &cfg);
    let out = run(&["serve", "-c", path.to_str().unwrap()]);
    let t = text(&out);
    assert!(
        !out.status.success() && out.status.code().is_some(),
        "pier did not fail on a port in use: {t}"
    );
    assert!(
        t.contains(&addr.to_string()),
        "the address is not named:\n{t}"
    );
    assert!(
        t.to_lowercase().contains("in use"),
        "not said to be in use:\n{t}"
    );
    drop(taken);
}

#[test]
fn quick_mode_balances_and_fails_over() {
    let a = Origin::start_named("alpha");
    let b = Origin::start_named("beta");
    let to = format!("{},{}", a.addr(), b.addr());
    let p = PierProcess::start_args(
        bin(),
        &[
            "proxy",
            "--listen",
            "127.0.0.1:0",
            "--to",
            &to,
            "--admin",
            "127.0.0.1:0",
        ],
    );
    let addr = p.listener("main");
    let names: Vec<String> = (0..10).map(|_| get(addr, "/name").body_str()).collect();
    assert!(
        names.iter().any(|n| n == "alpha") && names.iter().any(|n| n == "beta"),
        "{names:?}"
    );
    assert_eq!(get(p.admin(), "/healthz").status, 200);
    b.stop();
    for _ in 0..10 {
        let r = get(addr, "/name");
        assert_eq!((r.status, r.body_str().as_str()), (200, "alpha"));
    }
}

#[test]
fn quick_mode_without_admin() {
    let a = Origin::start_named("alpha");
    let to = a.addr().to_string();
    let p = PierProcess::start_args(bin(), &["proxy", "--listen", "127.0.0.1:0", "--to", &to]);
    assert_eq!(get(p.listener("main"), "/hello").body, b"hello world\n");
}

#[test]
fn default_config_proxies_to_the_demo_origin() {
    let dir = TempDir::new();
    let db = dir
        .path()
        .join("analytics.db")
        .to_string_lossy()
        .into_owned();
    let p = PierProcess::launch_env(
        bin(),
        None,
        &["serve"],
        &[
            ("PIER_LISTEN", "127.0.0.1:0"),
            ("PIER_ADMIN", "127.0.0.1:0"),
            ("PIER_DEMO_PORT", "0"),
            ("PIER_ANALYTICS_DB", &db),
        ],
    )
    .unwrap_or_else(|e| panic!("{e}"));
    let r = get(p.listener("main"), "/");
    assert_eq!(r.status, 200, "{:?} {}", r.headers, r.body_str());
    assert_eq!(get(p.admin(), "/healthz").status, 200);
    // It tells the newcomer what it did and what to do next.
    let logs = p.logs();
    assert!(logs.contains(&p.listener("main").to_string()), "{logs}");
    assert!(logs.contains("pier proxy"), "{logs}");
}
