"""Benchmark of the read side: figures to report, not to assert.

    python3 tests/bench_read.py [--data DIR] [--days N] [--budget-s S] [--python PYTHON]

Builds (once; cached in ``--data``, default /tmp/healthlog-bench-read) a store of minute
data for ten metrics, one point per minute each: a year is 10 x 525,600 = 5.26 M points;
and each day a night's sleep summary (stages) and a workout (version 2, 120 route points).
Each day is one HAE-shaped delivery (compact JSON, ``date``/``qty``/``source``; heart rate
with ``Min``/``Avg``/``Max``), journaled with ``healthlog.accept_delivery`` into the
data directory's archive and folded with ``healthlog.FoldEngine``: the real ingest and fold
code path, without HTTP in between. When folding at the rate of the first days would take
longer than ``--budget-s`` (default 300 s), fewer days are built and the year's figures are
extrapolated linearly (the table says so).

Then a real ``healthlog.py serve`` subprocess is started on that directory and measured
with http.client:

* ``/api/points`` for the last 30 days bucketed by hour, and the whole span by day
  (median of 3, JSON);
* the raw CSV and raw JSON of the whole span for one metric: points/s and bytes, read in
  64 KiB pieces as a client would;
* the server's VmRSS (/proc/PID/status) sampled every 50 ms while each answer streams:
  a streamed answer keeps it flat, whatever the span.

A re-run with the same ``--data`` skips the build. The machine is shared and noisy: compare
figures within one run.
"""

from __future__ import annotations

import argparse
import datetime as dt
import hashlib
import http.client
import json
import os
import random
import statistics
import subprocess
import sys
import threading
import time
import urllib.parse
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import healthlog  # noqa: E402  (after the path: the working tree's healthlog)
import hae_factory as hf  # noqa: E402  (tests/: HAE's own shapes of a night and a workout)

TOKEN = "bench-token-0123456789abcdef"
START = dt.datetime(2025, 1, 1, tzinfo=dt.timezone.utc)
MINUTES = 1440
#: (name, units, kind): ten metrics a watch records per minute.
METRICS = (("step_count", "count", "sum"), ("active_energy", "kcal", "sum"),
           ("basal_energy_burned", "kcal", "sum"), ("walking_running_distance", "km", "sum"),
           ("heart_rate", "count/min", "hr"), ("respiratory_rate", "count/min", "level"),
           ("blood_oxygen_saturation", "%", "level"), ("flights_climbed", "count", "sum"),
           ("apple_exercise_time", "min", "sum"), ("apple_stand_time", "min", "sum"))
#: Besides the minute series, every day holds a night's sleep summary and a workout.
EXTRA = ("sleep_analysis", "workouts")
MARKER = "bench-read.json"
HEADERS = {"automation-name": "Bench read", "automation-id": "BENCH-READ-0001",
           "automation-aggregation": "Minutes", "automation-period": "Since Last Sync"}


# ---------------------------------------------------------------------------------------------
# Building the store.

def day_body(day: int, rng: random.Random) -> bytes:
    """One day (UTC) of every metric at every minute, as HAE would send it (compact)."""
    base = START + dt.timedelta(days=day)
    stamps = [(base + dt.timedelta(minutes=m)).strftime("%Y-%m-%d %H:%M:%S +0000")
              for m in range(MINUTES)]
    metrics = []
    for name, units, kind in METRICS:
        points = []
        for stamp in stamps:
            if kind == "hr":
                low = rng.randint(52, 90)
                point = {"date": stamp, "Min": low, "Avg": low + rng.random() * 12,
                         "Max": low + rng.randint(12, 30)}
            elif kind == "level":
                point = {"date": stamp, "qty": 10 + rng.random() * 90}
            else:
                point = {"date": stamp, "qty": rng.random() * 40}
            point["source"] = "Apple Watch"
            points.append(point)
        metrics.append({"name": name, "units": units, "data": points})
    # The night that ends this day (a sleep summary with stages) and an evening run.
    date = base.date()
    metrics.append({"name": "sleep_analysis", "units": "hr",
                    "data": hf.sleep_summaries(day, date, date + dt.timedelta(days=1))})
    workout = hf.workout_v2(day, dt.datetime.combine(date, dt.time(17, 30)), route_points=120)
    return json.dumps({"data": {"metrics": metrics, "workouts": [workout]}},
                      separators=(",", ":")).encode()


def build(data_dir: Path, days: int, budget_s: float) -> dict:
    """Journal and fold up to ``days`` days; fewer when the fold rate says the budget would
    not hold. Returns what was built, also written to DATA/bench-read.json."""
    config = healthlog.Config(data_dir=data_dir, log_level="WARN")
    healthlog.ensure_data_dir(data_dir)
    lock = healthlog.DataDirLock(data_dir)
    lock.acquire("serve")  # nothing else may write here while we fold
    conn = healthlog.open_database(config, synchronous="NORMAL")
    archive = healthlog.Archive(data_dir)
    engine = healthlog.FoldEngine(conn, config, verbose=False)
    rng = random.Random(7)
    started = time.perf_counter()
    fold_s = body_bytes = points = 0
    built = 0
    try:
        for day in range(days):
            body = day_body(day, rng)
            tmp = data_dir / healthlog.TMP_DIR / ("bench-%d.part" % day)
            tmp.write_bytes(body)
            upload = healthlog.Upload(tmp, len(body), hashlib.sha256(body).hexdigest())
            delivery_id = healthlog.accept_delivery(archive, conn, upload, healthlog.utc_now(),
                                                    HEADERS, None)
            t0 = time.perf_counter()
            outcome = engine.fold(delivery_id)
            fold_s += time.perf_counter() - t0
            if outcome.kind != "folded":
                raise SystemExit("day %d did not fold: %r" % (day, outcome))
            built, body_bytes, points = day + 1, body_bytes + len(body), points + MINUTES * 10
            elapsed = time.perf_counter() - started
            if built in (3, 7) or built % 30 == 0:
                print("  built %3d days, %9d points, %6.1f s (fold %.1f s, %.0f points/s)"
                      % (built, points, elapsed, fold_s, points / fold_s), flush=True)
            if built >= 3 and elapsed / built * days > budget_s and elapsed > budget_s:
                print("  stopping at %d days: %d days would take ~%.0f s (budget %.0f s)"
                      % (built, days, elapsed / built * days, budget_s), flush=True)
                break
    finally:
        conn.close()
        lock.release()
    info = {"days": built, "wanted_days": days, "points": points, "body_bytes": body_bytes,
            "build_s": round(time.perf_counter() - started, 1), "fold_s": round(fold_s, 1),
            "metrics": [m[0] for m in METRICS] + list(EXTRA), "start": START.isoformat()}
    (data_dir / MARKER).write_text(json.dumps(info, indent=1) + "\n")
    return info


def cached(data_dir: Path, days: int) -> dict:
    """The marker of a finished build of the same shape, else None."""
    try:
        info = json.loads((data_dir / MARKER).read_text())
    except (OSError, ValueError):
        return None
    if (info.get("wanted_days") != days
            or info.get("metrics") != [m[0] for m in METRICS] + list(EXTRA)):
        return None
    return info


# ---------------------------------------------------------------------------------------------
# Measuring a serve subprocess.

class Serve:
    def __init__(self, python: str, data_dir: Path):
        self.log = data_dir.parent / (data_dir.name + "-serve.log")
        self._log = open(str(self.log), "wb")
        self.proc = subprocess.Popen(
            [python, str(ROOT / "healthlog.py"), "serve", "--data", str(data_dir), "--listen",
             "127.0.0.1:0", "--token", TOKEN, "--log-level", "WARN"],
            stdout=subprocess.DEVNULL, stderr=self._log)
        self.port = self._port(data_dir)

    def _port(self, data_dir: Path) -> int:
        # WARN hides the "serving" record; ask the kernel which port the process listens on.
        deadline = time.monotonic() + 30
        inodes = set()
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise SystemExit("serve exited: " + self.log.read_text())
            fd_dir = Path("/proc/%d/fd" % self.proc.pid)
            for fd in fd_dir.iterdir():
                try:
                    target = os.readlink(str(fd))
                except OSError:
                    continue
                if target.startswith("socket:["):
                    inodes.add(target[8:-1])
            for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
                fields = line.split()
                if fields[3] == "0A" and fields[9] in inodes:  # LISTEN
                    return int(fields[1].rsplit(":", 1)[1], 16)
            time.sleep(0.1)
        raise SystemExit("serve did not listen: " + self.log.read_text())

    def rss_mib(self) -> float:
        for line in Path("/proc/%d/status" % self.proc.pid).read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
        return float("nan")

    def get(self, path: str, **query) -> tuple:
        """(status, seconds, bytes, rss samples in MiB) of one streamed GET."""
        pairs = [(k.rstrip("_"), v) for k, v in query.items()]
        target = path + "?" + urllib.parse.urlencode(pairs)
        samples, done = [self.rss_mib()], threading.Event()

        def sample() -> None:
            while not done.wait(0.05):
                samples.append(self.rss_mib())

        sampler = threading.Thread(target=sample)
        sampler.start()
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=3600)
        try:
            started = time.perf_counter()
            conn.request("GET", target, headers={"Authorization": "Bearer " + TOKEN})
            response = conn.getresponse()
            size = 0
            while True:
                chunk = response.read(65536)
                if not chunk:
                    break
                size += len(chunk)
            elapsed = time.perf_counter() - started
        finally:
            conn.close()
            done.set()
            sampler.join()
        samples.append(self.rss_mib())
        if response.status != 200:
            raise SystemExit("GET %s answered %d" % (target, response.status))
        return elapsed, size, samples

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(60)
        self._log.close()


def iso(moment: dt.datetime) -> str:
    return moment.strftime("%Y-%m-%dT%H:%M:%SZ")


def measure(serve: Serve, info: dict) -> list:
    days = info["days"]
    end = START + dt.timedelta(days=days)
    last30 = max(0, days - 30)
    month_from = START + dt.timedelta(days=last30)
    span_days = days - last30
    rows = []
    cases = [
        ("hour buckets, last %d days" % span_days, "heart_rate", span_days,
         dict(bucket="hour", from_=iso(month_from), to=iso(end)), 3),
        ("hour buckets, last %d days" % span_days, "step_count", span_days,
         dict(bucket="hour", from_=str(int(month_from.timestamp() * 1000)),
              to=str(int(end.timestamp() * 1000))), 3),
        ("day buckets, %d days" % days, "heart_rate", days, dict(bucket="day"), 3),
        ("day buckets, %d days, tz -07:00" % days, "step_count", days,
         dict(bucket="day", tz="-07:00"), 3),
        ("raw CSV, %d days" % days, "heart_rate", days, dict(format="csv"), 2),
        ("raw CSV, %d days" % days, "step_count", days, dict(format="csv"), 1),
        ("raw JSON, %d days" % days, "heart_rate", days, dict(), 1),
    ]
    for label, metric, span, query, runs in cases:
        results = [serve.get("/api/points", metric=metric, **query) for _ in range(runs)]
        seconds = statistics.median(r[0] for r in results)
        size = results[0][1]
        samples = [s for r in results for s in r[2]]
        points = span * MINUTES
        rows.append((label, metric, seconds, size, points, results[0][2][0], max(samples),
                     samples[-1]))
    # The summary page's one request (READ-15): a day's cards, the 30-day usual, 14-day
    # sparklines and the 455-day trends of every metric (goal: at most 200 ms here).
    last_day = (end - dt.timedelta(days=1)).date().isoformat()
    results = [serve.get("/api/summary", date=last_day) for _ in range(3)]
    samples = [s for r in results for s in r[2]]
    rows.append(("summary of the last day", "all", statistics.median(r[0] for r in results),
                 results[0][1], 0, results[0][2][0], max(samples), samples[-1]))
    return rows


def report(rows: list, info: dict, python: str) -> None:
    scale = 365 / info["days"]
    print()
    print("read: serve subprocess, %s, store of %d days x %d minute metrics = %d points, a night"
          " and a workout a day "
          "(built in %.0f s, fold %.0f s = %.0f points/s)"
          % (subprocess.check_output([python, "-c", "import sys; print(sys.version.split()[0])"],
                                     text=True).strip(), info["days"], len(METRICS),
             info["points"], info["build_s"], info["fold_s"], info["points"] / info["fold_s"]))
    print("%-34s %-11s %8s %11s %10s %12s %9s %9s %9s" % (
        "query", "metric", "seconds", "bytes", "points", "points/s", "RSS0 MiB", "max MiB",
        "growth"))
    for label, metric, seconds, size, points, rss0, rss_max, _ in rows:
        print("%-34s %-11s %8.3f %11d %10d %12.0f %9.1f %9.1f %+9.1f" % (
            label, metric, seconds, size, points, points / seconds, rss0, rss_max,
            rss_max - rss0))
    if info["days"] < 365:
        print()
        print("extrapolated to 365 days (x%.2f, linear in points; the store above holds %d of"
              " the %d days asked for):" % (scale, info["days"], info["wanted_days"]))
        for label, metric, seconds, size, _, _, _, _ in rows:
            if "last" in label:
                continue
            print("  %-32s %-11s ~%7.1f s  ~%6.0f MB" % (
                label.replace("%d days" % info["days"], "365 days"), metric, seconds * scale,
                size * scale / 1e6))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--data", type=Path, default=Path("/tmp/healthlog-bench-read"),
                        help="data directory to build (or reuse when already built)")
    parser.add_argument("--days", type=int, default=365, help="days of minute data to build")
    parser.add_argument("--budget-s", type=float, default=300.0,
                        help="stop building earlier when the whole would take longer")
    parser.add_argument("--python", default=sys.executable, help="interpreter for serve")
    args = parser.parse_args(argv)
    data_dir = args.data.resolve()
    info = cached(data_dir, args.days)
    if info is None:
        if data_dir.exists() and any(data_dir.iterdir()):
            raise SystemExit("%s holds something else; remove it or pass another --data"
                             % data_dir)
        print("building %s: %d days x %d metrics, one point per minute"
              % (data_dir, args.days, len(METRICS)), flush=True)
        info = build(data_dir, args.days, args.budget_s)
    else:
        print("reusing %s (%d days, built in %.0f s)" % (data_dir, info["days"],
                                                           info["build_s"]), flush=True)
    serve = Serve(args.python, data_dir)
    try:
        rows = measure(serve, info)
    finally:
        serve.stop()
    report(rows, info, args.python)
    return 0


if __name__ == "__main__":
    sys.exit(main())
