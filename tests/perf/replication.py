#!/usr/bin/env python3
"""Replicated PUTs against one node's, side by side with a baseline build.

For each build (--shoal, and --baseline when given) and each --runs round: `shoal bench
--ratio 0:1 --routing direct` (50 connections, 100-byte values) against one node, then against
three nodes in sync and in async mode. Builds alternate within a round, so both see the same
machine. Reported per build: PUT ops/s, the ratio to that build's one node, server CPU µs per
PUT (all nodes' CPU over the PUTs), p99, and changes per exchange with the replica holders
(`shoal_replication_exchanges_total`; builds without the metric show "-"). Medians of --runs.

    cargo build --release && python3 tests/perf/replication.py --shoal target/release/shoal \\
        --baseline /path/to/older/release/shoal

Everything listens on 127.0.0.1 and every process is stopped by its PID.
"""
import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import failover  # noqa: E402  (its Cluster starts and stops the nodes)

SETUPS = [(1, "sync"), (3, "sync"), (3, "async")]


def counters(cluster):
    """Changes and exchanges with replica holders, summed over the nodes."""
    return failover.metric_sums(cluster, {"changes": "shoal_replication_changes_total",
                                          "exchanges": "shoal_replication_exchanges_total"})


def run(shoal, nodes, mode, duration):
    with failover.running_cluster(shoal, nodes, mode) as cluster:
        before = counters(cluster)
        report = failover.bench_put(shoal, cluster, duration, 100_000)
        after = counters(cluster)
        exchanges = after["exchanges"] - before["exchanges"]
        per_exchange = (after["changes"] - before["changes"]) / exchanges if exchanges else None
        return (report["keys_per_sec"], report["server_us_per_request"], report["latency"]["p99_ms"], per_exchange)


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
        for nodes, mode in SETUPS:
            for name, shoal in builds:
                results.setdefault((nodes, mode, name), []).append(run(shoal, nodes, mode, a.duration))
    one = {name: statistics.median(r[0] for r in results[(1, "sync", name)]) for name, _ in builds}
    print(f"replicated PUTs, 50 connections, 100-byte values, medians of {a.runs} runs of {a.duration}")
    print("nodes  mode   build      PUT ops/s  vs 1 node  server µs/PUT  p99 ms  changes/exchange")
    for (nodes, mode, name), runs in results.items():
        med = lambda i: statistics.median(r[i] for r in runs)  # noqa: E731
        batch = [r[3] for r in runs if r[3]]
        batch = f"{statistics.median(batch):.1f}" if batch else "-"
        print(f"{nodes:5}  {mode if nodes > 1 else '-':5}  {name:8} {med(0):11,.0f} {med(0) / one[name]:9.2f}x "
              f"{med(1):14.1f} {med(2):7.2f}  {batch:>16}")


if __name__ == "__main__":
    main()
