"""Benchmark of the MCP tools: figures to report, not to assert.

    python3 tests/bench_mcp.py [--data DIR] [--days N] [--budget-s S]

Builds (once; cached in ``--data``, default /tmp/healthlog-bench-mcp) the store of
tests/bench_read.py: ten metrics by the minute, a night's sleep summary and a workout each
day, journaled and folded by the real ingest and fold code (``--days`` days, default 90).
Then it measures each tool call, median of 3, over stdio (``healthlog.py mcp``, a
subprocess: the store opened read-only) and over HTTP (``POST /mcp`` on a ``serve``
subprocess), beside the read routes the tools call for the same question; and the stdio
server's peak VmRSS. The machine is shared and noisy: compare figures within one run.
"""

from __future__ import annotations

import argparse
import http.client
import json
import statistics
import subprocess
import sys
import time
import urllib.parse
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

import bench_read  # noqa: E402  (the read benchmark's store and serve helper)

CALLS = [
    ("list_metrics", {}),
    ("get_series", {"metric": "step_count", "range": "24h"}),
    ("get_series", {"metric": "step_count", "range": "30d"}),
    ("get_series", {"metric": "heart_rate", "range": "30d"}),
    ("get_series", {"metric": "heart_rate", "range": "all"}),
    ("get_day_summary", {}),
    ("get_sleep", {"range": "30d"}),
    ("compare_periods", {"metrics": ["step_count", "heart_rate", "sleep_analysis"],
                         "first": {"from": "2025-01-01", "to": "2025-01-31"},
                         "second": {"from": "2025-02-01", "to": "2025-02-28"}}),
    ("get_data_health", {}),
]
ROUTES = [("/api/summary", {}), ("/api/plan", {"metric": "heart_rate", "range": "all"}),
          ("/api/coverage", {})]
REPEATS = 3


def label(name: str, arguments: dict) -> str:
    shown = ",".join("%s=%s" % (k, v) for k, v in arguments.items()
                     if k in ("metric", "range"))
    return name + (" " + shown if shown else "")


class Stdio:
    """``healthlog.py mcp`` as a desktop client starts it."""

    def __init__(self, data_dir: Path):
        self.proc = subprocess.Popen(
            [sys.executable, str(ROOT / "healthlog.py"), "mcp", "--data", str(data_dir),
             "--log-level", "WARN"], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        self.next_id = 0
        self.ask("initialize", {"protocolVersion": "2025-11-25", "capabilities": {},
                                "clientInfo": {"name": "bench", "version": "1"}})
        self.peak = self.rss_mib()

    def ask(self, method: str, params: dict) -> dict:
        self.next_id += 1
        line = json.dumps({"jsonrpc": "2.0", "id": self.next_id, "method": method,
                           "params": params})
        self.proc.stdin.write(line.encode() + b"\n")
        self.proc.stdin.flush()
        reply = json.loads(self.proc.stdout.readline())
        if "error" in reply or reply["result"].get("isError"):
            raise SystemExit("%s failed: %s" % (method, json.dumps(reply)[:300]))
        return reply

    def rss_mib(self) -> float:
        for line in Path("/proc/%d/status" % self.proc.pid).read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
        return float("nan")

    def stop(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(60)


def http_call(port: int, method: str, path: str, body: bytes = None) -> tuple:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    try:
        headers = {"Authorization": "Bearer " + bench_read.TOKEN,
                   "MCP-Protocol-Version": "2025-11-25"}
        if body is not None:
            headers["Content-Type"] = "application/json"
        started = time.perf_counter()
        conn.request(method, path, body=body, headers=headers)
        response = conn.getresponse()
        data = response.read()
        elapsed = time.perf_counter() - started
    finally:
        conn.close()
    if response.status != 200:
        raise SystemExit("%s %s answered %d" % (method, path, response.status))
    return elapsed, len(data)


def median_s(run, *args) -> tuple:
    """(median seconds, bytes of the last answer) of :data:`REPEATS` runs of
    ``run(*args)``."""
    times, size = [], 0
    for _ in range(REPEATS):
        elapsed, size = run(*args)
        times.append(elapsed)
    return statistics.median(times), size


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--data", type=Path, default=Path("/tmp/healthlog-bench-mcp"))
    parser.add_argument("--days", type=int, default=90)
    parser.add_argument("--budget-s", type=float, default=300.0)
    args = parser.parse_args(argv)
    data_dir = args.data.resolve()
    info = bench_read.cached(data_dir, args.days)
    if info is None:
        if data_dir.exists() and any(data_dir.iterdir()):
            raise SystemExit("%s holds something else; pass another --data" % data_dir)
        print("building %s: %d days x 10 metrics by the minute" % (data_dir, args.days),
              flush=True)
        info = bench_read.build(data_dir, args.days, args.budget_s)
    print("store: %d days, %d points, %s" % (info["days"], info["points"], data_dir))
    stdio = Stdio(data_dir)
    rows = []
    try:
        def call_stdio(name: str, arguments: dict) -> tuple:
            started = time.perf_counter()
            reply = stdio.ask("tools/call", {"name": name, "arguments": arguments})
            return time.perf_counter() - started, len(json.dumps(reply))

        for name, arguments in CALLS:
            rows.append([label(name, arguments), *median_s(call_stdio, name, arguments)])
    finally:
        peak = stdio.rss_mib()
        stdio.stop()
    serve = bench_read.Serve(sys.executable, data_dir)
    try:
        for row, (name, arguments) in zip(rows, CALLS):
            body = json.dumps({"jsonrpc": "2.0", "id": 1, "method": "tools/call",
                               "params": {"name": name, "arguments": arguments}}).encode()
            row.append(median_s(http_call, serve.port, "POST", "/mcp", body)[0])
        routes = [(path, median_s(http_call, serve.port, "GET",
                                  path + "?" + urllib.parse.urlencode(query)))
                  for path, query in ROUTES]
    finally:
        serve.stop()
    print("\n%-44s %9s %9s %11s" % ("tool (median of %d)" % REPEATS, "stdio", "POST /mcp",
                                    "reply bytes"))
    for text, stdio_s, size, http_s in rows:
        print("%-44s %7.0f ms %7.0f ms %11d" % (text, stdio_s * 1000, http_s * 1000, size))
    print("\nthe routes those tools call, for comparison:")
    for path, (seconds, size) in routes:
        print("  GET %-36s %7.0f ms %11d bytes" % (path, seconds * 1000, size))
    print("\nstdio server's peak VmRSS: %.1f MiB" % peak)
    return 0


if __name__ == "__main__":
    sys.exit(main())
