"""Helpers of the rebuild tests (test_reindex.py, test_reindex_crash.py,
test_reindex_parallel.py): the bodies they post, the CLI started in the background, a
module's own server, and readings of a data directory that only a rebuild's tests need.
What other test files need too is in conftest.py (``run_cli``, ``journal_rows``,
``object_rows``, ``live_fingerprint``, ``wait_folded``)."""

import contextlib
import datetime as dt
import logging
import random
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import hae_factory as hf
import healthlog
from conftest import (JOURNAL_HISTORY, TOKEN, Client, LogCapture, archive_files, assert_no_leaks,
                      db_rows, journal_rows)

DAY = dt.date(2024, 3, 8)
FAST = hf.Automation("Reindex fast", "Minutes", "Since Last Sync")
FINGERPRINT = re.compile(r"^fingerprint: ([0-9a-f]{64})$", re.M)


# -- the command line -----------------------------------------------------------------------


def cli_args(*args) -> list:
    return [sys.executable, "-m", "healthlog"] + [str(a) for a in args]


def start_cli(*args) -> subprocess.Popen:
    # SIGINT back to its default, so the child turns it into KeyboardInterrupt even when
    # the test runner itself was started with SIGINT ignored (a background job).
    return subprocess.Popen(cli_args(*args), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, preexec_fn=lambda: signal.signal(signal.SIGINT,
                                                                        signal.SIG_DFL))


def printed_fingerprint(text: str) -> str:
    [value] = FINGERPRINT.findall(text)
    return value


# -- reading a data directory -----------------------------------------------------------------


def by_path(rows: list) -> dict:
    """Journal rows keyed by archive path, ids left out and an error naming an earlier
    delivery by id ("duplicate of delivery N") naming it by its archive path instead."""
    paths = {row["id"]: row["archive_path"] for row in rows}
    out = {}
    for row in rows:
        row = {k: v for k, v in row.items() if k != "id"}
        if (row["error"] or "").startswith("duplicate of delivery "):
            row["error"] = "duplicate of " + paths[int(row["error"].rsplit(" ", 1)[1])]
        out[row["archive_path"]] = row
    return out


def tables(data_dir: Path) -> set:
    return {row["name"] for row in db_rows(data_dir, "SELECT name FROM sqlite_master"
                                                     " WHERE type = 'table'")}


def body_paths(data_dir: Path) -> list:
    return [f for f in archive_files(data_dir) if f.startswith("archive/")
            and f.endswith(".json") and not f.endswith(".meta.json")]


def copy_store(source: Path, tmp_path: Path) -> Path:
    target = tmp_path / "data"
    shutil.copytree(str(source), str(target))
    return target


# -- bodies and deliveries ------------------------------------------------------------------


def when(hour: int, minute: int = 0, day: dt.date = DAY) -> str:
    """HAE's timestamp of an instant of ``day`` in UTC (``yyyy-MM-dd HH:mm:ss Z``)."""
    return "%s %02d:%02d:00 +0000" % (day.isoformat(), hour, minute)


def pt(at: str, **values) -> dict:
    point = {"date": at}
    point.update(values)
    point["source"] = hf.CANARY_SOURCE  # a device name that must never reach a log
    return point


def headers(automation: hf.Automation = FAST, aggregation: bool = True) -> dict:
    out = hf.headers_for(automation, hf.new_uuid(random.Random(automation.name)))
    if not aggregation:
        del out["automation-aggregation"]
    return out


def post(client: Client, payload: bytes, path: str = "/api/ingest", **kw) -> int:
    status, answer = client.ingest(payload, path=path, **kw)
    assert status == 200, answer
    return answer["delivery_id"]


# -- a module's server --------------------------------------------------------------------------


@contextlib.contextmanager
def module_service(data_dir: Path, **overrides):
    """A real server for a module fixture, with its own log capture and leak check."""
    capture = LogCapture()
    handler = healthlog.setup_logging(healthlog.Config(data_dir=Path("."), log_level="DEBUG"),
                                      stream=capture.stream)
    values = dict(data_dir=data_dir, host="127.0.0.1", port=0, token=TOKEN,
                  busy_timeout_s=10.0, stop_budget_s=30.0)
    values.update(overrides)
    service = healthlog.Service(healthlog.Config(**values), announce=lambda token: None)
    service.start()
    try:
        yield service
    finally:
        service.stop()
        logging.getLogger().removeHandler(handler)
    assert_no_leaks(capture.lines())


def journal_facts(data_dir: Path) -> list:
    """Every journal row and column but the three that tell this machine's history
    (:data:`conftest.JOURNAL_HISTORY`): what a rebuild from the archive restores."""
    return journal_rows(data_dir, JOURNAL_HISTORY)
