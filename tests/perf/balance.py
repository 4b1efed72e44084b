#!/usr/bin/env python3
"""Balancing by data and eviction policies, measured (not timed assertions).

1. Rebalance: a 3-node cluster (sync replication, `--stats-interval 1s`) gets a skewed load:
   one `{hot}` tag holding about 30% of the bytes and some 16 KiB values, all on the hot
   tag's owner, plus small items everywhere. The dry run's plan is taken, then the real
   rebalance runs and is timed until the cluster settles. Printed per run and as medians:
   bytes moved against the planner's lower bound (what any plan within 5% of the average must
   move), fullest/emptiest before and after, the time it took and the estimate the plan gave.

2. Hit rate: one node with a 1 MiB cache and --keys keys of 200 bytes (about 15 times what
   fits) is read cache-aside (GET; on a miss, PUT) with keys drawn from a Zipf distribution
   (s = --zipf-s), --requests requests after as many to warm up, once with `--eviction lru`
   and once with `--eviction lfu`, --runs times; medians of the hit rate side by side.

Everything listens on 127.0.0.1; every process is stopped by its PID.

    cargo build --release && python3 tests/perf/balance.py --shoal target/release/shoal
"""

import argparse
import bisect
import http.client
import json
import random
import statistics
import subprocess
import tempfile
import time

from failover import Cluster, free_port, get_json, request


def put(addr, key, size):
    request("PUT", addr, f"/v1/kv/{key}", b"v" * size, timeout=30)


def rebalance_run(shoal, small):
    with tempfile.TemporaryDirectory() as tmp:
        c = Cluster(shoal, tmp, "sync")
        c.extra = ["--stats-interval", "1s"]
        try:
            first = c.start_node()
            for _ in range(2):
                c.start_node(join=first)
            c.wait_settled(0, 3)
            hot_owner = owner_of(first, "{hot}:0")
            # The skewed load: ~30% in one bucket, large values on the same node, small items.
            for i in range(small // 10):
                put(c.addrs[i % 3], f"{{hot}}:{i}", 1000)
            large = 0
            i = 0
            while large < 40:
                key = f"large-{i}"
                i += 1
                if owner_of(first, key) == hot_owner:
                    put(first, key, 16 * 1024)
                    large += 1
                else:
                    request("DELETE", first, f"/v1/kv/{key}")
            subprocess.run([shoal, "bench", "--addr", first, "--keys", str(small), "--value-size", "100",
                            "--duration", "0s", "--connections", "8"], check=True, capture_output=True)
            # Every member reported on the settled data: the plan is stable.
            end = time.time() + 60
            while True:
                a = get_json(first, "/v1/cluster/buckets?limit=1")
                time.sleep(1.5)
                b = get_json(first, "/v1/cluster/buckets?limit=1")
                if not b["missing"] and a["total_bytes"] == b["total_bytes"]:
                    break
                if time.time() > end:
                    raise RuntimeError("statistics never settled")
            dry = json.loads(request("POST", first, "/v1/cluster/rebalance?dry_run=true")[1])
            started = time.time()
            real = json.loads(request("POST", c.addrs[1], "/v1/cluster/rebalance", timeout=40)[1])
            c.wait_settled(0, 3)
            took = time.time() - started
            assert real["moves"] == dry["moves"], "the dry run's plan is what ran"
            return {
                "moved": real["bytes_moved"], "lower": real["lower_bound_bytes"], "buckets": len(real["moves"]),
                "before": real["ratio_before"], "after": real["ratio_after"], "seconds": took,
                "estimate": real["estimated_seconds"],
            }
        finally:
            c.stop()


def owner_of(addr, key):
    """The node that owns `key` (a PUT answers it), leaving a one-byte value there."""
    return json.loads(request("PUT", addr, f"/v1/kv/{key}", b"x")[1])["node"]


class Zipf:
    def __init__(self, n, s, rng):
        weights = [1.0 / (k ** s) for k in range(1, n + 1)]
        total = sum(weights)
        acc, self.cdf = 0.0, []
        for w in weights:
            acc += w / total
            self.cdf.append(acc)
        self.rng = rng

    def draw(self):
        return min(bisect.bisect_left(self.cdf, self.rng.random()), len(self.cdf) - 1)


def hit_rate_run(shoal, policy, keys, requests, s, seed):
    with tempfile.TemporaryDirectory() as tmp:
        port, peer = free_port(), free_port()
        addr = f"127.0.0.1:{port}"
        cmd = [shoal, "serve", "--listen", addr, "--peer-listen", f"127.0.0.1:{peer}", "--data-dir", tmp,
               "--cache-size", "1MiB", "--worker-threads", "1", "--eviction", policy]
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            end = time.time() + 60
            while subprocess.run([shoal, "status", "--addr", addr], capture_output=True).returncode != 0:
                if time.time() > end or proc.poll() is not None:
                    raise RuntimeError("the node did not start")
                time.sleep(0.1)
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
            zipf = Zipf(keys, s, random.Random(seed))
            # Keys are shuffled so that popularity is unrelated to the key's bucket.
            names = [f"z{i}" for i in range(keys)]
            random.Random(seed + 1).shuffle(names)
            value = b"v" * 200
            hits = 0
            for i in range(2 * requests):
                key = names[zipf.draw()]
                conn.request("GET", f"/v1/kv/{key}")
                r = conn.getresponse()
                r.read()
                if r.status == 200:
                    if i >= requests:
                        hits += 1
                elif r.status == 404:
                    conn.request("PUT", f"/v1/kv/{key}", body=value)
                    w = conn.getresponse()
                    w.read()
                else:
                    raise RuntimeError(f"GET {key}: {r.status}")
            conn.close()
            return hits / requests
        finally:
            proc.terminate()
            proc.wait()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--shoal", default="target/release/shoal")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--small", type=int, default=20000, help="small items in the rebalance load")
    p.add_argument("--keys", type=int, default=50000)
    p.add_argument("--requests", type=int, default=50000)
    p.add_argument("--zipf-s", type=float, default=0.99)
    a = p.parse_args()

    runs = []
    for r in range(a.runs):
        run = rebalance_run(a.shoal, a.small)
        runs.append(run)
        print(f"rebalance run {r + 1}: {run['buckets']} buckets, {run['moved']} bytes moved "
              f"(lower bound {run['lower']}), fullest/emptiest {run['before']:.2f} -> {run['after']:.2f}, "
              f"{run['seconds']:.1f} s (estimate {run['estimate']})", flush=True)
    med = lambda k: statistics.median(x[k] for x in runs)
    print(f"rebalance medians: moved {med('moved'):.0f} bytes, lower bound {med('lower'):.0f} "
          f"({med('moved') / max(med('lower'), 1):.2f}x), ratio {med('before'):.2f} -> {med('after'):.2f}, "
          f"{med('seconds'):.1f} s")

    rates = {"lru": [], "lfu": []}
    for r in range(a.runs):
        for policy in ("lru", "lfu"):
            rate = hit_rate_run(a.shoal, policy, a.keys, a.requests, a.zipf_s, seed=r)
            rates[policy].append(rate)
            print(f"hit rate run {r + 1} {policy}: {rate:.3f}", flush=True)
    print(f"hit rate medians (Zipf s={a.zipf_s}, {a.keys} keys, 1 MiB cache): "
          f"lru {statistics.median(rates['lru']):.3f}, lfu {statistics.median(rates['lfu']):.3f}")


if __name__ == "__main__":
    main()
