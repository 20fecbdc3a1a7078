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
#   CACHE_SIM=1 bash bench/cache_instructions.sh           # and L1d/L2 data misses per request
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
# CACHE_SIM=1: callgrind also simulates this machine's data caches per core (48 KiB L1d, 2 MiB
# L2, or L2=<bytes,ways,line>; the 300 MiB shared L3 would hold the whole zone) and reports
# their misses per request: a miss path that touches memory gone cold (an evicted object's
# frees) shows there, not in Ir.
SIM=()
[ "${CACHE_SIM:-0}" = 1 ] && SIM=(--cache-sim=yes --I1=32768,8,64 --D1=49152,12,64 --LL="${L2:-2097152,16,64}")
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
  valgrind --tool=callgrind "${SIM[@]}" --callgrind-out-file="$dir/cg.out" "$PIER_BIN" serve -c "$dir/pier.toml" >"$dir/proxy.log" 2>&1 &
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
  # Ir, and with CACHE_SIM=1 the data misses of the simulated L1 and L2: "Ir D1miss L2miss".
  python3 "$BENCH/tool.py" cg-totals "$dir"/cg.out*
}

printf "%-12s %-8s %14s %14s %12s" mode path "Ir(N1=$N1)" "Ir(N2=$N2)" "Ir/request"
[ "${CACHE_SIM:-0}" = 1 ] && printf " %14s %14s %14s" "L1d miss/req" "L2 miss/req" "L1i miss/req"
printf "\n"
for mode in $MODES; do
  read -r a a1 a2 a3 <<<"$(instructions "$mode" "$N1")"
  read -r b b1 b2 b3 <<<"$(instructions "$mode" "$N2")"
  printf "%-12s %-8s %14s %14s %12s" "$mode" "$URL_PATH" "$a" "$b" "$(( (b - a) / (N2 - N1) ))"
  if [ "${CACHE_SIM:-0}" = 1 ]; then
    printf " %14s %14s %14s" "$(( (b1 - a1) / (N2 - N1) ))" "$(( (b2 - a2) / (N2 - N1) ))" "$(( (b3 - a3) / (N2 - N1) ))"
  fi
  printf "\n"
done
