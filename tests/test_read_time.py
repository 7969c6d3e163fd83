"""The read side in the phone's time: time zones, DST and sleep (read spec READ-2.8, READ-3.5,
READ-8, READ-11, READ-12), end to end.

One store (`store`), built once: HAE-shaped bodies made by tests/hae_factory.py are posted
over HTTP to a real ``healthlog.py serve`` subprocess on 127.0.0.1:0 and folded by its worker
into a real SQLite file. The phone travelled:

* a year of Days exports in each of Australia/Sydney (July 2022 - June 2023), Europe/Berlin
  (July 2023 - June 2024) and America/New_York (November 2024 - 3 November 2025, "today"):
  monthly backfills of the thirteen Days metrics (points at local midnight, the offset
  following the zone's DST, some metrics ``"data": []``) and tiny one-day "Today" exports
  around each DST change, re-sending the same points;
* Minutes exports of a New York phone around both 2025 DST changes (basal energy every
  minute, steps), and of a phone in Asia/Kolkata (+05:30: every UTC hour straddles two
  local hours);
* active energy in kcal, an hour in kJ with one late point, kcal again (READ-3.5);
* sleep of a New York phone: a month of nightly summaries in HAE's three forms with
  ``date`` the wake time on some nights and the sleep start on others (READ-12.1); a week
  and a day of stage records with localised and HealthKit stage names, a second device
  and a nap (READ-12.2); records, summaries, both, and a night summarised twice
  (READ-12.3).

Every expectation is computed here from the bodies posted (tests/read_helpers.py: times read
with ``datetime`` from the text the phone wrote, other zones placed with ``zoneinfo``), never
from healthlog's code.
"""

from __future__ import annotations

import csv
import datetime as dt
import io
import json
import os
import random
import sqlite3
import sys
import zoneinfo
from pathlib import Path
from typing import NamedTuple

import pytest

import hae_factory as hf
from conftest import Lazy, db_rows, run_export, wait_for
from read_helpers import (US, Store, aggregate, assert_buckets_equal, assert_error,
                          assert_nights_equal, call, close, coordinate, get, get_json, in_zone,
                          instant_us, iso_local, local_midnight_us, night_items, nights_by_date,
                          raw_runs, raw_start, read_csv, runs_of, serve_corpus, sleep_dates,
                          utc_iso, week_items, written)

SEED = 2025
SLEEP_SEED = 41
#: Names that must never appear in a log record above DEBUG (beside conftest's canaries).
EXTRA_CANARIES = (hf.SLEEP_APP,)

#: (zone, factory zone, first day, end day (exclusive), a zone of another continent west of
#: it, an offset west of it): the phone's year in each zone, and where else it is read.
YEARS = (("Australia/Sydney", hf.SYDNEY, dt.date(2022, 7, 1), dt.date(2023, 7, 1),
          "America/New_York", "+05:30"),
         ("Europe/Berlin", hf.BERLIN, dt.date(2023, 7, 1), dt.date(2024, 7, 1),
          "America/Los_Angeles", "-05:00"),
         ("America/New_York", hf.NEW_YORK, dt.date(2024, 11, 4), dt.date(2025, 11, 4),
          "Pacific/Honolulu", "-10:00"))
#: The DST changes inside those years (the tiny "Today" exports re-send the days around them).
DST_DAYS = {"Australia/Sydney": (dt.date(2022, 10, 2), dt.date(2023, 4, 2)),
            "Europe/Berlin": (dt.date(2023, 10, 29), dt.date(2024, 3, 31)),
            "America/New_York": (dt.date(2025, 3, 9), dt.date(2025, 11, 2))}
SPRING, AUTUMN = DST_DAYS["America/New_York"]
NY = "America/New_York"
#: Days of the New York Minutes exports: basal energy every minute; steps on some of them.
BASAL_DAYS = [dt.date(2025, 3, 7) + dt.timedelta(days=k) for k in range(5)] + [
    dt.date(2025, 11, 1) + dt.timedelta(days=k) for k in range(3)]
STEP_DAYS = [dt.date(2025, 3, 8) + dt.timedelta(days=k) for k in range(3)] + [
    dt.date(2025, 11, 1) + dt.timedelta(days=k) for k in range(3)]
KOLKATA_DAYS = [dt.date(2025, 6, 10), dt.date(2025, 6, 11)]

DAYS = hf.Automation("Daily totals", "Days", "Previous 30 Days")
TODAY = hf.Automation("Today totals", "Days", "Today")
MINUTES = hf.Automation("Health fast", "Minutes", "Since Last Sync")
SLEEP = hf.Automation("Sleep", "Days", "Previous 7 Days")


class Corpus(NamedTuple):
    deliveries: list  # (headers, body bytes), in posting order
    posted: dict  # (metric, layer) -> {coordinate text: (point, units)}
    sleep: dict  # scenario -> {"summaries": [...], "records": [...]}

    def points(self, metric: str, layer: str) -> list:
        """(point, units) of a metric and layer in time order."""
        return sorted(self.posted[(metric, layer)].values(),
                      key=lambda item: (instant_us(raw_start(item[0])), str(item[0])))


def build_corpus() -> Corpus:
    rng = random.Random(SEED)
    corpus = Corpus([], {}, {})

    def post(automation: hf.Automation, body: dict, layer: str) -> dict:
        """Post ``body`` as HAE re-sends it (keys shuffled, last digits jittered); remember
        each point as sent the first time (a later send of the same value changes nothing,
        storage spec)."""
        sent = hf.dumps_hae(body, rng)
        corpus.deliveries.append((hf.headers_for(automation, hf.new_uuid(rng)), sent))
        parsed = json.loads(sent)
        for element in parsed["data"].get("metrics", []):
            target = "record" if element["name"] == "sleep_analysis" else layer
            kept = corpus.posted.setdefault((element["name"], target), {})
            for point in element["data"]:
                key = (raw_start(point), point.get("end", point.get("endDate")),
                       point.get("value"))
                kept.setdefault(key, (point, element["units"]))
        return parsed

    def sleep_rows(parsed: dict) -> list:
        return parsed["data"]["metrics"][0]["data"]

    # A year of Days exports per zone: monthly backfills, then "Today" around DST changes.
    for name, zone, first, end, _, _ in YEARS:
        phone = hf.Phone(zone=zone, sources="single")
        month = first
        while month < end:
            following = min(end, (month.replace(day=1) + dt.timedelta(days=32)).replace(day=1))
            post(DAYS, hf.days_export(SEED, month, following, phone=phone, rng=rng), "days")
            month = following
        for change in DST_DAYS[name]:
            for k in (-1, 0, 1):
                post(TODAY, hf.days_export(SEED, change + dt.timedelta(days=k), phone=phone,
                                           rng=rng), "days")
    # Minutes: New York around both changes of 2025, Kolkata in June.
    ny = hf.Phone(zone=hf.NEW_YORK)
    for day in BASAL_DAYS:
        names = ("basal_energy_burned",) + (("step_count",) if day in STEP_DAYS else ())
        post(MINUTES, hf.metrics_payload(SEED, names, day, day + dt.timedelta(days=1),
                                         "Minutes", phone=ny, rng=rng), "minutes")
    for day in KOLKATA_DAYS:
        post(MINUTES, hf.metrics_payload(SEED, ("walking_running_distance",), day,
                                         day + dt.timedelta(days=1), "Minutes",
                                         phone=hf.Phone(zone=hf.KOLKATA), rng=rng), "minutes")
    # READ-3.5: kcal from 12:00, one kJ point at 13:45, kcal again from 14:00 (local).
    for units, minutes in (("kcal", range(0, 60, 3)), ("kJ", (105,)),
                           ("kcal", range(120, 180, 3))):
        energy = [{"date": ny.time(dt.datetime(2025, 5, 5, 12) + dt.timedelta(minutes=m)),
                   "qty": 0.5 + m / 100, "source": hf.OWNER_WATCH} for m in minutes]
        post(MINUTES, hf.envelope(metrics=[hf.metric("active_energy", energy, units)]),
             "minutes")
    # Sleep of a New York phone.
    sleeper = hf.Phone(zone=hf.NEW_YORK, sources="single")

    def sleep_body(rows: list) -> dict:
        return hf.envelope(metrics=[hf.metric("sleep_analysis", rows, "hr")])

    def keep(scenario: str, kind: str, rows: list) -> None:
        """Post sleep rows and remember them, as sent, for the scenario's oracle."""
        sent = sleep_rows(post(SLEEP, sleep_body(rows), "days"))
        corpus.sleep.setdefault(scenario, {"summaries": [], "records": []})[kind] += sent

    # READ-12.1: January in the three nightly forms, date the wake time or the sleep start.
    for form, first, end in (("a", 1, 11), ("b", 11, 21), ("c", 21, 32)):
        rows = hf.sleep_summaries(SLEEP_SEED, dt.date(2025, 1, first),
                                  dt.date(2025, 1, 1) + dt.timedelta(days=end - 1),
                                  phone=sleeper, form=form, date_as="mixed", rng=rng)
        keep("12.1", "summaries", rows)
    # READ-12.2: stage records of the mornings 3-10 March (the 9th: the change to daylight
    # time), in four spellings and both record shapes; a sleep app beside the watch on the
    # 7th; a nap in the afternoon of the 6th.
    spellings = {3: ("en", "new"), 4: ("de", "old"), 5: ("hk", "new"), 6: ("en-6.6.2", "old"),
                 7: ("en", "new"), 8: ("de", "new"), 9: ("en", "old"), 10: ("hk", "old")}
    week: list = []
    for morning, (language, variant) in spellings.items():
        phone = hf.Phone(zone=hf.NEW_YORK, sources="single", language=language)
        day = dt.date(2025, 3, morning)
        week += hf.sleep_segments(SLEEP_SEED, day, phone=phone, variant=variant, rng=rng)
        if morning == 7:
            week += hf.sleep_app_records(SLEEP_SEED, day, phone=phone, shift_s=420)
        if morning == 6:
            week += hf.sleep_nap(dt.datetime(2025, 3, 6, 14, 10), 40, phone=phone)
    keep("12.2", "records", week)
    # READ-12.3: mornings 7-13 April: records (7-9), summaries (10, 11), both (12), and the
    # night of the 13th summarised twice, date once the wake time and once the sleep start.
    phone = hf.Phone(zone=hf.NEW_YORK, sources="single")
    april = dt.date(2025, 4, 7)
    records = hf.sleep_segments(SLEEP_SEED, april, april + dt.timedelta(days=3), phone=phone,
                                rng=rng)
    records += hf.sleep_segments(SLEEP_SEED, dt.date(2025, 4, 12), phone=phone, rng=rng)
    summaries = hf.sleep_summaries(SLEEP_SEED, dt.date(2025, 4, 10), dt.date(2025, 4, 12),
                                   phone=phone, form="c", date_as="wake", rng=rng)
    summaries += hf.sleep_summaries(SLEEP_SEED, dt.date(2025, 4, 12), dt.date(2025, 4, 14),
                                    phone=phone, form="c", date_as="start", rng=rng)
    twice = hf.sleep_summaries(SLEEP_SEED, dt.date(2025, 4, 13), phone=phone, form="c",
                               date_as="wake", rng=rng)
    keep("12.3", "records", records)
    keep("12.3", "summaries", summaries)
    keep("12.3", "summaries", twice)
    # A watch without an "In Bed" record from the phone (mornings 16-19 June): what a range
    # that ends at midnight cuts.
    june = hf.sleep_segments(SLEEP_SEED, dt.date(2025, 6, 16), dt.date(2025, 6, 20),
                             phone=phone, rng=rng)
    keep("cut", "records", [r for r in june if r["value"] != "In Bed"])
    # Evening naps that end 3 h (15 July) and 2 h 59 min (17 July) before the night's first
    # record: three hours apart are two sleeps, less is one.
    gaps = []
    for morning, gap in ((15, dt.timedelta(hours=3)), (17, dt.timedelta(hours=2, minutes=59))):
        night = hf.sleep_segments(SLEEP_SEED, dt.date(2025, 7, morning), phone=phone, rng=rng)
        first = min(written(r["start"]) for r in night)
        gaps += night + hf.sleep_nap(first - gap - dt.timedelta(minutes=50), 50, phone=phone)
    keep("gap", "records", gaps)
    # The night of 5 August summarised at 3:10 (the phone unlocked in the night), then in
    # the morning; `date` is the wake time, so the two sends have two coordinates.
    [night] = hf.sleep_summaries(SLEEP_SEED, dt.date(2025, 8, 5), phone=phone, form="c",
                                 date_as="wake", rng=rng)
    keep("so far", "summaries", [hf.sleep_summary_so_far(night, dt.datetime(2025, 8, 5, 3, 10),
                                                         phone=phone)])
    keep("so far", "summaries", [night])
    return corpus


CORPUS = Lazy(build_corpus)


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> Store:
    """The corpus posted to a serve subprocess and folded by its worker; the server keeps
    running for the module (export runs beside it)."""
    yield from serve_corpus(tmp_path_factory.mktemp("read-time"), CORPUS, CORPUS.deliveries,
                            EXTRA_CANARIES)


# ---------------------------------------------------------------------------------------------
# READ-11: days and hours are the phone's

def steps_of_year(store: Store, zone: str) -> list:
    first, end = next((y[2], y[3]) for y in YEARS if y[0] == zone)
    return [(p, u) for p, u in store.corpus.points("step_count", "days")
            if first.isoformat() <= raw_start(p)[:10] < end.isoformat()]


@pytest.mark.parametrize("zone", [y[0] for y in YEARS])
def test_read_11_1_days_exports_land_on_their_written_date_across_both_dst_changes(store,
                                                                                   zone):
    _, _, first, end, elsewhere, offset = next(y for y in YEARS if y[0] == zone)
    items = steps_of_year(store, zone)
    assert len(items) == (end - first).days  # one point a day, each day once
    assert len({raw_start(p)[-5:] for p, _ in items}) == 2  # both offsets of the zone
    # tz=local and the phone's own zone: every point in the bucket of its written date
    for tz in ("local", zone):
        reply = get_json(store.address, "/api/points", metric="step_count", layer="days",
                         bucket="day", tz=tz, from_=first.isoformat(),
                         to=(end - dt.timedelta(days=1)).isoformat())  # `to` is included
        assert (reply["tz"], reply["layer"]) == (tz, "days")
        [run] = reply["runs"]
        assert [b["date"] for b in run["buckets"]] == [raw_start(p)[:10] for p, _ in items]
        for entry, (point, _) in zip(run["buckets"], items):
            moment = written(point["date"])  # local midnight as the phone wrote it
            assert (entry["start"], entry["local"], entry["count"]) == (
                utc_iso(instant_us(point["date"])), iso_local(moment), 1), (tz, entry)
            assert entry["fields"]["qty"]["sum"] == point["qty"]
        assert_buckets_equal(reply["runs"], aggregate(items, "day", tz))
    # another continent's zone and an offset: that zone's local days, as computed here
    start = instant_us(raw_start(items[0][0]))
    stop = instant_us(raw_start(items[-1][0])) + US
    for tz in (elsewhere, offset):
        reply = get_json(store.address, "/api/points", metric="step_count", layer="days",
                         bucket="day", tz=tz, from_=utc_iso(start), to=utc_iso(stop))
        assert reply["tz"] == tz
        want = aggregate(items, "day", tz)
        assert_buckets_equal(reply["runs"], want)
        shifted = [b for b, (p, _) in zip(want[0]["buckets"], items)
                   if b["date"] != raw_start(p)[:10]]
        assert len(shifted) == len(items), "%s puts every midnight of %s on another day" % (
            tz, zone)


def test_read_11_1_steps_per_week_follow_the_written_dates(store):
    """Weeks from Monday, in local dates, across the whole travelled store: each point in
    the week of the date written in it."""
    items = [(p, u) for p, u in store.corpus.points("step_count", "days")]
    reply = get_json(store.address, "/api/points", metric="step_count", layer="days",
                     bucket="week")
    assert_buckets_equal(reply["runs"], aggregate(items, "week", "local"))
    for entry in reply["runs"][0]["buckets"]:
        assert dt.date.fromisoformat(entry["date"]).weekday() == 0
        assert entry["local"][10:19] == "T00:00:00"


@pytest.mark.parametrize("tz", ["local", NY])
def test_read_11_2_hour_buckets_are_local_clock_hours_23_or_25_on_a_dst_day(store, tz):
    items = store.corpus.points("basal_energy_burned", "minutes")
    for day, hours in ((SPRING, 23), (AUTUMN, 25)):
        following = day + dt.timedelta(days=1)
        on_day = [(p, u) for p, u in items if raw_start(p)[:10] == day.isoformat()]
        want = aggregate(on_day, "hour", tz)
        # date-only bounds (the points are read; `to` includes its day) and the day's UTC
        # instants (summaries)
        bounds = ((day.isoformat(), day.isoformat()),
                  (utc_iso(local_midnight_us(day, NY)), utc_iso(local_midnight_us(following,
                                                                                  NY))))
        for first, last in bounds:
            reply = get_json(store.address, "/api/points", metric="basal_energy_burned",
                             bucket="hour", tz=tz, from_=first, to=last)
            [run] = reply["runs"]
            assert len(run["buckets"]) == hours, (day, tz, first)
            assert {b["date"] for b in run["buckets"]} == {day.isoformat()}
            assert all(b["local"][13:19] == ":00:00" for b in run["buckets"])
            assert_buckets_equal(reply["runs"], want)
            locals_ = [b["local"] for b in run["buckets"]]
            if hours == 25:  # the repeated hour twice, with its two offsets
                assert [t for t in locals_ if t[11:13] == "01"] == [
                    "2025-11-02T01:00:00-04:00", "2025-11-02T01:00:00-05:00"]
            else:
                assert not [t for t in locals_ if t[11:13] == "02"]
            assert all(b["count"] == 60 for b in run["buckets"])  # every minute, every hour


def test_read_11_3_days_of_minute_data_are_whole_on_both_sides_of_a_dst_change(store):
    items = store.corpus.points("step_count", "minutes")
    want = aggregate(items, "day", "local")
    assert [b["date"] for b in want[0]["buckets"]] == [d.isoformat() for d in STEP_DAYS]
    counts = {b["date"]: b["count"] for b in want[0]["buckets"]}
    for day in STEP_DAYS:  # the oracle's premise: each day's points are the ones written on it
        assert counts[day.isoformat()] == sum(raw_start(p)[:10] == day.isoformat()
                                              for p, _ in items)
    whole = get_json(store.address, "/api/points", metric="step_count", layer="minutes",
                     bucket="day")  # summaries: every hour whole, one offset each
    assert whole["tz"] == "local"
    assert_buckets_equal(whole["runs"], want)
    for first, last in ((STEP_DAYS[0], STEP_DAYS[2]), (STEP_DAYS[3], STEP_DAYS[5])):
        ranged = get_json(store.address, "/api/points", metric="step_count", layer="minutes",
                          bucket="day", from_=first.isoformat(), to=last.isoformat())
        assert_buckets_equal(ranged["runs"], aggregate(
            [(p, u) for p, u in items if first.isoformat() <= raw_start(p)[:10]
             <= last.isoformat()], "day", "local"))
    # a range cutting hours in two (their points are read) agrees with the summaries
    cut = get_json(store.address, "/api/points", metric="step_count", layer="minutes",
                   bucket="day", from_="2025-11-01T04:30:00Z", to="2025-11-04T05:30:00Z")
    assert_buckets_equal(cut["runs"], aggregate(
        [(p, u) for p, u in items if instant_us("2025-11-01T04:30:00Z")
         <= instant_us(raw_start(p)) < instant_us("2025-11-04T05:30:00Z")], "day", "local"))


@pytest.mark.parametrize("bucket", ["day", "hour"])
def test_read_11_3_days_and_hours_of_a_half_hour_offset_are_whole(store, bucket):
    """Asia/Kolkata (+05:30): every UTC hour holds minutes of two local hours, and the one at
    18:00Z of two local days, so its points are counted, not its summary."""
    items = store.corpus.points("walking_running_distance", "minutes")
    for tz in ("local", "Asia/Kolkata", "+05:30"):
        reply = get_json(store.address, "/api/points", metric="walking_running_distance",
                         layer="minutes", bucket=bucket, tz=tz)  # it has days too (READ-11.1)
        assert_buckets_equal(reply["runs"], aggregate(items, bucket, tz))
    if bucket == "day":
        assert [b["date"] for b in reply["runs"][0]["buckets"]] == [
            d.isoformat() for d in KOLKATA_DAYS]


@pytest.mark.parametrize("tz", ["local", "Europe/Berlin", "+05:30"])
def test_read_11_4_a_date_only_range_is_whole_local_days(store, tz):
    items = store.corpus.points("basal_energy_burned", "minutes")
    first, last = dt.date(2025, 3, 8), dt.date(2025, 3, 10)  # `to` includes its day
    if tz == "local":
        inside = [(p, u) for p, u in items
                  if first.isoformat() <= raw_start(p)[:10] <= last.isoformat()]
        echoed = (first.isoformat(), last.isoformat())
    else:  # the UTC instants of the first day's midnight and of the one after the last day
        low = local_midnight_us(first, tz)
        high = local_midnight_us(last + dt.timedelta(days=1), tz)
        inside = [(p, u) for p, u in items if low <= instant_us(raw_start(p)) < high]
        echoed = (utc_iso(low), utc_iso(high))
    raw = get_json(store.address, "/api/points", metric="basal_energy_burned", tz=tz,
                   from_=first.isoformat(), to=last.isoformat())
    assert (raw["from"], raw["to"], raw["tz"]) == echoed + (tz,)
    assert raw["runs"] == raw_runs(inside)
    per_day = get_json(store.address, "/api/points", metric="basal_energy_burned", tz=tz,
                       bucket="day", from_=first.isoformat(), to=last.isoformat())
    assert (per_day["from"], per_day["to"]) == echoed
    want = aggregate(inside, "day", tz)
    assert_buckets_equal(per_day["runs"], want)
    assert [b["date"] for b in per_day["runs"][0]["buckets"]] == ["2025-03-08", "2025-03-09",
                                                                  "2025-03-10"]
    # the first and the last day whole: every minute of those local days
    everything = aggregate(items, "day", tz)[0]["buckets"]
    whole = {b["date"]: b["count"] for b in everything}
    got = per_day["runs"][0]["buckets"]
    assert (got[0]["count"], got[-1]["count"]) == (whole["2025-03-08"], whole["2025-03-10"])
    if tz in ("local", NY):
        assert [b["count"] for b in got] == [1440, 1380, 1440]  # the 9th has 23 hours
    csv_rows = read_csv(get(store.address, "/api/points", metric="basal_energy_burned", tz=tz,
                            format="csv", from_=first.isoformat(), to=last.isoformat()))
    assert len(csv_rows) == 1 + len(inside)
    assert {row[4] for row in csv_rows[1:]} == {"2025-03-08", "2025-03-09", "2025-03-10"}
    assert [row[3] for row in csv_rows[1:]] == [
        iso_local(in_zone(instant_us(raw_start(p)), tz, raw_start(p))) for p, _ in inside]


def test_read_11_5_a_zone_this_machine_does_not_know_is_refused_with_what_to_do(store):
    for tz in ("Mars/Olympus_Mons", "../../etc/passwd", "/etc/localtime",
               "/usr/share/zoneinfo/UTC", "posix/../../../etc/passwd", "Europe/../UTC"):
        for bucket in (None, "day"):
            error = assert_error(get(store.address, "/api/points", metric="step_count",
                                     bucket=bucket, tz=tz), 400, "bad_request")
            message = error["message"]
            if tz == "Mars/Olympus_Mons":
                assert tz in message and "local" in message, message  # names it; what to do
            else:
                assert "passwd" not in message and "localtime" not in message, message
                assert "local" in message and "+02:00" in message, message  # the forms


def test_read_11_5_nothing_is_read_from_a_path_the_zone_name_spells(start_service):
    """In process, with an audit hook on ``open``: a zone name that spells a path outside
    the time-zone database opens nothing there (the hook only watches; the app is real)."""
    watching, opened = [], []

    def hook(event: str, args: tuple) -> None:
        if watching and event == "open" and isinstance(args[0], (str, bytes)):
            opened.append(str(args[0]))

    sys.addaudithook(hook)  # cannot be removed: it records only while `watching`
    service = start_service()
    body = hf.dumps_hae(hf.envelope(metrics=[hf.metric("step_count", [
        {"date": "2025-03-09 10:00:00 -0400", "qty": 12}], "count")]))
    status, _ = call(service.address, "POST", "/api/ingest", body=body,
                     headers={"Content-Type": "application/json",
                              "automation-aggregation": "Minutes"})[:2]
    assert status == 200
    wait_for(lambda: db_rows(service.config.data_dir, "SELECT parse_status FROM delivery")
             [0]["parse_status"] == "parsed", what="the delivery is folded")
    watching.append(True)
    try:
        with open(os.devnull, "rb"):  # the hook sees what this process opens
            pass
        for tz in ("../../etc/passwd", "/etc/passwd", "Mars/Olympus_Mons", "/etc/localtime",
                   "../../../../../../etc/hostname"):
            assert_error(get(service.address, "/api/points", metric="step_count",
                             bucket="day", tz=tz), 400, "bad_request")
    finally:
        watching.clear()
    assert os.devnull in opened
    tz_dirs = [str(Path(p).resolve()) for p in zoneinfo.TZPATH]
    outside = [p for p in opened if ("passwd" in p or "hostname" in p or "localtime" in p
                                     or ("Olympus" in p and not any(
                                         str(Path(p).resolve()).startswith(d)
                                         for d in tz_dirs)))]
    assert outside == [], outside


# ---------------------------------------------------------------------------------------------
# READ-2.8 and READ-3.5

def test_read_2_8_without_a_layer_the_finest_with_points_in_the_range(store):
    """Minutes for the last days, Days for the year up to today (3 November 2025): two months
    per day read the days layer, a bucket for every day; the last two days read minutes."""
    days = [(p, u) for p, u in steps_of_year(store, NY)
            if "2025-09-04" <= raw_start(p)[:10] < "2025-11-04"]
    assert len(days) == 61
    months = get_json(store.address, "/api/points", metric="step_count", bucket="day",
                      from_="2025-09-04", to="2025-11-03")
    assert months["layer"] == "days", "two months of days read from %s" % months["layer"]
    assert [b["date"] for b in months["runs"][0]["buckets"]] == [
        raw_start(p)[:10] for p, _ in days]
    assert_buckets_equal(months["runs"], aggregate(days, "day", "local"))
    recent = get_json(store.address, "/api/points", metric="step_count", bucket="day",
                      from_="2025-11-02", to="2025-11-03")
    assert recent["layer"] == "minutes"
    minutes = [(p, u) for p, u in store.corpus.points("step_count", "minutes")
               if raw_start(p)[:10] in ("2025-11-02", "2025-11-03")]
    assert_buckets_equal(recent["runs"], aggregate(minutes, "day", "local"))
    csv_reply = get(store.address, "/api/points", metric="step_count", bucket="day",
                    format="csv", from_="2025-09-04", to="2025-11-03")
    assert months["layers"] == ["days", "minutes"]  # days the chosen layer lacks: filled
    assert csv_reply.headers["X-Healthlog-Layer"] == "days,minutes"


def test_read_3_5_a_run_without_a_point_in_the_range_is_left_out(store):
    items = store.corpus.points("active_energy", "minutes")
    assert [u for u, _ in runs_of(items)] == ["kcal", "kJ", "kcal"]
    for first, last, units in (
            ("2025-05-05T12:00:00-04:00", "2025-05-05T13:30:00-04:00", ["kcal"]),  # kJ after
            ("2025-05-05T13:50:00-04:00", "2025-05-05T15:00:00-04:00", ["kcal"]),  # kJ before
            ("2025-05-05T13:30:00-04:00", "2025-05-05T14:30:00-04:00", ["kJ", "kcal"]),
            ("2025-05-05T13:10:00-04:00", "2025-05-05T13:40:00-04:00", [])):
        inside = [(p, u) for p, u in items
                  if instant_us(first) <= instant_us(p["date"]) < instant_us(last)]
        raw = get_json(store.address, "/api/points", metric="active_energy", from_=first,
                       to=last)
        assert [r["units"] for r in raw["runs"]] == units
        assert raw["runs"] == raw_runs(inside)
        for bucket in ("hour", "day"):
            reply = get_json(store.address, "/api/points", metric="active_energy",
                             bucket=bucket, from_=first, to=last)
            assert [r["units"] for r in reply["runs"]] == units, (first, last, bucket)
            assert all(r["buckets"] for r in reply["runs"])
            assert_buckets_equal(reply["runs"], aggregate(inside, bucket, "local"))
            rows = read_csv(get(store.address, "/api/points", metric="active_energy",
                                bucket=bucket, format="csv", from_=first, to=last))
            assert [row[3] for row in rows[1:]] == [
                r["units"] for r in reply["runs"] for _ in r["buckets"]]


# ---------------------------------------------------------------------------------------------
# READ-12: a night belongs to the day it ends

def sleep_reply(store: Store, first: str, last: str, bucket: str = "day", tz: str = "local",
                fmt: str = None):
    return get_json(store.address, "/api/points", metric="sleep_analysis", bucket=bucket,
                    tz=tz, from_=first, to=last, format=fmt)


@pytest.mark.parametrize("tz", ["local", NY])
def test_read_12_1_every_nightly_form_gives_its_night_on_its_morning(store, tz):
    sleep = store.corpus.sleep["12.1"]
    summaries = sleep["summaries"]
    forms = {("totalSleep" in p, "core" in p) for p in summaries}
    assert forms == {(False, False), (False, True), (True, True)}  # (a), (b) and (c)
    by_date = {"wake": 0, "start": 0}
    for point in summaries:
        by_date["wake" if point["date"] == point["sleepEnd"] else "start"] += 1
        assert point["date"] in (point["sleepEnd"], point["sleepStart"])
    assert by_date["wake"] > 5 and by_date["start"] > 5
    reply = sleep_reply(store, "2025-01-01", "2025-01-31", tz=tz)
    assert (reply["tz"], reply["from"], reply["units"]) == (
        tz, "2025-01-01" if tz == "local" else utc_iso(local_midnight_us(
            dt.date(2025, 1, 1), tz)), "hr")
    want = night_items(nights_by_date(summaries, [], tz), tz)
    assert [n["date"] for n in want] == ["2025-01-%02d" % d for d in range(1, 32)]
    assert_nights_equal(reply["nights"], want)
    assert all(n["count"] == 1 and n["form"] == "nightly" and not n["overlapping"]
               and n["naps"] == [] for n in reply["nights"])
    for night, point in zip(reply["nights"], summaries):
        assert night["date"] == point["sleepEnd"][:10]  # its morning, whatever `date` says
        if "totalSleep" in point:  # (c): asleep is totalSleep, not the 0 beside it
            assert night["asleep"] == point["totalSleep"] and point["asleep"] == 0
        elif "core" in point:  # (b): asleep is only the unspecified minutes beside stages
            assert point["asleep"] < 1 and close(night["asleep"], point["asleep"] + point[
                "core"] + point["deep"] + point["rem"], 1e-9), (night, point)
        else:  # (a): asleep alone
            assert night["asleep"] == point["asleep"]
    # the same nights by bucketing on `date` would put two on some days and none on others
    naive = {p["date"][:10] for p in summaries}
    assert naive != {n["date"] for n in reply["nights"]}


@pytest.mark.parametrize("bucket", ["day", "week"])
def test_read_12_2_stage_records_give_one_night_per_morning(store, bucket):
    records = store.corpus.sleep["12.2"]["records"]
    values = {p["value"] for p in records}
    assert {"Kern", "Tief", "Wach", "Im Bett", "InBed", "In Bed", "Asleep",
            "HKCategoryValueSleepAnalysisAsleepREM"} <= values
    assert {p.get("source") for p in records} == {hf.OWNER_WATCH, hf.OWNER_PHONE, hf.SLEEP_APP}
    reply = sleep_reply(store, "2025-03-03", "2025-03-16", bucket=bucket)
    by_date = nights_by_date([], records)
    assert sorted(d.isoformat() for d in by_date) == ["2025-03-%02d" % d for d in range(3, 11)]
    if bucket == "week":
        want = week_items(by_date)
        assert [w["date"] for w in want] == ["2025-03-03", "2025-03-10"]
        assert_nights_equal(reply["nights"], want, week=True)
        return
    want = night_items(by_date)
    assert_nights_equal(reply["nights"], want)
    counts = {n["date"]: n["count"] for n in reply["nights"]}
    assert counts.pop("2025-03-06") == 2  # the morning's night and the afternoon's nap
    assert set(counts.values()) == {1}  # every other morning: one night
    nights = {n["date"]: n for n in reply["nights"]}
    [nap] = nights["2025-03-06"]["naps"]  # beside the night, never in it
    assert (nap["sleep_start"], nap["sleep_end"]) == ("2025-03-06T14:10:00-05:00",
                                                      "2025-03-06T14:50:00-05:00"), nap
    assert close(nap["asleep"], 38 / 60) and nights["2025-03-06"]["asleep"] > 4
    two = nights["2025-03-07"]  # a watch and a sleep app: asleep is the union, not the sum
    app = [p for p in records if p.get("source") == hf.SLEEP_APP]
    assert app and two["asleep"] < sum(p["qty"] for p in records if p["endDate"][:10] ==
                                       "2025-03-07" and p["value"] in ("Core", "Deep", "REM",
                                                                       "Asleep"))
    assert two["overlapping"] and not any(n["overlapping"] for d, n in nights.items()
                                          if d != "2025-03-07")
    assert nights["2025-03-09"]["sleep_end"].endswith("-04:00")  # the change to daylight time
    assert nights["2025-03-09"]["sleep_start"].endswith("-05:00"), nights["2025-03-09"]


@pytest.mark.parametrize("tz,last", [(NY, "2025-06-17"), ("local", "2025-06-18T00:00:00-04:00"),
                                     ("-04:00", "2025-06-17")])
def test_read_12_2_a_range_that_ends_inside_a_night_gives_no_part_of_it(store, tz, last):
    """The nights whose end lies in the range: a range ending at midnight holds the nights
    that ended before it, whole, and nothing of the night still running then (a watch
    without the phone's "In Bed" record, so no record spans the night)."""
    records = store.corpus.sleep["cut"]["records"]
    by_date = nights_by_date([], records, tz)
    assert [d.isoformat() for d in sorted(by_date)] == ["2025-06-%02d" % d
                                                        for d in range(16, 20)]
    want = night_items({d: n for d, n in by_date.items()
                        if d.isoformat() in ("2025-06-16", "2025-06-17")}, tz)
    reply = sleep_reply(store, "2025-06-16", last, tz=tz)
    assert [(n["date"], n["count"]) for n in reply["nights"]] == [("2025-06-16", 1),
                                                                  ("2025-06-17", 1)]
    assert_nights_equal(reply["nights"], want)


def test_read_12_2_records_three_hours_apart_are_two_sleeps(store):
    """Records less than 3 h apart are one sleep: an evening nap that ends 3 h before the
    night begins is a sleep of its own day; one that ends 2 h 59 min before is part of the
    night."""
    records = store.corpus.sleep["gap"]["records"]
    reply = sleep_reply(store, "2025-07-14", "2025-07-17")
    want = night_items(nights_by_date([], records))
    assert [(n["date"], n["count"]) for n in want] == [("2025-07-14", 1), ("2025-07-15", 1),
                                                       ("2025-07-17", 1)]
    assert_nights_equal(reply["nights"], want)


def test_read_12_3_a_night_summarised_while_it_ran_and_again_counts_once(store):
    """HAE ran at 3:10 in the night and again in the morning: two summaries of one night,
    the first ending at 3:10. The night counts once, with one of the two sends' hours (not
    their sum)."""
    early, morning = store.corpus.sleep["so far"]["summaries"]
    assert early["sleepStart"] == morning["sleepStart"] and early["date"] != morning["date"]
    reply = sleep_reply(store, "2025-08-05", "2025-08-05")
    [night] = reply["nights"]
    assert (night["date"], night["count"]) == ("2025-08-05", 1), night
    assert night["asleep"] == morning["totalSleep"], night  # the summary of the latest end
    assert night["sleep_end"][:19] == morning["sleepEnd"][:19].replace(" ", "T"), night


def test_read_12_3_mixed_forms_in_one_range_and_a_night_sent_twice(store):
    sleep = store.corpus.sleep["12.3"]
    twice = [p for p in sleep["summaries"] if p["sleepEnd"][:10] == "2025-04-13"]
    assert len(twice) == 2 and twice[0]["date"] != twice[1]["date"]
    reply = sleep_reply(store, "2025-04-07", "2025-04-13")
    want = night_items(nights_by_date(sleep["summaries"], sleep["records"]))
    assert [n["date"] for n in want] == ["2025-04-%02d" % d for d in range(7, 14)]
    assert_nights_equal(reply["nights"], want)
    assert [n["form"] for n in reply["nights"]] == ["records"] * 3 + ["nightly"] * 4
    assert all(n["count"] == 1 for n in reply["nights"])  # the twice-sent night counts once
    both = next(n for n in reply["nights"] if n["date"] == "2025-04-12")
    summary = next(p for p in sleep["summaries"] if p["sleepEnd"][:10] == "2025-04-12")
    assert both["asleep"] == summary["totalSleep"] and both["in_bed"] == summary["inBed"]
    weeks = sleep_reply(store, "2025-04-07", "2025-04-13", bucket="week")
    assert [(w["date"], w["count"], w["nights"], w["form"]) for w in weeks["nights"]] == [
        ("2025-04-07", 7, 7, "mixed")]
    assert_nights_equal(weeks["nights"], week_items(nights_by_date(sleep["summaries"],
                                                                   sleep["records"])), week=True)
    rows = read_csv(get(store.address, "/api/points", metric="sleep_analysis", bucket="day",
                        format="csv", from_="2025-04-07", to="2025-04-13"))
    assert [row[rows[0].index("form")] for row in rows[1:]] == [n["form"] for n in
                                                               reply["nights"]]


# ---------------------------------------------------------------------------------------------
# READ-8: export in the phone's time

def test_read_8_1_export_gives_the_days_of_the_phone_without_tz(store):
    """``healthlog export`` beside serve: ``--tz`` defaults to ``local``, so a year of
    Sydney's days comes out on the dates written in them, byte for byte the route's."""
    query = dict(metric="step_count", layer="days", bucket="day", format="csv",
                 from_="2022-07-01", to="2023-06-30")
    route = get(store.address, "/api/points", tz="local", **query)
    assert route.status == 200
    result = run_export("--data", store.data_dir,
                        *["--%s=%s" % (key.rstrip("_"), val) for key, val in query.items()],
                        extra_canaries=EXTRA_CANARIES)
    assert result.returncode == 0, result.stderr
    assert result.stdout == route.body
    rows = list(csv.reader(io.StringIO(result.stdout.decode(), newline="")))
    items = steps_of_year(store, "Australia/Sydney")
    assert [(row[1], row[2]) for row in rows[1:]] == [
        (iso_local(written(p["date"])), p["date"][:10]) for p, _ in items]
    assert {row[1][-6:] for row in rows[1:]} == {"+10:00", "+11:00"}


def test_read_8_3_the_sqlite_export_keeps_each_points_local_start_and_date(store, tmp_path):
    out = tmp_path / "export.db"
    result = run_export("--data", store.data_dir, "--format", "sqlite", out,
                        extra_canaries=EXTRA_CANARIES)
    assert result.returncode == 0, result.stderr
    conn = sqlite3.connect(str(out))
    try:
        for metric, layer in (("step_count", "days"), ("basal_energy_burned", "minutes"),
                              ("walking_running_distance", "minutes"),
                              ("sleep_analysis", "record")):
            rows = conn.execute("SELECT start, \"end\", local_start, local_date FROM points"
                                " WHERE metric = ? AND layer = ? ORDER BY start, rowid",
                                (metric, layer)).fetchall()
            items = store.corpus.points(metric, layer)
            assert len(rows) == len(items), metric
            got = sorted(rows)
            date_of = {}  # a point's date as written; a sleep point's wake day (READ-12.5)
            if metric == "sleep_analysis":
                points = [p for p, _ in items]
                date_of = sleep_dates([p for p in points if "value" not in p],
                                      [p for p in points if "value" in p])
            want = sorted((utc_iso(instant_us(raw_start(p))),
                           utc_iso(instant_us(p.get("end") or p.get("endDate")
                                              or raw_start(p))),
                           iso_local(written(raw_start(p))),
                           date_of[coordinate(p)].isoformat() if date_of
                           else raw_start(p)[:10])
                          for p, _ in items)
            assert got == want, metric
        days = conn.execute("SELECT local_date, count(*) FROM points WHERE metric ="
                            " 'step_count' AND layer = 'days' GROUP BY local_date").fetchall()
        assert all(n == 1 for _, n in days) and len(days) == sum(
            (y[3] - y[2]).days for y in YEARS)
    finally:
        conn.close()
