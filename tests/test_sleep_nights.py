"""The night a person lived (READ-12.6 to 12.9, FRESH-5.3, FRESH-6.7): bodies shaped as real
ones that the earlier rule turned into nights nobody lived, read through the API, the day and
week CSV, ``healthlog export`` (CSV and SQLite), the summary and the coverage calendar, and
in Chromium on the summary page and the metric view, where the numbers a person reads are
compared with this file's own figures.

A New York phone's year of 2025, one nightly record a night (HAE >= 6.6.2 with a Watch,
``date`` the sleep start the evening before), with weeks of 4, 6 and 7 nights, the 4-night
weeks of longer nights (so that a mean of the weeks' means is not the mean of the nights).
In it, the shapes the evidence showed:

* 01-15: AutoSleep's 8.0 h beside the Watch's 6.1 h (totalSleep 14.1 h) in 8.25 h in bed,
  the window stretched to 15:20 that afternoon; its ``source`` names AutoSleep, the Watch
  and the iPhone;
* 02-10 (a Monday): no night, two afternoon naps back to back, 15:59-17:28 and 17:28-18:26;
* 02-20: an old record, ``asleep`` alone (no stage told apart);
* 02-23 and 02-24: records that touch: 21:57 -> 17:36 the next afternoon (9.23 h), then
  17:36 -> 05:29 (7.35 h, of which 1.48 h unspecified), with the Watch's stage records of
  that second night sent by another automation (the first from 22:40);
* 03-15 and 03-16: a 46-minute nap 16:53-17:39 on a day with its night, then a night record
  whose window starts at 17:39 (its in-bed start says 23:10), no stage records;
* 04-13: a night whose window starts at 22:00 two days before (04-12 has no night);
* 10-05: Sleep++ alone: 9.5 h of unspecified sleep between 23:30 and 06:30;
* 12-07: Eight Sleep alone, its stages written twice: deep 4 h 10, core 15 h 33, REM 7 h 16,
  awake 10 h 12 between 21:52 and 10:16.

The figures are this file's own (:func:`nights`): a small reading of the rule in its words,
from the records as posted. The automations are named with hyphens, received on four days,
and judged five days later: the nightly one is late, and its line at the top of the summary
page is read at 360 px.
"""

import csv
import datetime as dt
import io
import math
import random
import sqlite3
import statistics

import pytest

import hae_factory as hf
from conftest import Clock, run_export
from dashboard_browser import Session, serving
from read_helpers import get, get_json, hours_between, local_iso, nights_by_date, written

# Its service and browser live for the module: nothing may be left running after it.
pytestmark = pytest.mark.module_lifetime

PHONE = hf.Phone(zone=hf.NEW_YORK, sources="single")
YEAR = [dt.date(2025, 1, 1) + dt.timedelta(days=k) for k in range(365)]
WATCH = "Ana’s Apple Watch|Ana’s iPhone"
NIGHTLY = hf.Automation("sleep-nightly", "Days", "Since Last Sync")
RECORDS = hf.Automation("sleep-records", "Minutes", "Since Last Sync")
AUTOSLEEP, NAPS_ONLY, OLD_FORM = dt.date(2025, 1, 15), dt.date(2025, 2, 10), dt.date(2025, 2, 20)
TOUCH = (dt.date(2025, 2, 23), dt.date(2025, 2, 24))
NAP_DAY, AFTER_NAP = dt.date(2025, 3, 15), dt.date(2025, 3, 16)
LONG_WINDOW, SLEEP_PP, EIGHT = dt.date(2025, 4, 13), dt.date(2025, 10, 5), dt.date(2025, 12, 7)
EXTRA_CANARIES = ("AutoSleep", "Eight Sleep", "Sleep++", "Ana")


def ny_time(day: dt.date, hour: int, minute: int) -> str:
    """The phone's wall time as HAE writes it (the offset New York had then)."""
    return PHONE.time(dt.datetime(day.year, day.month, day.day, hour, minute))


def before(day: dt.date, days: int = 1) -> dt.date:
    return day - dt.timedelta(days=days)


# -- the bodies --------------------------------------------------------------------------------

def kept_nights(week_number: int) -> set:
    """Weekdays (Monday 0) with a night, by the week of the year: 4, 6 or 7 nights."""
    return {0: {0, 2, 4, 6}, 1: {0, 1, 2, 3, 4, 5}}.get(week_number % 3, set(range(7)))


def watch_night(wake: dt.date) -> dict:
    """An ordinary night of the Watch, ending on ``wake``: longer in the weeks of 4 nights."""
    rng = random.Random("issue-34-%s" % wake)
    start = ny_time(before(wake), 22, rng.randint(0, 59))
    end = ny_time(wake, 6, rng.randint(0, 59))
    extra = 1.0 if wake.isocalendar()[1] % 3 == 0 else 0.0
    deep, rem = round(rng.uniform(0.8, 1.5), 4), round(rng.uniform(1.0, 1.8), 4)
    core = round(rng.uniform(3.2, 4.2) + extra, 4)
    bed_from, bed_to = ny_time(before(wake), 21, 50), ny_time(wake, 7, 20)
    return {"date": start, "totalSleep": core + deep + rem, "asleep": 0, "core": core,
            "deep": deep, "rem": rem, "awake": 0.25, "inBed": hours_between(bed_from, bed_to),
            "inBedStart": bed_from, "inBedEnd": bed_to, "sleepStart": start, "sleepEnd": end,
            "source": WATCH}


def nightly_record(start: str, end: str, total: float = None, *, asleep: float = 0.0, core=0.0,
                   deep=0.0, rem=0.0, awake=0.0, in_bed: float = 0.0, bed=None,
                   source=WATCH) -> dict:
    """A nightly record as HAE >= 6.6.2 writes it (``date`` the sleep start)."""
    row = {"date": start, "totalSleep": asleep + core + deep + rem if total is None else total,
           "asleep": asleep, "core": core, "deep": deep, "rem": rem, "awake": awake,
           "inBed": in_bed, "sleepStart": start, "sleepEnd": end, "source": source}
    if bed:
        row.update(inBedStart=bed[0], inBedEnd=bed[1])
    return row


def special() -> dict:
    """wake day -> the records the evidence's shapes are made of (a day of naps only: its
    naps; 04-12: none)."""
    d = {}
    d[AUTOSLEEP] = [nightly_record(ny_time(before(AUTOSLEEP), 23, 40), ny_time(AUTOSLEEP, 15, 20),
                                   14.1,
                                   asleep=8.0, core=3.9, deep=1.0, rem=1.2, awake=0.4, in_bed=8.25,
                                   bed=(ny_time(before(AUTOSLEEP), 23, 30), ny_time(AUTOSLEEP, 7,
                                                                                    45)),
                                   source="AutoSleep|Nam’s Apple Watch|iPhone")]
    d[NAPS_ONLY] = [nightly_record(ny_time(NAPS_ONLY, 15, 59), ny_time(NAPS_ONLY, 17, 28),
                                   core=0.8, deep=0.4,
                                   rem=0.15),
                    nightly_record(ny_time(NAPS_ONLY, 17, 28), ny_time(NAPS_ONLY, 18, 26),
                                   core=0.5, deep=0.3,
                                   rem=0.1)]
    old = {"date": ny_time(OLD_FORM, 6, 40), "asleep": 6.9, "sleepStart": ny_time(before(OLD_FORM),
                                                                                  23, 5),
           "sleepEnd": ny_time(OLD_FORM, 6, 40), "sleepSource": "Ana’s Apple Watch", "inBed": 7.75,
           "inBedStart": ny_time(before(OLD_FORM), 22, 50), "inBedEnd": ny_time(OLD_FORM, 6, 35),
           "inBedSource": "Ana’s iPhone"}
    old["inBed"] = hours_between(old["inBedStart"], old["inBedEnd"])
    d[OLD_FORM] = [old]
    d[TOUCH[0]] = [nightly_record(ny_time(before(TOUCH[0]), 21, 57), ny_time(TOUCH[0], 17, 36),
                                  core=6.0,
                                  deep=1.5, rem=1.73, awake=0.2)]
    d[TOUCH[1]] = [nightly_record(ny_time(TOUCH[0], 17, 36), ny_time(TOUCH[1], 5, 29), asleep=1.48,
                                  core=3.87,
                                  deep=1.0, rem=1.0, awake=0.3)]
    nap = nightly_record(ny_time(NAP_DAY, 16, 53), ny_time(NAP_DAY, 17, 39), core=0.45, deep=0.1,
                         rem=0.15)
    d[NAP_DAY] = [watch_night(NAP_DAY), nap]
    d[AFTER_NAP] = [nightly_record(ny_time(NAP_DAY, 17, 39), ny_time(AFTER_NAP, 6, 50), core=4.5,
                                   deep=1.2,
                                   rem=1.3, awake=0.3, in_bed=7.75,
                                   bed=(ny_time(NAP_DAY, 23, 10), ny_time(AFTER_NAP, 6, 55)))]
    d[before(LONG_WINDOW)] = []
    d[LONG_WINDOW] = [nightly_record(ny_time(before(LONG_WINDOW, 2), 22, 0), ny_time(LONG_WINDOW,
                                                                                     7, 0),
                                     core=5.0, deep=1.4, rem=1.6, awake=0.4)]
    d[SLEEP_PP] = [nightly_record(ny_time(before(SLEEP_PP), 23, 30), ny_time(SLEEP_PP, 6, 30),
                                  asleep=9.5,
                                  source="Sleep++")]
    d[EIGHT] = [nightly_record(ny_time(before(EIGHT), 21, 52), ny_time(EIGHT, 10, 16),
                               deep=4 + 10 / 60,
                               core=15 + 33 / 60, rem=7 + 16 / 60, awake=10.2,
                               source="Eight Sleep")]
    return d


def stage_records() -> list:
    """The Watch's stage records of the night to 02-24, sent by another automation: from
    22:40, after the first record's window had ended at 17:36."""
    day, wake = TOUCH
    spans = ((day, 22, 40, day, 23, 55, "Core"), (day, 23, 55, wake, 0, 50, "Deep"),
             (wake, 0, 50, wake, 2, 30, "Core"), (wake, 2, 30, wake, 3, 30, "REM"),
             (wake, 3, 30, wake, 5, 29, "Core"))
    rows = []
    for d0, h0, m0, d1, h1, m1, value in spans:
        first, last = ny_time(d0, h0, m0), ny_time(d1, h1, m1)
        rows.append({"startDate": first, "endDate": last, "qty": hours_between(first, last),
                     "value": value, "source": "Ana’s Apple Watch"})
    return rows


def nightly_records() -> list:
    shapes = special()
    rows = []
    for wake in YEAR:
        if wake in shapes:
            rows += shapes[wake]
        elif wake.weekday() in kept_nights(wake.isocalendar()[1]):
            rows.append(watch_night(wake))
    return rows


NIGHTLY_ROWS = nightly_records()
STAGE_ROWS = stage_records()


# -- the figures, in this file's words ---------------------------------------------------------

def hours_of(record: dict) -> dict:
    """One nightly record as the rule reads it: a night of its own (never joined to another
    record), its hours HAE's total unless that passes the most the record allows (its window,
    its own hours in bed, a day); then the Watch-or-app's staged hours, else its unspecified
    ones, never more than that most; the stages shown are what counted."""
    end_text = record.get("sleepEnd") or record.get("inBedEnd") or record["date"]
    start_text = record.get("sleepStart") or record.get("inBedStart")
    told = {k: record[k] for k in ("deep", "core", "rem") if record.get(k, 0) > 0}
    unspecified = record.get("asleep", 0)
    said = record.get("totalSleep") or (unspecified + sum(told.values())) or None
    bounds = [(24.0, "day")]
    if record.get("inBed", 0) > 0:
        bounds.append((record["inBed"], "in_bed"))
    if start_text:
        bounds.append((hours_between(start_text, end_text), "window"))
    most, bound = min(bounds)
    overlapping = said > most + 1 / 3600
    if not overlapping:
        counted, figure = "total", said
        shown = dict(told, **({"asleep": unspecified} if told and unspecified else {}))
    elif told:
        counted, figure, shown = "staged", sum(told.values()), dict(told)
    else:
        counted, figure, shown = "unspecified", unspecified or said, {}
    asleep = min(figure, most)
    in_bed = record.get("inBed") or None
    if in_bed and record.get("inBedStart"):
        bed_window = hours_between(record["inBedStart"], record["inBedEnd"])
        overlapping = overlapping or in_bed > bed_window + 1 / 3600
        in_bed = min(in_bed, bed_window)
    share = asleep / figure
    stages = {k: v * share for k, v in shown.items()}
    if shown and record.get("awake"):
        awake = record["awake"] * share
        if overlapping:  # awake fits in what the most leaves beside the hours asleep
            awake = min(awake, most - asleep)
        if awake > 0:
            stages["awake"] = awake
    return {"date": written(end_text).date(), "start": start_text, "end": end_text,
            "asleep": asleep, "in_bed": in_bed, "stages": stages, "overlapping": overlapping,
            "counted": counted, "said": said, "limit": most, "limit_by": bound,
            "scaled": overlapping and bool(shown) and figure > most + 1 / 3600,
            "sources": [s for s in record.get("source", "").split("|") if s]}


def is_nap_as_written(night: dict) -> bool:
    """Under 3 h asleep, from and to between 10:00 and 20:00 of one day, as written."""
    first, last = written(night["start"]), written(night["end"])
    return (night["asleep"] < 3 and first.date() == last.date()
            and first.time() >= dt.time(10) and last.time() <= dt.time(20))


def nights() -> dict:
    """wake day -> {"night": its night or None, "naps": [...]}: every record a sleep of its
    own; one that starts where another ended shows the first start of the stage records in
    its window as its bedtime, else none; the day's night is its longest sleep that is no
    nap."""
    ends = {r.get("sleepEnd") for r in NIGHTLY_ROWS}
    by_day: dict = {}
    for row in NIGHTLY_ROWS:
        night = hours_of(row)
        night["window_start"] = night["start"]
        if night["start"] in ends:
            inside = [r["startDate"] for r in STAGE_ROWS
                      if written(night["start"]) <= written(r["startDate"])
                      and written(r["endDate"]) <= written(night["end"])]
            night["start"] = min(inside, key=written) if inside else None
        by_day.setdefault(night["date"], []).append(night)
    out = {}
    for day, sleeps in sorted(by_day.items()):
        candidates = [s for s in sleeps if not is_nap_as_written(dict(s, start=s["window_start"]))]
        night = max(candidates, key=lambda s: (s["asleep"], s["in_bed"] or 0)) \
            if candidates else None
        out[day] = {"night": night, "naps": sorted((s for s in sleeps if s is not night),
                                                   key=lambda s: written(s["end"]))}
    return out


NIGHTS = nights()


def mean(values):
    return math.fsum(values) / len(values)


# -- the store -------------------------------------------------------------------------------

def deliveries():
    """The nightly records in four bodies (a quarter each), on four days at 08:00 New York
    time; the stage records with the second."""
    quarters = [[r for r in NIGHTLY_ROWS if (written(r.get("sleepEnd") or r["date"]).month - 1)
                 // 3 == q] for q in range(4)]
    out = []
    for q, rows in enumerate(quarters):
        out.append((NIGHTLY, hf.dumps_hae(hf.envelope(metrics=[
            hf.metric("sleep_analysis", rows, "hr")]))))
        if q == 1:
            out.append((RECORDS, hf.dumps_hae(hf.envelope(metrics=[
                hf.metric("sleep_analysis", STAGE_ROWS, "hr")]))))
    return out


RECEIVED = [hf.zoned_epoch("America/New_York", dt.datetime(2026, 1, d, 8, minute))
            for d, minute in ((1, 0), (2, 0), (2, 5), (3, 0), (4, 0))]
"""When each delivery arrives: four days in a row (the records on the second)."""
JUDGED = hf.zoned_epoch("America/New_York", dt.datetime(2026, 1, 9, 12, 0))
"""When the page is read: five days after the last delivery, the nightly automation late."""


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """A real in-process server whose clock the test sets: each delivery received at its
    time through /api/ingest, folded, then the clock moved to when the page is read."""
    clock = Clock(RECEIVED[0])
    with serving(tmp_path_factory.mktemp("sleep-nights") / "data",
                 [(automation, body, at) for at, (automation, body) in zip(RECEIVED, deliveries())],
                 clock=clock) as running:
        clock.now = JUDGED
        yield running


def export_output(store, *args) -> bytes:
    """``healthlog export --data STORE ARGS``'s output; the command must succeed."""
    result = run_export("--data", store.data_dir, *args, extra_canaries=EXTRA_CANARIES)
    assert result.returncode == 0, result.stderr
    return result.stdout


@pytest.fixture(scope="module")
def exported(store, tmp_path_factory):
    """The year as day CSV from the route and from ``healthlog export``, and the SQLite
    export's ``nights`` rows."""
    query = dict(metric="sleep_analysis", bucket="day", format="csv", from_="2025-01-01",
                 to="2025-12-31")
    route = get(store.address, "/api/points", **query)
    assert route.status == 200
    command = export_output(store, *["--%s=%s" % (k.rstrip("_"), v) for k, v in query.items()])
    out = tmp_path_factory.mktemp("sleep-nights-export") / "export.sqlite"
    export_output(store, "--format", "sqlite", out)
    with sqlite3.connect(str(out)) as conn:
        conn.row_factory = sqlite3.Row
        rows = [dict(r) for r in conn.execute("SELECT * FROM nights ORDER BY date, \"end\"")]
    return {"route": route.body, "command": command, "sqlite": rows}


def day_items(store, first: dt.date, last: dt.date) -> dict:
    reply = get_json(store.address, "/api/points", metric="sleep_analysis", bucket="day",
                     from_=first.isoformat(), to=last.isoformat())
    return {dt.date.fromisoformat(item["date"]): item for item in reply["nights"]}


# -- the API, the CSVs and SQLite --------------------------------------------------------------

def assert_day(item: dict, day: dt.date) -> None:
    """A day item against this file's night and naps of that day."""
    want = NIGHTS[day]
    night = want["night"]
    assert item["nights"] == (night is not None), (day, item)
    assert item["count"] == (night is not None) + len(want["naps"]), (day, item)
    if night is None:
        assert (item["asleep"], item["in_bed"], item["stages"], item["sleep_start"],
                item["sleep_end"]) == (None, None, {}, None, None), (day, item)
    else:
        assert item["asleep"] == pytest.approx(night["asleep"], abs=1e-9), (day, item)
        assert item["in_bed"] == pytest.approx(night["in_bed"], abs=1e-9), (day, item)
        assert item["stages"] == pytest.approx(night["stages"], abs=1e-9), (day, item)
        assert (item["sleep_start"], item["sleep_end"]) == (local_iso(night["start"]),
                                                            local_iso(night["end"])), day
        assert (item["overlapping"], item["counted"], item["limit_by"], item["scaled"],
                item["sources"]) == (night["overlapping"], night["counted"], night["limit_by"],
                                     night["scaled"], night["sources"]), (day, item)
        assert item["said"] == pytest.approx(night["said"], abs=1e-9)
        assert item["limit"] == pytest.approx(night["limit"], abs=1e-9)
        sleep = sum(h for k, h in item["stages"].items() if k != "awake")
        assert sleep <= item["asleep"] + 1e-9, (day, "stages past the night", item)
    assert [(n["sleep_start"], n["sleep_end"]) for n in item["naps"]] == [
        (local_iso(n["start"]), local_iso(n["end"])) for n in want["naps"]], day
    assert [n["asleep"] for n in item["naps"]] == pytest.approx(
        [n["asleep"] for n in want["naps"]], abs=1e-9)


def test_read_12_6_the_figures_here_are_the_tests_oracles_too():
    """read_helpers' oracle, which the other sleep tests lean on, comes to this file's
    figures on every day of the year."""
    oracle = nights_by_date(NIGHTLY_ROWS, STAGE_ROWS)
    assert sorted(oracle) == sorted(NIGHTS)
    for day, (night, *naps) in oracle.items():
        want = NIGHTS[day]
        assert (night is None) == (want["night"] is None), day
        if night is not None:
            assert night.asleep == pytest.approx(want["night"]["asleep"], abs=1e-9), day
            assert night.stages == pytest.approx(want["night"]["stages"], abs=1e-9), day
            assert night.counted == want["night"]["counted"], day
        assert len(naps) == len(want["naps"]), day


def test_read_12_6_records_that_touch_are_two_nights_on_their_own_mornings(store):
    items = day_items(store, dt.date(2025, 2, 17), dt.date(2025, 3, 23))
    for day in items:
        assert_day(items[day], day)
    first, second = items[TOUCH[0]], items[TOUCH[1]]
    # never one "night" of 16 h 35 min on the 24th with a bedtime two days before it
    assert first["asleep"] == pytest.approx(9.23) and second["asleep"] == pytest.approx(7.35)
    assert first["overlapping"] is second["overlapping"] is False
    # the second starts where the first ended: its bedtime is its stage records' first start
    assert second["sleep_start"] == "2025-02-23T22:40:00-05:00"
    # the 1.48 h the Watch left unstaged are the stage "asleep, no stage"
    assert second["stages"]["asleep"] == pytest.approx(1.48)
    # the nap stays a nap beside the 15th's own night; the night after it has no bedtime
    nap_day, after = items[NAP_DAY], items[AFTER_NAP]
    assert [(n["sleep_start"], n["sleep_end"]) for n in nap_day["naps"]] == [
        ("2025-03-15T16:53:00-04:00", "2025-03-15T17:39:00-04:00")]
    assert nap_day["asleep"] == pytest.approx(NIGHTS[NAP_DAY]["night"]["asleep"])
    assert after["sleep_start"] is None and after["asleep"] == pytest.approx(7.0)
    weeks = get_json(store.address, "/api/points", metric="sleep_analysis", bucket="week",
                     from_="2025-02-17", to="2025-03-02")["nights"]
    for week in weeks:
        monday = dt.date.fromisoformat(week["date"])
        days = [monday + dt.timedelta(days=k) for k in range(7)]
        counted = [NIGHTS[d]["night"]["asleep"] for d in days
                   if d in NIGHTS and NIGHTS[d]["night"]]
        assert week["nights"] == len(counted)
        assert week["asleep"] == pytest.approx(mean(counted), abs=1e-9)


def test_read_12_7_overlap_is_seen_by_every_bound_and_counts_what_it_says(store):
    for day, counted, hours in ((AUTOSLEEP, "staged", 6.1), (EIGHT, "staged", 12.4),
                                (SLEEP_PP, "unspecified", 7.0)):
        [item] = day_items(store, day, day).values()
        assert_day(item, day)
        assert item["overlapping"] is True and item["counted"] == counted
        assert item["asleep"] == pytest.approx(hours)
    [autosleep] = day_items(store, AUTOSLEEP, AUTOSLEEP).values()
    # the window (15 h 40 min) hid it; the record's own 8.25 h in bed did not
    assert autosleep["limit_by"] == "in_bed" and autosleep["said"] == pytest.approx(14.1)
    assert set(autosleep["stages"]) == {"deep", "core", "rem", "awake"}  # AutoSleep's left out
    [eight] = day_items(store, EIGHT, EIGHT).values()
    assert eight["scaled"] is True and "awake" not in eight["stages"]
    assert sum(eight["stages"].values()) == pytest.approx(12.4)
    assert eight["stages"]["core"] / eight["stages"]["deep"] == pytest.approx(
        (15 + 33 / 60) / (4 + 10 / 60))
    assert eight["sources"] == ["Eight Sleep"]
    [alone] = day_items(store, SLEEP_PP, SLEEP_PP).values()
    assert alone["stages"] == {} and alone["sources"] == ["Sleep++"]


def test_read_12_8_a_day_of_naps_has_no_night_and_its_week_and_usual_skip_it(store):
    [item] = day_items(store, NAPS_ONLY, NAPS_ONLY).values()
    assert_day(item, NAPS_ONLY)
    assert item["nights"] == 0 and len(item["naps"]) == 2
    assert item["naps"][1]["sleep_start"] is None  # the second starts at the first's end
    [week] = get_json(store.address, "/api/points", metric="sleep_analysis", bucket="week",
                      from_=NAPS_ONLY.isoformat(), to="2025-02-16")["nights"]
    nights_of_week = [NIGHTS[d]["night"]["asleep"] for d in NIGHTS
                      if NAPS_ONLY <= d <= dt.date(2025, 2, 16) and NIGHTS[d]["night"]]
    assert (week["nights"], len(week["naps"])) == (len(nights_of_week), 2)
    assert week["asleep"] == pytest.approx(mean(nights_of_week), abs=1e-9)
    card = get_json(store.address, "/api/summary", date=NAPS_ONLY.isoformat())["cards"]["sleep"]
    assert (card["nights"], card["asleep"], len(card["naps"])) == (0, None, 2)
    later = dt.date(2025, 2, 12)
    card = get_json(store.address, "/api/summary", date=later.isoformat())["cards"]["sleep"]
    usual = [NIGHTS[d]["night"]["asleep"] for d in NIGHTS
             if later - dt.timedelta(days=30) <= d < later and NIGHTS[d]["night"]]
    assert card["usual_days"] == len(usual)
    assert card["usual"] == pytest.approx(statistics.median(usual), abs=1e-9)


def test_read_12_9_the_average_night_is_the_mean_of_the_nights(store):
    plan = get_json(store.address, "/api/plan", metric="sleep_analysis", range="1y")
    assert plan["bucket"] == "week"
    first, last = dt.date.fromisoformat(plan["from"]), dt.date.fromisoformat(plan["to"])
    reply = get_json(store.address, "/api/points", metric="sleep_analysis", bucket="week",
                     from_=plan["from"], to=plan["to"])
    counted = {d: v["night"] for d, v in NIGHTS.items() if first <= d <= last and v["night"]}
    weeks: dict = {}
    for day, night in counted.items():
        weeks.setdefault(day - dt.timedelta(days=day.weekday()), []).append(night["asleep"])
    assert {dt.date.fromisoformat(w["date"]): (w["nights"], w["asleep"])
            for w in reply["nights"]} == {
        monday: (len(hours), pytest.approx(mean(hours), abs=1e-9))
        for monday, hours in weeks.items()}
    assert len({len(hours) for hours in weeks.values()}) >= 3  # weeks of 4, 6 and 7 nights
    average = mean([n["asleep"] for n in counted.values()])
    of_weeks = mean([mean(hours) for hours in weeks.values()])
    assert abs(average - of_weeks) > 2 / 60  # the corpus tells the two apart
    assert reply["average"]["nights"] == len(counted)
    assert reply["average"]["asleep"] == pytest.approx(average, abs=1e-9)


def test_read_12_6_to_12_8_the_csvs_and_sqlite_carry_each_night_as_counted(exported):
    assert exported["command"] == exported["route"]  # `healthlog export`: the route's bytes
    rows = list(csv.DictReader(io.StringIO(exported["route"].decode(), newline="")))
    assert [dt.date.fromisoformat(r["date"]) for r in rows] == sorted(NIGHTS)
    for row in rows:
        want = NIGHTS[dt.date.fromisoformat(row["date"])]
        night = want["night"]
        assert row["nights"] == str(int(night is not None)) and row["naps"] == str(
            len(want["naps"]))
        if night is None:
            assert row["asleep"] == row["sleep_start"] == row["counted"] == "", row
            continue
        assert float(row["asleep"]) == pytest.approx(night["asleep"], abs=1e-9)
        for stage, column in (("deep", "deep"), ("core", "core"), ("rem", "rem"),
                              ("asleep", "unspecified"), ("awake", "awake")):
            cell = row[column]
            assert (cell == "") == (stage not in night["stages"]), (row["date"], stage)
            assert float(cell or 0) == pytest.approx(night["stages"].get(stage, 0), abs=1e-9)
        assert (row["counted"], row["scaled"], row["overlapping"]) == (
            night["counted"], str(int(night["scaled"])), str(int(night["overlapping"])))
        assert row["sleep_start"] == (local_iso(night["start"]) or "")
    by_kind = {}
    for row in exported["sqlite"]:
        by_kind.setdefault(row["kind"], []).append(row)
    nights_rows = {dt.date.fromisoformat(r["date"]): r for r in by_kind["night"]}
    assert sorted(nights_rows) == sorted(d for d, v in NIGHTS.items() if v["night"])
    for day, row in nights_rows.items():
        night = NIGHTS[day]["night"]
        assert row["asleep"] == pytest.approx(night["asleep"], abs=1e-9)
        assert row["unspecified"] == pytest.approx(night["stages"].get("asleep"), abs=1e-9)
        for stage in ("deep", "core", "rem", "awake"):
            assert row[stage] == pytest.approx(night["stages"].get(stage), abs=1e-9), day
        sleep = sum(row[k] or 0 for k in ("deep", "core", "rem", "unspecified"))
        assert sleep <= row["asleep"] + 1e-9, (day, row)
        assert (row["counted"], row["scaled"], row["overlapping"], row["sleep_start"]) == (
            night["counted"], int(night["scaled"]), int(night["overlapping"]),
            local_iso(night["start"]))
    assert nights_rows[TOUCH[1]]["unspecified"] == pytest.approx(1.48)
    naps = sorted((dt.date.fromisoformat(r["date"]), r["sleep_end"]) for r in by_kind["nap"])
    assert naps == sorted((d, local_iso(n["end"])) for d, v in NIGHTS.items() for n in v["naps"])


def test_fresh_5_3_the_calendar_counts_a_night_on_its_wake_day(store):
    """Each night began the evening before it ended (HAE's ``date`` says so): the sleep row
    has a night on each wake day and on no other, none on the day of naps only."""
    reply = get_json(store.address, "/api/coverage", from_="2025-02-01", to="2025-02-28")
    [row] = [r for r in reply["rows"] if r["metric"] == "sleep_analysis"]
    assert row["kind"] == "nights"
    days = [dt.date.fromisoformat(d) for d in reply["days"]]
    assert row["values"] == [d in NIGHTS and NIGHTS[d]["night"] is not None for d in days]
    assert row["states"][days.index(NAPS_ONLY)] == "missing"
    assert row["states"][days.index(TOUCH[1])] == "ok"


# -- the page --------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def page(browser, store):
    """One signed-in desktop page for the module's tests (one sign-in, views by address)."""
    s = Session(browser, store, timezone="Europe/Paris", width=1280, height=900)
    s.sign_in()
    yield s
    s.close()


def shown_hours(hours: float) -> str:
    """Hours as the page writes them: ``7 h 21 min``, ``45 min``."""
    minutes = int(hours * 60 + 0.5)
    return "%d min" % minutes if minutes < 60 else "%d h %02d min" % divmod(minutes, 60)


CARD = """() => { const c = document.querySelector('#cards .sleep-card');
  return c && {value: c.querySelector('.card-value').textContent,
    facts: Array.from(c.querySelectorAll('.fact')).map(f => f.textContent),
    notes: Array.from(c.querySelectorAll('.card-note')).map(
      n => [n.dataset.field, n.textContent]),
    chips: Array.from(c.querySelectorAll('.stage-chip')).map(
      s => [s.dataset.stage, s.textContent])}; }"""


def summary_card(page, day: dt.date) -> dict:
    page.evaluate("""h => { document.getElementById('summary').dataset.state = 'stale';
        location.hash = h; }""", "#view=summary&date=%s" % day.isoformat())
    page.wait_for_selector('#summary[data-state="ready"][data-date="%s"]' % day.isoformat())
    return page.evaluate(CARD)


def assert_card(card: dict, day: dt.date) -> None:
    """The sleep card reads as this file's night: hours asleep, each stage chip (its label
    and hours), bed and wake, the words of an overlap, the naps."""
    night = NIGHTS[day]["night"]
    assert card["value"].startswith(shown_hours(night["asleep"])), (day, card)
    labels = {"asleep": "asleep, no stage"}
    assert card["chips"] == [[k, "%s %s" % (labels.get(k, k), shown_hours(h))]
                             for k, h in sorted(night["stages"].items(), key=lambda kv: (
                                 "deep", "core", "rem", "asleep", "awake").index(kv[0]))]
    bed = written(night["start"]) if night["start"] else None
    wake = written(night["end"])
    assert ("bed " + bed.strftime("%H:%M") if bed and (wake.date() - bed.date()).days <= 1
            else "bed " + bed.strftime("%b %-d %H:%M") if bed
            else "bedtime not known") in card["facts"], (day, card["facts"])
    assert "wake " + wake.strftime("%H:%M") in card["facts"]
    notes = dict(card["notes"])
    assert ("overlapping" in notes) == night["overlapping"], (day, notes)
    if night["overlapping"]:
        words = notes["overlapping"]
        for source in night["sources"]:
            assert source in words, (day, words)
        if not any("Watch" in s for s in night["sources"]):
            assert "Watch" not in words, (day, words)
        assert "wrote %s" % shown_hours(night["said"]) in words
        assert shown_hours(night["asleep"]) in words


def test_read_12_6_the_summary_page_reads_each_night_as_counted(page):
    for day in (TOUCH[0], TOUCH[1], OLD_FORM, NAP_DAY, AFTER_NAP, LONG_WINDOW):
        assert_card(summary_card(page.page, day), day)
    card = summary_card(page.page, NAP_DAY)
    assert [text for field, text in card["notes"] if field == "nap"] == [
        "Nap 16:53–17:39 %s (not counted in the night)" % shown_hours(
            NIGHTS[NAP_DAY]["naps"][0]["asleep"])]


def test_read_12_7_the_summary_page_says_what_an_overlap_counted(page):
    for day in (AUTOSLEEP, EIGHT, SLEEP_PP):
        assert_card(summary_card(page.page, day), day)
    notes = dict(summary_card(page.page, EIGHT)["notes"])
    assert "scaled to their shares" in notes["overlapping"]


def test_read_12_8_the_summary_page_says_a_day_of_naps_has_no_night(page):
    card = summary_card(page.page, NAPS_ONLY)
    assert card["value"] == "no data" and card["chips"] == []
    notes = card["notes"]
    assert [f for f, _ in notes] == ["no-night", "nap", "nap"]
    assert notes[1][1].startswith("Nap 15:59–17:28 %s" % shown_hours(1.35))
    assert notes[2][1].startswith("Nap until 18:26 %s" % shown_hours(0.9))


def test_fresh_5_3_the_calendar_shows_a_night_on_its_wake_day(page):
    """The summary page's calendar (the 28 days to the server's day, 2026-01-09): the sleep
    row has a night on each day this file ends one on, and says so in words."""
    summary_card(page.page, dt.date(2025, 12, 31))
    page.page.wait_for_selector('#coverage[data-state="ready"]')
    cells = page.page.evaluate("""() => Array.from(document.querySelectorAll(
        '.cov-row[data-metric="sleep_analysis"] .cov-cell')).map(c => [c.dataset.date,
        c.dataset.value, c.title])""")
    assert len(cells) == 28
    for date, value, title in cells:
        day = dt.date.fromisoformat(date)
        night = day in NIGHTS and NIGHTS[day]["night"] is not None
        assert value == str(night).lower(), (date, value)
        assert title.endswith(": a night ended" if night else ": no night ended (missing)"
                              if day < dt.date(2026, 1, 9) else ""), (date, title)


BARS = """() => Array.from(document.querySelectorAll('#chart .night')).map(n => ({
  date: n.dataset.date, asleep: n.dataset.asleep,
  parts: Array.from(n.querySelectorAll('rect[data-stage]')).map(
    r => [r.dataset.stage, parseFloat(r.dataset.hours)])}))"""


def readout(page, day: dt.date) -> str:
    page.focus('#chart .night[data-date="%s"]' % day.isoformat())
    return page.inner_text("#readout")


STAGE_LABELS = {"asleep": "asleep, no stage"}
"""How the page names a stage that is no word of its own."""


def assert_readout(view, day: dt.date) -> None:
    """What a person reads pointing at a night: its hours asleep, each stage's hours by its
    label, bed and wake (or that the bedtime is not known; its date when it is days
    earlier), the words of an overlap naming its sources alone, each nap; a day of naps
    only says it has no night."""
    text = readout(view, day)
    night = NIGHTS[day]["night"]
    for nap in NIGHTS[day]["naps"]:
        times = ("%s–%s" % (written(nap["start"]).strftime("%H:%M"),
                            written(nap["end"]).strftime("%H:%M")) if nap["start"]
                 else "until " + written(nap["end"]).strftime("%H:%M"))
        assert "nap %s %s, not counted" % (times, shown_hours(nap["asleep"])) in text, (day, text)
    if night is None:
        assert "no night, naps only" in text and "asleep " not in text, (day, text)
        return
    assert "asleep %s" % shown_hours(night["asleep"]) in text, (day, text)
    for stage, hours in night["stages"].items():
        assert "%s %s" % (STAGE_LABELS.get(stage, stage), shown_hours(hours)) in text, (day, text)
    bed, wake = (written(night["start"]) if night["start"] else None), written(night["end"])
    assert "%s, wake %s" % ("bedtime not known" if bed is None else "bed " + (
        bed.strftime("%b %-d %H:%M") if (wake.date() - bed.date()).days > 1
        else bed.strftime("%H:%M")), wake.strftime("%H:%M")) in text, (day, text)
    assert ("Sources overlap: " in text) == night["overlapping"], (day, text)
    if night["overlapping"]:
        assert "Sources overlap: %s wrote %s" % (
            " and ".join([", ".join(night["sources"][:-1]), night["sources"][-1]]
                         if len(night["sources"]) > 1 else night["sources"]),
            shown_hours(night["said"])) in text, (day, text)
        if not any("Watch" in source for source in night["sources"]):
            assert "Watch" not in text, (day, text)


RANGES = (("2025-01-10", "2025-01-16"), ("2025-02-08", "2025-02-26"),
          ("2025-03-13", "2025-03-17"), ("2025-04-10", "2025-04-14"),
          ("2025-10-03", "2025-10-06"), ("2025-12-01", "2025-12-10"))
"""The metric view's ranges that hold the evidence's nights, by day."""


def test_read_12_6_to_12_8_the_metric_view_stacks_each_night_as_counted(page):
    for first, last in RANGES:
        view = page.open(metric="sleep_analysis", range="custom", tz="local",
                         **{"from": first, "to": last})
        bars = {dt.date.fromisoformat(b["date"]): b for b in view.evaluate(BARS)}
        assert sorted(bars) == sorted(d for d in NIGHTS if dt.date.fromisoformat(first) <= d
                                      <= dt.date.fromisoformat(last))
        for day, bar in bars.items():
            night = NIGHTS[day]["night"]
            if night is None:
                assert bar["parts"] == [], day
            elif night["stages"]:
                assert dict(bar["parts"]) == pytest.approx(night["stages"], abs=1e-6), day
            else:  # no stage hours: the hours asleep, drawn as the stage of sleep no
                # stage was given for (HealthKit's and HAE's plain "asleep")
                assert dict(bar["parts"]) == pytest.approx({"asleep": night["asleep"]},
                                                           abs=1e-6), day
            if night is not None:
                assert sum(h for k, h in bar["parts"] if k != "awake") <= night["asleep"] + 1e-6
            assert_readout(view, day)
        # the legend names each stage drawn once, by the sleep meaning's label: the hours
        # asleep without stage hours (02-20) and the Watch's unspecified 1.48 h (02-24) are
        # both "asleep, no stage", as the sleep rule names them
        nights = [NIGHTS[day]["night"] for day in bars if NIGHTS[day]["night"]]
        stages = {stage for n in nights for stage in n["stages"] or {"asleep": 0}}
        legend = view.eval_on_selector_all("#chart .legend-item",
                                           "is => is.map(i => i.textContent)")
        assert sorted(legend) == sorted(
            [STAGE_LABELS.get(stage, stage) for stage in stages]
            + (["in bed"] if any(n["in_bed"] is not None for n in nights) else [])), (
                first, legend)


def test_read_12_9_the_metric_view_reads_the_mean_of_the_nights(page, store):
    plan = get_json(store.address, "/api/plan", metric="sleep_analysis", range="1y")
    view = page.open(metric="sleep_analysis", range="1y", tz="local")
    first, last = dt.date.fromisoformat(plan["from"]), dt.date.fromisoformat(plan["to"])
    counted = [v["night"]["asleep"] for d, v in NIGHTS.items()
               if first <= d <= last and v["night"]]
    view.evaluate("() => document.activeElement && document.activeElement.blur()")
    text = view.inner_text("#readout")
    assert "%d nights · asleep %s a night on average" % (len(counted), shown_hours(mean(counted))) \
        in text, text


def test_fresh_6_7_a_phone_never_breaks_a_freshness_line_at_a_hyphen(browser, store):
    """At 360 px the line that says the nightly automation is late wraps between words, and
    never inside one with a hyphen ("2026-01-" / "09", "'sleep-" / "nightly'"): each such
    word is measured on one line (Range.getClientRects)."""
    s = Session(browser, store, timezone="America/New_York", width=360, height=780,
                phone=True)
    try:
        s.sign_in()
        words = s.page.evaluate("""() => Array.from(document.querySelectorAll(
            '#attention .attention-item p')).flatMap(p => {
          const out = [];
          const walk = document.createTreeWalker(p, NodeFilter.SHOW_TEXT);
          for (let t = walk.nextNode(); t; t = walk.nextNode()) {
            const re = /\\S*-\\S*/g;
            let m;
            while ((m = re.exec(t.data))) {
              const r = document.createRange();
              r.setStart(t, m.index);
              r.setEnd(t, m.index + m[0].length);
              const tops = new Set(Array.from(r.getClientRects()).map(x => Math.round(x.top)));
              out.push([m[0], tops.size]);
            }
          }
          return out; })""")
        lines = s.page.evaluate("""() => Array.from(document.querySelectorAll(
            '#attention .attention-item p')).map(p => Math.round(p.getBoundingClientRect().height
            / parseFloat(getComputedStyle(p).lineHeight)))""")
    finally:
        s.close()
    assert any("sleep-nightly" in w for w, _ in words), words
    assert any(w.startswith("2026-01-") for w, _ in words), words
    assert max(lines) >= 3  # the lines do wrap at this width
    assert [w for w, tops in words if tops != 1] == [], words
