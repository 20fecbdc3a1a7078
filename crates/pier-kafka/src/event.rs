//! The request event on the wire: one Cap'n Proto message
//! (`schema/event.capnp`, struct `Event`) per Kafka record, packed.

use crate::event_capnp::event;
use capnp::message::{Builder, ReaderOptions, ScratchSpaceHeapAllocator};
use pier_analytics::EventRef;
use std::fmt;
use std::net::{IpAddr, Ipv6Addr};

/// A record that is not a valid event (truncated, not Cap'n Proto, or a
/// field of the wrong shape).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DecodeError(pub String);

impl fmt::Display for DecodeError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "malformed event: {}", self.0)
    }
}

impl std::error::Error for DecodeError {}

impl From<capnp::Error> for DecodeError {
    fn from(e: capnp::Error) -> Self {
        DecodeError(e.to_string())
    }
}

/// The client address as the 16 bytes of the schema: IPv6 as is, IPv4 mapped
/// (`::ffff:a.b.c.d`).
pub fn ip_bytes(ip: IpAddr) -> [u8; 16] {
    match ip {
        IpAddr::V4(v4) => v4.to_ipv6_mapped().octets(),
        IpAddr::V6(v6) => v6.octets(),
    }
}

/// The inverse of [`ip_bytes`]; a mapped IPv4 address comes back as IPv4,
/// and 4 raw bytes are accepted as IPv4 too.
pub fn ip_from_bytes(b: &[u8]) -> Result<IpAddr, DecodeError> {
    match b.len() {
        16 => {
            let mut o = [0u8; 16];
            o.copy_from_slice(b);
            Ok(IpAddr::V6(Ipv6Addr::from(o)).to_canonical())
        }
        4 => Ok(IpAddr::from([b[0], b[1], b[2], b[3]])),
        n => Err(DecodeError(format!("client IP of {n} bytes"))),
    }
}

/// Encodes events, reusing its buffers: one allocation-free encode per event
/// once warmed up.
pub struct Encoder {
    scratch: Vec<capnp::Word>,
    out: Vec<u8>,
}

impl Default for Encoder {
    fn default() -> Self {
        Self::new()
    }
}

impl Encoder {
    pub fn new() -> Self {
        Self {
            // 1 KiB of first segment: an event with a long path and user
            // agent fits; a larger one spills to the heap.
            scratch: capnp::Word::allocate_zeroed_vec(128),
            out: Vec::with_capacity(512),
        }
    }

    /// The packed message for `e`, valid until the next call.
    pub fn encode(&mut self, e: &EventRef) -> &[u8] {
        // The allocator zeroes the scratch space (1 KiB) before use.
        let mut msg = Builder::new(ScratchSpaceHeapAllocator::new(
            capnp::Word::words_to_bytes_mut(&mut self.scratch),
        ));
        fill(msg.init_root::<event::Builder>(), e);
        self.out.clear();
        // Writing to a Vec cannot fail.
        let _ = capnp::serialize_packed::write_message(&mut self.out, &msg);
        &self.out
    }
}

fn fill(mut b: event::Builder, e: &EventRef) {
    b.set_ts_ms(e.ts_ms);
    b.set_listener(e.listener);
    b.set_host(e.host);
    b.set_route(e.route);
    b.set_method(e.method);
    b.set_path(e.path);
    b.set_status(e.status);
    b.set_bytes_in(e.bytes_in);
    b.set_bytes_out(e.bytes_out);
    b.set_duration_us(e.duration_us);
    b.set_upstream_us(e.upstream_us);
    b.set_upstream(e.upstream);
    b.set_cache(e.cache);
    b.set_protocol(e.protocol);
    b.set_tls_version(e.tls_version);
    b.set_client_ip(&ip_bytes(e.client_ip));
    b.set_user_agent(e.user_agent);
    // The ids travel as raw bytes (24, not 48), and come back as hex.
    let mut raw = [0u8; 16];
    if let Some(n) = unhex(e.trace_id, &mut raw) {
        b.set_trace_id(&raw[..n]);
    }
    if let Some(n) = unhex(e.span_id, &mut raw) {
        b.set_span_id(&raw[..n]);
    }
    if !e.extra.is_empty() {
        let n = e.extra.len().min(u32::MAX as usize);
        let mut list = b.init_extra(n as u32);
        for (i, (name, value)) in e.extra.iter().take(n).enumerate() {
            let mut f = list.reborrow().get(i as u32);
            f.set_name(name);
            f.set_value(value);
        }
    }
}

/// Lower-case hex of at most 32 digits into `out`; the byte count, or None
/// for an empty or malformed id (nothing is sent for it).
fn unhex(hex: &[u8], out: &mut [u8; 16]) -> Option<usize> {
    if hex.is_empty() || !hex.len().is_multiple_of(2) || hex.len() > 32 {
        return None;
    }
    fn digit(c: u8) -> Option<u8> {
        match c {
            b'0'..=b'9' => Some(c - b'0'),
            b'a'..=b'f' => Some(c - b'a' + 10),
            _ => None,
        }
    }
    for (i, pair) in hex.chunks_exact(2).enumerate() {
        out[i] = digit(pair[0])? << 4 | digit(pair[1])?;
    }
    Some(hex.len() / 2)
}

/// Raw id bytes (16 or 8, or none) back to hex in `out`; a record whose
/// id has another length is malformed.
fn id_hex<'a>(raw: &[u8], want: usize, out: &'a mut [u8; 32]) -> Result<&'a [u8], DecodeError> {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    match raw.len() {
        0 => Ok(&out[..0]),
        n if n == want => {
            for (i, b) in raw.iter().enumerate() {
                out[2 * i] = HEX[(b >> 4) as usize];
                out[2 * i + 1] = HEX[(b & 15) as usize];
            }
            Ok(&out[..2 * n])
        }
        n => Err(DecodeError(format!("trace or span id of {n} bytes"))),
    }
}

/// One event, encoded ([`Encoder`] reuses buffers; this allocates).
pub fn encode(e: &EventRef) -> Vec<u8> {
    Encoder::new().encode(e).to_vec()
}

/// Reader limits: an event is small; a hostile record cannot make the
/// reader walk more than this.
fn options() -> ReaderOptions {
    let mut o = ReaderOptions::new();
    o.traversal_limit_in_words(Some(1 << 20)).nesting_limit(8);
    o
}

fn text(t: capnp::Result<capnp::text::Reader<'_>>) -> Result<&str, DecodeError> {
    t?.to_str()
        .map_err(|_| DecodeError("text field is not UTF-8".into()))
}

/// Decodes one record and hands the event to `f` (borrowing from the decoded
/// message: no copy of its strings).
pub fn decode<R>(bytes: &[u8], f: impl FnOnce(&EventRef) -> R) -> Result<R, DecodeError> {
    let mut input = bytes;
    let msg = capnp::serialize_packed::read_message(&mut input, options())?;
    if !input.is_empty() {
        return Err(DecodeError("trailing bytes".into()));
    }
    let r = msg.get_root::<event::Reader>()?;
    let extra_list = r.get_extra()?;
    let mut extra = Vec::with_capacity(extra_list.len() as usize);
    for field in extra_list.iter() {
        extra.push((field.get_name()?, field.get_value()?));
    }
    let (mut trace_buf, mut span_buf) = ([0u8; 32], [0u8; 32]);
    let trace_id = id_hex(r.get_trace_id()?, 16, &mut trace_buf)?;
    let span_id = id_hex(r.get_span_id()?, 8, &mut span_buf)?;
    let e = EventRef {
        ts_ms: r.get_ts_ms(),
        host: r.get_host()?,
        route: text(r.get_route())?,
        method: r.get_method()?,
        path: r.get_path()?,
        status: r.get_status(),
        bytes_in: r.get_bytes_in(),
        bytes_out: r.get_bytes_out(),
        duration_us: r.get_duration_us(),
        upstream_us: r.get_upstream_us(),
        client_ip: ip_from_bytes(r.get_client_ip()?)?,
        user_agent: r.get_user_agent()?,
        listener: text(r.get_listener())?,
        upstream: r.get_upstream()?,
        cache: text(r.get_cache())?,
        protocol: text(r.get_protocol())?,
        tls_version: text(r.get_tls_version())?,
        extra: &extra,
        trace_id,
        span_id,
    };
    Ok(f(&e))
}

/// An event that owns its fields (tests, tools).
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub struct Event {
    pub ts_ms: u64,
    pub listener: String,
    pub host: Vec<u8>,
    pub route: String,
    pub method: Vec<u8>,
    pub path: Vec<u8>,
    pub status: u16,
    pub bytes_in: u64,
    pub bytes_out: u64,
    pub duration_us: u64,
    pub upstream_us: u64,
    pub upstream: Vec<u8>,
    pub cache: String,
    pub protocol: String,
    pub tls_version: String,
    pub client_ip: Option<IpAddr>,
    pub user_agent: Vec<u8>,
    pub extra: Vec<(Vec<u8>, Vec<u8>)>,
    /// Hex, as in the access log; empty without a trace.
    pub trace_id: Vec<u8>,
    pub span_id: Vec<u8>,
}

impl Event {
    pub fn from_ref(e: &EventRef) -> Event {
        Event {
            ts_ms: e.ts_ms,
            listener: e.listener.into(),
            host: e.host.into(),
            route: e.route.into(),
            method: e.method.into(),
            path: e.path.into(),
            status: e.status,
            bytes_in: e.bytes_in,
            bytes_out: e.bytes_out,
            duration_us: e.duration_us,
            upstream_us: e.upstream_us,
            upstream: e.upstream.into(),
            cache: e.cache.into(),
            protocol: e.protocol.into(),
            tls_version: e.tls_version.into(),
            client_ip: Some(e.client_ip),
            user_agent: e.user_agent.into(),
            extra: e
                .extra
                .iter()
                .map(|(k, v)| (k.to_vec(), v.to_vec()))
                .collect(),
            trace_id: e.trace_id.into(),
            span_id: e.span_id.into(),
        }
    }

    pub fn decode(bytes: &[u8]) -> Result<Event, DecodeError> {
        decode(bytes, Event::from_ref)
    }

    /// Runs `f` on a borrowed view of this event.
    pub fn with_ref<R>(&self, f: impl FnOnce(&EventRef) -> R) -> R {
        let extra: Vec<(&[u8], &[u8])> = self
            .extra
            .iter()
            .map(|(k, v)| (k.as_slice(), v.as_slice()))
            .collect();
        f(&EventRef {
            ts_ms: self.ts_ms,
            host: &self.host,
            route: &self.route,
            method: &self.method,
            path: &self.path,
            status: self.status,
            bytes_in: self.bytes_in,
            bytes_out: self.bytes_out,
            duration_us: self.duration_us,
            upstream_us: self.upstream_us,
            client_ip: self.client_ip.unwrap_or(EventRef::EMPTY.client_ip),
            user_agent: &self.user_agent,
            listener: &self.listener,
            upstream: &self.upstream,
            cache: &self.cache,
            protocol: &self.protocol,
            tls_version: &self.tls_version,
            extra: &extra,
            trace_id: &self.trace_id,
            span_id: &self.span_id,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::Ipv4Addr;

    fn full() -> Event {
        Event {
            ts_ms: 1_700_000_000_123,
            listener: "main".into(),
            host: b"Example.com:8080".to_vec(),
            route: "api".into(),
            method: b"GET".to_vec(),
            path: b"/users/\xff".to_vec(),
            status: 503,
            bytes_in: 120,
            bytes_out: u64::MAX,
            duration_us: 1800,
            upstream_us: 1500,
            upstream: b"127.0.0.1:3000".to_vec(),
            cache: "MISS".into(),
            protocol: "HTTP/2.0".into(),
            tls_version: "TLSv1.3".into(),
            client_ip: Some(IpAddr::V4(Ipv4Addr::new(192, 0, 2, 7))),
            user_agent: b"curl/8.5.0".to_vec(),
            extra: vec![
                (b"tenant".to_vec(), b"42".to_vec()),
                (b"".to_vec(), b"".to_vec()),
            ],
            trace_id: b"0af7651916cd43dd8448eb211c80319c".to_vec(),
            span_id: b"b7ad6b7169203331".to_vec(),
        }
    }

    #[test]
    fn round_trips_every_field() {
        let mut enc = Encoder::new();
        let e = full();
        let bytes = e.with_ref(|r| enc.encode(r).to_vec());
        assert_eq!(Event::decode(&bytes).unwrap(), e);
        // The encoder's buffers are reused: a second, different event.
        let mut e2 = full();
        e2.client_ip = Some("2001:db8::1".parse().unwrap());
        e2.extra.clear();
        e2.path = vec![b'p'; 5000]; // larger than the scratch segment
        let bytes2 = e2.with_ref(|r| enc.encode(r).to_vec());
        assert_eq!(Event::decode(&bytes2).unwrap(), e2);
        assert_eq!(Event::decode(&bytes).unwrap(), e);
        // Empty event.
        let empty = encode(&EventRef::EMPTY);
        let back = Event::decode(&empty).unwrap();
        assert_eq!(back.client_ip, Some(IpAddr::V4(Ipv4Addr::UNSPECIFIED)));
        assert!(empty.len() < 64, "{}", empty.len());
    }

    #[test]
    fn trace_ids_travel_as_bytes_and_malformed_ones_not_at_all() {
        let mut e = full();
        let with = e.with_ref(encode);
        e.trace_id = b"not hex at all, not hex at all!!".to_vec();
        e.span_id = b"B7AD6B7169203331".to_vec(); // upper case: not Pier's
        let without = e.with_ref(encode);
        let back = Event::decode(&without).unwrap();
        assert!(back.trace_id.is_empty() && back.span_id.is_empty());
        assert!(
            with.len() > without.len() + 16,
            "{} {}",
            with.len(),
            without.len()
        );
    }

    #[test]
    fn compact() {
        let e = full();
        let bytes = e.with_ref(encode);
        // Strings are ~70 bytes and the trace ids 24; fixed fields and
        // pointers pack well.
        assert!(bytes.len() < 240, "{} bytes", bytes.len());
    }

    #[test]
    fn mapped_and_raw_ips() {
        let v4 = IpAddr::V4(Ipv4Addr::new(10, 1, 2, 3));
        assert_eq!(ip_from_bytes(&ip_bytes(v4)).unwrap(), v4);
        assert_eq!(ip_from_bytes(&[10, 1, 2, 3]).unwrap(), v4);
        let v6: IpAddr = "::1".parse().unwrap();
        assert_eq!(ip_from_bytes(&ip_bytes(v6)).unwrap(), v6);
        assert!(ip_from_bytes(&[1, 2, 3]).is_err());
    }

    #[test]
    fn garbage_is_an_error_not_a_panic() {
        let bytes = full().with_ref(encode);
        assert!(Event::decode(&[]).is_err());
        assert!(Event::decode(&bytes[..bytes.len() - 3]).is_err());
        for i in 0..bytes.len() {
            for x in [0x01u8, 0x80, 0xff] {
                let mut c = bytes.clone();
                c[i] ^= x;
                let _ = Event::decode(&c);
            }
        }
        let mut seed = 0x9e3779b97f4a7c15u64;
        for len in 0..300 {
            let junk: Vec<u8> = (0..len)
                .map(|_| {
                    seed ^= seed << 13;
                    seed ^= seed >> 7;
                    seed ^= seed << 17;
                    seed as u8
                })
                .collect();
            let _ = Event::decode(&junk);
        }
    }
}
