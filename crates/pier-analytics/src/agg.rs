//! Per-minute aggregation of request events into [`Rollup`]s keyed by
//! minute, host and route.

use crate::codec::{put_bytes, put_u64, DecodeError, Reader};
use crate::hll::Hll;
use crate::sketch::Latency;
use crate::topk::TopK;
use std::collections::{BTreeMap, HashMap};

type Fast = foldhash::fast::RandomState;
use std::fmt::Write as _;
use std::net::IpAddr;

/// Counters kept by each top-N summary of a rollup.
pub const TOPK_CAPACITY: usize = 64;
/// Host names are cut to this many bytes (DNS names are at most 253).
pub const MAX_HOST_LEN: usize = 255;
/// Host and route of the row that collects events past the key bound.
pub const OTHER: &str = "(other)";
const FORMAT: u8 = 1;

/// One finished request, borrowed from the proxy's request state.
#[derive(Clone, Copy, Debug)]
pub struct EventRef<'a> {
    /// Wall-clock Unix time of the request's end, in milliseconds.
    pub ts_ms: u64,
    pub host: &'a [u8],
    pub route: &'a str,
    /// Not aggregated yet; carried for future per-method views.
    pub method: &'a [u8],
    /// Path without the query string.
    pub path: &'a [u8],
    pub status: u16,
    pub bytes_in: u64,
    pub bytes_out: u64,
    pub duration_us: u64,
    /// Time spent on the upstream; 0 when there was no upstream.
    pub upstream_us: u64,
    pub client_ip: IpAddr,
    pub user_agent: &'a [u8],
    /// The rest is carried to the event stream (Kafka), not aggregated.
    /// The listener's name ("" when unnamed).
    pub listener: &'a str,
    /// The upstream server's address as text ("" when none was used).
    pub upstream: &'a [u8],
    /// Cache status: "" (no cache), "HIT", "MISS", "EXPIRED", ...
    pub cache: &'a str,
    /// "HTTP/1.0", "HTTP/1.1" or "HTTP/2.0".
    pub protocol: &'a str,
    /// "TLSv1.3", "TLSv1.2", or "" for cleartext.
    pub tls_version: &'a str,
    /// Fields a log hook added (`pier.analytics.field(name, value)`).
    pub extra: &'a [(&'a [u8], &'a [u8])],
    /// The request's W3C trace id as 32 lowercase hex chars, or empty when
    /// the request had no trace context (`[tracing]` not configured).
    pub trace_id: &'a [u8],
    /// The request's server span id as 16 lowercase hex chars, or empty.
    pub span_id: &'a [u8],
}

impl EventRef<'_> {
    /// An event with every field empty (tests and builders start here).
    pub const EMPTY: EventRef<'static> = EventRef {
        ts_ms: 0,
        host: b"",
        route: "",
        method: b"",
        path: b"",
        status: 0,
        bytes_in: 0,
        bytes_out: 0,
        duration_us: 0,
        upstream_us: 0,
        client_ip: IpAddr::V4(std::net::Ipv4Addr::UNSPECIFIED),
        user_agent: b"",
        listener: "",
        upstream: b"",
        cache: "",
        protocol: "",
        tls_version: "",
        extra: &[],
        trace_id: b"",
        span_id: b"",
    };
}

/// What a rollup is about: a time bucket, host and route.
#[derive(Clone, PartialEq, Eq, Hash, Ord, PartialOrd, Debug)]
pub struct Key {
    /// Unix seconds at the start of the minute, hour or day.
    pub bucket: i64,
    pub host: String,
    pub route: String,
}

/// Everything kept about a set of requests; merging two rollups gives the
/// rollup of the union of their requests.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Rollup {
    pub requests: u64,
    pub bytes_in: u64,
    pub bytes_out: u64,
    /// Responses by class: 1xx, 2xx, 3xx, 4xx, 5xx. Statuses below 200 count
    /// as 1xx and 500 or more as 5xx.
    pub status: [u64; 5],
    pub latency: Latency,
    /// Only requests that reached an upstream.
    pub upstream_latency: Latency,
    /// Client IPs, hashed from their text form (`192.0.2.7`, `2001:db8::1`),
    /// i.e. `hll_hash_text(host(ip))` in postgresql-hll.
    pub clients: Hll,
    pub top_paths: TopK,
    pub top_clients: TopK,
    pub top_agents: TopK,
}

impl Default for Rollup {
    fn default() -> Self {
        Self::new()
    }
}

/// Index of `status`'s class in [`Rollup::status`].
pub fn status_class(status: u16) -> usize {
    match status {
        0..=199 => 0,
        200..=299 => 1,
        300..=399 => 2,
        400..=499 => 3,
        _ => 4,
    }
}

/// A small stack buffer for formatting an IP without allocating.
struct IpText {
    buf: [u8; 48],
    len: usize,
}

impl std::fmt::Write for IpText {
    fn write_str(&mut self, s: &str) -> std::fmt::Result {
        let end = self.len + s.len();
        let dst = self.buf.get_mut(self.len..end).ok_or(std::fmt::Error)?;
        dst.copy_from_slice(s.as_bytes());
        self.len = end;
        Ok(())
    }
}

fn ip_text(ip: IpAddr) -> IpText {
    let mut t = IpText {
        buf: [0; 48],
        len: 0,
    };
    // IPv4-mapped IPv6 (dual-stack sockets) counts as the IPv4 client.
    match ip.to_canonical() {
        // By hand: `fmt` costs ~200 instructions an address, on every event.
        IpAddr::V4(v4) => {
            let mut n = itoa::Buffer::new();
            for (i, o) in v4.octets().iter().enumerate() {
                if i > 0 {
                    t.buf[t.len] = b'.';
                    t.len += 1;
                }
                let d = n.format(*o).as_bytes();
                t.buf[t.len..t.len + d.len()].copy_from_slice(d);
                t.len += d.len();
            }
        }
        // The longest form is 45 bytes, so the write cannot fail.
        v6 => {
            let _ = write!(t, "{v6}");
        }
    }
    t
}

/// A client as the rollups count it: its address as text (the top list)
/// and that text's postgresql-hll hash (unique clients). Formatting and
/// hashing cost ~300 instructions; the aggregator keeps the last one, since
/// a client's requests come in runs (keep-alive, one worker's batch).
struct Client {
    ip: IpAddr,
    text: IpText,
    hash: u64,
}

impl Client {
    fn of(ip: IpAddr) -> Client {
        let text = ip_text(ip);
        let hash = crate::hll::hash_bytes(&text.buf[..text.len]);
        Client { ip, text, hash }
    }

    fn text(&self) -> &[u8] {
        &self.text.buf[..self.text.len]
    }
}

impl Rollup {
    pub fn new() -> Self {
        Self {
            requests: 0,
            bytes_in: 0,
            bytes_out: 0,
            status: [0; 5],
            latency: Latency::new(),
            upstream_latency: Latency::new(),
            clients: Hll::new(),
            top_paths: TopK::new(TOPK_CAPACITY),
            top_clients: TopK::new(TOPK_CAPACITY),
            top_agents: TopK::new(TOPK_CAPACITY),
        }
    }

    /// Counts one request.
    pub fn add(&mut self, e: &EventRef) {
        self.add_client(e, &Client::of(e.client_ip));
    }

    /// Counts one request whose client's text and hash are known.
    fn add_client(&mut self, e: &EventRef, client: &Client) {
        self.requests += 1;
        self.bytes_in = self.bytes_in.saturating_add(e.bytes_in);
        self.bytes_out = self.bytes_out.saturating_add(e.bytes_out);
        self.status[status_class(e.status)] += 1;
        self.latency.add(e.duration_us);
        if e.upstream_us > 0 {
            self.upstream_latency.add(e.upstream_us);
        }
        self.clients.add_hash(client.hash);
        self.top_clients.add(client.text(), 1);
        self.top_paths
            .add(if e.path.is_empty() { b"/" } else { e.path }, 1);
        self.top_agents.add(
            if e.user_agent.is_empty() {
                b"-"
            } else {
                e.user_agent
            },
            1,
        );
    }

    /// Adds `o`'s requests to this rollup.
    pub fn merge(&mut self, o: &Rollup) {
        self.requests = self.requests.saturating_add(o.requests);
        self.bytes_in = self.bytes_in.saturating_add(o.bytes_in);
        self.bytes_out = self.bytes_out.saturating_add(o.bytes_out);
        for (a, b) in self.status.iter_mut().zip(o.status) {
            *a = a.saturating_add(b);
        }
        self.latency.merge(&o.latency);
        self.upstream_latency.merge(&o.upstream_latency);
        self.clients.merge(&o.clients);
        self.top_paths.merge(&o.top_paths);
        self.top_clients.merge(&o.top_clients);
        self.top_agents.merge(&o.top_agents);
    }

    /// One blob: format byte, the counters as varints, then each sketch's
    /// own encoding, length-prefixed.
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(256);
        out.push(FORMAT);
        for v in [self.requests, self.bytes_in, self.bytes_out] {
            put_u64(&mut out, v);
        }
        for v in self.status {
            put_u64(&mut out, v);
        }
        put_bytes(&mut out, &self.latency.to_bytes());
        put_bytes(&mut out, &self.upstream_latency.to_bytes());
        put_bytes(&mut out, &self.clients.to_bytes());
        put_bytes(&mut out, &self.top_paths.to_bytes());
        put_bytes(&mut out, &self.top_clients.to_bytes());
        put_bytes(&mut out, &self.top_agents.to_bytes());
        out
    }

    /// Parses [`Rollup::to_bytes`] output; rejects anything malformed.
    pub fn from_bytes(bytes: &[u8]) -> Result<Rollup, DecodeError> {
        let mut r = Reader::new(bytes);
        if r.u8()? != FORMAT {
            return Err(DecodeError("rollup: unknown format"));
        }
        let requests = r.u64()?;
        let bytes_in = r.u64()?;
        let bytes_out = r.u64()?;
        let mut status = [0; 5];
        for s in &mut status {
            *s = r.u64()?;
        }
        let rollup = Rollup {
            requests,
            bytes_in,
            bytes_out,
            status,
            latency: Latency::from_bytes(r.bytes()?)?,
            upstream_latency: Latency::from_bytes(r.bytes()?)?,
            clients: Hll::from_bytes(r.bytes()?)?,
            top_paths: TopK::from_bytes(r.bytes()?)?,
            top_clients: TopK::from_bytes(r.bytes()?)?,
            top_agents: TopK::from_bytes(r.bytes()?)?,
        };
        r.finish()?;
        Ok(rollup)
    }
}

/// Normalizes a Host header value: ASCII lower case, port stripped
/// (`example.com:8080`, `[::1]:443`), invalid UTF-8 replaced, cut to
/// [`MAX_HOST_LEN`] bytes, and `-` if empty.
pub fn normalize_host(host: &[u8], out: &mut String) {
    out.clear();
    let mut h = host;
    if h.first() == Some(&b'[') {
        // [v6]:port -> [v6]
        if let Some(end) = h.iter().position(|&b| b == b']') {
            h = &h[..=end];
        }
    } else if let Some(colon) = h.iter().position(|&b| b == b':') {
        // name:port; a bare IPv6 address (several colons) is left alone.
        if !h[colon + 1..].contains(&b':') {
            h = &h[..colon];
        }
    }
    let h = &h[..h.len().min(MAX_HOST_LEN)];
    match std::str::from_utf8(h) {
        Ok(t) => out.push_str(t),
        Err(_) => out.push_str(&String::from_utf8_lossy(h)),
    }
    out.make_ascii_lowercase();
    if out.is_empty() {
        out.push('-');
    }
}

/// Start of the minute containing `ts_ms`, in Unix seconds.
pub fn minute_of(ts_ms: u64) -> i64 {
    ((ts_ms / 60_000) * 60) as i64
}

/// The rollups of one minute.
#[derive(Default)]
struct Minute {
    /// host -> route -> position in `rows`.
    /// Bounded by `max_keys` rows; foldhash is seeded per process.
    index: HashMap<String, HashMap<String, usize, Fast>, Fast>,
    rows: Vec<(Key, Rollup)>,
    /// Keys admitted under the bound (the overflow row is not one).
    admitted: usize,
}

/// Builds per-minute rollups from events, in bounded memory: each minute
/// keeps at most `max_keys` (host, route) rows plus one `(other)` row that
/// collects events past the bound.
///
/// Events may arrive slightly out of order; one for a minute already taken
/// starts a fresh row for that minute, which the next `take_before` returns
/// and [`crate::Store::write_minutes`] merges into the stored one.
pub struct Aggregator {
    max_keys: usize,
    minutes: BTreeMap<i64, Minute>,
    overflowed: u64,
    host: String,
    /// The last event's minute, raw Host bytes and route, and its row:
    /// events of one batch mostly share them, and then skip the host
    /// normalization and both lookups. Cleared when minutes are taken.
    last: Option<(i64, Vec<u8>, String, usize)>,
    /// The last event's client (see [`Client`]).
    client: Option<Client>,
}

impl Aggregator {
    pub fn new(max_keys: usize) -> Self {
        Self {
            max_keys,
            minutes: BTreeMap::new(),
            overflowed: 0,
            host: String::new(),
            last: None,
            client: None,
        }
    }

    /// Counts one event in its minute's rollup.
    pub fn add(&mut self, e: &EventRef) {
        if self.client.as_ref().is_none_or(|c| c.ip != e.client_ip) {
            self.client = Some(Client::of(e.client_ip));
        }
        let Some(client) = &self.client else {
            return;
        };
        let bucket = minute_of(e.ts_ms);
        if let Some((b, host, route, row)) = &self.last {
            if *b == bucket && host.as_slice() == e.host && route == e.route {
                let row = *row;
                if let Some(m) = self.minutes.get_mut(&bucket) {
                    m.rows[row].1.add_client(e, client);
                    return;
                }
            }
        }
        normalize_host(e.host, &mut self.host);
        let minute = self.minutes.entry(bucket).or_default();
        let found = minute
            .index
            .get(self.host.as_str())
            .and_then(|routes| routes.get(e.route))
            .copied();
        let (row, cacheable) = match found {
            Some(i) => (i, true),
            None if minute.admitted < self.max_keys => {
                minute.admitted += 1;
                (insert_row(minute, bucket, &self.host, e.route), true)
            }
            None => {
                // Not remembered: each such event counts as overflowed.
                self.overflowed += 1;
                let other = minute.index.get(OTHER).and_then(|r| r.get(OTHER)).copied();
                let row = match other {
                    Some(i) => i,
                    None => insert_row(minute, bucket, OTHER, OTHER),
                };
                (row, false)
            }
        };
        minute.rows[row].1.add_client(e, client);
        if !cacheable {
            self.last = None;
            return;
        }
        let last = self.last.get_or_insert_with(Default::default);
        last.0 = bucket;
        last.1.clear();
        last.1.extend_from_slice(e.host);
        last.2.clear();
        last.2.push_str(e.route);
        last.3 = row;
    }

    /// Removes and returns every minute that starts before `minute_start_s`,
    /// sorted by key.
    pub fn take_before(&mut self, minute_start_s: i64) -> Vec<(Key, Rollup)> {
        self.last = None;
        let later = self.minutes.split_off(&minute_start_s);
        let earlier = std::mem::replace(&mut self.minutes, later);
        collect(earlier)
    }

    /// Removes and returns every minute (at shutdown), sorted by key.
    pub fn take_all(&mut self) -> Vec<(Key, Rollup)> {
        self.last = None;
        collect(std::mem::take(&mut self.minutes))
    }

    /// The minutes still open, for live views (in minute order).
    pub fn peek(&self) -> impl Iterator<Item = (&Key, &Rollup)> {
        self.minutes
            .values()
            .flat_map(|m| m.rows.iter().map(|(k, r)| (k, r)))
    }

    /// Events counted in an `(other)` row because their minute already had
    /// `max_keys` keys.
    pub fn overflowed(&self) -> u64 {
        self.overflowed
    }

    /// Number of open (minute, host, route) rows.
    pub fn len(&self) -> usize {
        self.minutes.values().map(|m| m.rows.len()).sum()
    }

    pub fn is_empty(&self) -> bool {
        self.minutes.is_empty()
    }
}

fn insert_row(minute: &mut Minute, bucket: i64, host: &str, route: &str) -> usize {
    let i = minute.rows.len();
    minute
        .index
        .entry(host.to_owned())
        .or_default()
        .insert(route.to_owned(), i);
    let key = Key {
        bucket,
        host: host.to_owned(),
        route: route.to_owned(),
    };
    minute.rows.push((key, Rollup::new()));
    i
}

fn collect(minutes: BTreeMap<i64, Minute>) -> Vec<(Key, Rollup)> {
    let mut out: Vec<(Key, Rollup)> = minutes.into_values().flat_map(|m| m.rows).collect();
    out.sort_by(|a, b| a.0.cmp(&b.0));
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::{Ipv4Addr, Ipv6Addr};

    /// Repeated events skip the lookups (`last`), yet every event past the
    /// key bound still counts as overflowed, and a new minute or another
    /// key is never served from the remembered row.
    #[test]
    fn remembered_row_keeps_counts_exact() {
        let mut a = Aggregator::new(1);
        a.add(&event(0, b"A.example", "r", 1));
        a.add(&event(1, b"A.example", "r", 2));
        a.add(&event(2, b"b.example", "r", 3));
        a.add(&event(3, b"b.example", "r", 4));
        a.add(&event(4, b"A.example", "r", 5));
        a.add(&event(5, b"A.example", "s", 6));
        a.add(&event(60_000, b"A.example", "r", 7));
        assert_eq!(a.overflowed(), 3);
        let rows = a.take_all();
        let n = |b: i64, h: &str| {
            rows.iter()
                .find(|(k, _)| k.bucket == b && k.host == h)
                .map(|(_, r)| r.requests)
        };
        assert_eq!(n(0, "a.example"), Some(3));
        assert_eq!(n(0, OTHER), Some(3));
        assert_eq!(n(60, "a.example"), Some(1));
        a.add(&event(5, b"A.example", "r", 8));
        assert_eq!(a.take_all().len(), 1, "the cache does not outlive take_all");
    }

    fn event<'a>(ts_ms: u64, host: &'a [u8], route: &'a str, ip: u32) -> EventRef<'a> {
        EventRef {
            ts_ms,
            host,
            route,
            method: b"GET",
            path: b"/x",
            status: 200,
            bytes_in: 10,
            bytes_out: 100,
            duration_us: 1000,
            upstream_us: 800,
            client_ip: IpAddr::V4(Ipv4Addr::from(ip)),
            user_agent: b"ua",
            ..EventRef::EMPTY
        }
    }

    #[test]
    fn host_normalization() {
        let mut s = String::new();
        for (input, want) in [
            (&b"Example.COM:8080"[..], "example.com"),
            (b"example.com", "example.com"),
            (b"[::1]:443", "[::1]"),
            (b"[2001:DB8::1]", "[2001:db8::1]"),
            (b"2001:db8::1", "2001:db8::1"),
            (b"", "-"),
            (b":80", "-"),
            (b"caf\xc3\xa9.example", "caf\u{e9}.example"),
            (b"bad\xff", "bad\u{fffd}"),
        ] {
            normalize_host(input, &mut s);
            assert_eq!(s, want, "{input:?}");
        }
        normalize_host(&[b'a'; 1000], &mut s);
        assert_eq!(s.len(), MAX_HOST_LEN);
    }

    #[test]
    fn counts_every_event_in_its_minute() {
        let mut agg = Aggregator::new(100);
        let t0 = 1_700_000_040_000; // 20 s before a minute boundary
        let mut n = 0u64;
        for i in 0..3000u64 {
            let host: &[u8] = if i % 3 == 0 {
                b"a.example"
            } else {
                b"B.example:80"
            };
            let route = if i % 5 == 0 { "api" } else { "web" };
            agg.add(&event(t0 + i * 30, host, route, i as u32 % 50));
            n += 1;
        }
        // 3000 events over 90 s: two minutes, 2 hosts x 2 routes each.
        assert_eq!(agg.len(), 8);
        let live: u64 = agg.peek().map(|(_, r)| r.requests).sum();
        assert_eq!(live, n);
        let first = agg.take_before(minute_of(t0) + 60);
        assert_eq!(first.len(), 4);
        assert!(first.iter().all(|(k, _)| k.bucket == minute_of(t0)));
        assert!(first.windows(2).all(|w| w[0].0 < w[1].0));
        let rest = agg.take_all();
        assert!(agg.is_empty());
        let total: u64 = first.iter().chain(&rest).map(|(_, r)| r.requests).sum();
        assert_eq!(total, n);
        let hosts: Vec<&str> = first.iter().map(|(k, _)| k.host.as_str()).collect();
        assert_eq!(hosts, ["a.example", "a.example", "b.example", "b.example"]);
        let r = &first[0].1;
        assert_eq!(r.bytes_out, r.requests * 100);
        assert_eq!(r.status[1], r.requests);
        assert!(r.clients.estimate() <= 50);
        assert_eq!(agg.overflowed(), 0);
    }

    #[test]
    fn keys_past_the_bound_go_to_other() {
        let mut agg = Aggregator::new(2);
        for i in 0..10u32 {
            let host = format!("h{i}.example");
            agg.add(&event(60_000, host.as_bytes(), "r", i));
        }
        agg.add(&event(60_000, b"h0.example", "r", 0)); // admitted key still counts
        let rows = agg.take_all();
        assert_eq!(rows.len(), 3);
        assert_eq!(agg.overflowed(), 8);
        let other = rows.iter().find(|(k, _)| k.host == OTHER).unwrap();
        assert_eq!(other.0.route, OTHER);
        assert_eq!(other.1.requests, 8);
        assert_eq!(rows.iter().map(|(_, r)| r.requests).sum::<u64>(), 11);
        // A new minute has its own bound.
        agg.add(&event(120_000, b"h9.example", "r", 0));
        assert_eq!(agg.take_all()[0].0.host, "h9.example");
    }

    #[test]
    fn rollup_fields_and_round_trip() {
        let mut r = Rollup::new();
        let mut e = event(0, b"h", "r", 1);
        for (status, upstream) in [(101, 0), (204, 5), (302, 5), (404, 5), (503, 5), (999, 5)] {
            e.status = status;
            e.upstream_us = upstream;
            r.add(&e);
        }
        e.client_ip = IpAddr::V6(Ipv4Addr::new(0, 0, 0, 1).to_ipv6_mapped());
        e.path = b"";
        e.user_agent = b"";
        r.add(&e);
        e.client_ip = IpAddr::V6(Ipv6Addr::LOCALHOST);
        r.add(&e);
        assert_eq!(r.status, [1, 1, 1, 1, 4]);
        assert_eq!(r.requests, 8);
        assert_eq!(r.latency.count(), 8);
        assert_eq!(r.upstream_latency.count(), 7);
        assert_eq!(r.clients.estimate(), 2); // 0.0.0.1 (twice, mapped) and ::1
        assert_eq!(r.top_clients.top(1), [("0.0.0.1".to_string(), 7)]);
        assert!(r.top_paths.top(5).contains(&("/".to_string(), 2)));
        assert!(r.top_agents.top(5).contains(&("-".to_string(), 2)));
        let mut want = Hll::new();
        want.add_bytes(b"0.0.0.1");
        want.add_bytes(b"::1");
        assert_eq!(r.clients, want);

        let back = Rollup::from_bytes(&r.to_bytes()).unwrap();
        assert_eq!(back, r);
        let mut m = r.clone();
        m.merge(&back);
        assert_eq!(m.requests, 16);
        assert_eq!(m.clients, r.clients);

        let bytes = r.to_bytes();
        assert!(Rollup::from_bytes(&bytes[..bytes.len() - 1]).is_err());
        assert!(Rollup::from_bytes(&[]).is_err());
        for i in 0..bytes.len() {
            let mut c = bytes.clone();
            c[i] ^= 0xff;
            let _ = Rollup::from_bytes(&c);
        }
    }
}
