#!/usr/bin/env bash
# Runs N fresh simulation seeds, one process per seed and as many at once as there are cores,
# and prints each failing seed with the command that replays it. A seed that runs longer than
# SHOAL_SOAK_SEED_TIMEOUT seconds of wall time (default 600) is stopped and reported as hung.
#
# Usage: tests/sim/soak.sh N [FIRST]    (FIRST: the first seed; default a random one)
# SHOAL_SIM_SCENARIO and SHOAL_SIM_READ pass through (see tests/sim/main.rs).
set -euo pipefail
cd "$(dirname "$0")/../.."

n=${1:?usage: tests/sim/soak.sh N [FIRST]}
first=${2:-$(( (RANDOM << 15 | RANDOM) + 100000 ))}
timeout_s=${SHOAL_SOAK_SEED_TIMEOUT:-600}
jobs=$(nproc)

bin=$(cargo test --release -p shoal --test sim --locked --no-run 2>&1 | grep -o 'target/release/deps/sim-[0-9a-f]*' | head -n 1)
[ -x "$bin" ] || { echo "soak.sh: the simulation test binary was not built" >&2; exit 1; }
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT

echo "soak: seeds $first..$((first + n - 1)), $jobs at a time, ${timeout_s}s each at most"
run_seed() { # SEED: runs it, leaves its output in $out/SEED and its status in $out/SEED.rc
    local seed=$1 rc=0
    SHOAL_SIM_SEED=$seed timeout "$timeout_s" "$bin" --exact replay --nocapture >"$out/$seed" 2>&1 || rc=$?
    echo "$rc" >"$out/$seed.rc"
    case $rc in
        0) ;;
        124) echo "HUNG seed $seed (over ${timeout_s}s of wall time)" ;;
        *) echo "FAILED seed $seed: $(grep -m1 -o 'VIOLATION.\{0,200\}' "$out/$seed" || tail -n 1 "$out/$seed")" ;;
    esac
}
export -f run_seed
export bin out timeout_s
seq "$first" $((first + n - 1)) | xargs -P "$jobs" -I{} bash -c 'run_seed {}'

failed=0
for seed in $(seq "$first" $((first + n - 1))); do
    rc=$(cat "$out/$seed.rc" 2>/dev/null || echo missing)
    if [ "$rc" != 0 ]; then
        failed=$((failed + 1))
        echo "  replay: SHOAL_SIM_SEED=$seed${SHOAL_SIM_SCENARIO:+ SHOAL_SIM_SCENARIO=$SHOAL_SIM_SCENARIO}${SHOAL_SIM_READ:+ SHOAL_SIM_READ=$SHOAL_SIM_READ} RUST_LOG=info cargo test --release --test sim replay -- --nocapture"
    fi
done
echo "soak: $n seeds from $first, $failed failed"
[ "$failed" -eq 0 ]
