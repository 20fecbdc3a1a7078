//! The safety bounds of the Lua layer: cosocket handles (generation,
//! owning request, caps), the memory Lua can make Rust hold, and pier.http
//! on the proxy's HTTP/1 codec. Origins are threads on 127.0.0.1:0.

mod support;

use std::io::{Read, Write};
use std::net::TcpListener;
use std::sync::Arc;
use std::time::Duration;

use pier_lua::{LuaEngine, LuaLimits, RequestCtx, RouteHooks};
use support::*;

/// An origin answering up to `conns` connections with `reply` and closing.
/// With `read_request`, it first reads the request head (up to its blank
/// line); otherwise it writes at once.
fn origin(reply: Vec<u8>, conns: usize, read_request: bool) -> u16 {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = l.local_addr().unwrap().port();
    std::thread::spawn(move || {
        for s in l.incoming().take(conns) {
            let Ok(mut s) = s else { continue };
            let reply = reply.clone();
            std::thread::spawn(move || {
                s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
                if read_request {
                    let mut got = Vec::new();
                    let mut b = [0u8; 1024];
                    while !got.windows(4).any(|w| w == b"\r\n\r\n") {
                        match s.read(&mut b) {
                            Ok(0) | Err(_) => return,
                            Ok(n) => got.extend_from_slice(&b[..n]),
                        }
                    }
                }
                let _ = s.write_all(&reply);
                // Let the client read before the close (no RST on unread data).
                let _ = s.shutdown(std::net::Shutdown::Write);
                let mut sink = [0u8; 1024];
                while let Ok(n) = s.read(&mut sink) {
                    if n == 0 {
                        break;
                    }
                }
            });
        }
    });
    port
}

fn limited(code: &str, limits: LuaLimits) -> LuaEngine {
    LuaEngine::with_limits(
        Arc::new(setup(RouteHooks {
            access: src("route t access", code),
            ..Default::default()
        })),
        registry(&[("cache", 1 << 20)]),
        limits,
    )
    .unwrap()
}

/// Runs the access hook with `x-step: step` for request `ctx`.
async fn step(e: &LuaEngine, ctx: &mut RequestCtx, step: &str) -> Result<(), String> {
    let mut v = TestView::default();
    v.headers
        .push((b"x-step".to_vec(), step.as_bytes().to_vec()));
    e.access(0, &mut v, ctx)
        .await
        .map(|_| ())
        .map_err(|e| e.to_string())
}

const STEPS: &str = "local STEP = pier.req.get_header('x-step')\n";

// === cosockets ===

#[test]
fn a_stale_socket_handle_cannot_drive_the_slot_reused_by_another_request() {
    let port = origin(b"secret\n".to_vec(), 2, false);
    let e = access_engine(&format!(
        r#"{STEPS}
        if STEP == "a" then
            local s = pier.socket.tcp()
            assert(s:connect("127.0.0.1", {port}))
            STALE = s.id
        else
            collectgarbage()
            local s2 = pier.socket.tcp()
            -- The new socket took the old one's slot...
            assert(s2.id % 2^24 == STALE % 2^24, "slot not reused")
            assert(s2:connect("127.0.0.1", {port}))
            -- ...but the old handle does not reach it.
            local stale = setmetatable({{ id = STALE }}, getmetatable(s2))
            local ok, err = pcall(stale.receive, stale, "*l")
            assert(not ok, "stale handle read: " .. tostring(err))
            assert(tostring(err):find("bad socket", 1, true), tostring(err))
            assert(s2:receive("*l") == "secret")
        end
        "#
    ));
    run(async {
        step(&e, &mut RequestCtx::new(), "a").await.unwrap();
        step(&e, &mut RequestCtx::new(), "b").await.unwrap();
    });
}

#[test]
fn a_socket_cannot_be_used_from_another_request() {
    let port = origin(b"secret\n".to_vec(), 1, false);
    let e = access_engine(&format!(
        r#"{STEPS}
        if STEP == "a" then
            SOCK = pier.socket.tcp()
            assert(SOCK:connect("127.0.0.1", {port}))
        else
            local ok, err = pcall(SOCK.receive, SOCK, "*l")
            assert(not ok, "read another request's socket: " .. tostring(err))
            assert(tostring(err):find("bad request", 1, true), tostring(err))
        end
        "#
    ));
    run(async {
        // Request a is still alive (its ctx not dropped) while b runs.
        let mut a = RequestCtx::new();
        step(&e, &mut a, "a").await.unwrap();
        step(&e, &mut RequestCtx::new(), "b").await.unwrap();
        drop(a);
    });
}

#[test]
fn sockets_per_request_and_per_worker_are_capped() {
    let limits = LuaLimits {
        max_sockets_per_request: 2,
        max_sockets_per_worker: 3,
        ..LuaLimits::default()
    };
    let e = limited(
        &format!(
            r#"{STEPS}
            HELD = HELD or {{}}
            local mine = {{ pier.socket.tcp(), pier.socket.tcp() }}
            if STEP == "a" then
                HELD.a = mine
                local ok, err = pcall(pier.socket.tcp)
                assert(not ok and tostring(err):find("max_sockets_per_request", 1, true), tostring(err))
            elseif STEP == "b" then
                error("unreachable: the worker has 3 sockets at most")
            end
            "#
        ),
        limits,
    );
    let e2 = limited(
        &format!(
            r#"{STEPS}
            HELD = HELD or {{}}
            HELD[STEP] = pier.socket.tcp()
            local ok, err = pcall(pier.socket.tcp)
            if STEP == "b" then
                -- a holds 2, this request 1: the worker is full.
                assert(not ok and tostring(err):find("max_sockets_per_worker", 1, true), tostring(err))
            else
                assert(ok, tostring(err))
            end
            "#
        ),
        limits,
    );
    run(async {
        let mut a = RequestCtx::new();
        step(&e, &mut a, "a").await.unwrap();
        // Same thread, same slab: e2's requests see a's sockets.
        let mut b = RequestCtx::new();
        step(&e2, &mut b, "b").await.unwrap();
        // The request that held them ended: its sockets are freed.
        drop(a);
        drop(b);
        step(&e2, &mut RequestCtx::new(), "c").await.unwrap();
    });
}

// === memory bounds ===

#[test]
fn say_and_exit_bodies_are_bounded() {
    let e = limited(
        r#"
        local STEP = pier.req.get_header('x-step')
        if STEP == "say" then
            pier.say(string.rep("x", 600))
            pier.say(string.rep("x", 600))
        elseif STEP == "exit" then
            pier.exit(200, string.rep("x", 2000))
        elseif STEP == "ngxsay" then
            -- one string: ngx.say's classic C path (the newline counts)
            ngx.say(string.rep("x", 500))
            ngx.say(string.rep("x", 499))
        else
            pier.say(string.rep("x", 900))
        end
        "#,
        LuaLimits {
            max_response_body: 1000,
            ..LuaLimits::default()
        },
    );
    run(async {
        for s in ["say", "exit", "ngxsay"] {
            let err = step(&e, &mut RequestCtx::new(), s).await.unwrap_err();
            assert!(err.contains("max_response_body"), "{s}: {err}");
        }
        step(&e, &mut RequestCtx::new(), "ok").await.unwrap();
    });
}

#[test]
fn socket_receive_buffer_is_bounded() {
    let port = origin(vec![b'a'; 20_000], 3, false);
    let e = limited(
        &format!(
            r#"{STEPS}
            local s = pier.socket.tcp()
            assert(s:connect("127.0.0.1", {port}))
            if STEP == "line" then
                s:receive("*l")
            elseif STEP == "all" then
                s:receive("*a")
            else
                local it = s:receiveuntil("END")
                it()
            end
            "#
        ),
        LuaLimits {
            socket_buffer: 4096,
            ..LuaLimits::default()
        },
    );
    run(async {
        for s in ["line", "all", "until"] {
            let err = step(&e, &mut RequestCtx::new(), s).await.unwrap_err();
            assert!(err.contains("socket_buffer"), "{s}: {err}");
        }
    });
}

#[test]
fn socket_send_of_a_table_is_bounded() {
    let port = origin(b"x\n".to_vec(), 2, false);
    let e = limited(
        &format!(
            r#"{STEPS}
            local s = pier.socket.tcp()
            assert(s:connect("127.0.0.1", {port}))
            local piece = string.rep("a", 1000)
            local t = {{}}
            for i = 1, 5 do t[i] = piece end
            if STEP == "nested" then t = {{ t }} end
            s:send(t)
            "#
        ),
        LuaLimits {
            socket_buffer: 4096,
            ..LuaLimits::default()
        },
    );
    run(async {
        // A flat table (sent as one concatenation) and a nested one (piece
        // by piece): both over the bound.
        for s in ["flat", "nested"] {
            let err = step(&e, &mut RequestCtx::new(), s).await.unwrap_err();
            assert!(err.contains("socket_buffer"), "{s}: {err}");
        }
    });
}

#[test]
fn bad_socket_handles_are_refused() {
    let port = origin(b"x\n".to_vec(), 1, false);
    let e = access_engine(&format!(
        r#"
        local s = pier.socket.tcp()
        assert(s:connect("127.0.0.1", {port}))
        for _, id in ipairs {{ 0/0, -1, math.huge, 2^60, 1.5 }} do
            local bad = setmetatable({{ id = id }}, getmetatable(s))
            local ok, err = pcall(bad.receive, bad, "*l")
            assert(not ok and tostring(err):find("bad socket", 1, true), tostring(id) .. ": " .. tostring(err))
            ok, err = pcall(bad.send, bad, "x")
            assert(not ok and tostring(err):find("bad socket", 1, true), tostring(id) .. ": " .. tostring(err))
        end
        assert(s:receive("*l") == "x")
        "#
    ));
    run(async {
        e.access(0, &mut TestView::default(), &mut RequestCtx::new())
            .await
            .unwrap();
    });
}

#[test]
fn http_response_body_is_bounded() {
    let mut fixed = b"HTTP/1.1 200 OK\r\nContent-Length: 5000\r\n\r\n".to_vec();
    fixed.extend_from_slice(&[b'a'; 5000]);
    let mut chunked = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n".to_vec();
    for _ in 0..5 {
        chunked.extend_from_slice(b"3e8\r\n");
        chunked.extend_from_slice(&[b'b'; 1000]);
        chunked.extend_from_slice(b"\r\n");
    }
    chunked.extend_from_slice(b"0\r\n\r\n");
    let mut close = b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\n".to_vec();
    close.extend_from_slice(&[b'c'; 5000]);
    let ports = [
        origin(fixed, 1, true),
        origin(chunked, 1, true),
        origin(close, 1, true),
    ];
    let e = limited(
        r#"
        local url = "http://127.0.0.1:" .. pier.req.get_header("x-step") .. "/"
        local res, err = pier.http.request{ url = url }
        error("not refused: " .. tostring(res and #res.body) .. " bytes, " .. tostring(err))
        "#,
        LuaLimits {
            http_max_body: 1000,
            ..LuaLimits::default()
        },
    );
    run(async {
        for p in ports {
            let err = step(&e, &mut RequestCtx::new(), &p.to_string())
                .await
                .unwrap_err();
            assert!(err.contains("http_max_body"), "{p}: {err}");
        }
    });
}

// === pier.http on the codec ===

#[test]
fn http_rejects_a_bad_chunked_body() {
    let bad =
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhelloXX0\r\n\r\n".to_vec();
    let good =
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n".to_vec();
    let (bad, good) = (origin(bad, 1, true), origin(good, 1, true));
    let e = access_engine(&format!(
        r#"
        local res, err = pier.http.request{{ url = "http://127.0.0.1:{bad}/" }}
        assert(res == nil, "bad chunked body accepted: " .. tostring(res and res.body))
        assert(tostring(err):find("chunked", 1, true), tostring(err))
        res = assert(pier.http.request{{ url = "http://127.0.0.1:{good}/" }})
        assert(res.status == 200 and res.body == "hello", res.body)
        "#
    ));
    run(async {
        step(&e, &mut RequestCtx::new(), "").await.unwrap();
    });
}

#[test]
fn http_refuses_request_injection() {
    let port = origin(
        b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n".to_vec(),
        8,
        true,
    );
    let e = access_engine(&format!(
        r#"
        local base = "http://127.0.0.1:{port}"
        local function refused(opts, what)
            local ok, err = pcall(pier.http.request, opts)
            assert(not ok, what .. " was sent")
            assert(tostring(err):find("bad " .. what, 1, true), tostring(err))
        end
        refused({{ url = base .. "/a\r\nX-Evil: 1\r\n\r\nGET /b" }}, "path")
        refused({{ url = base .. "/a b" }}, "path")
        refused({{ url = base .. "/a\0b" }}, "path")
        refused({{ url = "http://exa\r\nmple/" }}, "host")
        refused({{ url = "http://exa mple/" }}, "host")
        refused({{ url = base .. "/", headers = {{ ["x-a"] = "1\r\nX-Evil: 2" }} }}, "header")
        refused({{ url = base .. "/", headers = {{ ["x-a"] = "1\0" }} }}, "header")
        refused({{ url = base .. "/", method = "GET /x HTTP/1.1\r\n" }}, "method")
        -- A clean request still works.
        local res = assert(pier.http.request{{ url = base .. "/ok?x=1", headers = {{ ["x-a"] = "fine" }} }})
        assert(res.status == 200)
        "#
    ));
    run(async {
        step(&e, &mut RequestCtx::new(), "").await.unwrap();
    });
}
