//! WebSocket over HTTP/2 (RFC 8441): an h2 client's extended CONNECT
//! (`:protocol = websocket`) reaches an HTTP/1.1 WebSocket origin as an
//! ordinary Upgrade, and the frames cross the HTTP/2 stream both ways, with
//! the allow-list of HTTP/1 tunnels.

mod common;

use bytes::Bytes;
use common::*;
use pier_test_support::ws;
use std::time::Duration;

/// The h2c listener in front of `origin`; `top` sections first.
fn config(origin: std::net::SocketAddr, top: &str) -> String {
    simple_config(&[origin], top, "").replace(
        "name = \"main\"\nlisten = \"127.0.0.1:0\"\n",
        "name = \"main\"\nlisten = \"127.0.0.1:0\"\nh2c = true\n",
    )
}

/// An extended CONNECT to `path` on `addr`: the response status, and (when
/// 200) the frames echoed back for `messages`.
fn connect_ws(addr: std::net::SocketAddr, path: &str, messages: &[&[u8]]) -> (u16, Vec<Vec<u8>>) {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        tokio::time::timeout(Duration::from_secs(20), async {
            let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
            let (send, conn) = h2::client::handshake(tcp).await.expect("h2 handshake");
            let task = tokio::spawn(async move {
                let _ = conn.await;
            });
            let mut send = send.ready().await.unwrap();
            // A first request: Pier's SETTINGS are in by its answer.
            let hello = http::Request::get("http://a/hello").body(()).unwrap();
            let (r, _) = send.send_request(hello, true).unwrap();
            assert_eq!(r.await.unwrap().status(), 200);
            let mut send = send.ready().await.unwrap();
            assert!(
                send.is_extended_connect_protocol_enabled(),
                "Pier offers SETTINGS_ENABLE_CONNECT_PROTOCOL"
            );
            let mut req = http::Request::builder()
                .method("CONNECT")
                .uri(format!("http://a{path}"))
                .header("sec-websocket-version", "13")
                .body(())
                .unwrap();
            req.extensions_mut()
                .insert(h2::ext::Protocol::from_static("websocket"));
            let (resp, mut tx) = send.send_request(req, false).unwrap();
            let resp = resp.await.expect("a response");
            let status = resp.status().as_u16();
            let mut echoed = Vec::new();
            if status == 200 {
                let mut rx = resp.into_body();
                let mut buf = Vec::new();
                for m in messages {
                    tx.send_data(
                        Bytes::from(ws::encode_frame(true, 1, m, Some([9, 8, 7, 6]))),
                        false,
                    )
                    .unwrap();
                    loop {
                        if let Ok(Some((f, used))) = ws::decode_frame(&buf, 1 << 20) {
                            buf.drain(..used);
                            echoed.push(f.payload);
                            break;
                        }
                        let data = rx.data().await.expect("an echo").expect("data");
                        let _ = rx.flow_control().release_capacity(data.len());
                        buf.extend_from_slice(&data);
                    }
                }
                tx.send_data(Bytes::new(), true).unwrap();
            }
            task.abort();
            (status, echoed)
        })
        .await
        .expect("the WebSocket exchange timed out")
    })
}

#[test]
fn websocket_over_http2_reaches_an_http1_origin() {
    let o = Origin::start();
    let p = pier(&config(o.addr(), ""));
    let (status, echoed) = connect_ws(p.listener("main"), "/ws", &[b"hello", &[b'x'; 70_000]]);
    assert_eq!(status, 200, "RFC 8441: the origin's 101 is a 200");
    assert_eq!(echoed.len(), 2);
    assert_eq!(echoed[0], b"hello");
    assert_eq!(echoed[1], vec![b'x'; 70_000]);
    assert_eq!(p.metric_value("pier_tunnels_total"), Some(1.0));
}

#[test]
fn websocket_over_http2_obeys_the_upgrade_allow_list() {
    let o = Origin::start();
    let p = pier(&config(o.addr(), "[http]\nupgrade = []\n"));
    let (status, _) = connect_ws(p.listener("main"), "/ws", &[]);
    // The origin got a plain GET (no Upgrade) and refused the handshake.
    assert_eq!(status, 400);
    assert_eq!(p.metric_value("pier_tunnels_total").unwrap_or(0.0), 0.0);
}
