#!/usr/bin/env python3
"""State-transfer benchmark: load ~1 GiB into 3 nodes, join a fourth, and measure the transfer.

Reports, per run and as medians over --runs: transfer time (join to settled), bytes moved,
MB/s, the replica snapshots the nodes sent meanwhile, the time until every node is ready (its
replica in place) and the replica snapshots sent until then, the four nodes' CPU time (user + system,
from /proc) and that per KB moved and in core-seconds per GiB, and the client p99 latency of GETs during the transfer
against before it (from 1-second `shoal bench` windows: those before the join, and those whose
middle falls inside the transfer). Everything listens on 127.0.0.1 and every process is stopped by its PID.

    cargo build --release && python3 tests/perf/transfer.py --shoal target/release/shoal
    python3 tests/perf/transfer.py --shoal target/release/shoal --quiet   # no client: the transfer's own CPU
"""

import argparse
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get_json(addr, path):
    with urllib.request.urlopen(f"http://{addr}{path}", timeout=10) as r:
        return json.load(r)


class Cluster:
    def __init__(self, shoal, tmp, extra=()):
        self.shoal, self.tmp, self.procs, self.addrs = shoal, tmp, [], []
        self.extra = list(extra)

    def start_node(self, join=None):
        n = len(self.procs)
        api, peer = free_port(), free_port()
        addr = f"127.0.0.1:{api}"
        cmd = [self.shoal, "serve", "--listen", addr, "--peer-listen", f"127.0.0.1:{peer}",
               "--data-dir", os.path.join(self.tmp, f"n{n}"), "--cache-size", "2GiB", "--worker-threads", "1"]
        cmd += self.extra
        if join:
            cmd += ["--join", join]
        log = open(os.path.join(self.tmp, f"n{n}.log"), "w")
        p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log)
        self.procs.append(p)
        self.addrs.append(addr)
        end = time.time() + 120
        while subprocess.run([self.shoal, "status", "--addr", addr], capture_output=True).returncode != 0:
            if time.time() > end or p.poll() is not None:
                raise RuntimeError(f"node {n} did not start")
            time.sleep(0.1)
        return addr

    def settled(self):
        """Every started node is a member that owns buckets, and nothing is moving. (The
        shares are equal in bytes, not in buckets: the cluster balances by data.)"""
        v = get_json(self.addrs[0], "/v1/cluster")
        owners = [m for m in v["members"] if m["buckets"] > 0]
        return v["transition"] is None and v["transfer"] is None and len(owners) == len(self.addrs)

    def wait_settled(self, limit=1800):
        wait_until(self.settled, "the cluster did not settle", limit)

    def ready(self):
        """Every node answers /readyz with 200: among other checks, its replica is in place."""
        for addr in self.addrs:
            try:
                with urllib.request.urlopen(f"http://{addr}/readyz", timeout=10) as r:
                    if r.status != 200:
                        return False
            except urllib.error.HTTPError:
                return False
        return True

    def wait_ready(self, limit=1800):
        wait_until(self.ready, "the nodes did not get ready", limit)

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


def wait_until(condition, failure, limit):
    """Polls `condition` every 0.2 s; raises `failure` if it does not hold within `limit` s."""
    end = time.time() + limit
    while not condition():
        if time.time() > end:
            raise RuntimeError(failure)
        time.sleep(0.2)


def cpu_seconds(pids):
    """User + system CPU seconds of the processes, from /proc (0 for one that is gone)."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0.0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / tick
        except FileNotFoundError:
            pass
    return total


def replica_snapshot_bytes(addrs):
    """Bytes of replica snapshots the nodes sent, ever (from their metrics)."""
    total = 0
    for addr in addrs:
        with urllib.request.urlopen(f"http://{addr}/metrics", timeout=10) as r:
            for line in r.read().decode().splitlines():
                if line.startswith("shoal_replication_snapshot_bytes_total"):
                    total += float(line.split()[-1])
    return total


def bench_window(shoal, addr, keys, seconds=1):
    out = subprocess.run([shoal, "bench", "--addr", addr, "--keys", str(keys), "--value-size", "1024",
                          "--duration", f"{seconds}s", "--connections", "10", "--no-fill", "-o", "json"],
                         capture_output=True, text=True, timeout=120)
    r = json.loads(out.stdout)
    return r["latency"]["p99_ms"], r["requests_per_sec"], sum(r["errors"].values())


def one_run(args, tmp):
    c = Cluster(args.shoal, tmp, args.serve_arg)
    try:
        first = c.start_node()
        c.start_node(join=first)
        c.start_node(join=first)
        c.wait_settled()
        c.wait_ready()
        t0 = time.time()
        subprocess.run([args.shoal, "bench", "--addr", first, "--keys", str(args.items), "--value-size", "1024",
                        "--duration", "0s"], check=True, capture_output=True, timeout=1800)
        fill = time.time() - t0
        before = [bench_window(args.shoal, first, args.items) for _ in range(args.windows)]

        during, stop = [], threading.Event()

        def load():
            while not stop.is_set():
                start = time.time()
                w = bench_window(args.shoal, first, args.items)
                during.append((start, time.time(), w))

        totals = lambda: {n["node_id"]: (n["buckets_pulled_total"], n.get("bytes_received_total", 0))
                          for n in get_json(first, "/v1/cluster/transfer")["nodes"]}
        before_totals = totals()
        replicas_before = replica_snapshot_bytes(c.addrs)
        t = threading.Thread(target=load)
        if not args.quiet:
            t.start()
        cpu_before = cpu_seconds(p.pid for p in c.procs)
        join_at = time.time()
        fourth = c.start_node(join=first)
        c.wait_settled()
        done_at = time.time()
        # The fourth node's CPU counts from its start.
        node_cpu = cpu_seconds(p.pid for p in c.procs) - cpu_before
        replica_bytes = replica_snapshot_bytes(c.addrs) - replicas_before
        # The replicas may settle after the share: the holder join order names for the
        # member before the joiner gets its copies once the joiner has pulled its share.
        c.wait_ready()
        ready_at = time.time()
        node_cpu_ready = cpu_seconds(p.pid for p in c.procs) - cpu_before
        replica_bytes_ready = replica_snapshot_bytes(c.addrs) - replicas_before
        stop.set()
        if not args.quiet:
            t.join()
        after = totals()
        moved = sum(b - before_totals.get(n, (0, 0))[0] for n, (b, _) in after.items())
        received = sum(r - before_totals.get(n, (0, 0))[1] for n, (_, r) in after.items())
        # Windows whose middle falls inside the transfer.
        inside = [w for (s, e, w) in during if join_at <= (s + e) / 2 <= done_at]
        seconds = done_at - join_at
        return {
            "fill_seconds": fill,
            "transfer_seconds": seconds,
            "buckets_moved": moved,
            "bytes_moved": received,
            "mb_per_sec": received / seconds / 1e6,
            "replica_snapshot_bytes": replica_bytes,
            "ready_seconds": ready_at - join_at,
            "replica_snapshot_bytes_ready": replica_bytes_ready,
            "node_cpu_seconds": node_cpu,
            "node_cpu_us_per_kb": node_cpu * 1e6 / (received / 1e3),
            # Core-seconds per GiB, both ends together: of the share alone (join to settled), and
            # of every byte the join sent (the share and the replica snapshots, join to ready).
            "core_seconds_per_gib_share": node_cpu / (received / 2**30),
            "core_seconds_per_gib_sent": node_cpu_ready / ((received + replica_bytes_ready) / 2**30),
            "p99_before_ms": statistics.median(w[0] for w in before),
            "p99_during_ms": statistics.median(w[0] for w in inside) if inside else None,
            "gets_per_sec_before": statistics.median(w[1] for w in before),
            "gets_per_sec_during": statistics.median(w[1] for w in inside) if inside else None,
            "errors_during": sum(w[2] for (_, _, w) in during),
        }
    finally:
        c.stop()


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--shoal", required=True)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--items", type=int, default=1_000_000, help="1 KiB items to load (1M: about 1 GiB)")
    ap.add_argument("--serve-arg", action="append", default=[],
                    help="an argument for every node's `shoal serve` (repeat; e.g. --serve-arg=--transfer-rate=50MB)")
    ap.add_argument("--windows", type=int, default=5, help="1-second latency windows before the join")
    ap.add_argument("--quiet", action="store_true",
                    help="no client load during the join: the nodes' CPU is the transfer's own")
    args = ap.parse_args()
    runs = []
    for i in range(args.runs):
        tmp = tempfile.mkdtemp(prefix="shoal-transfer-")
        try:
            r = one_run(args, tmp)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        print(f"run {i + 1}: " + json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in r.items()}),
              file=sys.stderr)
        runs.append(r)
    def med(k):
        values = [r[k] for r in runs if r[k] is not None]
        return statistics.median(values) if values else float("nan")
    print(f"state transfer, 3 -> 4 nodes, {args.items:,} items of 1 KiB, medians of {args.runs} runs")
    print(f"  transfer time      {med('transfer_seconds'):8.1f} s")
    print(f"  buckets moved      {med('buckets_moved'):8.0f}")
    print(f"  bytes moved        {med('bytes_moved') / 1e6:8.1f} MB")
    print(f"  throughput         {med('mb_per_sec'):8.1f} MB/s")
    print(f"  replica snapshots  {med('replica_snapshot_bytes') / 1e6:8.1f} MB   (sent by the nodes meanwhile)")
    print(f"  every node ready   {med('ready_seconds'):8.1f} s    (from the join; replicas in place)")
    print(f"  replica snapshots  {med('replica_snapshot_bytes_ready') / 1e6:8.1f} MB   (sent until then)")
    print(f"  node CPU           {med('node_cpu_seconds'):8.2f} s    ({med('node_cpu_us_per_kb'):.1f} µs per KB moved, four nodes)")
    print(f"  core-seconds/GiB   {med('core_seconds_per_gib_share'):8.2f}      (of the share; "
          f"{med('core_seconds_per_gib_sent'):.2f} of every byte sent until ready, replicas included)")
    print(f"  client p99 before  {med('p99_before_ms'):8.2f} ms   ({med('gets_per_sec_before'):,.0f} GET/s, 10 connections)")
    print(f"  client p99 during  {med('p99_during_ms'):8.2f} ms   ({med('gets_per_sec_during'):,.0f} GET/s)")
    print(f"  client errors during the transfer: {sum(r['errors_during'] for r in runs)}")


if __name__ == "__main__":
    main()
