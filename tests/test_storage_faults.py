"""Busy and broken storage: a database held busy, an archive that cannot be written, a full
disk, a corrupt database file, and start-up files that cannot be used (RELY-3.n).

Everything is real: a second SQLite connection holds the write lock; the archive is broken
by putting a file where a day folder must go (that works as root too, where permissions
would not: CI runs as root); a full disk is ``RLIMIT_FSIZE`` on a real ``healthlog.py
serve`` subprocess (SIGXFSZ ignored, so a write past the limit fails with EFBIG as one past
a full disk fails with ENOSPC); a corrupt database is a real file overwritten with garbage,
cut short, or with its pages zeroed. Recovery is always checked end to end with the
commands the README gives (``reindex``, ``verify``).

Names carry the scenario IDs RELY-3.n.
"""

import datetime as dt
import json
import os
import random
import resource
import shutil
import signal
import sqlite3
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

import hae_factory as hf
import healthlog
from conftest import (TOKEN, Client, archive_files, assert_no_leaks, db_rows, journal_rows,
                      live_fingerprint, log_records, one_line, parse_logfmt, run_cli, statuses,
                      wait_folded, wait_for)

AUTOMATION = hf.Automation("Storage faults", "Minutes", "Since Last Sync")
HEADERS = hf.headers_for(AUTOMATION, session_id="0C6B1C53-2D4A-4F7E-9B7B-6A1B2C3D4E5F")
DAY = dt.date(2024, 3, 8)
ERROR_KEYS = {"status", "code", "message"}


# ---------------------------------------------------------------------------------------------
# Helpers.


def day_body(seed: int, day: dt.date = DAY, names=("step_count", "heart_rate"),
             grouping: str = "Minutes", end: dt.date = None) -> bytes:
    """A real-shaped HAE metrics body for one local day (or ``[day, end)``)."""
    return hf.dumps_hae(hf.metrics_payload(seed, names, day, end, grouping), pretty=False)


def few_points_body(seed: int) -> bytes:
    """A few points only: a body that fits wherever a bigger one does not."""
    return hf.dumps_hae(hf.envelope(metrics=[hf.metric("step_count", [
        {"date": "2024-03-%02d 10:%02d:00 -0800" % (1 + seed % 28, minute), "qty": seed + minute}
        for minute in (1, 2, 3)], "count")]))


def serve_refused(data_dir: Path, *extra: str) -> subprocess.CompletedProcess:
    """``serve`` on a data directory it must refuse: it has to exit on its own (a server
    that starts instead is stopped after 60 s, and the test fails on its exit code)."""
    args = ["serve", "--data", data_dir, "--listen", "127.0.0.1:0"] + list(extra)
    try:
        return run_cli(*args, timeout=60)
    except subprocess.TimeoutExpired:
        raise AssertionError("serve started on %s instead of refusing it" % data_dir) from None


def assert_error_without_cause(payload, status: int, code: str) -> None:
    """The one JSON error shape, and no detail of the cause (no path, no errno, no SQL)."""
    assert set(payload) == {"error"} and set(payload["error"]) == ERROR_KEYS, payload
    assert (payload["error"]["status"], payload["error"]["code"]) == (status, code)
    text = json.dumps(payload).lower()
    for detail in ("archive", "sqlite", "locked", "errno", "tmp", "/", "oserror"):
        assert detail not in text, payload


def bodies_in_archive(data_dir: Path) -> list:
    return healthlog.archive_bodies(data_dir)


JOURNAL_FIELDS = ("received_at", "archive_path", "body_bytes", "body_sha256", "automation_id",
                  "automation_name", "automation_aggregation", "automation_period",
                  "session_id", "path_name")


# ---------------------------------------------------------------------------------------------
# RELY-3.1: ingest meets a database held busy past every retry.


@pytest.mark.json_agnostic
def test_rely_3_1_a_database_busy_past_the_timeout_answers_500_and_reindex_adopts_the_orphan(
        start_service, data_dir, write_locks, logs):
    """WHEN another connection holds the database's write lock longer than the busy
    timeout while a delivery arrives
    THEN the answer is a plain JSON 500 after waiting the timeout, one ERROR record carries
    busy=true and names the archived body, which stays byte for byte in the archive
    without a row (an orphan), nothing is left in tmp; once the lock is gone ingest
    answers 200 again, and `reindex` adopts the orphan in its journal place with its
    receive time and headers."""
    service = start_service(paused=True, busy_timeout_s=0.3)
    client = Client(*service.address)
    before, during, after = day_body(1), day_body(2, DAY + dt.timedelta(days=1)), \
        day_body(3, DAY + dt.timedelta(days=2))
    assert client.ingest(before, headers=HEADERS)[0] == 200

    lock = write_locks(service.config.db_path)
    started = time.monotonic()
    status, payload = client.ingest(during, headers=HEADERS)
    waited = time.monotonic() - started
    assert status == 500
    assert_error_without_cause(payload, 500, "internal_error")
    # A lower bound the code guarantees by sleeping, not a speed figure: SQLite's busy
    # handler sleeps the whole 0.3 s timeout before it gives up, and a loaded machine only
    # lengthens the wait (no upper bound is asserted).  It tells "waited for the lock"
    # from "gave up at once" (a connection opened without the busy timeout).
    assert waited >= 0.25, "it must wait for the lock before giving up (%.2f s)" % waited
    [record] = logs.find("delivery row not written", level="ERROR")
    assert record["busy"] == "true"
    assert record["error"] == "OperationalError"
    orphan = record["archive_path"]
    assert (data_dir / orphan).read_bytes() == during
    meta = json.loads((data_dir / (orphan[:-len(".json")] + ".meta.json")).read_text())
    assert meta["headers"]["automation-name"] == AUTOMATION.name
    assert list((data_dir / "tmp").iterdir()) == []
    assert len(db_rows(data_dir)) == 1
    # A reader is not held up by a writer in WAL mode: the service still says how it is.
    assert client.request("GET", "/healthz")[0] == 200

    lock.release()
    status, payload = client.ingest(after, headers=HEADERS)
    assert status == 200, payload
    assert [r["parse_status"] for r in db_rows(data_dir)] == ["pending", "pending"]
    service.worker.gate.set()
    wait_folded(data_dir, 2)
    service.stop()

    result = run_cli("reindex", "--data", data_dir)
    assert result.returncode == 0, result.stderr
    assert "orphans adopted: 1" in result.stdout
    rows = db_rows(data_dir, "SELECT * FROM delivery ORDER BY received_at, id")
    assert [r["archive_path"] for r in rows][1] == orphan  # between the other two
    adopted = rows[1]
    assert adopted["received_at"] == meta["received_at"]
    assert adopted["automation_name"] == AUTOMATION.name
    assert adopted["session_id"] == HEADERS["session-id"]
    assert [r["parse_status"] for r in rows] == ["parsed"] * 3
    assert sorted(r["archive_path"] for r in rows) == bodies_in_archive(data_dir)


# ---------------------------------------------------------------------------------------------
# RELY-3.2: the fold thread meets a busy database.


@pytest.mark.json_agnostic
def test_rely_3_2_a_busy_database_holds_the_live_fold_at_its_head_until_the_lock_goes(
        start_service, data_dir, write_locks, logs):
    """WHEN the live fold thread finds the database busy past its retries on pass after
    pass (another connection holds the write lock)
    THEN every delivery stays pending, none is failed, each pass stops at the head and no
    later delivery is folded before it, nothing is logged as an error, the worker keeps
    running and /healthz still answers with the backlog; once the lock goes, the next
    periodic pass (no new delivery wakes it) folds all of them in journal order."""
    service = start_service(paused=True, busy_timeout_s=0.1, fold_wake_s=0.3)
    client = Client(*service.address)
    ids = []
    for n in range(3):
        status, payload = client.ingest(day_body(10 + n, DAY + dt.timedelta(days=n)),
                                        headers=HEADERS)
        assert status == 200, payload
        ids.append(payload["delivery_id"])

    lock = write_locks(service.config.db_path)
    service.worker.gate.set()
    deferred = wait_for(lambda: (lambda d: d if len(d) >= 2 else None)(
        [int(r["delivery_id"]) for r in logs.find("fold deferred", level="INFO")]), timeout=60)
    assert set(deferred) == {ids[0]}, deferred
    assert statuses(data_dir) == {i: "pending" for i in ids}
    assert db_rows(data_dir, "SELECT count(*) AS n FROM object")[0]["n"] == 0
    status, health = client.request("GET", "/healthz")
    assert status == 200 and health["backlog"] == 3, health
    assert service.worker.state in ("idle", "folding")
    assert logs.find("", level="ERROR") == []
    assert logs.find("delivery folded") == []
    assert logs.find("delivery failed to fold") == []
    lock.release()

    assert wait_folded(data_dir, 3, timeout=30) == {i: "parsed" for i in ids}
    # A fold's records follow its commit: read them once the pass has returned.
    wait_for(lambda: service.worker.state == "idle", what="the fold pass has returned")
    folded = [int(r["delivery_id"]) for r in logs.find("delivery folded", level="INFO")]
    assert folded == ids
    assert logs.find("folded after a later one") == []


# ---------------------------------------------------------------------------------------------
# RELY-3.3: the archive cannot be written.


def block_day_folders(data_dir: Path) -> list:
    """Put a plain file where today's (and, near midnight, tomorrow's) UTC day folder of
    the archive must go: no body can be archived there, whoever runs the test."""
    now = dt.datetime.now(dt.timezone.utc)
    blocked = []
    for moment in (now, now + dt.timedelta(minutes=5)):
        folder = data_dir / healthlog.Archive.names(moment)[0]
        if folder not in blocked:
            folder.parent.mkdir(parents=True, exist_ok=True)
            folder.write_bytes(b"not a folder\n")
            blocked.append(folder)
    return blocked


@pytest.mark.json_agnostic
def test_rely_3_3_an_archive_that_cannot_be_written_answers_500_and_writes_nothing(
        start_service, data_dir, logs):
    """WHEN the archive's day folder cannot be created or written (a file stands in its
    place; root ignores permissions, this does not)
    THEN the delivery is answered with the plain JSON 500, one ERROR record names the
    class and errno only, and nothing of it is anywhere: no body or .meta.json in the
    archive, no upload in tmp, no row; the server goes on, and once the folder can be
    written a delivery is archived and journaled normally."""
    service = start_service(paused=True)
    client = Client(*service.address)
    blocked = block_day_folders(data_dir)

    status, payload = client.ingest(day_body(1), headers=HEADERS)
    assert status == 500
    assert_error_without_cause(payload, 500, "internal_error")
    [record] = logs.find("archive write failed", level="ERROR")
    assert (record["error"], record["errno"]) == ("NotADirectoryError", "20")
    assert set(record) == {"time", "level", "msg", "error", "errno"}
    leftovers = [p for p in archive_files(data_dir)
                 if data_dir / p not in blocked]
    assert leftovers == []
    assert db_rows(data_dir) == []
    assert client.request("GET", "/healthz")[0] == 200

    for folder in blocked:
        folder.unlink()
    status, payload = client.ingest(day_body(2), headers=HEADERS)
    assert status == 200, payload
    [row] = db_rows(data_dir)
    assert (data_dir / row["archive_path"]).read_bytes() == day_body(2)
    assert len(archive_files(data_dir)) == 2  # the body and its .meta.json, nothing else


@pytest.fixture
def tmp_on_other_filesystem(data_dir):
    """DATA/tmp as a link to a folder on another filesystem (/dev/shm, a tmpfs): what an
    owner does to spare an SD card, and what makes the body's rename into the archive
    fail (EXDEV) after its .meta.json has been written."""
    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm on this machine")
    elsewhere = Path(tempfile.mkdtemp(prefix="healthlog-tmp-", dir="/dev/shm"))
    try:
        data_dir.mkdir(mode=0o700)
        (data_dir / "archive").mkdir(mode=0o700)
        if os.stat(str(elsewhere)).st_dev == os.stat(str(data_dir)).st_dev:
            pytest.skip("/dev/shm is on the test's own filesystem")
        (data_dir / "tmp").symlink_to(elsewhere)
        yield elsewhere
    finally:
        shutil.rmtree(str(elsewhere), ignore_errors=True)


@pytest.mark.json_agnostic
def test_rely_3_3_a_body_that_cannot_be_moved_into_the_archive_leaves_no_meta_behind(
        make_config, tmp_on_other_filesystem, data_dir, logs):
    """WHEN DATA/tmp is on another filesystem than the archive, so that the body's rename
    into the archive fails after its .meta.json was written
    THEN either serve refuses to start with a message naming tmp, or the delivery is
    answered 500 and nothing of it stays: no .meta.json without its body in the archive,
    no upload, no row."""
    service = healthlog.Service(make_config(), announce=lambda token: None)
    try:
        service.start()
    except healthlog.ConfigError as exc:  # refusing the layout at start is fine too
        assert "tmp" in exc.message, exc.message
        return
    try:
        status, payload = Client(*service.address).ingest(day_body(1), headers=HEADERS)
        assert status == 500
        assert_error_without_cause(payload, 500, "internal_error")
        assert logs.find("archive write failed", level="ERROR")
        assert os.listdir(str(tmp_on_other_filesystem)) == []
        assert [str(p.relative_to(data_dir)) for p in (data_dir / "archive").rglob("*")
                if p.is_file()] == [], "a .meta.json without its body stays in the archive"
        assert db_rows(data_dir) == []
    finally:
        service.stop()


# ---------------------------------------------------------------------------------------------
# RELY-3.4: the disk is full (RLIMIT_FSIZE on a real serve process).


def limited(limit: int) -> list:
    """The interpreter for ServeProcess: python that sets RLIMIT_FSIZE and ignores
    SIGXFSZ (so a write past the limit fails with EFBIG, as one on a full disk fails with
    ENOSPC), then execs the real ``healthlog.py serve …``."""
    code = ("import os, resource, signal, sys; signal.signal(signal.SIGXFSZ, signal.SIG_IGN);"
            " resource.setrlimit(resource.RLIMIT_FSIZE, (%d, %d));"
            " os.execv(sys.executable, [sys.executable] + sys.argv[1:])" % (limit, limit))
    return [sys.executable, "-c", code]


def fsize_limit_works() -> bool:
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    return hard == resource.RLIM_INFINITY or hard >= 1 << 20


def post_all(client: Client, bodies: list) -> list:
    return [client.ingest(b, headers=HEADERS) for b in bodies]


@pytest.mark.json_agnostic
@pytest.mark.skipif(not fsize_limit_works(), reason="RLIMIT_FSIZE cannot be set here")
def test_rely_3_4_a_body_bigger_than_the_space_left_is_a_500_and_the_server_stays_up(
        serve_process, data_dir):
    """WHEN the disk fills up while a body streams into DATA/tmp (RLIMIT_FSIZE 1 MiB, a
    1.5 MB body)
    THEN the answer is the plain JSON 500 (a server-side failure HAE retries, not a
    client's 400), one ERROR record says the archive write failed with its errno, no
    partial upload or archive file and no row remain, the process stays up and smaller
    deliveries still get 200; after a restart with space back, every acknowledged
    delivery is there and folded, and `verify` passes."""
    proc = serve_process(data_dir, python=limited(1 << 20))
    small = [few_points_body(n) for n in range(3)]
    big = hf.big_metrics_body(1_500_000, seed=4)
    assert proc.client.ingest(small[0], headers=HEADERS)[0] == 200

    status, payload = proc.client.ingest(big, headers=HEADERS)

    records = [parse_logfmt(line) for line in proc.log_lines()]
    assert status == 500, (status, payload)
    assert_error_without_cause(payload, 500, "internal_error")
    failed = [r for r in records if r.get("msg") == "archive write failed: delivery refused"]
    assert failed and failed[0]["level"] == "ERROR", records
    assert failed[0]["errno"] in ("27", "28")  # EFBIG here, ENOSPC on a real disk
    assert list((data_dir / "tmp").iterdir()) == []
    assert len(bodies_in_archive(data_dir)) == 1 and len(archive_files(data_dir)) == 2
    assert proc.proc.poll() is None
    assert [r[0] for r in post_all(proc.client, small[1:])] == [200, 200]
    assert proc.client.request("GET", "/healthz")[0] == 200
    wait_folded(data_dir, 3)
    assert proc.terminate() == 0

    again = serve_process(data_dir)  # space is back
    assert again.client.ingest(big, headers=HEADERS)[0] == 200
    assert wait_folded(data_dir, 4) == {1: "parsed", 2: "parsed", 3: "parsed", 4: "parsed"}
    assert again.terminate() == 0
    result = run_cli("verify", "--data", data_dir)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.json_agnostic
@pytest.mark.torture  # fills the disk under a running serve on purpose: with the torture runs
@pytest.mark.skipif(not fsize_limit_works(), reason="RLIMIT_FSIZE cannot be set here")
def test_rely_3_4_a_full_disk_under_the_database_loses_no_acknowledged_delivery(
        serve_process, data_dir):
    """WHEN the disk fills up under the database (RLIMIT_FSIZE 192 KiB: a month of hourly
    points fits as a body and as a journal row, but not as the objects its fold writes;
    later rows no longer fit the WAL either)
    THEN an acknowledged delivery whose fold meets the full disk is not given up: it is
    never `failed` (a full disk is a circumstance, like a busy database) and is folded
    once space is back; a delivery whose row cannot be written is a 500 with an ERROR
    (busy=false) naming its archived body; the process stays up; after a restart with
    space back, `reindex` adopts exactly those orphans, every acknowledged delivery is
    `parsed`, and `verify` passes."""
    serve_process(data_dir).terminate()  # the database exists before the disk fills up
    proc = serve_process(data_dir, python=limited(192 << 10))
    month = day_body(20, dt.date(2024, 3, 1), ("step_count", "active_energy"), "Hours",
                     dt.date(2024, 4, 1))
    assert len(month) < 160 << 10
    status, payload = proc.client.ingest(month, headers=HEADERS)
    assert status == 200, payload
    acknowledged, refused = [payload["delivery_id"]], 0
    # The fold of that month meets the limit; wait until it has met it.
    wait_for(lambda: any(m in line for line in proc.log_lines() for m in (
        "delivery failed to fold", "fold deferred", "fold outcome not written",
        "fold pass failed", "delivery folded")), timeout=60)
    for n in range(60):  # rows until the WAL is full as well
        status, payload = proc.client.ingest(few_points_body(n), headers=HEADERS)
        if status == 200:
            acknowledged.append(payload["delivery_id"])
            continue
        assert status == 500, payload
        assert_error_without_cause(payload, 500, "internal_error")
        refused += 1
        if refused == 2:
            break
    assert refused == 2, "the database never reached the limit"
    records = [parse_logfmt(line) for line in proc.log_lines()]
    orphans = [r for r in records if r.get("msg", "").startswith("delivery row not written")]
    assert [(r["level"], r["busy"]) for r in orphans] == [("ERROR", "false")] * 2
    assert proc.proc.poll() is None
    assert "failed" not in statuses(data_dir).values(), (
        "an acknowledged delivery was given up because the disk was full: %s"
        % [(r.get("delivery_id"), r.get("error")) for r in records
           if r.get("msg") == "delivery failed to fold"])
    assert proc.terminate() == 0

    # Space is back: the restart adopts the two bodies whose rows the full disk refused
    # (RELY-11.4: never acknowledged, but the phone's own data) and folds everything.
    again = serve_process(data_dir)
    wait_folded(data_dir, len(acknowledged) + 2)
    assert [r for r in log_records(again.log_lines()) if r.get("msg", "").startswith(
        "archive settled at start")][0]["adopted"] == "2"
    assert again.terminate() == 0
    result = run_cli("reindex", "--data", data_dir)
    assert result.returncode == 0, result.stderr
    assert "orphans adopted: 0" in result.stdout
    final = statuses(data_dir)
    assert len(final) == len(acknowledged) + 2
    assert set(final.values()) == {"parsed"}
    assert sorted(r["archive_path"] for r in db_rows(data_dir)) == bodies_in_archive(data_dir)
    result = run_cli("verify", "--data", data_dir)
    assert result.returncode == 0, result.stdout + result.stderr


# ---------------------------------------------------------------------------------------------
# RELY-3.5: a corrupt database file.


def folded_store(start_service, data_dir: Path, count: int = 5) -> str:
    """A stopped data directory with ``count`` folded deliveries; its fingerprint."""
    service = start_service()
    client = Client(*service.address)
    for n in range(count):
        assert client.ingest(day_body(30 + n, DAY + dt.timedelta(days=n), ("step_count",)),
                             headers=HEADERS)[0] == 200
    wait_folded(data_dir, count)
    assert service.stop()
    assert not (data_dir / (healthlog.DB_NAME + "-wal")).exists()  # all in the main file
    return live_fingerprint(data_dir)


def corrupt(db: Path, how: str) -> None:
    good = db.read_bytes()
    page = 4096
    assert len(good) >= 6 * page, len(good)
    rng = random.Random(how)
    if how == "garbage":
        db.write_bytes(bytes(rng.getrandbits(8) for _ in range(len(good))))
    elif how == "truncated":
        db.write_bytes(good[:len(good) // 2])
    elif how == "zeroed-pages":  # a valid header and schema page, every other page zeroed
        db.write_bytes(good[:page] + bytes(len(good) - page))
    else:
        raise ValueError(how)


@pytest.mark.json_agnostic
@pytest.mark.parametrize("how", ["garbage", "truncated", "zeroed-pages"])
def test_rely_3_5_serve_refuses_a_corrupt_database_with_one_line_naming_it(
        start_service, data_dir, how):
    """WHEN `serve` starts on a database file that is garbage, cut short, or has a valid
    header but corrupt pages
    THEN it exits 2 with one line on stderr, no traceback, naming the database file, and
    leaves that file as it was (for salvage); `reindex` refuses it the same way."""
    folded_store(start_service, data_dir)
    db = data_dir / healthlog.DB_NAME
    corrupt(db, how)
    damaged = db.read_bytes()

    result = serve_refused(data_dir, "--token", TOKEN)
    assert result.returncode == 2, result.stderr
    line = one_line(result.stderr)
    assert str(db) in line, "the message does not name the database: %r" % line
    assert db.read_bytes() == damaged

    result = run_cli("reindex", "--data", data_dir)
    assert result.returncode == 2, result.stderr
    assert str(db) in one_line(result.stderr)
    assert db.read_bytes() == damaged


@pytest.mark.json_agnostic
def test_rely_3_5_the_documented_recovery_from_a_corrupt_database_brings_everything_back(
        start_service, data_dir, tmp_path, serve_process):
    """WHEN the database is corrupt and the owner follows the README: put archive/ into an
    empty data directory and run `reindex`
    THEN every archived delivery is back with its receive time and headers, the store has
    the fingerprint it had before the damage, `verify` passes and `serve` takes new
    deliveries there."""
    fingerprint = folded_store(start_service, data_dir)
    before = journal_rows(data_dir, order="received_at, id", only=JOURNAL_FIELDS)
    corrupt(data_dir / healthlog.DB_NAME, "garbage")

    fresh = tmp_path / "restored"
    fresh.mkdir(mode=0o700)
    shutil.copytree(str(data_dir / "archive"), str(fresh / "archive"))
    result = run_cli("reindex", "--data", fresh)
    assert result.returncode == 0, result.stderr
    assert "orphans adopted: %d" % len(before) in result.stdout
    assert "fingerprint: %s" % fingerprint in result.stdout
    assert journal_rows(fresh, order="received_at, id", only=JOURNAL_FIELDS) == before
    assert set(statuses(fresh).values()) == {"parsed"}
    result = run_cli("verify", "--data", fresh)
    assert result.returncode == 0, result.stdout + result.stderr

    proc = serve_process(fresh)
    status, payload = proc.client.ingest(day_body(99), headers=HEADERS)
    assert status == 200, payload
    wait_folded(fresh, len(before) + 1)
    assert proc.terminate() == 0


@pytest.mark.json_agnostic
def test_rely_3_5_corrupt_store_pages_never_turn_an_acknowledged_delivery_into_failed(
        start_service, data_dir, tmp_path):
    """WHEN only the store's pages are corrupt (the object table's root page overwritten),
    which a start does not read
    THEN serve either refuses to start (exit 2, one line naming the database) or takes
    deliveries but never gives one up as `failed` for the broken database: it stays
    pending and an ERROR record says the database is damaged."""
    folded_store(start_service, data_dir)
    db = data_dir / healthlog.DB_NAME
    conn = sqlite3.connect(str(db))
    try:
        root = conn.execute("SELECT rootpage FROM sqlite_master WHERE name = 'object'"
                            ).fetchone()[0]
    finally:
        conn.close()
    data = bytearray(db.read_bytes())
    data[(root - 1) * 4096:root * 4096] = bytes(random.Random(7).getrandbits(8)
                                                for _ in range(4096))
    db.write_bytes(bytes(data))

    log_path = tmp_path / "serve.log"
    with open(str(log_path), "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "healthlog", "serve", "--data", str(data_dir),
             "--listen", "127.0.0.1:0", "--token", TOKEN], stdout=subprocess.DEVNULL, stderr=log)
    try:
        port = wait_for(lambda: proc.poll() is not None or next(
            (parse_logfmt(line).get("listen") for line in log_path.read_text().splitlines()
             if "msg=serving" in line), None), timeout=20)
        text = log_path.read_text()
        if port is True:  # it refused to start: fine, when it says why
            assert proc.returncode == 2, text
            assert str(db) in one_line(text)
            return
        status, payload = Client("127.0.0.1", int(port.rsplit(":", 1)[1])).ingest(
            day_body(77), headers=HEADERS)
        assert status == 200, payload
        delivery_id = payload["delivery_id"]
        # The fold that met the broken database has ended when its outcome is written
        # (the delivery is no longer pending: the fault this test looks for), when the
        # pass has failed and the loop restarts, or when the fold was deferred for the
        # database and the loop pauses (the outcome, if any, was written before).
        wait_for(lambda: statuses(data_dir)[delivery_id] != "pending" or any(
            "fold pass failed" in line or "the fold loop pauses" in line
            for line in log_path.read_text().splitlines()),
            timeout=60, what="the fold of the delivery ends")
        text = log_path.read_text()
        assert statuses(data_dir)[delivery_id] == "pending", (
            "an acknowledged delivery was given up for a broken database:\n" + text)
        assert " level=ERROR " in text
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(30)
        assert_no_leaks(log_path.read_text().splitlines())


# ---------------------------------------------------------------------------------------------
# RELY-3.6: start-up files that cannot be used.


@pytest.mark.json_agnostic
def test_rely_3_6_a_tmp_that_is_not_a_folder_stops_serve_with_one_line_naming_it(data_dir):
    """WHEN DATA/tmp is a file, not a folder
    THEN serve exits 2 with one line naming DATA/tmp, no traceback."""
    (data_dir / "archive").mkdir(parents=True)
    (data_dir / "tmp").write_bytes(b"")
    result = serve_refused(data_dir, "--token", TOKEN)
    assert result.returncode == 2, result.stderr
    assert str(data_dir / "tmp") in one_line(result.stderr)


@pytest.mark.json_agnostic
@pytest.mark.parametrize("token_file", ["folder", "not-utf8", "empty"])
def test_rely_3_6_an_unusable_token_file_stops_serve_with_one_line_naming_it(
        data_dir, token_file):
    """WHEN DATA/token cannot be read as a token (a folder, bytes that are not UTF-8
    text, an empty file) and no token is given
    THEN serve exits 2 with one line naming the token file and never prints its content,
    no traceback, and leaves the file as it was."""
    (data_dir / "archive").mkdir(parents=True)
    path = data_dir / "token"
    if token_file == "folder":
        path.mkdir()
    else:
        content = {"not-utf8": b"\xff\xfeCANARY-BODY-TEXT\n", "empty": b""}[token_file]
        path.write_bytes(content)
    result = serve_refused(data_dir)
    assert result.returncode == 2, result.stderr
    assert str(path) in one_line(result.stderr)
    assert "CANARY" not in result.stderr + result.stdout
    if token_file != "folder":
        assert path.read_bytes() == content
