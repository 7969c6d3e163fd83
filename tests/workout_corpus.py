"""Workouts as HAE sends them, and the tests' own reading of them (workouts spec,
openspec/specs/workouts/spec.md): used by tests/test_workouts.py and
tests/test_workout_page.py.

The corpus: a 10 km run of version 2 with a route of one point a second, heart rate every
5 seconds (with a two-minute gap) and a recovery series; a ride; a pool swim without a route
(its distance series per minute); a strength workout whose ``heartRateData`` holds only the
recovery (HAE's bug: instantaneous samples after ``end``); a walk whose automation excluded
routes, sent with its route all the same (HAE's bug); the run again from another app (no
route, no heart rate, its start and end a little off); a yoga session and a walk of another
app overlapping the run by less than the rule's share; a run from a phone set to Chinese;
version 1 workouts in the shape of a
real HAE 8.1.2 body (heart rate at irregular seconds with a gap of minutes, recovery, the
climb as ``elevation.ascent`` in feet, distance in miles) and with a route; and a year of a
Days heart-rate export before them, whose highest ``Max`` the zones are drawn from when the
owner sets none.

The oracle here is written from the spec in its own words and never calls healthlog: times
are read with tests/read_helpers.py, distances by the haversine formula on a sphere of
6,371,008.8 m, splits, zones, pace and the GPX's heart rate by the rules the spec states.
"""

from __future__ import annotations

import bisect
import datetime as dt
import json
import math
import random

import hae_factory as hf
from read_helpers import instant_us

SEED = 35
BERLIN = hf.Phone(zone=hf.BERLIN, sources="single")
NEW_YORK = hf.Phone(zone=hf.NEW_YORK, sources="single")
WORKOUTS = hf.Automation("Workouts", "Default", "Since Last Sync")
NO_ROUTES = hf.Automation("Workouts without routes", "Default", "Since Last Sync")
OTHER_APP = hf.Automation("Another app", "Default", "Since Last Sync")
DAYS = hf.Automation("Daily heart", "Days", "Previous 7 Days")
EARTH_M = 6371008.8
YEAR_MAX = 188  # the highest Max of the Days heart-rate export (zones without a setting)
RUN_START = dt.datetime(2025, 6, 1, 7, 0)  # Berlin wall time
OTHER_SOURCE = "Strava"


def _t(phone: hf.Phone, epoch: float) -> str:
    return phone.time(epoch)


def _phone_epoch(wall: dt.datetime, phone: hf.Phone) -> int:
    return int(hf._epoch(wall, phone.zone))


def ten_km_run(rng: random.Random) -> dict:
    """Version 2, one route point a second until 10 km, heart rate every 5 s from the start
    (none from minute 20 to minute 22) and 24 recovery samples every 5 s after the end."""
    start = _phone_epoch(RUN_START, BERLIN)
    lat, lon, alt, course = 52.5163, 13.3777, 34.0, 80.0
    route, meters, t = [], 0.0, start
    while meters < 10_000:
        route.append({"latitude": lat, "longitude": lon, "altitude": round(alt, 3),
                      "course": course, "courseAccuracy": 12.0, "horizontalAccuracy": 4.0,
                      "verticalAccuracy": 3.0, "timestamp": _t(BERLIN, t),
                      "speed": 2.9, "speedAccuracy": 0.5})
        speed = 2.75 + 0.35 * math.sin((t - start) / 300) + rng.uniform(-0.1, 0.1)
        course = (course + rng.gauss(0, 4)) % 360
        step = speed
        lat2 = lat + step * math.cos(math.radians(course)) / 111_320
        lon2 = lon + step * math.sin(math.radians(course)) / (111_320 * math.cos(
            math.radians(lat)))
        meters += haversine(lat, lon, lat2, lon2)
        lat, lon = lat2, lon2
        alt += 0.6 * math.sin((t - start) / 200) + rng.gauss(0, 0.4)
        t += 1
    end = t
    heart = []
    for s in range(start, end + 1, 5):
        if 1200 <= s - start < 1320:
            continue  # the strap slipped: a gap of two minutes
        bpm = round(120 + 40 * min(1.0, (s - start) / 600) + rng.uniform(-4, 4))
        heart.append({"date": _t(BERLIN, s), "Min": bpm, "Avg": bpm, "Max": bpm,
                      "units": "count/min", "source": hf.OWNER_WATCH})
    recovery = [{"date": _t(BERLIN, end + 5 * (k + 1)), "Min": 158 - 2 * k, "Avg": 158 - 2 * k,
                 "Max": 158 - 2 * k, "units": "count/min", "source": hf.OWNER_WATCH}
                for k in range(24)]
    values = [h["Avg"] for h in heart]
    return {
        "id": hf.new_uuid(rng), "name": "Running", "start": _t(BERLIN, start),
        "end": _t(BERLIN, end), "duration": float(end - start) - 0.25,
        "location": "Outdoor", "isIndoor": False,
        "activeEnergyBurned": {"qty": 2811.5, "units": "kJ"},
        "totalEnergy": {"qty": 3304.2, "units": "kJ"},
        "distance": {"qty": 10.02, "units": "km"},
        "elevationUp": {"qty": 41.5, "units": "m"},
        "heartRate": {"min": {"qty": min(values), "units": "count/min"},
                      "avg": {"qty": sum(values) / len(values), "units": "count/min"},
                      "max": {"qty": max(values), "units": "count/min"}},
        "heartRateData": heart, "heartRateRecovery": recovery, "route": route, "metadata": {},
    }


def ride(rng: random.Random) -> dict:
    """Version 2, 20 minutes, a route point every 2 s, distance in km."""
    return hf.workout_v2(SEED, dt.datetime(2025, 6, 3, 18, 0), name="Outdoor Cycling",
                         minutes=20, phone=BERLIN, route_points=600, rng=rng)


def pool_swim(rng: random.Random) -> dict:
    """Version 2 at a pool, 30 minutes, 1,500 m, no route; its distance per minute."""
    start = _phone_epoch(dt.datetime(2025, 6, 4, 12, 0), BERLIN)
    minutes = [50.0] * 30
    heart = [{"date": _t(BERLIN, start + 60 * k), "Min": 110 + k % 7, "Avg": 118 + k % 5,
              "Max": 126 + k % 3, "units": "count/min", "source": hf.OWNER_WATCH}
             for k in range(30)]
    return {
        "id": hf.new_uuid(rng), "name": "Pool Swim", "start": _t(BERLIN, start),
        "end": _t(BERLIN, start + 1800), "duration": 1800.0, "location": "Pool",
        "isIndoor": True, "activeEnergyBurned": {"qty": 301.0, "units": "kcal"},
        "distance": {"qty": 1.5, "units": "km"}, "lapLength": {"qty": 25, "units": "m"},
        "heartRateData": heart, "heartRateRecovery": [],
        "swimDistance": [{"date": _t(BERLIN, start + 60 * k), "qty": q, "units": "m",
                          "source": hf.OWNER_WATCH} for k, q in enumerate(minutes)],
        "metadata": {},
    }


def recovery_only(rng: random.Random) -> dict:
    """Version 2 whose ``heartRateData`` holds the recovery: 8 instantaneous samples after
    its end (HAE's bug), the recovery series itself empty."""
    workout = hf.workout_v2(SEED + 1, dt.datetime(2025, 6, 5, 19, 0),
                            name="Functional Strength Training", minutes=40, phone=BERLIN,
                            route_points=0, rng=rng)
    end = instant_us(workout["end"]) // 1_000_000
    workout["heartRateData"] = [
        {"date": _t(BERLIN, end + 15 * (k + 1)), "Min": 120 - 3 * k, "Avg": 120 - 3 * k,
         "Max": 120 - 3 * k, "units": "count/min", "source": hf.OWNER_WATCH}
        for k in range(8)]
    workout["heartRateRecovery"] = []
    return workout


def excluded_route_walk(rng: random.Random) -> dict:
    """A walk of an automation that excluded routes, sent with its route (HAE's bug)."""
    return hf.workout_v2(SEED + 2, dt.datetime(2025, 6, 6, 8, 0), name="Outdoor Walk",
                         minutes=25, phone=BERLIN, route_points=300, rng=rng)


def run_again(run: dict, rng: random.Random) -> dict:
    """The 10 km run as another app recorded it: its own id and name, 35 s later, 20 s
    longer, no route, no heart rate, its energy series from that app."""
    start = instant_us(run["start"]) // 1_000_000 + 35
    end = instant_us(run["end"]) // 1_000_000 + 55
    return {"id": hf.new_uuid(rng), "name": "Morning Run", "start": _t(BERLIN, start),
            "end": _t(BERLIN, end), "duration": float(end - start),
            "activeEnergyBurned": {"qty": 640.0, "units": "kcal"},
            "distance": {"qty": 9.95, "units": "km"},
            "activeEnergy": [{"date": _t(BERLIN, start + 60 * k), "qty": 11.0,
                              "units": "kcal", "source": OTHER_SOURCE} for k in range(50)],
            "metadata": {}}


def near_misses(run: dict, rng: random.Random) -> list:
    """Workouts overlapping the run that are not it: a walk of nearly the same span (another
    activity; of the very same span it would be the run's coordinate, one point in the
    store), and a run covering 60 % of the run's length (less than the rule's share)."""
    start = instant_us(run["start"]) // 1_000_000
    end = instant_us(run["end"]) // 1_000_000
    walk = {"id": hf.new_uuid(rng), "name": "Walking", "start": _t(BERLIN, start + 60),
            "end": run["end"], "duration": float(end - start - 60),
            "distance": {"qty": 4.0, "units": "km"}, "metadata": {}}
    part = {"id": hf.new_uuid(rng), "name": "Running", "start": _t(BERLIN, start),
            "end": _t(BERLIN, start + int(0.6 * (end - start))),
            "duration": 0.6 * (end - start), "distance": {"qty": 6.0, "units": "km"},
            "metadata": {}}
    return [walk, part]


def real_v1_walk(rng: random.Random) -> dict:
    """Version 1 in the shape of a real HAE 8.1.2 body: no id, no duration, heart rate
    ``{date, qty, units: "bpm"}`` at irregular seconds with a gap of six minutes,
    recovery from a minute after the end, ``elevation.ascent`` in feet, miles, no route."""
    start = _phone_epoch(dt.datetime(2025, 6, 7, 20, 38, 38), NEW_YORK)
    end = start + 725
    offsets = [9, 10, 22, 25, 34, 38, 41, 49, 50, 56, 447, 451, 593, 600, 642, 679, 680, 686,
               691, 697]
    heart = [{"date": _t(NEW_YORK, start + o), "qty": 95 + (o * 7) % 13, "units": "bpm"}
             for o in offsets]
    recovery = [{"date": _t(NEW_YORK, end + 54 + 5 * k), "qty": 74 - k % 5, "units": "bpm"}
                for k in range(14)]
    return {"totalEnergy": {"qty": 133.5, "units": "kcal"},
            "stepCount": {"qty": 308, "units": "steps"}, "start": _t(NEW_YORK, start),
            "flightsClimbed": {"qty": 0, "units": "count"}, "name": "Walking",
            "distance": {"units": "mi", "qty": 0.59}, "speed": {"qty": 2.93, "units": "mi/hr"},
            "heartRateRecovery": recovery, "avgHeartRate": {"units": "bpm", "qty": 98.0},
            "isIndoor": False, "elevation": {"units": "ft", "ascent": 18.8, "descent": 0},
            "humidity": {"qty": 56, "units": "%"}, "activeEnergy": {"units": "kcal",
                                                                    "qty": 67.5},
            "heartRateData": heart, "maxHeartRate": {"units": "bpm", "qty": 108},
            "end": _t(NEW_YORK, end), "intensity": {"units": "MET", "qty": 4.2},
            "temperature": {"qty": 79.6, "units": "degF"}}


def v1_run(rng: random.Random) -> dict:
    """Version 1 with a route of ``lat``/``lon`` (the factory's), in miles."""
    return hf.workout_v1(SEED, dt.datetime(2025, 6, 8, 6, 30), name="Running", minutes=24,
                         phone=NEW_YORK, route_points=240, rng=rng)


def yoga(rng: random.Random) -> dict:
    """The real version 2 fragment's shape: energy in kJ, distance 0, one heart-rate sample."""
    workout = hf.workout_v2(SEED + 3, dt.datetime(2025, 6, 2, 9, 34), name="Yoga", minutes=11,
                            phone=BERLIN, route_points=0, rng=rng)
    workout["heartRateData"] = workout["heartRateData"][3:4]
    workout["distance"] = {"qty": 0, "units": "km"}
    return workout


def localised_run(rng: random.Random) -> dict:
    """Version 2 from a phone set to Chinese (the shape of a real zh-CN body): the name and
    location translated, the step series in ``步``, heart rate as ``avgHeartRate`` and
    ``maxHeartRate`` amounts (no ``heartRate`` object), ``avgSpeed``, a route."""
    workout = hf.workout_v2(SEED + 4, dt.datetime(2025, 6, 9, 6, 15), name="Running",
                            minutes=18, phone=BERLIN, route_points=180, rng=rng)
    summary = workout.pop("heartRate")
    workout.update(name="户外跑步", location="户外",
                   avgHeartRate={"qty": summary["avg"]["qty"], "units": "bpm"},
                   maxHeartRate={"qty": summary["max"]["qty"], "units": "bpm"},
                   avgSpeed={"qty": 9.8, "units": "kmph"},
                   stepCount=[{"date": h["date"], "qty": 160, "units": "步"}
                              for h in workout["heartRateData"]])
    return workout


def heart_days() -> list:
    """A Days export of heart rate over the year before the workouts: its highest ``Max``
    is :data:`YEAR_MAX`."""
    points = []
    for k in range(200):
        day = dt.date(2024, 11, 1) + dt.timedelta(days=k)
        top = YEAR_MAX if k == 150 else 150 + k % 30
        points.append({"date": BERLIN.time(day), "Min": 50, "Avg": 70, "Max": top,
                       "source": hf.OWNER_WATCH})
    return [hf.metric("heart_rate", points, "count/min")]


class WorkoutCorpus:
    """The deliveries (automation, body bytes) and each workout as the server got it
    (parsed back from the bytes posted), by a name of the test's."""

    def __init__(self):
        rng = random.Random(SEED)
        self.deliveries = []
        self.workouts = {}
        run = ten_km_run(rng)
        walk, part = near_misses(run, rng)
        batches = [
            (WORKOUTS, {"run": run, "ride": ride(rng), "swim": pool_swim(rng),
                        "bug": recovery_only(rng), "yoga": yoga(rng)}),
            (NO_ROUTES, {"excluded": excluded_route_walk(rng)}),
            (OTHER_APP, {"again": run_again(run, rng), "walk_over": walk, "part_run": part}),
            (WORKOUTS, {"v1_walk": real_v1_walk(rng), "v1_run": v1_run(rng),
                        "localised": localised_run(rng)}),
        ]
        self.deliveries.append((DAYS, hf.dumps_hae(hf.envelope(metrics=heart_days()), rng)))
        for automation, named in batches:
            sent = hf.dumps_hae(hf.envelope(workouts=list(named.values())), rng)
            self.deliveries.append((automation, sent))
            for name, workout in zip(named, json.loads(sent)["data"]["workouts"]):
                self.workouts[name] = workout


# -- the oracle ----------------------------------------------------------------------------


def seconds(text) -> float:
    return instant_us(text) / 1e6


def haversine(lat1, lon1, lat2, lon2) -> float:
    p1, p2 = math.radians(lat1), math.radians(lat2)
    a = (math.sin((p2 - p1) / 2) ** 2
         + math.cos(p1) * math.cos(p2) * math.sin(math.radians(lon2 - lon1) / 2) ** 2)
    return 2 * EARTH_M * math.asin(math.sqrt(a))


def positions(workout: dict) -> list:
    """(lat, lon, altitude, seconds) of each route point: version 2's latitude/longitude,
    version 1's lat/lon."""
    out = []
    for p in workout.get("route") or []:
        lat = p["latitude"] if "latitude" in p else p["lat"]
        lon = p["longitude"] if "longitude" in p else p["lon"]
        out.append((lat, lon, p.get("altitude"), seconds(p["timestamp"])))
    return out


def route_meters(points: list) -> float:
    return math.fsum(haversine(a[0], a[1], b[0], b[1]) for a, b in zip(points, points[1:]))


def session_heart(workout: dict) -> list:
    """(seconds, value) of the heart-rate samples from start to end, in time order."""
    start, end = seconds(workout["start"]), seconds(workout["end"])
    out = []
    for h in workout.get("heartRateData") or []:
        t = seconds(h["date"])
        if start <= t <= end:
            out.append((t, h["Avg"] if "Avg" in h else h["qty"]))
    return sorted(out)


def splits(points: list, unit_m: float, heart: list, start: float) -> list:
    """(meters, seconds, pace per unit, mean heart rate) of each split: a boundary every
    ``unit_m`` along the route, its time where it falls between two points (in proportion
    to the distance), the last partial split when 10 m or longer."""
    marks, total, goal = [], 0.0, unit_m
    for a, b in zip(points, points[1:]):
        step = haversine(a[0], a[1], b[0], b[1])
        while step > 0 and total + step >= goal:
            marks.append((goal, a[3] + (b[3] - a[3]) * (goal - total) / step))
            goal += unit_m
        total += step
    if not marks or marks[-1][0] < total:
        marks.append((total, points[-1][3]))
    rows, last_m, last_t = [], 0.0, start
    times = [h[0] for h in heart]
    for k, (m, t) in enumerate(marks):
        length = m - last_m
        if k == len(marks) - 1 and k > 0 and length < 10:
            break
        inside = [v for s, v in heart[bisect.bisect_left(times, last_t):] if s < t]
        rows.append((length, t - last_t, (t - last_t) * unit_m / length,
                     sum(inside) / len(inside) if inside else None))
        last_m, last_t = m, t
    return rows


def zone_seconds(heart: list, end: float, maximum: float) -> list:
    """Seconds below zone 1 and in zones 1 to 5 (50, 60, 70, 80, 90 % of the maximum):
    each sample holds until the next, the last until the end, never more than 60 s."""
    out = [0.0] * 6
    for k, (t, v) in enumerate(heart):
        until = heart[k + 1][0] if k + 1 < len(heart) else end
        held = min(max(until - t, 0), 60.0)
        zone = 0
        for number, share in enumerate((0.5, 0.6, 0.7, 0.8, 0.9), 1):
            if v >= share * maximum:
                zone = number
        out[zone] += held
    return out


def nearest_bpm(heart: list, t: float):
    """The sample nearest in time within 5 s, or None."""
    found = [(abs(s - t), v) for s, v in heart if abs(s - t) <= 5]
    return min(found)[1] if found else None


# -- a two-day workout -------------------------------------------------------------------------

LONG_POINTS = 193_000
LONG_START = dt.datetime(2025, 7, 4, 6, 0)  # Berlin wall time


def long_walk_body(points: int = LONG_POINTS) -> tuple:
    """(body bytes, id, points, [(lat, lon) of the first and the last]) of a version 2 hike
    of two days and more:
    a route point a second (``points`` of them), heart rate every 5 s, written compact as
    text (a dict a point would take longer to build than the server takes to fold it)."""
    start = _phone_epoch(LONG_START, BERLIN)
    uid = "0A7E6C2D-35D0-4B1E-9F00-00000000DA75"
    route, heart, ends = [], [], []
    lat, lon = 47.0, 8.0
    for k in range(points):
        t = start + k
        lat += 0.000009 * math.cos(k / 5000.0)
        lon += 0.000013 * math.sin(k / 7000.0 + 1.0)
        if k in (0, points - 1):
            ends.append((lat, lon))
        route.append('{"latitude":%r,"longitude":%r,"altitude":%r,"course":90.0,'
                     '"horizontalAccuracy":4.0,"verticalAccuracy":3.0,"speed":1.2,'
                     '"timestamp":"%s"}' % (lat, lon, 400.0 + 50 * math.sin(k / 3000.0),
                                            _t(BERLIN, t)))
        if k % 5 == 0:
            bpm = 95 + k % 30
            heart.append('{"date":"%s","Min":%d,"Avg":%d,"Max":%d,"units":"count/min"}'
                         % (_t(BERLIN, t), bpm, bpm, bpm))
    end = start + points - 1
    body = ('{"data":{"workouts":[{"id":"%s","name":"Hiking","start":"%s","end":"%s",'
            '"duration":%d,"distance":{"qty":%r,"units":"km"},"heartRateData":[%s],'
            '"route":[%s]}]}}' % (uid, _t(BERLIN, start), _t(BERLIN, end), end - start,
                                  points * 1.2 / 1000, ",".join(heart), ",".join(route)))
    return body.encode(), uid, points, ends
