# Process handling shared by the bench scripts (sourced; not run): every process tree a
# script starts is recorded in its PIDS, and killed when the script exits, however it exits.
#   PIDS=(); source "$BENCH_DIR/procs.sh"
#   cmd & PIDS+=($!)            # started
#   kill_tree "$pid"; untrack "$pid"   # stopped early
PROCS_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"

kill_tree() {   # TERM a process tree, wait (bounded), then KILL what is left
    local root="$1" pids p i
    pids="$(python3 "$PROCS_DIR/tool.py" tree "$root" 2>/dev/null || echo "$root")"
    kill -TERM "$root" 2>/dev/null || true
    for i in $(seq 1 50); do
        kill -0 "$root" 2>/dev/null || break
        sleep 0.1
    done
    for p in $pids; do kill -KILL "$p" 2>/dev/null || true; done
    wait "$root" 2>/dev/null || true
}

cleanup() {
    local rc=$? p
    for p in "${PIDS[@]:-}"; do [ -n "$p" ] && kill_tree "$p"; done
    exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

untrack() {     # untrack PID: no longer killed at exit (it was stopped already)
    local p out=()
    for p in "${PIDS[@]:-}"; do [ "$p" = "$1" ] || out+=("$p"); done
    PIDS=("${out[@]:-}")
}
