"""Benchmark of the fold's and the ingest check's peak memory per body shape, alone and in
a real ``serve``: figures to report, not to assert.

    python3 tests/bench_memory.py [--mib N] [--shapes SHAPE ...] [--root DIR]
                                  [--python PYTHON] [--no-orjson] [--stages] [--tracemalloc]
                                  [--serve [--beside SHAPE]]

For each body shape below, a body of about ``--mib`` MiB (default 32) is written to a
file, journaled into a fresh data directory with ``healthlog.py import --aggregation ...``
(the ingest path: validation, archive, pending row), and then folded in a FRESH
subprocess through the code path ``serve`` uses: ``FoldWorker(config).run_pass(engine)``
with ``engine = FoldEngine(worker.connect(), config)`` on that data directory.  That
subprocess imports healthlog, opens the journal, reads its VmHWM and VmRSS (the
baseline), resets VmHWM to the current RSS (``echo 5 > /proc/self/clear_refs``, Linux
4.0+), folds, and reads VmHWM again: the peak is that fold's alone (the import of the
modules and the parent's body generation are not in it).

Before the fold, the body's ingest check (``check_delivery_shape``, what
``accept_delivery`` calls) runs in another fresh subprocess, in a thread as serve's HTTP
workers run it, its VmHWM reset just before it.

The table, one row per shape: body MiB, bytes per point, points (the fold's own counter
in the journal), baseline RSS, peak RSS (VmHWM), (peak - baseline) / body, peak / body,
whether peak <= 4 x body + 100 MiB (the goal for a dense body; the 100 MiB stands for the
interpreter and what does not scale with the body), fold seconds, the check's
(peak - RSS before it) / body and seconds, and the delivery's outcome (it must be
``parsed``).

``--serve``: instead, each body is POSTed to a real ``healthlog.py serve`` (a fresh data
directory, ``--max-body-mib`` the body's size rounded up) and folded by its fold thread,
serve's memory read from outside: its RSS when idle, its VmHWM at the 200 (the check;
reset just before the POST) and after the fold (reset again at the 200: the fold's own
peak), each over the idle RSS per byte of the body, and the need serve's start-up check
counts (``memory_needed_mib``).  In serve's threads glibc's allocator keeps more of what a
fold frees than in a process of its own: these are the figures the memory check's
factors must cover.  With ``--beside SHAPE``, once each fold is under way (serve's RSS
grown by the body: its text read), a body of SHAPE as large is POSTed (a phone sending
during a backfill): serve's peak with both, against the need it counts.

Shapes (each a valid HAE body):

* ``compact-1metric-seconds``: compact JSON, ONE metric ``heart_rate`` (count/min) at
  second resolution, points ``{"date","Min","Avg","Max","source"}`` in varying key orders,
  mostly single samples (Min = Avg = Max, integers), some with a fractional Avg (short or
  17 significant digits), ``source`` missing in 60% of them, else ``Apple Watch``, now
  and then ``iPhone`` or pipe-joined.  ~77 bytes a point (a real 63 MiB export of 990k
  heart-rate points has 67): the most points per byte, the worst case.
* ``compact-1metric-qty``: compact, one metric ``step_count`` at minute resolution,
  ``{"date","qty","source"}`` with 17-digit quantities (many hours, 60 points each).
* ``pretty-minutes-many-metrics``: HAE's pretty printing (``"key" : value``, 2-space
  indent) with 20 metrics at minute resolution (heart_rate with Min/Avg/Max, the rest
  ``qty``), sources with the typographic apostrophe; a "Previous 7 Days" Minutes export.
* ``workouts-routes``: version-2 workouts with a route point per second (hae_factory's
  ``big_workouts_body``): few records, each large.
* ``sleep-records``: ``sleep_analysis`` stage records (``startDate``, ``endDate``,
  ``value``, ``qty``, ``source``), pretty, night after night.
* ``non-ascii``: like ``compact-1metric-qty`` with sources holding ``’`` and CJK (more
  than healthlog.LEAN_REPLACE_MAX distinct non-ASCII characters, so a large body is
  decoded with the escaping error handler instead of byte replacement).

Issue 27's shapes, whose folds held an object, a row or a metric per point:

* ``days-backfill``: HAE's manual export of a history with aggregation "days": 154 metrics
  (hae-format §7 names and units, nutrition, cycle symptoms; heart rate with Min/Avg/Max,
  blood pressure, glucose with ``mealTime``, sleep summaries) with one point a day, dated
  at local midnight (``YYYY-MM-DD 00:00:00 -0500``/``-0400``: the offset follows DST), for
  as many years as fit (~12 at 64 MiB), compact: one point in each (metric, UTC hour), so
  one hour object per point.
* ``workout-long``: ONE version-2 workout with a route point and a heart-rate sample every
  second for as long as fits (~1.7 days at 64 MiB), compact: one record as large as the
  body.
* ``many-metrics-one-point``: ~600,000 metrics at 64 MiB, each with a name of its own and
  one point (the names of symptoms, medications and cycle tracking are what the user
  typed: nothing bounds how many a body names).
* ``emoji-sources``: like ``compact-1metric-qty``, with an emoji (astral characters, ZWJ
  sequences, variation selectors) in every ``source``.

Issue 33's, with the owner's devices named as iOS writes names given with an emoji
(``Anna’s Apple Watch 🏃``, ``Anna’s iPhone 📱``: the typographic apostrophe and an
astral character):

* ``days-backfill-ios-names``: ``days-backfill`` with those names in its sources.
* ``many-metrics-ios-names``: ``many-metrics-one-point`` with the watch's name in every
  point's ``source``.

``--root DIR`` benches DIR/healthlog.py (import and fold), with this script's bodies: run
it once per checkout for a before/after comparison.  ``--no-orjson`` hides orjson from
both subprocesses (a PYTHONPATH module that refuses to import, as bench.py does); note
that bodies of healthlog.LEAN_PARSE_BYTES and more are parsed by the json module anyway.
``--stages`` also prints, for each shape, the fold's RSS and VmHWM at its stage
boundaries (parsed, extracted, merged and encoded, applied); ``--tracemalloc`` adds the
Python heap per stage (current and peak since the previous mark) and the largest
allocation sites at the end of the merge (tracemalloc slows the fold several times and
inflates RSS: read its heap figures, not its RSS).

Bodies are generated in the parent (a second or two per shape), each shape's files in a
temporary directory removed afterwards.  ``--mib 64`` takes 5 minutes on 2 quiet cores
(the one-point metrics and the Days histories fold for a minute each), ``--serve`` as
long; ``--tracemalloc`` one to three minutes a shape (its snapshots of ~1.5M blocks take
most of that).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import gc
import json
import os
import random
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Optional

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from bench import RESULTS, _describe, hidden_orjson_env  # noqa: E402  (stdlib only)

MIB = 1 << 20
GOAL_FACTOR, GOAL_MIB = 4, 100
"""The goal: fold peak memory for a dense body at most 4 x its size plus 100 MiB."""
FOLD_DEADLINE_S = 3600.0
"""The fold's deadline in the bench (serve's is healthlog.FOLD_DEADLINE_S, 300 s): a slow,
shared machine, or tracemalloc, must not turn a memory figure into a deadline failure."""
BATCH = 2000
"""Points joined and written at once by the generators."""


# ==========================================================================================
# Bodies: each generator writes one shape to a file and returns what it wrote.
# ==========================================================================================


class BodyFile:
    """UTF-8 text written in chunks, counting bytes."""

    def __init__(self, path: Path):
        self.handle = open(path, "wb")
        self.size = 0

    def write(self, text: str) -> None:
        data = text.encode("utf-8")
        self.handle.write(data)
        self.size += len(data)

    def close(self) -> None:
        self.handle.close()


_DAY_TEXT: dict = {}
EPOCH_2025_03_01 = 1740787200


def stamp(t: int, offset_s: int = 0, offset_text: str = "+0000") -> str:
    """HAE's ``yyyy-MM-dd HH:mm:ss Z`` of epoch second ``t`` at a fixed UTC offset."""
    local = t + offset_s
    day, second = divmod(local, 86400)
    text = _DAY_TEXT.get(day)
    if text is None:
        text = _DAY_TEXT[day] = (dt.date(1970, 1, 1) + dt.timedelta(days=day)).isoformat()
    hour, rest = divmod(second, 3600)
    return "%s %02d:%02d:%02d %s" % (text, hour, rest // 60, rest % 60, offset_text)


def _quoted(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


def _compact_metric(out: BodyFile, target: int, name: str, units: str,
                    point: Callable[[str], str], step: Callable[[], int]) -> int:
    """One compact metric of about ``target`` bytes: ``point(date)`` is one point's
    text, ``step()`` the seconds to the next point.  Returns the points written."""
    head = '{"data":{"metrics":[{"name":%s,"units":%s,"data":[' % (_quoted(name), _quoted(units))
    tail = "]}]}}"
    out.write(head)
    t, count, first = EPOCH_2025_03_01, 0, True
    while out.size + len(tail) < target:
        batch = []
        for _ in range(min(BATCH, max(1, (target - out.size) // 128))):  # the last ones few
            batch.append(point(stamp(t)))
            t += step()
        out.write(("" if first else ",") + ",".join(batch))
        first, count = False, count + len(batch)
    out.write(tail)
    return count


def _orders(keys: list, rng: random.Random, count: int) -> list:
    """``count`` key orders of ``keys``, the first one as given."""
    orders = [list(keys)]
    while len(orders) < count:
        order = list(keys)
        rng.shuffle(order)
        orders.append(order)
    return orders


def heart_rate_seconds(out: BodyFile, target: int, rng: random.Random) -> dict:
    r = rng.random
    orders = _orders(["date", "Min", "Avg", "Max", "source"], rng, 4)
    templates = ["{" + ",".join('"%s":%%(%s)s' % (k, k) for k in order) + "}"
                 for order in orders]
    bare = ["{" + ",".join('"%s":%%(%s)s' % (k, k) for k in order if k != "source") + "}"
            for order in orders]
    sources = ['"Apple Watch"'] * 8 + ['"Apple Watch|iPhone"', '"iPhone"']

    def point(date: str) -> str:
        low = 52 + int(70 * r())
        roll = r()
        if roll < 0.7:  # one sample in the second: Min = Avg = Max
            values = {"Min": low, "Avg": low, "Max": low}
        else:
            high = low + 1 + int(6 * r())
            avg = low + (high - low) * r()
            values = {"Min": low, "Max": high,
                      "Avg": "%.1f" % avg if roll < 0.9 else "%.17g" % avg}
        values["date"] = '"%s"' % date
        if r() < 0.6:  # no source: ~65 bytes, the size of a real export's points
            return bare[int(4 * r())] % values
        values["source"] = sources[int(10 * r())]
        return templates[int(4 * r())] % values

    def step() -> int:  # mostly every second, some gaps of one or two seconds
        roll = r()
        return 1 if roll < 0.8 else 2 if roll < 0.95 else 3

    return {"points": _compact_metric(out, target, "heart_rate", "count/min", point, step),
            "aggregation": "Seconds"}


def _qty_minutes(out: BodyFile, target: int, rng: random.Random, sources: list) -> int:
    r = rng.random
    orders = _orders(["date", "qty", "source"], rng, 3)
    templates = ["{" + ",".join('"%s":%%(%s)s' % (k, k) for k in order) + "}"
                 for order in orders]
    bare = '{"date":%(date)s,"qty":%(qty)s}'
    quoted = [_quoted(s) for s in sources]

    def point(date: str) -> str:
        roll = r()
        qty = "%d" % (1 + int(120 * roll)) if roll < 0.3 else "%.17g" % (120 * r())
        values = {"date": '"%s"' % date, "qty": qty}
        if r() < 0.05:
            return bare % values
        values["source"] = quoted[int(len(quoted) * r())]
        return templates[int(3 * r())] % values

    def step() -> int:  # every minute, with a gap now and then
        return 60 if r() < 0.9 else 120

    return _compact_metric(out, target, "step_count", "count", point, step)


def step_count_minutes(out: BodyFile, target: int, rng: random.Random) -> dict:
    sources = ["iPhone"] * 6 + ["Apple Watch"] * 3 + ["Apple Watch|iPhone"]
    return {"points": _qty_minutes(out, target, rng, sources), "aggregation": "Minutes"}


NON_ASCII_SOURCES = ["Anton’s Apple Watch", "Anton’s iPhone", "安东的Apple Watch",
                     "张伟的iPhone", "李娜的Apple Watch", "王芳的iPhone",
                     "Anton’s iPhone|安东的Apple Watch", "iPhone"]


def non_ascii_minutes(out: BodyFile, target: int, rng: random.Random) -> dict:
    return {"points": _qty_minutes(out, target, rng, NON_ASCII_SOURCES),
            "aggregation": "Minutes"}


OWNER_WATCH = "Anton’s Apple Watch"
OWNER_PHONE = "iPhone (Anton)"
MANY_METRICS = (  # name, units, value keys, (low, high), integer
    ("step_count", "count", ("qty",), (1, 140), False),
    ("active_energy", "kJ", ("qty",), (0.1, 30), False),
    ("basal_energy_burned", "kJ", ("qty",), (4, 5.5), False),
    ("walking_running_distance", "km", ("qty",), (0.001, 0.12), False),
    ("flights_climbed", "count", ("qty",), (1, 4), True),
    ("apple_exercise_time", "min", ("qty",), (1, 1), True),
    ("apple_stand_time", "min", ("qty",), (1, 1), True),
    ("heart_rate", "count/min", ("Min", "Avg", "Max"), (50, 150), False),
    ("resting_heart_rate", "count/min", ("qty",), (50, 65), True),
    ("walking_heart_rate_average", "count/min", ("qty",), (85, 110), False),
    ("heart_rate_variability", "ms", ("qty",), (15, 90), False),
    ("respiratory_rate", "count/min", ("qty",), (11, 19), False),
    ("blood_oxygen_saturation", "%", ("qty",), (92, 100), False),
    ("environmental_audio_exposure", "dBASPL", ("qty",), (35, 85), False),
    ("headphone_audio_exposure", "dBASPL", ("qty",), (50, 80), False),
    ("walking_speed", "km/hr", ("qty",), (3, 6), False),
    ("walking_step_length", "cm", ("qty",), (60, 80), False),
    ("walking_asymmetry_percentage", "%", ("qty",), (0, 8), False),
    ("physical_effort", "kcal/hr·kg", ("qty",), (1, 9), False),
    ("time_in_daylight", "min", ("qty",), (1, 1), True),
)


def _pretty_templates(keys: list, rng: random.Random, indent: int) -> list:
    """Pretty point templates (``%(key)s`` slots), 4 key orders with ``source`` and 4
    without, at ``indent`` spaces (HAE's: 10 for a metric's points)."""
    inner, outer = " " * (indent + 2), " " * indent
    out = []
    for with_source in (True, False):
        for order in _orders(keys + (["source"] if with_source else []), rng, 4):
            out.append(outer + "{\n" + ",\n".join(
                '%s"%s" : %%(%s)s' % (inner, k, k) for k in order) + "\n" + outer + "}")
    return out


def _pretty_number(value: float, integer: bool) -> str:
    return "%d" % round(value) if integer else "%.17g" % value


def pretty_many_metrics(out: BodyFile, target: int, rng: random.Random) -> dict:
    r = rng.random
    offset_s, offset_text = 3600, "+0100"
    head, tail = '{\n  "data" : {\n    "metrics" : [\n', "\n    ]\n  }\n}"
    out.write(head)
    sources = [_quoted(OWNER_WATCH)] * 8 + [_quoted(OWNER_WATCH + "|" + OWNER_PHONE),
                                            _quoted(OWNER_PHONE)]
    count = 0
    for index, (name, units, keys, (low, high), integer) in enumerate(MANY_METRICS):
        share = (target - out.size - len(tail)) / (len(MANY_METRICS) - index)
        goal = out.size + share
        out.write((",\n" if index else "") + '      {\n        "name" : %s,\n        "units" :'
                  ' %s,\n        "data" : [\n' % (_quoted(name), _quoted(units)))
        closer = "\n        ]\n      }"
        templates = _pretty_templates(list(("date",) + keys), rng, 10)
        t, first = EPOCH_2025_03_01 - offset_s, True
        while out.size + len(closer) < goal:
            batch = []
            for _ in range(BATCH // 4):
                values = {"date": '"%s"' % stamp(t, offset_s, offset_text)}
                if keys == ("qty",):
                    values["qty"] = _pretty_number(low + (high - low) * r(), integer)
                else:
                    a = low + (high - low) * r()
                    b = a + 12 * r()
                    values.update(Min=_pretty_number(a, True), Max=_pretty_number(b, True),
                                  Avg=_pretty_number((a + b) / 2, False))
                if r() < 0.85:
                    values["source"] = sources[int(10 * r())]
                    batch.append(templates[int(4 * r())] % values)
                else:
                    batch.append(templates[4 + int(4 * r())] % values)
                t += 60 if r() < 0.85 else 120
            out.write(("" if first else ",\n") + ",\n".join(batch))
            first, count = False, count + len(batch)
        out.write(closer)
    out.write(tail)
    return {"points": count, "aggregation": "Minutes"}


SLEEP_STAGES = ("Core", "Deep", "Core", "REM", "Core", "Awake")


def sleep_records(out: BodyFile, target: int, rng: random.Random) -> dict:
    r = rng.random
    offset_s, offset_text = 3600, "+0100"
    head = ('{\n  "data" : {\n    "metrics" : [\n      {\n        "name" : "sleep_analysis",\n'
            '        "units" : "hr",\n        "data" : [\n')
    tail = "\n        ]\n      }\n    ]\n  }\n}"
    out.write(head)
    templates = _pretty_templates(["startDate", "endDate", "value", "qty"], rng, 10)[:4]
    watch, phone = _quoted(OWNER_WATCH), _quoted(OWNER_PHONE)
    night, count, first = 0, 0, True
    while out.size + len(tail) < target:
        batch = []
        for _ in range(40):  # nights
            bed = EPOCH_2025_03_01 - 7200 + night * 86400 + int(5400 * r())
            t, segments = bed + int(600 * r()), []
            while t < bed + 7 * 3600:
                length = 240 + int(2400 * r())
                stage = SLEEP_STAGES[int(6 * r())]
                segments.append((t, t + length, stage, watch))
                t += length
            segments.insert(0, (bed, t + int(900 * r()), "In Bed", phone))
            for begin, finish, stage, source in segments:
                batch.append(templates[int(4 * r())] % {
                    "startDate": '"%s"' % stamp(begin, offset_s, offset_text),
                    "endDate": '"%s"' % stamp(finish, offset_s, offset_text),
                    "value": '"%s"' % stage, "qty": "%.17g" % ((finish - begin) / 3600),
                    "source": source})
            night += 1
        out.write(("" if first else ",\n") + ",\n".join(batch))
        first, count = False, count + len(batch)
    out.write(tail)
    return {"points": count, "aggregation": None}


def workouts_routes(out: BodyFile, target: int, rng: random.Random) -> dict:
    import hae_factory

    body = hae_factory.big_workouts_body(target, seed=rng.randrange(1 << 30))
    out.handle.write(body)
    out.size += len(body)
    return {"points": body.count(b'"heartRateData" :'), "route_points":
            body.count(b'"latitude" :'), "aggregation": None}


# -- issue 27, part 2: the shapes whose fold held an object, a row or a metric per point --

DAYS_METRICS = (  # name, units, point kind, (low, high), integer, source kind
    # activity
    ("step_count", "count", "qty", (800, 22000), False, "piped"),
    ("active_energy", "kJ", "qty", (600, 4500), False, "piped"),
    ("basal_energy_burned", "kJ", "qty", (6500, 7600), False, "piped"),
    ("walking_running_distance", "km", "qty", (0.5, 18), False, "piped"),
    ("cycling_distance", "km", "qty", (0.5, 60), False, "watch"),
    ("swimming_distance", "m", "qty", (200, 2500), False, "watch"),
    ("wheelchair_distance", "km", "qty", (0.1, 5), False, "watch"),
    ("downhill_snow_sports", "km", "qty", (1, 40), False, "watch"),
    ("distance_downhill_snow_sports", "km", "qty", (1, 40), False, "watch"),  # 2021's name
    ("flights_climbed", "count", "qty", (1, 40), True, "piped"),
    ("apple_exercise_time", "min", "qty", (0, 120), True, "watch"),
    ("apple_stand_time", "min", "qty", (20, 300), True, "watch"),
    ("apple_stand_hour", "count", "qty", (4, 16), True, "watch"),
    ("apple_move_time", "min", "qty", (10, 200), True, "watch"),
    ("physical_effort", "kcal/hr·kg", "qty", (1, 9), False, "watch"),
    ("time_in_daylight", "min", "qty", (5, 300), True, "watch"),
    ("push_count", "count", "qty", (10, 900), True, "watch"),
    ("wheelchair_push_count", "count", "qty", (10, 900), True, "watch"),
    ("swim_stroke_count", "count", "qty", (100, 1800), True, "watch"),
    ("swimming_stroke_count", "count", "qty", (100, 1800), True, "watch"),
    ("nike_fuel", "count", "qty", (500, 4000), True, "phone"),
    # heart
    ("heart_rate", "count/min", "hr", (48, 170), False, "piped"),
    ("resting_heart_rate", "count/min", "qty", (48, 66), True, "watch"),
    ("walking_heart_rate_average", "count/min", "qty", (85, 115), False, "watch"),
    ("heart_rate_variability", "ms", "qty", (15, 95), False, "watch"),
    ("cardio_recovery", "count/min", "qty", (12, 40), False, "watch"),
    ("atrial_fibrillation_burden", "%", "qty", (0, 2), False, "watch"),
    ("high_heart_rate_notifications", "count", "qty", (0, 2), True, "watch"),
    ("low_heart_rate_notifications", "count", "qty", (0, 2), True, "watch"),
    ("irregular_heart_rhythm_notifications", "count", "qty", (0, 1), True, "watch"),
    ("peripheral_perfusion_index", "%", "qty", (0.5, 8), False, "app"),
    # respiratory, vitals
    ("respiratory_rate", "count/min", "qty", (11, 19), False, "watch"),
    ("blood_oxygen_saturation", "%", "qty", (92, 100), False, "watch"),
    ("vo2_max", "mL/min·kg", "qty", (32, 52), False, "watch"),
    ("forced_vital_capacity", "L", "qty", (3, 6), False, "app"),
    ("forced_expiratory_volume_1", "L", "qty", (2.5, 4.5), False, "app"),
    ("peak_expiratory_flow_rate", "L/min", "qty", (350, 650), False, "app"),
    ("inhaler_usage", "count", "qty", (0, 4), True, "app"),
    ("breathing_disturbances", "count", "qty", (0, 12), False, "watch"),
    ("sleeping_breathing_disturbances", "count", "qty", (0, 12), False, "watch"),
    ("apple_sleeping_wrist_temperature", "degC", "qty", (35.2, 36.9), False, "watch"),
    ("body_temperature", "degC", "qty", (36.1, 37.4), False, "app"),
    ("basal_body_temperature", "degC", "qty", (36.0, 36.9), False, "app"),
    ("electrodermal_activity", "S", "qty", (0.000001, 0.00002), False, "app"),
    ("blood_pressure", "mmHg", "bp", (70, 140), True, "app"),
    ("blood_glucose", "mg/dL", "glucose", (70, 160), False, "app"),
    ("insulin_delivery", "IU", "insulin", (1, 30), False, "app"),
    ("blood_alcohol_content", "%", "qty", (0, 0.08), False, "app"),
    ("number_of_alcoholic_beverages", "count", "qty", (0, 4), True, "app"),
    ("number_of_times_fallen", "count", "qty", (0, 1), True, "watch"),
    ("uv_exposure", "count", "qty", (0, 9), False, "app"),
    # body
    ("weight_body_mass", "kg", "qty", (70, 80), False, "app"),
    ("body_mass_index", "count", "qty", (22, 26), False, "app"),
    ("body_fat_percentage", "%", "qty", (14, 24), False, "app"),
    ("lean_body_mass", "kg", "qty", (55, 64), False, "app"),
    ("height", "cm", "qty", (178, 179), False, "app"),
    ("waist_circumference", "cm", "qty", (80, 92), False, "app"),
    # mobility
    ("walking_speed", "km/hr", "qty", (3, 6), False, "phone"),
    ("walking_step_length", "cm", "qty", (60, 80), False, "phone"),
    ("walking_asymmetry_percentage", "%", "qty", (0, 8), False, "phone"),
    ("walking_double_support_percentage", "%", "qty", (22, 34), False, "phone"),
    ("stair_speed_up", "ft/s", "qty", (0.8, 2.2), False, "phone"),
    ("stair_speed_down", "ft/s", "qty", (0.9, 2.4), False, "phone"),
    ("stair_speed:_up", "ft/s", "qty", (0.8, 2.2), False, "phone"),  # 2021's spelling
    ("six_minute_walking_test_distance", "m", "qty", (450, 650), False, "phone"),
    ("apple_walking_steadiness", "%", "qty", (70, 100), False, "phone"),
    ("running_speed", "km/hr", "qty", (8, 15), False, "watch"),
    ("running_power", "W", "qty", (180, 320), False, "watch"),
    ("running_stride_length", "m", "qty", (0.9, 1.4), False, "watch"),
    ("running_vertical_oscillation", "cm", "qty", (6, 11), False, "watch"),
    ("running_ground_contact_time", "ms", "qty", (200, 300), False, "watch"),
    ("cycling_cadence", "count/min", "qty", (60, 100), False, "watch"),
    ("cycling_power", "W", "qty", (90, 260), False, "watch"),
    ("cycling_speed", "km/hr", "qty", (15, 35), False, "watch"),
    ("cycling_functional_threshold_power", "W", "qty", (180, 260), False, "watch"),
    # hearing, environment
    ("environmental_audio_exposure", "dBASPL", "qty", (45, 80), False, "watch"),
    ("headphone_audio_exposure", "dBASPL", "qty", (50, 80), False, "phone"),
    ("environmental_sound_reduction", "dBASPL", "qty", (0, 20), False, "watch"),
    ("under_water_depth", "m", "qty", (0.5, 6), False, "watch"),
    ("under_water_temperature", "degC", "qty", (18, 28), False, "watch"),
    ("water_temperature", "degC", "qty", (18, 28), False, "watch"),
    # mindfulness, events
    ("mindful_minutes", "min", "qty", (1, 30), True, "watch"),
    ("handwashing", "s", "event", (10, 40), False, "watch"),
    ("toothbrushing", "s", "event", (60, 150), False, "phone"),
    ("sexual_activity", "count", "sexual", (0, 1), True, "app"),
    ("sleep_analysis", "hr", "sleep", (5.5, 8.5), False, "piped"),
    # nutrition, daily totals
    ("dietary_energy", "kJ", "qty", (6000, 11000), False, "food"),
    ("dietary_water", "mL", "qty", (800, 3000), False, "food"),
    ("dietary_caffeine", "mg", "qty", (40, 400), False, "food"),
    ("caffeine", "mg", "qty", (40, 400), False, "food"),
    ("dietary_sugar", "g", "qty", (20, 110), False, "food"),
    ("dietary_cholesterol", "mg", "qty", (100, 450), False, "food"),
    ("cholesterol", "mg", "qty", (100, 450), False, "food"),
    ("protein", "g", "qty", (50, 160), False, "food"),
    ("carbohydrates", "g", "qty", (150, 380), False, "food"),
    ("fiber", "g", "qty", (12, 45), False, "food"),
    ("total_fat", "g", "qty", (40, 120), False, "food"),
    ("saturated_fat", "g", "qty", (12, 40), False, "food"),
    ("monounsaturated_fat", "g", "qty", (12, 45), False, "food"),
    ("polyunsaturated_fat", "g", "qty", (8, 25), False, "food"),
    ("biotin", "µg", "qty", (10, 60), False, "food"),
    ("calcium", "mg", "qty", (500, 1400), False, "food"),
    ("chloride", "mg", "qty", (1500, 3500), False, "food"),
    ("chromium", "µg", "qty", (10, 50), False, "food"),
    ("copper", "mg", "qty", (0.5, 2), False, "food"),
    ("folate", "µg", "qty", (150, 500), False, "food"),
    ("iodine", "µg", "qty", (80, 250), False, "food"),
    ("iron", "mg", "qty", (6, 20), False, "food"),
    ("magnesium", "mg", "qty", (200, 500), False, "food"),
    ("manganese", "mg", "qty", (1, 5), False, "food"),
    ("molybdenum", "µg", "qty", (20, 80), False, "food"),
    ("niacin", "mg", "qty", (10, 35), False, "food"),
    ("pantothenic_acid", "mg", "qty", (3, 9), False, "food"),
    ("phosphorus", "mg", "qty", (700, 1600), False, "food"),
    ("potassium", "mg", "qty", (1800, 4200), False, "food"),
    ("riboflavin", "mg", "qty", (0.8, 2.5), False, "food"),
    ("selenium", "µg", "qty", (30, 110), False, "food"),
    ("sodium", "mg", "qty", (1500, 4000), False, "food"),
    ("thiamin", "mg", "qty", (0.7, 2), False, "food"),
    ("vitamin_a", "µg", "qty", (300, 1200), False, "food"),
    ("vitamin_b6", "mg", "qty", (0.8, 2.5), False, "food"),
    ("vitamin_b12", "µg", "qty", (1, 8), False, "food"),
    ("vitamin_c", "mg", "qty", (30, 200), False, "food"),
    ("vitamin_d", "µg", "qty", (2, 25), False, "food"),
    ("vitamin_e", "mg", "qty", (4, 20), False, "food"),
    ("vitamin_k", "µg", "qty", (40, 200), False, "food"),
    ("zinc", "mg", "qty", (5, 16), False, "food"),
    # reproductive health, symptoms as daily counts
    ("basal_body_temperature_celsius", "degC", "qty", (36.0, 36.9), False, "app"),
    ("cervical_mucus_quality", "count", "qty", (0, 5), True, "app"),
    ("contraceptive", "count", "qty", (0, 1), True, "app"),
    ("intermenstrual_bleeding", "count", "qty", (0, 1), True, "app"),
    ("lactation", "count", "qty", (0, 1), True, "app"),
    ("menstrual_flow", "count", "qty", (0, 4), True, "app"),
    ("ovulation_test_result", "count", "qty", (0, 4), True, "app"),
    ("pregnancy", "count", "qty", (0, 1), True, "app"),
    ("pregnancy_test_result", "count", "qty", (0, 3), True, "app"),
    ("progesterone_test_result", "count", "qty", (0, 3), True, "app"),
    ("sexual_activity_protected", "count", "qty", (0, 1), True, "app"),
    ("abdominal_cramps", "count", "qty", (0, 1), True, "app"),
    ("bloating", "count", "qty", (0, 1), True, "app"),
    ("headache", "count", "qty", (0, 1), True, "app"),
    ("fatigue", "count", "qty", (0, 1), True, "app"),
    ("mood_changes", "count", "qty", (0, 1), True, "app"),
    ("sleep_changes", "count", "qty", (0, 1), True, "app"),
    ("appetite_changes", "count", "qty", (0, 1), True, "app"),
    ("acne", "count", "qty", (0, 1), True, "app"),
    ("hot_flashes", "count", "qty", (0, 1), True, "app"),
    ("dizziness", "count", "qty", (0, 1), True, "app"),
    ("nausea", "count", "qty", (0, 1), True, "app"),
    ("coughing", "count", "qty", (0, 1), True, "app"),
    ("shortness_of_breath", "count", "qty", (0, 1), True, "app"),
    ("chest_tightness_or_pain", "count", "qty", (0, 1), True, "app"),
    ("rapid_pounding_or_fluttering_heartbeat", "count", "qty", (0, 1), True, "app"),
    ("runny_nose", "count", "qty", (0, 1), True, "app"),
)
"""A manual Days export of every metric the Health app has (hae-format §7 names and units,
nutrition and cycle symptoms as daily totals): 154 metrics."""

def days_sources(watch: str, phone: str) -> dict:
    """Source kind -> the sources a Days export names, the owner's devices as given."""
    return {
        "piped": [watch + "|" + phone] * 3 + [watch, phone],
        "watch": [watch],
        "phone": [phone],
        "app": ["Withings", "Health Mate", phone],
        "food": ["MyFitnessPal", "Lifesum"],
    }


DAYS_SOURCES = days_sources(OWNER_WATCH, OWNER_PHONE)
IOS_WATCH, IOS_PHONE = "Anna’s Apple Watch 🏃", "Anna’s iPhone 📱"
"""Device names as iOS writes them when their owner gave them an emoji: the typographic
apostrophe (3 bytes of UTF-8, a ``\\u2019`` escape of 6 in the fold's text) and an astral
character (4 bytes, a surrogate pair of 12).  Decoded whole, one of them in a body makes
every character of its text 4 bytes wide."""
DAYS_ZONE = "America/New_York"
"""Days at local midnight in a zone with DST: -0500 in winter, -0400 in summer (hae-format
§11: the offset follows the phone's zone)."""


def _days_point(kind: str, date: str, low: float, high: float, integer: bool,
                source: Optional[str], r: Callable[[], float]) -> str:
    """One Days point of ``kind`` dated ``date`` (local midnight), compact, key order as
    HAE writes them."""
    number = (lambda: "%d" % round(low + (high - low) * r())) if integer else (
        lambda: "%.17g" % (low + (high - low) * r()))
    tail = "" if source is None else ',"source":%s' % _quoted(source)
    if kind == "hr":
        a = 48 + 20 * r()
        b = a + 40 + 80 * r()
        return '{"Min":%d,"Avg":%.17g,"date":"%s"%s,"Max":%d}' % (
            round(a), a + (b - a) * r() * 0.5, date, tail, round(b))
    if kind == "bp":
        return '{"date":"%s","systolic":%d,"diastolic":%d%s}' % (
            date, 105 + int(30 * r()), 65 + int(20 * r()), tail)
    if kind == "glucose":
        return '{"date":"%s","qty":%s,"mealTime":"%s"%s}' % (
            date, number(), ("Before Meal", "After Meal", "Unspecified")[int(3 * r())], tail)
    if kind == "insulin":
        return '{"date":"%s","qty":%s,"reason":"%s"%s}' % (
            date, number(), ("Bolus", "Basal")[int(2 * r())], tail)
    if kind == "event":
        return '{"date":"%s","qty":%s,"value":"%s"%s}' % (
            date, number(), "Complete" if r() < 0.8 else "Incomplete", tail)
    if kind == "sexual":
        return ('{"date":"%s","Unspecified":0,"Protection Used":%d,"Protection Not Used":0%s}'
                % (date, int(2 * r()), tail))
    if kind == "sleep":  # the aggregated night, dated like the rest of a Days export
        core, deep, rem = 3 + 2 * r(), 0.6 + 0.8 * r(), 1 + 0.8 * r()
        return ('{"date":"%s","totalSleep":%.17g,"asleep":0,"core":%.17g,"deep":%.17g,'
                '"rem":%.17g,"awake":%.17g,"inBed":%.17g%s}' % (
                    date, core + deep + rem, core, deep, rem, 0.3 * r(),
                    core + deep + rem + 0.4 * r(), tail))
    return '{"date":"%s","qty":%s%s}' % (date, number(), tail)


def days_backfill(out: BodyFile, target: int, rng: random.Random,
                  owner: tuple = (OWNER_WATCH, OWNER_PHONE)) -> dict:
    """Every metric, one point a day at local midnight, for as many years as fit (HAE's
    manual export of a history with aggregation "days"): one point in each (metric, UTC
    hour), so as many hour objects as points.  ``owner``: the names of the owner's watch
    and phone."""
    from zoneinfo import ZoneInfo

    named = days_sources(*owner)

    r = rng.random
    zone = ZoneInfo(DAYS_ZONE)
    draw = random.Random(0).random  # a day's bytes, estimated apart from the body's draws
    per_day = sum(len(_days_point(kind, "2025-03-01 00:00:00 -0500", low, high, integer,
                                  sources[int(len(sources) * draw())], draw).encode()) + 1
                  for _ in range(16)
                  for _, _, kind, (low, high), integer, source in DAYS_METRICS
                  for sources in [named[source]]) / 16
    overhead = 40 + sum(len('{"name":"%s","units":"%s","data":[]},' % (name, units))
                        for name, units, *_ in DAYS_METRICS)
    days = max(2, int((target - overhead) / per_day))
    last = dt.date(2025, 3, 1)
    dates = []
    for k in range(days):
        day = last - dt.timedelta(days=days - 1 - k)
        offset = dt.datetime(day.year, day.month, day.day, tzinfo=zone).utcoffset()
        minutes = int(offset.total_seconds()) // 60
        dates.append("%s 00:00:00 %s%02d%02d" % (day.isoformat(), "-" if minutes < 0 else "+",
                                                 abs(minutes) // 60, abs(minutes) % 60))
    out.write('{"data":{"metrics":[')
    count = 0
    for index, (name, units, kind, (low, high), integer, source) in enumerate(DAYS_METRICS):
        sources = named[source]
        out.write(("," if index else "") + '{"name":%s,"units":%s,"data":[' % (
            _quoted(name), _quoted(units)))
        for start in range(0, days, BATCH):
            out.write(("," if start else "") + ",".join(
                _days_point(kind, date, low, high, integer, sources[int(len(sources) * r())],
                            r) for date in dates[start:start + BATCH]))
        count += days
        out.write("]}")
    out.write("]}}")
    return {"points": count, "aggregation": "Days", "days": days}


def _workout_seconds(count: int, begin: int, bpm: float, where: list, r: Callable[[], float],
                     offset: tuple, source: str) -> tuple:
    """``count`` seconds of a long run from ``begin``: (heart-rate texts, route texts)."""
    heart, route = [], []
    lat, lon, alt, course = where
    for t in range(begin, begin + count):
        bpm = min(185.0, max(60.0, bpm + 3 * (r() - 0.5)))
        value = round(bpm)
        date = stamp(t, *offset)
        heart.append('{"date":"%s","Min":%d,"Avg":%d,"Max":%d,"units":"count/min","source":%s}'
                     % (date, value, value, value, source))
        course = (course + 6 * (r() - 0.5)) % 360
        speed = 2.4 + r()
        lat += speed * 0.0000063 * (r() - 0.5)
        lon += speed * 0.0000079 * (r() - 0.5)
        alt += r() - 0.5
        route.append('{"latitude":%.17g,"longitude":%.17g,"altitude":%.17g,"course":%.17g,'
                     '"courseAccuracy":%.17g,"horizontalAccuracy":%.17g,'
                     '"verticalAccuracy":%.17g,"timestamp":"%s","speed":%.17g,'
                     '"speedAccuracy":%.17g}' % (
                         lat, lon, alt, course, 5 + 20 * r(), 2 + 7 * r(), 1.5 + 4.5 * r(),
                         date, speed, 0.2 + r()))
    where[:] = [lat, lon, alt, course]
    return heart, route, bpm


def workout_long(out: BodyFile, target: int, rng: random.Random) -> dict:
    """ONE version-2 workout with a route point and a heart-rate sample every second for as
    long as fits (about 1.6 days at 64 MiB: an ultra, or a watch left recording), compact:
    one point of the record layer as large as the body."""
    r = rng.random
    offset = (-25200, "-0700")
    begin = EPOCH_2025_03_01 + 14 * 3600
    source = _quoted(OWNER_WATCH)
    heart, route, _ = _workout_seconds(200, begin, 120.0, [37.7749, -122.4194, 16.0, 90.0],
                                       random.Random(0).random, offset, source)
    per_second = sum(len(t) + 1 for t in heart + route) / 200
    seconds = max(60, int((target - 700) / per_second))
    end = begin + seconds
    out.write('{"data":{"workouts":[{"id":"5C2F0E4B-8A1D-4E36-9B7F-2D6A1C9E3F80",'
              '"name":"Outdoor Run","start":"%s","end":"%s","duration":%.17g,'
              '"location":"Outdoor","isIndoor":false,'
              '"activeEnergyBurned":{"qty":%.17g,"units":"kJ"},'
              '"distance":{"qty":%.17g,"units":"km"},"intensity":{"qty":%.17g,"units":"MET"},'
              '"heartRate":{"min":{"qty":61,"units":"count/min"},'
              '"avg":{"qty":%.17g,"units":"count/min"},"max":{"qty":171,"units":"count/min"}},'
              % (stamp(begin, *offset), stamp(end, *offset), seconds + r(),
                 seconds * 0.9 * (1 + r()), seconds * 0.0027, 7 + 3 * r(), 128 + 10 * r()))
    # The route is written after the heart rate: the two series are drawn together, a
    # batch at a time, and the route's batches wait in a file beside the body.
    spill = out.handle.name + ".route"
    bpm, where = 120.0, [37.7749, -122.4194, 16.0, 90.0]
    out.write('"heartRateData":[')
    with open(spill, "w+", encoding="utf-8") as routes:
        for start in range(0, seconds, BATCH):
            heart, route, bpm = _workout_seconds(min(BATCH, seconds - start), begin + start,
                                                 bpm, where, r, offset, source)
            out.write(("," if start else "") + ",".join(heart))
            routes.write(("," if start else "") + ",".join(route))
        out.write('],"heartRateRecovery":[],"route":[')
        routes.seek(0)
        for chunk in iter(lambda: routes.read(1 << 20), ""):
            out.write(chunk)
    os.unlink(spill)
    out.write('],"metadata":{}}]}}')
    return {"points": 1, "aggregation": None, "route_points": seconds,
            "heart_rate_points": seconds}


def many_metrics_one_point(out: BodyFile, target: int, rng: random.Random,
                           source_share: float = 0.2, watch: str = OWNER_WATCH) -> dict:
    """As many metrics as fit, each with a name of its own and ONE point (the names of
    symptoms, medications and cycle tracking come from what the user typed, so nothing
    bounds how many a body names), compact, a count and mostly no source (``watch`` in
    ``source_share`` of them): one metric, one hour object and one row per ~100 bytes."""
    r = rng.random
    names = [name for name, *_ in DAYS_METRICS]
    out.write('{"data":{"metrics":[')
    count, t, first = 0, EPOCH_2025_03_01, True
    while out.size + 10 < target:
        batch = []
        for _ in range(min(BATCH, max(1, (target - out.size) // 160))):
            name = "%s_%d" % (names[count % len(names)], count)
            source = ',"source":%s' % _quoted(watch) if r() < source_share else ""
            batch.append('{"name":"%s","units":"count","data":[{"date":"%s","qty":%d%s}]}'
                         % (name, stamp(t, -18000, "-0500"), 1 + int(20 * r()), source))
            count += 1
            t += 60
        out.write(("" if first else ",") + ",".join(batch))
        first = False
    out.write("]}}")
    return {"points": count, "aggregation": "Minutes"}


EMOJI_SOURCES = ["Anton’s Apple Watch 🏃", "🍎 iPhone", "Oura 💍", "WHOOP ⌚️", "Anton’s 📱",
                 "Sleep Cycle 😴", "Zepp 💓", "Garmin 🚴‍♂️", "Withings ⚖️", "MyFitnessPal 🥗",
                 "AutoSleep 🌙|Anton’s Apple Watch 🏃", "🏃‍♀️ Strava"]


def emoji_sources(out: BodyFile, target: int, rng: random.Random) -> dict:
    """Like compact-1metric-qty with an emoji in every ``source`` (hae-format §11: sources
    as people name their phones, emoji included): astral characters, written back as
    surrogate-pair escapes in the text the large-body fold reads."""
    return {"points": _qty_minutes(out, target, rng, EMOJI_SOURCES), "aggregation": "Minutes"}


def days_backfill_ios_names(out: BodyFile, target: int, rng: random.Random) -> dict:
    """``days-backfill`` whose owner's devices carry iOS names with ``’`` and an emoji."""
    return days_backfill(out, target, rng, owner=(IOS_WATCH, IOS_PHONE))


def many_metrics_ios_names(out: BodyFile, target: int, rng: random.Random) -> dict:
    """``many-metrics-one-point`` with the watch's iOS name (``’`` and an emoji) in every
    point's ``source``."""
    return many_metrics_one_point(out, target, rng, source_share=1.0, watch=IOS_WATCH)


SHAPES = {
    "compact-1metric-seconds": heart_rate_seconds,
    "compact-1metric-qty": step_count_minutes,
    "pretty-minutes-many-metrics": pretty_many_metrics,
    "workouts-routes": workouts_routes,
    "sleep-records": sleep_records,
    "non-ascii": non_ascii_minutes,
    "days-backfill": days_backfill,
    "workout-long": workout_long,
    "many-metrics-one-point": many_metrics_one_point,
    "emoji-sources": emoji_sources,
    "days-backfill-ios-names": days_backfill_ios_names,
    "many-metrics-ios-names": many_metrics_ios_names,
}
"""Shape name -> generator(out, target bytes, rng) -> {"points", "aggregation", ...}."""


def write_body(shape: str, path: Path, target: int, seed: int) -> dict:
    out = BodyFile(path)
    try:
        made = SHAPES[shape](out, target, random.Random(seed))
    finally:
        out.close()
    made["bytes"] = out.size
    return made


# ==========================================================================================
# The fold subprocess (``--internal fold``): one fold, its memory read from /proc.
# ==========================================================================================


def proc_status() -> dict:
    """VmHWM and VmRSS of this process, in MiB."""
    text = Path("/proc/self/status").read_text()
    return {key.lower(): int(value) / 1024 for key, value in
            re.findall(r"^(VmHWM|VmRSS):\s+(\d+) kB", text, re.M)}


def reset_peak() -> bool:
    """VmHWM back to the current RSS (Linux 4.0+); False when the kernel refuses."""
    try:
        with open("/proc/self/clear_refs", "w") as handle:
            handle.write("5")
        return True
    except OSError:
        return False


class Stages:
    """Marks at the fold's stage boundaries: RSS and VmHWM, and with tracemalloc the
    Python heap now and its peak since the previous mark."""

    def __init__(self, trace: bool):
        self.trace, self.marks, self.top = trace, [], []
        self.started = time.perf_counter()

    def mark(self, label: str) -> None:
        entry = dict(proc_status(), label=label, s=time.perf_counter() - self.started)
        if self.trace:
            import tracemalloc

            entry["heap"], entry["heap_peak"] = (x / MIB for x in
                                                 tracemalloc.get_traced_memory())
            tracemalloc.reset_peak()
        self.marks.append(entry)

    def snapshot(self, label: str, limit: int = 12) -> None:
        import tracemalloc

        snapshot = tracemalloc.take_snapshot().filter_traces(
            [tracemalloc.Filter(False, tracemalloc.__file__)])
        stats = snapshot.statistics("lineno")
        self.top.append({"label": label, "total": sum(s.size for s in stats) / MIB, "sites": [
            {"where": "%s:%d" % (Path(s.traceback[0].filename).name, s.traceback[0].lineno),
             "mib": s.size / MIB, "blocks": s.count,
             "line": _source_line(s.traceback[0].filename, s.traceback[0].lineno)}
            for s in stats[:limit]]})

    def wrap(self, owner: object, name: str, before: Optional[str], after: Optional[str],
             snapshot: bool = False, each: bool = False) -> None:
        """Mark around ``owner.name`` (a module function or a method), when it exists.
        ``each``: a function called many times in a fold (once per object): ``before``
        marks the first call, ``after`` the latest one (one mark, moved on); with
        ``snapshot`` and tracemalloc, a snapshot whenever the heap has grown 5% past the
        last one, so the last snapshot is near the largest heap seen at those calls."""
        original = owner.__dict__.get(name) if isinstance(owner, type) else getattr(
            owner, name, None)
        if original is None:
            return
        static = isinstance(original, staticmethod)
        function = original.__func__ if static else original
        calls = [0, 0.0]  # calls, heap at the last snapshot

        def wrapped(*args, **kwargs):
            calls[0] += 1
            if before and (not each or calls[0] == 1):
                self.mark(before)
                if snapshot and self.trace and not each:
                    self.snapshot(before)
            result = function(*args, **kwargs)
            if after and not each:
                self.mark(after)
                if snapshot and self.trace:
                    self.snapshot(after)
            elif after:
                if calls[0] > 2:
                    self.marks.pop()
                if calls[0] > 1:
                    self.mark("%s (call %d)" % (after, calls[0]))
                if snapshot and self.trace:
                    import tracemalloc

                    heap = tracemalloc.get_traced_memory()[0] / MIB
                    if heap > calls[1] * 1.05:
                        calls[1] = heap
                        if self.top and self.top[-1]["label"].startswith(after):
                            self.top.pop()
                        self.snapshot("%s (call %d)" % (after, calls[0]))
            return result

        setattr(owner, name, staticmethod(wrapped) if static else wrapped)


def _source_line(filename: str, lineno: int) -> str:
    import linecache

    return linecache.getline(filename, lineno).strip()[:90]


def fold_child(root: Path, data_dir: Path, stages: bool, trace: bool) -> dict:
    """Fold every pending delivery of ``data_dir`` as serve's worker does; the figures."""
    if trace:
        import tracemalloc

        tracemalloc.start()
    sys.path.insert(0, str(root))
    import healthlog

    if Path(healthlog.__file__).resolve() != (root / "healthlog.py").resolve():
        raise SystemExit("healthlog comes from %s, not from %s" % (healthlog.__file__, root))
    config = healthlog.Config(data_dir=data_dir, log_level="WARN")
    if any(f.name == "fold_deadline_s" for f in dataclasses.fields(config)):
        config = dataclasses.replace(config, fold_deadline_s=FOLD_DEADLINE_S)
    healthlog.setup_logging(config)
    worker = healthlog.FoldWorker(config)
    conn = worker.connect() if hasattr(worker, "connect") else healthlog.connect(
        config.db_path, synchronous="NORMAL")
    engine = healthlog.FoldEngine(conn, config)
    marks = Stages(trace) if stages else None
    if marks:
        marks.wrap(healthlog, "loads_checked", None, "parsed (loads_checked)")
        marks.wrap(healthlog, "extract_points", None, "extracted (doc released next)")
        marks.wrap(healthlog.FoldEngine, "_merge", "merge starts", "merged and encoded",
                   snapshot=True)
        marks.wrap(healthlog.FoldEngine, "_row", "first object encoded",
                   "object encoded", snapshot=True, each=True)
        marks.wrap(healthlog.FoldEngine, "apply", None, "applied (committed)")
    gc.collect()
    baseline = proc_status()
    reset = reset_peak()
    at_start = proc_status()
    if marks:
        marks.started = time.perf_counter()
        marks.mark("fold starts")
    started = time.perf_counter()
    folded = worker.run_pass(engine)
    elapsed = time.perf_counter() - started
    peak = proc_status()
    if marks:
        marks.mark("fold returned")
    rows = conn.execute("SELECT id, parse_status, layer, error, points, bad_points,"
                        " objects_written FROM delivery ORDER BY id").fetchall()
    conn.close()
    orjson = getattr(healthlog, "_orjson", None)
    return {"python": sys.version.split()[0],
            "json": "stdlib" if orjson is None else "orjson " + orjson.__version__,
            "baseline_hwm": baseline["vmhwm"], "baseline_rss": at_start["vmrss"],
            "peak_reset": reset, "peak": peak["vmhwm"], "end_rss": peak["vmrss"],
            "fold_s": elapsed, "folded": folded,
            "deliveries": [dict(zip(("id", "status", "layer", "error", "points",
                                     "bad_points", "objects_written"), row)) for row in rows],
            "stages": marks.marks if marks else None, "top": marks.top if marks else None}


def check_child(root: Path, body: Path) -> dict:
    """The ingest check of ``body`` (``check_delivery_shape``, what ``accept_delivery``
    calls) in a thread, as an HTTP worker of serve runs it; the figures."""
    sys.path.insert(0, str(root))
    import threading

    import healthlog

    if Path(healthlog.__file__).resolve() != (root / "healthlog.py").resolve():
        raise SystemExit("healthlog comes from %s, not from %s" % (healthlog.__file__, root))
    outcome = {}

    def check() -> None:
        started = time.perf_counter()
        try:
            parsed = healthlog.check_delivery_shape(body)
            outcome["verdict"] = "accepted" if parsed is None else "accepted (quick check)"
        except healthlog.HTTPFailure as exc:
            outcome["verdict"] = "refused: %s" % exc.message
        outcome["s"] = time.perf_counter() - started

    gc.collect()
    reset = reset_peak()
    at_start = proc_status()
    worker = threading.Thread(target=check)
    worker.start()
    worker.join()
    peak = proc_status()
    return {"base": at_start["vmrss"], "peak": peak["vmhwm"], "peak_reset": reset,
            "check_s": outcome["s"], "verdict": outcome["verdict"]}


# ==========================================================================================
# The parent: generate, import, fold in a fresh subprocess, print.
# ==========================================================================================


def run_shape(args: argparse.Namespace, shape: str, env: Optional[dict], tmp: Path) -> dict:
    body_path = tmp / (shape + ".json")
    started = time.perf_counter()
    made = write_body(shape, body_path, int(args.mib * MIB), seed=len(shape))
    generated = time.perf_counter() - started
    data_dir = tmp / "data"
    started = time.perf_counter()
    command = [args.python, str(args.root / "healthlog.py"), "import", "--data", str(data_dir),
               str(body_path)]
    if made["aggregation"]:
        command += ["--aggregation", made["aggregation"]]
    imported = subprocess.run(command, capture_output=True, text=True,
                              env=dict(env or os.environ, HEALTHLOG_LOG_LEVEL="WARN"))
    if imported.returncode or "accepted" not in imported.stdout:
        raise SystemExit("import of %s failed (exit %d):\n%s%s" % (
            shape, imported.returncode, imported.stdout, imported.stderr))
    import_s = time.perf_counter() - started
    check = _internal(args, env, "check", "--body", str(body_path), what="check of " + shape)
    body_path.unlink()  # the archive holds its copy; the fold reads that one
    figures = _internal(args, env, "fold", "--data", str(data_dir),
                        *(["--stages"] if args.stages else []),
                        *(["--tracemalloc"] if args.tracemalloc else []),
                        what="the fold of " + shape)
    figures.update(shape=shape, made=made, generate_s=generated, import_s=import_s,
                   check=check)
    return figures


def _internal(args: argparse.Namespace, env: Optional[dict], part: str, *more: str,
              what: str) -> dict:
    """This script's hidden ``part`` in a fresh subprocess; the figures it prints."""
    child = [args.python, "-u", str(Path(__file__).resolve()), "--internal", part,
             "--root", str(args.root)] + list(more)
    proc = subprocess.run(child, stdout=subprocess.PIPE, text=True, env=env)
    found = [line for line in proc.stdout.splitlines() if line.startswith(RESULTS)]
    if proc.returncode or not found:
        raise SystemExit("%s failed (exit %d):\n%s" % (what, proc.returncode, proc.stdout))
    return json.loads(found[-1][len(RESULTS):])


def row_of(figures: dict) -> dict:
    body = figures["made"]["bytes"] / MIB
    delivery = figures["deliveries"][0] if len(figures["deliveries"]) == 1 else None
    points = delivery["points"] if delivery and delivery["points"] is not None else None
    limit = GOAL_FACTOR * body + GOAL_MIB
    return {
        "shape": figures["shape"], "body": body,
        "per_point": figures["made"]["bytes"] / points if points else None,
        "points": points, "base": figures["baseline_rss"], "peak": figures["peak"],
        "growth": (figures["peak"] - figures["baseline_rss"]) / body,
        "ratio": figures["peak"] / body, "limit": limit, "met": figures["peak"] <= limit,
        "fold_s": figures["fold_s"],
        "check": (figures["check"]["peak"] - figures["check"]["base"]) / body,
        "check_s": figures["check"]["check_s"],
        "status": ",".join("%s%s" % (d["status"], " (%s)" % d["error"] if d["error"] else "")
                           for d in figures["deliveries"]),
    }


def print_table(rows: list) -> None:
    header = ("shape", "body MiB", "B/point", "points", "base MiB", "peak MiB",
              "(peak-base)/body", "peak/body", "peak <= 4xbody+100", "fold s",
              "check: growth/body", "check s", "status")
    cells = [header]
    for row in rows:
        cells.append((row["shape"], "%.1f" % row["body"],
                      "-" if row["per_point"] is None else "%.0f" % row["per_point"],
                      "-" if row["points"] is None else "{:,}".format(row["points"]),
                      "%.0f" % row["base"], "%.0f" % row["peak"], "%.2fx" % row["growth"],
                      "%.2fx" % row["ratio"],
                      "%s (%.0f)" % ("yes" if row["met"] else "NO", row["limit"]),
                      "%.1f" % row["fold_s"], "%.2fx" % row["check"], "%.1f" % row["check_s"],
                      row["status"]))
    widths = [max(len(c[i]) for c in cells) for i in range(len(header))]
    for index, line in enumerate(cells):
        print("| " + " | ".join(cell.rjust(width) if 0 < i < len(header) - 1 else
                                cell.ljust(width) for i, (cell, width) in
                                enumerate(zip(line, widths))) + " |")
        if not index:
            print("|" + "|".join("-" * (width + 2) for width in widths) + "|")


def print_stages(figures: dict) -> None:
    trace = any("heap" in mark for mark in figures["stages"])
    print("  stages of the fold (MiB; VmHWM since the reset before the fold%s):" % (
        "; heap = tracemalloc's current and peak since the previous mark" if trace else ""))
    for mark in figures["stages"]:
        print("    %7.1fs  %-30s RSS %6.0f  VmHWM %6.0f%s" % (
            mark["s"], mark["label"], mark["vmrss"], mark["vmhwm"],
            "  heap %6.0f  heap peak %6.0f" % (mark["heap"], mark["heap_peak"])
            if "heap" in mark else ""))
    for top in figures["top"] or ():
        print("  largest allocation sites alive at '%s' (tracemalloc, %.0f MiB in all):" % (
            top["label"], top["total"]))
        for site in top["sites"]:
            print("    %7.1f MiB %9d blocks  %-22s %s" % (site["mib"], site["blocks"],
                                                        site["where"], site["line"]))


# ==========================================================================================
# --serve: a real ``serve``, its memory read from outside; --beside: a body arriving during
# a fold, as a phone retrying during a backfill sends one.
# ==========================================================================================

TOKEN = "bench-memory-token-0123456789abcdef"
SAMPLE_S = 0.005
"""How often serve's VmRSS is read from outside (its VmHWM catches what falls between)."""


class WatchedServe:
    """A ``healthlog.py serve`` subprocess on a fresh data directory, its VmRSS read from
    /proc every :data:`SAMPLE_S` by a thread of this process."""

    def __init__(self, args: argparse.Namespace, env: Optional[dict], data_dir: Path,
                 max_body_mib: int):
        import threading

        self.data_dir, self.log = data_dir, data_dir.parent / "serve.log"
        with open(str(self.log), "wb") as log:
            self.proc = subprocess.Popen(
                [args.python, str(args.root / "healthlog.py"), "serve", "--data",
                 str(data_dir), "--listen", "127.0.0.1:0", "--token", TOKEN,
                 "--max-body-mib", str(max_body_mib)],
                stdout=subprocess.DEVNULL, stderr=log, env=env)
        self.port = self._port()
        self.samples: list = []  # (seconds since start, VmRSS MiB)
        self.started = time.perf_counter()
        self.done = threading.Event()
        self.sampler = threading.Thread(target=self._sample, daemon=True)
        self.sampler.start()

    def _port(self) -> int:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and self.proc.poll() is None:
            for line in self.log.read_text(errors="replace").splitlines():
                if "msg=serving" in line:
                    return int(line.split(" listen=", 1)[1].split()[0].rsplit(":", 1)[1])
            time.sleep(0.05)
        raise SystemExit("serve did not start:\n" + self.log.read_text(errors="replace"))

    def status(self) -> dict:
        """VmRSS and VmHWM of serve, in MiB ({} once it has ended)."""
        try:
            text = Path("/proc/%d/status" % self.proc.pid).read_text()
        except OSError:
            return {}
        return {key.lower(): int(value) / 1024 for key, value in
                re.findall(r"^(VmHWM|VmRSS):\s+(\d+) kB", text, re.M)}

    def _sample(self) -> None:
        while not self.done.is_set():
            rss = self.status().get("vmrss")
            if rss is None:
                return
            self.samples.append((time.perf_counter() - self.started, rss))
            self.done.wait(SAMPLE_S)

    def reset_peak(self) -> bool:
        """serve's VmHWM back to its VmRSS (Linux 4.0+, the same user)."""
        try:
            with open("/proc/%d/clear_refs" % self.proc.pid, "w") as handle:
                handle.write("5")
            return True
        except OSError:
            return False

    def post(self, body: Path, aggregation: Optional[str]) -> tuple:
        """POST ``body`` (read from its file as it is sent): (status, seconds)."""
        import http.client

        headers = {"Authorization": "Bearer " + TOKEN, "Content-Type": "application/json",
                   "Content-Length": str(body.stat().st_size)}
        if aggregation:
            headers["automation-aggregation"] = aggregation
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=900)
        started = time.perf_counter()
        try:
            with open(str(body), "rb") as handle:
                conn.request("POST", "/api/ingest", body=handle, headers=headers)
                answer = conn.getresponse()
                answer.read()
        finally:
            conn.close()
        return answer.status, time.perf_counter() - started

    def statuses(self) -> list:
        journal = sqlite3_connect(self.data_dir)
        try:
            return [row[0] + (" (%s)" % row[1] if row[1] else "") for row in journal.execute(
                "SELECT parse_status, error FROM delivery ORDER BY id")]
        finally:
            journal.close()

    def wait(self, done: Callable[[], bool], timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not done():
            if self.proc.poll() is not None:
                raise SystemExit("serve ended (exit %s) while waiting for %s:\n%s" % (
                    self.proc.returncode, what, self.log.read_text(errors="replace")))
            if time.monotonic() > deadline:
                raise SystemExit("no %s within %.0f s" % (what, timeout))
            time.sleep(0.05)

    def stop(self) -> None:
        self.done.set()
        self.sampler.join(10)
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(120)


def sqlite3_connect(data_dir: Path):
    import sqlite3

    return sqlite3.connect(str(data_dir / "healthlog.sqlite3"), isolation_level=None)


def serve_shape(args: argparse.Namespace, shape: str, env: Optional[dict], tmp: Path) -> dict:
    """A body of ``shape`` POSTed to a fresh serve and folded by its fold thread; with
    ``--beside``, a body of that shape POSTed once the fold is under way (serve's RSS grown
    by the body: its text is read).  serve's memory over its idle RSS, and the need its
    start-up check counts for its ``--max-body-mib``."""
    target = int(args.mib * MIB)
    body = tmp / (shape + ".json")
    made = write_body(shape, body, target, seed=len(shape))
    sizes = [made["bytes"]]
    if args.beside:
        other = tmp / ("beside-" + args.beside + ".json")
        beside = write_body(args.beside, other, target, seed=len(args.beside) + 1)
        sizes.append(beside["bytes"])
    max_body_mib = -(-max(sizes) // MIB)
    serve = WatchedServe(args, env, tmp / "data", max_body_mib)
    figures = {"shape": shape, "made": made, "max_body_mib": max_body_mib, "beside": None}
    try:
        time.sleep(1.0)  # the start-up settles (its first fold pass finds nothing)
        figures["idle"] = serve.status()["vmrss"]
        figures["peak_reset"] = serve.reset_peak()
        status, figures["post_s"] = serve.post(body, made["aggregation"])
        if status != 200:
            raise SystemExit("POST of %s answered %d" % (shape, status))
        figures["at_200"] = serve.status()["vmhwm"]
        if not args.beside:  # from here on, the fold's own peak (its start is in the RSS)
            figures["fold_reset"] = serve.reset_peak()
        if args.beside:
            journal = sqlite3_connect(serve.data_dir)
            try:
                serve.wait(lambda: serve.status().get("vmrss", 0) >= figures["idle"] +
                           made["bytes"] / MIB or not journal.execute(
                               "SELECT count(*) FROM delivery WHERE parse_status = 'pending'"
                           ).fetchone()[0], 900, "fold under way")
                figures["beside_after_s"] = time.perf_counter() - serve.started
                figures["beside_rss"] = serve.status()["vmrss"]
                status, seconds = serve.post(other, beside["aggregation"])
                figures["beside"] = {"shape": args.beside, "made": beside, "status": status,
                                     "post_s": seconds}
            finally:
                journal.close()
        journal = sqlite3_connect(serve.data_dir)
        try:
            serve.wait(lambda: not journal.execute(
                "SELECT count(*) FROM delivery WHERE parse_status = 'pending'").fetchone()[0],
                3600, "fold of every delivery")
        finally:
            journal.close()
        figures["peak"] = serve.status()["vmhwm"]
        figures["sampled_peak"] = max(rss for _, rss in serve.samples)
        figures["statuses"] = serve.statuses()
        figures["elapsed_s"] = time.perf_counter() - serve.started
    finally:
        serve.stop()
    sys.path.insert(0, str(args.root))
    import healthlog

    figures["needed"] = healthlog.memory_needed_mib(max_body_mib * MIB)
    return figures


def print_serve(figures: dict) -> None:
    body = figures["made"]["bytes"] / MIB
    line = ("%s: %.1f MiB, --max-body-mib %d; serve idle %.0f MiB, VmHWM %.0f at the 200"
            " (%.1f s, +%.2fx the body)" % (
                figures["shape"], body, figures["max_body_mib"], figures["idle"],
                figures["at_200"], figures["post_s"], (figures["at_200"] - figures["idle"]) /
                body))
    beside = figures["beside"]
    if beside:
        line += "; %s (%.1f MiB) posted %.1f s after serve's start at %.0f MiB RSS: %d in" \
                " %.1f s" % (beside["shape"], beside["made"]["bytes"] / MIB,
                             figures["beside_after_s"], figures["beside_rss"],
                             beside["status"], beside["post_s"])
    print(line + "; %s VmHWM %.0f MiB (+%.2fx the body over idle; sampled VmRSS peak %.0f),"
          " the start-up check counts %d MiB%s; %s in %.0f s" % (
              "peak" if beside else "the fold's", figures["peak"],
              (figures["peak"] - figures["idle"]) / body,
              figures["sampled_peak"], figures["needed"],
              "" if figures["peak_reset"] else " (VmHWM not reset: the peak may be the"
              " start-up's)", ", ".join(figures["statuses"]), figures["elapsed_s"]),
          flush=True)


def environment(args: argparse.Namespace, env: Optional[dict]) -> None:
    probe = subprocess.run(
        [args.python, "-c", "import sys\ntry:\n import orjson; v = orjson.__version__\n"
         "except ImportError:\n v = 'not importable'\nprint(sys.version.split()[0], v)"],
        capture_output=True, text=True, env=env, check=True).stdout.split()
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text()
                .splitlines() if line.startswith("model name")), "unknown CPU")
    memory = next((line.split(":", 1)[1].strip() for line in Path("/proc/meminfo").read_text()
                   .splitlines() if line.startswith("MemTotal")), "?")
    program = args.root / "healthlog.py"
    print("fold memory bench, %s" % time.strftime("%Y-%m-%d %H:%M:%S %z"))
    print("python %s (%s), orjson %s%s; %s, nproc %d, MemTotal %s, kernel %s" % (
        probe[0], args.python, probe[1], " (hidden by --no-orjson)" if args.no_orjson else "",
        cpu, os.cpu_count() or 0, memory, os.uname().release))
    print("healthlog under bench: %s (%s)" % (program, _describe(program)))
    print("bodies of ~%g MiB; the goal: fold peak <= %d x body + %d MiB; the fold runs"
          " FoldWorker.run_pass in a fresh subprocess, VmHWM reset just before it" % (
              args.mib, GOAL_FACTOR, GOAL_MIB))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mib", type=float, default=32.0, help="body size (default 32)")
    parser.add_argument("--shapes", nargs="+", choices=tuple(SHAPES), default=list(SHAPES),
                        metavar="SHAPE", help="default: all of " + ", ".join(SHAPES))
    parser.add_argument("--root", type=Path, default=ROOT,
                        help="bench DIR/healthlog.py (another checkout)")
    parser.add_argument("--python", default=sys.executable)
    parser.add_argument("--no-orjson", action="store_true",
                        help="hide orjson from the import and the fold")
    parser.add_argument("--stages", action="store_true",
                        help="RSS and VmHWM at the fold's stage boundaries")
    parser.add_argument("--tracemalloc", action="store_true",
                        help="with --stages: the Python heap per stage and the largest"
                             " allocation sites (slow; inflates RSS)")
    parser.add_argument("--serve", action="store_true",
                        help="POST each body to a real serve and read its memory from"
                             " outside while it checks and folds it")
    parser.add_argument("--beside", choices=tuple(SHAPES), metavar="SHAPE",
                        help="with --serve: POST a body of SHAPE while each fold runs")
    parser.add_argument("--internal", choices=["fold", "check"], help=argparse.SUPPRESS)
    parser.add_argument("--data", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--body", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.root = args.root.resolve()
    args.stages = args.stages or args.tracemalloc
    if not (args.root / "healthlog.py").is_file():
        parser.error("no healthlog.py in %s" % args.root)
    if args.beside and not args.serve:
        parser.error("--beside needs --serve")
    if args.internal:
        figures = fold_child(args.root, args.data, args.stages, args.tracemalloc) if (
            args.internal == "fold") else check_child(args.root, args.body)
        print(RESULTS + json.dumps(figures))
        return 0
    started = time.monotonic()
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-memory-") as tmp:
        env = hidden_orjson_env(Path(tmp) / "no-orjson") if args.no_orjson else None
        environment(args, env)
        if args.serve:
            for shape in args.shapes:
                with tempfile.TemporaryDirectory(dir=tmp) as shape_tmp:
                    print_serve(serve_shape(args, shape, env, Path(shape_tmp)))
            print("total wall time: %.0f s" % (time.monotonic() - started))
            return 0
        for shape in args.shapes:
            with tempfile.TemporaryDirectory(dir=tmp) as shape_tmp:
                figures = run_shape(args, shape, env, Path(shape_tmp))
            row = row_of(figures)
            rows.append(row)
            made = figures["made"]
            check = figures["check"]
            print("%s: ingest check %s in %.1f s, VmHWM %.0f MiB over %.0f (+%.2fx the body)" % (
                shape, check["verdict"], check["check_s"], check["peak"], check["base"],
                (check["peak"] - check["base"]) / (figures["made"]["bytes"] / MIB)))
            print("%s: %d bytes, %d points%s written in %.1f s, imported in %.1f s; fold (%s):"
                  " %.1f s, RSS %.0f MiB at its start (VmHWM %.0f after the imports%s), peak"
                  " %.0f MiB, %.0f MiB at its end; %s" % (
                      shape, made["bytes"], made["points"],
                      " (%d route points)" % made["route_points"] if "route_points" in made
                      else "", figures["generate_s"], figures["import_s"], figures["json"],
                      figures["fold_s"], figures["baseline_rss"], figures["baseline_hwm"],
                      "" if figures["peak_reset"] else "; VmHWM NOT reset: the peak may be"
                      " the imports'", figures["peak"], figures["end_rss"],
                      "; ".join("delivery %d %s layer=%s points=%s objects=%s%s" % (
                          d["id"], d["status"], d["layer"], d["points"], d["objects_written"],
                          " error=%s" % d["error"] if d["error"] else "")
                          for d in figures["deliveries"])), flush=True)
            if figures["stages"]:
                print_stages(figures)
    print()
    print_table(rows)
    print("(base: the fold process's RSS just before the fold, healthlog imported and the"
          " journal open; peak: its VmHWM after the fold; 4xbody+100 in parentheses, MiB;"
          " check: the ingest check's VmHWM over the RSS before it, in a fresh process,"
          " per byte of the body)")
    print("total wall time: %.0f s" % (time.monotonic() - started))
    return 0


if __name__ == "__main__":
    sys.exit(main())
