#!/usr/bin/env bash
# Does the committed profile (pgo/pier.profdata) still match the code? Builds the `dist`
# profile (profile-guided through pgo/rustc-wrapper) and adds up what LLVM discarded:
# each function changed since the profile was made is reported per crate ("function
# control flow change detected (hash mismatch) NAME ... up to N count discarded") and
# compiled as if it never ran. The share of the profile's counts discarded so is the
# measure of staleness; past PIER_PGO_MAX_STALE percent (default 5) this fails, naming the
# hottest changed functions, and `bash bench/pgo.sh --save` makes a new profile.
#
#   bash pgo/check.sh                # cargo build --profile dist -p pier, then the figures
#   bash pgo/check.sh BUILD_LOG      # the figures from a dist build's cargo output
#
# cargo replays a crate's warnings when it is fresh, so a built tree answers at once.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
MAX="${PIER_PGO_MAX_STALE:-5}"
total="$(sed -n 's/^total_count: //p' "$ROOT/pgo/PROFILE")"
want="$(sed -n '/^rustc: /{s///p;q;}' "$ROOT/pgo/PROFILE")"
have="$(rustc -vV | sed -n 1p)"
if [ "$want" != "$have" ]; then
  # Not a failure: the build is then the plain `dist` one, correct but slower. A machine
  # with another rustc gets a profile of its own with `bash bench/pgo.sh --save`.
  echo "pgo/check: NOT profile-guided: the profile was made by '$want', this compiler is '$have' (bash bench/pgo.sh --save)" >&2
  exit 0
fi
if [ $# -ge 1 ]; then
  log="$1"
else
  log="$(mktemp)"
  trap 'rm -f "$log"' EXIT
  # grep finding nothing to print is fine; a failed build is not (its log has no
  # mismatches, so it would pass as fresh).
  set +e
  (cd "$ROOT" && cargo build --profile dist -p pier --color never 2>&1) | tee "$log" | grep -v '^warning:.*hash mismatch'
  built="${PIPESTATUS[0]}"
  set -e
  if [ "$built" != 0 ]; then
    echo "pgo/check: the dist build failed (exit $built)" >&2
    exit 1
  fi
fi
python3 - "$log" "$total" "$MAX" <<'EOF'
import re, sys
log, total, limit = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
pat = re.compile(r"hash mismatch\) (\S+) Hash = \d+ up to (\d+) count discarded")
seen = {}
for line in open(log, errors="replace"):
    m = pat.search(line)
    if m:
        seen[m.group(1)] = max(seen.get(m.group(1), 0), int(m.group(2)))
lost = sum(seen.values())
share = 100.0 * lost / max(total, 1)
print(f"pgo/check: {len(seen)} functions changed since the profile; {lost} of its {total} counts discarded ({share:.2f}%, limit {limit}%)")
for name, n in sorted(seen.items(), key=lambda kv: -kv[1])[:10]:
    print(f"  {100.0 * n / max(total, 1):6.2f}%  {name}")
if share > limit:
    print("pgo/check: the profile is stale for the hot path: bash bench/pgo.sh --save, and commit pgo/", file=sys.stderr)
    sys.exit(1)
EOF
