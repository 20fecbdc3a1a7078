//! The embedded analytics store: SQLite through `rusqlite`, SQLite compiled
//! in (`bundled`).
//!
//! Why SQLite: the history is one file next to Pier's other state, with no
//! server to install, configure or keep running; in WAL mode a crash or a
//! kill never corrupts it (a transaction is all there or not at all) and a
//! reader never blocks the writer; history survives restarts and upgrades
//! of the binary. Bundling the library pins its version and needs no system
//! package.
//!
//! Layout: one table per [`Step`] (`minute`, `hour`, `day`), primary key
//! `(bucket, host, route)`, exact counters as integer columns and each
//! sketch as a BLOB in its own compact encoding (the `clients` HLL blob is a
//! valid postgresql-hll `hll(14, 5)` value). [`Store::write_minutes`] merges
//! every closed minute into its minute, hour and day rows in one
//! transaction, so the hour and day rows are always the union of their
//! minutes and a query at any step gives the same totals.
//!
//! Writes merge: writing the same (minute, host, route) twice adds the
//! second rollup to the first. The caller writes each closed minute once
//! ([`crate::Aggregator::take_before`] removes what it returns); a late event
//! for a minute already written comes back as a small extra row and is
//! merged in, which is what it should be.
//!
//! A blob that fails to decode (disk corruption, a future format) does not
//! fail reads or writes: that one sketch is treated as empty, the counters
//! are kept, and [`Store::malformed`] counts it.

use crate::agg::{normalize_host, Key, Rollup, TOPK_CAPACITY};
use crate::hll::Hll;
use crate::sketch::Latency;
use crate::topk::TopK;
use crate::DecodeError;
use rusqlite::{params, Connection, OptionalExtension, Row};
use serde::Serialize;
use std::cell::Cell;
use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::path::Path;
use std::time::Duration;

const SCHEMA_VERSION: i64 = 1;

/// The resolution of a query and the table it reads.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Step {
    Minute,
    Hour,
    Day,
}

impl Step {
    pub const ALL: [Step; 3] = [Step::Minute, Step::Hour, Step::Day];

    /// Length of a bucket in seconds: 60, 3600 or 86400.
    pub fn secs(self) -> i64 {
        match self {
            Step::Minute => 60,
            Step::Hour => 3600,
            Step::Day => 86_400,
        }
    }

    /// `"minute"`, `"hour"` or `"day"`: the table name and [`Report::step`].
    pub fn name(self) -> &'static str {
        match self {
            Step::Minute => "minute",
            Step::Hour => "hour",
            Step::Day => "day",
        }
    }

    /// Parses [`Step::name`].
    pub fn from_name(name: &str) -> Option<Step> {
        Step::ALL.into_iter().find(|s| s.name() == name)
    }

    /// Start of the bucket containing `t` (Unix seconds, UTC days).
    pub fn align(self, t: i64) -> i64 {
        t.div_euclid(self.secs()) * self.secs()
    }
}

/// A store error: SQLite's, or a database written by a newer Pier.
#[derive(Debug)]
pub enum Error {
    Sqlite(rusqlite::Error),
    Schema(String),
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Error::Sqlite(e) => write!(f, "analytics store: {e}"),
            Error::Schema(s) => write!(f, "analytics store: {s}"),
        }
    }
}

impl std::error::Error for Error {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            Error::Sqlite(e) => Some(e),
            Error::Schema(_) => None,
        }
    }
}

impl From<rusqlite::Error> for Error {
    fn from(e: rusqlite::Error) -> Self {
        Error::Sqlite(e)
    }
}

/// What to report: buckets starting in `[align(from_s), to_s)` at `step`,
/// optionally for one host and/or route, with `top` entries per top list.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Query {
    pub from_s: i64,
    /// Exclusive.
    pub to_s: i64,
    pub step: Step,
    /// Normalized like event hosts (lower case, port stripped).
    pub host: Option<String>,
    pub route: Option<String>,
    pub top: usize,
}

/// One bucket's figures (or the window's, for [`Report::total`]).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct Point {
    /// Bucket start, Unix seconds (the window's start for the total).
    pub t: i64,
    pub requests: u64,
    pub bytes_in: u64,
    pub bytes_out: u64,
    /// 1xx, 2xx, 3xx, 4xx, 5xx.
    pub status: [u64; 5],
    pub p50_us: u64,
    pub p90_us: u64,
    pub p99_us: u64,
    pub upstream_p99_us: u64,
    /// Estimated distinct client IPs (HyperLogLog union, not a sum).
    pub unique_clients: u64,
}

impl Point {
    fn of(t: i64, r: &Rollup) -> Point {
        Point {
            t,
            requests: r.requests,
            bytes_in: r.bytes_in,
            bytes_out: r.bytes_out,
            status: r.status,
            p50_us: r.latency.quantile(0.5),
            p90_us: r.latency.quantile(0.9),
            p99_us: r.latency.quantile(0.99),
            upstream_p99_us: r.upstream_latency.quantile(0.99),
            unique_clients: r.clients.estimate(),
        }
    }
}

/// The answer to a [`Query`], serialized as the admin API's JSON.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Report {
    /// Window start, aligned down to the step.
    pub from: i64,
    pub to: i64,
    pub step: &'static str,
    /// One point per bucket that has data, in time order; empty buckets are
    /// left out.
    pub series: Vec<Point>,
    /// The whole window.
    pub total: Point,
    pub top_paths: Vec<(String, u64)>,
    pub top_clients: Vec<(String, u64)>,
    pub top_agents: Vec<(String, u64)>,
    /// Exact request counts per host and per route over the window.
    pub top_hosts: Vec<(String, u64)>,
    pub top_routes: Vec<(String, u64)>,
}

/// The SQLite-backed store of minute, hour and day rollups.
pub struct Store {
    conn: Connection,
    malformed: Cell<u64>,
}

const COLUMNS: &str = "bucket, host, route, requests, bytes_in, bytes_out, \
     s1xx, s2xx, s3xx, s4xx, s5xx, \
     latency, upstream_latency, clients, top_paths, top_clients, top_agents";

fn to_i64(v: u64) -> i64 {
    i64::try_from(v).unwrap_or(i64::MAX)
}

fn to_u64(v: i64) -> u64 {
    u64::try_from(v).unwrap_or(0)
}

impl Store {
    /// Opens (creating if needed) the store at `path`; `":memory:"` gives a
    /// private in-memory database (tests). Several `Store`s may open the
    /// same file, e.g. one writing and one answering the admin API: WAL lets
    /// them read while another writes, and a writer waits up to 5 s for
    /// another.
    pub fn open(path: &Path) -> Result<Store, Error> {
        let conn = Connection::open(path)?;
        conn.busy_timeout(Duration::from_secs(5))?;
        // WAL: crash-safe, readers do not block the writer. NORMAL sync is
        // still crash-safe in WAL mode; a power cut may lose the last
        // transactions, which for analytics is a minute or two.
        let _mode: String = conn.query_row("PRAGMA journal_mode = WAL", [], |r| r.get(0))?;
        conn.pragma_update(None, "synchronous", "NORMAL")?;
        conn.set_prepared_statement_cache_capacity(32);

        let version: i64 = conn.query_row("PRAGMA user_version", [], |r| r.get(0))?;
        if version > SCHEMA_VERSION {
            return Err(Error::Schema(format!(
                "database schema version {version} is newer than this Pier's ({SCHEMA_VERSION})"
            )));
        }
        for step in Step::ALL {
            conn.execute_batch(&format!(
                "CREATE TABLE IF NOT EXISTS {t} (
                    bucket INTEGER NOT NULL,
                    host TEXT NOT NULL,
                    route TEXT NOT NULL,
                    requests INTEGER NOT NULL,
                    bytes_in INTEGER NOT NULL,
                    bytes_out INTEGER NOT NULL,
                    s1xx INTEGER NOT NULL,
                    s2xx INTEGER NOT NULL,
                    s3xx INTEGER NOT NULL,
                    s4xx INTEGER NOT NULL,
                    s5xx INTEGER NOT NULL,
                    latency BLOB NOT NULL,
                    upstream_latency BLOB NOT NULL,
                    clients BLOB NOT NULL,
                    top_paths BLOB NOT NULL,
                    top_clients BLOB NOT NULL,
                    top_agents BLOB NOT NULL,
                    PRIMARY KEY (bucket, host, route)
                );",
                t = step.name()
            ))?;
        }
        conn.pragma_update(None, "user_version", SCHEMA_VERSION)?;
        Ok(Store {
            conn,
            malformed: Cell::new(0),
        })
    }

    /// Sketch blobs that failed to decode since open (each read as empty).
    pub fn malformed(&self) -> u64 {
        self.malformed.get()
    }

    /// Merges closed minutes into their minute, hour and day rows, in one
    /// transaction (all or nothing). Rows may be for any minutes, in any
    /// order; a key already stored is added to, not replaced.
    pub fn write_minutes(&mut self, rows: &[(Key, Rollup)]) -> Result<(), Error> {
        if rows.is_empty() {
            return Ok(());
        }
        let tx = self.conn.transaction()?;
        let mut malformed = 0;
        for step in Step::ALL {
            // Merge the batch first so each row is read and written once.
            let mut batch: BTreeMap<Key, Rollup> = BTreeMap::new();
            for (k, r) in rows {
                let key = Key {
                    bucket: step.align(k.bucket),
                    host: k.host.clone(),
                    route: k.route.clone(),
                };
                batch.entry(key).or_default().merge(r);
            }
            let select = format!(
                "SELECT {COLUMNS} FROM {} WHERE bucket = ?1 AND host = ?2 AND route = ?3",
                step.name()
            );
            let upsert = format!(
                "INSERT OR REPLACE INTO {} ({COLUMNS}) VALUES \
                 (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, ?13, ?14, ?15, ?16, ?17)",
                step.name()
            );
            let mut select = tx.prepare_cached(&select)?;
            let mut upsert = tx.prepare_cached(&upsert)?;
            for (key, mut rollup) in batch {
                let stored = select
                    .query_row(params![key.bucket, key.host, key.route], |row| {
                        Ok(decode_row(row))
                    })
                    .optional()?;
                if let Some(stored) = stored {
                    let (_, old, bad) = stored?;
                    malformed += bad;
                    rollup.merge(&old);
                }
                upsert.execute(params![
                    key.bucket,
                    key.host,
                    key.route,
                    to_i64(rollup.requests),
                    to_i64(rollup.bytes_in),
                    to_i64(rollup.bytes_out),
                    to_i64(rollup.status[0]),
                    to_i64(rollup.status[1]),
                    to_i64(rollup.status[2]),
                    to_i64(rollup.status[3]),
                    to_i64(rollup.status[4]),
                    rollup.latency.to_bytes(),
                    rollup.upstream_latency.to_bytes(),
                    rollup.clients.to_bytes(),
                    rollup.top_paths.to_bytes(),
                    rollup.top_clients.to_bytes(),
                    rollup.top_agents.to_bytes(),
                ])?;
            }
        }
        tx.commit()?;
        self.malformed.set(self.malformed.get() + malformed);
        Ok(())
    }

    /// Deletes rows that ended before their step's retention: a minute row
    /// goes once `bucket + 60 <= now_s - keep_minutes_s`, and likewise for
    /// hours and days, so a bucket with any part inside the retention window
    /// stays. Returns the number of rows deleted. Freed pages are reused by
    /// later writes; the file does not shrink.
    pub fn prune(
        &mut self,
        now_s: i64,
        keep_minutes_s: i64,
        keep_hours_s: i64,
        keep_days_s: i64,
    ) -> Result<u64, Error> {
        let tx = self.conn.transaction()?;
        let mut deleted = 0u64;
        for (step, keep) in [
            (Step::Minute, keep_minutes_s),
            (Step::Hour, keep_hours_s),
            (Step::Day, keep_days_s),
        ] {
            let last = now_s.saturating_sub(keep).saturating_sub(step.secs());
            let sql = format!("DELETE FROM {} WHERE bucket <= ?1", step.name());
            deleted += tx.prepare_cached(&sql)?.execute([last])? as u64;
        }
        tx.commit()?;
        Ok(deleted)
    }

    /// Reports on the stored rows matching `q`.
    pub fn query(&self, q: &Query) -> Result<Report, Error> {
        self.query_with(std::iter::empty(), q)
    }

    /// As [`Store::query`], also merging `extra` rows kept in memory (the
    /// still-open minutes from [`crate::Aggregator`], not yet written; rows
    /// already written must not be passed again or they count twice). Extra
    /// keys are minute buckets; they are aligned to the query's step.
    pub fn query_live(&self, extra: &[(Key, Rollup)], q: &Query) -> Result<Report, Error> {
        self.query_with(extra.iter().map(|(k, r)| (k, r)), q)
    }

    /// As [`Store::query_live`] for borrowed rows, e.g.
    /// `store.query_with(aggregator.peek(), &q)` without cloning.
    pub fn query_with<'a, I>(&self, extra: I, q: &Query) -> Result<Report, Error>
    where
        I: IntoIterator<Item = (&'a Key, &'a Rollup)>,
    {
        let step = q.step;
        let from = step.align(q.from_s);
        let host = q.host.as_ref().map(|h| {
            let mut s = String::new();
            normalize_host(h.as_bytes(), &mut s);
            s
        });
        let mut acc = Accumulator::new(from);

        // Live rows, by bucket, merged as the stored buckets go by.
        let mut live: BTreeMap<i64, Rollup> = BTreeMap::new();
        for (k, r) in extra {
            let bucket = step.align(k.bucket);
            let wanted = bucket >= from
                && bucket < q.to_s
                && host.as_ref().is_none_or(|h| *h == k.host)
                && q.route.as_ref().is_none_or(|rt| *rt == k.route);
            if wanted {
                live.entry(bucket).or_default().merge(r);
                acc.count_key(&k.host, &k.route, r.requests);
            }
        }

        if from < q.to_s {
            let sql = format!(
                "SELECT {COLUMNS} FROM {} WHERE bucket >= ?1 AND bucket < ?2 \
                 AND (?3 IS NULL OR host = ?3) AND (?4 IS NULL OR route = ?4) \
                 ORDER BY bucket",
                step.name()
            );
            let mut stmt = self.conn.prepare_cached(&sql)?;
            let mut rows = stmt.query(params![from, q.to_s, host, q.route])?;
            let mut current: Option<(i64, Rollup)> = None;
            while let Some(row) = rows.next()? {
                let (key, rollup, bad) = decode_row(row)?;
                self.malformed.set(self.malformed.get() + bad);
                acc.count_key(&key.host, &key.route, rollup.requests);
                if current.as_ref().is_some_and(|(b, _)| *b != key.bucket) {
                    if let Some((b, r)) = current.take() {
                        acc.point(b, r);
                    }
                }
                let (_, cur) = current.get_or_insert_with(|| {
                    // Live-only buckets before this one come first.
                    while let Some(entry) = live.first_entry() {
                        if *entry.key() >= key.bucket {
                            break;
                        }
                        let (b, r) = entry.remove_entry();
                        acc.point(b, r);
                    }
                    (key.bucket, live.remove(&key.bucket).unwrap_or_default())
                });
                cur.merge(&rollup);
            }
            if let Some((b, r)) = current {
                acc.point(b, r);
            }
        }
        for (b, r) in live {
            acc.point(b, r);
        }
        Ok(acc.finish(q, step))
    }
}

/// Builds a report from buckets in time order.
struct Accumulator {
    from: i64,
    series: Vec<Point>,
    total: Rollup,
    hosts: HashMap<String, u64>,
    routes: HashMap<String, u64>,
}

impl Accumulator {
    fn new(from: i64) -> Self {
        Self {
            from,
            series: Vec::new(),
            total: Rollup::new(),
            hosts: HashMap::new(),
            routes: HashMap::new(),
        }
    }

    fn count_key(&mut self, host: &str, route: &str, requests: u64) {
        *self.hosts.entry(host.to_owned()).or_default() += requests;
        *self.routes.entry(route.to_owned()).or_default() += requests;
    }

    fn point(&mut self, bucket: i64, r: Rollup) {
        self.series.push(Point::of(bucket, &r));
        self.total.merge(&r);
    }

    fn finish(self, q: &Query, step: Step) -> Report {
        let top = |m: HashMap<String, u64>| {
            let mut v: Vec<(String, u64)> = m.into_iter().collect();
            v.sort_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
            v.truncate(q.top);
            v
        };
        Report {
            from: self.from,
            to: q.to_s,
            step: step.name(),
            total: Point::of(self.from, &self.total),
            series: self.series,
            top_paths: self.total.top_paths.top(q.top),
            top_clients: self.total.top_clients.top(q.top),
            top_agents: self.total.top_agents.top(q.top),
            top_hosts: top(self.hosts),
            top_routes: top(self.routes),
        }
    }
}

/// Reads a row selected with [`COLUMNS`]. Blobs that do not decode become
/// empty sketches; the third value counts them.
fn decode_row(row: &Row) -> rusqlite::Result<(Key, Rollup, u64)> {
    let key = Key {
        bucket: row.get(0)?,
        host: row.get(1)?,
        route: row.get(2)?,
    };
    let mut bad = 0u64;
    // A NULL or non-blob value (only by outside tampering) reads as empty,
    // which no decoder accepts, so it is counted too.
    let blob = |i: usize| row.get::<_, Vec<u8>>(i).unwrap_or_default();
    let top = || TopK::new(TOPK_CAPACITY);
    let rollup = Rollup {
        requests: to_u64(row.get(3)?),
        bytes_in: to_u64(row.get(4)?),
        bytes_out: to_u64(row.get(5)?),
        status: [
            to_u64(row.get(6)?),
            to_u64(row.get(7)?),
            to_u64(row.get(8)?),
            to_u64(row.get(9)?),
            to_u64(row.get(10)?),
        ],
        latency: decoded(Latency::from_bytes(&blob(11)), Latency::new, &mut bad),
        upstream_latency: decoded(Latency::from_bytes(&blob(12)), Latency::new, &mut bad),
        clients: decoded(Hll::from_bytes(&blob(13)), Hll::new, &mut bad),
        top_paths: decoded(TopK::from_bytes(&blob(14)), top, &mut bad),
        top_clients: decoded(TopK::from_bytes(&blob(15)), top, &mut bad),
        top_agents: decoded(TopK::from_bytes(&blob(16)), top, &mut bad),
    };
    Ok((key, rollup, bad))
}

fn decoded<T>(r: Result<T, DecodeError>, empty: impl FnOnce() -> T, bad: &mut u64) -> T {
    r.unwrap_or_else(|_| {
        *bad += 1;
        empty()
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::agg::{Aggregator, EventRef};
    use std::net::{IpAddr, Ipv4Addr};

    /// 2023-11-14 00:00:00 UTC: the start of a day.
    const DAY0: i64 = 1_699_920_000;

    fn mem() -> Store {
        Store::open(Path::new(":memory:")).unwrap()
    }

    /// `n` events spread over `minutes` minutes from `start`, 3 hosts, 2
    /// routes, 500 clients, varied statuses and latencies.
    fn events(start: i64, minutes: u64, n: u64) -> Vec<(Key, Rollup)> {
        let mut agg = Aggregator::new(1000);
        for i in 0..n {
            let ts_ms = start as u64 * 1000 + i * minutes * 60_000 / n;
            let host = format!("h{}.example", i % 3);
            let path = format!("/p/{}", i % 17);
            agg.add(&EventRef {
                ts_ms,
                host: host.as_bytes(),
                route: if i % 4 == 0 { "api" } else { "web" },
                method: b"GET",
                path: path.as_bytes(),
                status: [200, 200, 200, 404, 500, 301][(i % 6) as usize],
                bytes_in: 100 + i % 7,
                bytes_out: 1000 + i % 13,
                duration_us: 100 + (i * 7919) % 50_000,
                upstream_us: if i % 5 == 0 { 0 } else { 50 + i % 1000 },
                client_ip: IpAddr::V4(Ipv4Addr::from(0x0a00_0000 + (i % 500) as u32)),
                user_agent: b"test-agent",
                ..EventRef::EMPTY
            });
        }
        agg.take_all()
    }

    fn query(from_s: i64, to_s: i64, step: Step) -> Query {
        Query {
            from_s,
            to_s,
            step,
            host: None,
            route: None,
            top: 10,
        }
    }

    /// 1,000,000 distinct client IPs through the aggregator and the store,
    /// over 100 minutes and two hosts: the unique-client figure of the
    /// whole window (an HLL union over 200 rows, then over hours and the
    /// day) is within 2% of the exact count.
    #[test]
    fn a_million_clients_through_the_store_within_two_percent() {
        let mut agg = Aggregator::new(1000);
        let mut s = mem();
        let n: u64 = 1_000_000;
        let start = DAY0 + 3600;
        for i in 0..n {
            // A multiplicative permutation: distinct, scattered addresses.
            let ip = (i as u32).wrapping_mul(2_654_435_761) ^ 0x5bd1_e995;
            agg.add(&EventRef {
                ts_ms: start as u64 * 1000 + i * 6,
                host: if i % 2 == 0 {
                    b"a.example"
                } else {
                    b"b.example"
                },
                route: "r",
                status: 200,
                duration_us: 100,
                client_ip: IpAddr::V4(Ipv4Addr::from(ip)),
                ..EventRef::EMPTY
            });
            if i % 100_000 == 99_999 {
                // Close minutes as the analytics thread does.
                let cutoff = crate::agg::minute_of(start as u64 * 1000 + i * 6);
                s.write_minutes(&agg.take_before(cutoff)).unwrap();
            }
        }
        s.write_minutes(&agg.take_all()).unwrap();
        for step in Step::ALL {
            let r = s.query(&query(DAY0, DAY0 + 86_400, step)).unwrap();
            assert_eq!(r.total.requests, n, "{step:?}");
            let est = r.total.unique_clients as f64;
            let err = (est - n as f64).abs() / n as f64;
            assert!(
                err < 0.02,
                "{step:?}: estimate {est}, error {:.3}%",
                err * 100.0
            );
        }
    }

    #[test]
    fn counts_are_exact_and_steps_agree() {
        // 3 hours + 10 minutes, spanning a day boundary at the end.
        let start = DAY0 + 86_400 - 3 * 3600;
        let rows = events(start, 190, 20_000);
        let mut s = mem();
        // Write minute by minute, as the analytics thread does.
        for chunk in rows.chunk_by(|a, b| a.0.bucket == b.0.bucket) {
            s.write_minutes(chunk).unwrap();
        }
        let (from, to) = (DAY0, DAY0 + 2 * 86_400);
        let m = s.query(&query(from, to, Step::Minute)).unwrap();
        let h = s.query(&query(from, to, Step::Hour)).unwrap();
        let d = s.query(&query(from, to, Step::Day)).unwrap();
        assert_eq!(m.total.requests, 20_000);
        assert_eq!(m.series.len(), 190);
        assert_eq!(h.series.len(), 4);
        assert_eq!(d.series.len(), 2);
        assert_eq!(m.series.iter().map(|p| p.requests).sum::<u64>(), 20_000);
        // Identical totals, HLL unions and quantiles at every step (merges
        // are exact: same registers, same buckets). Only `t` differs.
        for other in [&h, &d] {
            assert_eq!(other.total, m.total);
            assert_eq!(other.top_paths, m.top_paths);
            assert_eq!(other.top_hosts, m.top_hosts);
            assert_eq!(other.top_routes, m.top_routes);
        }
        // Top clients are not unique here (every client made 40 requests):
        // which ones a summary keeps depends on the merge order, and each
        // count is an upper bound within total / 64 of the truth.
        for r in [&m, &h, &d] {
            assert_eq!(r.top_clients.len(), 10);
            assert!(r
                .top_clients
                .iter()
                .all(|(_, c)| (40..=40 + 20_000 / 64).contains(c)));
        }
        let unique = m.total.unique_clients;
        assert!((495..=505).contains(&unique), "{unique}");
        // unique clients are a union, not a sum of buckets.
        assert!(m.series.iter().map(|p| p.unique_clients).sum::<u64>() > unique);
        assert_eq!(m.total.status.iter().sum::<u64>(), 20_000);
        assert_eq!(m.top_hosts.len(), 3);
        assert_eq!(m.top_routes[0], ("web".to_string(), 15_000));
        assert_eq!(m.top_agents, [("test-agent".to_string(), 20_000)]);
        assert_eq!(m.top_paths.len(), 10);
        assert_eq!(m.step, "minute");
        assert!(m.total.p50_us > 0 && m.total.p99_us >= m.total.p90_us);
        // The hour rows are exactly the merge of their minutes.
        let hour = s.query(&query(start, start + 3600, Step::Minute)).unwrap();
        assert_eq!(h.series[0].requests, hour.total.requests);
        assert_eq!(h.series[0].unique_clients, hour.total.unique_clients);
        assert_eq!(h.series[0].p99_us, hour.total.p99_us);
        assert_eq!(s.malformed(), 0);
    }

    #[test]
    fn rewriting_a_minute_adds_to_it() {
        let rows = events(DAY0, 2, 300);
        let mut s = mem();
        s.write_minutes(&rows).unwrap();
        s.write_minutes(&rows).unwrap();
        for step in Step::ALL {
            let r = s.query(&query(DAY0, DAY0 + 86_400, step)).unwrap();
            assert_eq!(r.total.requests, 600, "{step:?}");
            // The clients are the same set: the union does not grow.
            assert!((r.total.unique_clients as i64 - 300).abs() <= 3);
        }
        // Duplicate keys within one batch merge too.
        let mut twice = rows.clone();
        twice.extend(rows.iter().cloned());
        let mut s2 = mem();
        s2.write_minutes(&twice).unwrap();
        let a = s.query(&query(DAY0, DAY0 + 86_400, Step::Minute)).unwrap();
        let b = s2.query(&query(DAY0, DAY0 + 86_400, Step::Minute)).unwrap();
        assert_eq!(a, b);
    }

    #[test]
    fn filters_by_host_and_route() {
        let rows = events(DAY0, 5, 1200);
        let mut s = mem();
        s.write_minutes(&rows).unwrap();
        let mut q = query(DAY0, DAY0 + 3600, Step::Minute);
        q.host = Some("H1.example:443".into()); // normalized like events
        let r = s.query(&q).unwrap();
        assert_eq!(r.total.requests, 400);
        assert_eq!(r.top_hosts, [("h1.example".to_string(), 400)]);
        q.route = Some("api".into());
        let r = s.query(&q).unwrap();
        // i % 3 == 1 and i % 4 == 0: i % 12 == 4.
        assert_eq!(r.total.requests, 100);
        assert_eq!(r.top_routes, [("api".to_string(), 100)]);
        q.host = None;
        assert_eq!(s.query(&q).unwrap().total.requests, 300);
        q.route = Some("nope".into());
        let r = s.query(&q).unwrap();
        assert_eq!(
            r.total,
            Point {
                t: DAY0,
                ..Point::default()
            }
        );
        assert!(r.series.is_empty() && r.top_paths.is_empty());
    }

    #[test]
    fn window_bounds_and_alignment() {
        let rows = events(DAY0, 120, 1200);
        let mut s = mem();
        s.write_minutes(&rows).unwrap();
        // [10, 20) minutes: exactly those buckets.
        let r = s
            .query(&query(DAY0 + 600, DAY0 + 1200, Step::Minute))
            .unwrap();
        assert_eq!(r.series.len(), 10);
        assert_eq!(r.series[0].t, DAY0 + 600);
        assert_eq!(r.series.last().unwrap().t, DAY0 + 1140);
        assert_eq!(r.total.requests, 100);
        // Hour step: from is aligned down to the hour.
        let r = s
            .query(&query(DAY0 + 1800, DAY0 + 3601, Step::Hour))
            .unwrap();
        assert_eq!(r.from, DAY0);
        assert_eq!(
            r.series.iter().map(|p| p.t).collect::<Vec<_>>(),
            [DAY0, DAY0 + 3600]
        );
        assert_eq!(r.total.requests, 1200);
        // Empty and inverted windows.
        assert!(s
            .query(&query(DAY0 + 9000, DAY0 + 9600, Step::Minute))
            .unwrap()
            .series
            .is_empty());
        assert!(s
            .query(&query(DAY0 + 600, DAY0, Step::Minute))
            .unwrap()
            .series
            .is_empty());
    }

    #[test]
    fn live_rows_are_merged_in() {
        let rows = events(DAY0, 10, 1000);
        let (closed, open): (Vec<_>, Vec<_>) =
            rows.into_iter().partition(|(k, _)| k.bucket < DAY0 + 480);
        let mut s = mem();
        s.write_minutes(&closed).unwrap();
        let q = query(DAY0, DAY0 + 3600, Step::Minute);
        let stored = s.query(&q).unwrap();
        let live = s.query_live(&open, &q).unwrap();
        assert_eq!(stored.total.requests, 800);
        assert_eq!(live.total.requests, 1000);
        assert_eq!(live.series.len(), 10);
        assert!(live.series.windows(2).all(|w| w[0].t < w[1].t));
        // Same as if everything had been written.
        s.write_minutes(&open).unwrap();
        let all = s.query(&q).unwrap();
        assert_eq!(all, live);
        // Live rows interleaved with stored buckets, at the hour step, and
        // filtered like stored rows.
        let mut s = mem();
        let (odd, even): (Vec<_>, Vec<_>) = closed
            .iter()
            .chain(&open)
            .cloned()
            .partition(|(k, _)| (k.bucket / 60) % 2 == 1);
        s.write_minutes(&odd).unwrap();
        assert_eq!(s.query_live(&even, &q).unwrap(), all);
        let mut qh = query(DAY0, DAY0 + 86_400, Step::Hour);
        qh.route = Some("api".into());
        let a = s.query_with(even.iter().map(|(k, r)| (k, r)), &qh).unwrap();
        assert_eq!(a.total.requests, 250);
        assert_eq!(a.series.len(), 1);
    }

    #[test]
    fn survives_restart() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("analytics.db");
        let rows = events(DAY0, 3, 500);
        let q = query(DAY0, DAY0 + 86_400, Step::Hour);
        let before = {
            let mut s = Store::open(&path).unwrap();
            s.write_minutes(&rows).unwrap();
            s.query(&q).unwrap()
        };
        let mut s = Store::open(&path).unwrap();
        assert_eq!(s.query(&q).unwrap(), before);
        assert_eq!(before.total.requests, 500);
        // And keeps merging after the restart.
        s.write_minutes(&rows).unwrap();
        assert_eq!(s.query(&q).unwrap().total.requests, 1000);
        // A second handle on the same file reads what the first wrote.
        let reader = Store::open(&path).unwrap();
        assert_eq!(reader.query(&q).unwrap().total.requests, 1000);
    }

    #[test]
    fn refuses_a_newer_schema() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("a.db");
        Store::open(&path)
            .unwrap()
            .conn
            .pragma_update(None, "user_version", 99)
            .unwrap();
        let err = Store::open(&path).err().unwrap();
        assert!(matches!(err, Error::Schema(_)), "{err}");
    }

    fn rows(s: &Store) -> i64 {
        Step::ALL
            .iter()
            .map(|t| {
                let sql = format!("SELECT COUNT(*) FROM {}", t.name());
                s.conn.query_row(&sql, [], |r| r.get::<_, i64>(0)).unwrap()
            })
            .sum()
    }

    fn buckets(s: &Store, step: Step) -> Vec<i64> {
        let sql = format!(
            "SELECT DISTINCT bucket FROM {} ORDER BY bucket",
            step.name()
        );
        let mut stmt = s.conn.prepare(&sql).unwrap();
        let b = stmt.query_map([], |r| r.get(0)).unwrap();
        b.map(Result::unwrap).collect()
    }

    #[test]
    fn prune_keeps_buckets_overlapping_retention() {
        // 3 days of 1 event every 10 minutes.
        let data = events(DAY0, 3 * 1440, 3 * 144);
        let mut s = mem();
        s.write_minutes(&data).unwrap();
        assert_eq!(buckets(&s, Step::Minute).len(), 432);
        assert_eq!(buckets(&s, Step::Hour).len(), 72);
        assert_eq!(buckets(&s, Step::Day).len(), 3);
        let before = rows(&s);
        let now = DAY0 + 3 * 86_400; // end of the data
                                     // Keep 2 h 5 min of minutes, 1 day + 30 min of hours, 1 day of days.
        let deleted = s.prune(now, 7500, 86_400 + 1800, 86_400).unwrap();
        assert_eq!(deleted as i64, before - rows(&s));
        // A row stays while bucket + step > now - keep.
        let minutes = buckets(&s, Step::Minute);
        assert!(minutes.iter().all(|&b| b + 60 > now - 7500));
        // The 10-minute marks from now - 7200: 12 buckets.
        assert_eq!(minutes.first(), Some(&(now - 7200)));
        assert_eq!(minutes.len(), 12);
        // Hours: the one starting at now - 25 h ends inside the retention
        // (now - 24.5 h), so it stays: 25 hours.
        let hours = buckets(&s, Step::Hour);
        assert_eq!(hours.first(), Some(&(now - 25 * 3600)));
        assert_eq!(hours.len(), 25);
        // Days: the day before the last ends exactly at the cutoff: gone.
        assert_eq!(buckets(&s, Step::Day), [now - 86_400]);
        let r = s.query(&query(now - 7200, now, Step::Minute)).unwrap();
        assert_eq!(r.series.len(), 12);
        assert_eq!(s.prune(now, 7500, 88_200, 86_400).unwrap(), 0);
    }

    #[test]
    fn malformed_blobs_are_skipped_and_counted() {
        let rows = events(DAY0, 2, 100);
        let mut s = mem();
        s.write_minutes(&rows).unwrap();
        let changed = s
            .conn
            .execute(
                "UPDATE minute SET clients = x'deadbeef', latency = x'', top_paths = 'text' \
                 WHERE bucket = ?1",
                [DAY0],
            )
            .unwrap();
        assert!(changed > 0);
        let q = query(DAY0, DAY0 + 3600, Step::Minute);
        let r = s.query(&q).unwrap();
        assert_eq!(r.total.requests, 100); // counters are intact
        assert_eq!(s.malformed(), 3 * changed as u64);
        // The corrupt minute's clients are missing from the union.
        let second = r.series[1].unique_clients;
        assert_eq!(r.total.unique_clients, second);
        // Writing on top of a corrupt row repairs it with the new data.
        s.write_minutes(&rows).unwrap();
        let r = s.query(&q).unwrap();
        assert_eq!(r.total.requests, 200);
        assert!(r.series[0].unique_clients > 0);
        // The hour row was never corrupt.
        let h = s.query(&query(DAY0, DAY0 + 3600, Step::Hour)).unwrap();
        assert_eq!(h.total.requests, 200);
    }

    #[test]
    fn report_serializes_to_json() {
        let rows = events(DAY0, 1, 10);
        let mut s = mem();
        s.write_minutes(&rows).unwrap();
        let r = s.query(&query(DAY0, DAY0 + 60, Step::Minute)).unwrap();
        let v: serde_json::Value = serde_json::to_value(&r).unwrap();
        assert_eq!(v["step"], "minute");
        assert_eq!(v["from"], DAY0);
        assert_eq!(v["total"]["requests"], 10);
        assert_eq!(v["series"][0]["t"], DAY0);
        assert_eq!(v["total"]["status"].as_array().unwrap().len(), 5);
        assert_eq!(v["top_hosts"][0][0], "h0.example");
        assert!(v["total"]["p99_us"].is_u64());
        assert_eq!(Step::from_name("hour"), Some(Step::Hour));
        assert_eq!(Step::from_name("week"), None);
    }
}
