"""Hostile input (RELY-4): fuzzed and hand-made hostile bodies against a real server.

One campaign per JSON mode (orjson, then the standard json module: ``json_mode``) posts,
to a real Cheroot server on 127.0.0.1:0 over a real data directory,

* a named corpus of hostile bodies and requests: truncations, invalid UTF-8, lone
  surrogate escapes, NaN/Infinity, numbers beyond a double or int64, duplicate keys,
  100 000 levels of nesting, strings of megabytes, wrong types in every place,
  10 000 metrics or sections, names with control characters and U+2028, empty, chunked,
  malformed chunked and oversized bodies, CSV, missing and wrong tokens;
* a seeded mutation fuzzer over real-shaped bodies from ``hae_factory`` (byte flips,
  truncation, splices, hostile tokens and values put in random places, deep wrapping);
* hypothesis-generated HAE-like documents with arbitrary JSON in every place,

lets the service's own fold thread fold whatever was accepted, and keeps every log record.
RELY-4.1 checks the answers and the archive, RELY-4.2 the fold, RELY-4.3 the log lines.
RELY-4.4 (``torture``) runs the same checks over many more cases.

The expected answer of each body comes from a reference written here, apart from
``check_delivery_shape``: strict UTF-8 JSON (RFC 8259: no NaN/Infinity, no lone
surrogate), every number a finite double or an integer within int64, and a top-level
object whose (last) ``data`` member is an object. Bodies nested deeper than 200 levels
may be refused or accepted (an accepted one must then fold); beyond 2 000 they must be
refused.
"""

import collections
import dataclasses
import datetime as dt
import hashlib
import json
import logging
import os
import random
import re
import socket
import sqlite3
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator, Optional

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import hae_factory as hf
import healthlog
from conftest import TOKEN, LogCapture, assert_no_leaks, parse_logfmt, read_to_end, wait_for

pytestmark = pytest.mark.usefixtures("json_mode")  # the fold runs with orjson and without

MAX_BODY = 12 << 20
"""The server's body limit in these tests: large enough for the megabyte strings, small
enough that an oversized body costs little."""

DEFAULT_MUTANTS = 100  # per JSON mode, with another seed in each: 200 distinct mutants
DEFAULT_EXAMPLES = 30  # hypothesis documents per JSON mode
TORTURE_MUTANTS = 6000
TORTURE_EXAMPLES = 400
TORTURE_BUDGET_S = 28.0  # per JSON mode: the mutation loop stops early past this
SEEDS = {"orjson": 20261130, "stdlib": 20261131}
BATCH = 25  # cases between two /healthz probes

ALLOWED = {200, 400, 401, 413, 415}
"""Every answer the ingest route may give a hostile request (503 only with Retry-After)."""

KNOWN_FAILURES = {"layer_not_inferable", "content_not_parsed", "body_missing",
                  "body_unreadable", "body_too_big", "fold_deadline_exceeded",
                  "nesting_too_deep"}

AUTOMATION = {"automation-name": "Hostile tracker",
              "automation-id": "2B0C8A55-6E0F-4C36-9D8B-0F4E3C2A1D10",
              "automation-aggregation": "Minutes", "automation-period": "Default",
              "session-id": "7E3F1A2B-4C5D-4E6F-8A9B-0C1D2E3F4A5B"}

HOSTILE_NAMES = ["a\nb", "a\r\nlevel=ERROR msg=forged", "x\u2028y", "x\u2029y", "n\u0085l",
                 "\x1b[31mred\x1b[0m", "nul\x00byte", 'q" level=ERROR msg="forged', "back\\slash",
                 "tab\there", "\ufeffbom", "\U0001f600emoji", " ", "", "=", "a=b c=d",
                 "x" * 70 + "\nafter-the-cut"]
"""Names and keys that would break or forge a log line if written raw."""

TIME_SPELLINGS = ["2024-03-08 10:00:00 -0800", "2024-03-08 7:57:00\u202fam +1000",
                  "2024-03-08T10:00:00Z", "2024-03-08", 1709913600, 1709913600000,
                  1709913600.5, "2024-02-30 25:61:61 +2500", "", "0000-00-00 00:00:00 +0000",
                  "9999-12-31 23:59:59 +1400", "1900-01-01 00:00:00 +0000", -1, 0, 1e300,
                  -1e300, True, None, [], {}, "2024-03-08 10:00:00 -0800" * 50]

HOSTILE_VALUES = [None, True, False, 0, -0.0, 1, -1, 2 ** 63 - 1, -(2 ** 63), 1e308, -1e308,
                  5e-324, "", "x", "NaN", "Infinity", "1e400", [], {}, [None], {"": None},
                  [[[[[[[[]]]]]]]], {"a": {"b": {"c": {}}}}, "\u2028", "\x00",
                  "2024-03-08 10:00:00 -0800", 1709913600, "a\nb"] + HOSTILE_NAMES[:8]
"""Values a structural mutation puts in a random place of a real-shaped document."""

RAW_NUMBERS = [b"NaN", b"Infinity", b"-Infinity", b"1e400", b"-1e400", b"1e309",
               b"18446744073709551616", b"9223372036854775808", b"-9223372036854775809",
               b"9223372036854775807", b"-9223372036854775808", b"1e-400", b"-0",
               b"0." + b"0" * 400 + b"1", b"1" + b"0" * 400, b"1.7976931348623157e308",
               b"2.2250738585072014e-308", b"4.9e-324", b"1E5", b"-0.0e-0"]
"""Number literals a raw mutation writes in place of a number of the body."""

RAW_STRINGS = [b'"\\ud800"', b'"\\udfff"', b'"\\ud83d\\ude00"', b'"\\ud83d\\ud83d"',
               b'"\\\\ud800"', b'"\\u0000"', b'"\\u2028"', b'"\xe2\x80\xa8"', b'"\xff"',
               b'"\xc0\xaf"', b'"\xed\xa0\x80"', b'"\xe2\x80"', b'"a\nb"', b'"\\x41"',
               b'"' + b"\\" * 3 + b'"', b'"\t"']
"""String literals a raw mutation writes in place of a string of the body."""


# -- HTTP over a raw socket: every answer with its headers, chunked and malformed bodies --


@dataclasses.dataclass(repr=False)  # its bodies are megabytes: no repr in reports
class Answer:
    status: int
    headers: dict
    body: bytes


def _header_bytes(headers: dict) -> bytes:
    out = b""
    for name, value in headers.items():
        value = value if isinstance(value, bytes) else str(value).encode("utf-8")
        out += name.encode("latin-1") + b": " + value + b"\r\n"
    return out


def exchange(address: tuple, method: str, path: str, headers: dict, body: bytes = None,
             chunked: bool = False, raw_body: bytes = None, head_only: bool = False,
             timeout: float = 60.0) -> Answer:
    """One request on a fresh connection (Connection: close); the answer read to EOF.

    ``chunked`` sends ``body`` in chunks of varied size; ``raw_body`` is written as it is
    (a malformed chunked coding); ``head_only`` sends the head and nothing else (the
    answer must come from the head alone). A server that does not answer within
    ``timeout`` fails the test: a hang is a defect.
    """
    all_headers = {"Host": "127.0.0.1", "Connection": "close"}
    if body is not None and not chunked and raw_body is None:
        all_headers["Content-Length"] = str(len(body))
    if chunked or raw_body is not None:
        all_headers["Transfer-Encoding"] = "chunked"
    all_headers.update(headers)
    head = ("%s %s HTTP/1.1\r\n" % (method, path)).encode("latin-1")
    head += _header_bytes(all_headers) + b"\r\n"
    with socket.create_connection(address, timeout=timeout) as sock:
        try:
            sock.sendall(head)
            if raw_body is not None:
                sock.sendall(raw_body)
            elif chunked:
                rng, view, sent = random.Random(len(body or b"")), memoryview(body or b""), 0
                while sent < len(view):
                    size = rng.choice((1, 7, 100, 4096, 65536, 1 << 20))
                    piece = view[sent:sent + size]
                    sock.sendall(b"%x\r\n" % len(piece) + piece + b"\r\n")
                    sent += len(piece)
                sock.sendall(b"0\r\n\r\n")
            elif body is not None and not head_only:
                sock.sendall(body)
            sock.shutdown(socket.SHUT_WR)  # the request is complete: no more is coming
        except OSError:  # the server answered early (413) and closed: read its answer
            pass
        data = read_to_end(sock)
    head_part, _, payload = data.partition(b"\r\n\r\n")
    lines = head_part.split(b"\r\n")
    assert lines and lines[0].startswith(b"HTTP/1."), "no HTTP answer: %r" % data[:200]
    status = int(lines[0].split(b" ", 2)[1])
    answer_headers = {}
    for line in lines[1:]:
        name, _, value = line.partition(b":")
        answer_headers[name.strip().lower().decode("latin-1")] = value.strip().decode("latin-1")
    return Answer(status, answer_headers, payload)


# -- the reference: what the ingest route must accept --------------------------------


class _Refused(Exception):
    pass


def _ref_float(text: str) -> float:
    value = float(text)
    if value in (float("inf"), float("-inf")):
        raise _Refused("beyond a double")
    return value


def _ref_int(text: str) -> int:
    if len(text.lstrip("-")) > 19:
        raise _Refused("beyond int64")
    value = int(text)
    if not -(2 ** 63) <= value <= 2 ** 63 - 1:
        raise _Refused("beyond int64")
    return value


def _ref_constant(name: str):
    raise _Refused(name)


def doc_depth(doc) -> int:
    """Levels of arrays and objects in a parsed document, counted without recursion."""
    deepest, stack = 0, [(doc, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, (dict, list)):
            deepest = max(deepest, depth)
            stack.extend((child, depth + 1)
                         for child in (node.values() if isinstance(node, dict) else node))
    return deepest


def _strings_are_utf8(value) -> bool:
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:
                return False
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return True


STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"')


def nesting_depth(text: str) -> int:
    """Brackets open at once, outside strings (an estimate for broken JSON)."""
    bare = STRING.sub('""', text)
    depth = deepest = 0
    for match in re.finditer(r"[\[\]{}]", bare):
        depth += 1 if match.group() in "[{" else -1
        deepest = max(deepest, depth)
    return deepest


ACCEPT, REFUSE, EITHER = "accept", "refuse", "either"
NESTING_PROMISED = 200
"""Levels of nesting every body within the other rules must be accepted with (HAE sends
about six); deeper ones may be refused (400) but, once accepted, must fold."""


def reference_verdict(body: bytes) -> tuple:
    """(ACCEPT | REFUSE | EITHER, parsed document or None) for a body posted as JSON."""
    if not body.strip():
        return REFUSE, None
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError:
        return REFUSE, None
    try:  # duplicate keys: the last one counts
        doc = json.loads(text, parse_float=_ref_float, parse_int=_ref_int,
                         parse_constant=_ref_constant)
    except _Refused:
        return REFUSE, None
    except RecursionError:
        return (REFUSE if nesting_depth(text) > 2000 else EITHER), None
    except ValueError:
        return REFUSE, None
    if not _strings_are_utf8(doc):
        return REFUSE, None
    if not isinstance(doc, dict) or not isinstance(doc.get("data"), dict):
        return REFUSE, None
    return (EITHER if doc_depth(doc) > NESTING_PROMISED else ACCEPT), doc


# -- cases -------------------------------------------------------------------------------


@dataclasses.dataclass(repr=False)  # its bodies are megabytes: no repr in reports
class Case:
    label: str
    body: bytes
    headers: dict = dataclasses.field(default_factory=lambda: dict(AUTOMATION))
    expect: frozenset = None  # exact statuses allowed; None: from the reference verdict
    path: str = "/api/ingest"
    mode: str = "plain"  # plain | chunked | raw | head
    raw_body: bytes = None
    fold: frozenset = None  # final statuses allowed for an accepted body
    min_bad: int = 0  # bad_points at least (for parsed/partial)
    token: bool = True


@dataclasses.dataclass(repr=False)  # its bodies are megabytes: no repr in reports
class Sent:
    case: Case
    answer: Answer
    verdict: str
    doc: object
    delivery_id: int = None
    kind: str = "named"


def _point(**fields) -> dict:
    point = {"date": "2024-03-08 10:%02d:00 -0800" % fields.pop("minute", 0), "qty": 1}
    point.update(fields)
    return {k: v for k, v in point.items() if v is not _DROP}


_DROP = object()


def _metrics(*metrics) -> bytes:
    return json.dumps({"data": {"metrics": list(metrics)}}, ensure_ascii=False).encode()


def _metric(points, name="step_count", units="count") -> dict:
    return {"name": name, "units": units, "data": points}


def _nest(depth: int, inner: str = "1", kind: str = "[") -> str:
    if kind == "[":
        return "[" * depth + inner + "]" * depth
    return '{"k":' * depth + inner + "}" * depth


def _with_qty(raw: str) -> bytes:
    return ('{"data":{"metrics":[{"name":"step_count","units":"count","data":[{"date":'
            '"2024-03-08 10:00:00 -0800","qty":%s,"source":"Anton\u2019s Apple Watch"}]}]}}'
            % raw).encode()


def base_bodies() -> list:
    """Real-shaped bodies from hae_factory: (name, bytes)."""
    two_hours = dt.datetime.combine(hf.DEFAULT_DAY, dt.time(2))
    rng = random.Random(5)
    bodies = [
        ("metrics", hf.dumps_hae(hf.metrics_payload(
            3, ("step_count", "heart_rate", "blood_pressure"), start=hf.DEFAULT_DAY,
            end=two_hours))),
        ("metrics-resend", hf.dumps_hae(hf.metrics_payload(
            3, ("step_count", "active_energy"), start=hf.DEFAULT_DAY, end=two_hours),
            rng=rng, pretty=False)),
        ("sleep", hf.dumps_hae(hf.metrics_payload(4, ("sleep_analysis",),
                                                  sleep="segments"))),
        ("workout", hf.dumps_hae(hf.envelope(workouts=[hf.workout_v2(3, route_points=12)]))),
        ("records", hf.dumps_hae(hf.envelope(**hf.records_sections(
            3, hf.DEFAULT_DAY, hf.DEFAULT_DAY + dt.timedelta(days=3), ecg_samples=20)))),
        ("canary", hf.dumps_hae(hf.canary_payload(3))),
    ]
    return bodies


def named_cases() -> list:
    """The hand-made hostile corpus, each with its exact expected answer."""
    base = hf.dumps_hae(hf.metrics_payload(
        7, ("step_count", "heart_rate"), start=hf.DEFAULT_DAY,
        end=dt.datetime.combine(hf.DEFAULT_DAY, dt.time(1))))
    ok, bad = frozenset({200}), frozenset({400})
    cases = []

    def add(label, body, expect=None, **kw):
        cases.append(Case(label, body, expect=expect, **kw))

    # Not a delivery at all.
    add("empty body", b"", bad)
    add("whitespace body", b" \r\n\t ", bad)
    for text in (b"null", b"[]", b'"data"', b"42", b"true", b"{}", b'{"Data":{}}',
                 b'{"data":[]}', b'{"data":"x"}', b'{"data":null}', b'{"data":1}',
                 b'[{"data":{}}]', b'{"data":{}} x', b'{"data":{}}{"data":{}}',
                 b"\xef\xbb\xbf" + base, b"{'data':{}}", b'{"data":{},}', b'{"data":{"a":1,}}'):
        add("not HAE JSON %r" % text[:20], text, bad)
    add("trailing whitespace", base + b"\n\n  \t", ok, fold=frozenset({"parsed"}))
    # Truncations and invalid UTF-8.
    for cut in (1, 2, len(base) // 3, len(base) // 2, len(base) - 1):
        add("truncated at %d" % cut, base[:cut], bad)
    at = base.index(b"Anton")
    for label, junk in (("0xff", b"\xff"), ("overlong", b"\xc0\xaf"), ("cesu", b"\xed\xa0\x80"),
                        ("cut multibyte", b"\xe2\x80"), ("latin-1", b"\x92"), ("0xfe", b"\xfe")):
        add("invalid UTF-8 %s" % label, base[:at] + junk + base[at:], bad)
    add("raw control character in a string", base[:at] + b"\n" + base[at:], bad)
    add("raw U+2028 in a string", base[:at] + "\u2028".encode() + base[at:], ok)
    # Surrogate escapes.
    for raw, expect in (('"\\ud800"', bad), ('"\\udfff"', bad), ('"\\ud800x"', bad),
                        ('"\\ud83d\\ud83d"', bad), ('"\\udc00\\ud800"', bad),
                        ('"\\ud83d\\ude00"', ok), ('"\\\\ud800"', ok), ('"\\u0000"', ok)):
        add("surrogate %s" % raw, _with_qty(raw), expect)
    add("lone surrogate in a key",
        b'{"data":{"metrics":[],"\\udbff":1}}', bad)
    # Numbers.
    for raw, expect in (("NaN", bad), ("Infinity", bad), ("-Infinity", bad), ("1e400", bad),
                        ("-1e400", bad), ("1e309", bad), ("1.7976931348623157e308", ok),
                        ("1e-400", ok), ("9223372036854775807", ok),
                        ("-9223372036854775808", ok), ("9223372036854775808", bad),
                        ("-9223372036854775809", bad), ("18446744073709551616", bad),
                        ("1" + "0" * 5000, bad), ("0." + "0" * 5000 + "1", ok),
                        ("1" + "0" * 400 + ".0", bad), ('"NaN"', ok), ("-0", ok), ("0e0", ok),
                        ("01", bad), (".5", bad), ("+1", bad), ("0x10", bad)):
        add("qty %s" % raw[:24], _with_qty(raw), expect)
    # Duplicate keys: the last one counts, in both parsers.
    add("data twice, last an object", b'{"data":[],"data":{"metrics":[]}}', ok)
    add("data twice, last not an object", b'{"data":{"metrics":[]},"data":5}', bad)
    add("duplicate keys in a point",
        b'{"data":{"metrics":[{"name":"step_count","units":"count","data":[{"date":"garbage",'
        b'"qty":1,"qty":{"x":2},"date":"2024-03-08 10:00:00 -0800"}]}]}}', ok,
        fold=frozenset({"parsed"}))
    add("duplicate metrics section",
        b'{"data":{"metrics":5,"metrics":[{"name":"step_count","units":"count","data":[]}]}}',
        ok, fold=frozenset({"parsed"}))
    # Nesting.
    for depth in (100_000, 5_000):
        add("%d nested arrays at the top" % depth, _nest(depth).encode(), bad)
        add("%d nested objects in data" % depth,
            ('{"data":%s}' % _nest(depth, "{}", "{")).encode(), bad)
        add("%d nested arrays in a point" % depth, _with_qty(_nest(depth)), bad)
        add("%d unclosed arrays" % depth, ('{"data":{"x":' + "[" * depth).encode(), bad)
    add("150 nested arrays in a point", _with_qty(_nest(150)), ok, fold=frozenset({"parsed"}))
    add("150 nested objects in a workout",
        ('{"data":{"workouts":[{"start":"2024-03-08 10:00:00 -0800","end":"2024-03-08 '
         '10:30:00 -0800","name":"Run","metadata":%s}]}}' % _nest(150, "{}", "{")).encode(), ok)
    for depth in (300, 450, 600, 900):  # accepted or refused at ingest; never a crash in the fold
        add("%d nested arrays in a point" % depth, _with_qty(_nest(depth)),
            frozenset({200, 400}))
    # Megabytes.
    big = "x" * (4 << 20)
    add("4 MiB source", _metrics(_metric([_point(source=big)])), ok, fold=frozenset({"parsed"}))
    add("4 MiB key in data", json.dumps({"data": {big: 1, "metrics": []}}).encode(), ok,
        fold=frozenset({"partial"}))
    add("8 MiB string in an unknown section",
        json.dumps({"data": {"unknown": "y" * (8 << 20)}}).encode(), ok,
        fold=frozenset({"partial"}))
    add("1 MiB metric name with an unreadable point",
        _metrics(_metric([_point(date="garbage")], name="m" * (1 << 20))), ok,
        fold=frozenset({"failed"}))
    add("over the limit by Content-Length", b"{" * (MAX_BODY + 1), frozenset({413}), mode="head")
    add("over the limit, chunked", b'{"data":{"x":"' + b" " * (MAX_BODY + 10) + b'"}}',
        frozenset({413}), mode="chunked")
    # Chunked transfer coding.
    add("chunked real body", base, ok, mode="chunked", fold=frozenset({"parsed"}))
    add("chunked, bad size line", b"", bad, mode="raw", raw_body=b"zz\r\nabc\r\n0\r\n\r\n")
    for size in (b"ffffffffffffffffffff", b"7fffffffffffffff", b"ffffffff"):
        # A chunk announced past the body limit is refused before it is read.
        add("chunked, size %s beyond the data" % size.decode(), b"", frozenset({413}),
            mode="raw", raw_body=size + b"\r\n{}\r\n0\r\n\r\n")
    add("chunked, missing CRLF", b"", bad, mode="raw",
        raw_body=b"5\r\n{\"dat0\r\n\r\n")
    add("chunked, empty", b"", bad, mode="raw", raw_body=b"0\r\n\r\n")
    # Requests refused before the body.
    add("CSV", b"date,qty\n2024-03-08,1\n", frozenset({415}),
        headers=dict(AUTOMATION, **{"Content-Type": "text/csv"}))
    add("multipart", base, frozenset({415}),
        headers=dict(AUTOMATION, **{"Content-Type": "multipart/form-data; boundary=x"}))
    add("no token", base, frozenset({401}), token=False)
    add("wrong token", base, frozenset({401}), token=False,
        headers=dict(AUTOMATION, Authorization="Bearer " + TOKEN[:-1] + "X"))
    add("bad ingest name", base, frozenset({400, 404}), path="/api/ingest/..%2F..%2Fetc")
    add("ingest name with a NUL", base, bad, path="/api/ingest/a%00b")
    # Wrong types everywhere: accepted, folded, the unreadable counted.
    failed, parsed = frozenset({"failed"}), frozenset({"parsed"})
    point_ok = _point()
    for label, body, outcome, min_bad in (
            ("metrics is an object", {"metrics": {"name": "step_count"}}, failed, 0),
            ("metrics is a string", {"metrics": "step_count"}, failed, 0),
            ("metrics is null", {"metrics": None}, parsed, 0),
            ("metric is a string", {"metrics": ["step_count", _metric([point_ok])]}, parsed, 1),
            ("metric is a list", {"metrics": [[1, 2], _metric([point_ok])]}, parsed, 1),
            ("metric name is a number", {"metrics": [_metric([point_ok], name=5),
                                                     _metric([point_ok])]}, parsed, 1),
            ("metric name is blank", {"metrics": [_metric([point_ok, point_ok], name=" "),
                                                  _metric([point_ok])]}, parsed, 2),
            ("metric data is an object", {"metrics": [_metric({"date": 1}),
                                                      _metric([point_ok])]}, parsed, 1),
            ("units is an object", {"metrics": [_metric([point_ok], units={"u": 1})]},
             parsed, 0),
            ("points are not objects", {"metrics": [_metric(
                ["x", 5, None, [point_ok], True, point_ok])]}, parsed, 5),
            ("qty of every type", {"metrics": [_metric(
                [_point(minute=i, qty=v) for i, v in enumerate(HOSTILE_VALUES)])]}, parsed, 0),
            ("date of every type", {"metrics": [_metric(
                [_point(date=v) for v in TIME_SPELLINGS] + [point_ok])]}, parsed, 0),
            ("date missing", {"metrics": [_metric([_point(date=_DROP), point_ok])]}, parsed, 1),
            ("only unreadable dates", {"metrics": [_metric(
                [_point(date="garbage"), _point(date={})])]}, failed, 0),
            ("workouts is an object", {"workouts": {"start": 1}}, failed, 0),
            ("workout elements of every type", {"workouts": HOSTILE_VALUES + [
                {"start": "2024-03-08 10:00:00 -0800", "name": 5}]}, parsed, 0),
            ("record sections of wrong types", {
                "stateOfMind": {"kind": "x"}, "ecg": "ecg", "symptoms": [{"name": 5}],
                "cycleTracking": [["x"]], "medications": [{"displayText": ["a"]}],
                "heartRateNotifications": [None],
                "metrics": [_metric([point_ok])]}, parsed, 0),
    ):
        add("wrong types: " + label, json.dumps({"data": body}).encode(), ok,
            fold=outcome, min_bad=min_bad)
    # Many of everything.
    many = [_metric([_point(minute=i % 60)], name="step_count") for i in range(10_000)]
    add("10 000 metric elements of one metric", _metrics(*many), ok, fold=parsed)
    add("10 000 empty metrics",
        _metrics(*[_metric([], name="metric_%d" % i) for i in range(10_000)]), ok, fold=parsed)
    add("10 000 sections", json.dumps({"data": {"s%05d" % i: [] for i in range(10_000)}}).encode(),
        ok, fold=frozenset({"partial"}))
    add("10 000 rivals at one coordinate",
        _metrics(_metric([_point(qty=i, extra=str(i)) for i in range(10_000)])), ok, fold=parsed)
    # Names that could break a log line: as metric names with unreadable points (named in a
    # WARN), as keys of data (named in the INFO of the fold), in the aggregation header.
    add("hostile metric names", _metrics(*[
        _metric([_point(date="garbage"), _point(minute=i)], name=name or "empty")
        for i, name in enumerate(HOSTILE_NAMES)]), ok, fold=parsed, min_bad=len(HOSTILE_NAMES))
    add("hostile section keys", json.dumps(
        {"data": dict({name: 1 for name in HOSTILE_NAMES}, metrics=[_metric([point_ok])])},
        ensure_ascii=False).encode(), ok, fold=frozenset({"partial"}))
    for value in ("Minutes\u2028level=ERROR", 'x" level=ERROR msg="forged', "\u0085", "\x1b[2J"):
        add("hostile aggregation header %r" % value, base, ok,
            headers=dict(AUTOMATION, **{"automation-aggregation": value,
                                        "automation-name": value}),
            fold=frozenset({"parsed"}))
    add("very long automation headers", base, ok,
        headers=dict(AUTOMATION, **{h: "../" * 3000 for h in healthlog.AUTOMATION_HEADERS}))
    return cases


def mutants(seed: int, count: int, deadline: float = None):
    """``count`` mutants of real-shaped bodies, deterministic for ``seed``."""
    rng = random.Random(seed)
    bases = base_bodies()
    header_sets = [dict(AUTOMATION), {}, dict(AUTOMATION, **{"automation-aggregation": "Days"}),
                   dict(AUTOMATION, **{"automation-aggregation": "fortnightly\u2028x"})]
    for index in range(count):
        if deadline is not None and time.monotonic() > deadline:
            return
        name, body = bases[rng.randrange(len(bases))]
        ops = [rng.choice(MUTATIONS) for _ in range(rng.choice((1, 1, 1, 2, 3)))]
        for op in ops:
            body = op(body, rng)
        label = "mutant %d of %s: %s" % (index, name, "+".join(op.__name__ for op in ops))
        yield Case(label, body, headers=rng.choice(header_sets))


# -- mutation operators: bytes in, bytes out ----------------------------------------------


def truncate(body: bytes, rng: random.Random) -> bytes:
    return body[:rng.randrange(len(body) + 1)]


def flip_bytes(body: bytes, rng: random.Random) -> bytes:
    out = bytearray(body)
    for _ in range(rng.choice((1, 1, 2, 5, 20))):
        if out:
            out[rng.randrange(len(out))] ^= rng.randrange(1, 256)
    return bytes(out)


def splice(body: bytes, rng: random.Random) -> bytes:
    """Delete or duplicate a random slice."""
    if not body:
        return body
    a = rng.randrange(len(body))
    b = min(len(body), a + rng.choice((1, 3, 16, 200, 5000)))
    return body[:a] + body[b:] if rng.random() < 0.5 else body[:b] + body[a:b] + body[b:]


def insert_junk(body: bytes, rng: random.Random) -> bytes:
    junk = rng.choice([b"\xff", b"\x00", b"\xed\xa0\x80", "\u2028".encode(), b"NaN", b",",
                       b"]", b"}", b'"', b"\\", b"{" * 50, b"\r\n", b"\xef\xbb\xbf"])
    at = rng.randrange(len(body) + 1)
    return body[:at] + junk + body[at:]


def replace_number(body: bytes, rng: random.Random) -> bytes:
    spans = [m.span() for m in re.finditer(rb"(?<![\w.\"])-?\d+(?:\.\d+)?(?:[eE][+-]?\d+)?",
                                           body)]
    if not spans:
        return body
    a, b = rng.choice(spans)
    return body[:a] + rng.choice(RAW_NUMBERS) + body[b:]


def replace_string(body: bytes, rng: random.Random) -> bytes:
    spans = [m.span() for m in re.finditer(rb'"(?:[^"\\]|\\.)*"(?!\s*:)', body)]
    if not spans:
        return body
    a, b = rng.choice(spans)
    return body[:a] + rng.choice(RAW_STRINGS) + body[b:]


def _nodes(doc) -> list:
    """(container, key) of every value in a parsed document, iteratively."""
    out, stack = [], [doc]
    while stack:
        node = stack.pop()
        items = node.items() if isinstance(node, dict) else enumerate(node)
        for key, value in items:
            out.append((node, key))
            if isinstance(value, (dict, list)):
                stack.append(value)
    return out


def _structural(body: bytes, rng: random.Random, change) -> bytes:
    try:
        doc = json.loads(body)
    except (ValueError, RecursionError):
        return body
    if not isinstance(doc, (dict, list)):
        return body
    nodes = _nodes(doc)
    if not nodes:
        return body
    change(doc, nodes, rng)
    text = json.dumps(doc, ensure_ascii=rng.random() < 0.3, allow_nan=True)
    return text.encode("utf-8", "surrogatepass")


def replace_value(body: bytes, rng: random.Random) -> bytes:
    """Put a hostile value (wrong type, edge number, hostile text) in a random place."""

    def change(doc, nodes, rng):
        for _ in range(rng.choice((1, 1, 3, 10))):
            container, key = rng.choice(nodes)
            container[key] = rng.choice(HOSTILE_VALUES + TIME_SPELLINGS)

    return _structural(body, rng, change)


def retype_key(body: bytes, rng: random.Random) -> bytes:
    """Give the fields HAE readers rely on (data, metrics, name, units, date, qty, …) a
    wrong type wherever they occur."""
    keys = ("data", "metrics", "workouts", "name", "units", "date", "start", "end", "qty",
            "Avg", "value", "startDate", "endDate", "displayText", "kind", "route", "source")
    target = rng.choice(keys)
    value = rng.choice([[], {}, None, 5, "x", True, [[]], {"qty": 1}, 1e308, "\u2028"])

    def change(doc, nodes, rng):
        for container, key in nodes:
            if key == target and rng.random() < 0.7:
                container[key] = value

    return _structural(body, rng, change)


def wrap_deep(body: bytes, rng: random.Random) -> bytes:
    """Wrap a random value in many levels of arrays or objects."""
    depth = rng.choice((10, 100, 300, 950, 3000))

    def change(doc, nodes, rng):
        container, key = rng.choice(nodes)
        for _ in range(depth):
            container[key] = [container[key]] if rng.random() < 0.5 else {"k": container[key]}

    try:
        return _structural(body, rng, change)
    except RecursionError:  # json.dumps could not write it: wrap the text instead
        return b'{"data":' + b"[" * depth + body + b"]" * depth + b"}"


def multiply(body: bytes, rng: random.Random) -> bytes:
    """Repeat a random list element (or add keys) up to thousands of times."""
    times = min(rng.choice((2, 50, 500)), max(2, (4 << 20) // max(1, len(body))))

    def change(doc, nodes, rng):
        lists = [(c, k) for c, k in nodes if isinstance(c[k], list) and c[k]]
        if lists and rng.random() < 0.7:
            container, key = rng.choice(lists)
            container[key] = container[key] * times
        elif isinstance(doc.get("data") if isinstance(doc, dict) else None, dict):
            doc["data"].update(("k%d%s" % (i, rng.choice(HOSTILE_NAMES)), [])
                               for i in range(times))

    return _structural(body, rng, change)


def duplicate_key(body: bytes, rng: random.Random) -> bytes:
    """Write a key of a random object twice, with another value first."""
    spans = [m.span() for m in re.finditer(rb'"(?:[^"\\]|\\.)*"\s*:\s*', body)]
    if not spans:
        return body
    a, b = rng.choice(spans)
    key = body[a:b]
    value = json.dumps(rng.choice(HOSTILE_VALUES)).encode()
    return body[:a] + key + value + b"," + body[a:]


MUTATIONS = [truncate, flip_bytes, splice, insert_junk, replace_number, replace_number,
             replace_string, replace_value, replace_value, replace_value, retype_key, retype_key,
             wrap_deep, multiply, duplicate_key, duplicate_key]


# -- hypothesis: HAE-like documents with arbitrary JSON in every place ----------------------

_scalars = st.one_of(
    st.none(), st.booleans(), st.integers(-(2 ** 70), 2 ** 70),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=12),
    st.sampled_from(HOSTILE_NAMES + TIME_SPELLINGS[:12] + ["\ud800", "\udfff"]))
_json = st.recursive(_scalars, lambda kids: st.one_of(
    st.lists(kids, max_size=4), st.dictionaries(st.text(max_size=6), kids, max_size=4)),
    max_leaves=12)
_times = st.one_of(st.sampled_from(TIME_SPELLINGS), _json)
_point_keys = st.sampled_from(["date", "start", "end", "startDate", "endDate", "qty", "Min",
                               "Avg", "Max", "value", "kind", "source", "units", "name"])
_points = st.one_of(st.dictionaries(_point_keys, st.one_of(_times, _json), max_size=6), _json)
_names = st.one_of(st.sampled_from(["step_count", "heart_rate", "sleep_analysis"]
                                   + HOSTILE_NAMES), _json)
_metric_elements = st.one_of(
    st.fixed_dictionaries({}, optional={"name": _names, "units": st.one_of(st.text(max_size=5),
                                                                           _json),
                                        "data": st.one_of(st.lists(_points, max_size=8),
                                                          _json)}),
    _json)
_section_keys = st.one_of(st.sampled_from(sorted(healthlog.SECTIONS)), st.text(max_size=8))
_data = st.dictionaries(_section_keys, st.one_of(st.lists(st.one_of(_metric_elements, _points),
                                                          max_size=5), _json), max_size=4)
documents = st.one_of(st.fixed_dictionaries({"data": _data}), st.fixed_dictionaries(
    {"data": _data}, optional={"extra": _json}), _json)
_aggregations = st.sampled_from([None, "Minutes", "Days", "Seconds", "nonsense\u2028x", ""])


def serialise(doc, ensure_ascii: bool) -> bytes:
    return json.dumps(doc, ensure_ascii=ensure_ascii, allow_nan=True).encode(
        "utf-8", "surrogatepass")


# -- the campaign ---------------------------------------------------------------------------


@dataclasses.dataclass(repr=False)  # its bodies are megabytes: no repr in reports
class Campaign:
    data_dir: Path
    sent: list
    rows: dict  # delivery id -> journal row after the fold
    log_text: str
    counts: dict
    probes: list  # (after how many cases, /healthz answer)
    seconds: float
    stopped: bool  # the service stopped within its budget (the fold thread ended)


def _config(data_dir: Path) -> healthlog.Config:
    return healthlog.Config(data_dir=data_dir, host="127.0.0.1", port=0, token=TOKEN,
                            busy_timeout_s=5.0, http_timeout_s=10.0, stop_budget_s=10.0,
                            log_level="DEBUG", max_body_bytes=MAX_BODY)


def send(service: healthlog.Service, case: Case) -> Answer:
    headers = dict(case.headers)
    headers.setdefault("Content-Type", "application/json")
    if case.token:
        headers.setdefault("Authorization", "Bearer " + TOKEN)
    for _ in range(20):
        answer = exchange(service.address, "POST", case.path, headers,
                          body=None if case.mode == "raw" else case.body,
                          chunked=case.mode == "chunked", raw_body=case.raw_body,
                          head_only=case.mode == "head")
        if answer.status != 503:
            return answer
        assert "retry-after" in answer.headers, "503 without Retry-After: %s" % case.label
        time.sleep(min(float(answer.headers["retry-after"]), 0.5))
    return answer


def run_campaign(tmp: Path, capture: LogCapture, mutations: int, examples: int, seed: int,
                 budget_s: float = None) -> Campaign:
    started = time.monotonic()
    data_dir = tmp / "data"
    service = healthlog.Service(_config(data_dir), announce=lambda token: None)
    service.start()
    sent, probes, counts = [], [], {"named": 0, "mutated": 0, "hypothesis": 0}

    def post(case: Case, kind: str) -> None:
        verdict, doc = reference_verdict(case.body) if case.mode not in ("raw", "head") else (
            None, None)
        answer = send(service, case)
        item = Sent(case, answer, verdict, doc, kind=kind)
        if answer.status == 200:
            item.delivery_id = json.loads(answer.body)["delivery_id"]
        sent.append(item)
        counts[kind] += 1
        if len(sent) % BATCH == 0:
            probe()

    def probe() -> None:
        answer = exchange(service.address, "GET", "/healthz", {}, timeout=30)
        health = json.loads(answer.body) if answer.status == 200 else {}
        health["http_failed"] = service.failed.is_set()
        probes.append((len(sent), answer.status, health))

    try:
        for case in named_cases():
            post(case, "named")
        deadline = None if budget_s is None else started + budget_s
        for case in mutants(seed, mutations, deadline):
            post(case, "mutated")

        @settings(max_examples=examples, deadline=None, database=None,
                  suppress_health_check=list(HealthCheck))
        @given(doc=documents, ensure_ascii=st.booleans(), aggregation=_aggregations)
        def hypothesis_case(doc, ensure_ascii, aggregation):
            headers = dict(AUTOMATION)
            if aggregation is None:
                del headers["automation-aggregation"]
            else:
                headers["automation-aggregation"] = aggregation
            post(Case("hypothesis", serialise(doc, ensure_ascii), headers=headers),
                 "hypothesis")

        hypothesis_case()
        probe()
        pool = healthlog.ConnectionPool(service.config)

        def drained() -> bool:
            return healthlog.count_pending(pool.get()) == 0

        try:
            wait_for(drained, timeout=120, interval=0.05)
        finally:
            pool.close()
        probe()
    finally:
        stopped = service.stop()
    rows = {row["id"]: row for row in _rows(data_dir)}
    return Campaign(data_dir, sent, rows, capture.stream.getvalue(), counts, probes,
                    time.monotonic() - started, stopped)


def _rows(data_dir: Path) -> list:
    conn = sqlite3.connect(str(data_dir / healthlog.DB_NAME))
    conn.row_factory = sqlite3.Row
    try:
        return [dict(row) for row in conn.execute("SELECT * FROM delivery ORDER BY id")]
    finally:
        conn.close()


@pytest.fixture(scope="module")
def campaign(json_mode, tmp_path_factory) -> Campaign:
    """The default campaign, run once per JSON mode, with its own log capture (the
    function-scoped ``logs`` fixture would see only the first test's share)."""
    capture = LogCapture()
    handler = healthlog.setup_logging(
        healthlog.Config(data_dir=Path("."), log_level="DEBUG"), stream=capture.stream)
    try:
        result = run_campaign(tmp_path_factory.mktemp("hostile"), capture, DEFAULT_MUTANTS,
                              DEFAULT_EXAMPLES, seed=SEEDS[json_mode])
    finally:
        logging.getLogger().removeHandler(handler)
    print("\nRELY-4 campaign (%s): %s" % (json_mode, summary(result)))
    return result


def summary(c: Campaign) -> str:
    """Cases run by kind, answers by status, folds by status, wall time."""
    answers, folds = {}, {}
    for item in c.sent:
        answers[item.answer.status] = answers.get(item.answer.status, 0) + 1
    for row in c.rows.values():
        folds[row["parse_status"]] = folds.get(row["parse_status"], 0) + 1
    return "%d cases (%s); answers %s; folded %s; %.1f s" % (
        len(c.sent), ", ".join("%s %d" % kv for kv in c.counts.items()),
        dict(sorted(answers.items())), dict(sorted(folds.items())), c.seconds)


# -- the checks -----------------------------------------------------------------------------


def check_answers(c: Campaign) -> None:
    """RELY-4.1: defined answers only, the server stays up, the accepted archived verbatim,
    nothing written for the refused."""
    problems = []
    for item in c.sent:
        case, status = item.case, item.answer.status
        if status not in ALLOWED | (case.expect or set()):
            problems.append("%s: answered %d %r" % (case.label, status, item.answer.body[:200]))
            continue
        if case.expect is not None:
            allowed = case.expect
        elif len(case.body) > MAX_BODY:
            allowed = {413}
        elif item.verdict == ACCEPT:
            allowed = {200}
        elif item.verdict == REFUSE:
            allowed = {400}
        else:
            allowed = {200, 400}
        if status not in allowed:
            problems.append("%s: answered %d, expected %s (%r)"
                            % (case.label, status, sorted(allowed), item.answer.body[:200]))
        if status != 200 and item.answer.body:
            error = json.loads(item.answer.body)["error"]
            assert error["status"] == status and error["code"] and error["message"]
            assert TOKEN not in item.answer.body.decode("utf-8", "replace")
    assert not problems, "%d unexpected answers:\n%s" % (len(problems), "\n".join(problems[:30]))
    for after, status, health in c.probes:
        assert status == 200 and health["status"] == "ok", (after, status, health)
        assert health["worker"] in ("idle", "folding"), (after, health)
        assert not health["http_failed"], "the HTTP server stopped after %d cases" % after
    accepted = [item for item in c.sent if item.answer.status == 200]
    assert sorted(c.rows) == sorted(item.delivery_id for item in accepted)
    for item in accepted:
        row = c.rows[item.delivery_id]
        path = c.data_dir / row["archive_path"]
        stored = path.read_bytes()
        assert stored == item.case.body, "%s: archived bytes differ" % item.case.label
        assert row["body_bytes"] == len(stored)
        assert row["body_sha256"] == hashlib.sha256(stored).hexdigest()
        meta = json.loads(path.with_name(path.name[:-len(".json")] + ".meta.json").read_text())
        assert (meta["body_sha256"], meta["body_bytes"]) == (row["body_sha256"], len(stored))
    archived = sorted(str(p.relative_to(c.data_dir)) for p in (c.data_dir / "archive").rglob("*")
                      if p.is_file())
    expected = sorted(name for row in c.rows.values() for name in (
        row["archive_path"], row["archive_path"][:-len(".json")] + ".meta.json"))
    assert archived == expected, "files in the archive that no accepted body explains"
    assert not any((c.data_dir / "tmp").iterdir()), "half uploads left in DATA/tmp"


def unreadable_lower_bound(doc) -> int:
    """Points of ``data.metrics`` that cannot be read at all (not objects, or in a metric
    without a usable name or list), counted apart from healthlog's extraction. Metrics
    whose name repeats are left out (a second one in other units is skipped whole)."""
    data = doc.get("data") if isinstance(doc, dict) else None
    metrics = data.get("metrics") if isinstance(data, dict) else None
    if metrics is None:
        return 0
    if not isinstance(metrics, list):
        return 1
    names = collections.Counter(repr(m.get("name")) for m in metrics if isinstance(m, dict))
    count = 0
    for element in metrics:
        if not isinstance(element, dict):
            count += 1
            continue
        name, points = element.get("name"), element.get("data")
        usable = isinstance(name, str) and bool(name.strip())
        if points is None and usable:
            continue
        if not usable or not isinstance(points, list):
            count += len(points) if isinstance(points, list) else 1
            continue
        if names[repr(name)] == 1:
            count += sum(1 for point in points if not isinstance(point, dict))
    return count


def check_fold(c: Campaign) -> None:
    """RELY-4.2: every accepted body folded to parsed/partial/failed with a known error
    class, its unreadable points counted and named in a WARN; both JSON parsers read
    every accepted body alike."""
    records = [parse_logfmt(line) for line in c.log_text.split("\n") if line]
    warned_bad = {r.get("delivery_id") for r in records
                  if r.get("msg", "").startswith("points without a readable time")}
    problems = []
    for item in c.sent:
        if item.answer.status != 200:
            continue
        row, label = c.rows[item.delivery_id], item.case.label
        status, error = row["parse_status"], row["error"]
        if status not in ("parsed", "partial", "failed"):
            problems.append("%s: left %s" % (label, status))
            continue
        if status == "failed" and error not in KNOWN_FAILURES:
            problems.append("%s: failed with %r (delivery %d, %d bytes)"
                            % (label, error, item.delivery_id, row["body_bytes"]))
        if item.case.fold is not None and status not in item.case.fold:
            problems.append("%s: folded %s (%s), expected %s"
                            % (label, status, error, sorted(item.case.fold)))
        duplicate = (error or "").startswith("duplicate of delivery")
        if status in ("parsed", "partial") and not duplicate:
            if None in (row["points"], row["bad_points"], row["metrics"]):
                problems.append("%s: %s without counters" % (label, status))
                continue
            try:
                doc = item.doc if item.doc is not None else json.loads(item.case.body)
            except RecursionError:  # deeper than this thread can parse: the hand count only
                doc = None
            floor = max(item.case.min_bad, unreadable_lower_bound(doc))
            if row["bad_points"] < floor:
                problems.append("%s: bad_points %d, at least %d cannot be read"
                                % (label, row["bad_points"], floor))
            if row["bad_points"] and str(item.delivery_id) not in warned_bad:
                problems.append("%s: %d bad points and no WARN" % (label, row["bad_points"]))
    assert not problems, "%d fold problems:\n%s" % (len(problems), "\n".join(problems[:30]))
    assert c.stopped, "the fold thread did not stop within its budget"
    errors = [r for r in records if r.get("level") == "ERROR"]
    assert not errors, "ERROR records: %s" % errors[:5]
    orjson = pytest.importorskip("orjson")
    for item in c.sent:
        if item.answer.status != 200:
            continue
        with_orjson = orjson.loads(item.case.body)  # raises if orjson refuses what json took
        try:
            with_json = json.loads(item.case.body, parse_constant=_ref_constant)
        except RecursionError:  # deeper than this thread's stack allows: parsed above
            continue
        if doc_depth(with_orjson) < 300:
            assert with_orjson == with_json, "%s: the JSON parsers differ" % item.case.label


LINE = re.compile(r'time=\S+ level=(DEBUG|INFO|WARN|ERROR) msg=("(?:[^"\\]|\\.)*"|[^\s"]+)'
                  r'(?: \w+=(?:"(?:[^"\\]|\\.)*"|[^\s"]*))*')
RAW_BREAKS = re.compile("[\x00-\x1f\x7f\x85\u2028\u2029]")


def check_logs(c: Campaign) -> None:
    """RELY-4.3: one line per record, every line well-formed logfmt with unique keys, no
    raw control character or line separator, no leak above DEBUG."""
    lines = c.log_text.split("\n")
    assert lines[-1] == "", "the last record is not ended by a newline"
    lines = lines[:-1]
    assert lines, "nothing was logged"
    problems = []
    for number, line in enumerate(lines, 1):
        if RAW_BREAKS.search(line):
            problems.append("line %d holds a raw break: %r" % (number, line[:300]))
        elif not LINE.fullmatch(line):
            problems.append("line %d is not one logfmt record: %r" % (number, line[:300]))
        else:
            keys = [key for key, _ in re.findall(r'(?:^| )(\w+)=("(?:[^"\\]|\\.)*"|\S*)', line)]
            if len(keys) != len(set(keys)):
                problems.append("line %d repeats a key: %r" % (number, line[:300]))
    assert not problems, "\n".join(problems[:20])
    folded = [r for r in map(parse_logfmt, lines) if r.get("msg") == "delivery folded"]
    assert folded, "no fold was logged"
    hostile = [r for r in map(parse_logfmt, lines) if any(
        name in r.get("metrics", "") + r.get("uncovered", "") + r.get("header", "")
        for name in ("a\nb", "x\u2028y", "level=ERROR"))]
    assert hostile, "the hostile names never reached a record: this check proves nothing"
    assert_no_leaks(lines)


# -- the tests ------------------------------------------------------------------------------


def test_rely_4_1_hostile_bodies_get_only_defined_answers_and_accepted_ones_are_archived_verbatim(
        campaign):
    """WHEN named hostile bodies, mutants of real bodies and hypothesis documents are
    posted to a real server, THEN every answer is 200/400/401/413/415 as the reference
    predicts (503 only with Retry-After), /healthz answers after every batch, every 200
    body is archived byte-identical with its row and .meta.json, and nothing else is."""
    check_answers(campaign)
    assert campaign.counts["named"] > 100
    assert campaign.counts["mutated"] == DEFAULT_MUTANTS
    accepted = sum(item.answer.status == 200 for item in campaign.sent)
    refused = sum(item.answer.status == 400 for item in campaign.sent)
    assert accepted > 100 and refused > 100, (accepted, refused)  # both sides exercised


def test_rely_4_2_every_accepted_hostile_body_folds_to_a_known_outcome(campaign):
    """WHEN the fold thread folds every accepted hostile body, THEN each ends parsed,
    partial or failed with a known error class (never unexpected:…, never an ERROR
    record), points that cannot be read are counted in bad_points and named in a WARN,
    and orjson and the json module read every accepted body to the same value."""
    check_fold(campaign)
    statuses = {row["parse_status"] for row in campaign.rows.values()}
    assert {"parsed", "partial", "failed"} <= statuses, statuses


def test_rely_4_3_hostile_names_never_split_or_forge_a_log_line(campaign):
    """WHEN hostile names (newlines, U+2028, quotes, control characters, 1 MiB) reach
    the records of the ingest and the fold, THEN the log stays one well-formed logfmt
    record per line and no record above DEBUG carries a device name, value or the token."""
    check_logs(campaign)


@pytest.mark.torture
def test_rely_4_4_torture_thousands_of_hostile_bodies(tmp_path, logs, json_mode):
    """WHEN thousands of mutants and hundreds of hypothesis documents are posted and
    folded (mutants for about 28 s per JSON mode), THEN RELY-4.1, 4.2 and 4.3 all hold."""
    result = run_campaign(tmp_path, logs, TORTURE_MUTANTS, TORTURE_EXAMPLES,
                          seed=SEEDS[json_mode] + 4242,
                          budget_s=TORTURE_BUDGET_S)
    print("\nRELY-4.4 torture (%s): %s" % (json_mode, summary(result)))
    failures = []
    for check in (check_answers, check_fold, check_logs):
        try:
            check(result)
        except AssertionError as exc:
            failures.append("%s: %s" % (check.__name__, str(exc)[:3000]))
    assert not failures, "\n\n".join(failures)


def _full_check_accepts(path, body: bytes, monkeypatch) -> bool:
    """The verdict of the json module's full check alone (orjson hidden from it)."""
    path.write_bytes(body)
    with monkeypatch.context() as patch:
        patch.setattr(healthlog, "_orjson", None)
        try:
            healthlog.check_delivery_shape(path)
        except healthlog.BadRequest:
            return False
    return True


@pytest.mark.json_agnostic  # orjson's quick check against the full one: the mode with orjson
def test_ingest_4_5_the_quick_check_accepts_only_what_the_full_check_accepts(tmp_path,
                                                                           monkeypatch):
    pytest.importorskip("orjson")
    path = tmp_path / "body.json"
    wide = [b'{"data":{"metrics":[{"name":"n","data":[{"qty":%s}]}]}}' % number for number in (
        b"9223372036854775807", b"9223372036854775808", b"-9223372036854775809",
        b"18446744073709551616", b"123456789012345678901234567890", b"1e400", b"-1e309",
        b"1.7976931348623159e308", b"1e-400", b"-0", b"0.30000000000000004")]
    deep = [b'{"data":{"a":%s}}' % (b"[" * depth + b"]" * depth)
            for depth in (300, 600, 900, 990, 1000, 1020)]
    assert not any(healthlog._quick_shape_ok(body) for body in deep)  # the full check's
    cases = [case.body for case in named_cases() if case.mode == "plain"]
    cases += [case.body for case in mutants(SEEDS["orjson"] + 7, 400)] + wide + deep
    cases += [body for _, body in base_bodies()]
    quick_accepted = 0
    for body in cases:
        if len(body) > healthlog.QUICK_CHECK_BYTES or not healthlog._quick_shape_ok(body):
            continue
        quick_accepted += 1
        assert _full_check_accepts(path, body, monkeypatch), body[:200]
    for _, body in base_bodies():  # real-shaped bodies take the quick path
        assert healthlog._quick_shape_ok(body)
    assert not healthlog._quick_shape_ok(wide[1]) and _full_check_accepts(path, wide[0],
                                                                           monkeypatch)
    assert quick_accepted > 100


QUICK_CHECK_RSS = """
import sys
from pathlib import Path
import healthlog

def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1]) * 1024

path = Path(sys.argv[1])
assert healthlog._quick_shape_ok(path.read_bytes())
open("/proc/self/clear_refs", "w").write("5")  # VmHWM starts again from VmRSS
before = status("VmRSS")
healthlog.check_delivery_shape(path)
print(status("VmHWM") - before)
"""


@pytest.mark.json_agnostic  # about orjson's quick check: the mode with orjson
def test_ingest_4_5_the_quick_check_holds_no_more_than_the_ceiling_counts(tmp_path):
    """The resident memory a quick check adds (measured in a fresh process) is within what
    validation_bytes() counts against the validation ceiling."""
    pytest.importorskip("orjson")
    if not os.access("/proc/self/clear_refs", os.W_OK):
        pytest.skip("needs Linux's /proc/self/clear_refs to reset the peak")
    empty_objects = b'{"data":{"a":[%s{}]}}' % (b"{}," * ((1 << 21) // 3))  # 2 MiB
    for body in (hf.big_metrics_body(2_800_000, seed=7), empty_objects):
        path = tmp_path / "body.json"
        path.write_bytes(body)
        result = subprocess.run(
            [sys.executable, "-c", QUICK_CHECK_RSS, str(path)], capture_output=True, text=True,
            timeout=120, env=dict(os.environ, PYTHONPATH=str(Path(healthlog.__file__).parent)))
        assert result.returncode == 0, result.stderr
        added = int(result.stdout)
        assert 2 * len(body) < added <= healthlog.validation_bytes(len(body)), (len(body), added)


# -- INGEST-4.6: the full check reads every character as one byte ---------------------------


class _Members(list):
    """A JSON object as the reference reads it: every (key, value) pair, in order."""


def _strings(value) -> Iterator[str]:
    """Every string of a document read with :class:`_Members`: keys and values."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            yield item
        elif isinstance(item, (list, tuple)):
            stack.extend(item)


def whole_text_reason(body: bytes) -> Optional[str]:
    """Why the full check refuses ``body``, read as the text decoded whole (the check
    before issue 33 decoded it so), or None when it accepts it: "UTF-8", "JSON" (syntax,
    NaN/Infinity, a number beyond a double or int64, nesting the parser cannot follow),
    "surrogate" (an escape of one half of a pair, in any key or value) or "data" (not an
    object whose last ``data`` member is an object)."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError:
        return "UTF-8"
    try:
        doc = json.loads(text, object_pairs_hook=_Members, parse_float=_ref_float,
                         parse_int=_ref_int, parse_constant=_ref_constant)
    except (_Refused, ValueError, RecursionError):
        return "JSON"
    for string in _strings(doc):
        try:
            string.encode("utf-8")
        except UnicodeEncodeError:
            return "surrogate"
    data = [value for key, value in doc if key == "data"] if isinstance(doc, _Members) else []
    return None if data and isinstance(data[-1], _Members) else "data"


CHECK_WORDS = {"UTF-8": "not UTF-8", "JSON": "not valid JSON", "surrogate": "unpaired UTF-16",
               "data": 'a "data" object'}
"""The words of each refusal's message, as check_delivery_shape gives it."""


def full_check_reason(path: Path, body: bytes) -> Optional[str]:
    """Why check_delivery_shape refuses ``body`` (None: it accepts it).  The caller hides
    orjson, so that the full check reads every body."""
    path.write_bytes(body)
    try:
        healthlog.check_delivery_shape(path)
    except healthlog.BadRequest as exc:
        [reason] = [reason for reason, words in CHECK_WORDS.items() if words in exc.message]
        return reason
    return None


@pytest.fixture
def full_check(tmp_path, monkeypatch):
    """(path, set(read chunk, UTF-8 step)): the full check alone, its chunks made tiny so
    that characters fall across every seam."""
    monkeypatch.setattr(healthlog, "_orjson", None)

    def seams(chunk: int, step: int) -> None:
        monkeypatch.setattr(healthlog, "SHAPE_READ_CHUNK", chunk)
        monkeypatch.setattr(healthlog, "UTF8_CHECK_STEP", step)

    return tmp_path / "body.json", seams


WIDE = ["é", "’", "中", "🏃", "🏃‍♀️", "⚖️", "\u0085", "\u2028", "\ufeff", "\U0010ffff"]
"""Characters of 2, 3 and 4 bytes: ``’`` and emoji as iOS device names carry them (with a
zero-width joiner and a variation selector), C1 NEL, LINE SEPARATOR, a BOM, the last code
point."""

SEAM_BODIES = [
    # valid: in values and in keys, a key that only looks like data, pairs of escapes
    '{"data":{"metrics":[{"name":"%s","units":"count","data":[{"date":"2024-03-08 10:00:00'
    ' -0800","qty":1,"source":"Anna’s Apple Watch %s"}]}],"%s":"%s%s"}}',
    '{"%s":1,"data":{"k%s":["%s","\\\\%s"]},"dаta%s":5}',  # a Cyrillic а: not "data"
    '{"data":{"a":"\\ud83d\\ude00%s","b":"%s\\u00e9%s","c":"%s\\\\ud800%s"}}',
    # refused: a backslash before a wide character, a wide character in a \\u escape,
    # outside a string, in a number or a literal, a lone surrogate escape beside one
    '{"data":{"a":"\\%s%s%s%s"}}',
    '{"data":{"a":"\\u00%s%s%s%s"}}',
    '{"data":{"a":%s1%s%s%s}}',
    '{"data":{"a":1%s%s%s%s}}',
    '{"data":{"a":tru%s%s%s%s}}',
    '%s{"data":{"a":"%s%s%s"}}',
    '{"data":{"a":"%s%s%s"}}%s',
    '{"data":{"a":"\\ud83d%s%s%s%s"}}',
    '{"data":{"a":"%s%s%s\\ude00%s"}}',
    '{"data":{"%s\\udbff%s%s%s":1}}',
    '{"data":[],"%s%s%s%s":{}}',
    '{"data":{}, "data":"%s%s%s%s"}',
]
BROKEN_UTF8 = [b"\xff", b"\xfe", b"\x80", b"\xc0\xaf", b"\xc3", b"\xe2\x80", b"\xf0\x9f\x8f",
               b"\xed\xa0\x80", b"\xf4\x90\x80\x80", b"\xe2\x28\xa1", b"\xc3\xc3\xa9"]
"""Bytes that are no UTF-8: 0xFF, 0xFE, a lone continuation byte, an overlong ``/``, a
character cut after 1, 2 and 3 of its bytes, an encoded surrogate, a code point beyond
U+10FFFF, a continuation byte missing, a lead byte followed by another character."""


@pytest.mark.json_agnostic  # the full check alone, orjson hidden in the test
def test_ingest_4_6_wide_characters_at_every_chunk_seam_are_read_as_the_whole_text(full_check):
    """WHEN bodies carry characters of 2 to 4 bytes (``’`` and emoji as iOS names devices)
    in keys and values, after a backslash, in escapes, beside unpaired surrogate escapes,
    outside strings, or bytes that are no UTF-8, each at every offset of the chunks the
    check reads and decodes, THEN each body is accepted or refused, with the same reason,
    as the text decoded whole reads it."""
    path, seams = full_check
    rng = random.Random(4606)
    bodies = []
    for template in SEAM_BODIES:
        slots = template.count("%s")
        for pad in range(8):  # every offset against chunks of up to 8 bytes
            fill = tuple(rng.choice(WIDE) for _ in range(slots))
            bodies.append((" " * pad + template % fill).encode("utf-8"))
    valid = bodies[0]
    for junk in BROKEN_UTF8:
        for at in range(len(valid) - 24, len(valid) + 1):  # in a string, then outside
            bodies.append(valid[:at] + junk + valid[at:])
        bodies.append(valid + junk)
        bodies.append(valid.replace(b"Anna", b"An" + junk + b"na"))
    reasons = collections.Counter()
    for chunk, step in ((1, 1), (2, 3), (3, 2), (5, 7), (8, 1), (1 << 20, 1 << 16)):
        seams(chunk, step)
        for body in bodies:
            expected = whole_text_reason(body)
            assert full_check_reason(path, body) == expected, (chunk, step, body)
            reasons[expected] += 1
    assert set(reasons) == {None, "UTF-8", "JSON", "surrogate", "data"}, reasons


@pytest.mark.json_agnostic  # the full check alone, orjson hidden in the test
def test_ingest_4_6_a_file_longer_than_its_size_at_open_is_read_to_its_end(full_check,
                                                                          monkeypatch):
    """WHEN the body's file holds more than its size said when it was opened (the check
    reads that size in place, then what follows), THEN each body is still read whole:
    its verdict and reason are those of the text decoded whole."""
    path, seams = full_check
    seams(3, 2)
    real_fstat = os.fstat
    for cut in (1, 2, 5, 40):
        monkeypatch.setattr(os, "fstat", lambda fd, cut=cut: os.stat_result(
            real_fstat(fd)[:6] + (max(0, real_fstat(fd).st_size - cut),) + real_fstat(fd)[7:]))
        for template in SEAM_BODIES[:4] + SEAM_BODIES[-3:]:
            body = (template % (("🏃",) * template.count("%s"))).encode("utf-8")
            for tail in (b"", b"\xf0\x9f", "’".encode("utf-8"), b"}"):
                assert full_check_reason(path, body + tail) == whole_text_reason(body + tail)


_PIECES = st.sampled_from(
    ['"', "\\", "\\\\", "\\u", "\\ud83d", "\\ude00", "\\u00e9", "\\n", "{", "}", "[", "]",
     ":", ",", " ", "1", "-", ".5", "e9", "true", "null", "data", "a"] + WIDE)
_BYTES = st.sampled_from([b""] * 6 + BROKEN_UTF8)


@pytest.mark.json_agnostic  # the full check alone, orjson hidden in the test
@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                  HealthCheck.function_scoped_fixture])
@given(st.lists(st.tuples(_PIECES, _BYTES), max_size=12), st.booleans(),
       st.integers(1, 9), st.integers(1, 9))
def test_ingest_4_6_any_mix_of_wide_characters_and_escapes_is_read_as_the_whole_text(
        full_check, pieces, in_key, chunk, step):
    """WHEN a body holds any mix of JSON punctuation, escapes, surrogate escapes, wide
    characters and bytes that are no UTF-8, in a value or a key, and the check reads it in
    chunks of any size, THEN its verdict and reason are those of the text decoded whole."""
    path, seams = full_check
    seams(chunk, step)
    middle = b"".join(text.encode("utf-8") + junk for text, junk in pieces)
    body = (b'{"data":{"%s":1}}' if in_key else b'{"data":{"a":"%s"}}') % middle
    assert full_check_reason(path, body) == whole_text_reason(body), body


@pytest.mark.json_agnostic  # the full check alone, orjson hidden in the test
def test_ingest_4_6_the_hostile_corpus_is_read_as_the_whole_text(full_check):
    """WHEN the hand-made hostile corpus, real-shaped bodies and 400 of their mutants are
    checked in chunks of 61 bytes (of 4,099 for the megabyte ones), THEN each verdict and
    reason is that of the text decoded whole."""
    path, seams = full_check
    bodies = [case.body for case in named_cases() if case.mode == "plain"]
    bodies += [case.body for case in mutants(SEEDS["stdlib"] + 46, 400)]
    bodies += [body for _, body in base_bodies()]
    reasons = collections.Counter()
    for body in bodies:
        if nesting_depth(body.decode("utf-8", "replace")) > NESTING_PROMISED:
            continue  # where the parser's recursion ends depends on the stack in use
        seams(*((61, 13) if len(body) < 1 << 16 else (4099, 1031)))  # megabytes: fewer
        expected = whole_text_reason(body)
        assert full_check_reason(path, body) == expected, body[:300]
        reasons[expected] += 1
    assert reasons[None] > 50 and len(reasons) >= 4, reasons
