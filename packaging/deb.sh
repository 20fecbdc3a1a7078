#!/usr/bin/env bash
# Build Pier's Debian package with cargo-deb from the `dist` profile, lint it with lintian,
# and (with --install) install it on this machine and check the packaged config with the
# installed binary, as a user would. CI runs `bash packaging/deb.sh --install`.
#
#   bash packaging/deb.sh              # target/debian/pier_*.deb, linted
#   bash packaging/deb.sh --install    # … then dpkg -i, pier check, the user and the files
set -euo pipefail
cd "$(dirname "$0")/.."

if ! command -v cargo-deb >/dev/null; then
  cargo install cargo-deb --locked --version 3.8.0
fi
if ! command -v lintian >/dev/null; then
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q lintian >/dev/null
fi

echo "== cargo deb (profile dist, guided by the committed profile: docs/pgo.md)"
build_log="$(mktemp)"
rc=0
cargo deb -p pier --profile dist ${PIER_DEB_ARGS:-} >"$build_log" 2>&1 || rc=$?
# LLVM's per-function staleness warnings are summed by pgo/check.sh below, not listed.
grep -v 'hash mismatch' "$build_log" || true
[ "$rc" = 0 ] || { echo "cargo deb failed ($rc)"; exit 1; }
# The packaged binary is the profile-guided one only while the profile matches the code.
echo "== pgo/check.sh (is the committed profile still the code's?)"
bash pgo/check.sh "$build_log"
rm -f "$build_log"
deb=$(ls -t target/debian/pier_*.deb | head -1)
echo "== $deb"
dpkg-deb --info "$deb" | sed -n '1,40p'
dpkg-deb --contents "$deb"

echo "== lintian"
# Errors fail the build; warnings are printed. --pedantic shows what is left to polish.
lintian --fail-on error --display-info "$deb"

if [ "${1:-}" = "--install" ]; then
  echo "== apt-get install ./$deb (its dependencies too)"
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q "./$deb"
  getent passwd pier >/dev/null || { echo "no pier user after install"; exit 1; }
  test "$(stat -c %U /var/log/pier)" = pier || { echo "/var/log/pier not owned by pier"; exit 1; }
  test -f /lib/systemd/system/pier.service || test -f /usr/lib/systemd/system/pier.service \
    || { echo "no unit installed"; exit 1; }
  dpkg-query -W -f='${Conffiles}\n' pier | grep -q /etc/pier/pier.toml \
    || { echo "/etc/pier/pier.toml is not a conffile"; exit 1; }
  echo "== pier check -c /etc/pier/pier.toml"
  /usr/bin/pier check -c /etc/pier/pier.toml
  # The packaged binary runs as the packaged user would: serve the packaged config on a
  # free port (the packaged :80 may be taken here) and answer a request.
  tmp=$(mktemp -d)
  sed -e 's|0.0.0.0:80|127.0.0.1:0|' -e 's|127.0.0.1:9901|127.0.0.1:0|' \
      -e "s|/var/log/pier/access.log|$tmp/access.log|" -e "s|/run/pier/upgrade.sock|$tmp/upgrade.sock|" \
      /etc/pier/pier.toml > "$tmp/pier.toml"
  /usr/bin/pier check -c "$tmp/pier.toml"
  /usr/bin/pier serve -c "$tmp/pier.toml" > "$tmp/out" 2>&1 &
  pid=$!
  for _ in $(seq 100); do grep -q "listening on" "$tmp/out" && break; sleep 0.1; done
  addr=$(sed -n 's|.*listening on http://\([0-9.:]*\).*|\1|p' "$tmp/out" | head -1)
  # Nothing listens on the packaged upstream (127.0.0.1:8000): a 502 with Pier's reason.
  code=$(curl -s -o /dev/null -w '%{http_code}' "http://$addr/")
  kill -TERM "$pid"; wait "$pid" || true
  cat "$tmp/out"
  test "$code" = 502 || { echo "the packaged binary answered $code, not 502"; exit 1; }
  rm -rf "$tmp"
  echo "== the package installs, its config checks and its binary serves"
fi
