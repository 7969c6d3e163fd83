"""What a metric means, and the metrics that are lists: the meaning table in the catalog
(READ-13), /api/records for workouts, ECG recordings and events and /api/ecg for a trace
(READ-14), end to end.

One store (`store`), built once: HAE-shaped bodies made by tests/hae_factory.py (workouts of
export versions 2 and 1, ECG recordings of 30 s at 512 Hz with epoch-dated voltages in µV,
state of mind, symptoms, medications, cycle tracking, heart-rate notifications, Days exports
of steps, heart rate, weight and nutrients, sleep summaries, and a metric no table knows) are
posted over HTTP to a real ``healthlog.py serve`` subprocess on 127.0.0.1:0 and folded by its
worker into a real SQLite file. The phone was in Berlin, then in New York.

Every expectation is computed here from the bodies posted (times read with ``datetime`` from
the text the phone wrote, tests/read_helpers.py), never from healthlog's code.
"""

from __future__ import annotations

import datetime as dt
import json
import random
import subprocess
import sys
from typing import NamedTuple

import pytest

import hae_factory as hf
from conftest import Client, Lazy, db_rows, wait_for
from read_helpers import (Store, assert_error, get, get_json, instant_us, iso_local, raw_end,
                          raw_start, read_csv, serve_corpus, utc_iso, written)

SEED = 14
BERLIN = hf.Phone(zone=hf.BERLIN, sources="single")
NEW_YORK = hf.Phone(zone=hf.NEW_YORK, sources="single")
NUTRIENTS = {"dietary_energy": "kcal", "dietary_sugar": "g", "protein": "g",
             "carbohydrates": "g", "total_fat": "g", "fiber": "g", "vitamin_c": "mg"}
UNKNOWN = "apple_sleep_score"  # a name a later HAE might send, in no table
#: Strings of the bodies that no log record above DEBUG may carry (beside conftest's).
EXTRA_CANARIES = ("Ibuprofen", "Cetirizine", "Headache", "Sinus Rhythm")

JOURNAL = hf.Automation("Journal", "Default", "Since Last Sync")
WORKOUTS = hf.Automation("Workouts", "Default", "Since Last Sync")
DAYS = hf.Automation("Daily totals", "Days", "Previous 7 Days")


class Corpus(NamedTuple):
    deliveries: list  # (headers, body bytes)
    records: dict  # metric -> [point as sent]


def build_corpus() -> Corpus:
    rng = random.Random(SEED)
    corpus = Corpus([], {})

    def post(automation: hf.Automation, body: dict) -> dict:
        sent = hf.dumps_hae(body, rng)
        corpus.deliveries.append((hf.headers_for(automation, hf.new_uuid(rng)), sent))
        parsed = json.loads(sent)["data"]
        names = {"workouts": lambda p: "workouts", "ecg": lambda p: "ecg",
                 "stateOfMind": lambda p: "state_of_mind",
                 "heartRateNotifications": lambda p: "heart_rate_notifications",
                 "symptoms": lambda p: "symptoms/" + p["name"],
                 "cycleTracking": lambda p: "cycle_tracking/" + p["name"],
                 "medications": lambda p: "medications/" + p["displayText"]}
        for section, name_of in names.items():
            for point in parsed.get(section, []):
                corpus.records.setdefault(name_of(point), []).append(point)
        return parsed

    # Workouts: version 2 in Berlin, then version 1 (HAE 8.1.2) and 2 in New York.
    post(WORKOUTS, hf.envelope(workouts=[
        hf.workout_v2(SEED, dt.datetime(2025, 5, 3, 7, 10), name="Running", minutes=31.5,
                      phone=BERLIN, route_points=5, rng=rng),
        hf.workout_v2(SEED, dt.datetime(2025, 5, 4, 23, 40), name="Yoga", minutes=45,
                      phone=BERLIN, route_points=0, rng=rng)]))
    post(WORKOUTS, hf.envelope(workouts=[
        hf.workout_v1(SEED, dt.datetime(2025, 5, 10, 18, 2), name="Outdoor Walk", minutes=12,
                      phone=NEW_YORK, route_points=4, rng=rng),
        hf.workout_v1(SEED, dt.datetime(2025, 5, 11, 6, 45), name="Running", minutes=42,
                      phone=NEW_YORK, route_points=4, rng=rng)]))
    post(WORKOUTS, hf.envelope(workouts=[
        hf.workout_v2(SEED, dt.datetime(2025, 5, 12, 21, 30), name="Outdoor Cycling",
                      minutes=55, phone=NEW_YORK, route_points=6, rng=rng)]))
    # ECG: three recordings of 30 s at 512 Hz.
    post(JOURNAL, hf.envelope(ecg=[
        hf.ecg_reading(rng, dt.datetime(2025, 5, 4, 9, 12), phone=BERLIN, samples=15360,
                       hz=512)]))
    post(JOURNAL, hf.envelope(ecg=[
        hf.ecg_reading(rng, dt.datetime(2025, 5, 11, 8, 30), phone=NEW_YORK, samples=15360,
                       hz=512),
        hf.ecg_reading(rng, dt.datetime(2025, 5, 12, 22, 5), phone=NEW_YORK, samples=15360,
                       hz=512)]))
    # Events: a daily mood and an emotion logged in the same moment, more moods, symptoms,
    # medications (one without end and scheduledDate), cycle tracking, a notification.
    moment = dt.datetime(2025, 5, 10, 21, 5, tzinfo=dt.timezone.utc)
    moods = [hf.state_of_mind(rng, moment, kind="daily_mood"),
             hf.state_of_mind(rng, moment, kind="momentary_emotion")]
    moods += [hf.state_of_mind(rng, moment + dt.timedelta(days=d, hours=h), kind=kind)
              for d, h, kind in ((-7, 0, "daily_mood"), (-6, 3, "momentary_emotion"),
                                 (1, -9, "momentary_emotion"), (2, 0, "daily_mood"))]
    doses = hf.medications(rng, dt.datetime(2025, 5, 11, 8, 0), phone=NEW_YORK)
    doses += hf.medications(rng, dt.datetime(2025, 5, 3, 8, 15), phone=BERLIN)
    for key in ("end", "scheduledDate"):
        doses[-1].pop(key, None)
    post(JOURNAL, hf.envelope(
        stateOfMind=moods,
        symptoms=hf.symptoms(rng, dt.datetime(2025, 5, 4, 16, 20), phone=BERLIN)
        + hf.symptoms(rng, dt.datetime(2025, 5, 12, 11, 0), phone=NEW_YORK, count=1),
        medications=doses,
        cycleTracking=hf.cycle_tracking(rng, dt.date(2025, 5, 3), phone=BERLIN, cycle_day=0)
        + hf.cycle_tracking(rng, dt.date(2025, 5, 11), phone=NEW_YORK, cycle_day=8),
        heartRateNotifications=[hf.heart_rate_notification(rng, dt.datetime(2025, 5, 11, 3, 20),
                                                           phone=NEW_YORK)]))
    # Series for the meaning table: Days exports of steps, heart rate, weight, nutrients,
    # nightly sleep summaries and a metric no table knows.
    days = hf.days_export(SEED, dt.date(2025, 5, 3), dt.date(2025, 5, 6), phone=BERLIN,
                          names=("step_count", "heart_rate", "weight_body_mass"), rng=rng)
    nutrition = [hf.metric(name, [{"date": BERLIN.time(hf.local_midnight(
        hf.BERLIN, dt.date(2025, 5, 3 + k))), "qty": 10.5 * (i + 1) + k}
        for k in range(3)], units) for i, (name, units) in enumerate(NUTRIENTS.items())]
    days["data"]["metrics"] += nutrition + [hf.metric(UNKNOWN, [
        {"date": BERLIN.time(hf.local_midnight(hf.BERLIN, dt.date(2025, 5, 3))), "qty": 81}],
        "count")]
    post(DAYS, days)
    post(DAYS, hf.envelope(metrics=[hf.metric("sleep_analysis", hf.sleep_summaries(
        SEED, dt.date(2025, 5, 3), dt.date(2025, 5, 6), phone=BERLIN, form="c", rng=rng))]))
    return corpus


CORPUS = Lazy(build_corpus)


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> Store:
    """The corpus posted to a serve subprocess and folded by its worker; the server keeps
    running for the module (export runs beside it)."""
    yield from serve_corpus(tmp_path_factory.mktemp("read-records"), CORPUS, CORPUS.deliveries,
                            EXTRA_CANARIES)


def page_through(store: Store, metric: str, limit: int, **query) -> list:
    """Every item of /api/records, following ``next_before`` from page to page."""
    items, before = [], None
    for _ in range(1000):
        page = get_json(store.address, "/api/records", metric=metric, limit=limit,
                        before=before, **query)
        assert page["metric"] == metric and len(page["items"]) <= limit
        items += page["items"]
        if page["next_before"] is None:
            return items
        assert len(page["items"]) == limit, page  # a full page has a next one
        before = page["next_before"]  # passed on as the reply gave it
    raise AssertionError("paging did not end")


def placed(point: dict) -> dict:
    """UTC start and end, local start and date of a record as the phone wrote them."""
    start = written(raw_start(point))
    return {"start": utc_iso(instant_us(raw_start(point))),
            "end": utc_iso(instant_us(raw_end(point))),
            "local_start": iso_local(start), "date": start.date().isoformat()}


def newest_first(points: list) -> list:
    """In coordinate order (start, end, category: the storage spec's), reversed."""
    def category(point: dict) -> str:
        for key in ("value", "kind"):
            if isinstance(point.get(key), str):
                return point[key]
        return ""

    return sorted(points, key=lambda p: (instant_us(raw_start(p)), instant_us(raw_end(p)),
                                         category(p)), reverse=True)


# ---------------------------------------------------------------------------------------------
# READ-13: the meaning table

#: The groups of the meaning table in the order the metric list shows them (READ-13).
GROUPS = [("activity", "Activity"), ("body", "Body"), ("heart", "Heart"),
          ("mindfulness", "Mindfulness"), ("nutrition", "Nutrition"), ("sleep", "Sleep"),
          ("workouts", "Workouts"), ("other", "Other")]


def test_read_13_1_nutrients_are_totals_in_nutrition_rates_are_averages(store):
    reply = get_json(store.address, "/api/catalog")
    catalog = reply["metrics"]
    assert [(g["group"], g["title"]) for g in reply["groups"]] == GROUPS
    assert {e["group"] for e in catalog} <= {group for group, _ in GROUPS}
    meanings = {e["metric"]: e["meaning"] for e in catalog}
    for entry in catalog:
        meaning = entry["meaning"]
        assert set(meaning) == {"name", "group", "kind", "drawn", "fields", "combine",
                                "better", "digits", "bounds", "stages", "labels"}
        assert meaning["drawn"] == {"total": "series", "average": "series",
                                    "sleep": "nights"}.get(meaning["kind"], "list")
        assert set(meaning["labels"]) == set(meaning["fields"])  # how each field is read
        assert meaning["group"] == entry["group"] and meaning["name"].strip()
        assert meaning["combine"] == {"total": "sum", "average": "avg"}.get(meaning["kind"])
        assert meaning["better"] in ("up", "down", None)
        assert meaning["fields"] and all(isinstance(f, str) for f in meaning["fields"])
        assert meanings[entry["metric"]] == meaning  # one meaning per metric, every layer

    def kind(metric: str) -> tuple:
        m = meanings[metric]
        return m["kind"], m["combine"], m["group"]

    assert kind("step_count") == ("total", "sum", "activity")
    for nutrient in NUTRIENTS:
        assert kind(nutrient) == ("total", "sum", "nutrition"), nutrient
    assert kind("heart_rate") == ("average", "avg", "heart")
    assert meanings["heart_rate"]["fields"][0] == "Avg"
    assert sorted(meanings["heart_rate"]["fields"]) == ["Avg", "Max", "Min"]
    assert meanings["heart_rate"]["bounds"] == ["Min", "Max"]  # a day of it has a range
    # the stages of sleep in the order they are listed and drawn: deepest first, awake last
    assert [s["stage"] for s in meanings["sleep_analysis"]["stages"]] == [
        "deep", "core", "rem", "asleep", "awake"]
    assert [s["stage"] for s in meanings["sleep_analysis"]["stages"] if not s["asleep"]] == [
        "awake"]
    assert meanings["sleep_analysis"]["labels"]["in_bed"] == "in bed"
    assert all(m["stages"] == [] for k, m in meanings.items() if k != "sleep_analysis")
    assert kind("weight_body_mass") == ("average", "avg", "body")
    assert (kind("sleep_analysis"), kind("workouts"), kind("ecg")) == (
        ("sleep", None, "sleep"), ("workouts", None, "workouts"), ("ecg", None, "heart"))
    events = [m for m in meanings if m == "state_of_mind" or m.startswith(
        ("symptoms/", "medications/", "cycle_tracking/")) or m == "heart_rate_notifications"]
    assert len(events) == len(CORPUS.records) - 2  # all but workouts and ecg
    for metric in events:
        assert meanings[metric]["kind"] == "events" and meanings[metric]["combine"] is None
    assert meanings["state_of_mind"]["group"] == "mindfulness"
    assert kind(UNKNOWN) == ("average", "avg", "other")
    assert {meanings[m]["fields"][0] for m in ("step_count", "weight_body_mass", UNKNOWN)
            } == {"qty"}
    # a name made of what the user entered is not in the display name's place of a log; the
    # catalog shows it to the signed-in user as the metric it is
    assert any(m.startswith("medications/Ibuprofen") for m in meanings)


#: READ-13.2: how a person reads the units HAE sends, by this test's own table: a count is
#: what the metric counts (nothing where its name says it), rates per minute are bpm unless
#: they count something else, HealthKit's spellings become the usual ones, the rest as sent.
SHOWN = {
    ("step_count", "count"): "steps", ("flights_climbed", "count"): "floors",
    ("body_mass_index", "count"): "", ("apple_stand_hour", "count"): "",
    ("number_of_times_fallen", "count"): "", ("swim_stroke_count", "count"): "",
    (UNKNOWN, "count"): "", ("heart_rate", "count/min"): "bpm",
    ("resting_heart_rate", "count/min"): "bpm", ("respiratory_rate", "count/min"): "breaths/min",
    ("dietary_water", "fl_oz_us"): "fl oz", ("dietary_water", "mL"): "mL",
    ("body_temperature", "degC"): "°C", ("basal_body_temperature", "degF"): "°F",
    ("ecg", "mcV"): "µV", ("blood_glucose", "mmol<180.1558800000541>/L"): "mmol/L",
    ("blood_glucose", "mg/dL"): "mg/dL", ("environmental_audio_exposure", "dBASPL"): "dB",
    **{(metric, units): units for metric, units in (
        ("active_energy", "kcal"), ("active_energy", "kJ"), ("weight_body_mass", "lb"),
        ("weight_body_mass", "kg"), ("walking_running_distance", "mi"),
        ("walking_running_distance", "km"), ("blood_pressure", "mmHg"),
        ("body_fat_percentage", "%"), ("heart_rate_variability", "ms"))},
}
WORKOUT_UNITS = {"kcal": "kcal", "kJ": "kJ", "mi": "mi", "km": "km", "count/min": "bpm",
                 "bpm": "bpm"}
#: The decimals always shown where a person's changes are smaller than one unit.
DIGITS = {"weight_body_mass": 1, "body_mass_index": 1, "body_fat_percentage": 1,
          "body_temperature": 1, "lean_body_mass": 1, "step_count": None, "heart_rate": None,
          "protein": None}


def test_read_13_2_units_and_decimals_as_people_read_them_come_from_the_server(store):
    """One rule on the server writes the units everywhere (cards, the metric view, lists):
    its answers for every kind of unit, and the replies that carry them."""
    import healthlog
    for (metric, units), shown in SHOWN.items():
        assert healthlog.unit_label(metric, units) == shown, (metric, units)
    assert healthlog.unit_label("step_count", None) is None
    for metric, digits in DIGITS.items():
        assert healthlog.meaning_of(metric).as_json()["digits"] == digits, metric
    meanings = {e["metric"]: e["meaning"] for e in get_json(store.address,
                                                             "/api/catalog")["metrics"]}
    assert meanings["weight_body_mass"]["digits"] == 1 and meanings["step_count"]["digits"] is None
    # the replies the page draws carry the units as shown beside the units stored
    for metric, label in (("step_count", "steps"), ("heart_rate", "bpm")):
        runs = get_json(store.address, "/api/points", metric=metric, bucket="day")["runs"]
        assert runs and {(r["units"], r["unit_label"]) for r in runs} == {
            (units, label) for (m, units), shown in SHOWN.items() if m == metric
            and shown == label}, metric
    for item in get_json(store.address, "/api/records", metric="workouts")["items"]:
        for key in ("energy", "distance", "average_heart_rate", "max_heart_rate"):
            if item[key] is not None:
                assert item[key]["unit_label"] == WORKOUT_UNITS[item[key]["units"]], item[key]
    start = get_json(store.address, "/api/records", metric="ecg")["items"][0]["start"]
    trace = get_json(store.address, "/api/ecg", start=start)
    assert (trace["units"], trace["unit_label"]) == ("mcV", "µV")


# ---------------------------------------------------------------------------------------------
# READ-14: lists of records

def expected_workout(point: dict) -> dict:
    """A workout as the list must give it, read from its body: version 2's ``duration``, else
    end - start; the energy and distance amounts in the units sent; the heart rate."""
    version = 2 if "id" in point or "duration" in point else 1
    span = (instant_us(point["end"]) - instant_us(point["start"])) / 1e6
    summary = point.get("heartRate") or {}

    def amount(value):
        return None if value is None else {"qty": value["qty"], "units": value["units"],
                                           "unit_label": WORKOUT_UNITS[value["units"]]}

    return dict(placed(point), name=point["name"],
                duration_s=point["duration"] if version == 2 else span,
                energy=amount(point.get("activeEnergyBurned") or point.get("activeEnergy")),
                distance=amount(point.get("distance")),
                average_heart_rate=amount(summary.get("avg") or point.get("avgHeartRate")),
                max_heart_rate=amount(summary.get("max") or point.get("maxHeartRate")),
                location=point.get("location"), version=version)


@pytest.mark.parametrize("limit", [2, 50])
def test_read_14_1_workouts_of_both_versions(store, limit):
    workouts = CORPUS.records["workouts"]
    assert {("id" in w, "duration" in w) for w in workouts} == {(True, True), (False, False)}
    items = page_through(store, "workouts", limit)
    want = [expected_workout(w) for w in newest_first(workouts)]
    assert [i["start"] for i in items] == [w["start"] for w in want]  # once each, newest first
    for item, expected in zip(items, want):
        assert {k: item.get(k) for k in expected} == expected
    walk = next(i for i in items if i["name"] == "Outdoor Walk")
    assert (walk["version"], walk["duration_s"]) == (1, 720)  # 12 minutes of HAE 8.1.2
    assert walk["energy"]["units"] == "kcal" and walk["distance"]["units"] == "mi"
    assert walk["local_start"] == "2025-05-10T18:02:00-04:00" and walk["date"] == "2025-05-10"
    run = next(i for i in items if i["name"] == "Running" and i["version"] == 2)
    assert run["energy"]["units"] == "kJ" and run["distance"]["units"] == "km"
    assert run["local_start"].startswith("2025-05-03T07:10:00+02:00")
    yoga = next(i for i in items if i["name"] == "Yoga")
    assert yoga["date"] == "2025-05-04" and yoga["start"].startswith("2025-05-04T21:40")
    reply = get_json(store.address, "/api/records", metric="workouts")
    assert (reply["kind"], reply["tz"], reply["next_before"]) == ("workouts", "local", None)
    # in another zone, the local start and date are that zone's
    tokyo = get_json(store.address, "/api/records", metric="workouts", tz="Asia/Tokyo")
    late = next(i for i in tokyo["items"] if i["name"] == "Outdoor Cycling")
    assert (late["local_start"][:16], late["date"]) == ("2025-05-13T10:30", "2025-05-13")
    ranged = get_json(store.address, "/api/records", metric="workouts", from_="2025-05-10",
                      to="2025-05-11")  # both days included
    assert [i["name"] for i in ranged["items"]] == ["Running", "Outdoor Walk"]


def test_read_14_2_an_ecg_recording_and_its_trace(store):
    recordings = newest_first(CORPUS.records["ecg"])
    listed = get_json(store.address, "/api/records", metric="ecg")
    assert listed["kind"] == "ecg"
    assert [i["start"] for i in listed["items"]] == [placed(r)["start"] for r in recordings]
    for item, recording in zip(listed["items"], recordings):
        assert {k: item[k] for k in ("start", "end", "local_start", "date")} == placed(recording)
        assert (item["classification"], item["average_heart_rate"], item["sampling_frequency"],
                item["samples"]) == (recording["classification"],
                                     recording["averageHeartRate"], 512, 15360)
        assert "voltageMeasurements" not in json.dumps(item)
    for item, recording in zip(listed["items"], recordings):
        trace = get_json(store.address, "/api/ecg", start=item["start"])
        measured = sorted(recording["voltageMeasurements"], key=lambda v: v["date"])
        assert trace["voltages"] == [v["voltage"] for v in measured]
        assert len(trace["voltages"]) == recording["numberOfVoltageMeasurements"] == 15360
        assert (trace["units"], trace["sampling_frequency"], trace["start"],
                trace["local_start"]) == ("mcV", 512, item["start"], item["local_start"])
    again = get_json(store.address, "/api/ecg",
                     start=recordings[0]["start"])  # HAE's own spelling of the start
    assert again["start"] == listed["items"][0]["start"]
    late = utc_iso(instant_us(recordings[0]["start"]) + 1_000_000)
    assert_error(get(store.address, "/api/ecg", start=late), 404, "not_found")
    assert_error(get(store.address, "/api/ecg"), 400, "bad_request")


@pytest.mark.parametrize("limit", [2, 50])  # pages that do not split the pair below
def test_read_14_3_events_of_every_kind_as_lists(store, limit):
    meanings = {e["metric"]: e["meaning"] for e in get_json(store.address,
                                                             "/api/catalog")["metrics"]}
    events = {m: points for m, points in CORPUS.records.items()
              if m not in ("workouts", "ecg")}
    assert {m.split("/")[0] for m in events} == {
        "state_of_mind", "symptoms", "medications", "cycle_tracking",
        "heart_rate_notifications"}
    for metric, points in events.items():
        fields = meanings[metric]["fields"]
        items = page_through(store, metric, limit)
        want = newest_first(points)
        assert len(items) == len(want), (metric, limit)
        for item, point in zip(items, want):
            assert {k: item[k] for k in ("start", "end", "local_start", "date")} == placed(
                point), metric
            assert item["details"] == {f: point[f] for f in fields if f in point}, metric
            assert item["details"], (metric, "no field of its meaning came")
    mood = get_json(store.address, "/api/records", metric="state_of_mind")["items"]
    assert {"valenceClassification", "kind", "labels"} <= set(mood[0]["details"])
    assert mood[0]["local_start"].endswith("+00:00")  # written in UTC (ISO with Z)
    symptom = next(m for m in events if m.startswith("symptoms/"))
    item = get_json(store.address, "/api/records", metric=symptom)["items"][0]
    assert "severity" in item["details"]
    notification = get_json(store.address, "/api/records",
                            metric="heart_rate_notifications")["items"][0]
    assert notification["details"] == {"heartNotification": "low_heart_rate_notification",
                                       "threshold": 45}
    assert notification["local_start"].startswith("2025-05-11T03:20:00-04:00")
    for series in ("step_count", "heart_rate", "sleep_analysis", UNKNOWN, "protein"):
        assert_error(get(store.address, "/api/records", metric=series), 400, "bad_request")
    assert_error(get(store.address, "/api/records", metric="no_such_metric"), 404,
                 "unknown_metric")
    for query in ({"limit": "0"}, {"limit": "501"}, {"before": "yesterday"}, {"tz": "Mars/X"}):
        assert_error(get(store.address, "/api/records", metric="state_of_mind", **query), 400,
                     "bad_request")


def test_read_14_3_a_mood_and_an_emotion_of_one_moment_both_come_through_the_pages(store):
    """A daily mood and a momentary emotion logged in the same moment share their start
    (their kinds tell them apart): paging by ``next_before`` must give each once."""
    moods = CORPUS.records["state_of_mind"]
    starts = [m["start"] for m in moods]
    assert len(starts) - len(set(starts)) == 1
    want = [placed(m)["start"] for m in newest_first(moods)]
    for limit in (1, 2, 3, 4):
        items = page_through(store, "state_of_mind", limit)
        assert [i["start"] for i in items] == want, limit


# ---------------------------------------------------------------------------------------------
# READ-4.5: ECG as CSV, one row per sample

ECG_COLUMNS = ["recording_start", "recording_local_start", "recording_local_date", "sample",
               "offset_s", "voltage", "units"]
SPREADSHEET_CELL_MAX = 32767  # characters a spreadsheet keeps in one cell


def export_csv(data_dir, *args) -> bytes:
    result = subprocess.run([sys.executable, "-m", "healthlog", "export", "--data",
                             str(data_dir), "--metric", "ecg", "--format", "csv", *args],
                            capture_output=True, timeout=120)
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_read_4_5_ecg_csv_is_one_row_per_sample_of_each_recording(store):
    recordings = sorted(CORPUS.records["ecg"], key=lambda r: instant_us(r["start"]))
    reply = get(store.address, "/api/points", metric="ecg", format="csv")
    rows = read_csv(reply)
    assert rows[0] == ECG_COLUMNS
    assert max(len(cell) for row in rows for cell in row) < 40  # was ~700,000 in one cell
    assert SPREADSHEET_CELL_MAX > 40
    assert len(rows) - 1 == sum(len(r["voltageMeasurements"]) for r in recordings) == 3 * 15360
    at = 1
    for recording in recordings:
        where = placed(recording)
        start_s = written(recording["start"]).timestamp()
        measured = sorted(recording["voltageMeasurements"], key=lambda v: v["date"])
        mine = rows[at:at + len(measured)]
        at += len(measured)
        assert {tuple(row[:3]) for row in mine} == {
            (where["start"], where["local_start"], where["date"])}
        assert [int(row[3]) for row in mine] == list(range(len(measured)))
        assert [float(row[5]) for row in mine] == [v["voltage"] for v in measured]
        assert {row[6] for row in mine} == {"mcV"}
        for row, sample in zip(mine, measured):  # seconds from the start, by the sample's date
            assert abs(float(row[4]) - (sample["date"] - start_s)) < 2e-6, (row, sample)
        assert float(mine[0][4]) == 0.0  # the first sample is taken at the start
        frequency = recording["samplingFrequency"]
        assert abs(float(mine[-1][4]) - (len(measured) - 1) / frequency) < 2e-6
    assert at == len(rows)
    # the command line prints the same bytes, and a range and a zone select and place them
    assert export_csv(store.data_dir) == reply.body
    later = get(store.address, "/api/points", metric="ecg", format="csv", tz="Asia/Tokyo",
                from_="2025-05-11")
    assert export_csv(store.data_dir, "--tz=Asia/Tokyo", "--from", "2025-05-11") == later.body
    tokyo = read_csv(later)[1:]
    wanted = [r for r in recordings if r["start"][:10] >= "2025-05-11"]
    assert len(tokyo) == sum(len(r["voltageMeasurements"]) for r in wanted) == 2 * 15360
    firsts = [row[1] for row in tokyo if row[3] == "0"]
    assert firsts == [written(r["start"]).astimezone(dt.timezone(dt.timedelta(hours=9)))
                      .isoformat() for r in wanted]


def test_read_4_5_ecg_samples_without_a_date_are_placed_by_the_sampling_frequency(
        start_service, data_dir):
    """A recording whose samples carry no ``date`` (and one without samples): the offset is
    the index over ``samplingFrequency``; the empty recording is one row."""
    service = start_service()
    client = Client(*service.address)
    rng = random.Random(SEED)
    dated = hf.ecg_reading(rng, dt.datetime(2025, 6, 1, 7, 0), phone=NEW_YORK, samples=64,
                           hz=512.5)
    undated = hf.ecg_reading(rng, dt.datetime(2025, 6, 1, 8, 0), phone=NEW_YORK, samples=40,
                             hz=512.5)
    for sample in undated["voltageMeasurements"]:
        del sample["date"]
    empty = hf.ecg_reading(rng, dt.datetime(2025, 6, 1, 9, 0), phone=NEW_YORK, samples=0,
                           hz=512.5)
    sent = hf.dumps_hae(hf.envelope(ecg=[dated, undated, empty]), rng)
    dated, undated, empty = json.loads(sent)["data"]["ecg"]  # as the server reads them
    status, _ = client.ingest(sent, headers=hf.headers_for(JOURNAL))
    assert status == 200
    wait_for(lambda: db_rows(data_dir)[0]["parse_status"] == "parsed", what="the fold")
    rows = read_csv(get(service.address, "/api/points", metric="ecg", format="csv"))
    assert rows[0] == ECG_COLUMNS
    by_start = {}
    for row in rows[1:]:
        by_start.setdefault(row[0], []).append(row)
    assert list(by_start) == [placed(r)["start"] for r in (dated, undated, empty)]
    mine = by_start[placed(undated)["start"]]
    assert [int(row[3]) for row in mine] == list(range(40))
    assert [float(row[4]) for row in mine] == [k / 512.5 for k in range(40)]
    assert [float(row[5]) for row in mine] == [v["voltage"] for v in
                                               undated["voltageMeasurements"]]
    start_s = written(dated["start"]).timestamp()
    offsets = [float(row[4]) for row in by_start[placed(dated)["start"]]]
    assert len(offsets) == 64 and all(abs(got - (v["date"] - start_s)) < 2e-6 for got, v in
                                      zip(offsets, dated["voltageMeasurements"]))
    assert by_start[placed(empty)["start"]] == [
        [placed(empty)["start"], placed(empty)["local_start"], placed(empty)["date"],
         "", "", "", ""]]
