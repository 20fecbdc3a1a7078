#!/usr/bin/env bash
# The cost of tracing (issue 36): plain /hello through Pier with `[tracing]` off, on with 1%
# of roots sampled, and on with every request sampled and exported, in requests per Pier
# CPU-second (utime+stime of each pier process, /proc). Three Piers (one worker each) run
# side by side in front of one nginx origin; the modes alternate within each repetition so
# drift hits them alike. The collector is a small OTLP/HTTP sink (Python) that answers 200
# to every batch: what is measured is Pier's side (ids, spans, encoding, POSTs), not a
# collector's.
#
#   bench/tracing.sh                      # DURATION=5 REPS=3 CONNS="50 500" PIER_BIN=target/dist/pier
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PIER_BIN="${PIER_BIN:-$ROOT/target/dist/pier}"
DURATION="${DURATION:-5}"; REPS="${REPS:-3}"; CONNS="${CONNS:-50 500}"
[ -x "$PIER_BIN" ] || (cd "$ROOT" && cargo build --profile dist -p pier)
pkgs=()
command -v nginx >/dev/null || [ -x /usr/sbin/nginx ] || pkgs+=(nginx)
command -v wrk >/dev/null || pkgs+=(wrk)
if [ "${#pkgs[@]}" -gt 0 ]; then
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq && apt-get install -y -qq --no-install-recommends "${pkgs[@]}" >/dev/null
fi
export PATH="$PATH:/usr/sbin"
DIR="$(mktemp -d)"; PIDS=()
cleanup() { for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done; rm -rf "$DIR"; }
trap cleanup EXIT
free_port() { python3 -c 'import socket;s=socket.socket();s.bind(("127.0.0.1",0));print(s.getsockname()[1])'; }

OPORT=$(free_port); SINK=$(free_port)
mkdir -p "$DIR/nginx/logs"
cat >"$DIR/nginx/nginx.conf" <<NGX
worker_processes 1;
error_log $DIR/nginx/logs/error.log;
pid $DIR/nginx/nginx.pid;
events { worker_connections 4096; }
http {
  access_log off;
  server {
    listen 127.0.0.1:$OPORT reuseport backlog=4096;
    keepalive_requests 1000000;
    location /hello { return 200 "hello world\n"; }
  }
}
NGX
nginx -p "$DIR/nginx" -c "$DIR/nginx/nginx.conf" -g 'daemon off;' & PIDS+=($!)
cat >"$DIR/sink.py" <<'PY'
import sys, http.server
class H(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    def do_POST(self):
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self.send_response(200); self.send_header("Content-Length", "0"); self.end_headers()
    def log_message(self, *a): pass
http.server.ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
PY
python3 "$DIR/sink.py" "$SINK" & PIDS+=($!)

declare -A PORT PID
for mode in off 1pct 100pct; do
  PORT[$mode]=$(free_port); APORT=$(free_port)
  case $mode in
    off) tracing="" ;;
    1pct) tracing=$'[tracing]\nendpoint = "http://127.0.0.1:'"$SINK"$'/v1/traces"\nsample = 0.01' ;;
    100pct) tracing=$'[tracing]\nendpoint = "http://127.0.0.1:'"$SINK"$'/v1/traces"\nsample = 1.0' ;;
  esac
  cat >"$DIR/pier-$mode.toml" <<TOML
[server]
workers = 1
[admin]
listen = "127.0.0.1:$APORT"
[log]
access = "off"
$tracing
[[listener]]
name = "main"
listen = "127.0.0.1:${PORT[$mode]}"
[[route]]
name = "default"
upstream = "app"
[upstream.app]
servers = ["127.0.0.1:$OPORT"]
TOML
  "$PIER_BIN" serve -c "$DIR/pier-$mode.toml" >"$DIR/pier-$mode.log" 2>&1 & PID[$mode]=$!; PIDS+=($!)
  echo "$mode admin 127.0.0.1:$APORT" >>"$DIR/admins"
done
for mode in off 1pct 100pct; do
  for _ in $(seq 100); do curl -sf "http://127.0.0.1:${PORT[$mode]}/hello" >/dev/null && break; sleep 0.1; done
done
cpu() { awk '{print $14+$15}' "/proc/$1/stat"; }
TCK=$(getconf CLK_TCK)
echo "load average: $(cut -d' ' -f1-3 /proc/loadavg); DURATION=$DURATION REPS=$REPS $("$PIER_BIN" --version 2>/dev/null | head -1)"
for c in $CONNS; do
  declare -A RATES=()
  for _ in $(seq "$REPS"); do
    for mode in off 1pct 100pct; do
      c0=$(cpu "${PID[$mode]}")
      out=$(wrk -t1 -c"$c" -d"${DURATION}s" "http://127.0.0.1:${PORT[$mode]}/hello")
      c1=$(cpu "${PID[$mode]}")
      reqs=$(awk '/requests in/{print $1}' <<<"$out")
      RATES[$mode]+="$(python3 -c "print(round($reqs/(($c1-$c0)/$TCK)))") "
    done
  done
  med() { tr ' ' '\n' <<<"$1" | grep . | sort -n | awk '{a[NR]=$1} END{print a[int((NR+1)/2)]}'; }
  off=$(med "${RATES[off]}")
  for mode in off 1pct 100pct; do
    m=$(med "${RATES[$mode]}")
    printf '%4s conns %-7s req/CPU-s: %s (median %s; CPU per request %+.1f%% vs off)\n' "$c" "$mode" \
      "${RATES[$mode]}" "$m" "$(python3 -c "print(($off/$m - 1) * 100)")"
  done
done
while read -r mode _ a; do
  printf '%-7s spans: %s\n' "$mode" "$(curl -s "http://$a/metrics" | awk '/^pier_tracing_spans_total/ {printf "%s ", $0}')"
done <"$DIR/admins"
echo "load average after: $(cut -d' ' -f1-3 /proc/loadavg)"
