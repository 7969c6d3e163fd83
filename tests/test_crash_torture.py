"""Crash torture (RELY-1): a real ``serve`` subprocess receiving HAE bodies from several
client threads is SIGKILLed at random moments, again and again, and restarted on the same
data directory. Nothing that was answered 200 may be lost or changed, no upload may survive
in ``DATA/tmp``, no delivery may be half folded, and at the end the backlog drains, ``verify``
passes and the live fingerprint equals a fresh ``reindex``.

The seed is drawn anew each run, printed and named in every assertion message; set
``HEALTHLOG_TORTURE_SEED`` to run one again (thread timing still differs between runs).
The helpers here (bodies, posting, CLI, archive checks) are shared with tests/test_load.py.
"""

import dataclasses
import datetime as dt
import hashlib
import http.client
import itertools
import json
import os
import random
import re
import shutil
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

import hae_factory as hf
from conftest import TOKEN, parse_logfmt, run_cli

pytestmark = pytest.mark.json_agnostic

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
class Answer:
    """One POST as a client saw it: status None when the connection failed."""

    status: object
    delivery_id: object = None
    retry_after: object = None
    seconds: float = 0.0
    error: str = ""


def post(port: int, body: bytes, headers: dict, timeout: float = 120.0) -> Answer:
    """POST one body on a fresh connection; never raises for a network failure."""
    started = time.monotonic()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("POST", "/api/ingest", body=body, headers=headers)
        response = conn.getresponse()
        raw = response.read()
        answer = Answer(response.status, retry_after=response.getheader("Retry-After"))
        if response.status == 200:
            answer.delivery_id = json.loads(raw)["delivery_id"]
    except (OSError, http.client.HTTPException) as exc:
        answer = Answer(None, error=type(exc).__name__)
    finally:
        conn.close()
    answer.seconds = time.monotonic() - started
    return answer


def get(port: int, path: str, timeout: float = 60.0) -> tuple:
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
class Sent:
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


def query(data_dir: Path, sql: str) -> list:
    return snapshot(data_dir, sql)[0]


def pending_count(data_dir: Path) -> int:
    return query(data_dir, "SELECT count(*) FROM delivery WHERE parse_status = 'pending'")[0][0]


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
    rows = {row[0]: row[1:] for row in query(
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


def log_records(serve_logs: list, levels=("ERROR",)) -> list:
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


# ---------------------------------------------------------------------------------------------
# The torture.

CRASH_SIZES = (1 * KIB, 10 * KIB, 100 * KIB, 1 * MIB, 3 * MIB, 20 * MIB)
CRASH_WEIGHTS = (55, 30, 12, 2, 0.3, 0)  # 20 MiB only in the cycles that ask for it
CLIENTS = 4
THINK_S = 0.25
"""Longest pause of a client between two posts: phones push now and then, and the store
to rebuild at the end stays small enough for the time budget."""
POST_WINDOW_S = (0.1, 0.8)
BIG_WINDOW_S = (0.6, 2.0)
"""Posting time before the kill; longer in a cycle that sends 20 MiB (about 0.5 s to
upload alone), so that it is sometimes answered and its fold sometimes cut."""


@pytest.fixture(scope="module")
def crash_bodies() -> Bodies:
    return Bodies(CRASH_SIZES)


@dataclasses.dataclass
class Tally:
    kills: int = 0
    acknowledged: int = 0
    unanswered: int = 0
    busy: int = 0
    refused: list = dataclasses.field(default_factory=list)
    tmp_left_by_kill: int = 0
    big_acknowledged: int = 0


def _client(port: int, bodies: Bodies, rng: random.Random, serials, lock: threading.Lock,
            stop: threading.Event, big_first: bool, sent: list, tally: Tally) -> None:
    """Post until told to stop (or the server dies under it); record what was answered."""
    first = True
    while not stop.is_set():
        size = CRASH_SIZES[-1] if first and big_first else rng.choices(
            CRASH_SIZES, CRASH_WEIGHTS)[0]
        first = False
        with lock:
            serial = next(serials)
        body = bodies.make(size, serial)
        digest = hashlib.sha256(body).hexdigest()
        answer = post(port, body, HEADERS)
        with lock:
            if answer.status == 200:
                sent.append(Sent(answer.delivery_id, digest, len(body), serial))
                tally.acknowledged += 1
                tally.big_acknowledged += size == CRASH_SIZES[-1]
            elif answer.status is None:
                tally.unanswered += 1
                return  # the server is gone: its successor has another port
            elif answer.status == 503:
                tally.busy += 1
            else:
                tally.refused.append(answer.status)
        if answer.status == 503:  # Retry-After, shortened: the cycle lasts about a second
            stop.wait(min(float(answer.retry_after or 1), 1.0))
        else:
            stop.wait(rng.uniform(0, THINK_S))


def crash_torture(serve_process, data_dir: Path, tmp_path: Path, bodies: Bodies, kills: int,
                  big_every: int, drain_timeout: float, label: str) -> None:
    seed = int(os.environ.get(SEED_ENV) or random.SystemRandom().randrange(1 << 32))
    rng = random.Random(seed)
    context = "%s seed=%d (%s=%d reruns it)" % (label, seed, SEED_ENV, seed)
    print("\n%s: %d kills" % (context, kills))
    started = time.monotonic()
    serials, lock = itertools.count(), threading.Lock()
    sent, tally, logs = [], Tally(), []
    checked = 0
    for cycle in range(kills + 1):
        serve = serve_process(data_dir)
        logs.append(serve.log_path)
        after = ("after restart %d (%d acknowledged so far)" % (cycle, len(sent)) if cycle
                 else "at the first start")
        assert not tmp_entries(data_dir), (
            "%s, %s: DATA/tmp still holds uploads of the killed process: %s"
            % (context, after, tmp_entries(data_dir)))
        # What the restarted serve found: every acknowledged delivery whole (the bytes of
        # the ones new since the last restart hashed again), no fold cut in half.
        new, checked = sent[checked:], len(sent)
        lost = lost_deliveries(data_dir, sent, hash_files=False) + lost_deliveries(
            data_dir, new, hash_files=True)
        assert not lost, "%s, %s: acknowledged deliveries lost:\n%s" % (
            context, after, "\n".join(lost[:20]))
        halves = half_folded(data_dir)
        assert not halves, "%s, %s: half-folded deliveries:\n%s" % (
            context, after, "\n".join(halves[:20]))
        if cycle == kills:
            break  # the last start: no more kills
        stop = threading.Event()
        big = cycle % big_every == big_every // 2
        threads = [threading.Thread(
            target=_client, name="torture-client-%d" % n, daemon=True,
            args=(serve.port, bodies, random.Random(rng.random()), serials, lock, stop,
                  big and n == 0, sent, tally)) for n in range(CLIENTS)]
        for thread in threads:
            thread.start()
        time.sleep(rng.uniform(*(BIG_WINDOW_S if big else POST_WINDOW_S)))
        assert serve.proc.poll() is None, "%s: serve died before its kill:\n%s" % (
            context, "\n".join(serve.log_lines()[-20:]))
        serve.kill()
        tally.kills += 1
        stop.set()
        for thread in threads:
            thread.join(60)
            assert not thread.is_alive(), "%s: a client hangs on a killed server" % context
        tally.tmp_left_by_kill += sum(name.startswith("upload-") for name in tmp_entries(data_dir))
    assert not tally.refused, "%s: posts refused with %s" % (context, tally.refused)

    # The backlog drains and the service stops in order.
    drained = wait_drained(data_dir, drain_timeout, context)
    assert serve.terminate() == 0, "%s: serve did not stop in order:\n%s" % (
        context, "\n".join(serve.log_lines()[-20:]))

    lost = lost_deliveries(data_dir, sent, hash_files=True)
    assert not lost, "%s: acknowledged deliveries lost:\n%s" % (context, "\n".join(lost[:20]))
    assert len({item.delivery_id for item in sent}) == len(sent), (
        "%s: one delivery id answered twice" % context)
    # A delivery whose fold the kills cut three times in a row (it is the first folded after
    # each restart, and a big body's fold outlasts a kill window) was failed so that the
    # queue moves (FOLD-14): its body is whole, and `refold` brings it back.
    exhausted = [i for (i, error) in query(
        data_dir, "SELECT id, error FROM delivery WHERE parse_status = 'failed'")
        if error == "fold_attempts_exhausted"]
    if exhausted:
        refolded = run_cli("refold", "--data", data_dir, "--failed", timeout=60)
        assert refolded.returncode == 0, refolded.stderr
        serve = serve_process(data_dir)
        logs.append(serve.log_path)
        wait_drained(data_dir, drain_timeout, context)
        assert serve.terminate() == 0, "%s: serve did not stop in order" % context
    statuses = dict(query(data_dir, "SELECT id, parse_status FROM delivery"))
    not_parsed = sorted((item.delivery_id, statuses[item.delivery_id]) for item in sent
                        if statuses[item.delivery_id] != "parsed")
    assert not not_parsed, "%s: acknowledged deliveries not parsed: %s" % (
        context, not_parsed[:20])
    halves = half_folded(data_dir)
    assert not halves, "%s: half-folded deliveries:\n%s" % (context, "\n".join(halves[:20]))
    journaled = {row[0] for row in query(data_dir, "SELECT archive_path FROM delivery")}
    missing = sorted(p for p in journaled if not (data_dir / p).is_file())
    assert not missing, "%s: journal rows without their body: %s" % (context, missing[:20])
    orphans = archive_bodies(data_dir) - journaled
    errors = [r for r in log_records(logs)
              if not r.get("msg", "").startswith("a delivery was tried 3 times")]
    assert not errors, "%s: serve logged errors: %s" % (context, errors[:10])
    figures = check_store_matches_rebuild(data_dir, tmp_path, orphans, context)

    unacknowledged = len(journaled) - len(sent)
    print("%s: kills survived %d, deliveries acknowledged %d (%d of 20 MiB), lost 0, failed"
          " after three cut folds and refolded %d; "
          "journaled without an answer %d, orphan bodies %d, posts cut off %d, 503 answers %d, "
          "uploads left in DATA/tmp by a kill and cleared at restart %d; objects %d, "
          "points %d, archive %.1f MiB; final drain %.1f s; wall %.1f s"
          % (label, tally.kills, tally.acknowledged, tally.big_acknowledged, len(exhausted),
             unacknowledged,
             len(orphans), tally.unanswered, tally.busy, tally.tmp_left_by_kill,
             figures["objects"], figures["points"], figures["archive_bytes"] / MIB, drained,
             time.monotonic() - started))


@pytest.mark.torture  # kills a process on purpose: with the torture runs (pyproject.toml)
def test_rely_1_1_sigkill_under_concurrent_posts_loses_nothing(serve_process, data_dir,
                                                                tmp_path, crash_bodies):
    """WHEN serve, receiving 1 KiB-20 MiB bodies from 4 clients, is SIGKILLed at 20 random
    moments and restarted each time, THEN every delivery answered 200 keeps its row and
    its exact bytes, DATA/tmp is emptied at each start, no delivery is half folded, the
    backlog drains, verify passes and the fingerprint equals a fresh reindex."""
    crash_torture(serve_process, data_dir, tmp_path, crash_bodies, kills=20, big_every=20,
                  drain_timeout=120, label="RELY-1.1")  # drains in about 4 s here


@pytest.mark.torture
def test_rely_1_2_two_hundred_sigkills_lose_nothing(serve_process, data_dir, tmp_path,
                                                   crash_bodies):
    """WHEN serve is SIGKILLed at 200 random moments under the posting of RELY-1.1 and
    restarted each time, THEN RELY-1.1's invariants hold after every restart and at the end."""
    crash_torture(serve_process, data_dir, tmp_path, crash_bodies, kills=200, big_every=40,
                  drain_timeout=300, label="RELY-1.2")
