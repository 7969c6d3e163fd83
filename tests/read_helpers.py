"""Helpers of the read-side tests (test_read*.py, test_summary*.py, test_sleep_*.py,
test_mcp*.py, test_workout*.py, test_view_plan.py, test_grafana.py and the pages): HTTP calls
that keep the headers, the module store (a corpus posted to a serve subprocess), and the
tests' own reading of times, buckets and nights.

The reading here is the oracle: it is written from the read spec (openspec/specs/read/
spec.md) and from what HAE writes, apart from healthlog's read code, and never calls
healthlog. Times are read with ``datetime`` (the offset written in HAE's text is the phone's
local time then), zones with ``zoneinfo``.

* ``tz=local``: each point in the offset its own timestamp was written in; a day or week
  bucket starts at local midnight in the offset of its earliest point (all that ``local``
  knows), an hour bucket at the local clock hour of its points.
* ``tz=+05:30``: that offset; ``tz=Area/City``: that zone's offset at the instant.
* sleep (READ-12): each step of the rule in plain words, worked out in whole seconds: a
  stretch of time is the set of seconds it covers (never interval arithmetic), sleeps are
  found by walking a time line of records opening and closing.
"""

from __future__ import annotations

import csv
import datetime as dt
import http.client
import io
import json
import math
import re
import statistics
import urllib.parse
import zoneinfo
from typing import Any, NamedTuple, Optional

from conftest import TOKEN, Client, ServeProcess, assert_no_leaks, db_rows, wait_for

US = 1_000_000
HOUR_US = 3600 * US
UTC = dt.timezone.utc
EPOCH = dt.datetime(1970, 1, 1, tzinfo=UTC)
_NAIVE_EPOCH = dt.datetime(1970, 1, 1)


# ---------------------------------------------------------------------------------------------
# HTTP with headers

class Reply(NamedTuple):
    status: int
    headers: http.client.HTTPMessage
    body: bytes

    def json(self):
        return json.loads(self.body)

    @property
    def text(self) -> str:
        return self.body.decode("utf-8")


def call(address: tuple, method: str, path: str, body: bytes = None, headers: dict = None,
         auth: bool = True) -> Reply:
    """One request on a fresh connection; Bearer token unless ``auth`` is false."""
    conn = http.client.HTTPConnection(address[0], address[1], timeout=60)
    try:
        sent = {"Authorization": "Bearer " + TOKEN} if auth else {}
        sent.update(headers or {})
        conn.request(method, path, body=body, headers=sent)
        response = conn.getresponse()
        return Reply(response.status, response.headers, response.read())
    finally:
        conn.close()


def url(path: str, **query) -> str:
    """``path?query``; ``from_`` stands for ``from``; None values are left out."""
    pairs = [(k.rstrip("_"), v) for k, v in query.items() if v is not None]
    return path + ("?" + urllib.parse.urlencode(pairs) if pairs else "")


def get(address: tuple, path: str, **query) -> Reply:
    return call(address, "GET", url(path, **query))


def get_json(address: tuple, path: str, **query):
    reply = get(address, path, **query)
    assert reply.status == 200, (path, query, reply.status, reply.body[:500])
    return reply.json()


def assert_error(reply: Reply, status: int, code: str) -> dict:
    """The one JSON error shape."""
    assert reply.status == status, (reply.status, reply.body[:500])
    assert reply.headers.get_content_type() == "application/json"
    error = reply.json()["error"]
    assert error["status"] == status and error["code"] == code, error
    assert isinstance(error["message"], str) and error["message"]
    return error


def read_csv(reply: Reply) -> list:
    assert reply.status == 200, reply.body[:500]
    assert reply.headers["Content-Type"].replace(" ", "").lower() == "text/csv;charset=utf-8"
    return list(csv.reader(io.StringIO(reply.text, newline="")))


# ---------------------------------------------------------------------------------------------
# Times as written

_HAE = re.compile(r"(\d{4})-(\d\d)-(\d\d) (\d\d):(\d\d):(\d\d) ([+-])(\d\d)(\d\d)")
_ISO = re.compile(r"(\d{4})-(\d\d)-(\d\d)T(\d\d):(\d\d):(\d\d)(?:\.(\d{1,6}))?"
                  r"(?:(Z)|([+-])(\d\d):(\d\d))")
_DATE = re.compile(r"(\d{4})-(\d\d)-(\d\d)")


def written(raw: Any) -> dt.datetime:
    """A timestamp as the phone wrote it: an aware datetime in the offset written in it
    (HAE's ``yyyy-MM-dd HH:mm:ss ±hhmm``, ISO-8601 with ``Z`` or an offset, a date alone as
    UTC midnight, epoch seconds or milliseconds as UTC)."""
    if isinstance(raw, (int, float)) and not isinstance(raw, bool):
        seconds = raw / 1000 if abs(raw) >= 1e11 else raw
        whole = math.floor(seconds)
        return EPOCH + dt.timedelta(seconds=whole, microseconds=round((seconds - whole) * US))
    text = raw.strip()
    match = _HAE.fullmatch(text)
    if match:
        y, mo, d, h, mi, s, sign, oh, om = match.groups()
        offset = (1 if sign == "+" else -1) * dt.timedelta(hours=int(oh), minutes=int(om))
        return dt.datetime(int(y), int(mo), int(d), int(h), int(mi), int(s),
                           tzinfo=dt.timezone(offset))
    match = _ISO.fullmatch(text)
    if match:
        y, mo, d, h, mi, s, fraction, zulu, sign, oh, om = match.groups()
        offset = dt.timedelta(0) if zulu else (1 if sign == "+" else -1) * dt.timedelta(
            hours=int(oh), minutes=int(om))
        return dt.datetime(int(y), int(mo), int(d), int(h), int(mi), int(s),
                           int((fraction or "0").ljust(6, "0")), tzinfo=dt.timezone(offset))
    match = _DATE.fullmatch(text)
    if match:
        return dt.datetime(*map(int, match.groups()), tzinfo=UTC)
    raise ValueError("not a timestamp the tests read: %r" % (raw,))


def instant_us(raw: Any) -> int:
    """UTC epoch microseconds of a timestamp as written."""
    return (written(raw) - EPOCH) // dt.timedelta(microseconds=1)


def offset_s(moment: dt.datetime) -> int:
    return int(moment.utcoffset().total_seconds())


def iso_local(moment: dt.datetime) -> str:
    """``2025-04-15T07:30:00-04:00``: an aware datetime as the read spec writes local times
    (to the second)."""
    return moment.replace(microsecond=0).isoformat()


def local_iso(text: Any) -> Optional[str]:
    """HAE's ``2025-03-08 15:59:00 -0500`` as a reply writes it, ``2025-03-08T15:59:00-05:00``
    (None stays None)."""
    return None if text is None else iso_local(written(text))


def utc_iso(us: int) -> str:
    """The read spec's reply time: ISO-8601 UTC with ``Z``, a fraction only when not zero."""
    moment = _NAIVE_EPOCH + dt.timedelta(microseconds=us)
    text = moment.strftime("%Y-%m-%dT%H:%M:%S")
    if moment.microsecond:
        text += (".%06d" % moment.microsecond).rstrip("0")
    return text + "Z"


def is_offset(tz: str) -> bool:
    return bool(re.fullmatch(r"[+-]\d\d:\d\d", tz))


def offset_of(tz: str) -> int:
    sign = -1 if tz[0] == "-" else 1
    return sign * (int(tz[1:3]) * 3600 + int(tz[4:6]) * 60)


def in_zone(us: int, tz: str, raw: Any = None) -> dt.datetime:
    """An instant in the query's ``tz`` (``local``: in the offset ``raw`` was written in)."""
    if tz == "local":
        return (EPOCH + dt.timedelta(microseconds=us)).astimezone(written(raw).tzinfo)
    if is_offset(tz):
        zone = dt.timezone(dt.timedelta(seconds=offset_of(tz)))
    else:
        zone = zoneinfo.ZoneInfo(tz)
    return (EPOCH + dt.timedelta(microseconds=us)).astimezone(zone)


def local_midnight_us(day: dt.date, tz: str, seen_offset: int = 0) -> int:
    """UTC µs of local midnight of ``day`` in ``tz`` (``local``: in ``seen_offset``)."""
    if tz == "local" or is_offset(tz):
        offset = seen_offset if tz == "local" else offset_of(tz)
        return ((dt.datetime.combine(day, dt.time()) - _NAIVE_EPOCH)
                // dt.timedelta(microseconds=1)) - offset * US
    moment = dt.datetime.combine(day, dt.time(), tzinfo=zoneinfo.ZoneInfo(tz))
    return (moment - EPOCH) // dt.timedelta(microseconds=1)


def raw_start(point: dict) -> Any:
    """The start as written: ``start``, else ``startDate``, else ``date`` (storage spec)."""
    for key in ("start", "startDate", "date"):
        if point.get(key) is not None:
            return point[key]
    return None


def raw_end(point: dict) -> Any:
    for key in ("end", "endDate"):
        if point.get(key) is not None:
            return point[key]
    return raw_start(point)


def coordinate(point: dict) -> tuple:
    """(start µs, end µs, category) as the storage spec defines it, read here."""
    category = point.get("value")
    if not isinstance(category, str):
        category = point.get("kind")
    return (instant_us(raw_start(point)), instant_us(raw_end(point)),
            category if isinstance(category, str) else "")


# ---------------------------------------------------------------------------------------------
# Runs and buckets

def runs_of(items: list) -> list:
    """[(units, [point, …])]: a new run whenever the units change between consecutive
    hourly objects (all points of one UTC hour share their object's units)."""
    runs: list = []
    last_hour = None
    for point, units in items:
        hour = coordinate(point)[0] // HOUR_US
        if not runs or (hour != last_hour and units != runs[-1][0]):
            runs.append((units, []))
        runs[-1][1].append(point)
        last_hour = hour
    return runs


def in_range(items: list, start: Optional[int], end: Optional[int]) -> list:
    return [(p, u) for p, u in items if (start is None or coordinate(p)[0] >= start)
            and (end is None or coordinate(p)[0] < end)]


def numeric(value) -> bool:
    return type(value) in (int, float)


def bucket_of(us: int, raw: Any, bucket: str, tz: str) -> tuple:
    """(key, offset seen): the local clock hour's UTC start, the local date, or its week's
    Monday, of an instant in ``tz``."""
    moment = in_zone(us, tz, raw)
    if bucket == "hour":
        hour = moment.replace(minute=0, second=0, microsecond=0)
        return (hour - EPOCH) // dt.timedelta(microseconds=1), offset_s(moment)
    day = moment.date()
    if bucket == "week":
        day -= dt.timedelta(days=day.weekday())
    return day, offset_s(moment)


def bucket_place(key: Any, bucket: str, tz: str, first_offset: int) -> dict:
    """``start`` (UTC), ``local`` and ``date`` of a bucket; ``first_offset``: the offset
    its earliest point was seen in (what ``tz=local`` knows of the day)."""
    if bucket == "hour":
        if tz == "local":
            moment = (EPOCH + dt.timedelta(microseconds=key)).astimezone(
                dt.timezone(dt.timedelta(seconds=first_offset)))
        else:
            moment = in_zone(key, tz)
        return {"start": utc_iso(key), "local": iso_local(moment),
                "date": moment.date().isoformat()}
    start = local_midnight_us(key, tz, first_offset)
    if tz == "local":
        moment = (EPOCH + dt.timedelta(microseconds=start)).astimezone(
            dt.timezone(dt.timedelta(seconds=first_offset)))
    else:
        moment = in_zone(start, tz)
    return {"start": utc_iso(start), "local": iso_local(moment), "date": key.isoformat()}


def stats_of(values: list) -> dict:
    return {"count": len(values), "min": min(values), "max": max(values),
            "avg": math.fsum(values) / len(values), "sum": math.fsum(values)}


def aggregate(items: list, bucket: str, tz: str = "local") -> list:
    """The tests' own bucket aggregates, shaped as the reply's ``runs``."""
    out = []
    for units, points in runs_of(items):
        buckets: dict = {}
        for point in points:
            raw = raw_start(point)
            us = instant_us(raw)
            key, seen = bucket_of(us, raw, bucket, tz)
            entry = buckets.setdefault(key, {"count": 0, "fields": {}, "first": None})
            if entry["first"] is None or us < entry["first"][0]:
                entry["first"] = (us, seen)
            entry["count"] += 1
            for name, value in point.items():
                if numeric(value):
                    entry["fields"].setdefault(name, []).append(value)
        out.append({"units": units, "buckets": [
            dict(bucket_place(key, bucket, tz, entry["first"][1]), count=entry["count"],
                 fields={name: stats_of(values) for name, values in entry["fields"].items()})
            for key, entry in sorted(buckets.items())]})
    return out


def close(a, b, rel: float = 1e-9) -> bool:
    """Two figures equal to ``rel`` of the larger (None only equals None)."""
    if a is None or b is None:
        return a is b
    return a == b or abs(a - b) <= rel * max(abs(a), abs(b), 1e-300)


def approx(value):
    """``value`` compared to 1e-9 (relative or absolute); None stays None."""
    import pytest

    return None if value is None else pytest.approx(value, rel=1e-9, abs=1e-9)


def assert_buckets_equal(got: list, want: list) -> None:
    """Bucket runs equal: places, counts, min and max exactly; avg and sum to 1e-9."""
    assert [r["units"] for r in got] == [r["units"] for r in want]
    for got_run, want_run in zip(got, want):
        assert [(b["start"], b["local"], b["date"]) for b in got_run["buckets"]] == [
            (b["start"], b["local"], b["date"]) for b in want_run["buckets"]], want_run["units"]
        for g, w in zip(got_run["buckets"], want_run["buckets"]):
            assert g["count"] == w["count"], w["local"]
            assert set(g.get("fields", {})) == set(w["fields"]), w["local"]
            for name, stats in w["fields"].items():
                mine = g["fields"][name]
                assert set(mine) == {"count", "min", "max", "avg", "sum"}, mine
                assert (mine["count"], mine["min"], mine["max"]) == (
                    stats["count"], stats["min"], stats["max"]), (w["local"], name)
                assert close(mine["avg"], stats["avg"]) and close(mine["sum"], stats["sum"]), (
                    w["local"], name, mine, stats)


# ---------------------------------------------------------------------------------------------
# Sleep: nights as the read spec places them (READ-12)
#
# The rule ("A night belongs to the day it ends"), worked out in the tests' own way. HAE
# writes every sleep time to the second, so a stretch of time is here the SET of whole
# seconds it covers and its length the size of that set: a second that two records cover
# (a record written twice, two devices recording one night) is one element, however many
# records cover it. Sleeps of stage records are found by walking a time line of records
# opening and closing; a nightly record is a sleep of its own.

#: Stage names as HAE writes them in a record's ``value``: English, HAE 6.6.2's ``InBed``,
#: German, and HealthKit's identifiers; the stage each names.
STAGE_OF = {
    "Core": "core", "Deep": "deep", "REM": "rem", "Awake": "awake", "In Bed": "in_bed",
    "InBed": "in_bed", "Asleep": "asleep", "Kern": "core", "Tief": "deep", "Wach": "awake",
    "Im Bett": "in_bed",
    "HKCategoryValueSleepAnalysisAsleepCore": "core",
    "HKCategoryValueSleepAnalysisAsleepDeep": "deep",
    "HKCategoryValueSleepAnalysisAsleepREM": "rem",
    "HKCategoryValueSleepAnalysisAwake": "awake",
    "HKCategoryValueSleepAnalysisInBed": "in_bed",
    "HKCategoryValueSleepAnalysisAsleepUnspecified": "asleep",
}
#: The stages that are sleep: a second in any of them is a second asleep.
ASLEEP = ("core", "deep", "rem", "asleep")
#: The stages a device told apart (the unspecified "asleep" is sleep no stage was given for).
TOLD_APART = ("core", "deep", "rem")
#: The order a night's stages are listed and drawn in (READ-12, READ-13): deepest first, the
#: unspecified sleep after the Watch's stages, awake last.
STAGE_ORDER = ("deep", "core", "rem", "asleep", "awake")
#: Quiet this long or longer between stage records parts two sleeps.
QUIET_S = 3 * 3600
#: No sleep shows more than a day.
DAY_S = 24 * 3600
#: HAE adds hours up as floats and writes times to the second: a figure that passes its
#: bound by one second or less has not passed it.
SLACK_S = 1
#: A nap: under this many hours asleep, wholly between these local clock times.
NAP_HOURS = 3
NAP_FROM, NAP_UNTIL = dt.time(10, 0), dt.time(20, 0)


class Sleep(NamedTuple):
    """One sleep as the tests work it out."""

    date: dt.date  # the local date it ended on
    end: int  # UTC epoch seconds
    start: Optional[int]  # its bedtime as shown (None: not known)
    end_text: Any  # the end as written
    start_text: Any
    asleep: Optional[float]  # hours
    in_bed: Optional[float]
    stages: dict  # stage -> hours
    form: str  # "nightly" (one record a night) or "records" (stage segments)
    overlapping: bool
    window: tuple = (None, None)  # (first second, its text) of the time it covers
    counted: Optional[str] = None
    said: Optional[float] = None
    limit: Optional[float] = None
    limit_by: Optional[str] = None
    scaled: bool = False
    sources: tuple = ()


def second_of(raw: Any) -> int:
    """The UTC epoch second of a sleep time as written (HAE writes them to the second)."""
    us = instant_us(raw)
    assert us % US == 0, ("a sleep time with a fraction of a second", raw)
    return us // US


def seconds_in(spans) -> set:
    """Every whole second that one of ``spans`` ((first second, end second): the end itself
    not included) covers."""
    covered: set = set()
    for first, end in spans:
        covered.update(range(first, end))
    return covered


def hours_in(seconds) -> float:
    return len(seconds) / 3600


def _positive(value) -> Optional[float]:
    return float(value) if numeric(value) and value > 0 else None


def sources_of(point: dict) -> list:
    """The names a point's ``source`` gives: HAE joins a night's sources with ``|``."""
    names = []
    for name in (point.get("source") or "").split("|"):
        if name.strip() and name.strip() not in names:
            names.append(name.strip())
    return names


def along_the_time_line(items: list) -> list:
    """``items`` ((first second, end second, anything)) in sleeps, by walking the time line
    from the earliest moment on: each item opens at its first second and closes at its end.
    While any item is open we are inside a sleep. Once all have closed, quiet begins; an item
    opening after 3 h of quiet or more begins a new sleep, one opening sooner belongs to the
    sleep before it. Returns the sleeps, each a list of its items."""
    moments = []
    for n, (first, end, _) in enumerate(items):
        moments += [(first, "opens", n), (end, "shuts", n)]
    sleeps: list = []
    open_now, quiet_since = 0, None
    for moment, what, n in sorted(moments):  # "opens" before "shuts" at one moment
        if what == "shuts":
            open_now -= 1
            if open_now == 0:
                quiet_since = moment
            continue
        if open_now == 0 and (quiet_since is None or moment - quiet_since >= QUIET_S):
            sleeps.append([])
        sleeps[-1].append(items[n])
        open_now += 1
    return sleeps


def _on_date(second: int, text: Any, tz: str) -> dt.date:
    return in_zone(second * US, tz, text).date()


def record_sleeps(records: list, tz: str = "local") -> list:
    """Stage records (``start``/``end``, else ``startDate``/``endDate``; the stage in
    ``value``) as sleeps, step by step:

    1. a record covers the seconds from its start to its end; one that covers none is no
       sleep;
    2. the records are walked along the time line (:func:`along_the_time_line`): records
       with less than 3 h of quiet between them are one sleep;
    3. each second of the sleep is in one stage: of the told-apart stages (core, deep, REM)
       covering it, that of the record that began last (the copy that began earlier is
       late); else unspecified sleep if an "asleep" record covers it; else awake if an
       awake record does. Asleep is the seconds in a stage of sleep; in bed the seconds any
       in-bed record covers;
    4. the sleep is overlapping when its asleep records' lengths, added up, come to more
       than the seconds asleep, or when those come to more than a day (a record kept
       running); it shows at most a day asleep, its stages then their shares of the day,
       and an overlapping sleep's awake time at most what its span (or a day) leaves;
    5. stage hours are shown only when a device told some apart; a sleep of unspecified
       records alone shows none;
    6. it ended at its last record's end, on that moment's local date; it started at its
       first record's start, in that record's offset."""
    items = []
    for point in records:
        first, end = second_of(raw_start(point)), second_of(raw_end(point))
        if end > first:
            items.append((first, end, point))
    out = []
    for sleep in along_the_time_line(items):
        told: dict = {}  # second -> (the start of the record that holds it, its stage)
        unspecified, awake, in_bed = set(), set(), set()
        added_up = 0
        named: dict = {}  # a source's name -> its first record's start
        for first, end, point in sleep:
            stage = STAGE_OF[point["value"]]
            for name in sources_of(point):
                named[name] = min(named.get(name, first), first)
            if stage in ASLEEP:
                added_up += end - first
            for second in range(first, end):
                if stage in TOLD_APART:
                    rank = (first, -STAGE_ORDER.index(stage))
                    if second not in told or rank > told[second][0]:
                        told[second] = (rank, stage)
                else:
                    {"asleep": unspecified, "awake": awake, "in_bed": in_bed}[stage].add(second)
        seconds = {stage: 0 for stage in STAGE_ORDER}
        for _, stage in told.values():
            seconds[stage] += 1
        seconds["asleep"] = len(unspecified - set(told))
        seconds["awake"] = len(awake - set(told) - unspecified)
        asleep_s = len(told) + seconds["asleep"]
        asleep = min(asleep_s, DAY_S) / 3600 if asleep_s else None
        share = min(1.0, DAY_S / asleep_s) if asleep_s else 1.0
        first = min(sleep, key=lambda item: item[0])
        last = max(sleep, key=lambda item: item[1])
        end_text = raw_end(last[2])
        span_s = last[1] - first[0]
        overlapping = added_up > asleep_s or asleep_s > DAY_S
        stages = {}
        if told:
            stages = {stage: seconds[stage] / 3600 * share for stage in ASLEEP
                      if seconds[stage]}
            awake_h = seconds["awake"] / 3600 * share
            if overlapping:  # awake fits in what the most it holds leaves beside sleep
                awake_h = min(awake_h, min(span_s, DAY_S) / 3600 - asleep)
            if awake_h > 0:
                stages["awake"] = awake_h
        out.append(Sleep(_on_date(last[1], end_text, tz), last[1], first[0], end_text,
                         raw_start(first[2]), asleep,
                         min(len(in_bed), DAY_S) / 3600 if in_bed else None, stages,
                         "records", overlapping,
                         (first[0], raw_start(first[2])), "union" if asleep_s else None,
                         added_up / 3600 if asleep_s else None, min(span_s, DAY_S) / 3600,
                         "day" if span_s > DAY_S else "window", asleep_s > DAY_S,
                         tuple(sorted(named, key=lambda name: (named[name], name)))))
    return out


def nightly_sleep(point: dict) -> dict:
    """What one nightly record says, in the rule's words: it ends at ``sleepEnd``, else
    ``inBedEnd``, else ``date``, and starts at ``sleepStart``, else ``inBedStart`` (no start
    unless before its end); HAE's own total is ``totalSleep``, else ``asleep + core + deep +
    rem`` (HAE's ``asleep`` beside stages being only the unspecified part); the staged
    figure is ``core + deep + rem``; in bed is ``inBed``, in the window
    ``inBedStart``-``inBedEnd`` (else the sleep's own)."""
    end_text = next(point[k] for k in ("sleepEnd", "inBedEnd", "date") if point.get(k))
    start_text = point.get("sleepStart") or point.get("inBedStart")
    end = second_of(end_text)
    start = None if start_text is None else second_of(start_text)
    if start is not None and start >= end:
        start = start_text = None
    told = {stage: _positive(point.get(stage)) for stage in TOLD_APART}
    told = {stage: hours for stage, hours in told.items() if hours is not None}
    staged = math.fsum(told.values())
    unspecified = _positive(point.get("asleep")) or 0.0
    said = _positive(point.get("totalSleep"))
    if said is None and (staged or unspecified):
        said = unspecified + staged
    bed_from, bed_to = point.get("inBedStart"), point.get("inBedEnd")
    bed_window = None
    if bed_from and bed_to and second_of(bed_to) > second_of(bed_from):
        bed_window = (second_of(bed_from), second_of(bed_to))
    elif start is not None:
        bed_window = (start, end)
    return {"end": end, "end_text": end_text, "start": start, "start_text": start_text,
            "said": said, "staged": staged, "told": told, "unspecified": unspecified,
            "awake": _positive(point.get("awake")) or 0.0,
            "in_bed": _positive(point.get("inBed")), "bed_window": bed_window,
            "sources": tuple(sources_of(point))}


def nightly_sleeps(points: list, tz: str = "local", records: list = ()) -> list:
    """Nightly records as sleeps, step by step:

    1. the same night summarised twice (one sleep start; a record without a start is known
       by its end) counts once: the record of the latest end is kept (of two ending
       together, the one with more keys);
    2. every kept record is a sleep of its own: records are never joined, even when one
       starts where another ended (HAE bounds a record's window by the record before it);
    3. the most it can hold (its limit) is the smallest of its window (its start to its
       end, when it has a start), its own ``inBed`` hours (when more than 0) and a day;
    4. its hours asleep are HAE's total. If that passes the limit (by more than a second),
       its sources overlap: it is marked overlapping and counts the staged figure
       (core + deep + rem), else ``asleep``, else the total; never more than the limit;
    5. its stages are shown only when it has told-apart ones: for the total, core, deep,
       REM and its unspecified ``asleep``; for the staged figure, core, deep and REM alone;
       when the figure counted was more than the limit, each is its share of the hours
       counted (scaled). Awake follows the same share, and on an overlapping night takes at
       most what the limit leaves beside the hours asleep;
    6. in bed: ``inBed``, never more than the seconds of its in-bed window nor a day; more
       than that (by a second) is overlapping too, and awake is then held to its limit;
    7. its bedtime is its start, except where its start is another record's end: then the
       first start of the last sleep of the stage ``records`` inside its window, else not
       known;
    8. it ended at its end, on that moment's local date."""
    kept: dict = {}
    for point in points:
        said = nightly_sleep(point)
        known_by = said["end"] if said["start"] is None else said["start"]
        rank = (said["end"], len(point))
        if known_by not in kept or rank >= kept[known_by][0]:
            kept[known_by] = (rank, said)
    summaries = [said for _, said in kept.values()]
    ends = {s["end"] for s in summaries}
    timed = [(second_of(raw_start(p)), second_of(raw_end(p)), p) for p in records]
    out = []
    for s in summaries:
        bounds = [(DAY_S / 3600, "day")]
        if s["in_bed"] is not None:
            bounds.append((s["in_bed"], "in_bed"))
        if s["start"] is not None:
            bounds.append(((s["end"] - s["start"]) / 3600, "window"))
        limit, limit_by = min(bounds, key=lambda b: b[0])
        asleep = counted = None
        overlapping = scaled = False
        shown: dict = {}
        figure = None
        if s["said"] is not None:
            if s["said"] * 3600 <= limit * 3600 + SLACK_S:
                counted, figure = "total", s["said"]
                if s["told"]:
                    shown = dict(s["told"])
                    if s["unspecified"]:
                        shown["asleep"] = s["unspecified"]
            else:
                overlapping = True
                if s["staged"]:
                    counted, figure, shown = "staged", s["staged"], dict(s["told"])
                    scaled = figure * 3600 > limit * 3600 + SLACK_S
                else:
                    counted, figure = "unspecified", s["unspecified"] or s["said"]
            asleep = min(figure, limit)
        in_bed = s["in_bed"]
        if in_bed is not None:
            bed_most = min(len(seconds_in([s["bed_window"]])), DAY_S) \
                if s["bed_window"] else DAY_S
            if in_bed * 3600 > bed_most + SLACK_S:
                overlapping = True
            in_bed = min(in_bed, bed_most / 3600)
        share = asleep / figure if shown and figure > asleep else 1.0
        stages = {stage: hours * share for stage, hours in shown.items()}
        if shown and s["awake"]:
            awake = s["awake"] * share
            if overlapping:
                awake = min(awake, max(0.0, limit - asleep))
            if awake > 0:
                stages["awake"] = awake
        start, start_text = s["start"], s["start_text"]
        if start is not None and start in ends:  # HAE's boundary: no bedtime
            inside = [item for item in timed if start <= item[0] and item[1] <= s["end"]
                      and item[1] > item[0]]
            last_sleep = along_the_time_line(inside)[-1:] if inside else []
            first = min(last_sleep[0], key=lambda item: item[0]) if last_sleep else None
            start, start_text = (None, None) if first is None else (first[0],
                                                                    raw_start(first[2]))
        out.append(Sleep(_on_date(s["end"], s["end_text"], tz), s["end"], start,
                         s["end_text"], start_text, asleep, in_bed, stages, "nightly",
                         overlapping, (s["start"], s["start_text"]), counted, s["said"],
                         limit, limit_by, scaled, s["sources"]))
    return out


def _length(sleep: Sleep) -> tuple:
    return (sleep.asleep or 0.0, sleep.in_bed or 0.0, sleep.end)


def is_nap(sleep: Sleep, tz: str = "local") -> bool:
    """Under 3 h asleep, its time wholly between 10:00 and 20:00 of one local day (its
    window: from the first second it covers, whether or not that is a bedtime)."""
    first, first_text = sleep.window
    if first is None or (sleep.asleep or 0.0) >= NAP_HOURS:
        return False
    began = in_zone(first * US, tz, first_text)
    ended = in_zone(sleep.end * US, tz, sleep.end_text)
    return (began.date() == ended.date() and began.time() >= NAP_FROM
            and ended.time() <= NAP_UNTIL)


def nights_by_date(summaries: list, records: list, tz: str = "local") -> dict:
    """date -> the date's sleeps: its night first (None on a date of naps only), then its
    naps in the order they ended:

    1. the sleeps of the nightly records and of the stage records, each on the local date it
       ended on;
    2. a date with a sleep of nightly records keeps those only; else the sleeps of its
       records;
    3. a nap (:func:`is_nap`) is never a night; the date's night is its longest other sleep
       (the most hours asleep, then in bed, then the later end); every other sleep of the
       date is a nap beside it, never added to the night."""
    by_date: dict = {}
    for sleep in nightly_sleeps(summaries, tz, records):
        by_date.setdefault(sleep.date, []).append(sleep)
    for sleep in record_sleeps(records, tz):
        if all(s.form == "records" for s in by_date.get(sleep.date, [])):
            by_date.setdefault(sleep.date, []).append(sleep)
    out = {}
    for date, sleeps in by_date.items():
        nights = [s for s in sleeps if not is_nap(s, tz)]
        night = max(nights, key=_length) if nights else None
        out[date] = [night] + sorted((s for s in sleeps if s is not night),
                                     key=lambda s: s.end)
    return out


def sleep_dates(summaries: list, records: list, tz: str = "local") -> dict:
    """coordinate (:func:`coordinate`) -> the local date a sleep point is exported on: its
    sleep's wake day (READ-12.5). A summary's is the date of its own end; a stage record's
    is the date its sleep (its records' sleep, :func:`record_sleeps`) ended on."""
    out = {}
    for point in summaries:
        said = nightly_sleep(point)
        out[coordinate(point)] = _on_date(said["end"], said["end_text"], tz)
    items = [(second_of(raw_start(p)), second_of(raw_end(p)), p) for p in records]
    for sleep in along_the_time_line([item for item in items if item[1] > item[0]]):
        last = max(sleep, key=lambda item: item[1])
        date = _on_date(last[1], raw_end(last[2]), tz)
        for _, _, point in sleep:
            out[coordinate(point)] = date
    for _, end, point in items:  # a record without length: its own end's date
        out.setdefault(coordinate(point), _on_date(end, raw_end(point), tz))
    return out


def _mean(values: list, nights: int = None) -> Optional[float]:
    known = [v for v in values if v is not None]
    return math.fsum(known) / (nights or len(known)) if known else None


def local_text(second: Optional[int], text: Any, tz: str) -> Optional[str]:
    return None if second is None else iso_local(in_zone(second * US, tz, text))


def nap_item(nap: Sleep, tz: str) -> dict:
    return {"sleep_start": local_text(nap.start, nap.start_text, tz),
            "sleep_end": local_text(nap.end, nap.end_text, tz), "date": nap.date.isoformat(),
            "asleep": nap.asleep, "in_bed": nap.in_bed, "overlapping": nap.overlapping}


def _end_offset(sleep: Sleep, tz: str) -> int:
    return offset_s(in_zone(sleep.end * US, tz, sleep.end_text))


def _forms(sleeps: list) -> str:
    forms = {sleep.form for sleep in sleeps}
    return forms.pop() if len(forms) == 1 else "mixed"


def night_items(by_date: dict, tz: str = "local") -> list:
    """The reply's day items: per date its night's hours, stages, start and end in local
    time, form and overlap, and how it was counted; its naps listed beside it; ``count``
    the night and its naps, ``nights`` 1, or 0 on a date of naps only (no hours then). The
    item starts at local midnight of its date (``tz=local``: in the offset its night, else
    its first nap, ended in, all that ``local`` knows of that day)."""
    out = []
    for date in sorted(by_date):
        night, *naps = by_date[date]
        first = night or min(naps, key=lambda n: n.end)
        out.append({**bucket_place(date, "day", tz, _end_offset(first, tz)),
                    "date": date.isoformat(), "count": (night is not None) + len(naps),
                    "nights": int(night is not None),
                    "asleep": night and night.asleep, "in_bed": night and night.in_bed,
                    "stages": dict(night.stages) if night else {},
                    "sleep_start": night and local_text(night.start, night.start_text, tz),
                    "sleep_end": night and local_text(night.end, night.end_text, tz),
                    "form": _forms([night] if night else naps),
                    "overlapping": bool(night and night.overlapping),
                    "counted": night and night.counted, "said": night and night.said,
                    "limit": night and night.limit, "limit_by": night and night.limit_by,
                    "scaled": bool(night and night.scaled),
                    "sources": list(night.sources) if night else [],
                    "naps": [nap_item(nap, tz) for nap in naps]})
    return out


def week_items(by_date: dict, tz: str = "local") -> list:
    """The reply's week items (weeks from Monday): the average night of the week's dates
    with one (a stage a night lacks counts 0 h for it; a date of naps only is none); the
    naps listed, never averaged in; ``count`` the nights and the naps, ``overlapping`` how
    many nights are. The item starts at local midnight of its Monday (``tz=local``: in the
    offset the week's first night, else nap, ended in)."""
    weeks: dict = {}
    for date in sorted(by_date):
        weeks.setdefault(date - dt.timedelta(days=date.weekday()), []).append(by_date[date])
    out = []
    for monday in sorted(weeks):
        days = weeks[monday]
        nights = [sleeps[0] for sleeps in days if sleeps[0] is not None]
        naps = [nap for sleeps in days for nap in sleeps[1:]]
        stages: dict = {}
        for night in nights:
            for stage, hours in night.stages.items():
                stages.setdefault(stage, []).append(hours)
        first = min(nights or naps, key=lambda n: n.end)
        out.append({**bucket_place(monday, "week", tz, _end_offset(first, tz)),
                    "date": monday.isoformat(), "count": len(nights) + len(naps),
                    "nights": len(nights), "asleep": _mean([n.asleep for n in nights]),
                    "in_bed": _mean([n.in_bed for n in nights]),
                    "stages": {stage: _mean(hours, len(nights))
                               for stage, hours in stages.items()},
                    "form": _forms(nights or naps),
                    "overlapping": sum(n.overlapping for n in nights),
                    "naps": [nap_item(nap, tz) for nap in naps]})
    return out


def average_night(by_date: dict) -> dict:
    """The range's average night: the mean of its nights' hours (a date of naps only has
    none), never a mean of weeks' means."""
    nights = [sleeps[0] for sleeps in by_date.values() if sleeps[0] is not None]
    return {"nights": len(nights), "asleep": _mean([n.asleep for n in nights]),
            "in_bed": _mean([n.in_bed for n in nights])}


def assert_hours(got: Optional[float], want: Optional[float], what: Any) -> None:
    if want is None:
        assert got is None, (what, got)
    else:
        assert got is not None and close(got, want, 1e-9), (what, got, want)


def assert_naps_equal(got: list, want: list, what: Any) -> None:
    assert [(n["sleep_start"], n["sleep_end"], n["date"]) for n in got] == [
        (n["sleep_start"], n["sleep_end"], n["date"]) for n in want], what
    for g, w in zip(got, want):
        assert_hours(g["asleep"], w["asleep"], (what, "nap asleep", w["sleep_end"]))
        assert_hours(g["in_bed"], w["in_bed"], (what, "nap in bed", w["sleep_end"]))
        assert g["overlapping"] is w["overlapping"], (what, "nap", g)


def assert_nights_equal(got: list, want: list, week: bool = False) -> None:
    """The reply's ``nights`` against the tests' own: dates, counts, hours (to 1e-9, a stage
    missing in the reply is 0 h), overlap, naps, local start and end, form, how each night
    was counted, and each item's ``start`` and ``local``: local midnight of its date. No
    night's stages of sleep add up to more than its hours asleep."""
    assert [(n["date"], n["count"]) for n in got] == [(n["date"], n["count"]) for n in want]
    for g, w in zip(got, want):
        assert g["nights"] == w["nights"], g
        assert_hours(g["asleep"], w["asleep"], (w["date"], "asleep"))
        assert_hours(g["in_bed"], w["in_bed"], (w["date"], "in_bed"))
        assert set(g["stages"]) <= {"core", "deep", "rem", "awake", "asleep"}, g["stages"]
        assert list(g["stages"]) == [s for s in STAGE_ORDER if s in g["stages"]], g["stages"]
        for stage in set(g["stages"]) | set(w["stages"]):
            assert close(g["stages"].get(stage, 0.0), w["stages"].get(stage, 0.0)), (
                w["date"], stage, g["stages"], w["stages"])
        sleep = math.fsum(h for s, h in g["stages"].items() if s in ASLEEP)
        assert sleep <= (g["asleep"] or 0.0) + 1e-9, (w["date"], "stages past the night", g)
        assert g["form"] == w["form"], (w["date"], g["form"])
        assert g["overlapping"] == w["overlapping"], (w["date"], "overlapping", g, w)
        assert type(g["overlapping"]) is (int if week else bool), g
        assert_naps_equal(g["naps"], w["naps"], w["date"])
        assert (g["start"], g["local"]) == (w["start"], w["local"]), (g, w)
        if not week:
            assert (g["sleep_start"], g["sleep_end"]) == (w["sleep_start"], w["sleep_end"]), (
                w["date"], g, w)
            assert (g["counted"], g["limit_by"], g["scaled"], g["sources"]) == (
                w["counted"], w["limit_by"], w["scaled"], w["sources"]), (w["date"], g, w)
            assert_hours(g["said"], w["said"], (w["date"], "said"))
            assert_hours(g["limit"], w["limit"], (w["date"], "limit"))


# -- the module store: a corpus posted to a serve subprocess ------------------------------


class Store(NamedTuple):
    """A running server holding a module's data: its data directory, address and the
    corpus it was built from (what the test knows it sent)."""

    data_dir: Any
    address: tuple
    corpus: Any

    @property
    def client(self) -> Client:
        return Client(*self.address)

    @property
    def base(self) -> str:
        """The page's origin, ``http://127.0.0.1:PORT``."""
        return "http://%s:%d" % self.address


def pending(data_dir) -> int:
    return db_rows(data_dir, "SELECT count(*) AS n FROM delivery"
                             " WHERE parse_status = 'pending'")[0]["n"]


def serve_corpus(base, corpus, deliveries, extra_canaries=(), all_parsed: bool = True):
    """A module fixture's body: ``deliveries`` ((headers, body)) posted to a serve
    subprocess in ``base`` and folded by its worker; the server keeps running while the
    fixture lasts (export runs beside it), and its log is checked for leaks after."""
    data_dir = base / "data"
    proc = ServeProcess(data_dir, base / "serve.log")
    try:
        client = proc.client
        for headers, body in deliveries:
            status, answer = client.ingest(body, headers=dict(headers))
            assert status == 200, answer
        wait_for(lambda: pending(data_dir) == 0, timeout=120, what="every delivery folded")
        if all_parsed:
            statuses = {row["parse_status"] for row in db_rows(data_dir)}
            assert statuses == {"parsed"}, statuses
        yield Store(data_dir, ("127.0.0.1", proc.port), corpus)
    finally:
        proc.terminate()
    assert_no_leaks(proc.log_lines(), extra=extra_canaries)



# -- a phone in New York (test_summary.py, test_mcp.py) ------------------------------------------

NEW_YORK = zoneinfo.ZoneInfo("America/New_York")


def ny_stamp(day: dt.date, minute: int = 0) -> str:
    """HAE's timestamp of the moment ``minute`` minutes after local midnight in New York
    (elapsed time: a DST day has 23 or 25 hours), with the offset of that moment."""
    midnight = dt.datetime(day.year, day.month, day.day, tzinfo=NEW_YORK).astimezone(UTC)
    moment = (midnight + dt.timedelta(minutes=minute)).astimezone(NEW_YORK)
    offset = int(moment.utcoffset().total_seconds()) // 60
    return "%s %s%02d%02d" % (moment.strftime("%Y-%m-%d %H:%M:%S"), "-" if offset < 0 else "+",
                              abs(offset) // 60, abs(offset) % 60)


def written_date(text: str) -> dt.date:
    """The local date the phone wrote in a timestamp."""
    return dt.date.fromisoformat(text[:10])


def ny_steps(day: dt.date, source: str) -> list:
    """Steps every 4 minutes of one local day of a phone in New York (all of a 23- or 25-hour
    day), the values a function of the day and the minute."""
    seed = day.toordinal()
    points = [{"date": ny_stamp(day, m), "qty": 5 + (seed * 7 + m * 13) % 17, "source": source}
              for m in range(0, 25 * 60, 4)]
    return [p for p in points if written_date(p["date"]) == day]  # that local day only



# -- answers' shapes -------------------------------------------------------------------------------


#: The Content-Security-Policy every page and answer carries.
CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
       "connect-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'")


def assert_security_headers(headers) -> None:
    """The headers every page and answer carries (any mapping; names in any case)."""
    found = {name.lower(): value for name, value in headers.items()}
    assert found["content-security-policy"] == CSP
    assert found["x-content-type-options"] == "nosniff"
    assert found["referrer-policy"] == "no-referrer"
    assert found["x-frame-options"] == "DENY"


def select(document, path: str) -> list:
    """A dotted path as JSONata reads it (arrays on the way are mapped and flattened), the
    only selector syntax the dashboard may use; a trailing ``[]`` keeps a list."""
    assert _PATH.fullmatch(path), "selector outside the tested subset: %r" % path
    values = [document]
    for step in path.rstrip("[]").split("."):
        found = []
        for item in values:
            value = item.get(step) if isinstance(item, dict) else None
            found += value if isinstance(value, list) else [] if value is None else [value]
        values = found
    return values

_PATH = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)*(\[\])?")


def raw_runs(items: list) -> list:
    return [{"units": units, "points": points} for units, points in runs_of(items)]


def hours_between(first: str, last: str) -> float:
    """Elapsed hours between two times as HAE writes them (each in its own offset)."""
    return (written(last) - written(first)).total_seconds() / 3600



# -- the summary's usual ----------------------------------------------------------------------

USUAL_DAYS, USUAL_MIN_DAYS = 30, 5
"""The usual of a day: the median of the days before it within USUAL_DAYS, given at least
USUAL_MIN_DAYS of them (the summary spec)."""


def usual_of(values: dict, on: dt.date):
    """The usual of day ``on`` from ``values`` (date -> value), or None (too few days)."""
    before = [v for d, v in values.items() if on - dt.timedelta(days=USUAL_DAYS) <= d < on]
    return statistics.median(before) if len(before) >= USUAL_MIN_DAYS else None
