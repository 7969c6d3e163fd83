"""Benchmarks: figures to report, not to assert (the goals are in openspec/README.md,
"Figures to design for").

    python3 tests/bench.py [ingest] [--python PYTHON]

``ingest``: POST -> 200 latency over loopback for 1 KB, 2 MB and 60 MB HAE-shaped
bodies against a real ``serve`` subprocess, and the peak RSS (VmHWM) of that process
before and after the 60 MB uploads.  Then, each on a fresh ``serve`` and data directory:
4 clients (threads, one connection each, released together) upload a distinct 60 MB
body at once: each client's statuses, latencies and serve's VmHWM at each answer, how
many answers were 503 (bodies under validation share VALIDATION_CEILING_BYTES, so two
60 MB bodies are validated one after the other, and an upload that waits longer than
VALIDATION_WAIT_S gets 503; it is sent again after its Retry-After), the time until the
last one was accepted, and serve's VmHWM idle, once every client had its answer (the
folds of the first bodies may already be running then: the count still pending is
printed) and after the folds; for comparison, ONE 60 MB upload (VmHWM idle, at its 200
and after its fold, and the increase over idle in multiples of the body); and the same
body with one paired surrogate escape (``\\ud83d\\ude00`` in a metric name), whose
validation should stay as flat as the plain body's (it used to take a full parse, ~7.8x
the body).

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
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TOKEN = "bench-token-0123456789abcdef"
CLIENTS = 4
"""Clients uploading a 60 MB body each at once in the concurrent ``ingest`` row."""


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

    def attempt(self, body: bytes, headers: dict = None,
                conn: http.client.HTTPConnection = None) -> tuple:
        """One POST on ``conn`` (or a connection of its own): (status, seconds,
        Retry-After or None)."""
        conn = conn or http.client.HTTPConnection("127.0.0.1", self.port, timeout=600)
        try:
            started = time.perf_counter()
            conn.request("POST", "/api/ingest", body=body, headers=dict(
                headers or {}, Authorization="Bearer " + TOKEN))
            response = conn.getresponse()
            response.read()
            elapsed = time.perf_counter() - started
        finally:
            conn.close()
        retry_after = response.getheader("Retry-After")
        return response.status, elapsed, int(retry_after) if retry_after else None

    def post(self, body: bytes, headers: dict = None) -> float:
        status, elapsed, _ = self.attempt(body, headers)
        if status != 200:
            raise SystemExit("POST answered %d" % status)
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
    big = bodies["60 MB"]
    _bench_concurrent(python, [metrics_body(60 << 20, seed=11 + i) for i in range(CLIENTS)])
    print("one 60 MB upload, each on a fresh serve; RSS increase over idle in multiples of"
          " the body:")
    _bench_single(python, "plain", big)
    surrogate = big.replace(b'"name" : "step_count"',
                            b'"name" : "step_count \\ud83d\\ude00"', 1)  # one grinning face
    assert surrogate != big and b"\\ud83d" in surrogate
    _bench_single(python, "paired surrogate", surrogate)


def _pending(data_dir: Path) -> int:
    import sqlite3 as _sqlite3

    conn = _sqlite3.connect(str(data_dir / "healthlog.sqlite3"))
    try:
        return conn.execute(
            "SELECT count(*) FROM delivery WHERE parse_status = 'pending'").fetchone()[0]
    finally:
        conn.close()


def _bench_concurrent(python: str, bodies: list) -> None:
    """``len(bodies)`` clients, each on its own connection (opened beforehand), start
    their POST together; a 503 is sent again after its Retry-After."""
    sys.path.insert(0, str(ROOT))
    import healthlog  # for its constants only

    ceiling, wait_s = healthlog.VALIDATION_CEILING_BYTES, healthlog.VALIDATION_WAIT_S
    with tempfile.TemporaryDirectory() as tmp:
        data_dir = Path(tmp) / "data"
        serve = Serve(python, data_dir)
        try:
            idle = serve.peak_rss_mib()
            gate = threading.Barrier(len(bodies) + 1, timeout=60)
            results: list = [None] * len(bodies)

            def client(index: int) -> None:
                attempts, error = [], None
                try:
                    conn = http.client.HTTPConnection("127.0.0.1", serve.port, timeout=600)
                    conn.connect()
                    gate.wait()
                    for _ in range(3):
                        status, elapsed, retry_after = serve.attempt(bodies[index], conn=conn)
                        attempts.append((status, elapsed, retry_after, serve.peak_rss_mib(),
                                         time.perf_counter()))
                        if status != 503:
                            break
                        time.sleep(retry_after or 30)
                        conn = None  # the retry opens a connection of its own
                except Exception as exc:  # reported below, never lost in the thread
                    error = exc
                results[index] = (attempts, error)

            threads = [threading.Thread(target=client, args=(i,)) for i in range(len(bodies))]
            for thread in threads:
                thread.start()
            gate.wait()
            started = time.perf_counter()
            for thread in threads:
                thread.join()
            rss_answered, pending = serve.peak_rss_mib(), _pending(data_dir)
            print("%d clients x 60 MB at once, one connection each (validation ceiling %d MiB,"
                  " wait %.0f s; a 503 is sent again after Retry-After)" % (
                      len(bodies), ceiling >> 20, wait_s))
            print("%-7s %10s %-18s %-30s %s" % ("client", "bytes", "statuses", "latencies",
                                                 "VmHWM at each answer"))
            busy, last = 0, started
            for index, (attempts, error) in enumerate(results):
                busy += sum(1 for a in attempts if a[0] == 503)
                if attempts:
                    last = max(last, attempts[-1][4])
                print("%-7d %10d %-18s %-30s %s%s" % (
                    index + 1, len(bodies[index]), " ".join(str(a[0]) for a in attempts),
                    " ".join("%.2fs" % a[1] for a in attempts),
                    " ".join("%.0f MiB" % a[3] for a in attempts),
                    "  error: %r" % error if error else ""))
            accepted = sum(1 for attempts, _ in results if attempts and attempts[-1][0] == 200)
            print("503 answers: %d; %d of %d accepted, the last after %.2f s in all" % (
                busy, accepted, len(bodies), last - started))
            first = min((a for attempts, _ in results for a in attempts if a[0] == 200),
                        key=lambda a: a[4], default=(0, 0, 0, float("nan"), 0))
            _wait_parsed(data_dir)
            print("peak RSS of serve: %.0f MiB idle, %.0f MiB at the first 200 (no fold can"
                  " have started before it), %.0f MiB once every client had its answer"
                  " (%d deliveries not yet folded then), %.0f MiB after the folds" % (
                      idle, first[3], rss_answered, pending, serve.peak_rss_mib()))
        finally:
            serve.stop()


def _bench_single(python: str, label: str, body: bytes) -> None:
    """One upload of ``body`` on a fresh serve: VmHWM at its 200 (before the fold starts)
    and after its fold."""
    with tempfile.TemporaryDirectory() as tmp:
        data_dir = Path(tmp) / "data"
        serve = Serve(python, data_dir)
        try:
            idle = serve.peak_rss_mib()
            elapsed = serve.post(body)
            answered = serve.peak_rss_mib()
            _wait_parsed(data_dir)
            folded = serve.peak_rss_mib()
            mib = len(body) / (1 << 20)
            print("  %-17s %10d bytes: 200 in %.2f s; peak RSS %.0f MiB idle, %.0f MiB at the"
                  " 200 (+%.1fx), %.0f MiB after the fold (+%.1fx)" % (
                      label, len(body), elapsed, idle, answered, (answered - idle) / mib,
                      folded, (folded - idle) / mib))
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
    while _pending(data_dir):
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
