#!/usr/bin/env python3
"""Server instructions per replicated PUT (or per GET) on three nodes, counted by callgrind.

Timed runs of three nodes on this 2-core VM move by tens of percent from one run to the next;
instruction counts do not. For each build given: three nodes in sync mode (one worker thread
each) run under valgrind's callgrind; `shoal bench --routing direct` fills 2,000 keys, the
counters of all three are zeroed, PUTs run from 8 connections for --duration, and the
counters are dumped. Printed per build: PUTs done, and per PUT the instructions of the three
processes together (their background work included: under valgrind they serve about a
thousand PUTs a second, so pings and the reconciler weigh more per PUT than at full speed).

With `--op get` the timed requests are GETs of those keys instead, and with `--routing any`
each goes to a random node, which forwards the two thirds it does not own: the difference
between `--routing any` and `--routing direct`, divided by 2/3, is what a forwarded read costs
the servers.

    python3 tests/perf/replica_instructions.py target/release/shoal /tmp/baseline-shoal
    python3 tests/perf/replica_instructions.py --op get --routing any target/release/shoal

Needs valgrind. Everything listens on 127.0.0.1, and every process is stopped by its PID.
"""
import argparse
import glob
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import failover  # noqa: E402  (its Cluster starts and stops the nodes)


class Callgrind(failover.Cluster):
    """A cluster whose nodes run under callgrind, with timeouts that suit its slowness."""

    def spawn(self, n, cmd):
        cmd = [a if a != "1s" else "10s" for a in cmd]  # --node-timeout
        out = os.path.join(self.tmp, f"callgrind-n{n}.out")
        log = open(os.path.join(self.tmp, f"n{n}.log"), "a")
        return subprocess.Popen(["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}"] + cmd,
                                stdout=subprocess.DEVNULL, stderr=log)


def total(dump):
    out = subprocess.run(["callgrind_annotate", dump], capture_output=True, text=True).stdout
    m = re.search(r"([\d,]+) \(100.0%\)\s+PROGRAM TOTALS", out)
    return int(m.group(1).replace(",", "")) if m else 0


def measure(shoal, duration, op, routing, keep=None):
    tmp = tempfile.mkdtemp(prefix="shoal-cg3-")
    cluster = Callgrind(shoal, tmp, "sync")
    try:
        seed = cluster.start_node()
        for _ in range(2):
            cluster.start_node(join=seed)
        cluster.wait_settled(0, 3, limit=900)
        bench = [shoal, "bench", "--addr", ",".join(cluster.addrs), "--keys", "2000", "--connections", "8"]
        subprocess.run(bench + ["--routing", "direct", "--ratio", "0:1", "--duration", "3s"], check=True,
                       capture_output=True)
        bench += ["--routing", routing, "--ratio", "0:1" if op == "put" else "1:0"]
        for p in cluster.procs:
            subprocess.run(["callgrind_control", "-z", str(p.pid)], capture_output=True)
        out = subprocess.run(bench + ["--duration", duration, "--no-fill", "-o", "json"], check=True,
                             capture_output=True, text=True)
        done = json.loads(out.stdout)["requests"]
        for p in cluster.procs:
            subprocess.run(["callgrind_control", "-d", str(p.pid)], capture_output=True)
        dumps = glob.glob(os.path.join(tmp, "callgrind-n*.out.1"))
        instructions = sum(total(d) for d in dumps)
        if keep:
            os.makedirs(keep, exist_ok=True)
            for d in dumps:
                shutil.copy(d, keep)
        return done, instructions
    finally:
        cluster.stop()
        shutil.rmtree(tmp, ignore_errors=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("shoal", nargs="+", help="release builds to count")
    ap.add_argument("--duration", default="10s")
    ap.add_argument("--op", choices=["put", "get"], default="put")
    ap.add_argument("--routing", choices=["direct", "any"], default="direct")
    ap.add_argument("--keep", help="copy the three dumps here (callgrind_annotate reads them); one build only")
    args = ap.parse_args()
    if not shutil.which("valgrind"):
        subprocess.run(["apt-get", "install", "-y", "-qq", "valgrind"], check=True)
    op = args.op.upper()
    print(f"{'binary':<40} {op + 's':>8} {f'instructions/{op} (3 nodes)':>28}  routing {args.routing}")
    for shoal in args.shoal:
        done, instructions = measure(shoal, args.duration, args.op, args.routing, args.keep)
        print(f"{shoal:<40} {done:>8} {instructions // max(done, 1):>28,}")


if __name__ == "__main__":
    main()
