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
  journal order ``(received_at, id)``;
* with ``--notify URL``, one notifier thread judges freshness every minute and posts a
  notice when an automation turns late or a metric stale, and when it is back.

On-disk layout, all under one data directory (``--data``)::

    healthlog.sqlite3   journal (table delivery) + vitrine (table object) + sign-in
                        sessions (table session), WAL mode
    archive/YYYY/MM/DD/<received>-<random>.json        raw bodies, as received
    archive/YYYY/MM/DD/<received>-<random>.meta.json   received_at, HAE headers, path name
    tmp/                in-flight uploads, rebuild scratch, spooled replies, a large
                        fold's rows (same filesystem; emptied at start but for a running
                        command's folder)
    token               the access token, mode 0600
    healthlog.lock      advisory lock: one process serves a data directory

When a 200 is sent: after the body and its metadata are durable in the archive
(temp file, fsync, rename, fsync of the folder) and the ``delivery`` row exists with
status ``pending``.  The fold happens later and never delays the answer.

Sections, top-down (each banner says what it owns; a section uses only what the sections
above it define, and each helper stands beside what uses it, or above them all when two
sections use it)::

     1. Constants — the versions, serve's defaults and limits, and every number two sections
        read, each with the reason for its value; any other number stands at the head of
        the part that reads it.
     2. Errors — one tree; HTTP-facing errors carry a status and a stable code.
     3. Logging and metrics — one record per line on stderr, logfmt or JSON; /metrics histograms.
     4. Config — defaults -> environment -> flags, merged once into a frozen object.
     5. Time — every timestamp form HAE sends, parsed to integer UTC microseconds.
     6. Canonical form and merge rule — same value, emptiness, dominance (storage spec).
     7. Files and archive — durable writes, raw bodies and their metadata, scratch folders.
     8. Body validation and JSON — what ingest accepts, and how many bytes it checks at once;
        parsing and writing bodies and objects.
     9. HAE extraction — which key of ``data`` becomes which metric, whole or hour by hour.
    10. Storage — schema, connections, the write transaction, the lock; accepting a delivery.
    11. Fold — one delivery into hourly objects, all-or-nothing (fold and storage specs).
    12. Fold worker — the one thread that folds pending deliveries in journal order, and the
        documents ingest hands it.
    13. Queries — what each metric means, catalog, points, buckets, nights (the one sleep
        rule), records, the view's plan, an ECG trace, the journal's deliveries (read spec).
    14. Workouts — a list, one workout whole: its figures, heart rate, route and splits
        (workouts spec).
    15. Freshness — is anything missing: each automation's and metric's state, the words of
        a notice, coverage per local day, and the notifier's thread (freshness spec).
    16. Summary page — a day at a glance against the person's own usual, and what needs
        attention (read spec).
    17. Export — the SQLite file of every point with its local time, every night and every
        workout with its route; a workout's GPX.
    18. Observability — the figures of /metrics (freshness gauges too), /healthz and status.
    19. Web sign-in — session cookies, the guess limiter, the client behind a proxy.
    20. MCP — read-only tools for AI assistants (Model Context Protocol): JSON-RPC, the
        protocol's versions, each tool calling the read functions of 13 to 16; ``healthlog
        mcp`` over stdio.
    21. Web app — the routes, one JSON error shape, an access log without bodies; ``/mcp``.
    22. HTTP transport — the head gate and the Cheroot adapter.
    23. Service — the lock, database, worker, notifier and server of `serve`; its memory.
    24. Maintenance — reindex, verify, import, refold, export: the store from the archive.
    25. Status — what the journal and the vitrine hold, readable while serve runs.
    26. CLI — subcommands, one-line errors, exit codes 0 / 1 / 2.
    27. The dashboard page — hand-written HTML, CSS and script, served from the .pyz itself.

One delivery's path to a chart, one home per step (section numbers as above)::

    App.ingest (21)             token, slots, size; the body streams into DATA/tmp
      Archive.receive (7)         hashed, fsynced
      ByteBudget.hold (8)         validation_bytes (8) of the validation_ceiling (8)
      accept_delivery (10)        check_delivery_shape (8); .meta.json and the body durably
                                  into the archive; the ``pending`` row; the parsed
                                  document to Handoff.put (12); then 200
    FoldWorker.run_pass (12)    woken by ingest; journal order; counts an attempt
      FoldEngine.fold (11)        Handoff.take (12), else extract_body (9): each metric's
                                  points by hour; outline_of (9) and decide: status and
                                  layer; merge_items and merge_hour (arbitrate: 6's rule)
                                  per hour object; apply: one transaction with the outcome
    App.points / App.plan (21)  point_query, plan_view, bucket_runs (13: whole hours
                                  from their tallies, the rest from their points)
    APP_JS (27)                 draws what /api/plan and /api/points send
    McpSession (20)             the same functions for an assistant: /mcp (21), or
                                  ``healthlog mcp`` on stdin and stdout

One judgement's path to a notice (``serve --notify URL``)::

    Service (23)                builds the FreshnessSource and the Notifier; start() starts
                                  the notifier's thread
    Notifier._run (15)          every ``freshness_check_s``; a read of /api/freshness,
                                  /api/summary, /api/coverage or /metrics (App._judge, 21)
                                  judges too
      Notifier.judge (15)         one judgement at a time
        FreshnessSource.judge (15)  when the database changed: ImportedDeliveries,
                                  JournalFacts and metric_facts (15) read the journal and
                                  the newest objects (decode_object, 11) in one snapshot;
                                  then judge_freshness (15) against the clock: each
                                  automation new, on_time or late, each metric new,
                                  fresh or stale
        Notifier._compare (15)      a change into or out of late or stale:
                                  automation_notice or metric_notice (15: the words,
                                  hae_action's dates to export), log_event (3), queued
      Notifier._attempt (15)      _post: the notice as text or JSON to the URL; after
                                  each failure again after ``notify_retry_s``, then
                                  dropped; counted on /metrics (render_metrics, 18)

The archive is the truth; the database is an index that ``reindex`` can rebuild.
Requirements live in ``openspec/specs/*/spec.md``; decisions in
``openspec/decisions.md``.
"""

from __future__ import annotations

import argparse
import array
import bisect
import codecs
import collections
import contextlib
import csv
import datetime as _dt
import errno
import fcntl
import gc
import hashlib
import hmac
import io
import ipaddress
import itertools
import json
import logging
import math
import operator
import os
import pickle
import re
import secrets
import selectors
import shutil
import signal
import socket
import sqlite3
import struct
import sys
import tempfile
import threading
import time
import unicodedata
import urllib.parse
import zlib
import zoneinfo
from dataclasses import dataclass, field as _field, replace as _replace
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Mapping, Optional, Sequence

try:  # optional speed-up: a .pyz cannot carry compiled code, the host may have it
    import orjson as _orjson
except ImportError:  # pragma: no cover - exercised by the runs without orjson
    _orjson = None

__version__ = "0.1.0"
__all__ = ["Config", "Service", "main", "__version__"]


# ==============================================================================
# Constants: the versions, serve's defaults and limits, every number two sections read.
# ==============================================================================

SCHEMA_VERSION = 5
"""``PRAGMA user_version`` of the database this code writes; a newer one is refused.
2: ``object.summary``, the hour's *tally* (:func:`hour_tally`: per field its count,
lowest, highest and total, and the offsets, for bucketed reads; the column keeps the
name it was given, so no database is rewritten for a word); a version-1 database
gains the column on open, and its objects get their tallies as they are written again
(reads compute a missing one from the points).  3: ``object.spans`` (each point's
parsed start and end, so a fold compares a re-sent hour without parsing the stored
timestamps again); older objects gain it as they are written again (a fold parses the
points of one without it, as before).  4: ``delivery.attempts`` (fold attempts without
an outcome) and the ``session`` table (signed-in browsers); older databases gain both
on open.  5: the index ``object_summary``, which covers what bucketed reads ask of an
object (built on open: about 0.3 s for a year of ten minute metrics)."""

PARSER_VERSION = 2
"""Stamped on each folded delivery.  2: the category (a string ``value``) is part of a
coordinate, sleep is a record, units never mix, times compare as instants, layers are
inferred by majority.  A store folded by an older parser is named at start and in
``status``, with ``reindex`` as the way to rebuild it by the current rules."""

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

INGEST_STALL_S = 60.0
"""Within that budget, the longest pause in a body: a phone switching networks resumes
within it; a client that stopped sending gets 408 and frees its thread."""

BUSY_TIMEOUT_S = 10.0
"""How long a writer waits for SQLite's write lock before it counts as busy."""

FOLD_WAKE_S = 60.0
"""Periodic wake-up of the fold thread, so a delivery left pending is retried even
when the phone is silent for hours (ING-4.5)."""

HANDOFF_BUDGET = 24 << 20
"""Memory the documents parsed at ingest may take while they wait for the fold thread
(:class:`Handoff`), as :func:`document_cost` estimates it.  0 turns the hand-over off."""
HANDOFF_BYTE_COST = 6
HANDOFF_CONTAINER_COST = 200
"""orjson's document of a body: 4.8 bytes per byte of compact dense points and 2.3 for
HAE's pretty-printed 2.8 MB body (tracemalloc), so 6 with room; but a body of tiny
objects takes more (``[{},{},…]`` 24 bytes per byte), so each object or array counts at
least 200 bytes (a small dict with its key and value)."""
SCRATCH_GRACE_S = 600.0
"""A scratch folder without its lock file yet is being created, and an archived file of an
``import`` running beside may be about to be journaled: left alone this long."""

MISSING_BODY_WAIT_S = 3600.0
"""``--missing-body-wait``'s default: how long an archived body may be absent from a
readable day folder before its delivery is ``failed`` with ``body_missing``.  An absent
body is almost always a disk mounted late, a permission or a folder being moved; an hour
outlasts any of those, and the one case it cannot heal (the file really gone) loses
nothing by waiting: only the deliveries after it wait with it.  A missing archive or
day folder never fails anything (FOLD-15.3)."""

FOLD_DEADLINE_S = 300.0
FOLD_DEADLINE_MIB = 16
"""A fold that takes longer than 300 s, and as much again for every 16 MiB of its body
beyond the first 16 (20 minutes at 64 MiB), is ``failed`` and frees the queue (ING-3).
Dense points fold at about 2 MiB a second here, so this only catches a pathological
body; but a history of one point per hour object (a Days export of every metric: 64 MiB,
783,000 objects) or 600,000 metrics of one point each take 135 and 209 s on this shared
2-core machine (tests/bench_memory.py), several times that on a small ARM board: a fixed
five minutes would fail a person's history there."""

STOP_BUDGET_S = 10.0
"""How long shutdown waits for the fold thread; a longer fold stays pending (ING-6)."""

READ_CHUNK = 1 << 20
"""Upload read size: 1 MiB reads run at ~540 MB/s over loopback (stack-notes §1.6)."""

HEAD_DEADLINE_S = 10.0
"""A request's line and headers must arrive within this (or the server-wide timeout,
when shorter), counted from the first moment the server waits for them.  A connection
is given a worker thread only once they have: a client that dribbles its headers holds
a file descriptor, never a thread."""

HEAD_GATE_MAX = 512
"""Connections waiting for their request head at once (a file descriptor each, under
the usual limit of 1024); a further one makes the longest waiter close."""

LISTEN_BACKLOG = 128
"""Connections the kernel queues before they are accepted (Cheroot's default is 5:
a burst of clients would wait for TCP's SYN retries, seconds each)."""

ACCEPT_TICK_S = 0.2
"""How long the HTTP server's accept loop waits before it looks up: stop() is noticed and
idle connections are checked against their timeout at this pace.  Shorter stops sooner but
wakes an idle appliance more often (0.05 s: 0.3 % of a core here, against 0.09 %)."""

SERVE_ERROR_PAUSE_S = 0.1
"""Pause of the HTTP server's accept loop after an error in it (no file descriptor left
for a new connection, say): the loop would otherwise retry at once, millions of times."""

HTTP_RESERVED_THREADS = 4
"""Worker threads an upload never takes: the read routes and /healthz keep these even
when every other thread is reading a slow body."""

VALIDATION_CEILING_BYTES = 64 << 20
"""Body bytes validated at once, at most; the largest body allowed when that is smaller
(:func:`validation_ceiling`).  A body larger than the ceiling is validated alone, once
nothing else is."""

VALIDATION_MEMORY_FACTOR = 2.1
"""Memory the ingest check of a body takes, per byte of it, at most: its bytes and then
its text at one byte a character (:func:`shape_text`), whatever characters it holds
(``tests/bench_memory.py --mib 64``: 1.95 to 2.08 for every shape, in a thread as serve
runs it; 2.0 in Python objects; a few MiB more at any size, which the base's room holds;
a body with emoji in its sources took 4.8 when it was decoded whole).  The ceiling and
:func:`quick_check_bytes` keep the checks at once within this factor of the largest body
allowed: what serve's start-up check counts (:func:`memory_needed_mib`)."""

VALIDATION_WAIT_S = 30.0
"""How long an upload waits for its turn to be validated before the answer is 503 with
Retry-After (the body is not kept: the phone sends it again)."""

RETRY_AFTER_S = 30

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

TOKEN_MIN_LENGTH = 16
"""The shortest token ``serve`` accepts: 16 characters of a password manager's choosing
hold off guessing for centuries even without :class:`GuessLimiter`."""

GUESSES_FREE = 5
"""Wrong tokens from one client address answered at once; the next ones wait a moment
that doubles (0.1 s, then up to :data:`GUESS_DELAY_MAX_S`).  A right token is never
counted, delayed or refused: it is compared first (RELY-7.8)."""
GUESS_DELAY_MAX_S = 2.0
GUESS_WAITERS_MAX = 2
"""Wrong answers waiting out their delay at once, whatever their addresses: a wrong token
beyond them is answered 429 at once, so that guessers never hold the HTTP threads the
phone's posts and the owner's sign-in need."""
GUESSES_BEFORE_LOCKOUT = 10
"""From this many wrong tokens in a burst on, an address's wrong tokens are answered 429
at once, for :data:`GUESS_LOCKOUT_S` after its last one, doubling with each further one
up to :data:`GUESS_LOCKOUT_MAX_S`.  Its right token is still served."""
GUESS_LOCKOUT_S = 30.0
GUESS_LOCKOUT_MAX_S = 900.0
GUESS_BURST_GAP_S = 600.0
"""A failure more than this after an address's last one starts a new burst, and counting
starts again."""
GUESS_ADDRESSES_MAX = 4096
"""Addresses the limiter remembers; the one that failed longest ago is forgotten first."""
FORWARDED_HINTS_MAX = 64
"""Untrusted addresses whose forwarding headers were logged (once each, with the hint to
name them in ``--trusted-proxy``): a bound, so that no client can grow it."""

LATE_AFTER_S = 6 * 3600.0
"""``--late-after``'s default: the shortest silence called late (an automation) or stale (a
metric), whatever their usual rhythm.  HAE runs only while the phone is unlocked and iOS
grants it time, so a few quiet hours are normal; six hours of them are not, by day."""
LATE_FACTOR = 3
"""An automation is late, a metric stale, after three of its usual intervals (and never
before ``--late-after``): one missed run is common (a locked phone), three in a row are not."""
USUAL_INTERVAL_DAYS = 14
"""An automation's usual interval: the median gap between its runs over the 14 days up to
its last delivery (two weeks hold a weekly rhythm twice and a daily one fourteen times)."""
USUAL_SPACING_DAYS = 30
"""A metric's usual spacing: the median gap between its points over the 30 days up to its
newest point (a weekly weigh-in has four of them); its carriers: the automations whose
deliveries wrote its objects in the 14 days up to that point."""
FRESH_MIN_RUNS = 3
"""Runs (deliveries, those of one ``session-id`` counting once) an automation needs before
it is judged: two gaps make a median; before that it is ``new``."""
FRESHNESS_CHECK_S = 60.0
"""How often ``serve`` judges freshness again for its notices, besides after a read of
``/api/freshness``, ``/api/summary`` or ``/metrics``."""
NOTIFY_TIMEOUT_S = 10.0
"""A notice's POST gives up after this; it never holds anything but the notifier's thread."""
NOTIFY_RETRY_S = (5.0, 30.0, 120.0, 600.0, 1800.0)
"""Waits before the retries of a notice that failed (an error, a timeout, an answer other
than 2xx); after the last the notice is dropped, with a WARN: about an hour in all."""
NOTIFY_QUEUE_MAX = 100
"""Notices waiting to be sent; beyond it the oldest is dropped (a receiver down for days)."""
COVERAGE_DAYS = 28
"""The days ``/api/coverage`` answers without ``from``: four weeks, ending today."""
COVERAGE_MAX_DAYS = 400
"""The longest range ``/api/coverage`` reads at once (a year and its edges)."""
SNAPSHOT_HOLD_S = 5.0
"""How long a streamed reply may keep its read snapshot open while the client reads.  A
client still reading after that gets the rest from a file under ``DATA/tmp``, written at
once, and the snapshot ends: a slow reader never keeps SQLite from reusing the WAL."""
SESSION_MAX_AGE_S = 30 * 86400
"""A signed-in browser stays signed in for 30 days; changing the token signs all out."""

# Read by more than one section below (a number that one section alone reads stands at
# the head of the part of that section that reads it):

TIMING_BOUNDS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 120.0)
"""Histogram buckets (seconds) for ingest answers and folds: 1 KB to 60 MB bodies."""
GZIP_LEVEL = 6
"""zlib's level for the stored objects' blobs: its default, near the best ratio for
JSON at a third of level 9's time."""
FOLD_MAX_BYTES = 512 << 20
"""A body above this is not parsed (a full parse holds ~6× the body in memory)."""
STREAM_FOLD_BYTES = 8 << 20
"""From this size on, a body is folded hour by hour (:func:`index_points`).  A whole
document of dense points takes 7-10× the body in Python objects (a 63 MiB body of
990k heart-rate points needed 600 MiB); the text, the index (4 to 20 bytes a point,
about 60 a metric) and a bounded batch of encoded objects stay near twice the body
(fold spec, FOLD-13)."""
DEFER_MIN_ELEMENTS = 256
"""An array member of a record with more elements than this stays in the text of a large
body (or of a large stored object) as a :class:`Deferred`: a two-day workout's 150,000
route points and as many heart-rate samples would take 2.5 times the body as dicts."""
FOLD_ATTEMPTS_MAX = 3
"""Fold attempts a delivery may have without an outcome (the process died during them:
a fault of the machine that the process survives takes its attempt back); the next pass
then fails it, so that no single delivery stops the fold.  Three: one death may be bad
luck, a third is the delivery."""
STREAM_CHUNK = 64 << 10
"""Streamed replies are written in pieces of about this size."""
MAX_OFFSET_S = 14 * 3600
"""The farthest offsets from UTC in use (Kiribati's +14:00, Baker Island's -12:00): a
local date-only bound selects objects this far on either side of UTC midnight."""
MCP_MESSAGE_MAX = 1 << 20
"""The largest MCP message taken, a line on stdio or the body of a ``POST /mcp``: a tool
call is a few hundred bytes; a mebibyte leaves room for any client's envelope."""

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


class Forbidden(HTTPFailure):
    """A state-changing request from another site is refused."""

    status, code = 403, "forbidden"


class MethodNotAllowed(HTTPFailure):
    """This route does not accept that method."""

    status, code = 405, "method_not_allowed"


class TooManyRequests(HTTPFailure):
    """Too many failed authentications from this address; try again later."""

    status, code = 429, "too_many_requests"

    def __init__(self, retry_after: float):
        super().__init__()
        self.headers = (("Retry-After", str(max(1, math.ceil(retry_after)))),)


class RequestTimeout(HTTPFailure):
    """The request body did not arrive within the ingest deadline."""

    status, code = 408, "request_timeout"


class PayloadTooLarge(HTTPFailure):
    """The body is larger than the configured limit."""

    status, code = 413, "payload_too_large"


def body_too_large(limit: int) -> PayloadTooLarge:
    return PayloadTooLarge("the body is larger than %d MiB (the limit set with --max-body-mib)"
                           % (limit >> 20))


class UnsupportedMediaType(HTTPFailure):
    """healthlog accepts JSON only: set Export Format to JSON in Health Auto Export."""

    status, code = 415, "unsupported_media_type"


class InternalError(HTTPFailure):
    """The server could not store the delivery; it was not accepted."""

    status, code = 500, "internal_error"


READ_FAILED = ("The server could not read the data; nothing was changed. Try again; the"
               " server's log names the error.")
REQUEST_FAILED = "The server could not complete the request; the server's log names the error."


class ServiceStopping(HTTPFailure):
    """healthlog is shutting down; try again shortly."""

    status, code = 503, "stopping"


class ServiceBusy(HTTPFailure):
    """Too many uploads at once: the body was not kept; send it again after Retry-After."""

    status, code = 503, "busy"
    headers = (("Retry-After", str(RETRY_AFTER_S)),)


class StorageFailure(HealthlogError):
    """Writing into the data directory failed (disk full, read-only, I/O error): the
    server's fault, never the client's."""

    def __init__(self, cause: OSError):
        super().__init__("cannot write into the data directory: %s"
                         % (cause.strerror or type(cause).__name__))
        self.cause = cause


class FoldPaused(HealthlogError):
    """A fault of the machine deferred a fold: the fold loop pauses, then tries again."""


class ScratchFault(HealthlogError):
    """A fold's scratch file could not be written or read (a full or failing disk): a
    fault of the machine, like a database that cannot be written (fold spec)."""

    def __init__(self, cause: OSError):
        super().__init__("a fold's scratch file failed (%s)"
                         % errno.errorcode.get(cause.errno or 0, type(cause).__name__))


class FoldFailure(HealthlogError):
    """The delivery cannot be folded; retrying will not change that (ING-3)."""

    error_class = "fold_failed"

    def __init__(self, message: Optional[str] = None, uncovered: Optional[list] = None):
        super().__init__(message)
        self.uncovered = uncovered


class ContentNotParsed(FoldFailure):
    """The body's content could not be parsed into points."""

    error_class = "content_not_parsed"


class LayerNotInferable(FoldFailure):
    """No header, no dense metrics and no earlier delivery of the automation name a layer."""

    error_class = "layer_not_inferable"


class BodyMissing(FoldFailure):
    """The archived body is gone from its readable day folder, and stayed gone for
    :attr:`Config.missing_body_wait_s` (the fold worker decides: FOLD-15.3); ``healthlog
    refold`` folds it again should it come back."""

    error_class = "body_missing"


class BodyTooBig(FoldFailure):
    """The archived body is too big to fold."""

    error_class = "body_too_big"


class FoldDeadlineExceeded(FoldFailure):
    """The fold took longer than its deadline."""

    error_class = "fold_deadline_exceeded"


class ArchiveFault(HealthlogError):
    """An archived body could not be read for a reason of the machine (permissions, an
    I/O error, too many open files), not of the body: the delivery stays pending and
    is tried again (fold spec)."""

    def __init__(self, cause: OSError):
        self.reason = errno.errorcode.get(cause.errno or 0, type(cause).__name__)
        super().__init__("an archived body cannot be read (%s)" % self.reason)


class BodyAbsent(ArchiveFault):
    """An archived body is not where the journal says it is: its disk not mounted yet
    (``archive_missing``), its day folder gone or in flight (``folder_missing``), or the
    file alone (``body_missing``).  Far more often a mount, a permission or a folder in
    flight than a lost file, so the delivery waits like any fault of the machine; only
    the fold worker fails it, after :attr:`Config.missing_body_wait_s` with its folders
    readable (FOLD-15.3)."""

    def __init__(self, reason: str):
        self.reason = reason
        HealthlogError.__init__(self, "an archived body is not there (%s)" % reason)


class ArchiveUnavailable(HTTPFailure):
    """The archive folder is missing or empty while the journal lists deliveries (its disk
    is not mounted yet): nothing is written; send the body again after Retry-After."""

    status, code = 503, "archive_unavailable"
    headers = (("Retry-After", str(RETRY_AFTER_S)),)


class UnknownMetric(NotFound):
    """No data of that metric: the reply lists the metrics there are."""

    code = "unknown_metric"

    def __init__(self, names: list):
        """``names``: the metrics there are, each as :func:`loggable_metric` gives it."""
        super().__init__("no data of that metric; see /api/catalog")
        self.extra = {"metrics": sorted(set(names))}


class UnknownLayer(NotFound):
    """The metric has no data in that layer."""

    code = "unknown_layer"


class NotAcceptable(HTTPFailure):
    """The client accepts no answer this route gives."""

    status, code = 406, "not_acceptable"


class McpError(HealthlogError):
    """A JSON-RPC error of the MCP server (section MCP): its code, its message and its
    ``data``, which never holds health data."""

    def __init__(self, code: int, message: str, data: Any = None):
        super().__init__(message)
        self.code, self.data = code, data


class UnknownWorkout(NotFound):
    """No stored workout has that id."""

    code = "unknown_workout"


class NoRoute(NotFound):
    """This workout has no route: there is nothing to draw or to write as GPX."""

    code = "no_route"


class PoolBroken(HealthlogError):
    """A rebuild worker ended, or could not merge what it was sent: the parallel rebuild
    is abandoned and started again in one process."""


# ==============================================================================
# Logging and metrics: one record per line on stderr, logfmt or JSON; /metrics histograms.
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


LOG_REPEATS_WRITTEN = 5
"""Identical records in a row written as they come; the rest of the run is counted."""
LOG_REPEAT_REPORT_S = 60.0
"""While a run of identical records goes on, its count is written this often."""


def _error_name(exc: Optional[BaseException]) -> Optional[str]:
    """An exception as a log field: its errno's name for an OSError (``EMFILE``), else its
    class; never its message, which may quote data."""
    if exc is None:
        return None
    return errno.errorcode.get(getattr(exc, "errno", None) or 0) or type(exc).__name__


def _is_timeout(exc: BaseException) -> bool:
    return isinstance(exc, socket.timeout) or "timed out" in str(exc)


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
    """``time=… level=… msg="…" key=value …`` (README, "Logging")."""

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


class CollapsingHandler(logging.StreamHandler):
    """A stream handler that writes a run of identical records (level, message and
    fields: everything but the time) as its first :data:`LOG_REPEATS_WRITTEN` lines and
    then a count: the same record with ``repeated=N`` once the run ends (before the next
    different record) and once every :data:`LOG_REPEAT_REPORT_S` while it goes on.  A
    failing machine (no file descriptors, say) then cannot fill the disk with one line."""

    def __init__(self, stream: Any):
        super().__init__(stream)
        self._key: Optional[tuple] = None
        self._run = 0  # records of the current run after its first
        self._held = 0  # of them, not written yet
        self._last: Optional[logging.LogRecord] = None
        self._reported = 0.0

    def emit(self, record: logging.LogRecord) -> None:  # under the handler's lock
        fields = getattr(record, "fields", None) or {}
        key = (record.levelno, record.name, record.getMessage(),
               repr(sorted(fields.items())), record.exc_info is None)
        if key == self._key:
            self._run += 1
            if self._run >= LOG_REPEATS_WRITTEN:
                self._held += 1
                self._last = record
                if record.created - self._reported >= LOG_REPEAT_REPORT_S:
                    self._write_held()
                return
        else:
            self._write_held()
            self._key, self._run, self._reported = key, 0, record.created
        self._last = record
        super().emit(record)

    def _write_held(self) -> None:
        held, self._held = self._held, 0
        if held and self._last is not None:
            count = logging.makeLogRecord(self._last.__dict__)
            count.fields = dict(getattr(self._last, "fields", None) or {}, repeated=held)
            super().emit(count)
            self._reported = self._last.created

    def close(self) -> None:
        """Write the count of a run still going on (at exit, logging closes handlers)."""
        self.acquire()
        try:
            self._write_held()
        finally:
            self.release()
        super().close()


def setup_logging(config: Config, stream: Any = None) -> logging.Handler:
    """Send every record of the process to one stderr handler in the chosen format."""
    handler = CollapsingHandler(stream or sys.stderr)
    handler.setFormatter(JSONFormatter() if config.log_format == "json" else LogfmtFormatter())
    root = logging.getLogger()
    for old in list(root.handlers):
        if getattr(old, "_healthlog", False):
            root.removeHandler(old)
    handler._healthlog = True  # type: ignore[attr-defined]
    root.addHandler(handler)
    root.setLevel(_LEVELS[config.log_level])
    return handler


class Histogram:
    """A Prometheus histogram kept in memory (this process only), thread-safe."""

    def __init__(self, bounds: tuple):
        self.bounds = bounds
        self._lock = threading.Lock()
        self._series: dict = {}  # labels -> [bucket counts…, sum, count]

    def observe(self, seconds: float, **labels: str) -> None:
        key = tuple(sorted(labels.items()))
        with self._lock:
            series = self._series.setdefault(key, [0] * len(self.bounds) + [0.0, 0])
            for i, bound in enumerate(self.bounds):
                if seconds <= bound:
                    series[i] += 1
            series[-2] += seconds
            series[-1] += 1

    def render(self, name: str, help_text: str) -> list:
        lines = ["# HELP %s %s" % (name, help_text), "# TYPE %s histogram" % name]
        with self._lock:
            series = {key: list(values) for key, values in self._series.items()}
        for key, values in sorted(series.items()):
            labels = ",".join('%s="%s"' % item for item in key)
            sep = "," if labels else ""
            for bound, count in zip(self.bounds, values):
                lines.append('%s_bucket{%s%sle="%s"} %d' % (name, labels, sep, repr(bound), count))
            lines.append('%s_bucket{%s%sle="+Inf"} %d' % (name, labels, sep, values[-1]))
            braces = "{%s}" % labels if labels else ""
            lines.append("%s_sum%s %s" % (name, braces, repr(values[-2])))
            lines.append("%s_count%s %d" % (name, braces, values[-1]))
        return lines


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
    ingest_stall_s: float = INGEST_STALL_S
    busy_timeout_s: float = BUSY_TIMEOUT_S
    fold_wake_s: float = FOLD_WAKE_S
    fold_deadline_s: float = FOLD_DEADLINE_S
    stop_budget_s: float = STOP_BUDGET_S
    handoff_budget: int = HANDOFF_BUDGET
    trusted_proxies: tuple = ()  # ip_network objects: whose forwarding headers count
    late_after_s: float = LATE_AFTER_S
    notify_url: Optional[str] = None  # where notices go (never logged: it may hold a secret)
    notify_format: str = "text"
    notify_timeout_s: float = NOTIFY_TIMEOUT_S
    notify_retry_s: tuple = NOTIFY_RETRY_S
    freshness_check_s: float = FRESHNESS_CHECK_S
    missing_body_wait_s: float = MISSING_BODY_WAIT_S
    map_tiles: Optional[str] = None  # a tile server's URL template: its host joins the CSP
    max_heart_rate: Optional[float] = None  # the owner's own, for heart-rate zones
    distance_units: Optional[str] = None  # km or mi for splits and pace; None: the workout's
    clock: Callable[[], float] = time.time
    """Epoch seconds now: what freshness is judged against and the time a delivery is
    received at.  Tests give their own and move it instead of waiting."""

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


def check_token_length(token: str, origin: str) -> str:
    """``serve`` refuses a token anyone could guess (the generated one has 43 characters,
    256 bits)."""
    if len(token) < TOKEN_MIN_LENGTH:
        raise ConfigError("%s: a token needs at least %d characters (this one has %d); leave"
                          " it out to have a random one made" % (origin, TOKEN_MIN_LENGTH,
                                                                 len(token)))
    return token


def parse_trusted_proxies(text: str, origin: str) -> tuple:
    """``ADDR[,ADDR...]``: addresses or networks (``10.0.0.0/8``, ``::1``) whose
    forwarding headers are believed."""
    networks = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        try:
            networks.append(ipaddress.ip_network(part, strict=False))
        except ValueError:
            raise ConfigError("%s: %r is not an address or a network (such as 127.0.0.1,"
                              " ::1 or 10.0.0.0/8)" % (origin, part)) from None
    if not networks:
        raise ConfigError("%s wants one or more addresses, separated by commas" % origin)
    return tuple(networks)


_DURATION = re.compile(r"([0-9]{1,7})([smhd])")
_DURATION_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_duration(text: str, origin: str) -> float:
    """``90s``, ``45m``, ``6h``, ``2d``: seconds, at least one."""
    match = _DURATION.fullmatch((text or "").strip())
    if not match or int(match.group(1)) < 1:
        raise ConfigError("%s wants a duration such as 90s, 45m, 6h or 2d" % origin)
    return float(int(match.group(1)) * _DURATION_UNITS[match.group(2)])


def parse_notify_url(text: str, origin: str) -> str:
    """An ``http://`` or ``https://`` address with a host: where ``serve`` posts notices."""
    parts = urllib.parse.urlsplit((text or "").strip())
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConfigError("%s wants an http:// or https:// address, such as"
                          " https://ntfy.sh/my-topic" % origin)
    return text.strip()


_TILE_FIELDS = re.compile(r"\{([a-z]+)\}")


def parse_map_tiles(text: str, origin: str) -> str:
    """A tile server's URL template: ``https://tile.openstreetmap.org/{z}/{x}/{y}.png``.
    ``http://`` or ``https://``, one host (no ``{s}`` of several), ``{z}``, ``{x}`` and
    ``{y}`` each once and no other field: only that host joins the page's
    Content-Security-Policy."""
    text = (text or "").strip()
    parts = urllib.parse.urlsplit(text)
    fields = _TILE_FIELDS.findall(text)
    if (parts.scheme not in ("http", "https") or not parts.hostname or "{" in parts.netloc
            or sorted(fields) != ["x", "y", "z"] or any(c in text for c in "\"'\\ <>")):
        raise ConfigError("%s wants a tile URL template on one host with {z}, {x} and {y},"
                          " such as https://tile.openstreetmap.org/{z}/{x}/{y}.png" % origin)
    return text


def parse_heart_rate(text: str, origin: str) -> float:
    """A maximum heart rate in beats per minute: a whole number from 100 to 250."""
    if not re.fullmatch(r"[0-9]{2,3}", (text or "").strip()) or not (
            100 <= int(text) <= 250):
        raise ConfigError("%s wants beats per minute, a whole number from 100 to 250" % origin)
    return float(int(text))


def parse_distance_units(text: str, origin: str) -> str:
    """``km`` or ``mi``: how splits, pace and speed are counted."""
    value = (text or "").strip().lower()
    if value not in ("km", "mi"):
        raise ConfigError("%s must be km or mi" % origin)
    return value


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
    for key, flag, variable, parse in (
            ("trusted_proxies", "--trusted-proxy", "HEALTHLOG_TRUSTED_PROXY",
             parse_trusted_proxies),
            ("late_after_s", "--late-after", "HEALTHLOG_LATE_AFTER", parse_duration),
            ("missing_body_wait_s", "--missing-body-wait", "HEALTHLOG_MISSING_BODY_WAIT",
             parse_duration),
            ("notify_url", "--notify", "HEALTHLOG_NOTIFY", parse_notify_url),
            ("map_tiles", "--map-tiles", "HEALTHLOG_MAP_TILES", parse_map_tiles),
            ("max_heart_rate", "--max-heart-rate", "HEALTHLOG_MAX_HEART_RATE",
             parse_heart_rate),
            ("distance_units", "--distance-units", "HEALTHLOG_DISTANCE_UNITS",
             parse_distance_units)):
        given = getattr(args, flag[2:].replace("-", "_"), None)
        if given is not None:  # the flag wins; an empty variable counts as unset
            values[key] = parse(given, flag)
        elif environ.get(variable):
            values[key] = parse(environ[variable], variable)
    notify_format = getattr(args, "notify_format", None)
    if notify_format is not None:
        if notify_format not in ("text", "json"):
            raise ConfigError("--notify-format must be text or json")
        values["notify_format"] = notify_format
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
# Time: every timestamp form HAE sends, parsed to integer UTC microseconds.
# ==============================================================================

US = 1_000_000
HOUR_US = 3600 * US
_EPOCH_ORDINAL = _dt.date(1970, 1, 1).toordinal()
_MIN_US = (_dt.date(1900, 1, 1).toordinal() - _EPOCH_ORDINAL) * 86400 * US
_MAX_US = (_dt.date(2200, 1, 1).toordinal() - _EPOCH_ORDINAL) * 86400 * US
_SEXAGESIMAL = {"%02d" % i: i for i in range(60)}
_HOUR_BASE: dict = {}
"""``"YYYY-MM-DD HH ±hhmm"`` → µs of that local hour in UTC.  HAE's timestamps share
a handful of hours and offsets, so the fast path is two slices and three lookups
(measured: strptime on every timestamp costs 9× the JSON parse of the body)."""
_HOUR_BASE_MAX = 200_000

_HAE_24H = re.compile(r"(\d{4})-(\d{2})-(\d{2}) (\d{1,2}):(\d{2}):(\d{2})(?:\.(\d{1,9}))?"
                      r" ?(?:([Zz])|([+-])(\d{2}):?(\d{2}))", re.ASCII)
_HAE_12H = re.compile(r"(\d{4})-(\d{2})-(\d{2}) (\d{1,2}):(\d{2})(?::(\d{2}))?"
                      "[ \u00a0\u202f]?([AaPp])\\.?[Mm]\\.? ?([+-])(\\d{2}):?(\\d{2})", re.ASCII)
_ISO = re.compile(r"(\d{4})-(\d{2})-(\d{2})T(\d{2}):(\d{2})(?::(\d{2})(?:[.,](\d{1,9}))?)?"
                  r"(?:([Zz])|([+-])(\d{2}):?(\d{2})?)", re.ASCII)
_DATE_ONLY = re.compile(r"(\d{4})-(\d{2})-(\d{2})", re.ASCII)


def parse_time(value: Any) -> Optional[int]:
    """A point's timestamp as UTC epoch microseconds, or None when it is not one.

    Accepts HAE's ``yyyy-MM-dd HH:mm:ss Z`` (fast path; the zone also as a literal
    ``Z``), its 12-hour variants
    (``am``/``AM``, with an ordinary, U+00A0 or U+202F space), fractions of a second,
    date-only (UTC midnight), ISO-8601 with ``Z`` or an offset, and epoch numbers
    (seconds; milliseconds above 1e11).  Pure: no I/O, no time zone database —
    the offset written in the string is the truth.
    """
    if type(value) is str:
        if len(value) == 25 and value[13] == ":" and value[16] == ":":
            base = _HOUR_BASE.get(value[:13] + value[19:])
            if base is not None:
                minute = _SEXAGESIMAL.get(value[14:16])
                second = _SEXAGESIMAL.get(value[17:19])
                if minute is not None and second is not None:
                    return base + (minute * 60 + second) * US
        return _parse_time_text(value)
    if type(value) is int or type(value) is float:
        return _parse_epoch(value)
    return None


def _parse_epoch(value: float) -> Optional[int]:
    if not -1e16 < value < 1e16:  # also NaN and ±inf; milliseconds reach ~7e12 by 2200
        return None
    scale = 1000 if abs(value) >= 1e11 else US  # above 1e11 (year 5138 in s): milliseconds
    result = value * scale if type(value) is int else int(round(value * scale))
    return result if _MIN_US <= result < _MAX_US else None


def _instant(year: str, month: str, day: str, hour: int, minute: str, second: Optional[str],
             fraction: Optional[str], offset_s: int) -> Optional[int]:
    try:
        date = _dt.date(int(year), int(month), int(day))
    except ValueError:
        return None
    minute_i, second_i = int(minute), int(second or 0)
    if hour > 23 or minute_i > 59 or second_i > 59:
        return None
    micros = int((fraction or "0")[:6].ljust(6, "0"))
    local = ((date.toordinal() - _EPOCH_ORDINAL) * 86400 + hour * 3600 + minute_i * 60
             + second_i)
    result = (local - offset_s) * US + micros
    return result if _MIN_US <= result < _MAX_US else None


def _offset_seconds(sign: str, hours: str, minutes: Optional[str]) -> Optional[int]:
    h, m = int(hours), int(minutes or 0)
    if h > 23 or m > 59:
        return None
    return (-1 if sign == "-" else 1) * (h * 3600 + m * 60)


def _parse_time_text(text: str) -> Optional[int]:
    text = text.strip()
    match = _HAE_24H.fullmatch(text)
    if match:
        y, mo, d, h, mi, s, frac, zulu, sign, oh, om = match.groups()
        offset = 0 if zulu else _offset_seconds(sign, oh, om)
        if offset is None:
            return None
        result = _instant(y, mo, d, int(h), mi, s, frac, offset)
        if result is not None and len(text) == 25 and not frac and len(h) == 2:
            if len(_HOUR_BASE) >= _HOUR_BASE_MAX:
                _HOUR_BASE.clear()
            _HOUR_BASE[text[:13] + text[19:]] = result - (int(mi) * 60 + int(s)) * US
        return result
    match = _HAE_12H.fullmatch(text)
    if match:
        y, mo, d, h, mi, s, half, sign, oh, om = match.groups()
        hour = int(h)
        offset = _offset_seconds(sign, oh, om)
        if not 1 <= hour <= 12 or offset is None:
            return None
        hour = hour % 12 + (12 if half in "Pp" else 0)
        return _instant(y, mo, d, hour, mi, s, None, offset)
    match = _ISO.fullmatch(text)
    if match:
        y, mo, d, h, mi, s, frac, zulu, sign, oh, om = match.groups()
        offset = 0 if zulu else _offset_seconds(sign, oh, om)
        if offset is None:
            return None
        return _instant(y, mo, d, int(h), mi, s, frac, offset)
    match = _DATE_ONLY.fullmatch(text)
    if match:
        return _instant(match.group(1), match.group(2), match.group(3), 0, "0", None, None, 0)
    return None


def local_day_and_second(value: Any) -> Optional[tuple]:
    """(proleptic ordinal of the local date, second of the local day) as written.

    Layer inference asks how a bucket start is aligned in the phone's own local time,
    which is the time written in the string, not UTC.  Epoch numbers are UTC.
    """
    if type(value) is str:
        text = value.strip()
        for pattern in (_HAE_24H, _ISO):
            match = pattern.fullmatch(text)
            if match:
                y, mo, d, h, mi, s = match.groups()[:6]
                fraction = match.group(7)
                break
        else:
            match = _HAE_12H.fullmatch(text)
            if match:
                y, mo, d, h, mi, s, half = match.groups()[:7]
                h = str(int(h) % 12 + (12 if half in "Pp" else 0))
                fraction = None
            else:
                match = _DATE_ONLY.fullmatch(text)
                if not match:
                    return None
                y, mo, d, h, mi, s, fraction = (match.group(1), match.group(2), match.group(3),
                                                "0", "0", "0", None)
        try:
            ordinal = _dt.date(int(y), int(mo), int(d)).toordinal()
        except ValueError:
            return None
        second = int(h) * 3600 + int(mi) * 60 + int(s or 0)
        if fraction and int(fraction):
            second += 0.5  # a fraction of a second is aligned to nothing coarser
        return ordinal, second
    instant = parse_time(value)
    if instant is None:
        return None
    days, rest = divmod(instant, 86400 * US)
    return days + _EPOCH_ORDINAL, rest / US


_MINUTE_SECOND = tuple("%02d:%02d" % divmod(second, 60) for second in range(3600))
"""``MM:SS`` of each second of an hour: texts of instants written a piece at a time."""
_HOUR_TEXT: dict = {}
"""UTC hour (epoch hours) → ``YYYY-MM-DDTHH:``: exports format the hours once."""


def _hour_prefix(moment: _dt.datetime) -> str:
    """``YYYY-MM-DDTHH:`` with a four-digit year also before 1000 (strftime writes ``1``)."""
    return "%04d-%02d-%02dT%02d:" % (moment.year, moment.month, moment.day, moment.hour)


def format_instant(instant_us: int) -> str:
    """UTC ISO-8601 text of an instant (for exports and messages, never for keys)."""
    hour, rest = divmod(instant_us, HOUR_US)
    prefix = _HOUR_TEXT.get(hour)
    if prefix is None:
        moment = _dt.datetime(1970, 1, 1, tzinfo=_dt.timezone.utc) + _dt.timedelta(hours=hour)
        if len(_HOUR_TEXT) >= _HOUR_BASE_MAX:
            _HOUR_TEXT.clear()
        prefix = _HOUR_TEXT[hour] = _hour_prefix(moment)
    seconds, micros = divmod(rest, US)
    text = prefix + _MINUTE_SECOND[seconds]
    if micros:
        text += (".%06d" % micros).rstrip("0")
    return text + "Z"


# -- local time on the read side: the day and hour as the phone lived them -------------

_OFFSET_TAIL: dict = {}
"""`` -0500`` → -18000: the offset written at the end of HAE's own timestamps."""


def text_offset(raw: Any, instant_us: int) -> int:
    """Seconds east of UTC of the local time a timestamp was written in: HAE writes every
    date in the phone's zone at that moment, so this is the offset the phone lived
    (0 for epoch numbers, ``Z`` and texts without an offset; a date alone is its own
    day)."""
    if type(raw) is str and len(raw) == 25 and raw[19] == " " and raw[20] in "+-":
        return _tail_offset(raw[20:])
    fields = local_day_and_second(raw)
    if fields is None:
        return 0
    local_s = (fields[0] - _EPOCH_ORDINAL) * 86400 + fields[1]
    return int(round((local_s - instant_us / US) / 60.0)) * 60


def _tail_offset(tail: str) -> int:
    """Seconds east of UTC of the ``+hhmm`` that ends one of HAE's own timestamps."""
    offset = _OFFSET_TAIL.get(tail)
    if offset is None:
        offset = _offset_seconds(tail[0], tail[1:3], tail[3:]) or 0
        if len(_OFFSET_TAIL) < 4096:
            _OFFSET_TAIL[tail] = offset
    return offset


def raw_start(point: dict) -> Any:
    """The start as written: ``start``, else ``startDate``, else ``date``."""
    get = point.get
    raw = get("start")
    if raw is None:
        raw = get("startDate")
        if raw is None:
            raw = get("date")
    return raw


def start_offsets(points: list, coords: Sequence) -> set:
    """The offsets (:func:`text_offset`) the starts of an object's points were written
    in.  One loop that reads each start (:func:`raw_start`) and converts only the
    distinct offset texts of HAE's own timestamps: it sees every stored point."""
    tails, offsets = set(), set()
    for point, coord in zip(points, coords):
        if type(point) is not dict:
            continue
        raw = raw_start(point)
        if type(raw) is str and len(raw) == 25 and raw[19] == " " and raw[20] in "+-":
            tails.add(raw[20:])
        else:
            offsets.add(text_offset(raw, coord[0]))
    offsets.update(_tail_offset(tail) for tail in tails)
    return offsets


class Zone:
    """How a read places instants on local days and hours (read spec, READ-8).

    ``local``: each point in the offset its own timestamp was written in, the day HAE
    meant, across DST changes and travel; an IANA zone (``zoneinfo``, DST-aware); or a
    fixed offset.  Offsets are seconds east of UTC."""

    name = "local"

    def point_offset(self, raw: Any, instant_us: int) -> int:
        return text_offset(raw, instant_us)

    def offset_at(self, instant_us: int) -> Optional[int]:
        """The zone's offset at an instant; None for ``local`` (the points say)."""
        return None

    def midnight(self, ordinal: int, seen_offset: int) -> int:
        """UTC µs of local midnight of the day ``ordinal``; ``seen_offset``: the offset of
        a point of that day, which is all ``local`` knows."""
        return ((ordinal - _EPOCH_ORDINAL) * 86400 - seen_offset) * US


class FixedZone(Zone):
    def __init__(self, offset_s: int):
        self.offset_s = offset_s
        self.name = format_offset(offset_s)

    def point_offset(self, raw: Any, instant_us: int) -> int:
        return self.offset_s

    def offset_at(self, instant_us: int) -> Optional[int]:
        return self.offset_s

    def midnight(self, ordinal: int, seen_offset: int) -> int:
        return ((ordinal - _EPOCH_ORDINAL) * 86400 - self.offset_s) * US


class NamedZone(Zone):
    def __init__(self, name: str, zone: Any):
        self.name, self._zone = name, zone
        self._offsets: dict = {}  # UTC hour -> offset (zones change on whole hours or less)

    def offset_at(self, instant_us: int) -> Optional[int]:
        minute = instant_us // (60 * US)
        found = self._offsets.get(minute)
        if found is None:
            moment = _dt.datetime.fromtimestamp(minute * 60, _dt.timezone.utc)
            found = int(moment.astimezone(self._zone).utcoffset().total_seconds())
            if len(self._offsets) >= 1 << 16:
                self._offsets.clear()
            self._offsets[minute] = found
        return found

    def point_offset(self, raw: Any, instant_us: int) -> int:
        return self.offset_at(instant_us)

    def midnight(self, ordinal: int, seen_offset: int) -> int:
        day = _dt.date.fromordinal(ordinal)
        local = _dt.datetime(day.year, day.month, day.day, tzinfo=self._zone)
        return int(local.timestamp()) * US


LOCAL_ZONE = Zone()


def format_offset(offset_s: int) -> str:
    """``+02:00``, ``-05:30``."""
    return "%s%02d:%02d" % ("-" if offset_s < 0 else "+", abs(offset_s) // 3600,
                            abs(offset_s) % 3600 // 60)


_LOCAL_HOUR: dict = {}
"""Local epoch hour → ``YYYY-MM-DDTHH:``: replies format each local hour once."""
_OFFSET_TEXT: dict = {}


def local_iso(instant_us: int, offset_s: int) -> str:
    """An instant as local ISO-8601 text with its offset: ``2025-04-15T07:30:00-04:00``
    (whole seconds)."""
    hour, rest = divmod(instant_us // US + offset_s, 3600)
    prefix = _LOCAL_HOUR.get(hour)
    if prefix is None:
        if len(_LOCAL_HOUR) >= _HOUR_BASE_MAX:
            _LOCAL_HOUR.clear()
        moment = _dt.datetime(1970, 1, 1) + _dt.timedelta(hours=hour)
        prefix = _LOCAL_HOUR[hour] = _hour_prefix(moment)
    zone = _OFFSET_TEXT.get(offset_s)
    if zone is None:
        zone = _OFFSET_TEXT[offset_s] = format_offset(offset_s)
    return prefix + _MINUTE_SECOND[rest] + zone


def local_ordinal(instant_us: int, offset_s: int) -> int:
    """Proleptic ordinal of the local date of an instant."""
    return (instant_us // US + offset_s) // 86400 + _EPOCH_ORDINAL


def utc_now() -> _dt.datetime:
    return _dt.datetime.now(_dt.timezone.utc)


def format_received_at(moment: _dt.datetime) -> str:
    """``YYYY-MM-DDTHH:MM:SS.ffffffZ``: the one format received_at is compared in."""
    return moment.astimezone(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def parse_received_at(text: str) -> _dt.datetime:
    return _dt.datetime.strptime(text, "%Y-%m-%dT%H:%M:%S.%fZ").replace(tzinfo=_dt.timezone.utc)


def journal_time(instant: Any) -> Optional[str]:
    """A time of the journal (``received_at``, ``folded_at``, an automation's last
    delivery), given as µs or as stored text, in the one form :func:`format_received_at`
    writes, six digits of microseconds and all (``…35.413920Z``, never ``…35.41392Z``),
    wherever it is shown: times compared as text have exactly one format.  None stays None;
    text no time can be read from is given as it is."""
    if instant is None:
        return None
    micros = instant if type(instant) is int else parse_time(instant)
    if micros is None:
        return instant
    return format_received_at(_dt.datetime(1970, 1, 1, tzinfo=_dt.timezone.utc)
                              + _dt.timedelta(microseconds=micros))


# ==============================================================================
# Canonical form and merge rule: same value, emptiness, dominance (storage spec).
# ==============================================================================

SAME_VALUE_REL = 1e-12
"""Numbers within this relative distance are one value: HAE re-spells doubles with
last-digit jitter (61.999999999999993 vs 61.99999999999999); rounding to N digits
instead would split 9 % of values across a rounding boundary (measured)."""


def strip_source(value: Any) -> Any:
    """The value without any ``source`` key, at every level."""
    if type(value) is dict:
        return {k: strip_source(v) if type(v) is dict or type(v) is list else v
                for k, v in value.items() if k != "source"}
    if type(value) is list:
        return [strip_source(v) if type(v) is dict or type(v) is list else v for v in value]
    return value


def canonical(value: Any) -> str:
    """Sorted keys, no ``source``, shortest round-trip numbers, no HTML escaping.

    Used to hash objects and to order candidates; never stored, never the answer to
    "is this a change?" (that is :func:`same_value`).  The text is the standard json
    module's, whether orjson is installed or not (:func:`canonical_bytes`).
    """
    return canonical_bytes(value).decode()


def _canonical_std(value: Any) -> bytes:
    return json.dumps(strip_source(value), sort_keys=True, ensure_ascii=False,
                      separators=(",", ":"), allow_nan=False).encode()


_ORJSON_RISKY = re.compile(rb"0\.0000|e-[0-9](?![0-9])")
"""Where orjson's numbers may be spelled unlike the json module's: below 1e-4 it writes
``0.00001`` and ``1e-7`` where json writes ``1e-05`` and ``1e-07`` (every other double
and every string is spelled alike: checked over 2.6M doubles and all code points)."""


def canonical_bytes(value: Any) -> bytes:
    """:func:`canonical` as UTF-8 bytes.  With orjson, the points' top-level ``source``
    keys are dropped from shallow copies and orjson writes the sorted text, 5× faster;
    when that text could differ from the json module's (a ``"source"`` left at a deeper
    level or in a string, a number below 1e-4, nesting orjson refuses), or when this
    orjson spells its probes differently (:func:`_orjson_canonical_ok`), the json
    module writes it.  So the hash never depends on whether orjson is installed."""
    if _canonical_orjson and _orjson is not None:
        if type(value) is list:
            top = []
            for item in value:
                if type(item) is dict and "source" in item:
                    item = item.copy()
                    del item["source"]
                top.append(item)
        elif type(value) is dict and "source" in value:
            top = value.copy()
            del top["source"]
        else:
            top = value
        try:
            text = _orjson.dumps(top, option=_orjson.OPT_SORT_KEYS)
        except TypeError:  # nesting past 255 levels, an integer beyond 64 bits
            pass
        else:
            if b'"source"' not in text and b"0.0000" not in text and (
                    b"e-" not in text or not _ORJSON_RISKY.search(text)):
                return text
    return _canonical_std(value)


def compact_json(value: Any) -> str:
    """``json.dumps(value, separators=(",", ":"))`` (ASCII, numbers as the json module
    spells them), through orjson when its text is the same."""
    if _canonical_orjson and _orjson is not None:
        try:
            text = _orjson.dumps(value)
        except TypeError:
            pass
        else:
            if (text.isascii() and b"\x7f" not in text and b"0.0000" not in text
                    and (b"e-" not in text or not _ORJSON_RISKY.search(text))):
                return text.decode()
    return json.dumps(value, separators=(",", ":"))


_CANONICAL_PROBES = (0.1, 1e16, 1.5e16, 1e22, 5e-324, 1.7976931348623157e308, 123456.789,
                     -0.0, 1e15, 1e-4, 1.2e-10, 1.2e-300, (1 << 63) - 1, -(1 << 63), True,
                     None, "\u00e9\x00\x1f\"\\/\n\t\b\f\r\u2028\x7f\U0001d11e",
                     {"b": 1, "a": [False, {}], "\u00e9": 1, "z": 2, "\U0001d11e": 3,
                      "\uffff": 4, "": 5})


def _orjson_canonical_ok() -> bool:
    """Does this orjson spell every probe as the json module does (or get flagged)?"""
    if _orjson is None:
        return False
    try:
        for probe in _CANONICAL_PROBES:
            text = _orjson.dumps(probe, option=_orjson.OPT_SORT_KEYS)
            if text != _canonical_std(probe) and not _ORJSON_RISKY.search(text):
                return False
    except Exception:  # an orjson too old for this use: the json module it is
        return False
    return True


_canonical_orjson = _orjson_canonical_ok()


TIME_KEYS = frozenset(("date", "start", "end", "startDate", "endDate", "sleepStart", "sleepEnd",
                       "inBedStart", "inBedEnd", "scheduledDate"))
"""Keys whose values are times: compared as instants, so the same moment re-spelled
(12-hour with U+202F after an iOS locale change, ISO, a literal ``Z``) is the same."""


def same_field(key: str, a: Any, b: Any) -> bool:
    """The values of one key are the same: for a key of :data:`TIME_KEYS` whose values
    both read as times, at least one of them text, the same instant (to the microsecond)
    however it is spelled; else :func:`same_value` (two numbers compare as numbers: the
    microseconds of a float epoch are the last digits' noise)."""
    if key in TIME_KEYS and (type(a) is str or type(b) is str) and not (
            a == b and type(a) is str and type(b) is str):
        instant = parse_time(a)
        if instant is not None:
            other = parse_time(b)
            if other is not None:
                return instant == other
    return same_value(a, b)


_LIST_KINDS = {list}
"""What :func:`same_value` compares element by element: lists, and a large record's array
left in its text (``Deferred``, added where the fold's extraction defines it)."""


def same_value(a: Any, b: Any) -> bool:
    """Same structure, equal strings and booleans, numbers equal within 1e-12 relative,
    times (:data:`TIME_KEYS`) equal as instants; ``source`` is ignored at every level."""
    if a == b and type(a) is type(b) and type(a) is not dict and type(a) is not list:
        return True
    ta, tb = type(a), type(b)
    if ta is dict:
        if tb is not dict:
            return False
        keys = a.keys() - {"source"}
        if keys != b.keys() - {"source"}:
            return False
        return all(same_field(k, a[k], b[k]) for k in keys)
    if ta is list or ta in _LIST_KINDS:
        return (tb is list or tb in _LIST_KINDS) and len(a) == len(b) and all(
            map(same_value, a, b))
    if ta is bool or tb is bool:
        return ta is tb and a == b
    if (ta is int or ta is float) and (tb is int or tb is float):
        if a == b:
            return True
        try:
            return abs(a - b) <= SAME_VALUE_REL * max(abs(a), abs(b))
        except OverflowError:  # integers beyond a double: only exact equality counts
            return False
    return ta is tb and a == b


_ABSENT = object()


def same_point(a: Any, b: Any) -> bool:
    """:func:`same_value`, faster for the usual pair of flat points: each key's values
    are compared in place, and only a pair that is not plainly equal (a number
    re-spelled, a time in another spelling, a nested value) asks :func:`same_field`."""
    if type(a) is not dict or type(b) is not dict:
        return same_value(a, b)
    compared = 0
    for key, mine in a.items():
        if key == "source":
            continue
        theirs = b.get(key, _ABSENT)
        kind = type(mine)
        if not (kind is type(theirs) and mine == theirs and kind is not dict
                and kind is not list):
            if theirs is _ABSENT or not same_field(key, mine, theirs):
                return False
        compared += 1
    return compared == len(b) - ("source" in b)


def is_empty(value: Any) -> bool:
    """``null``, ``""``, a number equal to 0, ``{}``, ``[]``; ``false`` is not empty."""
    if value is None:
        return True
    kind = type(value)
    if kind is int or kind is float:
        return value == 0
    if kind is str or kind is dict or kind is list:
        return not value
    return False


def content_keys(point: Any) -> frozenset:
    """C(p): keys other than ``source`` whose value is not empty (∅ for non-objects)."""
    if type(point) is not dict:
        return frozenset()
    return frozenset(k for k, v in point.items() if k != "source" and not is_empty(v))


def all_keys(point: Any) -> frozenset:
    """K(p): keys other than ``source`` (∅ for non-objects)."""
    if type(point) is not dict:
        return frozenset()
    return frozenset(k for k in point if k != "source")


def dominates(a: Any, b: Any) -> bool:
    """a is more complete than b: strictly more content carrying b's content, or equal
    content and strictly more (empty) keys (STO-2)."""
    ca, cb = content_keys(a), content_keys(b)
    if ca > cb:
        return all(same_field(k, a[k], b[k]) for k in cb)
    return ca == cb and all_keys(a) > all_keys(b)


def incomparable(a: Any, b: Any) -> bool:
    """Each carries a content key the other lacks (the rare case STO-2.5 observes)."""
    ca, cb = content_keys(a), content_keys(b)
    return bool(ca - cb) and bool(cb - ca)


def _arrived(point: Any) -> str:
    """The arrived point as text: the tie-break among candidates of one canonical form."""
    return json.dumps(point, ensure_ascii=False)


def _no_deadline() -> None:
    """The default ``check_deadline``: never expires."""


_DEADLINE_EVERY = 1024
"""Comparisons between two deadline checks inside a long reduction."""


def reduce_candidates(points: list,
                      check_deadline: Callable[[], None] = _no_deadline) -> tuple:
    """One delivery's candidates for one coordinate → (winner, lost).

    Drops every candidate dominated by another, then takes the greatest by canonical
    form, then by arrived text; the result never depends on the JSON array order.
    ``lost`` counts the distinct values dropped that were neither the same value as the
    winner nor dominated: information the store does not keep, never silent.
    Close to linear in the candidates: each one's canonical form and key sets are
    computed once, candidates of one canonical form collapse first, and dominance is
    asked between groups of equal key sets, through an index of the richer group's
    values (:class:`_ValueIndex`).  ``check_deadline`` is called inside, so a hostile body with
    thousands of rivals at one coordinate ends at the fold deadline.
    """
    if len(points) == 1:
        return points[0], 0
    forms: dict = {}  # canonical form -> [arrived points of that form]
    for point in points:
        forms.setdefault(canonical(point), []).append(point)
    check_deadline()
    groups: dict = {}  # (C, K) -> {canonical form: the greatest arrived point of it}
    for form, same in forms.items():
        point = same[0] if len(same) == 1 else max(same, key=_arrived)
        groups.setdefault((content_keys(point), all_keys(point)), {})[form] = point
    survivors: dict = {}
    for keys, members in groups.items():
        check_deadline()
        for rival_keys, rivals in groups.items():
            if rival_keys is not keys:
                members = _undominated(members, keys, rivals, rival_keys, check_deadline)
                if not members:
                    break
        if members:
            survivors[keys] = members
    best = max(form for members in survivors.values() for form in members)
    winner = next(members[best] for members in survivors.values() if best in members)
    lost = sum(1 for members in survivors.values() for form, point in members.items()
               if form != best and not same_value(point, winner))
    return winner, lost


def _undominated(members: dict, keys: tuple, rivals: dict, rival_keys: tuple,
                 check_deadline: Callable[[], None]) -> dict:
    """The members (all of key sets ``keys``) that no rival (all of ``rival_keys``)
    dominates: :func:`dominates` asked once per group, not once per pair."""
    (content, every), (rival_content, rival_every) = keys, rival_keys
    if rival_content == content:
        return {} if rival_every > every else members
    if not rival_content > content:
        return members
    if not content:
        return {}  # nothing to agree on: every rival carries strictly more
    index = _ValueIndex(list(rivals.values()), sorted(content), check_deadline)
    return {form: point for form, point in members.items() if not index.holds(point)}


class _ValueIndex:
    """Points indexed by their values on a set of keys, to ask "does any point have
    the same value as this one on every key?" without comparing every pair.

    The index key is the values with every number replaced by its cell on a
    logarithmic grid far coarser than :data:`SAME_VALUE_REL` (:class:`_Cells`): points
    of the same value share a key, except that a number within the tolerance of a
    cell edge may sit in the next cell, so those few are looked up in both.
    """

    def __init__(self, points: list, keys: list, check_deadline: Callable[[], None]):
        self.points, self.keys, self.check_deadline = points, keys, check_deadline
        self.cells: dict = {}
        for point in points:
            self.cells.setdefault(_Cells(self._values(point)).key, []).append(point)

    def _values(self, point: dict) -> dict:
        return {k: point[k] for k in self.keys}

    def holds(self, point: dict) -> bool:
        cells = _Cells(self._values(point))
        if len(cells.near_edge) > _EDGE_LOOKUPS_MAX:
            return self._scan(self.points, point)  # only a body built to be slow
        return any(self._scan(self.cells.get(key, ()), point) for key in cells.keys())

    def _scan(self, points: Any, point: dict) -> bool:
        for count, other in enumerate(points, 1):
            if count % _DEADLINE_EVERY == 0:
                self.check_deadline()
            if all(same_field(k, other[k], point[k]) for k in self.keys):
                return True
        return False


_CELL_WIDTH = 1e-9
"""Width of a number's cell in natural-log units: 1000 × :data:`SAME_VALUE_REL`, so two
numbers of the same value are at most 0.001 cell apart."""
_CELL_EDGE = 0.002
"""A number this close to its cell's edge (in cells) is also looked up in the next."""
_EDGE_LOOKUPS_MAX = 4


class _Cells:
    """A hashable stand-in for a value (``source`` dropped) in which every number is
    its cell and every time its instant: every value that :func:`same_value` calls the
    same has a stand-in among :meth:`keys` (the numbers near a cell edge taken in
    either neighbouring cell)."""

    def __init__(self, value: Any):
        self.near_edge: list = []  # (ordinal of the number, its other cell)
        self._count, self._flip, self._value = 0, {}, value
        self.key = self._walk(value, record=True)

    def keys(self) -> Iterator[tuple]:
        yield self.key
        edges = self.near_edge
        for mask in range(1, 1 << len(edges)):
            self._count = 0
            self._flip = {edges[i][0]: edges[i][1] for i in range(len(edges)) if mask >> i & 1}
            yield self._walk(self._value, record=False)

    def _walk_field(self, key: str, value: Any, record: bool) -> Any:
        if key in TIME_KEYS:
            instant = parse_time(value)
            if instant is not None:
                return ("time", instant)
        return self._walk(value, record)

    def _walk(self, value: Any, record: bool) -> Any:
        kind = type(value)
        if kind is dict:
            return ("{", tuple(sorted((k, self._walk_field(k, v, record))
                                      for k, v in value.items() if k != "source")))
        if kind is list:
            return ("[", tuple(self._walk(v, record) for v in value))
        if kind is not int and kind is not float:
            return (kind.__name__, value)
        if value == 0:
            return ("0",)
        ordinal = self._count
        self._count += 1
        position = math.log(abs(value)) / _CELL_WIDTH + 0.5  # 1 mid-cell; exact for big ints
        cell = math.floor(position)
        if record:
            if position - cell < _CELL_EDGE:
                self.near_edge.append((ordinal, cell - 1))
            elif cell + 1 - position < _CELL_EDGE:
                self.near_edge.append((ordinal, cell + 1))
        else:
            cell = self._flip.get(ordinal, cell)
        return ("+" if value > 0 else "-", cell)


def arbitrate(stored: Any, stored_position: tuple, arriving: Any,
              arriving_position: tuple) -> tuple:
    """Stored point vs arriving point → (replace, is_collision, is_incomparable).

    The arriving point replaces the stored one when it dominates it, or when neither
    dominates and it is later in journal order.  The same value is no change at all.
    """
    if same_value(stored, arriving):
        return False, False, False
    clash = incomparable(stored, arriving)
    if dominates(arriving, stored):
        return True, True, clash
    if dominates(stored, arriving):
        return False, False, clash
    replace = arriving_position > stored_position
    return replace, replace, clash


# ==============================================================================
# Files and archive: durable writes, raw bodies and their metadata, scratch folders.
# ==============================================================================


def fsync_dir(path: Path) -> None:
    fd = os.open(str(path), os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


_MKDIR_LOCK = threading.Lock()


def makedirs_durable(path: Path) -> None:
    """``mkdir -p`` that fsyncs each parent whose entries it changed.

    Under a lock, so a thread that finds the folder existing knows the fsync that made
    its entry durable has already happened (another thread may have just created it).
    """
    with _MKDIR_LOCK:
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


def _write_all(fd: int, chunk: bytes) -> None:
    """Unbuffered, so a full disk fails here, never later in a flush or a close."""
    view = memoryview(chunk)
    try:
        while view:
            view = view[os.write(fd, view):]
    except OSError as exc:  # disk full (ENOSPC, EFBIG), read-only, I/O error
        raise StorageFailure(exc) from None


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

    def __init__(self, data_dir: Path, tmp: Optional[Path] = None):
        self.data_dir = data_dir
        self.root = data_dir / ARCHIVE_DIR
        self.tmp = tmp or data_dir / TMP_DIR

    def unavailable(self) -> bool:
        """Is the archive missing or empty while the journal lists deliveries (a disk not
        mounted yet)?  Writing then would put bodies beside, not among, the others."""
        return archive_absent(self.data_dir) and journal_has_rows(self.data_dir / DB_NAME)

    def clear_tmp(self) -> int:
        """Remove what dead processes left in ``DATA/tmp``: half uploads (none was
        acknowledged) and scratch folders of a killed ``verify`` (a running one keeps its
        folder locked)."""
        removed = 0
        for entry in self.tmp.iterdir():
            with contextlib.suppress(OSError):
                if entry.is_dir():
                    if not _scratch_in_use(entry):
                        shutil.rmtree(str(entry))
                        removed += 1
                else:
                    entry.unlink()
                    removed += 1
        return removed

    def clear_scratch(self) -> int:
        """Remove the scratch folders of killed rebuilds (``reindex``, ``verify``); the
        uploads of a running ``import`` stay."""
        removed = 0
        for entry in self.tmp.iterdir() if self.tmp.is_dir() else ():
            with contextlib.suppress(OSError):
                if entry.is_dir() and not _scratch_in_use(entry):
                    shutil.rmtree(str(entry))
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
        try:
            fd = os.open(str(tmp_path), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except OSError as exc:
            raise StorageFailure(exc) from None
        try:
            while length is None or size < length:
                want = READ_CHUNK if length is None else min(READ_CHUNK, length - size)
                before_read()
                chunk = read(want)  # an OSError here is the client's connection
                if not chunk:
                    break
                size += len(chunk)
                if size > limit:
                    raise body_too_large(limit)
                digest.update(chunk)
                _write_all(fd, chunk)
            if length is not None and size != length:
                raise BadRequest("the body ended after %d of %d bytes" % (size, length))
            try:
                os.fsync(fd)
            except OSError as exc:
                raise StorageFailure(exc) from None
        except BaseException:
            with contextlib.suppress(OSError):
                tmp_path.unlink()
            raise
        finally:
            os.close(fd)
        return Upload(tmp_path, size, digest.hexdigest())

    def commit(self, upload: Upload, received_at: _dt.datetime, meta: dict) -> str:
        """Write ``.meta.json`` durably, then move the body in: its rename commits.

        Returns the body's path relative to the data directory.
        """
        if self.unavailable():  # never create it: the bodies are on a disk not there yet
            log_event(logging.WARNING, "delivery refused: the archive folder is missing or"
                      " empty (is its disk mounted?); the phone sends it again",
                      archive=str(self.root))
            raise ArchiveUnavailable("the archive is not available; send the body again after"
                                     " %d s" % RETRY_AFTER_S)
        folder, stem = self.names(received_at)
        target_dir = self.data_dir / folder
        makedirs_durable(target_dir)
        meta_bytes = json.dumps(meta, ensure_ascii=False, sort_keys=True, indent=1).encode()
        meta_path = target_dir / (stem + ".meta.json")
        try:
            write_durable(meta_path, meta_bytes + b"\n", mode=0o600)
            os.replace(str(upload.tmp_path), str(target_dir / (stem + ".json")))
        except OSError:  # e.g. DATA/tmp on another file system (EXDEV): no body, no meta
            with contextlib.suppress(OSError):
                meta_path.unlink()
                fsync_dir(target_dir)
            raise
        fsync_dir(target_dir)
        return "%s/%s.json" % (folder, stem)


SCRATCH_LOCK = "in-use.lock"
IMPORT_SCRATCH = "import-"
"""The prefix of an ``import``'s scratch folder under ``DATA/tmp``."""




@contextlib.contextmanager
def scratch_folder(data_dir: Path, prefix: str) -> Iterator[Path]:
    """A private folder under ``DATA/tmp`` for one process (verify's scratch database,
    import's uploads), locked while in use and removed afterwards.  A ``serve`` that
    starts meanwhile leaves it alone; one of a killed process is removed then."""
    tmp = data_dir / TMP_DIR
    tmp.mkdir(mode=0o700, exist_ok=True)  # absent in a directory restored from the archive
    folder = Path(tempfile.mkdtemp(prefix=prefix, dir=str(tmp)))
    fd = os.open(str(folder / SCRATCH_LOCK), os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield folder
    finally:
        shutil.rmtree(str(folder), ignore_errors=True)
        os.close(fd)


def _scratch_in_use(folder: Path) -> bool:
    """Does a live process hold the scratch folder's lock (or is it being created)?"""
    try:
        fd = os.open(str(folder / SCRATCH_LOCK), os.O_RDONLY)
    except FileNotFoundError:
        return time.time() - folder.stat().st_mtime < SCRATCH_GRACE_S
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return True
    finally:
        os.close(fd)
    return False


_NAME_STAMP = re.compile(r"(\d{8}T\d{6}\.\d{6}Z)-[0-9a-f]+\.json", re.ASCII)


def archive_bodies(data_dir: Path, since: str = "") -> list:
    """Every archived body (relative path), sorted; metadata and temp files excluded.
    ``since`` (``archive/YYYY/MM/DD``): only the day folders from that one on."""
    found = []
    for folder, files in archive_walk(data_dir, since):
        for name in files:
            if (name.endswith(".json") and not name.endswith(".meta.json")
                    and not name.startswith(".")):
                found.append(os.path.relpath(os.path.join(folder, name), str(data_dir)))
    return sorted(found)


def archive_walk(data_dir: Path, since: str = "") -> Iterator[tuple]:
    """(folder, its file names) of the archive in name order, skipping the year, month and
    day folders before ``since`` (``archive/YYYY/MM/DD``, compared as text: the names are
    zero-padded)."""
    for folder, dirs, files in os.walk(str(data_dir / ARCHIVE_DIR)):
        relative = os.path.relpath(folder, str(data_dir)) + "/"
        dirs[:] = sorted(d for d in dirs if relative + d >= since[:len(relative + d)])
        yield folder, files


def archive_absent(data_dir: Path) -> bool:
    """Does ``DATA/archive`` hold no year folder (missing, or an empty mount point)?

    A freshly made archive is such a folder too: what the journal says decides whether
    that is a new store or a disk that is not mounted yet (:func:`data_dir_state`).  An
    archive that cannot be listed is there (its permissions are a fault of their own)."""
    try:
        with os.scandir(str(data_dir / ARCHIVE_DIR)) as entries:
            return not any(entry.name.isdigit() and len(entry.name) == 4 for entry in entries)
    except (FileNotFoundError, NotADirectoryError):
        return True
    except OSError:
        return False


def journal_has_rows(db_path: Path) -> bool:
    """Does the database at ``db_path`` exist and list a delivery?  Read-only: it creates
    nothing, and a database that cannot be read counts as listing one (the safe answer
    for :meth:`Archive.unavailable`; opening it properly says what is wrong)."""
    if not db_path.is_file():
        return False
    try:
        conn = sqlite3.connect("file:%s?mode=ro" % urllib.parse.quote(str(db_path)), uri=True)
    except sqlite3.Error:
        return True
    try:
        return conn.execute("SELECT 1 FROM delivery LIMIT 1").fetchone() is not None
    except sqlite3.Error as exc:
        return "no such table" not in str(exc)
    finally:
        conn.close()


def absent_bodies(data_dir: Path, rows: Iterator[tuple]) -> tuple:
    """([ids of bodies provably gone], [relative folders that cannot be read]) for
    ``(id, archive_path)`` rows: a body absent from a readable folder is gone; one whose
    folder is missing or unreadable may be on a disk not mounted yet (one listing per
    folder)."""
    readable: dict = {}
    gone, unreachable = [], []
    for row_id, relative in rows:
        folder, _, name = relative.rpartition("/")
        if folder not in readable:
            try:
                readable[folder] = set(os.listdir(str(data_dir / folder)))
            except OSError:
                readable[folder] = None
                unreachable.append(folder)
        names = readable[folder]
        if names is not None and not (name in names and (data_dir / relative).is_file()):
            gone.append(row_id)
    return gone, unreachable


def body_lost(data_dir: Path, relative: str) -> bool:
    """Is an archived body provably gone: the archive mounted, its day folder readable,
    and the file not in it (:func:`absent_bodies`' rule)?  False whenever the answer might
    be a mount or a permission."""
    return not archive_absent(data_dir) and bool(absent_bodies(data_dir, [(0, relative)])[0])


def received_at_from_name(name: str) -> Optional[str]:
    """``20261129T210321.123456Z-…json`` → ``2026-11-29T21:03:21.123456Z``."""
    match = _NAME_STAMP.fullmatch(name)
    if not match:
        return None
    stamp = match.group(1)
    return "%s-%s-%sT%s:%s:%s" % (stamp[:4], stamp[4:6], stamp[6:8], stamp[9:11], stamp[11:13],
                                  stamp[13:])


def _read_meta(body: Path, relative: str) -> dict:
    """A body's ``.meta.json``; a missing one is ``{}``, a damaged one too, with a WARN:
    the delivery is then adopted without the headers that may decide its layer."""
    path = body.with_name(body.name[:-5] + ".meta.json")
    try:
        meta = json.loads(path.read_text("utf-8"))
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:
        meta = exc
    if type(meta) is not dict:
        log_event(logging.WARNING, "damaged .meta.json: the delivery is adopted without its"
                  " receive headers (its time comes from the file name)",
                  archive_path=relative, error=type(meta).__name__)
        return {}
    return meta


# ==============================================================================
# Body validation and JSON: what ingest accepts, how much at once; reading, writing JSON.
# ==============================================================================

_VALID_OBJECT = object()


def _reject_constant(name: str) -> Any:
    raise ValueError("%s is not valid JSON" % name)


_INT64 = 1 << 63


def _finite_float(text: str) -> float:
    value = float(text)
    if value - value != 0:  # inf (NaN cannot be spelled as a number)
        raise ValueError("number out of range")
    return value


def _int64(text: str) -> int:
    value = int(text)
    if not -_INT64 <= value < _INT64:
        raise ValueError("integer out of range")
    return value


def check_delivery_shape(path: Path, quick_max: Optional[int] = None) -> Optional[tuple]:
    """Validate a whole body as HAE JSON; return (document, plain, its estimated memory)
    when orjson parsed it whole on the way (:func:`_quick_shape_ok`), for the fold
    (:class:`Handoff`).

    Every byte is checked by the JSON scanner, over :func:`shape_text` (one byte a
    character, whatever the characters), and each object collapses into one shared
    sentinel as soon as it is parsed, so memory stays near twice the body's own size
    (:data:`VALIDATION_MEMORY_FACTOR`).
    With orjson, a body up to ``quick_max`` bytes (:func:`quick_check_bytes`; by default
    :data:`QUICK_CHECK_BYTES`) is first offered to :func:`_quick_shape_ok`, which accepts
    only what this check accepts.
    Requires: UTF-8, a top-level object whose ``data`` is an object, and numbers that
    every JSON parser reads alike: no NaN or Infinity, no number that overflows a
    double, no integer beyond 64 bits (orjson refuses the first and rounds the last,
    so the two parse paths could otherwise store different values).
    """
    last_pairs: list = []

    def collapse(pairs: list) -> object:
        last_pairs[:] = [pairs]
        return _VALID_OBJECT

    quick_max = QUICK_CHECK_BYTES if quick_max is None else min(quick_max, QUICK_CHECK_BYTES)
    if _orjson is not None and path.stat().st_size <= quick_max:
        body = path.read_bytes()
        doc = _quick_shape_ok(body)
        if doc is not None:
            return doc, not may_hold_booleans(body), document_cost(body)
        del body
    text = shape_text(path)
    try:
        top = json.loads(text, object_pairs_hook=collapse, parse_constant=_reject_constant,
                         parse_float=_finite_float, parse_int=_int64)
        lone = ("\\ud" in text or "\\uD" in text) and _lone_surrogate(text)
    except (ValueError, RecursionError):
        raise BadRequest("the body is not valid JSON, or holds a number out of range") from None
    finally:
        del text
    if lone:  # no UTF-8 spelling exists for it, so no store could hold it
        raise BadRequest("the body holds an unpaired UTF-16 surrogate escape")
    if top is not _VALID_OBJECT or not last_pairs:
        raise BadRequest("the body must be a JSON object with a \"data\" object")
    data = [value for key, value in last_pairs[0] if key == "data"]
    if not data or data[-1] is not _VALID_OBJECT:
        raise BadRequest("the body must be a JSON object with a \"data\" object")
    return None


SHAPE_READ_CHUNK = 1 << 20
"""Bytes of a body read into place and proven UTF-8 at a time (:func:`shape_text`)."""
UTF8_CHECK_STEP = 1 << 14
"""Bytes decoded at a time only to prove them UTF-8 (:func:`shape_text`): their text, up
to 4 bytes a character, is dropped at once."""
_ONE_BYTE_A_CHARACTER = bytes.maketrans(bytes(range(0xC0, 0x100)), b"#" * 64)
_CONTINUATION_BYTES = bytes(range(0x80, 0xC0))
"""UTF-8 to one byte a character: a lead byte to ``#``, its continuation bytes dropped."""


def shape_text(path: Path) -> str:
    """The body's text for :func:`check_delivery_shape`'s scanner, ASCII, every non-ASCII
    character written as one ``#``; BadRequest when the body is not UTF-8.

    Decoded whole, a body takes 1, 2 or 4 bytes a character for all of its text, as its
    widest character needs: a single emoji in a ``source`` made a body's check take 4.8
    times its size.  Here the body is read into one buffer and proven UTF-8 a chunk at a
    time, then written one byte a character at once, and the text takes one byte a
    character: two of the three (bytes, their translation, the text) at a time, twice
    the body at most, whatever characters it holds.  The JSON verdict is the same,
    because ``#`` is valid exactly where a non-ASCII character is: inside a string, not
    after a backslash (an escape), not in a ``\\u`` escape's four digits, nowhere outside
    a string (the json module's C scanner reads only ASCII digits, hex digits, whitespace
    and literals); and a key with one is ``data`` neither way.  Escapes stay as written,
    so an unpaired surrogate escape is found as before."""
    utf8 = codecs.getincrementaldecoder("utf-8")()  # strict: what body.decode() refused
    with open(str(path), "rb", buffering=0) as handle:
        body = bytearray(os.fstat(handle.fileno()).st_size)
        view, read = memoryview(body), 0
        try:
            while read < len(body):
                got = handle.readinto(view[read:read + SHAPE_READ_CHUNK])
                if not got:
                    break
                _prove_utf8(utf8, view[read:read + got])
                read += got
        finally:
            view.release()
        del body[read:]
        chunk = handle.read(1)  # nothing, unless the file grew since its size was read
        while chunk:  # (a read of a chunk's size would take that much memory first)
            chunk += handle.read(SHAPE_READ_CHUNK)
            _prove_utf8(utf8, chunk)
            body += chunk
            chunk = handle.read(1)
    _prove_utf8(utf8, b"", final=True)  # a character cut by the end of the body
    if not body.isascii():  # at once: no chunk's copies left behind in the allocator
        body = body.translate(_ONE_BYTE_A_CHARACTER, _CONTINUATION_BYTES)
    return body.decode("ascii")


def _prove_utf8(utf8: codecs.IncrementalDecoder, data: Any, final: bool = False) -> None:
    """Feed ``data`` to the strict decoder ``utf8``, a step at a time, dropping the text;
    BadRequest when it is not UTF-8.  A character cut by a step's end is completed by the
    next step or chunk."""
    try:
        for step in range(0, len(data), UTF8_CHECK_STEP):  # up to 4 bytes a character
            utf8.decode(data[step:step + UTF8_CHECK_STEP])
        if final:
            utf8.decode(b"", final=True)
    except UnicodeDecodeError:
        raise BadRequest("the body is not UTF-8 text") from None


QUICK_CHECK_BYTES = 4 << 20
"""Bodies up to this size are first checked by orjson, about 2× faster than the full check
but holding the whole document for a moment: :func:`validation_bytes` counts it."""

QUICK_CHECK_FACTOR = 32
"""Resident memory of orjson's check per body byte, at most: 4× for HAE bodies, 27× for a
body of empty objects (measured)."""

QUICK_CHECK_DEPTH = 256
"""Nesting the quick check accepts; deeper bodies go to the full check, whose limit is the
interpreter's recursion limit less the stack in use (orjson's is 1024)."""

_DIGITS_AS_ZEROS = bytes(48 if 48 <= i <= 57 else 46 if i == 46 else 32 for i in range(256))
"""Digits to ``0``, the decimal point kept, every other byte to a space: an integer part of
19 digits is then ``" " + 19 × "0"`` (a fraction's digits follow a ``.``)."""


def document_cost(body: bytes) -> int:
    """The memory a parsed body is counted for while it waits for the fold:
    :data:`HANDOFF_BYTE_COST` per byte, or :data:`HANDOFF_CONTAINER_COST` per object or
    array, whichever is more (braces inside strings count too: never less)."""
    return max(HANDOFF_BYTE_COST * len(body),
               HANDOFF_CONTAINER_COST * (body.count(b"{") + body.count(b"[")))


def _quick_shape_ok(body: bytes) -> Optional[dict]:
    """The document, when orjson proves the body acceptable (else None).  orjson refuses
    what the full check
    refuses (invalid UTF-8, a BOM, NaN, Infinity, a double overflow, an unpaired
    surrogate escape), except integers beyond 64 bits, which it reads as floats, and
    nesting between the full check's recursion limit and its own 1024: a run of 19
    digits anywhere, or nesting past :data:`QUICK_CHECK_DEPTH`, leaves the verdict to the
    full check, as does every body orjson refuses (for the message).  (A long run of
    digits in a string or an exponent sends the body to the full check too: slower,
    never wrong.)"""
    try:
        doc = _orjson.loads(body)
    except ValueError:
        return None
    if type(doc) is not dict or type(doc.get("data")) is not dict:
        return None
    if not _nested_at_most(doc, QUICK_CHECK_DEPTH):
        return None
    return doc if b" 0000000000000000000" not in body.translate(_DIGITS_AS_ZEROS) else None


def _nested_at_most(doc: Any, limit: int) -> bool:
    """Are ``doc``'s containers nested at most ``limit`` deep?  Level by level, no
    recursion."""
    level, depth = [doc], 0
    while level:
        depth += 1
        if depth > limit:
            return False
        below: list = []
        for container in level:
            for value in container.values() if type(container) is dict else container:
                if type(value) is dict or type(value) is list:
                    below.append(value)
        level = below
    return True


def validation_bytes(size: int, quick_max: int = QUICK_CHECK_BYTES) -> int:
    """What validating a body of ``size`` bytes counts against the shared ceiling: the
    body and its document while orjson checks it (up to ``quick_max`` bytes), else the
    body (whose check holds :data:`VALIDATION_MEMORY_FACTOR` times it)."""
    if _orjson is not None and size <= min(quick_max, QUICK_CHECK_BYTES):
        return QUICK_CHECK_FACTOR * size
    return size


def validation_ceiling(max_body_bytes: int) -> int:
    """Body bytes validated at once (:class:`ByteBudget`): :data:`VALIDATION_CEILING_BYTES`,
    or the largest body allowed when that is smaller, so that the checks running at once
    hold no more than the check of the largest body alone (:func:`memory_needed_mib`)."""
    return min(VALIDATION_CEILING_BYTES, max_body_bytes)


class ByteBudget:
    """Admission by size, first come first served: what holders hold together stays
    under ``ceiling``, except that a holder alone may exceed it (a body larger than the
    ceiling waits until nothing else is held)."""

    def __init__(self, ceiling: int):
        self.ceiling = ceiling
        self.held = 0
        self._line: collections.deque = collections.deque()
        self._changed = threading.Condition()

    @contextlib.contextmanager
    def hold(self, size: int, timeout: float) -> Iterator[None]:
        """Hold ``size`` bytes for the block; ServiceBusy after ``timeout`` s of waiting."""
        deadline = time.monotonic() + timeout
        me = object()
        with self._changed:
            self._line.append(me)
            try:
                while self._line[0] is not me or (self.held and
                                                  self.held + size > self.ceiling):
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        raise ServiceBusy("too many uploads are being checked at once;"
                                          " send the body again after %d s" % RETRY_AFTER_S)
                    self._changed.wait(remaining)
                self.held += size
            finally:
                self._line.remove(me)
                self._changed.notify_all()
        try:
            yield
        finally:
            with self._changed:
                self.held -= size
                self._changed.notify_all()


def quick_check_bytes(max_body_bytes: int) -> int:
    """The largest body offered to orjson's quick check when bodies up to
    ``max_body_bytes`` are accepted: :data:`QUICK_CHECK_BYTES`, or less, so that its worst
    (:data:`QUICK_CHECK_FACTOR` times the body, what it counts against the ceiling) stays
    within what the full check of the largest body may take
    (:data:`VALIDATION_MEMORY_FACTOR` times it): every body up to 4 MiB with 64 MiB
    allowed, up to 67 KiB with 1 MiB."""
    return min(QUICK_CHECK_BYTES,
               int(VALIDATION_MEMORY_FACTOR * max_body_bytes) // QUICK_CHECK_FACTOR)


_SURROGATE_ESCAPES = re.compile(
    r"\\\\|\\u[dD][89abAB][0-9a-fA-F]{2}\\u[dD][c-fC-F][0-9a-fA-F]{2}"
    r"|(\\u[dD][89a-fA-F][0-9a-fA-F]{2})")
"""In valid JSON every backslash opens an escape; read left to right, an escaped
backslash and a paired surrogate are skipped whole, so group 1 is a lone surrogate."""


def _lone_surrogate(text: str) -> bool:
    """Does valid JSON text escape a UTF-16 surrogate without its pair?  A scan, not a
    parse: memory stays flat however large the body."""
    return any(match.group(1) for match in _SURROGATE_ESCAPES.finditer(text))


def loads_body(body: bytes) -> Any:
    """Parse a delivery: orjson when the host has it, else the standard json module.

    Both refuse NaN and Infinity, so the two paths accept the same bodies.
    """
    if _orjson is not None:
        return _orjson.loads(body)
    return json.loads(body, parse_constant=_reject_constant)


def dumps_points(points: list) -> bytes:
    """The stored points as compact JSON, verbatim: same keys, same order, same strings
    (no escaping of non-ASCII or ``&<>``), every number the same double."""
    if _orjson is not None:
        try:
            return _orjson.dumps(points)
        except TypeError:  # orjson stops at 255 levels of nesting; the json module does not
            pass
    return json.dumps(points, ensure_ascii=False, separators=(",", ":"),
                      allow_nan=False).encode()


def compress_blob(data: bytes) -> bytes:
    """gzip at :data:`GZIP_LEVEL`, without a timestamp.  Through a compressor object:
    ``gzip.compress`` and ``zlib.compress`` took 2.8× as long for an hour's 2 KB
    (measured on Python 3.11).  The deflate stream is the gzip module's; the header's
    operating-system byte may differ by Python version, which no hash depends on."""
    compressor = zlib.compressobj(GZIP_LEVEL, zlib.DEFLATED, 31)
    return compressor.compress(data) + compressor.flush()


def decompress_blob(blob: bytes) -> bytes:
    """The JSON of a gzip blob (one member, as :func:`compress_blob` writes)."""
    return zlib.decompress(blob, 31)


def may_hold_booleans(text: bytes) -> bool:
    """Could JSON text hold a boolean?  (Its literals, or those words in a string.)"""
    return b"true" in text or b"false" in text


def _json_bytes(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


# ==============================================================================
# HAE extraction: which key of ``data`` becomes which metric, whole or hour by hour.
# ==============================================================================


def _category(point: Any) -> str:
    """The category of a stored point's coordinate (:func:`point_coordinate`)."""
    if type(point) is not dict:
        return ""
    category = point.get("value")
    if type(category) is not str:
        category = point.get("kind")
    return category if type(category) is str else ""

RECORD_LAYER = "record"
GROUPINGS = ("default", "seconds", "minutes", "hours", "days", "weeks", "months", "years")
_ALIGNMENT = {"seconds": 0, "minutes": 1, "hours": 2, "days": 3, "weeks": 3, "months": 3,
              "years": 3}
"""How finely a grouping's bucket starts are aligned; data finer than its header
contradicts the header (``default`` mixes seconds and minutes: never contradicted)."""

UNCOVERED_MAX_NAMES = 32
UNCOVERED_MAX_LENGTH = 64
"""HAE has eight sections; a body with dozens of unknown keys, or a key longer than
this, does not look like HAE, and hitting a bound raises the record to WARN (STO-6.3)."""

DENSE_MIN_POINTS = 3
"""A metric with this many bucket points has a say in layer inference."""
POOLED_MIN_POINTS = 2
"""Without a dense metric, this many bucket points over all metrics still tell the layer
(two minute-aligned points cannot come from an hourly export); one point never does."""
INFER_SAMPLE = 256
"""Starts per metric checked against a header: a contradiction shows in any of them."""
STARTS_KEPT = 4096
"""Raw bucket starts a metric keeps for layer inference."""
DISTINCT_COUNTED = max(DENSE_MIN_POINTS, POOLED_MIN_POINTS)
"""Distinct coordinates a large body's index counts per metric: all inference asks."""


def _named(prefix: str, field_names: tuple) -> Callable[[dict], Optional[str]]:
    def name_of(item: dict) -> Optional[str]:
        for key in field_names:
            value = item.get(key)
            if type(value) is str and value.strip():
                return prefix + value.strip()
        return None
    return name_of


SECTIONS = {
    "metrics": None,  # handled by extract_points: one metric per element
    "workouts": lambda item: "workouts",
    "stateOfMind": lambda item: "state_of_mind",
    "ecg": lambda item: "ecg",
    "heartRateNotifications": lambda item: "heart_rate_notifications",
    "symptoms": _named("symptoms/", ("name",)),
    "cycleTracking": _named("cycle_tracking/", ("name",)),
    "medications": _named("medications/", ("displayText", "nickname")),
}
"""``data.<key>`` → metric name of each element.  Any other key is uncovered."""


_NAMED_BY_CONTENT = ("symptoms/", "cycle_tracking/", "medications/")


def loggable_metric(name: str) -> str:
    """A metric name fit for a log record above DEBUG or a report.

    Symptom, cycle-tracking and medication metrics are named after values the user
    entered (a medication's name is health data, and a hash of a word from a short
    list is no protection): logs show only their section, ``medications/…``; the
    layer and hour next to it find the object.
    """
    for prefix in _NAMED_BY_CONTENT:
        if name.startswith(prefix):
            return prefix + "…"
    return name


def point_coordinate(point: dict, times: Optional[dict] = None) -> Optional[tuple]:
    """(start, end, category): the span in UTC µs and the category, the point's
    ``value`` when that is a string (a sleep stage, a cycle-tracking flow), else its
    ``kind`` when that is one (a state of mind's ``daily_mood`` or ``momentary_emotion``),
    else "".  Two records of different stages, or a day's mood and an emotion logged at
    the same moment, can share a span exactly: different facts, never rivals.

    ``times`` (a :class:`TimeMemo`) remembers each timestamp text read, for a fold in
    which many points share their timestamps.
    """
    span = point_span(point, times)
    return None if span is None else span + (_category(point),)


class TimeMemo(dict):
    """Timestamp text → :func:`parse_time`, for one fold: the metrics of a delivery share
    their minutes, so most timestamps are read from a dict, not parsed (1 µs → 0.1 µs).
    Holds at most :data:`TIME_MEMO_MAX` texts; only strings are remembered (``1``, ``1.0``
    and ``True`` are equal keys, not equal times)."""

    def time(self, raw: Any) -> Optional[int]:
        if type(raw) is not str:
            return parse_time(raw)
        instant = self.get(raw, _UNREAD)
        if instant is _UNREAD:
            if len(self) >= TIME_MEMO_MAX:
                self.clear()
            instant = self[raw] = parse_time(raw)
        return instant


_UNREAD = object()
TIME_MEMO_MAX = 1 << 17
"""Timestamps a :class:`TimeMemo` holds (about 10 MB): a day of minutes 90 times over, so
the metrics of a two-month minute export still share them."""


def point_span(point: dict, times: Optional[TimeMemo] = None) -> Optional[tuple]:
    """(start, end) in UTC µs: start = start, else startDate, else date; end = end,
    else endDate, else start.  None when a present timestamp cannot be parsed."""
    read = parse_time if times is None else times.time
    get = point.get
    start = read(raw_start(point))
    if start is None:
        return None
    raw = get("end")
    if raw is None:
        raw = get("endDate")
    if raw is None:
        return start, start
    end = read(raw)
    return None if end is None else (start, end)


@dataclass
class MetricPoints:
    """One metric of one delivery: its points grouped by coordinate."""

    name: str
    is_metric: bool  # time-grouped (data.metrics but sleep), not in the record layer
    units: Optional[str] = None
    coords: dict = _field(default_factory=dict)  # (start, end, category) -> point | [points]
    starts: list = _field(default_factory=list)  # start codes, for layer inference
    has_interval: bool = False

    @property
    def distinct(self) -> int:
        """Distinct coordinates placed (what layer inference counts)."""
        return len(self.coords)

    def hour_coords(self, check_deadline: Callable[[], None]) -> Iterator[tuple]:
        """(hour, {coordinate: point or [candidates]}) for each UTC hour of the points."""
        hours: dict = {}
        for coord, slot in self.coords.items():
            found = hours.get(coord[0] // HOUR_US)
            if found is None:
                found = hours[coord[0] // HOUR_US] = {}
            found[coord] = slot
        self.coords = {}  # the points live on in the hours only, each let go once merged
        while hours:
            yield hours.popitem()


@dataclass
class Extraction:
    """What a body holds, before any comparison with the store."""

    metrics: Any = _field(default_factory=dict)  # (is_metric, name) -> MetricPoints
    """A dict of :class:`MetricPoints`, or a large body's :class:`IndexedMetrics`."""
    points: int = 0
    mixed_units: set = _field(default_factory=set)  # metrics sent in two units: 2nd left out
    bad_points: int = 0
    bad_metrics: set = _field(default_factory=set)
    uncovered: list = _field(default_factory=list)
    uncovered_dropped: int = 0
    uncovered_cut: int = 0
    times: TimeMemo = _field(default_factory=TimeMemo)

    @property
    def has_metric_points(self) -> bool:
        if type(self.metrics) is not dict:
            return self.metrics.has_metric_points()
        return any(m.is_metric and m.distinct for m in self.metrics.values())

    def name_count(self) -> int:
        """Distinct metric names."""
        if type(self.metrics) is not dict:
            return self.metrics.name_count()
        return len({m.name for m in self.metrics.values()})

    def take_buckets(self) -> Iterator[Any]:
        """Each metric once, in order, let go of as the next is taken (the merge)."""
        metrics = self.metrics
        if type(metrics) is not dict:
            yield from metrics.take()
            return
        for key in list(metrics):
            yield metrics.pop(key)


def _bounded_names(keys: list) -> tuple:
    """The uncovered key names kept on the row: (names, dropped by count, cut by length)."""
    names, cut = [], 0
    for key in sorted(keys)[:UNCOVERED_MAX_NAMES]:
        if len(key) > UNCOVERED_MAX_LENGTH:
            key = key[:UNCOVERED_MAX_LENGTH] + "…"
            cut += 1
        names.append(key)
    return names, max(0, len(keys) - UNCOVERED_MAX_NAMES), cut


def extract_points(doc: Any, check_deadline: Callable[[], None] = lambda: None) -> Extraction:
    """Map a parsed body to metric points grouped by coordinate.  Pure.

    Raises ContentNotParsed when the top level is not ``{"data": {…}}``.  Points that
    are not objects or whose time cannot be read are counted in ``bad_points`` (with
    their metric's name), never dropped silently.
    """
    if type(doc) is not dict or type(doc.get("data")) is not dict:
        raise ContentNotParsed("the body is not a JSON object with a \"data\" object")
    out = Extraction()
    data = doc["data"]
    uncovered = [key for key in data if key not in SECTIONS]
    out.uncovered, out.uncovered_dropped, out.uncovered_cut = _bounded_names(uncovered)
    for key, name_of in SECTIONS.items():
        section = data.get(key)
        if section is None:
            continue
        if type(section) is not list:
            out.bad_points += 1
            out.bad_metrics.add(key)
            continue
        if name_of is None:
            for element in section:
                check_deadline()
                _extract_metric(out, element)
        else:
            for element in section:
                _extract_record(out, key, element, name_of)
    return out


def _metric_bucket(out: Extraction, is_metric: bool, name: str) -> MetricPoints:
    bucket = out.metrics.get((is_metric, name))
    if bucket is None:
        bucket = out.metrics[(is_metric, name)] = MetricPoints(name, is_metric)
    return bucket


def _add_point(bucket: MetricPoints, coord: tuple, point: dict) -> None:
    slot = bucket.coords.get(coord)
    if slot is None:
        bucket.coords[coord] = point
    elif type(slot) is list:
        slot.append(point)
    else:
        bucket.coords[coord] = [slot, point]


SLEEP_METRIC = "sleep_analysis"
"""HAE sends sleep per night (nightly records) or per stage segment (records) whatever the
automation's grouping: its points are records, never time-grouped buckets."""


def _extract_metric(out: Extraction, element: Any) -> None:
    name = element.get("name") if type(element) is dict else None
    points = element.get("data") if type(element) is dict else None
    if points is None and type(name) is str and name.strip():
        return  # "data": null: a metric exported without samples, like "data": []
    if type(name) is not str or not name.strip() or type(points) is not list:
        out.bad_points += len(points) if type(points) is list else 1
        out.bad_metrics.add(name if type(name) is str and name.strip() else "metrics")
        return
    bucket = _metric_bucket(out, name != SLEEP_METRIC, name)
    units = element.get("units")
    units = units if type(units) is str else None
    if bucket.coords and units != bucket.units:
        out.mixed_units.add(name)  # never stored under the other units: archive only
        return
    bucket.units = units
    starts, coords, times = bucket.starts, bucket.coords, out.times
    memo, read = times.get, times.time
    placed = 0
    for point in points:  # point_coordinate, inlined: this loop sees every point
        if type(point) is not dict:
            out.bad_points += 1
            out.bad_metrics.add(name)
            continue
        get = point.get
        raw = get("start")  # raw_start, inlined like the rest of point_coordinate here
        if raw is None:
            raw = get("startDate")
            if raw is None:
                raw = get("date")
        start = memo(raw, _UNREAD) if type(raw) is str else _UNREAD
        if start is _UNREAD:
            start = read(raw)
        end_raw = get("end")
        if end_raw is None:
            end_raw = get("endDate")
        if end_raw is None:
            end = start
        else:
            end = memo(end_raw, _UNREAD) if type(end_raw) is str else _UNREAD
            if end is _UNREAD:
                end = read(end_raw)
        if start is None or end is None:
            out.bad_points += 1
            out.bad_metrics.add(name)
            continue
        category = get("value")
        if type(category) is not str:
            category = get("kind")
            if type(category) is not str:
                category = ""
        coord = (start, end, category)
        placed += 1
        slot = coords.get(coord)
        if slot is None:
            coords[coord] = point
        elif type(slot) is list:
            slot.append(point)
        else:
            coords[coord] = [slot, point]
        if start != end:
            bucket.has_interval = True
        elif len(starts) < STARTS_KEPT:
            starts.append(start_code_of(raw))
    out.points += placed


def _extract_record(out: Extraction, section: str, element: Any, name_of: Callable) -> None:
    name = name_of(element) if type(element) is dict else None
    coord = point_coordinate(element, out.times) if name is not None else None
    if coord is None:
        out.bad_points += 1
        out.bad_metrics.add(name or name_of({}) or section)
        return
    out.points += 1
    _add_point(_metric_bucket(out, False, name), coord, element)


def header_layer(value: Optional[str]) -> Optional[str]:
    """The ``automation-aggregation`` header as a layer, or None when it names none."""
    if value is None:
        return None
    layer = value.strip().lower()
    return layer if layer in GROUPINGS else None


def infer_layer(extraction: Extraction, sample: Optional[int] = None) -> Optional[str]:
    """The grouping the delivery's bucket points agree on, in the local time written in
    their timestamps; None when there is too little to tell.

    Bucket points: points of time-grouped metrics (not sleep) without a distinct end.
    Each dense metric (at least :data:`DENSE_MIN_POINTS` points) votes for the coarsest
    alignment all its starts share (the second, minute, hour or day), and the alignment
    with most votes wins (ties: the finer), so a Minutes export whose heart rate is kept
    at the second is still ``minutes``.  Without a dense metric, the starts of all
    metrics are pooled (a one-day Days export: one point at local midnight per metric),
    when there are at least :data:`POOLED_MIN_POINTS`.  At the day alignment,
    ``days``/``weeks``/``months``/``years`` are told from the spacing of the dates of all
    the metrics that share it (a weekly weight beside daily steps is still ``days``).
    ``sample`` limits the starts looked at per metric (enough to see a contradiction of
    a header; the full set when the layer depends on it).
    """
    votes = [0, 0, 0, 0]
    voted_days: set = set()
    pooled_level, pooled_days, pooled_points = 3, set(), 0
    for bucket in extraction.metrics.values():
        if not bucket.is_metric or bucket.has_interval:
            continue
        starts = bucket.starts
        if not starts:
            continue
        alignment = _alignment(starts[:sample])
        if alignment is None:
            continue
        level, days = alignment
        if bucket.distinct >= DENSE_MIN_POINTS:
            votes[level] += 1
            voted_days |= days
        pooled_level = min(pooled_level, level)
        pooled_days |= days
        pooled_points += bucket.distinct
    if any(votes):
        level = max(range(4), key=lambda lvl: (votes[lvl], -lvl))
        return _grouping(level, voted_days)
    if pooled_points >= POOLED_MIN_POINTS:
        return _grouping(pooled_level, pooled_days)
    return None


def _alignment(codes: Sequence) -> Optional[tuple]:
    """(level, days): how coarsely these bucket starts (their :func:`start_code`) are
    aligned in local time (0 the second, 1 the minute, 2 the hour, 3 the day or coarser)
    and, at level 3, the ordinals of their local dates; None when no start can be read."""
    level, days, readable = 3, set(), False
    for code in codes:
        if code < 0:
            continue
        if code == 0:
            return 0, set()
        readable = True
        if code < 3:
            if code < level:
                level = code
        elif level == 3 and code > 3:
            days.add(code - 4)
    return (level, days if level == 3 else set()) if readable else None


def _grouping(level: int, days: set) -> str:
    return ("seconds", "minutes", "hours")[level] if level < 3 else _day_grouping(days)


def _day_grouping(days: set) -> str:
    """days, weeks, months or years, from the ordinals of day-aligned starts' dates."""
    dates = [_dt.date.fromordinal(o) for o in sorted(days)]
    if len(dates) >= 2 and all(d.day == 1 for d in dates):
        return "years" if all(d.month == 1 for d in dates) else "months"
    gaps = [b.toordinal() - a.toordinal() for a, b in zip(dates, dates[1:])]
    if gaps and all(g % 7 == 0 for g in gaps):
        return "weeks"
    return "days"


WHOLE_PARSE_NAMES_MAX = 4096
"""A body below :data:`STREAM_FOLD_BYTES` with more ``"name"`` keys than this is indexed
rather than parsed whole (:func:`extract_body`): a metric parsed whole costs about 1 KB
beside the ~100 bytes of a one-point metric's text (12 times the body), and HAE's widest
body, a Days export of every metric, names about 150."""


def wide_document(doc: Any) -> bool:
    """Does a parsed body hold more metrics, or named records, than
    :data:`WHOLE_PARSE_NAMES_MAX`?"""
    data = doc.get("data") if type(doc) is dict else None
    if type(data) is not dict:
        return False
    return sum(len(data[key]) for key in ("metrics", "symptoms", "cycleTracking", "medications")
               if type(data.get(key)) is list) > WHOLE_PARSE_NAMES_MAX


def body_error(exc: OSError, path: Path) -> ArchiveFault:
    """What an ``OSError`` on an archived body says.  Never the body's own failure: a
    body that is not there (:class:`BodyAbsent`) says where the absence starts (the
    archive, the day folder or the file), and any other error is a fault of the machine
    (permissions, I/O, too many files: :class:`ArchiveFault`).  The delivery waits
    either way; the fold worker alone may decide, much later, that a file is lost."""
    if not isinstance(exc, (FileNotFoundError, IsADirectoryError, NotADirectoryError)):
        return ArchiveFault(exc)
    archive = next((parent for parent in path.parents if parent.name == ARCHIVE_DIR), None)
    if archive is not None and archive_absent(archive.parent):
        return BodyAbsent("archive_missing")
    if not path.parent.is_dir():
        return BodyAbsent("folder_missing")
    return BodyAbsent("body_missing")


def body_size(path: Path) -> int:
    """The size of an archived body, classifying what can go wrong with it."""
    try:
        size = path.stat().st_size
    except OSError as exc:
        raise body_error(exc, path) from None
    if size > FOLD_MAX_BYTES:
        raise BodyTooBig()
    return size


def extract_body(path: Path, check_deadline: Callable[[], None] = lambda: None) -> tuple:
    """(extraction, plain) of an archived body: parsed whole and mapped by
    :func:`extract_points` below :data:`STREAM_FOLD_BYTES`, indexed by
    :func:`index_points` from that size on, or when it names more than
    :data:`WHOLE_PARSE_NAMES_MAX` metrics.  ``plain`` when the text holds no boolean
    (:attr:`HourObject.plain`)."""
    if body_size(path) < STREAM_FOLD_BYTES:
        body = _read_body(path)
        if body.count(b'"name"') <= WHOLE_PARSE_NAMES_MAX:
            plain = not may_hold_booleans(body)
            try:
                doc = loads_body(body)
            except (ValueError, RecursionError):  # UnicodeDecodeError is a ValueError
                raise ContentNotParsed() from None
            del body
            check_deadline()
            return extract_points(doc, check_deadline), plain
        del body  # thousands of metrics: indexed, as a large body is
    text, plain = read_ascii_text(path)
    check_deadline()
    return index_points(text, check_deadline), plain


def _read_body(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError as exc:
        raise body_error(exc, path) from None


_ASCII_BYTES = bytes(range(128))

_ESCAPED_NON_ASCII = re.compile(rb"\\[\x80-\xff]")

LEAN_REPLACE_MAX = 8
"""Distinct non-ASCII characters that :func:`read_ascii_text` replaces pass by pass in a
chunk; a chunk with more is escaped in one decoding pass instead (slower per character)."""


def _json_escape_error(exc: UnicodeDecodeError) -> tuple:
    """Codec error handler: a run of non-ASCII bytes (whole UTF-8 characters, in a body
    validated at ingest) as JSON ``\\u`` escapes."""
    data, end = exc.object, exc.start
    while end < len(data) and data[end] >= 0x80:
        end += 1
    return json.dumps(bytes(data[exc.start:end]).decode("utf-8"))[1:-1], end


codecs.register_error("healthlog-json-escape", _json_escape_error)


ASCII_READ_CHUNK = 1 << 20
"""Bytes of a large body read, checked and escaped at a time (:func:`read_ascii_text`)."""


def read_ascii_text(path: Path) -> tuple:
    """(text, plain): a large archived body as ASCII text for :func:`index_points`.
    Every non-ASCII character (only ever inside a string, in valid JSON) is first
    written as its ``\\u`` escape, so the text takes one byte per character instead of
    two or four; the document it holds is the same.  The file is read here, a chunk at a
    time, so that no caller holds its bytes beside the text: the text's bytes and the
    text itself are the most this holds (2x the body), whatever characters it has.
    What ingest refuses and an escape would make valid (a backslash before a non-ASCII
    character, an unpaired surrogate) is ContentNotParsed, as is text that is not UTF-8."""
    try:
        handle = open(str(path), "rb")
    except OSError as exc:
        raise body_error(exc, path) from None
    out = bytearray()
    carry, before, plain = b"", b"", True
    with handle:
        while True:
            try:
                chunk = handle.read(ASCII_READ_CHUNK)
            except OSError as exc:
                raise ArchiveFault(exc) from None
            piece, carry = carry + chunk, b""
            if not piece:
                break
            if chunk:  # a character cut by the chunk's end waits for the next one
                carry = _incomplete_tail(piece)
                piece = piece[:len(piece) - len(carry)]
            seen = before + piece  # a literal or a backslash across the chunks' seam
            if plain and may_hold_booleans(seen):
                plain = False
            if _ESCAPED_NON_ASCII.search(seen):
                raise ContentNotParsed()  # invalid JSON an escape would make valid
            before = seen[-4:]
            out += piece if piece.isascii() else _escaped_ascii(piece)
            if not chunk:
                break
    try:
        text = out.decode("ascii")
    except UnicodeDecodeError:  # pragma: no cover - _escaped_ascii gives ASCII only
        raise ContentNotParsed() from None
    del out
    if ("\\ud" in text or "\\uD" in text) and _lone_surrogate(text):
        raise ContentNotParsed()  # one surrogate of a pair is no character
    return text, plain


def _incomplete_tail(data: bytes) -> bytes:
    """The last bytes of ``data`` from the start of a UTF-8 character that may continue
    in the next chunk (a lead byte among the last four), else ``b""``."""
    for back in range(1, min(4, len(data)) + 1):
        byte = data[-back]
        if byte < 0x80:
            return b""
        if byte >= 0xC0:
            return data[-back:]
    return b""


def _escaped_ascii(piece: bytes) -> bytes:
    """UTF-8 ``piece`` (whole characters) with every non-ASCII character written as its
    JSON escape: by replacing each character's bytes when they are few
    (:data:`LEAN_REPLACE_MAX`; usually one, the ’ of device names), else with the
    escaping error handler.  ContentNotParsed when it is not UTF-8."""
    try:
        characters = set(piece.translate(None, _ASCII_BYTES).decode("utf-8"))
        if len(characters) <= LEAN_REPLACE_MAX:
            for character in characters:
                piece = piece.replace(character.encode("utf-8"),
                                      json.dumps(character)[1:-1].encode("ascii"))
            if not piece.isascii():  # a byte of no character (not UTF-8)
                raise ContentNotParsed()
            return piece
        return piece.decode("ascii", "healthlog-json-escape").encode("ascii")
    except UnicodeDecodeError:
        raise ContentNotParsed() from None


# -- large bodies: an index of where the points are, each parsed again in its hour -------


_WHITESPACE = re.compile(r"[ \t\n\r]*")

_SCANNER = json.JSONDecoder(parse_constant=_reject_constant, parse_float=_finite_float,
                            parse_int=_int64).scan_once
"""The json module's C scanner with ingest's rules: one JSON value at an index."""

_READ_AGAIN = json.JSONDecoder().scan_once
"""The same scanner without ingest's checks (Python calls for every number), for text
:data:`_SCANNER` has read once already (a point parsed again in its hour) or the fold
wrote itself (a stored object): the same values, three times as fast."""

_scanstring = json.decoder.scanstring


def _scan(text: str, at: int) -> tuple:
    """(value, index after it) of the JSON value at ``text[at]``; ValueError if none."""
    try:
        return _SCANNER(text, at)
    except StopIteration:
        raise ValueError("no JSON value at %d" % at) from None


def _walk_object(text: str, at: int, member: Callable[[str, int], int]) -> int:
    """Walk the object at ``text[at]``: ``member(key, index of its value)`` reads or
    skips each value and returns the index after it.  Returns the index after the
    object; ValueError (or IndexError at the end of the text) when it is not one."""
    if text[at] != "{":
        raise ValueError("not an object")
    space = _WHITESPACE.match
    at = space(text, at + 1).end()
    if text[at] == "}":
        return at + 1
    while True:
        if text[at] != '"':
            raise ValueError("a key must be a string")
        key, at = _scanstring(text, at + 1)
        at = space(text, at).end()
        if text[at] != ":":
            raise ValueError("':' expected")
        at = space(text, member(key, space(text, at + 1).end())).end()
        if text[at] == "}":
            return at + 1
        if text[at] != ",":
            raise ValueError("',' or '}' expected")
        at = space(text, at + 1).end()


# -- a large record's long arrays, left in the text until they are compared or encoded --


class Deferred:
    """An array member of a large record, left where it is in its text (a large body's,
    in memory, or a large stored object's, in a scratch file: :class:`_TextFile`): its
    elements are parsed one at a time whenever it is compared (:func:`same_value` takes
    it for a list) or encoded (:func:`encode_points`).  It never leaves the fold:
    candidates of one coordinate are compared with it made a list (:func:`materialize`),
    a rebuild sends it to its worker as a list, and no object holding one is kept
    decoded."""

    __slots__ = ("source", "at", "count")

    def __init__(self, source: Any, at: int, count: int):
        self.source, self.at, self.count = source, at, count

    def __len__(self) -> int:
        return self.count

    def __iter__(self) -> Iterator[Any]:
        cursor = _Cursor(self.source, self.at)
        cursor.take("[")
        for index in range(self.count):
            if index:
                cursor.take(",")
            yield cursor.value()

    def __reduce__(self) -> tuple:
        return list, (list(self),)


_LIST_KINDS.add(Deferred)


class _TextFile:
    """A large stored object's JSON, inflated and written as ASCII text
    (:func:`read_ascii_text`'s escapes) into an anonymous file under ``DATA/tmp``, a chunk
    at a time: read back a window at a time (:class:`_Cursor`), it is never whole in
    memory.  ``categorized``: it holds a ``"value"`` or ``"kind"`` key (or text);
    ``plain``: no ``true`` or ``false``."""

    __slots__ = ("file", "categorized", "plain")

    def __init__(self, scratch: Path, blob: bytes):
        self.categorized, self.plain = False, True
        try:
            scratch.mkdir(mode=0o700, exist_ok=True)
            self.file = tempfile.TemporaryFile(dir=str(scratch))
            inflate = zlib.decompressobj(31)
            carry, data, before = b"", blob, b""
            while not inflate.eof:
                chunk = inflate.decompress(data, ASCII_READ_CHUNK)
                data = inflate.unconsumed_tail
                if not chunk and not data and not inflate.eof:
                    raise zlib.error("the stored object ends early")
                piece = carry + chunk
                carry = b"" if inflate.eof else _incomplete_tail(piece)
                piece = piece[:len(piece) - len(carry)]
                piece = piece if piece.isascii() else _escaped_ascii(piece)
                seen = before + piece
                self.categorized = self.categorized or b'"value"' in seen or b'"kind"' in seen
                self.plain = self.plain and not may_hold_booleans(seen)
                before = seen[-8:]
                self.file.write(piece)
        except OSError as exc:
            raise ScratchFault(exc) from None

    def read(self, at: int, size: int) -> str:
        try:
            self.file.seek(at)
            return self.file.read(size).decode("ascii")
        except OSError as exc:
            raise ScratchFault(exc) from None


class _Cursor:
    """Reads JSON a value at a time from a text in memory (a ``str``) or in a
    :class:`_TextFile`, whose window it moves on as it goes (a value is whole in the
    window when it is read).  ``at`` is where it is in the whole text."""

    __slots__ = ("source", "text", "base", "at", "ended")

    def __init__(self, source: Any, at: int):
        self.source, self.at = source, at
        if type(source) is str:
            self.text, self.base, self.ended = source, 0, True
        else:
            self.text, self.base, self.ended = "", at, False

    def _read_more(self) -> bool:
        """More of the text in the window (what is behind ``at`` let go); False at its end."""
        if self.ended:
            return False
        more = self.source.read(self.base + len(self.text),
                                max(ASCII_READ_CHUNK, len(self.text)))  # a long value: O(n)
        if not more:
            self.ended = True
            return False
        self.text = self.text[self.at - self.base:] + more
        self.base = self.at
        return True

    def peek(self) -> str:
        """The next character that is not white space (``at`` moved to it)."""
        text, at = self.text, self.at - self.base
        if at < len(text) and text[at] not in " \t\n\r":
            return text[at]
        while True:
            found = _WHITESPACE.match(self.text, self.at - self.base).end()
            self.at = self.base + found
            if found < len(self.text):
                return self.text[found]
            if not self._read_more():
                raise ValueError("the text ends early")

    def take(self, character: str) -> None:
        if self.peek() != character:
            raise ValueError("%r expected" % character)
        self.at += 1

    def value(self) -> Any:
        self.peek()
        while True:
            try:
                value, end = _READ_AGAIN(self.text, self.at - self.base)
            except (StopIteration, ValueError):
                if self._read_more():
                    continue
                raise ValueError("no JSON value") from None
            if end + 3 > len(self.text) and self._read_more():  # a number may go on ("12." + "5")
                continue
            self.at = self.base + end
            return value

    def key(self) -> str:
        if self.peek() != '"':
            raise ValueError("a key must be a string")
        while True:
            try:
                key, end = _scanstring(self.text, self.at - self.base + 1)
            except ValueError:
                if self._read_more():
                    continue
                raise
            self.at = self.base + end
            return key


def _shallow(text: str, at: int) -> tuple:
    """(value, index after it) of the value at ``text[at]`` (:func:`_shallow_at`)."""
    cursor = _Cursor(text, at)
    return _shallow_at(cursor), cursor.at


def _shallow_at(cursor: _Cursor) -> Any:
    """The value at the cursor, an object's array members of more than
    :data:`DEFER_MIN_ELEMENTS` elements left in the text (:class:`Deferred`).  Only for
    text a walk or a dump has already checked."""
    if cursor.peek() != "{":
        return cursor.value()
    cursor.take("{")
    point: dict = {}
    if cursor.peek() == "}":
        cursor.at += 1
        return point
    while True:
        key = cursor.key()
        cursor.take(":")
        if cursor.peek() == "[":
            start = cursor.at
            cursor.take("[")
            elements, count = [], 0
            if cursor.peek() == "]":
                cursor.at += 1
            else:
                while True:
                    element = cursor.value()
                    count += 1
                    if count <= DEFER_MIN_ELEMENTS:
                        elements.append(element)
                    elif count == DEFER_MIN_ELEMENTS + 1:
                        elements = []  # let go: the array stays in the text
                    if cursor.peek() == "]":
                        cursor.at += 1
                        break
                    cursor.take(",")
            point[key] = (Deferred(cursor.source, start, count)
                          if count > DEFER_MIN_ELEMENTS else elements)
        else:
            point[key] = cursor.value()
        if cursor.peek() == "}":
            cursor.at += 1
            return point
        cursor.take(",")


def holds_deferred(points: list) -> bool:
    return any(type(point) is dict and any(type(v) is Deferred for v in point.values())
               for point in points)


def materialize(point: Any) -> Any:
    """The point with every :class:`Deferred` member a list (the point itself when it
    holds none)."""
    if type(point) is not dict or not any(type(v) is Deferred for v in point.values()):
        return point
    return {key: list(value) if type(value) is Deferred else value
            for key, value in point.items()}


def _stored_points(source: _TextFile) -> list:
    """A large stored object's points, each :func:`_shallow_at`."""
    cursor = _Cursor(source, 0)
    cursor.take("[")
    points: list = []
    if cursor.peek() == "]":
        return points
    while True:
        points.append(_shallow_at(cursor))
        if cursor.peek() == "]":
            return points
        cursor.take(",")


def _stored_size(blob: bytes) -> int:
    """The size of a stored object's JSON (gzip's ISIZE: its length modulo 2**32)."""
    return int.from_bytes(blob[-4:], "little") if len(blob) >= 18 else 0


_RECORD_FIELDS = frozenset(("name", "displayText", "nickname", "start", "startDate", "date",
                            "end", "endDate", "value", "kind"))
"""The members of a record element that name its metric and place it (:data:`SECTIONS`,
:func:`point_coordinate`): the index reads only these, and walks past the others (a
workout's route, its heart rate) an element at a time, never building the record."""

_RECOUNT = 255
"""A bucket's ``distinct`` when several elements placed points in it: counted again from
its points if asked (only layer inference asks, of time-grouped metrics)."""


class BodyIndex:
    """The columns every section of a large body shares (:func:`index_points`): each
    point's offset in the text, in the order the walk placed them, grouped in runs of one
    UTC hour (``run_hours``, ``run_lens``), and the start codes layer inference reads
    (:func:`start_code`).  About 20 bytes a point when every point has an hour of its
    own, 4 when an hour holds many."""

    __slots__ = ("text", "offsets", "run_hours", "run_lens", "starts")

    def __init__(self, text: str):
        self.text: Optional[str] = text
        self.offsets = array.array("I" if len(text) < 1 << 32 else "q")
        self.run_hours = array.array("q")
        self.run_lens = array.array("I")
        self.starts = array.array("i")


class _Segment:
    """What the walk placed of one element's points: runs from ``run0``, offsets from
    ``off0`` (``placed`` of them), start codes from ``start0``; ``count`` points, ``bad``
    of them not placed; up to :data:`DISTINCT_COUNTED` distinct coordinates."""

    __slots__ = ("run0", "runs", "off0", "placed", "start0", "nstart", "count", "bad",
                 "interval", "coords")

    def __init__(self, index: BodyIndex):
        self.run0, self.runs = len(index.run_hours), 0
        self.off0, self.placed = len(index.offsets), 0
        self.start0, self.nstart = len(index.starts), 0
        self.count = self.bad = 0
        self.interval = False
        self.coords: list = []


class _Buckets:
    """The metrics of one section of a large body, in the order they first appear, as
    columns rather than objects: a body of a million one-point metrics costs about 60
    bytes a metric beside its text.  A metric is found by the hash of its name in an
    open-addressing table of bucket numbers; a ``data.metrics`` name is kept as where it
    is in the text and read again when asked (a record's, made from its content, is
    kept).  A bucket's points are its first segment's (in its own columns) and any
    further ones (``more``): the elements of one metric, in order, as
    :meth:`IndexedMetric.absorb` used to join them."""

    __slots__ = ("index", "section", "record", "hashes", "name_at", "names", "flags", "units",
                 "distinct", "placed", "run0", "runs", "off0", "offn", "start0", "nstart",
                 "more", "slots", "points", "bad_points", "bad_metrics", "mixed_units")

    def __init__(self, index: BodyIndex, section: str):
        self.index, self.section = index, section
        self.record = SECTIONS[section] is not None
        self.hashes = array.array("q")
        self.name_at = array.array("q")  # data.metrics: the offset of the name's string
        self.names: list = []  # records: the names
        self.flags = bytearray()  # 1: time-grouped (is_metric); 2: a point has an interval
        self.units: list = []
        self.distinct = bytearray()
        self.placed = array.array("i")
        self.run0, self.runs = array.array("i"), array.array("i")
        self.off0, self.offn = array.array("i"), array.array("i")
        self.start0, self.nstart = array.array("i"), array.array("i")
        self.more: dict = {}  # bucket -> [(run0, runs, off0, offn, start0, nstart)]
        self.slots = array.array("i", [-1]) * 8
        self.points = self.bad_points = 0
        self.bad_metrics: set = set()
        self.mixed_units: set = set()

    def __len__(self) -> int:
        return len(self.hashes)

    def name(self, b: int) -> str:
        if self.record:
            return self.names[b]
        return _scan(self.index.text, self.name_at[b])[0]

    def bucket(self, is_metric: bool, name: str, name_at: int) -> int:
        """The bucket of (is_metric, name), made if it is new."""
        h = hash(name)
        slots, hashes, flags = self.slots, self.hashes, self.flags
        mask = len(slots) - 1
        i = h & mask
        while True:
            b = slots[i]
            if b < 0:
                break
            if hashes[b] == h and (flags[b] & 1) == is_metric and self.name(b) == name:
                return b
            i = (i + 1) & mask
        b = len(hashes)
        slots[i] = b
        hashes.append(h)
        if self.record:
            self.names.append(name)
        else:
            self.name_at.append(name_at)
        flags.append(1 if is_metric else 0)
        self.units.append(None)
        self.distinct.append(0)
        for column in (self.placed, self.run0, self.runs, self.off0, self.offn, self.start0,
                       self.nstart):
            column.append(0)
        if 2 * len(hashes) > len(slots):
            self._grow()
        return b

    def _grow(self) -> None:
        slots = array.array("i", [-1]) * (2 * len(self.slots))
        mask = len(slots) - 1
        for b, h in enumerate(self.hashes):
            i = h & mask
            while slots[i] >= 0:
                i = (i + 1) & mask
            slots[i] = b
        self.slots = slots

    def absorb(self, b: int, segment: _Segment) -> None:
        """Join an element's points to bucket ``b``, after the ones it has (one segment
        with its last one when they follow each other in the columns)."""
        if segment.interval:
            self.flags[b] |= 2
        if not segment.placed:
            return
        if not self.placed[b]:
            self.run0[b], self.runs[b] = segment.run0, segment.runs
            self.off0[b], self.offn[b] = segment.off0, segment.placed
            self.start0[b], self.nstart[b] = segment.start0, segment.nstart
            self.distinct[b] = len(segment.coords)
            self.placed[b] = segment.placed
            return
        if self.distinct[b] < DISTINCT_COUNTED:
            self.distinct[b] = _RECOUNT
        self.placed[b] += segment.placed
        more = self.more.get(b)
        run0, runs, off0, offn, start0, nstart = self.tail(b)
        if (run0 + runs == segment.run0 and off0 + offn == segment.off0
                and (not nstart or not segment.nstart or start0 + nstart == segment.start0)):
            joined = (run0, runs + segment.runs, off0, offn + segment.placed,
                      start0 if nstart else segment.start0, nstart + segment.nstart)
            if more:
                more[-1] = joined
            else:
                (self.run0[b], self.runs[b], self.off0[b], self.offn[b], self.start0[b],
                 self.nstart[b]) = joined
        else:
            self.more.setdefault(b, []).append(
                (segment.run0, segment.runs, segment.off0, segment.placed, segment.start0,
                 segment.nstart))

    def tail(self, b: int) -> tuple:
        """The last segment of bucket ``b`` (which has points)."""
        more = self.more.get(b)
        if more:
            return more[-1]
        return (self.run0[b], self.runs[b], self.off0[b], self.offn[b], self.start0[b],
                self.nstart[b])

    def segments(self, b: int) -> list:
        """(run0, runs, off0, offn, start0, nstart) of each segment of bucket ``b``."""
        if not self.placed[b]:
            return []
        first = (self.run0[b], self.runs[b], self.off0[b], self.offn[b], self.start0[b],
                 self.nstart[b])
        return [first] + self.more.get(b, [])


def start_code(raw: Any) -> int:
    """What layer inference reads of a bucket start (:func:`_alignment`), as one number:
    -1 when it cannot be read; 0, 1 or 2 when it is aligned to the second, the minute or
    the hour (in the local time written in it); 3 at local midnight of a date that does
    not exist; 4 + the proleptic ordinal of its local date at local midnight.  HAE's
    own format is read in place."""
    if (type(raw) is str and len(raw) == 25 and raw[10] == " " and raw[13] == ":"
            and raw[16] == ":" and raw[19] == " "):
        if raw[17:19] != "00":
            return 0
        if raw[14:16] != "00":
            return 1
        if raw[11:13] != "00":
            return 2
        try:
            return 4 + _dt.date(int(raw[:4]), int(raw[5:7]), int(raw[8:10])).toordinal()
        except ValueError:
            return 3
    fields = local_day_and_second(raw)
    if fields is None:
        return -1
    ordinal, second = fields
    if second % 60:
        return 0
    if second % 3600:
        return 1
    if second:
        return 2
    return 4 + ordinal


_START_CODES: dict = {}
"""Start text → :func:`start_code`: a body's metrics share their dates."""
_START_CODES_MAX = 1 << 16


def start_code_of(raw: Any) -> int:
    """:func:`start_code`, remembered for texts."""
    if type(raw) is not str:
        return start_code(raw)
    code = _START_CODES.get(raw)
    if code is None:
        if len(_START_CODES) >= _START_CODES_MAX:
            _START_CODES.clear()
        code = _START_CODES[raw] = start_code(raw)
    return code


class IndexedMetric:
    """One metric of a large body (:func:`index_points`): a view of its bucket, where
    each of its points starts in the text; the points themselves are parsed again, one
    hour at a time, when the hour is merged.  Duck-types :class:`MetricPoints` for the
    fold."""

    __slots__ = ("table", "b", "name", "is_metric", "units", "last")

    def __init__(self, table: _Buckets, b: int, last: bool = False):
        self.table, self.b, self.last = table, b, last
        self.name = table.name(b)
        self.is_metric = bool(table.flags[b] & 1)
        self.units = table.units[b]

    @property
    def has_interval(self) -> bool:
        return bool(self.table.flags[self.b] & 2)

    @property
    def starts(self) -> array.array:
        """The start codes of its bucket points, :data:`STARTS_KEPT` at most."""
        codes, all_codes = array.array("i"), self.table.index.starts
        for _, _, _, _, start0, nstart in self.table.segments(self.b):
            codes.extend(all_codes[start0:start0 + min(nstart, STARTS_KEPT - len(codes))])
            if len(codes) >= STARTS_KEPT:
                break
        return codes

    @property
    def distinct(self) -> int:
        """Distinct coordinates, counted up to :data:`DISTINCT_COUNTED` (layer inference
        asks no more)."""
        table, b = self.table, self.b
        if table.distinct[b] == _RECOUNT:
            seen: set = set()
            times = TimeMemo()
            for offsets in self._offsets():
                for offset in offsets:
                    seen.add(point_coordinate(_shallow(table.index.text, offset)[0], times))
                    if len(seen) >= DISTINCT_COUNTED:
                        break
                if len(seen) >= DISTINCT_COUNTED:
                    break
            table.distinct[b] = len(seen)
        return table.distinct[b]

    def _offsets(self) -> Iterator[array.array]:
        offsets = self.table.index.offsets
        for _, _, off0, offn, _, _ in self.table.segments(self.b):
            yield offsets[off0:off0 + offn]

    def hour_coords(self, check_deadline: Callable[[], None]) -> Iterator[tuple]:
        """As :meth:`MetricPoints.hour_coords`, parsing each hour's points again.  The
        last metric of a body lets its text go once its last hour is parsed."""
        index = self.table.index
        offsets, run_hours, run_lens = index.offsets, index.run_hours, index.run_lens
        hours: dict = {}  # hour -> offsets, body order; the hours in their first order
        for run0, runs, at, _, _, _ in self.table.segments(self.b):
            for run in range(run0, run0 + runs):
                hour, length = run_hours[run], run_lens[run]
                found = hours.get(hour)
                if found is None:
                    hours[hour] = offsets[at:at + length]
                else:
                    found.extend(offsets[at:at + length])
                at += length
        text = index.text
        times = TimeMemo()
        record = self.table.record
        while hours:
            hour, offsets_of_hour = hours.popitem()
            check_deadline()
            coords: dict = {}
            for offset in offsets_of_hour:
                point = (_shallow if record else _READ_AGAIN)(text, offset)[0]
                coord = point_coordinate(point, times)
                slot = coords.get(coord)
                if slot is None:
                    coords[coord] = point
                elif type(slot) is list:
                    slot.append(point)
                else:
                    coords[coord] = [slot, point]
            if self.last and not hours:  # nothing needs the text any more
                index.text = text = None
            yield hour, coords


class IndexedMetrics:
    """``Extraction.metrics`` of a large body: (is_metric, name) → :class:`IndexedMetric`,
    in the order the whole-document extraction makes them (sections in
    :data:`SECTIONS` order, metrics in the order they first appear), each made when
    asked."""

    def __init__(self, tables: list):
        self.tables = tables

    def __len__(self) -> int:
        return sum(len(table) for table in self.tables)

    def values(self) -> Iterator[IndexedMetric]:
        for table in self.tables:
            for b in range(len(table)):
                yield IndexedMetric(table, b)

    def items(self) -> Iterator[tuple]:
        for metric in self.values():
            yield (metric.is_metric, metric.name), metric

    def __iter__(self) -> Iterator[tuple]:
        for key, _ in self.items():
            yield key

    def take(self) -> Iterator[IndexedMetric]:
        """Each metric once, for the merge; the last one frees the text when done."""
        left = len(self)
        for table in self.tables:
            for b in range(len(table)):
                left -= 1
                yield IndexedMetric(table, b, last=not left)
        self.tables = []

    def has_metric_points(self) -> bool:
        return any(flags & 1 and placed for table in self.tables
                   for flags, placed in zip(table.flags, table.placed))

    def name_count(self) -> int:
        """Distinct metric names (a time-grouped metric and a record may share one)."""
        count = len(self)
        named = [table for table in self.tables if not table.record]
        for table in self.tables:
            if table.record:
                for name in table.names:  # records' names are never time-grouped
                    count -= any(_named_in(other, name) for other in named)
        return count


def _named_in(table: _Buckets, name: str) -> bool:
    """Does ``table`` (of data.metrics) hold a time-grouped metric called ``name``?"""
    h = hash(name)
    slots, mask = table.slots, len(table.slots) - 1
    i = h & mask
    while slots[i] >= 0:
        b = slots[i]
        if table.hashes[b] == h and table.flags[b] & 1 and table.name(b) == name:
            return True
        i = (i + 1) & mask
    return False


def index_points(text: str, check_deadline: Callable[[], None] = lambda: None) -> Extraction:
    """What :func:`extract_points` makes of the document in ``text``, without building
    it: every point is parsed once here to place it (its metric, hour and coordinate),
    and only its offset is kept (:class:`BodyIndex`).  A record element is read member by
    member: only what names and places it is built.  Duplicate keys keep their last
    value, as a parse does; invalid JSON anywhere is ContentNotParsed, as it is for a
    parse."""
    try:
        indexer = _Indexer(text, check_deadline)
        end = _WHITESPACE.match(text, _walk_object(
            text, _WHITESPACE.match(text).end(), indexer.top)).end()
        if end != len(text):
            raise ValueError("extra data after the body")
        return indexer.extraction()
    except (ValueError, IndexError, RecursionError):
        raise ContentNotParsed() from None


class _Indexer:
    """The walk of :func:`index_points`: ``data`` and its sections as they come, each
    section's elements joined to its metrics as they are read (a later duplicate of a
    section, or of ``data``, replaces what an earlier one gave, as in a parse); then the
    sections combined in :data:`SECTIONS` order, as :func:`extract_points` reads them."""

    def __init__(self, text: str, check_deadline: Callable[[], None]):
        self.text, self.check_deadline = text, check_deadline
        self.times = TimeMemo()
        self.index = BodyIndex(text)
        self.units: dict = {}  # one string of each units
        self.data: Optional[dict] = None  # section key -> _Buckets, "other" or None
        self.data_is_object = False

    def top(self, key: str, at: int) -> int:
        if key != "data":
            return _scan(self.text, at)[1]
        if self.text[at] != "{":
            self.data, self.data_is_object = None, False
            return _scan(self.text, at)[1]
        self.data, self.data_is_object = {}, True
        return _walk_object(self.text, at, self.section)

    def section(self, key: str, at: int) -> int:
        text = self.text
        if key not in SECTIONS or text[at] != "[":
            value, end = _scan(text, at)
            self.data[key] = None if value is None else "other"  # uncovered: only the key
            return end
        table = self.data[key] = _Buckets(self.index, key)
        if SECTIONS[key] is None:
            return self._elements(at, lambda at: self._metric(at, table))
        return self._elements(at, lambda at: self._record(at, table))

    def _elements(self, at: int, element: Callable[[int], int]) -> int:
        text, space = self.text, _WHITESPACE.match
        at = space(text, at + 1).end()
        if text[at] == "]":
            return at + 1
        while True:
            at = space(text, element(at)).end()
            if text[at] == "]":
                return at + 1
            if text[at] != ",":
                raise ValueError("',' or ']' expected")
            at = space(text, at + 1).end()

    def _skip(self, at: int) -> int:
        """Past the value at ``at``; an array an element at a time."""
        if self.text[at] == "[":
            return self._elements(at, lambda at: _scan(self.text, at)[1])
        return _scan(self.text, at)[1]

    def _metric(self, at: int, table: _Buckets) -> int:
        """One element of ``data.metrics``: its name, units and where its points are,
        joined to its metric as :func:`_extract_metric` decides."""
        text = self.text
        if text[at] != "{":
            end = _scan(text, at)[1]
            self._add_metric(table, None, 0, None, None)
            return end
        fields: dict = {}  # "name"/"units" -> value, "at": the name's offset, "data"

        def member(key: str, at: int) -> int:
            if key == "data" and text[at] == "[":
                segment = _Segment(self.index)
                end = self._points(at, segment)
                fields["data"] = segment
                return end
            value, end = _scan(text, at)
            if key in ("name", "units", "data"):
                fields[key] = value
                if key == "name":
                    fields["at"] = at
            return end

        end = _walk_object(text, at, member)
        self._add_metric(table, fields.get("name"), fields.get("at", 0), fields.get("units"),
                         fields.get("data"))
        return end

    def _add_metric(self, table: _Buckets, name: Any, name_at: int, units: Any,
                    points: Any) -> None:
        """:func:`_extract_metric`'s decisions on one element's index."""
        named = type(name) is str and name.strip()
        if points is None and named:
            return
        if not named or type(points) is not _Segment:
            table.bad_points += points.count if type(points) is _Segment else 1
            table.bad_metrics.add(name if named else "metrics")
            return
        b = table.bucket(name != SLEEP_METRIC, name, name_at)
        units = self.units.setdefault(units, units) if type(units) is str else None
        if table.placed[b] and units != table.units[b]:
            table.mixed_units.add(name)
            return
        table.units[b] = units
        if points.bad:
            table.bad_points += points.bad
            table.bad_metrics.add(name)
        table.points += points.count - points.bad
        table.absorb(b, points)

    def _record(self, at: int, table: _Buckets) -> int:
        """One record element: what names and places it, and its offset."""
        text = self.text
        name_of = SECTIONS[table.section]
        if text[at] != "{":
            end = _scan(text, at)[1]
            name = coord = None
        else:
            fields: dict = {}

            def member(key: str, at: int) -> int:
                if key in _RECORD_FIELDS:
                    fields[key], end = _scan(text, at)
                    return end
                return self._skip(at)

            end = _walk_object(text, at, member)
            name = name_of(fields)
            coord = point_coordinate(fields, self.times) if name is not None else None
        if coord is None:
            table.bad_points += 1
            table.bad_metrics.add(name or name_of({}) or table.section)
            return end
        table.points += 1
        b = table.bucket(False, name, 0)
        index = self.index
        segment = _Segment(index)
        segment.placed = segment.count = 1
        segment.coords.append(coord)
        hour = coord[0] // HOUR_US
        if table.placed[b]:
            run0, runs, off0, offn, _, _ = table.tail(b)
            joins = (run0 + runs == segment.run0 and off0 + offn == segment.off0
                     and index.run_hours[-1] == hour)
        else:
            joins = False
        if joins:  # the same metric and hour as the record before it
            index.run_lens[-1] += 1
        else:
            index.run_hours.append(hour)
            index.run_lens.append(1)
            segment.runs = 1
        index.offsets.append(at)
        table.absorb(b, segment)
        return end

    def _points(self, at: int, segment: _Segment) -> int:
        """The index after the array: :func:`_extract_metric`'s loop, placing offsets in
        the index's columns instead of keeping points."""
        text, space, scan = self.text, _WHITESPACE.match, _SCANNER
        memo, read = self.times.get, self.times.time
        index = self.index
        offsets, run_hours, run_lens, starts = (index.offsets, index.run_hours,
                                                index.run_lens, index.starts)
        coords = segment.coords
        last_hour = None
        count = bad = nstart = 0
        interval = False
        at = space(text, at + 1).end()
        if text[at] == "]":
            return at + 1
        while True:
            try:
                point, end_at = scan(text, at)
            except StopIteration:
                raise ValueError("no JSON value") from None
            count += 1
            if not count & 0xFFF:
                self.check_deadline()
            if type(point) is dict:
                get = point.get
                raw = get("start")  # raw_start, inlined: as in _extract_metric
                if raw is None:
                    raw = get("startDate")
                    if raw is None:
                        raw = get("date")
                start = memo(raw, _UNREAD) if type(raw) is str else _UNREAD
                if start is _UNREAD:
                    start = read(raw)
                end_raw = get("end")
                if end_raw is None:
                    end_raw = get("endDate")
                if end_raw is None:
                    end = start
                else:
                    end = memo(end_raw, _UNREAD) if type(end_raw) is str else _UNREAD
                    if end is _UNREAD:
                        end = read(end_raw)
                if start is None or end is None:
                    bad += 1
                else:
                    hour = start // HOUR_US
                    if hour == last_hour:
                        run_lens[-1] += 1
                    else:
                        run_hours.append(hour)
                        run_lens.append(1)
                        last_hour = hour
                    offsets.append(at)
                    if len(coords) < DISTINCT_COUNTED:
                        coord = (start, end, _category(point))
                        if coord not in coords:
                            coords.append(coord)
                    if start != end:
                        interval = True
                    elif nstart < STARTS_KEPT:
                        starts.append(start_code_of(raw))
                        nstart += 1
            else:
                bad += 1
            at = space(text, end_at).end()
            if text[at] == "]":
                break
            if text[at] != ",":
                raise ValueError("',' or ']' expected")
            at = space(text, at + 1).end()
        segment.runs = len(run_hours) - segment.run0
        segment.placed = count - bad
        segment.nstart, segment.count, segment.bad = nstart, count, bad
        segment.interval = interval
        return at + 1

    def extraction(self) -> Extraction:
        if not self.data_is_object:
            raise ContentNotParsed("the body is not a JSON object with a \"data\" object")
        out = Extraction()
        data = self.data
        uncovered = [key for key in data if key not in SECTIONS]
        out.uncovered, out.uncovered_dropped, out.uncovered_cut = _bounded_names(uncovered)
        tables = []
        for key in SECTIONS:
            section = data.get(key)
            if section is None:
                continue
            if type(section) is not _Buckets:
                out.bad_points += 1
                out.bad_metrics.add(key)
                continue
            out.points += section.points
            out.bad_points += section.bad_points
            out.bad_metrics |= section.bad_metrics
            out.mixed_units |= section.mixed_units
            tables.append(section)
        out.metrics = IndexedMetrics(tables)
        return out


def hour_items(bucket: Any, check_deadline: Callable[[], None]) -> Iterator[tuple]:
    """(hour, [(coordinate, point)], values dropped) for each UTC hour of one metric of a
    delivery (:class:`MetricPoints` or :class:`IndexedMetric`), each coordinate's
    candidates reduced to one (:func:`reduce_candidates`)."""
    for hour, coords in bucket.hour_coords(check_deadline):
        items, dropped = [], 0
        for coord, slot in coords.items():
            if type(slot) is list:
                slot, lost = reduce_candidates([materialize(p) for p in slot],
                                               check_deadline)
                dropped += lost
            items.append((coord, slot))
        del coords
        yield hour, items, dropped


@dataclass
class BodyOutline:
    """What a fold's outcome is decided by, without the points (:meth:`FoldEngine.decide`):
    small enough to cross from a rebuild's worker process to its writer."""

    metrics: int  # distinct metric names
    points: int
    bad_points: int
    bad_metrics: set
    mixed_units: set
    uncovered: list
    uncovered_dropped: int
    uncovered_cut: int
    has_metric_points: bool
    inferred: Optional[str]  # the layer the bucket starts suggest (infer_layer)
    plain: bool


def outline_of(extraction: Extraction, plain: bool, aggregation: Optional[str]) -> BodyOutline:
    """The :class:`BodyOutline` of an extraction, before its points are merged; the layer
    is inferred as the delivery's ``automation-aggregation`` header asks (a sample of
    starts when it names a grouping, to see a contradiction; all of them when not)."""
    has_metric_points = extraction.has_metric_points
    inferred = None
    if has_metric_points:
        inferred = infer_layer(extraction,
                               sample=INFER_SAMPLE if header_layer(aggregation) else None)
    return BodyOutline(extraction.name_count(), extraction.points,
                       extraction.bad_points, extraction.bad_metrics, extraction.mixed_units,
                       extraction.uncovered, extraction.uncovered_dropped,
                       extraction.uncovered_cut, has_metric_points, inferred, plain)


# ==============================================================================
# Storage: schema, connections, the write transaction, the lock; accepting a delivery.
# ==============================================================================

_SCHEMA = """
CREATE TABLE {delivery} (
    id                     INTEGER PRIMARY KEY,
    received_at            TEXT NOT NULL,
    journaled_at           TEXT,
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
    sealed_changes         INTEGER,
    attempts               INTEGER NOT NULL DEFAULT 0
);
CREATE INDEX {delivery}_journal ON {delivery} (received_at, id);
CREATE INDEX {delivery}_pending ON {delivery} (received_at, id) WHERE parse_status = 'pending';
CREATE INDEX {delivery}_body ON {delivery} (body_sha256);

CREATE TABLE {object} (
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
    summary          TEXT,
    spans            BLOB,
    PRIMARY KEY (metric, layer, hour)
) WITHOUT ROWID;
CREATE INDEX {object}_summary ON {object} (metric, layer, hour, units, first_at, last_at,
                                         summary);
"""
"""The journal (``delivery``) and the vitrine (``object``).  ``object.summary`` is the
hour's tally (:func:`hour_tally`), not the summary page: it and its index keep the name
they were first given, since a new name would rewrite every database for a word."""


_ADDED_COLUMNS = (("object", "summary", "TEXT"), ("object", "spans", "BLOB"),
                  ("delivery", "attempts", "INTEGER NOT NULL DEFAULT 0"))
"""Columns later schema versions added (2, 3, 4): an older database gains them on open."""

_SESSION_SCHEMA = """
CREATE TABLE IF NOT EXISTS session (
    id          TEXT PRIMARY KEY,
    created_at  TEXT NOT NULL,
    expires_at  INTEGER NOT NULL
) WITHOUT ROWID"""
"""Signed-in browsers: a cookie names its row, and signing out deletes it.  Not part of
the vitrine: ``reindex`` leaves it alone."""


def schema_statements(delivery: str = "delivery", object_: str = "object",
                      indexes: bool = True) -> list:
    """The DDL of one table set; reindex builds a second set beside the live one."""
    statements = [st.strip() for st in _SCHEMA.format(delivery=delivery, object=object_)
                  .split(";") if st.strip()]
    return [st for st in statements if indexes or not st.startswith("CREATE INDEX")]


def index_statements(table: str) -> list:
    """The CREATE INDEX statements of the live ``delivery`` or ``object`` table.

    ``object_summary`` covers what bucketed reads and the summary page ask of an object, so
    that they scan a narrow index instead of rows that hold their blobs (3× faster for a
    year of hours, for about 2.5 bytes a minute point)."""
    return [st for st in schema_statements() if st.startswith("CREATE INDEX")
            and " ON %s " % table in st]


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


def _sqlite_error_in(exc: BaseException, codes: tuple, texts: tuple) -> bool:
    """Is ``exc`` an SQLite error of one of these primary result codes?  Python before
    3.11 gives no code: its message is read instead."""
    code = getattr(exc, "sqlite_errorcode", None)
    if code is not None:
        return (code & 0xFF) in codes
    return isinstance(exc, sqlite3.Error) and any(text in str(exc) for text in texts)


def is_busy(exc: BaseException) -> bool:
    """True when SQLite gave up waiting for a lock (SQLITE_BUSY and its variants)."""
    return _sqlite_error_in(exc, (5,), ("database is locked",))


_CORRUPT_CODES = (11, 26)  # SQLITE_CORRUPT, NOTADB
_CORRUPT_TEXTS = ("malformed", "not a database")
_STORAGE_CODES = (7, 8, 10, 13, 14) + _CORRUPT_CODES  # NOMEM, READONLY, IOERR, FULL, CANTOPEN
_STORAGE_TEXTS = ("out of memory", "readonly database", "disk I/O error", "disk is full",
                  "unable to open database") + _CORRUPT_TEXTS


def is_corruption(exc: BaseException) -> bool:
    """True when SQLite found the database file damaged."""
    return _sqlite_error_in(exc, _CORRUPT_CODES, _CORRUPT_TEXTS)


def damaged_database(path: Path, exc: BaseException) -> ConfigError:
    """The one message for a damaged database file, with the way back."""
    return ConfigError(
        "%s is damaged (%s); move %s* aside and run `healthlog reindex` to rebuild it from"
        " the archive" % (path, str(exc).split("\n")[0][:80], path.name))


def is_storage_failure(exc: BaseException) -> bool:
    """True when SQLite could not write for a reason of the machine (disk full, a
    read-only or failing disk), which no delivery causes and waiting may cure."""
    return _sqlite_error_in(exc, _STORAGE_CODES, _STORAGE_TEXTS)


@contextlib.contextmanager
def write_txn(conn: sqlite3.Connection) -> Iterator[sqlite3.Connection]:
    """``BEGIN IMMEDIATE`` … ``COMMIT``; rolled back on any exception.

    IMMEDIATE takes the write lock up front, so the busy timeout is honoured instead
    of failing at once on a read-to-write upgrade (stack-notes §4.4).
    """
    conn.execute("BEGIN IMMEDIATE")
    try:
        yield conn
        conn.execute("COMMIT")
    except BaseException:
        # Also after a failed COMMIT: a connection left inside a transaction would keep
        # the write lock and make every later writer busy.
        if conn.in_transaction:
            with contextlib.suppress(sqlite3.Error):
                conn.execute("ROLLBACK")
        raise


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
        # Asked again inside the write transaction: a second process may have created
        # or upgraded the schema since (serve and import started together).
        version = conn.execute("PRAGMA user_version").fetchone()[0]
        if version == 0:
            for statement in schema_statements():
                conn.execute(statement)
        else:
            for table, column, kind in _ADDED_COLUMNS:
                present = {row[1] for row in conn.execute("PRAGMA table_info(%s)" % table)}
                if column not in present:
                    conn.execute("ALTER TABLE %s ADD COLUMN %s %s" % (table, column, kind))
            for statement in index_statements("object"):
                conn.execute(statement.replace("CREATE INDEX", "CREATE INDEX IF NOT EXISTS"))
        conn.execute(_SESSION_SCHEMA)
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
        if is_corruption(exc):
            raise damaged_database(path, exc) from None
        raise ConfigError("cannot open %s: %s" % (path, exc)) from None
    try:
        migrate(conn, path)
        for table in ("delivery", "object"):  # reads each table's root page
            conn.execute("SELECT 1 FROM %s LIMIT 1" % table).fetchall()
    except sqlite3.DatabaseError as exc:
        conn.close()
        if is_corruption(exc):
            raise damaged_database(path, exc) from None
        raise
    except BaseException:
        conn.close()
        raise
    return conn


def open_read_only(config: Config) -> sqlite3.Connection:
    """A connection that can only read the database of a data directory (SQLite's
    ``mode=ro``, and ``query_only``): it creates, migrates and writes nothing, and as a WAL
    reader never keeps the fold from committing.  The schema must be this version's (an
    older one is upgraded by ``serve`` or ``status``, which may write)."""
    path = config.db_path
    if not path.exists():
        raise ConfigError("no healthlog database at %s (has `healthlog serve` run there?)"
                          % config.data_dir)
    try:
        conn = sqlite3.connect("file:%s?mode=ro" % urllib.parse.quote(str(path)), uri=True,
                               timeout=config.busy_timeout_s, isolation_level=None,
                               check_same_thread=False)
    except sqlite3.Error as exc:
        raise ConfigError("cannot open %s: %s" % (path, exc)) from None
    try:
        conn.execute("PRAGMA query_only=ON")
        version = conn.execute("PRAGMA user_version").fetchone()[0]
        for table in ("delivery", "object"):  # reads each table's root page
            conn.execute("SELECT 1 FROM %s LIMIT 1" % table).fetchall()
    except sqlite3.DatabaseError as exc:
        conn.close()
        if is_corruption(exc):
            raise damaged_database(path, exc) from None
        raise ConfigError("cannot read %s: %s" % (path, exc)) from None
    if version != SCHEMA_VERSION:
        conn.close()
        raise ConfigError("%s has schema version %d, this healthlog %s reads version %d: %s"
                          % (path, version, __version__, SCHEMA_VERSION,
                             "run a newer healthlog" if version > SCHEMA_VERSION else
                             "start `healthlog serve` (or run `healthlog status`) once to"
                             " upgrade it"))
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

    def holder(self) -> Optional[str]:
        """What another process holds the lock for (``serve``, ``reindex``), or None."""
        if not self.held_by_other():
            return None
        try:
            return self.path.read_text().split()[1]
        except (OSError, IndexError):
            return "unknown"

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


def ensure_data_dir(path: Path, wait_for_archive: bool = False) -> bool:
    """Create the data directory (mode 0700: it holds health data) and its folders, but
    never one half of a store whose other half is elsewhere (RELY-11): an archive of
    deliveries beside no database is refused, and so is a journal of deliveries beside no
    archive (or an empty one: a disk not mounted yet), unless ``wait_for_archive``, when
    nothing is created for it and True is returned (``serve`` then waits for it)."""
    has_rows = journal_has_rows(path / DB_NAME)
    absent = archive_absent(path)
    if not has_rows and not absent and not (path / DB_NAME).exists():
        raise ConfigError(
            "%s holds an archive of deliveries but no database (%s): if the database's disk"
            " is not mounted yet, start healthlog once it is; to build the database from"
            " the archive, run `healthlog reindex --data %s`" % (path, DB_NAME, path))
    waiting = has_rows and absent
    if waiting and not wait_for_archive:
        raise ConfigError(archive_missing_message(path))
    try:
        if not waiting:
            makedirs_durable(path / ARCHIVE_DIR)
        makedirs_durable(path / TMP_DIR)
    except OSError as exc:  # name what failed: the folder itself, or a path inside it
        failed = Path(exc.filename) if exc.filename else path
        reason = exc.strerror or type(exc).__name__
        if failed == path:
            message = "cannot create data directory %s: %s" % (path, reason)
        elif path.is_dir():
            message = ("data directory %s is not usable: cannot create %s: %s (is it"
                       " writable by the user healthlog runs as?)" % (path, failed, reason))
        else:
            message = "cannot create data directory %s: %s: %s" % (path, failed, reason)
        raise ConfigError(message) from None
    if not os.access(str(path), os.W_OK):
        raise ConfigError("data directory %s is not writable" % path)
    return waiting


def archive_missing_message(path: Path) -> str:
    """The one sentence for a journal of deliveries whose archive is missing or empty."""
    return ("the journal in %s lists deliveries but %s is missing or empty: is the disk that"
            " holds it mounted? Nothing was changed" % (path, path / ARCHIVE_DIR))


def resolve_token(config: Config) -> tuple:
    """(token, made now): the token from the config, else ``DATA/token``, else a new one
    written there (shown once, in the start banner, never logged)."""
    if config.token:
        return config.token, False
    path = config.data_dir / TOKEN_NAME
    try:
        text = path.read_text(encoding="utf-8").strip()
    except FileNotFoundError:
        text = None
    except OSError as exc:
        raise ConfigError("cannot read %s: %s" % (path, exc.strerror)) from None
    except UnicodeDecodeError:
        raise ConfigError("cannot read %s: it is not UTF-8 text (write the token there"
                          " again, or remove the file to have a new one made)" % path) from None
    if text is not None:
        return check_token_length(_check_token(text, str(path)), str(path)), False
    token = secrets.token_urlsafe(32)
    write_durable(path, (token + "\n").encode(), mode=0o600)
    return token, True


def count_pending(conn: sqlite3.Connection) -> int:
    return conn.execute(
        "SELECT count(*) FROM delivery WHERE parse_status = 'pending'").fetchone()[0]


def fingerprint(conn: sqlite3.Connection, table: str = "object") -> str:
    """SHA-256 over the sorted (metric, layer, hour, hash) of every object.

    The one definition used by status, reindex and verify.
    """
    rows = conn.execute("SELECT metric, layer, hour, hash FROM %s" % table)
    return fingerprint_rows(((metric, layer, hour), digest)
                            for metric, layer, hour, digest in rows)


def fingerprint_rows(items: Any) -> str:
    """The fingerprint of ((metric, layer, hour), hash) pairs, in any order."""
    digest = hashlib.sha256()
    for (metric, layer, hour), row_hash in sorted(items):
        digest.update(("%s\x1f%s\x1f%d\x1f%s\n" % (metric, layer, hour, row_hash)).encode())
    return digest.hexdigest()


_INSERT_DELIVERY = (
    "INSERT INTO delivery (received_at, journaled_at, archive_path, body_bytes, body_sha256,"
    " automation_id, automation_name, automation_aggregation, automation_period, session_id,"
    " path_name) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)")


def accept_delivery(archive: Archive, conn: sqlite3.Connection, upload: Upload,
                    received_at: _dt.datetime, headers: Mapping[str, Optional[str]],
                    name: Optional[str], extra_meta: Optional[dict] = None,
                    handoff: Optional["Handoff"] = None,
                    quick_max: Optional[int] = None) -> int:
    """The one way a body becomes a delivery (HTTP ingest and ``import`` alike).

    Validates the body (orjson's quick check up to ``quick_max`` bytes: see
    :func:`check_delivery_shape`), writes ``.meta.json`` and then the body durably into
    the archive, and only then inserts the ``pending`` row.  Raises BadRequest (nothing
    written) or InternalError (logged: an archive failure, or a row that could not be
    written, whose body is then an orphan until reindex adopts it — ING-9).
    """
    try:
        parsed = check_delivery_shape(upload.tmp_path, quick_max)
        meta = {
            "received_at": format_received_at(received_at),
            "headers": {h: v for h, v in headers.items() if v is not None},
            "path_name": name,
            "body_bytes": upload.size,
            "body_sha256": upload.sha256,
            "healthlog_version": __version__,
        }
        meta.update(extra_meta or {})
        try:
            archive_path = archive.commit(upload, received_at, meta)
        except (OSError, StorageFailure) as exc:
            exc = getattr(exc, "cause", exc)
            log_event(logging.ERROR, "archive write failed: delivery refused",
                      error=type(exc).__name__, errno=exc.errno)
            raise InternalError() from None
    finally:
        upload.discard()  # a no-op once the body has been renamed into the archive
    delivery_id = None
    try:
        with write_txn(conn):
            cursor = conn.execute(
                _INSERT_DELIVERY,
                (format_received_at(received_at), format_received_at(utc_now()), archive_path,
                 upload.size, upload.sha256,
                 headers.get("automation-id"), headers.get("automation-name"),
                 headers.get("automation-aggregation"), headers.get("automation-period"),
                 headers.get("session-id"), name))
            delivery_id = int(cursor.lastrowid)
            if handoff is not None and parsed is not None:  # before the fold can see the row
                handoff.put(delivery_id, *parsed)
    except sqlite3.Error as exc:
        if handoff is not None and delivery_id is not None:
            handoff.take(delivery_id)  # the row was not committed
        log_event(logging.ERROR,
                  "delivery row not written: the body is an orphan in the archive until"
                  " `healthlog reindex` adopts it",
                  archive_path=archive_path, busy=is_busy(exc), error=type(exc).__name__)
        raise InternalError() from None
    return delivery_id


def journaled_paths(conn: sqlite3.Connection, since: str = "") -> set:
    """The archive paths the journal lists, in the day folders from ``since`` on."""
    return {path for (path,) in conn.execute(
        "SELECT archive_path FROM delivery WHERE archive_path >= ?", (since,))}


def _hash_file(path: Path) -> tuple:
    digest, size = hashlib.sha256(), 0
    with open(str(path), "rb") as handle:
        for chunk in iter(lambda: handle.read(READ_CHUNK), b""):
            digest.update(chunk)
            size += len(chunk)
    return size, digest.hexdigest()


def adopt_orphans(conn: sqlite3.Connection, data_dir: Path,
                  settled_before: Optional[float] = None, since: str = "") -> int:
    """Journal archived bodies that have no delivery row, in journal order.

    received_at and HAE's headers come from the body's ``.meta.json``; without one,
    received_at comes from the file name.  An unreadable body is left for later, and so
    is one written at or after ``settled_before`` (epoch seconds: an ``import`` beside
    may be about to journal it).  ``since`` limits the search to the day folders from
    that one on (``archive/YYYY/MM/DD``).
    """
    known = journaled_paths(conn, since)
    rows = []
    for relative in archive_bodies(data_dir, since):
        if relative in known:
            continue
        body = data_dir / relative
        if settled_before is not None and _modified_at(body) >= settled_before:
            continue
        meta = _read_meta(body, relative)
        received_at = meta.get("received_at")
        try:
            parse_received_at(received_at)
        except (TypeError, ValueError):
            if meta:
                log_event(logging.WARNING, "damaged .meta.json: no usable receive time; the"
                          " file name gives it", archive_path=relative)
            received_at = received_at_from_name(body.name)
        if received_at is None:
            log_event(logging.WARNING, "archived file without a receive time was not adopted",
                      archive_path=relative)
            continue
        try:
            size, sha256 = _hash_file(body)
        except OSError as exc:
            log_event(logging.WARNING, "archived body unreadable, not adopted",
                      archive_path=relative, error=type(exc).__name__)
            continue
        headers = meta.get("headers") if type(meta.get("headers")) is dict else {}
        name = meta.get("path_name") if type(meta.get("path_name")) is str else None
        rows.append((received_at, None, relative, size, sha256, headers.get("automation-id"),
                     headers.get("automation-name"), headers.get("automation-aggregation"),
                     headers.get("automation-period"), headers.get("session-id"), name))
    rows.sort()
    if rows:
        with write_txn(conn):
            conn.executemany(_INSERT_DELIVERY, rows)
    return len(rows)

def _modified_at(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return math.inf  # gone or unreadable: nothing to adopt or remove now


def remove_stray_meta(conn: sqlite3.Connection, data_dir: Path,
                      settled_before: Optional[float] = None, since: str = "") -> int:
    """Remove the ``.meta.json`` files whose body never arrived: their request was cut
    before the body's rename, the commit point, so it was never acknowledged and holds
    nothing but headers.  A meta whose body the journal lists stays (that body may come
    back with its disk), and so does one written at or after ``settled_before``.  ``since``
    as for :func:`adopt_orphans`."""
    known = journaled_paths(conn, since)
    removed = 0
    for folder, files in archive_walk(data_dir, since):
        for name in files:
            if not name.endswith(".meta.json") or name.startswith("."):
                continue
            body = name[:-len(".meta.json")] + ".json"
            relative = os.path.relpath(os.path.join(folder, body), str(data_dir))
            meta = Path(folder) / name
            if (body in files or relative in known
                    or (settled_before is not None and _modified_at(meta) >= settled_before)):
                continue
            with contextlib.suppress(FileNotFoundError):
                meta.unlink()
                fsync_dir(meta.parent)
                removed += 1
    return removed


def archive_day_before(relative: str) -> str:
    """``archive/YYYY/MM/DD`` of the day before an archived body's folder (the whole
    archive, ``""``, for a path not in that form)."""
    try:
        day = _dt.datetime.strptime(relative[len(ARCHIVE_DIR) + 1:][:10], "%Y/%m/%d").date()
    except ValueError:
        return ""
    return "%s/%s" % (ARCHIVE_DIR, (day - _dt.timedelta(days=1)).strftime("%Y/%m/%d"))


def import_running(data_dir: Path) -> bool:
    """Is an ``import`` writing beside (its scratch folder under ``DATA/tmp`` locked)?"""
    tmp = data_dir / TMP_DIR
    try:
        entries = list(tmp.iterdir())
    except OSError:
        return False
    return any(entry.name.startswith(IMPORT_SCRATCH) and entry.is_dir()
               and _scratch_in_use(entry) for entry in entries)


def settle_archive(conn: sqlite3.Connection, data_dir: Path) -> tuple:
    """(adopted, removed) at ``serve``'s start, as ``reindex`` does (RELY-11.4): the
    bodies a killed process archived without their row are journaled (never
    acknowledged, but the phone's own data, which folds like its resend would), and the
    metadata of bodies that never arrived is removed.  While an ``import`` runs, files of
    the last :data:`SCRATCH_GRACE_S` are its own and left alone.  An empty journal
    beside an archive is left to ``reindex`` (:func:`warn_if_journal_lost` says so).

    Only the day folders from the newest journaled body's, a day before it, are searched:
    what a killed process leaves lies there (an upload takes at most its route's
    deadline), and a start then costs a few folders, not the archive of years.  Older
    orphans (a row not written for a busy database, which its ERROR names) are
    ``reindex``'s."""
    newest = conn.execute("SELECT max(archive_path) FROM delivery").fetchone()[0]
    if newest is None:
        return 0, 0
    since = archive_day_before(newest)
    settled_before = time.time() - SCRATCH_GRACE_S if import_running(data_dir) else None
    try:
        adopted = adopt_orphans(conn, data_dir, settled_before, since)
        removed = remove_stray_meta(conn, data_dir, settled_before, since)
    except OSError as exc:  # a folder that cannot be read or written: reindex's, later
        log_event(logging.WARNING, "the archive could not be settled at start; `healthlog"
                  " reindex` adopts what a killed process left", error=type(exc).__name__)
        return 0, 0
    if adopted or removed:
        log_event(logging.INFO, "archive settled at start: bodies without a journal row"
                  " adopted, metadata without a body removed (none was acknowledged)",
                  adopted=adopted, meta_removed=removed)
    return adopted, removed


def _status_counts(conn: sqlite3.Connection, journal: str = "delivery") -> dict:
    counts = dict.fromkeys(STATUSES, 0)
    counts.update(conn.execute("SELECT parse_status, count(*) FROM %s GROUP BY parse_status"
                               % journal))
    return counts


# ==============================================================================
# Fold: one delivery into hourly objects, all-or-nothing (fold and storage specs).
# ==============================================================================

FOLD_BUSY_BACKOFF_S = (0.1, 0.5)
"""Retries of the apply transaction after the busy timeout; then the delivery is
deferred (stays pending) and the pass stops at it (ING-4.2)."""
WARN_NAMES_MAX = 20


def accumulate(fields: dict, points: Sequence) -> int:
    """Add the numeric top-level fields of ``points`` to ``fields``: name -> [count, min,
    max, sum] (``bool`` is no number; a sum that overflows a double becomes None).
    Returns how many of them are objects.  One loop over many points: it sees every
    stored point."""
    count = 0
    get = fields.get
    for point in points:
        if type(point) is not dict:
            continue
        count += 1
        for name, value in point.items():
            kind = type(value)
            if kind is not int and kind is not float:
                continue
            stats = get(name)
            if stats is None:
                fields[name] = [1, value, value, value]
                continue
            stats[0] += 1
            if value < stats[1]:
                stats[1] = value
            elif value > stats[2]:  # min <= max: a new minimum is no new maximum
                stats[2] = value
            if stats[3] is not None:
                total = stats[3] + value
                stats[3] = total if -math.inf < total < math.inf else None
    return count


def hour_tally(points: list, coords: Sequence) -> dict:
    """An object's aggregates, kept beside it for reads that need not decode it: the
    number of points, per numeric top-level field [count, min, max, sum]
    (:func:`accumulate`), for buckets; the offsets its points' starts were written in
    (``o``, sorted), so that a read in each point's local time knows the hour's local day
    without reading the points; and every top-level key its points hold (``k``, in the
    order first seen), the columns of a raw CSV."""
    fields: dict = {}
    count = accumulate(fields, points)
    return {"n": count, "f": fields, "o": sorted(start_offsets(points, coords)),
            "k": point_keys(points)}


def point_keys(points: list) -> list:
    """Every top-level key of the points that are objects, in the order first met, in one
    C loop."""
    return list(dict.fromkeys(itertools.chain.from_iterable(
        point for point in points if type(point) is dict)))


def object_hash(points: list) -> str:
    """SHA-256 of the canonical form of an object's points, in stored order."""
    return hashlib.sha256(canonical_bytes(points)).hexdigest()


# -- encoding an object: its blob and hash, a piece at a time when it is large --------

STREAM_NESTING_MAX = 200
"""Nesting a piece-by-piece encoding allows (orjson stops at 255 levels; the json module
at the interpreter's recursion limit): anything deeper is encoded whole, as before."""


class _Unstreamable(Exception):
    """The object is nested too deep to be encoded a piece at a time."""


def _build(value: Any) -> int:
    """0: a scalar, or a container of scalars; 1: a small container holding containers;
    2: a :class:`Deferred`, or a container of more than :data:`DEFER_MIN_ELEMENTS`
    members or holding one (walked by :func:`_json_pieces`)."""
    kind = type(value)
    if kind is Deferred:
        return 2
    if kind is not dict and kind is not list:
        return 0
    if len(value) > DEFER_MIN_ELEMENTS:
        return 2
    nested = 0
    for member in value.values() if kind is dict else value:
        member_kind = type(member)
        if member_kind is Deferred:
            return 2
        if member_kind is dict or member_kind is list:
            if len(member) > DEFER_MIN_ELEMENTS:
                return 2
            nested = 1
    return nested


PIECE_MEMBERS = 256
"""Flat members of a long array written by one call of the JSON writer."""


def _json_pieces(value: Any, leaf: Callable[[Any], bytes], canonical_form: bool,
                 depth: int) -> Iterator[bytes]:
    """The compact JSON of ``value`` in pieces: ``leaf`` of each small part (of a run of
    :data:`PIECE_MEMBERS` flat members of an array at once), the weighty containers
    walked (:func:`_build`); ``canonical_form``: keys sorted, no ``source``
    (:func:`_canonical_std`).  Both JSON writers write a container as the concatenation
    of its members' texts, so the pieces join to what ``leaf`` writes of the whole."""
    if depth > STREAM_NESTING_MAX:
        raise _Unstreamable()
    build = _build(value)
    if build < 2:
        if build and not _nested_at_most(value, STREAM_NESTING_MAX - depth):
            raise _Unstreamable()
        yield leaf(value)
    elif type(value) is dict:
        keys = sorted(k for k in value if k != "source") if canonical_form else list(value)
        yield b"{"
        for index, key in enumerate(keys):
            yield (b"," if index else b"") + leaf(key) + b":"
            yield from _json_pieces(value[key], leaf, canonical_form, depth + 1)
        yield b"}"
    else:
        yield b"["
        run: list = []
        comma = b""
        for member in value:
            if _build(member) == 0:
                run.append(member)
                if len(run) < PIECE_MEMBERS:
                    continue
            if run:
                yield comma + leaf(run)[1:-1]  # the members' texts, without the brackets
                comma, run = b",", []
                if _build(member) == 0:
                    continue
            yield comma
            comma = b","
            yield from _json_pieces(member, leaf, canonical_form, depth + 1)
        if run:
            yield comma + leaf(run)[1:-1]
        yield b"]"


def _points_pieces(points: list, leaf: Callable[[Any], bytes],
                   canonical_form: bool) -> Iterator[bytes]:
    """:func:`_json_pieces` of an object's points, each point a piece of its own or
    walked."""
    yield b"["
    for index, point in enumerate(points):
        if index:
            yield b","
        yield from _json_pieces(point, leaf, canonical_form, 1)
    yield b"]"


def _std_dumps(value: Any) -> bytes:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"),
                      allow_nan=False).encode()


def _compressed(pieces: Iterator[bytes]) -> bytes:
    """:func:`compress_blob` of the joined pieces (deflate's output does not depend on how
    its input is cut)."""
    compressor = zlib.compressobj(GZIP_LEVEL, zlib.DEFLATED, 31)
    out, batch, size = [], [], 0
    for piece in pieces:
        batch.append(piece)
        size += len(piece)
        if size >= 1 << 16:
            out.append(compressor.compress(b"".join(batch)))
            batch, size = [], 0
    out.append(compressor.compress(b"".join(batch)))
    out.append(compressor.flush())
    return b"".join(out)


def encode_points(points: list) -> tuple:
    """(blob, hash) of an object's points: ``compress_blob(dumps_points(points))`` and
    :func:`object_hash`.  A few points holding long arrays (a workout's route, an ECG's
    voltages, a :class:`Deferred`) are written a piece at a time, so that neither their
    JSON nor a copy without ``source`` is ever whole in memory; the bytes are the same."""
    if len(points) <= 64 and any(_build(point) == 2 for point in points):
        try:
            if _orjson is not None:
                try:
                    blob = _compressed(_points_pieces(points, _orjson.dumps, False))
                except TypeError:  # as dumps_points: the json module writes it all
                    blob = _compressed(_points_pieces(points, _std_dumps, False))
            else:
                blob = _compressed(_points_pieces(points, _std_dumps, False))
            digest = hashlib.sha256()
            for piece in _points_pieces(points, canonical_bytes, True):
                digest.update(piece)
            return blob, digest.hexdigest()
        except (_Unstreamable, RecursionError):
            points = [materialize(point) for point in points]
    return compress_blob(dumps_points(points)), object_hash(points)


# -- objects: one metric's hour, decoded, merged and encoded ----------------------------

@dataclass
class HourObject:
    """One row of the vitrine: the points of one metric, layer and UTC hour."""

    metric: str
    layer: str
    hour: int
    units: Optional[str]
    coords: list  # (start, end, category) of each point, in stored order
    points: list
    deliveries: list  # the id of the delivery each point came from
    created_by: int
    updated_by: int
    sealed: bool
    plain: bool = False
    """No point holds a boolean, so ``==`` on two points of plain sources is
    :func:`same_value` (only ``True == 1`` and ``False == 0`` set them apart)."""


def encode_spans(coords: list) -> bytes:
    """``object.spans``: every start, then every end, as little-endian int64."""
    spans = array.array("q", map(operator.itemgetter(0), coords))
    spans.extend(map(operator.itemgetter(1), coords))
    if sys.byteorder == "big":
        spans.byteswap()
    return spans.tobytes()


def decode_spans(blob: Optional[bytes], count: int) -> Optional[tuple]:
    """(starts, ends) of ``count`` points, or None when ``blob`` does not hold them."""
    if blob is None or len(blob) != 16 * count:
        return None
    spans = array.array("q")
    spans.frombytes(blob)
    if sys.byteorder == "big":
        spans.byteswap()
    return spans[:count], spans[count:]


def decode_object(row: tuple, scratch: Optional[Path] = None) -> HourObject:
    """The object of a stored row.  With ``scratch`` (a fold's ``DATA/tmp``), an object
    whose JSON takes :data:`STREAM_FOLD_BYTES` or more keeps its records' long arrays in
    its text, in a scratch file (:class:`_TextFile`, :class:`Deferred`), as a large
    body's stay in its text."""
    metric, layer, hour, units, created_by, updated_by, sealed, blob, point_deliveries, spans = row
    if scratch is not None and _stored_size(blob) >= STREAM_FOLD_BYTES:
        source = _TextFile(scratch, blob)
        points = _stored_points(source)
        categorized, plain = source.categorized, source.plain
    else:
        text = decompress_blob(blob)
        points = loads_body(text)
        categorized = b'"value"' in text or b'"kind"' in text
        plain = not may_hold_booleans(text)
    known = decode_spans(spans, len(points))
    if known is None:  # written before schema 3: read the timestamps again
        coords = [point_coordinate(p) if type(p) is dict else None for p in points]
        coords = [c if c is not None else (-1, -1, "") for c in coords]
    elif not categorized:  # no point has a category
        coords = list(zip(known[0], known[1], itertools.repeat("")))
    elif -1 in known[0]:  # an unreadable point, stored as (-1, -1, "") before: keep it so
        coords = [(-1, -1, "") if start == -1 and end == -1 else (start, end, _category(p))
                  for start, end, p in zip(known[0], known[1], points)]
    else:
        coords = list(zip(known[0], known[1], map(_category, points)))
    return HourObject(metric, layer, hour, units, coords, points, loads_body(point_deliveries),
                      created_by, updated_by, bool(sealed), plain)


@dataclass
class HourMerge:
    """What merging one hour's arriving points decided: the object to write (None when
    nothing changes), the delivery's counters for it, and WARN records (message,
    fields) to log once the fold is committed."""

    written: Optional[HourObject]
    counters: dict
    warnings: list


def merge_hour(stored: Optional[HourObject], metric: str, layer: str, hour: int,
               units: Optional[str], arriving: list, delivery_id: int, here: tuple,
               positions: Mapping[int, tuple], dropped: int = 0,
               plain: bool = False) -> HourMerge:
    """Merge one delivery's points of one hour into the stored object.  Pure.

    ``arriving``: [(coordinate, point)], one point per coordinate (the within-delivery
    reduction has run; ``dropped`` counts the distinct values it dropped that were
    neither the same value as the winner nor dominated).  ``here`` is the delivery's
    journal position, ``positions`` that of every delivery a stored point came from.
    A stored object whose units differ from ``units`` stays as it is: the arriving
    points stay out (they remain in the archive), counted in ``unit_conflicts``.
    ``plain``: no arriving point holds a boolean (:attr:`HourObject.plain`).
    """
    counters = dict.fromkeys(("objects_written", "overwrites", "incomparable",
                              "unit_conflicts", "sealed_changes"), 0)
    warnings: list = []

    def where(**more: Any) -> dict:  # a warning's fields; most merges have none to log
        return dict({"metric": loggable_metric(metric), "layer": layer, "hour": hour,
                     "hour_utc": format_instant(hour * HOUR_US), "delivery_id": delivery_id},
                    **more)

    if stored is None:
        arriving = sorted(arriving, key=lambda item: item[0])
        written = HourObject(metric, layer, hour, units, [c for c, _ in arriving],
                             [p for _, p in arriving], [delivery_id] * len(arriving),
                             delivery_id, delivery_id, False, plain)
        counters["objects_written"] = 1
        counters["incomparable"] = dropped
        if dropped:
            warnings.append(("incomparable points at one coordinate",
                             where(overwrites=0, incomparable=dropped)))
        return HourMerge(written, counters, warnings)
    if units != stored.units:  # no units is a label too: never mixed with one
        counters["unit_conflicts"] = 1
        warnings.append(("units differ from the stored object's: the arriving points of"
                         " this hour were not stored (they stay in the archive)",
                         where(stored_units=stored.units, arriving_units=units)))
        return HourMerge(None, counters, warnings)
    coords, points, point_deliveries = stored.coords, stored.points, stored.deliveries
    index = dict(zip(coords, range(len(coords))))
    equal_is_same = plain and stored.plain
    appended: list = []  # (coordinate, point) of the coordinates the object lacks
    copied = False
    overwrites = 0
    clashes = dropped
    for coord, point in arriving:  # one point per coordinate
        i = index.get(coord)
        if i is None:
            appended.append((coord, point))
            continue
        mine = points[i]
        if (equal_is_same and mine == point) or same_point(mine, point):
            continue  # a re-send: no change, and no need of the journal positions
        replace, collision, clash = arbitrate(mine, positions[point_deliveries[i]], point, here)
        clashes += clash
        if replace:
            if not copied:  # the stored object itself stays as it was read
                points, point_deliveries, copied = list(points), list(point_deliveries), True
            points[i], point_deliveries[i] = point, delivery_id
            overwrites += collision
    counters["incomparable"], counters["overwrites"] = clashes, overwrites
    if clashes or overwrites:
        warnings.append(("collision: a stored point was replaced by a different value"
                         if overwrites else "incomparable points at one coordinate",
                         where(overwrites=overwrites, incomparable=clashes)))
    if not appended and not overwrites:
        return HourMerge(None, counters, warnings)  # the same values, or lost to the stored
    if appended:
        coords = list(coords) + [c for c, _ in appended]
        points = list(points) + [p for _, p in appended]
        point_deliveries = list(point_deliveries) + [delivery_id] * len(appended)
        order = sorted(range(len(coords)), key=coords.__getitem__)
        coords = [coords[i] for i in order]
        points = [points[i] for i in order]
        point_deliveries = [point_deliveries[i] for i in order]
    if stored.sealed:
        counters["sealed_changes"] = 1
        warnings.append(("a sealed hour changed; the data is stored anyway", where()))
    counters["objects_written"] = 1
    written = HourObject(metric, layer, hour, stored.units, coords, points, point_deliveries,
                         stored.created_by, delivery_id, stored.sealed,
                         plain and stored.plain)
    return HourMerge(written, counters, warnings)


_FAULT_WORDS = {
    "memory": "memory ran out",
    "archive:archive_missing": "the archive folder is missing or empty (is its disk mounted?)",
    "archive:folder_missing": "the archived body's day folder is not there",
    "archive:body_missing": "the archived body is not in its folder",
    None: "the archived body cannot be read",
}
"""What the ERROR of a deferred fold says of each fault of the machine."""


@dataclass(frozen=True)
class Outcome:
    """The class of a fold's result: what happens to the delivery and to the pass."""

    kind: str  # folded | failed | deferred | unrecorded
    status: Optional[str] = None
    error: Optional[str] = None

    @property
    def deferred(self) -> bool:
        return self.kind == "deferred"

    @property
    def machine_fault(self) -> bool:
        """Deferred by a fault of the machine (storage, memory, archive), not a busy
        database: the fold loop pauses before it tries again."""
        return self.kind == "deferred" and self.error != "busy"


def classify(exc: Optional[BaseException], status: Optional[str] = None) -> Outcome:
    """The one classifier of fold results, shared by the worker and reindex (ING-5).

    Only the fold's error is classified; a stop is never an outcome here.
    """
    if exc is None:
        return Outcome("folded", status)
    if isinstance(exc, FoldFailure):
        return Outcome("failed", "failed", exc.error_class)
    if isinstance(exc, RecursionError):  # valid JSON nested deeper than the fold walks
        return Outcome("failed", "failed", "nesting_too_deep")
    if isinstance(exc, sqlite3.Error) and is_busy(exc):
        return Outcome("deferred", error="busy")
    if isinstance(exc, sqlite3.Error) and is_storage_failure(exc):
        return Outcome("deferred", error="storage")  # the machine's fault, not the body's
    if isinstance(exc, ScratchFault):
        return Outcome("deferred", error="storage")  # DATA/tmp: the database's disk
    if isinstance(exc, ArchiveFault):
        return Outcome("deferred", error="archive:" + exc.reason)
    if isinstance(exc, MemoryError):
        return Outcome("deferred", error="memory")
    return Outcome("failed", "failed", "unexpected:" + type(exc).__name__)


FOLD_ROWS_HELD = 2048
FOLD_ROW_BYTES_HELD = 8 << 20
"""Encoded rows a fold holds in memory, at most (and their bytes, about): the rest wait in
a scratch file until the write transaction (:class:`RowSpill`).  A body of one point per
hour object (a Days history, thousands of one-point metrics) gives a row per ~100 bytes
of body, each ~700 bytes in memory: 7x the body, had they all been held."""


class RowSpill:
    """The encoded rows of one fold, in the order they were made: the latest
    (:data:`FOLD_ROWS_HELD` at most) in memory, the ones before in batches in an
    anonymous file under ``DATA/tmp`` (gone when it is closed, or with the process).
    :meth:`batches` gives them back in order, as often as a retried transaction asks."""

    __slots__ = ("rows", "bytes", "file", "spilled", "count")

    def __init__(self) -> None:
        self.rows: list = []
        self.bytes = 0
        self.file: Any = None
        self.spilled = 0  # batches in the file
        self.count = 0  # rows in all

    def append(self, row: tuple, scratch: Path) -> None:
        self.rows.append(row)
        self.count += 1
        self.bytes += 400 + len(row[11]) + len(row[12]) + len(row[13] or "") + len(row[14])
        if len(self.rows) >= FOLD_ROWS_HELD or self.bytes >= FOLD_ROW_BYTES_HELD:
            self._spill(scratch)

    def _spill(self, scratch: Path) -> None:
        try:
            if self.file is None:
                scratch.mkdir(mode=0o700, exist_ok=True)
                self.file = tempfile.TemporaryFile(dir=str(scratch))
            pickle.dump(self.rows, self.file, pickle.HIGHEST_PROTOCOL)
        except OSError as exc:
            raise ScratchFault(exc) from None
        self.rows, self.bytes = [], 0
        self.spilled += 1

    def batches(self) -> Iterator[list]:
        """Every row, in batches, in the order appended."""
        if self.spilled:
            try:
                self.file.seek(0)
                for _ in range(self.spilled):
                    yield pickle.load(self.file)
            except OSError as exc:
                raise ScratchFault(exc) from None
        if self.rows:
            yield self.rows

    def __len__(self) -> int:
        return self.count

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
            self.file = None


@dataclass
class FoldPlan:
    """Everything one fold decided, computed before the write transaction."""

    delivery_id: int
    status: str
    layer: Optional[str]
    uncovered: list
    error: Optional[str] = None
    counters: dict = _field(default_factory=dict)
    rows: RowSpill = _field(default_factory=RowSpill)  # the objects it writes, encoded
    recent: collections.deque = _field(  # write-behind: the last objects it writes, decoded
        default_factory=lambda: collections.deque(maxlen=RECENT_OBJECTS))
    forget: list = _field(default_factory=list)  # write-behind: keys not kept decoded
    warnings: list = _field(default_factory=list)  # (message, fields) logged after commit
    metric_layer: Optional[str] = None  # where its time-grouped metrics go
    plain: bool = False  # its body holds no boolean (HourObject.plain)
    here: tuple = ()  # (received_at, id): its place in the journal
    from_ingest: bool = False  # its document came from ingest (Handoff), not the archive


class _Positions:
    """Journal positions by delivery id, asked of the journal only when a merge meets a
    stored point with a different value (a re-send of the same values asks nothing)."""

    def __init__(self, lookup: Callable[[int], tuple]):
        self._lookup = lookup

    def __getitem__(self, delivery_id: int) -> tuple:
        return self._lookup(delivery_id)


def inherited_layer(conn: sqlite3.Connection, row: Mapping[str, Any],
                    journal: str = "delivery") -> Optional[str]:
    """The metric layer of the latest folded delivery before ``row`` in journal order
    (``received_at``, ``id``) of the same automation: automation-id, else
    automation-name, else the ingest path name."""
    for column in ("automation_id", "automation_name", "path_name"):
        if row[column]:
            break
    else:
        return None
    found = conn.execute(
        "SELECT layer FROM %s WHERE %s = ? AND parse_status IN ('parsed', 'partial')"
        " AND layer IS NOT NULL AND layer != ?"
        " AND (received_at < ? OR (received_at = ? AND id < ?))"
        " ORDER BY received_at DESC, id DESC LIMIT 1" % (journal, column),
        (row[column], RECORD_LAYER, row["received_at"], row["received_at"],
         row["id"])).fetchone()
    return found[0] if found else None


_COUNTERS = ("metrics", "points", "bad_points", "objects_written", "overwrites",
             "incomparable", "unit_conflicts", "sealed_changes")


RECENT_OBJECTS = 256
"""Decoded objects a rebuild keeps: a push's hours are read again by the next push."""


def fold_budget_s(config: Config, body_bytes: Optional[int]) -> float:
    """How long the fold of a body of ``body_bytes`` may take (:data:`FOLD_DEADLINE_MIB`):
    the configured deadline, and as much again for every further 16 MiB."""
    blocks = (body_bytes or 0) / (FOLD_DEADLINE_MIB * 1048576)
    return config.fold_deadline_s * max(1.0, blocks)


class FoldEngine:
    """Folds deliveries into one object table and records outcomes in one journal table.

    The worker folds into ``object``/``delivery``; reindex into fresh tables that are
    swapped in at the end.  Only one FoldEngine writes a table set at a time, so objects
    read before the write transaction cannot change underneath it.
    """

    def __init__(self, conn: sqlite3.Connection, config: Config, objects: str = "object",
                 journal: str = "delivery", verbose: bool = True):
        assert objects.isidentifier() and journal.isidentifier()
        self.conn, self.config = conn, config
        self.verbose = verbose  # reindex: per-delivery records at DEBUG, one for the run at the end
        self.objects, self.journal = objects, journal
        self._positions: dict = {}
        self._recent: Optional[collections.OrderedDict] = None
        self._dirty: Optional[dict] = None
        self._written: Optional[set] = None
        self._scratch = config.data_dir / TMP_DIR  # where a fold's rows spill (RowSpill)
        self.handoff: Optional[Handoff] = None  # the fold thread's: documents from ingest

    def write_behind(self) -> None:
        """Hold the rows of the objects this engine writes and write them at
        :meth:`flush`, each once however many folds changed it (a fold still encodes its
        objects, so a failure to encode one is its own ``failed``); keep the last
        :data:`RECENT_OBJECTS` of them decoded, to read from memory (a held one further
        back is decoded from its row).  A fold whose rows spilled to its scratch file
        (:class:`RowSpill`) is too big to hold: its rows are written with its outcome,
        after the held ones.
        Only for a rebuild: its tables have no other writer while the engine lives, so
        memory and the table never disagree."""
        self._recent = collections.OrderedDict()
        self._dirty = {}
        empty = self.conn.execute("SELECT 1 FROM %s LIMIT 1" % self.objects).fetchone() is None
        # A rebuild starts from an empty table: an object this engine never wrote is not
        # there, and need not be looked for (hashes of the keys written: a collision
        # only costs a look).
        self._written: Optional[set] = set() if empty else None

    def keep(self, plan: FoldPlan) -> None:
        """Writing behind: hold the objects of a fold whose outcome stands, for the next
        :meth:`flush` (unless they spilled: then they are written already), and keep the
        last :data:`RECENT_OBJECTS` of them decoded for the next folds (the ones before
        would have been pushed out by these)."""
        if not plan.rows.spilled:
            for encoded in plan.rows.rows:
                self._dirty[encoded[:3]] = encoded
        for key in plan.forget:
            self._recent.pop(key, None)
        for written in plan.recent:
            key = (written.metric, written.layer, written.hour)
            self._recent[key] = written
            self._recent.move_to_end(key)
        while len(self._recent) > RECENT_OBJECTS:  # a held one is decoded again from its row
            self._recent.popitem(last=False)

    def store(self, plan: FoldPlan) -> None:
        """Writing behind, without a journal (a rebuild worker's shard): :meth:`keep`,
        writing the rows of a fold that spilled first, after the held ones."""
        if plan.rows.spilled:
            self.flush()
            self._write(lambda: self._insert(plan.rows))
        self.keep(plan)

    def _insert(self, rows: RowSpill) -> None:
        insert = self._insert_objects
        for batch in rows.batches():
            self.conn.executemany(insert, batch)

    @property
    def held(self) -> int:
        """Rows held for the next :meth:`flush`."""
        return len(self._dirty or ())

    @property
    def _insert_objects(self) -> str:
        return ("INSERT OR REPLACE INTO %s (metric, layer, hour, units, first_at, last_at,"
                " points, delivery_id, updated_by, hash, sealed, blob, point_deliveries,"
                " summary, spans) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)"
                % self.objects)

    def flush(self) -> None:
        """Write the rows held since the last flush, in one transaction."""
        if self._dirty:
            rows = [self._dirty[key] for key in sorted(self._dirty)]
            self._write(lambda: self.conn.executemany(self._insert_objects, rows))
            self._dirty.clear()
        while self._recent is not None and len(self._recent) > RECENT_OBJECTS:
            self._recent.popitem(last=False)

    # -- reading -----------------------------------------------------------------

    def row(self, delivery_id: int) -> Optional[sqlite3.Row]:
        cursor = self.conn.execute(
            "SELECT id, received_at, archive_path, body_bytes, body_sha256, automation_id,"
            " automation_name, automation_aggregation, path_name, parse_status,"
            " uncovered_keys, attempts, error FROM %s WHERE id = ?" % self.journal,
            (delivery_id,))
        cursor.row_factory = sqlite3.Row
        return cursor.fetchone()

    def position(self, delivery_id: int) -> tuple:
        """(received_at, id): a delivery's place in the journal."""
        found = self._positions.get(delivery_id)
        if found is None:
            row = self.conn.execute("SELECT received_at FROM %s WHERE id = ?" % self.journal,
                                    (delivery_id,)).fetchone()
            found = (row[0] if row else "", delivery_id)
            if len(self._positions) > 100_000:
                self._positions.clear()
            self._positions[delivery_id] = found
        return found

    def load_object(self, metric: str, layer: str, hour: int) -> Optional[HourObject]:
        if self._recent is not None:
            recent = self._recent.get((metric, layer, hour))
            if recent is not None:
                self._recent.move_to_end((metric, layer, hour))
                return recent
            if self._written is not None and hash((metric, layer, hour)) not in self._written:
                return None
            held = self._dirty.get((metric, layer, hour))
            if held is not None:  # written since the last flush, no longer decoded
                found = decode_object(operator.itemgetter(0, 1, 2, 3, 7, 8, 10, 11, 12, 14)(
                    held), self._scratch)
                if not holds_deferred(found.points):
                    self._recent[(metric, layer, hour)] = found
                return found
        row = self.conn.execute(
            "SELECT metric, layer, hour, units, delivery_id, updated_by, sealed, blob,"
            " point_deliveries, spans FROM %s WHERE metric = ? AND layer = ? AND hour = ?"
            % self.objects, (metric, layer, hour)).fetchone()
        return decode_object(row, self._scratch) if row else None

    def earlier_duplicate(self, row: sqlite3.Row) -> Optional[tuple]:
        """An earlier parsed/partial delivery with the same bytes and the same
        layer-deciding headers: (id, status, layer, uncovered_keys)."""
        return self.conn.execute(
            "SELECT id, parse_status, layer, uncovered_keys FROM %s"
            " WHERE body_sha256 = ? AND parse_status IN ('parsed', 'partial')"
            " AND (received_at < ? OR (received_at = ? AND id < ?))"
            " AND automation_aggregation IS ? AND automation_id IS ?"
            " AND automation_name IS ? AND path_name IS ?"
            " ORDER BY received_at, id LIMIT 1" % self.journal,
            (row["body_sha256"], row["received_at"], row["received_at"], row["id"],
             row["automation_aggregation"], row["automation_id"], row["automation_name"],
             row["path_name"])).fetchone()

    def inherited_layer(self, row: Mapping[str, Any]) -> Optional[str]:
        """The metric layer of the previous folded delivery (journal order) of the same
        automation: automation-id, else automation-name, else the ingest path name."""
        return inherited_layer(self.conn, row, self.journal)

    def later_already_folded(self, row: sqlite3.Row) -> bool:
        """Is a delivery later in the journal already parsed/partial? (ING-4.3)"""
        return self.conn.execute(
            "SELECT 1 FROM %s WHERE parse_status IN ('parsed', 'partial')"
            " AND (received_at > ? OR (received_at = ? AND id > ?)) LIMIT 1" % self.journal,
            (row["received_at"], row["received_at"], row["id"])).fetchone() is not None

    # -- folding -----------------------------------------------------------------

    def plan(self, row: sqlite3.Row, deadline: float) -> FoldPlan:
        """All the CPU work of a fold: read, parse, place, merge, encode.  No writes."""

        def check_deadline() -> None:
            if time.monotonic() > deadline:
                raise FoldDeadlineExceeded()

        handed = self.handoff.take(row["id"]) if self.handoff is not None else None
        if handed is not None and wide_document(handed[0]):
            handed = None  # thousands of metrics: indexed from the archive instead
        duplicate = self.earlier_duplicate(row)
        if duplicate is not None:
            earlier, status, layer, uncovered = duplicate
            return FoldPlan(row["id"], status, layer, json.loads(uncovered),
                            error="duplicate of delivery %d" % earlier,
                            counters=dict.fromkeys(_COUNTERS, 0))
        if handed is None:
            extraction, plain = extract_body(self.config.data_dir / row["archive_path"],
                                             check_deadline)
        else:  # the document ingest parsed from the bytes it archived
            doc, plain = handed
            handed = True
            extraction = extract_points(doc, check_deadline)
            del doc
        outline = outline_of(extraction, plain, row["automation_aggregation"])
        plan = self.decide(row, outline)
        plan.from_ingest = handed is True
        self._merge(plan, row, extraction, check_deadline)
        self._describe(plan, outline)
        return plan

    def decide(self, row: Mapping[str, Any], outline: "BodyOutline") -> FoldPlan:
        """The outcome a parsed body gets before its points meet the store: its status
        and layer, the counters the body itself gives; raises the fold failures that
        need no comparison (nothing placed, no layer to be found)."""
        if outline.bad_points and not outline.points:
            raise ContentNotParsed("no point in the delivery could be placed",
                                   uncovered=outline.uncovered)
        layer, warnings = self._layer(row, outline)
        counters = dict.fromkeys(_COUNTERS, 0)
        counters.update(metrics=outline.metrics, points=outline.points,
                        bad_points=outline.bad_points,
                        unit_conflicts=len(outline.mixed_units))
        return FoldPlan(row["id"], "partial" if outline.uncovered else "parsed",
                        layer if outline.has_metric_points else (
                            RECORD_LAYER if outline.points else None),
                        outline.uncovered, counters=counters, warnings=warnings,
                        metric_layer=layer, plain=outline.plain,
                        here=(row["received_at"], row["id"]))

    def _layer(self, row: Mapping[str, Any], outline: "BodyOutline") -> tuple:
        """(layer, warnings): header, else inference, else inheritance (storage spec)."""
        if not outline.has_metric_points:
            return None, []
        raw = row["automation_aggregation"]
        header = header_layer(raw)
        inferred = outline.inferred
        warnings = []
        if header is not None:
            if (inferred is not None and header != "default"
                    and _ALIGNMENT[inferred] < _ALIGNMENT[header]):
                warnings.append(("the automation-aggregation header disagrees with the bucket"
                                 " starts; the header wins",
                                 {"delivery_id": row["id"], "header": header,
                                  "inferred": inferred}))
            return header, warnings
        if raw is not None and raw.strip():
            warnings.append(("the automation-aggregation header names no known grouping;"
                             " the layer is inferred",
                             {"delivery_id": row["id"], "header": raw,
                              "known": ",".join(GROUPINGS)}))
        layer = inferred or self.inherited_layer(row)
        if layer is None:
            raise LayerNotInferable(uncovered=outline.uncovered)
        return layer, warnings

    def _merge(self, plan: FoldPlan, row: sqlite3.Row, extraction: Extraction,
               check_deadline: Callable[[], None]) -> None:
        for bucket in extraction.take_buckets():  # its points let go once merged, encoded
            layer = plan.metric_layer if bucket.is_metric else RECORD_LAYER
            new = self._dirty is None and self.conn.execute(  # a metric the store lacks
                "SELECT 1 FROM %s WHERE metric = ? AND layer = ? LIMIT 1" % self.objects,
                (bucket.name, layer)).fetchone() is None
            for hour, items, dropped in hour_items(bucket, check_deadline):
                check_deadline()
                self.merge_items(plan, bucket.name, bucket.is_metric, bucket.units, hour,
                                 items, dropped, new)

    def merge_items(self, plan: FoldPlan, name: str, is_metric: bool, units: Optional[str],
                    hour: int, items: list, dropped: int, new: bool = False) -> None:
        """Merge one hour of one metric of the planned delivery with the stored object
        and encode the object it gives: its counters and warnings go to ``plan``, its row
        to ``plan.rows`` (and, writing behind, the object to ``plan.recent``).  ``new``:
        the store holds no object of this metric and layer (no hour of it is looked up:
        a Days history of every metric is one lookup a metric, not one a point)."""
        layer = plan.metric_layer if is_metric else RECORD_LAYER
        stored = None if new else self.load_object(name, layer, hour)
        merged = merge_hour(stored, name, layer, hour, units, items, plan.delivery_id,
                            plan.here, _Positions(self.position), dropped, plan.plain)
        counters = plan.counters
        for counter, count in merged.counters.items():
            counters[counter] += count
        plan.warnings.extend(merged.warnings)
        if merged.written is None:
            return
        plan.rows.append(self._row(merged.written), self._scratch)
        if self._dirty is not None:  # writing behind: held until the next flush
            if holds_deferred(merged.written.points):  # never kept decoded: it holds a text
                plan.forget.append((name, layer, hour))
            else:
                plan.recent.append(merged.written)
            if self._written is not None:  # (a fold that fails after this costs a look)
                self._written.add(hash((name, layer, hour)))

    @staticmethod
    def _row(written: HourObject) -> tuple:
        points, coords = written.points, written.coords
        blob, digest = encode_points(points)
        return (written.metric, written.layer, written.hour, written.units,
                coords[0][0] // US, coords[-1][0] // US, len(points), written.created_by,
                written.updated_by, digest, int(written.sealed), blob,
                compact_json(written.deliveries), compact_json(hour_tally(points, coords)),
                encode_spans(coords))

    @staticmethod
    def _describe(plan: FoldPlan, outline: "BodyOutline") -> None:
        if outline.bad_points:
            names = sorted({loggable_metric(str(n)) for n in outline.bad_metrics})
            plan.warnings.insert(0, ("points without a readable time or not objects were"
                                     " counted, not stored",
                                     {"delivery_id": plan.delivery_id,
                                      "bad_points": outline.bad_points,
                                      "metrics": names[:WARN_NAMES_MAX]}))
        if outline.mixed_units:
            names = sorted({loggable_metric(n) for n in outline.mixed_units})
            plan.warnings.insert(0, ("a metric came in two units in one body; the points in"
                                     " the second stay in the archive only",
                                     {"delivery_id": plan.delivery_id,
                                      "metrics": names[:WARN_NAMES_MAX]}))
        if outline.uncovered_dropped or outline.uncovered_cut:
            plan.warnings.insert(0, ("the list of uncovered keys hit its bounds",
                                     {"delivery_id": plan.delivery_id,
                                      "dropped": outline.uncovered_dropped,
                                      "cut": outline.uncovered_cut}))

    # -- writing -----------------------------------------------------------------

    def apply(self, plan: FoldPlan) -> None:
        """Write every changed object and the delivery's outcome in one transaction (its
        rows in batches, as :class:`RowSpill` gives them back).  Writing behind, the
        objects wait for :meth:`keep` and :meth:`flush`, unless they spilled: then the
        held ones are flushed first, and these written with the outcome."""
        counters = [plan.counters.get(name) for name in _COUNTERS]
        rows = plan.rows if self._dirty is None or plan.rows.spilled else None
        if rows is not None and self._dirty is not None:
            self.flush()
        self._write(lambda: (
            rows is not None and self._insert(rows),
            self._record(plan.delivery_id, plan.status, plan.layer, plan.uncovered, plan.error,
                         counters)))

    def count_attempt(self, delivery_id: int, taken_back: int = 0) -> None:
        """Raise the delivery's attempt count in its own transaction, before its fold:
        a fold the process does not survive leaves this trace (fold spec, FOLD-14).
        ``taken_back``: earlier attempts a busy or failing database deferred, which
        could not be taken back then."""
        self._write(lambda: self.conn.execute(
            "UPDATE %s SET attempts = max(attempts + 1 - ?, 0) WHERE id = ?" % self.journal,
            (taken_back, delivery_id)))

    def note_fault(self, delivery_id: int, fault: str) -> bool:
        """Write the fault of the machine that deferred a fold on its (still pending)
        row, and take its attempt back: only a death counts (FOLD-14, FOLD-15).  False
        when the database could not be written (the attempt is then owed)."""
        try:
            self._write(lambda: self.conn.execute(
                "UPDATE %s SET error = ?, attempts = max(attempts - 1, 0)"
                " WHERE id = ? AND parse_status = 'pending'" % self.journal,
                ("retrying:" + fault, delivery_id)))
        except sqlite3.Error:
            return False
        return True

    def record_failed(self, delivery_id: int, error: str, uncovered: Optional[list]) -> None:
        """Write a ``failed`` outcome (counters stay empty: only a successful fold has them)."""
        self._write(lambda: self._record(delivery_id, "failed", None, uncovered, error,
                                         [None] * len(_COUNTERS)))

    def _record(self, delivery_id: int, status: str, layer: Optional[str],
                uncovered: Optional[list], error: Optional[str], counters: list) -> None:
        uncovered_sql = ", uncovered_keys = ?" if uncovered is not None else ""
        values = [status, layer, error, format_received_at(utc_now()), PARSER_VERSION]
        if uncovered is not None:
            values.append(json.dumps(uncovered, ensure_ascii=False))
        self.conn.execute(
            "UPDATE %s SET parse_status = ?, layer = ?, error = ?, folded_at = ?,"
            " parser_version = ?%s, %s WHERE id = ?"
            % (self.journal, uncovered_sql, ", ".join("%s = ?" % c for c in _COUNTERS)),
            values + counters + [delivery_id])

    def _write(self, work: Callable[[], Any]) -> None:
        for attempt in range(len(FOLD_BUSY_BACKOFF_S) + 1):
            try:
                with write_txn(self.conn):
                    work()
                return
            except sqlite3.Error as exc:
                if not is_busy(exc) or attempt == len(FOLD_BUSY_BACKOFF_S):
                    raise
                time.sleep(FOLD_BUSY_BACKOFF_S[attempt])

    # -- the boundary that records outcomes ----------------------------------------

    def fold(self, delivery_id: int, row: Optional[sqlite3.Row] = None) -> Outcome:
        """Fold one delivery and record its outcome; raises only when its journal row
        cannot even be read (a database failure, which ends the pass).  ``row`` saves
        reading it again when the caller already has it.

        Any exception of the fold becomes ``failed`` here, at the boundary that writes
        the outcome (ING-3); a busy database leaves the delivery pending (deferred).
        """
        started = time.monotonic()
        if row is None:
            row = self.row(delivery_id)
        if row is None:
            return Outcome("unrecorded")
        plan = None
        try:
            plan = self.plan(row, started + fold_budget_s(self.config, row["body_bytes"]))
            self.apply(plan)
            outcome = classify(None, plan.status)
            if self._dirty is not None:
                self.keep(plan)
            plan.rows.close()
        except Exception as exc:  # the fold boundary: classify, never crash the worker
            if plan is not None:
                plan.rows.close()
            outcome = classify(exc)
            if outcome.kind == "failed":
                log_event(logging.DEBUG, "fold failure detail", delivery_id=delivery_id,
                          detail=repr(exc))
                uncovered = getattr(exc, "uncovered", None)
                if uncovered is None and plan is not None:
                    uncovered = plan.uncovered  # the parse had collected it (STO-7.3)
                outcome = self._record_failure(delivery_id, outcome, uncovered)
        if outcome.kind == "folded":
            self._log_folded(plan, time.monotonic() - started, self.verbose)
        else:
            self.log_deferred(delivery_id, outcome)
        return outcome

    @staticmethod
    def log_deferred(delivery_id: int, outcome: Outcome) -> None:
        """The one record of a deferred fold: INFO for a busy database, else ERROR."""
        if outcome.error == "storage":
            log_event(logging.ERROR, "fold deferred: the database cannot be written (disk full,"
                      " read-only or failing); the delivery stays pending",
                      delivery_id=delivery_id)
        elif outcome.machine_fault:
            log_event(logging.ERROR, "fold deferred: %s; the delivery stays pending and is"
                      " tried again" % _FAULT_WORDS.get(outcome.error, _FAULT_WORDS[None]),
                      delivery_id=delivery_id, fault=outcome.error)
        elif outcome.kind == "deferred":
            log_event(logging.INFO, "fold deferred: the database is busy; the delivery stays"
                      " pending", delivery_id=delivery_id)

    def _record_failure(self, delivery_id: int, outcome: Outcome,
                        uncovered: Optional[list]) -> Outcome:
        try:
            self.record_failed(delivery_id, outcome.error, uncovered)
        except sqlite3.Error as exc:
            if is_busy(exc) or is_storage_failure(exc):
                return classify(exc)
            log_event(logging.ERROR, "fold outcome not written; the delivery stays pending",
                      delivery_id=delivery_id, error=type(exc).__name__)
            return Outcome("unrecorded", error=outcome.error)
        log_event(logging.WARNING if self.verbose else logging.DEBUG, "delivery failed to fold",
                  delivery_id=delivery_id, error=outcome.error)
        return outcome

    @staticmethod
    def _log_folded(plan: FoldPlan, seconds: float, verbose: bool) -> None:
        for message, fields in plan.warnings:
            log_event(logging.WARNING if verbose else logging.DEBUG, message, **fields)
        log_event(logging.INFO if verbose else logging.DEBUG, "delivery folded",
                  delivery_id=plan.delivery_id,
                  status=plan.status, layer=plan.layer, uncovered=plan.uncovered or None,
                  duplicate_of=plan.error, ms=round(seconds * 1000, 1),
                  parsed="at ingest" if plan.from_ingest else None, **plan.counters)


# ==============================================================================
# Fold worker: the one thread that folds pending deliveries in journal order; its handoff.
# ==============================================================================

LAG_WARN_S = 300.0
"""One fast-sync period of HAE: a delivery that waited longer means the queue grows
instead of draining (ING-7)."""

PASS_BATCH = 64

ABSENT_BODY = "archive:body_missing"
"""The deferred outcome of a body absent from a day folder that is there (:func:`classify`
of :class:`BodyAbsent`): the one machine fault that may, after a wait, fail a delivery."""

FOLD_RESTART_PAUSES_S = (1.0, 5.0, 15.0, 60.0)
"""Pauses before the fold loop starts again after consecutive failures or machine faults
(the last one repeats): a broken database is retried every minute, never given up on."""

ATTEMPTS_EXHAUSTED = "fold_attempts_exhausted"
RETRY_WORTHY = (ATTEMPTS_EXHAUSTED, "fold_deadline_exceeded", "body_unreadable",
                BodyMissing.error_class)
"""Error classes the machine, not the body, may have caused (``body_unreadable`` was
written by older versions; a ``body_missing`` file may come back with its disk or its
copy; ``unexpected:…`` too is worth a retry after an upgrade): ``status`` says so, and
``healthlog refold --failed`` sets them back to pending."""


def worth_retrying(error: Optional[str]) -> bool:
    """Could a failure of this class have been the machine's (:data:`RETRY_WORTHY`)?"""
    return error is not None and (error in RETRY_WORTHY or error.startswith("unexpected:"))


class Handoff:
    """Documents parsed at ingest, kept for the fold thread so that a delivery is parsed
    once (the fold would read and parse the archived copy of the same bytes again).

    Documents whose estimated memory (:func:`document_cost`) adds up to at most
    ``budget`` wait; the oldest give way.  What is not here (a restart, a large body, a
    document given way) is read from the archive, which stays the truth: the fold of a
    handed-over document is the fold of the archived body."""

    def __init__(self, budget: int):
        self.budget = budget
        self._lock = threading.Lock()
        self._waiting: collections.OrderedDict = collections.OrderedDict()  # id -> entry
        self._bytes = 0

    def put(self, delivery_id: int, doc: Any, plain: bool, cost: int) -> None:
        if cost > self.budget:
            return
        with self._lock:
            self._waiting[delivery_id] = (cost, doc, plain)
            self._bytes += cost
            while self._bytes > self.budget:
                self._bytes -= self._waiting.popitem(last=False)[1][0]

    def take(self, delivery_id: int) -> Optional[tuple]:
        """(document, plain) of a delivery, once; None when it is not here."""
        with self._lock:
            entry = self._waiting.pop(delivery_id, None)
            if entry is None:
                return None
            self._bytes -= entry[0]
            return entry[1:]


class FoldWorker:
    """Owns the fold thread: ``start()``, ``wake()``, idempotent ``stop(timeout)``.

    A pass selects ``pending`` deliveries after a strictly increasing cursor, in
    journal order ``(received_at, id)``, and folds them one by one; the stop flag is
    looked at between deliveries, never inside a fold (ING-4, ING-6).  A pass that
    raises (a database that cannot be read, say) restarts the loop after a pause.
    """

    restart_pauses_s = FOLD_RESTART_PAUSES_S

    def __init__(self, config: Config):
        self._config = config
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._started_at = format_received_at(utc_now())
        self._first_pass_done = False
        self.state = "starting"
        self.fold_seconds = Histogram(TIMING_BOUNDS)  # for /metrics, by outcome
        self.died = threading.Event()  # the thread ended without a stop request
        self._passed = False
        self.current: Optional[int] = None  # the delivery being folded
        self.fault: Optional[str] = None  # the machine fault the loop is paused for
        self._owed: dict = {}  # delivery id -> attempts to take back at its next one
        self._absent_since: dict = {}  # delivery id -> clock when its body was first absent
        self.handoff = Handoff(config.handoff_budget) if config.handoff_budget > 0 else None

    def start(self) -> None:
        self._started_at = format_received_at(utc_now())
        self._thread = threading.Thread(target=self._run, name="healthlog-fold", daemon=True)
        self._thread.start()

    @property
    def thread(self) -> Optional[threading.Thread]:
        return self._thread

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
        """The supervisor: any exception ends the loop, which starts again on a fresh
        connection after a growing pause (RELY-8.1); ``/healthz`` answers 503 meanwhile."""
        failures = 0
        try:
            while not self._stop.is_set():
                try:
                    self._loop()
                    return  # stop requested
                except Exception as exc:
                    failures = 1 if self._passed else failures + 1
                    self._passed = False
                    pause = self.restart_pauses_s[min(failures, len(self.restart_pauses_s)) - 1]
                    self.state = "restarting"
                    if isinstance(exc, FoldPaused):  # its ERROR named the delivery and fault
                        log_event(logging.INFO, "the fold loop pauses after a fault of the"
                                  " machine", fault=self.fault, restart_in_s=pause)
                    else:
                        log_event(logging.ERROR, "fold pass failed; the fold loop starts"
                                  " again", error=type(exc).__name__, restart_in_s=pause)
                    log_event(logging.DEBUG, "fold thread failure detail", detail=repr(exc))
                    self._stop.wait(pause)
        except BaseException as exc:  # not an Exception: nothing to restart in-thread
            log_event(logging.ERROR, "fold thread ended unexpectedly", error=type(exc).__name__)
            self.state = "stopped"  # before died is seen: /healthz then says failing
            self.died.set()
        finally:
            self.state = "stopped"
            log_event(logging.INFO, "fold thread stopped")

    def connect(self) -> sqlite3.Connection:
        """The fold thread's connection: ``synchronous=NORMAL``, since every fold can be
        redone from the archive (a crash may lose the last commits, never a body)."""
        return connect(self._config.db_path, busy_timeout_s=self._config.busy_timeout_s,
                       synchronous="NORMAL")

    def _loop(self) -> None:
        conn = self.connect()
        try:
            engine = FoldEngine(conn, self._config)
            engine.handoff = self.handoff
            backlog = count_pending(conn)
            if backlog:
                log_event(logging.INFO, "deliveries waiting to be folded", backlog=backlog)
            while not self._stop.is_set():
                self.state, self.fault = "folding", None
                self.run_pass(engine)
                self._passed = True
                self.state = "idle"
                self._wake.wait(self._config.fold_wake_s)
                self._wake.clear()
        finally:
            conn.close()

    @property
    def running(self) -> bool:
        """Is the loop up (folding or waiting), rather than restarting or ended?"""
        return self.state in ("starting", "folding", "idle")

    def run_pass(self, engine: FoldEngine) -> int:
        """One pass: fold every visible pending delivery after the cursor, in journal
        order; stop at a deferred one (the barrier) or at a stop request.

        Returns how many deliveries were folded.  The lag mark is computed on the pass's
        selection and written once per pass, also at the barrier (ING-7).
        """
        cursor = ("", 0)
        folded = 0
        completed = False
        lag = self._lag(engine.conn)
        try:
            while True:
                batch = engine.conn.execute(
                    "SELECT id, received_at FROM delivery WHERE parse_status = 'pending'"
                    " AND (received_at > ? OR (received_at = ? AND id > ?))"
                    " ORDER BY received_at, id LIMIT ?",
                    (cursor[0], cursor[0], cursor[1], PASS_BATCH)).fetchall()
                if not batch:
                    completed = True
                    return folded
                for delivery_id, received_at in batch:
                    if self._stop.is_set():
                        return folded
                    cursor = (received_at, delivery_id)
                    outcome = self.fold_one(engine, delivery_id)
                    if outcome.error == ABSENT_BODY:
                        outcome = self._absent_body(engine, delivery_id, outcome)
                    else:
                        self._absent_since.pop(delivery_id, None)
                    if outcome.machine_fault:  # the loop pauses; /healthz says failing
                        self.fault = outcome.error
                        raise FoldPaused(outcome.error)
                    self.fault = None
                    if outcome.deferred:
                        return folded  # the barrier: successors wait for this one
                    folded += outcome.kind == "folded"
        finally:
            if lag is not None:
                delayed, worst_wait, worst_id = lag
                log_event(logging.WARNING, "deliveries waited longer than %d s for their fold"
                          % LAG_WARN_S, delayed=delayed, worst_wait_s=round(worst_wait, 1),
                          worst_delivery_id=worst_id)
            if completed:
                self._first_pass_done = True

    def _absent_body(self, engine: FoldEngine, delivery_id: int, absent: Outcome) -> Outcome:
        """A body absent from its readable day folder waits like any fault of the machine;
        after ``missing_body_wait_s`` of this process's clock, and only if the archive and
        the folder can still be read and the file is still not there, the delivery is
        failed (``body_missing``) so that the deliveries after it are folded (FOLD-15.3)."""
        now = self._config.clock()
        since = self._absent_since.setdefault(delivery_id, now)
        if now - since < self._config.missing_body_wait_s:
            return absent
        row = engine.row(delivery_id)
        if row is None or not body_lost(self._config.data_dir, row["archive_path"]):
            return absent
        try:
            engine.record_failed(delivery_id, BodyMissing.error_class, None)
        except sqlite3.Error as exc:
            outcome = classify(exc)
            if not outcome.deferred:
                raise
            return outcome
        del self._absent_since[delivery_id]
        log_event(logging.ERROR, "an archived body stayed missing from its readable folder;"
                  " the delivery is failed so that the deliveries after it are folded."
                  " Should the file come back, `healthlog refold %d` folds it" % delivery_id,
                  delivery_id=delivery_id, missing_s=round(now - since))
        return Outcome("failed", "failed", BodyMissing.error_class)

    def _give_up(self, engine: FoldEngine, row: Mapping[str, Any]) -> Outcome:
        """Fail a delivery whose attempts ran out, and say so loudly, with the way back."""
        try:
            engine.record_failed(row["id"], ATTEMPTS_EXHAUSTED, None)
        except sqlite3.Error as exc:
            outcome = classify(exc)
            if not outcome.deferred:
                raise
            return outcome
        last_fault = (row["error"] or "retrying:died").partition(":")[2]
        log_event(logging.ERROR, "a delivery was tried %d times without an outcome (the"
                  " process died during its fold); it is failed now so that the deliveries"
                  " after it are folded. To fold it again, give healthlog more memory (or a"
                  " lower --max-body-mib), then run `healthlog refold %d`"
                  % (row["attempts"], row["id"]),
                  delivery_id=row["id"], body_mib=round(row["body_bytes"] / 1048576, 1),
                  last_fault=last_fault)
        return Outcome("failed", "failed", ATTEMPTS_EXHAUSTED)

    def settle(self, delivery_id: int) -> None:
        """Take back the attempt of a fold that a stop cut short (a stop is no fault of
        the delivery's).  Best effort, from the thread that stops the worker."""
        with contextlib.suppress(sqlite3.Error, OSError):
            conn = connect(self._config.db_path, busy_timeout_s=1.0)
            try:
                with write_txn(conn):
                    conn.execute("UPDATE delivery SET attempts = max(attempts - 1, 0)"
                                 " WHERE id = ? AND parse_status = 'pending'", (delivery_id,))
            finally:
                conn.close()

    def _lag(self, conn: sqlite3.Connection) -> Optional[tuple]:
        """(delayed, worst wait in s, its delivery id) among the pending deliveries that
        waited longer than LAG_WARN_S, or None.  Until the first pass has completed, the
        backlog from before this start is left out (the start-up INFO named it)."""
        now = utc_now()
        threshold = format_received_at(now - _dt.timedelta(seconds=LAG_WARN_S))
        floor = "" if self._first_pass_done else self._started_at
        # The wait starts when the delivery entered the journal: for HTTP that is its
        # received_at (plus the upload); an import's received_at is its export time.
        waiting = "coalesce(journaled_at, received_at)"
        delayed, oldest = conn.execute(
            "SELECT count(*), min(%s) FROM delivery WHERE parse_status = 'pending'"
            " AND %s < ? AND %s >= ?" % (waiting, waiting, waiting),
            (threshold, floor)).fetchone()
        if not delayed:
            return None
        worst_id = conn.execute(
            "SELECT min(id) FROM delivery WHERE parse_status = 'pending' AND %s = ?"
            % waiting, (oldest,)).fetchone()[0]
        return delayed, (now - parse_received_at(oldest)).total_seconds(), worst_id

    def fold_one(self, engine: FoldEngine, delivery_id: int) -> Outcome:
        """Fold one delivery; the out-of-order WARN is asked before and written after.

        The attempt is counted before the fold (FOLD-14): a delivery that already had
        :data:`FOLD_ATTEMPTS_MAX` attempts without an outcome is failed instead.  An
        attempt stays counted only when the process dies during the fold: a busy or
        failing database, an archive that cannot be read (whatever the other folders do)
        and memory running out take it back, and the loop pauses until the fault is
        gone (FOLD-15)."""
        row = engine.row(delivery_id)
        if row is None or row["parse_status"] != "pending":
            return Outcome("unrecorded")
        owed = self._owed.get(delivery_id, 0)
        if row["attempts"] - owed >= FOLD_ATTEMPTS_MAX:
            return self._give_up(engine, row)
        counted = False
        try:
            engine.count_attempt(delivery_id, owed)
            self._owed.pop(delivery_id, None)
            counted = True
        except sqlite3.Error as exc:
            outcome = classify(exc)
            if outcome.deferred:
                engine.log_deferred(delivery_id, outcome)
                return outcome
            # Any other refusal (a trigger, say) is the outcome write's to report.
            log_event(logging.DEBUG, "fold attempt not counted", delivery_id=delivery_id,
                      error=type(exc).__name__)
        late = engine.later_already_folded(row)
        started = time.monotonic()
        self.current = delivery_id
        try:
            outcome = engine.fold(delivery_id, row)
        finally:
            self.current = None
        if outcome.deferred and counted:  # a busy database or a machine fault: no attempt
            noted = outcome.error not in ("busy", "storage") and engine.note_fault(
                delivery_id, outcome.error)
            if not noted:  # the database's fault: owed, taken back at the next count
                self._owed[delivery_id] = self._owed.get(delivery_id, 0) + 1
        if outcome.kind in ("folded", "failed"):
            self.fold_seconds.observe(time.monotonic() - started, outcome=outcome.status)
        if late and outcome.kind == "folded":
            waited = (utc_now() - parse_received_at(row["received_at"])).total_seconds()
            log_event(logging.WARNING, "delivery folded after a later one; `healthlog reindex`"
                      " restores journal order", delivery_id=delivery_id,
                      waited_s=round(waited, 1))
        return outcome


def requeue_covered(conn: sqlite3.Connection) -> int:
    """Set back to pending the rows this version would fold differently (fold spec):
    ``partial`` rows whose uncovered keys are now covered, and statuses written by a
    parser that did not tell ``partial`` from ``parsed`` (no parser version)."""
    ids = [row_id for row_id, keys in conn.execute(
        "SELECT id, uncovered_keys FROM delivery WHERE parse_status = 'partial'")
        if any(key in SECTIONS for key in json.loads(keys or "[]"))]
    ids += [row_id for (row_id,) in conn.execute(
        "SELECT id FROM delivery WHERE parse_status = 'parsed' AND parser_version IS NULL")]
    if ids:
        with write_txn(conn):
            conn.executemany("UPDATE delivery SET parse_status = 'pending' WHERE id = ?",
                             [(i,) for i in ids])
        log_event(logging.INFO, "deliveries requeued for a new fold", count=len(ids))
    return len(ids)


def warn_if_journal_lost(conn: sqlite3.Connection, data_dir: Path) -> None:
    """An empty journal beside an archive with bodies: the database was replaced or
    lost; the bodies are safe, and reindex journals them again."""
    if conn.execute("SELECT 1 FROM delivery LIMIT 1").fetchone() is None:
        bodies = len(archive_bodies(data_dir))
        if bodies:
            log_event(logging.WARNING, "the journal is empty but the archive holds deliveries;"
                      " `healthlog reindex` journals and folds them again", archived=bodies)


def count_folded_by_older_parser(conn: sqlite3.Connection) -> int:
    """Deliveries whose objects were written by rules older than this version's."""
    return conn.execute(
        "SELECT count(*) FROM delivery WHERE parse_status IN ('parsed', 'partial')"
        " AND parser_version < ?", (PARSER_VERSION,)).fetchone()[0]


def warn_if_folded_by_older_parser(conn: sqlite3.Connection) -> None:
    older = count_folded_by_older_parser(conn)
    if older:
        log_event(logging.WARNING, "deliveries were folded by an older version with other"
                  " rules; run `healthlog reindex` (with serve stopped) to rebuild the store"
                  " from the archive", count=older, parser_version=PARSER_VERSION)


# ==============================================================================
# Queries: meanings, catalog, points, buckets, nights, records, the view's plan, deliveries.
# ==============================================================================

LAYER_ORDER = ("seconds", "default", "minutes", "hours", "days", "weeks", "months", "years",
               RECORD_LAYER)
"""Finest first: a query without a layer reads the finest layer the metric has."""

BUCKETS = {"hour": 3600, "day": 86400, "week": 7 * 86400}
"""Bucket widths in seconds; buckets are aligned in the query's offset (weeks on Monday)."""

DELIVERIES_LIMIT = (50, 500)
"""Journal rows per page: default and maximum."""


# -- what each metric means: one table, served with the catalog ------------------------

@dataclass(frozen=True)
class SleepStage:
    """A stage of sleep as the page lists and draws it: its name in the replies (a key of a
    night's ``stages``), how a person reads it (``label``), whether its hours are sleep
    (``asleep``: awake is not), and whether it is the sleep no stage was given for
    (``unspecified``: HAE's and HealthKit's plain ``asleep``; a night that names no stage
    is drawn as it)."""

    stage: str
    label: str
    asleep: bool = True
    unspecified: bool = False

    def as_json(self) -> dict:
        return {"stage": self.stage, "label": self.label, "asleep": self.asleep,
                "unspecified": self.unspecified}


SLEEP_STAGES = (SleepStage("deep", "deep"), SleepStage("core", "core"),
                SleepStage("rem", "rem"),
                SleepStage("asleep", "asleep, no stage", unspecified=True),
                SleepStage("awake", "awake", asleep=False))
"""The stages of sleep in the order they are listed and drawn: deepest first, awake last
(on top of a night's bar).  Part of the sleep meaning (:class:`Meaning`'s ``stages``): the
nights (:func:`sleep_buckets`), the summary's sleep card, the day CSV and the page take
their order and labels from here."""


@dataclass(frozen=True)
class Meaning:
    """What a metric is, for everything that shows or exports it (the page, ``export``,
    Grafana): its display name, its group, what its values are (``kind``), which fields
    hold them (the first is the main one) and which way is better (``up``, ``down`` or
    none; for trends).

    Kinds: ``total`` (a bucket sums it: steps, energy, nutrients), ``average`` (a bucket
    averages it: heart rate, weight), ``sleep`` (nights), ``workouts``, ``ecg`` and
    ``events`` (a list: symptoms, medications, state of mind, cycle tracking,
    heart-rate notifications); the page draws the first two as a series of buckets, sleep
    as nights and the others as lists of their records (``drawn``).

    How its numbers are written (:data:`WRITTEN`): ``counts``, what one of its counts is
    called where HAE's units say only ``count`` (``steps``; None: its name says what it
    counts, and a count is shown without a unit); ``digits``, the decimals always shown,
    where a person's changes are smaller than one unit (weight, body fat, temperature).

    What its points hold beyond their value: ``bounds``, the fields of a point that hold
    the lowest and highest of the span it summarises (heart rate's ``Min`` and ``Max``: a
    day of it has a range); ``stages``, the stages of sleep in their order
    (:data:`SLEEP_STAGES`); ``labels``, how a person reads a field whose name is no word
    (sleep's ``in_bed``: "in bed").
    """

    name: str
    group: str
    kind: str
    fields: tuple = ("qty",)
    better: Optional[str] = None
    counts: Optional[str] = None
    digits: Optional[int] = None
    bounds: Optional[tuple] = None
    stages: tuple = ()
    labels: tuple = ()

    @property
    def combine(self) -> Optional[str]:
        """How a bucket combines its fields: ``sum``, ``avg`` (the name of the bucket's
        figure that is its value), or None (not a series)."""
        return {"total": "sum", "average": "avg"}.get(self.kind)

    @property
    def drawn(self) -> str:
        """How the page draws it: ``series`` (buckets: a total's bars, an average's line),
        ``nights`` (sleep) or ``list`` (workouts, ECG recordings, events: its records)."""
        return {"total": "series", "average": "series", "sleep": "nights"}.get(self.kind,
                                                                                "list")

    def label(self, field: str) -> str:
        """How a person reads one of its fields: its label, else its name."""
        return dict(self.labels).get(field, field)

    def as_json(self) -> dict:
        return {"name": self.name, "group": self.group, "kind": self.kind,
                "drawn": self.drawn, "fields": list(self.fields), "combine": self.combine,
                "better": self.better,
                "digits": self.digits, "bounds": None if self.bounds is None
                else list(self.bounds), "stages": [stage.as_json() for stage in self.stages],
                "labels": {field: self.label(field) for field in self.fields}}


def _totals(group: str, *items: tuple) -> dict:
    return {metric: Meaning(name, group, "total", better=better)
            for metric, name, better in items}


def _averages(group: str, *items: tuple) -> dict:
    return {metric: Meaning(name, group, "average", better=better)
            for metric, name, better in items}


MEANINGS = dict(
    _totals("activity",
            ("step_count", "Steps", "up"), ("active_energy", "Active energy", "up"),
            ("basal_energy_burned", "Resting energy", None),
            ("walking_running_distance", "Walking + running distance", "up"),
            ("cycling_distance", "Cycling distance", "up"),
            ("swimming_distance", "Swimming distance", "up"),
            ("wheelchair_distance", "Wheelchair distance", "up"),
            ("downhill_snow_sports", "Downhill snow sports distance", None),
            ("flights_climbed", "Flights climbed", "up"),
            ("apple_exercise_time", "Exercise minutes", "up"),
            ("apple_stand_time", "Stand minutes", "up"),
            ("apple_stand_hour", "Stand hours", "up"),
            ("apple_move_time", "Move minutes", "up"),
            ("time_in_daylight", "Time in daylight", "up"),
            ("swim_stroke_count", "Swimming strokes", None),
            ("wheelchair_push_count", "Wheelchair pushes", None),
            ("number_of_times_fallen", "Falls", "down"),
            ("number_of_alcoholic_beverages", "Alcoholic drinks", "down"),
            ("inhaler_usage", "Inhaler uses", "down")),
    **_totals("mindfulness", ("mindful_minutes", "Mindful minutes", "up")),
    **_averages("activity",
                ("physical_effort", "Physical effort", None),
                ("walking_speed", "Walking speed", "up"),
                ("walking_step_length", "Step length", "up"),
                ("walking_asymmetry_percentage", "Walking asymmetry", "down"),
                ("walking_double_support_percentage", "Double support time", "down"),
                ("stair_speed_up", "Stair speed up", "up"),
                ("stair_speed_down", "Stair speed down", "up"),
                ("six_minute_walking_test_distance", "Six-minute walk", "up"),
                ("running_speed", "Running speed", "up"),
                ("running_power", "Running power", None),
                ("running_stride_length", "Running stride length", None),
                ("running_vertical_oscillation", "Vertical oscillation", None),
                ("running_ground_contact_time", "Ground contact time", None),
                ("cycling_cadence", "Cycling cadence", None),
                ("cycling_power", "Cycling power", None),
                ("cycling_speed", "Cycling speed", None),
                ("cycling_functional_threshold_power", "Functional threshold power", "up")),
    **_averages("heart",
                ("resting_heart_rate", "Resting heart rate", "down"),
                ("walking_heart_rate_average", "Walking heart rate", "down"),
                ("heart_rate_variability", "Heart rate variability", "up"),
                ("cardio_recovery", "Cardio recovery", "up"),
                ("vo2_max", "VO2 max", "up"),
                ("blood_oxygen_saturation", "Blood oxygen", None),
                ("atrial_fibrillation_burden", "AFib history", "down"),
                ("peripheral_perfusion_index", "Perfusion index", None)),
    **_averages("body",
                ("weight_body_mass", "Weight", None), ("body_mass_index", "Body mass index",
                                                       None),
                ("body_fat_percentage", "Body fat", "down"),
                ("lean_body_mass", "Lean body mass", None), ("height", "Height", None),
                ("waist_circumference", "Waist circumference", "down"),
                ("body_temperature", "Body temperature", None),
                ("basal_body_temperature", "Basal body temperature", None),
                ("apple_sleeping_wrist_temperature", "Wrist temperature while asleep", None),
                ("blood_glucose", "Blood glucose", None),
                ("blood_alcohol_content", "Blood alcohol", "down"),
                ("insulin_delivery", "Insulin", None),
                ("electrodermal_activity", "Electrodermal activity", None),
                ("forced_vital_capacity", "Forced vital capacity", "up"),
                ("forced_expiratory_volume_1", "FEV1", "up"),
                ("peak_expiratory_flow_rate", "Peak expiratory flow", "up"),
                ("uv_exposure", "UV exposure", None),
                ("environmental_audio_exposure", "Environmental sound level", "down"),
                ("headphone_audio_exposure", "Headphone sound level", "down"),
                ("under_water_depth", "Underwater depth", None),
                ("under_water_temperature", "Water temperature", None)),
    **_averages("sleep",
                ("respiratory_rate", "Respiratory rate", None),
                ("breathing_disturbances", "Breathing disturbances", "down")),
    heart_rate=Meaning("Heart rate", "heart", "average", ("Avg", "Min", "Max"),
                       bounds=("Min", "Max")),
    blood_pressure=Meaning("Blood pressure", "body", "average", ("systolic", "diastolic"),
                           "down"),
    sleep_analysis=Meaning("Sleep", "sleep", "sleep", ("asleep", "in_bed"), "up",
                           stages=SLEEP_STAGES, labels=(("in_bed", "in bed"),)),
    workouts=Meaning("Workouts", "workouts", "workouts", ("duration", "energy", "distance")),
    ecg=Meaning("ECG", "heart", "ecg", ("classification", "averageHeartRate")),
    heart_rate_notifications=Meaning("Heart rate notifications", "heart", "events",
                                     ("heartNotification", "threshold")),
    state_of_mind=Meaning("State of mind", "mindfulness", "events",
                          ("valenceClassification", "kind", "labels", "associations")),
    sexual_activity=Meaning("Sexual activity", "other", "total",
                            ("Unspecified", "Protection Used", "Protection Not Used")),
    handwashing=Meaning("Handwashing", "other", "total", ("qty",), "up"),
    toothbrushing=Meaning("Toothbrushing", "other", "total", ("qty",), "up"),
)
"""The meaning of every metric HAE names (its ``Supported Data`` list); any other metric is
an ``average`` in ``other`` (:func:`meaning_of`)."""

NUTRIENTS = (
    ("dietary_energy", "Energy consumed"), ("carbohydrates", "Carbohydrates"),
    ("protein", "Protein"), ("total_fat", "Total fat"), ("saturated_fat", "Saturated fat"),
    ("monounsaturated_fat", "Monounsaturated fat"),
    ("polyunsaturated_fat", "Polyunsaturated fat"), ("cholesterol", "Cholesterol"),
    ("fiber", "Fiber"), ("dietary_sugar", "Sugar"), ("dietary_water", "Water"),
    ("caffeine", "Caffeine"), ("dietary_caffeine", "Caffeine"), ("sodium", "Sodium"),
    ("potassium", "Potassium"), ("calcium", "Calcium"), ("iron", "Iron"),
    ("magnesium", "Magnesium"), ("zinc", "Zinc"), ("biotin", "Biotin"),
    ("chloride", "Chloride"), ("chromium", "Chromium"), ("copper", "Copper"),
    ("folate", "Folate"), ("iodine", "Iodine"), ("manganese", "Manganese"),
    ("molybdenum", "Molybdenum"), ("niacin", "Niacin"),
    ("pantothenic_acid", "Pantothenic acid"), ("riboflavin", "Riboflavin"),
    ("selenium", "Selenium"), ("thiamin", "Thiamin"), ("vitamin_a", "Vitamin A"),
    ("vitamin_b6", "Vitamin B6"), ("vitamin_b12", "Vitamin B12"), ("vitamin_c", "Vitamin C"),
    ("vitamin_d", "Vitamin D"), ("vitamin_e", "Vitamin E"), ("vitamin_k", "Vitamin K"),
    ("dietary_cholesterol", "Cholesterol"))
MEANINGS.update((metric, Meaning(name, "nutrition", "total")) for metric, name in NUTRIENTS)

WRITTEN = {
    # a count of it is called …
    "step_count": ("steps", None), "flights_climbed": ("floors", None),
    "respiratory_rate": ("breaths", None), "cycling_cadence": ("rev", None),
    "handwashing": ("times", None), "toothbrushing": ("times", None),
    "sexual_activity": ("times", None),
    # at least this many decimals: a person's changes are smaller than one unit
    "weight_body_mass": (None, 1), "lean_body_mass": (None, 1), "body_mass_index": (None, 1),
    "body_fat_percentage": (None, 1), "waist_circumference": (None, 1),
    "body_temperature": (None, 1), "basal_body_temperature": (None, 2),
    "apple_sleeping_wrist_temperature": (None, 2), "under_water_temperature": (None, 1),
    "vo2_max": (None, 1),
}
"""How the numbers of a metric are written, part of its meaning (:class:`Meaning`'s
``counts`` and ``digits``).  Every other ``count`` is shown without a unit: the metric's
name says what it counts (stand hours, body mass index, falls, swimming strokes, UV
index, …)."""
MEANINGS.update((metric, _replace(MEANINGS[metric], counts=counts, digits=digits))
                for metric, (counts, digits) in WRITTEN.items())

UNIT_LABELS = {
    "count/min": "bpm", "fl_oz_us": "fl oz", "fl_oz_imp": "imp fl oz", "cup_us": "cups",
    "degC": "°C", "degF": "°F", "mcV": "µV", "mcg": "µg", "mcS": "µS", "dBASPL": "dB",
    "hr": "h", "km/hr": "km/h", "mi/hr": "mph", "kcal/hr·kg": "MET",
}
"""HealthKit's unit names as a person reads them; any other (kcal, kJ, lb, kg, mi, km, ms,
mmHg, %, mg/dL, …) is shown as HAE sends it."""

_UNIT_FACTOR = re.compile(r"<[^<>]*>")
"""HealthKit's conversion factor inside a unit name: ``mmol<180.1558800000541>/L``."""


def unit_label(metric: str, units: Optional[str]) -> Optional[str]:
    """How the units of a metric are shown, everywhere the page shows them (cards, the
    metric view's axis and readout, lists): ``count/min`` is ``bpm``, a ``count`` is what
    the meaning says a count of it is called (``steps``), else nothing (``""``: the name
    says what it counts), ``fl_oz_us`` is ``fl oz``, ``degC`` ``°C`` (:data:`UNIT_LABELS`);
    None without units."""
    if not isinstance(units, str):
        return None
    counts = meaning_of(metric).counts
    if units == "count":
        return counts or ""
    if units == "count/min" and counts:
        return counts + "/min"
    if units in UNIT_LABELS:
        return UNIT_LABELS[units]
    return _UNIT_FACTOR.sub("", units).strip()

_EVENT_SECTIONS = (("symptoms/", "Symptom", ("severity",)),
                   ("medications/", "Medication", ("status", "dosage")),
                   ("cycle_tracking/", "Cycle tracking", ("value",)))


def meaning_of(metric: str) -> Meaning:
    """The meaning of a metric: the table's, a nutrient's for any ``dietary_…``, a list of
    events for symptoms, medications and cycle tracking, else a plain ``average``."""
    found = MEANINGS.get(metric)
    if found is not None:
        return found
    for prefix, label, fields in _EVENT_SECTIONS:
        if metric.startswith(prefix):
            group = "body" if prefix == "cycle_tracking/" else "other"
            return Meaning("%s: %s" % (label, metric[len(prefix):]), group, "events", fields)
    if metric.startswith("dietary_"):
        return Meaning(metric[len("dietary_"):].replace("_", " ").capitalize(), "nutrition",
                       "total")
    return Meaning(metric.replace("_", " ").capitalize(), "other", "average")


GROUPS = (("activity", "Activity"), ("body", "Body"), ("heart", "Heart"),
          ("mindfulness", "Mindfulness"), ("nutrition", "Nutrition"), ("sleep", "Sleep"),
          ("workouts", "Workouts"), ("other", "Other"))
"""The meaning table's groups, in the order the metric view lists them, with their titles
(everything the table does not place is in ``other``, last).  Served with the catalog
(:func:`groups_json`)."""


def groups_json() -> list:
    """The groups as ``/api/catalog`` and ``healthlog catalog --json`` carry them."""
    return [{"group": group, "title": title} for group, title in GROUPS]


@dataclass(frozen=True)
class SummaryCard:
    """A group of the summary page's cards: a group of the meaning table, the title it is
    shown under, how its cards are made and drawn (``render``, one of
    :data:`CARD_RENDERS`) and the metrics it shows, in their order."""

    group: str
    title: str
    render: str
    metrics: tuple = ()

    def as_json(self) -> dict:
        return {"group": self.group, "title": self.title, "render": self.render,
                "metrics": list(self.metrics)}


CARD_RENDERS = ("series", "latest", "night", "week", "list")
"""How a group's cards are made: ``series``, a card per metric with the day's value
against the usual and a sparkline (``render: series``), or, for a metric whose meaning has
``bounds``, the day's lowest, average and highest (``render: range``); ``latest``, a card
per metric with its latest measurement on or before the day; ``night``, the one card of
the night that ended on the day; ``week``, the one card of the 7 days' records (its items
the group's list); ``list``, everything else recorded on the day."""

SUMMARY_CARDS = (
    SummaryCard("activity", "Activity", "series",
                ("step_count", "active_energy", "apple_exercise_time", "apple_stand_hour",
                 "walking_running_distance")),
    SummaryCard("sleep", "Last night", "night", (SLEEP_METRIC,)),
    SummaryCard("heart", "Heart", "series",
                ("resting_heart_rate", "heart_rate_variability", "walking_heart_rate_average",
                 "heart_rate")),
    SummaryCard("body", "Body", "latest",
                ("weight_body_mass", "body_fat_percentage", "blood_pressure")),
    SummaryCard("workouts", "Workouts", "week", ("workouts",)),
    SummaryCard("other", "Also recorded", "list"),
)
"""The summary page's cards (:func:`summary`), in the order they are shown: each group is
a group of the meaning table and shows metrics of its own group; ``other`` lists what
else was recorded on the day, whatever its group.  Served with each summary as its
``card_order``: the page draws the groups the server names, in this order, under these
titles."""


def stored_metrics(conn: sqlite3.Connection) -> list:
    """The metrics the store holds, in order, each found by one seek of the primary key
    (a skip scan): never a scan of the hours, whatever the length of the history."""
    return [row[0] for row in conn.execute(
        "WITH RECURSIVE found(metric) AS (SELECT min(metric) FROM object UNION ALL SELECT"
        " (SELECT min(metric) FROM object WHERE metric > found.metric) FROM found WHERE"
        " metric IS NOT NULL) SELECT metric FROM found WHERE metric IS NOT NULL")]


def metric_layers(conn: sqlite3.Connection, metric: str) -> list:
    """The layers of a metric, in order, each found by one seek (as :func:`stored_metrics`)."""
    return [row[0] for row in conn.execute(
        "WITH RECURSIVE found(layer) AS (SELECT min(layer) FROM object WHERE metric = ?1"
        " UNION ALL SELECT (SELECT min(layer) FROM object WHERE metric = ?1 AND layer >"
        " found.layer) FROM found WHERE layer IS NOT NULL) SELECT layer FROM found WHERE"
        " layer IS NOT NULL", (metric,))]


def layer_hours(conn: sqlite3.Connection, metric: str, low: int = -(1 << 62),
                high: int = 1 << 62) -> dict:
    """Layer -> (first hour, last hour) of a metric's objects in the hours ``low``..``high``
    (layers without one left out): two seeks a layer."""
    found = {}
    for layer in metric_layers(conn, metric):
        first, last = conn.execute(
            "SELECT (SELECT min(hour) FROM object WHERE metric = ?1 AND layer = ?2 AND hour"
            " BETWEEN ?3 AND ?4), (SELECT max(hour) FROM object WHERE metric = ?1 AND layer"
            " = ?2 AND hour BETWEEN ?3 AND ?4)", (metric, layer, low, high)).fetchone()
        if first is not None:
            found[layer] = (first, last)
    return found


def catalog(conn: sqlite3.Connection) -> list:
    """Per (metric, layer): units, first and last point start, objects, points.  Reads the
    objects' bounds only; never decompresses a blob."""
    units: dict = {}
    for metric, layer, unit in conn.execute(
            "SELECT DISTINCT metric, layer, units FROM object WHERE units IS NOT NULL"):
        units.setdefault((metric, layer), []).append(unit)
    return [{"metric": metric, "layer": layer, "group": meaning_of(metric).group,
             "meaning": meaning_of(metric).as_json(),
             "units": sorted(units.get((metric, layer), [])),
             "first": format_instant(first * US), "last": format_instant(last * US),
             "objects": objects, "points": points}
            for metric, layer, first, last, objects, points in conn.execute(
                "SELECT metric, layer, min(first_at), max(last_at), count(*), sum(points)"
                " FROM object GROUP BY metric, layer ORDER BY metric, layer")]


def catalog_local(conn: sqlite3.Connection, item: dict) -> tuple:
    """(first, last) of a catalog entry as local ISO-8601 text with its offset, as the phone
    wrote them: each the start of the first and of the last point, in the offset its own
    timestamp was written in (``tz=local``, :meth:`Zone.point_offset`, as ``/api/points``
    and ``/api/records`` place a point).  Reads the object of each of the two only."""
    bounds = []
    for text, last in ((item["first"], False), (item["last"], True)):
        second = parse_time(text) // US * US
        query = PointQuery(item["metric"], item["layer"], second, second + US)
        found = None
        for _, coord, point in iter_points(conn, query):
            found = (coord[0], LOCAL_ZONE.point_offset(raw_start(point), coord[0]))
            if not last:
                break
        bounds.append(None if found is None else local_iso(*found))
    return tuple(bounds)


@dataclass(frozen=True)
class PointQuery:
    """What ``/api/points`` and ``healthlog export`` were asked, checked."""

    metric: str
    layer: str
    start: Optional[int] = None  # UTC µs, inclusive
    end: Optional[int] = None  # UTC µs, exclusive (a date-only ``to``: the next midnight)
    bucket: Optional[str] = None
    zone: Zone = LOCAL_ZONE
    fmt: str = "json"
    day_from: Optional[int] = None  # local date ordinals (tz=local, a date-only bound):
    day_to: Optional[int] = None  # the dates written in the points, from inclusive, to not
    # (a date-only ``to`` includes its day: ``day_to`` is the day after it)
    fill: tuple = ()  # day and week buckets without a layer asked, or of the layers asked
    # (``layer=days,minutes``): each day from the first of these layers that holds it (the
    # layer chosen, then DAY_LAYERS' order)
    coarsened: bool = False  # hours were asked of a layer of days: answered per day

    @property
    def sleep_stages(self) -> bool:
        return self.metric == SLEEP_METRIC and self.layer == RECORD_LAYER


_LOST_PLUS = re.compile(r"(?<=[0-9]) ( ?)([0-9]{2}:?[0-9]{2})$")
"""An offset whose ``+`` a query string turned into a space (``tz=+02:00`` or
``…T10:00:00+01:00`` typed into curl unencoded): the plus is put back."""


def _query_time(name: str, text: Optional[str]) -> Optional[int]:
    if text is None or text == "":
        return None
    if parse_time(text) is None:
        text = _LOST_PLUS.sub(r"\1+\2", text)
    value: Any = text
    if re.fullmatch(r"-?[0-9]{1,20}(\.[0-9]{1,20})?", text.strip()):
        value = float(text) if "." in text else int(text)
    instant = parse_time(value)
    if instant is None:
        raise BadRequest("%s is not a time healthlog can read: a time (ISO-8601, epoch seconds"
                         " or milliseconds) from 1900 to 2199, or a day YYYY-MM-DD %s"
                         % (name, READ_DAYS))
    return instant


_ZONE_NAME = re.compile(r"[A-Za-z][A-Za-z0-9_+-]{0,30}(/[A-Za-z0-9_+-]{1,30}){0,2}")


def parse_zone(text: Optional[str]) -> Zone:
    """``tz``: ``local`` (the default), an IANA zone name, or an offset such as ``+02:00``."""
    if text is None or text.strip() in ("", "local"):
        return LOCAL_ZONE
    if text.startswith(" "):
        text = "+" + text[1:]  # tz=+02:00 unencoded: the query string made it a space
    text = text.strip()
    match = re.fullmatch(r"([+-])([0-9]{2}):?([0-9]{2})", text)
    if match:
        offset = _offset_seconds(*match.groups())
        if offset is None:
            raise BadRequest("tz must be local, a time zone such as Europe/Berlin, or an"
                             " offset such as +02:00")
        return FixedZone(offset)
    if not _ZONE_NAME.fullmatch(text):
        raise BadRequest("tz must be local, a time zone such as Europe/Berlin, or an offset"
                         " such as +02:00")
    try:
        return NamedZone(text, zoneinfo.ZoneInfo(text))
    except (zoneinfo.ZoneInfoNotFoundError, ValueError, OSError):
        raise BadRequest("tz: this machine has no time zone called %s (without a system"
                         " time-zone database, install the tzdata package; tz=local or an"
                         " offset such as +02:00 always works)" % text) from None


_DATE_ONLY_QUERY = re.compile(r"\s*([0-9]{4})-([0-9]{2})-([0-9]{2})\s*")
READ_FIRST_DAY = _dt.date(1900, 1, 1).toordinal()
READ_LAST_DAY = _dt.date(9998, 12, 31).toordinal()
READ_DAYS = "from 1900-01-01 to 9998-12-31"
"""The days a read accepts, on every route and command (READ-2.9): a day's midnight in
any zone (±14 h), the day after a date-only ``to``, a week's Monday and the trends a
summary looks back over stay inside the calendar ``datetime`` can write (years 1 to
9999), so no read meets an overflow after its answer has begun; no health record is older
than 1900.  Checked once, where a query's dates are parsed (:func:`read_day`)."""


def read_day(name: str, text: Optional[str]) -> Optional[int]:
    """The proleptic ordinal of a date-only parameter (``YYYY-MM-DD``); None when absent or
    empty; a :class:`BadRequest` naming :data:`READ_DAYS` when it is not such a day or
    lies outside them."""
    if text is None or text == "":
        return None
    match = _DATE_ONLY_QUERY.fullmatch(text)
    try:
        day = _dt.date(*map(int, match.groups())).toordinal() if match else None
    except ValueError:
        day = None
    if day is None or not READ_FIRST_DAY <= day <= READ_LAST_DAY:
        raise BadRequest("%s must be a day YYYY-MM-DD %s" % (name, READ_DAYS))
    return day


def read_day_text(ordinal: int) -> str:
    """A day of a range the server builds itself (a card's link, a week's records, a
    view's bounds) as text :func:`read_day` takes: held inside :data:`READ_DAYS`, which
    loses nothing, since no stored instant is older than 1900 (:func:`parse_time`)."""
    return _dt.date.fromordinal(min(max(ordinal, READ_FIRST_DAY), READ_LAST_DAY)).isoformat()


def _query_bound(name: str, text: Optional[str], zone: Zone, is_end: bool) -> tuple:
    """(instant, local date ordinal) of ``from``/``to``.  A date alone is a whole local day
    in ``zone``: ``from`` starts at its midnight, ``to`` includes it (the range ends at the
    next midnight), as the page's "To" field and ``export --to`` mean it; with
    ``tz=local`` it is that date as written in each point, and the instant only narrows
    the objects read (:data:`MAX_OFFSET_S` around UTC midnight).  An instant ``to`` is
    exclusive."""
    if not _DATE_ONLY_QUERY.fullmatch(text or ""):
        return _query_time(name, text), None
    ordinal = read_day(name, text)
    if is_end:
        ordinal += 1  # the day after: ``to`` includes its own day
    if zone is LOCAL_ZONE:
        midnight = (ordinal - _EPOCH_ORDINAL) * 86400
        return (midnight + (MAX_OFFSET_S if is_end else -MAX_OFFSET_S)) * US, ordinal
    return zone.midnight(ordinal, 0), None


def point_query(conn: sqlite3.Connection, args: Mapping[str, Optional[str]]) -> PointQuery:
    """Check a query's parameters against the store: 400 for bad values, 404 for a
    metric or layer without data."""
    metric = args.get("metric")
    if not metric:
        raise BadRequest("metric is required; see /api/catalog")
    zone = parse_zone(args.get("tz"))
    start, day_from = _query_bound("from", args.get("from"), zone, is_end=False)
    end, day_to = _query_bound("to", args.get("to"), zone, is_end=True)
    if (start is not None and end is not None and start >= end) or (
            day_from is not None and day_to is not None and day_from >= day_to):
        raise BadRequest("from must be before to")
    bucket = args.get("bucket") or None
    if bucket is not None and bucket not in BUCKETS:
        raise BadRequest("bucket must be one of " + ", ".join(BUCKETS))
    fmt = args.get("format") or "json"
    if fmt not in ("json", "csv"):
        raise BadRequest("format must be json or csv")
    if bucket is not None and metric == SLEEP_METRIC and bucket == "hour":
        raise BadRequest("sleep is counted per night: bucket must be day or week")
    layers = metric_layers(conn, metric)
    if not layers:
        raise UnknownMetric([loggable_metric(name) for name in stored_metrics(conn)])
    asked = tuple(args["layer"].split(",")) if args.get("layer") else ()
    fill: tuple = ()
    if len(asked) > 1:  # read as named (the view's plan names them): no second decision
        if bucket not in ("day", "week"):
            raise BadRequest("several layers are read per day or week (each day from the"
                             " first that holds it): bucket must be day or week")
        if len(set(asked)) < len(asked) or not set(asked) <= set(DAY_LAYERS):
            raise BadRequest("the layers that fill each other's days are %s, each named once"
                             % ", ".join(DAY_LAYERS))
        fill = asked
    layer = asked[0] if asked else _finest_layer(conn, metric, layers, start, end)
    coarsened = bucket == "hour" and layer in DAY_ONLY_LAYERS
    if coarsened:
        bucket = "day"  # never finer than the data arrived (READ-17): the reply says so
    if not asked and bucket in ("day", "week"):
        fill = _filling(layer, layers)
    for name in asked or (layer,):
        if name not in layers:
            raise UnknownLayer("%s has no data in that layer; it has %s"
                               % (loggable_metric(metric), ", ".join(sorted(layers))))
    return PointQuery(metric, layer, start, end, bucket, zone, fmt, day_from, day_to, fill,
                      coarsened)


def _filling(layer: str, layers: Sequence[str]) -> tuple:
    """The layers a day or week bucket of ``layer`` reads when none was asked: ``layer``,
    then the other layers of :data:`DAY_LAYERS` the metric has, which fill the days it
    lacks, in that order; () when there are none, or ``layer`` is not one of them."""
    if layer not in DAY_LAYERS:
        return ()
    others = tuple(other for other in DAY_LAYERS if other in layers and other != layer)
    return (layer,) + others if others else ()


DAY_LAYERS = ("days", "hours", "minutes", "default", "seconds")
"""Layers a day's value can come from, preferred first: a Days export's point is the
phone's own total for the day (HealthKit's statistics of the whole day); finer layers add
up to it where there is none.  The summary reads each day from the first of them that
holds it; day and week buckets without a layer asked read the layer chosen for the range
and fill the days it lacks from the others, in this order (a Days automation stopped, a
Minutes one started later: no day goes missing)."""


def _finest_layer(conn: sqlite3.Connection, metric: str, layers: list,
                  start: Optional[int], end: Optional[int]) -> str:
    """The layer that answers a range best: of the layers with points in it, the finest
    whose points reach back to its start, else the one reaching furthest back (finer on a
    tie); without a start, the finest.  A store fed by a Minutes automation for the last
    days and a Days one for years answers a year from the days and the last day from the
    minutes."""
    def order(name: str) -> tuple:
        return (LAYER_ORDER.index(name) if name in LAYER_ORDER else len(LAYER_ORDER), name)

    low = -(1 << 62) if start is None else start // HOUR_US
    high = (1 << 62) if end is None else (end - 1) // HOUR_US
    reach = {layer: first for layer, (first, _) in layer_hours(conn, metric, low,
                                                                high).items()}
    if not reach:
        return min(layers, key=order)
    if start is None:
        return min(reach, key=order)
    earliest = min(reach.values())
    covering = [layer for layer, first in reach.items() if first <= max(low, earliest)]
    return min(covering, key=order)


WRITTEN_OFFSET_MAX_S = 86400 - 1
"""More than any offset written in a timestamp can say (``±23:59``, the most a time's text
can spell, beyond any zone's ``±14:00``): an object whose starts lie further than this
inside local date bounds has every point's written date inside them, whatever the offsets
of its points."""

NONE, SOME, ALL = 0, 1, 2
"""How much of an object lies in a query's range (:func:`_object_part`): none of its points
(nothing to read), some (its points are read one by one), or all of them (a whole object:
its tally or its stored text stand for its points)."""


class DecodeCount:
    """What the read side has done with stored objects since the module was loaded:
    ``objects`` decompressed (and so decoded), and of those ``checked``, read point by point
    (each point's time read or its bucket found, not its object's tally or stored text and
    spans taken whole).  The one measure of whether a read took its fast path: a whole hour
    counted from its tally, or an object outside the range, costs neither.  Tests read it
    around a request; a lock keeps concurrent reads from losing a count."""

    def __init__(self) -> None:
        self.objects = 0
        self.checked = 0
        self._lock = threading.Lock()

    def add(self) -> None:
        with self._lock:
            self.objects += 1

    def check(self) -> None:
        with self._lock:
            self.checked += 1


READ_DECODES = DecodeCount()


def _read_blob(blob: bytes) -> bytes:
    """An object's points as stored (JSON bytes), decompressed for a read and counted."""
    READ_DECODES.add()
    return decompress_blob(blob)


def _tally_of(text: str) -> dict:
    """An object's stored tally (:func:`hour_tally`), parsed: by orjson when the host has
    it (a year of hours is 8,760 of them), else, or for a text orjson refuses, by json."""
    if _orjson is not None:
        try:
            return _orjson.loads(text)
        except ValueError:
            pass
    return json.loads(text)


def _local_second_bounds(query: PointQuery, first_at: int, last_at: int,
                         tally_text: Optional[str]) -> tuple:
    """(lowest, highest) local second (UTC second plus the offset the query places a point
    in) that a point of an object can have, both included: ``tz=local``, from the offsets
    its tally names when it names them, else from :data:`WRITTEN_OFFSET_MAX_S` (which holds
    for any offset); a zone or an offset, from its offsets at the first and last start."""
    if query.zone is not LOCAL_ZONE:
        offsets = (query.zone.offset_at(first_at * US), query.zone.offset_at(last_at * US))
        return first_at + min(offsets), last_at + max(offsets)
    if tally_text:
        offsets = _tally_of(tally_text).get("o")
        if offsets:
            return first_at + min(offsets), last_at + max(offsets)
    return first_at - WRITTEN_OFFSET_MAX_S, last_at + WRITTEN_OFFSET_MAX_S


def _object_part(query: PointQuery, first_at: int, last_at: int,
                 tally_text: Optional[str]) -> int:
    """:data:`NONE`, :data:`SOME` or :data:`ALL`: how much of an object lies in the query's
    range, from its first and last start (whole seconds, as stored) and, where date bounds
    leave it open within a day of their edges, the offsets its points are placed in (the
    offsets its tally names, ``tz=local``; the zone's).  Exact where it answers ALL or NONE:
    a point's start is in the range when its instant is in ``[start, end)`` and (date
    bounds) its local date is in ``[day_from, day_to)``; every object more than a day
    inside date bounds is ALL, so only the objects at a range's edges are read point by
    point."""
    if ((query.start is not None and (last_at + 1) * US <= query.start)
            or (query.end is not None and first_at * US >= query.end)):
        return NONE
    inside = ((query.start is None or first_at * US >= query.start)
              and (query.end is None or (last_at + 1) * US <= query.end))
    if query.day_from is None and query.day_to is None:
        return ALL if inside else SOME
    low_day = None if query.day_from is None else (query.day_from - _EPOCH_ORDINAL) * 86400
    high_day = None if query.day_to is None else (query.day_to - _EPOCH_ORDINAL) * 86400
    part = _dates_part(low_day, high_day, first_at - WRITTEN_OFFSET_MAX_S,
                       last_at + WRITTEN_OFFSET_MAX_S)
    if part == SOME:  # an edge: the offsets its points are placed in
        part = _dates_part(low_day, high_day,
                           *_local_second_bounds(query, first_at, last_at, tally_text))
    if part == NONE:
        return NONE
    return ALL if inside and part == ALL else SOME


def _dates_part(low_day: Optional[int], high_day: Optional[int], lowest: int,
                highest: int) -> int:
    """How much of the local seconds ``lowest``..``highest`` lies in ``[low_day,
    high_day)`` (local seconds of the bounds' midnights; None: open)."""
    if (low_day is not None and highest < low_day) or (high_day is not None
                                                        and lowest >= high_day):
        return NONE
    if (low_day is None or lowest >= low_day) and (high_day is None or highest < high_day):
        return ALL
    return SOME


def _in_range_rows(conn: sqlite3.Connection, query: PointQuery, column: str) -> Iterator[tuple]:
    """(hour, units, part, ``column``) of each object that may hold points of the range,
    in time order (``column`` may name several, given as a tuple); ``part``: how much of it
    lies in the range (:func:`_object_part`: :data:`NONE`, :data:`SOME`, :data:`ALL`).
    With local date bounds the tally is read too, for the objects at the range's edges."""
    low = -(1 << 62) if query.start is None else query.start // HOUR_US
    high = (1 << 62) if query.end is None else (query.end - 1) // HOUR_US
    dated = query.day_from is not None or query.day_to is not None
    columns = [name.strip() for name in column.split(",")]
    tally_at = (columns.index("summary") if "summary" in columns
                else len(columns) if dated else None)
    if tally_at == len(columns):
        columns.append("summary")
    for row in conn.execute(
            "SELECT hour, units, first_at, last_at, %s FROM object WHERE metric = ?"
            " AND layer = ? AND hour BETWEEN ? AND ? ORDER BY hour" % ", ".join(columns),
            (query.metric, query.layer, low, high)):
        hour, units, first_at, last_at = row[:4]
        part = _object_part(query, first_at, last_at,
                            None if tally_at is None or not dated else row[4 + tally_at])
        value = row[4] if "," not in column else row[4:4 + column.count(",") + 1]
        yield hour, units, part, value


def _objects(conn: sqlite3.Connection, query: PointQuery) -> Iterator[tuple]:
    """(units, raw points array bytes, whole) of each object of the range that holds
    points of it."""
    for _, units, part, blob in _in_range_rows(conn, query, "blob"):
        if part != NONE:
            yield units, _read_blob(blob), part == ALL


def iter_points(conn: sqlite3.Connection, query: PointQuery) -> Iterator[tuple]:
    """(units, coordinate, point) of every point in the range, in time order.  The spans
    the fold stored beside each object give the coordinates without reading a timestamp
    again (objects written before them are read as they are)."""
    for units, start, end, point in _spans_in_range(conn, query):
        yield units, (start, end, _category(point)), point


def _spans_in_range(conn: sqlite3.Connection, query: PointQuery) -> Iterator[tuple]:
    """(units, start, end, point) of every point in the range, in time order:
    :func:`iter_points` without the category (raw CSV has no use for it)."""
    for _, units, part, (blob, spans) in _in_range_rows(conn, query, "blob, spans"):
        if part == NONE:
            continue
        points = loads_body(_read_blob(blob))
        known = _known_spans(spans, points)
        if part == ALL and known is not None:
            for start, end, point in zip(known[0], known[1], points):
                yield units, start, end, point
        else:
            for start, end, point in _points_checked(query, points, known):
                yield units, start, end, point


def _known_spans(spans: Optional[bytes], points: list) -> Optional[tuple]:
    """(starts, ends) of an object's points from the spans stored beside it, or None where
    they are not (an object written before them, or a point without a time)."""
    known = decode_spans(spans, len(points))
    return None if known is None or -1 in known[0] else known


def _points_checked(query: PointQuery, points: list, known: Optional[tuple]) -> Iterator[tuple]:
    """(start, end, point) of the points of an object, read point by point, that lie in the
    range (``known``: their spans, else their times are read)."""
    READ_DECODES.check()
    if known is None:
        for point in points:
            coord = point_coordinate(point) if type(point) is dict else None
            if _coord_in_range(coord, query, point):
                yield coord[0], coord[1], point
        return
    for start, end, point in zip(known[0], known[1], points):
        if _coord_in_range((start,), query, point):
            yield start, end, point


def _coord_in_range(coord: Optional[tuple], query: PointQuery, point: Any = None) -> bool:
    """Is the point's start in the query's ``[from, to)``: its instant, and with local
    date bounds the date written in it?"""
    if coord is None or (query.start is not None and coord[0] < query.start) or (
            query.end is not None and coord[0] >= query.end):
        return False
    if query.day_from is None and query.day_to is None:
        return True
    day = local_ordinal(coord[0], query.zone.point_offset(raw_start(point), coord[0]))
    return ((query.day_from is None or day >= query.day_from)
            and (query.day_to is None or day < query.day_to))


def _instant_or_null(instant: Optional[int]) -> Any:
    return None if instant is None else format_instant(instant)


def _head(query: PointQuery) -> dict:
    head = {"metric": query.metric, "layer": query.layer, "tz": query.zone.name}
    if query.fill:
        head["layers"] = list(query.fill)
    if query.bucket:
        head["bucket"] = query.bucket
        if query.coarsened:
            head["note"] = ("hours were asked, but the %s layer holds one value a day or"
                            " less: answered per day" % query.layer)
    head["from"] = (_dt.date.fromordinal(query.day_from).isoformat()
                    if query.day_from is not None else _instant_or_null(query.start))
    head["to"] = (_dt.date.fromordinal(query.day_to - 1).isoformat()  # the last day, as asked
                  if query.day_to is not None else _instant_or_null(query.end))
    return head


def _chunked(pieces: Iterator[bytes]) -> Iterator[bytes]:
    """Join small pieces into chunks of about :data:`STREAM_CHUNK` bytes."""
    buffer, size = [], 0
    for piece in pieces:
        buffer.append(piece)
        size += len(piece)
        if size >= STREAM_CHUNK:
            yield b"".join(buffer)
            buffer, size = [], 0
    if buffer:
        yield b"".join(buffer)


def render_points(conn: sqlite3.Connection, query: PointQuery) -> Iterator[bytes]:
    """The reply to a point query, streamed: JSON or CSV, raw or bucketed."""
    if query.bucket and query.sleep_stages:
        nights = sleep_nights(conn, query)
        pieces = _sleep_csv(nights, query) if query.fmt == "csv" else _sleep_json(nights, query)
    elif query.bucket:
        runs = bucket_runs(conn, query)
        pieces = _bucket_csv(runs, query) if query.fmt == "csv" else _bucket_json(runs, query)
    elif query.fmt == "csv":
        pieces = (_ecg_csv(conn, query) if meaning_of(query.metric).kind == "ecg"
                  else _raw_csv(conn, query))
    else:
        pieces = _raw_json(conn, query)
    return _chunked(pieces)


def _raw_json(conn: sqlite3.Connection, query: PointQuery) -> Iterator[bytes]:
    head = _json_bytes(_head(query))
    yield head[:-1] + b',"runs":['
    units_now, first_run, first_point = object(), True, True
    for units, raw, whole in _objects(conn, query):
        if whole:
            inner = raw.strip()[1:-1].strip()  # the stored points, verbatim
            if not inner:
                continue
            pieces = [inner]
        else:
            READ_DECODES.check()
            pieces = [dumps_points([point])[1:-1] for point in json.loads(raw)
                      if _in_range(point, query)]
            if not pieces:
                continue
        if units != units_now:
            if not first_run:
                yield b"]}"
            yield (b"" if first_run else b",") + b'{"units":' + _json_bytes(units) + b',"points":['
            units_now, first_run, first_point = units, False, True
        for piece in pieces:
            yield piece if first_point else b"," + piece
            first_point = False
    yield b"]}]}" if not first_run else b"]}"


def _in_range(point: Any, query: PointQuery) -> bool:
    return _coord_in_range(point_coordinate(point) if type(point) is dict else None, query,
                           point)


_FORMULA_STARTS = "=+-@|\u2212"
"""What a spreadsheet may read as the start of a formula (OWASP, CSV injection), with the
pipe of DDE and the minus sign; each in any of its compatibility forms (NFKC: the
full-width ``＝``, the small ``﹦``, the superscript ``⁼`` …), which some spreadsheets take
for the character itself."""
_INVISIBLE = ((0x00AD, 0x00AD), (0x034F, 0x034F), (0x061C, 0x061C), (0x115F, 0x1160),
              (0x17B4, 0x17B5), (0x180B, 0x180F), (0x200B, 0x200F), (0x202A, 0x202E),
              (0x2060, 0x206F), (0x3164, 0x3164), (0xFE00, 0xFE0F), (0xFEFF, 0xFEFF),
              (0xFFA0, 0xFFA0), (0xFFF0, 0xFFF8), (0x1BCA0, 0x1BCA3), (0x1D173, 0x1D17A),
              (0xE0000, 0xE0FFF))
"""Unicode's default-ignorable code points (zero-width spaces and joiners, the byte order
mark, bidirectional marks, variation selectors, the Hangul fillers, tags): a program shows
nothing for them, so a cell that begins with them begins, to the eye and to a spreadsheet
that skips them, with what follows.  Every other format character (Unicode category
``Cf``) counts as invisible too."""


def _invisible(char: str) -> bool:
    """Does a cell's reader see nothing of this character: white space, a format character,
    a default-ignorable one (:data:`_INVISIBLE`)?"""
    if char.isspace() or unicodedata.category(char) == "Cf":
        return True
    code = ord(char)
    return any(low <= code <= high for low, high in _INVISIBLE)


def starts_formula(cell: str) -> bool:
    """Could a spreadsheet run this text cell?  It starts with a tab or a line break, or
    its first character after any white space and invisible characters (:func:`_invisible`)
    is one of :data:`_FORMULA_STARTS` in any compatibility form (NFKC)."""
    if cell[:1] in ("\t", "\r", "\n"):
        return True
    for char in cell:
        if not _invisible(char):
            return unicodedata.normalize("NFKC", char)[:1] in _FORMULA_STARTS
    return False


_PLAIN_FIRST = frozenset(map(chr, range(0x21, 0x7F))).difference(_FORMULA_STARTS)
"""First characters that settle it at once: printable ASCII but the formula characters
(letters, digits, ``{``, ``[``, quotes …) begin no formula, and are not invisible."""


def _csv_lines(rows: Iterator[list]) -> Iterator[bytes]:
    """CSV rows, written in pieces of about :data:`STREAM_CHUNK` bytes.  A text cell that
    starts like a formula (:func:`starts_formula`) gets a leading ``'`` (OWASP's advice
    against CSV injection), so it is data, never a formula, in a spreadsheet; numbers pass
    as numbers, so ``-5`` stays ``-5``: only names, units and text values that arrived as
    strings can carry a formula (any app that writes to HealthKit chooses its source
    name).  A cell whose first character is printable ASCII other than those is passed at
    once (:data:`_PLAIN_FIRST`): the dates, numbers and names of almost every row."""
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\r\n")
    formula, plain = starts_formula, _PLAIN_FIRST
    for row in rows:  # one comprehension: this loop sees every cell
        writer.writerow(["'" + cell if type(cell) is str and cell and cell[0] not in plain
                         and formula(cell) else cell for cell in row])
        if out.tell() >= STREAM_CHUNK:
            yield out.getvalue().encode()
            out.seek(0)
            out.truncate()
    if out.tell():
        yield out.getvalue().encode()


def _csv_cell(value: Any) -> Any:
    """A value as JSON would spell it (shortest round-trip doubles, which the csv module
    writes for a float), text as it is; numbers stay numbers for :func:`_csv_lines`."""
    kind = type(value)
    if kind is str or kind is float or kind is int:
        return value
    if value is None:
        return ""
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def csv_field_order(metric: str, seen: Iterator[str]) -> list:
    """The fields of raw and bucket CSV in their one order (READ-4.6), whatever the range
    and however each point spelled its keys, so that exports of two ranges append: the
    meaning table's value fields in its order (:class:`Meaning`), then the times
    (:data:`RAW_CSV_TIMES`), then ``source``, then the rest by name.  ``seen``: the keys
    present in the range; only those get a column."""
    present = set(seen)
    lead = [name for name in meaning_of(metric).fields + RAW_CSV_TIMES + ("source",)
            if name in present]
    return list(dict.fromkeys(lead)) + sorted(present.difference(lead))


def _csv_value(value: Any) -> Any:
    """A point's value as a raw CSV cell: :func:`_csv_cell`, and a text that starts like a
    formula with its leading ``'`` (as :func:`_csv_lines` writes it)."""
    value = _csv_cell(value)
    if type(value) is str and value and value[0] not in _PLAIN_FIRST and starts_formula(value):
        return "'" + value
    return value


_CSV_QUOTING = ',"\r\n'
"""The characters that make the csv module quote a cell (its ``QUOTE_MINIMAL`` with
``\r\n`` lines)."""
_CSV_QUOTED = re.compile("[%s]" % _CSV_QUOTING)
"""A cell the csv module quotes: one that holds any of :data:`_CSV_QUOTING`."""


def _csv_text(value: Any) -> str:
    """A point's value as the text of a raw CSV cell, exactly as the csv module writes
    :func:`_csv_value` of it: a number as ``str`` spells it, a text quoted when it holds a
    comma, a quote or a line break (its quotes doubled)."""
    value = _csv_value(value)
    if type(value) is not str:
        return str(value)
    if _CSV_QUOTED.search(value):
        return '"' + value.replace('"', '""') + '"'
    return value


_CSV_PLAIN = frozenset((int, float))
"""Types of a value a CSV cell holds as it is (no text: never a formula)."""
_CSV_SAFE_FIRST = frozenset("0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz")
"""First characters of a text that can start no formula (nor space)."""
_CSV_TEXT = frozenset((str,))
"""The types of a column of texts only."""
_CSV_UNSAFE_NEXT = re.compile("\0(?![0-9A-Za-z])")
"""In texts each preceded by a NUL, a text that does not begin with one of
:data:`_CSV_SAFE_FIRST` (an empty one too): one that may be a formula.  A NUL inside a
text only adds a place to look."""
_ORJSON_REPR = _orjson is not None and _orjson.dumps([100.0, 0.1, 1e15, 0.0001, -2.5, 0.0, -7]) == (
    b"[100.0,0.1,1000000000000000.0,0.0001,-2.5,0.0,-7]")
"""Does this orjson write a number as ``str`` does, where that is plain notation (no
exponent)?  Shortest round-trip digits are one text, so the notation is all that could
differ: checked here once, on the forms it could differ in."""


def _number_cells(column: Sequence) -> list:
    """``str`` of each number of a column of ints and floats (what the csv module writes).
    Where every number's ``str`` is in plain notation (zero, or a magnitude from 1e-4 to
    below 1e16: no integer orjson refuses, none past 64 bits, either) and orjson writes
    it the same (:data:`_ORJSON_REPR`), the column's text is orjson's, split: twenty times
    faster than ``str`` of a float, a number at a time."""
    if (_orjson is not None and _ORJSON_REPR and column
            and min(filter(None, map(abs, column)), default=1) >= 1e-4
            and max(map(abs, column)) < 1e16):
        return _orjson.dumps(column)[1:-1].decode().split(",")
    return list(map(str, column))


_CSV_ROWS_HELD = 512
"""Raw CSV lines joined at once."""


def _raw_csv(conn: sqlite3.Connection, query: PointQuery) -> Iterator[bytes]:
    names = csv_field_order(query.metric, iter(_range_keys(conn, query)))
    yield from _csv_lines(iter([list(RAW_CSV_COLUMNS) + [
        name + "_" if name in RAW_CSV_COLUMNS else name for name in names]]))
    for lines in _raw_csv_rows(conn, query, names):
        yield ("\r\n".join(lines) + "\r\n").encode()


def _range_keys(conn: sqlite3.Connection, query: PointQuery) -> set:
    """Every top-level key of the points of the range (the columns of a raw CSV): of an
    object wholly in the range, the keys its tally names (:func:`hour_tally`'s ``k``), read
    from the tallies' index; of an object at the range's edges, or whose tally was written
    before it named them, the keys of its points in the range, decoded."""
    keys: set = set()
    for hour, _, part, tally_text in _in_range_rows(conn, query, "summary"):
        if part == NONE:
            continue
        named = _tally_of(tally_text).get("k") if part == ALL and tally_text else None
        if named is not None:
            keys.update(named)
            continue
        points = loads_body(_object_blob(conn, query, hour))
        if part == ALL:
            keys.update(point_keys(points))
            continue
        READ_DECODES.check()
        for point in points:
            if type(point) is dict and _in_range(point, query):
                keys.update(point)
    return keys


def _raw_csv_rows(conn: sqlite3.Connection, query: PointQuery, names: list) -> Iterator[list]:
    """Lists of raw CSV lines (a few hundred at a time, without their ``\r\n``), an object
    at a time: the lines of a whole hour whose points share one whole-hour offset written
    from the hour's own texts (:meth:`_RawCsvLines.whole_hour`), any other point's by
    :meth:`_RawCsvLines.line`."""
    lines = _RawCsvLines(query, names, SleepDates(sleep_nights(conn, query), query.zone)
                         if query.sleep_stages else None)
    held: list = []
    units_now, units_cell = object(), ""
    for hour, units, part, (blob, spans, tally_text) in _in_range_rows(
            conn, query, "blob, spans, summary"):
        if part == NONE:
            continue
        if units != units_now:
            units_now, units_cell = units, _csv_text(units or "")
        points = loads_body(_read_blob(blob))
        known = _known_spans(spans, points)
        offset = (lines.hour_offset(hour, tally_text)
                  if part == ALL and known is not None else None)
        if offset is not None:
            held += lines.whole_hour(hour, units_cell, points, known, offset)
        else:
            line = lines.line
            held += [line(units_cell, start, end, point) for start, end, point in (
                zip(known[0], known[1], points) if part == ALL and known is not None
                else _points_checked(query, points, known))]
        if len(held) >= _CSV_ROWS_HELD:
            yield held
            held = []
    if held:
        yield held


class _RawCsvLines:
    """The lines of raw CSV, each the bytes the csv module writes for its row
    (:func:`_csv_text`: a text value checked for a formula and quoted where it must be; the
    row's own texts, times and dates, need neither).

    Its loops see every point of a raw CSV, so they join the cells themselves (the csv
    module takes as long again) and write the texts of :func:`format_instant` and
    :func:`local_iso` from pieces: a whole hour of one whole-hour offset from the hour's
    own (its points share their date, UTC and local hour, and minute and second), any other
    point from the caches of those two functions (calling them where a cache has not the
    piece) and, ``tz=local``, the offset of HAE's own timestamps from their last six
    characters, read once per distinct tail."""

    def __init__(self, query: PointQuery, names: list, sleep: Optional[SleepDates]):
        self.zone, self.names, self.sleep = query.zone, names, sleep
        self.take = operator.itemgetter(*names) if names else None  # every key of a point
        self.tails: dict = {}  # " +hhmm" -> seconds east of UTC (tz=local)
        self.dates: dict = {}  # local date ordinal -> its ISO text

    def hour_offset(self, hour: int, tally_text: Optional[str]) -> Optional[int]:
        """The one whole-hour offset every point of a whole hour is placed in, when known
        without reading them (``tz=local``: the one its tally names; a zone's the same at
        the hour's start and end), else None; and None for sleep, whose dates are its
        nights'."""
        if self.sleep is not None:
            return None
        zone = self.zone
        if zone is LOCAL_ZONE:
            offsets = _tally_of(tally_text).get("o") if tally_text else None
            offset = offsets[0] if offsets and len(offsets) == 1 else None
        else:
            offset = zone.offset_at(hour * HOUR_US)
            if zone.offset_at((hour + 1) * HOUR_US - 1) != offset:
                return None
        return offset if type(offset) is int and offset % 3600 == 0 else None

    def values(self, point: dict) -> list:
        """The cells of a point's own keys."""
        plain, safe, quoted, text_of = _CSV_PLAIN, _CSV_SAFE_FIRST, _CSV_QUOTED.search, _csv_text
        return [str(value) if type(value) in plain else value if type(value) is str
                and value[:1] in safe and not quoted(value) else text_of(value)
                for value in map(point.get, self.names)]

    def columns(self, points: list) -> list:
        """The cells of the points' own keys, a column (a key) at a time: a column of
        numbers, or of texts none of which needs a quote or a ``'`` (a few searches of the
        joined column: for each of :data:`_CSV_QUOTING`, and :data:`_CSV_UNSAFE_NEXT`), is
        written as it is, in one C loop; any other column a cell at a time, as
        :meth:`values` writes it."""
        names = self.names
        if not names:
            return []
        try:  # every point has every key: a C loop takes them out
            cells = list(map(self.take, points))
            columns = list(zip(*cells)) if len(names) > 1 else [cells]
        except KeyError:
            columns = [[point.get(name) for point in points] for name in names]
        out = []
        unsafe = _CSV_UNSAFE_NEXT.search
        for column in columns:
            kinds = set(map(type, column))
            if kinds <= _CSV_PLAIN:
                out.append(_number_cells(column))
                continue
            if kinds == _CSV_TEXT:
                joined = "\0" + "\0".join(column)
                # a find per character of _CSV_QUOTING: 50 times faster than its regex here
                if not (any(map(joined.__contains__, _CSV_QUOTING)) or unsafe(joined)):
                    out.append(column)
                    continue
            out.append(list(map(_csv_text, column)))
        return out

    def whole_hour(self, hour: int, units_cell: str, points: list, known: tuple,
                   offset: int) -> list:
        """The lines of a whole hour's points, all placed in ``offset`` (a whole hour): the
        five cells of the time from the hour's own texts and the point's minute and second
        (an instant's start and end in one text each), the rest a column at a time
        (:meth:`columns`)."""
        base = hour * HOUR_US
        start_text, local_text = format_instant(base), local_iso(base, offset)
        utc_hour, local_hour, date = start_text[:14], local_text[:14], local_text[:10]
        zone_text = local_text[19:]
        minute_second, starts, ends = _MINUTE_SECOND, known[0], known[1]
        if starts == ends and not any(map(US.__rmod__, starts)):
            parts = (utc_hour, "Z," + utc_hour, "Z,%s,%s" % (units_cell, local_hour),
                     "%s,%s" % (zone_text, date))
            heads = [minute_second[(start - base) // US].join(parts) for start in starts]
        else:
            heads = []
            for start, end, point in zip(starts, ends, points):
                rest = start - base
                if rest % US:  # a fraction of a second: the general line's cells
                    heads.append(self.head(units_cell, start, end, point))
                    continue
                piece = minute_second[rest // US]
                utc = utc_hour + piece + "Z"
                heads.append(",".join((utc, utc if end == start else format_instant(end),
                                       units_cell, local_hour + piece + zone_text, date)))
        return list(map(",".join, zip(heads, *self.columns(points))))

    def line(self, units_cell: str, start: int, end: int, point: dict) -> str:
        """The line of any point."""
        return ",".join([self.head(units_cell, start, end, point)] + self.values(point))

    def head(self, units_cell: str, start: int, end: int, point: dict) -> str:
        """The five cells of any point's time, joined (:data:`RAW_CSV_COLUMNS`)."""
        if self.zone is LOCAL_ZONE:
            raw = raw_start(point)
            offset = self.tails.get(raw[19:]) if type(raw) is str and len(raw) == 25 else None
            if offset is None:
                offset = text_offset(raw, start)
                if type(raw) is str and len(raw) == 25 and raw[19] == " " and raw[20] in "+-":
                    self.tails[raw[19:]] = offset
        else:
            offset = self.zone.point_offset(raw_start(point), start)
        local_s = start // US + offset
        hour, rest = divmod(local_s, 3600)
        prefix, zone_text = _LOCAL_HOUR.get(hour), _OFFSET_TEXT.get(offset)
        local_text = (local_iso(start, offset) if prefix is None or zone_text is None
                      else prefix + _MINUTE_SECOND[rest] + zone_text)
        hour, rest = divmod(start, HOUR_US)
        prefix = _HOUR_TEXT.get(hour)
        utc = (format_instant(start) if prefix is None or rest % US
               else prefix + _MINUTE_SECOND[rest // US] + "Z")
        day = None if self.sleep is None else self.sleep.of(point, (start, end))
        if day is None:
            day = local_s // 86400 + _EPOCH_ORDINAL
        date = self.dates.get(day)
        if date is None:
            date = self.dates[day] = _dt.date.fromordinal(day).isoformat()
        return ",".join((utc, utc if end == start else format_instant(end), units_cell,
                         local_text, date))


RAW_CSV_TIMES = ("date", "start", "end", "startDate", "endDate")
"""The keys HAE writes a point's times in, in the order raw CSV gives them columns."""
RAW_CSV_COLUMNS = ("utc_start", "utc_end", "units", "local_start", "local_date")
"""The columns raw CSV puts before the point's own keys (a key of the same name gets a
trailing ``_``): the coordinate in UTC, the run's units, and the start in local time
(the query's ``tz``; ``local``: as the phone wrote it) with its date; a sleep row's date
is the day its sleep ended (:class:`SleepDates`)."""


ECG_CSV_COLUMNS = ("recording_start", "recording_local_start", "recording_local_date",
                   "sample", "offset_s", "voltage", "units")
"""Raw CSV of ECG recordings: one row per voltage sample, not one per recording (a 30 s
recording at 512 Hz is 15,360 samples, as JSON some 700,000 characters: a spreadsheet cuts
a cell at 32,767).  The recording's start in UTC, in local time (the query's ``tz``) and
its local date; the sample's index in the order measured (from 0, as ``/api/ecg`` lists the
voltages); its time in seconds from the recording's start (its ``date`` minus the start, or
without a readable ``date`` its index divided by ``samplingFrequency``; empty without
either); its voltage and units as sent (HAE: µV, ``mcV``).  A recording without samples is
one row with the last four empty."""


def ecg_readings(point: dict) -> list:
    """(instant µs or None, reading) of each sample of an ECG recording with a numeric
    ``voltage``, in the order measured: by ``date``, those without a readable one first, as
    sent (a stable sort)."""
    samples = point.get("voltageMeasurements")
    readings = [(parse_time(item.get("date")), item)
                for item in (samples if type(samples) is list else ())
                if type(item) is dict and type(item.get("voltage")) in (int, float)]
    readings.sort(key=lambda pair: pair[0] or 0)
    return readings


def _ecg_csv(conn: sqlite3.Connection, query: PointQuery) -> Iterator[bytes]:
    zone = query.zone

    def rows() -> Iterator[list]:
        yield list(ECG_CSV_COLUMNS)
        for _, coord, point in iter_points(conn, query):
            offset = zone.point_offset(raw_start(point), coord[0])
            recording = [format_instant(coord[0]), local_iso(coord[0], offset),
                         _dt.date.fromordinal(local_ordinal(coord[0], offset)).isoformat()]
            frequency = point.get("samplingFrequency")
            if type(frequency) not in (int, float) or not frequency > 0:
                frequency = None
            readings = ecg_readings(point)
            if not readings:
                yield recording + ["", "", "", ""]
            for index, (instant, item) in enumerate(readings):
                units = item.get("units")
                yield recording + [
                    index, (instant - coord[0]) / US if instant is not None
                    else index / frequency if frequency else None,
                    item["voltage"], units if type(units) is str else ""]

    yield from _csv_lines(rows())


@dataclass
class _Run:
    units: Optional[str]
    buckets: dict = _field(default_factory=dict)  # bucket key -> _Bucket


@dataclass
class _Bucket:
    count: int = 0
    fields: dict = _field(default_factory=dict)  # name -> [count, min, max, sum]
    first: Optional[int] = None  # the earliest instant counted, and its offset:
    offset: int = 0  # where ``tz=local`` learns the bucket's local midnight

    def saw(self, instant_us: int, offset_s: int) -> None:
        if self.first is None or instant_us < self.first:
            self.first, self.offset = instant_us, offset_s


def bucket_key(instant_us: int, offset_s: int, bucket: str) -> int:
    """The bucket of an instant seen at ``offset_s``: for days and weeks the local date's
    ordinal (weeks: their Monday's), for hours the UTC µs of the local clock hour's start
    (a DST day has 23 or 25 of them: the hour repeated in autumn is two buckets)."""
    local_s = instant_us // US + offset_s
    if bucket == "hour":
        return (local_s // 3600 * 3600 - offset_s) * US
    day = local_s // 86400 + _EPOCH_ORDINAL
    return day if bucket == "day" else day - (day - 1) % 7  # ordinal 1 was a Monday


def _bucket_place(query: PointQuery, key: int, bucket: _Bucket) -> dict:
    """``start`` (UTC), ``local`` (its local time) and ``date`` of a bucket."""
    if query.bucket == "hour":
        start = key
        offset = query.zone.offset_at(key)
        offset = bucket.offset if offset is None else offset
        return {"start": format_instant(start), "local": local_iso(start, offset),
                "date": _dt.date.fromordinal(local_ordinal(start, offset)).isoformat()}
    start = query.zone.midnight(key, bucket.offset)
    offset = query.zone.offset_at(start)
    return {"start": format_instant(start),
            "local": local_iso(start, bucket.offset if offset is None else offset),
            "date": _dt.date.fromordinal(key).isoformat()}


def _hour_offsets(query: PointQuery, hour: int, tally: dict) -> Optional[list]:
    """The offsets the points of a UTC hour are placed in, when known without reading them:
    the zone's at the hour's start and end, or (``tz=local``) those the fold wrote in the
    hour's tally."""
    start = query.zone.offset_at(hour * HOUR_US)
    if start is None:
        return tally.get("o")
    end = query.zone.offset_at((hour + 1) * HOUR_US - 1)
    return [start] if end == start else [start, end]


def _tally_bucket(query: PointQuery, hour: int, tally: Optional[dict]) -> Optional[tuple]:
    """(key, offset) of the one bucket a whole hour falls in, when its tally can stand for
    its points, else None (the points are read)."""
    if tally is None:
        return None
    offsets = _hour_offsets(query, hour, tally)
    if not offsets or len(offsets) != 1:
        return None
    offset = offsets[0]
    # bucket_key of the hour's first and last second, as integer arithmetic: this runs for
    # every hour of a year
    if query.bucket == "hour":
        return None if offset % 3600 else (hour * HOUR_US, offset)
    first, last = (hour * 3600 + offset) // 86400, (hour * 3600 + 3599 + offset) // 86400
    if query.bucket == "week":  # their Mondays (ordinal 1 was a Monday)
        first -= (first + _EPOCH_ORDINAL - 1) % 7
        last -= (last + _EPOCH_ORDINAL - 1) % 7
    if first != last:
        return None  # a half-hour offset: the hour straddles two local hours or days
    return first + _EPOCH_ORDINAL, offset


def bucket_runs(conn: sqlite3.Connection, query: PointQuery) -> list:
    """Per run of equal units, per bucket: count and count/min/max/sum of every numeric
    field, in the query's local time (:class:`Zone`).

    An object wholly inside the range whose points all fall in one bucket is counted
    from its stored tally (:func:`hour_tally`) without decoding its points: a year of
    minute data is 8,760 tallies instead of half a million points; so with local date
    bounds (``tz=local``), where an object more than a day inside them is whole whatever
    its offsets (:func:`_object_part`).  An object whose points are read adds them to a
    bucket as its tally would, an object's share at a time (:func:`_object_shares`): the
    same sums to the last bit whichever way an hour is counted.  A run holds at least one
    bucket.
    """
    if query.fill:
        return _filled_runs(conn, query)
    runs: list = []
    for hour, units, part, tally_text in _in_range_rows(conn, query, "summary"):
        if not runs or runs[-1].units != units:
            if runs and not runs[-1].buckets:
                runs.pop()  # nothing of the last run fell in the range
            runs.append(_Run(units))
        if part == NONE:
            continue  # no point of it in the range (its units still end a run, as read)
        buckets = runs[-1].buckets
        tally = _tally_of(tally_text) if tally_text and part == ALL else None
        placed = _tally_bucket(query, hour, tally)
        if placed is not None:
            target = buckets.setdefault(placed[0], _Bucket())
            target.saw(hour * HOUR_US, placed[1])
            _add_tally(target, tally)
            continue
        for key, share in _object_shares(query, _object_blob(conn, query, hour)).items():
            target = buckets.setdefault(key, _Bucket())
            target.saw(share.first, share.offset)
            _add_tally(target, {"n": share.count, "f": share.fields})
    if runs and not runs[-1].buckets:
        runs.pop()
    return runs


def _object_shares(query: PointQuery, raw: bytes) -> dict:
    """Bucket key -> :class:`_Bucket` of one object's points in the range: each bucket's
    share of the object, aggregated over its points in stored order as the object's tally
    was (:func:`hour_tally`), so that adding it to a bucket gives what the tally gives."""
    READ_DECODES.check()
    shares: dict = {}
    for point in loads_body(raw):
        coord = point_coordinate(point) if type(point) is dict else None
        if _coord_in_range(coord, query, point):
            offset = query.zone.point_offset(raw_start(point), coord[0])
            key = bucket_key(coord[0], offset, query.bucket)
            share = shares.get(key)
            if share is None:
                share = shares[key] = _Bucket()
            share.saw(coord[0], offset)
            share.count += 1
            accumulate(share.fields, (point,))
    return shares


def _filled_runs(conn: sqlite3.Connection, query: PointQuery) -> list:
    """:func:`bucket_runs` of each day (or week) from the first layer of ``query.fill`` that
    holds it, runs of units formed again over the days chosen."""
    chosen: dict = {}  # bucket key -> [(units, bucket)] of the layer that holds it first
    for layer in query.fill:
        taken: dict = {}
        for run in bucket_runs(conn, _replace(query, layer=layer, fill=())):
            for key, bucket in run.buckets.items():
                if key not in chosen:
                    taken.setdefault(key, []).append((run.units, bucket))
        chosen.update(taken)
    runs: list = []
    for key in sorted(chosen):
        for units, bucket in chosen[key]:
            if not runs or runs[-1].units != units or key in runs[-1].buckets:
                runs.append(_Run(units))
            runs[-1].buckets[key] = bucket
    return runs


def _object_blob(conn: sqlite3.Connection, query: PointQuery, hour: int) -> bytes:
    return _read_blob(conn.execute(
        "SELECT blob FROM object WHERE metric = ? AND layer = ? AND hour = ?",
        (query.metric, query.layer, hour)).fetchone()[0])


def _hour_spans(hours: list) -> list:
    """Runs of consecutive hours, as (first, last)."""
    spans: list = []
    for hour in sorted(hours):
        if spans and hour == spans[-1][1] + 1:
            spans[-1][1] = hour
        else:
            spans.append([hour, hour])
    return spans


def _add_tally(target: _Bucket, tally: dict) -> None:
    target.count += tally["n"]
    for name, (count, low, high, total) in tally["f"].items():
        stats = target.fields.get(name)
        if stats is None:
            target.fields[name] = [count, low, high, total]
        else:
            stats[0] += count
            stats[1] = min(stats[1], low)
            stats[2] = max(stats[2], high)
            stats[3] = None if stats[3] is None or total is None else stats[3] + total


def _field_stats(stats: list) -> dict:
    """A field's aggregates as replied; sum and average are null when the sum overflows
    a double (JSON has no Infinity)."""
    count, low, high, total = stats
    return {"count": count, "min": low, "max": high,
            "avg": None if total is None else total / count, "sum": total}


def _median(values: list) -> Optional[float]:
    """The middle of ``values`` (the mean of the two middle ones); None when empty."""
    values = sorted(values)
    if not values:
        return None
    middle = len(values) // 2
    return values[middle] if len(values) % 2 else (values[middle - 1] + values[middle]) / 2


def _bucket_json(runs: list, query: PointQuery) -> Iterator[bytes]:
    head = _json_bytes(_head(query))
    yield head[:-1] + b',"runs":['
    for i, run in enumerate(runs):
        yield ((b"," if i else b"") + b'{"units":' + _json_bytes(run.units) + b',"unit_label":'
               + _json_bytes(unit_label(query.metric, run.units)) + b',"buckets":[')
        for j, key in enumerate(sorted(run.buckets)):
            bucket = run.buckets[key]
            item = _bucket_place(query, key, bucket)
            item["units"] = run.units  # each row says its units (Grafana splits by them)
            item["count"] = bucket.count
            if bucket.fields:
                item["fields"] = {name: _field_stats(stats)
                                  for name, stats in bucket.fields.items()}
            yield (b"," if j else b"") + _json_bytes(item)
        yield b"]}"
    yield b"]}"


def _bucket_csv(runs: list, query: PointQuery) -> Iterator[bytes]:
    seen: set = set()
    for run in runs:
        for bucket in run.buckets.values():
            seen.update(bucket.fields)
    fields = csv_field_order(query.metric, iter(seen))
    columns = ["start", "local", "date", "units", "count"] + [
        "%s_%s" % (name, stat) for name in fields
        for stat in ("count", "min", "max", "avg", "sum")]

    def rows() -> Iterator[list]:
        yield columns
        for run in runs:
            for key in sorted(run.buckets):
                bucket = run.buckets[key]
                place = _bucket_place(query, key, bucket)
                row = [place["start"], place["local"], place["date"], run.units or "",
                       bucket.count]
                for name in fields:
                    stats = bucket.fields.get(name)
                    row += ([_csv_cell(v) for v in _field_stats(stats).values()] if stats
                            else [""] * 5)
                yield row

    yield from _csv_lines(rows())


# -- sleep: a night belongs to the day it ends -----------------------------------------

SLEEP_STAGE_NAMES = {
    "core": ("core", "asleepcore", "kern", "léger", "leger", "ligero", "leggero"),
    "deep": ("deep", "asleepdeep", "tief", "profond", "profundo", "profondo"),
    "rem": ("rem", "asleeprem", "paradoxal"),
    "asleep": ("asleep", "unspecified", "asleepunspecified", "schlafend", "endormi",
               "dormido"),
    "awake": ("awake", "wach", "éveillé", "eveille", "despierto", "sveglio"),
    "in_bed": ("inbed", "imbett", "aulit", "encama", "aletto"),
}
"""How each sleep stage is spelled in HAE's records (``value``): English, as HealthKit
names it (``HKCategoryValueSleepAnalysisAsleepREM``), and in the languages seen in
phones' exports; compared lower-case without spaces, ``_`` or ``-``."""
_STAGE_OF = {spelling: stage for stage, spellings in SLEEP_STAGE_NAMES.items()
             for spelling in spellings}
NIGHT_GAP_US = 3 * HOUR_US
"""Stage records this far apart or more are two sleeps (a night and an afternoon nap).
Nightly records are never joined: each is HAE's own sleep, and HAE bounds a record's
window by the previous record's end, so records that touch are two sleeps."""
STAGE_ORDER = tuple(stage.stage for stage in SLEEP_STAGES)
"""The order stages are listed and drawn in, deepest first, awake last: the sleep
meaning's (:data:`SLEEP_STAGES`)."""
ASLEEP_STAGES = tuple(stage.stage for stage in SLEEP_STAGES if stage.asleep)
"""The stages whose hours are sleep: all but awake."""
STAGED = tuple(stage.stage for stage in SLEEP_STAGES if stage.asleep and not stage.unspecified)
"""The stages of sleep a device told apart (the Watch's core, deep and REM)."""
UNSPECIFIED = next(stage.stage for stage in SLEEP_STAGES if stage.unspecified)
"""The stage of sleep no stage was given for (HAE's and HealthKit's plain ``asleep``)."""
AWAKE = next(stage.stage for stage in SLEEP_STAGES if not stage.asleep)
"""The stage that is not sleep."""


_STAGE_SPELLED: dict = {}
"""``value`` text -> its stage (or None): a year of records repeats a few spellings."""


def sleep_stage(value: Any) -> Optional[str]:
    """The stage a record's ``value`` names (``core``, ``deep``, ``rem``, ``asleep``,
    ``awake``, ``in_bed``), or None."""
    if type(value) is not str:
        return None
    if value in _STAGE_SPELLED:
        return _STAGE_SPELLED[value]
    key = re.sub(r"[\s_-]+", "", value.lower())
    if key.startswith("hkcategoryvaluesleepanalysis"):
        key = key[len("hkcategoryvaluesleepanalysis"):]
    if len(_STAGE_SPELLED) >= 4096:
        _STAGE_SPELLED.clear()
    stage = _STAGE_SPELLED[value] = _STAGE_OF.get(key)
    return stage


def _hours(value: Any) -> Optional[float]:
    return float(value) if type(value) in (int, float) and value > 0 else None


SLEEP_TOLERANCE_H = 1 / 3600
"""One second: HAE writes a sleep's start and end to the second and adds its hours up as
floats, so a figure within a second of a bound is that bound, not an overlap.  No figure
is ever shown above its bound: within the second it is cut to it."""
SLEEP_MAX_H = 24.0
"""No sleep is longer than a day, whatever its figures say."""
NAP_MAX_H = 3.0
"""A sleep of less than this many hours asleep that lies wholly in the day is a nap."""
NAP_DAY_S = (10 * 3600, 20 * 3600)
"""The day of a nap, in local clock seconds from midnight: 10:00 to 20:00."""


@dataclass
class Night:
    """One sleep, placed on the local date of its end: a nightly record, or stage records
    less than :data:`NIGHT_GAP_US` apart.  ``asleep`` is its hours asleep by the one sleep
    rule (:func:`_nightly_night`, :func:`_record_night`), never more than its ``limit``
    (the smallest of its window, its own hours in bed and a day); ``overlapping`` when its
    own figures said more (``said``: two sources describing the same hours, or one written
    twice); ``counted`` which figure gives ``asleep`` (``total``: HAE's own, ``staged``:
    core + deep + rem, ``unspecified``: HAE's ``asleep``, the sleep no stage holds,
    ``union``: the time its stage records cover); ``stages`` the stage hours shown, never
    adding up to more than ``asleep`` (awake beside them), ``scaled`` when they are shares
    of a figure cut to its limit.  ``start`` is the bedtime shown (None when not known: a
    record that starts where the one before it ended); ``begins`` where its window starts,
    known or not."""

    date: int  # local date ordinal
    end: int  # UTC µs
    end_offset: int
    start: Optional[int]
    start_offset: int
    asleep: Optional[float]
    in_bed: Optional[float]
    stages: dict
    form: str  # "nightly" (one record per night) or "records" (one per stage segment)
    overlapping: bool = False
    window: Optional[float] = None  # hours from ``begins`` to its end
    begins: Optional[int] = None
    begins_offset: int = 0
    counted: Optional[str] = None
    said: Optional[float] = None
    limit: Optional[float] = None
    limit_by: Optional[str] = None  # "window", "in_bed" or "day"
    scaled: bool = False
    sources: tuple = ()


@dataclass
class SleepDay:
    """The sleeps that ended on one local date: its ``night`` (its longest sleep that is no
    nap; None on a day of naps only) and its ``naps`` (every other sleep, never counted),
    and ``clusters``, the sleeps its stage records make (the night or naps, unless the
    date's nightly records gave them), by which those records are dated."""

    date: int
    night: Optional[Night]
    naps: list
    clusters: list = _field(default_factory=list)

    @property
    def end(self) -> int:
        return max(sleep.end for sleep in ([self.night] if self.night else []) + self.naps)


@dataclass
class _NightlySleep:
    """One nightly record's figures, before the rule settles what it shows."""

    start: Optional[int]
    start_offset: int
    end: int
    end_offset: int
    total: Optional[float]  # HAE's own total: totalSleep, else asleep + core + deep + rem
    staged: dict  # core, deep, rem: the stages a device told apart
    unspecified: float  # HAE's ``asleep``: only the unspecified part where stages exist
    awake: float
    in_bed: Optional[float]
    in_bed_window: Optional[tuple]
    sources: tuple


_SOURCE_NAMES: dict = {}
"""``source`` text -> its names: a year of sleep records repeats a few of them."""


def _sources(text: Any) -> tuple:
    """The names a ``source`` gives (HAE joins a night's with ``|``), each once, in order."""
    if type(text) is not str:
        return ()
    found = _SOURCE_NAMES.get(text)
    if found is None:
        names: list = []
        for name in text.split("|"):
            name = name.strip()
            if name and name not in names:
                names.append(name)
        if len(_SOURCE_NAMES) >= 4096:
            _SOURCE_NAMES.clear()
        found = _SOURCE_NAMES[text] = tuple(names)
    return found


def _nightly_sleep(point: dict, zone: Zone) -> Optional[_NightlySleep]:
    """A nightly record (HAE's "Aggregate Sleep": one point a night), in any of its forms:
    its end is ``sleepEnd``, else ``inBedEnd``, else ``date``; its total is ``totalSleep``, else
    ``asleep + core + deep + rem``.  Evidence (3,242 of 3,242 real records with
    ``totalSleep``, seven people, 2010-2026): ``totalSleep`` always equals that sum, so
    ``asleep`` alone is only the unspecified part wherever stages exist."""
    for key in ("sleepEnd", "inBedEnd", "date"):
        end = parse_time(point.get(key))
        if end is not None:
            end_offset = zone.point_offset(point.get(key), end)
            break
    else:
        return None
    start_raw = point.get("sleepStart") or point.get("inBedStart")
    start = parse_time(start_raw)
    if start is not None and start >= end:
        start = None
    staged = {stage: _hours(point.get(stage)) for stage in STAGED}
    staged = {stage: hours for stage, hours in staged.items() if hours}
    unspecified = _hours(point.get("asleep")) or 0.0
    total = _hours(point.get("totalSleep"))
    if total is None and (staged or unspecified):
        total = unspecified + sum(staged.values())
    bed_start, bed_end = parse_time(point.get("inBedStart")), parse_time(point.get("inBedEnd"))
    return _NightlySleep(start, end_offset if start is None else
                         zone.point_offset(start_raw, start), end, end_offset, total, staged,
                         unspecified, _hours(point.get("awake")) or 0.0,
                         _hours(point.get("inBed")),
                         (bed_start, bed_end) if bed_start is not None and bed_end is not None
                         and bed_end > bed_start else None, _sources(point.get("source")))


def _limit(window: Optional[float], in_bed: Optional[float]) -> tuple:
    """(hours, what bounds them) of the most sleep a record can hold: the smallest of its
    window, its own hours in bed (when it gives them) and a day."""
    bounds = [(SLEEP_MAX_H, "day")]
    if in_bed is not None:
        bounds.append((in_bed, "in_bed"))
    if window is not None:
        bounds.append((window, "window"))
    return min(bounds, key=lambda bound: bound[0])


def _nightly_night(sleep: _NightlySleep, date: int) -> Night:
    """The night one nightly record gives, by the one sleep rule:

    * its figures overlap when HAE's total is more than its limit (:func:`_limit`: its
      window, its own ``inBed``, a day) by more than :data:`SLEEP_TOLERANCE_H`: two sources
      describe the same hours (AutoSleep's 8.0 h beside the Watch's 6.1 h in 8.25 h in bed)
      or one wrote its samples twice (Eight Sleep: 27 h between 21:52 and 10:16);
    * the hours counted are HAE's total, else (overlapping) the staged figure (core + deep +
      rem) if there is one, else ``asleep``, never more than the limit;
    * the stages shown are those counted: the total's stages and its unspecified part
      (the stage ``asleep``); the staged figure's stages, another source's unspecified part
      left out; none when ``asleep`` alone counts.  A figure cut to its limit shows its
      stages as their shares of it (``scaled``), and an overlapping night's awake time
      never fills more than the limit leaves;
    * in bed is ``inBed``, never more than its in-bed window (else its window) nor a day;
      more than that is overlapping too (and awake then fits in the limit as well)."""
    window = None if sleep.start is None else (sleep.end - sleep.start) / HOUR_US
    limit, limit_by = _limit(window, sleep.in_bed)
    staged = sum(sleep.staged.values())
    said = sleep.total
    asleep = counted = None
    overlapping = scaled = False
    shown: dict = {}
    figure = 0.0
    if said is not None and said <= limit + SLEEP_TOLERANCE_H:
        counted, figure = "total", said
        if staged:
            shown = dict(sleep.staged)
            if sleep.unspecified:
                shown[UNSPECIFIED] = sleep.unspecified
    elif said is not None:
        overlapping = True
        if staged:
            counted, figure, shown = "staged", staged, dict(sleep.staged)
        else:
            counted, figure = "unspecified", sleep.unspecified or said
        scaled = bool(shown) and figure > limit + SLEEP_TOLERANCE_H
    if counted is not None:
        asleep = min(figure, limit)
    in_bed = sleep.in_bed
    if in_bed is not None:
        bed_window = sleep.in_bed_window or (None if sleep.start is None
                                             else (sleep.start, sleep.end))
        cap = SLEEP_MAX_H if bed_window is None else min(
            (bed_window[1] - bed_window[0]) / HOUR_US, SLEEP_MAX_H)
        overlapping = overlapping or in_bed > cap + SLEEP_TOLERANCE_H
        in_bed = min(in_bed, cap)
    share = asleep / figure if shown and figure > asleep else 1.0
    stages = {stage: hours * share for stage, hours in shown.items()}
    if shown and sleep.awake:
        awake = sleep.awake * share
        if overlapping:
            awake = min(awake, max(0.0, limit - asleep))
        if awake > 0:
            stages[AWAKE] = awake
    return Night(date, sleep.end, sleep.end_offset, sleep.start, sleep.start_offset, asleep,
                 in_bed, in_stage_order(stages), "nightly", overlapping, window, sleep.start,
                 sleep.start_offset, counted, said, limit, limit_by, scaled, sleep.sources)


def _record_seconds(group: list) -> tuple:
    """({stage: µs}, µs asleep, µs in bed) of stage records ((start, end, stage, …)), each
    instant counted once, in one stage: a stage a device told apart (of two, the record
    that began last, which describes that moment), else the unspecified stage, else awake;
    in bed wherever an in-bed record is.  Records that do not overlap (one device, the
    usual night) are added up; the others are walked instant by instant of change."""
    spans = sorted((record[0], record[1], record[2]) for record in group
                   if record[2] != "in_bed")
    in_bed = _union_us([(record[0], record[1]) for record in group if record[2] == "in_bed"])
    seconds: dict = {}
    asleep = 0
    if all(spans[k][0] >= spans[k - 1][1] for k in range(1, len(spans))):
        for start, end, stage in spans:
            seconds[stage] = seconds.get(stage, 0) + end - start
            if stage != AWAKE:
                asleep += end - start
        return seconds, asleep, in_bed
    cuts = sorted({t for span in spans for t in (span[0], span[1])})
    rank = {stage: n for n, stage in enumerate(STAGE_ORDER)}
    active: list = []
    k = 0
    for first, last in zip(cuts, cuts[1:]):
        while k < len(spans) and spans[k][0] <= first:
            active.append(spans[k])
            k += 1
        active = [span for span in active if span[1] > first]
        if not active:
            continue
        told = [span for span in active if span[2] in STAGED]
        if told:
            stage = max(told, key=lambda span: (span[0], -rank[span[2]]))[2]
        elif any(span[2] == UNSPECIFIED for span in active):
            stage = UNSPECIFIED
        else:
            stage = AWAKE
        seconds[stage] = seconds.get(stage, 0) + last - first
        if stage != AWAKE:
            asleep += last - first
    return seconds, asleep, in_bed


def _union_us(spans: list) -> int:
    """The µs that (start, end) spans cover, each once."""
    total, reach = 0, None
    for start, end in sorted(spans):
        if reach is None or start > reach:
            total, reach = total + end - start, end
        elif end > reach:
            total, reach = total + end - reach, end
    return total


def _record_night(group: list, zone: Zone) -> Night:
    """The sleep of stage records ((start, end, stage, end text, start text, sources)) less
    than :data:`NIGHT_GAP_US` apart, placed on the local date of its last end.  Every
    instant counts once (:func:`_record_seconds`), so a record written twice, or two devices
    recording one night, count once: asleep is the time any asleep record covers, each
    stage the time it holds, in bed that of ``in_bed``; none more than a day (the stages
    then shares of it, ``scaled``).  The sleep is ``overlapping`` when its asleep records
    add up to more than the time they cover, or to more than a day (its awake time then
    fits in what its limit leaves); its stages are shown only when a device told some
    apart (asleep alone shows no stage hours)."""
    last = max(group, key=lambda r: r[1])
    first = min(group, key=lambda r: r[0])
    end_offset = zone.point_offset(last[3], last[1])
    start_offset = zone.point_offset(first[4], first[0])
    seconds, covered, bed = _record_seconds(group)
    said_us = sum(r[1] - r[0] for r in group if r[2] in ASLEEP_STAGES)
    span = (last[1] - first[0]) / HOUR_US
    union = covered / HOUR_US
    asleep = min(union, SLEEP_MAX_H) if covered else None
    overlapping = covered > 0 and (said_us > covered or union > SLEEP_MAX_H)
    limit, limit_by = (SLEEP_MAX_H, "day") if span > SLEEP_MAX_H else (span, "window")
    stages: dict = {}
    if any(seconds.get(stage) for stage in STAGED):
        share = asleep / union if union > asleep else 1.0
        stages = {stage: us / HOUR_US * share for stage, us in seconds.items()
                  if stage != AWAKE}
        awake = seconds.get(AWAKE, 0) / HOUR_US * share
        if overlapping:
            awake = min(awake, max(0.0, limit - asleep))
        if awake > 0:
            stages[AWAKE] = awake
    seen: dict = {}  # source name -> its first record's start: named in that order
    for record in group:
        for name in record[5]:
            seen[name] = min(seen.get(name, record[0]), record[0])
    sources = sorted(seen, key=lambda name: (seen[name], name))
    return Night(local_ordinal(last[1], end_offset), last[1], end_offset, first[0],
                 start_offset, asleep, None if not bed else min(bed / HOUR_US, SLEEP_MAX_H),
                 in_stage_order(stages), "records", overlapping, span, first[0], start_offset,
                 "union" if covered else None, said_us / HOUR_US if covered else None,
                 limit, limit_by, union > SLEEP_MAX_H, tuple(sources))


def _record_clusters(stage_records: list) -> list:
    """Stage records in sleeps: sorted, each group's records less than
    :data:`NIGHT_GAP_US` after the latest end before them."""
    groups: list = []
    reach = None
    for record in sorted(stage_records):
        if not groups or record[0] - reach >= NIGHT_GAP_US:
            groups.append([])
            reach = record[1]
        groups[-1].append(record)
        reach = max(reach, record[1])
    return groups


def _stages_span(stage_records: list, starts: list, sleep: _NightlySleep) -> Optional[tuple]:
    """(start, raw start) of the stage records inside a nightly record's window that end
    its last sleep (the records less than :data:`NIGHT_GAP_US` apart that lie last in
    it), or None when it holds none."""
    inside = [record for record in stage_records[bisect.bisect_left(starts, sleep.start):]
              if record[0] < sleep.end]
    inside = [record for record in inside if record[1] <= sleep.end]
    groups = _record_clusters(inside)
    return (groups[-1][0][0], groups[-1][0][4]) if groups else None


def is_nap(night: Night) -> bool:
    """A nap: less than :data:`NAP_MAX_H` asleep, lying wholly between 10:00 and 20:00 local
    time of one day (:data:`NAP_DAY_S`), by its window (known even where its bedtime is
    not).  A shift worker's day sleep is a night by its length; a short night that begins
    at 06:30 is still a night."""
    if night.begins is None or (night.asleep or 0.0) >= NAP_MAX_H:
        return False
    begins = night.begins // US + night.begins_offset
    ends = night.end // US + night.end_offset
    if begins // 86400 != ends // 86400:
        return False
    return (NAP_DAY_S[0] <= begins % 86400 and ends % 86400 <= NAP_DAY_S[1]
            and ends > begins)


def _sleep_length(night: Night) -> tuple:
    """What makes a day's night its longest sleep: hours asleep, else in bed, else its
    window, then the later end."""
    return (night.asleep or 0.0, night.in_bed or 0.0, night.window or 0.0, night.end)


def nights_of_points(points: Iterable, zone: Zone) -> list:
    """Every date's sleeps from sleep points (:func:`nights_of_spans`, each point's span
    read from its timestamps)."""
    return nights_of_spans(((point_span(point), point) for point in points), zone)


def nights_of_spans(items: Iterable, zone: Zone) -> list:
    """Every date's sleeps (:class:`SleepDay`, by date) from sleep points, by the one
    sleep rule:

    * each nightly record is one sleep (:func:`_nightly_night`), never joined to another;
      the same night sent twice (HAE re-sends a night with ``date`` once the sleep start,
      once the wake time; or sends it while it runs, and again in the morning) counts
      once: the record of the latest end of a sleep start.  A record that starts where
      another ended has no known bedtime: its stage records' span, else none;
    * stage records less than :data:`NIGHT_GAP_US` apart are one sleep (:func:`_record_night`);
    * a date with nightly records takes the sleeps they make, else those of its stage
      records; of them, naps (:func:`is_nap`) are never its night; its night is its longest
      other sleep, every other sleep is a nap beside it; a date of naps only has no night."""
    nightly: dict = {}
    stage_records = []
    for span, point in items:
        stage = sleep_stage(point.get("value"))
        if stage is not None:
            start, end = span or (None, None)
            if start is None or end is None or end <= start:
                continue
            raw_end = point.get("end") or point.get("endDate") or raw_start(point)
            stage_records.append((start, end, stage, raw_end, raw_start(point),
                                  _sources(point.get("source"))))
            continue
        sleep = _nightly_sleep(point, zone)
        if sleep is not None:  # one night, however often sent: the latest end wins
            key = sleep.end if sleep.start is None else sleep.start
            rank = (sleep.end, len(content_keys(point)))
            known = nightly.get(key)
            if known is None or rank >= known[1]:
                nightly[key] = (sleep, rank)
    stage_records.sort()
    starts = [record[0] for record in stage_records]
    ends = {sleep.end for sleep, _ in nightly.values()}
    by_date: dict = {}
    for sleep, _ in nightly.values():
        night = _nightly_night(sleep, local_ordinal(sleep.end, sleep.end_offset))
        if sleep.start is not None and sleep.start in ends:  # HAE's boundary, no bedtime
            span = _stages_span(stage_records, starts, sleep)
            night.start = None if span is None else span[0]
            night.start_offset = (night.start_offset if span is None
                                  else zone.point_offset(span[1], span[0]))
        by_date.setdefault(night.date, ([], [], []))[0].append(night)
    for group in _record_clusters(stage_records):
        night = _record_night(group, zone)
        by_date.setdefault(night.date, ([], [], []))[1].append(night)
    days = []
    for date in sorted(by_date):
        from_nightly, from_records, _ = by_date[date]
        sleeps = from_nightly or from_records
        others = [sleep for sleep in sleeps if not is_nap(sleep)]
        night = max(others, key=_sleep_length) if others else None
        days.append(SleepDay(date, night, sorted((sleep for sleep in sleeps
                                                 if sleep is not night),
                                                key=lambda sleep: sleep.end),
                             from_records))
    return days


def _sleep_points(conn: sqlite3.Connection, query: PointQuery) -> Iterator[tuple]:
    """((start, end), point) of the sleep points a range's nights are made of: from three
    days before its start (a night's window and the record it starts at may begin that
    long before it ends); the spans the store keeps, never parsed again."""
    widened = _replace(query, start=None if query.start is None
                                  else query.start - 3 * 86400 * US, day_from=None,
                                  day_to=None)
    for _, coord, point in iter_points(conn, widened):
        yield (coord[0], coord[1]), point


def sleep_nights(conn: sqlite3.Connection, query: PointQuery) -> list:
    """The sleep days (:class:`SleepDay`) whose sleeps end in the range, one per local
    date, by the one sleep rule (:func:`nights_of_spans`)."""
    return [day for day in nights_of_spans(_sleep_points(conn, query), query.zone)
            if _day_in_range(day, query)]


def _day_in_range(day: SleepDay, query: PointQuery) -> bool:
    end = day.end
    if query.start is not None and query.day_from is None and end < query.start:
        return False
    if query.end is not None and query.day_to is None and end >= query.end:
        return False
    return ((query.day_from is None or day.date >= query.day_from)
            and (query.day_to is None or day.date < query.day_to))


def sleep_wake_days(conn: sqlite3.Connection, zone: Zone, low_us: int, high_us: int) -> set:
    """The local date ordinals between two instants on which a night ended (a date of naps
    only has none): the coverage calendar's sleep row, counted on the wake day."""
    query = PointQuery(SLEEP_METRIC, RECORD_LAYER, low_us, high_us, zone=zone)
    return {day.date for day in sleep_nights(conn, query) if day.night is not None}


def _local_text(instant: Optional[int], offset: int) -> Optional[str]:
    return None if instant is None else local_iso(instant, offset)


def _nap_item(nap: Night) -> dict:
    return {"sleep_start": _local_text(nap.start, nap.start_offset),
            "sleep_end": local_iso(nap.end, nap.end_offset),
            "date": _dt.date.fromordinal(nap.date).isoformat(),
            "asleep": nap.asleep, "in_bed": nap.in_bed, "overlapping": nap.overlapping}


def _night_words(night: Optional[Night]) -> dict:
    """What a day's night says of how it was counted (``counted``, ``said``, ``limit``,
    ``limit_by``, ``scaled``) and who wrote it (``sources``, the names its records give)."""
    if night is None:
        return {"counted": None, "said": None, "limit": None, "limit_by": None,
                "scaled": False, "sources": []}
    return {"counted": night.counted, "said": night.said, "limit": night.limit,
            "limit_by": night.limit_by, "scaled": night.scaled,
            "sources": list(night.sources)}


def in_stage_order(stages: dict) -> dict:
    """A night's stage hours in the order of the sleep meaning (:data:`STAGE_ORDER`):
    deepest first, awake last; a stage outside it after them, by name."""
    return {**{stage: stages[stage] for stage in STAGE_ORDER if stage in stages},
            **{stage: stages[stage] for stage in sorted(stages) if stage not in STAGE_ORDER}}


def stage_order_json() -> list:
    """The stages as a reply that lists nights carries them (``stage_order``): in their
    order, with their labels (:data:`SLEEP_STAGES`)."""
    return [stage.as_json() for stage in SLEEP_STAGES]


def _mean(values: list) -> Optional[float]:
    known = [value for value in values if value is not None]
    return sum(known) / len(known) if known else None


def sleep_average(days: list) -> dict:
    """The average night of a range: the mean of its nights (never of weeks' means, never
    a nap), and how many there are."""
    nights = [day.night for day in days if day.night is not None]
    return {"nights": len(nights), "asleep": _mean([n.asleep for n in nights]),
            "in_bed": _mean([n.in_bed for n in nights])}


def sleep_buckets(days: list, query: PointQuery) -> list:
    """Day buckets (the day's night, its naps beside it; a day of naps only: no night, 0
    ``nights``) or week buckets (the mean of the nights there are; the naps listed, never
    averaged in), in the reply's shape."""
    groups: dict = {}
    for day in days:
        key = day.date if query.bucket == "day" else day.date - (day.date - 1) % 7
        groups.setdefault(key, []).append(day)
    out = []
    for key in sorted(groups):
        members = groups[key]
        nights = [day.night for day in members if day.night is not None]
        naps = [nap for day in members for nap in day.naps]
        stages: dict = {}
        for night in nights:
            for stage, hours in night.stages.items():
                stages[stage] = stages.get(stage, 0.0) + hours / len(nights)
        sleeps = nights or naps
        first = min(sleeps, key=lambda n: n.end)
        bucket = _Bucket(count=len(sleeps), first=first.end, offset=first.end_offset)
        item = _bucket_place(query, key, bucket)
        forms = {sleep.form for sleep in sleeps}
        item.update({"count": len(nights) + len(naps), "nights": len(nights),
                     "asleep": _mean([n.asleep for n in nights]),
                     "in_bed": _mean([n.in_bed for n in nights]),
                     "stages": in_stage_order(stages),
                     "form": forms.pop() if len(forms) == 1 else "mixed",
                     "overlapping": sum(n.overlapping for n in nights),
                     "naps": [_nap_item(nap) for nap in naps]})
        if query.bucket == "day":
            night = nights[0] if nights else None
            item["sleep_start"] = None if night is None else _local_text(
                night.start, night.start_offset)
            item["sleep_end"] = None if night is None else local_iso(night.end,
                                                                     night.end_offset)
            item["overlapping"] = bool(night and night.overlapping)
            item.update(_night_words(night))
        out.append(item)
    return out


class SleepDates:
    """The local date each sleep point belongs to, as the page dates it: a nightly record's
    own end (``sleepEnd``, else ``inBedEnd``, else ``date``), a stage record's sleep's end
    (else its own); so that exports date a sleep row on its wake day, not by HAE's ``date``
    (the sleep start the evening before on 43 of 91 real nights of one person)."""

    def __init__(self, days: list, zone: Zone):
        sleeps = sorted((sleep for day in days for sleep in day.clusters),
                        key=lambda sleep: sleep.begins)
        self._starts = [sleep.begins for sleep in sleeps]
        self._sleeps = sleeps
        self._zone = zone

    @classmethod
    def read(cls, conn: sqlite3.Connection, query: PointQuery) -> "SleepDates":
        return cls(sleep_nights(conn, query), query.zone)

    def of(self, point: dict, coord: tuple) -> Optional[int]:
        """The local date ordinal of a sleep point, or None when it is no sleep."""
        if sleep_stage(point.get("value")) is None:
            sleep = _nightly_sleep(point, self._zone)
            return None if sleep is None else local_ordinal(sleep.end, sleep.end_offset)
        at = bisect.bisect_right(self._starts, coord[0]) - 1
        if at >= 0 and coord[0] < self._sleeps[at].end:  # the sleep its records make
            return self._sleeps[at].date
        raw_end = point.get("end") or point.get("endDate") or raw_start(point)
        return local_ordinal(coord[1], self._zone.point_offset(raw_end, coord[1]))


def _sleep_json(days: list, query: PointQuery) -> Iterator[bytes]:
    head = _json_bytes(_head(query))
    yield (head[:-1] + b',"units":"hr","stage_order":' + _json_bytes(stage_order_json())
           + b',"average":' + _json_bytes(sleep_average(days))
           + b',"nights":' + _json_bytes(sleep_buckets(days, query)) + b"}")


def _sleep_csv(days: list, query: PointQuery) -> Iterator[bytes]:
    buckets = sleep_buckets(days, query)
    shown = [stage for stage in SLEEP_STAGES
             if any(stage.stage in item["stages"] for item in buckets)]
    stages = [stage.stage for stage in shown]
    columns = ["start", "local", "date", "count", "nights", "asleep", "in_bed"] + [
        "unspecified" if stage.unspecified else stage.stage for stage in shown]  # one name each
    if query.bucket == "day":
        columns += ["sleep_start", "sleep_end", "form", "counted", "scaled"]
    columns += ["overlapping", "naps", "nap_hours"]

    def rows() -> Iterator[list]:
        yield columns
        for item in buckets:
            row = [item["start"], item["local"], item["date"], item["count"], item["nights"],
                   _csv_cell(item["asleep"]), _csv_cell(item["in_bed"])]
            row += [_csv_cell(item["stages"].get(stage)) for stage in stages]
            if query.bucket == "day":
                row += [item["sleep_start"] or "", item["sleep_end"] or "", item["form"],
                        item["counted"] or "", int(item["scaled"])]
            nap_hours = [nap["asleep"] for nap in item["naps"] if nap["asleep"] is not None]
            row += [int(item["overlapping"]), len(item["naps"]),
                    _csv_cell(sum(nap_hours) if nap_hours else None)]
            yield row

    yield from _csv_lines(rows())


# -- records: workouts, ECG recordings and events as lists, newest first --------------

RECORDS_LIMIT = (50, 500)
"""Records per page: default and maximum."""


def _quantity(value: Any) -> Optional[dict]:
    """``{qty, units}`` as HAE writes a measured amount, when it is one."""
    if type(value) is dict and type(value.get("qty")) in (int, float):
        return {"qty": value["qty"], "units": value.get("units")}
    return None


def workout_item(point: dict, coord: tuple) -> dict:
    """A workout of either export version: version 2 has ``id`` and ``duration`` (seconds),
    ``activeEnergyBurned`` and a ``heartRate`` object (its average and highest); version 1
    has neither id nor duration (it is the span), and ``activeEnergy``/``totalEnergy`` as
    amounts."""
    duration = point.get("duration")
    if type(duration) not in (int, float) or duration <= 0:
        duration = (coord[1] - coord[0]) / US if coord[1] > coord[0] else None
    energy = (_quantity(point.get("activeEnergyBurned")) or _quantity(point.get("activeEnergy"))
              or _quantity(point.get("totalEnergy")))
    heart = point.get("heartRate") if type(point.get("heartRate")) is dict else {}
    average = _quantity(heart.get("avg")) or _quantity(point.get("avgHeartRate"))
    highest = _quantity(heart.get("max")) or _quantity(point.get("maxHeartRate"))
    name = point.get("name")
    distance = _quantity(point.get("distance"))
    for amount in (energy, distance, average, highest):
        if amount is not None:
            amount["unit_label"] = unit_label("workouts", amount["units"])
    return {"name": name if type(name) is str else None, "duration_s": duration,
            "energy": energy, "distance": distance,
            "average_heart_rate": average, "max_heart_rate": highest,
            "location": point.get("location") if type(point.get("location")) is str else None,
            "version": 2 if "duration" in point or "id" in point else 1}


def ecg_item(point: dict, coord: tuple) -> dict:
    """An ECG recording without its samples (``/api/ecg`` gives those)."""
    samples = point.get("voltageMeasurements")
    frequency = point.get("samplingFrequency")
    return {"classification": point.get("classification"),
            "average_heart_rate": point.get("averageHeartRate"),
            "sampling_frequency": frequency if type(frequency) in (int, float) else None,
            "samples": len(samples) if type(samples) is list else 0}


def event_item(point: dict, meaning: Meaning) -> dict:
    """An event: the fields its meaning names, as they are."""
    return {"details": {name: point[name] for name in meaning.fields if name in point}}


def records(conn: sqlite3.Connection, args: Mapping[str, Optional[str]]) -> dict:
    """``GET /api/records``: the points of a workouts, ECG or events metric as a list,
    newest first, each with its start in UTC and in local time (``tz``) and its local
    date; paged by ``limit`` and ``before`` (a start, as ``next_before`` gives it)."""
    query = point_query(conn, dict(args, bucket=None, format=None))
    meaning = meaning_of(query.metric)
    if meaning.kind not in ("workouts", "ecg", "events"):
        raise BadRequest("%s is a series: ask /api/points" % loggable_metric(query.metric))
    limit = _whole_number("limit", args.get("limit"), RECORDS_LIMIT[0], RECORDS_LIMIT[1])
    # ``before``: a start, or the cursor next_before gives (start|end|category): the items
    # before it in (start, end, category) order, so that no record of a start shared by
    # two pages is lost between them
    start_text, _, rest = (args.get("before") or "").partition("|")
    before = _query_time("before", start_text)
    cursor = None
    if before is not None and rest:
        end_text, _, category = rest.partition("|")
        end = _query_time("before", end_text)
        if end is None:
            raise BadRequest("before is not a cursor next_before gave")
        cursor, before = (before, end, category), before + 1
    if before is not None:
        query = _replace(query, end=before if query.end is None else min(query.end, before))
    items: list = []
    coords: list = []
    for _, coord, point in iter_points_newest(conn, query):
        if cursor is not None and coord >= cursor:
            continue  # shown on an earlier page: the same start, a later end or category
        if len(items) == limit + 1:
            break
        offset = query.zone.point_offset(raw_start(point), coord[0])
        item = {"start": format_instant(coord[0]),
                "end": format_instant(coord[1]), "local_start": local_iso(coord[0], offset),
                "date": _dt.date.fromordinal(local_ordinal(coord[0], offset)).isoformat()}
        if meaning.kind == "workouts":
            item.update(workout_item(point, coord))
        elif meaning.kind == "ecg":
            item.update(ecg_item(point, coord))
        else:
            item.update(event_item(point, meaning))
        items.append(item)
        coords.append(coord)
    more = len(items) > limit
    items = items[:limit]
    last = coords[limit - 1] if more else None
    return {"metric": query.metric, "kind": meaning.kind, "tz": query.zone.name,
            "items": items, "next_before": None if last is None else "%s|%s|%s" % (
                format_instant(last[0]), format_instant(last[1]), last[2])}


def iter_points_newest(conn: sqlite3.Connection, query: PointQuery) -> Iterator[tuple]:
    """:func:`iter_points`, newest first (an object at a time: a page of a year of workouts
    decodes only the hours it shows)."""
    low = -(1 << 62) if query.start is None else query.start // HOUR_US
    high = (1 << 62) if query.end is None else (query.end - 1) // HOUR_US
    for units, blob in conn.execute(
            "SELECT units, blob FROM object WHERE metric = ? AND layer = ? AND hour BETWEEN"
            " ? AND ? ORDER BY hour DESC", (query.metric, query.layer, low, high)):
        found = []
        READ_DECODES.check()
        for point in loads_body(_read_blob(blob)):
            coord = point_coordinate(point) if type(point) is dict else None
            if _coord_in_range(coord, query, point):
                found.append((units, coord, point))
        yield from reversed(found)  # stored in time order


# -- the view's plan: which layer and bucket answer a range, decided once -------------

VIEW_RANGES = {"24h": 1, "7d": 7, "30d": 30, "1y": 365}
"""The page's ranges and their days; ``all`` and ``custom`` (``from``/``to`` dates, both
shown) besides."""
HOUR_MAX_DAYS = 2
"""Series are drawn per hour for ranges of two days or less (never finer than the layer's
own grouping: a metric that arrives once a day stays per day)."""
DAY_MAX_DAYS = 186
"""Per day up to half a year, per week beyond."""
DAY_ONLY_LAYERS = ("days", "weeks", "months", "years")
"""Layers whose points each stand for a whole day or more: never bucketed per hour."""
_BUCKET_WORDS = {"hour": "per hour", "day": "per day", "week": "per week"}


def _newest(conn: sqlite3.Connection, metric: str, layer: str, zone: Zone) -> Optional[tuple]:
    """(instant, offset) of the newest point of a metric's layer, as the view's zone sees
    it (``tz=local``: the offset written in the point)."""
    for _, coord, point in iter_points_newest(conn, PointQuery(metric, layer)):
        return coord[0], zone.point_offset(raw_start(point), coord[0])
    return None


def _view_day_text(ordinal: int) -> str:
    """``Mon 3 Mar 2025``."""
    day = _dt.date.fromordinal(ordinal)
    return "%s %d %s %d" % (day.strftime("%a"), day.day, day.strftime("%b"), day.year)


def plan_view(conn: sqlite3.Connection, args: Mapping[str, Optional[str]]) -> dict:
    """``GET /api/plan?metric=&range=&tz=[&layer=][&from=&to=]``: what the metric view
    reads and draws for a range, decided here and nowhere else: the layer (the one whose
    newest point is newest anchors the range, the one answering it best is read), the
    bucket (per hour up to two days, per day up to half a year, per week beyond; never finer
    than the layer: day data on a 24 h range is one day; lists get the days or weeks their
    chart counts by), the bounds to ask for, the query that reads it (``points``:
    ``/api/points``' parameters, the layers named as they are to be read, the chosen one
    first, then those that fill the days it lacks) and the words the page shows for all of
    it."""
    metric = args.get("metric")
    if not metric:
        raise BadRequest("metric is required; see /api/catalog")
    view = args.get("range") or "7d"
    if view not in VIEW_RANGES and view not in ("all", "custom"):
        raise BadRequest("range must be one of %s, all or custom" % ", ".join(VIEW_RANGES))
    zone = parse_zone(args.get("tz"))
    hours = layer_hours(conn, metric)
    layers = {layer: last for layer, (_, last) in hours.items()}
    if not layers:
        raise UnknownMetric([loggable_metric(name) for name in stored_metrics(conn)])
    asked = args.get("layer") or None
    if asked is not None and asked not in layers:
        raise UnknownLayer("%s has no data in that layer; it has %s"
                           % (loggable_metric(metric), ", ".join(sorted(layers))))
    meaning = meaning_of(metric)
    kind = meaning.kind
    series = meaning.drawn == "series"
    anchor_layer = asked or max(layers, key=lambda name: (layers[name], -LAYER_ORDER.index(
        name) if name in LAYER_ORDER else 0))
    plan: dict = {"metric": metric, "range": view, "tz": zone.name, "kind": kind}
    if view == "custom":
        day_from, last = read_day("from", args.get("from")), read_day("to", args.get("to"))
        if day_from is None or last is None or day_from > last:
            raise BadRequest("a custom range wants from and to as days YYYY-MM-DD, from on or"
                             " before to, both %s" % READ_DAYS)
        day_to = last + 1
        days = day_to - day_from
    elif view == "all":
        first_hour = min(first for first, _ in hours.values())
        days = (max(layers.values()) - first_hour) / 24 + 1
        day_from = day_to = None
    else:
        days = VIEW_RANGES[view]
        newest = _newest(conn, metric, anchor_layer, zone)
        if newest is None:
            raise UnknownMetric([loggable_metric(metric)])
        anchor_day = local_ordinal(*newest)
        if kind == "sleep":  # a night is on the morning it ended
            nights = [day for day in sleep_nights(conn, PointQuery(
                metric, anchor_layer, start=newest[0] - 2 * 86400 * US,
                end=newest[0] + 2 * 86400 * US, zone=zone)) if day.night is not None]
            anchor_day = nights[-1].date if nights else anchor_day
        day_to = anchor_day + 1
        day_from = day_to - days
        plan["anchor"] = {"date": _dt.date.fromordinal(anchor_day).isoformat(),
                          "local": local_iso(*newest)}

    def read_layer(first: Optional[str], last: Optional[str]) -> str:
        """The layer /api/points picks for these bounds (the same rule, the same bounds)."""
        start = _query_bound("from", first, zone, is_end=False)[0]
        end = _query_bound("to", last, zone, is_end=True)[0]
        return asked or _finest_layer(conn, metric, list(layers), start, end)

    def dates(first: Optional[int], end: Optional[int]) -> tuple:
        """The bounds of the dates [first, end) as the routes read dates: ``to`` is the
        last day, included."""
        return (None if first is None else read_day_text(first),
                None if end is None else read_day_text(end - 1))

    layer = read_layer(*dates(day_from, day_to))
    bucket = ("hour" if series and days <= HOUR_MAX_DAYS and layer not in DAY_ONLY_LAYERS
              else "day" if days <= DAY_MAX_DAYS else "week")  # lists: their chart's days
    if bucket == "week" and day_from is not None and view != "custom":
        day_from -= (day_from - 1) % 7  # weeks start on Monday
    bounds = dates(day_from, day_to)
    span = ("all stored data" if day_from is None else _view_day_text(day_from)
            if day_to - day_from == 1 else "%s – %s" % (_view_day_text(day_from),
                                                       _view_day_text(day_to - 1)))
    if bucket == "hour" and view == "24h":
        newest = _newest(conn, metric, layer, zone) or newest
        t1 = (newest[0] // HOUR_US + 1) * HOUR_US
        hours = (format_instant(t1 - 24 * HOUR_US), format_instant(t1))
        if read_layer(*hours) not in DAY_ONLY_LAYERS:
            bounds, layer = hours, read_layer(*hours)
            span = "24 hours to %s" % local_iso(t1, newest[1])[11:16]
        else:  # the last 24 hours hold only day data: the day it is
            bucket = "day"
    day_only = layer in DAY_ONLY_LAYERS
    plan.update(layer=layer, bucket=bucket, axis="hours" if bucket == "hour" else "dates",
                **{"from": bounds[0], "to": bounds[1]})
    # what /api/points is asked (it reads the layers as named: no second decision): the
    # layer chosen, and when none was asked, the layers that fill the days it lacks, as
    # point_query fills them; a list's records, its CSV, have no bucket
    read = (layer,)
    if asked is None and meaning.drawn != "list" and bucket != "hour":
        read = _filling(layer, list(layers)) or read
    plan["points"] = {"metric": metric, "layer": ",".join(read), "from": bounds[0],
                      "to": bounds[1], "tz": zone.name}
    if meaning.drawn != "list":
        plan["points"]["bucket"] = bucket
    words = [span]
    if series:
        words.append("%s %s" % ("totals" if kind == "total" else "averages",
                                _BUCKET_WORDS[bucket]))
    elif kind == "sleep":
        words.append("one bar per night" if bucket == "day" else "the average night per week")
    if day_only and series and days <= HOUR_MAX_DAYS:
        words.append("this metric arrives once a day, so it is shown per day")
    words.append("read from the %s layer" % layer)
    plan["words"] = " · ".join(words)
    return plan


def ecg_trace(conn: sqlite3.Connection, args: Mapping[str, Optional[str]]) -> dict:
    """``GET /api/ecg?start=…``: the recording that starts then, with its voltages in the
    order they were measured, at its sampling frequency."""
    start = _query_time("start", args.get("start"))
    if start is None:
        raise BadRequest("start is required: a recording's start, as /api/records lists it")
    zone = parse_zone(args.get("tz"))
    query = PointQuery("ecg", RECORD_LAYER, start, start + 1, zone=zone)
    for _, coord, point in iter_points(conn, query):
        readings = [item for _, item in ecg_readings(point)]
        units = {item.get("units") for item in readings if type(item.get("units")) is str}
        offset = zone.point_offset(raw_start(point), coord[0])
        trace = dict(ecg_item(point, coord), start=format_instant(coord[0]),
                    local_start=local_iso(coord[0], offset),
                    units=units.pop() if len(units) == 1 else None,
                    voltages=[item["voltage"] for item in readings])
        trace["unit_label"] = unit_label("ecg", trace["units"])
        return trace
    raise NotFound("no ECG recording starts then")


# -- the journal: what arrived and what became of it, a page at a time ---------------

DELIVERY_FIELDS = ("id", "received_at", "body_bytes", "automation_name", "automation_id",
                   "automation_aggregation", "path_name", "parse_status", "layer", "error",
                   "uncovered_keys", "folded_at") + _COUNTERS


def deliveries(conn: sqlite3.Connection, args: Mapping[str, Optional[str]]) -> dict:
    """A page of the journal, newest first: what arrived and what became of it, never a
    body or a value."""
    status = args.get("status") or None
    if status is not None and status not in STATUSES:
        raise BadRequest("status must be one of " + ", ".join(STATUSES))
    limit = _whole_number("limit", args.get("limit"), DELIVERIES_LIMIT[0], DELIVERIES_LIMIT[1])
    before = args.get("before")
    where, values = [], []
    if status is not None:
        where.append("parse_status = ?")
        values.append(status)
    if before:
        anchor_id = _whole_number("before", before, 0, 1 << 62)
        anchor = conn.execute("SELECT received_at FROM delivery WHERE id = ?",
                              (anchor_id,)).fetchone()
        if anchor is None:
            raise BadRequest("before names no delivery")
        where.append("(received_at < ? OR (received_at = ? AND id < ?))")
        values += [anchor[0], anchor[0], anchor_id]
    rows = conn.execute(
        "SELECT %s FROM delivery%s ORDER BY received_at DESC, id DESC LIMIT ?"
        % (", ".join(DELIVERY_FIELDS), " WHERE " + " AND ".join(where) if where else ""),
        values + [limit + 1]).fetchall()
    items = []
    for row in rows[:limit]:
        item = dict(zip(DELIVERY_FIELDS, row))
        item["status"] = item.pop("parse_status")
        item["uncovered_keys"] = json.loads(item["uncovered_keys"] or "[]")
        if item["status"] == "failed" and worth_retrying(item["error"]):
            item["remedy"] = ("the machine, not the body, may have caused this (a disk not"
                              " mounted, memory): `healthlog refold %d` folds it again"
                              % item["id"])
        for name in ("received_at", "folded_at"):
            item[name] = journal_time(item[name])
        items.append(item)
    return {"deliveries": items,
            "next_before": items[-1]["id"] if len(rows) > limit else None}


def _whole_number(name: str, text: Optional[str], default: int, high: int) -> int:
    if text is None or text == "":
        return default
    if not re.fullmatch(r"[0-9]{1,18}", text):
        raise BadRequest("%s must be a whole number" % name)
    value = int(text)
    if not 1 <= value <= high:
        raise BadRequest("%s must be between 1 and %d" % (name, high))
    return value


# ==============================================================================
# Workouts: a list, one workout whole: its figures, heart rate, route and splits.
# ==============================================================================
# The functions below take a connection and plain parameters and return plain dicts: the
# routes (/api/workouts, /api/workouts/<id>), the GPX and SQLite exports and any other
# reader answer from them alone (workouts spec).

WORKOUT_METRIC = "workouts"
HEART_RATE_METRIC = "heart_rate"
ROUTE_DRAW_MAX = 2000
"""Route points a workout's answer carries for drawing, at most: a longer route is thinned on
the server (every n-th point, the first and the last kept), so that a two-day route of
193,000 points answers in the size of an hour's run; the whole route stays in the store, the
GPX and the SQLite export, and the bounds and figures are the whole route's."""
HEART_DRAW_MAX = 1000
"""Heart-rate samples drawn, at most: a longer series is drawn in runs of consecutive samples
(the first's time, their mean, lowest and highest)."""
HEART_NEAREST_S = 5.0
"""A route point's heart rate is the workout's sample nearest to it in time, when one is
within this many seconds (the page's colours, the GPX's ``gpxtpx:hr``): HAE's Seconds
grouping sends one every few seconds; nothing is interpolated across a gap."""
HEART_HOLD_S = 60.0
"""A heart-rate sample stands for the time until the next one, at most this long: HAE's
Minutes grouping sends one a minute; a longer gap is time without heart rate, never filled
(zones; the GPX takes the nearest sample within :data:`HEART_NEAREST_S`)."""
ELEVATION_STEP_M = 3.0
"""A route's altitude counts as a climb or a descent once it has moved this far from the last
turning point: GPS altitude wanders a metre or two between seconds, and adding every rise of
a flat run's route counted hundreds of metres."""
SPEED_WINDOW_S = 10.0
"""A drawn route point's speed is that of the last 10 seconds at least (of the stretch since
the point drawn before it, when longer): GPS positions a second apart make a speed that
jumps by a third from one second to the next."""
SPLIT_MIN_M = 10.0
"""A last, partial split shorter than this is left out: a pace over a few metres means
nothing."""
DUPLICATE_OVERLAP = 0.8
"""Two workouts of one activity are one, recorded twice, when their times overlap by at least
this share of the longer one (openspec/decisions.md: the same workout from the Watch and
another app)."""
DUPLICATE_MARGIN_S = 6 * 3600
"""Workouts this far outside a range are read too, to find the duplicates of those inside it
(a workout overlapping 80 % of another starts within a fifth of its length)."""
WORKOUTS_LIST_MAX = 1000
"""Workouts one list answers, newest first; a longer range says ``truncated``."""
EARTH_RADIUS_M = 6371008.8
"""The mean Earth radius (IUGG): distances along a route by the haversine formula."""
HEART_YEAR_S = 365 * 86400
"""Zones without the owner's maximum take the highest heart rate of this long before the
workout's end."""
HEART_ZONES = ((1, 0.5), (2, 0.6), (3, 0.7), (4, 0.8), (5, 0.9))
"""Heart-rate zones: each from this share of the maximum up to the next zone's share."""

DISTANCE_METERS = {"m": 1.0, "km": 1000.0, "mi": 1609.344, "yd": 0.9144, "ft": 0.3048,
                   "cm": 0.01}
"""Meters in each distance unit HAE sends (``distance``, ``elevationUp``, series)."""

UNIT_SYSTEMS = {
    "km": {"distance": ("km", 1000.0), "short": ("m", 1.0), "elevation": ("m", 1.0),
           "speed": ("km/h", 1000.0 / 3600), "swim": ("100 m", 100.0)},
    "mi": {"distance": ("mi", 1609.344), "short": ("ft", 0.3048), "elevation": ("ft", 0.3048),
           "speed": ("mph", 1609.344 / 3600), "swim": ("100 yd", 91.44)},
}
"""How distances are counted and written, by the owner's units (:func:`owner_units`): each
unit's label and its size in meters (speed: in meters per second)."""

ACTIVITIES = (
    # (activity, how its pace is read, whole words of its names, parts of its names)
    ("running", "pace", ("run", "running", "jog", "jogging", "course", "laufen", "lauf",
                         "carrera", "corsa", "corrida", "hardlopen"), ("跑",)),
    ("walking", "pace", ("walk", "walking", "marche", "gehen", "spaziergang", "caminata",
                         "camminata", "wandelen"), ("步行", "散步", "走路")),
    ("hiking", "pace", ("hike", "hiking", "randonnée", "wandern", "senderismo",
                        "escursionismo"), ("徒步", "远足")),
    ("cycling", "speed", ("cycling", "cycle", "bike", "biking", "ride", "vélo", "cyclisme",
                          "radfahren", "ciclismo", "fietsen"), ("骑行", "自行车", "单车")),
    ("swimming", "swim", ("swim", "swimming", "natation", "schwimmen", "natación", "nuoto",
                          "zwemmen"), ("游泳",)),
)
"""Activities whose pace or speed is read their own way, by the words of a workout's name as
HAE sends it (localised: Apple's English names and some of their translations); a workout at
a ``Pool`` or in ``Open Water``, or with swimming or cycling fields, is known by those.  Any
other activity shows its speed."""

_ACTIVITY_SERIES = {"running": "walkingAndRunningDistance", "walking": "walkingAndRunningDistance",
                    "hiking": "walkingAndRunningDistance", "cycling": "cyclingDistance",
                    "swimming": "swimDistance"}
"""The distance series (``Include Workout Metrics``) that splits use where there is no route."""


@dataclass
class StoredWorkout:
    """One stored workout: its id, coordinate, verbatim point (long arrays of a large one
    left in a scratch file, :class:`Deferred`) and the hour of its object."""

    id: str
    coord: tuple
    point: dict
    hour: int


def _number(value: Any) -> Optional[float]:
    return float(value) if type(value) in (int, float) and math.isfinite(value) else None


def _compact_instant(instant_us: int) -> str:
    """``20250503T051000Z`` (a fraction when there is one): an instant inside an id."""
    return format_instant(instant_us).replace("-", "").replace(":", "")


_COORD_ID = re.compile(r"([0-9]{8}T[0-9]{6}(?:\.[0-9]{1,6})?Z)_([0-9]{8}T[0-9]{6}"
                       r"(?:\.[0-9]{1,6})?Z)")
_HAE_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,99}")


def workout_id(point: dict, coord: tuple) -> str:
    """A workout's id: HAE's ``id`` (version 2's HealthKit UUID) where it is URL-safe, else
    its start and end in UTC (``20250503T051000Z_20250503T054130Z``): stable, URL-safe, and
    the coordinate it is stored at."""
    sent = point.get("id")
    if type(sent) is str and _HAE_ID.fullmatch(sent) and not _COORD_ID.fullmatch(sent):
        return sent
    return "%s_%s" % (_compact_instant(coord[0]), _compact_instant(coord[1]))


def _id_instants(ident: str) -> Optional[tuple]:
    """(start, end) of an id made of a coordinate, else None."""
    match = _COORD_ID.fullmatch(ident)
    if not match:
        return None
    out = []
    for text in match.groups():
        whole, _, fraction = text[:-1].partition(".")
        moment = _dt.datetime.strptime(whole, "%Y%m%dT%H%M%S").replace(
            tzinfo=_dt.timezone.utc)
        seconds = (moment - _dt.datetime(1970, 1, 1, tzinfo=_dt.timezone.utc)
                   ) // _dt.timedelta(seconds=1)
        out.append(seconds * US + int((fraction or "0").ljust(6, "0")))
    return tuple(out)


def _series(point: dict, key: str) -> Any:
    """A member holding a series (a list, or a large record's :class:`Deferred`), else ()."""
    value = point.get(key)
    return value if type(value) is list or type(value) is Deferred else ()


def workout_activity(point: dict) -> str:
    """What the workout is (:data:`ACTIVITIES`): by the words of its name, else where it took
    place (``Pool``, ``Open Water``), else its swimming or cycling fields; ``other`` else."""
    name = point.get("name") if type(point.get("name")) is str else ""
    lowered = name.lower()
    words = set(re.findall(r"[^\W\d_]+", lowered))
    for activity, _, whole, parts in ACTIVITIES:
        if words & set(whole) or any(part in lowered for part in parts):
            return activity
    if point.get("location") in ("Pool", "Open Water"):
        return "swimming"
    if _series(point, "swimDistance") or _series(point, "swimStroke") or point.get(
            "lapLength") or (_quantity(point.get("totalSwimmingStrokeCount")) or {}).get("qty"):
        return "swimming"
    if _series(point, "cyclingDistance") or _series(point, "cyclingSpeed"):
        return "cycling"
    return "other"


def _pace_kind(activity: str) -> str:
    for name, kind, _, _ in ACTIVITIES:
        if name == activity:
            return kind
    return "speed"


def owner_units(point: dict, setting: Optional[str] = None) -> str:
    """``km`` or ``mi``: the setting (``--distance-units``), else the units the workout's
    distance was sent in (miles, yards and feet: ``mi``), else ``km``."""
    if setting in UNIT_SYSTEMS:
        return setting
    distance = _quantity(point.get("distance"))
    return "mi" if distance is not None and distance["units"] in ("mi", "yd", "ft") else "km"


def _meters(amount: Optional[dict]) -> Optional[float]:
    """An amount of distance in meters, when its units are known."""
    if amount is None or amount.get("units") not in DISTANCE_METERS:
        return None
    return amount["qty"] * DISTANCE_METERS[amount["units"]]


# -- a workout's heart rate ---------------------------------------------------------


def heart_samples(items: Any) -> list:
    """[(instant, value, lowest, highest)] of a heart-rate series as HAE sends it, in time
    order: version 2's ``{date, Min, Avg, Max}`` (the value is ``Avg``), version 1's
    ``{date, qty}``; a sample without a time or a value is left out."""
    out = []
    for item in items:
        if type(item) is not dict:
            continue
        instant = parse_time(item.get("date", item.get("start")))
        value = _number(item.get("Avg"))
        if value is None:
            value = _number(item.get("qty"))
        if instant is None or value is None:
            continue
        low, high = _number(item.get("Min")), _number(item.get("Max"))
        out.append((instant, value, value if low is None else low,
                    value if high is None else high))
    out.sort(key=operator.itemgetter(0))
    return out


@dataclass
class WorkoutHeart:
    """A workout's heart rate, kept apart: the ``session`` (samples of ``heartRateData``
    from start to end) and the ``recovery`` (``heartRateRecovery``, and samples of
    ``heartRateData`` after the end); ``state``: ``sent``, ``recovery_only`` (HAE's bug:
    ``heartRateData`` holds only instantaneous samples after the end), ``after_end`` (only
    samples after the end) or ``none``."""

    session: list
    recovery: list
    state: str


def workout_heart(point: dict, coord: tuple) -> WorkoutHeart:
    start, end = coord[0], coord[1]
    data = heart_samples(_series(point, "heartRateData"))
    session = [s for s in data if start <= s[0] <= end]
    after = [s for s in data if s[0] > end]
    seen = {s[0] for s in after}
    recovery = sorted(after + [s for s in heart_samples(_series(point, "heartRateRecovery"))
                               if s[0] not in seen], key=operator.itemgetter(0))
    if session:
        state = "sent"
    elif after and len(after) == len(data):
        state = ("recovery_only" if all(s[1] == s[2] == s[3] for s in after)
                 else "after_end")
    else:
        state = "none"
    return WorkoutHeart(session, recovery, state)


HEART_WORDS = {
    "recovery_only": "The heart rate during this workout was not sent: Health Auto Export"
                     " sent the recovery after it in its place (drawn after the end, as"
                     " recovery).",
    "after_end": "The heart rate during this workout was not sent: every sample sent is"
                 " after its end (drawn after the end).",
    "none": "No heart rate was sent with this workout.",
}


def _has_session_heart(point: dict, coord: tuple) -> bool:
    """Is there a heart-rate sample from start to end (read until the first one)?"""
    for item in _series(point, "heartRateData"):
        if type(item) is dict:
            instant = parse_time(item.get("date", item.get("start")))
            if instant is not None and coord[0] <= instant <= coord[1]:
                return True
    return False


def highest_heart_rate(conn: sqlite3.Connection, end_us: int) -> Optional[float]:
    """The highest heart rate stored in the :data:`HEART_YEAR_S` before ``end_us``, from the
    hours' tallies of the heart-rate metric (its ``Max``, else ``Avg``, else ``qty``)."""
    best = None
    for (tally,) in conn.execute(
            "SELECT summary FROM object WHERE metric = ? AND hour BETWEEN ? AND ?",
            (HEART_RATE_METRIC, (end_us - HEART_YEAR_S * US) // HOUR_US, end_us // HOUR_US)):
        try:
            fields = json.loads(tally)["f"] if tally else {}
        except (ValueError, KeyError, TypeError):
            continue
        for name in ("Max", "Avg", "qty"):
            found = fields.get(name) if type(fields) is dict else None
            if type(found) is list and len(found) > 2 and _number(found[2]) is not None:
                best = found[2] if best is None else max(best, found[2])
                break
    return best


def heart_zones(session: list, end_us: int, maximum: float) -> list:
    """Time in each zone (:data:`HEART_ZONES`) and below the first: each session sample
    stands for the time until the next (the last: until the end), at most
    :data:`HEART_HOLD_S`; its value (``Avg``) decides its zone."""
    zones = [{"zone": 0, "label": "Below zone 1", "low": None,
              "high": HEART_ZONES[0][1] * maximum, "seconds": 0.0}]
    for k, (number, share) in enumerate(HEART_ZONES):
        high = HEART_ZONES[k + 1][1] * maximum if k + 1 < len(HEART_ZONES) else None
        zones.append({"zone": number, "label": "Zone %d" % number, "low": share * maximum,
                      "high": high, "seconds": 0.0})
    for k, (instant, value, _, _) in enumerate(session):
        following = session[k + 1][0] if k + 1 < len(session) else end_us
        held = min(max(following - instant, 0), HEART_HOLD_S * US) / US
        index = 0
        for number, share in HEART_ZONES:
            if value >= share * maximum:
                index = number
        zones[index]["seconds"] += held
    return zones


def _thin_heart(samples: list, origin: int, limit: int) -> list:
    """[[seconds from ``origin``, value, lowest, highest]], in runs of consecutive samples
    when there are more than ``limit``."""
    size = max(1, -(-len(samples) // limit))
    out = []
    for first in range(0, len(samples), size):
        run = samples[first:first + size]
        out.append([(run[0][0] - origin) / US, math.fsum(s[1] for s in run) / len(run),
                    min(s[2] for s in run), max(s[3] for s in run)])
    return out


# -- a workout's route: one pass, whatever its length ---------------------------------


def route_positions(items: Any) -> Iterator[tuple]:
    """(latitude, longitude, altitude or None, instant or None, point) of each route point
    with a position, in the order sent: version 2's ``latitude``/``longitude``, version 1's
    ``lat``/``lon``; ``timestamp`` in any of HAE's time forms."""
    for item in items:
        if type(item) is not dict:
            continue
        lat = _number(item.get("latitude", item.get("lat")))
        lon = _number(item.get("longitude", item.get("lon")))
        if lat is None or lon is None or not (-90 <= lat <= 90 and -180 <= lon <= 180):
            continue
        yield (lat, lon, _number(item.get("altitude")),
               parse_time(item.get("timestamp", item.get("date"))), item)


def haversine_m(lat1: float, lon1: float, lat2: float, lon2: float) -> float:
    """Meters along the Earth's surface between two positions (a sphere of
    :data:`EARTH_RADIUS_M`)."""
    phi1, phi2 = math.radians(lat1), math.radians(lat2)
    half = (math.sin((phi2 - phi1) / 2) ** 2 + math.cos(phi1) * math.cos(phi2)
            * math.sin(math.radians(lon2 - lon1) / 2) ** 2)
    return 2 * EARTH_RADIUS_M * math.asin(min(1.0, math.sqrt(half)))


@dataclass
class RouteWalk:
    """What one pass over a route found: ``count`` points with a position, the bounds
    (south, west, north, east), the meters along it, the climb and descent
    (:data:`ELEVATION_STEP_M`), the split boundaries passed ([(meters, instant or None,
    altitude or None)], the end included), and the points kept for drawing ([instant or
    None, latitude, longitude, altitude, meters so far, meters per second (:func:`_keep`)
    or None])."""

    count: int = 0
    bounds: Optional[list] = None
    meters: float = 0.0
    gain: Optional[float] = None
    loss: Optional[float] = None
    boundaries: list = _field(default_factory=list)
    drawn: list = _field(default_factory=list)


def walk_route(items: Any, split_m: float, draw_max: int = ROUTE_DRAW_MAX) -> RouteWalk:
    """One pass over a route (a list, or a :class:`Deferred` read an element at a time):
    memory bounded by ``draw_max`` and the number of splits, whatever its length."""
    walk = RouteWalk()
    stride = max(1, -(-len(items) // draw_max))
    previous = kept = None
    reference = None  # the altitude of the last turning point (ELEVATION_STEP_M)
    recent: collections.deque = collections.deque()  # (instant, meters) of SPEED_WINDOW_S
    next_split = split_m
    for lat, lon, alt, instant, _ in route_positions(items):
        bounds = walk.bounds
        if bounds is None:
            walk.bounds = [lat, lon, lat, lon]
        else:
            bounds[0], bounds[1] = min(bounds[0], lat), min(bounds[1], lon)
            bounds[2], bounds[3] = max(bounds[2], lat), max(bounds[3], lon)
        if previous is not None:
            step = haversine_m(previous[0], previous[1], lat, lon)
            before = walk.meters
            walk.meters += step
            while step > 0 and walk.meters >= next_split:
                share = (next_split - before) / step
                walk.boundaries.append((next_split, _between(previous[3], instant, share),
                                        _between(previous[2], alt, share)))
                next_split += split_m
        if alt is not None:
            if reference is None:
                reference, walk.gain, walk.loss = alt, 0.0, 0.0
            elif alt - reference >= ELEVATION_STEP_M:
                walk.gain += alt - reference
                reference = alt
            elif reference - alt >= ELEVATION_STEP_M:
                walk.loss += reference - alt
                reference = alt
        previous = (lat, lon, alt, instant)
        walk.count += 1
        if instant is not None:
            recent.append((instant, walk.meters))
            while len(recent) > 1 and recent[1][0] <= instant - SPEED_WINDOW_S * US:
                recent.popleft()
        if (walk.count - 1) % stride == 0:
            kept = _keep(walk, kept, previous, walk.count, recent)
    if previous is not None:
        if kept[6] != walk.count:  # the finish is always drawn
            _keep(walk, kept, previous, walk.count, recent)
        if not walk.boundaries or walk.boundaries[-1][0] < walk.meters:
            walk.boundaries.append((walk.meters, previous[3], previous[2]))
    for point in walk.drawn:
        del point[6:]
    return walk


def _between(a: Optional[float], b: Optional[float], share: float) -> Optional[float]:
    """The value ``share`` of the way from ``a`` to ``b`` along one segment (None when either
    end lacks it: nothing is filled across a gap)."""
    if a is None or b is None:
        return None
    return a + (b - a) * share


def _keep(walk: RouteWalk, kept: Optional[list], here: tuple, number: int,
          recent: collections.deque) -> list:
    """Keep a point for drawing, with its speed over the stretch since the point kept before
    it or :data:`SPEED_WINDOW_S`, whichever is longer (``recent``: the points of that
    window, oldest first)."""
    lat, lon, alt, instant = here
    speed = None
    since = recent[0] if recent else None
    if kept is not None and kept[0] is not None and (since is None or kept[0] < since[0]):
        since = (kept[0], kept[4])
    if since is not None and instant is not None and instant > since[0]:
        speed = (walk.meters - since[1]) / ((instant - since[0]) / US)
    point = [instant, lat, lon, alt, walk.meters, speed, number]
    walk.drawn.append(point)
    return point


def _series_boundaries(items: Any, end_us: int, split_m: float) -> Optional[tuple]:
    """(boundaries, meters) of a distance series (``walkingAndRunningDistance``, …) as
    :func:`walk_route` gives them for a route: each sample's distance is reached at the next
    sample's date (the last: at the workout's end), in between in proportion to time."""
    samples = []
    for item in items:
        if type(item) is dict:
            instant = parse_time(item.get("date", item.get("start")))
            meters = _meters(_quantity(item))
            if instant is not None and meters is not None:
                samples.append((instant, meters))
    if not samples:
        return None
    samples.sort(key=operator.itemgetter(0))
    boundaries, total, next_split = [], 0.0, split_m
    for k, (instant, meters) in enumerate(samples):
        reached = samples[k + 1][0] if k + 1 < len(samples) else max(end_us, instant)
        before = total
        total += meters
        while meters > 0 and total >= next_split:
            share = (next_split - before) / meters
            boundaries.append((next_split, instant + (reached - instant) * share, None))
            next_split += split_m
    if total <= 0:
        return None
    if not boundaries or boundaries[-1][0] < total:
        boundaries.append((total, max(end_us, samples[-1][0]), None))
    return boundaries, total


def workout_splits(boundaries: list, start_us: int, split_m: float, heart: list) -> list:
    """The splits between boundaries ([(meters, instant, altitude)]), from the start: each
    with its meters, seconds, pace (seconds per ``split_m``), mean heart rate of the session
    samples inside it and change of altitude; a last split shorter than
    :data:`SPLIT_MIN_M` is left out."""
    times = [s[0] for s in heart]
    rows = []
    meters, instant, altitude = 0.0, start_us, None
    for number, (reach, reached, alt) in enumerate(boundaries, 1):
        length = reach - meters
        if length < SPLIT_MIN_M and number == len(boundaries) and number > 1:
            break
        seconds = None if reached is None or instant is None else (reached - instant) / US
        inside = heart[bisect.bisect_left(times, instant):bisect.bisect_left(
            times, reached)] if instant is not None and reached is not None else []
        rows.append({
            "split": number, "meters": length, "seconds": seconds,
            "pace_s": None if not seconds or length <= 0 else seconds * split_m / length,
            "average_heart_rate": math.fsum(s[1] for s in inside) / len(inside)
            if inside else None,
            "altitude_change_m": None if alt is None or altitude is None else alt - altitude})
        meters, instant, altitude = reach, reached, alt
    return rows


# -- reading workouts -----------------------------------------------------------------


def _workout_rows(conn: sqlite3.Connection, low_hour: int, high_hour: int,
                  newest_first: bool = False) -> sqlite3.Cursor:
    """(hour, units, blob, spans) of the stored workouts objects of those hours, a row at a
    time (close the cursor when leaving it early: an open statement holds its snapshot)."""
    return conn.execute(
        "SELECT hour, units, blob, spans FROM object WHERE metric = ? AND layer = ? AND hour"
        " BETWEEN ? AND ? ORDER BY hour" + (" DESC" if newest_first else ""),
        (WORKOUT_METRIC, RECORD_LAYER, low_hour, high_hour))


def _workouts_of(row: tuple, scratch: Optional[Path]) -> list:
    """[StoredWorkout] of a stored workouts object, in stored order.  With ``scratch`` (the
    data directory's ``tmp``), an object whose JSON takes :data:`STREAM_FOLD_BYTES` or more
    keeps its long arrays (a route, a heart-rate series) in a scratch file, read an element
    at a time (:class:`Deferred`), as the fold reads it."""
    hour, _, blob, spans = row
    if scratch is not None and _stored_size(blob) >= STREAM_FOLD_BYTES:
        points = _stored_points(_TextFile(scratch, blob))
    else:
        points = loads_body(decompress_blob(blob))
    known = decode_spans(spans, len(points))
    out = []
    for k, point in enumerate(points):
        if type(point) is not dict:
            continue
        if known is not None and known[0][k] != -1:
            coord = (known[0][k], known[1][k], _category(point))
        else:
            coord = point_coordinate(point)
        if coord is not None:
            out.append(StoredWorkout(workout_id(point, coord), coord, point, hour))
    return out


WORKOUT_SEARCH_CHUNK = 1 << 20
"""An id is looked for in a stored object's JSON this many bytes at a time."""


def _blob_holds(blob: bytes, needle: bytes) -> bool:
    """Does a stored object's JSON hold ``needle``?  Inflated a piece at a time: memory stays
    small however large the object."""
    inflate = zlib.decompressobj(31)
    data, carry = blob, b""
    while True:
        piece = inflate.decompress(data, WORKOUT_SEARCH_CHUNK)
        data = inflate.unconsumed_tail
        if needle in carry + piece:
            return True
        carry = (carry + piece)[-len(needle):]
        if inflate.eof or (not piece and not data):
            return False


def _find(conn: sqlite3.Connection, ident: str, scratch: Optional[Path]) -> tuple:
    """(the stored workout of an id, every workout of its object) (:func:`workout_id`): an
    id of start and end is read from the hour it names; HAE's id is looked for in the
    stored objects, newest first, without decoding them (the first that names it).
    :class:`UnknownWorkout` else."""
    instants = _id_instants(ident)
    if instants is not None:
        hour, needle = instants[0] // HOUR_US, None
        rows = _workout_rows(conn, hour, hour)
    elif _HAE_ID.fullmatch(ident):
        needle = b'"id":"%s"' % ident.encode("ascii")
        rows = _workout_rows(conn, -(1 << 62), 1 << 62, newest_first=True)
    else:
        raise UnknownWorkout("no stored workout has that id; /api/workouts lists them")
    with contextlib.closing(rows):
        for row in rows:
            if needle is not None and not _blob_holds(row[2], needle):
                continue
            workouts = _workouts_of(row, scratch)
            for workout in workouts:
                if workout.id == ident or workout.coord[:2] == instants:
                    return workout, workouts
    raise UnknownWorkout("no stored workout has that id; /api/workouts lists them")


def find_workout(conn: sqlite3.Connection, ident: str,
                 scratch: Optional[Path] = None) -> StoredWorkout:
    """The stored workout of an id (:func:`workout_id`, either form)."""
    return _find(conn, ident, scratch)[0]


def _workout_source(point: dict) -> Optional[str]:
    """Where the workout came from, as HAE names it: its ``source`` (version 2 has none),
    else that of its first heart-rate or energy sample."""
    if type(point.get("source")) is str and point["source"]:
        return point["source"]
    for key in ("heartRateData", "activeEnergy", "heartRateRecovery"):
        for item in _series(point, key):
            if type(item) is dict and type(item.get("source")) is str and item["source"]:
                return item["source"]
            break
    return None


def workout_listing(workout: StoredWorkout, zone: Zone) -> dict:
    """A workout as a list shows it: its id, times (UTC, local in ``zone``, the local date),
    :func:`workout_item`'s figures as sent, its activity, whether a route and the session's
    heart rate were sent, and its source."""
    point, coord = workout.point, workout.coord
    raw_end = point.get("end", point.get("endDate"))
    start_offset = zone.point_offset(raw_start(point), coord[0])
    end_offset = zone.point_offset(raw_end if raw_end is not None else raw_start(point),
                                   coord[1])
    item = {"id": workout.id, "start": format_instant(coord[0]),
            "end": format_instant(coord[1]), "local_start": local_iso(coord[0], start_offset),
            "local_end": local_iso(coord[1], end_offset),
            "date": _dt.date.fromordinal(local_ordinal(coord[0], start_offset)).isoformat()}
    item.update(workout_item(point, coord))
    route = _series(point, "route")
    total = _quantity(point.get("totalEnergy"))
    if total is not None:
        total["unit_label"] = unit_label(WORKOUT_METRIC, total["units"])
    item.update(activity=workout_activity(point), route_points=len(route),
                has_route=len(route) > 0, has_heart_rate=_has_session_heart(point, coord),
                total_energy=total, source=_workout_source(point),
                duplicate_of=None, shown_first=None, duplicates=[])
    return item


def mark_duplicates(entries: list) -> None:
    """Mark the workouts recorded twice among ``entries`` ([(listing, coordinate)]): same
    activity (by its name's words; the same name when neither is known) and times
    overlapping by at least :data:`DUPLICATE_OVERLAP` of the longer.  Of each group the one
    shown first has a route, then the session's heart rate, then more route points, then
    the longer duration, then the earlier start; the others name it in ``duplicate_of``,
    and it names them in ``duplicates`` (each names the first in ``shown_first``)."""
    keys = [item["activity"] if item["activity"] != "other" else
            "name:" + (item["name"] or "").strip().lower() for item, _ in entries]
    parent = list(range(len(entries)))

    def root(k: int) -> int:
        while parent[k] != k:
            parent[k] = parent[parent[k]]
            k = parent[k]
        return k

    order = sorted(range(len(entries)), key=lambda k: entries[k][1][:2])
    for position, a in enumerate(order):
        start_a, end_a = entries[a][1][:2]
        for b in order[position + 1:]:
            start_b, end_b = entries[b][1][:2]
            if start_b >= end_a:
                break
            longer = max(end_a - start_a, end_b - start_b)
            overlap = min(end_a, end_b) - start_b
            if keys[a] == keys[b] and longer > 0 and overlap >= DUPLICATE_OVERLAP * longer:
                parent[root(b)] = root(a)
    groups: dict = {}
    for k in range(len(entries)):
        groups.setdefault(root(k), []).append(k)
    for members in groups.values():
        if len(members) < 2:
            continue
        best = max(members, key=lambda k: (
            entries[k][0]["has_route"], entries[k][0]["has_heart_rate"],
            entries[k][0]["route_points"], entries[k][0]["duration_s"] or 0,
            -entries[k][1][0]))
        first = entries[best][0]
        for k in members:
            item = entries[k][0]
            if k != best:
                item["duplicate_of"] = first["id"]
                item["shown_first"] = _workout_reference(first)
                first["duplicates"].append(_workout_reference(item))


def _workout_reference(item: dict) -> dict:
    """A workout as another names it beside itself."""
    return {"id": item["id"], "name": item["name"], "local_start": item["local_start"],
            "source": item["source"]}


def _range_workouts(conn: sqlite3.Connection, low_us: Optional[int], high_us: Optional[int],
                    zone: Zone, scratch: Optional[Path], limit: Optional[int] = None,
                    wanted: Callable[[StoredWorkout], bool] = lambda w: True,
                    decoded: Optional[dict] = None) -> tuple:
    """([(listing, coordinate)] of the workouts ``wanted``, newest first, at most
    ``limit``; whether more were left out), duplicates marked among them and the workouts
    of :data:`DUPLICATE_MARGIN_S` around them.  ``decoded``: hour -> the workouts of an
    object already decoded (not decoded again)."""
    margin = DUPLICATE_MARGIN_S * US
    low = -(1 << 62) if low_us is None else (low_us - margin) // HOUR_US
    high = (1 << 62) if high_us is None else (high_us + margin) // HOUR_US
    inside, around, more, oldest = [], [], False, None
    with contextlib.closing(_workout_rows(conn, low, high, newest_first=True)) as rows:
        for row in rows:
            if limit is not None and len(inside) > limit and (
                    row[0] + 1) * HOUR_US <= oldest - margin:
                break  # older than every duplicate of the workouts kept could be
            workouts = (decoded or {}).get(row[0])
            for workout in reversed(workouts if workouts is not None
                                    else _workouts_of(row, scratch)):
                entry = (workout_listing(workout, zone), workout.coord)  # not the point
                if wanted(workout):
                    inside.append(entry)
                    oldest = workout.coord[0] if oldest is None else min(oldest,
                                                                         workout.coord[0])
                else:
                    around.append(entry)
    inside.sort(key=operator.itemgetter(1), reverse=True)
    if limit is not None and len(inside) > limit:
        inside, more = inside[:limit], True
    mark_duplicates(inside + around)
    return inside, more


def list_workouts(conn: sqlite3.Connection, args: Mapping[str, Optional[str]],
                  scratch: Optional[Path] = None,
                  limit: Optional[int] = WORKOUTS_LIST_MAX) -> dict:
    """``GET /api/workouts?from&to&tz``: the workouts whose start is in the range (read as
    ``/api/points`` reads it), newest first, at most ``limit``; each as
    :func:`workout_listing` gives it, duplicates marked (:func:`mark_duplicates`); and the
    count and seconds of the workouts shown first (a duplicate is counted once,
    :func:`workout_totals`); with ``bucket`` (``day`` or ``week``), the same per local day or
    week of the workouts listed (``buckets``, :func:`workout_buckets`)."""
    zone = parse_zone(args.get("tz"))
    start, day_from = _query_bound("from", args.get("from"), zone, is_end=False)
    end, day_to = _query_bound("to", args.get("to"), zone, is_end=True)
    if (start is not None and end is not None and start >= end) or (
            day_from is not None and day_to is not None and day_from >= day_to):
        raise BadRequest("from must be before to")
    bucket = args.get("bucket") or None
    if bucket not in (None, "day", "week"):
        raise BadRequest("bucket must be day or week")
    query = PointQuery(WORKOUT_METRIC, RECORD_LAYER, start, end, zone=zone,
                       day_from=day_from, day_to=day_to)
    entries, more = _range_workouts(
        conn, start, end, zone, scratch, limit,
        lambda w: _coord_in_range(w.coord, query, w.point))
    items = [item for item, _ in entries]
    answer = {"tz": zone.name, "from": _instant_or_null(start), "to": _instant_or_null(end),
              "workouts": items, **workout_totals(items), "truncated": more}
    if bucket is not None:
        answer.update(bucket=bucket, buckets=workout_buckets(items, bucket))
    return answer


def workout_totals(items: list) -> dict:
    """``count`` and ``seconds`` of the workouts shown first among ``items`` (summaries
    marked by :func:`mark_duplicates`): a workout two apps recorded counts once."""
    shown = [item for item in items if item["duplicate_of"] is None]
    return {"count": len(shown), "seconds": math.fsum(item["duration_s"] or 0
                                                     for item in shown)}


def workout_buckets(items: list, bucket: str) -> list:
    """The workout time of each local day (``bucket=day``) or week (``week``: dated by its
    Monday) of ``items``' dates that has a workout: [{date, count, seconds}] in date
    order, each counted as :func:`workout_totals` counts (a workout two apps recorded
    once)."""
    slots: dict = {}
    for item in items:
        day = _dt.date.fromisoformat(item["date"])
        if bucket == "week":
            day -= _dt.timedelta(days=day.weekday())
        slots.setdefault(day, []).append(item)
    return [{"date": day.isoformat(), **workout_totals(slots[day])} for day in sorted(slots)
            if any(item["duplicate_of"] is None for item in slots[day])]


# -- one workout, whole ---------------------------------------------------------------


FIGURE_DIGITS = {"distance": 2, "active_energy": 0, "total_energy": 0, "speed": 1,
                 "elevation_gain": 0, "average_heart_rate": 0, "max_heart_rate": 0}
"""The decimals a workout's figure is written with: 10.02 km, 2,812 kJ, 24.3 km/h, 147 bpm."""


def _figure(key: str, label: str, value: Optional[float], shown: str,
            units: Optional[str] = None, label_units: Optional[str] = None,
            note: Optional[str] = None) -> Optional[dict]:
    """A figure of the workout page: ``shown`` says how the page writes the value
    (``duration``: h:mm:ss, ``pace``: m:ss per unit, ``number``: with ``digits``
    decimals)."""
    if value is None:
        return None
    return {"key": key, "label": label, "value": value, "shown": shown, "units": units,
            "unit_label": label_units if label_units is not None else unit_label(
                WORKOUT_METRIC, units), "digits": FIGURE_DIGITS.get(key), "note": note}


def _sent_figure(key: str, label: str, amount: Optional[dict],
                 note: Optional[str] = None) -> Optional[dict]:
    if amount is None:
        return None
    return _figure(key, label, amount["qty"], "number", amount["units"], note=note)


def _elevation_sent(point: dict) -> Optional[dict]:
    """The climb as sent: version 2's ``elevationUp``, version 1's ``elevation.ascent``."""
    up = _quantity(point.get("elevationUp"))
    if up is not None:
        return up
    elevation = point.get("elevation")
    if type(elevation) is dict and _number(elevation.get("ascent")) is not None:
        return {"qty": elevation["ascent"], "units": elevation.get("units")}
    return None


def workout_figures(point: dict, duration: Optional[float], activity: str, system: str,
                    walk: Optional[RouteWalk], heart: WorkoutHeart) -> list:
    """The figures of a workout, each in the units a person reads: duration; distance, active
    and total energy as sent (never added across units); pace or speed as the activity reads
    it, in the owner's units; the climb (as sent, else the route's); average and highest heart
    rate (as sent, else from the session's samples)."""
    units = UNIT_SYSTEMS[system]
    figures = [_figure("duration", "Duration", duration, "duration")]
    distance = _quantity(point.get("distance"))
    if distance is not None and distance["qty"] > 0:
        figures.append(_sent_figure("distance", "Distance", distance))
        meters = _meters(distance)
    elif walk is not None and walk.meters > 0:
        label, size = units["distance"]
        meters = walk.meters
        figures.append(_figure("distance", "Distance", meters / size, "number", label,
                               note="from the route"))
    else:
        meters = None
    figures.append(_sent_figure("active_energy", "Active energy", _quantity(
        point.get("activeEnergyBurned")) or _quantity(point.get("activeEnergy"))))
    figures.append(_sent_figure("total_energy", "Total energy",
                                _quantity(point.get("totalEnergy"))))
    if meters and duration:
        kind = _pace_kind(activity)
        if kind == "speed":
            label, size = units["speed"]
            figures.append(_figure("speed", "Average speed", meters / duration / size,
                                   "number", label))
        else:
            label, size = units["swim" if kind == "swim" else "distance"]
            figures.append(_figure("pace", "Average pace", duration / (meters / size), "pace",
                                   label_units="/" + label))
    climb = _elevation_sent(point)
    if climb is not None:
        figures.append(_sent_figure("elevation_gain", "Elevation gain", climb))
    elif walk is not None and walk.gain is not None:
        label, size = units["elevation"]
        figures.append(_figure("elevation_gain", "Elevation gain", walk.gain / size, "number",
                               label, note="from the route"))
    sent_heart = point.get("heartRate") if type(point.get("heartRate")) is dict else {}
    for key, label, sent, pick in (
            ("average_heart_rate", "Average heart rate", "avg", None),
            ("max_heart_rate", "Highest heart rate", "max", max)):
        amount = _quantity(sent_heart.get(sent)) or _quantity(point.get(
            "avgHeartRate" if sent == "avg" else "maxHeartRate"))
        if amount is not None:
            figures.append(_sent_figure(key, label, amount))
        elif heart.session:
            values = [s[1] for s in heart.session]
            value = pick(values) if pick else math.fsum(values) / len(values)
            figures.append(_figure(key, label, value, "number", label_units="bpm",
                                   note="from the samples"))
    return [f for f in figures if f is not None]


def _zones_answer(conn: sqlite3.Connection, heart: WorkoutHeart, end_us: int,
                  setting: Optional[float]) -> Optional[dict]:
    """The zones of the session's heart rate, from the owner's maximum, else the highest of
    the year before the workout, else the workout's own; the answer says which."""
    if not heart.session:
        return None
    own = max(s[3] for s in heart.session)
    if setting:
        maximum, source = setting, "setting"
        words = "Zones from your maximum heart rate, %d bpm (--max-heart-rate)." % setting
    else:
        year = highest_heart_rate(conn, end_us)
        if year is not None and year >= own:
            maximum, source = year, "year"
            words = ("Zones from the highest heart rate stored in the year before this"
                     " workout, %d bpm; set your own with --max-heart-rate." % round(year))
        else:
            maximum, source = own, "workout"
            words = ("Zones from this workout's highest heart rate, %d bpm: none higher is"
                     " stored from the year before it; set your own with --max-heart-rate."
                     % round(own))
    return {"max": maximum, "source": source, "words": words,
            "zones": heart_zones(heart.session, end_us, maximum)}


def _route_answer(walk: RouteWalk, start_us: int, heart: WorkoutHeart, ident: str) -> dict:
    """The route as the page draws it: the whole route's bounds and meters, the points kept
    ([seconds from the start or None, latitude, longitude, altitude, meters so far, speed in
    m/s since the last kept point, heart rate then]), and where its GPX is."""
    times = [s[0] for s in heart.session]
    drawn = []
    for instant, lat, lon, alt, meters, speed in walk.drawn:
        drawn.append([None if instant is None else (instant - start_us) / US, lat, lon, alt,
                      meters, speed, nearest_heart(times, heart.session, instant)])
    south, west, north, east = walk.bounds
    return {"points": walk.count, "drawn": drawn, "meters": walk.meters,
            "bounds": {"south": south, "west": west, "north": north, "east": east},
            "has_altitude": walk.gain is not None,
            "gpx": "/api/workouts/%s.gpx" % ident}


def nearest_heart(times: list, samples: list, instant: Optional[int]) -> Optional[float]:
    """The value of the session sample nearest to ``instant``, when one is within
    :data:`HEART_NEAREST_S` (never interpolated, never across a gap)."""
    if instant is None or not times:
        return None
    k = bisect.bisect_left(times, instant)
    best = None
    for j in (k - 1, k):
        if 0 <= j < len(times) and abs(times[j] - instant) <= HEART_NEAREST_S * US and (
                best is None or abs(times[j] - instant) < abs(times[best] - instant)):
            best = j
    return None if best is None else samples[best][1]


def get_workout(conn: sqlite3.Connection, ident: str,
                args: Optional[Mapping[str, Optional[str]]] = None,
                scratch: Optional[Path] = None, max_heart_rate: Optional[float] = None,
                distance_units: Optional[str] = None) -> dict:
    """``GET /api/workouts/<id>``: one workout whole: its listing (:func:`workout_listing`,
    duplicates marked among the workouts around it), its figures (:func:`workout_figures`),
    the route thinned for drawing (:data:`ROUTE_DRAW_MAX`) with its bounds, the session's
    heart rate and the recovery apart, with zones, the splits per km or mile (100 m or yards
    swimming) from the route (else the distance series) and the altitude along the route.
    ``args``: ``tz``.  Time and memory are bounded whatever the route's length (one pass,
    :func:`walk_route`)."""
    zone = parse_zone((args or {}).get("tz"))
    found, siblings = _find(conn, ident, scratch)
    [(listing, _)] = _range_workouts(conn, found.coord[0], found.coord[1], zone, scratch,
                                     wanted=lambda w: w is found,
                                     decoded={found.hour: siblings})[0]
    point, (start, end, _) = found.point, found.coord
    activity = listing["activity"]
    system = owner_units(point, distance_units)
    units = UNIT_SYSTEMS[system]
    split_label, split_m = units["swim" if activity == "swimming" else "distance"]
    heart = workout_heart(point, found.coord)
    route = _series(point, "route")
    walk = walk_route(route, split_m) if len(route) else None
    if walk is not None and walk.count == 0:
        walk = None
    boundaries, source = (walk.boundaries, "route") if walk is not None else (None, None)
    if boundaries is None:
        series = _series_boundaries(_series(point, _ACTIVITY_SERIES.get(
            activity, "walkingAndRunningDistance")), end, split_m)
        if series is not None:
            boundaries, source = series[0], "distance series"
    duration = listing["duration_s"]
    notes = [] if heart.state == "sent" else [HEART_WORDS[heart.state]]
    if walk is None:
        notes.append("No route was sent with this workout.")
    return {
        "workout": listing,
        "figures": workout_figures(point, duration, activity, system, walk, heart),
        "units": {"system": system, **{key: {"label": label, "meters": size}
                                       for key, (label, size) in units.items()}},
        "route": None if walk is None else _route_answer(walk, start, heart, found.id),
        "heart_rate": {
            "state": heart.state, "units_label": "bpm",
            "session": _thin_heart(heart.session, start, HEART_DRAW_MAX),
            "recovery": _thin_heart(heart.recovery, start, HEART_DRAW_MAX),
            "end_s": (end - start) / US,
            "zones": _zones_answer(conn, heart, end, max_heart_rate)},
        "splits": None if not boundaries else _splits_answer(
            workout_splits(boundaries, start, split_m, heart.session), activity, units,
            split_label, split_m, source),
        "elevation": None if walk is None or walk.gain is None else {
            "label": units["elevation"][0], "meters": units["elevation"][1],
            "gain_m": walk.gain, "loss_m": walk.loss,
            "profile": [[p[4], p[3]] for p in walk.drawn if p[3] is not None]},
        "notes": notes,
        "link": {"metric": WORKOUT_METRIC, "from": _dt.date.fromordinal(
            _dt.date.fromisoformat(listing["date"]).toordinal() - 6).isoformat(),
            "to": listing["date"]},
    }


def _splits_answer(rows: list, activity: str, units: dict, label: str, size: float,
                   source: str) -> dict:
    """The splits as the page shows them: pace, or speed for an activity read by its speed
    (each row's ``speed`` in the owner's units)."""
    speed_label, speed_size = units["speed"]
    for row in rows:
        row["speed"] = None if not row["seconds"] else row["meters"] / row["seconds"] / (
            speed_size)
    return {"unit": {"label": label, "meters": size}, "source": source, "rows": rows,
            "shown": "speed" if _pace_kind(activity) == "speed" else "pace",
            "pace_label": "/" + label, "speed_label": speed_label}


# ==============================================================================
# Freshness: is anything missing? States, notices' words, coverage; the notifier.
# ==============================================================================
# Everything here is derived from the journal and the store, as ``reindex`` rebuilds them:
# nothing is stored.  Facts that do not depend on the clock (last deliveries, usual
# intervals, newest points, carriers) are kept in memory by :class:`FreshnessSource`
# between changes of the database; the states are judged against ``Config.clock``.

FRESHNESS_DAY_LAYERS = ("days", "weeks", "months", "years")
"""Layers whose points stand for a whole day or more: coverage says present or not."""
DAILY_SPACING_S = 25 * 3600
"""A metric whose usual spacing is at most this (a day, 25 hours on a DST day) is expected
every day: a day without it is missing; a sparser one's quiet days are not flagged."""
_ID_CHUNK = 500


def automation_key(automation_id: Optional[str], automation_name: Optional[str],
                   path_name: Optional[str]) -> str:
    """Who sent a delivery: HAE's ``automation-id``, else its ``automation-name``, else the
    path it was posted to (``/api/ingest/<name>``; ``/api/ingest`` for every delivery
    without headers or name: one anonymous automation)."""
    if automation_id:
        return automation_id
    if automation_name:
        return automation_name
    return "/api/ingest/" + path_name if path_name else "/api/ingest"


def watched_metric(metric: str) -> bool:
    """Symptoms, medications and cycle tracking are events a person enters, named after
    what they entered (health data): no rhythm to miss, and no name to send."""
    return loggable_metric(metric) == metric


class ImportedDeliveries:
    """The ids of the deliveries ``healthlog import`` journaled: an import is a person's
    export, not an automation running, and its ``received_at`` is the file's time.  Its
    ``.meta.json`` says ``imported_from``; only rows without ``automation-id`` and
    ``automation-name`` are looked at (``import`` sets neither), each once."""

    def __init__(self, data_dir: Path):
        self.data_dir = data_dir
        self.ids: set = set()
        self._upto = 0

    def update(self, conn: sqlite3.Connection) -> None:
        rows = conn.execute(
            "SELECT id, archive_path FROM delivery WHERE id > ? AND coalesce(automation_id,"
            " '') = '' AND coalesce(automation_name, '') = '' ORDER BY id",
            (self._upto,)).fetchall()
        for row_id, relative in rows:
            meta = _read_meta(self.data_dir / relative, relative)
            if "imported_from" in meta:
                self.ids.add(row_id)
        top = conn.execute("SELECT max(id) FROM delivery").fetchone()[0]
        self._upto = max(self._upto, top or 0, rows[-1][0] if rows else 0)


@dataclass
class _Sender:
    """What the journal says of one automation (imports left out)."""

    key: str
    name: Optional[str] = None  # its latest automation-name, else its path name
    deliveries: int = 0
    first_us: int = 0
    last_us: int = 0
    runs: list = _field(default_factory=list)  # start of each run, sorted (µs)
    times: Any = _field(default_factory=lambda: array.array("q"))  # every delivery, sorted
    session: Optional[str] = None  # the session-id of its latest delivery

    def last_folded_us(self, pending: Optional[collections.Counter]) -> int:
        """Its last delivery that is no longer waiting for the fold (``pending``: how many
        of its deliveries received at each time wait): a delivery not folded yet says
        nothing of what it carries."""
        if not pending:
            return self.last_us
        waiting = collections.Counter(pending)
        for at in reversed(self.times):
            if waiting[at]:
                waiting[at] -= 1
                continue
            return at
        return self.first_us - 1  # every delivery waits: none has said anything yet

    def usual_interval_s(self) -> Optional[float]:
        """The median gap between its runs that end in the :data:`USUAL_INTERVAL_DAYS` up
        to its last run; None before :data:`FRESH_MIN_RUNS` runs."""
        runs = self.runs
        if len(runs) < FRESH_MIN_RUNS:
            return None
        start = runs[-1] - USUAL_INTERVAL_DAYS * 86400 * US
        first = max(1, bisect.bisect_left(runs, start))
        return _median([(runs[i] - runs[i - 1]) / US for i in range(first, len(runs))])


class JournalFacts:
    """Per automation, from the delivery rows in id order: deliveries, first and last,
    and its runs (deliveries of one ``session-id`` in a row are one run: HAE's Batch
    Requests).  Rows are only ever added while a process runs, so each is read once."""

    def __init__(self):
        self.senders: dict = {}
        self._upto = 0

    def update(self, conn: sqlite3.Connection, imports: ImportedDeliveries) -> None:
        for row_id, received, a_id, a_name, path, session in conn.execute(
                "SELECT id, received_at, automation_id, automation_name, path_name, session_id"
                " FROM delivery WHERE id > ? ORDER BY id", (self._upto,)):
            self._upto = row_id
            if row_id in imports.ids:
                continue
            at = parse_time(received)
            if at is None:
                continue
            key = automation_key(a_id, a_name, path)
            sender = self.senders.get(key)
            if sender is None:
                sender = self.senders[key] = _Sender(key, first_us=at, last_us=at)
            sender.name = a_name or path or sender.name
            sender.deliveries += 1
            sender.first_us, sender.last_us = min(sender.first_us, at), max(sender.last_us, at)
            if not session or session != sender.session:
                bisect.insort(sender.runs, at)
            bisect.insort(sender.times, at)
            sender.session = session

    def pending(self, conn: sqlite3.Connection, imports: ImportedDeliveries) -> dict:
        """Automation key → Counter of the receive times of its deliveries waiting for the
        fold (few: the partial index of pending rows)."""
        found: dict = {}
        for row_id, received, a_id, a_name, path in conn.execute(
                "SELECT id, received_at, automation_id, automation_name, path_name FROM"
                " delivery WHERE parse_status = 'pending'"):
            at = parse_time(received)
            if row_id in imports.ids or at is None or row_id > self._upto:
                continue
            found.setdefault(automation_key(a_id, a_name, path),
                             collections.Counter())[at] += 1
        return found


@dataclass(frozen=True)
class MetricFacts:
    """What the store says of one metric and layer: its newest point (instant and the
    offset it was written in), its first hour, its usual spacing (None with one point),
    the automations whose deliveries wrote it lately (keys), and the delivery of its
    newest point."""

    metric: str
    layer: str
    newest_us: int
    newest_offset: int
    first_hour: int
    spacing_s: Optional[float]
    carriers: tuple
    newest_delivery: Optional[int]


def _time_median(gaps: list) -> Optional[float]:
    """The gap a moment usually falls in: of [(gap, how many such gaps)], the one at which
    gaps no longer than it cover half of the time they span together (0 when all are 0)."""
    if not gaps:
        return None
    total = sum(gap * count for gap, count in gaps)
    covered = 0.0
    for gap, count in sorted(gaps):
        covered += gap * count
        if covered * 2 >= total:
            return float(gap)
    return float(max(gap for gap, _ in gaps))  # pragma: no cover - float rounding


def _spacing(conn: sqlite3.Connection, metric: str, layer: str, top: int) -> Optional[float]:
    """The usual spacing of a metric's points over the :data:`USUAL_SPACING_DAYS` up to its
    newest hour (the gap into that window included): the gap between consecutive points
    that a moment of that time usually falls in, so that a metric measured in bursts (three
    blood pressure readings a minute apart, twice a year) is spaced by its bursts, and one
    quiet every night by its nights when they are most of its time.  The points of one hour
    count as evenly spaced between its first and last: read from the objects' bounds,
    never from their points."""
    low = top - USUAL_SPACING_DAYS * 24
    gaps: list = []
    before = conn.execute("SELECT last_at FROM object WHERE metric = ? AND layer = ? AND"
                          " hour < ? ORDER BY hour DESC LIMIT 1", (metric, layer, low)).fetchone()
    previous = None if before is None else before[0]
    for first_at, last_at, points in _bounds(conn, metric, layer, low, top):
        if previous is not None:
            gaps.append((max(0, first_at - previous), 1))
        if points > 1:
            gaps.append(((last_at - first_at) / (points - 1), points - 1))
        previous = last_at
    return _time_median(gaps)


def _bounds(conn: sqlite3.Connection, metric: str, layer: str, low: int, high: int) -> list:
    """(first_at, last_at, points) of the objects of the hours ``low``..``high`` in order,
    from the index that covers the tallies (a tally says how many points it has) rather
    than from the rows that hold the blobs; an object without a tally is read."""
    try:
        rows = conn.execute(
            "SELECT hour, first_at, last_at, json_extract(summary, '$.n') FROM object WHERE"
            " metric = ? AND layer = ? AND hour BETWEEN ? AND ? ORDER BY hour",
            (metric, layer, low, high)).fetchall()
    except sqlite3.OperationalError:  # an SQLite without JSON functions
        rows = [(hour, first_at, last_at, None) for hour, first_at, last_at in conn.execute(
            "SELECT hour, first_at, last_at FROM object WHERE metric = ? AND layer = ? AND"
            " hour BETWEEN ? AND ? ORDER BY hour", (metric, layer, low, high))]
    out = []
    for hour, first_at, last_at, points in rows:
        if points is None:
            points = conn.execute("SELECT points FROM object WHERE metric = ? AND layer = ?"
                                  " AND hour = ?", (metric, layer, hour)).fetchone()[0]
        out.append((first_at, last_at, points))
    return out


def _carrier_keys(conn: sqlite3.Connection, ids: set, imports: ImportedDeliveries) -> dict:
    """Delivery id → automation key, imports left out."""
    found: dict = {}
    wanted = sorted(i for i in ids if i not in imports.ids)
    for at in range(0, len(wanted), _ID_CHUNK):
        chunk = wanted[at:at + _ID_CHUNK]
        for row_id, a_id, a_name, path in conn.execute(
                "SELECT id, automation_id, automation_name, path_name FROM delivery WHERE id"
                " IN (%s)" % ",".join("?" * len(chunk)), chunk):
            found[row_id] = automation_key(a_id, a_name, path)
    return found


def metric_facts(conn: sqlite3.Connection, imports: ImportedDeliveries,
                 newest_cache: Optional[dict] = None) -> list:
    """:class:`MetricFacts` of every watched metric and layer.  ``newest_cache`` keeps each
    newest object's reading by (hour, hash) between calls: a large hour (a workout's
    route) is decoded once."""
    cache = newest_cache if newest_cache is not None else {}
    found = []
    tops = [(metric, layer, first, last) for metric in stored_metrics(conn)  # seeks, not a
            for layer, (first, last) in layer_hours(conn, metric).items()]  # scan of years
    wanted_ids: dict = {}
    for metric, layer, first_hour, top in tops:
        if not watched_metric(metric):
            continue
        row = conn.execute(
            "SELECT hash, metric, layer, hour, units, delivery_id, updated_by, sealed, blob,"
            " point_deliveries, spans FROM object WHERE metric = ? AND layer = ? AND hour = ?",
            (metric, layer, top)).fetchone()
        newest = cache.get((metric, layer))
        if newest is None or newest[0] != (top, row[0]):
            stored = decode_object(row[1:])
            last = max(range(len(stored.coords)), key=lambda i: stored.coords[i][0])
            start = stored.coords[last][0]
            point = stored.points[last]
            raw = raw_start(point) if type(point) is dict else None
            newest = ((top, row[0]), start, text_offset(raw, start), stored.deliveries[last])
            cache[(metric, layer)] = newest
        ids = {newest[3]}
        for created, updated in conn.execute(
                "SELECT delivery_id, updated_by FROM object WHERE metric = ? AND layer = ? AND"
                " hour BETWEEN ? AND ?", (metric, layer, top - USUAL_INTERVAL_DAYS * 24, top)):
            ids.add(created)
            ids.add(updated)
        wanted_ids[(metric, layer)] = ids
        found.append([metric, layer, newest[1], newest[2], first_hour,
                      _spacing(conn, metric, layer, top), newest[3]])
    keys = _carrier_keys(conn, set().union(*wanted_ids.values()) if wanted_ids else set(),
                         imports)
    return [MetricFacts(metric, layer, newest_us, offset, first_hour, spacing,
                        tuple(sorted({keys[i] for i in wanted_ids[(metric, layer)] if i in keys})),
                        newest_id)
            for metric, layer, newest_us, offset, first_hour, spacing, newest_id in found]


@dataclass(frozen=True)
class AutomationState:
    key: str
    name: Optional[str]
    deliveries: int
    first_us: int
    last_us: int
    usual_s: Optional[float]
    threshold_s: float
    state: str  # new | on_time | late
    carries: tuple  # (metric, layer) of the metrics it carries
    offset: int = 0  # the phone's clock for it (:func:`judge_freshness`): its dates, times

    @property
    def label(self) -> str:
        """How a person knows it: its name, quoted."""
        if self.name:
            return "'%s'" % self.name
        return "the automation posting to %s" % self.key


@dataclass(frozen=True)
class MetricState:
    metric: str
    layer: str
    newest_us: int
    newest_offset: int
    first_hour: int
    spacing_s: Optional[float]
    threshold_s: float
    state: str  # new | fresh | stale
    carrier: Optional[AutomationState]  # the one that keeps delivering, else that carried it

    @property
    def label(self) -> str:
        return meaning_of(self.metric).name


@dataclass(frozen=True)
class Freshness:
    """Every automation's and metric's state at ``now_s``."""

    now_s: float
    late_after_s: float
    automations: tuple
    metrics: tuple

    def as_json(self) -> dict:
        """``GET /api/freshness``."""
        return {"automations": [
            {"id": a.key, "name": a.name, "last_delivery": journal_time(a.last_us),
             "usual_interval_s": None if a.usual_s is None else round(a.usual_s, 3),
             "state": a.state} for a in self.automations],
            "metrics": [
                {"metric": m.metric, "layer": m.layer,
                 "newest_point": local_iso(m.newest_us, m.newest_offset), "state": m.state}
                for m in self.metrics]}

    def metric(self, metric: str, layer: str) -> Optional[MetricState]:
        for item in self.metrics:
            if item.metric == metric and item.layer == layer:
                return item
        return None


def phone_offset(metrics: Sequence) -> int:
    """The phone's clock now, as far as the store knows it: the offset the newest point of
    any metric was written in (``metrics``: :class:`MetricFacts` or :class:`MetricState`);
    0 (UTC) while nothing is stored.  What ``tz=local`` means by today."""
    newest = max(((m.newest_us, m.newest_offset) for m in metrics), default=(0, 0))
    return newest[1]


def judge_freshness(senders: Mapping[str, _Sender], facts: list, now_s: float,
                    late_after_s: float, pending: Optional[Mapping] = None) -> Freshness:
    """States at ``now_s``: an automation is ``late`` when silent longer than
    max(:data:`LATE_FACTOR` × its usual interval, ``late_after_s``); a metric ``stale`` when
    its newest point is older than max(:data:`LATE_FACTOR` × its usual spacing,
    ``late_after_s``) while an automation that carries it has delivered since that
    deadline, in a delivery already folded (``pending``: :meth:`JournalFacts.pending`).

    One clock, the phone's, for every word said of an automation (its dates to export,
    the time of its last delivery): the offset the newest point it carries was written in;
    an automation that carries nothing (its runs write nothing new, a "Previous 7 Days"
    safety net re-sending what another wrote) has the phone's clock now
    (:func:`phone_offset`).  A delivery's body is not read for it: only what the fold
    stored says which points an automation wrote."""
    carried: dict = {}
    offsets: dict = {}  # automation -> (newest point it carries, its offset)
    phone = phone_offset(facts)
    for fact in facts:
        for key in fact.carriers:
            carried.setdefault(key, []).append((fact.metric, fact.layer))
            offsets[key] = max(offsets.get(key, (fact.newest_us, fact.newest_offset)),
                               (fact.newest_us, fact.newest_offset))
    automations = {}
    for key, sender in senders.items():
        usual = sender.usual_interval_s()
        threshold = late_after_s if usual is None else max(LATE_FACTOR * usual, late_after_s)
        if usual is None:
            state = "new"
        else:
            state = "late" if now_s - sender.last_us / US > threshold else "on_time"
        automations[key] = AutomationState(key, sender.name, sender.deliveries,
                                           sender.first_us, sender.last_us, usual, threshold,
                                           state, tuple(carried.get(key, ())),
                                           offsets.get(key, (0, phone))[1])
    metrics = []
    for fact in facts:
        threshold = late_after_s if fact.spacing_s is None else max(
            LATE_FACTOR * fact.spacing_s, late_after_s)
        carriers = sorted((automations[k] for k in fact.carriers if k in automations),
                          key=lambda a: (-a.last_us, a.key))
        deadline_us = fact.newest_us + int(threshold * US)
        delivering = [a for a in carriers if senders[a.key].last_folded_us(
            (pending or {}).get(a.key)) > deadline_us]
        if fact.spacing_s is None:
            state = "new"
        elif now_s * US > deadline_us and delivering:
            state = "stale"
        else:
            state = "fresh"
        carrier = (delivering or carriers or [None])[0]
        metrics.append(MetricState(fact.metric, fact.layer, fact.newest_us, fact.newest_offset,
                                   fact.first_hour, fact.spacing_s, threshold, state, carrier))
    return Freshness(now_s, late_after_s,
                     tuple(sorted(automations.values(), key=lambda a: (a.name or a.key, a.key))),
                     tuple(metrics))


class FreshnessSource:
    """Freshness for ``serve``: the facts kept in memory on a connection of its own, read
    again when the database changed (``PRAGMA data_version``: another connection
    committed), and judged against the clock at each call.  Thread-safe.

    While the archive's disk is not there (``serve`` waits for it), an import cannot be
    told from an automation's delivery (its ``.meta.json`` is on that disk): the facts are
    then read by readers kept by none, and read again once the disk is mounted, right,
    instead of an import counting as a delivery for as long as ``serve`` runs."""

    def __init__(self, config: Config):
        self.config = config
        self._lock = threading.Lock()
        self._conn: Optional[sqlite3.Connection] = None
        self._version: Optional[int] = None
        self._imports = ImportedDeliveries(config.data_dir)
        self._journal = JournalFacts()
        self._senders: dict = {}
        self._absent = False  # the facts were read while the archive's disk was not there
        self._newest: dict = {}
        self._facts: list = []
        self._pending: dict = {}
        self._closed = False

    def judge(self, now_s: Optional[float] = None) -> Freshness:
        with self._lock:
            if self._closed:
                raise HealthlogError("the service has stopped")
            if self._conn is None:  # it only reads: FULL, as every connection but the fold's
                self._conn = connect(self.config.db_path,
                                     busy_timeout_s=self.config.busy_timeout_s)
            conn = self._conn
            version = conn.execute("PRAGMA data_version").fetchone()[0]
            if version != self._version or (self._absent
                                            and not archive_absent(self.config.data_dir)):
                absent = archive_absent(self.config.data_dir)
                imports, journal = ((ImportedDeliveries(self.config.data_dir), JournalFacts())
                                    if absent else (self._imports, self._journal))
                conn.execute("BEGIN")  # one snapshot of the journal and the store
                try:
                    imports.update(conn)
                    journal.update(conn, imports)
                    self._pending = journal.pending(conn, imports)
                    self._facts = metric_facts(conn, imports, self._newest)
                finally:
                    conn.execute("COMMIT")
                self._senders = journal.senders
                self._version, self._absent = version, absent
            return judge_freshness(self._senders, self._facts,
                                   self.config.clock() if now_s is None else now_s,
                                   self.config.late_after_s, self._pending)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            if self._conn is not None:
                with contextlib.suppress(sqlite3.Error):
                    self._conn.close()
                self._conn = None


def freshness_of(conn: sqlite3.Connection, data_dir: Path, now_s: float,
                 late_after_s: float) -> Freshness:
    """Freshness read once, on ``conn`` (``status``)."""
    imports, journal = ImportedDeliveries(data_dir), JournalFacts()
    imports.update(conn)
    journal.update(conn, imports)
    return judge_freshness(journal.senders, metric_facts(conn, imports), now_s, late_after_s,
                           journal.pending(conn, imports))


# -- notices: what a person is told, in HAE's own words ---------------------------------

def _moment(instant_us: int, offset_s: Optional[int] = None) -> str:
    """``Fri 2024-03-08 14:02 UTC`` (or ``-08:00``: the offset the time was written in)."""
    shown = _dt.datetime(1970, 1, 1) + _dt.timedelta(
        seconds=instant_us // US + (offset_s or 0))
    return "%s %04d-%02d-%02d %02d:%02d %s" % (
        shown.strftime("%a"), shown.year, shown.month, shown.day, shown.hour, shown.minute,
        "UTC" if offset_s is None else format_offset(offset_s))


def _span_text(seconds: float) -> str:
    """``5 min``, ``6 h``, ``2 d``: a usual interval or a threshold, as a person says it."""
    if seconds >= 86400 and seconds % 86400 == 0 or seconds >= 3 * 86400:
        return "%s d" % _round_text(seconds / 86400)
    if seconds >= 3600:
        return "%s h" % _round_text(seconds / 3600)
    if seconds >= 60:
        return "%s min" % _round_text(seconds / 60)
    return "%s s" % _round_text(seconds)


def _round_text(value: float) -> str:
    return ("%.1f" % value).rstrip("0").rstrip(".")


def hae_action(automation: Optional[AutomationState], first: int, last: int) -> str:
    """How to fill the local days ``first``..``last`` (ordinals) in Health Auto Export."""
    dates = (_dt.date.fromordinal(first).isoformat() if first == last else "%s to %s" % (
        _dt.date.fromordinal(first).isoformat(), _dt.date.fromordinal(last).isoformat()))
    where = ("open the automation %s, tap Manual Export" % automation.label
             if automation is not None else "tap Manual Export in the automation that sends it")
    return ("To fill the gap: in Health Auto Export, %s and export %s. A re-send is always safe"
            " here: healthlog keeps each point once." % (where, dates))


@dataclass(frozen=True)
class Notice:
    """One change of state (or, on the page and in ``status``, one state) told to a person:
    names and times only, never a value, a device or the token."""

    kind: str  # automation | metric
    subject: str  # the automation's id, or metric/layer
    state: str  # late | on_time | stale | fresh
    title: str
    text: str
    action: str
    since: str  # the last delivery or the newest point, local on the phone's clock

    def as_json(self) -> dict:
        return {"kind": self.kind, "subject": self.subject, "state": self.state,
                "title": self.title, "text": self.text, "action": self.action,
                "since": self.since}


def _today(instant_s: float, offset_s: int) -> int:
    return local_ordinal(int(instant_s * US), offset_s)


def automation_notice(item: AutomationState, now_s: float) -> Notice:
    """What a person is told of an automation, on the phone's clock (its ``offset``), as
    of a metric: the time of its last delivery and the dates to export."""
    since = local_iso(item.last_us, item.offset)
    if item.state == "late":
        usual = "" if item.usual_s is None else "; it usually sends every %s" % _span_text(
            item.usual_s)
        return Notice(
            "automation", item.key, "late", "healthlog: %s is late" % item.label,
            "%s has sent nothing since %s%s (late after %s)." % (
                capitalise_first(item.label), _moment(item.last_us, item.offset), usual,
                _span_text(item.threshold_s)),
            "Unlock the phone and open Health Auto Export: check that the automation %s is"
            " on, and that Low Power Mode and a lack of Background App Refresh do not stop"
            " it. %s" % (item.label, hae_action(item, local_ordinal(item.last_us, item.offset),
                                                 _today(now_s, item.offset))),
            since)
    return Notice("automation", item.key, item.state, "healthlog: %s is back" % item.label,
                  "%s delivered again at %s." % (capitalise_first(item.label),
                                                 _moment(item.last_us, item.offset)), "", since)


def metric_notice(item: MetricState, now_s: float) -> Notice:
    since = local_iso(item.newest_us, item.newest_offset)
    subject = "%s/%s" % (item.metric, item.layer)
    name = "%s (%s)" % (item.label, item.layer)
    if item.state == "stale":
        by = item.carrier.label if item.carrier is not None else "its automation"
        return Notice(
            "metric", subject, "stale", "healthlog: %s has stopped" % name,
            "%s: nothing since %s while %s keeps delivering." % (
                name, _moment(item.newest_us, item.newest_offset), by),
            "Check that the device that records it is worn and syncs, that Health Auto"
            " Export may still read it (Settings, Health, Data Access & Devices) and that %s"
            " still selects it. %s" % (by, hae_action(
                item.carrier, local_ordinal(item.newest_us, item.newest_offset),
                _today(now_s, item.newest_offset))),
            since)
    return Notice("metric", subject, item.state, "healthlog: %s is back" % name,
                  "%s: new data again, the newest from %s." % (
                      name, _moment(item.newest_us, item.newest_offset)), "", since)


def capitalise_first(text: str) -> str:
    return text[:1].upper() + text[1:]


def attention(fresh: Freshness) -> list:
    """A notice for each automation that is late and each metric that is stale."""
    return ([automation_notice(a, fresh.now_s) for a in fresh.automations if a.state == "late"]
            + [metric_notice(m, fresh.now_s) for m in fresh.metrics if m.state == "stale"])


# -- coverage: how much arrived, per local day ------------------------------------------

def coverage(conn: sqlite3.Connection, args: Mapping[str, Optional[str]],
             fresh: Freshness) -> dict:
    """``GET /api/coverage?from=&to=&tz=`` (``to`` the last day, included): per local day and
    metric, how much arrived: the
    local clock hours with a point (minute data), or whether there is a point (day data),
    by the day rules of ``/api/points``; each day marked ``ok``, ``thin``, ``missing``,
    ``quiet`` (none, and none expected), ``before`` (its first point), ``today`` or
    ``future``; and for each run of missing or thin days, how to fill it."""
    zone = parse_zone(args.get("tz"))
    first, last = read_day("from", args.get("from")), read_day("to", args.get("to"))
    end = None if last is None else last + 1  # a date-only ``to`` includes its day (READ-8.5)
    now_us = int(fresh.now_s * US)
    offset = zone.offset_at(now_us)
    if offset is None:  # tz=local: today on the phone's clock (as the notices say it)
        offset = phone_offset(fresh.metrics)
    today = local_ordinal(now_us, offset)
    if first is None and end is None:
        first, end = today - COVERAGE_DAYS + 1, today + 1
    elif first is None:
        first = end - COVERAGE_DAYS
    elif end is None:
        end = first + COVERAGE_DAYS
    if not READ_FIRST_DAY <= first < end <= READ_LAST_DAY + 1:
        raise BadRequest("from must be on or before to, both days %s" % READ_DAYS)
    if end - first > COVERAGE_MAX_DAYS:
        raise BadRequest("coverage is read %d days at most at once" % COVERAGE_MAX_DAYS)
    low_us = ((first - _EPOCH_ORDINAL) * 86400 - MAX_OFFSET_S) * US
    high_us = ((end - _EPOCH_ORDINAL) * 86400 + MAX_OFFSET_S) * US
    days = list(range(first, end))
    rows = []
    for item in fresh.metrics:
        if (item.newest_us < low_us - USUAL_SPACING_DAYS * 86400 * US
                or item.first_hour * HOUR_US >= high_us):
            continue
        rows.append((item, _coverage_row(conn, item, zone, days, today, low_us, high_us)))
    rows.sort(key=lambda r: (r[1]["group"], r[1]["name"], r[1]["metric"], r[1]["layer"]))
    return {"from": _dt.date.fromordinal(first).isoformat(),
            "to": _dt.date.fromordinal(end - 1).isoformat(), "tz": zone.name,
            "today": _dt.date.fromordinal(today).isoformat(),
            "days": [_dt.date.fromordinal(day).isoformat() for day in days],
            "rules": {"thin": "fewer than half the median hours of the row's days with data",
                      "daily_spacing_s": DAILY_SPACING_S},
            "rows": [row for _, row in rows], "fill": _gap_actions(rows)}


def _gap_actions(rows: list) -> list:
    """The gaps of every row, per automation that carries them: one Manual Export of a run
    of days sends every metric of the automation, so each run of days with a gap in any of
    them is one action, naming the metrics it fills."""
    found: dict = {}  # carrier key -> (carrier, {ordinal: {metric names}})
    for item, row in rows:
        carrier = item.carrier
        entry = found.setdefault(None if carrier is None else carrier.key, (carrier, {}))
        for gap in row["gaps"]:
            first = _dt.date.fromisoformat(gap["from"]).toordinal()
            for day in range(first, first + gap["days"]):
                entry[1].setdefault(day, set()).add("%s (%s)" % (row["name"], row["layer"]))
    actions = []
    for carrier, days in found.values():
        run: list = []
        for day in sorted(days) + [None]:
            if run and (day is None or day != run[-1] + 1):
                actions.append({"automation": None if carrier is None else carrier.name
                             or carrier.key,
                             "from": _dt.date.fromordinal(run[0]).isoformat(),
                             "to": _dt.date.fromordinal(run[-1]).isoformat(),
                             "metrics": sorted(set().union(*(days[d] for d in run))),
                             "action": hae_action(carrier, run[0], run[-1])})
                run = []
            if day is not None:
                run.append(day)
    return sorted(actions, key=lambda f: (f["from"], f["automation"] or ""))


def _local_hours(conn: sqlite3.Connection, query: PointQuery) -> dict:
    """Local date ordinal → the buckets of ``query`` (local clock hours, or the day) that
    hold a point: by :func:`bucket_key`, the day rule of ``/api/points``.  An hour whose
    points share one whole-hour offset (the zone's, or for ``tz=local`` the one its tally
    names) lies in one local hour of one day, read from the tally in SQLite; the points
    of the other hours are read (:func:`bucket_runs`)."""
    found: dict = {}
    low, high = query.start // HOUR_US, (query.end - 1) // HOUR_US
    try:
        rows = conn.execute(
            "SELECT hour, json_extract(summary, '$.o') FROM object WHERE metric = ? AND"
            " layer = ? AND hour BETWEEN ? AND ?", (query.metric, query.layer, low, high))
        left = []
        for hour, offsets in rows:
            tally = {} if offsets is None else {"o": json.loads(offsets)}
            known = _hour_offsets(query, hour, tally)
            if not known or len(known) != 1 or known[0] % 3600:
                left.append(hour)
                continue
            date = local_ordinal(hour * HOUR_US, known[0])
            found.setdefault(date, set()).add(
                hour * HOUR_US if query.bucket == "hour" else date)
        spans = _hour_spans(left)
    except sqlite3.OperationalError:  # an SQLite without JSON functions: read the points
        spans = [(low, high)]
    for first, last in spans:
        part = _replace(query, start=max(query.start, first * HOUR_US),
                        end=min(query.end, (last + 1) * HOUR_US))
        for run in bucket_runs(conn, part):
            for key, bucket in run.buckets.items():
                date = _dt.date.fromisoformat(_bucket_place(part, key, bucket)["date"])
                found.setdefault(date.toordinal(), set()).add(key)
    return found


def _coverage_row(conn: sqlite3.Connection, item: MetricState, zone: Zone, days: list,
                  today: int, low_us: int, high_us: int) -> dict:
    if item.metric == SLEEP_METRIC and item.layer == RECORD_LAYER:  # a night on its wake day
        kind = "nights"
        hours = {day: {day} for day in sleep_wake_days(conn, zone, low_us, high_us)}
    else:
        kind = "present" if item.layer in FRESHNESS_DAY_LAYERS else "hours"
        query = PointQuery(item.metric, item.layer, low_us, high_us,
                           "day" if kind == "present" else "hour", zone)
        hours = _local_hours(conn, query)
    first_offset = zone.offset_at(item.first_hour * HOUR_US)
    first_day = local_ordinal(item.first_hour * HOUR_US,
                              item.newest_offset if first_offset is None else first_offset)
    values = [(len(hours.get(day, ())) if kind == "hours" else day in hours) for day in days]
    daily = item.spacing_s is not None and item.spacing_s <= DAILY_SPACING_S
    counted = [len(hours[day]) for day in days if day in hours and day < today]
    usual = _median(counted) if kind == "hours" and counted else None
    states = []
    for day, value in zip(days, values):
        if day > today:
            states.append("future")
        elif day == today:
            states.append("today")
        elif value:
            states.append("thin" if usual is not None and daily and value < usual / 2
                          else "ok")
        elif day < first_day:
            states.append("before")
        else:
            states.append("missing" if daily else "quiet")
    gaps, run = [], None
    for day, state in zip(days, states):
        if state in ("missing", "thin"):
            run = [day, day] if run is None else [run[0], day]
            continue
        if run is not None:
            gaps.append(run)
            run = None
    if run is not None:
        gaps.append(run)
    meaning = meaning_of(item.metric)
    return {"metric": item.metric, "layer": item.layer, "name": meaning.name,
            "group": meaning.group, "kind": kind, "state": item.state,
            "automation": item.carrier.name or item.carrier.key if item.carrier else None,
            "usual_hours": usual, "values": values, "states": states,
            "gaps": [{"from": _dt.date.fromordinal(a).isoformat(),
                      "to": _dt.date.fromordinal(b).isoformat(), "days": b - a + 1,
                      "states": sorted({states[day - days[0]] for day in range(a, b + 1)}),
                      "action": hae_action(item.carrier, a, b)} for a, b in gaps]}


# -- the notifier: a judgement a minute, each change told once -------------------------

class Notifier:
    """Freshness as ``serve`` follows it: every judgement goes through :meth:`judge`, which
    compares each automation's and metric's state with the one judged before and, on a
    change into or out of ``late`` or ``stale``, logs it and (``--notify URL``) queues one
    notice.  With a URL, a thread of its own judges every ``freshness_check_s`` and posts
    the queued notices in order, retrying a failed one after each of ``notify_retry_s``:
    ingest and the fold never wait for it.  The states found by the first judgement are
    the baseline: a restart never repeats a notice."""

    def __init__(self, config: Config, source: FreshnessSource):
        self.config, self.source = config, source
        self._lock = threading.Lock()  # one judgement and comparison at a time
        self._states: Optional[dict] = None
        self._queue: collections.deque = collections.deque()  # [notice, attempts, due]
        self._wake = threading.Event()
        self._stop = threading.Event()
        self.counts = {"sent": 0, "failures": 0, "dropped": 0}
        self.thread: Optional[threading.Thread] = None

    def judge(self) -> Freshness:
        with self._lock:
            fresh = self.source.judge()
            self._compare(fresh)
        return fresh

    def _compare(self, fresh: Freshness) -> None:
        items: dict = {("automation", a.key): a for a in fresh.automations}
        items.update((("metric", m.metric, m.layer), m) for m in fresh.metrics)
        before, self._states = self._states, {subject: item.state
                                              for subject, item in items.items()}
        if before is None:
            return
        for subject, item in items.items():
            was = before.get(subject)
            if was is None or was == item.state or not {was, item.state} & {"late", "stale"}:
                continue
            if subject[0] == "automation":
                notice = automation_notice(item, fresh.now_s)
                log_event(logging.WARNING if item.state == "late" else logging.INFO,
                          "an automation is late" if item.state == "late"
                          else "an automation delivers again", automation=item.key,
                          last_delivery=journal_time(item.last_us))
            else:
                notice = metric_notice(item, fresh.now_s)
                log_event(logging.WARNING if item.state == "stale" else logging.INFO,
                          "a metric has stopped while its automation delivers"
                          if item.state == "stale" else "a metric arrives again",
                          metric=loggable_metric(item.metric), layer=item.layer,
                          newest_point=local_iso(item.newest_us, item.newest_offset))
            if self.config.notify_url:
                self._enqueue(notice)

    def _enqueue(self, notice: Notice) -> None:
        if len(self._queue) >= NOTIFY_QUEUE_MAX:
            self._queue.popleft()
            self.counts["dropped"] += 1
            log_event(logging.WARNING, "notice dropped: too many waiting",
                      waiting=NOTIFY_QUEUE_MAX)
        self._queue.append([notice, 0, time.monotonic()])
        self._wake.set()

    # -- the thread ------------------------------------------------------------

    def start(self) -> None:
        """Judge the baseline now, before ``serve`` takes or folds a delivery, so that the
        first delivery after a start is compared with the store as it was found (a baseline
        judged later would take in what that delivery changed, and say nothing of it);
        then, with a URL, start the thread.  A fault here leaves the baseline to the first
        judgement that succeeds."""
        fresh = self._judge_or_warn()
        if not self.config.notify_url:
            return
        self.thread = threading.Thread(target=self._run, name="healthlog-notify", daemon=True)
        self.thread.start()
        counts = {} if fresh is None else {
            "late": sum(a.state == "late" for a in fresh.automations),
            "stale": sum(m.state == "stale" for m in fresh.metrics)}
        log_event(logging.INFO, "notices on", host=urllib.parse.urlsplit(
            self.config.notify_url).hostname, format=self.config.notify_format, **counts)

    def stop(self, budget: float) -> bool:
        self._stop.set()
        self._wake.set()
        if self.thread is not None:
            self.thread.join(budget)
            return not self.thread.is_alive()
        return True

    def _judge_or_warn(self) -> Optional[Freshness]:
        """:meth:`judge`; a database fault is a WARN (unless stopping) and None: judged
        again at the next check."""
        try:
            return self.judge()
        except Exception as exc:
            if not self._stop.is_set():
                log_event(logging.WARNING, "freshness could not be read; tried again later",
                          error=_error_name(exc))
            return None

    def _run(self) -> None:
        next_check = 0.0
        while not self._stop.is_set():
            now = time.monotonic()
            if now >= next_check:
                next_check = now + self.config.freshness_check_s
                if self._judge_or_warn() is None and self._stop.is_set():
                    return
            with self._lock:
                head = self._queue[0] if self._queue else None
            if head is not None and head[2] <= time.monotonic():
                self._attempt(head)
                continue
            wait = next_check - time.monotonic()
            if head is not None:
                wait = min(wait, head[2] - time.monotonic())
            self._wake.wait(max(0.0, wait))
            self._wake.clear()

    def _attempt(self, entry: list) -> None:
        notice = entry[0]
        error = self._post(notice)
        with self._lock:
            if error is None:
                self.counts["sent"] += 1
                self._forget(entry)
                log_event(logging.INFO, "notice sent", kind=notice.kind, state=notice.state)
                return
            self.counts["failures"] += 1
            entry[1] += 1
            retries = self.config.notify_retry_s
            if entry[1] > len(retries):
                self._forget(entry)
                self.counts["dropped"] += 1
                log_event(logging.WARNING, "notice dropped: the receiver did not take it",
                          kind=notice.kind, state=notice.state, attempts=entry[1], error=error)
                return
            entry[2] = time.monotonic() + retries[entry[1] - 1]
        log_event(logging.WARNING, "notice not delivered; it is sent again later",
                  kind=notice.kind, state=notice.state, attempt=entry[1], error=error,
                  retry_in_s=retries[entry[1] - 1],
                  host=urllib.parse.urlsplit(self.config.notify_url).hostname)

    def _forget(self, entry: list) -> None:
        if self._queue and self._queue[0] is entry:  # not pushed out meanwhile
            self._queue.popleft()

    def _post(self, notice: Notice) -> Optional[str]:
        """POST one notice; None when the receiver took it (2xx), else what went wrong (an
        HTTP status or an error's name, never the address: it may hold a secret)."""
        import urllib.error
        import urllib.request

        if self.config.notify_format == "json":
            body = json.dumps(notice.as_json()).encode()
            headers = {"Content-Type": "application/json"}
        else:
            text = notice.text + ("\n\n" + notice.action if notice.action else "")
            body = (text + "\n").encode()
            headers = {"Content-Type": "text/plain; charset=utf-8",
                       "Title": _header_text(notice.title)}
        request = urllib.request.Request(self.config.notify_url, data=body, headers=headers,
                                         method="POST")
        try:
            with urllib.request.urlopen(request, timeout=self.config.notify_timeout_s) as answer:
                answer.read(65536)
                status = answer.status
        except urllib.error.HTTPError as exc:
            exc.close()
            return "http_%d" % exc.code
        except Exception as exc:  # refused, timed out, a bad answer
            return "timeout" if _is_timeout(exc) else _error_name(exc)
        return None if 200 <= status < 300 else "http_%d" % status


def _header_text(text: str) -> str:
    """A header value as HTTP carries it: Latin-1 as it is, anything else as RFC 2047
    (which ntfy reads)."""
    try:
        text.encode("latin-1")
        return text
    except UnicodeEncodeError:
        return "=?UTF-8?B?%s?=" % codecs.encode(text.encode(), "base64").decode().replace(
            "\n", "")


# ==============================================================================
# Summary page: a day at a glance, against the person's own usual.
# ==============================================================================

USUAL_DAYS = 30
"""The usual is the median of the day values of the 30 days before the day shown."""
USUAL_MIN_DAYS = 5
"""Fewer days with a value than this, and there is no usual (a median of two days is no
one's usual)."""
SPARK_DAYS = 14
TREND_RECENT_DAYS = 90
TREND_BASELINE_DAYS = 365
TREND_MIN_RECENT, TREND_MIN_BASELINE = 30, 90
"""A trend compares the mean day value of the last 90 days with that of the 365 days
before, when the recent window holds at least 30 days with a value and the baseline 90; it
is flagged when the difference exceeds one standard deviation of the baseline days."""


def _layers_between(conn: sqlite3.Connection, metric: str, low: int, high: int) -> list:
    """The layers of a metric with an object in the hours ``low``..``high``."""
    return list(layer_hours(conn, metric, low, high))


_DAY_SHIFT = 1 << 20
"""Days SQLite adds to a local second before it divides by a day, and takes off after:
its integer division truncates toward zero, so a dividend kept positive floors, as a date
does (2,870 years: before any day a query can ask)."""


def _day_values_sql(conn: sqlite3.Connection, metric: str, layer: str, field: str,
                    zone: Zone, low: int, high: int) -> Optional[tuple]:
    """([(epoch day, units, count, sum)], [hours left]): per local day, from the hours'
    tallies, summed inside SQLite, for the hours whose points all lie in one local day:
    one offset (the one the fold wrote for them, ``tz=local``; the zone's) under which the
    hour crosses no local midnight; the other hours (two offsets, the hour a day in which
    a half-hour offset's midnight falls, a tally from before offsets were kept) are left
    to be read from their points.  One statement; each tally's JSON read by four scalar
    ``json_extract`` (one call of several paths costs more: the small array it builds is
    parsed again for each use).  An IANA zone: :func:`_zone_day_values`.  None where this
    SQLite has no JSON functions."""
    path = '$.f."%s"' % field.replace('"', "")
    if isinstance(zone, NamedZone):
        return _zone_day_values(conn, metric, layer, path, zone, low, high)
    local = "hour * 3600 + %s + %d" % ("o0" if zone is LOCAL_ZONE else int(zone.offset_s),
                                       _DAY_SHIFT * 86400)
    single = "o0 IS NOT NULL AND o1 IS NULL AND " if zone is LOCAL_ZONE else "has AND "
    # LIMIT -1 OFFSET 0 keeps SQLite from flattening a subquery into the next, which would
    # repeat its json_extract calls (each a parse of the whole tally) for every use.
    try:
        rows = conn.execute(
            "SELECT CASE WHEN ok THEN (%s) / 86400 - %d END, CASE WHEN ok THEN NULL ELSE hour"
            " END, units, sum(c), sum(s) FROM (SELECT hour, units, o0, c, s, coalesce(%s(%s)"
            " %% 86400 <= 82800, 0) AS ok FROM (SELECT hour, units, summary IS NOT NULL AS"
            " has, json_extract(summary, '$.o[0]') AS o0, json_extract(summary, '$.o[1]') AS"
            " o1, json_extract(summary, ?) AS c, json_extract(summary, ?) AS s FROM object"
            " WHERE metric = ? AND layer = ? AND hour BETWEEN ? AND ? LIMIT -1 OFFSET 0)"
            " LIMIT -1 OFFSET 0) WHERE NOT ok OR c IS NOT NULL GROUP BY 1, 2, 3"
            % (local, _DAY_SHIFT, single, local),
            (path + "[0]", path + "[3]", metric, layer, low, high)).fetchall()
    except sqlite3.OperationalError:
        return None
    return ([(day, units, count, total) for day, hour, units, count, total in rows
             if hour is None],
            sorted({hour for _, hour, _, _, _ in rows if hour is not None}))


def _zone_day_values(conn: sqlite3.Connection, metric: str, layer: str, path: str,
                     zone: "NamedZone", low: int, high: int) -> Optional[tuple]:
    """:func:`_day_values_sql` in an IANA zone: SQLite reads each tally's count and sum,
    and the hours are placed on the zone's days here (an hour whose offset at its start
    differs from the next hour's, a DST change, is read from its points)."""
    try:
        rows = conn.execute(
            "SELECT hour, units, summary IS NOT NULL, json_extract(summary, ?),"
            " json_extract(summary, ?) FROM object WHERE metric = ? AND layer = ? AND hour"
            " BETWEEN ? AND ?", (path + "[0]", path + "[3]", metric, layer, low, high))
        rows = rows.fetchall()
    except sqlite3.OperationalError:
        return None
    days: dict = {}
    left = []
    for hour, units, has, count, total in rows:
        offset = zone.offset_at(hour * HOUR_US)
        local = hour * 3600 + offset
        if not has or offset != zone.offset_at((hour + 1) * HOUR_US) or local % 86400 > 82800:
            left.append(hour)
        elif count is not None:
            slot = days.setdefault((local // 86400, units), [0, 0.0])
            slot[0] += count
            slot[1] += total or 0.0
    return [(day, units, count, total) for (day, units), (count, total) in days.items()], left


def day_values(conn: sqlite3.Connection, metric: str, zone: Zone, first: int,
               last: int) -> dict:
    """Local date ordinal → (value, units) of a ``total`` or ``average`` metric over the
    days ``first``..``last``: the day's sum or mean of its main field, from the first layer
    of :data:`DAY_LAYERS` that holds that day."""
    meaning = meaning_of(metric)
    field = meaning.fields[0]
    low = ((first - _EPOCH_ORDINAL) * 86400 - MAX_OFFSET_S) // 3600
    high = ((last + 1 - _EPOCH_ORDINAL) * 86400 + MAX_OFFSET_S) // 3600
    layers = _layers_between(conn, metric, low, high)
    found: dict = {}
    for layer in sorted((layer for layer in layers if layer in DAY_LAYERS),
                        key=DAY_LAYERS.index):
        totals: dict = {}  # (ordinal, units) -> [count, sum]
        fast = _day_values_sql(conn, metric, layer, field, zone, low, high)
        if fast is None:
            hours = None
        else:
            rows, hours = fast
            for epoch_day, units, count, total in rows:
                if count:
                    slot = totals.setdefault((epoch_day + _EPOCH_ORDINAL, units), [0, 0.0])
                    slot[0] += count
                    slot[1] += total or 0.0
        query = PointQuery(metric, layer, low * HOUR_US, (high + 1) * HOUR_US, "day", zone)
        for hour_range in ([None] if hours is None else _hour_spans(hours)):
            part = query if hour_range is None else _replace(
                query, start=hour_range[0] * HOUR_US, end=(hour_range[1] + 1) * HOUR_US)
            for run in bucket_runs(conn, part):
                for ordinal, bucket in run.buckets.items():
                    stats = bucket.fields.get(field)
                    if stats is not None and stats[3] is not None:
                        slot = totals.setdefault((ordinal, run.units), [0, 0.0])
                        slot[0] += stats[0]
                        slot[1] += stats[3]
        for (ordinal, units), (count, total) in totals.items():
            if first <= ordinal <= last and ordinal not in found:
                found[ordinal] = (total if meaning.kind == "total" else total / count, units)
        if all(day in found for day in range(first, last + 1)):
            break
    return found


def _usual(values: dict, day: int, units: Optional[str]) -> tuple:
    """(median, days) of the day values of the :data:`USUAL_DAYS` before ``day`` in the
    same units; the median is None with fewer than :data:`USUAL_MIN_DAYS` days."""
    before = [value for ordinal, (value, unit) in values.items()
              if day - USUAL_DAYS <= ordinal < day and unit == units]
    return (_median(before) if len(before) >= USUAL_MIN_DAYS else None), len(before)


def _spark(values: dict, day: int) -> list:
    return [{"date": _dt.date.fromordinal(ordinal).isoformat(),
             "value": values[ordinal][0] if ordinal in values else None}
            for ordinal in range(day - SPARK_DAYS + 1, day + 1)]


def _link(metric: str, day: int, days: int = SPARK_DAYS) -> dict:
    """A card's range as a query takes it: ``from`` and ``to`` both included."""
    return {"metric": metric, "from": read_day_text(day - days + 1), "to": read_day_text(day)}


def _written(metric: str, units: Optional[str]) -> dict:
    """How a card writes its numbers: its units as shown (:func:`unit_label`) and the
    decimals its meaning always shows."""
    return {"unit_label": unit_label(metric, units), "digits": meaning_of(metric).digits}


def _series_card(conn: sqlite3.Connection, metric: str, zone: Zone, day: int) -> Optional[dict]:
    values = day_values(conn, metric, zone, day - USUAL_DAYS, day)
    if not values:
        return None
    meaning = meaning_of(metric)
    value, units = values.get(day, (None, None))
    if units is None:
        units = values[max(values)][1]
    usual, usual_days = _usual(values, day, units)
    return {"metric": metric, "name": meaning.name, "render": "series", "kind": meaning.kind,
            "units": units, **_written(metric, units),
            "value": value, "usual": usual, "usual_days": usual_days,
            "spark": _spark(values, day), "link": _link(metric, day)}


def _sleep_card(conn: sqlite3.Connection, zone: Zone, day: int,
                title: str) -> Optional[dict]:
    """Last night: the night that ended on the day, its stages in the sleep meaning's order
    (``stage_order``), its fields (the main one first) with their labels, against the
    usual night."""
    if RECORD_LAYER not in metric_layers(conn, SLEEP_METRIC):
        return None
    query = PointQuery(SLEEP_METRIC, RECORD_LAYER, None, None, "day", zone,
                       day_from=day - USUAL_DAYS, day_to=day + 1)
    query = _replace(query, start=((day - USUAL_DAYS - _EPOCH_ORDINAL) * 86400
                                   - MAX_OFFSET_S) * US,
                     end=((day + 1 - _EPOCH_ORDINAL) * 86400 + MAX_OFFSET_S) * US)
    nights = {_dt.date.fromisoformat(item["date"]).toordinal(): item
              for item in sleep_buckets(sleep_nights(conn, query), query)}
    if not nights:
        return None
    asleep = {ordinal: (item["asleep"], "hr") for ordinal, item in nights.items()
              if item["asleep"] is not None}
    usual, usual_days = _usual(asleep, day, "hr")
    night = nights.get(day)
    meaning = meaning_of(SLEEP_METRIC)
    return {"metric": SLEEP_METRIC, "name": title, "render": "night", "units": "hr",
            "fields": [{"field": field, "label": meaning.label(field)}
                       for field in meaning.fields],
            "stage_order": stage_order_json(),
            "nights": night["nights"] if night else 0,
            "overlapping": night["overlapping"] if night else False,
            "naps": night["naps"] if night else [],
            "asleep": night["asleep"] if night else None,
            "in_bed": night["in_bed"] if night else None,
            "stages": night["stages"] if night else {},
            "sleep_start": night["sleep_start"] if night else None,
            "sleep_end": night["sleep_end"] if night else None,
            **(_night_words(None) if night is None else {
                key: night[key] for key in _night_words(None)}),
            "usual": usual, "usual_days": usual_days, "spark": _spark(asleep, day),
            "link": _link(SLEEP_METRIC, day)}


def _range_card(conn: sqlite3.Connection, metric: str, zone: Zone,
                day: int) -> Optional[dict]:
    """The day's lowest, average and highest of a metric whose points hold their span's
    lowest and highest (its meaning's ``bounds``: heart rate's Min and Max), the average
    that of its main field, from the finest layer with the day (:data:`DAY_LAYERS`,
    finest first)."""
    meaning = meaning_of(metric)
    low_field, high_field = meaning.bounds
    query = PointQuery(metric, "", None, None, "day", zone, day_from=day, day_to=day + 1)
    for layer in DAY_LAYERS[::-1]:
        part = _replace(query, layer=layer,
                        start=((day - _EPOCH_ORDINAL) * 86400 - MAX_OFFSET_S) * US,
                        end=((day + 1 - _EPOCH_ORDINAL) * 86400 + MAX_OFFSET_S) * US)
        for run in bucket_runs(conn, part):
            bucket = run.buckets.get(day)
            if bucket is None:
                continue
            low, mean, high = (bucket.fields.get(name)
                               for name in (low_field, meaning.fields[0], high_field))
            if mean is None:
                continue
            return {"metric": metric, "name": meaning.name, "render": "range",
                    "units": run.units, **_written(metric, run.units), "layer": layer,
                    "min": (low or mean)[1], "max": (high or mean)[2],
                    "avg": None if mean[3] is None else mean[3] / mean[0],
                    "link": _link(metric, day, 1)}
    return None


def _latest(conn: sqlite3.Connection, metric: str, zone: Zone, day: int) -> Optional[dict]:
    """The last measurement of a body metric on or before the day; ``day_value`` when it
    stands for a whole day (a layer of days: a Days automation's, at local midnight), whose
    time of day means nothing."""
    meaning = meaning_of(metric)
    end = ((day + 1 - _EPOCH_ORDINAL) * 86400 + MAX_OFFSET_S) * US
    best = None
    for layer in metric_layers(conn, metric):
        query = PointQuery(metric, layer, None, end, None, zone, day_to=day + 1)
        for units, coord, point in iter_points_newest(conn, query):
            if best is None or coord[0] > best[1][0]:
                best = (units, coord, point, layer)
            break
    if best is None:
        return None
    units, coord, point, layer = best
    offset = zone.point_offset(raw_start(point), coord[0])
    values = {name: point.get(name) for name in meaning.fields
              if type(point.get(name)) in (int, float)}
    return {"metric": metric, "name": meaning.name, "render": "latest", "units": units,
            **_written(metric, units), "values": values, "measured": local_iso(coord[0], offset),
            "day_value": layer in DAY_ONLY_LAYERS, "link": _link(metric, day, 90)}


def _other_today(conn: sqlite3.Connection, zone: Zone, day: int, shown: set) -> list:
    """Everything else recorded on the day: a value per series, a count per list."""
    low = ((day - _EPOCH_ORDINAL) * 86400 - MAX_OFFSET_S) // 3600
    high = ((day + 1 - _EPOCH_ORDINAL) * 86400 + MAX_OFFSET_S) // 3600
    metrics = [metric for metric in stored_metrics(conn)
               if metric not in shown and _layers_between(conn, metric, low, high)]
    out = []
    for metric in metrics:
        meaning = meaning_of(metric)
        if meaning.kind in ("total", "average"):
            found = day_values(conn, metric, zone, day, day).get(day)
            if found is not None:
                out.append({"metric": metric, "name": meaning.name, "kind": meaning.kind,
                            "value": found[0], "units": found[1],
                            **_written(metric, found[1]), "link": _link(metric, day)})
        elif meaning.kind == "events":
            query = PointQuery(metric, RECORD_LAYER, low * HOUR_US, (high + 1) * HOUR_US,
                               None, zone, day_from=day, day_to=day + 1)
            count = sum(1 for _ in iter_points(conn, query))
            if count:
                out.append({"metric": metric, "name": meaning.name, "kind": "events",
                            "value": count, "units": None, "link": _link(metric, day)})
    return out


def trends(conn: sqlite3.Connection, zone: Zone, day: int) -> list:
    """Per series metric where a direction means something (the meaning's ``better``), the
    mean day value of the last :data:`TREND_RECENT_DAYS` days against the
    :data:`TREND_BASELINE_DAYS` before; flagged past one standard deviation of the baseline
    days, when both windows hold enough days (:data:`TREND_MIN_RECENT`,
    :data:`TREND_MIN_BASELINE`)."""
    first = day - TREND_RECENT_DAYS - TREND_BASELINE_DAYS + 1
    out = []
    for metric in stored_metrics(conn):
        meaning = meaning_of(metric)
        if meaning.kind not in ("total", "average") or meaning.better is None:
            continue
        values = day_values(conn, metric, zone, first, day)
        if not values:
            continue
        units = values[max(values)][1]
        recent = [v for o, (v, u) in values.items() if o > day - TREND_RECENT_DAYS and u == units]
        base = [v for o, (v, u) in values.items() if o <= day - TREND_RECENT_DAYS and u == units]
        if len(recent) < TREND_MIN_RECENT or len(base) < TREND_MIN_BASELINE:
            continue
        mean_recent, mean_base = sum(recent) / len(recent), sum(base) / len(base)
        spread = math.sqrt(sum((v - mean_base) ** 2 for v in base) / (len(base) - 1))
        change = mean_recent - mean_base
        direction = "up" if change > 0 else "down" if change < 0 else None
        out.append({"metric": metric, "name": meaning.name, "units": units,
                    **_written(metric, units), "recent": mean_recent, "baseline": mean_base,
                    "baseline_sd": spread,
                    "recent_days": len(recent), "baseline_days": len(base), "change": change,
                    "flagged": abs(change) > spread, "direction": direction,
                    "better": None if direction is None else direction == meaning.better,
                    "link": _link(metric, day, TREND_RECENT_DAYS + TREND_BASELINE_DAYS)})
    return out


WEEK_DAYS = 7
"""A ``week`` card lists the records of the 7 days ending on the day."""


def _week_of(conn: sqlite3.Connection, metric: str, zone: Zone, day: int) -> list:
    """The records of the :data:`WEEK_DAYS` ending on the day, newest first: workouts as
    /api/workouts lists them (a workout recorded twice marked, :func:`mark_duplicates`),
    others as /api/records."""
    if conn.execute("SELECT 1 FROM object WHERE metric = ? LIMIT 1",
                    (metric,)).fetchone() is None:
        return []
    bounds = {"tz": zone.name, "from": read_day_text(day - WEEK_DAYS + 1),
              "to": read_day_text(day)}
    if metric == WORKOUT_METRIC:  # with ids, and a workout recorded twice marked
        return list_workouts(conn, bounds, limit=100)["workouts"]
    return records(conn, dict(bounds, metric=metric, limit="100"))["items"]


def _newest_day(conn: sqlite3.Connection, zone: Zone) -> int:
    """The local date of the newest point of any series or night (today, for a phone that
    pushes): where a person opening the page expects to land."""
    row = None  # (last_at, metric, layer, hour) of the object with the newest start
    for metric in stored_metrics(conn):  # a seek per metric and layer: never a scan
        for layer in metric_layers(conn, metric):
            if layer == RECORD_LAYER and metric != SLEEP_METRIC:
                continue
            last_at, hour = conn.execute(
                "SELECT last_at, hour FROM object WHERE metric = ? AND layer = ?"
                " ORDER BY hour DESC LIMIT 1", (metric, layer)).fetchone()
            if row is None or last_at > row[0]:
                row = (last_at, metric, layer, hour)
    if row is None:
        return utc_now().date().toordinal()
    _, metric, layer, hour = row
    query = PointQuery(metric, layer, hour * HOUR_US, (hour + 1) * HOUR_US, None, zone)
    newest = None
    for _, coord, point in iter_points(conn, query):
        newest = (coord[0], zone.point_offset(raw_start(point), coord[0]))
    if newest is None:
        return utc_now().date().toordinal()
    return local_ordinal(*newest)


def summary(conn: sqlite3.Connection, args: Mapping[str, Optional[str]],
            fresh: Optional[Freshness] = None) -> dict:
    """``GET /api/summary?date=YYYY-MM-DD&tz=…``: what the summary page shows, for one local
    day (default: the day of the newest point, in its own local time); with ``fresh``, its
    ``attention``: a notice for what is late or stale now, whatever the day.  Its cards are
    the meaning table's (:data:`SUMMARY_CARDS`): ``cards`` by group, and ``card_order`` the
    groups in their order with their titles, metrics and ``render``, so that the page draws
    what it is sent."""
    zone = parse_zone(args.get("tz"))
    day = read_day("date", args.get("date"))
    if day is None:
        day = _newest_day(conn, zone)
    cards: dict = {}
    order = []
    shown = {metric for group in SUMMARY_CARDS for metric in group.metrics}
    for group in SUMMARY_CARDS:  # the meaning table's cards, in its order
        entry = group.as_json()
        if group.render == "series":
            found = [(_range_card if meaning_of(metric).bounds else _series_card)(
                conn, metric, zone, day) for metric in group.metrics]
            cards[group.group] = [card for card in found if card is not None]
        elif group.render == "latest":
            found = [_latest(conn, metric, zone, day) for metric in group.metrics]
            cards[group.group] = [card for card in found if card is not None]
        elif group.render == "night":
            cards[group.group] = _sleep_card(conn, zone, day, group.title)
        elif group.render == "week":
            [metric] = group.metrics
            cards[group.group] = _week_of(conn, metric, zone, day)
            entry["link"] = _link(metric, day, WEEK_DAYS)
            if metric == WORKOUT_METRIC:  # their count and time, each workout once
                entry.update(workout_totals(cards[group.group]))
        else:
            cards[group.group] = _other_today(conn, zone, day, shown)
        order.append(entry)
    return {"date": _dt.date.fromordinal(day).isoformat(), "tz": zone.name,
            "attention": [] if fresh is None else [n.as_json() for n in attention(fresh)],
            "usual": {"days": USUAL_DAYS, "min_days": USUAL_MIN_DAYS, "rule": "median"},
            "card_order": order, "cards": cards, "trends": trends(conn, zone, day),
            "trend_rule": {"recent_days": TREND_RECENT_DAYS,
                           "baseline_days": TREND_BASELINE_DAYS,
                           "min_recent_days": TREND_MIN_RECENT,
                           "min_baseline_days": TREND_MIN_BASELINE,
                           "flagged_when": "the difference of the means exceeds one standard"
                                           " deviation of the baseline days"}}


# ==============================================================================
# Export: the SQLite file of every point with its local time, and every night.
# ==============================================================================

# -- export: the same replies on the command line, and a flat SQLite file ------------

EXPORT_COLUMNS = ("qty", "value", "min", "avg", "max", "source")
"""Fields of a point that get a column of their own in an exported SQLite file."""

_EXPORT_SCHEMA = """
CREATE TABLE points (metric TEXT NOT NULL, layer TEXT NOT NULL, start TEXT NOT NULL,
                     "end" TEXT NOT NULL, local_start TEXT NOT NULL, local_date TEXT NOT NULL,
                     units TEXT, qty REAL, value TEXT, min REAL, avg REAL, max REAL,
                     source TEXT, extra TEXT);
CREATE TABLE metrics (metric TEXT NOT NULL, layer TEXT NOT NULL, name TEXT NOT NULL,
                      kind TEXT NOT NULL, "group" TEXT NOT NULL, units TEXT, points INTEGER,
                      first TEXT, last TEXT, first_local TEXT, last_local TEXT);
CREATE TABLE nights (date TEXT NOT NULL, kind TEXT NOT NULL, sleep_start TEXT,
                     sleep_end TEXT NOT NULL, start TEXT, "end" TEXT NOT NULL, asleep REAL,
                     in_bed REAL, deep REAL, core REAL, rem REAL, unspecified REAL,
                     awake REAL, overlapping INTEGER NOT NULL, form TEXT NOT NULL,
                     counted TEXT, scaled INTEGER NOT NULL);
"""
"""``metrics``: one row per metric and layer, as ``/api/catalog`` and ``healthlog
catalog`` give it: the meaning's display ``name``, ``kind`` and ``group``, the units, the
number of points, the ``first`` and ``last`` start in UTC and, as the catalog table prints
them, in the local time each was written in (``first_local``, ``last_local``).
``nights``: one row per sleep by the one sleep rule (:func:`sleep_nights`): ``kind`` is
``night`` (a date's longest sleep that is no nap) or ``nap`` (a date of naps only has nap
rows alone); ``date`` the local date it ended; ``sleep_start``/``sleep_end`` local,
``start``/``end`` UTC (the start empty where the bedtime is not known); hours asleep, in
bed and per stage as shown (``unspecified``: the stage "asleep, no stage"), never adding
up to more than asleep; ``overlapping`` 1 where its figures said more than its limit;
``counted`` which figure gives asleep (``total``, ``staged``, ``unspecified``, ``union``);
``scaled`` 1 where its stages are shares of a figure cut to its limit."""

_EXPORT_INDEXES = """
CREATE INDEX points_metric ON points (metric, layer, start);
CREATE INDEX points_start ON points (start);
CREATE INDEX points_local_date ON points (local_date);
CREATE INDEX nights_date ON nights (date);
"""


NIGHT_COLUMNS = 17
"""The columns of the exported ``nights`` table."""


def _night_rows(days: list) -> Iterator[tuple]:
    for day in days:
        for kind, sleep in ([("night", day.night)] if day.night else []) + [
                ("nap", nap) for nap in day.naps]:
            yield (_dt.date.fromordinal(sleep.date).isoformat(), kind,
                   _local_text(sleep.start, sleep.start_offset),
                   local_iso(sleep.end, sleep.end_offset),
                   None if sleep.start is None else format_instant(sleep.start),
                   format_instant(sleep.end), sleep.asleep, sleep.in_bed,
                   sleep.stages.get("deep"), sleep.stages.get("core"), sleep.stages.get("rem"),
                   sleep.stages.get(UNSPECIFIED), sleep.stages.get(AWAKE),
                   int(sleep.overlapping), sleep.form, sleep.counted, int(sleep.scaled))


def _export_row(metric: str, layer: str, units: Optional[str], coord: tuple, point: dict,
                day: Optional[int] = None) -> tuple:
    """One row of ``points``.  ``extra`` holds the fields no column holds: not the
    timestamps the point was placed by (:func:`point_span`: its start and end key), which
    ``start``, ``end`` and ``local_start`` give, so no row repeats its date as text."""
    lowered = {}
    extra = {}
    placed = _placing_keys(point)
    for key, value in point.items():
        name = key.lower()
        if name in EXPORT_COLUMNS and name not in lowered and (
                type(value) in (int, float) if name in ("qty", "min", "avg", "max")
                else type(value) is str):
            lowered[name] = value
        elif key not in placed:
            extra[key] = value
    offset = text_offset(raw_start(point), coord[0])
    return ((metric, layer, format_instant(coord[0]), format_instant(coord[1]),
             local_iso(coord[0], offset),
             _dt.date.fromordinal(local_ordinal(coord[0], offset) if day is None
                                  else day).isoformat(), units)
            + tuple(lowered.get(name) for name in EXPORT_COLUMNS)
            + (json.dumps(extra, ensure_ascii=False) if extra else None,))


_WORKOUT_SCHEMA = """
CREATE TABLE workouts (id TEXT NOT NULL, name TEXT, activity TEXT NOT NULL, start TEXT NOT NULL,
                       "end" TEXT NOT NULL, local_start TEXT NOT NULL, local_end TEXT NOT NULL,
                       local_date TEXT NOT NULL, duration_s REAL, distance REAL,
                       distance_units TEXT, active_energy REAL, active_energy_units TEXT,
                       total_energy REAL, total_energy_units TEXT, average_heart_rate REAL,
                       max_heart_rate REAL, heart_rate_units TEXT, elevation_gain REAL,
                       elevation_units TEXT, route_points INTEGER NOT NULL,
                       has_heart_rate INTEGER NOT NULL, source TEXT, duplicate_of TEXT,
                       version INTEGER NOT NULL);
CREATE TABLE workout_route (workout_id TEXT NOT NULL, seq INTEGER NOT NULL, time TEXT,
                            local_time TEXT, latitude REAL NOT NULL, longitude REAL NOT NULL,
                            altitude REAL, speed REAL, course REAL, horizontal_accuracy REAL,
                            vertical_accuracy REAL, heart_rate REAL);
"""
"""``workouts``: one row a workout (:func:`workout_listing`), its figures as sent, its UTC and
local times (as the phone wrote them) and ``duplicate_of`` (the id of the one shown first,
for a workout recorded twice); ``workout_route``: one row a route point with a position, in
the order sent (``seq`` from 0), its time in UTC and as the phone wrote it, and the heart
rate of the nearest session sample within :data:`HEART_NEAREST_S`."""

_WORKOUT_INDEXES = """
CREATE INDEX workouts_id ON workouts (id);
CREATE INDEX workouts_start ON workouts (start);
CREATE INDEX workout_route_workout ON workout_route (workout_id, seq);
"""


def _route_rows(workout: StoredWorkout) -> Iterator[tuple]:
    session = workout_heart(workout.point, workout.coord).session
    times = [s[0] for s in session]
    for seq, (lat, lon, alt, instant, item) in enumerate(
            route_positions(_series(workout.point, "route"))):
        raw = item.get("timestamp", item.get("date"))
        yield (workout.id, seq, None if instant is None else format_instant(instant),
               None if instant is None else local_iso(instant, text_offset(raw, instant)),
               lat, lon, alt, _number(item.get("speed")), _number(item.get("course")),
               _number(item.get("horizontalAccuracy")), _number(item.get("verticalAccuracy")),
               nearest_heart(times, session, instant))


def _amount(found: Optional[dict]) -> tuple:
    return (found["qty"], found["units"]) if found else (None, None)


def _workout_row(item: dict, sent: tuple) -> tuple:
    """A row of ``workouts``; ``sent``: the active energy and the climb as sent."""
    average, highest = _amount(item["average_heart_rate"]), _amount(item["max_heart_rate"])
    return ((item["id"], item["name"], item["activity"], item["start"], item["end"],
             item["local_start"], item["local_end"], item["date"], item["duration_s"])
            + _amount(item["distance"]) + _amount(sent[0]) + _amount(item["total_energy"])
            + (average[0], highest[0], average[1] or highest[1]) + _amount(sent[1])
            + (item["route_points"], int(item["has_heart_rate"]), item["source"],
               item["duplicate_of"], item["version"]))


def export_workouts(conn: sqlite3.Connection, target: sqlite3.Connection,
                    scratch: Optional[Path] = None) -> int:
    """Every stored workout into ``workouts`` and its whole route into ``workout_route``
    (:data:`_WORKOUT_SCHEMA`), an object at a time (a large one's arrays read from a
    scratch file under ``scratch``); duplicates are marked once all are read.  Returns
    the number of workouts."""
    entries, sent = [], []
    with contextlib.closing(_workout_rows(conn, -(1 << 62), 1 << 62)) as rows:
        for row in rows:
            for workout in _workouts_of(row, scratch):
                point = workout.point
                entries.append((workout_listing(workout, LOCAL_ZONE), workout.coord))
                sent.append((_quantity(point.get("activeEnergyBurned"))
                             or _quantity(point.get("activeEnergy")), _elevation_sent(point)))
                target.executemany("INSERT INTO workout_route VALUES (%s)" % ",".join(
                    "?" * 12), _route_rows(workout))
    mark_duplicates(entries)
    target.executemany("INSERT INTO workouts VALUES (%s)" % ",".join("?" * 25), (
        _workout_row(item, figures) for (item, _), figures in zip(entries, sent)))
    return len(entries)


# -- GPX: a workout's route as Strava, Garmin and others take it --------------------

GPX_NAMESPACES = (
    'xmlns="http://www.topografix.com/GPX/1/1"'
    ' xmlns:gpxtpx="http://www.garmin.com/xmlschemas/TrackPointExtension/v1"'
    ' xmlns:xsi="http://www.w3.org/2001/XMLSchema-instance"'
    ' xsi:schemaLocation="http://www.topografix.com/GPX/1/1'
    ' http://www.topografix.com/GPX/1/1/gpx.xsd'
    ' http://www.garmin.com/xmlschemas/TrackPointExtension/v1'
    ' http://www8.garmin.com/xmlschemas/TrackPointExtensionv1.xsd"')
_XML_NOT_TEXT = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\ufffe\uffff]")


def _xml_text(text: str) -> str:
    """Text as XML character data (the characters XML 1.0 cannot hold left out)."""
    return _XML_NOT_TEXT.sub("", text).replace("&", "&amp;").replace("<", "&lt;").replace(
        ">", "&gt;")


def gpx_pieces(workout: StoredWorkout) -> Iterator[bytes]:
    """A workout's GPX 1.1, in pieces of about :data:`STREAM_CHUNK`: one ``trk`` named by the
    workout, its activity in ``type``, one ``trkseg`` of every route point with a position,
    each with ``ele`` (its altitude), ``time`` (UTC) and, in Garmin's
    ``TrackPointExtension``, ``gpxtpx:hr``: the session sample nearest in time within
    :data:`HEART_NEAREST_S`, rounded (never interpolated).  :class:`NoRoute` at once,
    before any piece, when there is no route point with a position."""
    route = _series(workout.point, "route")
    if next(route_positions(route), None) is None:
        raise NoRoute("this workout has no route: there is nothing to write as GPX")
    return _gpx_stream(workout, route)


def _gpx_stream(workout: StoredWorkout, route: Any) -> Iterator[bytes]:
    point = workout.point
    name = _xml_text(point["name"]) if type(point.get("name")) is str else "Workout"
    activity = workout_activity(point)
    session = workout_heart(point, workout.coord).session
    times = [s[0] for s in session]
    parts = ['<?xml version="1.0" encoding="UTF-8"?>\n<gpx version="1.1" creator="healthlog'
             ' %s" %s>\n<metadata><name>%s</name><time>%s</time></metadata>\n<trk><name>%s'
             '</name><type>%s</type><trkseg>\n' % (
                 __version__, GPX_NAMESPACES, name, format_instant(workout.coord[0]), name,
                 activity if activity != "other" else name)]
    size = len(parts[0])
    for lat, lon, alt, instant, _ in route_positions(route):
        text = '<trkpt lat="%r" lon="%r">' % (lat, lon)
        if alt is not None:
            text += "<ele>%r</ele>" % alt
        if instant is not None:
            text += "<time>%s</time>" % format_instant(instant)
        bpm = nearest_heart(times, session, instant)
        if bpm is not None:
            text += ("<extensions><gpxtpx:TrackPointExtension><gpxtpx:hr>%d</gpxtpx:hr>"
                     "</gpxtpx:TrackPointExtension></extensions>" % round(bpm))
        parts.append(text + "</trkpt>\n")
        size += len(text) + 9
        if size >= STREAM_CHUNK:
            yield "".join(parts).encode("utf-8")
            parts, size = [], 0
    parts.append("</trkseg></trk>\n</gpx>\n")
    yield "".join(parts).encode("utf-8")


def gpx_file_name(item: dict) -> str:
    """``2025-05-03-0710-running.gpx``: a workout's local start as the phone wrote it and its
    activity (else its name in letters and digits, else ``workout``)."""
    local = item["local_start"]
    what = item["activity"] if item["activity"] != "other" else re.sub(
        r"[^a-z0-9]+", "-", (item["name"] or "").lower()).strip("-") or "workout"
    return "%s-%s%s-%s.gpx" % (local[:10], local[11:13], local[14:16], what[:40])


def _placing_keys(point: dict) -> tuple:
    """The keys :func:`point_span` read a point's start and end from (as :func:`raw_start`
    and its end: the first of them that is not null)."""
    get = point.get
    start = ("start" if get("start") is not None else "startDate"
             if get("startDate") is not None else "date")
    end = "end" if get("end") is not None else "endDate"
    return (start, end) if get(end) is not None else (start,)


def export_sqlite(conn: sqlite3.Connection, out: Path, scratch: Optional[Path] = None) -> int:
    """Every stored point as one row of a flat ``points`` table in a new SQLite file, the
    shape Datasette and sqlite-utils open directly, every sleep as a row of ``nights`` (a
    sleep point's ``local_date`` is the day its sleep ended), and every workout as a row of
    ``workouts`` with its route in ``workout_route`` (:func:`export_workouts`); returns the
    number of points."""
    target = sqlite3.connect(str(out), isolation_level=None)
    written = 0
    try:
        target.executescript(_EXPORT_SCHEMA)
        target.executescript(_WORKOUT_SCHEMA)
        target.execute("BEGIN")
        for metric, layer in conn.execute(
                "SELECT DISTINCT metric, layer FROM object ORDER BY metric, layer").fetchall():
            query = PointQuery(metric, layer)
            sleep = None
            if query.sleep_stages:  # sleep's layer: each night once
                nights = sleep_nights(conn, query)
                target.executemany("INSERT INTO nights VALUES (%s)"
                                   % ",".join("?" * NIGHT_COLUMNS),
                                   _night_rows(nights))
                sleep = SleepDates(nights, LOCAL_ZONE)
            rows = (_export_row(metric, layer, units, coord, point,
                                None if sleep is None else sleep.of(point, coord))
                    for units, coord, point in iter_points(conn, query))
            before = target.total_changes
            target.executemany("INSERT INTO points VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?)", rows)
            written += target.total_changes - before
        for item in catalog(conn):
            meaning = item["meaning"]
            target.execute("INSERT INTO metrics VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                           (item["metric"], item["layer"], meaning["name"], meaning["kind"],
                            meaning["group"], ",".join(item["units"]) or None,
                            item["points"], item["first"], item["last"])
                           + catalog_local(conn, item))
        export_workouts(conn, target, scratch)
        target.execute("COMMIT")
        target.executescript(_EXPORT_INDEXES)
        target.executescript(_WORKOUT_INDEXES)
    finally:
        target.close()
    return written


# ==============================================================================
# Observability: the figures of /metrics, /healthz and status.
# ==============================================================================

WORKER_STATES = ("starting", "idle", "folding", "restarting", "stopped")


def failed_by_error(conn: sqlite3.Connection) -> dict:
    """Failed deliveries per error class (duplicates name no class of their own)."""
    return dict(conn.execute("SELECT error, count(*) FROM delivery WHERE parse_status ="
                             " 'failed' GROUP BY error ORDER BY error"))


def count_exhausted(conn: sqlite3.Connection) -> int:
    """Deliveries failed because their attempts ran out: ``/healthz`` says degraded."""
    return conn.execute("SELECT count(*) FROM delivery WHERE parse_status = 'failed'"
                        " AND error = ?", (ATTEMPTS_EXHAUSTED,)).fetchone()[0]


def store_figures(conn: sqlite3.Connection) -> tuple:
    """(deliveries per status, oldest pending received_at or None, its age in seconds or
    None, objects, points): what ``status`` and ``/metrics`` both report."""
    counts = _status_counts(conn)
    oldest = conn.execute("SELECT min(received_at) FROM delivery"
                          " WHERE parse_status = 'pending'").fetchone()[0]
    age = None if oldest is None else (utc_now() - parse_received_at(oldest)).total_seconds()
    objects, points = conn.execute(
        "SELECT count(*), coalesce(sum(points), 0) FROM object").fetchone()
    return counts, oldest, age, objects, points


def _label(value: str) -> str:
    """A Prometheus label value, escaped."""
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def render_metrics(conn: sqlite3.Connection, ingest_seconds: Histogram, fold_seconds: Histogram,
                   worker_state: str, fresh: Optional[Freshness] = None,
                   notices: Optional[Mapping[str, int]] = None) -> bytes:
    """Prometheus text format: the journal, the store and this process's timings; never a
    health value.  The only names from the user's data are those of the freshness
    gauges: each automation's id and name and each watched metric's name and layer."""
    conn.execute("BEGIN")  # one snapshot
    try:
        counts, _, age, objects, points = store_figures(conn)
        received, received_bytes, overwrites, conflicts = conn.execute(
            "SELECT count(*), coalesce(sum(body_bytes), 0), coalesce(sum(overwrites), 0),"
            " coalesce(sum(unit_conflicts), 0) FROM delivery").fetchone()
        failed = failed_by_error(conn)
    finally:
        conn.execute("COMMIT")
    age = age or 0.0
    lines = []

    def family(name: str, kind: str, help_text: str, samples: list) -> None:
        lines.extend(["# HELP %s %s" % (name, help_text), "# TYPE %s %s" % (name, kind)])
        lines.extend("%s%s %s" % (name, labels, value) for labels, value in samples)

    family("healthlog_deliveries", "gauge", "Deliveries in the journal by status.",
           [('{status="%s"}' % status, counts[status]) for status in STATUSES])
    family("healthlog_backlog", "gauge", "Deliveries waiting to be folded.",
           [("", counts["pending"])])
    family("healthlog_failed_deliveries", "gauge",
           "Failed deliveries by error class (%s: tried %d times without an outcome)."
           % (ATTEMPTS_EXHAUSTED, FOLD_ATTEMPTS_MAX),
           [('{error="%s"}' % _label(error or ""), n) for error, n in failed.items()])
    family("healthlog_oldest_pending_age_seconds", "gauge",
           "Age of the oldest pending delivery (0 when none).", [("", round(age, 3))])
    family("healthlog_received_deliveries_total", "counter", "Deliveries journaled.",
           [("", received)])
    family("healthlog_received_bytes_total", "counter", "Body bytes journaled.",
           [("", received_bytes)])
    family("healthlog_objects", "gauge", "Hourly objects in the store.", [("", objects)])
    family("healthlog_points", "gauge", "Points in the store.", [("", points)])
    family("healthlog_overwrites_total", "counter",
           "Stored points replaced by a different value.", [("", overwrites)])
    family("healthlog_unit_conflicts_total", "counter",
           "Hours whose arriving points had other units than the stored object.",
           [("", conflicts)])
    family("healthlog_worker_up", "gauge", "1 while the fold thread runs.",
           [("", int(worker_state in ("idle", "folding")))])
    family("healthlog_worker_state", "gauge", "The fold thread's state.",
           [('{state="%s"}' % state, int(state == worker_state)) for state in WORKER_STATES])
    family("healthlog_info", "gauge", "healthlog's version.",
           [('{version="%s"}' % __version__, 1)])
    if fresh is not None:
        def who(a: AutomationState) -> str:
            return '{automation="%s",name="%s"}' % (_label(a.key), _label(a.name or ""))

        def what(m: MetricState) -> str:
            return '{metric="%s",layer="%s"}' % (_label(m.metric), _label(m.layer))

        family("healthlog_automation_last_delivery_timestamp_seconds", "gauge",
               "When each automation's last delivery was received (epoch seconds).",
               [(who(a), round(a.last_us / US, 3)) for a in fresh.automations])
        family("healthlog_automation_late", "gauge",
               "1 while an automation is silent longer than its threshold.",
               [(who(a), int(a.state == "late")) for a in fresh.automations])
        family("healthlog_automation_threshold_seconds", "gauge",
               "The silence after which each automation is late.",
               [(who(a), round(float(a.threshold_s), 3)) for a in fresh.automations])
        family("healthlog_metric_newest_point_timestamp_seconds", "gauge",
               "The start of each metric's newest point (epoch seconds).",
               [(what(m), round(m.newest_us / US, 3)) for m in fresh.metrics])
        family("healthlog_metric_stale", "gauge",
               "1 while a metric has stopped arriving though an automation that carries it"
               " keeps delivering.", [(what(m), int(m.state == "stale")) for m in fresh.metrics])
    if notices is not None:
        family("healthlog_notices_sent_total", "counter", "Notices the receiver took (2xx).",
               [("", notices.get("sent", 0))])
        family("healthlog_notice_failures_total", "counter",
               "Attempts to send a notice that failed (error, timeout or not 2xx).",
               [("", notices.get("failures", 0))])
        family("healthlog_notices_dropped_total", "counter",
               "Notices given up after their last retry, or pushed out of a full queue.",
               [("", notices.get("dropped", 0))])
    lines += ingest_seconds.render("healthlog_ingest_seconds",
                                   "POST /api/ingest answer time, by status code.")
    lines += fold_seconds.render("healthlog_fold_seconds", "Fold time per delivery, by outcome.")
    return ("\n".join(lines) + "\n").encode()


# ==============================================================================
# Web sign-in: session cookies, the guess limiter, the client behind a proxy.
# ==============================================================================

# -- sessions: the dashboard's sign-in --------------------------------------------

SESSION_COOKIE = "healthlog_session"


def session_value(token: bytes, session_id: str, expiry: int) -> str:
    """``<id>.<expiry>.<HMAC-SHA256(token, "session:<id>:<expiry>")>``: unforgeable without
    the token, which the cookie never contains.  The id names a row of the ``session``
    table: signing out deletes it, and a cookie without its row opens nothing."""
    digest = hmac.new(token, ("session:%s:%d" % (session_id, expiry)).encode(),
                      hashlib.sha256).hexdigest()
    return "%s.%d.%s" % (session_id, expiry, digest)


_SESSION_VALUE = re.compile(r"([0-9a-f]{32})\.([0-9]{1,12})\.[0-9a-f]{64}", re.ASCII)


def session_parts(token: bytes, value: str, now: float) -> Optional[tuple]:
    """(id, expiry) of a session cookie signed with ``token`` and not expired, else None
    (whether the session still exists is the ``session`` table's to say)."""
    match = _SESSION_VALUE.fullmatch(value)
    if not token or match is None or int(match.group(2)) < now:
        return None
    session_id, expiry = match.group(1), int(match.group(2))
    if not hmac.compare_digest(session_value(token, session_id, expiry).encode(),
                               value.encode("latin-1", "replace")):
        return None
    return session_id, expiry


class GuessLimiter:
    """Wrong tokens per client address (RELY-7.8): slowed, then answered 429, without a
    right token ever being refused.  The token is compared before the limiter is asked,
    so a phone that shares an address with a stranger (behind a reverse proxy that is not
    named in ``--trusted-proxy``, or a carrier's NAT) keeps delivering whatever the
    stranger sends.

    The first :data:`GUESSES_FREE` wrong tokens of a burst are answered at once, the next
    ones after a delay that doubles, and from :data:`GUESSES_BEFORE_LOCKOUT` on at once
    with 429 for a lockout that doubles with each further one.  At most
    :data:`GUESS_WAITERS_MAX` wrong answers wait at a time, whatever their addresses; one
    beyond them is 429 at once.  A right token does not end a burst: behind a shared
    address it would hand the stranger a fresh one.  Thread-safe; in memory only."""

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self._clock = clock
        self._lock = threading.Lock()
        self._failures: collections.OrderedDict = collections.OrderedDict()  # address ->
        # [failures in the burst, time of the last one]
        self._waiters = threading.BoundedSemaphore(GUESS_WAITERS_MAX)

    @staticmethod
    def _lockout(failures: int) -> float:
        if failures < GUESSES_BEFORE_LOCKOUT:
            return 0.0
        doublings = min(failures - GUESSES_BEFORE_LOCKOUT, 32)  # a storm counts thousands
        return min(GUESS_LOCKOUT_S * 2 ** doublings, GUESS_LOCKOUT_MAX_S)

    def refused_for(self, address: str) -> float:
        """Seconds for which wrong tokens from ``address`` are still answered 429."""
        with self._lock:
            entry = self._failures.get(address)
        if entry is None:
            return 0.0
        return max(0.0, entry[1] + self._lockout(entry[0]) - self._clock())

    def failed(self, address: str) -> tuple:
        """Count a wrong token of ``address``: (failures in its burst, seconds to wait
        before answering 401, or None: answer 429 now, for as long as
        :meth:`refused_for` says)."""
        now = self._clock()
        with self._lock:
            entry = self._failures.pop(address, None)
            if entry is None or now - entry[1] > GUESS_BURST_GAP_S + self._lockout(entry[0]):
                entry = [0, now]
            locked = now < entry[1] + self._lockout(entry[0])
            entry[0] += 1
            entry[1] = now
            self._failures[address] = entry  # the most recent last
            while len(self._failures) > GUESS_ADDRESSES_MAX:
                self._failures.popitem(last=False)
            failures = entry[0]
        if locked:
            return failures, None
        if failures <= GUESSES_FREE:
            return failures, 0.0
        return failures, min(0.1 * 2 ** (failures - GUESSES_FREE - 1), GUESS_DELAY_MAX_S)

    @contextlib.contextmanager
    def waiting(self) -> Iterator[bool]:
        """A place among the wrong answers that wait out their delay: yields False when
        every place is taken (answer 429 at once instead)."""
        got = self._waiters.acquire(blocking=False)
        try:
            yield got
        finally:
            if got:
                self._waiters.release()


# -- the client's address, behind a reverse proxy or not ------------------------------


_FORWARDED_FOR = re.compile(r'(?:^|;)\s*for\s*=\s*("[^"]*"|[^;,\s]*)', re.IGNORECASE)


def _hop_address(text: str) -> str:
    """One hop of a forwarding header as an address: quotes, brackets and a port
    removed; what is not an address becomes ``unknown``."""
    text = text.strip().strip('"')
    if text.startswith("["):
        text = text[1:].partition("]")[0]
    elif text.count(":") == 1:  # IPv4 with a port
        text = text.partition(":")[0]
    try:
        address = ipaddress.ip_address(text)
    except ValueError:
        return "unknown"
    mapped = getattr(address, "ipv4_mapped", None)
    return str(mapped or address)


def forwarded_hops(environ: Mapping[str, Any]) -> list:
    """The addresses a request passed through, nearest last: ``X-Forwarded-For`` when it
    is there (nginx and Caddy write it), else the ``for=`` of ``Forwarded`` (RFC 7239)."""
    chain = environ.get("HTTP_X_FORWARDED_FOR")
    if chain is not None:
        return [_hop_address(hop) for hop in chain.split(",")]
    forwarded = environ.get("HTTP_FORWARDED")
    if forwarded is not None:
        return [_hop_address(match.group(1)) for element in forwarded.split(",")
                for match in [_FORWARDED_FOR.search(element)] if match]
    return []


def _is_trusted(address: str, trusted: Sequence) -> bool:
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return False
    ip = getattr(ip, "ipv4_mapped", None) or ip
    return any(ip in network for network in trusted)


def client_address(environ: Mapping[str, Any], trusted: Sequence) -> tuple:
    """(the client's address, whether forwarding headers came from an untrusted peer).

    From a peer named in ``--trusted-proxy`` the client is the nearest hop of the
    forwarding headers that is not itself trusted (a hop a client wrote further left
    is never believed); from any other peer the headers are ignored."""
    peer = _hop_address(environ.get("REMOTE_ADDR") or "")
    if peer == "unknown":
        peer = environ.get("REMOTE_ADDR") or "-"
    hops = forwarded_hops(environ)
    if not trusted or not _is_trusted(peer, trusted):
        return peer, bool(hops) or "HTTP_X_REAL_IP" in environ
    for hop in reversed(hops):
        if not _is_trusted(hop, trusted):  # a hop that names no address: the proxy's own
            return (peer if hop == "unknown" else hop), False
    return (hops[0] if hops else peer), False


# ==============================================================================
# MCP: read-only tools for AI assistants, over stdio and POST /mcp (Model Context Protocol).
# ==============================================================================
# JSON-RPC 2.0 written here (no runtime dependency): the handshake versions, negotiated by
# ``initialize``, and the stateless 2026-07-28 version, whose every request carries its
# version and capabilities in ``params._meta`` (``server/discover`` instead of the
# handshake).  Every tool answers from the functions the read routes call, in one snapshot,
# so that no figure an assistant quotes can differ from the page's; a tool fails with the
# words the route would answer.  The stdio command (:func:`run_mcp`, last here, which the CLI
# calls) and the ``/mcp`` route (:class:`App`) only carry messages to and from
# :class:`McpSession`.

MCP_HANDSHAKE_VERSIONS = ("2024-11-05", "2025-03-26", "2025-06-18", "2025-11-25")
"""The versions ``initialize`` negotiates, oldest first; an unknown one asked for is
answered with the latest (the specification's rule)."""
MCP_MODERN_VERSIONS = ("2026-07-28",)
"""The versions of the per-request envelope: no handshake, ``server/discover``, every result
with its ``resultType``."""
MCP_HTTP_ASSUMED_VERSION = "2025-03-26"
"""The version of a request over HTTP without ``MCP-Protocol-Version`` (the specification:
a server that has no other way to know assumes 2025-03-26)."""
MCP_META_VERSION = "io.modelcontextprotocol/protocolVersion"
MCP_META_CAPABILITIES = "io.modelcontextprotocol/clientCapabilities"
MCP_META_SERVER_INFO = "io.modelcontextprotocol/serverInfo"
MCP_CACHE_TTL_MS = 300_000
"""How long a modern client may keep ``server/discover``'s and ``tools/list``'s answers: the
tools change only with a new version of healthlog."""
MCP_SERIES_MAX = 400
"""Buckets (or nights) one ``get_series`` or ``get_sleep`` reply holds at most, the latest
kept: eight years of weeks; a longer range is told how to narrow."""
MCP_COMPARE_METRICS_MAX = 10
MCP_PERIOD_MAX_DAYS = 3660
"""``compare_periods``: metrics per call, and the longest period (ten years of days)."""

RPC_PARSE_ERROR, RPC_INVALID_REQUEST, RPC_METHOD_NOT_FOUND = -32700, -32600, -32601
RPC_INVALID_PARAMS, RPC_INTERNAL_ERROR = -32602, -32603
RPC_HEADER_MISMATCH, RPC_UNSUPPORTED_VERSION = -32020, -32022
"""JSON-RPC's codes, and the two of the 2026-07-28 envelope: its headers disagree with the
body, its version is not served (``data``: ``{supported, requested}``)."""

MCP_INSTRUCTIONS = (
    "healthlog is a person's own, self-hosted store of their Apple Health data, pushed by"
    " the iPhone app Health Auto Export. Every value these tools return is that person's own"
    " health data: private, and theirs. Dates are local ISO dates (YYYY-MM-DD) as the phone"
    " lived them: with tz local (the default) each point counts on the date written in it,"
    " and a night belongs to the morning it ended. The figures are the ones healthlog's own"
    " page shows: quote them as they are, in the units given. Missing data is not a trend"
    " and not a zero: a day without data may be a day not delivered yet (a late automation,"
    " a watch not worn). Before you read a drop or a gap as a change, call get_data_health:"
    " it names late automations, stale metrics, missing or thin days, and the Health Auto"
    " Export action that fills them. Replies are bounded; one that was cut says how to"
    " narrow it (from and to). list_metrics names what the store holds.")


def _mcp_reply(message_id: Any, result: dict) -> dict:
    return {"jsonrpc": "2.0", "id": message_id, "result": result}


def _mcp_error_reply(message_id: Any, exc: McpError) -> dict:
    error: dict = {"code": exc.code, "message": exc.message}
    if exc.data is not None:
        error["data"] = exc.data
    return {"jsonrpc": "2.0", "id": message_id, "error": error}


def _unsupported_version(requested: Any) -> McpError:
    """-32022, naming every version served: a client that knows only the handshake learns
    that ``initialize`` will do."""
    return McpError(RPC_UNSUPPORTED_VERSION, "unsupported protocol version", {
        "supported": list(MCP_HANDSHAKE_VERSIONS + MCP_MODERN_VERSIONS),
        "requested": requested if isinstance(requested, str) else repr(requested)[:40]})


def mcp_http_status(reply: Any, modern: bool) -> int:
    """The HTTP status of a reply to a POST: an error of the message itself (not JSON, no
    request, an unsupported version, headers that disagree) is 400; in the 2026-07-28 era
    its table also makes an unknown method 404 and bad params 400; every other answer,
    errors of the handshake era included, is 200 (that era's rule)."""
    if not isinstance(reply, dict) or "error" not in reply:
        return 200
    code = reply["error"]["code"]
    if code in (RPC_PARSE_ERROR, RPC_INVALID_REQUEST, RPC_HEADER_MISMATCH,
                RPC_UNSUPPORTED_VERSION):
        return 400
    if modern:
        return {RPC_INVALID_PARAMS: 400, RPC_METHOD_NOT_FOUND: 404}.get(code, 200)
    return 200


# -- the tools: each a name, its schemas and the read functions it calls ---------------

@dataclass(frozen=True)
class McpTool:
    """One tool: what ``tools/list`` shows of it, what it runs (``run(reader, arguments)``
    → the structured answer) and its short text for clients that read text (``text``).
    Every tool only reads; :data:`MCP_TOOLS` lists them."""

    name: str
    title: str
    description: str
    input_schema: dict
    output_schema: dict
    run: Callable[["McpReader", dict], dict]
    text: Callable[[dict], str]

    def listing(self, version: str) -> dict:
        """The tool as ``tools/list`` shows it at ``version``: annotations from 2025-03-26,
        the title and the output schema from 2025-06-18 (before, the text is the JSON)."""
        tool: dict = {"name": self.name, "description": self.description,
                      "inputSchema": self.input_schema}
        if version >= "2025-03-26":
            tool["annotations"] = {"title": self.title, "readOnlyHint": True,
                                   "destructiveHint": False, "idempotentHint": True,
                                   "openWorldHint": False}
        if version >= "2025-06-18":
            tool["title"] = self.title
            tool["outputSchema"] = self.output_schema
        return tool


class McpReader:
    """What a tool reads from: ``connection()`` (the caller's, on which a tool opens its one
    snapshot), ``freshness()`` (freshness judged now), the owner's settings the page reads
    with (``config``: heart-rate maximum, distance units) and ``scratch``, the folder a long
    workout route is read through (``serve``'s ``DATA/tmp``; None for ``healthlog mcp``,
    which writes nothing)."""

    def __init__(self, connection: Callable[[], sqlite3.Connection],
                 freshness: Callable[[], Freshness], config: Optional[Config] = None,
                 scratch: Optional[Path] = None):
        self.connection = connection
        self.freshness = freshness
        self.config = config
        self.scratch = scratch

    @contextlib.contextmanager
    def snapshot(self) -> Iterator[sqlite3.Connection]:
        """The connection inside one read transaction: every figure of a reply agrees."""
        conn = self.connection()
        conn.execute("BEGIN")
        try:
            yield conn
        finally:
            conn.execute("COMMIT")


_MCP_DATE = {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$",
             "description": "a local date, YYYY-MM-DD"}
_MCP_TZ = {"type": "string", "description": (
    "local (the default: each point on the date and at the time the phone wrote it), a time"
    " zone such as Europe/Berlin, or an offset such as +02:00")}
_MCP_RANGE = {"type": "string", "enum": ["24h", "7d", "30d", "1y", "all"], "description": (
    "the page's ranges, ending with the newest data (default 7d); from and to instead give"
    " a range of dates")}
_MCP_NUMBER = {"type": ["number", "null"]}


def _mcp_object(properties: dict, required: Sequence[str] = (), closed: bool = True) -> dict:
    schema: dict = {"type": "object", "properties": properties}
    if required:
        schema["required"] = list(required)
    if closed:
        schema["additionalProperties"] = False
    return schema


def _mcp_list(items: dict) -> dict:
    return {"type": "array", "items": items}


def _mcp_check(schema: dict, value: Any, where: str = "arguments") -> None:
    """``value`` against the part of JSON Schema the input schemas use (type, properties,
    required, additionalProperties false, enum, pattern, items, minItems, maxItems);
    BadRequest naming what is wrong, which the tool answers as its error."""
    kinds = schema.get("type")
    kinds = [kinds] if isinstance(kinds, str) else (kinds or [])
    checks = {"object": lambda v: isinstance(v, dict), "string": lambda v: isinstance(v, str),
              "array": lambda v: isinstance(v, list), "null": lambda v: v is None,
              "integer": lambda v: type(v) is int,
              "number": lambda v: type(v) in (int, float)}
    if kinds and not any(checks[kind](value) for kind in kinds):
        raise BadRequest("%s must be %s" % (where, " or ".join(
            "an object" if kind == "object" else "an array" if kind == "array" else
            "a " + kind for kind in kinds)))
    if "enum" in schema and value not in schema["enum"]:
        raise BadRequest("%s must be one of %s" % (where, ", ".join(map(str, schema["enum"]))))
    if isinstance(value, str) and "pattern" in schema and not re.search(schema["pattern"],
                                                                         value):
        raise BadRequest("%s must be %s" % (where, schema.get("description", "as described")))
    if isinstance(value, list):
        if len(value) < schema.get("minItems", 0) or len(value) > schema.get("maxItems",
                                                                             len(value)):
            raise BadRequest("%s must have %d to %d items" % (
                where, schema.get("minItems", 0), schema.get("maxItems", len(value))))
        for number, item in enumerate(value):
            _mcp_check(schema.get("items", {}), item, "%s[%d]" % (where, number))
    if isinstance(value, dict):
        properties = schema.get("properties", {})
        for name in schema.get("required", ()):
            if name not in value:
                raise BadRequest("%s: %s is required" % (where, name))
        for name, item in value.items():
            if name in properties:
                _mcp_check(properties[name], item, name if where == "arguments"
                           else "%s.%s" % (where, name))
            elif schema.get("additionalProperties") is False:
                raise BadRequest("%s: unknown argument %s (it takes %s)" % (
                    where, str(name)[:40], ", ".join(properties) or "none"))


def _mcp_number(value: Any, digits: Optional[int] = None) -> str:
    """A number as the page writes it (its ``formatNumber``): at most ``digits`` decimals,
    else 0 from 100 on, 1 from 10 on, 2 below; grouped by thousands; ``–`` for none."""
    if type(value) not in (int, float) or not math.isfinite(value):
        return "–"
    if digits is None:
        digits = 0 if abs(value) >= 100 else 1 if abs(value) >= 10 else 2
    text = "{:,.{}f}".format(value, digits)
    if "." in text:
        text = text.rstrip("0").rstrip(".")
    return "0" if text in ("-0", "") else text


def _mcp_amount(value: Any, label: Optional[str], digits: Optional[int] = None) -> str:
    """A number with its unit as the page shows it; ``no data`` for none (never 0)."""
    number = _mcp_number(value, digits)
    if number == "–":
        return "no data"
    return number if not label else "%s %s" % (number, label)


def _mcp_clock(seconds: Optional[float]) -> str:
    """A duration as the page writes it: ``h:mm:ss``, or ``m:ss`` under an hour."""
    if type(seconds) not in (int, float) or not math.isfinite(seconds):
        return "–"
    whole = int(round(seconds))
    hours, rest = divmod(whole, 3600)
    return ("%d:%02d:%02d" % (hours, rest // 60, rest % 60) if hours
            else "%d:%02d" % (rest // 60, rest % 60))


def _mcp_count(count: int, word: str) -> str:
    return "%d %s%s" % (count, word, "" if count == 1 else "s")


def _mcp_args(arguments: dict, **names: str) -> dict:
    """The read routes' parameters from a tool's arguments: ``names`` maps each route
    parameter to its argument; an argument not given is left out."""
    return {param: arguments[arg] for param, arg in names.items() if arguments.get(arg)
            is not None}


def _mcp_cut(items: list, what: str, plural: str) -> tuple:
    """(the latest :data:`MCP_SERIES_MAX` items, the note that says what was left out)."""
    if len(items) <= MCP_SERIES_MAX:
        return items, None
    kept = items[-MCP_SERIES_MAX:]
    return kept, ("%d %s of %d shown, the latest (from %s); ask from and to for the"
                  " earlier ones" % (len(kept), plural, len(items), kept[0][what]))


def _api_json(conn: sqlite3.Connection, query: PointQuery) -> dict:
    """What ``GET /api/points`` answers for ``query``, as JSON (the same rendering)."""
    return json.loads(b"".join(render_points(conn, _replace(query, fmt="json"))))


# list_metrics ------------------------------------------------------------------------

def mcp_list_metrics(reader: McpReader, arguments: dict) -> dict:
    """``/api/catalog``, each entry with how its units are read and its first and last
    point's local dates (as ``healthlog catalog`` shows them)."""
    with reader.snapshot() as conn:
        items = catalog(conn)
        local = [catalog_local(conn, item) for item in items]
    metrics = []
    for item, (first, last) in zip(items, local):
        meaning = item["meaning"]
        metrics.append({
            "metric": item["metric"], "name": meaning["name"], "group": item["group"],
            "kind": meaning["kind"], "combine": meaning["combine"], "better": meaning["better"],
            "layer": item["layer"], "units": item["units"],
            "unit_labels": [unit_label(item["metric"], units) for units in item["units"]],
            "first": item["first"], "last": item["last"], "first_local": first,
            "last_local": last, "first_date": first and first[:10],
            "last_date": last and last[:10], "points": item["points"]})
    return {"metrics": metrics, "groups": groups_json()}


def _text_metrics(answer: dict) -> str:
    if not answer["metrics"]:
        return "The store is empty: nothing has been folded yet."
    lines = ["%d metrics and layers (metric, layer: name, kind, units, first to last date):"
             % len(answer["metrics"])]
    for item in answer["metrics"]:
        labels = ", ".join(label or units for label, units in zip(item["unit_labels"],
                                                                 item["units"]))
        lines.append("%s, %s: %s, %s%s, %s to %s" % (
            item["metric"], item["layer"], item["name"], item["kind"],
            ", " + labels if labels else "", item["first_date"], item["last_date"]))
    return "\n".join(lines)


_MCP_METRICS_OUT = _mcp_object({
    "metrics": _mcp_list(_mcp_object({
        "metric": {"type": "string"}, "name": {"type": "string"}, "group": {"type": "string"},
        "kind": {"type": "string"}, "combine": {"type": ["string", "null"]},
        "better": {"type": ["string", "null"]}, "layer": {"type": "string"},
        "units": _mcp_list({"type": "string"}),
        "unit_labels": _mcp_list({"type": ["string", "null"]}),
        "first": {"type": "string"}, "last": {"type": "string"},
        "first_local": {"type": ["string", "null"]}, "last_local": {"type": ["string", "null"]},
        "first_date": {"type": ["string", "null"]}, "last_date": {"type": ["string", "null"]},
        "points": {"type": "integer"}}, closed=False)),
    "groups": _mcp_list(_mcp_object({"group": {"type": "string"},
                                     "title": {"type": "string"}}))},
    ("metrics", "groups"), closed=False)


# get_series --------------------------------------------------------------------------

def _series_plan(conn: sqlite3.Connection, arguments: dict) -> dict:
    """The view's plan of a metric for the range asked (``plan_view``, as the page asks it):
    ``from`` and ``to`` make a custom range; either alone is refused in the route's words."""
    args = _mcp_args(arguments, metric="metric", tz="tz", layer="layer")
    if arguments.get("from") or arguments.get("to"):
        args.update(range="custom", **_mcp_args(arguments, **{"from": "from", "to": "to"}))
    else:
        args["range"] = arguments.get("range") or "7d"
    return plan_view(conn, args)


def _planned_query(conn: sqlite3.Connection, plan: dict) -> PointQuery:
    """The query the page sends for a plan: its ``points``, the layers read as named (the
    one picked, else the one chosen and those that fill the days it lacks)."""
    return point_query(conn, plan["points"])


def mcp_get_series(reader: McpReader, arguments: dict) -> dict:
    """A total or average metric bucketed by the view's plan (per hour up to two days, never
    for day data; per day up to half a year; per week beyond): ``/api/plan``, then
    ``/api/points`` as its ``points`` name it; each bucket's ``value`` is its main field
    combined as the meaning says (sum or average), as the page draws it."""
    with reader.snapshot() as conn:
        plan = _series_plan(conn, arguments)
        meaning = meaning_of(plan["metric"])
        if plan["kind"] == "sleep":
            raise BadRequest("sleep is counted per night: ask get_sleep")
        if plan["kind"] not in ("total", "average"):
            raise BadRequest("%s is a list of records, not a series"
                             % loggable_metric(plan["metric"]))
        answer = _api_json(conn, _planned_query(conn, plan))
    field_name = meaning.fields[0]
    buckets = []
    for run in answer["runs"]:
        for bucket in run["buckets"]:
            stats = bucket.get("fields", {}).get(field_name) or {}
            buckets.append({"date": bucket["date"], "local": bucket["local"],
                            "start": bucket["start"], "units": run["units"],
                            "unit_label": run["unit_label"], "count": bucket["count"],
                            "value": stats.get(meaning.combine), "fields": bucket.get(
                                "fields", {})})
    shown, note = _mcp_cut(buckets, "date", plan["bucket"] + "s")
    out = {"metric": plan["metric"], "name": meaning.name, "kind": meaning.kind,
           "combine": meaning.combine, "field": field_name, "digits": meaning.digits,
           "tz": plan["tz"], "range": plan["range"], "from": answer["from"],
           "to": answer["to"], "bucket": answer["bucket"], "layer": answer["layer"],
           "layers": answer.get("layers", [answer["layer"]]), "words": plan["words"],
           "buckets": shown, "total_buckets": len(buckets), "truncated": note is not None,
           "notes": [text for text in (answer.get("note"), note) if text]}
    return out


def _text_series(answer: dict) -> str:
    lines = ["%s (%s), %s, %s:" % (answer["name"], answer["metric"], answer["words"],
                                  "tz " + answer["tz"])]
    hourly = answer["bucket"] == "hour"
    for bucket in answer["buckets"]:
        when = bucket["local"][:16].replace("T", " ") if hourly else bucket["date"]
        line = "%s  %s" % (when, _mcp_amount(bucket["value"], bucket["unit_label"],
                                              answer["digits"]))
        stats = bucket["fields"].get(answer["field"])
        if answer["combine"] == "avg" and stats:
            line += " (%s to %s)" % (_mcp_number(stats["min"], answer["digits"]),
                                     _mcp_number(stats["max"], answer["digits"]))
        lines.append(line)
    if not answer["buckets"]:
        lines.append("no data in this range")
    lines += answer["notes"]
    return "\n".join(lines)


_MCP_SERIES_IN = _mcp_object({
    "metric": {"type": "string", "description": "a metric as list_metrics names it"},
    "range": _MCP_RANGE, "from": _MCP_DATE, "to": _MCP_DATE, "tz": _MCP_TZ,
    "layer": {"type": "string", "description": (
        "a layer list_metrics names (default: the one that answers the range best, with"
        " days it lacks filled from the others)")}}, ("metric",))
_MCP_STATS = _mcp_object({"count": {"type": "integer"}, "min": _MCP_NUMBER,
                          "max": _MCP_NUMBER, "avg": _MCP_NUMBER, "sum": _MCP_NUMBER})
_MCP_SERIES_OUT = _mcp_object({
    "metric": {"type": "string"}, "name": {"type": "string"}, "kind": {"type": "string"},
    "combine": {"type": "string"}, "field": {"type": "string"},
    "digits": {"type": ["integer", "null"]}, "tz": {"type": "string"},
    "range": {"type": "string"}, "from": {"type": ["string", "null"]},
    "to": {"type": ["string", "null"]}, "bucket": {"type": "string"},
    "layer": {"type": "string"}, "layers": _mcp_list({"type": "string"}),
    "words": {"type": "string"},
    "buckets": _mcp_list(_mcp_object({
        "date": {"type": "string"}, "local": {"type": "string"}, "start": {"type": "string"},
        "units": {"type": ["string", "null"]}, "unit_label": {"type": ["string", "null"]},
        "count": {"type": "integer"}, "value": _MCP_NUMBER,
        "fields": {"type": "object", "additionalProperties": _MCP_STATS}})),
    "total_buckets": {"type": "integer"}, "truncated": {"type": "boolean"},
    "notes": _mcp_list({"type": "string"})},
    ("metric", "tz", "bucket", "buckets", "truncated"), closed=False)


# get_day_summary ---------------------------------------------------------------------

def mcp_get_day_summary(reader: McpReader, arguments: dict) -> dict:
    """The summary page's data for a date (``/api/summary``): its cards against the usual,
    the trends, and what needs attention now."""
    fresh = reader.freshness()
    with reader.snapshot() as conn:
        return summary(conn, _mcp_args(arguments, date="date", tz="tz"), fresh)


def _text_card(card: dict) -> str:
    digits = card.get("digits")
    if card.get("render") == "range":
        return "%s: %s to %s, average %s" % (
            card["name"], _mcp_number(card["min"], digits),
            _mcp_amount(card["max"], card["unit_label"], digits),
            _mcp_amount(card["avg"], card["unit_label"], digits))
    if card.get("render") == "latest":
        values = ", ".join(_mcp_number(value, digits) if name == "qty" else
                           "%s %s" % (name, _mcp_number(value, digits))
                           for name, value in card["values"].items())
        return "%s: %s %s, measured %s" % (card["name"], values, card["unit_label"] or "",
                                          card["measured"][:16].replace("T", " "))
    usual = card.get("usual")
    return "%s: %s%s" % (card["name"], _mcp_amount(card["value"], card.get("unit_label"),
                                                    digits),
                         "" if usual is None and "usual" not in card else
                         " (usual %s)" % _mcp_amount(usual, card.get("unit_label"), digits)
                         if usual is not None else " (no usual yet)")


def _text_summary(answer: dict) -> str:
    lines = ["Summary of %s (tz %s):" % (answer["date"], answer["tz"])]
    for group in answer["card_order"]:
        cards = answer["cards"].get(group["group"])
        if group["render"] == "night":
            if cards and cards.get("asleep") is not None:
                lines.append("%s: asleep %s, in bed %s (%s)%s" % (
                    group["title"], _mcp_amount(cards["asleep"], "h"),
                    _mcp_amount(cards["in_bed"], "h"), "no usual yet"
                    if cards["usual"] is None else "usual " + _mcp_amount(cards["usual"], "h"),
                    ", sources overlap" if cards["overlapping"] else ""))
            continue
        if group["render"] == "week":
            if cards:
                lines.append("%s, last 7 days: %s" % (group["title"], "; ".join(
                    "%s %s" % (item["date"], item.get("name") or "workout") for item in cards)))
            continue
        for card in cards or []:
            lines.append(_text_card(card))
    for trend in answer["trends"]:
        if trend["flagged"]:
            lines.append("Trend: %s %s, last 90 days %s against %s the year before" % (
                trend["name"], trend["direction"], _mcp_amount(
                    trend["recent"], trend["unit_label"], trend["digits"]),
                _mcp_amount(trend["baseline"], trend["unit_label"], trend["digits"])))
    for notice in answer["attention"]:
        lines.append("Attention: " + notice["text"])
    return "\n".join(lines)


_MCP_SUMMARY_IN = _mcp_object({
    "date": dict(_MCP_DATE, description="the local date (default: the day of the newest"
                                        " data)"), "tz": _MCP_TZ})
_MCP_SUMMARY_OUT = _mcp_object({
    "date": {"type": "string"}, "tz": {"type": "string"},
    "attention": _mcp_list({"type": "object"}), "usual": {"type": "object"},
    "card_order": _mcp_list({"type": "object"}), "cards": {"type": "object"},
    "trends": _mcp_list({"type": "object"}), "trend_rule": {"type": "object"}},
    ("date", "tz", "cards", "card_order", "trends", "attention"), closed=False)


# get_sleep ---------------------------------------------------------------------------

def mcp_get_sleep(reader: McpReader, arguments: dict) -> dict:
    """Nights and naps for a range, as the sleep view reads them: ``/api/plan`` for
    ``sleep_analysis``, then ``/api/points`` as its ``points`` name it (a night per day up
    to half a year, the average night per week beyond), each night with its counted
    figures, its stages and ``overlapping``."""
    with reader.snapshot() as conn:
        plan = _series_plan(conn, dict(arguments, metric=SLEEP_METRIC))
        answer = _api_json(conn, _planned_query(conn, plan))
    nights, note = _mcp_cut(answer["nights"], "date", "nights" if plan["bucket"] == "day"
                            else "weeks")
    return {"tz": answer["tz"], "from": answer["from"], "to": answer["to"],
            "bucket": answer["bucket"], "words": plan["words"], "units": answer["units"],
            "stage_order": answer["stage_order"], "nights": nights,
            "total_nights": len(answer["nights"]), "truncated": note is not None,
            "notes": [note] if note else []}


def _text_sleep(answer: dict) -> str:
    lines = ["Sleep, %s, tz %s (hours; a night is on the morning it ended):"
             % (answer["words"], answer["tz"])]
    for night in answer["nights"]:
        stages = ", ".join("%s %s" % (stage, _mcp_number(hours))
                           for stage, hours in night["stages"].items())
        line = "%s  asleep %s, in bed %s%s" % (
            night["date"], _mcp_number(night["asleep"]), _mcp_number(night["in_bed"]),
            " (%s)" % stages if stages else "")
        if not night.get("nights", 1):
            line = "%s  no night, naps only" % night["date"]
        elif answer["bucket"] == "day" and night.get("sleep_end"):
            start = night.get("sleep_start")
            line += ", %s to %s" % (start[11:16] if start else "bedtime unknown",
                                    night["sleep_end"][11:16])
        if answer["bucket"] == "week":
            line += ", the average of %s" % _mcp_count(night["nights"], "night")
        if night["overlapping"]:
            said = night.get("said")
            line += ", sources overlap (counted once%s)" % (
                "" if said is None else "; together they said %s h" % _mcp_number(said))
        naps = [nap for nap in night["naps"] if nap["asleep"] is not None]
        if naps:
            line += ", naps %s" % " + ".join(_mcp_number(nap["asleep"]) for nap in naps)
        lines.append(line)
    if not answer["nights"]:
        lines.append("no nights in this range")
    lines += answer["notes"]
    return "\n".join(lines)


_MCP_SLEEP_IN = _mcp_object({"range": _MCP_RANGE, "from": _MCP_DATE, "to": _MCP_DATE,
                             "tz": _MCP_TZ})
_MCP_SLEEP_OUT = _mcp_object({
    "tz": {"type": "string"}, "from": {"type": ["string", "null"]},
    "to": {"type": ["string", "null"]}, "bucket": {"type": "string"},
    "words": {"type": "string"}, "units": {"type": "string"},
    "stage_order": _mcp_list({"type": "object"}),
    "nights": _mcp_list(_mcp_object({
        "date": {"type": "string"}, "asleep": _MCP_NUMBER, "in_bed": _MCP_NUMBER,
        "stages": {"type": "object", "additionalProperties": {"type": "number"}},
        "overlapping": {"type": ["boolean", "integer"]}, "naps": _mcp_list({"type": "object"}),
        "nights": {"type": "integer"}, "count": {"type": "integer"}}, closed=False)),
    "total_nights": {"type": "integer"}, "truncated": {"type": "boolean"},
    "notes": _mcp_list({"type": "string"})},
    ("tz", "bucket", "nights", "truncated"), closed=False)


# compare_periods ---------------------------------------------------------------------

def _period_days(arguments: dict, which: str) -> tuple:
    """(first, last) ordinals of a period, its dates checked as the routes check them."""
    bounds = []
    for end in ("from", "to"):
        text = arguments[which][end]
        try:
            bounds.append(_dt.date.fromisoformat(text).toordinal())
        except ValueError:
            raise BadRequest("%s.%s is not a date" % (which, end)) from None
    if bounds[0] > bounds[1]:
        raise BadRequest("%s: from must be on or before to" % which)
    if bounds[1] - bounds[0] + 1 > MCP_PERIOD_MAX_DAYS:
        raise BadRequest("%s: a period is %d days at most" % (which, MCP_PERIOD_MAX_DAYS))
    return bounds[0], bounds[1]


def _day_buckets(conn: sqlite3.Connection, metric: str, tz: Optional[str], first: int,
                 last: int) -> list:
    """[(units, value)] per day of ``/api/points?bucket=day`` over the dates (the page's
    query: no layer, so that each day comes from the layer that holds it); for sleep, each
    night's hours asleep."""
    args = {"metric": metric, "bucket": "day", "from": _dt.date.fromordinal(first).isoformat(),
            "to": _dt.date.fromordinal(last).isoformat()}
    if tz:
        args["tz"] = tz
    answer = _api_json(conn, point_query(conn, args))
    if metric == SLEEP_METRIC:
        return [("hr", night["asleep"]) for night in answer["nights"]
                if night["asleep"] is not None]
    meaning = meaning_of(metric)
    out = []
    for run in answer["runs"]:
        for bucket in run["buckets"]:
            stats = bucket.get("fields", {}).get(meaning.fields[0])
            if stats and stats.get(meaning.combine) is not None:
                out.append((run["units"], stats[meaning.combine]))
    return out


def _compared(metric: str, periods: list) -> dict:
    """The periods' figures of one metric from its day values: the mean per day with data
    (per night, for sleep) and, for a total, the total; then the change from the first to
    the second.  Days in other units than the latest are left out, and said so."""
    meaning = meaning_of(metric)
    seen = [units for values in periods for units, _ in values]
    units = seen[-1] if seen else None
    out: dict = {"metric": metric, "name": meaning.name, "kind": meaning.kind,
                 "units": units, "unit_label": "h" if meaning.kind == "sleep"
                 else unit_label(metric, units), "digits": meaning.digits, "notes": []}
    figures = []
    for which, values in zip(("first", "second"), periods):
        kept = [value for unit, value in values if unit == units]
        if len(kept) < len(values):
            out["notes"].append("%s: %d days in other units left out" % (
                which, len(values) - len(kept)))
        figure = {"days_with_data": len(kept),
                  "mean": sum(kept) / len(kept) if kept else None}
        if meaning.kind == "total":
            figure["total"] = sum(kept) if kept else None
        figures.append(figure)
        out[which] = figure
    change: dict = {}
    for name in ("mean", "total"):
        a, b = figures[0].get(name), figures[1].get(name)
        if name in figures[0]:
            change[name] = None if a is None or b is None else b - a
            change[name + "_percent"] = (None if a is None or b is None or a == 0
                                         else (b - a) / abs(a) * 100)
    out["change"] = change
    return out


def mcp_compare_periods(reader: McpReader, arguments: dict) -> dict:
    """One or more metrics over two date ranges: from the day buckets ``/api/points``
    gives (a night per day for sleep), each period's mean per day with data (per night),
    the total for a total, and the change from the first period to the second."""
    spans = [_period_days(arguments, which) for which in ("first", "second")]
    metrics = list(dict.fromkeys(arguments["metrics"]))
    out = []
    with reader.snapshot() as conn:
        for metric in metrics:
            kind = meaning_of(metric).kind
            if kind not in ("total", "average", "sleep"):
                raise BadRequest("%s is a list of records: it has no day values to compare"
                                 % loggable_metric(metric))
            out.append(_compared(metric, [_day_buckets(conn, metric, arguments.get("tz"),
                                                       first, last)
                                          for first, last in spans]))
    return {"tz": parse_zone(arguments.get("tz")).name,
            **{which: {"from": _dt.date.fromordinal(first).isoformat(),
                       "to": _dt.date.fromordinal(last).isoformat(), "days": last - first + 1}
               for which, (first, last) in zip(("first", "second"), spans)},
            "metrics": out}


def _text_compare(answer: dict) -> str:
    lines = ["First %s to %s (%d days) against second %s to %s (%d days), tz %s:" % (
        answer["first"]["from"], answer["first"]["to"], answer["first"]["days"],
        answer["second"]["from"], answer["second"]["to"], answer["second"]["days"],
        answer["tz"])]
    for item in answer["metrics"]:
        label, digits = item["unit_label"], item["digits"]
        per = "night" if item["kind"] == "sleep" else "day"
        line = "%s: mean per %s %s (%s) -> %s (%s)" % (
            item["name"], per, _mcp_amount(item["first"]["mean"], label, digits),
            _mcp_count(item["first"]["days_with_data"], per),
            _mcp_amount(item["second"]["mean"], label, digits),
            _mcp_count(item["second"]["days_with_data"], per))
        change = item["change"]
        if change["mean"] is not None:
            line += ", change %s%s" % (_mcp_amount(change["mean"], label, digits),
                                       "" if change["mean_percent"] is None else
                                       " (%s%%)" % _mcp_number(change["mean_percent"], 1))
        if "total" in item["first"]:
            line += "; totals %s -> %s" % (_mcp_amount(item["first"]["total"], label, digits),
                                           _mcp_amount(item["second"]["total"], label, digits))
        lines.append(line)
        lines += ["  " + note for note in item["notes"]]
    return "\n".join(lines)


_MCP_PERIOD = _mcp_object({"from": _MCP_DATE, "to": _MCP_DATE}, ("from", "to"))
_MCP_COMPARE_IN = _mcp_object({
    "metrics": dict(_mcp_list({"type": "string"}), minItems=1,
                    maxItems=MCP_COMPARE_METRICS_MAX, description=(
                        "metrics as list_metrics names them: totals, averages, or"
                        " sleep_analysis")),
    "first": dict(_MCP_PERIOD, description="the first period, both dates included"),
    "second": dict(_MCP_PERIOD, description="the second period, both dates included"),
    "tz": _MCP_TZ}, ("metrics", "first", "second"))
_MCP_FIGURES = _mcp_object({"days_with_data": {"type": "integer"}, "mean": _MCP_NUMBER,
                            "total": _MCP_NUMBER})
_MCP_COMPARE_OUT = _mcp_object({
    "tz": {"type": "string"},
    "first": _mcp_object({"from": {"type": "string"}, "to": {"type": "string"},
                          "days": {"type": "integer"}}),
    "second": _mcp_object({"from": {"type": "string"}, "to": {"type": "string"},
                           "days": {"type": "integer"}}),
    "metrics": _mcp_list(_mcp_object({
        "metric": {"type": "string"}, "name": {"type": "string"}, "kind": {"type": "string"},
        "units": {"type": ["string", "null"]}, "unit_label": {"type": ["string", "null"]},
        "digits": {"type": ["integer", "null"]}, "first": _MCP_FIGURES,
        "second": _MCP_FIGURES, "change": {"type": "object"},
        "notes": _mcp_list({"type": "string"})}))},
    ("tz", "first", "second", "metrics"))


# get_data_health ---------------------------------------------------------------------

def mcp_get_data_health(reader: McpReader, arguments: dict) -> dict:
    """Freshness now (``/api/freshness``: each automation and metric with its state), the
    notices of what is late or stale (the summary's ``attention``), and the coverage of the
    days asked (``/api/coverage``: each metric's days ``ok``, ``thin``, ``missing``…, its
    gaps, and the Health Auto Export action that fills each run of them)."""
    fresh = reader.freshness()
    with reader.snapshot() as conn:
        cover = coverage(conn, _mcp_args(arguments, **{"from": "from", "to": "to",
                                                       "tz": "tz"}), fresh)
    states = fresh.as_json()
    rows = [{key: value for key, value in row.items() if key != "values"}
            for row in cover["rows"]]
    return {"judged_at": format_instant(int(fresh.now_s * US)),
            "late_after_s": fresh.late_after_s,
            "automations": states["automations"], "metrics": states["metrics"],
            "attention": [notice.as_json() for notice in attention(fresh)],
            "coverage": dict(cover, rows=rows)}


def _text_health(answer: dict) -> str:
    cover = answer["coverage"]
    late = [a for a in answer["automations"] if a["state"] == "late"]
    stale = [m for m in answer["metrics"] if m["state"] == "stale"]
    lines = ["Data health now: %d automations (%d late), %d metrics and layers (%d stale);"
             " coverage %s to %s (today %s, tz %s):" % (
                 len(answer["automations"]), len(late), len(answer["metrics"]), len(stale),
                 cover["from"], cover["to"], cover["today"], cover["tz"])]
    for notice in answer["attention"]:
        lines.append("%s: %s %s" % (notice["state"], notice["text"], notice["action"]))
    for row in cover["rows"]:
        for gap in row["gaps"]:
            lines.append("%s (%s): %s %s to %s (%d days)" % (
                row["name"], row["layer"], "/".join(gap["states"]), gap["from"], gap["to"],
                gap["days"]))
    for item in cover["fill"]:
        lines.append("Fill %s to %s (%s): %s" % (item["from"], item["to"],
                                                 ", ".join(item["metrics"]), item["action"]))
    if len(lines) == 1:
        lines.append("nothing late, stale, missing or thin")
    return "\n".join(lines)


_MCP_HEALTH_IN = _mcp_object({
    "from": dict(_MCP_DATE, description="the first day of the coverage (default: four weeks"
                                        " ending today)"),
    "to": dict(_MCP_DATE, description="its last day, included"), "tz": _MCP_TZ})
_MCP_HEALTH_OUT = _mcp_object({
    "judged_at": {"type": "string"}, "late_after_s": {"type": "number"},
    "automations": _mcp_list({"type": "object"}), "metrics": _mcp_list({"type": "object"}),
    "attention": _mcp_list({"type": "object"}),
    "coverage": _mcp_object({
        "from": {"type": "string"}, "to": {"type": "string"}, "today": {"type": "string"},
        "tz": {"type": "string"}, "days": _mcp_list({"type": "string"}),
        "rows": _mcp_list({"type": "object"}), "fill": _mcp_list({"type": "object"})},
        ("from", "to", "rows", "fill"), closed=False)},
    ("automations", "metrics", "attention", "coverage"), closed=False)


# list_workouts, get_workout ----------------------------------------------------------

def mcp_list_workouts(reader: McpReader, arguments: dict) -> dict:
    """The workouts of a range as ``GET /api/workouts`` lists them (newest first, a
    workout recorded by two apps marked and counted once), at most
    :data:`MCP_SERIES_MAX`."""
    with reader.snapshot() as conn:
        answer = list_workouts(conn, _mcp_args(arguments, **{"from": "from", "to": "to",
                                                             "tz": "tz"}),
                               reader.scratch, limit=MCP_SERIES_MAX)
    notes = ["%d workouts shown, the newest; ask from and to for the earlier ones"
             % MCP_SERIES_MAX] if answer["truncated"] else []
    return {"tz": answer["tz"], "from": answer["from"], "to": answer["to"],
            "workouts": answer["workouts"], "count": answer["count"],
            "seconds": answer["seconds"], "truncated": bool(answer["truncated"]),
            "notes": notes}


def _text_workouts(answer: dict) -> str:
    lines = ["Workouts, tz %s: %s, %s in all (a workout two apps recorded counts once):" % (
        answer["tz"], _mcp_count(answer["count"], "workout"), _mcp_clock(answer["seconds"]))]
    for item in answer["workouts"]:
        line = "%s %s  %s, %s (id %s)" % (item["date"], item["local_start"][11:16],
                                          item["name"] or item["activity"],
                                          _mcp_clock(item["duration_s"]), item["id"])
        if item["duplicate_of"]:
            line += ", the same as %s" % item["duplicate_of"]
        lines.append(line)
    if not answer["workouts"]:
        lines.append("no workouts in this range")
    return "\n".join(lines + answer["notes"])


def mcp_get_workout(reader: McpReader, arguments: dict) -> dict:
    """One workout as ``GET /api/workouts/<id>`` gives it to the page: its figures in the
    units people read, heart-rate zones, splits and the climb.  The drawn route, the
    heart-rate samples and the altitude profile are left out (the page draws them; the
    GPX carries the whole route): their count and the route's bounds stay."""
    config = reader.config
    with reader.snapshot() as conn:
        answer = get_workout(conn, arguments["id"], _mcp_args(arguments, tz="tz"),
                             reader.scratch, config.max_heart_rate if config else None,
                             config.distance_units if config else None)
    route = answer["route"]
    if route is not None:
        route = {key: value for key, value in route.items() if key != "points"}
    heart = dict(answer["heart_rate"])
    for series in ("session", "recovery"):
        heart[series + "_samples"] = len(heart.pop(series) or ())
    elevation = answer["elevation"]
    if elevation is not None:
        elevation = {key: value for key, value in elevation.items() if key != "profile"}
    return {"workout": answer["workout"], "figures": answer["figures"],
            "units": answer["units"], "route": route, "heart_rate": heart,
            "splits": answer["splits"], "elevation": elevation, "notes": answer["notes"]}


def _text_workout(answer: dict) -> str:
    item = answer["workout"]
    lines = ["%s, %s %s to %s (%s):" % (item["name"] or item["activity"], item["date"],
                                        item["local_start"][11:16], item["local_end"][11:16],
                                        _mcp_clock(item["duration_s"]))]
    for figure in answer["figures"]:
        if figure["shown"] in ("duration", "pace"):
            shown = _mcp_clock(figure["value"]) + (" " + figure["unit_label"]
                                                   if figure["unit_label"] else "")
        else:
            shown = _mcp_amount(figure["value"], figure["unit_label"], figure["digits"])
        lines.append("  %s: %s" % (figure["label"], shown))
    zones = answer["heart_rate"].get("zones")
    if zones:
        lines.append("  heart-rate zones (maximum %s bpm): %s" % (_mcp_number(
            zones["max"], 0), ", ".join("%s %s" % (zone["label"], _mcp_clock(zone["seconds"]))
                                        for zone in zones["zones"])))
    splits = answer["splits"]
    if splits:
        lines.append("  %s splits per %s" % (len(splits["rows"]), splits["unit"]["label"]))
    return "\n".join(lines + ["  " + note for note in answer["notes"]])


_MCP_WORKOUTS_IN = _mcp_object({
    "from": dict(_MCP_DATE, description="the first local date (default: every workout)"),
    "to": dict(_MCP_DATE, description="the last local date, included"), "tz": _MCP_TZ})
_MCP_WORKOUTS_OUT = _mcp_object({
    "tz": {"type": "string"}, "from": {"type": ["string", "null"]},
    "to": {"type": ["string", "null"]}, "workouts": _mcp_list({"type": "object"}),
    "count": {"type": "integer"}, "seconds": {"type": "number"},
    "truncated": {"type": "boolean"}, "notes": _mcp_list({"type": "string"})},
    ("tz", "workouts", "count", "truncated"))
_MCP_WORKOUT_IN = _mcp_object({"id": {"type": "string", "description": (
    "a workout's id as list_workouts gives it")}, "tz": _MCP_TZ}, ("id",))
_MCP_WORKOUT_OUT = _mcp_object({
    "workout": {"type": "object"}, "figures": _mcp_list({"type": "object"}),
    "units": {"type": "object"}, "route": {"type": ["object", "null"]},
    "heart_rate": {"type": "object"}, "splits": {"type": ["object", "null"]},
    "elevation": {"type": ["object", "null"]}, "notes": _mcp_list({"type": "string"})},
    ("workout", "figures", "heart_rate", "notes"))


MCP_TOOLS = (
    McpTool("list_metrics", "What the store holds", (
        "Every metric and layer stored: its name, what it is (a total, an average, sleep,"
        " workouts, events), its units as a person reads them, and the local dates of its"
        " first and last point."), _mcp_object({}), _MCP_METRICS_OUT, mcp_list_metrics,
        _text_metrics),
    McpTool("get_series", "A metric over time", (
        "A total or average metric (steps, heart rate, weight…) over a range, bucketed as"
        " healthlog's page draws it: per hour for two days or less (never for data that"
        " arrives once a day), per day up to half a year, per week beyond. Each bucket's"
        " value is the day's (hour's, week's) total or average."), _MCP_SERIES_IN,
        _MCP_SERIES_OUT, mcp_get_series, _text_series),
    McpTool("get_day_summary", "A day at a glance", (
        "The summary page of a date: activity, last night's sleep, heart, body, the week's"
        " workouts and what else was recorded, each against the person's usual (the median"
        " of the 30 days before); the trends of the last 90 days against the year before;"
        " and what needs attention."), _MCP_SUMMARY_IN, _MCP_SUMMARY_OUT,
        mcp_get_day_summary, _text_summary),
    McpTool("get_sleep", "Nights and naps", (
        "Each night of a range (on the morning it ended): hours asleep and in bed by"
        " healthlog's one sleep rule, the stages, bed and wake time, naps apart, and"
        " whether sources overlapped (counted once, capped). Beyond half a year, the"
        " average night per week."), _MCP_SLEEP_IN, _MCP_SLEEP_OUT, mcp_get_sleep,
        _text_sleep),
    McpTool("compare_periods", "Two periods compared", (
        "One or more metrics over two date ranges: the mean per day with data (per night"
        " for sleep_analysis) and, for totals, the total of each period, and the change from"
        " the first to the second."), _MCP_COMPARE_IN, _MCP_COMPARE_OUT,
        mcp_compare_periods, _text_compare),
    McpTool("get_data_health", "What is missing", (
        "Which Health Auto Export automations are late, which metrics stale, which days"
        " missing or thin, and the action in Health Auto Export that fills each gap. Ask"
        " it before reading a gap or a drop as a change."), _MCP_HEALTH_IN,
        _MCP_HEALTH_OUT, mcp_get_data_health, _text_health),
    McpTool("list_workouts", "Workouts of a range", (
        "Each workout of a range, newest first: its id, name and activity, local start and"
        " end, duration, distance and energy as sent, heart rate, whether a route was sent,"
        " and which workouts two apps recorded (shown once, counted once)."),
        _MCP_WORKOUTS_IN, _MCP_WORKOUTS_OUT, mcp_list_workouts, _text_workouts),
    McpTool("get_workout", "One workout", (
        "One workout by its id (list_workouts gives it): its figures in the units a person"
        " reads (pace or speed by activity), heart-rate zones and time in each, splits per"
        " km or mile with pace and heart rate, the climb, and what was not sent."),
        _MCP_WORKOUT_IN, _MCP_WORKOUT_OUT, mcp_get_workout, _text_workout),
)
"""The tools, in the order ``tools/list`` gives them.  A new read view becomes a tool by
one entry here: its schemas, the function that calls the view, and its text."""


# -- the protocol: one conversation, whatever carries it ------------------------------

def mcp_call_tool(tool: McpTool, reader: McpReader, arguments: dict) -> tuple:
    """(structured answer, None) or (None, the error's words): the route's message for a
    refusal (HTTPFailure), :data:`READ_FAILED` for a failure of the machine (logged by its
    class only)."""
    try:
        _mcp_check(tool.input_schema, arguments)
        return tool.run(reader, arguments), None
    except UnknownMetric as exc:
        return None, "%s (list_metrics names them: %s)" % (
            exc.message, ", ".join(exc.extra["metrics"]) or "the store is empty")
    except HTTPFailure as exc:
        return None, exc.message
    except Exception as exc:  # the boundary of a tool: the class in the log, never values
        log_event(logging.ERROR, "mcp tool failed", tool=tool.name, error=type(exc).__name__)
        log_event(logging.DEBUG, "mcp tool failure detail", detail=repr(exc))
        return None, READ_FAILED


class McpSession:
    """One MCP conversation: stdio's whole connection, or one HTTP request (``headers``:
    its headers, lower-case names).  :meth:`receive` takes a message's bytes and gives the
    reply to send, or None (a notification, a response)."""

    def __init__(self, reader: McpReader, headers: Optional[Mapping[str, str]] = None,
                 tools: Sequence[McpTool] = MCP_TOOLS):
        self.reader, self.headers, self.tools = reader, headers, tuple(tools)
        self.era: Optional[str] = None  # stdio: "handshake" or "modern", once one answered
        self.version: Optional[str] = None  # the handshake's version, once negotiated
        self.modern = False  # the last request was one of the 2026-07-28 envelope

    # -- messages ----------------------------------------------------------------

    def receive(self, raw: bytes) -> Any:
        """The reply to one message (or batch) as received."""
        try:
            message = json.loads(raw)
        except (ValueError, RecursionError):  # not JSON, not UTF-8, nested too deep
            return _mcp_error_reply(None, McpError(RPC_PARSE_ERROR, "parse error: the message"
                                                   " is not JSON"))
        if isinstance(message, list):
            if not message or self._version_now() != "2025-03-26":
                return _mcp_error_reply(None, McpError(
                    RPC_INVALID_REQUEST, "a batch is answered only at protocol version"
                    " 2025-03-26, and never empty"))
            replies = [reply for reply in map(self.handle, message) if reply is not None]
            return replies or None
        return self.handle(message)

    def handle(self, message: Any) -> Optional[dict]:
        """The reply to one JSON-RPC message, or None for a notification or a response."""
        if not isinstance(message, dict) or message.get("jsonrpc") != "2.0":
            return _mcp_error_reply(_rpc_id(message), McpError(
                RPC_INVALID_REQUEST, "invalid request: not a JSON-RPC 2.0 message"))
        if "method" not in message and ("result" in message or "error" in message):
            return None  # a response: this server sends no requests, so none is awaited
        method, params = message.get("method"), message.get("params")
        if not isinstance(method, str):
            return _mcp_error_reply(_rpc_id(message), McpError(
                RPC_INVALID_REQUEST, "invalid request: method must be a string"))
        if "id" not in message:
            self._notified(method, params)
            return None
        message_id = message["id"]
        if not (isinstance(message_id, str) or type(message_id) is int):
            return _mcp_error_reply(None, McpError(
                RPC_INVALID_REQUEST, "invalid request: id must be a string or an integer"))
        started = time.monotonic()
        try:
            if params is not None and not isinstance(params, dict):
                raise McpError(RPC_INVALID_PARAMS, "params must be an object")
            reply = _mcp_reply(message_id, self._answer(method, params or {}))
        except McpError as exc:
            reply = _mcp_error_reply(message_id, exc)
        except Exception as exc:  # the boundary: the class in the log, one generic answer
            log_event(logging.ERROR, "mcp request failed", method=method[:40],
                      error=type(exc).__name__)
            log_event(logging.DEBUG, "mcp request failure detail", detail=repr(exc))
            reply = _mcp_error_reply(message_id, McpError(RPC_INTERNAL_ERROR, REQUEST_FAILED))
        log_event(logging.INFO if method == "tools/call" else logging.DEBUG, "mcp request",
                  method=method if method in _MCP_METHODS else "other",
                  tool=self._tool_name(method, params),
                  error=reply["error"]["code"] if "error" in reply else None,
                  tool_error=reply.get("result", {}).get("isError") or None,
                  ms=round((time.monotonic() - started) * 1000, 1))
        return reply

    def _notified(self, method: str, params: Any) -> None:
        """Notifications change nothing here: ``notifications/initialized`` ends a
        handshake that needs no more; ``notifications/cancelled`` names a request whose
        answer is already on its way (one at a time); others are ignored."""
        log_event(logging.DEBUG, "mcp notification",
                  method=method if method in _MCP_METHODS else "other")

    def _tool_name(self, method: str, params: Any) -> Optional[str]:
        if method != "tools/call" or not isinstance(params, dict):
            return None
        name = params.get("name")
        return name if any(tool.name == name for tool in self.tools) else None

    def _version_now(self) -> str:
        header = (self.headers or {}).get("mcp-protocol-version")
        return self.version or header or (MCP_HTTP_ASSUMED_VERSION if self.headers is not None
                                          else MCP_HANDSHAKE_VERSIONS[-1])

    # -- eras --------------------------------------------------------------------

    def _answer(self, method: str, params: dict) -> dict:
        meta = params.get("_meta")
        header = (self.headers or {}).get("mcp-protocol-version")
        enveloped = isinstance(meta, dict) and MCP_META_VERSION in meta
        self.modern = method != "initialize" and (
            enveloped or method == "server/discover" or self.era == "modern"
            or header in MCP_MODERN_VERSIONS)
        if method == "initialize":
            return self._initialize(params)
        if not self.modern:
            return self._handshake_request(method, params)
        if self.era == "handshake":
            raise McpError(RPC_INVALID_REQUEST, "this connection negotiated protocol version"
                           " %s by initialize; a request in the 2026-07-28 envelope is not"
                           " taken on it" % self.version)
        version = self._modern_version(method, params)
        result = self._modern_request(method, params, version)
        if self.headers is None:
            self.era = "modern"  # stdio: the first answered request settles the era
        result["resultType"] = "complete"
        result["_meta"] = {MCP_META_SERVER_INFO: {"name": "healthlog", "version": __version__}}
        return result

    def _initialize(self, params: dict) -> dict:
        if self.era == "modern":
            raise _unsupported_version(params.get("protocolVersion"))
        asked = params.get("protocolVersion")
        if not isinstance(asked, str):
            raise McpError(RPC_INVALID_PARAMS, "initialize: protocolVersion is required")
        version = asked if asked in MCP_HANDSHAKE_VERSIONS else MCP_HANDSHAKE_VERSIONS[-1]
        if self.headers is None:
            self.era, self.version = "handshake", version
        return {"protocolVersion": version, "capabilities": {"tools": {"listChanged": False}},
                "serverInfo": {"name": "healthlog", "title": "healthlog",
                               "version": __version__},
                "instructions": MCP_INSTRUCTIONS}

    def _handshake_request(self, method: str, params: dict) -> dict:
        version = self._version_now()
        if version not in MCP_HANDSHAKE_VERSIONS:
            raise _unsupported_version(version)
        if method == "ping":
            return {}
        if method == "tools/list":
            return self._tools_list(params, version)
        if method == "tools/call":
            return self._tools_call(params, version)
        raise McpError(RPC_METHOD_NOT_FOUND, "method not found", method[:80])

    def _modern_version(self, method: str, params: dict) -> str:
        """The version of an enveloped request, checked as 2026-07-28 asks: the envelope
        complete (else -32602), over HTTP its headers the body's (else -32020), and the
        version one served (else -32022)."""
        meta = params.get("_meta")
        if (not isinstance(meta, dict) or MCP_META_VERSION not in meta
                or MCP_META_CAPABILITIES not in meta):
            raise McpError(RPC_INVALID_PARAMS, "params._meta must carry %s and %s"
                           % (MCP_META_VERSION, MCP_META_CAPABILITIES))
        version = meta[MCP_META_VERSION]
        if self.headers is not None:
            headers = self.headers
            if headers.get("mcp-protocol-version") != version:
                raise McpError(RPC_HEADER_MISMATCH, "the MCP-Protocol-Version header is not"
                               " the request's protocol version")
            if headers.get("mcp-method") != method:
                raise McpError(RPC_HEADER_MISMATCH, "the Mcp-Method header is not the"
                               " request's method")
            if (method == "tools/call" and params.get("name") is not None
                    and _decoded_header(headers.get("mcp-name")) != params.get("name")):
                raise McpError(RPC_HEADER_MISMATCH, "the Mcp-Name header is not the tool"
                               " called")
        if not isinstance(version, str):
            raise McpError(RPC_INVALID_PARAMS, "the protocol version must be a string")
        if version not in MCP_MODERN_VERSIONS:
            raise _unsupported_version(version)
        return version

    def _modern_request(self, method: str, params: dict, version: str) -> dict:
        if method == "server/discover":
            return {"supportedVersions": list(MCP_MODERN_VERSIONS),
                    "capabilities": {"tools": {"listChanged": False}},
                    "instructions": MCP_INSTRUCTIONS, "ttlMs": MCP_CACHE_TTL_MS,
                    "cacheScope": "private"}
        if method == "tools/list":
            return dict(self._tools_list(params, version), ttlMs=MCP_CACHE_TTL_MS,
                        cacheScope="private")
        if method == "tools/call":
            return self._tools_call(params, version)
        raise McpError(RPC_METHOD_NOT_FOUND, "method not found", method[:80])

    # -- tools -------------------------------------------------------------------

    def _tools_list(self, params: dict, version: str) -> dict:
        """Every tool in one page: a cursor names no later page."""
        if params.get("cursor") is not None:
            raise McpError(RPC_INVALID_PARAMS, "unknown cursor: every tool is on the first"
                           " page")
        return {"tools": [tool.listing(version) for tool in self.tools]}

    def _tools_call(self, params: dict, version: str) -> dict:
        """A tool's answer: ``structuredContent`` and a short text from 2025-06-18 on, the
        JSON as text before; a refusal as a result with ``isError`` (the model reads it and
        can ask again), an unknown tool as -32602."""
        name, arguments = params.get("name"), params.get("arguments")
        if not isinstance(name, str):
            raise McpError(RPC_INVALID_PARAMS, "tools/call: name is required")
        found = [tool for tool in self.tools if tool.name == name]
        if not found:
            raise McpError(RPC_INVALID_PARAMS, "unknown tool; tools/list names them",
                           name[:80])
        if arguments is not None and not isinstance(arguments, dict):
            return {"content": [{"type": "text", "text": "arguments must be an object"}],
                    "isError": True}
        [tool] = found
        answer, error = mcp_call_tool(tool, self.reader, arguments or {})
        if error is not None:
            return {"content": [{"type": "text", "text": error}], "isError": True}
        if version < "2025-06-18":
            return {"content": [{"type": "text", "text": json.dumps(answer, ensure_ascii=False)}],
                    "isError": False}
        return {"content": [{"type": "text", "text": tool.text(answer)}],
                "structuredContent": answer, "isError": False}


_MCP_METHODS = ("initialize", "ping", "tools/list", "tools/call", "server/discover",
                "notifications/initialized", "notifications/cancelled")
"""Methods logged by name (any other is logged as ``other``: a name a client chose)."""


def _rpc_id(message: Any) -> Any:
    """The id of an invalid message, when it has a valid one, else null."""
    found = message.get("id") if isinstance(message, dict) else None
    return found if isinstance(found, str) or type(found) is int else None


def _decoded_header(value: Optional[str]) -> Optional[str]:
    """A header value as 2026-07-28 writes one that is not plain ASCII: ``=?base64?…?=``."""
    if value is None:
        return None
    match = re.fullmatch(r"=\?base64\?(.*)\?=", value)
    if match is None:
        return value
    try:
        return codecs.decode(match.group(1).encode("ascii"), "base64").decode("utf-8")
    except (ValueError, UnicodeError):
        return None


def mcp_read_only_reader(config: Config, conn: sqlite3.Connection) -> McpReader:
    """The reader of ``healthlog mcp``: its one read-only connection, freshness judged on
    it at each call (:func:`freshness_of`)."""
    return McpReader(lambda: conn, lambda: freshness_of(conn, config.data_dir, config.clock(),
                                                        config.late_after_s), config)


def serve_mcp_stdio(session: McpSession, source: Any, sink: Any) -> None:
    """Newline-delimited JSON-RPC until ``source`` ends: one message a line (UTF-8), one
    reply a line, each flushed; a line over :data:`MCP_MESSAGE_MAX` bytes is refused and
    skipped to its end."""
    while True:
        line = source.readline(MCP_MESSAGE_MAX + 1)
        if not line:
            return
        if len(line) > MCP_MESSAGE_MAX and not line.endswith(b"\n"):
            while line and not line.endswith(b"\n"):
                line = source.readline(MCP_MESSAGE_MAX)
            reply: Any = _mcp_error_reply(None, McpError(
                RPC_INVALID_REQUEST, "a message is %d bytes at most" % MCP_MESSAGE_MAX))
        elif not line.strip():
            continue
        else:
            reply = session.receive(line)
        if reply is not None:
            sink.write(json.dumps(reply, separators=(",", ":")).encode() + b"\n")
            sink.flush()


def run_mcp(config: Config, source: Any = None, sink: Any = None) -> int:
    """``healthlog mcp``: the tools over stdio for an assistant's desktop client, which
    starts it as a command.  Beside ``serve`` or without it: it opens the store read-only
    (:func:`open_read_only`) and never writes; stdout carries only the protocol (anything
    else printed goes to stderr, with the log)."""
    source = source or sys.stdin.buffer
    sink = sink or sys.stdout.buffer
    conn = open_read_only(config)
    try:
        log_event(logging.INFO, "mcp serving on stdio", data=str(config.data_dir),
                  tools=len(MCP_TOOLS))
        with contextlib.redirect_stdout(sys.stderr):
            serve_mcp_stdio(McpSession(mcp_read_only_reader(config, conn)), source, sink)
    finally:
        conn.close()
    log_event(logging.INFO, "mcp stopped: its client closed stdin")
    return 0


# ==============================================================================
# Web app: the routes, one JSON error shape, an access log without bodies.
# ==============================================================================

ENV_REQUEST = "healthlog.cheroot_request"
ENV_RECEIVED = "healthlog.received_at"
ENV_QUIET = "healthlog.quiet"
ENV_CLIENT = "healthlog.client"  # the client's address (behind a trusted proxy: the real one)
"""Set on a request whose access-log record goes to DEBUG: a failed authentication of a
burst already named in a WARN."""


def error_body(status: int, code: str, message: str, extra: Optional[dict] = None) -> bytes:
    """The one JSON error shape of every HTTP error; never echoes request content."""
    error = {"status": status, "code": code, "message": message}
    error.update(extra or {})
    return json.dumps({"error": error}).encode()


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


def security_headers(map_tiles: Optional[str] = None) -> tuple:
    """The headers on every answer: the page runs only its own script and style, in no
    frame; images come from the page itself, and from the tile server's origin alone when
    ``serve --map-tiles`` names one (nothing else ever leaves the server)."""
    images = "'self' data:"
    if map_tiles:
        parts = urllib.parse.urlsplit(map_tiles)
        images += " %s://%s" % (parts.scheme, parts.netloc.rpartition("@")[2])
    return (
        ("Content-Security-Policy", "default-src 'none'; script-src 'self'; style-src 'self';"
         " img-src %s; connect-src 'self'; form-action 'self'; frame-ancestors 'none';"
         " base-uri 'none'" % images),
        ("X-Content-Type-Options", "nosniff"),
        ("Referrer-Policy", "no-referrer"),
        ("X-Frame-Options", "DENY"),
    )


SECURITY_HEADERS = security_headers()
"""On every answer of a ``serve`` without map tiles."""

LOGIN_FORM_MAX = 4096
"""A sign-in form is one field: a body larger than this is no sign-in."""


class App:
    """The WSGI application: bottle routes inside an access-log and error boundary.

    Its collaborators are explicit: the archive and the connection pool that ingest
    writes to and the read routes read from, the fold worker it wakes and reports on
    (its state and fold timings), and the service's stopping flag.
    """

    def __init__(self, config: Config, archive: Archive, pool: ConnectionPool,
                 worker: FoldWorker, stopping: threading.Event,
                 judge: Optional[Callable[[], Freshness]] = None,
                 notices: Optional[Callable[[], dict]] = None):
        import bottle

        self.config, self.archive, self.pool = config, archive, pool
        self.worker, self.stopping = worker, stopping
        self.judge = judge  # freshness now (the service's, which also tells the notifier)
        self.security = security_headers(config.map_tiles)
        self.notices = notices  # the notifier's counts, when it runs
        self.ingest_seconds = Histogram(TIMING_BOUNDS)
        # Uploads never take the last threads; bodies under validation share a ceiling.
        self.upload_slots = threading.BoundedSemaphore(
            max(1, config.http_threads - HTTP_RESERVED_THREADS))
        self.validation = ByteBudget(validation_ceiling(config.max_body_bytes))
        self.quick_max = quick_check_bytes(config.max_body_bytes)
        self.guesses = GuessLimiter()
        self._hinted: set = set()  # untrusted peers whose forwarding headers were logged
        self._token = b""
        self._token_in_path = ""
        self.bottle = bottle.Bottle()
        self.bottle.config["catchall"] = False
        for rule, method, callback in (
                ("/api/ingest", "POST", self.ingest),
                ("/api/ingest/<name>", "POST", self.ingest),
                ("/healthz", "GET", self.healthz),
                ("/api/catalog", "GET", self.catalog),
                ("/api/points", "GET", self.points),
                ("/api/deliveries", "GET", self.deliveries),
                ("/api/records", "GET", self.records),
                ("/api/workouts", "GET", self.workouts),
                ("/api/workouts/<ident>", "GET", self.workout),
                ("/api/ecg", "GET", self.ecg),
                ("/api/summary", "GET", self.summary),
                ("/api/plan", "GET", self.plan),
                ("/api/freshness", "GET", self.freshness),
                ("/api/coverage", "GET", self.coverage),
                ("/mcp", "POST", self.mcp),
                ("/mcp", "GET", self.mcp_other),
                ("/mcp", "DELETE", self.mcp_other),
                ("/metrics", "GET", self.metrics),
                ("/", "GET", self.page),
                ("/login", "POST", self.login),
                ("/logout", "POST", self.logout),
                ("/static/<name>", "GET", self.static)):
            self.bottle.route(rule, method, callback)
        self.mcp_reader = McpReader(lambda: self.pool.get(), self._judge, config,
                                    archive.tmp if archive is not None else None)

    def set_token(self, token: str) -> None:
        self._token = token.encode()
        self._token_in_path = self._token.decode("latin-1")  # as Cheroot spells PATH_INFO

    # -- WSGI entry ---------------------------------------------------------

    def __call__(self, environ: dict, start_response: Callable) -> Any:
        started = time.monotonic()
        environ[ENV_RECEIVED] = _dt.datetime.fromtimestamp(self.config.clock(),
                                                           _dt.timezone.utc)
        environ[ENV_CLIENT], untrusted = client_address(environ, self.config.trusted_proxies)
        if untrusted:
            self._hint_forwarded(environ[ENV_CLIENT])
        path = environ.get("PATH_INFO", "")
        if self._token and self._token_in_path in path:  # a token typed into the URL
            path = path.replace(self._token_in_path, "<token>")  # is never logged
        try:
            status, headers, body = self._dispatch(environ)
        except HTTPFailure as exc:
            status, headers, body = self._failure(environ, exc)
        except Exception as exc:  # the boundary: log the class, answer one JSON 500
            log_event(logging.ERROR, "request failed", error=type(exc).__name__, path=path)
            log_event(logging.DEBUG, "request failure detail", detail=repr(exc))
            status, headers, body = self._failure(environ, InternalError(
                None if path.startswith("/api/ingest") else READ_FAILED
                if environ.get("REQUEST_METHOD") in ("GET", "HEAD") else REQUEST_FAILED))
        start_response(status, list(headers) + list(self.security))
        code = int(status.split(" ", 1)[0])
        if path.startswith("/api/ingest") and environ.get("REQUEST_METHOD") == "POST":
            self.ingest_seconds.observe(time.monotonic() - started, status=str(code))

        def logged(bytes_out: int) -> None:
            quiet = path == "/healthz" or environ.get(ENV_QUIET)
            log_event(logging.DEBUG if quiet else logging.INFO, "http request",
                      method=environ.get("REQUEST_METHOD", ""), path=path, status=code,
                      bytes_in=int(environ.get("CONTENT_LENGTH") or 0) or None,
                      bytes_out=bytes_out, ms=round((time.monotonic() - started) * 1000, 1))

        if type(body) is bytes:
            logged(len(body))
            return [body]
        return _Streamed(body, logged)

    def _dispatch(self, environ: dict) -> tuple:
        import bottle

        try:
            route, args = self.bottle.router.match(environ)
        except bottle.HTTPError as exc:
            if exc.status_code == 405:
                raise MethodNotAllowed() from None
            raise NotFound() from None
        if _has_body(environ) and route.rule not in ("/api/ingest", "/api/ingest/<name>",
                                                     "/login", "/mcp"):
            _close_connection(environ)  # only these read a body
        return route.callback(environ, **args)

    def _failure(self, environ: dict, exc: HTTPFailure) -> tuple:
        if _has_body(environ):
            _close_connection(environ)
        body = error_body(exc.status, exc.code, exc.message, getattr(exc, "extra", None))
        return ("%d %s" % (exc.status, _REASONS.get(exc.status, "Error")),
                [("Content-Type", "application/json"), ("Content-Length", str(len(body)))]
                + list(getattr(exc, "headers", ())), body)

    def _ok(self, obj: Any) -> tuple:
        body = _json_bytes(obj)
        return ("200 OK", [("Content-Type", "application/json"),
                           ("Content-Length", str(len(body))),
                           ("Cache-Control", "no-store")], body)

    # -- authentication -----------------------------------------------------

    def authenticate(self, environ: Mapping[str, Any], cookie: bool = False) -> None:
        """Bearer token or X-API-Key, compared in constant time; with ``cookie`` also
        the dashboard's session cookie (read routes only: ingest never takes it, so a
        page of another site can never make a signed-in browser post data)."""
        offered = None
        authorization = environ.get("HTTP_AUTHORIZATION", "")
        scheme, _, credentials = authorization.partition(" ")
        if scheme.lower() == "bearer" and credentials.strip():
            offered = credentials.strip()
        elif environ.get("HTTP_X_API_KEY"):
            offered = environ["HTTP_X_API_KEY"].strip()
        if offered is None and cookie and self._signed_in(environ):
            return
        if offered is None:
            raise Unauthorized()
        self.check_guess(environ, offered.encode("latin-1", "replace"))

    def check_guess(self, environ: Mapping[str, Any], offered: bytes) -> None:
        """Compare an offered token in constant time; a right one is served at once,
        whatever its address did before (RELY-7.8).  A wrong one is one failure of its
        client address (:class:`GuessLimiter`): 401 after its delay, or 429 at once when
        the address is locked out or every waiting place is taken.  Only a burst's first
        failure and the start of its lockout are WARNs."""
        if self._token and hmac.compare_digest(offered, self._token):
            return
        address = environ.get(ENV_CLIENT) or environ.get("REMOTE_ADDR") or "-"
        failures, delay = self.guesses.failed(address)
        if failures == 1:
            log_event(logging.WARNING, "authentication failed; more failures from this"
                      " address are counted, not logged", address=address)
        elif failures == GUESSES_BEFORE_LOCKOUT:
            log_event(logging.WARNING, "too many failed authentications: wrong tokens from"
                      " the address are refused for a while (a right one is still served)",
                      address=address, failures=failures,
                      refused_s=int(self.guesses.refused_for(address)))
        else:
            environ[ENV_QUIET] = True
        if delay is None:
            raise TooManyRequests(self.guesses.refused_for(address))
        if delay:
            with self.guesses.waiting() as placed:
                if not placed:
                    raise TooManyRequests(delay)
                time.sleep(delay)
        raise Unauthorized()

    def _hint_forwarded(self, peer: str) -> None:
        """Forwarding headers from a peer not named in ``--trusted-proxy``: said once per
        peer, since they are ignored (a stranger may write them; a proxy of one's own
        would make every client one address)."""
        if peer in self._hinted or len(self._hinted) >= FORWARDED_HINTS_MAX:
            return
        self._hinted.add(peer)
        log_event(logging.WARNING, "a request carries X-Forwarded-For, Forwarded or X-Real-IP"
                  " from an address not named in --trusted-proxy; the headers are ignored. If"
                  " this is your reverse proxy, start serve with --trusted-proxy ADDRESS",
                  address=peer)

    def _session(self, environ: Mapping[str, Any]) -> Optional[str]:
        """The id of the browser's session, when its cookie is genuine, unexpired and
        its session has not been ended."""
        value = _cookie(environ, SESSION_COOKIE)
        parts = None if value is None else session_parts(self._token, value, time.time())
        if parts is None:
            return None
        found = self.pool.get().execute("SELECT 1 FROM session WHERE id = ? AND expires_at = ?",
                                        parts).fetchone()
        return parts[0] if found else None

    def _signed_in(self, environ: Mapping[str, Any]) -> bool:
        return self._session(environ) is not None

    # -- routes: ingest and health ------------------------------------------

    def healthz(self, environ: dict) -> tuple:
        """GET /healthz: liveness, backlog size and worker state; no token, no health data.

        503 with ``"status": "failing"`` while the fold loop is not running (restarting
        after a failure, or ended) or the database cannot be read, unless the service
        is stopping (RELY-8.1).
        """
        exhausted = 0
        try:
            conn = self.pool.get()
            backlog: Optional[int] = count_pending(conn)
            exhausted = count_exhausted(conn)
        except sqlite3.Error as exc:
            log_event(logging.DEBUG, "health check cannot read the journal",
                      error=type(exc).__name__)
            backlog = None
        missing = self.archive.unavailable()
        if self.stopping.is_set():
            status = "stopping"
        elif not self.worker.running or backlog is None or missing:
            status = "failing"
        else:
            status = "degraded" if exhausted else "ok"
        health = {"status": status, "version": __version__, "backlog": backlog,
                  "worker": self.worker.state, "failed_after_attempts": exhausted}
        if self.worker.fault is not None:
            health["fault"] = self.worker.fault
        if missing:  # a disk not mounted yet: say which folder (RELY-11.1)
            health["fault"] = "archive:archive_missing"
            health["missing"] = ARCHIVE_DIR
        answer = self._ok(health)
        if status == "failing":
            return ("503 Service Unavailable",) + answer[1:]
        return answer

    def ingest(self, environ: dict, name: Optional[str] = None) -> tuple:
        """POST /api/ingest[/<name>]: archive durably, journal as pending, answer 200."""
        received_at = environ[ENV_RECEIVED]
        if self.stopping.is_set():
            raise ServiceStopping()
        self.authenticate(environ)
        if name is not None and self._token and hmac.compare_digest(
                name.encode("latin-1", "replace"), self._token):
            raise BadRequest("the token belongs in the Authorization header, not in the URL")
        if name is not None and not _valid_name(name):
            raise BadRequest("the ingest name may use letters, digits, '.', '_' and '-' "
                             "(at most %d)" % INGEST_NAME_MAX)
        content_type = environ.get("CONTENT_TYPE", "").lower()
        if content_type.startswith(("multipart/", "text/csv", "application/csv")):
            raise UnsupportedMediaType()
        length = self._content_length(environ)
        conn = self.pool.get()  # before the body: a failure here leaves no upload
        if not self.upload_slots.acquire(blocking=False):
            log_event(logging.WARNING, "upload refused: every upload slot is in use",
                      retry_after_s=RETRY_AFTER_S)
            raise ServiceBusy("every upload slot is in use; send the body again after %d s"
                              % RETRY_AFTER_S)
        try:
            upload = self._receive(environ, length)
            try:
                with self.validation.hold(validation_bytes(upload.size, self.quick_max),
                                          VALIDATION_WAIT_S):
                    headers = {h: _header(environ, h) for h in AUTOMATION_HEADERS}
                    delivery_id = accept_delivery(
                        self.archive, conn, upload, received_at, headers, name,
                        {"content_type": environ.get("CONTENT_TYPE") or None},
                        self.worker.handoff, self.quick_max)
            except ServiceBusy:
                log_event(logging.WARNING, "upload refused: the validation ceiling was not"
                          " free in time", body_bytes=upload.size, retry_after_s=RETRY_AFTER_S)
                raise
            finally:
                upload.discard()  # a no-op once the body is in the archive
        finally:
            self.upload_slots.release()
        self.worker.wake()
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
            raise body_too_large(self.config.max_body_bytes)
        if length == 0:
            raise BadRequest("the request has no body")
        return length

    def _receive(self, environ: dict, length: Optional[int]) -> Upload:
        """Read the body under the route's own deadline (ING-8); a pause longer than
        ``ingest_stall_s`` ends it too (RELY-5.4)."""
        deadline = time.monotonic() + self.config.ingest_budget_s
        sock = _request_socket(environ)

        def before_read() -> None:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise RequestTimeout()
            if sock is not None:
                try:
                    sock.settimeout(min(remaining, self.config.ingest_stall_s))
                except OSError as exc:  # a transport without deadlines is no failure
                    log_event(logging.DEBUG, "cannot set the ingest deadline",
                              error=type(exc).__name__)

        stream = environ["wsgi.input"]
        request = environ.get(ENV_REQUEST)
        if length is None and request is not None:
            # Cheroot reads a whole chunk in one call, after a size line of any length:
            # chunks are decoded here instead, bounded, and the connection then closes.
            stream = ChunkedBody(request.conn.rfile, self.config.max_body_bytes)
            _close_connection(environ)
        try:
            return self.archive.receive(stream.read, length, self.config.max_body_bytes,
                                        before_read)
        except BadRequest:
            if self.stopping.is_set():  # cut off by the shutdown, not by the client
                raise ServiceStopping() from None
            raise
        except HTTPFailure:
            raise
        except StorageFailure as exc:
            log_event(logging.ERROR, "archive write failed: delivery refused",
                      error=type(exc.cause).__name__, errno=exc.cause.errno)
            raise InternalError() from None
        except OSError as exc:  # includes socket timeouts and resets
            if _is_timeout(exc):
                raise RequestTimeout() from None
            log_event(logging.INFO, "upload interrupted", error=type(exc).__name__)
            raise BadRequest("the body could not be read to its end") from None
        except ValueError:  # malformed chunked coding
            raise BadRequest("the chunked body is malformed") from None


    # -- routes: reading ------------------------------------------------------

    def catalog(self, environ: dict) -> tuple:
        """GET /api/catalog: what the store holds per metric and layer; ``kind`` keeps
        the kinds named, ``field`` the metrics whose main value field it is."""
        self.authenticate(environ, cookie=True)
        items = catalog(self.pool.get())
        args = _query_args(environ)
        kinds = args.get("kind")
        if kinds:  # e.g. kind=total,average: the series a chart of buckets can draw
            wanted = {kind.strip() for kind in kinds.split(",")}
            items = [item for item in items if item["meaning"]["kind"] in wanted]
        wanted_field = args.get("field")
        if wanted_field:  # e.g. field=qty: those whose value is qty (a chart that draws qty)
            items = [item for item in items if item["meaning"]["fields"][:1] == [wanted_field]]
        return self._ok({"metrics": items, "groups": groups_json()})

    def points(self, environ: dict) -> tuple:
        """GET /api/points: verbatim points or bucket aggregates, JSON or CSV, streamed."""
        self.authenticate(environ, cookie=True)
        conn = self.pool.get()
        query = point_query(conn, _query_args(environ))
        kind = ("text/csv; charset=utf-8" if query.fmt == "csv"
                else "application/json")
        return ("200 OK", [("Content-Type", kind), ("Cache-Control", "no-store"),
                           ("X-Healthlog-Layer", ",".join(query.fill) or query.layer)],
                _Begun(_in_snapshot(conn, query, self.archive.tmp)))

    def deliveries(self, environ: dict) -> tuple:
        """GET /api/deliveries: the journal, newest first, never bodies or values."""
        self.authenticate(environ, cookie=True)
        return self._ok(deliveries(self.pool.get(), _query_args(environ)))

    def records(self, environ: dict) -> tuple:
        """GET /api/records: workouts, ECG recordings and events, newest first."""
        self.authenticate(environ, cookie=True)
        return self._ok(records(self.pool.get(), _query_args(environ)))

    def workouts(self, environ: dict) -> tuple:
        """GET /api/workouts: the workouts of a range, newest first, duplicates marked."""
        self.authenticate(environ, cookie=True)
        conn = self.pool.get()
        conn.execute("BEGIN")  # one snapshot
        try:
            return self._ok(list_workouts(conn, _query_args(environ), self.archive.tmp))
        finally:
            conn.execute("COMMIT")

    def workout(self, environ: dict, ident: str) -> tuple:
        """GET /api/workouts/<id>: one workout whole (its route thinned for drawing, the
        map tiles' template when ``--map-tiles`` names one); ``<id>.gpx``: its GPX,
        streamed."""
        self.authenticate(environ, cookie=True)
        conn = self.pool.get()
        conn.execute("BEGIN")  # one snapshot
        try:
            if ident.endswith(".gpx"):
                found = find_workout(conn, ident[:-4], self.archive.tmp)
                pieces = gpx_pieces(found)  # NoRoute here, before the answer starts
                name = gpx_file_name(workout_listing(found, LOCAL_ZONE))
            else:
                answer = get_workout(conn, ident, _query_args(environ), self.archive.tmp,
                                     self.config.max_heart_rate, self.config.distance_units)
                answer["map_tiles"] = self.config.map_tiles
                return self._ok(answer)
        finally:
            conn.execute("COMMIT")
        return ("200 OK", [("Content-Type", "application/gpx+xml"),
                           ("Content-Disposition", 'attachment; filename="%s"' % name),
                           ("Cache-Control", "no-store")], pieces)

    def summary(self, environ: dict) -> tuple:
        """GET /api/summary: a day at a glance (the summary page's data)."""
        self.authenticate(environ, cookie=True)
        fresh = self._judge()
        conn = self.pool.get()
        conn.execute("BEGIN")  # one snapshot
        try:
            return self._ok(summary(conn, _query_args(environ), fresh))
        finally:
            conn.execute("COMMIT")

    def _judge(self) -> Freshness:
        if self.judge is not None:
            return self.judge()
        return freshness_of(self.pool.get(), self.config.data_dir, self.config.clock(),
                            self.config.late_after_s)

    def freshness(self, environ: dict) -> tuple:
        """GET /api/freshness: each automation's and metric's state, never a value."""
        self.authenticate(environ, cookie=True)
        return self._ok(self._judge().as_json())

    def coverage(self, environ: dict) -> tuple:
        """GET /api/coverage: how much arrived per local day and metric."""
        self.authenticate(environ, cookie=True)
        args = _query_args(environ)
        fresh = self._judge()
        conn = self.pool.get()
        conn.execute("BEGIN")  # one snapshot
        try:
            return self._ok(coverage(conn, args, fresh))
        finally:
            conn.execute("COMMIT")

    def plan(self, environ: dict) -> tuple:
        """GET /api/plan: the layer, bucket and bounds the metric view reads for a range."""
        self.authenticate(environ, cookie=True)
        conn = self.pool.get()
        conn.execute("BEGIN")  # one snapshot
        try:
            return self._ok(plan_view(conn, _query_args(environ)))
        finally:
            conn.execute("COMMIT")

    def ecg(self, environ: dict) -> tuple:
        """GET /api/ecg: one ECG recording's trace."""
        self.authenticate(environ, cookie=True)
        return self._ok(ecg_trace(self.pool.get(), _query_args(environ)))

    def metrics(self, environ: dict) -> tuple:
        """GET /metrics: Prometheus text format."""
        self.authenticate(environ, cookie=True)
        body = render_metrics(self.pool.get(), self.ingest_seconds, self.worker.fold_seconds,
                              self.worker.state, self._judge(),
                              None if self.notices is None else self.notices())
        return ("200 OK", [("Content-Type", "text/plain; version=0.0.4; charset=utf-8"),
                           ("Content-Length", str(len(body))), ("Cache-Control", "no-store")],
                body)

    # -- routes: MCP (the Streamable HTTP transport) ---------------------------------

    def mcp(self, environ: dict) -> tuple:
        """POST /mcp: one JSON-RPC message (or a 2025-03-26 batch) of the Model Context
        Protocol, answered as JSON (this server sends no stream), behind the token or the
        cookie of every read; a page of another site is refused (403); a notification or
        a response is taken with 202."""
        _refuse_foreign_origin(environ)
        self.authenticate(environ, cookie=True)
        kind = environ.get("CONTENT_TYPE", "").split(";", 1)[0].strip().lower()
        if kind != "application/json":
            raise UnsupportedMediaType("an MCP message is JSON: Content-Type must be"
                                       " application/json")
        accept = environ.get("HTTP_ACCEPT")
        if accept and not any(part.split(";", 1)[0].strip().lower() in (
                "application/json", "application/*", "*/*") for part in accept.split(",")):
            raise NotAcceptable("the answer is JSON: Accept must allow application/json")
        length = environ.get("CONTENT_LENGTH") or ""
        if not re.fullmatch(r"[0-9]{1,12}", length):
            raise BadRequest("an MCP message needs a Content-Length")
        if int(length) > MCP_MESSAGE_MAX:
            raise PayloadTooLarge("an MCP message is %d bytes at most" % MCP_MESSAGE_MAX)
        raw = environ["wsgi.input"].read(int(length))
        headers = {name.lower(): value for name, value in (
            (name, _header(environ, name)) for name in ("MCP-Protocol-Version", "Mcp-Method",
                                                        "Mcp-Name")) if value is not None}
        session = McpSession(self.mcp_reader, headers)
        reply = session.receive(raw)
        if reply is None:
            return "202 Accepted", [("Content-Length", "0")], b""
        status = mcp_http_status(reply, session.modern)
        ok = self._ok(reply)
        return ("%d %s" % (status, _REASONS.get(status, "Error")),) + ok[1:]

    def mcp_other(self, environ: dict) -> tuple:
        """GET and DELETE /mcp: 405, as the transport says for a server that opens no
        stream (GET) and keeps no session to end (DELETE)."""
        _refuse_foreign_origin(environ)
        self.authenticate(environ, cookie=True)
        refusal = MethodNotAllowed(
            "this MCP server sends no stream and keeps no session: POST each message to /mcp")
        refusal.headers = (("Allow", "POST"),)
        raise refusal

    # -- routes: the page and its session -----------------------------------------

    def page(self, environ: dict) -> tuple:
        """GET /: the dashboard when signed in, else the sign-in form."""
        if self._signed_in(environ):
            return _html("200 OK", DASHBOARD_HTML)
        return _html("200 OK", LOGIN_HTML.replace("{message}", ""))

    def login(self, environ: dict) -> tuple:
        """POST /login: the token from the sign-in form sets the session cookie."""
        _refuse_cross_site(environ)
        length = environ.get("CONTENT_LENGTH") or ""
        if not re.fullmatch(r"[0-9]{1,6}", length) or int(length) > LOGIN_FORM_MAX:
            raise BadRequest("a sign-in form has one short field")
        form = urllib.parse.parse_qs(environ["wsgi.input"].read(int(length)).decode(
            "utf-8", "replace"))
        offered = (form.get("token") or [""])[0].strip().encode("utf-8", "replace")
        try:
            self.check_guess(environ, offered)
        except TooManyRequests as exc:
            status, headers, body = _html("429 Too Many Requests", LOGIN_HTML.replace(
                "{message}", '<p class="error">That is not the token of this healthlog, and'
                ' too many wrong ones came from this address: wrong tokens are refused for a'
                ' while (the right one is still taken).</p>'))
            return status, list(headers) + list(exc.headers), body
        except Unauthorized:
            return _html("401 Unauthorized", LOGIN_HTML.replace(
                "{message}", '<p class="error">That is not the token of this healthlog.</p>'))
        session_id, now = secrets.token_hex(16), int(time.time())
        conn = self.pool.get()
        with write_txn(conn):
            conn.execute("DELETE FROM session WHERE expires_at < ?", (now,))
            conn.execute("INSERT INTO session (id, created_at, expires_at) VALUES (?, ?, ?)",
                         (session_id, format_received_at(utc_now()), now + SESSION_MAX_AGE_S))
        cookie = "%s=%s; Path=/; HttpOnly; SameSite=Strict; Max-Age=%d" % (
            SESSION_COOKIE, session_value(self._token, session_id, now + SESSION_MAX_AGE_S),
            SESSION_MAX_AGE_S)
        if environ.get("HTTP_X_FORWARDED_PROTO", "").lower() == "https":
            cookie += "; Secure"
        return ("303 See Other", [("Location", "/"), ("Set-Cookie", cookie),
                                  ("Content-Length", "0"), ("Cache-Control", "no-store")], b"")

    def logout(self, environ: dict) -> tuple:
        """POST /logout: this browser's session ends, and its cookie is cleared;
        ``?everywhere=1`` ends every session (every signed-in browser)."""
        _refuse_cross_site(environ)
        session_id = self._session(environ)
        if session_id is not None:
            everywhere = _query_args(environ).get("everywhere") == "1"
            conn = self.pool.get()
            with write_txn(conn):
                if everywhere:
                    conn.execute("DELETE FROM session")
                else:
                    conn.execute("DELETE FROM session WHERE id = ?", (session_id,))
            log_event(logging.INFO, "signed out", everywhere=everywhere)
        cookie = "%s=; Path=/; HttpOnly; SameSite=Strict; Max-Age=0" % SESSION_COOKIE
        return ("303 See Other", [("Location", "/"), ("Set-Cookie", cookie),
                                  ("Content-Length", "0"), ("Cache-Control", "no-store")], b"")

    def static(self, environ: dict, name: str) -> tuple:
        """GET /static/app.js and /static/app.css: the page's script and style."""
        found = STATIC_FILES.get(name)
        if found is None:
            raise NotFound()
        kind, text = found
        body = text.encode()
        return ("200 OK", [("Content-Type", kind), ("Content-Length", str(len(body))),
                           ("Cache-Control", "no-cache")], body)


def _in_snapshot(conn: sqlite3.Connection, query: PointQuery,
                 spool_dir: Path) -> Iterator[bytes]:
    """The reply read in one snapshot: a fold that commits meanwhile (CSV reads the range
    twice) is not half seen.  The snapshot is held at most :data:`SNAPSHOT_HOLD_S` while
    the client reads; then the rest is written to an unnamed file in ``spool_dir`` at
    once, the snapshot ends, and the client reads the file at its own pace.  The
    transaction ends however the stream ends."""
    conn.execute("BEGIN")
    try:
        pieces = render_points(conn, query)
        deadline = time.monotonic() + SNAPSHOT_HOLD_S
        for piece in pieces:
            yield piece
            if time.monotonic() > deadline:
                break
        else:
            return
        spool = tempfile.TemporaryFile(dir=str(spool_dir))
        try:
            for piece in pieces:
                spool.write(piece)
        except BaseException:
            spool.close()
            raise
    finally:
        conn.execute("COMMIT")
    log_event(logging.DEBUG, "a slow reader reads the rest of its reply from a file",
              bytes=spool.tell())
    with spool:
        spool.seek(0)
        for chunk in iter(lambda: spool.read(STREAM_CHUNK), b""):
            yield chunk


class _Begun:
    """A stream whose first piece is already made: a failure before it (a range the
    answer cannot write, a damaged object) is raised when the stream is made, inside the
    route, and answered as the route's own error, never as a ``200`` that breaks off
    (READ-2.10).  The first piece holds the whole head of the answer (:func:`_chunked`
    joins pieces up to :data:`STREAM_CHUNK` bytes).  ``close`` closes the stream it
    holds, so a client gone early ends its snapshot."""

    def __init__(self, pieces: Iterator[bytes]):
        self._pieces = pieces
        self._first = next(pieces, None)

    def __iter__(self) -> Iterator[bytes]:
        if self._first is not None:
            first, self._first = self._first, None
            yield first
        yield from self._pieces

    def close(self) -> None:
        self._pieces.close()  # type: ignore[attr-defined]


class _Streamed:
    """A streamed answer: its pieces, then one access-log record with the bytes sent."""

    def __init__(self, pieces: Iterator[bytes], logged: Callable[[int], None]):
        self._pieces, self._logged, self._sent = pieces, logged, 0

    def __iter__(self) -> Iterator[bytes]:
        try:
            for piece in self._pieces:
                self._sent += len(piece)
                yield piece
        except Exception as exc:  # the headers are out: all that is left is to stop
            log_event(logging.ERROR, "streamed answer failed", error=type(exc).__name__)
            log_event(logging.DEBUG, "streamed answer failure detail", detail=repr(exc))
            raise

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self._pieces.close()  # type: ignore[attr-defined]
        self._logged(self._sent)


def _query_args(environ: Mapping[str, Any]) -> dict:
    """The query string's parameters, the first value of each."""
    parsed = urllib.parse.parse_qs(environ.get("QUERY_STRING", ""), keep_blank_values=True)
    return {key: values[0] for key, values in parsed.items()}


def _cookie(environ: Mapping[str, Any], name: str) -> Optional[str]:
    for part in environ.get("HTTP_COOKIE", "").split(";"):
        key, _, value = part.strip().partition("=")
        if key == name:
            return value
    return None


def _refuse_cross_site(environ: Mapping[str, Any]) -> None:
    """A state-changing request must come from this site's own page (besides the
    SameSite=Strict cookie): refused when the browser says it is cross-site, or when
    its Origin names another host than the one asked (``X-Forwarded-Host`` when a proxy
    rewrote ``Host``).  Chromium sends ``Origin: null`` for the page's own form posts
    because of ``Referrer-Policy: no-referrer``; ``Sec-Fetch-Site`` still tells."""
    if environ.get("HTTP_SEC_FETCH_SITE", "").lower() in ("cross-site", "same-site"):
        raise Forbidden("cross-site requests are refused")
    origin = environ.get("HTTP_ORIGIN")
    if origin and origin != "null":  # null: the page's own no-referrer policy at work
        host = urllib.parse.urlsplit(origin).netloc.lower()
        asked = (environ.get("HTTP_X_FORWARDED_HOST") or environ.get("HTTP_HOST", ""))
        if host != asked.split(",")[0].strip().lower():  # behind a proxy: the host it was asked
            raise Forbidden("cross-site requests are refused")


def _refuse_foreign_origin(environ: Mapping[str, Any]) -> None:
    """MCP over HTTP from a browser page: only this server's own page may post (the
    transport's rule against DNS rebinding and cross-site requests): refused when the
    browser says cross-site, when the Origin is ``null`` (a sandboxed or local page) or
    names another host than the one asked (``X-Forwarded-Host`` behind a proxy).  A client
    that is no browser sends no Origin."""
    origin = environ.get("HTTP_ORIGIN")
    if environ.get("HTTP_SEC_FETCH_SITE", "").lower() in ("cross-site", "same-site"):
        raise Forbidden("cross-site requests are refused")
    if origin is None:
        return
    host = urllib.parse.urlsplit(origin.strip()).netloc.lower()
    asked = (environ.get("HTTP_X_FORWARDED_HOST") or environ.get("HTTP_HOST", ""))
    if origin.strip() == "null" or host != asked.split(",")[0].strip().lower():
        raise Forbidden("cross-site requests are refused")


def _html(status: str, text: str) -> tuple:
    body = text.encode()
    return (status, [("Content-Type", "text/html; charset=utf-8"),
                     ("Content-Length", str(len(body))), ("Cache-Control", "no-store")], body)


_REASONS = {200: "OK", 202: "Accepted", 400: "Bad Request", 401: "Unauthorized",
            403: "Forbidden", 404: "Not Found", 405: "Method Not Allowed",
            406: "Not Acceptable", 408: "Request Timeout",
            413: "Payload Too Large", 415: "Unsupported Media Type", 429: "Too Many Requests",
            500: "Internal Server Error", 503: "Service Unavailable"}


CHUNK_LINE_MAX = 1024
_CHUNK_SIZE = re.compile(rb"[0-9A-Fa-f]{1,64}")


class ChunkedBody:
    """``Transfer-Encoding: chunked`` decoded from the connection: ``read(n)`` returns at
    most ``n`` bytes of one chunk, so memory stays at a read's size whatever a chunk
    announces; size lines and trailers are bounded, and a chunk larger than the body
    limit is refused before it is read (413)."""

    def __init__(self, rfile: Any, limit: int):
        self._rfile, self._limit = rfile, limit
        self._left, self._done = 0, False

    def _line(self) -> bytes:
        line = self._rfile.readline(CHUNK_LINE_MAX + 1)
        if not line:
            raise BadRequest("the chunked body ended before its last chunk")
        if len(line) > CHUNK_LINE_MAX or not line.endswith(b"\n"):
            raise ValueError("chunk line too long")
        return line.rstrip(b"\r\n")

    def read(self, size: int) -> bytes:
        if self._done:
            return b""
        if not self._left:
            text = self._line().split(b";", 1)[0].strip()
            if not _CHUNK_SIZE.fullmatch(text):
                raise ValueError("bad chunk size")
            self._left = int(text, 16)
            if self._left > self._limit:
                raise body_too_large(self._limit)
            if not self._left:
                for _ in range(64):  # trailers, up to the empty line
                    if not self._line():
                        self._done = True
                        return b""
                raise ValueError("too many trailers")
        data = self._rfile.read(min(size, self._left))
        if not data:
            raise BadRequest("the chunked body ended before its last chunk")
        self._left -= len(data)
        if not self._left and self._rfile.read(2) != b"\r\n":
            raise ValueError("chunk not followed by CRLF")
        return data


def _request_socket(environ: Mapping[str, Any]) -> Any:
    request = environ.get(ENV_REQUEST)
    try:
        return request.conn.socket
    except AttributeError:
        return None


# ==============================================================================
# HTTP transport: the head gate and the Cheroot adapter.
# ==============================================================================

_HEAD_ENDS = (b"\r\n\r\n", b"\n\n")

_CONTENT_LENGTH = re.compile(rb"\ncontent-length[ \t]*:[ \t]*([0-9]{1,12})[ \t]*\r?\n", re.I)

_EXPECT_CONTINUE = re.compile(rb"\nexpect[ \t]*:[ \t]*100-continue", re.I)

GATE_BODY_MAX = 16 * 1024
"""Outside the ingest route, a body up to this size (a sign-in form) must also have
arrived before the request gets a thread; the ingest route reads its body itself, under
its upload slots, its deadline and its stall limit."""


def head_end(data: Any, start: int = 0) -> Optional[int]:
    """Where the request head in ``data`` ends (after its blank line), searching from
    ``start``; None while it has not arrived."""
    ends = [i + len(end) for end in _HEAD_ENDS for i in (data.find(end, start),) if i >= 0]
    return min(ends) if ends else None


def request_size(data: Any, end: int) -> int:
    """How many bytes of ``data`` must have arrived before the request, whose head ends
    at ``end``, is given a thread: the head, and a small announced body outside the
    ingest route."""
    if data.startswith(b"POST /api/ingest"):  # its body is read under the route's budget
        return end
    match = _CONTENT_LENGTH.search(data, 0, end)
    if match is None or int(match.group(1)) > GATE_BODY_MAX or _EXPECT_CONTINUE.search(
            data, 0, end):  # that client sends its body only after "100 Continue"
        return end
    return end + int(match.group(1))


def request_ready(data: bytes) -> bool:
    """Has a request arrived far enough to be given a thread?"""
    end = head_end(data)
    return end is not None and len(data) >= request_size(data, end)


_HEAD_TIMEOUT = b"HTTP/1.1 408 Request Timeout\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"


class _Waiting:
    """A connection in the head gate: what has arrived of its head, and its deadline."""

    __slots__ = ("conn", "head", "deadline", "need")

    def __init__(self, conn: Any, deadline: float):
        self.conn, self.head, self.deadline = conn, bytearray(), deadline
        self.need: Optional[int] = None  # bytes to wait for, once the head has arrived


class HeadGate:
    """Holds each connection until its request line and headers have arrived, then
    hands it to Cheroot's worker threads with those bytes (RELY-5).

    Cheroot gives a connection a worker thread as soon as it is accepted (or, kept
    alive, as soon as a byte arrives) and reads the head in that thread under an
    inactivity timeout only, so 16 clients dribbling header bytes take every thread.
    Here one thread reads the heads of all waiting connections without blocking, under
    one total deadline per head (HEAD_DEADLINE_S); a thread is taken only by a request
    ready to be served.
    """

    def __init__(self, dispatch: Callable[[Any, bytes], None], deadline_s: float,
                 head_limit: int, on_failure: Callable[[], None],
                 capacity: Optional[int] = None):
        self._dispatch, self._on_failure = dispatch, on_failure
        self._deadline_s, self._head_limit = deadline_s, head_limit
        self._capacity = capacity or HEAD_GATE_MAX
        self._selector = selectors.DefaultSelector()
        self._arrivals: collections.deque = collections.deque()
        self._waiting: dict = {}  # fd -> _Waiting
        self._bell_in, self._bell_out = socket.socketpair()
        self._bell_in.setblocking(False)
        self._bell_out.setblocking(False)
        self._selector.register(self._bell_out, selectors.EVENT_READ)
        self._closed = False
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="healthlog-head-gate",
                                        daemon=True)

    def start(self) -> None:
        self._thread.start()

    def admit(self, conn: Any, start: bytes = b"") -> None:
        """Take a connection whose request has still to arrive (any thread); ``start`` is
        what was already read of it."""
        with self._lock:
            if not self._closed:
                self._arrivals.append((conn, start))
                conn = None
        if conn is not None:  # the server is stopping
            _close_quietly(conn)
            return
        with contextlib.suppress(OSError):
            self._bell_in.send(b"\0")

    def stop(self) -> None:
        """Close every waiting connection and end the thread."""
        with self._lock:
            self._closed = True
        with contextlib.suppress(OSError):
            self._bell_in.send(b"\0")
        self._thread.join(5.0)

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    def _run(self) -> None:
        try:
            while True:
                with self._lock:
                    closed = self._closed
                if closed:
                    return
                soonest = min((w.deadline for w in self._waiting.values()), default=None)
                timeout = 1.0 if soonest is None else max(0.0, min(1.0, soonest -
                                                                     time.monotonic()))
                for key, _events in self._selector.select(timeout):
                    if key.fileobj is self._bell_out:
                        with contextlib.suppress(OSError):
                            self._bell_out.recv(4096)
                    else:
                        self._read(key.fd)
                self._take_arrivals()
                self._expire()
        except Exception as exc:  # never expected: say so; serve stops and exits 1
            log_event(logging.ERROR, "request head gate failed", error=type(exc).__name__)
            self._on_failure()
        finally:
            with self._lock:
                self._closed = True
                arrivals, self._arrivals = list(self._arrivals), collections.deque()
            for conn in [conn for conn, _ in arrivals] + [w.conn for w in self._waiting.values()]:
                _close_quietly(conn)
            self._waiting.clear()
            self._selector.close()
            self._bell_in.close()
            self._bell_out.close()

    def _take_arrivals(self) -> None:
        deadline = time.monotonic() + self._deadline_s
        while True:
            with self._lock:
                if not self._arrivals:
                    return
                conn, start = self._arrivals.popleft()
            if len(self._waiting) >= self._capacity:  # the longest waiter makes room
                fd, oldest = min(self._waiting.items(), key=lambda item: item[1].deadline)
                self._forget(fd)
                _close_quietly(oldest.conn)
                log_event(logging.WARNING, "connection closed: too many requests are waiting"
                          " for their headers", waiting=len(self._waiting) + 1)
            try:
                sock = conn.socket
                sock.setblocking(False)
                self._selector.register(sock, selectors.EVENT_READ)
            except (OSError, ValueError):
                _close_quietly(conn)
                continue
            waiting = self._waiting[sock.fileno()] = _Waiting(conn, deadline)
            waiting.head += start
            end = head_end(start)
            if end is not None:  # a head already in, its body still on the way
                waiting.need = request_size(start, end)

    def _read(self, fd: int) -> None:
        waiting = self._waiting.get(fd)
        if waiting is None:
            return
        try:
            chunk = waiting.conn.socket.recv(16384)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            chunk = b""
        if not chunk:  # the client left (or closed an idle kept-alive connection)
            self._forget(fd)
            _close_quietly(waiting.conn)
            return
        waiting.head += chunk
        if waiting.need is None:  # only the new bytes are searched: no rescans
            end = head_end(waiting.head, max(0, len(waiting.head) - len(chunk) - 3))
            if end is None:
                if len(waiting.head) < self._head_limit:
                    return
                end = len(waiting.head)  # too long: Cheroot refuses it
            waiting.need = request_size(waiting.head, end)
        if len(waiting.head) < waiting.need:
            return
        self._forget(fd)
        try:  # Cheroot's threads read with the server's timeout again
            waiting.conn.socket.settimeout(waiting.conn.server.timeout)
            self._dispatch(waiting.conn, bytes(waiting.head))
        except Exception as exc:
            log_event(logging.WARNING, "connection dropped on its way to a worker thread",
                      error=type(exc).__name__)
            _close_quietly(waiting.conn)

    def _expire(self) -> None:
        now = time.monotonic()
        for fd, waiting in list(self._waiting.items()):
            if waiting.deadline <= now:
                self._forget(fd)
                if waiting.head:  # a request was started: tell the client why it ends
                    with contextlib.suppress(OSError):
                        waiting.conn.socket.send(_HEAD_TIMEOUT)
                    log_event(logging.INFO, "request headers did not arrive within %g s"
                              % self._deadline_s, bytes=len(waiting.head))
                _close_quietly(waiting.conn)

    def _forget(self, fd: int) -> None:
        waiting = self._waiting.pop(fd)
        with contextlib.suppress(KeyError, ValueError, OSError):
            self._selector.unregister(waiting.conn.socket)


def _close_quietly(conn: Any) -> None:
    with contextlib.suppress(Exception):
        conn.close()


CHEROOT_INTERNALS = (
    ("makefile.StreamReader.has_data", "whether a connection's reader holds unread bytes"),
    ("makefile.StreamReader's base io.BufferedReader(raw, bufsize)",
     "the head reader calls it, skipping StreamReader.__init__(sock, mode, bufsize)"),
    ("server.HTTPConnection: rfile, socket, rbufsize", "the head gate swaps the reader"),
    ("server.HTTPRequest: conn, server", "the gateway restores the socket timeout"),
    ("wsgi.Server: prepare, process_conn, stop, error_log", "overridden"),
    ("wsgi.Gateway_10: get_environ, respond; server.Gateway: req",
     "overridden; the request in environ"),
)
"""What the Cheroot adapter (:func:`_make_server_classes`) relies on beyond Cheroot's
documented API, checked by :func:`cheroot_missing` when it is built: Cheroot 11.1.2 is
pinned (``pyproject.toml``, the build), and an upgrade that drops one of these stops
``serve`` with a message naming the adapter instead of failing on a request."""


def cheroot_missing(makefile: Any, server: Any, wsgi: Any) -> list:
    """The entries of :data:`CHEROOT_INTERNALS` these Cheroot modules no longer have."""
    def assigned(function: Any) -> set:
        return set(getattr(getattr(function, "__code__", None), "co_names", ()))

    reader = getattr(makefile, "StreamReader", None)
    base = reader.__mro__[1] if isinstance(reader, type) and len(reader.__mro__) > 1 else None
    checks = (
        callable(getattr(reader, "has_data", None)),
        base is not None and base.__name__ == "BufferedReader",
        {"rfile", "socket"} <= assigned(getattr(getattr(server, "HTTPConnection", None),
                                                "__init__", None))
        and hasattr(getattr(server, "HTTPConnection", None), "rbufsize"),
        {"conn", "server"} <= assigned(getattr(getattr(server, "HTTPRequest", None),
                                               "__init__", None)),
        all(callable(getattr(getattr(wsgi, "Server", None), name, None))
            for name in ("prepare", "process_conn", "stop", "error_log")),
        all(callable(getattr(getattr(wsgi, "Gateway_10", None), name, None))
            for name in ("get_environ", "respond"))
        and "req" in assigned(getattr(getattr(server, "Gateway", None), "__init__", None)),
    )
    return [name for (name, _), present in zip(CHEROOT_INTERNALS, checks) if not present]


def _make_server_classes() -> tuple:
    """The Cheroot adapter, the only code that relies on Cheroot's internals
    (:data:`CHEROOT_INTERNALS`): a gateway exposing the request, errors routed to
    logging, and a server that gives a connection a thread only once its head has
    arrived."""
    from cheroot import makefile, server, wsgi

    missing = cheroot_missing(makefile, server, wsgi)
    if missing:
        raise ConfigError(
            "the installed Cheroot lacks what healthlog's Cheroot adapter"
            " (_make_server_classes) relies on: %s; install cheroot==11.1.2, the version"
            " the .pyz is built with" % "; ".join(missing))

    class _Replayed(socket.SocketIO):
        """The socket's reads, after the bytes the head gate already took from it."""

        def __init__(self, sock: Any, first: bytes):
            super().__init__(sock, "rb")
            self.first = memoryview(first)

        def readinto(self, buffer: Any) -> Optional[int]:
            if self.first:
                count = min(len(buffer), len(self.first))
                buffer[:count] = self.first[:count]
                self.first = self.first[count:]
                return count
            return super().readinto(buffer)

    def _buffered(rfile: Any) -> bytes:
        """Take what a connection's reader holds but no request has read yet."""
        data = b""
        if makefile.StreamReader.has_data(rfile):  # its buffer, without reading the socket
            data = rfile.read(len(rfile.peek(1)))
        if isinstance(rfile, HeadReader):
            data += bytes(rfile.raw.first)
            rfile.raw.first = memoryview(b"")
        return data

    class HeadReader(makefile.StreamReader):
        """Cheroot's request reader over ``_Replayed``: the head comes first."""

        def __init__(self, sock: Any, first: bytes, bufsize: int):
            super(makefile.StreamReader, self).__init__(_Replayed(sock, first), bufsize)
            self.bytes_read = 0

        def has_data(self) -> bool:
            return super().has_data() or bool(self.raw.first)

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
        head_gate: Optional[HeadGate] = None
        on_failure: Callable[[], None] = staticmethod(lambda: None)

        def prepare(self) -> None:
            super().prepare()
            self.head_gate = HeadGate(self._dispatch_head, min(HEAD_DEADLINE_S, self.timeout),
                                      self.max_request_header_size or HEADER_LIMIT,
                                      self.on_failure)
            self.head_gate.start()

        def process_conn(self, conn: Any) -> None:
            if self.head_gate is None:
                super().process_conn(conn)
                return
            start = _buffered(conn.rfile) if conn.rfile.has_data() else b""
            if start and request_ready(start):  # a pipelined request already read in
                self._dispatch_head(conn, start)
            else:
                self.head_gate.admit(conn, start)

        def _dispatch_head(self, conn: Any, head: bytes) -> None:
            conn.rfile = HeadReader(conn.socket, head, conn.rbufsize)
            super().process_conn(conn)

        def stop(self) -> None:
            if self.head_gate is not None:
                self.head_gate.stop()
            super().stop()

        def error_log(self, msg: str = "", level: int = 20, traceback: bool = False) -> None:
            log_event(max(level, logging.WARNING) if traceback else level,
                      "http server: " + str(msg)[:200],
                      error=_error_name(sys.exc_info()[1]) if traceback else None)
            if traceback:
                _log.debug("http server traceback", exc_info=True)
            if msg == "Error in HTTPServer.serve":  # its loop would spin: out of descriptors
                time.sleep(SERVE_ERROR_PAUSE_S)

    return Gateway, Server


# ==============================================================================
# Service: the lock, database, worker, notifier and server of `serve`; its memory.
# ==============================================================================


class Service:
    """``healthlog serve`` as an object: ``start()``, ``address``, ordered ``stop()``."""

    def __init__(self, config: Config, announce: Optional[Callable[[str], None]] = None):
        self.config = config
        self.announce = announce or (lambda text: print(text, flush=True))
        self.lock = DataDirLock(config.data_dir)
        self.archive = Archive(config.data_dir)
        self.pool = ConnectionPool(config, synchronous="FULL")
        self.worker = FoldWorker(config)
        self.freshness = FreshnessSource(config)
        self.notifier = Notifier(config, self.freshness)
        self.app: Optional[App] = None  # built at start, around the worker it then has
        self.server: Any = None
        self.stopping = threading.Event()
        self._serve_thread: Optional[threading.Thread] = None
        self._stopped: Optional[bool] = None
        self.failed = threading.Event()

    @property
    def address(self) -> tuple:
        return self.server.bind_addr[:2]

    @property
    def broken(self) -> bool:
        """The HTTP server or the fold thread ended on its own: ``serve`` exits 1."""
        return self.failed.is_set() or self.worker.died.is_set()

    def start(self) -> None:
        if self.config.token is not None:
            check_token_length(self.config.token, "--token (or HEALTHLOG_TOKEN)")
        archive_waits = ensure_data_dir(self.config.data_dir, wait_for_archive=True)
        self.lock.acquire("serve")
        try:
            conn = open_database(self.config)
            try:
                requeue_covered(conn)
                warn_if_folded_by_older_parser(conn)
                warn_if_journal_lost(conn, self.config.data_dir)
                if archive_waits:
                    log_event(logging.WARNING, archive_missing_message(self.config.data_dir)
                              + "; serve waits for it: ingest answers 503 (the phone sends"
                              " again), the fold waits, /healthz answers 503",
                              archive=str(self.archive.root))
                else:
                    settle_archive(conn, self.config.data_dir)
            except sqlite3.DatabaseError as exc:
                if is_corruption(exc):
                    raise damaged_database(self.config.db_path, exc) from None
                raise
            finally:
                conn.close()
            self.app = App(self.config, self.archive, self.pool, self.worker, self.stopping,
                           self.notifier.judge,
                           (lambda: dict(self.notifier.counts)) if self.config.notify_url
                           else None)
            self._bind()  # a taken port fails here: before a token is announced or a fold runs
            self.archive.clear_tmp()
            token, made = resolve_token(self.config)
            self.app.set_token(token)
            self.notifier.start()  # its baseline: the store before a delivery is taken
            self._serve_thread = threading.Thread(target=self._serve, name="healthlog-http")
            self._serve_thread.start()
            self.worker.start()
        except BaseException:
            if self.server is not None:
                self.server.stop()
            self.worker.stop(0)
            self.notifier.stop(0)
            self.pool.close()
            self.lock.release()
            raise
        host, port = self.address
        self.announce(start_banner(self.config, host, port, token if made else None))
        log_event(logging.INFO, "serving", listen=format_address(host, port),
                  data=str(self.config.data_dir), version=__version__)
        warn_if_memory_short(self.config)

    def _bind(self) -> None:
        gateway, server_class = _make_server_classes()
        server = server_class((self.config.host, self.config.port), self.app,
                              numthreads=self.config.http_threads,
                              timeout=self.config.http_timeout_s,
                              shutdown_timeout=self.config.stop_budget_s,
                              request_queue_size=LISTEN_BACKLOG, server_name="healthlog")
        server.gateway = gateway
        server.on_failure = self.failed.set  # serve then stops and exits 1
        server.expiration_interval = ACCEPT_TICK_S
        server.max_request_header_size = HEADER_LIMIT
        server.max_request_body_size = 0  # the ingest route enforces its own limit
        try:
            server.prepare()
        except OSError as exc:
            raise ConfigError("cannot listen on %s: %s" % (self.config.listen,
                                                           exc.strerror or exc)) from None
        self.server = server

    def _serve(self) -> None:
        try:
            self.server.serve()
        except Exception as exc:
            log_event(logging.ERROR, "http server stopped unexpectedly", error=type(exc).__name__)
            self.failed.set()

    def stop(self) -> bool:
        """Stop HTTP first, then the fold thread, each within the stop budget (ING-6).

        Returns True when both ended in time.  Not finishing is a WARN, never an error:
        an unfinished fold's delivery simply stays pending.  The database connections
        and the data-directory lock are let go only once every request and the fold
        have ended (RELY-8.4): until then a second process could write beside them.
        Idempotent.
        """
        if self._stopped is not None:
            return self._stopped
        self.stopping.set()
        self.notifier.stop(0)  # asked now, awaited below: a notice under way ends meanwhile
        budget = self.config.stop_budget_s
        running = []
        if self.server is not None:
            stopper = threading.Thread(target=self.server.stop, name="healthlog-http-stop",
                                       daemon=True)
            stopper.start()
            stopper.join(budget)
            running.append(stopper)
            if self._serve_thread is not None:
                self._serve_thread.join(0.1 if stopper.is_alive() else budget)
                running.append(self._serve_thread)
            if any(thread.is_alive() for thread in running):
                log_event(logging.WARNING, "requests still running after the stop budget",
                          budget_s=budget)
            else:
                log_event(logging.INFO, "http stopped")
        finished = self.worker.stop(budget)
        folding = self.worker.current
        if not finished and folding is not None:
            self.worker.settle(folding)
        if not finished:
            log_event(logging.WARNING, "fold thread did not stop within the budget; its"
                      " delivery stays pending and is folded after the next start",
                      budget_s=budget)
        if self.worker.thread is not None:
            running.append(self.worker.thread)
        if not self.notifier.stop(budget):
            log_event(logging.WARNING, "the notifier did not stop within the budget (a"
                      " receiver that does not answer)", budget_s=budget)
        running = [thread for thread in running if thread.is_alive()]
        if running:
            log_event(logging.WARNING, "the data directory stays locked until the running"
                      " work has ended", threads=len(running))
            threading.Thread(target=self._release_after, args=(running,),
                             name="healthlog-release", daemon=True).start()
        else:
            self._release()
        self._stopped = not running
        return self._stopped

    def _release_after(self, running: list) -> None:
        for thread in running:
            thread.join()
        self._release()

    def _release(self) -> None:
        self.pool.close()
        self.freshness.close()
        self.lock.release()


SERVE_BASE_MIB = 64
"""Resident memory of an idle ``serve`` (57 MiB measured, with orjson), with room."""
FOLD_MEMORY_FACTOR = 3.0
WHOLE_FOLD_FACTOR = 10.0
"""Memory above the base per byte of the largest body, for its fold as serve's fold
thread runs it (``tests/bench_memory.py --serve``, every body shape, over serve's idle
memory): from :data:`STREAM_FOLD_BYTES` on, at most 2.79 times the body (600,000 metrics
of one point each at 64 MiB, 2.63 in another run; 2.04 to 2.46 for every other shape;
2.00 to 2.23 for every shape folded in a process of its own: in serve's fold thread,
glibc's allocator keeps more of what a fold frees); a smaller body is parsed whole, up to
9.4 times its size (``--mib 7.9``; 6.5 in a process of its own), so the fold of a body
just under that size bounds what small limits need."""
CGROUP_ROOT = Path("/")
"""Where ``/proc/self/cgroup`` and ``/sys/fs/cgroup`` are read from."""


def fold_memory_mib(max_body_bytes: int) -> float:
    """What the fold of the largest body may need above the base, in MiB."""
    return max(FOLD_MEMORY_FACTOR * max_body_bytes,
               WHOLE_FOLD_FACTOR * min(max_body_bytes, STREAM_FOLD_BYTES - 1)) / 1048576


def validation_memory_mib(max_body_bytes: int) -> float:
    """What the ingest checks running at once may hold, in MiB: as much as the check of
    the largest body (:data:`VALIDATION_MEMORY_FACTOR`; :func:`validation_ceiling` and
    :func:`quick_check_bytes` keep them within it)."""
    return VALIDATION_MEMORY_FACTOR * max_body_bytes / 1048576


def memory_needed_mib(max_body_bytes: int) -> int:
    """What ``serve`` may need at once: its base, the small documents waiting for the
    fold (:class:`Handoff`), the fold of a body of the largest size and, beside it, the
    ingest check of another as large (a phone sending its backfill again while the first
    copy folds)."""
    return int(SERVE_BASE_MIB + HANDOFF_BUDGET / 1048576 + fold_memory_mib(max_body_bytes)
               + validation_memory_mib(max_body_bytes))


def largest_body_mib(limit_bytes: int) -> int:
    """The largest ``--max-body-mib`` whose need fits in ``limit_bytes`` (0 when none)."""
    low, high = 0, 1 << 20  # the need grows with the body: the largest that fits
    while low < high:
        middle = (low + high + 1) // 2
        if memory_needed_mib(middle << 20) * 1048576 <= limit_bytes:
            low = middle
        else:
            high = middle - 1
    return low


def _cgroup_limit(path: Path) -> Optional[int]:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() and int(text) < 1 << 60 else None  # "max": none


def memory_limit() -> tuple:
    """(bytes, what they are) this process may use: the smallest memory limit of its
    control group and their parents (cgroup v2 ``memory.max``, v1
    ``memory.limit_in_bytes``: systemd's ``MemoryMax``, a container's limit), else the
    physical memory."""
    physical = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    limits = []
    try:
        lines = (CGROUP_ROOT / "proc/self/cgroup").read_text().splitlines()
    except OSError:
        lines = []
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        if controllers == "":
            base, name = CGROUP_ROOT / "sys/fs/cgroup", "memory.max"
        elif "memory" in controllers.split(","):
            base, name = CGROUP_ROOT / "sys/fs/cgroup/memory", "memory.limit_in_bytes"
        else:
            continue
        relative = Path(path.lstrip("/"))
        for folder in [relative] + list(relative.parents):  # a container sees its own as /
            limit = _cgroup_limit(base / folder / name)
            if limit is not None:
                limits.append(limit)
    if limits and min(limits) < physical:
        return min(limits), "the control group's memory limit"
    return physical, "the physical memory"


def warn_if_memory_short(config: Config) -> None:
    """A WARN when the largest body allowed may need more memory than this process may
    use, with the largest --max-body-mib that fits (RELY-10.1)."""
    limit, what = memory_limit()
    needed = memory_needed_mib(config.max_body_bytes)
    if needed * 1048576 <= limit:
        return
    safe = largest_body_mib(limit)
    log_event(logging.WARNING, "the largest body allowed may need more memory than healthlog"
              " may use: a fold killed for it would be tried again at each restart (three"
              " times, then failed); lower --max-body-mib or give more memory",
              max_body_mib=config.max_body_bytes >> 20, needed_mib=needed,
              limit_mib=limit >> 20, limit_of=what, safe_max_body_mib=safe)


def local_addresses() -> list:
    """This machine's addresses a phone on the LAN can use: IPv4 of every interface but
    loopback, and global IPv6 (Linux: ``/proc/net/if_inet6``)."""
    found = []
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        for _, name in socket.if_nameindex():
            try:  # SIOCGIFADDR: the interface's IPv4 address
                packed = fcntl.ioctl(probe.fileno(), 0x8915,
                                     name.encode()[:15].ljust(40, b"\0"))
            except OSError:
                continue
            address = socket.inet_ntoa(packed[20:24])
            if not address.startswith("127.") and address not in found:
                found.append(address)
    except (OSError, AttributeError):  # no if_nameindex, or no such ioctl, off Linux
        pass
    finally:
        probe.close()
    try:
        with open("/proc/net/if_inet6") as table:
            for line in table:
                fields = line.split()
                if len(fields) >= 6 and fields[3] == "00" and fields[5] != "lo":  # global
                    address = socket.inet_ntop(socket.AF_INET6, bytes.fromhex(fields[0]))
                    if address not in found:
                        found.append(address)
    except OSError:
        pass
    return found


HAE_SETTINGS = (("Export Format", "JSON"), ("Export Version", "v2"),
                ("Time Grouping", "one per automation (Minutes, and Days in a second one)"),
                ("Batch Requests", "off (on for a big backfill)"))
"""What to choose in Health Auto Export besides URL and headers, in the order its REST API
automation screen shows them (README: Setting up Health Auto Export)."""


def start_banner(config: Config, host: str, port: int, new_token: Optional[str]) -> str:
    """What ``serve`` prints on standard output at each start: where the dashboard is and
    what to type into Health Auto Export.  The token itself only when it was just made (and
    never in a log record)."""
    if host in ("0.0.0.0", "::", ""):
        hosts = local_addresses() or ["<this-machine>"]
        hosts += ["127.0.0.1"] if host == "0.0.0.0" else ["::1"]
    else:
        hosts = [host]
    urls = ["http://%s" % format_address(name, port) for name in hosts]
    lan = [url for url in urls if "127.0.0.1" not in url and "[::1]" not in url] or urls
    if new_token is not None:
        token = new_token
        kept = ("a new access token, kept in %s (mode 0600; it is shown only this once)"
                % (config.data_dir / TOKEN_NAME))
    elif config.token:
        token, kept = "<the token you gave>", "the token given with --token or HEALTHLOG_TOKEN"
    else:
        token = "<the token in %s>" % (config.data_dir / TOKEN_NAME)
        kept = "the access token in %s" % (config.data_dir / TOKEN_NAME)
    lines = ["healthlog %s: data in %s; %s" % (__version__, config.data_dir, kept), "",
             "Dashboard (sign in with the token):"]
    lines += ["  %s/" % url for url in urls]
    lines += ["", "In Health Auto Export, add an automation of type REST API:",
              "  %-16s%s/api/ingest" % ("URL:", lan[0])]
    lines += ["  %-16s%s/api/ingest  (or this address)" % ("", url) for url in lan[1:]]
    lines.append("  %-16sAuthorization: Bearer %s" % ("Headers:", token))
    lines += ["  %-16s%s" % (name + ":", value) for name, value in HAE_SETTINGS]
    return "\n".join(lines) + "\n"


def run_serve(config: Config) -> int:
    """Run until SIGTERM/SIGINT; exit 0 after the ordered shutdown."""
    service = Service(config)
    stop = threading.Event()

    def on_signal(signum: int, frame: Any) -> None:
        log_event(logging.INFO, "stop requested", signal=signal.Signals(signum).name)
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    service.start()
    while not stop.is_set() and not service.broken:
        stop.wait(0.5)
    finished = service.stop()
    log_event(logging.INFO, "stopped")
    code = 1 if service.broken else 0
    if not finished:
        # A request or the fold (daemon threads) is mid-transaction: exiting now rolls
        # its work back, which is the defined state (a delivery not answered is not
        # accepted; an unfinished fold's delivery stays pending), and ends the lock.
        logging.shutdown()
        os._exit(code)
    return code


# ==============================================================================
# Maintenance: reindex, verify, import, refold, export: the store from the archive.
# ==============================================================================


def _duration(seconds: float) -> str:
    seconds = int(seconds)
    if seconds < 120:
        return "%ds" % seconds
    if seconds < 7200:
        return "%dm%02ds" % divmod(seconds, 60)
    return "%dh%02dm" % (seconds // 3600, seconds % 3600 // 60)


def run_refold(config: Config, ids: Sequence[int], all_failed: bool, out: Any = None) -> int:
    """``healthlog refold``: set failed deliveries back to ``pending`` for the fold to try
    again, without a full ``reindex``.  One short write transaction, so it is safe
    beside a running ``serve`` (its periodic pass picks them up) or without one (the
    next start folds them)."""
    out = out or sys.stdout
    if not ids and not all_failed:
        raise ConfigError("name the deliveries to fold again (their ids, as `healthlog"
                          " status` lists them), or pass --failed for every failed one")
    if DataDirLock(config.data_dir).holder() == "reindex":
        raise ConfigError("%s is being reindexed, which folds every delivery again"
                          % config.data_dir)
    conn = open_database(config, create=False)
    try:
        with write_txn(conn):
            if all_failed:  # every failed one, besides the ids named
                ids = list(ids) + [i for (i,) in conn.execute(
                    "SELECT id FROM delivery WHERE parse_status = 'failed' ORDER BY id")]
            found = dict(conn.execute("SELECT id, parse_status FROM delivery WHERE id IN"
                                      " (%s)" % ",".join("?" * len(ids)), list(ids)))
            unknown = sorted(set(ids) - set(found))
            if unknown:
                raise ConfigError("no delivery %s in %s" % (
                    ", ".join(map(str, unknown)), config.data_dir))
            chosen = sorted(i for i in set(ids) if found[i] == "failed")
            conn.executemany(
                "UPDATE delivery SET parse_status = 'pending', attempts = 0, error = NULL,"
                " folded_at = NULL, layer = NULL, %s WHERE id = ? AND parse_status = 'failed'"
                % ", ".join("%s = NULL" % column for column in _COUNTERS),
                [(i,) for i in chosen])
            first = chosen and conn.execute(
                "SELECT received_at, id FROM delivery WHERE id IN (%s) ORDER BY received_at, id"
                " LIMIT 1" % ",".join("?" * len(chosen)), chosen).fetchone()
            later = first and conn.execute(
                "SELECT 1 FROM delivery WHERE parse_status IN ('parsed', 'partial') AND"
                " (received_at > ? OR (received_at = ? AND id > ?)) LIMIT 1",
                (first[0], first[0], first[1])).fetchone()
    finally:
        conn.close()
    for delivery_id in sorted(set(ids) - set(chosen)):
        out.write("delivery %d is %s, not failed: left as it is\n"
                  % (delivery_id, found[delivery_id]))
    if not chosen:
        out.write("refold: no failed delivery to fold again\n")
        return 0
    out.write("refold: %s set back to pending (%s); a running `healthlog serve` folds them"
              " within a minute, otherwise its next start does\n"
              % (_plural(len(chosen), "delivery", "deliveries"), ", ".join(map(str, chosen))))
    if later:
        out.write("later deliveries are folded already: `healthlog reindex` folds everything"
                  " in journal order, should a value depend on it\n")
    log_event(logging.INFO, "deliveries set back to pending", count=len(chosen))
    return 0

JOURNAL_COLUMNS = ("id", "received_at", "journaled_at", "archive_path", "body_bytes",
                   "body_sha256",
                   "automation_id", "automation_name", "automation_aggregation",
                   "automation_period", "session_id", "path_name")
"""What a delivery is, before any fold: copied into a rebuild, never recomputed."""

REBUILD_BUSY_TRIES = 10
REBUILD_BATCH_S = 0.25
"""A rebuild writes the objects its folds changed four times a second, each once however
many folds changed it (:meth:`FoldEngine.write_behind`), or sooner when
:data:`REBUILD_HELD_MAX` rows are held.  Each delivery's outcome is still committed with
its fold, so the write lock is held only for moments and ``import`` keeps working."""
REBUILD_HELD_MAX = 4096
REBUILD_AHEAD = 16
REBUILD_AHEAD_BYTES = 32 << 20
"""A parallel rebuild asks its workers to prepare at most 16 deliveries per worker beyond
the one being decided, and at most 32 MiB of bodies."""


def refuse_unreachable(data_dir: Path, paths: Iterator[tuple], command: str) -> None:
    """Refuse ``command`` (reindex, verify) while the archive, or a day folder of a
    journaled body, is missing or unreadable: it would rebuild the store without those
    bodies and call them lost (RELY-11.3)."""
    paths = list(paths)
    if paths and archive_absent(data_dir):
        raise ConfigError(archive_missing_message(data_dir))
    unreachable = absent_bodies(data_dir, paths)[1]
    if unreachable:
        raise ConfigError(
            "%s of the journal's bodies cannot be read (%s%s): is the disk mounted and"
            " readable by this user? %s changed nothing" % (
                _plural(len(unreachable), "folder", "folders"), unreachable[0],
                " …" if len(unreachable) > 1 else "", command))


def mark_missing(conn: sqlite3.Connection, data_dir: Path, journal: str) -> int:
    """Rows whose body file is gone from its readable folder become ``failed`` with
    error ``body_missing`` (:func:`refuse_unreachable` has made sure the folders are)."""
    gone = absent_bodies(data_dir, conn.execute("SELECT id, archive_path FROM %s" % journal))[0]
    missing = [(row_id,) for row_id in gone]
    if missing:
        with write_txn(conn):
            conn.executemany(
                "UPDATE %s SET parse_status = 'failed', error = ?, folded_at = ?,"
                " parser_version = ?, layer = NULL, %s WHERE id = ?"
                % (journal, ", ".join("%s = NULL" % c for c in _COUNTERS)),
                [(BodyMissing.error_class, format_received_at(utc_now()), PARSER_VERSION,
                  row_id) for (row_id,) in missing])
    return len(missing)


class Progress:
    """``done/total deliveries, MB/s, ETA`` on stderr, only when stderr is a terminal."""

    def __init__(self, label: str, total: int, total_bytes: int, stream: Any = None):
        self.stream = stream or sys.stderr
        self.enabled = bool(getattr(self.stream, "isatty", lambda: False)())
        self.label, self.total, self.total_bytes = label, total, max(total_bytes, 1)
        self.started = self._shown = time.monotonic()

    def update(self, done: int, done_bytes: int) -> None:
        now = time.monotonic()
        if not self.enabled or (now - self._shown < 0.25 and done < self.total):
            return
        self._shown = now
        elapsed = max(now - self.started, 1e-6)
        rate = done_bytes / elapsed
        eta = (self.total_bytes - done_bytes) / rate if rate else 0
        self.stream.write("\r%s: %d/%d deliveries, %.1f MB/s, ETA %s   " % (
            self.label, done, self.total, rate / 1e6, _duration(eta)))
        self.stream.flush()

    def finish(self) -> None:
        if self.enabled:
            self.stream.write("\n")
            self.stream.flush()


# ------------------------------------------------------------------------------
# A rebuild on every core: workers parse (map) and merge the objects of their shard
# (reduce); the writer decides each outcome in journal order and routes the points.
# ------------------------------------------------------------------------------


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity, e.g. ``taskset``)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def can_fork() -> bool:
    """Rebuild workers are forked: the platform needs ``os.fork`` (Linux, the BSDs,
    macOS); elsewhere a rebuild runs in one process."""
    return hasattr(os, "fork")


REBUILD_SHARD_FLUSH_S = 2.0
"""A worker writes the objects of its shard to its own scratch file every 2 s (or at
:data:`REBUILD_HELD_MAX` rows): no other process waits for that file's lock."""
REBUILD_LOCK_HOLD_S = 0.05
REBUILD_LOCK_GAP_S = 0.01
"""The writer of a parallel rebuild commits before it waits for a worker, and at the
latest after 50 ms; then it leaves the write lock free for 10 ms, so that an ``import``
beside it (whose wait for the lock polls every few ms, then every 100 ms) gets a turn."""
REBUILD_GATHER_ROWS = 16384
"""Objects the writer copies from a worker's scratch file per transaction at the end: a
year of minute data (57k objects) in a few transactions of about 0.15 s each."""
REBUILD_CHUNK_POINTS = 20_000
"""A body the writer reads itself (one of :data:`STREAM_FOLD_BYTES` or more) goes to the
shards' workers in pieces of about this many points, so it is never whole in memory."""
REBUILD_UNSENT_MAX = 64 << 20
"""Bytes the writer may hold for workers that have not read them yet; past it, it waits."""
_FRAME = struct.Struct("!Q")
_MAX_FD = os.sysconf("SC_OPEN_MAX") if hasattr(os, "sysconf") else 1024


def _frame(message: Any) -> bytes:
    data = pickle.dumps(message, pickle.HIGHEST_PROTOCOL)
    return _FRAME.pack(len(data)) + data


def _read_message(sock: socket.socket) -> Any:
    """The next framed message from a blocking socket; None at its end."""
    head = _read_exactly(sock, _FRAME.size)
    body = head and _read_exactly(sock, _FRAME.unpack(head)[0])
    return None if body is None else pickle.loads(body)


def _read_exactly(sock: socket.socket, size: int) -> Optional[bytearray]:
    data = bytearray(size)
    view, got = memoryview(data), 0
    while got < size:
        count = sock.recv_into(view[got:])
        if not count:
            return None
        got += count
    return data


def shard_of(name: str, hour: int, shards: int) -> int:
    """The worker that owns the objects of a metric's hour (whatever their layer)."""
    return (zlib.crc32(name.encode("utf-8", "surrogatepass")) + hour) % shards


def shard_entries(extraction: Extraction, shards: int,
                  check_deadline: Callable[[], None]) -> Iterator[tuple]:
    """(shard, (name, is_metric, units, hour, items, dropped)) for every hour of every
    metric of a body, in the order :meth:`FoldEngine._merge` takes them."""
    for bucket in extraction.take_buckets():
        for hour, items, dropped in hour_items(bucket, check_deadline):
            yield shard_of(bucket.name, hour, shards), (bucket.name, bucket.is_metric,
                                                        bucket.units, hour, items, dropped)


class Workers:
    """Forked worker processes, each reached over its own socket pair with pickled,
    length-prefixed messages: no semaphore, so nothing needs ``/dev/shm``.  The writer
    never blocks sending (its ends are non-blocking; what a socket does not take waits
    here and goes when it drains), so it never waits on a worker that waits on it."""

    def __init__(self, jobs: int, child: Callable[[socket.socket, int], None]):
        self.socks: list = []
        self._pids: list = []
        # What exists now is shared with the workers until written to: keep the collector
        # from writing to all of it in each of them (every page would be copied).
        gc.freeze()
        try:
            for index in range(jobs):
                ours, theirs = socket.socketpair()
                try:
                    pid = os.fork()
                except OSError:
                    ours.close()
                    theirs.close()
                    raise
                if pid == 0:  # the worker leaves by os._exit: no finalizer, no atexit
                    code = 0
                    try:
                        signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the writer's
                        # Only its socket and the standard streams: not the data
                        # directory's lock, the writer's database or other workers' ends,
                        # so that nothing of the writer outlives it here.
                        keep = theirs.fileno()
                        os.closerange(3, keep)
                        os.closerange(keep + 1, _MAX_FD)
                        child(theirs, index)
                    except BaseException:
                        code = 1
                    finally:
                        os._exit(code)
                theirs.close()
                ours.setblocking(False)
                self.socks.append(ours)
                self._pids.append(pid)
        except OSError as exc:  # no process or descriptor left (a pid or file limit)
            self.close(abort=True)
            raise PoolBroken("rebuild workers could not be started (%s)"
                             % errno.errorcode.get(exc.errno, exc.errno)) from None
        except BaseException:
            self.close(abort=True)
            raise
        finally:
            gc.unfreeze()
        self._selector = selectors.DefaultSelector()
        for index, sock in enumerate(self.socks):
            self._selector.register(sock, selectors.EVENT_READ, index)
        self._out: list = [collections.deque() for _ in self.socks]
        self._in: list = [bytearray() for _ in self.socks]
        self.unsent = 0

    def send(self, index: int, message: Any) -> None:
        frame = memoryview(_frame(message))
        self._out[index].append(frame)
        self.unsent += len(frame)
        self._pump(index)

    def _pump(self, index: int) -> None:
        out = self._out[index]
        while out:
            try:
                sent = self.socks[index].send(out[0])
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                raise PoolBroken("rebuild worker %d ended" % (index + 1)) from None
            self.unsent -= sent
            if sent == len(out[0]):
                out.popleft()
            else:
                out[0] = out[0][sent:]
                return

    def receive(self, timeout: Optional[float] = None) -> list:
        """Wait (at most ``timeout`` seconds) until a worker answers or a socket with
        something unsent drains: [(worker, message)], possibly empty."""
        for index, out in enumerate(self._out):
            self._selector.modify(self.socks[index], selectors.EVENT_READ | (
                selectors.EVENT_WRITE if out else 0), index)
        messages = []
        for selected, events in self._selector.select(timeout):
            index = selected.data
            if events & selectors.EVENT_WRITE:
                self._pump(index)
            if events & selectors.EVENT_READ:
                messages.extend((index, message) for message in self._read(index))
        return messages

    def _read(self, index: int) -> list:
        try:
            chunk = self.socks[index].recv(1 << 20)
        except (BlockingIOError, InterruptedError):
            return []
        except OSError:
            chunk = b""
        if not chunk:
            raise PoolBroken("rebuild worker %d ended" % (index + 1))
        data = self._in[index]
        data += chunk
        messages = []
        while len(data) >= _FRAME.size:
            size = _FRAME.unpack_from(data)[0]
            if len(data) < _FRAME.size + size:
                break
            messages.append(pickle.loads(memoryview(data)[_FRAME.size:_FRAME.size + size]))
            del data[:_FRAME.size + size]
        return messages

    def close(self, abort: bool = False) -> None:
        """Close the writer's ends (a worker reads their end and exits), or kill the
        workers first (``abort``: an error or Ctrl-C in the writer); reap them."""
        for pid in self._pids if abort else ():
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        if getattr(self, "_selector", None) is not None:
            self._selector.close()
        for sock in self.socks:
            sock.close()
        for pid in self._pids:
            with contextlib.suppress(OSError):
                os.waitpid(pid, 0)


class _ShardEngine(FoldEngine):
    """A worker's fold engine for the objects of its shard, in a scratch database of its
    own, writing behind; journal positions come from the writer's snapshot."""

    def __init__(self, conn: sqlite3.Connection, config: Config, positions: dict):
        super().__init__(conn, config, verbose=False)
        self.write_behind()
        self._journal_positions = positions
        self.flushed = time.monotonic()

    def position(self, delivery_id: int) -> tuple:
        return (self._journal_positions.get(delivery_id, ""), delivery_id)


def _rebuild_child(sock: socket.socket, index: int, config: Config, shards: int,
                   shard_path: Path, positions: dict) -> None:
    """A rebuild worker: prepare the bodies it is asked to (parse, place, outline,
    split by shard) and merge, in the order sent, the hours of its own shard; at the
    end, write its objects to ``shard_path``.  It writes no other file and logs
    nothing."""
    engine = None
    kept: dict = {}  # delivery id -> the hours of this shard of a body prepared here
    while True:
        message = _read_message(sock)
        if message is None:
            return
        kind = message[0]
        if kind == "prepare":
            answer = _prepare(message, config, shards, index, kept)
        elif kind == "forget":
            kept.pop(message[1], None)
            continue
        elif kind == "merge":
            if engine is None:
                # A scratch file read once at the end and lost with the rebuild if it
                # fails: no journal, no sync.
                conn = sqlite3.connect(str(shard_path), isolation_level=None)
                conn.execute("PRAGMA journal_mode=OFF")
                conn.execute("PRAGMA synchronous=OFF")
                for statement in schema_statements():  # its object table, no index
                    if statement.startswith("CREATE TABLE object "):
                        conn.execute(statement)
                engine = _ShardEngine(conn, config, positions)
            answer = _merge_share(engine, message, kept)
        else:
            if engine is not None:
                engine.flush()
                engine.conn.close()
            answer = ("finished", index)
        sock.sendall(_frame(answer))


def _prepare(message: tuple, config: Config, shards: int, index: int, kept: dict) -> tuple:
    """("prepared", id, outline, shares): the body's outcome inputs and its hours split
    by shard, each a pickled list or None (nothing), this worker's own shard kept here
    (True); or ("prepared", id, outline or None, (kind, error, uncovered)) when it cannot
    be read, parsed or placed (the outline when only placing its hours failed: the
    decision comes first, as in one process)."""
    _, delivery_id, relative, aggregation, body_bytes = message
    deadline = time.monotonic() + fold_budget_s(config, body_bytes)

    def check_deadline() -> None:
        if time.monotonic() > deadline:
            raise FoldDeadlineExceeded()

    outline = None
    try:
        extraction, plain = extract_body(config.data_dir / relative, check_deadline)
        outline = outline_of(extraction, plain, aggregation)
        shares: list = [[] for _ in range(shards)]
        for shard, entry in shard_entries(extraction, shards, check_deadline):
            shares[shard].append(entry)
        sent = [pickle.dumps(share, pickle.HIGHEST_PROTOCOL) if share and shard != index
                else None for shard, share in enumerate(shares)]
    except Exception as exc:  # classified as the fold would (after its decision, if any)
        outcome = classify(exc)
        return ("prepared", delivery_id, outline,
                (outcome.kind, outcome.error, getattr(exc, "uncovered", None)))
    if shares[index]:
        kept[delivery_id] = shares[index]
        sent[index] = True
    return ("prepared", delivery_id, outline, sent)


def _merge_share(engine: _ShardEngine, message: tuple, kept: dict) -> tuple:
    """Merge a delivery's hours of this shard (sent, or None: kept here when it was
    prepared): ("merged", id, counters, warnings), or ("merge failed", id) (the writer
    then abandons the parallel rebuild)."""
    _, delivery_id, here, metric_layer, plain, share = message
    entries = kept.pop(delivery_id) if share is None else pickle.loads(share)
    deadline = time.monotonic() + engine.config.fold_deadline_s
    plan = FoldPlan(delivery_id, "", None, [], counters=dict.fromkeys(_COUNTERS, 0),
                    metric_layer=metric_layer, plain=plain, here=here)
    try:
        for name, is_metric, units, hour, items, dropped in entries:
            if time.monotonic() > deadline:
                raise FoldDeadlineExceeded()
            engine.merge_items(plan, name, is_metric, units, hour, items, dropped)
        engine.store(plan)
        if (time.monotonic() - engine.flushed >= REBUILD_SHARD_FLUSH_S
                or engine.held >= REBUILD_HELD_MAX):
            engine.flush()
            engine.flushed = time.monotonic()
    except Exception:
        return ("merge failed", delivery_id)
    finally:
        plan.rows.close()
    return ("merged", delivery_id, plan.counters, plan.warnings)


class _ParallelRebuild:
    """The writer of a parallel rebuild (:func:`rebuild` with jobs > 1).

    Workers prepare the next deliveries ahead (at most :data:`REBUILD_AHEAD` per worker
    and :data:`REBUILD_AHEAD_BYTES` of bodies); the writer takes them in journal order,
    decides each outcome with the fold's own code (:meth:`FoldEngine.decide`, the
    duplicate and inheritance rules reading the journal it writes) and sends each hour
    to the worker that owns its objects (:func:`shard_of`), which merges them in the
    order sent.  Every object meets the deliveries that touch it in journal order, as in
    one process, so the store is the same.  The outcomes are written as decided (their
    counters once the shards have answered); the writer commits before it waits for a
    worker, so the write lock is held only while it writes and ``import`` keeps working.
    A body of :data:`STREAM_FOLD_BYTES` or more, or one a worker could not read for a
    passing fault, is read here and sent in pieces."""

    def __init__(self, engine: FoldEngine, ids: list, sizes: dict, progress: Progress,
                 jobs: int, shard_dir: Path):
        self.engine, self.conn, self.config = engine, engine.conn, engine.config
        self.ids, self.sizes, self.progress, self.jobs = ids, sizes, progress, jobs
        self.shard_paths = [shard_dir / ("shard-%d.sqlite3" % n) for n in range(jobs)]
        self.prepared: dict = {}
        self.waiting: dict = {}  # id -> [plan, answers awaited, still sending, started]
        self.finished: set = set()
        positions = dict(self.conn.execute("SELECT id, received_at FROM %s" % engine.journal))
        config, paths = self.config, self.shard_paths
        self.workers = Workers(jobs, lambda sock, index: _rebuild_child(
            sock, index, config, jobs, paths[index], positions))
        self.asked = self.asked_bytes = self.done_bytes = 0
        self.rows: dict = {}
        self.began = math.inf  # when the open transaction began

    def run(self) -> None:
        """Fold every delivery, wait for the shards, copy their objects in."""
        try:
            for done, delivery_id in enumerate(self.ids, 1):
                self._ask_ahead(done)
                self._fold(delivery_id)
                self.done_bytes += self.sizes.get(delivery_id, 0)
                self.progress.update(done, self.done_bytes)
                if time.monotonic() - self.began >= REBUILD_LOCK_HOLD_S:
                    self._commit()  # and a moment without the lock before the next write
                    time.sleep(REBUILD_LOCK_GAP_S)
            while self.waiting:
                self._receive()
            for index in range(self.jobs):
                self.workers.send(index, ("finish",))
            while len(self.finished) < self.jobs:
                self._receive()
            self._commit()
        except BaseException as exc:
            self.workers.close(abort=True)
            if self.conn.in_transaction:
                with contextlib.suppress(sqlite3.Error):
                    self.conn.execute("ROLLBACK")
            if isinstance(exc, sqlite3.Error):  # as the one-process rebuild ends
                raise HealthlogError(STUCK_REBUILD) from None
            raise
        self.workers.close()
        self._gather()

    def _ask_ahead(self, done: int) -> None:
        limit = min(done + REBUILD_AHEAD * self.jobs, len(self.ids))
        while self.asked < limit and (self.asked < done
                                      or self.asked_bytes < REBUILD_AHEAD_BYTES):
            delivery_id = self.ids[self.asked]
            row = self.rows[delivery_id] = self.engine.row(delivery_id)
            size = self.sizes.get(delivery_id, 0)
            if row is not None and size < STREAM_FOLD_BYTES:
                self.workers.send(self.asked % self.jobs, (
                    "prepare", delivery_id, row["archive_path"],
                    row["automation_aggregation"], row["body_bytes"]))
                self.prepared[delivery_id] = None  # asked
                self.asked_bytes += size
            self.asked += 1

    def _fold(self, delivery_id: int) -> None:
        started = time.monotonic()
        row = self.rows.pop(delivery_id)
        if row is None:
            return
        if delivery_id not in self.prepared:  # too big to send whole
            self._fold_here(row, started)
            return
        while self.prepared[delivery_id] is None:
            self._receive()
        outline, shares = self.prepared.pop(delivery_id)
        self.asked_bytes -= self.sizes.get(delivery_id, 0)
        kept = [shard for shard, share in enumerate(shares) if share is True]
        plan = self._duplicate(row, started)
        if plan is None and outline is not None:
            plan = self._decide(row, outline)
        if plan is None or plan.error is not None or type(shares) is tuple:
            for shard in kept:  # nothing of it is merged
                self.workers.send(shard, ("forget", delivery_id))
            if plan is not None and plan.error is None:  # placing its hours failed
                kind, error, uncovered = shares
                if kind == "failed":
                    self._record_failed(delivery_id, error, uncovered)
                else:  # a passing fault: read it here, as the fold would again
                    self._fold_here(row, started)
            elif plan is None and outline is None:  # it could not be read or parsed
                kind, error, uncovered = shares
                if kind == "failed":
                    self._record_failed(delivery_id, error, uncovered)
                else:
                    self._fold_here(row, started)
            return
        self.engine._describe(plan, outline)
        self._record(plan)
        self.waiting[delivery_id] = [plan, 0, True, started]
        for shard, share in enumerate(shares):
            if share is not None:
                self._send(shard, plan, None if share is True else share)
        self._sent(delivery_id)

    def _duplicate(self, row: Mapping[str, Any], started: float) -> Optional[FoldPlan]:
        """The plan of a delivery whose bytes an earlier folded one had, recorded."""
        duplicate = self.engine.earlier_duplicate(row)
        if duplicate is None:
            return None
        earlier, status, layer, uncovered = duplicate
        plan = FoldPlan(row["id"], status, layer, json.loads(uncovered),
                        error="duplicate of delivery %d" % earlier,
                        counters=dict.fromkeys(_COUNTERS, 0))
        self._record(plan)
        self._done(plan, started)
        return plan

    def _fold_here(self, row: Mapping[str, Any], started: float) -> None:
        """Read, parse and place the body here, and send its hours in pieces."""
        deadline = started + fold_budget_s(self.config, row["body_bytes"])

        def check_deadline() -> None:
            if time.monotonic() > deadline:
                raise FoldDeadlineExceeded()

        if self._duplicate(row, started) is not None:
            return
        path = self.config.data_dir / row["archive_path"]
        for _ in range(REBUILD_BUSY_TRIES):
            try:
                extraction, plain = extract_body(path, check_deadline)
                break
            except Exception as exc:
                outcome = classify(exc)
                if outcome.kind == "failed":
                    self._record_failed(row["id"], outcome.error,
                                        getattr(exc, "uncovered", None))
                    return
                self._commit()
                time.sleep(1.0)
        else:
            raise HealthlogError(STUCK_REBUILD)
        outline = outline_of(extraction, plain, row["automation_aggregation"])
        plan = self._decide(row, outline)
        if plan is None:
            return
        self.engine._describe(plan, outline)
        self._record(plan)
        self.waiting[plan.delivery_id] = [plan, 0, True, started]
        pieces: list = [[] for _ in range(self.jobs)]
        sizes = [0] * self.jobs
        try:
            for shard, entry in shard_entries(extraction, self.jobs, check_deadline):
                pieces[shard].append(entry)
                sizes[shard] += len(entry[4])
                if sizes[shard] >= REBUILD_CHUNK_POINTS:
                    self._send(shard, plan, pickle.dumps(pieces[shard],
                                                         pickle.HIGHEST_PROTOCOL))
                    pieces[shard], sizes[shard] = [], 0
            for shard, piece in enumerate(pieces):
                if piece:
                    self._send(shard, plan, pickle.dumps(piece, pickle.HIGHEST_PROTOCOL))
        except (PoolBroken, HealthlogError, KeyboardInterrupt):
            raise
        except Exception as exc:  # some pieces are merged already: start again in one process
            raise PoolBroken("a large body could not be placed here (%s)"
                             % type(exc).__name__) from None
        self._sent(plan.delivery_id)

    def _decide(self, row: Mapping[str, Any], outline: BodyOutline) -> Optional[FoldPlan]:
        try:
            return self.engine.decide(row, outline)
        except FoldFailure as exc:  # nothing placed, no layer to be found
            self._record_failed(row["id"], classify(exc).error, exc.uncovered)
            return None

    def _send(self, shard: int, plan: FoldPlan, share: Optional[bytes]) -> None:
        """Send one share of the planned delivery to its owner (counted as awaited)."""
        while self.workers.unsent > REBUILD_UNSENT_MAX:
            self._receive()
        self.waiting[plan.delivery_id][1] += 1
        self.workers.send(shard, ("merge", plan.delivery_id, plan.here, plan.metric_layer,
                                  plan.plain, share))

    def _sent(self, delivery_id: int) -> None:
        """Every share of the delivery is on its way: done once all are merged."""
        waiting = self.waiting[delivery_id]
        waiting[2] = False
        self._answered(delivery_id)

    def _answered(self, delivery_id: int) -> None:
        plan, awaited, sending, started = self.waiting[delivery_id]
        if awaited or sending:
            return
        del self.waiting[delivery_id]
        self._begin()
        self.conn.execute(
            "UPDATE %s SET %s WHERE id = ?" % (self.engine.journal, ", ".join(
                "%s = ?" % name for name in _COUNTERS)),
            [plan.counters[name] for name in _COUNTERS] + [delivery_id])
        self._done(plan, started)

    def _receive(self) -> None:
        """Wait for the workers, committing first: no write lock is held while they
        work."""
        self._commit()
        for _, message in self.workers.receive():
            kind = message[0]
            if kind == "prepared":
                self.prepared[message[1]] = message[2:]
            elif kind == "merged":
                _, delivery_id, counters, warnings = message
                waiting = self.waiting[delivery_id]
                plan = waiting[0]
                for name, count in counters.items():  # the shard's own, from zero
                    plan.counters[name] += count
                plan.warnings.extend(warnings)
                waiting[1] -= 1
                self._answered(delivery_id)
            elif kind == "merge failed":
                raise PoolBroken("a rebuild worker could not merge a delivery")
            else:
                self.finished.add(message[1])

    def _record(self, plan: FoldPlan) -> None:
        self._begin()
        self.engine._record(plan.delivery_id, plan.status, plan.layer, plan.uncovered,
                            plan.error, [plan.counters.get(name) for name in _COUNTERS])

    def _record_failed(self, delivery_id: int, error: str, uncovered: Optional[list]) -> None:
        self._begin()
        self.engine._record(delivery_id, "failed", None, uncovered, error,
                            [None] * len(_COUNTERS))
        log_event(logging.DEBUG, "delivery failed to fold", delivery_id=delivery_id,
                  error=error)

    def _done(self, plan: FoldPlan, started: float) -> None:
        self.engine._log_folded(plan, time.monotonic() - started, False)

    def _begin(self) -> None:
        """Open the writer's transaction (until it next waits, :meth:`_commit`)."""
        if self.conn.in_transaction:
            return
        for attempt in range(REBUILD_BUSY_TRIES):
            try:
                self.conn.execute("BEGIN IMMEDIATE")
                self.began = time.monotonic()
                return
            except sqlite3.Error as exc:
                if not is_busy(exc) or attempt == REBUILD_BUSY_TRIES - 1:
                    raise HealthlogError(STUCK_REBUILD) from None
                time.sleep(1.0)

    def _commit(self) -> None:
        if self.conn.in_transaction:
            try:
                self.conn.execute("COMMIT")
            except sqlite3.Error:
                raise HealthlogError(STUCK_REBUILD) from None
        self.began = math.inf

    def _gather(self) -> None:
        """Copy the shards' objects into the rebuild's object table, in transactions of
        :data:`REBUILD_GATHER_ROWS` rows.  A disk that fills here hands the rebuild to one
        process (the shards' files are gone by then)."""
        columns = ("metric, layer, hour, units, first_at, last_at, points, delivery_id,"
                   " updated_by, hash, sealed, blob, point_deliveries, summary, spans")
        try:
            for path in self.shard_paths:
                if not path.exists():
                    continue
                self.conn.execute("ATTACH DATABASE ? AS shard", (str(path),))
                try:
                    after: tuple = ("", "", -(1 << 62))
                    while True:
                        self._begin()
                        last = self.conn.execute(
                            "SELECT metric, layer, hour FROM (SELECT metric, layer, hour FROM"
                            " shard.object WHERE (metric, layer, hour) > (?, ?, ?) ORDER BY"
                            " metric, layer, hour LIMIT ?) ORDER BY metric DESC, layer DESC,"
                            " hour DESC LIMIT 1", after + (REBUILD_GATHER_ROWS,)).fetchone()
                        if last is None:
                            self._commit()
                            break
                        self.conn.execute(
                            "INSERT INTO %s (%s) SELECT %s FROM shard.object WHERE"
                            " (metric, layer, hour) > (?, ?, ?) AND (metric, layer, hour) <="
                            " (?, ?, ?)" % (self.engine.objects, columns, columns),
                            after + tuple(last))
                        self._commit()
                        after = tuple(last)
                finally:
                    if self.conn.in_transaction:
                        self.conn.execute("ROLLBACK")
                    self.conn.execute("DETACH DATABASE shard")
        except sqlite3.Error as exc:
            if is_storage_failure(exc):
                raise PoolBroken("the rebuild's copy of its objects ran out of room") from None
            raise HealthlogError(STUCK_REBUILD) from None


def rebuild(conn: sqlite3.Connection, config: Config, journal: str, objects: str,
            ids: list, label: str, jobs: int = 1) -> float:
    """Fold ``ids`` in the given (journal) order into ``objects``/``journal`` with the
    worker's own fold code and classifier; no out-of-order check, no lag WARN.  With
    ``jobs`` > 1, in that many worker processes beside this one
    (:class:`_ParallelRebuild`): the same store, on every core.

    Returns the seconds it took.  A database that stays busy aborts the rebuild; a
    worker that ends or fails raises :class:`PoolBroken` (the caller starts again in
    one process).
    """
    engine = FoldEngine(conn, config, objects=objects, journal=journal, verbose=False)
    sizes = dict(conn.execute("SELECT id, body_bytes FROM %s" % journal))
    progress = Progress(label, len(ids), sum(sizes.get(i, 0) for i in ids))
    if jobs > 1 and len(ids) > 1 and can_fork():
        with scratch_folder(config.data_dir, "rebuild-") as shard_dir:
            _ParallelRebuild(engine, ids, sizes, progress, jobs, shard_dir).run()
        progress.finish()
        return time.monotonic() - progress.started
    done_bytes = 0
    engine.write_behind()
    flushed = time.monotonic()
    for done, delivery_id in enumerate(ids, 1):
        for _ in range(REBUILD_BUSY_TRIES):
            if not engine.fold(delivery_id).deferred:
                break
            time.sleep(1.0)
        else:
            raise HealthlogError(STUCK_REBUILD)
        done_bytes += sizes.get(delivery_id, 0)
        if time.monotonic() - flushed >= REBUILD_BATCH_S or engine.held >= REBUILD_HELD_MAX:
            _flush(engine)
            flushed = time.monotonic()
        progress.update(done, done_bytes)
    _flush(engine)
    progress.finish()
    return time.monotonic() - progress.started


STUCK_REBUILD = ("the database stayed busy or could not be written; stopped (nothing was"
                 " replaced)")


def _flush(engine: FoldEngine) -> None:
    """:meth:`FoldEngine.flush`, waiting out a writer such as ``import``."""
    for attempt in range(REBUILD_BUSY_TRIES):
        try:
            engine.flush()
            return
        except sqlite3.Error as exc:
            if not is_busy(exc) or attempt == REBUILD_BUSY_TRIES - 1:
                raise HealthlogError(STUCK_REBUILD) from None
            time.sleep(1.0)


def _drop_rebuild_tables(conn: sqlite3.Connection) -> None:
    with write_txn(conn):
        conn.execute("DROP TABLE IF EXISTS object_rebuild")
        conn.execute("DROP TABLE IF EXISTS delivery_rebuild")


def run_reindex(config: Config, out: Any = None, force: bool = False, jobs: int = 1) -> int:
    """``healthlog reindex``: rebuild journal outcomes and the vitrine from the archive.

    Everything is folded into ``delivery_rebuild``/``object_rebuild``; the live tables
    are replaced in one transaction at the end, so a crash or Ctrl-C at any point
    leaves the previous store intact and usable.  A rebuild in which deliveries that
    are folded now would end ``failed`` (an unmounted archive, a full disk, memory
    running out) is not swapped in unless ``force``.  ``jobs``: processes that parse and
    merge beside this one (:func:`rebuild`); the store is the same.
    """
    out = out or sys.stdout
    if not (config.data_dir / ARCHIVE_DIR).is_dir() and not journal_has_rows(config.db_path):
        raise ConfigError("no healthlog archive in %s" % config.data_dir)
    lock = DataDirLock(config.data_dir)
    try:
        lock.acquire("reindex")
    except DataDirLocked:
        raise ConfigError("%s is in use (is `healthlog serve` running there?); stop it"
                          " before reindex" % config.data_dir) from None
    conn = open_database(config, synchronous="NORMAL")
    swapped = False
    try:
        _drop_rebuild_tables(conn)  # left by an interrupted run
        refuse_unreachable(config.data_dir, conn.execute(
            "SELECT id, archive_path FROM delivery"), "reindex")
        Archive(config.data_dir).clear_scratch()
        adopted = adopt_orphans(conn, config.data_dir)
        cols = ", ".join(JOURNAL_COLUMNS)
        missing, last_id, ids = _rebuild_tables(conn, config, cols)
        jobs = jobs if can_fork() and len(ids) > 1 else 1
        try:
            seconds = rebuild(conn, config, "delivery_rebuild", "object_rebuild", ids,
                              "reindex", jobs)
        except PoolBroken as exc:
            log_event(logging.WARNING, "the parallel reindex stopped; starting again in one"
                      " process", reason=str(exc))
            _drop_rebuild_tables(conn)
            missing, last_id, ids = _rebuild_tables(conn, config, cols)
            jobs = 1
            seconds = rebuild(conn, config, "delivery_rebuild", "object_rebuild", ids,
                              "reindex")
        if not force:
            _refuse_regressions(conn)
        _swap_rebuild(conn, cols, last_id)
        swapped = True
        with contextlib.suppress(sqlite3.Error):
            conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        counts = _status_counts(conn)
        objects, points = conn.execute(
            "SELECT count(*), coalesce(sum(points), 0) FROM object").fetchone()
        archive_bytes = conn.execute(
            "SELECT coalesce(sum(body_bytes), 0) FROM delivery").fetchone()[0]
        fp = fingerprint(conn)
    except KeyboardInterrupt:
        # The swap's COMMIT may have returned just before the signal was delivered.
        swapped = swapped or not conn.execute(
            "SELECT 1 FROM sqlite_master WHERE name = 'delivery_rebuild'").fetchone()
        if swapped:
            message = ("reindex interrupted after the rebuilt store was swapped in; it is"
                       " complete (`healthlog status` shows it)")
        else:
            with contextlib.suppress(sqlite3.Error):
                _drop_rebuild_tables(conn)
            message = "reindex interrupted; the previous store is unchanged"
        if sys.stderr.isatty():
            sys.stderr.write("\n")  # end the progress line
        sys.stderr.write("healthlog: %s\n" % message)
        return 130
    except BaseException:
        if not swapped:  # the previous store stays; so must no half rebuild
            with contextlib.suppress(sqlite3.Error):
                _drop_rebuild_tables(conn)
        raise
    finally:
        conn.close()
        lock.release()
    out.write("deliveries: %d (%s)\n" % (sum(counts.values()), ", ".join(
        "%s %d" % item for item in counts.items())))
    out.write("orphans adopted: %d\nbodies missing: %d\nobjects: %d\npoints: %d\n"
              % (adopted, missing, objects, points))
    out.write("folded: %d deliveries in %.1f s, %s (%.0f deliveries/s, %.1f MB/s,"
              " %.0f points/s)\n"
              % (len(ids), seconds, _plural(jobs, "job", "jobs"), len(ids) / max(seconds, 1e-9),
                 archive_bytes / 1e6 / max(seconds, 1e-9), points / max(seconds, 1e-9)))
    out.write("fingerprint: %s\n" % fp)
    return 0


def _rebuild_tables(conn: sqlite3.Connection, config: Config, cols: str) -> tuple:
    """Create the rebuild's tables with every journal row waiting: (bodies missing, the
    last id copied, the ids to fold in journal order)."""
    with write_txn(conn):
        for statement in schema_statements("delivery_rebuild", "object_rebuild"):
            if " ON object_rebuild " not in statement:  # built once, at the swap
                conn.execute(statement)
        conn.execute("INSERT INTO delivery_rebuild (%s) SELECT %s FROM delivery"
                     % (cols, cols))
    missing = mark_missing(conn, config.data_dir, "delivery_rebuild")
    last_id = conn.execute("SELECT coalesce(max(id), 0) FROM delivery_rebuild").fetchone()[0]
    ids = [i for (i,) in conn.execute(
        "SELECT id FROM delivery_rebuild WHERE parse_status = 'pending'"
        " ORDER BY received_at, id")]
    return missing, last_id, ids


def _refuse_regressions(conn: sqlite3.Connection) -> None:
    """Raise when deliveries that are ``parsed``/``partial`` now end ``failed`` in the
    rebuild for a reason other than a missing body, or when every folded delivery's body
    is missing (an archive that is not mounted): the store would lose their points, and
    only reindex retries failed deliveries, so a wrong swap would last (ING-3).  A few
    missing bodies are reported and the rest proceeds."""
    lost = conn.execute(
        "SELECT r.error, count(*) FROM delivery_rebuild r JOIN delivery d ON d.id = r.id"
        " WHERE d.parse_status IN ('parsed', 'partial') AND r.parse_status = 'failed'"
        " GROUP BY r.error ORDER BY r.error").fetchall()
    folded = conn.execute("SELECT count(*) FROM delivery"
                          " WHERE parse_status IN ('parsed', 'partial')").fetchone()[0]
    missing = sum(n for error, n in lost if error == "body_missing")
    if missing < folded or not folded:
        lost = [(error, n) for error, n in lost if error != "body_missing"]
    if lost:
        raise HealthlogError(
            "reindex would turn %s into failed ones (%s); nothing was replaced. Is the"
            " archive complete and the disk healthy? Rerun, or pass --force to accept"
            % (_plural(sum(n for _, n in lost), "folded delivery", "folded deliveries"),
               ", ".join("%s %d" % (error, n) for error, n in lost)))


def _plural(count: int, one: str, many: str) -> str:
    return "%d %s" % (count, one if count == 1 else many)


def _swap_rebuild(conn: sqlite3.Connection, cols: str, last_id: int) -> None:
    """Replace the live tables by the rebuilt ones in one durable transaction.

    Deliveries journaled meanwhile (``import`` does not take the lock) are carried
    over as ``pending``; the next ``serve`` folds them.
    """
    conn.execute("PRAGMA synchronous=FULL")
    with write_txn(conn):
        conn.execute("INSERT INTO delivery_rebuild (%s) SELECT %s FROM delivery WHERE id > ?"
                     % (cols, cols), (last_id,))
        conn.execute("DROP TABLE object")
        conn.execute("DROP TABLE delivery")
        conn.execute("ALTER TABLE object_rebuild RENAME TO object")
        conn.execute("ALTER TABLE delivery_rebuild RENAME TO delivery")
        for name in ("journal", "pending", "body"):
            conn.execute("DROP INDEX delivery_rebuild_%s" % name)
        for statement in index_statements("delivery") + index_statements("object"):
            conn.execute(statement)


def run_verify(config: Config, out: Any = None, jobs: int = 1) -> int:
    """``healthlog verify``: rebuild into a scratch database and compare objects.

    Reads the live database only (one snapshot of journal and objects), so it runs
    beside ``serve``.  Deliveries still pending in the snapshot are left out of the
    rebuild, as they are out of the live store.  Exit 0 when equal, 1 when not.
    """
    out = out or sys.stdout
    live = open_database(config, create=False, synchronous="NORMAL")
    try:
        live.execute("BEGIN")
        journal = live.execute("SELECT %s, error, parse_status, folded_at FROM delivery"
                               % ", ".join(JOURNAL_COLUMNS)).fetchall()
        live_objects = {(metric, layer, hour): digest
                        for metric, layer, hour, digest in live.execute(
            "SELECT metric, layer, hour, hash FROM object")}
        live.execute("COMMIT")
    finally:
        live.close()
    path_at = JOURNAL_COLUMNS.index("archive_path")
    refuse_unreachable(config.data_dir, ((row[0], row[path_at]) for row in journal), "verify")
    orphans = len(set(archive_bodies(config.data_dir)) - {row[path_at] for row in journal})
    returned = sum(1 for row in journal if row[-2] == "failed"
                   and worth_retrying(row[len(JOURNAL_COLUMNS)])
                   and (config.data_dir / row[path_at]).is_file())
    # Never folded yet: not in the live store either.  (A row requeued at start has been
    # folded before; its objects are live, so it is rebuilt too.)
    live_pending = {row[0] for row in journal if row[-2] == "pending" and not row[-1]}
    try:
        rebuilt = _verify_rebuild(config, journal, live_pending, jobs)
    except PoolBroken as exc:
        log_event(logging.WARNING, "the parallel verify stopped; starting again in one"
                  " process", reason=str(exc))
        rebuilt = _verify_rebuild(config, journal, live_pending, 1)
    differing = sorted(k for k in live_objects.keys() | rebuilt.keys()
                       if live_objects.get(k) != rebuilt.get(k))
    out.write("live:    %d objects, fingerprint: %s\n" % (
        len(live_objects), fingerprint_rows(live_objects.items())))
    out.write("rebuilt: %d objects, fingerprint: %s\n" % (
        len(rebuilt), fingerprint_rows(rebuilt.items())))
    if live_pending:
        out.write("not compared: %s still pending\n" % _plural(len(live_pending), "delivery",
                                                               "deliveries"))
    if orphans:
        out.write("orphans: %s without a journal row (reindex adopts them)\n"
                  % _plural(orphans, "archived body", "archived bodies"))
    if returned:
        out.write("failed: %s failed for a reason of the machine, and %s body is there;"
                  " `healthlog refold --failed` folds them again\n"
                  % (_plural(returned, "delivery", "deliveries"),
                     "its" if returned == 1 else "each"))
    for metric, layer, hour in differing[:20]:
        out.write("differs: metric=%s layer=%s hour=%s live=%s rebuilt=%s\n" % (
            loggable_metric(metric), layer, format_instant(hour * HOUR_US),
            (live_objects.get((metric, layer, hour)) or "absent")[:12],
            (rebuilt.get((metric, layer, hour)) or "absent")[:12]))
    if len(differing) > 20:
        out.write("differs: … and %d more\n" % (len(differing) - 20))
    out.write("fingerprint: %s\n" % fingerprint_rows(live_objects.items()))
    out.write("verify: %s\n" % ("equal" if not differing else "%d objects differ; `healthlog"
                                " reindex` rebuilds the store from the archive"
                                % len(differing)))
    return 1 if differing else 0


def _verify_rebuild(config: Config, journal: list, live_pending: set, jobs: int) -> dict:
    """The object hashes a rebuild of the journal's snapshot gives, in a scratch store."""
    with scratch_folder(config.data_dir, "verify-") as scratch_dir:
        scratch = connect(scratch_dir / DB_NAME, busy_timeout_s=config.busy_timeout_s,
                          synchronous="NORMAL")
        try:
            migrate(scratch, scratch_dir / DB_NAME)
            with write_txn(scratch):
                scratch.executemany("INSERT INTO delivery (%s) VALUES (%s)" % (
                    ", ".join(JOURNAL_COLUMNS), ", ".join("?" * len(JOURNAL_COLUMNS))),
                    [row[:len(JOURNAL_COLUMNS)] for row in journal])
            mark_missing(scratch, config.data_dir, "delivery")
            ids = [i for (i,) in scratch.execute(
                "SELECT id FROM delivery WHERE parse_status = 'pending' ORDER BY received_at, id")
                if i not in live_pending]
            rebuild(scratch, config, "delivery", "object", ids, "verify", jobs)
            return {(metric, layer, hour): digest
                    for metric, layer, hour, digest in scratch.execute(
                "SELECT metric, layer, hour, hash FROM object")}
        finally:
            scratch.close()


def run_import(config: Config, files: Sequence[str], aggregation: Optional[str],
               name: Optional[str], out: Any = None) -> int:
    """``healthlog import FILE…``: journal HAE JSON exports through the ingest path.

    Safe beside a running ``serve`` (its worker folds them on its next wake-up);
    refused while ``reindex`` runs.  Exit 0 when every file was accepted, else 2.
    """
    out = out or sys.stdout
    if aggregation is not None and header_layer(aggregation) is None:
        raise ConfigError("--aggregation must be one of " + ", ".join(GROUPINGS))
    if name is not None and not _valid_name(name):
        raise ConfigError("--name may use letters, digits, '.', '_' and '-' (at most %d)"
                          % INGEST_NAME_MAX)
    ensure_data_dir(config.data_dir)
    if DataDirLock(config.data_dir).holder() == "reindex":
        raise ConfigError("%s is being reindexed; import after it has finished"
                          % config.data_dir)
    conn = open_database(config)
    headers = {"automation-aggregation": aggregation} if aggregation else {}
    rejected = 0
    try:
        with scratch_folder(config.data_dir, IMPORT_SCRATCH) as spool:
            archive = Archive(config.data_dir, tmp=spool)  # a starting serve leaves it alone
            for path in files:
                try:
                    delivery_id = _import_one(archive, conn, Path(path), headers, name)
                except HTTPFailure as exc:
                    rejected += 1
                    out.write("rejected %s: %s\n" % (path, exc.message))
                else:
                    out.write("accepted %s: delivery %d\n" % (path, delivery_id))
    finally:
        conn.close()
    return 2 if rejected else 0


def _refuse_undecidable_layer(conn: sqlite3.Connection, body: Path, headers: dict,
                              name: Optional[str], received_at: _dt.datetime) -> None:
    """Refuse, before it is journaled, a file whose metrics no rule could place: no
    ``--aggregation``, too few bucket points to infer from, and no earlier delivery of
    the same ``--name`` to inherit from.  HTTP ingest journals such a body (the phone
    must get its answer); an import can still be fixed by the person typing it."""
    if header_layer(headers.get("automation-aggregation")) is not None:
        return
    try:
        extraction = extract_body(body)[0]
    except (OSError, ValueError, RecursionError, FoldFailure, ArchiveFault):
        return  # unreadable or not HAE-shaped: the validation that follows says why
    if not extraction.has_metric_points or infer_layer(extraction) is not None:
        return
    position = {"automation_id": None, "automation_name": None, "path_name": name,
                "received_at": format_received_at(received_at), "id": 1 << 62}
    earlier = name is not None and conn.execute(
        "SELECT 1 FROM delivery WHERE path_name = ? AND parse_status = 'pending'"
        " LIMIT 1", (name,)).fetchone() is not None  # its fold may yet give a layer
    if not earlier and inherited_layer(conn, position) is None:
        raise BadRequest("the time grouping of its metrics cannot be told from the file;"
                         " pass --aggregation with the grouping the export used (%s)"
                         % ", ".join(g.title() for g in GROUPINGS))


def _import_one(archive: Archive, conn: sqlite3.Connection, path: Path, headers: dict,
                name: Optional[str]) -> int:
    try:
        stat = path.stat()
        size = stat.st_size
        if size > FOLD_MAX_BYTES:
            raise PayloadTooLarge("larger than %d MiB, too big to fold; export shorter date"
                                  " ranges" % (FOLD_MAX_BYTES >> 20))
        with open(str(path), "rb") as handle:
            upload = archive.receive(handle.read, size, FOLD_MAX_BYTES, lambda: None)
    except StorageFailure as exc:
        raise ConfigError("%s: %s" % (archive.tmp, exc.message)) from None
    except OSError as exc:
        raise BadRequest("cannot read the file (%s)"
                         % (exc.strerror or type(exc).__name__)) from None
    # The file's modification time stands for when the export was made: an old export
    # must not take the place of newer pushed values at a tie (the later journal
    # position wins).  Never later than now.
    exported_at = min(_dt.datetime.fromtimestamp(stat.st_mtime, _dt.timezone.utc), utc_now())
    try:
        _refuse_undecidable_layer(conn, upload.tmp_path, headers, name, exported_at)
    except BaseException:
        upload.discard()
        raise
    return accept_delivery(archive, conn, upload, exported_at, headers, name,
                           {"imported_from": path.name,
                            "imported_at": format_received_at(utc_now())})


def run_export(config: Config, args: argparse.Namespace, out: Any = None) -> int:
    """``healthlog export``: the reply of ``/api/points`` for the same query on stdout, or
    with ``--format sqlite`` every stored point in a new SQLite file.  Only reads, so
    it runs beside ``serve``."""
    out = out or sys.stdout.buffer
    conn = open_database(config, create=False, synchronous="NORMAL")
    try:
        conn.execute("BEGIN")  # one snapshot of the store
        scratch = config.data_dir / TMP_DIR
        if args.format == "sqlite":
            chosen = [flag for flag, value in (
                ("--metric", args.metric), ("--layer", args.layer), ("--from", args.start),
                ("--to", args.end), ("--bucket", args.bucket), ("--tz", args.tz)) if value]
            if chosen:  # never a range quietly ignored: the file holds every point
                raise ConfigError("--format sqlite exports every point of every metric, in"
                                  " the local time each point was written in; %s go%s with"
                                  " --format csv or json" % (", ".join(chosen),
                                                             "" if len(chosen) > 1 else "es"))
            return _export_to_file(conn, args.output, scratch)
        if args.output:
            raise ConfigError("OUT.db goes with --format sqlite only")
        if args.format == "gpx":
            return _export_gpx(conn, args, scratch, out)
        if args.workout or args.out_dir:
            raise ConfigError("--workout and --out go with --format gpx")
        if not args.metric:  # the route's message names /api/catalog; here, the command
            raise ConfigError("--metric is required; `healthlog catalog` lists the metrics"
                              " there are (or --format sqlite OUT.db exports them all)")
        try:
            query = point_query(conn, {"metric": args.metric, "layer": args.layer,
                                       "from": args.start, "to": args.end,
                                       "bucket": args.bucket, "tz": args.tz,
                                       "format": args.format})
        except UnknownMetric:
            raise ConfigError("no data of that metric; `healthlog catalog` lists the metrics"
                              " there are") from None
        except HTTPFailure as exc:
            raise ConfigError(exc.message) from None
        for chunk in render_points(conn, query):
            out.write(chunk)
        out.flush()
        return 0
    finally:
        conn.close()


def run_catalog(config: Config, as_json: bool, out: Any = None) -> int:
    """``healthlog catalog``: what ``/api/catalog`` answers, as a table or as JSON (the
    metric names ``export --metric`` takes).  The table's first and last are local times
    as the phone wrote them (:func:`catalog_local`), to the minute with their offset: a
    day in Sydney is not shown as the UTC day before.  Only reads, in one snapshot."""
    out = out or sys.stdout
    conn = open_database(config, create=False, synchronous="NORMAL")
    try:
        conn.execute("BEGIN")  # the bounds and the points they name agree
        items = catalog(conn)
        local = [] if as_json else [catalog_local(conn, item) for item in items]
        conn.execute("COMMIT")
    finally:
        conn.close()
    if as_json:
        out.write(json.dumps({"metrics": items, "groups": groups_json()}, indent=1,
                             ensure_ascii=False) + "\n")
        return 0
    if not items:
        out.write("the store is empty: nothing has been folded yet\n")
        return 0

    def minute(text: Optional[str]) -> str:
        return "-" if text is None else text[:16] + text[19:]  # 2025-04-15T00:00-04:00

    rows = [("METRIC", "LAYER", "UNITS", "FIRST", "LAST", "POINTS", "WHAT")] + [
        (item["metric"], item["layer"], ",".join(item["units"]) or "-", minute(first),
         minute(last), "{:,}".format(item["points"]),
         "%s (%s)" % (item["meaning"]["name"], item["meaning"]["kind"]))
        for item, (first, last) in zip(items, local)]
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]) - 1)]
    for row in rows:
        line = "  ".join(cell.ljust(width) if i != 5 else cell.rjust(width)
                         for i, (cell, width) in enumerate(zip(row, widths)))
        out.write((line + "  " + row[-1]).translate(_ESCAPES) + "\n")
    return 0


def _export_gpx(conn: sqlite3.Connection, args: argparse.Namespace, scratch: Path,
                out: Any) -> int:
    """``export --format gpx``: one workout's GPX (``--workout ID``) on standard output or
    into ``--out DIR``; or, with ``--out DIR``, one file per workout with a route whose start
    is in ``--from``/``--to`` (a workout recorded twice: the one shown first), named by its
    local date, time and activity (:func:`gpx_file_name`).  No file is overwritten: when
    one of the names exists, nothing is written."""
    try:
        if args.workout:
            chosen = [find_workout(conn, args.workout, scratch)]
            skipped = ""
        else:
            if not args.out_dir:
                raise ConfigError("--format gpx writes one file per workout into a folder:"
                                  " give --out DIR (or --workout ID for one on standard"
                                  " output)")
            items = list_workouts(conn, {"from": args.start, "to": args.end, "tz": args.tz},
                                  scratch, limit=None)["workouts"]
            shown = [item for item in items if item["duplicate_of"] is None]
            chosen = [find_workout(conn, item["id"], scratch) for item in reversed(shown)
                      if item["has_route"]]
            skipped = "%d without a route, %d recorded twice" % (
                len(shown) - len(chosen), len(items) - len(shown))
        if args.workout and not args.out_dir:
            for piece in gpx_pieces(chosen[0]):
                out.write(piece)
            out.flush()
            return 0
    except (UnknownWorkout, NoRoute) as exc:
        raise ConfigError(exc.message.replace("/api/workouts lists them",
                                              "the page's workouts list names them")) from None
    except HTTPFailure as exc:
        raise ConfigError(exc.message) from None
    folder = Path(args.out_dir)
    names: list = []
    for workout in chosen:
        name = gpx_file_name(workout_listing(workout, LOCAL_ZONE))
        stem, number = name[:-4], 2
        while name in names:
            name, number = "%s-%d.gpx" % (stem, number), number + 1
        names.append(name)
    taken = [name for name in names if (folder / name).exists()]
    if taken:
        raise ConfigError("%s exists; export writes new files only" % (folder / taken[0]))
    folder.mkdir(parents=True, exist_ok=True)
    for workout, name in zip(chosen, names):
        _write_new(folder / name, gpx_pieces(workout))
        sys.stdout.write("wrote %s\n" % (folder / name))
    if not args.workout:
        sys.stdout.write("%d GPX files in %s (left out: %s)\n" % (len(names), folder, skipped))
    return 0


def _write_new(path: Path, pieces: Iterator[bytes]) -> None:
    """A new file of ``pieces``; a partial one is removed if writing fails."""
    with open(str(path), "xb") as handle:
        try:
            for piece in pieces:
                handle.write(piece)
        except BaseException:
            handle.close()
            path.unlink()
            raise


def _export_to_file(conn: sqlite3.Connection, output: Optional[str],
                    scratch: Optional[Path] = None) -> int:
    if not output:
        raise ConfigError("--format sqlite needs the file to create: healthlog export"
                          " --format sqlite OUT.db")
    target = Path(output)
    if target.exists():
        raise ConfigError("%s exists; export writes a new file" % target)
    try:
        count = export_sqlite(conn, target, scratch)
    except BaseException:
        with contextlib.suppress(OSError):
            target.unlink()  # never leave half an export behind
        raise
    sys.stderr.write("healthlog: exported %d points to %s\n" % (count, target))
    return 0


# ==============================================================================
# Status: what the journal and the vitrine hold, readable while serve runs.
# ==============================================================================

STATUS_PROBLEMS_MAX = 10
"""How many of the latest failed and partial deliveries ``status`` lists."""


def collect_status(config: Config) -> dict:
    conn = open_database(config, create=False, synchronous="NORMAL")
    try:
        conn.execute("BEGIN")  # one snapshot: the counts and the fingerprint agree
        counts, oldest, age, objects, points = store_figures(conn)
        last = conn.execute("SELECT max(received_at) FROM delivery").fetchone()[0]
        problems = _recent_problems(conn)
        failed = failed_by_error(conn)
        retrying = [{"id": row_id, "received_at": journal_time(received), "attempts": attempts,
                     "fault": (error or "").partition(":")[2] or None}
                    for row_id, received, attempts, error in conn.execute(
            "SELECT id, received_at, attempts, error FROM delivery WHERE parse_status ="
            " 'pending' AND (attempts > 0 OR error LIKE 'retrying:%') ORDER BY received_at, id"
            " LIMIT ?", (STATUS_PROBLEMS_MAX,))]
        older = count_folded_by_older_parser(conn)
        fp = fingerprint(conn)
        fresh = freshness_of(conn, config.data_dir, config.clock(), config.late_after_s)
        conn.execute("COMMIT")
    finally:
        conn.close()
    bodies = archive_bodies(config.data_dir)
    archive_files, archive_bytes = len(bodies), 0
    for relative in bodies:
        with contextlib.suppress(OSError):
            archive_bytes += (config.data_dir / relative).stat().st_size
    db_bytes = sum(p.stat().st_size for p in config.data_dir.glob(DB_NAME + "*") if p.is_file())
    oldest_age = None if age is None else round(age, 1)
    return {
        "data": str(config.data_dir),
        "all_folded": counts["pending"] == 0,
        "folded": fold_line(counts, age),
        "deliveries": counts,
        "backlog": counts["pending"],
        "oldest_pending": journal_time(oldest),
        "oldest_pending_age_s": oldest_age,
        "last_delivery": journal_time(last),
        "objects": objects,
        "points": points,
        "archive_files": archive_files,
        "archive_bytes": archive_bytes,
        "archive_missing": sum(counts.values()) > 0 and archive_absent(config.data_dir),
        "database_bytes": db_bytes,
        "folded_by_older_parser": older,
        "failed_by_error": failed,
        "failed_worth_retrying": sum(n for error, n in failed.items() if worth_retrying(error)),
        "retrying": retrying,
        "recent_problems": problems,
        "late_after_s": config.late_after_s,
        "freshness": fresh.as_json(),
        "attention": [notice.as_json() for notice in attention(fresh)],
        "fingerprint": fp,
    }


def fold_line(counts: dict, oldest_age_s: Optional[float]) -> str:
    """Whether everything received is folded, in one line: ``all 1,234 deliveries folded``
    or ``12 deliveries waiting to be folded (oldest 3m05s)``.  A failed delivery is folded
    (it waits for nothing; the line says how many failed)."""
    total, waiting = sum(counts.values()), counts.get("pending", 0)
    if not total:
        return "nothing received yet"
    if waiting:
        return "{:,} {} waiting to be folded (oldest {})".format(
            waiting, "delivery" if waiting == 1 else "deliveries",
            _duration(max(0.0, oldest_age_s or 0.0)))
    failed = counts.get("failed", 0)
    if total == 1:
        return "the only delivery is folded" + (" (it failed)" if failed else "")
    return "all {:,} deliveries folded".format(total) + (
        ", {:,} of them failed".format(failed) if failed else "")


def _recent_problems(conn: sqlite3.Connection) -> list:
    """The latest failed and partial deliveries: what went wrong, never values."""
    rows = conn.execute(
        "SELECT id, received_at, coalesce(automation_name, automation_id, path_name),"
        " parse_status, error, uncovered_keys FROM delivery"
        " WHERE parse_status IN ('failed', 'partial')"
        " ORDER BY received_at DESC, id DESC LIMIT ?", (STATUS_PROBLEMS_MAX,)).fetchall()
    return [{"id": row_id, "received_at": journal_time(received), "automation": automation,
             "status": status, "error": error, "uncovered_keys": json.loads(keys or "[]")}
            for row_id, received, automation, status, error, keys in rows]


def _size(count: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if count < 1024 or unit == "GiB":
            return ("%d %s" % (count, unit)) if unit == "B" else ("%.1f %s" % (count, unit))
        count /= 1024.0
    return str(count)


def format_status(status: dict) -> str:
    counts = status["deliveries"]
    age = status["oldest_pending_age_s"]
    lines = [
        "data: %s" % status["data"],
        status["folded"],
        "deliveries: %d (%s)" % (sum(counts.values()),
                                 ", ".join("%s %d" % item for item in counts.items())),
        "backlog: %d%s" % (status["backlog"],
                           "" if age is None else " (oldest pending %s ago)" % _duration(age)),
        "last delivery: %s" % (status["last_delivery"] or "none"),
        "objects: %d" % status["objects"],
        "points: %d" % status["points"],
        ("archive: missing or empty while the journal lists deliveries; is its disk mounted?"
         if status["archive_missing"] else
         "archive: %d bodies, %s" % (status["archive_files"], _size(status["archive_bytes"]))),
        "database: %s" % _size(status["database_bytes"]),
    ]
    if status["failed_by_error"]:
        lines.append("failed: %s" % ", ".join("%s %d" % (error or "-", n) for error, n
                                              in status["failed_by_error"].items()))
    if status["failed_worth_retrying"]:
        lines.append("  %s failed for a reason of the machine, not of the body; `healthlog"
                     " refold --failed` folds them again"
                     % _plural(status["failed_worth_retrying"], "delivery", "deliveries"))
    for item in status["retrying"]:
        lines.append("retrying: delivery %d (received %s), %s so far%s" % (
            item["id"], item["received_at"], _plural(item["attempts"], "attempt", "attempts"),
            ", last fault: %s" % item["fault"] if item["fault"] else ""))
    if status["folded_by_older_parser"]:
        lines.append("folded by an older version: %d deliveries (run `healthlog reindex` to"
                     " rebuild the store by this version's rules)"
                     % status["folded_by_older_parser"])
    if status["recent_problems"]:
        lines.append("latest failed or partial deliveries:")
        for problem in status["recent_problems"]:
            detail = problem["error"] or ""
            if problem["uncovered_keys"]:
                detail = (detail + " " if detail else "") + "uncovered: " + ", ".join(
                    problem["uncovered_keys"])
            lines.append("  %d  %s  %s  %s  %s" % (
                problem["id"], problem["received_at"], problem["automation"] or "-",
                problem["status"], detail or "-"))
            lines[-1] = lines[-1].translate(_ESCAPES)  # names from a body or a header
    automations = status["freshness"]["automations"]
    if automations:
        lines.append("automations: %s" % ", ".join(
            "%s %s" % (item["name"] or item["id"], item["state"].replace("_", " "))
            for item in automations).translate(_ESCAPES))
    for notice in status["attention"]:
        lines.append(("%s: %s" % (notice["state"], notice["text"])).translate(_ESCAPES))
        lines.append(("  %s" % notice["action"]).translate(_ESCAPES))
    lines.append("fingerprint: %s" % status["fingerprint"])
    return "\n".join(lines)


# ==============================================================================
# CLI: subcommands, one-line errors, exit codes 0 / 1 / 2.
# ==============================================================================


class _Parser(argparse.ArgumentParser):
    """argparse with a one-line error (exit 2) instead of the usage block."""

    def error(self, message: str) -> None:  # type: ignore[override]
        sys.stderr.write("%s: error: %s (see --help)\n" % (self.prog, message))
        raise SystemExit(2)


def _jobs(text: str) -> int:
    if not re.fullmatch(r"[0-9]{1,4}", text) or not 1 <= int(text) <= 1024:
        raise argparse.ArgumentTypeError("must be a whole number from 1 to 1024")
    return int(text)


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
    serve.add_argument("--trusted-proxy", metavar="ADDR[,ADDR...]",
                       help="reverse proxies (addresses or networks) whose X-Forwarded-For or"
                            " Forwarded header names the client (env HEALTHLOG_TRUSTED_PROXY;"
                            " default: none, the headers are ignored)")
    late_after_help = ("silence after which an automation is late and a metric stale, unless"
                       " three of its usual intervals are longer: 90s, 45m, 6h, 2d (env"
                       " HEALTHLOG_LATE_AFTER; default 6h)")
    serve.add_argument("--late-after", metavar="DURATION", help=late_after_help)
    serve.add_argument("--missing-body-wait", metavar="DURATION",
                       help="how long an archived body may be absent from its readable day"
                            " folder before its delivery is failed (a missing archive or day"
                            " folder never fails anything): 90s, 45m, 6h, 2d (env"
                            " HEALTHLOG_MISSING_BODY_WAIT; default 1h)")
    serve.add_argument("--notify", metavar="URL",
                       help="post a notice there when an automation turns late or a metric"
                            " stale, and when it is back (env HEALTHLOG_NOTIFY; default: no"
                            " notices); ntfy, a Home Assistant webhook, …")
    serve.add_argument("--notify-format", choices=("text", "json"),
                       help="text: a plain-text body with a Title header, as ntfy takes it"
                            " (default); json: one JSON object")
    serve.add_argument("--map-tiles", metavar="URL-TEMPLATE",
                       help="draw workout routes over map tiles from this server, such as"
                            " https://tile.openstreetmap.org/{z}/{x}/{y}.png; only its host"
                            " is added to the page's Content-Security-Policy (env"
                            " HEALTHLOG_MAP_TILES; default: no tiles, nothing leaves the"
                            " server)")
    serve.add_argument("--max-heart-rate", metavar="BPM",
                       help="your maximum heart rate, for heart-rate zones (env"
                            " HEALTHLOG_MAX_HEART_RATE; default: the highest stored in the"
                            " year before each workout)")
    serve.add_argument("--distance-units", metavar="km|mi",
                       help="splits, pace and speed per km or per mile (env"
                            " HEALTHLOG_DISTANCE_UNITS; default: the units each workout's"
                            " distance was sent in)")

    status = commands.add_parser("status", help="what the journal and the store hold, and what is"
                                 " late or stale")
    data_option(status)
    status.add_argument("--json", action="store_true", help="print JSON")
    status.add_argument("--late-after", metavar="DURATION", help=late_after_help)

    reindex = commands.add_parser("reindex", help="rebuild the store from the archive"
                                  " (serve must be stopped)")
    data_option(reindex)
    reindex.add_argument("--force", action="store_true",
                         help="swap the rebuild in even if folded deliveries would end failed")
    verify = commands.add_parser("verify", help="rebuild into a scratch copy and compare;"
                                 " exit 1 on a difference")
    data_option(verify)
    for command in (reindex, verify):
        command.add_argument("--jobs", type=_jobs, default=None, metavar="N",
                             help="worker processes that parse and merge (default: the"
                                  " cores this process may use, here %d)" % usable_cores())

    importer = commands.add_parser("import", help="add HAE JSON files exported by hand")
    data_option(importer)
    importer.add_argument("files", nargs="+", metavar="FILE", help="HAE JSON export files")
    importer.add_argument("--aggregation", metavar="GROUPING",
                          help="the export's time grouping (Minutes, Hours, Days, …):"
                               " the layer its metrics go to")
    importer.add_argument("--name", help="an automation name for these files (as in"
                                         " /api/ingest/<name>)")

    listing = commands.add_parser("catalog", help="what the store holds: each metric and"
                                  " layer with its units, first and last point (local time"
                                  " as the phone wrote it), and points")
    data_option(listing)
    listing.add_argument("--json", action="store_true", help="print JSON, as /api/catalog")

    refold = commands.add_parser("refold", help="set failed deliveries back to pending, to"
                                 " be folded again (beside serve or without it)")
    data_option(refold)
    refold.add_argument("ids", nargs="*", type=int, metavar="ID", help="delivery ids")
    refold.add_argument("--failed", action="store_true", help="every failed delivery")

    mcp = commands.add_parser("mcp", help="the read-only MCP server for an AI assistant,"
                              " over stdin and stdout (beside serve or without it)")
    data_option(mcp)
    mcp.add_argument("--late-after", metavar="DURATION", help=late_after_help)

    export = commands.add_parser("export", help="points of one metric as CSV or JSON on"
                                 " stdout, or every point into a new SQLite file")
    data_option(export)
    export.add_argument("output", nargs="?", metavar="OUT.db",
                        help="the SQLite file to create (with --format sqlite)")
    export.add_argument("--metric", help="the metric, as `healthlog catalog` names it")
    export.add_argument("--layer", help="its layer (default: the one that answers the range"
                        " best, as /api/points chooses)")
    export.add_argument("--from", dest="start", metavar="TIME",
                        help="first point start (ISO-8601, YYYY-MM-DD or epoch; a date"
                             " starts at its local midnight)")
    export.add_argument("--to", dest="end", metavar="TIME",
                        help="end of the range: a date alone (YYYY-MM-DD) includes that"
                             " local day; a time is exclusive")
    export.add_argument("--bucket", choices=tuple(BUCKETS), help="aggregate per bucket")
    export.add_argument("--tz", metavar="ZONE",
                        help="local time of days and hours: local (default: as the phone wrote"
                             " each point), a time zone such as Europe/Berlin, or an offset")
    export.add_argument("--format", choices=("csv", "json", "sqlite", "gpx"), default="json",
                        help="json (default), csv, sqlite (every metric, into OUT.db), or gpx"
                             " (workouts' routes: --workout ID, or --from/--to with --out"
                             " DIR)")
    export.add_argument("--workout", metavar="ID",
                        help="with --format gpx: the workout, by the id its page and"
                             " /api/workouts give")
    export.add_argument("--out", dest="out_dir", metavar="DIR",
                        help="with --format gpx: the folder to write one .gpx per workout"
                             " into, named by local date, time and activity")
    return parser


def _offset_values(argv: Sequence[str]) -> list:
    """``--tz -05:00`` as ``--tz=-05:00``: argparse takes a value that begins with ``-`` for
    an option, and a zone west of UTC is written so."""
    out: list = []
    for arg in argv:
        if out and out[-1] == "--tz" and re.fullmatch(r"-[0-9]{2}:?[0-9]{2}", arg):
            out[-1] = "--tz=" + arg
        else:
            out.append(arg)
    return out


CLOSED_PIPE_EXIT = 128 + signal.SIGPIPE
"""The exit code of a command whose reader closed standard output (``| head``): what a
shell reports for a Unix tool that SIGPIPE ended."""


def _stdout_to_devnull() -> None:
    """Standard output's reader has gone: what is still buffered, and Python's own flush at
    exit, go nowhere instead of raising (or printing "Exception ignored")."""
    with contextlib.suppress(OSError, ValueError):
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)


class _Report:
    """Standard output for a command that does work (reindex, verify, import, refold): a
    closed pipe drops the rest of its report and never stops the work; the command ends
    with its own exit code."""

    def write(self, text: str) -> None:
        try:
            sys.stdout.write(text)
            sys.stdout.flush()
        except BrokenPipeError:
            _stdout_to_devnull()

    def flush(self) -> None:
        self.write("")


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point: ``healthlog COMMAND [options]``; returns the exit code.  A reader that
    closes standard output before the end (``export … | head -1``, ``catalog | head``) ends
    a command that only prints (export, catalog, status, ``--help``, ``--version``) quietly,
    as Unix tools end: no message, exit :data:`CLOSED_PIPE_EXIT`; a command that does work
    finishes it (:class:`_Report`)."""
    try:
        try:
            code = _run_command(argv)
        except SystemExit as stop:  # argparse's --help, --version and usage errors
            code = stop.code if isinstance(stop.code, int) else 0 if stop.code is None else 1
        sys.stdout.flush()  # here, where a closed pipe is caught, not at the interpreter's exit
        return code
    except BrokenPipeError:
        _stdout_to_devnull()
        return CLOSED_PIPE_EXIT


def _run_command(argv: Optional[Sequence[str]]) -> int:
    args = build_parser().parse_args(_offset_values(sys.argv[1:] if argv is None else argv))
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
        if args.command == "reindex":
            return run_reindex(config, _Report(), force=args.force,
                               jobs=args.jobs or usable_cores())
        if args.command == "verify":
            return run_verify(config, _Report(), jobs=args.jobs or usable_cores())
        if args.command == "import":
            return run_import(config, args.files, args.aggregation, args.name, _Report())
        if args.command == "refold":
            return run_refold(config, args.ids, args.failed, _Report())
        if args.command == "catalog":
            return run_catalog(config, args.json)
        if args.command == "export":
            return run_export(config, args)
        if args.command == "mcp":
            return run_mcp(config)
    except ConfigError as exc:
        sys.stderr.write("healthlog: %s\n" % exc.message)
        return 2
    except HealthlogError as exc:
        sys.stderr.write("healthlog: %s\n" % exc.message)
        return 1
    except BrokenPipeError:
        raise  # the reader has gone: no error of ours (see main)
    except (OSError, sqlite3.Error) as exc:  # the environment: one line, no traceback
        detail = getattr(exc, "strerror", None) or str(exc)
        where = getattr(exc, "filename", None)
        sys.stderr.write("healthlog: %s%s (%s)\n" % (
            detail, ": %s" % where if where else "", type(exc).__name__))
        return 2
    except KeyboardInterrupt:
        return 130
    return 2


# ==============================================================================
# The dashboard page: hand-written HTML, CSS and script, served from the .pyz itself.
# ==============================================================================
# Data, not code: kept last so that the program above reads without it.  No third-party
# script, nothing fetched at run time; the CSP allows only these two files.

LOGIN_HTML = r"""<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<meta name="color-scheme" content="light dark">
<meta name="robots" content="noindex">
<title>Sign in · healthlog</title>
<link rel="icon" href="data:,">
<link rel="stylesheet" href="/static/app.css">
<script src="/static/app.js" defer></script>
</head>
<body class="login">
<main class="signin">
  <h1>healthlog</h1>
  <form id="login" method="post" action="/login">
    <label for="token">Access token</label>
    <input type="password" id="token" name="token" required autofocus
           autocomplete="current-password" autocapitalize="off" spellcheck="false">
    <div class="notice" role="alert">{message}</div>
    <button type="submit">Sign in</button>
  </form>
  <p class="hint">Use the token Health Auto Export sends: the file <code>token</code> in the
    data directory, or <code>HEALTHLOG_TOKEN</code>.</p>
</main>
</body>
</html>
"""
"""The sign-in page; ``{message}`` is replaced by a failed sign-in's notice."""

DASHBOARD_HTML = r"""<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<meta name="color-scheme" content="light dark">
<meta name="robots" content="noindex">
<title>healthlog</title>
<link rel="icon" href="data:,">
<link rel="stylesheet" href="/static/app.css">
<script src="/static/app.js" defer></script>
</head>
<body>
<header class="top">
  <h1>healthlog</h1>
  <nav class="views" aria-label="Views">
    <a id="nav-summary" class="view-link" href="#view=summary">Summary</a>
    <a id="nav-metrics" class="view-link" href="#view=metric">Metrics</a>
  </nav>
  <form class="signout" method="post" action="/logout">
    <button id="signout" type="submit">Sign out</button>
    <button id="signout-everywhere" type="submit" formaction="/logout?everywhere=1"
            title="End the sessions of every signed-in browser">Sign out everywhere</button>
  </form>
</header>
<main>
  <noscript><p class="message">This page needs JavaScript.</p></noscript>
  <p id="message" class="message" role="alert" hidden></p>

  <section id="summary" class="panel summary" aria-labelledby="summary-title" data-state="idle"
           hidden>
    <div id="attention" class="attention" role="status" hidden></div>
    <div class="day-head">
      <button id="day-prev" class="day-step" type="button" aria-label="Previous day"
              title="The day before">&#8249;</button>
      <div class="day-title">
        <h2 id="summary-title">Summary</h2>
        <p id="summary-meta" class="meta"></p>
      </div>
      <button id="day-next" class="day-step" type="button" aria-label="Next day"
              title="The day after">&#8250;</button>
      <a id="day-latest" class="button" href="#view=summary" hidden>Latest</a>
    </div>
    <p id="usual-rule" class="meta"></p>
    <div id="cards" class="cards"></div>
    <section class="trends-box" aria-labelledby="trends-title">
      <h2 id="trends-title">Trends</h2>
      <p id="trend-rule" class="meta"></p>
      <ol id="trends" class="trends"></ol>
    </section>
    <section class="coverage-box" aria-labelledby="coverage-title">
      <h2 id="coverage-title">What arrived</h2>
      <p id="coverage-rule" class="meta"></p>
      <div id="coverage" class="coverage" data-state="idle"></div>
      <ul id="coverage-legend" class="coverage-legend"></ul>
      <ul id="coverage-gaps" class="coverage-gaps"></ul>
    </section>
  </section>

  <section id="metric-view" class="panel" aria-labelledby="view-title" hidden>
    <div class="controls">
      <label class="field metric-field">
        <span>Metric</span>
        <select id="catalog" disabled><option>Loading…</option></select>
      </label>
      <label class="field" id="layer-field" hidden>
        <span>Layer</span>
        <select id="layer"></select>
      </label>
      <div class="field">
        <span id="range-label">Range</span>
        <div id="range" class="range" role="group" aria-labelledby="range-label">
          <button type="button" data-range="24h">24 h</button>
          <button type="button" data-range="7d">7 d</button>
          <button type="button" data-range="30d">30 d</button>
          <button type="button" data-range="1y">1 y</button>
          <button type="button" data-range="all">All</button>
          <button type="button" data-range="custom">Custom</button>
        </div>
      </div>
      <label class="field">
        <span>Time zone</span>
        <select id="zone"></select>
      </label>
      <div id="custom" class="custom" hidden>
        <label class="field"><span>From</span><input type="date" id="from"></label>
        <label class="field"><span>To</span><input type="date" id="to"></label>
      </div>
    </div>
    <h2 id="view-title">Chart</h2>
    <p id="view-meta" class="meta"></p>
    <div id="chart" class="chart" data-state="idle"></div>
    <p id="readout" class="readout" aria-live="polite"></p>
    <div id="records" class="records"></div>
    <p class="actions">
      <button id="records-more" type="button" hidden>More</button>
      <a id="csv" class="button">Download CSV</a>
    </p>
  </section>

  <section id="workout-view" class="panel workout-view" aria-labelledby="workout-title"
           data-state="idle" hidden>
    <p class="back"><a id="workout-back" href="#view=metric">&#8249; Workouts</a></p>
    <h2 id="workout-title">Workout</h2>
    <p id="workout-meta" class="meta"></p>
    <ul id="workout-notes" class="workout-notes"></ul>
    <dl id="workout-figures" class="workout-figures"></dl>
    <section id="part-route" class="workout-part" aria-labelledby="route-title" hidden>
      <div class="panel-head">
        <h3 id="route-title">Route</h3>
        <a id="workout-gpx" class="button" download hidden>Download GPX</a>
      </div>
      <div id="workout-map" class="workout-map"></div>
      <p id="route-legend" class="legend route-legend"></p>
    </section>
    <section id="part-heart" class="workout-part" aria-labelledby="heart-title" hidden>
      <h3 id="heart-title">Heart rate</h3>
      <div id="workout-heart" class="workout-chart"></div>
      <p id="zone-rule" class="meta"></p>
      <table id="workout-zones" class="list zones"></table>
    </section>
    <section id="part-splits" class="workout-part" aria-labelledby="splits-title" hidden>
      <h3 id="splits-title">Splits</h3>
      <table id="workout-splits" class="list splits"></table>
    </section>
    <section id="part-elevation" class="workout-part" aria-labelledby="elevation-title" hidden>
      <h3 id="elevation-title">Elevation</h3>
      <div id="workout-elevation" class="workout-chart"></div>
    </section>
  </section>

  <section id="journal-panel" class="panel" aria-labelledby="journal-title" hidden>
    <div class="panel-head">
      <h2 id="journal-title">Deliveries</h2>
      <button id="refresh" type="button">Refresh</button>
    </div>
    <p id="health" class="meta"></p>
    <div id="journal"></div>
    <p class="actions"><button id="journal-more" type="button" hidden>More deliveries</button></p>
  </section>
</main>
</body>
</html>
"""

APP_CSS = r"""/* healthlog: one small stylesheet, system fonts, light and dark. */

:root {
  color-scheme: light dark;
  --bg: #f5f6f8;
  --panel: #ffffff;
  --text: #1d2330;
  --muted: #5d6675;
  --line: #dde1e7;
  --grid: #e8ebef;
  --grid-major: #c9ced6;
  --accent: #0a66d8;
  --accent-text: #ffffff;
  --danger: #b3261e;
  --ok: #1e7b34;
  --warn: #9a6700;
  --c0: #0a66d8;
  --c1: #d9480f;
  --c2: #2b8a3e;
  --c3: #ae3ec9;
  --c4: #0c8599;
  --c5: #5f3dc4;
  --band: rgba(217, 72, 15, 0.18);
  --bar: #0c8599;
  --deep: #3b2f9e;
  --core: #5b7be8;
  --rem: #2bb3c0;
  --awake: #f08c3a;
  --asleep: #5f9a4e;
  --other: #a0a7b4;
  --inbed: #c5cbe0;
}

@media (prefers-color-scheme: dark) {
  :root {
    --bg: #111418;
    --panel: #1b1f26;
    --text: #e6e9ee;
    --muted: #9aa3b1;
    --line: #2d333d;
    --grid: #262b33;
    --grid-major: #3b424d;
    --accent: #5aa2ff;
    --accent-text: #0b1220;
    --danger: #ff8a80;
    --ok: #6fd08c;
    --warn: #e3b341;
    --c0: #5aa2ff;
    --c1: #ff8c5a;
    --c2: #6fd08c;
    --c3: #d68cf0;
    --c4: #4fd1e0;
    --c5: #a48bff;
    --band: rgba(255, 140, 90, 0.22);
    --bar: #4fd1e0;
    --deep: #7d6cf0;
    --core: #5b8cff;
    --rem: #45d0dc;
    --awake: #f5a25d;
    --asleep: #86c06c;
    --inbed: #39415a;
  }
}

* { box-sizing: border-box; }

[hidden] { display: none !important; }

html { -webkit-text-size-adjust: 100%; text-size-adjust: 100%; }

body {
  margin: 0;
  background: var(--bg);
  color: var(--text);
  font: 15px/1.45 system-ui, -apple-system, "Segoe UI", Roboto, "Helvetica Neue", Arial, sans-serif;
}

h1, h2 { margin: 0; line-height: 1.2; }
h1 { font-size: 1.25rem; }
h2 { font-size: 1.1rem; }
code { font-family: ui-monospace, SFMono-Regular, Menlo, Consolas, monospace; font-size: 0.9em; }
a { color: var(--accent); }

button, .button, select, input {
  font: inherit;
  color: inherit;
  border: 1px solid var(--line);
  border-radius: 8px;
  background: var(--panel);
  padding: 0.4rem 0.7rem;
  min-height: 2.3rem;
}

button, .button { cursor: pointer; text-decoration: none; display: inline-block; }
button:hover, .button:hover { border-color: var(--accent); }
button:focus-visible, .button:focus-visible, select:focus-visible, input:focus-visible {
  outline: 2px solid var(--accent);
  outline-offset: 1px;
}
button.link {
  border: 0;
  padding: 0;
  min-height: 0;
  background: none;
  color: var(--accent);
  text-decoration: underline;
}

/* ---- header ---------------------------------------------------------------- */

.top {
  display: flex;
  align-items: center;
  justify-content: space-between;
  gap: 1rem;
  padding: 0.6rem 1rem;
  background: var(--panel);
  border-bottom: 1px solid var(--line);
}
.signout { margin: 0; }

main {
  max-width: 1100px;
  margin: 0 auto;
  padding: 0.75rem;
}

.panel {
  background: var(--panel);
  border: 1px solid var(--line);
  border-radius: 12px;
  padding: 0.9rem;
  margin-bottom: 0.9rem;
}
.panel h2 { margin-bottom: 0.25rem; }
.panel-head { display: flex; align-items: center; justify-content: space-between; gap: 1rem; }

.meta, .readout { color: var(--muted); font-size: 0.88rem; margin: 0.2rem 0 0.5rem; }
.readout { min-height: 1.3em; font-variant-numeric: tabular-nums; }

.message {
  margin: 0 0 0.9rem;
  padding: 0.6rem 0.8rem;
  border-radius: 8px;
  border: 1px solid var(--danger);
  color: var(--danger);
}
.message:empty { display: none; }

/* ---- controls ------------------------------------------------------------- */

.controls {
  display: flex;
  flex-wrap: wrap;
  align-items: flex-end;
  gap: 0.6rem 1rem;
  margin-bottom: 0.8rem;
}
.field {
  display: flex; flex-direction: column; gap: 0.2rem; font-size: 0.85rem;
  color: var(--muted);
}
.field select, .field input { color: var(--text); font-size: 1rem; }
#catalog { min-width: 14rem; max-width: 100%; }
#zone, #layer { max-width: 100%; }
.field { min-width: 0; max-width: 100%; }

.range { display: flex; flex-wrap: wrap; }
.range button { border-radius: 0; margin-left: -1px; min-width: 3.2rem; }
.range button:first-child { border-radius: 8px 0 0 8px; margin-left: 0; }
.range button:last-child { border-radius: 0 8px 8px 0; }
.range button.active {
  background: var(--accent);
  border-color: var(--accent);
  color: var(--accent-text);
  position: relative;
}
.custom { display: flex; gap: 0.6rem; flex-wrap: wrap; }

/* ---- chart ---------------------------------------------------------------- */

.chart { min-height: 220px; position: relative; }
.chart[data-state="loading"] { opacity: 0.55; }
.chart svg { display: block; width: 100%; height: auto; overflow: visible; touch-action: pan-y; }
.chart-panel + .chart-panel { margin-top: 0.8rem; }
.chart-head {
  display: flex;
  flex-wrap: wrap;
  align-items: baseline;
  gap: 0.3rem 0.8rem;
  font-size: 0.85rem;
  margin-bottom: 0.2rem;
}
.units { font-weight: 600; }
.note { color: var(--warn); }
.legend { display: flex; flex-wrap: wrap; gap: 0.2rem 0.8rem; color: var(--muted); }
.legend-item { display: inline-flex; align-items: center; gap: 0.3rem; }
.swatch { width: 0.9rem; height: 0.6rem; border-radius: 2px; display: inline-block; }
.swatch.s0 { background: var(--c0); }
.swatch.s1 { background: var(--c1); }
.swatch.s2 { background: var(--c2); }
.swatch.s3 { background: var(--c3); }
.swatch.s4 { background: var(--c4); }
.swatch.s5 { background: var(--c5); }
.swatch.band-swatch { background: var(--band); border: 1px solid var(--c1); }
.swatch.bar-swatch { background: var(--bar); }
.swatch.inbed-swatch { background: var(--inbed); }
.swatch.stage-deep { background: var(--deep); }
.swatch.stage-core { background: var(--core); }
.swatch.stage-rem { background: var(--rem); }
.swatch.stage-awake { background: var(--awake); }
.swatch.stage-asleep { background: var(--asleep); }
.swatch.stage-other { background: var(--other); }

.grid line { stroke: var(--grid); stroke-width: 1; }
.grid line.major { stroke: var(--grid-major); }
.grid text { fill: var(--muted); font-size: 11px; font-variant-numeric: tabular-nums; }
.grid .ylabel { text-anchor: end; }
.grid .xlabel { text-anchor: middle; }

.series {
  fill: none;
  stroke-width: 2;
  stroke-linejoin: round;
  stroke-linecap: round;
  vector-effect: non-scaling-stroke;
}
.series.s0 { stroke: var(--c0); }
.series.s1 { stroke: var(--c1); }
.series.s2 { stroke: var(--c2); }
.series.s3 { stroke: var(--c3); }
.series.s4 { stroke: var(--c4); }
.series.s5 { stroke: var(--c5); }
.band { fill: var(--band); stroke: none; }
.bar { fill: var(--bar); }
.bar.s1 { fill: var(--c1); }
.bar.s2 { fill: var(--c2); }
.bar.s3 { fill: var(--c3); }
.bar.s4 { fill: var(--c4); }
.bar.s5 { fill: var(--c5); }
.pt { stroke: var(--panel); stroke-width: 1; }
.pt.s0 { fill: var(--c0); }
.pt.s1 { fill: var(--c1); }
.pt.s2 { fill: var(--c2); }
.pt.s3 { fill: var(--c3); }
.pt.s4 { fill: var(--c4); }
.pt.s5 { fill: var(--c5); }
.bucket { outline: none; }
.bucket.on .bar, .bucket:focus .bar, .bucket.on .stage, .bucket:focus .stage { opacity: 0.75; }
.bucket.on .pt, .bucket:focus .pt { stroke: var(--text); stroke-width: 2; }
.trace {
  fill: none;
  stroke: var(--danger);
  stroke-width: 1.2;
  stroke-linejoin: round;
  vector-effect: non-scaling-stroke;
}
.ecg-trace { display: block; width: 100%; height: auto; }
.stage { stroke: none; }
.stage-deep { fill: var(--deep); }
.stage-core { fill: var(--core); }
.stage-rem { fill: var(--rem); }
.stage-awake { fill: var(--awake); }
.stage-asleep { fill: var(--asleep); }
.stage-other { fill: var(--other); }
.stage-inbed { fill: var(--inbed); }
.swatch.stage-inbed { background: var(--inbed); }
.cursor { stroke: var(--muted); stroke-width: 1; stroke-dasharray: 3 3; pointer-events: none; }
.hit { fill: transparent; cursor: crosshair; }
.chart-head .units + span { color: var(--muted); }

.empty { color: var(--muted); padding: 2rem 0; text-align: center; margin: 0; }
.empty p { margin: 0.3rem 0; }
.actions { margin: 0.4rem 0 0; }

/* ---- lists: workouts, ECG recordings, events ----------------------------- */

.records:empty { display: none; }
.record-list { list-style: none; margin: 0.6rem 0 0; padding: 0; display: grid; gap: 0.5rem;
  grid-template-columns: repeat(auto-fill, minmax(16rem, 1fr)); }
.record {
  border: 1px solid var(--line);
  border-radius: 10px;
  padding: 0.55rem 0.7rem;
  min-width: 0;
  overflow-wrap: anywhere;
}
.record.active { border-color: var(--accent); box-shadow: 0 0 0 1px var(--accent); }
.rec-head { display: flex; flex-wrap: wrap; justify-content: space-between; gap: 0.2rem 0.8rem; }
.rec-name { font-weight: 600; }
.rec-when, .rec-time { color: var(--muted); font-variant-numeric: tabular-nums; }
.rec-fields { display: flex; flex-wrap: wrap; gap: 0.2rem 1rem; margin: 0.35rem 0 0; }
.rec-field { display: flex; gap: 0.35rem; min-width: 0; }
.rec-field dt { color: var(--muted); }
.rec-field dd { margin: 0; font-variant-numeric: tabular-nums; }
.rec-pick {
  display: block; width: 100%; text-align: left; border: 0; padding: 0; min-height: 0;
  background: none;
}
a.rec-pick { color: inherit; text-decoration: none; }
a.rec-pick:hover .rec-name, a.rec-pick:focus-visible .rec-name { color: var(--accent);
  text-decoration: underline; }
.rec-also { margin: 0.3rem 0 0; font-size: 0.85rem; color: var(--muted); }
.item-also { color: var(--muted); font-size: 0.85rem; }
.timeline .day h3 { font-size: 0.95rem; margin: 0.9rem 0 0.2rem; }
.timeline .record-list { grid-template-columns: 1fr; margin-top: 0.3rem; }
.timeline .record { display: flex; gap: 0.8rem; align-items: baseline; }
.timeline .rec-fields { margin: 0; }

/* ---- tables --------------------------------------------------------------- */

#journal { overflow-x: auto; }
table.list { width: 100%; border-collapse: collapse; font-size: 0.88rem; }
.list th, .list td {
  text-align: left;
  padding: 0.35rem 0.5rem;
  border-bottom: 1px solid var(--line);
  white-space: nowrap;
  vertical-align: top;
}
.list th { color: var(--muted); font-weight: 600; white-space: normal; vertical-align: bottom; }
.list td.num { text-align: right; font-variant-numeric: tabular-nums; }
.list td.error { color: var(--danger); white-space: normal; min-width: 8rem; }
.status { font-weight: 600; }
.status-parsed { color: var(--ok); }
.status-partial, .status-pending { color: var(--warn); }
.status-failed { color: var(--danger); }
.list td.flag { color: var(--warn); font-weight: 600; }
.actions { display: flex; flex-wrap: wrap; gap: 0.5rem; }

/* ---- views ---------------------------------------------------------------- */

.top h1 { margin-right: auto; }
.views { display: flex; gap: 0.25rem; }
.view-link {
  padding: 0.35rem 0.75rem;
  border-radius: 8px;
  color: var(--text);
  text-decoration: none;
  border: 1px solid transparent;
}
.view-link:hover { border-color: var(--line); }
.view-link.active { background: var(--accent); color: var(--accent-text); }

/* ---- the summary page ------------------------------------------------------ */

.day-head { display: flex; align-items: center; gap: 0.6rem; flex-wrap: wrap; }
.day-title { flex: 1 1 12rem; min-width: 0; }
.day-title .meta { margin-bottom: 0; }
.day-step { font-size: 1.3rem; line-height: 1; min-width: 2.6rem; padding: 0.2rem 0.6rem; }
.day-step:disabled { opacity: 0.4; cursor: default; }
#summary[data-state="loading"] .cards { opacity: 0.55; }

.card-group { margin-top: 0.9rem; }
.card-group h3 {
  font-size: 0.82rem; margin: 0 0 0.35rem; color: var(--muted); font-weight: 600;
  text-transform: uppercase; letter-spacing: 0.04em;
}
.card-grid {
  display: grid; gap: 0.6rem; grid-template-columns: repeat(auto-fill, minmax(14rem, 1fr));
}
.card {
  display: flex; flex-direction: column; gap: 0.15rem; min-width: 0;
  border: 1px solid var(--line); border-radius: 10px; padding: 0.6rem 0.75rem;
  color: var(--text); text-decoration: none; background: var(--panel);
  overflow-wrap: anywhere;
}
a.card:hover, a.card:focus-visible { border-color: var(--accent); }
a.card:focus-visible { outline: 2px solid var(--accent); outline-offset: 1px; }
.card.wide { grid-column: 1 / -1; }
@media (min-width: 561px) {
  .sleep-card { grid-column: span 2; }
}
.card-name { font-weight: 600; font-size: 0.9rem; }
.card-value { font-size: 1.45rem; font-weight: 600; font-variant-numeric: tabular-nums;
  display: flex; flex-wrap: wrap; align-items: baseline; gap: 0 0.3rem; }
.card-value.no-data { color: var(--muted); font-weight: 400; font-size: 1.1rem; }
.card-units { font-size: 0.85rem; font-weight: 400; color: var(--muted); }
.card-value .sep { color: var(--muted); font-weight: 400; }
.card-usual { color: var(--muted); font-size: 0.85rem; font-variant-numeric: tabular-nums; }
.card-usual .num { color: var(--text); }
.card-facts, .stages { display: flex; flex-wrap: wrap; gap: 0.1rem 0.8rem; font-size: 0.85rem;
  color: var(--muted); font-variant-numeric: tabular-nums; }
.card-facts .num, .stages .num { color: var(--text); }
.card-note { margin: 0.2rem 0 0; font-size: 0.8rem; color: var(--muted); }
.card-note .num { color: var(--text); }
.stage-chip { display: inline-flex; align-items: center; gap: 0.3rem; }
.range-value { gap: 0.2rem 1.1rem; }
.range-figure { display: inline-flex; flex-direction: column; }
.range-label { font-size: 0.75rem; font-weight: 400; color: var(--muted); }

.spark {
  display: block; width: 100%; max-width: 18rem; height: auto; margin-top: 0.3rem;
  overflow: visible;
}
.spark-path {
  fill: none; stroke: var(--c0); stroke-width: 1.6; stroke-linejoin: round;
  stroke-linecap: round;
}
.spark-lines .spark-mark { fill: var(--c0); }
.spark-bars .spark-mark { fill: var(--bar); opacity: 0.55; }
.spark-bars .spark-mark.spark-day { opacity: 1; }
.spark-lines .spark-mark.spark-day { fill: var(--c1); }
.spark-usual { stroke: var(--muted); stroke-width: 1; stroke-dasharray: 3 3; }
.sleep-card .spark-bars .spark-mark { fill: var(--core); }

.card-list { list-style: none; margin: 0.3rem 0 0; padding: 0; display: grid; gap: 0.2rem; }
.card-list li {
  display: flex; flex-wrap: wrap; gap: 0.1rem 0.9rem; align-items: baseline;
  border-top: 1px solid var(--line); padding-top: 0.25rem; min-width: 0;
}
.item-name { font-weight: 600; min-width: 9rem; }
.item-when { color: var(--muted); min-width: 9rem; font-variant-numeric: tabular-nums; }
.item-figure { font-variant-numeric: tabular-nums; }
.other-item .item-figure { margin-left: auto; }

.trends-box { margin-top: 1.3rem; }

/* ---- freshness: the line at the top, the coverage calendar ----------------- */

.attention { display: grid; gap: 0.45rem; margin-bottom: 0.8rem; }
.attention-item {
  border: 1px solid var(--warn); border-left-width: 4px; border-radius: 8px;
  padding: 0.45rem 0.7rem; min-width: 0; overflow-wrap: anywhere;
}
.attention-item.stale, .attention-item.late { border-color: var(--danger); }
.attention-text { margin: 0; font-weight: 600; }
.attention-item .whole { white-space: nowrap; }
.attention-action { margin: 0.2rem 0 0; color: var(--muted); font-size: 0.88rem; }
.attention-more { display: grid; gap: 0.45rem; overflow-wrap: anywhere; }
.attention-more summary { cursor: pointer; font-weight: 600; }
.coverage-box { margin-top: 1.3rem; }
.coverage { display: grid; gap: 0.35rem; min-width: 0; }
.cov-row { min-width: 0; }
.cov-name { font-size: 0.88rem; overflow-wrap: anywhere; }
.cov-name .meta { font-size: 0.8rem; margin: 0; }
.cov-cells {
  list-style: none; margin: 0.15rem 0 0; padding: 0; display: grid; grid-auto-flow: column;
  grid-auto-columns: minmax(0, 1fr); gap: 2px;
}
.cov-cell { height: 0.9rem; border-radius: 2px; background: var(--grid); min-width: 0; }
.cov-cell.ok { background: var(--ok); }
.cov-cell.thin { background: var(--warn); opacity: 0.75; }
.cov-cell.missing { background: var(--danger); }
.cov-cell.quiet { background: var(--grid); }
.cov-cell.today { background: var(--grid-major); }
.cov-cell.today.has { background: var(--ok); opacity: 0.6; }
.cov-cell.before, .cov-cell.future { background: transparent; border: 1px dashed var(--line); }
.cov-head .cov-cell { background: transparent; height: auto; font-size: 0.7rem;
  color: var(--muted); text-align: center; white-space: nowrap; }
.coverage-legend { list-style: none; margin: 0.5rem 0 0; padding: 0; display: flex;
  flex-wrap: wrap; gap: 0.2rem 0.9rem; font-size: 0.8rem; color: var(--muted); }
.coverage-legend .cov-cell { display: inline-block; width: 0.9rem; vertical-align: middle;
  margin-right: 0.3rem; }
.coverage-gaps { margin: 0.6rem 0 0; padding-left: 1.1rem; display: grid; gap: 0.35rem;
  font-size: 0.88rem; overflow-wrap: anywhere; }
.trends { list-style: none; margin: 0.5rem 0 0; padding: 0; display: grid; gap: 0.45rem; }
.trend {
  border: 1px solid var(--line); border-left-width: 4px; border-radius: 8px;
  padding: 0.45rem 0.7rem; min-width: 0; overflow-wrap: anywhere;
}
.trend.flagged.better { border-left-color: var(--ok); }
.trend.flagged.worse { border-left-color: var(--danger); }
.trend.flagged { border-left-color: var(--warn); }
.trend-head { display: flex; flex-wrap: wrap; gap: 0.1rem 0.8rem; align-items: baseline; }
.trend-name { font-weight: 600; }
.trend-direction { color: var(--muted); }
.trend.flagged .trend-direction { color: var(--text); font-weight: 600; }
.trend.flagged.better .trend-direction { color: var(--ok); }
.trend.flagged.worse .trend-direction { color: var(--danger); }
.trend-flag { color: var(--muted); font-size: 0.85rem; }
.trend.flagged .trend-flag { color: var(--warn); font-weight: 600; }
.trend-figures { display: flex; flex-wrap: wrap; gap: 0.1rem 1.1rem; font-size: 0.88rem;
  color: var(--muted); }
.trend-figures .num { color: var(--text); font-variant-numeric: tabular-nums; }

/* ---- one workout ------------------------------------------------------------ */

:root {
  --r0: #2b6cb0; --r1: #2f9e8f; --r2: #8bb32b; --r3: #e0a020; --r4: #d9480f;
  --zone: rgba(217, 72, 15, 0.06);
}
.back { margin: 0 0 0.3rem; font-size: 0.9rem; }
.back a { text-decoration: none; }
.workout-view h3 { font-size: 1rem; margin: 0; }
.workout-part { margin-top: 1.1rem; min-width: 0; }
.workout-notes { list-style: none; margin: 0.3rem 0; padding: 0; display: grid; gap: 0.3rem;
  overflow-wrap: anywhere; }
.workout-notes li { border-left: 3px solid var(--warn); padding: 0.2rem 0.6rem; }
.workout-notes li.duplicate { border-left-color: var(--accent); }
.workout-figures { display: grid; gap: 0.5rem 1rem; margin: 0.6rem 0 0;
  grid-template-columns: repeat(auto-fill, minmax(9.5rem, 1fr)); }
.figure { min-width: 0; }
.figure dt { color: var(--muted); font-size: 0.82rem; }
.figure dd { margin: 0; font-size: 1.25rem; font-weight: 600; font-variant-numeric: tabular-nums;
  overflow-wrap: anywhere; }
.figure-note { font-size: 0.75rem; font-weight: 400; color: var(--muted); }
.workout-map { margin-top: 0.4rem; border: 1px solid var(--line); border-radius: 8px;
  overflow: hidden; background: var(--bg); }
.route-map { display: block; width: 100%; height: auto; }
.route-line { fill: none; stroke-width: 3.5; stroke-linejoin: round; stroke-linecap: round; }
.route-0 { stroke: var(--r0); } .swatch.route-0 { background: var(--r0); }
.route-1 { stroke: var(--r1); } .swatch.route-1 { background: var(--r1); }
.route-2 { stroke: var(--r2); } .swatch.route-2 { background: var(--r2); }
.route-3 { stroke: var(--r3); } .swatch.route-3 { background: var(--r3); }
.route-4 { stroke: var(--r4); } .swatch.route-4 { background: var(--r4); }
.route-none { stroke: var(--muted); }
.route-start { fill: var(--ok); stroke: var(--panel); stroke-width: 2; }
.route-finish { fill: var(--text); stroke: var(--panel); stroke-width: 2; }
.scale-bar line { stroke: var(--text); stroke-width: 2; }
.scale-bar text, .tile-credit { fill: var(--text); font-size: 11px; }
.tile-credit { text-anchor: end; }
.route-legend { margin-top: 0.4rem; font-size: 0.85rem; align-items: center; }
.route-colour { display: inline-flex; }
.route-colour button { border-radius: 0; min-height: 1.9rem; padding: 0.15rem 0.5rem;
  font-size: 0.85rem; }
.route-colour button:first-child { border-radius: 8px 0 0 8px; }
.route-colour button:last-child { border-radius: 0 8px 8px 0; margin-left: -1px; }
.route-colour button.active { background: var(--accent); color: var(--accent-text);
  border-color: var(--accent); }
.workout-chart svg { display: block; width: 100%; height: auto; }
.zone-band { fill: var(--zone); }
.zone-band.zone-2, .zone-band.zone-4 { fill: transparent; }
.series.recovery { stroke: var(--muted); stroke-dasharray: 4 3; }
.swatch.recovery-swatch { background: var(--muted); }
.end-mark { stroke: var(--muted); stroke-width: 1; stroke-dasharray: 2 3; }
.end-label { fill: var(--muted); font-size: 11px; }
.elevation-area { fill: var(--band); stroke: none; }
table.zones, table.splits { margin-top: 0.4rem; table-layout: fixed; }
.zones th, .zones td, .splits th, .splits td { white-space: normal; overflow-wrap: anywhere;
  padding: 0.3rem 0.35rem; }

/* ---- sign-in page --------------------------------------------------------- */

body.login { display: flex; min-height: 100vh; align-items: center; justify-content: center; }
.signin {
  width: 100%;
  max-width: 22rem;
  margin: 1rem;
  padding: 1.4rem;
  background: var(--panel);
  border: 1px solid var(--line);
  border-radius: 12px;
}
.signin h1 { margin-bottom: 1rem; }
.signin form { display: flex; flex-direction: column; gap: 0.5rem; }
.signin label { font-size: 0.9rem; color: var(--muted); }
.signin input { width: 100%; font-size: 1rem; }
.notice:empty { display: none; }
.notice {
  margin: 0.2rem 0;
  padding: 0.5rem 0.7rem;
  border-radius: 8px;
  border: 1px solid var(--danger);
  color: var(--danger);
  font-size: 0.9rem;
}
.notice p { margin: 0; }
.signin button[type="submit"] {
  background: var(--accent);
  border-color: var(--accent);
  color: var(--accent-text);
  font-weight: 600;
}
.hint { color: var(--muted); font-size: 0.82rem; margin: 1rem 0 0; }

/* ---- phones --------------------------------------------------------------- */

@media (max-width: 560px) {
  main { padding: 0.5rem; }
  .panel { padding: 0.7rem; border-radius: 10px; }
  .controls { flex-direction: column; align-items: stretch; }
  #catalog { min-width: 0; width: 100%; }
  .range button { flex: 1 1 auto; min-width: 0; padding-left: 0.3rem; padding-right: 0.3rem; }
  /* the journal as cards: one delivery a block, each cell named by its column; a cell
     never breaks inside a word or a number: cells flow side by side as far as they fit
     whole, the automation's name and the error take a line of their own and wrap
     between words (inside one only where a word is wider than the screen) */
  table.journal, .journal tbody { display: block; width: 100%; }
  .journal thead { display: none; }
  .journal tr {
    display: flex; flex-wrap: wrap; gap: 0 1.2rem;
    border: 1px solid var(--line); border-radius: 10px; padding: 0.4rem 0.6rem;
    margin-bottom: 0.5rem;
  }
  .journal td {
    display: flex; flex: 1 1 auto; justify-content: space-between; gap: 0.5rem; border: 0;
    padding: 0.1rem 0; white-space: nowrap; text-align: right;
  }
  .journal td.wide, .journal td.error {
    flex-basis: 100%; min-width: 0; white-space: normal; overflow-wrap: anywhere;
  }
  .journal td::before {
    content: attr(data-label); color: var(--muted); text-align: left; white-space: nowrap;
  }
  .journal td.num { text-align: right; }
  .journal td:empty { display: none; }
  .record-list { grid-template-columns: 1fr; }
  .top { flex-wrap: wrap; padding: 0.5rem 0.75rem; gap: 0.5rem; }
  .card-grid { grid-template-columns: 1fr; }
  .item-name, .item-when { min-width: 0; }
  .signout { display: flex; flex-wrap: wrap; gap: 0.4rem; }
}
"""

APP_JS = r"""// healthlog dashboard: plain ES2017, no libraries, no build step.
// The page only draws: what a metric means (its name, group, total or average, fields) comes
// from the catalog, and every day, night and hour it shows is the one the server names
// (tz=local: the day the phone lived). The browser's own clock and offset never decide a
// day. Everything that comes from the data reaches the page through textContent or SVG
// attributes, never through innerHTML.
'use strict';

(function () {
  const SVG_NS = 'http://www.w3.org/2000/svg';
  const HOUR = 3600e3;
  const DAY_MS = 24 * HOUR;
  const RANGE_KEYS = ['24h', '7d', '30d', '1y', 'all', 'custom'];
  const JOURNAL_PAGE = 20; // the journal's rows a page shows, then "More deliveries"
  const DATE_RE = /^(\d{4})-(\d{2})-(\d{2})$/;
  const LOCAL_RE = new RegExp('^(\\d{4}-\\d{2}-\\d{2})T(\\d{2}):(\\d{2})' +
    '(?::(\\d{2})(?:\\.\\d+)?)?(Z|[+-]\\d{2}:\\d{2})$');

  // ---------------------------------------------------------------------------------
  // Calendar dates as text (YYYY-MM-DD): arithmetic on the calendar alone, in UTC, so
  // that the browser's zone never moves a date.
  // ---------------------------------------------------------------------------------

  function dayNumber(date) {
    const m = DATE_RE.exec(date);
    if (!m) throw new Error('not a date: ' + date);
    return Math.round(Date.UTC(+m[1], +m[2] - 1, +m[3]) / DAY_MS);
  }

  function dateOf(n) { return new Date(n * DAY_MS).toISOString().slice(0, 10); }

  function addDays(date, n) { return dateOf(dayNumber(date) + n); }

  function daysBetween(from, to) { return dayNumber(to) - dayNumber(from); }

  /** 0 for Monday … 6 for Sunday (1970-01-01 was a Thursday). */
  function weekdayOf(date) { return (((dayNumber(date) + 3) % 7) + 7) % 7; }

  function mondayOf(date) { return addDays(date, -weekdayOf(date)); }

  function isDate(text) { return typeof text === 'string' && DATE_RE.test(text); }

  /** The slots of a date axis: every day of [from, to), or the Monday of every week. */
  function dateSlots(from, to, bucket) {
    const out = [];
    const step = bucket === 'week' ? 7 : 1;
    let d = bucket === 'week' ? mondayOf(from) : from;
    for (let guard = 0; d < to && guard < 5000; guard++) {
      out.push(d);
      d = addDays(d, step);
    }
    return out;
  }

  // ---------------------------------------------------------------------------------
  // Instants and local times as the server writes them
  // ---------------------------------------------------------------------------------

  /** ISO-8601 UTC without milliseconds: 2024-03-08T18:00:00Z. */
  function isoZ(ms) { return new Date(ms).toISOString().replace(/\.\d{3}Z$/, 'Z'); }

  function instant(text) {
    const t = Date.parse(text);
    return isNaN(t) ? null : t;
  }

  /** The parts of a local time the server wrote (2025-04-15T07:30:00-04:00): its date,
   *  wall clock and offset, read from the text (never converted to the browser's zone). */
  function splitLocal(text) {
    const m = LOCAL_RE.exec(text || '');
    if (!m) return null;
    const offset = m[5] === 'Z' ? '+00:00' : m[5];
    const sign = offset.charAt(0) === '-' ? -1 : 1;
    const offsetMin = sign * (+offset.slice(1, 3) * 60 + +offset.slice(4, 6));
    return {
      date: m[1], hour: +m[2], minute: +m[3], time: m[2] + ':' + m[3], offset: offset,
      offsetMs: offsetMin * 60e3,
    };
  }

  function pad(n) { return (n < 10 ? '0' : '') + n; }

  // ---------------------------------------------------------------------------------
  // Ranges: what to ask for and the axis to draw it on
  // ---------------------------------------------------------------------------------

  /** The server's plan of a view (GET /api/plan: the layer, bucket and bounds it chose for
   *  the range) with what drawing it needs: the date slots of a range of dates, the instants
   *  of a range of hours. The page decides none of it. Pure. */
  function planOf(plan) {
    const hours = plan.axis === 'hours' && !!plan.from && !isDate(plan.from);
    return Object.assign({}, plan, {
      slots: plan.axis === 'dates' && plan.from
        ? dateSlots(plan.from, addDays(plan.to, 1), plan.bucket) : null,
      t0: hours ? instant(plan.from) : null,
      t1: hours ? instant(plan.to) : null,
    });
  }

  // ---------------------------------------------------------------------------------
  // Numbers and words
  // ---------------------------------------------------------------------------------

  const numberFormats = {};

  /** Every number on the page goes through here: one grouping, one rounding rule. */
  function formatNumber(v, digits) {
    if (typeof v !== 'number' || !isFinite(v)) return '–';
    if (digits === undefined) {
      const abs = Math.abs(v);
      digits = abs >= 100 ? 0 : abs >= 10 ? 1 : 2;
    }
    if (!numberFormats[digits]) {
      numberFormats[digits] = new Intl.NumberFormat(undefined, {
        maximumFractionDigits: digits, useGrouping: true,
      });
    }
    return numberFormats[digits].format(v);
  }

  function formatCount(n) { return formatNumber(n, 0); }

  /** A measured value with at least the decimals its meaning asks for (``digits``, from
   *  the server: "168.0" and "167.8" lb, never both "168"); without them, formatNumber's. */
  function formatValue(v, digits) {
    if (typeof digits !== 'number' || !(digits >= 0)) return formatNumber(v);
    if (typeof v !== 'number' || !isFinite(v)) return '–';
    const abs = Math.abs(v);
    const most = Math.max(digits, abs >= 100 ? 0 : abs >= 10 ? 1 : 2);
    const key = digits + '-' + most;
    if (!numberFormats[key]) {
      numberFormats[key] = new Intl.NumberFormat(undefined, {
        minimumFractionDigits: digits, maximumFractionDigits: most, useGrouping: true,
      });
    }
    return numberFormats[key].format(v);
  }

  /** An axis tick: the decimals its step has (0.25: two, on every tick), so that every
   *  tick reads as the value it marks and no two alike. */
  function formatTick(v, step) {
    let digits = 0;
    while (digits < 6 && step > 0 &&
      Math.abs(step * Math.pow(10, digits) - Math.round(step * Math.pow(10, digits))) > 1e-6) {
      digits += 1;
    }
    return formatValue(v, digits);
  }

  /** " bpm" after a number: the units as the server shows them (its ``unit_label``: "" for
   *  a count the metric's name explains), else as stored. */
  function unitText(label, units) {
    const shown = typeof label === 'string' ? label : units;
    return shown ? ' ' + shown : '';
  }

  /** Minutes as "45 min" or "7 h 05 min". */
  function formatMinutes(minutes) {
    if (typeof minutes !== 'number' || !isFinite(minutes) || minutes < 0) return '–';
    const whole = Math.round(minutes);
    if (whole < 60) return whole + ' min';
    return Math.floor(whole / 60) + ' h ' + pad(whole % 60) + ' min';
  }

  function formatHours(hours) { return formatMinutes(hours * 60); }

  /** Seconds as "22 s" under a minute, else as formatMinutes. */
  function formatSeconds(seconds) {
    if (typeof seconds === 'number' && seconds >= 0 && seconds < 59.5) {
      return Math.round(seconds) + ' s';
    }
    return formatMinutes(seconds / 60);
  }

  const dateFormats = {};

  /** A calendar date in words ("Tue, Apr 15, 2025"), formatted as a UTC date so that no
   *  zone moves it. */
  function formatDate(date, style) {
    const key = style || 'long';
    if (!dateFormats[key]) {
      const options = {
        long: { weekday: 'short', day: 'numeric', month: 'short', year: 'numeric' },
        short: { day: 'numeric', month: 'short' },
        weekday: { weekday: 'short' },
        month: { month: 'short' },
        year: { year: 'numeric' },
      }[key];
      options.timeZone = 'UTC';
      dateFormats[key] = new Intl.DateTimeFormat(undefined, options);
    }
    return dateFormats[key].format(new Date(dayNumber(date) * DAY_MS));
  }

  /** A local time the server wrote, in words: its date and wall clock as written. */
  function formatLocal(text, withOffset) {
    const p = splitLocal(text);
    if (!p) return text || '–';
    return formatDate(p.date) + ', ' + p.time + (withOffset ? ' (UTC' + p.offset + ')' : '');
  }

  /** An instant (a delivery's receive time) in the chosen zone, or the browser's for
   *  "local" (a server event has no phone zone). */
  function formatInstant(text, zone) {
    const t = instant(text);
    if (t === null) return '–';
    const options = {
      day: 'numeric', month: 'short', year: 'numeric', hour: '2-digit', minute: '2-digit',
      hourCycle: 'h23',
    };
    if (zone && zone !== 'local') options.timeZone = zone;
    try {
      return new Intl.DateTimeFormat(undefined, options).format(new Date(t));
    } catch (err) {
      delete options.timeZone;
      return new Intl.DateTimeFormat(undefined, options).format(new Date(t));
    }
  }

  /** "valenceClassification" -> "valence classification", "slightly_pleasant" ->
   *  "slightly pleasant": field names and slugs as words, nothing renamed. */
  function words(text) {
    return String(text).replace(/_/g, ' ').replace(/([a-z])([A-Z])/g, '$1 $2').toLowerCase();
  }

  function capitalise(text) { return text.charAt(0).toUpperCase() + text.slice(1); }

  function detailText(value) {
    if (value === null || value === undefined) return '–';
    if (Array.isArray(value)) return value.length ? value.map(detailText).join(', ') : '–';
    if (typeof value === 'number') return formatNumber(value);
    if (typeof value === 'boolean') return value ? 'yes' : 'no';
    if (typeof value === 'object') {
      if (typeof value.qty === 'number') {
        return formatNumber(value.qty) + unitText(value.unit_label, value.units);
      }
      return Object.keys(value).map(function (k) {
        return words(k) + ' ' + detailText(value[k]);
      }).join(', ');
    }
    return /^[a-z]+(_[a-z]+)+$/.test(value) ? words(value) : String(value);
  }

  function quantityText(q) {
    return q && typeof q.qty === 'number' ? formatNumber(q.qty) + unitText(q.unit_label, q.units)
      : '–';
  }

  // ---------------------------------------------------------------------------------
  // Axes: ticks for values, dates and hours
  // ---------------------------------------------------------------------------------

  /** Round ticks covering [lo, hi]. */
  function niceTicks(lo, hi, count) {
    if (!(hi > lo)) {
      const room = Math.abs(hi) > 0 ? Math.abs(hi) * 0.1 : 1;
      lo -= room;
      hi += room;
    }
    const raw = (hi - lo) / Math.max(1, count);
    const mag = Math.pow(10, Math.floor(Math.log10(raw)));
    const norm = raw / mag;
    const step = (norm <= 1 ? 1 : norm <= 2 ? 2 : norm <= 2.5 ? 2.5 : norm <= 5 ? 5 : 10) * mag;
    const start = Math.floor(lo / step + 1e-9) * step;
    const end = Math.ceil(hi / step - 1e-9) * step;
    const ticks = [];
    for (let i = 0, v = start; v <= end + step / 2 && i < 50; i++, v = start + i * step) {
      ticks.push(Math.round(v / step) * step);
    }
    return ticks;
  }

  /** Which slots of a date axis get a label, at most ``room`` of them: every day, every
   *  Monday, every other Monday, or month starts (every 1, 2, 3 or 6 months, years
   *  named). A fortnight or less of days that one-line labels cannot all name is labelled
   *  in two lines (weekday over day; ``lines``), each day or every other, at most
   *  ``narrow`` of them: a week on a phone has a label per night. Returns [{index, date,
   *  label, major, lines?}]. */
  function dateTicks(slots, bucket, room, narrow) {
    const n = slots.length;
    const out = [];
    if (!n) return out;
    const limit = Math.max(2, room);
    if (bucket === 'day' && n <= limit) {
      slots.forEach(function (d, i) {
        out.push({
          index: i, date: d, major: d.slice(8) === '01',
          label: n <= 8 ? formatDate(d, 'weekday') + ' ' + (+d.slice(8)) : formatDate(d, 'short'),
        });
      });
      return out;
    }
    if (bucket === 'day' && n <= 16 && narrow >= 2) {
      for (const every of [1, 2]) {
        if (Math.ceil(n / every) <= narrow) {
          slots.forEach(function (d, i) {
            if (i % every) return;
            const lines = [formatDate(d, 'weekday'), String(+d.slice(8))];
            out.push({ index: i, date: d, major: d.slice(8) === '01', label: lines.join(' '),
              lines: lines });
          });
          return out;
        }
      }
    }
    if (bucket === 'day') {
      const mondays = slots.filter(function (d) { return weekdayOf(d) === 0; }).length;
      for (const every of [1, 2]) {
        if (mondays / every <= limit) {
          let k = 0;
          slots.forEach(function (d, i) {
            if (weekdayOf(d) === 0 && k++ % every === 0) {
              out.push({ index: i, date: d, label: formatDate(d, 'short'), major: false });
            }
          });
          return out;
        }
      }
    }
    // months: the first slot of each month (a week's slot is its Monday)
    const starts = [];
    slots.forEach(function (d, i) {
      if (i === 0 ? d.slice(8) === '01' || bucket === 'week' && +d.slice(8) <= 7
        : d.slice(5, 7) !== slots[i - 1].slice(5, 7)) {
        starts.push(i);
      }
    });
    const everies = [1, 2, 3, 6, 12];
    let every = 12;
    for (let i = 0; i < everies.length; i++) {
      if (starts.length / everies[i] <= limit) {
        every = everies[i];
        break;
      }
    }
    starts.forEach(function (i) {
      const d = slots[i];
      const month = +d.slice(5, 7) - 1;
      if (month % every !== 0) return;
      const first = month === 0;
      out.push({
        index: i, date: d, label: first ? d.slice(0, 4) : formatDate(d, 'month'), major: first,
      });
    });
    return out;
  }

  /** Hour ticks over [t0, t1): each whole hour labelled by the wall clock it had, in the
   *  offset of the nearest bucket the server placed (its ``local``); midnights carry the
   *  date and are major. At most ``room`` labels. Returns [{t, label, major, date}]. */
  function hourTicks(t0, t1, buckets, room) {
    const known = buckets.map(function (b) {
      return { t: instant(b.start), p: splitLocal(b.local) };
    }).filter(function (k) { return k.t !== null && k.p; })
      .sort(function (a, b) { return a.t - b.t; });
    if (!known.length) return [];
    const offsetAt = function (t) {
      let best = known[0];
      for (let i = 0; i < known.length; i++) {
        if (known[i].t <= t) best = known[i];
        else break;
      }
      return best.p.offsetMs;
    };
    const hours = [];
    for (let t = Math.ceil(t0 / HOUR) * HOUR; t < t1; t += HOUR) {
      const wall = new Date(t + offsetAt(t));
      hours.push({ t: t, hour: wall.getUTCHours(), date: wall.toISOString().slice(0, 10) });
    }
    const steps = [1, 2, 3, 4, 6, 12, 24];
    let step = steps[steps.length - 1];
    for (let i = 0; i < steps.length; i++) {
      const shown = hours.filter(function (h) { return h.hour % steps[i] === 0; }).length;
      if (shown <= Math.max(2, room)) {
        step = steps[i];
        break;
      }
    }
    return hours.filter(function (h) { return h.hour % step === 0; }).map(function (h) {
      return {
        t: h.t, date: h.date, major: h.hour === 0,
        label: h.hour === 0 ? formatDate(h.date, 'short') : pad(h.hour) + ':00',
      };
    });
  }

  // ---------------------------------------------------------------------------------
  // From replies to what is drawn (pure)
  // ---------------------------------------------------------------------------------

  /** The value of a bucket's field as the metric's meaning combines it: ``combine`` names
   *  the bucket's figure that is its value (``sum`` or ``avg``). */
  function bucketValue(bucket, field, combine) {
    const stats = bucket.fields && bucket.fields[field];
    if (!stats) return null;
    const v = stats[combine];
    return typeof v === 'number' && isFinite(v) ? v : null;
  }

  /** The fields a series draws: the meaning's (main first) that the buckets hold; without
   *  any of them, the numeric fields the buckets hold. */
  function seriesFields(meaning, buckets) {
    const present = [];
    buckets.forEach(function (b) {
      Object.keys(b.fields || {}).forEach(function (f) {
        if (present.indexOf(f) < 0) present.push(f);
      });
    });
    const named = (meaning.fields || []).filter(function (f) { return present.indexOf(f) >= 0; });
    return named.length ? named : present;
  }

  /** Runs of positions without a gap: a missing bucket breaks a line. Positions are slot
   *  numbers (a date's index, or hours since the axis start). */
  function segmentsOf(points) {
    const out = [];
    let current = [];
    points.forEach(function (p, i) {
      if (i && p.pos - points[i - 1].pos > 1.5) {
        out.push(current);
        current = [];
      }
      current.push(p);
    });
    if (current.length) out.push(current);
    return out;
  }

  /** The stages of a night with hours, in the order the server gives (``order``: the sleep
   *  meaning's stages, deepest first, awake last, each {stage, label, asleep, unspecified});
   *  a stage it does not list comes after the listed stages of sleep. Pure. */
  function stagesOf(stages, order) {
    const listed = (order || []).map(function (s) { return s.stage; });
    const rank = function (k) {
      const i = listed.indexOf(k);
      return i < 0 ? listed.length : i;
    };
    return Object.keys(stages || {}).filter(function (k) {
      return typeof stages[k] === 'number' && stages[k] > 0;
    }).sort(function (a, b) { return rank(a) - rank(b); });
  }

  /** The entry of a stage in the server's order, or what a stage it does not list is: a
   *  stage of sleep named by its key. */
  function stageOf(stage, order) {
    const found = (order || []).filter(function (s) { return s.stage === stage; })[0];
    return found || { stage: stage, label: stage, asleep: true, unspecified: false };
  }

  /** A night's bar: its stages of sleep bottom up in the server's order, the stages that
   *  are not sleep (awake) on top, in bed behind. The asleep hours no stage holds (a night
   *  whose figure has no stage hours, or a week's nights without them) are the sleep no
   *  stage was given for: the order's ``unspecified`` stage ("asleep, no stage"), added to
   *  its hours where the night has some; a remainder under a minute is the rounding of
   *  averages, not drawn. The server's stages never add up to more than the hours asleep.
   *  Pure. */
  function nightBar(night, order) {
    const stages = Object.assign({}, night.stages || {});
    const asleep = typeof night.asleep === 'number' ? night.asleep : null;
    const unspecified = (order || []).filter(function (s) { return s.unspecified; })[0];
    let staged = 0;
    stagesOf(stages, order).forEach(function (k) {
      if (stageOf(k, order).asleep) staged += stages[k];
    });
    if (unspecified && asleep !== null && asleep - staged > 1 / 60) {
      stages[unspecified.stage] = (stages[unspecified.stage] || 0) + asleep - staged;
    }
    const keys = stagesOf(stages, order);
    const awake = keys.filter(function (k) { return !stageOf(k, order).asleep; });
    const parts = [];
    keys.forEach(function (k) {
      if (awake.indexOf(k) < 0) parts.push({ stage: k, hours: stages[k] });
    });
    awake.forEach(function (k) { parts.push({ stage: k, hours: stages[k] }); });
    let top = 0;
    parts.forEach(function (p) { top += p.hours; });
    return { parts: parts, top: top, asleep: asleep,
      inBed: typeof night.in_bed === 'number' ? night.in_bed : null };
  }

  /** Names as words: "A", "A and B", "A, B and C"; past ``most`` of them, "N more". */
  function listWords(names, most) {
    const shown = names.slice(0, most || names.length);
    if (names.length > shown.length) shown.push((names.length - shown.length) + ' more');
    if (shown.length < 2) return shown.join('');
    return shown.slice(0, -1).join(', ') + ' and ' + shown[shown.length - 1];
  }

  /** When a night's sleep began and ended, in words: "bed 23:10, wake 07:00"; a bedtime
   *  more than a day before the wake day with its date; "bedtime not known" where the
   *  server knows none (a record that starts where the one before it ended). Pure. */
  function bedWords(night) {
    const bed = bedTime(night);
    const end = splitLocal(night.sleep_end);
    return (bed ? 'bed ' + bed : 'bedtime not known') + ', wake ' + (end ? end.time : '–');
  }

  /** A night's bedtime as shown: its wall clock, with its date when that is more than a
   *  day before the wake day ("Feb 22 21:57"); null when not known. Pure. */
  function bedTime(night) {
    const start = splitLocal(night.sleep_start);
    const end = splitLocal(night.sleep_end);
    if (!start) return null;
    return (end && daysBetween(start.date, end.date) > 1
      ? formatDate(start.date, 'short') + ' ' : '') + start.time;
  }

  /** A nap's times: "15:59–17:28", or "until 18:26" where its start is not known. Pure. */
  function napTimes(nap) {
    const from = splitLocal(nap.sleep_start);
    const to = splitLocal(nap.sleep_end);
    const end = to ? to.time : '–';
    return from ? from.time + '–' + end : 'until ' + end;
  }

  /** What an overlapping night says of itself, from what the server counted (``counted``,
   *  ``said``, ``limit``, ``limit_by``, ``scaled``, ``sources``): who wrote it (the names
   *  its records give, never another device), how much they said against the most the
   *  night holds, and which figure counts. ``fields``: the sleep meaning's fields with
   *  their labels (hours asleep, in bed). '' for a night that does not overlap. Pure. */
  function overlapWords(night, order, fields) {
    if (!night || night.overlapping !== true) return '';
    const label = function (i) { return (fields[i] && fields[i].label) || ''; };
    const inBed = fields[1] ? fields[1].field : null;
    const who = (night.sources || []).length ? listWords(night.sources, 4) : 'Its sources';
    const staged = (order || []).filter(function (s) { return s.asleep && !s.unspecified; })
      .map(function (s) { return s.label; });
    const limit = formatHours(night.limit);
    let bound = ' for a night of ' + limit + ' from its start to its end';
    if (night.limit_by === inBed && inBed) bound = ' for ' + limit + ' ' + label(1);
    else if (night.limit_by !== 'window') bound = ', more than a day holds';
    const asleep = formatHours(night.asleep);
    let counted;
    if (night.counted === 'staged') {
      counted = night.scaled
        ? asleep + ', the most the night holds, its ' + listWords(staged) +
          ' scaled to their shares of it'
        : 'its ' + listWords(staged) + ', ' + asleep +
          ' (the sleep no stage holds is left out)';
    } else if (night.counted === 'unspecified') {
      counted = asleep + ' ' + label(0) + (night.said > night.limit
        ? ', the most the night holds' : '') + '; no stage hours';
    } else if (night.counted === 'union') {
      counted = asleep + ' ' + label(0) + ', each minute once' +
        (night.scaled ? ', its stages scaled to a day' : '');
    } else {
      counted = asleep + ' ' + label(0) + ' as written; ' + label(1) + ' at most its window';
    }
    return 'Sources overlap: ' + who + ' wrote ' + formatHours(night.said) + bound +
      '; counted: ' + counted + '.';
  }

  // ---------------------------------------------------------------------------------
  // DOM helpers
  // ---------------------------------------------------------------------------------

  function $(id) { return document.getElementById(id); }

  function el(tag, className, text) {
    const node = document.createElement(tag);
    if (className) node.className = className;
    if (text !== undefined && text !== null) node.textContent = String(text);
    return node;
  }

  function svg(tag, attrs, text) {
    const node = document.createElementNS(SVG_NS, tag);
    Object.keys(attrs || {}).forEach(function (name) {
      if (attrs[name] !== null && attrs[name] !== undefined) {
        node.setAttribute(name, String(attrs[name]));
      }
    });
    if (text !== undefined) node.textContent = String(text);
    return node;
  }

  function clear(node) {
    while (node.firstChild) node.removeChild(node.firstChild);
  }

  function setData(node, values) {
    Object.keys(values).forEach(function (k) {
      const v = values[k];
      if (v !== null && v !== undefined) node.dataset[k] = String(v);
    });
  }

  function showMessage(text) {
    const box = $('message');
    box.textContent = text || '';
    box.hidden = !text;
  }

  class HttpError extends Error {
    constructor(message, status) {
      super(message);
      this.status = status;
    }
  }

  // A view's load supersedes the one before it: that one is aborted, and its answers,
  // should any still arrive, are recognised by their older token and dropped.
  function newLoad(slot) {
    if (slot.controller) slot.controller.abort();
    slot.controller = new AbortController();
    slot.token += 1;
    return { controller: slot.controller, token: slot.token };
  }

  async function getJSON(url, signal) {
    let response;
    try {
      response = await fetch(url, {
        credentials: 'same-origin', headers: { Accept: 'application/json' }, signal: signal,
      });
    } catch (err) {
      if (err && err.name === 'AbortError') throw err;
      throw new HttpError('The server cannot be reached (' + err.message + ').', 0);
    }
    if (response.status === 401) {
      // The session ended (signed out elsewhere, or the token changed): the sign-in page,
      // at the same address, so the view comes back once signed in.
      window.location.reload();
      throw new HttpError('Signed out.', 401);
    }
    let body = null;
    try {
      body = await response.json();
    } catch (err) {
      if (err && err.name === 'AbortError') throw err;
      body = null;
    }
    if (!response.ok) {
      const detail = body && body.error && body.error.message;
      throw new HttpError(detail || 'HTTP ' + response.status, response.status);
    }
    return body;
  }

  function query(path, params) {
    const search = new URLSearchParams();
    Object.keys(params).forEach(function (k) {
      if (params[k] !== null && params[k] !== undefined && params[k] !== '') {
        search.set(k, params[k]);
      }
    });
    return path + '?' + search.toString();
  }

  // ---------------------------------------------------------------------------------
  // State, the address (hash) and the controls
  // ---------------------------------------------------------------------------------

  const state = {
    metrics: [], // one per metric: {metric, meaning, layers: [catalog entries], first, last}
    groups: [], // the meaning table's groups in order, with their titles (the catalog's)
    metric: null,
    view: null, // 'summary' or 'metric': what the address shows
    layer: '', // '' = the server's choice for the range (it names it), else a stored layer
    layerRead: null, // the layer the last reply was read from, as it names it
    range: '7d',
    custom: null, // {from, to}: dates, both shown
    tz: 'local',
    ecg: null, // the start of the chosen ECG recording
    workout: { token: 0, controller: null, data: null, colour: 'speed' }, // #view=workout
    token: 0, // every view load takes a number; a reply to an older one is dropped
    controller: null,
    shown: null, // what the chart shows, for redrawing on resize
    more: null, // loads the next page of the list shown
    journalNext: null,
    journalLoaded: false, // the journal loads with the first metric view
    summary: {
      token: 0, controller: null, date: null, // the day shown, as the server named it
      newest: {}, // tz -> the day the server opens on (its newest data)
      coverageController: null, coverageTz: null, // the calendar, loaded once per zone
    },
  };

  function readHash() {
    const params = new URLSearchParams(window.location.hash.replace(/^#/, ''));
    const out = {};
    const keys = ['view', 'date', 'metric', 'layer', 'range', 'tz', 'from', 'to',
      'recording', 'id']; // recording: the ECG recording shown, by its start; id: a workout
    keys.forEach(function (k) {
      const v = params.get(k);
      if (v) out[k] = v;
    });
    return out;
  }

  function writeHash() {
    if (!state.metric) return;
    const params = new URLSearchParams();
    params.set('metric', state.metric.metric);
    if (state.layer) params.set('layer', state.layer);
    params.set('range', state.range);
    if (state.range === 'custom' && state.custom) {
      params.set('from', state.custom.from);
      params.set('to', state.custom.to);
    }
    params.set('tz', state.tz);
    if (state.metric.meaning.kind === 'ecg' && state.ecg) params.set('recording', state.ecg);
    const hash = '#' + params.toString();
    if (window.location.hash !== hash) window.history.replaceState(null, '', hash);
    $('nav-metrics').href = hash;
  }

  function applyHash(wanted) {
    const found = state.metrics.find(function (m) { return m.metric === wanted.metric; });
    if (found) state.metric = found;
    if (!state.metric) state.metric = defaultMetric();
    state.layer = wanted.layer && state.metric.layers.some(function (l) {
      return l.layer === wanted.layer;
    }) ? wanted.layer : '';
    if (wanted.range && RANGE_KEYS.indexOf(wanted.range) >= 0) state.range = wanted.range;
    if (state.range === 'custom') {
      if (isDate(wanted.from) && isDate(wanted.to) && wanted.from <= wanted.to) {
        state.custom = { from: wanted.from, to: wanted.to };
      } else if (!state.custom) {
        state.range = '7d';
      }
    }
    if (wanted.tz) {
      state.tz = wanted.tz;
      ensureZoneOption(wanted.tz);
    }
    state.ecg = wanted.recording || null;
  }

  /** The metric a first visit opens on: the series with the latest data. */
  function defaultMetric() {
    const series = state.metrics.filter(function (m) { return m.meaning.drawn === 'series'; });
    const pool = series.length ? series : state.metrics;
    return pool.slice().sort(function (a, b) {
      return b.last - a.last || (a.metric < b.metric ? -1 : 1);
    })[0];
  }

  function browserZone() {
    try {
      return Intl.DateTimeFormat().resolvedOptions().timeZone || null;
    } catch (err) {
      return null;
    }
  }

  function ensureZoneOption(zone) {
    const select = $('zone');
    const known = Array.prototype.some.call(select.options, function (o) {
      return o.value === zone;
    });
    if (!known) select.appendChild(new Option(zone, zone));
    select.value = zone;
  }

  function fillZones() {
    const select = $('zone');
    clear(select);
    select.appendChild(new Option('As recorded on the phone', 'local'));
    const own = browserZone();
    if (own && own !== 'UTC' && own !== 'Etc/UTC') {
      select.appendChild(new Option('This browser: ' + own, own));
    }
    select.appendChild(new Option('UTC', 'UTC'));
    select.value = state.tz;
  }

  /** A group's title as the catalog names it, else its name in words. */
  function groupLabel(group) {
    const found = state.groups.filter(function (g) { return g.group === group; })[0];
    return found ? found.title : capitalise(words(group || ''));
  }

  function fillCatalog() {
    const select = $('catalog');
    clear(select);
    const groups = [];
    state.metrics.forEach(function (m) {
      if (groups.indexOf(m.meaning.group) < 0) groups.push(m.meaning.group);
    });
    // in the catalog's order of groups; a group it does not list after them, by name
    const listed = state.groups.map(function (g) { return g.group; });
    const rank = function (g) {
      const i = listed.indexOf(g);
      return i < 0 ? listed.length : i;
    };
    groups.sort(function (a, b) {
      return rank(a) - rank(b) || (a < b ? -1 : a > b ? 1 : 0);
    });
    groups.forEach(function (group) {
      const optgroup = el('optgroup');
      optgroup.label = groupLabel(group);
      state.metrics.filter(function (m) { return m.meaning.group === group; })
        .sort(function (a, b) { return a.meaning.name.localeCompare(b.meaning.name); })
        .forEach(function (m) {
          const option = el('option', null, m.meaning.name);
          option.value = m.metric;
          option.dataset.metric = m.metric;
          option.dataset.kind = m.meaning.kind;
          optgroup.appendChild(option);
        });
      select.appendChild(optgroup);
    });
    select.disabled = false;
  }

  function fillLayers() {
    const field = $('layer-field');
    const select = $('layer');
    clear(select);
    const layers = state.metric ? state.metric.layers : [];
    field.hidden = layers.length < 2;
    select.appendChild(new Option(state.layerRead && !state.layer
      ? 'Best for the range: ' + state.layerRead : 'Best for the range', ''));
    layers.forEach(function (l) { select.appendChild(new Option(l.layer, l.layer)); });
    select.value = state.layer;
  }

  function markControls() {
    Array.prototype.forEach.call(document.querySelectorAll('#range button'), function (b) {
      const on = b.dataset.range === state.range;
      b.classList.toggle('active', on);
      b.setAttribute('aria-pressed', on ? 'true' : 'false');
    });
    $('custom').hidden = state.range !== 'custom';
    if (state.custom) {
      $('from').value = state.custom.from;
      $('to').value = state.custom.to;
    }
    if (state.metric) $('catalog').value = state.metric.metric;
    $('zone').value = state.tz;
    fillLayers();
  }

  async function loadCatalog() {
    let data;
    try {
      data = await getJSON('/api/catalog');
    } catch (err) {
      if (err.status !== 401) showMessage('Catalog: ' + err.message);
      return;
    }
    const byMetric = {};
    state.groups = (data && data.groups) || [];
    ((data && data.metrics) || []).forEach(function (entry) {
      let m = byMetric[entry.metric];
      if (!m) {
        m = byMetric[entry.metric] = {
          metric: entry.metric, meaning: entry.meaning, layers: [], first: Infinity,
          last: -Infinity, points: 0,
        };
        state.metrics.push(m);
      }
      m.layers.push(entry);
      m.first = Math.min(m.first, instant(entry.first));
      m.last = Math.max(m.last, instant(entry.last));
      m.points += entry.points || 0;
    });
    if (!state.metrics.length) {
      const select = $('catalog');
      clear(select);
      select.appendChild(el('option', null, 'No data yet'));
      $('chart').dataset.state = 'empty';
      $('view-title').textContent = 'No data yet';
      $('view-meta').textContent = 'Point a Health Auto Export automation at /api/ingest.';
      return;
    }
    fillCatalog();
    if (state.view === 'metric') {
      applyHash(readHash());
      showView();
    }
  }

  // ---------------------------------------------------------------------------------
  // One view: the chosen metric over the chosen range, in the chosen zone
  // ---------------------------------------------------------------------------------

  /** {date, instant} of the metric's latest data in the chosen zone, as the server dates
   *  it. */
  function setChart(values) {
    const chart = $('chart');
    Object.keys(values).forEach(function (k) {
      if (values[k] === null || values[k] === undefined) delete chart.dataset[k];
      else chart.dataset[k] = String(values[k]);
    });
  }

  function zoneText() {
    return state.tz === 'local' ? 'times as recorded on the phone' : 'times in ' + state.tz;
  }

  async function showView() {
    const metric = state.metric;
    if (!metric) return;
    const { controller, token } = newLoad(state);
    const current = function () { return token === state.token; };
    const kind = metric.meaning.kind;
    const drawn = metric.meaning.drawn;
    writeHash();
    markControls();
    state.more = null;
    $('records-more').hidden = true;
    $('view-title').textContent = metric.meaning.name;
    $('readout').textContent = '';
    const chart = $('chart');
    chart.hidden = kind === 'events';
    setChart({
      metric: metric.metric, kind: kind, range: state.range, tz: state.tz, state: 'loading',
      bucket: null, from: null, to: null, layer: null,
    });
    chart.setAttribute('aria-busy', 'true');
    try {
      const custom = state.range === 'custom' && state.custom ? state.custom : null;
      const plan = planOf(await getJSON(query('/api/plan', {
        metric: metric.metric, range: state.range, tz: state.tz, layer: state.layer || null,
        from: custom ? custom.from : null, to: custom ? custom.to : null,
      }), controller.signal));
      if (!current()) return;
      if (plan.from && isDate(plan.from) && !state.custom) {
        // the dates a switch to Custom starts from
        $('from').value = plan.from;
        $('to').value = plan.to;
      }
      // the plan's query, as it names it: /api/points reads the layers it names (the one
      // picked, else the one chosen and those that fill the days it lacks, READ-2.8); a
      // list's has no bucket
      setChart({ bucket: plan.points.bucket || null, from: plan.from, to: plan.to,
        layer: plan.layer });
      const meta = capitalise(plan.words) + ' · ' + zoneText();
      $('view-meta').textContent = meta;
      state.layerRead = plan.layer;
      fillLayers();
      setCsv(plan);
      let view;
      if (drawn !== 'list') {
        const data = await getJSON(query('/api/points', plan.points), controller.signal);
        if (!current()) return;
        view = { kind: kind, drawn: drawn, metric: metric, plan: plan, data: data };
      } else if (kind === 'workouts') {
        const data = await getJSON(query('/api/workouts', {
          from: plan.from, to: plan.to, tz: plan.tz, bucket: plan.bucket,
        }), controller.signal);
        if (!current()) return;
        view = { kind: kind, drawn: drawn, metric: metric, plan: plan,
          items: data.workouts || [], buckets: data.buckets || [], truncated: data.truncated };
      } else {
        const page = await getJSON(query('/api/records', plan.points), controller.signal);
        if (!current()) return;
        view = { kind: kind, drawn: drawn, metric: metric, plan: plan, items: page.items || [],
          next: page.next_before, params: plan.points };
      }
      state.shown = view;
      draw(view);
      if (kind === 'ecg') await showTrace(view, token, controller.signal);
      if (!current()) return;
      chart.removeAttribute('aria-busy');
      chart.dataset.state = 'ready';
    } catch (err) {
      if (!current() || (err && err.name === 'AbortError')) return;
      chart.removeAttribute('aria-busy');
      chart.hidden = false;
      clear(chart);
      chart.appendChild(el('p', 'empty', 'Could not load ' + metric.meaning.name + ': ' +
        err.message));
      chart.dataset.state = 'error';
    }
  }

  /** The CSV link: the plan's query, as CSV (a list's records, a series' buckets). */
  function setCsv(plan) {
    const csv = $('csv');
    csv.href = query('/api/points', Object.assign({}, plan.points, { format: 'csv' }));
    csv.setAttribute('download', [plan.metric, state.range, plan.from || 'all']
      .join('-').replace(/[^A-Za-z0-9._-]+/g, '_') + '.csv');
  }

  function draw(view) {
    const chart = $('chart');
    clear(chart);
    clear($('records'));
    const kind = view.kind;
    if (view.drawn === 'series') drawSeries(chart, view);
    else if (view.drawn === 'nights') drawNights(chart, view);
    else if (kind === 'workouts') {
      drawWorkoutMinutes(chart, view);
      drawWorkoutList($('records'), view.items);
    } else if (kind === 'ecg') drawEcgList($('records'), view);
    else drawEvents($('records'), view);
  }

  function redraw() {
    const view = state.shown;
    if (!view || $('chart').dataset.state !== 'ready') return;
    if (view.drawn === 'series') {
      clear($('chart'));
      drawSeries($('chart'), view);
    } else if (view.drawn === 'nights') {
      clear($('chart'));
      drawNights($('chart'), view);
    } else if (view.kind === 'workouts') {
      clear($('chart'));
      drawWorkoutMinutes($('chart'), view);
    } else if (view.kind === 'ecg' && view.trace) {
      clear($('chart'));
      drawTrace($('chart'), view.trace);
    }
  }

  // ---------------------------------------------------------------------------------
  // Charts: a frame (axes, grid, readout) and what each kind draws in it
  // ---------------------------------------------------------------------------------

  function emptyNote(chart, text) {
    const box = el('div', 'empty');
    box.appendChild(el('p', null, text || 'No data in this range.'));
    chart.appendChild(box);
  }

  /** The plot's geometry: width from the page, the axis' slots and positions. */
  function frame(chart, plan, buckets, yLo, yHi, zeroBase) {
    const width = Math.max(300, Math.round(chart.clientWidth || 600));
    const height = width < 520 ? 220 : 280;
    const margin = { top: 12, right: 10, bottom: 28, left: 40 };
    let lo = yLo;
    let hi = yHi;
    if (zeroBase) {
      lo = Math.min(lo, 0);
      hi = Math.max(hi, 0);
    }
    if (!isFinite(lo) || !isFinite(hi)) {
      lo = 0;
      hi = 1;
    }
    const plotH = height - margin.top - margin.bottom;
    const ticks = niceTicks(lo, hi, plotH < 200 ? 4 : 5);
    const step = ticks.length > 1 ? ticks[1] - ticks[0] : 1;
    const longest = Math.max.apply(null, ticks.map(function (v) {
      return formatTick(v, step).length;
    }));
    margin.left = Math.max(30, Math.ceil(12 + 6.5 * longest));
    const plotW = width - margin.left - margin.right;
    const g = {
      width: width, height: height, margin: margin, plotW: plotW, plotH: plotH, ticks: ticks,
      y0: ticks[0], y1: ticks[ticks.length - 1], step: step,
    };
    g.y = function (v) { return margin.top + plotH - (v - g.y0) / (g.y1 - g.y0) * plotH; };
    if (plan.axis === 'hours') {
      let t0 = plan.t0;
      let t1 = plan.t1;
      const starts = buckets.map(function (b) { return instant(b.start); });
      if (t0 === null || t1 === null) {
        // a range of dates read per hour: from the first date's local midnight, in the
        // offset the server wrote for its first hour, to the end of the last date (``to``)
        const first = buckets.length ? splitLocal(buckets[0].local) : null;
        const last = buckets.length ? splitLocal(buckets[buckets.length - 1].local) : null;
        t0 = plan.from && first ? dayNumber(plan.from) * DAY_MS - first.offsetMs
          : Math.min.apply(null, starts);
        t1 = plan.to && last ? dayNumber(addDays(plan.to, 1)) * DAY_MS - last.offsetMs
          : Math.max.apply(null, starts) + HOUR;
        t0 = Math.min(t0, Math.min.apply(null, starts));
        t1 = Math.max(t1, Math.max.apply(null, starts) + HOUR);
      }
      g.t0 = t0;
      g.t1 = t1;
      g.count = Math.max(1, Math.round((t1 - t0) / HOUR));
      g.pos = function (b) { return (instant(b.start) - t0) / HOUR; };
    } else {
      let slots = plan.slots;
      if (!slots) {
        const dates = buckets.map(function (b) { return b.date; }).filter(isDate).sort();
        slots = dates.length ? dateSlots(dates[0], addDays(dates[dates.length - 1], 1),
          plan.bucket) : [];
      }
      const index = {};
      slots.forEach(function (d, i) { index[d] = i; });
      g.slots = slots;
      g.count = Math.max(1, slots.length);
      g.pos = function (b) { return b.date in index ? index[b.date] : null; };
    }
    g.slotW = plotW / g.count;
    g.x = function (pos) { return margin.left + (pos + 0.5) * g.slotW; };
    return g;
  }

  function drawGrid(root, g, plan, buckets) {
    const grid = svg('g', { class: 'grid' });
    g.ticks.forEach(function (v) {
      grid.appendChild(svg('line', {
        x1: g.margin.left, x2: g.width - g.margin.right, y1: g.y(v), y2: g.y(v),
      }));
      const label = svg('text', { x: g.margin.left - 6, y: g.y(v) + 4, class: 'ylabel' },
        formatTick(v, g.step));
      label.setAttribute('data-value', String(v));
      grid.appendChild(label);
    });
    const room = Math.floor(g.plotW / 64);
    const narrow = Math.floor(g.plotW / 30); // two-line labels: "Wed" over "14"
    const edge = function (x) {
      return Math.min(g.width - g.margin.right - 14, Math.max(g.margin.left + 14, x));
    };
    if (plan.axis === 'hours') {
      hourTicks(g.t0, g.t1, buckets, room).forEach(function (tick) {
        const x = g.margin.left + (tick.t - g.t0) / HOUR * g.slotW;
        grid.appendChild(svg('line', {
          x1: x, x2: x, y1: g.margin.top, y2: g.margin.top + g.plotH,
          class: tick.major ? 'major' : null,
        }));
        grid.appendChild(svg('text', { x: edge(x), y: g.height - 8, class: 'xlabel' }, tick.label));
      });
    } else {
      dateTicks(g.slots, plan.bucket, room, narrow).forEach(function (tick) {
        // a day's label sits under its bar; a week's or a month's at the slot it starts
        const edge0 = g.margin.left + tick.index * g.slotW;
        const x = plan.bucket === 'day' ? g.x(tick.index) : edge0;
        if (plan.bucket !== 'day' || tick.major) {
          grid.appendChild(svg('line', {
            x1: edge0, x2: edge0, y1: g.margin.top, y2: g.margin.top + g.plotH,
            class: tick.major ? 'major' : null,
          }));
        }
        let text;
        if (tick.lines) {
          text = svg('text', { x: edge(x), y: g.height - 17, class: 'xlabel' });
          tick.lines.forEach(function (line, k) {
            text.appendChild(svg('tspan', { x: edge(x), y: g.height - 17 + 12 * k }, line));
          });
        } else {
          text = svg('text', { x: edge(x), y: g.height - 8, class: 'xlabel' }, tick.label);
        }
        text.setAttribute('data-date', tick.date);
        grid.appendChild(text);
      });
    }
    root.appendChild(grid);
  }

  function svgRoot(g, label) {
    return svg('svg', {
      viewBox: '0 0 ' + g.width + ' ' + g.height, width: '100%', role: 'img',
      preserveAspectRatio: 'xMidYMid meet', 'aria-label': label,
    });
  }

  /** Hover, tap and keyboard: the bucket under the pointer writes its readout. */
  function wireReadout(root, g, marks, summary) {
    const readout = $('readout');
    readout.textContent = summary;
    const cursor = svg('line', {
      class: 'cursor', x1: 0, x2: 0, y1: g.margin.top, y2: g.margin.top + g.plotH,
      visibility: 'hidden',
    });
    root.appendChild(cursor);
    const show = function (mark) {
      readout.textContent = mark.text;
      cursor.setAttribute('x1', mark.x);
      cursor.setAttribute('x2', mark.x);
      cursor.setAttribute('visibility', 'visible');
      marks.forEach(function (m) { m.node.classList.toggle('on', m === mark); });
    };
    const at = function (event) {
      const box = root.getBoundingClientRect();
      if (!box.width || !marks.length) return;
      const px = (event.clientX - box.left) * g.width / box.width;
      let best = null;
      marks.forEach(function (m) {
        if (best === null || Math.abs(m.x - px) < Math.abs(best.x - px)) best = m;
      });
      if (best && Math.abs(best.x - px) <= Math.max(g.slotW, 12)) show(best);
    };
    root.addEventListener('pointermove', at);
    root.addEventListener('click', at);
    root.addEventListener('pointerleave', function () {
      cursor.setAttribute('visibility', 'hidden');
    });
    marks.forEach(function (m) {
      m.node.addEventListener('focus', function () { show(m); });
    });
  }

  function whenText(plan, bucket) {
    if (plan.bucket === 'hour') {
      const p = splitLocal(bucket.local);
      if (!p) return bucket.local;
      return formatDate(p.date) + ', ' + p.time + '–' + pad((p.hour + 1) % 24) + ':' +
        pad(p.minute) + ' (UTC' + p.offset + ')';
    }
    return (plan.bucket === 'week' ? 'Week of ' : '') + formatDate(bucket.date);
  }

  function markOf(node, g, pos, text) {
    node.setAttribute('tabindex', '0');
    node.appendChild(svg('title', {}, text));
    return { node: node, x: g.x(pos), text: text };
  }

  function drawSeries(chart, view) {
    const runs = ((view.data && view.data.runs) || []).filter(function (r) {
      return r.buckets && r.buckets.length;
    });
    if (!runs.length) {
      emptyNote(chart);
      $('readout').textContent = '';
      return;
    }
    // One panel per units: kcal and kJ never share an axis.
    const byUnits = [];
    runs.forEach(function (run) {
      const key = run.units === null || run.units === undefined ? '' : String(run.units);
      let group = byUnits.find(function (u) { return u.units === key; });
      if (!group) {
        byUnits.push(group = {
          units: key, label: typeof run.unit_label === 'string' ? run.unit_label : key,
          buckets: [],
        });
      }
      run.buckets.forEach(function (b) { group.buckets.push(b); });
    });
    const summaries = [];
    byUnits.forEach(function (group) {
      summaries.push(drawSeriesPanel(chart, view, group, byUnits.length > 1));
    });
    $('readout').textContent = summaries.join(' · ');
    chart.dataset.summary = summaries.join(' · ');
  }

  function drawSeriesPanel(chart, view, group, several) {
    const meaning = view.metric.meaning;
    const plan = view.plan;
    const total = meaning.kind === 'total';
    const combine = meaning.combine;
    const buckets = group.buckets.slice().sort(function (a, b) {
      return instant(a.start) - instant(b.start);
    });
    const fields = seriesFields(meaning, buckets);
    // the band: the fields the meaning names as each point's lowest and highest (``bounds``)
    const bounds = meaning.bounds || [];
    const band = !total && bounds.length === 2 && bounds.every(function (f) {
      return fields.indexOf(f) >= 0;
    });
    const lines = band ? fields.filter(function (f) { return bounds.indexOf(f) < 0; })
      : fields;
    const drawn = total ? fields : lines;
    const fieldName = function (f) { return words((meaning.labels || {})[f] || f); };
    const units = group.units;
    const shown = unitText(group.label); // " bpm", " steps", or "" (BMI: its name says it)
    const digits = meaning.digits;
    const fmt = function (v) { return formatValue(v, digits); };

    // values per bucket
    let lo = Infinity;
    let hi = -Infinity;
    const rows = buckets.map(function (b) {
      const values = {};
      drawn.forEach(function (f) { values[f] = bucketValue(b, f, combine); });
      let value = drawn.length ? values[drawn[0]] : null;
      if (total) {
        value = null;
        drawn.forEach(function (f) {
          if (values[f] !== null) value = (value || 0) + values[f];
        });
      }
      const row = { b: b, values: values, value: value, lo: null, hi: null };
      if (band) {
        const low = b.fields[bounds[0]];
        const high = b.fields[bounds[1]];
        row.lo = low && isNumber(low.min) ? low.min : null;
        row.hi = high && isNumber(high.max) ? high.max : null;
      }
      [row.value, row.lo, row.hi].concat(total ? [] : drawn.map(function (f) {
        return values[f];
      })).forEach(function (v) {
        if (typeof v === 'number' && isFinite(v)) {
          lo = Math.min(lo, v);
          hi = Math.max(hi, v);
        }
      });
      return row;
    });

    const panel = el('div', 'chart-panel');
    panel.dataset.units = units;
    const head = el('div', 'chart-head');
    head.appendChild(el('span', 'units', group.label || (units ? '' : 'no units')));
    if (several) head.appendChild(el('span', 'note', 'the units changed in this range'));
    const legend = el('span', 'legend');
    const legendItem = function (cls, text) {
      const item = el('span', 'legend-item');
      item.appendChild(el('span', 'swatch ' + cls));
      item.appendChild(document.createTextNode(text));
      legend.appendChild(item);
    };
    // a series of its main field alone is named by the metric; several fields by theirs
    drawn.forEach(function (f, i) {
      legendItem((total ? 'bar-swatch' : 's' + (i % 6)) + (total && i ? ' s' + (i % 6) : ''),
        (drawn.length > 1 || f !== (meaning.fields || [])[0] ? fieldName(f) + ', ' : '') +
        (total ? 'total per ' + plan.bucket : 'average per ' + plan.bucket));
    });
    if (band) legendItem('band-swatch', 'lowest – highest');
    head.appendChild(legend);
    panel.appendChild(head);
    chart.appendChild(panel);

    const g = frame(chart, plan, buckets, lo, hi, total);
    const root = svgRoot(g, meaning.name + (group.label ? ' in ' + group.label : ''));
    drawGrid(root, g, plan, buckets);
    const data = svg('g', { class: 'data' });
    const marks = [];
    const placed = rows.map(function (r) { return Object.assign({ pos: g.pos(r.b) }, r); })
      .filter(function (r) { return r.pos !== null; });

    if (band) {
      segmentsOf(placed.filter(function (r) {
        return typeof r.lo === 'number' && typeof r.hi === 'number';
      })).forEach(function (seg) {
        if (seg.length === 1) {
          const w = Math.max(3, Math.min(10, g.slotW * 0.5));
          data.appendChild(svg('rect', {
            class: 'band', x: (g.x(seg[0].pos) - w / 2).toFixed(1), y: g.y(seg[0].hi).toFixed(1),
            width: w.toFixed(1), height: Math.max(1, g.y(seg[0].lo) - g.y(seg[0].hi)).toFixed(1),
          }));
          return;
        }
        const top = seg.map(function (r, i) {
          return (i ? 'L' : 'M') + g.x(r.pos).toFixed(1) + ' ' + g.y(r.hi).toFixed(1);
        });
        const bottom = seg.slice().reverse().map(function (r) {
          return 'L' + g.x(r.pos).toFixed(1) + ' ' + g.y(r.lo).toFixed(1);
        });
        data.appendChild(svg('path', { class: 'band', d: top.concat(bottom).join(' ') + ' Z' }));
      });
    }
    if (!total) {
      lines.forEach(function (f, i) {
        const pts = placed.filter(function (r) { return r.values[f] !== null; });
        const d = segmentsOf(pts).filter(function (seg) { return seg.length > 1; })
          .map(function (seg) {
            return seg.map(function (r, k) {
              return (k ? 'L' : 'M') + g.x(r.pos).toFixed(1) + ' ' + g.y(r.values[f]).toFixed(1);
            }).join(' ');
          }).join(' ');
        if (d) {
          const path = svg('path', { class: 'series s' + (i % 6), d: d });
          path.dataset.field = f;
          data.appendChild(path);
        }
      });
    }
    const barW = Math.max(1, Math.min(g.slotW * 0.75, 48));
    placed.forEach(function (r) {
      const b = r.b;
      if (r.value === null && !drawn.some(function (f) { return r.values[f] !== null; })) return;
      const node = svg('g', { class: 'bucket' });
      setData(node, {
        date: b.date, local: b.local, start: b.start, count: b.count, value: r.value,
        min: r.lo, max: r.hi, units: units,
      });
      const x = g.x(r.pos);
      let text = whenText(plan, b) + ': ';
      if (total) {
        let base = 0;
        drawn.forEach(function (f, i) {
          const v = r.values[f];
          if (v === null) return;
          const top = g.y(base + v);
          const rect = svg('rect', {
            class: 'bar' + (i ? ' s' + (i % 6) : ''), x: (x - barW / 2).toFixed(1),
            y: Math.min(top, g.y(base) - 1).toFixed(1), width: barW.toFixed(1),
            height: Math.max(1, g.y(base) - top).toFixed(1),
          });
          rect.dataset.field = f;
          rect.dataset.value = String(v);
          node.appendChild(rect);
          base += v;
        });
        text += fmt(r.value) + shown;
        if (drawn.length > 1) {
          text += ' (' + drawn.filter(function (f) { return r.values[f] !== null; })
            .map(function (f) { return fieldName(f) + ' ' + fmt(r.values[f]); })
            .join(', ') + ')';
        }
      } else {
        const isolated = !placed.some(function (o) {
          return o !== r && Math.abs(o.pos - r.pos) <= 1.5;
        });
        drawn.forEach(function (f, i) {
          const v = r.values[f];
          if (v === null) return;
          const dot = svg('circle', {
            class: 'pt s' + (i % 6) + (isolated ? ' lone' : ''), cx: x.toFixed(1),
            cy: g.y(v).toFixed(1), r: isolated ? 4 : placed.length > 120 ? 1.5 : 2.5,
          });
          dot.dataset.field = f;
          dot.dataset.value = String(v);
          node.appendChild(dot);
        });
        text += drawn.filter(function (f) { return r.values[f] !== null; }).map(function (f) {
          return (drawn.length > 1 ? fieldName(f) + ' ' : '') + fmt(r.values[f]) + shown;
        }).join(', ');
        if (band && r.lo !== null && r.hi !== null) {
          text += ' (lowest ' + fmt(r.lo) + ', highest ' + fmt(r.hi) + ')';
        }
      }
      text += ' · ' + formatCount(b.count) + (b.count === 1 ? ' point' : ' points');
      node.appendChild(svg('rect', {
        class: 'hit', x: (x - g.slotW / 2).toFixed(1), y: g.margin.top, width: g.slotW.toFixed(2),
        height: g.plotH,
      }));
      data.appendChild(node);
      marks.push(markOf(node, g, r.pos, text));
    });
    root.appendChild(data);
    panel.appendChild(root);

    // the range at a glance
    let summary;
    const withValue = placed.filter(function (r) { return r.value !== null; });
    const per = plan.bucket === 'hour' ? 'an hour' : plan.bucket === 'week' ? 'a week' : 'a day';
    if (total) {
      let sum = 0;
      withValue.forEach(function (r) { sum += r.value; });
      summary = 'Total ' + fmt(sum) + shown + ' · ' +
        fmt(withValue.length ? sum / withValue.length : NaN) + ' ' + per +
        ' on average (' + withValue.length + ' with data)';
    } else {
      let n = 0;
      let s = 0;
      let low = Infinity;
      let high = -Infinity;
      placed.forEach(function (r) {
        const main = r.b.fields && r.b.fields[drawn[0]];
        if (main && typeof main.sum === 'number') {
          n += main.count;
          s += main.sum;
        }
        const l = r.lo !== null ? r.lo : main && main.min;
        const h = r.hi !== null ? r.hi : main && main.max;
        if (typeof l === 'number') low = Math.min(low, l);
        if (typeof h === 'number') high = Math.max(high, h);
      });
      summary = 'Average ' + fmt(n ? s / n : NaN) + shown +
        ' · lowest ' + fmt(low) + ' · highest ' + fmt(high);
    }
    wireReadout(root, g, marks, summary);
    return summary;
  }

  /** The sleep meaning's stages in their order: the reply's, else the catalog's. */
  function stageOrder(view) {
    return (view.data && view.data.stage_order) || view.metric.meaning.stages || [];
  }

  /** How a person reads the meaning's field number ``i`` (0: the main one). */
  function fieldLabel(meaning, i) {
    const field = (meaning.fields || [])[i];
    return (meaning.labels && meaning.labels[field]) || field || '';
  }

  /** The meaning's fields with their labels, as the summary's sleep card carries them. */
  function sleepFields(meaning) {
    return (meaning.fields || []).map(function (field, i) {
      return { field: field, label: fieldLabel(meaning, i) };
    });
  }

  function drawNights(chart, view) {
    const plan = view.plan;
    const meaning = view.metric.meaning;
    const order = stageOrder(view);
    const nights = (view.data && view.data.nights) || [];
    if (!nights.length) {
      emptyNote(chart, 'No nights in this range.');
      $('readout').textContent = '';
      return;
    }
    const bars = nights.map(function (n) { return { n: n, bar: nightBar(n, order) }; });
    let hi = 0;
    bars.forEach(function (b) { hi = Math.max(hi, b.bar.top, b.bar.inBed || 0); });
    const panel = el('div', 'chart-panel');
    const head = el('div', 'chart-head');
    head.appendChild(el('span', 'units', 'hours per night' + (plan.bucket === 'week'
      ? ' (the average night of each week)' : ', on the morning it ended')));
    const legend = el('span', 'legend');
    const seen = [];
    bars.forEach(function (b) {
      b.bar.parts.forEach(function (p) { if (seen.indexOf(p.stage) < 0) seen.push(p.stage); });
    });
    seen.forEach(function (s) {
      const item = el('span', 'legend-item');
      item.appendChild(el('span', 'swatch stage-' + s));
      item.appendChild(document.createTextNode(stageOf(s, order).label));
      legend.appendChild(item);
    });
    if (bars.some(function (b) { return b.bar.inBed !== null; })) {
      const item = el('span', 'legend-item');
      item.appendChild(el('span', 'swatch stage-inbed'));
      item.appendChild(document.createTextNode(fieldLabel(meaning, 1)));
      legend.appendChild(item);
    }
    head.appendChild(legend);
    panel.appendChild(head);
    chart.appendChild(panel);
    const g = frame(chart, plan, nights, 0, hi, true);
    const root = svgRoot(g, meaning.name + ' per night in hours');
    drawGrid(root, g, plan, nights);
    const data = svg('g', { class: 'data' });
    const marks = [];
    const barW = Math.max(2, Math.min(g.slotW * 0.7, 44));
    bars.forEach(function (item) {
      const n = item.n;
      const bar = item.bar;
      const pos = g.pos(n);
      if (pos === null) return;
      const x = g.x(pos);
      const node = svg('g', { class: 'bucket night' });
      setData(node, {
        date: n.date, local: n.local, start: n.start, asleep: bar.asleep, inBed: bar.inBed,
        nights: n.nights, form: n.form, sleepStart: n.sleep_start, sleepEnd: n.sleep_end,
        value: bar.asleep, overlapping: n.overlapping, naps: (n.naps || []).length,
      });
      if (bar.inBed !== null) {
        node.appendChild(svg('rect', {
          class: 'stage stage-inbed', x: (x - barW / 2 - 3).toFixed(1),
          y: g.y(bar.inBed).toFixed(1),
          width: (barW + 6).toFixed(1), height: Math.max(1, g.y(0) - g.y(bar.inBed)).toFixed(1),
        }));
      }
      let base = 0;
      bar.parts.forEach(function (p) {
        const rect = svg('rect', {
          class: 'stage stage-' + p.stage, x: (x - barW / 2).toFixed(1),
          y: g.y(base + p.hours).toFixed(1), width: barW.toFixed(1),
          height: Math.max(1, g.y(base) - g.y(base + p.hours)).toFixed(1),
        });
        rect.dataset.stage = p.stage;
        rect.dataset.hours = String(p.hours);
        node.appendChild(rect);
        base += p.hours;
      });
      const parts = [];
      if (n.nights) {
        parts.push(fieldLabel(meaning, 0) + ' ' +
          (bar.asleep !== null ? formatHours(bar.asleep) : '–'));
      }
      if (bar.inBed !== null) parts.push(fieldLabel(meaning, 1) + ' ' + formatHours(bar.inBed));
      const stages = stagesOf(n.stages, order);
      if (stages.length) {
        parts.push(stages.map(function (k) {
          return stageOf(k, order).label + ' ' + formatHours(n.stages[k]);
        }).join(', '));
      }
      if (plan.bucket !== 'week' && !n.nights) parts.unshift('no night, naps only');
      else if (plan.bucket !== 'week') parts.push(bedWords(n));
      if (plan.bucket === 'week') parts.push(n.nights + (n.nights === 1 ? ' night' : ' nights'));
      if (n.overlapping) {
        parts.push(plan.bucket === 'week' ? n.overlapping + ' with overlapping sources'
          : overlapWords(n, order, sleepFields(meaning)));
      }
      (n.naps || []).forEach(function (nap) {
        parts.push('nap ' + napTimes(nap) + ' ' +
          (typeof nap.asleep === 'number' ? formatHours(nap.asleep) : '–') + ', not counted');
      });
      const text = (plan.bucket === 'week' ? 'Week of ' + formatDate(n.date) + ', average night'
        : 'Night to ' + formatDate(n.date)) + ': ' + parts.join(' · ');
      node.appendChild(svg('rect', {
        class: 'hit', x: (x - g.slotW / 2).toFixed(1), y: g.margin.top, width: g.slotW.toFixed(2),
        height: g.plotH,
      }));
      data.appendChild(node);
      marks.push(markOf(node, g, pos, text));
    });
    root.appendChild(data);
    panel.appendChild(root);
    // the mean of the range's nights, as the server counts it (never a mean of weeks)
    const average = (view.data && view.data.average) || {};
    const count = average.nights || 0;
    const summary = (plan.bucket === 'week' ? nights.length + ' weeks, ' : '') + count +
      (count === 1 ? ' night' : ' nights') + ' · ' + fieldLabel(meaning, 0) + ' ' +
      formatHours(isNumber(average.asleep) ? average.asleep : NaN) + ' a night on average';
    wireReadout(root, g, marks, summary);
  }

  /** Workout minutes per day or week (its Monday), as /api/workouts counts them for the
   *  plan's bucket (a workout two apps recorded once). */
  function drawWorkoutMinutes(chart, view) {
    const plan = view.plan;
    const buckets = view.buckets.map(function (b) {
      return { date: b.date, minutes: b.seconds / 60, count: b.count };
    });
    if (!buckets.length) {
      emptyNote(chart, 'No workouts in this range.');
      $('readout').textContent = '';
      return;
    }
    let hi = 0;
    buckets.forEach(function (b) { hi = Math.max(hi, b.minutes); });
    const panel = el('div', 'chart-panel');
    const head = el('div', 'chart-head');
    head.appendChild(el('span', 'units', 'workout minutes per ' + plan.bucket));
    panel.appendChild(head);
    chart.appendChild(panel);
    const g = frame(chart, plan, buckets, 0, hi, true);
    const root = svgRoot(g, 'Workout minutes per ' + plan.bucket);
    drawGrid(root, g, plan, buckets);
    const data = svg('g', { class: 'data' });
    const marks = [];
    const barW = Math.max(2, Math.min(g.slotW * 0.7, 44));
    buckets.forEach(function (b) {
      const pos = g.pos(b);
      if (pos === null) return;
      const x = g.x(pos);
      const node = svg('g', { class: 'bucket' });
      setData(node, { date: b.date, value: b.minutes, count: b.count, units: 'min' });
      const top = g.y(b.minutes);
      node.appendChild(svg('rect', {
        class: 'bar', x: (x - barW / 2).toFixed(1), y: Math.min(top, g.y(0) - 1).toFixed(1),
        width: barW.toFixed(1), height: Math.max(1, g.y(0) - top).toFixed(1),
      }));
      node.appendChild(svg('rect', {
        class: 'hit', x: (x - g.slotW / 2).toFixed(1), y: g.margin.top, width: g.slotW.toFixed(2),
        height: g.plotH,
      }));
      data.appendChild(node);
      marks.push(markOf(node, g, pos, whenText(plan, b) + ': ' +
        formatSeconds(b.minutes * 60) +
        ' of workouts (' + b.count + (b.count === 1 ? ' workout)' : ' workouts)')));
    });
    root.appendChild(data);
    panel.appendChild(root);
    let minutes = 0;
    let count = 0;
    buckets.forEach(function (b) { minutes += b.minutes; count += b.count; });
    wireReadout(root, g, marks, count + (count === 1 ? ' workout' : ' workouts') +
      ' · ' + formatSeconds(minutes * 60) + ' in all');
  }

  // ---------------------------------------------------------------------------------
  // Lists: workouts, ECG recordings, events
  // ---------------------------------------------------------------------------------

  function addField(list, label, value) {
    const item = el('div', 'rec-field');
    item.appendChild(el('dt', null, label));
    item.appendChild(el('dd', null, value));
    list.appendChild(item);
  }

  /** The workouts of the range, each opening its own page; one recorded twice is listed
   *  once, as the one the server shows first, the other named on it. */
  function drawWorkoutList(box, items) {
    if (!items.length) return;
    const list = el('ol', 'record-list workouts');
    items.forEach(function (w) {
      if (w.duplicate_of) return;
      const li = el('li', 'record workout');
      setData(li, {
        id: w.id, date: w.date, local: w.local_start, start: w.start, durationS: w.duration_s,
        energy: w.energy ? w.energy.qty : null, energyUnits: w.energy ? w.energy.units : null,
        distance: w.distance ? w.distance.qty : null,
        distanceUnits: w.distance ? w.distance.units : null, version: w.version,
        route: w.has_route ? w.route_points : null, duplicates: w.duplicates.length || null,
      });
      const pick = el('a', 'rec-pick');
      pick.href = workoutHash(w.id);
      const head = el('span', 'rec-head');
      head.appendChild(el('span', 'rec-name', w.name || 'Workout'));
      head.appendChild(el('span', 'rec-when', formatLocal(w.local_start)));
      pick.appendChild(head);
      const dl = el('dl', 'rec-fields');
      addField(dl, 'Duration', formatSeconds(w.duration_s));
      addField(dl, 'Energy', quantityText(w.energy));
      addField(dl, 'Distance', quantityText(w.distance));
      if (w.average_heart_rate) addField(dl, 'Heart rate', quantityText(w.average_heart_rate));
      if (w.location) addField(dl, 'Where', w.location);
      if (w.has_route) addField(dl, 'Route', formatCount(w.route_points) + ' points');
      pick.appendChild(dl);
      li.appendChild(pick);
      w.duplicates.forEach(function (d) {
        const also = el('p', 'rec-also');
        also.appendChild(document.createTextNode('Also recorded: '));
        const a = el('a', null, (d.name || 'Workout') + (d.source ? ' (' + d.source + ')' : ''));
        a.href = workoutHash(d.id);
        also.appendChild(a);
        li.appendChild(also);
      });
      list.appendChild(li);
    });
    if (state.shown && state.shown.truncated) {
      box.appendChild(el('p', 'meta', 'The newest workouts of the range; choose a shorter' +
        ' range for the others.'));
    }
    box.appendChild(list);
  }

  function moreButton(view, render) {
    const button = $('records-more');
    button.hidden = !view.next;
    state.more = !view.next ? null : async function () {
      const token = state.token;
      button.disabled = true;
      try {
        const page = await getJSON(query('/api/records', Object.assign({
          before: view.next,
        }, view.params)), state.controller ? state.controller.signal : undefined);
        if (token !== state.token) return;
        view.items = view.items.concat(page.items || []);
        view.next = page.next_before;
        render(page.items || []);
        button.hidden = !view.next;
      } catch (err) {
        if (err && err.name === 'AbortError') return;
        showMessage('Could not load more: ' + err.message);
      } finally {
        button.disabled = false;
      }
    };
  }

  function drawEcgList(box, view) {
    const chart = $('chart');
    if (!view.items.length) {
      emptyNote(chart, 'No ECG recordings in this range.');
      return;
    }
    const list = el('ol', 'record-list ecgs');
    box.appendChild(list);
    const render = function (items) {
      items.forEach(function (r) {
        const li = el('li', 'record ecg');
        setData(li, {
          date: r.date, local: r.local_start, start: r.start, samples: r.samples,
          frequency: r.sampling_frequency, classification: r.classification,
        });
        const pick = el('button', 'rec-pick');
        pick.type = 'button';
        const head = el('span', 'rec-head');
        head.appendChild(el('span', 'rec-name', r.classification ? words(r.classification)
          .replace(/^./, function (c) { return c.toUpperCase(); }) : 'ECG'));
        head.appendChild(el('span', 'rec-when', formatLocal(r.local_start)));
        pick.appendChild(head);
        const dl = el('dl', 'rec-fields');
        addField(dl, 'Average heart rate', detailText(r.average_heart_rate));
        addField(dl, 'Samples', formatCount(r.samples));
        addField(dl, 'Sampling', r.sampling_frequency
          ? formatNumber(r.sampling_frequency, 1) + ' Hz' : '–');
        pick.appendChild(dl);
        pick.addEventListener('click', function () {
          state.ecg = r.start;
          writeHash();
          const token = state.token;
          showTrace(view, token, state.controller ? state.controller.signal : undefined)
            .catch(function (err) {
              if (!(err && err.name === 'AbortError')) showMessage('ECG: ' + err.message);
            });
        });
        li.appendChild(pick);
        list.appendChild(li);
      });
      markEcg();
    };
    render(view.items);
    moreButton(view, render);
  }

  function markEcg() {
    Array.prototype.forEach.call(document.querySelectorAll('#records li.ecg'), function (li) {
      const on = li.dataset.start === state.ecg;
      li.classList.toggle('active', on);
      li.querySelector('button').setAttribute('aria-pressed', on ? 'true' : 'false');
    });
  }

  async function showTrace(view, token, signal) {
    if (!view.items.length) return;
    const chosen = view.items.find(function (r) { return r.start === state.ecg; }) || view.items[0];
    state.ecg = chosen.start;
    writeHash();
    markEcg();
    const chart = $('chart');
    chart.dataset.state = 'loading';
    const trace = await getJSON(query('/api/ecg', { start: chosen.start, tz: state.tz }), signal);
    if (token !== state.token) return;
    view.trace = trace;
    clear(chart);
    drawTrace(chart, trace);
    chart.dataset.state = 'ready';
  }

  /** The trace: µV against time at the recording's sampling frequency, in strips of 10 s
   *  (as a paper ECG is read), one polyline point per sample; each strip has its amplitude
   *  axis (round µV ticks within the recording's lowest and highest voltage) beside its
   *  time axis. */
  function drawTrace(chart, trace) {
    const volts = trace.voltages || [];
    const hz = trace.sampling_frequency;
    const units = trace.unit_label || trace.units || '';
    const head = el('div', 'chart-head');
    head.appendChild(el('span', 'units', units + ' against seconds'));
    head.appendChild(el('span', null, formatLocal(trace.local_start) + ' · ' +
      (trace.classification ? words(trace.classification) : 'no classification') +
      ' · average heart rate ' + detailText(trace.average_heart_rate)));
    chart.appendChild(head);
    if (!volts.length || !(hz > 0)) {
      emptyNote(chart, 'This recording holds no samples.');
      return;
    }
    const strip = 10;
    const seconds = volts.length / hz;
    const strips = Math.max(1, Math.ceil(seconds / strip - 1e-9));
    const width = Math.max(300, Math.round(chart.clientWidth || 600));
    const rowH = width < 520 ? 90 : 130;
    const margin = { top: 18, right: 8, bottom: 18, left: 8 }; // top: the axis' units
    let lo = Infinity;
    let hi = -Infinity;
    volts.forEach(function (v) {
      lo = Math.min(lo, v);
      hi = Math.max(hi, v);
    });
    if (!(hi > lo)) {
      hi = lo + 1;
    }
    const all = niceTicks(lo, hi, rowH < 100 ? 3 : 4);
    const step = all.length > 1 ? all[1] - all[0] : 1;
    const ticks = all.filter(function (v) { return v >= lo - 1e-9 && v <= hi + 1e-9; });
    const longest = Math.max.apply(null, ticks.map(function (v) {
      return formatTick(v, step).length;
    }).concat([units.length]));
    margin.left = Math.max(30, Math.ceil(12 + 6.5 * longest));
    const height = strips * (rowH + margin.bottom) + margin.top;
    const root = svg('svg', {
      viewBox: '0 0 ' + width + ' ' + height, width: '100%', role: 'img', class: 'ecg-trace',
      'aria-label': 'ECG trace, ' + formatNumber(seconds, 1) + ' s',
    });
    setData(root, { samples: volts.length, frequency: hz, start: trace.start,
      seconds: seconds, min: lo, max: hi });
    const plotW = width - margin.left - margin.right;
    const yOf = function (top, v) { return top + rowH - (v - lo) / (hi - lo) * rowH; };
    for (let s = 0; s < strips; s++) {
      const top = margin.top + s * (rowH + margin.bottom);
      const grid = svg('g', { class: 'grid' });
      const axis = svg('g', { class: 'amplitude' });
      ticks.forEach(function (v) {
        const y = yOf(top, v);
        grid.appendChild(svg('line', { x1: margin.left, x2: width - margin.right, y1: y, y2: y,
          class: v === 0 ? 'major' : null }));
        const label = svg('text', { x: margin.left - 5, y: y + 4, class: 'ylabel' },
          formatTick(v, step));
        label.setAttribute('data-value', String(v));
        axis.appendChild(label);
      });
      if (s === 0) {
        // the axis' units, above its highest tick
        axis.appendChild(svg('text', { x: margin.left - 5, y: 10,
          class: 'ylabel amplitude-units' }, units));
      }
      grid.appendChild(axis);
      for (let k = 0; k <= strip; k++) {
        const x = margin.left + k / strip * plotW;
        grid.appendChild(svg('line', { x1: x, x2: x, y1: top, y2: top + rowH,
          class: k % 5 === 0 ? 'major' : null }));
        if (k % 5 === 0) {
          grid.appendChild(svg('text', { x: Math.min(width - 14, Math.max(14, x)),
            y: top + rowH + 13, class: 'xlabel' }, (s * strip + k) + ' s'));
        }
      }
      root.appendChild(grid);
      const first = Math.round(s * strip * hz);
      const last = Math.min(volts.length, Math.round((s + 1) * strip * hz));
      const points = [];
      for (let i = first; i < last; i++) {
        const x = margin.left + (i / hz - s * strip) / strip * plotW;
        const y = yOf(top, volts[i]);
        points.push(x.toFixed(2) + ',' + y.toFixed(1));
      }
      const line = svg('polyline', { class: 'trace', points: points.join(' ') });
      setData(line, { first: first, count: last - first });
      root.appendChild(line);
    }
    chart.appendChild(root);
    $('readout').textContent = formatCount(volts.length) + ' samples at ' + formatNumber(hz, 1) +
      ' Hz (' + formatNumber(seconds, 1) + ' s), ' + formatNumber(lo) + ' to ' +
      formatNumber(hi) + ' ' + units;
  }

  function drawEvents(box, view) {
    const meaning = view.metric.meaning;
    if (!view.items.length) {
      box.appendChild(el('p', 'empty', 'No ' + meaning.name.toLowerCase() + ' in this range.'));
      $('readout').textContent = '';
      return;
    }
    const timeline = el('div', 'timeline');
    box.appendChild(timeline);
    let day = null;
    let list = null;
    const render = function (items) {
      items.forEach(function (ev) {
        if (!day || day.dataset.date !== ev.date) {
          day = el('section', 'day');
          day.dataset.date = ev.date;
          day.appendChild(el('h3', null, isDate(ev.date) ? formatDate(ev.date) : ev.date));
          list = el('ol', 'record-list events');
          day.appendChild(list);
          timeline.appendChild(day);
        }
        const li = el('li', 'record event');
        setData(li, { date: ev.date, local: ev.local_start, start: ev.start });
        const p = splitLocal(ev.local_start);
        const time = el('time', 'rec-time', p ? p.time : ev.local_start);
        time.setAttribute('datetime', ev.local_start || '');
        li.appendChild(time);
        const dl = el('dl', 'rec-fields');
        const details = ev.details || {};
        const names = (meaning.fields || []).filter(function (f) { return f in details; })
          .concat(Object.keys(details).filter(function (f) {
            return (meaning.fields || []).indexOf(f) < 0;
          }));
        names.forEach(function (f) {
          const item = el('div', 'rec-field');
          item.dataset.field = f;
          item.appendChild(el('dt', null, capitalise(words(f))));
          item.appendChild(el('dd', null, detailText(details[f])));
          dl.appendChild(item);
        });
        if (!names.length) dl.appendChild(el('div', 'rec-field', 'recorded'));
        li.appendChild(dl);
        list.appendChild(li);
      });
      $('readout').textContent = view.items.length + (view.items.length === 1 ? ' entry'
        : ' entries') + (view.next ? ' so far (more below)' : '');
    };
    render(view.items);
    moreButton(view, render);
  }

  // ---------------------------------------------------------------------------------
  // The summary page: a day at a glance, each value against the person's own usual
  // ---------------------------------------------------------------------------------

  const SPARK_W = 210;
  const SPARK_H = 40;

  /** The metric view's address for a card's link {metric, from, to}: both dates are in
   *  the range, as the server writes them, and both are shown. */
  function linkHash(link, tz) {
    const params = new URLSearchParams();
    params.set('metric', link.metric);
    params.set('range', 'custom');
    params.set('from', link.from);
    params.set('to', link.to);
    params.set('tz', tz || 'local');
    return '#' + params.toString();
  }

  /** The summary's address: a chosen day (none: the day the server opens on) and a zone
   *  other than the phone's. */
  function summaryHash(date, tz) {
    const params = new URLSearchParams();
    params.set('view', 'summary');
    if (date) params.set('date', date);
    if (tz && tz !== 'local') params.set('tz', tz);
    return '#' + params.toString();
  }

  function isNumber(v) { return typeof v === 'number' && isFinite(v); }

  /** Where a sparkline's marks go: a slot per day of ``points`` ({date, value}); a day
   *  without a value has no mark (a gap, never 0) and a line breaks around it. ``bars``:
   *  the scale starts at 0 (totals, nights); otherwise it spans the values and the usual.
   *  Returns {marks: [{date, value, x, y, h}], segments: [[mark, …]] (two marks or more),
   *  slot, usualY}. Pure. */
  function sparkMarks(points, bars, usual, width, height) {
    const values = points.map(function (p) { return p.value; }).filter(isNumber);
    if (isNumber(usual)) values.push(usual);
    let lo = values.length ? Math.min.apply(null, values) : 0;
    let hi = values.length ? Math.max.apply(null, values) : 1;
    if (bars) lo = Math.min(0, lo);
    if (!(hi > lo)) {
      const room = Math.abs(hi) > 0 ? Math.abs(hi) * 0.1 : 1;
      if (!bars) lo -= room;
      hi += room;
    }
    const edge = 3;
    const slot = width / Math.max(1, points.length);
    const y = function (v) { return height - edge - (v - lo) / (hi - lo) * (height - 2 * edge); };
    const base = y(Math.max(lo, 0));
    const marks = [];
    const segments = [];
    let run = [];
    points.forEach(function (p, i) {
      if (!isNumber(p.value)) {
        if (run.length > 1) segments.push(run);
        run = [];
        return;
      }
      const mark = { date: p.date, value: p.value, x: (i + 0.5) * slot, y: y(p.value),
        h: Math.max(1, base - y(p.value)) };
      marks.push(mark);
      run.push(mark);
    });
    if (run.length > 1) segments.push(run);
    return {
      marks: marks, segments: segments, slot: slot, usualY: isNumber(usual) ? y(usual) : null,
    };
  }

  /** A 14-day sparkline: bars or a broken line, the usual as a dashed rule, the day shown
   *  marked; every mark carries its date and value. */
  function drawSpark(points, bars, usual, label, format, day) {
    const g = sparkMarks(points, bars, usual, SPARK_W, SPARK_H);
    const root = svg('svg', {
      class: 'spark ' + (bars ? 'spark-bars' : 'spark-lines'), role: 'img',
      viewBox: '0 0 ' + SPARK_W + ' ' + SPARK_H, width: '100%',
      'aria-label': label + ', ' + points.length + ' days: ' + g.marks.length + ' with data',
    });
    if (g.usualY !== null) {
      root.appendChild(svg('line', { class: 'spark-usual', x1: 0, x2: SPARK_W,
        y1: g.usualY.toFixed(1), y2: g.usualY.toFixed(1) }));
    }
    if (!bars) {
      g.segments.forEach(function (seg) {
        root.appendChild(svg('polyline', { class: 'spark-path', points: seg.map(function (m) {
          return m.x.toFixed(1) + ',' + m.y.toFixed(1);
        }).join(' ') }));
      });
    }
    const barW = Math.max(2, g.slot * 0.68);
    g.marks.forEach(function (m) {
      const today = m.date === day;
      const node = bars
        ? svg('rect', { x: (m.x - barW / 2).toFixed(1), y: (m.y).toFixed(1),
          width: barW.toFixed(1), height: m.h.toFixed(1) })
        : svg('circle', { cx: m.x.toFixed(1), cy: m.y.toFixed(1), r: today ? 3 : 1.8 });
      node.setAttribute('class', 'spark-mark' + (today ? ' spark-day' : ''));
      setData(node, { date: m.date, value: m.value });
      node.appendChild(svg('title', {}, formatDate(m.date, 'short') + ': ' + format(m.value)));
      root.appendChild(node);
    });
    return root;
  }

  function cardShell(cls, link, name) {
    const card = el(link ? 'a' : 'div', 'card ' + cls);
    if (link) card.href = linkHash(link, state.tz);
    card.appendChild(el('span', 'card-name', name));
    return card;
  }

  /** The day's value as a person reads it, or "no data" (never 0). */
  function valueNode(value, units, text) {
    const node = el('span', 'card-value');
    if (!isNumber(value)) {
      node.classList.add('no-data');
      node.textContent = 'no data';
      return node;
    }
    node.appendChild(el('span', 'num', text !== undefined ? text : formatNumber(value)));
    if (units) {
      node.appendChild(document.createTextNode(' '));
      node.appendChild(el('span', 'card-units', units));
    }
    return node;
  }

  function usualNode(usual, days, units, text, rule) {
    const node = el('span', 'card-usual');
    if (!isNumber(usual)) {
      node.classList.add('no-usual');
      node.textContent = 'no usual yet' + (rule && rule.min_days
        ? ' (' + (days || 0) + ' of the ' + rule.min_days + ' days it needs)' : '');
      return node;
    }
    node.appendChild(document.createTextNode('usual '));
    node.appendChild(el('span', 'num', text !== undefined ? text : formatNumber(usual)));
    if (units) node.appendChild(document.createTextNode(' ' + units));
    return node;
  }

  /** A card's units as the server shows them ("" for a count its name explains). */
  function cardUnits(card) {
    return typeof card.unit_label === 'string' ? card.unit_label : card.units || '';
  }

  function seriesCard(card, day, rule) {
    const units = cardUnits(card);
    const fmt = function (v) { return formatValue(v, card.digits); };
    const node = cardShell('series-card', card.link, card.name);
    setData(node, {
      metric: card.metric, kind: card.kind, units: card.units, date: day, value: card.value,
      usual: card.usual, usualDays: card.usual_days,
    });
    node.appendChild(valueNode(card.value, units, isNumber(card.value) ? fmt(card.value)
      : undefined));
    node.appendChild(usualNode(card.usual, card.usual_days, units, isNumber(card.usual)
      ? fmt(card.usual) : undefined, rule));
    node.appendChild(drawSpark(card.spark || [], card.kind === 'total', card.usual, card.name,
      function (v) { return fmt(v) + unitText(units); }, day));
    return node;
  }

  /** A nap beside a day's night: its times and hours, never added to the night. */
  function napNode(nap) {
    const node = el('p', 'card-note nap');
    setData(node, { field: 'nap', sleepStart: nap.sleep_start, sleepEnd: nap.sleep_end,
      asleep: nap.asleep });
    node.appendChild(document.createTextNode('Nap ' + napTimes(nap) + ' '));
    node.appendChild(el('span', 'num', isNumber(nap.asleep) ? formatHours(nap.asleep) : '–'));
    node.appendChild(document.createTextNode(' (not counted in the night)'));
    return node;
  }

  function sleepCard(card, day, rule) {
    const node = cardShell('sleep-card', card.link, 'Night to ' + formatDate(day, 'weekday') +
      ' ' + formatDate(day, 'short'));
    setData(node, {
      metric: card.metric, units: card.units, date: day, value: card.asleep,
      asleep: card.asleep, inBed: card.in_bed, usual: card.usual, usualDays: card.usual_days,
      sleepStart: card.sleep_start, sleepEnd: card.sleep_end,
    });
    // the card's fields, the main one first (hours asleep, in bed), as the meaning names them
    const fields = card.fields || [];
    const labelOf = function (i) { return fields[i] ? fields[i].label : ''; };
    node.appendChild(valueNode(card.asleep, labelOf(0), isNumber(card.asleep)
      ? formatHours(card.asleep) : undefined));
    const facts = el('span', 'card-facts');
    const fact = function (label, text, data) {
      const item = el('span', 'fact');
      setData(item, data);
      item.appendChild(document.createTextNode(label + ' '));
      item.appendChild(el('span', 'num', text));
      facts.appendChild(item);
    };
    if (isNumber(card.in_bed) && fields[1]) {
      fact(labelOf(1), formatHours(card.in_bed), { field: fields[1].field });
    }
    const start = splitLocal(card.sleep_start);
    const end = splitLocal(card.sleep_end);
    if (start) fact('bed', bedTime(card), { field: 'sleep_start', local: card.sleep_start });
    else if (end) {
      const unknown = el('span', 'fact', 'bedtime not known');
      unknown.dataset.field = 'sleep_start';
      facts.appendChild(unknown);
    }
    if (end) fact('wake', end.time, { field: 'sleep_end', local: card.sleep_end });
    if (facts.firstChild) node.appendChild(facts);
    if (!card.nights && (card.naps || []).length) {
      const none = el('p', 'card-note', 'No night ended on this day: naps only, never ' +
        'counted as a night.');
      none.dataset.field = 'no-night';
      node.appendChild(none);
    }
    if (card.overlapping) {
      const note = el('p', 'card-note', overlapWords(card, card.stage_order || [], fields));
      note.dataset.field = 'overlapping';
      node.appendChild(note);
    }
    (card.naps || []).forEach(function (nap) {
      node.appendChild(napNode(nap));
    });
    const order = card.stage_order || [];
    const stages = stagesOf(card.stages, order);
    if (stages.length) {
      const row = el('span', 'stages');
      stages.forEach(function (k) {
        const chip = el('span', 'stage-chip');
        setData(chip, { stage: k, hours: card.stages[k] });
        chip.appendChild(el('span', 'swatch stage-' + k.replace(/[^a-z]/g, '')));
        chip.appendChild(document.createTextNode(stageOf(k, order).label + ' '));
        chip.appendChild(el('span', 'num', formatHours(card.stages[k])));
        row.appendChild(chip);
      });
      node.appendChild(row);
    }
    node.appendChild(usualNode(card.usual, card.usual_days, labelOf(0), isNumber(card.usual)
      ? formatHours(card.usual) : undefined, rule));
    node.appendChild(drawSpark(card.spark || [], true, card.usual, 'Hours ' + labelOf(0),
      formatHours, day));
    return node;
  }

  function rangeCard(card, day) {
    const node = cardShell('range-card', card.link, card.name + ', lowest to highest');
    setData(node, {
      metric: card.metric, units: card.units, date: day, min: card.min, avg: card.avg,
      max: card.max, layer: card.layer,
    });
    const row = el('span', 'card-value range-value');
    [['min', 'lowest'], ['avg', 'average'], ['max', 'highest']].forEach(function (f) {
      const item = el('span', 'range-figure');
      item.dataset.field = f[0];
      if (isNumber(card[f[0]])) item.dataset.value = String(card[f[0]]);
      item.appendChild(el('span', 'num', formatValue(card[f[0]], card.digits)));
      item.appendChild(el('span', 'range-label', f[1]));
      row.appendChild(item);
    });
    node.appendChild(row);
    node.appendChild(el('span', 'card-usual', cardUnits(card)));
    return node;
  }

  function bodyCard(card) {
    const node = cardShell('body-card', card.link, card.name);
    const values = card.values || {};
    const fields = Object.keys(values).filter(function (f) { return isNumber(values[f]); });
    setData(node, { metric: card.metric, units: card.units, measured: card.measured,
      value: fields.length ? values[fields[0]] : null });
    const value = el('span', 'card-value');
    fields.forEach(function (f, i) {
      if (i) value.appendChild(el('span', 'sep', '/'));
      const n = el('span', 'num', formatValue(values[f], card.digits));
      setData(n, { field: f, value: values[f] });
      value.appendChild(n);
    });
    const units = cardUnits(card);
    if (!fields.length) {
      value.classList.add('no-data');
      value.textContent = 'no data';
    } else if (units) {
      value.appendChild(document.createTextNode(' '));
      value.appendChild(el('span', 'card-units', units));
    }
    node.appendChild(value);
    // a value for the whole day (a Days automation's, at local midnight): its date alone
    const p = splitLocal(card.measured);
    node.appendChild(el('span', 'card-usual measured', 'measured ' + (card.day_value && p
      ? formatDate(p.date) : formatLocal(card.measured))));
    return node;
  }

  /** The workouts of the week: ``group`` is the summary's entry for them (its title, the
   *  link to their view, {metric, from, to}, that the server made, and their ``count`` and
   *  ``seconds``). */
  function workoutsCard(items, day, group) {
    const link = group.link;
    // a card of links (each workout opens its page): the title links to the list
    const node = el('div', 'card workouts-card wide');
    const title = el('a', 'card-name', group.title + ', ' + formatDate(link.from, 'short') +
      ' – ' + formatDate(link.to, 'short'));
    title.href = linkHash(link, state.tz);
    node.appendChild(title);
    // their count and time as the server counts them (a workout two apps recorded once);
    // the list shows each once, the one the server shows first
    const shown = items.filter(function (w) { return !w.duplicate_of; });
    setData(node, { metric: link.metric, count: group.count, seconds: group.seconds,
      date: day });
    const value = el('span', 'card-value');
    value.appendChild(el('span', 'num', formatCount(group.count)));
    value.appendChild(document.createTextNode(' '));
    value.appendChild(el('span', 'card-units', 'workout' + (group.count === 1 ? '' : 's') +
      ', ' + formatSeconds(group.seconds)));
    node.appendChild(value);
    const list = el('ul', 'card-list');
    shown.forEach(function (w) {
      const li = el('li', 'workout-item');
      setData(li, {
        id: w.id, start: w.start, local: w.local_start, date: w.date, name: w.name,
        durationS: w.duration_s, energy: w.energy ? w.energy.qty : null,
        energyUnits: w.energy ? w.energy.units : null,
      });
      const p = splitLocal(w.local_start);
      const a = el('a', 'item-name', w.name || 'Workout');
      a.href = workoutHash(w.id);
      li.appendChild(a);
      li.appendChild(el('span', 'item-when', p ? formatDate(p.date, 'weekday') + ' ' +
        formatDate(p.date, 'short') + ', ' + p.time : w.local_start));
      li.appendChild(el('span', 'item-figure num', formatSeconds(w.duration_s)));
      li.appendChild(el('span', 'item-figure num', quantityText(w.energy)));
      if ((w.duplicates || []).length) {
        li.appendChild(el('span', 'item-also', 'also recorded by ' + w.duplicates.map(
          function (d) { return d.source || d.name || 'another app'; }).join(', ')));
      }
      list.appendChild(li);
    });
    node.appendChild(list);
    return node;
  }

  function otherCard(items, day) {
    const node = cardShell('other-card wide', null, formatDate(day));
    const list = el('ul', 'card-list');
    items.forEach(function (o) {
      const li = el('li', 'other-item');
      setData(li, { metric: o.metric, kind: o.kind, value: o.value, units: o.units });
      const a = el('a', 'item-name', o.name);
      a.href = linkHash(o.link, state.tz);
      li.appendChild(a);
      const text = o.kind === 'events'
        ? formatCount(o.value) + (o.value === 1 ? ' entry' : ' entries')
        : formatValue(o.value, o.digits) + unitText(cardUnits(o));
      li.appendChild(el('span', 'item-figure num', text));
      list.appendChild(li);
    });
    node.appendChild(list);
    return node;
  }

  /** The cards of the day; how many. ``wanted``: the day the address asked for (none: the
   *  server's newest, which has data unless the store is empty). */
  function drawCards(data, wanted) {
    const box = $('cards');
    clear(box);
    const cards = data.cards || {};
    const rule = data.usual || {};
    const day = data.date;
    let shown = 0;
    // the groups the server names, in its order, under its titles; each drawn as it says
    // (``render``), a group of cards each as its own ``render`` says
    const each = {
      series: function (card) { return seriesCard(card, day, rule); },
      range: function (card) { return rangeCard(card, day); },
      latest: function (card) { return bodyCard(card); },
    };
    (data.card_order || []).forEach(function (entry) {
      const found = cards[entry.group];
      const made = [];
      if (entry.render === 'night') {
        if (found) made.push(sleepCard(found, day, rule));
      } else if (entry.render === 'week') {
        if (found && found.length) made.push(workoutsCard(found, day, entry));
      } else if (entry.render === 'list') {
        if (found && found.length) made.push(otherCard(found, day));
      } else {
        (found || []).forEach(function (card) {
          if (each[card.render]) made.push(each[card.render](card));
        });
      }
      if (!made.length) return;
      const group = el('section', 'card-group');
      group.dataset.group = entry.group;
      group.appendChild(el('h3', null, entry.title));
      const grid = el('div', 'card-grid');
      made.forEach(function (node) { grid.appendChild(node); });
      group.appendChild(grid);
      box.appendChild(group);
      shown += made.length;
    });
    if (!shown) {
      box.appendChild(el('p', 'empty', wanted
        ? 'Nothing recorded on this day or the ' + rule.days + ' days before it.'
        : 'No data yet. Point a Health Auto Export automation at /api/ingest.'));
    }
    return shown;
  }

  function drawTrends(data) {
    const rule = data.trend_rule || {};
    const text = $('trend-rule');
    setData(text, {
      recentDays: rule.recent_days, baselineDays: rule.baseline_days,
      minRecentDays: rule.min_recent_days, minBaselineDays: rule.min_baseline_days,
    });
    text.textContent = 'Each trend compares the mean day value of the last ' +
      rule.recent_days + ' days with that of the ' + rule.baseline_days +
      ' days before, and is flagged when ' + rule.flagged_when + '; it needs at least ' +
      rule.min_recent_days + ' recent and ' + rule.min_baseline_days + ' earlier days with data.';
    const list = $('trends');
    clear(list);
    const trends = (data.trends || []).slice().sort(function (a, b) {
      return (b.flagged === true) - (a.flagged === true) || a.name.localeCompare(b.name);
    });
    if (!trends.length) {
      list.appendChild(el('li', 'empty', 'No metric has enough days for a trend yet.'));
      return;
    }
    trends.forEach(function (t) {
      const judged = t.better === true ? 'better' : t.better === false ? 'worse' : null;
      const li = el('li', 'trend' + (t.flagged ? ' flagged' : '') +
        (t.flagged && judged ? ' ' + judged : ''));
      setData(li, {
        metric: t.metric, units: t.units, recent: t.recent, baseline: t.baseline,
        baselineSd: t.baseline_sd, change: t.change, recentDays: t.recent_days,
        baselineDays: t.baseline_days, flagged: t.flagged ? 'true' : 'false',
        direction: t.direction || 'none', better: judged || 'none',
      });
      const head = el('div', 'trend-head');
      const name = el('a', 'trend-name', t.name);
      name.href = linkHash(t.link, state.tz);
      head.appendChild(name);
      const arrow = t.direction === 'up' ? '▲ up' : t.direction === 'down' ? '▼ down'
        : 'no change';
      head.appendChild(el('span', 'trend-direction', arrow + (judged ? ' (' + judged + ')' : '')));
      head.appendChild(el('span', 'trend-flag', t.flagged ? 'flagged'
        : 'within the usual spread'));
      li.appendChild(head);
      const figures = el('div', 'trend-figures');
      const figure = function (field, value, label) {
        const item = el('span', 'trend-figure');
        setData(item, { field: field, value: value });
        item.appendChild(el('span', 'num',
          formatValue(value, t.digits) + unitText(cardUnits(t))));
        item.appendChild(document.createTextNode(' ' + label));
        figures.appendChild(item);
      };
      figure('recent', t.recent, 'a day in the last ' + rule.recent_days + ' days (' +
        t.recent_days + ' with data)');
      figure('baseline', t.baseline, 'a day in the ' + rule.baseline_days + ' before (' +
        t.baseline_days + ' with data)');
      figure('baseline_sd', t.baseline_sd, 'their standard deviation');
      li.appendChild(figures);
      list.appendChild(li);
    });
  }

  function drawSummary(data, wanted) {
    const s = state.summary;
    $('summary-title').textContent = formatDate(data.date);
    const newest = s.newest[state.tz];
    drawAttention(data.attention);
    const shown = drawCards(data, wanted);
    $('summary-meta').textContent = capitalise(zoneText()) +
      (newest === data.date && shown ? ' · the latest day with data' : '');
    const rule = data.usual || {};
    const usual = $('usual-rule');
    setData(usual, { days: rule.days, minDays: rule.min_days });
    usual.textContent = 'Usual: the ' + rule.rule + ' of the ' + rule.days +
      ' days before, from at least ' + rule.min_days + ' days with data.';
    $('day-next').disabled = Boolean(newest) && data.date >= newest;
    $('day-latest').hidden = !wanted || data.date === newest;
    $('day-latest').href = summaryHash(null, state.tz);
    drawTrends(data);
  }

  async function showSummary(date) {
    const box = $('summary');
    const s = state.summary;
    const { controller, token } = newLoad(s);
    box.dataset.state = 'loading';
    box.setAttribute('aria-busy', 'true');
    $('nav-summary').href = summaryHash(date, state.tz);
    if (s.coverageTz !== state.tz || $('coverage').dataset.state !== 'ready') {
      s.coverageTz = state.tz;
      showCoverage();
    }
    try {
      const data = await getJSON(query('/api/summary', { date: date, tz: state.tz }),
        controller.signal);
      if (token !== s.token) return;
      if (!date) s.newest[state.tz] = data.date; // the day the server opens on
      s.date = data.date;
      drawSummary(data, date);
      setData(box, { date: data.date, tz: data.tz });
      box.removeAttribute('aria-busy');
      box.dataset.state = 'ready';
    } catch (err) {
      if (token !== s.token || (err && err.name === 'AbortError')) return;
      box.removeAttribute('aria-busy');
      clear($('cards'));
      $('cards').appendChild(el('p', 'empty', 'Could not load the summary: ' + err.message));
      box.dataset.state = 'error';
    }
  }

  // ---------------------------------------------------------------------------------
  // Freshness: what is late or stale (the line at the top), and what arrived per day
  // ---------------------------------------------------------------------------------

  const COVERAGE_STATES = [
    ['ok', 'data'], ['thin', 'thin: under half the usual hours'], ['missing', 'missing'],
    ['quiet', 'none, and none expected'], ['today', 'today'],
  ];

  const ATTENTION_SHOWN = 3; // more lines than this fold away, named in one line

  /** ``node`` with ``text`` in it, each word with a hyphen in it (a date, an automation's
   *  name) kept on one line: a phone's narrow line breaks between words, never at a
   *  hyphen ("2025-04-" / "25"). */
  function wholeWords(node, text) {
    String(text || '').split(/(\s+)/).forEach(function (word) {
      if (word.indexOf('-') >= 0 && /\S/.test(word)) node.appendChild(el('span', 'whole', word));
      else if (word) node.appendChild(document.createTextNode(word));
    });
    return node;
  }

  function drawAttention(items) {
    const box = $('attention');
    clear(box);
    const all = items || [];
    let more = null;
    all.forEach(function (n, i) {
      const item = el('div', 'attention-item ' + n.state);
      setData(item, { kind: n.kind, state: n.state, subject: n.subject, since: n.since });
      item.appendChild(wholeWords(el('p', 'attention-text'), n.text));
      if (n.action) item.appendChild(wholeWords(el('p', 'attention-action'), n.action));
      if (i < ATTENTION_SHOWN || all.length === ATTENTION_SHOWN + 1) {
        box.appendChild(item);
        return;
      }
      if (!more) {
        more = el('details', 'attention-more');
        const rest = all.slice(ATTENTION_SHOWN).map(function (r) {
          return r.title.replace(/^healthlog: /, '');
        });
        more.appendChild(el('summary', null, rest.length + ' more: ' + rest.join('; ')));
        box.appendChild(more);
      }
      more.appendChild(item);
    });
    box.hidden = !box.firstChild;
  }

  /** What a calendar cell says: the day, how much arrived, and its state in words. */
  function cellText(row, date, value, cellState) {
    let amount = value ? 'data' : 'no data';
    if (row.kind === 'hours') {
      amount = formatCount(value) + (value === 1 ? ' hour' : ' hours') + ' with data';
    } else if (row.kind === 'nights') {
      amount = value ? 'a night ended' : 'no night ended';
    }
    const said = {
      ok: '', thin: ' (thin)', missing: ' (missing)', quiet: '', today: ' (today, not over)',
      before: ' (before its first data)', future: '',
    }[cellState] || '';
    return formatDate(date) + ': ' + amount + said;
  }

  function coverageRow(data, row) {
    const box = el('div', 'cov-row');
    setData(box, { metric: row.metric, layer: row.layer, kind: row.kind, state: row.state });
    const name = el('div', 'cov-name', row.name + ' ');
    name.appendChild(el('span', 'meta', row.layer + (row.automation
      ? ' · ' + row.automation : '')));
    box.appendChild(name);
    const cells = el('ol', 'cov-cells');
    cells.setAttribute('aria-label', row.name + ', ' + row.layer);
    data.days.forEach(function (date, i) {
      const value = row.values[i];
      const cellState = row.states[i];
      const cell = el('li', 'cov-cell ' + cellState + (value ? ' has' : ''));
      setData(cell, { date: date, value: value, state: cellState });
      cell.title = cellText(row, date, value, cellState);
      cell.setAttribute('aria-label', cell.title);
      cells.appendChild(cell);
    });
    box.appendChild(cells);
    return box;
  }

  function drawCoverage(data) {
    const box = $('coverage');
    clear(box);
    const head = el('ol', 'cov-cells cov-head');
    head.setAttribute('aria-hidden', 'true');
    data.days.forEach(function (date) {
      const monday = weekdayOf(date) === 0;
      head.appendChild(el('li', 'cov-cell', monday ? String(Number(date.slice(8))) : ''));
    });
    const headRow = el('div', 'cov-row');
    headRow.appendChild(el('div', 'cov-name meta', formatDate(data.days[0]) + ' – ' +
      formatDate(data.days[data.days.length - 1]) + ' (Mondays numbered)'));
    headRow.appendChild(head);
    box.appendChild(headRow);
    (data.rows || []).forEach(function (row) { box.appendChild(coverageRow(data, row)); });
    if (!(data.rows || []).length) box.appendChild(el('p', 'empty', 'No data in these days.'));
    $('coverage-rule').textContent = 'Each day of each metric: the hours with data (minute ' +
      'data) or whether there is data (day data), by the date written in each point; for ' +
      'sleep, whether a night ended that day. A day is thin under half the median hours ' +
      'of its row, missing without data where the metric comes daily.';
    const legend = $('coverage-legend');
    clear(legend);
    COVERAGE_STATES.forEach(function (entry) {
      const item = el('li');
      item.appendChild(el('span', 'cov-cell ' + entry[0]));
      item.appendChild(document.createTextNode(entry[1]));
      legend.appendChild(item);
    });
    const gaps = $('coverage-gaps');
    clear(gaps);
    (data.fill || []).forEach(function (gap) {
      const item = el('li', 'cov-gap');
      setData(item, { automation: gap.automation, from: gap.from, to: gap.to });
      const when = gap.from === gap.to ? formatDate(gap.from)
        : formatDate(gap.from) + ' to ' + formatDate(gap.to);
      item.appendChild(el('strong', null, when + ', ' + gap.metrics.join(', ') + ': '));
      item.appendChild(document.createTextNode(gap.action));
      gaps.appendChild(item);
    });
    setData(box, { from: data.from, to: data.to, tz: data.tz, today: data.today });
  }

  async function showCoverage() {
    const box = $('coverage');
    const s = state.summary;
    if (s.coverageController) s.coverageController.abort();
    const controller = new AbortController();
    s.coverageController = controller;
    box.dataset.state = 'loading';
    try {
      const data = await getJSON(query('/api/coverage', { tz: state.tz }), controller.signal);
      if (controller !== s.coverageController) return;
      drawCoverage(data);
      box.dataset.state = 'ready';
    } catch (err) {
      if (controller !== s.coverageController || (err && err.name === 'AbortError')) return;
      clear(box);
      box.appendChild(el('p', 'empty', 'Could not load what arrived: ' + err.message));
      box.dataset.state = 'error';
    }
  }

  function stepDay(n) {
    const date = state.summary.date;
    if (!date) return;
    window.location.hash = summaryHash(addDays(date, n), state.tz);
  }

  // ---------------------------------------------------------------------------------
  // One workout: its figures, route, heart rate, splits and elevation (#view=workout)
  // ---------------------------------------------------------------------------------
  // Everything it shows is in /api/workouts/<id>'s answer: the figures with their labels
  // and units, the route already thinned with its bounds, the zones and their rule, the
  // splits and their unit. The page projects, scales and colours; it decides no figure.

  const ROUTE_STEPS = 5; // colours of the route, slow to fast (or low to high heart rate)
  const MAP_WORLD_M = 40075016.686; // the equator's length on Web Mercator's sphere
  const TILE_PX = 256;
  const TILES_MAX = 64;

  /** Seconds as a clock: "32:05", or "1:02:05" from an hour on. */
  function formatClock(seconds) {
    if (!isNumber(seconds) || seconds < 0) return '–';
    const whole = Math.round(seconds);
    const h = Math.floor(whole / 3600);
    const m = Math.floor(whole % 3600 / 60);
    const s = whole % 60;
    return (h ? h + ':' + pad(m) : String(m)) + ':' + pad(s);
  }

  /** A figure of the workout page as the server describes it: a clock, a pace (m:ss per
   *  unit) or a number, with its units as the server shows them. */
  function figureText(f) {
    if (!f || !isNumber(f.value)) return '–';
    if (f.shown === 'duration') return formatClock(f.value);
    if (f.shown === 'pace') return formatClock(f.value) + ' ' + (f.unit_label || '');
    return formatNumber(f.value, isNumber(f.digits) ? f.digits : undefined) +
      unitText(f.unit_label, f.units);
  }

  /** Web Mercator of a position, the world being 1 × 1 (x east from 180° W, y south from
   *  85.05° N). Pure. */
  function mercator(lat, lon) {
    const phi = Math.max(-85.05112878, Math.min(85.05112878, lat)) * Math.PI / 180;
    return [(lon + 180) / 360,
      (1 - Math.log(Math.tan(phi) + 1 / Math.cos(phi)) / Math.PI) / 2];
  }

  /** How a route's bounds fit a width × height box with ``inset`` pixels all round: the
   *  pixels per world unit and the world position of the box's top left corner. Pure. */
  function routeFit(bounds, width, height, inset) {
    const nw = mercator(bounds.north, bounds.west);
    const se = mercator(bounds.south, bounds.east);
    const spanX = Math.max(se[0] - nw[0], 1e-9);
    const spanY = Math.max(se[1] - nw[1], 1e-9);
    const scale = Math.min((width - 2 * inset) / spanX, (height - 2 * inset) / spanY, 2e8);
    return {
      scale: scale,
      x0: (nw[0] + se[0]) / 2 - width / 2 / scale,
      y0: (nw[1] + se[1]) / 2 - height / 2 / scale,
      width: width, height: height,
    };
  }

  function project(fit, lat, lon) {
    const m = mercator(lat, lon);
    return [(m[0] - fit.x0) * fit.scale, (m[1] - fit.y0) * fit.scale];
  }

  /** A scale bar of at most ``room`` pixels at the latitude shown: the longest round
   *  length (1, 2 or 5 times a power of ten) of the owner's distance unit, or of the short
   *  unit under one of those. Pure. */
  function scaleBar(fit, lat, room, units) {
    const metersPerPx = MAP_WORLD_M * Math.cos(lat * Math.PI / 180) / fit.scale;
    const most = metersPerPx * room;
    const unit = most >= units.distance.meters ? units.distance : units.short;
    const inUnits = most / unit.meters;
    const mag = Math.pow(10, Math.floor(Math.log10(inUnits)));
    const step = [5, 2, 1].map(function (k) { return k * mag; })
      .filter(function (v) { return v <= inUnits; })[0] || mag;
    return { px: step * unit.meters / metersPerPx, label: formatNumber(step) + ' ' + unit.label,
      meters: step * unit.meters };
  }

  /** The class (0 … ROUTE_STEPS-1) of each value by the quantiles of those present, and
   *  the bounds of each class; null values stay null. Pure. */
  function routeSteps(values) {
    const present = values.filter(isNumber).sort(function (a, b) { return a - b; });
    if (!present.length) return { classes: values.map(function () { return null; }), cuts: [] };
    const cuts = [];
    for (let k = 1; k < ROUTE_STEPS; k++) {
      const at = Math.floor(present.length * k / ROUTE_STEPS);
      cuts.push(present[Math.min(present.length - 1, at)]);
    }
    const classes = values.map(function (v) {
      if (!isNumber(v)) return null;
      let c = 0;
      while (c < cuts.length && v >= cuts[c]) c += 1;
      return c;
    });
    return { classes: classes, cuts: [present[0]].concat(cuts, [present[present.length - 1]]) };
  }

  /** The tiles under a fitted map at the zoom whose tiles are 256 to 512 pixels wide:
   *  [{z, x, y, px, py, size}]; none above TILES_MAX. Pure. */
  function mapTiles(fit) {
    const z = Math.max(0, Math.min(19, Math.floor(Math.log2(fit.scale / TILE_PX))));
    const n = Math.pow(2, z);
    const size = fit.scale / n;
    const x1 = Math.floor(fit.x0 * n);
    const y1 = Math.floor(fit.y0 * n);
    const x2 = Math.floor((fit.x0 + fit.width / fit.scale) * n);
    const y2 = Math.floor((fit.y0 + fit.height / fit.scale) * n);
    const out = [];
    for (let x = x1; x <= x2; x++) {
      for (let y = Math.max(0, y1); y <= Math.min(n - 1, y2); y++) {
        out.push({ z: z, x: ((x % n) + n) % n, y: y, px: (x / n - fit.x0) * fit.scale,
          py: (y / n - fit.y0) * fit.scale, size: size });
      }
    }
    return out.length > TILES_MAX ? [] : out;
  }

  async function showWorkout(id) {
    const box = $('workout-view');
    const w = state.workout;
    const { controller, token } = newLoad(w);
    box.dataset.state = 'loading';
    box.dataset.id = id;
    let data;
    try {
      data = await getJSON(query('/api/workouts/' + encodeURIComponent(id), { tz: state.tz }),
        controller.signal);
    } catch (err) {
      if (token !== w.token || (err && err.name === 'AbortError')) return;
      clearWorkout();
      $('workout-title').textContent = 'Workout';
      $('workout-meta').textContent = 'Could not load this workout: ' + err.message;
      box.dataset.state = 'error';
      return;
    }
    if (token !== w.token) return;
    w.data = data;
    drawWorkout(data);
    box.dataset.state = 'ready';
  }

  function clearWorkout() {
    ['workout-notes', 'workout-figures', 'workout-map', 'workout-heart', 'workout-zones',
      'workout-splits', 'workout-elevation', 'route-legend'].forEach(function (k) {
      clear($(k));
    });
    ['part-route', 'part-heart', 'part-splits', 'part-elevation'].forEach(function (k) {
      $(k).hidden = true;
    });
    $('workout-gpx').hidden = true;
  }

  function drawWorkout(data) {
    clearWorkout();
    const wk = data.workout;
    $('workout-title').textContent = wk.name || 'Workout';
    $('workout-meta').textContent = formatLocal(wk.local_start) + ' – ' +
      (splitLocal(wk.local_end) || {}).time + ' · ' + zoneText();
    $('workout-back').href = linkHash(data.link, state.tz);
    drawWorkoutNotes(data);
    drawFigures($('workout-figures'), data.figures);
    if (data.route) {
      $('part-route').hidden = false;
      const gpx = $('workout-gpx');
      gpx.href = data.route.gpx;
      gpx.hidden = false;
      drawRouteMap(data);
    }
    const heart = data.heart_rate;
    if (heart.session.length || heart.recovery.length) {
      $('part-heart').hidden = false;
      drawHeart($('workout-heart'), heart);
      drawZones(heart.zones, heart.units_label);
    }
    if (data.splits && data.splits.rows.length) {
      $('part-splits').hidden = false;
      drawSplits($('workout-splits'), data.splits, data.heart_rate.units_label);
    }
    if (data.elevation && data.elevation.profile.length > 1) {
      $('part-elevation').hidden = false;
      drawElevation($('workout-elevation'), data.elevation, data.units);
    }
  }

  function drawWorkoutNotes(data) {
    const list = $('workout-notes');
    const wk = data.workout;
    (data.notes || []).forEach(function (text) { list.appendChild(el('li', 'note', text)); });
    const other = function (d, lead) {
      const li = el('li', 'duplicate');
      li.appendChild(document.createTextNode(lead));
      const a = el('a', null, (d.name || 'Workout') + ', ' + formatLocal(d.local_start) +
        (d.source ? ' (' + d.source + ')' : ''));
      a.href = workoutHash(d.id);
      li.appendChild(a);
      list.appendChild(li);
    };
    (wk.duplicates || []).forEach(function (d) { other(d, 'Also recorded: '); });
    if (wk.shown_first) other(wk.shown_first, 'Recorded twice, counted once as ');
  }

  function workoutHash(id) {
    const params = new URLSearchParams();
    params.set('view', 'workout');
    params.set('id', id);
    if (state.tz !== 'local') params.set('tz', state.tz);
    return '#' + params.toString();
  }

  function drawFigures(box, figures) {
    figures.forEach(function (f) {
      const item = el('div', 'figure');
      setData(item, { key: f.key, value: f.value, units: f.units, shown: f.shown });
      item.appendChild(el('dt', null, f.label));
      const dd = el('dd', 'num', figureText(f));
      if (f.note) dd.appendChild(el('span', 'figure-note', ' ' + f.note));
      item.appendChild(dd);
      box.appendChild(item);
    });
  }

  function routeColourValues(track, by) {
    return track.drawn.map(function (p) { return by === 'hr' ? p[6] : p[5]; });
  }

  function drawRouteMap(data) {
    const track = data.route;
    const box = $('workout-map');
    clear(box);
    const width = Math.max(260, box.clientWidth || 600);
    const height = Math.round(Math.max(220, Math.min(520, width * 0.62)));
    const fit = routeFit(track.bounds, width, height, 16);
    const root = svg('svg', {
      viewBox: '0 0 ' + width + ' ' + height, width: '100%', role: 'img',
      class: 'route-map', 'aria-label': 'The route on a map, ' + formatNumber(track.points,
        0) + ' points',
    });
    setData(root, { scale: fit.scale, x0: fit.x0, y0: fit.y0, width: width, height: height,
      points: track.points, drawn: track.drawn.length });
    if (data.map_tiles) {
      const layer = svg('g', { class: 'tiles' });
      mapTiles(fit).forEach(function (t) {
        layer.appendChild(svg('image', {
          href: data.map_tiles.replace('{z}', t.z).replace('{x}', t.x).replace('{y}', t.y),
          x: t.px.toFixed(1), y: t.py.toFixed(1), width: t.size.toFixed(1),
          height: t.size.toFixed(1), preserveAspectRatio: 'none',
        }));
      });
      root.appendChild(layer);
    }
    const hasHeart = track.drawn.some(function (p) { return isNumber(p[6]); });
    const by = state.workout.colour === 'hr' && hasHeart ? 'hr' : 'speed';
    const steps = routeSteps(routeColourValues(track, by));
    const points = track.drawn.map(function (p) { return project(fit, p[1], p[2]); });
    const lines = svg('g', { class: 'route-lines' });
    let current = null;
    for (let k = 1; k < points.length; k++) {
      const c = steps.classes[k];
      const cls = 'route-line ' + (c === null ? 'route-none' : 'route-' + c);
      if (!current || current.cls !== cls) {
        current = { cls: cls, pts: [points[k - 1]] };
        lines.appendChild(current.node = svg('polyline', { class: cls }));
      }
      current.pts.push(points[k]);
      current.node.setAttribute('points', current.pts.map(function (q) {
        return q[0].toFixed(1) + ',' + q[1].toFixed(1);
      }).join(' '));
    }
    root.appendChild(lines);
    const first = points[0];
    const last = points[points.length - 1];
    root.appendChild(svg('circle', { class: 'route-start', cx: first[0].toFixed(1),
      cy: first[1].toFixed(1), r: 6 }, undefined));
    root.appendChild(svg('rect', { class: 'route-finish', x: (last[0] - 5).toFixed(1),
      y: (last[1] - 5).toFixed(1), width: 10, height: 10 }));
    const bar = scaleBar(fit, (track.bounds.north + track.bounds.south) / 2, width / 4,
      data.units);
    const g = svg('g', { class: 'scale-bar' });
    setData(g, { meters: bar.meters, px: bar.px });
    g.appendChild(svg('line', { x1: 12, x2: (12 + bar.px).toFixed(1), y1: height - 12,
      y2: height - 12 }));
    g.appendChild(svg('text', { x: 12, y: height - 18 }, bar.label));
    root.appendChild(g);
    if (data.map_tiles) {
      root.appendChild(svg('text', { class: 'tile-credit', x: width - 6, y: height - 6 },
        'Tiles: ' + tileHost(data.map_tiles)));
    }
    box.appendChild(root);
    drawRouteLegend(track, by, steps, hasHeart, data.units, data.heart_rate.units_label);
  }

  /** A workout page drawn again when the window's width changes (its map and charts are
   *  drawn for the width they have). */
  function wireWorkoutResize() {
    let timer = null;
    let lastWidth = document.documentElement.clientWidth;
    window.addEventListener('resize', function () {
      clearTimeout(timer);
      timer = setTimeout(function () {
        const width = document.documentElement.clientWidth;
        if (width === lastWidth || state.view !== 'workout' || !state.workout.data) return;
        lastWidth = width;
        drawWorkout(state.workout.data);
      }, 150);
    });
  }

  function tileHost(template) {
    const m = /^[a-z]+:\/\/([^/]+)/.exec(template);
    return m ? m[1] : template;
  }

  /** The route's colours: speed in the owner's units (``units.speed``: its label and its
   *  size in m/s) or heart rate (``bpm``: its units as the server shows them). */
  function drawRouteLegend(track, by, steps, hasHeart, units, bpm) {
    const legend = $('route-legend');
    clear(legend);
    const pick = el('span', 'route-colour');
    [['speed', 'Speed'], ['hr', 'Heart rate']].forEach(function (choice) {
      const b = el('button', by === choice[0] ? 'active' : null, choice[1]);
      b.type = 'button';
      b.dataset.colour = choice[0];
      b.setAttribute('aria-pressed', by === choice[0] ? 'true' : 'false');
      b.disabled = choice[0] === 'hr' && !hasHeart;
      b.addEventListener('click', function () {
        state.workout.colour = choice[0];
        if (state.workout.data) drawRouteMap(state.workout.data);
      });
      pick.appendChild(b);
    });
    legend.appendChild(pick);
    const cuts = steps.cuts;
    const text = function (v) {
      return by === 'hr' ? formatCount(v) : formatNumber(v / units.speed.meters);
    };
    for (let c = 0; c + 1 < cuts.length; c++) {
      const item = el('span', 'legend-item');
      item.appendChild(el('span', 'swatch route-' + c));
      item.appendChild(document.createTextNode(text(cuts[c]) + '–' + text(cuts[c + 1])));
      legend.appendChild(item);
    }
    if (cuts.length) {
      legend.appendChild(el('span', 'units', by === 'hr' ? bpm : units.speed.label));
    }
    legend.appendChild(el('span', 'meta', ' · ' + formatNumber(track.points, 0) +
      ' points, ' + formatNumber(track.drawn.length, 0) + ' drawn'));
  }

  /** A small chart frame of its own: x in seconds, y in values. */
  function plainFrame(box, xLo, xHi, yLo, yHi, label) {
    const width = Math.max(260, box.clientWidth || 600);
    const height = 200;
    const margin = { top: 10, right: 10, bottom: 26, left: 40 };
    const plotW = width - margin.left - margin.right;
    const plotH = height - margin.top - margin.bottom;
    const yTicks = niceTicks(yLo, yHi, 4);
    const lo = Math.min(yLo, yTicks[0]);
    const hi = Math.max(yHi, yTicks[yTicks.length - 1]);
    const g = {
      width: width, height: height, margin: margin, plotW: plotW, plotH: plotH,
      x: function (v) { return margin.left + (xHi > xLo ? (v - xLo) / (xHi - xLo) : 0) * plotW; },
      y: function (v) { return margin.top + (hi > lo ? (hi - v) / (hi - lo) : 0.5) * plotH; },
    };
    const root = svg('svg', { viewBox: '0 0 ' + width + ' ' + height, width: '100%',
      role: 'img', 'aria-label': label });
    const grid = svg('g', { class: 'grid' });
    yTicks.forEach(function (t) {
      if (t < lo || t > hi) return;
      grid.appendChild(svg('line', { x1: margin.left, x2: width - margin.right,
        y1: g.y(t).toFixed(1), y2: g.y(t).toFixed(1) }));
      grid.appendChild(svg('text', { class: 'ylabel', x: margin.left - 4,
        y: (g.y(t) + 4).toFixed(1) }, formatTick(t, yTicks[1] - yTicks[0])));
    });
    root.appendChild(grid);
    box.appendChild(root);
    return { g: g, root: root, grid: grid };
  }

  function timeTicks(grid, g, xLo, xHi) {
    const ticks = niceTicks(xLo / 60, xHi / 60, 5);
    ticks.forEach(function (t) {
      if (t * 60 < xLo || t * 60 > xHi) return;
      grid.appendChild(svg('text', { class: 'xlabel', x: g.x(t * 60).toFixed(1),
        y: g.height - 8 }, formatClock(t * 60)));
    });
  }

  function drawHeart(box, heart) {
    const all = heart.session.concat(heart.recovery);
    const end = heart.end_s;
    let yLo = Infinity;
    let yHi = -Infinity;
    all.forEach(function (s) { yLo = Math.min(yLo, s[2]); yHi = Math.max(yHi, s[3]); });
    const xHi = Math.max(end, all.length ? all[all.length - 1][0] : end);
    const f = plainFrame(box, 0, xHi, yLo, yHi, 'Heart rate during the workout and after it');
    const g = f.g;
    const zones = heart.zones ? heart.zones.zones : [];
    zones.forEach(function (z) {
      if (!z.zone) return;
      const top = g.y(isNumber(z.high) ? Math.min(z.high, yHi) : yHi);
      const bottom = g.y(Math.max(z.low, yLo));
      if (!(bottom > top)) return;
      f.root.insertBefore(svg('rect', { class: 'zone-band zone-' + z.zone, x: g.margin.left,
        y: top.toFixed(1), width: g.plotW, height: (bottom - top).toFixed(1) }), f.grid);
    });
    timeTicks(f.grid, g, 0, xHi);
    const line = function (samples, cls) {
      if (!samples.length) return;
      f.root.appendChild(svg('polyline', { class: cls, points: samples.map(function (s) {
        return g.x(s[0]).toFixed(1) + ',' + g.y(s[1]).toFixed(1);
      }).join(' ') }));
    };
    line(heart.session, 'series s1 heart-session');
    line(heart.recovery, 'series recovery');
    f.root.appendChild(svg('line', { class: 'end-mark', x1: g.x(end).toFixed(1),
      x2: g.x(end).toFixed(1), y1: g.margin.top, y2: g.margin.top + g.plotH }));
    f.root.appendChild(svg('text', { class: 'end-label', x: (g.x(end) + 3).toFixed(1),
      y: g.margin.top + 10 }, 'end'));
    setData(f.root, { session: heart.session.length, recovery: heart.recovery.length,
      state: heart.state });
    const legend = el('p', 'legend');
    [['s1', 'during the workout', heart.session.length],
      ['recovery-swatch', 'recovery, after the end', heart.recovery.length]]
      .forEach(function (l) {
        if (!l[2]) return;
        const item = el('span', 'legend-item');
        item.appendChild(el('span', 'swatch ' + l[0]));
        item.appendChild(document.createTextNode(l[1]));
        legend.appendChild(item);
      });
    box.appendChild(legend);
  }

  function drawZones(zones, bpm) {
    const table = $('workout-zones');
    const rule = $('zone-rule');
    rule.textContent = zones ? zones.words : '';
    if (!zones) return;
    let total = 0;
    zones.zones.forEach(function (z) { total += z.seconds; });
    const head = el('tr');
    ['Zone', 'Heart rate', 'Time', 'Share'].forEach(function (t) {
      head.appendChild(el('th', null, t));
    });
    table.appendChild(el('thead')).appendChild(head);
    const body = table.appendChild(el('tbody'));
    zones.zones.forEach(function (z) {
      const tr = el('tr', 'zone-row');
      setData(tr, { zone: z.zone, seconds: z.seconds, low: z.low, high: z.high });
      tr.appendChild(el('td', null, z.label));
      tr.appendChild(el('td', 'num', z.low === null ? 'under ' + formatCount(z.high) + ' ' + bpm
        : z.high === null ? formatCount(z.low) + ' ' + bpm + ' and over'
          : formatCount(z.low) + '–' + formatCount(z.high) + ' ' + bpm));
      tr.appendChild(el('td', 'num', formatClock(z.seconds)));
      tr.appendChild(el('td', 'num', total ? formatNumber(100 * z.seconds / total, 0) + ' %'
        : '–'));
      body.appendChild(tr);
    });
  }

  function drawSplits(table, splits, bpm) {
    const speed = splits.shown === 'speed';
    const head = el('tr');
    [splits.unit.label, 'Time', speed ? 'Speed' : 'Pace', 'Heart rate']
      .forEach(function (t) { head.appendChild(el('th', null, t)); });
    table.appendChild(el('thead')).appendChild(head);
    const body = table.appendChild(el('tbody'));
    splits.rows.forEach(function (r) {
      const tr = el('tr', 'split-row');
      setData(tr, { split: r.split, meters: r.meters, seconds: r.seconds, pace: r.pace_s,
        speed: r.speed, heart: r.average_heart_rate });
      const whole = Math.abs(r.meters - splits.unit.meters) < 1e-6;
      tr.appendChild(el('td', null, whole ? String(r.split)
        : formatNumber(r.meters / splits.unit.meters) + ' ' + splits.unit.label));
      tr.appendChild(el('td', 'num', formatClock(r.seconds)));
      tr.appendChild(el('td', 'num', speed ? formatNumber(r.speed) + ' ' + splits.speed_label
        : formatClock(r.pace_s) + ' ' + splits.pace_label));
      tr.appendChild(el('td', 'num', isNumber(r.average_heart_rate)
        ? formatCount(r.average_heart_rate) + ' ' + bpm : '–'));
      body.appendChild(tr);
    });
  }

  function drawElevation(box, elevation, units) {
    const profile = elevation.profile;
    let lo = Infinity;
    let hi = -Infinity;
    profile.forEach(function (p) { lo = Math.min(lo, p[1]); hi = Math.max(hi, p[1]); });
    const size = elevation.meters;
    const xHi = profile[profile.length - 1][0];
    const f = plainFrame(box, 0, xHi, lo / size, hi / size, 'Altitude along the route');
    const g = f.g;
    const ticks = niceTicks(0, xHi / units.distance.meters, 5);
    ticks.forEach(function (t) {
      if (t * units.distance.meters > xHi) return;
      f.grid.appendChild(svg('text', { class: 'xlabel', x: g.x(t * units.distance.meters)
        .toFixed(1), y: g.height - 8 }, formatNumber(t) + ' ' + units.distance.label));
    });
    const bottom = g.margin.top + g.plotH;
    const pts = profile.map(function (p) {
      return g.x(p[0]).toFixed(1) + ',' + g.y(p[1] / size).toFixed(1);
    });
    f.root.appendChild(svg('polygon', { class: 'elevation-area', points: g.x(0).toFixed(1) +
      ',' + bottom + ' ' + pts.join(' ') + ' ' + g.x(xHi).toFixed(1) + ',' + bottom }));
    f.root.appendChild(svg('polyline', { class: 'series s2', points: pts.join(' ') }));
    box.appendChild(el('p', 'meta', 'Climbed ' + formatNumber(elevation.gain_m / size) + ' ' +
      elevation.label + ', descended ' + formatNumber(elevation.loss_m / size) + ' ' +
      elevation.label + ' (from the route\u2019s altitude)'));
  }

  // ---------------------------------------------------------------------------------
  // Views: the address says which
  // ---------------------------------------------------------------------------------

  function setView(view) {
    state.view = view;
    document.body.dataset.view = view;
    $('summary').hidden = view !== 'summary';
    $('metric-view').hidden = view !== 'metric';
    $('journal-panel').hidden = view !== 'metric';
    $('workout-view').hidden = view !== 'workout';
    [['nav-summary', 'summary'], ['nav-metrics', 'metric']].forEach(function (n) {
      const on = n[1] === (view === 'workout' ? 'metric' : view);
      $(n[0]).classList.toggle('active', on);
      if (on) $(n[0]).setAttribute('aria-current', 'page');
      else $(n[0]).removeAttribute('aria-current');
    });
  }

  /** What the address asks for: the summary (no metric in it; a first visit) or the
   *  metric view. */
  function route() {
    const wanted = readHash();
    if (wanted.view === 'workout' && wanted.id) {
      if (wanted.tz && wanted.tz !== state.tz) {
        state.tz = wanted.tz;
        ensureZoneOption(wanted.tz);
      }
      setView('workout');
      showWorkout(wanted.id);
      return;
    }
    const view = wanted.metric || wanted.view === 'metric' ? 'metric' : 'summary';
    setView(view);
    if (view === 'summary') {
      if (wanted.tz && wanted.tz !== state.tz) {
        state.tz = wanted.tz;
        ensureZoneOption(wanted.tz);
      }
      showSummary(isDate(wanted.date) ? wanted.date : null);
      return;
    }
    if (!state.journalLoaded) {
      state.journalLoaded = true;
      loadJournal(false);
      loadHealth();
    }
    if (!state.metrics.length) return; // loadCatalog shows the view when the catalog comes
    applyHash(wanted);
    showView();
  }

  // ---------------------------------------------------------------------------------
  // The journal and the service state
  // ---------------------------------------------------------------------------------

  const JOURNAL_COLUMNS = [
    ['ID', function (d) { return '#' + d.id; }, 'num'],
    ['Received', function (d) { return formatInstant(d.received_at, state.tz); }],
    ['Automation', function (d) { return d.automation_name || d.path_name || '–'; }, 'wide'],
    ['Status', null],
    ['Layer', function (d) { return d.layer || '–'; }],
    ['Points', function (d) { return formatCount(d.points); }, 'num'],
    ['Objects written', function (d) { return formatCount(d.objects_written); }, 'num'],
    ['Overwrites', function (d) { return formatCount(d.overwrites); }, 'num'],
    ['Unit conflicts', function (d) { return formatCount(d.unit_conflicts); }, 'num'],
    ['Size', function (d) { return formatBytes(d.body_bytes); }, 'num'],
    ['Error', function (d) { return (d.error || '') + (d.remedy ? ' — ' + d.remedy : ''); },
      'error'],
  ];

  function formatBytes(n) {
    if (typeof n !== 'number') return '–';
    if (n < 1024) return formatCount(n) + ' B';
    if (n < 1024 * 1024) return formatNumber(n / 1024, 1) + ' KiB';
    return formatNumber(n / 1024 / 1024, 1) + ' MiB';
  }

  async function loadJournal(append) {
    const box = $('journal');
    const more = $('journal-more');
    let page;
    try {
      page = await getJSON(query('/api/deliveries', {
        limit: JOURNAL_PAGE, before: append ? state.journalNext : null,
      }));
    } catch (err) {
      if (err.status === 401) return;
      clear(box);
      box.appendChild(el('p', 'empty', 'Could not load the journal: ' + err.message));
      return;
    }
    const rows = page.deliveries || [];
    state.journalNext = page.next_before;
    more.hidden = !page.next_before;
    let table = box.querySelector('table');
    if (!append || !table) {
      clear(box);
      if (!rows.length) {
        box.appendChild(el('p', 'empty', 'No deliveries yet.'));
        return;
      }
      table = el('table', 'list journal');
      const head = el('tr');
      JOURNAL_COLUMNS.forEach(function (c) { head.appendChild(el('th', c[2] || null, c[0])); });
      table.appendChild(el('thead')).appendChild(head);
      table.appendChild(el('tbody'));
      box.appendChild(table);
    }
    const body = table.querySelector('tbody');
    rows.forEach(function (d) {
      const tr = el('tr');
      setData(tr, {
        id: d.id, status: d.status, points: d.points, overwrites: d.overwrites,
        unitConflicts: d.unit_conflicts, received: d.received_at,
      });
      JOURNAL_COLUMNS.forEach(function (c) {
        const td = el('td', c[2] || null);
        td.dataset.label = c[0];
        if (c[1]) td.textContent = c[1](d);
        else {
          td.appendChild(el('span', 'status status-' + String(d.status).replace(/[^a-z]/g, ''),
            d.status));
        }
        if ((c[0] === 'Overwrites' && d.overwrites > 0) ||
            (c[0] === 'Unit conflicts' && d.unit_conflicts > 0)) {
          td.classList.add('flag');
        }
        tr.appendChild(td);
      });
      body.appendChild(tr);
    });
    $('journal-title').textContent = 'Deliveries (' + body.children.length + ' shown)';
  }

  async function loadHealth() {
    const health = $('health');
    let status = null;
    try {
      status = await getJSON('/healthz');
    } catch (err) {
      status = null;
    }
    let lastFold = null;
    try {
      const page = await getJSON(query('/api/deliveries', { limit: 1, status: 'parsed' }));
      const d = page.deliveries && page.deliveries[0];
      lastFold = d && d.folded_at ? d.folded_at : null;
    } catch (err) {
      lastFold = null;
    }
    const parts = [];
    if (status) {
      parts.push('Backlog ' + formatCount(status.backlog));
      parts.push('worker ' + status.worker);
      if (status.status && status.status !== 'ok') parts.push(status.status);
      if (status.version) parts.push('version ' + status.version);
    } else {
      parts.push('Service state unavailable');
    }
    parts.push(lastFold ? 'last fold ' + formatInstant(lastFold, state.tz) : 'no fold yet');
    health.textContent = parts.join(' · ');
  }

  // ---------------------------------------------------------------------------------
  // Wiring
  // ---------------------------------------------------------------------------------

  function init() {
    fillZones();
    $('catalog').addEventListener('change', function (event) {
      const found = state.metrics.find(function (m) { return m.metric === event.target.value; });
      if (!found) return;
      state.metric = found;
      state.layer = '';
      state.ecg = null;
      showView();
    });
    $('layer').addEventListener('change', function (event) {
      state.layer = event.target.value;
      showView();
    });
    $('zone').addEventListener('change', function (event) {
      state.tz = event.target.value;
      showView();
      loadJournal(false);
      loadHealth();
    });
    Array.prototype.forEach.call(document.querySelectorAll('#range button'), function (button) {
      button.addEventListener('click', function () {
        const key = button.dataset.range;
        if (key === 'custom' && !state.custom) {
          const from = $('from').value;
          const to = $('to').value;
          if (isDate(from) && isDate(to)) state.custom = { from: from, to: to };
          else return;
        }
        state.range = key;
        showView();
      });
    });
    const onDates = function () {
      const from = $('from').value;
      const to = $('to').value;
      if (!isDate(from) || !isDate(to) || to < from) return;
      state.custom = { from: from, to: to };
      state.range = 'custom';
      showView();
    };
    $('from').addEventListener('change', onDates);
    $('to').addEventListener('change', onDates);
    $('records-more').addEventListener('click', function () {
      if (state.more) state.more();
    });
    $('journal-more').addEventListener('click', function () { loadJournal(true); });
    $('refresh').addEventListener('click', function () {
      // new deliveries may have brought new metrics and a later "latest data"
      state.metrics = [];
      loadCatalog();
      loadJournal(false);
      loadHealth();
    });
    $('day-prev').addEventListener('click', function () { stepDay(-1); });
    $('day-next').addEventListener('click', function () { stepDay(1); });
    window.addEventListener('hashchange', route);
    wireWorkoutResize();
    let resizeTimer = null;
    let lastWidth = $('chart').clientWidth;
    window.addEventListener('resize', function () {
      clearTimeout(resizeTimer);
      resizeTimer = setTimeout(function () {
        const w = $('chart').clientWidth;
        if (w !== lastWidth) {
          lastWidth = w;
          redraw();
        }
      }, 150);
    });
    route();
    loadCatalog();
  }

  // The pure functions, for the in-browser unit tests (tests/test_dashboard_logic.py): a
  // test sets window.HEALTHLOG_TEST before this script runs; a normal page exposes nothing.
  if (window.HEALTHLOG_TEST === true) {
    window.healthlogTest = {
      dayNumber: dayNumber, dateOf: dateOf, addDays: addDays, daysBetween: daysBetween,
      weekdayOf: weekdayOf, mondayOf: mondayOf, dateSlots: dateSlots, isoZ: isoZ,
      splitLocal: splitLocal, planOf: planOf,
      niceTicks: niceTicks, dateTicks: dateTicks,
      hourTicks: hourTicks, bucketValue: bucketValue, seriesFields: seriesFields,
      segmentsOf: segmentsOf, nightBar: nightBar,
      stagesOf: stagesOf, listWords: listWords, bedWords: bedWords, bedTime: bedTime,
      napTimes: napTimes,
      overlapWords: overlapWords,
      formatNumber: formatNumber, formatMinutes: formatMinutes, formatHours: formatHours,
      formatDate: formatDate, formatLocal: formatLocal, words: words, detailText: detailText,
      formatValue: formatValue, formatTick: formatTick, formatSeconds: formatSeconds,
      unitText: unitText,
      linkHash: linkHash, summaryHash: summaryHash, sparkMarks: sparkMarks,
    };
  }

  const signIn = document.getElementById('login');
  if (signIn) {
    // The sign-in page: a bookmarked view (#metric=...) outlives signing in. The form
    // posts to /login#view, and the redirect to / keeps that fragment, which its
    // Location does not name (a browser carries it over).
    signIn.addEventListener('submit', () => {
      signIn.setAttribute('action', '/login' + window.location.hash);
    });
    return;
  }
  if (!document.getElementById('catalog')) return; // loaded without the dashboard (tests)
  if (document.readyState === 'loading') {
    document.addEventListener('DOMContentLoaded', init);
  } else {
    init();
  }
})();
"""

STATIC_FILES = {
    "app.css": ("text/css; charset=utf-8", APP_CSS),
    "app.js": ("text/javascript; charset=utf-8", APP_JS),
}


if __name__ == "__main__":
    sys.exit(main())
