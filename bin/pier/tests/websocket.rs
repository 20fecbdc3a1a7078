//! WebSocket (and any Upgrade) tunnelled after the 101.

mod common;

use std::time::Duration;

use common::*;

const KEY: &str = "dGhlIHNhbXBsZSBub25jZQ==";

fn handshake(c: &mut RawConn) -> Response {
    c.request(
        "GET",
        "/ws",
        &[
            ("upgrade", "websocket"),
            ("connection", "Upgrade"),
            ("sec-websocket-key", KEY),
            ("sec-websocket-version", "13"),
        ],
        b"",
    )
    .unwrap()
}

#[test]
fn websocket_echo_through_the_tunnel() {
    let o = Origin::start();
    let p = pier(&simple_config(&[o.addr()], "", ""));
    let mut c = RawConn::connect(p.listener("main"));
    let r = handshake(&mut c);
    assert_eq!(r.status, 101, "{:?} {}", r.headers, r.body_str());
    assert!(r.has_token("upgrade", "websocket"), "{:?}", r.headers);
    assert!(r.has_token("connection", "upgrade"), "{:?}", r.headers);
    assert_eq!(
        r.header("sec-websocket-accept"),
        Some(ws::accept_key(KEY).as_str())
    );

    c.send(&ws::encode_frame(
        true,
        ws::OP_TEXT,
        b"hello through pier",
        Some([0x37, 0xfa, 0x21, 0x3d]),
    ));
    let f = c.read_ws_frame().unwrap();
    assert_eq!(f.opcode, ws::OP_TEXT);
    assert!(!f.masked);
    assert_eq!(f.payload, b"hello through pier");

    // Larger frames, several in one write, both ways.
    let big = pattern(0, 200_000);
    let mut burst = ws::encode_frame(true, ws::OP_BINARY, &big, Some([1, 2, 3, 4]));
    burst.extend(ws::encode_frame(
        true,
        ws::OP_PING,
        b"p",
        Some([5, 6, 7, 8]),
    ));
    c.send(&burst);
    assert_eq!(c.read_ws_frame().unwrap().payload, big);
    assert_eq!(c.read_ws_frame().unwrap().opcode, ws::OP_PING);

    // A long idle pause inside the tunnel is fine (no HTTP timeouts apply to it here).
    std::thread::sleep(Duration::from_millis(300));
    c.send(&ws::encode_frame(
        true,
        ws::OP_TEXT,
        b"again",
        Some([9, 9, 9, 9]),
    ));
    assert_eq!(c.read_ws_frame().unwrap().payload, b"again");

    c.send(&ws::encode_frame(
        true,
        ws::OP_CLOSE,
        b"",
        Some([1, 1, 1, 1]),
    ));
    assert_eq!(c.read_ws_frame().unwrap().opcode, ws::OP_CLOSE);
    assert!(
        c.is_closed(Duration::from_secs(5)),
        "tunnel not closed after the origin closed"
    );
    assert_eq!(o.requests(), 1);
}

#[test]
fn refused_upgrade_is_a_plain_response() {
    // The origin answers 400 to a handshake without a key: no tunnel, the response is
    // relayed as HTTP.
    let o = Origin::start();
    let p = pier(&simple_config(&[o.addr()], "", ""));
    let mut c = RawConn::connect(p.listener("main"));
    let r = c
        .request(
            "GET",
            "/ws",
            &[("upgrade", "websocket"), ("connection", "Upgrade")],
            b"",
        )
        .unwrap();
    assert_eq!(r.status, 400);
    assert_eq!(r.body_str(), "not a websocket handshake\n");
}

#[test]
fn many_tunnels_at_once() {
    let o = Origin::start();
    let p = pier(&simple_config(&[o.addr()], "", ""));
    let addr = p.listener("main");
    let threads: Vec<_> = (0..8)
        .map(|i| {
            std::thread::spawn(move || {
                let mut c = RawConn::connect(addr);
                assert_eq!(handshake(&mut c).status, 101);
                for j in 0..20 {
                    let msg = format!("conn {i} msg {j}");
                    c.send(&ws::encode_frame(
                        true,
                        ws::OP_TEXT,
                        msg.as_bytes(),
                        Some([i as u8, j as u8, 1, 2]),
                    ));
                    assert_eq!(c.read_ws_frame().unwrap().payload, msg.as_bytes());
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    assert_eq!(o.requests(), 8);
}
