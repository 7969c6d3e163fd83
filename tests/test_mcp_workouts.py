"""MCP-5: the workouts' tools of the MCP server (openspec/specs/mcp/spec.md).

A 10 km run of one route point a second with its heart rate, and the same run recorded by
another app, posted to a real ``serve``; the official SDK's client asks ``list_workouts``
and ``get_workout`` over stdio (``healthlog mcp``) and over Streamable HTTP (``POST /mcp``).
Each answer is compared with what ``/api/workouts`` and ``/api/workouts/<id>`` give the
page, and with the test's own reading of the bodies (tests/workout_corpus.py: haversine
splits, the duplicate counted once, the run's duration from its start and end).
"""

import random

import pytest

import hae_factory as hf
import workout_corpus as wc
from read_helpers import get_json, serve_corpus
from mcp_helpers import TRANSPORTS, answer, converse

RANGE = {"from": "2025-05-25", "to": "2025-06-07"}
@pytest.fixture(scope="module")
def store(tmp_path_factory):
    rng = random.Random(wc.SEED)
    run = wc.ten_km_run(rng)
    again = wc.run_again(run, rng)
    bodies = {"run": run, "again": again}
    deliveries = [(hf.headers_for(wc.WORKOUTS), hf.dumps_hae(hf.envelope(workouts=[run]))),
                  (hf.headers_for(wc.OTHER_APP), hf.dumps_hae(hf.envelope(workouts=[again])))]
    yield from serve_corpus(tmp_path_factory.mktemp("mcp-workouts"), bodies, deliveries)


@pytest.fixture(scope="module", params=TRANSPORTS)
def workouts_seen(request, store, tmp_path_factory):
    kind, mode = request.param
    run = store.corpus["run"]
    calls = [("list_workouts", RANGE), ("get_workout", {"id": run["id"]}),
             ("get_workout", {"id": "no-such-workout"}),
             ("list_workouts", {"from": "0001-01-01", "tz": "+14:00"}),
             ("list_workouts", {"from": "2025-06-07", "to": "2025-05-25"})]
    return converse(store, kind, calls, mode, tmp_path_factory.mktemp("mcp-workouts-log"))


def test_mcp_5_1_list_workouts_is_the_api_s_list_and_counts_a_duplicate_once(store, workouts_seen):
    assert {"list_workouts", "get_workout"} <= {tool.name for tool in workouts_seen.tools}
    listed = answer(workouts_seen.results[0])
    api = get_json(store.address, "/api/workouts", from_=RANGE["from"], to=RANGE["to"])
    assert listed["workouts"] == api["workouts"]
    assert (listed["count"], listed["seconds"]) == (api["count"], api["seconds"])
    # The test's own reading: two workouts posted, the same run twice, counted once, for
    # the duration HAE sent with the one that has the route.
    run, again = store.corpus["run"], store.corpus["again"]
    assert len(listed["workouts"]) == 2 and listed["count"] == 1
    assert listed["seconds"] == run["duration"] != again["duration"]
    first = [item for item in listed["workouts"] if item["duplicate_of"] is None]
    assert [item["id"] for item in first] == [run["id"]]
    [other] = [item for item in listed["workouts"] if item["duplicate_of"] is not None]
    assert other["id"] == again["id"] and other["duplicate_of"] == run["id"]
    assert "the same as %s" % run["id"] in workouts_seen.results[0].content[0].text


def test_mcp_5_2_get_workout_gives_the_page_s_figures_splits_and_zones(store, workouts_seen):
    run = store.corpus["run"]
    got = answer(workouts_seen.results[1])
    page = get_json(store.address, "/api/workouts/" + run["id"])
    for key in ("workout", "figures", "units", "splits", "notes"):
        assert got[key] == page[key], key
    assert got["heart_rate"]["zones"] == page["heart_rate"]["zones"]
    assert got["heart_rate"]["session_samples"] == len(page["heart_rate"]["session"])
    assert "points" not in got["route"] and got["route"]["meters"] == page["route"]["meters"]
    # The test's own splits: a boundary every kilometre along the route (haversine).
    points = wc.positions(run)
    heart = wc.session_heart(run)
    own = wc.splits(points, 1000.0, heart, wc.seconds(run["start"]))
    rows = got["splits"]["rows"]
    assert len(rows) == len(own)
    for row, (meters, secs, _, _) in zip(rows, own):
        assert row["meters"] == pytest.approx(meters, rel=1e-6)
        assert row["seconds"] == pytest.approx(secs, abs=0.01)
    text = workouts_seen.results[1].content[0].text
    assert "heart-rate zones" in text and "%d splits per km" % len(own) in text


def test_mcp_5_3_workout_refusals_are_the_api_s_words(store, workouts_seen):
    missing, far, backwards = workouts_seen.results[2:5]
    for result in (missing, far, backwards):
        assert result.is_error is True
    assert "no stored workout has that id" in missing.content[0].text
    assert "1900-01-01" in far.content[0].text  # the range a date must lie in
    assert "before" in backwards.content[0].text
