#!/usr/bin/env bash
# The sizes of a request's futures, as rustc lays them out (`-Zprint-type-sizes`): what each
# HTTP/2 or HTTP/3 stream allocates and copies, and each HTTP/1 connection's request box
# (docs/phases.md, "A multiplexed connection's stream"). Not a timing: a layout report.
#
#   bash bench/future-sizes.sh              # the request futures' sizes, largest first
#   TOP=40 MATCH=H2Downstream bash bench/future-sizes.sh   # every future on HTTP/2's path
#   DETAIL='driver::connect<' bash bench/future-sizes.sh   # one future's variants and fields
#
# A release build without LTO or the profile (layouts do not depend on either), in its own
# target directory (default /tmp/pier-type-sizes; RUSTC_BOOTSTRAP=1 lets stable rustc take
# the -Z flag, and would rebuild every dependency in a shared target directory).
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=${TYPE_SIZES_TARGET:-/tmp/pier-type-sizes}
OUT=$DIR/type-sizes.txt
mkdir -p "$DIR"
# The report comes from compiling the binary crate, so it must be compiled again.
CARGO_TARGET_DIR="$DIR" cargo clean --quiet --release -p pier
RUSTC_BOOTSTRAP=1 PIER_PGO=0 CARGO_PROFILE_RELEASE_LTO=false CARGO_PROFILE_RELEASE_CODEGEN_UNITS=16 \
  CARGO_PROFILE_RELEASE_DEBUG=0 CARGO_TARGET_DIR="$DIR" \
  cargo rustc --quiet --release -p pier --bin pier -- -Zprint-type-sizes >"$OUT"
python3 - "$OUT" "${MATCH:-}" "${TOP:-12}" "${DETAIL:-}" <<'PY'
import re, sys
path, match, top, detail = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
types, cur = {}, None
for line in open(path):
    m = re.match(r"print-type-size type: `(.*)`: (\d+) bytes", line)
    if m:
        cur = m.group(1)
        types[cur] = (int(m.group(2)), [])
    elif cur:
        types[cur][1].append(line[len("print-type-size "):].rstrip())
futs = {t: v for t, v in types.items() if t.startswith("{async")}
if detail:
    for t, (size, lines) in futs.items():
        if detail in t:
            print(size, t)
            for l in lines:
                f = re.match(r"\s+(local|upvar) `.*?`: (\d+) bytes", l)
                if not f or int(f.group(2)) >= 64:
                    print("   ", l.strip()[:200])
    sys.exit(0)
if match:
    rows = [(v[0], t) for t, v in futs.items() if match in t]
else:
    keys = ("Engine>::serve_stream<", "driver::serve_request<", "driver::serve_stream<")
    rows = [(v[0], t) for t, v in futs.items() if any(k in t for k in keys)]
for size, t in sorted(set(rows), reverse=True)[:top]:
    print(f"{size:>7}  {t[:190]}")
PY
