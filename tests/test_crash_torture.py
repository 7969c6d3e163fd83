"""Crash torture (RELY-1): a real ``serve`` subprocess receiving HAE bodies from several
client threads is SIGKILLed at random moments, again and again, and restarted on the same
data directory. Nothing that was answered 200 may be lost or changed, no upload may survive
in ``DATA/tmp``, no delivery may be half folded, and at the end the backlog drains, ``verify``
passes and the live fingerprint equals a fresh ``reindex``.

The seed is drawn anew each run, printed and named in every assertion message; set
``HEALTHLOG_TORTURE_SEED`` to run one again (thread timing still differs between runs).
Its bodies, client and checks are tests/load_helpers.py's, shared with tests/test_load.py.
"""

import dataclasses
import hashlib
import itertools
import os
import random
import threading
import time
from pathlib import Path

import pytest

from conftest import run_cli
from load_helpers import (HEADERS, KIB, MIB, SEED_ENV, Acknowledged, Bodies, archive_bodies,
                          check_store_matches_rebuild, half_folded, logged, lost_deliveries,
                          snapshot_rows, timed_post, tmp_entries, wait_drained)

pytestmark = pytest.mark.json_agnostic

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
        answer = timed_post(port, body, HEADERS)
        with lock:
            if answer.status == 200:
                sent.append(Acknowledged(answer.delivery_id, digest, len(body), serial))
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
    exhausted = [i for (i, error) in snapshot_rows(
        data_dir, "SELECT id, error FROM delivery WHERE parse_status = 'failed'")
        if error == "fold_attempts_exhausted"]
    if exhausted:
        refolded = run_cli("refold", "--data", data_dir, "--failed", timeout=60)
        assert refolded.returncode == 0, refolded.stderr
        serve = serve_process(data_dir)
        logs.append(serve.log_path)
        wait_drained(data_dir, drain_timeout, context)
        assert serve.terminate() == 0, "%s: serve did not stop in order" % context
    statuses = dict(snapshot_rows(data_dir, "SELECT id, parse_status FROM delivery"))
    not_parsed = sorted((item.delivery_id, statuses[item.delivery_id]) for item in sent
                        if statuses[item.delivery_id] != "parsed")
    assert not not_parsed, "%s: acknowledged deliveries not parsed: %s" % (
        context, not_parsed[:20])
    halves = half_folded(data_dir)
    assert not halves, "%s: half-folded deliveries:\n%s" % (context, "\n".join(halves[:20]))
    journaled = {row[0] for row in snapshot_rows(data_dir, "SELECT archive_path FROM delivery")}
    missing = sorted(p for p in journaled if not (data_dir / p).is_file())
    assert not missing, "%s: journal rows without their body: %s" % (context, missing[:20])
    orphans = archive_bodies(data_dir) - journaled
    errors = [r for r in logged(logs)
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
