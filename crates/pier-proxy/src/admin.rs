//! The admin listener: `/healthz` and Prometheus `/metrics`. Not a hot path,
//! so it favours plainness over speed. Requests are read with pier-http's
//! codec, the one HTTP/1 parser in the tree (two small GET endpoints don't
//! call for a server crate; the live dashboard of the analytics issue, with
//! server-sent events, may move this plane onto hyper).

use crate::Shared;
use std::fmt::Write as _;
use std::sync::Arc;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

pub async fn serve(listener: tokio::net::TcpListener, shared: Arc<Shared>) {
    loop {
        let Ok((mut s, _)) = listener.accept().await else {
            continue;
        };
        let shared = shared.clone();
        tokio::task::spawn_local(async move {
            let mut buf = Vec::with_capacity(1024);
            loop {
                let mut chunk = [0u8; 1024];
                let n = match tokio::time::timeout(
                    std::time::Duration::from_secs(10),
                    s.read(&mut chunk),
                )
                .await
                {
                    Ok(Ok(n)) if n > 0 => n,
                    _ => return,
                };
                buf.extend_from_slice(&chunk[..n]);
                if buf.len() > 16384 {
                    return;
                }
                let mut req = pier_http::RequestHead::default();
                match req.parse(&buf, &ADMIN_LIMITS) {
                    Ok(Some(n)) => {
                        let path = String::from_utf8_lossy(req.path()).into_owned();
                        let close = !req.keep_alive();
                        buf.drain(..n);
                        let (status, ctype, body) = route(&path, &shared);
                        let head = format!(
                            "HTTP/1.1 {status}\r\nContent-Type: {ctype}\r\nContent-Length: {}\r\n{}\r\n",
                            body.len(),
                            if close { "Connection: close\r\n" } else { "" }
                        );
                        if s.write_all(head.as_bytes()).await.is_err()
                            || s.write_all(body.as_bytes()).await.is_err()
                        {
                            return;
                        }
                        if close {
                            return;
                        }
                    }
                    Ok(None) => continue,
                    Err(_) => {
                        let _ = s.write_all(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\nConnection: close\r\n\r\n").await;
                        return;
                    }
                }
            }
        });
    }
}

const ADMIN_LIMITS: pier_http::HeadLimits = pier_http::HeadLimits {
    max_header_bytes: 16384,
    max_headers: 64,
    max_uri_bytes: 4096,
};

fn route(path: &str, shared: &Shared) -> (&'static str, &'static str, String) {
    match path {
        "/healthz" => {
            if shared.draining() {
                ("503 Service Unavailable", "text/plain", "draining\n".into())
            } else {
                ("200 OK", "text/plain", "ok\n".into())
            }
        }
        "/metrics" => (
            "200 OK",
            "text/plain; version=0.0.4",
            render_metrics(shared),
        ),
        _ => ("404 Not Found", "text/plain", "not found\n".into()),
    }
}

pub fn render_metrics(shared: &Shared) -> String {
    let mut out = String::with_capacity(8192);
    shared.metrics.render(&mut out);
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
    crate::dns::stats().render(&mut out);
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
    if !state.cache_zones.is_empty() {
        use std::sync::atomic::Ordering::Relaxed;
        out.push_str("# HELP pier_cache_lookups_total Cache lookups by result.\n# TYPE pier_cache_lookups_total counter\n");
        for z in &state.cache_zones {
            let s = &z.stats;
            for (result, n) in [
                ("hit", &s.hit),
                ("miss", &s.miss),
                ("revalidated", &s.revalidated),
                ("coalesced", &s.coalesced),
                ("pass", &s.pass),
            ] {
                let _ = writeln!(
                    out,
                    "pier_cache_lookups_total{{zone=\"{}\",result=\"{result}\"}} {}",
                    z.name,
                    n.load(Relaxed)
                );
            }
        }
        out.push_str("# TYPE pier_cache_objects gauge\n# TYPE pier_cache_bytes gauge\n# TYPE pier_cache_capacity_bytes gauge\n# TYPE pier_cache_stored_total counter\n# TYPE pier_cache_evictions_total counter\n# TYPE pier_cache_lock_timeouts_total counter\n");
        for z in &state.cache_zones {
            let (objects, bytes) = z.usage();
            let _ = writeln!(
                out,
                "pier_cache_objects{{zone=\"{n}\"}} {objects}\npier_cache_bytes{{zone=\"{n}\"}} {bytes}\npier_cache_capacity_bytes{{zone=\"{n}\"}} {}\npier_cache_stored_total{{zone=\"{n}\"}} {}\npier_cache_evictions_total{{zone=\"{n}\"}} {}\npier_cache_lock_timeouts_total{{zone=\"{n}\"}} {}",
                z.capacity(),
                z.stats.stored.load(Relaxed),
                z.stats.evicted.load(Relaxed),
                z.stats.lock_timeouts.load(Relaxed),
                n = z.name,
            );
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
    out
}
