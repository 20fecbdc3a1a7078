//! The OTLP exporter: a bounded queue every worker hands finished spans to
//! without waiting (a full queue drops the span, counted), and one thread
//! that sends them in batches (512 spans, or what came within a second):
//! as `application/x-protobuf` POSTs to an `http://` endpoint (OTLP/HTTP),
//! or as unary `TraceService/Export` calls over one kept HTTP/2 connection
//! to a `grpc://` endpoint (OTLP/gRPC). A collector that is slow or down
//! costs the proxy nothing but the dropped spans: a failed export drops its
//! batch, counted, and is not retried.

use crate::span::{encode_request, Span};
use std::io::{Read, Write};
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::mpsc::{sync_channel, Receiver, RecvTimeoutError, SyncSender, TrySendError};
use std::sync::{Arc, Mutex, OnceLock, Weak};
use std::time::{Duration, Instant};

/// Spans sent per POST at most.
const BATCH: usize = 512;
/// A span waits this long at most for its batch to fill.
const LINGER: Duration = Duration::from_secs(1);
/// Each step of a POST (connect, write, read) gives up after this.
const STEP: Duration = Duration::from_secs(5);

enum Msg {
    Span(Box<Span>),
    /// Send what is queued now, then answer.
    Flush(SyncSender<()>),
}

/// Spans exported, dropped at the queue, and lost in failed POSTs.
static EXPORTED: AtomicU64 = AtomicU64::new(0);
static DROPPED: AtomicU64 = AtomicU64::new(0);
static FAILED: AtomicU64 = AtomicU64::new(0);

/// `pier_tracing_spans_total{result}`, Prometheus text.
pub fn render(out: &mut String) {
    use std::fmt::Write as _;
    let _ = writeln!(
        out,
        "# TYPE pier_tracing_spans_total counter\npier_tracing_spans_total{{result=\"exported\"}} {}\npier_tracing_spans_total{{result=\"dropped\"}} {}\npier_tracing_spans_total{{result=\"failed\"}} {}",
        EXPORTED.load(Relaxed),
        DROPPED.load(Relaxed),
        FAILED.load(Relaxed)
    );
}

/// A `[tracing]` table's exporter, shared by every worker.
pub struct Exporter {
    tx: SyncSender<Msg>,
    endpoint: String,
    service: String,
    queue: usize,
}

impl std::fmt::Debug for Exporter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Exporter")
            .field("endpoint", &self.endpoint)
            .finish()
    }
}

/// The exporter for (endpoint, service, queue): the one already running
/// when a reload keeps them, else a new one. Only configs hold it: when the
/// last one using an exporter is gone (a reload that removed or changed
/// `[tracing]`), its queue's sender drops and its thread ends, sending what
/// it holds.
pub fn exporter(endpoint: &str, service: &str, queue: usize) -> Arc<Exporter> {
    static CURRENT: OnceLock<Mutex<Weak<Exporter>>> = OnceLock::new();
    let mut cur = CURRENT
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|e| e.into_inner());
    let queue = queue.max(1);
    if let Some(e) = cur.upgrade() {
        if e.endpoint == endpoint && e.service == service && e.queue == queue {
            return e;
        }
    }
    let (tx, rx) = sync_channel(queue);
    let (url, svc) = (endpoint.to_string(), service.to_string());
    let spawned = std::thread::Builder::new()
        .name("pier-trace".into())
        .spawn(move || run(rx, &url, &svc));
    if let Err(e) = spawned {
        tracing::error!("tracing: cannot start the exporter thread: {e}");
    }
    let e = Arc::new(Exporter {
        tx,
        endpoint: endpoint.to_string(),
        service: service.to_string(),
        queue,
    });
    *cur = Arc::downgrade(&e);
    e
}

impl Exporter {
    /// Queue a finished span; never waits (a full queue drops it).
    pub fn submit(&self, span: Span) {
        match self.tx.try_send(Msg::Span(Box::new(span))) {
            Ok(()) => {}
            Err(TrySendError::Full(_)) | Err(TrySendError::Disconnected(_)) => {
                DROPPED.fetch_add(1, Relaxed);
            }
        }
    }

    /// Send what is queued, waiting at most `timeout` (a drain's last step).
    pub fn flush(&self, timeout: Duration) -> bool {
        let (ack, done) = sync_channel(1);
        if send_within(&self.tx, Msg::Flush(ack), timeout).is_err() {
            return false;
        }
        done.recv_timeout(timeout).is_ok()
    }
}

/// `try_send` until `timeout`: a flush waits for room, a span does not.
fn send_within(tx: &SyncSender<Msg>, mut m: Msg, timeout: Duration) -> Result<(), ()> {
    let until = Instant::now() + timeout;
    loop {
        match tx.try_send(m) {
            Ok(()) => return Ok(()),
            Err(TrySendError::Disconnected(_)) => return Err(()),
            Err(TrySendError::Full(back)) => {
                if Instant::now() >= until {
                    return Err(());
                }
                m = back;
                std::thread::sleep(Duration::from_millis(5));
            }
        }
    }
}

fn run(rx: Receiver<Msg>, endpoint: &str, service: &str) {
    let mut grpc = match endpoint.strip_prefix("grpc://") {
        Some(authority) => match Grpc::new(authority) {
            Ok(g) => Some(g),
            Err(e) => {
                tracing::error!("tracing: {endpoint}: {e}; spans will be dropped");
                None
            }
        },
        None => None,
    };
    let mut batch: Vec<Span> = Vec::with_capacity(BATCH);
    let mut first: Option<Instant> = None;
    loop {
        let wait = first.map_or(LINGER, |t| LINGER.saturating_sub(t.elapsed()));
        let (flush, ack, closed) = match rx.recv_timeout(wait) {
            Ok(Msg::Span(s)) => {
                batch.push(*s);
                first.get_or_insert_with(Instant::now);
                (batch.len() >= BATCH, None, false)
            }
            Ok(Msg::Flush(ack)) => {
                // Everything queued before the flush asked.
                while let Ok(Msg::Span(s)) = rx.try_recv() {
                    batch.push(*s);
                }
                (true, Some(ack), false)
            }
            Err(RecvTimeoutError::Timeout) => (true, None, false),
            Err(RecvTimeoutError::Disconnected) => (true, None, true),
        };
        if flush && !batch.is_empty() {
            for chunk in batch.chunks(BATCH) {
                let body = encode_request(service, chunk);
                let sent = match grpc.as_mut() {
                    Some(g) => g.export(&body),
                    None => post(endpoint, &body),
                };
                match sent {
                    Ok(()) => {
                        EXPORTED.fetch_add(chunk.len() as u64, Relaxed);
                    }
                    Err(e) => {
                        FAILED.fetch_add(chunk.len() as u64, Relaxed);
                        tracing::debug!("tracing: {endpoint}: {e}; {} spans lost", chunk.len());
                    }
                }
            }
            batch.clear();
            first = None;
        }
        if let Some(ack) = ack {
            let _ = ack.try_send(());
        }
        if closed {
            return;
        }
    }
}

/// The first socket address of `host:port`.
fn resolve(connect: &str) -> Result<std::net::SocketAddr, String> {
    use std::net::ToSocketAddrs;
    connect
        .to_socket_addrs()
        .map_err(|e| format!("{connect}: {e}"))?
        .next()
        .ok_or_else(|| format!("{connect}: no address"))
}

/// The gRPC method OTLP/gRPC collectors serve.
const EXPORT_PATH: &str = "/opentelemetry.proto.collector.trace.v1.TraceService/Export";

/// An OTLP/gRPC client: one HTTP/2 connection (h2c), kept between batches
/// and made again when it breaks, driven by a single-threaded runtime of
/// the exporter thread's own (the workers' runtimes never see it).
struct Grpc {
    rt: tokio::runtime::Runtime,
    authority: String,
    uri: http::Uri,
    conn: Option<h2::client::SendRequest<bytes::Bytes>>,
}

impl Grpc {
    fn new(authority: &str) -> Result<Grpc, String> {
        let authority = authority.trim_end_matches('/');
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(|e| format!("runtime: {e}"))?;
        let uri = format!("http://{authority}{EXPORT_PATH}")
            .parse()
            .map_err(|e| format!("{authority}: {e}"))?;
        Ok(Grpc {
            rt,
            authority: authority.to_string(),
            uri,
            conn: None,
        })
    }

    /// One `Export` call with `body` (an `ExportTraceServiceRequest`); Ok
    /// when the collector answers grpc-status 0. A kept connection that
    /// fails is dropped and the call made once more on a new one.
    fn export(&mut self, body: &[u8]) -> Result<(), String> {
        let mut framed = Vec::with_capacity(5 + body.len());
        framed.push(0); // not compressed
        framed.extend_from_slice(&(body.len() as u32).to_be_bytes());
        framed.extend_from_slice(body);
        let framed = bytes::Bytes::from(framed);
        let reused = self.conn.is_some();
        let first = self.call(framed.clone());
        match first {
            Err(Failure::Connection(_)) if reused => {
                self.conn = None;
                self.call(framed).map_err(Failure::text)
            }
            r => r.map_err(Failure::text),
        }
    }

    fn call(&mut self, framed: bytes::Bytes) -> Result<(), Failure> {
        let Grpc {
            rt,
            authority,
            uri,
            conn,
        } = self;
        let r = rt.block_on(async {
            tokio::time::timeout(2 * STEP, call(conn, authority, uri, framed))
                .await
                .unwrap_or_else(|_| Err(Failure::Connection("timed out".into())))
        });
        if matches!(r, Err(Failure::Connection(_))) {
            self.conn = None;
        }
        r
    }
}

/// Why an export call failed: the connection (worth a new one), or the
/// collector's answer.
enum Failure {
    Connection(String),
    Answer(String),
}

impl Failure {
    fn text(self) -> String {
        match self {
            Failure::Connection(s) | Failure::Answer(s) => s,
        }
    }
}

async fn call(
    conn: &mut Option<h2::client::SendRequest<bytes::Bytes>>,
    authority: &str,
    uri: &http::Uri,
    framed: bytes::Bytes,
) -> Result<(), Failure> {
    let io = |e: &dyn std::fmt::Display| Failure::Connection(e.to_string());
    if conn.is_none() {
        let url = format!("http://{authority}");
        let url = pier_http::url::parse_http(&url, 4317, "/")
            .map_err(|e| Failure::Connection(e.into()))?;
        let addr = resolve(&url.connect).map_err(Failure::Connection)?;
        let tcp = tokio::net::TcpStream::connect(addr)
            .await
            .map_err(|e| io(&e))?;
        let _ = tcp.set_nodelay(true);
        let (send, connection) = h2::client::handshake(tcp).await.map_err(|e| io(&e))?;
        tokio::spawn(async move {
            let _ = connection.await;
        });
        *conn = Some(send);
    }
    let Some(send) = conn.as_ref() else {
        return Err(Failure::Connection("no connection".into()));
    };
    let mut send = send.clone().ready().await.map_err(|e| io(&e))?;
    let req = http::Request::builder()
        .method("POST")
        .uri(uri.clone())
        .header("content-type", "application/grpc")
        .header("te", "trailers")
        .header("user-agent", "pier")
        .body(())
        .map_err(|e| Failure::Answer(e.to_string()))?;
    let (resp, mut stream) = send.send_request(req, false).map_err(|e| io(&e))?;
    stream.send_data(framed, true).map_err(|e| io(&e))?;
    let resp = resp.await.map_err(|e| io(&e))?;
    if resp.status() != http::StatusCode::OK {
        return Err(Failure::Answer(format!("HTTP {}", resp.status())));
    }
    // A trailers-only answer has grpc-status in its head.
    if let Some(s) = resp.headers().get("grpc-status") {
        return grpc_status(s, resp.headers().get("grpc-message"));
    }
    let mut body = resp.into_body();
    while let Some(chunk) = body.data().await {
        let chunk = chunk.map_err(|e| io(&e))?;
        let _ = body.flow_control().release_capacity(chunk.len());
    }
    let trailers = body.trailers().await.map_err(|e| io(&e))?;
    match trailers.as_ref().and_then(|t| t.get("grpc-status")) {
        Some(s) => grpc_status(s, trailers.as_ref().and_then(|t| t.get("grpc-message"))),
        None => Err(Failure::Answer("no grpc-status".into())),
    }
}

fn grpc_status(s: &http::HeaderValue, msg: Option<&http::HeaderValue>) -> Result<(), Failure> {
    if s.as_bytes() == b"0" {
        return Ok(());
    }
    let msg = msg.map(|m| String::from_utf8_lossy(m.as_bytes()).into_owned());
    Err(Failure::Answer(format!(
        "grpc-status {}: {}",
        String::from_utf8_lossy(s.as_bytes()),
        msg.unwrap_or_default()
    )))
}

/// POST `body` to an `http://` OTLP endpoint; Ok on a 2xx.
fn post(url: &str, body: &[u8]) -> Result<(), String> {
    let u = pier_http::url::parse_http(url, 4318, "/v1/traces")?;
    let (hostport, path) = (u.authority, &*u.path);
    let addr = resolve(&u.connect)?;
    let mut s = std::net::TcpStream::connect_timeout(&addr, STEP).map_err(|e| e.to_string())?;
    s.set_read_timeout(Some(STEP)).map_err(|e| e.to_string())?;
    s.set_write_timeout(Some(STEP)).map_err(|e| e.to_string())?;
    let mut req = Vec::with_capacity(200 + body.len());
    let _ = write!(
        req,
        "POST {path} HTTP/1.1\r\nHost: {hostport}\r\nContent-Type: application/x-protobuf\r\nContent-Length: {}\r\nUser-Agent: pier\r\nConnection: close\r\n\r\n",
        body.len()
    );
    req.extend_from_slice(body);
    s.write_all(&req).map_err(|e| e.to_string())?;
    let mut buf = Vec::with_capacity(1024);
    let mut chunk = [0u8; 1024];
    loop {
        let n = s.read(&mut chunk).map_err(|e| e.to_string())?;
        buf.extend_from_slice(&chunk[..n]);
        let mut headers = [httparse::EMPTY_HEADER; 32];
        let mut r = httparse::Response::new(&mut headers);
        match r.parse(&buf) {
            Ok(httparse::Status::Complete(_)) => {
                let code = r.code.unwrap_or(0);
                return if (200..300).contains(&code) {
                    Ok(())
                } else {
                    Err(format!("HTTP {code}"))
                };
            }
            Ok(httparse::Status::Partial) if n > 0 && buf.len() < 64 * 1024 => {}
            _ => return Err("bad HTTP response".into()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_reload_keeps_an_unchanged_exporter_and_the_last_holder_ends_it() {
        let a = exporter("http://127.0.0.1:9/v1/traces", "s", 16);
        let b = exporter("http://127.0.0.1:9/v1/traces", "s", 16);
        assert!(Arc::ptr_eq(&a, &b));
        // Another queue size is another exporter.
        let c = exporter("http://127.0.0.1:9/v1/traces", "s", 32);
        assert!(!Arc::ptr_eq(&a, &c));
        // Once no config holds one, its thread sees the queue closed.
        let weak = Arc::downgrade(&c);
        drop(c);
        assert!(weak.upgrade().is_none());
        let d = exporter("http://127.0.0.1:9/v1/traces", "s", 32);
        assert!(!Arc::ptr_eq(&a, &d));
    }
}
