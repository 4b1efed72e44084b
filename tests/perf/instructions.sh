#!/usr/bin/env bash
# Server instructions per request, counted by callgrind: the same figure on a busy or a quiet
# machine, so it separates what the code costs from what the VM does.
#
#   tests/perf/instructions.sh target/release/shoal [/tmp/baseline-shoal ...]
#
# For each binary: one node (--worker-threads 1) under valgrind's callgrind; `shoal bench`
# fills 2,000 keys, then the counters are zeroed, 8 s of unbatched GETs (then PUTs) from 4
# connections run, and the counters are dumped. Printed per request: every instruction of
# the process (background work included) and those of the connection tasks alone (the
# `http_server::serve` closure: parsing, routing, the handler, the answer). Needs valgrind
# (installed here from the Debian package if missing). Every process started is stopped by
# its PID.
set -euo pipefail

if [ $# -lt 1 ]; then
    echo "usage: $0 SHOAL_BINARY [MORE_BINARIES...]" >&2
    exit 2
fi
if ! command -v valgrind > /dev/null || ! command -v callgrind_annotate > /dev/null; then
    apt-get install -y -qq valgrind > /dev/null
fi

API=127.0.0.1:7190
PEER=127.0.0.1:7191
work=$(mktemp -d)
server=""
cleanup() {
    if [ -n "$server" ]; then kill "$server" 2> /dev/null || true; fi
    rm -rf "$work"
}
trap cleanup EXIT

# The sum of a callgrind dump's events, and the inclusive count of one function. awk reads
# to the end (an early exit would kill callgrind_annotate with SIGPIPE, and pipefail this
# script).
total_of() { callgrind_annotate "$1" 2> /dev/null | awk '!done && /PROGRAM TOTALS/ {gsub(",", "", $1); print $1; done = 1}'; }
serve_of() {
    callgrind_annotate --inclusive=yes "$1" 2> /dev/null \
        | awk '!done && /http_server::serve::\{\{closure\}\}::\{\{closure\}\} \[/ {gsub(",", "", $1); print $1; done = 1}'
}

printf '%-40s %-4s %9s %14s %14s\n' binary op requests "all/request" "serve/request"
for bin in "$@"; do
    for op in GET PUT; do
        ratio=1:0
        if [ "$op" = PUT ]; then ratio=0:1; fi
        data="$work/data-$op"
        out="$work/callgrind-$op.out"
        valgrind --tool=callgrind --callgrind-out-file="$out" "$bin" serve --listen "$API" \
            --peer-listen "$PEER" --data-dir "$data" --worker-threads 1 > "$work/server.log" 2>&1 &
        server=$!
        for _ in $(seq 1 600); do
            if curl -sf "http://$API/readyz" > /dev/null 2>&1; then break; fi
            sleep 0.2
        done
        "$bin" bench --addr "$API" --connections 4 --keys 2000 --duration 2s --ratio "$ratio" > /dev/null
        callgrind_control -z "$server" > /dev/null 2>&1
        requests=$("$bin" bench --addr "$API" --connections 4 --keys 2000 --duration 8s --ratio "$ratio" \
            --no-fill -o json | python3 -c 'import json, sys; print(json.load(sys.stdin)["requests"])')
        callgrind_control -d "$server" > /dev/null 2>&1
        kill "$server"
        wait "$server" 2> /dev/null || true
        server=""
        all=$(total_of "$out.1")
        serve=$(serve_of "$out.1")
        printf '%-40s %-4s %9d %14d %14d\n' "$bin" "$op" "$requests" $((all / requests)) $((serve / requests))
        rm -rf "$data" "$out"*
    done
done
