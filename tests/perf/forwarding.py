#!/usr/bin/env python3
"""What a forwarded operation costs the servers, side by side with a baseline build.

Three nodes (sync replication), settled. For each build (--shoal, and --baseline when given),
each --runs round and each of GET and PUT: `shoal bench` (50 connections, 100-byte values,
100,000 keys) with `--routing direct` (every request to its owner) and `--routing any` (a
random node, which forwards two thirds of them). Builds alternate within a round, so both see
the same machine. Reported per build: ops/s, server CPU µs per operation both ways, the extra
server µs per forwarded operation ((any - direct) / (2/3)), and forwarded operations per
exchange with the owner (`shoal_forward_exchanges_total`; "-" for builds without it). That
counts the owners' lanes, which carry forwarded reads over HTTP: where a peer link is open,
reads (since `07f0653`) and writes go on it one message each and are not counted,
so the column is then large (only the reads before the links opened). Medians of --runs.

    cargo build --release && python3 tests/perf/forwarding.py --shoal target/release/shoal \\
        --baseline /path/to/older/release/shoal

Everything listens on 127.0.0.1 and every process is stopped by its PID.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import failover  # noqa: E402  (its Cluster starts and stops the nodes)

RATIOS = {"GET": "1:0", "PUT": "0:1"}


def counters(cluster):
    """Forwarded operations and exchanges that carried them, summed over the nodes."""
    return failover.metric_sums(cluster, {"ops": "shoal_forwarded_operations_total",
                                          "exchanges": "shoal_forward_exchanges_total"})


def bench(shoal, cluster, routing, ratio, duration):
    pids = ",".join(str(p.pid) for p in cluster.procs)
    out = subprocess.run([shoal, "bench", "--addr", ",".join(cluster.addrs), "--routing", routing, "--ratio", ratio,
                          "--keys", "100000", "--no-fill", "--duration", duration, "--connections", "50",
                          "--server-pid", pids, "-o", "json"], check=True, capture_output=True, text=True)
    r = json.loads(out.stdout)
    return r["keys_per_sec"], r["server_us_per_key"]


def run(shoal, op, duration):
    with failover.running_cluster(shoal, 3, "sync") as cluster:
        failover.bench_put(shoal, cluster, "2s", 100_000)  # fills the keys
        direct = bench(shoal, cluster, "direct", RATIOS[op], duration)
        before = counters(cluster)
        anyr = bench(shoal, cluster, "any", RATIOS[op], duration)
        after = counters(cluster)
        exchanges = after["exchanges"] - before["exchanges"]
        per_exchange = (after["ops"] - before["ops"]) / exchanges if exchanges else None
        return direct + anyr + (per_exchange,)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shoal", default="target/release/shoal")
    p.add_argument("--baseline", help="an older build to measure side by side")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--duration", default="5s")
    a = p.parse_args()
    builds = [("this", a.shoal)] + ([("baseline", a.baseline)] if a.baseline else [])
    results = {}
    for _ in range(a.runs):
        for op in RATIOS:
            for name, shoal in builds:
                results.setdefault((op, name), []).append(run(shoal, op, a.duration))
    print(f"3 nodes, sync, 50 connections, 100-byte values, medians of {a.runs} runs of {a.duration}")
    print("op   build     direct ops/s  µs/op   any ops/s  µs/op  extra µs per forwarded op  ops/exchange")
    for (op, name), runs in results.items():
        med = lambda i: statistics.median(r[i] for r in runs)  # noqa: E731
        extra = statistics.median((r[3] - r[1]) * 1.5 for r in runs)
        batch = [r[4] for r in runs if r[4]]
        batch = f"{statistics.median(batch):.2f}" if batch else "-"
        print(f"{op:4} {name:8} {med(0):13,.0f} {med(1):6.1f} {med(2):11,.0f} {med(3):6.1f} {extra:26.1f} {batch:>13}")


if __name__ == "__main__":
    main()
