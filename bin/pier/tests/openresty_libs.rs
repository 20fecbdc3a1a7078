//! OpenResty's own Lua libraries, unchanged (Debian's packages, unpacked by .ci/install into
//! `PIER_LUA_LIBS`), running in Pier hooks through the `ngx` global: lua-resty-redis and
//! lua-resty-memcached against real servers the test starts, lua-resty-dns against a DNS
//! server in the test (UDP, and TCP after a truncated answer), lua-resty-lrucache (both
//! implementations), lua-resty-cookie, lua-resty-string's digests and AES, and ngx_lua's
//! phase rules. Every library is used as its README shows, under concurrency.
//!
//! `PIER_LUA_LIBS` unset or incomplete, or a server binary missing: the tests fail and say
//! what to install (`./test.sh` installs everything and runs them).

mod common;

use std::collections::{BTreeMap, HashMap};
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream, UdpSocket};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use common::*;

// ---------------------------------------------------------------- the libraries

/// Modules the tests require, relative to `PIER_LUA_LIBS`.
const LIB_FILES: &[&str] = &[
    "nginx/redis.lua",
    "nginx/memcached.lua",
    "nginx/dns/resolver.lua",
    "nginx/cookie.lua",
    "nginx/string.lua",
    "nginx/md5.lua",
    "nginx/sha1.lua",
    "nginx/sha256.lua",
    "nginx/aes.lua",
    "nginx/random.lua",
    "resty/lrucache.lua",
    "resty/lrucache/pureffi.lua",
];

/// The library directory. Panics, naming the install command, when `PIER_LUA_LIBS` is
/// unset or lacks a library: a test that passes without running proves nothing.
fn libs() -> PathBuf {
    let dir = std::env::var_os("PIER_LUA_LIBS").unwrap_or_else(|| {
        panic!(
            "PIER_LUA_LIBS is unset: run ./test.sh (it installs what the tests need), or \
             `bash .ci/install && source target/test-env.sh` before cargo test; by hand, \
             unpack Debian's lua-nginx-redis, -memcached, -dns, -cookie, -string and \
             lua-resty-lrucache and point PIER_LUA_LIBS at their usr/share/lua/5.1"
        )
    });
    let dir = PathBuf::from(dir);
    for f in LIB_FILES {
        assert!(
            dir.join(f).is_file(),
            "PIER_LUA_LIBS={} lacks {f}: the library install is broken \
             (rm -rf target/lualibs, then bash .ci/install)",
            dir.display()
        );
    }
    dir
}

/// `[lua]` with the libraries on `package.path`, plus `extra` lines (hooks, dicts).
fn lua_top(libs: &Path, extra: &str) -> String {
    format!(
        "[lua]\npackage_path = [\"{}/?.lua\"]\n{extra}\n",
        libs.display()
    )
}

/// A `[[route]]` with hooks; `upstream` may be empty (content-only route).
fn lua_route(name: &str, path: &str, upstream: &str, hooks: &str) -> String {
    let up = if upstream.is_empty() {
        String::new()
    } else {
        format!("upstream = \"{upstream}\"\n")
    };
    format!("[[route]]\nname = \"{name}\"\npath = \"{path}\"\n{up}\n[route.lua]\n{hooks}\n\n")
}

fn hook(phase: &str, code: &str) -> String {
    format!("{phase} = '''\n{code}\n'''\n")
}

/// `threads` client threads, each on its own keep-alive connection, each sending
/// `per_thread` requests built by `path(thread, i)`; returns every response (in order per
/// thread). Non-200 answers fail the test with their body.
fn run_clients(
    p: &PierProcess,
    threads: usize,
    per_thread: usize,
    path: impl Fn(usize, usize) -> String + Send + Sync + 'static,
) -> Vec<Vec<Response>> {
    let addr = p.listener("main");
    let path = Arc::new(path);
    let handles: Vec<_> = (0..threads)
        .map(|t| {
            let path = path.clone();
            std::thread::spawn(move || {
                let mut conn = RawConn::connect(addr);
                (0..per_thread)
                    .map(|i| {
                        let u = path(t, i);
                        let r = conn
                            .get(&u)
                            .unwrap_or_else(|e| panic!("thread {t} GET {u}: {e}"));
                        assert_eq!(r.status, 200, "GET {u}: {}", r.body_str());
                        r
                    })
                    .collect::<Vec<_>>()
            })
        })
        .collect();
    handles
        .into_iter()
        .map(|h| match h.join() {
            Ok(v) => v,
            Err(e) => std::panic::resume_unwind(e),
        })
        .collect()
}

// ---------------------------------------------------------------- servers

fn memcached_server() -> Server {
    Server::start(&server_bin("memcached"), |port| {
        // As root memcached refuses to start without naming a user (staying root here);
        // as anyone else it ignores `-u`.
        [
            "-l",
            "127.0.0.1",
            "-p",
            &port.to_string(),
            "-U",
            "0",
            "-u",
            "root",
        ]
        .map(String::from)
        .to_vec()
    })
}

/// One command to a Redis server on a new connection; the reply as text (integers and
/// simple strings as is, a bulk string's data, `(nil)`, `ERR ...` for errors).
fn redis_cmd(addr: SocketAddr, args: &[&str]) -> String {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let mut req = format!("*{}\r\n", args.len());
    for a in args {
        req.push_str(&format!("${}\r\n{a}\r\n", a.len()));
    }
    s.write_all(req.as_bytes()).unwrap();
    let mut r = BufReader::new(s);
    let mut line = String::new();
    r.read_line(&mut line).unwrap();
    let line = line.trim_end();
    let (kind, rest) = line.split_at(1);
    match kind {
        "+" | ":" => rest.to_string(),
        "-" => format!("ERR {rest}"),
        "$" => {
            let n: i64 = rest.parse().unwrap();
            if n < 0 {
                return "(nil)".into();
            }
            let mut b = vec![0; n as usize + 2];
            r.read_exact(&mut b).unwrap();
            b.truncate(n as usize);
            String::from_utf8_lossy(&b).into_owned()
        }
        _ => panic!("unexpected reply {line:?}"),
    }
}

/// A numeric field of `INFO` (`total_connections_received`, `connected_clients`).
fn redis_info(addr: SocketAddr, field: &str) -> u64 {
    let info = redis_cmd(addr, &["INFO"]);
    info.lines()
        .find_map(|l| l.strip_prefix(&format!("{field}:")))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or_else(|| panic!("no {field} in INFO:\n{info}"))
}

/// memcached's `stats` on a new connection.
fn memcached_stats(addr: SocketAddr) -> HashMap<String, String> {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    s.write_all(b"stats\r\n").unwrap();
    let mut r = BufReader::new(s);
    let mut out = HashMap::new();
    for _ in 0..1000 {
        let mut line = String::new();
        if r.read_line(&mut line).unwrap() == 0 || line.trim_end() == "END" {
            return out;
        }
        let mut it = line.split_whitespace();
        if let (Some("STAT"), Some(k), Some(v)) = (it.next(), it.next(), it.next()) {
            out.insert(k.to_string(), v.to_string());
        }
    }
    panic!("memcached stats did not end");
}

fn memcached_get(addr: SocketAddr, key: &str) -> Option<String> {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    s.write_all(format!("get {key}\r\n").as_bytes()).unwrap();
    let mut r = BufReader::new(s);
    let mut line = String::new();
    r.read_line(&mut line).unwrap();
    if line.trim_end() == "END" {
        return None;
    }
    let mut v = String::new();
    r.read_line(&mut v).unwrap();
    Some(v.trim_end().to_string())
}

// ---------------------------------------------------------------- lua-resty-redis

/// Connects `red` (lua-resty-redis) or answers 502 with the error.
const REDIS_CONNECT: &str = r#"
local redis = require "nginx.redis"
local red = redis:new()
red:set_timeout(3000)
local ok, err = red:connect("127.0.0.1", REDIS_PORT)
if not ok then
  ngx.status = 502
  ngx.say("failed to connect: ", err)
  return ngx.exit(502)
end
local function check(res, err, what)
  if not res then
    ngx.status = 500
    ngx.say(what or "redis", ": ", err)
    return ngx.exit(500)
  end
  return res
end
"#;

fn redis_routes(port: u16) -> String {
    let connect = REDIS_CONNECT.replace("REDIS_PORT", &port.to_string());
    let incr = format!(
        r#"{connect}
local n = check(red:incr("hits"))
local reused = red:get_reused_times()
check(red:set_keepalive(10000, 100))
ngx.header["x-reused"] = reused
ngx.say(n)"#
    );
    // Three commands in one round trip; the replies in order.
    let pipeline = format!(
        r#"{connect}
local id = ngx.req.get_uri_args().id
red:init_pipeline()
red:set("p:" .. id, "v" .. id)
red:get("p:" .. id)
red:incr("pipelined")
local res = check(red:commit_pipeline())
check(red:set_keepalive(10000, 100))
ngx.say(#res, " ", res[1], " ", res[2], " ", type(res[3]))"#
    );
    let multi = format!(
        r#"{connect}
local id = ngx.req.get_uri_args().id
local ok = check(red:multi())
local q1 = check(red:set("tx:" .. id, id))
local q2 = check(red:incr("tx_count"))
local ans = check(red:exec())
local missing = red:get("no-such-key")
check(red:set_keepalive(10000, 100))
ngx.say(ok, " ", q1, " ", q2, " ", ans[1], " ", type(ans[2]), " ", tostring(missing == ngx.null))"#
    );
    // Subscribes, then waits for one message (published by /redis/pub).
    let sub = format!(
        r#"{connect}
local res = check(red:subscribe("news"))
local msg = check(red:read_reply())
red:close()
ngx.say(res[1], " ", res[2], " ", res[3], " | ", msg[1], " ", msg[2], " ", msg[3])"#
    );
    let publish = format!(
        r#"{connect}
local n = check(red:publish("news", ngx.req.get_uri_args().msg))
check(red:set_keepalive(10000, 100))
ngx.say(n)"#
    );
    [
        ("incr", "/redis/incr", incr),
        ("pipeline", "/redis/pipeline", pipeline),
        ("multi", "/redis/multi", multi),
        ("sub", "/redis/sub", sub),
        ("pub", "/redis/pub", publish),
    ]
    .iter()
    .map(|(n, path, code)| lua_route(n, path, "", &hook("content", code)))
    .collect()
}

#[test]
fn resty_redis_incr_pipeline_transaction_pubsub_and_keepalive() {
    let libs = libs();
    let redis = redis_server();
    let p = pier(&base_config(
        &lua_top(&libs, ""),
        &redis_routes(redis.addr.port()),
    ));
    let conns_before = redis_info(redis.addr, "total_connections_received");

    // INCR from 4 client threads over both workers: every increment counted once.
    const THREADS: usize = 4;
    const PER_THREAD: usize = 50;
    let all = run_clients(&p, THREADS, PER_THREAD, |_, _| "/redis/incr".into());
    let mut values: Vec<u64> = all
        .iter()
        .flatten()
        .map(|r| r.body_str().trim().parse().unwrap())
        .collect();
    values.sort_unstable();
    let n = (THREADS * PER_THREAD) as u64;
    assert_eq!(values, (1..=n).collect::<Vec<_>>(), "each INCR once");
    assert_eq!(redis_cmd(redis.addr, &["GET", "hits"]), n.to_string());
    // set_keepalive: connections are reused, not opened per request. At most one per
    // concurrent request was ever needed (4), plus our own INFO/GET connections.
    let reused = all
        .iter()
        .flatten()
        .filter(|r| r.header("x-reused").is_some_and(|v| v != "0"))
        .count();
    assert!(
        reused as u64 >= n - 8,
        "only {reused} of {n} requests reused a connection"
    );
    let opened = redis_info(redis.addr, "total_connections_received") - conns_before;
    assert!(
        opened <= THREADS as u64 + 2 + 1,
        "{opened} connections to redis for {n} requests (pool not reused)"
    );
    // Pooled connections left open: no more than were ever concurrently needed (far
    // under pool size 100 × 2 workers), plus the INFO connection itself.
    let clients = redis_info(redis.addr, "connected_clients");
    assert!(clients <= THREADS as u64 + 1, "{clients} connected clients");

    // Pipelines and transactions, concurrently.
    let all = run_clients(&p, THREADS, 10, |t, i| {
        if i % 2 == 0 {
            format!("/redis/pipeline?id={t}-{i}")
        } else {
            format!("/redis/multi?id={t}-{i}")
        }
    });
    for (t, rs) in all.iter().enumerate() {
        for (i, r) in rs.iter().enumerate() {
            let want = if i % 2 == 0 {
                format!("3 OK v{t}-{i} number\n")
            } else {
                "OK QUEUED QUEUED OK number true\n".to_string()
            };
            assert_eq!(r.body_str(), want, "request {i} of thread {t}");
        }
    }
    assert_eq!(redis_cmd(redis.addr, &["GET", "pipelined"]), "20");
    assert_eq!(redis_cmd(redis.addr, &["GET", "tx_count"]), "20");
    assert_eq!(redis_cmd(redis.addr, &["GET", "tx:3-9"]), "3-9");

    // Pub/sub: one request subscribes and waits; others publish until it is subscribed.
    let addr = p.listener("main");
    let sub = std::thread::spawn(move || RawConn::connect(addr).get("/redis/sub"));
    let mut pubc = RawConn::connect(addr);
    let delivered = wait_until(Duration::from_secs(10), || {
        let r = pubc.get("/redis/pub?msg=hello").unwrap();
        assert_eq!(r.status, 200, "{}", r.body_str());
        r.body_str().trim() == "1"
    });
    assert!(delivered, "the subscriber never subscribed\n{}", p.logs());
    let r = sub.join().unwrap().unwrap();
    assert_eq!(r.status, 200, "{}", r.body_str());
    assert_eq!(r.body_str(), "subscribe news 1 | message news hello\n");
}

// ---------------------------------------------------------------- lua-resty-memcached

#[test]
fn resty_memcached_set_get_incr_delete_with_keepalive() {
    let libs = libs();
    let mc = memcached_server();
    let code = format!(
        r#"
local memcached = require "nginx.memcached"
local memc, err = memcached:new()
if not memc then return ngx.exit(500) end
memc:set_timeout(3000)
local ok, err = memc:connect("127.0.0.1", {port})
if not ok then
  ngx.status = 502
  ngx.say("failed to connect: ", err)
  return ngx.exit(502)
end
local id = ngx.req.get_uri_args().id
local key = "k" .. id
local ok, err = memc:set(key, "value " .. id, 60)
if not ok then ngx.say("set: ", err) return end
local v, flags, err = memc:get(key)
memc:add("counter", 0)
local n, err = memc:incr("counter", 1)
if not n then ngx.say("incr: ", err) return end
local ok, err = memc:delete(key)
local gone, _, gerr = memc:get(key)
local reused = memc:get_reused_times()
local ok, err = memc:set_keepalive(10000, 100)
if not ok then ngx.say("keepalive: ", err) return end
ngx.header["x-reused"] = reused
ngx.say(v, "|", flags, "|", type(n), "|", tostring(gone), "|", tostring(gerr))"#,
        port = mc.addr.port()
    );
    let p = pier(&base_config(
        &lua_top(&libs, ""),
        &lua_route("mc", "/mc", "", &hook("content", &code)),
    ));
    let before: u64 = memcached_stats(mc.addr)["total_connections"]
        .parse()
        .unwrap();
    const THREADS: usize = 4;
    const PER_THREAD: usize = 50;
    let all = run_clients(&p, THREADS, PER_THREAD, |t, i| format!("/mc?id={t}-{i}"));
    for (t, rs) in all.iter().enumerate() {
        for (i, r) in rs.iter().enumerate() {
            assert_eq!(
                r.body_str(),
                format!("value {t}-{i}|0|string|nil|nil\n"),
                "request {i} of thread {t}"
            );
        }
    }
    let n = THREADS * PER_THREAD;
    assert_eq!(memcached_get(mc.addr, "counter"), Some(n.to_string()));
    assert_eq!(memcached_get(mc.addr, "k0-0"), None, "deleted");
    let after: u64 = memcached_stats(mc.addr)["total_connections"]
        .parse()
        .unwrap();
    // This test's own connections: the two `get`s and the second `stats`.
    let opened = after - before - 3;
    assert!(
        opened <= THREADS as u64 + 1,
        "{opened} connections to memcached for {n} requests (pool not reused)"
    );
    let reused = all
        .iter()
        .flatten()
        .filter(|r| r.header("x-reused").is_some_and(|v| v != "0"))
        .count();
    assert!(
        reused >= n - 8,
        "only {reused} of {n} requests reused a connection"
    );
}

// ---------------------------------------------------------------- lua-resty-dns

/// A DNS server on 127.0.0.1 (UDP and TCP on one port): `svc.pier.test` A 127.0.0.42;
/// `big.pier.test` answers truncated (TC) over UDP and 127.0.0.43 over TCP; other names
/// NXDOMAIN. Counts the queries it answered per transport.
struct Dns {
    addr: SocketAddr,
    udp_queries: Arc<AtomicUsize>,
    tcp_queries: Arc<AtomicUsize>,
    stop: Arc<AtomicBool>,
}

impl Drop for Dns {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
    }
}

/// The answer to one query message, or None for a malformed one.
fn dns_answer(q: &[u8], tcp: bool) -> Option<Vec<u8>> {
    if q.len() < 12 {
        return None;
    }
    // The question: labels up to the root, then QTYPE and QCLASS.
    let mut i = 12;
    let mut labels = Vec::new();
    loop {
        let n = *q.get(i)? as usize;
        i += 1;
        if n == 0 {
            break;
        }
        if n > 63 {
            return None;
        }
        labels.push(String::from_utf8_lossy(q.get(i..i + n)?).to_ascii_lowercase());
        i += n;
    }
    let qtype = u16::from_be_bytes([*q.get(i)?, *q.get(i + 1)?]);
    let question = q.get(12..i + 4)?;
    let name = labels.join(".");
    let (addr, truncated, rcode) = match name.as_str() {
        "svc.pier.test" => (Some([127, 0, 0, 42]), false, 0),
        "big.pier.test" if tcp => (Some([127, 0, 0, 43]), false, 0),
        "big.pier.test" => (None, true, 0),
        _ => (None, false, 3),
    };
    let addr = addr.filter(|_| qtype == 1);
    let mut flags: u16 = 0x8180 | rcode; // QR, RD, RA
    if truncated {
        flags |= 0x0200;
    }
    let mut out = Vec::with_capacity(64);
    out.extend_from_slice(&q[0..2]);
    out.extend_from_slice(&flags.to_be_bytes());
    out.extend_from_slice(&1u16.to_be_bytes());
    out.extend_from_slice(&u16::from(addr.is_some()).to_be_bytes());
    out.extend_from_slice(&[0, 0, 0, 0]);
    out.extend_from_slice(question);
    if let Some(a) = addr {
        // Name: a pointer to the question's; type A, class IN, TTL 300, 4 bytes.
        out.extend_from_slice(&[0xC0, 12, 0, 1, 0, 1, 0, 0, 1, 44, 0, 4]);
        out.extend_from_slice(&a);
    }
    Some(out)
}

fn dns_server() -> Dns {
    // UDP on a free port, TCP on the same one (retry if TCP's is taken).
    let (udp, tcp) = (0..20)
        .find_map(|_| {
            let u = UdpSocket::bind("127.0.0.1:0").ok()?;
            let t = TcpListener::bind(u.local_addr().ok()?).ok()?;
            Some((u, t))
        })
        .expect("a port free for both UDP and TCP");
    let addr = udp.local_addr().unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let (uq, tq) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
    udp.set_read_timeout(Some(Duration::from_millis(100)))
        .unwrap();
    let (s, c) = (stop.clone(), uq.clone());
    std::thread::spawn(move || {
        let mut buf = [0u8; 4096];
        while !s.load(Ordering::SeqCst) {
            let Ok((n, from)) = udp.recv_from(&mut buf) else {
                continue;
            };
            if let Some(a) = dns_answer(&buf[..n], false) {
                c.fetch_add(1, Ordering::SeqCst);
                let _ = udp.send_to(&a, from);
            }
        }
    });
    tcp.set_nonblocking(true).unwrap();
    let (s, c) = (stop.clone(), tq.clone());
    std::thread::spawn(move || {
        while !s.load(Ordering::SeqCst) {
            let Ok((mut conn, _)) = tcp.accept() else {
                std::thread::sleep(Duration::from_millis(20));
                continue;
            };
            let c = c.clone();
            std::thread::spawn(move || -> std::io::Result<()> {
                conn.set_nonblocking(false)?;
                conn.set_read_timeout(Some(Duration::from_secs(5)))?;
                let mut len = [0u8; 2];
                conn.read_exact(&mut len)?;
                let mut q = vec![0; u16::from_be_bytes(len) as usize];
                conn.read_exact(&mut q)?;
                if let Some(a) = dns_answer(&q, true) {
                    c.fetch_add(1, Ordering::SeqCst);
                    conn.write_all(&(a.len() as u16).to_be_bytes())?;
                    conn.write_all(&a)?;
                }
                Ok(())
            });
        }
    });
    Dns {
        addr,
        udp_queries: uq,
        tcp_queries: tq,
        stop,
    }
}

#[test]
fn resty_dns_resolves_over_udp_and_falls_back_to_tcp() {
    let libs = libs();
    let dns = dns_server();
    let code = format!(
        r#"
local resolver = require "nginx.dns.resolver"
local r, err = resolver:new{{ nameservers = {{ {{"127.0.0.1", {port}}} }}, retrans = 3, timeout = 2000 }}
if not r then
  ngx.say("failed to instantiate the resolver: ", err)
  return
end
local answers, err = r:query(ngx.req.get_uri_args().name, {{ qtype = r.TYPE_A }})
if not answers then
  ngx.say("failed to query: ", err)
  return
end
if answers.errcode then
  ngx.say("server error ", answers.errcode, ": ", answers.errstr)
  return
end
for _, ans in ipairs(answers) do
  ngx.say(ans.name, " ", ans.address, " ", ans.type, " ", ans.ttl)
end"#,
        port = dns.addr.port()
    );
    let p = pier(&base_config(
        &lua_top(&libs, ""),
        &lua_route("dns", "/dns", "", &hook("content", &code)),
    ));
    let all = run_clients(&p, 4, 10, |_, i| match i % 3 {
        0 => "/dns?name=svc.pier.test".into(),
        1 => "/dns?name=big.pier.test".into(),
        _ => "/dns?name=nope.pier.test".into(),
    });
    for rs in &all {
        for (i, r) in rs.iter().enumerate() {
            let want = match i % 3 {
                0 => "svc.pier.test 127.0.0.42 1 300\n",
                1 => "big.pier.test 127.0.0.43 1 300\n",
                _ => "server error 3: name error\n",
            };
            assert_eq!(r.body_str(), want, "request {i}");
        }
    }
    // 40 UDP queries; the 12 truncated ones asked again over TCP.
    assert_eq!(dns.udp_queries.load(Ordering::SeqCst), 40);
    assert_eq!(dns.tcp_queries.load(Ordering::SeqCst), 12);
}

// ---------------------------------------------------------------- lua-resty-lrucache

/// `init` makes the caches (per Lua state, i.e. per worker); the hook at `/lruN/` (N: the
/// module's index; route paths are prefixes) runs `op` (set, get) on the small cache (2
/// items) or counts requests in the big one (`op=hit`).
fn lru_routes(modules: &[&str]) -> (String, String) {
    let mut init = String::from("LRU = {}\n");
    let mut routes = String::new();
    for (i, m) in modules.iter().enumerate() {
        init.push_str(&format!(
            r#"do
  local lrucache = require "{m}"
  local small, err = lrucache.new(2)
  if not small then error("failed to create the cache: " .. (err or "unknown")) end
  LRU["{m}"] = {{ small = small, big = assert(lrucache.new(1000)) }}
end
"#
        ));
        let code = format!(
            r#"
local c = LRU["{m}"]
local args = ngx.req.get_uri_args()
if args.op == "set" then
  c.small:set(args.k, args.v, tonumber(args.ttl))
  ngx.say("ok {m}")
elseif args.op == "get" then
  local v, stale = c.small:get(args.k)
  ngx.say(tostring(v), " ", tostring(stale))
elseif args.op == "hit" then
  local n = (c.big:get("hits") or 0) + 1
  c.big:set("hits", n)
  c.big:set("k" .. args.k, args.k)
  -- get returns the value, then the stale value and the flags: keep the first.
ngx.say(tostring(c.big), " ", n, " ", (c.big:get("k" .. args.k)))
end"#
        );
        routes.push_str(&lua_route(
            &format!("lru{i}"),
            &format!("/lru{i}/"),
            "",
            &hook("content", &code),
        ));
    }
    (hook("init", &init), routes)
}

#[test]
fn resty_lrucache_both_implementations_per_worker() {
    let libs = libs();
    let modules = ["resty.lrucache", "resty.lrucache.pureffi"];
    let (init, routes) = lru_routes(&modules);
    let p = pier(&base_config(&lua_top(&libs, &init), &routes));
    for (mi, m) in modules.into_iter().enumerate() {
        // One connection: one worker, one cache.
        let mut c = RawConn::connect(p.listener("main"));
        let mut q = |args: &str| {
            let r = c.get(&format!("/lru{mi}/?{args}")).unwrap();
            assert_eq!(r.status, 200, "{m} {args}: {}", r.body_str());
            r.body_str().trim().to_string()
        };
        let ok = format!("ok {m}");
        assert_eq!(q("op=set&k=a&v=1"), ok);
        assert_eq!(q("op=set&k=b&v=2"), ok);
        assert_eq!(q("op=get&k=a"), "1 nil", "{m}");
        // a was used last: c evicts b.
        assert_eq!(q("op=set&k=c&v=3"), ok);
        assert_eq!(q("op=get&k=b"), "nil nil", "{m}: b evicted");
        assert_eq!(q("op=get&k=a"), "1 nil", "{m}");
        assert_eq!(q("op=get&k=c"), "3 nil", "{m}");
        // A TTL (seconds, ngx.now's clock): present, then expired with the stale value.
        assert_eq!(q("op=set&k=t&v=tv&ttl=0.2"), ok);
        assert_eq!(q("op=get&k=t"), "tv nil", "{m}");
        let mut last = String::new();
        let expired = wait_until(Duration::from_secs(5), || {
            last = q("op=get&k=t");
            last != "tv nil"
        });
        assert!(expired, "{m}: the 0.2 s entry never expired");
        assert_eq!(
            last, "nil tv",
            "{m}: expired get returns nil and the stale value"
        );

        // Concurrent requests: each worker's cache counts exactly its own requests.
        let all = run_clients(&p, 4, 50, move |t, i| format!("/lru{mi}/?op=hit&k={t}x{i}"));
        let mut per_cache: BTreeMap<String, (u64, u64)> = BTreeMap::new();
        for (t, rs) in all.iter().enumerate() {
            for (i, r) in rs.iter().enumerate() {
                let body = r.body_str();
                let f: Vec<&str> = body.split_whitespace().collect();
                assert!(f.len() >= 3, "{body:?}");
                // tostring(cache), "table: 0x...": the table's address names the cache.
                let id = f[..f.len() - 2].join(" ");
                let n: u64 = f[f.len() - 2].parse().unwrap();
                assert_eq!(f[f.len() - 1], format!("{t}x{i}"));
                let e = per_cache.entry(id).or_default();
                e.0 += 1;
                e.1 = e.1.max(n);
            }
        }
        assert!(
            per_cache.len() <= 2,
            "{m}: more caches than worker states: {per_cache:?}"
        );
        for (id, (responses, max)) in &per_cache {
            assert_eq!(responses, max, "{m}: cache {id}; all: {per_cache:?}");
        }
    }
}

// ---------------------------------------------------------------- lua-resty-cookie

#[test]
fn resty_cookie_reads_request_cookies_and_sets_response_cookies() {
    let libs = libs();
    let o = Origin::start();
    let code = r#"
local ck = require "nginx.cookie"
local cookie, err = ck:new()
if not cookie then
  ngx.log(ngx.ERR, err)
  return ngx.exit(500)
end
local a, aerr = cookie:get("a")
local all, err = cookie:get_all()
local names = {}
if all then
  for k, v in pairs(all) do names[#names + 1] = k .. "=" .. v end
  table.sort(names)
end
local ok, err = cookie:set({ key = "session", value = "abc", path = "/",
                             httponly = true, max_age = 60 })
if not ok then ngx.say("set: ", err) return end
local ok, err = cookie:set({ key = "lang", value = "en" })
if not ok then ngx.say("set: ", err) return end
ngx.say(tostring(a), " ", tostring(aerr), " ", table.concat(names, ","))"#;
    // The common OpenResty pattern: a cookie added to the origin's response.
    let filter = r#"
local ck = require "nginx.cookie"
local cookie = ck:new()
assert(cookie:set({ key = "seen", value = cookie:get("visit") or "none" }))"#;
    let p = pier(&base_config(
        &lua_top(&libs, ""),
        &format!(
            "{}{}[upstream.app]\nservers = {}\n",
            lua_route("cookie", "/cookie", "", &hook("content", code)),
            lua_route("app", "/app/", "app", &hook("header_filter", filter)),
            servers(&[o.addr()])
        ),
    ));
    let addr = p.listener("main");
    let handles: Vec<_> = (0..4)
        .map(|t| {
            std::thread::spawn(move || {
                let mut c = RawConn::connect(addr);
                for i in 0..20 {
                    let b = format!("two{t}-{i}");
                    let cookie = format!("a=1; b={b}; c=x%20y");
                    let r = c
                        .request("GET", "/cookie", &[("Cookie", cookie.as_str())], b"")
                        .unwrap();
                    assert_eq!(r.status, 200, "{}", r.body_str());
                    assert_eq!(r.body_str(), format!("1 nil a=1,b={b},c=x%20y\n"));
                    assert_eq!(
                        r.header_all("set-cookie"),
                        ["session=abc; Max-Age=60; Path=/; HttpOnly", "lang=en"]
                    );
                    let visit = format!("visit={t}");
                    let r = c
                        .request("GET", "/app/hello", &[("Cookie", visit.as_str())], b"")
                        .unwrap();
                    assert_eq!((r.status, r.body_str().as_str()), (200, "hello world\n"));
                    assert_eq!(r.header_all("set-cookie"), [format!("seen={t}")]);
                }
            })
        })
        .collect();
    for h in handles {
        h.join().unwrap();
    }
    // No Cookie header: get says so, set still works.
    let r = RawConn::connect(addr).get("/cookie").unwrap();
    assert_eq!(r.status, 200, "{}", r.body_str());
    assert_eq!(
        r.body_str(),
        "nil no cookie found in the current request \n"
    );
    assert_eq!(r.header_all("set-cookie").len(), 2);
}

// ---------------------------------------------------------------- lua-resty-string

/// `openssl dgst -ALG` of `data`, as lowercase hex.
fn openssl_dgst(alg: &str, data: &[u8]) -> String {
    openssl(&["dgst", &format!("-{alg}"), "-r"], data)
        .split_whitespace()
        .next()
        .unwrap()
        .to_string()
}

fn openssl(args: &[&str], input: &[u8]) -> String {
    let mut child = Command::new("openssl")
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("openssl");
    child.stdin.take().unwrap().write_all(input).unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success(), "openssl {args:?}");
    String::from_utf8(out.stdout).unwrap()
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

#[test]
fn resty_string_digests_aes_and_random() {
    let libs = libs();
    // Digests of the query's `s`, fed in two updates; AES-128-CBC (the library's default,
    // key and IV from EVP_BytesToKey with MD5, 1 round) of `s` and back; random bytes.
    let code = r#"
local str = require "nginx.string"
local s = ngx.req.get_uri_args().s
local half = math.floor(#s / 2)
local out = {}
for _, name in ipairs({ "md5", "sha1", "sha256" }) do
  local d = require("nginx." .. name):new()
  assert(d:update(s:sub(1, half)))
  assert(d:update(s:sub(half + 1)))
  out[#out + 1] = name .. "=" .. str.to_hex(d:final())
end
local aes = require "nginx.aes"
local a = assert(aes:new("secret", "saltsalt"))
local enc = a:encrypt(s)
out[#out + 1] = "aes=" .. str.to_hex(enc)
out[#out + 1] = "back=" .. tostring(a:decrypt(enc) == s)
local random = require "nginx.random"
local r1, r2 = random.bytes(16), random.bytes(16, true)
out[#out + 1] = "random=" .. #r1 .. "," .. #r2 .. "," .. tostring(r1 ~= r2)
out[#out + 1] = "atoi=" .. str.atoi("12345")
ngx.say(table.concat(out, " "))"#;
    let p = pier(&base_config(
        &lua_top(&libs, ""),
        &lua_route("str", "/str", "", &hook("content", code)),
    ));
    let inputs: Vec<String> = (0..4)
        .map(|t| format!("pier-{t}-{}", "abcdefghij".repeat(t * 7 + 1)))
        .collect();
    let want: Vec<String> = inputs
        .iter()
        .map(|s| {
            let d = s.as_bytes();
            let enc_hex = hex(&openssl_enc_bytes(d));
            format!(
                "md5={} sha1={} sha256={} aes={enc_hex} back=true random=16,16,true atoi=12345\n",
                openssl_dgst("md5", d),
                openssl_dgst("sha1", d),
                openssl_dgst("sha256", d),
            )
        })
        .collect();
    let want = Arc::new(want);
    let w = want.clone();
    let inputs = Arc::new(inputs);
    let ins = inputs.clone();
    let all = run_clients(&p, 4, 10, move |t, _| format!("/str?s={}", ins[t]));
    for (t, rs) in all.iter().enumerate() {
        for r in rs {
            assert_eq!(r.body_str(), w[t], "input {:?}", inputs[t]);
        }
    }
}

/// The ciphertext `openssl enc -aes-128-cbc -md md5 -S saltsalt -pass pass:secret` makes
/// of `data`.
fn openssl_enc_bytes(data: &[u8]) -> Vec<u8> {
    let mut child = Command::new("openssl")
        .args([
            "enc",
            "-aes-128-cbc",
            "-md",
            "md5",
            "-S",
            &hex(b"saltsalt"),
            "-pass",
            "pass:secret",
        ])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("openssl");
    child.stdin.take().unwrap().write_all(data).unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success(), "openssl enc");
    // OpenSSL 1.1 writes a "Salted__" header and the salt before the ciphertext even with
    // an explicit -S; 3.x writes only the ciphertext.
    match out.stdout.strip_prefix(b"Salted__saltsalt") {
        Some(rest) => rest.to_vec(),
        None => out.stdout,
    }
}

// ---------------------------------------------------------------- phase rules

/// Waits (bounded) until Pier's output contains every one of `needles`.
#[track_caller]
fn wait_log(p: &PierProcess, needles: &[&str]) {
    let ok = wait_until(Duration::from_secs(5), || {
        let l = p.logs();
        needles.iter().all(|n| l.contains(n))
    });
    assert!(ok, "pier's log lacks {needles:?}:\n{}", p.logs());
}

#[test]
fn ngx_phase_rules_raise_api_disabled_errors() {
    let o = Origin::start();
    let routes = [
        // Caught: the message is ngx_lua's, word for word.
        lua_route(
            "caught",
            "/caught/",
            "app",
            &hook(
                "header_filter",
                "local ok, err = pcall(ngx.sleep, 0.001)\nngx.header[\"x-err\"] = tostring(ok) .. \" \" .. err",
            ),
        ),
        // Uncaught in header_filter: the request fails with 500.
        lua_route("hf", "/hf/", "app", &hook("header_filter", "ngx.sleep(0.001)")),
        // Uncaught in log: logged, the response (already sent) stands.
        lua_route("lg", "/lg/", "app", &hook("log", "local sock = ngx.socket.tcp()")),
    ]
    .concat();
    let p = pier(&base_config(
        "",
        &format!(
            "{routes}[upstream.app]\nservers = {}\n",
            servers(&[o.addr()])
        ),
    ));
    let addr = p.listener("main");
    for round in 0..3 {
        let r = RawConn::connect(addr).get("/caught/hello").unwrap();
        assert_eq!(r.status, 200, "round {round}");
        let err = r.header("x-err").unwrap_or_default();
        assert!(
            err.starts_with("false ")
                && err.contains("API disabled in the context of header_filter_by_lua*"),
            "round {round}: x-err {err:?}"
        );
        let r = RawConn::connect(addr).get("/hf/hello").unwrap();
        assert_eq!(r.status, 500, "round {round}: {}", r.body_str());
        let r = RawConn::connect(addr).get("/lg/hello").unwrap();
        assert_eq!((r.status, r.body_str().as_str()), (200, "hello world\n"));
    }
    wait_log(
        &p,
        &[
            "API disabled in the context of header_filter_by_lua*",
            "API disabled in the context of log_by_lua*",
        ],
    );
    // The workers go on: plain requests on both still succeed.
    let all = run_clients(&p, 4, 5, |_, _| "/lg/hello".into());
    assert!(all
        .iter()
        .flatten()
        .all(|r| r.body_str() == "hello world\n"));
}
