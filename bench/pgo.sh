#!/usr/bin/env bash
# A profile-guided build of Pier for benchmarks (issue 8: user CPU per request). Pier runs
# fewer instructions per request than nginx yet spent more user time at 50 connections: its
# code is laid out for no particular path. PGO lays the hot path out straight (branch
# weights, inlining and block order from a real run).
#
#   bash bench/pgo.sh --save     # a new committed profile: pgo/pier.profdata.xz and pgo/PROFILE,
#                                # then `bash pgo/check.sh` (the dist build, guided by it)
#   bash bench/pgo.sh            # the profile stays in target/pgo-data; a build with it in
#                                # target/pgo-use/dist/pier (PIER_BIN=... bash bench/run.sh)
#
# The optimised builds (`--release`, `--profile dist`, the Debian package) apply the committed
# profile through pgo/rustc-wrapper (docs/pgo.md); `--save` is how it is remade when the
# code has moved on (pgo/check.sh says when) or rustc changes.
#
# Steps: an instrumented `dist` build (target/pgo-gen), a training run of that binary through
# bench/run.sh's own workloads (plain proxy and the Lua access hook, /hello and /4k.bin, 50 and
# 500 connections; a short bench/redis_incr.sh run for the cosocket path unless NO_REDIS=1;
# bench/cache.sh's hits and stored misses unless NO_CACHE=1; HTTPS keep-alive and handshakes
# unless NO_TLS=1; bench/h2.sh's HTTP/2 over TLS and gRPC unless NO_H2=1),
# `llvm-profdata merge`, then a `dist` build that uses the profile (target/pgo-use).
# Needs rustup's `llvm-tools` component (its llvm-profdata matches rustc's LLVM).
# The normal builds are untouched: separate target directories, RUSTFLAGS only here.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
PROF="${PROF:-$ROOT/target/pgo-data}"
SAVE=0
[ "${1:-}" = --save ] && SAVE=1
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
if [ "${NO_TLS:-0}" != 1 ]; then
  # HTTPS: keep-alive requests, full handshakes and resumed ones (rustls, the accept path).
  log "training: bench/run.sh TLS=1 (keep-alive, full and resumed handshakes)"
  PIER_BIN="$ROOT/target/pgo-gen/dist/pier" SKIP_BUILD=1 TLS=1 PROXIES_TLS=pier REPS=1 \
    DURATION="$TRAIN_DURATION" IDLE_CONNS=0 RESUME_N=20000 OUT_DIR="$PROF/out-tls" bash "$ROOT/bench/run.sh" \
    >"$PROF/train-tls.log" 2>&1 || log "TLS training failed (see $PROF/train-tls.log); going on"
fi
if [ "${NO_H2:-0}" != 1 ]; then
  # HTTP/2 over TLS and gRPC (h2 on both legs): without them the h2 crate is laid out cold.
  modes=h2; { command -v ghz >/dev/null || [ -x /root/go/bin/ghz ]; } && modes=h2,grpc
  log "training: bench/h2.sh MODES=$modes"
  PIER_BIN="$ROOT/target/pgo-gen/dist/pier" SKIP_BUILD=1 PROXIES=pier MODES="$modes" REPS=1 \
    DURATION="$TRAIN_DURATION" OUT_DIR="$PROF/out-h2" bash "$ROOT/bench/h2.sh" \
    >"$PROF/train-h2.log" 2>&1 || log "HTTP/2 training failed (see $PROF/train-h2.log); going on"
fi
n="$(find "$PROF/raw" -name '*.profraw' | wc -l)"
[ "$n" -gt 0 ] || { log "no .profraw written (did Pier exit cleanly?)"; exit 1; }
"$PROFDATA" merge -o "$PROF/pier.profdata" "$PROF/raw"
log "merged $n profiles into $PROF/pier.profdata"

if [ "$SAVE" = 1 ]; then
  # The committed profile, with what pgo/rustc-wrapper and pgo/check.sh read: the compiler
  # that made it (another one's function hashes differ) and its total count.
  # Committed xz-compressed (23 MB → 3 MB); pgo/rustc-wrapper unpacks it.
  xz -9 -T2 -c "$PROF/pier.profdata" >"$ROOT/pgo/pier.profdata.xz"
  summary="$("$PROFDATA" show "$PROF/pier.profdata")"
  commit="$(cd "$ROOT" && git rev-parse --short HEAD)$(cd "$ROOT" && git diff --quiet HEAD -- . ':!pgo' || echo '+changes')"
  {
    echo "# The profile pgo/rustc-wrapper applies to the optimised builds (docs/pgo.md)."
    echo "# Made by bench/pgo.sh --save; do not edit by hand."
    echo "rustc: $(rustc -vV | sed -n 1p)"
    echo "llvm: $(rustc -vV | sed -n 's/^LLVM version: //p')"
    echo "commit: $commit"
    echo "made: $(date -u +%Y-%m-%d)"
    echo "functions: $(sed -n 's/^Total functions: //p' <<<"$summary")"
    echo "total_count: $(sed -n 's/^Total count: //p' <<<"$summary")"
    echo "training: bench/run.sh (plain, Lua access; /hello, /4k.bin; 50, 500 conns)$([ "${NO_REDIS:-0}" = 1 ] || echo ', redis_incr.sh')$([ "${NO_CACHE:-0}" = 1 ] || echo ', cache.sh hits and misses')$([ "${NO_TLS:-0}" = 1 ] || echo ', run.sh TLS=1')$([ "${NO_H2:-0}" = 1 ] || echo ', h2.sh')"
  } >"$ROOT/pgo/PROFILE"
  log "saved pgo/pier.profdata.xz and pgo/PROFILE; checking them with the dist build"
  # Dependencies built with the old profile keep it (cargo does not see the profile
  # change), and the fat-LTO link of modules with two profiles' summaries fails
  # ("failed to load bitcode of module ..."): the check builds from clean.
  rm -rf "$ROOT/target/dist"
  bash "$ROOT/pgo/check.sh"
  log "done: $ROOT/target/dist/pier (profile-guided); commit pgo/"
  exit 0
fi

log "profile-guided build (target/pgo-use)"
# `-C no-vectorize-slp` for the binary's crate only, which is where fat LTO optimises the
# whole program: with the profile's inlining, LLVM 22 (rustc 1.95) had spent 28 minutes of
# that link in the SLP vectoriser (`getScalarsVectorizationLegality`, perf) when stopped,
# and an earlier try ran 45 minutes unfinished; without SLP the link takes about 11 minutes
# (BENCHMARKS.md, stop 29).
(cd "$ROOT" && RUSTFLAGS="-Cprofile-use=$PROF/pier.profdata" \
  cargo rustc -q --profile dist -p pier --bin pier --target-dir target/pgo-use -- -C no-vectorize-slp)
log "done: $ROOT/target/pgo-use/dist/pier"
