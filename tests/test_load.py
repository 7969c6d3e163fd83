"""Load (RELY-6): 8 clients post real-shaped HAE bodies of 1 KiB to 3 MiB at once to a real
``serve`` subprocess while a reader keeps loading the dashboard and its read routes. Every
post must be answered 200 (a ``503`` with ``Retry-After`` is sent again and counted, not
lost), everything must be folded, in journal order wherever the journal allowed it, and the
live store must equal a fresh ``reindex``. Post and read latencies are printed (``-s``).
"""

import bisect
import hashlib
import itertools
import os
import random
import threading
import time
from pathlib import Path

import pytest

import hae_factory as hf
from conftest import TOKEN, parse_logfmt
from load_helpers import (KIB, MIB, SEED_ENV, Acknowledged, Bodies, archive_bodies,
                          check_store_matches_rebuild, half_folded, logged, lost_deliveries,
                          percentile, snapshot_rows, timed_get, timed_post, wait_drained)

pytestmark = pytest.mark.json_agnostic

LOAD_SIZES = (1 * KIB, 10 * KIB, 100 * KIB, 1 * MIB, 3 * MIB)
LOAD_WEIGHTS = (60, 25, 12, 2.5, 0.5)
CLIENTS = 8
RETRY_AFTER_CAP_S = 5.0
"""A 503's Retry-After is honoured up to this: the server keeps nothing of a refused body,
so an earlier retry costs it nothing, and the test's time budget stays bounded."""
OUT_OF_ORDER = "delivery folded after a later one"

READS = (
    "/",
    "/api/catalog",
    "/api/points?metric=heart_rate&from=2024-03-10&to=2024-03-11",
    "/api/points?metric=step_count&bucket=day&from=2024-03-01&to=2024-09-01",
    "/api/points?metric=flights_climbed&bucket=hour&from=2023-01-01&to=2023-03-01",
    "/api/deliveries?limit=50",
)


@pytest.fixture(scope="module")
def load_bodies() -> Bodies:
    return Bodies(LOAD_SIZES)


def _poster(port: int, bodies: Bodies, rng: random.Random, count: int, client: int,
            serials, lock: threading.Lock, out: dict) -> None:
    """Post ``count`` deliveries back to back, each until it is answered 200."""
    headers = hf.headers_for(hf.Automation("Load %d" % client, "Minutes", "Since Last Sync"),
                             session_id=hf.new_uuid(rng), token=TOKEN)
    for _ in range(count):
        size = rng.choices(LOAD_SIZES, LOAD_WEIGHTS)[0]
        with lock:
            serial = next(serials)
        body = bodies.make(size, serial)
        digest = hashlib.sha256(body).hexdigest()
        while True:
            answer = timed_post(port, body, headers)
            with lock:
                out["attempts"].append((size, answer))
            if answer.status != 503:
                break
            with lock:
                out["retries"] += 1
            time.sleep(min(float(answer.retry_after or 1), RETRY_AFTER_CAP_S))
        if answer.status == 200:
            with lock:
                out["sent"].append(Acknowledged(answer.delivery_id, digest, len(body), serial))
        else:  # a failure: recorded in attempts; the delivery is not sent again
            with lock:
                out["failed"].append((serial, size, answer.status, answer.error))


def _reader(port: int, stop: threading.Event, out: list) -> None:
    """Load the dashboard's routes round after round until told to stop."""
    for path in itertools.cycle(READS):
        if stop.is_set():
            return
        status, body, seconds = timed_get(port, path)
        out.append((path, status, seconds, len(body)))


def fold_order(data_dir: Path) -> tuple:
    """(deliveries folded after one later in journal order, problems).

    A single worker with a forward cursor folds what it can see in journal order
    ``(received_at, id)``; a delivery can only be folded after a later one when it was not
    yet visible (still uploading: ``received_at`` is stamped when the request arrives, the row
    is written after the upload) when that later one was selected. So for every delivery A
    folded after a later one, the first such later one C to be folded must have entered the
    journal first: ``C.journaled_at < A.journaled_at`` (both are read inside the write
    transaction that inserts the row). Fold order is ``folded_at`` order."""
    rows = snapshot_rows(data_dir, "SELECT id, received_at, journaled_at, folded_at FROM delivery")
    position = {row[0]: n for n, row in enumerate(sorted(rows, key=lambda r: (r[1], r[0])))}
    by_fold = sorted(rows, key=lambda r: (r[3], r[0]))
    highest, top = [], -1  # highest journal position folded so far, per fold step
    for row in by_fold:
        top = max(top, position[row[0]])
        highest.append(top)
    late, problems = {}, []
    for step, (delivery_id, _, journaled_at, _) in enumerate(by_fold):
        first = bisect.bisect_right(highest, position[delivery_id])
        if first < step:  # by_fold[first] is later in the journal and was folded earlier
            later = by_fold[first]
            late[delivery_id] = later[0]
            if not later[2] < journaled_at:
                problems.append(
                    "delivery %d (journaled %s) was folded after delivery %d, later in"
                    " journal order, which entered the journal after it (%s)"
                    % (delivery_id, journaled_at, later[0], later[2]))
    return late, problems


def load(serve_process, data_dir: Path, tmp_path: Path, bodies: Bodies, per_client: int,
         drain_timeout: float, label: str) -> None:
    seed = int(os.environ.get(SEED_ENV) or random.SystemRandom().randrange(1 << 32))
    rng = random.Random(seed)
    context = "%s seed=%d (%s=%d reruns it)" % (label, seed, SEED_ENV, seed)
    print("\n%s: %d clients x %d deliveries" % (context, CLIENTS, per_client))
    started = time.monotonic()
    serve = serve_process(data_dir)
    # One delivery first, so that every metric the reader asks for exists.
    serials, lock = itertools.count(), threading.Lock()
    out = {"attempts": [], "sent": [], "failed": [], "retries": 0}
    _poster(serve.port, bodies, random.Random(rng.random()), 1, 0, serials, lock, out)
    assert len(out["sent"]) == 1, "%s: the first post failed: %s" % (context, out["attempts"])
    wait_drained(data_dir, 60, context)
    out["attempts"].clear()

    stop, reads = threading.Event(), []
    reader = threading.Thread(target=_reader, args=(serve.port, stop, reads), name="load-reader",
                              daemon=True)
    posters = [threading.Thread(
        target=_poster, name="load-client-%d" % n, daemon=True,
        args=(serve.port, bodies, random.Random(rng.random()), per_client, n, serials, lock,
              out)) for n in range(CLIENTS)]
    posting = time.monotonic()
    reader.start()
    for thread in posters:
        thread.start()
    try:
        for thread in posters:
            thread.join(600)
            assert not thread.is_alive(), "%s: a client hangs" % context
        posted = time.monotonic() - posting
    finally:
        stop.set()
        reader.join(120)
    assert not reader.is_alive(), "%s: the reader hangs" % context
    drained = wait_drained(data_dir, drain_timeout, context)
    assert serve.terminate() == 0, "%s: serve did not stop in order:\n%s" % (
        context, "\n".join(serve.log_lines()[-20:]))

    attempts, sent = out["attempts"], out["sent"]
    assert not out["failed"], "%s: posts not answered 200 (serial, size, status, error): %s" % (
        context, out["failed"][:20])
    assert len(sent) == CLIENTS * per_client + 1, context
    bad_reads = [(path, status) for path, status, _, _ in reads if status != 200]
    assert not bad_reads, "%s: reads not answered 200: %s" % (context, bad_reads[:20])
    assert reads, "%s: the reader read nothing" % context
    lost = lost_deliveries(data_dir, sent, hash_files=True)
    assert not lost, "%s: acknowledged deliveries lost:\n%s" % (context, "\n".join(lost[:20]))
    statuses = dict(snapshot_rows(data_dir, "SELECT id, parse_status FROM delivery"))
    assert len(statuses) == len(sent), "%s: %d rows for %d deliveries" % (
        context, len(statuses), len(sent))
    not_parsed = sorted((i, s) for i, s in statuses.items() if s != "parsed")
    assert not not_parsed, "%s: deliveries not parsed: %s" % (context, not_parsed[:20])
    halves = half_folded(data_dir)
    assert not halves, "%s: half-folded deliveries:\n%s" % (context, "\n".join(halves[:20]))

    late, problems = fold_order(data_dir)
    assert not problems, "%s: folded out of journal order:\n%s" % (
        context, "\n".join(problems[:20]))
    warned = set()
    for line in serve.log_lines():
        record = parse_logfmt(line)
        if record.get("msg", "").startswith(OUT_OF_ORDER):
            assert record.get("level") == "WARN", line
            warned.add(int(record["delivery_id"]))
    assert warned == set(late), (
        "%s: the out-of-order WARN names %s, but these were folded after a later delivery: %s"
        % (context, sorted(warned), sorted(late)))
    errors = logged([serve.log_path])
    assert not errors, "%s: serve logged errors: %s" % (context, errors[:10])
    journaled = {row[0] for row in snapshot_rows(data_dir, "SELECT archive_path FROM delivery")}
    orphans = archive_bodies(data_dir) - journaled
    assert not orphans, "%s: archived bodies without a row: %s" % (context, sorted(orphans))
    figures = check_store_matches_rebuild(data_dir, tmp_path, orphans, context)

    ok = [a for _, a in attempts if a.status == 200]
    small = [a.seconds for size, a in attempts if a.status == 200 and size == LOAD_SIZES[0]]
    big = [a.seconds for size, a in attempts if a.status == 200 and size == LOAD_SIZES[-1]]
    read_s = [seconds for _, _, seconds, _ in reads]
    per_route = ", ".join(
        "%s p50 %.0f/p99 %.0f ms" % (path.split("&")[0], 1000 * percentile(times, 0.5),
                                     1000 * percentile(times, 0.99))
        for path, times in ((p, [s for q, _, s, _ in reads if q == p]) for p in READS))
    print("%s: %d posts answered 200 (%.1f MiB) in %.1f s, %d retried after 503, 0 failed; "
          "folded after a later delivery (not yet visible, WARNed): %d; final drain %.1f s; "
          "objects %d; wall %.1f s"
          % (label, len(ok), sum(s.size for s in sent) / MIB, posted, out["retries"],
             len(late), drained, figures["objects"], time.monotonic() - started))
    print("%s: post latency p50 %.0f ms, p99 %.0f ms (1 KiB: p50 %.0f/p99 %.0f ms; 3 MiB: "
          "p50 %.0f/p99 %.0f ms); read latency over %d reads p50 %.0f ms, p99 %.0f ms"
          % (label, 1000 * percentile([a.seconds for a in ok], 0.5),
             1000 * percentile([a.seconds for a in ok], 0.99),
             1000 * percentile(small, 0.5), 1000 * percentile(small, 0.99),
             1000 * percentile(big, 0.5), 1000 * percentile(big, 0.99),
             len(reads), 1000 * percentile(read_s, 0.5), 1000 * percentile(read_s, 0.99)))
    print("%s: reads by route: %s" % (label, per_route))


def test_rely_6_1_eight_clients_and_a_reader(serve_process, data_dir, tmp_path, load_bodies):
    """WHEN 8 clients post 15 deliveries each (1 KiB-3 MiB) while the dashboard routes are read
    without pause, THEN every post and read is answered 200, everything is folded in the
    journal order the journal allowed, and the store equals a fresh reindex."""
    load(serve_process, data_dir, tmp_path, load_bodies, per_client=15, drain_timeout=120,
         label="RELY-6.1")


@pytest.mark.torture
def test_rely_6_2_eight_clients_five_hundred_deliveries_each(serve_process, data_dir, tmp_path,
                                                            load_bodies):
    """WHEN 8 clients post 500 deliveries each under RELY-6.1's reading, THEN RELY-6.1's
    promises hold."""
    load(serve_process, data_dir, tmp_path, load_bodies, per_client=500, drain_timeout=300,
         label="RELY-6.2")
