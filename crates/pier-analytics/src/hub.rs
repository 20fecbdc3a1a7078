//! Built-in analytics (docs/analytics.md): the hand-off from the logging
//! step and the one analytics thread that rolls events up.
//!
//! A worker never aggregates: its logging step copies the request's fields
//! into a thread-local [`Batch`] (fixed fields in one `Vec`, text in one
//! byte arena: no allocation per event once the buffers have grown), and
//! hands a full batch — or whatever it has, once a second — to the analytics
//! thread over a bounded channel. When that channel is full the batch is
//! dropped and counted, so a slow disk or a stuck query never slows a
//! request. The analytics thread adds events to the per-minute
//! [`Aggregator`], keeps a per-second ring for the live view, writes each
//! closed minute to the [`Store`] (which merges it into its hour and day)
//! and prunes old rows.

use crate::{sketch::Latency, Aggregator, EventRef, Query, Report, Step, Store};
use std::cell::RefCell;
use std::net::IpAddr;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::mpsc::{sync_channel, Receiver, RecvTimeoutError, SyncSender, TrySendError};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// Events per batch: big enough that the channel send is rare, small enough
/// that a batch is a few tens of KB.
const BATCH_EVENTS: usize = 256;
/// A minute is closed (written) this long after it ends: workers hand
/// batches over at least once a second, so events arrive a little late.
const CLOSE_AFTER_MS: u64 = 5_000;
/// Seconds of per-second history kept for the live view.
const LIVE_SECONDS: usize = 300;
/// Text fields are cut to this many bytes in the arena (a path or a
/// user agent can be 16 KB; analytics keeps the start).
const MAX_FIELD: usize = 512;

/// One event's fixed fields; text fields are (offset, length) in the arena.
struct Fixed {
    ts_ms: u64,
    bytes_in: u64,
    bytes_out: u64,
    duration_us: u64,
    upstream_us: u64,
    client_ip: IpAddr,
    status: u16,
    host: (u32, u32),
    route: (u32, u32),
    method: (u32, u32),
    path: (u32, u32),
    user_agent: (u32, u32),
    listener: (u32, u32),
    upstream: Option<std::net::SocketAddr>,
    protocol: &'static str,
    tls_version: &'static str,
    cache: &'static str,
    /// `extras[extra.0 .. extra.0 + extra.1]`: fields a log hook added.
    extra: (u32, u32),
    /// Hex trace and span ids in the arena (empty without a trace).
    trace_id: (u32, u32),
    span_id: (u32, u32),
}

/// A hook's field: (name, value) in the arena.
type Extra = ((u32, u32), (u32, u32));

/// Events copied out of their requests.
#[derive(Default)]
pub struct Batch {
    events: Vec<Fixed>,
    bytes: Vec<u8>,
    extras: Vec<Extra>,
}

impl Batch {
    fn put(&mut self, b: &[u8]) -> (u32, u32) {
        let b = &b[..b.len().min(MAX_FIELD)];
        let off = self.bytes.len() as u32;
        self.bytes.extend_from_slice(b);
        (off, b.len() as u32)
    }

    fn get(&self, r: (u32, u32)) -> &[u8] {
        &self.bytes[r.0 as usize..(r.0 + r.1) as usize]
    }

    fn push(
        &mut self,
        e: &EventRef<'_>,
        protocol: &'static str,
        tls: &'static str,
        upstream: Option<std::net::SocketAddr>,
    ) {
        let first = self.extras.len() as u32;
        for (k, v) in e.extra {
            let x = (self.put(k), self.put(v));
            self.extras.push(x);
        }
        let f = Fixed {
            ts_ms: e.ts_ms,
            bytes_in: e.bytes_in,
            bytes_out: e.bytes_out,
            duration_us: e.duration_us,
            upstream_us: e.upstream_us,
            client_ip: e.client_ip,
            status: e.status,
            host: self.put(e.host),
            route: self.put(e.route.as_bytes()),
            method: self.put(e.method),
            path: self.put(e.path),
            user_agent: self.put(e.user_agent),
            listener: self.put(e.listener.as_bytes()),
            upstream,
            protocol,
            tls_version: tls,
            cache: cache_status(e.cache),
            extra: (first, e.extra.len() as u32),
            trace_id: self.put(e.trace_id),
            span_id: self.put(e.span_id),
        };
        self.events.push(f);
    }

    pub fn len(&self) -> usize {
        self.events.len()
    }

    pub fn is_empty(&self) -> bool {
        self.events.is_empty()
    }

    /// Each event, borrowed back out of the batch; with `upstream`, the
    /// upstream address formatted as text (for a sink; the rollups don't
    /// read it).
    pub fn for_each(&self, upstream: bool, mut f: impl FnMut(&EventRef<'_>)) {
        let mut extra: Vec<(&[u8], &[u8])> = Vec::new();
        let mut up = Vec::with_capacity(64);
        for e in &self.events {
            up.clear();
            if let (true, Some(a)) = (upstream, e.upstream) {
                use std::io::Write as _;
                let _ = write!(up, "{a}");
            }
            let text = |r| std::str::from_utf8(self.get(r)).unwrap_or("");
            extra.clear();
            for &(k, v) in &self.extras[e.extra.0 as usize..(e.extra.0 + e.extra.1) as usize] {
                extra.push((self.get(k), self.get(v)));
            }
            f(&EventRef {
                ts_ms: e.ts_ms,
                host: self.get(e.host),
                route: text(e.route),
                method: self.get(e.method),
                path: self.get(e.path),
                status: e.status,
                bytes_in: e.bytes_in,
                bytes_out: e.bytes_out,
                duration_us: e.duration_us,
                upstream_us: e.upstream_us,
                client_ip: e.client_ip,
                user_agent: self.get(e.user_agent),
                listener: text(e.listener),
                upstream: &up,
                cache: e.cache,
                protocol: e.protocol,
                tls_version: e.tls_version,
                extra: &extra,
                trace_id: self.get(e.trace_id),
                span_id: self.get(e.span_id),
            });
        }
    }
}

/// The cache statuses Pier logs, as `'static` strings (an event keeps no
/// borrowed text outside its arena).
fn cache_status(s: &str) -> &'static str {
    match s {
        "HIT" => "HIT",
        "MISS" => "MISS",
        "EXPIRED" => "EXPIRED",
        "REVALIDATED" => "REVALIDATED",
        "STALE" => "STALE",
        "UPDATING" => "UPDATING",
        "COALESCED" => "COALESCED",
        "PASS" => "PASS",
        "" => "",
        _ => "OTHER",
    }
}

/// TLS versions as `'static` strings.
pub fn tls_version(s: &str) -> &'static str {
    match s {
        "TLSv1.3" => "TLSv1.3",
        "TLSv1.2" => "TLSv1.2",
        "" => "",
        _ => "other",
    }
}

thread_local! {
    static BATCH: RefCell<Batch> = RefCell::new(Batch::default());
}

enum Msg {
    Batch(Batch),
    Stop(std::sync::mpsc::Sender<()>),
}

/// Where events also go, besides the embedded rollups (the Kafka sink of
/// `[analytics.kafka]`, made by the binary: this crate builds no Kafka
/// client). Called from the analytics thread only; must never block.
pub trait EventSink: Send + Sync {
    fn offer(&self, e: &EventRef<'_>);
    /// (sent, dropped, errors, queued).
    fn stats(&self) -> (u64, u64, u64, u64);
    /// At shutdown: wait up to `timeout` for what is queued.
    fn flush(&self, timeout: Duration);
}

/// Counters shown in /metrics.
#[derive(Default)]
pub struct Counters {
    pub events: AtomicU64,
    pub dropped: AtomicU64,
    pub overflowed: AtomicU64,
    pub store_errors: AtomicU64,
    pub minutes_written: AtomicU64,
}

/// One second of the live view.
#[derive(Clone, Default)]
pub struct Second {
    pub t: i64,
    pub requests: u64,
    pub bytes_in: u64,
    pub bytes_out: u64,
    pub status: [u64; 5],
    pub latency: Latency,
}

/// What the analytics thread shares with queries.
pub struct Inner {
    pub agg: Aggregator,
    pub store: Store,
    live: Vec<Second>,
}

impl Inner {
    fn live_add(&mut self, e: &EventRef<'_>) {
        let t = (e.ts_ms / 1000) as i64;
        let slot = &mut self.live[t as usize % LIVE_SECONDS];
        if slot.t != t {
            if slot.t > t {
                return; // older than the ring
            }
            *slot = Second {
                t,
                ..Second::default()
            };
        }
        slot.requests += 1;
        slot.bytes_in += e.bytes_in;
        slot.bytes_out += e.bytes_out;
        slot.status[crate::agg::status_class(e.status)] += 1;
        slot.latency.add(e.duration_us);
    }

    /// The live seconds in [from, to), oldest first; seconds without
    /// traffic come back empty.
    pub fn seconds(&self, from: i64, to: i64) -> Vec<Second> {
        (from.max(to - LIVE_SECONDS as i64)..to)
            .map(|t| {
                let s = &self.live[t as usize % LIVE_SECONDS];
                if s.t == t {
                    s.clone()
                } else {
                    Second {
                        t,
                        ..Second::default()
                    }
                }
            })
            .collect()
    }
}

/// The analytics of one process: the sender workers hand batches to, and
/// the state the analytics thread keeps.
pub struct Hub {
    tx: SyncSender<Msg>,
    pub inner: Arc<Mutex<Inner>>,
    pub counters: Arc<Counters>,
    pub sink: Option<Arc<dyn EventSink>>,
    thread: Mutex<Option<std::thread::JoinHandle<()>>>,
}

impl Hub {
    /// Open the store (`cfg.path`, or memory) and start the thread.
    pub fn start(
        cfg: &pier_config::Analytics,
        sink: Option<Arc<dyn EventSink>>,
    ) -> Result<Hub, String> {
        let path = cfg
            .path
            .clone()
            .unwrap_or_else(|| std::path::PathBuf::from(":memory:"));
        pier_log::fields::enable(true);
        let store =
            Store::open(&path).map_err(|e| format!("analytics store {}: {e}", path.display()))?;
        let inner = Arc::new(Mutex::new(Inner {
            agg: Aggregator::new(cfg.max_keys),
            store,
            live: vec![Second::default(); LIVE_SECONDS],
        }));
        let counters = Arc::new(Counters::default());
        let (tx, rx) = sync_channel(cfg.queue.div_ceil(BATCH_EVENTS).max(2));
        let keep = [cfg.keep_minutes, cfg.keep_hours, cfg.keep_days].map(|d| d.as_secs() as i64);
        let thread = {
            let (inner, counters, sink) = (inner.clone(), counters.clone(), sink.clone());
            std::thread::Builder::new()
                .name("pier-analytics".into())
                .spawn(move || run(rx, inner, counters, keep, sink))
                .map_err(|e| format!("analytics thread: {e}"))?
        };
        Ok(Hub {
            tx,
            inner,
            counters,
            sink,
            thread: Mutex::new(Some(thread)),
        })
    }

    /// The logging step: copy one event into this thread's batch.
    pub fn record(
        &self,
        e: &EventRef<'_>,
        protocol: &'static str,
        tls: &'static str,
        upstream: Option<std::net::SocketAddr>,
    ) {
        let full = BATCH.with(|b| {
            let mut b = b.borrow_mut();
            b.push(e, protocol, tls, upstream);
            b.len() >= BATCH_EVENTS
        });
        if full {
            self.flush();
        }
    }

    /// Hand this thread's batch over (workers call it every second).
    pub fn flush(&self) {
        let batch = BATCH.with(|b| {
            let mut b = b.borrow_mut();
            if b.is_empty() {
                return None;
            }
            let cap = b.bytes.capacity();
            Some(std::mem::replace(
                &mut *b,
                Batch {
                    events: Vec::with_capacity(BATCH_EVENTS),
                    bytes: Vec::with_capacity(cap),
                    extras: Vec::new(),
                },
            ))
        });
        let Some(batch) = batch else { return };
        let n = batch.len() as u64;
        match self.tx.try_send(Msg::Batch(batch)) {
            Ok(()) => {}
            Err(TrySendError::Full(_)) | Err(TrySendError::Disconnected(_)) => {
                self.counters.dropped.fetch_add(n, Relaxed);
            }
        }
    }

    /// Write every open minute and stop the thread (shutdown). Waits for
    /// the batches already queued.
    pub fn stop(&self) {
        let (tx, rx) = std::sync::mpsc::channel();
        if self.tx.send(Msg::Stop(tx)).is_ok() {
            let _ = rx.recv_timeout(Duration::from_secs(10));
        }
        if let Some(t) = self.thread.lock().ok().and_then(|mut t| t.take()) {
            let _ = t.join();
        }
    }

    /// A report over stored minutes plus the minutes still open.
    pub fn query(&self, q: &Query) -> Result<Report, String> {
        let g = self.inner.lock().map_err(|_| "analytics state poisoned")?;
        g.store
            .query_with(g.agg.peek(), q)
            .map_err(|e| e.to_string())
    }
}

/// The analytics thread.
fn run(
    rx: Receiver<Msg>,
    inner: Arc<Mutex<Inner>>,
    counters: Arc<Counters>,
    keep: [i64; 3],
    sink: Option<Arc<dyn EventSink>>,
) {
    let mut last_close = 0u64;
    let mut last_prune = 0u64;
    loop {
        let msg = rx.recv_timeout(Duration::from_millis(500));
        let stop = match msg {
            Ok(Msg::Batch(b)) => {
                let mut g = match inner.lock() {
                    Ok(g) => g,
                    Err(p) => p.into_inner(),
                };
                b.for_each(false, |e| {
                    g.agg.add(e);
                    g.live_add(e);
                });
                drop(g);
                if let Some(sink) = &sink {
                    b.for_each(true, |e| sink.offer(e));
                }
                counters.events.fetch_add(b.len() as u64, Relaxed);
                None
            }
            Ok(Msg::Stop(done)) => Some(Some(done)),
            Err(RecvTimeoutError::Timeout) => None,
            Err(RecvTimeoutError::Disconnected) => Some(None),
        };
        let now = pier_http::date::now_ns() / 1_000_000;
        if let Some(done) = stop {
            // Drain what the workers handed over before the stop.
            let mut g = match inner.lock() {
                Ok(g) => g,
                Err(p) => p.into_inner(),
            };
            while let Ok(Msg::Batch(b)) = rx.try_recv() {
                b.for_each(sink.is_some(), |e| {
                    g.agg.add(e);
                    if let Some(sink) = &sink {
                        sink.offer(e);
                    }
                });
                counters.events.fetch_add(b.len() as u64, Relaxed);
            }
            let rows = g.agg.take_all();
            write(&mut g, &rows, &counters);
            if let Some(sink) = &sink {
                sink.flush(Duration::from_secs(5));
            }
            if let Some(done) = done {
                let _ = done.send(());
            }
            return;
        }
        if now >= last_close + 1000 {
            last_close = now;
            let cutoff = crate::agg::minute_of(now.saturating_sub(CLOSE_AFTER_MS));
            let mut g = match inner.lock() {
                Ok(g) => g,
                Err(p) => p.into_inner(),
            };
            let rows = g.agg.take_before(cutoff);
            if !rows.is_empty() {
                write(&mut g, &rows, &counters);
            }
            counters.overflowed.store(g.agg.overflowed(), Relaxed);
            if now >= last_prune + 600_000 {
                last_prune = now;
                let now_s = (now / 1000) as i64;
                if g.store.prune(now_s, keep[0], keep[1], keep[2]).is_err() {
                    counters.store_errors.fetch_add(1, Relaxed);
                }
            }
        }
    }
}

fn write(g: &mut Inner, rows: &[(crate::Key, crate::Rollup)], c: &Counters) {
    match g.store.write_minutes(rows) {
        Ok(()) => {
            c.minutes_written.fetch_add(rows.len() as u64, Relaxed);
        }
        Err(e) => {
            c.store_errors.fetch_add(1, Relaxed);
            tracing::error!("analytics: writing {} rows: {e}", rows.len());
        }
    }
}

/// `from`/`to` of the API: Unix seconds or RFC 3339
/// (`2026-11-25T10:00:00Z`, `…+01:00`, fractions ignored).
pub fn parse_time(s: &str) -> Option<i64> {
    if let Ok(n) = s.parse::<i64>() {
        return (0..=253_402_300_799).contains(&n).then_some(n);
    }
    let b = s.as_bytes();
    if b.len() < 20 || b[4] != b'-' || b[7] != b'-' || !matches!(b[10], b'T' | b't' | b' ') {
        return None;
    }
    let num = |r: std::ops::Range<usize>| -> Option<i64> {
        let t = s.get(r)?;
        t.bytes()
            .all(|c| c.is_ascii_digit())
            .then(|| t.parse().ok())?
    };
    let (y, mo, d) = (num(0..4)?, num(5..7)?, num(8..10)?);
    if b[13] != b':' || b[16] != b':' {
        return None;
    }
    let (h, mi, sec) = (num(11..13)?, num(14..16)?, num(17..19)?);
    if !(1..=12).contains(&mo) || !(1..=31).contains(&d) || h > 23 || mi > 59 || sec > 60 {
        return None;
    }
    let mut i = 19;
    if b.get(i) == Some(&b'.') {
        i += 1;
        while b.get(i).is_some_and(|c| c.is_ascii_digit()) {
            i += 1;
        }
    }
    let offset = match b.get(i) {
        Some(b'Z' | b'z') if i + 1 == b.len() => 0,
        Some(&sign @ (b'+' | b'-')) if i + 6 == b.len() && b[i + 3] == b':' => {
            let (oh, om) = (num(i + 1..i + 3)?, num(i + 4..i + 6)?);
            if oh > 23 || om > 59 {
                return None;
            }
            let o = oh * 3600 + om * 60;
            if sign == b'+' {
                o
            } else {
                -o
            }
        }
        _ => return None,
    };
    // Days from the civil date (Howard Hinnant's algorithm).
    let y2 = if mo <= 2 { y - 1 } else { y };
    let era = y2.div_euclid(400);
    let yoe = y2 - era * 400;
    let mp = (mo + 9) % 12;
    let doy = (153 * mp + 2) / 5 + d - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    let days = era * 146_097 + doe - 719_468;
    Some(days * 86_400 + h * 3600 + mi * 60 + sec - offset)
}

/// The API's query from its URL parameters; `now` in Unix seconds.
pub fn query_of(params: &[(String, String)], now: i64) -> Result<Query, String> {
    let get = |k: &str| params.iter().find(|(n, _)| n == k).map(|(_, v)| v.as_str());
    let to = match get("to") {
        Some(v) => parse_time(v).ok_or_else(|| format!("bad `to`: {v:?}"))?,
        None => now + 1,
    };
    let from = match get("from") {
        Some(v) => parse_time(v).ok_or_else(|| format!("bad `from`: {v:?}"))?,
        None => to - 3600,
    };
    if from >= to {
        return Err("`from` must be before `to`".into());
    }
    let step = match get("step") {
        Some(v) => Step::from_name(v).ok_or_else(|| format!("bad `step`: {v:?}"))?,
        None => Step::Minute,
    };
    // A bounded answer: at most this many points in a series.
    if (to - from) / step.secs() > 50_000 {
        return Err(format!(
            "the window holds more than 50000 {}s: use a longer step",
            step.name()
        ));
    }
    let top = match get("top") {
        Some(v) => v
            .parse::<usize>()
            .ok()
            .filter(|n| *n <= 64)
            .ok_or_else(|| format!("bad `top`: {v:?} (0..64)"))?,
        None => 10,
    };
    Ok(Query {
        from_s: from,
        to_s: to,
        step,
        host: get("host").filter(|h| !h.is_empty()).map(str::to_owned),
        route: get("route").filter(|r| !r.is_empty()).map(str::to_owned),
        top,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rfc3339_and_unix_times() {
        assert_eq!(parse_time("0"), Some(0));
        assert_eq!(parse_time("1764064800"), Some(1_764_064_800));
        assert_eq!(parse_time("1970-01-01T00:00:00Z"), Some(0));
        assert_eq!(parse_time("2025-11-25T10:00:00Z"), Some(1_764_064_800));
        assert_eq!(parse_time("2025-11-25T11:00:00+01:00"), Some(1_764_064_800));
        assert_eq!(
            parse_time("2025-11-25T09:30:00.123-00:30"),
            Some(1_764_064_800)
        );
        assert_eq!(parse_time("2024-02-29T00:00:00Z"), Some(1_709_164_800));
        for bad in [
            "",
            "-1",
            "2025-13-01T00:00:00Z",
            "2025-11-25T10:00:00",
            "2025-11-25T10:00:00+1",
            "2025-11-25X10:00:00Z",
            "2025-11-25T1a:00:00Z",
            "99999999999999999999",
            "2025-11-25T10:00:00Zjunk",
        ] {
            assert_eq!(parse_time(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn api_parameters() {
        let p = |v: &[(&str, &str)]| -> Vec<(String, String)> {
            v.iter()
                .map(|(a, b)| (a.to_string(), b.to_string()))
                .collect()
        };
        let q = query_of(&[], 10_000).unwrap();
        assert_eq!(
            (q.from_s, q.to_s, q.step, q.top),
            (6401, 10_001, Step::Minute, 10)
        );
        let q = query_of(
            &p(&[
                ("from", "0"),
                ("to", "86400"),
                ("step", "hour"),
                ("host", "a.example"),
            ]),
            0,
        )
        .unwrap();
        assert_eq!((q.from_s, q.to_s, q.step), (0, 86_400, Step::Hour));
        assert_eq!(q.host.as_deref(), Some("a.example"));
        for bad in [
            &[("from", "10"), ("to", "5")][..],
            &[("step", "week")],
            &[("from", "x")],
            &[("top", "1000")],
            &[("from", "0"), ("to", "99999999"), ("step", "minute")],
        ] {
            assert!(query_of(&p(bad), 100).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn batches_give_their_events_back() {
        let mut b = Batch::default();
        let long = vec![b'p'; 4000];
        b.push(
            &EventRef {
                ts_ms: 5,
                host: b"a.example",
                route: "r",
                path: &long,
                status: 404,
                user_agent: b"ua",
                cache: "HIT",
                extra: &[(b"user", b"alice")],
                trace_id: b"0af7651916cd43dd8448eb211c80319c",
                span_id: b"b7ad6b7169203331",
                ..EventRef::EMPTY
            },
            "HTTP/1.1",
            "TLSv1.3",
            Some(([10, 0, 0, 1], 8080).into()),
        );
        let mut seen = 0;
        b.for_each(true, |e| {
            seen += 1;
            assert_eq!(e.upstream, b"10.0.0.1:8080");
            assert_eq!(
                (e.ts_ms, e.host, e.route, e.status),
                (5, &b"a.example"[..], "r", 404)
            );
            assert_eq!(e.path.len(), MAX_FIELD);
            assert_eq!(
                (e.cache, e.protocol, e.tls_version),
                ("HIT", "HTTP/1.1", "TLSv1.3")
            );
            assert_eq!(e.extra, &[(&b"user"[..], &b"alice"[..])]);
            assert_eq!(e.trace_id, b"0af7651916cd43dd8448eb211c80319c");
            assert_eq!(e.span_id, b"b7ad6b7169203331");
        });
        assert_eq!(seen, 1);
        // Without a trace context, the ids come back empty.
        let mut b = Batch::default();
        b.push(&EventRef::EMPTY, "HTTP/1.1", "", None);
        b.for_each(false, |e| {
            assert_eq!((e.trace_id, e.span_id), (&b""[..], &b""[..]))
        });
    }
}
