"""Benchmarks: figures to report, not to assert (design.md §13).

    python3 tests/bench.py [ingest] [--python PYTHON]

``ingest``: POST -> 200 latency over loopback for 1 KB, 2 MB and 60 MB HAE-shaped
bodies against a real ``serve`` subprocess, and the peak RSS (VmHWM) of that process
before and after the 60 MB uploads.  The machine is shared and noisy: compare
figures within one run, and read medians.
"""

from __future__ import annotations

import argparse
import http.client
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TOKEN = "bench-token-0123456789abcdef"


def metrics_body(target_bytes: int, seed: int = 1) -> bytes:
    """A minute-grouped HAE metrics body of about ``target_bytes``, pretty-printed."""
    rng = random.Random(seed)
    names = ["step_count", "active_energy", "heart_rate", "walking_running_distance"]
    metrics, points, size, minute = [], [], 60, 0
    while size < target_bytes:
        name = names[len(metrics) % len(names)]
        day, rest = divmod(minute, 1440)
        stamp = "2026-%02d-%02d %02d:%02d:00 -0700" % (
            1 + day // 28 % 12, 1 + day % 28, rest // 60, rest % 60)
        minute += 1
        if name == "heart_rate":
            point = ('{\n  "Min" : %d,\n  "date" : "%s",\n  "Avg" : %.17g,\n  "Max" : %d,\n'
                     '  "source" : "Apple Watch|iPhone"\n}' % (
                         rng.randint(50, 70), stamp, rng.uniform(60, 90), rng.randint(90, 140)))
        else:
            point = '{\n  "qty" : %.17g,\n  "source" : "Apple Watch",\n  "date" : "%s"\n}' % (
                rng.uniform(0, 200), stamp)
        points.append(point)
        size += len(point) + 2
        if len(points) == 5000 or size >= target_bytes:
            metrics.append('{\n "name" : "%s",\n "units" : "count",\n "data" : [\n%s\n]\n}'
                           % (name, ",\n".join(points)))
            points = []
    return ('{\n  "data" : {\n    "metrics" : [\n%s\n]\n  }\n}' % ",\n".join(metrics)).encode()


class Serve:
    def __init__(self, python: str, data_dir: Path):
        self.log = data_dir.parent / "serve.log"
        self.proc = subprocess.Popen(
            [python, str(ROOT / "healthlog.py"), "serve", "--data", str(data_dir), "--listen",
             "127.0.0.1:0", "--token", TOKEN],
            stdout=subprocess.DEVNULL, stderr=open(self.log, "wb"))
        self.port = self._port()

    def _port(self) -> int:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            for line in self.log.read_text(errors="replace").splitlines():
                if 'msg=serving' in line:
                    return int(line.split(" listen=", 1)[1].split()[0].rsplit(":", 1)[1])
            time.sleep(0.1)
        raise SystemExit("serve did not start: " + self.log.read_text())

    def peak_rss_mib(self) -> float:
        for line in Path("/proc/%d/status" % self.proc.pid).read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
        return float("nan")

    def post(self, body: bytes) -> float:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=600)
        started = time.perf_counter()
        conn.request("POST", "/api/ingest", body=body, headers={
            "Authorization": "Bearer " + TOKEN, "Content-Type": "application/json"})
        response = conn.getresponse()
        response.read()
        elapsed = time.perf_counter() - started
        conn.close()
        if response.status != 200:
            raise SystemExit("POST answered %d" % response.status)
        return elapsed

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(60)


def bench_ingest(python: str) -> None:
    sizes = [("1 KB", 1000, 50), ("2 MB", 2 << 20, 10), ("60 MB", 60 << 20, 3)]
    bodies = {label: metrics_body(size) for label, size, _ in sizes}
    with tempfile.TemporaryDirectory() as tmp:
        serve = Serve(python, Path(tmp) / "data")
        try:
            print("ingest: POST -> 200 over loopback, %s" % subprocess.check_output(
                [python, "-c", "import sys; print(sys.version.split()[0])"], text=True).strip())
            print("%-6s %12s %10s %10s %10s" % ("body", "bytes", "median", "min", "max"))
            for label, _, runs in sizes:
                if label == "60 MB":
                    rss_before = serve.peak_rss_mib()
                times = [serve.post(bodies[label]) for _ in range(runs)]
                print("%-6s %12d %9.1fms %9.1fms %9.1fms" % (
                    label, len(bodies[label]), statistics.median(times) * 1000,
                    min(times) * 1000, max(times) * 1000))
            print("peak RSS of serve: %.0f MiB before the 60 MB uploads, %.0f MiB after"
                  % (rss_before, serve.peak_rss_mib()))
        finally:
            serve.stop()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("what", nargs="*", default=["ingest"], choices=["ingest"])
    parser.add_argument("--python", default=sys.executable)
    args = parser.parse_args(argv)
    if "ingest" in args.what:
        bench_ingest(args.python)
    return 0


if __name__ == "__main__":
    sys.exit(main())
