"""The server plans the view (READ-17): for a range it chooses the layer and the bucket,
never finer than the data arrived, and says so in words; the page draws what it is told.

A real ``serve`` holds, for a phone in America/New_York: a Days automation (steps, weight:
one point per day at local midnight) for 60 days, a Minutes automation of heart rate for
the last three days, and nine nights of sleep summaries; active energy from both, the Days
automation's up to the day before the newest, the Minutes one's for the last three days.
Every expectation is worked out here from the bodies: the newest point's written date, the
points of a day summed.
"""

import datetime as dt

import pytest

import hae_factory as hf
from read_helpers import assert_error, get, get_json, serve_corpus

ZONE = "America/New_York"
PHONE = hf.Phone(zone=hf.NEW_YORK, sources="single")
NEWEST = dt.date(2025, 3, 10)
FIRST = NEWEST - dt.timedelta(days=59)
DAYS = hf.Automation("Health days", "Days", "Previous 7 Days")
MINUTES = hf.Automation("Health minutes", "Minutes", "Since Last Sync")
SLEEP = hf.Automation("Sleep", "Default", "Previous 7 Days")


def corpus() -> dict:
    export = hf.days_export(seed=5, start=FIRST, end=NEWEST + dt.timedelta(days=1),
                            phone=PHONE, names=("step_count", "weight_body_mass"))
    start = hf.zoned_epoch(ZONE, dt.datetime.combine(NEWEST - dt.timedelta(days=2), dt.time()))
    end = hf.zoned_epoch(ZONE, dt.datetime.combine(NEWEST, dt.time(21, 17)))
    heart = [{"date": hf.zoned_stamp(ZONE, t), "Min": 60 + t % 20, "Avg": 70 + t % 20,
              "Max": 80 + t % 20, "source": hf.OWNER_WATCH} for t in range(start, end, 300)]
    nights = hf.sleep_summaries(3, NEWEST - dt.timedelta(days=8), NEWEST + dt.timedelta(days=1),
                                phone=PHONE, form="c")
    # active energy: the Days automation's to yesterday, the Minutes one's since two days
    # before the newest day (both hold the two days between)
    energy_days = [{"date": hf.zoned_stamp(ZONE, dt.datetime.combine(FIRST + dt.timedelta(
        days=k), dt.time())), "qty": 400.0 + k, "source": hf.OWNER_PHONE}
        for k in range((NEWEST - FIRST).days)]
    energy_minutes = [{"date": hf.zoned_stamp(ZONE, t), "qty": 0.5 + t % 7 / 10,
                       "source": hf.OWNER_WATCH} for t in range(start, end, 600)]
    return {"days": export, "heart": heart, "nights": nights,
            "energy": {"days": energy_days, "minutes": energy_minutes}}


CORPUS = corpus()


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    deliveries = [
        (hf.headers_for(DAYS), hf.dumps_hae(CORPUS["days"])),
        (hf.headers_for(MINUTES), hf.dumps_hae(hf.envelope(metrics=[
            hf.metric("heart_rate", CORPUS["heart"], "count/min")]))),
        (hf.headers_for(SLEEP), hf.dumps_hae(hf.envelope(metrics=[
            hf.metric("sleep_analysis", CORPUS["nights"], "hr")]))),
        (hf.headers_for(DAYS), hf.dumps_hae(hf.envelope(metrics=[
            hf.metric("active_energy", CORPUS["energy"]["days"], "kcal")]))),
        (hf.headers_for(MINUTES), hf.dumps_hae(hf.envelope(metrics=[
            hf.metric("active_energy", CORPUS["energy"]["minutes"], "kcal")]))),
    ]
    yield from serve_corpus(tmp_path_factory.mktemp("plan"), CORPUS, deliveries)


def day_steps() -> dict:
    [steps] = [m for m in CORPUS["days"]["data"]["metrics"] if m["name"] == "step_count"]
    out = {}
    for point in steps["data"]:
        out[point["date"][:10]] = out.get(point["date"][:10], 0) + point["qty"]
    return out


def plan(store, **query):
    return get_json(store.address, "/api/plan", **query)


def test_read_17_1_day_data_on_a_24_hour_range_is_one_day_said_as_such(store):
    newest = max(day_steps())
    got = plan(store, metric="step_count", range="24h")
    assert (got["layer"], got["bucket"], got["axis"]) == ("days", "day", "dates")
    assert (got["from"], got["to"]) == (newest, newest)  # one day: both bounds are it
    assert "arrives once a day" in got["words"] and "per hour" not in got["words"]
    reply = get_json(store.address, "/api/points", metric="step_count", layer=got["layer"],
                     bucket=got["bucket"], **{"from": got["from"], "to": got["to"]})
    [run] = reply["runs"]
    assert [(b["date"], b["fields"]["qty"]["sum"]) for b in run["buckets"]] == [
        (newest, day_steps()[newest])]


@pytest.mark.parametrize("view, first, last", [
    ("custom", "2025-03-09", "2025-03-10"), ("7d", "2025-03-04", "2025-03-10"),
    ("30d", "2025-02-09", "2025-03-10")])
def test_read_17_1_day_data_is_never_drawn_per_hour(store, view, first, last):
    query = {"from": first, "to": last} if view == "custom" else {}
    got = plan(store, metric="step_count", range=view, **query)
    assert got["bucket"] == "day" and got["layer"] == "days"
    assert (got["from"], got["to"]) == (first, last)  # dates: the last day is included
    reply = get_json(store.address, "/api/points", metric="step_count", layer=got["layer"],
                     bucket=got["bucket"], **{"from": got["from"], "to": got["to"]})
    sums = {b["date"]: b["fields"]["qty"]["sum"] for b in reply["runs"][0]["buckets"]}
    assert sums == {d: v for d, v in day_steps().items() if first <= d <= last}


def test_read_17_2_minute_data_on_24_hours_is_per_hour_to_the_hour_after_the_newest(store):
    newest = max(CORPUS["heart"], key=lambda p: p["date"])["date"]  # "2025-03-10 21:15:00 -0400"
    got = plan(store, metric="heart_rate", range="24h")
    assert (got["layer"], got["bucket"], got["axis"]) == ("minutes", "hour", "hours")
    moment = dt.datetime.strptime(newest, "%Y-%m-%d %H:%M:%S %z")
    end = (moment.replace(minute=0, second=0) + dt.timedelta(hours=1)).astimezone(
        dt.timezone.utc)
    assert got["to"] == end.strftime("%Y-%m-%dT%H:%M:%SZ")
    assert got["from"] == (end - dt.timedelta(hours=24)).strftime("%Y-%m-%dT%H:%M:%SZ")
    assert got["words"].startswith("24 hours to %02d:00" % (moment.hour + 1))
    assert "averages per hour" in got["words"]


def test_read_17_2_long_ranges_are_per_day_then_per_week(store):
    assert plan(store, metric="heart_rate", range="7d")["bucket"] == "day"
    year = plan(store, metric="step_count", range="1y")
    assert year["bucket"] == "week"
    assert dt.date.fromisoformat(year["from"]).weekday() == 0  # weeks start on Monday
    everything = plan(store, metric="step_count", range="all")
    assert (everything["from"], everything["to"], everything["bucket"]) == (None, None, "day")


def test_read_17_3_sleep_is_per_night_to_the_newest_morning(store):
    wake = max(n["sleepEnd"][:10] for n in CORPUS["nights"])
    got = plan(store, metric="sleep_analysis", range="7d")
    assert (got["bucket"], got["to"]) == ("day", wake)
    assert got["anchor"]["date"] == wake and "one bar per night" in got["words"]


def energy_by_day(layer: str) -> dict:
    """Active energy per written date of the points the test sent in that layer."""
    out: dict = {}
    for point in CORPUS["energy"][layer]:
        out[point["date"][:10]] = out.get(point["date"][:10], 0.0) + point["qty"]
    return out


def test_read_17_7_the_plan_names_the_query_and_points_reads_its_layers_as_named(store):
    """The plan names the query that reads the view (``points``): its layer, and when none
    was picked the layers that fill the days it lacks; /api/points reads them as named,
    which is what it answers when it chooses itself, byte for byte (it chooses nothing
    again), and another order of the same layers reads each day from the first named."""
    days, minutes = energy_by_day("days"), energy_by_day("minutes")
    assert set(days) & set(minutes)  # two days held by both layers
    for view in ("7d", "30d"):
        got = plan(store, metric="active_energy", range=view)
        assert (got["layer"], got["bucket"]) == ("days", "day")
        assert got["points"] == {"metric": "active_energy", "layer": "days,minutes",
                                 "from": got["from"], "to": got["to"], "tz": "local",
                                 "bucket": "day"}
        named = get(store.address, "/api/points", **got["points"])
        chosen = get(store.address, "/api/points", **dict(got["points"], layer=None))
        assert named.status == chosen.status == 200 and named.body == chosen.body
        assert named.headers["X-Healthlog-Layer"] == "days,minutes"
        for order, first in (("days,minutes", days), ("minutes,days", minutes)):
            reply = get_json(store.address, "/api/points", **dict(got["points"], layer=order))
            sums = {b["date"]: b["fields"]["qty"]["sum"] for run in reply["runs"]
                    for b in run["buckets"]}
            want = dict(minutes if first is days else days, **first)
            assert sums == pytest.approx({d: v for d, v in want.items()
                                          if got["from"] <= d <= got["to"]}), order
            assert (reply["layer"], reply["layers"]) == (order.split(",")[0], order.split(","))
    hours = plan(store, metric="active_energy", range="24h")
    assert (hours["bucket"], hours["points"]["layer"]) == ("hour", "minutes")
    picked = plan(store, metric="active_energy", range="30d", layer="minutes")
    assert picked["points"]["layer"] == "minutes"  # a layer picked is read alone
    week = {"metric": "active_energy", "from": "2025-03-04", "to": "2025-03-10"}
    for query, status, code in (
            ({"layer": "days,minutes"}, 400, "bad_request"),  # raw points: one layer
            ({"layer": "days,minutes", "bucket": "hour"}, 400, "bad_request"),
            ({"layer": "days,days", "bucket": "day"}, 400, "bad_request"),
            ({"layer": "days,weeks", "bucket": "day"}, 400, "bad_request"),
            ({"layer": "days,hours", "bucket": "day"}, 404, "unknown_layer")):
        assert_error(get(store.address, "/api/points", **week, **query), status, code)


@pytest.mark.parametrize("query, status, code", [
    ({"range": "24h"}, 400, "bad_request"),
    ({"metric": "step_count", "range": "2w"}, 400, "bad_request"),
    ({"metric": "step_count", "range": "custom", "from": "2025-03-09"}, 400, "bad_request"),
    ({"metric": "step_count", "range": "custom", "from": "2025-03-10", "to": "2025-03-09"},
     400, "bad_request"),
    ({"metric": "step_count", "range": "custom", "from": "2024-02-30", "to": "2025-03-09"},
     400, "bad_request"),
    ({"metric": "step_count", "range": "custom", "from": "2025-03-01", "to": "9999-12-31"},
     400, "bad_request"),
    ({"metric": "step_count", "range": "custom", "from": "0000-01-01", "to": "2025-03-09"},
     400, "bad_request"),
    ({"metric": "no_such_metric", "range": "7d"}, 404, "unknown_metric"),
    ({"metric": "step_count", "layer": "minutes"}, 404, "unknown_layer"),
])
def test_read_17_4_a_plan_that_cannot_be_made_is_the_routes_own_error(store, query, status,
                                                                      code):
    assert_error(get(store.address, "/api/plan", **query), status, code)
