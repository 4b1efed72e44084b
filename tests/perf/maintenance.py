#!/usr/bin/env python3
"""Maintenance against failover: bytes moved and time to ready when a node goes away for a
while and comes back on its data dir.

A 3-node cluster (sync replication, pings every 200 ms, node timeout 1 s) holds --keys keys
of --value-size bytes; `shoal bench` overwrites them through the two other nodes the whole
time. The second member goes away for --away seconds, then starts again on its data dir:

- maintenance: `POST /v1/cluster/nodes/{id}/maintenance`, then SIGTERM; its replica holder
  serves its buckets; back, it takes them back (whole buckets: its memory is empty);
- failover + rejoin: SIGTERM with `--restart-window 0s`; the cluster fails it after the node
  timeout and rebalances without it; back, it rejoins as a new member and gets a share again.

Bytes moved: the sum over the members of `shoal_transfer_bytes_received_total` (state
transfer) and `shoal_replication_snapshot_bytes_total` (whole buckets sent to replicas), from
just before the node goes away until every member is ready and nothing moves. Time to ready:
from the restart until then. Medians of --runs. Everything is on 127.0.0.1; every process is
stopped by its PID.

    cargo build --release && python3 tests/perf/maintenance.py --shoal target/release/shoal
"""

import argparse
import json
import shutil
import signal
import statistics
import subprocess
import tempfile
import time
import urllib.error

from failover import Cluster, get_json, request

COUNTERS = ("shoal_transfer_bytes_received_total", "shoal_replication_snapshot_bytes_total")


def moved_bytes(addr):
    """The node's bytes received by state transfer plus replica snapshot bytes it sent."""
    text = request("GET", addr, "/metrics")[1].decode()
    total = 0.0
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name in COUNTERS:
            total += float(value)
    return total


def ready_and_settled(cluster):
    try:
        for addr in cluster.addrs:
            if request("GET", addr, "/readyz")[0] != 200:
                return False
        v = get_json(cluster.addrs[0], "/v1/cluster")
    except (OSError, urllib.error.URLError):
        return False
    return (len(v["members"]) == 3 and v["transition"] is None and v["transfer"] is None
            and v.get("maintenance") is None and not v["lost_buckets"])


def run_once(shoal, way, keys, value_size, away):
    tmp = tempfile.mkdtemp(prefix=f"shoal-{way}-")
    cluster = Cluster(shoal, tmp, "sync")
    cluster.extra = ["--restart-window", "5m" if way == "maintenance" else "0s"]
    load = None
    try:
        seed = cluster.start_node()
        for _ in range(2):
            cluster.start_node(join=seed)
        cluster.wait_settled(0, 3)
        while not ready_and_settled(cluster):
            time.sleep(0.2)
        subprocess.run([shoal, "bench", "--addr", seed, "--keys", str(keys), "--value-size", str(value_size),
                        "--duration", "0s", "--connections", "8"], check=True, capture_output=True)
        victim = 1
        others = [cluster.addrs[n] for n in range(3) if n != victim]
        load = subprocess.Popen([shoal, "bench", "--addr", ",".join(others), "--routing", "any", "--no-fill",
                                 "--ratio", "0:1", "--keys", str(keys), "--value-size", str(value_size),
                                 "--connections", "4", "--duration", "1h"],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(2)
        before = {n: moved_bytes(cluster.addrs[n]) for n in range(3)}
        if way == "maintenance":
            vid = get_json(cluster.addrs[victim], "/v1/cluster")["node_id"]
            request("POST", cluster.addrs[0], f"/v1/cluster/nodes/{vid}/maintenance",
                    json.dumps({"for": "10m"}).encode(), timeout=120)
        cluster.procs[victim].send_signal(signal.SIGTERM)
        cluster.procs[victim].wait(timeout=120)
        time.sleep(away)
        restarted = time.time()
        cluster.restart(victim)
        while not ready_and_settled(cluster):
            if time.time() - restarted > 600:
                raise RuntimeError("the cluster did not settle")
            time.sleep(0.2)
        took = time.time() - restarted
        after = {n: moved_bytes(cluster.addrs[n]) for n in range(3)}
        # The victim's process is new: its counters start again from 0.
        moved = sum(after[n] - before[n] for n in range(3) if n != victim) + after[victim]
        failed = get_json(cluster.addrs[0], "/v1/cluster")["failed"]
        return took, moved, failed
    finally:
        if load is not None and load.poll() is None:
            load.send_signal(signal.SIGTERM)
            load.wait()
        cluster.stop()
        shutil.rmtree(tmp, ignore_errors=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shoal", default="target/release/shoal")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--keys", type=int, default=200_000)
    ap.add_argument("--value-size", type=int, default=1024)
    ap.add_argument("--away", type=float, default=60.0, help="seconds the node is away")
    args = ap.parse_args()
    results = {}
    for way in ("maintenance", "failover"):
        runs = []
        for run in range(args.runs):
            took, moved, failed = run_once(args.shoal, way, args.keys, args.value_size, args.away)
            print(f"  {way} run {run + 1}: ready {took:.1f} s after the restart, {moved / 1e6:.0f} MB moved, "
                  f"failed members {failed}", flush=True)
            runs.append((took, moved))
        results[way] = (statistics.median(t for t, _ in runs), statistics.median(m for _, m in runs))
    print(f"\n{'way':<22} {'time to ready':>14} {'bytes moved':>12}")
    for way, (took, moved) in results.items():
        print(f"{way:<22} {took:>12.1f} s {moved / 1e6:>9.0f} MB")


if __name__ == "__main__":
    main()
