"""The suite's fixtures and the helpers test files of every kind share, each written once:
real data directories, a real Cheroot server on 127.0.0.1:0, real serve subprocesses, the
.pyz, log capture with a leak check on every test, a check that no test leaves threads or
connections behind, the command line (``run_cli``), the journal's and the store's rows, a
clock, HTTP servers of a test's own and the browser. A family's helpers have their own
module (tests/test_test_helpers.py says which, and fails on a helper written twice)."""

import ast
import contextlib
import dataclasses
import fcntl
import functools
import gc
import gzip
import http.client
import importlib.util
import io
import json
import logging
import os
import py_compile
import re
import signal
import socket
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Optional

import pytest

import build_zipapp
import healthlog

pytest.register_assert_rewrite("read_helpers")  # the read tests' oracle: say what differed
pytest.register_assert_rewrite("fold_helpers")  # the fold tests' Journal and DirectStore


def pytest_configure(config):
    """In the process that starts the workers: the test files' assertions rewritten once,
    before the workers start (:func:`rewrite_tests_once`)."""
    if WORKER is None:
        rewrite_tests_once(config)


def rewrite_tests_once(config) -> None:
    """Write pytest's cache of the test files with their asserts rewritten (in
    tests/__pycache__, checked by the source's hash), which every worker then reads
    instead of rewriting 37,000 lines itself (5 s of CPU a worker): pytest writes it only
    when Python may write bytecode, and CI sets PYTHONDONTWRITEBYTECODE. The files are
    those pytest rewrites: test_*.py, this file and the helper modules registered above,
    and the modules of the packages that bring a pytest plugin (hypothesis, anyio,
    xdist: pytest rewrites every module of such a package), those this process imported
    and hypothesis's that the test files import (1.3 s of CPU a worker, rewritten again in
    each). It uses pytest's own rewriting functions; should a pytest release change them,
    nothing is written and each worker rewrites as it always did."""
    try:
        from _pytest.assertion import rewrite

        state = config.stash.get(rewrite.assertstate_key, None)
        if state is None:  # --assert=plain
            return
        with contextlib.suppress(ImportError):  # rewritten here, as in every worker
            import hypothesis.strategies  # noqa: F401

        tests = Path(__file__).resolve().parent
        files = sorted(tests.glob("test_*.py")) + [
            tests / name for name in ("conftest.py", "read_helpers.py", "fold_helpers.py")]
        files += sorted(set(config.pluginmanager.rewrite_hook._rewritten_names.values()))
        for source in files:
            cache = rewrite.get_cache_dir(source)
            pyc = cache / (source.name[:-3] + rewrite.PYC_TAIL)
            if rewrite._read_pyc(source, pyc) is not None:
                continue
            if not rewrite.try_makedirs(cache):
                return
            source_hash, code = rewrite._rewrite_test(source, config)
            rewrite._write_pyc(state, code, source_hash, pyc)
    except (ImportError, AttributeError, TypeError):
        return


@pytest.fixture(scope="session")
def pyz(tmp_path_factory) -> Path:
    """dist/healthlog.pyz built once per session (per xdist worker) from the working
    tree, in a temp folder.

    The wheels come from build_zipapp's cache (build/wheels), downloaded on first use;
    a file lock keeps two workers from downloading into the cache at once.
    Run it with tests/test_build.py's run_pyz().
    """
    build_zipapp.DEFAULT_WHEELS.mkdir(parents=True, exist_ok=True)
    with open(str(build_zipapp.DEFAULT_WHEELS.parent / "wheels.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        return build_zipapp.build(tmp_path_factory.mktemp("pyz") / "healthlog.pyz")


TOKEN = "test-token-0123456789abcdef"
ROOT = Path(__file__).resolve().parent.parent

WORKER = os.environ.get("PYTEST_XDIST_WORKER")
"""This process's xdist worker name (``gw0``…), None in the process that starts them."""

# ``serve`` in a subprocess runs as ``python -m healthlog`` (the .pyz's way: its
# __main__ imports the module) from healthlog.py compiled once for the whole run: run as
# a script it would be compiled at every start (0.3 s of CPU a process, hundreds of
# processes), since PYTHONDONTWRITEBYTECODE, which CI sets, keeps Python from caching it.
# The process that starts the workers compiles it before they start; they use its copy.
if WORKER is None:
    py_compile.compile(str(ROOT / "healthlog.py"), doraise=True,
                       cfile=importlib.util.cache_from_source(str(ROOT / "healthlog.py")))
os.environ["PYTHONPATH"] = os.pathsep.join(
    [str(ROOT)] + [p for p in [os.environ.get("PYTHONPATH")] if p and p != str(ROOT)])

# The in-process servers of the tests look up from their accept loop every 20 ms instead of
# every 200 ms: Service.stop() waits for that look (cheroot's), and the suite stops about 500
# of them.  At the shipped pace a stop waited 0.18 s on average (46 s for the 260 stops of
# seven files), at this one 0.03 s.  Only the pace changes, not the path; ``serve`` in a
# subprocess keeps the shipped one.
healthlog.ACCEPT_TICK_S = 0.02

# Strings that must never appear in a log record above DEBUG: the tokens, and what test
# payloads carry: the canary device name and value, and the owner's name that is part of
# every device name in tests/hae_factory.py's traffic ("Anton’s Apple Watch").
LEAK_CANARIES = [TOKEN, "Zebulon", "72.123456789", "CANARY-BODY-TEXT", "Anton",
                 "canary-token-Zq7WxQ3vR9"]

_LOGFMT_PAIR = re.compile(r'(\w+)=("(?:[^"\\]|\\.)*"|\S*)')


def without_source(value):
    """The value without any ``source`` key at any level: an oracle written apart from
    healthlog.strip_source, for tests that check healthlog against the storage spec's
    merge rule."""
    if isinstance(value, dict):
        return {k: without_source(v) for k, v in value.items() if k != "source"}
    if isinstance(value, list):
        return [without_source(v) for v in value]
    return value


def parse_logfmt(line: str) -> dict:
    """One logfmt line as a dict of unescaped strings."""
    out = {}
    for key, raw in _LOGFMT_PAIR.findall(line):
        if raw.startswith('"'):
            raw = json.loads(raw)
        out[key] = raw
    return out


class LogCapture:
    """Everything healthlog logged during one test, as logfmt lines and dicts."""

    def __init__(self):
        self.stream = io.StringIO()

    def lines(self) -> list:
        return [line for line in self.stream.getvalue().splitlines() if line]

    def records(self) -> list:
        return [parse_logfmt(line) for line in self.lines()]

    def find(self, msg_part: str, level: str = None) -> list:
        return [r for r in self.records() if msg_part in r.get("msg", "")
                and (level is None or r.get("level") == level)]


def assert_no_leaks(lines, extra=()) -> None:
    """No record above DEBUG carries the token, a canary value or a device name."""
    for line in lines:
        if " level=DEBUG " in line or '"level": "DEBUG"' in line:
            continue
        for canary in list(LEAK_CANARIES) + list(extra):
            assert canary not in line, "log record leaks %r: %s" % (canary, line)


@pytest.fixture(autouse=True)
def logs():
    """Capture healthlog's records for the test, then check them for leaks."""
    capture = LogCapture()
    config = healthlog.Config(data_dir=Path("."), log_level="DEBUG")
    handler = healthlog.setup_logging(config, stream=capture.stream)
    yield capture
    logging.getLogger().removeHandler(handler)
    assert_no_leaks(capture.lines())


LEAK_GRACE_S = 10.0
"""How long a test's threads and sockets may take to end after its teardown."""


def _open_handles() -> set:
    """This process's open sockets and database files, as (fd, target) pairs."""
    handles = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink("/proc/self/fd/" + fd)
        except OSError:  # closed between listing and reading
            continue
        if target.startswith("socket:") or healthlog.DB_NAME in target:
            handles.add((fd, target))
    return handles


class Lazy:
    """A module's constant built the first time a test uses it.  pytest-xdist imports every
    test module in every worker to collect it, and runs each module in one worker only
    (``--dist loadfile``): a corpus built at import would be built in all of them."""

    def __init__(self, build):
        self._build, self._value, self._built = build, None, False

    def _get(self):
        if not self._built:
            self._value, self._built = self._build(), True
        return self._value

    def __getattr__(self, name):
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self._get(), name)


@contextlib.contextmanager
def leaves_nothing_running(what: str):
    """Fail when ``what`` (the test, the module) leaves threads, servers or connections
    behind, given :data:`LEAK_GRACE_S` to end them: a fold thread still burning a core
    slows every later test and makes timings vary."""
    threads, handles = set(threading.enumerate()), _open_handles()
    yield
    deadline = time.monotonic() + LEAK_GRACE_S
    while True:
        extra_threads = [t.name for t in threading.enumerate() if t not in threads and t.is_alive()]
        extra_handles = sorted(target for _, target in _open_handles() - handles)
        if not extra_threads and not extra_handles:
            return
        if time.monotonic() > deadline:
            raise AssertionError("left running after %s: threads %s, open %s"
                                 % (what, extra_threads, extra_handles))
        time.sleep(0.05)


@pytest.fixture(autouse=True)
def nothing_left_running(request):
    """Every test ends what it started; in a module marked ``module_lifetime`` (its service
    and browser live for the module) the same check runs once, after the module
    (:func:`module_leaves_nothing_running`)."""
    if request.node.get_closest_marker("module_lifetime") is not None:
        yield
        return
    with leaves_nothing_running("the test"):
        yield


@pytest.fixture(scope="module", autouse=True)
def module_leaves_nothing_running(request):
    """A ``module_lifetime`` module ends what it started (a service, a browser)."""
    if request.node.get_closest_marker("module_lifetime") is None:
        yield
        return
    with leaves_nothing_running("the module"):
        yield


HEAVY_FIRST = ("test_reindex.py", "test_workout_large.py", "test_dashboard.py", "test_fold.py",
               "test_late_disk.py", "test_reindex_parallel.py", "test_hostile_input.py",
               "test_fold_stream.py", "test_storage.py", "test_read.py", "test_real_exports.py",
               "test_reliability.py", "test_fold_faults.py", "test_read_fast.py", "test_merge.py",
               "test_ingest.py", "test_read_time.py", "test_mcp.py", "test_storage_faults.py",
               "test_serve.py", "test_summary_page.py", "test_hae_factory.py",
               "test_sleep_nights.py", "test_workout_page.py", "test_fold_properties.py",
               "test_read_records.py", "test_security.py")
"""Test files that take the longest, longest first (``--durations``): pytest-xdist hands
whole files to its workers in collection order (``--dist loadfile
--no-loadscope-reorder``; its own order, by the number of tests in a file, put files of a
few long tests last), so that a long file begun last would leave the other workers idle
at the end."""


def pytest_collection_modifyitems(config, items):
    """A test marked ``json_agnostic`` (or in a module so marked, unless it is marked
    ``json_both``) runs in the orjson mode only: crash, lock and interrupt tests, where no
    JSON library plays a part, and tests of what the fold and a rebuild do with a body,
    whose JSON library's part is tested where it plays one (the parse and the index,
    test_fold_stream; ingest's check, test_hostile_input; a body's canonical form,
    test_merge and test_storage; the same fingerprint with and without orjson,
    REINDEX-10.3).  Then the longest files are put first (:data:`HEAVY_FIRST`)."""
    kept, dropped = [], []
    for item in items:
        params = getattr(getattr(item, "callspec", None), "params", {})
        agnostic = (item.get_closest_marker("json_agnostic") is not None
                    and item.get_closest_marker("json_both") is None)
        (dropped if agnostic and params.get("json_mode") == "stdlib" else kept).append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
    rank = {name: n for n, name in enumerate(HEAVY_FIRST)}
    kept.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: files stay whole
    items[:] = kept


def pytest_collection_finish(session):
    """What collection made (the test modules, healthlog, hypothesis, the items) lives to the
    end of the run: frozen out of the garbage collector's passes (``gc.freeze``), which
    otherwise walk all of it again at each full one (2.2 of 5.2 s of collector CPU in four
    of the heaviest files)."""
    gc.collect()
    gc.freeze()


@pytest.fixture(scope="module", params=["orjson", "stdlib"])
def json_mode(request, tmp_path_factory):
    """Run a whole module once with orjson and once with the standard json module
    (orjson hidden in this process and, through PYTHONPATH, in every subprocess):
    healthlog promises the same results either way.  Modules opt in with
    ``pytestmark = pytest.mark.usefixtures("json_mode")``; module fixtures that fold
    data request it so that they are built in the mode of their tests."""
    if request.param == "orjson":
        if healthlog._orjson is None:
            pytest.skip("orjson is not installed")
        yield request.param
        return
    hidden = tmp_path_factory.mktemp("no-orjson")
    (hidden / "orjson.py").write_text('raise ImportError("orjson is hidden by the tests")\n')
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(healthlog, "_orjson", None)
        patch.setenv("PYTHONPATH", os.pathsep.join(
            [str(hidden)] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
        yield request.param


@pytest.fixture
def data_dir(tmp_path) -> Path:
    return tmp_path / "data"


@pytest.fixture
def make_config(data_dir):
    """Config for an in-process server on 127.0.0.1:0 with short, test-sized timeouts."""

    def make(**overrides) -> healthlog.Config:
        values = dict(data_dir=data_dir, host="127.0.0.1", port=0, token=TOKEN,
                      busy_timeout_s=0.5, http_timeout_s=5.0, stop_budget_s=5.0,
                      log_level="DEBUG")
        values.update(overrides)
        return healthlog.Config(**values)

    return make


class GatedWorker(healthlog.FoldWorker):
    """The real fold worker, held before each pass until the test opens ``gate``.

    Lets a test look at the journal in the state "accepted, not yet folded" without
    racing the fold thread; once opened, the real pass runs unchanged.
    """

    def __init__(self, config):
        super().__init__(config)
        self.gate = threading.Event()
        self.held = threading.Event()  # set while the fold thread waits at the gate

    def run_pass(self, folder):
        while not self.gate.wait(0.02):
            self.held.set()
            if self._stop.is_set():
                return 0
        self.held.clear()
        return super().run_pass(folder)

    def hold(self) -> None:
        """Close the gate and return once the fold thread waits at it, so that a delivery
        posted next stays pending: a pass that was already past the gate (a wake-up left
        from the last deliveries) has ended first."""
        self.gate.clear()
        self.held.clear()
        self.wake()
        wait_for(self.held.is_set, what="the fold thread waiting at its gate")


@pytest.fixture
def start_service(make_config):
    """Start real Services (Cheroot on 127.0.0.1:0); all are stopped after the test.

    ``paused=True`` holds the fold thread (GatedWorker) until ``service.worker.gate``
    is set; ``worker=`` gives another subclass of the real FoldWorker.
    """
    started = []

    def start(paused: bool = False, worker: type = None, **overrides) -> healthlog.Service:
        service = healthlog.Service(make_config(**overrides), announce=lambda token: None)
        if paused or worker is not None:
            service.worker = (worker or GatedWorker)(service.config)
        service.start()
        started.append(service)
        return service

    yield start
    late = [service.address for service in started if not service.stop()]  # idempotent
    assert not late, "Service.stop() ran out of its budget (a fold outlived the test): %s" % late


@pytest.fixture
def service(start_service) -> healthlog.Service:
    return start_service()


@pytest.fixture
def paused_service(start_service) -> healthlog.Service:
    """A service whose fold thread waits for ``service.worker.gate``."""
    return start_service(paused=True)


def wait_for(predicate, timeout: float = 20.0, interval: float = 0.02, what: str = None):
    """Poll until predicate() is truthy; return its value or fail.

    The one way a test waits for something to happen (a row, a log record, a file, a
    state): never a bare ``time.sleep``.  ``timeout`` is a ceiling, not a speed figure:
    keep it many times the usual wait, so a busy 2-core machine still passes; ``what``
    names the awaited event in the failure.
    """
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError("%s: not seen within %.1f s" % (what or "condition", timeout))
        time.sleep(interval)


class Passes:
    """Fold passes driven by the test: the real ``FoldWorker.run_pass`` over the real
    ``FoldEngine``, on a connection of the test's own, so nothing races the test."""

    def __init__(self, config: healthlog.Config, **overrides):
        self.config = dataclasses.replace(config, **overrides)
        self.worker = healthlog.FoldWorker(self.config)
        self.conn = healthlog.connect(self.config.db_path,
                                      busy_timeout_s=self.config.busy_timeout_s,
                                      synchronous="NORMAL")
        self.engine = healthlog.FoldEngine(self.conn, self.config)

    def run(self, timeout: float = 60.0) -> int:
        """One pass; a pass that does not end within ``timeout`` fails the test (rather
        than hanging it: ING-4.4 is about passes that must end)."""
        result = {}

        def run_pass() -> None:
            result["folded"] = self.worker.run_pass(self.engine)

        thread = threading.Thread(target=run_pass, name="test-fold-pass", daemon=True)
        thread.start()
        thread.join(timeout)
        assert not thread.is_alive(), "the fold pass did not end within %.0f s" % timeout
        assert "folded" in result, "the fold pass raised"
        return result["folded"]

    def close(self) -> None:
        self.conn.close()


def read_to_end(sock: socket.socket) -> bytes:
    """Everything the server sends on a raw socket until it closes the connection (a reset
    counts as closing: the server may drop a connection whose request it refused)."""
    data = b""
    while True:
        try:
            chunk = sock.recv(1 << 16)
        except ConnectionResetError:
            break
        if not chunk:
            break
        data += chunk
    return data


class Client:
    """A tiny HTTP client for a running server; every call is a fresh connection."""

    def __init__(self, host: str, port: int, token: str = TOKEN):
        self.host, self.port, self.token = host, port, token

    def request(self, method: str, path: str, body: bytes = None, headers: dict = None,
                token: bool = True) -> tuple:
        conn = http.client.HTTPConnection(self.host, self.port, timeout=30)
        try:
            all_headers = {"Content-Type": "application/json"} if body is not None else {}
            if token:
                all_headers["Authorization"] = "Bearer " + self.token
            all_headers.update(headers or {})
            conn.request(method, path, body=body, headers=all_headers)
            response = conn.getresponse()
            raw = response.read()
            try:
                payload = json.loads(raw) if raw else None
            except ValueError:
                payload = raw
            return response.status, payload
        finally:
            conn.close()

    def ingest(self, body: bytes, path: str = "/api/ingest", **kw) -> tuple:
        return self.request("POST", path, body=body, **kw)


@pytest.fixture
def client(service) -> Client:
    host, port = service.address
    return Client(host, port)


def db_rows(data_dir: Path, sql: str = "SELECT * FROM delivery ORDER BY id", args=()) -> list:
    conn = sqlite3.connect(str(data_dir / "healthlog.sqlite3"))
    conn.row_factory = sqlite3.Row
    try:
        return [dict(row) for row in conn.execute(sql, args)]
    finally:
        conn.close()


def archive_files(data_dir: Path) -> list:
    """Every file under DATA/archive and DATA/tmp (relative paths, sorted)."""
    out = []
    for sub in ("archive", "tmp"):
        base = data_dir / sub
        if base.exists():
            out += sorted(str(p.relative_to(data_dir)) for p in base.rglob("*") if p.is_file())
    return out


class ServeProcess:
    """``python3 -m healthlog serve`` (healthlog.py) as a real subprocess; its stderr goes to
    a file."""

    def __init__(self, data_dir: Path, log_path: Path, *extra: str, python: str = sys.executable,
                 program: str = None, env: dict = None):
        self.log_path = log_path
        self._log = open(str(log_path), "ab")
        interpreter = [str(python)] if isinstance(python, (str, Path)) else list(python)
        args = interpreter + ([str(program)] if program else ["-m", "healthlog"]) + [
            "serve", "--data", str(data_dir), "--listen", "127.0.0.1:0", "--token", TOKEN]
        args += list(extra)
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=self._log,
                                     env=env)
        try:
            self.port = self._wait_for_port()
        except BaseException:  # never leave a server running behind a failed start
            self.proc.kill()
            self.proc.wait(30)
            self._log.close()
            raise

    def _wait_for_port(self, timeout: float = 60.0) -> int:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for line in self.log_path.read_text(errors="replace").splitlines():
                record = json.loads(line) if line.startswith("{") else parse_logfmt(line)
                if record.get("msg") == "serving":
                    return int(record["listen"].rsplit(":", 1)[1])
            if self.proc.poll() is not None:
                raise AssertionError("serve exited early:\n" + self.log_path.read_text())
            time.sleep(0.05)
        raise AssertionError("serve did not log its address:\n" + self.log_path.read_text())

    @property
    def client(self) -> Client:
        return Client("127.0.0.1", self.port)

    def log_lines(self) -> list:
        return [line for line in self.log_path.read_text(errors="replace").splitlines() if line]

    def terminate(self, sig=signal.SIGTERM, timeout: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout)
        finally:
            self._log.close()

    def kill(self) -> int:
        return self.terminate(signal.SIGKILL)


@pytest.fixture
def serve_process(tmp_path):
    """Start real serve subprocesses; any still running are killed after the test."""
    procs = []

    def start(data_dir: Path, *extra: str, **kw) -> ServeProcess:
        proc = ServeProcess(data_dir, tmp_path / ("serve-%d.log" % len(procs)), *extra, **kw)
        procs.append(proc)
        return proc

    yield start
    for proc in procs:
        if proc.proc.poll() is None:
            proc.kill()
        assert_no_leaks(proc.log_lines())


# -- helpers of several test files ------------------------------------------------------------
# What more than one test file needs lives here, once (tests/test_test_helpers.py fails when a
# top-level helper is defined in two test files, or a test file imports from another): the
# command line, the journal's rows, a clock the test moves, HTTP servers of a test's own, the
# browser.  Helpers of one family keep their own module: the read tests' oracle and module
# store (read_helpers.py), the fold tests' Journal and DirectStore (fold_helpers.py), the page's
# browser session and in-process store (dashboard_browser.py), HAE's bodies (hae_factory.py)
# and the workouts' corpus (workout_corpus.py).


def run_cli(*args, timeout: float = 120, env: dict = None, cwd=None, text: bool = True,
            output_is_data: bool = False, extra_canaries=()) -> subprocess.CompletedProcess:
    """``python -m healthlog ARGS`` as a subprocess, its output captured (str, or bytes
    with ``text=False``).  Run as a module, it imports healthlog.py compiled once for the
    whole run (above), where ``python healthlog.py`` would compile it at every start.

    Nothing it writes may leak health data or the token (:func:`assert_no_leaks`, with
    ``extra_canaries``): stderr always, stdout too unless it is the data asked for
    (``output_is_data``: an export)."""
    result = subprocess.run([sys.executable, "-m", "healthlog"] + [str(a) for a in args],
                            capture_output=True, text=text, timeout=timeout, env=env,
                            cwd=None if cwd is None else str(cwd))

    def lines(out) -> list:
        return (out if text else out.decode("utf-8", "replace")).splitlines()

    assert_no_leaks(lines(result.stderr) + ([] if output_is_data else lines(result.stdout)),
                    extra=extra_canaries)
    return result


def run_export(*args, **kw) -> subprocess.CompletedProcess:
    """``healthlog export ARGS`` (:func:`run_cli`): its stdout is the data, as bytes."""
    return run_cli("export", *args, text=False, output_is_data=True, **kw)


def log_records(lines) -> list:
    """Log lines (logfmt, or JSON with ``--log-format json``) as dicts."""
    return [json.loads(line) if line.startswith("{") else parse_logfmt(line) for line in lines]


def find_records(lines, msg_part: str, level: str = None) -> list:
    """The records of ``lines`` whose message contains ``msg_part`` (at ``level``)."""
    return [r for r in log_records(lines) if msg_part in r.get("msg", "")
            and (level is None or r.get("level") == level)]


JOURNAL_HISTORY = ("folded_at", "journaled_at", "attempts")
"""The journal columns that tell this machine's history, not what was delivered: when a fold
ran, when the row was inserted (a restore from the archive alone does not know it) and how
many tries the live fold took (a rebuild counts none)."""


def journal_rows(data_dir: Path, leave_out=(), order: str = "id", only=None) -> list:
    """Every row of the journal (the ``delivery`` table) as a dict, in ``order``: its
    ``only`` columns if given, else all but the ``leave_out`` ones."""
    return [{k: v for k, v in row.items() if (k in only if only else k not in leave_out)}
            for row in db_rows(data_dir, "SELECT * FROM delivery ORDER BY " + order)]


def statuses(data_dir: Path) -> dict:
    """Delivery id -> its parse status, for every journal row."""
    return {r["id"]: r["parse_status"] for r in db_rows(data_dir)}


def statuses_of(data_dir: Path, ids) -> list:
    """The parse statuses of the deliveries ``ids``, in that order."""
    found = statuses(data_dir)
    return [found[i] for i in ids]


def healthz(client: Client) -> tuple:
    """(status, answer) of ``GET /healthz`` (no token: a monitor's request)."""
    return client.request("GET", "/healthz", token=False)


def wait_folded(data_dir: Path, count: int = None, timeout: float = 60.0) -> dict:
    """Wait until no delivery is pending (and ``count`` are journaled, if given): the
    journal's statuses then (:func:`statuses`)."""
    def settled():
        found = statuses(data_dir)
        done = "pending" not in found.values() and (count is None or len(found) == count)
        return (found,) if done else None  # a tuple: true for an empty journal too

    return wait_for(settled, timeout=timeout, what="every delivery folded")[0]


def delivery_row(data_dir: Path, delivery_id: int) -> dict:
    """The journal row of one delivery."""
    [found] = db_rows(data_dir, "SELECT * FROM delivery WHERE id = ?", (delivery_id,))
    return found


class Clock:
    """A service's clock (``Config.clock``): epoch seconds the test sets and moves, instead
    of waiting for the time to pass.  It starts at ``now`` (the real time if not given)."""

    def __init__(self, now: float = None):
        self.now = time.time() if now is None else float(now)

    def __call__(self) -> float:
        return self.now


class LocalServer:
    """An HTTP server of the test's own on 127.0.0.1:0 in a thread (a notice receiver, a
    relay, a proxy, a tile server, a package index): ``handler`` is its
    ``BaseHTTPRequestHandler`` class.  Its request threads are joined when it is closed
    (:meth:`close`, or the end of a ``with`` block), so no test leaves one running."""

    def __init__(self, handler, name: str = "test-http-server"):
        import http.server

        class Server(http.server.ThreadingHTTPServer):
            daemon_threads = False  # server_close() joins the handlers

        self.server = Server(("127.0.0.1", 0), handler)
        self.address = self.server.server_address[:2]
        self.port = self.address[1]
        self.origin = "http://127.0.0.1:%d" % self.port
        self.thread = threading.Thread(target=self.server.serve_forever, args=(0.05,),
                                       name=name)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(10)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


@pytest.fixture(scope="module")
def browser():
    """One Chromium for the module (tests/dashboard_browser.py says which and how)."""
    from dashboard_browser import launched

    yield from launched()


def one_line(text: str) -> str:
    """The only line of ``text`` (a command's message); fails on a traceback or on more
    lines."""
    assert "Traceback" not in text, text
    lines = text.splitlines()
    assert len(lines) == 1, text
    return lines[0]


def live_fingerprint(data_dir: Path) -> str:
    """The fingerprint of the store in ``data_dir``, read from its database."""
    with contextlib.closing(sqlite3.connect(str(data_dir / healthlog.DB_NAME))) as conn:
        return healthlog.fingerprint(conn)


def object_rows(data_dir: Path, metric: str = None) -> list:
    """Every object row (of ``metric``, if given) as a dict, in (metric, layer, hour)
    order."""
    where, args = ("WHERE metric = ?", (metric,)) if metric else ("", ())
    return db_rows(data_dir, "SELECT * FROM object %s ORDER BY metric, layer, hour" % where,
                   args)


def stored_points(data_dir: Path, metric: str, layer: str = None) -> list:
    """(point, delivery id) of every stored point of ``metric`` (in ``layer``, if given),
    in hour order: the objects' blobs decoded here, apart from healthlog's reading."""
    sql = "SELECT blob, point_deliveries FROM object WHERE metric = ?"
    args = (metric,)
    if layer is not None:
        sql, args = sql + " AND layer = ?", args + (layer,)
    out = []
    for row in db_rows(data_dir, sql + " ORDER BY hour", args):
        out += zip(json.loads(gzip.decompress(row["blob"])), json.loads(row["point_deliveries"]))
    return out


class WriteLock:
    """A second real connection that holds SQLite's write lock (``BEGIN IMMEDIATE``) until
    the test releases it (:meth:`release`, or the end of a ``with`` block): a busy database.
    (A stronger lock cannot be had while serve runs: in WAL mode ``locking_mode=EXCLUSIVE``
    needs every other connection gone.)"""

    def __init__(self, db_path: Path):
        self.conn = sqlite3.connect(str(db_path), isolation_level=None)
        self.conn.execute("BEGIN IMMEDIATE")

    def release(self) -> None:
        if self.conn is not None:
            self.conn.execute("ROLLBACK")
            self.conn.close()
            self.conn = None

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.release()


@pytest.fixture
def write_locks():
    """hold(db_path) -> a :class:`WriteLock`; every lock still held is released after the
    test."""
    held = []

    def hold(db_path: Path) -> WriteLock:
        held.append(WriteLock(db_path))
        return held[-1]

    yield hold
    for lock in held:
        lock.release()


class RawAnswer:
    """An answer read off the socket by :func:`raw_request`: the status, the header lines as
    sent (``header_list``; ``headers`` by lower-case name) and the body."""

    def __init__(self, status: int, headers: list, body: bytes):
        self.status, self.header_list, self.body = status, headers, body
        self.headers = {name.lower(): value for name, value in headers}

    def all(self, name: str) -> list:
        return [value for key, value in self.header_list if key.lower() == name.lower()]

    def text(self) -> str:
        return "\r\n".join("%s: %s" % pair for pair in self.header_list) + "\r\n\r\n" + \
            self.body.decode("utf-8", "replace")


def raw_request(service, method: str, path: str, headers: dict = None, body: bytes = None,
                token: bool = False, source: str = "127.0.0.1") -> RawAnswer:
    """One request on a fresh connection; header values may be str or raw bytes.
    ``source``: the client's address (any of 127.0.0.0/8 on Linux)."""
    all_headers = {"Host": "127.0.0.1", "Connection": "close"}
    if token:
        all_headers["Authorization"] = "Bearer " + TOKEN
    if body is not None:
        all_headers["Content-Length"] = str(len(body))
        all_headers.setdefault("Content-Type", "application/json")
    all_headers.update(headers or {})
    head = ("%s %s HTTP/1.1\r\n" % (method, path)).encode("latin-1")
    for name, value in all_headers.items():
        value = value if isinstance(value, bytes) else value.encode("utf-8")
        head += name.encode("latin-1") + b": " + value + b"\r\n"
    with socket.create_connection(service.address, timeout=30,
                                  source_address=(source, 0)) as sock:
        sock.sendall(head + b"\r\n" + (body or b""))
        data = read_to_end(sock)
    head_part, _, payload = data.partition(b"\r\n\r\n")
    lines = head_part.decode("latin-1").split("\r\n")
    status = int(lines[0].split(" ", 2)[1])
    pairs = [tuple(part.strip() for part in line.split(":", 1)) for line in lines[1:] if line]
    return RawAnswer(status, pairs, payload)



def statements(tree: ast.AST):
    """Every statement of a syntax tree at any depth (definitions, imports, nested in
    classes, functions, branches and handlers alike): the statements ``ast.walk`` finds,
    without visiting the expressions, ten times as fast (the static checks of
    tests/test_docs.py and tests/test_test_helpers.py read the whole suite)."""
    stack = [tree]
    while stack:
        node = stack.pop()
        for field in ("body", "orelse", "finalbody", "handlers", "cases"):
            for child in getattr(node, field, None) or ():
                if isinstance(child, ast.stmt):
                    yield child
                stack.append(child)


# -- other Pythons (the .pyz's tests) ---------------------------------------------------------


@functools.lru_cache
def pyenv_root() -> Path:
    """$PYENV_ROOT, else what `pyenv root` prints, else ~/.pyenv."""
    if os.environ.get("PYENV_ROOT"):
        return Path(os.environ["PYENV_ROOT"])
    try:
        out = subprocess.run(["pyenv", "root"], capture_output=True, text=True, timeout=30,
                             stdin=subprocess.DEVNULL)
        if out.returncode == 0 and out.stdout.strip():
            return Path(out.stdout.strip())
    except (OSError, subprocess.SubprocessError):
        pass
    return Path.home() / ".pyenv"


def find_python(version: str) -> Optional[Path]:
    """The newest pyenv interpreter `version`.N (e.g. "3.9" → .../3.9.18/bin/python3), or None.

    Only plain releases count: "3.13.0t" (free-threaded) or "3.13-dev" are not 3.13.N.
    """
    found = []
    for folder in (pyenv_root() / "versions").glob(version + ".*"):
        match = re.fullmatch(re.escape(version) + r"\.(\d+)", folder.name)
        exe = folder / "bin" / "python3"
        if not exe.exists():
            exe = folder / "bin" / "python"  # Python 2 has no python3
        if match and exe.exists():
            found.append((int(match.group(1)), exe))
    return max(found)[1] if found else None


def require_python(version: str, required: bool = True) -> Path:
    """find_python(version), or skip the test; a failure instead when CI demands pyenv."""
    exe = find_python(version)
    if exe is not None:
        return exe
    message = f"no Python {version} under {pyenv_root()}/versions"
    if required and os.environ.get("HEALTHLOG_REQUIRE_PYENV") == "1":
        pytest.fail(message + " (HEALTHLOG_REQUIRE_PYENV=1)")
    pytest.skip(message)



# -- a small delivery, and a request written by hand ------------------------------------------


def hae_body(canary_value: float = 72.123456789) -> bytes:
    """A small HAE-shaped metrics delivery, pretty-printed the iOS way.

    It carries a canary point value and a canary device name, which the autouse
    leak check looks for in every log record.
    """
    return (
        '{\n  "data" : {\n    "metrics" : [\n      {\n        "units" : "count/min",\n'
        '        "data" : [\n          {\n            "Max" : 116,\n'
        '            "date" : "2026-05-19 00:00:00 -0700",\n'
        '            "source" : "Zebulon\u2019s Apple Watch|iPhone",\n'
        '            "Avg" : %r,\n            "Min" : 52\n          }\n        ],\n'
        '        "name" : "heart_rate"\n      }\n    ],\n    "workouts" : [ ]\n  }\n}'
        % canary_value
    ).encode("utf-8")

HAE_HEADERS = {
    "automation-name": "Health tracker",
    "automation-id": "788509F9-3AFA-42CE-850C-E4D2DDB02F12",
    "automation-aggregation": "Days",
    "automation-period": "Previous 7 Days",
    "session-id": "0C6B1C53-2D4A-4F7E-9B7B-6A1B2C3D4E5F",
}


def raw_post(port: int, body: bytes, headers: dict = None, path: str = "/api/ingest") -> bytes:
    lines = ["POST %s HTTP/1.1" % path, "Host: 127.0.0.1",
             "Authorization: Bearer " + TOKEN, "Content-Type: application/json",
             "Content-Length: %d" % len(body)]
    lines += ["%s: %s" % item for item in (headers or {}).items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


def read_response(sock: socket.socket) -> tuple:
    """Read one HTTP response from a raw socket: (status, json body)."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            break
        data += chunk
    head, _, rest = data.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    length = 0
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value)
    while len(rest) < length:
        chunk = sock.recv(65536)
        if not chunk:
            break
        rest += chunk
    return status, json.loads(rest[:length]) if length else None
