#!/usr/bin/env bash
# HTTP/2 and gRPC side by side: Pier vs nginx and HAProxy, one proxy at a time, per proxy
# CPU-second. See bench/README.md ("HTTP/2 and gRPC").
#
#   bench/h2.sh                                     # everything (~16 minutes on 2 cores)
#   MODES=grpc PROXIES=pier,nginx REPS=1 bench/h2.sh
#   PIER_BIN=after PIER_BIN_B=before PROXIES=pier,pier-b,haproxy SKIP_BUILD=1 bench/h2.sh  # two builds, one run
#
# Modes:
#   h2    HTTP/2 over TLS (ALPN h2) downstream, HTTP/1.1 to an nginx origin; h2load with 10
#         streams per connection (STREAMS total: 5 and 50 connections by default).
#   h2c   the same over cleartext HTTP/2 with prior knowledge (h2load's default for http://;
#         Pier `h2c = "only"`, nginx `listen … http2` without ssl, HAProxy `proto h2`).
#   grpc  gRPC unary (grpc.testing.TestService/UnaryCall) with ghz, cleartext HTTP/2 with
#         prior knowledge on both legs, to grpc-go's interop server; counts the upstream
#         connections each proxy opened (sockets to the server's port, TIME-WAIT included).
#   idle  RSS growth with IDLE_CONNS HTTP/2-over-TLS client connections held open after one
#         request each.
set -euo pipefail

BENCH_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$BENCH_DIR/.." && pwd)"

PROXIES="${PROXIES:-pier,nginx,haproxy}"
MODES="${MODES:-h2,h2c,grpc,idle}"
DURATION="${DURATION:-10}"
STREAMS="${STREAMS:-50,500}"        # streams in flight in total
PER_CONN="${PER_CONN:-10}"          # h2, h2c: streams per connection (a list: 1,10,100)
PATHS="${PATHS:-/hello}"            # h2, h2c: request paths (the origin has /hello and /4k.bin)
REPS="${REPS:-3}"
IDLE_CONNS="${IDLE_CONNS:-2000}"
PIER_BIN="${PIER_BIN:-$ROOT/target/dist/pier}"
PIER_BIN_B="${PIER_BIN_B:-}"        # a second build: proxy "pier-b" (same config as "pier"), e.g. before/after
GHZ="${GHZ:-$(command -v ghz || echo /root/go/bin/ghz)}"
GRPC_SERVER="${GRPC_SERVER:-$(command -v server || echo /root/go/bin/server)}"
SKIP_BUILD="${SKIP_BUILD:-0}"
OUT_DIR="${OUT_DIR:-$BENCH_DIR/out}"

log() { printf '[h2 bench %s] %s\n' "$(date -u +%H:%M:%S)" "$*" >&2; }
die() { log "ERROR: $*"; exit 1; }
has() { [[ ",$2," == *",$1,"* ]]; }

command -v h2load >/dev/null || die "h2load missing (apt-get install nghttp2-client)"
command -v nginx >/dev/null || die "nginx missing"
command -v haproxy >/dev/null || die "haproxy missing"
if has grpc "$MODES"; then
    [ -x "$GHZ" ] || die "ghz missing (go install github.com/bojand/ghz/cmd/ghz@latest)"
    [ -x "$GRPC_SERVER" ] || die "grpc-go interop server missing (go install google.golang.org/grpc/interop/server@latest)"
    # `|| true`: a module version in the cache without the file makes ls fail (pipefail).
    PROTO="${PROTO:-$( (ls -d /root/go/pkg/mod/google.golang.org/grpc@*/interop/grpc_testing/test.proto 2>/dev/null || true) | head -1)}"
    [ -f "$PROTO" ] || PROTO="$BENCH_DIR/peers/h2/grpc_testing.proto"
fi

PIDS=()
source "$BENCH_DIR/procs.sh"   # kill_tree, cleanup (at exit), untrack

template() {   # template SRC DST PORT UPSTREAM
    sed -e "s/@PORT@/$3/g" -e "s/@ORIGIN@/$4/g" \
        -e "s|@CERT@|$CERT_FILE|g" -e "s|@KEY@|$KEY_FILE|g" -e "s|@PEM@|$PEM_FILE|g" "$1" >"$2"
}

if [ "$SKIP_BUILD" != 1 ]; then
    log "building pier: cargo build --profile dist -p pier"
    (cd "$ROOT" && nice -n 10 cargo build --profile dist -p pier) || die "cargo build failed"
fi
[ -x "$PIER_BIN" ] || die "no Pier binary at $PIER_BIN"

mkdir -p "$OUT_DIR"
RUN="$OUT_DIR/h2-$(date -u +%Y%m%dT%H%M%SZ)"
mkdir -p "$RUN"
RESULTS="$RUN/results.jsonl"
: >"$RESULTS"
ulimit -n 20000 2>/dev/null || ulimit -n "$(ulimit -Hn)"
log "run directory: $RUN"

# Certificates (ECDSA P-256), made now.
d="$RUN/certs"; mkdir -p "$d"
openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -days 2 \
    -subj /CN=pier-bench-ca -keyout "$d/ca.key" -out "$d/ca.pem" 2>/dev/null
openssl req -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -subj /CN=localhost \
    -keyout "$d/leaf.key" -out "$d/leaf.csr" 2>/dev/null
printf 'subjectAltName=DNS:localhost,IP:127.0.0.1\nbasicConstraints=CA:FALSE\n' >"$d/ext.cnf"
openssl x509 -req -in "$d/leaf.csr" -CA "$d/ca.pem" -CAkey "$d/ca.key" -CAcreateserial \
    -days 2 -extfile "$d/ext.cnf" -out "$d/leaf.pem" 2>/dev/null
cat "$d/leaf.pem" "$d/leaf.key" >"$d/combined.pem"
chmod -R a+rX "$RUN"
CERT_FILE="$d/leaf.pem"; KEY_FILE="$d/leaf.key"; PEM_FILE="$d/combined.pem"

# The HTTP/1.1 origin (nginx, as in bench/run.sh) and the gRPC server.
ORIGIN_PORT="$(python3 "$BENCH_DIR/tool.py" port)"
mkdir -p "$RUN/origin/logs/tmp" "$RUN/origin/html"
printf 'hello world\n' >"$RUN/origin/html/hello.txt"
head -c 4096 /dev/urandom >"$RUN/origin/html/4k.bin"
chmod -R 755 "$RUN/origin"
template "$BENCH_DIR/peers/origin/nginx.conf" "$RUN/origin/nginx.conf" "$ORIGIN_PORT" 0
nginx -p "$RUN/origin/" -c nginx.conf -e "$RUN/origin/logs/error.log" >"$RUN/origin/stdout.log" 2>&1 &
PIDS+=("$!")
python3 "$BENCH_DIR/tool.py" wait-port "$ORIGIN_PORT" 15 || die "origin did not start"
GRPC_PORT=0
if has grpc "$MODES"; then
    GRPC_PORT="$(python3 "$BENCH_DIR/tool.py" port)"
    "$GRPC_SERVER" --port="$GRPC_PORT" >"$RUN/grpc-server.log" 2>&1 &
    PIDS+=("$!")
    python3 "$BENCH_DIR/tool.py" wait-port "$GRPC_PORT" 15 || die "gRPC server did not start"
fi

cat >"$RUN/settings.json" <<EOF
{"proxies": "$PROXIES", "modes": "$MODES", "duration": $DURATION, "streams": "$STREAMS", "reps": $REPS,
 "per_conn": "$PER_CONN", "paths": "$PATHS",
 "idle_conns": $IDLE_CONNS, "date": "$(date -u +%Y-%m-%dT%H:%M:%SZ)", "nproc": $(nproc),
 "nginx": "$(nginx -v 2>&1 | sed 's/.*nginx\///')", "haproxy": "$(haproxy -v | head -1 | awk '{print $3}')",
 "h2load": "$(h2load --version | awk '{print $2}')", "ghz": "$("$GHZ" --version 2>&1 | head -1)",
 "pier_commit": "$(cd "$ROOT" && git rev-parse --short HEAD 2>/dev/null || echo none)"}
EOF

PROXY_PID=""; PROXY_PORT=""
start_proxy() {   # start_proxy NAME MODE
    local name="$1" mode="$2" dir="$RUN/$1-$2" up="$ORIGIN_PORT" cfg
    [ "$mode" = grpc ] && up="$GRPC_PORT"
    local suffix="$mode"   # h2, h2c or grpc: bench/peers/h2/<proxy>-<suffix>.*
    PROXY_PORT="$(python3 "$BENCH_DIR/tool.py" port)"
    rm -rf "$dir"; mkdir -p "$dir/logs/tmp"; chmod -R 755 "$dir"
    case "$name" in
        nginx)
            template "$BENCH_DIR/peers/h2/nginx-$suffix.conf" "$dir/nginx.conf" "$PROXY_PORT" "$up"
            nginx -p "$dir/" -c nginx.conf -e "$dir/logs/error.log" >"$dir/stdout.log" 2>&1 & ;;
        haproxy)
            template "$BENCH_DIR/peers/h2/haproxy-$suffix.cfg" "$dir/haproxy.cfg" "$PROXY_PORT" "$up"
            haproxy -db -f "$dir/haproxy.cfg" >"$dir/stdout.log" 2>&1 & ;;
        pier)
            template "$BENCH_DIR/peers/h2/pier-$suffix.toml" "$dir/pier.toml" "$PROXY_PORT" "$up"
            "$PIER_BIN" serve -c "$dir/pier.toml" >"$dir/stdout.log" 2>&1 & ;;
        pier-b)
            [ -x "$PIER_BIN_B" ] || die "pier-b: no binary at PIER_BIN_B='$PIER_BIN_B'"
            template "$BENCH_DIR/peers/h2/pier-$suffix.toml" "$dir/pier.toml" "$PROXY_PORT" "$up"
            "$PIER_BIN_B" serve -c "$dir/pier.toml" >"$dir/stdout.log" 2>&1 & ;;
        *) die "unknown proxy $name" ;;
    esac
    PROXY_PID=$!
    PIDS+=("$PROXY_PID")
    python3 "$BENCH_DIR/tool.py" wait-port "$PROXY_PORT" 15 --pid "$PROXY_PID" || {
        tail -n 20 "$dir/stdout.log" "$dir/logs/error.log" >&2 2>/dev/null || true; return 1; }
    local why
    if [ "$mode" = grpc ]; then
        why="$("$GRPC_CLIENT" --server_port="$PROXY_PORT" --test_case=large_unary 2>&1)" || {
            log "$name: gRPC check failed: $why"; return 1; }
    else
        local clear=(); [ "$mode" = h2c ] && clear=(--cleartext)
        why="$(python3 "$BENCH_DIR/h2tool.py" check-h2 "${clear[@]}" "$PROXY_PORT")" || {
            log "$name: HTTP/2 check failed: $why"; return 1; }
    fi
}
stop_proxy() { [ -n "$PROXY_PID" ] || return 0; kill_tree "$PROXY_PID"; untrack "$PROXY_PID"; PROXY_PID=""; }
GRPC_CLIENT="${GRPC_CLIENT:-$(command -v client || echo /root/go/bin/client)}"

IFS=, read -ra PROXY_LIST <<<"$PROXIES"
IFS=, read -ra STREAM_LIST <<<"$STREAMS"
IFS=, read -ra PER_CONN_LIST <<<"$PER_CONN"
IFS=, read -ra PATH_LIST <<<"$PATHS"
for rep in $(seq 1 "$REPS"); do
    for mode in h2 h2c grpc; do
        has "$mode" "$MODES" || continue
        # gRPC: one call, 10 streams a connection. h2 and h2c: every path and streams per
        # connection; S streams in flight are S/P connections of P (at least one connection).
        paths=("${PATH_LIST[@]}"); pers=("${PER_CONN_LIST[@]}")
        [ "$mode" = grpc ] && { paths=(-); pers=(10); }
        for path in "${paths[@]}"; do
        for per in "${pers[@]}"; do
        for s in "${STREAM_LIST[@]}"; do
            conns=$((s / per)); [ "$conns" -ge 1 ] || conns=1
            log "rep $rep/$REPS: $mode $path, $((conns * per)) streams ($per per connection), ${DURATION}s, load $(cut -d' ' -f1 /proc/loadavg)"
            for proxy in "${PROXY_LIST[@]}"; do
                start_proxy "$proxy" "$mode" || { stop_proxy; continue; }
                if [ "$mode" != grpc ]; then
                    python3 "$BENCH_DIR/h2tool.py" h2load --kind "$mode" --proxy "$proxy" --out "$RESULTS" \
                        --pid "$PROXY_PID" --port "$PROXY_PORT" --conns "$conns" --streams $((conns * per)) \
                        --path "$path" --duration "$DURATION" --rep "$rep" --origin-port "$ORIGIN_PORT" \
                        || log "$proxy: h2load error"
                else
                    python3 "$BENCH_DIR/h2tool.py" ghz --kind grpc --proxy "$proxy" --out "$RESULTS" \
                        --pid "$PROXY_PID" --port "$PROXY_PORT" --conns "$conns" --streams "$s" \
                        --duration "$DURATION" --rep "$rep" --upstream-port "$GRPC_PORT" \
                        --proto "$PROTO" --ghz "$GHZ" || log "$proxy: ghz error"
                fi
                stop_proxy
            done
        done
        done
        done
    done
    if has idle "$MODES" && [ "$IDLE_CONNS" -gt 0 ]; then
        for proxy in "${PROXY_LIST[@]}"; do
            start_proxy "$proxy" h2 || { stop_proxy; continue; }
            python3 "$BENCH_DIR/h2tool.py" idle --proxy "$proxy" --out "$RESULTS" --pid "$PROXY_PID" \
                --port "$PROXY_PORT" --n "$IDLE_CONNS" --rep "$rep" || log "$proxy: idle test failed"
            stop_proxy
        done
    fi
done

python3 "$BENCH_DIR/h2tool.py" report "$RUN" | tee "$RUN/results.md"
log "report: $RUN/results.md"
