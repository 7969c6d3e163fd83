"""Workouts as people look at them: the list, one workout whole, its GPX, duplicates across
sources, the SQLite export's tables and the settings (openspec/specs/workouts/spec.md,
WKT-1 to WKT-8 and WKT-11).

One store for the module: the bodies of tests/workout_corpus.py posted over HTTP to a real
``healthlog serve`` subprocess on 127.0.0.1:0 and folded by its worker. Every expectation is
the corpus's own arithmetic (tests/workout_corpus.py), from the bodies posted; GPX files are
read by gpxpy, a parser written apart from healthlog.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import io
import sqlite3
import urllib.parse

import gpxpy
import pytest

import hae_factory as hf
import healthlog
import workout_corpus as wc
from conftest import TOKEN, run_export
from read_helpers import (approx, assert_error, call, get, get_json, instant_us, serve_corpus,
                          written)

UTC = dt.timezone.utc
RANGE = {"from_": "2025-05-01", "to": "2025-06-30"}


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    corpus = wc.WorkoutCorpus()
    deliveries = [(hf.headers_for(a), body) for a, body in corpus.deliveries]
    yield from serve_corpus(tmp_path_factory.mktemp("workouts"), corpus, deliveries)


def coordinate_id(workout: dict) -> str:
    """The spec's id of a workout without HAE's: its start and end in UTC, compact."""
    def compact(text):
        return written(text).astimezone(UTC).strftime("%Y%m%dT%H%M%SZ")
    return "%s_%s" % (compact(workout["start"]), compact(workout["end"]))


def id_of(workout: dict) -> str:
    return workout["id"] if "id" in workout else coordinate_id(workout)


def listed(store) -> dict:
    answer = get_json(store.address, "/api/workouts", **RANGE)
    return answer, {item["id"]: item for item in answer["workouts"]}


def workout(store, name: str, **query) -> dict:
    return get_json(store.address, "/api/workouts/" + id_of(store.corpus.workouts[name]),
                    **query)


def figures(answer) -> dict:
    return {f["key"]: f for f in answer["figures"]}


def connect(store):
    """A read-only connection of the test's own, closed after the block."""
    return contextlib.closing(sqlite3.connect(
        "file:%s?mode=ro" % (store.data_dir / "healthlog.sqlite3"), uri=True))


# -- WKT-1: the list --------------------------------------------------------------------------


def test_wkt_1_1_the_list_of_a_range_has_every_workout_with_its_id_and_figures(store):
    answer, by_id = listed(store)
    sent = store.corpus.workouts
    assert set(by_id) == {id_of(w) for w in sent.values()}
    starts = [instant_us(item["start"].replace("Z", "+00:00")) for item in answer["workouts"]]
    assert starts == sorted(starts, reverse=True)  # newest first
    for name, w in sent.items():
        item = by_id[id_of(w)]
        start = written(w["start"])
        assert item["local_start"] == start.isoformat() and item["date"] == str(start.date())
        assert item["name"] == w["name"]
        seconds = w["duration"] if "duration" in w else (
            written(w["end"]) - start).total_seconds()
        assert item["duration_s"] == approx(seconds), name
        assert item["version"] == (2 if "id" in w else 1)
        assert item["has_route"] == bool(w.get("route"))
        assert item["route_points"] == len(w.get("route") or [])
        assert item["has_heart_rate"] == bool(wc.session_heart(w)), name
        if "distance" in w:
            assert (item["distance"]["qty"], item["distance"]["units"]) == (
                w["distance"]["qty"], w["distance"]["units"])
    # ids of version 1 are their coordinates; the walk of 8.1.2 has none of HAE's
    assert by_id[coordinate_id(sent["v1_walk"])]["name"] == "Walking"
    # a date alone includes its day, in each workout's own local time
    day = get_json(store.address, "/api/workouts", from_="2025-06-01", to="2025-06-01")
    assert {item["id"] for item in day["workouts"]} == {
        id_of(sent[n]) for n in ("run", "again", "walk_over", "part_run")}


def test_wkt_1_2_errors_are_the_one_json_shape_and_reading_needs_the_token(store):
    assert_error(call(store.address, "GET", "/api/workouts", auth=False), 401, "unauthorized")
    run_id = id_of(store.corpus.workouts["run"])
    for path in ("/api/workouts/" + run_id, "/api/workouts/%s.gpx" % run_id):
        assert_error(call(store.address, "GET", path, auth=False), 401, "unauthorized")
    assert_error(get(store.address, "/api/workouts", from_="2025-06-02", to="2025-06-01"),
                 400, "bad_request")
    assert_error(get(store.address, "/api/workouts", tz="Mars/Olympus"), 400, "bad_request")
    for unknown in ("0000AAAA-0000-4000-8000-000000000000", "20250601T050000Z_20250601T060000Z",
                    "not%20an%20id", "x" * 300):
        error = assert_error(get(store.address, "/api/workouts/" + unknown), 404,
                             "unknown_workout")
        assert "unknown" not in error["message"] or unknown not in error["message"]
    swim = id_of(store.corpus.workouts["swim"])
    error = assert_error(get(store.address, "/api/workouts/%s.gpx" % swim), 404, "no_route")
    assert "route" in error["message"]


# -- WKT-2: figures in the units people read ----------------------------------------------------


def test_wkt_2_1_a_run_in_km_and_kj_as_sent_with_its_pace(store):
    run = store.corpus.workouts["run"]
    f = figures(workout(store, "run"))
    km, active, total = (run["distance"]["qty"], run["activeEnergyBurned"]["qty"],
                         run["totalEnergy"]["qty"])
    assert f["duration"]["value"] == approx(run["duration"])
    assert (f["distance"]["value"], f["distance"]["unit_label"]) == (km, "km")
    assert (f["active_energy"]["value"], f["active_energy"]["units"]) == (active, "kJ")
    assert (f["total_energy"]["value"], f["total_energy"]["units"]) == (total, "kJ")
    # kJ stay kJ: no figure is their sum, nor a conversion to kcal
    assert all(abs(x["value"] - (active + total)) > 1 and abs(x["value"] - active / 4.184) > 1
               for x in f.values())
    assert f["pace"]["shown"] == "pace" and f["pace"]["unit_label"] == "/km"
    assert f["pace"]["value"] == approx(run["duration"] / km)
    assert (f["elevation_gain"]["value"], f["elevation_gain"]["units"]) == (
        run["elevationUp"]["qty"], "m")
    assert f["average_heart_rate"]["value"] == approx(run["heartRate"]["avg"]["qty"])
    assert f["max_heart_rate"]["value"] == run["heartRate"]["max"]["qty"]
    assert "speed" not in f


def test_wkt_2_2_a_ride_in_km_per_hour_a_walk_in_miles_and_a_swim_per_100_m(store):
    sent = store.corpus.workouts
    ride = sent["ride"]
    f = figures(workout(store, "ride"))
    assert "pace" not in f and f["speed"]["unit_label"] == "km/h"
    assert f["speed"]["value"] == approx(ride["distance"]["qty"] / (ride["duration"] / 3600))
    walk = sent["v1_walk"]  # version 1: end - start, miles, feet, kcal twice
    f = figures(workout(store, "v1_walk"))
    assert f["duration"]["value"] == 725 and walk["distance"]["units"] == "mi"
    assert f["pace"]["unit_label"] == "/mi"
    assert f["pace"]["value"] == approx(725 / walk["distance"]["qty"])
    assert (f["elevation_gain"]["value"], f["elevation_gain"]["units"]) == (
        walk["elevation"]["ascent"], "ft")
    assert (f["active_energy"]["value"], f["total_energy"]["value"]) == (
        walk["activeEnergy"]["qty"], walk["totalEnergy"]["qty"])
    assert (f["average_heart_rate"]["value"], f["max_heart_rate"]["value"]) == (
        walk["avgHeartRate"]["qty"], walk["maxHeartRate"]["qty"])
    swim = workout(store, "swim")
    f = figures(swim)
    assert f["pace"]["unit_label"] == "/100 m"
    assert f["pace"]["value"] == approx(1800 / (sent["swim"]["distance"]["qty"] * 10))
    assert swim["route"] is None and swim["elevation"] is None
    assert "No route was sent with this workout." in swim["notes"]
    # the real fragment's yoga: distance 0 km is no distance, energy in kJ as sent
    f = figures(workout(store, "yoga"))
    assert "distance" not in f and "pace" not in f and f["active_energy"]["units"] == "kJ"
    # a Chinese phone's run: its activity from its translated name, heart rate as amounts
    localised = sent["localised"]
    answer = workout(store, "localised")
    f = figures(answer)
    assert answer["workout"]["activity"] == "running" and f["pace"]["unit_label"] == "/km"
    assert f["pace"]["value"] == approx(localised["duration"] / localised["distance"]["qty"])
    assert (f["average_heart_rate"]["value"], f["max_heart_rate"]["value"]) == (
        localised["avgHeartRate"]["qty"], localised["maxHeartRate"]["qty"])
    assert f["average_heart_rate"]["unit_label"] == "bpm"


# -- WKT-3: the route, thinned for drawing ---------------------------------------------------------


def test_wkt_3_1_the_route_is_thinned_on_the_server_with_the_whole_routes_bounds(store):
    run = store.corpus.workouts["run"]
    points = wc.positions(run)
    route = workout(store, "run")["route"]
    assert route["points"] == len(points) == 3638 and len(route["drawn"]) <= 2000
    drawn = [(p[1], p[2]) for p in route["drawn"]]
    assert drawn[0] == points[0][:2] and drawn[-1] == points[-1][:2]
    assert set(drawn) <= {p[:2] for p in points}
    assert route["bounds"] == {"south": min(p[0] for p in points),
                               "west": min(p[1] for p in points),
                               "north": max(p[0] for p in points),
                               "east": max(p[1] for p in points)}
    assert route["meters"] == pytest.approx(wc.route_meters(points), rel=1e-9)
    assert route["gpx"] == "/api/workouts/%s.gpx" % run["id"]
    ride = store.corpus.workouts["ride"]  # 600 points: drawn whole
    drawn = workout(store, "ride")["route"]["drawn"]
    assert [(p[1], p[2], p[3]) for p in drawn] == [p[:3] for p in wc.positions(ride)]
    excluded = workout(store, "excluded")  # sent although its automation excluded routes
    assert excluded["route"]["points"] == len(store.corpus.workouts["excluded"]["route"])


# -- WKT-4: heart rate, recovery and zones -------------------------------------------------------


def test_wkt_4_1_session_and_recovery_apart_and_time_in_zones(store):
    run = store.corpus.workouts["run"]
    answer = workout(store, "run")
    heart = answer["heart_rate"]
    session = wc.session_heart(run)
    start, end = wc.seconds(run["start"]), wc.seconds(run["end"])
    assert heart["state"] == "sent"
    assert [(s[0], s[1]) for s in heart["session"]] == [
        (pytest.approx(t - start), v) for t, v in session]
    assert [s[1] for s in heart["recovery"]] == [r["Avg"] for r in run["heartRateRecovery"]]
    assert all(s[0] > end - start for s in heart["recovery"])
    zones = heart["zones"]
    assert (zones["source"], zones["max"]) == ("year", wc.YEAR_MAX)  # the year's highest
    assert "188 bpm" in zones["words"] and "--max-heart-rate" in zones["words"]
    expected = wc.zone_seconds(session, end, wc.YEAR_MAX)
    assert [z["seconds"] for z in zones["zones"]] == [pytest.approx(s) for s in expected]
    # the sample before the two-minute gap holds 60 s of its 125: the zones hold 65 s less
    assert sum(expected) == pytest.approx(end - start - 65)
    with connect(store) as conn:  # the owner's own maximum (--max-heart-rate)
        own = healthlog.get_workout(conn, run["id"], max_heart_rate=190.0)
    assert (own["heart_rate"]["zones"]["source"], own["heart_rate"]["zones"]["max"]) == (
        "setting", 190.0)
    assert [z["seconds"] for z in own["heart_rate"]["zones"]["zones"]] == [
        pytest.approx(s) for s in wc.zone_seconds(session, end, 190.0)]


def test_wkt_4_2_a_heart_rate_holding_only_the_recovery_says_the_session_was_not_sent(store):
    bug = store.corpus.workouts["bug"]
    answer = workout(store, "bug")
    heart = answer["heart_rate"]
    assert heart["state"] == "recovery_only" and heart["session"] == [] and not heart["zones"]
    assert [s[1] for s in heart["recovery"]] == [h["Avg"] for h in bug["heartRateData"]]
    assert any("was not sent" in note and "recovery" in note for note in answer["notes"])
    assert answer["workout"]["has_heart_rate"] is False
    v1 = workout(store, "v1_walk")["heart_rate"]  # version 1: qty samples, recovery apart
    assert v1["state"] == "sent" and len(v1["recovery"]) == 14


# -- WKT-5: splits ---------------------------------------------------------------------------


def split_rows(answer) -> list:
    return [(r["meters"], r["seconds"], r["pace_s"], r["average_heart_rate"])
            for r in answer["splits"]["rows"]]


def assert_rows(found, expected):
    assert len(found) == len(expected)
    for got, want in zip(found, expected):  # times to a few µs (instants in µs, as floats)
        assert got[:3] == pytest.approx(want[:3], rel=1e-9, abs=1e-5)
        assert (got[3] is None) == (want[3] is None)
        if want[3] is not None:
            assert got[3] == pytest.approx(want[3])


def test_wkt_5_1_splits_per_km_and_per_mile_from_the_route_and_from_a_distance_series(store):
    run = store.corpus.workouts["run"]
    points = wc.positions(run)
    session = wc.session_heart(run)
    answer = workout(store, "run")
    assert answer["splits"]["unit"] == {"label": "km", "meters": 1000.0}
    assert answer["splits"]["source"] == "route"
    expected = wc.splits(points, 1000.0, session, wc.seconds(run["start"]))
    assert len(expected) == 10
    assert_rows(split_rows(answer), expected)
    with connect(store) as conn:  # --distance-units mi: per mile
        miles = healthlog.get_workout(conn, run["id"], distance_units="mi")
    assert miles["splits"]["unit"]["label"] == "mi"
    assert_rows(split_rows(miles), wc.splits(points, 1609.344, session,
                                             wc.seconds(run["start"])))
    v1 = store.corpus.workouts["v1_run"]  # sent in miles: per mile
    assert_rows(split_rows(workout(store, "v1_run")), wc.splits(
        wc.positions(v1), 1609.344, wc.session_heart(v1), wc.seconds(v1["start"])))
    swim = store.corpus.workouts["swim"]  # no route: its distance series, per 100 m
    answer = workout(store, "swim")
    assert answer["splits"]["source"] == "distance series"
    rows = answer["splits"]["rows"]
    start = wc.seconds(swim["start"])
    assert len(rows) == 15  # 50 m a minute, reached at the next minute: 100 m every 120 s
    for k, row in enumerate(rows):
        inside = [h["Avg"] for h in swim["heartRateData"]
                  if start + 120 * k <= wc.seconds(h["date"]) < start + 120 * (k + 1)]
        assert (row["meters"], row["seconds"], row["pace_s"]) == (100.0, 120.0, 120.0)
        assert row["average_heart_rate"] == pytest.approx(sum(inside) / len(inside))


def test_wkt_5_2_the_elevation_profile_follows_the_route(store):
    run = store.corpus.workouts["run"]
    answer = workout(store, "run")
    profile = answer["elevation"]["profile"]
    altitudes = {p[2] for p in wc.positions(run)}
    assert len(profile) == len(answer["route"]["drawn"])
    assert all(p[1] in altitudes for p in profile)
    assert [p[0] for p in profile] == sorted(p[0] for p in profile)
    assert profile[-1][0] == pytest.approx(wc.route_meters(wc.positions(run)), rel=1e-9)
    assert workout(store, "swim")["elevation"] is None


# -- WKT-6: GPX ---------------------------------------------------------------------------------


def check_gpx(text: str, w: dict, activity: str) -> None:
    """The GPX against the body, point by point."""
    gpx = gpxpy.parse(io.StringIO(text))
    assert gpx.version == "1.1" and len(gpx.tracks) == 1
    [track] = gpx.tracks
    assert track.name == w["name"] and track.type == activity
    [segment] = track.segments
    points = wc.positions(w)
    session = wc.session_heart(w)
    assert len(segment.points) == len(points)
    hr_seen = 0
    for got, (lat, lon, alt, t) in zip(segment.points, points):
        assert (got.latitude, got.longitude, got.elevation) == (lat, lon, alt)
        assert got.time == dt.datetime.fromtimestamp(t, UTC)
        found = [e for ext in got.extensions for e in ext.iter() if e.tag.endswith("}hr")]
        bpm = wc.nearest_bpm(session, t)
        assert [int(e.text) for e in found] == ([] if bpm is None else [round(bpm)])
        hr_seen += bool(found)
    return hr_seen


def test_wkt_6_1_the_gpx_is_the_route_point_by_point_with_the_nearest_heart_rate(store):
    run = store.corpus.workouts["run"]
    reply = get(store.address, "/api/workouts/%s.gpx" % run["id"])
    assert reply.status == 200 and reply.headers.get_content_type() == "application/gpx+xml"
    disposition = reply.headers["Content-Disposition"]
    assert disposition == 'attachment; filename="2025-06-01-0700-running.gpx"'
    seen = check_gpx(reply.text, run, "running")
    start = wc.seconds(run["start"])
    in_gap = [t for *_, t in wc.positions(run) if 1200 < t - start < 1315]
    assert in_gap and seen == len(wc.positions(run)) - len(in_gap)  # none across the gap
    assert "gpxtpx:TrackPointExtension" in reply.text
    v1 = store.corpus.workouts["v1_run"]  # lat/lon of version 1; heart rate a minute apart
    reply = get(store.address, "/api/workouts/%s.gpx" % coordinate_id(v1))
    check_gpx(reply.text, v1, "running")
    ride = store.corpus.workouts["ride"]
    check_gpx(get(store.address, "/api/workouts/%s.gpx" % ride["id"]).text, ride, "cycling")


def test_wkt_6_2_export_gpx_of_one_workout_and_of_a_range_into_a_folder(store, tmp_path):
    run = store.corpus.workouts["run"]
    data = str(store.data_dir)
    one = run_export("--data", data, "--format", "gpx", "--workout", run["id"])
    assert one.returncode == 0, one.stderr
    assert one.stdout == get(store.address, "/api/workouts/%s.gpx" % run["id"]).body
    folder = tmp_path / "gpx"
    done = run_export("--data", data, "--format", "gpx", "--from", "2025-06-01",
                   "--to", "2025-06-08", "--out", str(folder))
    assert done.returncode == 0, done.stderr
    names = sorted(p.name for p in folder.iterdir())
    assert names == ["2025-06-01-0700-running.gpx", "2025-06-03-1800-cycling.gpx",
                     "2025-06-06-0800-walking.gpx", "2025-06-08-0630-running.gpx"]
    check_gpx((folder / names[1]).read_text(), store.corpus.workouts["ride"], "cycling")
    assert (folder / names[0]).read_bytes() == one.stdout
    again = run_export("--data", data, "--format", "gpx", "--from", "2025-06-01",
                    "--to", "2025-06-08", "--out", str(folder))
    assert again.returncode == 2 and again.stdout == b""
    assert len(again.stderr.decode().strip().splitlines()) == 1 and b"exists" in again.stderr
    for bad in (["--workout", "nope"], ["--workout", store.corpus.workouts["swim"]["id"]], []):
        refused = run_export("--data", data, "--format", "gpx", *bad)
        assert refused.returncode == 2 and refused.stdout == b"", bad
        assert len(refused.stderr.decode().strip().splitlines()) == 1


# -- WKT-7: the same workout from two sources ----------------------------------------------------


def test_wkt_7_1_a_workout_recorded_twice_is_shown_once_and_counted_once(store):
    sent = store.corpus.workouts
    answer, by_id = listed(store)
    run, again = by_id[sent["run"]["id"]], by_id[sent["again"]["id"]]
    assert run["duplicate_of"] is None and again["duplicate_of"] == run["id"]
    assert again["shown_first"]["id"] == run["id"]
    assert run["duplicates"] == [{"id": again["id"], "name": "Morning Run",
                                  "local_start": again["local_start"],
                                  "source": wc.OTHER_SOURCE}]
    for name in ("walk_over", "part_run"):  # another activity; too little overlap
        assert by_id[id_of(sent[name])]["duplicate_of"] is None
    counted = [w for name, w in sent.items() if name != "again"]
    assert answer["count"] == len(counted) == len(sent) - 1
    assert answer["seconds"] == pytest.approx(sum(sent_seconds(w) for w in counted))
    one = workout(store, "again")["workout"]  # its own page names the first
    assert one["duplicate_of"] == run["id"]
    summary = get_json(store.address, "/api/summary", date="2025-06-07", tz="local")
    items = {i["id"]: i for i in summary["cards"]["workouts"]}
    assert items[again["id"]]["duplicate_of"] == run["id"]
    # the summary's card of the 7 days to 06-07 counts them as the list does
    [card] = [g for g in summary["card_order"] if g["group"] == "workouts"]
    week = [w for w in counted if "2025-06-01" <= w["start"][:10] <= "2025-06-07"]
    assert (card["count"], card["seconds"]) == (len(week), pytest.approx(sum(
        sent_seconds(w) for w in week)))


def sent_seconds(w: dict) -> float:
    """A sent workout's time: version 2's duration, else its end minus its start."""
    return w["duration"] if "duration" in w else (written(w["end"]) - written(
        w["start"])).total_seconds()


def test_wkt_7_2_workout_time_per_day_and_per_week_counts_a_copy_once(store):
    """The page's chart of workout minutes is the list's ``buckets``: per local day of each
    workout's written start, or per week from its Monday, the workouts and their time, the
    run another app recorded too counted once."""
    sent = store.corpus.workouts
    for bucket in ("day", "week"):
        expected: dict = {}
        for name, w in sent.items():
            if name == "again":  # the copy of the run
                continue
            day = written(w["start"]).date()
            if bucket == "week":
                day -= dt.timedelta(days=day.weekday())
            slot = expected.setdefault(day.isoformat(), [0, 0.0])
            slot[0] += 1
            slot[1] += sent_seconds(w)
        answer = get_json(store.address, "/api/workouts", bucket=bucket, **RANGE)
        assert answer["bucket"] == bucket
        assert [(b["date"], b["count"], b["seconds"]) for b in answer["buckets"]] == [
            (day, count, pytest.approx(seconds)) for day, (count, seconds)
            in sorted(expected.items())]
        assert sum(b["count"] for b in answer["buckets"]) == answer["count"]
    assert "buckets" not in get_json(store.address, "/api/workouts", **RANGE)
    assert_error(get(store.address, "/api/workouts", bucket="hour", **RANGE), 400,
                 "bad_request")


# -- WKT-8: the SQLite export ----------------------------------------------------------------


def test_wkt_8_1_the_sqlite_export_has_workouts_and_their_routes(store, tmp_path):
    out = tmp_path / "out.db"
    done = run_export("--data", str(store.data_dir), "--format", "sqlite", str(out))
    assert done.returncode == 0, done.stderr
    db = sqlite3.connect(str(out))
    db.row_factory = sqlite3.Row
    rows = {r["id"]: dict(r) for r in db.execute("SELECT * FROM workouts")}
    sent = store.corpus.workouts
    assert set(rows) == {id_of(w) for w in sent.values()}
    run = rows[sent["run"]["id"]]
    body = sent["run"]
    assert (run["distance"], run["distance_units"], run["active_energy"],
            run["active_energy_units"], run["total_energy"]) == (
        body["distance"]["qty"], "km", body["activeEnergyBurned"]["qty"], "kJ",
        body["totalEnergy"]["qty"])
    assert run["local_start"] == written(body["start"]).isoformat()
    assert run["route_points"] == 3638 and run["elevation_gain"] == body["elevationUp"]["qty"]
    assert rows[sent["again"]["id"]]["duplicate_of"] == sent["run"]["id"]
    walk = rows[coordinate_id(sent["v1_walk"])]
    assert (walk["elevation_gain"], walk["elevation_units"], walk["version"]) == (
        sent["v1_walk"]["elevation"]["ascent"], "ft", 1)
    points = db.execute("SELECT latitude, longitude, altitude, time, heart_rate FROM"
                        " workout_route WHERE workout_id = ? ORDER BY seq",
                        (sent["run"]["id"],)).fetchall()
    session = wc.session_heart(sent["run"])
    assert [(p[0], p[1], p[2]) for p in points] == [p[:3] for p in wc.positions(sent["run"])]
    for p, (*_, t) in zip(points, wc.positions(sent["run"])):
        assert instant_us(p[3]) == t * 1_000_000 and p[4] == wc.nearest_bpm(session, t)
    total = db.execute("SELECT count(*) FROM workout_route").fetchone()[0]
    assert total == sum(len(w.get("route") or []) for w in sent.values())
    indexes = {r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type='index'")}
    assert {"workouts_id", "workout_route_workout"} <= indexes


# -- WKT-11: the settings ---------------------------------------------------------------------


@pytest.mark.parametrize("flag, value", [
    ("--map-tiles", "ftp://tiles.example.org/{z}/{x}/{y}.png"),
    ("--map-tiles", "https://{s}.tile.example.org/{z}/{x}/{y}.png"),
    ("--map-tiles", "https://tiles.example.org/{z}/{x}.png"),
    ("--map-tiles", "https://tiles.example.org/{z}/{x}/{y}.png?k=\"'"),
    ("--max-heart-rate", "300"), ("--max-heart-rate", "fast"),
    ("--distance-units", "yards")])
def test_wkt_11_1_settings_out_of_their_forms_stop_serve_with_one_line(flag, value, tmp_path,
                                                                       capsys):
    code = healthlog.main(["serve", "--data", str(tmp_path / "d"), "--token", TOKEN, flag,
                           value])
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1 and flag in err
    assert not (tmp_path / "d").exists()


def test_wkt_11_2_settings_come_from_flags_else_the_environment():
    parser = healthlog.build_parser()
    env = {"HEALTHLOG_MAP_TILES": "https://tiles.example.org/{z}/{x}/{y}.png",
           "HEALTHLOG_MAX_HEART_RATE": "185", "HEALTHLOG_DISTANCE_UNITS": "mi"}
    config = healthlog.build_config(parser.parse_args(["serve"]), env)
    assert (config.map_tiles, config.max_heart_rate, config.distance_units) == (
        env["HEALTHLOG_MAP_TILES"], 185.0, "mi")
    config = healthlog.build_config(parser.parse_args(
        ["serve", "--max-heart-rate", "192", "--distance-units", "km"]), env)
    assert (config.max_heart_rate, config.distance_units) == (192.0, "km")
    csp = dict(healthlog.security_headers(env["HEALTHLOG_MAP_TILES"]))["Content-Security-Policy"]
    assert "img-src 'self' data: https://tiles.example.org;" in csp
    assert urllib.parse.urlsplit(env["HEALTHLOG_MAP_TILES"]).hostname in csp
