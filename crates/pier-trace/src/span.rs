//! A finished span and its OTLP protobuf encoding
//! (opentelemetry-proto `ExportTraceServiceRequest`), written by hand: the
//! handful of messages a span needs, without a code generator.

/// OpenTelemetry's span kinds (the proto's numbers).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SpanKind {
    Internal = 1,
    Server = 2,
    Client = 3,
}

#[derive(Debug, Clone, PartialEq)]
pub enum Value {
    Str(String),
    Int(i64),
    Double(f64),
    Bool(bool),
}

/// A point in a span's time, with its own attributes (a hook's
/// `pier.trace.add_event`).
#[derive(Debug, Clone, PartialEq)]
pub struct Event {
    pub time_ns: u64,
    pub name: String,
    pub attributes: Vec<(String, Value)>,
}

/// One span, built when a sampled request (or one of its attempts) ends.
#[derive(Debug, Clone, PartialEq)]
pub struct Span {
    pub trace_id: [u8; 16],
    pub span_id: [u8; 8],
    pub parent: Option<[u8; 8]>,
    pub name: String,
    pub kind: SpanKind,
    pub start_ns: u64,
    pub end_ns: u64,
    /// Attribute names from OpenTelemetry's HTTP semantic conventions
    /// (`http.request.method`, …) and Pier's own (`pier.*`).
    pub attributes: Vec<(&'static str, Value)>,
    /// Attributes a hook added (`pier.trace.set_attribute`).
    pub extra: Vec<(String, Value)>,
    pub events: Vec<Event>,
    /// Status ERROR with this message (a 5xx, a failed attempt).
    pub error: Option<String>,
    /// The request's `tracestate`, kept as the client sent it.
    pub trace_state: Option<String>,
}

fn varint(out: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        out.push(v as u8 | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

fn tag(out: &mut Vec<u8>, field: u32, wire: u8) {
    varint(out, (u64::from(field) << 3) | u64::from(wire));
}

fn bytes(out: &mut Vec<u8>, field: u32, b: &[u8]) {
    tag(out, field, 2);
    varint(out, b.len() as u64);
    out.extend_from_slice(b);
}

fn fixed64(out: &mut Vec<u8>, field: u32, v: u64) {
    tag(out, field, 1);
    out.extend_from_slice(&v.to_le_bytes());
}

/// A length-delimited sub-message written by `f`.
fn message(out: &mut Vec<u8>, field: u32, f: impl FnOnce(&mut Vec<u8>)) {
    let mut body = Vec::new();
    f(&mut body);
    bytes(out, field, &body);
}

/// `KeyValue { key = 1; AnyValue value = 2 }`, `AnyValue { string = 1;
/// bool = 2; int = 3; double = 4 }`.
fn key_value(out: &mut Vec<u8>, field: u32, key: &str, v: &Value) {
    message(out, field, |kv| {
        bytes(kv, 1, key.as_bytes());
        message(kv, 2, |any| match v {
            Value::Str(s) => bytes(any, 1, s.as_bytes()),
            Value::Bool(b) => {
                tag(any, 2, 0);
                varint(any, *b as u64);
            }
            Value::Int(i) => {
                tag(any, 3, 0);
                varint(any, *i as u64);
            }
            Value::Double(d) => fixed64(any, 4, d.to_bits()),
        });
    });
}

impl Span {
    /// `Span` (trace_id = 1, span_id = 2, trace_state = 3, parent_span_id
    /// = 4, name = 5, kind = 6, start = 7, end = 8, attributes = 9, events
    /// = 11, status = 15).
    fn encode(&self, out: &mut Vec<u8>) {
        bytes(out, 1, &self.trace_id);
        bytes(out, 2, &self.span_id);
        if let Some(ts) = &self.trace_state {
            bytes(out, 3, ts.as_bytes());
        }
        if let Some(p) = &self.parent {
            bytes(out, 4, p);
        }
        bytes(out, 5, self.name.as_bytes());
        tag(out, 6, 0);
        varint(out, self.kind as u64);
        fixed64(out, 7, self.start_ns);
        fixed64(out, 8, self.end_ns.max(self.start_ns));
        for (k, v) in &self.attributes {
            key_value(out, 9, k, v);
        }
        for (k, v) in &self.extra {
            key_value(out, 9, k, v);
        }
        // Event { time_unix_nano = 1; name = 2; attributes = 3 }.
        for e in &self.events {
            message(out, 11, |m| {
                fixed64(m, 1, e.time_ns);
                bytes(m, 2, e.name.as_bytes());
                for (k, v) in &e.attributes {
                    key_value(m, 3, k, v);
                }
            });
        }
        if let Some(msg) = &self.error {
            // Status { message = 2; code = 3 (2: ERROR) }.
            message(out, 15, |s| {
                bytes(s, 2, msg.as_bytes());
                tag(s, 3, 0);
                varint(s, 2);
            });
        }
    }
}

/// One `ExportTraceServiceRequest` for `spans`: a ResourceSpans naming the
/// service, a ScopeSpans naming Pier.
pub fn encode_request(service_name: &str, spans: &[Span]) -> Vec<u8> {
    let mut out = Vec::with_capacity(128 + spans.len() * 256);
    message(&mut out, 1, |rs| {
        // Resource { attributes = 1 }.
        message(rs, 1, |r| {
            key_value(r, 1, "service.name", &Value::Str(service_name.to_string()));
        });
        // ScopeSpans { scope = 1; spans = 2 }.
        message(rs, 2, |ss| {
            message(ss, 1, |scope| {
                bytes(scope, 1, b"pier");
                bytes(scope, 2, env!("CARGO_PKG_VERSION").as_bytes());
            });
            for s in spans {
                message(ss, 2, |b| s.encode(b));
            }
        });
    });
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn varints_and_a_span_as_protobuf_spells_them() {
        let mut v = Vec::new();
        varint(&mut v, 300);
        assert_eq!(v, [0xac, 0x02]);
        let s = Span {
            trace_id: [1; 16],
            span_id: [2; 8],
            parent: None,
            name: "GET".into(),
            kind: SpanKind::Server,
            start_ns: 5,
            end_ns: 7,
            attributes: vec![("http.response.status_code", Value::Int(200))],
            extra: Vec::new(),
            events: Vec::new(),
            error: None,
            trace_state: None,
        };
        let mut b = Vec::new();
        s.encode(&mut b);
        // trace_id: field 1, wire 2, 16 bytes.
        assert_eq!(&b[..2], &[0x0a, 16]);
        assert_eq!(&b[2..18], &[1; 16]);
        // span_id: field 2.
        assert_eq!(&b[18..20], &[0x12, 8]);
        // name "GET": field 5.
        assert_eq!(&b[28..33], &[0x2a, 3, b'G', b'E', b'T']);
        // kind SERVER: field 6 varint 2.
        assert_eq!(&b[33..35], &[0x30, 2]);
        // start: field 7 fixed64.
        assert_eq!(b[35], 0x39);
        assert_eq!(&b[36..44], &5u64.to_le_bytes());
        let req = encode_request("svc", std::slice::from_ref(&s));
        assert_eq!(req[0], 0x0a);

        // A hook's attribute and event follow the span's own.
        let mut h = s;
        h.attributes.clear();
        h.extra.push(("k".into(), Value::Double(1.5)));
        h.events.push(Event {
            time_ns: 6,
            name: "e".into(),
            attributes: vec![("a".into(), Value::Bool(true))],
        });
        let mut b = Vec::new();
        h.encode(&mut b);
        let kv = [
            0x4a, 14, 0x0a, 1, b'k', 0x12, 9, 0x21, 0, 0, 0, 0, 0, 0, 0xf8, 0x3f,
        ];
        let at = b
            .windows(kv.len())
            .position(|w| w == kv)
            .expect("attribute");
        // event: field 11 (0x5a), time fixed64 6, name "e", attribute a=true.
        let ev = &b[at + kv.len()..];
        assert_eq!(ev[0], 0x5a);
        assert_eq!(&ev[2..11], &[0x09, 6, 0, 0, 0, 0, 0, 0, 0]);
        assert_eq!(&ev[11..14], &[0x12, 1, b'e']);
        assert_eq!(&ev[14..16], &[0x1a, 7]);
    }
}
