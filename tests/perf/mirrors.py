#!/usr/bin/env python3
"""Reads balanced over mirrors against reads at the owner, with one mirror slowed.

A 3-node cluster (sync replication, `--ha-strategy nodeads`, karma blocks of 2 s) holds
--keys keys. The third node's API is reached by the other nodes through a proxy that holds
every chunk --delay-ms in each direction (a slow link to one node: the kernel here has no
netem); clients reach every node directly. `shoal bench --routing any --ratio 9:1` (90%
reads, each request to a random node, which forwards) runs --duration, --runs times, with
`--read owner` and with `--read mirrors`, alternating; medians of throughput, p50 and p99 are
printed side by side, and the share of the reads balanced over mirrors that each node served
(`shoal_mirror_reads_total`).

Everything listens on 127.0.0.1; every process is stopped by its PID.

    cargo build --release && python3 tests/perf/mirrors.py --shoal target/release/shoal
"""

import argparse
import asyncio
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading

from failover import Cluster, fill, free_port, request


def start_proxy(target_port, delay):
    """A delaying TCP proxy on a free port to 127.0.0.1:target_port, in a thread."""
    port = free_port()
    ready = threading.Event()

    async def pipe(reader, writer):
        try:
            while True:
                data = await reader.read(65536)
                if not data:
                    break
                await asyncio.sleep(delay)
                writer.write(data)
                await writer.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            writer.close()

    async def handle(client_reader, client_writer):
        try:
            server_reader, server_writer = await asyncio.open_connection("127.0.0.1", target_port)
        except OSError:
            client_writer.close()
            return
        await asyncio.gather(pipe(client_reader, server_writer), pipe(server_reader, client_writer))

    async def serve():
        server = await asyncio.start_server(handle, "127.0.0.1", port)
        ready.set()
        async with server:
            await server.serve_forever()

    threading.Thread(target=lambda: asyncio.run(serve()), daemon=True).start()
    ready.wait(10)
    return port


def served_by(cluster):
    """shoal_mirror_reads_total summed over the nodes, by serving node."""
    total = {}
    for addr in cluster.addrs:
        for line in request("GET", addr, "/metrics")[1].decode().splitlines():
            if line.startswith("shoal_mirror_reads_total{"):
                node = line.split('node="')[1].split('"')[0]
                total[node] = total.get(node, 0) + float(line.rsplit(" ", 1)[1])
    return total


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shoal", default="target/release/shoal")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--keys", type=int, default=50_000)
    ap.add_argument("--duration", default="10s")
    ap.add_argument("--connections", type=int, default=32)
    ap.add_argument("--delay-ms", type=float, default=2.0)
    args = ap.parse_args()

    tmp = tempfile.mkdtemp(prefix="shoal-mirrors-")
    cluster = Cluster(args.shoal, tmp, "sync")
    cluster.extra = ["--ha-strategy", "nodeads", "--ha-period-karma", "2s"]
    results = {"owner": [], "mirrors": []}
    try:
        seed = cluster.start_node()
        cluster.start_node(join=seed)
        # The third node: the others reach its API through the slow link.
        api = free_port()
        proxy = start_proxy(api, args.delay_ms / 1000)
        cluster.extra += ["--advertise", f"127.0.0.1:{proxy}"]
        third = f"127.0.0.1:{api}"
        n = len(cluster.procs)
        cmd = [args.shoal, "serve", "--listen", third, "--peer-listen", f"127.0.0.1:{free_port()}",
               "--data-dir", f"{tmp}/n{n}", "--cache-size", "512MiB", "--worker-threads", "1",
               "--replication", "sync", "--ping-interval", "200ms", "--node-timeout", "1s",
               "--join", seed] + cluster.extra
        cluster.args.append(cmd)
        cluster.procs.append(cluster.spawn(n, cmd))
        cluster.addrs.append(third)
        cluster.wait_ready(n)
        cluster.wait_settled(0, 3)
        fill(args.shoal, seed, args.keys)
        pids = ",".join(str(p.pid) for p in cluster.procs)
        for run in range(args.runs):
            for read in ("owner", "mirrors"):
                out = subprocess.run(
                    [args.shoal, "bench", "--addr", ",".join(cluster.addrs), "--routing", "any", "--no-fill",
                     "--ratio", "9:1", "--read", read, "--keys", str(args.keys), "--duration", args.duration,
                     "--connections", str(args.connections), "--server-pid", pids, "-o", "json"],
                    check=True, capture_output=True, text=True)
                r = json.loads(out.stdout)
                errors = sum(r["errors"].values())
                results[read].append((r["requests_per_sec"], r["latency"]["p50_ms"], r["latency"]["p99_ms"], errors))
                print(f"  run {run + 1} read={read}: {r['requests_per_sec']:.0f} req/s, p50 {r['latency']['p50_ms']:.3f} ms,"
                      f" p99 {r['latency']['p99_ms']:.3f} ms, errors {errors}", flush=True)
        share = served_by(cluster)
    finally:
        cluster.stop()
        shutil.rmtree(tmp, ignore_errors=True)

    def med(read, i):
        return statistics.median(x[i] for x in results[read])

    print(f"\nthree nodes, the third behind a {args.delay_ms} ms-each-way link, 90% reads, routing any, "
          f"medians of {args.runs}")
    print(f"{'read':<8} {'req/s':>10} {'p50 ms':>8} {'p99 ms':>8} {'errors':>7}")
    for read in ("owner", "mirrors"):
        print(f"{read:<8} {med(read, 0):>10.0f} {med(read, 1):>8.3f} {med(read, 2):>8.3f} {int(med(read, 3)):>7}")
    total = sum(share.values()) or 1
    print("mirror reads served by node: " + ", ".join(f"{k}: {v / total:.1%}" for k, v in sorted(share.items())))
    return 0


if __name__ == "__main__":
    sys.exit(main())
