"""What the commands and the journal write: a receive time in one form everywhere (READ-5.6),
and every command that writes to standard output ends quietly when its reader has gone
(READ-8.7: ``healthlog export … | head -1``, ``healthlog catalog | head``).

The receive times are set by the service's injected clock (``Config.clock``) and by an
imported file's modification time, both with microseconds that end in zeros, which a
shortened form would drop.
"""

import datetime as dt
import json
import os
import re
import subprocess
import sys

import pytest

import hae_factory as hf
from conftest import Client, db_rows, wait_for

JOURNAL_FORM = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{6}Z")
"""The journal's one form: six digits of microseconds, trailing zeros kept."""
RECEIVED = dt.datetime(2026, 12, 5, 18, 3, 35, 413920, tzinfo=dt.timezone.utc)
IMPORTED = dt.datetime(2026, 12, 4, 7, 0, 1, 250000, tzinfo=dt.timezone.utc)
SAFETY = hf.Automation("Safety net", "Minutes", "Previous 7 Days")


def _text(moment: dt.datetime) -> str:
    return moment.strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def test_read_5_6_a_receive_time_is_written_in_one_form_everywhere(start_service, data_dir,
                                                                    tmp_path):
    """Two deliveries received at …35.413920 (one folded, one left pending) and an import of
    a file made at …01.250000: /api/deliveries, /api/freshness, ``status --json`` and
    ``status`` give each receive time with its six digits."""
    clock_at = [RECEIVED.timestamp()]
    service = start_service(paused=True, clock=lambda: clock_at[0])
    client = Client(*service.address)
    body = hf.dumps_hae(hf.canary_payload(1, dt.date(2026, 12, 5)))
    for _ in range(3):  # three runs: an automation with a usual interval
        assert client.ingest(body, headers=hf.headers_for(SAFETY))[0] == 200
    rows = db_rows(data_dir)
    assert [row["received_at"] for row in rows] == [_text(RECEIVED)] * 3
    export = tmp_path / "export.json"
    export.write_bytes(body)
    os.utime(export, ns=(int(IMPORTED.timestamp()) * 10**9 + 250_000_000,) * 2)
    imported = subprocess.run([sys.executable, "-m", "healthlog", "import", "--data",
                               str(data_dir), str(export)], capture_output=True, timeout=60)
    assert imported.returncode == 0, imported.stderr
    service.worker.gate.set()
    wait_for(lambda: all(r["parse_status"] != "pending" for r in db_rows(data_dir)),
             what="every delivery folded")
    # one more, left pending: status names the oldest pending by its receive time
    service.worker.hold()
    clock_at[0] = RECEIVED.timestamp() + 60  # …36:35.413920
    assert client.ingest(body, headers=hf.headers_for(SAFETY))[0] == 200
    later = _text(RECEIVED + dt.timedelta(seconds=60))

    status, journal = client.request("GET", "/api/deliveries")
    assert status == 200
    received = [item["received_at"] for item in journal["deliveries"]]
    assert received == [later, _text(RECEIVED), _text(RECEIVED), _text(RECEIVED),
                        _text(IMPORTED)]
    folded = [item["folded_at"] for item in journal["deliveries"] if item["folded_at"]]
    assert len(folded) == 4 and all(JOURNAL_FORM.fullmatch(text) for text in folded)
    status, fresh = client.request("GET", "/api/freshness")
    assert [a["last_delivery"] for a in fresh["automations"]] == [later]

    result = subprocess.run([sys.executable, "-m", "healthlog", "status", "--json", "--data",
                             str(data_dir)], capture_output=True, timeout=60)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert (report["last_delivery"], report["oldest_pending"]) == (later, later)
    assert [a["last_delivery"] for a in report["freshness"]["automations"]] == [later]
    text = subprocess.run([sys.executable, "-m", "healthlog", "status", "--data",
                           str(data_dir)], capture_output=True, text=True, timeout=60)
    assert "last delivery: %s" % later in text.stdout
    service.worker.gate.set()


# -- READ-8.7: a closed pipe ends a command quietly ----------------------------------------

@pytest.fixture(scope="module")
def filled(tmp_path_factory):
    """A data directory holding four days of steps by the minute (some 400 KiB as JSON, well
    over a pipe's 64 KiB), imported: no server runs, so the commands that take the lock run
    too."""
    base = tmp_path_factory.mktemp("pipes")
    export = base / "days.json"
    first = dt.datetime(2026, 12, 2)
    steps = [{"date": (first + dt.timedelta(minutes=n)).strftime("%Y-%m-%d %H:%M:00 -0800"),
              "qty": n % 90, "source": "Watch"} for n in range(4 * 1440)]
    export.write_bytes(hf.dumps_hae(hf.envelope(metrics=[hf.metric("step_count", steps,
                                                                   "count")])))
    data_dir = base / "data"
    result = subprocess.run([sys.executable, "-m", "healthlog", "import", "--data",
                             str(data_dir), "--aggregation", "Minutes", str(export)],
                            capture_output=True, timeout=60)
    assert result.returncode == 0, result.stderr
    folded = subprocess.run([sys.executable, "-m", "healthlog", "reindex", "--data",
                             str(data_dir)], capture_output=True, timeout=120)
    assert folded.returncode == 0, folded.stderr
    return base, data_dir, export


def _closed_at_once(args: list) -> subprocess.CompletedProcess:
    """The command with a standard output whose reader has gone before it writes."""
    read, write = os.pipe()
    os.close(read)
    try:
        return subprocess.run([sys.executable, "-m", "healthlog"] + [str(a) for a in args],
                              stdout=write, stderr=subprocess.PIPE, timeout=120)
    finally:
        os.close(write)


def _quiet(result: subprocess.CompletedProcess, code: int, what) -> None:
    assert result.returncode == code, (what, result.returncode, result.stderr)
    assert result.stderr == b"", (what, result.stderr)


def test_read_8_7_a_command_that_prints_ends_quietly_when_its_reader_has_gone(filled):
    """``export … | head -1`` (CSV; JSON, one line, read in part), and
    every command that only prints with its reader gone before it writes: exit 141 (128 +
    SIGPIPE, as a shell reports a Unix tool that SIGPIPE ended), nothing on stderr."""
    _, data_dir, _ = filled
    for fmt in ("json", "csv"):
        command = [sys.executable, "-m", "healthlog", "export", "--data", str(data_dir),
                   "--metric", "step_count", "--format", fmt]
        whole = subprocess.run(command, capture_output=True, timeout=60)
        assert whole.returncode == 0 and len(whole.stdout) > 256 << 10, len(whole.stdout)
        head = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        # what `head -1` does once it has its line (JSON is one line: `head -c 1000`)
        first = head.stdout.readline() if fmt == "csv" else head.stdout.read(1000)
        head.stdout.close()
        head.wait(timeout=60)
        assert first and whole.stdout.startswith(first)
        assert (head.returncode, head.stderr.read()) == (141, b""), fmt
        head.stderr.close()
    for args in (["export", "--data", data_dir, "--metric", "step_count"],
                 ["export", "--data", data_dir, "--metric", "step_count", "--format", "csv"],
                 ["catalog", "--data", data_dir], ["catalog", "--json", "--data", data_dir],
                 ["status", "--data", data_dir], ["status", "--json", "--data", data_dir]):
        _quiet(_closed_at_once(args), 141, args)
    for args in (["--help"], ["export", "--help"], ["--version"]):  # argparse's own: quiet,
        result = _closed_at_once(args)  # 0 where it ignores the error itself (Python 3.12)
        assert result.returncode in (0, 141) and result.stderr == b"", (args, result)


def test_read_8_7_a_command_that_does_work_finishes_it_when_its_reader_has_gone(filled,
                                                                                tmp_path):
    """import, refold, verify and reindex with their reader gone: the work is done (the file
    imported, the store rebuilt), nothing on stderr, each command's own exit code."""
    _, data_dir, export = filled
    copy = tmp_path / "again.json"
    copy.write_bytes(export.read_bytes().replace(b"2026-12-05", b"2026-12-07"))
    before = db_rows(data_dir, "SELECT count(*) AS n FROM delivery")[0]["n"]
    _quiet(_closed_at_once(["import", "--data", data_dir, "--aggregation", "Minutes", copy]),
           0, "import")
    assert db_rows(data_dir, "SELECT count(*) AS n FROM delivery")[0]["n"] == before + 1
    _quiet(_closed_at_once(["refold", "--failed", "--data", data_dir]), 0, "refold")
    _quiet(_closed_at_once(["reindex", "--data", data_dir]), 0, "reindex")
    assert {row["parse_status"] for row in db_rows(data_dir)} == {"parsed"}
    _quiet(_closed_at_once(["verify", "--data", data_dir]), 0, "verify")
