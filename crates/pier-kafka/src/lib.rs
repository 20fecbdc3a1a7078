//! Pier's analytics when one machine is not enough: every request's event
//! goes to Kafka ([`Sink`]), and `pier aggregate` ([`aggregate::run`])
//! consumes the topic in a consumer group, aggregates per minute with
//! [`pier_analytics::Aggregator`] and merges the rollups into PostgreSQL
//! (`hll` extension) — per minute, hour and day, exactly once.
//!
//! See docs/analytics-kafka.md for the schemas, the pipeline and the
//! exactly-once argument.
//!
//! # Wiring the sink
//! ```no_run
//! use pier_kafka::{Sink, SinkConfig};
//! use std::time::Duration;
//! let sink = Sink::start(&SinkConfig {
//!     brokers: vec!["127.0.0.1:9092".into()],
//!     topic: "pier-events".into(),
//!     batch_size: 10_000,
//!     linger: Duration::from_millis(100),
//!     compression: "lz4".into(),
//!     queue: 100_000,
//! })
//! .unwrap();
//! // On the analytics thread, for every request:
//! sink.offer(&pier_analytics::EventRef::EMPTY);
//! // At shutdown:
//! sink.flush(Duration::from_secs(5));
//! println!("{:?}", sink.stats());
//! ```
//!
//! # Why librdkafka (the `rdkafka` crate)
//! - The aggregator needs consumer groups with partition rebalancing, and
//!   rebalance callbacks in which it seeks each newly assigned partition to
//!   the offset PostgreSQL has. librdkafka has all of it; the pure-Rust
//!   clients do not (`rskafka` has no consumer groups; `kafka` has no
//!   rebalancing).
//! - The producer side gives idempotent produce (no duplicates when a batch
//!   is retried across a broker restart, so counts stay exact), a bounded
//!   queue whose overflow is an immediate error (never a block), batching by
//!   count and linger, and every codec (gzip, snappy, lz4, zstd), all from
//!   its own threads: [`Sink::offer`] costs an encode and a queue insert.
//! - Measured here (BENCHMARKS.md): the sink sustains over a million events
//!   per CPU-second.
//! - Build: Debian 12's `librdkafka-dev` is 2.0.2, older than rdkafka 0.39
//!   accepts (2.12), so librdkafka is built from the crate's vendored source.
//!   Its CMake build (`cmake-build`) fails on 2.12.1 without libcurl
//!   (`rdkafka_conf.c` tests `#ifdef WITH_OAUTHBEARER_OIDC`, which CMake
//!   defines to 0), so the default `./configure` build is used, with curl,
//!   SSL and SASL off (plaintext brokers; enable the crate's `ssl` feature to
//!   add TLS). It adds about a minute of build on 2 cores, once.
//!
//! # The event encoding
//! Cap'n Proto (`schema/event.capnp`), packed: about 100 bytes for a typical
//! request before Kafka's batch compression, encoded without allocation into
//! reused buffers ([`event::Encoder`]), decodable field by field without
//! copying. The generated code is committed (`src/event_capnp.rs`).

pub mod aggregate;
pub mod event;
pub mod pg;
mod sink;
#[cfg(feature = "testenv")]
pub mod testenv;

#[rustfmt::skip]
#[allow(clippy::all, clippy::pedantic, unused, missing_docs, unsafe_code)]
#[path = "event_capnp.rs"]
pub mod event_capnp;

pub use aggregate::{parse_duration, AggregateConfig};
pub use sink::{producer_config, Sink, SinkConfig, SinkStats, COMPRESSIONS};

#[cfg(test)]
mod tests {
    use std::path::Path;
    use std::process::Command;

    /// Regenerates the Rust code from the schema with the `capnp` tool and
    /// compares it with the committed file. Without the tool (a fresh
    /// machine), nothing to compare: CI installs `capnproto`.
    #[test]
    fn generated_code_is_current() {
        let have_capnp = Command::new("capnp")
            .arg("--version")
            .output()
            .is_ok_and(|o| o.status.success());
        if !have_capnp {
            assert!(
                std::env::var_os("CI").is_none(),
                "CI must install capnproto (the `capnp` tool) to check src/event_capnp.rs"
            );
            eprintln!("capnp not installed: generated code not checked");
            return;
        }
        let dir = Path::new(env!("CARGO_MANIFEST_DIR"));
        let out = std::env::temp_dir().join(format!("pier-kafka-capnp-{}", std::process::id()));
        std::fs::create_dir_all(&out).unwrap();
        capnpc::CompilerCommand::new()
            .src_prefix(dir.join("schema"))
            .file(dir.join("schema/event.capnp"))
            .output_path(&out)
            .run()
            .expect("capnp compile");
        let fresh = std::fs::read_to_string(out.join("event_capnp.rs")).unwrap();
        let committed = std::fs::read_to_string(dir.join("src/event_capnp.rs")).unwrap();
        let _ = std::fs::remove_dir_all(&out);
        if std::env::var_os("PIER_KAFKA_REGENERATE").is_some() {
            std::fs::write(dir.join("src/event_capnp.rs"), &fresh).unwrap();
            return;
        }
        // The header names the capnp tool's version; the code must match.
        let body = |s: &str| {
            s.lines()
                .filter(|l| !l.starts_with("// capnp binary version"))
                .collect::<Vec<_>>()
                .join("\n")
        };
        assert!(
            body(&fresh) == body(&committed),
            "src/event_capnp.rs is stale: regenerate it with \
             PIER_KAFKA_REGENERATE=1 cargo test -p pier-kafka generated_code_is_current"
        );
    }
}
