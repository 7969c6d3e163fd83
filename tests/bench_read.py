"""Benchmark of the read side: figures to report, not to assert.

    python3 tests/bench_read.py [--data DIR] [--days N] [--budget-s S] [--python PYTHON]
                                [--root DIR] [--runs N]

Builds (once; cached in ``--data``, default /tmp/healthlog-bench-read) a store of a
person's minute data, HAE-shaped, as a phone that lives in Europe/Berlin and travels sends
it: every three days one delivery (``Since Last Sync``, Minutes) of seven minute metrics
(heart rate with ``Min``/``Avg``/``Max`` every minute; active and resting energy every minute;
steps and walking distance in most waking minutes; exercise and stand minutes), the day's
resting heart rate, heart rate variability, walking heart rate, stand hours and now and then
a weight, the night's sleep (one nightly record) and an evening workout (version 2, 60 route
points).  Every timestamp is written in the phone's local time with its offset, as HAE
writes it: two DST changes a year, and every year two weeks in America/New_York, a week in
Asia/Kolkata (+05:30) and three days in Asia/Kathmandu (+05:45), each journey starting in the
middle of a day.  About 2.1 M points a year; ``--days`` (default 1,096: three years) sets the
history.  Each delivery is journaled with ``healthlog.accept_delivery`` into the data
directory's archive and folded with ``healthlog.FoldEngine``: the real ingest and fold code,
without HTTP in between.  When folding at the rate so far would take longer than
``--budget-s`` (default 900 s), fewer days are built (the report says so).

Then a real ``healthlog.py serve`` subprocess (of ``--root``, default this checkout) is
started on that directory and measured with http.client, each figure the median of
``--runs`` (default 5), in pairs side by side:

* the page's own requests: ``/api/plan`` (``tz=local``, as the page asks) and then
  ``/api/points`` with the layer, bucket and dates the plan says, beside the same
  ``/api/points`` with epoch bounds (the UTC instants of the same local midnights, still
  ``tz=local``): steps over a year (per week), heart rate over 30 days (per day) and over
  7 days;
* 30 days of heart rate per hour, the dates of the phone (``tz=local``), an IANA zone and
  an offset beside epoch bounds;
* what Grafana asks (epoch milliseconds, ``tz=local``, per hour, 7 days);
* the raw CSV of a year of heart rate, dates beside epoch bounds, and of steps, and the raw
  JSON of the year of heart rate, in points/s;
* ``healthlog export --bucket day`` of a year of steps, dates beside epoch bounds (a
  subprocess beside ``serve``: export only reads);
* ``/api/summary`` of a day one month into the history, one year, two years and at its end:
  what a long history costs the summary.

Beside each time, the CPU the server spent on the request (/proc/PID/stat; the rest of the
time is the client reading, the loopback and other processes), and the server's VmRSS
(/proc/PID/status), sampled every 50 ms while each answer streams: a streamed answer keeps
it flat, whatever the span.  A re-run with the same ``--data`` skips
the build.  The machine is shared and noisy: compare figures within one run, and the ratios
of a pair above all.
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
START = dt.datetime(2023, 1, 1, tzinfo=dt.timezone.utc)
DELIVERY_DAYS = 3
SHAPE = 2  # the store's shape; a cached store of another shape is built again
MARKER = "bench-read.json"
HEADERS = {"automation-name": "Bench read", "automation-id": "BENCH-READ-0002",
           "automation-aggregation": "Minutes", "automation-period": "Since Last Sync"}
HOME = hf.BERLIN
KATHMANDU = hf.Zone("Asia/Kathmandu", 345)
#: (first day of the year's journey, days, zone): each journey starts at 10:00 UTC.
JOURNEYS = ((95, 14, hf.NEW_YORK), (200, 7, hf.KOLKATA), (290, 3, KATHMANDU))
MINUTE_METRICS = ("heart_rate", "active_energy", "basal_energy_burned", "step_count",
                  "walking_running_distance", "apple_exercise_time", "apple_stand_time")
UNITS = {"heart_rate": "count/min", "active_energy": "kcal", "basal_energy_burned": "kcal",
         "step_count": "count", "walking_running_distance": "km", "apple_exercise_time": "min",
         "apple_stand_time": "min", "resting_heart_rate": "count/min",
         "heart_rate_variability": "ms", "walking_heart_rate_average": "count/min",
         "apple_stand_hour": "count", "weight_body_mass": "kg"}
SOURCE = hf.OWNER_WATCH


# ---------------------------------------------------------------------------------------------
# Building the store.

def zone_at(t: float) -> hf.Zone:
    """The zone the phone is in at epoch second ``t``."""
    day = int((t - START.timestamp()) // 86400)
    year_day = day % 365
    for first, days, zone in JOURNEYS:
        begin = (day - year_day + first) * 86400 + START.timestamp() + 36000
        if begin <= t < begin + days * 86400:
            return zone
    return HOME


def stamp(t: float) -> str:
    """HAE's ``yyyy-MM-dd HH:mm:ss Z`` of ``t`` where the phone is then."""
    return hf.hae_time(t, zone_at(t))


def body_of(first_day: int, rng: random.Random) -> bytes:
    """One delivery: ``DELIVERY_DAYS`` UTC days from ``first_day`` (days after START)."""
    t0 = START.timestamp() + first_day * 86400
    points = {name: [] for name in UNITS}
    sleep, workouts = [], []
    for minute in range(DELIVERY_DAYS * 1440):
        t = t0 + minute * 60
        text = stamp(t)
        local_hour = int(text[11:13])
        awake = 7 <= local_hour < 23
        low = rng.randint(52, 90) + (25 if awake else 0)
        points["heart_rate"].append({"date": text, "Min": low, "Avg": low + rng.random() * 12,
                                     "Max": low + rng.randint(12, 30), "source": SOURCE})
        points["active_energy"].append({"date": text, "qty": rng.random() * (4 if awake else 0.3),
                                        "source": SOURCE})
        points["basal_energy_burned"].append({"date": text, "qty": 1.1 + rng.random() * 0.2,
                                              "source": SOURCE})
        if awake and rng.random() < 0.55:
            steps = rng.randint(5, 120)
            points["step_count"].append({"date": text, "qty": steps, "source": SOURCE})
            points["walking_running_distance"].append(
                {"date": text, "qty": steps * 0.00075, "source": SOURCE})
        if text[11:16] >= "17:30" and text[11:16] < "18:00":
            points["apple_exercise_time"].append({"date": text, "qty": 1, "source": SOURCE})
        if awake and rng.random() < 0.1:
            points["apple_stand_time"].append({"date": text, "qty": 1, "source": SOURCE})
        if text[14:16] == "00" and awake and rng.random() < 0.75:
            points["apple_stand_hour"].append({"date": text, "qty": 1, "source": SOURCE})
        if text[11:16] == "07:00":
            points["resting_heart_rate"].append({"date": text, "qty": rng.randint(50, 62),
                                                 "source": SOURCE})
            points["walking_heart_rate_average"].append(
                {"date": text, "qty": 90 + rng.random() * 15, "source": SOURCE})
            if rng.random() < 0.35:
                points["weight_body_mass"].append({"date": text, "qty": 74 + rng.random(),
                                                   "source": SOURCE})
        if text[13:16] == ":30" and local_hour % 4 == 1:
            points["heart_rate_variability"].append({"date": text, "qty": 30 + rng.random() * 30,
                                                     "source": SOURCE})
    for day in range(DELIVERY_DAYS):
        noon = t0 + day * 86400 + 12 * 3600
        phone = hf.Phone(zone=zone_at(noon), sources="single")
        date = dt.datetime.fromtimestamp(noon, dt.timezone.utc).date()
        sleep += hf.sleep_nights(first_day + day, date, phone=phone, rng=rng)
        evening = dt.datetime.fromtimestamp(t0 + day * 86400 + 16 * 3600, dt.timezone.utc)
        workouts.append(hf.workout_v2(first_day + day, evening, phone=phone, route_points=60,
                                      rng=rng))
    metrics = [{"name": name, "units": UNITS[name], "data": data}
               for name, data in points.items()]
    metrics.append({"name": "sleep_analysis", "units": "hr", "data": sleep})
    return json.dumps({"data": {"metrics": metrics, "workouts": workouts}},
                      separators=(",", ":")).encode()


def build(data_dir: Path, days: int, budget_s: float) -> dict:
    """Journal and fold up to ``days`` days, a delivery every ``DELIVERY_DAYS``; fewer when
    the fold rate says the budget would not hold.  Returns what was built, also written to
    DATA/bench-read.json."""
    config = healthlog.Config(data_dir=data_dir, log_level="WARN")
    healthlog.ensure_data_dir(data_dir)
    lock = healthlog.DataDirLock(data_dir)
    lock.acquire("serve")  # nothing else may write here while we fold
    conn = healthlog.open_database(config, synchronous="NORMAL")
    archive = healthlog.Archive(data_dir)
    engine = healthlog.FoldEngine(conn, config, verbose=False)
    rng = random.Random(7)
    started = time.perf_counter()
    fold_s = body_bytes = 0
    built = 0
    try:
        for first in range(0, days, DELIVERY_DAYS):
            body = body_of(first, rng)
            tmp = data_dir / healthlog.TMP_DIR / ("bench-%d.part" % first)
            tmp.write_bytes(body)
            upload = healthlog.Upload(tmp, len(body), hashlib.sha256(body).hexdigest())
            received = START + dt.timedelta(days=first + DELIVERY_DAYS, hours=1)
            delivery_id = healthlog.accept_delivery(archive, conn, upload, received,
                                                    HEADERS, None)
            t0 = time.perf_counter()
            outcome = engine.fold(delivery_id)
            fold_s += time.perf_counter() - t0
            if outcome.kind != "folded":
                raise SystemExit("days from %d did not fold: %r" % (first, outcome))
            built, body_bytes = first + DELIVERY_DAYS, body_bytes + len(body)
            elapsed = time.perf_counter() - started
            if built % 90 == 0:
                print("  built %4d days, %6.0f s (fold %.0f s)" % (built, elapsed, fold_s),
                      flush=True)
            if built < days and elapsed / built * days > budget_s and elapsed > budget_s / 4:
                print("  stopping at %d days: %d days would take ~%.0f s (budget %.0f s)"
                      % (built, days, elapsed / built * days, budget_s), flush=True)
                break
        points = conn.execute("SELECT sum(points) FROM object").fetchone()[0]
    finally:
        conn.close()
        lock.release()
    info = {"shape": SHAPE, "days": built, "wanted_days": days, "points": points,
            "body_bytes": body_bytes, "build_s": round(time.perf_counter() - started, 1),
            "fold_s": round(fold_s, 1), "start": START.isoformat()}
    (data_dir / MARKER).write_text(json.dumps(info, indent=1) + "\n")
    return info


def cached(data_dir: Path, days: int) -> dict:
    """The marker of a finished build of the same shape, else None."""
    try:
        info = json.loads((data_dir / MARKER).read_text())
    except (OSError, ValueError):
        return None
    if info.get("wanted_days") != days or info.get("shape") != SHAPE:
        return None
    return info


# ---------------------------------------------------------------------------------------------
# Measuring a serve subprocess.

class Serve:
    def __init__(self, python: str, root: Path, data_dir: Path):
        self.log = data_dir.parent / (data_dir.name + "-serve.log")
        self._log = open(str(self.log), "wb")
        self.proc = subprocess.Popen(
            [python, str(root / "healthlog.py"), "serve", "--data", str(data_dir), "--listen",
             "127.0.0.1:0", "--token", TOKEN, "--log-level", "WARN"],
            stdout=subprocess.DEVNULL, stderr=self._log)
        self.port = self._port()

    def _port(self) -> int:
        # WARN hides the "serving" record; ask the kernel which port the process listens on.
        deadline = time.monotonic() + 60
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

    def cpu_s(self) -> float:
        """CPU seconds (user and system) the server has spent so far."""
        fields = Path("/proc/%d/stat" % self.proc.pid).read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def get(self, path: str, **query) -> tuple:
        """(seconds, body, rss samples in MiB, server CPU seconds) of one streamed GET."""
        pairs = [(k.rstrip("_"), v) for k, v in query.items() if v is not None]
        target = path + "?" + urllib.parse.urlencode(pairs)
        samples, done = [self.rss_mib()], threading.Event()

        def sample() -> None:
            while not done.wait(0.05):
                samples.append(self.rss_mib())

        sampler = threading.Thread(target=sample)
        sampler.start()
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=3600)
        cpu = self.cpu_s()
        try:
            started = time.perf_counter()
            conn.request("GET", target, headers={"Authorization": "Bearer " + TOKEN})
            response = conn.getresponse()
            pieces = []
            while True:
                chunk = response.read(65536)
                if not chunk:
                    break
                pieces.append(chunk)
            elapsed = time.perf_counter() - started
        finally:
            conn.close()
            done.set()
            sampler.join()
        samples.append(self.rss_mib())
        cpu = self.cpu_s() - cpu
        if response.status != 200:
            raise SystemExit("GET %s answered %d: %s" % (target, response.status,
                                                         b"".join(pieces)[:300]))
        return elapsed, b"".join(pieces), samples, cpu

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(60)
        self._log.close()


def epoch_ms(day: dt.date, zone: hf.Zone) -> str:
    """Epoch milliseconds of local midnight of ``day`` in ``zone``."""
    return str(int(hf.local_midnight(zone, day)) * 1000)


class Figure:
    """One measured request: the median of its runs, its size, its points, memory."""

    def __init__(self, label: str, runs: list, points: int = 0):
        self.label = label
        self.seconds = statistics.median(r[0] for r in runs)
        self.size = len(runs[0][1])
        self.points = points
        samples = [s for r in runs for s in r[2]]
        self.growth = max(samples) - runs[0][2][0]
        self.cpu = statistics.median(r[3] for r in runs)  # the server's (nan: a command)


def timed(function, runs: int) -> list:
    return [function() for _ in range(runs)]


def timed_pair(first, second, runs: int) -> tuple:
    """Both requests of a pair, taking turns (one, the other, the other, one, …), so that
    the first run of a large read (the store's pages coming into the page cache: kernel
    time the server is charged for) falls to neither side alone."""
    ones, others = [], []
    for turn in range(runs):
        order = ((first, ones), (second, others))
        for function, out in (order if turn % 2 == 0 else order[::-1]):
            out.append(function())
    return ones, others


def page_view(serve: Serve, metric: str, view: str, runs: int) -> tuple:
    """The page's two requests for a view (the plan, then the points it names), its points
    alone, and the same buckets with epoch bounds (the UTC instants of the same midnights
    in the phone's home zone; 24 hours: the plan's own instants in milliseconds): figures
    (page, None, points, epoch points)."""
    plan_runs = timed(lambda: serve.get("/api/plan", metric=metric, range=view, tz="local"),
                      runs)
    plan = json.loads(plan_runs[0][1])
    dated = timed(lambda: serve.get("/api/points", **plan["points"]), runs)  # as asked
    if len(plan["from"]) == 10:
        first, last = (dt.date.fromisoformat(plan[k]) for k in ("from", "to"))
        bounds = epoch_ms(first, HOME), epoch_ms(last + dt.timedelta(days=1), HOME)
    else:
        bounds = tuple(str(int(dt.datetime.fromisoformat(plan[k].replace("Z", "+00:00"))
                               .timestamp() * 1000)) for k in ("from", "to"))
    epoch = timed(lambda: serve.get("/api/points", metric=metric, bucket=plan["bucket"],
                                    from_=bounds[0], to=bounds[1], tz="local"), runs)
    both = [(p[0] + d[0], d[1], p[2] + d[2], p[3] + d[3]) for p, d in zip(plan_runs, dated)]
    label = "%s %s (%s by %s, %s to %s)" % (metric, view, plan["layer"], plan["bucket"],
                                             plan["from"], plan["to"])
    return (Figure("the page's %s: plan + points" % label, both), None,
            Figure("  its points, dates (tz=local)", dated),
            Figure("same, epoch bounds", epoch))


def export_seconds(python: str, root: Path, data_dir: Path, runs: int, **query) -> list:
    """(seconds, output, [nan]) of ``healthlog export`` runs (a subprocess; its start
    counts)."""
    args = [python, str(root / "healthlog.py"), "export", "--data", str(data_dir)]
    for key, value in query.items():
        args += ["--" + key.rstrip("_").replace("_", "-"), value]
    out = []
    for _ in range(runs):
        started = time.perf_counter()
        done = subprocess.run(args, capture_output=True, check=True)
        out.append((time.perf_counter() - started, done.stdout, [float("nan")], float("nan")))
    return out


def measure(serve: Serve, info: dict, args: argparse.Namespace) -> list:
    """Pairs of figures: (date-bounded or the first, epoch-bounded or None)."""
    runs = args.runs
    end_day = (START + dt.timedelta(days=info["days"] - 1)).date()
    pairs = []
    for metric, view in (("step_count", "1y"), ("heart_rate", "30d"), ("heart_rate", "7d"),
                         ("heart_rate", "24h")):
        page, nothing, dated, epoch = page_view(serve, metric, view, runs)
        pairs += [(page, nothing), (dated, epoch)]
    month = [end_day - dt.timedelta(days=29), end_day]
    for tz in ("local", "Europe/Berlin", "+01:00"):
        dated = timed(lambda tz=tz: serve.get(
            "/api/points", metric="heart_rate", bucket="hour", from_=month[0].isoformat(),
            to=month[1].isoformat(), tz=tz), runs)
        pairs.append((Figure("heart_rate 30 days by hour, dates, tz=%s" % tz, dated), None))
    epoch = timed(lambda: serve.get(
        "/api/points", metric="heart_rate", bucket="hour", from_=epoch_ms(month[0], HOME),
        to=epoch_ms(month[1] + dt.timedelta(days=1), HOME), tz="local"), runs)
    pairs[-3] = (pairs[-3][0], Figure("same, epoch bounds", epoch))
    grafana_end = int(hf.local_midnight(HOME, end_day)) * 1000 + 15 * 3600 * 1000
    grafana = timed(lambda: serve.get(
        "/api/points", metric="step_count", bucket="hour", from_=str(grafana_end - 7 * 86400000),
        to=str(grafana_end), tz="local"), runs)
    pairs.append((Figure("Grafana: step_count 7 days by hour, epoch ms, tz=local", grafana),
                  None))
    year = [end_day - dt.timedelta(days=364), end_day]
    csv_runs = max(3, runs // 2)
    dated, epoch = timed_pair(
        lambda: serve.get("/api/points", metric="heart_rate", format="csv",
                          from_=year[0].isoformat(), to=year[1].isoformat(), tz="local"),
        lambda: serve.get("/api/points", metric="heart_rate", format="csv",
                          from_=epoch_ms(year[0], HOME),
                          to=epoch_ms(year[1] + dt.timedelta(days=1), HOME), tz="local"),
        csv_runs)
    rows = dated[0][1].count(b"\n") - 1
    pairs.append((Figure("raw CSV, heart_rate, a year, dates", dated, rows),
                  Figure("same, epoch bounds", epoch, epoch[0][1].count(b"\n") - 1)))
    steps = timed(lambda: serve.get("/api/points", metric="step_count", format="csv",
                                    from_=year[0].isoformat(), to=year[1].isoformat(),
                                    tz="local"), csv_runs)
    pairs.append((Figure("raw CSV, step_count, a year, dates", steps,
                         steps[0][1].count(b"\n") - 1), None))
    raw = timed(lambda: serve.get("/api/points", metric="heart_rate", from_=year[0].isoformat(),
                                  to=year[1].isoformat(), tz="local"), csv_runs)
    pairs.append((Figure("raw JSON, heart_rate, a year, dates", raw,
                         raw[0][1].count(b'"date"')), None))
    dated = export_seconds(args.python, args.root, args.data, max(1, runs // 2),
                           metric="step_count", bucket="day", from_=year[0].isoformat(),
                           to=year[1].isoformat())
    epoch = export_seconds(args.python, args.root, args.data, max(1, runs // 2),
                           metric="step_count", bucket="day", from_=epoch_ms(year[0], HOME),
                           to=epoch_ms(year[1] + dt.timedelta(days=1), HOME))
    pairs.append((Figure("export --bucket day, step_count, a year, dates", dated),
                  Figure("same, epoch bounds", epoch)))
    for label, day in (("a month in", 30), ("a year in", 365), ("two years in", 730),
                       ("the last day", info["days"] - 1)):
        if day >= info["days"]:
            continue
        date = (START + dt.timedelta(days=day)).date().isoformat()
        summary = timed(lambda date=date: serve.get("/api/summary", date=date, tz="local"),
                        runs)
        pairs.append((Figure("/api/summary %s (%s)" % (label, date), summary), None))
    newest = timed(lambda: serve.get("/api/summary", tz="local"), runs)
    pairs.append((Figure("/api/summary without a date (the newest day)", newest), None))
    return pairs


def python_version(python: str) -> str:
    return subprocess.check_output([python, "-c", "import sys; print(sys.version.split()[0])"],
                                   text=True).strip()


def report(pairs: list, info: dict, args: argparse.Namespace) -> None:
    print()
    print("read: serve subprocess of %s, Python %s; store of %d days, %d points (built in %.0f"
          " s, fold %.0f s = %.0f points/s); medians of %d"
          % (args.root, python_version(args.python), info["days"], info["points"],
             info["build_s"], info["fold_s"], info["points"] / max(info["fold_s"], 1e-9),
             args.runs))
    print("%-72s %9s %8s %10s %11s %8s | %9s %7s" % (
        "request", "ms", "CPU ms", "bytes", "points/s", "RSS +MiB", "epoch ms", "ratio"))
    for first, epoch in pairs:
        rate = "%11.0f" % (first.points / first.seconds) if first.points else " " * 11
        line = "%-72s %9.1f %8.1f %10d %s %+8.1f" % (
            first.label[:72], first.seconds * 1000, first.cpu * 1000, first.size, rate,
            first.growth)
        if epoch is not None:
            line += " | %9.1f %6.2fx" % (epoch.seconds * 1000, first.seconds / epoch.seconds)
            if epoch.points:
                line += "  (epoch: %.0f points/s)" % (epoch.points / epoch.seconds)
        print(line)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--data", type=Path, default=Path("/tmp/healthlog-bench-read"),
                        help="data directory to build (or reuse when already built)")
    parser.add_argument("--days", type=int, default=1096, help="days of history to build")
    parser.add_argument("--budget-s", type=float, default=900.0,
                        help="stop building earlier when the whole would take longer")
    parser.add_argument("--python", default=sys.executable, help="interpreter for serve")
    parser.add_argument("--root", type=Path, default=ROOT,
                        help="the checkout whose healthlog.py serves (before/after)")
    parser.add_argument("--runs", type=int, default=5, help="timings per figure")
    args = parser.parse_args(argv)
    args.data, args.root = args.data.resolve(), args.root.resolve()
    info = cached(args.data, args.days)
    if info is None:
        if args.data.exists() and any(args.data.iterdir()):
            raise SystemExit("%s holds something else; remove it or pass another --data"
                             % args.data)
        print("building %s: %d days, a delivery every %d days" % (args.data, args.days,
                                                                  DELIVERY_DAYS), flush=True)
        info = build(args.data, args.days, args.budget_s)
    else:
        print("reusing %s (%d days, built in %.0f s)" % (args.data, info["days"],
                                                           info["build_s"]), flush=True)
    serve = Serve(args.python, args.root, args.data)
    try:
        pairs = measure(serve, info, args)
    finally:
        serve.stop()
    report(pairs, info, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
