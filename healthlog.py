"""healthlog: a self-hosted store for Apple Health data pushed by Health Auto Export.

Health Auto Export (HAE), an iOS app, POSTs JSON bodies ("deliveries") to a REST
endpoint.  healthlog keeps every delivery forever, byte for byte, and folds them into
a compact, deduplicated store of hourly objects that can be queried and exported.

Threads inside ``healthlog serve``:

* the main thread parses the command line, handles SIGTERM/SIGINT and runs the
  shutdown order: stop accepting HTTP first, then stop the fold thread;
* the Cheroot HTTP server and its worker pool answer ``POST /api/ingest`` and the
  read routes;
* exactly one fold thread turns ``pending`` deliveries into hourly objects, in
  journal order ``(received_at, id)``.

On-disk layout, all under one data directory (``--data``)::

    healthlog.sqlite3   journal (table delivery) + vitrine (table object), WAL mode
    archive/YYYY/MM/DD/<received>-<random>.json        raw bodies, as received
    archive/YYYY/MM/DD/<received>-<random>.meta.json   received_at, HAE headers, path name
    tmp/                in-flight uploads (same filesystem; emptied at start)
    token               the access token, mode 0600
    healthlog.lock      advisory lock: one process serves a data directory

When a 200 is sent: after the body and its metadata are durable in the archive
(temp file, fsync, rename, fsync of the folder) and the ``delivery`` row exists with
status ``pending``.  The fold happens later and never delays the answer.

The archive is the truth; the database is an index that ``reindex`` can rebuild.
Requirements live in ``openspec/specs/*/spec.md``; decisions in
``openspec/decisions.md``.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import errno
import fcntl
import hashlib
import hmac
import json
import logging
import os
import secrets
import signal
import sqlite3
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Optional, Sequence

__version__ = "0.1.0"
__all__ = ["Config", "Service", "main", "__version__"]


# ==============================================================================
# Constants: every tunable number, with the reason for its value.
# ==============================================================================

SCHEMA_VERSION = 1
"""``PRAGMA user_version`` of the database this code writes; a newer one is refused."""

PARSER_VERSION = 1
"""Stamped on each folded delivery; rows folded by an older parser are refolded."""

DEFAULT_PORT = 8765
DEFAULT_HOST = "0.0.0.0"  # the phone must reach it over the LAN
DEFAULT_MAX_BODY_MIB = 256
"""HAE raw-sample weeks reach ~20 MB and manual year exports far more; 256 MiB keeps
one body well inside a Raspberry Pi's memory while it is validated."""

HTTP_THREADS = 16
"""Cheroot holds a worker thread for a whole upload; 16 leaves room for slow uploads
plus the read routes."""

HTTP_TIMEOUT_S = 20.0
"""Server-wide per-socket inactivity timeout.  Only the ingest route widens it, for
itself (ING-8)."""

INGEST_BUDGET_S = 900.0
"""The ingest route's own deadline for reading the body and sending the answer: a
256 MiB body over a 1 MB/s Wi-Fi link still fits."""

BUSY_TIMEOUT_S = 10.0
"""How long a writer waits for SQLite's write lock before it counts as busy."""

FOLD_WAKE_S = 60.0
"""Periodic wake-up of the fold thread, so a delivery left pending is retried even
when the phone is silent for hours (ING-4.5)."""

FOLD_DEADLINE_S = 300.0
STOP_BUDGET_S = 10.0
"""How long shutdown waits for the fold thread; a longer fold stays pending (ING-6)."""

READ_CHUNK = 1 << 20
"""Upload read size: 1 MiB reads run at ~540 MB/s over loopback (stack-notes §1.6)."""

HEADER_LIMIT = 64 * 1024
HEADER_VALUE_MAX = 256
"""HAE's automation headers are short names and UUIDs; anything longer is cut."""

INGEST_NAME_MAX = 64
AUTOMATION_HEADERS = (
    "automation-name",
    "automation-id",
    "automation-aggregation",
    "automation-period",
    "session-id",
)

STATUSES = ("pending", "parsed", "partial", "failed")

DB_NAME = "healthlog.sqlite3"
LOCK_NAME = "healthlog.lock"
TOKEN_NAME = "token"
ARCHIVE_DIR = "archive"
TMP_DIR = "tmp"


# ==============================================================================
# Errors: one tree; HTTP-facing errors carry a status and a stable code.
# ==============================================================================


class HealthlogError(Exception):
    """healthlog failed."""

    def __init__(self, message: Optional[str] = None):
        super().__init__(message or (self.__doc__ or "").strip())

    @property
    def message(self) -> str:
        return str(self.args[0]) if self.args else ""


class ConfigError(HealthlogError):
    """The configuration or the data directory cannot be used."""


class DataDirLocked(ConfigError):
    """Another healthlog process holds the data directory."""


class SchemaTooNew(ConfigError):
    """The database was written by a newer healthlog."""


class HTTPFailure(HealthlogError):
    """The request failed."""

    status = 500
    code = "internal_error"


class Unauthorized(HTTPFailure):
    """Missing or wrong access token."""

    status, code = 401, "unauthorized"


class BadRequest(HTTPFailure):
    """The request is not a valid Health Auto Export JSON delivery."""

    status, code = 400, "bad_request"


class NotFound(HTTPFailure):
    """No such route."""

    status, code = 404, "not_found"


class MethodNotAllowed(HTTPFailure):
    """This route does not accept that method."""

    status, code = 405, "method_not_allowed"


class RequestTimeout(HTTPFailure):
    """The request body did not arrive within the ingest deadline."""

    status, code = 408, "request_timeout"


class PayloadTooLarge(HTTPFailure):
    """The body is larger than the configured limit."""

    status, code = 413, "payload_too_large"


class UnsupportedMediaType(HTTPFailure):
    """healthlog accepts JSON only: set Export Format to JSON in Health Auto Export."""

    status, code = 415, "unsupported_media_type"


class InternalError(HTTPFailure):
    """The server could not store the delivery; it was not accepted."""

    status, code = 500, "internal_error"


class ServiceStopping(HTTPFailure):
    """healthlog is shutting down; try again shortly."""

    status, code = 503, "stopping"


# ==============================================================================
# Config: defaults -> environment -> flags, merged once into a frozen object.
# ==============================================================================


def default_data_dir(environ: Mapping[str, str]) -> Path:
    """``$XDG_DATA_HOME/healthlog``, else ``~/.local/share/healthlog``."""
    base = environ.get("XDG_DATA_HOME") or os.path.join(
        environ.get("HOME") or os.path.expanduser("~"), ".local", "share"
    )
    return Path(base) / "healthlog"


@dataclass(frozen=True)
class Config:
    """Everything a command needs to know; built once, passed explicitly."""

    data_dir: Path
    host: str = DEFAULT_HOST
    port: int = DEFAULT_PORT
    token: Optional[str] = None
    max_body_bytes: int = DEFAULT_MAX_BODY_MIB << 20
    log_format: str = "logfmt"
    log_level: str = "INFO"
    http_threads: int = HTTP_THREADS
    http_timeout_s: float = HTTP_TIMEOUT_S
    ingest_budget_s: float = INGEST_BUDGET_S
    busy_timeout_s: float = BUSY_TIMEOUT_S
    fold_wake_s: float = FOLD_WAKE_S
    fold_deadline_s: float = FOLD_DEADLINE_S
    stop_budget_s: float = STOP_BUDGET_S

    @property
    def db_path(self) -> Path:
        return self.data_dir / DB_NAME

    @property
    def listen(self) -> str:
        return format_address(self.host, self.port)


def parse_listen(text: str) -> tuple:
    """Parse ``HOST:PORT`` (``[::1]:8765``, ``:8765`` for all interfaces)."""
    host, sep, port_text = text.strip().rpartition(":")
    if not sep:
        raise ConfigError("--listen wants HOST:PORT, for example 0.0.0.0:%d" % DEFAULT_PORT)
    host = host.strip("[]") or DEFAULT_HOST
    try:
        port = int(port_text)
    except ValueError:
        raise ConfigError("--listen: port must be a number, got %r" % port_text) from None
    if not 0 <= port <= 65535:
        raise ConfigError("--listen: port must be between 0 and 65535")
    return host, port


def format_address(host: str, port: int) -> str:
    return "[%s]:%d" % (host, port) if ":" in host else "%s:%d" % (host, port)


def _check_token(token: str, origin: str) -> str:
    if not token or token != token.strip() or any(c.isspace() for c in token):
        raise ConfigError("%s: the token must be non-empty and contain no whitespace" % origin)
    return token


def build_config(args: argparse.Namespace, environ: Mapping[str, str]) -> Config:
    """Merge defaults, ``HEALTHLOG_*`` environment variables and flags (flags win)."""
    values: dict = {}
    data = getattr(args, "data", None) or environ.get("HEALTHLOG_DATA")
    values["data_dir"] = Path(data).expanduser() if data else default_data_dir(environ)
    listen = getattr(args, "listen", None) or environ.get("HEALTHLOG_LISTEN")
    if listen:
        values["host"], values["port"] = parse_listen(listen)
    token = getattr(args, "token", None)
    if token is not None:
        values["token"] = _check_token(token, "--token")
    elif environ.get("HEALTHLOG_TOKEN") is not None:
        values["token"] = _check_token(environ["HEALTHLOG_TOKEN"], "HEALTHLOG_TOKEN")
    max_mib = getattr(args, "max_body_mib", None)
    if max_mib is not None:
        if max_mib < 1:
            raise ConfigError("--max-body-mib must be at least 1")
        values["max_body_bytes"] = max_mib << 20
    log_format = getattr(args, "log_format", None) or environ.get("HEALTHLOG_LOG_FORMAT")
    if log_format:
        if log_format not in ("logfmt", "json"):
            raise ConfigError("--log-format must be logfmt or json")
        values["log_format"] = log_format
    log_level = getattr(args, "log_level", None) or environ.get("HEALTHLOG_LOG_LEVEL")
    if log_level:
        if log_level.upper() not in _LEVELS:
            raise ConfigError("--log-level must be one of DEBUG, INFO, WARN, ERROR")
        values["log_level"] = log_level.upper()
    return Config(**values)


# ==============================================================================
# Logging: one record per line on stderr, logfmt or JSON; fields never break a line.
# ==============================================================================

_log = logging.getLogger("healthlog")
_LEVELS = {"DEBUG": logging.DEBUG, "INFO": logging.INFO, "WARN": logging.WARNING,
           "WARNING": logging.WARNING, "ERROR": logging.ERROR}
_LEVEL_NAMES = {logging.DEBUG: "DEBUG", logging.INFO: "INFO", logging.WARNING: "WARN",
                logging.ERROR: "ERROR", logging.CRITICAL: "ERROR"}

# Control characters and Unicode line separators are escaped so that a name taken
# from a foreign body can never split or forge a log line (STO-6).
_ESCAPES = {i: "\\u%04x" % i for i in list(range(0x20)) + [0x7F, 0x85, 0x2028, 0x2029]}
_ESCAPES.update({ord("\\"): "\\\\", ord('"'): '\\"', ord("\n"): "\\n", ord("\r"): "\\r",
                 ord("\t"): "\\t"})


def log_event(level: int, msg: str, **fields: Any) -> None:
    """Write one structured record.  Fields above DEBUG must never carry health data."""
    if _log.isEnabledFor(level):
        _log.log(level, msg, extra={"fields": fields})


def _logfmt_value(value: Any) -> str:
    if value is None:
        return '""'
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if not isinstance(value, str):
        value = json.dumps(value, ensure_ascii=False, separators=(",", ":"))
    escaped = value.translate(_ESCAPES)
    if escaped and escaped == value and not any(c in value for c in ' ="'):
        return value
    return '"%s"' % escaped


def _utc_iso(ts: float) -> str:
    moment = _dt.datetime.fromtimestamp(ts, _dt.timezone.utc)
    return moment.strftime("%Y-%m-%dT%H:%M:%S.") + "%03dZ" % (moment.microsecond // 1000)


class LogfmtFormatter(logging.Formatter):
    """``time=… level=… msg="…" key=value …`` (design.md §11)."""

    def format(self, record: logging.LogRecord) -> str:
        parts = ["time=" + _utc_iso(record.created),
                 "level=" + _LEVEL_NAMES.get(record.levelno, "INFO"),
                 "msg=" + _logfmt_value(record.getMessage())]
        for key, value in _record_fields(record).items():
            if value is not None:
                parts.append("%s=%s" % (key, _logfmt_value(value)))
        return " ".join(parts)


class JSONFormatter(logging.Formatter):
    """The same fields as logfmt, one JSON object per line."""

    def format(self, record: logging.LogRecord) -> str:
        out = {"time": _utc_iso(record.created),
               "level": _LEVEL_NAMES.get(record.levelno, "INFO"),
               "msg": record.getMessage()}
        out.update(_record_fields(record))
        return json.dumps(out, default=str)


def _record_fields(record: logging.LogRecord) -> dict:
    fields = dict(getattr(record, "fields", None) or {})
    if record.name != "healthlog":
        fields.setdefault("logger", record.name)
    if record.exc_info and record.levelno <= logging.DEBUG:
        # Tracebacks may quote values from a body: only DEBUG shows them.
        fields["traceback"] = logging.Formatter().formatException(record.exc_info)
    return fields


def setup_logging(config: Config, stream: Any = None) -> logging.Handler:
    """Send every record of the process to one stderr handler in the chosen format."""
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(JSONFormatter() if config.log_format == "json" else LogfmtFormatter())
    root = logging.getLogger()
    for old in list(root.handlers):
        if getattr(old, "_healthlog", False):
            root.removeHandler(old)
    handler._healthlog = True  # type: ignore[attr-defined]
    root.addHandler(handler)
    root.setLevel(_LEVELS[config.log_level])
    return handler


# ==============================================================================
# Time: the fixed-width UTC text form of received_at (text order = time order).
# ==============================================================================


def utc_now() -> _dt.datetime:
    return _dt.datetime.now(_dt.timezone.utc)


def format_received_at(moment: _dt.datetime) -> str:
    """``YYYY-MM-DDTHH:MM:SS.ffffffZ``: the one format received_at is compared in."""
    return moment.astimezone(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def parse_received_at(text: str) -> _dt.datetime:
    return _dt.datetime.strptime(text, "%Y-%m-%dT%H:%M:%S.%fZ").replace(tzinfo=_dt.timezone.utc)


# ==============================================================================
# Storage: schema, connections, the write transaction, the data-directory lock.
# ==============================================================================

_SCHEMA = """
CREATE TABLE delivery (
    id                     INTEGER PRIMARY KEY,
    received_at            TEXT NOT NULL,
    archive_path           TEXT NOT NULL UNIQUE,
    body_bytes             INTEGER NOT NULL,
    body_sha256            TEXT NOT NULL,
    automation_id          TEXT,
    automation_name        TEXT,
    automation_aggregation TEXT,
    automation_period      TEXT,
    session_id             TEXT,
    path_name              TEXT,
    parse_status           TEXT NOT NULL DEFAULT 'pending'
                           CHECK (parse_status IN ('pending', 'parsed', 'partial', 'failed')),
    uncovered_keys         TEXT NOT NULL DEFAULT '[]',
    layer                  TEXT,
    error                  TEXT,
    folded_at              TEXT,
    parser_version         INTEGER,
    metrics                INTEGER,
    points                 INTEGER,
    bad_points             INTEGER,
    objects_written        INTEGER,
    overwrites             INTEGER,
    incomparable           INTEGER,
    unit_conflicts         INTEGER,
    sealed_changes         INTEGER
);
CREATE INDEX delivery_journal ON delivery (received_at, id);
CREATE INDEX delivery_pending ON delivery (received_at, id) WHERE parse_status = 'pending';

CREATE TABLE object (
    metric           TEXT NOT NULL,
    layer            TEXT NOT NULL,
    hour             INTEGER NOT NULL,
    units            TEXT,
    first_at         INTEGER NOT NULL,
    last_at          INTEGER NOT NULL,
    points           INTEGER NOT NULL,
    delivery_id      INTEGER NOT NULL,
    updated_by       INTEGER NOT NULL,
    hash             TEXT NOT NULL,
    sealed           INTEGER NOT NULL DEFAULT 0,
    blob             BLOB NOT NULL,
    point_deliveries TEXT NOT NULL,
    PRIMARY KEY (metric, layer, hour)
) WITHOUT ROWID;
"""


def connect(path: Path, *, busy_timeout_s: float = BUSY_TIMEOUT_S,
            synchronous: str = "FULL") -> sqlite3.Connection:
    """Open a connection with every pragma set; WAL must really be on.

    ``synchronous`` is per connection: FULL where a commit backs an HTTP 200,
    NORMAL where the result can be rebuilt from the archive (stack-notes §4.2).
    """
    conn = sqlite3.connect(str(path), timeout=busy_timeout_s, isolation_level=None,
                           check_same_thread=False)
    try:
        mode = conn.execute("PRAGMA journal_mode=WAL").fetchone()[0]
        if str(mode).lower() != "wal":
            raise ConfigError("%s: SQLite refused WAL mode (is the data directory on a "
                              "network filesystem?)" % path)
        conn.execute("PRAGMA synchronous=%s" % ("FULL" if synchronous == "FULL" else "NORMAL"))
        conn.execute("PRAGMA foreign_keys=ON")
    except BaseException:
        conn.close()
        raise
    return conn


def is_busy(exc: BaseException) -> bool:
    """True when SQLite gave up waiting for a lock (SQLITE_BUSY and its variants)."""
    code = getattr(exc, "sqlite_errorcode", None)
    if code is not None:
        return (code & 0xFF) == 5
    return isinstance(exc, sqlite3.OperationalError) and "database is locked" in str(exc)


@contextlib.contextmanager
def write_txn(conn: sqlite3.Connection) -> Iterator[sqlite3.Connection]:
    """``BEGIN IMMEDIATE`` … ``COMMIT``; rolled back on any exception.

    IMMEDIATE takes the write lock up front, so the busy timeout is honoured instead
    of failing at once on a read-to-write upgrade (stack-notes §4.4).
    """
    conn.execute("BEGIN IMMEDIATE")
    try:
        yield conn
    except BaseException:
        with contextlib.suppress(sqlite3.Error):
            conn.execute("ROLLBACK")
        raise
    conn.execute("COMMIT")


def migrate(conn: sqlite3.Connection, path: Path) -> None:
    """Create the schema on an empty database; refuse one written by a newer version."""
    version = conn.execute("PRAGMA user_version").fetchone()[0]
    if version > SCHEMA_VERSION:
        raise SchemaTooNew(
            "%s has schema version %d, but this healthlog %s understands up to version %d;"
            " run a newer healthlog" % (path, version, __version__, SCHEMA_VERSION))
    if version == SCHEMA_VERSION:
        return
    with write_txn(conn):
        for statement in _SCHEMA.split(";"):
            if statement.strip():
                conn.execute(statement)
        conn.execute("PRAGMA user_version=%d" % SCHEMA_VERSION)


def open_database(config: Config, *, create: bool = True,
                  synchronous: str = "FULL") -> sqlite3.Connection:
    """Open (and on first use create) the database of a data directory."""
    path = config.db_path
    if not create and not path.exists():
        raise ConfigError("no healthlog database at %s (has `healthlog serve` run there?)"
                          % config.data_dir)
    try:
        conn = connect(path, busy_timeout_s=config.busy_timeout_s, synchronous=synchronous)
    except sqlite3.Error as exc:
        raise ConfigError("cannot open %s: %s" % (path, exc)) from None
    try:
        migrate(conn, path)
    except BaseException:
        conn.close()
        raise
    return conn


class ConnectionPool:
    """One connection per thread, opened lazily, all closed together at the end."""

    def __init__(self, config: Config, synchronous: str = "FULL"):
        self._config = config
        self._synchronous = synchronous
        self._local = threading.local()
        self._all: list = []
        self._lock = threading.Lock()

    def get(self) -> sqlite3.Connection:
        conn = getattr(self._local, "conn", None)
        if conn is None:
            conn = connect(self._config.db_path, busy_timeout_s=self._config.busy_timeout_s,
                           synchronous=self._synchronous)
            self._local.conn = conn
            with self._lock:
                self._all.append(conn)
        return conn

    def close(self) -> None:
        with self._lock:
            conns, self._all = self._all, []
        for conn in conns:
            with contextlib.suppress(sqlite3.Error):
                conn.close()


class DataDirLock:
    """An advisory ``flock`` on ``DATA/healthlog.lock``: serve and reindex never share."""

    def __init__(self, data_dir: Path):
        self.path = data_dir / LOCK_NAME
        self._fd: Optional[int] = None

    def acquire(self, purpose: str) -> None:
        fd = os.open(str(self.path), os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            os.close(fd)
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise DataDirLocked("%s is in use by another healthlog process (lock %s held)"
                                    % (self.path.parent, self.path)) from None
            raise
        os.ftruncate(fd, 0)
        os.write(fd, ("%d %s\n" % (os.getpid(), purpose)).encode())
        self._fd = fd

    def held_by_other(self) -> bool:
        """True when another process holds the lock (this one does not take it)."""
        try:
            fd = os.open(str(self.path), os.O_RDONLY)
        except FileNotFoundError:
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError:
            return True
        finally:
            os.close(fd)
        return False

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def ensure_data_dir(path: Path) -> None:
    """Create the data directory (mode 0700: it holds health data) and its folders."""
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        (path / ARCHIVE_DIR).mkdir(mode=0o700, exist_ok=True)
        (path / TMP_DIR).mkdir(mode=0o700, exist_ok=True)
    except OSError as exc:
        raise ConfigError("cannot create data directory %s: %s" % (path, exc.strerror)) from None
    if not os.access(str(path), os.W_OK):
        raise ConfigError("data directory %s is not writable" % path)


def resolve_token(config: Config, announce: Callable[[str], None]) -> str:
    """The token from the config, else ``DATA/token``, else a new one written there.

    A new token is announced once (with the Health Auto Export setup hint), never
    logged.
    """
    if config.token:
        return config.token
    path = config.data_dir / TOKEN_NAME
    try:
        text = path.read_text(encoding="utf-8").strip()
    except FileNotFoundError:
        text = None
    except OSError as exc:
        raise ConfigError("cannot read %s: %s" % (path, exc.strerror)) from None
    if text is not None:
        return _check_token(text, str(path))
    token = secrets.token_urlsafe(32)
    write_durable(path, (token + "\n").encode(), mode=0o600)
    announce(token)
    return token


def count_pending(conn: sqlite3.Connection) -> int:
    return conn.execute(
        "SELECT count(*) FROM delivery WHERE parse_status = 'pending'").fetchone()[0]


def fingerprint(conn: sqlite3.Connection) -> str:
    """SHA-256 over the sorted (metric, layer, hour, hash) of every object.

    The one definition used by status, reindex and verify.
    """
    digest = hashlib.sha256()
    rows = conn.execute("SELECT metric, layer, hour, hash FROM object ORDER BY metric, layer, hour")
    for metric, layer, hour, object_hash in rows:
        digest.update(("%s\x1f%s\x1f%d\x1f%s\n" % (metric, layer, hour, object_hash)).encode())
    return digest.hexdigest()


# ==============================================================================
# Archive: raw bodies and their metadata, written durably before any row exists.
# ==============================================================================


def fsync_dir(path: Path) -> None:
    fd = os.open(str(path), os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def makedirs_durable(path: Path) -> None:
    """``mkdir -p`` that fsyncs each parent whose entries it changed."""
    missing = []
    probe = path
    while not probe.exists():
        missing.append(probe)
        probe = probe.parent
    for directory in reversed(missing):
        with contextlib.suppress(FileExistsError):
            directory.mkdir(mode=0o700)
        fsync_dir(directory.parent)


def write_durable(path: Path, data: bytes, mode: int = 0o600) -> None:
    """Temp file beside ``path``, fsync, rename, fsync the folder."""
    tmp = path.with_name(".%s.%s.tmp" % (path.name, secrets.token_hex(4)))
    fd = os.open(str(tmp), os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(str(tmp), str(path))
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(str(tmp))
        raise
    fsync_dir(path.parent)


@dataclass
class Upload:
    """A body received into ``DATA/tmp``: durable on disk, not yet in the archive."""

    tmp_path: Path
    size: int
    sha256: str

    def discard(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.tmp_path.unlink()


class Archive:
    """The raw archive under ``DATA/archive``, and the upload area ``DATA/tmp``."""

    def __init__(self, data_dir: Path):
        self.data_dir = data_dir
        self.root = data_dir / ARCHIVE_DIR
        self.tmp = data_dir / TMP_DIR

    def clear_tmp(self) -> int:
        """Remove uploads left by a process that died mid-request (none was acknowledged)."""
        removed = 0
        for entry in self.tmp.iterdir():
            with contextlib.suppress(OSError):
                entry.unlink()
                removed += 1
        return removed

    @staticmethod
    def names(received_at: _dt.datetime) -> tuple:
        """(relative folder, file stem) for a delivery received at that instant.

        The stem is the basic ISO form ``20261129T210321.123456Z``: colons in file
        names break copies to SMB shares and Windows backups.
        """
        moment = received_at.astimezone(_dt.timezone.utc)
        folder = "%s/%04d/%02d/%02d" % (ARCHIVE_DIR, moment.year, moment.month, moment.day)
        stem = moment.strftime("%Y%m%dT%H%M%S.%fZ") + "-" + secrets.token_hex(4)
        return folder, stem

    def receive(self, read: Callable[[int], bytes], length: Optional[int], limit: int,
                before_read: Callable[[], None]) -> Upload:
        """Stream a body into ``DATA/tmp`` in chunks, hashing it; fsync at the end.

        ``length`` is the Content-Length (None for chunked bodies).  Raises
        PayloadTooLarge past ``limit`` and BadRequest when the body ends early.
        """
        tmp_path = self.tmp / ("upload-%s.part" % secrets.token_hex(8))
        digest = hashlib.sha256()
        size = 0
        fd = os.open(str(tmp_path), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            with os.fdopen(fd, "wb") as handle:
                while length is None or size < length:
                    want = READ_CHUNK if length is None else min(READ_CHUNK, length - size)
                    before_read()
                    chunk = read(want)
                    if not chunk:
                        break
                    size += len(chunk)
                    if size > limit:
                        raise PayloadTooLarge("the body is larger than %d MiB (the limit set "
                                              "with --max-body-mib)" % (limit >> 20))
                    digest.update(chunk)
                    handle.write(chunk)
                if length is not None and size != length:
                    raise BadRequest("the body ended after %d of %d bytes" % (size, length))
                handle.flush()
                os.fsync(handle.fileno())
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                tmp_path.unlink()
            raise
        return Upload(tmp_path, size, digest.hexdigest())

    def commit(self, upload: Upload, received_at: _dt.datetime, meta: dict) -> str:
        """Write ``.meta.json`` durably, then move the body in: its rename commits.

        Returns the body's path relative to the data directory.
        """
        folder, stem = self.names(received_at)
        target_dir = self.data_dir / folder
        makedirs_durable(target_dir)
        meta_bytes = json.dumps(meta, ensure_ascii=False, sort_keys=True, indent=1).encode()
        write_durable(target_dir / (stem + ".meta.json"), meta_bytes + b"\n", mode=0o600)
        os.replace(str(upload.tmp_path), str(target_dir / (stem + ".json")))
        fsync_dir(target_dir)
        return "%s/%s.json" % (folder, stem)


_VALID_OBJECT = object()


def _reject_constant(name: str) -> Any:
    raise ValueError("%s is not valid JSON" % name)


def check_delivery_shape(path: Path) -> None:
    """Validate a whole body as HAE JSON without building the document.

    Every byte is checked by the JSON scanner, but each object collapses into one
    shared sentinel as soon as it is parsed, so memory stays near the body's own size.
    Requires: UTF-8, a top-level object whose ``data`` is an object.  NaN and
    Infinity are refused (they are not JSON, and orjson would refuse them later).
    """
    last_pairs: list = []

    def collapse(pairs: list) -> object:
        last_pairs[:] = [pairs]
        return _VALID_OBJECT

    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError:
        raise BadRequest("the body is not UTF-8 text") from None
    try:
        top = json.loads(text, object_pairs_hook=collapse, parse_constant=_reject_constant)
    except (ValueError, RecursionError):
        raise BadRequest("the body is not valid JSON") from None
    finally:
        del text
    if top is not _VALID_OBJECT or not last_pairs:
        raise BadRequest("the body must be a JSON object with a \"data\" object")
    data = [value for key, value in last_pairs[0] if key == "data"]
    if not data or data[-1] is not _VALID_OBJECT:
        raise BadRequest("the body must be a JSON object with a \"data\" object")


# ==============================================================================
# Fold worker: the one thread that folds pending deliveries in journal order.
# ==============================================================================


class FoldWorker:
    """Owns the fold thread: ``start()``, ``wake()``, idempotent ``stop(timeout)``.

    The fold itself arrives with the fold capability; until then a pass only looks
    at the backlog, and every delivery stays ``pending`` (ING-2), which is the
    honest state: nothing has folded it yet.
    """

    def __init__(self, config: Config):
        self._config = config
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self.state = "starting"

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="healthlog-fold", daemon=True)
        self._thread.start()

    def wake(self) -> None:
        """Ask for a pass soon; losing a wake-up loses nothing (the row is pending)."""
        self._wake.set()

    def stop(self, timeout: float) -> bool:
        """Ask the thread to stop between deliveries; True when it ended in time."""
        self._stop.set()
        self._wake.set()
        if self._thread is None:
            return True
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def _run(self) -> None:
        conn = None
        try:
            conn = connect(self._config.db_path, busy_timeout_s=self._config.busy_timeout_s,
                           synchronous="NORMAL")
            backlog = count_pending(conn)
            if backlog:
                log_event(logging.INFO, "deliveries waiting to be folded", backlog=backlog)
            while not self._stop.is_set():
                self.state = "idle"
                self._wake.wait(self._config.fold_wake_s)
                self._wake.clear()
                if self._stop.is_set():
                    break
                self.state = "folding"
                try:
                    self.run_pass(conn)
                except Exception as exc:  # the loop survives a failed pass (ING-4)
                    log_event(logging.ERROR, "fold pass failed", error=type(exc).__name__)
                    log_event(logging.DEBUG, "fold pass failure detail", detail=repr(exc))
        except Exception as exc:
            log_event(logging.ERROR, "fold thread cannot start", error=type(exc).__name__)
        finally:
            self.state = "stopped"
            if conn is not None:
                conn.close()
            log_event(logging.INFO, "fold thread stopped")

    def run_pass(self, conn: sqlite3.Connection) -> int:
        """One pass over the pending deliveries; returns how many were folded."""
        return 0


# ==============================================================================
# HTTP app: ingest, health, one JSON error shape, an access log without bodies.
# ==============================================================================

ENV_REQUEST = "healthlog.cheroot_request"
ENV_RECEIVED = "healthlog.received_at"


def error_body(status: int, code: str, message: str) -> bytes:
    """The one JSON error shape of every HTTP error; never echoes request content."""
    return json.dumps({"error": {"status": status, "code": code, "message": message}}).encode()


def _json_bytes(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


def _header(environ: Mapping[str, Any], name: str) -> Optional[str]:
    """A request header as text: WSGI hands out latin-1; HAE sends UTF-8 names."""
    value = environ.get("HTTP_" + name.upper().replace("-", "_"))
    if value is None:
        return None
    try:
        value = value.encode("latin-1").decode("utf-8")
    except (UnicodeEncodeError, UnicodeDecodeError):
        pass
    return value.strip()[:HEADER_VALUE_MAX]


def _close_connection(environ: Mapping[str, Any]) -> None:
    """Close after answering, so Cheroot never drains an unread body into memory."""
    request = environ.get(ENV_REQUEST)
    if request is not None:
        request.close_connection = True


def _has_body(environ: Mapping[str, Any]) -> bool:
    length = environ.get("CONTENT_LENGTH")
    return bool(length and length != "0") or "chunked" in environ.get(
        "HTTP_TRANSFER_ENCODING", "").lower()


def _valid_name(name: str) -> bool:
    return 0 < len(name) <= INGEST_NAME_MAX and all(
        c.isascii() and (c.isalnum() or c in "._-") for c in name)


class App:
    """The WSGI application: bottle routes inside an access-log and error boundary."""

    def __init__(self, service: "Service"):
        import bottle

        self.service = service
        self.config = service.config
        self._token = b""
        self.bottle = bottle.Bottle()
        self.bottle.config["catchall"] = False
        self.bottle.route("/api/ingest", "POST", self.ingest)
        self.bottle.route("/api/ingest/<name>", "POST", self.ingest)
        self.bottle.route("/healthz", "GET", self.healthz)

    def set_token(self, token: str) -> None:
        self._token = token.encode()

    # -- WSGI entry ---------------------------------------------------------

    def __call__(self, environ: dict, start_response: Callable) -> list:
        import bottle

        started = time.monotonic()
        environ[ENV_RECEIVED] = utc_now()
        status = "500 Internal Server Error"
        try:
            status, headers, body = self._dispatch(environ)
        except HTTPFailure as exc:
            status, headers, body = self._failure(environ, exc)
        except bottle.HTTPResponse as exc:  # not expected: routes return tuples
            status, headers, body = exc.status_line, list(exc.headerlist), b""
        except Exception as exc:  # the boundary: log the class, answer one JSON 500
            log_event(logging.ERROR, "request failed", error=type(exc).__name__,
                      path=environ.get("PATH_INFO", ""))
            log_event(logging.DEBUG, "request failure detail", detail=repr(exc))
            status, headers, body = self._failure(environ, InternalError())
        start_response(status, headers)
        path = environ.get("PATH_INFO", "")
        log_event(logging.DEBUG if path == "/healthz" else logging.INFO, "http request",
                  method=environ.get("REQUEST_METHOD", ""), path=path,
                  status=int(status.split(" ", 1)[0]),
                  bytes_in=int(environ.get("CONTENT_LENGTH") or 0) or None,
                  bytes_out=len(body), ms=round((time.monotonic() - started) * 1000, 1))
        return [body]

    def _dispatch(self, environ: dict) -> tuple:
        import bottle

        try:
            route, args = self.bottle.router.match(environ)
        except bottle.HTTPError as exc:
            if exc.status_code == 405:
                raise MethodNotAllowed() from None
            raise NotFound() from None
        if _has_body(environ) and not route.rule.startswith("/api/ingest"):
            _close_connection(environ)  # only ingest reads a body
        return route.callback(environ, **args)

    def _failure(self, environ: dict, exc: HTTPFailure) -> tuple:
        if _has_body(environ):
            _close_connection(environ)
        body = error_body(exc.status, exc.code, exc.message)
        return ("%d %s" % (exc.status, _REASONS.get(exc.status, "Error")),
                [("Content-Type", "application/json"), ("Content-Length", str(len(body)))],
                body)

    def _ok(self, obj: Any) -> tuple:
        body = _json_bytes(obj)
        return ("200 OK", [("Content-Type", "application/json"),
                           ("Content-Length", str(len(body))),
                           ("Cache-Control", "no-store")], body)

    # -- authentication -----------------------------------------------------

    def authenticate(self, environ: Mapping[str, Any]) -> None:
        """Bearer token or X-API-Key, compared in constant time."""
        offered = None
        authorization = environ.get("HTTP_AUTHORIZATION", "")
        scheme, _, credentials = authorization.partition(" ")
        if scheme.lower() == "bearer" and credentials.strip():
            offered = credentials.strip()
        elif environ.get("HTTP_X_API_KEY"):
            offered = environ["HTTP_X_API_KEY"].strip()
        if offered is None or not self._token or not hmac.compare_digest(
                offered.encode("latin-1", "replace"), self._token):
            raise Unauthorized()

    # -- routes -------------------------------------------------------------

    def healthz(self, environ: dict) -> tuple:
        """GET /healthz: liveness, backlog size and worker state; no token, no health data."""
        return self._ok({
            "status": "stopping" if self.service.stopping else "ok",
            "version": __version__,
            "backlog": count_pending(self.service.pool.get()),
            "worker": self.service.worker.state,
        })

    def ingest(self, environ: dict, name: Optional[str] = None) -> tuple:
        """POST /api/ingest[/<name>]: archive durably, journal as pending, answer 200."""
        received_at = environ[ENV_RECEIVED]
        if self.service.stopping:
            raise ServiceStopping()
        self.authenticate(environ)
        if name is not None and not _valid_name(name):
            raise BadRequest("the ingest name may use letters, digits, '.', '_' and '-' "
                             "(at most %d)" % INGEST_NAME_MAX)
        content_type = environ.get("CONTENT_TYPE", "").lower()
        if content_type.startswith(("multipart/", "text/csv", "application/csv")):
            raise UnsupportedMediaType()
        length = self._content_length(environ)
        upload = self._receive(environ, length)
        try:
            check_delivery_shape(upload.tmp_path)
            headers = {h: _header(environ, h) for h in AUTOMATION_HEADERS}
            meta = {
                "received_at": format_received_at(received_at),
                "headers": {h: v for h, v in headers.items() if v is not None},
                "path_name": name,
                "content_type": environ.get("CONTENT_TYPE") or None,
                "body_bytes": upload.size,
                "body_sha256": upload.sha256,
                "healthlog_version": __version__,
            }
            archive_path = self._commit(upload, received_at, meta)
        except BaseException:
            upload.discard()
            raise
        delivery_id = self.service.record_delivery(received_at, archive_path, upload, headers,
                                                   name)
        self.service.worker.wake()
        return self._ok({"delivery_id": delivery_id, "status": "pending"})

    def _content_length(self, environ: Mapping[str, Any]) -> Optional[int]:
        text = environ.get("CONTENT_LENGTH")
        if not text:
            if "chunked" in environ.get("HTTP_TRANSFER_ENCODING", "").lower():
                return None
            raise BadRequest("the request has no body")
        try:
            length = int(text)
        except ValueError:
            raise BadRequest("Content-Length is not a number") from None
        if length > self.config.max_body_bytes:
            raise PayloadTooLarge("the body is larger than %d MiB (the limit set with "
                                  "--max-body-mib)" % (self.config.max_body_bytes >> 20))
        if length == 0:
            raise BadRequest("the request has no body")
        return length

    def _receive(self, environ: dict, length: Optional[int]) -> Upload:
        """Read the body under the route's own deadline (ING-8)."""
        deadline = time.monotonic() + self.config.ingest_budget_s
        sock = _request_socket(environ)

        def before_read() -> None:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise RequestTimeout()
            if sock is not None:
                try:
                    sock.settimeout(remaining)
                except OSError as exc:  # a transport without deadlines is no failure
                    log_event(logging.DEBUG, "cannot set the ingest deadline",
                              error=type(exc).__name__)

        stream = environ["wsgi.input"]
        try:
            return self.service.archive.receive(stream.read, length, self.config.max_body_bytes,
                                                before_read)
        except HTTPFailure:
            raise
        except OSError as exc:  # includes socket timeouts and resets
            if _is_timeout(exc):
                raise RequestTimeout() from None
            log_event(logging.INFO, "upload interrupted", error=type(exc).__name__)
            raise BadRequest("the body could not be read to its end") from None
        except ValueError:  # malformed chunked coding
            raise BadRequest("the chunked body is malformed") from None

    def _commit(self, upload: Upload, received_at: _dt.datetime, meta: dict) -> str:
        try:
            return self.service.archive.commit(upload, received_at, meta)
        except OSError as exc:
            log_event(logging.ERROR, "archive write failed: delivery refused",
                      error=type(exc).__name__, errno=exc.errno)
            raise InternalError() from None


_REASONS = {200: "OK", 400: "Bad Request", 401: "Unauthorized", 404: "Not Found",
            405: "Method Not Allowed", 408: "Request Timeout", 413: "Payload Too Large",
            415: "Unsupported Media Type", 500: "Internal Server Error",
            503: "Service Unavailable"}


def _is_timeout(exc: BaseException) -> bool:
    import socket

    return isinstance(exc, socket.timeout) or "timed out" in str(exc)


def _request_socket(environ: Mapping[str, Any]) -> Any:
    request = environ.get(ENV_REQUEST)
    try:
        return request.conn.socket
    except AttributeError:
        return None


# ==============================================================================
# Server lifecycle: the Service owns lock, database, worker and Cheroot server.
# ==============================================================================


def _make_server_classes() -> tuple:
    """Cheroot subclasses: a gateway exposing the request, errors routed to logging."""
    from cheroot import wsgi

    class Gateway(wsgi.Gateway_10):
        """Puts Cheroot's request in environ and restores the socket timeout afterwards.

        The ingest route widens the timeout of its own socket only; restoring it after
        the answer has been written keeps the next request on a kept-alive connection
        under the server-wide timeout (ING-8.2).
        """

        def get_environ(self) -> dict:
            environ = super().get_environ()
            environ[ENV_REQUEST] = self.req
            return environ

        def respond(self) -> None:
            try:
                super().respond()
            finally:
                with contextlib.suppress(OSError, AttributeError):
                    self.req.conn.socket.settimeout(self.req.server.timeout)

    class Server(wsgi.Server):
        def error_log(self, msg: str = "", level: int = 20, traceback: bool = False) -> None:
            log_event(max(level, logging.WARNING) if traceback else level,
                      "http server: " + str(msg)[:200])
            if traceback:
                _log.debug("http server traceback", exc_info=True)

    return Gateway, Server


class Service:
    """``healthlog serve`` as an object: ``start()``, ``address``, ordered ``stop()``."""

    def __init__(self, config: Config, announce: Optional[Callable[[str], None]] = None):
        self.config = config
        self.announce = announce or (lambda token: print_token_hint(config, token))
        self.lock = DataDirLock(config.data_dir)
        self.archive = Archive(config.data_dir)
        self.pool = ConnectionPool(config, synchronous="FULL")
        self.worker = FoldWorker(config)
        self.app = App(self)
        self.server: Any = None
        self.stopping = False
        self._serve_thread: Optional[threading.Thread] = None
        self.failed = threading.Event()

    @property
    def address(self) -> tuple:
        return self.server.bind_addr[:2]

    def start(self) -> None:
        ensure_data_dir(self.config.data_dir)
        self.lock.acquire("serve")
        try:
            open_database(self.config).close()
            self.app.set_token(resolve_token(self.config, self.announce))
            self.archive.clear_tmp()
            self.worker.start()
            self._start_http()
        except BaseException:
            self.worker.stop(0)
            self.pool.close()
            self.lock.release()
            raise
        host, port = self.address
        log_event(logging.INFO, "serving", listen=format_address(host, port),
                  data=str(self.config.data_dir), version=__version__)

    def _start_http(self) -> None:
        gateway, server_class = _make_server_classes()
        server = server_class((self.config.host, self.config.port), self.app,
                              numthreads=self.config.http_threads,
                              timeout=self.config.http_timeout_s,
                              shutdown_timeout=self.config.stop_budget_s,
                              server_name="healthlog")
        server.gateway = gateway
        server.max_request_header_size = HEADER_LIMIT
        server.max_request_body_size = 0  # the ingest route enforces its own limit
        try:
            server.prepare()
        except OSError as exc:
            raise ConfigError("cannot listen on %s: %s" % (self.config.listen,
                                                           exc.strerror or exc)) from None
        self.server = server
        self._serve_thread = threading.Thread(target=self._serve, name="healthlog-http")
        self._serve_thread.start()

    def _serve(self) -> None:
        try:
            self.server.serve()
        except Exception as exc:
            log_event(logging.ERROR, "http server stopped unexpectedly", error=type(exc).__name__)
            self.failed.set()

    def record_delivery(self, received_at: _dt.datetime, archive_path: str, upload: Upload,
                        headers: Mapping[str, Optional[str]], name: Optional[str]) -> int:
        """Insert the ``pending`` row; on failure log ERROR naming the orphan (ING-9)."""
        try:
            conn = self.pool.get()
            with write_txn(conn):
                cursor = conn.execute(
                    "INSERT INTO delivery (received_at, archive_path, body_bytes, body_sha256,"
                    " automation_id, automation_name, automation_aggregation,"
                    " automation_period, session_id, path_name)"
                    " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                    (format_received_at(received_at), archive_path, upload.size, upload.sha256,
                     headers.get("automation-id"), headers.get("automation-name"),
                     headers.get("automation-aggregation"), headers.get("automation-period"),
                     headers.get("session-id"), name))
                return int(cursor.lastrowid)
        except sqlite3.Error as exc:
            log_event(logging.ERROR,
                      "delivery row not written: the body is an orphan in the archive until"
                      " `healthlog reindex` adopts it",
                      archive_path=archive_path, busy=is_busy(exc), error=type(exc).__name__)
            raise InternalError() from None

    def stop(self) -> bool:
        """Stop HTTP first, then the fold thread within its budget (ING-6).

        Returns True when the fold thread ended in time; not finishing is a WARN,
        never an error: its delivery simply stays pending.
        """
        self.stopping = True
        if self.server is not None:
            self.server.stop()
            if self._serve_thread is not None:
                self._serve_thread.join(self.config.stop_budget_s)
            log_event(logging.INFO, "http stopped")
        finished = self.worker.stop(self.config.stop_budget_s)
        if not finished:
            log_event(logging.WARNING, "fold thread did not stop within the budget; its"
                      " delivery stays pending and is folded after the next start",
                      budget_s=self.config.stop_budget_s)
        self.pool.close()
        self.lock.release()
        return finished


def print_token_hint(config: Config, token: str) -> None:
    """Show a newly created token once, with what to type into Health Auto Export."""
    host = config.host if config.host not in ("0.0.0.0", "::", "") else "<this-machine>"
    print("healthlog: created an access token in %s (keep it secret; it is shown once)\n"
          "\n"
          "In Health Auto Export, add an automation of type REST API:\n"
          "  URL:            http://%s/api/ingest\n"
          "  Headers:        Authorization: Bearer %s\n"
          "  Export Format:  JSON    (one time grouping per automation)\n"
          % (config.data_dir / TOKEN_NAME, format_address(host, config.port), token),
          flush=True)


def run_serve(config: Config) -> int:
    """Run until SIGTERM/SIGINT; exit 0 after the ordered shutdown."""
    service = Service(config)
    stop = threading.Event()

    def on_signal(signum: int, _frame: Any) -> None:
        log_event(logging.INFO, "stop requested", signal=signal.Signals(signum).name)
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    service.start()
    while not stop.is_set() and not service.failed.is_set():
        stop.wait(0.5)
    finished = service.stop()
    log_event(logging.INFO, "stopped")
    if not finished:
        # The fold thread is a daemon mid-transaction: exiting now rolls its work back,
        # which is the defined state (the delivery stays pending).
        logging.shutdown()
        os._exit(1 if service.failed.is_set() else 0)
    return 1 if service.failed.is_set() else 0


# ==============================================================================
# Status: what the journal and the vitrine hold, readable while serve runs.
# ==============================================================================


def collect_status(config: Config) -> dict:
    conn = open_database(config, create=False, synchronous="NORMAL")
    try:
        counts = dict.fromkeys(STATUSES, 0)
        for status, count in conn.execute(
                "SELECT parse_status, count(*) FROM delivery GROUP BY parse_status"):
            counts[status] = count
        oldest = conn.execute("SELECT min(received_at) FROM delivery"
                              " WHERE parse_status = 'pending'").fetchone()[0]
        last = conn.execute("SELECT max(received_at) FROM delivery").fetchone()[0]
        objects, points = conn.execute(
            "SELECT count(*), coalesce(sum(points), 0) FROM object").fetchone()
        fp = fingerprint(conn)
    finally:
        conn.close()
    archive_files = archive_bytes = 0
    for folder, _dirs, files in os.walk(str(config.data_dir / ARCHIVE_DIR)):
        for name in files:
            if name.endswith(".json") and not name.endswith(".meta.json"):
                archive_files += 1
                with contextlib.suppress(OSError):
                    archive_bytes += os.stat(os.path.join(folder, name)).st_size
    db_bytes = sum(p.stat().st_size for p in config.data_dir.glob(DB_NAME + "*") if p.is_file())
    oldest_age = None
    if oldest:
        oldest_age = round((utc_now() - parse_received_at(oldest)).total_seconds(), 1)
    return {
        "data": str(config.data_dir),
        "deliveries": counts,
        "backlog": counts["pending"],
        "oldest_pending": oldest,
        "oldest_pending_age_s": oldest_age,
        "last_delivery": last,
        "objects": objects,
        "points": points,
        "archive_files": archive_files,
        "archive_bytes": archive_bytes,
        "database_bytes": db_bytes,
        "fingerprint": fp,
    }


def format_status(status: dict) -> str:
    counts = status["deliveries"]
    age = status["oldest_pending_age_s"]
    lines = [
        "data: %s" % status["data"],
        "deliveries: %d (%s)" % (sum(counts.values()),
                                 ", ".join("%s %d" % item for item in counts.items())),
        "backlog: %d%s" % (status["backlog"],
                           "" if age is None else " (oldest pending %s ago)" % _duration(age)),
        "last delivery: %s" % (status["last_delivery"] or "none"),
        "objects: %d" % status["objects"],
        "points: %d" % status["points"],
        "archive: %d bodies, %s" % (status["archive_files"], _size(status["archive_bytes"])),
        "database: %s" % _size(status["database_bytes"]),
        "fingerprint: %s" % status["fingerprint"],
    ]
    return "\n".join(lines)


def _duration(seconds: float) -> str:
    seconds = int(seconds)
    if seconds < 120:
        return "%ds" % seconds
    if seconds < 7200:
        return "%dm%02ds" % divmod(seconds, 60)
    return "%dh%02dm" % (seconds // 3600, seconds % 3600 // 60)


def _size(count: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if count < 1024 or unit == "GiB":
            return ("%d %s" % (count, unit)) if unit == "B" else ("%.1f %s" % (count, unit))
        count /= 1024.0
    return str(count)


# ==============================================================================
# CLI: subcommands, one-line errors, exit codes 0 / 1 / 2.
# ==============================================================================


class _Parser(argparse.ArgumentParser):
    """argparse with a one-line error (exit 2) instead of the usage block."""

    def error(self, message: str) -> None:  # type: ignore[override]
        sys.stderr.write("%s: error: %s (see --help)\n" % (self.prog, message))
        raise SystemExit(2)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="healthlog", description="Self-hosted store for Apple Health "
                     "data pushed by Health Auto Export.")
    parser.add_argument("--version", action="version", version="healthlog " + __version__)
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)

    def data_option(sub: argparse.ArgumentParser) -> None:
        sub.add_argument("--data", metavar="DIR",
                         help="data directory (env HEALTHLOG_DATA; default "
                              "$XDG_DATA_HOME/healthlog or ~/.local/share/healthlog)")
        sub.add_argument("--log-format", choices=("logfmt", "json"),
                         help="log record format on stderr (env HEALTHLOG_LOG_FORMAT)")
        sub.add_argument("--log-level", choices=("DEBUG", "INFO", "WARN", "ERROR"),
                         type=str.upper, help="lowest level logged (default INFO)")

    serve = commands.add_parser("serve", help="receive deliveries over HTTP and fold them")
    data_option(serve)
    serve.add_argument("--listen", metavar="HOST:PORT",
                       help="address to listen on (env HEALTHLOG_LISTEN; default 0.0.0.0:%d)"
                            % DEFAULT_PORT)
    serve.add_argument("--token", help="access token (env HEALTHLOG_TOKEN; default: DATA/token,"
                                       " created on first start)")
    serve.add_argument("--max-body-mib", type=int, metavar="N",
                       help="largest accepted body in MiB (default %d)" % DEFAULT_MAX_BODY_MIB)

    status = commands.add_parser("status", help="journal and store summary")
    data_option(status)
    status.add_argument("--json", action="store_true", help="print JSON")
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point: ``healthlog COMMAND [options]``; returns the exit code."""
    args = build_parser().parse_args(argv)
    if not args.command:
        build_parser().print_help(sys.stderr)
        return 2
    try:
        config = build_config(args, os.environ)
        setup_logging(config)
        if args.command == "serve":
            return run_serve(config)
        if args.command == "status":
            status = collect_status(config)
            print(json.dumps(status, indent=1) if args.json else format_status(status))
            return 0
    except ConfigError as exc:
        sys.stderr.write("healthlog: %s\n" % exc.message)
        return 2
    except KeyboardInterrupt:
        return 130
    return 2


if __name__ == "__main__":
    sys.exit(main())
