#!/usr/bin/env bash
# A fleet of Piers (issue 37), two figures:
#
# 1. Origin requests per distinct object with 3 lower tiers. OBJECTS distinct URLs
#    (/hello?o=N, each cacheable for an hour) are requested through each of 3 caches at
#    once (h2load, one connection per cache, every URL once), in front of one nginx origin
#    whose stub_status counts what reaches it:
#      pier-tiered  3 lower-tier Piers with `[cache.main] parents` = 2 parent Piers
#      pier-alone   3 Piers, no parents
#      varnish      3 varnishd, no tiering (Varnish 7.1 from Debian; skipped if absent)
#    The goal is 1.0 for the tiered fleet; each cache on its own fetches every object: 3.0.
# 2. The cost per request of a global limit against a local one: user-space instructions
#    per request under callgrind (bench/instructions.sh, proxies pier (no limit),
#    pier-limit-local and pier-limit-global; the global one exchanges with a redis-server
#    it starts).
#
#   bash bench/fleet.sh                      # both; OBJECTS=1000
#   PARTS=tiers OBJECTS=5000 bash bench/fleet.sh
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
BENCH="$ROOT/bench"
PIER_BIN="${PIER_BIN:-$ROOT/target/dist/pier}"
OBJECTS="${OBJECTS:-1000}"
PARTS="${PARTS:-tiers,limits}"
VARNISHD="$(command -v varnishd || echo /usr/sbin/varnishd)"
for t in h2load nginx curl; do
  command -v "$t" >/dev/null || { echo "needs $t (apt-get install nghttp2-client nginx curl)" >&2; exit 1; }
done
[ -x "$PIER_BIN" ] || { echo "no $PIER_BIN: cargo build --profile dist -p pier" >&2; exit 1; }
RUN="$(mktemp -d /tmp/pier-fleet.XXXXXX)"
PIDS=()
cleanup() { for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; rm -rf "$RUN"; }
trap cleanup EXIT
port() { python3 "$BENCH/tool.py" port; }

if [[ ",$PARTS," == *",tiers,"* ]]; then
  # A fresh origin per fleet, so its counter starts at 0.
  origin() {
    local dir="$RUN/origin-$1" p; p="$(port)"
    mkdir -p "$dir/logs/tmp" "$dir/html"
    sed -e "s/@PORT@/$p/g" "$BENCH/peers/cache/origin.conf" >"$dir/nginx.conf"
    nginx -p "$dir/" -c nginx.conf -e "$dir/logs/error.log" >/dev/null 2>&1 &
    PIDS+=($!)
    python3 "$BENCH/tool.py" wait-port "$p" 10
    echo "$p"
  }
  # Requests the origin answered, less the status requests themselves.
  origin_requests() {
    curl -s "http://127.0.0.1:$1/__status" | awk '/^ *[0-9]+ +[0-9]+ +[0-9]+/ { print $3 - 1 }'
  }
  # pier_conf PORT ORIGIN_PORT PARENTS(toml array or empty)
  pier_conf() {
    cat <<EOF
[server]
workers = 1
[log]
access = "off"
[analytics]
enabled = false
[cache.main]
memory = "256m"
$( [ -n "$3" ] && echo "parents = $3" )
[[listener]]
name = "main"
listen = "127.0.0.1:$1"
[[route]]
name = "all"
path = "/"
upstream = "origin"
[route.cache]
zone = "main"
[upstream.origin]
servers = ["127.0.0.1:$2"]
EOF
  }
  start_pier() { # NAME PORT ORIGIN PARENTS
    pier_conf "$2" "$3" "$4" >"$RUN/$1.toml"
    "$PIER_BIN" serve -c "$RUN/$1.toml" >"$RUN/$1.log" 2>&1 &
    PIDS+=($!)
    python3 "$BENCH/tool.py" wait-port "$2" 20
  }
  for i in $(seq 0 $((OBJECTS - 1))); do echo "/hello?o=$i"; done >"$RUN/paths"
  # Every URL once through each of the three caches, the three at once.
  through() {
    local hs=()
    for p in "$@"; do
      sed "s|^|http://127.0.0.1:$p|" "$RUN/paths" >"$RUN/uris-$p"
      # One site name for the whole fleet, as clients of a real one send (the cache key
      # has the Host in it: each node's own address would make three keys of one object).
      h2load --h1 -n "$OBJECTS" -c 1 -t 1 -H ":authority: fleet.test" -i "$RUN/uris-$p" >"$RUN/h2load-$p.log" 2>&1 &
      hs+=($!)
    done
    for h in "${hs[@]}"; do wait "$h"; done
    for p in "$@"; do
      grep -q "$OBJECTS succeeded, 0 failed" "$RUN/h2load-$p.log" || { grep "requests:" "$RUN/h2load-$p.log" >&2; }
    done
  }
  printf "%-14s %8s %16s %22s\n" fleet objects origin_requests "per distinct object"
  report() { printf "%-14s %8s %16s %22s\n" "$1" "$OBJECTS" "$2" "$(python3 -c "print(f'{$2 / $OBJECTS:.3f}')")"; }

  o="$(origin tiered)"
  pa="$(port)"; pb="$(port)"
  start_pier parent-a "$pa" "$o" ""
  start_pier parent-b "$pb" "$o" ""
  cs=()
  for n in 1 2 3; do
    c="$(port)"; cs+=("$c")
    start_pier "child-$n" "$c" "$o" "[\"127.0.0.1:$pa\", \"127.0.0.1:$pb\"]"
  done
  through "${cs[@]}"
  report pier-tiered "$(origin_requests "$o")"

  o="$(origin alone)"
  cs=()
  for n in 1 2 3; do
    c="$(port)"; cs+=("$c")
    start_pier "alone-$n" "$c" "$o" ""
  done
  through "${cs[@]}"
  report pier-alone "$(origin_requests "$o")"

  if [ -x "$VARNISHD" ]; then
    o="$(origin varnish)"
    cs=()
    for n in 1 2 3; do
      c="$(port)"; cs+=("$c")
      mkdir -p "$RUN/varnish-$n"
      sed -e "s/@ORIGIN@/$o/g" "$BENCH/peers/cache/varnish.vcl" >"$RUN/varnish-$n/default.vcl"
      "$VARNISHD" -F -j none -n "$RUN/varnish-$n/state" -a "127.0.0.1:$c" -f "$RUN/varnish-$n/default.vcl" \
        -s malloc,256m >"$RUN/varnish-$n/stdout.log" 2>&1 &
      PIDS+=($!)
      python3 "$BENCH/tool.py" wait-port "$c" 30
    done
    through "${cs[@]}"
    report varnish "$(origin_requests "$o")"
  else
    echo "varnish: not installed (apt-get install varnish)"
  fi
fi

if [[ ",$PARTS," == *",limits,"* ]]; then
  echo
  PIER_BIN="$PIER_BIN" PROXIES="pier pier-limit-local pier-limit-global" bash "$BENCH/instructions.sh"
fi
