#!/usr/bin/env bash
# Side-by-side performance of shoal and Redis on this machine, in one run.
#
# Builds shoal in release mode, then runs tests/perf/compare.py, which installs redis-server
# (Debian package) if missing, starts Redis and shoal on loopback only, measures, stops every
# process it started by its PID, and prints one table. Takes about 10 minutes on 2 cores.
#
#   tests/perf/compare.sh            # 3 runs per figure, 5 s each, medians reported
#   RUNS=5 DURATION=10 tests/perf/compare.sh
set -euo pipefail
cd "$(dirname "$0")/../.."

cargo build --release --locked --bin shoal
exec python3 tests/perf/compare.py --shoal target/release/shoal "$@"
