//! The demo origin the embedded default config starts, so that `pier` alone
//! shows a working proxy. Deliberately tiny; real deployments remove `[demo]`.

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

async fn serve(mut s: tokio::net::TcpStream) {
    let _ = s.set_nodelay(true);
    let mut buf = Vec::with_capacity(4096);
    loop {
        let mut chunk = [0u8; 4096];
        let n = match s.read(&mut chunk).await {
            Ok(n) if n > 0 => n,
            _ => return,
        };
        buf.extend_from_slice(&chunk[..n]);
        loop {
            let mut h = [httparse::EMPTY_HEADER; 64];
            let mut req = httparse::Request::new(&mut h);
            let used = match req.parse(&buf) {
                Ok(httparse::Status::Complete(n)) => n,
                Ok(httparse::Status::Partial) if buf.len() < 65536 => break,
                _ => return,
            };
            let path = req.path.unwrap_or("/");
            let body: &[u8] = match path {
                "/hello" => b"hello world\n",
                "/healthz" => b"ok\n",
                _ => b"Hello from Pier's demo origin. Point Pier at your own origin with:\n  pier proxy --listen 127.0.0.1:8080 --to 127.0.0.1:3000\n",
            };
            let head = format!(
                "HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: {}\r\nServer: pier-demo-origin\r\n\r\n",
                body.len()
            );
            buf.drain(..used);
            if s.write_all(head.as_bytes()).await.is_err() || s.write_all(body).await.is_err() {
                return;
            }
        }
    }
}
