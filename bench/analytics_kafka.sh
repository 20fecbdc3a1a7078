#!/usr/bin/env bash
# Analytics scale-out benchmark (issue 12): the Kafka sink's throughput per CPU-second and
# the end-to-end lag from an event to its row in PostgreSQL, with a real single-node Kafka
# (KRaft, Apache Kafka 3.9.1's jars) and PostgreSQL 15 + hll, both started on free
# 127.0.0.1 ports by the bench binary (crates/pier-kafka/examples/analytics_kafka_bench.rs)
# and removed when it ends.
#
#   bench/analytics_kafka.sh                                  # ~2 minutes after the build
#   BENCH_EVENTS=500000 BENCH_SECS=10 bench/analytics_kafka.sh   # quick look
#
# Knobs: BENCH_EVENTS (sink phase, default 2000000), BENCH_RATE (lag phase events/s,
# default 20000), BENCH_SECS (lag phase length, default 30), BENCH_FLUSH (aggregator flush
# intervals, default "1s,200ms"). Output: printed, and bench/out/analytics-kafka.md.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
log() { printf '[analytics-kafka %s] %s\n' "$(date -u +%H:%M:%S)" "$*" >&2; }

need=()
for p in postgresql-15 postgresql-15-hll openjdk-17-jre-headless maven; do
  dpkg -s "$p" >/dev/null 2>&1 || need+=("$p")
done
if [ ${#need[@]} -gt 0 ]; then
  log "installing ${need[*]}"
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >/dev/null
fi
KAFKA_LIBS="$ROOT/target/kafka-libs"
if [ ! -f "$KAFKA_LIBS/.complete" ]; then
  log "downloading Kafka's jars (Maven Central)"
  rm -rf "$KAFKA_LIBS" && mkdir -p "$KAFKA_LIBS"
  cp crates/pier-kafka/testenv/pom.xml "$KAFKA_LIBS/pom.xml"
  (cd "$KAFKA_LIBS" && mvn -q -B dependency:copy-dependencies -DoutputDirectory=libs)
  touch "$KAFKA_LIBS/.complete"
fi
export PIER_KAFKA_LIBS="${PIER_KAFKA_LIBS:-$KAFKA_LIBS/libs}"
export PIER_PG_BIN="${PIER_PG_BIN:-/usr/lib/postgresql/15/bin}"

log "building (release)"
cargo build --release -q -p pier-kafka --features testenv --example analytics_kafka_bench
mkdir -p bench/out
log "running"
{
  echo "# Analytics: Kafka -> PostgreSQL ($(date -u +%Y-%m-%dT%H:%MZ), $(nproc) cores)"
  echo
  "$ROOT/target/release/examples/analytics_kafka_bench"
} | tee bench/out/analytics-kafka.md
