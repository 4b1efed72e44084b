#!/usr/bin/env python3
"""Shows that cross_check.py can fail: breaks the rendered manifests in one way at a time
and asserts that the checker exits 1 with the expected FAIL line (and that the unbroken
manifests pass).

Usage: negative_test.py RENDERED.yaml   (the output of `kubectl kustomize deploy/`)
Prints `ok: ...` or `FAIL: ...` per case; exits 1 if any case went wrong. Needs PyYAML.
"""

import copy
import os
import subprocess
import sys
import tempfile

import yaml

CHECKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "cross_check.py")


def one(docs, kind, name):
    return next(d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name)


def container(docs):
    return one(docs, "StatefulSet", "shoal")["spec"]["template"]["spec"]["containers"][0]


def service_selector_typo(docs):
    one(docs, "Service", "shoal")["spec"]["selector"]["app.kubernetes.io/name"] = "shaol"


def pdb_selector_typo(docs):
    one(docs, "PodDisruptionBudget", "shoal")["spec"]["selector"]["matchLabels"]["app.kubernetes.io/name"] = "shaol"


def short_grace_period(docs):
    one(docs, "StatefulSet", "shoal")["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] = 30


def peer_port_open_to_all(docs):
    for rule in one(docs, "NetworkPolicy", "shoal")["spec"]["ingress"]:
        rule.pop("from", None)


def headless_hides_unready(docs):
    one(docs, "Service", "shoal-headless")["spec"]["publishNotReadyAddresses"] = False


def readiness_wrong_path(docs):
    container(docs)["readinessProbe"]["httpGet"]["path"] = "/healthz"


def listen_port_mismatch(docs):
    for e in container(docs)["env"]:
        if e["name"] == "SHOAL_PEER_LISTEN":
            e["value"] = "0.0.0.0:7001"


# (what to break, a piece of the FAIL line the checker must print)
CASES = [
    (service_selector_typo, "FAIL: Service shoal selector"),
    (pdb_selector_typo, "FAIL: PodDisruptionBudget shoal selector"),
    (short_grace_period, "FAIL: terminationGracePeriodSeconds 30 <"),
    (peer_port_open_to_all, "FAIL: NetworkPolicy: peer port"),
    (headless_hides_unready, "FAIL: Service shoal-headless has publishNotReadyAddresses"),
    (readiness_wrong_path, "FAIL: readinessProbe"),
    (listen_port_mismatch, "FAIL: SHOAL_PEER_LISTEN="),
]


def run_checker(docs):
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
        yaml.safe_dump_all(docs, f)
        path = f.name
    try:
        r = subprocess.run([sys.executable, CHECKER, path], capture_output=True, text=True)
    finally:
        os.unlink(path)
    return r.returncode, r.stdout + r.stderr


def main():
    with open(sys.argv[1]) as f:
        base = [d for d in yaml.safe_load_all(f) if d]
    failed = 0

    code, out = run_checker(base)
    if code == 0:
        print("ok: negative: the unbroken manifests pass")
    else:
        print(f"FAIL: negative: the unbroken manifests do not pass (exit {code}):\n{out}")
        failed += 1

    for breaker, expected in CASES:
        docs = copy.deepcopy(base)
        breaker(docs)
        code, out = run_checker(docs)
        lines = [line for line in out.splitlines() if line.startswith(expected)]
        if code == 1 and lines:
            print(f"ok: negative: {breaker.__name__} is caught ({lines[0]})")
        else:
            print(f"FAIL: negative: {breaker.__name__}: expected exit 1 and a line starting {expected!r}, got exit {code}:\n{out}")
            failed += 1
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
