"""READ-15: GET /api/summary, a day at a glance against the person's own usual
(openspec/specs/read/spec.md).

Bodies are built here the way HAE sends them (minute exports with the phone's offset in
every timestamp, Days exports at local midnight, sleep summaries), for a phone in
America/New_York whose days cross the DST change of 2025-03-09; they are posted to a real
server on 127.0.0.1:0 and folded by its worker. Every expected number is computed here
from the points by the date written in them, with zoneinfo, never by healthlog's code.
"""

import datetime as dt
import json
import statistics

import pytest

import hae_factory as hf
from conftest import db_rows, wait_for
from read_helpers import close, ny_stamp, ny_steps, serve_corpus, usual_of, written_date

FIRST = dt.date(2025, 2, 20)
DAYS = [FIRST + dt.timedelta(days=n) for n in range(45)]  # to 2025-04-05, across 03-09
MISSING = {dt.date(2025, 3, 1), dt.date(2025, 3, 2), dt.date(2025, 3, 20)}
KJ_FROM = dt.date(2025, 3, 22)  # the phone's energy unit switched to kJ that day
MINUTES = {"automation-name": "Fast", "automation-aggregation": "Minutes"}
DAILY = {"automation-name": "Daily", "automation-aggregation": "Days"}
RECORDS = {"automation-name": "Sleep"}


def energy_of(day: dt.date) -> tuple:
    kj = day >= KJ_FROM
    points = [{"date": ny_stamp(day, m), "qty": (1.5 + m % 5) * (4.184 if kj else 1.0),
               "source": "Watch"} for m in range(6 * 60, 22 * 60, 10)]
    return points, "kJ" if kj else "kcal"


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """The days' steps and energy by the minute, daily resting heart rate and weight, and
    twelve nights in the three summary forms, posted and folded; the store's corpus is what
    was posted of each."""
    bodies = {"steps": [], "energy": [], "resting": [], "weight": [], "nights": []}
    deliveries = []
    for day in DAYS:
        if day in MISSING:
            continue
        steps = ny_steps(day, "Watch")
        energy, units = energy_of(day)
        bodies["steps"] += steps
        bodies["energy"] += [(p, units) for p in energy]
        deliveries.append((MINUTES, hf.dumps_hae(hf.envelope(metrics=[
            hf.metric("step_count", steps, "count"),
            hf.metric("active_energy", energy, units)]))))
    resting = [{"date": ny_stamp(day), "qty": 50 + day.day % 6, "source": "Watch"}
               for day in DAYS if day not in MISSING]
    weight = [{"date": ny_stamp(day, 7 * 60 + 5), "qty": 70 + day.day / 10, "source": "Scale"}
              for day in DAYS[::6]]
    bodies["resting"], bodies["weight"] = resting, weight
    deliveries.append((DAILY, hf.dumps_hae(hf.envelope(metrics=[
        hf.metric("resting_heart_rate", resting, "count/min"),
        hf.metric("weight_body_mass", weight, "kg")]))))
    nights = []
    for n, day in enumerate(DAYS[-12:]):
        wake = ny_stamp(day, 6 * 60 + 40 + n)
        start = ny_stamp(day - dt.timedelta(days=1), 23 * 60 + 10)
        # HAE's `date`: the wake time some nights, the sleep start the evening before on
        # others; form (a) old, (b) stages beside the unspecified minutes in a non-zero
        # asleep, (c) asleep: 0 beside totalSleep (their sum, as on every real record).
        night = {"date": wake if n % 2 else start, "sleepStart": start, "sleepEnd": wake,
                 "inBedStart": start, "inBedEnd": wake, "inBed": 7.4 + n / 100,
                 "source": "Watch"}
        if n % 3 == 0:
            night.update(asleep=7.2 - n / 50, sleepSource="Watch", inBedSource="Phone")
        elif n % 3 == 1:
            night.update(asleep=0.2 + n / 40, core=3.5, deep=1.2, rem=1.6, awake=0.3)
        else:
            night.update(asleep=0, totalSleep=6.4 + n / 30, core=3.9 + n / 30, deep=1.1,
                         rem=1.4, awake=0.2)
        nights.append(night)
    bodies["nights"] = nights
    deliveries.append((RECORDS, hf.dumps_hae(hf.envelope(metrics=[
        hf.metric("sleep_analysis", nights, "hr")]))))
    yield from serve_corpus(tmp_path_factory.mktemp("summary"), bodies, deliveries)


def summary_of(client, day: dt.date) -> dict:
    status, answer = client.request("GET", "/api/summary?date=%s" % day.isoformat())
    assert status == 200, answer
    return answer


def by_date(points: list, value=lambda p: p["qty"]) -> dict:
    out: dict = {}
    for point in points:
        out.setdefault(written_date(point["date"]), []).append(value(point))
    return out


def card(answer: dict, group: str, metric: str) -> dict:
    [found] = [c for c in answer["cards"][group] if c["metric"] == metric]
    return found


@pytest.mark.parametrize("day", [dt.date(2025, 3, 9), dt.date(2025, 3, 10),
                                 dt.date(2025, 4, 5), dt.date(2025, 3, 20)],
                         ids=["dst-day", "after-dst", "last", "missing"])
def test_read_15_1_day_values_usual_and_sparkline_are_the_tests_own(served, day):
    client, bodies = served.client, served.corpus
    answer = summary_of(client, day)
    assert answer["date"] == day.isoformat() and answer["tz"] == "local"
    steps = {d: sum(v) for d, v in by_date(bodies["steps"]).items()}
    got = card(answer, "activity", "step_count")
    assert got["units"] == "count" and got["name"] == "Steps"
    assert close(got["value"], steps.get(day))  # null on a day without data, never 0
    assert close(got["usual"], usual_of(steps, day))
    spark = [(dt.date.fromisoformat(p["date"]), p["value"]) for p in got["spark"]]
    assert [d for d, _ in spark] == [day - dt.timedelta(days=n) for n in range(13, -1, -1)]
    for d, value in spark:
        assert close(value, steps.get(d)), d
    assert got["link"] == {"metric": "step_count",  # both dates in the range, as a query
                           "from": (day - dt.timedelta(days=13)).isoformat(),
                           "to": day.isoformat()}
    resting = {d: statistics.mean(v) for d, v in by_date(bodies["resting"]).items()}
    heart = card(answer, "heart", "resting_heart_rate")
    assert close(heart["value"], resting.get(day)) and close(heart["usual"],
                                                             usual_of(resting, day))
    [weight] = [c for c in answer["cards"]["body"] if c["metric"] == "weight_body_mass"]
    latest = max((p for p in bodies["weight"] if written_date(p["date"]) <= day),
                 key=lambda p: p["date"][:19])
    assert weight["values"] == {"qty": latest["qty"]} and weight["units"] == "kg"
    assert weight["measured"][:19] == latest["date"][:19].replace(" ", "T")


def hours_asleep(night: dict) -> float:
    """A summary's sleep is HAE's own total: totalSleep, else its asleep (only the
    unspecified part where stages stand beside it) and its stages added up. These nights
    are 7.5 h or more from sleep start to wake, each figure within that."""
    if night.get("totalSleep"):
        return night["totalSleep"]
    return night["asleep"] + sum(night.get(stage, 0.0) for stage in ("core", "deep", "rem"))


def test_read_15_2_last_night_in_every_nightly_form(served):
    client, bodies = served.client, served.corpus
    forms = {("totalSleep" in n, "core" in n) for n in bodies["nights"]}
    assert forms == {(False, False), (False, True), (True, True)}  # (a), (b) and (c)
    for night in bodies["nights"]:
        morning = written_date(night["sleepEnd"])
        answer = summary_of(client, morning)
        sleep = answer["cards"]["sleep"]
        asleep = hours_asleep(night)
        assert asleep < 7.5 and close(sleep["asleep"], asleep), (morning, sleep)
        if "core" in night and "totalSleep" not in night:  # (b): not the asleep figure alone
            assert sleep["asleep"] > night["asleep"] + 6
        assert close(sleep["in_bed"], night["inBed"])
        assert sleep["overlapping"] is False and sleep["naps"] == []
        # stages are shown where the Watch told some apart (forms (b), (c)): those, awake,
        # and beside them the minutes it left unstaged (HAE's asleep) as their own stage
        stages = {k: night[k] for k in ("core", "deep", "rem", "awake") if night.get(k)}
        if "core" in night and night.get("asleep"):
            stages["asleep"] = night["asleep"]
        assert list(sleep["stages"]) == [k for k in STAGES if k in stages]  # deepest first
        assert [s["stage"] for s in sleep["stage_order"]] == list(STAGES)
        assert all(close(sleep["stages"][k], v) for k, v in stages.items()), sleep["stages"]
        assert sleep["sleep_end"][:19] == night["sleepEnd"][:19].replace(" ", "T")
        assert sleep["sleep_start"][:19] == night["sleepStart"][:19].replace(" ", "T")
        earlier = [hours_asleep(n) for n in bodies["nights"]
                   if morning - dt.timedelta(days=30) <= written_date(n["sleepEnd"]) < morning]
        assert close(sleep["usual"], statistics.median(earlier) if len(earlier) >= 5 else None)


#: The summary's groups, by the spec (READ-15): (group, title, how drawn, metrics).
CARD_ORDER = (("activity", "Activity", "series", ["step_count", "active_energy",
                                                   "apple_exercise_time", "apple_stand_hour",
                                                   "walking_running_distance"]),
              ("sleep", "Last night", "night", ["sleep_analysis"]),
              ("heart", "Heart", "series", ["resting_heart_rate", "heart_rate_variability",
                                            "walking_heart_rate_average", "heart_rate"]),
              ("body", "Body", "latest", ["weight_body_mass", "body_fat_percentage",
                                          "blood_pressure"]),
              ("workouts", "Workouts", "week", ["workouts"]),
              ("other", "Also recorded", "list", []))
#: The stages of sleep, deepest first, awake last (READ-12, READ-13).
STAGES = ("deep", "core", "rem", "asleep", "awake")


def test_read_15_7_the_cards_their_order_and_titles_come_with_the_summary(served):
    client = served.client
    catalog = {e["metric"]: e["meaning"] for e in client.request("GET", "/api/catalog")[1][
        "metrics"]}
    for day in (DAYS[-1], dt.date(2024, 6, 1)):  # a day with data and one before any
        answer = summary_of(client, day)
        order = answer["card_order"]
        assert [(g["group"], g["title"], g["render"], g["metrics"]) for g in order] == list(
            CARD_ORDER)
        assert list(answer["cards"]) == [g["group"] for g in order]
        # each group is its metrics' group in the catalog's meaning table
        for group in order:
            for metric in group["metrics"]:
                if metric in catalog:
                    assert catalog[metric]["group"] == group["group"], metric
        [week] = [g for g in order if g["render"] == "week"]
        assert week["link"] == {"metric": "workouts",
                                "from": (day - dt.timedelta(days=6)).isoformat(),
                                "to": day.isoformat()}
        assert all("link" not in g for g in order if g["render"] != "week")
    answer = summary_of(client, DAYS[-1])
    # each card says how it is drawn: a series, the heart rate's range, a latest measurement
    for group, _, render, _ in CARD_ORDER:
        if render in ("series", "latest"):
            for found in answer["cards"][group]:
                assert found["render"] == render, found["metric"]
    assert answer["cards"]["sleep"]["render"] == "night"
    assert answer["cards"]["sleep"]["fields"] == [
        {"field": "asleep", "label": "asleep"}, {"field": "in_bed", "label": "in bed"}]


def test_read_15_4_a_metric_in_two_units(served):
    client, bodies = served.client, served.corpus
    day = dt.date(2025, 4, 2)
    answer = summary_of(client, day)
    energy = card(answer, "activity", "active_energy")
    sums: dict = {}
    for point, units in bodies["energy"]:
        key = written_date(point["date"])
        sums[key] = (sums.get(key, (0.0, units))[0] + point["qty"], units)
    assert energy["units"] == "kJ" and close(energy["value"], sums[day][0])
    kj_days = {d: v for d, (v, u) in sums.items() if u == "kJ"}
    assert close(energy["usual"], usual_of(kj_days, day))


def test_read_15_1_a_day_before_any_data_has_no_values(served):
    client = served.client
    answer = summary_of(client, dt.date(2024, 6, 1))
    assert answer["cards"]["sleep"] is None
    for group in ("activity", "heart"):
        for found in answer["cards"][group]:
            assert found.get("value") is None and found.get("usual") is None
    assert answer["cards"]["workouts"] == [] and answer["cards"]["other"] == []


def test_read_15_1_without_a_date_the_day_of_the_newest_point(served):
    client = served.client
    status, answer = client.request("GET", "/api/summary")
    assert status == 200 and answer["date"] == DAYS[-1].isoformat()
    assert client.request("GET", "/api/summary?date=2025-13-01")[0] == 400


# -- READ-15.3: trends, on a store of their own ------------------------------------------


@pytest.fixture(scope="module")
def trending(tmp_path_factory):
    """455 days of Days exports: resting heart rate falling in the last 90 days (better:
    down), steps rising (better: up), body fat flat, and VO2 max with too few recent days."""
    last = dt.date(2025, 6, 30)
    days = [last - dt.timedelta(days=n) for n in range(454, -1, -1)]
    recent = set(days[-90:])
    series = {
        "resting_heart_rate": [(d, 60 + (d.day % 5) - (6 if d in recent else 0)) for d in days],
        "step_count": [(d, 8000 + (d.day % 7) * 100 + (2500 if d in recent else 0))
                       for d in days],
        "body_fat_percentage": [(d, 22 + (d.day % 3) * 0.5) for d in days],
        "vo2_max": [(d, 40 + d.day % 4) for d in days if d not in recent or d.day == 1],
    }
    metrics = [hf.metric(name, [{"date": ny_stamp(d), "qty": v, "source": "Watch"}
                                for d, v in points], "x")
               for name, points in series.items()]
    yield from serve_corpus(tmp_path_factory.mktemp("trends"), (last, series),
                            [(DAILY, hf.dumps_hae(hf.envelope(metrics=metrics)))])


def test_read_15_3_trends_up_down_and_flat_by_the_stated_rule(trending):
    client, (last, series) = trending.client, trending.corpus
    answer = summary_of(client, last)
    rule = answer["trend_rule"]
    assert (rule["recent_days"], rule["baseline_days"]) == (90, 365)
    trends = {t["metric"]: t for t in answer["trends"]}
    assert "vo2_max" not in trends  # too few recent days
    for metric, better in (("resting_heart_rate", "down"), ("step_count", "up"),
                           ("body_fat_percentage", "down")):
        values = series[metric]
        recent = [v for d, v in values if d > last - dt.timedelta(days=90)]
        base = [v for d, v in values if d <= last - dt.timedelta(days=90)]
        mean_recent, mean_base = statistics.mean(recent), statistics.mean(base)
        spread = statistics.stdev(base)
        got = trends[metric]
        assert close(got["recent"], mean_recent) and close(got["baseline"], mean_base)
        assert close(got["baseline_sd"], spread)
        assert got["flagged"] == (abs(mean_recent - mean_base) > spread)
        if got["flagged"]:  # a real change: its direction, and whether that is better
            direction = "up" if mean_recent > mean_base else "down"
            assert (got["direction"], got["better"]) == (direction, direction == better)
    assert trends["resting_heart_rate"]["flagged"] and trends["step_count"]["flagged"]
    assert not trends["body_fat_percentage"]["flagged"]
    assert (trends["resting_heart_rate"]["direction"], trends["resting_heart_rate"]["better"]) \
        == ("down", True)
    assert (trends["step_count"]["direction"], trends["step_count"]["better"]) == ("up", True)
    json.dumps(answer)  # plain JSON, no NaN


# -- READ-15.1: day values for every kind of offset --------------------------------------


def test_read_15_1_day_values_for_half_hour_and_changing_offsets(client, data_dir):
    """The day values come mostly from the hourly summaries summed inside SQLite; the hours
    whose points fall on two local days (a +05:30 phone, a traveller whose offset changes
    inside an hour) are read from their points. Both kinds, in local time and in a fixed
    zone, against day sums computed here."""
    points = []
    first = dt.datetime(2025, 5, 1, tzinfo=dt.timezone.utc)
    for n in range(10 * 24 * 4):  # every 15 minutes for ten days
        moment = first + dt.timedelta(minutes=15 * n)
        day = n // 96
        # Days 0-3 in India, days 4-6 in Lisbon (+01:00), a flight to Berlin on day 7
        # (the offset changes at 10:40 UTC, inside an hour), then +02:00.
        if day < 4:
            offset = dt.timedelta(hours=5, minutes=30)
        elif day < 7 or (day == 7 and moment.hour * 60 + moment.minute < 10 * 60 + 40):
            offset = dt.timedelta(hours=1)
        else:
            offset = dt.timedelta(hours=2)
        local = moment.astimezone(dt.timezone(offset))
        points.append({"date": local.strftime("%Y-%m-%d %H:%M:%S %z"),
                       "qty": 1 + (n * 7) % 11, "source": "Watch"})
    assert client.ingest(hf.dumps_hae(hf.envelope(metrics=[
        hf.metric("step_count", points, "count")])), headers=MINUTES)[0] == 200
    wait_for(lambda: {r["parse_status"] for r in db_rows(data_dir)} == {"parsed"},
             what="the trip is folded")
    for tz, offset in (("local", None), ("+05:30", dt.timedelta(hours=5, minutes=30)),
                       ("-07:00", dt.timedelta(hours=-7))):
        sums: dict = {}
        for point in points:
            when = dt.datetime.strptime(point["date"], "%Y-%m-%d %H:%M:%S %z")
            date = when.date() if offset is None else when.astimezone(dt.timezone(offset)).date()
            sums[date] = sums.get(date, 0) + point["qty"]
        day = dt.date(2025, 5, 10)
        status, answer = client.request(
            "GET", "/api/summary?date=%s&tz=%s" % (day, tz.replace("+", "%2B")))
        assert status == 200, answer
        spark = {dt.date.fromisoformat(p["date"]): p["value"]
                 for p in card(answer, "activity", "step_count")["spark"]}
        assert {d: v for d, v in spark.items() if v is not None} == {
            d: v for d, v in sums.items() if d <= day}, tz
