#!/usr/bin/env bash
# User-space instructions per proxied request, Pier vs nginx, counted by
# callgrind: a figure that does not move with what else the 2-core machine is
# doing, unlike the user µs/request of bench/run.sh (±20% per repetition here).
# Issue 8 targets Pier's user CPU per request ≤ nginx's at 50 connections; this
# shows where Pier stands and, with KEEP=1, where its instructions go
# (callgrind_annotate RUN/pier-N2/cg.out*).
#
# Each proxy runs with one worker under callgrind in front of the bench's nginx
# origin; h2load sends exactly N1, then in a second run N2 requests over C
# keep-alive connections; instructions per request =
# (Ir(N2) - Ir(N1)) / (N2 - N1), so start-up and shutdown cancel out. Every
# thread (Pier) or process (nginx: master_process off, the worker is the
# process) is counted.
#
#   bash bench/instructions.sh                 # pier, pier-noanalytics, nginx; N1=2000 N2=12000 C=10
#   PROXIES=pier PATHS=/4k.bin bash bench/instructions.sh
#   PROXIES="pier-lua nginx-lua" bash bench/instructions.sh   # bench/run.sh's Lua access hook
#   PROXIES=pier-cache PATHS="/hello /4k.bin" bash bench/instructions.sh   # cache hits (bench/cache.sh's config)
#   PROXIES="pier pier-trace1 pier-trace100" bash bench/instructions.sh   # tracing off / 1% / 100%
#   PROXIES=pier-h2c bash bench/instructions.sh   # HTTP/2 (cleartext, 10 streams a connection) to the HTTP/1.1 origin
#   PROXIES="pier-limit-local pier-limit-global" bash bench/instructions.sh   # a [[limit]] per client, local or global (Redis)
#   PROXIES=pier-grpc bash bench/instructions.sh   # gRPC unary through Pier (bench/h2.sh's grpc mode: h2c both
#       legs, grpc-go's interop server; ghz with C connections and 10 calls in flight each)
#   COUNT=syscalls PROXIES="pier-lua nginx-lua" bash bench/instructions.sh
#       system calls per request by kind instead (strace -f -c, same harness). strace slows
#       the proxy, so this counts kinds of calls, not time.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
BENCH="$ROOT/bench"
PIER_BIN="${PIER_BIN:-$ROOT/target/dist/pier}"
N1="${N1:-2000}"
N2="${N2:-12000}"
C="${C:-10}"
PROXIES="${PROXIES:-pier pier-noanalytics nginx}"
PATHS="${PATHS:-/hello}"
COUNT="${COUNT:-instructions}"   # instructions (callgrind) or syscalls (strace)
case "$COUNT" in
  instructions) TOOLS="valgrind callgrind_annotate" ;;
  syscalls) TOOLS="strace" ;;
  *) echo "COUNT is instructions or syscalls" >&2; exit 1 ;;
esac
for t in $TOOLS h2load nginx; do
  command -v "$t" >/dev/null || { echo "needs $t (apt-get install valgrind strace nghttp2-client nginx)" >&2; exit 1; }
done
[ -x "$PIER_BIN" ] || { echo "no $PIER_BIN: cargo build --profile dist -p pier" >&2; exit 1; }
RUN="$(mktemp -d /tmp/pier-instr.XXXXXX)"
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
# pier-cache: a second origin, bench/cache.sh's (every response cacheable for an hour).
if [[ " $PROXIES " == *" pier-cache "* ]]; then
  CACHE_ORIGIN_PORT="$(port)"
  mkdir -p "$RUN/cache-origin/logs/tmp" "$RUN/cache-origin/html"
  head -c 4096 /dev/urandom >"$RUN/cache-origin/html/4k.bin"
  chmod 755 "$RUN"; chmod -R 755 "$RUN/cache-origin"   # nginx workers run as nobody
  sed -e "s/@PORT@/$CACHE_ORIGIN_PORT/g" "$BENCH/peers/cache/origin.conf" >"$RUN/cache-origin/nginx.conf"
  nginx -p "$RUN/cache-origin/" -c nginx.conf -e "$RUN/cache-origin/logs/error.log" >/dev/null 2>&1 &
  PIDS+=($!)
  python3 "$BENCH/tool.py" wait-port "$CACHE_ORIGIN_PORT" 10
fi

# pier-grpc: grpc-go's interop server as the origin, ghz as the client (bench/h2.sh's).
if [[ " $PROXIES " == *" pier-grpc "* ]]; then
  GHZ="${GHZ:-$(command -v ghz || echo /root/go/bin/ghz)}"
  GRPC_SERVER="${GRPC_SERVER:-$(command -v server || echo /root/go/bin/server)}"
  [ -x "$GHZ" ] && [ -x "$GRPC_SERVER" ] || { echo "pier-grpc needs ghz and grpc-go's interop server (.ci/install, bench/h2.sh)" >&2; exit 1; }
  GRPC_PORT="$(port)"
  "$GRPC_SERVER" --port="$GRPC_PORT" >"$RUN/grpc-server.log" 2>&1 &
  PIDS+=($!)
  python3 "$BENCH/tool.py" wait-port "$GRPC_PORT" 10
fi

# pier-limit-global: the fleet's Redis (a redis-server of its own).
if [[ " $PROXIES " == *" pier-limit-global "* ]]; then
  command -v redis-server >/dev/null || { echo "needs redis-server (apt-get install redis-server)" >&2; exit 1; }
  REDIS_PORT="$(port)"
  redis-server --port "$REDIS_PORT" --bind 127.0.0.1 --save "" --appendonly no >"$RUN/redis.log" 2>&1 &
  PIDS+=($!)
  python3 "$BENCH/tool.py" wait-port "$REDIS_PORT" 10
fi

# counted PROXY PATH N: one run of PROXY serving N requests for PATH; prints its total Ir
# (COUNT=instructions) or the path of its strace summary (COUNT=syscalls)
counted() {
  local proxy="$1" path="$2" n="$3" p; p="$(port)"
  local dir="$RUN/$proxy-$n${path//\//_}"; mkdir -p "$dir/logs/tmp"
  local cmd
  case "$proxy" in
    pier | pier-noanalytics)
      sed -e "s/@PORT@/$p/g" -e "s/@ORIGIN@/$ORIGIN_PORT/g" -e 's/^workers = 2/workers = 1/' \
        "$BENCH/peers/pier/pier.toml" >"$dir/pier.toml"
      [ "$proxy" = pier-noanalytics ] && printf '\n[analytics]\nenabled = false\n' >>"$dir/pier.toml"
      cmd=("$PIER_BIN" serve -c "$dir/pier.toml") ;;
    pier-trace1 | pier-trace100)
      # bench/tracing.sh's question without its noise: [tracing] on, 1% or every root
      # sampled. The collector is an address nothing listens on (each batch fails at
      # connect and is counted as failed): the request path's cost, ids, context,
      # traceparent upstream, spans built and their encoding, not a collector's.
      sed -e "s/@PORT@/$p/g" -e "s/@ORIGIN@/$ORIGIN_PORT/g" -e 's/^workers = 2/workers = 1/' \
        "$BENCH/peers/pier/pier.toml" >"$dir/pier.toml"
      local ratio=0.01; [ "$proxy" = pier-trace100 ] && ratio=1.0
      printf '\n[tracing]\nendpoint = "http://127.0.0.1:9/v1/traces"\nsample = %s\n' "$ratio" >>"$dir/pier.toml"
      cmd=("$PIER_BIN" serve -c "$dir/pier.toml") ;;
    pier-limit-local | pier-limit-global)
      # A rate limit per client address, high enough never to refuse (the cost of counting,
      # not of refusing): local (the count-min sketch), or global (the sketch, then the
      # fleet's count from the last exchange with Redis; the exchange thread's own work,
      # every 50 ms, is counted too).
      sed -e "s/@PORT@/$p/g" -e "s/@ORIGIN@/$ORIGIN_PORT/g" -e 's/^workers = 2/workers = 1/' \
        "$BENCH/peers/pier/pier.toml" >"$dir/pier.toml"
      local scope=local
      if [ "$proxy" = pier-limit-global ]; then
        scope=global
        printf '\n[redis]\nurl = "redis://127.0.0.1:%s"\n' "$REDIS_PORT" >>"$dir/pier.toml"
      fi
      printf '\n[[limit]]\nname = "per-client"\nkey = "client_ip"\nrate = "10000000/s"\nscope = "%s"\n' "$scope" >>"$dir/pier.toml"
      cmd=("$PIER_BIN" serve -c "$dir/pier.toml") ;;
    pier-h2c)
      # The plain config with cleartext HTTP/2 (prior knowledge) on the listener: what a
      # request costs the engine over HTTP/2 without TLS (h2load, C connections, 10
      # streams each).
      sed -e "s/@PORT@/$p/g" -e "s/@ORIGIN@/$ORIGIN_PORT/g" -e 's/^workers = 2/workers = 1/' \
        -e 's/^listen = "127.0.0.1:\([0-9]*\)"$/listen = "127.0.0.1:\1"\nh2c = true/' \
        "$BENCH/peers/pier/pier.toml" >"$dir/pier.toml"
      cmd=("$PIER_BIN" serve -c "$dir/pier.toml") ;;
    pier-grpc)
      sed -e "s/@PORT@/$p/g" -e "s/@ORIGIN@/$GRPC_PORT/g" -e 's/^workers = 2/workers = 1/' \
        "$BENCH/peers/h2/pier-grpc.toml" >"$dir/pier.toml"
      cmd=("$PIER_BIN" serve -c "$dir/pier.toml") ;;
    pier-cache)
      # bench/cache.sh's Pier (1 GiB zone) in front of its origin: every request but the
      # first is a cache hit.
      sed -e "s/@PORT@/$p/g" -e "s/@ORIGIN@/$CACHE_ORIGIN_PORT/g" -e 's/^workers = 2/workers = 1/' \
        "$BENCH/peers/cache/pier.toml" >"$dir/pier.toml"
      cmd=("$PIER_BIN" serve -c "$dir/pier.toml") ;;
    pier-lua)
      # bench/run.sh's Lua access-hook scenario: the example config, one worker.
      python3 "$BENCH/tool.py" pier-config "$ROOT/examples/lua-access.toml" "$dir/pier.toml"
      sed -i 's/^workers = 2/workers = 1/' "$dir/pier.toml"
      export PIER_LISTEN="127.0.0.1:$p" PIER_ORIGIN="127.0.0.1:$ORIGIN_PORT" PIER_ADMIN="127.0.0.1:$(port)"
      cmd=("$PIER_BIN" serve -c "$dir/pier.toml") ;;
    nginx | nginx-lua)
      local conf=nginx-proxy; [ "$proxy" = nginx-lua ] && conf=nginx-lua
      sed -e "s/@PORT@/$p/g" -e "s/@ORIGIN@/$ORIGIN_PORT/g" -e 's/^worker_processes 2;/worker_processes 1;/' \
        -e 's/^master_process on;/master_process off;/' -e 's/ reuseport;/;/' \
        "$BENCH/peers/$conf/nginx.conf" >"$dir/nginx.conf"
      cmd=(nginx -p "$dir/" -c nginx.conf -e "$dir/logs/error.log") ;;
    *) echo "unknown proxy $proxy" >&2; exit 1 ;;
  esac
  if [ "$COUNT" = syscalls ]; then
    strace -f -c -U calls,name -o "$dir/strace.out" "${cmd[@]}" >"$dir/proxy.log" 2>&1 &
  else
    valgrind --tool=callgrind --callgrind-out-file="$dir/cg.out" "${cmd[@]}" >"$dir/proxy.log" 2>&1 &
  fi
  local vp=$!
  python3 "$BENCH/tool.py" wait-port "$p" 120 --pid "$vp"
  if [ "$proxy" = pier-grpc ]; then
    "$GHZ" --insecure --proto "$BENCH/peers/h2/grpc_testing.proto" --import-paths "$BENCH/peers/h2" \
      --call grpc.testing.TestService/UnaryCall \
      -d '{"response_size": 16, "payload": {"body": "cGllci1iZW5jaC1wYXlsb2Fk"}}' \
      --connections="$C" -c $((C * 10)) -n "$n" --timeout=30s "127.0.0.1:$p" >"$dir/h2load.log" 2>&1
    grep -q "\[OK\] *$n responses" "$dir/h2load.log" || grep -A3 "Status code distribution" "$dir/h2load.log" >&2 || true
  else
    if [ "$proxy" = pier-h2c ]; then
      h2load -n "$n" -c "$C" -m 10 -t 1 "http://127.0.0.1:$p$path" >"$dir/h2load.log" 2>&1
    else
      h2load --h1 -n "$n" -c "$C" -t 1 "http://127.0.0.1:$p$path" >"$dir/h2load.log" 2>&1
    fi
    grep -q "succeeded, 0 failed" "$dir/h2load.log" || grep "requests:" "$dir/h2load.log" >&2
  fi
  if [ "$COUNT" = syscalls ]; then
    # The proxy is strace's child; strace writes its summary when it exits.
    pkill -TERM -P "$vp"; wait "$vp" || true
    echo "$dir/strace.out"
  else
    kill -TERM "$vp"; wait "$vp" || true
    { callgrind_annotate "$dir"/cg.out* 2>/dev/null || true; } | awk '/PROGRAM TOTALS/ && !done { gsub(",", "", $1); print $1; done = 1 }'
  fi
}

[ "$COUNT" = instructions ] && printf "%-18s %-8s %14s %14s %12s\n" proxy path "Ir(N1=$N1)" "Ir(N2=$N2)" "Ir/request"
for path in $PATHS; do
  for proxy in $PROXIES; do
    a="$(counted "$proxy" "$path" "$N1")"; b="$(counted "$proxy" "$path" "$N2")"
    if [ "$COUNT" = syscalls ]; then
      echo "== $proxy $path: system calls per request (C=$C)"
      python3 "$BENCH/tool.py" syscalls "$a" "$b" $((N2 - N1))
    else
      printf "%-18s %-8s %14s %14s %12s\n" "$proxy" "$path" "$a" "$b" "$(( (b - a) / (N2 - N1) ))"
    fi
  done
done
