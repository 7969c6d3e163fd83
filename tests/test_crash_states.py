"""RELY-2: the crash states of ingest and fold, explored after ALICE (Pillai et al., OSDI '14,
"All File Systems Are Not Created Equal").

Record. One real ingest (``Archive.receive`` then ``accept_delivery``: the two calls the
ingest route makes, on a real data directory, with the route's extra metadata) or one real
fold pass (``FoldWorker.run_pass`` over a ``FoldEngine``) runs in this process while a thin
recording layer wraps the ``os`` functions healthlog calls (``os.open``, ``os.write`` and the
writes of the file objects ``os.fdopen`` returns, recorded when they reach the kernel,
``os.fsync``, ``os.replace``/``os.rename``, ``os.mkdir``, ``os.unlink``; pathlib's accessor on
Python < 3.11) and the database connections. These are the connections a real ``Service`` of
the data directory writes through, opened by its own code: the ingest route's from
``service.pool.get()``, the fold thread's from ``service.worker.connect()`` (see ``Recording``).
Every call still happens for real; the layer only writes down a logical operation log of what
happened under the data directory: create, mkdir, write(bytes), fsync(file), fsync(dir),
rename, unlink, and ``sqlite_commit``. The recording is checked complete: the whole log,
replayed on the image of the directory taken before, must give the files on disk after.

SQLite. A commit is one atomic operation (SQLite's own crash safety is assumed, not tested).
Its effect is captured physically: right after COMMIT returns, the database file and its
``-wal`` are copied (no writer is active then, so the pair is consistent; the ``-shm`` is left
out and SQLite rebuilds it from the WAL), which is what a crash leaves on disk. The level is
read from the connection (``PRAGMA synchronous``), never assumed. A commit on a
``synchronous=FULL`` connection (ingest) is durable when it returns; one on a
``synchronous=NORMAL`` connection (the fold worker's) is atomic but not durable until the WAL
is next fsynced, so a crash may lose any suffix of the NORMAL commits made since the last FULL
one (the WAL is a checksummed log: recovery keeps a prefix of its frames).

Crash model: the weakest POSIX one (ALICE's weak abstract persistence model, weaker than
ext4 data=ordered). A crash after the first k operations keeps: the data of a file written
before its last fsync; of later writes nothing, a torn prefix (half) or all of it, or as many
zero bytes (a size update that reached the disk before the data, as with ext4
data=writeback). A create, mkdir or unlink persists for sure only once its directory has been
fsynced afterwards, and until then any subset of them may persist, in any order; a rename is
persisted by an fsync of its destination directory and may, until then, also persist without
its source name going away (never the reverse: no file system loses a renamed file). Each crash
state is built as a real directory (the pre-operation image plus the persisted operations,
plus the database files of the surviving commit) and deduplicated by content hash.

Recover as the README tells a user: start a real ``Service`` on it (``serve``: clears
``DATA/tmp``, folds what is pending), stop it, run ``healthlog reindex`` (adopts orphans) and
``healthlog verify``. The invariants checked on every state (a violation is a vulnerability):

* before recovery, the store is exactly the clean fold of a journal-order prefix of the
  deliveries (same object rows as a reference fold of that prefix in a fresh directory), every
  folded delivery is ``parsed`` and no object names a delivery that is not (nothing folded
  half or twice), and ``verify`` agrees;
* ``serve`` starts on it, leaves ``DATA/tmp`` empty and folds every journaled delivery; every
  delivery row, then and after ``reindex``, points to a body byte-identical to the one sent;
* a delivery acknowledged before the crash (the crash point is after its row's commit
  returned, where the 200 is sent) is in the journal exactly once and in the archive;
* after ``reindex``: every archived body is journaled exactly once and byte-identical to a sent
  one, and beside it is its ``.meta.json`` with the body's size, SHA-256, receive time and
  headers, which the row carries too (an orphan adopted without its metadata loses its
  automation headers: that is a vulnerability); no row is ``failed`` (``body_missing`` cannot
  happen when rows are only written after their body is durable); a ``.meta.json`` without a
  body is never journaled; the fingerprint equals a clean fold of the deliveries journaled;
  ``verify`` says equal.

Leftovers that hurt nothing (a ``.meta.json`` whose body never arrived, a torn
``.<stem>.meta.json.<hex>.tmp``) are counted as notes, not vulnerabilities. The report (crash
points, crash states, unique states recovered, vulnerabilities) is printed: run with ``-s``.
"""

import concurrent.futures
import dataclasses
import datetime as dt
import errno
import hashlib
import io
import itertools
import json
import os
import pathlib
import shutil
import sqlite3
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Callable, Optional

import pytest

import hae_factory as hf
import healthlog
from conftest import db_rows, wait_for

pytestmark = pytest.mark.json_agnostic

ROOT_INO = 0
DB_FILES = frozenset(healthlog.DB_NAME + suffix for suffix in ("", "-wal", "-shm", "-journal"))
T0 = dt.datetime(2026, 11, 29, 21, 16, 49, 450228, tzinfo=dt.timezone.utc)
DAY = dt.datetime(2024, 3, 8, 18, tzinfo=dt.timezone.utc)  # 10:00 on the phone: steps
MAX_COMBINATIONS = 20000


# ---------------------------------------------------------------------------------------------
# The operation log and the file-system image it is replayed on.


@dataclasses.dataclass(frozen=True)
class Op:
    """One logical operation. ``parent``/``name`` locate a directory entry (the destination of
    a rename, whose source is ``src``); ``ino`` is the file or directory concerned."""

    kind: str  # create mkdir write fsync dsync rename unlink commit
    text: str
    ino: int = -1
    parent: int = -1
    name: str = ""
    src: tuple = ()
    offset: int = 0
    data: bytes = b""
    db: Optional[dict] = None  # commit: database file name -> bytes
    durable: bool = True  # commit: synchronous=FULL


class Tree:
    """A file-system image: directories (ino -> {name: ino}) and file data (ino -> bytes)."""

    def __init__(self):
        self.dirs = {ROOT_INO: {}}
        self.files = {}

    def copy(self) -> "Tree":
        other = Tree()
        other.dirs = {ino: dict(entries) for ino, entries in self.dirs.items()}
        other.files = dict(self.files)
        return other

    @classmethod
    def scan(cls, root: Path) -> tuple:
        """(tree, {relative path: ino}) of a directory, database files left out."""
        tree, paths, counter = cls(), {".": ROOT_INO}, itertools.count(1)
        for folder, dirs, files in os.walk(str(root)):
            dirs.sort()
            rel_folder = os.path.relpath(folder, str(root))
            parent = paths[rel_folder]
            for name in sorted(dirs) + sorted(files):
                rel = os.path.normpath(os.path.join(rel_folder, name))
                if rel in DB_FILES:
                    continue
                ino = next(counter)
                paths[rel] = ino
                tree.dirs[parent][name] = ino
                if name in dirs:
                    tree.dirs[ino] = {}
                else:
                    tree.files[ino] = Path(folder, name).read_bytes()
        return tree, paths

    def image(self) -> dict:
        """{relative path: bytes, or None for a directory} of what is reachable."""
        out = {}

        def walk(ino: int, prefix: str) -> None:
            for name, child in sorted(self.dirs[ino].items()):
                rel = prefix + name
                if child in self.dirs:
                    out[rel] = None
                    walk(child, rel + "/")
                else:
                    out[rel] = self.files.get(child, b"")

        walk(ROOT_INO, "")
        return out


def image_digest(image: dict, db: dict) -> str:
    digest = hashlib.sha256()
    for rel, data in sorted(image.items()):
        digest.update(("%s\0%s\n" % (rel, "dir" if data is None
                                     else hashlib.sha256(data).hexdigest())).encode())
    for name, data in sorted(db.items()):
        digest.update(("db:%s\0%s\n" % (name, hashlib.sha256(data).hexdigest())).encode())
    return digest.hexdigest()


def materialize(image: dict, db: dict, target: Path) -> None:
    target.mkdir(parents=True)
    for rel, data in sorted(image.items()):
        if data is None:
            (target / rel).mkdir()
        else:
            (target / rel).write_bytes(data)
    for name, data in db.items():
        (target / name).write_bytes(data)


def replay_all(base: Tree, ops: list) -> Tree:
    """The image when every operation persisted (what the disk shows without a crash)."""
    return build_tree(base, ops, {}, {})


def build_tree(base: Tree, ops: list, choices: dict, tails: dict) -> Tree:
    """Apply ``ops`` to a copy of ``base``. ``choices``: op index -> whether a directory
    operation persisted (a rename: (destination added, source removed)); absent means
    persisted. ``tails``: ino -> how many unsynced bytes persisted, or "zeros"."""
    tree = base.copy()
    writes: dict = {}
    synced_upto: dict = {}
    for index, op in enumerate(ops):
        kind = op.kind
        if kind in ("create", "mkdir"):
            if kind == "mkdir":
                tree.dirs.setdefault(op.ino, {})
            else:
                tree.files.setdefault(op.ino, b"")
            if choices.get(index, True):
                tree.dirs[op.parent][op.name] = op.ino
        elif kind == "unlink":
            if choices.get(index, True) and tree.dirs[op.parent].get(op.name) == op.ino:
                del tree.dirs[op.parent][op.name]
        elif kind == "rename":
            added, removed = choices.get(index, (True, True))
            if removed and tree.dirs[op.src[0]].get(op.src[1]) == op.ino:
                del tree.dirs[op.src[0]][op.src[1]]
            if added:
                tree.dirs[op.parent][op.name] = op.ino
        elif kind == "write":
            writes.setdefault(op.ino, []).append(op)
        elif kind == "fsync":
            synced_upto[op.ino] = len(writes.get(op.ino, []))
    for ino, done in writes.items():
        data = bytearray(tree.files.get(ino, b""))
        synced = done[:synced_upto.get(ino, 0)]
        for op in synced:
            data[op.offset:op.offset + len(op.data)] = op.data
        tail = b"".join(op.data for op in done[len(synced):])
        keep = tails.get(ino, len(tail))
        tail = b"\0" * len(tail) if keep == "zeros" else tail[:keep]
        if tail:
            start = done[len(synced)].offset
            data[start:start + len(tail)] = tail
        tree.files[ino] = bytes(data)
    return tree


def crash_states(base: Tree, base_db: dict, ops: list, k: int):
    """Every crash state after the first ``k`` operations: (label, image, db) triples."""
    issued = ops[:k]
    last_dsync, last_fsync = {}, {}
    for index, op in enumerate(issued):
        if op.kind == "dsync":
            last_dsync[op.ino] = index
        elif op.kind == "fsync":
            last_fsync[op.ino] = index

    def synced(folder: int, index: int) -> bool:
        return last_dsync.get(folder, -1) > index

    points = []  # (op index, options)
    for index, op in enumerate(issued):
        if op.kind in ("create", "mkdir", "unlink"):
            if not synced(op.parent, index):
                points.append((index, (False, True)))
        elif op.kind == "rename":
            added_synced, removed_synced = synced(op.parent, index), synced(op.src[0], index)
            options = [(False, False), (True, True)]
            if op.src[0] != op.parent:
                options.append((True, False))  # both names: the source entry survives
            options = [(a, r) for a, r in options
                       if (a or not added_synced) and (r or not removed_synced)]
            if len(options) > 1:
                points.append((index, tuple(options)))
    tail_points = []  # (ino, options)
    unsynced: dict = {}
    for index, op in enumerate(issued):
        if op.kind == "write" and index > last_fsync.get(op.ino, -1):
            unsynced[op.ino] = unsynced.get(op.ino, 0) + len(op.data)
    for ino, size in sorted(unsynced.items()):
        tail_points.append((ino, tuple(sorted({0, size // 2, size}) + ["zeros"])))
    written = {op.ino: op.text.split(",")[0] + ")" for op in issued if op.kind == "write"}
    commits = [op for op in issued if op.kind == "commit"]
    durable = max([i for i, op in enumerate(commits) if op.durable], default=-1)
    dbs = [base_db] if durable < 0 else []
    dbs += [op.db for op in commits[max(durable, 0):]]
    combinations = len(dbs)
    for _, options in points + tail_points:
        combinations *= len(options)
    assert combinations <= MAX_COMBINATIONS, "too many crash states after op %d" % k
    for db_index, db in enumerate(dbs):
        for picks in itertools.product(*(options for _, options in points + tail_points)):
            choices = {index: pick for (index, _), pick in zip(points, picks)}
            tails = {ino: pick for (ino, _), pick in zip(tail_points, picks[len(points):])}
            tree = build_tree(base, issued, choices, tails)
            label = "after %d ops; lost: %s; tails: %s; db: %s" % (
                k, [issued[i].text + ("" if pick else " (undone)") if not isinstance(pick, tuple)
                    else "%s (added=%s, source removed=%s)" % (issued[i].text, *pick)
                    for i, pick in choices.items() if pick is not True and pick != (True, True)],
                {written[ino]: pick for ino, pick in tails.items()},
                "base" if db is base_db else "commit %d" % (len(commits) - len(dbs) + db_index))
            yield label, tree.image(), db


# ---------------------------------------------------------------------------------------------
# Recording: healthlog's own calls, done for real and written down.


class _RecordedRaw(io.RawIOBase):
    """The unbuffered file under a file object from ``os.fdopen``: its writes are recorded
    when they reach the kernel, so a buffered write still in the file object when ``fsync``
    runs is recorded after that fsync, which does not cover it (a missing ``flush()``)."""

    def __init__(self, real: io.FileIO, recorder: "Recorder", ino: int, rel: str):
        super().__init__()
        self._real, self._recorder, self._ino, self._rel = real, recorder, ino, rel

    def write(self, data) -> int:
        offset = self._real.tell()
        written = self._real.write(data)
        if written:
            chunk = bytes(memoryview(data)[:written])
            self._recorder.log(Op("write", "write(%s, %d bytes)" % (self._rel, len(chunk)),
                                  ino=self._ino, offset=offset, data=chunk))
        return written

    def readinto(self, buffer) -> int:
        return self._real.readinto(buffer)

    def readable(self) -> bool:
        return self._real.readable()

    def writable(self) -> bool:
        return self._real.writable()

    def seekable(self) -> bool:
        return self._real.seekable()

    def seek(self, offset: int, whence: int = 0) -> int:
        return self._real.seek(offset, whence)

    def tell(self) -> int:
        return self._real.tell()

    def fileno(self) -> int:
        return self._real.fileno()

    def close(self) -> None:
        try:
            super().close()
        finally:
            self._real.close()


class Recorder:
    """Wraps the ``os`` calls healthlog makes under ``root`` and logs them as operations."""

    def __init__(self, root: Path, base_paths: dict, first_ino: int):
        self.root = os.path.abspath(str(root))
        self.paths = dict(base_paths)  # volatile namespace: relative path -> ino
        self.dir_inos = set()
        self.inos = itertools.count(first_ino)
        self.fds: dict = {}  # fd -> (ino, relative path, is a directory)
        self.ops: list = []
        self.unsupported: list = []
        self.active = False

    def log(self, op: Op) -> None:
        self.ops.append(op)

    def rel(self, path) -> Optional[str]:
        if isinstance(path, int):
            return None
        full = os.path.abspath(os.fsdecode(os.fspath(path)))
        rel = os.path.relpath(full, self.root)
        if rel == ".." or rel.startswith("../") or rel in DB_FILES:
            return None
        return rel

    def parent_of(self, rel: str) -> tuple:
        head, name = os.path.split(rel)
        return self.paths[head or "."], name

    def commit(self, snapshot: dict, durable: bool) -> None:
        self.log(Op("commit", "sqlite_commit(%s)" % ("FULL" if durable else "NORMAL"),
                    db=snapshot, durable=durable))

    def install(self, patch: pytest.MonkeyPatch) -> None:
        real = {name: getattr(os, name) for name in (
            "open", "close", "fdopen", "fsync", "replace", "rename", "unlink", "remove",
            "mkdir", "rmdir", "write", "ftruncate", "truncate", "link", "symlink")}
        rec = self

        def os_open(path, flags, mode=0o777, *, dir_fd=None):
            rel = rec.rel(path) if dir_fd is None else None
            existed = rel is not None and os.path.lexists(os.fspath(path))
            fd = real["open"](path, flags, mode, dir_fd=dir_fd)
            if rel is not None:
                if flags & os.O_TRUNC and existed:
                    rec.unsupported.append("O_TRUNC on %s" % rel)
                if not existed and flags & os.O_CREAT:
                    parent, name = rec.parent_of(rel)
                    ino = next(rec.inos)
                    rec.paths[rel] = ino
                    rec.log(Op("create", "create(%s)" % rel, ino=ino, parent=parent, name=name))
                rec.fds[fd] = (rec.paths[rel], rel, bool(flags & os.O_DIRECTORY))
            else:
                rec.fds.pop(fd, None)
            return fd

        def os_close(fd):
            real["close"](fd)
            rec.fds.pop(fd, None)

        def os_fdopen(fd, mode="r", buffering=-1, *args, **kwargs):
            if fd not in rec.fds or not any(c in mode for c in "wa+"):
                return real["fdopen"](fd, mode, buffering, *args, **kwargs)
            ino, rel, _ = rec.fds[fd]
            if "b" not in mode or args or kwargs:
                rec.unsupported.append("fdopen(%s, %r) on %s" % (fd, mode, rel))
                return real["fdopen"](fd, mode, buffering, *args, **kwargs)
            raw = _RecordedRaw(real["fdopen"](fd, mode, 0), rec, ino, rel)
            if buffering == 0:
                return raw
            size = buffering if buffering > 1 else io.DEFAULT_BUFFER_SIZE
            return (io.BufferedRandom if "+" in mode else io.BufferedWriter)(raw, size)

        def os_write(fd, data):
            written = real["write"](fd, data)
            if fd in rec.fds:
                ino, rel, _ = rec.fds[fd]
                end = os.lseek(fd, 0, os.SEEK_CUR)
                chunk = bytes(data[:written])
                rec.log(Op("write", "write(%s, %d bytes)" % (rel, len(chunk)), ino=ino,
                           offset=end - written, data=chunk))
            return written

        def os_fsync(fd):
            real["fsync"](fd)
            fd = fd if isinstance(fd, int) else fd.fileno()
            if fd in rec.fds:
                ino, rel, is_dir = rec.fds[fd]
                rec.log(Op("dsync" if is_dir else "fsync",
                           "fsync(%s%s)" % (rel, "/" if is_dir else ""), ino=ino))

        def renamer(which):
            def os_rename(src, dst, *, src_dir_fd=None, dst_dir_fd=None):
                real[which](src, dst, src_dir_fd=src_dir_fd, dst_dir_fd=dst_dir_fd)
                srel, drel = rec.rel(src), rec.rel(dst)
                if srel is None and drel is None:
                    return
                if srel is None or drel is None:
                    rec.unsupported.append("rename across the data directory: %s" % (src,))
                    return
                ino = rec.paths.pop(srel)
                for path in [p for p in rec.paths if p.startswith(srel + "/")]:
                    rec.paths[drel + path[len(srel):]] = rec.paths.pop(path)
                rec.paths[drel] = ino
                sparent, sname = rec.parent_of(srel)
                dparent, dname = rec.parent_of(drel)
                rec.log(Op("rename", "rename(%s, %s)" % (srel, drel), ino=ino, parent=dparent,
                           name=dname, src=(sparent, sname)))
            return os_rename

        def unlinker(which):
            def os_unlink(path, *, dir_fd=None):
                real[which](path, dir_fd=dir_fd)
                rel = rec.rel(path)
                if rel is not None:
                    parent, name = rec.parent_of(rel)
                    rec.log(Op("unlink", "unlink(%s)" % rel, ino=rec.paths.pop(rel),
                               parent=parent, name=name))
            return os_unlink

        def os_mkdir(path, mode=0o777, *, dir_fd=None):
            real["mkdir"](path, mode, dir_fd=dir_fd)
            rel = rec.rel(path)
            if rel is not None:
                parent, name = rec.parent_of(rel)
                ino = next(rec.inos)
                rec.paths[rel] = ino
                rec.log(Op("mkdir", "mkdir(%s)" % rel, ino=ino, parent=parent, name=name))

        def refuse(which):
            def call(target, *args, **kwargs):
                if (target in rec.fds) if isinstance(target, int) else rec.rel(target):
                    rec.unsupported.append("%s on %s" % (which, target))
                return real[which](target, *args, **kwargs)
            return call

        wrappers = {"open": os_open, "close": os_close, "fdopen": os_fdopen, "fsync": os_fsync,
                    "replace": renamer("replace"), "rename": renamer("rename"),
                    "unlink": unlinker("unlink"), "remove": unlinker("remove"),
                    "mkdir": os_mkdir, "write": os_write}
        wrappers.update((name, refuse(name)) for name in (
            "rmdir", "ftruncate", "truncate", "link", "symlink"))
        for name, wrapper in wrappers.items():
            patch.setattr(os, name, wrapper)
        accessor = getattr(pathlib, "_NormalAccessor", None)  # Python 3.9 and 3.10
        if accessor is not None:
            for name in ("open", "mkdir", "unlink", "rename", "replace", "rmdir", "symlink"):
                if name in wrappers and hasattr(accessor, name):
                    patch.setattr(accessor, name, staticmethod(wrappers[name]))


def db_snapshot(data_dir: Path) -> dict:
    """The database files as a crash now would leave them (no -shm: rebuilt from the WAL)."""
    out = {}
    for name in (healthlog.DB_NAME, healthlog.DB_NAME + "-wal"):
        path = data_dir / name
        if path.exists():
            out[name] = path.read_bytes()
    return out


class RecordingConnection:
    """A real connection whose commits are logged, with the database files they leave."""

    def __init__(self, conn: sqlite3.Connection, recorder: Recorder, data_dir: Path):
        self._conn, self._recorder, self._data_dir = conn, recorder, data_dir
        self._durable = conn.execute("PRAGMA synchronous").fetchone()[0] >= 2

    def _after(self, sql: str, changes_before: int) -> None:
        if self._conn.in_transaction:
            return
        if sql.strip().upper().startswith(("COMMIT", "END")) \
                or self._conn.total_changes != changes_before:
            self._recorder.commit(db_snapshot(self._data_dir), self._durable)

    def execute(self, sql, *args):
        before = self._conn.total_changes
        cursor = self._conn.execute(sql, *args)
        self._after(sql, before)
        return cursor

    def executemany(self, sql, *args):
        before = self._conn.total_changes
        cursor = self._conn.executemany(sql, *args)
        self._after(sql, before)
        return cursor

    def __getattr__(self, name):
        return getattr(self._conn, name)


# ---------------------------------------------------------------------------------------------
# Deliveries, the reference folds and the scenario explored.


@dataclasses.dataclass
class SentBody:
    body: bytes
    headers: dict
    received_at: dt.datetime

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.body).hexdigest()

    @property
    def stamp(self) -> str:
        return healthlog.format_received_at(self.received_at)


EXTRA_META = {"content_type": "application/json"}  # what the ingest route adds


def delivery(seed: int, names: tuple, start: dt.datetime, hours: float, received_at,
             cutoff=None) -> SentBody:
    payload = hf.metrics_payload(seed, names, start=start,
                                 end=start + dt.timedelta(hours=hours), cutoff=cutoff)
    automation = hf.Automation("Crash states", "Minutes", "Since Last Sync")
    headers = hf.headers_for(automation, session_id="0C6B1C53-0000-4000-8000-%012d" % seed)
    headers = {h: headers.get(h) for h in healthlog.AUTOMATION_HEADERS}
    return SentBody(hf.dumps_hae(payload), headers, received_at)


def accept_sent(archive: healthlog.Archive, conn, sent: SentBody) -> int:
    """Receive and accept one delivery exactly as the ingest route does."""
    upload = archive.receive(io.BytesIO(sent.body).read, len(sent.body), 1 << 30,
                             lambda: None)
    return healthlog.accept_delivery(archive, conn, upload, sent.received_at, sent.headers,
                                     None, dict(EXTRA_META))


OBJECT_COLUMNS = ("metric, layer, hour, units, first_at, last_at, points, delivery_id,"
                  " updated_by, hash, sealed, point_deliveries")


def conn_objects(conn) -> list:
    return [tuple(row) for row in conn.execute(
        "SELECT %s FROM object ORDER BY metric, layer, hour" % OBJECT_COLUMNS)]


class CleanFolds:
    """Clean folds in fresh directories: the object rows after folding the first m of the
    deliveries (journaled in order), and the fingerprint of any subset folded alone."""

    def __init__(self, root: Path, sent: list):
        assert len({s.sha256 for s in sent}) == len(sent), "the checker tells bodies apart"
        self.root, self.sent = root, sent
        self._fingerprints: dict = {}
        self._lock = threading.Lock()  # states are recovered in parallel
        self._folders = itertools.count()
        self.rows_after = self._fold(tuple(range(len(sent))), rows=True)

    def _fold(self, indices: tuple, rows: bool = False):
        folder = self.root / ("ref-%d" % next(self._folders))
        config = healthlog.Config(data_dir=folder, log_level="ERROR")
        healthlog.ensure_data_dir(folder)
        conn = healthlog.open_database(config)
        try:
            archive = healthlog.Archive(folder)
            ids = [accept_sent(archive, conn, self.sent[i]) for i in indices]
            engine = healthlog.FoldEngine(conn, config, verbose=False)
            after = [conn_objects(conn)]
            for delivery_id in ids:
                assert engine.fold(delivery_id).kind == "folded"
                after.append(conn_objects(conn))
            return after if rows else healthlog.fingerprint(conn)
        finally:
            conn.close()
            shutil.rmtree(str(folder))

    def fingerprint(self, present: frozenset) -> str:
        with self._lock:
            if present not in self._fingerprints:
                self._fingerprints[present] = self._fold(tuple(sorted(present)))
            return self._fingerprints[present]


@dataclasses.dataclass
class Scenario:
    name: str
    base: Tree
    base_db: dict
    ops: list
    sent: list
    acked_after: dict  # sent index -> the crash point from which its 200 was sent
    refs: CleanFolds


@dataclasses.dataclass
class Report:
    name: str
    crash_points: int = 0
    crash_states: int = 0
    recovered: int = 0
    seconds: float = 0.0
    vulnerabilities: list = dataclasses.field(default_factory=list)
    notes: Counter = dataclasses.field(default_factory=Counter)

    def show(self) -> None:
        print("\n%s: %d crash points, %d crash states, %d unique states recovered, "
              "%d vulnerabilities, %.1f s" % (self.name, self.crash_points, self.crash_states,
                                              self.recovered, len(self.vulnerabilities),
                                              self.seconds))
        for note, count in sorted(self.notes.items()):
            print("  note: %s: %d states" % (note, count))
        for text in self.vulnerabilities[:10]:
            print("  VULNERABILITY: " + text)


@dataclasses.dataclass
class Recording:
    """What ``steps`` is handed: a real ``Service`` of the data directory and the connections
    it writes through, opened by its own code and wrapped so that their commits are logged.

    ``ingest`` comes from ``service.pool.get()``, the call the ingest route makes for its
    connection; ``fold`` from ``service.worker.connect()``, the one the fold thread makes. The
    service is constructed, not started: a started one writes DATA/token, clears DATA/tmp and
    runs a fold thread whose commits would land, unrecorded, beside the recorded ones;
    ``Service.start`` hands this very pool to the ingest route, and RELY-9.2 checks the
    connections of a started service over HTTP."""

    service: healthlog.Service
    ingest: RecordingConnection
    fold: RecordingConnection
    acknowledged: Callable[[int], None]  # sent index i got its 200 (its row commit returned)

    def post(self, sent: SentBody) -> int:
        """One delivery received and accepted as the route does: the service's archive, its
        pool's connection."""
        return accept_sent(self.service.archive, self.ingest, sent)

    engine: Optional[healthlog.FoldEngine] = None

    def fold_pass(self) -> int:
        """One pass of the service's fold worker over one engine on its fold connection, as
        the fold thread runs its passes."""
        if self.engine is None:
            self.engine = healthlog.FoldEngine(self.fold, self.service.config)
        return self.service.worker.run_pass(self.engine)


def record(data_dir: Path, monkeypatch, steps) -> tuple:
    """Run ``steps(recording)`` (a :class:`Recording`) under the recorder on a prepared,
    quiescent data directory. Whether a commit is durable is read from its connection's
    ``PRAGMA synchronous``. Returns (base tree, base database, ops, {sent index: crash point});
    checks the recording is complete."""
    service = healthlog.Service(healthlog.Config(data_dir=data_dir, log_level="ERROR"),
                                announce=lambda token: None)
    fold = service.worker.connect()
    try:
        ingest = service.pool.get()
        base, paths = Tree.scan(data_dir)
        base_db = db_snapshot(data_dir)
        recorder = Recorder(data_dir, paths, first_ino=len(paths) + 1)
        acked = {}
        recording = Recording(service, RecordingConnection(ingest, recorder, data_dir),
                              RecordingConnection(fold, recorder, data_dir),
                              lambda index: acked.__setitem__(index, len(recorder.ops)))
        with monkeypatch.context() as patch:
            recorder.install(patch)
            steps(recording)
    finally:
        fold.close()
        service.pool.close()
    assert not recorder.unsupported, recorder.unsupported
    replayed = replay_all(base, recorder.ops).image()
    on_disk = Tree.scan(data_dir)[0].image()
    assert replayed == on_disk, "the recording missed an operation: %s" % sorted(
        set(replayed.items()) ^ set(on_disk.items()))
    return base, base_db, recorder.ops, acked


# ---------------------------------------------------------------------------------------------
# Recovery and the invariants.


def store_fingerprint(state: Path) -> str:
    conn = sqlite3.connect(str(state / healthlog.DB_NAME))
    try:
        return healthlog.fingerprint(conn)
    finally:
        conn.close()


def check_before_recovery(state: Path, scenario: Scenario, config) -> list:
    """The crash state's store: a clean fold of a journal-order prefix, nothing half."""
    problems = []
    conn = sqlite3.connect(str(state / healthlog.DB_NAME))
    try:
        integrity = conn.execute("PRAGMA integrity_check").fetchone()[0]
        if integrity != "ok":
            return ["database damaged: %s" % integrity]
        rows = conn.execute("SELECT id, body_sha256, parse_status, folded_at FROM delivery"
                            " ORDER BY received_at, id").fetchall()
        objects = conn_objects(conn)
    finally:
        conn.close()
    index_of = {sent.sha256: i for i, sent in enumerate(scenario.sent)}
    statuses = [status for _, _, status, _ in rows]
    folded = [row_id for row_id, _, status, _ in rows if status in ("parsed", "partial")]
    if any(status not in ("pending", "parsed", "partial") for status in statuses):
        problems.append("a delivery is %s before any recovery" % statuses)
    if statuses != sorted(statuses, key=lambda s: s == "pending"):
        problems.append("folded out of journal order: %s" % statuses)
    if any(status == "pending" and folded_at for _, _, status, folded_at in rows):
        problems.append("a pending delivery carries a fold time (half-recorded outcome)")
    prefix = [index_of.get(sha) for _, sha, status, _ in rows if status != "pending"]
    if prefix != list(range(len(prefix))):
        problems.append("the folded deliveries are not the first ones sent: %s" % prefix)
    elif objects != scenario.refs.rows_after[len(prefix)]:
        problems.append("objects are not those of a clean fold of the %d folded deliveries"
                        " (half a fold, or a fold twice)" % len(prefix))
    named = set()
    for row in objects:
        named.update([row[7], row[8]] + json.loads(row[11]))
    if not named <= set(folded):
        problems.append("objects name deliveries that are not folded: %s"
                        % sorted(named - set(folded)))
    out = io.StringIO()
    if healthlog.run_verify(config, out=out) != 0:
        problems.append("verify before recovery: %s" % out.getvalue().strip().splitlines()[-1])
    return problems


def run_service(config) -> None:
    service = healthlog.Service(config, announce=lambda token: None)
    service.start()
    try:
        wait_for(lambda: service.worker.state == "idle", timeout=20)
    finally:
        assert service.stop(), "the fold thread did not stop"


def check_journal(state: Path, scenario: Scenario, when: str) -> tuple:
    """Every row points to a body identical to the one sent; (rows, problems)."""
    problems = []
    by_sha = {sent.sha256: sent for sent in scenario.sent}
    rows = db_rows(state, "SELECT * FROM delivery ORDER BY id")
    for row in rows:
        path = state / row["archive_path"]
        sent = by_sha.get(row["body_sha256"])
        if not path.is_file():
            problems.append("%s: row %d points to a missing body %s (%s)" % (
                when, row["id"], row["archive_path"], row["error"]))
        elif sent is None or path.read_bytes() != sent.body:
            problems.append("%s: row %d's body %s is not a body that was sent (torn?)"
                            % (when, row["id"], row["archive_path"]))
        if row["parse_status"] not in ("parsed", "partial"):
            problems.append("%s: row %d is %s (%s)" % (when, row["id"], row["parse_status"],
                                                        row["error"]))
    return rows, problems


def check_after_recovery(state: Path, scenario: Scenario, acked: frozenset, config,
                         notes: Counter) -> list:
    tmp_left = sorted(p.name for p in (state / healthlog.TMP_DIR).iterdir())
    problems = ["serve left DATA/tmp with %s" % tmp_left] if tmp_left else []
    rows, found = check_journal(state, scenario, "after serve")
    problems += found
    index_of = {sent.sha256: i for i, sent in enumerate(scenario.sent)}
    served = frozenset(index_of[row["body_sha256"]] for row in rows
                       if row["body_sha256"] in index_of)
    if store_fingerprint(state) != scenario.refs.fingerprint(served):
        problems.append("after serve, the store is not a clean fold of %s" % sorted(served))
    for index in sorted(acked):
        count = sum(row["body_sha256"] == scenario.sent[index].sha256 for row in rows)
        if count != 1:
            problems.append("acknowledged delivery %d is journaled %d times after serve"
                            % (index, count))
    out = io.StringIO()
    try:
        code = healthlog.run_reindex(config, out=out)
    except Exception as exc:  # a failing recovery is what this test looks for
        return problems + ["reindex raised %r" % exc]
    if code != 0:
        return problems + ["reindex exit %d: %s" % (code, out.getvalue())]
    rows, found = check_journal(state, scenario, "after reindex")
    problems += found
    by_path = Counter(row["archive_path"] for row in rows)
    bodies = healthlog.archive_bodies(state)
    if sorted(by_path) != bodies or max(by_path.values(), default=1) != 1:
        problems.append("journal rows %s and archived bodies %s differ" % (sorted(by_path),
                                                                           bodies))
    by_sha = {sent.sha256: sent for sent in scenario.sent}
    present = set()
    for row in rows:
        if row["archive_path"].endswith(".meta.json"):
            problems.append("a .meta.json was journaled as a body: %s" % row["archive_path"])
            continue
        sent = by_sha.get(row["body_sha256"])
        if sent is None:
            continue  # reported by check_journal
        index = scenario.sent.index(sent)
        if index in present:
            problems.append("delivery %d is journaled twice" % index)
        present.add(index)
        meta_path = state / (row["archive_path"][:-len(".json")] + ".meta.json")
        try:
            meta = json.loads(meta_path.read_text("utf-8"))
        except (OSError, ValueError) as exc:
            problems.append("body %s has no readable .meta.json (%s): its headers are lost"
                            % (row["archive_path"], type(exc).__name__))
            meta = {}
        want = {"received_at": sent.stamp, "body_sha256": sent.sha256,
                "body_bytes": len(sent.body),
                "headers": {h: v for h, v in sent.headers.items() if v is not None}}
        if meta and {key: meta.get(key) for key in want} != want:
            problems.append("the .meta.json of %s does not describe its body"
                            % row["archive_path"])
        columns = {"received_at": sent.stamp,
                   "automation_id": sent.headers.get("automation-id"),
                   "automation_aggregation": sent.headers.get("automation-aggregation"),
                   "session_id": sent.headers.get("session-id")}
        if {key: row[key] for key in columns} != columns:
            problems.append("row of %s lost its receive time or headers: %s"
                            % (row["archive_path"], {key: row[key] for key in columns}))
    missing = acked - present
    if missing:
        problems.append("acknowledged deliveries %s are gone after recovery" % sorted(missing))
    metas = {str(p.relative_to(state)) for p in (state / healthlog.ARCHIVE_DIR).rglob("*")
             if p.name.endswith(".meta.json") and not p.name.startswith(".")}
    if any(meta[:-len(".meta.json")] + ".json" not in by_path for meta in metas):
        notes["a .meta.json without its body (never journaled)"] += 1
    if any(p.name.startswith(".") for p in (state / healthlog.ARCHIVE_DIR).rglob("*")):
        notes["a leftover .meta.json temp file in the archive"] += 1
    if store_fingerprint(state) != scenario.refs.fingerprint(frozenset(present)):
        problems.append("fingerprint after reindex is not that of a clean fold of %s"
                        % sorted(present))
    out = io.StringIO()
    if healthlog.run_verify(config, out=out) != 0:
        problems.append("verify after recovery: %s" % out.getvalue())
    return problems


def recover_and_check(scenario: Scenario, state: Path, image: dict, db: dict, acked: frozenset,
                      make_config, notes: Counter) -> list:
    """Build one crash state, recover it as a user would, and list the invariants broken
    (leftovers that hurt nothing go to ``notes``)."""
    materialize(image, db, state)
    config = make_config(data_dir=state, log_level="ERROR")
    try:
        problems = check_before_recovery(state, scenario, config)
        try:
            run_service(config)
        except Exception as exc:  # a state serve cannot start on is a finding
            return problems + ["serve failed on the crash state: %r" % exc]
        return problems + check_after_recovery(state, scenario, acked, config, notes)
    finally:
        shutil.rmtree(str(state))


RECOVERY_THREADS = 4
"""Crash states recovered at once: each ``Service.stop()`` sleeps ~0.2 s in Cheroot's
selector loop, so a few in parallel keep the run short without loading the cores."""


def explore(scenario: Scenario, workdir: Path, make_config, points=None,
            stop_at_first: bool = False) -> Report:
    """Enumerate, build, recover and check every crash state of the scenario's op log
    (deduplicated by content and by what had been acknowledged)."""
    report = Report(scenario.name)
    started = time.monotonic()
    unique = {}
    for k in (range(len(scenario.ops) + 1) if points is None else points):
        report.crash_points += 1
        acked = frozenset(i for i, point in scenario.acked_after.items() if point <= k)
        for label, image, db in crash_states(scenario.base, scenario.base_db, scenario.ops, k):
            report.crash_states += 1
            unique.setdefault((image_digest(image, db), acked), (k, label, image, db, acked))
    jobs = list(unique.values())

    def run(number: int) -> tuple:
        k, label, image, db, acked = jobs[number]
        notes = Counter()
        problems = recover_and_check(scenario, workdir / ("state-%d" % number), image, db,
                                     acked, make_config, notes)
        ops_text = "; ".join(op.text for op in scenario.ops[:k])
        return (["%s | %s | ops: %s" % (" / ".join(problems), label, ops_text)]
                if problems else []), notes

    if stop_at_first:
        results = (run(number) for number in range(len(jobs)))
    else:
        executor = concurrent.futures.ThreadPoolExecutor(RECOVERY_THREADS)
        results = executor.map(run, range(len(jobs)))
    try:
        for found, notes in results:
            report.recovered += 1
            report.vulnerabilities += found
            report.notes.update(notes)
            if found and stop_at_first:
                break
    finally:
        if not stop_at_first:
            executor.shutdown()
    report.seconds = time.monotonic() - started
    return report


# ---------------------------------------------------------------------------------------------
# Scenarios.


def fresh_data_dir(data_dir: Path) -> None:
    healthlog.ensure_data_dir(data_dir)
    healthlog.open_database(healthlog.Config(data_dir=data_dir, log_level="ERROR")).close()


def ingest_scenario(data_dir: Path, tmp_path: Path, monkeypatch) -> Scenario:
    """One small delivery into an empty data directory (its day folders are created)."""
    sent = [delivery(1, ("step_count",), DAY,
                     1, T0)]
    fresh_data_dir(data_dir)

    def steps(recording: Recording) -> None:
        recording.post(sent[0])
        recording.acknowledged(0)

    base, base_db, ops, acked = record(data_dir, monkeypatch, steps)
    return Scenario("RELY-2.1 ingest", base, base_db, ops, sent, acked,
                    CleanFolds(tmp_path / "refs", sent))


def fold_sends() -> list:
    """D0 folded before; D1 re-sends D0's window grown (overwrites) and D2 adds a metric."""

    return [delivery(1, ("step_count", "heart_rate"), DAY, 1.5, T0,
                     cutoff=DAY + dt.timedelta(minutes=70, seconds=20)),
            delivery(1, ("step_count", "heart_rate"), DAY, 1.5, T0 + dt.timedelta(minutes=5)),
            delivery(2, ("active_energy",), DAY, 1, T0 + dt.timedelta(minutes=10))]


def fold_scenario(data_dir: Path, tmp_path: Path, monkeypatch) -> Scenario:
    sent = fold_sends()
    fresh_data_dir(data_dir)
    config = healthlog.Config(data_dir=data_dir, log_level="ERROR")
    conn = healthlog.open_database(config)
    try:
        ids = [accept_sent(healthlog.Archive(data_dir), conn, s) for s in sent]
        assert healthlog.FoldEngine(conn, config).fold(ids[0]).kind == "folded"
    finally:
        conn.close()

    def steps(recording: Recording) -> None:
        assert recording.fold_pass() == 2

    base, base_db, ops, acked = record(data_dir, monkeypatch, steps)
    # Per delivery: its attempt counted (FOLD-14), then its fold.
    assert [op.kind for op in ops] == ["commit"] * 4, [op.text for op in ops]
    return Scenario("RELY-2.2 fold", base, base_db, ops, sent, dict.fromkeys(range(3), 0),
                    CleanFolds(tmp_path / "refs", sent))


# ---------------------------------------------------------------------------------------------
# The tests.


def test_rely_2_1_every_crash_state_of_an_ingest_recovers_without_loss(
        data_dir, tmp_path, monkeypatch, make_config):
    """WHEN one delivery is ingested (receive, meta, body rename, row commit) and the machine
    crashes after any of its file-system operations, with any un-fsynced write dropped, torn
    or zeroed and any un-fsynced directory entry undone, and the user restarts ``serve`` and
    runs ``reindex`` and ``verify``
    THEN a delivery whose row commit had returned (200) is journaled once with its body
    byte-identical, no torn body or body without its ``.meta.json`` is ever journaled, no row
    points to a missing body, and the store equals a clean fold of what is journaled."""
    scenario = ingest_scenario(data_dir, tmp_path, monkeypatch)
    kinds = [op.kind for op in scenario.ops]
    assert kinds.count("commit") == 1 and kinds.count("rename") == 2 and "dsync" in kinds
    report = explore(scenario, tmp_path / "states", make_config)
    print("\nthe recorded ingest:\n  " + "\n  ".join(op.text for op in scenario.ops))
    report.show()
    assert report.recovered >= 10
    assert report.vulnerabilities == [], "\n".join(report.vulnerabilities[:5])


def test_rely_2_2_every_crash_state_of_a_fold_pass_is_a_whole_fold(
        data_dir, tmp_path, monkeypatch, make_config):
    """WHEN a fold pass folds two pending deliveries into hours a folded one already holds
    (per delivery one transaction counting its attempt, then one folding it;
    synchronous=NORMAL) and the machine crashes after any of
    its commits, losing any suffix of the commits not yet made durable
    THEN the objects are exactly a clean fold of the deliveries marked folded (a journal-order
    prefix; no object names an unfolded delivery), and after restarting ``serve`` every
    delivery is parsed and the fingerprint is that of a clean fold of all of them."""
    scenario = fold_scenario(data_dir, tmp_path, monkeypatch)
    report = explore(scenario, tmp_path / "states", make_config)
    report.show()
    assert report.recovered == 5  # none, an attempt, a fold, an attempt, a fold
    assert report.vulnerabilities == [], "\n".join(report.vulnerabilities[:5])


def _moved(ops: list, index: int, to: int) -> list:
    ops = list(ops)
    ops.insert(to, ops.pop(index))
    return ops


def test_rely_2_3_the_checker_catches_a_body_renamed_before_its_meta_is_durable(
        data_dir, tmp_path, monkeypatch, make_config):
    """(A test of the test machinery.) WHEN the recorded ingest log is rewritten so that the
    body is renamed into the archive (and its folder fsynced) before its ``.meta.json`` is
    created, and the crash points between the two are explored
    THEN the exploration counts its states and reports a vulnerability: an orphan adopted by
    ``reindex`` without its metadata."""
    scenario = ingest_scenario(data_dir, tmp_path, monkeypatch)
    ops = scenario.ops
    body = next(i for i, op in enumerate(ops) if op.kind == "rename" and "upload-" in op.text)
    meta = next(i for i, op in enumerate(ops) if op.kind == "create" and ".meta.json" in op.text)
    assert ops[body + 1].kind == "dsync" and meta < body
    bad = _moved(_moved(ops, body, meta), body + 1, meta + 1)  # rename, dsync, create meta...
    scenario = dataclasses.replace(scenario, ops=bad, name="planted: body before meta")
    report = explore(scenario, tmp_path / "states", make_config,
                     points=range(meta + 2, meta + 4), stop_at_first=True)
    report.show()
    assert report.crash_states > 0 and len(report.vulnerabilities) == 1
    assert "headers are lost" in report.vulnerabilities[0], report.vulnerabilities[0]


def test_rely_2_3_the_checker_catches_a_body_renamed_before_its_data_is_fsynced(
        data_dir, tmp_path, monkeypatch, make_config):
    """(A test of the test machinery.) WHEN the recorded ingest log is rewritten without the
    fsync of the uploaded body, and the crash point right after the row commit is explored
    THEN a torn body is reported, and the acknowledged delivery as not intact."""
    scenario = ingest_scenario(data_dir, tmp_path, monkeypatch)
    upload_fsync = next(i for i, op in enumerate(scenario.ops)
                        if op.kind == "fsync" and "upload-" in op.text)
    bad = scenario.ops[:upload_fsync] + scenario.ops[upload_fsync + 1:]
    scenario = dataclasses.replace(scenario, ops=bad, name="planted: body never fsynced")
    report = explore(scenario, tmp_path / "states", make_config, points=[len(bad)],
                     stop_at_first=True)
    report.show()
    assert len(report.vulnerabilities) == 1
    assert "not a body that was sent" in report.vulnerabilities[0], report.vulnerabilities[0]


def test_rely_2_3_the_checker_catches_a_fold_committed_in_two_transactions(
        data_dir, tmp_path, monkeypatch, make_config):
    """(A test of the test machinery.) WHEN a fold's log is replaced by a hand-built one that
    commits the delivery's objects in one transaction and its status in a second (durably)
    THEN the crash state between the two commits is reported as half a fold."""
    scenario = fold_scenario(data_dir, tmp_path, monkeypatch)
    first = scenario.ops[1]  # the first fold (ops[0] counts its attempt)
    half_dir = tmp_path / "half"
    materialize({}, scenario.base_db, half_dir)
    after_dir = tmp_path / "after"
    materialize({}, first.db, after_dir)
    conn = sqlite3.connect(str(half_dir / healthlog.DB_NAME), isolation_level=None)
    try:
        conn.execute("ATTACH DATABASE ? AS done", (str(after_dir / healthlog.DB_NAME),))
        conn.execute("BEGIN")
        conn.execute("DELETE FROM main.object")
        conn.execute("INSERT INTO main.object SELECT * FROM done.object")
        conn.execute("COMMIT")
        conn.execute("DETACH DATABASE done")
    finally:
        conn.close()
    half = Op("commit", "sqlite_commit(objects only)", db=db_snapshot(half_dir), durable=True)
    done = dataclasses.replace(first, durable=True)
    scenario = dataclasses.replace(scenario, ops=[half, done], name="planted: split fold")
    report = explore(scenario, tmp_path / "states", make_config, points=[1],
                     stop_at_first=True)
    report.show()
    assert len(report.vulnerabilities) == 1
    assert "objects name deliveries that are not folded" in report.vulnerabilities[0]


def test_rely_2_4_a_body_refused_after_its_meta_json_leaves_no_meta_json_in_any_crash_state(
        data_dir, tmp_path, monkeypatch, make_config):
    """WHEN the body's rename into the archive fails (EXDEV: DATA/tmp on another file system)
    after its ``.meta.json`` was made durable, the delivery is refused with a 500, and the
    machine crashes right after that answer, in every way the weak model allows
    THEN no crash state holds the ``.meta.json`` (its removal was made durable before the
    answer) or a row, and every state recovers: ``serve`` clears the upload, nothing is
    journaled."""
    sent = delivery(1, ("step_count",), DAY, 1, T0)
    fresh_data_dir(data_dir)

    def steps(recording: Recording) -> None:
        rename = os.replace  # the recorder's

        def cross_device(src, dst, **kwargs):
            if os.path.basename(os.fspath(src)).startswith("upload-"):
                raise OSError(errno.EXDEV, os.strerror(errno.EXDEV), src)
            return rename(src, dst, **kwargs)

        with monkeypatch.context() as patch:
            patch.setattr(os, "replace", cross_device)
            with pytest.raises(healthlog.InternalError):
                recording.post(sent)

    base, base_db, ops, acked = record(data_dir, monkeypatch, steps)
    texts = [op.text for op in ops]
    assert not acked and "commit" not in [op.kind for op in ops], texts
    assert any(op.kind == "rename" and op.name.endswith(".meta.json") for op in ops), texts
    assert any(op.kind == "unlink" and op.name.endswith(".meta.json") for op in ops), texts
    states = list(crash_states(base, base_db, ops, len(ops)))
    kept = [label for label, image, _ in states
            if any(rel.endswith(".meta.json") for rel in image)]
    assert states and not kept, "a .meta.json without its body survives the crash: %s\nops: %s" % (
        kept[:3], "; ".join(texts))
    scenario = Scenario("RELY-2.4 refused", base, base_db, ops, [sent], acked,
                        CleanFolds(tmp_path / "refs", [sent]))
    report = explore(scenario, tmp_path / "states", make_config, points=[len(ops)])
    report.show()
    assert report.recovered >= 1
    assert report.vulnerabilities == [], "\n".join(report.vulnerabilities[:5])


@pytest.mark.torture
def test_rely_2_1_rely_2_2_torture_ingests_and_folds_interleaved_over_two_days(
        data_dir, tmp_path, monkeypatch, make_config):
    """WHEN three deliveries over two UTC days are ingested, with fold passes in between
    (as the fold thread runs beside ingest), and the machine crashes anywhere in the whole
    log, in every way the weak model allows
    THEN every crash state recovers with the invariants of RELY-2.1 and RELY-2.2."""

    sent = [delivery(1, ("step_count",), DAY, 1, T0,
                     cutoff=DAY + dt.timedelta(minutes=40, seconds=20)),
            delivery(1, ("step_count",), DAY, 1, T0 + dt.timedelta(hours=3)),
            delivery(3, ("heart_rate",), DAY, 1, T0 + dt.timedelta(hours=4))]
    fresh_data_dir(data_dir)

    def steps(recording: Recording) -> None:
        for index, s in enumerate(sent):
            recording.post(s)
            recording.acknowledged(index)
            if index != 1:
                recording.fold_pass()

    base, base_db, ops, acked = record(data_dir, monkeypatch, steps)
    assert len({op.text for op in ops if op.kind == "mkdir"}) == 4  # 2026/11/29, 11/30
    scenario = Scenario("RELY-2.1/2.2 torture", base, base_db, ops, sent, acked,
                        CleanFolds(tmp_path / "refs", sent))
    report = explore(scenario, tmp_path / "states", make_config)
    report.show()
    assert report.vulnerabilities == [], "\n".join(report.vulnerabilities[:5])
