#!/usr/bin/env bash
# The HTTP cache, side by side (issue 11): Pier vs Varnish 7 and nginx proxy_cache, each in
# front of the same nginx origin (every response max-age=3600), one proxy at a time, per
# proxy CPU-second (bench/tool.py measure: the proxy's utime+stime over its process tree).
#
#   bench/cache.sh                                  # every part, defaults below
#   PARTS=hits REPS=1 DURATION=3 bench/cache.sh     # a quick look at the hit path
#
# Parts (PARTS, comma separated):
#   hits       cache hits for PATHS at CONNS connections: pier, varnish, nginx (warmed first)
#   miss       every request a distinct URL (wrk script peers/cache/miss.lua): pier with the
#              cache on vs pier-plain (no [route.cache]): the cost of lookup + fill + store
#   transient  disk bytes written over a Zipf workload with many one-hit wonders: pier with
#              promote_hits = 2 (transient admission) vs promote_hits = 0 (write every miss)
#   rss        RSS of pier with its 1 GiB memory tier full (1.3 GiB of distinct 1 MiB objects)
set -euo pipefail

BENCH_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$BENCH_DIR/.." && pwd)"
PEERS="$BENCH_DIR/peers/cache"

# ---- knobs (environment) ----------------------------------------------------------------
PARTS="${PARTS:-hits,miss,transient,rss}"
PROXIES="${PROXIES:-pier,varnish,nginx}"
DURATION="${DURATION:-5}"
CONNS="${CONNS-50,500}"
PATHS="${PATHS-/hello,/4k.bin,/1m.bin}"
REPS="${REPS:-3}"
THREADS="${THREADS:-2}"
MISS_PATH="${MISS_PATH:-/4k.bin}"
# The miss part's memory tier: small enough to be full and evicting within a second, as a
# production cache is (a 1 GiB tier would still be growing, and page-faulting, for the
# whole run).
MISS_MEMORY="${MISS_MEMORY:-64m}"
# Who runs the miss part: each proxy with its cache and without (X-plain). The peers show what
# storing every miss costs them: MISS_PROXIES=pier,pier-plain,nginx,nginx-plain,varnish,varnish-plain
MISS_PROXIES="${MISS_PROXIES:-pier,pier-plain}"
ZIPF_REQUESTS="${ZIPF_REQUESTS:-40000}"
ZIPF_KEYS="${ZIPF_KEYS:-200000}"
ZIPF_S="${ZIPF_S:-0.9}"
PIER_BIN="${PIER_BIN:-$ROOT/target/dist/pier}"
# A second build to compare in the same interleaved run: proxy "pier-b" (cache on), e.g.
# PIER_BIN_B=<before> PARTS=miss MISS_PROXIES=pier,pier-b,pier-plain (and "pier-plain-b", that build
# without its cache).
PIER_BIN_B="${PIER_BIN_B:-}"
SKIP_INSTALL="${SKIP_INSTALL:-0}"
SKIP_BUILD="${SKIP_BUILD:-0}"
OUT_DIR="${OUT_DIR:-$BENCH_DIR/out}"

log() { printf '[cache %s] %s\n' "$(date -u +%H:%M:%S)" "$*" >&2; }
die() { log "ERROR: $*"; exit 1; }
has() { [[ ",$2," == *",$1,"* ]]; }

install_missing() {
    local pkgs=()
    command -v nginx >/dev/null || pkgs+=(nginx)
    command -v varnishd >/dev/null || [ -x /usr/sbin/varnishd ] || pkgs+=(varnish)
    command -v wrk >/dev/null || pkgs+=(wrk)
    command -v python3 >/dev/null || pkgs+=(python3)
    if [ "${#pkgs[@]}" -gt 0 ]; then
        [ "$SKIP_INSTALL" = 1 ] && die "missing packages: ${pkgs[*]} (SKIP_INSTALL=1)"
        log "installing: ${pkgs[*]}"
        export DEBIAN_FRONTEND=noninteractive
        apt-get update -qq
        apt-get install -y -qq --no-install-recommends "${pkgs[@]}" >/dev/null
    fi
}
VARNISHD="$(command -v varnishd || echo /usr/sbin/varnishd)"

PIDS=()
ORIGIN_PID=""
PROXY_PID=""
PROXY_PORT=""
ADMIN_PORT=""

source "$BENCH_DIR/procs.sh"   # kill_tree, cleanup (at exit), untrack
template() {   # template SRC DST PORT [DIR]
    sed -e "s/@PORT@/$3/g" -e "s/@ORIGIN@/$ORIGIN_PORT/g" -e "s|@DIR@|${4:-}|g" "$1" >"$2"
}

# start_proxy NAME [EXTRA_TOML]: pier, pier-plain, pier-disk, varnish, nginx
start_proxy() {
    local name="$1" extra="${2:-}" dir="$RUN/$1" port
    port="$(python3 "$BENCH_DIR/tool.py" port)"
    PROXY_PORT="$port"
    ADMIN_PORT=""
    rm -rf "$dir"; mkdir -p "$dir/logs/tmp"; chmod -R 755 "$dir"
    case "$name" in
        pier|pier-plain|pier-disk|pier-b|pier-plain-b)
            template "$PEERS/pier.toml" "$dir/pier.toml" "$port"
            if [ "$name" = pier-plain ] || [ "$name" = pier-plain-b ]; then
                sed -i -e '/^\[route.cache\]/d' -e '/^zone = "main"/d' "$dir/pier.toml"
            fi
            [ -n "${MEMORY:-}" ] && sed -i -e "s/^memory = .*/memory = \"$MEMORY\"/" "$dir/pier.toml"
            # Extra keys go under [cache.main], the file's last table; then [admin].
            [ -n "$extra" ] && printf '%s\n' "$extra" >>"$dir/pier.toml"
            ADMIN_PORT="$(python3 "$BENCH_DIR/tool.py" port)"
            printf '\n[admin]\nlisten = "127.0.0.1:%s"\n' "$ADMIN_PORT" >>"$dir/pier.toml"
            local bin="$PIER_BIN"
            case "$name" in pier-b|pier-plain-b) bin="${PIER_BIN_B:?$name needs PIER_BIN_B}" ;; esac
            "$bin" serve -c "$dir/pier.toml" >"$dir/stdout.log" 2>&1 &
            ;;
        varnish|varnish-plain)
            template "$PEERS/varnish.vcl" "$dir/default.vcl" "$port"
            # The plain baseline: every request passed to the origin, nothing stored.
            [ "$name" = varnish-plain ] && printf 'sub vcl_recv { return (pass); }\n' >>"$dir/default.vcl"
            "$VARNISHD" -F -j none -n "$dir/varnish" -a "127.0.0.1:$port" -f "$dir/default.vcl" \
                -s "malloc,${MEMORY:-1g}" -p thread_pools=2 -p thread_pool_min=50 -p thread_pool_max=1000 \
                >"$dir/stdout.log" 2>&1 &
            ;;
        nginx|nginx-plain)
            template "$PEERS/nginx.conf" "$dir/nginx.conf" "$port" "$dir"
            [ "$name" = nginx-plain ] && sed -i -e 's/proxy_cache c;/proxy_cache off;/' "$dir/nginx.conf"
            [ -n "${MEMORY:-}" ] && sed -i -e "s/max_size=2g/max_size=$MEMORY/" "$dir/nginx.conf"
            nginx -p "$dir/" -c nginx.conf -e "$dir/logs/error.log" >"$dir/stdout.log" 2>&1 &
            ;;
        *) die "unknown proxy '$name'" ;;
    esac
    PROXY_PID=$!
    PIDS+=("$PROXY_PID")
    if ! python3 "$BENCH_DIR/tool.py" wait-port "$port" 20 --pid "$PROXY_PID" || ! kill -0 "$PROXY_PID" 2>/dev/null; then
        log "$name did not start on 127.0.0.1:$port:"
        tail -n 20 "$dir/stdout.log" "$dir/logs/error.log" >&2 2>/dev/null || true
        stop_proxy
        return 1
    fi
    local why
    if ! why="$(python3 "$BENCH_DIR/tool.py" check "$port" 2>&1)"; then
        log "$name failed its sanity check: $why"
        stop_proxy
        return 1
    fi
}
stop_proxy() {
    [ -n "$PROXY_PID" ] || return 0
    kill_tree "$PROXY_PID"
    untrack "$PROXY_PID"
    PROXY_PID=""
}

measure() {   # measure PROXY PATH CONNS REP [SCRIPT]
    local script=()
    [ -n "${5:-}" ] && script=(--script "$5")
    python3 "$BENCH_DIR/tool.py" measure --proxy "$1" --path "$2" --out "$RESULTS" \
        --pid "$PROXY_PID" --port "$PROXY_PORT" --origin-pid "$ORIGIN_PID" \
        --origin-port "$ORIGIN_PORT" --conns "$3" --duration "$DURATION" --threads "$THREADS" \
        --rep "$4" "${script[@]}" || log "$1: wrk reported an error (kept in $RESULTS)"
}

# ---- setup ------------------------------------------------------------------------------
install_missing
if [ "$SKIP_BUILD" != 1 ]; then
    log "building pier: cargo build --profile dist -p pier"
    (cd "$ROOT" && nice -n 10 cargo build --profile dist -p pier) >/dev/null 2>&1 \
        || die "cargo build --profile dist -p pier failed"
fi
[ -x "$PIER_BIN" ] || die "no Pier binary at $PIER_BIN"

mkdir -p "$OUT_DIR"
RUN="$OUT_DIR/cache-$(date -u +%Y%m%dT%H%M%SZ)"
mkdir -p "$RUN"; chmod 755 "$RUN"
RESULTS="$RUN/results.jsonl"
: >"$RESULTS"
log "run directory: $RUN"
ulimit -n 20000 2>/dev/null || ulimit -n "$(ulimit -Hn)"

ORIGIN_PORT="$(python3 "$BENCH_DIR/tool.py" port)"
mkdir -p "$RUN/origin/logs/tmp" "$RUN/origin/html"
head -c 4096 /dev/urandom >"$RUN/origin/html/4k.bin"
head -c 1048576 /dev/urandom >"$RUN/origin/html/1m.bin"
chmod -R 755 "$RUN/origin"
template "$PEERS/origin.conf" "$RUN/origin/nginx.conf" "$ORIGIN_PORT"
nginx -p "$RUN/origin/" -c nginx.conf -e "$RUN/origin/logs/error.log" >"$RUN/origin/stdout.log" 2>&1 &
ORIGIN_PID=$!
PIDS+=("$ORIGIN_PID")
python3 "$BENCH_DIR/tool.py" wait-port "$ORIGIN_PORT" 15 || die "origin did not start"
log "origin: nginx on 127.0.0.1:$ORIGIN_PORT; load average $(cut -d' ' -f1-3 /proc/loadavg)"
{
    echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ), nproc $(nproc), kernel $(uname -r)"
    echo "nginx $(nginx -v 2>&1 | sed 's/.*nginx\///'), $("$VARNISHD" -V 2>&1 | head -1)"
    echo "pier $(cd "$ROOT" && git rev-parse --short HEAD 2>/dev/null) (+ working tree)"
    echo "parts=$PARTS proxies=$PROXIES duration=$DURATION conns=$CONNS paths=$PATHS reps=$REPS"
} >"$RUN/settings.txt"

IFS=, read -ra PROXY_LIST <<<"$PROXIES"
IFS=, read -ra CONN_LIST <<<"$CONNS"
IFS=, read -ra PATH_LIST <<<"$PATHS"
IFS=, read -ra MISS_PROXY_LIST <<<"$MISS_PROXIES"

# ---- hits ---------------------------------------------------------------------------------
if has hits "$PARTS"; then
    for rep in $(seq 1 "$REPS"); do
        for path in "${PATH_LIST[@]}"; do
            for c in "${CONN_LIST[@]}"; do
                log "hits rep $rep/$REPS: $path, $c connections (load $(cut -d' ' -f1 /proc/loadavg))"
                for proxy in "${PROXY_LIST[@]}"; do
                    start_proxy "$proxy" || continue
                    # Warm: the object is stored, then hit once.
                    curl -s -o /dev/null "http://127.0.0.1:$PROXY_PORT$path"
                    curl -s -o /dev/null "http://127.0.0.1:$PROXY_PORT$path"
                    measure "$proxy" "$path" "$c" "$rep"
                    stop_proxy
                done
            done
        done
    done
    log "hits: requests per proxy CPU-second (median of $REPS, min–max)"
    python3 "$BENCH_DIR/cache_tool.py" table "$RESULTS" | tee "$RUN/hits.md"
fi

# ---- miss path ----------------------------------------------------------------------------
if has miss "$PARTS"; then
    MRESULTS="$RUN/miss.jsonl"; : >"$MRESULTS"
    for rep in $(seq 1 "$REPS"); do
        for c in "${CONN_LIST[@]}"; do
            log "miss rep $rep/$REPS: $MISS_PATH?m=<unique>, $c connections"
            for proxy in "${MISS_PROXY_LIST[@]}"; do
                MEMORY="$MISS_MEMORY" start_proxy "$proxy" || continue
                RESULTS_SAVE="$RESULTS"; RESULTS="$MRESULTS"
                measure "$proxy" "$MISS_PATH" "$c" "$rep" "$PEERS/miss.lua"
                RESULTS="$RESULTS_SAVE"
                stop_proxy
            done
        done
    done
    log "miss path: each proxy with its cache on (every request a miss) vs plain (X-plain)"
    python3 "$BENCH_DIR/cache_tool.py" table "$MRESULTS" | tee "$RUN/miss.md"
fi

# ---- transient tier -----------------------------------------------------------------------
if has transient "$PARTS"; then
    : >"$RUN/transient.jsonl"
    for promote in 2 0; do
        extra="$(printf 'disk_dir = "%s"\ndisk = "4g"\npromote_hits = %s\ndisk_min_ttl = "1m"\ndisk_queue = 4096' \
            "$RUN/disk-$promote" "$promote")"
        start_proxy pier-disk "$extra" || continue
        log "transient: promote_hits=$promote, $ZIPF_REQUESTS requests over $ZIPF_KEYS keys (zipf s=$ZIPF_S)"
        python3 "$BENCH_DIR/cache_tool.py" zipf --port "$PROXY_PORT" --admin "$ADMIN_PORT" \
            --requests "$ZIPF_REQUESTS" --keys "$ZIPF_KEYS" --s "$ZIPF_S" --seed 11 \
            --label "promote_hits=$promote" | tee -a "$RUN/transient.jsonl"
        du -sb "$RUN/disk-$promote" | tee -a "$RUN/transient.du"
        stop_proxy
    done
fi

# ---- RSS with the memory tier full --------------------------------------------------------
if has rss "$PARTS"; then
    start_proxy pier
    base="$(python3 "$BENCH_DIR/tool.py" stat "$PROXY_PID")"
    log "rss: filling the 1 GiB memory tier with 1300 distinct 1 MiB objects"
    python3 "$BENCH_DIR/cache_tool.py" fill --port "$PROXY_PORT" --n 1300 --path /1m.bin
    # A second pass over other keys: eviction churn at full size.
    python3 "$BENCH_DIR/cache_tool.py" fill --port "$PROXY_PORT" --n 1300 --path /1m.bin?second
    after="$(python3 "$BENCH_DIR/tool.py" stat "$PROXY_PID")"
    m="$(curl -s "http://127.0.0.1:$ADMIN_PORT/metrics" | grep -E '^pier_cache_(bytes|objects|evictions_total)\{zone="main",tier="memory"\}')"
    printf 'before: %s\nafter: %s\n%s\n' "$base" "$after" "$m" | tee "$RUN/rss.txt"
    stop_proxy
fi
log "done: $RUN"
