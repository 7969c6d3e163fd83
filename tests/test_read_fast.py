"""READ-18: every request a person makes is answered from the tallies and spans: the page's
own requests (``/api/plan``, then ``/api/points`` with what the plan says, ``tz=local``),
Grafana's, ``export`` and the summary read whole hours without decoding them; only the
objects at a range's edges, and the hours whose points fall in two buckets, are read point
by point; and what they answer is what reading every point answers, byte for byte.

One store, built once: HAE-shaped Minutes exports (steps, heart rate, active energy) and
stage records of sleep, made by tests/hae_factory.py, of a phone that travels: Berlin
across the end of summer time (27 October 2024), Kolkata (+05:30), Kathmandu (+05:45) and
New York across its own change (3 November), each journey starting in the middle of an
hour.  The bodies are posted over HTTP to a real server running in this process (Cheroot on
127.0.0.1:0), so that a test reads ``healthlog.READ_DECODES``, the count of stored objects
the read side decoded, around the requests it makes; the fold is the server's own worker.

What a request must decode is worked out here from the points posted (times read with
``datetime`` from the text the phone wrote, zones with ``zoneinfo``), never from healthlog's
code: an hour must be read when the range takes some of its points but not all, when the
points it holds for the range fall in two buckets, or (``tz=local``) when they were written
in two offsets.  The slow answer, to compare with, is the same request with every object
read point by point (``healthlog._object_part`` made to say that every object is cut by the
range).
"""

from __future__ import annotations

import csv
import datetime as dt
import io
import json
import shutil
import sqlite3
import zoneinfo
from typing import NamedTuple

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import hae_factory as hf
import healthlog
from conftest import TOKEN, Client, db_rows, wait_for
from read_helpers import Store, get, get_json

UTC = dt.timezone.utc
SEED = 38
KATHMANDU = hf.Zone("Asia/Kathmandu", 345)  # +05:45: a quarter-hour offset
#: (zone, from): the phone's journey, each leg until the next one starts.
LEGS = ((hf.BERLIN, dt.datetime(2024, 10, 23, 22, tzinfo=UTC)),
        (hf.KOLKATA, dt.datetime(2024, 10, 29, 9, 10, tzinfo=UTC)),
        (KATHMANDU, dt.datetime(2024, 10, 31, 20, 0, tzinfo=UTC)),
        (hf.NEW_YORK, dt.datetime(2024, 11, 2, 6, 40, tzinfo=UTC)))
END = dt.datetime(2024, 11, 6, 5, 0, tzinfo=UTC)
METRICS = ("step_count", "heart_rate", "active_energy")
#: Mornings of stage records, in the zone of the leg they fall in.
SLEEP = ((hf.BERLIN, dt.date(2024, 10, 25), dt.date(2024, 10, 29)),
         (hf.KOLKATA, dt.date(2024, 10, 30), dt.date(2024, 10, 31)),
         (hf.NEW_YORK, dt.date(2024, 11, 3), dt.date(2024, 11, 6)))
MINUTES = hf.Automation("Health fast", "Minutes", "Since Last Sync")
NIGHTS = hf.Automation("Sleep", "Days", "Previous 7 Days")
HOUR_S = 3600


class Point(NamedTuple):
    instant: int  # UTC seconds of its start
    offset: int  # seconds east of UTC, as written


class Corpus(NamedTuple):
    deliveries: list  # (headers, body)
    points: dict  # metric -> [Point]


def point_of(text: str) -> Point:
    """A point's start as HAE wrote it: ``2024-10-27 02:30:00 +0100``."""
    moment = dt.datetime.strptime(text, "%Y-%m-%d %H:%M:%S %z")
    return Point(int(moment.timestamp()), int(moment.utcoffset().total_seconds()))


def build_corpus() -> Corpus:
    corpus = Corpus([], {metric: [] for metric in METRICS + ("sleep_analysis",)})
    ends = [start for _, start in LEGS[1:]] + [END]
    for (zone, start), end in zip(LEGS, ends):
        phone = hf.Phone(zone=zone, sources="single")
        cut = start
        while cut < end:  # two days a delivery, as "Since Last Sync" sends them
            following = min(end, cut + dt.timedelta(days=2))
            body = hf.metrics_payload(SEED, METRICS, cut, following, "Minutes", phone=phone)
            corpus.deliveries.append((hf.headers_for(MINUTES), hf.dumps_hae(body)))
            for element in body["data"]["metrics"]:
                corpus.points[element["name"]] += [point_of(p["date"]) for p in element["data"]]
            cut = following
    for zone, first, last in SLEEP:
        rows = hf.sleep_segments(SEED, first, last, phone=hf.Phone(zone=zone, sources="single"))
        corpus.deliveries.append((hf.headers_for(NIGHTS), hf.dumps_hae(hf.envelope(
            metrics=[hf.metric("sleep_analysis", rows)]))))
        corpus.points["sleep_analysis"] += [point_of(r["startDate"]) for r in rows]
    return corpus


@pytest.fixture(scope="module")
def folded(tmp_path_factory) -> tuple:
    """(data directory, corpus): the corpus posted to a server in this process and folded by
    its worker; the server is stopped again (each test starts its own on the store)."""
    data_dir = tmp_path_factory.mktemp("read-fast") / "data"
    config = healthlog.Config(data_dir=data_dir, host="127.0.0.1", port=0, token=TOKEN,
                              busy_timeout_s=10.0, http_timeout_s=30.0, stop_budget_s=10.0,
                              log_level="INFO")
    service = healthlog.Service(config, announce=lambda token: None)
    service.start()
    try:
        corpus = build_corpus()
        client = Client(*service.address)
        for headers, body in corpus.deliveries:
            status, answer = client.ingest(body, headers=headers)
            assert status == 200, answer
        wait_for(lambda: all(row["parse_status"] != "pending" for row in db_rows(data_dir)),
                 timeout=120, what="every delivery folded")
        assert {row["parse_status"] for row in db_rows(data_dir)} == {"parsed"}
    finally:
        assert service.stop(), "the server did not stop within its budget"
    return data_dir, corpus


@pytest.fixture
def store(folded, start_service) -> Store:
    """A server in this process on the folded store (its reads counted in this process)."""
    service = start_service(data_dir=folded[0], log_level="INFO", http_timeout_s=30.0)
    return Store(folded[0], service.address, folded[1])


def fetch(store: Store, path: str = "/api/points", **query) -> tuple:
    """(body bytes, objects decoded, objects read point by point) of one request."""
    decoded, checked = healthlog.READ_DECODES.objects, healthlog.READ_DECODES.checked
    reply = get(store.address, path, **query)
    assert reply.status == 200, (path, query, reply.status, reply.body[:300])
    return (reply.body, healthlog.READ_DECODES.objects - decoded,
            healthlog.READ_DECODES.checked - checked)


# ---------------------------------------------------------------------------------------------
# The test's own reading: which hours a request must read point by point.

def offset_in(tz: str, point: Point) -> int:
    """The offset a request in ``tz`` places a point in: as written (``local``), the zone's
    at its instant, or the fixed offset."""
    if tz == "local":
        return point.offset
    if tz[0] in "+-":
        sign = -1 if tz[0] == "-" else 1
        return sign * (int(tz[1:3]) * 3600 + int(tz[4:6]) * 60)
    moment = dt.datetime.fromtimestamp(point.instant, UTC).astimezone(zoneinfo.ZoneInfo(tz))
    return int(moment.utcoffset().total_seconds())


def midnight(tz: str, day: dt.date) -> int:
    """UTC seconds of local midnight of ``day`` in a zone or an offset."""
    if tz[0] in "+-":
        return int(dt.datetime(day.year, day.month, day.day, tzinfo=UTC).timestamp()) \
            - offset_in(tz, Point(0, 0))
    return int(dt.datetime(day.year, day.month, day.day,
                           tzinfo=zoneinfo.ZoneInfo(tz)).timestamp())


def points_between(tz: str, first: str, last: str):
    """The test of a point for the bounds a request sends: dates (``to`` included: in
    ``tz=local`` the date written in the point, else the zone's midnights) or instants
    (``to`` excluded)."""
    if len(first) == 10:
        low, high = dt.date.fromisoformat(first), dt.date.fromisoformat(last)
        if tz == "local":
            return lambda p: low <= local_date(p, p.offset) <= high
        start, end = midnight(tz, low), midnight(tz, high + dt.timedelta(days=1))
        return lambda p: start <= p.instant < end
    start, end = (int(dt.datetime.fromisoformat(t.replace("Z", "+00:00")).timestamp())
                  for t in (first, last))
    return lambda p: start <= p.instant < end


def local_date(point: Point, offset: int) -> dt.date:
    return dt.datetime.fromtimestamp(point.instant + offset, UTC).date()


def bucket_key(point: Point, offset: int, bucket: str):
    if bucket == "hour":
        return (point.instant + offset) // HOUR_S
    day = local_date(point, offset)
    return day if bucket == "day" else day - dt.timedelta(days=day.weekday())


def must_read(points: list, tz: str, first: str, last: str, bucket: str) -> tuple:
    """(hours that must be read point by point, hours with a point in the range) for one
    bucketed request: an hour the range cuts, an hour inside which a bucket starts in the
    offset of one of its points, an hour whose points were written in two offsets."""
    taken = points_between(tz, first, last)
    hours: dict = {}
    for point in points:
        hours.setdefault(point.instant // HOUR_S, []).append(point)
    must, touched = 0, 0
    for hour, members in hours.items():
        inside = [p for p in members if taken(p)]
        if not inside:
            continue
        touched += 1
        offsets = {offset_in(tz, p) for p in members}
        first, last = Point(hour * HOUR_S, 0), Point(hour * HOUR_S + HOUR_S - 1, 0)
        crossed = any(bucket_key(first, o, bucket) != bucket_key(last, o, bucket)
                      for o in offsets)  # a bucket starts inside the hour (+05:30's midnight)
        if len(inside) < len(members) or crossed or len({p.offset for p in members}) > 1:
            must += 1
    return must, touched


# ---------------------------------------------------------------------------------------------
# READ-18.1: the page's requests decode only the hours at their edges

PAGE_VIEWS = ("24h", "7d", "30d", "1y", "all")


@pytest.mark.parametrize("tz", ["local", "Europe/Berlin", "+05:30", "-04:00"])
def test_read_18_1_the_pages_requests_decode_only_the_hours_at_their_edges(store, tz):
    for metric in ("step_count", "heart_rate"):
        for view in PAGE_VIEWS:
            plan_body, plan_decoded, _ = fetch(store, "/api/plan", metric=metric, range=view,
                                               tz=tz)
            plan = json.loads(plan_body)
            assert plan_decoded <= 2, (view, plan_decoded)  # the newest point, found twice
            _, decoded, checked = fetch(store, **plan["points"])  # as the page asks it
            points = store.corpus.points[metric]
            if plan["from"] is None:  # all stored data
                first, last = "1970-01-01", "2100-01-01"
            else:
                first, last = plan["from"], plan["to"]
            must, touched = must_read(points, tz, first, last, plan["bucket"])
            assert decoded == checked, (view, decoded, checked)  # a bucket reads no raw text
            assert decoded <= must, (metric, view, plan["bucket"], decoded, must, touched)
    # the test's own measure can tell: a week of days in local time must read a few hours
    # of the 24 a day it takes
    plan = get_json(store.address, "/api/plan", metric="heart_rate", range="7d", tz="local")
    must, touched = must_read(store.corpus.points["heart_rate"], "local", plan["from"],
                              plan["to"], plan["bucket"])
    assert touched >= 150 and must <= touched // 10, (must, touched)


def test_read_18_1_grafana_and_export_decode_only_the_hours_at_their_edges(store):
    points = store.corpus.points["step_count"]
    # Grafana: epoch milliseconds, hours of tz=local, over the whole journey
    start = int(dt.datetime(2024, 10, 24, 7, 30, tzinfo=UTC).timestamp())
    end = int(dt.datetime(2024, 11, 5, 16, 45, tzinfo=UTC).timestamp())
    _, decoded, _ = fetch(store, metric="step_count", bucket="hour", from_=str(start * 1000),
                          to=str(end * 1000), tz="local")
    must, touched = must_read(points, "local", *(dt.datetime.fromtimestamp(t, UTC).strftime(
        "%Y-%m-%dT%H:%M:%SZ") for t in (start, end)), "hour")
    assert decoded <= must, (decoded, must, touched)
    # export --bucket day with dates, in this process (it only reads, beside the server)
    for tz in ("local", "Asia/Kolkata"):
        args = healthlog.build_parser().parse_args([
            "export", "--data", str(store.data_dir), "--metric", "step_count", "--bucket",
            "day", "--from", "2024-10-26", "--to", "2024-11-03", "--tz", tz])
        out = io.BytesIO()
        before = healthlog.READ_DECODES.objects
        assert healthlog.run_export(healthlog.build_config(args, {}), args, out) == 0
        decoded = healthlog.READ_DECODES.objects - before
        answer = json.loads(out.getvalue())
        assert answer["runs"] and answer["from"] in ("2024-10-26", "2024-10-25T18:30:00Z")
        must, touched = must_read(points, tz, "2024-10-26", "2024-11-03", "day")
        assert decoded <= must and touched >= 100, (tz, decoded, must, touched)


# ---------------------------------------------------------------------------------------------
# READ-18.2: raw points of whole hours come from their stored text and spans

@pytest.mark.parametrize("fmt", ["json", "csv"])
def test_read_18_2_raw_points_read_only_the_hours_at_their_edges_point_by_point(store, fmt):
    points = store.corpus.points["heart_rate"]
    for first, last in (("2024-10-26", "2024-10-28"), ("2024-10-29", "2024-11-02")):
        _, decoded, checked = fetch(store, metric="heart_rate", format=fmt, from_=first,
                                    to=last, tz="local")
        must, touched = must_read(points, "local", first, last, "day")
        if fmt == "json":
            assert decoded == touched and checked <= must, (first, decoded, touched, checked)
            continue
        # CSV reads its columns first: a whole hour's from its tally, an hour at an edge
        # from its points (decoded and read point by point again for its lines)
        assert checked % 2 == 0 and checked <= must * 2, (first, checked, must)
        assert decoded == touched + checked // 2, (first, decoded, touched, checked)


# ---------------------------------------------------------------------------------------------
# READ-18.5: an hour whose tally names no keys is read for them

def test_read_18_5_an_hour_whose_tally_names_no_keys_is_read_for_them(store, folded,
                                                                         start_service,
                                                                         tmp_path):
    """The store as a version that wrote tallies without ``k`` left it: a copy of the
    folded data directory with ``k`` taken out of every tally."""
    older = tmp_path / "older"
    shutil.copytree(folded[0], older)
    conn = sqlite3.connect(str(older / healthlog.DB_NAME))
    with conn:
        rows = conn.execute("SELECT metric, layer, hour, summary FROM object"
                            " WHERE summary IS NOT NULL").fetchall()
        for metric, layer, hour, summary in rows:
            tally = json.loads(summary)
            assert "k" in tally
            del tally["k"]
            conn.execute("UPDATE object SET summary = ? WHERE metric = ? AND layer = ?"
                         " AND hour = ?", (json.dumps(tally), metric, layer, hour))
    conn.close()
    old = Store(older, start_service(data_dir=older, log_level="INFO").address, folded[1])
    for metric in ("heart_rate", "step_count"):
        for first, last in (("2024-10-26", "2024-10-28"), ("2024-10-29", "2024-11-02")):
            query = dict(metric=metric, format="csv", from_=first, to=last, tz="local")
            named, _, _ = fetch(store, **query)
            body, decoded, _ = fetch(old, **query)
            assert body == named, query
            _, touched = must_read(store.corpus.points[metric], "local", first, last, "day")
            assert decoded == touched * 2, (query, decoded, touched)


# ---------------------------------------------------------------------------------------------
# READ-18.3: the fast answer is the slow answer, byte for byte

BOUNDS = ((None, None), ("2024-10-27", "2024-10-27"), ("2024-10-26", "2024-10-30"),
          ("2024-10-29", "2024-11-03"), ("2024-11-02", None), (None, "2024-10-31"),
          ("2024-10-27T00:30:00+02:00", "2024-11-02T07:20:00Z"))
ZONES = ("local", "Europe/Berlin", "Asia/Kolkata", "+05:45", "-04:00")


def requests_to_compare() -> list:
    out = []

    def points(**query) -> None:
        out.append(("/api/points", query))

    for tz in ZONES:
        for first, last in BOUNDS:
            for metric in ("step_count", "heart_rate"):
                for bucket in ("day", "week", "hour")[:3 if first else 2]:
                    points(metric=metric, tz=tz, from_=first, to=last, bucket=bucket)
        for first, last in BOUNDS[1:4]:
            points(metric="active_energy", tz=tz, from_=first, to=last, bucket="day")
        for first, last in BOUNDS[2:4]:
            points(metric="heart_rate", tz=tz, from_=first, to=last, bucket="day",
                   format="csv")
    for tz in ("local", "Asia/Kolkata"):  # raw: the zone makes only the local columns
        for first, last in BOUNDS[1:5]:
            for metric in ("step_count", "heart_rate"):
                for fmt in ("json", "csv"):
                    points(metric=metric, tz=tz, from_=first, to=last, format=fmt)
            for fmt in ("json", "csv"):
                points(metric="sleep_analysis", tz=tz, from_=first, to=last, format=fmt)
    for tz in ("local", "Europe/Berlin", "+05:45"):
        for day in ("2024-10-27", "2024-10-30", "2024-11-01", "2024-11-03"):
            out.append(("/api/summary", {"date": day, "tz": tz}))
    return out


def test_read_18_3_the_fast_answer_is_the_slow_answer_byte_for_byte(store, monkeypatch):
    requests = requests_to_compare()
    for metric in ("step_count", "heart_rate"):  # the page's own requests, as planned
        for view in PAGE_VIEWS:
            for tz in ("local", "Asia/Kolkata"):
                plan = get_json(store.address, "/api/plan", metric=metric, range=view, tz=tz)
                requests.append(("/api/points", plan["points"]))
    fast = [fetch(store, path, **query) for path, query in requests]
    monkeypatch.setattr(healthlog, "_object_part", lambda *args: healthlog.SOME)
    slow = [fetch(store, path, **query) for path, query in requests]
    for (path, query), (fast_body, fast_decoded, fast_checked), (
            slow_body, slow_decoded, slow_checked) in zip(requests, fast, slow):
        assert fast_body == slow_body, (path, query)
        assert fast_decoded <= slow_decoded and fast_checked <= slow_checked, (path, query)
    # the fast path was taken: most hours were neither decoded for a bucket nor checked
    # point by point
    assert sum(f[2] for f in fast) * 5 < sum(s[2] for s in slow)


# ---------------------------------------------------------------------------------------------
# READ-18.4: the summary costs what its windows hold, whatever the history before them

def sqlite_steps(data_dir, read) -> tuple:
    """(SQLite virtual machine steps, objects decoded) of ``read(conn)`` on a connection of
    its own: a measure of the work a read asks of the store, which no timing gives."""
    conn = healthlog.connect(data_dir / healthlog.DB_NAME)
    steps = [0]

    def step() -> int:
        steps[0] += 1
        return 0

    try:
        conn.execute("BEGIN")
        conn.set_progress_handler(step, 100)
        before = healthlog.READ_DECODES.objects
        read(conn)
        return steps[0], healthlog.READ_DECODES.objects - before
    finally:
        conn.set_progress_handler(None, 0)
        conn.execute("COMMIT")
        conn.close()


def history_body(first: dt.date, days: int) -> bytes:
    """Steps and heart rate of the same Minutes automation years before the journey, a
    point an hour for ``days`` days (the phone was in Berlin): history in the layer the
    summary reads, but outside every window it shows."""
    phone = hf.Phone(zone=hf.BERLIN, sources="single")
    start = dt.datetime(first.year, first.month, first.day, tzinfo=UTC)
    steps, heart = [], []
    for hour in range(days * 24):
        stamp = phone.time(start + dt.timedelta(hours=hour))
        steps.append({"date": stamp, "qty": 40 + hour % 300, "source": hf.OWNER_WATCH})
        heart.append({"date": stamp, "Min": 55, "Avg": 60 + hour % 20, "Max": 90,
                      "source": hf.OWNER_WATCH})
    return hf.dumps_hae(hf.envelope(metrics=[hf.metric("step_count", steps),
                                             hf.metric("heart_rate", heart)]), pretty=False)


def test_read_18_4_the_summary_costs_the_same_whatever_the_history_before_its_windows(
        start_service):
    service = start_service(log_level="INFO")
    client = Client(*service.address)
    data_dir = service.config.data_dir
    recent = [d for d in build_corpus().deliveries if b"sleep_analysis" not in d[1]][-3:]
    for headers, body in recent:
        assert client.ingest(body, headers=headers)[0] == 200

    def folded() -> bool:
        return all(row["parse_status"] == "parsed" for row in db_rows(data_dir))

    wait_for(folded, timeout=60, what="the recent days folded")
    reads = {
        "summary of a day": lambda conn: healthlog.summary(
            conn, {"date": "2024-11-04", "tz": "local"}),
        "summary of the newest day": lambda conn: healthlog.summary(conn, {"tz": "local"}),
        "summary in a zone": lambda conn: healthlog.summary(
            conn, {"date": "2024-11-04", "tz": "Europe/Berlin"}),
        "the freshness the summary carries": lambda conn: healthlog.freshness_of(
            conn, data_dir, service.config.clock(), service.config.late_after_s),
        "plan of a week": lambda conn: healthlog.plan_view(
            conn, {"metric": "step_count", "range": "7d", "tz": "local"}),
        "a week by day": lambda conn: b"".join(healthlog.render_points(
            conn, healthlog.point_query(conn, {"metric": "step_count", "bucket": "day",
                                               "from": "2024-10-30", "to": "2024-11-05"}))),
    }
    short = {name: sqlite_steps(data_dir, read) for name, read in reads.items()}
    # years of hourly points before the summary's windows (its trends look 455 days back)
    hours = healthlog.HOUR_US // healthlog.US
    for first in (dt.date(2021, 1, 1), dt.date(2021, 7, 2)):
        body = history_body(first, 182)
        assert client.ingest(body, headers=hf.headers_for(MINUTES))[0] == 200
    wait_for(folded, timeout=120, what="the history folded")
    conn = sqlite3.connect(str(data_dir / healthlog.DB_NAME))
    objects = conn.execute("SELECT count(*) FROM object WHERE hour < ?",
                           (int(dt.datetime(2022, 1, 1, tzinfo=UTC).timestamp()) // hours,)
                           ).fetchone()[0]
    conn.close()
    assert objects >= 364 * 24 * 2  # the history is there, in its own hours
    long = {name: sqlite_steps(data_dir, read) for name, read in reads.items()}
    for name in reads:
        (short_steps, short_decoded), (long_steps, long_decoded) = short[name], long[name]
        assert long_decoded == short_decoded, (name, short_decoded, long_decoded)
        # the same work, never a scan of the history's 17,472 hours (a scan takes at least
        # one step of the handler's 100 an hour)
        assert long_steps <= short_steps + 10, (name, short_steps, long_steps)


TRICKY = ["plain", "", "a,b", 'say "hi"', '"', "line\nbreak", "cr\rhere", "\r\n", " lead",
          "=1+1", "+SUM(1,2)", "-2", "@A1", "|cmd", "\uff1d1", "\tx", "Antons\u2019 Watch",
          "\u00e9\u00e8,\u00ea", "\U0001f600"]
"""Texts a raw CSV must write as the csv module does: commas, quotes and line breaks
quoted (quotes doubled), formulas made harmless with a leading ``'``, any other text as it
is."""
QUOTED_ONLY = [["plain", "x" + character + "y", "Antons\u2019 Watch"]
               for character in (",", '"', "\r", "\n")]
"""Hours of texts none of which can start a formula, and one of which holds one character
that makes the csv module quote it: written a column at a time, where the quoting alone
decides, for each such character."""


def test_read_18_3_raw_csv_is_what_the_csv_module_writes(start_service):
    """Raw CSV is written without the csv module (READ-18's speed): its bytes are those the
    csv module writes for the cells it holds, whatever the texts and numbers."""
    service = start_service(log_level="INFO")
    points = []
    for hour, texts in enumerate([TRICKY] + QUOTED_ONLY, 2):
        for minute, text in enumerate(texts):
            points.append({"date": "2024-10-27 %02d:%02d:00 +0100" % (hour, minute), "qty": [
                -5, 0.1, 1e-07, 1e16, 2 ** 62, 123456.789, -0.0][minute % 7], "note": text,
                "nested": {"a": [text, 1.5]} if minute % 3 else None,
                "flag": minute % 2 == 0, "source": text})
    body = hf.dumps_hae(hf.envelope(metrics=[hf.metric("step_count", points, "cou,nt")]))
    assert Client(*service.address).ingest(body, headers={"automation-aggregation":
                                                          "Minutes"})[0] == 200
    wait_for(lambda: db_rows(service.config.data_dir, "SELECT parse_status FROM delivery")[0][
        "parse_status"] == "parsed", what="the delivery folded")
    for query in ({}, {"from_": "2024-10-27", "to": "2024-10-27"}, {"tz": "Asia/Kolkata"}):
        reply = get(service.address, "/api/points", metric="step_count", format="csv", **query)
        assert reply.status == 200
        rows = list(csv.reader(io.StringIO(reply.body.decode(), newline="")))
        assert len(rows) == len(points) + 1
        written = io.StringIO()
        csv.writer(written, lineterminator="\r\n").writerows(rows)
        assert written.getvalue().encode() == reply.body, query
        notes = [row[rows[0].index("note")] for row in rows[1:]]
        assert [note.lstrip("'") if note.startswith("'") and note[1:] in TRICKY else note
                for note in notes] == TRICKY + sum(QUOTED_ONLY, [])


NUMBERS = st.one_of(st.floats(allow_nan=False, allow_infinity=False),
                    st.integers(-(2 ** 70), 2 ** 70),
                    st.floats(1e-5, 1e17), st.floats(-1e17, -1e-5),
                    st.sampled_from([0, 0.0, -0.0, 1e-4, -1e-4, 1e16, -1e16,
                                     9999999999999998.0, 9.999999999999999e-05]))
"""Numbers a raw CSV column holds, crowded around where ``str`` changes notation."""


@settings(max_examples=300, deadline=None)
@given(st.lists(NUMBERS, max_size=70), st.booleans())
def test_read_18_3_a_column_of_numbers_is_written_as_str_writes_each(column, as_tuple):
    """A whole hour's column of numbers is written in one piece (by orjson where it writes
    what ``str`` writes): every cell is what the csv module writes for that number."""
    cells = healthlog._number_cells(tuple(column) if as_tuple else column)
    assert cells == [str(number) for number in column]
