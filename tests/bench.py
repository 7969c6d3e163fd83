"""Benchmarks: figures to report, not to assert (the goals are in openspec/README.md,
"Figures to design for", and issue 11's speed goals in ``GOALS`` below).

    python3 tests/bench.py [goals] [ingest] [fold] [--python PYTHON] [--root DIR]
                           [--skip-year] [--json std]

``goals`` (the default): every row of issue 11's speed-goal table, measured within one
run, first on every core and then again pinned to CPU 0 (``taskset -c 0``, a stand-in
for a Raspberry Pi), then the table: figure | goal | 2 cores | 1 core | met (on every
core).  The figures: POST -> parsed for a 2.8 MB minute delivery, each sample on a fresh
``serve`` and data directory (the same bytes sent again would be folded as a duplicate),
over the standard ``json.loads`` of that body; the fold of that delivery fresh and of its
re-serialised re-send (into the store that holds it), over ``json.loads`` with the same
JSON library and over each other, with orjson and with orjson hidden (a PYTHONPATH module
that refuses to import, as tests/conftest.py's json_mode does); the peak RSS of ``serve``
for a 62 MB delivery, upload and fold; ``healthlog reindex`` of bench_reindex.py's year of
hourly minute pushes, with and without orjson, in points/s, and whether its fingerprint is
still the one the code had before the speed work (``YEAR_FINGERPRINT``: a SAME or
DIFFERENT line); 20,000 points crowded on 60 coordinates (one, two and three key sets)
over 20,000 distinct points.  Medians of 7 (the crowded folds: of 3).  The measurements
run in a child (bench.py with a hidden ``--internal measure``), once as is and once under
``taskset -c 0``, which pins the child and everything it starts; the fold figures come
from grandchildren (``--internal folds``), one per JSON library.  Generating the year
takes about a minute and the whole run 3-4 minutes on 2 cores; ``--skip-year`` leaves
the reindex rows out.

``--root DIR`` benches DIR/healthlog.py, in process and as subprocesses, with this
checkout's tests/ helpers (any section): run the same bench against the code before a
change for a before/after table.

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
import hashlib
import http.client
import json
import os
import random
import re
import shutil
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parent.parent
TOKEN = "bench-token-0123456789abcdef"
CLIENTS = 4
"""Clients uploading a 60 MB body each at once in the concurrent ``ingest`` row."""
SAMPLES = 7
"""Timings per figure of ``goals``; the figure is their median (the machine is shared)."""
CROWDED_SAMPLES = 3
"""Timings per crowded fold of ``goals``."""
POLL_S = 0.003
"""How often ``goals`` looks whether a delivery is folded: small beside a 2.8 MB fold."""
CROWDED = (("20k distinct points", 20_000, 1), ("20k on 60 coordinates", 60, 1),
           ("  ... two key sets", 60, 2), ("  ... three key sets", 60, 3))
"""(label, coordinates, key sets) of the ``crowded_body`` folds of 20,000 points."""
YEAR_DAYS, YEAR_PUSHES_PER_DAY = 365, 24
YEAR_FINGERPRINT = "c4f4a6f3e66ca782fe0b59c2aceece3470e406c7589247e2490a02ea2651caff"
"""The fingerprint of bench_reindex.py's year (YEAR_DAYS days, YEAR_PUSHES_PER_DAY pushes a
day) after ``reindex`` with the code before the speed work of issue 11 (commit 78453c9):
the speed work must not change a stored object, with orjson or without."""
RESULTS = "bench-results: "
"""Starts the one line in which an ``--internal`` part hands its figures to its parent."""
GOALS = (
    ("POST -> parsed 2.8 MB / stdlib json.loads", "<= 4x", "post_parsed", True, 4, "{:.1f}x"),
    ("re-send fold / fresh fold, orjson", "<= 0.5x", "orjson_resend_fresh", True, 0.5,
     "{:.2f}x"),
    ("re-send fold / fresh fold, stdlib", "<= 0.5x", "stdlib_resend_fresh", True, 0.5,
     "{:.2f}x"),
    ("fold / loads, fresh, orjson", "<= 5x", "orjson_fresh_loads", True, 5, "{:.1f}x"),
    ("fold / loads, re-send, orjson", "<= 3x", "orjson_resend_loads", True, 3, "{:.1f}x"),
    ("fold / loads, fresh, stdlib", "<= 5x", "stdlib_fresh_loads", True, 5, "{:.1f}x"),
    ("fold / loads, re-send, stdlib", "<= 3x", "stdlib_resend_loads", True, 3, "{:.1f}x"),
    ("peak RSS of serve, 62 MB upload + fold", "<= 300 MiB", "rss_mib", True, 300,
     "{:.0f} MiB"),
    ("reindex of a year, orjson", ">= 250,000 points/s", "orjson_reindex", False, 250_000,
     "{:,.0f}/s"),
    ("reindex of a year, stdlib", ">= 250,000 points/s", "stdlib_reindex", False, 250_000,
     "{:,.0f}/s"),
    ("fold 20k on 60 coordinates / 20k distinct", "<= 3x", "crowded_1", True, 3, "{:.2f}x"),
    ("  ... two key sets", "<= 3x", "crowded_2", True, 3, "{:.2f}x"),
    ("  ... three key sets", "<= 3x", "crowded_3", True, 3, "{:.2f}x"),
)
"""Issue 11's speed goals: (figure, goal, key in the figures, at most (else at least),
limit, format of a figure)."""


class Target:
    """The healthlog under bench: this checkout's, or another's (``--root``) for a
    before/after table; the factory and the conftest helpers always come from this
    checkout's tests/."""

    def __init__(self, python: str, root: Path):
        self.python, self.root = python, root

    def command(self, *args: str) -> list:
        """``healthlog.py *args`` as a subprocess."""
        return [self.python, str(self.root / "healthlog.py")] + list(args)

    def internal(self, part: str, *args: str) -> list:
        """bench.py's hidden ``part`` as a subprocess, for the same healthlog."""
        return [self.python, "-u", str(Path(__file__).resolve()), "--internal", part,
                "--python", self.python, "--root", str(self.root)] + list(args)

    def module(self):
        """healthlog imported in this process from ``root`` (and tests/ importable)."""
        if "healthlog" not in sys.modules:
            sys.path[:0] = [str(self.root), str(ROOT), str(ROOT / "tests")]
        import healthlog

        if Path(healthlog.__file__).resolve() != (self.root / "healthlog.py").resolve():
            raise SystemExit("healthlog comes from %s, not from %s" % (healthlog.__file__,
                                                                      self.root))
        return healthlog


def hidden_orjson_env(directory: Path) -> dict:
    """The environment for a subprocess, and all it starts, that cannot import orjson: a
    PYTHONPATH module of that name that raises ImportError (tests/conftest.py's
    json_mode)."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "orjson.py").write_text('raise ImportError("orjson is hidden by the bench")\n')
    return dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(directory)] + [p for p in [os.environ.get("PYTHONPATH")] if p]))


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
    def __init__(self, target: Target, data_dir: Path):
        self.log = data_dir.parent / "serve.log"
        self.proc = subprocess.Popen(
            target.command("serve", "--data", str(data_dir), "--listen", "127.0.0.1:0",
                           "--token", TOKEN),
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


def bench_guesses(target: Target, seconds: float = 30.0) -> None:
    """Wrong tokens sent as fast as one client can, from one address, for ``seconds``, while
    the phone asks with the right token from the same address twice a second: how the wrong
    ones were answered (401 after their delay, 429 once the address is locked out), how the
    right ones were (every one 200: RELY-7.8), and the log lines the storm made."""
    import threading

    with tempfile.TemporaryDirectory() as tmp:
        serve = Serve(target, Path(tmp) / "data")
        statuses: dict = {}
        right: dict = {}
        started = time.monotonic()
        done = threading.Event()

        def phone() -> None:
            while not done.wait(0.5):
                conn = http.client.HTTPConnection("127.0.0.1", serve.port, timeout=60)
                try:
                    conn.request("GET", "/api/catalog",
                                 headers={"Authorization": "Bearer " + TOKEN})
                    response = conn.getresponse()
                    response.read()
                    right[response.status] = right.get(response.status, 0) + 1
                finally:
                    conn.close()

        helper = threading.Thread(target=phone)
        helper.start()
        conn = http.client.HTTPConnection("127.0.0.1", serve.port, timeout=60)
        try:
            while time.monotonic() - started < seconds:
                conn.request("GET", "/api/catalog",
                             headers={"Authorization": "Bearer wrong-" + TOKEN})
                response = conn.getresponse()
                response.read()
                statuses[response.status] = statuses.get(response.status, 0) + 1
                if response.getheader("Connection", "").lower() == "close":
                    conn.close()
                    conn = http.client.HTTPConnection("127.0.0.1", serve.port, timeout=60)
        finally:
            done.set()
            helper.join()
            conn.close()
            elapsed = time.monotonic() - started
            serve.stop()
        lines = [line for line in serve.log.read_text(errors="replace").splitlines()
                 if " level=DEBUG " not in line]
    print("wrong tokens from one address for %.0f s: %d answered 401 after their delay, %d"
          " answered 429 at once (%.0f a second), other %s; %d log lines above DEBUG; the"
          " right token from the same address meanwhile: %s"
          % (elapsed, statuses.get(401, 0), statuses.get(429, 0),
             statuses.get(429, 0) / elapsed,
             {k: v for k, v in statuses.items() if k not in (401, 429)} or "none",
             len(lines), right))


def bench_ingest(target: Target) -> None:
    """Each POST starts when the previous delivery has been folded (as a phone sends
    one at a time), so the figure is the answer time, not contention with a fold."""
    sizes = [("1 KB", 1000, 50), ("2 MB", 2 << 20, 10), ("60 MB", 60 << 20, 3)]
    bodies = {label: metrics_body(size) for label, size, _ in sizes}
    with tempfile.TemporaryDirectory() as tmp:
        data_dir = Path(tmp) / "data"
        serve = Serve(target, data_dir)
        try:
            print("ingest: POST -> 200 over loopback, %s" % subprocess.check_output(
                [target.python, "-c", "import sys; print(sys.version.split()[0])"],
                text=True).strip())
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
    _bench_concurrent(target, [metrics_body(60 << 20, seed=11 + i) for i in range(CLIENTS)])
    print("one 60 MB upload, each on a fresh serve; RSS increase over idle in multiples of"
          " the body:")
    _bench_single(target, "plain", big)
    surrogate = big.replace(b'"name" : "step_count"',
                            b'"name" : "step_count \\ud83d\\ude00"', 1)  # one grinning face
    assert surrogate != big and b"\\ud83d" in surrogate
    _bench_single(target, "paired surrogate", surrogate)


def _journal(data_dir: Path) -> sqlite3.Connection:
    """A connection to the journal of ``serve``'s data directory, reading in autocommit
    (each query sees the last commit)."""
    return sqlite3.connect(str(data_dir / "healthlog.sqlite3"), isolation_level=None)


def _pending(journal: sqlite3.Connection) -> int:
    return journal.execute(
        "SELECT count(*) FROM delivery WHERE parse_status = 'pending'").fetchone()[0]


def _bench_concurrent(target: Target, bodies: list) -> None:
    """``len(bodies)`` clients, each on its own connection (opened beforehand), start
    their POST together; a 503 is sent again after its Retry-After."""
    healthlog = target.module()  # for its constants only
    ceiling, wait_s = healthlog.VALIDATION_CEILING_BYTES, healthlog.VALIDATION_WAIT_S
    with tempfile.TemporaryDirectory() as tmp:
        data_dir = Path(tmp) / "data"
        serve = Serve(target, data_dir)
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
            journal = _journal(data_dir)
            rss_answered, pending = serve.peak_rss_mib(), _pending(journal)
            journal.close()
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


def _bench_single(target: Target, label: str, body: bytes) -> None:
    """One upload of ``body`` on a fresh serve: VmHWM at its 200 (before the fold starts)
    and after its fold."""
    with tempfile.TemporaryDirectory() as tmp:
        data_dir = Path(tmp) / "data"
        serve = Serve(target, data_dir)
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


def _bench_config(healthlog, data_dir: Path):
    """An in-process service's configuration for ``_fold_once``, quiet but for errors."""
    return healthlog.Config(data_dir=data_dir, host="127.0.0.1", port=0, token=TOKEN,
                            log_level="ERROR")


def bench_fold(target: Target, std_json: bool) -> None:
    if std_json:
        sys.modules["orjson"] = None  # type: ignore[assignment]
    healthlog = target.module()
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
        config = _bench_config(healthlog, Path(tmp) / "data")
        healthlog.setup_logging(config)
        crowded = [(label, crowded_body(20_000, coordinates, key_sets))
                   for label, coordinates, key_sets in CROWDED]
        for label, body in ([("fresh 2.8 MB", small), ("re-sent 2.8 MB", resent)] + crowded
                            + [("fresh 62 MB", big)]):
            if label != "re-sent 2.8 MB":  # a store of its own: nothing overlaps
                config = _bench_config(healthlog, Path(tmp) / ("data%d" % len(body)))
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
        serve = Serve(target, Path(tmp) / "data")
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


def _wait_parsed(data_dir: Path, poll_s: float = 0.01) -> None:
    """Until every delivery is folded, looking every ``poll_s`` on one connection."""
    journal = _journal(data_dir)
    try:
        while _pending(journal):
            time.sleep(poll_s)
    finally:
        journal.close()


def _median_time(function, *args) -> float:
    """The median of SAMPLES timings of ``function(*args)``, in seconds."""
    times = []
    for _ in range(SAMPLES):
        started = time.perf_counter()
        function(*args)
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def _json_name(healthlog) -> str:
    return "stdlib" if healthlog._orjson is None else "orjson " + healthlog._orjson.__version__


def _goal_bodies(hae_factory) -> tuple:
    """(headers, the 2.8 MB minute delivery) of the ``goals`` figures."""
    return (hae_factory.headers_for(hae_factory.Automation("Bench", aggregation="Minutes")),
            hae_factory.big_metrics_body(2_800_000, seed=7))


def fold_figures(target: Target, crowded: bool) -> dict:
    """``--internal folds``: the fold timings of ``goals`` with the JSON library this
    process can import (run once as it is, once with orjson hidden), for ``measure``.

    Each sample is a fresh store: the fresh delivery, then its re-send into the store that
    holds it.  ``loads`` is the same library's: healthlog.loads_body with orjson, else
    ``json.loads``."""
    healthlog = target.module()
    import hae_factory

    headers, small = _goal_bodies(hae_factory)
    resent = hae_factory.resend(small, random.Random(8))
    loads = json.loads if healthlog._orjson is None else healthlog.loads_body
    figures = {"json": _json_name(healthlog), "loads_fresh_s": _median_time(loads, small),
               "loads_resend_s": _median_time(loads, resent), "fresh_s": [], "resend_s": [],
               "crowded": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for sample in range(SAMPLES):
            config = _bench_config(healthlog, Path(tmp) / ("data%d" % sample))
            if not sample:
                healthlog.setup_logging(config)
            elapsed, (figures["points"], _, _) = _fold_once(healthlog, config, small, headers)
            figures["fresh_s"].append(elapsed)
            figures["resend_s"].append(_fold_once(healthlog, config, resent, headers)[0])
        for label, coordinates, key_sets in CROWDED if crowded else ():
            body = crowded_body(20_000, coordinates, key_sets)
            figures["crowded"][label] = []
            for sample in range(CROWDED_SAMPLES):
                config = _bench_config(healthlog, Path(tmp) / ("crowded%d-%d-%d" % (
                    coordinates, key_sets, sample)))
                figures["crowded"][label].append(_fold_once(healthlog, config, body, headers)[0])
    return figures


def _post_to_parsed(target: Target, body: bytes, headers: dict) -> float:
    """Seconds from the start of a POST of ``body`` until its delivery is folded, on a
    fresh ``serve`` and data directory."""
    with tempfile.TemporaryDirectory() as tmp:
        serve = Serve(target, Path(tmp) / "data")
        try:
            started = time.perf_counter()
            serve.post(body, headers)
            _wait_parsed(Path(tmp) / "data", POLL_S)
            return time.perf_counter() - started
        finally:
            serve.stop()


def _peak_rss(target: Target, body: bytes, headers: dict) -> tuple:
    """VmHWM of a fresh ``serve`` in MiB before a POST of ``body``, at its 200 (before the
    fold can be done) and once it is folded, and the seconds from POST to folded."""
    with tempfile.TemporaryDirectory() as tmp:
        serve = Serve(target, Path(tmp) / "data")
        try:
            idle = serve.peak_rss_mib()
            started = time.perf_counter()
            serve.post(body, headers)
            answered = serve.peak_rss_mib()
            _wait_parsed(Path(tmp) / "data", POLL_S)
            return idle, answered, serve.peak_rss_mib(), time.perf_counter() - started
        finally:
            serve.stop()


def _reindex(target: Target, year: Path, prefix: list) -> dict:
    """``healthlog reindex`` of the year as a subprocess (after ``prefix``, e.g. an
    ``env`` that hides orjson): wall, peak RSS and what it printed."""
    import bench_reindex  # after target.module(): it imports healthlog too

    wall, peak, out = bench_reindex.run_measured(
        prefix + target.command("reindex", "--data", str(year)))
    found = {key: re.search(r"^%s: (.*)$" % key, out, re.M)
             for key in ("deliveries", "points", "folded", "fingerprint")}
    if not all(found.values()):
        raise SystemExit("reindex printed no %s:\n%s" % (
            ", ".join(key for key, match in found.items() if not match), out))
    points = int(found["points"].group(1))
    return {"wall": wall, "peak": peak, "points": points, "points_s": points / wall,
            "deliveries": found["deliveries"].group(1), "folded": found["folded"].group(1),
            "fingerprint": found["fingerprint"].group(1)}


def measure(target: Target, year: Optional[Path]) -> dict:
    """``--internal measure``: every figure of the goal table once, on the cores this
    process may use, printing the details as it goes; returns the figures (by ``GOALS``
    key) and the fingerprint of each reindex of ``year`` (None: no reindex rows)."""
    healthlog = target.module()
    import hae_factory

    print("python %s, json: %s, nproc %s" % (
        sys.version.split()[0], _json_name(healthlog),
        subprocess.check_output(["nproc"], text=True).strip()))
    headers, small = _goal_bodies(hae_factory)
    figures, fingerprints = {}, {}

    parsed = [_post_to_parsed(target, small, headers) for _ in range(SAMPLES)]
    loads = _median_time(json.loads, small)
    figures["post_parsed"] = statistics.median(parsed) / loads
    print("POST -> parsed, 2.8 MB (%d bytes), each on a fresh serve: median %.0f ms (%s ms);"
          " stdlib json.loads of the body: median %.1f ms; ratio %.1fx" % (
              len(small), statistics.median(parsed) * 1000,
              " ".join("%.0f" % (t * 1000) for t in parsed), loads * 1000,
              figures["post_parsed"]))

    with tempfile.TemporaryDirectory() as tmp:
        hidden = hidden_orjson_env(Path(tmp) / "no-orjson")
        for mode, env, extra in (("orjson", None, ["--crowded"]), ("stdlib", hidden, [])):
            folds = run_part(target.internal("folds", *extra), env)
            fresh, again = (statistics.median(folds[k]) for k in ("fresh_s", "resend_s"))
            figures[mode + "_fresh_loads"] = fresh / folds["loads_fresh_s"]
            figures[mode + "_resend_loads"] = again / folds["loads_resend_s"]
            figures[mode + "_resend_fresh"] = again / fresh
            print("fold, %s, %d points, medians of %d: fresh %.3f s (%.3f-%.3f), re-send"
                  " %.3f s (%.3f-%.3f); loads %.4f s fresh, %.4f s re-sent; fresh/loads"
                  " %.1fx, re-send/loads %.1fx, re-send/fresh %.2fx" % (
                      folds["json"], folds["points"], SAMPLES, fresh, min(folds["fresh_s"]),
                      max(folds["fresh_s"]), again, min(folds["resend_s"]),
                      max(folds["resend_s"]), folds["loads_fresh_s"], folds["loads_resend_s"],
                      figures[mode + "_fresh_loads"], figures[mode + "_resend_loads"],
                      figures[mode + "_resend_fresh"]))
            if folds["crowded"]:
                print("crowded folds of 20,000 points, %s, medians of %d:" % (
                    folds["json"], CROWDED_SAMPLES))
                distinct = statistics.median(folds["crowded"][CROWDED[0][0]])
                for index, (label, _, _) in enumerate(CROWDED):
                    elapsed = statistics.median(folds["crowded"][label])
                    if index:
                        figures["crowded_%d" % index] = elapsed / distinct
                    print("  %-22s %.3f s  %.2fx the distinct points" % (
                        label, elapsed, elapsed / distinct))

        big = hae_factory.big_metrics_body(62_000_000, seed=9)
        idle, answered, folded, elapsed = _peak_rss(target, big, headers)
        figures["rss_mib"] = folded
        print("peak RSS of serve, 62 MB delivery (%d bytes): %.0f MiB before the POST, %.0f MiB"
              " at its 200, %.0f MiB once folded (POST -> parsed %.1f s)" % (
                  len(big), idle, answered, folded, elapsed))

        if year is not None:
            for mode, prefix in (("orjson", []),
                                 ("stdlib", ["env", "PYTHONPATH=" + hidden["PYTHONPATH"]])):
                run = _reindex(target, year, prefix)
                figures[mode + "_reindex"] = run["points_s"]
                fingerprints[mode] = run["fingerprint"]
                print("reindex of the year, %s: %s deliveries, %d points in %.1f s wall ="
                      " %.0f points/s, peak RSS %.0f MiB; healthlog: folded %s; fingerprint %s"
                      % (mode, run["deliveries"], run["points"], run["wall"], run["points_s"],
                         run["peak"], run["folded"], run["fingerprint"]))
    return {"figures": figures, "fingerprints": fingerprints if year is not None else None}


def run_part(command: list, env: Optional[dict] = None) -> dict:
    """An ``--internal`` part as a subprocess: its lines pass through, its figures come
    back."""
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, text=True, env=env)
    figures = None
    for line in proc.stdout:
        if line.startswith(RESULTS):
            figures = json.loads(line[len(RESULTS):])
        else:
            print(line, end="", flush=True)
    if proc.wait() or figures is None:
        raise SystemExit("%s failed (exit %d)" % (" ".join(command), proc.returncode))
    return figures


def _describe(path: Path) -> str:
    """Which code the figures are for: sha256 and git commit of ``path``."""
    digest = hashlib.sha256(path.read_bytes()).hexdigest()[:16]
    try:
        commit, changed = (subprocess.run(
            ["git", "-C", str(path.parent)] + args, capture_output=True, text=True,
            check=True).stdout.strip() for args in (["log", "-1", "--format=%h"],
                                                     ["status", "--porcelain", path.name]))
    except (OSError, subprocess.CalledProcessError):
        return "sha256 %s, not in git" % digest
    return "sha256 %s, git %s%s" % (digest, commit, " + uncommitted changes" if changed else "")


def bench_goals(target: Target, skip_year: bool) -> None:
    """Issue 11's goal table: the year generated once, then ``measure`` on every core and
    pinned to CPU 0, then the table and the fingerprint check."""
    started = time.monotonic()
    program = target.root / "healthlog.py"
    described = _describe(program)
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text()
                .splitlines() if line.startswith("model name")), "unknown CPU")
    print("goals (issue 11), %s; %s, nproc %s" % (
        time.strftime("%Y-%m-%d %H:%M:%S %z"), cpu,
        subprocess.check_output(["nproc"], text=True).strip()))
    print("healthlog under bench: %s (%s)" % (program, described))
    runs = {}
    with tempfile.TemporaryDirectory(prefix="bench-goals-") as tmp:
        command = target.internal("measure")
        if not skip_year:
            year = Path(tmp) / "year"
            target.module()
            import bench_reindex

            print("generating the year: %d days, %d pushes a day ..." % (
                YEAR_DAYS, YEAR_PUSHES_PER_DAY), flush=True)
            bench_reindex.write_store(year, YEAR_DAYS, YEAR_PUSHES_PER_DAY)
            command += ["--year", str(year)]
        print("\n== 2 cores ==", flush=True)
        runs["2 cores"] = run_part(command)
        if shutil.which("taskset"):
            print("\n== 1 core (taskset -c 0) ==", flush=True)
            runs["1 core"] = run_part(["taskset", "-c", "0"] + command)
        else:
            print("\ntaskset not found: the one-core column was not measured")
    print_goals(runs)
    if _describe(program) != described:
        print("WARNING: %s changed during the run (now %s): the columns may be for different"
              " code" % (program, _describe(program)))
    print("total wall time of the bench: %.0f s" % (time.monotonic() - started))


def print_goals(runs: dict) -> None:
    """The summary table (``met`` from the figures on every core), then the fingerprint
    of every reindex of the year against the one before the speed work."""
    columns = ("2 cores", "1 core")
    rows = [("figure", "goal") + columns + ("met (2 cores)",)]
    for figure, goal, key, at_most, limit, form in GOALS:
        values = [runs[column]["figures"].get(key) if column in runs else None
                  for column in columns]
        met = "-" if values[0] is None else "yes" if (
            values[0] <= limit if at_most else values[0] >= limit) else "no"
        rows.append((figure, goal) + tuple("-" if value is None else form.format(value)
                                           for value in values) + (met,))
    rows.append(("all of the above on one core (taskset -c 0)", "reported", "-",
                 "measured" if "1 core" in runs else "not measured", "-"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    print()
    for index, row in enumerate(rows):
        print("| " + " | ".join(cell.ljust(width) for cell, width in zip(row, widths)) + " |")
        if not index:
            print("|" + "|".join("-" * (width + 2) for width in widths) + "|")
    print("('-': not measured; the reindex rows need the year, left out by --skip-year)")
    print()
    print("=" * 78)
    fingerprints = {"%s, %s" % (column, mode): fingerprint
                    for column, run in runs.items() for mode, fingerprint in
                    (run["fingerprints"] or {}).items()}
    if not fingerprints:
        print("fingerprint of the year: not checked (--skip-year)")
    elif set(fingerprints.values()) == {YEAR_FINGERPRINT}:
        print("fingerprint of the year: SAME as before the speed work (%s; reindex on %s)" % (
            YEAR_FINGERPRINT, "; ".join(fingerprints)))
    else:
        print("fingerprint of the year: DIFFERENT: before the speed work %s, now" % (
            YEAR_FINGERPRINT))
        for run, fingerprint in fingerprints.items():
            print("  %-16s %s %s" % (run, fingerprint,
                                     "same" if fingerprint == YEAR_FINGERPRINT else "DIFFERENT"))
    print("=" * 78)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sections = ("goals", "ingest", "fold", "guesses")
    parser.add_argument("what", nargs="*", metavar="{%s}" % ",".join(sections),
                        help="default: goals")
    parser.add_argument("--python", default=sys.executable)
    parser.add_argument("--root", type=Path, default=ROOT,
                        help="bench DIR/healthlog.py (another checkout) with this checkout's"
                             " tests/ helpers")
    parser.add_argument("--skip-year", action="store_true",
                        help="goals: leave out the reindex rows (the year takes a minute or"
                             " two to generate)")
    parser.add_argument("--json", choices=["auto", "std"], default="auto",
                        help="std: hide orjson (the fold section only)")
    parser.add_argument("--internal", choices=["measure", "folds"], help=argparse.SUPPRESS)
    parser.add_argument("--year", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--crowded", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    what = args.what or ["goals"]  # not choices=: argparse checks an empty list against them
    if set(what) - set(sections):
        parser.error("unknown section: %s" % " ".join(sorted(set(what) - set(sections))))
    if not (args.root / "healthlog.py").is_file():
        parser.error("no healthlog.py in %s" % args.root)
    target = Target(args.python, args.root.resolve())
    if args.internal:
        figures = (measure(target, args.year) if args.internal == "measure"
                   else fold_figures(target, args.crowded))
        print(RESULTS + json.dumps(figures))
        return 0
    if "goals" in what:
        bench_goals(target, args.skip_year)
    if "ingest" in what:
        bench_ingest(target)
    if "fold" in what:
        bench_fold(target, args.json == "std")
    if "guesses" in what:
        bench_guesses(target)
    return 0


if __name__ == "__main__":
    sys.exit(main())
