#!/usr/bin/env bash
# User-space instructions per FULL TLS 1.3 handshake, Pier vs nginx, counted by
# callgrind (bench/instructions.sh's method, for new connections instead of
# requests): a figure that does not move with what else the 2-core machine is
# doing. Issue 34 asks for full handshakes per CPU-second >= 1.2x nginx; this
# shows where each one's instructions go (KEEP=1, then callgrind_annotate
# RUN/<proxy>-<N2>/cg.out*).
#
# Both proxies serve one ECDSA P-256 certificate made now (as bench/run.sh TLS=1
# does) with their bench/peers TLS configs (bench/peers/pier/pier-tls.toml,
# bench/peers/nginx-proxy/nginx-tls.conf: session cache and tickets on), one
# worker, in front of the bench's nginx origin. The client is bench/tool.py's
# `resume --full`: C clients, each opening one connection after another, a
# TLS 1.3 handshake that never offers a session, one GET /hello with
# Connection: close, read until the proxy closes. N1, then in a second run N2
# handshakes; instructions per handshake = (Ir(N2) - Ir(N1)) / (N2 - N1), so
# start-up and shutdown cancel out. Before the count each run prints what one
# `openssl s_client` (the client library the tool and wrk use: OpenSSL 3) and
# the tool negotiated: protocol, cipher, key-exchange group, and how many
# session tickets the proxy sent (NewSessionTicket messages).
#
#   bash bench/tls_instructions.sh                          # pier, nginx; N1=200 N2=1200 C=4
#   PIER_BIN=/tmp/pier-hs PROXIES=pier KEEP=1 bash bench/tls_instructions.sh
#   COUNT=syscalls bash bench/tls_instructions.sh           # system calls per handshake (strace -f -c)
#   RESUMED=1 bash bench/tls_instructions.sh                # resumed handshakes instead of full ones
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
BENCH="$ROOT/bench"
PIER_BIN="${PIER_BIN:-$ROOT/target/dist/pier}"
N1="${N1:-200}"
N2="${N2:-1200}"
C="${C:-4}"
# RESUMED=1: every handshake but each client's first resumes its previous session (TLS 1.3
# tickets; the tool counts a full one as an error): what resumption saves against the default.
FULL="--full"; [ "${RESUMED:-0}" = 1 ] && FULL=""
PROXIES="${PROXIES:-pier nginx}"
COUNT="${COUNT:-instructions}"   # instructions (callgrind) or syscalls (strace)
case "$COUNT" in
  instructions) TOOLS="valgrind callgrind_annotate" ;;
  syscalls) TOOLS="strace" ;;
  *) echo "COUNT is instructions or syscalls" >&2; exit 1 ;;
esac
for t in $TOOLS openssl nginx python3; do
  command -v "$t" >/dev/null || { echo "needs $t (apt-get install valgrind strace openssl nginx)" >&2; exit 1; }
done
[ -x "$PIER_BIN" ] || { echo "no $PIER_BIN: cargo build --profile dist -p pier" >&2; exit 1; }
RUN="$(mktemp -d /tmp/pier-tlsinstr.XXXXXX)"
chmod 755 "$RUN"
PIDS=()
cleanup() { for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done; [ "${KEEP:-0}" = 1 ] && echo "kept $RUN" >&2 || rm -rf "$RUN"; }
trap cleanup EXIT
port() { python3 "$BENCH/tool.py" port; }

# The certificate: bench/run.sh's make_certs (a P-256 CA and a P-256 leaf for localhost).
d="$RUN/certs"; mkdir -p "$d"
openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -days 2 \
  -subj /CN=pier-bench-ca -keyout "$d/ca.key" -out "$d/ca.pem" 2>/dev/null
openssl req -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -subj /CN=localhost \
  -keyout "$d/leaf.key" -out "$d/leaf.csr" 2>/dev/null
printf 'subjectAltName=DNS:localhost,IP:127.0.0.1\nbasicConstraints=CA:FALSE\n' >"$d/ext.cnf"
openssl x509 -req -in "$d/leaf.csr" -CA "$d/ca.pem" -CAkey "$d/ca.key" -CAcreateserial \
  -days 2 -extfile "$d/ext.cnf" -out "$d/leaf.pem" 2>/dev/null
chmod 644 "$d"/*
CERT="$d/leaf.pem"; KEY="$d/leaf.key"

ORIGIN_PORT="$(port)"
mkdir -p "$RUN/origin/logs/tmp" "$RUN/origin/html"
sed -e "s/@PORT@/$ORIGIN_PORT/g" "$BENCH/peers/origin/nginx.conf" >"$RUN/origin/nginx.conf"
nginx -p "$RUN/origin/" -c nginx.conf -e "$RUN/origin/logs/error.log" >/dev/null 2>&1 &
PIDS+=($!)
ORIGIN_PID=$!
python3 "$BENCH/tool.py" wait-port "$ORIGIN_PORT" 10

# counted PROXY N: one run of PROXY doing N full handshakes; prints its total Ir
# (COUNT=instructions) or the path of its strace summary (COUNT=syscalls)
counted() {
  local proxy="$1" n="$2" p; p="$(port)"
  local dir="$RUN/$proxy-$n"; mkdir -p "$dir/logs/tmp"
  local cmd
  case "$proxy" in
    pier)
      sed -e "s/@PORT@/$p/g" -e "s/@ORIGIN@/$ORIGIN_PORT/g" -e "s|@CERT@|$CERT|g" -e "s|@KEY@|$KEY|g" \
        -e 's/^workers = 2/workers = 1/' "$BENCH/peers/pier/pier-tls.toml" >"$dir/pier.toml"
      cmd=("$PIER_BIN" serve -c "$dir/pier.toml") ;;
    nginx)
      sed -e "s/@PORT@/$p/g" -e "s/@ORIGIN@/$ORIGIN_PORT/g" -e "s|@CERT@|$CERT|g" -e "s|@KEY@|$KEY|g" \
        -e 's/^worker_processes 2;/worker_processes 1;/' -e 's/^master_process on;/master_process off;/' \
        -e 's/ reuseport;/;/' "$BENCH/peers/nginx-proxy/nginx-tls.conf" >"$dir/nginx.conf"
      cmd=(nginx -p "$dir/" -c nginx.conf -e "$dir/logs/error.log") ;;
    *) echo "unknown proxy $proxy" >&2; exit 1 ;;
  esac
  if [ "$COUNT" = syscalls ]; then
    strace -f -c -U calls,name -o "$dir/strace.out" "${cmd[@]}" >"$dir/proxy.log" 2>&1 &
  else
    valgrind --tool=callgrind --callgrind-out-file="$dir/cg.out" "${cmd[@]}" >"$dir/proxy.log" 2>&1 &
  fi
  local vp=$!
  python3 "$BENCH/tool.py" wait-port "$p" 120 --pid "$vp"
  # What was negotiated (one more handshake in both runs: it cancels out).
  { printf 'GET /hello HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n'; sleep 3; } |
    timeout 60 openssl s_client -connect "127.0.0.1:$p" -servername localhost -brief -msg \
      >"$dir/s_client.log" 2>&1 || true
  python3 "$BENCH/tool.py" resume $FULL --proxy "$proxy" --out "$dir/resume.jsonl" --pid "$vp" \
    --port "$p" --origin-pid "$ORIGIN_PID" --origin-port "$ORIGIN_PORT" --conns "$C" \
    --duration 3600 --n "$n" --tls 1.3 --rep 1 >"$dir/resume.log" 2>&1 || cat "$dir/resume.log" >&2
  if [ "$COUNT" = syscalls ]; then
    pkill -TERM -P "$vp"; wait "$vp" || true
    echo "$dir/strace.out"
  else
    kill -TERM "$vp"; wait "$vp" || true
    { callgrind_annotate "$dir"/cg.out* 2>/dev/null || true; } | awk '/PROGRAM TOTALS/ && !done { gsub(",", "", $1); print $1; done = 1 }'
  fi
}

# The negotiated parameters, as openssl s_client -brief saw them, and the session tickets
# the proxy sent on that one connection.
negotiated() {
  grep -E 'Protocol version|Ciphersuite|Server Temp Key|Negotiated TLS1.3 group|Peer signature type' "$1" |
    sed 's/^/    /'
  echo "    NewSessionTicket messages: $(grep -c '<<< .*NewSessionTicket' "$1")"
}

[ "$COUNT" = instructions ] && printf "%-8s %14s %14s %14s\n" proxy "Ir(N1=$N1)" "Ir(N2=$N2)" "Ir/handshake"
for proxy in $PROXIES; do
  a="$(counted "$proxy" "$N1")"; b="$(counted "$proxy" "$N2")"
  if [ "$COUNT" = syscalls ]; then
    echo "== $proxy: system calls per full TLS 1.3 handshake (C=$C)"
    python3 "$BENCH/tool.py" syscalls "$a" "$b" $((N2 - N1))
  else
    printf "%-8s %14s %14s %14s\n" "$proxy" "$a" "$b" "$(( (b - a) / (N2 - N1) ))"
  fi
  negotiated "$RUN/$proxy-$N2/s_client.log"
  grep -h 'handshakes' "$RUN/$proxy-$N2/resume.log" | sed 's/^ */    tool: /'
done
