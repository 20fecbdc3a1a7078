#!/usr/bin/env bash
# Side-by-side benchmark: Pier vs nginx, HAProxy and OpenResty-style nginx + Lua, each in
# front of the same nginx origin, one proxy at a time. See bench/README.md.
#
#   bench/run.sh                                   # everything, default settings
#   PROXIES=nginx,haproxy DURATION=3 REPS=1 bench/run.sh
set -euo pipefail

BENCH_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$BENCH_DIR/.." && pwd)"

# ---- knobs (environment) ----------------------------------------------------------------
PROXIES="${PROXIES:-pier,nginx,haproxy,pier-lua,nginx-lua,pier-limit}"
DURATION="${DURATION:-10}"          # seconds per wrk run
CONNS="${CONNS-50,500}"             # wrk connection counts (empty: no load runs)
PATHS="${PATHS-/hello,/4k.bin}"     # request paths (origin: /hello, /4k.bin, /100k.bin; empty: none)
REPS="${REPS:-3}"                   # repetitions; proxies are interleaved within each
THREADS="${THREADS:-2}"             # wrk threads
IDLE_CONNS="${IDLE_CONNS:-10000}"   # idle keep-alive connections for the idle-RSS test (0 = skip)
PIER_BIN="${PIER_BIN:-$ROOT/target/dist/pier}"
PIER_BIN_B="${PIER_BIN_B:-}"        # a second build: proxy "pier-b" (same config as "pier"), e.g. before/after
PIER_LUA_CONFIG="${PIER_LUA_CONFIG:-$ROOT/examples/lua-access.toml}"
SKIP_INSTALL="${SKIP_INSTALL:-0}"   # 1 = never call apt-get
SKIP_BUILD="${SKIP_BUILD:-0}"       # 1 = use $PIER_BIN as is
PGO="${PGO:-0}"                     # 1 = build with bench/pgo.sh (profile-guided) and run that binary
OUT_DIR="${OUT_DIR:-$BENCH_DIR/out}"
TLS="${TLS:-0}"                     # 1 = the proxies serve HTTPS (pier, nginx, haproxy)
CERT_KIND="${CERT_KIND:-ecdsa}"     # TLS certificate: ecdsa (P-256) or rsa (2048)
HANDSHAKE_CONNS="${HANDSHAKE_CONNS-50}"  # TLS=1: connections of the new-connection-per-request runs (empty: none)
RESUME_CONNS="${RESUME_CONNS-50}"   # TLS=1: concurrent clients of the resumed-handshake runs (empty: none)
RESUME_TLS="${RESUME_TLS:-1.3}"     # TLS=1: versions for the resumed-handshake runs (1.3, 1.2 or 1.3,1.2)
RESUME_FULL="${RESUME_FULL:-1}"     # TLS=1: 1 = also the same client never resuming (control)
RESUME_N="${RESUME_N:-200000}"      # TLS=1: at most this many handshakes per resumed-handshake run
if [ "$TLS" = 1 ]; then
    PROXIES="${PROXIES_TLS:-pier,nginx,haproxy}"
    export BENCH_SCHEME=https
fi

log() { printf '[bench %s] %s\n' "$(date -u +%H:%M:%S)" "$*" >&2; }
die() { log "ERROR: $*"; exit 1; }

# ---- prerequisites ----------------------------------------------------------------------
install_missing() {
    local pkgs=()
    command -v nginx >/dev/null || pkgs+=(nginx)
    command -v haproxy >/dev/null || pkgs+=(haproxy)
    command -v wrk >/dev/null || pkgs+=(wrk)
    command -v ps >/dev/null || pkgs+=(procps)
    command -v ss >/dev/null || pkgs+=(iproute2)
    [ -e /usr/lib/nginx/modules/ngx_http_lua_module.so ] || pkgs+=(libnginx-mod-http-lua)
    [ -e /usr/share/lua/5.1/resty/core.lua ] || pkgs+=(lua-resty-core)
    command -v python3 >/dev/null || pkgs+=(python3)
    if [ "${#pkgs[@]}" -gt 0 ]; then
        [ "$SKIP_INSTALL" = 1 ] && die "missing packages: ${pkgs[*]} (SKIP_INSTALL=1)"
        log "installing: ${pkgs[*]}"
        export DEBIAN_FRONTEND=noninteractive
        apt-get update -qq
        apt-get install -y -qq --no-install-recommends "${pkgs[@]}" >/dev/null
    fi
    # The Debian packages enable a system nginx on port 80; it is not ours, leave it alone.
}

has_proxy() { [[ ",$PROXIES," == *",$1,"* ]]; }
drop_proxy() {
    local p out=()
    IFS=, read -ra list <<<"$PROXIES"
    for p in "${list[@]}"; do [ "$p" = "$1" ] || out+=("$p"); done
    PROXIES="$(IFS=,; echo "${out[*]}")"
}

SKIPPED=()   # "proxy: reason" lines, copied into the report

build_pier() {
    has_proxy pier || has_proxy pier-lua || has_proxy pier-limit || has_proxy pier-noanalytics || return 0
    if [ "$SKIP_BUILD" != 1 ] && [ "$PGO" = 1 ]; then
        # The profile-guided build (bench/pgo.sh): it trains on this script's workloads.
        log "building pier with PGO: bench/pgo.sh"
        if ! (cd "$ROOT" && nice -n 10 bash "$BENCH_DIR/pgo.sh") >"$RUN/cargo-build.log" 2>&1; then
            tail -n 20 "$RUN/cargo-build.log" >&2
            die "bench/pgo.sh failed (log: $RUN/cargo-build.log)"
        fi
        PIER_BIN="$ROOT/target/pgo-use/dist/pier"
    elif [ "$SKIP_BUILD" != 1 ]; then
        log "building pier: cargo build --profile dist -p pier"
        if ! (cd "$ROOT" && nice -n 10 cargo build --profile dist -p pier) >"$RUN/cargo-build.log" 2>&1; then
            tail -n 20 "$RUN/cargo-build.log" >&2
            log "Pier does NOT build yet (cargo build --profile dist -p pier failed; log: $RUN/cargo-build.log)."
            log "Skipping the pier and pier-lua scenarios; the peers are still measured."
            SKIPPED+=("pier, pier-lua: \`cargo build --profile dist -p pier\` failed (binary not ready)")
            drop_proxy pier; drop_proxy pier-lua; drop_proxy pier-limit; drop_proxy pier-noanalytics
            return 0
        fi
    fi
    if [ ! -x "$PIER_BIN" ]; then
        log "no Pier binary at $PIER_BIN; skipping pier and pier-lua"
        SKIPPED+=("pier, pier-lua: no binary at $PIER_BIN")
        drop_proxy pier; drop_proxy pier-lua; drop_proxy pier-limit; drop_proxy pier-noanalytics
        return 0
    fi
    if has_proxy pier-b && [ ! -x "$PIER_BIN_B" ]; then
        log "pier-b: no binary at PIER_BIN_B='$PIER_BIN_B'; skipping it"
        SKIPPED+=("pier-b: no binary at PIER_BIN_B='$PIER_BIN_B'")
        drop_proxy pier-b
    fi
    if has_proxy pier-lua && [ ! -f "$PIER_LUA_CONFIG" ]; then
        log "pier-lua: $PIER_LUA_CONFIG does not exist yet (Lua hooks not landed); skipping it"
        SKIPPED+=("pier-lua: $(basename "$PIER_LUA_CONFIG") does not exist yet")
        drop_proxy pier-lua
    fi
}

# ---- process bookkeeping ----------------------------------------------------------------
PIDS=()        # every process tree root this script started
ORIGIN_PID=""
PROXY_PID=""
PROXY_PORT=""

source "$BENCH_DIR/procs.sh"   # kill_tree, cleanup (at exit), untrack

template() {   # template SRC DST PORT
    sed -e "s/@PORT@/$3/g" -e "s/@ORIGIN@/${ORIGIN_PORT:-0}/g" \
        -e "s|@CERT@|${CERT_FILE:-}|g" -e "s|@KEY@|${KEY_FILE:-}|g" -e "s|@PEM@|${PEM_FILE:-}|g" \
        "$1" >"$2"
}

# TLS=1: a bench CA and a leaf certificate for 127.0.0.1/localhost, made now (never committed).
make_certs() {
    local d="$RUN/certs"
    mkdir -p "$d"; chmod 755 "$d"
    openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -days 2 \
        -subj /CN=pier-bench-ca -keyout "$d/ca.key" -out "$d/ca.pem" 2>/dev/null
    case "$CERT_KIND" in
        rsa) openssl req -newkey rsa:2048 -nodes -subj /CN=localhost -keyout "$d/leaf.key" -out "$d/leaf.csr" 2>/dev/null ;;
        *)   openssl req -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -subj /CN=localhost \
                 -keyout "$d/leaf.key" -out "$d/leaf.csr" 2>/dev/null ;;
    esac
    printf 'subjectAltName=DNS:localhost,IP:127.0.0.1\nbasicConstraints=CA:FALSE\n' >"$d/ext.cnf"
    openssl x509 -req -in "$d/leaf.csr" -CA "$d/ca.pem" -CAkey "$d/ca.key" -CAcreateserial \
        -days 2 -extfile "$d/ext.cnf" -out "$d/leaf.pem" 2>/dev/null
    cat "$d/leaf.pem" "$d/leaf.key" >"$d/combined.pem"
    chmod 644 "$d"/*
    CERT_FILE="$d/leaf.pem"; KEY_FILE="$d/leaf.key"; PEM_FILE="$d/combined.pem"
    log "TLS: $CERT_KIND certificate in $d"
}

# The config a proxy runs from (TLS variants when TLS=1).
peer_conf() {   # peer_conf DIR FILE
    if [ "$TLS" = 1 ]; then
        case "$2" in
            nginx.conf) echo "$BENCH_DIR/peers/$1/nginx-tls.conf" ;;
            haproxy.cfg) echo "$BENCH_DIR/peers/$1/haproxy-tls.cfg" ;;
            pier.toml) echo "$BENCH_DIR/peers/$1/pier-tls.toml" ;;
        esac
    else
        echo "$BENCH_DIR/peers/$1/$2"
    fi
}

prep_nginx_dir() {   # fresh prefix dir for one nginx instance
    rm -rf "$1"; mkdir -p "$1/logs/tmp"; chmod -R 755 "$1"
}

# start_proxy NAME: sets PROXY_PID and PROXY_PORT, returns 1 (with a message) on failure
start_proxy() {
    local name="$1" dir="$RUN/$1" port
    port="$(python3 "$BENCH_DIR/tool.py" port)"
    PROXY_PORT="$port"
    case "$name" in
        nginx|nginx-lua)
            local src="nginx-proxy"; [ "$name" = nginx-lua ] && src="nginx-lua"
            prep_nginx_dir "$dir"
            template "$(peer_conf "$src" nginx.conf)" "$dir/nginx.conf" "$port"
            nginx -p "$dir/" -c nginx.conf -e "$dir/logs/error.log" >"$dir/stdout.log" 2>&1 &
            ;;
        haproxy)
            rm -rf "$dir"; mkdir -p "$dir"
            template "$(peer_conf haproxy haproxy.cfg)" "$dir/haproxy.cfg" "$port"
            haproxy -db -f "$dir/haproxy.cfg" >"$dir/stdout.log" 2>&1 &
            ;;
        pier)
            rm -rf "$dir"; mkdir -p "$dir"
            template "$(peer_conf pier pier.toml)" "$dir/pier.toml" "$port"
            "$PIER_BIN" serve -c "$dir/pier.toml" >"$dir/stdout.log" 2>&1 &
            ;;
        pier-b)
            # The plain Pier config run by a second build (PIER_BIN_B): two builds, one run.
            rm -rf "$dir"; mkdir -p "$dir"
            template "$(peer_conf pier pier.toml)" "$dir/pier.toml" "$port"
            "$PIER_BIN_B" serve -c "$dir/pier.toml" >"$dir/stdout.log" 2>&1 &
            ;;
        pier-uring|pier-epoll)
            # The plain Pier config with its clients on each worker's
            # io_uring ([server] io_uring, the default since issue 34) or on
            # epoll, whatever the build's default: the pair measures the ring.
            rm -rf "$dir"; mkdir -p "$dir"
            template "$(peer_conf pier pier.toml)" "$dir/pier.toml" "$port"
            PIER_IO_URING="$([ "$name" = pier-uring ] && echo 1 || echo 0)" \
                "$PIER_BIN" serve -c "$dir/pier.toml" >"$dir/stdout.log" 2>&1 &
            ;;
        pier-lua)
            rm -rf "$dir"; mkdir -p "$dir"
            python3 "$BENCH_DIR/tool.py" pier-config "$PIER_LUA_CONFIG" "$dir/pier.toml"
            # The example's ${PIER_*:-...} defaults are fixed ports: override all of them.
            PIER_LISTEN="127.0.0.1:$port" PIER_ORIGIN="127.0.0.1:$ORIGIN_PORT" \
                PIER_ADMIN="127.0.0.1:$(python3 "$BENCH_DIR/tool.py" port)" \
                "$PIER_BIN" serve -c "$dir/pier.toml" >"$dir/stdout.log" 2>&1 &
            ;;
        pier-limit)
            # The plain Pier config plus a [[limit]] checked on every request
            # (per client IP, set high enough never to refuse): its cost alone.
            rm -rf "$dir"; mkdir -p "$dir"
            template "$BENCH_DIR/peers/pier/pier.toml" "$dir/pier.toml" "$port"
            cat "$BENCH_DIR/peers/pier/limit.toml" >>"$dir/pier.toml"
            "$PIER_BIN" serve -c "$dir/pier.toml" >"$dir/stdout.log" 2>&1 &
            ;;
        pier-noanalytics)
            # The plain Pier config with the built-in analytics (on by
            # default, in "pier") turned off: the pair measures its cost.
            rm -rf "$dir"; mkdir -p "$dir"
            template "$BENCH_DIR/peers/pier/pier.toml" "$dir/pier.toml" "$port"
            printf '\n[analytics]\nenabled = false\n' >>"$dir/pier.toml"
            "$PIER_BIN" serve -c "$dir/pier.toml" >"$dir/stdout.log" 2>&1 &
            ;;
        *) die "unknown proxy '$name' (known: pier, pier-b, pier-uring, pier-epoll, nginx, haproxy, pier-lua, nginx-lua, pier-limit, pier-noanalytics)" ;;
    esac
    PROXY_PID=$!
    PIDS+=("$PROXY_PID")
    if ! python3 "$BENCH_DIR/tool.py" wait-port "$port" 15 --pid "$PROXY_PID" || ! kill -0 "$PROXY_PID" 2>/dev/null; then
        log "$name did not start listening on 127.0.0.1:$port; its output:"
        tail -n 20 "$dir/stdout.log" "$dir/logs/error.log" >&2 2>/dev/null || true
        echo >&2
        stop_proxy
        return 1
    fi
    local lua=""; [[ "$name" == *-lua ]] && lua="--lua"
    local why
    if ! why="$(python3 "$BENCH_DIR/tool.py" check "$port" $lua 2>&1)"; then
        log "$name failed its sanity check: $why"
        stop_proxy
        return 1
    fi
    if [ "$name" = nginx-lua ] && ! grep -q 'RESTYCORE_CHECK resty.core loaded=true' "$dir/logs/error.log"; then
        log "nginx-lua: lua-resty-core is not loaded (see $dir/logs/error.log)"
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

mkdir -p "$OUT_DIR"
chmod 755 "$OUT_DIR"
RUN="$OUT_DIR/run-$(date -u +%Y%m%dT%H%M%SZ)"
mkdir -p "$RUN"; chmod 755 "$RUN"
RESULTS="$RUN/results.jsonl"
: >"$RESULTS"
log "run directory: $RUN"
[ "$TLS" = 1 ] && make_certs

# 10,000 idle client connections (plus the proxy's own) need more than the default 1024.
ulimit -n 20000 2>/dev/null || ulimit -n "$(ulimit -Hn)"
log "open files limit: $(ulimit -n)"

build_pier
[ -n "$PROXIES" ] || die "nothing to benchmark (PROXIES is empty after skips)"
IFS=, read -ra PROXY_LIST <<<"$PROXIES"
IFS=, read -ra CONN_LIST <<<"$CONNS"
IFS=, read -ra PATH_LIST <<<"$PATHS"

# Origin: nginx, started once and shared by every proxy run.
ORIGIN_PORT="$(python3 "$BENCH_DIR/tool.py" port)"
prep_nginx_dir "$RUN/origin"
mkdir -p "$RUN/origin/html"
printf 'hello world\n' >"$RUN/origin/html/hello.txt"
head -c 4096 /dev/urandom >"$RUN/origin/html/4k.bin"
head -c 102400 /dev/urandom >"$RUN/origin/html/100k.bin"
chmod -R 755 "$RUN/origin"
template "$BENCH_DIR/peers/origin/nginx.conf" "$RUN/origin/nginx.conf" "$ORIGIN_PORT"
nginx -p "$RUN/origin/" -c nginx.conf -e "$RUN/origin/logs/error.log" >"$RUN/origin/stdout.log" 2>&1 &
ORIGIN_PID=$!
PIDS+=("$ORIGIN_PID")
python3 "$BENCH_DIR/tool.py" wait-port "$ORIGIN_PORT" 15 || {
    cat "$RUN/origin/logs/error.log" >&2 || true; die "origin did not start"; }
log "origin: nginx pid $ORIGIN_PID on 127.0.0.1:$ORIGIN_PORT"

cat >"$RUN/settings.json" <<EOF
{"proxies": "$PROXIES", "duration": $DURATION, "conns": "$CONNS", "paths": "$PATHS",
 "reps": $REPS, "threads": $THREADS, "idle_conns": $IDLE_CONNS,
 "tls": $TLS, "cert": "$CERT_KIND", "handshake_conns": "$HANDSHAKE_CONNS",
 "resume_conns": "$RESUME_CONNS", "resume_tls": "$RESUME_TLS", "resume_full": "$RESUME_FULL",
 "date": "$(date -u +%Y-%m-%dT%H:%M:%SZ)", "nproc": $(nproc),
 "kernel": "$(uname -r)",
 "nginx": "$(nginx -v 2>&1 | sed 's/.*nginx\///')",
 "haproxy": "$(haproxy -v | head -1 | awk '{print $3}')",
 "pier": "$( [ -x "$PIER_BIN" ] && "$PIER_BIN" --version 2>/dev/null | head -1 || echo n/a)",
 "pier_b": "$( [ -n "$PIER_BIN_B" ] && [ -x "$PIER_BIN_B" ] && "$PIER_BIN_B" --version 2>/dev/null | head -1 || echo n/a)",
 "pier_commit": "$(cd "$ROOT" && git rev-parse --short HEAD 2>/dev/null || echo none)"}
EOF
for s in "${SKIPPED[@]:-}"; do [ -n "$s" ] && echo "$s"; done >"$RUN/skipped.txt" || true

FAILED_STARTS=0
for rep in $(seq 1 "$REPS"); do
    for path in "${PATH_LIST[@]}"; do
        for c in "${CONN_LIST[@]}"; do
            log "rep $rep/$REPS: $path, $c connections, ${DURATION}s each"
            for proxy in "${PROXY_LIST[@]}"; do
                if ! start_proxy "$proxy"; then
                    FAILED_STARTS=$((FAILED_STARTS + 1))
                    echo "{\"kind\":\"failed\",\"proxy\":\"$proxy\",\"path\":\"$path\",\"conns\":$c,\"rep\":$rep}" >>"$RESULTS"
                    continue
                fi
                python3 "$BENCH_DIR/tool.py" measure --proxy "$proxy" --path "$path" \
                    --out "$RESULTS" --pid "$PROXY_PID" --port "$PROXY_PORT" \
                    --origin-pid "$ORIGIN_PID" --origin-port "$ORIGIN_PORT" --conns "$c" \
                    --duration "$DURATION" --threads "$THREADS" --rep "$rep" \
                    || log "$proxy: wrk run reported an error (kept in $RESULTS)"
                stop_proxy
            done
        done
    done
    if [ "$TLS" = 1 ] && [ -n "$HANDSHAKE_CONNS" ]; then
        log "rep $rep/$REPS: a full TLS handshake per request ($CERT_KIND), $HANDSHAKE_CONNS connections"
        for proxy in "${PROXY_LIST[@]}"; do
            start_proxy "$proxy" || { FAILED_STARTS=$((FAILED_STARTS + 1)); continue; }
            python3 "$BENCH_DIR/tool.py" measure --proxy "$proxy" --path /hello --close \
                --out "$RESULTS" --pid "$PROXY_PID" --port "$PROXY_PORT" \
                --origin-pid "$ORIGIN_PID" --origin-port "$ORIGIN_PORT" --conns "$HANDSHAKE_CONNS" \
                --duration "$DURATION" --threads "$THREADS" --rep "$rep" \
                || log "$proxy: handshake run reported an error (kept in $RESULTS)"
            stop_proxy
        done
    fi
    if [ "$TLS" = 1 ] && [ -n "$RESUME_CONNS" ]; then
        IFS=, read -ra RESUME_TLS_LIST <<<"$RESUME_TLS"
        for v in "${RESUME_TLS_LIST[@]}"; do
            modes=(""); [ "$RESUME_FULL" = 1 ] && modes+=(--full)
            for mode in "${modes[@]}"; do
                log "rep $rep/$REPS: TLS $v handshake per request, ${mode:+never }resuming, $RESUME_CONNS clients"
                for proxy in "${PROXY_LIST[@]}"; do
                    start_proxy "$proxy" || { FAILED_STARTS=$((FAILED_STARTS + 1)); continue; }
                    python3 "$BENCH_DIR/tool.py" resume --proxy "$proxy" --out "$RESULTS" \
                        --pid "$PROXY_PID" --port "$PROXY_PORT" --origin-pid "$ORIGIN_PID" \
                        --origin-port "$ORIGIN_PORT" --conns "$RESUME_CONNS" --duration "$DURATION" \
                        --n "$RESUME_N" --tls "$v" $mode --rep "$rep" \
                        || log "$proxy: resumed-handshake run reported an error (kept in $RESULTS)"
                    stop_proxy
                done
            done
        done
    fi
    if [ "$IDLE_CONNS" -gt 0 ]; then
        log "rep $rep/$REPS: RSS with $IDLE_CONNS idle keep-alive connections"
        for proxy in "${PROXY_LIST[@]}"; do
            if ! start_proxy "$proxy"; then
                FAILED_STARTS=$((FAILED_STARTS + 1))
                continue
            fi
            python3 "$BENCH_DIR/tool.py" idle --proxy "$proxy" --out "$RESULTS" \
                --pid "$PROXY_PID" --port "$PROXY_PORT" --n "$IDLE_CONNS" --rep "$rep" \
                || log "$proxy: idle-connection test failed"
            stop_proxy
        done
    fi
done

python3 "$BENCH_DIR/report.py" "$RUN" | tee "$RUN/results.md"
cp "$RUN/results.md" "$OUT_DIR/results.md"
cp "$RESULTS" "$OUT_DIR/results.jsonl"
log "report: $OUT_DIR/results.md (raw: $RESULTS)"
[ "$FAILED_STARTS" -eq 0 ] || log "WARNING: $FAILED_STARTS proxy start(s) failed; see the logs under $RUN"
