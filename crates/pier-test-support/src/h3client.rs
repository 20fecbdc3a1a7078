//! A blocking HTTP/3 client for scenarios (quinn + h3): one QUIC
//! connection, requests on it in turn, answers as [`Response`]s like the
//! HTTP/1 client's, so a scenario's expectations read the same over both.

use crate::client::Response;
use bytes::{Buf, Bytes};
use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

type Send = h3::client::SendRequest<h3_quinn::OpenStreams, Bytes>;

/// One HTTP/3 connection to Pier, with the runtime that drives it.
pub struct H3Conn {
    rt: tokio::runtime::Runtime,
    _ep: quinn::Endpoint,
    conn: quinn::Connection,
    send: Send,
    drive: tokio::task::JoinHandle<()>,
    port: u16,
}

impl std::fmt::Debug for H3Conn {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("H3Conn").field("port", &self.port).finish()
    }
}

/// Every exchange is bounded: a hung one fails the test, not CI.
const BOUND: Duration = Duration::from_secs(30);

fn io(e: impl std::fmt::Display) -> std::io::Error {
    std::io::Error::other(e.to_string())
}

impl H3Conn {
    /// A connection to `addr` (UDP), trusting `ca`, asking for `pier.test`.
    pub fn connect(addr: SocketAddr, ca: &Path) -> std::io::Result<H3Conn> {
        H3Conn::connect_named(addr, ca, "pier.test")
    }

    /// As [`H3Conn::connect`], asking for `name` (SNI and the certificate's
    /// name).
    pub fn connect_named(addr: SocketAddr, ca: &Path, name: &str) -> std::io::Result<H3Conn> {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?;
        let tls = crate::tls::TlsClientConfig::new(ca, None, &["h3"], None);
        let quic = quinn::crypto::rustls::QuicClientConfig::try_from(tls.0).map_err(io)?;
        let (ep, conn, send, drive) = rt.block_on(async {
            tokio::time::timeout(BOUND, async {
                let mut ep = quinn::Endpoint::client("127.0.0.1:0".parse().unwrap())?;
                ep.set_default_client_config(quinn::ClientConfig::new(Arc::new(quic)));
                let conn = ep.connect(addr, name).map_err(io)?.await.map_err(io)?;
                let (mut driver, send) = h3::client::new(h3_quinn::Connection::new(conn.clone()))
                    .await
                    .map_err(io)?;
                let drive = tokio::spawn(async move {
                    let _ = std::future::poll_fn(|cx| driver.poll_close(cx)).await;
                });
                Ok::<_, std::io::Error>((ep, conn, send, drive))
            })
            .await
            .map_err(io)?
        })?;
        Ok(H3Conn {
            rt,
            _ep: ep,
            conn,
            send,
            drive,
            port: addr.port(),
        })
    }

    /// One request; a `Host` header becomes the authority (`pier.test`
    /// otherwise), as an HTTP/3 client sends it.
    pub fn request(
        &mut self,
        method: &str,
        path: &str,
        headers: &[(&str, &str)],
        body: &[u8],
    ) -> std::io::Result<Response> {
        let host = headers
            .iter()
            .find(|(n, _)| n.eq_ignore_ascii_case("host"))
            .map(|(_, v)| v.to_string())
            .unwrap_or_else(|| format!("pier.test:{}", self.port));
        let mut req = http::Request::builder()
            .method(method)
            .uri(format!("https://{host}{path}"));
        for (n, v) in headers
            .iter()
            .filter(|(n, _)| !n.eq_ignore_ascii_case("host"))
        {
            req = req.header(*n, *v);
        }
        if !body.is_empty() {
            req = req.header("content-length", body.len());
        }
        let req = req.body(()).map_err(io)?;
        let send = &mut self.send;
        self.rt.block_on(async {
            tokio::time::timeout(BOUND, async {
                let mut stream = send.send_request(req).await.map_err(io)?;
                if !body.is_empty() {
                    stream
                        .send_data(Bytes::copy_from_slice(body))
                        .await
                        .map_err(io)?;
                }
                stream.finish().await.map_err(io)?;
                let resp = stream.recv_response().await.map_err(io)?;
                let mut got = Vec::new();
                while let Some(mut chunk) = stream.recv_data().await.map_err(io)? {
                    while chunk.has_remaining() {
                        let c = chunk.chunk();
                        got.extend_from_slice(c);
                        let n = c.len();
                        chunk.advance(n);
                    }
                }
                let trailers = stream.recv_trailers().await.map_err(io)?;
                let fields = |h: &http::HeaderMap| {
                    h.iter()
                        .map(|(n, v)| {
                            (
                                n.as_str().to_string(),
                                String::from_utf8_lossy(v.as_bytes()).into_owned(),
                            )
                        })
                        .collect::<Vec<_>>()
                };
                Ok(Response {
                    status: resp.status().as_u16(),
                    reason: resp.status().canonical_reason().unwrap_or("").to_string(),
                    minor_version: 0,
                    headers: fields(resp.headers()),
                    body_len: got.len() as u64,
                    body: got,
                    trailers: trailers.as_ref().map(fields).unwrap_or_default(),
                    ..Response::default()
                })
            })
            .await
            .map_err(io)?
        })
    }
}

impl Drop for H3Conn {
    fn drop(&mut self) {
        self.drive.abort();
        self.conn.close(0u32.into(), b"done");
    }
}
