#!/usr/bin/env bash
# The cache's miss path in user-space instructions per request (issue 11: ≤ 10% more CPU per
# request than plain proxying), counted by callgrind so that the busy 2-core machine cannot
# move the figure (bench/cache.sh's per-CPU-second reading of the same thing moves ±20%).
#
# Pier runs with one worker under callgrind in front of bench/cache.sh's nginx origin (every
# response `Cache-Control: max-age=3600`, so every miss is stored), in two configurations:
#   pier-cache  the route with [route.cache] (a small memory zone, MEMORY, so that it is full
#               and evicting in both runs: the steady state of a miss-heavy cache)
#   pier-plain  the same file without [route.cache]
# Every request is a distinct URL: C h2load processes, one connection each, each with its own
# URI list (-i) of PATH?m=<process>-<n>, so no request is a hit or waits on another's fill.
# Instructions per request = (Ir(N2) - Ir(N1)) / (N2 - N1): start-up and shutdown cancel out.
#
#   bash bench/cache_instructions.sh                       # N1=2000 N2=8000 C=10 PATH=/4k.bin
#   KEEP=1 MODES=pier-cache bash bench/cache_instructions.sh
#       then: callgrind_annotate --tree=caller --inclusive=yes RUN/pier-cache-8000/cg.out*
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
BENCH="$ROOT/bench"
PIER_BIN="${PIER_BIN:-$ROOT/target/dist/pier}"
N1="${N1:-2000}"
N2="${N2:-8000}"
C="${C:-10}"
MODES="${MODES:-pier-plain pier-cache}"
URL_PATH="${URL_PATH:-/4k.bin}"
MEMORY="${MEMORY:-4m}"
for t in valgrind callgrind_annotate h2load nginx python3; do
  command -v "$t" >/dev/null || { echo "needs $t (apt-get install valgrind nghttp2-client nginx)" >&2; exit 1; }
done
[ -x "$PIER_BIN" ] || { echo "no $PIER_BIN: cargo build --profile dist -p pier" >&2; exit 1; }
[ $((N1 % C)) = 0 ] && [ $((N2 % C)) = 0 ] || { echo "N1 and N2 must be multiples of C" >&2; exit 1; }
RUN="$(mktemp -d /tmp/pier-cache-instr.XXXXXX)"
PIDS=()
cleanup() { for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done; [ "${KEEP:-0}" = 1 ] && echo "kept $RUN" >&2 || rm -rf "$RUN"; }
trap cleanup EXIT
port() { python3 "$BENCH/tool.py" port; }

ORIGIN_PORT="$(port)"
mkdir -p "$RUN/origin/logs/tmp" "$RUN/origin/html"
sed -e "s/@PORT@/$ORIGIN_PORT/g" "$BENCH/peers/cache/origin.conf" >"$RUN/origin/nginx.conf"
head -c 4096 /dev/urandom >"$RUN/origin/html/4k.bin"
chmod -R 755 "$RUN"   # nginx workers run as nobody
nginx -p "$RUN/origin/" -c nginx.conf -e "$RUN/origin/logs/error.log" >/dev/null 2>&1 &
PIDS+=($!)
python3 "$BENCH/tool.py" wait-port "$ORIGIN_PORT" 10

# instructions MODE N: total Ir of one run of Pier in MODE serving N distinct-URL requests
instructions() {
  local mode="$1" n="$2" p; p="$(port)"
  local dir="$RUN/$mode-$n"; mkdir -p "$dir"
  sed -e "s/@PORT@/$p/g" -e "s/@ORIGIN@/$ORIGIN_PORT/g" -e 's/^workers = 2/workers = 1/' \
    -e "s/^memory = .*/memory = \"$MEMORY\"/" "$BENCH/peers/cache/pier.toml" >"$dir/pier.toml"
  [ "$mode" = pier-plain ] && sed -i -e '/^\[route.cache\]/d' -e '/^zone = "main"/d' "$dir/pier.toml"
  local per=$((n / C)) i
  for i in $(seq 1 "$C"); do
    seq 1 "$per" | sed "s|^|http://127.0.0.1:$p$URL_PATH?m=$i-|" >"$dir/uris.$i"
  done
  valgrind --tool=callgrind --callgrind-out-file="$dir/cg.out" "$PIER_BIN" serve -c "$dir/pier.toml" >"$dir/proxy.log" 2>&1 &
  local vp=$!
  python3 "$BENCH/tool.py" wait-port "$p" 120 --pid "$vp"
  local hp=()
  for i in $(seq 1 "$C"); do
    h2load --h1 -n "$per" -c 1 -t 1 -i "$dir/uris.$i" >"$dir/h2load.$i.log" 2>&1 &
    hp+=($!)
  done
  for i in "${hp[@]}"; do wait "$i"; done
  for i in $(seq 1 "$C"); do
    grep -q "succeeded, 0 failed" "$dir/h2load.$i.log" || grep "requests:" "$dir/h2load.$i.log" >&2
  done
  kill -TERM "$vp"; wait "$vp" || true
  { callgrind_annotate "$dir"/cg.out* 2>/dev/null || true; } | awk '/PROGRAM TOTALS/ && !done { gsub(",", "", $1); print $1; done = 1 }'
}

printf "%-12s %-8s %14s %14s %12s\n" mode path "Ir(N1=$N1)" "Ir(N2=$N2)" "Ir/request"
for mode in $MODES; do
  a="$(instructions "$mode" "$N1")"; b="$(instructions "$mode" "$N2")"
  printf "%-12s %-8s %14s %14s %12s\n" "$mode" "$URL_PATH" "$a" "$b" "$(( (b - a) / (N2 - N1) ))"
done
