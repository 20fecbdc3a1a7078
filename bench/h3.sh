#!/usr/bin/env bash
# HTTP/3 side by side: Pier against Caddy (quic-go), one proxy at a time, per proxy
# CPU-second, plus Pier's own HTTP/2 over TLS in the same run. See bench/README.md ("HTTP/3").
#
#   bench/h3.sh                                           # everything (~12 minutes on 2 cores)
#   PIER_BIN=/tmp/pier SKIP_BUILD=1 REPS=1 DURATION=5 bench/h3.sh
#   PROXIES=pier,pier-h2 PATHS=/hello STREAMS=500 NEWCONN= SKIP_BUILD=1 bench/h3.sh   # HTTP/3 vs HTTP/2 only
#
# Proxies (PROXIES, in this order within each repetition):
#   pier      Pier (bench/peers/h3/pier-h3.toml, `http3 = true`), the client speaking HTTP/3
#   caddy     Caddy v2.11.9 (bench/peers/h3/Caddyfile), the client speaking HTTP/3
#   pier-h2   the same Pier binary and config, the client speaking HTTP/2 over TLS (TCP)
#   caddy-h2  the same Caddy, the client speaking HTTP/2 over TLS (not in the default list)
# Every proxy runs WORKERS threads (Pier's `workers`; Caddy's GOMAXPROCS), in front of one
# nginx origin (bench/peers/origin/nginx.conf: /hello, /4k.bin), and is started fresh for
# every run. The client is bench/h3load (quic-go's http3, x/net's http2).
#
# Scenarios:
#   keep-alive   for each of PATHS and STREAMS: CONNS connections (default 5), STREAMS
#                requests in flight in total, spread evenly over them; WARMUP s unmeasured, then
#                DURATION s measured
#   new conn     NEWCONN clients (default 50; empty: none), each opening one connection after
#                another: a full handshake (no resumption, no 0-RTT), one GET NEWCONN_PATH,
#                close. The figure is connections (each with its request) per proxy CPU-second
set -euo pipefail

BENCH_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$BENCH_DIR/.." && pwd)"

PROXIES="${PROXIES:-pier,caddy,pier-h2}"
DURATION="${DURATION:-10}"
WARMUP="${WARMUP:-1}"
REPS="${REPS:-3}"
STREAMS="${STREAMS:-50,500}"        # requests in flight in total, over CONNS connections
CONNS="${CONNS:-5}"
PATHS="${PATHS-/hello,/4k.bin}"
NEWCONN="${NEWCONN-50}"             # concurrent clients in the new-connection runs; empty: none
NEWCONN_PATH="${NEWCONN_PATH:-/hello}"
WORKERS="${WORKERS:-2}"
PIER_BIN="${PIER_BIN:-$ROOT/target/dist/pier}"
CADDY="${CADDY:-$(command -v caddy || echo /root/go/bin/caddy)}"
H3LOAD="${H3LOAD:-$BENCH_DIR/h3load/h3load}"
SKIP_BUILD="${SKIP_BUILD:-0}"
OUT_DIR="${OUT_DIR:-$BENCH_DIR/out}"

log() { printf '[h3 bench %s] %s\n' "$(date -u +%H:%M:%S)" "$*" >&2; }
die() { log "ERROR: $*"; exit 1; }
has() { [[ ",$2," == *",$1,"* ]]; }

command -v nginx >/dev/null || die "nginx missing (apt-get install nginx)"
command -v openssl >/dev/null || die "openssl missing"
command -v python3 >/dev/null || die "python3 missing"
[ -x "$H3LOAD" ] || die "h3load missing at $H3LOAD: build it with (cd bench/h3load && go build)"
if has caddy "$PROXIES" || has caddy-h2 "$PROXIES"; then
    [ -x "$CADDY" ] || die "caddy missing: go install github.com/caddyserver/caddy/v2/cmd/caddy@v2.11.9 (or CADDY=path)"
fi

PIDS=()
source "$BENCH_DIR/procs.sh"   # kill_tree, cleanup (at exit), untrack

template() {   # template SRC DST PORT UPSTREAM [DATA]
    sed -e "s/@PORT@/$3/g" -e "s/@ORIGIN@/$4/g" -e "s/@WORKERS@/$WORKERS/g" \
        -e "s|@CERT@|$CERT_FILE|g" -e "s|@KEY@|$KEY_FILE|g" -e "s|@DATA@|${5:-}|g" "$1" >"$2"
}

if has pier "$PROXIES" || has pier-h2 "$PROXIES"; then
    if [ "$SKIP_BUILD" != 1 ]; then
        log "building pier: cargo build --profile dist -p pier"
        (cd "$ROOT" && nice -n 10 cargo build --profile dist -p pier) || die "cargo build failed"
    fi
    [ -x "$PIER_BIN" ] || die "no Pier binary at $PIER_BIN"
fi

mkdir -p "$OUT_DIR"
RUN="$OUT_DIR/h3-$(date -u +%Y%m%dT%H%M%SZ)"
mkdir -p "$RUN"
RESULTS="$RUN/results.jsonl"
: >"$RESULTS"
ulimit -n 20000 2>/dev/null || ulimit -n "$(ulimit -Hn)"
log "run directory: $RUN"

# Certificates (ECDSA P-256), made now, as in bench/h2.sh.
d="$RUN/certs"; mkdir -p "$d"
openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -days 2 \
    -subj /CN=pier-bench-ca -keyout "$d/ca.key" -out "$d/ca.pem" 2>/dev/null
openssl req -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -subj /CN=localhost \
    -keyout "$d/leaf.key" -out "$d/leaf.csr" 2>/dev/null
printf 'subjectAltName=DNS:localhost,IP:127.0.0.1\nbasicConstraints=CA:FALSE\n' >"$d/ext.cnf"
openssl x509 -req -in "$d/leaf.csr" -CA "$d/ca.pem" -CAkey "$d/ca.key" -CAcreateserial \
    -days 2 -extfile "$d/ext.cnf" -out "$d/leaf.pem" 2>/dev/null
chmod -R a+rX "$RUN"
CERT_FILE="$d/leaf.pem"; KEY_FILE="$d/leaf.key"; CA_FILE="$d/ca.pem"

# The HTTP/1.1 origin (nginx, as in bench/run.sh and bench/h2.sh).
ORIGIN_PORT="$(python3 "$BENCH_DIR/tool.py" port)"
mkdir -p "$RUN/origin/logs/tmp" "$RUN/origin/html"
printf 'hello world\n' >"$RUN/origin/html/hello.txt"
head -c 4096 /dev/urandom >"$RUN/origin/html/4k.bin"
chmod -R 755 "$RUN/origin"
template "$BENCH_DIR/peers/origin/nginx.conf" "$RUN/origin/nginx.conf" "$ORIGIN_PORT" 0
nginx -p "$RUN/origin/" -c nginx.conf -e "$RUN/origin/logs/error.log" >"$RUN/origin/stdout.log" 2>&1 &
ORIGIN_PID=$!
PIDS+=("$ORIGIN_PID")
python3 "$BENCH_DIR/tool.py" wait-port "$ORIGIN_PORT" 15 || die "origin did not start"

caddy_version="none"; pier_version="none"
[ -x "$CADDY" ] && caddy_version="$(go version -m "$CADDY" 2>/dev/null | awk '$1=="mod"{print $3} $2=="github.com/quic-go/quic-go"{q=$3} END{if(q)print "quic-go "q}' | paste -sd' ' || echo unknown)"
[ -x "$PIER_BIN" ] && pier_version="$("$PIER_BIN" --version 2>/dev/null | head -1 || echo unknown)"
h3load_quic="$(go version -m "$H3LOAD" 2>/dev/null | awk '$2=="github.com/quic-go/quic-go"{print $3}' || true)"
cat >"$RUN/settings.json" <<EOF
{"proxies": "$PROXIES", "duration": $DURATION, "warmup": $WARMUP, "streams": "$STREAMS", "conns": $CONNS,
 "paths": "$PATHS", "newconn": "$NEWCONN", "newconn_path": "$NEWCONN_PATH", "reps": $REPS, "workers": $WORKERS,
 "date": "$(date -u +%Y-%m-%dT%H:%M:%SZ)", "nproc": $(nproc), "pier_bin": "$PIER_BIN", "pier": "$pier_version",
 "caddy": "$caddy_version", "h3load_quic_go": "$h3load_quic",
 "nginx": "$(nginx -v 2>&1 | sed 's/.*nginx\///')", "rmem_max": $(cat /proc/sys/net/core/rmem_max),
 "pier_commit": "$(cd "$ROOT" && git rev-parse --short HEAD 2>/dev/null || echo none)"}
EOF

PROXY_PID=""; PROXY_PORT=""
proto_of() { case "$1" in *-h2) echo h2 ;; *) echo h3 ;; esac; }
start_proxy() {   # start_proxy NAME
    local name="$1" dir="$RUN/$1" base="${1%-h2}"
    PROXY_PORT="$(python3 "$BENCH_DIR/tool.py" port)"
    rm -rf "$dir"; mkdir -p "$dir/data"; chmod -R 755 "$dir"
    case "$base" in
        pier)
            template "$BENCH_DIR/peers/h3/pier-h3.toml" "$dir/pier.toml" "$PROXY_PORT" "$ORIGIN_PORT"
            "$PIER_BIN" serve -c "$dir/pier.toml" >"$dir/stdout.log" 2>&1 & ;;
        caddy)
            template "$BENCH_DIR/peers/h3/Caddyfile" "$dir/Caddyfile" "$PROXY_PORT" "$ORIGIN_PORT" "$dir/data"
            XDG_DATA_HOME="$dir/data" XDG_CONFIG_HOME="$dir/data" GOMAXPROCS="$WORKERS" \
                "$CADDY" run --config "$dir/Caddyfile" --adapter caddyfile >"$dir/stdout.log" 2>&1 & ;;
        *) die "unknown proxy $name (pier, caddy, pier-h2, caddy-h2)" ;;
    esac
    PROXY_PID=$!
    PIDS+=("$PROXY_PID")
    python3 "$BENCH_DIR/tool.py" wait-port "$PROXY_PORT" 15 --pid "$PROXY_PID" || {
        log "$name did not start"; tail -n 20 "$dir/stdout.log" >&2 2>/dev/null || true; return 1; }
    local why
    why="$(python3 "$BENCH_DIR/h3tool.py" check --h3load "$H3LOAD" --port "$PROXY_PORT" \
        --proto "$(proto_of "$name")" --cacert "$CA_FILE")" || {
        log "$name: check failed: $why"; tail -n 20 "$dir/stdout.log" >&2 2>/dev/null || true; return 1; }
}
stop_proxy() { [ -n "$PROXY_PID" ] || return 0; kill_tree "$PROXY_PID"; untrack "$PROXY_PID"; PROXY_PID=""; }

run_one() {   # run_one PROXY MODE PATH STREAMS REP
    local proxy="$1" mode="$2" path="$3" s="$4" rep="$5"
    start_proxy "$proxy" || { stop_proxy; return 0; }
    python3 "$BENCH_DIR/h3tool.py" load --proxy "$proxy" --proto "$(proto_of "$proxy")" --mode "$mode" \
        --out "$RESULTS" --h3load "$H3LOAD" --pid "$PROXY_PID" --port "$PROXY_PORT" \
        --origin-pid "$ORIGIN_PID" --origin-port "$ORIGIN_PORT" --path "$path" --streams "$s" \
        --conns "$CONNS" --duration "$DURATION" --warmup "$WARMUP" --rep "$rep" --cacert "$CA_FILE" \
        --log "$RUN/$proxy/stdout.log" || log "$proxy: h3load reported an error (see $RESULTS)"
    # The last error the proxy logged, if any, for the record (the log is kept, below).
    grep -iE '\b(error|panic)' "$RUN/$proxy/stdout.log" 2>/dev/null | tail -n 1 | cut -c1-300 | sed "s/^/    $proxy log: /" >&2 || true
    mkdir -p "$RUN/logs"   # start_proxy empties $RUN/$proxy: every run's log is kept here
    cp "$RUN/$proxy/stdout.log" "$RUN/logs/$proxy-rep$rep-$mode-${path//\//}-$s.log" 2>/dev/null || true
    stop_proxy
}

IFS=, read -ra PROXY_LIST <<<"$PROXIES"
IFS=, read -ra STREAM_LIST <<<"$STREAMS"
IFS=, read -ra PATH_LIST <<<"$PATHS"
for rep in $(seq 1 "$REPS"); do
    for path in "${PATH_LIST[@]}"; do
        [ -n "$path" ] || continue
        for s in "${STREAM_LIST[@]}"; do
            log "rep $rep/$REPS: $path, $s streams over $CONNS connections, ${DURATION}s, load $(cut -d' ' -f1 /proc/loadavg)"
            for proxy in "${PROXY_LIST[@]}"; do run_one "$proxy" keepalive "$path" "$s" "$rep"; done
        done
    done
    if [ -n "$NEWCONN" ]; then
        log "rep $rep/$REPS: a new connection per request, $NEWCONN clients, $NEWCONN_PATH, ${DURATION}s, load $(cut -d' ' -f1 /proc/loadavg)"
        for proxy in "${PROXY_LIST[@]}"; do run_one "$proxy" newconn "$NEWCONN_PATH" "$NEWCONN" "$rep"; done
    fi
done

python3 "$BENCH_DIR/h3tool.py" report "$RUN" | tee "$RUN/results.md"
log "report: $RUN/results.md"
