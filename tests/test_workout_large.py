"""A workout of two days and more, 193,000 route points (openspec/specs/workouts/spec.md,
WKT-10): its page's answer is bounded (the route thinned on the server) and its GPX streams.

The one large body of the workout tests (~43 MB, tests/workout_corpus.py's
``long_walk_body``), posted to a real ``healthlog serve`` subprocess and folded by it. How
long and how much memory the answers take is measured by tests/bench_workout.py, never
asserted here.
"""

from __future__ import annotations

import http.client

import pytest

import workout_corpus as wc
from conftest import TOKEN
from read_helpers import get_json, serve_corpus

# A long load (a 43 MB body, 20 s of CPU to build, fold and read): with the torture runs
# (pyproject.toml); the route's thinning and the GPX are proven on small workouts in
# tests/test_workouts.py (WKT-3.1, WKT-6.1) in the default run.
pytestmark = pytest.mark.torture


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    body, uid, points, ends = wc.long_walk_body()
    headers = {"Content-Type": "application/json", "automation-name": "Long walks"}
    yield from serve_corpus(tmp_path_factory.mktemp("long"), (uid, points, ends),
                            [(headers, body)])


def test_wkt_10_1_a_two_day_route_of_193k_points_answers_thinned_and_its_gpx_streams(store):
    uid, points, ends = store.corpus
    answer = get_json(store.address, "/api/workouts/" + uid)
    route = answer["route"]
    assert route["points"] == points == 193_000
    assert len(route["drawn"]) <= 2000
    assert [tuple(p[1:3]) for p in (route["drawn"][0], route["drawn"][-1])] == ends
    assert len(answer["heart_rate"]["session"]) <= 1000
    assert answer["workout"]["duration_s"] == points - 1 and answer["splits"]["rows"]
    # the GPX streams: chunked, read a piece at a time, every point in it
    conn = http.client.HTTPConnection(*store.address, timeout=120)
    try:
        conn.request("GET", "/api/workouts/%s.gpx" % uid,
                     headers={"Authorization": "Bearer " + TOKEN})
        response = conn.getresponse()
        assert response.status == 200 and response.getheader("Content-Length") is None
        assert response.getheader("Transfer-Encoding") == "chunked"
        pieces, count, tail, first = 0, 0, b"", None
        while True:
            piece = response.read(1 << 16)
            if not piece:
                break
            pieces += 1
            text = tail + piece
            count += text.count(b"<trkpt ")
            tail = text[-6:]
            if first is None:
                first = piece
        assert pieces > 100 and count == points
        assert tail.endswith(b"gpx>\n")
        assert b'<trkpt lat="%r" lon="%r">' % ends[0] in first
    finally:
        conn.close()
