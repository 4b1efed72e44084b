#!/usr/bin/env bash
# Runs every test of shoal on a fresh machine: installs what the tests need (curl for the
# README examples), then checks formatting and lints and runs the whole test suite.
# Usage: tests/run.sh            (CI runs exactly this through .ci/run)
set -euo pipefail
cd "$(dirname "$0")/.."

install() { # install PACKAGE when COMMAND is missing
    local command=$1 package=$2
    command -v "$command" >/dev/null 2>&1 && return 0
    echo "tests/run.sh: installing $package (for $command)"
    local sudo=""
    [ "$(id -u)" -ne 0 ] && sudo="sudo -n"
    $sudo apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "$package" >/dev/null
    command -v "$command" >/dev/null 2>&1 || { echo "tests/run.sh: could not install $package" >&2; exit 1; }
}

install curl curl

echo "== format"
cargo fmt --all -- --check
echo "== lint"
cargo clippy --workspace --all-targets --locked -- -D warnings
echo "== test"
cargo test --workspace --locked --no-fail-fast
