"""No night's stages pass the night (READ-12.10): a Hypothesis property over generated
nights of every form HAE sends, overlapping or not, through the server's own rule from
points to nights (``nights_of_points``, which ``sleep_nights`` feeds with the stored points),
its day and week buckets (the JSON reply's), the day CSV and the SQLite export's ``nights``
rows.

A night is generated as HAE writes it: a nightly record of form (a), (b) or (c), with
another app's unspecified hours beside the Watch's stages, stages written twice, an in-bed
figure smaller or larger than the night, a window stretched to the next afternoon or
without a start, records that touch; or stage records of one or two devices, copied some
seconds later, kept running for more than a day, with unspecified and awake blocks. What
must hold, in this file's words: the stages of sleep shown or exported add up to the hours
asleep or less (to them where any is shown); the hours asleep are never more than the
night's window, its own hours in bed, nor a day; and on a night whose figures overlap,
its stages and awake time together fit in the most it can hold.
"""

import csv
import datetime as dt
import io
import math

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import healthlog
from read_helpers import nights_by_date

SETTINGS = settings(max_examples=150, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow])
T0 = dt.datetime(2025, 6, 2, 12, 0, tzinfo=dt.timezone(dt.timedelta(hours=-4)))
SLEEP = ("deep", "core", "rem", "asleep")
SOURCES = ("Ana’s Apple Watch", "AutoSleep", "Eight Sleep", "Sleep++", "iPhone")


def text(moment: dt.datetime) -> str:
    return moment.strftime("%Y-%m-%d %H:%M:%S %z")


def hours(value: float) -> float:
    return round(value, 6)


@st.composite
def nightly(draw, start: dt.datetime):
    """One nightly record starting at ``start`` (a sleep start, or another record's end)."""
    length = draw(st.integers(20, 40 * 60)) * 60  # 20 minutes to 40 hours of window
    end = start + dt.timedelta(seconds=length)
    window = length / 3600
    form = draw(st.sampled_from("abc"))
    told = {k: hours(window * draw(st.floats(0, 0.6))) for k in ("core", "deep", "rem")}
    times = draw(st.sampled_from([1, 1, 2, 3]))  # stages written once, twice or three times
    told = {k: v * times for k, v in told.items()}
    point = {"date": text(draw(st.sampled_from([start, end])))}
    if form == "a":
        point["asleep"] = hours(window * draw(st.floats(0, 2.5)))
    else:
        point.update(told)
        point["asleep"] = hours(window * draw(st.sampled_from([0, 0, 0.05, 0.9, 1.3])))
        point["awake"] = hours(window * draw(st.floats(0, 0.8)))
        if form == "c" or draw(st.booleans()):
            point["totalSleep"] = point["asleep"] + sum(told.values())
    if draw(st.booleans()):
        point["sleepStart"] = text(start)
    point["sleepEnd"] = text(end)
    in_bed = draw(st.sampled_from([None, 0, 0.3, 0.8, 1.0, 1.5]))
    if in_bed is not None:
        point["inBed"] = hours(window * in_bed)
        if draw(st.booleans()):
            bed = draw(st.integers(0, length))
            point.update(inBedStart=text(start + dt.timedelta(seconds=bed // 2)),
                         inBedEnd=text(end - dt.timedelta(seconds=(length - bed) // 2)))
    point["source"] = "|".join(draw(st.lists(st.sampled_from(SOURCES), min_size=1,
                                             max_size=3, unique=True)))
    return point, end


@st.composite
def records(draw, start: dt.datetime):
    """Stage records of one night from ``start``: a device's segments one after another,
    maybe a second device's (or the same copied) some seconds later, maybe one kept
    running."""
    values = ("Core", "Deep", "REM", "Awake", "Asleep", "In Bed", "Kern",
              "HKCategoryValueSleepAnalysisAsleepUnspecified")
    segments = draw(st.lists(st.tuples(st.sampled_from(values), st.integers(60, 3 * 3600)),
                             min_size=1, max_size=14))
    rows, t = [], start
    for value, seconds in segments:
        rows.append({"startDate": text(t), "endDate": text(t + dt.timedelta(seconds=seconds)),
                     "qty": seconds / 3600, "value": value, "source": SOURCES[0]})
        t += dt.timedelta(seconds=seconds)
    shift = draw(st.sampled_from([None, 0, 40, 420, -300]))
    if shift is not None:
        twice = draw(st.sampled_from(["same", "Asleep", "Core"]))
        for row in list(rows):
            first = dt.datetime.strptime(row["startDate"], "%Y-%m-%d %H:%M:%S %z")
            last = dt.datetime.strptime(row["endDate"], "%Y-%m-%d %H:%M:%S %z")
            rows.append(dict(row, startDate=text(first + dt.timedelta(seconds=shift)),
                             endDate=text(last + dt.timedelta(seconds=shift)),
                             value=row["value"] if twice == "same" else twice,
                             source=SOURCES[1]))
    if draw(st.booleans()):
        hours_on = draw(st.integers(20, 30))
        rows.append({"startDate": text(start), "endDate": text(
            start + dt.timedelta(hours=hours_on)), "qty": hours_on, "value": "Asleep",
            "source": SOURCES[3]})
    return rows, t


@st.composite
def nights_of_every_form(draw):
    """A run of sleeps: nightly records (touching or apart) and stage records."""
    points, t = [], T0
    for _ in range(draw(st.integers(1, 6))):
        t += dt.timedelta(seconds=draw(st.sampled_from([0, 0, 600, 3 * 3600, 9 * 3600])))
        if draw(st.booleans()):
            point, t = draw(nightly(t))
            points.append(point)
        else:
            rows, t = draw(records(t))
            points += rows
    return points


def sleeps_of(days: list) -> list:
    return [sleep for day in days for sleep in ([day.night] if day.night else []) + day.naps]


def most_of(sleep) -> float:
    """The most a sleep can hold, read from what the server says bounded it."""
    return min(sleep.limit if sleep.limit is not None else 24.0, 24.0)


@SETTINGS
@given(nights_of_every_form(), st.sampled_from(["day", "week"]))
def test_read_12_10_no_nights_stages_pass_the_night(points, bucket):
    zone = healthlog.LOCAL_ZONE
    days = healthlog.nights_of_points(points, zone)
    for sleep in sleeps_of(days):
        sleep_stages = math.fsum(h for k, h in sleep.stages.items() if k in SLEEP)
        assert all(h > 0 for h in sleep.stages.values()), sleep
        if sleep.asleep is None:
            assert not sleep.stages, sleep
            continue
        assert sleep.asleep <= most_of(sleep) + 1e-9, sleep
        if sleep.window is not None and sleep.form == "nightly":
            assert sleep.asleep <= sleep.window + 1e-9, sleep
        assert sleep_stages <= sleep.asleep * (1 + 1e-9) + 1e-12, sleep
        if sleep_stages:
            assert math.isclose(sleep_stages, sleep.asleep, rel_tol=1e-9), sleep
        if sleep.overlapping:
            assert math.fsum(sleep.stages.values()) <= most_of(sleep) * (1 + 1e-9) + 1e-12, \
                sleep
    query = healthlog.PointQuery(healthlog.SLEEP_METRIC, healthlog.RECORD_LAYER, bucket=bucket,
                                 zone=zone)
    for item in healthlog.sleep_buckets(days, query):
        sleep_stages = math.fsum(h for k, h in item["stages"].items() if k in SLEEP)
        assert sleep_stages <= (item["asleep"] or 0.0) * (1 + 1e-9) + 1e-12, item
    csv_text = b"".join(healthlog._sleep_csv(days, query)).decode()
    for row in csv.DictReader(io.StringIO(csv_text, newline="")):
        told = math.fsum(float(row.get(k) or 0) for k in ("deep", "core", "rem", "unspecified"))
        assert told <= float(row["asleep"] or 0) * (1 + 1e-9) + 1e-12, row
    columns = ("date", "kind", "sleep_start", "sleep_end", "start", "end", "asleep", "in_bed",
               "deep", "core", "rem", "unspecified", "awake", "overlapping", "form", "counted",
               "scaled")
    for values in healthlog._night_rows(days):
        row = dict(zip(columns, values))
        told = math.fsum(row[k] or 0 for k in ("deep", "core", "rem", "unspecified"))
        assert told <= (row["asleep"] or 0) * (1 + 1e-9) + 1e-12, row


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(nights_of_every_form())
def test_read_12_10_the_server_and_the_tests_oracle_count_the_same_nights(points):
    """The tests' oracle (read_helpers: seconds as sets, a time line walked) and the server
    come to the same night, naps, hours and stages on every generated date: the figures the
    other sleep tests compare with are the rule's. (Fewer examples: the oracle counts
    seconds one by one, and a record kept running a day holds 86,400 of them.)"""
    days = {dt.date.fromordinal(day.date): day
            for day in healthlog.nights_of_points(points, healthlog.LOCAL_ZONE)}
    oracle = nights_by_date([p for p in points if "value" not in p],
                            [p for p in points if "value" in p])
    assert sorted(days) == sorted(oracle)
    for date, (night, *naps) in oracle.items():
        day = days[date]
        assert (day.night is None) == (night is None), date
        assert len(day.naps) == len(naps), date
        for got, want in ([(day.night, night)] if night else []) + list(zip(day.naps, naps)):
            assert (got.asleep is None) == (want.asleep is None), date
            if want.asleep is not None:
                assert math.isclose(got.asleep, want.asleep, rel_tol=1e-9, abs_tol=1e-9)
            assert set(got.stages) == set(want.stages), (date, got.stages, want.stages)
            for stage, hours in want.stages.items():
                assert math.isclose(got.stages[stage], hours, rel_tol=1e-9, abs_tol=1e-9), (
                    date, stage, got.stages, want.stages)
            assert (got.overlapping, got.counted, got.scaled) == (
                want.overlapping, want.counted, want.scaled), (date, got, want)
