//! The admin listener: `/healthz`, Prometheus `/metrics`, the analytics
//! API (`/api/analytics`, `/api/analytics/live` as server-sent events,
//! `/api/status`) and the `/dashboard` page shipped in the binary. Not a
//! hot path, so it favours plainness over speed. Requests are read with
//! pier-http's codec, the one HTTP/1 parser in the tree: a handful of GET
//! endpoints and one event stream don't call for a server crate.
//!
//! It shows client addresses and can purge the cache, so (issue 31):
//! - credentials (`[admin] token` or `user`/`password`) travel only in the
//!   `Authorization` header, never a cookie or a query string that a link
//!   or a form on another site could make a browser send;
//! - when set, every endpoint but `/healthz` and the (data-less)
//!   `/dashboard` page asks for them; without them, only loopback
//!   listeners start (pier-config), and read-only endpoints answer there as
//!   nginx's `stub_status` does;
//! - mutating endpoints (`/api/cache/purge`) always need credentials, and
//!   refuse what a page on another site can send without a CORS preflight:
//!   a cross-site `Origin` or `Sec-Fetch-Site`, a form's content types;
//! - the `Host` header must name this listener (an IP literal of it,
//!   `localhost` on loopback, or `[admin] hosts`), so a DNS-rebound name
//!   reads nothing.

use pier_proxy::Shared;
use std::fmt::Write as _;
use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};
use std::sync::Arc;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

/// The dashboard: one page, no external scripts (it must work offline).
const DASHBOARD: &str = include_str!("dashboard.html");
/// Live streams open at once (each costs a task and a JSON a second).
const MAX_STREAMS: usize = 32;
static STREAMS: AtomicUsize = AtomicUsize::new(0);

/// Serve the admin listener: HTTP/1.1, over TLS when `[admin.tls]` is set
/// (`tls`, built by pier-tls as a listener's is: bounded, timed handshakes).
pub async fn serve(
    listener: tokio::net::TcpListener,
    shared: Arc<Shared>,
    tls: Option<Arc<pier_tls::ServerTls>>,
) {
    let Ok(local) = listener.local_addr() else {
        return;
    };
    loop {
        let Ok((s, _)) = listener.accept().await else {
            continue;
        };
        let shared = shared.clone();
        let tls = tls.clone();
        tokio::task::spawn_local(async move {
            match tls {
                None => connection(s, shared, local).await,
                Some(t) => {
                    if let Some((s, _)) = t.accept(s, std::future::pending()).await {
                        connection(s, shared, local).await
                    }
                }
            }
        });
    }
}

/// Write `bytes` and flush them (a TLS stream holds records until flushed).
async fn say<S: AsyncWrite + Unpin>(s: &mut S, bytes: &[u8]) -> std::io::Result<()> {
    s.write_all(bytes).await?;
    s.flush().await
}

/// One admin connection, request after request (pipelined ones too).
async fn connection<S: AsyncRead + AsyncWrite + Unpin>(
    mut s: S,
    shared: Arc<Shared>,
    local: std::net::SocketAddr,
) {
    let mut buf = Vec::with_capacity(1024);
    loop {
        // A pipelined request may already be in `buf`: parse first.
        if !buf.is_empty() {
            let mut req = pier_http::RequestHead::default();
            match req.parse(&buf, &ADMIN_LIMITS) {
                Ok(Some(n)) => {
                    buf.drain(..n);
                    let close = !req.keep_alive();
                    let Some(body) = read_body(&mut s, &mut buf, &req).await else {
                        let _ = say(&mut s, b"HTTP/1.1 413 Content Too Large\r\nContent-Length: 0\r\nConnection: close\r\n\r\n").await;
                        return;
                    };
                    let r = handle(&req, &body, &shared, local).await;
                    if let Answer::Stream = r.body {
                        stream_live(s, shared).await;
                        return;
                    }
                    if write_answer(&mut s, &r, close).await.is_err() || close {
                        return;
                    }
                    continue;
                }
                Ok(None) => {}
                Err(_) => {
                    let _ = say(&mut s, b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\nConnection: close\r\n\r\n").await;
                    return;
                }
            }
        }
        let mut chunk = [0u8; 1024];
        let n = match tokio::time::timeout(std::time::Duration::from_secs(10), s.read(&mut chunk))
            .await
        {
            Ok(Ok(n)) if n > 0 => n,
            _ => return,
        };
        buf.extend_from_slice(&chunk[..n]);
        if buf.len() > 16384 {
            return;
        }
    }
}

const ADMIN_LIMITS: pier_http::HeadLimits = pier_http::HeadLimits {
    max_header_bytes: 16384,
    max_headers: 64,
    max_uri_bytes: 4096,
};

enum Answer {
    Text(String),
    Stream,
}

struct Reply {
    status: &'static str,
    ctype: &'static str,
    /// Extra header lines, each ending in CRLF.
    extra: String,
    body: Answer,
}

fn reply(status: &'static str, ctype: &'static str, body: String) -> Reply {
    Reply {
        status,
        ctype,
        extra: String::new(),
        body: Answer::Text(body),
    }
}

async fn write_answer<S: AsyncWrite + Unpin>(
    s: &mut S,
    r: &Reply,
    close: bool,
) -> std::io::Result<()> {
    let Answer::Text(body) = &r.body else {
        return Ok(());
    };
    let head = format!(
        "HTTP/1.1 {}\r\nContent-Type: {}\r\nContent-Length: {}\r\nCache-Control: no-store\r\n{}{}\r\n",
        r.status,
        r.ctype,
        body.len(),
        r.extra,
        if close { "Connection: close\r\n" } else { "" }
    );
    s.write_all(head.as_bytes()).await?;
    s.write_all(body.as_bytes()).await?;
    // A TLS stream holds records until flushed.
    s.flush().await
}

/// The URL's query parameters, percent-decoded.
fn params(query: &[u8]) -> Vec<(String, String)> {
    query
        .split(|&b| b == b'&')
        .filter(|p| !p.is_empty())
        .take(32)
        .map(|p| {
            let (k, v) = match p.iter().position(|&b| b == b'=') {
                Some(i) => (&p[..i], &p[i + 1..]),
                None => (p, &b""[..]),
            };
            (unescape(k), unescape(v))
        })
        .collect()
}

fn unescape(b: &[u8]) -> String {
    let hex = |c: u8| (c as char).to_digit(16).map(|d| d as u8);
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        match b[i] {
            b'+' => out.push(b' '),
            b'%' if i + 2 < b.len() => match (hex(b[i + 1]), hex(b[i + 2])) {
                (Some(h), Some(l)) => {
                    out.push(h << 4 | l);
                    i += 2;
                }
                _ => out.push(b'%'),
            },
            c => out.push(c),
        }
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// Compares without an early exit, so the time taken does not tell how
/// much of a guess was right.
fn same(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// Whether the request carries the credentials `[admin]` asks for (any one
/// of them), in its `Authorization` header: a bearer token or basic.
fn authorized(req: &pier_http::RequestHead, auth: &pier_config::AdminAuth) -> bool {
    let header = req.headers.get(b"authorization").unwrap_or(b"");
    if let Some(t) = &auth.token {
        if header.len() > 7
            && header[..7].eq_ignore_ascii_case(b"bearer ")
            && same(&header[7..], t.as_bytes())
        {
            return true;
        }
    }
    if let Some((user, pass)) = &auth.basic {
        if header.len() > 6 && header[..6].eq_ignore_ascii_case(b"basic ") {
            use base64::Engine as _;
            if let Ok(d) =
                base64::engine::general_purpose::STANDARD.decode(header[6..].trim_ascii())
            {
                let want = format!("{user}:{pass}");
                if same(&d, want.as_bytes()) {
                    return true;
                }
            }
        }
    }
    false
}

/// Whether `Host` names this listener rather than some name that happens to
/// resolve to it (DNS rebinding: a page on evil.example whose name is
/// re-pointed at 127.0.0.1 would read the answers as same-origin). An IP
/// literal of the listener (any, when it listens on all addresses; any
/// loopback one, when it is on loopback) passes, `localhost` on a loopback
/// listener, and the names in `[admin] hosts`; no `Host` at all (HTTP/1.0
/// tools) too, since a browser always sends one. The port is not compared:
/// an IP literal cannot be rebound, whatever the port.
fn host_ok(req: &pier_http::RequestHead, local: std::net::SocketAddr, hosts: &[String]) -> bool {
    let Some(h) = req.headers.get(b"host") else {
        return true;
    };
    let Ok(h) = std::str::from_utf8(h) else {
        return false;
    };
    let h = h.trim();
    let port_ok = |p: &str| p.is_empty() || (p.len() <= 5 && p.bytes().all(|b| b.is_ascii_digit()));
    let ip_ok = |ip: std::net::IpAddr| {
        let l = local.ip();
        ip == l || l.is_unspecified() || (ip.is_loopback() && l.is_loopback())
    };
    if let Some(rest) = h.strip_prefix('[') {
        let Some((ip, tail)) = rest.split_once(']') else {
            return false;
        };
        let port = match tail.strip_prefix(':') {
            Some(p) => p,
            None if tail.is_empty() => "",
            None => return false,
        };
        return port_ok(port)
            && ip
                .parse::<std::net::Ipv6Addr>()
                .is_ok_and(|ip| ip_ok(ip.into()));
    }
    let (name, port) = h.rsplit_once(':').unwrap_or((h, ""));
    if !port_ok(port) {
        return false;
    }
    if let Ok(ip) = name.parse::<std::net::Ipv4Addr>() {
        return ip_ok(ip.into());
    }
    let name = name.trim_end_matches('.').to_ascii_lowercase();
    (name == "localhost" && local.ip().is_loopback()) || hosts.contains(&name)
}

/// Why a state-changing request must be refused though its credentials
/// are good: what a page on another site can make a browser send without
/// a CORS preflight (a browser sends remembered basic credentials along).
/// A cross-site `Origin` or `Sec-Fetch-Site`, or a form's content type.
fn cross_site(req: &pier_http::RequestHead) -> bool {
    let h = |n: &[u8]| req.headers.get(n).map(|v| v.trim_ascii());
    if let Some(site) = h(b"sec-fetch-site") {
        if !site.eq_ignore_ascii_case(b"same-origin") && !site.eq_ignore_ascii_case(b"none") {
            return true;
        }
    }
    if let Some(origin) = h(b"origin") {
        // Same origin: `scheme://` then the Host this request came with.
        let host = h(b"host").unwrap_or(b"");
        let rest = origin
            .strip_prefix(b"http://")
            .or_else(|| origin.strip_prefix(b"https://"));
        if host.is_empty() || !rest.is_some_and(|r| r.eq_ignore_ascii_case(host)) {
            return true;
        }
    }
    if let Some(ct) = h(b"content-type") {
        let ct = ct.split(|&b| b == b';').next().unwrap_or(b"").trim_ascii();
        for form in [
            &b"application/x-www-form-urlencoded"[..],
            b"multipart/form-data",
            b"text/plain",
        ] {
            if ct.eq_ignore_ascii_case(form) {
                return true;
            }
        }
    }
    false
}

/// Largest admin request body (a purge's JSON).
const MAX_BODY: usize = 16384;

/// The request's body (by Content-Length, at most [`MAX_BODY`]), taken
/// from `buf` and the socket; None: too big, chunked, or the client went.
async fn read_body<S: AsyncRead + Unpin>(
    s: &mut S,
    buf: &mut Vec<u8>,
    req: &pier_http::RequestHead,
) -> Option<Vec<u8>> {
    if req.headers.get(b"transfer-encoding").is_some() {
        return None;
    }
    let n = match req.headers.get(b"content-length") {
        None => 0,
        Some(v) => std::str::from_utf8(v).ok()?.trim().parse::<usize>().ok()?,
    };
    if n > MAX_BODY {
        return None;
    }
    while buf.len() < n {
        let mut chunk = [0u8; 4096];
        let got = tokio::time::timeout(std::time::Duration::from_secs(10), s.read(&mut chunk))
            .await
            .ok()?
            .ok()?;
        if got == 0 {
            return None;
        }
        buf.extend_from_slice(&chunk[..got]);
    }
    Some(buf.drain(..n).collect())
}

/// `POST /api/cache/purge`: by `url` (its key and the keys a route's
/// header or cookie parts extend it with), `prefix` (of keys), `tag`
/// (`Surrogate-Key`/`Cache-Tag`) or exact `key`, in the query or a JSON
/// body (`tags` may be a list); `zone` limits it to one zone. Applied
/// here, then (with `[redis]`) published to the fleet. Answers how many
/// keys went and how many nodes received it.
async fn purge(
    method: &[u8],
    qs: &[(String, String)],
    body: &[u8],
    state: &pier_proxy::State,
) -> Reply {
    let (purged, p) = match purge_here(method, qs, body, state) {
        Ok(x) => x,
        Err(r) => return r,
    };
    let mut answer = serde_json::json!({ "purged": purged });
    if let Some(fleet) = pier_fleet::get() {
        let fleet = fleet.clone();
        // The publish blocks (a Redis round trip, bounded by its timeout):
        // off the runtime's threads.
        let sent = tokio::task::spawn_blocking(move || fleet.publish(&p)).await;
        match sent {
            Ok(Ok(nodes)) => answer["nodes"] = nodes.into(),
            Ok(Err(e)) => answer["fleet_error"] = e.into(),
            Err(e) => answer["fleet_error"] = e.to_string().into(),
        }
    }
    reply("200 OK", "application/json", answer.to_string() + "\n")
}

/// A purge published by another node of the fleet: the same as one made
/// here through the API; the objects removed.
pub fn apply_fleet_purge(state: &pier_proxy::State, p: &pier_fleet::Purge) -> usize {
    pier_proxy::purge::apply(state, p.zone.as_deref(), &p.asks).unwrap_or(0)
}

fn purge_here(
    method: &[u8],
    qs: &[(String, String)],
    body: &[u8],
    state: &pier_proxy::State,
) -> Result<(usize, pier_fleet::Purge), Reply> {
    let json_err = |status, e: &str| {
        reply(
            status,
            "application/json",
            serde_json::json!({ "error": e }).to_string() + "\n",
        )
    };
    if method != b"POST" && method != b"PURGE" {
        let mut r = json_err("405 Method Not Allowed", "use POST");
        r.extra.push_str("Allow: POST\r\n");
        return Err(r);
    }
    // (what, value): what is url, prefix, tag or key.
    let mut asks: Vec<(String, String)> = qs
        .iter()
        .filter(|(k, _)| matches!(k.as_str(), "url" | "prefix" | "tag" | "key" | "ban"))
        .cloned()
        .collect();
    let mut zone = qs.iter().find(|(k, _)| k == "zone").map(|(_, v)| v.clone());
    if !body.iter().all(u8::is_ascii_whitespace) {
        let v: serde_json::Value = match serde_json::from_slice(body) {
            Ok(v) => v,
            Err(e) => return Err(json_err("400 Bad Request", &format!("body: {e}"))),
        };
        let Some(o) = v.as_object() else {
            return Err(json_err("400 Bad Request", "body: expected a JSON object"));
        };
        for (k, v) in o {
            let what = match k.as_str() {
                "url" | "urls" => "url",
                "prefix" | "prefixes" => "prefix",
                "tag" | "tags" => "tag",
                "key" | "keys" => "key",
                "ban" | "bans" => "ban",
                "zone" => {
                    zone = v.as_str().map(str::to_string);
                    continue;
                }
                _ => {
                    return Err(json_err(
                        "400 Bad Request",
                        &format!("body: unknown field {k:?}"),
                    ))
                }
            };
            let vals: Vec<&serde_json::Value> = match v {
                serde_json::Value::Array(a) => a.iter().collect(),
                v => vec![v],
            };
            for x in vals {
                let Some(x) = x.as_str() else {
                    return Err(json_err(
                        "400 Bad Request",
                        &format!("body: {k} must be strings"),
                    ));
                };
                asks.push((what.to_string(), x.to_string()));
            }
        }
    }
    if asks.is_empty() {
        return Err(json_err(
            "400 Bad Request",
            "give url, prefix, tag, key or ban",
        ));
    }
    if asks.len() > pier_fleet::MAX_ASKS {
        return Err(json_err("400 Bad Request", "at most 1000 purges a request"));
    }
    match pier_proxy::purge::apply(state, zone.as_deref(), &asks) {
        Ok(n) => Ok((n, pier_fleet::Purge { zone, asks })),
        Err((status, e)) => Err(json_err(status, &e)),
    }
}

/// Endpoints that change state (they answer only with credentials).
fn mutating(path: &str) -> bool {
    path == "/api/cache/purge"
}

async fn handle(
    req: &pier_http::RequestHead,
    body: &[u8],
    shared: &Arc<Shared>,
    local: std::net::SocketAddr,
) -> Reply {
    let path = String::from_utf8_lossy(req.path()).into_owned();
    let qs = params(req.query().unwrap_or(b""));
    // Health checkers send whatever Host, and learn nothing but "draining".
    if path == "/healthz" {
        return if shared.draining() {
            reply("503 Service Unavailable", "text/plain", "draining\n".into())
        } else {
            reply("200 OK", "text/plain", "ok\n".into())
        };
    }
    let state = shared.state.load();
    let auth = &state.cfg.admin_auth;
    let refuse = |reason: &str, status, text: &str| {
        shared.metrics.admin_refused(reason);
        reply(status, "text/plain", format!("{text}\n"))
    };
    if !host_ok(req, local, &auth.hosts) {
        return refuse(
            "host",
            "421 Misdirected Request",
            "the Host header does not name this admin endpoint (add it to [admin] hosts)",
        );
    }
    // The page itself holds no data: its requests carry the credentials.
    let public = matches!(path.as_str(), "/dashboard" | "/dashboard/");
    if mutating(&path) && !auth.any() {
        return refuse(
            "no_credentials",
            "403 Forbidden",
            "set [admin] token (or pier proxy --admin-token) to use this endpoint",
        );
    }
    if auth.any() && !public && !authorized(req, auth) {
        let mut r = refuse("unauthorized", "401 Unauthorized", "unauthorized");
        if auth.basic.is_some() {
            r.extra
                .push_str("WWW-Authenticate: Basic realm=\"pier admin\"\r\n");
        }
        return r;
    }
    if mutating(&path) && cross_site(req) {
        return refuse(
            "cross_site",
            "403 Forbidden",
            "refused: a cross-site request or a form's content type (send JSON, or no body)",
        );
    }
    match path.as_str() {
        // Prometheus asks for OpenMetrics when it keeps exemplars: the
        // duration buckets then name a sampled request's trace.
        "/metrics" if pier_log::openmetrics::wanted(req.headers.get(b"accept").unwrap_or(b"")) => {
            reply(
                "200 OK",
                pier_log::openmetrics::CONTENT_TYPE,
                pier_log::openmetrics::convert(&render_metrics_with(shared, true)),
            )
        }
        "/metrics" => reply(
            "200 OK",
            "text/plain; version=0.0.4",
            render_metrics(shared),
        ),
        "/dashboard" | "/dashboard/" => {
            let mut r = reply("200 OK", "text/html; charset=utf-8", DASHBOARD.into());
            // Not to be framed by another site (clickjacking).
            r.extra.push_str(
                "X-Frame-Options: DENY\r\nContent-Security-Policy: frame-ancestors 'none'\r\n",
            );
            r
        }
        "/api/status" => reply("200 OK", "application/json", status_json(shared)),
        "/api/cache/purge" => purge(req.method(), &qs, body, &state).await,
        "/api/analytics" => {
            let Some(hub) = shared.analytics.clone() else {
                return reply(
                    "404 Not Found",
                    "application/json",
                    "{\"error\":\"analytics is off ([analytics] enabled = false)\"}\n".into(),
                );
            };
            let q = match pier_analytics::hub::query_of(&qs, wall_s()) {
                Ok(q) => q,
                Err(e) => {
                    return reply(
                        "400 Bad Request",
                        "application/json",
                        serde_json::json!({ "error": e }).to_string(),
                    )
                }
            };
            // SQLite reads block: off the control thread's runtime.
            match tokio::task::spawn_blocking(move || hub.query(&q)).await {
                Ok(Ok(report)) => reply(
                    "200 OK",
                    "application/json",
                    serde_json::to_string(&report).unwrap_or_default(),
                ),
                Ok(Err(e)) => reply(
                    "500 Internal Server Error",
                    "application/json",
                    serde_json::json!({ "error": e }).to_string(),
                ),
                Err(e) => reply(
                    "500 Internal Server Error",
                    "application/json",
                    serde_json::json!({ "error": e.to_string() }).to_string(),
                ),
            }
        }
        "/api/analytics/live" => {
            if shared.analytics.is_none() {
                return reply("404 Not Found", "text/plain", "analytics is off\n".into());
            }
            Reply {
                status: "200 OK",
                ctype: "text/event-stream",
                extra: String::new(),
                body: Answer::Stream,
            }
        }
        _ => reply("404 Not Found", "text/plain", "not found\n".into()),
    }
}

/// Unix seconds, from the clock the requests use.
fn wall_s() -> i64 {
    (pier_http::date::now_ns() / 1_000_000_000) as i64
}

/// Releases a live-stream slot however the stream ends.
struct StreamSlot;
impl Drop for StreamSlot {
    fn drop(&mut self) {
        STREAMS.fetch_sub(1, Relaxed);
    }
}

/// `/api/analytics/live`: the last two minutes of per-second figures at
/// once (`event: history`), then one second and a status snapshot each
/// second, until the client goes or Pier drains.
async fn stream_live<S: AsyncWrite + Unpin>(mut s: S, shared: Arc<Shared>) {
    if STREAMS.fetch_add(1, Relaxed) >= MAX_STREAMS {
        STREAMS.fetch_sub(1, Relaxed);
        let _ = say(&mut s, b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: text/plain\r\nContent-Length: 22\r\nConnection: close\r\n\r\ntoo many live streams\n")
            .await;
        return;
    }
    let _slot = StreamSlot;
    let Some(hub) = shared.analytics.clone() else {
        return;
    };
    let head = "HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nCache-Control: no-store\r\nConnection: close\r\n\r\n";
    if say(&mut s, head.as_bytes()).await.is_err() {
        return;
    }
    // The second before last is complete: workers hand events over once a second.
    let mut last = wall_s() - 2;
    let history = seconds_json(&hub, last - 120, last + 1);
    if say(
        &mut s,
        format!("event: history\ndata: {history}\n\n").as_bytes(),
    )
    .await
    .is_err()
    {
        return;
    }
    let mut tick = tokio::time::interval(std::time::Duration::from_secs(1));
    tick.tick().await;
    while !shared.draining() {
        tick.tick().await;
        let now = wall_s() - 2;
        if now <= last {
            continue;
        }
        let secs = seconds_json(&hub, last + 1, now + 1);
        last = now;
        let msg = format!(
            "event: second\ndata: {secs}\n\nevent: status\ndata: {}\n\n",
            status_json(&shared)
        );
        if say(&mut s, msg.as_bytes()).await.is_err() {
            return;
        }
    }
}

fn seconds_json(hub: &pier_analytics::hub::Hub, from: i64, to: i64) -> String {
    let secs = match hub.inner.lock() {
        Ok(g) => g.seconds(from, to),
        Err(_) => Vec::new(),
    };
    let v: Vec<_> = secs
        .iter()
        .map(|s| {
            serde_json::json!({
                "t": s.t,
                "requests": s.requests,
                "bytes_in": s.bytes_in,
                "bytes_out": s.bytes_out,
                "status": s.status,
                "p50_us": s.latency.quantile(0.5),
                "p90_us": s.latency.quantile(0.9),
                "p99_us": s.latency.quantile(0.99),
            })
        })
        .collect();
    serde_json::Value::Array(v).to_string()
}

/// Upstream health, pool reuse and connection counts: `/api/status` and the
/// live stream's `status` events.
fn status_json(shared: &Shared) -> String {
    let state = shared.state.load();
    let m = &shared.metrics;
    let upstreams: Vec<_> = state
        .groups
        .iter()
        .map(|g| {
            let peers: Vec<_> = g
                .peers()
                .iter()
                .map(|p| {
                    serde_json::json!({
                        "server": p.addr.to_string(),
                        "healthy": p.is_healthy(),
                        "active": p.active(),
                    })
                })
                .collect();
            serde_json::json!({ "name": g.name(), "servers": peers })
        })
        .collect();
    let a = shared.analytics.as_ref().map(|h| {
        let c = &h.counters;
        serde_json::json!({
            "events": c.events.load(Relaxed),
            "dropped": c.dropped.load(Relaxed),
            "store_errors": c.store_errors.load(Relaxed),
        })
    });
    serde_json::json!({
        "upstreams": upstreams,
        "pool": {
            "created": m.pool_created(),
            "reused": m.pool_reused(),
            "idle": shared.pool.idle_count(),
        },
        "active_connections": m.active_connections.load(Relaxed),
        "active_requests": m.active_requests.load(Relaxed),
        "analytics": a,
    })
    .to_string()
}

pub fn render_metrics(shared: &Shared) -> String {
    render_metrics_with(shared, false)
}

/// The Prometheus text; `exemplars` only for OpenMetrics.
fn render_metrics_with(shared: &Shared, exemplars: bool) -> String {
    let mut out = String::with_capacity(8192);
    shared.metrics.render(&mut out, exemplars);
    let state = shared.state.load();
    out.push_str("# HELP pier_upstream_healthy 1 if the server is eligible for traffic.\n# TYPE pier_upstream_healthy gauge\n");
    for g in &state.groups {
        for p in g.peers() {
            let _ = writeln!(
                out,
                "pier_upstream_healthy{{upstream=\"{}\",server=\"{}\"}} {}",
                g.name(),
                p.addr,
                p.is_healthy() as u8
            );
        }
    }
    out.push_str("# HELP pier_upstream_peers Servers in the group (after DNS resolution).\n# TYPE pier_upstream_peers gauge\n");
    for g in &state.groups {
        let _ = writeln!(
            out,
            "pier_upstream_peers{{upstream=\"{}\"}} {}",
            g.name(),
            g.peers().len()
        );
    }
    pier_lb::dns::stats().render(&mut out);
    out.push_str("# TYPE pier_upstream_active_requests gauge\n");
    for g in &state.groups {
        for p in g.peers() {
            let _ = writeln!(
                out,
                "pier_upstream_active_requests{{upstream=\"{}\",server=\"{}\"}} {}",
                g.name(),
                p.addr,
                p.active()
            );
        }
    }
    pier_tls::stats::stats().render(&mut out);
    pier_trace::export::render(&mut out);
    if let Some(f) = pier_fleet::get() {
        f.render(&mut out);
    }
    out.push_str("# HELP pier_proxy_protocol_total Connections on proxy_protocol listeners, by what their PROXY header did: ok (a client named), local (the balancer's own), untrusted (not from trusted_proxies: closed), invalid, timeout.\n# TYPE pier_proxy_protocol_total counter\n");
    for (i, r) in pier_proxy::proxy_protocol::RESULTS.iter().enumerate() {
        let n = pier_proxy::proxy_protocol::COUNTS[i].load(std::sync::atomic::Ordering::Relaxed);
        let _ = writeln!(out, "pier_proxy_protocol_total{{result=\"{r}\"}} {n}");
    }
    let [retries, handshakes, failed, early_served, early_refused, in_progress] =
        pier_proxy::quic_stats();
    let _ = writeln!(
        out,
        "# HELP pier_http3_retries_total QUIC Retry packets sent (address validation).\n# TYPE pier_http3_retries_total counter\npier_http3_retries_total {retries}\n# HELP pier_http3_handshakes_total QUIC handshakes, by result.\n# TYPE pier_http3_handshakes_total counter\npier_http3_handshakes_total{{result=\"ok\"}} {handshakes}\npier_http3_handshakes_total{{result=\"failed\"}} {failed}\n# HELP pier_http3_early_data_total Requests received in 0-RTT: served (replay-safe methods) or refused with 425.\n# TYPE pier_http3_early_data_total counter\npier_http3_early_data_total{{result=\"served\"}} {early_served}\npier_http3_early_data_total{{result=\"refused\"}} {early_refused}\n# HELP pier_http3_handshakes_in_progress QUIC handshakes in progress (above 64 on a worker, new clients get a Retry).\n# TYPE pier_http3_handshakes_in_progress gauge\npier_http3_handshakes_in_progress {in_progress}"
    );
    if !state.cache_zones.is_empty() {
        out.push_str("# HELP pier_cache_lookups_total Cache lookups by result.\n# TYPE pier_cache_lookups_total counter\n");
        for z in &state.cache_zones {
            let s = &z.stats;
            for (result, n) in [
                ("hit", &s.hit),
                ("miss", &s.miss),
                ("revalidated", &s.revalidated),
                ("expired", &s.expired),
                ("stale", &s.stale),
                ("updating", &s.updating),
                ("coalesced", &s.coalesced),
                ("pass", &s.pass),
            ] {
                let _ = writeln!(
                    out,
                    "pier_cache_lookups_total{{zone=\"{}\",result=\"{result}\"}} {}",
                    z.name,
                    n.get()
                );
            }
        }
        let _ = writeln!(
            out,
            "# HELP pier_cache_mapped_bodies Large cached bodies held in read-only mappings of their own.\n# TYPE pier_cache_mapped_bodies gauge\npier_cache_mapped_bodies {}\n# HELP pier_splice_bytes_total Cached body bytes spliced to clients without a copy.\n# TYPE pier_splice_bytes_total counter\npier_splice_bytes_total {}",
            pier_cache::mapped::mapped(),
            pier_proxy::splice_bytes()
        );
        out.push_str("# TYPE pier_cache_objects gauge\n# TYPE pier_cache_bytes gauge\n# TYPE pier_cache_capacity_bytes gauge\n# TYPE pier_cache_stored_total counter\n# TYPE pier_cache_evictions_total counter\n# TYPE pier_cache_lock_timeouts_total counter\n# TYPE pier_cache_promotions_total counter\n# TYPE pier_cache_disk_writes_total counter\n# TYPE pier_cache_disk_written_bytes_total counter\n# TYPE pier_cache_disk_skipped_total counter\n# TYPE pier_cache_disk_errors_total counter\n# TYPE pier_cache_disk_corrupt_total counter\n# TYPE pier_cache_disk_hits_total counter\n");
        for z in &state.cache_zones {
            let ((objects, bytes), disk) = z.tiers();
            let _ = writeln!(
                out,
                "pier_cache_objects{{zone=\"{n}\",tier=\"memory\"}} {objects}\npier_cache_bytes{{zone=\"{n}\",tier=\"memory\"}} {bytes}\npier_cache_capacity_bytes{{zone=\"{n}\",tier=\"memory\"}} {}\npier_cache_stored_total{{zone=\"{n}\"}} {}\npier_cache_evictions_total{{zone=\"{n}\",tier=\"memory\"}} {}\npier_cache_lock_timeouts_total{{zone=\"{n}\"}} {}",
                z.capacity(),
                z.stats.stored.get(),
                z.stats.evicted.get(),
                z.stats.lock_timeouts.get(),
                n = z.name,
            );
            if let Some((objects, bytes)) = disk {
                let d = &z.stats.disk;
                let _ = writeln!(
                    out,
                    "pier_cache_objects{{zone=\"{n}\",tier=\"disk\"}} {objects}\npier_cache_bytes{{zone=\"{n}\",tier=\"disk\"}} {bytes}\npier_cache_capacity_bytes{{zone=\"{n}\",tier=\"disk\"}} {}\npier_cache_evictions_total{{zone=\"{n}\",tier=\"disk\"}} {}\npier_cache_promotions_total{{zone=\"{n}\"}} {}\npier_cache_disk_writes_total{{zone=\"{n}\"}} {}\npier_cache_disk_written_bytes_total{{zone=\"{n}\"}} {}\npier_cache_disk_skipped_total{{zone=\"{n}\",reason=\"queue_full\"}} {}\npier_cache_disk_skipped_total{{zone=\"{n}\",reason=\"disk_full\"}} {}\npier_cache_disk_skipped_total{{zone=\"{n}\",reason=\"read_queue_full\"}} {}\npier_cache_disk_errors_total{{zone=\"{n}\"}} {}\npier_cache_disk_corrupt_total{{zone=\"{n}\"}} {}\npier_cache_disk_hits_total{{zone=\"{n}\"}} {}",
                    z.disk_capacity().unwrap_or(0),
                    d.evicted.load(Relaxed),
                    d.promotions.load(Relaxed),
                    d.writes.load(Relaxed),
                    d.bytes_written.load(Relaxed),
                    d.write_skipped_queue.load(Relaxed),
                    d.write_skipped_full.load(Relaxed),
                    d.read_skipped.load(Relaxed),
                    d.errors.load(Relaxed),
                    d.corrupt.load(Relaxed),
                    d.hits.load(Relaxed),
                    n = z.name,
                );
            }
        }
    }
    if state.listener_tls.iter().any(|t| t.is_some()) {
        out.push_str("# HELP pier_tls_certificate_expiry_seconds Seconds until the certificate's notAfter (negative: expired).\n# TYPE pier_tls_certificate_expiry_seconds gauge\n");
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs() as i64)
            .unwrap_or(0);
        for t in state.listener_tls.iter().flatten() {
            for c in t.certificates() {
                let _ = writeln!(
                    out,
                    "pier_tls_certificate_expiry_seconds{{listener=\"{}\",name=\"{}\"}} {}",
                    t.listener(),
                    c.name,
                    c.not_after - now
                );
            }
        }
    }
    out.push_str("# HELP pier_limit_denied_total Requests over a [[limit]] rule (refused, or only counted in dry run).\n# TYPE pier_limit_denied_total counter\n");
    for l in &state.limits {
        let _ = writeln!(
            out,
            "pier_limit_denied_total{{limit=\"{}\",dry_run=\"{}\"}} {}",
            l.rule.name,
            l.rule.dry_run,
            l.denied_total()
        );
    }
    global_limit_metrics(&state, &mut out);
    let _ = writeln!(
        out,
        "# TYPE pier_upstream_idle_connections gauge\npier_upstream_idle_connections {}",
        shared.pool.idle_count()
    );
    let _ = writeln!(
        out,
        "# TYPE pier_config_generation gauge\npier_config_generation {}",
        state.generation
    );
    if let Some(a) = &shared.analytics {
        let c = &a.counters;
        let _ = writeln!(
            out,
            "# HELP pier_analytics_events_total Request events the analytics thread rolled up.\n# TYPE pier_analytics_events_total counter\npier_analytics_events_total {}\n\
             # HELP pier_analytics_events_dropped_total Events dropped because the analytics queue was full.\n# TYPE pier_analytics_events_dropped_total counter\npier_analytics_events_dropped_total {}\n\
             # HELP pier_analytics_overflowed_total Events counted under (other) past max_keys.\n# TYPE pier_analytics_overflowed_total counter\npier_analytics_overflowed_total {}\n\
             # TYPE pier_analytics_rows_written_total counter\npier_analytics_rows_written_total {}\n\
             # TYPE pier_analytics_store_errors_total counter\npier_analytics_store_errors_total {}",
            c.events.load(Relaxed),
            c.dropped.load(Relaxed),
            c.overflowed.load(Relaxed),
            c.minutes_written.load(Relaxed),
            c.store_errors.load(Relaxed),
        );
        if let Some(sink) = &a.sink {
            let (sent, dropped, errors, queued) = sink.stats();
            let _ = writeln!(
                out,
                "# HELP pier_analytics_kafka_events_total Events sent to Kafka by result: sent (acknowledged), dropped (queue full, Kafka slow or down), error (never acknowledged).\n# TYPE pier_analytics_kafka_events_total counter\n\
                 pier_analytics_kafka_events_total{{result=\"sent\"}} {sent}\n\
                 pier_analytics_kafka_events_total{{result=\"dropped\"}} {dropped}\n\
                 pier_analytics_kafka_events_total{{result=\"error\"}} {errors}\n\
                 # TYPE pier_analytics_kafka_queued gauge\npier_analytics_kafka_queued {queued}"
            );
        }
    }
    out
}

/// `pier_limit_global_*`: the fleet's counts behind `scope = "global"`.
fn global_limit_metrics(state: &pier_proxy::State, out: &mut String) {
    let globals: Vec<&pier_limits::GlobalRate> = state
        .limits
        .iter()
        .filter_map(|l| l.global.as_deref())
        .collect();
    if globals.is_empty() {
        return;
    }
    // (family, type, help, labels after `limit`, value) per series.
    type Value = fn(&pier_limits::GlobalRate) -> u64;
    let series: [(&str, &str, &str, &str, Value); 6] = [
        ("pier_limit_global_unavailable_total", "counter", "Requests of a global limit decided while Redis was out of reach (admitted on the node's own count with fail = \"open\", refused with \"closed\").", "", |g| g.stats().unavailable.load(Relaxed)),
        ("pier_limit_global_overflow_total", "counter", "Requests of new keys past the global limit's key table, decided on the node's own count.", "", |g| g.stats().overflow.load(Relaxed)),
        ("pier_limit_global_syncs_total", "counter", "Exchanges of counts with Redis.", ",result=\"ok\"", |g| g.stats().syncs.load(Relaxed)),
        ("pier_limit_global_syncs_total", "counter", "", ",result=\"error\"", |g| g.stats().sync_errors.load(Relaxed)),
        ("pier_limit_global_nodes", "gauge", "Nodes in the fleet as of the last exchange.", "", |g| g.nodes()),
        ("pier_limit_global_keys", "gauge", "Keys a global limit holds on this node.", "", |g| g.keys() as u64),
    ];
    for (family, kind, help, labels, value) in series {
        // A family's second series (another label value) shares its header.
        if !help.is_empty() {
            let _ = writeln!(out, "# HELP {family} {help}\n# TYPE {family} {kind}");
        }
        for g in &globals {
            let _ = writeln!(
                out,
                "{family}{{limit=\"{}\"{labels}}} {}",
                g.name(),
                value(g)
            );
        }
    }
}
