#!/usr/bin/env python3
"""Server instructions per replicated PUT (or per GET) on three nodes, counted by callgrind.

Timed runs of three nodes on this 2-core VM move by tens of percent from one run to the next;
instruction counts do not. For each build given: three nodes in sync mode (one worker thread
each) run under valgrind's callgrind; `shoal bench --routing direct` fills 2,000 keys, the
counters of all three are zeroed, PUTs run from 8 connections for --duration, and the
counters are dumped. Printed per build: PUTs done, and per PUT the instructions of the three
processes together, first all of them, then with the work the idle cluster does over the same
time taken off (measured just before, counters zeroed, no load for --duration): under valgrind
the nodes serve about a thousand PUTs a second, so pings, the reconciler and timers weigh ten to
twenty times more per PUT than at full speed, where the second figure is the one that counts.

With `--nodes 1` the same runs against one node alone (no replica): the denominator of "what a
replicated PUT costs against one node's PUT", measured the same way. `--runs 3` repeats each
measurement and prints the median (and every run).

With `--op get` the timed requests are GETs of those keys instead, and with `--routing any`
each goes to a random node, which forwards the two thirds it does not own: the difference
between `--routing any` and `--routing direct`, divided by 2/3, is what a forwarded read costs
the servers.

    python3 tests/perf/replica_instructions.py target/release/shoal /tmp/baseline-shoal
    python3 tests/perf/replica_instructions.py --op get --routing any target/release/shoal
    python3 tests/perf/replica_instructions.py --nodes 1 --runs 3 target/release/shoal

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
import time

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


def dumped(cluster, tmp, n):
    """Dumps every node's counters (the n-th dump) and answers their instructions together."""
    for p in cluster.procs:
        subprocess.run(["callgrind_control", "-d", str(p.pid)], capture_output=True)
    dumps = glob.glob(os.path.join(tmp, f"callgrind-n*.out.{n}"))
    return sum(total(d) for d in dumps), dumps


def zeroed(cluster):
    for p in cluster.procs:
        subprocess.run(["callgrind_control", "-z", str(p.pid)], capture_output=True)
    return time.monotonic()


def measure(shoal, duration, op, routing, nodes=3, keep=None):
    """Operations done, the nodes' instructions meanwhile, and their instructions over the same
    time with no load (pings, the reconciler, timers: what the nodes do anyway)."""
    tmp = tempfile.mkdtemp(prefix="shoal-cg3-")
    cluster = Callgrind(shoal, tmp, "sync")
    try:
        seed = cluster.start_node()
        for _ in range(nodes - 1):
            cluster.start_node(join=seed)
        if nodes > 1:
            cluster.wait_settled(0, nodes, limit=900)
        bench = [shoal, "bench", "--addr", ",".join(cluster.addrs), "--keys", "2000", "--connections", "8"]
        subprocess.run(bench + ["--routing", "direct", "--ratio", "0:1", "--duration", "3s"], check=True,
                       capture_output=True)
        bench += ["--routing", routing, "--ratio", "0:1" if op == "put" else "1:0"]
        started = zeroed(cluster)
        time.sleep(float(duration.rstrip("s")))
        idle, _ = dumped(cluster, tmp, 1)
        idle_per_s = idle / (time.monotonic() - started)
        started = zeroed(cluster)
        out = subprocess.run(bench + ["--duration", duration, "--no-fill", "-o", "json"], check=True,
                             capture_output=True, text=True)
        done = json.loads(out.stdout)["requests"]
        instructions, dumps = dumped(cluster, tmp, 2)
        idle = idle_per_s * (time.monotonic() - started)
        if keep:
            os.makedirs(keep, exist_ok=True)
            for d in dumps:
                shutil.copy(d, keep)
        return done, instructions, idle
    finally:
        cluster.stop()
        shutil.rmtree(tmp, ignore_errors=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("shoal", nargs="+", help="release builds to count")
    ap.add_argument("--duration", default="10s")
    ap.add_argument("--op", choices=["put", "get"], default="put")
    ap.add_argument("--routing", choices=["direct", "any"], default="direct")
    ap.add_argument("--nodes", type=int, choices=[1, 3], default=3)
    ap.add_argument("--runs", type=int, default=1, help="measurements per build; the median is printed")
    ap.add_argument("--keep", help="copy the dumps here (callgrind_annotate reads them); one build, one run")
    args = ap.parse_args()
    if not shutil.which("valgrind"):
        subprocess.run(["apt-get", "install", "-y", "-qq", "valgrind"], check=True)
    op = args.op.upper()
    what = f"instructions/{op} ({args.nodes} node{'s' if args.nodes > 1 else ''})"
    print(f"{'binary':<34} {op + 's':>7} {what:>27} {'idle work taken off':>20}  routing {args.routing}, "
          f"median of {args.runs}")
    for shoal in args.shoal:
        runs = [measure(shoal, args.duration, args.op, args.routing, args.nodes, args.keep) for _ in range(args.runs)]
        per_op = sorted((i // max(d, 1), int(max(i - idle, 0)) // max(d, 1), d) for d, i, idle in runs)
        net = sorted(n for _, n, _ in per_op)
        median, _, done = per_op[len(per_op) // 2]
        print(f"{shoal:<34} {done:>7} {median:>27,} {net[len(net) // 2]:>20,}  "
              f"(all: {', '.join(f'{p:,}' for p, _, _ in per_op)}; idle taken off: {', '.join(f'{n:,}' for n in net)})",
              flush=True)


if __name__ == "__main__":
    main()
