"""Hypothesis properties of the merge rule, through the real fold on real SQLite files.

Each example journals random HAE-shaped deliveries through the ingest path
(``accept_delivery``: archive + journal) into a fresh data directory and folds them
with the worker's own ``FoldEngine``/``FoldWorker`` code.  Points come from a small
coordinate domain so deliveries overlap, with random subsets of fields, empty values
(0, null, ""), booleans, and last-digit jitter.
"""

import datetime as dt
import io
import json
import random
import sqlite3
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import healthlog
from fold_helpers import DirectStore


# One JSON mode (conftest's json_agnostic): these are properties of the merge and of a
# rebuild, whose JSON library's part test_merge and REINDEX-10.3 check both ways.
pytestmark = [pytest.mark.usefixtures("json_mode"), pytest.mark.json_agnostic]

SETTINGS = settings(max_examples=40, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow])
T0 = dt.datetime(2026, 11, 1, tzinfo=dt.timezone.utc)
HEADERS = {"automation-aggregation": "Minutes", "automation-id": "AUTO-1"}

FIELDS = {
    "qty": st.sampled_from([0, 0.0, None, 5, 5.000000000000001, 7.25, 12.5]),
    "Min": st.sampled_from([0, None, 3, 4.5]),
    "Max": st.sampled_from([0, "", 9, 11.75]),
    "context": st.sampled_from(["", "Active", "Resting"]),
    "isIndoor": st.sampled_from([False, True, 0]),
}
SOURCES = st.sampled_from([None, "", "Apple Watch", "Apple Watch|iPhone"])


@st.composite
def points(draw):
    minute = draw(st.integers(0, 4))
    keys = draw(st.lists(st.sampled_from(sorted(FIELDS)), unique=True, max_size=4))
    point = {"date": "2026-11-01 10:%02d:00 +0000" % minute}
    for key in keys:
        point[key] = draw(FIELDS[key])
    source = draw(SOURCES)
    if source is not None:
        point["source"] = source
    items = list(point.items())
    random.Random(draw(st.integers(0, 999))).shuffle(items)  # key order is not stable
    return dict(items)


deliveries = st.lists(st.lists(points(), min_size=1, max_size=6), min_size=1, max_size=6)


def heart_rate_body(pts: list) -> bytes:
    return json.dumps({"data": {"metrics": [{"name": "heart_rate", "units": "count/min",
                                             "data": pts}]}}).encode()


def fresh_store(tmp: str, name: str) -> DirectStore:
    """A fresh data directory ``tmp/name``: deliveries received ``seconds`` after T0, with
    HEADERS."""
    return DirectStore(Path(tmp) / name, T0, HEADERS)


@SETTINGS
@given(deliveries)
def test_property_folding_a_delivery_twice_changes_nothing(batch):
    """Each delivery folded a second time right after itself — byte-identical, and
    re-serialised with its keys in another order (a retried push) — writes nothing."""
    with tempfile.TemporaryDirectory() as tmp:
        store = fresh_store(tmp, "a")
        seconds = 0
        for pts in batch:
            store.fold(store.journal(heart_rate_body(pts), seconds))
            before = store.objects()
            reordered = [dict(reversed(list(p.items()))) for p in pts]
            for again in (heart_rate_body(pts), heart_rate_body(reordered)):
                seconds += 1
                delivery = store.journal(again, seconds)
                store.fold(delivery)
                assert store.objects() == before
                assert store.conn.execute("SELECT objects_written, overwrites FROM delivery"
                                          " WHERE id = ?", (delivery,)).fetchone() == (0, 0)
            seconds += 1
        store.close()


@SETTINGS
@given(deliveries, st.integers(0, 2**32))
def test_property_array_order_never_changes_the_result(batch, seed):
    """Each delivery's array in another order gives the same store.  (The permutation
    depends on the delivery's content, so a byte-identical re-post stays one: it is a
    no-op by design, while a re-serialised copy is folded like any delivery.)"""
    with tempfile.TemporaryDirectory() as tmp:
        first, second = fresh_store(tmp, "a"), fresh_store(tmp, "b")
        for i, pts in enumerate(batch):
            shuffled = list(pts)
            random.Random(heart_rate_body(pts) + str(seed).encode()).shuffle(shuffled)
            first.fold(first.journal(heart_rate_body(pts), i))
            second.fold(second.journal(heart_rate_body(shuffled), i))
        assert first.objects() == second.objects()  # hashes, blobs and provenance alike
        first.close()
        second.close()


@SETTINGS
@given(points(), st.lists(points(), min_size=1, max_size=5))
def test_property_a_dominated_point_never_replaces_a_richer_one(rich, later):
    later = [dict(p, date=rich["date"]) for p in later]
    with tempfile.TemporaryDirectory() as tmp:
        store = fresh_store(tmp, "a")
        store.fold(store.journal(heart_rate_body([rich]), 0))
        for i, point in enumerate(later, 1):
            kept = store.stored()[healthlog.point_span(rich)]
            store.fold(store.journal(heart_rate_body([point]), i))
            now = store.stored()[healthlog.point_span(rich)]
            if healthlog.dominates(kept, point):
                assert now is not None and healthlog.same_value(now, kept)
            assert not healthlog.dominates(kept, now)  # never poorer than what it held
        store.close()


@SETTINGS
@given(deliveries, st.lists(st.booleans(), min_size=6, max_size=6))
def test_property_live_worker_equals_one_by_one_into_a_fresh_store(batch, pass_after):
    """The live worker, with passes at random moments between ingests, ends where a
    fresh store folding the same deliveries one by one in journal order ends."""
    with tempfile.TemporaryDirectory() as tmp:
        live, fresh = fresh_store(tmp, "live"), fresh_store(tmp, "fresh")
        worker = healthlog.FoldWorker(live.config)
        for i, pts in enumerate(batch):
            live.journal(heart_rate_body(pts), i)
            if pass_after[i]:
                worker.run_pass(live.engine)
        worker.run_pass(live.engine)
        assert live.conn.execute("SELECT count(*) FROM delivery WHERE parse_status ="
                                 " 'pending'").fetchone()[0] == 0
        for i, pts in enumerate(batch):
            fresh.fold(fresh.journal(heart_rate_body(pts), i))
        assert live.fingerprint() == fresh.fingerprint()
        assert live.stored() == fresh.stored()
        live.close()
        fresh.close()


@SETTINGS
@given(deliveries)
def test_property_reindex_restores_the_live_fingerprint(batch):
    with tempfile.TemporaryDirectory() as tmp:
        live = fresh_store(tmp, "live")
        for i, pts in enumerate(batch):
            live.fold(live.journal(heart_rate_body(pts), i))
        expected = live.fingerprint()
        live.close()
        out = io.StringIO()
        assert healthlog.run_reindex(live.config, out=out) == 0
        assert "fingerprint: %s" % expected in out.getvalue()
        conn = sqlite3.connect(str(live.config.db_path))
        assert healthlog.fingerprint(conn) == expected
        conn.close()
