"""Benchmark of ``healthlog reindex`` on a year of minute data: figures, not asserts.

    python3 tests/bench_reindex.py [--data DIR] [--days 365] [--pushes-per-day 24] [--verify]
                                   [--stdlib-json] [--jobs]

The traffic is what a phone with one fast Health Auto Export automation sends for a year:
Minutes grouping, "Since Last Sync", ``--pushes-per-day`` pushes a day at even intervals
(default 24: hourly), each carrying the minute buckets of ten metrics since the previous
push and re-sending the previous push's last bucket, still growing then (the factory's
``cutoff``). Bodies come from tests/hae_factory.py (iOS pretty JSON, mixed sources), the
phone is in US Pacific time, so the year crosses both DST changes. With the defaults that
is 8,760 deliveries, ~180 MB of JSON and ~1.1M points.

The store is written straight into the archive and the journal through healthlog.Archive
and healthlog.accept_delivery (no HTTP), with the push's instant as ``received_at``; every
delivery is left ``pending``. Then ``python3 healthlog.py reindex --data DIR`` runs as a
subprocess under ``/usr/bin/time -v`` (else ``resource.getrusage``), and the script prints
wall time, deliveries/s, MB/s of archive, points/s and the peak RSS of the reindex process.
An existing ``--data`` directory is reused as it is (delete it to regenerate). healthlog
uses orjson when the interpreter has it; ``--stdlib-json`` runs it with ``-S`` (no
site-packages) to measure the standard ``json`` path. ``--jobs`` runs ``reindex`` with one
job, two, every usable core and pinned to one core (``taskset -c 0``), sampling the memory
of the main process and of each worker every 100 ms.
"""

from __future__ import annotations

import argparse
import datetime as dt
import io
import os
import re
import resource
import shutil
import sqlite3
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

import hae_factory as hf  # noqa: E402
import healthlog  # noqa: E402

METRICS = ("step_count", "active_energy", "basal_energy_burned", "walking_running_distance",
           "heart_rate", "apple_exercise_time", "flights_climbed", "heart_rate_variability",
           "blood_oxygen_saturation", "respiratory_rate")
FIRST_DAY = dt.date(2024, 1, 1)
AUTOMATION = hf.Automation("Health fast", "Minutes", "Since Last Sync")


def pushes(days: int, per_day: int):
    """(received_at, body) of every push, in arrival order."""
    step = 86400 // per_day
    start = hf.local_midnight(hf.PACIFIC, FIRST_DAY)
    last = None
    for index in range(days * per_day):
        now = start + (index + 1) * step + 7  # a few seconds after the even time
        window_start = start if last is None else last - last % 60  # re-send the last bucket
        payload = hf.metrics_payload(index, METRICS, window_start, now, "Minutes", cutoff=now)
        last = now
        yield dt.datetime.fromtimestamp(now, dt.timezone.utc), hf.dumps_hae(payload)


def write_store(data_dir: Path, days: int, per_day: int) -> None:
    healthlog.ensure_data_dir(data_dir)
    config = healthlog.Config(data_dir=data_dir)
    conn = healthlog.open_database(config, synchronous="NORMAL")
    archive = healthlog.Archive(data_dir)
    headers = {k: v for k, v in hf.headers_for(AUTOMATION, "BENCH").items()
               if k in healthlog.AUTOMATION_HEADERS}
    started, size, count = time.monotonic(), 0, 0
    try:
        for received_at, body in pushes(days, per_day):
            upload = archive.receive(io.BytesIO(body).read, len(body), len(body),
                                     lambda: None)
            healthlog.accept_delivery(archive, conn, upload, received_at, headers, None)
            size += len(body)
            count += 1
            if count % 500 == 0:
                print("  written %d deliveries, %.0f MB, %.0f s" % (
                    count, size / 1e6, time.monotonic() - started), file=sys.stderr)
    finally:
        conn.close()
    print("wrote %d deliveries, %.1f MB in %.0f s" % (count, size / 1e6,
                                                      time.monotonic() - started))


def run_measured(args: list) -> tuple:
    """(wall seconds, peak RSS in MiB, stdout) of one subprocess."""
    if os.access("/usr/bin/time", os.X_OK):
        started = time.monotonic()
        result = subprocess.run(["/usr/bin/time", "-v"] + args, capture_output=True, text=True)
        wall = time.monotonic() - started
        found = re.search(r"Maximum resident set size \(kbytes\): (\d+)", result.stderr)
        peak = int(found.group(1)) / 1024 if found else float("nan")
    else:
        before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
        started = time.monotonic()
        result = subprocess.run(args, capture_output=True, text=True)
        wall = time.monotonic() - started
        peak = max(before, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss) / 1024
    if result.returncode not in (0, 1):
        sys.exit("%s failed (%d):\n%s" % (" ".join(args), result.returncode, result.stderr))
    return wall, peak, result.stdout


def _rss_kib(pid: int) -> int:
    """The proportional set size (PSS) of a process: its resident memory with each page
    shared with the processes it forked counted once among them, so that the workers'
    figures add up (their RSS would count the pages they share with the main process
    in each of them); VmRSS where the kernel gives no smaps_rollup."""
    try:
        for line in Path("/proc/%d/smaps_rollup" % pid).read_text().splitlines():
            if line.startswith("Pss:"):
                return int(line.split()[1])
    except OSError:
        pass
    try:
        for line in Path("/proc/%d/status" % pid).read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def _children(pid: int) -> list:
    try:
        return [int(c) for c in Path("/proc/%d/task/%d/children" % (pid, pid)).read_text().split()]
    except OSError:
        return []


def run_sampled(args: list) -> dict:
    """Run ``args``; sample the resident memory of it and of its child processes (the
    rebuild's workers) every 100 ms (:func:`_rss_kib`): wall seconds, stdout, and the
    peaks in MiB of the main process, of the largest worker and of their sum."""
    started = time.monotonic()
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    peak_main = peak_worker = peak_sum = 0
    while proc.poll() is None:
        main_kib = _rss_kib(proc.pid)
        workers = [_rss_kib(child) for child in _children(proc.pid)]
        peak_main = max(peak_main, main_kib)
        peak_worker = max([peak_worker] + workers)
        peak_sum = max(peak_sum, main_kib + sum(workers))
        time.sleep(0.1)
    out, err = proc.communicate()
    wall = time.monotonic() - started
    if proc.returncode != 0:
        sys.exit("%s failed (%d):\n%s" % (" ".join(args), proc.returncode, err))
    return {"wall": wall, "out": out, "main": peak_main / 1024, "worker": peak_worker / 1024,
            "sum": peak_sum / 1024}


def bench_jobs(python: list, data_dir: Path, deliveries: int, archive_bytes: int) -> None:
    """``reindex`` with 1 job, 2 jobs, the default (every usable core) and pinned to one
    core: speed, the ratio to one job, memory per process, and the fingerprints."""
    command = python + [str(ROOT / "healthlog.py"), "reindex", "--data", str(data_dir)]
    runs = [("--jobs 1", command + ["--jobs", "1"]), ("--jobs 2", command + ["--jobs", "2"]),
            ("default (%d usable cores)" % len(os.sched_getaffinity(0)), command)]
    if shutil.which("taskset"):
        runs.append(("default, taskset -c 0", ["taskset", "-c", "0"] + command))
    print("reindex of %d deliveries, %.1f MB, python %s" % (
        deliveries, archive_bytes / 1e6, sys.version.split()[0]))
    print("wall: the whole command; fold: its `folded:` line (the rebuild without start-up,"
          " swap and index building); memory: peak PSS")
    print("%-26s %6s %6s %12s %8s %9s %11s %8s %s" % (
        "run", "wall s", "fold s", "fold pts/s", "x 1 job", "main MiB", "worker MiB",
        "sum MiB", "jobs, fingerprint"))
    first = None
    for label, args in runs:
        run = run_sampled(args)
        points = int(re.search(r"^points: (\d+)$", run["out"], re.M).group(1))
        fold_s, jobs = re.search(r"^folded: \d+ deliveries in ([\d.]+) s, (\d+ jobs?) ",
                                 run["out"], re.M).groups()
        fingerprint = re.search(r"^fingerprint: (\w+)$", run["out"], re.M).group(1)
        rate = points / float(fold_s)
        first = first or rate
        print("%-26s %6.1f %6s %12.0f %7.2fx %9.0f %11.0f %8.0f %s, %s" % (
            label, run["wall"], fold_s, rate, rate / first, run["main"], run["worker"],
            run["sum"], jobs, fingerprint[:16]))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, help="data directory (kept; default: a temp dir)")
    parser.add_argument("--days", type=int, default=365)
    parser.add_argument("--pushes-per-day", type=int, default=24)
    parser.add_argument("--verify", action="store_true", help="also time `verify` afterwards")
    parser.add_argument("--stdlib-json", action="store_true",
                        help="run healthlog with `python3 -S` (no site-packages, so no orjson)")
    parser.add_argument("--jobs", action="store_true",
                        help="compare 1 job, 2 jobs, every core and one pinned core instead")
    args = parser.parse_args()
    temporary = args.data is None
    data_dir = args.data or Path(tempfile.mkdtemp(prefix="bench-reindex-")) / "data"
    try:
        if not (data_dir / healthlog.DB_NAME).exists():
            write_store(data_dir, args.days, args.pushes_per_day)
        conn = sqlite3.connect(str(data_dir / healthlog.DB_NAME))
        deliveries, archive_bytes = conn.execute(
            "SELECT count(*), sum(body_bytes) FROM delivery").fetchone()
        conn.close()
        python = [sys.executable, "-S"] if args.stdlib_json else [sys.executable]
        if args.jobs:
            bench_jobs(python, data_dir, deliveries, archive_bytes)
            return 0
        command = python + [str(ROOT / "healthlog.py"), "reindex", "--data", str(data_dir)]
        print("$ " + " ".join(command))
        wall, peak, out = run_measured(command)
        print(out, end="")
        points = int(re.search(r"^points: (\d+)$", out, re.M).group(1))
        print("reindex: %d deliveries, %.1f MB of archive, %d points stored" % (
            deliveries, archive_bytes / 1e6, points))
        print("  wall %.1f s | %.0f deliveries/s | %.1f MB/s | %.0f points/s | peak RSS %.0f MiB"
              % (wall, deliveries / wall, archive_bytes / 1e6 / wall, points / wall, peak))
        if args.verify:
            command[command.index("reindex")] = "verify"
            wall, peak, out = run_measured(command)
            print("verify: wall %.1f s | peak RSS %.0f MiB | %s" % (
                wall, peak, out.strip().splitlines()[-1]))
    finally:
        if temporary:
            shutil.rmtree(str(data_dir.parent), ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
