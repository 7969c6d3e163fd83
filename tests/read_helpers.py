"""Helpers of the read-side tests (test_read.py, test_read_time.py, test_read_records.py):
HTTP calls that keep the headers, and the tests' own reading of times, buckets and nights.

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
    return a == b or abs(a - b) <= rel * max(abs(a), abs(b), 1e-300)


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
# records cover it. Sleeps are found by walking a time line of records opening and closing.

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
#: The stage figures a nightly record carries beside its totals.
NIGHTLY_STAGES = ("core", "deep", "rem", "awake")
#: The order a night's stages are listed and drawn in (READ-12, READ-13): deepest first, the
#: unspecified sleep after the Watch's stages, awake last.
STAGE_ORDER = ("deep", "core", "rem", "asleep", "awake")
#: Quiet this long or longer between records parts two sleeps.
QUIET_S = 3 * 3600
#: No sleep shows more than a day.
DAY_S = 24 * 3600
#: HAE sums hours as floats and writes windows to the second: a figure less than a minute
#: past its window is not past it.
SLACK_S = 60


class Sleep(NamedTuple):
    """One sleep as the tests work it out."""

    date: dt.date  # the local date it ended on
    end: int  # UTC epoch seconds
    start: Optional[int]
    end_text: Any  # the end as written
    start_text: Any
    asleep: Optional[float]  # hours
    in_bed: Optional[float]
    stages: dict  # stage -> hours
    form: str  # "nightly" (one record a night) or "records" (stage segments)
    overlapping: bool


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


def hours_in(seconds: set) -> float:
    return len(seconds) / 3600


def _positive(value) -> Optional[float]:
    return float(value) if numeric(value) and value > 0 else None


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
    3. a stage's hours are the seconds that any record of that stage covers; asleep is the
       seconds any core, deep, REM or unspecified asleep record covers; in bed the seconds
       any in-bed record covers. A second covered by two records counts once;
    4. the sleep is overlapping when its asleep records' lengths, added up, come to more
       than the seconds they cover (a minute of slack), or when those seconds come to more
       than a day (no one sleeps longer: a record kept running);
    5. no figure of a sleep is more than a day (its window, the seconds from its first
       record's start to its last end, holds every record, so asleep never exceeds it);
    6. it ended at its last record's end, on that moment's local date; it started at its
       first record's start, in that record's offset."""
    items = []
    for point in records:
        first, end = second_of(raw_start(point)), second_of(raw_end(point))
        if end > first:
            items.append((first, end, point))
    out = []
    for sleep in along_the_time_line(items):
        by_stage: dict = {}
        added_up = 0
        for first, end, point in sleep:
            stage = STAGE_OF[point["value"]]
            by_stage.setdefault(stage, []).append((first, end))
            if stage in ASLEEP:
                added_up += end - first
        covered = {stage: seconds_in(spans) for stage, spans in by_stage.items()}
        asleep_seconds: set = set()
        for stage in ASLEEP:
            asleep_seconds |= covered.get(stage, set())
        asleep = min(hours_in(asleep_seconds), DAY_S / 3600) if asleep_seconds else None
        in_bed = (min(hours_in(covered["in_bed"]), DAY_S / 3600) if "in_bed" in covered
                  else None)
        stages = {stage: min(hours_in(seconds), DAY_S / 3600)
                  for stage, seconds in covered.items() if stage != "in_bed"}
        first = min(sleep, key=lambda item: item[0])
        last = max(sleep, key=lambda item: item[1])
        end_text = raw_end(last[2])
        out.append(Sleep(_on_date(last[1], end_text, tz), last[1], first[0], end_text,
                         raw_start(first[2]), asleep, in_bed, stages, "records",
                         added_up > len(asleep_seconds) + SLACK_S
                         or len(asleep_seconds) > DAY_S))
    return out


def nightly_sleep(point: dict) -> dict:
    """What one nightly record says, in the rule's words: it ends at ``sleepEnd``, else
    ``inBedEnd``, else ``date``, and starts at ``sleepStart``, else ``inBedStart`` (no start
    unless before its end); HAE's own total is ``totalSleep``, else ``asleep + core + deep +
    rem`` (HAE's ``asleep`` beside stages being only the unspecified part); the Watch's
    staged figure is ``core + deep + rem``; in bed is ``inBed``, in the window
    ``inBedStart``-``inBedEnd`` (else the sleep's own)."""
    end_text = next(point[k] for k in ("sleepEnd", "inBedEnd", "date") if point.get(k))
    start_text = point.get("sleepStart") or point.get("inBedStart")
    end = second_of(end_text)
    start = None if start_text is None else second_of(start_text)
    if start is not None and start >= end:
        start = start_text = None
    stages = {stage: _positive(point.get(stage)) for stage in NIGHTLY_STAGES}
    stages = {stage: hours for stage, hours in stages.items() if hours is not None}
    staged = math.fsum(stages.get(stage, 0.0) for stage in ("core", "deep", "rem"))
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
            "said": said, "staged": staged, "unspecified": unspecified,
            "in_bed": _positive(point.get("inBed")), "bed_window": bed_window,
            "stages": stages}


def nightly_sleeps(points: list, tz: str = "local") -> list:
    """Summary records as sleeps, step by step:

    1. the same night summarised twice (one sleep start; a record without a start is known
       by its end) counts once: the summary of the latest end is kept (of two ending
       together, the one with more keys);
    2. each summary covers its window, from its start to its end; the windows are walked
       along the time line (:func:`along_the_time_line`): less than 3 h of quiet between
       them, one sleep. A summary without a start is a sleep alone;
    3. the most a sleep can hold is the seconds its windows cover (the gaps between them
       left out) and never more than a day (a day when a summary has no window);
    4. its hours asleep are what its summaries say, added up. If that is more than the most
       (by more than a minute), its sources overlap: it is marked overlapping and its hours
       are the Watch's staged figure (core + deep + rem, added up), else the ``asleep``
       figures, else what they say, but never more than the most;
    5. in bed likewise: the ``inBed`` figures added up, never more than the seconds their
       in-bed windows cover nor a day; more than that is overlapping too;
    6. its stage hours are the summaries' stage figures, added up (at most a day each);
    7. it ended at its latest end, on that moment's local date, and started at its earliest
       start, as written."""
    kept: dict = {}
    for point in points:
        said = nightly_sleep(point)
        known_by = said["end"] if said["start"] is None else said["start"]
        rank = (said["end"], len(point))
        if known_by not in kept or rank >= kept[known_by][0]:
            kept[known_by] = (rank, said)
    summaries = [said for _, said in kept.values()]
    with_window = [(s["start"], s["end"], s) for s in summaries if s["start"] is not None]
    groups = [[s for _, _, s in group] for group in along_the_time_line(with_window)]
    groups += [[s] for s in summaries if s["start"] is None]
    out = []
    for group in groups:
        if all(s["start"] is not None for s in group):
            most = min(len(seconds_in((s["start"], s["end"]) for s in group)), DAY_S)
        else:
            most = DAY_S
        figures = [s["said"] for s in group if s["said"] is not None]
        asleep, overlapping = None, False
        if figures:
            asleep = math.fsum(figures)
            if asleep * 3600 > most + SLACK_S:
                overlapping = True
                staged = math.fsum(s["staged"] for s in group)
                unspecified = math.fsum(s["unspecified"] for s in group)
                asleep = min(staged or unspecified or asleep, most / 3600)
        beds = [s["in_bed"] for s in group if s["in_bed"] is not None]
        in_bed = None
        if beds:
            windows = [s["bed_window"] for s in group if s["bed_window"] is not None]
            bed_most = (min(len(seconds_in(windows)), DAY_S) if len(windows) == len(group)
                        else DAY_S)
            in_bed = math.fsum(beds)
            if in_bed * 3600 > bed_most + SLACK_S:
                overlapping = True
                in_bed = bed_most / 3600
        stages: dict = {}
        for s in group:
            for stage, hours in s["stages"].items():
                stages.setdefault(stage, []).append(hours)
        last = max(group, key=lambda s: s["end"])
        starts = [s for s in group if s["start"] is not None]
        first = min(starts, key=lambda s: s["start"]) if starts else None
        out.append(Sleep(_on_date(last["end"], last["end_text"], tz), last["end"],
                         first and first["start"], last["end_text"],
                         first and first["start_text"], asleep, in_bed,
                         {stage: min(math.fsum(hours), DAY_S / 3600)
                          for stage, hours in stages.items()},
                         "nightly", overlapping))
    return out


def _length(sleep: Sleep) -> tuple:
    return (sleep.asleep or 0.0, sleep.in_bed or 0.0, sleep.end)


def nights_by_date(summaries: list, records: list, tz: str = "local") -> dict:
    """date -> the date's sleeps, its night first, then its naps in the order they ended:

    1. the sleeps of the summaries and of the stage records, each on the local date it
       ended on;
    2. a date with a sleep of summaries keeps those only; else the sleeps of its records;
    3. the date's night is its longest sleep (the most hours asleep, then in bed, then the
       later end); every other sleep of the date is a nap, never added to the night."""
    by_date: dict = {}
    for sleep in nightly_sleeps(summaries, tz):
        by_date.setdefault(sleep.date, []).append(sleep)
    for sleep in record_sleeps(records, tz):
        if all(s.form == "records" for s in by_date.get(sleep.date, [])):
            by_date.setdefault(sleep.date, []).append(sleep)
    out = {}
    for date, sleeps in by_date.items():
        night = max(sleeps, key=_length)
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


def local_text(second: int, text: Any, tz: str) -> str:
    return iso_local(in_zone(second * US, tz, text))


def nap_item(nap: Sleep, tz: str) -> dict:
    return {"sleep_start": None if nap.start is None else local_text(nap.start,
                                                                     nap.start_text, tz),
            "sleep_end": local_text(nap.end, nap.end_text, tz), "date": nap.date.isoformat(),
            "asleep": nap.asleep, "in_bed": nap.in_bed, "overlapping": nap.overlapping}


def _end_offset(sleep: Sleep, tz: str) -> int:
    return offset_s(in_zone(sleep.end * US, tz, sleep.end_text))


def night_items(by_date: dict, tz: str = "local") -> list:
    """The reply's day items: per date its night's hours, stages, start and end in local
    time, form and overlap; its naps listed beside it; ``count`` the night and its naps.
    The item starts at local midnight of its date (``tz=local``: in the offset its night
    ended in, all that ``local`` knows of that day)."""
    out = []
    for date in sorted(by_date):
        night, *naps = by_date[date]
        out.append({**bucket_place(date, "day", tz, _end_offset(night, tz)),
                    "date": date.isoformat(), "count": 1 + len(naps), "nights": 1,
                    "asleep": night.asleep, "in_bed": night.in_bed,
                    "stages": dict(night.stages),
                    "sleep_start": None if night.start is None else local_text(
                        night.start, night.start_text, tz),
                    "sleep_end": local_text(night.end, night.end_text, tz),
                    "form": night.form, "overlapping": night.overlapping,
                    "naps": [nap_item(nap, tz) for nap in naps]})
    return out


def week_items(by_date: dict, tz: str = "local") -> list:
    """The reply's week items (weeks from Monday): the average night of the week's dates
    with one (a stage a night lacks counts 0 h for it); the naps listed, never averaged in;
    ``count`` the nights and the naps, ``overlapping`` how many nights are. The item starts
    at local midnight of its Monday (``tz=local``: in the offset the week's first night
    ended in)."""
    weeks: dict = {}
    for date in sorted(by_date):
        weeks.setdefault(date - dt.timedelta(days=date.weekday()), []).append(by_date[date])
    out = []
    for monday in sorted(weeks):
        days = weeks[monday]
        nights = [sleeps[0] for sleeps in days]
        naps = [nap for sleeps in days for nap in sleeps[1:]]
        stages: dict = {}
        for night in nights:
            for stage, hours in night.stages.items():
                stages.setdefault(stage, []).append(hours)
        forms = {night.form for night in nights}
        first = min(nights, key=lambda n: n.end)
        out.append({**bucket_place(monday, "week", tz, _end_offset(first, tz)),
                    "date": monday.isoformat(), "count": len(nights) + len(naps),
                    "nights": len(nights), "asleep": _mean([n.asleep for n in nights]),
                    "in_bed": _mean([n.in_bed for n in nights]),
                    "stages": {stage: _mean(hours, len(nights))
                               for stage, hours in stages.items()},
                    "form": forms.pop() if len(forms) == 1 else "mixed",
                    "overlapping": sum(n.overlapping for n in nights),
                    "naps": [nap_item(nap, tz) for nap in naps]})
    return out


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
    missing in the reply is 0 h), overlap, naps, local start and end, form, and each item's
    ``start`` and ``local``: local midnight of its date."""
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
        assert g["form"] == w["form"], (w["date"], g["form"])
        assert g["overlapping"] == w["overlapping"], (w["date"], "overlapping", g, w)
        assert type(g["overlapping"]) is (int if week else bool), g
        assert_naps_equal(g["naps"], w["naps"], w["date"])
        assert (g["start"], g["local"]) == (w["start"], w["local"]), (g, w)
        if not week:
            assert (g["sleep_start"], g["sleep_end"]) == (w["sleep_start"], w["sleep_end"]), (
                w["date"], g, w)


# -- the module store: a corpus posted to a serve subprocess ------------------------------


class Store(NamedTuple):
    data_dir: Any
    address: tuple
    corpus: Any

    @property
    def client(self) -> Client:
        return Client(*self.address)


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
