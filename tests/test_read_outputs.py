"""What the commands and the journal write: a receive time in one form everywhere (READ-5.6).

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
    service.worker.gate.clear()
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
