"""Deterministic synthetic Health Auto Export (HAE) payloads for the test-suite.

What HAE really sends was worked out from HAE's documentation, real exports and public
receivers of HAE data; the "§" tags below name the part of HAE's format a shape belongs to
(see "HAE's format in brief" at the end of this docstring), and "E" numbers label the piece
of evidence a detail was taken from (captures and threads that are not in this repository).
This module fabricates bodies, headers and whole streams of deliveries with the same shapes
and quirks, from a seed, with the standard library only (Python 3.9+).

Usage::

    import random
    import hae_factory as hf

    payload = hf.metrics_payload(1, ("step_count", "heart_rate"), start=hf.DST_SPRING)
    body = hf.dumps_hae(payload)                  # iOS pretty JSON, keys in the given order
    again = hf.resend(body, random.Random(2))     # same values, other bytes (§1)
    headers = hf.headers_for(hf.Automation("Metrics", "Minutes", "Today"), token="t")
    for push in hf.week_of_traffic(seed=7):       # a week of deliveries, in arrival order
        post(push.headers, push.body)
    big = hf.big_metrics_body(60 << 20, seed=3)   # ~60 MB minute-grouped body in ~1-2 s

Model. Two kinds of randomness are kept apart:

* the *truth* - what the wearer's body did (steps per minute, heart-rate samples, nights,
  workouts, journal entries) - is a pure function of (seed, metric, instant), computed by
  hashing. Any window can be cut out of it at any moment and overlapping windows agree,
  which is what makes re-sent "Previous 7 Days" points equal to the ones sent before;
* the *serialisation* - sources, key order, last-digit jitter, session ids - comes from a
  ``random.Random``; every builder takes ``rng`` (default ``random.Random(seed)``).

A `Phone` holds the settings that shape every timestamp and label: its `Zone` (with a DST
rule implemented here, so DST tests need no tz database), 24- or 12-hour time style, source
policy and language. Windows are half-open ``[start, end)``; ``start``/``end`` accept a
``date`` (local midnight), an aware ``datetime``, a naive ``datetime`` (phone-local wall
time) or epoch seconds. ``cutoff`` models "now": samples at or after it do not exist yet and
the minute it falls in counts pro rata, which is how the current bucket grows between pushes.

Builders return plain dicts and lists in a documented key order; `dumps_hae` writes them
byte-for-byte like the app (``"key" : value``, 2-space indent, floats with 17 significant
digits, UTF-8), and with an ``rng`` shuffles key order and jitters the last digit the way two
sends of unchanged data differ.

HAE's format in brief (the "§" tags):

* §1 the body is one object ``{"data": {...}}`` whose sections (``metrics``, ``workouts``,
  ``stateOfMind``, ``medications``, ``symptoms``, ``cycleTracking``, ``ecg``,
  ``heartRateNotifications``) are all optional; nothing in the body says which automation or
  grouping sent it. It is pretty-printed iOS-style (``"key" : value``), doubles carry up to 17
  significant digits, and key order changes between sends of unchanged data.
* §2 metrics: §2.1 a metric object is ``{"name", "units", "data"}`` (snake_case name, the
  user's units); §2.2 a point has ``date`` (the bucket start) and ``qty``, usually ``source``
  (merged devices joined with ``|``, Apple device names with the typographic apostrophe),
  and ``start``/``end`` when samples are not summarised; §2.3–2.6 special shapes
  (``heart_rate`` with Min/Avg/Max, ``blood_pressure``, ``sleep_analysis`` as nightly
  summaries or stage segments in hours).
* §3 timestamps are ``yyyy-MM-dd HH:mm:ss Z`` with the phone's offset at the sample (so DST
  changes it within a body); 12-hour phones write ``7:57:00 am``, newer iOS with U+202F
  before ``am``/``pm``; some fields are date-only, ISO-8601 with ``Z``, or epoch numbers.
* §4 workouts, §4.1 version 2 (current: ``id``, ``duration``, per-minute series, routes) and
  §4.2 version 1 (legacy); §4b the other sections, in their observed rather than documented
  shapes (localised names and values, epoch dates in ECG voltages and heart-rate
  notifications).
* §5 the request: ``POST`` with ``Content-Type: application/json``, the user's own headers
  (the token), and the headers the app adds: ``automation-name``, ``automation-id``,
  ``automation-aggregation``, ``automation-period``, ``session-id``.
* §6 automation settings: time grouping (Default = seconds for heart rate, minutes for the
  rest; Minutes, Hours, Days, …), period (Default, Since Last Sync, Today, Previous 7 Days,
  …), batching; the grouping shows only in the header and in the spacing of bucket starts,
  and the current bucket's value grows between pushes while its start stays.
* §7 metric names with the units they were seen in.
"""

from __future__ import annotations

import datetime as dt
import functools
import hashlib
import itertools
import json
import math
import random
import re
import time
import uuid
import zlib
from dataclasses import dataclass
from json.encoder import encode_basestring
from typing import Any, Iterator, NamedTuple, Optional, Sequence

__all__ = [
    "BACK_TO_BACK_NAPS", "BERLIN", "BRISBANE", "CANARY_QTY", "CANARY_SOURCE", "CANARY_STRINGS",
    "CANARY_TOKEN",
    "DAYS_METRICS", "DEFAULT_DAY", "DEFAULT_METRICS", "DST_FALL", "DST_SPRING", "ECG_SAMPLES",
    "FAST", "GROUPINGS", "JOURNAL", "KOLKATA", "METRICS", "NEW_YORK", "RAW", "RECORD_SECTIONS",
    "SLEEP", "SLEEP_APP", "SYDNEY", "TODAY", "WEEK", "WORKOUTS",
    "OVERLAP_SOURCE", "OWNER_PHONE", "OWNER_WATCH", "PACIFIC", "PERIODS", "PERTH", "PHONE",
    "PIPED_SOURCE",
    "SLEEP_VALUES", "TIME_STYLES", "UTC_ZONE", "WORKOUT_KINDS",
    "Automation", "MetricSpec", "Phone", "Push", "RawNumber", "Zone",
    "big_metrics_body", "big_workouts_body", "canary_payload", "cycle_tracking", "day_fields",
    "days_export", "days_points", "dumps_hae", "ecg_reading", "envelope", "hae_time",
    "headers_for", "heart_rate_notification", "iso_z", "local_midnight", "medications",
    "metric", "metric_points", "metrics_payload", "new_uuid", "records_sections", "resend",
    "same_value", "sleep_app_records", "sleep_app_summary", "sleep_nap",
    "sleep_nap_summaries", "sleep_nights", "sleep_overlapping_sources", "sleep_records_again",
    "sleep_segments", "sleep_summaries", "sleep_summary_so_far", "state_of_mind", "symptoms",
    "utc_offset", "week_of_traffic", "workout_v1", "workout_v2", "workouts_between",
]

# ==========================================================================================
# Constants: names, values and dates the fixtures are built around, each with its reason.
# ==========================================================================================

#: Device names with the typographic apostrophe Apple uses (§2.2, E10/E34).
OWNER_WATCH = "Anton’s Apple Watch"
OWNER_PHONE = "iPhone (Anton)"
#: Merged sources are pipe-joined (§2.2).
PIPED_SOURCE = OWNER_WATCH + "|" + OWNER_PHONE

#: Distinctive values for log-leak tests: nothing else in a payload looks like them, so a
#: test can scan logs for CANARY_STRINGS after posting `canary_payload()`.
CANARY_SOURCE = "Zebulon’s Apple Watch"
CANARY_QTY = 72.123456789
CANARY_TOKEN = "canary-token-Zq7WxQ3vR9"
CANARY_STRINGS = (CANARY_SOURCE, "Zebulon", "72.123456789", CANARY_TOKEN)

#: Time groupings an automation can send (header automation-aggregation, §5/§6).
GROUPINGS = ("Minutes", "Hours", "Days", "Default")
#: Date-range labels (header automation-period, §5/§6).
PERIODS = ("Default", "Since Last Sync", "Today", "Yesterday", "Previous 7 Days")

#: US DST days of 2024: clocks jump 02:00 -> 03:00 and fall back 02:00 -> 01:00.
DST_SPRING = dt.date(2024, 3, 10)
DST_FALL = dt.date(2024, 11, 3)
#: An ordinary day two days before DST_SPRING, so a week from it crosses a DST change.
DEFAULT_DAY = dt.date(2024, 3, 8)

#: One 30 s ECG reading at 512.6 Hz holds 15 379 voltage samples (§4b, E50).
ECG_SAMPLES = 15379
_ECG_HZ = 512.6

_EPOCH_ORDINAL = dt.date(1970, 1, 1).toordinal()
#: Float totals use math.fsum: sum() of floats became compensated in Python 3.12, so its
#: last digit differs between versions, and "same seed, same bytes" must hold on 3.9-3.13.
_fsum = math.fsum
_DAY = 86400
_SIZES = {"Seconds": 1, "Minutes": 60, "Hours": 3600}

# ==========================================================================================
# Time: zones with a built-in DST rule, and the HAE / ISO timestamp spellings.
# ==========================================================================================


@dataclass(frozen=True)
class Zone:
    """A phone time zone: offsets in minutes east of UTC and an optional DST rule.

    ``rule`` is ``"us"`` (DST from the 2nd Sunday of March 02:00 local standard time to the
    1st Sunday of November 02:00 local daylight time), ``"eu"`` (last Sunday of March to
    last Sunday of October, 01:00 UTC) or ``"au"`` (south-east Australia: from the 1st Sunday
    of October 02:00 standard time to the 1st Sunday of April 03:00 daylight time, so
    daylight time spans the new year); empty means a fixed offset.
    """

    name: str
    std: int
    dst: Optional[int] = None
    rule: str = ""


PACIFIC = Zone("America/Los_Angeles", -480, -420, "us")
BERLIN = Zone("Europe/Berlin", 60, 120, "eu")
BRISBANE = Zone("Australia/Brisbane", 600)  # the +1000 of the 12-hour capture (E26)
PERTH = Zone("Australia/Perth", 480)  # the +0800 of the 2023 sleep captures (E10)
NEW_YORK = Zone("America/New_York", -300, -240, "us")
SYDNEY = Zone("Australia/Sydney", 600, 660, "au")
KOLKATA = Zone("Asia/Kolkata", 330)  # a half-hour offset: UTC hours straddle local hours
UTC_ZONE = Zone("UTC", 0)

#: Timestamp styles: None is 24-hour; otherwise (space before am/pm, upper-case am/pm).
#: 12-hour phones leak their locale into HAE's format (§3, E26/E11).
TIME_STYLES = {
    "24h": None,
    "12h": (" ", False),  # 2024-09-21 7:57:00 am +1000
    "12H": (" ", True),  # 2024-09-21 7:57:00 AM +1000
    "12h-nnbsp": ("\u202f", False),  # ICU 72 narrow no-break space
    "12H-nbsp": ("\u00a0", True),  # no-break space
}


@functools.lru_cache(maxsize=4096)
def _date_of_day(day: int) -> dt.date:
    return dt.date.fromordinal(_EPOCH_ORDINAL + day)


@functools.lru_cache(maxsize=4096)
def _date_text(day: int) -> str:
    return _date_of_day(day).isoformat()


def _day_number(day: dt.date) -> int:
    return day.toordinal() - _EPOCH_ORDINAL


def _sunday_on_or_after(day: dt.date) -> dt.date:
    return day + dt.timedelta(days=(6 - day.weekday()) % 7)


@functools.lru_cache(maxsize=None)
def _dst_span(zone: Zone, year: int) -> tuple:
    """UTC epoch seconds [start, end) of daylight time in ``year``."""
    if zone.rule == "us":
        start_day = _sunday_on_or_after(dt.date(year, 3, 8))  # the 2nd Sunday
        end_day = _sunday_on_or_after(dt.date(year, 11, 1))
        start = _day_number(start_day) * _DAY + 7200 - zone.std * 60
        end = _day_number(end_day) * _DAY + 7200 - zone.dst * 60
        return start, end
    if zone.rule == "eu":
        start_day = _sunday_on_or_after(dt.date(year, 3, 25))  # the last Sunday
        end_day = _sunday_on_or_after(dt.date(year, 10, 25))
        return _day_number(start_day) * _DAY + 3600, _day_number(end_day) * _DAY + 3600
    if zone.rule == "au":  # southern: start (October) comes after end (April) in a year
        start_day = _sunday_on_or_after(dt.date(year, 10, 1))  # the 1st Sunday
        end_day = _sunday_on_or_after(dt.date(year, 4, 1))
        start = _day_number(start_day) * _DAY + 7200 - zone.std * 60
        end = _day_number(end_day) * _DAY + 10800 - zone.dst * 60
        return start, end
    raise ValueError("unknown DST rule %r" % zone.rule)


def _offset_at(zone: Zone, t: float) -> int:
    if not zone.rule:
        return zone.std
    start, end = _dst_span(zone, _date_of_day(int(t // _DAY)).year)
    if end < start:  # southern hemisphere: standard time from April to October
        return zone.std if end <= t < start else zone.dst
    return zone.dst if start <= t < end else zone.std


def _local_epoch(zone: Zone, local_seconds: int) -> int:
    """The UTC instant whose wall clock reads ``local_seconds``; the earlier one if the
    wall time happens twice, the instant after the jump if it never happens."""
    offsets = (zone.std,) if zone.dst is None else (zone.dst, zone.std)
    for off in offsets:
        t = local_seconds - off * 60
        if _offset_at(zone, t) == off:
            return t
    return local_seconds - zone.std * 60


def _epoch(when: Any, zone: Zone = UTC_ZONE) -> float:
    """Epoch seconds of a number, an aware datetime, a naive datetime (wall time in
    ``zone``) or a date (local midnight in ``zone``)."""
    if isinstance(when, bool):
        raise TypeError("a time cannot be a bool")
    if isinstance(when, (int, float)):
        return when
    if isinstance(when, dt.datetime):
        if when.tzinfo is not None:
            return when.timestamp()
        wall = _day_number(when.date()) * _DAY + when.hour * 3600 + when.minute * 60
        return _local_epoch(zone, wall + when.second) + when.microsecond / 1e6
    if isinstance(when, dt.date):
        return local_midnight(zone, when)
    raise TypeError("not a time: %r" % (when,))


def _span(start: Any, end: Any, zone: Zone) -> tuple:
    """Epoch bounds of ``[start, end)``; without ``end`` the window is one local day (a
    ``date`` runs to the next local midnight, so DST days have 23 or 25 hours)."""
    t0 = _epoch(start, zone)
    if end is not None:
        return t0, _epoch(end, zone)
    if isinstance(start, dt.date) and not isinstance(start, dt.datetime):
        return t0, local_midnight(zone, start + dt.timedelta(days=1))
    return t0, t0 + _DAY


def utc_offset(zone: Zone, when: Any) -> int:
    """Offset in minutes east of UTC that a phone in ``zone`` shows at ``when``."""
    return _offset_at(zone, _epoch(when, zone))


def local_midnight(zone: Zone, day: dt.date) -> int:
    """Epoch seconds of 00:00 local time on ``day`` in ``zone``."""
    return _local_epoch(zone, _day_number(day) * _DAY)


def _offset_text(minutes: int) -> str:
    sign = "-" if minutes < 0 else "+"
    return "%s%02d%02d" % (sign, abs(minutes) // 60, abs(minutes) % 60)


def _format_hae(t: float, off: int, style: str) -> str:
    local = int(t // 1) + off * 60
    day, sec = divmod(local, _DAY)
    hour, rest = divmod(sec, 3600)
    minute, second = divmod(rest, 60)
    twelve = TIME_STYLES[style]
    if twelve is None:
        clock = "%02d:%02d:%02d" % (hour, minute, second)
    else:
        space, upper = twelve
        mark = ("PM" if upper else "pm") if hour >= 12 else ("AM" if upper else "am")
        clock = "%d:%02d:%02d%s%s" % (hour % 12 or 12, minute, second, space, mark)
    return "%s %s %s" % (_date_text(day), clock, _offset_text(off))


def hae_time(when: Any, zone: Zone = PACIFIC, style: str = "24h") -> str:
    """HAE's ``yyyy-MM-dd HH:mm:ss Z`` (or a 12-hour variant) for ``when`` in ``zone``."""
    t = _epoch(when, zone)
    return _format_hae(t, _offset_at(zone, t), style)


def iso_z(when: Any) -> str:
    """ISO-8601 UTC with ``Z``, as stateOfMind sends it (§3, E47)."""
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(int(_epoch(when) // 1)))


# ==========================================================================================
# Phone: the settings that shape labels, timestamps and sources.
# ==========================================================================================


@dataclass(frozen=True)
class Phone:
    """What the exporting phone contributes: zone, time style, sources and language.

    ``sources``: ``"mixed"`` (mostly the watch, some pipe-joined, phone-only, ``""`` and
    missing), ``"single"`` (always the watch), ``"none"`` (no ``source`` key, HAE <= 2021)
    or any other string, used verbatim on every point (e.g. `CANARY_SOURCE`).
    ``language`` picks the sleep-stage vocabulary of `SLEEP_VALUES`.
    """

    zone: Zone = PACIFIC
    time_style: str = "24h"
    sources: str = "mixed"
    language: str = "en"

    def time(self, when: Any) -> str:
        """``when`` in HAE's format as this phone writes it."""
        return hae_time(when, self.zone, self.time_style)

    def pick_source(self, rng: random.Random, usual: str = OWNER_WATCH) -> Optional[str]:
        """A ``source`` value for one point, or None when the key is to be left out."""
        if self.sources == "mixed":
            roll = rng.random()
            if roll < 0.72:
                return usual
            if roll < 0.87:
                return PIPED_SOURCE
            if roll < 0.95:
                return OWNER_PHONE
            return "" if roll < 0.98 else None
        if self.sources == "single":
            return usual
        if self.sources == "none":
            return None
        return self.sources


PHONE = Phone()


def _with_source(point: dict, source: Optional[str]) -> dict:
    if source is not None:
        point["source"] = source
    return point


# ==========================================================================================
# Truth: what the wearer's body did, as a pure function of (seed, metric, instant).
# ==========================================================================================

_M64 = (1 << 64) - 1


def _mix64(x: int) -> int:
    """SplitMix64 finaliser: a cheap, well-spread integer hash."""
    x = (x + 0x9E3779B97F4A7C15) & _M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


def _draw(seed: int, salt: int, n: int, j: int = 0) -> float:
    """A uniform number in [0, 1) fixed by (seed, salt, n, j)."""
    x = _mix64(_mix64((seed * 0x2545F4914F6CDD1D + salt) & _M64) ^ ((n * 16 + j) & _M64))
    return (x >> 11) * (1.0 / (1 << 53))


@functools.lru_cache(maxsize=None)
def _salt(name: str) -> int:
    return zlib.crc32(name.encode("utf-8"))


def _uuid_from(*parts: Any) -> str:
    """An upper-case v4-shaped UUID fixed by ``parts`` (stable ids for re-sent records)."""
    digest = hashlib.sha256(repr(parts).encode("utf-8")).digest()
    return str(uuid.UUID(bytes=digest[:16], version=4)).upper()


class MetricSpec(NamedTuple):
    """How the truth of one metric is drawn.

    kind ``sum``: amounts per minute (present with probability ``rate`` x the hour's
    activity; ``rate`` >= 1 means every minute), ``level`` the mean amount; bucket = sum.
    kind ``hr``: heart-rate samples, ``level`` +- ``spread`` bpm; bucket = Min/Avg/Max.
    kinds ``event``/``bp``/``glucose``: ``rate`` measurements a day around ``level``.
    """

    units: str
    kind: str
    level: float
    spread: float
    rate: float
    integer: bool = False


#: Metric names and units as sent (§7); values are plausible, not physiological models.
METRICS = {
    "step_count": MetricSpec("count", "sum", 42.0, 0, 0.30),
    "active_energy": MetricSpec("kJ", "sum", 3.1, 0, 0.45),
    "basal_energy_burned": MetricSpec("kJ", "sum", 4.6, 0, 1.0),
    "walking_running_distance": MetricSpec("km", "sum", 0.031, 0, 0.28),
    "flights_climbed": MetricSpec("count", "sum", 1, 0, 0.01, True),
    "apple_exercise_time": MetricSpec("min", "sum", 1, 0, 0.04, True),
    "apple_stand_hour": MetricSpec("count", "event", 1, 0, 12, True),
    "heart_rate": MetricSpec("count/min", "hr", 70, 14, 0.2),
    "resting_heart_rate": MetricSpec("count/min", "event", 57, 4, 1, True),
    "walking_heart_rate_average": MetricSpec("count/min", "event", 96, 8, 1),
    "heart_rate_variability": MetricSpec("ms", "event", 42, 18, 6),
    "respiratory_rate": MetricSpec("count/min", "event", 15, 2, 8),
    "blood_oxygen_saturation": MetricSpec("%", "event", 97, 2.5, 5),
    "apple_sleeping_wrist_temperature": MetricSpec("degC", "event", 36.1, 0.4, 1),
    "weight_body_mass": MetricSpec("kg", "event", 74.2, 0.8, 1),
    "blood_pressure": MetricSpec("mmHg", "bp", 118, 8, 1, True),
    "blood_glucose": MetricSpec("mg/dL", "glucose", 98, 20, 2),
}

#: Conversions for user unit preferences (kcal/kJ, km/mi, degC/degF, kg/lb).
_UNIT_SCALE = {
    ("kJ", "kcal"): 1 / 4.184,
    ("km", "mi"): 0.621371192237334,
    ("kg", "lb"): 2.2046226218487757,
}

#: Activity multiplier per local hour (night quiet, commute and evening busy).
_ACTIVITY = (0.1, 0.05, 0.05, 0.05, 0.05, 0.1, 0.4, 1.2, 1.3, 1.0, 1.0, 1.0,
             1.1, 1.0, 1.0, 1.0, 1.1, 1.4, 1.4, 1.1, 0.8, 0.6, 0.4, 0.2)
_MEAL_TIMES = ("Before Meal", "After Meal", "Unspecified")


def _convert(value: float, spec_units: str, units: str) -> float:
    if units == spec_units:
        return value
    if (spec_units, units) == ("degC", "degF"):
        return value * 1.8 + 32
    return value * _UNIT_SCALE[(spec_units, units)]


@functools.lru_cache(maxsize=200_000)
def _hour_truth(seed: int, name: str, std: int, hour: int) -> tuple:
    """(t, value) samples of a ``sum`` or ``hr`` metric in UTC hour ``hour``, sorted."""
    spec = METRICS[name]
    salt = _salt(name)
    local_hour = (hour + std // 60) % 24
    activity = _ACTIVITY[local_hour]
    out = []
    if spec.kind == "sum":
        chance = 1.0 if spec.rate >= 1 else min(1.0, spec.rate * activity)
        for n in range(hour * 60, hour * 60 + 60):
            if _draw(seed, salt, n) < chance:
                value = spec.level * (0.25 + 1.5 * _draw(seed, salt, n, 1))
                out.append((n * 60, max(1, round(value)) if spec.integer else value))
        return tuple(out)
    base = spec.level - 12 if activity < 0.3 else spec.level + 4 * activity
    for n in range(hour * 60, hour * 60 + 60):
        if _draw(seed, salt, n) >= spec.rate:
            continue
        count = 1 + (_draw(seed, salt, n, 1) < 0.3) + (_draw(seed, salt, n, 2) < 0.1)
        seconds = sorted({int(60 * _draw(seed, salt, n, 3 + k)) for k in range(count)})
        for k, second in enumerate(seconds):
            bpm = round(base + spec.spread * (2 * _draw(seed, salt, n, 8 + k) - 1))
            out.append((n * 60 + second, bpm))
    return tuple(out)


@functools.lru_cache(maxsize=50_000)
def _day_events(seed: int, name: str, day: int) -> tuple:
    """(t, value) measurements of an event-like metric on UTC day ``day``, sorted."""
    spec = METRICS[name]
    salt = _salt(name)
    whole = int(spec.rate)
    count = whole + (_draw(seed, salt, day, 15) < spec.rate - whole)
    out = []
    for k in range(count):
        t = day * _DAY + int(_DAY * _draw(seed, salt, day * 64 + k, 1))
        centre = spec.level + spec.spread * (2 * _draw(seed, salt, day * 64 + k, 2) - 1)
        if spec.kind == "bp":
            value = (round(centre), round(centre * 0.65 + 4 * _draw(seed, salt, day, 3)))
        elif spec.kind == "glucose":
            value = (centre, _MEAL_TIMES[int(3 * _draw(seed, salt, day * 64 + k, 4))])
        else:
            value = round(centre) if spec.integer else centre
        out.append((t, value))
    return tuple(sorted(out))


def _samples(seed: int, name: str, zone: Zone, t0: float, t1: float, cutoff: Optional[float]):
    """Truth samples with ``t0 <= t < min(t1, cutoff)``; a ``sum`` minute still running at
    ``cutoff`` counts pro rata."""
    kind = METRICS[name].kind
    end = t1 if cutoff is None else min(t1, cutoff)
    if kind in ("sum", "hr"):
        for hour in range(int(t0 // 3600), int(math.ceil(end / 3600))):
            for t, value in _hour_truth(seed, name, zone.std, hour):
                if t0 <= t < end:
                    if kind == "sum" and cutoff is not None and t + 60 > cutoff:
                        value = value * (cutoff - t) / 60
                    yield t, value
        return
    for day in range(int(t0 // _DAY), int(end // _DAY) + 1):
        for t, value in _day_events(seed, name, day):
            if t0 <= t < end:
                yield t, value


# ==========================================================================================
# Metrics: bucketed points in the shapes of §2 for Minutes/Hours/Days/Default grouping.
# ==========================================================================================


def _bucket_start(t: float, size: Optional[int], zone: Zone) -> int:
    """Start of the bucket holding ``t``; ``size`` None means a local day."""
    off = _offset_at(zone, t) * 60
    if size is None:
        return _local_epoch(zone, int((t + off) // _DAY) * _DAY)
    return int(t - ((t + off) % size))


def _bucket_fields(kind: str, values: list, integer: bool) -> dict:
    """The value keys of one bucket (heart rate and blood pressure are integers, so plain
    sum() is exact for them)."""
    if kind == "sum":
        return {"qty": _fsum(values)}
    if kind == "hr":
        return {"Min": min(values), "Avg": sum(values) / len(values), "Max": max(values)}
    if kind == "bp":
        return {"systolic": sum(v[0] for v in values) / len(values),
                "diastolic": sum(v[1] for v in values) / len(values)}
    if kind == "glucose":
        return {"qty": _fsum(v[0] for v in values) / len(values), "mealTime": values[0][1]}
    if integer and len(values) == 1:
        return {"qty": values[0]}
    return {"qty": _fsum(values) / len(values)}


def metric_points(seed: int, name: str, start: Any, end: Any = None, grouping: str = "Minutes",
                  *, phone: Phone = PHONE, cutoff: Any = None,
                  rng: Optional[random.Random] = None, units: Optional[str] = None) -> list:
    """Points of metric ``name`` for samples in ``[start, end)`` grouped as HAE does.

    ``grouping``: ``Minutes``/``Hours``/``Days`` buckets start at local minute/hour/
    midnight (a DST day has buckets with two offsets); ``Default`` is per-second buckets for
    heart_rate and per-minute for everything else (§6). Buckets without samples are left
    out. Point keys in order: ``date``, the value keys (``qty``; ``Min, Avg, Max`` for
    heart_rate; ``systolic, diastolic``; ``qty, mealTime``), then ``source`` unless the
    phone's source policy drops it. ``end`` defaults to one local day after ``start``.
    """
    spec = METRICS[name]
    rng = rng or random.Random(seed)
    zone = phone.zone
    t0, t1 = _span(start, end, zone)
    limit = None if cutoff is None else _epoch(cutoff, zone)
    if grouping == "Default":
        size: Optional[int] = 1 if name == "heart_rate" else 60
    else:
        size = None if grouping == "Days" else _SIZES[grouping]
    units = units or spec.units
    points = []
    samples = _samples(seed, name, zone, t0, t1, limit)
    for bucket, group in itertools.groupby(samples, lambda s: _bucket_start(s[0], size, zone)):
        fields = _bucket_fields(spec.kind, [value for _, value in group], spec.integer)
        if "qty" in fields and spec.kind != "hr":
            fields["qty"] = _convert(fields["qty"], spec.units, units)
        point = {"date": phone.time(bucket)}
        point.update(fields)
        points.append(_with_source(point, phone.pick_source(rng)))
    return points


def metric(name: str, points: list, units: Optional[str] = None) -> dict:
    """A metric object ``{"name", "units", "data"}`` (§2.1); units default from METRICS."""
    if units is None:
        units = "hr" if name == "sleep_analysis" else METRICS[name].units
    return {"name": name, "units": units, "data": points}


def envelope(**sections: list) -> dict:
    """The body ``{"data": {section: [...], ...}}`` with sections in the given order."""
    return {"data": dict(sections)}



def body(*metrics: tuple, pretty: bool = True, **sections: list) -> bytes:
    """HAE's bytes of a body with ``(name, units, points)`` metrics and the other ``data``
    sections given, in that order."""
    data = {"metrics": [metric(name, points, units) for name, units, points in metrics]}
    data.update(sections)
    return dumps_hae({"data": data}, pretty=pretty)

#: Metrics a typical "health metrics" automation selects.
DEFAULT_METRICS = ("step_count", "active_energy", "heart_rate", "resting_heart_rate",
                   "heart_rate_variability", "blood_oxygen_saturation", "blood_pressure")


def metrics_payload(seed: int = 0, names: Sequence[str] = DEFAULT_METRICS,
                    start: Any = DEFAULT_DAY, end: Any = None, grouping: str = "Minutes", *,
                    phone: Phone = PHONE, cutoff: Any = None,
                    rng: Optional[random.Random] = None, units: Optional[dict] = None,
                    sleep: str = "aggregated", empty_metrics: Sequence[str] = (),
                    siblings: Sequence[str] = ()) -> dict:
    """A metrics body for ``[start, end)`` (default: one day) in ``grouping``.

    ``names`` may include ``sleep_analysis`` (form from ``sleep``: ``aggregated``,
    ``segments`` or ``segments-old``, see `sleep_segments`). ``units`` maps metric names to
    a preferred unit (``{"active_energy": "kcal"}``). A selected metric without samples
    keeps ``"data": []``, as do the names in ``empty_metrics``; ``siblings`` adds empty
    sections after ``metrics`` (older app versions sent ``"workouts": []``).
    """
    rng = rng or random.Random(seed)
    units = units or {}
    metrics = []
    for name in names:
        if name == "sleep_analysis":
            if sleep == "aggregated":
                rows = sleep_nights(seed, start, end, phone=phone, cutoff=cutoff, rng=rng)
            else:
                variant = "old" if sleep == "segments-old" else "new"
                rows = sleep_segments(seed, start, end, phone=phone, cutoff=cutoff, rng=rng,
                                      variant=variant)
            metrics.append(metric(name, rows))
            continue
        points = metric_points(seed, name, start, end, grouping, phone=phone, cutoff=cutoff,
                               rng=rng, units=units.get(name))
        metrics.append(metric(name, points, units.get(name)))
    metrics.extend(metric(name, [], units.get(name)) for name in empty_metrics)
    data = {"metrics": metrics}
    data.update((section, []) for section in siblings)
    return {"data": data}


# ==========================================================================================
# Days exports: one point per metric and local day, at local midnight (§2.2, §6).
# ==========================================================================================

#: The thirteen metrics of a typical Days automation ("daily totals"). On many days some of
#: them have no sample and HAE sends the metric with ``"data": []``.
DAYS_METRICS = ("step_count", "active_energy", "basal_energy_burned", "walking_running_distance",
                "flights_climbed", "apple_exercise_time", "apple_stand_hour", "heart_rate",
                "resting_heart_rate", "walking_heart_rate_average", "heart_rate_variability",
                "blood_oxygen_saturation", "weight_body_mass")
#: Chance that a metric has no sample on a day (weighed on some mornings only, and so on).
_DAYS_MISSING = {"weight_body_mass": 0.75, "blood_oxygen_saturation": 0.3,
                 "walking_heart_rate_average": 0.2, "flights_climbed": 0.25,
                 "heart_rate_variability": 0.05}


def day_fields(seed: int, name: str, day: dt.date, units: Optional[str] = None) -> Optional[dict]:
    """The value keys of the Days point of metric ``name`` for local ``day``, or None on a day
    without samples: a pure function of (seed, name, day), drawn per day (a year of days costs
    a year of draws, not a year of minutes). Totals (``sum`` metrics) are a day's worth of
    the metric's minutes; heart rate is the day's Min/Avg/Max; other metrics one reading."""
    spec = METRICS[name]
    salt = _salt("days:" + name)
    number = _day_number(day)

    def draw(j: int) -> float:
        return _draw(seed, salt, number, j)

    if draw(0) < _DAYS_MISSING.get(name, 0.0):
        return None
    if spec.kind == "sum":
        minutes = 1440 * (1.0 if spec.rate >= 1 else spec.rate * 0.7)
        value = spec.level * minutes * (0.55 + 0.9 * draw(1))
        value = max(1, round(value)) if spec.integer else value
        return {"qty": _convert(value, spec.units, units or spec.units)}
    if spec.kind == "hr":
        return {"Min": round(spec.level - 24 + 10 * draw(1)),
                "Avg": spec.level + 6 * (2 * draw(2) - 1),
                "Max": round(spec.level + 60 + 45 * draw(3))}
    if spec.kind != "event":
        raise ValueError("no Days points of %s" % name)
    if spec.integer and spec.rate > 1:  # a count of events a day (stand hours)
        return {"qty": max(1, round(spec.rate * (0.5 + 0.7 * draw(1))))}
    value = spec.level + spec.spread * (2 * draw(1) - 1)
    return {"qty": _convert(round(value) if spec.integer else value, spec.units,
                            units or spec.units)}


def _days(start: Any, end: Any) -> list:
    first = start if isinstance(start, dt.date) else _date_of_day(int(_epoch(start) // _DAY))
    if end is None:
        return [first]
    return [first + dt.timedelta(days=k) for k in range((end - first).days)]


def days_points(seed: int, name: str, start: Any = DEFAULT_DAY, end: Optional[dt.date] = None,
                *, phone: Phone = PHONE, rng: Optional[random.Random] = None,
                units: Optional[str] = None) -> list:
    """The Days points of ``name`` for the local days ``[start, end)`` (default: the day
    ``start``), each at local midnight written in the offset of that midnight, so the
    offset follows the phone's DST (``2025-04-15 00:00:00 -0400``). Keys: ``date``, the
    value keys of `day_fields`, ``source`` as the phone's policy draws it."""
    rng = rng or random.Random(seed)
    points = []
    for day in _days(start, end):
        fields = day_fields(seed, name, day, units)
        if fields is None:
            continue
        point = {"date": phone.time(local_midnight(phone.zone, day))}
        point.update(fields)
        points.append(_with_source(point, phone.pick_source(rng)))
    return points


def days_export(seed: int = 0, start: Any = DEFAULT_DAY, end: Optional[dt.date] = None, *,
                phone: Phone = PHONE, names: Sequence[str] = DAYS_METRICS,
                rng: Optional[random.Random] = None, units: Optional[dict] = None) -> dict:
    """The body of a Days automation for the local days ``[start, end)``: every metric of
    ``names`` in that order, with `days_points` (``"data": []`` when it has none). A
    "Today" export is one day: thirteen metrics of one point each, some empty."""
    rng = rng or random.Random(seed)
    units = units or {}
    return {"data": {"metrics": [
        metric(name, days_points(seed, name, start, end, phone=phone, rng=rng,
                                 units=units.get(name)), units.get(name))
        for name in names]}}


# ==========================================================================================
# Sleep: nightly aggregated rows and stage segments (§2.5).
# ==========================================================================================

#: Sleep stage labels by phone language: English, HAE 6.6.2 ("InBed"), German, and the raw
#: HealthKit identifiers one 2026 capture showed (§2.5).
SLEEP_VALUES = {
    "en": {"core": "Core", "deep": "Deep", "rem": "REM", "awake": "Awake", "inbed": "In Bed"},
    "en-6.6.2": {"core": "Core", "deep": "Deep", "rem": "REM", "awake": "Awake",
                 "inbed": "InBed"},
    "de": {"core": "Kern", "deep": "Tief", "rem": "REM", "awake": "Wach", "inbed": "Im Bett"},
    "hk": {"core": "HKCategoryValueSleepAnalysisAsleepCore",
           "deep": "HKCategoryValueSleepAnalysisAsleepDeep",
           "rem": "HKCategoryValueSleepAnalysisAsleepREM",
           "awake": "HKCategoryValueSleepAnalysisAwake",
           "inbed": "HKCategoryValueSleepAnalysisInBed"},
}
#: One sleep cycle: (stage, minimum minutes, extra minutes drawn).
_CYCLE = (("core", 15, 25), ("deep", 8, 30), ("core", 8, 15), ("rem", 8, 25), ("awake", 1, 5))


class _Night(NamedTuple):
    in_bed: tuple
    segments: tuple  # (start, end, stage)


@functools.lru_cache(maxsize=4096)
def _night(seed: int, zone: Zone, wake_day: int) -> _Night:
    """The night that ends on the morning of local day ``wake_day``."""
    salt = _salt("sleep")

    def draw(j: int) -> float:
        return _draw(seed, salt, wake_day, j)

    bed = _local_epoch(zone, wake_day * _DAY - 105 * 60 + int(6000 * draw(0)))
    asleep = bed + 240 + int(960 * draw(1))
    wake = _local_epoch(zone, wake_day * _DAY + 380 * 60 + int(5400 * draw(2)))
    segments = []
    t, j = asleep, 3
    while t < wake:
        for stage, least, extra in _CYCLE:
            if stage == "awake" and draw(j) < 0.5:
                j += 1
                continue
            length = (least + int(extra * draw(j + 1))) * 60 + int(60 * draw(j + 2))
            j += 3
            segments.append((t, min(wake, t + length), stage))
            t += length
            if t >= wake:
                break
    out_of_bed = wake + 120 + int(780 * draw(j))
    return _Night((bed, out_of_bed), tuple(segments))


def _nights(seed: int, start: Any, end: Any, phone: Phone, cutoff: Any) -> list:
    """Nights whose out-of-bed time lies in ``[start, min(end, cutoff))``."""
    zone = phone.zone
    t0, t1 = _span(start, end, zone)
    if cutoff is not None:
        t1 = min(t1, _epoch(cutoff, zone))
    first = int((t0 + _offset_at(zone, t0) * 60) // _DAY)
    last = int((t1 + _offset_at(zone, t1) * 60) // _DAY)
    nights = [_night(seed, zone, day) for day in range(first, last + 1)]
    return [night for night in nights if t0 <= night.in_bed[1] < t1]


class _NightFigures(NamedTuple):
    hours: dict  # stage -> hours: core, deep, rem, awake
    sleep: tuple  # (first asleep start, last asleep end), epoch seconds
    in_bed: tuple  # (start, end), epoch seconds
    wake_day: int  # the local day (days since the epoch) the night ended on


def _night_figures(night: _Night, zone: Zone) -> _NightFigures:
    """What every summary of ``night`` is made from."""
    hours = {"core": 0.0, "deep": 0.0, "rem": 0.0, "awake": 0.0}
    for begin, finish, stage in night.segments:
        hours[stage] += (finish - begin) / 3600
    asleep = [s for s in night.segments if s[2] != "awake"]
    bed_end = night.in_bed[1]
    return _NightFigures(hours, (asleep[0][0], asleep[-1][1]), night.in_bed,
                         int((bed_end + _offset_at(zone, bed_end) * 60) // _DAY))


def sleep_nights(seed: int = 0, start: Any = DEFAULT_DAY, end: Any = None, *,
                 phone: Phone = PHONE, cutoff: Any = None,
                 rng: Optional[random.Random] = None, date_only: bool = False) -> list:
    """Aggregated sleep rows (one per night, HAE >= 6.6.2) for nights ending in the window.

    Keys in order: ``date, totalSleep, asleep, core, deep, rem, sleepStart, sleepEnd,
    inBed, inBedStart, inBedEnd, awake, source``; durations in hours, ``asleep`` 0 as for a
    watch with stages. ``date`` is local midnight of the wake-up day as a full timestamp,
    or ``yyyy-MM-dd`` with ``date_only`` (both occur, §2.5); it never depends on when the
    row is sent, so re-sent rows keep their coordinate.
    """
    rng = rng or random.Random(seed)
    rows = []
    for night in _nights(seed, start, end, phone, cutoff):
        hours, (sleep_start, sleep_end), (bed_start, bed_end), wake_day = _night_figures(
            night, phone.zone)
        date = _date_text(wake_day) if date_only else phone.time(
            _local_epoch(phone.zone, wake_day * _DAY))
        row = {"date": date, "totalSleep": hours["core"] + hours["deep"] + hours["rem"],
               "asleep": 0, "core": hours["core"], "deep": hours["deep"], "rem": hours["rem"],
               "sleepStart": phone.time(sleep_start), "sleepEnd": phone.time(sleep_end),
               "inBed": (bed_end - bed_start) / 3600, "inBedStart": phone.time(bed_start),
               "inBedEnd": phone.time(bed_end), "awake": hours["awake"]}
        rows.append(_with_source(row, phone.pick_source(rng, PIPED_SOURCE)))
    return rows


def sleep_segments(seed: int = 0, start: Any = DEFAULT_DAY, end: Any = None, *,
                   phone: Phone = PHONE, cutoff: Any = None,
                   rng: Optional[random.Random] = None, variant: str = "new") -> list:
    """Unaggregated sleep: one row per stage segment plus the phone's "In Bed" span.

    ``variant="old"``: keys ``startDate, endDate, qty, value, source``. ``"new"`` puts
    ``date, start, end`` first; ``date`` is the night's in-bed start, shared by every
    segment of the night while ``start``/``end`` differ. ``qty`` is hours; ``value`` comes
    from `SLEEP_VALUES` in the phone's language.
    """
    rng = rng or random.Random(seed)
    labels = SLEEP_VALUES[phone.language]
    rows = []
    for night in _nights(seed, start, end, phone, cutoff):
        spans = [(night.in_bed[0], night.in_bed[1], "inbed", OWNER_PHONE)]
        spans += [(begin, finish, stage, OWNER_WATCH) for begin, finish, stage in night.segments]
        for begin, finish, stage, device in spans:
            row = {}
            if variant == "new":
                row.update(date=phone.time(night.in_bed[0]), start=phone.time(begin),
                           end=phone.time(finish))
            row.update(startDate=phone.time(begin), endDate=phone.time(finish),
                       qty=(finish - begin) / 3600, value=labels[stage])
            rows.append(_with_source(row, phone.pick_source(rng, device)))
    return rows


#: The forms of nightly sleep summaries HAE has written (§2.5), see `sleep_summaries`.
SLEEP_FORMS = ("a", "b", "c")


def sleep_summaries(seed: int = 0, start: Any = DEFAULT_DAY, end: Any = None, *,
                    phone: Phone = PHONE, form: str = "c", date_as: str = "wake",
                    cutoff: Any = None, rng: Optional[random.Random] = None) -> list:
    """Nightly sleep summaries (one point per night ending in the window) in the form of
    one HAE era (§2.5):

    * ``"a"`` old (2022-23): ``date, asleep, sleepStart, sleepEnd, sleepSource, inBed,
      inBedStart, inBedEnd, inBedSource``; no stages;
    * ``"b"``: ``date, asleep`` (non-zero: only the unspecified part of the night, a few
      minutes drawn per night and taken from core, so ``asleep + core + deep + rem`` is the
      night's sleep), ``core, deep, rem, awake``, ``sleepStart, sleepEnd, inBed,
      inBedStart, inBedEnd, source``;
    * ``"c"`` HAE >= 6.6.2 with a Watch: ``date, totalSleep, asleep`` (0), ``core, deep,
      rem, awake, inBed, inBedStart, inBedEnd, sleepStart, sleepEnd, source``.

    ``date_as`` is what ``date`` holds: ``"wake"`` the wake time (``sleepEnd``) or
    ``"start"`` the sleep start the evening before (HAE has written both), ``"midnight"``
    local midnight of the wake day (as `sleep_nights`), or ``"mixed"``: wake or start, drawn
    per night. The nights are those of `sleep_segments` (same seed, same nights).
    """
    if form not in SLEEP_FORMS:
        raise ValueError("unknown sleep summary form %r" % form)
    rng = rng or random.Random(seed)
    zone = phone.zone
    rows = []
    for night in _nights(seed, start, end, phone, cutoff):
        hours, (sleep_start, sleep_end), (bed_start, bed_end), wake_day = _night_figures(
            night, zone)
        how = date_as
        if how == "mixed":
            how = "wake" if _draw(seed, _salt("sleep-date"), wake_day) < 0.5 else "start"
        date = {"wake": sleep_end, "start": sleep_start,
                "midnight": _local_epoch(zone, wake_day * _DAY)}[how]
        total = _fsum((hours["core"], hours["deep"], hours["rem"]))
        row: dict = {"date": phone.time(date)}
        core = hours["core"]
        if form == "c":
            row.update(totalSleep=total, asleep=0)
        elif form == "b":  # HAE's asleep beside stages: the unspecified part only (E: 0.59 h
            # beside 6.14 + 1.18 + 1.32 h); drawn by the night, so the rng is not advanced
            unspecified = (2 + int(38 * _draw(seed, _salt("sleep-unspecified"), wake_day))) / 60
            row["asleep"] = unspecified
            core -= unspecified
        else:
            row["asleep"] = total
        if form != "a":
            row.update(core=core, deep=hours["deep"], rem=hours["rem"], awake=hours["awake"])
        if form == "c":
            row.update(inBed=(bed_end - bed_start) / 3600, inBedStart=phone.time(bed_start),
                       inBedEnd=phone.time(bed_end), sleepStart=phone.time(sleep_start),
                       sleepEnd=phone.time(sleep_end))
        else:
            row.update(sleepStart=phone.time(sleep_start), sleepEnd=phone.time(sleep_end))
            if form == "a":
                row["sleepSource"] = phone.pick_source(rng) or OWNER_WATCH
            row.update(inBed=(bed_end - bed_start) / 3600, inBedStart=phone.time(bed_start),
                       inBedEnd=phone.time(bed_end))
        if form == "a":
            row["inBedSource"] = OWNER_PHONE
        else:
            _with_source(row, phone.pick_source(rng, PIPED_SOURCE))
        rows.append(row)
    return rows


def sleep_summary_so_far(row: dict, at: Any, *, phone: Phone = PHONE) -> dict:
    """A summary of form (b) or (c) as HAE sends it when it runs during the night (the phone
    unlocked at 3 am, the watch's samples synced so far): the night until ``at``, with
    ``sleepEnd``/``inBedEnd`` (and ``date`` when it held the wake time) at ``at`` and the
    hours scaled to the part slept. The morning's summary of the same night follows."""
    start, end = epoch_of_text(row["sleepStart"]), epoch_of_text(row["sleepEnd"])
    t = _epoch(at, phone.zone)
    if not start < t < end:
        raise ValueError("``at`` must lie inside the night")
    share = (t - start) / (end - start)
    out = dict(row)
    for key in ("totalSleep", "asleep", "core", "deep", "rem", "awake"):
        if isinstance(out.get(key), (int, float)):
            out[key] = out[key] * share
    if out["date"] == row["sleepEnd"]:
        out["date"] = phone.time(t)
    out["sleepEnd"] = out["inBedEnd"] = phone.time(t)
    out["inBed"] = (t - epoch_of_text(row["inBedStart"])) / 3600
    return out


def epoch_of_text(text: str) -> float:
    """Epoch seconds of a 24-hour HAE timestamp (the factory's own, for its own rows)."""
    stamp = dt.datetime.strptime(text, "%Y-%m-%d %H:%M:%S %z")
    return stamp.timestamp()


#: A sleep app on the phone: the second device recording the same nights.
SLEEP_APP = "AutoSleep"
#: How a sleep app's unstaged sleep is spelled per phone language (HealthKit's "asleep
#: unspecified"); other languages as in English.
_ASLEEP_VALUES = {"hk": "HKCategoryValueSleepAnalysisAsleepUnspecified"}


def _record(phone: Phone, begin: float, finish: float, value: str, variant: str,
            night_date: Optional[float]) -> dict:
    row = {}
    if variant == "new":
        row.update(date=phone.time(begin if night_date is None else night_date),
                   start=phone.time(begin), end=phone.time(finish))
    row.update(startDate=phone.time(begin), endDate=phone.time(finish),
               qty=(finish - begin) / 3600, value=value)
    return row


def sleep_app_records(seed: int = 0, start: Any = DEFAULT_DAY, end: Any = None, *,
                      phone: Phone = PHONE, app: str = SLEEP_APP, shift_s: int = 420,
                      variant: str = "old", cutoff: Any = None) -> list:
    """The nights of `sleep_segments` (same seed) as a second device records them: a sleep
    app writes an "In Bed" span and unstaged "Asleep" blocks (the watch's asleep segments
    between two awakenings, merged), all ``shift_s`` later than the watch saw them, so the
    two devices' records overlap without matching. ``source`` is ``app`` on every row."""
    labels = SLEEP_VALUES[phone.language]
    asleep_value = _ASLEEP_VALUES.get(phone.language, "Asleep")
    rows = []
    for night in _nights(seed, start, end, phone, cutoff):
        blocks: list = []
        for begin, finish, stage in night.segments:
            if stage == "awake":
                blocks.append(None)
            elif blocks and blocks[-1] is not None:
                blocks[-1] = (blocks[-1][0], finish)
            else:
                blocks.append((begin, finish))
        spans = [(night.in_bed[0] + shift_s, night.in_bed[1] + shift_s, labels["inbed"])]
        spans += [(b + shift_s, f + shift_s, asleep_value) for b, f in filter(None, blocks)]
        for begin, finish, value in spans:
            row = _record(phone, begin, finish, value, variant, night.in_bed[0] + shift_s)
            rows.append(_with_source(row, app))
    return rows


def sleep_nap(start: Any, minutes: float, *, phone: Phone = PHONE, variant: str = "new",
              source: str = OWNER_WATCH) -> list:
    """An afternoon nap as the watch records it: core sleep, a two-minute awakening, core
    sleep again (``start``: a naive datetime is the phone's wall time)."""
    labels = SLEEP_VALUES[phone.language]
    t0 = _epoch(start, phone.zone)
    first = t0 + int(minutes * 60 * 0.6)
    spans = ((t0, first, "core"), (first, first + 120, "awake"),
             (first + 120, t0 + int(minutes * 60), "core"))
    return [_with_source(_record(phone, b, f, labels[stage], variant, t0), source)
            for b, f, stage in spans]


#: HAE joins the sources of a night it sums (§2.2): a sleep app beside the Watch.
OVERLAP_SOURCE = SLEEP_APP + "|" + OWNER_WATCH + "|iPhone"


def sleep_overlapping_sources(seed: int = 0, start: Any = DEFAULT_DAY, end: Any = None, *,
                              phone: Phone = PHONE, cutoff: Any = None, total: bool = False,
                              source: str = OVERLAP_SOURCE) -> list:
    """Summaries of nights that a sleep app (AutoSleep, Sleep++) and the Watch both
    recorded (§2.5; the sum passed the window on 87 of 90 real nights of one person): HAE
    writes the app's hours as ``asleep`` beside the Watch's ``core, deep, rem, awake``, so
    two sources describe the same hours and ``asleep + core + deep + rem`` exceeds
    ``sleepEnd - sleepStart``. The nights are those of `sleep_segments` (same seed); the
    app's hours are the Watch's asleep hours give or take up to 20 minutes (drawn per
    night, so the figures are a pure function of the seed). ``total``: HAE >= 6.6.2 also
    writes ``totalSleep``, the sum of the four (as on every real record).

    Keys in order: ``date`` (the sleep start), [``totalSleep``], ``asleep, core, deep, rem,
    awake, sleepStart, sleepEnd, inBed, inBedStart, inBedEnd, source``."""
    rows = []
    for night in _nights(seed, start, end, phone, cutoff):
        hours, (sleep_start, sleep_end), (bed_start, bed_end), wake_day = _night_figures(
            night, phone.zone)
        watch = _fsum((hours["core"], hours["deep"], hours["rem"]))
        app = watch + (int(2400 * _draw(seed, _salt("sleep-app"), wake_day)) - 1200) / 3600
        row: dict = {"date": phone.time(sleep_start)}
        if total:
            row["totalSleep"] = _fsum((app, watch))
        row.update(asleep=app, core=hours["core"], deep=hours["deep"], rem=hours["rem"],
                   awake=hours["awake"], sleepStart=phone.time(sleep_start),
                   sleepEnd=phone.time(sleep_end), inBed=(bed_end - bed_start) / 3600,
                   inBedStart=phone.time(bed_start), inBedEnd=phone.time(bed_end),
                   source=source)
        rows.append(row)
    return rows


def sleep_app_summary(start: Any, end: Any, hours: float, *, phone: Phone = PHONE,
                      app: str = "Eight Sleep", in_bed: Optional[float] = None) -> dict:
    """One app's summary of what it recorded between ``start`` and ``end`` (a naive
    datetime is the phone's wall time), as HAE >= 6.6.2 sends it without a Watch: the app's
    sleep is unspecified, so ``totalSleep`` and ``asleep`` are both ``hours`` and the stages
    0. Real ones said more than the hours between: Eight Sleep writing its samples twice,
    27.0 h between 21:52 and 10:16; HeartWatch 82.7 h over three days (§2.5). ``in_bed``:
    the in-bed hours claimed (default: twice the span, the samples written twice).

    Keys in order: ``date`` (the sleep start), ``totalSleep, asleep, core, deep, rem, awake,
    inBed, inBedStart, inBedEnd, sleepStart, sleepEnd, source``."""
    t0, t1 = _epoch(start, phone.zone), _epoch(end, phone.zone)
    if not t0 < t1:
        raise ValueError("a sleep ends after it starts")
    first, last = phone.time(t0), phone.time(t1)
    return {"date": first, "totalSleep": hours, "asleep": hours, "core": 0, "deep": 0,
            "rem": 0, "awake": 0, "inBed": 2 * (t1 - t0) / 3600 if in_bed is None else in_bed,
            "inBedStart": first, "inBedEnd": last, "sleepStart": first, "sleepEnd": last,
            "source": app}


#: Two afternoon naps back to back beside a night, as one real day showed: (start, end,
#: core, deep, rem), wall times of the day and hours.
BACK_TO_BACK_NAPS = ((dt.time(15, 59), dt.time(17, 28), 0.8, 0.4, 0.15),
                     (dt.time(17, 28), dt.time(18, 26), 0.5, 0.3, 0.1))


def sleep_nap_summaries(day: dt.date, naps: Sequence[tuple] = BACK_TO_BACK_NAPS, *,
                        phone: Phone = PHONE, source: str = OWNER_WATCH) -> list:
    """Summaries of afternoon naps on ``day`` as HAE >= 6.6.2 sends them from a Watch, one
    per nap of ``naps`` ((start, end, core, deep, rem), see `BACK_TO_BACK_NAPS`):
    ``totalSleep`` is core + deep + rem beside ``asleep`` 0, in bed the nap's span.

    Keys in order: ``date`` (the nap's start), ``totalSleep, asleep, core, deep, rem,
    awake, inBed, inBedStart, inBedEnd, sleepStart, sleepEnd, source``."""
    rows = []
    for begin, finish, core, deep, rem in naps:
        t0 = _epoch(dt.datetime.combine(day, begin), phone.zone)
        t1 = _epoch(dt.datetime.combine(day, finish), phone.zone)
        first, last = phone.time(t0), phone.time(t1)
        rows.append({"date": first, "totalSleep": _fsum((core, deep, rem)), "asleep": 0,
                     "core": core, "deep": deep, "rem": rem, "awake": 0,
                     "inBed": (t1 - t0) / 3600, "inBedStart": first, "inBedEnd": last,
                     "sleepStart": first, "sleepEnd": last, "source": source})
    return rows


_NOT_ASLEEP = {labels[key] for labels in SLEEP_VALUES.values() for key in ("awake", "inbed")}


def sleep_records_again(rows: list, *, shift_s: int = 40, source: Optional[str] = None) -> list:
    """The asleep segments of stage records ``rows`` (`sleep_segments`, `sleep_nap`) written
    a second time, ``shift_s`` seconds later: a device syncing a night again, or an app
    importing it, so Health holds both copies. (An identical copy is one point in the
    store; only one that differs in time reaches a read as two.) Same keys, spellings and
    ``qty``; ``source`` replaced when given; the in-bed and awake records are not copied."""
    out = []
    for row in rows:
        if row["value"] in _NOT_ASLEEP:
            continue
        copy = dict(row)
        for key in ("start", "end", "startDate", "endDate"):
            if key in copy:
                copy[key] = _shift_text(copy[key], shift_s)
        if source is not None:
            copy["source"] = source
        out.append(copy)
    return out


def _shift_text(text: str, seconds: int) -> str:
    """A 24-hour HAE timestamp ``seconds`` later, in the offset it was written in."""
    stamp = dt.datetime.strptime(text, "%Y-%m-%d %H:%M:%S %z") + dt.timedelta(seconds=seconds)
    return stamp.strftime("%Y-%m-%d %H:%M:%S %z")


# ==========================================================================================
# Workouts: version 2 (current) and version 1 (legacy) with series and routes (§4).
# ==========================================================================================

#: name -> (location, isIndoor, has a route, workout heart rate, speed m/s).
WORKOUT_KINDS = {
    "Running": ("Outdoor", False, True, 152, 2.9),
    "Outdoor Walk": ("Outdoor", False, True, 108, 1.4),
    "Outdoor Cycling": ("Outdoor", False, True, 136, 6.5),
    "Traditional Strength Training": ("Indoor", True, False, 118, 0.0),
    "Yoga": ("Indoor", True, False, 92, 0.0),
}
_HOME = (47.6205, -122.3493)


class _Session(NamedTuple):
    uid: str
    start: int
    seconds: float
    kind: tuple


def _session(seed: int, start: Any, name: str, minutes: float, zone: Zone) -> _Session:
    t0 = int(_epoch(start, zone))
    frac = _draw(seed, _salt("workout"), t0, 1)
    kind = WORKOUT_KINDS.get(name, ("Indoor", True, False, 110, 0.0))
    return _Session(_uuid_from(seed, "workout", t0, name), t0, minutes * 60 + frac, kind)


def _workout_hr_minutes(session: _Session, rng: random.Random) -> list:
    """(minute start, Min, Avg, Max) per workout minute, Min < Avg < Max (§4.1, E55)."""
    out = []
    level = session.kind[3]
    for k in range(int(math.ceil(session.seconds / 60))):
        ramp = min(1.0, (k + 1) / 5)
        centre = 80 + (level - 80) * ramp + rng.uniform(-6, 6)
        low = round(centre - rng.uniform(2, 9))
        high = round(centre + rng.uniform(2, 9))
        out.append((session.start + 60 * k, low, rng.uniform(low + 0.5, high - 0.5), high))
    return out


def _route(session: _Session, count: int, rng: random.Random) -> list:
    """(t, lat, lon, alt, course, speed) samples spread evenly over the session."""
    lat, lon = _HOME
    alt, course = 52.0 + rng.uniform(-5, 5), rng.uniform(0, 360)
    speed = session.kind[4] or 1.0
    step = session.seconds / max(count, 1)
    out = []
    for k in range(count):
        course = (course + rng.gauss(0, 6)) % 360
        v = max(0.2, speed + rng.gauss(0, speed * 0.08))
        dist = v * step
        lat += dist * math.cos(math.radians(course)) / 111320.0
        lon += dist * math.sin(math.radians(course)) / (111320.0 * math.cos(math.radians(lat)))
        alt += rng.gauss(0, 0.3)
        out.append((session.start + k * step, lat, lon, alt, course, v))
    return out


def _route_count(session: _Session, route_points: Optional[int]) -> int:
    """``None``: one point per second for outdoor workouts (what the watch records)."""
    if route_points is not None:
        return route_points
    return int(session.seconds) if session.kind[2] else 0


def _default_start(start: Any) -> Any:
    if start is None:
        return dt.datetime.combine(DEFAULT_DAY, dt.time(17, 30))
    return start


def workout_v2(seed: int = 0, start: Any = None, *, name: str = "Running",
               minutes: float = 30.0, phone: Phone = PHONE, route_points: Optional[int] = None,
               rng: Optional[random.Random] = None) -> dict:
    """A version-2 workout (§4.1) starting at ``start`` (default DEFAULT_DAY 17:30 local).

    Keys: ``id`` (upper-case UUID, stable for the same seed/start/name), ``name``,
    ``start``, ``end``, ``duration`` (fractional seconds), ``location``, ``isIndoor``,
    ``activeEnergyBurned`` (kJ), ``distance``, ``intensity``, ``heartRate`` summary,
    ``heartRateData`` (per minute, Min < Avg < Max), ``heartRateRecovery`` (24 instantaneous
    points over 2 min from ``end``), ``activeEnergy`` series (kcal), ``route`` (only when
    it has points; ``route_points`` None = one per second outdoors), ``metadata`` ``{}``.
    No top-level ``source``.
    """
    rng = rng or random.Random(seed)
    session = _session(seed, _default_start(start), name, minutes, phone.zone)
    end = session.start + int(session.seconds)
    source = phone.pick_source(rng)
    hr = _workout_hr_minutes(session, rng)
    heart = [_with_source({"date": phone.time(t), "Min": low, "Avg": avg, "Max": high,
                           "units": "count/min"}, source) for t, low, avg, high in hr]
    recovery_bpm = hr[-1][2]
    recovery = []
    for k in range(24):
        bpm = round(recovery_bpm - 1.6 * k + rng.uniform(-2, 2))
        recovery.append(_with_source({"date": phone.time(end + 5 * k), "Min": bpm, "Avg": bpm,
                                      "Max": bpm, "units": "count/min"}, source))
    kcal = [rng.uniform(4, 14) * session.kind[3] / 140 for _ in hr]
    energy = [_with_source({"date": phone.time(t), "qty": q, "units": "kcal"}, source)
              for (t, _, _, _), q in zip(hr, kcal)]
    location, indoor, _, _, speed = session.kind
    avg_hr = _fsum(a for _, _, a, _ in hr) / len(hr)
    workout = {
        "id": session.uid, "name": name, "start": phone.time(session.start),
        "end": phone.time(end), "duration": session.seconds, "location": location,
        "isIndoor": indoor, "activeEnergyBurned": {"qty": _fsum(kcal) * 4.184, "units": "kJ"},
        "distance": {"qty": speed * session.seconds / 1000, "units": "km"},
        "intensity": {"qty": rng.uniform(3, 11), "units": "MET"},
        "heartRate": {"min": {"qty": min(h[1] for h in hr), "units": "count/min"},
                      "avg": {"qty": avg_hr, "units": "count/min"},
                      "max": {"qty": max(h[3] for h in hr), "units": "count/min"}},
        "heartRateData": heart, "heartRateRecovery": recovery, "activeEnergy": energy,
    }
    route = _route(session, _route_count(session, route_points), rng)
    if route:
        workout["route"] = [
            {"latitude": lat, "longitude": lon, "altitude": alt, "course": course,
             "courseAccuracy": rng.uniform(5, 25), "horizontalAccuracy": rng.uniform(2, 9),
             "verticalAccuracy": rng.uniform(1.5, 6), "timestamp": phone.time(t),
             "speed": v, "speedAccuracy": rng.uniform(0.2, 1.2)}
            for t, lat, lon, alt, course, v in route]
    workout["metadata"] = {}
    return workout


def workout_v1(seed: int = 0, start: Any = None, *, name: str = "Running",
               minutes: float = 30.0, phone: Phone = PHONE, route_points: Optional[int] = None,
               rng: Optional[random.Random] = None) -> dict:
    """A version-1 (legacy, HAE 8.1.2) workout (§4.2): no ``id``, no ``duration``.

    ``heartRateData``/``heartRateRecovery`` are ``[{date, qty, units}]``, ``route`` is
    ``[{lat, lon, altitude, timestamp}]``, energies are ``{qty, units}`` objects, plus
    ``stepCount`` (``steps``), ``speed`` (``mi/hr``), ``elevation {ascent, descent, units}``
    and the other summary fields of the real 8.1.2 sample.
    """
    rng = rng or random.Random(seed)
    session = _session(seed, _default_start(start), name, minutes, phone.zone)
    end = session.start + int(session.seconds)
    hr = _workout_hr_minutes(session, rng)
    miles = session.kind[4] * session.seconds / 1609.344
    active = _fsum(rng.uniform(4, 14) for _ in hr) * session.kind[3] / 140
    route = _route(session, _route_count(session, route_points), rng)
    return {
        "name": name, "start": phone.time(session.start), "end": phone.time(end),
        "heartRateData": [{"date": phone.time(t), "qty": avg, "units": "bpm"}
                          for t, _, avg, _ in hr],
        "heartRateRecovery": [{"date": phone.time(end + 60 * k),
                               "qty": hr[-1][2] - 9 * k + rng.uniform(-2, 2), "units": "bpm"}
                              for k in range(3)],
        "route": [{"lat": lat, "lon": lon, "altitude": alt, "timestamp": phone.time(t)}
                  for t, lat, lon, alt, _, _ in route],
        "totalEnergy": {"qty": active * 1.25, "units": "kcal"},
        "activeEnergy": {"qty": active, "units": "kcal"},
        "maxHeartRate": {"qty": max(h[3] for h in hr), "units": "bpm"},
        "avgHeartRate": {"qty": _fsum(h[2] for h in hr) / len(hr), "units": "bpm"},
        "stepCount": {"qty": round(session.seconds * 2.6 * (session.kind[4] > 0)),
                      "units": "steps"},
        "stepCadence": {"qty": rng.uniform(150, 175) if session.kind[4] else 0, "units": "spm"},
        "distance": {"qty": miles, "units": "mi"},
        "speed": {"qty": miles / (session.seconds / 3600), "units": "mi/hr"},
        "flightsClimbed": {"qty": rng.randint(0, 6), "units": "count"},
        "intensity": {"qty": rng.uniform(3, 11), "units": "kcal/hr·kg"},
        "temperature": {"qty": rng.uniform(45, 75), "units": "degF"},
        "humidity": {"qty": rng.randint(40, 90), "units": "%"},
        "elevation": {"ascent": rng.uniform(0, 60), "descent": rng.uniform(0, 60),
                      "units": "ft"},
        "isIndoor": session.kind[1],
        "totalSwimmingStrokeCount": {"qty": 0, "units": "count"},
        "swimCadence": {"qty": 0, "units": "spm"},
    }


@functools.lru_cache(maxsize=4096)
def _day_workout(seed: int, zone: Zone, day: int) -> Optional[tuple]:
    """(start epoch, minutes, name) of the workout on local day ``day``, if any."""
    salt = _salt("workout-plan")
    if _draw(seed, salt, day) >= 0.6:
        return None
    names = sorted(WORKOUT_KINDS)
    name = names[int(len(names) * _draw(seed, salt, day, 1))]
    morning = _draw(seed, salt, day, 2) < 0.3
    clock = (6 * 60 + 30 if morning else 17 * 60) + int(110 * _draw(seed, salt, day, 3))
    start = _local_epoch(zone, day * _DAY + clock * 60 + int(60 * _draw(seed, salt, day, 4)))
    return start, 20 + int(55 * _draw(seed, salt, day, 5)), name


def workouts_between(seed: int, start: Any, end: Any, *, phone: Phone = PHONE,
                     version: int = 2, route_points: Optional[int] = None,
                     rng: Optional[random.Random] = None) -> list:
    """The truth's workouts (about three in five days) that end in ``[start, end)``."""
    rng = rng or random.Random(seed)
    zone = phone.zone
    t0, t1 = _epoch(start, zone), _epoch(end, zone)
    build = workout_v2 if version == 2 else workout_v1
    out = []
    for day in range(int(t0 // _DAY) - 1, int(t1 // _DAY) + 2):
        plan = _day_workout(seed, zone, day)
        if plan and t0 <= plan[0] + plan[1] * 60 < t1:
            out.append(build(seed, plan[0], name=plan[2], minutes=plan[1], phone=phone,
                             route_points=route_points, rng=rng))
    return out


# ==========================================================================================
# Other sections: stateOfMind, ecg, heartRateNotifications, symptoms, cycleTracking,
# medications, in their observed (not documented) shapes (§4b).
# ==========================================================================================

_MOOD_LABELS = ("proud", "calm", "content", "grateful", "stressed", "tired", "happy",
                "anxious", "hopeful", "irritated")
_MOOD_ASSOCIATIONS = ("work", "family", "fitness", "health", "friends", "weather", "tasks")
_VALENCE_CLASSES = ((-0.7, "very_unpleasant"), (-0.4, "unpleasant"),
                    (-0.1, "slightly_unpleasant"), (0.1, "neutral"),
                    (0.4, "slightly_pleasant"), (0.7, "pleasant"), (2.0, "very_pleasant"))


def state_of_mind(rng: random.Random, when: Any, *, kind: str = "momentary_emotion") -> dict:
    """A stateOfMind entry: ``id, start, end`` (ISO-8601 ``Z``), ``kind``
    (``momentary_emotion``/``daily_mood``), ``labels``, ``associations``, ``valence``
    (-1..1), ``valenceClassification`` as a string slug, ``metadata {}``."""
    t = _epoch(when)
    valence = rng.uniform(-1, 1)
    slug = next(name for bound, name in _VALENCE_CLASSES if valence < bound)
    return {"id": new_uuid(rng), "start": iso_z(t), "end": iso_z(t), "kind": kind,
            "labels": rng.sample(_MOOD_LABELS, rng.randint(1, 3)),
            "associations": rng.sample(_MOOD_ASSOCIATIONS, rng.randint(0, 2)),
            "valence": valence, "valenceClassification": slug, "metadata": {}}


def _ecg_microvolts(phase: float) -> float:
    """A crude P-QRS-T beat; ``phase`` in [0, 1)."""
    def bump(centre: float, width: float, height: float) -> float:
        return height * math.exp(-((phase - centre) / width) ** 2)
    return (bump(0.12, 0.03, 110) - bump(0.28, 0.008, 90) + bump(0.3, 0.01, 950)
            - bump(0.32, 0.01, 230) + bump(0.55, 0.05, 260))


def ecg_reading(rng: random.Random, when: Any, *, phone: Phone = PHONE,
                samples: int = ECG_SAMPLES, hz: float = _ECG_HZ) -> dict:
    """An ECG: HAE-format ``start``/``end`` (30 s), ``classification``, ``severity``,
    ``averageHeartRate``, ``numberOfVoltageMeasurements``, ``samplingFrequency`` (``hz``),
    ``voltageMeasurements [{date: epoch float, voltage, units: "mcV"}]``, ``source: "ECG"``."""
    t0 = float(int(_epoch(when, phone.zone)))
    bpm = rng.randint(58, 84)
    volts = [{"date": t0 + k / hz,
              "voltage": _ecg_microvolts((k / hz * bpm / 60) % 1) + rng.gauss(0, 12),
              "units": "mcV"} for k in range(samples)]
    return {"start": phone.time(t0), "end": phone.time(t0 + 30), "classification": "Sinus Rhythm",
            "severity": "None", "averageHeartRate": bpm, "numberOfVoltageMeasurements": samples,
            "samplingFrequency": hz, "voltageMeasurements": volts, "source": "ECG"}


def heart_rate_notification(rng: random.Random, when: Any, *, phone: Phone = PHONE,
                            kind: str = "low_heart_rate_notification") -> dict:
    """A heart-rate notification in the shape issue #68 observed: ``heartNotification``
    slug, ``threshold``, HAE-format ``start``/``end`` (10 min), ``heartRateData`` with epoch
    dates, and ``source`` as an object."""
    t0 = float(int(_epoch(when, phone.zone)))
    low = kind.startswith("low")
    threshold = 45 if low else 120
    data = [{"date": t0 + 60 * k + rng.uniform(0, 5),
             "qty": threshold + (-rng.randint(1, 6) if low else rng.randint(1, 15)),
             "units": "count/min"} for k in range(10)]
    source = {"name": OWNER_WATCH, "bundleIdentifier": "com.apple.health." + new_uuid(rng)}
    return {"heartNotification": kind, "threshold": threshold, "start": phone.time(t0),
            "end": phone.time(t0 + 600), "heartRateData": data, "source": source}


_SYMPTOMS = ("Headache", "Fatigue", "Coughing", "Runny Nose", "Sore Throat", "Nausea")
_SEVERITIES = ("Mild", "Moderate", "Severe", "Present")


def symptoms(rng: random.Random, when: Any, *, phone: Phone = PHONE, count: int = 2) -> list:
    """``count`` symptom entries logged together: they share ``start`` and ``end``
    (``start, end, name, severity, userEntered, source``)."""
    t0 = _epoch(when, phone.zone)
    start, end = phone.time(t0), phone.time(t0 + rng.choice((0, 1800, 3600)))
    source = phone.pick_source(rng, OWNER_PHONE)
    return [_with_source({"start": start, "end": end, "name": name,
                          "severity": rng.choice(_SEVERITIES), "userEntered": True}, source)
            for name in rng.sample(_SYMPTOMS, count)]


def cycle_tracking(rng: random.Random, day: dt.date, *, phone: Phone = PHONE,
                   cycle_day: int = 0) -> list:
    """Cycle-tracking entries for one local day, sharing ``start``/``end`` (local
    midnight): ``start, end, name, value`` and ``isCycleStart`` on menstrual flow."""
    stamp = phone.time(local_midnight(phone.zone, day))
    entries = []
    if cycle_day < 5:
        flow = ("Heavy", "Medium", "Medium", "Light", "Light")[cycle_day]
        entries.append({"start": stamp, "end": stamp, "name": "Menstrual Flow",
                        "value": flow, "isCycleStart": cycle_day == 0})
    if 11 <= cycle_day <= 15:
        entries.append({"start": stamp, "end": stamp, "name": "Ovulation Test Result",
                        "value": "Positive" if cycle_day == 13 else "Negative"})
    entries.append({"start": stamp, "end": stamp, "name": "Cervical Mucus Quality",
                    "value": rng.choice(("Dry", "Sticky", "Creamy", "Watery", "Egg White"))})
    return entries


_MEDICATIONS = (("Ibuprofen 200 mg Oral Tablet", "Ibu", "310965"),
                ("Cetirizine 10 mg Oral Tablet", None, "1014678"),
                ("Vitamin D3 1000 UNT Oral Capsule", "D3", "316628"))


def medications(rng: random.Random, when: Any, *, phone: Phone = PHONE,
                scheduled: Any = None) -> list:
    """Doses logged together (shared ``start``/``end``): ``displayText, nickname?, start,
    end, scheduledDate, status, isArchived, dosage, codings[{code, system, version}]``."""
    t0 = _epoch(when, phone.zone)
    planned = phone.time(_epoch(scheduled, phone.zone) if scheduled is not None else t0)
    doses = []
    for display, nickname, code in _MEDICATIONS[:rng.randint(1, 3)]:
        dose = {"displayText": display}
        if nickname:
            dose["nickname"] = nickname
        dose.update(start=phone.time(t0), end=phone.time(t0), scheduledDate=planned,
                    status="Taken" if rng.random() < 0.9 else "Skipped", isArchived=False,
                    dosage=1, codings=[{"code": code,
                                        "system": "http://www.nlm.nih.gov/research/umls/rxnorm",
                                        "version": "09022024"}])
        doses.append(dose)
    return doses


#: The six non-metric, non-workout sections in the order the wiki lists them.
RECORD_SECTIONS = ("stateOfMind", "medications", "symptoms", "cycleTracking", "ecg",
                   "heartRateNotifications")


def _journal_events(seed: int, zone: Zone, day: int) -> list:
    """(t, what) of the record-section entries on local day ``day``, in time order."""
    salt = _salt("journal")

    def draw(j: int) -> float:
        return _draw(seed, salt, day, j)

    def clock(j: int, first_hour: float, last_hour: float) -> int:
        minute = int((first_hour + (last_hour - first_hour) * draw(j)) * 60)
        return _local_epoch(zone, day * _DAY + minute * 60 + int(60 * draw(j + 1)))

    events = [(_local_epoch(zone, day * _DAY), "cycleTracking"),
              (clock(1, 7.5, 9), "medications"), (clock(3, 20, 22.5), "daily_mood")]
    events += [(clock(5 + 2 * k, 9, 20), "momentary_emotion") for k in range(int(3 * draw(4)))]
    if draw(11) < 0.3:
        events.append((clock(12, 10, 19), "symptoms"))
    if draw(14) < 0.3:
        events.append((clock(15, 8, 21), "ecg"))
    if draw(17) < 0.12:
        events.append((clock(18, 1, 5), "heartRateNotifications"))
    return sorted(events)


def records_sections(seed: int, start: Any, end: Any = None, *, phone: Phone = PHONE,
                     cutoff: Any = None, rng: Optional[random.Random] = None,
                     ecg_samples: int = ECG_SAMPLES) -> dict:
    """The six record sections for ``[start, min(end, cutoff))``, each a list (often
    empty), keyed as in `RECORD_SECTIONS`. Per local day the truth holds a daily mood and
    up to two momentary emotions, morning medications, symptoms on some days, a 28-day
    cycle, an ECG every few days and a rare heart-rate notification."""
    rng = rng or random.Random(seed)
    zone = phone.zone
    t0, t1 = _span(start, end, zone)
    if cutoff is not None:
        t1 = min(t1, _epoch(cutoff, zone))
    out: dict = {name: [] for name in RECORD_SECTIONS}
    first = int((t0 + _offset_at(zone, t0) * 60) // _DAY)
    for day in range(first, int((t1 + _offset_at(zone, t1) * 60) // _DAY) + 1):
        for t, what in _journal_events(seed, zone, day):
            if not t0 <= t < t1:
                continue
            if what == "cycleTracking":
                out[what] += cycle_tracking(rng, _date_of_day(day), phone=phone,
                                            cycle_day=day % 28)
            elif what == "medications":
                out[what] += medications(rng, t, phone=phone,
                                         scheduled=_local_epoch(zone, day * _DAY + 8 * 3600))
            elif what in ("daily_mood", "momentary_emotion"):
                out["stateOfMind"].append(state_of_mind(rng, t, kind=what))
            elif what == "symptoms":
                out[what] += symptoms(rng, t, phone=phone, count=rng.randint(1, 3))
            elif what == "ecg":
                out[what].append(ecg_reading(rng, t, phone=phone, samples=ecg_samples))
            else:
                out[what].append(heart_rate_notification(rng, t, phone=phone))
    return out


# ==========================================================================================
# Serialisation: iOS-style pretty JSON, and re-sends that differ only in bytes (§1).
# ==========================================================================================

_NUMBER = re.compile(r"-?(?:0|[1-9]\d*)(?:\.\d+)?(?:[eE][+-]?\d+)?\Z")


class RawNumber(str):
    """A JSON number literal written verbatim by `dumps_hae` (``"0e0"``, ``"-0"``,
    ``"61.999999999999993"``); parses as that number."""

    def __new__(cls, text: str) -> "RawNumber":
        if not _NUMBER.match(text):
            raise ValueError("not a JSON number: %r" % text)
        return super().__new__(cls, text)


def _float_text(x: float, rng: Optional[random.Random]) -> str:
    """``x`` with 17 significant digits; with ``rng``, half of the non-integral values get
    the shortest spelling of the same double or a neighbour one ulp away (relative change
    <= 2.3e-16, far inside 1e-12)."""
    if not math.isfinite(x):
        raise ValueError("JSON has no %r" % x)
    if rng is not None and x != int(x) and rng.random() < 0.5:
        roll = rng.random()
        if roll < 0.4:
            return repr(x)
        x = math.nextafter(x, math.inf if roll < 0.7 else -math.inf)
    return "%.17g" % x


class _Writer:
    """Appends the JSON text of one value to ``parts``; see `dumps_hae`."""

    def __init__(self, rng: Optional[random.Random], pretty: bool, escape_slashes: bool):
        self.rng = rng
        self.pretty = pretty
        self.escape_slashes = escape_slashes
        self.parts: list = []
        self.indents = ["\n"]

    def newline(self, depth: int) -> str:
        while len(self.indents) <= depth:
            self.indents.append("\n" + "  " * len(self.indents))
        return self.indents[depth]

    def string(self, text: str) -> str:
        quoted = encode_basestring(text)
        return quoted.replace("/", "\\/") if self.escape_slashes else quoted

    def value(self, obj: Any, depth: int) -> None:
        if isinstance(obj, str):
            self.parts.append(obj if isinstance(obj, RawNumber) else self.string(obj))
        elif obj is True or obj is False or obj is None:
            self.parts.append("true" if obj is True else "false" if obj is False else "null")
        elif isinstance(obj, int):
            self.parts.append(str(int(obj)))
        elif isinstance(obj, float):
            self.parts.append(_float_text(obj, self.rng))
        elif isinstance(obj, dict):
            self.container(obj, depth, "{", "}")
        elif isinstance(obj, (list, tuple)):
            self.container(obj, depth, "[", "]")
        else:
            raise TypeError("cannot write %r as JSON" % type(obj).__name__)

    def container(self, obj: Any, depth: int, opener: str, closer: str) -> None:
        if not obj:  # NSJSONSerialization writes empty containers over two lines
            inner = self.newline(0) + self.newline(depth) if self.pretty else ""
            self.parts.append(opener + inner + closer)
            return
        is_dict = isinstance(obj, dict)
        items = list(obj) if is_dict else obj
        if is_dict and self.rng is not None:
            self.rng.shuffle(items)
        inner = self.newline(depth + 1) if self.pretty else ""
        colon = " : " if self.pretty else ":"
        self.parts.append(opener)
        for k, item in enumerate(items):
            self.parts.append(("," if k else "") + inner)
            if is_dict:
                if not isinstance(item, str):
                    raise TypeError("JSON keys must be strings, not %r" % (item,))
                self.parts.append(self.string(item) + colon)
                item = obj[item]
            self.value(item, depth + 1)
        self.parts.append((self.newline(depth) if self.pretty else "") + closer)


def dumps_hae(obj: Any, rng: Optional[random.Random] = None, pretty: bool = True, *,
              escape_slashes: bool = False) -> bytes:
    """Serialise ``obj`` as HAE does: UTF-8 bytes, iOS pretty style (``"key" : value``,
    2-space indent, empty containers as ``[`` newline newline ``]``), compact when not
    ``pretty``.

    Without ``rng`` the output is fully determined by ``obj``: keys in the given order,
    floats as ``'%.17g'`` (17 significant digits, e.g. 61.999999999999993), ints as ints,
    `RawNumber` verbatim; so ``dumps_hae(json.loads(b)) == b`` for any ``b`` it wrote. With
    ``rng`` it writes a re-send: every object's keys shuffled, half the non-integral floats
    re-spelled or moved one ulp (`same_value` still holds). Non-ASCII is written as UTF-8
    and ``& < >`` are never escaped; ``escape_slashes`` writes ``/`` as ``\\/`` like Apple's
    encoders do by default (whether HAE does is not established).
    """
    writer = _Writer(rng, pretty, escape_slashes)
    writer.value(obj, 0)
    return "".join(writer.parts).encode("utf-8")


def resend(body: bytes, rng: random.Random, pretty: bool = True) -> bytes:
    """The same parsed value re-serialised as a later send of unchanged data."""
    return dumps_hae(json.loads(body), rng, pretty)


def same_value(a: Any, b: Any, rel: float = 1e-12) -> bool:
    """True when two parsed JSON values have the same structure, equal strings and
    booleans, and numbers with ``|a - b| <= rel * max(|a|, |b|)`` (the storage spec's "same
    value", ``source`` included). An independent oracle for tests."""
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b) and a == b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return a == b or abs(a - b) <= rel * max(abs(a), abs(b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same_value(a[k], b[k], rel) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(same_value(x, y, rel) for x, y in zip(a, b))
    return type(a) is type(b) and a == b


# ==========================================================================================
# Headers: what the app adds to every request (§5).
# ==========================================================================================


@dataclass(frozen=True)
class Automation:
    """One REST automation as the receiver sees it in headers: its user-chosen name, its
    time grouping (`GROUPINGS`) and its date range (`PERIODS`)."""

    name: str
    aggregation: str = "Minutes"
    period: str = "Since Last Sync"

    @property
    def id(self) -> str:
        """Upper-case UUID, stable for the automation's name."""
        return _uuid_from("automation", self.name)


def new_uuid(rng: random.Random) -> str:
    """A fresh upper-case v4 UUID drawn from ``rng``."""
    return str(uuid.UUID(int=rng.getrandbits(128), version=4)).upper()


def headers_for(automation: Automation, session_id: Optional[str] = None,
                token: Optional[str] = None) -> dict:
    """The headers HAE sends for one request of ``automation``: Content-Type,
    automation-name/-id/-aggregation/-period, session-id (a fresh random UUID unless given;
    pass ``new_uuid(rng)`` for determinism) and ``Authorization: Bearer`` with a token."""
    headers = {
        "Content-Type": "application/json",
        "automation-name": automation.name,
        "automation-id": automation.id,
        "automation-aggregation": automation.aggregation,
        "automation-period": automation.period,
        "session-id": session_id or str(uuid.uuid4()).upper(),
    }
    if token is not None:
        headers["Authorization"] = "Bearer " + token
    return headers


# ==========================================================================================
# Traffic: a week of deliveries from several automations, in arrival order.
# ==========================================================================================


class Push(NamedTuple):
    """One delivery: when it arrived (aware UTC), its headers, body and automation."""

    received_at: dt.datetime
    headers: dict
    body: bytes
    automation: Automation


@dataclass(frozen=True)
class _Plan:
    fast_metrics: tuple
    today_metrics: tuple
    week_metrics: tuple
    week_grouping: str
    raw_metrics: tuple
    sessions: tuple  # local minute of day each phone session starts (before jitter)
    session_ticks: int  # fast pushes per session, 5 minutes apart
    route_points: Optional[int]
    ecg_samples: int


_SMALL = _Plan(("step_count", "active_energy", "heart_rate"), ("step_count", "active_energy"),
               ("step_count", "heart_rate"), "Hours", ("heart_rate", "step_count"),
               (7 * 60 + 10, 12 * 60 + 20, 18 * 60 + 40, 22 * 60 + 5), 4, 60, 512)
_BIG = _Plan(("step_count", "active_energy", "basal_energy_burned", "walking_running_distance",
              "heart_rate", "apple_exercise_time", "flights_climbed"),
             ("step_count", "active_energy", "basal_energy_burned", "apple_exercise_time",
              "walking_running_distance", "flights_climbed"),
             ("step_count", "active_energy", "basal_energy_burned", "walking_running_distance",
              "heart_rate", "heart_rate_variability", "blood_oxygen_saturation",
              "respiratory_rate", "blood_pressure"), "Minutes",
             ("heart_rate", "step_count", "active_energy", "heart_rate_variability"),
             tuple(h * 60 for h in range(7, 23)), 6, None, ECG_SAMPLES)

#: The automations of the simulated phone (names are what a user might type).
FAST = Automation("Health fast", "Minutes", "Since Last Sync")
TODAY = Automation("Today totals", "Days", "Today")
WEEK = Automation("Week backfill", "Hours", "Previous 7 Days")
SLEEP = Automation("Sleep", "Days", "Previous 7 Days")
RAW = Automation("Raw samples", "Default", "Default")
WORKOUTS = Automation("Workouts", "Default", "Since Last Sync")
JOURNAL = Automation("Journal", "Default", "Since Last Sync")
_SLEEP_METRICS = ("sleep_analysis", "resting_heart_rate", "heart_rate_variability")


def _window(automation: Automation, now: float, last: Optional[float], zone: Zone) -> tuple:
    """[start, end) an automation exports at ``now`` given its previous run at ``last``."""
    today = int((now + _offset_at(zone, now) * 60) // _DAY)
    midnight = _local_epoch(zone, today * _DAY)
    if automation.period == "Today":
        return midnight, now
    if automation.period == "Previous 7 Days":
        return _local_epoch(zone, (today - 7) * _DAY), midnight
    if automation.period == "Default":
        return _local_epoch(zone, (today - 1) * _DAY), now
    if automation.period == "Yesterday":
        return _local_epoch(zone, (today - 1) * _DAY), midnight
    if last is None:
        return midnight, now
    size = _SIZES.get(automation.aggregation, 60)  # the last bucket is sent again
    return _bucket_start(last, size, zone), now


def _session_starts(seed: int, zone: Zone, day: int, plan: _Plan) -> list:
    salt = _salt("sessions")
    return [_local_epoch(zone, day * _DAY + 60 * (minute + int(30 * _draw(seed, salt, day, k))))
            for k, minute in enumerate(plan.sessions)]


def _jobs(tick: int, session: int, sessions: int) -> list:
    """Automations that fire at this tick: fast every tick, today totals every third,
    the once-a-day ones at the day's first (and raw also last) session."""
    jobs = [FAST]
    if tick % 3 == 0:
        jobs.append(TODAY)
    if tick == 0 and session == 0:
        jobs += [WEEK, SLEEP, RAW]
    if tick == 0:
        jobs.append(WORKOUTS)
    if tick == 0 and session == sessions - 1:
        jobs += [RAW, JOURNAL]
    return jobs


def _payload_for(automation: Automation, seed: int, window: tuple, now: float, plan: _Plan,
                 phone: Phone, rng: random.Random) -> Optional[dict]:
    start, end = window
    if automation is WORKOUTS:
        found = workouts_between(seed, start, end, phone=phone, route_points=plan.route_points,
                                 rng=rng)
        return envelope(workouts=found) if found else None  # no push without a workout
    if automation is JOURNAL:
        return envelope(**records_sections(seed, start, end, phone=phone, cutoff=now,
                                           rng=rng, ecg_samples=plan.ecg_samples))
    names = {FAST: plan.fast_metrics, TODAY: plan.today_metrics, WEEK: plan.week_metrics,
             SLEEP: _SLEEP_METRICS, RAW: plan.raw_metrics + ("sleep_analysis",)}[automation]
    sleep = "segments" if automation is RAW else "aggregated"
    siblings = ("workouts",) if automation is TODAY else ()  # as older app versions did
    grouping = plan.week_grouping if automation is WEEK else automation.aggregation
    return metrics_payload(seed, names, start, end, grouping, phone=phone, cutoff=now,
                           rng=rng, sleep=sleep, siblings=siblings)


def week_of_traffic(seed: int = 0, start: dt.date = DEFAULT_DAY, days: int = 7, *,
                    small: bool = True, phone: Phone = PHONE,
                    token: Optional[str] = None) -> Iterator[Push]:
    """Deliveries of ``days`` local days from ``start``, in arrival order.

    The phone is used in a few sessions a day (4 short ones with ``small``, hourly 07-22
    otherwise); HAE only runs while it is unlocked. In each session a fast automation
    (Minutes, Since Last Sync) pushes every 5 minutes and re-sends its last, still growing
    minute; "Today totals" (Days, Today) every 15 minutes re-sends today's growing day
    buckets. At the first session of a day "Week backfill" (Previous 7 Days; Hours with
    ``small``, Minutes otherwise) and "Sleep" (aggregated sleep, Days, Previous 7 Days)
    re-send six days already sent, re-serialised; "Raw samples" (Default grouping, Default
    period: yesterday and today so far, per-second heart rate, sleep segments) runs then and
    at the last session, which also sends the six record sections ("Journal"). "Workouts"
    (v2) pushes when a workout ended since its last run. Every body is written with shuffled
    keys and last-digit jitter. The default start puts DST_SPRING in the week.
    """
    plan = _SMALL if small else _BIG
    week = WEEK if small else Automation(WEEK.name, plan.week_grouping, WEEK.period)
    rng = random.Random(seed)
    zone = phone.zone
    last: dict = {}
    first_day = _day_number(start)
    for day in range(first_day, first_day + days):
        sessions = _session_starts(seed, zone, day, plan)
        for session, began in enumerate(sessions):
            for tick in range(plan.session_ticks):
                moment = began + 300 * tick
                for order, job in enumerate(_jobs(tick, session, len(sessions))):
                    now = moment + 4 * order + rng.randint(0, 3)
                    window = _window(job, now, last.get(job), zone)
                    payload = _payload_for(job, seed, window, now, plan, phone, rng)
                    last[job] = now
                    if payload is None:
                        continue
                    sent_as = week if job is WEEK else job
                    yield Push(dt.datetime.fromtimestamp(now, dt.timezone.utc),
                               headers_for(sent_as, new_uuid(rng), token),
                               dumps_hae(payload, rng), sent_as)


# ==========================================================================================
# Size helpers: large but realistic bodies, built fast from string templates.
# ==========================================================================================

#: (name, units, value keys) of the metrics in `big_metrics_body`.
_BIG_METRICS = (("step_count", "count", ("qty",)), ("active_energy", "kJ", ("qty",)),
                ("basal_energy_burned", "kJ", ("qty",)),
                ("walking_running_distance", "km", ("qty",)),
                ("heart_rate", "count/min", ("Min", "Avg", "Max")))
_BIG_SOURCES = ((0.85, OWNER_WATCH), (0.95, PIPED_SOURCE), (0.98, ""), (1.01, None))


def _big_values(name: str, rng: random.Random) -> tuple:
    r = rng.random
    if name == "heart_rate":
        low = 55 + int(40 * r())
        high = low + int(25 * r())
        return str(low), "%.17g" % (low + (high - low) * r()), str(high)
    scale = {"step_count": (4.0, 110.0), "active_energy": (0.2, 6.0),
             "basal_energy_burned": (4.2, 0.9), "walking_running_distance": (0.003, 0.09)}
    base, spread = scale[name]
    return ("%.17g" % (base + spread * r()),)


def _point_templates(keys: tuple, rng: random.Random, count: int) -> list:
    """``count`` str.format templates of one pretty point (indent 10) with shuffled keys;
    each takes (date, *values, source) positionally. Half lack ``source``."""
    templates = []
    for k in range(count):
        fields = ["date"] + list(keys) + (["source"] if k % 2 == 0 else [])
        order = fields[:]
        rng.shuffle(order)
        lines = ['            "%s" : {%d}' % (f, fields.index(f)) for f in order]
        templates.append("          {{\n" + ",\n".join(lines) + "\n          }}")
    return templates


def big_metrics_body(target_bytes: int, seed: int = 0, *, start: Any = DST_SPRING,
                     phone: Phone = PHONE) -> bytes:
    """A valid minute-grouped metrics body of about ``target_bytes`` (within one point),
    pretty-printed exactly as `dumps_hae` would write its parsed value.

    Five metrics share the size; each is a run of consecutive minutes from local midnight
    of ``start`` (default a DST day, so offsets change inside the body), with random key
    orders, 17-digit floats and mostly single sources (some pipe-joined, ``""`` or
    missing). About 160 bytes per point: 60 MB is ~375k points and takes a second or two.
    """
    rng = random.Random(seed)
    zone = phone.zone
    t_start = int(_epoch(start, zone))
    head = '{\n  "data" : {\n    "metrics" : [\n'
    tail = "\n    ]\n  }\n}"
    chunks = [head]
    size = len(head) + len(tail)
    for index, (name, units, keys) in enumerate(_BIG_METRICS):
        opener = ('      {\n        "name" : "%s",\n        "units" : "%s",\n'
                  '        "data" : [\n' % (name, units))
        closer = "\n        ]\n      }"
        share = (target_bytes - size) / (len(_BIG_METRICS) - index)
        chunks.append((",\n" if index else "") + opener)
        used = len(opener) + len(closer) + (2 if index else 0)
        templates = _point_templates(keys, rng, 8)
        points = []
        t = t_start
        while used < share or not points:
            roll = rng.random()
            source = next(s for bound, s in _BIG_SOURCES if roll < bound)
            date = encode_basestring(phone.time(t))
            if source is None:
                template = templates[1 + 2 * rng.randrange(4)]
                text = template.format(date, *_big_values(name, rng))
            else:
                template = templates[2 * rng.randrange(4)]
                quoted = encode_basestring(source)
                text = template.format(date, *_big_values(name, rng), quoted)
                used += 2 * quoted.count("’")  # three UTF-8 bytes, one character
            points.append(text)
            used += len(text) + 2
            t += 60
        chunks.append(",\n".join(points))
        chunks.append(closer)
        size += used
    chunks.append(tail)
    return "".join(chunks).encode("utf-8")


def big_workouts_body(target_bytes: int, seed: int = 0, *, start: Any = DEFAULT_DAY,
                      phone: Phone = PHONE) -> bytes:
    """A v2 workouts body of about ``target_bytes`` (within a few percent): one run a day,
    up to two hours with a route point per second (~440 bytes each), written re-send style
    (shuffled keys, jitter) exactly as `dumps_hae` would write the whole body."""
    rng = random.Random(seed)
    head, tail = '{\n  "data" : {\n    "workouts" : [\n      ', "\n    ]\n  }\n}"
    texts: list = []
    size = len(head) + len(tail)
    day = _day_number(start)
    while size < target_bytes or not texts:
        points = max(60, min(7200, (target_bytes - size - 50_000) // 440))
        begin = _local_epoch(phone.zone, day * _DAY + 7 * 3600)
        workout = workout_v2(seed, begin, name="Running", minutes=points / 60, phone=phone,
                             route_points=points, rng=rng)
        writer = _Writer(rng, True, False)
        writer.value(workout, 3)
        texts.append("".join(writer.parts))
        size += len(texts[-1].encode("utf-8")) + (8 if len(texts) > 1 else 0)
        day += 1
    return (head + ",\n      ".join(texts) + tail).encode("utf-8")


# ==========================================================================================
# Canaries: a payload whose every device name and one value are unmistakable in logs.
# ==========================================================================================


def canary_payload(seed: int = 0, day: dt.date = DEFAULT_DAY) -> dict:
    """A body touching metrics, sleep, a workout and the record sections in which every
    ``source`` is CANARY_SOURCE and CANARY_QTY appears as a heart-rate ``Avg``, a
    ``qty`` and a workout's ``activeEnergyBurned``. Scan logs for CANARY_STRINGS."""
    rng = random.Random(seed)
    phone = Phone(sources=CANARY_SOURCE)
    body = metrics_payload(seed, ("heart_rate", "resting_heart_rate", "sleep_analysis"), day,
                           phone=phone, rng=rng)
    for item in body["data"]["metrics"]:
        if item["data"] and item["name"] == "heart_rate":
            item["data"][0]["Avg"] = CANARY_QTY
        elif item["data"] and item["name"] == "resting_heart_rate":
            item["data"][0]["qty"] = CANARY_QTY
    workout = workout_v2(seed, dt.datetime.combine(day, dt.time(18)), phone=phone,
                         route_points=5, rng=rng)
    workout["activeEnergyBurned"]["qty"] = CANARY_QTY
    body["data"]["workouts"] = [workout]
    body["data"]["symptoms"] = symptoms(rng, dt.datetime.combine(day, dt.time(12)), phone=phone)
    return body


# ==========================================================================================
# The dashboard's fixtures (tests/test_dashboard.py): phones in real time zones, read from
# the system's tz database rather than the DST rules above (Sydney's DST runs October to
# April), Days exports at local midnight, the four forms of sleep HAE has sent, and lists
# (version-1 walks of a given length, ECG recordings, events) whose every field is known.
# ==========================================================================================


def zoned_stamp(zone_name: str, when: Any) -> str:
    """HAE's ``yyyy-MM-dd HH:mm:ss ±hhmm`` for ``when`` in the IANA zone ``zone_name``:
    a naive datetime is wall time there (the earlier of a repeated hour), a number epoch
    seconds."""
    from zoneinfo import ZoneInfo
    zone = ZoneInfo(zone_name)
    if isinstance(when, (int, float)):
        local = dt.datetime.fromtimestamp(when, zone)
    else:
        local = when.replace(tzinfo=zone)
    minutes = int(local.utcoffset().total_seconds() // 60)
    return "%s %s" % (local.strftime("%Y-%m-%d %H:%M:%S"), _offset_text(minutes))


def zoned_epoch(zone_name: str, wall: dt.datetime) -> int:
    """Epoch seconds of the wall time ``wall`` in ``zone_name`` (the earlier if repeated)."""
    from zoneinfo import ZoneInfo
    return int(wall.replace(tzinfo=ZoneInfo(zone_name)).timestamp())


def zoned_days_export(zone_name: str, first: dt.date, days: int, seed: int = 0) -> dict:
    """What a Days automation of a phone in ``zone_name`` sends for ``days`` days from
    ``first``: per metric name, one point per day at local midnight (the offset of that
    midnight, so it follows DST): ``step_count`` ``{date, qty, source}`` and ``heart_rate``
    ``{date, Min, Avg, Max, source}``."""
    rng = random.Random(seed)
    steps, heart = [], []
    for k in range(days):
        stamp = zoned_stamp(zone_name, dt.datetime.combine(first + dt.timedelta(days=k),
                                                           dt.time()))
        steps.append({"date": stamp, "qty": rng.randint(1500, 16000), "source": OWNER_PHONE})
        low = rng.randint(44, 60)
        high = rng.randint(105, 170)
        heart.append({"date": stamp, "Min": low, "Avg": round(rng.uniform(low + 10, 82), 3),
                      "Max": high, "source": OWNER_WATCH})
    return {"step_count": steps, "heart_rate": heart}


def minute_steps(zone_name: str, start: int, end: int, every: int = 60, seed: int = 0) -> list:
    """Steps of a Minutes automation every ``every`` seconds of ``[start, end)`` (epoch
    seconds), each point dated in the offset the phone had at that instant."""
    rng = random.Random(seed)
    return [{"date": zoned_stamp(zone_name, t), "qty": rng.randint(0, 90),
             "source": OWNER_WATCH} for t in range(start, end, every)]


NIGHT_FORMS = ("a", "b", "c", "d")
"""The four shapes of sleep HAE has sent: (a) an old summary without stages, (b) a summary
with stages beside a non-zero ``asleep``, (c) a summary of HAE 6.6.2 or later with
``asleep: 0`` beside ``totalSleep``, (d) stage records."""


def sleep_night_points(form: str, zone_name: str, wake_day: dt.date, seed: int = 0) -> list:
    """The points HAE sends for the night that ends on the morning of ``wake_day`` in
    ``form`` (`NIGHT_FORMS`). Form (b)'s ``asleep`` is the few minutes the watch left
    unstaged, beside the stages (their sum is the night). Summaries of form (b) are dated
    at the sleep start the evening before (HAE does that on some nights), the others at
    the wake time or the
    wake day's midnight; stage records do not overlap and sit inside one in-bed record."""
    rng = random.Random("%s-%s-%s" % (seed, form, wake_day))
    bed = zoned_epoch(zone_name, dt.datetime.combine(wake_day, dt.time())) - rng.randint(
        30, 110) * 60
    asleep_at = bed + rng.randint(5, 25) * 60
    segments, t = [], asleep_at
    for stage, low, high in (("core", 40, 70), ("deep", 20, 45), ("core", 30, 60),
                             ("rem", 20, 40), ("awake", 2, 8), ("core", 40, 70),
                             ("deep", 15, 30), ("rem", 25, 45), ("core", 30, 60),
                             ("rem", 20, 40)):
        length = rng.randint(low, high) * 60 + rng.randint(0, 59)
        segments.append((t, t + length, stage))
        t += length
    wake = t
    out_of_bed = wake + rng.randint(3, 20) * 60
    hours = {"core": 0.0, "deep": 0.0, "rem": 0.0, "awake": 0.0}
    for begin, finish, stage in segments:
        hours[stage] += (finish - begin) / 3600
    slept = hours["core"] + hours["deep"] + hours["rem"]
    stamp = functools.partial(zoned_stamp, zone_name)
    in_bed = (out_of_bed - bed) / 3600
    if form == "a":
        return [{"date": stamp(wake), "asleep": slept, "sleepStart": stamp(asleep_at),
                 "sleepEnd": stamp(wake), "sleepSource": OWNER_WATCH, "inBed": in_bed,
                 "inBedStart": stamp(bed), "inBedEnd": stamp(out_of_bed),
                 "inBedSource": OWNER_PHONE}]
    if form == "b":
        # the watch left a few minutes unstaged: HAE's "asleep" is only those (§2.5)
        unstaged = (int(hours["core"] * 60) % 23 + 2) / 60
        return [{"date": stamp(asleep_at), "asleep": unstaged,
                 "core": hours["core"] - unstaged,
                 "deep": hours["deep"], "rem": hours["rem"], "awake": hours["awake"],
                 "sleepStart": stamp(asleep_at), "sleepEnd": stamp(wake), "inBed": in_bed,
                 "inBedStart": stamp(bed), "inBedEnd": stamp(out_of_bed),
                 "source": OWNER_WATCH}]
    if form == "c":
        midnight = zoned_stamp(zone_name, dt.datetime.combine(wake_day, dt.time()))
        return [{"date": midnight, "totalSleep": slept, "asleep": 0, "core": hours["core"],
                 "deep": hours["deep"], "rem": hours["rem"], "sleepStart": stamp(asleep_at),
                 "sleepEnd": stamp(wake), "inBed": in_bed, "inBedStart": stamp(bed),
                 "inBedEnd": stamp(out_of_bed), "awake": hours["awake"],
                 "source": PIPED_SOURCE}]
    if form != "d":
        raise ValueError("sleep form must be one of %s" % (NIGHT_FORMS,))
    labels = SLEEP_VALUES["en"]
    rows = [{"startDate": stamp(bed), "endDate": stamp(out_of_bed), "value": labels["inbed"],
             "qty": in_bed, "source": OWNER_PHONE}]
    rows += [{"startDate": stamp(begin), "endDate": stamp(finish), "value": labels[stage],
              "qty": (finish - begin) / 3600, "source": OWNER_WATCH}
             for begin, finish, stage in segments]
    return rows
