"""Helpers of the load and crash runs (test_load.py, test_crash_torture.py): real-shaped
HAE bodies built once and made distinct cheaply, a client that never raises and times each
request, and the checks that nothing answered 200 was lost or half folded and that the live
store equals a fresh ``reindex``."""

import dataclasses
import datetime as dt
import hashlib
import http.client
import json
import os
import re
import shutil
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import hae_factory as hf
from conftest import TOKEN, parse_logfmt, run_cli

SEED_ENV = "HEALTHLOG_TORTURE_SEED"

# ---------------------------------------------------------------------------------------------
# Bodies: real-shaped HAE bodies built once per module, made distinct cheaply.

KIB, MIB = 1 << 10, 1 << 20
_HEAD = b'{\n  "data" : {\n    "metrics" : [\n'
UNIQUE_METRIC = "flights_climbed"
UNIQUE_START = 1672531200  # 2023-01-01T00:00:00Z: far from every base body's days
_UNIQUE = ('      {\n        "name" : "%s",\n        "units" : "count",\n'
           '        "data" : [\n          {\n            "date" : "%%s",\n'
           '            "qty" : %%d\n          }\n        ]\n      },\n' % UNIQUE_METRIC)


class Bodies:
    """Minute-grouped HAE metric bodies (tests/hae_factory.py's ``big_metrics_body``), one
    per size, built once. ``make(size, serial)`` puts one more metric in front: a single
    ``flights_climbed`` point at a minute of its own, so every body is distinct and adds one
    coordinate to the store, while the rest is a re-send of the base (cheap to fold again).
    Each size class covers days of its own, so the classes never collide."""

    def __init__(self, sizes):
        self.sizes = tuple(sizes)
        self._tails = {}
        for index, size in enumerate(self.sizes):
            start = hf.DST_SPRING + dt.timedelta(days=30 * index)
            body = hf.big_metrics_body(size, seed=index + 1, start=start)
            assert body.startswith(_HEAD), "big_metrics_body changed its layout"
            self._tails[size] = body[len(_HEAD):]

    def make(self, size: int, serial: int) -> bytes:
        point = _UNIQUE % (hf.hae_time(UNIQUE_START + 60 * serial), serial % 9 + 1)
        return _HEAD + point.encode() + self._tails[size]


HEADERS = hf.headers_for(hf.Automation("Reliability", "Minutes", "Since Last Sync"),
                         session_id="5E55-0000", token=TOKEN)


# ---------------------------------------------------------------------------------------------
# Posting.

@dataclasses.dataclass
class PostAnswer:
    """One POST as a client saw it: status None when the connection failed."""

    status: object
    delivery_id: object = None
    retry_after: object = None
    seconds: float = 0.0
    error: str = ""


def timed_post(port: int, body: bytes, headers: dict, timeout: float = 120.0) -> PostAnswer:
    """POST one body on a fresh connection; never raises for a network failure."""
    started = time.monotonic()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("POST", "/api/ingest", body=body, headers=headers)
        response = conn.getresponse()
        raw = response.read()
        answer = PostAnswer(response.status, retry_after=response.getheader("Retry-After"))
        if response.status == 200:
            answer.delivery_id = json.loads(raw)["delivery_id"]
    except (OSError, http.client.HTTPException) as exc:
        answer = PostAnswer(None, error=type(exc).__name__)
    finally:
        conn.close()
    answer.seconds = time.monotonic() - started
    return answer


def timed_get(port: int, path: str, timeout: float = 60.0) -> tuple:
    """GET with the bearer token: (status or None, body bytes, seconds)."""
    started = time.monotonic()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("GET", path, headers={"Authorization": "Bearer " + TOKEN})
        response = conn.getresponse()
        status, raw = response.status, response.read()
    except (OSError, http.client.HTTPException):
        status, raw = None, b""
    finally:
        conn.close()
    return status, raw, time.monotonic() - started


@dataclasses.dataclass
class Acknowledged:
    """A body that was answered 200: what the archive and the journal must hold for it."""

    delivery_id: int
    sha256: str
    size: int
    serial: int


def percentile(values, fraction: float) -> float:
    """The nearest-rank percentile (0 for no values)."""
    ordered = sorted(values)
    if not ordered:
        return 0.0
    return ordered[min(len(ordered) - 1, max(0, int(round(fraction * len(ordered))) - 1))]


# ---------------------------------------------------------------------------------------------
# The CLI and the data directory.

def fingerprint_line(output: str) -> str:
    lines = [line for line in output.splitlines() if line.startswith("fingerprint: ")]
    assert len(lines) == 1, "no single fingerprint line in:\n" + output
    return lines[0].split(": ", 1)[1].strip()


def snapshot(data_dir: Path, *sqls: str) -> list:
    """The rows of each query, all read in one transaction (one snapshot of the database,
    even while serve writes), on a connection of the test's own, closed at once."""
    conn = sqlite3.connect(str(data_dir / "healthlog.sqlite3"), timeout=30,
                           isolation_level=None)
    try:
        conn.execute("BEGIN")
        results = [conn.execute(sql).fetchall() for sql in sqls]
        conn.execute("COMMIT")
        return results
    finally:
        conn.close()


def snapshot_rows(data_dir: Path, sql: str) -> list:
    return snapshot(data_dir, sql)[0]


def pending_count(data_dir: Path) -> int:
    return snapshot_rows(
        data_dir, "SELECT count(*) FROM delivery WHERE parse_status = 'pending'")[0][0]


def wait_drained(data_dir: Path, timeout: float, context: str) -> float:
    """Wait until no delivery is pending; return how long that took, a figure for the
    report.  ``timeout`` is a ceiling for a backlog that does not drain, many times
    the usual drain, not a speed goal."""
    started = time.monotonic()
    deadline = started + timeout
    while True:
        left = pending_count(data_dir)
        if not left:
            return time.monotonic() - started
        if time.monotonic() > deadline:
            raise AssertionError("%s: %d deliveries still pending after %.0f s: the backlog"
                                 " does not drain" % (context, left, timeout))
        time.sleep(0.1)


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(str(path), "rb") as handle:
        for chunk in iter(lambda: handle.read(MIB), b""):
            digest.update(chunk)
    return digest.hexdigest()


def archive_bodies(data_dir: Path) -> set:
    """Relative paths of every archived body (``.meta.json`` files aside)."""
    base = data_dir / "archive"
    return {str(p.relative_to(data_dir)) for p in base.rglob("*.json")
            if not p.name.endswith(".meta.json")} if base.exists() else set()


def tmp_entries(data_dir: Path) -> list:
    tmp = data_dir / "tmp"
    return sorted(p.name for p in tmp.iterdir()) if tmp.exists() else []


def lost_deliveries(data_dir: Path, sent: list, hash_files: bool) -> list:
    """What is wrong with each acknowledged delivery: no row, another hash or size in the
    row, no archived body, or (``hash_files``) archived bytes other than those sent."""
    rows = {row[0]: row[1:] for row in snapshot_rows(
        data_dir, "SELECT id, archive_path, body_sha256, body_bytes FROM delivery")}
    problems = []
    for item in sent:
        row = rows.get(item.delivery_id)
        if row is None:
            problems.append("delivery %d: no journal row" % item.delivery_id)
            continue
        path, sha, size = row
        body = data_dir / path
        if sha != item.sha256 or size != item.size:
            problems.append("delivery %d: row says %s/%d bytes, sent %s/%d bytes"
                            % (item.delivery_id, sha[:12], size, item.sha256[:12], item.size))
        elif not body.is_file() or not (data_dir / (path[:-5] + ".meta.json")).is_file():
            problems.append("delivery %d: %s or its .meta.json is missing"
                            % (item.delivery_id, path))
        elif body.stat().st_size != item.size or (hash_files and sha256_file(body) != sha):
            problems.append("delivery %d: %s is not the bytes sent" % (item.delivery_id, path))
    return problems


def half_folded(data_dir: Path) -> list:
    """Signs of a fold that was cut in half: an object naming a delivery (as creator, last
    writer or source of a point) that is not ``parsed``/``partial``, a pending row with a
    fold time, a folded row without one. Read in one snapshot: serve may be folding."""
    statuses, odd, objects = snapshot(
        data_dir, "SELECT id, parse_status FROM delivery",
        "SELECT id, parse_status, folded_at FROM delivery"
        " WHERE (parse_status = 'pending') = (folded_at IS NOT NULL)",
        "SELECT metric, layer, hour, delivery_id, updated_by, point_deliveries FROM object")
    status = dict(statuses)
    problems = ["delivery %d is %s with folded_at %s" % row for row in odd]
    for metric, layer, hour, created, updated, points in objects:
        for delivery_id in {created, updated} | set(json.loads(points)):
            if status.get(delivery_id) not in ("parsed", "partial"):
                problems.append("object %s/%s/%d names delivery %d, which is %s"
                                % (metric, layer, hour, delivery_id, status.get(delivery_id)))
    return problems


def logged(serve_logs: list, levels=("ERROR",)) -> list:
    """Records of the given levels from serve's log files (logfmt)."""
    found = []
    for path in serve_logs:
        for line in Path(path).read_text(errors="replace").splitlines():
            record = parse_logfmt(line)
            if record.get("level") in levels:
                found.append(record)
    return found


def copy_without(data_dir: Path, target: Path, leave_out: set) -> None:
    """A copy of a stopped data directory for ``reindex`` to rebuild: the database copied,
    the archive hard-linked (never modified), the bodies in ``leave_out`` (relative paths)
    and their ``.meta.json`` left out."""
    skip = set(leave_out) | {p[:-5] + ".meta.json" for p in leave_out}
    target.mkdir(mode=0o700)
    for entry in data_dir.iterdir():
        if entry.name.startswith("healthlog.sqlite3"):
            shutil.copy2(str(entry), str(target / entry.name))
    for path in (data_dir / "archive").rglob("*"):
        relative = str(path.relative_to(data_dir))
        if path.is_file() and relative not in skip:
            (target / relative).parent.mkdir(parents=True, exist_ok=True)
            os.link(str(path), str(target / relative))
    (target / "tmp").mkdir()


def _cli(*args) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "healthlog"] + [str(a) for a in args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def check_store_matches_rebuild(data_dir: Path, tmp_path: Path, orphans: set,
                                context: str) -> dict:
    """``verify`` passes and counts exactly ``orphans``, and the live fingerprint (``status
    --json``) equals the one of a fresh ``reindex``, run on a copy of the stopped directory
    without the orphans (an orphan was never answered 200 and is not in the live store;
    ``reindex`` would adopt and fold it). verify and reindex run side by side (both rebuild
    everything). Returns status's figures."""
    status = run_cli("status", "--data", data_dir, "--json")
    assert status.returncode == 0, "%s: status failed:\n%s" % (context, status.stderr)
    figures = json.loads(status.stdout)
    assert figures["backlog"] == 0, "%s: backlog %d" % (context, figures["backlog"])
    live = figures["fingerprint"]
    copy = tmp_path / "rebuild-copy"
    copy_without(data_dir, copy, orphans)
    procs = [_cli("verify", "--data", data_dir), _cli("reindex", "--data", copy)]
    try:
        (verify_out, verify_err), (reindex_out, reindex_err) = [
            proc.communicate(timeout=300) for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    verify_rc, reindex_rc = [proc.returncode for proc in procs]
    assert verify_rc == 0 and "verify: equal" in verify_out, (
        "%s: verify failed (exit %d):\n%s%s" % (context, verify_rc, verify_out, verify_err))
    counted = [int(n) for n in re.findall(r"^orphans: (\d+) archived bod", verify_out,
                                          re.MULTILINE)]
    assert counted == ([len(orphans)] if orphans else []), (
        "%s: verify counts other orphans than the %d found:\n%s"
        % (context, len(orphans), verify_out))
    assert fingerprint_line(verify_out) == live, context + ":\n" + verify_out
    assert reindex_rc == 0, "%s: reindex failed (exit %d):\n%s%s" % (
        context, reindex_rc, reindex_out, reindex_err)
    assert "orphans adopted: 0\n" in reindex_out, context + ":\n" + reindex_out
    assert fingerprint_line(reindex_out) == live, (
        "%s: the live store's fingerprint %s differs from a fresh reindex:\n%s"
        % (context, live, reindex_out))
    return figures
