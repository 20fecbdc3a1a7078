//! Counters sharded per worker thread.
//!
//! Each worker increments only its own cache-line-aligned shard, so the hot
//! path is an uncontended relaxed atomic add; `/metrics` sums the shards.
//! Routes get stable indices by name (kept across reloads so counters never
//! reset), bounded by `MAX_ROUTES`; beyond that they share an overflow slot.

use parking_lot::Mutex;
use pier_error::Kind;
use std::cell::Cell;
use std::fmt::Write as _;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering::Relaxed};

pub const MAX_ROUTES: usize = 256;
const OVERFLOW_ROUTE: usize = MAX_ROUTES - 1;
/// Latency bucket upper bounds in microseconds.
pub const BUCKETS_US: [u64; 14] = [
    500, 1_000, 2_500, 5_000, 10_000, 25_000, 50_000, 100_000, 250_000, 500_000, 1_000_000,
    2_500_000, 5_000_000, 10_000_000,
];
/// Extra local-response causes that are not `pier_error::Kind`s.
/// Local responses not caused by a `pier_error::Kind`: answers made by hooks.
pub const EXTRA_REASONS: [(&str, u16); 1] = [("hook", 0)];

/// Kinds whose refusals may carry a configured status (`[[limit]] status`);
/// each has a counter per status 400..=599 so the metric shows what was sent.
const CUSTOM_KINDS: [Kind; 3] = [
    Kind::RateLimited,
    Kind::ConcurrencyLimited,
    Kind::UpstreamLimited,
];

thread_local! {
    /// Which shard this thread writes; workers set it at start.
    pub static WORKER_ID: Cell<usize> = const { Cell::new(0) };
}

#[repr(align(128))]
struct Shard {
    requests: Vec<[AtomicU64; 6]>,
    local: [AtomicU64; Kind::ALL.len()],
    extra: [AtomicU64; EXTRA_REASONS.len()],
    /// `CUSTOM_KINDS[i]` answered with status `400 + j`.
    custom: Box<[[AtomicU64; 200]; CUSTOM_KINDS.len()]>,
    pool_created: AtomicU64,
    pool_reused: AtomicU64,
    buckets: [AtomicU64; BUCKETS_US.len() + 1],
    latency_sum_us: AtomicU64,
    retries: AtomicU64,
    refused_connections: AtomicU64,
    evicted_connections: AtomicU64,
    goaway_timeouts: AtomicU64,
    admin_refused: [AtomicU64; ADMIN_REFUSALS.len()],
    log_dropped: AtomicU64,
    /// The latest sampled request per latency bucket (OpenMetrics
    /// exemplars). Written by traced, sampled requests only, so the lock is
    /// off the common path; uncontended but for a scrape.
    exemplars: Mutex<[Option<Exemplar>; BUCKETS_US.len() + 1]>,
}

/// A sampled request that fell in a latency bucket: `pier_request_duration_
/// seconds_bucket` names its trace in the OpenMetrics exposition, so a slow
/// bucket leads to a trace.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Exemplar {
    /// The trace id (32) and the server span id (16) in lower-case hex, as
    /// the request already holds them for its log line.
    pub ids_hex: [u8; 48],
    pub dur_us: u64,
    /// Unix time, milliseconds.
    pub ts_ms: u64,
}

/// Why the admin endpoint refused a request (`pier_admin_refused_total`).
pub const ADMIN_REFUSALS: [&str; 4] = ["unauthorized", "no_credentials", "host", "cross_site"];

impl Shard {
    fn new() -> Self {
        Shard {
            requests: (0..MAX_ROUTES).map(|_| Default::default()).collect(),
            local: std::array::from_fn(|_| AtomicU64::new(0)),
            extra: Default::default(),
            custom: Box::new(std::array::from_fn(|_| {
                std::array::from_fn(|_| AtomicU64::new(0))
            })),
            pool_created: AtomicU64::new(0),
            pool_reused: AtomicU64::new(0),
            buckets: Default::default(),
            latency_sum_us: AtomicU64::new(0),
            retries: AtomicU64::new(0),
            refused_connections: AtomicU64::new(0),
            evicted_connections: AtomicU64::new(0),
            goaway_timeouts: AtomicU64::new(0),
            admin_refused: Default::default(),
            log_dropped: AtomicU64::new(0),
            exemplars: Mutex::new([None; BUCKETS_US.len() + 1]),
        }
    }
}

pub struct Metrics {
    shards: Vec<Shard>,
    routes: Mutex<Vec<String>>,
    pub active_connections: AtomicI64,
    pub active_requests: AtomicI64,
    /// Upgraded connections (WebSocket) being tunnelled now, and in all.
    pub active_tunnels: AtomicI64,
    pub tunnels: AtomicU64,
    /// Requests by client protocol: [HTTP/1.x, HTTP/2].
    /// Requests by protocol (`pier_session::Protocol::index`): HTTP/2 and
    /// HTTP/3 only, HTTP/1.x being the rest of the requests.
    pub by_protocol: [AtomicU64; 3],
    /// Proxied gRPC calls by grpc-status (0..=16; 17: absent or unknown).
    grpc: [AtomicU64; 18],
    /// Requests whose task panicked (a bug: the connection was closed, its
    /// slots released, and nothing else lost).
    pub panics: AtomicU64,
}

/// One unit of a gauge, released on every path out (a panic's unwinding
/// included): counters that leak on an early return or a panic are how a
/// proxy ends up refusing every connection.
pub struct GaugeGuard<'a>(&'a AtomicI64);

impl<'a> GaugeGuard<'a> {
    pub fn enter(g: &'a AtomicI64) -> Self {
        g.fetch_add(1, Relaxed);
        GaugeGuard(g)
    }
}

impl Drop for GaugeGuard<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Relaxed);
    }
}

macro_rules! sum {
    ($self:ident, $f:ident) => {
        $self.shards.iter().map(|s| s.$f.load(Relaxed)).sum::<u64>()
    };
}

impl Metrics {
    pub fn new(workers: usize) -> Self {
        Metrics {
            shards: (0..workers.max(1) + 1).map(|_| Shard::new()).collect(),
            routes: Mutex::new(Vec::new()),
            active_connections: AtomicI64::new(0),
            active_requests: AtomicI64::new(0),
            active_tunnels: AtomicI64::new(0),
            tunnels: AtomicU64::new(0),
            by_protocol: [AtomicU64::new(0), AtomicU64::new(0), AtomicU64::new(0)],
            grpc: std::array::from_fn(|_| AtomicU64::new(0)),
            panics: AtomicU64::new(0),
        }
    }

    #[inline]
    fn shard(&self) -> &Shard {
        let id = WORKER_ID.with(|w| w.get());
        &self.shards[id.min(self.shards.len() - 1)]
    }

    /// Stable index for a route name (config load time, not the hot path).
    pub fn route_index(&self, name: &str) -> usize {
        let mut r = self.routes.lock();
        if let Some(i) = r.iter().position(|n| n == name) {
            return i;
        }
        if r.len() < OVERFLOW_ROUTE {
            r.push(name.to_string());
            r.len() - 1
        } else {
            OVERFLOW_ROUTE
        }
    }

    /// One finished request: its route, status and duration.
    #[inline]
    pub fn request(&self, route: usize, status: u16, dur_us: u64) {
        let s = self.shard();
        let class = (status / 100).min(5) as usize;
        s.requests[route.min(OVERFLOW_ROUTE)][class].fetch_add(1, Relaxed);
        s.buckets[bucket(dur_us)].fetch_add(1, Relaxed);
        s.latency_sum_us.fetch_add(dur_us, Relaxed);
    }

    /// A sampled request's trace becomes its latency bucket's exemplar
    /// (after [`Metrics::request`] counted it).
    pub fn exemplar(&self, e: Exemplar) {
        self.shard().exemplars.lock()[bucket(e.dur_us)] = Some(e);
    }

    /// Each bucket's newest exemplar over the shards.
    fn exemplars(&self) -> [Option<Exemplar>; BUCKETS_US.len() + 1] {
        let mut out = [None; BUCKETS_US.len() + 1];
        for s in &self.shards {
            let ex = *s.exemplars.lock();
            for (o, e) in out.iter_mut().zip(ex) {
                if let Some(e) = e {
                    if o.is_none_or(|o: Exemplar| o.ts_ms < e.ts_ms) {
                        *o = Some(e);
                    }
                }
            }
        }
        out
    }

    #[inline]
    pub fn local_response(&self, kind: Kind) {
        self.shard().local[kind.index()].fetch_add(1, Relaxed);
    }

    /// A refusal of `kind` sent with `status` (a limit's configured status
    /// may differ from the kind's own).
    #[inline]
    pub fn local_response_status(&self, kind: Kind, status: u16) {
        if status != kind.status() && (400..600).contains(&status) {
            if let Some(i) = CUSTOM_KINDS.iter().position(|k| *k == kind) {
                self.shard().custom[i][(status - 400) as usize].fetch_add(1, Relaxed);
                return;
            }
        }
        self.local_response(kind);
    }

    /// Local responses not caused by a `Kind` (limits, Lua); index into `EXTRA_REASONS`.
    #[inline]
    pub fn local_extra(&self, idx: usize) {
        self.shard().extra[idx].fetch_add(1, Relaxed);
    }

    #[inline]
    pub fn pool(&self, reused: bool) {
        let s = self.shard();
        if reused {
            s.pool_reused.fetch_add(1, Relaxed);
        } else {
            s.pool_created.fetch_add(1, Relaxed);
        }
    }

    /// A proxied gRPC call ended with this `grpc-status` (None: none sent).
    pub fn grpc_status(&self, code: Option<&[u8]>) {
        let i = code
            .and_then(|c| std::str::from_utf8(c).ok())
            .and_then(|c| c.trim().parse::<usize>().ok())
            .filter(|&c| c <= 16)
            .unwrap_or(17);
        self.grpc[i].fetch_add(1, Relaxed);
    }
    pub fn retry(&self) {
        self.shard().retries.fetch_add(1, Relaxed);
    }
    pub fn refused_connection(&self) {
        self.shard().refused_connections.fetch_add(1, Relaxed);
    }
    /// An idle or head-reading connection closed to admit a new one at
    /// `max_connections`.
    pub fn evicted_connection(&self) {
        self.shard().evicted_connections.fetch_add(1, Relaxed);
    }
    /// An HTTP/2 connection closed `client_goaway` after its GOAWAY.
    pub fn goaway_timeout(&self) {
        self.shard().goaway_timeouts.fetch_add(1, Relaxed);
    }
    /// An admin request refused; `reason` is one of [`ADMIN_REFUSALS`].
    pub fn admin_refused(&self, reason: &str) {
        if let Some(i) = ADMIN_REFUSALS.iter().position(|r| *r == reason) {
            self.shard().admin_refused[i].fetch_add(1, Relaxed);
        }
    }
    pub fn log_dropped(&self, n: u64) {
        self.shard().log_dropped.fetch_add(n, Relaxed);
    }

    pub fn pool_created(&self) -> u64 {
        sum!(self, pool_created)
    }
    pub fn pool_reused(&self) -> u64 {
        sum!(self, pool_reused)
    }
    pub fn local_count(&self, kind: Kind) -> u64 {
        self.shards
            .iter()
            .map(|s| s.local[kind.index()].load(Relaxed))
            .sum()
    }

    /// Refusals of `kind` sent with a configured status other than its own.
    fn custom_count(&self, kind: Kind) -> u64 {
        let Some(i) = CUSTOM_KINDS.iter().position(|k| *k == kind) else {
            return 0;
        };
        self.shards
            .iter()
            .map(|s| s.custom[i].iter().map(|c| c.load(Relaxed)).sum::<u64>())
            .sum()
    }

    /// Prometheus text exposition (admin listener; not a hot path).
    /// The Prometheus text format; with `exemplars`, the duration buckets
    /// carry OpenMetrics exemplars (` # {trace_id=…} value timestamp`),
    /// which only the OpenMetrics format allows ([`crate::openmetrics`]).
    pub fn render(&self, out: &mut String, exemplars: bool) {
        let routes = self.routes.lock().clone();
        out.push_str("# HELP pier_requests_total Requests answered, by route and status class.\n# TYPE pier_requests_total counter\n");
        const CLASSES: [&str; 6] = ["0xx", "1xx", "2xx", "3xx", "4xx", "5xx"];
        for (ri, name) in routes
            .iter()
            .enumerate()
            .chain(std::iter::once((OVERFLOW_ROUTE, &String::from("_other"))))
        {
            for (ci, c) in CLASSES.iter().enumerate() {
                let v: u64 = self
                    .shards
                    .iter()
                    .map(|s| s.requests[ri][ci].load(Relaxed))
                    .sum();
                if v > 0 {
                    let _ = writeln!(
                        out,
                        "pier_requests_total{{route=\"{name}\",class=\"{c}\"}} {v}"
                    );
                }
            }
        }
        out.push_str("# HELP pier_local_responses_total Responses Pier generated itself, by status and reason.\n# TYPE pier_local_responses_total counter\n");
        for k in Kind::ALL {
            let v = self.local_count(k);
            let _ = writeln!(
                out,
                "pier_local_responses_total{{status=\"{}\",reason=\"{}\"}} {v}",
                k.status(),
                k.reason()
            );
        }
        for (i, k) in CUSTOM_KINDS.iter().enumerate() {
            for j in 0..200 {
                let v: u64 = self
                    .shards
                    .iter()
                    .map(|s| s.custom[i][j].load(Relaxed))
                    .sum();
                if v > 0 {
                    let _ = writeln!(
                        out,
                        "pier_local_responses_total{{status=\"{}\",reason=\"{}\"}} {v}",
                        400 + j,
                        k.reason()
                    );
                }
            }
        }
        for (i, (reason, status)) in EXTRA_REASONS.iter().enumerate() {
            let v: u64 = self.shards.iter().map(|s| s.extra[i].load(Relaxed)).sum();
            if *status != 0 {
                let _ = writeln!(
                    out,
                    "pier_local_responses_total{{status=\"{status}\",reason=\"{reason}\"}} {v}"
                );
            } else {
                let _ = writeln!(
                    out,
                    "pier_local_responses_total{{status=\"any\",reason=\"{reason}\"}} {v}"
                );
            }
        }
        out.push_str("# HELP pier_errors_total Errors by reason (same counts as local responses, by reason only).\n# TYPE pier_errors_total counter\n");
        for k in Kind::ALL {
            let _ = writeln!(
                out,
                "pier_errors_total{{reason=\"{}\"}} {}",
                k.reason(),
                self.local_count(k) + self.custom_count(k)
            );
        }
        let _ = writeln!(out, "# TYPE pier_upstream_connections_created_total counter\npier_upstream_connections_created_total {}", self.pool_created());
        let _ = writeln!(out, "# TYPE pier_upstream_connections_reused_total counter\npier_upstream_connections_reused_total {}", self.pool_reused());
        let _ = writeln!(
            out,
            "# TYPE pier_upstream_retries_total counter\npier_upstream_retries_total {}",
            sum!(self, retries)
        );
        let _ = writeln!(
            out,
            "# TYPE pier_refused_connections_total counter\npier_refused_connections_total {}",
            sum!(self, refused_connections)
        );
        let _ = writeln!(
            out,
            "# TYPE pier_evicted_connections_total counter\npier_evicted_connections_total {}",
            sum!(self, evicted_connections)
        );
        let _ = writeln!(
            out,
            "# TYPE pier_http2_goaway_timeouts_total counter\npier_http2_goaway_timeouts_total {}",
            sum!(self, goaway_timeouts)
        );
        let _ = writeln!(out, "# TYPE pier_admin_refused_total counter");
        for (i, r) in ADMIN_REFUSALS.iter().enumerate() {
            let n: u64 = self
                .shards
                .iter()
                .map(|s| s.admin_refused[i].load(Relaxed))
                .sum();
            let _ = writeln!(out, "pier_admin_refused_total{{reason=\"{r}\"}} {n}");
        }
        let _ = writeln!(
            out,
            "# TYPE pier_access_log_dropped_total counter\npier_access_log_dropped_total {}",
            sum!(self, log_dropped)
        );
        let _ = writeln!(
            out,
            "# TYPE pier_active_connections gauge\npier_active_connections {}",
            self.active_connections.load(Relaxed)
        );
        let _ = writeln!(
            out,
            "# TYPE pier_active_requests gauge\npier_active_requests {}",
            self.active_requests.load(Relaxed)
        );
        let _ = writeln!(
            out,
            "# TYPE pier_active_tunnels gauge\npier_active_tunnels {}\n# TYPE pier_tunnels_total counter\npier_tunnels_total {}",
            self.active_tunnels.load(Relaxed),
            self.tunnels.load(Relaxed)
        );
        let _ = writeln!(
            out,
            "# HELP pier_requests_by_protocol_total Requests over HTTP/2 and HTTP/3 (HTTP/1.x: the rest of pier_requests_total).\n# TYPE pier_requests_by_protocol_total counter\npier_requests_by_protocol_total{{protocol=\"h2\"}} {}\npier_requests_by_protocol_total{{protocol=\"h3\"}} {}",
            self.by_protocol[1].load(Relaxed),
            self.by_protocol[2].load(Relaxed)
        );
        out.push_str("# HELP pier_grpc_responses_total Proxied gRPC calls by grpc-status (\"none\": the origin sent none).\n# TYPE pier_grpc_responses_total counter\n");
        for (i, c) in self.grpc.iter().enumerate() {
            let n = c.load(Relaxed);
            if n > 0 {
                if i == 17 {
                    let _ = writeln!(out, "pier_grpc_responses_total{{status=\"none\"}} {n}");
                } else {
                    let _ = writeln!(out, "pier_grpc_responses_total{{status=\"{i}\"}} {n}");
                }
            }
        }
        let _ = writeln!(
            out,
            "# HELP pier_panics_total Requests whose task panicked (closed; slots released).\n# TYPE pier_panics_total counter\npier_panics_total {}",
            self.panics.load(Relaxed)
        );
        out.push_str("# HELP pier_request_duration_seconds Time from request head to last response byte.\n# TYPE pier_request_duration_seconds histogram\n");
        let ex = if exemplars {
            self.exemplars()
        } else {
            [None; BUCKETS_US.len() + 1]
        };
        let mut cum = 0u64;
        for (i, ub) in BUCKETS_US.iter().enumerate() {
            cum += self
                .shards
                .iter()
                .map(|s| s.buckets[i].load(Relaxed))
                .sum::<u64>();
            let _ = write!(
                out,
                "pier_request_duration_seconds_bucket{{le=\"{}\"}} {cum}",
                *ub as f64 / 1e6
            );
            write_exemplar(out, ex[i]);
        }
        cum += self
            .shards
            .iter()
            .map(|s| s.buckets[BUCKETS_US.len()].load(Relaxed))
            .sum::<u64>();
        let _ = write!(
            out,
            "pier_request_duration_seconds_bucket{{le=\"+Inf\"}} {cum}"
        );
        write_exemplar(out, ex[BUCKETS_US.len()]);
        let _ = writeln!(
            out,
            "pier_request_duration_seconds_sum {}",
            sum!(self, latency_sum_us) as f64 / 1e6
        );
        let _ = writeln!(out, "pier_request_duration_seconds_count {cum}");
    }
}

/// The latency bucket of a duration.
#[inline]
fn bucket(dur_us: u64) -> usize {
    BUCKETS_US
        .iter()
        .position(|&ub| dur_us <= ub)
        .unwrap_or(BUCKETS_US.len())
}

/// ` # {trace_id="…",span_id="…"} 0.000123 1700000000.123` and the line's
/// end (OpenMetrics: the exemplar's value in the metric's unit, a
/// timestamp in seconds).
fn write_exemplar(out: &mut String, e: Option<Exemplar>) {
    if let Some(e) = e {
        // Hex digits are ASCII.
        let t = std::str::from_utf8(&e.ids_hex[..32]).unwrap_or("");
        let sp = std::str::from_utf8(&e.ids_hex[32..]).unwrap_or("");
        let _ = write!(
            out,
            " # {{trace_id=\"{t}\",span_id=\"{sp}\"}} {} {}.{:03}",
            e.dur_us as f64 / 1e6,
            e.ts_ms / 1000,
            e.ts_ms % 1000
        );
    }
    out.push('\n');
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_sum_across_shards() {
        let m = std::sync::Arc::new(Metrics::new(2));
        let r = m.route_index("api");
        assert_eq!(m.route_index("api"), r);
        let hs: Vec<_> = (0..3)
            .map(|w| {
                let m = m.clone();
                std::thread::spawn(move || {
                    WORKER_ID.with(|c| c.set(w));
                    for _ in 0..1000 {
                        m.request(r, 200, 700);
                        m.pool(true);
                    }
                    m.local_response(Kind::UpstreamConnect);
                })
            })
            .collect();
        for h in hs {
            h.join().unwrap();
        }
        let mut s = String::new();
        m.render(&mut s, false);
        assert!(
            s.contains("pier_requests_total{route=\"api\",class=\"2xx\"} 3000"),
            "{s}"
        );
        assert!(s.contains("pier_upstream_connections_reused_total 3000"));
        assert!(
            s.contains("pier_local_responses_total{status=\"502\",reason=\"upstream-connect\"} 3")
        );
        assert!(s.contains("pier_request_duration_seconds_bucket{le=\"0.001\"} 3000"));
        assert!(s.contains("pier_request_duration_seconds_count 3000"));
    }

    #[test]
    fn a_bucket_names_its_newest_sampled_request() {
        let m = Metrics::new(2);
        let ex = |id: &str, dur_us, ts_ms| {
            let mut ids_hex = [0u8; 48];
            ids_hex.copy_from_slice(id.repeat(24).as_bytes());
            Exemplar {
                ids_hex,
                dur_us,
                ts_ms,
            }
        };
        for (w, e) in [
            (1, ex("a1", 700, 1_000)),
            (2, ex("b2", 900, 2_500)), // same bucket (≤ 1 ms), newer
            (1, ex("c3", 30_000_000, 3_000)),
        ] {
            WORKER_ID.with(|c| c.set(w));
            m.request(0, 200, e.dur_us);
            m.exemplar(e);
        }
        let mut plain = String::new();
        m.render(&mut plain, false);
        assert!(!plain.contains("trace_id"), "{plain}");
        let mut s = String::new();
        m.render(&mut s, true);
        let b2 = "b2".repeat(16);
        let line = format!(
            "pier_request_duration_seconds_bucket{{le=\"0.001\"}} 2 # {{trace_id=\"{b2}\",span_id=\"{}\"}} 0.0009 2.500\n",
            "b2".repeat(8)
        );
        assert!(s.contains(&line), "{s}");
        assert!(
            !s.contains(&"a1".repeat(16)),
            "older exemplar in the same bucket"
        );
        assert!(s.contains("le=\"+Inf\"} 3 # {trace_id=\"c3c3"), "{s}");
        assert!(s.contains("le=\"0.0005\"} 0\n"), "{s}");
    }
}
