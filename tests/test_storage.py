"""Storage over the real fold: points, coordinates, the merge rule and hourly objects.

Every test posts HAE-shaped bodies with HAE's automation headers to a real Cheroot server
on 127.0.0.1:0 (so the layer is decided by the header, as for the app), lets the real fold
thread fold them into a real SQLite file, and then reads the ``object`` and ``delivery``
tables. Blobs are decoded with gzip + json, independently of healthlog's own decoder.
Points carry hae_factory.CANARY_SOURCE (a device name) and distinctive values, so the
autouse leak check of conftest.py is meaningful for every record written.

Names carry the scenario IDs of openspec/specs/storage/spec.md: the seed's (STO-n.m, the
user's original requirements; see openspec/README.md) and the project's own (STORAGE-n.m).
"""

import datetime as dt
import gzip
import hashlib
import json
import random
import shutil
import sqlite3
import struct

import pytest

import hae_factory as hf
import healthlog
from conftest import Client, db_rows, wait_for, without_source

pytestmark = pytest.mark.usefixtures("json_mode")  # every test with and without orjson

SOURCE = hf.CANARY_SOURCE  # "Zebulon’s Apple Watch": must never reach a log record
OTHER_SOURCE = hf.PIPED_SOURCE
MINUTES = hf.Automation("Storage minutes", "Minutes", "Since Last Sync")
DAYS = hf.Automation("Storage sleep", "Days", "Previous 7 Days")
LAYER = "minutes"  # the layer MINUTES's header decides


# ---------------------------------------------------------------------------------------------
# Building bodies.

def at(hour: int, minute: int = 0, second: int = 0, day: int = 8) -> str:
    """HAE's timestamp of a wall-clock time on 2024-03-(day) in Pacific time (PST, -0800)."""
    return hf.hae_time(dt.datetime(2024, 3, day, hour, minute, second))


def utc_seconds(text: str) -> int:
    """An independent oracle for HAE's ``yyyy-MM-dd HH:mm:ss Z``."""
    return int(dt.datetime.strptime(text, "%Y-%m-%d %H:%M:%S %z").timestamp())


def utc_hour(text: str) -> int:
    return utc_seconds(text) // 3600


def point_at(when: str, source: str = SOURCE, **values) -> dict:
    """A metric point: ``date``, the values in the given order, then ``source``."""
    point = {"date": when}
    point.update(values)
    if source is not None:
        point["source"] = source
    return point


def minutes(name: str, units: str, hour: int, first: int, last: int, **kw) -> tuple:
    """A metric with one point per minute ``first..last`` of ``hour``: qty = 100 + minute."""
    return name, units, [point_at(at(hour, m), qty=100 + m + 0.25, **kw) for m in range(first,
                                                                                        last + 1)]


# ---------------------------------------------------------------------------------------------
# Posting and reading.

class ServedStore:
    """A running service and what it stored, read straight from its SQLite file."""

    def __init__(self, service: healthlog.Service, logs=None):
        self.service = service
        self.logs = logs
        self.data_dir = service.config.data_dir
        self.client = Client(*service.address)

    def post(self, data: bytes, automation: hf.Automation = MINUTES) -> int:
        status, answer = self.client.ingest(data, headers=hf.headers_for(automation))
        assert status == 200, answer
        return answer["delivery_id"]

    def fold(self, data: bytes, automation: hf.Automation = MINUTES) -> dict:
        """Post one body and wait until its delivery row has an outcome."""
        return self.folded(self.post(data, automation))

    def folded(self, delivery_id: int) -> dict:
        row = wait_for(lambda: self.delivery(delivery_id, done=True))
        if self.logs is not None:  # the fold logs after its commit: wait for its record
            wait_for(lambda: [r for r in self.logs.records() if r.get("delivery_id") ==
                              str(delivery_id) and r.get("msg") in (
                                  "delivery folded", "delivery failed to fold")])
        return row

    def delivery(self, delivery_id: int, done: bool = False) -> dict:
        rows = db_rows(self.data_dir, "SELECT * FROM delivery WHERE id = ?", (delivery_id,))
        if not rows or (done and rows[0]["parse_status"] == "pending"):
            return None
        return rows[0]

    def objects(self, metric: str = None) -> list:
        """Every object row (metric, if given), with ``decoded`` = the blob's points."""
        sql = "SELECT * FROM object"
        args = ()
        if metric is not None:
            sql += " WHERE metric = ?"
            args = (metric,)
        rows = db_rows(self.data_dir, sql + " ORDER BY metric, layer, hour", args)
        for row in rows:
            row["decoded"] = json.loads(gzip.decompress(row["blob"]))
            row["from"] = json.loads(row["point_deliveries"])
        return rows

    def object(self, metric: str, when: str, layer: str = LAYER) -> dict:
        found = [row for row in self.objects(metric)
                 if row["layer"] == layer and row["hour"] == utc_hour(when)]
        assert len(found) == 1, found
        return found[0]

    def sql(self, *statements: str) -> None:
        conn = sqlite3.connect(str(self.data_dir / "healthlog.sqlite3"), isolation_level=None)
        try:
            for statement in statements:
                conn.execute(statement)
        finally:
            conn.close()

    def count_object_writes(self) -> None:
        """From now on, every INSERT or UPDATE of an object row is counted."""
        self.sql("CREATE TABLE test_object_writes (n INTEGER NOT NULL)",
                 "INSERT INTO test_object_writes VALUES (0)",
                 "CREATE TRIGGER test_count_inserts AFTER INSERT ON object"
                 " BEGIN UPDATE test_object_writes SET n = n + 1; END",
                 "CREATE TRIGGER test_count_updates AFTER UPDATE ON object"
                 " BEGIN UPDATE test_object_writes SET n = n + 1; END")

    def object_writes(self) -> int:
        return db_rows(self.data_dir, "SELECT n FROM test_object_writes")[0]["n"]


@pytest.fixture
def store(service, logs) -> ServedStore:
    return ServedStore(service, logs)


def warnings(logs) -> list:
    return [r for r in logs.records() if r.get("level") in ("WARN", "ERROR")]


def assert_absent(logs, *values: str) -> None:
    """No record above DEBUG carries any of these strings (point values of the test)."""
    for line in logs.lines():
        if " level=DEBUG " in line:
            continue
        for value in values:
            assert value not in line, "log record carries %r: %s" % (value, line)


def only_point(row: dict) -> dict:
    assert row["points"] == len(row["decoded"]) == 1, row["decoded"]
    return row["decoded"][0]


def canonical_hash(points: list) -> str:
    """SHA-256 of the storage spec's canonical form, computed independently of healthlog."""
    text = json.dumps(without_source(points), sort_keys=True, ensure_ascii=False,
                      separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


# =============================================================================================
# STO-1: a point's identity is its coordinates metric + layer + start + end.
# =============================================================================================


def test_sto_1_1_the_same_point_again_changes_nothing(store, logs):
    metric = minutes("step_count", "count", 10, 0, 2)
    first = store.fold(hf.body(metric))
    before = store.objects()
    store.count_object_writes()
    again = store.fold(hf.body(metric, pretty=False))  # other bytes, the same points
    assert (again["parse_status"], again["error"]) == ("parsed", None)  # a real fold
    assert again["objects_written"] == again["overwrites"] == again["incomparable"] == 0
    assert store.objects() == before  # hash, blob bytes, point_deliveries, updated_by
    assert store.object_writes() == 0
    assert before[0]["from"] == [first["id"]] * 3
    assert warnings(logs) == []


def test_sto_1_2_a_change_of_source_does_not_create_a_second_point(store, logs):
    first = store.fold(hf.body(minutes("step_count", "count", 10, 0, 2)))
    before = store.objects()
    # The same points re-attributed by Health: another source string, or none at all.
    renamed = [point_at(at(10, m), qty=100 + m + 0.25, source=OTHER_SOURCE if m else None)
               for m in range(3)]
    again = store.fold(hf.body(("step_count", "count", renamed)))
    assert again["objects_written"] == again["overwrites"] == 0
    [row] = store.objects()
    assert row == before[0]  # the stored bytes keep the old source, provenance stays
    assert [p["source"] for p in row["decoded"]] == [SOURCE] * 3
    assert row["from"] == [first["id"]] * 3
    # Within one delivery, two copies differing only in source are one point too.
    twins = [point_at(at(11, 0), qty=7.5, source=SOURCE), point_at(at(11, 0), qty=7.5,
                                                                   source=OTHER_SOURCE)]
    third = store.fold(hf.body(("step_count", "count", twins)))
    assert third["points"] == 2 and third["incomparable"] == 0
    only_point(store.object("step_count", at(11)))
    assert warnings(logs) == []


def test_sto_1_3_sleep_records_with_one_date_and_different_intervals_stay_apart(store):
    rows = hf.sleep_segments(3, hf.DEFAULT_DAY, phone=hf.Phone(sources=SOURCE))
    assert len(rows) > 5 and len({r["date"] for r in rows}) == 1  # one date for the night
    delivery = store.fold(hf.body(("sleep_analysis", "hr", rows)), DAYS)
    assert delivery["parse_status"] == "parsed" and delivery["incomparable"] == 0
    objects = store.objects("sleep_analysis")
    assert {o["layer"] for o in objects} == {"record"}  # sleep is a record, whatever the header
    stored = [p for o in objects for p in o["decoded"]]
    assert sum(o["points"] for o in objects) == len(stored) == len(rows)
    assert sorted((p["start"], p["end"]) for p in stored) == \
        sorted((r["start"], r["end"]) for r in rows)
    for o in objects:  # each in the object of its start's UTC hour
        assert {utc_hour(p["start"]) for p in o["decoded"]} == {o["hour"]}


def test_sto_1_4_a_record_repeated_in_the_next_delivery_is_not_duplicated(store):
    phone = hf.Phone(sources=SOURCE)
    workout = hf.workout_v2(1, dt.datetime(2024, 3, 8, 18), phone=phone, route_points=5)
    segments = hf.sleep_segments(1, hf.DEFAULT_DAY, phone=phone)
    store.fold(hf.body(("sleep_analysis", "hr", segments), workouts=[workout]), DAYS)
    count = {o["metric"]: o["points"] for o in store.objects()}
    # The next delivery repeats them: re-serialised, and the workout recounted.
    recounted = json.loads(json.dumps(workout))
    recounted["intensity"]["qty"] = 9.875
    again = hf.resend(hf.body(("sleep_analysis", "hr", segments), workouts=[recounted]),
                      random.Random(4))
    second = store.fold(again, DAYS)
    assert second["parse_status"] == "parsed"
    assert {o["metric"]: o["points"] for o in store.objects()} == count
    [row] = store.objects("workouts")
    assert only_point(row)["intensity"]["qty"] == 9.875 and row["from"] == [second["id"]]


def test_sto_1_5_a_point_without_end_is_the_degenerate_interval(store):
    store.fold(hf.body(("step_count", "count", [point_at(at(10, 5), qty=5.5)])))
    # end == start written out is the same coordinate; another end is another point.
    later = [point_at(at(10, 5), qty=5.5, end=at(10, 5)), point_at(at(10, 5), qty=8.5, end=at(10,
                                                                                              9))]
    store.fold(hf.body(("step_count", "count", later)))
    row = store.object("step_count", at(10))
    spans = sorted((p["date"], p.get("end", p["date"])) for p in row["decoded"])
    assert spans == [(at(10, 5), at(10, 5)), (at(10, 5), at(10, 9))]
    assert row["points"] == 2


def test_storage_1_1_record_sections_become_metrics_in_the_record_layer(store):
    phone = hf.Phone(sources=SOURCE)
    sections = hf.records_sections(2, hf.DEFAULT_DAY, hf.DEFAULT_DAY + dt.timedelta(days=40),
                                   phone=phone, ecg_samples=12)
    sections["workouts"] = [hf.workout_v2(2, dt.datetime(2024, 3, 9, 7), phone=phone,
                                          route_points=3)]
    assert all(sections[key] for key in ("stateOfMind", "medications", "symptoms",
                                         "cycleTracking", "ecg", "workouts"))
    delivery = store.fold(hf.body(minutes("step_count", "count", 10, 0, 1), **sections))
    assert delivery["parse_status"] == "parsed" and delivery["layer"] == LAYER
    names = {"stateOfMind": lambda e: "state_of_mind", "ecg": lambda e: "ecg",
             "heartRateNotifications": lambda e: "heart_rate_notifications",
             "workouts": lambda e: "workouts",
             "symptoms": lambda e: "symptoms/" + e["name"],
             "cycleTracking": lambda e: "cycle_tracking/" + e["name"],
             "medications": lambda e: "medications/" + (e.get("displayText") or e["nickname"])}
    stored = {}
    for row in store.objects():
        stored.setdefault((row["metric"], row["layer"]), []).extend(row["decoded"])
    assert {layer for (metric, layer) in stored if metric != "step_count"} == {"record"}
    assert len(stored[("step_count", LAYER)]) == 2
    for key, name_of in names.items():
        for element in sections[key]:
            assert element in stored[(name_of(element), "record")], (key, element.get("name"))


def test_storage_1_2_points_without_a_readable_time_are_counted_not_dropped(store, logs):
    points = [point_at(at(10, 0), qty=3.5), point_at("yesterday-ish", qty=72.123456789),
              "CANARY-BODY-TEXT",
              point_at(at(10, 1), qty=4.5)]
    delivery = store.fold(hf.body(("step_count", "count", points)))
    assert delivery["parse_status"] == "parsed"
    assert (delivery["points"], delivery["bad_points"]) == (2, 2)
    assert store.object("step_count", at(10))["points"] == 2
    [record] = logs.find("points without a readable time", level="WARN")
    assert record["bad_points"] == "2" and "step_count" in record["metrics"]
    assert record["delivery_id"] == str(delivery["id"])


# =============================================================================================
# STO-2: collisions are resolved by completeness, then by journal position.
# =============================================================================================


def test_sto_2_1_a_poor_point_does_not_erase_a_rich_ones_fields(store):
    def rich(when):
        return point_at(when, Min=52, Avg=61.5, Max=88, context="Sedentary")

    def poor(when):
        return point_at(when, Min=52, Avg=61.5, Max=88, source=OTHER_SOURCE)

    first = store.fold(hf.body(("heart_rate", "count/min", [rich(at(10, 0)), poor(at(11, 0))])))
    second = store.fold(hf.body(("heart_rate", "count/min", [poor(at(10, 0)), rich(at(11, 0))])))
    for hour in (10, 11):
        assert only_point(store.object("heart_rate", at(hour)))["context"] == "Sedentary"
    assert store.object("heart_rate", at(10))["from"] == [first["id"]]  # untouched
    assert store.object("heart_rate", at(11))["from"] == [second["id"]]  # enriched
    assert second["objects_written"] == 1


def test_sto_2_2_fields_without_content_add_no_completeness(store):
    empty_five = point_at(at(10, 0), qty=hf.RawNumber("0e0"), Avg=hf.RawNumber("-0"), Min={},
                          Max=[])
    real = point_at(at(10, 0), qty=12.5)
    store.fold(hf.body(("step_count", "count", [empty_five])))
    store.fold(hf.body(("step_count", "count", [real])))
    assert only_point(store.object("step_count", at(10))) == real
    # The other order: the content-free point arriving later does not win either.
    store.fold(hf.body(("step_count", "count", [point_at(at(11, 0), qty=12.5)])))
    store.fold(hf.body(("step_count", "count", [dict(empty_five, date=at(11, 0))])))
    assert only_point(store.object("step_count", at(11))) == point_at(at(11, 0), qty=12.5)


def test_sto_2_3_with_equal_content_no_fields_are_lost(store):
    kept = point_at(at(10, 0), qty=10.5, Min=0, Max=0)
    first = store.fold(hf.body(("step_count", "count", [kept])))
    second = store.fold(hf.body(("step_count", "count", [point_at(at(10, 0), qty=11.5)])))
    row = store.object("step_count", at(10))
    assert only_point(row) == kept and row["from"] == [first["id"]]
    assert second["objects_written"] == second["overwrites"] == 0


def test_sto_2_4_equally_complete_points_later_in_journal_wins_in_any_fold_order(
        start_service, tmp_path):
    service = start_service(paused=True)
    store = ServedStore(service)
    older = store.post(hf.body(("step_count", "count", [point_at(at(10, 0), qty=10.5)])))
    newer = store.post(hf.body(("step_count", "count", [point_at(at(10, 0), qty=11.5)])))
    service.stop()  # neither was folded: both are pending in the journal
    results = []
    for order in ((older, newer), (newer, older)):
        copy = tmp_path / ("copy-%d-%d" % order)
        shutil.copytree(str(service.config.data_dir), str(copy))
        conn = healthlog.connect(copy / healthlog.DB_NAME)
        try:
            engine = healthlog.FoldEngine(conn, healthlog.Config(data_dir=copy))
            assert [engine.fold(i).status for i in order] == ["parsed", "parsed"]
            # Every column but delivery_id: which delivery created the object is an
            # event of that fold order, not content.
            results.append((db_rows(copy, "SELECT metric, layer, hour, units, first_at,"
                                          " last_at, points, updated_by, hash, sealed, blob,"
                                          " point_deliveries FROM object"),
                            healthlog.fingerprint(conn)))
        finally:
            conn.close()
    (in_order, print_in_order), (reversed_order, print_reversed) = results
    assert in_order == reversed_order and print_in_order == print_reversed
    [row] = in_order
    assert json.loads(gzip.decompress(row["blob"]))[0]["qty"] == 11.5
    assert json.loads(row["point_deliveries"]) == [newer]


def test_sto_2_4_within_one_delivery_the_array_order_does_not_matter(store):
    a, b = dict(qty=10.5, Min=1.5), dict(qty=11.5, Min=1.5)
    store.fold(hf.body(("step_count", "count", [point_at(at(10, 0), **a), point_at(at(10, 0),
                                                                                   **b)])))
    store.fold(hf.body(("step_count", "count", [point_at(at(11, 0), **b), point_at(at(11, 0),
                                                                                   **a)])))
    first = only_point(store.object("step_count", at(10)))
    second = only_point(store.object("step_count", at(11)))
    assert dict(first, date=None) == dict(second, date=None)


def test_sto_2_5_incomparable_sets_across_deliveries_are_counted_not_merged(store, logs):
    with_min = point_at(at(10, 0), Avg=72.123456789, Min=31.2468013579)
    with_max = point_at(at(10, 0), Avg=72.123456789, Max=97.8642097531)
    store.fold(hf.body(("heart_rate", "count/min", [with_min])))
    second = store.fold(hf.body(("heart_rate", "count/min", [with_max])))
    row = store.object("heart_rate", at(10))
    assert only_point(row) == with_max  # the later one wins, unmerged
    assert (second["incomparable"], second["overwrites"]) == (1, 1)
    [record] = warnings(logs)
    assert (record["metric"], record["layer"], record["hour"]) == \
        ("heart_rate", LAYER, str(utc_hour(at(10))))
    assert record["incomparable"] == "1" and record["delivery_id"] == str(second["id"])
    assert_absent(logs, "31.2468013579", "97.8642097531")


def test_sto_2_5_incomparable_sets_within_one_delivery_one_point_chosen_deterministically(store):
    x, y = dict(Avg=72.123456789, Min=31.2468013579), dict(Avg=72.123456789, Max=97.8642097531)
    first = store.fold(hf.body(("heart_rate", "count/min", [point_at(at(10, 0), **x),
                                                         point_at(at(10, 0), **y)])))
    second = store.fold(hf.body(("heart_rate", "count/min", [point_at(at(11, 0), **y),
                                                          point_at(at(11, 0), **x)])))
    assert first["incomparable"] == second["incomparable"] == 1
    one = only_point(store.object("heart_rate", at(10)))
    other = only_point(store.object("heart_rate", at(11)))
    assert dict(one, date=None) == dict(other, date=None) and ("Min" in one) != ("Max" in one)


def test_sto_2_5_incomparable_sets_within_one_delivery_are_named_in_a_warn(store, logs):
    delivery = store.fold(hf.body(("heart_rate", "count/min",
                                [point_at(at(10, 0), Avg=72.123456789, Min=31.2468013579),
                                 point_at(at(10, 0), Avg=72.123456789, Max=97.8642097531)])))
    assert delivery["incomparable"] == 1
    found = [r for r in warnings(logs) if r.get("metric") == "heart_rate"]
    assert found and found[0]["layer"] == LAYER and found[0]["hour"] == str(utc_hour(at(10)))


def test_sto_2_6_content_that_is_not_an_object_never_beats_a_point_with_fields(store, logs):
    store.fold(hf.body(("step_count", "count", [point_at(at(10, 0), qty=5.5)])))
    before = store.objects()
    junk = ["CANARY-BODY-TEXT", 72.123456789, None, [at(10, 0), 5.5], True]
    second = store.fold(hf.body(("step_count", "count", junk),
                                ("active_energy", "kcal", [point_at(at(10, 0), qty=1.5)])))
    assert second["parse_status"] == "parsed"
    assert (second["bad_points"], second["incomparable"], second["overwrites"]) == (5, 0, 0)
    assert store.objects("step_count") == before
    # Within one delivery: the point with fields is stored, nothing counts as incomparable.
    third = store.fold(hf.body(("step_count", "count", ["CANARY-BODY-TEXT", point_at(at(11, 0),
                                                                                     qty=6.5),
                                                      {}])))
    assert (third["bad_points"], third["incomparable"]) == (2, 0)
    assert only_point(store.object("step_count", at(11))) == point_at(at(11, 0), qty=6.5)


def test_sto_2_7_a_collision_leaves_a_warn_with_coordinates_and_a_count(store, logs):
    first = store.fold(hf.body(minutes("step_count", "count", 10, 0, 4)))
    changed = [point_at(at(10, m), qty=72.123456789 + m) for m in (1, 2, 3)]
    second = store.fold(hf.body(("step_count", "count", changed)))
    assert second["overwrites"] == 3 and second["objects_written"] == 1
    row = store.object("step_count", at(10))
    assert [p["qty"] for p in row["decoded"]] == [100.25, 72.123456789 + 1, 72.123456789 + 2,
                                                  72.123456789 + 3, 104.25]
    assert row["from"] == [first["id"]] + [second["id"]] * 3 + [first["id"]]
    assert row["updated_by"] == second["id"]
    [record] = logs.find("collision", level="WARN")  # one per object, with the count
    assert (record["metric"], record["layer"], record["hour"], record["overwrites"]) == \
        ("step_count", LAYER, str(utc_hour(at(10))), "3")
    assert record["hour_utc"].startswith("2024-03-08T18:00:00")
    assert_absent(logs, "101.25", "102.25", "103.25", "73.12345")


def test_sto_2_8_serialisation_jitter_is_not_a_collision(store, logs):
    payload = hf.metrics_payload(5, ("step_count", "heart_rate", "active_energy"),
                                 dt.datetime(2024, 3, 8, 8), dt.datetime(2024, 3, 8, 11),
                                 phone=hf.Phone(sources=SOURCE))
    original = hf.dumps_hae(payload)
    store.fold(original)
    before = store.objects()
    jittered = hf.resend(original, random.Random(8))
    assert jittered != original and json.loads(jittered) != json.loads(original)
    second = store.fold(jittered)
    assert second["error"] is None and second["points"] > 100
    assert second["overwrites"] == second["objects_written"] == second["incomparable"] == 0
    assert store.objects() == before
    # HAE's own example: 61.999999999999993 then 61.99999999999999, keys in another order.
    store.fold(hf.body(("heart_rate", "count/min",
                     [{"Avg": hf.RawNumber("61.999999999999993"), "date": at(12, 0),
                       "source": SOURCE}])))
    third = store.fold(hf.body(("heart_rate", "count/min",
                             [{"date": at(12, 0), "source": OTHER_SOURCE,
                               "Avg": hf.RawNumber("61.99999999999999")}])))
    assert third["overwrites"] == third["objects_written"] == 0
    assert list(only_point(store.object("heart_rate", at(12)))) == ["Avg", "date", "source"]
    assert warnings(logs) == []


# =============================================================================================
# STO-3: hourly objects.
# =============================================================================================


def test_sto_3_1_a_failure_mid_delivery_leaves_no_object_of_it(store, logs):
    store.fold(hf.body(minutes("step_count", "count", 10, 0, 2)))
    before = store.objects()
    # The apply fails on the last object of the delivery, after the others were written
    # inside its transaction.
    store.sql("CREATE TRIGGER test_refuse BEFORE INSERT ON object WHEN NEW.metric ="
              " 'walking_speed' BEGIN SELECT RAISE(ABORT, 'refused by the test'); END")
    failing = store.fold(hf.body(minutes("step_count", "count", 10, 3, 5),
                                 minutes("step_count", "count", 11, 0, 1),
                                 minutes("active_energy", "kcal", 10, 0, 2),
                                 minutes("walking_speed", "km/hr", 10, 0, 2)))
    assert failing["parse_status"] == "failed"
    assert failing["error"] == "unexpected:IntegrityError"
    assert store.objects() == before
    assert db_rows(store.data_dir, "SELECT count(*) AS n FROM object WHERE delivery_id = ?"
                   " OR updated_by = ?", (failing["id"], failing["id"]))[0]["n"] == 0
    [record] = logs.find("delivery failed to fold", level="WARN")
    assert record["delivery_id"] == str(failing["id"])


def test_sto_3_2_a_change_of_units_does_not_relabel_stored_points(store, logs):
    store.fold(hf.body(minutes("active_energy", "kcal", 10, 0, 1)))
    second = store.fold(hf.body(("active_energy", "kJ", [point_at(at(10, 2), qty=42.987654321)])))
    row = store.object("active_energy", at(10))
    assert row["units"] == "kcal"
    # The kJ value is not stored under kcal: it stays in the archive, the object is as it was.
    assert row["points"] == 2 and 42.987654321 not in [p["qty"] for p in row["decoded"]]
    assert second["unit_conflicts"] == 1 and second["objects_written"] == 0
    [record] = logs.find("units differ", level="WARN")
    assert (record["metric"], record["layer"], record["hour"]) == \
        ("active_energy", LAYER, str(utc_hour(at(10))))
    assert (record["stored_units"], record["arriving_units"]) == ("kcal", "kJ")
    assert_absent(logs, "42.987654321")


def test_sto_3_3_points_of_one_hour_go_into_one_object(store):
    points = [point_at(at(10, m), qty=100 + m + 0.25) for m in range(60)]
    random.Random(3).shuffle(points)
    points += [point_at(at(9, 59), qty=1.5), point_at(at(11, 0), qty=2.5)]
    delivery = store.fold(hf.body(("step_count", "count", points)))
    assert delivery["objects_written"] == 3
    assert [o["hour"] for o in store.objects()] == [utc_hour(at(h)) for h in (9, 10, 11)]
    row = store.object("step_count", at(10))
    assert row["hour"] == utc_seconds("2024-03-08 18:00:00 +0000") // 3600
    assert (row["metric"], row["layer"], row["units"], row["sealed"]) == \
        ("step_count", LAYER, "count", 0)
    assert (row["first_at"], row["last_at"]) == (utc_seconds(at(10, 0)), utc_seconds(at(10, 59)))
    assert row["points"] == 60
    assert [p["date"] for p in row["decoded"]] == [at(10, m) for m in range(60)]  # time order
    assert row["delivery_id"] == row["updated_by"] == delivery["id"]
    assert row["from"] == [delivery["id"]] * 60
    assert row["hash"] == canonical_hash(row["decoded"])


def test_sto_3_4_adding_to_an_existing_hour_keeps_its_points(store):
    even = [point_at(at(10, m), qty=m + 0.5) for m in range(0, 60, 2)]
    odd = [point_at(at(10, m), qty=m + 0.5, source=OTHER_SOURCE) for m in range(1, 60, 2)]
    first = store.fold(hf.body(("step_count", "count", even)))
    second = store.fold(hf.body(("step_count", "count", odd + even[:3])))
    row = store.object("step_count", at(10))
    assert row["decoded"] == [p for pair in zip(even, odd) for p in pair]  # merged, in order
    assert row["from"] == [first["id"], second["id"]] * 30
    assert (row["delivery_id"], row["updated_by"]) == (first["id"], second["id"])
    assert (row["first_at"], row["last_at"]) == (utc_seconds(at(10, 0)), utc_seconds(at(10, 59)))
    # A later delivery with one point of the hour removes none of the others.
    store.fold(hf.body(("step_count", "count", [point_at(at(10, 7), qty=99.5)])))
    row = store.object("step_count", at(10))
    assert row["points"] == 60 and row["decoded"][7]["qty"] == 99.5


def test_storage_3_2_each_object_carries_the_tally_of_its_points(store):
    points = [point_at(at(10, m), qty=100 + m + 0.25) for m in range(5)]
    points[2]["flag"] = True  # a boolean is no number
    points[3]["Min"] = 4
    store.fold(hf.body(("step_count", "count", points)))
    more = [point_at(at(10, 7), qty=-3.5)]
    store.fold(hf.body(("step_count", "count", more)))  # the object is written again
    row = store.object("step_count", at(10))
    stored = row["decoded"]
    qty = [p["qty"] for p in stored]
    offsets = sorted({-8 * 3600 if p["date"].endswith("-0800") else None for p in stored})
    assert offsets == [-8 * 3600]  # what the points were written in: Pacific standard time
    keys = []  # every key of the stored points, in the order they are first met
    for point in stored:
        keys += [key for key in point if key not in keys]
    assert "flag" in keys and "Min" in keys
    assert json.loads(row["summary"]) == {
        "n": len(stored), "f": {"qty": [len(qty), min(qty), max(qty), sum(qty)],
                                "Min": [1, 4, 4, 4]}, "o": offsets, "k": keys}


def test_storage_3_3_a_version_1_database_is_upgraded_in_place(data_dir, start_service):
    healthlog.ensure_data_dir(data_dir)
    conn = sqlite3.connect(str(data_dir / healthlog.DB_NAME))
    for statement in healthlog.schema_statements():
        if "_summary ON" in statement:
            continue  # version 5's index of the summaries
        conn.execute(statement.replace("    summary          TEXT,\n", "")
                     .replace("    spans            BLOB,\n", "")
                     .replace(",\n    attempts               INTEGER NOT NULL DEFAULT 0", ""))
    conn.execute("INSERT INTO object (metric, layer, hour, units, first_at, last_at, points,"
                 " delivery_id, updated_by, hash, sealed, blob, point_deliveries) VALUES"
                 " ('step_count', 'minutes', 474000, 'count', 1706400000, 1706400000, 1, 1, 1,"
                 " 'h', 0, ?, '[1]')",
                 (gzip.compress(b'[{"date":"2024-01-28 00:00:00 +0000","qty":5}]'),))
    conn.execute("PRAGMA user_version = 1")
    conn.commit()
    assert "summary" not in [c[1] for c in conn.execute("PRAGMA table_info(object)")]
    assert "attempts" not in [c[1] for c in conn.execute("PRAGMA table_info(delivery)")]
    conn.close()

    service = start_service()

    assert db_rows(data_dir, "PRAGMA user_version")[0]["user_version"] == healthlog.SCHEMA_VERSION
    assert "attempts" in [r["name"] for r in db_rows(data_dir, "PRAGMA table_info(delivery)")]
    names = [r["name"] for r in db_rows(data_dir, "SELECT name FROM sqlite_master")]
    assert "session" in names and "object_summary" in names
    [row] = db_rows(data_dir, "SELECT metric, summary, spans FROM object")
    assert row == {"metric": "step_count", "summary": None, "spans": None}  # computed when read
    reply = Client(*service.address).request(
        "GET", "/api/points?metric=step_count&bucket=day")[1]
    assert reply["runs"][0]["buckets"] == [{"start": "2024-01-28T00:00:00Z",
                                            "local": "2024-01-28T00:00:00+00:00",
                                            "date": "2024-01-28", "units": "count",
                                            "count": 1,
                                            "fields": {"qty": {"count": 1, "min": 5, "max": 5,
                                                               "avg": 5.0, "sum": 5}}}]


def test_storage_3_1_points_are_stored_verbatim(store):
    point = {"qty": hf.RawNumber("61.999999999999993"), "date": at(10, 0),
             "context": "AT&T <b>run</b> – Zebulon’s", "Min": hf.RawNumber("1E-7"),
             "Max": hf.RawNumber("12.50"), "isIndoor": False, "source": SOURCE}
    store.fold(hf.body(("heart_rate", "count/min", [point])))
    row = store.object("heart_rate", at(10))
    raw = gzip.decompress(row["blob"])
    assert "AT&T <b>run</b> – Zebulon’s".encode("utf-8") in raw  # no HTML or \u escaping
    assert SOURCE.encode("utf-8") in raw
    [stored] = json.loads(raw)
    assert list(stored) == list(point)  # the arrived keys, in their order
    assert stored["qty"] == 61.999999999999993 and stored["Min"] == 1e-7  # the same doubles
    assert stored["Max"] == 12.5 and stored["isIndoor"] is False


# =============================================================================================
# STO-4: the hash detects changes.
# =============================================================================================


def test_sto_4_1_re_sending_the_same_hours_does_not_write(store, logs):
    payload = hf.metrics_payload(6, ("step_count", "heart_rate"), dt.datetime(2024, 3, 8, 9),
                                 dt.datetime(2024, 3, 8, 12), phone=hf.Phone(sources=SOURCE))
    original = hf.dumps_hae(payload)
    first = store.fold(original)
    before = store.objects()
    store.count_object_writes()
    resent = store.fold(hf.resend(original, random.Random(1)))
    assert resent["error"] is None and resent["points"] == first["points"]
    assert resent["objects_written"] == 0
    assert store.object_writes() == 0 and store.objects() == before
    # A byte-identical re-post of the same automation folds as a no-op naming the first.
    repeat = store.fold(original)
    assert repeat["parse_status"] == first["parse_status"] == "parsed"
    assert repeat["error"] == "duplicate of delivery %d" % first["id"]
    assert repeat["objects_written"] == repeat["overwrites"] == 0
    assert store.object_writes() == 0 and store.objects() == before
    assert warnings(logs) == []


def test_storage_4_1_the_hash_is_of_the_canonical_form_only(store):
    plain = [point_at(at(10, m), qty=m + 0.5) for m in range(5)]
    reworded = [{"qty": m + 0.5, "date": at(10, m), "source": OTHER_SOURCE} for m in range(5)]
    store.fold(hf.body(("step_count", "count", plain), ("step_count_copy", "count", reworded)))
    one, other = store.object("step_count", at(10)), store.object("step_count_copy", at(10))
    assert one["blob"] != other["blob"]
    assert one["hash"] == other["hash"] == canonical_hash(plain)
    assert one["hash"] == healthlog.object_hash(one["decoded"])


# =============================================================================================
# STO-5: the sealed-hour flag.
# =============================================================================================


def test_sto_5_1_a_change_to_a_sealed_hour_is_signalled_and_stored(store, logs):
    original = hf.body(minutes("step_count", "count", 10, 0, 2))
    store.fold(original)
    store.sql("UPDATE object SET sealed = 1")
    same = store.fold(hf.resend(original, random.Random(2)))  # no change: no signal
    assert same["sealed_changes"] == 0 and warnings(logs) == []
    changed = store.fold(hf.body(("step_count", "count", [point_at(at(10, 3), qty=3.14159265358)])))
    assert changed["parse_status"] == "parsed" and changed["sealed_changes"] == 1
    row = store.object("step_count", at(10))
    assert row["points"] == 4 and row["sealed"] == 1  # stored anyway, still sealed
    [record] = logs.find("sealed hour", level="WARN")
    assert (record["metric"], record["layer"], record["hour"]) == \
        ("step_count", LAYER, str(utc_hour(at(10))))
    assert_absent(logs, "3.14159265358")


def test_storage_5_1_no_rule_seals_an_hour(store):
    store.fold(hf.body(minutes("step_count", "count", 10, 0, 2)))
    store.fold(hf.body(minutes("step_count", "count", 10, 1, 5), minutes("step_count", "count",
                                                                     3, 0, 1)))
    rows = store.objects()
    assert rows and all(row["sealed"] == 0 for row in rows)


# =============================================================================================
# STO-6: point values stay out of the logs.
# =============================================================================================


def test_sto_6_1_a_folded_delivery_is_logged_with_counters_and_id_only(store, logs):
    delivery = store.fold(hf.dumps_hae(hf.canary_payload(1)))
    assert delivery["parse_status"] == "parsed" and delivery["objects_written"] > 0
    [record] = logs.find("delivery folded", level="INFO")
    assert record["delivery_id"] == str(delivery["id"])
    for counter in ("metrics", "points", "objects_written"):
        assert record[counter] == str(delivery[counter]), counter
    line = [text for text in logs.lines() if 'msg="delivery folded"' in text][0]
    for name in hf.CANARY_STRINGS + (hf.OWNER_WATCH, "Anton", "Zebulon"):
        assert name not in line
    assert_absent(logs, *hf.CANARY_STRINGS)


def test_sto_6_2_uncovered_sections_are_named_by_key_in_a_field_at_info(store, logs):
    forged = 'evil\nlevel=ERROR msg="forged"'
    data = hf.body(minutes("step_count", "count", 10, 0, 1),
                   mysteryReadings=[{"date": at(10, 0), "value": "CANARY-BODY-TEXT"}],
                   **{forged: {"zqHiddenKey": "CANARY-BODY-TEXT"}})
    delivery = store.fold(data)
    assert delivery["parse_status"] == "partial"
    [record] = logs.find("delivery folded")
    assert record["level"] == "INFO"
    assert sorted(json.loads(record["uncovered"])) == sorted(["mysteryReadings", forged])
    assert warnings(logs) == []  # partiality alone raises nothing
    assert all(line.startswith("time=") for line in logs.lines())  # no forged line
    assert_absent(logs, "CANARY-BODY-TEXT", "zqHiddenKey")


def test_sto_6_3_the_uncovered_list_hitting_its_bounds_is_a_warn_with_the_count(store, logs):
    many = {"unknown%02d" % i: [] for i in range(40)}
    first = store.fold(hf.body(minutes("step_count", "count", 10, 0, 1), **many))
    assert first["parse_status"] == "partial"
    assert len(json.loads(first["uncovered_keys"])) == healthlog.UNCOVERED_MAX_NAMES == 32
    [record] = logs.find("uncovered keys hit its bounds", level="WARN")
    assert (record["delivery_id"], record["dropped"]) == (str(first["id"]), "8")
    long_name = "x" * 100
    second = store.fold(hf.body(minutes("step_count", "count", 11, 0, 1), **{long_name: []}))
    [kept] = json.loads(second["uncovered_keys"])
    assert len(kept) <= healthlog.UNCOVERED_MAX_LENGTH + 1 and kept.startswith("x" * 64)
    records = logs.find("uncovered keys hit its bounds", level="WARN")
    assert len(records) == 2 and records[1]["cut"] == "1" and records[1]["dropped"] == "0"


# =============================================================================================
# STO-7: accounting for a partly parsed delivery.
# =============================================================================================


def test_sto_7_1_a_delivery_with_an_uncovered_section_is_partial(store):
    delivery = store.fold(hf.body(minutes("step_count", "count", 10, 0, 2),
                                  mysteryReadings=[{"date": at(10, 0), "value": 1.5}],
                                  stateOfMind=[]))
    assert delivery["parse_status"] == "partial"
    assert json.loads(delivery["uncovered_keys"]) == ["mysteryReadings"]
    assert store.object("step_count", at(10))["points"] == 3  # covered points stored as usual
    assert delivery["objects_written"] == 1


def test_sto_7_2_a_delivery_without_uncovered_sections_is_parsed(store):
    delivery = store.fold(hf.body(minutes("step_count", "count", 10, 0, 2), workouts=[],
                                  stateOfMind=[]))
    assert delivery["parse_status"] == "parsed"
    assert delivery["uncovered_keys"] == "[]"


def test_sto_7_3_a_parse_failure_outranks_partiality_and_keeps_the_list(store):
    # The layer cannot be decided: no valid header, too few points to infer, no history.
    no_header = hf.Automation("Storage unknown layer", "bogus", "Today")
    failed = store.fold(hf.body(minutes("step_count", "count", 10, 0, 0),
                                mysteryReadings=[{"x": 1}]), no_header)
    assert failed["parse_status"] == "failed" and failed["error"] == "layer_not_inferable"
    assert json.loads(failed["uncovered_keys"]) == ["mysteryReadings"]
    # Nothing in the body could be placed.
    unplaceable = store.fold(hf.body(("step_count", "count", [point_at("not a time", qty=1.5),
                                                              "x"]),
                                     mysteryReadings=[]))
    assert unplaceable["parse_status"] == "failed"
    assert json.loads(unplaceable["uncovered_keys"]) == ["mysteryReadings"]
    assert store.objects() == []


def test_sto_7_3_a_delivery_with_some_bad_points_is_not_failed(store):
    delivery = store.fold(hf.body(("step_count", "count", [point_at("not a time", qty=1.5),
                                                        point_at(at(10, 0), qty=2.5)])))
    assert (delivery["parse_status"], delivery["bad_points"], delivery["points"]) == \
        ("parsed", 1, 1)


def test_sto_7_3_a_failure_writing_the_points_keeps_the_uncovered_list(store):
    store.sql("CREATE TRIGGER test_refuse BEFORE INSERT ON object"
              " BEGIN SELECT RAISE(ABORT, 'refused by the test'); END")
    failed = store.fold(hf.body(minutes("step_count", "count", 10, 0, 1),
                                mysteryReadings=[{"x": 1}]))
    assert failed["parse_status"] == "failed"
    assert json.loads(failed["uncovered_keys"]) == ["mysteryReadings"]


def test_sto_7_4_a_busy_database_leaves_the_delivery_pending(start_service, logs):
    service = start_service(paused=True)
    store = ServedStore(service)
    delivery_id = store.post(hf.body(minutes("step_count", "count", 10, 0, 2)))
    holder = sqlite3.connect(str(store.data_dir / healthlog.DB_NAME), isolation_level=None)
    try:
        holder.execute("BEGIN IMMEDIATE")
        service.worker.gate.set()
        wait_for(lambda: logs.find("fold deferred"), timeout=30)
        assert store.delivery(delivery_id)["parse_status"] == "pending"
    finally:
        holder.execute("ROLLBACK")
        holder.close()
    service.worker.wake()
    assert store.folded(delivery_id)["parse_status"] == "parsed"
    assert store.object("step_count", at(10))["points"] == 3


def test_sto_7_4_a_stop_from_outside_leaves_the_delivery_pending(start_service):
    service = start_service(paused=True)
    delivery_id = ServedStore(service).post(hf.body(minutes("step_count", "count", 10, 0, 2)))
    service.stop()
    rows = db_rows(service.config.data_dir)
    assert [(r["id"], r["parse_status"]) for r in rows] == [(delivery_id, "pending")]
    restarted = ServedStore(start_service())
    assert restarted.folded(delivery_id)["parse_status"] == "parsed"


def test_sto_7_5_a_partial_delivery_is_refolded_once_its_section_is_covered(
        start_service, logs):
    phone = hf.Phone(sources=SOURCE)
    workout = hf.workout_v2(7, dt.datetime(2024, 3, 8, 18), phone=phone, route_points=4)
    service = start_service()
    first = ServedStore(service).fold(hf.body(minutes("step_count", "count", 10, 0, 2),
                                        workouts=[workout]))
    assert first["parse_status"] == "parsed"
    service.stop()
    # As an older version left it: workouts not covered, so not in the store.
    conn = sqlite3.connect(str(service.config.data_dir / healthlog.DB_NAME))
    with conn:
        conn.execute("UPDATE delivery SET parse_status = 'partial', uncovered_keys = ?"
                     " WHERE id = ?", ('["workouts"]', first["id"]))
        conn.execute("DELETE FROM object WHERE metric = 'workouts'")
    conn.close()
    store = ServedStore(start_service())
    assert logs.find("deliveries requeued", level="INFO")[0]["count"] == "1"
    refolded = store.folded(first["id"])
    assert refolded["parse_status"] == "parsed" and refolded["uncovered_keys"] == "[]"
    assert only_point(store.object("workouts", workout["start"], layer="record")) == workout


def test_storage_7_1_a_status_written_by_an_older_parser_is_refolded(start_service, logs):
    service = start_service()
    first = ServedStore(service).fold(hf.body(minutes("step_count", "count", 10, 0, 2)))
    assert first["parser_version"] == healthlog.PARSER_VERSION
    service.stop()
    before = db_rows(service.config.data_dir, "SELECT * FROM object")
    conn = sqlite3.connect(str(service.config.data_dir / healthlog.DB_NAME))
    with conn:
        conn.execute("UPDATE delivery SET parser_version = NULL")  # as a parser before v1
    conn.close()
    store = ServedStore(start_service())
    assert logs.find("deliveries requeued", level="INFO")[0]["count"] == "1"
    refolded = store.folded(first["id"])
    assert refolded["parse_status"] == "parsed"
    assert refolded["parser_version"] == healthlog.PARSER_VERSION
    assert refolded["objects_written"] == 0
    assert db_rows(store.data_dir, "SELECT * FROM object") == before


def _spans_of(row: dict) -> list:
    return list(struct.unpack("<%dq" % (2 * row["points"]), row["spans"]))


def _expected_spans(points: list) -> list:
    """Starts then ends in UTC µs, read with the test's own parser (whole seconds)."""
    starts = [utc_seconds(p.get("start") or p.get("startDate") or p["date"]) for p in points]
    ends = [utc_seconds(p.get("end") or p.get("endDate") or p.get("start") or p["date"])
            for p in points]
    return [s * 1_000_000 for s in starts + ends]


def test_storage_3_4_each_object_carries_its_points_spans(store):
    minute_points = [point_at(at(10, m), qty=100 + m + 0.25) for m in (5, 0, 3)]
    store.fold(hf.body(("step_count", "count", minute_points)))
    nights = hf.sleep_segments(3, hf.DEFAULT_DAY, phone=hf.Phone(sources=SOURCE))
    store.fold(hf.body(("sleep_analysis", "hr", nights)), DAYS)
    objects = store.objects("step_count") + store.objects("sleep_analysis")
    assert len(objects) > 2
    for row in objects:
        assert _spans_of(row) == _expected_spans(row["decoded"])

    # An object without spans (as written before schema version 3) still merges.
    store.sql("UPDATE object SET spans = NULL")
    again = store.fold(hf.resend(hf.body(("step_count", "count", minute_points)),
                                 random.Random(3)))
    assert again["parse_status"] == "parsed" and again["objects_written"] == 0
    assert {row["spans"] for row in store.objects()} == {None}
    more = store.fold(hf.body(("step_count", "count", [point_at(at(10, 7), qty=9.5)])))
    assert more["objects_written"] == 1 and more["overwrites"] == 0
    row = store.object("step_count", at(10))
    assert row["points"] == 4 and _spans_of(row) == _expected_spans(row["decoded"])
    assert [p["date"] for p in row["decoded"]] == [at(10, m) for m in (0, 3, 5, 7)]


def test_storage_2_2_a_boolean_is_not_the_number_it_equals(store, logs):
    numbers = [point_at(at(9, 0), qty=5.25, flag=1), point_at(at(9, 1), qty=6.25, flag=0)]
    first = store.fold(hf.body(("step_count", "count", numbers)))
    assert first["objects_written"] == 1
    stored = store.object("step_count", at(9))
    assert healthlog.decode_object((
        stored["metric"], stored["layer"], stored["hour"], stored["units"],
        stored["delivery_id"], stored["updated_by"], stored["sealed"], stored["blob"],
        stored["point_deliveries"], stored["spans"])).plain  # the fast comparison is open
    booleans = [point_at(at(9, 0), qty=5.25, flag=True), point_at(at(9, 1), qty=6.25, flag=False)]
    second = store.fold(hf.body(("step_count", "count", booleans)))
    assert second["overwrites"] == 2 and second["objects_written"] == 1
    row = store.object("step_count", at(9))
    assert [p["flag"] for p in row["decoded"]] == [True, False]
    assert row["from"] == [second["id"]] * 2
