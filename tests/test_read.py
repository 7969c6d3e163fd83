"""The read side: /api/catalog, /api/points, /api/deliveries, /metrics, the page and its
session, and ``healthlog export``, end to end.

One known corpus (`CORPUS`: HAE-shaped bodies built here, every posted point remembered) is
posted over HTTP to a real ``healthlog.py serve`` subprocess on 127.0.0.1:0 and folded by
its live worker into a real SQLite file, once per JSON mode (`store`). A subprocess, not an
in-process Service, because the module's server outlives single tests and an in-process one
opens a database connection per HTTP thread on first use, which the suite's leak check
(conftest.nothing_left_running) would pin on whichever test came first. Tests that need a
state of their own (counters that move) start their own in-process Service.

Every expectation is computed in the test: from what was posted (the points are stored
verbatim, so raw reads give them back), from the ``object`` table, and from the test's own
aggregation of the posted points in the phone's local time (tests/read_helpers.py: each point
in the offset its timestamp was written in, or the ``tz`` asked); none from healthlog's code.

Names carry the scenario IDs READ-n.m: READ-1 catalog, READ-2 raw points, READ-3 buckets,
READ-4 CSV, READ-5 deliveries, READ-6 /metrics, READ-7 page, session and security headers,
READ-8 the export CLI, READ-12 the corpus's nights. Time zones, DST and sleep in all its forms
are in tests/test_read_time.py, the meaning table and the lists of records in
tests/test_read_records.py.
"""

from __future__ import annotations

import csv
import datetime as dt
import gzip
import hashlib
import hmac
import io
import json
import random
import re
import sqlite3
import subprocess
import sys
import time
import urllib.parse
import zoneinfo
from pathlib import Path
from typing import NamedTuple, Optional

import pytest

import hae_factory as hf
import healthlog
from conftest import ROOT, TOKEN, Client, db_rows, object_rows, run_export, wait_for
from read_helpers import (Reply, Store, aggregate, assert_buckets_equal, assert_error,
                          assert_nights_equal, assert_security_headers, call, close, coordinate,
                          get, get_json, in_range, instant_us, iso_local, night_items,
                          nights_by_date, numeric, pending, raw_runs, raw_start, read_csv, select,
                          serve_corpus, sleep_dates, utc_iso, week_items, written)

pytestmark = pytest.mark.usefixtures("json_mode")  # every test with and without orjson

US = 1_000_000
HOUR_US = 3600 * US
DAY0 = 1709856000  # 2024-03-08T00:00:00Z (a Friday; the US DST change is on the 10th)
SESSION_MAX_AGE = 2592000
#: Strings of the posted bodies that no journal or monitoring answer may carry.
BODY_STRINGS = (hf.CANARY_SOURCE, "Zebulon", "72.123456789", hf.OWNER_WATCH, "Anton",
                "Ibuprofen", "Headache")


# ---------------------------------------------------------------------------------------------
# The corpus: bodies built here, every posted point remembered with its units.

def hae(t: float, zone: hf.Zone = hf.PACIFIC) -> str:
    """HAE's ``yyyy-MM-dd HH:mm:ss ±hhmm`` of epoch second ``t`` as a phone in ``zone``."""
    return hf.hae_time(t, zone)


class Corpus:
    """The deliveries to post, in order, and the points each (metric, layer) must hold."""

    def __init__(self):
        self.deliveries: list = []  # (automation name, headers, body bytes)
        self.posted: dict = {}  # (metric, layer) -> [(point, units)] in posting order

    def add(self, automation: hf.Automation, data: dict, layer: Optional[str],
            stored: bool = True) -> None:
        """One delivery; ``layer`` is where its time-grouped metrics go (header)."""
        headers = hf.headers_for(automation, hf.new_uuid(random.Random(automation.name)))
        self.deliveries.append((automation.name, headers, hf.dumps_hae({"data": data})))
        if not stored:
            return
        for element in data.get("metrics", []):
            name = element["name"]
            target = "record" if name == "sleep_analysis" else layer
            self._keep(name, target, element["data"], element["units"])
        named = {"workouts": lambda p: "workouts", "stateOfMind": lambda p: "state_of_mind",
                 "symptoms": lambda p: "symptoms/" + p["name"],
                 "medications": lambda p: "medications/" + p["displayText"]}
        for section, name_of in named.items():
            for point in data.get(section, []):
                self._keep(name_of(point), "record", [point], None)

    def _keep(self, metric: str, layer: str, points: list, units: Optional[str]) -> None:
        self.posted.setdefault((metric, layer), []).extend((p, units) for p in points)

    def points(self, metric: str, layer: str) -> list:
        """(point, units) of a metric and layer in the order reads must give them."""
        return sorted(self.posted[(metric, layer)], key=lambda item: coordinate(item[0]))


def build_corpus() -> Corpus:
    rng = random.Random(20240308)
    corpus = Corpus()
    sources = (hf.OWNER_WATCH, hf.PIPED_SOURCE, None, hf.OWNER_PHONE)

    def with_source(point: dict, k: int) -> dict:
        if sources[k % 4] is not None:
            point["source"] = sources[k % 4]
        return point

    # 1. Minutes: two hours of steps (18:00-19:59Z) and five days of heart rate every 7 min
    #    (Min/Avg/Max; every tenth point without Max; one canary value and device name).
    steps = [with_source({"date": hae(DAY0 + 18 * 3600 + 60 * k),
                          "qty": k + 1 if k % 2 else 10.25 + rng.random() * 50}, k)
             for k in range(120)]
    heart = []
    for k in range(5 * 1440 // 7):
        low = rng.randint(48, 70)
        point = {"date": hae(DAY0 + 420 * k), "Min": low, "Avg": low + rng.uniform(0.5, 20),
                 "Max": low + rng.randint(21, 60)}
        if k % 10 == 3:
            del point["Max"]
        heart.append(with_source(point, k))
    heart[77]["Avg"], heart[77]["source"] = hf.CANARY_QTY, hf.CANARY_SOURCE
    corpus.add(hf.Automation("Read minutes", "Minutes"),
               {"metrics": [hf.metric("step_count", steps, "count"),
                            hf.metric("heart_rate", heart, "count/min")]}, "minutes")
    # 2. Hours: a day of hourly steps (so step_count has two layers; minutes is the finer).
    corpus.add(hf.Automation("Read hours", "Hours", "Today"),
               {"metrics": [hf.metric("step_count", [
                   {"date": hae(DAY0 + 3600 * h), "qty": 100 + 7 * h, "source": hf.OWNER_WATCH}
                   for h in range(24)], "count")]}, "hours")
    # 3-5. Active energy in kcal for two hours, then NEW hours in kJ, then kcal again.
    for name, units, first_hour, hours in (("Read energy kcal", "kcal", 10, 2),
                                           ("Read energy kJ", "kJ", 12, 2),
                                           ("Read energy kcal again", "kcal", 14, 1)):
        energy = [{"date": hae(DAY0 + first_hour * 3600 + 180 * k),
                   "qty": rng.uniform(0.1, 9.0), "source": hf.OWNER_WATCH}
                  for k in range(hours * 20)]
        corpus.add(hf.Automation(name, "Minutes"),
                   {"metrics": [hf.metric("active_energy", energy, units)]}, "minutes")
    # 6. Sleep stage records (unaggregated) of four nights.
    segments = hf.sleep_segments(11, dt.date(2024, 3, 9), dt.date(2024, 3, 13),
                                 phone=hf.Phone(sources="single"), rng=rng)
    corpus.add(hf.Automation("Read sleep", "Default", "Previous 7 Days"),
               {"metrics": [hf.metric("sleep_analysis", segments, "hr")]}, None)
    # 7. Record sections: a workout, a mood, symptoms and medications (named by value).
    noon = dt.datetime(2024, 3, 9, 12, 0)
    medications = hf.medications(rng, noon)
    assert medications[0]["displayText"].startswith("Ibuprofen")
    corpus.add(hf.Automation("Read journal", "Default"), {
        "workouts": [hf.workout_v2(3, dt.datetime(2024, 3, 9, 17, 30), minutes=20,
                                   route_points=5, rng=rng)],
        "stateOfMind": [hf.state_of_mind(rng, DAY0 + 86400 + 30000)],
        "symptoms": hf.symptoms(rng, dt.datetime(2024, 3, 9, 9, 15)),
        "medications": medications}, None)
    # 8. Days: a body metric, a nutrition metric and one no group knows.
    days = [hae(hf.local_midnight(hf.PACIFIC, dt.date(2024, 3, 8 + d))) for d in range(3)]
    corpus.add(hf.Automation("Read days", "Days", "Today"), {"metrics": [
        hf.metric("weight_body_mass", [{"date": d, "qty": 74.1 + i / 10, "source": hf.OWNER_PHONE}
                                       for i, d in enumerate(days)], "kg"),
        hf.metric("dietary_water", [{"date": d, "qty": 1500 + i} for i, d in enumerate(days)],
                  "mL"),
        hf.metric("zz_future_metric", [{"date": d, "qty": i} for i, d in enumerate(days[:2])],
                  "count")]}, "days")
    # 9. No readable time at all: failed, nothing stored.
    corpus.add(hf.Automation("Read broken", "Minutes"), {"metrics": [hf.metric(
        "step_count", [{"date": "yesterday", "qty": 3, "source": hf.CANARY_SOURCE}], "count")]},
        "minutes", stored=False)
    # 10. A section this version does not know: partial, its step points stored.
    late = [{"date": "2024-03-20 09:0%d:00 +0000" % m, "qty": m} for m in (1, 2, 3)]
    corpus.add(hf.Automation("Read partial", "Minutes"),
               {"metrics": [hf.metric("step_count", late, "count")],
                "futureSection": [{"date": "2024-03-20 09:00:00 +0000", "mood": "ok"}]},
               "minutes")
    return corpus


CORPUS = build_corpus()


# ---------------------------------------------------------------------------------------------
# The module store.

@pytest.fixture(scope="module")
def store(tmp_path_factory, json_mode) -> Store:
    """The corpus posted to a serve subprocess and folded by its worker; the server keeps
    running for the module (export runs beside it)."""
    yield from serve_corpus(tmp_path_factory.mktemp("read"), CORPUS,
                            [(h, b) for _, h, b in CORPUS.deliveries], all_parsed=False)


# ---------------------------------------------------------------------------------------------
# The test's own reading of the points (runs and bucket aggregates: tests/read_helpers.py).

# ---------------------------------------------------------------------------------------------
# READ-1: /api/catalog

def expected_catalog(data_dir: Path) -> list:
    """One entry per (metric, layer), from the object table (groups left out)."""
    entries: dict = {}
    for row in object_rows(data_dir):
        entry = entries.setdefault((row["metric"], row["layer"]), {
            "metric": row["metric"], "layer": row["layer"], "units": set(),
            "first": row["first_at"], "last": row["last_at"], "objects": 0, "points": 0})
        if row["units"] is not None:
            entry["units"].add(row["units"])
        entry["first"] = min(entry["first"], row["first_at"])
        entry["last"] = max(entry["last"], row["last_at"])
        entry["objects"] += 1
        entry["points"] += row["points"]
    return [dict(e, units=sorted(e["units"]), first=utc_iso(e["first"] * US),
                 last=utc_iso(e["last"] * US)) for _, e in sorted(entries.items())]


def test_read_1_1_catalog_lists_every_metric_and_layer_with_exact_counts_and_span(store):
    catalog = get_json(store.address, "/api/catalog")["metrics"]
    want = expected_catalog(store.data_dir)
    assert [{k: v for k, v in e.items() if k not in ("group", "meaning")} for e in catalog] == want
    assert all(e["meaning"]["group"] == e["group"] for e in catalog)  # READ-13: one table
    # … and the object table holds exactly what was posted (stored verbatim, nothing lost).
    assert {(e["metric"], e["layer"]) for e in want} == set(store.corpus.posted)
    for entry in catalog:
        items = store.corpus.points(entry["metric"], entry["layer"])
        starts = [coordinate(p)[0] for p, _ in items]
        assert entry["points"] == len(items), entry
        assert entry["first"] == utc_iso(min(starts) // US * US), entry
        assert entry["last"] == utc_iso(max(starts) // US * US), entry
        assert entry["units"] == sorted({u for _, u in items if u is not None}), entry
        assert entry["objects"] == len({s // HOUR_US for s in starts}), entry
    energy = next(e for e in catalog if e["metric"] == "active_energy")
    assert energy["units"] == ["kJ", "kcal"] and energy["objects"] == 5


def test_read_1_2_catalog_groups_metrics_by_name(store):
    groups = {(e["metric"], e["layer"]): e["group"]
              for e in get_json(store.address, "/api/catalog")["metrics"]}
    assert groups[("step_count", "minutes")] == groups[("step_count", "hours")] == "activity"
    assert groups[("active_energy", "minutes")] == "activity"
    assert groups[("heart_rate", "minutes")] == "heart"
    assert groups[("sleep_analysis", "record")] == "sleep"
    assert groups[("weight_body_mass", "days")] == "body"
    assert groups[("dietary_water", "days")] == "nutrition"
    assert groups[("workouts", "record")] == "workouts"
    assert groups[("state_of_mind", "record")] == "mindfulness"
    assert groups[("zz_future_metric", "days")] == "other"
    assert set(groups.values()) <= {"activity", "heart", "sleep", "body", "nutrition",
                                    "workouts", "mindfulness", "other"}


# ---------------------------------------------------------------------------------------------
# READ-2: /api/points, raw

def test_read_2_1_raw_points_are_the_posted_points_verbatim_in_time_order(store):
    for metric, layer in sorted(store.corpus.posted):
        reply = get_json(store.address, "/api/points", metric=metric, layer=layer)
        items = store.corpus.points(metric, layer)
        assert reply["metric"] == metric and reply["layer"] == layer
        assert reply["from"] is None and reply["to"] is None
        assert reply["runs"] == raw_runs(items), (metric, layer)
        assert "bucket" not in reply or reply["bucket"] is None
    # one step per minute, in time order, the canary heart-rate point among them
    steps = get_json(store.address, "/api/points", metric="step_count")["runs"][0]["points"]
    starts = [coordinate(p)[0] for p in steps]
    assert starts == sorted(starts) and len(steps) == 123
    heart = get_json(store.address, "/api/points", metric="heart_rate")["runs"][0]["points"]
    assert {"date": hae(DAY0 + 420 * 77), "Min": heart[77]["Min"], "Avg": hf.CANARY_QTY,
            "Max": heart[77]["Max"], "source": hf.CANARY_SOURCE} == heart[77]


def test_read_2_2_without_a_layer_the_finest_is_read_and_named(store):
    minutes = get_json(store.address, "/api/points", metric="step_count")
    assert minutes["layer"] == "minutes"  # has minutes and hours; not the alphabetical first
    hours = get_json(store.address, "/api/points", metric="step_count", layer="hours")
    assert hours["layer"] == "hours"
    assert hours["runs"] == raw_runs(store.corpus.points("step_count", "hours"))
    assert get_json(store.address, "/api/points", metric="workouts")["layer"] == "record"
    for layer in ("days", "record", "seconds", "no-such-layer"):
        assert_error(get(store.address, "/api/points", metric="step_count", layer=layer),
                     404, "unknown_layer")


def test_read_2_3_from_and_to_select_starts_in_a_half_open_range_in_any_spelling(store):
    items = store.corpus.points("step_count", "minutes")
    t1830, t1945 = (DAY0 + 18 * 3600 + 1800) * US, (DAY0 + 19 * 3600 + 2700) * US
    spellings = [
        ("2024-03-08T18:30:00Z", "2024-03-08T19:45:00Z"),
        ("2024-03-08T10:30:00-08:00", "2024-03-08T20:45:00+01:00"),
        ("2024-03-08 10:30:00 -0800", "2024-03-08 19:45:00 +0000"),
        (str(DAY0 + 18 * 3600 + 1800), str((DAY0 + 19 * 3600 + 2700) * 1000)),  # s and ms
    ]
    want = raw_runs(in_range(items, t1830, t1945))
    assert len(want[0]["points"]) == 75  # 18:30 included, 19:45 excluded
    for start, end in spellings:
        reply = get_json(store.address, "/api/points", metric="step_count", from_=start, to=end)
        assert (reply["from"], reply["to"]) == ("2024-03-08T18:30:00Z", "2024-03-08T19:45:00Z")
        assert reply["runs"] == want, (start, end)
    # the same half-open range in buckets and in CSV (a point starts exactly at `to`)
    buckets = get_json(store.address, "/api/points", metric="step_count", bucket="hour",
                       from_=spellings[0][0], to=spellings[0][1])
    assert_buckets_equal(buckets["runs"], aggregate(in_range(items, t1830, t1945), "hour"))
    assert [b["count"] for b in buckets["runs"][0]["buckets"]] == [30, 45]
    rows = read_csv(get(store.address, "/api/points", metric="step_count", format="csv",
                        from_=spellings[3][0], to=spellings[3][1]))
    assert [row[0] for row in rows[1:]] == [utc_iso(coordinate(p)[0]) for p in want[0]["points"]]
    # a date alone with tz an offset is a whole day of that offset: `from` its midnight,
    # `to` up to the next one (it includes its day), echoed as the UTC instants; with
    # tz=local (the default) it is the date written in each point, echoed as the date;
    # either bound may be left open
    heart = store.corpus.points("heart_rate", "minutes")
    day9, day10 = (DAY0 + 86400) * US, (DAY0 + 2 * 86400) * US
    reply = get_json(store.address, "/api/points", metric="heart_rate", from_="2024-03-09",
                     to="2024-03-09", tz="+00:00")
    assert (reply["from"], reply["to"]) == ("2024-03-09T00:00:00Z", "2024-03-10T00:00:00Z")
    assert reply["runs"] == raw_runs(in_range(heart, day9, day10))
    reply = get_json(store.address, "/api/points", metric="heart_rate", from_="2024-03-10",
                     tz="-08:00")
    assert (reply["from"], reply["to"]) == ("2024-03-10T08:00:00Z", None)
    assert reply["runs"] == raw_runs(in_range(heart, day10 + 8 * HOUR_US, None))

    def written_on(first: Optional[str], last: Optional[str]) -> list:
        return [(p, u) for p, u in heart if (first is None or raw_start(p)[:10] >= first)
                and (last is None or raw_start(p)[:10] <= last)]

    for first, last in (("2024-03-09", "2024-03-10"), (None, "2024-03-08"),
                        ("2024-03-11", None)):
        reply = get_json(store.address, "/api/points", metric="heart_rate", from_=first,
                         to=last)
        assert (reply["tz"], reply["from"], reply["to"]) == ("local", first, last)
        assert reply["runs"] == raw_runs(written_on(first, last)), (first, last)
        assert reply["runs"] != raw_runs(in_range(heart, day9, day9 + 2 * 86400 * US))
    empty = get_json(store.address, "/api/points", metric="heart_rate", from_="2030-01-01")
    assert empty["runs"] == []


def test_read_2_4_a_change_of_units_starts_a_new_run(store):
    reply = get_json(store.address, "/api/points", metric="active_energy")
    assert [run["units"] for run in reply["runs"]] == ["kcal", "kJ", "kcal"]
    assert [len(run["points"]) for run in reply["runs"]] == [40, 40, 20]
    assert reply["runs"] == raw_runs(store.corpus.points("active_energy", "minutes"))
    for run in reply["runs"]:  # each run holds only the points posted in its units
        posted = [p for p, u in store.corpus.points("active_energy", "minutes")
                  if u == run["units"]]
        assert all(p in posted for p in run["points"])
    inside = get_json(store.address, "/api/points", metric="active_energy",
                      from_="2024-03-08T12:30:00Z", to="2024-03-08T14:30:00Z")
    assert [(r["units"], len(r["points"])) for r in inside["runs"]] == [("kJ", 30), ("kcal", 10)]


def test_read_2_5_a_plus_in_the_query_is_a_plus_and_long_numbers_are_400(store):
    # As typed into curl: "+" unencoded in an offset or a time is a plus, not a space.
    plain = get_json(store.address, "/api/points", metric="heart_rate", bucket="day",
                     tz="+02:00")
    raw = call(store.address, "GET", "/api/points?metric=heart_rate&bucket=day&tz=+02:00")
    assert raw.status == 200 and raw.json() == plain
    ranged = call(store.address, "GET", "/api/points?metric=heart_rate"
                  "&from=2024-03-09T00:00:00+00:00&to=2024-03-10T00:00:00+00:00")
    assert ranged.status == 200 and ranged.json()["from"] == "2024-03-09T00:00:00Z"
    assert_error(get(store.address, "/api/points", metric="heart_rate", from_="9" * 5000),
                 400, "bad_request")


def test_read_3_1_a_sum_beyond_a_double_is_null(start_service):
    service = start_service()
    huge = [{"date": "2024-03-08 10:%02d:00 -0800" % m, "qty": 1e308} for m in range(3)]
    body = hf.dumps_hae(hf.envelope(metrics=[hf.metric("step_count", huge, "count")]))
    client = Client(*service.address)
    assert client.ingest(body, headers={"automation-aggregation": "Minutes"})[0] == 200
    wait_for(lambda: db_rows(service.config.data_dir, "SELECT parse_status FROM delivery")
             [0]["parse_status"] == "parsed")
    reply = call(service.address, "GET", "/api/points?metric=step_count&bucket=hour")
    def no_constants(name):
        raise AssertionError("not JSON: " + name)

    [bucket] = json.loads(reply.body, parse_constant=no_constants)["runs"][0]["buckets"]
    assert bucket["fields"]["qty"] == {"count": 3, "min": 1e308, "max": 1e308, "avg": None,
                                       "sum": None}


@pytest.mark.parametrize("query", [
    {},  # no metric
    {"metric": ""},
    {"metric": "step_count", "from_": "yesterday"},
    {"metric": "step_count", "to": "2024-13-45"},
    {"metric": "step_count", "from_": "2024-03-08T19:00:00Z", "to": "2024-03-08T19:00:00Z"},
    {"metric": "step_count", "from_": "2024-03-09", "to": "2024-03-08"},
    {"metric": "step_count", "bucket": "month"},
    {"metric": "step_count", "bucket": "hour", "tz": "+25:00"},
    {"metric": "step_count", "bucket": "day", "tz": "PST"},
    {"metric": "step_count", "tz": "Mars/Olympus_Mons"},
    {"metric": "step_count", "tz": "../../etc/passwd"},
    {"metric": "step_count", "format": "xml"},
    {"metric": "step_count", "bucket": "day", "format": "sqlite"},
    {"metric": "sleep_analysis", "bucket": "hour"},
    {"metric": "step_count", "from_": "2024-02-30"},
], ids=["no-metric", "empty-metric", "bad-from", "bad-to", "from-equals-to", "from-after-to",
        "bad-bucket", "tz-out-of-range", "tz-name", "tz-unknown-zone", "tz-path",
        "bad-format", "sqlite-over-http", "sleep-per-hour", "no-such-date"])
def test_read_2_5_unreadable_parameters_are_400(store, query):
    assert_error(get(store.address, "/api/points", **query), 400, "bad_request")


def test_read_2_6_an_unknown_metric_is_404_listing_names_with_entered_values_masked(store):
    error = assert_error(get(store.address, "/api/points", metric="steps"), 404,
                         "unknown_metric")
    names = {e["metric"] for e in get_json(store.address, "/api/catalog")["metrics"]}
    masked = set()
    for name in names:
        prefix = next((p for p in ("symptoms/", "cycle_tracking/", "medications/")
                       if name.startswith(p)), None)
        masked.add(prefix + "…" if prefix else name)
    assert len(error["metrics"]) == len(set(error["metrics"]))  # deduplicated
    assert set(error["metrics"]) == masked
    assert {"medications/…", "symptoms/…", "step_count"} <= masked
    reply = get(store.address, "/api/points", metric="steps")
    for secret in ("Ibuprofen", "Cetirizine", "Vitamin", "Headache", "Fatigue", "Coughing",
                   "Runny", "Sore", "Nausea"):
        assert secret not in reply.text and secret not in json.dumps(error, ensure_ascii=False)
    # a value-derived metric is still read by its full name
    medication = next(n for n in names if n.startswith("medications/Ibuprofen"))
    reply = get_json(store.address, "/api/points", metric=medication)
    assert reply["runs"] == raw_runs(store.corpus.points(medication, "record"))


# ---------------------------------------------------------------------------------------------
# READ-3: /api/points with a bucket

@pytest.mark.parametrize("metric,bucket", [("heart_rate", "hour"), ("heart_rate", "day"),
                                           ("heart_rate", "week"), ("step_count", "hour"),
                                           ("active_energy", "day")])
def test_read_3_1_bucket_aggregates_equal_the_tests_own(store, metric, bucket):
    reply = get_json(store.address, "/api/points", metric=metric, bucket=bucket)
    assert (reply["metric"], reply["layer"], reply["bucket"], reply["tz"]) == (
        metric, "minutes", bucket, "local")
    assert (reply["from"], reply["to"]) == (None, None)
    want = aggregate(store.corpus.points(metric, "minutes"), bucket)  # tz=local: as written
    assert_buckets_equal(reply["runs"], want)
    if bucket != "hour":  # each point on the date written in it, not on its UTC date
        dates = {raw_start(p)[:10] for p, _ in store.corpus.points(metric, "minutes")}
        if bucket == "day":
            assert {b["date"] for r in reply["runs"] for b in r["buckets"]} == dates
        assert all(b["local"][11:19] == "00:00:00" for r in reply["runs"]
                   for b in r["buckets"])
    if metric == "heart_rate":  # per-field counts differ: every tenth point lacks Max
        fields = reply["runs"][0]["buckets"][0]["fields"]
        assert set(fields) == {"Min", "Avg", "Max"}
        if bucket != "hour":
            assert fields["Max"]["count"] < fields["Avg"]["count"] == reply["runs"][0][
                "buckets"][0]["count"]


def test_read_3_2_buckets_are_aligned_in_the_requested_offset(store):
    heart = store.corpus.points("heart_rate", "minutes")
    for bucket, tz in (("day", "-07:00"), ("day", "+05:30"), ("hour", "+05:30"),
                       ("hour", "-08:00"), ("week", "-08:00"), ("week", "+14:00")):
        reply = get_json(store.address, "/api/points", metric="heart_rate", bucket=bucket, tz=tz)
        assert reply["tz"] == tz
        assert_buckets_equal(reply["runs"], aggregate(heart, bucket, tz))
        for entry in reply["runs"][0]["buckets"]:
            assert entry["local"].endswith(tz) and entry["local"][:10] == entry["date"]
            if bucket != "hour":
                assert entry["local"][10:19] == "T00:00:00", entry
            if bucket == "week":
                assert dt.date.fromisoformat(entry["date"]).weekday() == 0, entry
    shifted = get_json(store.address, "/api/points", metric="heart_rate", bucket="day",
                       tz="-07:00")["runs"][0]["buckets"]
    assert shifted[0]["start"] == "2024-03-07T07:00:00Z"  # 2024-03-08 00:00Z is the 7th at -7
    assert (shifted[0]["local"], shifted[0]["date"]) == ("2024-03-07T00:00:00-07:00",
                                                         "2024-03-07")
    half = get_json(store.address, "/api/points", metric="heart_rate", bucket="hour",
                    tz="+05:30")["runs"][0]["buckets"]
    assert all(b["start"].endswith(":30:00Z") and b["local"][13:] == ":00:00+05:30"
               for b in half)
    ranged = get_json(store.address, "/api/points", metric="heart_rate", bucket="day",
                      tz="-07:00", from_="2024-03-09T07:00:00Z", to="2024-03-11T07:00:00Z")
    assert_buckets_equal(ranged["runs"], aggregate(
        in_range(heart, (DAY0 + 86400 + 25200) * US, (DAY0 + 3 * 86400 + 25200) * US),
        "day", "-07:00"))
    assert [b["start"] for b in ranged["runs"][0]["buckets"]] == [
        "2024-03-09T07:00:00Z", "2024-03-10T07:00:00Z"]


def test_read_3_3_a_bucket_never_mixes_units(store):
    for bucket in ("day", "week"):
        reply = get_json(store.address, "/api/points", metric="active_energy", bucket=bucket)
        assert [run["units"] for run in reply["runs"]] == ["kcal", "kJ", "kcal"]
        assert [[b["count"] for b in run["buckets"]] for run in reply["runs"]] == [
            [40], [40], [20]]
        assert_buckets_equal(reply["runs"],
                             aggregate(store.corpus.points("active_energy", "minutes"), bucket))


@pytest.mark.parametrize("bucket,tz", [("day", "local"), ("day", "-08:00"), ("day", "+00:00"),
                                       ("week", "-07:00"), ("week", "local")])
def test_read_12_2_the_corpus_stage_records_give_one_night_per_morning(store, bucket, tz):
    """The corpus's four nights of stage records (in bed from the phone, stages from the
    watch, one across the change to daylight time on 2024-03-10): one night on each morning,
    each stage's hours the seconds its records cover, asleep those of the asleep records."""
    reply = get_json(store.address, "/api/points", metric="sleep_analysis", bucket=bucket,
                     tz=tz)
    assert (reply["layer"], reply["tz"], reply["units"]) == ("record", tz, "hr")
    assert "runs" not in reply
    # the stages in the order every night lists them (READ-13), with how each is read
    assert [(s["stage"], s["asleep"]) for s in reply["stage_order"]] == [
        ("deep", True), ("core", True), ("rem", True), ("asleep", True), ("awake", False)]
    assert all(s["label"] for s in reply["stage_order"])
    records = [p for p, _ in store.corpus.points("sleep_analysis", "record")]
    by_date = nights_by_date([], records, tz)
    if bucket == "day":
        assert_nights_equal(reply["nights"], night_items(by_date, tz))
        assert [n["date"] for n in reply["nights"]] == ["2024-03-%02d" % d
                                                        for d in (9, 10, 11, 12)]
        assert all(n["count"] == 1 and n["asleep"] > 5 and not n["overlapping"]
                   and n["naps"] == [] for n in reply["nights"])
    else:
        assert_nights_equal(reply["nights"], week_items(by_date, tz), week=True)


# ---------------------------------------------------------------------------------------------
# READ-4: CSV

def assert_cell(cell: str, value) -> None:
    """A CSV cell against a stored value: numbers as floats, objects/arrays as JSON text,
    strings verbatim, booleans as JSON literals, a missing key as an empty cell."""
    if isinstance(value, bool):
        assert cell.lower() == json.dumps(value), (cell, value)
    elif numeric(value):
        assert float(cell) == float(value), (cell, value)
    elif isinstance(value, (dict, list)):
        assert json.loads(cell) == value, (cell, value)
    else:
        assert cell == value, (cell, value)


@pytest.mark.parametrize("metric,layer", [("step_count", "minutes"), ("heart_rate", "minutes"),
                                          ("active_energy", "minutes"), ("workouts", "record"),
                                          ("sleep_analysis", "record"),
                                          ("state_of_mind", "record")])
def test_read_4_1_raw_csv_parses_back_to_the_stored_points(store, metric, layer):
    reply = get(store.address, "/api/points", metric=metric, layer=layer, format="csv")
    rows = read_csv(reply)
    assert reply.headers["X-Healthlog-Layer"] == layer
    items = store.corpus.points(metric, layer)
    meaning = {m["metric"]: m["meaning"] for m in get_json(store.address, "/api/catalog")[
        "metrics"]}[metric]
    keys = csv_keys([point for point, _ in items], meaning["fields"])
    assert rows[0] == ["utc_start", "utc_end", "units", "local_start", "local_date"] + keys
    assert len(rows) == 1 + len(items)
    wake_days = sleep_points_dates(items) if metric == "sleep_analysis" else {}
    for row, (point, units) in zip(rows[1:], items):
        start, end, _ = coordinate(point)
        moment = written(raw_start(point))  # the local start and date as the point wrote them
        date = wake_days.get(coordinate(point), moment.date())  # sleep: its wake day
        assert row[:5] == [utc_iso(start), utc_iso(end), units or "", iso_local(moment),
                           date.isoformat()]
        for key, cell in zip(keys, row[5:]):
            if key in point:
                assert_cell(cell, point[key])
            else:
                assert cell == "", (key, row)
    if metric == "heart_rate":  # across the change to daylight time: both offsets, as written
        assert {row[3][-6:] for row in rows[1:]} == {"-08:00", "-07:00"}
    if metric == "sleep_analysis":  # the records of each night before midnight: its morning
        assert any(row[4] != row[3][:10] for row in rows[1:])


def csv_keys(points: list, value_fields: list) -> list:
    """Raw CSV's point keys in their one order (READ-4.6), in this test's words: the value
    fields the meaning names, in its order, then the times HAE writes (date, start, end,
    startDate, endDate), then source, then every other key by name; each only if a point
    of the range has it."""
    seen = {key for point in points for key in point}
    first = [key for key in list(value_fields) + ["date", "start", "end", "startDate",
                                                  "endDate", "source"] if key in seen]
    return first + sorted(seen - set(first))


def sleep_points_dates(items: list) -> dict:
    """coordinate -> the wake day a sleep point is exported on (READ-12.5)."""
    points = [p for p, _ in items]
    return sleep_dates([p for p in points if "value" not in p],
                       [p for p in points if "value" in p])


def test_read_4_1_raw_csv_in_another_zone_and_a_key_named_like_a_column(start_service):
    """With ``tz`` the local start and date are the zone's; a key named like one of the first
    five columns gets a trailing ``_``, so no two columns have one name."""
    service = start_service()
    points = [{"date": "2024-03-08 23:%02d:00 -0800" % m, "qty": m, "units": "odd",
               "local_date": "x%d" % m} for m in range(3)]
    body = hf.dumps_hae(hf.envelope(metrics=[hf.metric("step_count", points, "count")]))
    assert Client(*service.address).ingest(body, headers={"automation-aggregation":
                                                          "Minutes"})[0] == 200
    wait_for(lambda: db_rows(service.config.data_dir, "SELECT parse_status FROM delivery")
             [0]["parse_status"] == "parsed", what="the delivery is folded")
    rows = read_csv(get(service.address, "/api/points", metric="step_count", format="csv",
                        tz="Europe/Berlin"))
    assert rows[0] == ["utc_start", "utc_end", "units", "local_start", "local_date", "qty",
                       "date", "local_date_", "units_"]
    for row, point in zip(rows[1:], points):
        berlin = written(point["date"]).astimezone(zoneinfo.ZoneInfo("Europe/Berlin"))
        assert row[3:5] == [iso_local(berlin), "2024-03-09"]  # 08:0x in Berlin next day
        assert row[7:] == [point["local_date"], "odd"]


@pytest.mark.parametrize("query", [dict(metric="heart_rate", bucket="day", tz="-07:00"),
                                   dict(metric="heart_rate", bucket="hour"),
                                   dict(metric="heart_rate", bucket="week",
                                        tz="America/Los_Angeles")],
                         ids=["day-offset", "hour-local", "week-zone"])
def test_read_4_2_bucket_csv_has_five_columns_per_field_equal_to_the_json(store, query):
    want = get_json(store.address, "/api/points", **query)
    rows = read_csv(get(store.address, "/api/points", format="csv", **query))
    header = rows[0]
    assert header[:5] == ["start", "local", "date", "units", "count"]
    fields = [column[:-len("_count")] for column in header[5::5]]
    assert sorted(fields) == ["Avg", "Max", "Min"]
    stats = ("count", "min", "max", "avg", "sum")
    assert header[5:] == ["%s_%s" % (f, s) for f in fields for s in stats]
    flat = [(run["units"], b) for run in want["runs"] for b in run["buckets"]]
    assert len(rows) == 1 + len(flat)
    for row, (units, entry) in zip(rows[1:], flat):
        assert row[:5] == [entry["start"], entry["local"], entry["date"], units,
                           str(entry["count"])]
        for i, field in enumerate(fields):
            cells = row[5 + 5 * i: 10 + 5 * i]
            for stat, cell in zip(stats, cells):
                if field in entry["fields"]:
                    assert_cell(cell, entry["fields"][field][stat])
                else:
                    assert cell == "", (field, row)
    assert_buckets_equal(want["runs"], aggregate(store.corpus.points("heart_rate", "minutes"),
                                                 query["bucket"], query.get("tz", "local")))
    energy = read_csv(get(store.address, "/api/points", metric="active_energy", bucket="day",
                          format="csv"))
    assert [row[3] for row in energy[1:]] == ["kcal", "kJ", "kcal"]


@pytest.mark.parametrize("tz", ["local", "-08:00"])
def test_read_4_3_sleep_bucket_csv_has_one_row_per_nights_date(store, tz):
    query = dict(metric="sleep_analysis", bucket="day", tz=tz)
    want = get_json(store.address, "/api/points", **query)
    rows = read_csv(get(store.address, "/api/points", format="csv", **query))
    stages = {s for n in want["nights"] for s in n["stages"]}
    assert stages == {"awake", "core", "deep", "rem"}
    stages = ["deep", "core", "rem", "awake"]  # deepest first, as drawn; awake last
    assert rows[0] == ["start", "local", "date", "count", "nights", "asleep", "in_bed"] + \
        stages + ["sleep_start", "sleep_end", "form", "counted", "scaled", "overlapping",
                  "naps", "nap_hours"]
    assert len(rows) == 1 + len(want["nights"]) == 5
    for row, night in zip(rows[1:], want["nights"]):
        cells = dict(zip(rows[0], row))
        assert [cells[k] for k in ("start", "local", "date", "count", "nights", "sleep_start",
                                   "sleep_end", "form", "counted")] == [
            "" if night[k] is None else str(night[k]) for k in (
                "start", "local", "date", "count", "nights", "sleep_start", "sleep_end",
                "form", "counted")]
        assert cells["scaled"] == str(int(night["scaled"]))
        for key in ("asleep", "in_bed"):
            assert close(float(cells[key]), night[key]), key
        for stage in stages:
            assert close(float(cells[stage] or 0), night["stages"].get(stage, 0.0)), stage
        assert (cells["overlapping"], cells["naps"], cells["nap_hours"]) == (
            str(int(night["overlapping"])), str(len(night["naps"])), ""), cells
    weeks = read_csv(get(store.address, "/api/points", format="csv", bucket="week",
                         metric="sleep_analysis", tz=tz))
    assert weeks[0] == ["start", "local", "date", "count", "nights", "asleep", "in_bed"] + \
        stages + ["overlapping", "naps", "nap_hours"]


FORMULAS = ['=HYPERLINK("http://example.invalid/?"&A2,"open")', "+SUM(1,2)", "-2+3",
            "@SUM(A1:A9)", "\tcmd", "\r=1", "\n=1+1", " =1", "\n\n +1", "\u3000=2",
            "\u00a0@SUM(1)", "|cmd", "\uff1dSUM(1)", "\uff0b1", "\uff0d1", "\uff20A1",
            "\uff5ccmd", "\r\n-1"]
"""Text a spreadsheet could run: OWASP's starts, the same after leading whitespace and line
breaks, the pipe, and the full-width forms."""


def spreadsheet_runs(cell: str) -> bool:
    """Could a spreadsheet run this cell?  In this test's words: it begins with a tab or a
    line break, or its first character after any whitespace is one of = + - @ | or their
    full-width forms."""
    first = cell.lstrip()[:1]
    return cell[:1] in ("\t", "\r", "\n") or bool(first) and first in (
        "=+-@|\uff1d\uff0b\uff0d\uff20\uff5c")


def test_read_4_4_a_csv_cell_is_never_a_formula(start_service, data_dir):
    """Every text cell that starts like a formula (OWASP: = + - @ tab CR; also after
    leading whitespace and line breaks, the pipe and the full-width forms) is written with
    a leading ' in raw CSV, bucket CSV and `export --format csv`; numbers stay numbers."""
    service = start_service()
    points = []
    for minute, formula in enumerate(FORMULAS):
        points.append({"date": "2024-03-08 10:%02d:00 -0800" % minute, "qty": -5 - minute,
                       "note": formula, "source": formula, formula: -0.25})
    units = "@SUM(1)"
    body = hf.dumps_hae(hf.envelope(metrics=[hf.metric("step_count", points, units)]))
    assert Client(*service.address).ingest(body, headers={"automation-aggregation":
                                                          "Minutes"})[0] == 200
    wait_for(lambda: db_rows(data_dir, "SELECT parse_status FROM delivery")[0]["parse_status"]
             == "parsed", what="the delivery is folded")
    raw = read_csv(get(service.address, "/api/points", metric="step_count", format="csv"))
    buckets = read_csv(get(service.address, "/api/points", metric="step_count", bucket="day",
                           format="csv"))
    exported = subprocess.run(
        [sys.executable, "-m", "healthlog", "export", "--data", str(data_dir),
         "--metric", "step_count", "--format", "csv"], capture_output=True, timeout=60)
    assert exported.returncode == 0, exported.stderr
    assert list(csv.reader(io.StringIO(exported.stdout.decode(), newline=""))) == raw

    def neutral(text: str) -> str:
        return "'" + text

    header = raw[0]
    assert header[:5] == ["utc_start", "utc_end", "units", "local_start", "local_date"]
    assert [neutral(f) for f in sorted(FORMULAS)] == [k for k in header if k.startswith("'")]
    for row, point in zip(raw[1:], points):
        cells = dict(zip(header, row))
        assert cells["units"] == neutral(units)
        assert cells["note"] == cells["source"] == neutral(point["note"])
        assert cells["qty"] == str(point["qty"])  # a negative number stays a number
        assert cells[neutral(point["note"])] == "-0.25"
    for table in (raw, buckets):
        for row in table:
            for cell in row:
                assert not spreadsheet_runs(cell) or float(cell) < 0, repr(cell)
    assert buckets[0][:5] == ["start", "local", "date", "units", "count"]
    assert buckets[1][3] == neutral(units)
    assert neutral(FORMULAS[0]) + "_sum" in buckets[0]


# ---------------------------------------------------------------------------------------------
# READ-5: /api/deliveries

DELIVERY_KEYS = {"id", "received_at", "body_bytes", "automation_name", "automation_id",
                 "automation_aggregation", "path_name", "status", "layer", "error",
                 "uncovered_keys", "folded_at", "metrics", "points", "bad_points",
                 "objects_written", "overwrites", "incomparable", "unit_conflicts",
                 "sealed_changes"}


def journal_newest_first(data_dir: Path) -> list:
    return db_rows(data_dir, "SELECT * FROM delivery ORDER BY received_at DESC, id DESC")


def expected_delivery(row: dict) -> dict:
    """A journal row as the read spec shows it; times as instants (µs) for comparison."""
    out = {k: row[k] for k in DELIVERY_KEYS - {"status", "uncovered_keys"}}
    out["status"] = row["parse_status"]
    out["uncovered_keys"] = json.loads(row["uncovered_keys"])
    for key in ("received_at", "folded_at"):
        out[key] = row[key] and instant_us(row[key])
    return out


def test_read_5_1_deliveries_are_the_journal_newest_first(store):
    reply = get_json(store.address, "/api/deliveries")
    rows = journal_newest_first(store.data_dir)
    assert len(rows) == len(store.corpus.deliveries)
    assert [set(d) for d in reply["deliveries"]] == [DELIVERY_KEYS] * len(rows)
    instants = [dict(d, received_at=instant_us(d["received_at"]),
                     folded_at=d["folded_at"] and instant_us(d["folded_at"]))
                for d in reply["deliveries"]]
    assert instants == [expected_delivery(row) for row in rows]
    assert reply["next_before"] is None
    assert [d["automation_name"] for d in reply["deliveries"]] == [
        name for name, _, _ in reversed(store.corpus.deliveries)]
    # times are spelled as the journal stores and compares them (READ-5.6): six digits of
    # microseconds, trailing zeros kept
    spelled = [(d[k], row[k]) for d, row in zip(reply["deliveries"], rows)
               for k in ("received_at", "folded_at") if d[k]]
    assert [(t, kept) for t, kept in spelled if t != kept or not re.fullmatch(
        r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{6}Z", t)] == []


def test_read_5_2_limit_and_before_page_through_the_journal(store):
    ids = [row["id"] for row in journal_newest_first(store.data_dir)]
    seen, before = [], None
    for _ in range(len(ids)):
        page = get_json(store.address, "/api/deliveries", limit=3, before=before)
        got = [d["id"] for d in page["deliveries"]]
        seen += got
        if len(got) < 3:
            assert page["next_before"] is None
            break
        assert page["next_before"] == got[-1]
        before = page["next_before"]
    assert seen == ids
    assert [d["id"] for d in get_json(store.address, "/api/deliveries", limit=500)[
        "deliveries"]] == ids
    one = get_json(store.address, "/api/deliveries", limit=1, before=ids[4])
    assert [d["id"] for d in one["deliveries"]] == [ids[5]] and one["next_before"] == ids[5]


def test_read_5_3_status_selects_deliveries_by_outcome(store):
    rows = journal_newest_first(store.data_dir)
    for status in healthlog.STATUSES:
        reply = get_json(store.address, "/api/deliveries", status=status)
        assert [d["id"] for d in reply["deliveries"]] == [
            row["id"] for row in rows if row["parse_status"] == status], status
    failed = get_json(store.address, "/api/deliveries", status="failed")["deliveries"]
    partial = get_json(store.address, "/api/deliveries", status="partial")["deliveries"]
    assert [d["automation_name"] for d in failed] == ["Read broken"]
    assert [(d["automation_name"], d["uncovered_keys"]) for d in partial] == [
        ("Read partial", ["futureSection"])]
    assert failed[0]["error"] and failed[0]["points"] is None


@pytest.mark.parametrize("query", [{"limit": "0"}, {"limit": "501"}, {"limit": "-1"},
                                   {"limit": "ten"}, {"status": "done"}, {"status": "PARSED"},
                                   {"before": "latest"}, {"before": "1.5"}])
def test_read_5_4_unreadable_deliveries_parameters_are_400(store, query):
    assert_error(get(store.address, "/api/deliveries", **query), 400, "bad_request")


def test_read_5_5_deliveries_never_carry_body_content(store):
    text = get(store.address, "/api/deliveries", limit=500).text
    for secret in BODY_STRINGS + ("Core", "count/min", "2024-03-08 1", "-0800"):
        assert secret not in text, secret


# ---------------------------------------------------------------------------------------------
# READ-6: /metrics

class Family(NamedTuple):
    type: str
    help: Optional[str]
    samples: list  # (name, labels dict, value)


_NAME = r"[a-zA-Z_:][a-zA-Z0-9_:]*"
_SAMPLE = re.compile(r"(%s)(\{[^\n]*\})? (\S+)(?: (-?\d+))?" % _NAME)
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\\n]|\\[\\"n])*)"(,?)')
_TYPES = ("counter", "gauge", "histogram", "summary", "untyped")


def parse_labels(text: str) -> dict:
    assert text.startswith("{") and text.endswith("}"), text
    body, labels, pos = text[1:-1], {}, 0
    while pos < len(body):
        match = _LABEL.match(body, pos)
        assert match, "bad label set %r" % text
        name, value, comma = match.groups()
        assert name not in labels, "label repeated: %r" % text
        labels[name] = value.replace('\\"', '"').replace("\\n", "\n").replace("\\\\", "\\")
        pos = match.end()
        assert comma or pos == len(body), text
    return labels


def parse_prometheus(text: str) -> dict:
    """A strict reader of the text format 0.0.4: {family: Family}.

    Every sample belongs to a family declared by ``# TYPE`` before it (histogram and
    summary samples by their ``_bucket``/``_sum``/``_count`` suffix), HELP and TYPE come at
    most once per family, a family's samples are contiguous, label sets are well formed and
    not repeated, values are Go floats; histograms are checked with check_histogram."""
    assert text.endswith("\n"), "the exposition must end with a newline"
    families: dict = {}
    helps: dict = {}
    finished, current = set(), None
    for line in text.split("\n")[:-1]:
        if not line.strip():
            continue
        if line.startswith("#"):
            parts = line.split(" ", 3)
            if len(parts) >= 3 and parts[1] in ("HELP", "TYPE"):
                assert re.fullmatch(_NAME, parts[2]), line
                if parts[1] == "HELP":
                    assert parts[2] not in helps, "HELP twice: " + line
                    helps[parts[2]] = parts[3] if len(parts) > 3 else ""
                else:
                    assert len(parts) == 4 and parts[3] in _TYPES, line
                    assert parts[2] not in families, "TYPE twice or after samples: " + line
                    families[parts[2]] = Family(parts[3], None, [])
            continue
        match = _SAMPLE.fullmatch(line)
        assert match, "not a sample line: %r" % line
        name, labels, value, _ = match.groups()
        family = name if name in families else None
        for suffix in ("_bucket", "_sum", "_count"):
            base = name[:-len(suffix)]
            if family is None and name.endswith(suffix) and base in families and (
                    families[base].type == "histogram"
                    or (families[base].type == "summary" and suffix != "_bucket")):
                family = base
        assert family is not None, "sample without a TYPE: %r" % line
        assert family not in finished, "samples of %s are not contiguous" % family
        if current not in (None, family):
            finished.add(current)
        current = family
        number = float(value)  # accepts NaN, +Inf, -Inf, exponents
        parsed = parse_labels(labels) if labels else {}
        key = (name, tuple(sorted(parsed.items())))
        assert key not in {(n, tuple(sorted(lb.items()))) for n, lb, _ in
                           families[family].samples}, "sample repeated: %r" % line
        families[family].samples.append((name, parsed, number))
    for name in helps:
        assert name in families, "HELP without TYPE: " + name
    out = {name: fam._replace(help=helps.get(name)) for name, fam in families.items()}
    for name, fam in out.items():
        if fam.type == "histogram":
            check_histogram(name, fam)
        if fam.type == "counter":
            assert all(v >= 0 for _, _, v in fam.samples), name
    return out


def check_histogram(name: str, family: Family) -> None:
    """Per label set: buckets in rising ``le``, cumulative, ending at +Inf == _count."""
    series: dict = {}
    for sample, labels, value in family.samples:
        rest = tuple(sorted((k, v) for k, v in labels.items() if k != "le"))
        entry = series.setdefault(rest, {"buckets": [], "sum": None, "count": None})
        if sample == name + "_bucket":
            entry["buckets"].append((float(labels["le"]), labels["le"], value))
        else:
            assert "le" not in labels, sample
            entry[sample[len(name) + 1:]] = value
    assert series, "histogram %s has no samples" % name
    for rest, entry in series.items():
        bounds = [b for b, _, _ in entry["buckets"]]
        counts = [c for _, _, c in entry["buckets"]]
        assert bounds and bounds == sorted(bounds) and len(set(bounds)) == len(bounds), name
        assert counts == sorted(counts), "%s%s buckets are not cumulative" % (name, rest)
        assert entry["buckets"][-1][1] == "+Inf", "%s%s has no +Inf bucket" % (name, rest)
        assert entry["count"] is not None and entry["sum"] is not None, (name, rest)
        assert entry["buckets"][-1][2] == entry["count"], (name, rest)
        assert all(c == int(c) for c in counts), (name, rest)


def scrape(address: tuple) -> dict:
    reply = call(address, "GET", "/metrics")
    assert reply.status == 200, reply.body[:300]
    content_type = reply.headers["Content-Type"].replace(" ", "")
    assert content_type.startswith("text/plain;") and "version=0.0.4" in content_type
    return parse_prometheus(reply.text)


def value(families: dict, name: str, **labels) -> float:
    family = name
    for suffix in ("_bucket", "_sum", "_count"):
        if name not in families and name.endswith(suffix) and name[:-len(suffix)] in families:
            family = name[:-len(suffix)]
    found = [v for n, lb, v in families[family].samples if n == name and lb == labels]
    assert len(found) == 1, (name, labels, families[family].samples)
    return found[0]


def histogram_count(families: dict, name: str) -> float:
    """The observations of a histogram over all its label sets."""
    return sum(v for n, _, v in families[name].samples if n == name + "_count")


def series_sum(families: dict, name: str) -> float:
    return sum(v for n, _, v in families[name].samples if n == name + "_sum")


def test_read_6_1_metrics_are_valid_text_format_with_the_journals_figures(store):
    families = scrape(store.address)
    journal = db_rows(store.data_dir)
    store_rows = object_rows(store.data_dir)
    for status in healthlog.STATUSES:
        count = sum(row["parse_status"] == status for row in journal)
        if count or any(lb == {"status": status}
                        for _, lb, _ in families["healthlog_deliveries"].samples):
            assert value(families, "healthlog_deliveries", status=status) == count, status
    expected = {
        "healthlog_backlog": 0,
        "healthlog_received_deliveries_total": len(journal),
        "healthlog_received_bytes_total": sum(row["body_bytes"] for row in journal),
        "healthlog_objects": len(store_rows),
        "healthlog_points": sum(row["points"] for row in store_rows),
        "healthlog_overwrites_total": sum(row["overwrites"] or 0 for row in journal),
        "healthlog_unit_conflicts_total": sum(row["unit_conflicts"] or 0 for row in journal),
        "healthlog_worker_up": 1,
    }
    for name, want in expected.items():
        assert value(families, name) == want, name
    assert families["healthlog_received_deliveries_total"].type == "counter"
    assert families["healthlog_received_bytes_total"].type == "counter"
    assert families["healthlog_deliveries"].type == "gauge"
    assert families["healthlog_ingest_seconds"].type == "histogram"
    assert families["healthlog_fold_seconds"].type == "histogram"
    assert value(families, "healthlog_oldest_pending_age_seconds") >= 0
    states = families["healthlog_worker_state"].samples
    assert sorted(v for _, _, v in states)[-1] == 1 and sum(v for _, _, v in states) == 1
    assert all(set(lb) == {"state"} for _, lb, _ in states)
    assert value(families, "healthlog_info", version=healthlog.__version__) == 1
    assert all(f.help for f in families.values()), "every family has a HELP line"
    outcomes = {lb.get("outcome") for _, lb, _ in families["healthlog_fold_seconds"].samples}
    assert outcomes <= {"parsed", "partial", "failed"}
    assert histogram_count(families, "healthlog_ingest_seconds") >= 0


def test_read_6_2_counters_move_when_a_delivery_arrives_and_is_folded(start_service):
    service = start_service(paused=True)
    address = service.address
    client = Client(*address)
    data_dir = service.config.data_dir
    minutes = {"automation-aggregation": "Minutes"}
    first = hf.dumps_hae({"data": {"metrics": [hf.metric("step_count", [
        {"date": hae(DAY0 + 60 * k), "qty": k} for k in range(5)], "count")]}})
    assert client.ingest(first, headers=minutes)[0] == 200
    service.worker.gate.set()
    wait_for(lambda: pending(data_dir) == 0 and service.worker.state == "idle")
    service.worker.hold()
    before = scrape(address)
    body = hf.dumps_hae({"data": {"metrics": [hf.metric("step_count", [
        {"date": hae(DAY0 + 3600 + 60 * k), "qty": k, "source": hf.CANARY_SOURCE}
        for k in range(7)], "count")]}})
    assert client.ingest(body, headers=minutes)[0] == 200
    # Journaled, not folded yet (the worker waits at its gate): scraped once the gauge
    # shows the pending delivery aged 0.3 s (was: a 0.3 s sleep, then one scrape).
    arrived = wait_for(lambda: (lambda scraped: value(
        scraped, "healthlog_oldest_pending_age_seconds") >= 0.3 and scraped)(scrape(address)),
        interval=0.05, what="the oldest pending age grows")
    folded_moved = {"healthlog_objects": 1, "healthlog_points": 7}
    assert {name: value(arrived, name) - value(before, name) for name in (
        "healthlog_received_deliveries_total", "healthlog_received_bytes_total",
        "healthlog_backlog", "healthlog_objects", "healthlog_points")} == {
        "healthlog_received_deliveries_total": 1, "healthlog_received_bytes_total": len(body),
        "healthlog_backlog": 1, "healthlog_objects": 0, "healthlog_points": 0}
    assert value(arrived, "healthlog_deliveries", status="pending") == 1
    assert value(arrived, "healthlog_oldest_pending_age_seconds") >= 0.3
    assert histogram_count(arrived, "healthlog_ingest_seconds") - histogram_count(
        before, "healthlog_ingest_seconds") == 1
    assert series_sum(arrived, "healthlog_ingest_seconds") > series_sum(
        before, "healthlog_ingest_seconds")
    assert histogram_count(arrived, "healthlog_fold_seconds") == histogram_count(
        before, "healthlog_fold_seconds")
    service.worker.gate.set()
    wait_for(lambda: pending(data_dir) == 0 and service.worker.state == "idle")
    after = scrape(address)
    assert {name: value(after, name) - value(arrived, name) for name in folded_moved} == (
        folded_moved)
    assert (value(after, "healthlog_backlog"), value(
        after, "healthlog_oldest_pending_age_seconds")) == (0, 0)
    assert histogram_count(after, "healthlog_fold_seconds") - histogram_count(
        arrived, "healthlog_fold_seconds") == 1
    assert value(after, "healthlog_fold_seconds_count", outcome="parsed") - value(
        before, "healthlog_fold_seconds_count", outcome="parsed") == 1
    assert value(after, "healthlog_deliveries", status="parsed") == 2
    assert value(after, "healthlog_received_deliveries_total") == value(
        arrived, "healthlog_received_deliveries_total")
    assert hf.CANARY_SOURCE not in call(address, "GET", "/metrics").text


def test_read_6_3_metrics_carry_no_health_values_or_names_of_the_users_data(store):
    text = call(store.address, "GET", "/metrics").text
    for secret in BODY_STRINGS + ("medications", "symptoms"):
        assert secret not in text, secret
    # The metrics stored are named only by the freshness gauges (FRESH-6.1), as a label; so
    # are the automations (whose names may hold such a word: "Read sleep").
    names = {metric for metric, _ in store.corpus.posted} | {"step_count", "heart_rate",
                                                             "sleep"}
    gauges = ("healthlog_metric_newest_point_timestamp_seconds{metric=",
              "healthlog_metric_stale{metric=", "healthlog_automation_")
    for line in text.splitlines():
        if any(name in line for name in names):
            assert line.startswith(gauges), line


# ---------------------------------------------------------------------------------------------
# READ-7: page, session and security headers

READ_ROUTES = ("/api/catalog", "/api/points?metric=step_count", "/api/deliveries", "/metrics")


def form(token: str) -> bytes:
    return urllib.parse.urlencode({"token": token}).encode()


FORM = {"Content-Type": "application/x-www-form-urlencoded"}


def login(address: tuple, token: str = TOKEN, headers: dict = None) -> Reply:
    return call(address, "POST", "/login", body=form(token), headers=dict(FORM, **(headers or {})),
                auth=False)


def cookie_parts(reply: Reply) -> tuple:
    """(name, value, {attribute lower-case: value}) of the one Set-Cookie."""
    [header] = reply.headers.get_all("Set-Cookie")
    first, *attributes = [part.strip() for part in header.split(";")]
    name, _, cookie = first.partition("=")
    attrs = {}
    for attribute in attributes:
        key, _, val = attribute.partition("=")
        attrs[key.lower()] = val
    return name, cookie, attrs


def session_cookie(expiry: int, token: str = TOKEN, session_id: str = "ab" * 16) -> str:
    """A cookie signed as the read spec says; it opens nothing unless its session id names
    a session the server started (sign-in) and has not ended."""
    mac = hmac.new(token.encode(), ("session:%s:%d" % (session_id, expiry)).encode(),
                   hashlib.sha256).hexdigest()
    return "healthlog_session=%s.%d.%s" % (session_id, expiry, mac)


def assert_page(reply: Reply) -> str:
    """HTML that loads nothing but /static/app.css and /static/app.js (the sign-in page
    too: the script carries a bookmarked view through the form): no inline code or
    style, nothing from elsewhere."""
    assert reply.status == 200, reply.body[:300]
    assert reply.headers.get_content_type() == "text/html"
    page = reply.text
    assert re.search(r'<link[^>]+href="/static/app\.css"', page)
    assert re.search(r'<script[^>]+src="/static/app\.js"', page)
    loaded = set(re.findall(r'<(?:script|img|iframe)[^>]*\ssrc="([^"]*)"', page, re.I))
    loaded |= set(re.findall(r'<link[^>]*\shref="([^"]*)"', page, re.I))
    loaded.discard("data:,")  # the empty icon: it stops the browser asking for /favicon.ico
    assert loaded <= {"/static/app.css", "/static/app.js"}, loaded
    assert not re.search(r"<script(?![^>]*\bsrc=)[^>]*>", page), "inline script"
    assert not re.search(r"<style|\sstyle=|\son[a-z]+=", page, re.I), "inline style or handler"
    return page


def test_read_7_1_every_read_route_needs_the_token_or_the_session(store):
    for path in READ_ROUTES:
        assert_error(call(store.address, "GET", path, auth=False), 401, "unauthorized")
        assert_error(call(store.address, "GET", path, headers={
            "Authorization": "Bearer wrong-" + TOKEN}), 401, "unauthorized")
        assert_error(call(store.address, "GET", path, auth=False, headers={
            "X-API-Key": TOKEN[:-1]}), 401, "unauthorized")
        assert call(store.address, "GET", path).status == 200, path
        assert call(store.address, "GET", path, auth=False,
                    headers={"X-API-Key": TOKEN}).status == 200, path
    assert call(store.address, "GET", "/healthz", auth=False).status == 200


def test_read_7_2_without_a_session_the_page_is_the_login_form(store):
    page = assert_page(call(store.address, "GET", "/", auth=False))
    assert 'id="catalog"' not in page  # the form alone, none of the dashboard
    assert re.search(r'<form[^>]+method="post"', page, re.I)
    assert re.search(r'<form[^>]+action="/login"', page)
    assert re.search(r'<input[^>]+name="token"', page)
    # a Bearer header is no session: the page still asks to log in
    assert re.search(r'name="token"', call(store.address, "GET", "/").text)


def test_read_7_3_a_wrong_token_is_401_with_the_login_page(store):
    reply = login(store.address, "wrong-token")
    assert reply.status == 401
    assert reply.headers.get_content_type() == "text/html"
    assert re.search(r'<input[^>]+name="token"', reply.text)
    assert "wrong-token" not in reply.text and TOKEN not in reply.text
    assert not reply.headers.get_all("Set-Cookie")


def test_read_7_4_the_right_token_sets_a_strict_http_only_session_cookie(store):
    now = int(time.time())
    reply = login(store.address)
    assert reply.status == 303
    assert urllib.parse.urlsplit(reply.headers["Location"]).path == "/"
    name, cookie, attrs = cookie_parts(reply)
    assert name == "healthlog_session"
    assert attrs.get("path") == "/" and "httponly" in attrs
    assert attrs.get("samesite", "").lower() == "strict"
    assert attrs.get("max-age") == str(SESSION_MAX_AGE)
    assert "secure" not in attrs
    session_id, expiry, mac = cookie.split(".")
    assert re.fullmatch(r"[0-9a-f]{32}", session_id)
    assert now + SESSION_MAX_AGE - 5 <= int(expiry) <= int(time.time()) + SESSION_MAX_AGE + 5
    assert "healthlog_session=" + cookie == session_cookie(int(expiry), session_id=session_id)
    jar = {"Cookie": "healthlog_session=" + cookie}
    catalog = call(store.address, "GET", "/api/catalog", headers=jar, auth=False)
    assert catalog.status == 200 and catalog.json()["metrics"]
    for path in READ_ROUTES:
        assert call(store.address, "GET", path, headers=jar, auth=False).status == 200, path
    dashboard = assert_page(call(store.address, "GET", "/", headers=jar, auth=False))
    assert not re.search(r'name="token"', dashboard)
    # among other cookies of the same host too
    other = {"Cookie": "theme=dark; healthlog_session=%s; x=1" % cookie}
    assert call(store.address, "GET", "/api/catalog", headers=other, auth=False).status == 200


def test_read_7_5_the_cookie_is_secure_behind_an_https_proxy(store):
    _, _, attrs = cookie_parts(login(store.address, headers={"X-Forwarded-Proto": "https"}))
    assert "secure" in attrs and "httponly" in attrs
    _, _, attrs = cookie_parts(login(store.address, headers={"X-Forwarded-Proto": "http"}))
    assert "secure" not in attrs


def test_read_7_6_the_session_cookie_does_not_authorise_ingest(store):
    _, cookie, _ = cookie_parts(login(store.address))
    body = hf.dumps_hae({"data": {"metrics": []}})
    reply = call(store.address, "POST", "/api/ingest", body=body, auth=False,
                 headers={"Content-Type": "application/json",
                          "Cookie": "healthlog_session=" + cookie})
    assert_error(reply, 401, "unauthorized")
    assert len(db_rows(store.data_dir)) == len(store.corpus.deliveries)


def test_read_7_7_forged_expired_and_foreign_cookies_are_refused(store):
    now = int(time.time())
    _, cookie, _ = cookie_parts(login(store.address))
    session_id, expiry, _ = cookie.split(".")
    legacy = hmac.new(TOKEN.encode(), ("session:%d" % (now + 3600)).encode(),
                      hashlib.sha256).hexdigest()
    forged = [
        session_cookie(now + 3600),  # correctly signed, but no session was started for it
        session_cookie(now - 10, session_id=session_id),  # expired, correctly signed
        session_cookie(int(expiry) + 1, session_id=session_id),  # another expiry, re-signed
        session_cookie(int(expiry), token="another-token-0123456789", session_id=session_id),
        "healthlog_session=" + cookie[:-4] + "0000",  # signature altered
        "healthlog_session=%s.%s.%s" % (session_id, expiry, "0" * 64),
        "healthlog_session=%s.%s" % (session_id, expiry),
        "healthlog_session=" + cookie.replace(".", ":"),
        "healthlog_session=%d.%s" % (now + 3600, legacy),  # the form of earlier versions
        "healthlog_session=" + TOKEN,
        "healthlog_session=%s.\u00b2.%s" % (session_id, "0" * 64),  # a digit to isdigit only
    ]
    good = "healthlog_session=" + cookie
    assert call(store.address, "GET", "/api/catalog", headers={"Cookie": good},
                auth=False).status == 200  # the control: a session the server started
    for cookie in forged:
        reply = call(store.address, "GET", "/api/catalog", headers={"Cookie": cookie}, auth=False)
        assert_error(reply, 401, "unauthorized")
        page = call(store.address, "GET", "/", headers={"Cookie": cookie}, auth=False)
        assert page.status == 200 and re.search(r'name="token"', page.text), cookie


def test_read_7_8_cross_site_login_and_logout_are_403(store):
    here = "http://%s:%d" % store.address
    for path in ("/login", "/logout"):
        for headers in ({"Sec-Fetch-Site": "cross-site"}, {"Origin": "http://evil.example"},
                        {"Origin": "http://evil.example:%d" % store.address[1]}):
            reply = call(store.address, "POST", path, body=form(TOKEN),
                         headers=dict(FORM, **headers), auth=False)
            assert reply.status == 403, (path, headers, reply.status)
            assert not reply.headers.get_all("Set-Cookie"), (path, headers)
    for headers in ({"Origin": here}, {"Sec-Fetch-Site": "same-origin", "Origin": here},
                    {"Origin": "https://health.example", "X-Forwarded-Host": "health.example"}):
        assert login(store.address, headers=headers).status == 303, headers


def test_read_7_9_logout_clears_the_cookie(store):
    _, cookie, _ = cookie_parts(login(store.address))
    reply = call(store.address, "POST", "/logout", body=b"", auth=False,
                 headers=dict(FORM, Cookie="healthlog_session=" + cookie))
    assert reply.status == 303
    assert urllib.parse.urlsplit(reply.headers["Location"]).path == "/"
    name, value_, attrs = cookie_parts(reply)
    assert name == "healthlog_session" and attrs.get("max-age") == "0"
    assert attrs.get("path") == "/" and value_ != cookie


def test_read_7_10_every_response_carries_the_security_headers(store):
    jar = {"Cookie": "healthlog_session=" + cookie_parts(login(store.address))[1]}
    replies = [
        call(store.address, "GET", "/", auth=False),  # login page
        call(store.address, "GET", "/", headers=jar, auth=False),  # dashboard
        call(store.address, "GET", "/api/catalog"),
        call(store.address, "GET", "/api/points?metric=step_count&format=csv"),
        call(store.address, "GET", "/api/catalog", auth=False),  # 401
        call(store.address, "GET", "/api/points?metric=nope"),  # 404
        call(store.address, "GET", "/api/points?metric=step_count&bucket=year"),  # 400
        call(store.address, "GET", "/no/such/route"),
        call(store.address, "GET", "/static/app.js", auth=False),
        call(store.address, "GET", "/metrics"),
        login(store.address, "wrong"),
        login(store.address),
    ]
    assert [r.status for r in replies] == [200, 200, 200, 200, 401, 404, 400, 404, 200, 200,
                                           401, 303]
    for reply in replies:
        assert_security_headers(reply.headers)


def test_read_7_11_static_assets_are_served_without_auth(store):
    js = call(store.address, "GET", "/static/app.js", auth=False)
    css = call(store.address, "GET", "/static/app.css", auth=False)
    assert js.status == css.status == 200
    assert js.headers.get_content_type() in ("text/javascript", "application/javascript")
    assert css.headers.get_content_type() == "text/css"
    assert js.body.strip() and css.body.strip()
    assert call(store.address, "GET", "/static/nope.js", auth=False).status == 404
    assert call(store.address, "GET", "/static/../healthlog.py", auth=False).status in (400, 404)


# ---------------------------------------------------------------------------------------------
# READ-8: healthlog export

@pytest.mark.parametrize("query", [
    dict(metric="step_count", format="csv"),
    dict(metric="heart_rate", format="json", from_="2024-03-09", to="2024-03-10T06:00:00-08:00"),
    dict(metric="active_energy"),
    dict(metric="heart_rate", bucket="day", tz="-07:00"),
    dict(metric="heart_rate", bucket="week", format="csv"),
    dict(metric="sleep_analysis", layer="record", bucket="day", tz="-08:00", format="csv"),
    dict(metric="workouts", format="csv"),
    dict(metric="heart_rate", bucket="hour", tz="America/Los_Angeles"),
    dict(metric="heart_rate", from_="2024-03-09", to="2024-03-11", bucket="day", format="csv"),
    dict(metric="sleep_analysis", bucket="week"),
], ids=["raw-csv", "raw-json-range", "runs", "bucket-json-tz", "bucket-csv", "sleep-csv",
        "nested-csv", "bucket-zone", "local-dates-csv", "sleep-weeks"])
def test_read_8_1_export_prints_the_bytes_the_route_answers(store, query):
    route = get(store.address, "/api/points", **query)
    assert route.status == 200, route.body[:300]
    # --tz=-07:00: a separate "-07:00" reads as an option to argparse
    args = ["--%s=%s" % (key.rstrip("_"), val) for key, val in query.items()]
    result = run_export("--data", store.data_dir, *args)  # beside the running serve
    assert result.returncode == 0, result.stderr
    assert result.stdout == route.body


def test_read_8_1_export_reads_in_local_time_by_default(store):
    """``--tz`` defaults to ``local``: without it, export prints what the route answers with
    ``tz=local``, each point on the date and hour written in it."""
    for query in (dict(metric="heart_rate", bucket="day", format="csv"),
                  dict(metric="heart_rate", format="csv"),
                  dict(metric="sleep_analysis", bucket="day")):
        route = get(store.address, "/api/points", tz="local", **query)
        assert route.status == 200, route.body[:300]
        result = run_export("--data", store.data_dir,
                            *["--%s=%s" % (key, val) for key, val in query.items()])
        assert result.returncode == 0, result.stderr
        assert result.stdout == route.body, query
    exported = run_export("--data", store.data_dir, "--metric=heart_rate", "--bucket=day",
                          "--format=csv")
    days = list(csv.reader(io.StringIO(exported.stdout.decode(), newline="")))
    written_dates = sorted({raw_start(p)[:10]
                            for p, _ in store.corpus.points("heart_rate", "minutes")})
    assert [row[2] for row in days[1:]] == written_dates
    assert days[1][1] == "2024-03-07T00:00:00-08:00"  # the first point: 16:00 -0800 the 7th


def test_read_8_2_export_of_an_unknown_metric_exits_2_with_one_line(store):
    result = run_export("--data", store.data_dir, "--metric", "steps")
    assert result.returncode == 2
    assert result.stdout == b""
    lines = [line for line in result.stderr.decode().splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in lines[0], lines
    assert "healthlog status" in lines[0] or "catalog" in lines[0], lines


POINTS_COLUMNS = [("metric", "TEXT"), ("layer", "TEXT"), ("start", "TEXT"), ("end", "TEXT"),
                  ("local_start", "TEXT"), ("local_date", "TEXT"), ("units", "TEXT"),
                  ("qty", "REAL"), ("value", "TEXT"), ("min", "REAL"), ("avg", "REAL"),
                  ("max", "REAL"), ("source", "TEXT"), ("extra", "TEXT")]
COLUMN_KEYS = {"qty", "value", "min", "avg", "max", "source", "Min", "Avg", "Max"}
TIME_KEYS = {"date", "start", "end", "startDate", "endDate"}


def test_read_8_3_export_to_sqlite_writes_points_and_metrics_tables(store, tmp_path):
    out = tmp_path / "export.db"
    result = run_export("--data", store.data_dir, "--format", "sqlite", out)
    assert result.returncode == 0, result.stderr
    conn = sqlite3.connect(str(out))
    conn.row_factory = sqlite3.Row
    try:
        columns = [(r["name"], r["type"].upper()) for r in conn.execute(
            "PRAGMA table_info(points)")]
        assert columns == POINTS_COLUMNS
        assert [r["name"] for r in conn.execute("PRAGMA table_info(metrics)")] == [
            "metric", "layer", "name", "kind", "group", "units", "points", "first", "last",
            "first_local", "last_local"]
        indexed = [[c["name"] for c in conn.execute("PRAGMA index_info(%s)" % i["name"])]
                   for i in conn.execute("PRAGMA index_list(points)")]
        assert ["metric", "layer", "start"] in indexed and ["start"] in indexed
        assert ["local_date"] in indexed
        store_rows = object_rows(store.data_dir)
        total = conn.execute("SELECT count(*) FROM points").fetchone()[0]
        assert total == sum(row["points"] for row in store_rows)
        counts = {(r[0], r[1]): r[2] for r in conn.execute(
            "SELECT metric, layer, count(*) FROM points GROUP BY metric, layer")}
        catalog = get_json(store.address, "/api/catalog")["metrics"]
        assert counts == {(e["metric"], e["layer"]): e["points"] for e in catalog}
        metrics = {(r["metric"], r["layer"]): r for r in conn.execute("SELECT * FROM metrics")}
        assert set(metrics) == set(counts)
        for entry in catalog:
            row = metrics[(entry["metric"], entry["layer"])]
            assert row["points"] == entry["points"]
            assert (row["first"], row["last"]) == (entry["first"], entry["last"])
            assert (row["name"], row["kind"], row["group"]) == (
                entry["meaning"]["name"], entry["meaning"]["kind"], entry["meaning"]["group"])
            # first and last as the phone wrote them (as `healthlog catalog` prints them)
            starts = sorted((coordinate(p)[0], n) for n, (p, _) in enumerate(
                store.corpus.points(entry["metric"], entry["layer"])))
            posted = store.corpus.points(entry["metric"], entry["layer"])
            assert utc_iso(starts[0][0]) == entry["first"]
            assert (row["first_local"], row["last_local"]) == tuple(
                iso_local(written(raw_start(posted[n][0]))) for n in (
                    starts[0][1], max(n for at, n in starts if at == starts[-1][0])))
            assert all(u in (row["units"] or "") for u in entry["units"])
        for metric, layer in (("step_count", "minutes"), ("heart_rate", "minutes"),
                              ("sleep_analysis", "record"), ("workouts", "record")):
            rows = conn.execute("SELECT * FROM points WHERE metric = ? AND layer = ?"
                                " ORDER BY start, rowid", (metric, layer)).fetchall()
            items = store.corpus.points(metric, layer)
            assert len(rows) == len(items)
            pairs = list(zip(rows, items))
            wake_days = sleep_points_dates(items) if metric == "sleep_analysis" else {}
            for row, (point, units) in pairs[:40] + pairs[-40:]:
                assert_export_row(row, point, units, wake_days.get(coordinate(point)))
        # the local start and date as each point wrote them, both offsets of the DST change
        offsets = {r[0][-6:] for r in conn.execute(
            "SELECT local_start FROM points WHERE metric = 'heart_rate'")}
        assert offsets == {"-08:00", "-07:00"}
        mood = conn.execute("SELECT local_start, local_date FROM points"
                            " WHERE metric = 'state_of_mind'").fetchall()
        assert [tuple(r) for r in mood] == [(iso_local(written(p["start"])), p["start"][:10])
                                           for p, _ in store.corpus.points("state_of_mind",
                                                                           "record")]
    finally:
        conn.close()


def assert_export_row(row: sqlite3.Row, point: dict, units: Optional[str],
                      wake_day: Optional[dt.date] = None) -> None:
    """One row of the SQLite export against the point posted; ``wake_day``: a sleep point's
    date (READ-12.5), else the date its start was written on."""
    start, end, _ = coordinate(point)
    assert (row["start"], row["end"], row["units"]) == (utc_iso(start), utc_iso(end),
                                                        units), dict(row)
    moment = written(raw_start(point))
    assert (row["local_start"], row["local_date"]) == (
        iso_local(moment), (wake_day or moment.date()).isoformat()), dict(row)
    for column, keys in (("qty", ("qty",)), ("min", ("min", "Min")), ("avg", ("avg", "Avg")),
                         ("max", ("max", "Max"))):
        given = [point[k] for k in keys if numeric(point.get(k))]
        assert row[column] == (given[0] if given else None), (column, dict(row), point)
    assert row["value"] == (point["value"] if isinstance(point.get("value"), str) else None)
    source = point.get("source")
    assert row["source"] == (source if isinstance(source, str) else None), (dict(row), point)
    rest = {k: v for k, v in point.items() if k not in COLUMN_KEYS | TIME_KEYS}
    extra = json.loads(row["extra"]) if row["extra"] is not None else {}
    assert {k: v for k, v in extra.items() if k not in TIME_KEYS} == rest, (dict(row), point)
    # the timestamps the point was placed by are the start, end and local_start columns,
    # never repeated in extra (READ-8.3): its start key and its end key, the first not null
    placed = [next((k for k in keys if point.get(k) is not None), None)
              for keys in (("start", "startDate", "date"), ("end", "endDate"))]
    assert not set(placed) & set(extra), (placed, extra)


def test_read_8_4_export_refuses_to_overwrite_an_existing_file(store, tmp_path):
    out = tmp_path / "taken.db"
    out.write_bytes(b"mine")
    result = run_export("--data", store.data_dir, "--format", "sqlite", out)
    assert result.returncode == 2
    assert out.read_bytes() == b"mine"
    lines = [line for line in result.stderr.decode().splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in lines[0], lines


def test_read_8_5_a_date_only_to_includes_its_day_on_the_command_line_as_on_the_route(store):
    """``export --to 2024-03-09`` holds the 9th, as the page's "To" field means it: the
    command line and the route read a date alone one way."""
    heart = store.corpus.points("heart_rate", "minutes")
    dates = sorted({raw_start(p)[:10] for p, _ in heart})
    assert len(dates) >= 4, dates
    first, last = dates[1], dates[2]  # two whole days in the middle of the data

    def on(low: str, high: str) -> list:
        return [(p, u) for p, u in heart if low <= raw_start(p)[:10] <= high]

    for low, high, fmt in ((first, last, "json"), (last, last, "csv"), (first, last, "csv")):
        query = {"metric": "heart_rate", "from": low, "to": high, "format": fmt}
        route = get(store.address, "/api/points", **{("from_" if k == "from" else k): v
                                                     for k, v in query.items()})
        assert route.status == 200, route.body[:300]
        result = run_export("--data", store.data_dir, "--metric", "heart_rate", "--from", low,
                            "--to", high, "--format", fmt)
        assert result.returncode == 0, result.stderr
        assert result.stdout == route.body, (low, high, fmt)
        want = on(low, high)
        assert want and len(want) < len(heart)
        if fmt == "json":
            reply = json.loads(result.stdout)
            assert (reply["from"], reply["to"]) == (low, high)  # the dates asked, both in
            assert reply["runs"] == raw_runs(want)
        else:
            rows = list(csv.reader(io.StringIO(result.stdout.decode(), newline="")))
            assert [row[4] for row in rows[1:]] == [raw_start(p)[:10] for p, _ in want]
            assert rows[-1][4] == high  # the last day is there, to its last minute
    # with an offset: from the first day's midnight there to the midnight after the last
    low_us = int(dt.datetime.fromisoformat(first + "T00:00:00+00:00").timestamp()) * US
    high_us = int(dt.datetime.fromisoformat(last + "T00:00:00+00:00").timestamp()) * US
    high_us += 86400 * US
    result = run_export("--data", store.data_dir, "--metric=heart_rate", "--tz=+00:00",
                        "--from=" + first, "--to=" + last)
    assert result.returncode == 0, result.stderr
    reply = json.loads(result.stdout)
    assert (reply["from"], reply["to"]) == (utc_iso(low_us), utc_iso(high_us))
    assert reply["runs"] == raw_runs(in_range(heart, low_us, high_us))
    # the help says it
    helped = subprocess.run([sys.executable, "-m", "healthlog", "export", "--help"],
                            capture_output=True, text=True, timeout=60)
    assert helped.returncode == 0
    assert ("--to TIME end of the range: a date alone (YYYY-MM-DD) includes that local day"
            in " ".join(helped.stdout.split())), helped.stdout


def test_read_2_7_the_object_table_holds_exactly_the_posted_points(store):
    """The oracle's premise, read from the blobs: a wrong corpus would make the tests above
    pass or fail for nothing."""
    for metric, layer in store.corpus.posted:
        stored = []
        for row in object_rows(store.data_dir, metric):
            if row["layer"] == layer:
                stored += json.loads(gzip.decompress(row["blob"]))
        assert stored == [p for p, _ in store.corpus.points(metric, layer)], (metric, layer)


# ---------------------------------------------------------------------------------------------
# READ-9: the Grafana dashboard in contrib/ asks what the API answers

DASHBOARD = ROOT / "contrib" / "grafana" / "healthlog-infinity.json"
def test_read_9_1_the_grafana_dashboard_asks_what_the_api_answers(store):
    dashboard = json.loads(DASHBOARD.read_text(encoding="utf-8"))
    assert dashboard["schemaVersion"] >= 39
    targets = [t for p in dashboard["panels"] for t in p.get("targets", [])]
    targets += [v["query"]["infinityQuery"] for v in dashboard["templating"]["list"]
                if v["type"] == "query"]
    grafana = {"${__from}": str((DAY0 - 86400) * 1000), "${__to}": str((DAY0 + 6 * 86400) * 1000),
               "${metric}": "step_count", "${tz}": "-08:00"}
    seen_paths = set()
    for target in targets:
        assert (target["type"], target["source"], target["parser"]) == ("json", "url", "backend")
        assert target["url_options"]["method"] == "GET"
        query = {}
        for param in target["url_options"]["params"]:
            query[param["key"] + ("_" if param["key"] == "from" else "")] = grafana.get(
                param["value"], param["value"])
        assert not [v for v in query.values() if "$" in v], query
        reply = get_json(store.address, target["url"], **query)
        rows = select(reply, target["root_selector"])
        assert rows and all(isinstance(r, dict) for r in rows), target["root_selector"]
        for column in target["columns"]:
            cells = [select(row, column["selector"]) for row in rows]
            assert any(cells), (target["url"], query, column)
            for cell in cells:
                assert len(cell) <= 1, column
                if cell and column["type"] == "timestamp":
                    assert healthlog.parse_time(cell[0]) is not None, cell
                if cell and column["type"] == "number":
                    assert numeric(cell[0]), (column, cell)
        seen_paths.add(target["url"])
    assert seen_paths == {"/api/points", "/api/catalog", "/api/deliveries"}
