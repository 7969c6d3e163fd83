"""Helpers of the fold tests (test_fold.py, test_real_exports.py, test_fold_properties.py,
test_fold_stream.py, test_fold_faults.py, test_late_disk.py): the two ways they get
deliveries into a real journal, and the fold faults' small deliveries and quick server.

* `Journal`: really posting them to a running Cheroot server on 127.0.0.1:0 (usually a
  paused one, whose fold thread waits for ``worker.gate``), then reading or editing the
  journal it keeps.
* `DirectStore`: journaling them through the ingest path (``accept_delivery``: archive +
  journal) into a fresh data directory, without HTTP, and folding them with the worker's
  own ``FoldEngine``; one per hypothesis example.
"""

import datetime as dt
import gzip
import io
import json
import os
import signal
import sqlite3
import threading
from pathlib import Path

import hae_factory as hf
import healthlog
from conftest import Client, GatedWorker, db_rows, log_records, run_cli, wait_for

#: The headers `Journal.post` sends unless told otherwise: a Minutes automation.
AUTOMATION = {
    "automation-name": "Fold test",
    "automation-id": "6F0D1D5E-0C1A-4E2B-9A3C-00000000F01D",
    "automation-aggregation": "Minutes",
    "automation-period": "Since Last Sync",
}


class Journal:
    """Posts real deliveries to a running service and reads or edits its journal."""

    def __init__(self, service: healthlog.Service):
        self.service = service
        self.config = service.config
        self.data_dir = service.config.data_dir
        self.client = Client(*service.address)

    def post(self, body: bytes, headers: dict = AUTOMATION, path: str = "/api/ingest") -> int:
        status, payload = self.client.ingest(body, headers=dict(headers), path=path)
        assert status == 200, payload
        return payload["delivery_id"]

    def row(self, delivery_id: int) -> dict:
        [row] = db_rows(self.data_dir, "SELECT * FROM delivery WHERE id = ?", (delivery_id,))
        return row

    def statuses(self, *ids) -> list:
        return [self.row(i)["parse_status"] for i in ids]

    def pending(self) -> list:
        return [r["id"] for r in db_rows(self.data_dir, "SELECT id FROM delivery WHERE"
                                         " parse_status = 'pending' ORDER BY id")]

    def settle(self, service: healthlog.Service = None, timeout: float = 20.0) -> None:
        """Wait until nothing is pending and the fold thread's pass has returned: a fold's
        records are written after its commit, and the lag WARN at the end of the pass."""
        worker = (service or self.service).worker
        wait_for(lambda: not self.pending() and worker.state == "idle", timeout=timeout)

    def execute(self, sql: str, args=()) -> None:
        conn = sqlite3.connect(str(self.config.db_path))
        try:
            conn.execute(sql, args)
            conn.commit()
        finally:
            conn.close()

    def received_at(self, delivery_id: int) -> dt.datetime:
        return healthlog.parse_received_at(self.row(delivery_id)["received_at"])

    def set_received_at(self, delivery_id: int, moment: dt.datetime) -> None:
        # received_at is the journal position; journaled_at, when the row entered the
        # journal, is where its wait for the fold starts: a row "received" earlier by
        # these tests also entered the journal then.
        text = healthlog.format_received_at(moment)
        self.execute("UPDATE delivery SET received_at = ?, journaled_at = ? WHERE id = ?",
                     (text, text, delivery_id))

    def archive_path(self, delivery_id: int):
        return self.data_dir / self.row(delivery_id)["archive_path"]

    def fold_order(self, ids) -> list:
        """The given deliveries sorted by when their outcome was written."""
        return sorted(ids, key=lambda i: self.row(i)["folded_at"])

    def objects_touched_by(self, delivery_id: int) -> list:
        """(metric, layer, hour) of every object that was created or changed by the
        delivery, or that holds one of its points."""
        return [(o["metric"], o["layer"], o["hour"]) for o in db_rows(
            self.data_dir, "SELECT metric, layer, hour, delivery_id, updated_by,"
            " point_deliveries FROM object")
            if delivery_id in (o["delivery_id"], o["updated_by"])
            or delivery_id in json.loads(o["point_deliveries"])]


class DirectStore:
    """A fresh data directory with a journal, folded by the real FoldEngine.

    A delivery is received ``seconds`` after ``t0``; ``headers`` are what `journal` sends
    when it is given none.
    """

    def __init__(self, root: Path, t0: dt.datetime, headers: dict = None):
        self.config = healthlog.Config(data_dir=root, log_level="ERROR")
        healthlog.ensure_data_dir(root)
        self.conn = healthlog.open_database(self.config, synchronous="NORMAL")
        self.archive = healthlog.Archive(root)
        self.engine = healthlog.FoldEngine(self.conn, self.config, verbose=False)
        self.t0, self.headers = t0, headers
        self.seconds = 0

    def journal(self, body: bytes, seconds: int = None, headers: dict = None) -> int:
        """Journal ``body``: its delivery id.  Without ``seconds``, it is received one
        second after the one journaled before it without ``seconds``."""
        upload = self.archive.receive(io.BytesIO(body).read, len(body), 1 << 30, lambda: None)
        if seconds is None:
            self.seconds += 1
            seconds = self.seconds
        return healthlog.accept_delivery(self.archive, self.conn, upload,
                                         self.t0 + dt.timedelta(seconds=seconds),
                                         self.headers if headers is None else headers, None)

    def fold(self, delivery_id: int) -> None:
        assert self.engine.fold(delivery_id).kind == "folded"

    def fold_all(self) -> None:
        """Fold everything pending as ``serve`` does: one pass of the worker's own loop."""
        healthlog.FoldWorker(self.config).run_pass(self.engine)

    def journal_and_fold(self, body: bytes, headers: dict = None) -> dict:
        """Journal ``body`` (a second after the one before it) and fold it at once: the
        delivery's journal row."""
        delivery_id = self.journal(body, headers=headers)
        self.fold(delivery_id)
        cursor = self.conn.execute("SELECT * FROM delivery WHERE id = ?", (delivery_id,))
        names = [c[0] for c in cursor.description]
        return dict(zip(names, cursor.fetchone()))

    def objects(self, *extra: str) -> list:
        """Every object as (metric, layer, hour, units, points, hash, blob,
        point_deliveries) followed by the ``extra`` columns (``"*"``: every column), in
        (metric, layer, hour) order."""
        columns = ("metric", "layer", "hour", "units", "points", "hash", "blob",
                   "point_deliveries") + extra
        return self.conn.execute("SELECT %s FROM object ORDER BY 1, 2, 3"
                                 % ", ".join(columns)).fetchall()

    def journal_rows(self) -> list:
        """What the fold wrote of each delivery, in id order."""
        return self.conn.execute(
            "SELECT id, parse_status, layer, error, uncovered_keys, metrics, points,"
            " bad_points, objects_written, overwrites, incomparable, unit_conflicts"
            " FROM delivery ORDER BY id").fetchall()

    def stored(self) -> dict:
        """(start, end) -> stored point, over every object."""
        out = {}
        for (blob,) in self.conn.execute("SELECT blob FROM object"):
            for point in json.loads(gzip.decompress(blob)):
                out[healthlog.point_span(point)] = point
        return out

    def fingerprint(self) -> str:
        return healthlog.fingerprint(self.conn)

    def close(self) -> None:
        self.conn.close()



# -- the fold faults' deliveries and server (test_fold_faults.py, test_late_disk.py) ---------

#: The automation the fold faults' deliveries come from, and its headers.
FAULTS = hf.Automation("Fold faults", "Minutes", "Since Last Sync")
HEADERS = hf.headers_for(FAULTS, session_id="5E0B7C1A-3F2D-4C8B-9A61-7D2E4F6A8B90")
DAY = dt.date(2024, 3, 8)


def small_body(seed: int, day: dt.date = DAY) -> bytes:
    """A real-shaped HAE delivery of two hours of step counts (about 5 KB)."""
    start = dt.datetime.combine(day, dt.time(9))
    return hf.dumps_hae(hf.metrics_payload(seed, ("step_count",), start,
                                           start + dt.timedelta(hours=2)))


def import_bodies(data_dir: Path, folder: Path, bodies: list, first: dt.datetime) -> list:
    """Journal ``bodies`` with ``healthlog import``, one second apart from ``first`` in
    journal order (import takes a file's modification time as its ``received_at``, and
    files it as received that day); returns their delivery ids."""
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for index, body in enumerate(bodies):
        path = folder / ("export-%d.json" % index)
        path.write_bytes(body)
        moment = (first + dt.timedelta(seconds=index)).timestamp()
        os.utime(str(path), (moment, moment))
        paths.append(path)
    result = run_cli("import", "--data", data_dir, "--aggregation", "Minutes", *paths)
    assert result.returncode == 0, result.stdout + result.stderr
    ids = [int(line.rsplit(" ", 1)[1]) for line in result.stdout.splitlines()
           if line.startswith("accepted ")]
    assert len(ids) == len(bodies), result.stdout
    return ids

QUICK_SERVE = """
import sys
sys.path.insert(0, %r)
import healthlog
healthlog.FoldWorker.restart_pauses_s = (0.2,)  # the loop tries again every 0.2 s
sys.exit(healthlog.main(sys.argv[1:]))
"""


class QuickRetryWorker(GatedWorker):
    """The real worker, held until ``gate`` is set, that starts its loop again 0.1 s after
    a fault instead of 1, 5 and 15 s."""

    restart_pauses_s = (0.1,)


def post_small(service: healthlog.Service, count: int) -> list:
    """The ids of ``count`` small deliveries posted, one day apart."""
    client = Client(*service.address)
    ids = []
    for n in range(count):
        status, payload = client.ingest(small_body(n, DAY + dt.timedelta(days=n)),
                                        headers=HEADERS)
        assert status == 200
        ids.append(payload["delivery_id"])
    return ids



# -- bodies ----------------------------------------------------------------------------------------


def body_of(*metrics, **sections) -> bytes:
    """An HAE body written the iOS way (``"key" : value``, 2-space indent)."""
    data = {"metrics": list(metrics)} if metrics else {}
    data.update(sections)
    return hf.dumps_hae({"data": data})


# ---------------------------------------------------------------------------------------------
# A process's memory, watched from outside (FOLD-14.1, RELY-10)


def proc_status(pid: int) -> dict:
    """The Vm* figures of /proc/PID/status, in bytes ({} once the process is gone)."""
    figures = {}
    try:
        with open("/proc/%d/status" % pid) as status:
            for line in status:
                key, _, value = line.partition(":")
                if key.startswith("Vm"):
                    figures[key] = int(value.split()[0]) * 1024
    except OSError:  # ended, or a zombie without figures
        return {}
    return figures


class OomWatchdog(threading.Thread):
    """The OOM killer of one process: SIGKILL once its resident memory exceeds ``cap``,
    read every ``poll_s`` seconds."""

    def __init__(self, pid: int, cap: int, poll_s: float = 0.002):
        super().__init__(name="test-oom-watchdog", daemon=True)
        self.pid, self.cap, self.poll_s = pid, cap, poll_s
        self.killed_at = None  # the VmRSS that got the process killed
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.is_set():
            rss = proc_status(self.pid).get("VmRSS")
            if rss is None:
                return
            if rss > self.cap:
                os.kill(self.pid, signal.SIGKILL)
                self.killed_at = rss
                return
            self.done.wait(self.poll_s)

    def finish(self) -> None:
        self.done.set()
        self.join(30)


def port_of(log_path: Path) -> int:
    """The port a serve process logged with ``serving`` (0 before it has)."""
    for record in log_records(log_path.read_text(errors="replace").splitlines()):
        if record.get("msg") == "serving":
            return int(record["listen"].rsplit(":", 1)[1])
    return 0
