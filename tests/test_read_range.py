"""Every read answers its range or refuses it (READ-2.9, READ-2.10).

A date that cannot be read in the zone asked (``0001-01-01`` east of UTC has its midnight in
the year 0; ``9999-12-31``'s next midnight is in the year 10000) is a ``400`` naming the days a
read accepts, on every read route of the server and in ``healthlog export`` in every format;
the days at the ends of that range answer whole. No answer is a ``200`` that breaks off: a
failure before the first byte of a streamed answer is the route's own error.

The walk covers every ``GET`` route the application registers: a route added without a place
here fails :func:`test_read_2_9_every_read_route_is_walked`.
"""

import contextlib
import csv
import datetime as dt
import io
import json
import random
import sqlite3
import subprocess
import threading

import pytest

import hae_factory as hf
import healthlog
from conftest import Client, db_rows, run_export, wait_for
from read_helpers import call, serve_corpus, url

RANGE = "from 1900-01-01 to 9998-12-31"
"""The days a read accepts, as every refusal names them (and /api/summary always did)."""
FAR = ("0001-01-01", "9999-12-31")
ENDS = ("1900-01-01", "9998-12-31")
ZONES = ("+14:00", "-12:00", "Asia/Tokyo")
DAY = dt.date(2024, 3, 8)
PHONE = hf.Phone(zone=hf.NEW_YORK, sources="single")


def corpus() -> list:
    """Series of minutes and of days, sleep, a workout, events and an ECG recording."""
    rng = random.Random(3)
    days = hf.days_export(seed=5, start=DAY - dt.timedelta(days=3), end=DAY + dt.timedelta(days=1),
                          phone=PHONE, names=("step_count",))
    ecg = hf.envelope(ecg=[hf.ecg_reading(rng, dt.datetime.combine(DAY, dt.time(9)),
                                          phone=PHONE, samples=40)])
    return [hf.dumps_hae(hf.canary_payload(1, DAY)), hf.dumps_hae(days), hf.dumps_hae(ecg)]


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    deliveries = [({}, body) for body in corpus()]
    yield from serve_corpus(tmp_path_factory.mktemp("range"), None, deliveries)


# Each read route, with the queries that take a date: (path, fixed parameters, the names
# the dates go into).  A route that takes no date is listed in UNDATED.
DATED = [
    ("/api/points", {"metric": "step_count"}, ("from", "to")),
    ("/api/points", {"metric": "step_count", "bucket": "day"}, ("from", "to")),
    ("/api/points", {"metric": "step_count", "bucket": "week", "format": "csv"}, ("from", "to")),
    ("/api/points", {"metric": "step_count", "format": "csv"}, ("from", "to")),
    ("/api/points", {"metric": "heart_rate", "bucket": "hour"}, ("from", "to")),
    ("/api/points", {"metric": "heart_rate", "bucket": "day", "format": "csv"}, ("from", "to")),
    ("/api/points", {"metric": "sleep_analysis"}, ("from", "to")),
    ("/api/points", {"metric": "sleep_analysis", "bucket": "day"}, ("from", "to")),
    ("/api/points", {"metric": "sleep_analysis", "bucket": "week", "format": "csv"},
     ("from", "to")),
    ("/api/points", {"metric": "workouts", "format": "csv"}, ("from", "to")),
    ("/api/points", {"metric": "ecg", "format": "csv"}, ("from", "to")),
    ("/api/records", {"metric": "workouts"}, ("from", "to")),
    ("/api/workouts", {}, ("from", "to")),
    ("/api/records", {"metric": "symptoms/Headache"}, ("from", "to")),
    ("/api/plan", {"metric": "heart_rate", "range": "custom"}, ("from", "to")),
    ("/api/plan", {"metric": "sleep_analysis", "range": "custom"}, ("from", "to")),
    ("/api/summary", {}, ("date",)),
    ("/api/coverage", {}, ("from", "to")),
    ("/api/ecg", {}, ("start",)),
]
UNDATED = {"/api/catalog", "/api/deliveries", "/api/freshness", "/metrics", "/healthz", "/",
           "/static/<name>", "/api/workouts/<ident>", "/mcp"}
PAIRED = {"/api/plan"}
"""Routes that want both ends: a date asked alone there is refused for the missing end."""


def _answer_is_whole(reply, query: dict) -> None:
    """A complete, valid answer: JSON that parses, or CSV with its header."""
    assert reply.status == 200, (query, reply.body[:300])
    if query.get("format") == "csv":
        rows = list(csv.reader(io.StringIO(reply.text, newline="")))
        assert rows and rows[0], query
    else:
        answer = json.loads(reply.body)
        assert isinstance(answer, dict), query


def _refused(reply, query: dict) -> None:
    assert reply.status == 400, (query, reply.body[:300])
    error = json.loads(reply.body)["error"]
    assert error["code"] == "bad_request"
    assert RANGE in error["message"], (query, error)


def test_read_2_9_every_read_route_is_walked(tmp_path):
    """The walk below knows every GET route: a new one must say whether it takes a date."""
    app = healthlog.App(healthlog.Config(data_dir=tmp_path), None, None, None,
                        threading.Event())
    routes = {route.rule for route in app.bottle.routes if route.method == "GET"}
    assert routes == {path for path, _, _ in DATED} | UNDATED


def test_read_2_9_every_read_route_refuses_a_date_it_cannot_read(store):
    """0001-01-01 and 9999-12-31 in +14:00, -12:00 and Asia/Tokyo, as each date a route
    takes (alone and together), raw and bucketed, JSON and CSV: 400 naming the range."""
    for path, fixed, names in DATED:
        for date in FAR:
            for tz in ZONES:
                for asked in [(name,) for name in names] + ([names] if len(names) > 1 else []):
                    query = dict(fixed, tz=tz, **{name: date for name in asked})
                    reply = call(store.address, "GET", url(path, **query))
                    if path in PAIRED and len(asked) == 1:
                        assert reply.status == 400, (path, query)  # the other end is missing
                        continue
                    _refused(reply, dict(query, path=path))


def test_read_2_9_the_days_at_the_ends_of_the_range_answer_whole(store):
    """1900-01-01 and 9998-12-31 in the same zones: a complete answer on every route."""
    for path, fixed, names in DATED:
        for tz in ZONES:
            if path == "/api/ecg":  # a recording's start: the time it began, or 404
                starts = [json.loads(call(store.address, "GET", url(
                    "/api/records", metric="ecg", tz=tz)).body)["items"][0]["start"]]
                for start in starts:
                    _answer_is_whole(call(store.address, "GET", url(path, start=start, tz=tz)),
                                     {"path": path})
                continue
            for date in ENDS:
                query = dict(fixed, tz=tz, **{name: date for name in names})
                _answer_is_whole(call(store.address, "GET", url(path, **query)),
                                 dict(query, path=path))
            if len(names) == 2 and path != "/api/coverage":  # the whole range at once
                # (coverage reads a few hundred days at most: it says so for this one)
                query = dict(fixed, tz=tz, **{names[0]: ENDS[0], names[1]: ENDS[1]})
                reply = call(store.address, "GET", url(path, **query))
                _answer_is_whole(reply, dict(query, path=path))
                if path == "/api/points" and fixed.get("format") != "csv":
                    assert json.loads(reply.body)["to"] is not None  # a bound, not "no end"
    # (a workout's own route takes an id, /mcp only POST: MCP-3 walks its dates)
    for path in UNDATED - {"/static/<name>", "/api/workouts/<ident>", "/mcp"}:
        reply = call(store.address, "GET", url(path, tz=ZONES[0], date=FAR[0],
                                               **{"from": FAR[0], "to": FAR[1]}))
        assert reply.status == 200, path  # no date taken: the parameters are not read


def _exit_2_naming_the_range(result: subprocess.CompletedProcess, what) -> None:
    assert result.returncode == 2, (what, result.stderr)
    assert result.stdout == b"", what
    lines = result.stderr.decode().splitlines()
    assert len(lines) == 1 and "Traceback" not in lines[0], (what, lines)
    assert RANGE in lines[0], (what, lines)


def test_read_2_9_export_refuses_a_date_it_cannot_read_in_every_format(store, tmp_path):
    """``healthlog export`` beside serve: exit 2, one line naming the range, nothing on
    standard output; the ends of the range print the route's bytes; ``--format sqlite``,
    which writes every point, takes no range at all."""
    formats = ("json", "csv")
    runs = 0
    for date in FAR:
        for tz in ZONES:
            for flag in ("--from", "--to"):
                fmt = formats[runs % 2]
                runs += 1
                what = (date, tz, flag, fmt)
                _exit_2_naming_the_range(run_export(  # "--tz -12:00" too, as a person types it
                    "--data", store.data_dir, "--metric", "heart_rate", flag, date, "--tz", tz,
                    "--format", fmt), what)
    for tz in ZONES:
        for n, fmt in enumerate(formats):
            metric, bucket = ("step_count", "week") if n else ("sleep_analysis", "day")
            result = run_export("--data", store.data_dir, "--metric", metric, "--bucket", bucket,
                                "--from", ENDS[0], "--to", ENDS[1], "--tz", tz, "--format", fmt)
            assert result.returncode == 0, result.stderr
            route = call(store.address, "GET", url(
                "/api/points", metric=metric, bucket=bucket, tz=tz, format=fmt,
                **{"from": ENDS[0], "to": ENDS[1]}))
            assert route.status == 200
            assert result.stdout == route.body, (tz, fmt)
    out = tmp_path / "all.db"
    result = run_export("--data", store.data_dir, "--format", "sqlite", "--from", FAR[0],
                        "--tz", ZONES[0], out)
    assert result.returncode == 2 and not out.exists()
    lines = result.stderr.decode().splitlines()
    assert len(lines) == 1 and "--from, --tz go with --format csv or json" in lines[0], lines


def test_read_2_10_a_failure_before_the_first_byte_is_the_routes_error(start_service,
                                                                      data_dir, logs):
    """The first hour of a metric damaged on disk: a streamed answer that cannot make its
    first bytes is a 500 saying the read failed, never a 200 that breaks off; the other
    metrics still answer."""
    service = start_service()
    client = Client(*service.address)
    assert client.ingest(hf.dumps_hae(hf.canary_payload(1, DAY)))[0] == 200
    wait_for(lambda: db_rows(data_dir)[0]["parse_status"] == "parsed")
    database = str(data_dir / healthlog.DB_NAME)
    with contextlib.closing(sqlite3.connect(database)) as conn, conn:
        [hour] = conn.execute("SELECT min(hour) FROM object WHERE metric = 'heart_rate'")
        conn.execute("UPDATE object SET blob = ? WHERE metric = 'heart_rate' AND hour = ?",
                     (b"not gzip", hour[0]))
    for query in ({"metric": "heart_rate"}, {"metric": "heart_rate", "format": "csv"}):
        reply = call(service.address, "GET", url("/api/points", **query))
        assert reply.status == 500, (query, reply.body[:200])
        error = json.loads(reply.body)["error"]
        assert (error["code"], error["message"]) == ("internal_error", healthlog.READ_FAILED)
    assert call(service.address, "GET", url("/api/points", metric="resting_heart_rate")
                ).status == 200
    assert not logs.find("streamed answer failed")
    assert [r["path"] for r in logs.find("request failed", level="ERROR")] == [
        "/api/points", "/api/points"]
