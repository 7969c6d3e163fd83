"""FOLD-17: a delivery is parsed once (openspec/specs/fold/spec.md).

With orjson, ingest parses a body of up to 4 MiB whole to validate it; that document is
handed to the fold thread instead of reading and parsing the archived copy of the same
bytes again. These tests post the same traffic to a real server with the hand-over and
to one without it, and compare the journals and the stores with each other and with a
``reindex`` from the archive.
"""

import datetime as dt
import subprocess
import sys

import pytest

import hae_factory as hf
import healthlog
from conftest import Client, db_rows, journal_rows, wait_for

# One JSON mode (orjson): only orjson's parse is handed over (FOLD-17); without it there
# is nothing to hand over, and REINDEX-10.3 compares the store both ways.
pytestmark = [pytest.mark.usefixtures("json_mode"), pytest.mark.json_agnostic]

IGNORED = ("id", "folded_at", "journaled_at", "received_at", "archive_path", "attempts")


def traffic() -> list:
    """(headers, body) of two days of the factory's phone: minute pushes that re-send
    their last bucket, Days totals, sleep, workouts, the record sections."""
    return [(p.headers, p.body) for p in hf.week_of_traffic(seed=11, days=2)]


def fold_all(service: healthlog.Service, deliveries: list) -> None:
    """Post each delivery and wait for its fold before the next, so that the hand-over
    never has more than one waiting, however slow the machine."""
    client = Client(*service.address)
    data_dir = service.config.data_dir
    for headers, body in deliveries:
        status, answer = client.ingest(body, headers=headers)
        assert status == 200, answer
        wait_for(lambda: all(r["parse_status"] != "pending" for r in db_rows(data_dir)),
                 timeout=120, what="the delivery folded")


def fingerprint(data_dir) -> str:
    [row] = db_rows(data_dir, "SELECT count(*) AS n FROM object")
    assert row["n"] > 0
    conn = healthlog.connect(data_dir / healthlog.DB_NAME)
    try:
        return healthlog.fingerprint(conn)
    finally:
        conn.close()


def reindexed(data_dir) -> str:
    result = subprocess.run([sys.executable, "-m", "healthlog", "reindex", "--data",
                             str(data_dir)], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    return result.stdout.rsplit("fingerprint: ", 1)[1].strip()


def test_fold_17_1_the_same_store_with_and_without_the_handoff(start_service, tmp_path,
                                                               logs):
    deliveries = traffic()
    handed = start_service(data_dir=tmp_path / "handed")
    fold_all(handed, deliveries)
    handed.stop()
    from_ingest = [r for r in logs.find("delivery folded") if r.get("parsed") == "at ingest"]
    if healthlog._orjson is not None:  # ingest parses whole only with orjson
        assert len(from_ingest) == len(deliveries)
    else:
        assert from_ingest == []
    before = len(logs.find("delivery folded"))
    read_again = start_service(data_dir=tmp_path / "read", handoff_budget=0)
    fold_all(read_again, deliveries)
    read_again.stop()
    assert len(logs.find("delivery folded")) == before + len(deliveries)
    assert [r for r in logs.find("delivery folded")[before:]
            if r.get("parsed") == "at ingest"] == []
    assert (journal_rows(handed.config.data_dir, IGNORED)
            == journal_rows(read_again.config.data_dir, IGNORED))
    live = fingerprint(handed.config.data_dir)
    assert fingerprint(read_again.config.data_dir) == live
    assert reindexed(handed.config.data_dir) == live
    assert reindexed(read_again.config.data_dir) == live


def test_fold_17_2_documents_past_the_budget_are_read_from_the_archive(start_service,
                                                                       tmp_path, logs):
    """Five bodies wait while the fold thread is held; the hand-over keeps the newest
    that fit in its budget and the fold reads the others from the archive, to the same
    store as a server that handed none over."""
    if healthlog._orjson is None:
        pytest.skip("without orjson nothing is handed over")
    day = dt.date(2024, 3, 8)
    bodies = [hf.dumps_hae(hf.metrics_payload(n, ("step_count", "heart_rate"),
                                              day + dt.timedelta(days=n), grouping="Minutes"))
              for n in range(5)]
    budget = healthlog.document_cost(bodies[3]) + healthlog.document_cost(bodies[4])
    headers = {"automation-name": "Budget", "automation-aggregation": "Minutes"}
    held = start_service(paused=True, data_dir=tmp_path / "held", handoff_budget=budget)
    client = Client(*held.address)
    ids = [client.ingest(body, headers=headers)[1]["delivery_id"] for body in bodies]
    held.worker.gate.set()
    data_dir = held.config.data_dir
    wait_for(lambda: all(r["parse_status"] == "parsed" for r in db_rows(data_dir)),
             timeout=60, what="every delivery folded")
    held.stop()
    parsed = {int(r["delivery_id"]): r.get("parsed") for r in logs.find("delivery folded")}
    assert [parsed[i] for i in ids] == [None, None, None, "at ingest", "at ingest"]
    none = start_service(data_dir=tmp_path / "none", handoff_budget=0)
    client = Client(*none.address)
    for body in bodies:
        assert client.ingest(body, headers=headers)[0] == 200
    wait_for(lambda: all(r["parse_status"] == "parsed" for r in db_rows(none.config.data_dir)),
             timeout=60, what="every delivery folded")
    none.stop()
    assert fingerprint(data_dir) == fingerprint(none.config.data_dir)
    assert journal_rows(data_dir, IGNORED) == journal_rows(none.config.data_dir, IGNORED)
