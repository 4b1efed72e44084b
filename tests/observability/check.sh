#!/usr/bin/env bash
# Checks shoal's observability files against Prometheus's own tools and a live node:
#   1. installs promtool (Debian's `prometheus` package) when it is missing;
#   2. deploy/prometheus-rules.yaml: `promtool check rules` and the unit tests in
#      tests/observability/rules_test.yaml (`promtool test rules`);
#   3. grafana/shoal.json: JSON structure (schemaVersion 39, DS_PROMETHEUS input and variable,
#      datasources, unique ids, titles and descriptions, units, grid without overlaps,
#      $__rate_interval in range selectors), and every PromQL expression (targets and the
#      label_values() selectors of variables) parsed by `promtool check rules`, after substituting
#      Grafana variables;
#   4. a live node (target/debug/shoal, built beforehand): /readyz, one put and get, /metrics
#      through `promtool check metrics`, and every metric name the rules and the dashboard use
#      must be in that scrape;
#   5. negative self-tests: the name check reports an unknown metric, and an unsubstituted
#      Grafana variable is a parse error.
# Usage: tests/observability/check.sh          (needs python3, curl; root or passwordless sudo
#        to install promtool)
set -euo pipefail
cd "$(dirname "$0")/../.."

RULES=deploy/prometheus-rules.yaml
RULES_TEST=tests/observability/rules_test.yaml
DASHBOARD=grafana/shoal.json
BIN=target/debug/shoal

failures=()
fail() {
    echo "FAIL: $*" >&2
    failures+=("$*")
}
die() {
    echo "check.sh: $*" >&2
    exit 1
}

# The temp dir, the node's lifecycle and the tool checks (python3, curl).
# shellcheck source=tests/node.sh
source tests/node.sh

# ------------------------------------------------------------------ 1. promtool
prometheus_pids() { # PIDs of running processes named exactly "prometheus"
    local comm pid
    for comm in /proc/[0-9]*/comm; do
        [ "$(cat "$comm" 2>/dev/null)" = prometheus ] || continue
        pid=${comm#/proc/}
        echo "${pid%/comm}"
    done
    return 0
}
install_promtool() {
    command -v promtool >/dev/null 2>&1 && return 0
    echo "== installing promtool (Debian package prometheus)"
    local sudo="" before pid
    [ "$(id -u)" -ne 0 ] && sudo="sudo -n"
    before=" $(prometheus_pids | tr '\n' ' ') "
    $sudo apt-get update -qq || die "apt-get update failed; cannot install promtool"
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends prometheus >/dev/null \
        || die "apt-get install prometheus failed; cannot install promtool"
    # The package's postinst starts the Prometheus server where the init system allows it
    # (containers usually deny it through policy-rc.d). Stop a server the install started: by
    # its service, else by the PIDs that were not there before the install.
    for pid in $(prometheus_pids); do
        case "$before" in *" $pid "*) continue ;; esac
        echo "check.sh: stopping the prometheus server the package started (pid $pid)"
        $sudo service prometheus stop >/dev/null 2>&1 || true
        kill -0 "$pid" 2>/dev/null && { $sudo kill "$pid" 2>/dev/null || true; }
    done
    command -v promtool >/dev/null 2>&1 || die "promtool still missing after installing prometheus"
}
install_promtool
echo "== $(promtool --version 2>&1 | head -n 1)"

# The Python half: structure checks, expression extraction and the metric-name check.
cat >"$work/obs.py" <<'PY'
"""Helpers of tests/observability/check.sh (stdlib only)."""
import json
import re
import sys

DS = {"type": "prometheus", "uid": "${DS_PROMETHEUS}"}
UNITS = {"bytes", "s", "ops", "percentunit", "short", "none", "Bps"}
# Grafana's built-in variables, replaced by a value of the same kind.
BUILTINS = {"__rate_interval": "5m", "__interval": "1m", "__range": "1h", "__range_s": "3600",
            "__range_ms": "3600000", "__interval_ms": "60000"}
# Names Prometheus makes itself: not in a node's /metrics.
PROMETHEUS_MADE = {"up", "ALERTS", "ALERTS_FOR_STATE", "scrape_duration_seconds", "scrape_samples_scraped",
                   "scrape_samples_post_metric_relabeling", "scrape_series_added", "scrape_timeout_seconds",
                   "scrape_sample_limit", "scrape_body_size_bytes"}
KEYWORDS = {"and", "or", "unless", "by", "without", "on", "ignoring", "group_left", "group_right", "bool",
            "offset", "inf", "nan", "atan2"}


def substitute(expr):
    """Replaces Grafana variables: built-ins by a duration/number, others ($instance, ${instance},
    ${instance:regex}, [[instance]]) by the regex `.*` (they sit inside =~ label matchers)."""
    def builtin(m):
        name = m.group(1) or m.group(2)
        if name in BUILTINS:
            return BUILTINS[name]
        if name.startswith("__"):
            raise SystemExit(f"unknown Grafana built-in variable ${name} in: {expr}")
        return ".*"
    expr = re.sub(r"\$\{(\w+)(?::[\w]+)?\}|\$(\w+)", builtin, expr)
    return re.sub(r"\[\[(\w+)(?::\w+)?\]\]", ".*", expr)


def metric_names(expr):
    """Metric names a PromQL expression selects (syntax is promtool's job; this only finds names)."""
    s = re.sub(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`', '""', expr)  # strings
    s = re.sub(r"\{[^{}]*\}", " ", s)                                           # label matchers
    s = re.sub(r"\[[^\[\]]*\]", " ", s)                                         # ranges, subqueries
    s = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^()]*\)", " ", s)  # label lists
    names = set()
    for m in re.finditer(r"(?<![\w.:])[A-Za-z_:][A-Za-z0-9_:]*", s):
        name = m.group(0)
        if name in KEYWORDS or re.match(r"\s*\(", s[m.end():]):  # keyword or function/aggregation
            continue
        names.add(name)
    return names


def dashboard(path, rules_out, exprs_out):
    d = json.load(open(path))
    errors = []
    err = errors.append
    if d.get("schemaVersion") != 39:
        err(f"schemaVersion is {d.get('schemaVersion')!r}, expected 39")
    for key in ("uid", "title"):
        if not d.get(key):
            err(f"top-level {key} missing")
    if not any(i.get("name") == "DS_PROMETHEUS" and i.get("type") == "datasource"
               and i.get("pluginId") == "prometheus" for i in d.get("__inputs", [])):
        err("__inputs has no DS_PROMETHEUS datasource input (pluginId prometheus)")
    if not any(r.get("type") == "datasource" and r.get("id") == "prometheus" for r in d.get("__requires", [])):
        err("__requires does not require the prometheus datasource")
    exprs = []
    variables = {v.get("name"): v for v in d.get("templating", {}).get("list", [])}
    v = variables.get("DS_PROMETHEUS")
    if not v or v.get("type") != "datasource" or v.get("query") != "prometheus":
        err("templating needs a DS_PROMETHEUS variable of type datasource with query prometheus")
    v = variables.get("instance")
    if not v or not v.get("multi") or not v.get("includeAll"):
        err("templating needs a multi, includeAll `instance` variable")
    for name, v in variables.items():
        if v.get("type") != "query":
            continue
        if v.get("datasource") != DS:
            err(f"variable {name}: datasource is {v.get('datasource')!r}, expected {DS}")
        q = v.get("query")
        q = q.get("query", "") if isinstance(q, dict) else (q or "")
        m = re.fullmatch(r"\s*label_values\((.*),\s*(\w+)\s*\)\s*", q)
        if not m:
            err(f"variable {name}: query {q!r} is not label_values(<selector>, <label>)")
            continue
        exprs.append({"where": f"variable {name}", "expr": substitute(m.group(1))})

    panels, ids, titles, descriptions = [], {}, {}, {}

    def walk(items, parent):
        for p in items:
            panels.append((p, parent))
            walk(p.get("panels", []), p)
    walk(d.get("panels", []), None)
    if not panels:
        err("no panels")
    for p, parent in panels:
        pid, title, kind = p.get("id"), p.get("title", ""), p.get("type")
        label = f"panel {pid} {title!r}"
        if not isinstance(pid, int):
            err(f"{label}: id must be an integer")
        elif pid in ids:
            err(f"{label}: id {pid} also used by {ids[pid]!r}")
        ids.setdefault(pid, title)
        g = p.get("gridPos")
        if not isinstance(g, dict) or not all(isinstance(g.get(k), int) for k in "xywh"):
            err(f"{label}: gridPos with integer x, y, w, h missing")
        elif g["x"] < 0 or g["w"] <= 0 or g["h"] <= 0 or g["x"] + g["w"] > 24:
            err(f"{label}: gridPos {g} outside the 24-column grid")
        if not title:
            err(f"panel {pid}: no title")
        if kind == "row":
            if p.get("datasource") not in (None, DS):
                err(f"{label}: row datasource {p.get('datasource')!r}, expected {DS}")
            if parent is not None:
                err(f"{label}: a row inside a row")
            if p.get("panels") and not p.get("collapsed"):
                err(f"{label}: only a collapsed row may nest panels")
            continue
        if title in titles:
            err(f"{label}: title also used by panel {titles[title]}")
        titles.setdefault(title, pid)
        desc = p.get("description", "")
        if not desc:
            err(f"{label}: no description")
        elif desc in descriptions:
            err(f"{label}: description also used by panel {descriptions[desc]}")
        descriptions.setdefault(desc, pid)
        if p.get("datasource") != DS:
            err(f"{label}: datasource {p.get('datasource')!r}, expected {DS}")
        unit = p.get("fieldConfig", {}).get("defaults", {}).get("unit")
        if unit not in UNITS:
            err(f"{label}: unit {unit!r} not one of {sorted(UNITS)}")
        targets = p.get("targets") or []
        if not targets:
            err(f"{label}: no targets")
        refs = set()
        for t in targets:
            ref = t.get("refId")
            where = f"{label} target {ref}"
            if not ref or ref in refs:
                err(f"{where}: missing or repeated refId")
            refs.add(ref)
            if t.get("datasource") != DS:
                err(f"{where}: datasource {t.get('datasource')!r}, expected {DS}")
            expr = t.get("expr", "")
            if not expr.strip():
                err(f"{where}: empty expr")
                continue
            for rng in re.findall(r"\[([^\[\]]*)\]", expr):
                if rng not in ("$__rate_interval", "$__range"):
                    err(f"{where}: range [{rng}] should be [$__rate_interval] (or [$__range] for totals)")
            exprs.append({"where": where, "expr": substitute(expr)})

    # Layout: top-level panels (rows included) must not overlap; the panels of a collapsed row
    # must not overlap each other and sit below their row.
    def overlaps(group):
        for i, (a, _) in enumerate(group):
            for b, _ in group[i + 1:]:
                ga, gb = a.get("gridPos") or {}, b.get("gridPos") or {}
                try:
                    if (ga["x"] < gb["x"] + gb["w"] and gb["x"] < ga["x"] + ga["w"]
                            and ga["y"] < gb["y"] + gb["h"] and gb["y"] < ga["y"] + ga["h"]):
                        err(f"panels {a.get('id')} and {b.get('id')} overlap: {ga} / {gb}")
                except (KeyError, TypeError):
                    pass
    overlaps([x for x in panels if x[1] is None])
    for row in [p for p, parent in panels if p.get("type") == "row"]:
        nested = [x for x in panels if x[1] is row]
        overlaps(nested)
        for p, _ in nested:
            if p.get("gridPos", {}).get("y", 0) <= row.get("gridPos", {}).get("y", 0):
                err(f"panel {p.get('id')} is above its collapsed row {row.get('id')}")

    with open(rules_out, "w") as f:
        f.write("groups:\n  - name: dashboard\n    rules:\n")
        for i, e in enumerate(exprs):
            f.write(f"      - record: dashboard:expr_{i}\n        expr: {json.dumps(e['expr'])}\n")
    json.dump(exprs, open(exprs_out, "w"), indent=1)
    for e in errors:
        print(f"  {path}: {e}")
    print(f"  {path}: {len(panels)} panels, {len(exprs)} expressions")
    return 1 if errors else 0


def rules(path, exprs_out):
    """The expr of every rule in a rules file, without a YAML library: plain, quoted and block
    scalars (| > with chomping); check.sh compares the count with promtool's."""
    lines = open(path).read().split("\n")
    exprs, count = [], 0
    name = "?"
    for i, line in enumerate(lines):
        m = re.match(r"^\s*-?\s*(record|alert):\s*(\S.*?)\s*$", line)
        if m:
            count += 1
            name = f"{m.group(1)} {m.group(2)}"
        m = re.match(r"^(\s*)(-\s+)?expr:\s*(.*?)\s*$", line)
        if not m:
            continue
        indent = len(m.group(1)) + len(m.group(2) or "")
        value = m.group(3)
        if re.fullmatch(r"[|>][-+]?", value):
            block = []
            for nxt in lines[i + 1:]:
                if nxt.strip() and len(nxt) - len(nxt.lstrip()) <= indent:
                    break
                block.append(nxt.strip())
            value = " ".join(x for x in block if x)
        elif value.startswith("'"):
            value = value[1:-1].replace("''", "'")
        elif value.startswith('"'):
            value = json.loads(value)
        else:
            value = re.split(r"\s+#", value)[0]
        exprs.append({"where": f"{path}: {name}", "expr": value})
    if len(exprs) != count:
        print(f"  {path}: found {count} rules but {len(exprs)} expr fields", file=sys.stderr)
        return 1
    json.dump(exprs, open(exprs_out, "w"), indent=1)
    print(count)
    return 0


def names(scrape, *expr_files):
    """Every metric name of the expressions must be a sample name of the scrape (a histogram
    counts through its _bucket/_sum/_count samples) or a declared gauge/counter family;
    recording-rule outputs (with `:`) and names Prometheus makes are exempt."""
    exported, families = set(), {}
    for line in open(scrape):
        if line.startswith("# TYPE "):
            parts = line.split()
            if len(parts) >= 4:
                families[parts[2]] = parts[3]
        elif line.strip() and not line.startswith("#"):
            m = re.match(r"[A-Za-z_:][A-Za-z0-9_:]*", line)
            if m:
                exported.add(m.group(0))
    used = {}
    for path in expr_files:
        for e in json.load(open(path)):
            for n in metric_names(e["expr"]):
                used.setdefault(n, []).append(e["where"])
    checked = sorted(n for n in used if ":" not in n and n not in PROMETHEUS_MADE)
    exempt = sorted(n for n in used if n not in checked)
    # Per-peer gauges have no samples on a node alone (it has no peers), but the node
    # declares their families (# TYPE ... gauge) from startup: a declared gauge or counter counts.
    declared = {n for n, kind in families.items() if kind in ("gauge", "counter")}
    missing = [n for n in checked if n not in exported and n not in declared]
    print(f"  metric names used ({len(checked)} checked, exempt: {', '.join(exempt) or 'none'}):")
    for n in checked:
        print(f"    {'MISSING ' if n in missing else ''}{n}")
    for n in missing:
        hint = ""
        if n.endswith("_bucket") and families.get(n[: -len("_bucket")]) == "summary":
            hint = " (exported as a summary: configure histogram buckets)"
        if n in families and families[n] in ("histogram", "summary"):
            hint = f" (a {families[n]}: select {n}_bucket/_sum/_count)"
        print(f"  missing from /metrics: {n}{hint}, used by {'; '.join(used[n][:3])}"
              f"{' …' if len(used[n]) > 3 else ''}")
    return 1 if missing else 0


def selftest():
    cases = {
        'sum by (op, le) (rate(shoal_a_bucket{instance=~".*", op!="x"}[5m]))': {"shoal_a_bucket"},
        "shoal_b / on (instance) group_left (peer) (shoal_c > 0) or shoal_d offset 10m": {"shoal_b", "shoal_c", "shoal_d"},
        "time() - process_start_time_seconds and on (instance) up == bool 1": {"process_start_time_seconds", "up"},
        'label_replace(shoal_e, "dst", "$1", "src", "(.*)") * 1e-3 + scalar(max(shoal_f))': {"shoal_e", "shoal_f"},
        "histogram_quantile(0.99, sum(rate(shoal_g[5m:1m])) by (le)) + shoal:rec:rate5m": {"shoal_g", "shoal:rec:rate5m"},
    }
    bad = 0
    for expr, want in cases.items():
        got = metric_names(expr)
        if got != want:
            print(f"  metric_names({expr!r}) = {sorted(got)}, expected {sorted(want)}")
            bad = 1
    for raw, want in {"x[$__rate_interval]": "x[5m]", 'y{i=~"$instance",j=~"${instance:regex}"}': 'y{i=~".*",j=~".*"}'}.items():
        if substitute(raw) != want:
            print(f"  substitute({raw!r}) = {substitute(raw)!r}, expected {want!r}")
            bad = 1
    return bad


if __name__ == "__main__":
    cmd, args = sys.argv[1], sys.argv[2:]
    sys.exit({"dashboard": dashboard, "rules": rules, "names": names, "selftest": selftest}[cmd](*args))
PY
obs() { python3 "$work/obs.py" "$@"; }

# check_rules FILE EXPECTED_COUNT: promtool's parser over FILE, and it must see every rule.
check_rules() {
    local out
    if ! out=$(promtool check rules "$1" 2>&1); then
        echo "$out" | sed 's/^/  /'
        return 1
    fi
    echo "$out" | sed 's/^/  /'
    if [ -n "${2:-}" ] && ! grep -q "SUCCESS: $2 rules found" <<<"$out"; then
        echo "  expected $2 rules in $1"
        return 1
    fi
}

# ------------------------------------------------------------------ 2. rules
echo "== rules: $RULES"
rule_count=$(obs rules "$RULES" "$work/rules_exprs.json") || die "could not extract the expressions of $RULES"
check_rules "$RULES" "$rule_count" || fail "promtool check rules $RULES"
echo "== rules unit tests: $RULES_TEST"
if ! promtool test rules "$RULES_TEST" 2>&1 | sed '/^$/d; s/^/  /'; then
    fail "promtool test rules $RULES_TEST"
fi

# ------------------------------------------------------------------ 3. dashboard
echo "== dashboard: $DASHBOARD"
obs dashboard "$DASHBOARD" "$work/dashboard_rules.yaml" "$work/dashboard_exprs.json" \
    || fail "$DASHBOARD structure"
if [ -s "$work/dashboard_exprs.json" ]; then
    expr_count=$(python3 -c 'import json,sys; print(len(json.load(open(sys.argv[1]))))' "$work/dashboard_exprs.json")
    check_rules "$work/dashboard_rules.yaml" "$expr_count" || fail "PromQL of $DASHBOARD does not parse"
fi

# ------------------------------------------------------------------ 5a. self-tests (no node needed)
echo "== self-tests"
if obs selftest; then
    echo "  ok: metric-name extraction and variable substitution"
else
    fail "metric-name extraction self-test"
fi
printf 'groups:\n  - name: t\n    rules:\n      - record: t:x\n        expr: rate(shoal_items[$__rate_interval])\n' \
    >"$work/unsubstituted.yaml"
if promtool check rules "$work/unsubstituted.yaml" >/dev/null 2>&1; then
    fail "self-test: promtool accepted an unsubstituted \$__rate_interval"
else
    echo "  ok: an unsubstituted \$__rate_interval is a parse error"
fi

# ------------------------------------------------------------------ 4. live node
echo "== live node: $BIN"
start_node "$BIN"
echo "  ready on $base (pid $node_pid)"
value="observability check $$"
curl -fsS -X PUT --data-binary "$value" "$base/v1/kv/observability-check" >/dev/null || fail "PUT /v1/kv/observability-check"
got=$(curl -fsS "$base/v1/kv/observability-check") || fail "GET /v1/kv/observability-check"
[ "${got:-}" = "$value" ] || fail "GET /v1/kv/observability-check answered ${got:-nothing}, expected $value"
curl -fsS "$base/metrics" >"$work/metrics.txt" || die "GET /metrics failed"
echo "  /metrics: $(grep -vc '^#' "$work/metrics.txt") samples"

# promtool check metrics exits 1 when the text does not parse (a hard error, message on
# stderr) and 3 when it parses but breaks a naming rule (lint lines `name problem` on stdout:
# missing HELP, counters without _total, non-base units, ...). Both fail the check: a parse
# error breaks every scrape, and a lint is a metric name we want to fix while nothing depends
# on it yet, not to ignore. Every line it prints is shown.
echo "== promtool check metrics"
set +e
lint=$(promtool check metrics <"$work/metrics.txt" 2>&1)
lint_rc=$?
set -e
[ -n "$lint" ] && echo "$lint" | sed 's/^/  /'
case $lint_rc in
    0) echo "  ok: no problems" ;;
    3) fail "promtool check metrics: lint problems in /metrics ($(grep -c . <<<"$lint") lines above)" ;;
    *) fail "promtool check metrics: /metrics does not parse (exit $lint_rc)" ;;
esac

echo "== metric names of the rules and the dashboard in /metrics"
obs names "$work/metrics.txt" "$work/rules_exprs.json" "$work/dashboard_exprs.json" \
    || fail "the rules or the dashboard use metric names the node does not export"

# ------------------------------------------------------------------ 5b. negative name check
echo "== self-test: an unknown metric is reported"
echo '[{"where": "self-test", "expr": "sum(rate(shoal_no_such_metric[5m])) / sum(shoal_items)"}]' \
    >"$work/bad_exprs.json"
set +e
bad=$(obs names "$work/metrics.txt" "$work/bad_exprs.json" 2>&1)
bad_rc=$?
set -e
if [ "$bad_rc" -ne 0 ] && grep -q "missing from /metrics: shoal_no_such_metric" <<<"$bad" \
    && ! grep -q "missing from /metrics: shoal_items" <<<"$bad"; then
    echo "  ok: shoal_no_such_metric reported, shoal_items accepted"
else
    echo "$bad" | sed 's/^/  /'
    fail "self-test: the name check did not report shoal_no_such_metric"
fi

echo "== done in ${SECONDS}s"
if [ "${#failures[@]}" -gt 0 ]; then
    echo "check.sh: ${#failures[@]} failure(s):" >&2
    printf '  - %s\n' "${failures[@]}" >&2
    exit 1
fi
echo "check.sh: all observability checks passed"
