#!/usr/bin/env python3
"""Peak memory of a shoal node against its --memory-limit, under write patterns that each
write well over the limit (a benchmark, run by hand; the figures go in tests/perf/README.md).

For every pattern a fresh node starts with `--memory-limit` (default 256MiB, as the
StatefulSet sets it), the pattern runs, and the kernel's peak resident size (VmHWM, which
also catches spikes between samples) is read before the node is stopped. The table says how
far under or over the limit each pattern peaked, and what the store charged at the end.

    python3 tests/perf/memory.py --shoal target/release/shoal [--limit 256MiB] [--only NAME]

Exits 1 when any pattern peaked at or above the limit. Servers listen on 127.0.0.1 only and
every process started here is stopped by its PID, also on errors.
"""

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

MIB = 1024 * 1024


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def status_kib(pid, field):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def parse_size(text):
    units = {"KiB": 1024, "MiB": MIB, "GiB": 1024 * MIB, "": 1}
    for unit in sorted(units, key=len, reverse=True):
        if text.endswith(unit) and text[: len(text) - len(unit)].isdigit():
            return int(text[: len(text) - len(unit)]) * units[unit]
    raise SystemExit(f"--limit {text!r}: expected e.g. 256MiB")


def get_json(base, path):
    with urllib.request.urlopen(base + path, timeout=10) as r:
        return json.load(r)


class Node:
    """One `shoal serve` with a memory limit, stopped by its PID."""

    def __init__(self, shoal, limit, env_extra, join=None):
        self.dir = tempfile.mkdtemp(prefix="shoal-memory-")
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        env = dict(os.environ, **env_extra)
        args = [shoal, "serve", "--listen", f"127.0.0.1:{self.port}", "--peer-listen", f"127.0.0.1:{free_port()}",
                "--data-dir", os.path.join(self.dir, "data"), "--memory-limit", str(limit)]
        if join:
            args += ["--join", join]
        self.log = open(os.path.join(self.dir, "node.log"), "w")
        self.proc = subprocess.Popen(args, stdout=self.log, stderr=self.log, env=env)
        deadline = time.time() + 60
        while True:
            try:
                with urllib.request.urlopen(self.base + "/readyz", timeout=1) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if self.proc.poll() is not None or time.time() > deadline:
                self.stop()
                raise RuntimeError("the node did not become ready")
            time.sleep(0.1)

    def peak(self):
        return status_kib(self.proc.pid, "VmHWM") * 1024

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        shutil.rmtree(self.dir, ignore_errors=True)


def bench(shoal, node, **kw):
    """`shoal bench` writes only, without its fill; returns its JSON report. `node` may be a
    list: the writes go to each key's owner."""
    nodes = node if isinstance(node, list) else [node]
    addrs = ",".join(f"127.0.0.1:{n.port}" for n in nodes)
    args = [shoal, "bench", "--addr", addrs, "--ratio", "0:1", "--no-fill", "-o", "json"]
    for k, v in kw.items():
        args += [f"--{k.replace('_', '-')}", str(v)]
    out = subprocess.run(args, capture_output=True, text=True, timeout=600)
    if out.returncode != 0:
        return {"error": out.stderr.strip()[-200:]}
    return json.loads(out.stdout)


def phases(shoal, node, sizes):
    """One 10 s bench per (value size, keys), 32 connections; the last report, with the node's
    CPU per request in each phase as its note (what allocator settings cost)."""
    reports = [bench(shoal, node, value_size=v, keys=k, connections=32, duration="10s", server_pid=node.proc.pid)
               for v, k in sizes]
    last = dict(reports[-1])
    last["note"] = "server µs/request by phase: " + ", ".join(
        f"{r.get('server_us_per_request') or 0:.1f}" for r in reports)
    return last


def slow_bodies(node, count=200, size=16 * MIB, seconds=10):
    """`count` connections each announce a `size` body and trickle it; the server must not
    buffer them all."""
    socks = []
    try:
        for i in range(count):
            s = socket.create_connection(("127.0.0.1", node.port), timeout=5)
            s.sendall(f"PUT /v1/kv/slow-{i} HTTP/1.1\r\nHost: x\r\nContent-Length: {size}\r\n\r\n".encode())
            socks.append(s)
        chunk = b"x" * (size // 40)
        end = time.time() + seconds
        while time.time() < end:
            for s in socks:
                try:
                    s.sendall(chunk)
                except OSError:
                    pass
            time.sleep(0.1)
    finally:
        for s in socks:
            s.close()
    return {}


def bulk_get_bomb(node, shoal):
    """1000 values of 1 MiB written, then read back in one bulk get."""
    bench(shoal, node, value_size=MIB, keys=1000, connections=4, duration="15s")
    keys = [f"key:{i:012}" for i in range(1000)]
    req = urllib.request.Request(node.base + "/v1/bulk/get", data=json.dumps({"keys": keys}).encode(), method="POST")
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            r.read()
            return {"status": r.status}
    except urllib.error.HTTPError as e:
        return {"status": e.code}


def post_expecting_continue(port, path, data):
    """POSTs `data` as curl does with a large body: `Expect: 100-continue`, and the body only
    once the server said 100 (a refusal comes before it). Answers status and headers."""
    import http.client
    import select
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    try:
        conn.putrequest("POST", path)
        for name, value in [("Content-Type", "application/json"), ("Content-Length", str(len(data))),
                            ("Expect", "100-continue")]:
            conn.putheader(name, value)
        conn.endheaders()
        # As curl: wait a moment for the server's word, then send anyway.
        readable, _, _ = select.select([conn.sock], [], [], 1.0)
        if not readable or conn.sock.recv(12, socket.MSG_PEEK) == b"HTTP/1.1 100":
            conn.send(data)
        r = conn.getresponse()
        r.read()
        return r.status, r.headers
    finally:
        conn.close()


def bulk_bodies(node, body_mib, parallel, total_mib):
    """Bulk puts whose JSON bodies are `body_mib` MiB each (items of 100 KiB), `parallel` at a
    time, until `total_mib` MiB were sent; counts the answers by status (a body over the
    node's bulk limit is 413 before it is read; a full budget is 503 with Retry-After)."""
    item = 100 * 1024
    per_body = max(1, body_mib * MIB // (item + 64))
    bodies = max(1, total_mib // body_mib)
    statuses, lock = {}, threading.Lock()
    counter = iter(range(bodies))

    def send(i):
        items = [{"key": f"bulk-{i}-{j}", "value": "v" * item} for j in range(per_body)]
        data = json.dumps({"items": items}).encode()
        try:
            status, headers = post_expecting_continue(node.port, "/v1/bulk/put", data)
            if status == 503 and not headers.get("Retry-After"):
                status = "503 without Retry-After"
        except OSError as e:
            status = type(e).__name__
        with lock:
            statuses[status] = statuses.get(status, 0) + 1

    def worker():
        for i in counter:
            send(i)

    threads = [threading.Thread(target=worker) for _ in range(parallel)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    alive = node.proc.poll() is None
    return {"note": "answers " + ", ".join(f"{k}: {v}" for k, v in sorted(statuses.items(), key=str))
            + ("" if alive else "; THE NODE DIED")}


def replicas(shoal, first, limit, env_extra, value_size):
    """Three members (sync replication): every node holds its own items and another's replica,
    both stores full; the highest peak of the three counts."""
    others = [Node(shoal, limit, env_extra, join=f"127.0.0.1:{first.port}") for _ in range(2)]
    try:
        nodes = [first] + others
        deadline = time.time() + 120
        while True:
            view = get_json(first.base, "/v1/cluster")
            r = view.get("replication") or {}
            settled = len(view["members"]) == 3 and view.get("transfer") is None and view.get("transition") is None
            if settled and r.get("attached_buckets") == r.get("owned_buckets"):
                break
            if time.time() > deadline:
                raise RuntimeError("the three nodes did not settle")
            time.sleep(0.5)
        report = bench(shoal, nodes, value_size=value_size, keys=max(1, 2 * 3 * limit // value_size), connections=24,
                       duration="30s")
        peaks = [n.peak() for n in nodes]
        report["peak"] = max(peaks)
        report["note"] = "peaks " + ", ".join(f"{p / MIB:.0f}M" for p in peaks)
        return report
    finally:
        for n in others:
            n.stop()


PATTERNS = {
    # name: (what, run(node) -> report)
    "small": ("100 B values, 5M keys, 50 connections, 20 s",
              lambda shoal, n: bench(shoal, n, value_size=100, keys=5_000_000, connections=50, duration="20s")),
    "medium": ("5 KB values (kept out of line), 200k keys, 20 s",
               lambda shoal, n: bench(shoal, n, value_size=5000, keys=200_000, connections=50, duration="20s")),
    "large": ("1 MiB values, 2000 keys, 16 connections, 20 s",
              lambda shoal, n: bench(shoal, n, value_size=MIB, keys=2000, connections=16, duration="20s")),
    "max": ("16 MiB values, 64 keys, 8 connections, 15 s",
            lambda shoal, n: bench(shoal, n, value_size=16 * MIB, keys=64, connections=8, duration="15s")),
    "overwrites": ("1000 B values over 10k keys, 20 s",
                   lambda shoal, n: bench(shoal, n, value_size=1000, keys=10_000, connections=50, duration="20s")),
    "shift": ("eviction churn as sizes shift: 100 B, then 64 KiB, then 100 B, 10 s each",
              lambda shoal, n: phases(shoal, n, [(100, 3_000_000), (65536, 20_000), (100, 3_000_000)])),
    "bulk": ("bulk puts of 60 x 100 KiB (8 MB bodies, under the limit), 8 connections, 20 s",
             lambda shoal, n: bench(shoal, n, value_size=102400, keys=20_000, batch=60, connections=8, duration="20s")),
    "connections": ("1000 connections, 10 KiB values, 20 s",
                    lambda shoal, n: bench(shoal, n, value_size=10240, keys=100_000, connections=1000, duration="20s")),
    "replicas": ("3 nodes, sync replication, 1 KiB values to each key's owner, 30 s",
                 lambda shoal, n: replicas(shoal, n, LIMIT[0], ENV[0], 1024)),
    "replicas-large": ("3 nodes, sync replication, 256 KiB values to each key's owner, 30 s",
                       lambda shoal, n: replicas(shoal, n, LIMIT[0], ENV[0], 262144)),
    "slow": ("200 connections trickling 16 MiB bodies, 10 s",
             lambda shoal, n: slow_bodies(n)),
    "bulk-get": ("1000 x 1 MiB values read back in one bulk get",
                 lambda shoal, n: bulk_get_bomb(n, shoal)),
    "bulk-57": ("500 MB in 57 MiB bulk bodies, one at a time",
                lambda shoal, n: bulk_bodies(n, 57, 1, 500)),
    "bulk-57x4": ("57 MiB bulk bodies, four at a time, 12 in all",
                  lambda shoal, n: bulk_bodies(n, 57, 4, 57 * 12)),
    "bulk-8x4": ("8 MiB bulk bodies (the limit at 256 MiB), four at a time, 500 MB in all",
                 lambda shoal, n: bulk_bodies(n, 8, 4, 500)),
}


LIMIT, ENV = [0], [{}]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shoal", default="target/release/shoal")
    ap.add_argument("--limit", default="256MiB")
    ap.add_argument("--only", action="append", help="run only this pattern (repeatable)")
    ap.add_argument("--env", action="append", default=[], help="NAME=VALUE for the node (e.g. MIMALLOC_ALLOW_THP=0)")
    args = ap.parse_args()
    limit = parse_size(args.limit)
    env_extra = dict(e.split("=", 1) for e in args.env)
    LIMIT[0], ENV[0] = limit, env_extra
    try:
        import resource
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, 8192), hard))
    except (ValueError, OSError):
        pass
    thp = open("/sys/kernel/mm/transparent_hugepage/enabled").read().strip()
    print(f"limit {limit // MIB} MiB; transparent huge pages: {thp}; node env: {env_extra or '-'}")
    print(f"{'pattern':12} {'peak RSS':>10} {'of limit':>9} {'charged':>9} {'items':>9} {'store limit':>12}  notes")
    over = False
    for name, (what, run) in PATTERNS.items():
        if args.only and name not in args.only:
            continue
        node = Node(args.shoal, limit, env_extra)
        try:
            report = run(args.shoal, node)
            stats = get_json(node.base, "/v1/node")
            peak = max(node.peak(), report.get("peak", 0) if isinstance(report, dict) else 0)
        finally:
            node.stop()
        over |= peak >= limit
        notes = what
        if isinstance(report, dict) and report.get("error"):
            notes += f"; bench: {report['error']}"
        elif isinstance(report, dict) and report.get("errors"):
            notes += f"; bench errors: {report['errors']}"
        elif isinstance(report, dict) and "status" in report:
            notes += f"; answer {report['status']}"
        if isinstance(report, dict) and report.get("note"):
            notes += f"; {report['note']}"
        print(f"{name:12} {peak / MIB:9.0f}M {100 * peak / limit:8.0f}% {stats['bytes'] / MIB:8.0f}M "
              f"{stats['items']:>9} {stats['limit_bytes'] / MIB:11.0f}M  {notes}", flush=True)
    sys.exit(1 if over else 0)


if __name__ == "__main__":
    main()
