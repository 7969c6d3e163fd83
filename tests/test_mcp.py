"""MCP-n: the read-only MCP server for AI assistants (openspec/specs/mcp/spec.md).

The official MCP Python SDK's client (a test-only dependency: the reference client nobody
here wrote) connects over stdio to ``python -m healthlog mcp`` and over Streamable HTTP to
a real ``serve`` subprocess on 127.0.0.1:0; the protocol's corners are sent as raw JSON-RPC
lines and raw HTTP requests. The store is built from HAE-shaped bodies, posted and folded
once for the module: a phone in America/New_York whose days cross the DST change of
2025-03-09, steps by the minute (two days not delivered), heart rate for three days, a Days
automation with resting heart rate and eight years of weekly weights, and nightly sleep
records (HAE's aggregated form, hae-format §2.5) with a nap. Every figure a tool gives is
compared with what the read API answers for the same question, and steps, a summary card
and sleep also with what the test computes from the bodies in its own words.
"""

import datetime as dt
import hashlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

import hae_factory as hf
import healthlog
from conftest import ROOT, TOKEN, LocalServer, assert_no_leaks, db_rows, wait_for
from mcp_helpers import TRANSPORTS, SdkSession, answer, converse  # skips without the SDK
from read_helpers import call, close, get_json, ny_stamp, ny_steps, serve_corpus, written_date

FIRST = dt.date(2025, 2, 24)
DAYS = [FIRST + dt.timedelta(days=n) for n in range(35)]  # to 2025-03-30, across 03-09
LAST = DAYS[-1]
MISSING = {dt.date(2025, 3, 4), dt.date(2025, 3, 20)}  # no steps were delivered these days
WATCH = hf.OWNER_WATCH  # a device name: never in a log record above DEBUG
WEEKS = 420  # weekly weights, eight years: more weeks than one reply holds
MINUTES = {"automation-name": "Fast", "automation-aggregation": "Minutes"}
DAILY = {"automation-name": "Daily", "automation-aggregation": "Days"}
SLEEP = {"automation-name": "Sleep"}
TOOLS = ["list_metrics", "get_series", "get_day_summary", "get_sleep", "compare_periods",
         "get_data_health", "list_workouts", "get_workout"]
HANDSHAKE = ["2024-11-05", "2025-03-26", "2025-06-18", "2025-11-25"]
MODERN = "2026-07-28"
META_VERSION = "io.modelcontextprotocol/protocolVersion"
META_CAPABILITIES = "io.modelcontextprotocol/clientCapabilities"


# ---------------------------------------------------------------------------------------------
# The bodies, as HAE writes them

def heart_of(day: dt.date) -> list:
    return [{"date": ny_stamp(day, m), "Min": 52 + m % 7, "Avg": 61 + (m // 10) % 13,
             "Max": 80 + m % 11, "source": WATCH} for m in range(0, 22 * 60, 10)]


def night_of(n: int, day: dt.date) -> dict:
    """HAE's nightly record (the aggregated form, §2.5) of the night that ended on ``day``:
    ``date`` is the wake time; ``totalSleep`` the sum of the stages; well within its window."""
    start, wake = ny_stamp(day - dt.timedelta(days=1), 23 * 60 + 10), ny_stamp(day, 6 * 60 + 40 + n)
    return {"date": wake, "totalSleep": 6.4 + n / 30, "asleep": 0, "core": 3.9 + n / 30,
            "deep": 1.1, "rem": 1.4, "awake": 0.2, "sleepStart": start, "sleepEnd": wake,
            "inBed": 7.4 + n / 100, "inBedStart": start, "inBedEnd": wake, "source": WATCH}


def nap_of(day: dt.date) -> dict:
    start, end = ny_stamp(day, 14 * 60), ny_stamp(day, 14 * 60 + 45)
    return {"date": end, "totalSleep": 0.6, "asleep": 0, "core": 0.6, "sleepStart": start,
            "sleepEnd": end, "inBed": 0.7, "inBedStart": start, "inBedEnd": end,
            "source": WATCH}


def corpus() -> tuple:
    """(bodies by kind, deliveries): what is posted, and what the test reads it as."""
    bodies: dict = {"steps": {}, "heart": {}, "resting": [], "weight": [], "nights": [],
                    "nap": None}
    deliveries = []
    for day in DAYS:
        if day in MISSING:
            continue
        steps = ny_steps(day, WATCH)
        bodies["steps"][day] = steps
        metrics = [hf.metric("step_count", steps, "count")]
        if day >= LAST - dt.timedelta(days=2):
            bodies["heart"][day] = heart_of(day)
            metrics.append(hf.metric("heart_rate", bodies["heart"][day], "count/min"))
        deliveries.append((MINUTES, hf.dumps_hae(hf.envelope(metrics=metrics))))
    bodies["resting"] = [{"date": ny_stamp(day), "qty": 50 + day.day % 6, "source": WATCH}
                         for day in DAYS]
    weeks = [LAST - dt.timedelta(weeks=n) for n in range(WEEKS - 1, -1, -1)]
    bodies["weight"] = [{"date": ny_stamp(day, 7 * 60 + 5),
                         "qty": hf.CANARY_QTY if n == WEEKS - 3 else 70 + (n % 30) / 10,
                         "source": "Scale"} for n, day in enumerate(weeks)]
    deliveries.append((DAILY, hf.dumps_hae(hf.envelope(metrics=[
        hf.metric("resting_heart_rate", bodies["resting"], "count/min"),
        hf.metric("weight_body_mass", bodies["weight"], "kg")]))))
    bodies["nights"] = [night_of(n, day) for n, day in enumerate(DAYS[-12:])]
    bodies["nap"] = nap_of(DAYS[-3])
    deliveries.append((SLEEP, hf.dumps_hae(hf.envelope(metrics=[
        hf.metric("sleep_analysis", bodies["nights"] + [bodies["nap"]], "hr")]))))
    return bodies, deliveries


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """The corpus posted to a serve subprocess and folded; serve runs for the module."""
    bodies, deliveries = corpus()
    yield from serve_corpus(tmp_path_factory.mktemp("mcp"), bodies, deliveries)


def steps_by_day(bodies: dict) -> dict:
    """The test's own day totals: every step point, by the date written in it."""
    out: dict = {}
    for points in bodies["steps"].values():
        for point in points:
            day = written_date(point["date"])
            out[day] = out.get(day, 0) + point["qty"]
    return out


# ---------------------------------------------------------------------------------------------
# The SDK's client, over both transports

# ---------------------------------------------------------------------------------------------
# Raw JSON-RPC over stdio

def raw_stdio(data_dir: Path, lines: list, timeout: float = 60) -> tuple:
    """``python -m healthlog mcp`` fed ``lines`` (bytes or objects) on stdin until EOF:
    (its exit code, every stdout line parsed as JSON, its stderr lines)."""
    payload = b"".join((line if isinstance(line, bytes) else json.dumps(line).encode()) + b"\n"
                       for line in lines)
    done = subprocess.run([sys.executable, "-m", "healthlog", "mcp", "--data", str(data_dir)],
                          input=payload, capture_output=True, timeout=timeout, cwd=str(ROOT))
    replies = [json.loads(line) for line in done.stdout.splitlines()]
    log = [line for line in done.stderr.decode().splitlines() if line]
    assert_no_leaks(log)
    return done.returncode, replies, log


def request(message_id, method: str, params: dict = None) -> dict:
    message = {"jsonrpc": "2.0", "id": message_id, "method": method}
    if params is not None:
        message["params"] = params
    return message


def initialize(version: str, message_id=0) -> dict:
    return request(message_id, "initialize", {"protocolVersion": version, "capabilities": {},
                                              "clientInfo": {"name": "test", "version": "1"}})


def rpc_envelope(version: str = MODERN, **params) -> dict:
    return dict(params, _meta={META_VERSION: version, META_CAPABILITIES: {}})


def by_id(replies: list) -> dict:
    return {reply.get("id"): reply for reply in replies}


# ---------------------------------------------------------------------------------------------
# One SDK session per transport asks every question of the tests that compare figures

SERIES_CASES = [({"metric": "step_count"}, None), ({"metric": "step_count", "range": "24h"}, None),
                ({"metric": "step_count", "range": "30d", "tz": "Europe/Berlin"}, None),
                ({"metric": "step_count", "range": "1y"}, None),
                ({"metric": "step_count", "from": "2025-03-01", "to": "2025-03-12"}, None),
                ({"metric": "heart_rate", "range": "24h"}, None),
                ({"metric": "resting_heart_rate", "range": "24h"}, "day"),
                ({"metric": "weight_body_mass", "range": "30d"}, None)]
SUMMARY_DAYS = [dt.date(2025, 3, 10), dt.date(2025, 3, 20), LAST]
SLEEP_RANGE = {"from": DAYS[-14].isoformat(), "to": LAST.isoformat()}
FIRST_PERIOD = {"from": "2025-02-24", "to": "2025-03-09"}
SECOND_PERIOD = {"from": "2025-03-10", "to": "2025-03-30"}
COMPARED = ["step_count", "heart_rate", "resting_heart_rate", "sleep_analysis"]
HEALTH_RANGE = {"from": "2025-02-24", "to": "2025-03-30"}
PLANNED = {
    "errors": [("get_series", {"metric": "no_such_metric"}),
               ("get_series", {"metric": "step_count", "from": "2025-03-10"}),
               ("get_day_summary", {"date": "2025-02-30"}),
               ("get_series", {"metric": "step_count", "tz": "Mars/Olympus"}),
               ("get_series", {"metric": "step_count", "bucket": "hour"}),
               ("get_series", {}), ("get_sleep", {"from": "10 March"}),
               ("no_such_tool", {})],
    "bounded": [("get_series", {"metric": "weight_body_mass", "range": "all"})],
    "metrics": [("list_metrics", {})],
    "series": [("get_series", args) for args, _ in SERIES_CASES],
    "summary": [("get_day_summary", {"date": day.isoformat()}) for day in SUMMARY_DAYS]
    + [("get_day_summary", {})],
    "sleep": [("get_sleep", SLEEP_RANGE), ("get_sleep", {})],
    "compare": [("compare_periods", {"metrics": COMPARED, "first": FIRST_PERIOD,
                                     "second": SECOND_PERIOD})],
    "health": [("get_data_health", HEALTH_RANGE)],
}
"""The calls of each test that compares figures, by test."""


@pytest.fixture(scope="module", params=TRANSPORTS)
def seen(request, store, tmp_path_factory) -> SdkSession:
    """Every call of :data:`PLANNED`, in one SDK session over stdio (the handshake) and one
    over HTTP (2026-07-28, by the probe); ``results`` by test."""
    kind, mode = request.param
    flat = [one for calls in PLANNED.values() for one in calls]
    session = converse(store, kind, flat, mode, tmp_path_factory.mktemp("mcp-log"))
    assert len(session.results) == len(flat)
    results, at = {}, 0
    for name, calls in PLANNED.items():
        results[name] = session.results[at:at + len(calls)]
        at += len(calls)
    session.results = results
    return session


# ---------------------------------------------------------------------------------------------
# MCP-1: the protocol

def test_mcp_1_1_initialize_negotiates_every_handshake_version(store):
    for version in HANDSHAKE:
        code, replies, _ = raw_stdio(store.data_dir, [
            initialize(version), {"jsonrpc": "2.0", "method": "notifications/initialized"},
            request(1, "tools/list")])
        assert code == 0 and len(replies) == 2, replies
        result = by_id(replies)[0]["result"]
        assert result["protocolVersion"] == version
        assert result["serverInfo"]["name"] == "healthlog"
        assert result["serverInfo"]["version"] == healthlog.__version__
        assert result["capabilities"] == {"tools": {"listChanged": False}}
        words = result["instructions"]
        for said in ("own", "health data", "local ISO dates", "not a trend",
                     "get_data_health"):
            assert said in words, said
        assert [t["name"] for t in by_id(replies)[1]["result"]["tools"]] == TOOLS


def test_mcp_1_2_an_unknown_version_is_answered_with_the_latest(store):
    code, replies, _ = raw_stdio(store.data_dir, [
        initialize("2099-01-01"), request(1, "initialize", {"capabilities": {}})])
    got = by_id(replies)
    assert got[0]["result"]["protocolVersion"] == HANDSHAKE[-1]
    assert got[1]["error"]["code"] == -32602 and "protocolVersion" in got[1]["error"]["message"]


def test_mcp_1_3_the_2026_07_28_envelope_is_spoken(store, seen, tmp_path):
    """The SDK in auto mode probes server/discover and stays in 2026-07-28; pinned to it,
    it calls without a probe; in legacy mode it shakes hands (``seen``: stdio in legacy
    mode, HTTP in auto mode)."""
    assert seen.version == (HANDSHAKE[-1] if seen.mode == "legacy" else MODERN)
    assert seen.info.name == "healthlog" and "health data" in seen.instructions
    transport = "http" if seen.transport == "stdio" else "stdio"  # the other modes there
    for mode, version in (("auto", MODERN), (MODERN, MODERN)) if transport == "stdio" else (
            (MODERN, MODERN), ("legacy", HANDSHAKE[-1])):
        other = converse(store, transport, [("get_series", {"metric": "step_count"})], mode,
                         tmp_path)
        assert other.version == version, mode
        assert [tool.name for tool in other.tools] == TOOLS
        assert answer(other.results[0])["metric"] == "step_count"


def test_mcp_1_3_the_envelope_is_checked_on_stdio(store):
    discover = request(1, "server/discover", rpc_envelope())
    code, replies, _ = raw_stdio(store.data_dir, [
        discover, request(2, "tools/list", rpc_envelope("2027-01-01")),
        request(3, "tools/list", {"_meta": {META_VERSION: MODERN}}),
        request(4, "ping", rpc_envelope()), initialize(HANDSHAKE[-1], 5),
        request(6, "tools/list", rpc_envelope())])
    got = by_id(replies)
    result = got[1]["result"]
    assert result["supportedVersions"] == [MODERN] and result["resultType"] == "complete"
    assert result["capabilities"] == {"tools": {"listChanged": False}}
    assert result["_meta"]["io.modelcontextprotocol/serverInfo"]["name"] == "healthlog"
    assert result["cacheScope"] == "private" and result["ttlMs"] >= 0
    assert "health data" in result["instructions"]
    assert got[2]["error"]["code"] == -32022
    assert got[2]["error"]["data"] == {"supported": HANDSHAKE + [MODERN],
                                       "requested": "2027-01-01"}
    assert got[3]["error"]["code"] == -32602  # the envelope without capabilities
    assert got[4]["error"]["code"] == -32601  # 2026-07-28 has no ping
    assert got[5]["error"]["code"] == -32022  # no handshake on a modern connection
    listed = got[6]["result"]
    assert [t["name"] for t in listed["tools"]] == TOOLS and listed["resultType"] == "complete"
    # a connection that shook hands takes no enveloped request
    code, replies, _ = raw_stdio(store.data_dir, [initialize(HANDSHAKE[-1]),
                                                  request(1, "tools/list", rpc_envelope())])
    assert by_id(replies)[1]["error"]["code"] == -32600


def test_mcp_1_4_ping_notifications_and_cancellation(store):
    code, replies, _ = raw_stdio(store.data_dir, [
        initialize(HANDSHAKE[-1]), {"jsonrpc": "2.0", "method": "notifications/initialized"},
        request(1, "ping"),
        request(2, "tools/call", {"name": "get_series", "arguments": {"metric": "step_count"}}),
        {"jsonrpc": "2.0", "method": "notifications/cancelled",
         "params": {"requestId": 2, "reason": "the user moved on"}},
        {"jsonrpc": "2.0", "method": "notifications/cancelled", "params": {"requestId": 99}},
        {"jsonrpc": "2.0", "method": "notifications/whatever", "params": {"x": 1}},
        {"jsonrpc": "2.0", "id": 7, "result": {}},  # a response to nothing: ignored
        request(3, "ping", {})])
    assert code == 0
    assert [reply["id"] for reply in replies] == [0, 1, 2, 3]  # notifications get nothing
    assert by_id(replies)[1]["result"] == {} and by_id(replies)[3]["result"] == {}
    assert by_id(replies)[2]["result"]["isError"] is False


def test_mcp_1_5_malformed_and_invalid_messages(store):
    code, replies, log = raw_stdio(store.data_dir, [
        b"this is not json", b'{"jsonrpc": "2.0", "id": 1, "method": "ping"',
        b'"a string"', b'{"jsonrpc": "2.0", "id": 1, "method": "p\xffng"}',
        {"jsonrpc": "1.0", "id": 2, "method": "ping"},
        {"jsonrpc": "2.0", "id": {"no": 1}, "method": "ping"},
        {"jsonrpc": "2.0", "id": 3},
        {"jsonrpc": "2.0", "id": 4, "method": 7},
        request(5, "resources/list"), request(6, "no/such/method"),
        {"jsonrpc": "2.0", "id": 7, "method": "tools/list", "params": [1, 2]},
        [request(8, "ping"), request(9, "ping")],  # no batches after 2025-03-26
        b"{" + b" " * healthlog.MCP_MESSAGE_MAX + b"}",
        b"", b"   ",
        request(10, "ping")])
    assert code == 0
    errors = [(reply["id"], reply["error"]["code"]) for reply in replies[:-1]]
    assert errors == [(None, -32700), (None, -32700), (None, -32600), (None, -32700),
                      (2, -32600), (None, -32600), (3, -32600), (4, -32600), (5, -32601),
                      (6, -32601), (7, -32602), (None, -32600), (None, -32600)]
    assert replies[-1] == {"jsonrpc": "2.0", "id": 10, "result": {}}  # still serving
    assert any('msg="mcp stopped' in line for line in log)


def test_mcp_1_6_a_batch_is_answered_at_2025_03_26(store):
    code, replies, _ = raw_stdio(store.data_dir, [
        initialize("2025-03-26"),
        [request(1, "ping"), {"jsonrpc": "2.0", "method": "notifications/initialized"},
         request(2, "tools/list")], []])
    assert replies[0]["result"]["protocolVersion"] == "2025-03-26"
    assert isinstance(replies[1], list) and [r["id"] for r in replies[1]] == [1, 2]
    assert replies[2]["error"]["code"] == -32600  # an empty batch


# ---------------------------------------------------------------------------------------------
# MCP-2: the tools

def test_mcp_2_1_every_tool_is_read_only_and_described(seen):
    assert [tool.name for tool in seen.tools] == TOOLS
    for tool in seen.tools:
        hints = tool.annotations
        assert (hints.read_only_hint, hints.idempotent_hint, hints.destructive_hint,
                hints.open_world_hint) == (True, True, False, False), tool.name
        assert tool.input_schema["type"] == "object" and tool.description and tool.title
        assert tool.output_schema["type"] == "object"
    series = {tool.name: tool for tool in seen.tools}["get_series"]
    assert series.input_schema["required"] == ["metric"]
    assert series.input_schema["additionalProperties"] is False


def test_mcp_2_2_older_versions_see_what_their_version_knows(store):
    code, replies, _ = raw_stdio(store.data_dir, [
        initialize("2024-11-05"), request(1, "tools/list"),
        request(2, "tools/call", {"name": "list_metrics", "arguments": {}}),
        request(3, "tools/list", {"cursor": "next"})])
    got = by_id(replies)
    for tool in got[1]["result"]["tools"]:
        assert set(tool) == {"name", "description", "inputSchema"}  # 2024-11-05's fields
    result = got[2]["result"]
    assert "structuredContent" not in result
    assert [m["metric"] for m in json.loads(result["content"][0]["text"])["metrics"]] == [
        m["metric"] for m in get_json(store.address, "/api/catalog")["metrics"]]
    assert got[3]["error"]["code"] == -32602  # every tool is on the first page


def test_mcp_2_3_tool_errors_are_the_apis_words(store, seen):
    def api_message(path, **query) -> str:
        reply = call(store.address, "GET", path + "?" + "&".join(
            "%s=%s" % item for item in query.items()))
        assert reply.status in (400, 404), reply
        return reply.json()["error"]["message"]

    results = seen.results["errors"]
    texts = []
    for result in results[:-1]:
        assert result.is_error is True and result.structured_content is None
        texts.append(result.content[0].text)
    assert texts[0].startswith(api_message("/api/points", metric="no_such_metric"))
    assert "step_count" in texts[0]  # the metrics there are, named
    assert texts[1] == api_message("/api/plan", metric="step_count", range="custom",
                                   **{"from": "2025-03-10"})
    assert texts[2] == api_message("/api/summary", date="2025-02-30")
    assert texts[3] == api_message("/api/points", metric="step_count", tz="Mars/Olympus")
    assert "unknown argument bucket" in texts[4] and "metric is required" in texts[5]
    assert "from must be a local date" in texts[6]
    from mcp.shared.exceptions import MCPError

    assert isinstance(results[-1], MCPError) and results[-1].error.code == -32602


def test_mcp_2_4_replies_are_bounded_and_say_how_to_narrow(store, seen):
    weeks = {written_date(p["date"]) for p in store.corpus["weight"]}
    mondays = sorted({day - dt.timedelta(days=day.weekday()) for day in weeks})
    assert len(mondays) == WEEKS > healthlog.MCP_SERIES_MAX
    [result] = seen.results["bounded"]
    got = answer(result)
    assert got["bucket"] == "week" and got["truncated"] is True
    assert got["total_buckets"] == WEEKS
    assert [b["date"] for b in got["buckets"]] == [
        day.isoformat() for day in mondays[-healthlog.MCP_SERIES_MAX:]]  # the latest
    assert any("ask from and to" in note for note in got["notes"])
    assert "ask from and to" in result.content[0].text


# ---------------------------------------------------------------------------------------------
# MCP-3: every figure is the read API's

def test_mcp_3_1_list_metrics_is_the_catalog(store, seen):
    got = answer(seen.results["metrics"][0])
    api = get_json(store.address, "/api/catalog")
    assert got["groups"] == api["groups"]
    assert [(m["metric"], m["layer"]) for m in got["metrics"]] == [
        (m["metric"], m["layer"]) for m in api["metrics"]]
    for item, want in zip(got["metrics"], api["metrics"]):
        for key in ("units", "first", "last", "points", "group"):
            assert item[key] == want[key], (item["metric"], key)
        assert (item["name"], item["kind"]) == (want["meaning"]["name"],
                                                want["meaning"]["kind"])
    steps = {m["metric"]: m for m in got["metrics"]}["step_count"]
    written = sorted(written_date(p["date"]) for points in store.corpus["steps"].values()
                     for p in points)
    assert (steps["first_date"], steps["last_date"]) == (written[0].isoformat(),
                                                         written[-1].isoformat())
    assert steps["unit_labels"] == ["steps"]
    heart = {m["metric"]: m for m in got["metrics"]}["resting_heart_rate"]
    assert heart["unit_labels"] == ["bpm"] and heart["layer"] == "days"


def test_mcp_3_2_get_series_is_the_plan_then_the_points(store, seen):
    own = steps_by_day(store.corpus)
    for (args, bucket), result in zip(SERIES_CASES, seen.results["series"]):
        got = answer(result)
        query = {"metric": args["metric"], "tz": args.get("tz")}
        if "from" in args:
            query.update(range="custom", from_=args["from"], to=args["to"])
        else:
            query["range"] = args.get("range", "7d")
        plan = get_json(store.address, "/api/plan", **query)
        points = get_json(store.address, "/api/points", metric=args["metric"],
                          from_=plan["from"], to=plan["to"], tz=args.get("tz"),
                          bucket=plan["bucket"])
        assert (got["bucket"], got["from"], got["to"], got["words"]) == (
            plan["bucket"], points["from"], points["to"], plan["words"]), args
        if bucket:  # day data is never per hour, whatever the range
            assert got["bucket"] == bucket
        want = [(b["date"], b["local"], b["start"], run["units"], b["count"], b["fields"])
                for run in points["runs"] for b in run["buckets"]]
        assert [(b["date"], b["local"], b["start"], b["units"], b["count"], b["fields"])
                for b in got["buckets"]] == want, args
        combine = "sum" if args["metric"] == "step_count" else "avg"
        field = "Avg" if args["metric"] == "heart_rate" else "qty"
        for b in got["buckets"]:
            assert b["value"] == b["fields"][field][combine]
            if args["metric"] == "step_count" and got["bucket"] == "day" and not args.get("tz"):
                assert close(b["value"], own[dt.date.fromisoformat(b["date"])]), b["date"]


def test_mcp_3_3_get_day_summary_is_the_summary_page(store, seen):
    own = steps_by_day(store.corpus)
    for day, result in zip(SUMMARY_DAYS + [LAST], seen.results["summary"]):
        got = answer(result)
        want = get_json(store.address, "/api/summary", date=day.isoformat())
        assert got == want, day
        [card] = [c for c in got["cards"]["activity"] if c["metric"] == "step_count"]
        assert close(card["value"], own.get(day)), day  # null on a day without data
        before = [v for d, v in own.items() if day - dt.timedelta(days=30) <= d < day]
        assert close(card["usual"], statistics.median(before) if len(before) >= 5 else None)
        assert ("Steps: " + ("no data" if day in MISSING else "")) in result.content[0].text


def test_mcp_3_4_get_sleep_is_the_apis_nights_and_the_bodies(store, seen):
    first, last = SLEEP_RANGE["from"], SLEEP_RANGE["to"]
    got, latest = (answer(result) for result in seen.results["sleep"])
    api = get_json(store.address, "/api/points", metric="sleep_analysis", from_=first,
                   to=last, bucket="day")
    assert got["nights"] == api["nights"] and got["stage_order"] == api["stage_order"]
    plan = get_json(store.address, "/api/plan", metric="sleep_analysis", range="7d")
    assert latest["nights"] == get_json(
        store.address, "/api/points", metric="sleep_analysis", from_=plan["from"],
        to=plan["to"], bucket=plan["bucket"])["nights"]
    nights = {night["date"]: night for night in got["nights"]}
    assert len(nights) == len(store.corpus["nights"])
    for record in store.corpus["nights"]:  # the night is on the morning it ended
        night = nights[written_date(record["sleepEnd"]).isoformat()]
        assert close(night["asleep"], record["totalSleep"])  # HAE's own total
        assert close(night["in_bed"], record["inBed"])
        assert set(night["stages"]) == {"core", "deep", "rem", "awake"}
        for stage in night["stages"]:
            assert close(night["stages"][stage], record[stage]), stage
        assert night["sleep_end"][:19] == record["sleepEnd"][:19].replace(" ", "T")
        assert night["overlapping"] is False
    napped = nights[written_date(store.corpus["nap"]["sleepEnd"]).isoformat()]
    assert [close(nap["asleep"], 0.6) for nap in napped["naps"]] == [True]  # beside it


def test_mcp_3_5_compare_periods_from_the_day_buckets(store, seen):
    first, second = FIRST_PERIOD, SECOND_PERIOD
    got = {item["metric"]: item for item in answer(seen.results["compare"][0])["metrics"]}
    own = steps_by_day(store.corpus)

    def period(bounds) -> list:
        low, high = (dt.date.fromisoformat(bounds[k]) for k in ("from", "to"))
        return [v for d, v in sorted(own.items()) if low <= d <= high]

    for which, bounds in (("first", first), ("second", second)):
        steps = period(bounds)
        figures = got["step_count"][which]
        assert figures["days_with_data"] == len(steps)
        assert close(figures["total"], sum(steps)) and close(figures["mean"],
                                                             statistics.mean(steps))
        for metric, field in (("heart_rate", "Avg"), ("resting_heart_rate", "qty")):
            points = get_json(store.address, "/api/points", metric=metric, bucket="day",
                              from_=bounds["from"], to=bounds["to"])
            days = [b["fields"][field]["avg"] for run in points["runs"] for b in run["buckets"]]
            assert got[metric][which]["days_with_data"] == len(days)
            assert close(got[metric][which]["mean"], statistics.mean(days) if days else None)
            assert "total" not in got[metric][which]
        nights = [n["totalSleep"] for n in store.corpus["nights"]
                  if bounds["from"] <= n["sleepEnd"][:10] <= bounds["to"]]
        assert close(got["sleep_analysis"][which]["mean"],
                     statistics.mean(nights) if nights else None)
    change = got["step_count"]["change"]
    assert close(change["mean"], statistics.mean(period(second)) - statistics.mean(
        period(first)))
    assert close(change["total"], sum(period(second)) - sum(period(first)))
    assert close(change["mean_percent"], change["mean"] / statistics.mean(period(first)) * 100)
    assert got["step_count"]["unit_label"] == "steps"


def test_mcp_3_6_get_data_health_is_freshness_and_coverage(store, seen):
    bounds = HEALTH_RANGE
    got = answer(seen.results["health"][0])
    fresh = get_json(store.address, "/api/freshness")
    assert got["automations"] == fresh["automations"] and got["metrics"] == fresh["metrics"]
    cover = get_json(store.address, "/api/coverage", from_=bounds["from"], to=bounds["to"])
    for row in cover["rows"]:
        del row["values"]
    assert got["coverage"] == cover
    steps = [row for row in got["coverage"]["rows"] if row["metric"] == "step_count"]
    [row] = steps
    gaps = {(gap["from"], gap["to"]) for gap in row["gaps"]}
    assert gaps == {(day.isoformat(), day.isoformat()) for day in MISSING}
    for gap in row["gaps"]:
        assert gap["states"] == ["missing"] and "Manual Export" in gap["action"]
        assert "'Fast'" in gap["action"] and gap["from"] in gap["action"]
    text = seen.results["health"][0].content[0].text
    assert all(day.isoformat() in text for day in MISSING)


def test_mcp_3_7_a_late_automation_is_named_with_the_action_that_fills_it(store):
    """The stdio server's reader (its read-only connection, freshness judged at its
    clock), two days on: the automations are late, and each notice says what to do."""
    later = time.time() + 2 * 86400
    config = healthlog.Config(data_dir=store.data_dir, clock=lambda: later)
    conn = healthlog.open_read_only(config)
    try:
        reader = healthlog.mcp_read_only_reader(config, conn)
        session = healthlog.McpSession(reader)
        reply = session.receive(json.dumps(request(1, "tools/call", {
            "name": "get_data_health", "arguments": {}})).encode())
    finally:
        conn.close()
    got = reply["result"]["structuredContent"]
    states = {a["name"]: a["state"] for a in got["automations"]}
    assert states == {"Fast": "late", "Daily": "new", "Sleep": "new"}  # one delivery: new
    notices = [n for n in got["attention"] if n["kind"] == "automation"]
    assert sorted(n["subject"] for n in notices) == sorted(
        a["id"] for a in got["automations"] if a["state"] == "late")
    for notice in notices:
        assert notice["state"] == "late" and "Manual Export" in notice["action"]
    assert "'Fast' has sent nothing since" in reply["result"]["content"][0]["text"]


# ---------------------------------------------------------------------------------------------
# MCP-4: the transports

def test_mcp_4_1_stdio_writes_only_the_protocol_and_logs_no_value(store):
    code, replies, log = raw_stdio(store.data_dir, [
        initialize(HANDSHAKE[-1]),
        request(1, "tools/call", {"name": "get_series", "arguments": {
            "metric": "weight_body_mass", "range": "all"}}),
        request(2, "tools/call", {"name": "get_day_summary", "arguments": {}})])
    assert code == 0 and [reply["id"] for reply in replies] == [0, 1, 2]
    weights = [b["value"] for b in replies[1]["result"]["structuredContent"]["buckets"]]
    assert hf.CANARY_QTY in weights  # the value went out on stdout, and nowhere else
    records = [line for line in log if "level=DEBUG" not in line]
    assert records and all(line.startswith("time=") for line in records)
    assert_no_leaks(log)


def _file_state(data_dir: Path) -> dict:
    return {path.name: hashlib.sha256(path.read_bytes()).hexdigest()
            for path in sorted(data_dir.iterdir()) if path.is_file()}


def test_mcp_4_2_stdio_opens_the_store_read_only(tmp_path, serve_process):
    data_dir = tmp_path / "data"
    serve = serve_process(data_dir)
    status, _ = serve.client.ingest(hf.dumps_hae(hf.envelope(metrics=[
        hf.metric("step_count", ny_steps(DAYS[0], WATCH), "count")])), headers=MINUTES)
    assert status == 200
    wait_for(lambda: db_rows(data_dir)[0]["parse_status"] == "parsed", what="the fold")
    assert serve.terminate() == 0
    before = _file_state(data_dir)
    code, replies, _ = raw_stdio(data_dir, [
        initialize(HANDSHAKE[-1]),
        request(1, "tools/call", {"name": "get_day_summary", "arguments": {}}),
        request(2, "tools/call", {"name": "get_data_health", "arguments": {}})])
    assert code == 0 and replies[1]["result"]["isError"] is False
    after = {name: digest for name, digest in _file_state(data_dir).items()
             if not name.endswith(("-wal", "-shm"))}  # SQLite's reader files, empty of pages
    assert after == {name: digest for name, digest in before.items()
                     if not name.endswith(("-wal", "-shm"))}
    wal = data_dir / (healthlog.DB_NAME + "-wal")
    assert not wal.exists() or wal.stat().st_size == 0  # nothing written
    empty = tmp_path / "empty"
    empty.mkdir()
    done = subprocess.run([sys.executable, "-m", "healthlog", "mcp", "--data", str(empty)],
                          input=b"", capture_output=True, timeout=60, cwd=str(ROOT))
    assert done.returncode == 2 and done.stdout == b""
    assert done.stderr.decode().startswith("healthlog: no healthlog database at")
    assert list(empty.iterdir()) == []  # nothing created


def test_mcp_4_3_a_delivery_folds_while_stdio_reads(tmp_path, serve_process):
    """The stdio server reads the store without pause while ``serve`` folds a delivery
    beside it: the fold completes, and every reply is one snapshot, before or after the
    fold, never half of it."""
    data_dir = tmp_path / "data"
    serve = serve_process(data_dir)
    day = DAYS[10]
    old = [p for p in ny_steps(day, WATCH) if p["date"][11:13] < "12"]
    status, _ = serve.client.ingest(hf.dumps_hae(hf.envelope(metrics=[
        hf.metric("step_count", old, "count")])), headers=MINUTES)
    assert status == 200
    wait_for(lambda: db_rows(data_dir)[0]["parse_status"] == "parsed", what="the first fold")
    # steps between the first delivery's (minutes 2, 6, 10…: no point is sent twice), and a
    # week of heart rate by the minute in the same delivery, so that its fold takes a while
    new = [{"date": ny_stamp(day, m), "qty": 3, "source": WATCH} for m in range(2, 24 * 60, 4)]
    heart = [{"date": ny_stamp(day - dt.timedelta(days=d), m), "Min": 50, "Avg": 60 + m % 9,
              "Max": 80, "source": WATCH} for d in range(7) for m in range(0, 24 * 60)]
    proc = subprocess.Popen([sys.executable, "-m", "healthlog", "mcp", "--data", str(data_dir)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, cwd=str(ROOT))
    arrivals: list = []  # (monotonic time, the day's steps in the reply, the request's id)
    sent: dict = {}  # request id -> monotonic time it was written
    stop = threading.Event()

    def read() -> None:
        for line in proc.stdout:
            reply = json.loads(line)
            buckets = reply["result"]["structuredContent"]["buckets"]
            arrivals.append((time.monotonic(), [b["value"] for b in buckets
                                                if b["date"] == day.isoformat()], reply["id"]))

    def write() -> None:
        ask = {"name": "get_series", "arguments": {  # four days: buckets of days
            "metric": "step_count", "from": (day - dt.timedelta(days=3)).isoformat(),
            "to": day.isoformat()}}
        for number in range(5000):
            if stop.is_set():
                break
            sent[number] = time.monotonic()
            proc.stdin.write(json.dumps(request(number, "tools/call", ask)).encode() + b"\n")
            proc.stdin.flush()
            while len(arrivals) < number - 3 and not stop.is_set():
                time.sleep(0.002)  # a few requests ahead of the replies, never idle
        proc.stdin.close()

    reader, writer = threading.Thread(target=read), threading.Thread(target=write)
    reader.start()
    writer.start()
    try:
        wait_for(lambda: len(arrivals) >= 5, what="the stdio server answering")
        posted = time.monotonic()
        status, _ = serve.client.ingest(hf.dumps_hae(hf.envelope(metrics=[
            hf.metric("step_count", new, "count"),
            hf.metric("heart_rate", heart, "count/min")])), headers=MINUTES)
        assert status == 200
        wait_for(lambda: db_rows(data_dir)[-1]["parse_status"] == "parsed", timeout=60,
                 what="the delivery folded beside the reader")
        folded = time.monotonic()
        # a reply to a request written once the fold had committed (the server reads its
        # requests in order: that one was read after the commit)
        wait_for(lambda: any(sent[number] > folded for _, _, number in arrivals),
                 what="a reply to a request written after the fold")
    finally:
        stop.set()
        writer.join(60)
        reader.join(60)
        assert proc.wait(60) == 0
    before = sum(p["qty"] for p in old)
    after = before + sum(p["qty"] for p in new if written_date(p["date"]) == day)
    assert {tuple(values) for _, values, _ in arrivals} <= {(before,), (after,)}
    assert arrivals[0][1] == [before]
    asked_after = [values for _, values, number in arrivals if sent[number] > folded]
    assert asked_after and all(values == [after] for values in asked_after)
    during = [at for at, _, _ in arrivals if posted <= at <= folded]
    assert during, "no reply while the delivery waited and folded"


def mcp_post(address, body, headers: dict = None, auth: bool = True):
    sent = {"Content-Type": "application/json",
            "Accept": "application/json, text/event-stream"}
    sent.update(headers or {})
    return call(address, "POST", "/mcp", body=body if isinstance(body, bytes)
                else json.dumps(body).encode(), headers=sent, auth=auth)


def test_mcp_4_4_post_mcp_needs_the_token_and_its_own_origin(store):
    ping = request(1, "ping")
    assert mcp_post(store.address, ping, auth=False).status == 401
    assert mcp_post(store.address, ping, {"Authorization": "Bearer wrong"},
                    auth=False).status == 401
    own = "http://%s:%d" % store.address
    for origin in ("http://evil.example", "null", "http://127.0.0.1:1", "https://%s:%d"
                   % ("localhost", store.address[1])):
        reply = mcp_post(store.address, ping, {"Origin": origin})
        assert reply.status == 403, origin
        assert reply.json()["error"]["code"] == "forbidden"
    assert mcp_post(store.address, ping, {"Sec-Fetch-Site": "cross-site"}).status == 403
    reply = mcp_post(store.address, ping, {"Origin": own})
    assert reply.status == 200 and reply.json() == {"jsonrpc": "2.0", "id": 1, "result": {}}
    login = call(store.address, "POST", "/login", body=("token=" + TOKEN).encode(),
                 headers={"Content-Type": "application/x-www-form-urlencoded"}, auth=False)
    cookie = login.headers["Set-Cookie"].split(";", 1)[0]
    reply = mcp_post(store.address, ping, {"Cookie": cookie, "Origin": own}, auth=False)
    assert reply.status == 200 and reply.json()["result"] == {}  # the page's session too


def test_mcp_4_5_http_answers_as_the_transport_says(store):
    for method in ("GET", "DELETE"):
        reply = call(store.address, method, "/mcp",
                     headers={"Accept": "text/event-stream"})
        assert reply.status == 405 and reply.headers["Allow"] == "POST", method
        assert call(store.address, method, "/mcp", auth=False).status == 401
    notification = {"jsonrpc": "2.0", "method": "notifications/initialized"}
    reply = mcp_post(store.address, notification, {"MCP-Protocol-Version": HANDSHAKE[-1]})
    assert reply.status == 202 and reply.body == b""
    assert mcp_post(store.address, {"jsonrpc": "2.0", "id": 3, "result": {}}).status == 202
    assert mcp_post(store.address, request(1, "ping"),
                    {"Content-Type": "text/plain"}).status == 415
    assert mcp_post(store.address, request(1, "ping"),
                    {"Accept": "text/event-stream"}).status == 406
    too_long = {"Content-Length": str(healthlog.MCP_MESSAGE_MAX + 1)}  # refused unread
    assert mcp_post(store.address, b"{}", too_long).status == 413
    reply = mcp_post(store.address, b"{not json")
    assert reply.status == 400 and reply.json()["error"]["code"] == -32700

    def modern(message, **headers):
        sent = {"MCP-Protocol-Version": MODERN, "Mcp-Method": message["method"]}
        sent.update({name.replace("_", "-"): value for name, value in headers.items()})
        return mcp_post(store.address, message, sent)

    reply = modern(request(1, "server/discover", rpc_envelope()))
    assert reply.status == 200 and reply.json()["result"]["supportedVersions"] == [MODERN]
    reply = modern(request(1, "tools/list", rpc_envelope()), Mcp_Method="tools/call")
    assert reply.status == 400 and reply.json()["error"]["code"] == -32020
    call_tool = request(2, "tools/call", rpc_envelope(name="list_metrics", arguments={}))
    reply = modern(call_tool, Mcp_Name="get_sleep")
    assert reply.status == 400 and reply.json()["error"]["code"] == -32020
    reply = modern(call_tool, Mcp_Name="list_metrics")
    assert reply.status == 200 and reply.json()["result"]["resultType"] == "complete"
    reply = modern(request(1, "resources/list", rpc_envelope()))
    assert reply.status == 404 and reply.json()["error"]["code"] == -32601
    reply = mcp_post(store.address, request(1, "tools/list"),
                     {"MCP-Protocol-Version": "2099-01-01"})
    assert reply.status == 400 and reply.json()["error"]["code"] == -32022
    reply = mcp_post(store.address, request(1, "no/such"),
                     {"MCP-Protocol-Version": HANDSHAKE[-1]})
    assert reply.status == 200 and reply.json()["error"]["code"] == -32601  # handshake era
    reply = mcp_post(store.address, [request(1, "ping"), request(2, "ping")],
                     {"MCP-Protocol-Version": "2025-03-26"})
    assert reply.status == 200 and [r["id"] for r in reply.json()] == [1, 2]


CONFORMANCE_VERSION = "0.1.12"
"""The MCP conformance CLI .ci/run installs (npm install @modelcontextprotocol/conformance
@0.1.12): 0.1.13 on needs Node 22, and Debian's node is 20."""
CONFORMANCE_SCENARIOS = ("server-initialize", "ping", "tools-list")
"""The server scenarios that apply to a tools-only server. The others ask for the suite's
own test tools (tools-call-*: test_simple_text, test_image_content…), for prompts,
resources, logging, completions, sampling, elicitation or server-sent streams, which this
server does not offer; dns-rebinding-protection is for servers without authentication
bound to localhost (serve listens for the phone, and every request needs the token)."""


def conformance() -> str:
    """The conformance CLI, or skip; a failure instead when CI demands it."""
    found = os.environ.get("HEALTHLOG_MCP_CONFORMANCE")
    problem = None
    if not shutil.which("node"):
        problem = "node is not installed (apt-get install nodejs npm)"
    elif not found or not os.path.exists(found):
        problem = ("the MCP conformance CLI is not installed (npm install --prefix DIR"
                   " @modelcontextprotocol/conformance@%s, then HEALTHLOG_MCP_CONFORMANCE="
                   "DIR/node_modules/.bin/conformance)" % CONFORMANCE_VERSION)
    if problem is not None:
        if os.environ.get("HEALTHLOG_REQUIRE_MCP_CONFORMANCE") == "1":
            pytest.fail(problem + "; HEALTHLOG_REQUIRE_MCP_CONFORMANCE=1 demands it")
        pytest.skip(problem)
    return found


class TokenRelay(LocalServer):
    """A relay on 127.0.0.1:0 that adds the token to each request for ``serve``: the
    conformance CLI has no way to send one."""

    def __init__(self, address: tuple):
        import http.client
        import http.server

        target = address

        class Handler(http.server.BaseHTTPRequestHandler):
            def relay(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else None
                headers = {k: v for k, v in self.headers.items()
                           if k.lower() not in ("host", "connection", "content-length")}
                headers["Authorization"] = "Bearer " + TOKEN
                conn = http.client.HTTPConnection(*target, timeout=60)
                try:
                    conn.request(self.command, self.path, body=body, headers=headers)
                    response = conn.getresponse()
                    data = response.read()
                finally:
                    conn.close()
                self.send_response(response.status)
                for key, value in response.getheaders():
                    if key.lower() not in ("content-length", "connection"):
                        self.send_header(key, value)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_POST = do_DELETE = relay

            def log_message(self, *args) -> None:
                pass

        super().__init__(Handler, name="token-relay")


@pytest.mark.parametrize("scenario", CONFORMANCE_SCENARIOS)
def test_mcp_4_6_the_conformance_cli_passes_against_serve(store, scenario):
    cli = conformance()
    with TokenRelay(store.address) as relay:
        done = subprocess.run(
            ["node", cli, "server", "--url", "http://127.0.0.1:%d/mcp" % relay.port,
             "--scenario", scenario], capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert "0 failed" in done.stdout and "Passed: " in done.stdout, done.stdout[-3000:]
