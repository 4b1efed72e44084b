# shellcheck shell=bash
# One `shoal serve` for the shell checks (sourced by tests/observability/check.sh and
# tests/api/check.sh): a temp dir in $work, the node on free loopback ports, stopped by its PID
# on exit (SIGTERM, then SIGKILL after 15 s).
#   start_node BIN [serve flags...]   sets $node_pid and $base, waits (60 s) for /readyz 200;
#                                     on failure prints the node's log and calls die.
#   stop_node                         stops it by its PID and removes its data dir (the next
#                                     start_node starts afresh).
# The sourcing script defines die().

work=$(mktemp -d)
node_pid=""
stop_node() {
    if [ -n "$node_pid" ] && kill -0 "$node_pid" 2>/dev/null; then
        kill -TERM "$node_pid" 2>/dev/null || true
        # The node drains for up to 10 s on SIGTERM; kill it if it takes longer than 15 s.
        for _ in $(seq 150); do kill -0 "$node_pid" 2>/dev/null || break; sleep 0.1; done
        kill -KILL "$node_pid" 2>/dev/null || true
        wait "$node_pid" 2>/dev/null || true
    fi
    node_pid=""
    rm -rf "$work/data"
}
cleanup() {
    stop_node
    rm -rf "$work"
}
trap cleanup EXIT

for tool in python3 curl; do
    command -v "$tool" >/dev/null 2>&1 || die "$tool is required"
done

start_node() {
    local bin=$1 api_port peer_port deadline
    shift
    [ -x "$bin" ] || die "$bin is missing: build first (cargo build)"
    # Two ports below the kernel's ephemeral range (32768 and up): no outgoing connection can
    # take one as its local port before the node binds it, as one did to a port the kernel had
    # handed out (the node then exited with "Address already in use").
    read -r api_port peer_port < <(python3 -c '
import random, socket
found = []
while len(found) < 2:
    port = random.randrange(20000, 32000)
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            continue
    if port not in found:
        found.append(port)
print(*found)')
    base="http://127.0.0.1:$api_port"
    "$bin" serve --listen "127.0.0.1:$api_port" --peer-listen "127.0.0.1:$peer_port" \
        --data-dir "$work/data" --worker-threads 1 "$@" >"$work/node.log" 2>&1 &
    node_pid=$!
    deadline=$((SECONDS + 60))
    until [ "$(curl -s -o /dev/null -w '%{http_code}' "$base/readyz" 2>/dev/null)" = 200 ]; do
        kill -0 "$node_pid" 2>/dev/null || { tail -n 30 "$work/node.log" >&2; die "the node exited before it was ready"; }
        [ "$SECONDS" -lt "$deadline" ] || { tail -n 30 "$work/node.log" >&2; die "the node was not ready within 60 s"; }
        sleep 0.2
    done
}
