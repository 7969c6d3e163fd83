"""Reliability defects found by the torture work, each proven fixed against a real server.

Slow and abusive clients (RELY-5) against a real Cheroot server on 127.0.0.1:0, and the
defects RELY-8.x: a fold loop that restarts, a lock kept while work still runs, a
migration race, a damaged ``.meta.json``, the token banner, permission messages, the
validation ceiling, the status snapshot.  Names carry the reliability spec's scenario IDs
(openspec/specs/reliability/spec.md).
"""

import dataclasses
import io
import json
import os
import resource
import signal
import socket
import sqlite3
import subprocess
import sys
import threading
import time
import tracemalloc
import urllib.parse
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import hae_factory
import healthlog
from conftest import (HAE_HEADERS, TOKEN, Client, archive_files, db_rows, hae_body, raw_post,
                      read_response, wait_for)

pytestmark = pytest.mark.json_agnostic


def _big_body() -> bytes:
    """A real-shaped minute delivery of about 1 MB."""
    payload = hae_factory.metrics_payload(seed=5, names=("heart_rate", "step_count",
                                                         "active_energy"))
    return json.dumps(payload, indent=2).encode()


def _healthz(port: int) -> tuple:
    """(status, payload) of GET /healthz; the client gives up after 30 s of silence."""
    return Client("127.0.0.1", port).request("GET", "/healthz", token=False)


HANG_DEADLINE_S = 30.0
"""How long a RELY-5 test waits for the server to act (answer, disconnect, close) before
it calls the server hung: a deadline that only catches a hang, not a speed figure.  The
server acts within about 2 s in these tests (their deadlines are 2 s or less); the
deadlines that must NOT apply are set to 120 s or more, so a server that waited for them
is, as far as the test is concerned, hung."""


def _head_gate(service: healthlog.Service) -> healthlog.HeadGate:
    return service.server.head_gate


class Dribbler:
    """Open connections that send the start of a request, then one byte at a time."""

    def __init__(self, port: int, count: int, start: bytes, every_s: float):
        self.socks = []
        for _ in range(count):
            sock = socket.create_connection(("127.0.0.1", port))
            sock.sendall(start)
            self.socks.append(sock)
        self._stop = threading.Event()
        self._every_s = every_s
        self._thread = threading.Thread(target=self._run, name="test-dribbler")
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self._every_s):
            for sock in self.socks:
                try:
                    sock.send(b"X")
                except OSError:
                    pass

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        for sock in self.socks:
            sock.close()


# -- RELY-5: slow and abusive clients ----------------------------------------------


def test_rely_5_1_two_hundred_slow_header_clients_do_not_stop_a_delivery(start_service,
                                                                          data_dir, monkeypatch):
    """WHEN 200 connections send `POST /api/ingest HTTP/1.1` and then dribble header bytes,
    THEN a normal delivery is answered 200 within 2 s and /healthz stays responsive.

    (Tested by order, not by time: the delivery and /healthz are answered while all 200
    still dribble and wait in the head gate.  The server timeout and the head deadline
    are 120 s, so a server held up by the slow clients could answer only after they had
    been let go; and a server that never answered would meet the client's own 30 s
    silence timeout, the hang deadline.)"""
    monkeypatch.setattr(healthlog, "HEAD_DEADLINE_S", 120.0)
    service = start_service(http_timeout_s=120.0)
    port = service.address[1]
    body = _big_body()
    slow = Dribbler(port, 200, b"POST /api/ingest HTTP/1.1\r\nHost: x\r\nX-Slow: ", 0.5)
    try:
        wait_for(lambda: _head_gate(service).waiting >= 200,
                 what="all 200 slow connections wait in the head gate")
        status, payload = Client("127.0.0.1", port).ingest(body)
        health = _healthz(port)
        assert _head_gate(service).waiting >= 200, (
            "a slow client was let go before the delivery was answered: it waited for them")
    finally:
        slow.close()
    assert status == 200, payload
    assert health[0] == 200
    row = db_rows(data_dir)[0]
    assert (data_dir / row["archive_path"]).read_bytes() == body


def test_rely_5_2_request_headers_have_a_total_deadline(start_service, monkeypatch):
    """WHEN a client keeps sending header bytes more often than the inactivity timeout but
    never ends its headers, THEN it gets 408 and is disconnected at the head deadline.

    The deadline here is the 2 s server timeout (the head deadline is the smaller of the
    two; HEAD_DEADLINE_S is set to 300 s): the client dribbles until it is disconnected,
    for at most HANG_DEADLINE_S (15 times that deadline), which only catches a hang."""
    monkeypatch.setattr(healthlog, "HEAD_DEADLINE_S", 300.0)
    service = start_service(http_timeout_s=2.0)
    with socket.create_connection(("127.0.0.1", service.address[1])) as sock:
        sock.sendall(b"GET /healthz HTTP/1.1\r\nX-Slow: ")
        deadline = time.monotonic() + HANG_DEADLINE_S
        sock.settimeout(0.3)  # the dribble: a byte about every 0.3 s
        received = b""
        while time.monotonic() < deadline:
            try:
                sock.send(b"X")
                chunk = sock.recv(4096)
            except socket.timeout:
                continue
            except OSError:
                break
            if not chunk:
                break
            received += chunk
        else:
            raise AssertionError("a dribbling client was not disconnected within the %.0f s"
                                 " hang deadline" % HANG_DEADLINE_S)
    assert received.startswith(b"HTTP/1.1 408 "), received[:60]


def test_rely_5_3_slow_bodies_leave_threads_for_reading_and_get_503_past_the_slots(
        start_service, data_dir):
    """WHEN every upload slot is held by a slow body, THEN a further upload is answered 503
    with Retry-After at once, /healthz and the read routes still answer, and the slow
    uploads leave nothing behind once their clients go away."""
    service = start_service(http_threads=6, http_timeout_s=10.0)
    port = service.address[1]
    slots = service.config.http_threads - healthlog.HTTP_RESERVED_THREADS
    head = raw_post(port, b"x" * 10_000)[:-10_000] + b"{"
    slow = Dribbler(port, slots, head, 0.3)
    try:
        wait_for(lambda: len(list((data_dir / "tmp").glob("upload-*"))) == slots,
                 what="every upload slot holds a slow body")
        # "At once": the slow bodies hold their slots as long as this request is open,
        # so an upload that waited for a slot would never be answered (the client gives
        # up after 30 s of silence): no time is taken.
        status, payload = Client("127.0.0.1", port).ingest(hae_body())
        health = _healthz(port)
        catalog = Client("127.0.0.1", port).request("GET", "/api/catalog")
    finally:
        slow.close()
    assert status == 503 and payload["error"]["code"] == "busy", payload
    assert health[0] == 200 and catalog[0] == 200
    wait_for(lambda: not list((data_dir / "tmp").iterdir()), timeout=30,
             what="the slow uploads leave DATA/tmp once their clients have gone")
    assert Client("127.0.0.1", port).ingest(hae_body())[0] == 200
    assert len(db_rows(data_dir)) == 1


def test_rely_5_3_busy_answer_carries_retry_after(start_service):
    """WHEN the upload slots are taken, THEN the 503 names when to come back."""
    service = start_service(http_threads=5)
    assert service.app.upload_slots.acquire(blocking=False)  # the only slot (5 - 4)
    try:
        with socket.create_connection(("127.0.0.1", service.address[1])) as sock:
            sock.sendall(raw_post(service.address[1], hae_body()))
            head = sock.recv(65536).split(b"\r\n\r\n")[0].decode().lower()
    finally:
        service.app.upload_slots.release()
    assert head.startswith("http/1.1 503")
    assert "retry-after: %d" % healthlog.RETRY_AFTER_S in head


def test_rely_5_4_a_body_shorter_than_its_content_length_times_out_alone(start_service,
                                                                          data_dir):
    """WHEN a client announces a longer body than it sends and stops, THEN it gets 408 once
    the pause outlasts the ingest stall limit, other clients are served meanwhile, and
    nothing is kept."""
    service = start_service(ingest_stall_s=1.5)
    port = service.address[1]
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(raw_post(port, hae_body())[:-30])
        assert Client("127.0.0.1", port).ingest(hae_body())[0] == 200
        sock.settimeout(30)  # a ceiling 20 times the 1.5 s stall limit
        status, payload = read_response(sock)
    assert status == 408 and payload["error"]["code"] == "request_timeout"
    assert len(db_rows(data_dir)) == 1
    wait_for(lambda: not list((data_dir / "tmp").iterdir()))


def test_rely_5_5_idle_connections_hold_no_thread(start_service, monkeypatch):
    """WHEN 300 clients connect and say nothing, THEN requests are still served, no thread
    is started for them, and they are closed at the head deadline.

    The head deadline is the 2 s server timeout (HEAD_DEADLINE_S is set to 300 s); the
    clients wait for the close HANG_DEADLINE_S in all, which only catches a hang."""
    monkeypatch.setattr(healthlog, "HEAD_DEADLINE_S", 300.0)
    service = start_service(http_timeout_s=2.0)
    port = service.address[1]
    before = threading.active_count()
    idle = [socket.create_connection(("127.0.0.1", port)) for _ in range(300)]
    try:
        health = _healthz(port)
        during = threading.active_count()
        deadline = time.monotonic() + HANG_DEADLINE_S
        closed = 0
        for sock in idle:
            sock.settimeout(max(0.001, deadline - time.monotonic()))
            try:
                closed += sock.recv(1) == b""
            except socket.timeout:
                pass  # still open at the ceiling
            except OSError:
                closed += 1
    finally:
        for sock in idle:
            sock.close()
    assert health[0] == 200
    assert during <= before
    assert closed == len(idle)


def _minute_points(day: str, count: int) -> list:
    return [{"date": "%s %02d:%02d:00 +0000" % (day, m // 60 % 24, m % 60), "qty": m % 97,
             "source": "Watch"} for m in range(count)]


def _wal_bytes(data_dir: Path) -> int:
    path = data_dir / (healthlog.DB_NAME + "-wal")
    return path.stat().st_size if path.exists() else 0


def test_rely_5_6_a_slow_reader_holds_no_snapshot_for_long(start_service, data_dir, logs,
                                                           monkeypatch):
    """WHEN a client reads a long CSV reply at 10 KB/s while deliveries are folded
    THEN past the snapshot's hold the rest of the reply is read from a file and the
    snapshot ends: the WAL can be checkpointed and truncated to nothing while the client
    is still reading, and the reply is whole and equal to a fast read of it."""
    monkeypatch.setattr(healthlog, "SNAPSHOT_HOLD_S", 0.0)  # spooled after the first piece
    service = start_service()
    minutes = {"automation-aggregation": "Minutes"}
    client = Client(*service.address)
    days = ["2024-03-%02d" % d for d in range(1, 5)]
    for day in days:
        body = hae_factory.dumps_hae(hae_factory.envelope(metrics=[hae_factory.metric(
            "step_count", _minute_points(day, 1440), "count")]), pretty=False)
        assert client.ingest(body, headers=minutes)[0] == 200
    wait_for(lambda: {r["parse_status"] for r in db_rows(data_dir)} == {"parsed"},
             what="the store is folded")
    query = "/api/points?metric=step_count&format=csv"
    fast = client.request("GET", query)[1]
    assert fast.count(b"\r\n") == 1 + 4 * 1440  # about 300 KB

    slow = socket.create_connection(service.address)
    slow.sendall(("GET %s HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer %s\r\n"
                  "Connection: close\r\n\r\n" % (query, TOKEN)).encode())
    received = bytearray()

    def read_slowly(until: int) -> None:  # 10 KB/s: this pace is what is tested
        while len(received) < until:
            chunk = slow.recv(1024)
            assert chunk, "the reply ended early"
            received.extend(chunk)
            time.sleep(0.1)

    try:
        read_slowly(10 << 10)
        wait_for(lambda: logs.find("a slow reader reads the rest of its reply from a file"),
                 what="the reply is spooled and its snapshot ends")
        for n, day in enumerate(("2024-04-01", "2024-04-02", "2024-04-03")):
            body = hae_factory.dumps_hae(hae_factory.envelope(metrics=[hae_factory.metric(
                "heart_rate", [dict(p, Avg=p.pop("qty")) for p in _minute_points(day, 1440)],
                "count/min")]), pretty=False)
            assert client.ingest(body, headers=minutes)[0] == 200
            wait_for(lambda: len({r["parse_status"] for r in db_rows(data_dir)
                                  if r["parse_status"] == "pending"}) == 0,
                     what="delivery %d is folded" % n)
            read_slowly(len(received) + (2 << 10))
        assert _wal_bytes(data_dir) > 0
        conn = sqlite3.connect(str(data_dir / healthlog.DB_NAME))
        try:
            busy, _, _ = conn.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()
        finally:
            conn.close()
        assert busy == 0, "a reader still holds an old snapshot"
        assert _wal_bytes(data_dir) == 0
        assert len(received) < len(fast)  # the client is still reading
        slow.settimeout(60)
        while True:
            chunk = slow.recv(1 << 16)
            if not chunk:
                break
            received.extend(chunk)
    finally:
        slow.close()
    head, _, chunked = bytes(received).partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200")
    body, rest = b"", chunked
    while True:  # Transfer-Encoding: chunked
        size_line, _, rest = rest.partition(b"\r\n")
        size = int(size_line, 16)
        if size == 0:
            break
        body, rest = body + rest[:size], rest[size + 2:]
    assert body == fast


# -- RELY-10: memory that fits the machine --------------------------------------------------


def _cgroups(root: Path, cgroup: str, limits: dict) -> None:
    """A /proc/self/cgroup and a /sys/fs/cgroup tree under ``root``, as the kernel shows
    them: ``limits`` maps a file under sys/fs/cgroup to its text."""
    (root / "proc/self").mkdir(parents=True)
    (root / "proc/self/cgroup").write_text(cgroup)
    for name, text in limits.items():
        path = root / "sys/fs/cgroup" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text + "\n")


MIB = 1 << 20
PHYSICAL = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.parametrize("cgroup,limits,expected", [
    ("0::/system.slice/healthlog.service\n",  # cgroup v2 under systemd: MemoryMax=400M
     {"system.slice/healthlog.service/memory.max": str(400 * MIB),
      "system.slice/memory.max": "max"}, 400 * MIB),
    ("0::/user.slice/app\n",  # a parent's limit is the smaller one
     {"user.slice/app/memory.max": "max", "user.slice/memory.max": str(300 * MIB)}, 300 * MIB),
    ("4:memory:/docker/abc\n0::/\n",  # cgroup v1 in a container: its own cgroup is the root
     {"memory/memory.limit_in_bytes": str(512 * MIB)}, 512 * MIB),
    ("4:memory:/\n", {"memory/memory.limit_in_bytes": "9223372036854771712"}, PHYSICAL),
    ("0::/\n", {}, PHYSICAL),
], ids=["v2-service", "v2-parent", "v1-container", "v1-unlimited", "none"])
def test_rely_10_1_the_memory_limit_is_the_smallest_of_the_control_groups(
        cgroup, limits, expected, tmp_path, monkeypatch):
    _cgroups(tmp_path, cgroup, limits)
    monkeypatch.setattr(healthlog, "CGROUP_ROOT", tmp_path)
    limit, what = healthlog.memory_limit()
    assert limit == min(expected, PHYSICAL)
    assert ("control group" in what) == (expected < PHYSICAL)


def test_rely_10_1_serve_warns_when_the_largest_body_may_not_fit(start_service, tmp_path,
                                                                 monkeypatch, logs):
    """WHEN serve starts under a 425 MiB limit with the default 256 MiB body limit, THEN one
    WARN gives what it may need (its 88 MiB, the fold of a 256 MiB body at 3 times it and
    the check of another beside it at 2.1 times), the limit and the largest --max-body-mib
    that fits (66; contrib/healthlog.service pairs 425M with 64, which needs 414 MiB);
    with that limit no WARN is written."""
    _cgroups(tmp_path / "root", "0::/system.slice/healthlog.service\n",
             {"system.slice/healthlog.service/memory.max": str(425 * MIB)})
    monkeypatch.setattr(healthlog, "CGROUP_ROOT", tmp_path / "root")
    service = start_service(max_body_bytes=256 * MIB)
    [warn] = logs.find("the largest body allowed may need more memory", level="WARN")
    assert (warn["max_body_mib"], warn["limit_mib"]) == ("256", "425")
    assert int(warn["needed_mib"]) == healthlog.memory_needed_mib(256 * MIB) == int(
        64 + 24 + 3 * 256 + 2.1 * 256) == 1393
    safe = int(warn["safe_max_body_mib"])
    assert healthlog.memory_needed_mib(safe * MIB) <= 425 < healthlog.memory_needed_mib(
        (safe + 1) * MIB)
    assert safe == 66 and healthlog.memory_needed_mib(64 * MIB) == int(88 + 5.1 * 64) == 414
    assert service.stop()
    start_service(max_body_bytes=safe * MIB, data_dir=tmp_path / "other")
    assert len(logs.find("the largest body allowed may need more memory")) == 1


CHECK_RSS = r"""
import sys, threading
from pathlib import Path
sys.path.insert(0, sys.argv[1])
import healthlog

def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1]) * 1024

path, verdict = Path(sys.argv[2]), []

def check():  # in a thread, as an HTTP worker of serve runs it
    try:
        healthlog.check_delivery_shape(path)
        verdict.append("accepted")
    except healthlog.BadRequest as exc:
        verdict.append(exc.message)

open("/proc/self/clear_refs", "w").write("5")  # VmHWM starts again from VmRSS
before = status("VmRSS")
worker = threading.Thread(target=check)
worker.start()
worker.join()
print(status("VmHWM") - before, verdict[0])
"""
CHECK_MIB = 5
"""Over QUICK_CHECK_BYTES: the full check, the one whose memory scales with the body."""
CHECK_FIXED_MIB = 6
"""What a check holds whatever its body: its chunks, read, decoded and translated."""


def _wide_bodies(folder: Path) -> dict:
    """name -> (path, accepted?) of bodies of about CHECK_MIB MiB whose strings carry wide
    characters: the bench's emoji, CJK and iOS device-name shapes, strings of emoji alone,
    and that last body with one byte that is no UTF-8 at its end."""
    import bench_memory

    made = {}
    for shape in ("emoji-sources", "non-ascii", "many-metrics-ios-names"):
        path = folder / (shape + ".json")
        bench_memory.write_body(shape, path, CHECK_MIB * MIB, seed=33)
        made[shape] = path, True
    point = '{"date":"2024-03-08 10:%02d:00 -0800","qty":1,"source":"%s"}'
    emoji = "🏃‍♀️⌚️💓📱’" * 40
    points = ",".join(point % (minute % 60, emoji) for minute in range(
        CHECK_MIB * MIB // len((point % (0, emoji)).encode("utf-8"))))
    text = '{"data":{"metrics":[{"name":"%s","units":"count","data":[%s]}]}}' % (emoji, points)
    path = folder / "emoji-alone.json"
    path.write_text(text, encoding="utf-8")
    made["emoji-alone"] = path, True
    path = folder / "emoji-alone-not-utf-8.json"
    path.write_bytes(text.encode("utf-8") + b"\xff")
    made["emoji-alone-not-utf-8"] = path, False
    return made


def test_rely_10_4_the_ingest_check_holds_twice_its_body_whatever_the_characters(tmp_path):
    """WHEN bodies whose strings carry emoji, ``’``, CJK or nothing but emoji (and one that
    turns out not to be UTF-8 at its last byte) are checked as ingest checks them, each in
    a fresh process, THEN the check's peak memory stays within VALIDATION_MEMORY_FACTOR
    times the body plus a few MiB of chunks (decoded whole, an emoji made every character
    4 bytes wide: 4.8 times the body), and each is accepted, or refused as not UTF-8."""
    if not os.access("/proc/self/clear_refs", os.W_OK):
        pytest.skip("needs Linux's /proc/self/clear_refs to reset the peak")
    for name, (path, accepted) in sorted(_wide_bodies(tmp_path).items()):
        size = path.stat().st_size
        result = subprocess.run(
            [sys.executable, "-c", CHECK_RSS, str(Path(healthlog.__file__).parent), str(path)],
            capture_output=True, text=True, timeout=120)
        assert result.returncode == 0, result.stderr
        added, verdict = result.stdout.split(" ", 1)
        allowance = healthlog.VALIDATION_MEMORY_FACTOR * size + CHECK_FIXED_MIB * MIB
        assert int(added) <= allowance, (name, int(added) / size)
        assert (verdict.strip() == "accepted") is accepted, (name, verdict)
        assert accepted or "not UTF-8" in verdict


# -- RELY-8.1/8.2: the fold thread ------------------------------------------------


class FlakyWorker(healthlog.FoldWorker):
    """The real worker; its first ``failures`` passes raise (as a broken disk would)."""

    # /healthz answers 503 only during these pauses: long enough that a busy machine's
    # poll still lands in one (two of 0.5 s were once all the window there was)
    restart_pauses_s = (2.0,)

    def __init__(self, config, failures: int, error: type = RuntimeError):
        super().__init__(config)
        self.failures, self.error = failures, error
        self.allowed = threading.Event()

    def run_pass(self, engine):
        if self.failures:
            self.allowed.wait(10)
            self.failures -= 1
            raise self.error("injected fold failure")
        return super().run_pass(engine)


def _service_with(make_config, worker_factory, **overrides) -> healthlog.Service:
    service = healthlog.Service(make_config(**overrides), announce=lambda token: None)
    service.worker = worker_factory(service.config)
    service.start()
    return service


def test_rely_8_1_fold_loop_restarts_and_healthz_says_failing_meanwhile(make_config, data_dir,
                                                                       logs):
    """WHEN an exception escapes a fold pass, THEN the loop starts again after a pause,
    /healthz answers 503 "failing" until it runs, and the delivery is folded after."""
    service = _service_with(make_config, lambda config: FlakyWorker(config, failures=2))
    try:
        port = service.address[1]
        assert Client("127.0.0.1", port).ingest(hae_body(), headers=HAE_HEADERS)[0] == 200
        service.worker.allowed.set()
        status, payload = wait_for(lambda: (lambda h: h[0] == 503 and h)(_healthz(port)))
        assert payload["status"] == "failing" and payload["worker"] == "restarting"
        wait_for(lambda: db_rows(data_dir)[0]["parse_status"] == "parsed")
        wait_for(lambda: _healthz(port)[0] == 200)
    finally:
        assert service.stop()
    failed = logs.find("fold pass failed", "ERROR")
    assert len(failed) == 2 and failed[0]["error"] == "RuntimeError"


class _Fatal(BaseException):
    """Stands for what no ``except Exception`` catches."""


def test_rely_8_2_a_fold_thread_that_ends_makes_serve_exit_non_zero(make_config, logs):
    """WHEN the fold thread ends without a stop request, THEN /healthz answers 503 and the
    service reports itself broken (`serve` then exits 1, for systemd to restart it)."""
    service = _service_with(make_config, lambda config: FlakyWorker(config, 1, _Fatal))
    try:
        service.worker.allowed.set()
        wait_for(lambda: service.broken)
        status, payload = _healthz(service.address[1])
        assert status == 503 and payload["status"] == "failing"
    finally:
        assert service.stop()
    assert logs.find("fold thread ended unexpectedly", "ERROR")


def test_rely_8_2_healthz_is_ok_while_stopping(start_service):
    """WHEN the service is stopping, THEN a stopped fold thread is no failure."""
    service = start_service()
    service.stopping.set()
    service.worker.stop(5)
    status, payload = _healthz(service.address[1])
    assert status == 200 and payload["status"] == "stopping"


def test_rely_8_2_storage_failure_in_a_fold_leaves_the_delivery_pending():
    """WHEN SQLite cannot write for a reason of the machine (disk full, read-only, I/O),
    THEN the fold is deferred, not recorded as a failed delivery."""
    full = sqlite3.OperationalError("database or disk is full")
    readonly = sqlite3.OperationalError("attempt to write a readonly database")
    assert healthlog.classify(full).deferred and healthlog.classify(readonly).deferred
    assert healthlog.classify(sqlite3.IntegrityError("UNIQUE constraint")).kind == "failed"


# -- RELY-8.3: the validation ceiling ----------------------------------------------


def test_rely_8_3_bytes_under_validation_have_a_ceiling(start_service, data_dir, monkeypatch):
    """WHEN the validation ceiling is held longer than an upload may wait, THEN the upload
    is answered 503 with Retry-After and leaves nothing behind; once free, it is accepted."""
    monkeypatch.setattr(healthlog, "VALIDATION_WAIT_S", 0.5)
    service = start_service()
    client = Client("127.0.0.1", service.address[1])
    with service.app.validation.hold(healthlog.VALIDATION_CEILING_BYTES, 1):
        status, payload = client.ingest(hae_body())
    assert status == 503 and payload["error"]["code"] == "busy"
    assert db_rows(data_dir) == [] and archive_files(data_dir) == []
    assert not list((data_dir / "tmp").iterdir())
    assert client.ingest(hae_body())[0] == 200


def test_rely_8_3_a_smaller_body_limit_lowers_the_ceiling_and_the_quick_check(
        start_service, tmp_path, monkeypatch, logs):
    """WHEN --max-body-mib is 1 (below the 64 MiB ceiling), THEN 1 MiB under validation
    is the ceiling (a small upload beside it waits, then gets 503), and orjson's quick
    check, which may hold 32 times its body, takes a body of 40 KB but not one of 100 KB
    (it takes both under the default limit): no check holds more than the full check of a
    1 MiB body may, 2.1 MiB."""
    monkeypatch.setattr(healthlog, "VALIDATION_WAIT_S", 0.5)
    for limit, status in ((1 << 20, 503), (None, 200)):
        service = start_service(data_dir=tmp_path / ("ceiling-%s" % limit),
                                **({"max_body_bytes": limit} if limit else {}))
        with service.app.validation.hold(1 << 20, 1):
            assert Client("127.0.0.1", service.address[1]).ingest(hae_body())[0] == status
    if healthlog._orjson is None:
        return  # without orjson every body takes the full check
    bodies = [hae_factory.big_metrics_body(40_000, seed=3),
              hae_factory.big_metrics_body(100_000, seed=4)]
    assert len(bodies[0]) < 64 << 10 < len(bodies[1]) < 1 << 20
    for limit, expected in ((1 << 20, ["at ingest", None]), (None, ["at ingest"] * 2)):
        service = start_service(data_dir=tmp_path / ("quick-%s" % limit),
                                **({"max_body_bytes": limit} if limit else {}))
        before = len(logs.find("delivery folded"))
        client = Client("127.0.0.1", service.address[1])
        ids = [client.ingest(body)[1]["delivery_id"] for body in bodies]
        wait_for(lambda before=before: len(logs.find("delivery folded")) == before + 2,
                 timeout=60, what="the bodies folded")
        parsed = {int(r["delivery_id"]): r.get("parsed")
                  for r in logs.find("delivery folded")[before:]}
        assert [parsed[i] for i in ids] == expected


def test_rely_8_3_byte_budget_admits_in_order_and_lets_a_large_body_in_alone():
    """WHEN holders would pass the ceiling together, THEN the later one waits its turn; a
    holder larger than the ceiling is admitted once nothing else is held."""
    budget = healthlog.ByteBudget(100)
    order = []

    release = {"big": threading.Event(), "small": threading.Event()}

    def hold(name: str, size: int) -> None:
        with budget.hold(size, 60):
            order.append((name, budget.held))
            release[name].wait(60)  # held until the test lets go

    def in_line() -> int:
        with budget._changed:
            return len(budget._line)

    with budget.hold(60, 1):
        late = threading.Thread(target=hold, args=("big", 500))
        late.start()
        wait_for(lambda: in_line() == 1, what="the big holder waits in line")
        small = threading.Thread(target=hold, args=("small", 10))
        small.start()  # fits, but queues behind the big one: first come, first served
        wait_for(lambda: in_line() == 2, what="the small holder waits behind it")
        assert order == []
    wait_for(lambda: order, what="the big holder is admitted")
    assert order == [("big", 500)] and in_line() == 1  # the small one still waits
    release["big"].set()
    late.join(60)
    wait_for(lambda: len(order) == 2, what="the small holder is admitted")
    release["small"].set()
    small.join(60)
    assert order == [("big", 500), ("small", 10)]
    assert budget.held == 0
    with budget.hold(90, 1):
        with pytest.raises(healthlog.ServiceBusy):
            with budget.hold(20, 0.2):
                pass
    assert budget.held == 0


def test_rely_8_3_a_surrogate_escape_does_not_multiply_validation_memory(tmp_path,
                                                                         monkeypatch):
    """WHEN a large body holds one paired surrogate escape, THEN validating it takes about
    the memory of a body without one (no full parse of the document).  The full check's
    memory: orjson's quick check of small bodies is counted apart (INGEST-4.5)."""
    monkeypatch.setattr(healthlog, "QUICK_CHECK_BYTES", 0)
    payload = hae_factory.metrics_payload(seed=2, names=("heart_rate", "step_count"))
    plain = json.dumps(payload, indent=1)
    with_pair = plain.replace('"heart_rate"', '"heart_rate \\ud83d\\ude00"', 1)
    peaks = []
    for text in (plain, with_pair):
        path = tmp_path / "body.json"
        path.write_bytes(text.encode())
        tracemalloc.start()
        healthlog.check_delivery_shape(path)
        peaks.append(tracemalloc.get_traced_memory()[1])
        tracemalloc.stop()
    assert peaks[1] < 1.5 * peaks[0], peaks
    assert peaks[1] < 4 * len(with_pair), peaks


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(["a", "\\\\", "\\ud83d", "\\ude00", "\\uDBFF", "\\u00e9",
                                 "\\n", '\\"']), max_size=8))
def test_rely_8_3_lone_surrogate_scan_agrees_with_a_full_parse(pieces):
    """WHEN a JSON string holds any mix of escapes, THEN the streaming scan finds a lone
    surrogate exactly when no UTF-8 spelling of the parsed text exists."""
    text = '{"data": {"name": "%s"}}' % "".join(pieces)
    try:
        json.dumps(json.loads(text), ensure_ascii=False).encode("utf-8")
        expected = False
    except UnicodeEncodeError:
        expected = True
    assert healthlog._lone_surrogate(text) is expected


# -- RELY-8.4: the lock outlives running work --------------------------------------


def test_rely_8_4_lock_is_kept_while_a_request_outlives_the_stop_budget(make_config, data_dir):
    """WHEN a request is still writing after the stop budget, THEN stop() returns within
    about the budget, the data-directory lock stays held until the request has ended, and
    only then is it released.

    (stop() within about the budget is tested by order, not by time: the request waits
    up to its 60 s busy timeout for the lock the test holds, so a stop() that waited for
    the request would return only once the request had ended; this stop() must return
    while the request is still waiting.)"""
    config = make_config(busy_timeout_s=60.0, stop_budget_s=0.5)
    service = healthlog.Service(config, announce=lambda token: None)
    service.start()
    blocker = sqlite3.connect(str(config.db_path), isolation_level=None)
    answers = []
    try:
        blocker.execute("BEGIN IMMEDIATE")  # the ingest's INSERT waits for this lock
        poster = threading.Thread(target=lambda: answers.append(
            Client(*service.address).ingest(hae_body())))
        poster.start()
        wait_for(lambda: archive_files(data_dir))  # the body is archived; the row waits
        assert service.stop() is False
        assert poster.is_alive(), (
            "the request ended before stop() returned (stop() waited for it, or it ended"
            " early): no test of the lock")
        other = healthlog.DataDirLock(data_dir)
        with pytest.raises(healthlog.DataDirLocked):
            other.acquire("test")
        blocker.execute("ROLLBACK")
        poster.join(60)
        wait_for(lambda: not service.lock.held_by_other() and service.lock._fd is None)
        other.acquire("test")
        other.release()
    finally:
        if blocker.in_transaction:
            blocker.execute("ROLLBACK")
        blocker.close()
    assert answers and answers[0][0] == 200


# -- RELY-8.5: serve and import on a new data directory ---------------------------


def test_rely_8_5_two_processes_creating_one_schema_both_succeed(make_config, data_dir,
                                                                   monkeypatch):
    """WHEN two processes open a new data directory at once and both find it without a
    schema, THEN one creates it and the other uses it (no "table exists")."""
    data_dir.mkdir()
    config = make_config()
    blocker = sqlite3.connect(str(config.db_path), isolation_level=None)
    blocker.execute("PRAGMA journal_mode=WAL")
    blocker.execute("BEGIN IMMEDIATE")  # both openers read version 0, then wait here
    results, creating = [], []
    write_txn = healthlog.write_txn

    def watched_write_txn(conn, *args, **kwargs):  # the real one, its callers counted
        creating.append(threading.current_thread().name)
        return write_txn(conn, *args, **kwargs)

    monkeypatch.setattr(healthlog, "write_txn", watched_write_txn)

    def open_it() -> None:
        try:
            healthlog.open_database(dataclasses.replace(config, busy_timeout_s=10)).close()
            results.append("ok")
        except Exception as exc:  # the assertion below names it
            results.append(repr(exc))

    openers = [threading.Thread(target=open_it) for _ in range(2)]
    for opener in openers:
        opener.start()
    # Both read version 0 and go for the write lock the blocker holds (busy timeout 10 s).
    wait_for(lambda: len(creating) == 2, what="both openers find no schema")
    blocker.execute("ROLLBACK")
    blocker.close()
    for opener in openers:
        opener.join(20)
    assert results == ["ok", "ok"]


# -- RELY-8.6: a damaged .meta.json -------------------------------------------------


def test_rely_8_6_damaged_meta_json_is_adopted_with_a_warning(start_service, data_dir, logs):
    """WHEN `reindex` adopts an archived body whose .meta.json is damaged, THEN it says so
    in a WARN naming the file, and takes the receive time from the file name."""
    service = start_service()
    assert Client(*service.address).ingest(hae_body(), headers=HAE_HEADERS)[0] == 200
    wait_for(lambda: db_rows(data_dir)[0]["parse_status"] == "parsed")
    assert service.stop()
    body = data_dir / db_rows(data_dir)[0]["archive_path"]
    received_at = db_rows(data_dir)[0]["received_at"]
    meta = body.with_name(body.name[:-5] + ".meta.json")
    meta.write_bytes(meta.read_bytes()[:25])  # torn
    conn = sqlite3.connect(str(data_dir / healthlog.DB_NAME))
    conn.execute("DELETE FROM delivery")
    conn.commit()
    conn.close()
    assert healthlog.run_reindex(service.config, out=io.StringIO()) == 0
    warned = logs.find("damaged .meta.json", "WARN")
    assert warned and warned[0]["archive_path"] == db_rows(data_dir)[0]["archive_path"]
    assert db_rows(data_dir)[0]["received_at"] == received_at


# -- RELY-8.7: the token banner -----------------------------------------------------


def _serve_cli(data_dir: Path, listen: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "healthlog", "serve", "--data", str(data_dir),
         "--listen", listen], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env=dict(os.environ, HEALTHLOG_LOG_LEVEL="INFO"))


def test_rely_8_7_token_banner_is_shown_only_by_a_start_that_listens(data_dir):
    """WHEN the first start on a new data directory fails because the port is taken, THEN
    it prints no token; the next start that listens shows the token once."""
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen(1)
    try:
        failed = _serve_cli(data_dir, "127.0.0.1:%d" % taken.getsockname()[1])
        out, err = failed.communicate(timeout=30)
    finally:
        taken.close()
    assert failed.returncode == 2 and "cannot listen" in err
    assert "token" not in out
    started = _serve_cli(data_dir, "127.0.0.1:0")
    banner = []
    try:
        for line in started.stdout:
            banner.append(line)
            if "Bearer" in line:
                break
    finally:
        started.terminate()
        started.communicate(timeout=30)
    token = (data_dir / healthlog.TOKEN_NAME).read_text().strip()
    assert "a new access token" in banner[0]
    assert "Authorization: Bearer " + token in banner[-1]
    assert started.returncode == 0


# -- RELY-8.8: permission messages --------------------------------------------------


def in_child(work) -> str:
    """``work()`` in a forked child (for what must not touch the test process: another
    user, a file size limit); its result, or its exception's text, comes back by a pipe."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        try:
            outcome = str(work())
        except BaseException as exc:
            outcome = "%s: %s" % (type(exc).__name__, exc)
        os.write(write_end, outcome.encode())
        os._exit(0)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as pipe:
        outcome = pipe.read().decode()
    os.waitpid(pid, 0)
    return outcome


def _ensure_as_nobody(path: Path) -> str:
    """ensure_data_dir as an unprivileged user (root ignores permissions, and CI runs as
    root)."""

    def work() -> str:
        if os.geteuid() == 0:
            os.setgid(65534)
            os.setuid(65534)
        healthlog.ensure_data_dir(path)
        return "no error"

    return in_child(work)


def test_rely_8_8_an_existing_unwritable_data_directory_is_named_as_such(tmp_path):
    """WHEN the data directory exists but is not writable, THEN the message says so and
    names the folder it could not create, not "cannot create data directory"."""
    tmp_path.chmod(0o755)
    for parent in list(tmp_path.parents)[:3]:  # pytest's own folders, for the child user
        if parent.stat().st_uid == os.geteuid():
            parent.chmod(parent.stat().st_mode | 0o005)
    data = tmp_path / "data"
    data.mkdir(mode=0o555)
    message = _ensure_as_nobody(data)
    assert "data directory %s is not usable" % data in message, message
    assert "cannot create %s" % (data / "archive") in message
    assert "Permission denied" in message
    assert "cannot create data directory" not in message


# -- RELY-8.9: status in one snapshot ------------------------------------------------


def test_rely_8_9_status_counts_and_fingerprint_come_from_one_snapshot(start_service,
                                                                       data_dir, monkeypatch):
    """WHEN a fold commits while `status` is reading, THEN the counts and the fingerprint
    it prints still describe one state of the store."""
    service = start_service()
    assert Client(*service.address).ingest(hae_body(), headers=HAE_HEADERS)[0] == 200
    wait_for(lambda: db_rows(data_dir)[0]["parse_status"] == "parsed")
    assert service.stop()
    conn = sqlite3.connect(str(data_dir / healthlog.DB_NAME), isolation_level=None)
    before = healthlog.fingerprint(conn)
    original = healthlog.fingerprint

    def fingerprint_after_a_commit(reader, *args, **kw):
        conn.execute("UPDATE object SET hash = 'changed-meanwhile'")  # another writer
        return original(reader, *args, **kw)

    monkeypatch.setattr(healthlog, "fingerprint", fingerprint_after_a_commit)
    status = healthlog.collect_status(dataclasses.replace(service.config))
    conn.close()
    assert status["fingerprint"] == before


# -- RELY-8.10: a lost journal beside a full archive --------------------------------


def test_rely_8_10_an_empty_journal_beside_archived_bodies_is_a_warning(start_service,
                                                                       data_dir, logs):
    """WHEN serve starts on a database with no deliveries while the archive holds bodies
    (the database file was replaced), THEN a WARN says so and names reindex."""
    service = start_service()
    assert Client(*service.address).ingest(hae_body(), headers=HAE_HEADERS)[0] == 200
    assert service.stop()
    for path in data_dir.glob(healthlog.DB_NAME + "*"):
        path.unlink()
    # Replaced by an empty one (with none at all, serve refuses: RELY-11.5).
    healthlog.open_database(service.config).close()
    assert not logs.find("journal is empty")
    start_service()
    warned = logs.find("journal is empty", "WARN")
    assert len(warned) == 1 and warned[0]["archived"] == "1"


# -- found by a second reading of the change ----------------------------------------


@pytest.mark.parametrize("start", [
    # RELY-5.2: a whole request, then the start of a second one on the same connection
    b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\nGET /healthz HTTP/1.1\r\nX-Pad: ",
    # RELY-5.3: a sign-in form announced, then dribbled
    b"POST /login HTTP/1.1\r\nHost: x\r\nContent-Type: application/x-www-form-urlencoded"
    b"\r\nContent-Length: 4000\r\n\r\ntoken=",
], ids=["pipelined-head", "sign-in-body"])
def test_rely_5_2_rely_5_3_what_is_dribbled_waits_in_the_gate_not_in_a_thread(start_service,
                                                                             start):
    """WHEN clients dribble a head pipelined behind a whole request, or a sign-in form's
    body, THEN they wait without a thread: with more of them than threads, /healthz still
    answers."""
    service = start_service(http_threads=5, http_timeout_s=5.0)
    port = service.address[1]
    slow = Dribbler(port, 8, start, 0.5)
    try:
        # More of them than threads, all waiting in the gate: a thread held by one would
        # keep it out of the gate (its 5 s timeout, renewed by each byte, never ends).
        wait_for(lambda: _head_gate(service).waiting == 8,
                 what="all 8 dribblers wait in the head gate")
        health = _healthz(port)
    finally:
        slow.close()
    assert health[0] == 200


def test_rely_5_5_a_full_gate_closes_its_longest_waiter_not_the_newcomer(start_service,
                                                                        monkeypatch):
    """WHEN more connections wait for their heads than the gate holds, THEN the one that
    waited longest is closed, and a client that sends its request at once is served.

    The head deadline and the server timeout are 120 s, so within the 30 s the first
    client waits for its close (a ceiling, not a speed figure) only the full gate closes
    it."""
    monkeypatch.setattr(healthlog, "HEAD_GATE_MAX", 20)
    monkeypatch.setattr(healthlog, "HEAD_DEADLINE_S", 120.0)
    service = start_service(http_timeout_s=120.0)
    port = service.address[1]
    idle = [socket.create_connection(("127.0.0.1", port)) for _ in range(40)]
    try:
        health = _healthz(port)
        idle[0].settimeout(30)
        first_closed = idle[0].recv(1) == b""
    finally:
        for sock in idle:
            sock.close()
    assert health[0] == 200
    assert first_closed


def test_rely_3_4_a_small_write_on_a_full_disk_is_the_servers_fault(tmp_path):
    """WHEN the disk fills while a body smaller than any write buffer is received, THEN the
    failure is a storage failure (a 500), never the client's early end (a 400)."""
    archive_dir = tmp_path / "data"
    (archive_dir / "tmp").mkdir(parents=True)

    def work() -> str:  # a file size limit stands for a full disk
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (1000, 1000))
        body = io.BytesIO(b"x" * 5000)
        healthlog.Archive(archive_dir).receive(body.read, 5000, 1 << 20, lambda: None)
        return "no error"

    outcome = in_child(work).split(":")[0]
    assert outcome == "StorageFailure"
    assert not list((archive_dir / "tmp").iterdir())


def _chunked(port: int, chunks: list, extra: bytes = b"") -> tuple:
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(b"POST /api/ingest HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer %s\r\n"
                     b"Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
                     % TOKEN.encode())
        try:
            for chunk in chunks:
                sock.sendall(b"%x%s\r\n%s\r\n" % (len(chunk), extra, chunk))
            sock.sendall(b"0\r\n\r\n")
        except (BrokenPipeError, ConnectionResetError):
            pass  # refused early: the answer is already on its way
        sock.settimeout(20)
        return read_response(sock)


def test_rely_4_1_chunked_framing_is_the_clients_and_bounded(start_service, data_dir):
    """WHEN a valid body comes in one-byte chunks, THEN it is accepted byte for byte; WHEN a
    chunk line is longer than any size line needs, THEN the answer is 400, never a 500."""
    service = start_service(max_body_bytes=1 << 20)
    port = service.address[1]
    body = hae_body()
    status, payload = _chunked(port, [body[i:i + 1] for i in range(len(body))])
    assert status == 200, payload
    assert (data_dir / db_rows(data_dir)[0]["archive_path"]).read_bytes() == body
    status, payload = _chunked(port, [body], extra=b";" + b"x" * (64 << 10))
    assert status == 400 and payload["error"]["code"] == "bad_request"


def test_rely_7_4_a_non_ascii_token_in_the_path_is_not_logged(start_service, logs):
    """WHEN a token with non-ASCII letters is typed into the URL path, THEN the access log
    shows `<token>` in its place, in any spelling Cheroot gives the path."""
    token = "s\u00e9same-\u00f6ffne-dich-0123456789"
    service = start_service(token=token)
    quoted = urllib.parse.quote(token.encode("utf-8"))
    Client(*service.address).request("GET", "/" + quoted, token=False)
    lines = logs.lines()
    assert any("<token>" in line for line in lines)
    raw = token.encode("utf-8").decode("latin-1")
    assert not [line for line in lines if raw in line or token in line or quoted in line]


def test_rely_8_1_the_first_failure_after_good_passes_pauses_the_shortest(make_config, logs):
    """WHEN a pass fails after passes that succeeded, THEN the loop starts again after the
    first (shortest) pause, not the longest."""

    class LateFailure(healthlog.FoldWorker):
        restart_pauses_s = (0.2, 30.0)
        passes = 0

        def run_pass(self, engine):
            self.passes += 1
            if self.passes == 3:
                raise RuntimeError("injected fold failure")
            return super().run_pass(engine)

    service = _service_with(make_config, LateFailure, fold_wake_s=0.1)
    try:
        failed = wait_for(lambda: logs.find("fold pass failed", "ERROR"))
        # The loop comes back: within 15 s, 75 times the 0.2 s pause it must take and
        # half the 30 s one it must not (which pause it took, the record says below).
        wait_for(lambda: service.worker.passes >= 4, timeout=15, what="a pass after the pause")
    finally:
        assert service.stop()
    assert failed[0]["restart_in_s"] == "0.2"


def test_rely_8_7_a_start_that_fails_after_binding_announces_no_token(make_config, data_dir):
    """WHEN a first start fails after the port is bound (DATA/tmp is not a folder), THEN no
    token is announced, so the next start that works still shows it."""
    (data_dir / "archive").mkdir(parents=True)
    (data_dir / "tmp").write_text("not a folder")
    announced = []
    service = healthlog.Service(make_config(token=None), announce=announced.append)
    with pytest.raises(OSError):
        service.start()
    assert announced == []


def test_rely_5_2_a_pipelined_request_whose_body_comes_later_is_served(start_service):
    """WHEN a second request's head arrives with the first request and its small body only
    later, THEN both are answered, in order, on the one connection."""
    service = start_service()
    with socket.create_connection(("127.0.0.1", service.address[1])) as sock:
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n"
                     b"POST /login HTTP/1.1\r\nHost: x\r\nContent-Type: application/"
                     b"x-www-form-urlencoded\r\nContent-Length: 11\r\n\r\ntoken=")
        sock.settimeout(30)
        # The body comes later: once the first request is answered, so the second
        # one's head has been read with it and its body is still missing.
        first, _ = read_response(sock)
        sock.sendall(b"wrong")
        received = b""
        while b"HTTP/1.1 " not in received or not received.endswith(b"</html>\n"):
            chunk = sock.recv(65536)
            if not chunk:
                break
            received += chunk
    answers = [part.split(b"\r\n", 1)[0] for part in received.split(b"HTTP/1.1 ")[1:]]
    assert (first, answers) == (200, [b"401 Unauthorized"]), received[:300]
