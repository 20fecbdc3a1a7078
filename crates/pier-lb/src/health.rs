//! Active health checks: one tokio task per peer of every group that has a
//! `health_check`. A group whose upstream speaks TLS is checked over TLS
//! (the same trust, client certificate and server name as its traffic):
//! a cleartext check to a TLS port would mark every server down.

use std::fmt;
use std::io;
use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use pier_config::{HealthCheck, HealthKind};
use pier_http::{write, HeadLimits, ResponseHead};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio::time::MissedTickBehavior;

use crate::group::Group;

/// TLS for one group's checks: its upstream's rustls config (trust, client
/// certificate, resumption) and configured server name.
#[derive(Clone, Debug)]
pub struct CheckTls {
    pub config: Arc<rustls::ClientConfig>,
    /// SNI and verified name; None = the server's host name, else its IP
    /// address (verified against the certificate's IP SANs), as requests do.
    pub server_name: Option<Arc<str>>,
}

/// Spawn the active health checkers on the current tokio runtime (panics
/// outside one, as `tokio::spawn`). Each peer is checked at once and then
/// every `interval`; `rise` consecutive good checks mark a down peer up,
/// `fall` consecutive bad ones mark an up peer down, and each transition is
/// logged. `tls[i]` (when present) is the TLS of `groups[i]`'s servers:
/// `http` and `grpc` checks then run over TLS (`tcp` ones stay a connect).
/// The tasks end when `shutdown` becomes true or its sender is dropped; the
/// handles let a caller wait for that.
pub fn spawn_health_checks(
    groups: &[Arc<Group>],
    tls: &[Option<CheckTls>],
    shutdown: watch::Receiver<bool>,
) -> Vec<JoinHandle<()>> {
    let mut tasks = Vec::new();
    for (gi, group) in groups.iter().enumerate() {
        let Some(hc) = &group.config().health_check else {
            continue;
        };
        let tls = tls.get(gi).cloned().flatten();
        for idx in 0..group.peers().len() {
            tasks.push(tokio::spawn(check_loop(
                group.clone(),
                idx,
                hc.clone(),
                tls.clone(),
                shutdown.clone(),
            )));
        }
    }
    tasks
}

/// The connector and name a peer's checks use: the group's config with the
/// ALPN the check speaks (`http/1.1`, or `h2` for gRPC), whatever the
/// upstream's own `protocol` offers.
fn check_connector(
    tls: Option<CheckTls>,
    kind: &HealthKind,
    peer: &crate::Peer,
) -> Option<(
    tokio_rustls::TlsConnector,
    rustls::pki_types::ServerName<'static>,
)> {
    let t = tls?;
    let alpn: &[u8] = match kind {
        HealthKind::Tcp => return None,
        HealthKind::Http { .. } => b"http/1.1",
        HealthKind::Grpc { .. } => b"h2",
    };
    let mut config = (*t.config).clone();
    config.alpn_protocols = vec![alpn.to_vec()];
    let name = crate::tls_server_name(t.server_name.as_ref(), peer.host.as_ref(), peer.addr);
    let name = match rustls::pki_types::ServerName::try_from(name.to_string()) {
        Ok(n) => n,
        Err(e) => {
            // Validated at load for `server_name`; a resolved host name is a
            // DNS name. Checks then fail (and say why) rather than go clear.
            tracing::warn!(peer = %peer.addr, name = %name, error = %e, "health check: bad TLS server name");
            rustls::pki_types::ServerName::IpAddress(peer.addr.ip().into())
        }
    };
    Some((tokio_rustls::TlsConnector::from(Arc::new(config)), name))
}

async fn check_loop(
    group: Arc<Group>,
    idx: usize,
    hc: HealthCheck,
    tls: Option<CheckTls>,
    mut shutdown: watch::Receiver<bool>,
) {
    let peer = group.peers()[idx].clone();
    let tls = check_connector(tls, &hc.kind, &peer);
    let request = match &hc.kind {
        HealthKind::Tcp => Vec::new(),
        HealthKind::Http { path, host, .. } => {
            // The configured Host, else the server's name (or address) and port.
            let named = peer
                .host
                .as_deref()
                .map(|h| format!("{h}:{}", peer.addr.port()));
            http_request(path, host.as_deref().or(named.as_deref()), peer.addr)
        }
        HealthKind::Grpc { .. } => Vec::new(),
    };
    // A server that takes PROXY headers (`send_proxy_protocol`) wants one
    // on every connection: the check's says it is the proxy's own (v2
    // LOCAL, v1 UNKNOWN), as HAProxy's `check-send-proxy` does.
    let preface: &[u8] = match group.config().send_proxy_protocol {
        None => b"",
        Some(pier_config::SendProxy::V1) => b"PROXY UNKNOWN\r\n",
        Some(pier_config::SendProxy::V2) => b"\r\n\r\n\0\r\nQUIT\n\x20\x00\x00\x00",
    };
    let rise = hc.rise.max(1);
    let fall = hc.fall.max(1);
    let mut tick = tokio::time::interval(hc.interval.max(Duration::from_millis(1)));
    tick.set_missed_tick_behavior(MissedTickBehavior::Delay);
    let (mut oks, mut fails) = (0u32, 0u32);
    let mut last_up = peer.is_healthy();
    loop {
        if *shutdown.borrow() {
            return;
        }
        tokio::select! {
            _ = tick.tick() => {}
            r = shutdown.changed() => {
                if r.is_err() {
                    return;
                }
                continue;
            }
        }
        let result = tokio::select! {
            r = check(peer.addr, tls.as_ref(), &hc.kind, preface, &request, hc.timeout) => r,
            _ = shutdown.changed() => continue,
        };
        let up = peer.is_healthy();
        if last_up && !up {
            // Marked down elsewhere (passive failures, admin): earn `rise`
            // good checks from here.
            oks = 0;
        }
        match result {
            Ok(()) => {
                oks = oks.saturating_add(1);
                fails = 0;
                if !up && oks >= rise {
                    peer.consecutive_fails.store(0, Ordering::Relaxed);
                    peer.healthy.store(true, Ordering::Release);
                    tracing::info!(upstream = %group.name(), peer = %peer.addr, checks = oks, "peer up: active health check passed");
                }
            }
            Err(e) => {
                fails = fails.saturating_add(1);
                oks = 0;
                if up && fails >= fall {
                    peer.healthy.store(false, Ordering::Release);
                    tracing::info!(upstream = %group.name(), peer = %peer.addr, checks = fails, error = %e, "peer down: active health check failed");
                } else {
                    tracing::debug!(upstream = %group.name(), peer = %peer.addr, error = %e, "health check failed");
                }
            }
        }
        last_up = peer.is_healthy();
    }
}

fn http_request(path: &str, host: Option<&str>, addr: SocketAddr) -> Vec<u8> {
    let host = host.map_or_else(|| addr.to_string(), str::to_owned);
    let mut out = Vec::with_capacity(96 + path.len() + host.len());
    write::request_line(&mut out, b"GET", path.as_bytes());
    write::header(&mut out, b"Host", host.as_bytes());
    write::header(&mut out, b"Connection", b"close");
    write::header(&mut out, b"User-Agent", b"pier-health");
    out.extend_from_slice(b"\r\n");
    out
}

/// Why a check failed (logged on transitions).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum CheckError {
    Timeout,
    Connect(io::ErrorKind),
    /// The TLS handshake failed (the rustls error, e.g. a bad certificate).
    Tls(String),
    Io(io::ErrorKind),
    /// Closed or garbled before the end of a response head.
    BadResponse,
    Status(u16),
}

impl fmt::Display for CheckError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            CheckError::Timeout => f.write_str("timed out"),
            CheckError::Connect(k) => write!(f, "connect: {k}"),
            CheckError::Tls(e) => write!(f, "tls: {e}"),
            CheckError::Io(k) => write!(f, "i/o: {k}"),
            CheckError::BadResponse => f.write_str("no valid HTTP response head"),
            CheckError::Status(s) => write!(f, "status {s}"),
        }
    }
}

/// One check, all of it (connect, TLS handshake, send, read the response
/// head) within `timeout`.
pub(crate) async fn check(
    addr: SocketAddr,
    tls: Option<&(
        tokio_rustls::TlsConnector,
        rustls::pki_types::ServerName<'static>,
    )>,
    kind: &HealthKind,
    preface: &[u8],
    request: &[u8],
    timeout: Duration,
) -> Result<(), CheckError> {
    let run = async {
        let mut stream = TcpStream::connect(addr)
            .await
            .map_err(|e| CheckError::Connect(e.kind()))?;
        let _ = stream.set_nodelay(true);
        if !preface.is_empty() {
            tokio::io::AsyncWriteExt::write_all(&mut stream, preface)
                .await
                .map_err(|e| CheckError::Connect(e.kind()))?;
        }
        match tls {
            None => probe(stream, "http", addr, kind, request).await,
            Some((connector, name)) => {
                let stream = connector
                    .connect(name.clone(), stream)
                    .await
                    .map_err(|e| CheckError::Tls(e.to_string()))?;
                probe(stream, "https", addr, kind, request).await
            }
        }
    };
    tokio::time::timeout(timeout, run)
        .await
        .unwrap_or(Err(CheckError::Timeout))
}

/// The check's exchange on a connected stream (TCP or TLS).
async fn probe<S>(
    mut stream: S,
    scheme: &str,
    addr: SocketAddr,
    kind: &HealthKind,
    request: &[u8],
) -> Result<(), CheckError>
where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    if let HealthKind::Grpc { service } = kind {
        return grpc_check(stream, scheme, addr, service).await;
    }
    let HealthKind::Http {
        expect_min,
        expect_max,
        ..
    } = kind
    else {
        return Ok(());
    };
    stream
        .write_all(request)
        .await
        .map_err(|e| CheckError::Io(e.kind()))?;
    let status = read_status(&mut stream).await?;
    if (*expect_min..=*expect_max).contains(&status) {
        Ok(())
    } else {
        Err(CheckError::Status(status))
    }
}

/// `grpc.health.v1.Health/Check` over HTTP/2 (h2c, or TLS with ALPN h2):
/// SERVING (1) with grpc-status 0 is healthy; anything else is a failed
/// check.
async fn grpc_check<S>(
    stream: S,
    scheme: &str,
    addr: SocketAddr,
    service: &str,
) -> Result<(), CheckError>
where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    fn bad<E>(_: E) -> CheckError {
        CheckError::BadResponse
    }
    let (send, conn) = h2::client::handshake(stream)
        .await
        .map_err(|_| CheckError::BadResponse)?;
    // The connection's I/O runs beside the request; it ends with the check.
    let driver = tokio::spawn(async move {
        let _ = conn.await;
    });
    let result = async {
        let mut send = send.ready().await.map_err(bad)?;
        let req = http::Request::builder()
            .method("POST")
            .uri(format!("{scheme}://{addr}/grpc.health.v1.Health/Check"))
            .header("content-type", "application/grpc")
            .header("te", "trailers")
            .header("user-agent", "pier-health")
            .body(())
            .map_err(bad)?;
        // HealthCheckRequest { service = 1 }: one length-prefixed message.
        let mut msg = Vec::with_capacity(2 + service.len());
        if !service.is_empty() {
            msg.push(0x0a);
            msg.push(service.len().min(127) as u8);
            msg.extend_from_slice(&service.as_bytes()[..service.len().min(127)]);
        }
        let mut frame = vec![0u8];
        frame.extend_from_slice(&(msg.len() as u32).to_be_bytes());
        frame.extend_from_slice(&msg);
        let (resp, mut body) = send.send_request(req, false).map_err(bad)?;
        body.send_data(bytes::Bytes::from(frame), true)
            .map_err(bad)?;
        let resp = resp.await.map_err(bad)?;
        if resp.status() != 200 {
            return Err(CheckError::Status(resp.status().as_u16()));
        }
        let trailers_only = resp.headers().get("grpc-status").cloned();
        let mut recv = resp.into_body();
        let mut data = Vec::new();
        while let Some(chunk) = recv.data().await {
            let chunk = chunk.map_err(bad)?;
            let _ = recv.flow_control().release_capacity(chunk.len());
            data.extend_from_slice(&chunk);
            if data.len() > 1024 {
                return Err(CheckError::BadResponse);
            }
        }
        let status = match trailers_only {
            Some(s) => Some(s),
            None => recv
                .trailers()
                .await
                .map_err(bad)?
                .and_then(|t| t.get("grpc-status").cloned()),
        };
        if status.as_ref().map(|s| s.as_bytes()) != Some(b"0") {
            return Err(CheckError::Status(200));
        }
        // HealthCheckResponse { status = 1 (SERVING) }, after the 5-byte prefix.
        if data.len() >= 5 && data[5..].windows(2).any(|w| w == [0x08, 0x01]) {
            Ok(())
        } else {
            Err(CheckError::BadResponse)
        }
    }
    .await;
    driver.abort();
    result
}

/// Largest response head a check reads.
const MAX_HEAD: usize = 16 * 1024;

/// Read the response head (bounded) with Pier's HTTP/1 codec; its status.
async fn read_status<S: AsyncRead + Unpin>(stream: &mut S) -> Result<u16, CheckError> {
    let mut buf = Vec::with_capacity(512);
    let mut chunk = [0u8; 1024];
    loop {
        if let Some(status) = parse_head(&buf)? {
            return Ok(status);
        }
        if buf.len() >= MAX_HEAD {
            return Err(CheckError::BadResponse);
        }
        let n = stream
            .read(&mut chunk)
            .await
            .map_err(|e| CheckError::Io(e.kind()))?;
        if n == 0 {
            return Err(CheckError::BadResponse);
        }
        buf.extend_from_slice(&chunk[..n]);
    }
}

/// `Ok(None)` = need more bytes. Any three-digit code (100..=999) is a
/// status, as a proxy must tolerate; the head is parsed by `pier-http`.
pub(crate) fn parse_head(buf: &[u8]) -> Result<Option<u16>, CheckError> {
    let limits = HeadLimits {
        max_header_bytes: MAX_HEAD,
        ..HeadLimits::default()
    };
    let mut head = ResponseHead::default();
    match head.parse(buf, &limits) {
        Ok(Some(_)) => Ok(Some(head.status)),
        Ok(None) => Ok(None),
        Err(_) => Err(CheckError::BadResponse),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn head_parsing() {
        assert_eq!(parse_head(b"HTTP/1.1 200 OK\r\n\r\n"), Ok(Some(200)));
        assert_eq!(parse_head(b"HTTP/1.0 503\r\n\r\n"), Ok(Some(503)));
        assert_eq!(parse_head(b"HTTP/1.1 299 x\n\n"), Ok(Some(299)));
        assert_eq!(
            parse_head(b"HTTP/1.1 999 odd\r\nContent-Length: 0\r\n\r\n"),
            Ok(Some(999))
        );
        // The status line alone is not a response yet.
        assert_eq!(parse_head(b"HTTP/1.1 200 OK\r\n"), Ok(None));
        assert_eq!(parse_head(b"HTTP/1.1 20"), Ok(None));
        assert_eq!(parse_head(b"HTT"), Ok(None));
        assert_eq!(parse_head(b""), Ok(None));
        for bad in [
            &b"SSH-2.0-OpenSSH\r\n"[..],
            b"HTTP/1.1 2000 OK\r\n\r\n",
            b"HTTP/1.1 abc\r\n\r\n",
            b"HTTP/1.1 099\r\n\r\n",
            b"HTTP/1.1 200 OK\r\nbad header: x\r\n\r\n",
        ] {
            assert_eq!(
                parse_head(bad),
                Err(CheckError::BadResponse),
                "{:?}",
                String::from_utf8_lossy(bad)
            );
        }
    }

    #[test]
    fn request_bytes() {
        let addr: SocketAddr = "[::1]:8080".parse().unwrap();
        assert_eq!(
            http_request("/hc", None, addr),
            b"GET /hc HTTP/1.1\r\nHost: [::1]:8080\r\nConnection: close\r\nUser-Agent: pier-health\r\n\r\n"
        );
        assert!(
            String::from_utf8(http_request("/", Some("svc.local"), addr))
                .unwrap()
                .contains("\r\nHost: svc.local\r\n")
        );
    }
}
