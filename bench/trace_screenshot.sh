#!/usr/bin/env bash
# A picture of a Pier trace in Jaeger's UI, for docs/tracing.md: Jaeger v2 ($JAEGER, built
# by .ci/install), a Python origin and Pier on free ports; one request with a traceparent
# through a route whose first server is down (so the trace shows the retry), then headless
# Chromium photographs the trace's page. Usage:
#   JAEGER_UI_ASSETS=DIR bash bench/trace_screenshot.sh [PIER_BIN]
# Writes docs/img/jaeger-trace.png. A Jaeger built with `go build` (as .ci/install does) has
# no UI of its own: DIR is a build of jaeger-ui at the tag Jaeger pins (v1.76.0, commit
# 1ceadb6f), which no registry serves prebuilt. It needs Node >= 24 (npm's `node` package
# gives one: `npm i node@24`, then its node_modules/.bin first on PATH); in a checkout of
# jaegertracing/jaeger-ui at that tag: `npm ci`, then `npm run build` in packages/jaeger-ui
# (DIR = packages/jaeger-ui/build). docs/img/jaeger-trace.png was made so on 2026-12-06.
set -euo pipefail
cd "$(dirname "$0")/.."
source target/test-env.sh
PIER="${1:-target/debug/pier}"
OUT="docs/img/jaeger-trace.png"
UI="${JAEGER_UI_ASSETS:?set JAEGER_UI_ASSETS to a jaeger-ui build (see the top of this file)}"
DIR="$(mktemp -d)"
pids=()
trap 'kill "${pids[@]}" 2>/dev/null || true; rm -rf "$DIR"' EXIT

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
OTLP=$(free_port); QUERY=$(free_port); GRPC=$(free_port); ORIGIN=$(free_port)
LISTEN=$(free_port); ADMIN=$(free_port); DEAD=$(free_port)

cat >"$DIR/jaeger.yaml" <<YAML
service:
  extensions: [jaeger_storage, jaeger_query]
  pipelines:
    traces: { receivers: [otlp], processors: [], exporters: [jaeger_storage_exporter] }
  telemetry: { metrics: { level: none } }
extensions:
  jaeger_query:
    storage: { traces: mem }
    ui: { assets_path: "$UI" }
    http: { endpoint: "127.0.0.1:$QUERY" }
    grpc: { endpoint: "127.0.0.1:$GRPC" }
  jaeger_storage:
    backends: { mem: { memory: { max_traces: 1000 } } }
receivers:
  otlp: { protocols: { http: { endpoint: "127.0.0.1:$OTLP" } } }
exporters:
  jaeger_storage_exporter: { trace_storage: mem }
YAML
"$JAEGER" --config="file:$DIR/jaeger.yaml" >"$DIR/jaeger.log" 2>&1 & pids+=($!)
mkdir -p "$DIR/www/api" "$(dirname "$OUT")" && echo '{"ok":true}' >"$DIR/www/api/orders"
python3 -m http.server "$ORIGIN" --bind 127.0.0.1 --directory "$DIR/www" >/dev/null 2>&1 & pids+=($!)
cat >"$DIR/pier.toml" <<TOML
[admin]
listen = "127.0.0.1:$ADMIN"
[tracing]
endpoint = "http://127.0.0.1:$OTLP/v1/traces"
service_name = "pier-edge"
[[listener]]
name = "main"
listen = "127.0.0.1:$LISTEN"
[[route]]
name = "api"
path = "/api/"
upstream = "orders"
[upstream.orders]
servers = ["127.0.0.1:$DEAD", "127.0.0.1:$ORIGIN"]
balance = "round_robin"
retries = 1
TOML
"$PIER" serve -c "$DIR/pier.toml" >"$DIR/pier.log" 2>&1 & pids+=($!)
for _ in $(seq 100); do
  curl -s -o /dev/null "http://127.0.0.1:$QUERY/" && curl -s -o /dev/null "http://127.0.0.1:$ORIGIN/" \
    && curl -s -o /dev/null "http://127.0.0.1:$LISTEN/" && break
  sleep 0.1
done
# Requests until one of them tried the dead server first (a trace with two attempts).
trace=""
for i in 1 2 3 4 5 6; do
  t=$(printf '%032x' "$((0x5e1f0000 + i))")
  before=$(curl -s "http://127.0.0.1:$ADMIN/metrics" | awk '/^pier_upstream_retries_total/ {print $2}')
  code=$(curl -s -o /dev/null -w '%{http_code}' -H "traceparent: 00-$t-00f067aa0ba902b7-01" \
    "http://127.0.0.1:$LISTEN/api/orders")
  after=$(curl -s "http://127.0.0.1:$ADMIN/metrics" | awk '/^pier_upstream_retries_total/ {print $2}')
  # A retry that then reached the origin: one failed attempt, one answered.
  if [ "$after" != "$before" ] && [ "$code" = 200 ]; then trace=$t; break; fi
done
[ -n "$trace" ] || { echo "no request was retried" >&2; exit 1; }
for _ in $(seq 100); do
  curl -s "http://127.0.0.1:$QUERY/api/traces/$trace" | grep -q '"spans"' && break
  sleep 0.1
done
chromium --headless --no-sandbox --disable-gpu --hide-scrollbars --window-size=1400,700 \
  --virtual-time-budget=15000 --screenshot="$OUT" "http://127.0.0.1:$QUERY/trace/$trace" 2>/dev/null
echo "== $OUT (trace $trace)"
