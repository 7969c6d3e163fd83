"""READ-1.3, 1.4: `healthlog catalog` prints what /api/catalog answers, beside a running
serve, its first and last in the phone's own local time; READ-8.6: `export`'s errors point
to it, not to /api/catalog (openspec/specs/read/spec.md)."""

import datetime as dt
import json
import re

import hae_factory as hf
import healthlog
from conftest import Client, db_rows, run_cli, wait_for


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
    # first and last as the phone wrote them (00:00 and 00:02 at -04:00), not UTC's 04:00
    assert re.search(r"step_count\s+minutes\s+count\s+2025-04-15T00:00-04:00\s+"
                     r"2025-04-15T00:02-04:00\s+3\s+Steps \(total\)$", rows["step_count"]), \
        rows["step_count"]
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


def minute_as_written(text: str) -> str:
    """HAE's ``2024-11-06 00:00:00 +1100`` as ``2024-11-06T00:00+11:00``."""
    moment = dt.datetime.strptime(text, "%Y-%m-%d %H:%M:%S %z")
    return moment.isoformat(timespec="minutes")


def test_read_1_4_the_catalog_table_shows_first_and_last_as_the_phone_wrote_them(
        start_service, data_dir):
    """A Sydney phone's Days export from 6 November 2024: its first point, local midnight
    at +11:00, is 13:00 UTC on the 5th. The table shows the 6th, as written, with the
    offset; --json stays the route's UTC."""
    service = start_service()
    client = Client(*service.address)
    sydney = hf.Phone(zone=hf.SYDNEY, sources="single")
    body = hf.days_export(3, dt.date(2024, 11, 6), dt.date(2024, 11, 10), phone=sydney,
                          names=("step_count",))
    sent = body["data"]["metrics"][0]["data"]
    new_york = hf.Phone(zone=hf.NEW_YORK, sources="single")
    start = dt.datetime(2025, 3, 9, 6, 58, tzinfo=dt.timezone.utc).timestamp()  # 01:58 EST
    minutes = [{"date": new_york.time(start + 60 * m), "qty": 60 + m}
               for m in range(4)]  # across the spring change: -05:00, then -04:00
    headers = hf.headers_for(hf.Automation("Daily", "Days", "Previous 7 Days"))
    assert client.ingest(hf.dumps_hae(body), headers=headers)[0] == 200
    assert client.ingest(hf.dumps_hae(hf.envelope(metrics=[hf.metric(
        "heart_rate", minutes, "count/min")])), headers={"automation-aggregation": "Minutes"}
    )[0] == 200
    wait_for(lambda: {r["parse_status"] for r in db_rows(data_dir)} == {"parsed"},
             what="the folds")
    route = client.request("GET", "/api/catalog")[1]

    table = run_cli("catalog", "--data", data_dir)
    as_json = run_cli("catalog", "--data", data_dir, "--json")

    assert table.returncode == as_json.returncode == 0, table.stderr + as_json.stderr
    assert json.loads(as_json.stdout) == route
    rows = {line.split()[0]: line.split() for line in table.stdout.splitlines()[1:]}
    first, last = sent[0]["date"], sent[-1]["date"]
    assert first.startswith("2024-11-06 00:00:00 +1100")
    assert rows["step_count"][3:5] == [minute_as_written(first), minute_as_written(last)]
    assert rows["step_count"][3] == "2024-11-06T00:00+11:00"  # not the 5th
    entry = next(e for e in route["metrics"] if e["metric"] == "step_count")
    assert entry["first"] == "2024-11-05T13:00:00Z"  # what the table used to cut to 16
    assert rows["heart_rate"][3:5] == [minute_as_written(minutes[0]["date"]),
                                       minute_as_written(minutes[-1]["date"])]
    assert rows["heart_rate"][3:5] == ["2025-03-09T01:58-05:00", "2025-03-09T03:01-04:00"]


def test_read_8_6_export_errors_name_the_catalog_command(start_service, data_dir):
    """On the command line the errors that lead to the metric names point to `healthlog
    catalog`; the route's own message keeps /api/catalog."""
    service = start_service()
    client = Client(*service.address)
    steps = [{"date": "2025-04-15 00:%02d:00 -0400" % m, "qty": 5} for m in range(2)]
    assert client.ingest(hf.dumps_hae(hf.envelope(metrics=[hf.metric(
        "step_count", steps, "count")])), headers={"automation-aggregation": "Minutes"})[0] == 200
    wait_for(lambda: db_rows(data_dir)[0]["parse_status"] == "parsed", what="the fold")
    for args in ((), ("--metric", ""), ("--format", "csv"), ("--metric", "no_such_metric"),
                 ("--metric=no_such_metric", "--format", "csv")):
        result = run_cli("export", "--data", data_dir, *args)
        assert result.returncode == 2 and result.stdout == "", (args, result)
        assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr, args
        assert "`healthlog catalog`" in result.stderr and "/api/" not in result.stderr, (
            args, result.stderr)
    status, answer = client.request("GET", "/api/points")
    assert status == 400 and "/api/catalog" in answer["error"]["message"]
    status, answer = client.request("GET", "/api/points?metric=no_such_metric")
    assert status == 404 and "/api/catalog" in answer["error"]["message"]
