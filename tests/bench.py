"""Benchmarks: figures to report, not to assert (the goals are in openspec/README.md,
"Figures to design for").

    python3 tests/bench.py [ingest] [--python PYTHON]

``ingest``: POST -> 200 latency over loopback for 1 KB, 2 MB and 60 MB HAE-shaped
bodies against a real ``serve`` subprocess, and the peak RSS (VmHWM) of that process
before and after the 60 MB uploads.

``fold``: fold throughput (points/s) and the ratio fold time / ``json.loads`` time for a
fresh ~16.8k-point delivery (2.8 MB), for the same points re-sent re-serialised (keys
shuffled, last-digit jitter), for 20,000 points on 20,000 distinct minutes beside 20,000
points crowded on 60 minutes (one, two and three key sets: the cost of a fold must stay
close to linear in the points whatever their coordinates), and for a fresh 62 MB
delivery; bytes per stored point; POST -> parsed for the 2.8 MB body; and the peak RSS of
a ``serve`` subprocess during the 62 MB fold.  ``--json std`` hides orjson to measure the
standard-library path.  The machine is shared and noisy: compare figures within one run,
and read medians.
"""

from __future__ import annotations

import argparse
import http.client
import json
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

    def post(self, body: bytes, headers: dict = None) -> float:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=600)
        started = time.perf_counter()
        conn.request("POST", "/api/ingest", body=body, headers=dict(
            headers or {}, Authorization="Bearer " + TOKEN))
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
    """Each POST starts when the previous delivery has been folded (as a phone sends
    one at a time), so the figure is the answer time, not contention with a fold."""
    sizes = [("1 KB", 1000, 50), ("2 MB", 2 << 20, 10), ("60 MB", 60 << 20, 3)]
    bodies = {label: metrics_body(size) for label, size, _ in sizes}
    with tempfile.TemporaryDirectory() as tmp:
        data_dir = Path(tmp) / "data"
        serve = Serve(python, data_dir)
        try:
            print("ingest: POST -> 200 over loopback, %s" % subprocess.check_output(
                [python, "-c", "import sys; print(sys.version.split()[0])"], text=True).strip())
            print("%-6s %12s %10s %10s %10s" % ("body", "bytes", "median", "min", "max"))
            for label, _, runs in sizes:
                times = []
                for _ in range(runs):
                    _wait_parsed(data_dir)
                    if label == "60 MB" and not times:
                        rss_before = serve.peak_rss_mib()
                    times.append(serve.post(bodies[label]))
                    if label == "60 MB" and len(times) == 1:
                        rss_upload = serve.peak_rss_mib()  # read at the 200, before the fold
                print("%-6s %12d %9.1fms %9.1fms %9.1fms" % (
                    label, len(bodies[label]), statistics.median(times) * 1000,
                    min(times) * 1000, max(times) * 1000))
            _wait_parsed(data_dir)
            print("peak RSS of serve: %.0f MiB before the 60 MB uploads, %.0f MiB at the first"
                  " one's 200, %.0f MiB after their folds" % (
                      rss_before, rss_upload, serve.peak_rss_mib()))
        finally:
            serve.stop()


def _fold_once(healthlog, config, body: bytes, headers: dict) -> tuple:
    """Journal ``body`` through a paused in-process service, then time one real fold."""
    sys.path.insert(0, str(ROOT / "tests"))
    from conftest import GatedWorker  # the real worker, held until a gate opens

    service = healthlog.Service(config, announce=lambda token: None)
    service.worker = GatedWorker(config)
    service.start()
    try:
        conn = http.client.HTTPConnection(*service.address, timeout=600)
        all_headers = dict(headers, Authorization="Bearer " + TOKEN)
        conn.request("POST", "/api/ingest", body=body, headers=all_headers)
        response = conn.getresponse()
        delivery_id = json.loads(response.read())["delivery_id"]
        conn.close()
    finally:
        service.stop()
    db = healthlog.connect(config.db_path, synchronous="NORMAL")
    try:
        engine = healthlog.FoldEngine(db, config)
        started = time.perf_counter()
        outcome = engine.fold(delivery_id)
        elapsed = time.perf_counter() - started
        row = db.execute("SELECT points, objects_written, overwrites FROM delivery WHERE id = ?",
                         (delivery_id,)).fetchone()
    finally:
        db.close()
    assert outcome.kind == "folded", outcome
    return elapsed, row


def crowded_body(points: int, coordinates: int, key_sets: int = 1) -> bytes:
    """``points`` step-count points on only ``coordinates`` minutes, every one a different
    value; with ``key_sets`` > 1 they also differ in which keys carry content, so the
    reduction has to ask dominance between groups (the suite issue's quadratic case)."""
    extra = ["", ',"Min":%d', ',"Min":%d,"Max":%d']
    rows = []
    for i in range(points):
        tail = extra[i % key_sets]
        day, minute = divmod(i % coordinates, 1440)
        point = ('{"date":"2026-05-%02d %02d:%02d:00 -0700","qty":%d.25,"source":"iPhone"'
                 % (1 + day, minute // 60, minute % 60, i))
        rows.append(point + tail % ((i,) * tail.count("%d")) + "}")
    return ('{"data":{"metrics":[{"name":"step_count","units":"count","data":[%s]}]}}'
            % ",".join(rows)).encode()


def bench_fold(python: str, std_json: bool) -> None:
    if std_json:
        sys.modules["orjson"] = None  # type: ignore[assignment]
    sys.path.insert(0, str(ROOT))
    sys.path.insert(0, str(ROOT / "tests"))
    import healthlog
    import hae_factory

    headers = hae_factory.headers_for(hae_factory.Automation("Bench", aggregation="Minutes"))
    small = hae_factory.big_metrics_body(2_800_000, seed=7)
    resent = hae_factory.resend(small, random.Random(8))
    big = hae_factory.big_metrics_body(62_000_000, seed=9)
    print("fold: %s, json: %s" % (sys.version.split()[0],
                                 "stdlib" if healthlog._orjson is None else "orjson"))
    print("%-22s %10s %9s %12s %10s %8s" % ("delivery", "points", "fold", "points/s",
                                             "loads", "ratio"))
    with tempfile.TemporaryDirectory() as tmp:
        config = healthlog.Config(data_dir=Path(tmp) / "data", host="127.0.0.1", port=0,
                                  token=TOKEN, log_level="ERROR")
        healthlog.setup_logging(config)
        for label, body in (("fresh 2.8 MB", small), ("re-sent 2.8 MB", resent),
                            ("20k distinct points", crowded_body(20_000, 20_000)),
                            ("20k on 60 coordinates", crowded_body(20_000, 60)),
                            ("  ... two key sets", crowded_body(20_000, 60, key_sets=2)),
                            ("  ... three key sets", crowded_body(20_000, 60, key_sets=3)),
                            ("fresh 62 MB", big)):
            if label != "re-sent 2.8 MB":  # a store of its own: nothing overlaps
                config = healthlog.Config(data_dir=Path(tmp) / ("data%d" % len(body)),
                                          host="127.0.0.1", port=0, token=TOKEN,
                                          log_level="ERROR")
            loads_started = time.perf_counter()
            healthlog.loads_body(body)
            loads = time.perf_counter() - loads_started
            elapsed, (points, written, overwrites) = _fold_once(healthlog, config, body, headers)
            print("%-22s %10d %8.2fs %12.0f %9.3fs %8.1f   objects_written=%d overwrites=%d"
                  % (label, points, elapsed, points / elapsed, loads, elapsed / loads,
                     written, overwrites))
        db = healthlog.connect(config.db_path, synchronous="NORMAL")
        stored_points, blob, provenance = db.execute(
            "SELECT sum(points), sum(length(blob)), sum(length(point_deliveries)) FROM object"
        ).fetchone()
        db.close()
        print("bytes per stored point: %.1f (blob %.1f + point_deliveries %.1f) over %d points"
              % ((blob + provenance) / stored_points, blob / stored_points,
                 provenance / stored_points, stored_points))
    with tempfile.TemporaryDirectory() as tmp:
        serve = Serve(python, Path(tmp) / "data")
        try:
            started = time.perf_counter()
            serve.post(small, headers)
            _wait_parsed(Path(tmp) / "data")
            print("POST -> parsed, 2.8 MB: %.0f ms" % ((time.perf_counter() - started) * 1000))
            before = serve.peak_rss_mib()
            serve.post(big, headers)
            _wait_parsed(Path(tmp) / "data")
            print("peak RSS of serve: %.0f MiB before the 62 MB delivery, %.0f MiB after its"
                  " upload and fold" % (before, serve.peak_rss_mib()))
        finally:
            serve.stop()


def _wait_parsed(data_dir: Path) -> None:
    import sqlite3 as _sqlite3

    while True:
        conn = _sqlite3.connect(str(data_dir / "healthlog.sqlite3"))
        pending = conn.execute(
            "SELECT count(*) FROM delivery WHERE parse_status = 'pending'").fetchone()[0]
        conn.close()
        if not pending:
            return
        time.sleep(0.01)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("what", nargs="*", default=["ingest", "fold"],
                        choices=["ingest", "fold"])
    parser.add_argument("--python", default=sys.executable)
    parser.add_argument("--json", choices=["auto", "std"], default="auto",
                        help="std: hide orjson (the fold section only)")
    args = parser.parse_args(argv)
    if "ingest" in args.what:
        bench_ingest(args.python)
    if "fold" in args.what:
        bench_fold(args.python, args.json == "std")
    return 0


if __name__ == "__main__":
    sys.exit(main())
