"""`healthlog reindex` against crashes, interrupts and a running serve, on a store big enough
that a rebuild takes seconds: SIGKILL and Ctrl-C at every stage, the data-directory lock, a
verify killed midway.

Split from tests/test_reindex.py (same helpers, imported from there) so that the two run on
different test workers. Names carry the scenario IDs of openspec/specs/reindex/spec.md
(REINDEX-n.m).
"""

import contextlib
import datetime as dt
import io
import json
import signal
import sqlite3
import subprocess
from pathlib import Path

import pytest

import hae_factory as hf
import healthlog
from conftest import (TOKEN, Client, db_rows, live_fingerprint, object_rows, one_line, run_cli,
                      stored_points, wait_folded, wait_for)
from reindex_helpers import (DAY, body_paths, copy_store, headers, journal_facts, module_service,
                             post, printed_fingerprint, pt, start_cli, tables, when)

pytestmark = pytest.mark.usefixtures("json_mode")  # agnostic tests run in one mode only


BIG_DELIVERIES = 24


@pytest.fixture(scope="module")
def big_store(tmp_path_factory, json_mode) -> Path:
    """A store that takes reindex a few seconds: 24 minute-grouped bodies of 2 MB
    (~180k points), folded live."""
    data_dir = tmp_path_factory.mktemp("big") / "data"
    backfill = headers(hf.Automation("Reindex backfill", "Minutes", "Default"))
    with module_service(data_dir) as service:
        client = Client(*service.address)
        for i in range(BIG_DELIVERIES):
            post(client, hf.big_metrics_body(2 << 20, seed=i, start=DAY + dt.timedelta(days=2 * i)),
                 headers=backfill)
        wait_folded(data_dir, timeout=120)
    return data_dir


def wait_rebuilding(data_dir: Path, proc: subprocess.Popen, at_least: int = 2) -> int:
    """Wait until a running reindex has folded ``at_least`` deliveries into its new tables."""

    def folded() -> int:
        assert proc.poll() is None, "reindex finished before it could be interrupted"
        try:
            return db_rows(data_dir, "SELECT count(*) AS n FROM delivery_rebuild"
                                     " WHERE parse_status != 'pending'")[0]["n"] >= at_least
        except sqlite3.Error:  # the table does not exist yet
            return False

    return wait_for(folded, timeout=60, interval=0.01)


def signal_pending(pid: int, signum: int) -> bool:
    """Is ``signum`` sent to the process and not yet taken by it (/proc: SigPnd, ShdPnd)?"""
    bit = 1 << (signum - 1)
    with open("/proc/%d/status" % pid) as status:
        masks = [int(line.split()[1], 16) for line in status
                 if line.startswith(("SigPnd:", "ShdPnd:"))]
    return any(mask & bit for mask in masks)


# ---------------------------------------------------------------------------------------------
# Requirement 1: reindex and serve never share a data directory.

@pytest.mark.json_agnostic
def test_reindex_1_1_reindex_while_serve_runs_is_refused(start_service, data_dir):
    service = start_service()
    post(Client(*service.address), hf.body(("step_count", "count", [pt(when(8), qty=5)])),
         headers=headers())
    wait_folded(data_dir)
    before_journal, before_objects = journal_facts(data_dir), object_rows(data_dir)

    result = run_cli("reindex", "--data", data_dir)

    assert result.returncode == 2
    line = one_line(result.stderr)
    assert "in use" in line and "serve" in line and str(data_dir) in line
    assert result.stdout == ""
    assert journal_facts(data_dir) == before_journal and object_rows(data_dir) == before_objects
    assert tables(data_dir) == {"delivery", "object", "session"}


@pytest.mark.json_agnostic
@pytest.mark.torture  # acts during a long reindex of big_store: with the torture runs
def test_reindex_1_2_serve_and_import_are_refused_while_reindex_runs(big_store, tmp_path):
    data_dir = copy_store(big_store, tmp_path)
    export = tmp_path / "export.json"
    export.write_bytes(hf.body(("step_count", "count", [pt(when(8), qty=5)])))
    reindex = start_cli("reindex", "--data", data_dir)
    try:
        wait_rebuilding(data_dir, reindex)
        serve = run_cli("serve", "--data", data_dir, "--listen", "127.0.0.1:0",
                        "--token", TOKEN, timeout=30)
        imported = run_cli("import", "--data", data_dir, export)
        assert reindex.poll() is None  # both answers came while reindex was running
    finally:
        stdout, stderr = reindex.communicate(timeout=120)

    assert serve.returncode == 2 and "in use" in one_line(serve.stderr)
    assert imported.returncode == 2 and "being reindexed" in one_line(imported.stderr)
    assert imported.stdout == ""
    assert reindex.returncode == 0, stderr
    assert len(body_paths(data_dir)) == BIG_DELIVERIES  # the export was not archived
    assert printed_fingerprint(stdout) == live_fingerprint(big_store)


# ---------------------------------------------------------------------------------------------
# Requirement 5: a crash or Ctrl-C leaves the previous store intact.

@pytest.mark.json_agnostic
@pytest.mark.torture  # kills a process on purpose: with the torture runs (pyproject.toml)
def test_reindex_5_1_sigkill_during_reindex_leaves_the_old_store_and_a_rerun_completes(
        big_store, tmp_path):
    data_dir = copy_store(big_store, tmp_path)
    before_journal, before_objects = journal_facts(data_dir), object_rows(data_dir)
    before = live_fingerprint(data_dir)
    proc = start_cli("reindex", "--data", data_dir)
    try:
        wait_rebuilding(data_dir, proc)
        proc.kill()
    finally:
        proc.communicate(timeout=30)
    assert proc.returncode == -signal.SIGKILL

    assert "delivery_rebuild" in tables(data_dir)  # it really died mid-way
    assert live_fingerprint(data_dir) == before
    assert object_rows(data_dir) == before_objects and journal_facts(data_dir) == before_journal
    status = run_cli("status", "--data", data_dir, "--json")
    assert status.returncode == 0 and json.loads(status.stdout)["fingerprint"] == before
    verified = run_cli("verify", "--data", data_dir)
    assert verified.returncode == 0 and "verify: equal" in verified.stdout, verified.stdout

    rerun = run_cli("reindex", "--data", data_dir)

    assert rerun.returncode == 0, rerun.stderr
    assert printed_fingerprint(rerun.stdout) == before == live_fingerprint(data_dir)
    assert journal_facts(data_dir) == before_journal
    assert tables(data_dir) == {"delivery", "object", "session"}


@pytest.mark.json_agnostic
@pytest.mark.torture  # acts during a long reindex of big_store: with the torture runs
def test_reindex_5_2_ctrl_c_during_reindex_leaves_the_old_store(big_store, tmp_path):
    data_dir = copy_store(big_store, tmp_path)
    before_journal, before_objects = journal_facts(data_dir), object_rows(data_dir)
    proc = start_cli("reindex", "--data", data_dir)
    try:
        wait_rebuilding(data_dir, proc)
        proc.send_signal(signal.SIGINT)
    finally:
        stdout, stderr = proc.communicate(timeout=60)

    assert proc.returncode == 130
    assert "reindex interrupted; the previous store is unchanged" in one_line(stderr.strip())
    assert "fingerprint" not in stdout
    assert object_rows(data_dir) == before_objects and journal_facts(data_dir) == before_journal
    assert tables(data_dir) == {"delivery", "object", "session"}


@pytest.mark.json_agnostic
@pytest.mark.torture  # acts during a long reindex of big_store: with the torture runs
def test_reindex_5_3_delivery_journaled_while_reindex_runs_is_kept_pending(big_store, tmp_path,
                                                                           start_service):
    data_dir = copy_store(big_store, tmp_path)
    payload = hf.body(("step_count", "count", [pt(when(8, m, DAY - dt.timedelta(days=3)), qty=m + 1)
                                            for m in range(3)]))
    hae_headers = {k: v for k, v in headers().items() if k in healthlog.AUTOMATION_HEADERS}
    proc = start_cli("reindex", "--data", data_dir)
    try:
        wait_rebuilding(data_dir, proc)
        # An `import` that looked at the lock just before reindex took it: the same
        # acceptance path, journaling a delivery while the rebuild runs.
        archive = healthlog.Archive(data_dir)
        conn = healthlog.open_database(healthlog.Config(data_dir=data_dir))
        try:
            upload = archive.receive(io.BytesIO(payload).read, len(payload), 1 << 20,
                                     lambda: None)
            late = healthlog.accept_delivery(archive, conn, upload, healthlog.utc_now(),
                                             hae_headers, None)
        finally:
            conn.close()
        assert proc.poll() is None
    finally:
        stdout, stderr = proc.communicate(timeout=120)

    assert proc.returncode == 0, stderr
    assert "deliveries: %d (pending 1, parsed %d," % (BIG_DELIVERIES + 1, BIG_DELIVERIES) \
        in stdout
    assert db_rows(data_dir, "SELECT parse_status FROM delivery WHERE id = ?",
                   (late,))[0]["parse_status"] == "pending"
    assert printed_fingerprint(stdout) == live_fingerprint(big_store)
    start_service()  # the next start folds it
    wait_folded(data_dir)
    assert [p["qty"] for p, d in stored_points(data_dir, "step_count") if d == late] == [1, 2, 3]
    assert run_cli("verify", "--data", data_dir).returncode == 0


@pytest.mark.json_agnostic
@pytest.mark.torture  # acts during a long reindex of big_store: with the torture runs
def test_reindex_5_4_ctrl_c_after_the_swap_does_not_claim_the_old_store_was_kept(big_store,
                                                                                 tmp_path):
    data_dir = copy_store(big_store, tmp_path)
    with contextlib.closing(sqlite3.connect(str(data_dir / healthlog.DB_NAME))) as conn:
        with conn:  # one damaged object: the rebuild differs from the old store
            conn.execute("UPDATE object SET hash = ? WHERE (metric, layer, hour) IN"
                         " (SELECT metric, layer, hour FROM object LIMIT 1)", ("0" * 64,))
    damaged = live_fingerprint(data_dir)
    # A reader (a `status` or `verify` beside it) holds a snapshot, so the checkpoint after the
    # swap waits for it: that is the moment Ctrl-C arrives.
    reader = sqlite3.connect(str(data_dir / healthlog.DB_NAME), isolation_level=None)
    reader.execute("BEGIN")
    reader.execute("SELECT count(*) FROM object").fetchone()
    proc = start_cli("reindex", "--data", data_dir)
    try:
        wait_rebuilding(data_dir, proc)
        wait_for(lambda: proc.poll() is None and "delivery_rebuild" not in tables(data_dir),
                 timeout=60, interval=0.01)
        proc.send_signal(signal.SIGINT)
        # Ctrl-C reaches the process while the reader still holds the checkpoint back.
        wait_for(lambda: not signal_pending(proc.pid, signal.SIGINT),
                 what="reindex takes the SIGINT")
    finally:
        reader.execute("COMMIT")
        reader.close()
        stdout, stderr = proc.communicate(timeout=60)

    assert live_fingerprint(data_dir) == live_fingerprint(big_store) != damaged  # swapped in
    assert "the previous store is unchanged" not in stderr, (proc.returncode, stderr)


# ---------------------------------------------------------------------------------------------
# Requirement 7: a killed verify.

@pytest.mark.json_agnostic
@pytest.mark.torture  # kills a process on purpose: with the torture runs (pyproject.toml)
def test_reindex_7_4_a_killed_verify_leaves_nothing_after_the_next_start(big_store, tmp_path,
                                                                        start_service):
    data_dir = copy_store(big_store, tmp_path)
    proc = start_cli("verify", "--data", data_dir)
    try:
        # Killed while it writes its rebuild (its WAL holds pages), not as it starts.
        wait_for(lambda: [p for p in (data_dir / "tmp").glob("verify-*/" + healthlog.DB_NAME
                                                             + "-wal") if p.stat().st_size],
                 what="verify writes its rebuild")
        assert proc.poll() is None, "verify finished before it could be killed"
        proc.kill()
    finally:
        proc.communicate(timeout=30)
    assert live_fingerprint(data_dir) == live_fingerprint(big_store)

    start_service().stop()

    assert list((data_dir / "tmp").iterdir()) == []


