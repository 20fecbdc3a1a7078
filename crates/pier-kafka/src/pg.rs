//! The PostgreSQL side of `pier aggregate`: schema, and the one transaction
//! per flush that merges rows and advances the consumed offsets together.

use pier_analytics::hll::Hll;
use pier_analytics::sketch::Latency;
use pier_analytics::{Key, Rollup};
use postgres::{Client, GenericClient, Transaction};
use std::collections::BTreeMap;

/// The rollup tables: name and bucket length in seconds.
pub const TABLES: [(&str, i64); 3] = [
    ("pier_minute", 60),
    ("pier_hour", 3600),
    ("pier_day", 86400),
];

/// The schema (idempotent: `CREATE ... IF NOT EXISTS`).
pub const SCHEMA: &str = r#"
CREATE EXTENSION IF NOT EXISTS hll;

CREATE TABLE IF NOT EXISTS pier_minute (
    bucket         timestamptz NOT NULL,
    host           text        NOT NULL,
    route          text        NOT NULL,
    requests       bigint      NOT NULL DEFAULT 0,
    bytes_in       bigint      NOT NULL DEFAULT 0,
    bytes_out      bigint      NOT NULL DEFAULT 0,
    status_1xx     bigint      NOT NULL DEFAULT 0,
    status_2xx     bigint      NOT NULL DEFAULT 0,
    status_3xx     bigint      NOT NULL DEFAULT 0,
    status_4xx     bigint      NOT NULL DEFAULT 0,
    status_5xx     bigint      NOT NULL DEFAULT 0,
    latency_p50_us bigint      NOT NULL DEFAULT 0,
    latency_p90_us bigint      NOT NULL DEFAULT 0,
    latency_p99_us bigint      NOT NULL DEFAULT 0,
    latency        bytea,
    clients        hll(14, 5)  NOT NULL DEFAULT hll_empty(14, 5),
    PRIMARY KEY (host, bucket, route)
);
CREATE TABLE IF NOT EXISTS pier_hour (LIKE pier_minute INCLUDING ALL);
CREATE TABLE IF NOT EXISTS pier_day (LIKE pier_minute INCLUDING ALL);
CREATE INDEX IF NOT EXISTS pier_minute_bucket ON pier_minute (bucket);
CREATE INDEX IF NOT EXISTS pier_hour_bucket ON pier_hour (bucket);
CREATE INDEX IF NOT EXISTS pier_day_bucket ON pier_day (bucket);

CREATE TABLE IF NOT EXISTS pier_kafka_offsets (
    topic       text        NOT NULL,
    partition   integer     NOT NULL,
    next_offset bigint      NOT NULL,
    updated     timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (topic, partition)
);
"#;

/// A PostgreSQL error, or the fence: another aggregator advanced a
/// partition's offset since this one read it.
#[derive(Debug)]
pub enum Error {
    Pg(postgres::Error),
    Fenced { partition: i32 },
}

impl std::fmt::Display for Error {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Error::Pg(e) => {
                write!(f, "postgres: {e}")?;
                if let Some(db) = e.as_db_error() {
                    write!(f, ": {}", db.message())?;
                }
                Ok(())
            }
            Error::Fenced { partition } => write!(
                f,
                "partition {partition}: its offset in PostgreSQL moved (another aggregator owns it now)"
            ),
        }
    }
}

impl From<postgres::Error> for Error {
    fn from(e: postgres::Error) -> Self {
        Error::Pg(e)
    }
}

impl Error {
    /// A deadlock or serialization failure: the transaction may simply be
    /// run again.
    pub fn is_retryable(&self) -> bool {
        match self {
            Error::Pg(e) => matches!(e.code().map(|c| c.code()), Some("40P01" | "40001")),
            Error::Fenced { .. } => false,
        }
    }
}

/// Creates the tables; on Citus, distributes them by host (the offsets table
/// becomes a reference table). Returns whether Citus was found.
pub fn ensure_schema(c: &mut Client) -> Result<bool, Error> {
    // Two aggregators starting together: one creates, the other waits.
    let mut tx = c.transaction()?;
    tx.execute("SELECT pg_advisory_xact_lock(7354921)", &[])?;
    tx.batch_execute(SCHEMA)?;
    let citus = tx
        .query_opt("SELECT 1 FROM pg_extension WHERE extname = 'citus'", &[])?
        .is_some();
    if citus {
        // UNTESTED: Citus is not installable on the machines this was built
        // on. create_distributed_table refuses a table already distributed,
        // hence the check.
        for (table, _) in TABLES {
            let done = tx
                .query_opt(
                    "SELECT 1 FROM pg_dist_partition WHERE logicalrelid = $1::regclass",
                    &[&table],
                )?
                .is_some();
            if !done {
                tx.execute(
                    "SELECT create_distributed_table($1, 'host', colocate_with => 'default')",
                    &[&table],
                )?;
            }
        }
        let done = tx
            .query_opt(
                "SELECT 1 FROM pg_dist_partition WHERE logicalrelid = 'pier_kafka_offsets'::regclass",
                &[],
            )?
            .is_some();
        if !done {
            tx.execute("SELECT create_reference_table('pier_kafka_offsets')", &[])?;
        }
    }
    tx.commit()?;
    Ok(citus)
}

/// The next offset to consume per partition, as PostgreSQL has it (absent:
/// nothing of that partition was ever written).
pub fn offsets(
    c: &mut impl GenericClient,
    topic: &str,
    partitions: &[i32],
) -> Result<BTreeMap<i32, i64>, Error> {
    let rows = c.query(
        "SELECT partition, next_offset FROM pier_kafka_offsets \
         WHERE topic = $1 AND partition = ANY($2)",
        &[&topic, &partitions],
    )?;
    Ok(rows.iter().map(|r| (r.get(0), r.get(1))).collect())
}

/// What one flush writes: the consumed range of each partition and the
/// minute rollups of those events.
pub struct Batch<'a> {
    pub topic: &'a str,
    /// partition -> (next offset PostgreSQL has, or None if it has no row;
    /// next offset after this batch).
    pub ranges: &'a BTreeMap<i32, (Option<i64>, i64)>,
    pub minutes: &'a [(Key, Rollup)],
}

/// Merges the batch's rollups into the minute, hour and day tables and
/// advances the offsets, all in one transaction: either all of it is in
/// PostgreSQL or none of it. `before_commit` runs last inside the
/// transaction (tests use it to die there).
pub fn write_batch(c: &mut Client, b: &Batch, before_commit: impl FnOnce()) -> Result<(), Error> {
    let mut tx = c.transaction()?;
    // Offsets first, in partition order: the fence. Two live aggregators
    // never hold the same partition; a stale one (it lost the partition
    // without noticing) finds the offset moved and writes nothing.
    for (&p, &(from, to)) in b.ranges {
        if Some(to) == from {
            continue;
        }
        let n = match from {
            Some(from) => tx.execute(
                "UPDATE pier_kafka_offsets SET next_offset = $3, updated = now() \
                 WHERE topic = $1 AND partition = $2 AND next_offset = $4",
                &[&b.topic, &p, &to, &from],
            )?,
            None => tx.execute(
                "INSERT INTO pier_kafka_offsets (topic, partition, next_offset) \
                 VALUES ($1, $2, $3) ON CONFLICT DO NOTHING",
                &[&b.topic, &p, &to],
            )?,
        };
        if n != 1 {
            return Err(Error::Fenced { partition: p });
        }
    }
    for (table, secs) in TABLES {
        let rows = if secs == 60 {
            b.minutes.to_vec()
        } else {
            coarsen(b.minutes, secs)
        };
        merge_rows(&mut tx, table, &rows)?;
    }
    before_commit();
    tx.commit()?;
    Ok(())
}

/// The rollups re-keyed by the `secs`-long bucket containing them, merged.
pub fn coarsen(rows: &[(Key, Rollup)], secs: i64) -> Vec<(Key, Rollup)> {
    let mut out: BTreeMap<Key, Rollup> = BTreeMap::new();
    for (k, r) in rows {
        let key = Key {
            bucket: k.bucket.div_euclid(secs) * secs,
            host: k.host.clone(),
            route: k.route.clone(),
        };
        out.entry(key).or_default().merge(r);
    }
    out.into_iter().collect()
}

/// A row's counters (requests, bytes in, bytes out, 5 status classes) and
/// latency sketch as PostgreSQL has them.
type Stored = (Vec<i64>, Option<Vec<u8>>);

/// Adds `rows` into `table`. Counters and the latency sketch are merged
/// here under row locks (SELECT ... FOR UPDATE, in primary key order, the
/// same order for every aggregator so that two never deadlock); unique
/// clients with `hll_union` in SQL.
fn merge_rows(tx: &mut Transaction, table: &str, rows: &[(Key, Rollup)]) -> Result<(), Error> {
    if rows.is_empty() {
        return Ok(());
    }
    // Primary key order: (host, bucket, route).
    let mut rows: Vec<&(Key, Rollup)> = rows.iter().collect();
    rows.sort_by(|a, b| {
        (&a.0.host, a.0.bucket, &a.0.route).cmp(&(&b.0.host, b.0.bucket, &b.0.route))
    });
    let buckets: Vec<i64> = rows.iter().map(|(k, _)| k.bucket).collect();
    let hosts: Vec<&str> = rows.iter().map(|(k, _)| k.host.as_str()).collect();
    let routes: Vec<&str> = rows.iter().map(|(k, _)| k.route.as_str()).collect();

    tx.execute(
        &format!(
            "INSERT INTO {table} (bucket, host, route) \
             SELECT to_timestamp(b), h, r FROM unnest($1::int8[], $2::text[], $3::text[]) \
             WITH ORDINALITY AS u(b, h, r, i) ORDER BY i \
             ON CONFLICT DO NOTHING"
        ),
        &[&buckets, &hosts, &routes],
    )?;
    let existing = tx.query(
        &format!(
            "SELECT host, extract(epoch FROM bucket)::int8, route, requests, bytes_in, bytes_out, \
                    status_1xx, status_2xx, status_3xx, status_4xx, status_5xx, latency \
             FROM {table} \
             WHERE (host, bucket, route) IN \
                   (SELECT h, to_timestamp(b), r FROM unnest($1::int8[], $2::text[], $3::text[]) AS u(b, h, r)) \
             ORDER BY host, bucket, route FOR UPDATE"
        ),
        &[&buckets, &hosts, &routes],
    )?;
    let mut current: BTreeMap<(String, i64, String), Stored> = BTreeMap::new();
    for r in &existing {
        let counters: Vec<i64> = (3..11).map(|i| r.get::<_, i64>(i)).collect();
        current.insert((r.get(0), r.get(1), r.get(2)), (counters, r.get(11)));
    }

    let n = rows.len();
    let mut cols: Vec<Vec<i64>> = (0..11).map(|_| Vec::with_capacity(n)).collect();
    let mut latency: Vec<Vec<u8>> = Vec::with_capacity(n);
    let mut clients: Vec<Vec<u8>> = Vec::with_capacity(n);
    for (k, r) in &rows {
        let (old, old_latency) = current
            .get(&(k.host.clone(), k.bucket, k.route.clone()))
            .cloned()
            .unwrap_or((vec![0; 8], None));
        let new = [
            r.requests,
            r.bytes_in,
            r.bytes_out,
            r.status[0],
            r.status[1],
            r.status[2],
            r.status[3],
            r.status[4],
        ];
        for (i, v) in new.iter().enumerate() {
            cols[i].push(old[i].saturating_add(i64::try_from(*v).unwrap_or(i64::MAX)));
        }
        let mut lat = r.latency.clone();
        // A sketch we cannot read (written by an incompatible version) is
        // replaced: counters stay exact, only old quantiles are lost.
        if let Some(Ok(prev)) = old_latency.as_deref().map(Latency::from_bytes) {
            lat.merge(&prev);
        }
        for (i, q) in [0.5, 0.9, 0.99].into_iter().enumerate() {
            cols[8 + i].push(i64::try_from(lat.quantile(q)).unwrap_or(i64::MAX));
        }
        latency.push(lat.to_bytes());
        clients.push(r.clients.to_bytes());
    }
    tx.execute(
        &format!(
            "UPDATE {table} AS m SET \
                requests = u.requests, bytes_in = u.bytes_in, bytes_out = u.bytes_out, \
                status_1xx = u.s1, status_2xx = u.s2, status_3xx = u.s3, status_4xx = u.s4, status_5xx = u.s5, \
                latency_p50_us = u.p50, latency_p90_us = u.p90, latency_p99_us = u.p99, \
                latency = u.latency, clients = hll_union(m.clients, u.clients::hll) \
             FROM unnest($1::int8[], $2::text[], $3::text[], $4::int8[], $5::int8[], $6::int8[], \
                         $7::int8[], $8::int8[], $9::int8[], $10::int8[], $11::int8[], \
                         $12::int8[], $13::int8[], $14::int8[], $15::bytea[], $16::bytea[]) \
                  AS u(b, h, r, requests, bytes_in, bytes_out, s1, s2, s3, s4, s5, p50, p90, p99, latency, clients) \
             WHERE m.host = u.h AND m.bucket = to_timestamp(u.b) AND m.route = u.r"
        ),
        &[
            &buckets, &hosts, &routes, &cols[0], &cols[1], &cols[2], &cols[3], &cols[4], &cols[5],
            &cols[6], &cols[7], &cols[8], &cols[9], &cols[10], &latency, &clients,
        ],
    )?;
    Ok(())
}

/// Reads an `hll` column value back as a sketch (tests, tools).
pub fn hll_from_pg(bytes: &[u8]) -> Option<Hll> {
    Hll::from_bytes(bytes).ok()
}
