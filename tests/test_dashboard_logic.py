"""The dashboard's time, tick and bucket logic, unit-tested in Chromium (READ-10.14), and
the summary page's links and sparklines (READ-16).

The functions are the page's own: healthlog.APP_JS is loaded into a blank page after the test
sets ``window.HEALTHLOG_TEST = true``, and the script then puts its pure functions on
``window.healthlogTest`` (a normal page sets no flag and exposes nothing). One file serves the
page and the test, so what is tested is exactly what runs, and the page still loads only
/static/app.js (READ-7.2). The expected values are computed here, in Python, from the
calendar and the tz database; each browser context runs in an extreme zone (+14:00, -10:00,
+05:45) so that a function that leaned on the browser's clock would give other dates.
"""

import datetime as dt
import re
from pathlib import Path
from zoneinfo import ZoneInfo

import pytest

import healthlog

ZONES = ("Pacific/Kiritimati", "Pacific/Honolulu", "Asia/Kathmandu")


@pytest.fixture(scope="module", params=ZONES)
def js(browser, request):
    """call(name, *args): window.healthlogTest[name](...args) in a page in that zone."""
    context = browser.new_context(timezone_id=request.param, locale="en-US")
    page = context.new_page()
    page.set_content("<!doctype html><title>logic</title>")
    page.evaluate("window.HEALTHLOG_TEST = true")
    page.add_script_tag(content=healthlog.APP_JS)
    assert page.evaluate("typeof window.healthlogTest") == "object"

    def call(name, *args):
        return page.evaluate("([name, args]) => window.healthlogTest[name](...args)",
                             [name, list(args)])

    def has(name):
        return page.evaluate("name => name in window.healthlogTest", name)

    def many(name, calls):
        """[window.healthlogTest[name](...args) for args in calls], in one round trip."""
        return page.evaluate("([name, calls]) => calls.map(a => window.healthlogTest[name](...a))",
                             [name, [list(a) for a in calls]])

    call.many = many
    call.has = has
    yield call
    context.close()


def iso(d: dt.date) -> str:
    return d.isoformat()


def test_read_10_14_a_normal_page_exposes_nothing(browser):
    context = browser.new_context()
    page = context.new_page()
    page.set_content("<!doctype html><title>plain</title>")
    page.add_script_tag(content=healthlog.APP_JS)
    assert page.evaluate("typeof window.healthlogTest") == "undefined"
    context.close()


def test_read_10_14_calendar_arithmetic_is_the_calendar_in_any_zone(js):
    days = [dt.date(2023, 12, 25) + dt.timedelta(days=k) for k in range(0, 800, 3)]
    shifts = [(day, n) for day in days for n in (-400, -1, 0, 1, 29, 366)]
    assert js.many("addDays", [(iso(d), n) for d, n in shifts]) == [
        iso(d + dt.timedelta(days=n)) for d, n in shifts]
    assert js.many("weekdayOf", [(iso(d),) for d in days]) == [d.weekday() for d in days]
    assert js.many("mondayOf", [(iso(d),) for d in days]) == [
        iso(d - dt.timedelta(days=d.weekday())) for d in days]
    # DST days, a leap day and the epoch's neighbours are days like any other
    for text in ("2024-03-10", "2024-03-31", "2025-04-06", "2024-02-29", "1969-12-31",
                 "1970-01-01", "2023-11-05"):
        day = dt.date.fromisoformat(text)
        assert js("addDays", text, 1) == iso(day + dt.timedelta(days=1))
        assert js("dayNumber", text) == (day - dt.date(1970, 1, 1)).days
    assert js("daysBetween", "2024-01-01", "2025-01-01") == 366
    assert js("dateSlots", "2024-03-29", "2024-04-02", "day") == [
        "2024-03-29", "2024-03-30", "2024-03-31", "2024-04-01"]
    assert js("dateSlots", "2024-03-29", "2024-04-16", "week") == [
        "2024-03-25", "2024-04-01", "2024-04-08", "2024-04-15"]


def test_read_10_14_local_times_are_read_as_written(js):
    assert js("splitLocal", "2023-11-05T01:00:00-05:00") == {
        "date": "2023-11-05", "hour": 1, "minute": 0, "time": "01:00", "offset": "-05:00",
        "offsetMs": -5 * 3600e3}
    assert js("splitLocal", "2025-04-06T02:30:00+10:00")["offsetMs"] == 10 * 3600e3
    assert js("splitLocal", "2026-01-26T16:30:00Z")["offset"] == "+00:00"
    assert js("splitLocal", "2024-03-31T03:00:00.5+05:45")["time"] == "03:00"
    assert js("splitLocal", "not a time") is None
    assert js("formatLocal", "2023-11-05T01:00:00-05:00", True) == \
        "Sun, Nov 5, 2023, 01:00 (UTC-05:00)"
    assert js("formatDate", "2024-02-29") == "Thu, Feb 29, 2024"


def test_read_17_6_the_page_draws_the_servers_plan(js):
    """planOf adds only what drawing needs to the server's plan: the date slots of a range
    of dates (its ``to`` the last day, included; weeks from their Mondays), the instants of
    a range of hours; the bucket, the layer and the bounds stay as the server chose them."""
    week = js("planOf", {"range": "1y", "bucket": "week", "axis": "dates", "layer": "days",
                         "from": "2024-12-30", "to": "2025-01-19"})
    assert (week["bucket"], week["layer"]) == ("week", "days")
    assert week["slots"] == ["2024-12-30", "2025-01-06", "2025-01-13"]
    assert (week["t0"], week["t1"]) == (None, None)
    days = js("planOf", {"range": "24h", "bucket": "day", "axis": "dates", "layer": "days",
                         "from": "2025-03-10", "to": "2025-03-10"})
    assert days["slots"] == ["2025-03-10"]
    hours = js("planOf", {"range": "24h", "bucket": "hour", "axis": "hours",
                          "layer": "minutes", "from": "2025-03-10T02:00:00Z",
                          "to": "2025-03-11T02:00:00Z"})
    start = dt.datetime(2025, 3, 10, 2, tzinfo=dt.timezone.utc).timestamp() * 1000
    assert (hours["t0"], hours["t1"], hours["slots"]) == (start, start + 86400e3, None)
    custom = js("planOf", {"range": "custom", "bucket": "hour", "axis": "hours",
                           "layer": "minutes", "from": "2023-11-05", "to": "2023-11-05"})
    assert (custom["t0"], custom["t1"], custom["slots"]) == (None, None, None)
    every = js("planOf", {"range": "all", "bucket": "week", "axis": "dates", "layer": "days",
                          "from": None, "to": None})
    assert every["slots"] is None


def test_read_10_14_hour_ticks_follow_the_phones_clock_across_dst(js):
    zone = ZoneInfo("America/New_York")
    t0 = dt.datetime(2023, 11, 5, tzinfo=zone)
    buckets = []
    for h in range(25):
        start = t0.astimezone(dt.timezone.utc) + dt.timedelta(hours=h)
        local = start.astimezone(zone)
        buckets.append({"start": start.strftime("%Y-%m-%dT%H:%M:%SZ"),
                        "local": local.isoformat()})
    begin = t0.timestamp() * 1000
    ticks = js("hourTicks", begin, begin + 25 * 3600e3, buckets, 30)
    labels = [t["label"] for t in ticks]
    expected = [b["local"][11:16] for b in buckets]
    expected[0] = "Nov 5"
    assert labels == expected  # 01:00 twice, as the phone's clock read
    assert [t["major"] for t in ticks] == [True] + [False] * 24
    fewer = js("hourTicks", begin, begin + 25 * 3600e3, buckets, 5)
    assert [t["label"] for t in fewer] == ["Nov 5", "06:00", "12:00", "18:00"]


def test_read_10_14_date_ticks_fit_the_room(js):
    month = [iso(dt.date(2024, 3, 1) + dt.timedelta(days=k)) for k in range(31)]
    ticks = js("dateTicks", month, "day", 8)
    assert [t["date"] for t in ticks] == [d for d in month
                                          if dt.date.fromisoformat(d).weekday() == 0]
    assert all(t["label"] == dt.date.fromisoformat(t["date"]).strftime("%b ") + str(
        int(t["date"][8:])) for t in ticks)
    week = month[:7]
    assert [t["label"] for t in js("dateTicks", week, "day", 8)] == [
        "%s %d" % (dt.date.fromisoformat(d).strftime("%a"), int(d[8:])) for d in week]
    weeks = [iso(dt.date(2024, 1, 1) + dt.timedelta(days=7 * k)) for k in range(53)]
    labels = [t["label"] for t in js("dateTicks", weeks, "week", 12)]
    assert labels == ["2024", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct",
                      "Nov", "Dec"]
    assert [t["label"] for t in js("dateTicks", weeks, "week", 4)] == [
        "2024", "Apr", "Jul", "Oct"]
    # a phone: one-line labels for 4 of a week's 7 days, two-line ones (weekday over day)
    # for 9: every night has its label; a fortnight in room for 7, every other day
    narrow = js("dateTicks", week, "day", 4, 9)
    assert [t["date"] for t in narrow] == week
    assert [t["lines"] for t in narrow] == [
        [dt.date.fromisoformat(d).strftime("%a"), str(int(d[8:]))] for d in week]
    fortnight = [iso(dt.date(2024, 3, 25) + dt.timedelta(days=k)) for k in range(14)]
    assert [t["date"] for t in js("dateTicks", fortnight, "day", 4, 7)] == fortnight[::2]
    assert [t["date"] for t in js("dateTicks", fortnight, "day", 4, 6)] == [
        d for d in fortnight if dt.date.fromisoformat(d).weekday() == 0]  # Mondays, as before


def test_read_10_14_value_ticks_are_round_and_cover(js):
    for lo, hi, count in ((0, 16123, 5), (48.2, 171, 4), (0, 0.7, 5), (5, 5, 4), (-3, 12, 5)):
        ticks = js("niceTicks", lo, hi, count)
        assert ticks[0] <= lo and ticks[-1] >= hi and len(ticks) <= count + 3
        steps = {round(b - a, 9) for a, b in zip(ticks, ticks[1:])}
        assert len(steps) == 1


def test_read_10_14_gaps_break_lines(js):
    points = [{"pos": p} for p in (0, 1, 2, 5, 7, 8)]
    assert [[p["pos"] for p in seg] for seg in js("segmentsOf", points)] == [
        [0, 1, 2], [5], [7, 8]]


def test_read_10_14_the_page_chooses_no_layer(js):
    """The server chooses the layer for a range (READ-2.8): the page has no function of
    its own for it any more."""
    assert js.has("chooseLayer") is False


def test_read_16_3_a_cards_link_is_the_metric_views_address(js):
    """A card's link {metric, from, to} (both dates in the range, as the server writes it
    and as a date-only ``to`` is read) opens the metric view on those dates, both shown;
    the summary's own address keeps a chosen day and a zone other than the phone's."""
    import urllib.parse
    link = {"metric": "step_count", "from": "2025-02-25", "to": "2025-03-10"}
    hash_ = js("linkHash", link, "local")
    assert hash_.startswith("#")
    assert dict(urllib.parse.parse_qsl(hash_[1:])) == {
        "metric": "step_count", "range": "custom", "from": "2025-02-25", "to": "2025-03-10",
        "tz": "local"}
    # a month's end and a DST day are days like any other
    assert "to=2024-02-29" in js("linkHash", dict(link, **{"to": "2024-02-29"}), "UTC")
    assert "to=2025-03-09" in js("linkHash", dict(link, **{"to": "2025-03-09"}), "local")
    assert js("summaryHash", None, "local") == "#view=summary"
    assert js("summaryHash", "2025-03-09", "local") == "#view=summary&date=2025-03-09"
    assert js("summaryHash", "2025-03-09", "Europe/Berlin") == \
        "#view=summary&date=2025-03-09&tz=Europe%2FBerlin"


def test_read_16_2_a_sparkline_has_gaps_never_zeros(js):
    """A day without a value has no mark and breaks the line; bars stand on 0, a line spans
    its values and the usual; a day's value is never drawn at 0."""
    days = ["2025-03-%02d" % d for d in range(1, 15)]
    values = [5, 7, None, 6, 8, None, None, 9, None, 4, 4, 6, 7, 3]
    points = [{"date": d, "value": v} for d, v in zip(days, values)]
    line = js("sparkMarks", points, False, 6, 140, 40)
    assert [m["date"] for m in line["marks"]] == [d for d, v in zip(days, values) if v is not None]
    assert [[m["date"] for m in seg] for seg in line["segments"]] == [
        days[0:2], days[3:5], days[9:14]]  # the lone 8th is a dot only
    ys = {m["value"]: m["y"] for m in line["marks"]}
    assert ys[9] == pytest.approx(3) and ys[3] == pytest.approx(37)  # the span, edge to edge
    assert line["usualY"] == pytest.approx(37 - (6 - 3) / (9 - 3) * 34)
    xs = [m["x"] for m in line["marks"]]
    assert xs[0] == pytest.approx(5) and xs[-1] == pytest.approx(135)  # a slot per day
    bars = js("sparkMarks", points, True, None, 140, 40)
    assert bars["usualY"] is None
    for m in bars["marks"]:  # from 0 up to the value
        assert m["y"] + m["h"] == pytest.approx(37)
        assert m["h"] == pytest.approx(m["value"] / 9 * 34)
    empty = js("sparkMarks", [{"date": d, "value": None} for d in days], True, None, 140, 40)
    assert empty["marks"] == [] and empty["segments"] == []


def test_read_10_14_night_bars_and_durations(js):
    """A night's bar is its stages in the server's order; the hours asleep no stage holds
    are the stage the order names ``unspecified`` (its label "asleep, no stage"), never a
    stage of the page's own; workout minutes per day are the server's (/api/workouts'
    ``buckets``, tests/test_workouts.py), the page only writes them."""
    assert js("formatMinutes", 12.0) == "12 min"
    assert js("formatHours", 7.5) == "7 h 30 min"
    # the stages in the order the server sends them (the sleep meaning's, as /api/points
    # and the summary's sleep card carry it): the bar follows it, whatever its order
    order = healthlog.meaning_of("sleep_analysis").as_json()["stages"]
    [unspecified] = [s["stage"] for s in order if s["unspecified"]]
    old = js("nightBar", {"asleep": 6.5, "in_bed": 7.25, "stages": {}}, order)
    assert old == {"parts": [{"stage": unspecified, "hours": 6.5}], "top": 6.5, "asleep": 6.5,
                   "inBed": 7.25}  # no stage hours: the hours asleep, no stage given
    # the stage of sleep no stage was given for is a stage like the others, and the
    # stages the server sends add up to the hours asleep: nothing stacks above them
    told = js("nightBar", {"asleep": 7.0, "in_bed": None, "stages": {
        "awake": 0.2, "asleep": 1.0, "rem": 1.0, "core": 4.0, "deep": 1.0}}, order)
    assert told["parts"] == [{"stage": s, "hours": h} for s, h in (
        ("deep", 1.0), ("core", 4.0), ("rem", 1.0), ("asleep", 1.0), ("awake", 0.2))]
    assert told["top"] == pytest.approx(7.2)
    staged = js("nightBar", {"asleep": 6.0, "in_bed": None, "stages": {
        "rem": 1.5, "awake": 0.25, "core": 3.0, "deep": 1.0}}, order)
    assert [p["stage"] for p in staged["parts"]] == ["deep", "core", "rem", unspecified,
                                                      "awake"]
    assert staged["parts"][3]["hours"] == pytest.approx(6.0 - 5.5)
    assert staged["inBed"] is None
    # a week's average night: its unspecified hours and those of its nights without stages
    week = js("nightBar", {"asleep": 7.0, "in_bed": None, "stages": {
        "core": 4.0, "asleep": 1.0, "awake": 0.3}}, order)
    assert week["parts"] == [{"stage": "core", "hours": 4.0},
                             {"stage": "asleep", "hours": pytest.approx(3.0)},
                             {"stage": "awake", "hours": 0.3}]
    # another order, and a stage that is not sleep in it: the bar is what the order says
    turned = [dict(s, asleep=s["stage"] != "rem") for s in reversed(order)]
    again = js("nightBar", {"asleep": 4.5, "in_bed": None, "stages": {
        "rem": 1.5, "awake": 0.25, "core": 3.0, "deep": 1.0}}, turned)
    assert [p["stage"] for p in again["parts"]] == ["awake", unspecified, "core", "deep",
                                                    "rem"]
    assert again["parts"][1]["hours"] == pytest.approx(4.5 - 4.25)
    # an order without an unspecified stage: the page adds none of its own
    bare = [s for s in order if not s["unspecified"]]
    assert [p["stage"] for p in js("nightBar", {"asleep": 6.5, "stages": {"core": 3.0}},
                                   bare)["parts"]] == ["core"]
    assert js("stagesOf", {"rem": 1.5, "new": 0.5, "deep": 0, "core": 2}, order) == [
        "core", "rem", "new"]  # an unknown stage after those listed; none of 0 hours


def test_read_12_7_a_night_says_what_was_counted_from_its_sources(js):
    """The words of a night (READ-12.6, 12.7): who wrote it, as its records name their
    sources (never another device), what they said against the most the night holds, and
    which figure counts; the bedtime, or that it is not known, and its date when it is
    more than a day before the morning; a nap whose start is not known."""
    assert js.many("listWords", [(["A"],), (["A", "B"],), (["A", "B", "C"],),
                                 (list("ABCDEF"), 4)]) == [
        "A", "A and B", "A, B and C", "A, B, C, D and 2 more"]
    assert js("bedWords", {"sleep_start": "2025-03-08T23:10:00-05:00",
                           "sleep_end": "2025-03-09T07:02:00-04:00"}) == "bed 23:10, wake 07:02"
    assert js("bedWords", {"sleep_start": None,
                           "sleep_end": "2025-02-24T05:29:00+01:00"}) == (
        "bedtime not known, wake 05:29")
    assert js("bedTime", {"sleep_start": "2025-02-22T21:57:00+01:00",
                          "sleep_end": "2025-02-24T05:29:00+01:00"}) == "Feb 22 21:57"
    assert js("bedTime", {"sleep_start": None, "sleep_end": "2025-02-24T05:29:00+01:00"}) is None
    assert js.many("napTimes", [
        ({"sleep_start": "2025-02-10T15:59:00-05:00", "sleep_end": "2025-02-10T17:28:00-05:00"},),
        ({"sleep_start": None, "sleep_end": "2025-02-10T18:26:00-05:00"},)]) == [
        "15:59–17:28", "until 18:26"]
    order = healthlog.meaning_of("sleep_analysis").as_json()["stages"]
    fields = [{"field": "asleep", "label": "asleep"}, {"field": "in_bed", "label": "in bed"}]
    autosleep = {"overlapping": True, "counted": "staged", "said": 14.1, "limit": 8.25,
                 "limit_by": "in_bed", "scaled": False, "asleep": 6.1,
                 "sources": ["AutoSleep", "Nam’s Apple Watch", "iPhone"]}
    assert js("overlapWords", autosleep, order, fields) == (
        "Sources overlap: AutoSleep, Nam’s Apple Watch and iPhone wrote 14 h 06 min for "
        "8 h 15 min in bed; counted: its deep, core and rem, 6 h 06 min (the sleep no stage "
        "holds is left out).")
    eight = {"overlapping": True, "counted": "staged", "said": 27.0, "limit": 12.4,
             "limit_by": "window", "scaled": True, "asleep": 12.4, "sources": ["Eight Sleep"]}
    words = js("overlapWords", eight, order, fields)
    assert words == ("Sources overlap: Eight Sleep wrote 27 h 00 min for a night of 12 h 24 min "
                     "from its start to its end; counted: 12 h 24 min, the most the night "
                     "holds, its deep, core and rem scaled to their shares of it.")
    assert "Watch" not in words
    alone = {"overlapping": True, "counted": "unspecified", "said": 9.5, "limit": 7.0,
             "limit_by": "window", "scaled": False, "asleep": 7.0, "sources": ["Sleep++"]}
    assert js("overlapWords", alone, order, fields).endswith(
        "counted: 7 h 00 min asleep, the most the night holds; no stage hours.")
    days = dict(alone, said=82.7, limit=24.0, limit_by="day", asleep=24.0,
                sources=["HeartWatch"])
    assert js("overlapWords", days, order, fields).startswith(
        "Sources overlap: HeartWatch wrote 82 h 42 min, more than a day holds; counted: 24 h")
    records = {"overlapping": True, "counted": "union", "said": 16.0, "limit": 8.5,
               "limit_by": "window", "scaled": False, "asleep": 8.1,
               "sources": ["Apple Watch", "iPhone"]}
    assert js("overlapWords", records, order, fields).endswith(
        "counted: 8 h 06 min asleep, each minute once.")
    assert js("overlapWords", dict(records, overlapping=False), order, fields) == ""


def test_read_10_14_numbers_have_one_format(js):
    assert js("formatNumber", 12345.6) == "12,346"
    assert js("formatNumber", 1234) == "1,234"
    assert js("formatNumber", 64.25) == "64.3"
    assert js("formatNumber", 0.123) == "0.12"
    # a meaning's digits are the fewest decimals shown: pounds to a tenth
    assert [js("formatValue", v, 1) for v in (167.8, 168.0, 1234.56, 74.25, 0.04)] == [
        "167.8", "168.0", "1,234.6", "74.3", "0.04"]
    assert js("formatValue", 168.0, None) == "168"
    # ticks show the decimals of their step, so that none read alike
    assert [js("formatTick", v, 0.25) for v in (167.5, 167.75, 168)] == [
        "167.50", "167.75", "168.00"]
    assert [js("formatTick", v, 500) for v in (0, 500, 1000)] == ["0", "500", "1,000"]
    assert js("formatTick", 0.6, 0.2) == "0.6"
    # under a minute in seconds
    assert [js("formatSeconds", v) for v in (22.4, 59.4, 59.6, 720, 3900)] == [
        "22 s", "59 s", "1 min", "12 min", "1 h 05 min"]
    assert js("unitText", "bpm", "count/min") == " bpm"
    assert js("unitText", "", "count") == ""  # the name says what it counts
    assert js("unitText", None, "kcal") == " kcal"
    assert js("words", "valenceClassification") == "valence classification"
    assert js("detailText", "slightly_pleasant") == "slightly pleasant"
    assert js("detailText", ["calm", "happy"]) == "calm, happy"
    assert js("detailText", {"qty": 2.5, "units": "mg"}) == "2.5 mg"


def test_read_10_14_dates_instants_and_bucket_values(js):
    """dateOf is dayNumber's inverse; isoZ writes an instant in UTC to the second;
    bucketValue takes the figure the meaning's ``combine`` names (``sum`` or ``avg``), and
    nothing for a field the bucket lacks or a value that is no finite number; seriesFields draws the
    meaning's fields that the buckets hold, main first, else whatever numeric fields they
    hold."""
    days = [dt.date(1969, 12, 30) + dt.timedelta(days=k) for k in range(0, 20000, 97)]
    epoch = dt.date(1970, 1, 1)
    assert js.many("dateOf", [((d - epoch).days,) for d in days]) == [iso(d) for d in days]
    moments = [dt.datetime(2024, 3, 10, 6, 59, 59, 999000, tzinfo=dt.timezone.utc),
               dt.datetime(1969, 12, 31, 23, 0, tzinfo=dt.timezone.utc),
               dt.datetime(2025, 11, 2, 5, 30, 1, tzinfo=dt.timezone.utc)]
    assert js.many("isoZ", [(m.timestamp() * 1000,) for m in moments]) == [
        m.replace(microsecond=0).strftime("%Y-%m-%dT%H:%M:%SZ") for m in moments]
    bucket = {"fields": {"qty": {"count": 4, "sum": 10.5, "avg": 2.625, "min": 1, "max": 4},
                         "Max": {"count": 1, "sum": None, "avg": None}}}
    assert js("bucketValue", bucket, "qty", "sum") == 10.5
    assert js("bucketValue", bucket, "qty", "avg") == 2.625
    assert js("bucketValue", bucket, "Max", "avg") is None
    assert js("bucketValue", bucket, "Min", "avg") is None
    assert js("bucketValue", {}, "qty", "sum") is None
    heart = {"fields": ["Avg", "Min", "Max"]}
    buckets = [{"fields": {"Max": {}, "Avg": {}}}, {"fields": {"Min": {}, "qty": {}}}]
    assert js("seriesFields", heart, buckets) == ["Avg", "Min", "Max"]
    assert js("seriesFields", heart, buckets[:1]) == ["Avg", "Max"]
    assert js("seriesFields", {"fields": ["systolic"]}, buckets) == ["Max", "Avg", "Min", "qty"]
    assert js("seriesFields", {}, [{}]) == []


def test_read_10_14_every_exposed_function_is_tested():
    """Each function the script puts on window.healthlogTest is called by a test here."""
    script = healthlog.APP_JS
    start = script.index("window.healthlogTest = {")
    exposed = set(re.findall(r"(\w+): \w+", script[start:script.index("};", start)]))
    source = Path(__file__).read_text(encoding="utf-8")
    untested = sorted(name for name in exposed
                      if not re.search(r"""js(?:\.many)?\(["']%s["']""" % name, source))
    assert len(exposed) > 20 and not untested, untested
