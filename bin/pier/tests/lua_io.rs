//! Non-blocking I/O from Lua hooks through a real Pier: cosockets talking RESP to a tiny
//! Redis-protocol server in the test (with keep-alive), `pier.http.request` against a
//! second origin, and `pier.sleep` suspending only its own request.

mod common;

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::*;

/// A Redis-protocol server on 127.0.0.1:0 handling GET, SET and INCR; returns its address
/// and the count of connections it accepted (at most 100, one thread each).
fn resp_server() -> (SocketAddr, Arc<AtomicUsize>) {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    let conns = Arc::new(AtomicUsize::new(0));
    let data: Arc<Mutex<HashMap<String, String>>> = Arc::default();
    let c2 = conns.clone();
    std::thread::spawn(move || {
        for s in l.incoming().take(100) {
            let Ok(s) = s else { continue };
            c2.fetch_add(1, Ordering::SeqCst);
            let data = data.clone();
            std::thread::spawn(move || {
                let _ = serve_resp(s, data);
            });
        }
    });
    (addr, conns)
}

fn serve_resp(s: TcpStream, data: Arc<Mutex<HashMap<String, String>>>) -> std::io::Result<()> {
    // Idle connections (Pier's keep-alive pool) are closed after a while.
    s.set_read_timeout(Some(Duration::from_secs(30)))?;
    let mut w = s.try_clone()?;
    let mut r = BufReader::new(s);
    loop {
        let mut line = String::new();
        if r.read_line(&mut line)? == 0 {
            return Ok(());
        }
        let bad = || std::io::Error::new(std::io::ErrorKind::InvalidData, "bad RESP");
        let n: usize = line
            .trim_end()
            .strip_prefix('*')
            .and_then(|n| n.parse().ok())
            .ok_or_else(bad)?;
        let mut args = Vec::with_capacity(n);
        for _ in 0..n {
            line.clear();
            r.read_line(&mut line)?;
            let len: usize = line
                .trim_end()
                .strip_prefix('$')
                .and_then(|n| n.parse().ok())
                .ok_or_else(bad)?;
            let mut b = vec![0; len + 2];
            r.read_exact(&mut b)?;
            b.truncate(len);
            args.push(String::from_utf8_lossy(&b).into_owned());
        }
        let reply = match args.first().map(|a| a.to_ascii_uppercase()).as_deref() {
            Some("SET") if args.len() == 3 => {
                data.lock()
                    .unwrap()
                    .insert(args[1].clone(), args[2].clone());
                "+OK\r\n".to_owned()
            }
            Some("GET") if args.len() == 2 => match data.lock().unwrap().get(&args[1]) {
                Some(v) => format!("${}\r\n{v}\r\n", v.len()),
                None => "$-1\r\n".to_owned(),
            },
            Some("INCR") if args.len() == 2 => {
                let mut d = data.lock().unwrap();
                match d.get(&args[1]).map_or(Ok(0), |v| v.parse::<i64>()) {
                    Ok(v) => {
                        d.insert(args[1].clone(), (v + 1).to_string());
                        format!(":{}\r\n", v + 1)
                    }
                    Err(_) => "-ERR value is not an integer\r\n".to_owned(),
                }
            }
            _ => "-ERR unknown command\r\n".to_owned(),
        };
        w.write_all(reply.as_bytes())?;
    }
}

/// A minimal Redis client in Lua, as user code would carry one.
const REDIS_CLIENT: &str = r#"
local function cmd(sock, ...)
  local args = { ... }
  local parts = { "*" .. #args .. "\r\n" }
  for _, a in ipairs(args) do
    a = tostring(a)
    parts[#parts + 1] = "$" .. #a .. "\r\n" .. a .. "\r\n"
  end
  local sent, err = sock:send(parts)
  if not sent then return nil, err end
  local line, err = sock:receive("*l")
  if not line then return nil, err end
  local p = line:sub(1, 1)
  if p == "+" then return line:sub(2) end
  if p == ":" then return tonumber(line:sub(2)) end
  if p == "-" then return nil, line:sub(2) end
  if p == "$" then
    local n = tonumber(line:sub(2))
    if n < 0 then return nil end
    local data, err = sock:receive(n + 2)
    if not data then return nil, err end
    return data:sub(1, n)
  end
  return nil, "bad reply " .. line
end
"#;

fn content_route(name: &str, path: &str, code: &str) -> String {
    format!("[[route]]\nname = \"{name}\"\npath = \"{path}\"\n\n[route.lua]\ncontent = '''\n{code}\n'''\n\n")
}

#[test]
fn cosocket_incr_against_a_redis_protocol_server_with_keepalive() {
    let (redis, conns) = resp_server();
    let code = format!(
        r#"{REDIS_CLIENT}
local sock = pier.socket.tcp()
sock:settimeout(2000)
local ok, err = sock:connect("127.0.0.1", {port})
if not ok then
  pier.exit(502, "connect: " .. tostring(err))
end
local reused = sock:getreusedtimes()
local key = pier.req.get_uri_args().key or "visits"
local n, err = cmd(sock, "INCR", key)
if not n then
  pier.exit(502, "incr: " .. tostring(err))
end
assert(cmd(sock, "SET", "last", key) == "OK")
assert(cmd(sock, "GET", "last") == key)
assert(sock:setkeepalive(10000, 16))
pier.resp.set_header("x-reused", reused)
pier.say(n)
"#,
        port = redis.port()
    );
    let p = pier(&base_config("", &content_route("redis", "/redis", &code)));

    // Sequential requests on one client connection: one worker thread, one pooled
    // connection to the server, reused every time after the first.
    let mut conn = RawConn::connect(p.listener("main"));
    for i in 1..=10 {
        let r = conn.get("/redis").unwrap();
        assert_eq!(r.status, 200, "{}", r.body_str());
        assert_eq!(r.body_str(), format!("{i}\n"));
        assert_eq!(r.header("x-reused"), Some((i - 1).to_string().as_str()));
    }
    assert_eq!(conns.load(Ordering::SeqCst), 1, "keep-alive pool not used");

    // Concurrent clients over both workers: every INCR counted, and the pool stays small
    // (pooled per worker thread; concurrent requests may each need one).
    let addr = p.listener("main");
    let handles: Vec<_> = (0..4)
        .map(|_| {
            std::thread::spawn(move || {
                let mut conn = RawConn::connect(addr);
                (0..25)
                    .map(|_| {
                        let r = conn.get("/redis?key=shared").unwrap();
                        assert_eq!(r.status, 200, "{}", r.body_str());
                        r.body_str().trim().parse::<u64>().unwrap()
                    })
                    .collect::<Vec<_>>()
            })
        })
        .collect();
    let mut all: Vec<u64> = handles
        .into_iter()
        .flat_map(|h| h.join().unwrap())
        .collect();
    all.sort_unstable();
    assert_eq!(all, (1..=100).collect::<Vec<u64>>(), "each INCR once");
    let c = conns.load(Ordering::SeqCst);
    assert!(
        c <= 1 + 4 * 2,
        "{c} connections to the server for 110 requests"
    );
}

#[test]
fn cosocket_errors_are_returned_to_lua() {
    let dead = dead_addr();
    let code = format!(
        r#"
local sock = pier.socket.tcp()
sock:settimeout(1000)
local ok, err = sock:connect("127.0.0.1", {port})
pier.say(tostring(ok), " ", tostring(err))
"#,
        port = dead.port()
    );
    let p = pier(&base_config("", &content_route("dead", "/dead", &code)));
    let r = RawConn::connect(p.listener("main")).get("/dead").unwrap();
    assert_eq!(r.status, 200);
    assert_eq!(r.body_str(), "nil connection refused\n");
}

#[test]
fn http_client_calls_a_second_origin() {
    let main = Origin::start_named("main-origin");
    let side = Origin::start_named("side");
    let code = format!(
        r#"
local r, err = pier.http.request{{ url = "http://{side}/name" }}
if not r then
  pier.exit(502, "http: " .. tostring(err))
end
pier.resp.set_header("x-sub-status", r.status)
pier.resp.set_header("x-sub-origin", r.headers["x-origin"])
local e = assert(pier.http.request{{
  method = "POST", url = "http://{side}/echo", body = "ping pong", timeout = 2000,
}})
local h = assert(pier.http.request{{ url = "http://{side}/headers", headers = {{ ["X-From"] = "lua" }} }})
local seen = h.body:lower()
pier.say(r.body, " ", e.status, " ", e.body, " ", seen:find("\r\nx-from: lua\r\n", 1, true) ~= nil,
  " ", seen:sub(1, 21))
"#,
        side = side.addr()
    );
    let routes = format!(
        "{}[[route]]\nname = \"main\"\npath = \"/\"\nupstream = \"app\"\n\n[upstream.app]\nservers = {}\n",
        content_route("sub", "/sub", &code),
        servers(&[main.addr()])
    );
    let p = pier(&base_config("", &routes));
    let mut conn = RawConn::connect(p.listener("main"));
    for _ in 0..5 {
        let r = conn.get("/sub").unwrap();
        assert_eq!(r.status, 200, "{}", r.body_str());
        assert_eq!(r.header("x-sub-status"), Some("200"));
        assert_eq!(r.header("x-sub-origin"), Some("side"));
        assert_eq!(
            r.body_str(),
            "side 200 ping pong true get /headers http/1.1\n"
        );
    }
    assert_eq!(side.requests(), 15);
    // Pooled: one worker thread, sequential calls, one connection.
    assert_eq!(
        side.connections(),
        1,
        "pier.http did not keep the connection"
    );
    // The route next to it still proxies to the main origin.
    let r = conn.get("/name").unwrap();
    assert_eq!(r.body_str(), "main-origin");
    assert_eq!(main.requests(), 1);

    // An origin that is gone: nil and an error, the hook answers.
    side.stop();
    let r = conn.get("/sub").unwrap();
    assert_eq!(r.status, 502, "{}", r.body_str());
    assert!(r.body_str().starts_with("http: "), "{}", r.body_str());
}

#[test]
fn sleep_suspends_only_its_request() {
    const N: usize = 8;
    // Long sleeps, so that no bound below depends on the machine's speed.
    let code = r#"
pier.sleep(5)
pier.say("slept")
"#;
    let fast = r#"
pier.say("fast")
"#;
    let p = pier(&base_config(
        "",
        &format!(
            "{}{}",
            content_route("sleep", "/sleep", code),
            content_route("fast", "/fast", fast)
        ),
    ));
    let addr = p.listener("main");
    let t0 = Instant::now();
    let handles: Vec<_> = (0..N)
        .map(|_| {
            std::thread::spawn(move || {
                let r = RawConn::connect(addr).get("/sleep").unwrap();
                assert_eq!(r.status, 200, "{}", r.body_str());
                assert_eq!(r.body_str(), "slept\n");
            })
        })
        .collect();
    // Every sleeping request is in its hook.
    assert!(
        wait_until(Duration::from_secs(5), || {
            p.metric_value("pier_active_requests").unwrap_or(0.0) >= N as f64
        }),
        "{N} sleeping requests never in flight together"
    );
    // While they sleep, other requests are served: the answer comes while
    // every sleeping one is still waiting.
    let r = RawConn::connect(addr).get("/fast").unwrap();
    assert_eq!(r.body_str(), "fast\n");
    let pending = handles.iter().filter(|h| !h.is_finished()).count();
    assert_eq!(pending, N, "a request waited behind sleeping hooks");
    for h in handles {
        h.join().unwrap();
    }
    let all = t0.elapsed();
    assert!(all >= Duration::from_secs(5), "{all:?}");
    // Blocking sleeps would take N * 5 s / 2 workers = 20 s.
    assert!(all < Duration::from_secs(15), "{N} sleeps took {all:?}");
}

/// Sends one RESP command to the server directly and returns the raw reply line(s).
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
    if let Some(n) = line.trim_end().strip_prefix('$') {
        let n: i64 = n.parse().unwrap();
        if n < 0 {
            return "nil".into();
        }
        let mut b = vec![0; n as usize + 2];
        r.read_exact(&mut b).unwrap();
        b.truncate(n as usize);
        return String::from_utf8(b).unwrap();
    }
    line.trim_end().to_string()
}

#[test]
fn access_hook_authorizes_against_redis() {
    let (redis, _) = resp_server();
    assert_eq!(redis_cmd(redis, &["SET", "token:abc", "alice"]), "+OK");
    let o = Origin::start();
    let access = format!(
        r#"{REDIS_CLIENT}
local auth = pier.req.get_header("Authorization") or ""
local token = auth:match("^Bearer (%w+)$")
if not token then
  pier.exit(401, "no token\n")
end
local sock = pier.socket.tcp()
sock:settimeout(2000)
assert(sock:connect("127.0.0.1", {port}))
local user, err = cmd(sock, "GET", "token:" .. token)
sock:setkeepalive(10000, 8)
if not user then
  pier.exit(403, "unknown token\n")
end
pier.req.set_header("x-user", user)
"#,
        port = redis.port()
    );
    let routes = format!(
        "[[route]]\nname = \"api\"\npath = \"/\"\nupstream = \"app\"\n\n[route.lua]\naccess = '''\n{access}\n'''\n\n[upstream.app]\nservers = {}\n",
        servers(&[o.addr()])
    );
    let p = pier(&base_config("", &routes));
    let mut conn = RawConn::connect(p.listener("main"));
    let r = conn.get("/headers").unwrap();
    assert_eq!((r.status, r.body_str().as_str()), (401, "no token\n"));
    let r = conn
        .request("GET", "/headers", &[("Authorization", "Bearer nope")], b"")
        .unwrap();
    assert_eq!((r.status, r.body_str().as_str()), (403, "unknown token\n"));
    assert_eq!(o.requests(), 0);
    let r = conn
        .request("GET", "/headers", &[("Authorization", "Bearer abc")], b"")
        .unwrap();
    assert_eq!(r.status, 200, "{}", r.body_str());
    assert!(
        r.body_str()
            .to_ascii_lowercase()
            .contains("\r\nx-user: alice\r\n"),
        "{}",
        r.body_str()
    );
}

#[test]
fn timer_callback_does_cosocket_io() {
    let (redis, _) = resp_server();
    let content = format!(
        r#"{REDIS_CLIENT}
local by = pier.req.get_uri_args().by
assert(pier.timer.at(0, function(premature, key)
  local sock = pier.socket.tcp()
  sock:settimeout(2000)
  assert(sock:connect("127.0.0.1", {port}))
  pier.sleep(0.01)
  assert(cmd(sock, "SET", key, "set by a timer in phase " .. pier.get_phase()))
  sock:close()
end, "timer:" .. by))
pier.say("scheduled")
"#,
        port = redis.port()
    );
    let p = pier(&base_config(
        "",
        &content_route("sched", "/sched", &content),
    ));
    let r = RawConn::connect(p.listener("main"))
        .get("/sched?by=one")
        .unwrap();
    assert_eq!(r.body_str(), "scheduled\n");
    let mut last = String::new();
    let ok = wait_until(Duration::from_secs(5), || {
        last = redis_cmd(redis, &["GET", "timer:one"]);
        last != "nil"
    });
    assert!(ok, "the timer never wrote to the server");
    assert_eq!(last, "set by a timer in phase timer");
}

#[test]
fn http_client_reads_large_chunked_bodies() {
    const N: usize = 200_000;
    let side = Origin::start_named("side");
    let content = format!(
        r#"
local r = assert(pier.http.request{{ url = "http://{side}/chunked/{N}" }})
local sum = 0
for i = 1, #r.body do
  sum = (sum * 31 + r.body:byte(i)) % 2147483647
end
pier.say(r.status, " ", #r.body, " ", sum)
"#,
        side = side.addr()
    );
    let p = pier(&base_config("", &content_route("big", "/big", &content)));
    let r = RawConn::connect(p.listener("main")).get("/big").unwrap();
    assert_eq!(r.status, 200, "{}", r.body_str());
    let sum = pattern(0, N)
        .iter()
        .fold(0u64, |s, &b| (s * 31 + b as u64) % 2_147_483_647);
    assert_eq!(r.body_str(), format!("200 {N} {sum}\n"));
}

#[test]
fn balancer_peer_that_refuses_is_a_502() {
    let a = Origin::start_named("alpha");
    let dead = dead_addr();
    let bal = format!(
        r#"
if pier.req.get_header("x-dead") then
  pier.balancer.set_peer("127.0.0.1", {dead_port})
  pier.balancer.set_retries(0)
end
"#,
        dead_port = dead.port()
    );
    let routes = format!(
        "[[route]]\nname = \"b\"\npath = \"/\"\nupstream = \"app\"\n\n[route.lua]\nbalancer = '''\n{bal}\n'''\n\n[upstream.app]\nservers = {}\n",
        servers(&[a.addr()])
    );
    let p = pier(&base_config("", &routes));
    let r = RawConn::connect(p.listener("main"))
        .request("GET", "/name", &[("x-dead", "1")], b"")
        .unwrap();
    assert_local(&r, 502, "upstream-connect");
    assert_eq!(
        a.requests(),
        0,
        "the hook's choice must not fall back silently"
    );
    let r = RawConn::connect(p.listener("main")).get("/name").unwrap();
    assert_eq!(r.body_str(), "alpha");
}

/// Requests whose hooks yield (pier.sleep) interleave on the same worker thread; each
/// must keep seeing its own request, headers and `pier.ctx` after every resume.
#[test]
fn yielding_hooks_keep_their_own_request_and_ctx() {
    let o = Origin::start();
    let access = r#"
local tag = pier.req.get_header("x-tag")
pier.ctx.tag = tag
pier.sleep(0.001 * (tonumber(tag:match("(%d+)$")) % 7))
pier.req.set_header("x-seen", pier.ctx.tag .. "/" .. pier.req.get_header("x-tag") .. "/" .. pier.var.request_uri)
"#;
    let bal = r#"
pier.sleep(0.002)
pier.ctx.bal = pier.req.get_header("x-tag")
"#;
    let hf = r#"
pier.resp.set_header("x-ctx", pier.ctx.tag .. "/" .. pier.ctx.bal)
"#;
    let routes = format!(
        "[[route]]\nname = \"y\"\npath = \"/\"\nupstream = \"app\"\n\n[route.lua]\naccess = '''\n{access}\n'''\nbalancer = '''\n{bal}\n'''\nheader_filter = '''\n{hf}\n'''\n\n[upstream.app]\nservers = {}\n",
        servers(&[o.addr()])
    );
    let p = pier(&base_config("", &routes));
    let addr = p.listener("main");
    let handles: Vec<_> = (0..6)
        .map(|t| {
            std::thread::spawn(move || {
                let mut conn = RawConn::connect(addr);
                for i in 0..25 {
                    let tag = format!("t{t}-{i}");
                    let path = format!("/headers?t={t}&i={i}");
                    let r = conn.request("GET", &path, &[("x-tag", &tag)], b"").unwrap();
                    assert_eq!(r.status, 200, "{}", r.body_str());
                    assert_eq!(r.header("x-ctx"), Some(format!("{tag}/{tag}").as_str()));
                    let want = format!("\r\nx-seen: {tag}/{tag}/{path}\r\n");
                    assert!(
                        r.body_str().to_ascii_lowercase().contains(&want),
                        "{want:?} not in {}",
                        r.body_str()
                    );
                }
            })
        })
        .collect();
    for h in handles {
        h.join().unwrap();
    }
    assert_eq!(o.requests(), 150);
}
