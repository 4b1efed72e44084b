#!/usr/bin/env bash
# Runs every test of shoal on a fresh machine: installs what the tests need (curl for the
# README examples, openssl for the README's certificates, nft/ip/unshare for the fault tests; the deploy and observability checks
# install kubectl, kubernetes-validate and promtool themselves), then checks formatting and
# lints and runs the whole test suite.
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
install nft nftables   # the fault tests cut links with nft rules
install ip iproute2
install unshare util-linux
install openssl openssl   # the README's commands that make a CA and node certificates

# .cargo/config.toml builds with --cfg tokio_unstable, which lets the deterministic simulation
# seed tokio's own random choices; a RUSTFLAGS from the environment replaces that setting, so
# it is added back.
if [ -n "${RUSTFLAGS:-}" ]; then
    export RUSTFLAGS="$RUSTFLAGS --cfg tokio_unstable"
fi

echo "== format"
cargo fmt --all -- --check
echo "== lint"
cargo clippy --workspace --all-targets --locked -- -D warnings
echo "== docs"
RUSTDOCFLAGS="${RUSTDOCFLAGS:-} --cfg tokio_unstable -D warnings" cargo doc --workspace --no-deps --document-private-items --locked
echo "== test"
status=0
cargo test --workspace --locked --no-fail-fast || status=$?

# The deployment as users get it, checked offline by real tools (they install what they
# need: kubectl/kustomize, kubernetes-validate, promtool): the Kubernetes manifests, the
# Prometheus rules, the Grafana dashboard, and a live node's /metrics (target/debug/shoal,
# built by the tests above).
echo "== deploy/ manifests"
tests/deploy/check.sh || status=$?
echo "== metrics, rules and dashboard"
tests/observability/check.sh || status=$?
# The server against its own OpenAPI description (schemathesis, installed in a venv).
echo "== API description (schemathesis)"
tests/api/check.sh || status=$?

# Fault tests (kill -9, SIGSTOP, nft partitions) run real node processes on 127.0.0.2-4 inside
# a private network namespace: the nft rules and every packet stay in it, and it vanishes
# with the process.
echo "== fault tests (private network namespace)"
bin=$(cargo test -p shoal --test cluster --locked --no-run 2>&1 | grep -o 'target/debug/deps/cluster-[0-9a-f]*' | head -n 1)
[ -x "$bin" ] || { echo "tests/run.sh: cluster test binary not found" >&2; exit 1; }
netns="unshare -n"
[ "$(id -u)" -ne 0 ] && netns="unshare -rn"
$netns sh -c 'ip link set lo up && SHOAL_FAULT_NETNS=1 exec "$0" --ignored --test-threads=1 faults::' "$bin" || status=$?
exit $status
