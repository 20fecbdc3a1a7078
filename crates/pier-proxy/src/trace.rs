//! `[tracing]` in the driver: each request's trace context (continued from
//! its `traceparent` or started here, `Step::Route`), the `traceparent`
//! each upstream attempt carries (its own client span as the parent,
//! `forward::Outgoing`), and, for a sampled request, its server span and
//! one client span per attempt, handed to the exporter when the request is
//! logged (`driver::finish`). With `[tracing]` absent none of this runs.

use crate::session::Session;
use crate::state::State;
use pier_trace::{Context, Span, SpanKind, Value};
use std::net::SocketAddr;

/// A request's tracing state, kept (boxed) in its session and reused by the
/// connection's next request.
#[derive(Debug)]
pub struct RequestTrace {
    /// False until the request is routed with `[tracing]` on.
    pub active: bool,
    pub ctx: Context,
    /// The `traceparent` the current attempt sends upstream.
    pub header: [u8; 55],
    /// The trace id and the server span id in hex (logs, Lua's
    /// `ngx.var.trace_id` and `span_id`).
    pub hex: [u8; 48],
    attempt: Option<Attempt>,
    /// Spans of the attempts that ended (sampled requests only).
    spans: Vec<Span>,
}

#[derive(Debug)]
struct Attempt {
    span_id: [u8; 8],
    start_ns: u64,
    peer: SocketAddr,
    number: u32,
    reused: Option<bool>,
}

/// The request's context, once its route (and so its root ratio) is known.
pub(crate) fn start(state: &State, sess: &mut Session) {
    if state.tracer.is_none() {
        return;
    }
    let threshold = sess
        .route
        .map(|r| state.routes[r].trace_threshold)
        .unwrap_or(state.trace_threshold);
    let ctx = Context::start(sess.req.headers.get(b"traceparent"), threshold);
    let t = sess.trace.get_or_insert_with(|| {
        Box::new(RequestTrace {
            active: false,
            ctx,
            header: [0; 55],
            hex: [0; 48],
            attempt: None,
            spans: Vec::new(),
        })
    });
    t.active = true;
    t.ctx = ctx;
    t.header = pier_trace::traceparent(&ctx.trace_id, &ctx.span_id, ctx.sampled);
    pier_trace::hex_into(&ctx.trace_id, &mut t.hex[..32]);
    pier_trace::hex_into(&ctx.span_id, &mut t.hex[32..]);
    t.attempt = None;
    t.spans.clear();
}

impl RequestTrace {
    pub fn trace_hex(&self) -> &[u8] {
        &self.hex[..32]
    }
    pub fn span_hex(&self) -> &[u8] {
        &self.hex[32..]
    }
    /// The `traceparent` of a request a hook makes (`pier.http`), which
    /// has no client span of its own: the server span is its parent.
    pub fn subrequest(&self) -> [u8; 55] {
        pier_trace::traceparent(&self.ctx.trace_id, &self.ctx.span_id, self.ctx.sampled)
    }
}

/// The request's trace, if it has one.
pub fn of(sess: &Session) -> Option<&RequestTrace> {
    sess.trace.as_deref().filter(|t| t.active)
}

/// An attempt at `peer` begins: its client span, named in the
/// `traceparent` it sends.
pub(crate) fn begin_attempt(sess: &mut Session, peer: SocketAddr, number: u32) {
    let Some(t) = sess.trace.as_deref_mut().filter(|t| t.active) else {
        return;
    };
    let span_id = pier_trace::span_id();
    t.header = pier_trace::traceparent(&t.ctx.trace_id, &span_id, t.ctx.sampled);
    if t.ctx.sampled {
        t.attempt = Some(Attempt {
            span_id,
            start_ns: pier_clock::system_ns(),
            peer,
            number,
            reused: None,
        });
    }
}

/// Whether the attempt's connection came from the pool.
pub(crate) fn attempt_reused(sess: &mut Session, reused: bool) {
    if let Some(a) = sess.trace.as_deref_mut().and_then(|t| t.attempt.as_mut()) {
        a.reused = Some(reused);
    }
}

/// The attempt ended: with the status it relayed, or how it failed.
pub(crate) fn end_attempt(sess: &mut Session, failed: Option<&str>) {
    let status = sess.status;
    let method = String::from_utf8_lossy(sess.req.method()).into_owned();
    let Some(t) = sess.trace.as_deref_mut().filter(|t| t.active) else {
        return;
    };
    let Some(a) = t.attempt.take() else {
        return;
    };
    let mut attributes = vec![
        ("http.request.method", Value::Str(method.clone())),
        ("server.address", Value::Str(a.peer.ip().to_string())),
        ("server.port", Value::Int(i64::from(a.peer.port()))),
        ("pier.attempt", Value::Int(i64::from(a.number))),
    ];
    if let Some(r) = a.reused {
        attributes.push(("pier.connection.reused", Value::Bool(r)));
    }
    if failed.is_none() && status > 0 {
        attributes.push(("http.response.status_code", Value::Int(i64::from(status))));
    }
    let error = match failed {
        Some(why) => Some(why.to_string()),
        None if status >= 500 => Some(format!("HTTP {status}")),
        None => None,
    };
    t.spans.push(Span {
        trace_id: t.ctx.trace_id,
        span_id: a.span_id,
        parent: Some(t.ctx.span_id),
        name: method,
        kind: SpanKind::Client,
        start_ns: a.start_ns,
        end_ns: pier_clock::system_ns(),
        attributes,
        error,
        trace_state: None,
    });
}

/// The request is done: its spans go to the exporter (sampled only).
pub(crate) fn finish(state: &State, sess: &mut Session, route: Option<usize>, dur_us: u64) {
    let Some(exporter) = &state.tracer else {
        return;
    };
    if !of(sess).is_some_and(|t| t.ctx.sampled) {
        return;
    }
    // An attempt still open (a panic, a client gone mid-exchange) ends here.
    end_attempt(sess, Some("request ended during the attempt"));
    let text = |b: &[u8]| String::from_utf8_lossy(b).into_owned();
    let method = text(sess.req.method());
    let route_name = route.map(|r| state.routes[r].name.as_str());
    let mut attributes = vec![
        ("http.request.method", Value::Str(method.clone())),
        ("url.path", Value::Str(text(sess.req.path()))),
        ("url.scheme", Value::Str(sess.scheme().to_string())),
        (
            "network.protocol.version",
            Value::Str(
                sess.conn
                    .proto
                    .version(sess.req.version)
                    .trim_start_matches("HTTP/")
                    .to_string(),
            ),
        ),
        ("client.address", Value::Str(sess.client_ip.clone())),
        (
            "http.response.status_code",
            Value::Int(i64::from(sess.status)),
        ),
    ];
    if let Some(h) = sess.req.host() {
        attributes.push(("server.address", Value::Str(text(h))));
    }
    if let Some(q) = sess.req.query() {
        attributes.push(("url.query", Value::Str(text(q))));
    }
    if let Some(ua) = sess.req.headers.get_known(pier_http::known::USER_AGENT) {
        attributes.push(("user_agent.original", Value::Str(text(ua))));
    }
    if let Some(r) = route_name {
        attributes.push(("http.route", Value::Str(r.to_string())));
    }
    let cache = sess.cache.as_str();
    if !cache.is_empty() {
        attributes.push(("pier.cache", Value::Str(cache.to_string())));
    }
    if !sess.reason.is_empty() {
        attributes.push(("pier.reason", Value::Str(sess.reason.to_string())));
    }
    let trace_state = sess.req.headers.get(b"tracestate").map(text);
    let start_ns = sess.now_ns;
    let Some(t) = sess.trace.as_deref_mut() else {
        return;
    };
    for s in t.spans.drain(..) {
        exporter.submit(s);
    }
    exporter.submit(Span {
        trace_id: t.ctx.trace_id,
        span_id: t.ctx.span_id,
        parent: t.ctx.parent,
        name: match route_name {
            Some(r) => format!("{method} {r}"),
            None => method,
        },
        kind: SpanKind::Server,
        start_ns,
        end_ns: start_ns + dur_us * 1000,
        attributes,
        error: (sess.status >= 500).then(|| format!("HTTP {}", sess.status)),
        trace_state,
    });
}
