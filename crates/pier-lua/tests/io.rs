//! Cosockets against a tiny Redis-protocol server, and pier.http against a
//! tiny HTTP/1.1 server, both on 127.0.0.1:0 in the test.

mod support;

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use pier_lua::{Flow, RequestCtx};
use support::*;

/// A RESP server: GET, SET, INCR, plus BLOB (raw bytes, then close) and
/// SLOW (never answers). Returns its port and the count of connections.
fn resp_server() -> (u16, Arc<AtomicUsize>) {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = l.local_addr().unwrap().port();
    let conns = Arc::new(AtomicUsize::new(0));
    let data: Arc<Mutex<HashMap<String, String>>> = Arc::default();
    let c2 = conns.clone();
    std::thread::spawn(move || {
        for s in l.incoming().take(50) {
            let Ok(s) = s else { continue };
            c2.fetch_add(1, Ordering::SeqCst);
            let data = data.clone();
            std::thread::spawn(move || serve_resp(s, data));
        }
    });
    (port, conns)
}

fn serve_resp(s: TcpStream, data: Arc<Mutex<HashMap<String, String>>>) {
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let mut w = s.try_clone().unwrap();
    let mut r = BufReader::new(s);
    loop {
        let mut line = String::new();
        if r.read_line(&mut line).unwrap_or(0) == 0 {
            return;
        }
        let n: usize = line.trim_end().strip_prefix('*').unwrap().parse().unwrap();
        let mut args = Vec::new();
        for _ in 0..n {
            line.clear();
            r.read_line(&mut line).unwrap();
            let len: usize = line.trim_end()[1..].parse().unwrap();
            let mut b = vec![0; len + 2];
            r.read_exact(&mut b).unwrap();
            b.truncate(len);
            args.push(String::from_utf8(b).unwrap());
        }
        let reply = match args[0].to_ascii_uppercase().as_str() {
            "SET" => {
                data.lock()
                    .unwrap()
                    .insert(args[1].clone(), args[2].clone());
                "+OK\r\n".to_owned()
            }
            "GET" => match data.lock().unwrap().get(&args[1]) {
                Some(v) => format!("${}\r\n{v}\r\n", v.len()),
                None => "$-1\r\n".to_owned(),
            },
            "INCR" => {
                let mut d = data.lock().unwrap();
                let v = d.get(&args[1]).map_or(0, |v| v.parse::<i64>().unwrap()) + 1;
                d.insert(args[1].clone(), v.to_string());
                format!(":{v}\r\n")
            }
            "BLOB" => {
                w.write_all(b"abc--END--rest of it").unwrap();
                return;
            }
            "SLOW" => {
                std::thread::sleep(Duration::from_millis(500));
                return;
            }
            _ => "-ERR unknown command\r\n".to_owned(),
        };
        w.write_all(reply.as_bytes()).unwrap();
    }
}

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
    local data = assert(sock:receive(n + 2))
    return data:sub(1, n)
  end
end
"#;

#[test]
fn cosocket_redis_get_set_incr_with_keepalive() {
    let (port, conns) = resp_server();
    let code = format!(
        r#"{REDIS_CLIENT}
        local sock = pier.socket.tcp()
        sock:settimeout(2000)
        assert(sock:connect("127.0.0.1", {port}))
        pier.resp.set_header("x-reused", sock:getreusedtimes())
        assert(cmd(sock, "SET", "greeting", "hello world") == "OK")
        assert(cmd(sock, "GET", "greeting") == "hello world")
        assert(cmd(sock, "GET", "missing") == nil)
        local n = assert(cmd(sock, "INCR", "visits"))
        local ok, err = cmd(sock, "NOPE")
        assert(ok == nil and err == "ERR unknown command", err)
        assert(sock:setkeepalive(10000, 10))
        pier.resp.set_header("x-visits", n)
        "#
    );
    let e = access_engine(&code);
    run(async {
        for i in 1..=3 {
            let mut v = TestView::default();
            e.access(0, &mut v, &mut RequestCtx::new()).await.unwrap();
            assert_eq!(v.resp("x-visits"), Some(i.to_string()));
            assert_eq!(v.resp("x-reused"), Some((i - 1).to_string()));
        }
    });
    assert_eq!(conns.load(Ordering::SeqCst), 1, "keepalive pool not reused");
}

#[test]
fn cosocket_receiveuntil_all_timeout_and_errors() {
    let (port, _) = resp_server();
    let code = format!(
        r#"
        local sock = pier.socket.tcp()
        assert(sock:connect("127.0.0.1", {port}))
        assert(sock:send("*1\r\n$4\r\nBLOB\r\n"))
        local reader = sock:receiveuntil("--END--")
        assert(reader() == "abc")
        local rest = sock:receive("*a")
        assert(rest == "rest of it", rest)
        local d, err = sock:receive(1)
        assert(d == nil and err == "closed", err)
        sock:close()

        local s2 = pier.socket.tcp()
        s2:settimeout(50)
        assert(s2:connect("127.0.0.1", {port}))
        assert(s2:send({{"*1\r\n", "$4\r\n", "SLOW\r\n"}}))
        local t0 = pier.now()
        local data, err, partial = s2:receive()
        assert(data == nil and err == "timeout" and partial == "", err)
        s2:close()

        -- A port nobody listens on.
        local l = pier.socket.tcp()
        local ok, err = l:connect("127.0.0.1", 1)
        assert(ok == nil and err == "connection refused", err)
        pier.exit(204)
        "#
    );
    let e = access_engine(&code);
    let flow = run(e.access(0, &mut TestView::default(), &mut RequestCtx::new())).unwrap();
    assert!(matches!(flow, Flow::Respond { status: 204, .. }));
}

/// An HTTP/1.1 server with keep-alive: `/echo` answers with the method,
/// path, `x-test` header and body size; `/chunked` with a chunked body.
fn http_server() -> (u16, Arc<AtomicUsize>) {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = l.local_addr().unwrap().port();
    let conns = Arc::new(AtomicUsize::new(0));
    let c2 = conns.clone();
    std::thread::spawn(move || {
        for s in l.incoming().take(50) {
            let Ok(s) = s else { continue };
            c2.fetch_add(1, Ordering::SeqCst);
            std::thread::spawn(move || serve_http(s));
        }
    });
    (port, conns)
}

fn serve_http(s: TcpStream) {
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let mut w = s.try_clone().unwrap();
    let mut r = BufReader::new(s);
    loop {
        let mut line = String::new();
        if r.read_line(&mut line).unwrap_or(0) == 0 {
            return;
        }
        let mut parts = line.split_whitespace();
        let (method, path) = (
            parts.next().unwrap().to_owned(),
            parts.next().unwrap().to_owned(),
        );
        let (mut len, mut xtest) = (0usize, String::new());
        loop {
            line.clear();
            r.read_line(&mut line).unwrap();
            if line == "\r\n" {
                break;
            }
            let (k, v) = line.trim_end().split_once(':').unwrap();
            match k.to_ascii_lowercase().as_str() {
                "content-length" => len = v.trim().parse().unwrap(),
                "x-test" => xtest = v.trim().to_owned(),
                _ => {}
            }
        }
        let mut body = vec![0; len];
        r.read_exact(&mut body).unwrap();
        if path == "/chunked" {
            w.write_all(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nX-A: 1\r\nX-A: 2\r\n\r\n5\r\nhello\r\n6;ext=1\r\n world\r\n0\r\n\r\n").unwrap();
            continue;
        }
        let out = format!("{method} {path} {xtest} {}", body.len());
        write!(
            w,
            "HTTP/1.1 201 Created\r\nContent-Length: {}\r\nContent-Type: text/plain\r\n\r\n{out}",
            out.len()
        )
        .unwrap();
    }
}

#[test]
fn http_request_keepalive_and_chunked() {
    let (port, conns) = http_server();
    let code = format!(
        r#"
        local res, err = pier.http.request{{ method = "POST", url = "http://127.0.0.1:{port}/echo?a=1",
            headers = {{ ["X-Test"] = "yes" }}, body = "12345", timeout = 2000 }}
        assert(res, err)
        assert(res.status == 201, res.status)
        assert(res.body == "POST /echo?a=1 yes 5", res.body)
        assert(res.headers["content-type"] == "text/plain")
        res = assert(pier.http.request{{ url = "http://127.0.0.1:{port}/chunked" }})
        assert(res.body == "hello world", res.body)
        assert(res.headers["x-a"][1] == "1" and res.headers["x-a"][2] == "2")
        res = assert(pier.http.request{{ url = "http://127.0.0.1:{port}" }})
        assert(res.body == "GET /  0", res.body)
        local r2, e2 = pier.http.request{{ url = "https://example.com/" }}
        assert(r2 == nil and e2:find("only http://"), e2)
        r2, e2 = pier.http.request{{ url = "http://127.0.0.1:1/" }}
        assert(r2 == nil and e2:find("connect"), e2)
        pier.say(res.status)
        "#
    );
    let e = engine(setup(pier_lua::RouteHooks {
        content: src("route t content", &code),
        ..Default::default()
    }));
    run(async {
        for _ in 0..2 {
            let flow = e
                .content(0, &mut TestView::default(), &mut RequestCtx::new())
                .await
                .unwrap();
            assert_eq!(
                flow,
                Flow::Respond {
                    status: 200,
                    headers: vec![],
                    body: "201\n".into()
                }
            );
        }
    });
    assert_eq!(
        conns.load(Ordering::SeqCst),
        1,
        "HTTP keep-alive not reused"
    );
}

/// A request's first four sockets are freed at its end, not by the collector
/// (they carry no finalizer); later ones are collected as soon as Lua lets
/// go of them.
#[test]
fn a_requests_first_sockets_wait_for_its_end_later_ones_are_collected() {
    let code = r#"
        local function slot(s) return s.id % 2^24 end
        local first, seen = {}, {}
        for i = 1, 4 do
          first[i] = pier.socket.tcp()
          seen[slot(first[i])] = true
          -- The second request: the first one's end freed its sockets,
          -- so it gets slots the first one had.
          if MAXSLOT then assert(slot(first[i]) <= MAXSLOT, "not freed at the request's end") end
        end
        first = nil
        collectgarbage()
        collectgarbage()
        local fifth = pier.socket.tcp()
        assert(not seen[slot(fifth)], "a first socket was collected")
        local was = slot(fifth)
        fifth = nil
        collectgarbage()
        collectgarbage()
        local last = pier.socket.tcp()
        assert(slot(last) == was, "the fifth socket was not collected")
        for k in pairs(seen) do MAXSLOT = math.max(MAXSLOT or 0, k, slot(last)) end
        "#;
    let e = access_engine(code);
    run(e.access(0, &mut TestView::default(), &mut RequestCtx::new())).unwrap();
    run(e.access(0, &mut TestView::default(), &mut RequestCtx::new())).unwrap();
}

#[test]
fn collected_sockets_free_their_slot() {
    let (port, conns) = resp_server();
    let code = format!(
        r#"
        -- A handle is generation * 2^24 + slot index.
        local function slot(s) return s.id % 2^24 end
        local max = -1
        for i = 1, 200 do
          local s = pier.socket.tcp()
          if slot(s) > max then max = slot(s) end
          if i % 50 == 0 then
            -- an open, never closed connection is closed by the collector too
            assert(s:connect("127.0.0.1", {port}))
          end
        end
        collectgarbage()
        collectgarbage()
        local s = pier.socket.tcp()
        assert(slot(s) <= max, "slot not reused")
        local before, handle = slot(s), s.id
        s = nil
        collectgarbage()
        collectgarbage()
        local again = pier.socket.tcp()
        -- Same slot, new generation: the old handle names nothing.
        assert(slot(again) == before and again.id ~= handle)
        "#
    );
    let e = access_engine(&code);
    run(e.access(0, &mut TestView::default(), &mut RequestCtx::new())).unwrap();
    // The server accepts asynchronously: wait (bounded) for the 4 accepts.
    let t0 = std::time::Instant::now();
    while conns.load(Ordering::SeqCst) < 4 && t0.elapsed() < Duration::from_secs(5) {
        std::thread::sleep(Duration::from_millis(5));
    }
    assert_eq!(conns.load(Ordering::SeqCst), 4);
}
