#!/usr/bin/env python3
"""Side-by-side benchmark of shoal and Redis on this machine (compare.sh builds shoal and runs it).

Installs Redis (the Debian packages) first if it is missing.

Every figure is the median of --runs clean runs. A run during which other processes used more
than 0.1 core (measured from /proc/stat) is repeated. Servers listen on 127.0.0.1 only and
every process started here is stopped by its PID, also on errors.

Single-node figures pin the server to core 0 and the load generator to core 1, as in
shared/notes/perf-baselines.md: Redis is single-threaded, and shoal runs one worker thread,
so both are compared per core. The cluster figures leave everything unpinned.
"""

import argparse
import json
import os
import resource
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request

TICKS = os.sysconf("SC_CLK_TCK")
FOREIGN_LIMIT = 0.1


def cpu_seconds(pid):
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS


def machine_busy():
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:9]]
    return (sum(v) - v[3] - v[4]) / TICKS


def rss_bytes(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def children_cpu():
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_port(port, deadline=30):
    end = time.time() + deadline
    while time.time() < end:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"nothing listens on 127.0.0.1:{port}")


class Processes:
    """Every server started here, stopped by PID on exit."""

    def __init__(self):
        self.procs = []

    def start(self, args, pin=None, env=None):
        if pin is not None:
            args = ["taskset", "-c", str(pin)] + args
        p = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
        self.procs.append(p)
        return p

    def stop(self, p):
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()

    def stop_all(self):
        for p in self.procs:
            self.stop(p)


def measured(run, runs, label):
    """Runs `run()` until `runs` clean results; returns the list of results."""
    results, tries = [], 0
    while len(results) < runs:
        tries += 1
        r = run()
        if r["foreign"] > FOREIGN_LIMIT and tries < runs * 3:
            print(f"  {label}: foreign load {r['foreign']:.2f} core, repeating", file=sys.stderr)
            continue
        results.append(r)
    return results


def median(results, key):
    return statistics.median(r[key] for r in results)


# ---------------------------------------------------------------- Redis


def redis_benchmark(port, pid, test, pipeline, requests, args):
    cmd = ["redis-benchmark", "-h", "127.0.0.1", "-p", str(port), "-t", test, "-n", str(requests),
           "-r", str(args.keys), "-d", str(args.value_size), "-c", str(args.connections),
           "-P", str(pipeline), "--csv", "--precision", "3"]
    cmd = ["taskset", "-c", "1"] + cmd
    s0, m0, c0, t0 = cpu_seconds(pid), machine_busy(), children_cpu(), time.time()
    out = subprocess.run(["timeout", "300"] + cmd, capture_output=True, text=True, check=True).stdout
    s1, m1, c1, t1 = cpu_seconds(pid), machine_busy(), children_cpu(), time.time()
    row = [l for l in out.splitlines() if l.startswith('"') and not l.startswith('"test"')][-1]
    cols = [c.strip('"') for c in row.split(",")]
    rps = float(cols[1])
    wall = t1 - t0
    server, client = s1 - s0, c1 - c0
    return {
        "ops": rps,
        "server_us": server * 1e6 / (rps * wall),
        "p50": float(cols[4]),
        "p99": float(cols[6]),
        "foreign": ((m1 - m0) - server - client) / wall,
    }


def redis_figures(args, procs):
    port = free_port()
    p = procs.start(["redis-server", "--bind", "127.0.0.1", "--port", str(port), "--save", "",
                     "--appendonly", "no", "--protected-mode", "yes"], pin=0)
    wait_port(port)
    n1 = int(90_000 * args.duration)
    out = {}
    out["set_p1"] = measured(lambda: redis_benchmark(port, p.pid, "set", 1, n1, args), args.runs, "redis SET -P1")
    out["get_p1"] = measured(lambda: redis_benchmark(port, p.pid, "get", 1, n1, args), args.runs, "redis GET -P1")
    out["get_p16"] = measured(lambda: redis_benchmark(port, p.pid, "get", 16, n1 * 8, args), args.runs,
                              "redis GET -P16")
    out["memory"] = redis_memory(port, args)
    procs.stop(p)
    return out


def redis_memory(port, args):
    cli = ["redis-cli", "-h", "127.0.0.1", "-p", str(port)]
    subprocess.run(cli + ["flushall"], check=True, capture_output=True)

    def info():
        text = subprocess.run(cli + ["info", "memory"], check=True, capture_output=True, text=True).stdout
        return dict(l.split(":", 1) for l in text.splitlines() if ":" in l)

    before = info()
    value = "x" * args.value_size
    proto = []
    for i in range(args.memory_items):
        key = f"key:{i:012d}"
        proto.append(f"*3\r\n$3\r\nSET\r\n${len(key)}\r\n{key}\r\n${len(value)}\r\n{value}\r\n")
    subprocess.run(cli + ["--pipe"], input="".join(proto), text=True, check=True, capture_output=True)
    after = info()
    items = int(subprocess.run(cli + ["dbsize"], check=True, capture_output=True, text=True).stdout)
    payload = 16 + args.value_size
    per_item = (int(after["used_memory"]) - int(before["used_memory"])) / items
    rss = (int(after["used_memory_rss"]) - int(before["used_memory_rss"])) / items
    return {"items": items, "per_item": per_item, "overhead": per_item - payload, "rss_per_item": rss}


# ---------------------------------------------------------------- shoal


def start_shoal(procs, args, data, pin=None, join=None):
    port, peer = free_port(), free_port()
    cmd = [args.shoal, "serve", "--listen", f"127.0.0.1:{port}", "--peer-listen", f"127.0.0.1:{peer}",
           "--data-dir", data, "--cache-size", "8GiB", "--worker-threads", "1"]
    if join:
        cmd += ["--join", join]
    p = procs.start(cmd, pin=pin)
    wait_port(port)
    addr = f"127.0.0.1:{port}"
    end = time.time() + 60
    while subprocess.run([args.shoal, "status", "--addr", addr], capture_output=True).returncode != 0:
        if time.time() > end:
            raise RuntimeError(f"shoal at {addr} did not become ready")
        time.sleep(0.1)
    return p, addr


def settled(addrs, deadline=180):
    """Waits until every node in `addrs` sees all of them as members, with no transition, no
    transfer and every replica attached: before that, writes may answer 503 and the figures
    measure the join, not the cluster."""
    end = time.time() + deadline
    pending = list(addrs)
    while pending:
        addr = pending[0]
        try:
            with urllib.request.urlopen(f"http://{addr}/v1/cluster", timeout=5) as r:
                v = json.load(r)
            rep = v.get("replication") or {}
            if (len(v["members"]) == len(addrs) and v.get("transition") is None and v.get("transfer") is None
                    and rep.get("attached_buckets") == rep.get("owned_buckets")):
                pending.pop(0)
                continue
        except (OSError, ValueError, KeyError):
            pass
        if time.time() > end:
            raise RuntimeError(f"{addr} did not settle with {len(addrs)} members")
        time.sleep(0.2)


def shoal_bench(addrs, pids, args, ratio="1:0", batch=1, routing="direct", fill=False, pin=1, keys=None):
    cmd = [args.shoal, "bench", "--addr", ",".join(addrs), "--server-pid", ",".join(str(p) for p in pids),
           "--duration", f"{args.duration}s", "--connections", str(args.connections),
           "--keys", str(keys or args.keys), "--value-size", str(args.value_size), "--ratio", ratio,
           "--batch", str(batch), "--routing", routing, "-o", "json"]
    if not fill:
        cmd.append("--no-fill")
    if pin is not None:
        cmd = ["taskset", "-c", str(pin)] + cmd
    done = subprocess.run(["timeout", "600"] + cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"shoal bench failed ({done.returncode}): {done.stderr.strip()}")
    r = json.loads(done.stdout)
    if r.get("fill_retries"):
        print(f"  shoal bench fill: {r['fill_retries']} keys sent again after a 503", file=sys.stderr)
    if r["errors"]:
        print(f"  shoal bench errors: {r['errors']}", file=sys.stderr)
    return {
        "ops": r["keys_per_sec"],
        "requests": r["requests_per_sec"],
        "server_us": r["server_us_per_key"],
        "p50": r["latency"]["p50_ms"],
        "p99": r["latency"]["p99_ms"],
        "foreign": r["cpu"]["foreign_cores"],
    }


def shoal_figures(args, procs, tmp):
    p, addr = start_shoal(procs, args, os.path.join(tmp, "single"), pin=0)
    shoal_bench([addr], [p.pid], args, ratio="0:1", fill=True)  # fill every key, warm up
    out = {}
    out["set_p1"] = measured(lambda: shoal_bench([addr], [p.pid], args, ratio="0:1"), args.runs, "shoal PUT")
    out["get_p1"] = measured(lambda: shoal_bench([addr], [p.pid], args), args.runs, "shoal GET")
    out["get_b16"] = measured(lambda: shoal_bench([addr], [p.pid], args, batch=16), args.runs, "shoal GET batch 16")
    procs.stop(p)
    out["memory"] = shoal_memory(args, procs, tmp)
    return out


def shoal_memory(args, procs, tmp):
    p, addr = start_shoal(procs, args, os.path.join(tmp, "memory"), pin=0)
    time.sleep(1)
    before = rss_bytes(p.pid)
    subprocess.run([args.shoal, "bench", "--addr", addr, "--keys", str(args.memory_items), "--duration", "0s",
                    "--value-size", str(args.value_size)], check=True, capture_output=True)
    time.sleep(1)
    after = rss_bytes(p.pid)
    node = json.loads(subprocess.run(["curl", "-s", f"http://{addr}/v1/node"], capture_output=True,
                                     text=True, check=True).stdout)
    procs.stop(p)
    payload = 16 + args.value_size
    per_item = (after - before) / node["items"]
    return {"items": node["items"], "per_item": per_item, "overhead": per_item - payload,
            "accounted_per_item": node["bytes"] / node["items"]}


def cluster_figures(args, procs, tmp):
    out = {}
    p, addr = start_shoal(procs, args, os.path.join(tmp, "c1"))
    shoal_bench([addr], [p.pid], args, ratio="0:1", fill=True, pin=None)
    out["one"] = measured(lambda: shoal_bench([addr], [p.pid], args, pin=None), args.runs, "1 node")
    procs.stop(p)
    p1, a1 = start_shoal(procs, args, os.path.join(tmp, "n1"))
    p2, a2 = start_shoal(procs, args, os.path.join(tmp, "n2"), join=a1)
    p3, a3 = start_shoal(procs, args, os.path.join(tmp, "n3"), join=a1)
    pids = [p1.pid, p2.pid, p3.pid]
    settled([a1, a2, a3])
    shoal_bench([a1], pids, args, ratio="0:1", fill=True, pin=None)
    out["direct"] = measured(lambda: shoal_bench([a1], pids, args, pin=None), args.runs, "3 nodes direct")
    out["any"] = measured(lambda: shoal_bench([a1, a2, a3], pids, args, routing="any", pin=None), args.runs,
                          "3 nodes any")
    for p in (p1, p2, p3):
        procs.stop(p)
    return out


# ---------------------------------------------------------------- report


def report(redis, shoal, cluster, args):
    rows = []

    def row(name, r, s, target, higher_is_better=True, fmt="{:,.0f}"):
        ratio = s / r if r else float("nan")
        ok = ""
        if target is not None:
            ok = "ok" if (ratio >= target if higher_is_better else ratio <= target) else "MISSED"
        rows.append((name, fmt.format(r), fmt.format(s), f"{ratio:.2f}",
                     (f"{'≥' if higher_is_better else '≤'}{target}" if target is not None else ""), ok))

    for name, key_r, key_s in [("GET -P1 / single", "get_p1", "get_p1"), ("SET -P1 / PUT", "set_p1", "set_p1")]:
        R, S = redis[key_r], shoal[key_s]
        row(f"{name}  ops/s", median(R, "ops"), median(S, "ops"), 1.0)
        row(f"{name}  server µs/op", median(R, "server_us"), median(S, "server_us"), 1.1, False, "{:.2f}")
        row(f"{name}  p50 ms", median(R, "p50"), median(S, "p50"), None, False, "{:.3f}")
        row(f"{name}  p99 ms", median(R, "p99"), median(S, "p99"), None, False, "{:.3f}")
    R, S = redis["get_p16"], shoal["get_b16"]
    row("GET -P16 / batch 16  keys/s", median(R, "ops"), median(S, "ops"), 0.8)
    row("GET -P16 / batch 16  server µs/key", median(R, "server_us"), median(S, "server_us"), None, False, "{:.2f}")
    row("GET -P16 / batch 16  p99 ms", median(R, "p99"), median(S, "p99"), None, False, "{:.3f}")
    rm, sm = redis["memory"], shoal["memory"]
    rows.append(("memory B/item (1M items)", f"{rm['per_item']:.1f}", f"{sm['per_item']:.1f}",
                 f"{sm['per_item'] / rm['per_item']:.2f}", "", ""))
    rows.append(("memory overhead B/item", f"{rm['overhead']:.1f}", f"{sm['overhead']:.1f}", "", "≤100 B",
                 "ok" if sm["overhead"] <= 100 else "MISSED"))
    one, direct, anyr = (median(cluster[k], "ops") for k in ("one", "direct", "any"))
    rows.append(("3 nodes direct / 1 node  ops/s", f"{one:,.0f}", f"{direct:,.0f}", f"{direct / one:.2f}",
                 "≥0.9", "ok" if direct / one >= 0.9 else "MISSED"))
    rows.append(("3 nodes any / 1 node  ops/s", f"{one:,.0f}", f"{anyr:,.0f}", f"{anyr / one:.2f}", "", ""))
    d_us, a_us = median(cluster["direct"], "server_us"), median(cluster["any"], "server_us")
    forwarded_share = 2 / 3
    rows.append(("server µs/op: direct vs any (3 nodes)", f"{d_us:.2f}", f"{a_us:.2f}", f"{a_us / d_us:.2f}", "", ""))
    rows.append(("extra server µs per forwarded op", "", f"{(a_us - d_us) / forwarded_share:.2f}", "", "", ""))

    widths = [max(len(str(r[i])) for r in rows + [HEADER]) for i in range(len(HEADER))]
    lines = []
    for r in [HEADER] + rows:
        lines.append("  ".join(str(c).ljust(w) if i == 0 else str(c).rjust(w) for i, (c, w) in enumerate(zip(r, widths))))
    print(f"shoal vs Redis, {args.connections} connections, {args.value_size} B values, {args.keys:,} keys, "
          f"medians of {args.runs} runs of {args.duration}s; single-node rows pinned (server core 0, client core 1)")
    print("\n".join(lines))
    print(f"shoal memory: {sm['items']:,} items, RSS growth {sm['per_item']:.1f} B/item, "
          f"its own accounting {sm['accounted_per_item']:.1f} B/item; Redis RSS growth {rm['rss_per_item']:.1f} B/item")


def single_figures(args, procs, tmp, binary, name):
    """Unbatched GET and PUT of one pinned node of `binary`."""
    own = argparse.Namespace(**{**vars(args), "shoal": binary})
    p, addr = start_shoal(procs, own, os.path.join(tmp, name), pin=0)
    shoal_bench([addr], [p.pid], own, ratio="0:1", fill=True)
    out = {
        "set_p1": measured(lambda: shoal_bench([addr], [p.pid], own, ratio="0:1"), args.runs, f"{name} PUT"),
        "get_p1": measured(lambda: shoal_bench([addr], [p.pid], own), args.runs, f"{name} GET"),
    }
    procs.stop(p)
    return out


def single_report(args, procs, tmp):
    """Single-node server µs/op of Redis, the baseline binary (if any) and this one, one run."""
    n1 = int(90_000 * args.duration)
    port = free_port()
    p = procs.start(["redis-server", "--bind", "127.0.0.1", "--port", str(port), "--save", "",
                     "--appendonly", "no", "--protected-mode", "yes"], pin=0)
    wait_port(port)
    redis = {
        "set_p1": measured(lambda: redis_benchmark(port, p.pid, "set", 1, n1, args), args.runs, "redis SET -P1"),
        "get_p1": measured(lambda: redis_benchmark(port, p.pid, "get", 1, n1, args), args.runs, "redis GET -P1"),
    }
    procs.stop(p)
    columns = [("redis", redis)]
    if args.baseline:
        columns.append(("baseline", single_figures(args, procs, tmp, args.baseline, "baseline")))
    columns.append(("shoal", single_figures(args, procs, tmp, args.shoal, "shoal")))
    print(f"single node, pinned, medians of {args.runs} runs of {args.duration}s: server µs/op (ops/s)")
    print("figure".ljust(8) + "".join(name.rjust(22) for name, _ in columns))
    for label, key in (("GET", "get_p1"), ("PUT", "set_p1")):
        cells = [f"{median(c[key], 'server_us'):.2f} ({median(c[key], 'ops'):,.0f})" for _, c in columns]
        print(label.ljust(8) + "".join(cell.rjust(22) for cell in cells))


HEADER = ("figure", "redis / base", "shoal", "ratio", "target", "")


def install_redis():
    """Installs Redis (the Debian packages) when its server or tools are missing."""
    if shutil.which("redis-server") and shutil.which("redis-benchmark") and shutil.which("redis-cli"):
        return
    print("compare.py: installing redis-server and redis-tools", file=sys.stderr)
    sudo = [] if os.geteuid() == 0 else ["sudo", "-n"]
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    subprocess.run(sudo + ["apt-get", "update", "-qq"], check=True, env=env)
    subprocess.run(sudo + ["apt-get", "install", "-y", "-qq", "redis-server", "redis-tools"],
                   check=True, env=env, stdout=subprocess.DEVNULL)


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--shoal", required=True)
    ap.add_argument("--runs", type=int, default=int(os.environ.get("RUNS", 3)))
    ap.add_argument("--duration", type=int, default=int(os.environ.get("DURATION", 5)))
    ap.add_argument("--connections", type=int, default=50)
    ap.add_argument("--keys", type=int, default=100_000)
    ap.add_argument("--value-size", type=int, default=100)
    ap.add_argument("--memory-items", type=int, default=1_000_000)
    ap.add_argument("--json", help="also write the raw results here")
    ap.add_argument("--only", choices=["cluster", "single"], help="measure only part (for quick iterations)")
    ap.add_argument("--baseline", help="with --only single: another shoal binary measured in the same run")
    args = ap.parse_args()
    install_redis()
    for tool in ("redis-server", "redis-benchmark", "redis-cli", "taskset", "curl"):
        if not shutil.which(tool):
            sys.exit(f"compare.py: {tool} is missing")
    procs = Processes()
    tmp = tempfile.mkdtemp(prefix="shoal-perf-")
    try:
        if args.only == "cluster":
            cluster = cluster_figures(args, procs, tmp)
            for k in ("one", "direct", "any"):
                print(k, {f: round(median(cluster[k], f), 2) for f in ("ops", "server_us", "p99", "foreign")})
            return
        if args.only == "single":
            single_report(args, procs, tmp)
            return
        redis = redis_figures(args, procs)
        shoal = shoal_figures(args, procs, tmp)
        cluster = cluster_figures(args, procs, tmp)
    finally:
        procs.stop_all()
        shutil.rmtree(tmp, ignore_errors=True)
    report(redis, shoal, cluster, args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"redis": redis, "shoal": shoal, "cluster": cluster}, f, indent=2)


if __name__ == "__main__":
    main()
