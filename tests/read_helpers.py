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
ASLEEP = {"core", "deep", "rem", "asleep"}
NIGHT_GAP_US = 3 * HOUR_US


class Sleep(NamedTuple):
    """One sleep as the tests place it."""

    date: dt.date  # the local date its sleep ended
    end: int  # UTC µs
    start: Optional[int]
    end_text: Any  # the end as written
    start_text: Any
    asleep: Optional[float]
    in_bed: Optional[float]
    stages: dict
    form: str  # "summary" or "records"


def _positive(value) -> Optional[float]:
    return float(value) if numeric(value) and value > 0 else None


def summary_sleep(point: dict, tz: str = "local") -> Sleep:
    """A summary point's night: placed by ``sleepEnd``, else ``inBedEnd``, else ``date``;
    asleep is ``totalSleep``, else ``asleep``, else core + deep + rem."""
    end_text = next(point[k] for k in ("sleepEnd", "inBedEnd", "date") if point.get(k))
    start_text = point.get("sleepStart") or point.get("inBedStart")
    end = instant_us(end_text)
    stages = {stage: _positive(point.get(stage)) for stage in ("core", "deep", "rem", "awake")}
    stages = {k: v for k, v in stages.items() if v is not None}
    asleep = _positive(point.get("totalSleep")) or _positive(point.get("asleep"))
    if asleep is None and {"core", "deep", "rem"} & set(stages):
        asleep = sum(stages.get(s, 0.0) for s in ("core", "deep", "rem"))
    return Sleep(in_zone(end, tz, end_text).date(), end,
                 None if start_text is None else instant_us(start_text), end_text, start_text,
                 asleep, _positive(point.get("inBed")), stages, "summary")


def union_hours(spans: list) -> float:
    total, reach = 0, None
    for start, end in sorted(spans):
        if reach is None or start > reach:
            total, reach = total + end - start, end
        elif end > reach:
            total, reach = total + end - reach, end
    return total / HOUR_US


def record_sleeps(records: list, tz: str = "local") -> list:
    """Stage records grouped into sleeps: a record that starts less than 3 h after the
    latest end of the sleep so far belongs to it. Stage hours are the sum of the records'
    ``qty`` (else their span), asleep and in bed the union of their records' spans."""
    items = sorted(((instant_us(raw_start(p)), instant_us(raw_end(p)), p) for p in records),
                   key=lambda item: item[:2])
    groups: list = []
    for start, end, point in items:
        if groups and start - max(e for _, e, _ in groups[-1]) < NIGHT_GAP_US:
            groups[-1].append((start, end, point))
        else:
            groups.append([(start, end, point)])
    out = []
    for group in groups:
        last = max(group, key=lambda item: item[1])
        first = min(group, key=lambda item: item[0])
        stages: dict = {}
        asleep, in_bed = [], []
        for start, end, point in group:
            stage = STAGE_OF[point["value"]]
            hours = point["qty"] if numeric(point.get("qty")) else (end - start) / HOUR_US
            if stage == "in_bed":
                in_bed.append((start, end))
            else:
                stages[stage] = stages.get(stage, 0.0) + hours
            if stage in ASLEEP:
                asleep.append((start, end))
        end_text = raw_end(last[2])
        out.append(Sleep(in_zone(last[1], tz, end_text).date(), last[1], first[0], end_text,
                         raw_start(first[2]), union_hours(asleep) if asleep else None,
                         union_hours(in_bed) if in_bed else None, stages, "records"))
    return out


def nights_by_date(summaries: list, records: list, tz: str = "local") -> dict:
    """date -> [Sleep]: a date with a summary night takes its summaries (the same night
    summarised twice counts once: one per sleepEnd), else the sleeps of its records."""
    by_date: dict = {}
    ends = set()
    for point in summaries:
        sleep = summary_sleep(point, tz)
        if sleep.end in ends:
            continue
        ends.add(sleep.end)
        by_date.setdefault(sleep.date, []).append(sleep)
    for sleep in record_sleeps(records, tz):
        if all(s.form == "records" for s in by_date.get(sleep.date, [])):
            by_date.setdefault(sleep.date, []).append(sleep)
    return by_date


def _total(values: list, share: float = 1.0) -> Optional[float]:
    known = [v for v in values if v is not None]
    return math.fsum(known) * share if known else None


def _form(sleeps: list) -> str:
    forms = {s.form for s in sleeps}
    return forms.pop() if len(forms) == 1 else "mixed"


def local_text(us: int, text: Any, tz: str) -> str:
    return iso_local(in_zone(us, tz, text))


def night_items(by_date: dict, tz: str = "local") -> list:
    """The reply's day items: per date the sum of its sleeps, the earliest start and the
    latest end in local time, and the form read ("mixed" for both)."""
    out = []
    for date in sorted(by_date):
        sleeps = by_date[date]
        stages: dict = {}
        for sleep in sleeps:
            for stage, hours in sleep.stages.items():
                stages[stage] = stages.get(stage, 0.0) + hours
        starts = [s for s in sleeps if s.start is not None]
        earliest = min(starts, key=lambda s: s.start) if starts else None
        last = max(sleeps, key=lambda s: s.end)
        out.append({"date": date.isoformat(), "count": len(sleeps),
                    "asleep": _total([s.asleep for s in sleeps]),
                    "in_bed": _total([s.in_bed for s in sleeps]), "stages": stages,
                    "sleep_start": earliest and local_text(earliest.start, earliest.start_text,
                                                           tz),
                    "sleep_end": local_text(last.end, last.end_text, tz),
                    "form": _form(sleeps), "end_offsets": {
                        offset_s(in_zone(s.end, tz, s.end_text)) for s in sleeps}})
    return out


def week_items(by_date: dict) -> list:
    """The reply's week items: the average of the week's dates with a night (a date's
    sleeps summed first)."""
    weeks: dict = {}
    for date, sleeps in by_date.items():
        weeks.setdefault(date - dt.timedelta(days=date.weekday()), {})[date] = sleeps
    out = []
    for monday in sorted(weeks):
        days = weeks[monday]
        sleeps = [s for day in days.values() for s in day]
        share = 1 / len(days)
        stages: dict = {}
        for sleep in sleeps:
            for stage, hours in sleep.stages.items():
                stages[stage] = stages.get(stage, 0.0) + hours * share
        out.append({"date": monday.isoformat(), "count": len(sleeps), "nights": len(days),
                    "asleep": _total([s.asleep for s in sleeps], share),
                    "in_bed": _total([s.in_bed for s in sleeps], share), "stages": stages,
                    "form": _form(sleeps)})
    return out


def assert_hours(got: Optional[float], want: Optional[float], what: Any) -> None:
    if want is None:
        assert got is None, what
    else:
        assert got is not None and close(got, want, 1e-9), (what, got, want)


def assert_nights_equal(got: list, want: list, week: bool = False) -> None:
    """The reply's ``nights`` against the tests' own: dates, counts, hours (to 1e-9, a stage
    missing in the reply is 0 h), local start and end, form; each item's ``start`` and
    ``local`` name local midnight of its date in an offset one of its sleeps ended in."""
    assert [(n["date"], n["count"]) for n in got] == [(n["date"], n["count"]) for n in want]
    for g, w in zip(got, want):
        assert g["count"] == w["count"], (w["date"], g)
        assert_hours(g["asleep"], w["asleep"], (w["date"], "asleep"))
        assert_hours(g["in_bed"], w["in_bed"], (w["date"], "in_bed"))
        assert set(g["stages"]) <= {"core", "deep", "rem", "awake", "asleep"}, g["stages"]
        for stage in set(g["stages"]) | set(w["stages"]):
            assert close(g["stages"].get(stage, 0.0), w["stages"].get(stage, 0.0)), (
                w["date"], stage, g["stages"], w["stages"])
        assert g["form"] == w["form"], (w["date"], g["form"])
        assert g["local"].startswith(w["date"] + "T00:00:00"), g
        assert instant_us(g["local"]) == instant_us(g["start"]), g
        if week:
            assert g["nights"] == w["nights"], g
        else:
            assert (g["sleep_start"], g["sleep_end"]) == (w["sleep_start"], w["sleep_end"]), (
                w["date"], g, w)
            assert offset_s(written(g["local"])) in w["end_offsets"], (g, w)


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
