"""READ-1.3: `healthlog catalog` prints what /api/catalog answers, beside a running serve,
and `export` of an unknown metric points to it (openspec/specs/read/spec.md)."""

import json
import re
import subprocess
import sys

import hae_factory as hf
import healthlog
from conftest import ROOT, Client, db_rows, wait_for


def run_cli(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "healthlog.py")] + [str(a) for a in args],
                          capture_output=True, text=True, timeout=60)


def test_read_1_3_the_catalog_command_prints_what_the_route_answers(start_service, data_dir):
    service = start_service()
    client = Client(*service.address)
    steps = [{"date": "2025-04-15 00:%02d:00 -0400" % m, "qty": 1000 + m} for m in range(3)]
    energy = [{"date": "2025-04-15 00:%02d:00 -0400" % m, "qty": 1.5} for m in range(2)]
    body = hf.dumps_hae(hf.envelope(metrics=[hf.metric("step_count", steps, "count"),
                                             hf.metric("dietary_energy", energy, "kcal")]))
    assert client.ingest(body, headers={"automation-aggregation": "Minutes"})[0] == 200
    wait_for(lambda: db_rows(data_dir)[0]["parse_status"] == "parsed", what="the fold")
    route = client.request("GET", "/api/catalog")[1]

    as_json = run_cli("catalog", "--data", data_dir, "--json")
    table = run_cli("catalog", "--data", data_dir)

    assert as_json.returncode == table.returncode == 0, as_json.stderr + table.stderr
    assert json.loads(as_json.stdout) == route
    lines = table.stdout.splitlines()
    assert lines[0].split() == ["METRIC", "LAYER", "UNITS", "FIRST", "LAST", "POINTS", "WHAT"]
    rows = {line.split()[0]: line for line in lines[1:]}
    assert set(rows) == {"dietary_energy", "step_count"}
    assert re.search(r"step_count\s+minutes\s+count\s+2025-04-15T04:00\s+2025-04-15T04:02\s+3"
                     r"\s+Steps \(total\)$", rows["step_count"]), rows["step_count"]
    assert rows["dietary_energy"].endswith("Energy consumed (total)")

    unknown = run_cli("export", "--data", data_dir, "--metric", "no_such_metric")
    assert unknown.returncode == 2 and unknown.stdout == ""
    assert "healthlog catalog" in unknown.stderr and unknown.stderr.count("\n") == 1


def test_read_1_3_an_empty_store_says_so(tmp_path):
    config = healthlog.Config(data_dir=tmp_path)
    healthlog.ensure_data_dir(tmp_path)
    healthlog.open_database(config).close()
    result = run_cli("catalog", "--data", tmp_path)
    assert result.returncode == 0 and "nothing has been folded yet" in result.stdout
