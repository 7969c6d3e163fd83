"""Benchmark of the sleep rule's reads: figures to report, not to assert.

    python3 tests/bench_sleep.py [--data DIR] [--program HEALTHLOG_PY] [--rounds N]

Builds (once; cached in ``--data``, default /tmp/healthlog-bench-sleep) a store of a year
of sleep in both forms HAE sends, each posted as one HAE-shaped body through a real
``serve``: a nightly record a night (HAE >= 6.6.2 with a Watch) and the same nights as stage
records (a segment per stage, an in-bed record), some 11,000 records. Then a ``serve`` of
``--program`` (default: this tree's healthlog.py; give another tree's to compare) answers,
each the median of ``--rounds`` (default 5) on a warm server:

* ``/api/points?metric=sleep_analysis&bucket=day`` over the year (JSON and CSV);
* the same per week, and ``/api/summary`` of the last day (its sleep card reads 31 days);
* ``/api/coverage`` of the year's last 28 days (its sleep row reads the nights).

The machine is shared and noisy: compare figures within one run.
"""

from __future__ import annotations

import argparse
import datetime as dt
import http.client
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

import hae_factory as hf  # noqa: E402  (tests/: HAE's own shapes of a night)

TOKEN = "bench-token-0123456789abcdef"
PHONE = hf.Phone(zone=hf.NEW_YORK, sources="single")
FIRST, END = dt.date(2025, 1, 1), dt.date(2026, 1, 1)


def serve(program: Path, data: Path, log: Path):
    proc = subprocess.Popen([sys.executable, str(program), "serve", "--data", str(data),
                             "--listen", "127.0.0.1:0", "--token", TOKEN],
                            stdout=subprocess.DEVNULL, stderr=open(str(log), "wb"))
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        for line in log.read_text(errors="replace").splitlines():
            if "msg=serving" in line and "listen=" in line:
                return proc, int(line.split("listen=")[1].split()[0].rsplit(":", 1)[1])
        time.sleep(0.1)
    proc.kill()
    raise SystemExit("serve did not start:\n" + log.read_text())


def call(port: int, method: str, path: str, body: bytes = None, headers: dict = None):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    try:
        sent = {"Authorization": "Bearer " + TOKEN}
        sent.update(headers or {})
        conn.request(method, path, body=body, headers=sent)
        reply = conn.getresponse()
        return reply.status, reply.read()
    finally:
        conn.close()


def build(data: Path, program: Path) -> None:
    if (data / "healthlog.sqlite3").exists():
        return
    data.mkdir(parents=True, exist_ok=True)
    proc, port = serve(program, data, data.parent / "bench-sleep-build.log")
    try:
        nightly = hf.sleep_summaries(34, FIRST, END, phone=PHONE, form="c", date_as="start")
        records = hf.sleep_segments(34, FIRST, END, phone=PHONE, variant="new")
        for rows, grouping in ((nightly, "Days"), (records, "Minutes")):
            body = hf.dumps_hae(hf.envelope(metrics=[hf.metric("sleep_analysis", rows, "hr")]))
            status, answer = call(port, "POST", "/api/ingest", body,
                                  {"automation-aggregation": grouping,
                                   "Content-Type": "application/json"})
            assert status == 200, answer
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            status, answer = call(port, "GET", "/healthz")
            if b'"backlog":0' in answer.replace(b" ", b""):
                break
            time.sleep(0.5)
        print("built: %d nightly records, %d stage records" % (len(nightly), len(records)))
    finally:
        proc.terminate()
        proc.wait(60)


def measure(port: int, path: str, rounds: int) -> tuple:
    times, size = [], 0
    call(port, "GET", path)  # warm
    for _ in range(rounds):
        started = time.perf_counter()
        status, body = call(port, "GET", path)
        times.append(time.perf_counter() - started)
        assert status == 200, body[:300]
        size = len(body)
    return statistics.median(times), size


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--data", type=Path, default=Path(tempfile.gettempdir())
                        / "healthlog-bench-sleep")
    parser.add_argument("--program", type=Path, default=ROOT / "healthlog.py")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    build(args.data / "data", ROOT / "healthlog.py")
    proc, port = serve(args.program, args.data / "data", args.data / "bench-sleep.log")
    try:
        year = "from=2025-01-01&to=2025-12-31"
        for name, path in (
                ("nights by day, JSON", "/api/points?metric=sleep_analysis&bucket=day&" + year),
                ("nights by day, CSV", "/api/points?metric=sleep_analysis&bucket=day&format=csv&"
                 + year),
                ("nights by week, JSON", "/api/points?metric=sleep_analysis&bucket=week&" + year),
                ("summary of 2025-12-31", "/api/summary?date=2025-12-31"),
                ("coverage, 28 days", "/api/coverage?from=2025-12-04&to=2025-12-31")):
            seconds, size = measure(port, path, args.rounds)
            print("%-24s %8.1f ms  %9d bytes" % (name, seconds * 1000, size))
    finally:
        proc.terminate()
        proc.wait(60)


if __name__ == "__main__":
    main()
