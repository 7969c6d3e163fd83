"""Benchmark of one long workout: figures to report, not to assert.

    python3 tests/bench_workout.py [--points N] [--python PYTHON]

Builds a version 2 walk of two days and more (``--points``, default 193,000 route points, one
a second, heart rate every 5 s; tests/workout_corpus.py's ``long_walk_body``, ~43 MB of
compact JSON), posts it to a real ``healthlog.py serve`` subprocess in a fresh data
directory and waits for the fold. Then, with http.client, in 64 KiB reads as a client would:

* ``GET /api/workouts/<id>`` (the page's answer, its route thinned on the server),
* ``GET /api/workouts/<id>.gpx`` (the whole route, streamed): time to the first bytes and
  to the last,
* ``GET /api/workouts`` of its days,

each with the server's VmRSS (/proc/PID/status) sampled every 50 ms: before, and the
highest while it answers. The machine is shared and noisy: compare figures within one run.
"""

from __future__ import annotations

import argparse
import http.client
import json
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

import workout_corpus as wc  # noqa: E402  (after the path: tests/)

TOKEN = "bench-token-0123456789abcdef"


class Server:
    def __init__(self, python: str, data: Path):
        self.log = data.parent / "serve.log"
        self.proc = subprocess.Popen(
            [python, "-m", "healthlog", "serve", "--data", str(data), "--listen",
             "127.0.0.1:0", "--token", TOKEN, "--log-format", "json"], cwd=str(ROOT),
            stdout=subprocess.DEVNULL, stderr=open(str(self.log), "wb"))
        deadline = time.monotonic() + 60
        self.port = None
        while self.port is None and time.monotonic() < deadline:
            for line in self.log.read_text().splitlines():
                record = json.loads(line)
                if record.get("msg") == "serving":
                    self.port = int(record["listen"].rsplit(":", 1)[1])
            time.sleep(0.05)

    def rss_mib(self) -> float:
        for line in Path("/proc/%d/status" % self.proc.pid).read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
        return float("nan")

    def request(self, method: str, path: str, body: bytes = None) -> tuple:
        """(status, seconds to the first bytes, seconds in all, bytes, RSS before, RSS
        highest) of one request, read in 64 KiB pieces."""
        samples, done = [self.rss_mib()], threading.Event()

        def sample() -> None:
            while not done.wait(0.05):
                samples.append(self.rss_mib())

        sampler = threading.Thread(target=sample)
        sampler.start()
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=3600)
        try:
            started = time.perf_counter()
            headers = {"Authorization": "Bearer " + TOKEN}
            if body is not None:
                headers["Content-Type"] = "application/json"
            conn.request(method, path, body=body, headers=headers)
            response = conn.getresponse()
            first, size, data = None, 0, b""
            while True:
                piece = response.read(64 << 10)
                if first is None:
                    first = time.perf_counter() - started
                if not piece:
                    break
                size += len(piece)
                if size <= 1 << 20:
                    data += piece
            return (response.status, first, time.perf_counter() - started, size,
                    samples[0], max(samples), data)
        finally:
            conn.close()
            done.set()
            sampler.join()

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(60)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--points", type=int, default=wc.LONG_POINTS)
    parser.add_argument("--python", default=sys.executable)
    args = parser.parse_args()
    made = time.perf_counter()
    body, uid, points, _ = wc.long_walk_body(args.points)
    print("body: %d route points, %.1f MB, built in %.1f s" % (
        points, len(body) / 1e6, time.perf_counter() - made))
    with tempfile.TemporaryDirectory(prefix="healthlog-bench-workout-") as base:
        server = Server(args.python, Path(base) / "data")
        try:
            posted = time.perf_counter()
            status = server.request("POST", "/api/ingest", body)[0]
            assert status == 200, status
            while True:
                rows = json.loads(server.request("GET", "/api/deliveries?limit=1")[6])
                if rows["deliveries"][0]["status"] != "pending":
                    break
                time.sleep(0.2)
            print("fold: %s in %.1f s from the post" % (rows["deliveries"][0]["status"],
                                                        time.perf_counter() - posted))
            idle = server.rss_mib()
            print("serve idle after the fold: %.0f MiB" % idle)
            for label, path in (("workout", "/api/workouts/" + uid),
                                ("gpx", "/api/workouts/%s.gpx" % uid),
                                ("list", "/api/workouts?from=2025-07-01&to=2025-07-10")):
                status, first, total, size, before, peak, data = server.request("GET", path)
                extra = ""
                if label == "workout":
                    answer = json.loads(data)
                    extra = ", %d of %d route points drawn" % (
                        len(answer["route"]["drawn"]), answer["route"]["points"])
                print("%-8s %d: first bytes %.2f s, all %.2f s, %.1f MB; RSS %.0f -> %.0f MiB"
                      " (+%.0f)%s" % (label, status, first, total, size / 1e6, before, peak,
                                      peak - before, extra))
        finally:
            server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
