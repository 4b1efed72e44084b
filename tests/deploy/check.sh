#!/usr/bin/env bash
# Checks shoal's Kubernetes manifests (deploy/) without a cluster:
#   1. tools: kubectl (for `kubectl kustomize`), and kubernetes-validate in a venv
#   2. render deploy/ and deploy/monitoring/ with `kubectl kustomize`
#   3. schema-validate the rendered core manifests with `kubernetes-validate --strict`,
#      for the oldest supported Kubernetes and for the newest schemas it ships
#   4. cross-object rules (tests/deploy/cross_check.py), monitoring selectors included
#   5. a negative test: broken copies of the manifests must make the checker fail
#   6. every SHOAL_* variable the manifests set is one `shoal serve --help` lists (needs a
#      built binary: `cargo build --bin shoal` first; CI builds before calling this)
#   7. a second cluster: an overlay with a namePrefix and its own instance label renames
#      every object, selector and reference (tests/deploy/prefix_check.py)
#   8. TLS with cert-manager: deploy/tls/ patched onto deploy/, rendered, validated and
#      checked against its issuers (tests/deploy/tls_check.py)
#
# Usage: tests/deploy/check.sh   (from any directory; root or passwordless sudo to install)
# Environment: SHOAL_BIN (default target/debug/shoal).
# Every step runs even when an earlier one failed; the exit code is 1 if any failed.
# Nothing is skipped: a tool that is missing and cannot be installed is a failure.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."

# kubernetes-validate pinned: it bundles the schemas (Kubernetes 1.25 to 1.37).
KUBERNETES_VALIDATE_VERSION=1.37.0
# The oldest Kubernetes the manifests support (persistentVolumeClaimRetentionPolicy is on by
# default from 1.27; everything else is older). The newest is kubernetes-validate's default.
MIN_KUBERNETES=1.30.0

VENV=target/deploy-venv
RENDERED=target/deploy-rendered.yaml
RENDERED_MONITORING=target/deploy-monitoring-rendered.yaml
SERVE_HELP=target/deploy-serve-help.txt
SHOAL_BIN=${SHOAL_BIN:-target/debug/shoal}

start=$SECONDS
mkdir -p target
# No stale output of an earlier run can stand in for this one's.
rm -f "$RENDERED" "$RENDERED_MONITORING" "$SERVE_HELP"
passed=0
failed=0
failed_steps=()

# step NAME COMMAND...: runs one step, prints its result and counts it.
step() {
    local name=$1
    shift
    echo "== $name"
    if "$@"; then
        echo "-- passed: $name"
        passed=$((passed + 1))
    else
        echo "-- FAILED: $name"
        failed=$((failed + 1))
        failed_steps+=("$name")
    fi
}

# apt_install PACKAGE...: Debian packages, as root or through passwordless sudo.
apt_install() {
    local sudo=""
    if [ "$(id -u)" -ne 0 ]; then
        command -v sudo >/dev/null 2>&1 || { echo "need root or sudo to install $*" >&2; return 1; }
        sudo="sudo -n"
    fi
    echo "installing Debian packages: $*"
    $sudo apt-get update -qq || return 1
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "$@" >/dev/null || return 1
}

# kubectl: the machine's own if it has one (any version with `kubectl kustomize`, Debian
# bookworm's 1.20 included), else Debian's kubernetes-client package.
ensure_kubectl() {
    if ! command -v kubectl >/dev/null 2>&1; then
        apt_install kubernetes-client || { echo "kubectl is missing and kubernetes-client could not be installed" >&2; return 1; }
    fi
    command -v kubectl >/dev/null 2>&1 || { echo "kubectl still missing after installing kubernetes-client" >&2; return 1; }
    if ! kubectl kustomize --help >/dev/null 2>&1; then
        echo "$(command -v kubectl) has no 'kustomize' subcommand: need kubectl >= 1.14" >&2
        return 1
    fi
    echo "kubectl: $(command -v kubectl), $(kubectl version --client 2>/dev/null | head -n 1)"
}

# kubernetes-validate (and PyYAML, its dependency, for the Python checks) in a venv.
ensure_validator() {
    command -v python3 >/dev/null 2>&1 || apt_install python3 || return 1
    if [ ! -x "$VENV/bin/python" ] || ! "$VENV/bin/python" -c 'import sys' 2>/dev/null; then
        rm -rf "$VENV"
        if ! python3 -m venv "$VENV" 2>/dev/null; then
            # Debian's python3 has no ensurepip without python3-venv.
            rm -rf "$VENV"
            apt_install python3-venv || return 1
            python3 -m venv "$VENV" || return 1
        fi
    fi
    if [ "$("$VENV/bin/kubernetes-validate" --version 2>/dev/null)" != "$KUBERNETES_VALIDATE_VERSION" ]; then
        "$VENV/bin/pip" install --quiet --disable-pip-version-check \
            "kubernetes-validate==$KUBERNETES_VALIDATE_VERSION" || return 1
    fi
    "$VENV/bin/python" -c 'import yaml' || return 1
    echo "kubernetes-validate $("$VENV/bin/kubernetes-validate" --version) in $VENV"
}

# kustomize prints its stderr through, except the deprecation warning for commonLabels
# (kept on purpose: old kubectl's kustomize does not know its replacement, `labels`).
kustomize() {
    local dir=$1 out=$2 err=target/deploy-kustomize.err
    if ! kubectl kustomize "$dir" >"$out" 2>"$err"; then
        cat "$err" >&2
        return 1
    fi
    grep -v -e "'commonLabels' is deprecated" -e "'vars' is deprecated" -e "'bases' is deprecated" "$err" >&2 || true
}

# A second cluster beside the first: an overlay of deploy/ with a namePrefix and its own
# instance label. Every name, selector and reference must follow (prefix_check.py), and the
# base must pass the same check with no prefix.
OVERLAY=target/deploy-overlay
RENDERED_OVERLAY=target/deploy-overlay-rendered.yaml
second_cluster() {
    rm -rf "$OVERLAY" "$RENDERED_OVERLAY"
    mkdir -p "$OVERLAY"
    # `bases`, not `resources`: old kubectl's kustomize takes directories only there.
    cat >"$OVERLAY/kustomization.yaml" <<'YAML'
apiVersion: kustomize.config.k8s.io/v1beta1
kind: Kustomization
bases:
  - ../../deploy
namePrefix: blue-
commonLabels:
  app.kubernetes.io/instance: blue
YAML
    kustomize "$OVERLAY" "$RENDERED_OVERLAY" || return 1
    "$VENV/bin/python" tests/deploy/prefix_check.py "$RENDERED" "" shoal || return 1
    "$VENV/bin/python" tests/deploy/prefix_check.py "$RENDERED_OVERLAY" blue- blue || return 1
    # The overlay is a valid cluster too.
    "$VENV/bin/kubernetes-validate" --strict --quiet -k "$MIN_KUBERNETES" "$RENDERED_OVERLAY" || return 1
}

# TLS with cert-manager: deploy/tls/statefulset-tls.yaml patched onto deploy/ in an overlay
# (as deploy/README.md tells users to), rendered, schema-validated, its SHOAL_* variables known
# to `shoal serve`, and checked against deploy/tls/issuer.yaml (tls_check.py).
TLS_OVERLAY=target/deploy-tls-overlay
RENDERED_TLS=target/deploy-tls-rendered.yaml
tls_overlay() {
    rm -rf "$TLS_OVERLAY" "$RENDERED_TLS"
    mkdir -p "$TLS_OVERLAY"
    cp deploy/tls/statefulset-tls.yaml "$TLS_OVERLAY/"
    cat >"$TLS_OVERLAY/kustomization.yaml" <<'YAML'
apiVersion: kustomize.config.k8s.io/v1beta1
kind: Kustomization
bases:
  - ../../deploy
patchesStrategicMerge:
  - statefulset-tls.yaml
YAML
    kustomize "$TLS_OVERLAY" "$RENDERED_TLS" || return 1
    "$VENV/bin/kubernetes-validate" --strict --quiet -k "$MIN_KUBERNETES" "$RENDERED_TLS" || return 1
    "$VENV/bin/python" tests/deploy/tls_check.py "$RENDERED_TLS" deploy/tls/issuer.yaml || return 1
    [ -s "$SERVE_HELP" ] || env -i PATH="$PATH" "$SHOAL_BIN" serve --help >"$SERVE_HELP" || return 1
    "$VENV/bin/python" tests/deploy/cross_check.py "$RENDERED_TLS" --known-env "$SERVE_HELP"
}

render() {
    kustomize deploy/ "$RENDERED" || { rm -f "$RENDERED"; return 1; }
    kustomize deploy/monitoring/ "$RENDERED_MONITORING" || { rm -f "$RENDERED_MONITORING"; return 1; }
    echo "rendered $RENDERED ($(grep -c '^kind:' "$RENDERED") objects) and $RENDERED_MONITORING ($(grep -c '^kind:' "$RENDERED_MONITORING") object)"
}

# rendered COMMAND...: runs a step that reads the rendered manifests, or fails at once
# (counted, never skipped) when there are none.
rendered() {
    if [ ! -s "$RENDERED" ] || [ ! -s "$RENDERED_MONITORING" ]; then
        echo "FAIL: not run: the render step produced nothing"
        return 1
    fi
    "$@"
}

# Strict: unknown fields are errors. The ServiceMonitor is a CRD that kubernetes-validate
# has no schema for; its rendering and selectors are checked by cross_check.py instead.
validate() {
    local version=$1
    local args=(--strict --quiet)
    if [ "$version" = newest ]; then
        # kubernetes-validate's default version: the newest schemas it ships.
        version=$("$VENV/bin/kubernetes-validate" --help | grep -o 'Defaults to [0-9.]*' | grep -o '[0-9.]*$')
    fi
    "$VENV/bin/kubernetes-validate" "${args[@]}" -k "$version" "$RENDERED" || return 1
    echo "ok: every object in $RENDERED is valid for Kubernetes $version"
}

known_env() {
    if [ ! -x "$SHOAL_BIN" ]; then
        echo "FAIL: $SHOAL_BIN does not exist: build it first (cargo build --bin shoal), or set SHOAL_BIN"
        return 1
    fi
    # A clean environment: clap prints the value of any SHOAL_* variable that is set.
    env -i PATH="$PATH" "$SHOAL_BIN" serve --help >"$SERVE_HELP" || return 1
    "$VENV/bin/python" tests/deploy/cross_check.py "$RENDERED" --known-env "$SERVE_HELP"
}

step "tools: kubectl" ensure_kubectl
step "tools: kubernetes-validate" ensure_validator
step "render (kubectl kustomize)" render
step "schema (kubernetes-validate --strict -k $MIN_KUBERNETES)" rendered validate "$MIN_KUBERNETES"
step "schema (kubernetes-validate --strict, newest schemas)" rendered validate newest
step "cross-object rules (cross_check.py)" \
    rendered "$VENV/bin/python" tests/deploy/cross_check.py "$RENDERED" --monitoring "$RENDERED_MONITORING"
step "the checker can fail (negative_test.py)" rendered "$VENV/bin/python" tests/deploy/negative_test.py "$RENDERED"
step "SHOAL_* variables known to shoal serve" rendered known_env
step "a second cluster: namePrefix and instance overlay (prefix_check.py)" rendered second_cluster
step "TLS with cert-manager: deploy/tls overlay (tls_check.py)" rendered tls_overlay

echo
if [ "$failed" -gt 0 ]; then
    printf 'failed step: %s\n' "${failed_steps[@]}"
fi
echo "deploy checks took $((SECONDS - start))s"
echo "deploy: $passed passed, $failed failed"
[ "$failed" -eq 0 ]
