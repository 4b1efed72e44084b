#!/usr/bin/env python3
"""The client library against forwarding: three nodes on this machine, `shoal bench` through
`shoal::client` (`--routing client`: each key to its owner from the map the client follows)
side by side with `--routing any` (a random node, which forwards two thirds of the operations)
and `--routing direct` (the bench's own routing from the map, for reference). Reports ops/s and
server CPU µs per operation, medians of --runs clean runs, for GETs and PUTs.

Loopback only; every process started here is stopped by its PID, also on errors. Waits until the
cluster has settled (no transition, no transfer, every replica attached) before measuring.

    cargo build --release && python3 tests/perf/client.py --shoal target/release/shoal
"""

import argparse
import os
import shutil
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from compare import Processes, measured, median, settled, shoal_bench, start_shoal  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--shoal", required=True)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--duration", type=int, default=5)
    ap.add_argument("--connections", type=int, default=50)
    ap.add_argument("--keys", type=int, default=100_000)
    ap.add_argument("--value-size", type=int, default=100)
    args = ap.parse_args()
    procs = Processes()
    tmp = tempfile.mkdtemp(prefix="shoal-client-perf-")
    try:
        p1, a1 = start_shoal(procs, args, os.path.join(tmp, "n1"))
        settled([a1])
        p2, a2 = start_shoal(procs, args, os.path.join(tmp, "n2"), join=a1)
        settled([a1, a2])
        p3, a3 = start_shoal(procs, args, os.path.join(tmp, "n3"), join=a1)
        settled([a1, a2, a3])
        pids = [p1.pid, p2.pid, p3.pid]
        shoal_bench([a1], pids, args, ratio="0:1", fill=True, pin=None)
        rows = []
        for ratio, op in (("1:0", "GET"), ("0:1", "PUT")):
            figures = {}
            for routing in ("client", "any", "direct"):
                addrs = [a1, a2, a3] if routing == "any" else [a1]
                figures[routing] = measured(
                    lambda: shoal_bench(addrs, pids, args, ratio=ratio, routing=routing, pin=None),
                    args.runs, f"{op} {routing}")
            rows.append((op, figures))
    finally:
        procs.stop_all()
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"3 nodes, {args.connections} connections, {args.value_size} B values, {args.keys:,} keys, "
          f"medians of {args.runs} runs of {args.duration}s")
    print(f"{'figure':<28}{'client':>10}{'any':>10}{'direct':>10}{'client/any':>12}")
    for op, f in rows:
        ops = {k: median(v, "ops") for k, v in f.items()}
        us = {k: median(v, "server_us") for k, v in f.items()}
        print(f"{op + ' ops/s':<28}{ops['client']:>10,.0f}{ops['any']:>10,.0f}{ops['direct']:>10,.0f}"
              f"{ops['client'] / ops['any']:>12.2f}")
        print(f"{op + ' server µs/op':<28}{us['client']:>10.2f}{us['any']:>10.2f}{us['direct']:>10.2f}"
              f"{us['client'] / us['any']:>12.2f}")


if __name__ == "__main__":
    main()
