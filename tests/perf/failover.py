#!/usr/bin/env python3
"""Failover and replication benchmark.

1. Failover time: a 3-node cluster (sync replication, pings every 200 ms, node timeout 1 s)
   holds --keys keys; a node is killed with SIGKILL (--victim: the Raft leader, the busiest
   other node, or each in turn); the time until every key is readable and writable again (read
   and overwritten through a survivor) is measured, and split into its parts: until a new Raft
   leader is known (when the leader was killed), until the failure is committed (the event
   log's `node_failed`), until the heir serves the buckets (`promoted`), until the first full
   answer. The killed node rejoins as a new member before the next run. Medians of --runs.
2. PUT throughput: `shoal bench --ratio 0:1` against one node, then against three nodes in
   sync and in async mode (direct routing), --bench-runs runs each, medians.

Everything listens on 127.0.0.1 and every process is stopped by its PID.

    cargo build --release && python3 tests/perf/failover.py --shoal target/release/shoal
"""

import argparse
import contextlib
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import tempfile
import threading
import time
import urllib.error
import urllib.request


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def request(method, addr, path, body=None, timeout=5):
    req = urllib.request.Request(f"http://{addr}{path}", data=body, method=method)
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return r.status, r.read()


def get_json(addr, path):
    return json.loads(request("GET", addr, path)[1])


class Cluster:
    def __init__(self, shoal, tmp, mode):
        self.shoal, self.tmp, self.mode = shoal, tmp, mode
        self.procs, self.addrs, self.args = [], [], []
        self.extra = []  # more `shoal serve` flags for every node

    def start_node(self, join=None):
        n = len(self.procs)
        api, peer = free_port(), free_port()
        addr = f"127.0.0.1:{api}"
        cmd = [self.shoal, "serve", "--listen", addr, "--peer-listen", f"127.0.0.1:{peer}",
               "--data-dir", os.path.join(self.tmp, f"n{n}"), "--cache-size", "512MiB",
               "--worker-threads", "1", "--replication", self.mode,
               "--ping-interval", "200ms", "--node-timeout", "1s"]
        cmd += self.extra
        if join:
            cmd += ["--join", join]
        self.args.append(cmd)
        self.procs.append(self.spawn(n, cmd))
        self.addrs.append(addr)
        self.wait_ready(n)
        return addr

    def spawn(self, n, cmd):
        log = open(os.path.join(self.tmp, f"n{n}.log"), "a")
        return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log)

    def wait_ready(self, n):
        end = time.time() + 120
        while subprocess.run([self.shoal, "status", "--addr", self.addrs[n]], capture_output=True).returncode != 0:
            if time.time() > end or self.procs[n].poll() is not None:
                raise RuntimeError(f"node {n} did not start")
            time.sleep(0.1)

    def view(self, n):
        return get_json(self.addrs[n], "/v1/cluster")

    def wait_settled(self, via, members, limit=300):
        end = time.time() + limit
        while True:
            try:
                v = self.view(via)
                r = v["replication"] or {}
                if (len(v["members"]) == members and v["transition"] is None and v["transfer"] is None
                        and r.get("attached_buckets") == r.get("owned_buckets")):
                    return v
            except (OSError, urllib.error.URLError, KeyError):
                pass
            if time.time() > end:
                raise RuntimeError("the cluster did not settle")
            time.sleep(0.2)

    def kill9(self, n):
        self.procs[n].send_signal(signal.SIGKILL)
        self.procs[n].wait()

    def restart(self, n):
        self.procs[n] = self.spawn(n, self.args[n])
        self.wait_ready(n)

    def stop(self):
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in self.procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def fill(shoal, addr, keys):
    subprocess.run([shoal, "bench", "--addr", addr, "--keys", str(keys), "--value-size", "100",
                    "--duration", "0s", "--connections", "8"], check=True, capture_output=True)


def all_keys_ok(cluster, via, keys):
    """Every key of the bench key space reads 200 (bulk) and one key per bucket is writable."""
    addr = cluster.addrs[via]
    names = [f"key:{i:012}" for i in range(keys)]
    for start in range(0, keys, 1000):
        try:
            status, body = request("POST", addr, "/v1/bulk/get", json.dumps({"keys": names[start:start + 1000]}).encode())
        except (OSError, urllib.error.URLError):
            return False
        results = json.loads(body)["results"]
        if any(r.get("error") or not r.get("found") for r in results):
            return False
    try:
        body = json.dumps({"items": [{"key": n, "value": "after"} for n in names[:2000]]}).encode()
        results = json.loads(request("POST", addr, "/v1/bulk/put", body)[1])["results"]
    except (OSError, urllib.error.URLError):
        return False
    return not any(r.get("error") for r in results)


def leader_watch(cluster, via, victim_id, out):
    """Polls `via` every 20 ms until it names a leader other than `victim_id`: its time."""
    end = time.time() + 120
    while time.time() < end:
        try:
            leader = cluster.view(via).get("leader")
            if leader is not None and leader != victim_id:
                out.append(time.time())
                return
        except (OSError, urllib.error.URLError, KeyError, ValueError):
            pass
        time.sleep(0.02)


def event_time(cluster, via, kind, node, after):
    """The time (s) of the first event of `kind` about `node` (any, when None) at or after
    `after`, or None."""
    try:
        events = get_json(cluster.addrs[via], "/v1/cluster/events?limit=100000")["events"]
    except (OSError, urllib.error.URLError, KeyError, ValueError):
        return None
    times = [e["time_ms"] / 1000 for e in events
             if e.get("type") == kind and (node is None or node in (e.get("node"), e.get("peer")))
             and e["time_ms"] / 1000 >= after]
    return min(times) if times else None


def failover_runs(shoal, runs, keys, victims):
    tmp = tempfile.mkdtemp(prefix="shoal-failover-")
    cluster = Cluster(shoal, tmp, "sync")
    times = []
    try:
        seed = cluster.start_node()
        for _ in range(2):
            cluster.start_node(join=seed)
        cluster.wait_settled(0, 3)
        fill(shoal, seed, keys)
        for run in range(runs * len(victims)):
            kind = victims[run % len(victims)]
            v = cluster.wait_settled(0, 3)
            ids = {m["api_addr"]: m["id"] for m in v["members"]}
            by_api = {m["api_addr"]: m["buckets"] for m in v["members"]}
            leader = next(n for n in range(3) if ids.get(cluster.addrs[n]) == v["leader"])
            if kind == "leader":
                victim = leader
            else:
                victim = max((n for n in range(3) if n != leader), key=lambda n: by_api.get(cluster.addrs[n], 0))
            victim_id = ids[cluster.addrs[victim]]
            via = next(n for n in range(3) if n != victim)
            elected = []
            watcher = None
            if kind == "leader":
                watcher = threading.Thread(target=leader_watch, args=(cluster, via, victim_id, elected), daemon=True)
            killed = time.time()
            cluster.kill9(victim)
            if watcher:
                watcher.start()
            while True:
                # The check that passes reads every key and writes 2,000 through the survivor;
                # the time it began says how much of the total is the check itself.
                check_began = time.time()
                if all_keys_ok(cluster, via, keys):
                    break
                if time.time() - killed > 120:
                    raise RuntimeError("keys did not come back")
                time.sleep(0.05)
            took = time.time() - killed
            if watcher:
                watcher.join(timeout=5)
            failed = event_time(cluster, via, "node_failed", victim_id, killed)
            # The heir's report names the heir, not the member it inherited from.
            promoted = event_time(cluster, via, "promoted", None, killed)
            part = lambda t: f"{t - killed:.2f}" if t else "?"
            parts = {"leader": part(elected[0]) if elected else "-", "failed": part(failed), "promoted": part(promoted),
                     "check": part(check_began)}
            times.append((kind, took, parts))
            print(f"  failover run {run + 1} ({kind} killed): {took:.2f} s; new leader known {parts['leader']} s, "
                  f"failure committed {parts['failed']} s, promoted {parts['promoted']} s, "
                  f"the passing check began {parts['check']} s", flush=True)
            cluster.restart(victim)  # rejoins as a new member
            cluster.wait_settled(via, 3)
    finally:
        cluster.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    return times


def metric_sums(cluster, names):
    """Each named counter (`{key: series name}`) summed over the cluster's nodes."""
    total = {key: 0.0 for key in names}
    for addr in cluster.addrs:
        for line in request("GET", addr, "/metrics")[1].decode().splitlines():
            for key, name in names.items():
                if line.startswith(name + " "):
                    total[key] += float(line.split()[-1])
    return total


@contextlib.contextmanager
def running_cluster(shoal, nodes, mode):
    """`nodes` nodes in replication `mode`, settled; stopped (by PID) and removed afterwards."""
    tmp = tempfile.mkdtemp(prefix="shoal-putbench-")
    cluster = Cluster(shoal, tmp, mode)
    try:
        seed = cluster.start_node()
        for _ in range(nodes - 1):
            cluster.start_node(join=seed)
        cluster.wait_settled(0, nodes)
        yield cluster
    finally:
        cluster.stop()
        shutil.rmtree(tmp, ignore_errors=True)


def bench_put(shoal, cluster, duration, keys):
    """`shoal bench` PUTs (50 connections, routed to owners) against `cluster`: its JSON report."""
    pids = ",".join(str(p.pid) for p in cluster.procs)
    out = subprocess.run([shoal, "bench", "--addr", ",".join(cluster.addrs), "--routing", "direct",
                          "--ratio", "0:1", "--keys", str(keys), "--duration", duration, "--connections", "50",
                          "--server-pid", pids, "-o", "json"], check=True, capture_output=True, text=True)
    return json.loads(out.stdout)


def put_throughput(shoal, nodes, mode, duration, keys):
    with running_cluster(shoal, nodes, mode) as cluster:
        report = bench_put(shoal, cluster, duration, keys)
        return report["keys_per_sec"], report["latency"]["p99_ms"], sum(report["errors"].values())


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shoal", default="target/release/shoal")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--keys", type=int, default=100_000)
    ap.add_argument("--bench-runs", type=int, default=3)
    ap.add_argument("--duration", default="10s")
    ap.add_argument("--only", choices=["failover", "put"], help="run one of the two parts")
    ap.add_argument("--victim", choices=["leader", "follower", "both"], default="both",
                    help="which node a failover run kills: the Raft leader, the busiest other node, or each in turn")
    args = ap.parse_args()

    if args.only != "put":
        victims = ["leader", "follower"] if args.victim == "both" else [args.victim]
        print(f"failover: 3 nodes, sync, {args.keys} keys, {args.runs} runs per victim ({', '.join(victims)})")
        runs = failover_runs(args.shoal, args.runs, args.keys, victims)
        for kind in victims:
            times = [t for k, t, _ in runs if k == kind]
            print(f"failover time, {kind} killed (kill -9 to every key readable and writable): "
                  f"median {statistics.median(times):.2f} s, runs {', '.join(f'{t:.2f}' for t in times)}")
            for name, what in [("leader", "new Raft leader known"), ("failed", "failure committed"),
                               ("promoted", "heir serves (promotion committed)"),
                               ("check", "the check that passed began (it reads 100,000 keys, writes 2,000)")]:
                known = [float(p[name]) for k, _, p in runs if k == kind and p[name] not in ("?", "-")]
                if known:
                    print(f"    {what}: median {statistics.median(known):.2f} s after the kill")
    if args.only == "failover":
        return

    print(f"PUT throughput, {args.bench_runs} runs of {args.duration} each, 50 connections, 100-byte values")
    rows = []
    for nodes, mode in [(1, "sync"), (3, "sync"), (3, "async")]:
        results = [put_throughput(args.shoal, nodes, mode, args.duration, args.keys) for _ in range(args.bench_runs)]
        ops = statistics.median(r[0] for r in results)
        p99 = statistics.median(r[1] for r in results)
        errors = sum(r[2] for r in results)
        rows.append((nodes, mode, ops, p99, errors))
    base = rows[0][2]
    print(f"{'nodes':>5}  {'mode':<6} {'PUT ops/s':>10}  {'vs 1 node':>9}  {'p99 ms':>7}  {'errors':>6}")
    for nodes, mode, ops, p99, errors in rows:
        label = mode if nodes > 1 else "-"
        print(f"{nodes:>5}  {label:<6} {ops:>10.0f}  {ops / base:>8.2f}x  {p99:>7.2f}  {errors:>6}")


if __name__ == "__main__":
    main()
