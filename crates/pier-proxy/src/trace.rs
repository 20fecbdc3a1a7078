//! `[tracing]` in the driver: each request's trace context (continued from
//! its `traceparent` or started here, `Step::Route`), the `traceparent`
//! each upstream attempt carries (its own client span as the parent,
//! `forward::Outgoing`), and, for a sampled request, its server span and
//! one client span per attempt, handed to the exporter when the request is
//! logged (`driver::finish`). With `[tracing]` absent none of this runs.

use crate::session::Session;
use crate::state::State;
use pier_trace::{Context, Event, Span, SpanKind, Value};
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
    /// The trace id, the server span id and the flags in hex (logs, Lua's
    /// `ngx.var.trace_id`, `span_id` and `trace_flags`).
    pub hex: [u8; 50],
    attempt: Option<Attempt>,
    /// Spans of the attempts and Lua phases that ended (sampled requests
    /// only).
    spans: Vec<Span>,
    /// What hooks added to the server span (`pier.trace`), sampled only.
    extra: Vec<(String, Value)>,
    events: Vec<Event>,
    /// Time in `body_filter` hooks (one attribute, not a span per chunk).
    body_filter_ns: u64,
}

/// Bounds on what hooks add to a request's span (`pier.trace`).
pub const MAX_HOOK_ATTRIBUTES: usize = 32;
pub const MAX_HOOK_EVENTS: usize = 32;
pub const MAX_EVENT_ATTRIBUTES: usize = 16;
/// A key's length at most (1 at least).
pub const MAX_KEY: usize = 128;
/// A string value's length at most.
pub const MAX_VALUE: usize = 1024;

/// What a hook adds to its request's span.
#[derive(Debug)]
pub enum HookAdd<'a> {
    /// An attribute of the server span (a key set again is replaced).
    Attribute(&'a [u8], Value),
    /// An event at the current time.
    Event(&'a [u8]),
    /// An attribute of the latest event.
    EventAttribute(&'a [u8], Value),
}

/// Why a hook's addition was refused.
#[derive(Debug, PartialEq, Eq)]
pub enum HookRefused {
    /// A key empty, too long or not UTF-8; a value too long; a number not
    /// finite; an event attribute with no event.
    Invalid,
    /// Past a bound above.
    TooMany,
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
            hex: [0; 50],
            attempt: None,
            spans: Vec::new(),
            extra: Vec::new(),
            events: Vec::new(),
            body_filter_ns: 0,
        })
    });
    t.active = true;
    t.ctx = ctx;
    t.header = pier_trace::traceparent(&ctx.trace_id, &ctx.span_id, ctx.sampled);
    // The same hex, copied out of `00-<trace>-<span>-<flags>`.
    t.hex[..32].copy_from_slice(&t.header[3..35]);
    t.hex[32..48].copy_from_slice(&t.header[36..52]);
    t.hex[48..].copy_from_slice(&t.header[53..55]);
    t.attempt = None;
    t.spans.clear();
    t.extra.clear();
    t.events.clear();
    t.body_filter_ns = 0;
}

/// A hook's `pier.trace.set_attribute` / `add_event`: kept for a sampled
/// request's server span; accepted and dropped for one not sampled (or
/// without a trace), as OpenTelemetry's non-recording spans do. Every
/// value is checked: it comes from Lua.
pub fn hook_add(sess: &mut Session, add: HookAdd<'_>) -> Result<(), HookRefused> {
    fn key(k: &[u8]) -> Result<String, HookRefused> {
        match std::str::from_utf8(k) {
            Ok(s) if !s.is_empty() && s.len() <= MAX_KEY => Ok(s.to_string()),
            _ => Err(HookRefused::Invalid),
        }
    }
    fn value(v: Value) -> Result<Value, HookRefused> {
        match &v {
            Value::Str(s) if s.len() > MAX_VALUE => Err(HookRefused::Invalid),
            Value::Double(d) if !d.is_finite() => Err(HookRefused::Invalid),
            _ => Ok(v),
        }
    }
    let Some(t) = sess
        .trace
        .as_deref_mut()
        .filter(|t| t.active && t.ctx.sampled)
    else {
        // Checked all the same, so a hook's mistake shows whatever the
        // sampling.
        return match add {
            HookAdd::Attribute(k, v) | HookAdd::EventAttribute(k, v) => {
                key(k).and(value(v)).map(drop)
            }
            HookAdd::Event(k) => key(k).map(drop),
        };
    };
    match add {
        HookAdd::Attribute(k, v) => {
            let (k, v) = (key(k)?, value(v)?);
            if let Some(slot) = t.extra.iter_mut().find(|(n, _)| *n == k) {
                slot.1 = v;
            } else if t.extra.len() >= MAX_HOOK_ATTRIBUTES {
                return Err(HookRefused::TooMany);
            } else {
                t.extra.push((k, v));
            }
        }
        HookAdd::Event(name) => {
            let name = key(name)?;
            if t.events.len() >= MAX_HOOK_EVENTS {
                return Err(HookRefused::TooMany);
            }
            t.events.push(Event {
                time_ns: pier_clock::system_ns(),
                name,
                attributes: Vec::new(),
            });
        }
        HookAdd::EventAttribute(k, v) => {
            let (k, v) = (key(k)?, value(v)?);
            let e = t.events.last_mut().ok_or(HookRefused::Invalid)?;
            if e.attributes.len() >= MAX_EVENT_ATTRIBUTES {
                return Err(HookRefused::TooMany);
            }
            e.attributes.push((k, v));
        }
    }
    Ok(())
}

/// When a Lua phase starts, for [`lua_phase`]: a sampled request's only
/// (an unsampled one reads no clock for its hooks).
pub fn lua_start(sess: &Session) -> Option<u64> {
    of(sess)
        .is_some_and(|t| t.ctx.sampled)
        .then(pier_clock::system_ns)
}

/// A Lua phase (`lua access`, …) ran from `start_ns` until now: a child
/// span of the server span, with the time spent in the hook, its cosocket
/// waits included. `body_filter`, called per chunk, adds to one attribute
/// instead (`pier.lua.body_filter.duration_ns`).
pub fn lua_phase(sess: &mut Session, phase: &'static str, start_ns: u64) {
    let Some(t) = sess
        .trace
        .as_deref_mut()
        .filter(|t| t.active && t.ctx.sampled)
    else {
        return;
    };
    let end_ns = pier_clock::system_ns();
    if phase == "body_filter" {
        t.body_filter_ns += end_ns.saturating_sub(start_ns);
        return;
    }
    if t.spans.len() >= 64 {
        return;
    }
    t.spans.push(Span {
        trace_id: t.ctx.trace_id,
        span_id: pier_trace::span_id(),
        parent: Some(t.ctx.span_id),
        name: lua_span_name(phase).to_string(),
        kind: SpanKind::Internal,
        start_ns,
        end_ns,
        attributes: vec![("pier.lua.phase", Value::Str(phase.to_string()))],
        extra: Vec::new(),
        events: Vec::new(),
        error: None,
        trace_state: None,
    });
}

fn lua_span_name(phase: &str) -> &'static str {
    match phase {
        "access" => "lua access",
        "content" => "lua content",
        "balancer" => "lua balancer",
        "upstream_request" => "lua upstream_request",
        "header_filter" => "lua header_filter",
        "log" => "lua log",
        _ => "lua",
    }
}

impl RequestTrace {
    pub fn trace_hex(&self) -> &[u8] {
        &self.hex[..32]
    }
    pub fn span_hex(&self) -> &[u8] {
        &self.hex[32..48]
    }
    /// `01` sampled, `00` not (W3C trace-flags).
    pub fn flags_hex(&self) -> &[u8] {
        &self.hex[48..]
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
    // Unsampled, no client span is recorded: the attempt names the server
    // span as its parent, the header `start` made (no id, no formatting).
    if t.ctx.sampled {
        let span_id = pier_trace::span_id();
        t.header = pier_trace::traceparent(&t.ctx.trace_id, &span_id, true);
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
    // Only sampled attempts are recorded: nothing is allocated for others.
    let Some(a) = sess
        .trace
        .as_deref_mut()
        .filter(|t| t.active)
        .and_then(|t| t.attempt.take())
    else {
        return;
    };
    let method = String::from_utf8_lossy(sess.req.method()).into_owned();
    let Some(t) = sess.trace.as_deref_mut() else {
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
        extra: Vec::new(),
        events: Vec::new(),
        error,
        trace_state: None,
    });
}

/// A sampled request becomes its latency bucket's exemplar (OpenMetrics),
/// named by the hex ids it already holds.
pub(crate) fn exemplar(m: &pier_log::metrics::Metrics, sess: &Session, dur_us: u64) {
    if let Some(t) = of(sess).filter(|t| t.ctx.sampled) {
        let mut ids_hex = [0u8; 48];
        ids_hex.copy_from_slice(&t.hex[..48]);
        m.exemplar(pier_log::metrics::Exemplar {
            ids_hex,
            dur_us,
            ts_ms: sess.now_ns / 1_000_000 + dur_us / 1000,
        });
    }
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
    if t.body_filter_ns > 0 {
        attributes.push((
            "pier.lua.body_filter.duration_ns",
            Value::Int(t.body_filter_ns.min(i64::MAX as u64) as i64),
        ));
    }
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
        extra: std::mem::take(&mut t.extra),
        events: std::mem::take(&mut t.events),
        error: (sess.status >= 500).then(|| format!("HTTP {}", sess.status)),
        trace_state,
    });
}
