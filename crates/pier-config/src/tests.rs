//! Loader tests: whole files in, `Config` or `FILE:LINE:COL` errors out.

use super::*;

fn no_env(_: &str) -> Option<String> {
    None
}

#[test]
fn quickstart_parses_without_env() {
    let c = load_str_with_env(DEFAULT_CONFIG, "quickstart.toml", &no_env).unwrap();
    assert_eq!(c.listeners[0].addr, "127.0.0.1:8080".parse().unwrap());
    assert_eq!(c.admin, Some("127.0.0.1:9901".parse().unwrap()));
    assert_eq!(c.demo_origin, Some("127.0.0.1:9000".parse().unwrap()));
}
