"""READ-9.2: the Grafana dashboard of contrib/ against a store fed as the README advises, by
a Minutes and a Days automation, asked for the ranges a person looks at.

Every `/api/points` and `/api/deliveries` query of contrib/grafana/healthlog-infinity.json
is sent the way Grafana's Infinity backend sends it (its URL parameters with `${__from}` and
`${__to}` in epoch milliseconds, `${tz}` and `${metric}` filled in) to a real server on
127.0.0.1:0, and its root selector and columns are applied to the answer. The counts the
answers must have are the test's own, from the bodies it posted.
"""

import datetime as dt
import json
import urllib.parse

import pytest

import hae_factory as hf
from conftest import ROOT, Client, db_rows, wait_for
from read_helpers import select, serve_corpus

DASHBOARD = ROOT / "contrib" / "grafana" / "healthlog-infinity.json"
NEW_YORK = hf.Zone("America/New_York", -300, -240, "us")
NOW = dt.datetime(2025, 4, 20, 15, 0, tzinfo=dt.timezone.utc)  # 11:00 in New York
MINUTES = {"automation-name": "Fast", "automation-aggregation": "Minutes"}
DAYS = {"automation-name": "Daily", "automation-aggregation": "Days"}


def targets() -> list:
    dashboard = json.loads(DASHBOARD.read_text())
    return [(panel["title"], target) for panel in dashboard["panels"]
            for target in panel.get("targets", [])]


def ny_local(day: dt.date, hour: int = 0, minute: int = 0) -> str:
    moment = dt.datetime(day.year, day.month, day.day, hour, minute)
    offset = -240 if dt.date(2025, 3, 9) <= day < dt.date(2025, 11, 2) else -300
    return "%s %s%02d%02d" % (moment.strftime("%Y-%m-%d %H:%M:%S"), "-" if offset < 0 else "+",
                              abs(offset) // 60, abs(offset) % 60)


@pytest.fixture(scope="module")
def fed(tmp_path_factory):
    """60 days of daily steps (a Days automation, one point at each local midnight) and the
    last 2 days by the minute, steps and heart rate (a Minutes automation), and a week of
    sleep summaries, posted to a serve process and folded (the store's corpus: the days)."""
    today = dt.date(2025, 4, 20)
    days = [today - dt.timedelta(days=n) for n in range(60, -1, -1)]
    daily = [{"date": ny_local(day), "qty": 5000 + day.day * 100, "source": "Watch"}
             for day in days]
    deliveries = [(DAYS, hf.dumps_hae(hf.envelope(metrics=[hf.metric(
        "step_count", daily, "count")])))]
    for day in (today - dt.timedelta(days=1), today):
        last = 24 * 60 if day < today else 11 * 60
        steps = [{"date": ny_local(day, m // 60, m % 60), "qty": 10 + m % 7, "source": "Watch"}
                 for m in range(0, last, 3)]
        heart = [{"date": ny_local(day, m // 60, m % 60), "Min": 55, "Avg": 60 + m % 9,
                  "Max": 80, "source": "Watch"} for m in range(0, last, 5)]
        # Active energy in kcal yesterday and in kJ today: the phone's unit setting changed.
        energy_units = "kcal" if day < today else "kJ"
        energy = [{"date": ny_local(day, m // 60, m % 60), "qty": 3 + m % 4, "source": "Watch"}
                  for m in range(0, last, 10)]
        deliveries.append((MINUTES, hf.dumps_hae(hf.envelope(metrics=[
            hf.metric("step_count", steps, "count"),
            hf.metric("heart_rate", heart, "count/min"),
            hf.metric("active_energy", energy, energy_units)]))))
    nights = [{"date": ny_local(day, 7), "sleepStart": ny_local(day - dt.timedelta(days=1), 23),
               "sleepEnd": ny_local(day, 7), "inBed": 8.2, "totalSleep": 7.5, "asleep": 0,
               "core": 4.0, "deep": 1.5, "rem": 2.0, "awake": 0.3, "source": "Watch"}
              for day in days[-7:]]
    deliveries.append((DAYS, hf.dumps_hae(hf.envelope(metrics=[hf.metric(
        "sleep_analysis", nights, "hr")]))))
    yield from serve_corpus(tmp_path_factory.mktemp("grafana"), days, deliveries)


def grafana_url(target: dict, start: dt.datetime, end: dt.datetime, tz: str,
                metric: str) -> str:
    """The URL Infinity's backend asks for: the panel's parameters, its variables filled."""
    values = {"${__from}": str(int(start.timestamp() * 1000)),
              "${__to}": str(int(end.timestamp() * 1000)), "${tz}": tz, "${metric}": metric}
    params = [(p["key"], values.get(p["value"], p["value"]))
              for p in target["url_options"]["params"]]
    return target["url"] + "?" + urllib.parse.urlencode(params)


def column(item: dict, selector: str):
    for part in selector.split("."):
        item = item.get(part) if isinstance(item, dict) else None
    return item


@pytest.mark.parametrize("span,expected", [
    (dt.timedelta(days=30), {"Steps per day ($tz)": 30, "Sleep per night ($tz)": 7}),
    (dt.timedelta(hours=24), {"Steps per hour": 24, "Heart rate per hour (avg, min, max)": 24,
                              "$metric per hour (qty)": 24}),
    (dt.timedelta(days=2), {"Steps per day ($tz)": 2, "Steps per hour": 35}),
], ids=["30-days", "24-hours", "2-days"])
def test_read_9_2_grafana_panels_answer_real_ranges_of_a_minutes_and_days_store(
        fed, span, expected):
    """WHEN each query of the dashboard is sent for the last 30 days, 24 hours and 2 days of
    a store fed by a Days and a Minutes automation, with tz=local
    THEN each answers 200, its selectors find a timestamp and a number in every row, and the
    panels this range is for have the rows the test counts: a bucket per local day (Days
    layer for 30 days, minutes for 2), per local hour, and per night."""
    client, days = fed.client, fed.corpus
    end = NOW
    start = end - span
    rows_of = {}
    for title, target in targets():
        reply = client.request("GET", grafana_url(target, start, end, "local", "step_count"))
        assert reply[0] == 200, (title, reply)
        rows = select(reply[1], target["root_selector"])
        for row in rows:
            for col in target["columns"]:
                value = column(row, col["selector"])
                if col["type"] == "timestamp":
                    assert value and value.endswith("Z"), (title, col, row)
                elif col["type"] == "number" and col["selector"].startswith("fields."):
                    assert isinstance(value, (int, float)) or value is None, (title, col, row)
        rows_of[title] = rows
    for title, count in expected.items():
        assert len(rows_of[title]) >= count, (title, len(rows_of[title]))
        numbers = [column(row, "fields.qty.sum") or column(row, "fields.Avg.avg")
                   or column(row, "asleep") for row in rows_of[title]]
        assert all(isinstance(n, (int, float)) and n > 0 for n in numbers), (title, numbers)
    if "Steps per day ($tz)" in expected and span.days >= 30:
        by_date = {row["date"]: row["fields"]["qty"]["sum"] for row in rows_of[
            "Steps per day ($tz)"]}
        for day in days[-30:-2]:  # whole days of the Days layer, on their written dates
            assert by_date[day.isoformat()] == 5000 + day.day * 100, day


def panel(title: str) -> dict:
    [target] = [t for name, t in targets() if name == title]
    return target


def test_read_17_5_a_per_hour_panel_on_day_only_data_answers_days(fed):
    """WHEN the "Steps per hour" panel's exact request covers 24 hours ten days back, where
    only the Days automation sent steps (one point at each local midnight)
    THEN the reply says it answered per day, with a note, and the one row stands at that
    local midnight with that day's steps, not as an hour."""
    day = dt.date(2025, 4, 10)
    start = dt.datetime(2025, 4, 10, 4, 0, tzinfo=dt.timezone.utc)  # local midnight (-04:00)
    status, reply = fed.client.request("GET", grafana_url(panel("Steps per hour"), start,
                                                          start + dt.timedelta(hours=24),
                                                          "local", "step_count"))
    assert status == 200
    assert (reply["layer"], reply["bucket"]) == ("days", "day") and "per day" in reply["note"]
    rows = select(reply, panel("Steps per hour")["root_selector"])
    assert [(row["start"], row["date"], row["fields"]["qty"]["sum"]) for row in rows] == [
        ("2025-04-10T04:00:00Z", day.isoformat(), 5000 + day.day * 100)]


def test_read_17_5_the_metric_panel_draws_one_series_per_unit(fed):
    """WHEN the "$metric per hour (qty)" panel asks for active energy over two days in which
    the phone switched from kcal to kJ
    THEN every row carries its units, and the panel's partition by units gives two series,
    kcal for yesterday's hours and kJ for today's, each with its own hours' sums."""
    target = panel("$metric per hour (qty)")
    dashboard = json.loads(DASHBOARD.read_text())
    [spec] = [p for p in dashboard["panels"] if p["title"] == "$metric per hour (qty)"]
    assert spec["transformations"] == [{"id": "partitionByValues",
                                        "options": {"fields": ["units"], "keepFields": False}}]
    assert {"selector": "units", "text": "units", "type": "string"} in target["columns"]
    start = dt.datetime(2025, 4, 19, 4, 0, tzinfo=dt.timezone.utc)
    status, reply = fed.client.request("GET", grafana_url(target, start, NOW, "local",
                                                          "active_energy"))
    assert status == 200
    series = {}
    for row in select(reply, target["root_selector"]):
        series.setdefault(column(row, "units"), []).append(row)
    assert set(series) == {"kcal", "kJ"}
    assert {row["date"] for row in series["kcal"]} == {"2025-04-19"}
    assert {row["date"] for row in series["kJ"]} == {"2025-04-20"}
    hour_sum = sum(3 + m % 4 for m in range(0, 60, 10))  # six points an hour
    assert all(row["fields"]["qty"]["sum"] == hour_sum for rows in series.values()
               for row in rows)
    assert (len(series["kcal"]), len(series["kJ"])) == (24, 11)


def test_read_17_5_the_metric_variable_offers_only_what_the_panel_can_draw(fed):
    dashboard = json.loads(DASHBOARD.read_text())
    [variable] = [v for v in dashboard["templating"]["list"] if v["name"] == "metric"]
    query = variable["query"]["infinityQuery"]
    url = query["url"] + "?" + urllib.parse.urlencode(
        [(p["key"], p["value"]) for p in query["url_options"]["params"]])
    status, reply = fed.client.request("GET", url)
    assert status == 200
    offered = {item["metric"] for item in select(reply, query["root_selector"])}
    # not sleep_analysis, and not heart_rate: its points carry Avg, Min and Max, not the qty
    # the panel draws (its own panel draws them)
    assert offered == {"step_count", "active_energy"}
    target = panel("$metric per hour (qty)")
    drawn = [col["selector"] for col in target["columns"] if col["type"] == "number"
             and col["selector"].startswith("fields.")]
    assert drawn and all(selector.startswith("fields.qty.") for selector in drawn)
    start = dt.datetime(2025, 4, 19, 4, 0, tzinfo=dt.timezone.utc)
    for metric in sorted(offered) + ["heart_rate"]:
        status, answer = fed.client.request("GET", grafana_url(target, start, NOW, "local",
                                                               metric))
        rows = select(answer, target["root_selector"])
        numbers = [column(row, selector) for row in rows for selector in drawn]
        if metric in offered:  # every offered metric draws a number in every row
            assert rows and all(isinstance(n, (int, float)) for n in numbers), metric
        else:  # what the variable no longer offers would have drawn nothing
            assert rows and all(n is None for n in numbers), metric
    heart = panel("Heart rate per hour (avg, min, max)")
    status, answer = fed.client.request("GET", grafana_url(heart, start, NOW, "local", ""))
    assert all(isinstance(column(row, "fields.Avg.avg"), (int, float))
               for row in select(answer, heart["root_selector"]))


def test_read_9_2_the_dashboard_sends_tz_local_by_default():
    dashboard = json.loads(DASHBOARD.read_text())
    [tz] = [v for v in dashboard["templating"]["list"] if v["name"] == "tz"]
    assert tz["current"]["value"] == "local"
    for title, target in targets():
        if target["url"] == "/api/points":
            assert {"key": "tz", "value": "${tz}"} in target["url_options"]["params"], title
            assert not any(p["key"] == "layer" for p in target["url_options"]["params"]), title


def test_read_2_8_days_a_layer_lacks_are_filled_from_another(start_service, data_dir):
    """WHEN a Days automation stopped five days ago and a Minutes one has run for the last
    seven, and steps are read per day over forty days without a layer
    THEN every day with data has its bucket: the days layer's value where it has one, the
    minutes' sum where it has none; and the reply names both layers."""
    client = Client(*start_service().address)
    today = dt.date(2025, 4, 20)
    days = [today - dt.timedelta(days=n) for n in range(39, 4, -1)]  # up to 5 days ago
    daily = {day: 6000 + day.day * 10 for day in days}
    assert client.ingest(hf.dumps_hae(hf.envelope(metrics=[hf.metric("step_count", [
        {"date": ny_local(day), "qty": qty} for day, qty in daily.items()], "count")])),
        headers=DAYS)[0] == 200
    sums = {}
    for day in (today - dt.timedelta(days=n) for n in range(6, -1, -1)):
        points = [{"date": ny_local(day, m // 60, m % 60), "qty": 7 + m % 5}
                  for m in range(0, 24 * 60, 10)]
        sums[day] = sum(p["qty"] for p in points)
        assert client.ingest(hf.dumps_hae(hf.envelope(metrics=[hf.metric(
            "step_count", points, "count")])), headers=MINUTES)[0] == 200
    wait_for(lambda: {r["parse_status"] for r in db_rows(data_dir)} == {"parsed"},
             what="the deliveries are folded")
    status, reply = client.request("GET", "/api/points?metric=step_count&bucket=day"
                                          "&from=2025-03-12&to=2025-04-20")
    assert status == 200 and (reply["layer"], reply["layers"]) == ("days", ["days", "minutes"])
    got = {b["date"]: b["fields"]["qty"]["sum"] for run in reply["runs"] for b in run["buckets"]}
    want = {day.isoformat(): qty for day, qty in daily.items()}
    want.update({day.isoformat(): total for day, total in sums.items()
                 if day.isoformat() not in want})
    assert got == {d: v for d, v in want.items() if "2025-03-12" <= d <= "2025-04-20"}
