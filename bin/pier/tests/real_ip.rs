//! The real client address (`[[listener]] real_ip_header`, issue 35 item
//! 3): behind trusted proxies the client is the right-most address of
//! X-Forwarded-For or Forwarded that is not one of them, as nginx's
//! `real_ip_header` + `set_real_ip_from` + `real_ip_recursive on`. Limits,
//! logs, Lua and the forwarding headers see it; the proxy stays visible
//! as the peer.

mod common;

use common::*;
use std::net::SocketAddr;
use std::time::Duration;

/// The listener believing `header` from `trusted`, with `/who` answering
/// Lua's view of the client; `top` sections before it.
fn config(origin: SocketAddr, header: &str, trusted: &str, top: &str) -> String {
    let who = hook(
        "content",
        "ngx.say(ngx.var.remote_addr, \" \", ngx.var.realip_remote_addr)",
    );
    base_config(
        top,
        &format!(
            "{}[[route]]\nname = \"all\"\nupstream = \"app\"\n\n[upstream.app]\nservers = [\"{origin}\"]\n",
            lua_route("who", "/who", "", &who)
        ),
    )
    .replace(
        "name = \"main\"\nlisten = \"127.0.0.1:0\"\n",
        &format!(
            "name = \"main\"\nlisten = \"127.0.0.1:0\"\nreal_ip_header = \"{header}\"\ntrusted_proxies = [{trusted}]\n"
        ),
    )
}

fn get(p: &PierProcess, path: &str, headers: &[(&str, &str)]) -> Response {
    let mut c = RawConn::connect(p.listener("main"));
    c.request("GET", path, headers, b"").unwrap()
}

/// What the origin saw as X-Forwarded-For.
fn origin_xff(p: &PierProcess, headers: &[(&str, &str)]) -> String {
    let seen = get(p, "/headers", headers).body_str().to_ascii_lowercase();
    seen.lines()
        .find_map(|l| l.strip_prefix("x-forwarded-for: ").map(str::to_string))
        .unwrap_or_default()
}

#[test]
fn x_forwarded_for_names_the_right_most_untrusted_address() {
    let o = Origin::start();
    let dir = TempDir::new();
    let log = dir.path().join("access.log");
    let p = pier(
        &config(
            o.addr(),
            "X-Forwarded-For",
            "\"127.0.0.1/32\", \"10.0.0.0/8\"",
            "",
        )
        .replace(
            "access = \"off\"",
            &format!("access = \"{}\"", log.display()),
        ),
    );
    // A client wrote 198.51.100.1 itself; its proxies appended the rest.
    let xff = [("X-Forwarded-For", "198.51.100.1, 203.0.113.9, 10.1.2.3")];
    assert_eq!(get(&p, "/who", &xff).body_str(), "203.0.113.9 127.0.0.1\n");
    // The chain goes on with the hop Pier heard from, not the client again.
    assert_eq!(
        origin_xff(&p, &xff),
        "198.51.100.1, 203.0.113.9, 10.1.2.3, 127.0.0.1"
    );
    // Every address trusted: the left-most. Over two header lines, too.
    let two = [
        ("X-Forwarded-For", "10.9.9.9"),
        ("X-Forwarded-For", "10.0.0.1, 10.0.0.2"),
    ];
    assert_eq!(get(&p, "/who", &two).body_str(), "10.9.9.9 127.0.0.1\n");
    // Something that is not an address ends the search.
    let odd = [("X-Forwarded-For", "203.0.113.1, unknown, 10.0.0.2")];
    assert_eq!(get(&p, "/who", &odd).body_str(), "10.0.0.2 127.0.0.1\n");
    // Without the header the peer is the client.
    assert_eq!(get(&p, "/who", &[]).body_str(), "127.0.0.1 127.0.0.1\n");

    // The access log's client is the named one; the proxy is `peer`.
    let ok = wait_until(Duration::from_secs(10), || {
        std::fs::read_to_string(&log)
            .unwrap_or_default()
            .lines()
            .count()
            >= 5
    });
    assert!(ok);
    let text = std::fs::read_to_string(&log).unwrap();
    let first = text
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
        .find(|v| v["uri"] == "/headers")
        .unwrap();
    assert_eq!(first["client"], "203.0.113.9");
    assert!(
        first["peer"].as_str().unwrap().starts_with("127.0.0.1:"),
        "{first}"
    );
    let bare = text
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
        .find(|v| v["client"] == "127.0.0.1")
        .unwrap();
    assert!(bare.get("peer").is_none(), "{bare}");
}

#[test]
fn forwarded_for_names_the_client() {
    let o = Origin::start();
    let p = pier(&config(
        o.addr(),
        "Forwarded",
        "\"127.0.0.1/32\", \"10.0.0.0/8\"",
        "",
    ));
    let fwd = [(
        "Forwarded",
        "for=198.51.100.1, for=\"[2001:db8::7]:4711\";proto=https, for=10.1.2.3;by=10.0.0.9",
    )];
    assert_eq!(get(&p, "/who", &fwd).body_str(), "2001:db8::7 127.0.0.1\n");
    // An obfuscated identifier (RFC 7239 §6.3) ends the search.
    let hidden = [("Forwarded", "for=203.0.113.1, for=_hidden, for=10.1.2.3")];
    assert_eq!(get(&p, "/who", &hidden).body_str(), "10.1.2.3 127.0.0.1\n");
}

#[test]
fn an_untrusted_peer_is_its_own_client() {
    let o = Origin::start();
    let p = pier(&config(o.addr(), "X-Forwarded-For", "\"10.0.0.0/8\"", ""));
    let xff = [("X-Forwarded-For", "203.0.113.9")];
    assert_eq!(get(&p, "/who", &xff).body_str(), "127.0.0.1 127.0.0.1\n");
    // And what it sent is replaced, as before.
    assert_eq!(origin_xff(&p, &xff), "127.0.0.1");
}

/// A rate limit keyed by `client_ip` counts the clients the proxies name.
#[test]
fn limits_count_the_named_client() {
    let o = Origin::start();
    let p = pier(&config(
        o.addr(),
        "X-Forwarded-For",
        "\"127.0.0.1/32\"",
        "[[limit]]\nname = \"per-client\"\nkey = \"client_ip\"\nrate = \"2/m\"\n",
    ));
    let a = [("X-Forwarded-For", "203.0.113.1")];
    let b = [("X-Forwarded-For", "203.0.113.2")];
    assert_eq!(get(&p, "/hello", &a).status, 200);
    assert_eq!(get(&p, "/hello", &a).status, 200);
    assert_eq!(get(&p, "/hello", &a).status, 429);
    assert_eq!(
        get(&p, "/hello", &b).status,
        200,
        "another client behind the same proxy"
    );
}

/// Pipelined requests on one connection: each is judged by its own
/// header, so one without it is the connection's peer again.
#[test]
fn each_request_names_its_own_client() {
    let o = Origin::start();
    let p = pier(&config(o.addr(), "X-Forwarded-For", "\"127.0.0.1/32\"", ""));
    let mut c = RawConn::connect(p.listener("main"));
    c.send(
        b"GET /who HTTP/1.1\r\nHost: a\r\nX-Forwarded-For: 203.0.113.5\r\n\r\n\
          GET /who HTTP/1.1\r\nHost: a\r\n\r\n",
    );
    assert_eq!(
        c.read_response().unwrap().body_str(),
        "203.0.113.5 127.0.0.1\n"
    );
    assert_eq!(
        c.read_response().unwrap().body_str(),
        "127.0.0.1 127.0.0.1\n"
    );
    // And after the pipeline, on the same connection.
    let r = c
        .request("GET", "/who", &[("X-Forwarded-For", "203.0.113.6")], b"")
        .unwrap();
    assert_eq!(r.body_str(), "203.0.113.6 127.0.0.1\n");
    assert_eq!(c.get("/who").unwrap().body_str(), "127.0.0.1 127.0.0.1\n");
}
