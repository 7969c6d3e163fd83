"""Faults that must not stop the fold: a delivery that kills the process, a busy database,
memory running out, an archive that cannot be read, one body that cannot be read, and the
way back for what failed (``healthlog refold``).

Everything is real: real SQLite files, real archive folders, real Cheroot servers on
127.0.0.1:0 and real ``healthlog.py serve`` subprocesses, killed for real.

- The OOM killer is a watchdog thread of the test that reads the serve process's VmRSS from
  ``/proc`` every 2 ms and sends SIGKILL above a cap; the test restarts serve after each
  death, as systemd would.
- Memory running out is ``RLIMIT_AS`` set on a real serve process (an exec wrapper, as
  test_storage_faults.py sets ``RLIMIT_FSIZE``), raised again with ``prlimit`` while it runs.
- An archive that cannot be read is a day folder with mode 000.  CI runs as root, and root
  reads it anyway, so there serve runs as root without the two capabilities that bypass
  file permissions (CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH): it then meets a real EACCES.
  Running it as ``nobody`` instead does not work on these machines: the virtualenv's
  interpreter lives under /root (mode 700), which nobody cannot enter.
- One body that cannot be read is a directory put where its file was (EISDIR).

Deliveries are either posted to a service, or journaled with ``healthlog import`` with the
file's modification time as their place in the journal, so that nothing is folded before
the test starts the serve that must fold them.

Names carry the fold spec's scenario IDs (openspec/specs/fold/spec.md, FOLD-14 to FOLD-16).
"""

import contextlib
import datetime as dt
import hashlib
import json
import os
import resource
import signal
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

import hae_factory as hf
import healthlog
from conftest import (ROOT, TOKEN, Client, Passes, WriteLock, assert_no_leaks, db_rows,
                      delivery_row, find_records, healthz, journal_rows, run_cli,
                      statuses_of, wait_for)
from fold_helpers import (DAY, HEADERS, QUICK_SERVE, OomWatchdog, QuickRetryWorker, import_bodies,
                          port_of, post_small, proc_status, small_body)

pytestmark = pytest.mark.json_agnostic  # faults of the machine: no JSON library plays a part

MIB = 1 << 20

DEFERRED_MEMORY = "fold deferred: memory ran out"
DEFERRED_ARCHIVE = "fold deferred: the archived body cannot be read"
GAVE_UP = "without an outcome"


# ---------------------------------------------------------------------------------------------
# Bodies, the journal, the command line.


def one_point_body() -> bytes:
    """One step count and no automation headers: no rule can tell its layer."""
    return hf.dumps_hae(hf.envelope(metrics=[hf.metric("step_count", [
        {"date": "2024-03-08 10:17:00 -0800", "qty": 41, "source": hf.OWNER_WATCH}],
        "count")]))


def objects_of(data_dir: Path, delivery_id: int) -> int:
    return db_rows(data_dir, "SELECT count(*) AS n FROM object WHERE delivery_id = ?"
                   " OR updated_by = ?", (delivery_id, delivery_id))[0]["n"]


def healthy(client: Client) -> bool:
    """/healthz answers 200 "ok" and names no fault."""
    status, health = healthz(client)
    return status == 200 and health["status"] == "ok" and "fault" not in health


def sha256_of(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


# ---------------------------------------------------------------------------------------------
# Requirement 14: no delivery can stop the fold.


def serve_command(data_dir: Path) -> list:
    return [sys.executable, "-m", "healthlog", "serve", "--data", str(data_dir),
            "--listen", "127.0.0.1:0", "--token", TOKEN]


@contextlib.contextmanager
def watched_serves(tmp_path: Path):
    """Start serve processes (each under its own watchdog); all are ended afterwards, and
    their logs checked for leaks."""
    started = []

    def start(data_dir: Path, cap: int) -> tuple:
        log_path = tmp_path / ("serve-%d.log" % len(started))
        with open(str(log_path), "wb") as log:
            proc = subprocess.Popen(serve_command(data_dir), stdout=subprocess.DEVNULL,
                                    stderr=log)
        watchdog = OomWatchdog(proc.pid, cap)
        watchdog.start()
        started.append((proc, watchdog, log_path))
        return proc, watchdog, log_path

    try:
        yield start
    finally:
        for proc, watchdog, log_path in started:
            watchdog.finish()
            if proc.poll() is None:
                proc.kill()
            proc.wait(30)
            assert_no_leaks(log_path.read_text(errors="replace").splitlines())


def idle_serve_figures(serve_process, tmp_path: Path, **kw) -> dict:
    """/proc figures of a serve process idling on an empty data directory, after it has
    answered one request (its HTTP threads are up)."""
    proc = serve_process(tmp_path / "idle-data", **kw)
    assert healthz(proc.client)[0] == 200
    figures = proc_status(proc.proc.pid)
    assert proc.terminate() == 0
    return figures


@pytest.mark.torture  # kills a process on purpose: with the torture runs (pyproject.toml)
def test_fold_14_1_a_delivery_that_kills_the_process_three_times_is_failed_and_the_queue_moves(
        serve_process, data_dir, tmp_path):
    big_body = hf.big_metrics_body(32 * MIB, seed=14)
    idle = idle_serve_figures(serve_process, tmp_path)["VmRSS"]
    # The fold of a body this size needs about twice the body over idle (FOLD-13), the
    # small folds almost nothing: the cap lets serve start, idle and fold the small ones.
    cap = idle + 20 * MIB
    first = dt.datetime.now(dt.timezone.utc) - dt.timedelta(minutes=1)
    big, *small = import_bodies(data_dir, tmp_path / "exports",
                                [big_body, small_body(1), small_body(2, DAY.replace(day=9))],
                                first)

    def settled() -> bool:
        assert statuses_of(data_dir, [big]) != ["parsed"], "the watchdog let the big fold through"
        return (statuses_of(data_dir, [big]) == ["failed"]
                and statuses_of(data_dir, small) == ["parsed", "parsed"])

    kills = []
    with watched_serves(tmp_path) as start:
        for _ in range(1 + 4):  # the first start, then at most 4 restarts
            proc, watchdog, log_path = start(data_dir, cap)
            wait_for(lambda proc=proc: proc.poll() is not None or settled(), timeout=120,
                     what="serve is killed, or the queue has moved past the big delivery")
            if proc.poll() is None:
                break
            watchdog.finish()
            assert proc.returncode == -signal.SIGKILL and watchdog.killed_at, (
                "serve died, not by the watchdog:\n" + log_path.read_text())
            kills.append(delivery_row(data_dir, big)["attempts"])
        else:
            raise AssertionError("the big delivery still stops the queue after 4 restarts")
        # Each death left its counted attempt; the fourth start gave up before folding.
        assert kills == [1, 2, 3]

        [failed] = db_rows(data_dir, "SELECT * FROM delivery WHERE id = ?", (big,))
        assert (failed["parse_status"], failed["error"], failed["attempts"]) == (
            "failed", healthlog.ATTEMPTS_EXHAUSTED, 3)
        assert objects_of(data_dir, big) == 0
        archived = data_dir / failed["archive_path"]
        assert sha256_of(archived) == hashlib.sha256(big_body).hexdigest() \
            == failed["body_sha256"]
        for delivery_id in small:
            assert delivery_row(data_dir, delivery_id)["attempts"] == 1

        lines = log_path.read_text(errors="replace").splitlines()
        [error] = find_records(lines, "", level="ERROR")
        assert GAVE_UP in error["msg"] and "healthlog refold %d" % big in error["msg"]
        assert error["delivery_id"] == str(big)
        assert float(error["body_mib"]) == round(len(big_body) / MIB, 1)
        assert error["last_fault"] == "died"

        client = Client("127.0.0.1", wait_for(lambda: port_of(log_path)))
        status, health = healthz(client)
        assert status == 200
        assert (health["status"], health["failed_after_attempts"]) == ("degraded", 1)
        assert "fault" not in health

        result = run_cli("status", "--data", data_dir, "--json")
        assert result.returncode == 0, result.stderr
        summary = json.loads(result.stdout)
        assert summary["failed_worth_retrying"] == 1
        assert summary["failed_by_error"] == {healthlog.ATTEMPTS_EXHAUSTED: 1}
        text = run_cli("status", "--data", data_dir).stdout
        assert "1 delivery failed for a reason of the machine" in text
        assert "refold --failed" in text

        status, metrics = client.request("GET", "/metrics")
        assert status == 200
        assert 'healthlog_failed_deliveries{error="fold_attempts_exhausted"} 1' \
            in metrics.decode().splitlines()

        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0


class LockedAtWrite(healthlog.FoldEngine):
    """The real engine; for the next ``defer`` folds a second real connection takes the
    write lock after the fold's attempt was counted, just before the fold writes."""

    def __init__(self, conn, config, defer: int):
        super().__init__(conn, config)
        self.defer = defer
        self.holder = None

    def apply(self, plan):
        if self.defer:
            self.defer -= 1
            self.holder = sqlite3.connect(str(self.config.db_path), isolation_level=None,
                                          check_same_thread=False)  # Passes' thread
            self.holder.execute("BEGIN IMMEDIATE")
        return super().apply(plan)

    def release(self) -> None:
        if self.holder is not None:
            self.holder.execute("ROLLBACK")
            self.holder.close()
            self.holder = None


@pytest.mark.parametrize("when", ["before its attempt", "at its write"])
def test_fold_14_2_attempts_the_database_deferred_are_not_counted(start_service, logs,
                                                                  monkeypatch, when):
    # Busy retries a few ms apart instead of 0.1 and 0.5 s: five deferred passes, not 4 s.
    monkeypatch.setattr(healthlog, "FOLD_BUSY_BACKOFF_S", (0.01, 0.01))
    service = start_service(paused=True, busy_timeout_s=0.05)  # its fold thread never runs
    status, payload = Client(*service.address).ingest(small_body(1), headers=HEADERS)
    assert status == 200
    delivery = payload["delivery_id"]
    data_dir = service.config.data_dir
    driver = Passes(service.config)
    try:
        if when == "before its attempt":  # the lock is held through the whole pass
            with WriteLock(service.config.db_path):
                for _ in range(5):
                    assert driver.run() == 0
            expected_between = 0  # the count itself was deferred
        else:  # the attempt is counted, then the fold's write finds the database busy
            driver.engine = LockedAtWrite(driver.conn, driver.config, defer=5)
            for _ in range(5):
                try:
                    assert driver.run() == 0
                finally:
                    driver.engine.release()
            expected_between = 1  # the deferred fold's attempt is taken back at the next
        deferred = logs.find("fold deferred", level="INFO")
        assert [r["delivery_id"] for r in deferred] == [str(delivery)] * 5
        found = delivery_row(data_dir, delivery)
        assert (found["parse_status"], found["attempts"]) == ("pending", expected_between)

        assert driver.run() == 1  # the lock is gone
    finally:
        driver.close()

    found = delivery_row(data_dir, delivery)
    assert (found["parse_status"], found["attempts"], found["error"]) == ("parsed", 1, None)
    assert logs.find("", level="ERROR") == []


# ---------------------------------------------------------------------------------------------
# Requirement 15: a fault of the machine leaves the delivery pending.


def address_space_limited(soft: int) -> list:
    """The interpreter for ServeProcess: python that sets RLIMIT_AS's soft limit (the
    hard one stays unlimited, so that the test can raise it again), then execs the real
    ``healthlog.py serve …`` in the same process."""
    code = ("import os, resource, sys;"
            " resource.setrlimit(resource.RLIMIT_AS, (%d, resource.RLIM_INFINITY));"
            " os.execv(sys.executable, [sys.executable] + sys.argv[1:])" % soft)
    return [sys.executable, "-c", code]


@pytest.mark.torture  # exhausts a process's memory on purpose: with the torture runs
@pytest.mark.skipif(resource.getrlimit(resource.RLIMIT_AS)[1] != resource.RLIM_INFINITY,
                    reason="RLIMIT_AS has a hard limit here: it could not be raised again")
def test_fold_15_1_memory_running_out_during_a_fold_leaves_the_delivery_pending(
        serve_process, data_dir, tmp_path):
    # glibc gives each thread that allocates an arena of its own, reserving 64 MiB of
    # address space each: with serve's 20 threads the idle process would take over 1 GiB
    # of address space it never uses, which drowns the fold's need.  Two arenas keep the
    # idle figure near what the process really maps (about 270 MiB here).
    env = dict(os.environ, MALLOC_ARENA_MAX="2")
    idle_peak = idle_serve_figures(serve_process, tmp_path, env=env)["VmPeak"]
    body = hf.big_metrics_body(32 * MIB, seed=15)
    # The fold reads the 32 MiB body whole before anything else (FOLD-13): 24 MiB over
    # idle lets serve start and answer, and not read it.
    limit = idle_peak + 24 * MIB
    [delivery] = import_bodies(data_dir, tmp_path / "exports", [body],
                               dt.datetime.now(dt.timezone.utc) - dt.timedelta(minutes=1))

    proc = serve_process(data_dir, python=address_space_limited(limit), env=env)
    assert resource.prlimit(proc.proc.pid, resource.RLIMIT_AS)[0] == limit
    wait_for(lambda: find_records(proc.log_lines(), DEFERRED_MEMORY, level="ERROR"), timeout=60,
             what="the fold runs out of memory")
    # /healthz answers 503 and names the fault while the fold loop pauses (1 s after the
    # first try, 5 s after the second): poll, it may be folding again for a moment.
    status, health = wait_for(lambda: (lambda h: h[0] == 503 and h)(healthz(proc.client)),
                              timeout=30, what="/healthz answers 503 during the pause")
    assert (health["status"], health.get("fault")) == ("failing", "memory")
    found = delivery_row(data_dir, delivery)
    assert (found["parse_status"], found["error"]) == ("pending", "retrying:memory")
    # Memory running out is the machine's (the process survived it): no attempt is kept,
    # and the delivery waits as long as it takes; raise the limit now, as freeing memory
    # would.
    resource.prlimit(proc.proc.pid, resource.RLIMIT_AS,
                     (resource.RLIM_INFINITY, resource.RLIM_INFINITY))

    wait_for(lambda: statuses_of(data_dir, [delivery]) != ["pending"], timeout=90,
             what="the delivery is folded once memory is there")
    found = delivery_row(data_dir, delivery)
    assert (found["parse_status"], found["error"]) == ("parsed", None)
    assert found["attempts"] == 1  # only the try that folded it is kept
    assert objects_of(data_dir, delivery) == found["objects_written"] > 0
    lines = proc.log_lines()
    deferrals = find_records(lines, DEFERRED_MEMORY, level="ERROR")
    assert len(deferrals) >= 1
    assert all((r["delivery_id"], r["fault"]) == (str(delivery), "memory") for r in deferrals)
    assert find_records(lines, GAVE_UP) == []
    # The fault is cleared when fold_one returns, a moment after the outcome's commit.
    wait_for(lambda: healthy(proc.client), what="/healthz says ok and names no fault")
    assert proc.terminate() == 0


_DROP_DAC = """
import ctypes, os, sys
libc = ctypes.CDLL(None, use_errno=True)
for capability in (1, 2):  # CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH
    if libc.prctl(24, capability, 0, 0, 0) != 0:  # PR_CAPBSET_DROP
        sys.exit("cannot drop capability %d: %s" % (capability, os.strerror(ctypes.get_errno())))
os.execv(sys.executable, [sys.executable] + sys.argv[1:])
"""


def permission_bound_python(tmp_path: Path) -> list:
    """An interpreter for ServeProcess that file permissions apply to, or skip.

    Not root: the plain interpreter.  Root: one whose capability bounding set lacks
    CAP_DAC_OVERRIDE and CAP_DAC_READ_SEARCH, so that the exec'd serve keeps uid 0 (and
    reads the root-owned virtualenv, data directory and database) but meets EACCES in a
    folder with mode 000.  Proven on a probe folder before it is used."""
    python = [sys.executable] if os.geteuid() != 0 else [sys.executable, "-c", _DROP_DAC]
    probe = tmp_path / "probe"
    probe.mkdir()
    (probe / "body.json").write_text("{}")
    probe.chmod(0)
    try:
        result = subprocess.run(python + ["-c", "import sys; open(sys.argv[1]).read()",
                                          str(probe / "body.json")],
                                capture_output=True, text=True, timeout=60)
    finally:
        probe.chmod(0o755)
    if "PermissionError" not in result.stderr:
        pytest.skip("cannot run serve so that a folder with mode 000 is unreadable to it"
                    " (as root without CAP_DAC_OVERRIDE): %s"
                    % (result.stderr.strip() or "the probe read the file"))
    return python


def test_fold_15_2_an_archive_that_cannot_be_read_for_a_while_fails_nothing(
        serve_process, data_dir, tmp_path):
    python = permission_bound_python(tmp_path)
    # One delivery folded first: the archive then has a body the worker can try to read
    # besides the failing one, in the same day folder (received the same day).
    first = dt.datetime(2024, 3, 8, 10, tzinfo=dt.timezone.utc)
    [folded] = import_bodies(data_dir, tmp_path / "exports-1", [small_body(1)], first)
    proc = serve_process(data_dir)
    wait_for(lambda: statuses_of(data_dir, [folded]) == ["parsed"], timeout=60)
    assert proc.terminate() == 0
    ids = import_bodies(data_dir, tmp_path / "exports-2",
                        [small_body(n, DAY + dt.timedelta(days=n)) for n in (2, 3, 4)],
                        first + dt.timedelta(minutes=1))
    day_folder = {(data_dir / delivery_row(data_dir, i)["archive_path"]).parent
                  for i in [folded] + ids}
    assert len(day_folder) == 1
    [day_folder] = day_folder

    day_folder.chmod(0)
    try:
        proc = serve_process(data_dir, python=python)
        head = ids[0]
        # Two tries: the first pass at start, and the one after the first pause (1 s).
        deferrals = wait_for(lambda: (lambda d: len(d) >= 2 and d)(
            find_records(proc.log_lines(), DEFERRED_ARCHIVE, level="ERROR")), timeout=60,
            what="two tries meet the unreadable archive")
        assert all((r["delivery_id"], r["fault"]) == (str(head), "archive:EACCES")
                   for r in deferrals)
        status, health = wait_for(lambda: (lambda h: h[0] == 503 and h)(healthz(proc.client)),
                                  timeout=30, what="/healthz answers 503 during the pause")
        assert (health["status"], health.get("fault")) == ("failing", "archive:EACCES")

        # A fault of the archive is none of the delivery's: its attempt is taken back, and
        # the pass stops at it (the others are not even tried).  Polled: during a try the
        # attempt is counted for a moment.
        def untouched() -> bool:
            rows = [delivery_row(data_dir, i) for i in ids]
            return ([(r["parse_status"], r["attempts"], r["folded_at"]) for r in rows]
                    == [("pending", 0, None)] * 3
                    and [r["error"] for r in rows] == ["retrying:archive:EACCES", None, None])

        wait_for(untouched, timeout=30, what="the deliveries are pending, no attempt kept")
        assert all(objects_of(data_dir, i) == 0 for i in ids)
    finally:
        day_folder.chmod(0o755)

    wait_for(lambda: statuses_of(data_dir, ids) == ["parsed"] * 3, timeout=90,
             what="the deliveries are folded once the archive can be read")
    for delivery_id in ids:
        found = delivery_row(data_dir, delivery_id)
        assert (found["attempts"], found["error"]) == (1, None)
    # Each fold logs "delivery folded" after the commit the statuses were read from:
    # read the log once the last of those records is there.
    lines = wait_for(lambda: (lambda found: len(find_records(found, "delivery folded")) >= len(ids)
                              and found)(proc.log_lines()),
                     what="the folds' records")
    assert find_records(lines, GAVE_UP) == []
    assert [int(r["delivery_id"]) for r in find_records(lines, "delivery folded")] == ids
    # The fault is cleared when fold_one returns, a moment after the outcome's commit.
    wait_for(lambda: healthy(proc.client), what="/healthz says ok and names no fault")
    assert proc.terminate() == 0


def test_fold_15_4_an_unreadable_day_folder_fails_nothing_while_the_newest_folded_is_elsewhere(
        serve_process, data_dir, tmp_path):
    """The report: the newest folded delivery in yesterday's folder, today's folder
    unreadable for longer than three tries of the fold.  Nothing is failed, no attempt is
    kept, and once the folder can be read everything folds by itself; verify is equal."""
    python = permission_bound_python(tmp_path)
    quick = tmp_path / "quick_serve.py"
    quick.write_text(QUICK_SERVE % str(ROOT))
    yesterday = dt.datetime(2024, 3, 8, 23, 58, tzinfo=dt.timezone.utc)
    [folded] = import_bodies(data_dir, tmp_path / "exports-1", [small_body(1)], yesterday)
    proc = serve_process(data_dir)
    wait_for(lambda: statuses_of(data_dir, [folded]) == ["parsed"], timeout=60)
    assert proc.terminate() == 0
    ids = import_bodies(data_dir, tmp_path / "exports-2",
                        [small_body(n, DAY + dt.timedelta(days=n)) for n in (2, 3, 4)],
                        yesterday + dt.timedelta(minutes=5))  # after UTC midnight
    today = {(data_dir / delivery_row(data_dir, i)["archive_path"]).parent for i in ids}
    assert len(today) == 1
    [today] = today
    assert (data_dir / delivery_row(data_dir, folded)["archive_path"]).parent != today

    today.chmod(0)
    try:
        proc = serve_process(data_dir, python=python, program=str(quick))
        tries = 3 * healthlog.FOLD_ATTEMPTS_MAX
        wait_for(lambda: len(find_records(proc.log_lines(), DEFERRED_ARCHIVE,
                                          level="ERROR")) >= tries,
                 timeout=90, what="%d tries meet the unreadable folder" % tries)

        def untouched() -> bool:  # polled: during a try the attempt is counted for a moment
            rows = [delivery_row(data_dir, i) for i in ids]
            return ([(r["parse_status"], r["attempts"]) for r in rows]
                    == [("pending", 0)] * 3 and rows[0]["error"] == "retrying:archive:EACCES")

        wait_for(untouched, timeout=30, what="pending, no attempt kept")
        assert find_records(proc.log_lines(), GAVE_UP) == []
    finally:
        today.chmod(0o755)

    wait_for(lambda: statuses_of(data_dir, ids) == ["parsed"] * 3, timeout=60,
             what="the deliveries are folded once the folder can be read")
    rows = [delivery_row(data_dir, i) for i in ids]
    assert [(r["attempts"], r["error"]) for r in rows] == [(1, None)] * 3
    assert proc.terminate() == 0
    assert find_records(proc.log_lines(), GAVE_UP) == []
    assert db_rows(data_dir, "SELECT count(*) AS n FROM delivery WHERE parse_status ="
                   " 'failed'")[0]["n"] == 0
    verified = run_cli("verify", "--data", data_dir)
    assert verified.returncode == 0 and "verify: equal" in verified.stdout, verified.stdout


@pytest.fixture
def quick_service(make_config):
    """A real service whose fold loop pauses only 0.1 s and wakes every 0.2 s, and that
    folds every delivery from its archived body (no hand-over from ingest, FOLD-17): the
    faults here are the archive's."""
    service = healthlog.Service(make_config(fold_wake_s=0.2, handoff_budget=0),
                                announce=lambda token: None)
    service.worker = QuickRetryWorker(service.config)
    service.start()
    yield service
    assert service.stop()


def exhaust_one_body(service: healthlog.Service) -> tuple:
    """(first, exhausted, after): four deliveries posted, the second one left with the
    attempts three deaths during its fold leave (FOLD-14.1 kills real processes for
    them), and the worker let go until it is failed; the others are parsed."""
    ids = post_small(service, 4)
    first, exhausted, *after = ids
    with contextlib.closing(sqlite3.connect(str(service.config.data_dir / healthlog.DB_NAME))
                            ) as conn, conn:
        conn.execute("UPDATE delivery SET attempts = ? WHERE id = ?",
                     (healthlog.FOLD_ATTEMPTS_MAX, exhausted))
    service.worker.gate.set()
    wait_for(lambda: statuses_of(service.config.data_dir, ids)
             == ["parsed", "failed", "parsed", "parsed"],
             timeout=60, what="the exhausted delivery is failed and the others are folded")
    wait_for(lambda: service.worker.state == "idle")
    return first, exhausted, after


def test_fold_14_1_an_exhausted_delivery_is_failed_loudly_and_the_queue_moves(quick_service,
                                                                              logs):
    """The give-up of FOLD-14.1 on an in-process service: one ERROR naming the delivery
    and `healthlog refold`, the deliveries after it folded after it, /healthz degraded."""
    first, exhausted, after = exhaust_one_body(quick_service)
    data_dir = quick_service.config.data_dir
    found = delivery_row(data_dir, exhausted)
    assert (found["parse_status"], found["error"], found["attempts"]) == (
        "failed", healthlog.ATTEMPTS_EXHAUSTED, healthlog.FOLD_ATTEMPTS_MAX)
    assert objects_of(data_dir, exhausted) == 0
    [gave_up] = logs.find(GAVE_UP, level="ERROR")
    assert (gave_up["delivery_id"], gave_up["last_fault"]) == (str(exhausted), "died")
    assert "healthlog refold %d" % exhausted in gave_up["msg"]
    order = [(r["msg"], r.get("delivery_id")) for r in logs.records()]
    gave_up_at = order.index((gave_up["msg"], str(exhausted)))
    folded = [(i, int(d)) for i, (msg, d) in enumerate(order) if msg == "delivery folded"]
    assert [d for _, d in folded] == [first] + after
    assert all(i > gave_up_at for i, d in folded if d in after)
    status, health = healthz(Client(*quick_service.address))
    assert status == 200
    assert (health["status"], health["failed_after_attempts"]) == ("degraded", 1)


# ---------------------------------------------------------------------------------------------
# Requirement 16: failed deliveries can be folded again without a rebuild.


def test_fold_16_1_refold_beside_a_running_serve(quick_service, logs):
    first, broken, after = exhaust_one_body(quick_service)
    data_dir = quick_service.config.data_dir
    client = Client(*quick_service.address)
    assert healthz(client)[1]["status"] == "degraded"
    path = data_dir / delivery_row(data_dir, broken)["archive_path"]
    assert sha256_of(path) == delivery_row(data_dir, broken)["body_sha256"]  # the body is intact

    result = run_cli("refold", "--data", data_dir, "--failed")

    assert result.returncode == 0, result.stderr
    assert "refold: 1 delivery set back to pending (%d)" % broken in result.stdout
    assert "healthlog reindex" in result.stdout  # later deliveries are folded already
    # The running service's periodic pass folds it; nobody restarts anything.
    wait_for(lambda: statuses_of(data_dir, [broken]) == ["parsed"], timeout=60,
             what="the running service folds the refolded delivery")
    found = delivery_row(data_dir, broken)
    assert (found["attempts"], found["error"]) == (1, None)
    assert objects_of(data_dir, broken) == found["objects_written"] > 0
    # The warning follows the commit the status was read from: wait for it as well.
    [late] = wait_for(lambda: logs.find("folded after a later one", level="WARN"),
                      what="the late fold's warning")
    assert late["delivery_id"] == str(broken)
    status, health = wait_for(lambda: (lambda h: h[1]["status"] == "ok" and h)(healthz(client)),
                              timeout=60, what="/healthz is ok again")
    assert (status, health["failed_after_attempts"]) == (200, 0)


def parsed_and_unlayered(start_service, data_dir: Path) -> tuple:
    """(parsed, unlayered): a delivery folded and one whose layer no rule can tell (failed),
    posted to a service that is stopped again."""
    service = start_service()
    client = Client(*service.address)
    parsed = client.ingest(small_body(1), headers=HEADERS)[1]["delivery_id"]
    unlayered = client.ingest(one_point_body())[1]["delivery_id"]
    wait_for(lambda: statuses_of(data_dir, [parsed, unlayered]) == ["parsed", "failed"])
    assert service.stop()
    return parsed, unlayered


def test_fold_16_2_refold_without_serve_and_what_it_refuses(start_service, data_dir, logs):
    # What failed: a fold over its deadline (a slow machine: worth folding again) and a
    # delivery whose layer no rule can tell (the body decides: it fails again).
    parsed, unlayered = parsed_and_unlayered(start_service, data_dir)
    service = start_service(fold_deadline_s=1e-9)
    slow = Client(*service.address).ingest(small_body(2, DAY.replace(day=9)),
                                           headers=HEADERS)[1]["delivery_id"]
    wait_for(lambda: statuses_of(data_dir, [slow]) == ["failed"])
    assert service.stop()
    assert [delivery_row(data_dir, i)["error"] for i in (unlayered, slow)] == [
        "layer_not_inferable", "fold_deadline_exceeded"]

    before = journal_rows(data_dir)
    result = run_cli("refold", "--data", data_dir, slow, parsed)
    assert result.returncode == 0, result.stderr
    assert "delivery %d is parsed, not failed: left as it is" % parsed in result.stdout
    assert "refold: 1 delivery set back to pending (%d)" % slow in result.stdout
    found = delivery_row(data_dir, slow)
    assert (found["parse_status"], found["attempts"], found["error"], found["folded_at"],
            found["layer"], found["points"]) == ("pending", 0, None, None, None, None)
    assert [r for r in journal_rows(data_dir) if r["id"] != slow] == [
        r for r in before if r["id"] != slow]

    before = journal_rows(data_dir)
    for ids in ([999], [unlayered, 999]):  # an unknown id, alone or beside a failed one
        result = run_cli("refold", "--data", data_dir, *ids)
        assert result.returncode == 2, result.stdout
        assert "no delivery 999" in result.stderr
        assert journal_rows(data_dir) == before
    result = run_cli("refold", "--data", data_dir)  # no id, no --failed
    assert result.returncode == 2, result.stdout
    assert "--failed" in result.stderr
    assert journal_rows(data_dir) == before

    result = run_cli("refold", "--data", data_dir, unlayered)
    assert result.returncode == 0, result.stderr
    assert statuses_of(data_dir, [unlayered]) == ["pending"]

    service = start_service()  # the next start folds them
    wait_for(lambda: "pending" not in statuses_of(data_dir, [slow, unlayered]), timeout=60)
    assert service.stop()
    found = delivery_row(data_dir, slow)
    assert (found["parse_status"], found["attempts"], found["error"]) == ("parsed", 1, None)
    assert objects_of(data_dir, slow) == found["objects_written"] > 0
    found = delivery_row(data_dir, unlayered)  # the body decides: it fails again, the same way
    assert (found["parse_status"], found["error"]) == ("failed", "layer_not_inferable")


def test_fold_16_2_an_unknown_id_beside_failed_changes_nothing(start_service, data_dir):
    """`refold --failed ID…`: the ids are not dropped for --failed.  An unknown one exits 2
    and changes nothing, and one that is not failed is named and left alone."""
    parsed, unlayered = parsed_and_unlayered(start_service, data_dir)

    before = journal_rows(data_dir)
    result = run_cli("refold", "--data", data_dir, "--failed", 999)
    assert (result.returncode, journal_rows(data_dir)) == (2, before), result.stdout
    assert "no delivery 999" in result.stderr

    result = run_cli("refold", "--data", data_dir, "--failed", parsed)
    assert result.returncode == 0, result.stderr
    assert "delivery %d is parsed, not failed: left as it is" % parsed in result.stdout
    assert statuses_of(data_dir, [parsed, unlayered]) == ["parsed", "pending"]


