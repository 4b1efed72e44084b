#!/usr/bin/env bash
# Checks a live node against its own OpenAPI description with schemathesis: every request the
# description allows is answered with a status and body it describes, every request it does
# not allow is refused, no answer is a 5xx. Bounded: 50 examples per operation and phase, at
# most 2 minutes of fuzzing, a 10-minute watchdog. Any finding fails.
#   1. installs schemathesis (pinned) in a venv under target/ when it is missing;
#   2. starts one node (target/debug/shoal, built beforehand) without tokens, then one with an
#      admin and a client token (what the description says of credentials must hold both
#      ways): one node, so that a generated leave is refused (409) instead of removing a member;
#   3. runs schemathesis with tests/api/schemathesis.toml against each.
# Usage: tests/api/check.sh          (needs python3 and curl)
set -euo pipefail
cd "$(dirname "$0")/../.."

BIN=target/debug/shoal
VENV=target/api-venv
SCHEMATHESIS_VERSION=4.32.5
TOKEN=schemathesis-admin-token

die() {
    echo "tests/api/check.sh: $*" >&2
    exit 1
}

# The temp dir, the node's lifecycle and the tool checks (python3, curl).
# shellcheck source=tests/node.sh
source tests/node.sh

# ------------------------------------------------------------------ 1. schemathesis
if [ "$("$VENV/bin/st" --version 2>/dev/null | grep -o '[0-9][0-9.]*' | head -n 1)" != "$SCHEMATHESIS_VERSION" ]; then
    rm -rf "$VENV"
    if ! python3 -m venv "$VENV" 2>/dev/null; then
        # Debian's python3 has no ensurepip without python3-venv.
        rm -rf "$VENV"
        sudo=""
        [ "$(id -u)" -ne 0 ] && sudo="sudo -n"
        $sudo apt-get update -qq
        DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq python3-venv >/dev/null
        python3 -m venv "$VENV"
    fi
    "$VENV/bin/pip" install --quiet --disable-pip-version-check "schemathesis==$SCHEMATHESIS_VERSION"
fi
echo "schemathesis: $("$VENV/bin/st" --version)"

# ------------------------------------------------------------------ 2. and 3. a node, then schemathesis
CLIENT_TOKEN=schemathesis-client-token
for mode in "without tokens" "with tokens"; do
    if [ "$mode" = "with tokens" ]; then
        start_node "$BIN" --admin-token "$TOKEN" --client-token "$CLIENT_TOKEN" --cache-size 64MiB
        auth=(-H "Authorization: Bearer $TOKEN")
    else
        start_node "$BIN" --cache-size 64MiB
        auth=()
    fi
    echo "node $mode ready on $base (pid $node_pid)"
    status=0
    timeout 600 "$VENV/bin/st" --config-file tests/api/schemathesis.toml run "$base/openapi.json" \
        --checks all --exclude-checks object_level_authorization \
        --phases examples,coverage,fuzzing,stateful --max-examples 50 --max-time 120 \
        --seed 1 --workers 1 --generation-database none --request-timeout 10 \
        "${auth[@]}" --no-color || status=$?
    if [ "$status" -ne 0 ]; then
        echo "--- node log (last 30 lines)" >&2
        tail -n 30 "$work/node.log" >&2
        die "schemathesis found the server ($mode) and its description disagree (exit $status)"
    fi
    kill -0 "$node_pid" 2>/dev/null || die "the node ($mode) died during the run"
    stop_node
done
echo "ok: the server is its description, with tokens and without"
