#!/usr/bin/env python3
"""Checks that rendered manifests form one self-contained cluster named by a prefix: every
object's name starts with PREFIX, every object and every selector carries
app.kubernetes.io/instance=INSTANCE, and every reference (the StatefulSet's serviceName, the
addresses the nodes advertise and discover each other by, ConfigMaps, Secrets) names an
object of the same render. Run on the base (prefix "", instance shoal) and on an overlay with
a namePrefix and its own instance (tests/deploy/check.sh): two such clusters can share a
namespace without one selecting the other's pods.

    prefix_check.py RENDERED.yaml PREFIX INSTANCE
"""

import sys

import yaml

INSTANCE = "app.kubernetes.io/instance"


def selectors(obj):
    """Every label selector of an object (as dicts of labels), with where it is."""
    kind, spec = obj["kind"], obj.get("spec") or {}
    found = []
    if kind == "Service":
        found.append(("spec.selector", spec.get("selector") or {}))
    if kind in ("StatefulSet", "PodDisruptionBudget"):
        found.append(("spec.selector", (spec.get("selector") or {}).get("matchLabels") or {}))
    if kind == "StatefulSet":
        affinity = spec["template"]["spec"].get("affinity") or {}
        for term in (affinity.get("podAntiAffinity") or {}).get("preferredDuringSchedulingIgnoredDuringExecution", []):
            found.append(("anti-affinity", term["podAffinityTerm"]["labelSelector"].get("matchLabels") or {}))
    if kind == "NetworkPolicy":
        found.append(("spec.podSelector", (spec.get("podSelector") or {}).get("matchLabels") or {}))
        for rule in spec.get("ingress") or []:
            for peer in rule.get("from") or []:
                if "podSelector" in peer and "namespaceSelector" not in peer:
                    found.append(("ingress from", peer["podSelector"].get("matchLabels") or {}))
    return found


def check(objects, prefix, instance):
    problems = []
    names = {(o["kind"], o["metadata"]["name"]) for o in objects}
    for o in objects:
        where = f'{o["kind"]}/{o["metadata"]["name"]}'
        if not o["metadata"]["name"].startswith(prefix):
            problems.append(f"{where}: the name does not start with {prefix!r}")
        if (o["metadata"].get("labels") or {}).get(INSTANCE) != instance:
            problems.append(f"{where}: no label {INSTANCE}={instance}")
        for what, labels in selectors(o):
            if labels.get(INSTANCE) != instance:
                problems.append(f"{where}: {what} does not select {INSTANCE}={instance}: {labels}")
    sets = [o for o in objects if o["kind"] == "StatefulSet"]
    if len(sets) != 1:
        return problems + [f"expected one StatefulSet, found {len(sets)}"]
    sts = sets[0]
    headless = sts["spec"]["serviceName"]
    if ("Service", headless) not in names:
        problems.append(f"serviceName {headless!r} is no Service of this render")
    if sts["spec"]["template"]["metadata"]["labels"].get(INSTANCE) != instance:
        problems.append(f"the pod template has no label {INSTANCE}={instance}")
    for c in sts["spec"]["template"]["spec"]["containers"]:
        env = {e["name"]: e for e in c.get("env", [])}
        for name in ("SHOAL_ADVERTISE", "SHOAL_PEER_ADVERTISE", "SHOAL_DISCOVER"):
            value = (env.get(name) or {}).get("value", "")
            # Expanded by kustomize, or by Kubernetes from HEADLESS_SERVICE when that names it.
            expanded = value.replace("$(HEADLESS_SERVICE)", (env.get("HEADLESS_SERVICE") or {}).get("value", "?"))
            # The whole name: `shoal-headless` must not pass for `blue-shoal-headless`.
            if not (expanded.startswith(f"{headless}.$(POD_NAMESPACE)") or f".{headless}.$(POD_NAMESPACE)" in expanded):
                problems.append(f"{name}={value!r} does not name the headless Service {headless!r}")
        refs = [("ConfigMap", r["configMapRef"]["name"]) for r in c.get("envFrom", []) if "configMapRef" in r]
        refs += [("Secret", e["valueFrom"]["secretKeyRef"]["name"])
                 for e in c.get("env", []) if "secretKeyRef" in (e.get("valueFrom") or {})]
        for kind, name in refs:
            if (kind, name) not in names:
                problems.append(f"container {c['name']} refers to {kind} {name!r}, not in this render")
    return problems


def main():
    path, prefix, instance = sys.argv[1:4]
    with open(path) as f:
        objects = [o for o in yaml.safe_load_all(f) if o]
    problems = check(objects, prefix, instance)
    for p in problems:
        print(f"FAIL: {p}")
    if problems:
        sys.exit(1)
    print(f"ok: {len(objects)} objects named {prefix or '(no prefix)'}*, instance {instance}, every reference inside")


if __name__ == "__main__":
    main()
