"""RELY-10: the memory a fold takes is bounded by its body, for every shape HAE can send,
and the start-up memory check says so truly (openspec/specs/reliability/spec.md).

The shapes are tests/bench_memory.py's, which measures them at 64 MiB: a Days history of
every metric (one point, so one hour object, per metric and day), one workout of days
with a route point and a heart-rate sample every second, hundreds of thousands of
metrics of one point each, an emoji in every ``source``; and the workout sent again with
one value changed (its stored object and the arriving one compared, and written).  Here
they are folded small, for a fast suite, but for the workout and its re-send, over
``healthlog.STREAM_FOLD_BYTES`` (the fold's own path for large bodies, untouched).

Everything is real and watched from outside: each fold runs in a subprocess through the
code path ``serve`` uses (``FoldWorker.run_pass`` on a journaled delivery), or in a real
``healthlog.py serve``, while a watchdog thread of the test reads the process's VmRSS
from ``/proc`` every 20 ms and SIGKILLs it above its cap, as the kernel's OOM killer
would; after the fold the process's VmHWM (its peak) is read too, so that a spike
between two reads counts.  A fold killed, or over its cap, fails the test.

- RELY-10.2: the fold alone, under the memory model's allowance for its body
  (``FOLD_MEMORY_FACTOR`` times it) plus a fixed 8 MiB (SQLite's cache, the memos of
  timestamps, a batch of rows); the small bodies indexed as large ones are
  (``STREAM_FOLD_BYTES`` lowered in the subprocess): the path whose memory scales with
  the body.  Before issue 27 these folds took 10 (Days), 20 (one-point metrics), 7.5 (the
  workout) and 9.8 (its re-send) times their body, and every one of them was killed here.
- RELY-10.3: the start-up check's verdict.  For a ``--max-body-mib``, the smallest memory
  limit the check accepts (no WARN, where 1 MiB less draws one) is the cap of a real
  ``serve`` with that ``--max-body-mib``, which folds the largest body of each shape it
  accepts.
- RELY-10.5: what runs at once.  Under the smallest limit the check accepts for
  ``--max-body-mib 48``, a real ``serve`` folds a Days history of about 48 MiB while a
  body as large with an emoji in every ``source`` arrives (a phone sending during a
  backfill).  With the ingest check as it was (the body decoded whole: 4 bytes a
  character, 4.8 times the body), ``serve`` went over the limit here (346 of 332 MiB in one
  run, killed by the watchdog in another); now it peaks near 205 MiB.
"""

import contextlib
import http.client
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Optional

import pytest

import bench_memory
import healthlog
from conftest import ROOT, TOKEN, assert_no_leaks, db_rows, parse_logfmt, wait_for
from fold_helpers import OomWatchdog, port_of, proc_status

# Memory of the large-body path: no JSON library in it; folds killed by a watchdog on purpose:
# with the torture runs (pyproject.toml).
pytestmark = [pytest.mark.json_agnostic, pytest.mark.torture]

MIB = 1 << 20
FIXED_MIB = 8
"""What a fold holds whatever its body: SQLite's page cache, the memos of timestamps
(``TimeMemo``, ``_HOUR_BASE``, ``_START_CODES``), a batch of encoded rows."""
POLL_S = 0.02
"""How often the watchdog reads VmRSS (VmHWM after the fold catches a spike between reads)."""

FOLDED = {  # RELY-10.2, shape: body MiB
    "days-backfill": 2.0,
    "many-metrics-one-point": 2.0,
    "emoji-sources": 2.0,
    "workout-long changed": 8.5,  # over STREAM_FOLD_BYTES: the large-body path, untouched
}
LARGEST_MIB = 1
"""RELY-10.3's --max-body-mib: the largest body of each shape a serve with it accepts."""


def import_one(data_dir: Path, body: Path, aggregation) -> None:
    """``healthlog import`` of one body, in this process (the ingest path)."""
    config = healthlog.Config(data_dir=data_dir, log_level="WARN")
    out = open(os.devnull, "w")
    try:
        assert healthlog.run_import(config, [str(body)], aggregation, None, out) == 0
    finally:
        out.close()


def write(folder: Path, shape: str, size: int) -> tuple:
    """(path, aggregation header, bytes) of a body of ``shape`` (``... changed``: the
    body of ``...`` with one heart-rate value changed, written after it)."""
    base = shape.split()[0]
    path = folder / ("%s-%d.json" % (shape.replace(" ", "-"), size))
    figures = bench_memory.write_body(base, path, size, seed=27)
    made = (path, figures["aggregation"], figures["bytes"])
    if shape.endswith("changed"):
        original = folder / ("%s-%d-before.json" % (base, size))
        path.rename(original)
        path.write_bytes(original.read_bytes().replace(b'"Avg":', b'"Avg":1', 1))
        made = (original, figures["aggregation"], figures["bytes"]), (path, None,
                                                                     figures["bytes"] + 1)
    return made


@pytest.fixture(scope="module")
def bodies(tmp_path_factory) -> dict:
    """shape -> what :func:`write` made, for RELY-10.2 (``("folded", shape)``) and
    RELY-10.3 (``("largest", shape)``, just under :data:`LARGEST_MIB`)."""
    folder = tmp_path_factory.mktemp("bodies")
    made = {}
    for shape, mib in FOLDED.items():
        made["folded", shape] = write(folder, shape, int(mib * MIB))
    for shape in ("days-backfill", "many-metrics-one-point", "emoji-sources",
                  "workout-long changed"):
        made["largest", shape] = write(folder, shape, LARGEST_MIB * MIB - (16 << 10))
    return made


CHILD = r"""
import gc, sys
from pathlib import Path
sys.path.insert(0, sys.argv[1])
import healthlog
if int(sys.argv[3]):
    healthlog.STREAM_FOLD_BYTES = int(sys.argv[3])
config = healthlog.Config(data_dir=Path(sys.argv[2]), log_level="WARN")
healthlog.setup_logging(config)
worker = healthlog.FoldWorker(config)
engine = healthlog.FoldEngine(worker.connect(), config)
gc.collect()
with open("/proc/self/clear_refs", "w") as reset:
    reset.write("5")  # VmHWM back to VmRSS: the peak from here on is the fold's
print("ready", flush=True)
sys.stdin.readline()
print("folded %d" % worker.run_pass(engine), flush=True)
sys.stdin.readline()
"""


def fold_watched(data_dir: Path, allowance: int, stream_bytes: int = 0) -> dict:
    """Fold what ``data_dir`` holds in a subprocess, as serve's worker does, under a cap
    of its RSS before the fold plus ``allowance`` bytes; its figures."""
    proc = subprocess.Popen([sys.executable, "-c", CHILD, str(ROOT), str(data_dir),
                             str(stream_bytes)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    watchdog = None
    try:
        assert proc.stdout.readline() == "ready\n", proc.stderr.read()
        base = proc_status(proc.pid)["VmRSS"]
        watchdog = OomWatchdog(proc.pid, base + allowance, POLL_S)
        watchdog.start()
        proc.stdin.write("\n")
        proc.stdin.flush()
        folded = proc.stdout.readline()
        peak = proc_status(proc.pid).get("VmHWM")
        if proc.poll() is None:
            proc.stdin.write("\n")
            proc.stdin.flush()
        proc.wait(60)
    finally:
        if watchdog is not None:
            watchdog.finish()
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
        errors = proc.stderr.read()
        proc.stdout.close()
        proc.stderr.close()
        proc.stdin.close()
    assert_no_leaks(errors.splitlines())
    return {"base": base, "cap": base + allowance, "peak": peak, "folded": folded,
            "killed_at": watchdog.killed_at, "returncode": proc.returncode, "log": errors}


def assert_within(figures: dict, what: str) -> None:
    assert figures["killed_at"] is None and figures["returncode"] == 0, (
        "%s: killed at %.1f MiB RSS, cap %.1f MiB (%.1f MiB before the fold)\n%s" % (
            what, (figures["killed_at"] or 0) / MIB, figures["cap"] / MIB,
            figures["base"] / MIB, figures["log"]))
    assert figures["peak"] <= figures["cap"], (
        "%s: VmHWM %.1f MiB over the cap %.1f MiB" % (
            what, figures["peak"] / MIB, figures["cap"] / MIB))


def smallest_accepted_limit(tmp_path: Path, monkeypatch, logs, max_body_mib: int) -> int:
    """The smallest memory limit (bytes) serve's start-up check accepts for
    ``--max-body-mib``: no WARN at it, one WARN at 1 MiB less (a cgroup v2 ``memory.max``
    as systemd's ``MemoryMax`` writes it, read by warn_if_memory_short)."""
    limit = healthlog.memory_needed_mib(max_body_mib * MIB) * MIB
    root = tmp_path / "root"
    for cap, warned in ((limit, False), (limit - MIB, True)):
        (root / "proc/self").mkdir(parents=True, exist_ok=True)
        (root / "proc/self/cgroup").write_text("0::/system.slice/healthlog.service\n")
        group = root / "sys/fs/cgroup/system.slice/healthlog.service"
        group.mkdir(parents=True, exist_ok=True)
        (group / "memory.max").write_text("%d\n" % cap)
        monkeypatch.setattr(healthlog, "CGROUP_ROOT", root)
        before = len(logs.find("the largest body allowed may need more memory"))
        healthlog.warn_if_memory_short(healthlog.Config(
            data_dir=tmp_path, max_body_bytes=max_body_mib * MIB))
        after = len(logs.find("the largest body allowed may need more memory"))
        assert (after > before) is warned, (cap / MIB, max_body_mib)
    return limit


@pytest.mark.parametrize("shape", sorted(FOLDED))
def test_rely_10_2_each_shape_folds_within_its_bodys_memory(shape, bodies, tmp_path):
    """WHEN a body of each shape (and the long workout sent again with one value changed)
    is folded as serve's worker folds it, under a cap of the memory model's allowance for
    its body plus 8 MiB that a watchdog enforces from outside, THEN the delivery ends
    parsed and the fold's peak stays under the cap."""
    data_dir = tmp_path / "data"
    made = bodies["folded", shape]
    for index, (path, aggregation, size) in enumerate(
            made if shape.endswith("changed") else [made]):  # the original, then the change
        import_one(data_dir, path, aggregation)
        stream = 0 if size >= healthlog.STREAM_FOLD_BYTES else MIB  # small ones indexed too
        allowance = int(healthlog.FOLD_MEMORY_FACTOR * size) + FIXED_MIB * MIB
        figures = fold_watched(data_dir, allowance, stream)
        assert_within(figures, "%s (%d), %.1f MiB" % (shape, index, size / MIB))
        rows = db_rows(data_dir)
        assert [row["parse_status"] for row in rows] == ["parsed"] * (index + 1)
        assert rows[-1]["objects_written"] >= 1


@contextlib.contextmanager
def capped_serve(data_dir: Path, log_path: Path, max_body_mib: int, limit: int):
    """A real ``serve`` with ``--max-body-mib``, its memory capped at ``limit`` by
    :class:`OomWatchdog` (SIGKILL above it, as the OOM killer); yields the process, then
    stops it and checks that the watchdog never fired and its log leaks nothing."""
    with open(str(log_path), "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "healthlog", "serve", "--data", str(data_dir),
             "--listen", "127.0.0.1:0", "--token", TOKEN, "--max-body-mib",
             str(max_body_mib)], stdout=subprocess.DEVNULL, stderr=log)
    watchdog = OomWatchdog(proc.pid, limit, POLL_S)
    watchdog.start()
    try:
        yield proc
    finally:
        watchdog.finish()
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        proc.wait(60)
    assert_no_leaks(log_path.read_text(errors="replace").splitlines())
    assert watchdog.killed_at is None, "serve killed at %.1f MiB, its limit %.1f MiB" % (
        watchdog.killed_at / MIB, limit / MIB)


def test_rely_10_3_a_limit_the_start_up_check_accepts_folds_the_largest_body_of_each_shape(
        bodies, tmp_path, monkeypatch, logs):
    """WHEN serve gets the smallest memory limit its start-up check accepts for a
    --max-body-mib (no WARN; 1 MiB less draws one), THEN a real serve under that limit,
    enforced by a watchdog, folds the largest body of every shape it accepts, each
    delivery parsed, its peak under the limit."""
    max_body_mib = LARGEST_MIB
    limit = smallest_accepted_limit(tmp_path, monkeypatch, logs, max_body_mib)
    data_dir = tmp_path / "data"
    for (kind, shape), made in sorted(bodies.items()):
        if kind == "largest":
            for path, aggregation, size in made if shape.endswith("changed") else [made]:
                assert size <= max_body_mib * MIB
                import_one(data_dir, path, aggregation)
    log_path = tmp_path / "serve.log"
    with capped_serve(data_dir, log_path, max_body_mib, limit) as proc:
        wait_for(lambda: proc.poll() is not None or all(
            row["parse_status"] != "pending" for row in db_rows(data_dir)), timeout=300,
            what="every delivery folded, or serve killed")
        peak = proc_status(proc.pid).get("VmHWM", 0)
    assert peak <= limit, "serve's VmHWM %.1f MiB, its limit %.1f MiB" % (peak / MIB,
                                                                           limit / MIB)
    assert [row["parse_status"] for row in db_rows(data_dir)] == ["parsed"] * 5
    lines = log_path.read_text(errors="replace").splitlines()
    assert not [line for line in lines if "may need more memory" in line]
    assert "serving" in [parse_logfmt(line).get("msg") for line in lines]


BESIDE_MIB = 48
"""RELY-10.5's --max-body-mib: a Days history of about this size folds while a body of
emoji sources as large arrives.  Large enough that the ingest check's old 4.8 times the
body (its text decoded whole, 4 bytes a character) passes the limit beside the fold (by
about 10 MiB: the fold holds about 1.2 times its body while the check runs)."""


def post_file(port: int, path: Path) -> Optional[int]:
    """POST the body in ``path`` to /api/ingest, read as it is sent; the status (None when
    the connection broke: serve killed)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    try:
        with open(str(path), "rb") as body:
            conn.request("POST", "/api/ingest", body=body, headers={
                "Authorization": "Bearer " + TOKEN, "Content-Type": "application/json",
                "Content-Length": str(path.stat().st_size),
                "automation-aggregation": "Minutes"})
            answer = conn.getresponse()
            answer.read()
            return answer.status
    except (http.client.HTTPException, OSError):
        return None
    finally:
        conn.close()


def test_rely_10_5_a_body_of_emoji_sources_arrives_while_a_days_history_folds(
        tmp_path, monkeypatch, logs):
    """WHEN a real serve, under the smallest memory limit its start-up check accepts for
    --max-body-mib 48 (enforced by the watchdog), folds a Days export of every metric of
    about 48 MiB and, while that fold runs, a body as large whose every ``source`` carries
    an emoji arrives (a phone sending during a backfill), THEN the body is answered 200
    while the history is still pending, both deliveries end parsed, the watchdog never
    fires and serve's VmHWM stays under the limit."""
    limit = smallest_accepted_limit(tmp_path, monkeypatch, logs, BESIDE_MIB)
    folder = tmp_path / "bodies"
    folder.mkdir()
    history, aggregation, _ = write(folder, "days-backfill", BESIDE_MIB * MIB - (16 << 10))
    arriving, _, _ = write(folder, "emoji-sources", BESIDE_MIB * MIB - (16 << 10))
    data_dir = tmp_path / "data"
    import_one(data_dir, history, aggregation)  # folded as soon as serve starts
    log_path = tmp_path / "serve.log"
    with capped_serve(data_dir, log_path, BESIDE_MIB, limit) as proc:
        wait_for(lambda: proc.poll() is not None or port_of(log_path), timeout=60,
                 what="serve listening")
        idle = proc_status(proc.pid).get("VmRSS", 0)
        wait_for(lambda: proc.poll() is not None or proc_status(proc.pid).get(
            "VmRSS", 0) > idle + BESIDE_MIB * MIB // 2, timeout=120,
            what="the history's fold under way (its text read)")
        assert proc.poll() is None, "serve ended before the body arrived"
        status = post_file(port_of(log_path), arriving)
        during = [row["parse_status"] for row in db_rows(data_dir)]
        wait_for(lambda: proc.poll() is not None or all(
            row["parse_status"] != "pending" for row in db_rows(data_dir)), timeout=600,
            what="both deliveries folded, or serve killed")
        peak = proc_status(proc.pid).get("VmHWM", 0)
    print("RELY-10.5: serve's VmHWM %.1f MiB, its limit %.1f MiB" % (peak / MIB, limit / MIB))
    assert status == 200 and during == ["pending", "pending"], (status, during)
    assert peak <= limit, "serve's VmHWM %.1f MiB, its limit %.1f MiB" % (peak / MIB,
                                                                           limit / MIB)
    assert [row["parse_status"] for row in db_rows(data_dir)] == ["parsed", "parsed"]
