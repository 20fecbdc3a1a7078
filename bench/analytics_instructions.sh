#!/usr/bin/env bash
# Analytics' cost per request in instructions (callgrind), on vs off: a count
# that does not depend on what else the 2-core machine is doing, unlike the
# req/CPU-s of bench/run.sh (whose pier / pier-noanalytics pair measures the
# same thing in time, with a spread of ±20% per repetition here).
#
# Pier (release build, 1 worker) runs under callgrind in front of the bench's
# nginx origin; h2load sends exactly N1, then in a second run N2 requests
# over 10 keep-alive connections; instructions per request =
# (Ir(N2) - Ir(N1)) / (N2 - N1), so start-up and shutdown cancel out. Every
# thread of Pier is counted (the analytics thread included).
#
#   bash bench/analytics_instructions.sh            # N1=2000 N2=12000
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
BENCH="$ROOT/bench"
PIER_BIN="${PIER_BIN:-$ROOT/target/dist/pier}"
N1="${N1:-2000}"
N2="${N2:-12000}"
for t in valgrind callgrind_annotate h2load nginx; do
  command -v "$t" >/dev/null || { echo "needs $t (apt-get install valgrind nghttp2-client nginx)" >&2; exit 1; }
done
[ -x "$PIER_BIN" ] || { echo "no $PIER_BIN: cargo build --profile dist -p pier" >&2; exit 1; }
RUN="$(mktemp -d /tmp/pier-ainstr.XXXXXX)"
PIDS=()
# KEEP=1 keeps the callgrind files (callgrind_annotate RUN/on-N2/cg.out*).
cleanup() { for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done; [ "${KEEP:-0}" = 1 ] && echo "kept $RUN" >&2 || rm -rf "$RUN"; }
trap cleanup EXIT
port() { python3 "$BENCH/tool.py" port; }

ORIGIN_PORT="$(port)"
mkdir -p "$RUN/origin/logs/tmp" "$RUN/origin/html"
sed -e "s/@PORT@/$ORIGIN_PORT/g" "$BENCH/peers/origin/nginx.conf" >"$RUN/origin/nginx.conf"
nginx -p "$RUN/origin/" -c nginx.conf -e "$RUN/origin/logs/error.log" >/dev/null 2>&1 &
PIDS+=($!)
python3 "$BENCH/tool.py" wait-port "$ORIGIN_PORT" 10

# instructions MODE N: total Ir of one Pier run serving N requests
instructions() {
  local mode="$1" n="$2" p; p="$(port)"
  local dir="$RUN/$mode-$n"; mkdir -p "$dir"
  sed -e "s/@PORT@/$p/g" -e "s/@ORIGIN@/$ORIGIN_PORT/g" -e 's/^workers = 2/workers = 1/' \
    "$BENCH/peers/pier/pier.toml" >"$dir/pier.toml"
  if [ "$mode" = off ]; then printf '\n[analytics]\nenabled = false\n' >>"$dir/pier.toml"; fi
  valgrind --tool=callgrind --callgrind-out-file="$dir/cg.out" "$PIER_BIN" serve -c "$dir/pier.toml" \
    >"$dir/pier.log" 2>&1 &
  local vp=$!
  python3 "$BENCH/tool.py" wait-port "$p" 120 --pid "$vp"
  h2load --h1 -n "$n" -c 10 -t 1 "http://127.0.0.1:$p/hello" >"$dir/h2load.log" 2>&1
  grep -q "succeeded, 0 failed" "$dir/h2load.log" || grep "requests:" "$dir/h2load.log" >&2
  kill -TERM "$vp"; wait "$vp" || true
  # Sum over every thread's file (callgrind writes one per thread with --separate-threads; one otherwise).
  { callgrind_annotate "$dir"/cg.out* 2>/dev/null || true; } | awk '/PROGRAM TOTALS/ && !done { gsub(",", "", $1); print $1; done = 1 }'
}

printf "%-14s %14s %14s %12s\n" "analytics" "Ir(N1=$N1)" "Ir(N2=$N2)" "Ir/request"
declare -A PER
for mode in ${MODES:-off on}; do
  a="$(instructions "$mode" "$N1")"; b="$(instructions "$mode" "$N2")"
  PER[$mode]=$(( (b - a) / (N2 - N1) ))
  printf "%-14s %14s %14s %12s\n" "$mode" "$a" "$b" "${PER[$mode]}"
done
[ -n "${PER[on]:-}" ] && [ -n "${PER[off]:-}" ] && python3 -c "on, off = ${PER[on]}, ${PER[off]}; print(f'analytics on: {on - off:+d} instructions per request, {100 * (on - off) / off:+.1f}%')"
