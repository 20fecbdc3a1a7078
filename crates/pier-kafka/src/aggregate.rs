//! `pier aggregate`: consumes the event topic in a consumer group,
//! aggregates per minute and merges into PostgreSQL.
//!
//! Exactly once into PostgreSQL: the offsets consumed are stored in
//! PostgreSQL (`pier_kafka_offsets`) in the same transaction as the rows they
//! produced; on assignment each partition is read from the offset PostgreSQL
//! has, whatever Kafka's committed offset says. Offsets are committed to
//! Kafka only after PostgreSQL has them, for monitoring (consumer lag).

use crate::event;
use crate::pg;
use pier_analytics::Aggregator;
use rdkafka::config::ClientConfig;
use rdkafka::consumer::{BaseConsumer, CommitMode, Consumer, ConsumerContext};
use rdkafka::error::KafkaError;
use rdkafka::types::RDKafkaRespErr;
use rdkafka::{ClientContext, Message, Offset, TopicPartitionList};
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// `pier aggregate`'s options.
#[derive(Clone, Debug)]
pub struct AggregateConfig {
    /// Bootstrap brokers, `host:port`.
    pub brokers: Vec<String>,
    pub topic: String,
    /// Consumer group: aggregators in one group share the partitions.
    pub group: String,
    /// libpq-style connection string or `postgresql://` URL.
    pub postgres: String,
    /// The password, when not in `postgres` (kept off the command line:
    /// `pier aggregate` reads it from PGPASSWORD or a file).
    pub password: Option<String>,
    /// How often the rollups of the events read so far are merged into
    /// PostgreSQL (the lag from event to row is about this).
    pub flush: Duration,
    /// (host, route) keys kept per minute; past it events count in `(other)`.
    pub max_keys: usize,
}

impl AggregateConfig {
    /// The connection settings: `postgres` parsed, `password` added.
    pub fn pg_config(&self) -> Result<postgres::Config, String> {
        let mut c: postgres::Config = self
            .postgres
            .parse()
            .map_err(|e| format!("postgres connection string: {e}"))?;
        if let Some(p) = &self.password {
            c.password(p);
        }
        Ok(c)
    }
}

/// Whether a connection string carries a password (which, given on the
/// command line, every local user can read in `ps` or /proc).
pub fn has_password(postgres: &str) -> Result<bool, String> {
    let c: postgres::Config = postgres
        .parse()
        .map_err(|e| format!("postgres connection string: {e}"))?;
    Ok(c.get_password().is_some())
}

impl Default for AggregateConfig {
    fn default() -> Self {
        Self {
            brokers: vec!["127.0.0.1:9092".into()],
            topic: "pier-events".into(),
            group: "pier-aggregate".into(),
            postgres: "host=127.0.0.1 user=postgres".into(),
            password: None,
            flush: Duration::from_secs(5),
            max_keys: 10_000,
        }
    }
}

/// Parses `5s`, `500ms`, `2m`, `1h`, or plain seconds.
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    let s = s.trim();
    let split = s
        .find(|c: char| !c.is_ascii_digit() && c != '.')
        .unwrap_or(s.len());
    let (num, unit) = s.split_at(split);
    let n: f64 = num.parse().map_err(|_| format!("bad duration {s:?}"))?;
    let secs = match unit.trim() {
        "" | "s" => n,
        "ms" => n / 1000.0,
        "m" => n * 60.0,
        "h" => n * 3600.0,
        _ => return Err(format!("bad duration {s:?}: unit must be ms, s, m or h")),
    };
    if !secs.is_finite() || secs <= 0.0 || secs > 86400.0 {
        return Err(format!("duration {s:?} out of range"));
    }
    Ok(Duration::from_secs_f64(secs))
}

/// A partition this aggregator holds.
#[derive(Clone, Copy, Debug)]
struct Part {
    /// PostgreSQL's next offset (None: no row yet).
    stored: Option<i64>,
    /// Next offset after the last event aggregated (= stored when none).
    next: Option<i64>,
}

struct State {
    cfg: AggregateConfig,
    pg: Option<postgres::Client>,
    agg: Aggregator,
    parts: BTreeMap<i32, Part>,
    /// Events aggregated since the last flush.
    pending: u64,
    /// The in-memory state was lost (a flush failed): the partitions must be
    /// read again from PostgreSQL's offsets.
    reseek: bool,
    /// For tests: abort inside the N-th transaction with data.
    abort_in_flush: Option<u64>,
    flushes: u64,
    malformed: u64,
    total: u64,
}

struct Ctx {
    state: Mutex<State>,
}

fn lock(m: &Mutex<State>) -> MutexGuard<'_, State> {
    match m.lock() {
        Ok(g) => g,
        Err(p) => p.into_inner(),
    }
}

impl ClientContext for Ctx {
    fn log(&self, level: rdkafka::config::RDKafkaLogLevel, fac: &str, msg: &str) {
        use rdkafka::config::RDKafkaLogLevel::*;
        if matches!(level, Emerg | Alert | Critical | Error) {
            tracing::warn!("librdkafka {fac}: {msg}");
        }
    }
    fn error(&self, error: KafkaError, reason: &str) {
        tracing::debug!("kafka: {error}: {reason}");
    }
}

impl ConsumerContext for Ctx {
    /// Eager rebalancing, done by hand so that each partition starts at the
    /// offset PostgreSQL has.
    fn rebalance(
        &self,
        consumer: &BaseConsumer<Self>,
        err: RDKafkaRespErr,
        tpl: &mut TopicPartitionList,
    ) {
        let mut st = lock(&self.state);
        match err {
            RDKafkaRespErr::RD_KAFKA_RESP_ERR__ASSIGN_PARTITIONS => {
                let parts: Vec<i32> = tpl.elements().iter().map(|e| e.partition()).collect();
                match st.load_offsets(&parts) {
                    Ok(stored) => {
                        let mut assign = TopicPartitionList::new();
                        for &p in &parts {
                            let at = stored.get(&p).copied();
                            let offset = at.map(Offset::Offset).unwrap_or(Offset::Beginning);
                            let _ = assign.add_partition_offset(&st.cfg.topic, p, offset);
                            st.parts.insert(
                                p,
                                Part {
                                    stored: at,
                                    next: at,
                                },
                            );
                        }
                        tracing::info!("assigned partitions {parts:?} from offsets {stored:?}");
                        if let Err(e) = consumer.assign(&assign) {
                            tracing::error!("assign: {e}");
                        }
                    }
                    Err(e) => {
                        // Without PostgreSQL's offsets nothing can be read
                        // safely: take no partitions; the group reassigns
                        // them after this member's session times out.
                        tracing::error!("assigned {parts:?} but cannot read offsets: {e}");
                        st.pg = None;
                        let _ = consumer.assign(&TopicPartitionList::new());
                    }
                }
            }
            RDKafkaRespErr::RD_KAFKA_RESP_ERR__REVOKE_PARTITIONS => {
                // Write what was read before another aggregator reads on from
                // PostgreSQL's offsets.
                if let Err(e) = st.flush() {
                    tracing::warn!(
                        "flush at revoke: {e} (the next owner reads those events again)"
                    );
                }
                let revoked: Vec<i32> = tpl.elements().iter().map(|e| e.partition()).collect();
                tracing::info!("revoked partitions {revoked:?}");
                st.parts.clear();
                st.reseek = false;
                let _ = consumer.unassign();
            }
            e => {
                tracing::warn!("rebalance error {e:?}");
                st.parts.clear();
                let _ = consumer.unassign();
            }
        }
    }
}

impl State {
    fn client(&mut self) -> Result<&mut postgres::Client, String> {
        if self.pg.as_ref().is_some_and(|c| c.is_closed()) {
            self.pg = None;
        }
        if self.pg.is_none() {
            let c = self
                .cfg
                .pg_config()?
                .connect(postgres::NoTls)
                .map_err(|e| format!("postgres: {e}"))?;
            self.pg = Some(c);
        }
        Ok(self.pg.as_mut().expect("connected above"))
    }

    fn load_offsets(&mut self, parts: &[i32]) -> Result<BTreeMap<i32, i64>, String> {
        let topic = self.cfg.topic.clone();
        let c = self.client()?;
        pg::offsets(c, &topic, parts).map_err(|e| e.to_string())
    }

    fn add(&mut self, partition: i32, offset: i64, payload: Option<&[u8]>) {
        if self.reseek {
            return; // read again after the re-seek
        }
        let Some(part) = self.parts.get_mut(&partition) else {
            return; // not ours (any more)
        };
        if part.next.is_some_and(|n| offset < n) {
            return; // already counted
        }
        part.next = Some(offset + 1);
        let agg = &mut self.agg;
        match event::decode(payload.unwrap_or_default(), |e| agg.add(e)) {
            Ok(()) => {
                self.pending += 1;
                self.total += 1;
            }
            Err(e) => {
                self.malformed += 1;
                if self.malformed.is_power_of_two() {
                    tracing::warn!(
                        "partition {partition} offset {offset}: {e} ({} so far)",
                        self.malformed
                    );
                }
            }
        }
    }

    /// Writes everything read since the last flush. On error the events are
    /// dropped from memory and `reseek` is set: they are read again from
    /// PostgreSQL's offsets.
    fn flush(&mut self) -> Result<(), String> {
        if self.reseek {
            // The events behind the offsets were dropped: writing offsets
            // now would lose them.
            return Err("state lost in an earlier flush; re-reading first".into());
        }
        let ranges: BTreeMap<i32, (Option<i64>, i64)> = self
            .parts
            .iter()
            .filter_map(|(&p, part)| match part.next {
                Some(n) if Some(n) != part.stored => Some((p, (part.stored, n))),
                _ => None,
            })
            .collect();
        if ranges.is_empty() && self.agg.is_empty() {
            return Ok(());
        }
        let minutes = self.agg.take_all();
        let events = std::mem::take(&mut self.pending);
        self.flushes += 1;
        let abort = self.abort_in_flush == Some(self.flushes);
        let topic = self.cfg.topic.clone();
        let t = Instant::now();
        let mut result = Err(String::new());
        for attempt in 0..5 {
            let c = match self.client() {
                Ok(c) => c,
                Err(e) => {
                    result = Err(e);
                    break;
                }
            };
            let batch = pg::Batch {
                topic: &topic,
                ranges: &ranges,
                minutes: &minutes,
            };
            match pg::write_batch(c, &batch, || {
                if abort {
                    eprintln!("pier aggregate: PIER_AGGREGATE_ABORT_IN_FLUSH: aborting inside the transaction");
                    std::process::abort();
                }
            }) {
                Ok(()) => {
                    result = Ok(());
                    break;
                }
                Err(e) if e.is_retryable() && attempt < 4 => {
                    tracing::debug!("flush: {e}; retrying");
                }
                Err(e) => {
                    result = Err(e.to_string());
                    break;
                }
            }
        }
        match result {
            Ok(()) => {
                for (p, (_, to)) in &ranges {
                    if let Some(part) = self.parts.get_mut(p) {
                        part.stored = Some(*to);
                    }
                }
                tracing::debug!(
                    "flushed {events} events, {} minute rows, offsets {ranges:?} in {:?}",
                    minutes.len(),
                    t.elapsed()
                );
                Ok(())
            }
            Err(e) => {
                self.reseek = true;
                self.agg = Aggregator::new(self.cfg.max_keys);
                Err(e)
            }
        }
    }

    /// After a failed flush: every partition held goes back to the offset
    /// PostgreSQL has.
    fn reseek(&mut self, consumer: &BaseConsumer<Ctx>) -> Result<(), String> {
        let parts: Vec<i32> = self.parts.keys().copied().collect();
        let stored = self.load_offsets(&parts)?;
        let mut tpl = TopicPartitionList::new();
        for &p in &parts {
            let at = stored.get(&p).copied();
            let _ = tpl.add_partition_offset(
                &self.cfg.topic,
                p,
                at.map(Offset::Offset).unwrap_or(Offset::Beginning),
            );
            self.parts.insert(
                p,
                Part {
                    stored: at,
                    next: at,
                },
            );
        }
        // Re-assigning resets the fetch positions (and drops what was
        // prefetched), as seeking would, in one call.
        consumer.assign(&tpl).map_err(|e| format!("assign: {e}"))?;
        self.reseek = false;
        tracing::info!("re-read partitions {parts:?} from offsets {stored:?}");
        Ok(())
    }

    /// Offsets PostgreSQL has, for Kafka's committed offsets (monitoring).
    fn committed(&self) -> TopicPartitionList {
        let mut tpl = TopicPartitionList::new();
        for (&p, part) in &self.parts {
            if let Some(at) = part.stored {
                let _ = tpl.add_partition_offset(&self.cfg.topic, p, Offset::Offset(at));
            }
        }
        tpl
    }
}

/// librdkafka consumer settings.
fn consumer_config(cfg: &AggregateConfig) -> ClientConfig {
    let mut c = ClientConfig::new();
    c.set("bootstrap.servers", cfg.brokers.join(","))
        .set("group.id", &cfg.group)
        .set("client.id", "pier-aggregate")
        // Positions come from PostgreSQL; Kafka's offsets are informational.
        .set("enable.auto.commit", "false")
        .set("enable.auto.offset.store", "false")
        .set("auto.offset.reset", "earliest")
        .set("partition.assignment.strategy", "roundrobin")
        // A killed aggregator's partitions move to the others within ~6 s.
        .set("session.timeout.ms", "6000")
        .set("heartbeat.interval.ms", "1000")
        .set("allow.auto.create.topics", "true")
        .set("topic.metadata.refresh.interval.ms", "5000")
        .set("reconnect.backoff.ms", "50")
        .set("reconnect.backoff.max.ms", "1000")
        .set("log.connection.close", "false");
    c
}

/// Runs until `stop` is set; then writes what it has read and leaves the
/// group. Errors only for what cannot be retried (bad config, PostgreSQL
/// schema refused).
pub fn run(cfg: &AggregateConfig, stop: &AtomicBool) -> Result<(), String> {
    if cfg.brokers.is_empty() || cfg.topic.is_empty() || cfg.group.is_empty() {
        return Err("pier aggregate: --kafka, --topic and --group must not be empty".into());
    }
    let mut pg = cfg
        .pg_config()
        .map_err(|e| format!("pier aggregate: {e}"))?
        .connect(postgres::NoTls)
        .map_err(|e| format!("pier aggregate: postgres: {e}"))?;
    let citus = pg::ensure_schema(&mut pg).map_err(|e| format!("pier aggregate: schema: {e}"))?;
    tracing::info!(
        "pier aggregate: topic {} group {} into PostgreSQL{}",
        cfg.topic,
        cfg.group,
        if citus {
            " (Citus: distributed tables)"
        } else {
            ""
        }
    );
    let abort_in_flush = std::env::var("PIER_AGGREGATE_ABORT_IN_FLUSH")
        .ok()
        .and_then(|v| v.parse().ok());
    let ctx = Ctx {
        state: Mutex::new(State {
            cfg: cfg.clone(),
            pg: Some(pg),
            agg: Aggregator::new(cfg.max_keys),
            parts: BTreeMap::new(),
            pending: 0,
            reseek: false,
            abort_in_flush,
            flushes: 0,
            malformed: 0,
            total: 0,
        }),
    };
    let consumer: BaseConsumer<Ctx> = consumer_config(cfg)
        .create_with_context(ctx)
        .map_err(|e| format!("pier aggregate: kafka: {e}"))?;
    consumer
        .subscribe(&[&cfg.topic])
        .map_err(|e| format!("pier aggregate: subscribe: {e}"))?;

    let mut next_flush = Instant::now() + cfg.flush;
    while !stop.load(Ordering::Relaxed) {
        let wait = next_flush
            .saturating_duration_since(Instant::now())
            .min(Duration::from_millis(100));
        match consumer.poll(wait) {
            Some(Ok(m)) => {
                let mut st = lock(&consumer.context().state);
                st.add(m.partition(), m.offset(), m.payload());
            }
            Some(Err(e)) => tracing::debug!("kafka: {e}"),
            None => {}
        }
        if Instant::now() >= next_flush {
            next_flush = Instant::now() + cfg.flush;
            let mut st = lock(&consumer.context().state);
            if st.reseek {
                if let Err(e) = st.reseek(&consumer) {
                    tracing::warn!("cannot re-read partitions yet: {e}");
                }
                continue;
            }
            match st.flush() {
                Ok(()) => {
                    let tpl = st.committed();
                    drop(st);
                    if tpl.count() > 0 {
                        let _ = consumer.commit(&tpl, CommitMode::Async);
                    }
                }
                Err(e) => tracing::warn!("flush failed: {e}; re-reading from PostgreSQL's offsets"),
            }
        }
    }
    let mut st = lock(&consumer.context().state);
    if !st.reseek {
        if let Err(e) = st.flush() {
            tracing::warn!("final flush failed: {e}");
        }
    }
    tracing::info!(
        "pier aggregate: stopping after {} events ({} malformed)",
        st.total,
        st.malformed
    );
    st.parts.clear();
    drop(st);
    consumer.unsubscribe();
    Ok(())
}

/// [`run`] until SIGTERM or SIGINT (`pier aggregate`).
pub fn run_until_signal(cfg: &AggregateConfig) -> Result<(), String> {
    let stop = stop_on_signals()?;
    run(cfg, &stop)
}

/// Sets the returned flag on SIGTERM or SIGINT.
pub fn stop_on_signals() -> Result<Arc<AtomicBool>, String> {
    let stop = Arc::new(AtomicBool::new(false));
    for sig in [signal_hook::consts::SIGTERM, signal_hook::consts::SIGINT] {
        signal_hook::flag::register(sig, stop.clone()).map_err(|e| format!("signal: {e}"))?;
    }
    Ok(stop)
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_password_comes_from_beside_the_connection_string() {
        use super::*;
        assert_eq!(has_password("host=db user=agg"), Ok(false));
        assert_eq!(has_password("host=db user=agg password=s3cret"), Ok(true));
        assert_eq!(has_password("postgresql://agg:s3cret@db/pier"), Ok(true));
        assert_eq!(has_password("postgresql://agg@db/pier"), Ok(false));
        let cfg = AggregateConfig {
            postgres: "postgresql://agg@db/pier".into(),
            password: Some("from-env".into()),
            ..Default::default()
        };
        let c = cfg.pg_config().unwrap();
        assert_eq!(c.get_password(), Some(&b"from-env"[..]));
        assert_eq!(c.get_user(), Some("agg"));
    }

    use super::*;

    #[test]
    fn durations() {
        assert_eq!(parse_duration("5s").unwrap(), Duration::from_secs(5));
        assert_eq!(parse_duration("250ms").unwrap(), Duration::from_millis(250));
        assert_eq!(parse_duration("2").unwrap(), Duration::from_secs(2));
        assert_eq!(parse_duration("1m").unwrap(), Duration::from_secs(60));
        for bad in ["", "s", "0s", "-1s", "5 days", "1e999"] {
            assert!(parse_duration(bad).is_err(), "{bad}");
        }
    }
}
