#!/usr/bin/env bash
# Compression with the cache (issue 11 item 7): the cost of a cache hit per client kind, in
# requests per Pier CPU-second (utime+stime of the pier process, /proc), wrk on loopback.
# One route stores a gzip copy ([route.compress] store = "gzip"); a second route caches
# without compression (the baseline). Scenarios, each a hit of a 16 KiB HTML page:
#   plain     route without compression, identity stored and sent
#   gzip      the stored gzip copy sent as it is (Accept-Encoding: gzip)
#   identity  the gzip copy decoded for a client without Accept-Encoding
#   br        the gzip copy decoded and re-encoded in brotli (Accept-Encoding: br)
#
#   bench/compress.sh                      # DURATION=5 REPS=3 CONNS=50
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PIER_BIN="${PIER_BIN:-$ROOT/target/dist/pier}"
DURATION="${DURATION:-5}"; REPS="${REPS:-3}"; CONNS="${CONNS:-50}"
[ -x "$PIER_BIN" ] || (cd "$ROOT" && cargo build --profile dist -p pier)
DIR="$(mktemp -d)"; PIDS=()
cleanup() { for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done; rm -rf "$DIR"; }
trap cleanup EXIT
free_port() { python3 -c 'import socket;s=socket.socket();s.bind(("127.0.0.1",0));print(s.getsockname()[1])'; }

mkdir -p "$DIR/www/c" "$DIR/www/p"
python3 - "$DIR/www" <<'PY'
import sys
page = "<html><body>\n" + "".join(f"<p>row {i}: some text that compresses like real pages do</p>\n" for i in range(300))
page = page[:16384]
for d in ("c", "p"):
    open(f"{sys.argv[1]}/{d}/page.html", "w").write(page)
PY
OPORT=$(free_port); PPORT=$(free_port); APORT=$(free_port)
(cd "$DIR/www" && exec python3 -m http.server "$OPORT" --bind 127.0.0.1 >/dev/null 2>&1) & PIDS+=($!)
cat > "$DIR/pier.toml" <<TOML
[server]
workers = 1
[admin]
listen = "127.0.0.1:$APORT"
[log]
access = "off"
[cache.main]
memory = "64m"
[[listener]]
name = "main"
listen = "127.0.0.1:$PPORT"
[[route]]
name = "compressed"
path = "/c/"
upstream = "app"
[route.cache]
zone = "main"
ttl = { "200" = "1h" }
[route.compress]
store = "gzip"
[[route]]
name = "plain"
upstream = "app"
[route.cache]
zone = "main"
ttl = { "200" = "1h" }
[upstream.app]
servers = ["127.0.0.1:$OPORT"]
TOML
"$PIER_BIN" serve -c "$DIR/pier.toml" >"$DIR/pier.log" 2>&1 & PIER=$!; PIDS+=($PIER)
for _ in $(seq 100); do curl -sf "http://127.0.0.1:$PPORT/p/page.html" >/dev/null && break; sleep 0.1; done
curl -sf "http://127.0.0.1:$PPORT/c/page.html" >/dev/null
cpu() { awk '{print $14+$15}' "/proc/$PIER/stat"; }
TCK=$(getconf CLK_TCK)
run() { # name path accept-encoding
    local rates=()
    for _ in $(seq "$REPS"); do
        local c0; c0=$(cpu)
        local out; out=$(wrk -t1 -c"$CONNS" -d"${DURATION}s" ${3:+-H "Accept-Encoding: $3"} "http://127.0.0.1:$PPORT$2")
        local c1; c1=$(cpu)
        local reqs; reqs=$(awk '/requests in/{print $1}' <<<"$out")
        rates+=("$(python3 -c "print(round($reqs/(($c1-$c0)/$TCK)))")")
    done
    printf '%-9s req/CPU-s: %s (median %s)\n' "$1" "${rates[*]}" \
        "$(printf '%s\n' "${rates[@]}" | sort -n | awk '{a[NR]=$1} END{print a[int((NR+1)/2)]}')"
}
echo "load average: $(cut -d' ' -f1-3 /proc/loadavg); CONNS=$CONNS DURATION=$DURATION REPS=$REPS"
run plain /p/page.html ""
run gzip /c/page.html gzip
run identity /c/page.html ""
run br /c/page.html br
echo "load average after: $(cut -d' ' -f1-3 /proc/loadavg)"
