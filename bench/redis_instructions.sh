#!/usr/bin/env bash
# The Redis INCR hook's user-space cost per request in instructions (callgrind), Pier vs
# OpenResty-style nginx: a count a busy 2-core machine cannot move, unlike the req/CPU-s
# of bench/redis_incr.sh. Same hook, configs and libraries as redis_incr.sh, one worker
# each (nginx with master_process off), one local redis-server.
#
# Each proxy runs under callgrind twice; h2load sends exactly N1, then N2 requests over C
# keep-alive connections; instructions per request = (Ir(N2) - Ir(N1)) / (N2 - N1), so
# start-up and shutdown cancel out. Every thread is counted. Kernel time is not: system
# CPU is about 60% of either proxy's time in this workload (see BENCHMARKS.md).
#
#   bash bench/redis_instructions.sh                 # N1=1000 N2=5000 C=10
#   C=500 N1=2000 N2=8000 bash bench/redis_instructions.sh
#   CACHE_SIM=1 C=500 N1=2000 N2=8000 bash bench/redis_instructions.sh
#                                                    # and simulated L1d/L2 data misses per request
#   KEEP=1 ...                                       # keep the callgrind files
#   COUNT=syscalls C=500 N1=2000 N2=8000 bash bench/redis_instructions.sh
#                                                    # system calls per request by kind instead
#       (strace -f -c). strace slows the proxy, which changes what waits on what (how often a
#       connect finds the pool empty), so this counts kinds of calls, not time.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
BENCH="$ROOT/bench"
PIER_BIN="${PIER_BIN:-$ROOT/target/dist/pier}"
PIER_LUA_LIBS="${PIER_LUA_LIBS:-$ROOT/target/lualibs/root/usr/share/lua/5.1}"
N1="${N1:-1000}"
N2="${N2:-5000}"
C="${C:-10}"
# CACHE_SIM=1: callgrind also simulates this machine's data caches per core (48 KiB L1d,
# 2 MiB L2; L2=524288,8,64 for a 512 KiB one, as `lscpu` shows on some of these machines)
# and reports their misses per request: state per connection that no longer fits shows
# there, not in Ir.
SIM=()
[ "${CACHE_SIM:-0}" = 1 ] && SIM=(--cache-sim=yes --I1=32768,8,64 --D1=49152,12,64 --LL="${L2:-2097152,16,64}")
COUNT="${COUNT:-instructions}"   # instructions (callgrind) or syscalls (strace)
case "$COUNT" in
  instructions) TOOLS="valgrind callgrind_annotate" ;;
  syscalls) TOOLS="strace" ;;
  *) echo "COUNT is instructions or syscalls" >&2; exit 1 ;;
esac
for t in $TOOLS h2load nginx redis-server redis-cli; do
  command -v "$t" >/dev/null || { echo "needs $t (apt-get install valgrind strace nghttp2-client nginx redis-server)" >&2; exit 1; }
done
[ -x "$PIER_BIN" ] || { echo "no $PIER_BIN: cargo build --profile dist -p pier" >&2; exit 1; }
[ -f "$PIER_LUA_LIBS/nginx/redis.lua" ] || { echo "no lua-resty-redis in $PIER_LUA_LIBS (run bench/redis_incr.sh once, or .ci/run)" >&2; exit 1; }
[ -e /usr/lib/nginx/modules/ngx_http_lua_module.so ] || { echo "needs libnginx-mod-http-lua" >&2; exit 1; }
RUN="$(mktemp -d /tmp/pier-rinstr.XXXXXX)"
chmod 755 "$RUN"
PIDS=()
cleanup() { for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done; [ "${KEEP:-0}" = 1 ] && echo "kept $RUN" >&2 || rm -rf "$RUN"; }
trap cleanup EXIT
port() { python3 "$BENCH/tool.py" port; }

REDIS_PORT="$(port)"
redis-server --port "$REDIS_PORT" --bind 127.0.0.1 --save '' --appendonly no --daemonize no >"$RUN/redis.log" 2>&1 &
PIDS+=($!)
python3 "$BENCH/tool.py" wait-port "$REDIS_PORT" 10
sed -e "s/@REDIS@/$REDIS_PORT/g" "$BENCH/peers/redis/incr.lua" >"$RUN/incr.lua"
chmod 644 "$RUN/incr.lua"

# counted PROXY N: one run serving N requests; prints its callgrind totals (COUNT=instructions)
# or the path of its strace summary (COUNT=syscalls)
counted() {
  local proxy="$1" n="$2" p; p="$(port)"
  local dir="$RUN/$proxy-$n"; mkdir -p "$dir/logs/tmp"; chmod -R 755 "$dir"
  local t=(-e "s/@PORT@/$p/g" -e "s|@LUALIBS@|$PIER_LUA_LIBS|g" -e "s|@HOOK@|$RUN/incr.lua|g")
  local cmd
  if [ "$proxy" = pier ]; then
    sed "${t[@]}" -e 's/^workers = 2/workers = 1/' "$BENCH/peers/redis/pier.toml" >"$dir/pier.toml"
    cmd=("$PIER_BIN" serve -c "$dir/pier.toml")
  else
    sed "${t[@]}" -e 's/^worker_processes 2/worker_processes 1/' -e 's/^master_process on/master_process off/' \
      "$BENCH/peers/redis/nginx.conf" >"$dir/nginx.conf"
    cmd=(nginx -p "$dir/" -c nginx.conf -e "$dir/logs/error.log")
  fi
  if [ "$COUNT" = syscalls ]; then
    strace -f -c -U calls,name -o "$dir/strace.out" "${cmd[@]}" >"$dir/proxy.log" 2>&1 &
  else
    valgrind --tool=callgrind "${SIM[@]}" --callgrind-out-file="$dir/cg.out" "${cmd[@]}" >"$dir/proxy.log" 2>&1 &
  fi
  local vp=$!
  python3 "$BENCH/tool.py" wait-port "$p" 120 --pid "$vp"
  redis-cli -p "$REDIS_PORT" SET hits 0 >/dev/null
  h2load --h1 -n "$n" -c "$C" -t 1 "http://127.0.0.1:$p/" >"$dir/h2load.log" 2>&1
  grep -q "succeeded, 0 failed" "$dir/h2load.log" || grep "requests:" "$dir/h2load.log" >&2
  local hits; hits="$(redis-cli -p "$REDIS_PORT" GET hits)"
  [ "$hits" = "$n" ] || echo "$proxy: redis counted $hits INCRs for $n requests" >&2
  if [ "$COUNT" = syscalls ]; then
    # The proxy is strace's child; strace writes its summary when it exits.
    pkill -TERM -P "$vp"; wait "$vp" || true
    echo "$dir/strace.out"
    return
  fi
  kill -TERM "$vp"; wait "$vp" || true
  # "Ir D1miss L2miss L1imiss" (the misses are 0 without CACHE_SIM=1).
  python3 "$BENCH/tool.py" cg-totals "$dir"/cg.out*
}

if [ "$COUNT" = syscalls ]; then
  for proxy in ${PROXIES:-pier nginx}; do
    a="$(counted "$proxy" "$N1")"; b="$(counted "$proxy" "$N2")"
    echo "== $proxy: system calls per request (C=$C)"
    python3 "$BENCH/tool.py" syscalls "$a" "$b" $((N2 - N1))
  done
  exit 0
fi

printf "%-8s %14s %14s %12s" "proxy" "Ir(N1=$N1)" "Ir(N2=$N2)" "Ir/request"
[ "${CACHE_SIM:-0}" = 1 ] && printf " %13s %12s %13s" "L1d miss/req" "L2 miss/req" "L1i miss/req"
printf "   (C=%s connections)\n" "$C"
declare -A PER
for proxy in ${PROXIES:-pier nginx}; do
  read -r a a1 a2 a3 <<<"$(counted "$proxy" "$N1")"
  read -r b b1 b2 b3 <<<"$(counted "$proxy" "$N2")"
  PER[$proxy]=$(( (b - a) / (N2 - N1) ))
  printf "%-8s %14s %14s %12s" "$proxy" "$a" "$b" "${PER[$proxy]}"
  if [ "${CACHE_SIM:-0}" = 1 ]; then
    printf " %13s %12s %13s" "$(( (b1 - a1) / (N2 - N1) ))" "$(( (b2 - a2) / (N2 - N1) ))" "$(( (b3 - a3) / (N2 - N1) ))"
  fi
  printf "\n"
done
[ -n "${PER[pier]:-}" ] && [ -n "${PER[nginx]:-}" ] && python3 -c "p, n = ${PER[pier]}, ${PER[nginx]}; print(f'Pier / nginx: {p / n:.2f}x the instructions per request')"
