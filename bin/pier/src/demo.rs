//! The demo origin the embedded default config starts, so that `pier` alone
//! shows a working proxy. Deliberately tiny; real deployments remove `[demo]`.

use pier_http::{write, BodyDecoder, HeadLimits, Method, RequestHead};
use std::net::SocketAddr;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// Bind now (so a busy port is reported at start-up), serve on a thread.
pub fn start(addr: SocketAddr) -> std::io::Result<SocketAddr> {
    let std_listener = std::net::TcpListener::bind(addr)?;
    std_listener.set_nonblocking(true)?;
    let bound = std_listener.local_addr()?;
    std::thread::Builder::new()
        .name("pier-demo-origin".into())
        .spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("demo runtime");
            rt.block_on(async move {
                let l = tokio::net::TcpListener::from_std(std_listener).expect("demo listener");
                loop {
                    let Ok((s, _)) = l.accept().await else {
                        continue;
                    };
                    tokio::spawn(serve(s));
                }
            });
        })?;
    Ok(bound)
}

/// Largest request head the demo reads.
const MAX_HEAD: usize = 64 * 1024;

async fn serve(mut s: tokio::net::TcpStream) {
    let _ = s.set_nodelay(true);
    let limits = HeadLimits {
        max_header_bytes: MAX_HEAD,
        max_uri_bytes: MAX_HEAD,
        ..HeadLimits::default()
    };
    let mut buf = Vec::with_capacity(4096);
    let mut req = RequestHead::default();
    // The body of the request being skipped, if any.
    let mut body: Option<BodyDecoder> = None;
    let mut out = Vec::with_capacity(256);
    loop {
        let mut chunk = [0u8; 4096];
        let n = match s.read(&mut chunk).await {
            Ok(n) if n > 0 => n,
            _ => return,
        };
        buf.extend_from_slice(&chunk[..n]);
        loop {
            if let Some(b) = &mut body {
                let Ok(used) = b.decode(&buf, |_| {}) else {
                    return;
                };
                buf.drain(..used);
                if !b.is_done() {
                    break;
                }
                body = None;
            }
            let used = match req.parse(&buf, &limits) {
                Ok(Some(n)) => n,
                Ok(None) => break,
                Err(_) => {
                    out.clear();
                    write::status_line(&mut out, 400, b"");
                    write::header(&mut out, b"Connection", b"close");
                    write::header(&mut out, b"Content-Length", b"0");
                    out.extend_from_slice(b"\r\n");
                    let _ = s.write_all(&out).await;
                    return;
                }
            };
            buf.drain(..used);
            let answer: &[u8] = match req.path() {
                b"/hello" => b"hello world\n",
                b"/healthz" => b"ok\n",
                _ => b"Hello from Pier's demo origin. Point Pier at your own origin with:\n  pier proxy --listen 127.0.0.1:8080 --to 127.0.0.1:3000\n",
            };
            let is_head = req.method_kind() == Method::Head;
            let close = !req.keep_alive();
            out.clear();
            write::status_line(&mut out, 200, b"OK");
            write::header(&mut out, b"Content-Type", b"text/plain");
            write::header_u64(&mut out, b"Content-Length", answer.len() as u64);
            write::header(&mut out, b"Server", b"pier-demo-origin");
            if close {
                write::header(&mut out, b"Connection", b"close");
            }
            out.extend_from_slice(b"\r\n");
            if !is_head {
                out.extend_from_slice(answer);
            }
            if s.write_all(&out).await.is_err() || close {
                return;
            }
            // Skip a request body (the demo answers without reading it).
            body = Some(BodyDecoder::new(req.body_len()));
        }
    }
}

#[cfg(test)]
mod tests {
    use std::io::{Read, Write};
    use std::time::Duration;

    /// Everything the demo writes on one connection until it closes.
    fn exchange(send: &[u8]) -> String {
        let addr = super::start("127.0.0.1:0".parse().unwrap()).unwrap();
        let mut s = std::net::TcpStream::connect(addr).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        s.write_all(send).unwrap();
        let mut out = Vec::new();
        let _ = s.read_to_end(&mut out);
        String::from_utf8(out).unwrap()
    }

    #[test]
    fn keep_alive_bodies_head_and_close() {
        // A POST body (chunked, then by length) is skipped, not read as the next
        // request; HEAD gets no body; `Connection: close` ends the exchange.
        let out = exchange(
            b"POST /hello HTTP/1.1\r\nHost: d\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nGET\r\n0\r\n\r\n\
              POST /healthz HTTP/1.1\r\nHost: d\r\nContent-Length: 4\r\n\r\nGET \
              HEAD /hello HTTP/1.1\r\nHost: d\r\n\r\n\
              GET /hello HTTP/1.1\r\nHost: d\r\nConnection: close\r\n\r\n",
        );
        assert_eq!(out.matches("HTTP/1.1 200 OK\r\n").count(), 4, "{out}");
        assert_eq!(out.matches("hello world\n").count(), 2, "{out}");
        assert_eq!(out.matches("ok\n").count(), 1, "{out}");
        assert!(
            out.ends_with("Connection: close\r\n\r\nhello world\n"),
            "{out}"
        );
    }

    #[test]
    fn a_bad_head_gets_400_and_a_close() {
        let out = exchange(b"GET / HTTP/1.1\r\nHost: d\r\nBad Header\r\n\r\n");
        assert!(out.starts_with("HTTP/1.1 400 Bad Request\r\n"), "{out}");
    }
}
