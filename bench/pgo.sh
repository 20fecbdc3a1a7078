#!/usr/bin/env bash
# A profile-guided build of Pier for benchmarks (issue 8: user CPU per request). Pier runs
# fewer instructions per request than nginx yet spent more user time at 50 connections: its
# code is laid out for no particular path. PGO lays the hot path out straight (branch
# weights, inlining and block order from a real run).
#
#   bash bench/pgo.sh            # -> target/pgo-use/dist/pier
#   PIER_BIN=target/pgo-use/dist/pier SKIP_BUILD=1 bash bench/run.sh
#
# Steps: an instrumented `dist` build (target/pgo-gen), a training run of that binary through
# bench/run.sh's own workloads (plain proxy and the Lua access hook, /hello and /4k.bin, 50 and
# 500 connections; a short bench/redis_incr.sh run for the cosocket path unless NO_REDIS=1;
# bench/cache.sh's hits and stored misses unless NO_CACHE=1),
# `llvm-profdata merge`, then a `dist` build that uses the profile (target/pgo-use).
# Needs rustup's `llvm-tools` component (its llvm-profdata matches rustc's LLVM).
# The normal builds are untouched: separate target directories, RUSTFLAGS only here.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
PROF="${PROF:-$ROOT/target/pgo-data}"
TRAIN_DURATION="${TRAIN_DURATION:-4}"
log() { printf '[pgo %s] %s\n' "$(date -u +%H:%M:%S)" "$*" >&2; }

SYSROOT="$(rustc --print sysroot)"
PROFDATA="$(ls "$SYSROOT"/lib/rustlib/*/bin/llvm-profdata 2>/dev/null | head -1 || true)"
if [ -z "$PROFDATA" ]; then
  log "installing rustup's llvm-tools (llvm-profdata for rustc's LLVM)"
  rustup component add llvm-tools >/dev/null
  PROFDATA="$(ls "$SYSROOT"/lib/rustlib/*/bin/llvm-profdata | head -1)"
fi

rm -rf "$PROF"; mkdir -p "$PROF/raw"
log "instrumented build (target/pgo-gen)"
(cd "$ROOT" && RUSTFLAGS="-Cprofile-generate=$PROF/raw" \
  cargo build -q --profile dist -p pier --target-dir target/pgo-gen)

log "training: bench/run.sh pier,pier-lua, ${TRAIN_DURATION}s per run"
PIER_BIN="$ROOT/target/pgo-gen/dist/pier" SKIP_BUILD=1 PROXIES=pier,pier-lua REPS=1 \
  DURATION="$TRAIN_DURATION" IDLE_CONNS=0 OUT_DIR="$PROF/out" bash "$ROOT/bench/run.sh" >"$PROF/train.log" 2>&1
if [ "${NO_REDIS:-0}" != 1 ] && command -v redis-server >/dev/null; then
  log "training: bench/redis_incr.sh (cosockets)"
  PIER_BIN="$ROOT/target/pgo-gen/dist/pier" SKIP_BUILD=1 PROXIES=pier-redis REPS=1 DURATION="$TRAIN_DURATION" \
    OUT_DIR="$PROF/out-redis" bash "$ROOT/bench/redis_incr.sh" >"$PROF/train-redis.log" 2>&1 || log "redis training failed (see $PROF/train-redis.log); going on"
fi
if [ "${NO_CACHE:-0}" != 1 ]; then
  # The cache's hit and miss paths: without them in the profile, LLVM lays out and optimises
  # the whole cache as cold code in the build that is meant to be deployed.
  log "training: bench/cache.sh hits (/hello, /4k.bin, /1m.bin) and stored misses"
  PIER_BIN="$ROOT/target/pgo-gen/dist/pier" SKIP_BUILD=1 PARTS=hits,miss PROXIES=pier MISS_PROXIES=pier \
    REPS=1 DURATION="$TRAIN_DURATION" OUT_DIR="$PROF/out-cache" bash "$ROOT/bench/cache.sh" \
    >"$PROF/train-cache.log" 2>&1 || log "cache training failed (see $PROF/train-cache.log); going on"
fi
n="$(find "$PROF/raw" -name '*.profraw' | wc -l)"
[ "$n" -gt 0 ] || { log "no .profraw written (did Pier exit cleanly?)"; exit 1; }
"$PROFDATA" merge -o "$PROF/pier.profdata" "$PROF/raw"
log "merged $n profiles into $PROF/pier.profdata"

log "profile-guided build (target/pgo-use)"
# `-C no-vectorize-slp` for the binary's crate only, which is where fat LTO optimises the
# whole program: with the profile's inlining, LLVM 22 (rustc 1.95) had spent 28 minutes of
# that link in the SLP vectoriser (`getScalarsVectorizationLegality`, perf) when stopped,
# and an earlier try ran 45 minutes unfinished; without SLP the link takes about 11 minutes
# (BENCHMARKS.md, stop 29).
(cd "$ROOT" && RUSTFLAGS="-Cprofile-use=$PROF/pier.profdata" \
  cargo rustc -q --profile dist -p pier --bin pier --target-dir target/pgo-use -- -C no-vectorize-slp)
log "done: $ROOT/target/pgo-use/dist/pier"
