#!/usr/bin/env bash
# The README's test command: installs what the tests need (.ci/install: Debian packages,
# OpenResty's Lua libraries, h2spec, grpc-go's interop binaries, Kafka's jars, PostgreSQL,
# the HTTP cache suite, a gRPC-web client; kept between runs), then runs every test.
#
#   ./test.sh                          # cargo test --workspace --no-fail-fast (every test binary runs)
#   ./test.sh -p pier --test cache     # arguments go to cargo test instead of --workspace
#   PIER_SKIP_INSTALL=1 ./test.sh …    # reuse target/test-env.sh as the last install wrote it
#
# Or once `.ci/install` has run: `source target/test-env.sh`, then any `cargo test …`.
# Everything listens on 127.0.0.1, on ports the kernel picks.
set -euo pipefail
cd "$(dirname "$0")"

if [ -z "${PIER_SKIP_INSTALL:-}" ] || [ ! -f target/test-env.sh ]; then
  bash .ci/install
fi
# shellcheck source=/dev/null
source target/test-env.sh

if [ $# -eq 0 ]; then
  set -- --workspace --no-fail-fast
fi
echo "== cargo test $*"
exec cargo test "$@"
