"""A disk that comes late fails nothing (openspec/specs/reliability/spec.md, RELY-11; the
fold spec's FOLD-15.3, FOLD-15.5 and FOLD-15.6; REINDEX-4.3).

The boot race of a home server: the NAS share or USB disk that holds the archive is mounted
after the service starts, or a day folder is moved while serving, or a file disappears.
Each is played with real folders under a real ``serve`` subprocess or a real Service on
127.0.0.1:0, and real ``healthlog`` commands; the statuses are read from the SQLite file.
"""

import datetime as dt
import json
import os
import sqlite3
import threading
from pathlib import Path

import pytest

import healthlog
from conftest import (ROOT, TOKEN, Client, Clock, db_rows, delivery_row, find_records, healthz,
                      run_cli, statuses_of, wait_for)
from fold_helpers import (DAY, HEADERS, QUICK_SERVE, QuickRetryWorker, import_bodies, post_small,
                          small_body)

UNMOUNTED_S = 11.0
"""How long the disk stays away in the subprocess runs (the report's 11 s)."""

WAIT_ARCHIVE = "lists deliveries but"
DEFERRED = "fold deferred"
STAYED_MISSING = "stayed missing from its readable folder"


def quick_serve(serve_process, data_dir: Path, tmp_path: Path, *extra: str):
    """A real ``serve`` whose fold loop tries again every 0.2 s after a fault."""
    program = tmp_path / "quick_serve.py"
    program.write_text(QUICK_SERVE % str(ROOT))
    return serve_process(data_dir, *extra, program=str(program))


def pending_store(data_dir: Path, tmp_path: Path, count: int = 3) -> tuple:
    """(folded ids, pending ids): one delivery folded by a serve that then stopped, and
    ``count`` imported after it, waiting for the next start."""
    first = dt.datetime(2024, 3, 8, 10, tzinfo=dt.timezone.utc)
    folded = import_bodies(data_dir, tmp_path / "exports-1", [small_body(1)], first)
    result = run_cli("reindex", "--data", data_dir)  # folds it, as a serve would
    assert result.returncode == 0, result.stderr
    later = [small_body(n, DAY + dt.timedelta(days=n)) for n in range(2, 2 + count)]
    pending = import_bodies(data_dir, tmp_path / "exports-2", later,
                            first + dt.timedelta(minutes=1))
    assert statuses_of(data_dir, folded) == ["parsed"]
    assert statuses_of(data_dir, pending) == ["pending"] * count
    return folded, pending


def failed_count(data_dir: Path) -> int:
    return db_rows(data_dir, "SELECT count(*) AS n FROM delivery WHERE parse_status ="
                   " 'failed'")[0]["n"]


def files_under(folder: Path) -> list:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*")) if folder.exists() else []


# ---------------------------------------------------------------------------------------------
# RELY-11.1: serve started while the archive's disk is not there.


@pytest.mark.parametrize("absent", ["missing", "empty mount point"])
def test_rely_11_1_serve_started_before_the_archive_disk_waits_and_fails_nothing(
        serve_process, data_dir, tmp_path, absent):
    folded, pending = pending_store(data_dir, tmp_path)
    archive = data_dir / healthlog.ARCHIVE_DIR
    elsewhere = tmp_path / "the-disk"
    archive.rename(elsewhere)
    if absent == "empty mount point":
        archive.mkdir()

    proc = quick_serve(serve_process, data_dir, tmp_path)
    try:
        warned = wait_for(lambda: find_records(proc.log_lines(), WAIT_ARCHIVE, level="WARN"),
                          timeout=30, what="the start-up WARN naming the archive")
        assert str(archive) in warned[0]["msg"]
        status, health = wait_for(lambda: (lambda h: h[0] == 503 and h)(healthz(proc.client)),
                                  timeout=30, what="/healthz answers 503")
        assert (health["status"], health["fault"], health["missing"]) == (
            "failing", "archive:archive_missing", "archive")
        status, answer = proc.client.ingest(small_body(9, DAY + dt.timedelta(days=9)),
                                            headers=HEADERS)
        assert status == 503 and answer["error"]["code"] == "archive_unavailable"
        # Nothing written where the disk's files should be: no archive made, none filled.
        assert files_under(archive) == [] and archive.exists() == (absent != "missing")
        wait_for(lambda: len(find_records(proc.log_lines(), DEFERRED, level="ERROR")) >= 3,
                 timeout=30, what="three tries meet the missing archive")
        wait_for(lambda: [delivery_row(data_dir, i)["error"] for i in pending[:1]]
                 == ["retrying:archive:archive_missing"], timeout=30)
        threading.Event().wait(max(0.0, UNMOUNTED_S - 3))  # the disk stays away 11 s
        assert failed_count(data_dir) == 0
        assert statuses_of(data_dir, pending) == ["pending"] * len(pending)
        assert all(delivery_row(data_dir, i)["attempts"] <= 1 for i in pending)
    finally:
        if archive.exists():
            archive.rmdir()  # the empty mount point, or fails loudly if anything was written
        elsewhere.rename(archive)  # the disk is mounted

    wait_for(lambda: statuses_of(data_dir, pending) == ["parsed"] * len(pending), timeout=60,
             what="the pending deliveries fold once the disk is there")
    wait_for(lambda: healthz(proc.client)[0] == 200, timeout=30)
    status, answer = proc.client.ingest(small_body(9, DAY + dt.timedelta(days=9)),
                                        headers=HEADERS)
    assert status == 200
    wait_for(lambda: statuses_of(data_dir, [answer["delivery_id"]]) == ["parsed"], timeout=60)
    assert proc.terminate() == 0
    assert failed_count(data_dir) == 0
    verified = run_cli("verify", "--data", data_dir)
    assert verified.returncode == 0 and "verify: equal" in verified.stdout, verified.stdout


# ---------------------------------------------------------------------------------------------
# RELY-11.2 and FOLD-15.6: a day folder gone while serving.


def test_rely_11_2_a_day_folder_gone_while_serving_fails_nothing(serve_process, data_dir,
                                                                 tmp_path):
    folded, pending = pending_store(data_dir, tmp_path)
    [folder] = {(data_dir / delivery_row(data_dir, i)["archive_path"]).parent for i in pending}
    moved = tmp_path / "in-flight"
    folder.rename(moved)
    try:
        proc = quick_serve(serve_process, data_dir, tmp_path, "--missing-body-wait", "1s")
        wait_for(lambda: len(find_records(proc.log_lines(), DEFERRED, level="ERROR")) >= 3,
                 timeout=30, what="three tries meet the missing day folder")
        threading.Event().wait(UNMOUNTED_S)  # eleven times the wait: still nothing fails
        assert failed_count(data_dir) == 0
        assert delivery_row(data_dir, pending[0])["error"] == "retrying:archive:folder_missing"
        assert find_records(proc.log_lines(), STAYED_MISSING) == []
    finally:
        moved.rename(folder)
    wait_for(lambda: statuses_of(data_dir, pending) == ["parsed"] * len(pending), timeout=60)
    assert proc.terminate() == 0 and failed_count(data_dir) == 0


# ---------------------------------------------------------------------------------------------
# RELY-11.6: a body gone for good fails only after the wait, its folder readable.


def test_rely_11_6_a_body_gone_for_good_fails_after_the_wait_and_says_how_back(
        serve_process, data_dir, tmp_path):
    folded, pending = pending_store(data_dir, tmp_path)
    lost = pending[1]
    body_path = data_dir / delivery_row(data_dir, lost)["archive_path"]
    body = body_path.read_bytes()
    body_path.unlink()

    proc = quick_serve(serve_process, data_dir, tmp_path, "--missing-body-wait", "3s")
    wait_for(lambda: statuses_of(data_dir, pending[:1]) == ["parsed"], timeout=60)
    waited = wait_for(lambda: find_records(proc.log_lines(), STAYED_MISSING, level="ERROR"),
                      timeout=60, what="the missing body fails after the wait")
    assert int(waited[0]["delivery_id"]) == lost and int(waited[0]["missing_s"]) >= 3
    assert "healthlog refold %d" % lost in waited[0]["msg"]
    deferred = [r for r in find_records(proc.log_lines(), DEFERRED, level="ERROR")
                if r["delivery_id"] == str(lost)]
    assert len(deferred) >= 2 and {r["fault"] for r in deferred} == {"archive:body_missing"}
    wait_for(lambda: statuses_of(data_dir, pending) == ["parsed", "failed", "parsed"], timeout=60)
    lost_row = delivery_row(data_dir, lost)
    assert (lost_row["error"], lost_row["attempts"]) == ("body_missing", 0)
    status, page = proc.client.request("GET", "/api/deliveries?status=failed")
    assert status == 200 and "refold %d" % lost in page["deliveries"][0]["remedy"]
    assert proc.terminate() == 0

    shown = run_cli("status", "--data", data_dir)
    assert "1 delivery failed for a reason of the machine" in shown.stdout, shown.stdout
    body_path.write_bytes(body)  # the copy is found again
    verified = run_cli("verify", "--data", data_dir)
    assert verified.returncode == 1
    assert "failed: 1 delivery failed for a reason of the machine, and its body is there;" \
        " `healthlog refold --failed` folds them again" in verified.stdout, verified.stdout
    assert run_cli("refold", "--data", data_dir, "--failed").returncode == 0
    proc = serve_process(data_dir)
    wait_for(lambda: statuses_of(data_dir, [lost]) == ["parsed"], timeout=60)
    assert proc.terminate() == 0
    assert run_cli("verify", "--data", data_dir).returncode == 0


# ---------------------------------------------------------------------------------------------
# FOLD-15.3, FOLD-15.5, FOLD-15.6 with an in-process service and a clock the test moves.


@pytest.fixture
def clocked_service(make_config):
    clock = Clock()
    service = healthlog.Service(make_config(fold_wake_s=0.2, handoff_budget=0, clock=clock),
                                announce=lambda token: None)
    service.worker = QuickRetryWorker(service.config)
    service.start()
    service.clock = clock
    yield service
    assert service.stop()


@pytest.mark.parametrize("how", ["deleted", "folder"])
def test_fold_15_3_a_body_gone_from_its_readable_folder_waits_then_fails_alone(
        clocked_service, logs, how):
    service, data_dir = clocked_service, clocked_service.config.data_dir
    ids = post_small(service, 3)
    gone = ids[1]
    path = data_dir / delivery_row(data_dir, gone)["archive_path"]
    body = path.read_bytes()
    path.unlink()
    if how == "folder":
        path.mkdir()
    service.worker.gate.set()
    wait_for(lambda: len([r for r in logs.find(DEFERRED, level="ERROR")
                          if r["delivery_id"] == str(gone)]) >= 3, timeout=30,
             what="three tries meet the missing body")
    wait_for(lambda: (lambda r: (r["parse_status"], r["attempts"], r["error"]))(
        delivery_row(data_dir, gone)) == ("pending", 0, "retrying:archive:body_missing"),
        timeout=30)
    assert statuses_of(data_dir, ids) == ["parsed", "pending", "pending"]  # the barrier holds
    assert logs.find(STAYED_MISSING) == []

    service.clock.now += healthlog.MISSING_BODY_WAIT_S  # the wait is over

    wait_for(lambda: statuses_of(data_dir, ids) == ["parsed", "failed", "parsed"], timeout=30,
             what="the lost body fails alone and the one after it folds")
    assert delivery_row(data_dir, gone)["error"] == "body_missing"
    [said] = logs.find(STAYED_MISSING, level="ERROR")
    assert said["delivery_id"] == str(gone) and "healthlog refold %d" % gone in said["msg"]

    if how == "folder":
        path.rmdir()
    path.write_bytes(body)
    status, page = Client(*service.address).request("GET", "/api/deliveries?status=failed")
    assert "`healthlog refold %d`" % gone in page["deliveries"][0]["remedy"]
    assert healthlog.run_refold(service.config, [], True, out=open(os.devnull, "w")) == 0
    wait_for(lambda: statuses_of(data_dir, ids) == ["parsed"] * 3, timeout=30)


def test_fold_15_6_a_day_folder_gone_for_longer_than_the_wait_fails_nothing(
        clocked_service, logs):
    """The wait over, the folder gone at the moment of judgement: nothing fails."""
    service, data_dir = clocked_service, clocked_service.config.data_dir
    ids = post_small(service, 2)
    path = data_dir / delivery_row(data_dir, ids[0])["archive_path"]
    path.unlink()
    service.worker.gate.set()
    wait_for(lambda: delivery_row(data_dir, ids[0])["error"] == "retrying:archive:body_missing",
             timeout=30)
    moved = path.parent.with_name("moved")
    path.parent.rename(moved)
    service.clock.now += 2 * healthlog.MISSING_BODY_WAIT_S
    wait_for(lambda: delivery_row(data_dir, ids[0])["error"] == "retrying:archive:folder_missing",
             timeout=30)
    wait_for(lambda: len(logs.find(DEFERRED, level="ERROR")) >= 6, timeout=30)
    assert failed_count(data_dir) == 0 and logs.find(STAYED_MISSING) == []
    moved.rename(path.parent)
    # Back, still without its file: a fresh wait starts (the clock does not move now).
    wait_for(lambda: delivery_row(data_dir, ids[0])["error"] == "retrying:archive:body_missing",
             timeout=30)
    assert failed_count(data_dir) == 0


@pytest.mark.parametrize("absent", ["missing", "empty"])
def test_fold_15_5_the_archive_folder_missing_while_serving_is_a_fault_of_the_machine(
        clocked_service, logs, absent):
    service, data_dir = clocked_service, clocked_service.config.data_dir
    ids = post_small(service, 2)
    archive = data_dir / healthlog.ARCHIVE_DIR
    archive.rename(data_dir / "archive-unmounted")
    if absent == "empty":
        archive.mkdir()
    try:
        service.worker.gate.set()
        wait_for(lambda: len(logs.find(DEFERRED, level="ERROR")) >= 4, timeout=60,
                 what="four tries meet the missing archive")
        service.clock.now += 2 * healthlog.MISSING_BODY_WAIT_S  # no wait fails it
        wait_for(lambda: [(r["parse_status"], r["attempts"], r["error"]) for r in
                          (delivery_row(data_dir, i) for i in ids)]
                 == [("pending", 0, "retrying:archive:archive_missing"), ("pending", 0, None)],
                 timeout=30, what="pending, no attempt kept")
        client = Client(*service.address)
        status, health = client.request("GET", "/healthz", token=False)
        assert status == 503 and (health["fault"], health["missing"]) == (
            "archive:archive_missing", "archive")
        status, answer = client.ingest(small_body(7), headers=HEADERS)
        assert status == 503 and answer["error"]["code"] == "archive_unavailable"
        assert files_under(archive) == []
        assert len(db_rows(data_dir)) == 2
    finally:
        if archive.exists():
            archive.rmdir()
        (data_dir / "archive-unmounted").rename(archive)
    wait_for(lambda: statuses_of(data_dir, ids) == ["parsed", "parsed"], timeout=60)
    assert failed_count(data_dir) == 0


# ---------------------------------------------------------------------------------------------
# RELY-11.3, REINDEX-4.3: commands refuse a store whose archive is not there.


def test_rely_11_3_commands_refuse_a_journal_whose_archive_is_missing(data_dir, tmp_path):
    folded, pending = pending_store(data_dir, tmp_path, count=1)
    before = db_rows(data_dir)
    archive = data_dir / healthlog.ARCHIVE_DIR
    archive.rename(tmp_path / "the-disk")
    export = tmp_path / "export.json"
    export.write_bytes(small_body(5))
    for args in (["import", "--aggregation", "Minutes", export], ["reindex"],
                 ["reindex", "--force"], ["verify"]):
        result = run_cli(*(args[:1] + ["--data", data_dir] + args[1:]))
        assert result.returncode == 2, (args, result.stderr)
        assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr
        assert "lists deliveries but %s is missing or empty" % archive in result.stderr
        assert not archive.exists() and db_rows(data_dir) == before
    shown = run_cli("status", "--data", data_dir)
    assert shown.returncode == 0
    assert "archive: missing or empty while the journal lists deliveries" in shown.stdout
    assert json.loads(run_cli("status", "--data", data_dir, "--json").stdout)[
        "archive_missing"] is True
    (tmp_path / "the-disk").rename(archive)
    assert run_cli("status", "--data", data_dir, "--json").returncode == 0
    assert json.loads(run_cli("status", "--data", data_dir, "--json").stdout)[
        "archive_missing"] is False


def test_rely_11_3_reindex_and_verify_refuse_a_day_folder_that_cannot_be_read(data_dir,
                                                                              tmp_path):
    folded, pending = pending_store(data_dir, tmp_path, count=1)
    [folder] = {(data_dir / delivery_row(data_dir, i)["archive_path"]).parent for i in pending}
    folder.rename(tmp_path / "in-flight")
    before = db_rows(data_dir)
    for command in ("reindex", "verify"):
        result = run_cli(command, "--data", data_dir)
        assert result.returncode == 2, result.stderr
        assert "1 folder of the journal's bodies cannot be read" in result.stderr
        assert "%s changed nothing" % command in result.stderr
    assert db_rows(data_dir) == before


def test_rely_11_5_an_archive_beside_no_database_is_refused(serve_process, data_dir, tmp_path):
    pending_store(data_dir, tmp_path, count=1)
    database = data_dir / healthlog.DB_NAME
    for path in data_dir.glob(healthlog.DB_NAME + "*"):
        path.rename(tmp_path / path.name)
    for args in (["serve", "--token", TOKEN, "--listen", "127.0.0.1:0"], ["import", __file__]):
        result = run_cli(args[0], "--data", data_dir, *args[1:], timeout=60)
        assert result.returncode == 2, result.stderr
        assert "holds an archive of deliveries but no database" in result.stderr
        assert "healthlog reindex --data %s" % data_dir in result.stderr
        assert not database.exists()
    assert run_cli("reindex", "--data", data_dir).returncode == 0  # what the message says
    assert database.exists()


# ---------------------------------------------------------------------------------------------
# RELY-11.4: serve settles the archive at start.


def test_rely_11_4_serve_adopts_orphan_bodies_and_removes_metadata_without_a_body(
        serve_process, data_dir, tmp_path):
    folded, pending = pending_store(data_dir, tmp_path, count=2)
    # What kills leave: a body whose row was never written (the phone got no 200), and a
    # .meta.json whose body was never renamed in.  And a journaled body that went missing,
    # whose metadata must stay.
    orphan_row = delivery_row(data_dir, pending[0])
    orphan = data_dir / orphan_row["archive_path"]
    with sqlite3.connect(str(data_dir / healthlog.DB_NAME)) as conn:
        conn.execute("DELETE FROM delivery WHERE id = ?", (pending[0],))
    conn.close()
    stray = orphan.with_name("20240308T100500.000000Z-0badc0de.meta.json")
    stray.write_text(orphan.with_name(orphan.name[:-5] + ".meta.json").read_text())
    kept_meta = (data_dir / delivery_row(data_dir, pending[1])["archive_path"])
    kept_meta = kept_meta.with_name(kept_meta.name[:-5] + ".meta.json")
    # An orphan years older than the newest journaled body: reindex's, not a start's.
    old_orphan = data_dir / "archive/2020/01/01" / "20200101T000000.000000Z-00000001.json"
    old_orphan.parent.mkdir(parents=True)
    old_orphan.write_bytes(small_body(11))

    proc = serve_process(data_dir)
    adopted = wait_for(lambda: find_records(proc.log_lines(), "archive settled at start"),
                       timeout=30)
    assert (adopted[0]["adopted"], adopted[0]["meta_removed"]) == ("1", "1")
    assert not stray.exists() and kept_meta.exists()
    [again] = db_rows(data_dir, "SELECT * FROM delivery WHERE archive_path = ?",
                      (orphan_row["archive_path"],))
    assert again["received_at"] == orphan_row["received_at"]
    assert again["body_sha256"] == orphan_row["body_sha256"]
    wait_for(lambda: statuses_of(data_dir, [again["id"]]) == ["parsed"], timeout=60)
    assert proc.terminate() == 0
    verified = run_cli("verify", "--data", data_dir)
    assert verified.returncode == 0, verified.stdout
    assert "orphans: 1 archived body without a journal row" in verified.stdout
    assert "orphans adopted: 1\n" in run_cli("reindex", "--data", data_dir).stdout
    assert "orphans" not in run_cli("verify", "--data", data_dir).stdout
