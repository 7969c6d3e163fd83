"""REINDEX-11: reindex and verify on every core (openspec/specs/reindex/spec.md).

``reindex --jobs N`` folds with N worker processes beside the writer: the workers read,
parse and place the next bodies, the writer decides every outcome in journal order and
sends each hour to the worker that owns its objects. The promise is that the store and the
journal are the ones a single process builds, whatever N: every test here compares a
``--jobs 1`` run with a parallel one on copies of the same data directory, row by row.

The data directories are written straight through healthlog's acceptance path
(``accept_delivery``: archive, then journal), so a store of hundreds of deliveries takes
a second; the rebuilds run as real ``healthlog.py`` subprocesses.
"""

import datetime as dt
import errno
import hashlib
import io
import json
import os
import random
import shutil
import signal
import sqlite3
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

import hae_factory as hf
import healthlog
from conftest import assert_no_leaks, db_rows, object_rows, run_cli, wait_for
from reindex_helpers import by_path, journal_facts, printed_fingerprint, start_cli

pytestmark = pytest.mark.usefixtures("json_mode")  # every test with and without orjson

UTC = dt.timezone.utc
FIRST = dt.datetime(2024, 3, 8, 6, tzinfo=UTC)
HOURS = [FIRST + dt.timedelta(hours=h) for h in (0, 1, 2, 5, 26, 27)]  # few: collisions
AUTOMATIONS = {
    "fast": ({"automation-name": "Fast", "automation-id": "A-FAST",
              "automation-aggregation": "Minutes"}, None),
    "hours": ({"automation-name": "Hourly", "automation-aggregation": "Hours"}, None),
    "daily": ({"automation-name": "Daily", "automation-aggregation": "Days"}, None),
    "records": ({"automation-name": "Sleep and workouts"}, None),
    "scale": ({}, "scale"),  # known only by its /api/ingest/scale path: no header at all
}


def stamp(moment: dt.datetime, offset_h: int = 1) -> str:
    """HAE's ``yyyy-MM-dd HH:mm:ss Z`` for a phone at UTC+``offset_h``."""
    local = moment.astimezone(dt.timezone(dt.timedelta(hours=offset_h)))
    return local.strftime("%Y-%m-%d %H:%M:%S %z")


def resent_body(data: dict, rng: random.Random) -> bytes:
    return hf.dumps_hae({"data": data}, rng)


def minute_points(rng: random.Random, hour: dt.datetime, name: str) -> list:
    """Minute buckets of one hour, values drawn from a few so that two deliveries of the
    hour agree on some points and disagree on others."""
    points = []
    for minute in sorted(rng.sample(range(60), rng.randint(3, 25))):
        at = stamp(hour + dt.timedelta(minutes=minute))
        if name == "heart_rate":
            low = rng.choice((55, 60, 61))
            point = {"date": at, "Min": low, "Avg": low + rng.choice((4, 4.5)),
                     "Max": low + 9}
        else:
            point = {"date": at, "qty": rng.choice((1, 2, 2.5, 3))}
        if rng.random() < 0.1:
            point["isManual"] = rng.random() < 0.5  # a boolean: no longer a plain body
        point["source"] = rng.choice(("Watch", "Watch", "Phone"))
        points.append(point)
    return points


def random_traffic(seed: int, count: int = 120) -> list:
    """(received_at, headers, path name, body) of ``count`` deliveries in arrival order:
    Minutes, Hours and Days pushes over a few hours and days (so that many deliveries
    meet in the same objects, with the same and with other values), records (sleep
    stages, workouts of both versions), the same bytes again (a duplicate) and under
    another automation (not one), a body of unreadable times (failed), one with a
    section this version does not know (partial), a path-named automation's sparse
    pushes (the layer inherited, or not to be found), a metric in a second unit, and
    arrival ties."""
    rng = random.Random(seed)
    out: list = []
    received = FIRST + dt.timedelta(days=3)
    for _ in range(count):
        if rng.random() > 0.15:  # else the same received_at as the one before: a tie
            received += dt.timedelta(seconds=rng.randint(1, 900))
        kind = rng.choices(("minutes", "hours", "days", "records", "again", "other", "bad",
                            "partial", "sparse", "units"),
                           (40, 8, 8, 8, 8, 4, 3, 3, 4, 3))[0]
        automation = {"minutes": "fast", "units": "fast", "partial": "fast", "bad": "fast",
                      "hours": "hours", "days": "daily", "records": "records",
                      "sparse": "scale"}.get(kind, "fast")
        headers, path_name = AUTOMATIONS[automation]
        if kind in ("again", "other") and out:
            _, headers, path_name, body = rng.choice(out)
            if kind == "other":  # the same bytes from another automation: not a duplicate
                headers, path_name = AUTOMATIONS["hours"]
            out.append((received, headers, path_name, body))
            continue
        data: dict = {"metrics": []}
        if kind in ("minutes", "partial", "units"):
            for name in rng.sample(("step_count", "heart_rate", "active_energy"),
                                   rng.randint(1, 3)):
                points = []
                for hour in rng.sample(HOURS, rng.randint(1, 2)):
                    points += minute_points(rng, hour, name)
                units = {"step_count": "count", "heart_rate": "count/min",
                         "active_energy": "kcal"}[name]
                if kind == "units" and name == "active_energy":
                    units = "kJ"
                data["metrics"].append(hf.metric(name, points, units))
            if kind == "partial":
                data["futureSection"] = [{"date": stamp(HOURS[0]), "mood": "fine"}]
        elif kind == "hours":
            data["metrics"].append(hf.metric("step_count", [
                {"date": stamp(hour), "qty": rng.choice((100, 120, 121))}
                for hour in rng.sample(HOURS, 3)], "count"))
        elif kind == "days":
            days = [FIRST.date() + dt.timedelta(days=n) for n in rng.sample(range(4), 2)]
            data["metrics"].append(hf.metric("step_count", [
                {"date": "%s 00:00:00 +0100" % day, "qty": rng.choice((8000, 8100))}
                for day in days], "count"))
        elif kind == "records":
            start = FIRST + dt.timedelta(hours=rng.choice((14, 38)))
            if rng.random() < 0.5:
                data["metrics"].append(hf.metric("sleep_analysis", hf.sleep_segments(
                    rng.randint(0, 3), FIRST.date(), FIRST.date() + dt.timedelta(days=1)),
                    "hr"))
            maker = hf.workout_v2 if rng.random() < 0.5 else hf.workout_v1
            data["workouts"] = [maker(rng.randint(0, 2), start, route_points=5)]
        elif kind == "bad":
            data["metrics"].append(hf.metric("step_count", [{"date": "yesterday", "qty": 1}],
                                             "count"))
        else:  # sparse: one or two points of a scale, no header to name its grouping
            data["metrics"].append(hf.metric("weight_body_mass", [
                {"date": stamp(rng.choice(HOURS) + dt.timedelta(minutes=rng.randint(0, 59))),
                 "qty": rng.choice((74.0, 74.2))} for _ in range(rng.randint(1, 2))], "kg"))
        out.append((received, headers, path_name, resent_body(data, rng)))
    return out


def write_store(data_dir: Path, deliveries: list) -> None:
    """Journal ``deliveries`` through healthlog's acceptance path, all left pending."""
    config = healthlog.Config(data_dir=data_dir, log_level="WARN")
    healthlog.ensure_data_dir(data_dir)
    conn = healthlog.open_database(config, synchronous="NORMAL")
    try:
        archive = healthlog.Archive(data_dir)
        for index, (received, headers, path_name, body) in enumerate(deliveries):
            tmp = data_dir / healthlog.TMP_DIR / ("test-%d.part" % index)
            tmp.write_bytes(body)
            upload = healthlog.Upload(tmp, len(body), hashlib.sha256(body).hexdigest())
            healthlog.accept_delivery(archive, conn, upload, received, headers, path_name)
    finally:
        conn.close()


def rebuilt(store: Path, tmp_path: Path, name: str, *args) -> tuple:
    """``reindex ARGS`` of a copy of ``store``: (data dir, the completed process)."""
    data_dir = tmp_path / name
    shutil.copytree(str(store), str(data_dir))
    result = run_cli("reindex", "--data", data_dir, *args, timeout=300)
    assert result.returncode == 0, result.stderr
    return data_dir, result


def assert_same_store(one: Path, many: Path) -> None:
    """The same journal outcomes and the same objects, byte for byte."""
    assert by_path(journal_facts(many)) == by_path(journal_facts(one))
    assert object_rows(many) == object_rows(one)


@pytest.mark.parametrize("seed", [1, pytest.param(2, marks=pytest.mark.json_agnostic),
                                  pytest.param(3, marks=pytest.mark.json_agnostic)])
def test_reindex_11_1_the_same_store_and_journal_on_every_core(tmp_path, seed):
    store = tmp_path / "store"
    write_store(store, random_traffic(seed))
    one, single = rebuilt(store, tmp_path, "one", "--jobs", "1")
    many, parallel = rebuilt(store, tmp_path, "many", "--jobs", "3")
    assert ", 1 job (" in single.stdout and ", 3 jobs (" in parallel.stdout
    statuses = {row["parse_status"] for row in db_rows(one)}
    errors = {(row["error"] or "").split(" ")[0] for row in db_rows(one)}
    # The traffic reaches every kind of outcome, or the comparison proves less.
    assert statuses == {"parsed", "partial", "failed"}, statuses
    assert {"duplicate", "content_not_parsed"} <= errors, errors
    assert db_rows(one, "SELECT sum(overwrites) AS n FROM delivery")[0]["n"] > 0
    assert_same_store(one, many)
    assert printed_fingerprint(parallel.stdout) == printed_fingerprint(single.stdout)
    checked = run_cli("verify", "--data", many, "--jobs", "2")
    assert checked.returncode == 0 and "verify: equal" in checked.stdout, checked.stdout
    assert parallel.stderr == ""  # nothing above INFO, and no progress off a terminal


@pytest.mark.json_agnostic  # the large body's parse and index with and without orjson: FOLD-13.1
# and FOLD-13.2 (test_fold_stream); between the processes its pieces are pickled
def test_reindex_11_2_a_large_body_is_read_by_the_writer_and_sent_in_pieces(tmp_path):
    """A body of STREAM_FOLD_BYTES or more is never sent whole between processes: the
    writer indexes it and sends its hours in pieces of REBUILD_CHUNK_POINTS points."""
    rng = random.Random(5)
    big = hf.big_metrics_body(healthlog.STREAM_FOLD_BYTES + (1 << 20), seed=5)
    assert len(big) >= healthlog.STREAM_FOLD_BYTES
    points = sum(len(m["data"]) for m in json.loads(big)["data"]["metrics"])
    assert points > 2 * healthlog.REBUILD_CHUNK_POINTS  # so it goes in several pieces
    deliveries = random_traffic(7, count=30)
    received = deliveries[-1][0] + dt.timedelta(minutes=1)
    deliveries.append((received, AUTOMATIONS["fast"][0], None, big))
    deliveries += [(received + dt.timedelta(minutes=1 + n), headers, path_name, body)
                   for n, (_, headers, path_name, body) in enumerate(rng.sample(deliveries, 5))]
    store = tmp_path / "store"
    write_store(store, deliveries)
    one, _ = rebuilt(store, tmp_path, "one", "--jobs", "1")
    many, parallel = rebuilt(store, tmp_path, "many", "--jobs", "2")
    assert ", 2 jobs (" in parallel.stdout
    assert_same_store(one, many)
    [row] = [r for r in db_rows(many) if r["body_bytes"] == len(big)]
    assert row["parse_status"] == "parsed" and row["points"] == points


def children_of(pid: int) -> list:
    """The processes whose parent is ``pid``."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry.name))
    return found


def gone(pid: int) -> bool:
    """Ended (a zombie that no one reaps counts as ended)."""
    try:
        state = Path("/proc/%d/stat" % pid).read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return True
    return state == "Z"


def days_store(store: Path, count: int) -> Path:
    """``count`` deliveries of a day of three metrics by the minute, journaled, pending."""
    deliveries = []
    received = FIRST + dt.timedelta(days=30)
    for n in range(count):
        payload = hf.metrics_payload(n, ("step_count", "heart_rate", "active_energy"),
                                     FIRST.date() + dt.timedelta(days=n % 20),
                                     grouping="Minutes")
        deliveries.append((received + dt.timedelta(minutes=n), AUTOMATIONS["fast"][0], None,
                           hf.dumps_hae(payload)))
    write_store(store, deliveries)
    return store


@pytest.fixture(scope="module")
def slow_store(tmp_path_factory, json_mode) -> Path:
    """Enough deliveries that a parallel reindex runs for a while on a busy machine: for
    the runs that stop it midway (torture)."""
    return days_store(tmp_path_factory.mktemp("slow") / "store", 60)


@pytest.fixture(scope="module")
def small_store(tmp_path_factory, json_mode) -> Path:
    """A few deliveries of the same kind: for the rules that hold for any store (how many
    jobs, which primitives), where the time a rebuild takes plays no part."""
    return days_store(tmp_path_factory.mktemp("small") / "store", 12)


@pytest.mark.json_agnostic
@pytest.mark.torture  # kills a process on purpose: with the torture runs (pyproject.toml)
def test_reindex_11_3_a_worker_that_ends_leaves_the_rebuild_to_one_process(slow_store,
                                                                            tmp_path):
    one, single = rebuilt(slow_store, tmp_path, "one", "--jobs", "1")
    data_dir = tmp_path / "many"
    shutil.copytree(str(slow_store), str(data_dir))
    proc = start_cli("reindex", "--data", data_dir, "--jobs", "2")
    try:
        workers = wait_for(lambda: children_of(proc.pid), timeout=60,
                           what="the reindex workers")
        os.kill(workers[0], signal.SIGKILL)
        stdout, stderr = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, stderr
    assert_no_leaks(stderr.splitlines())
    [warning] = [line for line in stderr.splitlines() if "level=WARN" in line]
    assert "the parallel reindex stopped; starting again in one process" in warning
    assert ", 1 job (" in stdout
    assert printed_fingerprint(stdout) == printed_fingerprint(single.stdout)
    assert_same_store(one, data_dir)
    assert all(gone(pid) for pid in workers)


@pytest.mark.json_agnostic
def test_reindex_11_4_no_semaphore_and_no_shared_memory_is_needed(small_store, tmp_path):
    """Where /dev/shm is missing or tiny, multiprocessing's locks and queues fail; the
    rebuild uses none of them (its workers talk over socket pairs)."""
    data_dir = tmp_path / "data"
    shutil.copytree(str(small_store), str(data_dir))
    breaker = ("import _multiprocessing, runpy, sys\n"
               "def refuse(*args, **kwargs):\n"
               "    raise OSError(28, 'No space left on device (/dev/shm)')\n"
               "_multiprocessing.SemLock = refuse\n"
               "runpy.run_module('healthlog', run_name='__main__', alter_sys=True)\n")
    result = subprocess.run([sys.executable, "-c", breaker,
                             "reindex", "--data", str(data_dir), "--jobs", "2"],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert ", 2 jobs (" in result.stdout and result.stderr == ""


@pytest.mark.json_agnostic
@pytest.mark.torture  # kills a process on purpose: with the torture runs (pyproject.toml)
@pytest.mark.parametrize("how", ["ctrl-c", "sigkill"])
def test_reindex_11_5_a_stopped_parallel_reindex_leaves_no_worker_behind(slow_store,
                                                                          tmp_path, how):
    data_dir = tmp_path / "data"
    shutil.copytree(str(slow_store), str(data_dir))
    conn = sqlite3.connect(str(data_dir / healthlog.DB_NAME))
    before = conn.execute("SELECT count(*) FROM delivery WHERE parse_status = 'pending'"
                          ).fetchone()[0]
    conn.close()
    proc = start_cli("reindex", "--data", data_dir, "--jobs", "2")
    try:
        workers = wait_for(lambda: children_of(proc.pid), timeout=60,
                           what="the reindex workers")
        # Stopped while the workers merge: once a shard file exists (or the rebuild ended).
        wait_for(lambda: proc.poll() is not None
                 or list((data_dir / "tmp").glob("rebuild-*/shard-*.sqlite3")),
                 timeout=60, what="the workers merging")
        proc.send_signal(signal.SIGINT if how == "ctrl-c" else signal.SIGKILL)
        _, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    wait_for(lambda: all(gone(pid) for pid in workers), timeout=30,
             what="every worker ended")
    if how == "ctrl-c" and proc.returncode == 130:  # else it ended before the signal
        assert stderr.strip().endswith("reindex interrupted; the previous store is unchanged")
    conn = sqlite3.connect(str(data_dir / healthlog.DB_NAME))
    try:
        if proc.returncode != 0:  # the previous journal is there, untouched
            assert conn.execute("SELECT count(*) FROM delivery WHERE parse_status ="
                                " 'pending'").fetchone()[0] == before
    finally:
        conn.close()
    again = run_cli("reindex", "--data", data_dir, "--jobs", "2", timeout=300)
    assert again.returncode == 0, again.stderr
    assert not list((data_dir / healthlog.TMP_DIR).glob("rebuild-*"))


@pytest.mark.json_agnostic
def test_reindex_11_6_jobs_default_to_the_usable_cores_and_are_checked(small_store, tmp_path):
    data_dir = tmp_path / "data"
    shutil.copytree(str(small_store), str(data_dir))
    refused = run_cli("reindex", "--data", data_dir, "--jobs", "0")
    assert refused.returncode == 2 and "--jobs" in refused.stderr
    if shutil.which("taskset") is None:
        pytest.skip("taskset is not installed")
    pinned = subprocess.run(["taskset", "-c", "0", sys.executable, "-m", "healthlog",
                             "reindex", "--data", str(data_dir)],
                            capture_output=True, text=True, timeout=300)
    assert pinned.returncode == 0, pinned.stderr
    assert ", 1 job (" in pinned.stdout


def rebuilt_here(store: Path, target: Path, jobs: int) -> str:
    """``run_reindex`` in this process on a copy of ``store``: what it printed."""
    shutil.copytree(str(store), str(target))
    out = io.StringIO()
    config = healthlog.Config(data_dir=target, log_level="WARN")
    assert healthlog.run_reindex(config, out=out, jobs=jobs) == 0
    return out.getvalue()


@pytest.mark.json_agnostic
def test_reindex_11_2_large_bodies_with_little_room_between_the_processes(tmp_path,
                                                                          monkeypatch):
    """Every body is read by the deciding process and sent in pieces of 300 points, and
    it may hold almost nothing unsent, so it waits for the workers between pieces of one
    delivery: the same journal and objects as one process."""
    deliveries = random_traffic(4, count=60)
    store = tmp_path / "store"
    write_store(store, deliveries)
    one = rebuilt_here(store, tmp_path / "one", 1)
    monkeypatch.setattr(healthlog, "STREAM_FOLD_BYTES", 1)
    monkeypatch.setattr(healthlog, "REBUILD_CHUNK_POINTS", 300)
    monkeypatch.setattr(healthlog, "REBUILD_UNSENT_MAX", 1)
    many = rebuilt_here(store, tmp_path / "many", 3)
    assert ", 3 jobs (" in many
    assert printed_fingerprint(many) == printed_fingerprint(one)
    assert_same_store(tmp_path / "one", tmp_path / "many")


@pytest.mark.json_agnostic
def test_reindex_11_3_workers_that_cannot_be_started_leave_it_to_one_process(
        small_store, tmp_path, monkeypatch, logs):
    def no_process_left():
        raise OSError(errno.EAGAIN, "Resource temporarily unavailable")

    monkeypatch.setattr(os, "fork", no_process_left)
    out = rebuilt_here(small_store, tmp_path / "data", 2)
    assert ", 1 job (" in out
    [warning] = logs.find("the parallel reindex stopped", level="WARN")
    assert warning["reason"] == "rebuild workers could not be started (EAGAIN)"


BOUNDED = {"FOLD_ROWS_HELD": 3, "DEFER_MIN_ELEMENTS": 2, "PIECE_MEMBERS": 2,
           "STREAM_FOLD_BYTES": 1, "WHOLE_PARSE_NAMES_MAX": 0, "ASCII_READ_CHUNK": 97,
           "REBUILD_CHUNK_POINTS": 50}
"""Every bound of a fold's memory at its tightest (tests/test_fold_stream.py, FOLD-13.3):
the rebuild's own write-behind and its workers spill and write their rows as a live fold
does, and every body goes to the workers in pieces."""


def folded_live(store: Path, target: Path) -> None:
    """A copy of ``store`` folded by serve's worker, in this process."""
    shutil.copytree(str(store), str(target))
    config = healthlog.Config(data_dir=target, log_level="WARN")
    worker = healthlog.FoldWorker(config)
    conn = worker.connect()
    try:
        worker.run_pass(healthlog.FoldEngine(conn, config))
    finally:
        conn.close()


def wide_and_long(seed: int) -> list:
    """(received_at, headers, path name, body) of a Days history of every metric,
    hundreds of one-point metrics and a long workout, then the workout and the history
    again, each with one value changed."""
    import bench_memory

    out = []
    received = FIRST + dt.timedelta(days=9)
    with tempfile.TemporaryDirectory() as tmp:
        for n, (shape, size) in enumerate((("days-backfill", 50_000),
                                           ("many-metrics-one-point", 30_000),
                                           ("workout-long", 60_000))):
            path = Path(tmp) / "body.json"
            made = bench_memory.write_body(shape, path, size, seed=seed)
            headers = ({"automation-aggregation": made["aggregation"]}
                       if made["aggregation"] else {"automation-name": "Workouts"})
            out.append((received + dt.timedelta(minutes=n), headers, None, path.read_bytes()))
    for n, (_, headers, _, body) in enumerate((out[2], out[0])):
        changed = body.replace(b'"Avg":', b'"Avg":1', 1).replace(b'"qty":', b'"qty":1', 1)
        out.append((received + dt.timedelta(minutes=5 + n), headers, None, changed))
    return out


@pytest.mark.json_agnostic  # FOLD-13.3 folds the same bounds with and without orjson
def test_reindex_2_4_folds_that_hold_a_bounded_batch_build_the_store_they_always_did(
        tmp_path, monkeypatch):
    """WHEN the live fold and reindex with one and three jobs run with every bound of a
    fold's memory at its tightest, THEN their journals and objects are those of the live
    fold and reindex with the defaults."""
    store = tmp_path / "store"
    write_store(store, random_traffic(8, count=40) + wide_and_long(8))
    folded_live(store, tmp_path / "live")
    one = rebuilt_here(store, tmp_path / "one", 1)
    with monkeypatch.context() as patch:
        for constant, value in BOUNDED.items():
            patch.setattr(healthlog, constant, value)
        folded_live(store, tmp_path / "live bounded")
        bounded_one = rebuilt_here(store, tmp_path / "one bounded", 1)
        bounded_many = rebuilt_here(store, tmp_path / "many bounded", 3)
    assert ", 3 jobs (" in bounded_many
    assert printed_fingerprint(bounded_one) == printed_fingerprint(one)
    assert printed_fingerprint(bounded_many) == printed_fingerprint(one)
    for name in ("live", "live bounded", "one bounded", "many bounded"):
        assert_same_store(tmp_path / "one", tmp_path / name)
    rows = db_rows(tmp_path / "one")
    assert sum(row["objects_written"] or 0 for row in rows[-2:]) >= 2  # the changes count
    assert len(object_rows(tmp_path / "one")) > 500
