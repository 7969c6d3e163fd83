"""FOLD-13: a large body is folded hour by hour from an index of its points, and gives what
the whole-document fold gives (openspec/specs/fold/spec.md).

From ``healthlog.STREAM_FOLD_BYTES`` on, the fold does not build the document: it walks
the text once with the json module's scanner, keeps each point's offset under its
metric and UTC hour, and parses each hour's points again when that hour is merged. The
tests here compare the two ways on the same bytes: the extraction (what each metric
holds, hour by hour, and every counter) and the store a sequence of deliveries leaves
(fingerprint and journal), on edge cases of JSON and HAE written by hand, the factory's
real shapes and random bodies from hypothesis. The memory it saves is measured by
``tests/bench_memory.py``, not asserted here.
"""

import contextlib
import datetime as dt
import json
import random
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import hae_factory as hf
import healthlog
from fold_helpers import DirectStore


pytestmark = pytest.mark.usefixtures("json_mode")  # every test with and without orjson

T0 = dt.datetime(2026, 11, 1, tzinfo=dt.timezone.utc)
WHOLE, INDEXED = 1 << 40, 0  # STREAM_FOLD_BYTES: never / always hour by hour


def view(extraction: healthlog.Extraction) -> dict:
    """Everything the fold reads of an extraction, each metric's points by hour and
    coordinate (the index is read by parsing its hours, as the merge does; an array the
    index leaves in the text, a workout's route, is read as the merge reads it)."""
    metrics = {}
    for key, bucket in extraction.metrics.items():
        metrics[key] = {"units": bucket.units, "starts": list(bucket.starts),
                        "has_interval": bucket.has_interval,
                        "distinct": min(bucket.distinct, healthlog.DISTINCT_COUNTED)}
        metrics[key]["hours"] = {
            hour: {coord: ([healthlog.materialize(p) for p in slot] if type(slot) is list
                           else healthlog.materialize(slot))
                   for coord, slot in coords.items()}
            for hour, coords in bucket.hour_coords(lambda: None)}
    return {"uncovered": extraction.uncovered, "dropped": extraction.uncovered_dropped,
            "cut": extraction.uncovered_cut, "points": extraction.points,
            "bad_points": extraction.bad_points, "bad_metrics": extraction.bad_metrics,
            "mixed_units": extraction.mixed_units, "metrics": metrics}


def both_ways(path: Path, monkeypatch) -> tuple:
    """(view of the whole-document extraction, view of the index) of one body file;
    an exception class instead of a view where the way refuses it."""
    out = []
    for threshold in (WHOLE, INDEXED):
        monkeypatch.setattr(healthlog, "STREAM_FOLD_BYTES", threshold)
        try:
            extraction, plain = healthlog.extract_body(path)
        except healthlog.FoldFailure as exc:
            out.append(type(exc))
        else:
            out.append((view(extraction), plain))
    return tuple(out)


POINT = '{"date":"2024-03-08 10:%02d:00 -0800","qty":%d.5,"source":"Zebulon’s Watch"}'
EDGE_CASES = {
    "plain": '{"data":{"metrics":[{"name":"step_count","units":"count","data":[%s]}]}}'
             % ",".join(POINT % (m, m) for m in range(60)),
    "pretty and keys in another order": json.dumps(
        {"data": {"metrics": [{"data": [json.loads(POINT % (m, m)) for m in range(5)],
                               "units": "count", "name": "step_count"}]}}, indent=2,
        ensure_ascii=False).replace('": ', '" : '),
    "duplicate keys keep the last": (
        '{"data":{"metrics":[]},"data":{"metrics":[{"name":"a","data":[%s],"name":"b",'
        '"units":"x","units":"count","data":[%s]}],"metrics":[{"name":"c","units":"n",'
        '"data":[%s]}]}}' % (POINT % (1, 1), POINT % (2, 2), POINT % (3, 3))),
    "a metric in two units": (
        '{"data":{"metrics":[{"name":"e","units":"kcal","data":[%s]},'
        '{"name":"e","units":"kJ","data":[%s]},{"name":"e","units":"kcal","data":[%s]}]}}'
        % (POINT % (1, 1), POINT % (2, 2), POINT % (3, 3))),
    "bad points, null data and bad elements": (
        '{"data":{"metrics":[{"name":"n","units":"c","data":null},{"name":"m","data":[1,'
        '{"date":"soon","qty":1},{"qty":2},%s,[],null]},{"name":" ","data":[1,2]},'
        '{"units":"x","data":[%s]},7,{"name":"q","data":"x"},{"name":"z"}],'
        '"workouts":{"not":"a list"},"ecg":null,"symptoms":[{"name":"Cough","start":"x"},'
        '{"start":"2024-03-08 10:00:00 -0800","end":"2024-03-08 11:00:00 -0800"},5]}}'
        % (POINT % (4, 4), POINT % (5, 5))),
    "every record section": json.dumps({"data": dict(hf.records_sections(
        3, hf.DEFAULT_DAY, hf.DEFAULT_DAY + dt.timedelta(days=2)),
        workouts=[hf.workout_v2(1), hf.workout_v1(2)])}),
    "sleep in records and summaries": json.dumps({"data": {"metrics": [
        hf.metric("sleep_analysis", hf.sleep_segments(1) + hf.sleep_nights(2))]}}),
    "uncovered keys, long and many": json.dumps({"data": dict(
        {"k%02d" % i: [i] for i in range(40)}, **{"x" * 80: {}, "metrics": []})}),
    "non-ASCII, escapes and surrogate pairs": (
        '{"data":{"a":"😀 x\u2028y \\u00e9\\n\\\\","b":"%s","metrics":[{"name":"é",'
        '"data":[{"date":"2024-03-08 10:00:00 -0800","qty":1,"source":"\\ud83d\\ude00’"}]}]}}'
        % "".join(chr(0x4e00 + i) for i in range(40))),
    "booleans": '{"data":{"metrics":[{"name":"w","data":[{"date":"2024-03-08 10:00:00'
                ' +0000","isIndoor":false,"qty":0}]}]}}',
    "whitespace everywhere": ' \n{ "data" :\t{ "metrics" : [ { "name" : "s" , "data" : [ %s'
                             ' , %s ] } ] } }\r\n' % (POINT % (1, 1), POINT % (1, 1)),
    "empty data": '{"data":{}}',
}
INVALID = {
    "not an object": '[{"data":{}}]',
    "data not an object": '{"data":[]}',
    "no data": '{"metrics":[]}',
    "extra data": '{"data":{}} {}',
    "truncated": '{"data":{"metrics":[{"name":"s","data":[%s' % (POINT % (1, 1)),
    "a missing comma": '{"data":{"metrics":[{"name":"s" "data":[]}]}}',
    "a trailing comma": '{"data":{"metrics":[{"name":"s","data":[1,]}]}}',
    "a backslash before a non-ASCII character": '{"data":{"a":"\\é"}}',
    "an unpaired surrogate": '{"data":{"a":"\\ud800"}}',
    "an overflowing double": '{"data":{"metrics":[{"name":"s","data":[{"qty":1e400}]}]}}',
    "a 21-digit integer": '{"data":{"a":123456789012345678901}}',
    "NaN": '{"data":{"metrics":[{"name":"s","data":[{"qty":NaN}]}]}}',
    "a control character in a key": '{"data":{"a\x01":1}}',
}


@pytest.mark.parametrize("name", sorted(EDGE_CASES))
def test_fold_13_1_a_large_body_is_indexed_to_what_its_document_holds(name, tmp_path,
                                                                       monkeypatch):
    path = tmp_path / "body.json"
    path.write_bytes(EDGE_CASES[name].encode("utf-8"))
    whole, indexed = both_ways(path, monkeypatch)
    assert whole == indexed
    assert type(whole) is tuple, whole  # these are all bodies the fold reads


@pytest.mark.parametrize("name", sorted(INVALID))
def test_fold_13_1_a_large_body_refuses_what_ingest_refuses(name, tmp_path, monkeypatch):
    path = tmp_path / "body.json"
    path.write_bytes(INVALID[name].encode("utf-8"))
    whole, indexed = both_ways(path, monkeypatch)
    assert indexed is healthlog.ContentNotParsed
    mode = "stdlib" if healthlog._orjson is None else "orjson"
    if mode not in SMALL_BODY_READS.get(name, ()):
        assert whole is healthlog.ContentNotParsed


SMALL_BODY_READS = {"an overflowing double": ("stdlib",), "an unpaired surrogate": ("stdlib",),
                    "a 21-digit integer": ("stdlib", "orjson")}
"""What the small-body parse reads (orjson a long integer as a double): bytes ingest never
archives, since its check refuses them; only an archive filled by hand holds them."""


def test_fold_13_1_real_shapes_are_indexed_to_what_their_documents_hold(tmp_path,
                                                                         monkeypatch):
    bodies = [hf.big_metrics_body(1 << 20, seed=5), hf.big_workouts_body(1 << 20, seed=6)]
    bodies += [push.body for push in hf.week_of_traffic(seed=7, days=2)][::7]
    path = tmp_path / "body.json"
    for body in bodies:
        path.write_bytes(body)
        whole, indexed = both_ways(path, monkeypatch)
        assert type(whole) is tuple and whole == indexed


# -- the store two ways --------------------------------------------------------------------


def fold_each(deliveries: list, root: Path, monkeypatch, variants: tuple) -> list:
    """One store per (name, {constant: value}) of ``variants``, each folded with healthlog's
    constants set so."""
    stores = []
    for name, constants in variants:
        with monkeypatch.context() as patch:
            for constant, value in constants.items():
                patch.setattr(healthlog, constant, value)
            store = DirectStore(root / name, T0)
            for seconds, (body, headers) in enumerate(deliveries):
                store.journal(body, seconds, headers)
            store.fold_all()
            stores.append(store)
    return stores


def fold_both_ways(deliveries: list, root: Path, monkeypatch) -> list:
    return fold_each(deliveries, root, monkeypatch,
                     (("whole", {"STREAM_FOLD_BYTES": WHOLE}),
                      ("indexed", {"STREAM_FOLD_BYTES": INDEXED})))


@contextlib.contextmanager
def the_same_store(first: DirectStore, second: DirectStore):
    """Asserts that the two stores hold the same objects, every column and blob included,
    and the same journal; closes both at the end of the block."""
    try:
        assert first.objects("*") == second.objects("*")
        assert first.journal_rows() == second.journal_rows()
        yield
    finally:
        first.conn.close()
        second.conn.close()


def test_fold_13_2_a_week_folded_hour_by_hour_is_the_week_folded_whole(tmp_path, monkeypatch):
    pushes = list(hf.week_of_traffic(seed=11, days=2))
    whole, indexed = fold_both_ways([(p.body, p.headers) for p in pushes], tmp_path,
                                    monkeypatch)
    with the_same_store(whole, indexed):
        assert {row[1] for row in whole.journal_rows()} >= {"parsed"}


STAGES = ("Core", "Deep", "REM", "Awake", "InBed")
FIELD = st.sampled_from(["qty", "Min", "Avg", "Max", "value", "kind", "context"])
VALUE = st.one_of(st.sampled_from([0, 0.0, None, "", False, True, 5, 5.000000000000001,
                                   "Core", "REM", "Active"]),
                  st.floats(allow_nan=False, allow_infinity=False), st.integers(-10, 10))


@st.composite
def hae_points(draw):
    minute = draw(st.integers(0, 130))
    when = "2026-11-01 %02d:%02d:%02d +0100" % (minute // 60, minute % 60,
                                                draw(st.sampled_from([0, 0, 17])))
    point = {draw(st.sampled_from(["date", "start", "startDate"])): when}
    if draw(st.booleans()):
        point[draw(st.sampled_from(["end", "endDate"]))] = draw(st.sampled_from(
            [when, "2026-11-01 03:00:00 +0100", "never"]))
    for key in draw(st.lists(FIELD, unique=True, max_size=3)):
        point[key] = draw(VALUE)
    if draw(st.booleans()):
        point["source"] = draw(st.sampled_from(["", "Watch", "Zebulon’s Watch"]))
    return point


@st.composite
def hae_bodies(draw):
    metrics = []
    for _ in range(draw(st.integers(0, 4))):
        element = {"name": draw(st.sampled_from(["step_count", "heart_rate",
                                                 "sleep_analysis", "", 5])),
                   "data": draw(st.one_of(st.lists(st.one_of(hae_points(), st.just(3)),
                                                   max_size=12),
                                          st.none()))}
        if draw(st.booleans()):
            element["units"] = draw(st.sampled_from(["count", "kJ", "kcal", None]))
        items = list(element.items())
        random.Random(draw(st.integers(0, 99))).shuffle(items)
        metrics.append(dict(items))
    data = {"metrics": metrics}
    if draw(st.booleans()):
        data["symptoms"] = [dict(p, name=draw(st.sampled_from(["Cough", "Headache"])))
                            for p in draw(st.lists(hae_points(), max_size=3))]
    if draw(st.booleans()):
        data["nutrition"] = []
    headers = draw(st.sampled_from([{"automation-aggregation": "Minutes"},
                                    {"automation-id": "A"}, {}]))
    pretty = draw(st.booleans())
    return hf.dumps_hae({"data": data}, pretty=pretty), headers


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(hae_bodies(), min_size=1, max_size=5))
def test_fold_13_2_random_deliveries_fold_alike_hour_by_hour_and_whole(deliveries):
    with tempfile.TemporaryDirectory() as tmp, pytest.MonkeyPatch.context() as monkeypatch:
        with the_same_store(*fold_both_ways(deliveries, Path(tmp), monkeypatch)):
            pass


# -- a bounded fold: rows in batches, records' long arrays left in the text -----------------

BOUNDED = {"FOLD_ROWS_HELD": 3, "DEFER_MIN_ELEMENTS": 2, "PIECE_MEMBERS": 2,
           "STREAM_FOLD_BYTES": 0, "WHOLE_PARSE_NAMES_MAX": 0, "ASCII_READ_CHUNK": 97}
"""Every bound of a fold's memory at its tightest: three encoded rows held (the rest in the
scratch file), arrays of more than two elements left in the text (a large body's, and a
stored object's read back from its scratch file), pieces of two members, every body
indexed, and read 97 bytes at a time."""


def fold_bounded_and_not(deliveries: list, root: Path, monkeypatch) -> list:
    """A store folded with the defaults (small bodies parsed whole), and one with every
    bound of :data:`BOUNDED`."""
    return fold_each(deliveries, root, monkeypatch, (("defaults", {}), ("bounded", BOUNDED)))


def wide_and_long_bodies(seed: int) -> list:
    """(body, headers) of a Days history of every metric, hundreds of one-point metrics and
    two long workouts, with the workouts sent again re-serialised and with one value
    changed, and the Days history again with one day changed (a stored object each)."""
    import bench_memory

    out = []
    with tempfile.TemporaryDirectory() as tmp:
        for shape, size in (("days-backfill", 60_000), ("many-metrics-one-point", 30_000),
                            ("workout-long", 70_000), ("emoji-sources", 20_000)):
            path = Path(tmp) / "body.json"
            made = bench_memory.write_body(shape, path, size, seed=seed)
            headers = ({"automation-aggregation": made["aggregation"]}
                       if made["aggregation"] else {})
            out.append((path.read_bytes(), headers))
    days, workout = out[0], out[2]
    out.append((hf.big_workouts_body(60_000, seed=seed), {}))
    out.append((hf.resend(workout[0], random.Random(seed), pretty=False), {}))
    out.append((workout[0].replace(b'"Avg":', b'"Avg":1', 1), {}))
    out.append((days[0].replace(b'"qty":', b'"qty":1', 1), days[1]))
    return out


def test_fold_13_3_a_fold_that_holds_a_bounded_batch_leaves_the_store_it_always_did(
        tmp_path, monkeypatch):
    deliveries = [(p.body, p.headers) for p in hf.week_of_traffic(seed=13, days=2)]
    deliveries += wide_and_long_bodies(13)
    defaults, bounded = fold_bounded_and_not(deliveries, tmp_path, monkeypatch)
    with the_same_store(defaults, bounded):
        rows = defaults.journal_rows()
        assert {row[1] for row in rows} == {"parsed"}
        assert sum(row[8] for row in rows[-4:]) >= 3  # the re-sends changed what they carry
        assert len(defaults.objects()) > 1000


@st.composite
def record_bodies(draw):
    """Workouts whose arrays hold random points and values (``source`` at every level,
    numbers that the JSON writers spell apart), and the body again with its keys in
    another order or one value changed."""
    workouts = []
    for _ in range(draw(st.integers(1, 3))):
        workout = {"id": draw(st.sampled_from(["W1", "W2"])),
                   "start": draw(st.sampled_from(["2026-11-01 01:00:00 +0100",
                                                  "2026-11-01 01:30:00 +0100"])),
                   "end": "2026-11-01 02:10:00 +0100", "name": "Running"}
        for key in draw(st.lists(st.sampled_from(["route", "heartRateData", "metadata"]),
                                 unique=True)):
            workout[key] = draw(st.lists(st.one_of(hae_points(), VALUE, st.lists(VALUE,
                                                                                 max_size=3)),
                                         max_size=6))
        if draw(st.booleans()):
            workout["source"] = "Zebulon’s Watch"
        workouts.append(workout)
    body = hf.dumps_hae({"data": {"workouts": workouts}}, pretty=draw(st.booleans()))
    again = draw(st.sampled_from(["resend", "change", "none"]))
    bodies = [(body, {})]
    if again == "resend":
        bodies.append((hf.resend(body, random.Random(draw(st.integers(0, 9)))), {}))
    elif again == "change" and b'"qty"' in body:
        bodies.append((body.replace(b'"qty"', b'"qty" : 7, "was"', 1), {}))
    return bodies


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.one_of(record_bodies(), hae_bodies().map(lambda b: [b])), min_size=1,
                max_size=4))
def test_fold_13_3_random_deliveries_fold_alike_bounded_and_not(groups):
    deliveries = [delivery for group in groups for delivery in group]
    with tempfile.TemporaryDirectory() as tmp, pytest.MonkeyPatch.context() as monkeypatch:
        with the_same_store(*fold_bounded_and_not(deliveries, Path(tmp), monkeypatch)):
            pass


JSON_VALUES = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-(1 << 63), (1 << 63) - 1),
              st.floats(allow_nan=False, allow_infinity=False),
              st.sampled_from([1e-7, 3.5e-5, 0.0001, 1e22, 0.1, -0.0]),
              st.text(max_size=4), st.sampled_from(["source", "é’😀", "\u2028\n\"\\"])),
    lambda inner: st.one_of(
        st.lists(inner, max_size=5),
        st.dictionaries(st.sampled_from(["source", "a", "Z", "é", "date", "value"]), inner,
                        max_size=4)),
    max_leaves=30)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.one_of(JSON_VALUES, st.dictionaries(
    st.sampled_from(["route", "source", "date", "value", "heartRateData"]),
    st.one_of(JSON_VALUES, st.lists(JSON_VALUES, min_size=3, max_size=9)), max_size=4)),
    min_size=1, max_size=4))
def test_fold_13_4_an_object_written_a_piece_at_a_time_is_the_object_written_whole(points):
    whole = (healthlog.compress_blob(healthlog.dumps_points(points)),
             healthlog.object_hash(points))
    with pytest.MonkeyPatch.context() as patch, tempfile.TemporaryDirectory() as tmp:
        for constant in ("DEFER_MIN_ELEMENTS", "PIECE_MEMBERS", "ASCII_READ_CHUNK"):
            patch.setattr(healthlog, constant, BOUNDED.get(constant, 2))
        assert healthlog.encode_points(points) == whole
        text = json.dumps(points, ensure_ascii=True, indent=1)  # a body's text, arrays left
        cursor = healthlog._Cursor(text, 0)  # in it: read back alike, the same value
        cursor.take("[")
        shallow = [healthlog._shallow_at(cursor)]
        while cursor.peek() == ",":
            cursor.take(",")
            shallow.append(healthlog._shallow_at(cursor))
        stored = healthlog._stored_points(healthlog._TextFile(Path(tmp), whole[0]))
        for read in (shallow, stored):
            assert [healthlog.materialize(point) for point in read] == points
            assert all(map(healthlog.same_value, read, points))
            assert all(map(healthlog.same_value, points, read))
            assert healthlog.encode_points(read) == whole
