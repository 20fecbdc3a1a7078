#!/usr/bin/env bash
# User-space instructions per NEW connection (a full handshake and one GET /hello), HTTP/3
# against Pier's own HTTP/2 over TLS, counted by callgrind: what bench/h3.sh's new-connection
# cell measures per CPU-second, as a figure the busy 2-core machine cannot move.
#
# Pier runs with one worker under callgrind (bench/peers/h3/pier-h3.toml: HTTP/3 and HTTP/2
# over TLS on one port) in front of the bench's nginx origin; bench/h3load opens a new
# connection per request (-newconn, CLIENTS at once) for D1, then in a second run D2 seconds;
# instructions per connection = (Ir(2) - Ir(1)) / (completed(2) - completed(1)), so start-up
# and shutdown cancel out.
#
#   bash bench/h3_instructions.sh                  # PROTOS="h3 h2" D1=3s D2=9s CLIENTS=4
#   KEEP=1 PROTOS=h3 bash bench/h3_instructions.sh  # then callgrind_annotate RUN/h3-2/cg.out
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
BENCH="$ROOT/bench"
PIER_BIN="${PIER_BIN:-$ROOT/target/dist/pier}"
H3LOAD="${H3LOAD:-$BENCH/h3load/h3load}"
PROTOS="${PROTOS:-h3 h2}"
D1="${D1:-3s}"
D2="${D2:-9s}"
CLIENTS="${CLIENTS:-4}"
for t in valgrind callgrind_annotate nginx openssl; do
  command -v "$t" >/dev/null || { echo "needs $t" >&2; exit 1; }
done
[ -x "$H3LOAD" ] || { echo "no $H3LOAD: (cd bench/h3load && go build)" >&2; exit 1; }
[ -x "$PIER_BIN" ] || { echo "no $PIER_BIN: cargo build --profile dist -p pier" >&2; exit 1; }
RUN="$(mktemp -d /tmp/pier-h3instr.XXXXXX)"
PIDS=()
cleanup() { for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done; [ "${KEEP:-0}" = 1 ] && echo "kept $RUN" >&2 || rm -rf "$RUN"; }
trap cleanup EXIT
port() { python3 "$BENCH/tool.py" port; }

d="$RUN/certs"; mkdir -p "$d"
openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -days 2 \
    -subj /CN=pier-bench-ca -keyout "$d/ca.key" -out "$d/ca.pem" 2>/dev/null
openssl req -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -subj /CN=localhost \
    -keyout "$d/leaf.key" -out "$d/leaf.csr" 2>/dev/null
printf 'subjectAltName=DNS:localhost,IP:127.0.0.1\nbasicConstraints=CA:FALSE\n' >"$d/ext.cnf"
openssl x509 -req -in "$d/leaf.csr" -CA "$d/ca.pem" -CAkey "$d/ca.key" -CAcreateserial \
    -days 2 -extfile "$d/ext.cnf" -out "$d/leaf.pem" 2>/dev/null

ORIGIN_PORT="$(port)"
mkdir -p "$RUN/origin/logs/tmp" "$RUN/origin/html"
sed -e "s/@PORT@/$ORIGIN_PORT/g" "$BENCH/peers/origin/nginx.conf" >"$RUN/origin/nginx.conf"
nginx -p "$RUN/origin/" -c nginx.conf -e "$RUN/origin/logs/error.log" >/dev/null 2>&1 &
PIDS+=($!)
python3 "$BENCH/tool.py" wait-port "$ORIGIN_PORT" 10

# counted PROTO RUN DURATION: prints "Ir completed"
counted() {
  local proto="$1" n="$2" dur="$3" p; p="$(port)"
  local dir="$RUN/$proto-$n"; mkdir -p "$dir"
  sed -e "s/@PORT@/$p/g" -e "s/@ORIGIN@/$ORIGIN_PORT/g" -e "s/@WORKERS@/1/g" \
    -e "s|@CERT@|$d/leaf.pem|g" -e "s|@KEY@|$d/leaf.key|g" \
    "$BENCH/peers/h3/pier-h3.toml" >"$dir/pier.toml"
  valgrind --tool=callgrind --callgrind-out-file="$dir/cg.out" "$PIER_BIN" serve -c "$dir/pier.toml" \
    >"$dir/proxy.log" 2>&1 &
  local vp=$!
  python3 "$BENCH/tool.py" wait-port "$p" 120 --pid "$vp"
  "$H3LOAD" -url "https://127.0.0.1:$p/hello" -proto "$proto" -newconn -m "$CLIENTS" -d "$dur" \
    -timeout 30s -cacert "$d/ca.pem" >"$dir/h3load.json" 2>"$dir/h3load.err"
  kill -TERM "$vp"; wait "$vp" || true
  local ir done
  ir="$({ callgrind_annotate "$dir"/cg.out* 2>/dev/null || true; } | awk '/PROGRAM TOTALS/ && !x { gsub(",", "", $1); print $1; x = 1 }')"
  done="$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["requests"])' "$dir/h3load.json")"
  echo "$ir $done"
}

printf "%-6s %14s %10s %14s %10s %14s\n" proto "Ir(1)" "conns(1)" "Ir(2)" "conns(2)" "Ir/connection"
for proto in $PROTOS; do
  read -r a na < <(counted "$proto" 1 "$D1")
  read -r b nb < <(counted "$proto" 2 "$D2")
  printf "%-6s %14s %10s %14s %10s %14s\n" "$proto" "$a" "$na" "$b" "$nb" "$(( (b - a) / (nb - na) ))"
done
