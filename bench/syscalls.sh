#!/usr/bin/env bash
# System calls per proxied request, Pier vs nginx, counted by strace: in the
# Lua access-hook scenario about two thirds of either proxy's CPU is system
# time, so the count and kind of calls matter as much as instructions.
#
# Same harness as bench/instructions.sh (one worker, h2load sends N1 then N2
# requests over C keep-alive connections); each call's count per request is
# (count(N2) - count(N1)) / (N2 - N1), so start-up and shutdown cancel out.
#
#   PROXIES="pier-lua nginx-lua" bash bench/syscalls.sh
#   C=500 N1=2000 N2=12000 PROXIES="pier nginx" bash bench/syscalls.sh
#   C=500 PROXIES="pier-redis nginx-redis" bash bench/syscalls.sh   # bench/redis_incr.sh's hook
#                                                    # (a local redis-server, lua-resty-redis)
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
BENCH="$ROOT/bench"
PIER_BIN="${PIER_BIN:-$ROOT/target/dist/pier}"
N1="${N1:-2000}"
N2="${N2:-12000}"
C="${C:-10}"
PROXIES="${PROXIES:-pier pier-noanalytics nginx}"
PATHS="${PATHS:-/hello}"
PIER_LUA_LIBS="${PIER_LUA_LIBS:-$ROOT/target/lualibs/root/usr/share/lua/5.1}"
for t in strace h2load nginx; do
  command -v "$t" >/dev/null || { echo "needs $t (apt-get install strace nghttp2-client nginx)" >&2; exit 1; }
done
[ -x "$PIER_BIN" ] || { echo "no $PIER_BIN: cargo build --profile dist -p pier" >&2; exit 1; }
RUN="$(mktemp -d /tmp/pier-sys.XXXXXX)"
PIDS=()
cleanup() { for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done; [ "${KEEP:-0}" = 1 ] && echo "kept $RUN" >&2 || rm -rf "$RUN"; }
trap cleanup EXIT
port() { python3 "$BENCH/tool.py" port; }

ORIGIN_PORT="$(port)"
mkdir -p "$RUN/origin/logs/tmp" "$RUN/origin/html"
sed -e "s/@PORT@/$ORIGIN_PORT/g" "$BENCH/peers/origin/nginx.conf" >"$RUN/origin/nginx.conf"
nginx -p "$RUN/origin/" -c nginx.conf -e "$RUN/origin/logs/error.log" >/dev/null 2>&1 &
PIDS+=($!)
python3 "$BENCH/tool.py" wait-port "$ORIGIN_PORT" 10
if [[ " $PROXIES " == *-redis\ * ]]; then
  command -v redis-server >/dev/null || { echo "needs redis-server" >&2; exit 1; }
  [ -f "$PIER_LUA_LIBS/nginx/redis.lua" ] || { echo "no lua-resty-redis in $PIER_LUA_LIBS (run bench/redis_incr.sh once, or .ci/run)" >&2; exit 1; }
  REDIS_PORT="$(port)"
  redis-server --port "$REDIS_PORT" --bind 127.0.0.1 --save '' --appendonly no --daemonize no >"$RUN/redis.log" 2>&1 &
  PIDS+=($!)
  python3 "$BENCH/tool.py" wait-port "$REDIS_PORT" 10
  sed -e "s/@REDIS@/$REDIS_PORT/g" "$BENCH/peers/redis/incr.lua" >"$RUN/incr.lua"
  chmod 755 "$RUN"; chmod 644 "$RUN/incr.lua"
fi

# calls PROXY PATH N: "name count" of every system call of one run of PROXY serving N requests for PATH
calls() {
  local proxy="$1" path="$2" n="$3" p; p="$(port)"
  local dir="$RUN/$proxy-$n${path//\//_}"; mkdir -p "$dir/logs/tmp"
  local cmd
  case "$proxy" in
    pier | pier-noanalytics)
      sed -e "s/@PORT@/$p/g" -e "s/@ORIGIN@/$ORIGIN_PORT/g" -e 's/^workers = 2/workers = 1/' \
        "$BENCH/peers/pier/pier.toml" >"$dir/pier.toml"
      [ "$proxy" = pier-noanalytics ] && printf '\n[analytics]\nenabled = false\n' >>"$dir/pier.toml"
      cmd=("$PIER_BIN" serve -c "$dir/pier.toml") ;;
    pier-lua)
      # bench/run.sh's Lua access-hook scenario: the example config, one worker.
      python3 "$BENCH/tool.py" pier-config "$ROOT/examples/lua-access.toml" "$dir/pier.toml"
      sed -i 's/^workers = 2/workers = 1/' "$dir/pier.toml"
      export PIER_LISTEN="127.0.0.1:$p" PIER_ORIGIN="127.0.0.1:$ORIGIN_PORT" PIER_ADMIN="127.0.0.1:$(port)"
      cmd=("$PIER_BIN" serve -c "$dir/pier.toml") ;;
    pier-redis | nginx-redis)
      # bench/redis_incr.sh's INCR hook, one worker.
      local t=(-e "s/@PORT@/$p/g" -e "s|@LUALIBS@|$PIER_LUA_LIBS|g" -e "s|@HOOK@|$RUN/incr.lua|g")
      chmod -R 755 "$dir"
      if [ "$proxy" = pier-redis ]; then
        sed "${t[@]}" -e 's/^workers = 2/workers = 1/' "$BENCH/peers/redis/pier.toml" >"$dir/pier.toml"
        cmd=("$PIER_BIN" serve -c "$dir/pier.toml")
      else
        sed "${t[@]}" -e 's/^worker_processes 2/worker_processes 1/' -e 's/^master_process on/master_process off/' \
          "$BENCH/peers/redis/nginx.conf" >"$dir/nginx.conf"
        cmd=(nginx -p "$dir/" -c nginx.conf -e "$dir/logs/error.log")
      fi ;;
    nginx | nginx-lua)
      local conf=nginx-proxy; [ "$proxy" = nginx-lua ] && conf=nginx-lua
      sed -e "s/@PORT@/$p/g" -e "s/@ORIGIN@/$ORIGIN_PORT/g" -e 's/^worker_processes 2;/worker_processes 1;/' \
        -e 's/^master_process on;/master_process off;/' -e 's/ reuseport;/;/' \
        "$BENCH/peers/$conf/nginx.conf" >"$dir/nginx.conf"
      cmd=(nginx -p "$dir/" -c nginx.conf -e "$dir/logs/error.log") ;;
    *) echo "unknown proxy $proxy" >&2; exit 1 ;;
  esac
  strace -f -c -U calls,name -o "$dir/strace.out" "${cmd[@]}" >"$dir/proxy.log" 2>&1 &
  local vp=$!
  python3 "$BENCH/tool.py" wait-port "$p" 120 --pid "$vp"
  h2load --h1 -n "$n" -c "$C" -t 1 "http://127.0.0.1:$p$path" >"$dir/h2load.log" 2>&1
  grep -q "succeeded, 0 failed" "$dir/h2load.log" || grep "requests:" "$dir/h2load.log" >&2
  pkill -TERM -P "$vp"; wait "$vp" || true   # the proxy (strace's child): strace then writes its summary
  # "calls name" rows of strace's summary
  awk '$1 ~ /^[0-9]+$/ && $2 != "total" { print $2, $1 }' "$dir/strace.out" | sort
}

for path in $PATHS; do
  for proxy in $PROXIES; do
    calls "$proxy" "$path" "$N1" >"$RUN/a"; calls "$proxy" "$path" "$N2" >"$RUN/b"
    echo "== $proxy $path: system calls per request (C=$C)"
    join -a1 -a2 -e 0 -o 0,1.2,2.2 "$RUN/a" "$RUN/b" |
      awk -v n=$((N2 - N1)) '{ d = ($3 - $2) / n; t += d; if (d >= 0.005) printf "  %-20s %8.3f\n", $1, d } END { printf "  %-20s %8.3f\n", "total", t }'
  done
done
