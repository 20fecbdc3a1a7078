#!/usr/bin/env bash
# Cosocket-heavy hook benchmark: Pier vs OpenResty-style nginx (Debian nginx +
# libnginx-mod-http-lua), each running the same content hook (bench/peers/redis/incr.lua:
# lua-resty-redis, one INCR per request on one local redis-server, keepalive pool 100)
# with the same unchanged library files. One proxy at a time, interleaved per repetition.
# Results: bench/out/redis-results.md and bench/out/redis-<time>/ (report: bench/redis_report.py).
#
#   bench/redis_incr.sh                               # 50 and 500 connections, 10 s, 3 reps
#   DURATION=3 REPS=1 bench/redis_incr.sh             # quick check
set -euo pipefail

BENCH_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$BENCH_DIR/.." && pwd)"

# ---- knobs (environment) ----------------------------------------------------------------
PROXIES="${PROXIES:-pier-redis,nginx-redis}"
DURATION="${DURATION:-10}"          # seconds per wrk run
CONNS="${CONNS:-50,500}"            # wrk connection counts
REPS="${REPS:-3}"                   # repetitions; proxies are interleaved within each
THREADS="${THREADS:-2}"             # wrk threads
# Workers per proxy (Pier `workers`, nginx `worker_processes`); each has its own pool of 100.
WORKERS="${WORKERS:-2}"
PIER_BIN="${PIER_BIN:-$ROOT/target/dist/pier}"
SKIP_INSTALL="${SKIP_INSTALL:-0}"   # 1 = never call apt-get
SKIP_BUILD="${SKIP_BUILD:-0}"       # 1 = use $PIER_BIN as is
# A second Pier build to compare in the same run: PROXIES=pier-redis,pier-redis-b,nginx-redis
PIER_BIN_B="${PIER_BIN_B:-}"
OUT_DIR="${OUT_DIR:-$BENCH_DIR/out}"
# The libraries: .ci/run unpacks them here; this script does the same when missing.
LUALIBS_DIR="$ROOT/target/lualibs"
PIER_LUA_LIBS="${PIER_LUA_LIBS:-$LUALIBS_DIR/root/usr/share/lua/5.1}"

log() { printf '[redis-bench %s] %s\n' "$(date -u +%H:%M:%S)" "$*" >&2; }
die() { log "ERROR: $*"; exit 1; }
tool() { python3 "$BENCH_DIR/tool.py" "$@"; }

# ---- prerequisites ----------------------------------------------------------------------
install_missing() {
    local pkgs=()
    command -v nginx >/dev/null || pkgs+=(nginx)
    command -v wrk >/dev/null || pkgs+=(wrk)
    command -v curl >/dev/null || pkgs+=(curl)
    command -v redis-server >/dev/null || pkgs+=(redis-server)
    command -v ps >/dev/null || pkgs+=(procps)
    command -v python3 >/dev/null || pkgs+=(python3)
    [ -e /usr/lib/nginx/modules/ngx_http_lua_module.so ] || pkgs+=(libnginx-mod-http-lua)
    [ -e /usr/share/lua/5.1/resty/core.lua ] || pkgs+=(lua-resty-core)
    if [ "${#pkgs[@]}" -gt 0 ]; then
        [ "$SKIP_INSTALL" = 1 ] && die "missing packages: ${pkgs[*]} (SKIP_INSTALL=1)"
        log "installing: ${pkgs[*]}"
        export DEBIAN_FRONTEND=noninteractive
        apt-get update -qq
        apt-get install -y -qq --no-install-recommends "${pkgs[@]}" >/dev/null
    fi
    if [ ! -f "$PIER_LUA_LIBS/nginx/redis.lua" ]; then
        [ "$PIER_LUA_LIBS" = "$LUALIBS_DIR/root/usr/share/lua/5.1" ] \
            || die "PIER_LUA_LIBS=$PIER_LUA_LIBS has no nginx/redis.lua"
        [ "$SKIP_INSTALL" = 1 ] && die "no lua-resty-redis at $PIER_LUA_LIBS (SKIP_INSTALL=1)"
        log "unpacking lua-nginx-redis into $LUALIBS_DIR (as .ci/run does)"
        mkdir -p "$LUALIBS_DIR/debs"
        (cd "$LUALIBS_DIR/debs" && apt-get download lua-nginx-redis)
        for d in "$LUALIBS_DIR"/debs/lua-nginx-redis_*.deb; do dpkg-deb -x "$d" "$LUALIBS_DIR/root"; done
    fi
}

has_proxy() { [[ ",$PROXIES," == *",$1,"* ]]; }

# ---- process bookkeeping ----------------------------------------------------------------
PIDS=()
PROXY_PID=""

source "$BENCH_DIR/procs.sh"   # kill_tree, cleanup (at exit), untrack

template() {   # template SRC DST PORT
    sed -e "s/@PORT@/$3/g" -e "s/@ORIGIN@/${ORIGIN_PORT:-0}/g" -e "s/@REDIS@/${REDIS_PORT:-0}/g" \
        -e "s|@LUALIBS@|$PIER_LUA_LIBS|g" -e "s|@HOOK@|$RUN/incr.lua|g" "$1" >"$2"
}

redis() { redis-cli -h 127.0.0.1 -p "$REDIS_PORT" "$@"; }
# TCP segments this machine received (all of them are loopback here): wrk <-> proxy and
# proxy <-> redis, so a run's count per request shows redis connections opened and closed.
tcp_in_segs() { awk '/^Tcp:/ { if (h) { print $11; exit } h = 1 }' /proc/net/snmp; }
redis_info() { redis INFO | tr -d '\r' | sed -n "s/^$1://p"; }

# start_proxy NAME: sets PROXY_PID and PROXY_PORT; returns 1 (with a message) on failure
start_proxy() {
    local name="$1" dir="$RUN/$1" port
    port="$(tool port)"
    PROXY_PORT="$port"
    rm -rf "$dir"; mkdir -p "$dir/logs/tmp"; chmod -R 755 "$dir"
    case "$name" in
        nginx-redis)
            template "$BENCH_DIR/peers/redis/nginx.conf" "$dir/nginx.conf" "$port"
            sed -i "s/^worker_processes .*/worker_processes $WORKERS;/" "$dir/nginx.conf"
            nginx -p "$dir/" -c nginx.conf -e "$dir/logs/error.log" >"$dir/stdout.log" 2>&1 &
            ;;
        pier-redis | pier-redis-b)
            local bin="$PIER_BIN"
            [ "$name" = pier-redis-b ] && bin="$PIER_BIN_B"
            template "$BENCH_DIR/peers/redis/pier.toml" "$dir/pier.toml" "$port"
            sed -i "s/^workers = .*/workers = $WORKERS/" "$dir/pier.toml"
            "$bin" serve -c "$dir/pier.toml" >"$dir/stdout.log" 2>&1 &
            ;;
        *) die "unknown proxy '$name' (known: pier-redis, pier-redis-b, nginx-redis)" ;;
    esac
    PROXY_PID=$!
    PIDS+=("$PROXY_PID")
    if ! tool wait-port "$port" 15 --pid "$PROXY_PID" || ! kill -0 "$PROXY_PID" 2>/dev/null; then
        log "$name did not start listening on 127.0.0.1:$port; its output:"
        tail -n 20 "$dir/stdout.log" "$dir/logs/error.log" >&2 2>/dev/null || true
        stop_proxy
        return 1
    fi
    # Sanity: two requests answer 200 with consecutive counter values.
    local a b
    a="$(curl -sf "http://127.0.0.1:$port/" || true)"
    b="$(curl -sf "http://127.0.0.1:$port/" || true)"
    if ! [[ "$a" =~ ^[0-9]+$ && "$b" =~ ^[0-9]+$ ]] || [ "$b" -ne $((a + 1)) ]; then
        log "$name failed its sanity check: GET / answered '${a:0:200}' then '${b:0:200}'"
        tail -n 20 "$dir/stdout.log" "$dir/logs/error.log" >&2 2>/dev/null || true
        stop_proxy
        return 1
    fi
    return 0
}

stop_proxy() {
    [ -n "$PROXY_PID" ] || return 0
    kill_tree "$PROXY_PID"
    untrack "$PROXY_PID"
    PROXY_PID=""
}

# ---- main ---------------------------------------------------------------------------------
install_missing
mkdir -p "$OUT_DIR"; chmod 755 "$OUT_DIR"
RUN="$OUT_DIR/redis-$(date -u +%Y%m%dT%H%M%SZ)"
mkdir -p "$RUN"; chmod 755 "$RUN"
RESULTS="$RUN/results.jsonl"
: >"$RESULTS"
log "run directory: $RUN"
ulimit -n 20000 2>/dev/null || ulimit -n "$(ulimit -Hn)"

if has_proxy pier-redis; then
    if [ "$SKIP_BUILD" != 1 ]; then
        log "building pier: cargo build --profile dist -p pier"
        (cd "$ROOT" && nice -n 10 cargo build --profile dist -p pier) >"$RUN/cargo-build.log" 2>&1 \
            || { tail -n 20 "$RUN/cargo-build.log" >&2; die "cargo build --profile dist -p pier failed"; }
    fi
    [ -x "$PIER_BIN" ] || die "no Pier binary at $PIER_BIN"
fi
if has_proxy pier-redis-b; then
    [ -x "$PIER_BIN_B" ] || die "pier-redis-b needs PIER_BIN_B (another Pier binary)"
fi

# redis-server: one instance for every run, no persistence.
REDIS_PORT="$(tool port)"
mkdir -p "$RUN/redis"
redis-server --port "$REDIS_PORT" --bind 127.0.0.1 --save '' --appendonly no --daemonize no \
    --dir "$RUN/redis" --maxclients 10000 >"$RUN/redis/stdout.log" 2>&1 &
REDIS_PID=$!
PIDS+=("$REDIS_PID")
tool wait-port "$REDIS_PORT" 15 --pid "$REDIS_PID" || { cat "$RUN/redis/stdout.log" >&2; die "redis-server did not start"; }
log "redis-server: pid $REDIS_PID on 127.0.0.1:$REDIS_PORT"

# tool.py measure reads an origin's stub_status (upstream connections): an idle nginx
# origin, which these content hooks never use (its count stays 0).
ORIGIN_PORT="$(tool port)"
rm -rf "$RUN/origin"; mkdir -p "$RUN/origin/logs/tmp" "$RUN/origin/html"; chmod -R 755 "$RUN/origin"
template "$BENCH_DIR/peers/origin/nginx.conf" "$RUN/origin/nginx.conf" "$ORIGIN_PORT"
nginx -p "$RUN/origin/" -c nginx.conf -e "$RUN/origin/logs/error.log" >"$RUN/origin/stdout.log" 2>&1 &
ORIGIN_PID=$!
PIDS+=("$ORIGIN_PID")
tool wait-port "$ORIGIN_PORT" 15 || die "origin did not start"

template "$BENCH_DIR/peers/redis/incr.lua" "$RUN/incr.lua" 0
chmod 644 "$RUN/incr.lua"

cat >"$RUN/settings.json" <<EOF
{"proxies": "$PROXIES", "workers": $WORKERS, "duration": $DURATION, "conns": "$CONNS", "reps": $REPS,
 "threads": $THREADS, "date": "$(date -u +%Y-%m-%dT%H:%M:%SZ)", "nproc": $(nproc),
 "kernel": "$(uname -r)", "nginx": "$(nginx -v 2>&1 | sed 's/.*nginx\///')",
 "redis": "$(redis-server --version | sed 's/.*v=\([^ ]*\).*/\1/')",
 "lua_libs": "$PIER_LUA_LIBS",
 "pier": "$( [ -x "$PIER_BIN" ] && "$PIER_BIN" --version 2>/dev/null | head -1 || echo n/a)",
 "pier_commit": "$(cd "$ROOT" && git rev-parse --short HEAD 2>/dev/null || echo none)"}
EOF

IFS=, read -ra PROXY_LIST <<<"$PROXIES"
IFS=, read -ra CONN_LIST <<<"$CONNS"
FAILED=0
for rep in $(seq 1 "$REPS"); do
    for c in "${CONN_LIST[@]}"; do
        log "rep $rep/$REPS: $c connections, ${DURATION}s each"
        for proxy in "${PROXY_LIST[@]}"; do
            if ! start_proxy "$proxy"; then
                FAILED=$((FAILED + 1))
                echo "{\"kind\":\"failed\",\"proxy\":\"$proxy\",\"conns\":$c,\"rep\":$rep}" >>"$RESULTS"
                continue
            fi
            redis SET hits 0 >/dev/null
            conns0="$(redis_info total_connections_received)"
            rcpu0="$(tool stat "$REDIS_PID" | sed 's/^cpu_s=\([^ ]*\).*/\1/')"
            segs0="$(tcp_in_segs)"
            tool measure --proxy "$proxy" --path / --out "$RESULTS" --pid "$PROXY_PID" \
                --port "$PROXY_PORT" --origin-pid "$ORIGIN_PID" --origin-port "$ORIGIN_PORT" \
                --conns "$c" --duration "$DURATION" --threads "$THREADS" --rep "$rep" \
                || log "$proxy: wrk run reported an error (kept in $RESULTS)"
            rcpu1="$(tool stat "$REDIS_PID" | sed 's/^cpu_s=\([^ ]*\).*/\1/')"
            segs1="$(tcp_in_segs)"
            conns1="$(redis_info total_connections_received)"
            clients="$(redis_info connected_clients)"
            hits="$(redis GET hits)"
            # Connections the proxy opened to redis during the run (minus redis-cli's own
            # INFO connection), the INCRs redis counted, and redis-server's CPU.
            echo "{\"kind\":\"redis\",\"proxy\":\"$proxy\",\"conns\":$c,\"rep\":$rep,\"redis_conns_opened\":$((conns1 - conns0 - 1)),\"redis_clients_after\":$((clients - 1)),\"incrs\":$hits,\"redis_cpu_s\":$(python3 -c "print(round($rcpu1 - $rcpu0, 3))"),\"redis_tcp_segs\":$((segs1 - segs0))}" >>"$RESULTS"
            log "  $proxy: redis saw $hits INCRs, $((conns1 - conns0 - 1)) new connections, $((clients - 1)) open after"
            stop_proxy
        done
    done
done

python3 "$BENCH_DIR/redis_report.py" "$RUN" | tee "$RUN/results.md"
cp "$RUN/results.md" "$OUT_DIR/redis-results.md"
log "report: $OUT_DIR/redis-results.md (raw: $RESULTS)"
[ "$FAILED" -eq 0 ] || { log "WARNING: $FAILED proxy start(s) failed; see the logs under $RUN"; exit 1; }
