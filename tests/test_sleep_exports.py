"""Exports date a sleep on its wake day and carry its hours (READ-12.5): the SQLite export's
``nights`` table and ``points`` rows, raw CSV and the day buckets' CSV, through a real server
and the real ``healthlog export``.

The phone is in America/New_York across the spring DST change (2025-03-09). Its summaries are
HAE >= 6.6.2 with a Watch (``totalSleep`` beside ``asleep: 0``) whose ``date`` is the sleep
start the evening before, as HAE wrote on 43 of 91 real nights of one person. Beside them:
two afternoon naps back to back on 2025-03-08 (15:59-17:28 and 17:28-18:26), and on
2025-03-11 AutoSleep's figure summed with the Watch's stages in one record (no
``totalSleep``): more than the night lasted. Every expected figure below is worked out here
from the records this file writes, in its own words.
"""

import csv
import datetime as dt
import io
import sqlite3

import pytest

import hae_factory as hf
from conftest import Client, db_rows, run_cli, wait_for
from read_helpers import get, local_iso

PHONE = hf.Phone(zone=hf.NEW_YORK, sources="single")
FIRST, LAST = dt.date(2025, 3, 5), dt.date(2025, 3, 13)
NAP_DAY = dt.date(2025, 3, 8)
OVERLAP_DAY = dt.date(2025, 3, 11)
AUTOSLEEP_HOURS = 7.9
NAPS = (("2025-03-08 15:59:00 -0500", "2025-03-08 17:28:00 -0500", 0.8, 0.4, 0.15),
        ("2025-03-08 17:28:00 -0500", "2025-03-08 18:26:00 -0500", 0.5, 0.3, 0.1))
"""(start, end, core, deep, rem) of the two naps as HAE summarises them."""


def _hours_between(start: str, end: str) -> float:
    parse = lambda text: dt.datetime.strptime(text, "%Y-%m-%d %H:%M:%S %z")  # noqa: E731
    return (parse(end) - parse(start)).total_seconds() / 3600


def _nap(start, end, core, deep, rem) -> dict:
    return {"date": start, "totalSleep": core + deep + rem, "asleep": 0, "core": core,
            "deep": deep, "rem": rem, "awake": 0, "inBed": _hours_between(start, end),
            "inBedStart": start, "inBedEnd": end, "sleepStart": start, "sleepEnd": end,
            "source": "Nap tester’s Apple Watch"}


def nights_and_naps() -> list:
    nights = hf.sleep_summaries(7, FIRST, LAST, phone=PHONE, form="c", date_as="start")
    for night in nights:
        if night["sleepEnd"][:10] == OVERLAP_DAY.isoformat():
            # AutoSleep beside the Watch: HAE writes the app's hours as "asleep" next to the
            # Watch's stages and no totalSleep.
            del night["totalSleep"]
            night["asleep"] = AUTOSLEEP_HOURS
            night["source"] = "AutoSleep|Nap tester’s Apple Watch|iPhone"
    return nights + [_nap(*nap) for nap in NAPS]


def expected() -> dict:
    """wake day -> what the night and its naps must read, by the rule in plain words:
    a Watch summary's hours asleep are its totalSleep; one whose asleep + core + deep + rem
    says more than the hours from sleepStart to sleepEnd is overlapping and counts the
    Watch's core + deep + rem, at most those hours; two naps are two naps, each with its
    total, apart from the night (the second starts where the first ended: HAE's boundary,
    so its start is not known)."""
    out = {}
    for night in nights_and_naps()[:-len(NAPS)]:
        wake = dt.date.fromisoformat(night["sleepEnd"][:10])
        window = _hours_between(night["sleepStart"], night["sleepEnd"])
        staged = night["core"] + night["deep"] + night["rem"]
        if "totalSleep" in night:
            asleep, overlapping = night["totalSleep"], False
        else:
            said = night["asleep"] + staged
            assert said > window  # the scenario: the two sources add up past the night
            asleep, overlapping = min(staged, window), True
        out[wake] = {"asleep": asleep, "in_bed": night["inBed"], "deep": night["deep"],
                     "core": night["core"], "rem": night["rem"], "overlapping": overlapping,
                     "sleep_start": night["sleepStart"], "sleep_end": night["sleepEnd"],
                     "naps": []}
    out[NAP_DAY]["naps"] = [{"sleep_start": start if start != NAPS[k - 1][1] or k == 0 else None,
                             "sleep_end": end, "asleep": core + deep + rem}
                            for k, (start, end, core, deep, rem) in enumerate(NAPS)]
    return out


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    """A real server holding the records, folded; then stopped, its data kept."""
    import healthlog
    from conftest import TOKEN

    data_dir = tmp_path_factory.mktemp("sleep-exports")
    config = healthlog.Config(data_dir=data_dir, host="127.0.0.1", port=0, token=TOKEN,
                              busy_timeout_s=0.5, http_timeout_s=5.0, stop_budget_s=5.0)
    service = healthlog.Service(config, announce=lambda token: None)
    service.start()
    try:
        body = hf.dumps_hae(hf.envelope(metrics=[hf.metric("sleep_analysis", nights_and_naps(),
                                                           "hr")]))
        assert Client(*service.address).ingest(body, headers={
            "automation-aggregation": "Days"})[0] == 200
        wait_for(lambda: db_rows(data_dir)[0]["parse_status"] == "parsed")
        day_csv = get(service.address, "/api/points", metric="sleep_analysis", bucket="day",
                      format="csv").body.decode()
        raw_csv = get(service.address, "/api/points", metric="sleep_analysis",
                      format="csv").body.decode()
    finally:
        assert service.stop()
    out = data_dir.parent / "export.sqlite"
    run = run_cli("export", "--data", data_dir, "--format", "sqlite", out)
    assert run.returncode == 0, run.stderr
    return {"day_csv": day_csv, "raw_csv": raw_csv, "sqlite": out}


def test_read_12_5_the_sqlite_nights_table_has_each_night_and_nap_on_its_wake_day(exports):
    with sqlite3.connect(str(exports["sqlite"])) as conn:
        conn.row_factory = sqlite3.Row
        rows = [dict(r) for r in conn.execute("SELECT * FROM nights ORDER BY date, kind")]
    want = expected()
    nights = [r for r in rows if r["kind"] == "night"]
    assert [dt.date.fromisoformat(r["date"]) for r in nights] == sorted(want)
    for row in nights:
        night = want[dt.date.fromisoformat(row["date"])]
        for key in ("asleep", "in_bed", "deep", "core", "rem"):
            assert row[key] == pytest.approx(night[key], abs=1e-9), (row["date"], key)
        assert row["overlapping"] == int(night["overlapping"])
        assert (row["sleep_start"], row["sleep_end"]) == (local_iso(night["sleep_start"]),
                                                          local_iso(night["sleep_end"]))
        assert row["asleep"] <= _hours_between(night["sleep_start"], night["sleep_end"]) + 1e-9
    naps = [r for r in rows if r["kind"] == "nap"]
    assert len(naps) == len(want[NAP_DAY]["naps"]) == 2
    for nap, nap_want in zip(sorted(naps, key=lambda r: r["sleep_end"]), want[NAP_DAY]["naps"]):
        assert nap["date"] == NAP_DAY.isoformat()
        assert (nap["sleep_start"], nap["sleep_end"]) == (local_iso(nap_want["sleep_start"]),
                                                          local_iso(nap_want["sleep_end"]))
        assert nap["asleep"] == pytest.approx(nap_want["asleep"], abs=1e-9)


def test_read_12_5_sleep_rows_of_points_and_raw_csv_are_dated_on_the_wake_day(exports):
    """HAE's ``date`` here is the evening before; every export dates the row by the
    morning the sleep ended (its sleepEnd's date)."""
    wake_days = sorted(r["sleepEnd"][:10] for r in nights_and_naps())
    with sqlite3.connect(str(exports["sqlite"])) as conn:
        dates = sorted(d for (d,) in conn.execute(
            "SELECT local_date FROM points WHERE metric = 'sleep_analysis'"))
    assert dates == wake_days
    raw = list(csv.DictReader(io.StringIO(exports["raw_csv"])))
    assert sorted(r["local_date"] for r in raw) == wake_days
    assert all(r["date"][:10] != r["local_date"] for r in raw
               if r["sleepStart"][:10] != r["sleepEnd"][:10])  # the evening's date: not used


def test_read_12_5_day_csv_carries_the_nights_hours_naps_and_overlap(exports):
    rows = list(csv.DictReader(io.StringIO(exports["day_csv"])))
    want = expected()
    assert [dt.date.fromisoformat(r["date"]) for r in rows] == sorted(want)
    for row in rows:
        night = want[dt.date.fromisoformat(row["date"])]
        assert float(row["asleep"]) == pytest.approx(night["asleep"], abs=1e-9)
        for stage in ("deep", "core", "rem"):
            assert float(row[stage]) == pytest.approx(night[stage], abs=1e-9)
        assert row["overlapping"] == str(int(night["overlapping"]))
        assert int(row["naps"]) == len(night["naps"])
        if night["naps"]:
            assert float(row["nap_hours"]) == pytest.approx(sum(n["asleep"]
                                                                for n in night["naps"]))
        else:
            assert row["nap_hours"] == ""
    assert list(rows[0])[7:10] == ["deep", "core", "rem"]  # deepest first, as drawn
