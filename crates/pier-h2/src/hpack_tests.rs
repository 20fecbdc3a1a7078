//! The header blocks vendor/h2 writes with `hpack_dynamic_table(false)`
//! (Pier's default on both sides), read off the wire: literals without
//! indexing, raw strings, nothing inserted into the peer's table, and the
//! same bytes for the same head every time. With the table on, the second
//! block is the shorter (the published crate's encoder).

use bytes::Bytes;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use tokio::io::{AsyncRead, AsyncWrite, DuplexStream, ReadBuf};

/// The client's end of the connection, keeping a copy of what it reads.
struct Tap {
    io: DuplexStream,
    seen: Arc<Mutex<Vec<u8>>>,
}

impl AsyncRead for Tap {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let before = buf.filled().len();
        let r = Pin::new(&mut self.io).poll_read(cx, buf);
        let new = buf.filled()[before..].to_vec();
        self.seen.lock().unwrap().extend_from_slice(&new);
        r
    }
}

impl AsyncWrite for Tap {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.io).poll_write(cx, buf)
    }
    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.io).poll_flush(cx)
    }
    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.io).poll_shutdown(cx)
    }
}

/// Serves two requests with the same response head on a connection whose
/// encoder has the dynamic table `on` or not; returns the header blocks
/// the client received, in order, after checking that the client's h2
/// decoded each back to the head sent.
fn two_response_blocks(on: bool) -> Vec<Vec<u8>> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let (a, b) = tokio::io::duplex(64 * 1024);
        tokio::spawn(async move {
            let mut c = h2::server::Builder::new()
                .hpack_dynamic_table(on)
                .handshake::<_, Bytes>(b)
                .await
                .unwrap();
            while let Some(Ok((_req, mut respond))) = c.accept().await {
                let mut secret = http::HeaderValue::from_static("Bearer s3cret");
                secret.set_sensitive(true);
                let res = http::Response::builder()
                    .status(200)
                    .header("content-type", "application/grpc")
                    .header("x-served-by", "pier-test-node")
                    .header("set-cookie", "a=1")
                    .header("set-cookie", "b=2")
                    .header("authorization", secret)
                    .body(())
                    .unwrap();
                respond.send_response(res, true).unwrap();
            }
        });
        let seen = Arc::new(Mutex::new(Vec::new()));
        let tap = Tap {
            io: a,
            seen: seen.clone(),
        };
        let (send, conn) = h2::client::handshake(tap).await.unwrap();
        tokio::spawn(conn);
        for _ in 0..2 {
            let mut send = send.clone().ready().await.unwrap();
            let req = http::Request::builder()
                .uri("http://x.test/")
                .body(())
                .unwrap();
            let (res, _) = send.send_request(req, true).unwrap();
            let res = res.await.unwrap();
            let h = res.headers();
            assert_eq!(res.status(), 200);
            assert_eq!(h["content-type"], "application/grpc");
            assert_eq!(h["x-served-by"], "pier-test-node");
            let cookies: Vec<_> = h.get_all("set-cookie").iter().collect();
            assert_eq!(cookies, ["a=1", "b=2"]);
            assert_eq!(h["authorization"], "Bearer s3cret");
        }
        let wire = seen.lock().unwrap().clone();
        header_blocks(&wire)
    })
}

/// The HEADERS frames' blocks in a server-to-client byte stream.
fn header_blocks(mut wire: &[u8]) -> Vec<Vec<u8>> {
    let mut out = Vec::new();
    while wire.len() >= 9 {
        let len = (wire[0] as usize) << 16 | (wire[1] as usize) << 8 | wire[2] as usize;
        let (kind, flags) = (wire[3], wire[4]);
        let payload = &wire[9..9 + len];
        if kind == 1 {
            assert_eq!(flags & 0x4, 0x4, "one frame a block (END_HEADERS)");
            assert_eq!(flags & 0x28, 0, "neither padded nor with a priority");
            out.push(payload.to_vec());
        }
        wire = &wire[9 + len..];
    }
    out
}

/// An HPACK integer with an `n`-bit prefix.
fn int(b: &[u8], i: &mut usize, n: u32) -> usize {
    let max = (1usize << n) - 1;
    let mut v = b[*i] as usize & max;
    *i += 1;
    if v == max {
        let mut shift = 0;
        loop {
            let c = b[*i];
            *i += 1;
            v += ((c & 0x7f) as usize) << shift;
            shift += 7;
            if c & 0x80 == 0 {
                break;
            }
        }
    }
    v
}

/// A string literal, which must be raw (no Huffman coding).
fn raw<'a>(b: &'a [u8], i: &mut usize) -> &'a [u8] {
    assert_eq!(b[*i] & 0x80, 0, "a Huffman-coded string");
    let len = int(b, i, 7);
    let s = &b[*i..*i + len];
    *i += len;
    s
}

#[test]
fn static_only_blocks_are_literals_without_indexing_and_the_same_every_time() {
    let blocks = two_response_blocks(false);
    assert_eq!(blocks.len(), 2);
    assert_eq!(blocks[0], blocks[1], "no state between blocks");
    let b = &blocks[0];
    let (mut i, mut names) = (0, Vec::new());
    while i < b.len() {
        let first = b[i];
        if first & 0x80 != 0 {
            let idx = int(b, &mut i, 7);
            assert!((1..=61).contains(&idx), "index {idx} is not static");
            names.push((format!("#{idx}"), false));
            continue;
        }
        assert_eq!(
            first & 0xe0,
            0,
            "byte {first:#x}: indexing or a size update"
        );
        let sensitive = first & 0x10 != 0;
        let idx = int(b, &mut i, 4);
        assert!(idx <= 61, "name index {idx} is not static");
        let name = if idx == 0 {
            String::from_utf8(raw(b, &mut i).to_vec()).unwrap()
        } else {
            format!("#{idx}")
        };
        let value = raw(b, &mut i).to_vec();
        assert!(!value.is_empty());
        names.push((name, sensitive));
    }
    // :status 200 is static entry 8; content-type 31, set-cookie 55 and
    // authorization 23 are static names; x-served-by is spelled out.
    let want = [
        ("#8", false),
        ("#31", false),
        ("x-served-by", false),
        ("#55", false),
        ("#55", false),
        ("#23", true),
    ];
    let got: Vec<_> = names.iter().map(|(n, s)| (n.as_str(), *s)).collect();
    assert_eq!(got, want);
}

#[test]
fn with_the_dynamic_table_the_second_block_is_indexes() {
    let blocks = two_response_blocks(true);
    assert_eq!(blocks.len(), 2);
    // Incremental indexing (01xxxxxx) in the first; the second refers to
    // the entries it made.
    assert!(blocks[0].iter().any(|&c| c & 0xc0 == 0x40));
    assert!(
        blocks[1].len() < blocks[0].len() / 2,
        "{} against {}",
        blocks[1].len(),
        blocks[0].len()
    );
}
