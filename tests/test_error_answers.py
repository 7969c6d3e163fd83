"""Every error answer is the route's own, and a sick machine cannot flood the log.

READ-15.5 (hostile summary dates), READ-15.6 (a read that fails says so), RELY-8.11 (runs
of identical log records), RELY-8.12 (descriptor exhaustion), through real servers.
"""

import contextlib
import io
import json
import logging
import resource
import socket
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

import hae_factory as hf
import healthlog
from conftest import TOKEN, Client, db_rows, parse_logfmt, wait_for

RANGE = "from 1900-01-01 to 9998-12-31"


@pytest.fixture
def one_folded(start_service, data_dir):
    """A real server holding one folded delivery."""
    service = start_service()
    client = Client(*service.address)
    assert client.ingest(hf.dumps_hae(hf.canary_payload(1)))[0] == 200
    wait_for(lambda: db_rows(data_dir)[0]["parse_status"] == "parsed")
    return service, client


ZONES = [None, "+14:00", "-12:00", "Pacific/Kiritimati"]


def _summary(client: Client, date: str, tz) -> tuple:
    query = "/api/summary?date=" + date + ("&tz=" + tz.replace("+", "%2B") if tz else "")
    return client.request("GET", query)


def test_read_15_5_a_summary_date_out_of_range_is_400_naming_the_range(one_folded):
    _, client = one_folded
    for date in ["0001-01-01", "9999-12-31", "1899-12-31", "0000-01-01", "2024-02-30",
                 "20240101", "2024-01-01T00:00", "99999-01-01", "2024-13-01"]:
        for tz in ZONES:
            status, answer = _summary(client, date, tz)
            assert status == 400, (date, tz, answer)
            assert answer["error"]["code"] == "bad_request"
            assert RANGE in answer["error"]["message"]
    for date in ["1900-01-01", "9998-12-31"]:  # the ends of the range answer
        for tz in ZONES:
            status, answer = _summary(client, date, tz)
            assert (status, answer["date"]) == (200, date), (tz, answer)


def test_read_15_6_a_read_that_fails_says_the_read_failed(start_service, data_dir, logs):
    """The object table taken away under a running server: reads answer 500 saying the
    read failed, with one ERROR naming the route and class; ingest's 500 is its own."""
    service = start_service()
    client = Client(*service.address)
    assert client.ingest(hf.dumps_hae(hf.canary_payload(1)))[0] == 200
    wait_for(lambda: db_rows(data_dir)[0]["parse_status"] == "parsed")
    database = str(data_dir / healthlog.DB_NAME)
    with contextlib.closing(sqlite3.connect(database)) as conn, conn:
        conn.execute("ALTER TABLE object RENAME TO object_away")
    try:
        for path in ("/api/catalog", "/api/points?metric=heart_rate",
                     "/api/summary?date=2024-03-08"):
            status, answer = client.request("GET", path)
            assert status == 500, (path, answer)
            assert answer["error"]["code"] == "internal_error"
            assert answer["error"]["message"] == healthlog.READ_FAILED
            assert "delivery" not in answer["error"]["message"]
    finally:
        with contextlib.closing(sqlite3.connect(database)) as conn, conn:
            conn.execute("ALTER TABLE object_away RENAME TO object")
    failed = logs.find("request failed", level="ERROR")
    assert [(r["path"], r["error"]) for r in failed] == [
        ("/api/catalog", "OperationalError"), ("/api/points", "OperationalError"),
        ("/api/summary", "OperationalError")]
    assert healthlog.InternalError().message == (
        "The server could not store the delivery; it was not accepted.")


def _records(stream: io.StringIO) -> list:
    return [parse_logfmt(line) for line in stream.getvalue().splitlines() if line]


def test_rely_8_11_a_run_of_identical_records_is_written_once_then_counted():
    """Through the handler serve installs: 100 identical records, a different one, 3 more
    of the first (a new run), then a run that outlasts the report interval, then the
    handler's close at exit."""
    stream = io.StringIO()
    handler = healthlog.setup_logging(healthlog.Config(data_dir=Path("."), log_level="DEBUG"),
                                      stream=stream)
    try:
        for _ in range(100):
            healthlog.log_event(logging.ERROR, "the same", error="EMFILE")
        healthlog.log_event(logging.INFO, "another")
        for _ in range(3):
            healthlog.log_event(logging.ERROR, "the same", error="EMFILE")
        healthlog.log_event(logging.ERROR, "the same", error="EBADF")  # other fields
        records = _records(stream)
        written = healthlog.LOG_REPEATS_WRITTEN
        assert [(r["msg"], r.get("error"), r.get("repeated")) for r in records] == (
            [("the same", "EMFILE", None)] * written
            + [("the same", "EMFILE", str(100 - written)), ("another", None, None)]
            + [("the same", "EMFILE", None)] * 3 + [("the same", "EBADF", None)])

        # A run that goes on, a record every 5 s: its count is written once a minute has
        # passed since its first record (the 6th to the 13th: 8), then every minute (12).
        start = time.time()
        for n in range(40):
            record = logging.makeLogRecord({"name": "healthlog", "levelno": logging.WARNING,
                                            "levelname": "WARNING", "msg": "long run",
                                            "fields": {}, "created": start + n * 5.0})
            handler.handle(record)
        long_run = [r for r in _records(stream) if r["msg"] == "long run"]
        assert [r.get("repeated") for r in long_run] == [None] * written + ["8", "12", "12"]
    finally:
        logging.getLogger().removeHandler(handler)
        handler.close()  # writes the count of the run still going on
    long_run = [r for r in _records(stream) if r["msg"] == "long run"]
    assert [r.get("repeated") for r in long_run][-1] == str(40 - written - 8 - 12 - 12)


def test_rely_8_12_out_of_file_descriptors_the_log_stays_small_and_serve_recovers(tmp_path):
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    log_path = tmp_path / "serve.log"

    def few_descriptors():
        resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))

    with open(str(log_path), "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "healthlog", "serve", "--data", str(data_dir),
             "--listen", "127.0.0.1:0", "--token", TOKEN], stdout=subprocess.DEVNULL,
            stderr=log, preexec_fn=few_descriptors)
    try:
        serving = wait_for(lambda: [r for r in map(parse_logfmt, log_path.read_text()
                                                   .splitlines()) if r.get("msg") == "serving"],
                           timeout=60, what="serve listens")
        port = int(serving[0]["listen"].rsplit(":", 1)[1])
        held = []
        for _ in range(120):
            held.append(socket.create_connection(("127.0.0.1", port), timeout=10))
        wait_for(lambda: "EMFILE" in log_path.read_text(), timeout=30,
                 what="serve runs out of descriptors")
        time.sleep(3)  # the accept loop meets the fault ~30 times meanwhile
        for sock in held:
            sock.close()
        client = Client("127.0.0.1", port)
        wait_for(lambda: client.request("GET", "/healthz", token=False)[0] == 200, timeout=60,
                 what="/healthz answers again")
    finally:
        proc.terminate()
        proc.wait(30)
    records = [parse_logfmt(line) for line in log_path.read_text().splitlines() if "=" in line]
    errors = [r for r in records if r.get("msg") == "http server: Error in HTTPServer.serve"]
    assert all(r["error"] == "EMFILE" for r in errors)
    counted = [r for r in errors if "repeated" in r]
    assert len(errors) - len(counted) == healthlog.LOG_REPEATS_WRITTEN
    assert 1 <= len(counted) <= 2 and sum(int(r["repeated"]) for r in counted) >= 10
    assert len(records) < 60, "the log grew: %d records" % len(records)
    assert json.dumps(records)  # every line was one parseable record
