"""READ-12.4: every real sleep form gives the night's true hours (openspec/specs/read/spec.md,
"A night belongs to the day it ends"), through a real server.

A New York phone's mornings of March 2025, each night in one of the forms HAE has really
sent, each posted as a body of its own:

* 03-03 ``totalSleep`` present (HAE >= 6.6.2 with a Watch, ``asleep: 0``);
* 03-04 stages beside a small unspecified ``asleep`` and no ``totalSleep``;
* 03-05 ``asleep`` only (the old summaries);
* 03-06 AutoSleep's ``asleep`` beside the Watch's stages: one night told twice, past its window;
* 03-07 Eight Sleep's night written twice: 27.0 h between 21:52 and 10:16;
* 03-08 a night, and two naps back to back in the afternoon (15:59-17:28, 17:28-18:26);
* 03-09 stage records with ``startDate``/``endDate`` across the change to daylight time, every
  record written twice in its body;
* 03-10 stage records with ``start``/``end``, the asleep ones written again 40 s later by the
  iPhone, and a nap of stage records in the afternoon;
* 03-11 a sleep app's records alone (unspecified ``Asleep`` blocks and ``In Bed``);
* 03-12 the evidence's night: the Watch's 6.14 + 1.18 + 1.32 h, AutoSleep's 7.9 h, ``totalSleep``
  their sum, in a window of 8.0 h.

Beside them, apart from March: a summary written twice across the March change of 2024 (a
window of 7 elapsed hours, 8 on the wall clock), HeartWatch's 82.7 h over three days, a sleep
app recording 28 h with no gap of 3 h, and a night re-sent in HealthKit's spellings.

Each night's figures are written here, in words, from how its body was built (`hand`); the
tests compare the server's day and week buckets (JSON and CSV) and each morning's summary card
with them, and check that the tests' oracle (read_helpers) comes to the same figures.
"""

from __future__ import annotations

import csv
import datetime as dt
import functools
import io
import json
import statistics

import pytest

import hae_factory as hf
from read_helpers import (assert_nights_equal, close, get, get_json, hours_between, local_iso,
                          night_items, nights_by_date, read_csv, serve_corpus, week_items, written)

SEED = 12
PHONE = hf.Phone(zone=hf.NEW_YORK, sources="single")
NY = "America/New_York"
MARCH = [dt.date(2025, 3, d) for d in range(3, 13)]
SLEEP = {"automation-name": "Sleep", "automation-aggregation": "Days"}
EXTRA_CANARIES = ("AutoSleep", "Eight Sleep", "HeartWatch")
STAGES = ("core", "deep", "rem", "awake")


def summary_night(row: dict, asleep: float, overlapping: bool = False, in_bed: float = None,
                  naps: tuple = (), stages: dict = None, counted: str = "total",
                  scaled: bool = False) -> dict:
    """A night read from one summary: its stages as written (unless ``stages`` says
    otherwise; the minutes the Watch left unstaged, HAE's ``asleep`` beside stages, are the
    stage "asleep"), its start and end its sleepStart and sleepEnd."""
    if stages is None:
        stages = {k: row[k] for k in STAGES if row.get(k)}
        if row.get("core") and row.get("asleep"):
            stages["asleep"] = row["asleep"]
    return {"form": "nightly", "asleep": asleep, "in_bed": row["inBed"] if in_bed is None
            else in_bed, "stages": stages, "overlapping": overlapping,
            "sleep_start": local_iso(row["sleepStart"]), "sleep_end": local_iso(row["sleepEnd"]),
            "naps": list(naps), "counted": counted, "scaled": scaled}


def records_night(rows: list, asleep: float, stages: dict, overlapping: bool = False,
                  naps: tuple = ()) -> dict:
    """A night read from stage records: from its first record's start to its last end."""
    first = min(rows, key=lambda r: written(r.get("start") or r["startDate"]))
    last = max(rows, key=lambda r: written(r.get("end") or r["endDate"]))
    in_bed = [r["qty"] for r in rows if r["value"] in ("In Bed", "InBed")]
    return {"form": "records", "asleep": asleep, "in_bed": in_bed[0] if in_bed else None,
            "stages": stages, "overlapping": overlapping,
            "sleep_start": local_iso(first.get("start") or first["startDate"]),
            "sleep_end": local_iso(last.get("end") or last["endDate"]), "naps": list(naps),
            "counted": "union", "scaled": asleep > 24 - 1e-9 and overlapping}


def qty(rows: list, *values: str) -> float:
    return sum(r["qty"] for r in rows if r["value"] in values)


# ---------------------------------------------------------------------------------------------
# The bodies, and what each night must read (in the test's own words)

def build() -> dict:
    """{"bodies": [rows of one body, …], "points": every sleep row posted, "hand": morning
    -> the night's figures, "apart": name -> (rows, figures) of the nights beside March}."""
    bodies, hand = [], {}
    # 03-03: totalSleep present: the night is totalSleep (not the asleep: 0 beside it).
    [c] = hf.sleep_summaries(SEED, MARCH[0], phone=PHONE, form="c", date_as="wake")
    bodies += [[c]]
    hand[MARCH[0]] = summary_night(c, c["totalSleep"])

    # 03-04: stages beside the unspecified minutes in asleep, no totalSleep: the night is the
    # unspecified minutes and the stages added up, which is what the Watch's segments of the
    # night (the same truth) hold; asleep alone would be minutes. Those minutes are a stage
    # of their own ("asleep, no stage") beside core, deep and REM.
    [b] = hf.sleep_summaries(SEED, MARCH[1], phone=PHONE, form="b", date_as="start")
    truth = hf.sleep_segments(SEED, MARCH[1], phone=PHONE)
    assert "totalSleep" not in b and b["asleep"] < 1
    asleep = b["asleep"] + b["core"] + b["deep"] + b["rem"]
    assert close(asleep, qty(truth, "Core", "Deep", "REM"), 1e-9)
    bodies += [[b]]
    hand[MARCH[1]] = summary_night(b, asleep)

    # 03-05: asleep only: the night is asleep.
    [a] = hf.sleep_summaries(SEED, MARCH[2], phone=PHONE, form="a", date_as="mixed")
    assert not any(k in a for k in ("totalSleep", "core", "deep", "rem"))
    bodies += [[a]]
    hand[MARCH[2]] = summary_night(a, a["asleep"])

    # 03-06: AutoSleep's hours as asleep beside the Watch's stages: together they say more
    # than the hours from sleep start to sleep end, so the sources overlap: the night is the
    # Watch's core + deep + rem (here within the window), marked overlapping. Its stages are
    # the Watch's (AutoSleep's unspecified hours are left out), and awake no more than the
    # window leaves beside them.
    [both] = hf.sleep_overlapping_sources(SEED, MARCH[3], phone=PHONE)
    window = hours_between(both["sleepStart"], both["sleepEnd"])
    watch = both["core"] + both["deep"] + both["rem"]
    assert both["asleep"] + watch > window + 1 and watch <= window + 1e-9
    assert both["inBed"] > window  # the window is the smallest bound here
    bodies += [[both]]
    awake = min(both["awake"], window - watch)
    hand[MARCH[3]] = summary_night(both, min(watch, window), overlapping=True, stages=dict(
        {k: both[k] for k in ("core", "deep", "rem")}, **({"awake": awake} if awake > 0
                                                          else {})), counted="staged")

    # 03-07: Eight Sleep wrote its night twice: 27.0 h between 21:52 and 10:16, that is in
    # 12 h 24 min, with no stages: the night is the window, 12.4 h, and so is in bed (it
    # claimed 24.8 h); overlapping.
    eight = hf.sleep_app_summary(dt.datetime(2025, 3, 6, 21, 52), dt.datetime(2025, 3, 7, 10, 16),
                                 27.0, phone=PHONE)
    assert hours_between(eight["sleepStart"], eight["sleepEnd"]) == 12.4
    bodies += [[eight]]
    hand[MARCH[4]] = summary_night(eight, 12.4, overlapping=True, in_bed=12.4,
                                   counted="unspecified")

    # 03-08: a night, and two naps back to back (15:59-17:28 and 17:28-18:26): two records,
    # two naps (a nightly record is never joined to another), of 0.8 + 0.4 + 0.15 h with
    # 1 h 29 min in bed and 0.5 + 0.3 + 0.1 h with 58 min in bed; the second starts where the
    # first ended, HAE's boundary, not a bedtime: its start is not known. Never part of the
    # night.
    [c8] = hf.sleep_summaries(SEED, MARCH[5], phone=PHONE, form="c", date_as="mixed")
    naps = hf.sleep_nap_summaries(MARCH[5], phone=PHONE)
    bodies += [[c8], naps]
    hand[MARCH[5]] = summary_night(c8, c8["totalSleep"], naps=[
        {"sleep_start": "2025-03-08T15:59:00-05:00", "sleep_end": "2025-03-08T17:28:00-05:00",
         "date": "2025-03-08", "asleep": 1.35, "in_bed": 1 + 29 / 60, "overlapping": False},
        {"sleep_start": None, "sleep_end": "2025-03-08T18:26:00-05:00",
         "date": "2025-03-08", "asleep": 0.9, "in_bed": 58 / 60, "overlapping": False}])

    # 03-09: the Watch's stage records (startDate/endDate) across the change to daylight time,
    # each written twice in its body (the store keeps one of two identical records). The
    # Watch's segments follow one another without overlapping: each stage is its records'
    # qty added up, asleep the core, deep and REM ones; in bed the phone's record, 6 h 26 min
    # 41 s elapsed (7 h 26 min 41 s on the wall clock).
    dst = hf.sleep_segments(SEED, MARCH[6], phone=PHONE, variant="old")
    bed = [r for r in dst if r["value"] == "In Bed"][0]
    assert (bed["startDate"], bed["endDate"]) == ("2025-03-08 23:51:57 -0500",
                                                  "2025-03-09 07:18:38 -0400")
    bodies += [[row for row in dst for _ in (0, 1)]]
    hand[MARCH[6]] = records_night(dst, qty(dst, "Core", "Deep", "REM"), {
        "core": qty(dst, "Core"), "deep": qty(dst, "Deep"), "rem": qty(dst, "REM"),
        "awake": qty(dst, "Awake")})
    assert close(hand[MARCH[6]]["in_bed"], 6 + 26 / 60 + 41 / 3600, 1e-9)

    # 03-10: the Watch's stage records (start/end), the asleep ones written again by the
    # iPhone 40 s later, and a nap of 40 min in the afternoon. A copy covers its original and
    # the first 40 s of the segment after it. Each second is in one stage: where the next
    # segment is sleep it is the next segment's (the record that began last); where it is an
    # awakening, or the night's end, the copy's: so at the end of each stretch of sleep (the
    # segments between two awakenings) its last stage gains 40 s, and the awakening after it
    # loses them (asleep, never awake). The records add up to twice the sleep: overlapping.
    # The nap: 24 min of core, 2 min awake, 14 min of core.
    watch = hf.sleep_segments(SEED, MARCH[7], phone=PHONE, variant="new")
    again = hf.sleep_records_again(watch, shift_s=40, source="iPhone")
    nap = hf.sleep_nap(dt.datetime(2025, 3, 10, 14, 10), 40, phone=PHONE)
    segments = [r for r in watch if r["value"] != "In Bed"]
    assert all(x["end"] == y["start"] and x["value"] != y["value"]
               for x, y in zip(segments, segments[1:]))  # one after another, never the same
    gained = {"core": 0.0, "deep": 0.0, "rem": 0.0, "awake": 0.0}
    stretches = 0
    for k, row in enumerate(segments):
        if row["value"] != "Awake":
            if k + 1 == len(segments) or segments[k + 1]["value"] == "Awake":
                stretches += 1
                gained[row["value"].lower()] += 40 / 3600
                if k + 1 < len(segments):
                    gained["awake"] -= 40 / 3600
    bodies += [watch, again, nap]
    hand[MARCH[7]] = records_night(watch, qty(watch, "Core", "Deep", "REM") + stretches * 40 / 3600,
                                   {"core": qty(watch, "Core") + gained["core"],
                                    "deep": qty(watch, "Deep") + gained["deep"],
                                    "rem": qty(watch, "REM") + gained["rem"],
                                    "awake": qty(watch, "Awake") + gained["awake"]},
                                   overlapping=True, naps=[{
                                        "sleep_start": "2025-03-10T14:10:00-04:00",
                                        "sleep_end": "2025-03-10T14:50:00-04:00",
                                        "date": "2025-03-10", "asleep": 38 / 60,
                                        "in_bed": None, "overlapping": False}])
    assert stretches > 1

    # 03-11: a sleep app alone: an in-bed record and unspecified "Asleep" blocks that never
    # overlap: asleep is the blocks' qty added up; no device told stages apart, so the night
    # shows no stage hours (asleep alone counts).
    app = hf.sleep_app_records(SEED, MARCH[8], phone=PHONE)
    assert {r["value"] for r in app} == {"In Bed", "Asleep"}
    bodies += [app]
    hand[MARCH[8]] = records_night(app, qty(app, "Asleep"), {})

    # 03-12: the evidence's night: the Watch's 6.14 + 1.18 + 1.32 h (8.64 h) beside AutoSleep's
    # 7.9 h, totalSleep their sum (16.54 h), between 23:00 and 07:00: 8.0 h (in bed 8.3 h).
    # The sources overlap; even the Watch's stages say more than the window: the night is
    # 8.0 h, and its stages their shares of it (8.0 / 8.64 of each); the window leaves no
    # room for awake beside them.
    evidence = {"date": "2025-03-11 23:00:00 -0400", "totalSleep": 16.54, "asleep": 7.9,
                "core": 6.14, "deep": 1.18, "rem": 1.32, "awake": 0.31, "inBed": 8.3,
                "inBedStart": "2025-03-11 22:50:00 -0400", "inBedEnd": "2025-03-12 07:08:00 -0400",
                "sleepStart": "2025-03-11 23:00:00 -0400", "sleepEnd": "2025-03-12 07:00:00 -0400",
                "source": hf.OVERLAP_SOURCE}
    bodies += [[evidence]]
    share = 8.0 / 8.64
    hand[MARCH[9]] = summary_night(evidence, 8.0, overlapping=True, stages={
        "core": 6.14 * share, "deep": 1.18 * share, "rem": 1.32 * share}, counted="staged",
        scaled=True)

    apart = {}
    # The March change of 2024: a night written twice from 23:30 (-05:00) to 07:30 (-04:00):
    # 8 h on the wall clock, 7 h elapsed. It says 15 h asleep and 8.5 h in bed: both are
    # 7.0 h, the real hours, overlapping.
    twice = hf.sleep_app_summary(dt.datetime(2024, 3, 9, 23, 30), dt.datetime(2024, 3, 10, 7, 30),
                                 15.0, phone=PHONE, app="HeartWatch", in_bed=8.5)
    assert hours_between(twice["sleepStart"], twice["sleepEnd"]) == 7.0
    apart["dst"] = ([twice], summary_night(twice, 7.0, overlapping=True, in_bed=7.0,
                                           counted="unspecified"))
    # HeartWatch's 82.7 h over three days (22:00 on 1 April to 08:42 on the 4th): no sleep is
    # longer than a day: 24 h asleep, 24 h in bed, overlapping.
    days = hf.sleep_app_summary(dt.datetime(2025, 4, 1, 22, 0), dt.datetime(2025, 4, 4, 8, 42),
                                82.7, phone=PHONE, app="HeartWatch", in_bed=82.7)
    apart["days"] = ([days], summary_night(days, 24.0, overlapping=True, in_bed=24.0,
                                           counted="unspecified"))
    # A sleep app that kept recording: "Asleep" from 20:00 on 20 April to 12:00 on the 21st
    # and from 13:00 to 01:00 on the 22nd: 28 h with a gap of one hour, one sleep: 24 h (no
    # stage hours: nothing told apart), marked overlapping: no one sleeps 28 h.
    blocks = [{"startDate": PHONE.time(dt.datetime(2025, 4, d0, h0)),
               "endDate": PHONE.time(dt.datetime(2025, 4, d1, h1)), "qty": hours,
               "value": "Asleep", "source": "AutoSleep"}
              for d0, h0, d1, h1, hours in ((20, 20, 21, 12, 16.0), (21, 13, 22, 1, 12.0))]
    apart["records-days"] = (blocks, records_night(blocks, 24.0, {}, overlapping=True))
    # A night sent again after HAE began writing HealthKit's names (a Previous 7 Days
    # automation re-sends the week): each record twice, once as "Core", once as
    # "HKCategoryValueSleepAnalysisAsleepCore", at the same times. Every second counts once,
    # so the hours are the night's; the records add up to twice them: overlapping.
    english = hf.sleep_segments(SEED, dt.date(2025, 5, 6), phone=PHONE, variant="old")
    healthkit = hf.sleep_segments(SEED, dt.date(2025, 5, 6), phone=hf.Phone(
        zone=hf.NEW_YORK, sources="single", language="hk"), variant="old")
    apart["respelled"] = (english + healthkit, records_night(
        english, qty(english, "Core", "Deep", "REM"),
        {"core": qty(english, "Core"), "deep": qty(english, "Deep"), "rem": qty(english, "REM"),
         "awake": qty(english, "Awake")}, overlapping=True))
    bodies += [[twice], [days], blocks, english, healthkit]
    return {"bodies": bodies, "points": [p for body in bodies for p in body], "hand": hand,
            "apart": apart}


CORPUS = build()


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """Each body posted as a delivery of its own to a serve subprocess, and folded."""
    deliveries = [(SLEEP, hf.dumps_hae(hf.envelope(metrics=[hf.metric("sleep_analysis", rows,
                                                                      "hr")])))
                  for rows in CORPUS["bodies"]]
    yield from serve_corpus(tmp_path_factory.mktemp("sleep-rule"), CORPUS, deliveries,
                            EXTRA_CANARIES)


@functools.lru_cache(maxsize=None)
def oracle(tz: str = "local") -> dict:
    """The tests' oracle (read_helpers) over the points the store holds: those posted, a
    point posted twice alike once (storage spec)."""
    stored = list({json.dumps(p, sort_keys=True): p for p in CORPUS["points"]}.values())
    return nights_by_date([p for p in stored if "value" not in p],
                          [p for p in stored if "value" in p], tz)


def read_nights(store, first: dt.date, end: dt.date, bucket: str = "day", tz: str = "local",
                fmt: str = None):
    """The nights of the dates [first, end): a date-only ``to`` is the last day, included."""
    query = dict(metric="sleep_analysis", bucket=bucket, tz=tz, from_=first.isoformat(),
                 to=(end - dt.timedelta(days=1)).isoformat(), format=fmt)
    if fmt == "csv":
        return read_csv(get(store.address, "/api/points", **query))
    return get_json(store.address, "/api/points", **query)["nights"]


def assert_night(got: dict, want: dict, what) -> None:
    """A day item (or a summary card) against a night's hand figures: hours to 1e-9, a
    stage the reply lacks is 0 h, the naps with their start, end and hours."""
    for key in ("asleep", "in_bed"):
        assert (got[key] is None) == (want[key] is None), (what, key, got[key])
        assert want[key] is None or close(got[key], want[key], 1e-9), (what, key, got, want)
    assert set(got["stages"]) == set(want["stages"]), (what, got["stages"])
    for stage, hours in want["stages"].items():
        assert close(got["stages"][stage], hours, 1e-9), (what, stage, got["stages"], hours)
    assert got["overlapping"] is want["overlapping"], (what, "overlapping", got)
    assert (got["counted"], got["scaled"]) == (want["counted"], want["scaled"]), (what, got)
    assert sum(h for k, h in got["stages"].items() if k != "awake") <= got["asleep"] + 1e-9
    assert (got["sleep_start"], got["sleep_end"]) == (want["sleep_start"], want["sleep_end"]), (
        what, got)
    assert len(got["naps"]) == len(want["naps"]), (what, got["naps"])
    for nap, hand in zip(got["naps"], want["naps"]):
        assert {k: nap[k] for k in ("sleep_start", "sleep_end", "date", "overlapping")} == {
            k: hand[k] for k in ("sleep_start", "sleep_end", "date", "overlapping")}, what
        for key in ("asleep", "in_bed"):
            assert (nap[key] is None) == (hand[key] is None), (what, key, nap)
            assert hand[key] is None or close(nap[key], hand[key], 1e-9), (what, key, nap)
    window = hours_between(want["sleep_start"], want["sleep_end"])
    assert got["asleep"] <= min(window, 24) + 1e-9, (what, "more than its window", got)


def test_read_12_4_the_oracle_comes_to_the_hand_figures():
    """read_helpers' oracle, which the other sleep tests lean on, gives every night here the
    figures this file works out by hand."""
    by_date = oracle()
    items = {item["date"]: item for item in night_items(by_date)}
    for morning, want in CORPUS["hand"].items():
        assert_night(items[morning.isoformat()], want, morning)
    for name, (_, want) in CORPUS["apart"].items():
        end = dt.date.fromisoformat(want["sleep_end"][:10])
        assert_night(items[end.isoformat()], want, name)


@pytest.mark.parametrize("tz", ["local", NY])
def test_read_12_4_each_form_gives_the_nights_true_hours_per_day(store, tz):
    got = read_nights(store, MARCH[0], MARCH[-1] + dt.timedelta(days=1), tz=tz)
    assert [n["date"] for n in got] == [d.isoformat() for d in MARCH]
    for item, morning in zip(got, MARCH):
        want = CORPUS["hand"][morning]
        assert_night(item, want, morning)
        assert (item["form"], item["nights"], item["count"]) == (want["form"], 1,
                                                                 1 + len(want["naps"]))
    assert_nights_equal(got, [n for n in night_items(oracle(tz), tz)
                              if n["date"] in {d.isoformat() for d in MARCH}])


def test_read_12_4_the_day_csv_carries_the_hours_naps_and_overlap(store):
    rows = read_nights(store, MARCH[0], MARCH[-1] + dt.timedelta(days=1), fmt="csv")
    stages = ["deep", "core", "rem", "asleep", "awake"]  # deepest first, as drawn
    # the stage of unspecified sleep is the column "unspecified": "asleep" is the hours
    assert rows[0] == ["start", "local", "date", "count", "nights", "asleep", "in_bed"] + \
        ["deep", "core", "rem", "unspecified", "awake"] + [
            "sleep_start", "sleep_end", "form", "counted", "scaled", "overlapping", "naps",
            "nap_hours"]
    assert [row[2] for row in rows[1:]] == [d.isoformat() for d in MARCH]
    for row, morning in zip(rows[1:], MARCH):
        want = CORPUS["hand"][morning]
        cells = dict(zip(rows[0][:5] + rows[0][12:], row[:5] + row[12:]))
        for key, cell in (("asleep", row[5]), ("in_bed", row[6])):
            assert close(float(cell), want[key], 1e-9), (morning, key, row)
        for stage, cell in zip(stages, row[7:12]):
            assert close(float(cell or 0), want["stages"].get(stage, 0.0), 1e-9), (
                morning, stage, row)
            assert (cell == "") == (stage not in want["stages"]), (morning, stage)
        assert (cells["sleep_start"], cells["sleep_end"], cells["form"]) == (
            want["sleep_start"], want["sleep_end"], want["form"])
        assert (cells["counted"], cells["scaled"]) == (want["counted"],
                                                       str(int(want["scaled"]))), cells
        assert (cells["count"], cells["nights"]) == (str(1 + len(want["naps"])), "1")
        assert (cells["overlapping"], cells["naps"]) == (str(int(want["overlapping"])),
                                                         str(len(want["naps"])))
        if want["naps"]:
            nap_hours = sum(nap["asleep"] for nap in want["naps"])
            assert close(float(cells["nap_hours"]), nap_hours, 1e-9), (morning, cells)
        else:
            assert cells["nap_hours"] == "", (morning, cells)


def test_read_12_4_the_day_csv_names_each_column_once(store):
    """A spreadsheet or ``csv.DictReader`` reads a column by its name: the hours asleep and
    the stage of unspecified sleep (a sleep app's "Asleep" records, 11 March) must not share
    one, or the night's hours read as the stage's (and as nothing on a night without it)."""
    text = get(store.address, "/api/points", metric="sleep_analysis", bucket="day",
               format="csv", from_="2025-03-03", to="2025-03-12").text
    header = next(csv.reader(io.StringIO(text)))
    assert len(set(header)) == len(header), header
    for row, morning in zip(csv.DictReader(io.StringIO(text)), MARCH):
        assert close(float(row["asleep"]), CORPUS["hand"][morning]["asleep"], 1e-9), row


def test_read_12_4_a_week_is_the_average_of_its_nights_never_of_its_naps(store):
    first, end = MARCH[0], MARCH[-1] + dt.timedelta(days=6)
    got = read_nights(store, first, end, bucket="week")
    weeks = {"2025-03-03": MARCH[:7], "2025-03-10": MARCH[7:]}
    assert [w["date"] for w in got] == list(weeks)
    for week, mornings in zip(got, weeks.values()):
        hand = [CORPUS["hand"][m] for m in mornings]
        naps = [nap for night in hand for nap in night["naps"]]
        assert (week["nights"], week["count"]) == (len(hand), len(hand) + len(naps))
        assert close(week["asleep"], sum(n["asleep"] for n in hand) / len(hand), 1e-9), week
        assert close(week["in_bed"], sum(n["in_bed"] for n in hand) / len(hand), 1e-9), week
        for stage in ("deep", "core", "rem", "asleep", "awake"):
            mean = sum(n["stages"].get(stage, 0.0) for n in hand) / len(hand)
            assert close(week["stages"].get(stage, 0.0), mean, 1e-9), (week["date"], stage)
        assert week["overlapping"] == sum(n["overlapping"] for n in hand)
        assert [(n["sleep_start"], n["sleep_end"]) for n in week["naps"]] == [
            (n["sleep_start"], n["sleep_end"]) for n in naps]
        with_naps = sum(n["asleep"] for n in hand) + sum(n["asleep"] for n in naps)
        assert not close(week["asleep"], with_naps / len(hand), 1e-6)  # naps: not averaged in
    by_date = {d: s for d, s in oracle().items() if first <= d < end}
    assert_nights_equal(got, week_items(by_date), week=True)
    rows = read_nights(store, first, end, bucket="week", fmt="csv")
    assert rows[0] == ["start", "local", "date", "count", "nights", "asleep", "in_bed", "deep",
                       "core", "rem", "unspecified", "awake", "overlapping", "naps",
                       "nap_hours"]
    for row, week in zip(rows[1:], got):
        assert row[2:5] == [week["date"], str(week["count"]), str(week["nights"])]
        assert close(float(row[5]), week["asleep"], 1e-12)
        assert row[-3:-1] == [str(week["overlapping"]), str(len(week["naps"]))]


def test_read_12_4_the_summary_of_each_morning_shows_its_night_and_naps(store):
    """The sleep card of each morning: the night's hours, stages, start and end, overlap and
    naps; the usual the median of the nights of the 30 days before (not their naps), the
    sparkline each day's night."""
    hand = CORPUS["hand"]
    for morning in MARCH:
        card = get_json(store.address, "/api/summary", date=morning.isoformat())["cards"][
            "sleep"]
        assert card["units"] == "hr"
        assert_night(card, hand[morning], morning)
        before = [hand[d]["asleep"] for d in MARCH if morning - dt.timedelta(days=30) <= d
                  < morning]
        usual = statistics.median(before) if len(before) >= 5 else None
        assert (card["usual"] is None) == (usual is None), (morning, card["usual"])
        assert usual is None or close(card["usual"], usual, 1e-9), (morning, card["usual"])
        assert card["usual_days"] == len(before)
        spark = {p["date"]: p["value"] for p in card["spark"]}
        assert len(spark) == 14 and all(
            (value is None) == (dt.date.fromisoformat(day) not in hand)
            and (value is None or close(value, hand[dt.date.fromisoformat(day)]["asleep"],
                                        1e-9)) for day, value in spark.items()), spark
    # the 8th's nap, had it been added to its night, would have moved the usual of the 12th
    nap = hand[MARCH[5]]["naps"][0]["asleep"]
    with_nap = [hand[d]["asleep"] + (nap if d == MARCH[5] else 0) for d in MARCH[:-1]]
    assert statistics.median(with_nap) != statistics.median([hand[d]["asleep"]
                                                            for d in MARCH[:-1]])


def test_read_12_4_a_night_across_the_dst_change_counts_real_hours(store):
    """Across the March change the wall clock skips an hour: a night from 23:30 to 07:30 is
    7 h, and a night written twice is capped at those 7 h, not at 8; the stage records of the
    9 March 2025 count 6 h 26 min 41 s in bed, not 7 h 26 min 41 s."""
    rows, want = CORPUS["apart"]["dst"]
    [got] = read_nights(store, dt.date(2024, 3, 10), dt.date(2024, 3, 11))
    assert got["date"] == "2024-03-10"
    assert_night(got, want, "dst")
    assert (got["sleep_start"][-6:], got["sleep_end"][-6:]) == ("-05:00", "-04:00")
    [csv] = read_nights(store, dt.date(2024, 3, 10), dt.date(2024, 3, 11), fmt="csv")[1:]
    assert csv[5:7] == ["7.0", "7.0"] and csv[-3] == "1", csv
    card = get_json(store.address, "/api/summary", date="2024-03-10")["cards"]["sleep"]
    assert_night(card, want, "dst card")
    [records] = read_nights(store, MARCH[6], MARCH[7])
    assert close(records["in_bed"], 6 + 26 / 60 + 41 / 3600, 1e-9)
    assert (records["sleep_start"][-6:], records["sleep_end"][-6:]) == ("-05:00", "-04:00")


def test_read_12_4_no_night_of_summaries_is_longer_than_a_day(store):
    rows, want = CORPUS["apart"]["days"]
    [got] = read_nights(store, dt.date(2025, 4, 1), dt.date(2025, 4, 5))
    assert got["date"] == "2025-04-04"
    assert_night(got, want, "three days")
    [week] = read_nights(store, dt.date(2025, 3, 31), dt.date(2025, 4, 7), bucket="week")
    assert week["asleep"] == 24.0 and week["overlapping"] == 1


def test_read_12_4_no_sleep_of_records_is_longer_than_a_day(store):
    """A sleep MUST NOT show more than 24 h, whatever its records say: a sleep app that
    recorded 16 h, paused an hour, then 12 h more, is one sleep of 24 h."""
    rows, want = CORPUS["apart"]["records-days"]
    [got] = read_nights(store, dt.date(2025, 4, 20), dt.date(2025, 4, 23))
    assert got["date"] == "2025-04-22" and got["form"] == "records"
    assert got["asleep"] <= 24.0, got
    assert_night(got, want, "28 h of records")


def test_read_12_4_a_night_resent_in_other_spellings_counts_once(store):
    rows, want = CORPUS["apart"]["respelled"]
    [got] = read_nights(store, dt.date(2025, 5, 6), dt.date(2025, 5, 7))
    for key in ("asleep", "in_bed"):
        assert close(got[key], want[key], 1e-9), (key, got)
    assert {k: round(v, 9) for k, v in got["stages"].items()} == {
        k: round(v, 9) for k, v in want["stages"].items()}
    assert (got["count"], got["naps"]) == (1, [])


def test_read_12_4_a_night_resent_in_other_spellings_is_marked_overlapping(store):
    """Each record of the night is there twice (HAE's and HealthKit's names at the same
    times): its stage records add up to twice their union, which the rule marks
    ``overlapping``, as it does a summary written twice."""
    [got] = read_nights(store, dt.date(2025, 5, 6), dt.date(2025, 5, 7))
    assert got["overlapping"] is True, got
