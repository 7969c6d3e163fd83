"""RELY-9: the durable path is tested by mutation.

``tests/mutate.py`` (run by hand) applies each mutant of the durable path to a copy of
healthlog.py and runs the tests named for it, which must fail. This module holds what the
default run checks of that: the mutant table still applies to healthlog.py and names tests that
exist, the spec lists the same table (RELY-9.1); and two cheap tests that kill the mutants of
the connection levels at their source: a started ``serve`` ingests over HTTP through FULL
connections and folds through a NORMAL one (RELY-9.2), and ``import`` journals through a FULL
connection (RELY-9.3). The crash-state explorer (RELY-2, tests/test_crash_states.py) kills
them too, by the loss they cause, on the connections of a real ``Service``.
"""

import ast
import datetime as dt
import io
import re
import threading
from pathlib import Path

import pytest

import hae_factory as hf
import healthlog
import mutate
from conftest import Client, db_rows, wait_for

pytestmark = pytest.mark.json_agnostic

ROOT = Path(__file__).resolve().parent.parent
SPEC = ROOT / "openspec" / "specs" / "reliability" / "spec.md"
FULL, NORMAL = 2, 1  # PRAGMA synchronous
FOLD_THREAD = "healthlog-fold"
DAY = dt.date(2024, 3, 8)
AUTOMATION = hf.Automation("Durable path", "Minutes", "Since Last Sync")
HEADERS = hf.headers_for(AUTOMATION, session_id="0C6B1C53-9000-4000-8000-000000000009")


def steps_body(seed: int) -> bytes:
    return hf.dumps_hae(hf.metrics_payload(seed, ("step_count",), DAY), pretty=False)


@pytest.fixture
def levels(monkeypatch) -> list:
    """Every connection healthlog opens from now on, as (thread name, ``PRAGMA synchronous``
    read in the opening thread as soon as ``connect`` returns)."""
    opened = []
    real = healthlog.connect

    def spy(path, **kwargs):
        conn = real(path, **kwargs)
        opened.append((threading.current_thread().name,
                       conn.execute("PRAGMA synchronous").fetchone()[0]))
        return conn

    monkeypatch.setattr(healthlog, "connect", spy)
    return opened


# ---------------------------------------------------------------------------------------------
# RELY-9.1: the mutant table.


def test_rely_9_1_every_mutant_of_the_durable_path_applies_once_and_names_existing_tests():
    """WHEN the mutant table of tests/mutate.py is read against healthlog.py, the tests and the
    reliability spec (the mutants themselves run by hand: ``python tests/mutate.py``)
    THEN each mutant's text occurs exactly once in healthlog.py, each names at least one
    test, each named test exists in its file and is not a torture test, and the spec's table
    lists the same mutants with the same killing tests."""
    source = (ROOT / "healthlog.py").read_text(encoding="utf-8")
    ids = [m.id for m in mutate.MUTANTS]
    assert len(set(ids)) == len(ids) and len(ids) >= 8, ids
    defined = {}
    for m in mutate.MUTANTS:
        assert source.count(m.old) == 1, "%s: its text occurs %d times in healthlog.py" % (
            m.id, source.count(m.old))
        assert m.new != m.old and m.tests, m.id
        assert {node for node, _ in m.expect} <= set(m.tests), m.id
        for node in m.tests:
            path, name = node.split("::")
            if path not in defined:
                tree = ast.parse((ROOT / path).read_text(encoding="utf-8"))
                defined[path] = {n.name: n for n in ast.walk(tree)
                                 if isinstance(n, ast.FunctionDef)}
            assert name in defined[path], "%s names %s, which does not exist" % (m.id, node)
            decorators = [ast.dump(d) for d in defined[path][name].decorator_list]
            assert not any("torture" in d for d in decorators), (
                "%s: %s is a torture test (mutate.py runs the default selection)" % (m.id, node))
    for m in mutate.EQUIVALENT:
        assert source.count(m.old) == 1, "%s: its text occurs %d times in healthlog.py" % (
            m.id, source.count(m.old))
    rows = {}
    for line in SPEC.read_text(encoding="utf-8").splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if line.startswith("|") and re.fullmatch(r"[ME]\d+", cells[0]):
            rows[cells[0]] = sorted(re.findall(r"`(test_\w+)`", cells[-1]))
    want = {m.id: sorted(node.split("::")[1] for node in m.tests) for m in mutate.MUTANTS}
    want.update((m.id, []) for m in mutate.EQUIVALENT)
    assert rows == want, "openspec/specs/reliability/spec.md's mutant table differs from" \
                         " tests/mutate.py"


# ---------------------------------------------------------------------------------------------
# RELY-9.2 and 9.3: the connection levels, where they are set.


def test_rely_9_2_serve_ingests_through_full_connections_and_folds_through_a_normal_one(
        start_service, data_dir, levels, monkeypatch):
    """WHEN a real ``serve`` on 127.0.0.1:0 answers one ingest over HTTP and folds it
    THEN the connection the delivery's row is committed through has ``synchronous=FULL`` (2),
    so does every connection opened outside the fold thread (the pool's, for the request),
    and the fold thread opened one connection, ``synchronous=NORMAL`` (1), which folded it."""
    accepted = []
    real_accept = healthlog.accept_delivery

    def accept_delivery(archive, conn, *args, **kwargs):
        accepted.append((threading.current_thread().name,
                         conn.execute("PRAGMA synchronous").fetchone()[0]))
        return real_accept(archive, conn, *args, **kwargs)

    monkeypatch.setattr(healthlog, "accept_delivery", accept_delivery)
    service = start_service()
    status, payload = Client(*service.address).ingest(steps_body(1), headers=HEADERS)
    assert status == 200, payload
    wait_for(lambda: db_rows(data_dir)[0]["parse_status"] == "parsed")
    [(thread, level)] = accepted
    assert thread != threading.current_thread().name, "not answered by a server thread"
    assert level == FULL, "the ingest route commits through synchronous=%d" % level
    others = [(name, level) for name, level in levels if name != FOLD_THREAD]
    assert thread in [name for name, _ in others], "the route's connection was not opened"
    assert [level for _, level in others] == [FULL] * len(others), others
    assert [level for name, level in levels if name == FOLD_THREAD] == [NORMAL], levels


def test_rely_9_3_import_journals_through_a_full_connection(data_dir, tmp_path, levels):
    """WHEN ``healthlog import`` accepts an export file
    THEN every connection it opened has ``synchronous=FULL`` (2): its ``accepted`` line rests
    on a durable row, as a 200 does."""
    export = tmp_path / "export.json"
    export.write_bytes(steps_body(2))
    out = io.StringIO()
    config = healthlog.Config(data_dir=data_dir, log_level="ERROR")
    assert healthlog.run_import(config, [str(export)], "Minutes", None, out=out) == 0, \
        out.getvalue()
    assert out.getvalue().startswith("accepted "), out.getvalue()
    assert levels and [level for _, level in levels] == [FULL] * len(levels), levels
    assert len(db_rows(data_dir)) == 1
