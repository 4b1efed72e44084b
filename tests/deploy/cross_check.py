#!/usr/bin/env python3
"""Cross-object checks of shoal's rendered Kubernetes manifests.

Schema validation (kubernetes-validate) checks each object alone; this checks that the
objects agree with each other: selectors match the pod labels, ports and probes line up with
the node's listen addresses, the grace period covers the drain, referenced Secrets and
ConfigMaps exist, and so on.

Usage:
  cross_check.py RENDERED.yaml [--monitoring MONITORING.yaml]
  cross_check.py RENDERED.yaml --known-env HELP.txt

The first form runs the cross-object rules (and, with --monitoring, checks the rendered
ServiceMonitor against the Services). The second only checks that every SHOAL_* variable the
manifests set is one that `shoal serve --help` (saved in HELP.txt) lists.

Each rule prints one line, `ok: ...` or `FAIL: ...`; the exit code is 1 if any failed.
Needs PyYAML.
"""

import argparse
import re
import sys

import yaml


class Checker:
    """Collects the result lines and remembers whether any rule failed."""

    def __init__(self):
        self.failed = 0

    def ok(self, msg):
        print(f"ok: {msg}")

    def fail(self, msg):
        print(f"FAIL: {msg}")
        self.failed += 1

    def check(self, cond, ok_msg, fail_msg=None):
        if cond:
            self.ok(ok_msg)
        else:
            self.fail(fail_msg or ok_msg)
        return cond


def load(path):
    with open(path) as f:
        return [d for d in yaml.safe_load_all(f) if d]


def find(docs, kind, name=None):
    return [d for d in docs if d.get("kind") == kind and (name is None or d["metadata"]["name"] == name)]


def selects(match_labels, labels):
    """True if a non-empty matchLabels-style selector selects objects with these labels."""
    return bool(match_labels) and all(labels.get(k) == v for k, v in match_labels.items())


def label_selector_selects(selector, labels, empty_selects_all=False):
    """A LabelSelector (matchLabels and matchExpressions) against a label set. An empty
    selector selects every pod in Kubernetes (a NetworkPolicy's podSelector: {}); pass
    empty_selects_all=True where that meaning is wanted, else it counts as no match."""
    selector = selector or {}
    match_labels = selector.get("matchLabels") or {}
    expressions = selector.get("matchExpressions") or []
    if not match_labels and not expressions:
        return empty_selects_all
    if any(labels.get(k) != v for k, v in match_labels.items()):
        return False
    for e in expressions:
        key, op, values = e["key"], e["operator"], e.get("values") or []
        if op == "In" and labels.get(key) not in values:
            return False
        if op == "NotIn" and labels.get(key) in values:
            return False
        if op == "Exists" and key not in labels:
            return False
        if op == "DoesNotExist" and key in labels:
            return False
    return True


def parse_duration(text):
    """Seconds in a humantime-style duration: 60s, 1m30s, 500ms, 2min, 1h, 90 (seconds)."""
    text = str(text).strip()
    if re.fullmatch(r"\d+", text):
        return float(text)
    units = {"ms": 0.001, "s": 1, "sec": 1, "secs": 1, "m": 60, "min": 60, "mins": 60, "h": 3600, "hr": 3600}
    parts = re.findall(r"(\d+(?:\.\d+)?)\s*([a-z]+)", text)
    if not parts or "".join(n + u for n, u in parts) != text.replace(" ", ""):
        raise ValueError(f"not a duration: {text!r}")
    return sum(float(n) * units[u] for n, u in parts)


def port_of(addr):
    """The port of HOST:PORT (HOST may be a bracketed IPv6 address or contain $(VARS))."""
    m = re.fullmatch(r".*:(\d+)", str(addr))
    return int(m.group(1)) if m else None


def host_of(addr):
    return str(addr).rsplit(":", 1)[0]


def container_env(docs, container):
    """The container's environment as Kubernetes builds it: envFrom ConfigMaps first, then
    env in order, each $(VAR) expanded from what is defined before it. Returns (values,
    sources, problems): values maps name -> string (for literal values), sources maps name ->
    where it comes from ('configmap NAME', 'value', or the valueFrom dict)."""
    values, sources, problems = {}, {}, []
    for ef in container.get("envFrom") or []:
        ref = ef.get("configMapRef")
        if ref:
            for cm in find(docs, "ConfigMap", ref["name"]):
                for k, v in (cm.get("data") or {}).items():
                    values[k] = str(v)
                    sources[k] = f"configmap {ref['name']}"
    for e in container.get("env") or []:
        name = e["name"]
        if "value" in e:
            raw = str(e["value"])

            def expand(m):
                var = m.group(1)
                if var in values:
                    return values[var]
                if var in sources:  # valueFrom: known at run time only
                    return "$(" + var + ")"
                problems.append(f"{name} uses $({var}), which is not defined before it")
                return m.group(0)

            values[name] = re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", expand, raw)
            sources[name] = "value"
        else:
            sources[name] = e.get("valueFrom")
            values.pop(name, None)
    return values, sources, problems


def resolve_port(container, port):
    """A probe/Service/NetworkPolicy port (number or container port name) as a number."""
    if isinstance(port, int):
        return port
    for p in container.get("ports") or []:
        if p.get("name") == port:
            return p["containerPort"]
    return None


def check_core(docs, c):
    sts_list = find(docs, "StatefulSet")
    if not c.check(len(sts_list) == 1, "exactly one StatefulSet", f"expected one StatefulSet, found {len(sts_list)}"):
        return
    sts = sts_list[0]
    spec = sts["spec"]
    tmpl = spec["template"]
    labels = tmpl["metadata"].get("labels") or {}
    pod = tmpl["spec"]
    containers = [x for x in pod["containers"] if x["name"] == "shoal"]
    if not c.check(len(containers) == 1, "the pod has a container named shoal"):
        return
    ctr = containers[0]
    ports = {p.get("name"): p["containerPort"] for p in ctr.get("ports") or []}

    # --- selectors ---------------------------------------------------------------------
    sel = spec.get("selector") or {}
    c.check(
        label_selector_selects(sel, labels),
        "StatefulSet selector matches its pod template labels",
        f"StatefulSet selector {sel} does not match pod template labels {labels}",
    )
    for svc in find(docs, "Service"):
        s = svc["spec"].get("selector") or {}
        c.check(
            selects(s, labels),
            f"Service {svc['metadata']['name']} selector matches the pod labels",
            f"Service {svc['metadata']['name']} selector {s} does not match the pod labels {labels}",
        )
        for p in svc["spec"].get("ports") or []:
            target = p.get("targetPort", p["port"])
            c.check(
                resolve_port(ctr, target) is not None,
                f"Service {svc['metadata']['name']} port {p.get('name')} targets container port {target}",
                f"Service {svc['metadata']['name']} port {p.get('name')} targets {target!r}, "
                f"which is not a container port ({ports})",
            )
    pdbs = find(docs, "PodDisruptionBudget")
    c.check(len(pdbs) >= 1, "a PodDisruptionBudget exists", "no PodDisruptionBudget")
    for pdb in pdbs:
        s = pdb["spec"].get("selector") or {}
        c.check(
            label_selector_selects(s, labels),
            f"PodDisruptionBudget {pdb['metadata']['name']} selector matches the pod labels",
            f"PodDisruptionBudget {pdb['metadata']['name']} selector {s} does not match the pod labels {labels}",
        )
        c.check(
            pdb["spec"].get("maxUnavailable") == 1,
            f"PodDisruptionBudget {pdb['metadata']['name']} has maxUnavailable: 1",
            f"PodDisruptionBudget {pdb['metadata']['name']} should have maxUnavailable: 1, "
            f"has {pdb['spec'].get('maxUnavailable')!r} (minAvailable {pdb['spec'].get('minAvailable')!r})",
        )

    # --- governing Service ---------------------------------------------------------------
    service_name = spec.get("serviceName")
    hs = find(docs, "Service", service_name)
    if c.check(bool(hs), f"serviceName {service_name} is a Service", f"serviceName {service_name!r} names no Service"):
        hspec = hs[0]["spec"]
        c.check(hspec.get("clusterIP") == "None", f"Service {service_name} is headless (clusterIP: None)")
        c.check(
            hspec.get("publishNotReadyAddresses") is True,
            f"Service {service_name} has publishNotReadyAddresses: true",
        )
        hports = {p.get("name"): p for p in hspec.get("ports") or []}
        c.check(
            {"api", "peer"} <= set(hports),
            f"Service {service_name} has ports named api and peer",
            f"Service {service_name} ports {sorted(hports)} lack api or peer",
        )
    c.check(spec.get("podManagementPolicy") == "Parallel", "podManagementPolicy is Parallel")

    # --- listen addresses and ports ------------------------------------------------------
    env, sources, problems = container_env(docs, ctr)
    for p in problems:
        c.fail(f"env: {p}")
    if not problems:
        c.ok("every $(VAR) in env refers to a variable defined before it")
    for name, var, adv in (("api", "SHOAL_LISTEN", "SHOAL_ADVERTISE"), ("peer", "SHOAL_PEER_LISTEN", "SHOAL_PEER_ADVERTISE")):
        cport = ports.get(name)
        if not c.check(cport is not None, f"container port {name} exists", f"no container port named {name}"):
            continue
        c.check(
            port_of(env.get(var)) == cport,
            f"{var}={env.get(var)} listens on container port {name} ({cport})",
            f"{var}={env.get(var)!r} does not listen on container port {name} ({cport})",
        )
        c.check(
            port_of(env.get(adv)) == cport,
            f"{adv} uses port {cport}",
            f"{adv}={env.get(adv)!r} does not end in :{cport}",
        )
        c.check(
            host_of(env.get(adv, "")).startswith(f"$(POD_NAME).{service_name}."),
            f"{adv} is the pod's DNS name under {service_name}",
            f"{adv}={env.get(adv)!r} is not $(POD_NAME).{service_name}.<namespace>...",
        )
        for svc in find(docs, "Service"):
            for p in svc["spec"].get("ports") or []:
                if p.get("name") == name:
                    c.check(
                        resolve_port(ctr, p.get("targetPort", p["port"])) == cport,
                        f"Service {svc['metadata']['name']} port {name} reaches container port {cport}",
                        f"Service {svc['metadata']['name']} port {name} targetPort "
                        f"{p.get('targetPort')!r} is not container port {name} ({cport})",
                    )
    disc = env.get("SHOAL_DISCOVER", "")
    c.check(
        disc.startswith(f"{service_name}.") and port_of(disc) == ports.get("api"),
        f"SHOAL_DISCOVER={disc} is the headless Service and the api port",
        f"SHOAL_DISCOVER={disc!r} should be {service_name}.<namespace>...:{ports.get('api')}",
    )
    c.check(
        isinstance(sources.get("POD_NAME"), dict)
        and sources["POD_NAME"].get("fieldRef", {}).get("fieldPath") == "metadata.name",
        "POD_NAME comes from metadata.name",
    )
    c.check(
        isinstance(sources.get("POD_NAMESPACE"), dict)
        and sources["POD_NAMESPACE"].get("fieldRef", {}).get("fieldPath") == "metadata.namespace",
        "POD_NAMESPACE comes from metadata.namespace",
    )

    # --- data dir ------------------------------------------------------------------------
    data_dir = env.get("SHOAL_DATA_DIR")
    mounts = {m["mountPath"]: m["name"] for m in ctr.get("volumeMounts") or []}
    claims = {t["metadata"]["name"] for t in spec.get("volumeClaimTemplates") or []}
    c.check(
        mounts.get(data_dir) in claims,
        f"SHOAL_DATA_DIR={data_dir} is a volumeClaimTemplate mount",
        f"SHOAL_DATA_DIR={data_dir!r} is not mounted from a volumeClaimTemplate ({mounts}, {claims})",
    )

    # --- probes and metrics --------------------------------------------------------------
    for probe, path in (("livenessProbe", "/livez"), ("readinessProbe", "/readyz"), ("startupProbe", "/livez")):
        get = (ctr.get(probe) or {}).get("httpGet") or {}
        c.check(
            get.get("path") == path and resolve_port(ctr, get.get("port")) == ports.get("api"),
            f"{probe} is GET {path} on the api port",
            f"{probe} is {get or 'missing'}, expected GET {path} on port api ({ports.get('api')})",
        )
    ann = tmpl["metadata"].get("annotations") or {}
    c.check(
        ann.get("prometheus.io/scrape") == "true"
        and ann.get("prometheus.io/port") == str(ports.get("api"))
        and ann.get("prometheus.io/path") == "/metrics",
        "prometheus.io annotations scrape /metrics on the api port",
        f"prometheus.io annotations {ann} do not point at /metrics on port {ports.get('api')}",
    )

    # --- resources -----------------------------------------------------------------------
    res = ctr.get("resources") or {}
    req_mem, lim_mem = (res.get("requests") or {}).get("memory"), (res.get("limits") or {}).get("memory")
    c.check(
        lim_mem is not None and req_mem == lim_mem,
        f"memory request == limit ({lim_mem})",
        f"memory request {req_mem!r} != limit {lim_mem!r}",
    )
    mem = sources.get("SHOAL_MEMORY_LIMIT")
    rf = (mem or {}).get("resourceFieldRef", {}) if isinstance(mem, dict) else {}
    c.check(
        rf.get("resource") == "limits.memory" and rf.get("containerName", ctr["name"]) == ctr["name"],
        "SHOAL_MEMORY_LIMIT is the container's limits.memory (downward API)",
        f"SHOAL_MEMORY_LIMIT comes from {mem!r}, expected resourceFieldRef limits.memory of {ctr['name']}",
    )

    # --- graceful stop -------------------------------------------------------------------
    pre = ((ctr.get("lifecycle") or {}).get("preStop")) or {}
    sleep = 0.0
    if "sleep" in pre:
        sleep = float(pre["sleep"]["seconds"])
    elif "exec" in pre:
        cmd = pre["exec"]["command"]
        if len(cmd) == 2 and cmd[0].endswith("sleep"):
            sleep = parse_duration(cmd[1])
    try:
        drain = parse_duration(env.get("SHOAL_DRAIN_TIMEOUT", "60s"))  # the node's default
    except ValueError as e:
        c.fail(f"SHOAL_DRAIN_TIMEOUT: {e}")
        drain = float("inf")
    grace = pod.get("terminationGracePeriodSeconds", 30)
    c.check(
        grace >= sleep + drain,
        f"terminationGracePeriodSeconds {grace} >= preStop sleep {sleep:g}s + drain timeout {drain:g}s",
        f"terminationGracePeriodSeconds {grace} < preStop sleep {sleep:g}s + drain timeout {drain:g}s",
    )
    c.check(
        pod.get("enableServiceLinks") is False,
        "enableServiceLinks: false (no SHOAL_PORT=tcp://... from the Service named shoal)",
    )

    # --- referenced Secret and ConfigMaps -------------------------------------------------
    for e in ctr.get("env") or []:
        ref = (e.get("valueFrom") or {}).get("secretKeyRef")
        if not ref:
            continue
        secrets = find(docs, "Secret", ref["name"])
        keys = set()
        for s in secrets:
            keys |= set((s.get("data") or {}).keys()) | set((s.get("stringData") or {}).keys())
        if not secrets:
            c.fail(f"{e['name']}: Secret {ref['name']} does not exist")
        elif ref["key"] in keys:
            c.ok(f"{e['name']}: Secret {ref['name']} has key {ref['key']}")
        elif ref.get("optional"):
            c.ok(f"{e['name']}: Secret {ref['name']} lacks key {ref['key']}, which is optional")
        else:
            c.fail(f"{e['name']}: Secret {ref['name']} has no key {ref['key']} (keys: {sorted(keys)})")
    for ef in ctr.get("envFrom") or []:
        ref = ef.get("configMapRef")
        if ref:
            c.check(
                bool(find(docs, "ConfigMap", ref["name"])) or ref.get("optional", False),
                f"envFrom ConfigMap {ref['name']} exists",
            )

    # --- NetworkPolicy -------------------------------------------------------------------
    peer, api = ports.get("peer"), ports.get("api")
    policies = [
        np
        for np in find(docs, "NetworkPolicy")
        if label_selector_selects(np["spec"].get("podSelector"), labels, empty_selects_all=True)
        and "Ingress" in (np["spec"].get("policyTypes") or ["Ingress"])
    ]
    if c.check(bool(policies), "a NetworkPolicy selects the shoal pods"):
        peer_ok, api_ok = True, False
        peer_rules = 0
        for np in policies:
            for rule in np["spec"].get("ingress") or []:
                rule_ports = [resolve_port(ctr, p.get("port")) for p in rule.get("ports") or []]
                covers = lambda port: not rule.get("ports") or port in rule_ports  # noqa: E731
                peers = rule.get("from") or []
                if covers(peer):
                    peer_rules += 1
                    # Every source must be a same-namespace podSelector that selects shoal pods.
                    if not peers or any(
                        "namespaceSelector" in f or "ipBlock" in f or not label_selector_selects(f.get("podSelector"), labels)
                        for f in peers
                    ):
                        peer_ok = False
                if covers(api):
                    api_ok = True
        c.check(
            peer_rules > 0 and peer_ok,
            f"NetworkPolicy: peer port {peer} only from shoal pods",
            f"NetworkPolicy: peer port {peer} is open to more than the shoal pods, or not open at all",
        )
        c.check(api_ok, f"NetworkPolicy: api port {api} is allowed", f"NetworkPolicy: no rule allows api port {api}")

    # --- anti-affinity ---------------------------------------------------------------------
    terms = ((pod.get("affinity") or {}).get("podAntiAffinity") or {}).get(
        "preferredDuringSchedulingIgnoredDuringExecution"
    ) or []
    c.check(
        any(
            t["podAffinityTerm"].get("topologyKey") == "kubernetes.io/hostname"
            and label_selector_selects(t["podAffinityTerm"].get("labelSelector"), labels)
            for t in terms
        ),
        "soft pod anti-affinity by hostname selects the shoal pods",
    )

    # --- security ------------------------------------------------------------------------
    psc, csc = pod.get("securityContext") or {}, ctr.get("securityContext") or {}
    c.check(csc.get("readOnlyRootFilesystem") is True, "readOnlyRootFilesystem: true")
    c.check(
        csc.get("runAsNonRoot", psc.get("runAsNonRoot")) is True,
        "runAsNonRoot: true",
    )
    c.check(
        csc.get("allowPrivilegeEscalation") is False and "ALL" in ((csc.get("capabilities") or {}).get("drop") or []),
        "allowPrivilegeEscalation: false and all capabilities dropped",
    )
    c.check("/tmp" in mounts, "/tmp is a writable mount (the root filesystem is read-only)")
    image = ctr.get("image", "")
    c.check(
        ":" in image.rsplit("/", 1)[-1] and not image.endswith(":latest"),
        f"image {image} has a pinned tag",
    )


def check_monitoring(docs, mon_docs, c):
    """The ServiceMonitor selects exactly the headless Service and scrapes /metrics on api."""
    sms = find(mon_docs, "ServiceMonitor")
    if not c.check(len(sms) == 1, "monitoring: one ServiceMonitor", f"monitoring: {len(sms)} ServiceMonitors"):
        return
    sm = sms[0]
    selected = [
        s["metadata"]["name"]
        for s in find(docs, "Service")
        if label_selector_selects(sm["spec"].get("selector"), s["metadata"].get("labels") or {})
    ]
    headless = find(docs, "StatefulSet")[0]["spec"]["serviceName"]
    c.check(
        selected == [headless],
        f"monitoring: ServiceMonitor selects the headless Service {headless} only",
        f"monitoring: ServiceMonitor selects {selected}, expected [{headless}]",
    )
    for ep in sm["spec"].get("endpoints") or []:
        svc_ports = [p.get("name") for s in find(docs, "Service", headless) for p in s["spec"].get("ports") or []]
        c.check(
            ep.get("port") == "api" and ep.get("port") in svc_ports and ep.get("path", "/metrics") == "/metrics",
            "monitoring: ServiceMonitor scrapes /metrics on port api",
            f"monitoring: endpoint {ep} is not /metrics on the Service's api port",
        )


RULES = "deploy/prometheus-rules.yaml"
PROMETHEUS_RULE = "deploy/monitoring/prometheusrule.yaml"
PROMETHEUS_RULE_HEAD = """\
# Generated from deploy/prometheus-rules.yaml (the source: edit that, then regenerate this with
# `python3 tests/deploy/cross_check.py --write-prometheusrule`): the same recording rules and
# alerts as a Prometheus Operator PrometheusRule, applied with the ServiceMonitor
# (`kubectl apply -k deploy/monitoring/`). tests/deploy/check.sh fails when the two differ.
# Like the ServiceMonitor, it may need the label your Prometheus selects rules by
# (kube-prometheus-stack: `release: <release name>`, see ruleSelector): add it under
# commonLabels in kustomization.yaml.
"""


def write_prometheusrule():
    """Writes the PrometheusRule from the rules file (multi-line expressions as blocks)."""

    class Dumper(yaml.SafeDumper):
        pass

    def text(dumper, data):
        return dumper.represent_scalar("tag:yaml.org,2002:str", data, style="|" if "\n" in data else None)

    Dumper.add_representer(str, text)
    with open(RULES) as f:
        groups = yaml.safe_load(f)["groups"]
    labels = {"app.kubernetes.io/name": "shoal", "app.kubernetes.io/component": "cache",
              "app.kubernetes.io/instance": "shoal"}
    rule = {"apiVersion": "monitoring.coreos.com/v1", "kind": "PrometheusRule",
            "metadata": {"name": "shoal", "labels": labels}, "spec": {"groups": groups}}
    with open(PROMETHEUS_RULE, "w") as f:
        f.write(PROMETHEUS_RULE_HEAD + yaml.dump(rule, Dumper=Dumper, sort_keys=False, width=200, allow_unicode=True))


def check_prometheusrule(mon_docs, c):
    """The rendered PrometheusRule holds exactly the rules file's groups (one source)."""
    rules = find(mon_docs, "PrometheusRule")
    if not c.check(len(rules) == 1, "monitoring: one PrometheusRule", f"monitoring: {len(rules)} PrometheusRules"):
        return
    with open(RULES) as f:
        groups = yaml.safe_load(f)["groups"]
    c.check(
        rules[0]["spec"].get("groups") == groups,
        f"monitoring: the PrometheusRule holds the groups of {RULES}",
        f"monitoring: the PrometheusRule differs from {RULES}: run `python3 tests/deploy/cross_check.py --write-prometheusrule`",
    )


def manifest_env_names(docs):
    """Every SHOAL_* variable the manifests give the shoal container (env and envFrom)."""
    names = set()
    for sts in find(docs, "StatefulSet"):
        for ctr in sts["spec"]["template"]["spec"]["containers"]:
            _, sources, _ = container_env(docs, ctr)
            names |= {n for n in sources if n.startswith("SHOAL_")}
    return names


def check_known_env(docs, help_path, c):
    with open(help_path) as f:
        # clap prints `[env: NAME=]` (`[env: NAME=VALUE]` when set, `[env: NAME]` for
        # hide_env_values), and may wrap the line after `[env:`.
        known = set(re.findall(r"\[env:\s+(SHOAL_[A-Z0-9_]+)[=\]]", f.read()))
    if not c.check(bool(known), f"`shoal serve --help` lists {len(known)} SHOAL_* variables", "no [env: SHOAL_*=] in the help text"):
        return
    for name in sorted(manifest_env_names(docs)):
        c.check(name in known, f"{name} is known to `shoal serve`", f"{name} is set by the manifests but unknown to `shoal serve`")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    if sys.argv[1:] == ["--write-prometheusrule"]:
        write_prometheusrule()
        return
    ap.add_argument("rendered", help="output of `kubectl kustomize deploy/`")
    ap.add_argument("--monitoring", help="output of `kubectl kustomize deploy/monitoring/`")
    ap.add_argument("--known-env", help="output of `shoal serve --help`: only check the SHOAL_* names")
    args = ap.parse_args()

    c = Checker()
    docs = load(args.rendered)
    if args.known_env:
        check_known_env(docs, args.known_env, c)
    else:
        check_core(docs, c)
        if args.monitoring:
            check_monitoring(docs, load(args.monitoring), c)
            check_prometheusrule(load(args.monitoring), c)
    print(f"{c.failed} failed" if c.failed else "all passed")
    sys.exit(1 if c.failed else 0)


if __name__ == "__main__":
    main()
