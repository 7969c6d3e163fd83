"""Shapes seen in real Health Auto Export bodies, and the fold rules of version 2 that
they called for (openspec/specs/storage/spec.md, STORAGE-8.n; one import scenario of the
reindex spec, REINDEX-9.5).

What real exports showed (bodies people published, folded while building this version):
sleep records of different stages sharing one exact span, a Minutes export whose heart
rate carries seconds, one-day Days exports with one point per metric, metrics with
``"data": null``, old and new aggregated sleep, and the same days re-sent in other units
after a change of the phone's unit setting. The bodies here are built in those shapes,
with the device names of tests/hae_factory.py, so that the autouse leak check of conftest
fails a test whose WARN or INFO records carry a value or a device name.

Most deliveries are journaled by really posting them to a paused Cheroot server on
127.0.0.1:0 and folded by the real ``FoldWorker.run_pass``/``FoldEngine`` on a
connection of the test's own (`Passes`, as in tests/test_fold.py); the hypothesis
properties journal through ``accept_delivery`` into a fresh data directory per example
(as tests/test_fold_properties.py does); the CLI and ``serve`` run as real subprocesses.
``merge_hour`` is pure and is tested directly (STORAGE-8.10).
"""

import contextlib
import datetime as dt
import gzip
import json
import os
import random
import re
import sqlite3
import tempfile
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import hae_factory as hf
import healthlog
from conftest import Passes, archive_files, db_rows, live_fingerprint, run_cli, wait_for
from fold_helpers import Journal, DirectStore, body_of


pytestmark = pytest.mark.usefixtures("json_mode")  # every test with and without orjson

EASTERN = hf.Zone("America/New_York", -300, -240, "us")  # the -0400/-0500 of real bodies
PROPERTY = settings(max_examples=25, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow])

#: The time-valued keys as the rules name them (written out here, not read from healthlog).
TIME_KEYS = ("date", "start", "end", "startDate", "endDate", "sleepStart", "sleepEnd",
             "inBedStart", "inBedEnd", "scheduledDate")

UNITS_WARN = "units differ from the stored object's"
INCOMPARABLE_WARN = "incomparable points at one coordinate"
DISAGREES = "disagrees"
UNKNOWN_GROUPING = "names no known grouping"


# ---------------------------------------------------------------------------------------------
# Headers and bodies.

def automation(name: str, aggregation=None, period: str = "Since Last Sync") -> dict:
    """The headers HAE sends for an automation; without ``automation-aggregation`` when
    ``aggregation`` is None (what an import without --aggregation amounts to)."""
    headers = hf.headers_for(hf.Automation(name, aggregation or "Minutes", period),
                             hf.new_uuid(random.Random(name)))
    del headers["Content-Type"]
    if aggregation is None:
        del headers["automation-aggregation"]
    return headers


def object_hour(text: str) -> int:
    return healthlog.parse_time(text) // healthlog.HOUR_US


def sleep_pairs_month(seed: int = 11, nights: int = 28) -> list:
    """A month of non-aggregated sleep records (``startDate, endDate, qty, value, source``,
    ``date`` absent or null) with two same-span pairs a night: the phone's InBed record
    beside the watch's Core segment of the same start and end, and another beside a REM
    segment (56 pairs in 28 nights, as in the real month)."""
    start = dt.date(2024, 5, 1)
    phone = hf.Phone(EASTERN, sources="single", language="en-6.6.2")
    rows = hf.sleep_segments(seed, start, start + dt.timedelta(days=nights), phone=phone,
                             variant="old")
    out, paired = [], set()
    for row in rows:
        if row["value"] == "InBed":
            paired = set()  # a new night
        twin = {"startDate": row["startDate"], "endDate": row["endDate"], "qty": row["qty"],
                "value": "InBed", "source": hf.OWNER_PHONE}
        stage = row["value"]
        if stage == "REM" and "REM" not in paired:
            out += [twin, row]  # InBed + REM
            paired.add(stage)
        elif stage == "Core" and "Core" not in paired:
            out += [row, twin]  # Core + InBed
            paired.add(stage)
        else:
            out.append(row)
    for i, row in enumerate(out):  # `date` null in half the records, absent in the others
        if i % 2 == 0:
            out[i] = dict([("date", None)] + list(row.items()))
    return out


def same_span_pairs(rows: list) -> list:
    """((startDate, endDate), sorted values) of every span that more than one record has."""
    spans: dict = {}
    for row in rows:
        spans.setdefault((row["startDate"], row["endDate"]), []).append(row["value"])
    return sorted((span, sorted(values)) for span, values in spans.items() if len(values) > 1)


def energy(seed: int, start: dt.datetime, end: dt.datetime, units: str) -> dict:
    """active_energy per minute of ``[start, end)`` (wall time, Pacific) in ``units``: the
    truth is one, so the kJ values of an instant are its kcal values x 4.184."""
    phone = hf.Phone(sources="single")
    return hf.metric("active_energy", hf.metric_points(seed, "active_energy", start, end,
                                                       "Minutes", phone=phone, units=units),
                     units)


# ---------------------------------------------------------------------------------------------
# Re-spelling times (written apart from healthlog.parse_time).

_HAE_TEXT = re.compile(r"(\d{4})-(\d{2})-(\d{2}) (\d{2}):(\d{2}):(\d{2}) ([+-])(\d{2})(\d{2})\Z")

#: style -> None (24-hour as sent), ("12", space, upper case), ("iso",) or ("24z",).
STYLES = {
    "24h": None,
    "12H": ("12", " ", True), "12h": ("12", " ", False),
    "12H-nbsp": ("12", "\u00a0", True), "12h-nbsp": ("12", "\u00a0", False),
    "12H-nnbsp": ("12", "\u202f", True), "12h-nnbsp": ("12", "\u202f", False),
    "iso-z": ("iso",), "24h-z": ("24z",),
}


def respell(text: str, style: str) -> str:
    """One HAE 24-hour timestamp written in another style; the same instant."""
    match = _HAE_TEXT.match(text)
    assert match, text
    y, mo, d, h, mi, s, sign, oh, om = match.groups()
    how = STYLES[style]
    if how is None:
        return text
    if how[0] == "12":
        hour = int(h)
        mark = "PM" if hour >= 12 else "AM"
        mark = mark if how[2] else mark.lower()
        return "%s-%s-%s %d:%s:%s%s%s %s%s%s" % (y, mo, d, hour % 12 or 12, mi, s, how[1],
                                               mark, sign, oh, om)
    offset = dt.timedelta(hours=int(oh), minutes=int(om)) * (-1 if sign == "-" else 1)
    moment = dt.datetime(int(y), int(mo), int(d), int(h), int(mi), int(s)) - offset
    if how[0] == "iso":
        return moment.strftime("%Y-%m-%dT%H:%M:%SZ")
    return moment.strftime("%Y-%m-%d %H:%M:%S Z")


def respell_all(value, styles: list, counter: list):
    """``value`` with every string under a time-valued key re-spelled, the styles taken in
    turn; ``counter[0]`` counts the re-spelled values."""
    if isinstance(value, dict):
        out = {}
        for key, item in value.items():
            if key in TIME_KEYS and isinstance(item, str) and _HAE_TEXT.match(item):
                out[key] = respell(item, styles[counter[0] % len(styles)])
                counter[0] += 1
            else:
                out[key] = respell_all(item, styles, counter)
        return out
    if isinstance(value, list):
        return [respell_all(item, styles, counter) for item in value]
    return value


# ---------------------------------------------------------------------------------------------
# Reading a data directory.

def decoded(blob: bytes) -> list:
    return json.loads(gzip.decompress(blob))


def decoded_objects(data_dir: Path, metric: str = None) -> list:
    rows = db_rows(data_dir, "SELECT * FROM object ORDER BY metric, layer, hour")
    for row in rows:
        row["decoded"] = decoded(row["blob"])
        row["from"] = json.loads(row["point_deliveries"])
    return [row for row in rows if metric is None or row["metric"] == metric]


def warns(logs, msg_part: str, delivery_id: int = None) -> list:
    return [r for r in logs.find(msg_part, "WARN")
            if delivery_id is None or r.get("delivery_id") == str(delivery_id)]


# ---------------------------------------------------------------------------------------------
# Folding at once: the journal of a paused real server (fold_helpers.Journal) and passes
# driven by the test (tests/test_fold.py).

class FoldNow:
    """Post one delivery and fold it at once: the delivery's journal row."""

    def __init__(self, journal: Journal, passes: Passes):
        self.journal, self.passes = journal, passes
        self.data_dir = journal.data_dir

    def __call__(self, body: bytes, headers: dict) -> dict:
        delivery_id = self.journal.post(body, headers)
        self.passes.run()
        row = self.journal.row(delivery_id)
        assert row["parse_status"] != "pending"
        return row


@pytest.fixture
def fold(start_service):
    journal = Journal(start_service(paused=True, busy_timeout_s=0.2))
    passes = Passes(journal.config)
    yield FoldNow(journal, passes)
    passes.close()


# ---------------------------------------------------------------------------------------------
# A data directory folded without HTTP, one per hypothesis example (fold_helpers.Store, as
# in tests/test_fold_properties.py): deliveries received a second apart from T0.

T0 = dt.datetime(2024, 6, 1, tzinfo=dt.timezone.utc)
#: The extra columns read by DirectStore.objects() here: who created and who last changed an object.
WRITERS = ("delivery_id", "updated_by")


# ---------------------------------------------------------------------------------------------
# Running the CLI (tests/test_reindex.py).

# =============================================================================================
# STORAGE-8.1: two sleep records of different stages with the same span are both kept.
# =============================================================================================

def test_storage_8_1_same_span_sleep_stages_are_both_kept(fold, logs):
    rows = sleep_pairs_month()
    pairs = same_span_pairs(rows)
    assert len(pairs) == 56
    assert {tuple(values) for _, values in pairs} == {("Core", "InBed"), ("InBed", "REM")}
    assert any("date" not in r for r in rows) and any(r.get("date", 0) is None for r in rows)

    row = fold(body_of(hf.metric("sleep_analysis", rows, "hr")),
               automation("Sleep records", "Days", "Previous 7 Days"))

    assert (row["parse_status"], row["layer"], row["error"]) == ("parsed", "record", None)
    assert (row["points"], row["bad_points"]) == (len(rows), 0)
    assert (row["incomparable"], row["overwrites"], row["unit_conflicts"]) == (0, 0, 0)
    stored = decoded_objects(fold.data_dir)
    assert {(o["metric"], o["layer"]) for o in stored} == {("sleep_analysis", "record")}
    assert sum(o["points"] for o in stored) == len(rows)
    assert row["objects_written"] == len(stored) == len({object_hour(r["startDate"]) for r in rows})
    kept = [p for o in stored for p in o["decoded"]]
    assert same_span_pairs(kept) == pairs  # both stages of every pair, as sent
    assert sorted(json.dumps(p, sort_keys=True) for p in kept) == sorted(
        json.dumps(r, sort_keys=True) for r in rows)
    assert warns(logs, INCOMPARABLE_WARN) == [] and warns(logs, "collision") == []


def test_storage_8_1_a_mood_and_an_emotion_logged_at_one_moment_are_both_kept(fold, logs):
    rng = random.Random(5)
    moment = dt.datetime(2024, 6, 3, 21, 0, tzinfo=dt.timezone.utc)
    mood = hf.state_of_mind(rng, moment, kind="daily_mood")
    emotion = hf.state_of_mind(rng, moment, kind="momentary_emotion")
    assert (mood["start"], mood["end"]) == (emotion["start"], emotion["end"])

    row = fold(body_of(stateOfMind=[mood, emotion]), automation("Mood", "Days"))

    assert (row["parse_status"], row["points"], row["incomparable"]) == ("parsed", 2, 0)
    [stored] = decoded_objects(fold.data_dir)
    assert stored["metric"] == "state_of_mind" and stored["points"] == 2
    assert sorted(p["kind"] for p in stored["decoded"]) == ["daily_mood", "momentary_emotion"]
    assert warns(logs, INCOMPARABLE_WARN) == []


def test_storage_8_1_the_category_is_part_of_the_coordinate():
    span = {"startDate": "2023-01-31 03:07:12 +0800", "endDate": "2023-01-31 03:21:12 +0800",
            "qty": 0.23333333333333334, "source": hf.OWNER_WATCH}
    core, in_bed = dict(span, value="Core"), dict(span, value="InBed", source=hf.OWNER_PHONE)
    start = healthlog.parse_time(span["startDate"])
    end = healthlog.parse_time(span["endDate"])
    assert healthlog.point_coordinate(core) == (start, end, "Core")
    assert healthlog.point_coordinate(in_bed) == (start, end, "InBed")
    numeric = {"date": "2024-05-19 10:01:00 -0400", "qty": 3, "value": 1}
    assert healthlog.point_coordinate(numeric)[2] == ""  # only a string value is a category
    # In one delivery the two are not rivals: extraction keeps both coordinates.
    extraction = healthlog.extract_points(
        {"data": {"metrics": [hf.metric("sleep_analysis", [core, in_bed], "hr")]}})
    [bucket] = extraction.metrics.values()
    assert not bucket.is_metric and len(bucket.coords) == 2


# =============================================================================================
# STORAGE-8.2: values dropped inside one delivery are counted and WARNed.
# =============================================================================================

def test_storage_8_2_dropped_different_values_at_one_coordinate_are_counted_and_warned(
        fold, logs):
    day = "2024-03-08 10:%02d:00 -0800"

    def hr(minute: int, avg, source=hf.CANARY_SOURCE, **extra) -> dict:
        point = {"date": day % minute, "Min": 60, "Avg": avg, "Max": 90, "source": source}
        point.update(extra)
        return point

    points = [
        hr(1, hf.CANARY_QTY), hr(1, 80.5, source=hf.OWNER_WATCH),  # same keys, other Avg
        hr(2, 70.25),
        hr(2, hf.RawNumber("70.250000000000014"), source=hf.OWNER_WATCH),  # the same value
        {"date": day % 2, "Min": 60, "Avg": 70.25, "source": hf.CANARY_SOURCE},  # dominated
        hr(3, 75.5),
    ]
    headers = automation("Heart fast", "Minutes")

    row = fold(body_of(hf.metric("heart_rate", points, "count/min")), headers)

    assert (row["parse_status"], row["layer"]) == ("parsed", "minutes")
    assert (row["points"], row["incomparable"], row["objects_written"]) == (6, 1, 1)
    [warn] = warns(logs, INCOMPARABLE_WARN, row["id"])
    assert (warn["metric"], warn["layer"], warn["hour"], warn["incomparable"]) == (
        "heart_rate", "minutes", str(object_hour(day % 0)), "1")
    [stored] = decoded_objects(fold.data_dir, "heart_rate")
    assert [p["date"] for p in stored["decoded"]] == [day % m for m in (1, 2, 3)]
    first, second, _ = stored["decoded"]
    assert first["Avg"] in (hf.CANARY_QTY, 80.5)  # one of the two is kept...
    assert "Max" in second and hf.same_value(second["Avg"], 70.25)  # ...the dominated never

    # The same points in the opposite order keep the same winner: nothing is written, and
    # the dropped value is counted again.
    again = fold(body_of(hf.metric("heart_rate", points[::-1], "count/min")), headers)

    assert (again["objects_written"], again["overwrites"], again["incomparable"]) == (0, 0, 1)
    assert decoded_objects(fold.data_dir, "heart_rate")[0]["hash"] == stored["hash"]
    assert len(warns(logs, INCOMPARABLE_WARN, again["id"])) == 1


# =============================================================================================
# STORAGE-8.3: an hourly object keeps the units it was created with.
# =============================================================================================

def test_storage_8_3_kj_after_kcal_leaves_the_kcal_objects_and_counts_conflicts(fold, logs):
    day = hf.DEFAULT_DAY
    ten, one, two = (dt.datetime.combine(day, dt.time(h)) for h in (10, 13, 14))
    kcal = energy(5, ten, one, "kcal")
    kj = energy(5, ten, two, "kJ")  # the same days re-sent after the unit setting changed
    by_date = {p["date"]: p["qty"] for p in kcal["data"]}
    assert all(abs(p["qty"] - by_date[p["date"]] * 4.184) < 1e-9 * p["qty"]
               for p in kj["data"] if p["date"] in by_date)
    kcal_hours = {object_hour(p["date"]) for p in kcal["data"]}
    kj_hours = {object_hour(p["date"]) for p in kj["data"]}
    assert len(kcal_hours) == 3 and kj_hours - kcal_hours  # one hour only in the kJ delivery
    headers = automation("Energy", "Minutes")

    first = fold(body_of(kcal), headers)
    before = {o["hour"]: o for o in decoded_objects(fold.data_dir, "active_energy")}
    second = fold(body_of(kj), headers)

    assert first["unit_conflicts"] == 0 and second["parse_status"] == "parsed"
    assert second["unit_conflicts"] == len(kcal_hours & kj_hours) == 3
    assert second["objects_written"] == len(kj_hours - kcal_hours) == 1
    after = {o["hour"]: o for o in decoded_objects(fold.data_dir, "active_energy")}
    assert set(after) == kcal_hours | kj_hours
    for hour in kcal_hours:  # untouched: units, points, hash and provenance
        assert after[hour]["units"] == "kcal"
        assert {k: v for k, v in after[hour].items() if k != "decoded"} == \
            {k: v for k, v in before[hour].items() if k != "decoded"}
        assert {p["date"]: p["qty"] for p in after[hour]["decoded"]} == {
            d: q for d, q in by_date.items() if object_hour(d) == hour}
        assert set(after[hour]["from"]) == {first["id"]}
    for hour in kj_hours - kcal_hours:  # a new hour takes the arriving units
        assert after[hour]["units"] == "kJ" and set(after[hour]["from"]) == {second["id"]}
        assert after[hour]["delivery_id"] == second["id"]
    records = warns(logs, UNITS_WARN, second["id"])
    assert sorted((r["metric"], r["layer"], r["hour"], r["stored_units"], r["arriving_units"])
                  for r in records) == sorted(("active_energy", "minutes", str(h), "kcal", "kJ")
                                              for h in kcal_hours)
    # the arriving kJ points of those hours stay in the archive, byte for byte
    archived = fold.data_dir / fold.journal.row(second["id"])["archive_path"]
    assert archived.read_bytes() == body_of(kj)


# =============================================================================================
# STORAGE-8.4: sleep always goes to the record layer, needing no aggregation header.
# =============================================================================================

def _old_aggregated_sleep() -> list:
    """Pre-6.6.2 nightly rows: ``date`` is the wake time, with sleepSource/inBedSource."""
    nights = (("2021-12-16", "00:48:20", "01:12:00", "08:41:12", "08:50:03"),
              ("2021-12-17", "23:30:15", "23:58:47", "07:55:40", "08:02:11"),
              ("2021-12-18", "01:31:02", "01:58:30", "09:03:36", "09:10:44"))
    rows = []
    for day, bed, asleep, wake, up in nights:
        bed_day = "2021-12-16" if bed.startswith("23") else day
        rows.append({"date": "%s %s +0800" % (day, wake), "asleep": 6.9152777777777779,
                     "sleepStart": "%s %s +0800" % (day, asleep),
                     "sleepEnd": "%s %s +0800" % (day, wake), "sleepSource": hf.OWNER_WATCH,
                     "inBed": 7.6494444444444447, "inBedStart": "%s %s +0800" % (bed_day, bed),
                     "inBedEnd": "%s %s +0800" % (day, up), "inBedSource": hf.OWNER_PHONE})
    return rows


def _null_date_records() -> list:
    """Records with ``"date": null`` beside ``startDate``/``endDate``."""
    stages = (("02:44:02", "03:07:12", "Core"), ("03:07:12", "03:21:12", "Deep"),
              ("03:21:12", "03:49:42", "REM"), ("03:49:42", "03:52:12", "Awake"),
              ("02:44:02", "08:39:12", "InBed"))
    return [{"date": None, "startDate": "2023-01-31 %s +0800" % a,
             "endDate": "2023-01-31 %s +0800" % b,
             "qty": (healthlog.parse_time("2023-01-31 %s +0800" % b)
                     - healthlog.parse_time("2023-01-31 %s +0800" % a)) / 3.6e9,
             "value": v, "source": hf.OWNER_PHONE if v == "InBed" else hf.OWNER_WATCH}
            for a, b, v in stages]


_PERTH = hf.Phone(hf.PERTH, sources="single")
SLEEP_FORMS = {
    "old-aggregated": _old_aggregated_sleep,
    "null-date-records": _null_date_records,
    "summary-6.6.2": lambda: hf.sleep_nights(3, hf.DEFAULT_DAY,
                                             hf.DEFAULT_DAY + dt.timedelta(days=3),
                                             phone=_PERTH),
    "one-summary": lambda: hf.sleep_nights(4, hf.DEFAULT_DAY, phone=_PERTH),
    "records": lambda: hf.sleep_segments(5, hf.DEFAULT_DAY, phone=_PERTH, variant="old"),
    "records-with-start-end": lambda: hf.sleep_segments(6, hf.DEFAULT_DAY, phone=_PERTH),
}


@pytest.mark.parametrize("form", sorted(SLEEP_FORMS))
def test_storage_8_4_each_sleep_format_alone_needs_no_aggregation_header(fold, logs, form):
    rows = SLEEP_FORMS[form]()
    assert rows
    if form == "summary-6.6.2":
        assert {"totalSleep", "asleep", "core", "deep", "rem", "awake", "sleepStart",
                "inBedEnd", "source"} <= set(rows[0]) and rows[0]["asleep"] == 0

    row = fold(body_of(hf.metric("sleep_analysis", rows, "hr")),
               automation("Sleep " + form, None, "Previous 7 Days"))

    assert (row["parse_status"], row["layer"], row["error"]) == ("parsed", "record", None)
    assert (row["points"], row["bad_points"], row["incomparable"]) == (len(rows), 0, 0)
    stored = decoded_objects(fold.data_dir)
    assert {(o["metric"], o["layer"]) for o in stored} == {("sleep_analysis", "record")}
    assert sum(o["points"] for o in stored) == len(rows)
    assert [r for r in logs.records() if r.get("level") == "WARN"] == []


def test_storage_8_4_sleep_beside_metrics_goes_to_record_whatever_the_header(fold):
    phone = hf.Phone(sources="single")
    payload = hf.metrics_payload(8, ("step_count", "sleep_analysis"), hf.DEFAULT_DAY,
                                 grouping="Hours", phone=phone, sleep="segments")
    nights = [m for m in payload["data"]["metrics"] if m["name"] == "sleep_analysis"]
    assert nights[0]["data"]

    row = fold(hf.dumps_hae(payload), automation("Hourly with sleep", "Hours"))

    assert (row["parse_status"], row["layer"]) == ("parsed", "hours")
    layers = {(o["metric"], o["layer"]) for o in decoded_objects(fold.data_dir)}
    assert layers == {("step_count", "hours"), ("sleep_analysis", "record")}


# =============================================================================================
# STORAGE-8.5: layer inference from tiny exports; "data": null is an empty metric.
# =============================================================================================

DAYS_EXPORT = (  # (name, units, value keys): 13 metrics, 10 with a point, 3 with "data": []
    ("step_count", "count", {"qty": 7369.1420323996308}),
    ("active_energy", "kcal", {"qty": 512.25}),
    ("basal_energy_burned", "kcal", {"qty": 1690.5}),
    ("walking_running_distance", "km", {"qty": 5.4321}),
    ("flights_climbed", "count", None),
    ("apple_exercise_time", "min", {"qty": 34}),
    ("apple_stand_hour", "count", None),
    ("heart_rate", "count/min", {"Min": 52, "Avg": hf.CANARY_QTY, "Max": 116}),
    ("resting_heart_rate", "count/min", {"qty": 57}),
    ("walking_heart_rate_average", "count/min", {"qty": 96.5}),
    ("heart_rate_variability", "ms", None),
    ("respiratory_rate", "count/min", {"qty": 15.25}),
    ("blood_oxygen_saturation", "%", {"qty": 97.5}),
)


def test_storage_8_5_a_one_day_days_export_without_header_is_days(fold, logs):
    midnight = "2024-05-19 00:00:00 -0700"
    metrics = [hf.metric(name, [] if values is None else [
        dict([("date", midnight)] + list(values.items()) + [("source", hf.OWNER_WATCH)])],
        units) for name, units, values in DAYS_EXPORT]
    assert len(metrics) == 13 and sum(len(m["data"]) for m in metrics) == 10

    row = fold(body_of(*metrics), automation("Today totals", None, "Today"))

    assert (row["parse_status"], row["layer"], row["error"]) == ("parsed", "days", None)
    assert (row["points"], row["bad_points"], row["objects_written"]) == (10, 0, 10)
    assert {o["layer"] for o in decoded_objects(fold.data_dir)} == {"days"}
    assert [r for r in logs.records() if r.get("level") == "WARN"] == []


def test_storage_8_5_a_metric_with_data_null_is_an_empty_metric(fold, logs):
    steps = hf.metric("step_count", [
        {"date": "2024-05-19 10:%02d:00 -0700" % m, "qty": 12.5 + m, "source": hf.OWNER_WATCH}
        for m in (1, 2)], "count")
    empty = {"name": "heart_rate", "units": "count/min", "data": None}

    row = fold(body_of(steps, empty), automation("Null data", None))

    assert (row["parse_status"], row["layer"], row["error"]) == ("parsed", "minutes", None)
    assert (row["points"], row["bad_points"]) == (2, 0)
    assert [(o["metric"], o["layer"], o["points"]) for o in decoded_objects(fold.data_dir)] == [
        ("step_count", "minutes", 2)]
    assert warns(logs, "points without a readable time") == []


def test_storage_8_5_a_single_point_without_header_or_history_is_not_inferable(fold):
    single = hf.metric("step_count", [{"date": "2024-05-19 10:01:00 -0700", "qty": 12.5,
                                       "source": hf.OWNER_WATCH}], "count")

    row = fold(body_of(single), automation("Lonely", None))

    assert (row["parse_status"], row["error"], row["layer"]) == (
        "failed", "layer_not_inferable", None)
    assert decoded_objects(fold.data_dir) == []


# =============================================================================================
# STORAGE-8.6: a Minutes export whose heart rate carries seconds.
# =============================================================================================

def _minutes_export() -> bytes:
    phone = hf.Phone(EASTERN, sources="single")
    start = dt.datetime(2024, 5, 19, 10, 0)
    end = start + dt.timedelta(hours=1)
    metrics = [hf.metric(name, hf.metric_points(2, name, start, end, "Minutes", phone=phone))
               for name in ("step_count", "active_energy", "basal_energy_burned",
                            "walking_running_distance")]
    heart = hf.metric_points(2, "heart_rate", start, end, "Default", phone=phone)  # seconds
    assert sum(not p["date"].endswith(":00 -0400") for p in heart) >= 3
    assert all(p["date"].endswith(":00 -0400") for m in metrics for p in m["data"])
    return body_of(hf.metric("heart_rate", heart), *metrics)


@pytest.mark.parametrize("header, layer, disagrees", [
    (None, "minutes", False), ("Minutes", "minutes", False), ("Days", "days", True)])
def test_storage_8_6_second_heart_rate_in_a_minutes_export(fold, logs, header, layer,
                                                           disagrees):
    row = fold(_minutes_export(), automation("Minutes export", header))

    assert (row["parse_status"], row["layer"]) == ("parsed", layer)
    assert {o["layer"] for o in decoded_objects(fold.data_dir)} == {layer}
    found = warns(logs, DISAGREES, row["id"])
    if disagrees:  # minute data under a Days header is a real contradiction
        [warn] = found
        assert (warn["header"], warn["inferred"]) == ("days", "minutes")
    else:
        assert found == [] and warns(logs, DISAGREES) == []


# =============================================================================================
# STORAGE-8.7: times compare as instants, however they are spelled.
# =============================================================================================

def _whole_day(seed: int, day: dt.date, hours: tuple = (0, 24)) -> tuple:
    """(metrics body, aggregated sleep body) of a day of an Eastern phone in 24-hour time:
    step count and heart rate per minute, the night's sleep segments (``date``, ``start``,
    ``end``, ``startDate``, ``endDate``), a workout (nested ``date`` keys), medications
    (``scheduledDate``); and the night's summary (``sleepStart`` … ``inBedEnd``)."""
    rng = random.Random(seed)
    phone = hf.Phone(EASTERN)
    start = dt.datetime.combine(day, dt.time()) + dt.timedelta(hours=hours[0])
    end = dt.datetime.combine(day, dt.time()) + dt.timedelta(hours=hours[1])
    metrics = [hf.metric(name, hf.metric_points(seed, name, start, end, "Minutes", phone=phone,
                                                rng=rng))
               for name in ("step_count", "heart_rate")]
    metrics.append(hf.metric("sleep_analysis", hf.sleep_segments(seed, day, phone=phone,
                                                                 rng=rng)))
    workout = hf.workout_v2(seed, dt.datetime.combine(day, dt.time(18, 5)), minutes=12,
                            phone=phone, route_points=0, rng=rng)
    doses = hf.medications(rng, dt.datetime.combine(day, dt.time(8, 3)), phone=phone,
                           scheduled=dt.datetime.combine(day, dt.time(8)))
    points = hf.envelope(metrics=metrics, workouts=[workout], medications=doses)
    summary = hf.envelope(metrics=[hf.metric("sleep_analysis", hf.sleep_nights(
        seed, day, phone=phone, rng=rng))])
    return points, summary


def test_storage_8_7_respelled_times_of_a_folded_day_write_nothing(fold, logs):
    assert set(TIME_KEYS) == set(healthlog.TIME_KEYS)
    stamp = "2024-03-13 23:32:00 -0400"
    spelled = {style: respell(stamp, style) for style in STYLES}
    assert spelled["12H"] == "2024-03-13 11:32:00 PM -0400"
    assert spelled["12H-nbsp"] == "2024-03-13 11:32:00\u00a0PM -0400"
    assert spelled["12h-nnbsp"] == "2024-03-13 11:32:00\u202fpm -0400"
    assert spelled["iso-z"] == "2024-03-14T03:32:00Z"
    assert respell("2024-03-13 00:05:00 -0400", "12h") == "2024-03-13 12:05:00 am -0400"
    headers = automation("Whole day", "Minutes")
    bodies = _whole_day(21, dt.date(2024, 3, 13))
    for body in bodies:
        assert fold(hf.dumps_hae(body), headers)["objects_written"] > 0
    before, fingerprint = decoded_objects(fold.data_dir), live_fingerprint(fold.data_dir)
    assert {(o["metric"], o["layer"]) for o in before} >= {
        ("step_count", "minutes"), ("heart_rate", "minutes"), ("sleep_analysis", "record"),
        ("workouts", "record")}

    for style in ("12H", "12h", "12H-nbsp", "12h-nbsp", "12H-nnbsp", "12h-nnbsp", "iso-z",
                  "24h-z"):
        for body in bodies:
            count = [0]
            again = respell_all(body, [style], count)
            assert count[0] > 0
            row = fold(hf.dumps_hae(again, random.Random(style)), headers)

            assert (row["parse_status"], row["error"]) == ("parsed", None), style
            assert (row["objects_written"], row["overwrites"], row["incomparable"],
                    row["bad_points"]) == (0, 0, 0, 0), style

    assert decoded_objects(fold.data_dir) == before
    assert live_fingerprint(fold.data_dir) == fingerprint
    assert warns(logs, "collision") == [] and warns(logs, INCOMPARABLE_WARN) == []


@PROPERTY
@given(seed=st.integers(0, 10_000), first_hour=st.integers(0, 22),
       styles=st.lists(st.sampled_from(sorted(STYLES)), min_size=1, max_size=4),
       shuffle=st.integers(0, 2**32))
def test_storage_8_7_property_any_respelling_of_a_folded_delivery_writes_nothing(
        seed, first_hour, styles, shuffle):
    headers = {"automation-aggregation": "Minutes", "automation-id": "RESPELL"}
    day = dt.date(2024, 3, 13) + dt.timedelta(days=seed % 5)
    bodies = _whole_day(seed, day, (first_hour, first_hour + 1))
    with tempfile.TemporaryDirectory() as tmp:
        store = DirectStore(Path(tmp) / "data", T0)
        try:
            for body in bodies:
                store.journal_and_fold(hf.dumps_hae(body), headers)
            before = store.objects(*WRITERS)
            fingerprint = healthlog.fingerprint(store.conn)
            for body in bodies:
                again = respell_all(body, styles, [0])
                row = store.journal_and_fold(hf.dumps_hae(again, random.Random(shuffle)), headers)
                assert row["parse_status"] == "parsed"
                # (a re-spelling that changed no byte is a duplicate: a no-op by design)
                assert row["error"] is None or row["error"].startswith("duplicate of")
                assert (row["objects_written"], row["overwrites"], row["incomparable"],
                        row["bad_points"]) == (0, 0, 0, 0)
            assert store.objects(*WRITERS) == before
            assert healthlog.fingerprint(store.conn) == fingerprint
        finally:
            store.close()


# =============================================================================================
# STORAGE-8.8: every stored point sits in an object of its own delivery's units.
# =============================================================================================

KJ_PER_KCAL = 4.184
energy_deliveries = st.lists(
    st.tuples(st.sampled_from(["kcal", "kJ"]),
              st.lists(st.tuples(st.integers(0, 3), st.integers(0, 3),
                                 st.sampled_from([1.25, 2.5, 3.75, 12.0])),
                       min_size=1, max_size=6)),
    min_size=1, max_size=6)


@PROPERTY
@given(energy_deliveries)
def test_storage_8_8_property_stored_points_keep_the_units_they_came_in(deliveries):
    headers = {"automation-aggregation": "Minutes", "automation-id": "UNITS"}
    with tempfile.TemporaryDirectory() as tmp:
        store = DirectStore(Path(tmp) / "data", T0)
        try:
            units_of, model = {}, {}  # delivery id -> units; hour -> units the oracle expects
            seen = set()
            for units, points in deliveries:
                data = [{"date": "2024-06-01 %02d:%02d:00 +0000" % (10 + h, m),
                         "qty": kcal * (KJ_PER_KCAL if units == "kJ" else 1),
                         "source": hf.OWNER_WATCH} for h, m, kcal in points]
                hours = {object_hour(p["date"]) for p in data}
                conflicts = sum(1 for h in hours if model.setdefault(h, units) != units)
                body = body_of(hf.metric("active_energy", data, units))
                if body in seen:  # the same bytes again: a duplicate, a no-op by design
                    conflicts = 0
                seen.add(body)
                row = store.journal_and_fold(body, headers)
                units_of[row["id"]] = units
                assert row["unit_conflicts"] == conflicts
            rows = store.objects(*WRITERS)
            assert {hour: units for _, _, hour, units, *_ in rows} == model
            for _, _, _, units, count, _, blob, point_deliveries, created, _ in rows:
                came_from = json.loads(point_deliveries)
                assert len(came_from) == count == len(decoded(blob))
                assert {units_of[d] for d in came_from} == {units}
                assert units_of[created] == units
        finally:
            store.close()


# =============================================================================================
# STORAGE-8.9: an unknown header value, a literal Z, problems in `status`.
# =============================================================================================

def test_storage_8_8_one_metric_in_two_units_in_one_body_keeps_the_first(fold, logs):
    kg = hf.metric("weight_body_mass", [{"date": "2024-03-08 07:00:00 -0800", "qty": 70.5}],
                   "kg")
    lb = hf.metric("weight_body_mass", [{"date": "2024-03-08 07:05:00 -0800", "qty": 155.4}],
                   "lb")
    steps = hf.metric("step_count", [{"date": "2024-03-08 07:%02d:00 -0800" % m, "qty": m}
                                     for m in range(3)], "count")

    row = fold(body_of(kg, lb, steps), automation("Two units", "Minutes"))

    assert (row["parse_status"], row["unit_conflicts"]) == ("parsed", 1)
    weight = [o for o in decoded_objects(fold.data_dir, "weight_body_mass")]
    assert [(o["units"], [p["qty"] for p in o["decoded"]]) for o in weight] == [("kg", [70.5])]
    assert warns(logs, "came in two units")


def test_storage_8_8_no_units_is_a_label_of_its_own():
    unlabelled = healthlog.HourObject("step_count", "minutes", 10, None, [(1, 1, "")],
                                      [{"date": "x", "qty": 1}], [1], 1, 1, False)
    merged = healthlog.merge_hour(unlabelled, "step_count", "minutes", 10, "count",
                                  [((2, 2, ""), {"date": "y", "qty": 2})], 2, ("b", 2),
                                  {1: ("a", 1)})
    assert merged.written is None and merged.counters["unit_conflicts"] == 1


def test_storage_8_9_an_unknown_aggregation_header_is_warned_and_the_layer_inferred(fold, logs):
    steps = hf.metric("step_count", [
        {"date": "2024-03-08 %02d:00:00 -0800" % h, "qty": 310.5 + h, "source": hf.OWNER_WATCH}
        for h in (0, 1, 2)], "count")

    row = fold(body_of(steps), automation("Odd grouping", "Fortnightly"))

    assert (row["parse_status"], row["layer"], row["automation_aggregation"]) == (
        "parsed", "hours", "Fortnightly")
    [warn] = warns(logs, UNKNOWN_GROUPING, row["id"])
    assert warn["header"] == "Fortnightly"
    assert {o["layer"] for o in decoded_objects(fold.data_dir)} == {"hours"}


def test_storage_8_7_parse_time_reads_a_literal_z():
    expected = healthlog.parse_time("2024-01-02 18:00:00 +0000")
    assert expected == 1704218400 * 10**6
    assert healthlog.parse_time("2024-01-02 18:00:00 Z") == expected
    assert healthlog.parse_time("2024-01-02T18:00:00Z") == expected
    assert healthlog.parse_time("2024-01-02 6:00:00\u202fPM +0000") == expected


def test_reindex_8_2_status_lists_the_latest_failed_and_partial_deliveries(fold):
    steps = hf.metric("step_count", [
        {"date": "2024-03-08 10:%02d:00 -0800" % m, "qty": 12.5 + m, "source": hf.CANARY_SOURCE}
        for m in (1, 2, 3)], "count")
    parsed = fold(body_of(steps), automation("Fine", "Minutes"))
    partial = fold(body_of(steps, nutrition=[{"date": "2024-03-08 10:01:00 -0800",
                                              "qty": hf.CANARY_QTY}]),
                   automation("Half known", "Minutes"))
    lonely = hf.metric("step_count", [{"date": "2024-03-08 11:01:00 -0800", "qty": 7.5,
                                       "source": hf.CANARY_SOURCE}], "count")
    failed = fold(body_of(lonely), automation("Lonely push", None))
    assert [r["parse_status"] for r in (parsed, partial, failed)] == [
        "parsed", "partial", "failed"]
    data_dir = fold.data_dir

    as_json = run_cli("status", "--data", data_dir, "--json")
    as_text = run_cli("status", "--data", data_dir)

    assert as_json.returncode == 0 and as_text.returncode == 0, as_json.stderr
    status = json.loads(as_json.stdout)
    assert status["folded_by_older_parser"] == 0
    assert status["recent_problems"] == [
        {"id": failed["id"], "received_at": failed["received_at"], "automation": "Lonely push",
         "status": "failed", "error": "layer_not_inferable", "uncovered_keys": []},
        {"id": partial["id"], "received_at": partial["received_at"],
         "automation": "Half known", "status": "partial", "error": None,
         "uncovered_keys": ["nutrition"]}]
    lines = as_text.stdout.splitlines()
    at = lines.index("latest failed or partial deliveries:")
    assert lines[at + 1] == "  %d  %s  Lonely push  failed  layer_not_inferable" % (
        failed["id"], failed["received_at"])
    assert lines[at + 2] == "  %d  %s  Half known  partial  uncovered: nutrition" % (
        partial["id"], partial["received_at"])
    assert "folded by an older version" not in as_text.stdout

    # A row as a version-1 parser left it (what an upgrade finds): status names it.
    with contextlib.closing(sqlite3.connect(str(data_dir / healthlog.DB_NAME))) as conn:
        with conn:
            conn.execute("UPDATE delivery SET parser_version = 1 WHERE id = ?", (parsed["id"],))
    assert json.loads(run_cli("status", "--data", data_dir, "--json").stdout)[
        "folded_by_older_parser"] == 1
    assert re.search(r"^folded by an older version: 1 deliveries",
                     run_cli("status", "--data", data_dir).stdout, re.M)


# =============================================================================================
# REINDEX-9.5: import refuses a file whose layer cannot be decided.
# =============================================================================================

def test_reindex_9_5_import_refuses_an_undecidable_file_and_accepts_it_with_aggregation(
        data_dir, tmp_path):
    def export(name: str, minute: int, age_s: int) -> Path:
        path = tmp_path / name
        path.write_bytes(body_of(hf.metric("step_count", [
            {"date": "2024-03-08 10:%02d:00 -0800" % minute, "qty": 12.5 + minute,
             "source": hf.CANARY_SOURCE}], "count")))
        moment = time.time() - age_s  # an import's journal position is its file time
        os.utime(str(path), (moment, moment))
        return path

    single, later = export("single.json", 1, 3600), export("later.json", 7, 1800)
    sleep = tmp_path / "sleep.json"
    sleep.write_bytes(body_of(hf.metric("sleep_analysis", _null_date_records(), "hr")))

    refused = run_cli("import", "--data", data_dir, single)

    assert refused.returncode == 2
    [line] = refused.stdout.splitlines()
    assert line.startswith("rejected %s: " % single) and "--aggregation" in line
    assert db_rows(data_dir) == [] and archive_files(data_dir) == []

    accepted = run_cli("import", "--data", data_dir, "--aggregation", "Minutes", "--name",
                       "manual", single)
    alone = run_cli("import", "--data", data_dir, sleep)  # sleep is never undecidable

    assert (accepted.returncode, alone.returncode) == (0, 0), accepted.stdout + alone.stdout
    assert re.fullmatch(r"accepted %s: delivery \d+\n" % re.escape(str(single)),
                        accepted.stdout)
    assert run_cli("reindex", "--data", data_dir).returncode == 0
    # Once a delivery of the same --name has a layer, a single point inherits it.
    inherited = run_cli("import", "--data", data_dir, "--name", "manual", later)
    assert inherited.returncode == 0, inherited.stdout
    # An earlier one of the name still pending (nothing folded it yet) is enough too: its
    # fold decides the layer the single point then inherits.
    first, second = export("first.json", 20, 900), export("second.json", 30, 600)
    first.write_bytes(body_of(hf.metric("step_count", [
        {"date": "2024-03-08 11:%02d:00 -0800" % m, "qty": m + 0.5} for m in range(5)],
        "count")))
    os.utime(str(first), (time.time() - 900, time.time() - 900))
    both = run_cli("import", "--data", data_dir, "--name", "batch", first, second)
    assert both.returncode == 0, both.stdout

    reindexed = run_cli("reindex", "--data", data_dir)
    verified = run_cli("verify", "--data", data_dir)

    assert reindexed.returncode == 0, reindexed.stdout + reindexed.stderr
    assert verified.returncode == 0 and "verify: equal" in verified.stdout, verified.stdout
    rows = db_rows(data_dir)
    assert [(r["parse_status"], r["layer"], r["path_name"], r["automation_aggregation"])
            for r in rows] == [("parsed", "minutes", "manual", "Minutes"),
                               ("parsed", "record", None, None),
                               ("parsed", "minutes", "manual", None),
                               ("parsed", "minutes", "batch", None),
                               ("parsed", "minutes", "batch", None)]


# =============================================================================================
# STORAGE-8.10: merge_hour, the pure merge of one hour.
# =============================================================================================

HOUR_TEXT = "2024-03-08 10:%02d:00 -0800"
HOUR = object_hour(HOUR_TEXT % 0)
FIRST = ("2024-03-08T18:30:00.000000Z", 1)
SECOND = ("2024-03-08T18:40:00.000000Z", 2)
THIRD = ("2024-03-08T18:50:00.000000Z", 3)
POSITIONS = {1: FIRST, 2: SECOND, 3: THIRD}


def minute_point(minute: int, **values) -> dict:
    point = {"date": HOUR_TEXT % minute}
    point.update(values)
    point.setdefault("source", hf.CANARY_SOURCE)
    return point


def coord(point: dict) -> tuple:
    return (healthlog.parse_time(point["date"]),) * 2 + ("",)


def stored_object(points: list, deliveries: list, units: str = "kcal",
                  created_by: int = 1, updated_by: int = 1) -> healthlog.HourObject:
    return healthlog.HourObject("active_energy", "minutes", HOUR, units,
                                [coord(p) for p in points], list(points), list(deliveries),
                                created_by, updated_by, False)


def merge(stored, arriving: list, delivery_id: int, units: str = "kcal", dropped: int = 0):
    return healthlog.merge_hour(stored, "active_energy", "minutes", HOUR, units,
                                [(coord(p), p) for p in arriving], delivery_id,
                                POSITIONS[delivery_id], POSITIONS, dropped)


def counted(result) -> dict:
    return {k: v for k, v in result.counters.items() if v}


def test_storage_8_10_a_new_object_takes_the_arriving_units_and_sorted_points():
    arriving = [minute_point(20, qty=2.5), minute_point(5, qty=1.25), minute_point(40, qty=3.75)]

    result = merge(None, arriving, 2, units="kJ")

    written = result.written
    assert (written.metric, written.layer, written.hour, written.units) == (
        "active_energy", "minutes", HOUR, "kJ")
    assert [p["date"] for p in written.points] == [HOUR_TEXT % m for m in (5, 20, 40)]
    assert written.coords == sorted(coord(p) for p in arriving)
    assert written.deliveries == [2, 2, 2]
    assert (written.created_by, written.updated_by, written.sealed) == (2, 2, False)
    assert counted(result) == {"objects_written": 1} and result.warnings == []


def test_storage_8_10_other_units_leave_the_stored_object_and_count_a_conflict():
    stored = stored_object([minute_point(5, qty=1.25)], [1])
    snapshot = repr(stored)

    result = merge(stored, [minute_point(5, qty=1.25 * 4.184), minute_point(6, qty=2.0)], 2,
                   units="kJ")

    assert result.written is None
    assert counted(result) == {"unit_conflicts": 1}
    [(message, fields)] = result.warnings
    assert message.startswith(UNITS_WARN)
    assert (fields["metric"], fields["layer"], fields["hour"], fields["stored_units"],
            fields["arriving_units"]) == ("active_energy", "minutes", HOUR, "kcal", "kJ")
    assert repr(stored) == snapshot  # pure: the stored object is not touched


def test_storage_8_10_the_same_value_writes_nothing():
    stored = stored_object([minute_point(5, qty=61.999999999999993), minute_point(6, qty=2.0)], [1,
                                                                                                 1])
    same = [{"qty": 61.99999999999999, "date": "2024-03-08 10:05:00\u202fAM -0800",
             "source": hf.OWNER_WATCH},
            {"date": "2024-03-08T18:06:00Z", "qty": 2}]

    result = merge(stored, same, 2)

    assert result.written is None and counted(result) == {} and result.warnings == []


def test_storage_8_10_a_later_position_replaces_an_equally_complete_point():
    stored = stored_object([minute_point(5, qty=1.25), minute_point(6, qty=2.0)], [1, 1])

    result = merge(stored, [minute_point(5, qty=9.5)], 2)

    written = result.written
    assert [p["qty"] for p in written.points] == [9.5, 2.0]
    assert written.deliveries == [2, 1]
    assert (written.created_by, written.updated_by, written.units) == (1, 2, "kcal")
    assert counted(result) == {"objects_written": 1, "overwrites": 1}
    [(message, fields)] = result.warnings
    assert message.startswith("collision") and fields["overwrites"] == 1
    # an earlier position does not replace the later stored point
    later = stored_object([minute_point(5, qty=9.5)], [2], created_by=2, updated_by=2)
    assert merge(later, [minute_point(5, qty=1.25)], 1).written is None


def test_storage_8_10_a_dominated_point_does_not_replace_a_richer_one():
    rich = minute_point(5, qty=1.25, Min=0.5)
    stored = stored_object([rich], [1])

    poorer = merge(stored, [minute_point(5, qty=1.25)], 3)
    richer = merge(stored_object([minute_point(5, qty=1.25)], [3], created_by=3, updated_by=3),
                   [rich], 1)  # dominance wins over journal order

    assert poorer.written is None and poorer.counters["overwrites"] == 0
    assert richer.written.points == [rich] and richer.written.deliveries == [1]


def test_storage_8_10_appended_points_are_sorted_and_dropped_values_counted():
    stored = stored_object([minute_point(5, qty=1.0), minute_point(20, qty=2.0)], [1, 1])

    result = merge(stored, [minute_point(40, qty=4.0), minute_point(10, qty=3.0)], 3, dropped=2)

    written = result.written
    assert [p["qty"] for p in written.points] == [1.0, 3.0, 2.0, 4.0]
    assert written.coords == sorted(written.coords)
    assert written.deliveries == [1, 3, 1, 3]
    assert (written.created_by, written.updated_by) == (1, 3)
    assert counted(result) == {"objects_written": 1, "incomparable": 2}
    [(message, fields)] = result.warnings
    assert message == INCOMPARABLE_WARN and fields["incomparable"] == 2
    fresh = merge(None, [minute_point(1, qty=1.0)], 2, dropped=1)
    assert counted(fresh) == {"objects_written": 1, "incomparable": 1}
    assert [m for m, _ in fresh.warnings] == [INCOMPARABLE_WARN]


# =============================================================================================
# STORAGE-8.11: the real exports through a real `serve`, then `verify`.
# =============================================================================================

def test_storage_8_11_real_serve_then_verify_is_equal(serve_process, data_dir):
    day = hf.DEFAULT_DAY
    ten, one, two = (dt.datetime.combine(day, dt.time(h)) for h in (10, 13, 14))
    proc = serve_process(data_dir)
    client = proc.client
    sent = [
        (body_of(hf.metric("sleep_analysis", sleep_pairs_month(), "hr")),
         automation("Sleep records", "Days", "Previous 7 Days")),
        (body_of(energy(5, ten, one, "kcal")), automation("Energy", "Minutes")),
        (body_of(energy(5, ten, two, "kJ")), automation("Energy", "Minutes")),
    ]
    ids = []
    for payload, headers in sent:
        status, answer = client.ingest(payload, headers=headers)
        assert status == 200, answer
        ids.append(answer["delivery_id"])
        # one at a time: the kJ delivery must come after the kcal one in the journal
        wait_for(lambda: db_rows(data_dir, "SELECT count(*) AS n FROM delivery WHERE"
                                           " parse_status = 'pending'")[0]["n"] == 0, 30)

    assert proc.terminate() == 0
    rows = {r["id"]: r for r in db_rows(data_dir)}
    assert [rows[i]["parse_status"] for i in ids] == ["parsed"] * 3
    assert (rows[ids[0]]["layer"], rows[ids[0]]["incomparable"]) == ("record", 0)
    assert rows[ids[2]]["unit_conflicts"] == 3
    verified = run_cli("verify", "--data", data_dir)
    assert verified.returncode == 0, verified.stdout + verified.stderr
    assert "verify: equal" in verified.stdout
