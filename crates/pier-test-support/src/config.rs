//! Config text for test Piers: one listener `main` and an admin listener, both
//! on port 0.

use std::net::SocketAddr;

/// A config with one listener `main` and an admin listener (both on port 0), access log
/// off, two workers, and `body` appended (routes, upstreams, other sections).
pub fn base_config(top: &str, body: &str) -> String {
    format!(
        r#"[server]
workers = 2
grace_period = "5s"

[admin]
listen = "127.0.0.1:0"

[log]
access = "off"

{top}

[[listener]]
name = "main"
listen = "127.0.0.1:0"

{body}
"#
    )
}

/// A TOML array of server addresses: `["127.0.0.1:1", "127.0.0.1:2"]`.
pub fn servers(addrs: &[SocketAddr]) -> String {
    let list: Vec<String> = addrs.iter().map(|a| format!("\"{a}\"")).collect();
    format!("[{}]", list.join(", "))
}

/// One catch-all route to upstream `app` with these servers; `top` holds whole sections
/// (`[limits]`…), `upstream_extra` lines go under `[upstream.app]`.
pub fn simple_config(addrs: &[SocketAddr], top: &str, upstream_extra: &str) -> String {
    route_config(addrs, top, "", upstream_extra)
}

/// [`simple_config`] with `route_extra` lines under the route (`[route.cache]`…,
/// as the last lines of the route's tables).
pub fn route_config(
    addrs: &[SocketAddr],
    top: &str,
    route_extra: &str,
    upstream_extra: &str,
) -> String {
    base_config(
        top,
        &format!(
            r#"[[route]]
name = "default"
upstream = "app"
{route_extra}

[upstream.app]
servers = {}
{upstream_extra}
"#,
            servers(addrs)
        ),
    )
}

/// One `[[route]]` with its `[route.lua]` table: `upstream` may be empty (content-only
/// route), `hooks` is `phase = '''code'''` lines ([`hook`]).
pub fn lua_route(name: &str, path: &str, upstream: &str, hooks: &str) -> String {
    let up = if upstream.is_empty() {
        String::new()
    } else {
        format!("upstream = \"{upstream}\"\n")
    };
    format!("[[route]]\nname = \"{name}\"\npath = \"{path}\"\n{up}\n[route.lua]\n{hooks}\n\n")
}

/// `phase = '''code'''`: one hook of a `[route.lua]` table.
pub fn hook(phase: &str, code: &str) -> String {
    format!("{phase} = '''\n{code}\n'''\n")
}
