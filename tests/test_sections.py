"""HAE sections to points and layers (healthlog.py section "HAE sections to points";
openspec/specs/storage/spec.md; seeds STO-1, STO-6.3, STO-7).

Bodies come from tests/hae_factory.py, serialised as the app does and parsed with
``json.loads``, so the extraction sees what a real delivery holds.
"""

from __future__ import annotations

import datetime as dt
import json
import random
from collections import Counter

import pytest

import hae_factory as hf
import healthlog
from healthlog import ContentNotParsed, extract_points, header_layer, infer_layer, point_span

T = healthlog.parse_time
DATE = "2024-03-08 10:00:00 -0800"
LATER = "2024-03-08 10:30:00 -0800"
TWO_WEEKS = (hf.DEFAULT_DAY, hf.DEFAULT_DAY + dt.timedelta(days=14))


def as_delivered(payload: dict, seed: int = None) -> dict:
    """The payload as a delivery carries it: HAE's bytes (a re-send with ``seed``), parsed."""
    rng = random.Random(seed) if seed is not None else None
    return json.loads(hf.dumps_hae(payload, rng))


def points_of(bucket: healthlog.MetricPoints) -> list:
    """Every (coordinate, point) of a metric, candidates at one coordinate included."""
    out = []
    for coord, slot in bucket.coords.items():
        for point in (slot if isinstance(slot, list) else [slot]):
            out.append((coord, point))
    return out


def span_of(item: dict) -> tuple:
    """Independent of point_coordinate: the rule written out for well-formed items,
    (start, end, category) with the category the item's ``value`` when it is text."""
    start = item.get("start", item.get("startDate", item.get("date")))
    end = item.get("end", item.get("endDate", start))
    category = item.get("value")
    if not isinstance(category, str):
        category = item.get("kind")
    return T(start), T(end), category if isinstance(category, str) else ""


# ---------------------------------------------------------------------------
# Which section becomes which metric
# ---------------------------------------------------------------------------


def test_the_covered_sections_are_those_of_the_design_table():
    assert set(healthlog.SECTIONS) == {"metrics", "workouts", "stateOfMind", "ecg",
                                       "heartRateNotifications", "symptoms", "cycleTracking",
                                       "medications"}


def test_metrics_become_metrics_by_name_with_their_units_and_verbatim_points():
    doc = as_delivered(hf.metrics_payload(3, hf.DEFAULT_METRICS, hf.DEFAULT_DAY,
                                  units={"active_energy": "kcal"}), seed=4)
    extraction = extract_points(doc)
    sent = {m["name"]: m for m in doc["data"]["metrics"]}
    assert extraction.bad_points == 0 and extraction.uncovered == []
    assert extraction.points == sum(len(m["data"]) for m in sent.values())
    with_points = {name for name, m in sent.items() if m["data"]}
    assert {key for key, bucket in extraction.metrics.items() if bucket.coords} == {
        (True, name) for name in with_points}
    assert extraction.metrics[(True, "active_energy")].units == "kcal"
    assert extraction.metrics[(True, "heart_rate")].units == "count/min"
    for name in with_points:
        bucket = extraction.metrics[(True, name)]
        assert bucket.is_metric and bucket.name == name
        placed = points_of(bucket)
        assert len(placed) == len(sent[name]["data"])
        for span, point in placed:
            assert any(point is p for p in sent[name]["data"])  # the parsed object itself
            assert span == (T(point["date"]), T(point["date"]), "")
    assert extraction.has_metric_points


def test_workouts_v1_and_v2_are_one_verbatim_point_each():
    v2 = hf.workout_v2(1, dt.datetime(2024, 3, 8, 17, 30), route_points=20)
    v1 = hf.workout_v1(1, dt.datetime(2024, 3, 9, 7, 0), route_points=5)
    doc = as_delivered(hf.envelope(workouts=[v2, v1]))
    extraction = extract_points(doc)
    bucket = extraction.metrics[(False, "workouts")]
    assert not bucket.is_metric
    assert list(extraction.metrics) == [(False, "workouts")]
    assert extraction.points == 2 and extraction.bad_points == 0
    placed = dict(points_of(bucket))
    for sent in doc["data"]["workouts"]:
        coord = (T(sent["start"]), T(sent["end"]), "")
        assert coord[1] > coord[0]
        assert placed[coord] is sent
    assert len(placed[span_of(doc["data"]["workouts"][0])]["route"]) == 20
    assert not extraction.has_metric_points


def test_record_sections_map_to_their_metric_names():
    sections = hf.records_sections(0, *TWO_WEEKS, ecg_samples=4)
    assert all(sections[name] for name in hf.RECORD_SECTIONS)  # every kind is exercised
    doc = as_delivered(hf.envelope(**sections), seed=1)
    extraction = extract_points(doc)
    names = {
        "stateOfMind": lambda item: "state_of_mind",
        "ecg": lambda item: "ecg",
        "heartRateNotifications": lambda item: "heart_rate_notifications",
        "symptoms": lambda item: "symptoms/" + item["name"],
        "cycleTracking": lambda item: "cycle_tracking/" + item["name"],
        "medications": lambda item: "medications/" + item["displayText"],
    }
    expected = Counter()
    for section, items in doc["data"].items():
        for item in items:
            expected[(names[section](item), span_of(item))] += 1
    found = Counter()
    for (is_metric, name), bucket in extraction.metrics.items():
        assert not is_metric
        for span, _ in points_of(bucket):
            found[(name, span)] += 1
    assert found == expected
    assert extraction.points == sum(expected.values()) and extraction.bad_points == 0
    assert extraction.uncovered == []
    assert any(name.startswith("medications/Ibuprofen") for _, name in extraction.metrics)


def test_state_of_mind_iso_times_and_ecg_epoch_samples_are_kept_verbatim():
    rng = random.Random(2)
    mood = hf.state_of_mind(rng, dt.datetime(2024, 3, 8, 21, 0, tzinfo=dt.timezone.utc))
    ecg = hf.ecg_reading(rng, dt.datetime(2024, 3, 8, 12, 0), samples=3)
    doc = as_delivered(hf.envelope(stateOfMind=[mood], ecg=[ecg]))
    extraction = extract_points(doc)
    (span, point), = points_of(extraction.metrics[(False, "state_of_mind")])
    assert mood["start"].endswith("Z") and span == (T(mood["start"]), T(mood["end"]),
                                                    mood["kind"])
    assert point == mood
    (span, point), = points_of(extraction.metrics[(False, "ecg")])
    assert span == (T(ecg["start"]), T(ecg["end"]), "")
    assert point["voltageMeasurements"] == ecg["voltageMeasurements"]


def test_symptoms_logged_together_share_a_span_but_not_a_metric():
    entries = hf.symptoms(random.Random(3), dt.datetime(2024, 3, 8, 12, 0), count=3)
    assert len({(e["start"], e["end"]) for e in entries}) == 1
    extraction = extract_points(as_delivered(hf.envelope(symptoms=entries)))
    assert sorted(name for _, name in extraction.metrics) == sorted(
        "symptoms/" + e["name"] for e in entries)
    for bucket in extraction.metrics.values():
        assert len(points_of(bucket)) == 1


def test_medications_are_named_by_display_text_else_nickname():
    start = DATE
    doses = [
        {"displayText": "Ibuprofen 200 mg Oral Tablet", "nickname": "Ibu", "start": start},
        {"displayText": "  ", "nickname": "  D3 ", "start": start},
        {"nickname": "Cet", "start": start, "end": LATER},
        {"displayText": 5, "nickname": "Odd", "start": start},
    ]
    extraction = extract_points(as_delivered(hf.envelope(medications=doses)))
    assert sorted(name for _, name in extraction.metrics) == [
        "medications/Cet", "medications/D3", "medications/Ibuprofen 200 mg Oral Tablet",
        "medications/Odd"]
    (span, _), = points_of(extraction.metrics[(False, "medications/Cet")])
    assert span == (T(start), T(LATER), "")


def test_cycle_tracking_entries_of_one_day_each_become_their_own_metric():
    entries = hf.cycle_tracking(random.Random(1), hf.DST_SPRING, cycle_day=13)
    extraction = extract_points(as_delivered(hf.envelope(cycleTracking=entries)))
    assert sorted(name for _, name in extraction.metrics) == sorted(
        "cycle_tracking/" + e["name"] for e in entries)
    midnight = T(hf.hae_time(hf.DST_SPRING, hf.PACIFIC))
    for bucket, entry in zip(extraction.metrics.values(), entries):
        assert list(bucket.coords) == [(midnight, midnight, span_of(entry)[2])]


def test_a_metric_named_like_a_section_does_not_mix_with_that_section():
    workout = hf.workout_v2(1, dt.datetime(2024, 3, 8, 17, 30), route_points=0)
    doc = as_delivered({"data": {"metrics": [{"name": "workouts", "units": "count",
                                      "data": [{"date": DATE, "qty": 1}]}],
                         "workouts": [workout]}})
    extraction = extract_points(doc)
    assert set(extraction.metrics) == {(True, "workouts"), (False, "workouts")}


# ---------------------------------------------------------------------------
# Start and end (STO-1)
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("point, start, end", [
    ({"date": DATE, "qty": 1}, DATE, DATE),
    ({"startDate": DATE, "endDate": LATER}, DATE, LATER),
    ({"date": "2024-03-08 09:00:00 -0800", "start": DATE, "end": LATER}, DATE, LATER),
    ({"date": "2024-03-08 09:00:00 -0800", "startDate": DATE}, DATE, DATE),
    ({"start": DATE, "startDate": "2024-03-08 09:00:00 -0800", "endDate": LATER}, DATE, LATER),
    ({"start": DATE, "end": LATER, "endDate": "2024-03-08 11:00:00 -0800"}, DATE, LATER),
    ({"date": DATE, "end": LATER}, DATE, LATER),
    ({"date": DATE, "end": None, "endDate": LATER}, DATE, LATER),
    ({"start": "2025-12-07T13:32:10Z", "end": "2025-12-07T13:32:10Z"},
     "2025-12-07T13:32:10Z", "2025-12-07T13:32:10Z"),
    ({"date": "2023-01-31", "totalSleep": 7.1}, "2023-01-31", "2023-01-31"),
    ({"date": 1476833353.994098}, 1476833353.994098, 1476833353.994098),
])
def test_start_and_end_rules(point, start, end):
    assert point_span(point) == (T(start), T(end))


def test_sto_1_5_a_point_without_end_has_end_equal_to_start():
    doc = as_delivered(hf.metrics_payload(1, ("resting_heart_rate", "step_count"), hf.DEFAULT_DAY))
    extraction = extract_points(doc)
    spans = [span for bucket in extraction.metrics.values() for span, _ in points_of(bucket)]
    assert spans and all(start == end for start, end, _ in spans)
    assert all(not bucket.has_interval for bucket in extraction.metrics.values())


@pytest.mark.parametrize("point", [
    {"qty": 1},                                        # no time at all
    {"date": "yesterday", "qty": 1},
    {"start": "garbage", "date": DATE},                # a present start that does not parse
    {"date": DATE, "end": "garbage"},
    {"startDate": DATE, "endDate": "2026-02-30 10:00:00 +0000"},
    {"date": True},
    {"date": None},
])
def test_a_point_whose_time_cannot_be_read_has_no_span(point):
    assert point_span(point) is None


def test_sto_1_3_sleep_segments_with_one_date_stay_separate_coordinates():
    rows = hf.sleep_segments(2, hf.DEFAULT_DAY, variant="new")
    assert len({row["date"] for row in rows}) == 1 and len(rows) > 5  # one night, one date
    doc = as_delivered(hf.envelope(metrics=[hf.metric("sleep_analysis", rows)]), seed=2)
    bucket = extract_points(doc).metrics[(False, "sleep_analysis")]  # sleep is a record
    assert len(bucket.coords) == len(rows)
    assert set(bucket.coords) == {(T(r["start"]), T(r["end"]), r["value"]) for r in rows}
    assert all(not isinstance(slot, list) for slot in bucket.coords.values())
    assert bucket.has_interval


def test_sto_1_3_old_sleep_segments_use_start_date_and_end_date():
    rows = hf.sleep_segments(2, hf.DEFAULT_DAY, variant="old")
    assert "date" not in rows[0] and "start" not in rows[0]
    bucket = extract_points(as_delivered(hf.envelope(metrics=[hf.metric("sleep_analysis", rows)]))
                            ).metrics[(False, "sleep_analysis")]
    assert set(bucket.coords) == {(T(r["startDate"]), T(r["endDate"]), r["value"])
                                  for r in rows}


def test_points_sharing_a_coordinate_are_all_kept_as_candidates():
    first = {"date": DATE, "qty": 10, "source": "Watch"}
    second = {"qty": 12, "date": DATE}
    third = {"date": LATER, "qty": 1}
    doc = as_delivered(hf.envelope(metrics=[hf.metric("step_count", [first, second, third])]))
    bucket = extract_points(doc).metrics[(True, "step_count")]
    slot = bucket.coords[(T(DATE), T(DATE), "")]
    assert slot == [first, second]
    assert bucket.coords[(T(LATER), T(LATER), "")] == third


def test_a_metric_repeated_in_one_body_is_one_metric():
    doc = as_delivered({"data": {"metrics": [hf.metric("step_count", [{"date": DATE, "qty": 1}]),
                                     hf.metric("step_count", [{"date": LATER, "qty": 2}])]}})
    extraction = extract_points(doc)
    assert list(extraction.metrics) == [(True, "step_count")]
    assert len(extraction.metrics[(True, "step_count")].coords) == 2


# ---------------------------------------------------------------------------
# Bad points are counted with their metric, never dropped silently
# ---------------------------------------------------------------------------


def test_bad_metric_points_are_counted_with_the_metric_name():
    good = {"date": DATE, "qty": 3}
    bad = ["text", 5, None, [], [good], {"date": "garbage", "qty": 1}, {"qty": 1},
           {"date": DATE, "end": "nope"}, {"start": "2026-02-30 10:00:00 +0000"}]
    doc = as_delivered({"data": {"metrics": [hf.metric("step_count", [good] + bad),
                                     hf.metric("heart_rate", [{"date": LATER, "Avg": 70}])]}})
    extraction = extract_points(doc)
    assert extraction.points == 2
    assert extraction.bad_points == len(bad)
    assert extraction.bad_metrics == {"step_count"}
    assert points_of(extraction.metrics[(True, "step_count")]) == [((T(DATE), T(DATE), ""),
                                                                    good)]


def test_a_metric_without_a_name_or_data_list_counts_its_points_as_bad():
    doc = as_delivered({"data": {"metrics": [
        {"units": "count", "data": [{"date": DATE, "qty": 1}, {"date": LATER, "qty": 2}]},
        {"name": "  ", "data": [{"date": DATE, "qty": 1}]},
        {"name": "step_count", "data": {"date": DATE}},
        "not a metric",
        hf.metric("heart_rate", [{"date": DATE, "Avg": 70}]),
    ]}})
    extraction = extract_points(doc)
    assert extraction.points == 1
    assert extraction.bad_points == 2 + 1 + 1 + 1
    assert extraction.bad_metrics == {"metrics", "step_count"}


def test_bad_record_points_are_counted_with_their_metric_name():
    workout = hf.workout_v2(1, dt.datetime(2024, 3, 8, 17, 30), route_points=0)
    broken = dict(workout, start="not a time")
    symptom = {"start": DATE, "end": LATER, "name": "Headache", "severity": "Mild"}
    doc = as_delivered(hf.envelope(workouts=[workout, broken],
                           symptoms=[symptom, dict(symptom, end="2024-02-30 10:00:00 +0000")],
                           stateOfMind=[{"start": "today", "end": "today", "kind": "x"}]))
    extraction = extract_points(doc)
    assert extraction.points == 2
    assert extraction.bad_points == 3
    assert extraction.bad_metrics == {"workouts", "symptoms/Headache", "state_of_mind"}


def test_a_record_without_a_name_is_counted_not_dropped():
    doc = as_delivered(hf.envelope(symptoms=[{"start": DATE, "end": DATE, "severity": "Mild"}],
                           medications=[{"start": DATE, "status": "Taken"}],
                           cycleTracking=[{"start": DATE, "end": DATE, "name": ""}]))
    extraction = extract_points(doc)
    assert extraction.points == 0 and extraction.bad_points == 3
    assert extraction.bad_metrics  # named, so the WARN can say where


def test_a_section_that_is_not_a_list_counts_as_a_bad_point_named_by_its_key():
    extraction = extract_points({"data": {"workouts": {"name": "Running"}, "ecg": "x"}})
    assert extraction.bad_points == 2
    assert extraction.bad_metrics == {"workouts", "ecg"}
    assert extraction.points == 0


def test_non_object_elements_of_record_sections_are_counted():
    extraction = extract_points({"data": {"workouts": ["Running", 5, None],
                                          "stateOfMind": [[]]}})
    assert extraction.bad_points == 4 and extraction.points == 0
    assert extraction.bad_metrics


def test_non_object_elements_are_named_by_their_metric():
    extraction = extract_points({"data": {"workouts": ["Running"], "stateOfMind": [[]]}})
    assert extraction.bad_metrics == {"workouts", "state_of_mind"}


def test_null_or_empty_sections_hold_nothing_and_are_covered():
    extraction = extract_points(as_delivered(hf.metrics_payload(
        1, ("step_count",), hf.DEFAULT_DAY, siblings=("workouts", "symptoms"))))
    assert extraction.uncovered == [] and extraction.bad_points == 0
    assert [name for _, name in extraction.metrics] == ["step_count"]
    for data in ({}, {"workouts": None, "symptoms": []}):
        extraction = extract_points({"data": data})
        assert (extraction.points, extraction.bad_points, extraction.uncovered) == (0, 0, [])
        assert extraction.metrics == {}


# ---------------------------------------------------------------------------
# Uncovered keys: listed, sorted, bounded (STO-6.3, STO-7)
# ---------------------------------------------------------------------------


def test_unknown_keys_under_data_are_listed_sorted():
    payload = hf.metrics_payload(1, ("step_count",), hf.DEFAULT_DAY)
    payload["data"].update({"zeta": [], "Workouts": [{"start": DATE}], "alpha": {"x": 1},
                            "medication": None})
    extraction = extract_points(as_delivered(payload))
    assert extraction.uncovered == ["Workouts", "alpha", "medication", "zeta"]
    assert extraction.uncovered_dropped == 0 and extraction.uncovered_cut == 0
    assert extraction.points > 0  # covered sections are still extracted


def test_uncovered_list_is_bounded_by_count():
    keys = ["key%02d" % i for i in range(40)]
    extraction = extract_points({"data": dict.fromkeys(reversed(keys), [])})
    assert extraction.uncovered == keys[:healthlog.UNCOVERED_MAX_NAMES]
    assert healthlog.UNCOVERED_MAX_NAMES == 32
    assert extraction.uncovered_dropped == 8
    assert extraction.uncovered_cut == 0


def test_uncovered_names_are_bounded_by_length():
    long_a, long_b = "a" * 100, "b" * 65
    exact = "c" * 64
    extraction = extract_points({"data": {long_b: 1, exact: 2, long_a: 3, "d": 4}})
    assert healthlog.UNCOVERED_MAX_LENGTH == 64
    assert extraction.uncovered_cut == 2
    assert extraction.uncovered_dropped == 0
    first, second, third, fourth = extraction.uncovered
    assert first.startswith("a" * 64) and second.startswith("b" * 64)
    assert third == exact and fourth == "d"
    for name in (first, second):
        assert len(name) <= 65 and "a" * 65 not in name and "b" * 65 not in name


def test_both_bounds_fire_together():
    keys = ["k%02d" % i + "x" * 80 for i in range(35)]
    extraction = extract_points({"data": dict.fromkeys(keys, [])})
    assert len(extraction.uncovered) == 32
    assert extraction.uncovered_dropped == 3
    assert extraction.uncovered_cut == 32


@pytest.mark.parametrize("doc", [[], "text", None, 5, True, [{"data": {}}], {},
                                 {"data": []}, {"data": None}, {"data": "x"}, {"Data": {}},
                                 {"metrics": []}])
def test_a_body_that_is_not_an_object_with_a_data_object_is_not_parsed(doc):
    with pytest.raises(ContentNotParsed):
        extract_points(doc)


def test_check_deadline_is_called_while_extracting_metrics():
    calls = []
    extract_points(as_delivered(hf.metrics_payload(1, ("step_count",), hf.DEFAULT_DAY)),
                   check_deadline=lambda: calls.append(1))
    assert calls

    def expired():
        raise healthlog.FoldDeadlineExceeded()

    with pytest.raises(healthlog.FoldDeadlineExceeded):
        extract_points(as_delivered(hf.metrics_payload(1, ("step_count",), hf.DEFAULT_DAY)),
                       check_deadline=expired)


# ---------------------------------------------------------------------------
# Layers: header first, then inference from dense metrics (storage spec, STO-1)
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("grouping", healthlog.GROUPINGS)
def test_header_layer_accepts_every_grouping_in_any_case(grouping):
    for spelling in (grouping, grouping.upper(), grouping.capitalize(), " %s " % grouping):
        assert header_layer(spelling) == grouping


@pytest.mark.parametrize("value", [None, "", "  ", "Minute", "record", "Today",
                                   "Previous 7 Days", "weekly", "days,hours", "sec onds"])
def test_header_layer_rejects_what_names_no_grouping(value):
    assert header_layer(value) is None


def infer(payload: dict) -> str:
    return infer_layer(extract_points(as_delivered(payload, seed=9)))


@pytest.mark.parametrize("day", [hf.DEFAULT_DAY, hf.DST_SPRING, hf.DST_FALL])
@pytest.mark.parametrize("grouping, layer", [("Minutes", "minutes"), ("Hours", "hours"),
                                             ("Default", "minutes")])
def test_infer_layer_from_factory_payloads(day, grouping, layer):
    # Default keeps heart rate at the second, everything else on the minute: the
    # majority of dense metrics decides (a Default delivery with its header is "default").
    assert infer(hf.metrics_payload(5, hf.DEFAULT_METRICS, day, grouping=grouping)) == layer


@pytest.mark.parametrize("style", sorted(hf.TIME_STYLES))
def test_infer_layer_reads_twelve_hour_phones_in_local_time(style):
    phone = hf.Phone(time_style=style)
    for grouping, layer in (("Minutes", "minutes"), ("Hours", "hours")):
        assert infer(hf.metrics_payload(5, ("step_count", "heart_rate"), hf.DEFAULT_DAY,
                                        grouping=grouping, phone=phone)) == layer
    week = (hf.DST_SPRING - dt.timedelta(days=3), hf.DST_SPRING + dt.timedelta(days=4))
    assert infer(hf.metrics_payload(5, ("step_count", "heart_rate"), *week, grouping="Days",
                                    phone=phone)) == "days"


@pytest.mark.parametrize("dst_day", [hf.DST_SPRING, hf.DST_FALL])
def test_infer_layer_days_across_a_dst_change(dst_day):
    payload = hf.metrics_payload(5, hf.DEFAULT_METRICS, dst_day - dt.timedelta(days=3),
                                 dst_day + dt.timedelta(days=4), grouping="Days")
    dates = {p["date"] for m in payload["data"]["metrics"] for p in m["data"]}
    assert {d[-5:] for d in dates} == {"-0800", "-0700"}  # midnight written two ways
    assert all(d[11:19] == "00:00:00" for d in dates)
    assert infer(payload) == "days"


def test_infer_layer_days_in_berlin():
    phone = hf.Phone(zone=hf.BERLIN)
    payload = hf.metrics_payload(5, ("step_count", "heart_rate"), dt.date(2024, 3, 28),
                                 dt.date(2024, 4, 3), grouping="Days", phone=phone)
    assert infer(payload) == "days"


def test_infer_layer_ignores_sleep_analysis():
    window = (hf.DEFAULT_DAY, hf.DEFAULT_DAY + dt.timedelta(days=7))
    aggregated = hf.metrics_payload(5, ("sleep_analysis",), *window)
    assert len(aggregated["data"]["metrics"][0]["data"]) >= 3  # dense, at local midnights
    assert infer(aggregated) is None
    assert infer(hf.metrics_payload(5, ("sleep_analysis",), *window, sleep="segments")) is None
    mixed = hf.metrics_payload(5, ("sleep_analysis", "step_count"), hf.DEFAULT_DAY,
                               grouping="Hours", sleep="segments")
    assert infer(mixed) == "hours"


def second_points(count: int, start: str = "2024-03-08 10:00:07 -0800") -> list:
    base = T(start) // healthlog.US
    return [{"date": hf.hae_time(base + 13 * k, hf.PACIFIC), "qty": k + 1} for k in range(count)]


def test_infer_layer_ignores_interval_metrics():
    raw = [{"date": p["date"], "start": p["date"],
            "end": hf.hae_time(T(p["date"]) // healthlog.US + 5, hf.PACIFIC), "qty": 40}
           for p in second_points(6)]
    doc = hf.envelope(metrics=[hf.metric("heart_rate_variability", raw)])
    assert infer(doc) is None
    hours = hf.metrics_payload(5, ("step_count",), hf.DEFAULT_DAY, grouping="Hours")
    hours["data"]["metrics"].append(hf.metric("heart_rate_variability", raw))
    assert infer(hours) == "hours"


def test_infer_layer_a_sparse_metric_has_no_vote_and_sparse_bodies_pool_their_points():
    assert infer(hf.envelope(metrics=[hf.metric("heart_rate", second_points(1))])) is None
    assert infer(hf.envelope(metrics=[hf.metric("heart_rate", second_points(2))])) == "seconds"
    assert infer(hf.envelope(metrics=[hf.metric("heart_rate", second_points(3))])) == "seconds"
    # a one-day Days body has one point per metric: nothing dense, the pool says days
    one_day = hf.metrics_payload(5, hf.DEFAULT_METRICS, hf.DEFAULT_DAY, grouping="Days")
    assert all(len(m["data"]) < 3 for m in one_day["data"]["metrics"])
    assert infer(one_day) == "days"
    minutes = hf.metrics_payload(5, ("step_count",), hf.DEFAULT_DAY, grouping="Minutes")
    minutes["data"]["metrics"].append(hf.metric("heart_rate", second_points(2)))
    assert infer(minutes) == "minutes"


def test_storage_8_5_weekly_metrics_beside_daily_ones_are_still_days():
    # Two weeks of a Days export: daily steps, a weight on Mondays, a blood pressure on
    # Sundays. Each weekly metric alone is spaced by weeks; the delivery is days.
    days = [dt.date(2024, 3, 4) + dt.timedelta(days=i) for i in range(14)]

    def at(day) -> str:
        return "%s 00:00:00 -0800" % day.isoformat()

    payload = hf.envelope(metrics=[
        hf.metric("step_count", [{"date": at(d), "qty": 1000 + i} for i, d in enumerate(days)],
                  "count"),
        hf.metric("weight_body_mass", [{"date": at(d), "qty": 70.5} for d in days[0::7]] * 1
                  + [{"date": at(days[0] + dt.timedelta(days=14)), "qty": 70.1}], "kg"),
        hf.metric("blood_pressure", [{"date": at(d), "systolic": 120, "diastolic": 80}
                                     for d in days[6::7]]
                  + [{"date": at(days[6] + dt.timedelta(days=14)), "systolic": 118,
                      "diastolic": 79}], "mmHg")])
    assert infer(payload) == "days"


def test_infer_layer_ignores_record_sections():
    assert infer(hf.envelope(**hf.records_sections(0, *TWO_WEEKS, ecg_samples=2))) is None
    assert infer_layer(extract_points({"data": {}})) is None


def midnight_points(days: list, zone: hf.Zone = hf.PACIFIC) -> list:
    return [{"date": hf.hae_time(day, zone), "qty": 100 + k} for k, day in enumerate(days)]


def spaced_payload(days: list) -> dict:
    return hf.envelope(metrics=[hf.metric("step_count", midnight_points(days)),
                                hf.metric("active_energy", midnight_points(days))])


def test_infer_layer_weeks_from_spacing_across_dst():
    mondays = [dt.date(2024, 2, 26) + dt.timedelta(weeks=k) for k in range(5)]
    payload = spaced_payload(mondays)
    assert {p["date"][-5:] for p in payload["data"]["metrics"][0]["data"]} == {"-0800", "-0700"}
    assert infer(payload) == "weeks"


def test_infer_layer_weeks_with_a_missing_week():
    sundays = [dt.date(2024, 3, 3), dt.date(2024, 3, 10), dt.date(2024, 3, 24)]
    assert infer(spaced_payload(sundays)) == "weeks"


def test_infer_layer_months_and_years_from_spacing():
    firsts = [dt.date(2024, month, 1) for month in range(1, 7)]
    assert infer(spaced_payload(firsts)) == "months"
    new_years = [dt.date(year, 1, 1) for year in range(2021, 2025)]
    assert infer(spaced_payload(new_years)) == "years"


def test_infer_layer_days_when_spacing_is_irregular():
    days = [dt.date(2024, 3, 1), dt.date(2024, 3, 2), dt.date(2024, 3, 9)]
    assert infer(spaced_payload(days)) == "days"
    mixed = [dt.date(2024, 3, 1), dt.date(2024, 4, 1), dt.date(2024, 4, 2)]
    assert infer(spaced_payload(mixed)) == "days"


def test_infer_layer_takes_the_finest_alignment_of_all_dense_metrics():
    hours = hf.metrics_payload(5, ("step_count",), hf.DEFAULT_DAY, grouping="Hours")
    minutes = hf.metrics_payload(5, ("active_energy",), hf.DEFAULT_DAY, grouping="Minutes")
    hours["data"]["metrics"] += minutes["data"]["metrics"]
    assert infer(hours) == "minutes"
    hours["data"]["metrics"].append(hf.metric("heart_rate", second_points(4)))
    assert infer(hours) == "seconds"


def test_infer_layer_reads_iso_and_colon_offset_spellings():
    iso = [{"date": "2024-03-08T%02d:00:00+02:00" % h, "qty": h} for h in range(8, 12)]
    colon = [{"date": "2024-03-08 %02d:00:00+01:00" % h, "qty": h} for h in range(8, 12)]
    assert infer(hf.envelope(metrics=[hf.metric("step_count", iso)])) == "hours"
    assert infer(hf.envelope(metrics=[hf.metric("step_count", colon)])) == "hours"
    colon[2]["date"] = "2024-03-08 10:00:30+01:00"
    assert infer(hf.envelope(metrics=[hf.metric("step_count", colon)])) == "seconds"


def test_infer_layer_merges_day_starts_written_in_24_and_12_hour_style():
    twelve = hf.Phone(time_style="12h-nnbsp")
    early = [{"date": hf.hae_time(dt.date(2024, m, 1), hf.PACIFIC), "qty": m} for m in (1, 2, 3)]
    late = [{"date": twelve.time(dt.date(2024, m, 1)), "qty": m} for m in (4, 5, 6)]
    assert "12:00:00\u202fam" in late[0]["date"]
    assert infer(hf.envelope(metrics=[hf.metric("step_count", early),
                                      hf.metric("active_energy", late)])) == "months"


def test_infer_layer_sample_limits_the_starts_looked_at():
    points = [{"date": "2024-03-08 %02d:00:00 -0800" % h, "qty": h} for h in range(8, 12)]
    points.append({"date": "2024-03-08 13:00:05 -0800", "qty": 1})
    extraction = extract_points(as_delivered(hf.envelope(metrics=[hf.metric("step_count",
                                                                            points)])))
    assert infer_layer(extraction) == "seconds"
    assert infer_layer(extraction, sample=4) == "hours"
    assert infer_layer(extraction, sample=None) == "seconds"


def test_infer_layer_treats_fractional_iso_starts_as_unaligned():
    points = [{"date": "2024-03-08T%02d:00:00.5000Z" % h, "qty": h} for h in range(8, 12)]
    assert healthlog.local_day_and_second(points[0]["date"])[1] % 60  # unaligned, as written
    assert infer(hf.envelope(metrics=[hf.metric("step_count", points)])) == "seconds"
