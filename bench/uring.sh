#!/usr/bin/env bash
# Issue 34 item 5: does io_uring cut a proxy's CPU per request? One run measures
# bench/uring/'s uring-proxy (a minimal HTTP/1.1 keep-alive reverse proxy) in its
# epoll mode (a tokio current_thread runtime, Pier's engine model) and in its io_uring
# mode (multishot accept, multishot recv into a provided-buffer ring, batched
# submission), with nginx as a proxy (and Pier, when its binary exists) next to them,
# all in front of the same nginx origin, one proxy at a time, interleaved.
#
# Every proxy runs ONE worker (a 2-core machine: the other core is for wrk and the
# origin). The figure is requests per proxy CPU-second, and the proxy's user and system
# CPU per request (from /proc/PID/stat before and after each wrk run; bench/tool.py
# measure, as bench/run.sh).
#
#   bash bench/uring.sh                                   # REPS=3 DURATION=8, 50 and 500 conns, /hello
#   PROXIES=epoll,uring REPS=5 bash bench/uring.sh
#   PIER_BIN=target/dist/pier bash bench/uring.sh
#
# uring-plain is the io_uring mode on a ring without SINGLE_ISSUER | DEFER_TASKRUN |
# COOP_TASKRUN (tokio-uring's and monoio's kind of ring). With SYSCALLS=1 (default, needs
# perf) every proxy then serves one more wrk run per connection count, untimed, while
# `perf stat` counts its system calls by kind (tracepoints): the calls a request costs.
set -euo pipefail

BENCH="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$BENCH/.." && pwd)"

PROXIES="${PROXIES:-epoll,uring,uring-plain,nginx,pier}"   # uring-proxy's modes (epoll, uring, uring-plain), nginx, pier, pier-epoll (PIER_IO_URING=0)
REPS="${REPS:-3}"
DURATION="${DURATION:-8}"
CONNS="${CONNS:-50,500}"
PATHS="${PATHS:-/hello}"
THREADS="${THREADS:-2}"        # wrk threads
WORKERS="${WORKERS:-1}"        # worker threads / processes of every proxy
PIER_BIN="${PIER_BIN:-/work/bench-target/dist/pier}"
URING_TARGET="${CARGO_TARGET_DIR:-$ROOT/target/uring}"
OUT_DIR="${OUT_DIR:-$BENCH/out}"
SKIP_BUILD="${SKIP_BUILD:-0}"
SYSCALLS="${SYSCALLS:-1}"      # 1 = afterwards, system calls per request (perf stat, one more wrk run each)

log() { printf '[uring %s] %s\n' "$(date -u +%H:%M:%S)" "$*" >&2; }
die() { log "ERROR: $*"; exit 1; }

for t in nginx wrk python3 cargo; do
    command -v "$t" >/dev/null || die "needs $t (apt-get install nginx wrk python3; rustup)"
done
[[ "$REPS" =~ ^[0-9]+$ && "$REPS" -ge 1 && "$REPS" -le 20 ]] || die "REPS is 1..20"
[[ "$DURATION" =~ ^[0-9]+$ && "$DURATION" -ge 1 && "$DURATION" -le 120 ]] || die "DURATION is 1..120 s"
[ "$(cat /proc/sys/kernel/io_uring_disabled 2>/dev/null || echo 0)" = 0 ] ||
    log "WARNING: /proc/sys/kernel/io_uring_disabled is not 0; the uring mode will fail to start"

mkdir -p "$OUT_DIR"
RUN="$OUT_DIR/uring-$(date -u +%Y%m%dT%H%M%SZ)"
mkdir -p "$RUN"; chmod 755 "$OUT_DIR" "$RUN"
RESULTS="$RUN/results.jsonl"
: >"$RESULTS"
log "run directory: $RUN"

# ---- build --------------------------------------------------------------------------------
URING_BIN="$URING_TARGET/release/uring-proxy"
if [ "$SKIP_BUILD" != 1 ]; then
    log "building: cargo build --release --features uring --manifest-path bench/uring/Cargo.toml (target $URING_TARGET)"
    if ! CARGO_TARGET_DIR="$URING_TARGET" nice -n 10 cargo build --release --features uring \
        --manifest-path "$BENCH/uring/Cargo.toml" >"$RUN/cargo-build.log" 2>&1; then
        tail -n 20 "$RUN/cargo-build.log" >&2
        die "uring-proxy does not build (log: $RUN/cargo-build.log)"
    fi
fi
[ -x "$URING_BIN" ] || die "no $URING_BIN"

has() { [[ ",$PROXIES," == *",$1,"* ]]; }
if has pier && [ ! -x "$PIER_BIN" ]; then
    log "no Pier binary at $PIER_BIN: pier skipped"
    PROXIES="$(echo ",$PROXIES," | sed 's/,pier,/,/; s/^,//; s/,$//')"
fi
IFS=, read -ra PROXY_LIST <<<"$PROXIES"
IFS=, read -ra CONN_LIST <<<"$CONNS"
IFS=, read -ra PATH_LIST <<<"$PATHS"

# ---- processes ----------------------------------------------------------------------------
PIDS=()
PROXY_PID=""
source "$BENCH/procs.sh"   # kill_tree, cleanup (at exit), untrack
ulimit -n 20000 2>/dev/null || ulimit -n "$(ulimit -Hn)"

# Origin: bench/run.sh's nginx (2 workers), shared by every proxy run.
ORIGIN_PORT="$(python3 "$BENCH/tool.py" port)"
mkdir -p "$RUN/origin/logs/tmp" "$RUN/origin/html"
printf 'hello world\n' >"$RUN/origin/html/hello.txt"
head -c 4096 /dev/urandom >"$RUN/origin/html/4k.bin"
chmod -R 755 "$RUN/origin"
sed -e "s/@PORT@/$ORIGIN_PORT/g" "$BENCH/peers/origin/nginx.conf" >"$RUN/origin/nginx.conf"
nginx -p "$RUN/origin/" -c nginx.conf -e "$RUN/origin/logs/error.log" >"$RUN/origin/stdout.log" 2>&1 &
ORIGIN_PID=$!
PIDS+=("$ORIGIN_PID")
python3 "$BENCH/tool.py" wait-port "$ORIGIN_PORT" 10 || die "origin did not start"
log "origin: nginx pid $ORIGIN_PID on 127.0.0.1:$ORIGIN_PORT"

start_proxy() {   # start_proxy NAME: sets PROXY_PID and PROXY_PORT
    local name="$1" dir="$RUN/$1"
    PROXY_PORT="$(python3 "$BENCH/tool.py" port)"
    rm -rf "$dir"; mkdir -p "$dir/logs/tmp"; chmod -R 755 "$dir"
    case "$name" in
        epoll | uring | uring-plain)
            local mode="${name%-plain}" ring=defer
            [ "$name" = uring-plain ] && ring=plain
            "$URING_BIN" --mode "$mode" --ring "$ring" --workers "$WORKERS" \
                --listen "127.0.0.1:$PROXY_PORT" --origin "127.0.0.1:$ORIGIN_PORT" \
                >"$dir/stdout.log" 2>&1 & ;;
        nginx)
            sed -e "s/@PORT@/$PROXY_PORT/g" -e "s/@ORIGIN@/$ORIGIN_PORT/g" \
                -e "s/^worker_processes 2;/worker_processes $WORKERS;/" \
                "$BENCH/peers/nginx-proxy/nginx.conf" >"$dir/nginx.conf"
            nginx -p "$dir/" -c nginx.conf -e "$dir/logs/error.log" >"$dir/stdout.log" 2>&1 & ;;
        pier|pier-epoll)
            # pier: its default (clients on io_uring since [server] io_uring);
            # pier-epoll: the same binary and config with PIER_IO_URING=0.
            sed -e "s/@PORT@/$PROXY_PORT/g" -e "s/@ORIGIN@/$ORIGIN_PORT/g" \
                -e "s/^workers = 2/workers = $WORKERS/" \
                "$BENCH/peers/pier/pier.toml" >"$dir/pier.toml"
            PIER_IO_URING="$([ "$name" = pier-epoll ] && echo 0 || echo "${PIER_IO_URING:-}")" \
                "$PIER_BIN" serve -c "$dir/pier.toml" >"$dir/stdout.log" 2>&1 & ;;
        *) die "unknown proxy $name (epoll, uring, uring-plain, nginx, pier, pier-epoll)" ;;
    esac
    PROXY_PID=$!
    PIDS+=("$PROXY_PID")
    if ! python3 "$BENCH/tool.py" wait-port "$PROXY_PORT" 15 --pid "$PROXY_PID"; then
        log "$name did not start; its output:"; tail -n 20 "$dir/stdout.log" >&2 || true
        stop_proxy; return 1
    fi
    local why
    if ! why="$(python3 "$BENCH/tool.py" check "$PROXY_PORT" 2>&1)"; then
        log "$name failed its sanity check: $why"; stop_proxy; return 1
    fi
}
stop_proxy() {
    [ -n "$PROXY_PID" ] || return 0
    kill_tree "$PROXY_PID"; untrack "$PROXY_PID"; PROXY_PID=""
}

cat >"$RUN/settings.json" <<EOF
{"proxies": "$PROXIES", "reps": $REPS, "duration": $DURATION, "conns": "$CONNS",
 "paths": "$PATHS", "threads": $THREADS, "workers": $WORKERS, "nproc": $(nproc),
 "date": "$(date -u +%Y-%m-%dT%H:%M:%SZ)", "kernel": "$(uname -r)",
 "nginx": "$(nginx -v 2>&1 | sed 's/.*nginx\///')",
 "pier": "$( [ -x "$PIER_BIN" ] && "$PIER_BIN" --version 2>/dev/null | head -1 || echo n/a)",
 "commit": "$(cd "$ROOT" && git rev-parse --short HEAD 2>/dev/null || echo none)"}
EOF

# ---- runs: for each repetition, path and connection count, every proxy once in turn -------
FAILED=0
for rep in $(seq 1 "$REPS"); do
    for path in "${PATH_LIST[@]}"; do
        for c in "${CONN_LIST[@]}"; do
            log "rep $rep/$REPS: $path, $c connections, ${DURATION}s each"
            for proxy in "${PROXY_LIST[@]}"; do
                if ! start_proxy "$proxy"; then
                    FAILED=$((FAILED + 1)); continue
                fi
                python3 "$BENCH/tool.py" measure --proxy "$proxy" --path "$path" \
                    --out "$RESULTS" --pid "$PROXY_PID" --port "$PROXY_PORT" \
                    --origin-pid "$ORIGIN_PID" --origin-port "$ORIGIN_PORT" --conns "$c" \
                    --duration "$DURATION" --threads "$THREADS" --rep "$rep" \
                    || log "$proxy: the wrk run reported an error (kept in $RESULTS)"
                stop_proxy
            done
        done
    done
done

# ---- system calls per request (outside the timed runs) ------------------------------------
# perf counts syscall tracepoints of the proxy's processes during one more wrk run per
# proxy and connection count: cheap enough not to change how the proxy batches its work
# (strace would: it slows every call).
SC_EVENTS=""
if [ "$SYSCALLS" = 1 ] && command -v perf >/dev/null &&
    perf stat -e raw_syscalls:sys_enter -- true >/dev/null 2>&1; then
    SC_EVENTS="raw_syscalls:sys_enter"
    for e in recvfrom sendto read write readv writev recvmsg sendmsg epoll_wait epoll_pwait \
        epoll_ctl io_uring_enter accept4 connect close setsockopt getsockopt; do
        for d in /sys/kernel/tracing /sys/kernel/debug/tracing; do
            if [ -d "$d/events/syscalls/sys_enter_$e" ]; then SC_EVENTS+=",syscalls:sys_enter_$e"; break; fi
        done
    done
elif [ "$SYSCALLS" = 1 ]; then
    log "system calls: perf (with syscall tracepoints) is not available; skipped"
fi
if [ -n "$SC_EVENTS" ]; then
    for c in "${CONN_LIST[@]}"; do
        for proxy in "${PROXY_LIST[@]}"; do
            log "system calls: $proxy, /hello, $c connections, ${DURATION}s under perf stat"
            start_proxy "$proxy" || { FAILED=$((FAILED + 1)); continue; }
            pids="$(python3 "$BENCH/tool.py" tree "$PROXY_PID" | tr ' ' ,)"
            timeout $((DURATION + 30)) perf stat -x, -e "$SC_EVENTS" -p "$pids" \
                -o "$RUN/$proxy/perf-$c.txt" -- sleep $((DURATION + 1)) &
            perf_pid=$!
            sleep 0.5
            timeout $((DURATION + 30)) wrk -t"$THREADS" -c"$c" -d"${DURATION}s" \
                -H 'User-Agent: pier-bench' "http://127.0.0.1:$PROXY_PORT/hello" \
                >"$RUN/$proxy/wrk-$c.txt" 2>&1 || log "$proxy: wrk failed"
            wait "$perf_pid" || log "$proxy: perf stat failed"
            stop_proxy
            python3 - "$BENCH" "$proxy" "$c" "$RUN/$proxy/perf-$c.txt" "$RUN/$proxy/wrk-$c.txt" \
                >>"$RESULTS" <<'PY' || log "$proxy: no syscall counts"
import json, sys
sys.path.insert(0, sys.argv[1])
import tool
calls = {}
for line in open(sys.argv[4], errors="replace"):
    f = line.strip().split(",")
    if len(f) > 2 and f[0].isdigit():
        calls[f[2].split(":")[-1].replace("sys_enter_", "")] = int(f[0])
r = tool.parse_wrk(open(sys.argv[5], errors="replace").read())
print(json.dumps({"kind": "syscalls", "proxy": sys.argv[2], "conns": int(sys.argv[3]),
                  "requests": r["requests"], "calls": calls}))
PY
        done
    done
fi

python3 "$BENCH/uring_report.py" "$RUN" | tee "$RUN/results.md"
log "report: $RUN/results.md (raw: $RESULTS)"
[ "$FAILED" -eq 0 ] || log "WARNING: $FAILED proxy start(s) failed; see the logs under $RUN"
