"""`healthlog reindex`, `verify`, `status`, `import` and the fingerprint, end to end.

Stores are made the way users make them: HAE-shaped bodies (tests/hae_factory.py) posted over
HTTP to a real Cheroot server on 127.0.0.1:0 whose live fold thread folds them into a real
SQLite file. The commands then run as real subprocesses (``python3 healthlog.py reindex``
…) on that data directory, beside a running server where the scenario says so; a crash is a
real SIGKILL. Two module fixtures build the larger stores once (a realistic week of traffic,
and a store big enough that reindex takes seconds); tests work on copies.

A delivery that "became visible late" is simulated as ING-4 describes it: it is posted
to a paused server, moved before its successor in the journal by SQL (``received_at``), and
only then folded by the live worker, which therefore folds it after its journal successor.

Names carry the scenario IDs of openspec/specs/reindex/spec.md (REINDEX-n.m).
"""

import contextlib
import datetime as dt
import hashlib
import json
import os
import pty
import re
import select
import shutil
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

import hae_factory as hf
import healthlog
from conftest import (ROOT, Client, assert_no_leaks, db_rows,
                      live_fingerprint, object_rows, parse_logfmt, run_cli, stored_points,
                      wait_folded, wait_for)
from reindex_helpers import (DAY, body_paths, by_path, cli_args, copy_store, headers, journal_facts,
                             module_service, post, printed_fingerprint, pt, tables, when)

# One JSON mode (orjson): a rebuild folds with the live fold's code, which test_fold*.py
# run with and without orjson; REINDEX-10.3 rebuilds the same archive both ways itself.
pytestmark = [pytest.mark.usefixtures("json_mode"), pytest.mark.json_agnostic]

PROGRESS = re.compile(r"reindex: (\d+)/(\d+) deliveries, (\d+\.\d) MB/s, ETA (\S+)")
EMPTY_SHA256 = hashlib.sha256(b"").hexdigest()


# ---------------------------------------------------------------------------------------------
# Running the CLI.

def run_on_terminal(*args, timeout: float = 120) -> tuple:
    """Run the CLI with stderr on a pseudo-terminal: (returncode, stdout, terminal text)."""
    master, slave = pty.openpty()
    proc = subprocess.Popen(cli_args(*args), stdout=subprocess.PIPE, stderr=slave)
    os.close(slave)
    chunks, deadline = [], time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([master], [], [], 0.1)
            if not ready:
                if proc.poll() is not None and not select.select([master], [], [], 0.2)[0]:
                    break
                continue
            try:
                data = os.read(master, 65536)
            except OSError:  # EIO: every writer of the terminal has gone
                break
            if not data:
                break
            chunks.append(data)
        stdout = proc.stdout.read().decode()
        returncode = proc.wait(timeout)
    finally:
        os.close(master)
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()
    return returncode, stdout, b"".join(chunks).decode(errors="replace")


# ---------------------------------------------------------------------------------------------
# Reading a data directory.

def status_counts(data_dir: Path) -> dict:
    counts = dict.fromkeys(healthlog.STATUSES, 0)
    counts.update((r["parse_status"], r["n"]) for r in db_rows(
        data_dir, "SELECT parse_status, count(*) AS n FROM delivery GROUP BY parse_status"))
    return counts


# ---------------------------------------------------------------------------------------------
# Building bodies and journals.

def post_and_fold(start_service, payload: bytes, **kw) -> int:
    """Post one delivery to a running server and let its live worker fold it."""
    service = start_service()
    delivery_id = post(Client(*service.address), payload, **kw)
    wait_folded(service.config.data_dir)
    service.stop()
    return delivery_id


def just_before(data_dir: Path, delivery_id: int) -> str:
    [row] = db_rows(data_dir, "SELECT received_at FROM delivery WHERE id = ?", (delivery_id,))
    moment = healthlog.parse_received_at(row["received_at"]) - dt.timedelta(microseconds=1)
    return healthlog.format_received_at(moment)


def fold_late(start_service, payload: bytes, received_at: str, **kw) -> int:
    """A delivery that became visible late: journaled at ``received_at`` (before deliveries
    that are already folded), then folded by the live worker after them."""
    service = start_service(paused=True)
    data_dir = service.config.data_dir
    delivery_id = post(Client(*service.address), payload, **kw)
    with contextlib.closing(sqlite3.connect(str(data_dir / healthlog.DB_NAME))) as conn:
        with conn:
            conn.execute("UPDATE delivery SET received_at = ? WHERE id = ?",
                         (received_at, delivery_id))
    service.worker.gate.set()
    wait_folded(data_dir)
    service.stop()
    return delivery_id


def _deliveries(week: bool) -> list:
    """(path, headers, body) of realistic traffic in arrival order.

    ``week``: a week of the factory's phone (fast Minutes pushes that re-send their growing
    last bucket, Today totals in Days, Previous-7-Days re-sends in Hours, aggregated sleep,
    Default-grouped raw samples, workouts, the six record sections), a day of the heavier
    phone, and two days of a Berlin phone in 12-hour time across a DST change; else one day
    of the factory's phone and the Berlin phone's day of the DST change. Then what else
    arrives in real life: a retried push with the same bytes, a body with a section this
    version does not know (partial), a body with no readable time (failed), an automation
    known only by its /api/ingest/<name> path whose sparse push inherits its layer, and the
    canary payload.
    """
    berlin = hf.Phone(hf.BERLIN, "12h")  # Europe's autumn DST change, 12-hour clock
    if week:
        pushes = list(hf.week_of_traffic(seed=7))
        pushes += hf.week_of_traffic(seed=3, start=DAY + dt.timedelta(days=14), days=1,
                                     small=False)
        pushes += hf.week_of_traffic(seed=1, start=dt.date(2024, 10, 26), days=2, phone=berlin)
    else:
        pushes = list(hf.week_of_traffic(seed=7, days=1))
        pushes += hf.week_of_traffic(seed=1, start=dt.date(2024, 10, 27), days=1, phone=berlin)
    out = [("/api/ingest", p.headers, p.body) for p in pushes]
    later = DAY + dt.timedelta(days=20)
    retried, partial, failed, canary, scale = [len(out) * k // 6 for k in range(1, 6)]
    extras = {
        retried: [out[retried]],  # HAE retried a push: the same bytes and headers again
        partial: [("/api/ingest", headers(hf.Automation("Reindex partial")),
                   hf.body(("step_count", "count",
                            [pt(when(9, m, later), qty=m + 1) for m in range(3)]),
                           futureSection=[{"date": when(9, 0, later), "mood": "ok"}]))],
        failed: [("/api/ingest", headers(hf.Automation("Reindex broken")),
                  hf.body(("step_count", "count", [{"date": "yesterday", "qty": 3}])))],
        canary: [("/api/ingest", headers(hf.Automation("Reindex canary", "Default", "Default")),
                  hf.dumps_hae(hf.canary_payload(5, later)))],
        scale: [("/api/ingest/scale", {}, hf.body(("weight_body_mass", "kg", [
                    pt(when(7, m, later), qty=74.0 + m / 10) for m in (1, 2, 3)]))),
                ("/api/ingest/scale", {}, hf.body(("weight_body_mass", "kg", [
                    pt(when(7, 30, later + dt.timedelta(days=1)), qty=74.4)])))],
    }
    arrival = []
    for index, delivery in enumerate(out):
        arrival.append(delivery)
        arrival += extras.get(index, [])
    return arrival


def _live_store(data_dir: Path, week: bool) -> Path:
    """A data directory whose live worker folded `_deliveries(week)`, with a backfill
    imported by hand halfway."""
    export = data_dir.parent / "export.json"  # a backfill exported by hand in the app
    export.write_bytes(hf.dumps_hae(hf.metrics_payload(
        9, ("step_count", "heart_rate"), DAY - dt.timedelta(days=30), grouping="Hours")))
    deliveries = _deliveries(week)
    with module_service(data_dir, fold_wake_s=0.2) as service:
        client = Client(*service.address)
        for index, (path, sent_headers, payload) in enumerate(deliveries):
            post(client, payload, path, headers=sent_headers)
            if index == len(deliveries) // 2:
                imported = run_cli("import", "--data", data_dir, "--aggregation", "Hours",
                                   "--name", "manual", export)
                assert imported.returncode == 0, imported.stdout + imported.stderr
        wait_folded(data_dir)
    return data_dir


@pytest.fixture(scope="module")
def week_store(tmp_path_factory, json_mode) -> Path:
    """A week of realistic traffic folded live (REINDEX-2.1 copies it)."""
    return _live_store(tmp_path_factory.mktemp("week") / "data", week=True)


@pytest.fixture(scope="module")
def day_store(tmp_path_factory, json_mode) -> Path:
    """A day of the same traffic, every outcome and kind of delivery in it, folded live:
    the store the tests of a rule about any store copy (a week proves no more there)."""
    return _live_store(tmp_path_factory.mktemp("day") / "data", week=False)


# ---------------------------------------------------------------------------------------------
# Requirement 2: the rebuilt store equals the live one.

def test_reindex_2_1_live_store_equals_the_rebuild_for_realistic_traffic(week_store, tmp_path,
                                                                         start_service):
    data_dir = copy_store(week_store, tmp_path)
    statuses = status_counts(data_dir)
    # the traffic exercised every outcome the worker has
    assert statuses["parsed"] > 300 and statuses["partial"] == 1 and statuses["failed"] == 1
    assert {r["layer"] for r in db_rows(data_dir, "SELECT DISTINCT layer FROM delivery")} >= {
        "minutes", "hours", "days", "default", "record", None}
    assert db_rows(data_dir, "SELECT count(*) AS n FROM delivery"
                             " WHERE error LIKE 'duplicate of delivery %'")[0]["n"] >= 1
    before_journal, before_objects = journal_facts(data_dir), object_rows(data_dir)
    before = live_fingerprint(data_dir)

    service = start_service()  # verify runs beside a running server
    verified = run_cli("verify", "--data", data_dir)
    service.stop()

    assert verified.returncode == 0, verified.stdout
    assert "verify: equal" in verified.stdout
    assert "live:    %d objects" % len(before_objects) in verified.stdout
    assert "rebuilt: %d objects" % len(before_objects) in verified.stdout
    assert printed_fingerprint(verified.stdout) == before

    reindexed = run_cli("reindex", "--data", data_dir)

    assert reindexed.returncode == 0, reindexed.stderr
    assert printed_fingerprint(reindexed.stdout) == before == live_fingerprint(data_dir)
    assert journal_facts(data_dir) == before_journal  # statuses, layers, errors, counters
    assert object_rows(data_dir) == before_objects  # every column, blobs and provenance included
    assert tables(data_dir) == {"delivery", "object", "session"}


def test_reindex_2_2_delivery_folded_after_its_journal_successor_ends_as_the_rebuild(
        start_service, data_dir, logs):
    # B is later in the journal but was folded first; A became visible late.
    b_body = hf.body(("step_count", "count", [pt(when(10, 0), qty=8), pt(when(10, 1), qty=3)]),
                     ("heart_rate", "count/min", [pt(when(10, 0), Avg=70)]))
    a_body = hf.body(("step_count", "count", [pt(when(10, 0), qty=7)]),
                     ("heart_rate", "count/min", [pt(when(10, 0), Min=60, Avg=70, Max=80)]),
                     ("active_energy", "kJ", [pt(when(10, 5), qty=1.5)]))
    b_id = post_and_fold(start_service, b_body, headers=headers())
    a_id = fold_late(start_service, a_body, just_before(data_dir, b_id), headers=headers())

    [warning] = logs.find("delivery folded after a later one", "WARN")
    assert warning["delivery_id"] == str(a_id)
    # Equally complete: the later one in the journal (B) keeps the coordinate although A
    # was folded last. A dominating point (A's heart rate has more content) wins either way.
    assert [(p["qty"], d) for p, d in stored_points(data_dir, "step_count")] == [
        (8, b_id), (3, b_id)]
    assert [(sorted(k for k in p if k != "source"), d)
            for p, d in stored_points(data_dir, "heart_rate")] == [
        (["Avg", "Max", "Min", "date"], a_id)]
    before = live_fingerprint(data_dir)

    verified = run_cli("verify", "--data", data_dir)
    assert verified.returncode == 0 and "verify: equal" in verified.stdout, verified.stdout
    reindexed = run_cli("reindex", "--data", data_dir)
    assert reindexed.returncode == 0 and printed_fingerprint(reindexed.stdout) == before


# ---------------------------------------------------------------------------------------------
# Requirement 3: the archive alone restores the journal and the store.

def test_reindex_3_1_archive_alone_restores_the_same_journal_and_fingerprint(day_store,
                                                                            tmp_path):
    data_dir = copy_store(day_store, tmp_path)
    before_journal, before = journal_facts(data_dir), live_fingerprint(data_dir)
    # The layer of Default-grouped automations came from their automation-aggregation header.
    defaults = {r["archive_path"]: r["layer"] for r in before_journal
                if r["automation_aggregation"] == "Default" and r["layer"] != "record"}
    assert defaults and set(defaults.values()) == {"default"}
    scale = [r for r in before_journal if r["path_name"] == "scale"]
    assert [r["layer"] for r in scale] == ["minutes", "minutes"]  # the second one inherited
    [manual] = [r for r in before_journal if r["path_name"] == "manual"]  # `import`ed
    assert (manual["automation_aggregation"], manual["layer"]) == ("Hours", "hours")
    assert not (data_dir / (healthlog.DB_NAME + "-wal")).exists()  # serve stopped cleanly
    (data_dir / healthlog.DB_NAME).unlink()
    for leftover in data_dir.glob(healthlog.DB_NAME + "-*"):
        leftover.unlink()

    result = run_cli("reindex", "--data", data_dir)

    assert result.returncode == 0, result.stderr
    assert "orphans adopted: %d\n" % len(before_journal) in result.stdout
    assert printed_fingerprint(result.stdout) == before == live_fingerprint(data_dir)
    # receive times, paths, sizes, hashes, HAE headers, path names, statuses, layers,
    # uncovered keys, errors and counters: all of it comes back.  Ids are given anew in
    # journal order, so rows are compared by archive path.
    assert by_path(journal_facts(data_dir)) == by_path(before_journal)


def test_reindex_3_2_orphan_bodies_are_adopted_and_folded(start_service, data_dir):
    service = start_service()
    client = Client(*service.address)
    post(client, hf.body(("step_count", "count", [pt(when(8, m), qty=m + 1) for m in range(3)])),
         headers=headers())
    wait_folded(data_dir)
    # The delivery rows cannot be written (another writer holds the database): the bodies
    # are archived with their .meta.json, answered 500, and become orphans (ING-9).
    raw = hf.Automation("Reindex raw", "Default", "Default")
    blocker = sqlite3.connect(str(data_dir / healthlog.DB_NAME), isolation_level=None)
    blocker.execute("BEGIN IMMEDIATE")
    try:
        orphan_bodies = [
            hf.body(("heart_rate", "count/min", [pt(when(9, m), Avg=60 + m) for m in range(3)])),
            hf.body(("active_energy", "kJ", [pt(when(11, m), qty=m + 0.5) for m in range(3)])),
        ]
        answers = [client.ingest(orphan_bodies[0], headers=headers(raw))[0],
                   client.ingest(orphan_bodies[1], path="/api/ingest/lost")[0]]
    finally:
        blocker.execute("ROLLBACK")
        blocker.close()
    service.stop()
    assert answers == [500, 500]
    orphans = [p for p in body_paths(data_dir)
               if p not in {r["archive_path"] for r in db_rows(data_dir)}]
    assert len(orphans) == 2
    metas = [json.loads((data_dir / p.replace(".json", ".meta.json")).read_text())
             for p in orphans]
    (data_dir / orphans[1].replace(".json", ".meta.json")).unlink()  # the second lost its meta

    checked = run_cli("verify", "--data", data_dir)
    assert checked.returncode == 0
    assert "orphans: 2 archived bodies without a journal row" in checked.stdout
    assert len(db_rows(data_dir)) == 1  # verify adopted nothing

    # a file dropped into the archive by hand: no .meta.json and no receive time in its name
    stray = data_dir / "archive" / "2024" / "03" / "08" / "export.json"
    stray.parent.mkdir(parents=True, exist_ok=True)
    stray.write_bytes(orphan_bodies[1])

    result = run_cli("reindex", "--data", data_dir)

    assert result.returncode == 0, result.stderr
    assert "orphans adopted: 2\n" in result.stdout
    [warning] = [r for r in map(parse_logfmt, result.stderr.splitlines())
                 if r.get("msg") == "archived file without a receive time was not adopted"]
    assert (warning["level"], warning["archive_path"]) == ("WARN", "archive/2024/03/08/export.json")
    assert "archive/2024/03/08/export.json" not in {r["archive_path"] for r in db_rows(data_dir)}
    rows = {r["archive_path"]: r for r in db_rows(data_dir)}
    with_meta, without_meta = rows[orphans[0]], rows[orphans[1]]
    # received_at and HAE's headers from .meta.json: the Default header decided the layer
    assert with_meta["received_at"] == metas[0]["received_at"]
    assert (with_meta["automation_name"], with_meta["automation_aggregation"]) == (
        "Reindex raw", "Default")
    assert (with_meta["parse_status"], with_meta["layer"]) == ("parsed", "default")
    # without one, received_at comes from the file name; the layer is inferred
    assert without_meta["received_at"] == metas[1]["received_at"] == \
        healthlog.received_at_from_name(Path(orphans[1]).name)
    assert without_meta["path_name"] is None and without_meta["automation_id"] is None
    assert (without_meta["parse_status"], without_meta["layer"]) == ("parsed", "minutes")
    assert [p["Avg"] for p, _ in stored_points(data_dir, "heart_rate")] == [60, 61, 62]
    assert [p["qty"] for p, _ in stored_points(data_dir, "active_energy")] == [0.5, 1.5, 2.5]
    assert run_cli("verify", "--data", data_dir).returncode == 0


def test_reindex_3_3_missing_body_is_reported_and_the_rest_proceeds(start_service, data_dir):
    service = start_service()
    client = Client(*service.address)
    lost = post(client, hf.body(("step_count", "count", [pt(when(8, m), qty=m + 1)
                                                       for m in range(3)])), headers=headers())
    kept = post(client, hf.body(("heart_rate", "count/min", [pt(when(9, m), Avg=60 + m)
                                                           for m in range(3)])), headers=headers())
    wait_folded(data_dir)
    service.stop()
    [row] = db_rows(data_dir, "SELECT archive_path FROM delivery WHERE id = ?", (lost,))
    (data_dir / row["archive_path"]).unlink()

    checked = run_cli("verify", "--data", data_dir)
    assert checked.returncode == 1
    assert ("differs: metric=step_count layer=minutes hour=2024-03-08T08:00:00Z live=%s"
            " rebuilt=absent" % db_rows(data_dir, "SELECT hash FROM object WHERE metric ="
                                                  " 'step_count'")[0]["hash"][:12]
            in checked.stdout)

    result = run_cli("reindex", "--data", data_dir)

    assert result.returncode == 0, result.stderr
    assert "bodies missing: 1\n" in result.stdout
    assert "deliveries: 2 (pending 0, parsed 1, partial 0, failed 1)" in result.stdout
    rows = {r["id"]: r for r in db_rows(data_dir)}
    assert (rows[lost]["parse_status"], rows[lost]["error"], rows[lost]["layer"],
            rows[lost]["points"]) == ("failed", "body_missing", None, None)
    assert (rows[kept]["parse_status"], rows[kept]["error"]) == ("parsed", None)
    assert stored_points(data_dir, "step_count") == []
    assert [p["Avg"] for p, _ in stored_points(data_dir, "heart_rate")] == [60, 61, 62]
    assert run_cli("verify", "--data", data_dir).returncode == 0


# ---------------------------------------------------------------------------------------------
# Requirement 4: every delivery, failed ones included, is folded again in journal order.

def test_reindex_4_1_reindex_folds_failed_deliveries_again_in_journal_order(start_service,
                                                                            data_dir, logs,
                                                                            monkeypatch):
    # An automation known by its path only. Its sparse push (one point) inherits the layer of
    # the dense push before it in the journal, but that one became visible late: the live
    # worker folded the sparse push first, could not place it, and marked it failed.
    dense = hf.body(("weight_body_mass", "kg", [pt(when(10, m), qty=74 + m / 10) for m in (1, 2,
                                                                                           3)]))
    sparse = hf.body(("weight_body_mass", "kg", [pt(when(11, 5), qty=74.5)]))
    sparse_id = post_and_fold(start_service, sparse, path="/api/ingest/scale")
    dense_id = fold_late(start_service, dense, just_before(data_dir, sparse_id),
                         path="/api/ingest/scale")
    rows = {r["id"]: r for r in db_rows(data_dir)}
    assert (rows[sparse_id]["parse_status"], rows[sparse_id]["error"]) == (
        "failed", "layer_not_inferable")
    assert rows[dense_id]["parse_status"] == "parsed"
    passes = []  # the real passes of the live worker, counted as they end
    run_pass = healthlog.FoldWorker.run_pass
    monkeypatch.setattr(healthlog.FoldWorker, "run_pass", lambda worker, engine: (
        run_pass(worker, engine), passes.append(1))[0])
    service = start_service(fold_wake_s=0.05)  # the worker never picks a failed one up again
    wait_for(lambda: len(passes) >= 3, what="three passes of the live worker")
    service.stop()
    assert db_rows(data_dir, "SELECT parse_status FROM delivery WHERE id = ?",
                   (sparse_id,))[0]["parse_status"] == "failed"
    checked = run_cli("verify", "--data", data_dir)
    assert checked.returncode == 1
    assert "differs: metric=weight_body_mass layer=minutes hour=2024-03-08T11:00:00Z" \
        " live=absent" in checked.stdout

    result = run_cli("reindex", "--data", data_dir)

    assert result.returncode == 0, result.stderr
    row = db_rows(data_dir, "SELECT * FROM delivery WHERE id = ?", (sparse_id,))[0]
    assert (row["parse_status"], row["layer"], row["error"]) == ("parsed", "minutes", None)
    assert [p["qty"] for p, _ in stored_points(data_dir, "weight_body_mass")] == [
        74.1, 74.2, 74.3, 74.5]
    # the rebuild folds in journal order by construction: no out-of-order or lag WARN
    assert "after a later one" not in result.stderr and "waited longer" not in result.stderr
    assert "level=WARN" not in result.stderr
    assert run_cli("verify", "--data", data_dir).returncode == 0


def test_reindex_4_2_a_rebuild_that_would_lose_folded_deliveries_is_not_swapped_in(day_store,
                                                                                  tmp_path):
    data_dir = copy_store(day_store, tmp_path)
    before_journal, before = journal_facts(data_dir), live_fingerprint(data_dir)
    shutil.copytree(str(data_dir / "archive"), str(tmp_path / "intact"))
    for archived in healthlog.archive_bodies(data_dir):  # a disk that gives back damaged files
        (data_dir / archived).write_bytes(b"\0" * 64)

    refused = run_cli("reindex", "--data", data_dir)

    assert refused.returncode == 1
    assert "nothing was replaced" in refused.stderr and refused.stderr.count("\n") == 1
    assert "Traceback" not in refused.stderr
    assert live_fingerprint(data_dir) == before and journal_facts(data_dir) == before_journal
    assert not {"delivery_rebuild", "object_rebuild"} & tables(data_dir)

    forced = run_cli("reindex", "--data", data_dir, "--force")

    assert forced.returncode == 0
    assert status_counts(data_dir)["failed"] == len(before_journal)
    shutil.rmtree(str(data_dir / "archive"))
    shutil.move(str(tmp_path / "intact"), str(data_dir / "archive"))
    healed = run_cli("reindex", "--data", data_dir)
    assert healed.returncode == 0 and printed_fingerprint(healed.stdout) == before


def test_reindex_4_3_an_archive_that_is_not_mounted_is_refused_even_forced(day_store,
                                                                           tmp_path):
    data_dir = copy_store(day_store, tmp_path)
    before_journal, before = journal_facts(data_dir), live_fingerprint(data_dir)
    shutil.move(str(data_dir / "archive"), str(tmp_path / "unmounted"))
    (data_dir / "archive").mkdir()  # the mount point of a disk that is not mounted

    for args in ((), ("--force",)):
        refused = run_cli("reindex", "--data", data_dir, *args)
        assert refused.returncode == 2 and refused.stderr.count("\n") == 1, refused.stderr
        assert "is missing or empty: is the disk that holds it mounted?" in refused.stderr
        assert live_fingerprint(data_dir) == before and journal_facts(data_dir) == before_journal
        assert not {"delivery_rebuild", "object_rebuild"} & tables(data_dir)
        assert list((data_dir / "archive").iterdir()) == []


# ---------------------------------------------------------------------------------------------
# Requirement 6: progress on a terminal, a summary at the end.

def test_reindex_6_1_progress_on_a_terminal_and_a_summary(day_store, tmp_path):
    data_dir = copy_store(day_store, tmp_path)
    counts = status_counts(data_dir)
    total = sum(counts.values())
    [sums] = db_rows(data_dir, "SELECT count(*) AS objects, sum(points) AS points FROM object")

    returncode, stdout, terminal = run_on_terminal("reindex", "--data", data_dir)

    assert returncode == 0, terminal
    progress = PROGRESS.findall(terminal)
    assert progress, terminal
    assert progress[-1][:2] == (str(total), str(total)) and progress[-1][3] == "0s"
    assert all(int(done) <= total for done, *_ in progress)
    assert stdout.splitlines()[:5] == [
        "deliveries: %d (%s)" % (total, ", ".join("%s %d" % kv for kv in counts.items())),
        "orphans adopted: 0",
        "bodies missing: 0",
        "objects: %d" % sums["objects"],
        "points: %d" % sums["points"],
    ]
    cores = len(os.sched_getaffinity(0))  # the default --jobs: the cores it may use
    assert re.search(r"^folded: %d deliveries in [\d.]+ s, %d jobs? \(\d+ deliveries/s,"
                     r" [\d.]+ MB/s, \d+ points/s\)$" % (total, cores), stdout, re.M)
    assert printed_fingerprint(stdout) == live_fingerprint(data_dir)
    assert_no_leaks(terminal.splitlines())


def test_reindex_6_2_no_progress_when_stderr_is_not_a_terminal(day_store, tmp_path):
    data_dir = copy_store(day_store, tmp_path)

    result = run_cli("reindex", "--data", data_dir)

    assert result.returncode == 0
    assert not PROGRESS.search(result.stderr) and "\r" not in result.stderr
    assert result.stderr == ""


# ---------------------------------------------------------------------------------------------
# Requirement 7: verify compares without changing anything.

def test_reindex_7_1_verify_beside_serve_changes_nothing_and_skips_pending(day_store, tmp_path,
                                                                           start_service):
    data_dir = copy_store(day_store, tmp_path)
    service = start_service(data_dir=data_dir, paused=True)
    post(Client(*service.address), hf.body(("step_count", "count", [pt(when(6), qty=1)])),
         headers=headers())
    before_journal, before_objects = journal_facts(data_dir), object_rows(data_dir)

    result = run_cli("verify", "--data", data_dir)

    assert result.returncode == 0, result.stdout
    assert "verify: equal" in result.stdout
    assert "not compared: 1 delivery still pending" in result.stdout
    assert printed_fingerprint(result.stdout) == live_fingerprint(data_dir)
    assert journal_facts(data_dir) == before_journal and object_rows(data_dir) == before_objects
    assert tables(data_dir) == {"delivery", "object", "session"}
    assert list((data_dir / "tmp").iterdir()) == []  # its scratch database is gone
    service.worker.gate.set()  # and the server goes on folding
    wait_folded(data_dir)


def test_reindex_7_2_verify_names_up_to_20_differing_objects_and_reindex_heals(start_service,
                                                                               data_dir):
    # The merge rule's residual: A {qty:10, Min:5} (1), C {qty:11} (2), B {qty:10} (3) ends as B
    # in journal order but as C when B is folded before C. 25 hours, one point each.
    hours = range(25)

    def hourly(**values) -> bytes:
        return hf.body(("step_count", "count", [pt(when(h % 24, 0, DAY + dt.timedelta(h // 24)),
                                                 **values) for h in hours]))

    service = start_service()
    client = Client(*service.address)
    post(client, hourly(qty=10, Min=5), headers=headers())
    wait_folded(data_dir)
    b_id = post(client, hourly(qty=10), headers=headers())
    wait_folded(data_dir)
    service.stop()
    c_id = fold_late(start_service, hourly(qty=11), just_before(data_dir, b_id),
                     headers=headers())
    assert {d for _, d in stored_points(data_dir, "step_count")} == {c_id}

    result = run_cli("verify", "--data", data_dir)

    assert result.returncode == 1
    differs = [line for line in result.stdout.splitlines() if line.startswith("differs: ")]
    assert len(differs) == 21 and differs[-1] == "differs: … and 5 more"
    midnight = dt.datetime.combine(DAY, dt.time(), dt.timezone.utc)
    for hour, line in zip(hours, differs[:20]):
        assert line.startswith("differs: metric=step_count layer=minutes hour=%s live=" % (
            midnight + dt.timedelta(hours=hour)).strftime("%Y-%m-%dT%H:%M:%SZ"))
    assert "verify: 25 objects differ" in result.stdout
    assert printed_fingerprint(result.stdout) == live_fingerprint(data_dir)

    healed = run_cli("reindex", "--data", data_dir)
    assert healed.returncode == 0
    assert {(p["qty"], "Min" in p, d) for p, d in stored_points(data_dir, "step_count")} == {
        (10, False, b_id)}
    assert run_cli("verify", "--data", data_dir).returncode == 0


def test_reindex_7_3_verify_works_in_a_directory_restored_from_the_archive_alone(day_store,
                                                                                tmp_path):
    data_dir = tmp_path / "restored"
    data_dir.mkdir(mode=0o700)
    shutil.copytree(str(day_store / "archive"), str(data_dir / "archive"))
    reindexed = run_cli("reindex", "--data", data_dir)
    assert reindexed.returncode == 0, reindexed.stderr
    assert printed_fingerprint(reindexed.stdout) == live_fingerprint(day_store)

    result = run_cli("verify", "--data", data_dir)

    assert "Traceback" not in result.stderr, result.stderr
    assert result.returncode == 0 and "verify: equal" in result.stdout


# ---------------------------------------------------------------------------------------------
# Requirement 8: status.

def test_reindex_8_1_status_reports_journal_store_and_sizes_beside_serve(day_store, tmp_path,
                                                                         start_service):
    data_dir = copy_store(day_store, tmp_path)
    service = start_service(data_dir=data_dir, paused=True)
    waiting = post(Client(*service.address), hf.body(("step_count", "count", [pt(when(6), qty=1)])),
                   headers=headers())
    [row] = db_rows(data_dir, "SELECT received_at FROM delivery WHERE id = ?", (waiting,))
    [sums] = db_rows(data_dir, "SELECT count(*) AS objects, sum(points) AS points FROM object")
    bodies = body_paths(data_dir)

    as_json = run_cli("status", "--data", data_dir, "--json")
    after = healthlog.utc_now()
    as_text = run_cli("status", "--data", data_dir)

    assert as_json.returncode == 0 and as_text.returncode == 0
    status = json.loads(as_json.stdout)
    counts = status_counts(data_dir)
    assert status["deliveries"] == counts and counts["pending"] == 1
    assert status["backlog"] == 1 and status["oldest_pending"] == row["received_at"]
    # Bracketed by the delivery's receipt and the test's reading of the clock after
    # `status` (and the figure's rounding to 0.1 s), not a band of seconds.
    waited_s = (after - healthlog.parse_received_at(row["received_at"])).total_seconds()
    assert 0 <= status["oldest_pending_age_s"] <= waited_s + 0.05
    assert status["last_delivery"] == row["received_at"]
    assert (status["objects"], status["points"]) == (sums["objects"], sums["points"])
    assert status["archive_files"] == len(bodies)
    assert status["archive_bytes"] == sum((data_dir / p).stat().st_size for p in bodies)
    assert status["database_bytes"] >= (data_dir / healthlog.DB_NAME).stat().st_size > 0
    assert status["fingerprint"] == live_fingerprint(data_dir)
    text = as_text.stdout
    assert "deliveries: %d (%s)" % (sum(counts.values()), ", ".join(
        "%s %d" % kv for kv in counts.items())) in text
    assert re.search(r"^backlog: 1 \(oldest pending \d+s ago\)$", text, re.M)
    assert "last delivery: %s" % row["received_at"] in text
    assert "objects: %d\npoints: %d\n" % (sums["objects"], sums["points"]) in text
    assert re.search(r"^archive: %d bodies, [\d.]+ MiB$" % len(bodies), text, re.M)
    assert re.search(r"^database: [\d.]+ (KiB|MiB)$", text, re.M)
    assert printed_fingerprint(text) == status["fingerprint"]


def test_reindex_8_3_status_says_in_one_line_whether_everything_received_is_folded(
        start_service, data_dir):
    service = start_service(paused=True)
    client = Client(*service.address)

    def status() -> tuple:
        as_json = run_cli("status", "--data", data_dir, "--json")
        as_text = run_cli("status", "--data", data_dir)
        assert as_json.returncode == as_text.returncode == 0, as_json.stderr + as_text.stderr
        lines = as_text.stdout.splitlines()
        assert lines[0] == "data: %s" % data_dir
        return json.loads(as_json.stdout), lines[1]

    reply, line = status()
    assert (reply["all_folded"], reply["folded"], line) == (
        True, "nothing received yet", "nothing received yet")

    before = dt.datetime.now(dt.timezone.utc)
    for hour in (6, 7):
        post(client, hf.body(("step_count", "count", [pt(when(hour, m), qty=m) for m in range(3)])),
             headers=headers())
    lonely = hf.Automation("Lonely push", "Minutes")  # one point, no grouping: it fails
    post(client, hf.body(("step_count", "count", [pt(when(9), qty=1)])),
         headers=headers(lonely, aggregation=False))
    rows = db_rows(data_dir)
    assert [r["parse_status"] for r in rows] == ["pending"] * 3
    reply, line = status()
    after = dt.datetime.now(dt.timezone.utc)
    oldest = min(dt.datetime.fromisoformat(r["received_at"].replace("Z", "+00:00"))
                 for r in rows)
    waited = re.fullmatch(r"3 deliveries waiting to be folded \(oldest (\d+)s\)", line)
    assert waited, line
    assert (oldest - before).total_seconds() >= -1  # the oldest is one of these three
    assert 0 <= int(waited.group(1)) <= (after - oldest).total_seconds() + 1
    assert reply["all_folded"] is False  # the same words (two runs: the age may differ)
    assert re.fullmatch(r"3 deliveries waiting to be folded \(oldest \d+s\)", reply["folded"])

    service.worker.gate.set()
    wait_folded(data_dir)
    assert [r["parse_status"] for r in db_rows(data_dir)] == ["parsed", "parsed", "failed"]
    reply, line = status()
    assert line == "all 3 deliveries folded, 1 of them failed"
    assert (reply["all_folded"], reply["folded"]) == (True, line)


# ---------------------------------------------------------------------------------------------
# Requirement 9: import goes through the ingest path.

def test_reindex_9_1_import_beside_serve_is_folded_by_the_running_worker(start_service,
                                                                         data_dir, tmp_path,
                                                                         logs):
    service = start_service(fold_wake_s=0.2)
    exports = []
    for day in range(2):
        export = tmp_path / ("export-%d.json" % day)
        export.write_bytes(hf.dumps_hae(hf.metrics_payload(
            day, ("step_count", "heart_rate"), DAY + dt.timedelta(days=day), grouping="Hours")))
        exports.append(export)

    result = run_cli("import", "--data", data_dir, "--aggregation", "Hours", "--name", "manual",
                     *exports)

    assert result.returncode == 0, result.stderr
    ids = [int(m) for m in re.findall(r"^accepted .+: delivery (\d+)$", result.stdout, re.M)]
    assert result.stdout.splitlines() == ["accepted %s: delivery %d" % (e, i)
                                          for e, i in zip(exports, ids)]
    wait_folded(data_dir)  # nobody woke the worker: its periodic wake-up found them
    rows = {r["id"]: r for r in db_rows(data_dir)}
    for delivery_id, export in zip(ids, exports):
        row = rows[delivery_id]
        assert (row["parse_status"], row["layer"], row["automation_aggregation"],
                row["path_name"]) == ("parsed", "hours", "Hours", "manual")
        assert (data_dir / row["archive_path"]).read_bytes() == export.read_bytes()
        meta = json.loads((data_dir / row["archive_path"].replace(".json", ".meta.json"))
                          .read_text())
        assert meta["imported_from"] == export.name and meta["path_name"] == "manual"
        assert meta["headers"] == {"automation-aggregation": "Hours"}
        assert meta["received_at"] == row["received_at"]
    # The server's worker folded them (it logs just after its commit: wait for the record).
    wait_for(lambda: {r["delivery_id"] for r in logs.find("delivery folded", "INFO")}
             == {str(i) for i in ids})
    assert service.worker.state in ("idle", "folding")


def test_reindex_9_2_import_validates_like_http_ingest(start_service, data_dir, tmp_path):
    bad = {
        "text.json": b"hello",
        "trailing.json": b'{"data": {"metrics": []}} and more',
        "array.json": b"[1, 2]",
        "no-data.json": b'{"metrics": []}',
        "data-array.json": b'{"data": []}',
        "nan.json": b'{"data": {"metrics": [{"name": "x", "data": [{"qty": NaN}]}]}}',
        "latin1.json": '{"data": {"note": "café"}}'.encode("latin-1"),
    }
    service = start_service(paused=True)
    client = Client(*service.address)
    expected = {}
    for name, payload in bad.items():
        (tmp_path / name).write_bytes(payload)
        status, answer = client.ingest(payload)
        assert status == 400
        expected[str(tmp_path / name)] = answer["error"]["message"]
    too_big = tmp_path / "year.json"
    with open(str(too_big), "wb") as handle:
        handle.truncate((512 << 20) + 1)  # sparse: nothing is read before the size check
    expected[str(too_big)] = "larger than 512 MiB, too big to fold; export shorter date ranges"
    missing = tmp_path / "missing.json"
    expected[str(missing)] = "cannot read the file (No such file or directory)"
    good = tmp_path / "good.json"
    good.write_bytes(hf.body(("step_count", "count", [pt(when(8, m),
                                                         qty=m + 1) for m in range(3)])))

    result = run_cli("import", "--data", data_dir, *(list(expected) + [good]))

    assert result.returncode == 2
    reasons = dict(re.findall(r"^rejected (.+?): (.+)$", result.stdout, re.M))
    assert reasons == expected
    [accepted] = re.findall(r"^accepted %s: delivery (\d+)$" % re.escape(str(good)),
                            result.stdout, re.M)
    assert [r["id"] for r in db_rows(data_dir)] == [int(accepted)]
    assert len(body_paths(data_dir)) == 1
    assert list((data_dir / "tmp").iterdir()) == []


def test_reindex_9_3_import_without_serve_is_folded_at_the_next_start(start_service, data_dir,
                                                                       tmp_path):
    export = tmp_path / "export.json"
    export.write_bytes(hf.body(("step_count", "count", [pt(when(8, m), qty=m + 1)
                                                      for m in range(3)])))

    result = run_cli("import", "--data", data_dir, export)

    assert result.returncode == 0
    [delivery_id] = [int(i) for i in re.findall(r"delivery (\d+)$", result.stdout, re.M)]
    assert db_rows(data_dir, "SELECT parse_status FROM delivery")[0]["parse_status"] == "pending"
    start_service()
    wait_folded(data_dir)
    [row] = db_rows(data_dir)
    assert (row["id"], row["parse_status"], row["layer"]) == (delivery_id, "parsed", "minutes")


def test_reindex_7_5_verify_rebuilds_a_delivery_requeued_at_start(day_store, tmp_path):
    # A row set back to pending at start (a newer parser covers its sections) still has
    # its objects in the live store: verify must rebuild it too, not call them extra.
    data_dir = copy_store(day_store, tmp_path)
    with contextlib.closing(sqlite3.connect(str(data_dir / healthlog.DB_NAME))) as conn:
        with conn:
            conn.execute("UPDATE delivery SET parse_status = 'pending' WHERE id ="
                         " (SELECT min(id) FROM delivery WHERE parse_status = 'parsed')")

    result = run_cli("verify", "--data", data_dir)

    assert result.returncode == 0, result.stdout
    assert "verify: equal" in result.stdout and "not compared" not in result.stdout


def test_reindex_9_4_an_old_export_does_not_take_the_place_of_newer_pushed_values(
        start_service, data_dir, tmp_path):
    # The export was made in the morning (its file time); the phone pushed the day's final
    # total in the evening. Equally complete points: the later journal position wins, and
    # the import's position is its file time, not the moment it was imported.
    export = tmp_path / "morning-export.json"
    export.write_bytes(hf.body(("step_count", "count", [pt(when(8, 0), qty=5000)])))
    morning = time.time() - 3600
    os.utime(str(export), (morning, morning))
    service = start_service(fold_wake_s=0.1)  # the import is folded on the next wake
    client = Client(*service.address)
    post(client, hf.body(("step_count", "count", [pt(when(8, 0), qty=12345)])), headers=headers())
    wait_folded(data_dir)

    result = run_cli("import", "--data", data_dir, "--aggregation", "Minutes", export)

    assert result.returncode == 0, result.stderr
    wait_folded(data_dir)
    assert [p["qty"] for p, _ in stored_points(data_dir, "step_count")] == [12345]
    imported = db_rows(data_dir, "SELECT received_at, journaled_at FROM delivery"
                                 " ORDER BY id")[-1]
    assert imported["received_at"] < imported["journaled_at"]
    service.stop()
    assert run_cli("verify", "--data", data_dir).returncode == 0


# ---------------------------------------------------------------------------------------------
# Requirement 10: one fingerprint everywhere.

def test_reindex_10_1_fingerprint_is_sha256_of_sorted_object_keys_and_hashes(day_store,
                                                                            tmp_path):
    data_dir = copy_store(day_store, tmp_path)
    rows = db_rows(data_dir, "SELECT metric, layer, hour, hash FROM object")
    expected = hashlib.sha256("".join(
        "%s\x1f%s\x1f%d\x1f%s\n" % (r["metric"], r["layer"], r["hour"], r["hash"])
        for r in sorted(rows, key=lambda r: (r["metric"], r["layer"], r["hour"]))
    ).encode()).hexdigest()

    status = run_cli("status", "--data", data_dir)
    verified = run_cli("verify", "--data", data_dir)
    reindexed = run_cli("reindex", "--data", data_dir)

    assert [printed_fingerprint(r.stdout) for r in (status, verified, reindexed)] == [
        expected] * 3
    assert json.loads(run_cli("status", "--data", data_dir, "--json").stdout)[
        "fingerprint"] == expected


def test_reindex_10_3_the_same_archive_gives_the_same_fingerprint_with_and_without_orjson(
        day_store, tmp_path):
    pytest.importorskip("orjson")
    hidden = tmp_path / "no-orjson"
    hidden.mkdir()
    (hidden / "orjson.py").write_text('raise ImportError("hidden")\n')
    modes = {"orjson": "", "stdlib": str(hidden)}
    printed = {}
    for mode, path in modes.items():
        data_dir = copy_store(day_store, tmp_path / mode)
        probe = "import healthlog; print(healthlog._orjson is not None)"
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (path, str(ROOT)) if p))
        uses = subprocess.run([sys.executable, "-c", probe], cwd=str(ROOT), env=env,
                              capture_output=True, text=True, check=True).stdout.strip()
        assert uses == str(mode == "orjson")
        result = subprocess.run(cli_args("reindex", "--data", data_dir), env=env,
                                capture_output=True, text=True, timeout=120)
        assert result.returncode == 0, result.stderr
        printed[mode] = printed_fingerprint(result.stdout)
    assert printed == dict.fromkeys(modes, live_fingerprint(day_store))


def test_reindex_10_2_fingerprint_of_an_empty_store_and_of_one_changed_object(start_service,
                                                                             data_dir):
    start_service().stop()
    status = run_cli("status", "--data", data_dir)
    assert printed_fingerprint(status.stdout) == EMPTY_SHA256

    post_and_fold(start_service, hf.body(("step_count", "count", [pt(when(8, m), qty=m + 1)
                                                               for m in range(3)])),
                  headers=headers())
    before = printed_fingerprint(run_cli("status", "--data", data_dir).stdout)
    assert before != EMPTY_SHA256
    with contextlib.closing(sqlite3.connect(str(data_dir / healthlog.DB_NAME))) as conn:
        with conn:
            conn.execute("UPDATE object SET hash = ? WHERE metric = 'step_count'", ("0" * 64,))
    after = printed_fingerprint(run_cli("status", "--data", data_dir).stdout)
    assert after not in (before, EMPTY_SHA256)
    checked = run_cli("verify", "--data", data_dir)
    assert checked.returncode == 1 and "live=000000000000" in checked.stdout


def test_reindex_2_3_a_delivery_the_live_fold_fails_fails_alike_in_a_rebuild(start_service,
                                                                            data_dir):
    plain = hf.body(("step_count", "count", [pt(when(10, m), qty=m + 1) for m in range(3)]))
    nest = b"[" * 700 + b"]" * 700  # valid JSON, deeper than the fold's recursion reaches
    deep = hf.body(("step_count", "count", [pt(when(11, 0), qty=4)])).replace(
        b'"qty" :', b'"nest" : ' + nest + b',\n"qty" :', 1)
    assert deep.count(b"[") > 700
    first = post_and_fold(start_service, plain, headers=headers())
    second = post_and_fold(start_service, deep, headers=headers())
    rows = {row["id"]: row for row in db_rows(data_dir)}
    assert (rows[first]["parse_status"], rows[second]["parse_status"],
            rows[second]["error"]) == ("parsed", "failed", "nesting_too_deep")
    before, fingerprint = journal_facts(data_dir), live_fingerprint(data_dir)

    checked = run_cli("verify", "--data", data_dir)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    rebuilt = run_cli("reindex", "--data", data_dir)

    assert rebuilt.returncode == 0, rebuilt.stderr
    assert journal_facts(data_dir) == before and live_fingerprint(data_dir) == fingerprint
