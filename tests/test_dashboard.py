"""The dashboard in a real browser (READ-10): headless Chromium driven by Playwright against
a real in-process server on 127.0.0.1:0 that holds data posted through /api/ingest and
folded.

What a person sees is read off the page (each bar, point, night, card and row carries its
numbers in data attributes, and the readout says them in words) and compared with what this
test computes itself from the bodies it posted, never with the API's reply.

The store is built once for the module and the browser launched once (the service is the one
``start_service`` starts, at module scope: a fixture of conftest cannot be), each test opens
its own browser context, in a time zone far from the phone's. Phones: a year of Days exports
each from New York (2023), Berlin (2024, with gaps) and Sydney (2025); minute steps across New
York's autumn DST change; eight nights of sleep in the four forms HAE has sent; version 1 and
2 workouts; ECG recordings; events of every kind; a scale's morning weights in pounds, a
tenth apart; and enough deliveries to page the journal.

The browser is Debian's ``chromium-headless-shell`` (tests/dashboard_browser.py), used as
installed: Playwright never downloads one here. Without it, or without the playwright
package, the tests are skipped, unless HEALTHLOG_REQUIRE_BROWSER=1 (CI sets it), which makes
that a failure. Screenshots of the metric view at 1280 px and 360 px are written to
contrib/screenshots/ (tracked: the README shows them) and, with the other views', to
tests/artifacts/ (ignored by git).
"""

import datetime as dt
import json
import math
import random
import re
import urllib.parse
from pathlib import Path

import pytest

import hae_factory as hf
from conftest import Lazy
from dashboard_browser import OVERFLOW, Session, long_date, serving, shown_number, sign_in
from read_helpers import assert_security_headers

# Its service and browser live for the module: nothing may be left running after it.
pytestmark = pytest.mark.module_lifetime

ROOT = Path(__file__).resolve().parent.parent
ARTIFACTS = Path(__file__).resolve().parent / "artifacts"
SCREENSHOTS = ROOT / "contrib" / "screenshots"

# -- the data --------------------------------------------------------------------------

#: (phone zone, year, a browser zone far from it): each phone's Days exports span both DST
#: changes of its year; the browser looks from another continent.
PHONES = (("America/New_York", 2023, "Asia/Tokyo"),
          ("Europe/Berlin", 2024, "America/Los_Angeles"),
          ("Australia/Sydney", 2025, "America/Sao_Paulo"))
#: Berlin's year has gaps: a lone day between two missing stretches (a line breaks, a lone
#: point shows as a dot, a missing day is no bar, not a zero).
GAPS = {"2024-05-10", "2024-05-11", "2024-05-12", "2024-05-14", "2024-05-15"}
LONE_DAY = "2024-05-13"
#: Minute steps of the New York phone across the autumn change (2023-11-05 has 25 hours).
MINUTES = ("America/New_York", dt.datetime(2023, 11, 4), dt.datetime(2023, 11, 7))
DST_DAY = "2023-11-05"
SLEEP_ZONE = "America/New_York"
SLEEP_DAYS = [dt.date(2026, 1, 10) + dt.timedelta(days=k) for k in range(8)]
SLEEP_FORMS = ("a", "a", "b", "b", "c", "c", "d", "d")
WALKS = ((dt.datetime(2026, 1, 20, 7, 5), 12), (dt.datetime(2026, 1, 20, 18, 40), 16))
JOURNAL_PAGE = 20
#: A scale's morning weights in pounds (New York, 07:12), a tenth apart: 167.8 and 168.0 are
#: two readings, never both "168".
SCALE = {dt.date(2025, 6, 1) + dt.timedelta(days=k): lb for k, lb in enumerate(
    (167.8, 168.0, 167.6, 168.4, 167.9, 168.0, 167.8, 168.2, 167.5, 167.8))}


def _stamp_parts(stamp: str) -> tuple:
    """(written date, written hour, offset as +HH:MM) of an HAE timestamp."""
    offset = stamp[-5:]
    return stamp[:10], int(stamp[11:13]), offset[:3] + ":" + offset[3:]


def _metrics_body(**points) -> bytes:
    return hf.dumps_hae(hf.envelope(metrics=[hf.metric(name, data)
                                             for name, data in points.items()]))


class Corpus:
    """Every body the module posts, (automation, body bytes, points), and what it holds."""

    def __init__(self):
        self.deliveries = []
        self.days = {}  # zone -> {"step_count": [...], "heart_rate": [...]}
        days_auto = hf.Automation("Health days", "Days", "Previous 7 Days")
        for seed, (zone, year, _) in enumerate(PHONES):
            first = dt.date(year, 1, 1)
            export = hf.zoned_days_export(zone, first, (dt.date(year + 1, 1, 1) - first).days,
                                    seed=seed)
            if zone == "Europe/Berlin":
                export = {name: [p for p in data if p["date"][:10] not in GAPS]
                          for name, data in export.items()}
            self.days[zone] = export
            for month in range(1, 13):  # HAE sends a year in pieces: one body a month
                part = {name: [p for p in data if int(p["date"][5:7]) == month]
                        for name, data in export.items()}
                self.add(days_auto, _metrics_body(**part),
                         sum(len(v) for v in part.values()))
        zone, start, end = MINUTES
        self.minutes = hf.minute_steps(zone, hf.zoned_epoch(zone, start),
                                       hf.zoned_epoch(zone, end), every=120, seed=7)
        self.add(hf.Automation("Health minutes", "Minutes", "Since Last Sync"),
                 _metrics_body(step_count=self.minutes), len(self.minutes))
        # an overwrite (one day's steps corrected) and a unit conflict (a day in "steps")
        fixed = dict(self.days["Australia/Sydney"]["step_count"][-1])
        fixed["qty"] += 1
        self.days["Australia/Sydney"]["step_count"][-1] = fixed
        self.add(hf.Automation("Corrections", "Days", "Today"), _metrics_body(step_count=[fixed]),
                 1, overwrites=1)
        clash = dict(self.days["Australia/Sydney"]["step_count"][-2])
        self.add(hf.Automation("Other units", "Days", "Today"),
                 hf.dumps_hae(hf.envelope(metrics=[hf.metric("step_count", [clash], "steps")])),
                 1, unit_conflicts=1)
        # sleep: eight nights, two of each form, in one body
        self.sleep = {}
        nights = []
        for day, form in zip(SLEEP_DAYS, SLEEP_FORMS):
            points = hf.sleep_night_points(form, SLEEP_ZONE, day, seed=3)
            self.sleep[day.isoformat()] = (form, points)
            nights += points
        self.add(hf.Automation("Sleep", "Default", "Previous 7 Days"),
                 _metrics_body(sleep_analysis=nights), len(nights))
        # workouts: version 1 walks without a duration, version 2 with one, and enough of
        # them that the list takes more than one page
        rng = random.Random(11)
        workouts = []
        for k, (start, minutes) in enumerate(WALKS):
            workouts.append(hf.workout_v1(k, hf.zoned_epoch("America/Los_Angeles", start),
                                          name="Outdoor Walk", minutes=minutes,
                                          route_points=3, rng=rng))
        workouts.append(hf.workout_v2(5, dt.datetime(2026, 1, 21, 17, 30), name="Running",
                                      minutes=32, route_points=5, rng=rng))
        workouts.append(hf.workout_v2(6, dt.datetime(2026, 1, 22, 6, 45), name="Yoga",
                                      minutes=45, route_points=0, rng=rng))
        for k in range(56):  # one a day from 2025-11-20
            day = dt.date(2025, 11, 20) + dt.timedelta(days=k)
            build = hf.workout_v2 if k % 3 else hf.workout_v1
            workouts.append(build(20 + k, dt.datetime.combine(day, dt.time(12, 10 + k % 40)),
                                  name="Traditional Strength Training",
                                  minutes=20 + k % 25, route_points=0, rng=rng))
        self.workouts = workouts
        self.add(hf.Automation("Workouts", "Default", "Since Last Sync"),
                 hf.dumps_hae(hf.envelope(workouts=workouts)), len(workouts))
        # ECG recordings and events
        self.ecg = [hf.ecg_reading(rng, dt.datetime(2026, 1, 25, 9, 15)),
                    hf.ecg_reading(rng, dt.datetime(2026, 1, 27, 21, 2), samples=7690)]
        self.moods = [hf.state_of_mind(rng, hf.zoned_epoch("America/Los_Angeles", when),
                                       kind=kind)
                      for when, kind in ((dt.datetime(2026, 1, 26, 8, 30), "momentary_emotion"),
                                         (dt.datetime(2026, 1, 26, 21, 45), "daily_mood"),
                                         (dt.datetime(2026, 1, 27, 13, 5), "momentary_emotion"))]
        self.symptoms = [{"start": hf.zoned_stamp("America/Los_Angeles", dt.datetime(
            2026, 1, 26, 14, 0)), "end": hf.zoned_stamp("America/Los_Angeles", dt.datetime(
                2026, 1, 26, 15, 0)), "name": "Headache", "severity": "Moderate",
            "userEntered": True, "source": hf.OWNER_PHONE}]
        self.medications = hf.medications(random.Random(4), dt.datetime(2026, 1, 26, 8, 0))
        self.notifications = [hf.heart_rate_notification(rng, dt.datetime(2026, 1, 27, 3, 10))]
        self.cycle = hf.cycle_tracking(rng, dt.date(2026, 1, 26), cycle_day=1)
        records = {"ecg": self.ecg, "stateOfMind": self.moods, "symptoms": self.symptoms,
                   "medications": self.medications,
                   "heartRateNotifications": self.notifications, "cycleTracking": self.cycle}
        self.add(hf.Automation("Journal", "Default", "Since Last Sync"),
                 hf.dumps_hae(hf.envelope(**records)),
                 sum(len(v) for v in records.values()))
        weights = [{"date": hf.zoned_stamp("America/New_York", dt.datetime.combine(
            day, dt.time(7, 12))), "qty": lb, "source": "Withings"} for day, lb in SCALE.items()]
        self.add(hf.Automation("Scale", "Default", "Since Last Sync"),
                 hf.dumps_hae(hf.envelope(metrics=[hf.metric("weight_body_mass", weights,
                                                             "lb")])), len(weights))

    def add(self, automation, body: bytes, points: int, **counters) -> None:
        self.deliveries.append({"automation": automation, "body": body, "points": points,
                                "counters": counters})


CORPUS = Lazy(Corpus)


# -- the module's service and browser ----------------------------------------------------


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """The corpus posted through /api/ingest to a real Service and folded."""
    with serving(tmp_path_factory.mktemp("dashboard") / "data",
                 [(item["automation"], item["body"]) for item in CORPUS.deliveries]) as store:
        yield store


# -- helpers ---------------------------------------------------------------------------


@pytest.fixture
def session(browser, store):
    made = []

    def open_session(**kw):
        made.append(Session(browser, store, **kw))
        return made[-1]

    yield open_session
    for s in made:
        s.close()


def query(url: str) -> dict:
    return {k: v[0] for k, v in urllib.parse.parse_qs(urllib.parse.urlsplit(url).query).items()}


def buckets(page, selector="#chart .bucket") -> list:
    """What each bar, point or night carries: its data attributes."""
    return page.eval_on_selector_all(selector, "ns => ns.map(n => Object.assign({}, n.dataset))")


def floats(rows: list, key: str) -> dict:
    return {r["date"]: float(r[key]) for r in rows if key in r}


def readout_of(page, selector: str) -> str:
    """The readout a person gets by pointing at (focusing) one bar, point or night."""
    page.focus(selector)
    return page.inner_text("#readout")


def screenshot(page, name: str, tracked: bool = False) -> None:
    """What the screen shows (the window, not the whole page: the journal runs on) into
    tests/artifacts/; ``tracked``: also the header and the view, down to the view's end,
    into contrib/screenshots/ (without the journal, whose receive times change every run,
    so that a run leaves the tracked pictures as they were)."""
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / name))
    if tracked:
        SCREENSHOTS.mkdir(parents=True, exist_ok=True)
        page.evaluate("() => window.scrollTo(0, 0)")
        box = page.locator("#metric-view").bounding_box()
        width = page.viewport_size["width"]
        page.screenshot(path=str(SCREENSHOTS / name), full_page=True, clip={
            "x": 0, "y": 0, "width": width, "height": box["y"] + box["height"] + 12})


# -- the tests -------------------------------------------------------------------------


def test_read_10_1_sign_in_latest_data_csv_and_sign_out(browser, store, session):
    s = session(timezone="Asia/Tokyo")
    page = s.page
    first = page.goto(store.base + "/")
    assert first.status == 200
    assert_security_headers(first.headers)
    assert page.get_attribute("#token", "type") == "password"
    assert page.locator("#catalog").count() == 0

    # A wrong token: 401 and the form again with its notice (the browser logs the 401).
    with page.expect_response(lambda r: r.url.endswith("/login")) as answer:
        sign_in(page, "not-the-token")
    assert answer.value.status == 401
    assert page.inner_text(".notice").strip()
    assert all("401" in e for e in s.watch.errors), s.watch.errors
    s.watch.errors.clear()

    # Signed in without an address: the summary page (READ-16), without the metric view
    # and the journal.
    sign_in(page)
    page.wait_for_selector('#summary[data-state="ready"]')
    assert page.is_hidden("#metric-view") and page.is_hidden("#journal-panel")
    assert page.get_attribute("#nav-summary", "aria-current") == "page"
    # "Metrics" without an address: the series with the latest data (Sydney's heart rate,
    # dated 2025-12-31 there) over 7 days ending on its last date, not an empty week of now.
    with page.expect_request(lambda r: "/api/points" in r.url and re.search(
            r"from=\d{4}-\d{2}-\d{2}&", r.url)) as asked:
        page.click("#nav-metrics")
    page.wait_for_selector('#chart[data-state="ready"][data-metric="heart_rate"]')
    assert page.get_attribute("#nav-metrics", "aria-current") == "page"
    assert page.is_visible("#journal-panel") and page.is_hidden("#summary")
    q = query(asked.value.url)
    assert (q["tz"], q["from"], q["to"]) == ("local", "2025-12-25", "2025-12-31")  # both in
    shown = buckets(page)
    sydney = {p["date"][:10]: p for p in CORPUS.days["Australia/Sydney"]["heart_rate"]}
    assert [b["date"] for b in shown] == ["2025-12-%02d" % d for d in range(25, 32)]
    for b in shown:
        assert float(b["value"]) == pytest.approx(sydney[b["date"]]["Avg"])
    assert "range=7d" in page.url and "tz=local" in page.url and "metric=heart_rate" in page.url

    # The catalog's groups and names come from the server's meaning table.
    groups = page.eval_on_selector_all("#catalog optgroup", "gs => gs.map(g => g.label)")
    assert groups == ["Activity", "Body", "Heart", "Mindfulness", "Sleep", "Workouts",
                      "Other"], groups
    names = page.eval_on_selector_all("#catalog option", "os => os.map(o => o.textContent)")
    assert "Steps" in names and "Heart rate" in names and "State of mind" in names

    # The CSV link asks for exactly what the chart shows.
    href = page.get_attribute("#csv", "href")
    csv_query = query(href)
    assert csv_query.pop("format") == "csv"
    assert csv_query == q
    csv = page.request.get(store.base + href)
    assert csv.status == 200 and csv.headers["content-type"].startswith("text/csv")
    lines = csv.text().splitlines()
    assert lines[0].startswith("start,local,date,") and len(lines) == 8, lines[:3]

    page_again = page.request.get(store.base + "/")
    assert_security_headers(page_again.headers)
    assert s.watch.errors == []

    # Sign out everywhere: a second browser signed in loses its session too.
    other = session(timezone="Europe/Paris").sign_in()
    page.click("#signout-everywhere")
    page.wait_for_selector("#token")
    assert page.request.get(store.base + "/api/catalog").status == 401
    assert other.page.request.get(store.base + "/api/catalog").status == 401
    other.page.goto(store.base + "/")
    other.page.wait_for_selector("#token")

    # Sign out: this browser only.
    sign_in(page)
    page.wait_for_selector('#summary[data-state="ready"]')
    sign_in(other.page)
    other.page.wait_for_selector('#summary[data-state="ready"]')
    page.click("#signout")
    page.wait_for_selector("#token")
    refused = page.request.get(store.base + "/api/catalog")
    assert refused.status == 401
    assert json.loads(refused.text())["error"]["code"] == "unauthorized"
    assert other.page.request.get(store.base + "/api/catalog").status == 200


@pytest.mark.parametrize("phone", PHONES, ids=[p[0] for p in PHONES])
def test_read_10_2_days_on_the_dates_written_across_both_dst_changes(session, phone):
    zone, year, browser_zone = phone
    export = CORPUS.days[zone]
    # the body follows DST: its midnights carry two offsets
    assert len({p["date"][-5:] for p in export["step_count"]}) == 2
    steps = {p["date"][:10]: p["qty"] for p in export["step_count"]}
    heart = {p["date"][:10]: p for p in export["heart_rate"]}
    s = session(timezone=browser_zone).sign_in()
    for first, last in (("%d-01-01" % year, "%d-06-30" % year),
                        ("%d-07-01" % year, "%d-12-31" % year)):
        page = s.open(metric="step_count", range="custom", tz="local", **{"from": first,
                                                                          "to": last})
        assert page.get_attribute("#chart", "data-bucket") == "day"
        shown = buckets(page)
        assert {b["date"]: float(b["value"]) for b in shown} == {
            d: q for d, q in steps.items() if first <= d <= last}
        # each day starts at the midnight written in the body, in its own offset
        written = {p["date"][:10]: p["date"] for p in export["step_count"]}
        for b in shown:
            date, hour, offset = _stamp_parts(written[b["date"]])
            assert b["local"] == "%sT%02d:00:00%s" % (date, hour, offset)
        page = s.open(metric="heart_rate", range="custom", tz="local", **{"from": first,
                                                                          "to": last})
        shown = buckets(page)
        assert sorted(b["date"] for b in shown) == sorted(
            d for d in heart if first <= d <= last)
        for b in shown:
            point = heart[b["date"]]
            assert (float(b["value"]), float(b["min"]), float(b["max"])) == pytest.approx(
                (point["Avg"], point["Min"], point["Max"]))
    # The readout of the first day after each change names that day and its number.
    written = {p["date"][:10]: p["date"] for p in export["step_count"]}
    dates = sorted(written)
    changes = [d for prev, d in zip(dates, dates[1:])
               if written[prev][-5:] != written[d][-5:]]
    assert len(changes) == 2
    for date in changes:
        half = ("%d-01-01" % year, "%d-06-30" % year) if date[5:7] <= "06" else (
            "%d-07-01" % year, "%d-12-31" % year)
        page = s.open(metric="step_count", range="custom", tz="local",
                      **{"from": half[0], "to": half[1]})
        text = readout_of(page, '#chart .bucket[data-date="%s"]' % date)
        day = dt.date.fromisoformat(date)
        assert text.startswith("%s, %s %d, %d: " % (day.strftime("%a"), day.strftime("%b"),
                                                     day.day, day.year)), text
        assert "{:,} steps".format(steps[date]) in text, text


def test_read_10_3_hours_are_the_phones_clock_hours_on_a_dst_day(session):
    expected = {}
    for p in CORPUS.minutes:
        date, hour, offset = _stamp_parts(p["date"])
        if date == DST_DAY:
            key = "%sT%02d:00:00%s" % (date, hour, offset)
            expected[key] = expected.get(key, 0) + p["qty"]
    assert len(expected) == 25  # 01:00 twice: -04:00, then -05:00
    page = session(timezone="Asia/Kolkata").sign_in(  # +05:30: its hours cut the phone's
        metric="step_count", range="custom", tz="local", **{"from": DST_DAY, "to": DST_DAY}).page
    assert page.get_attribute("#chart", "data-bucket") == "hour"
    assert page.get_attribute("#chart", "data-layer") == "minutes"
    shown = buckets(page)
    assert {b["local"]: float(b["value"]) for b in shown} == expected
    assert all(b["date"] == DST_DAY for b in shown)
    first = readout_of(page, '#chart .bucket[data-local="%sT01:00:00-04:00"]' % DST_DAY)
    second = readout_of(page, '#chart .bucket[data-local="%sT01:00:00-05:00"]' % DST_DAY)
    assert "01:00–02:00 (UTC-04:00)" in first and "01:00–02:00 (UTC-05:00)" in second
    sums = expected["%sT01:00:00-04:00" % DST_DAY], expected["%sT01:00:00-05:00" % DST_DAY]
    assert "{:,} steps".format(sums[0]) in first and "{:,} steps".format(sums[1]) in second


def _hhmm(stamp: str) -> str:
    return stamp[11:16]


def nights_truth() -> dict:
    """Each night as this test reads its points, by the rules of the four forms: a summary
    is on the date of its sleepEnd, asleep is HAE's total (totalSleep when it is sent, else
    the unstaged "asleep" and the stages added up), stages as given;
    stage records are on the date of their last end, asleep the (non-overlapping) asleep
    segments, in bed the in-bed record, bed and wake the first start and last end."""
    out = {}
    for form, points in CORPUS.sleep.values():
        if form != "d":
            p = points[0]
            out[p["sleepEnd"][:10]] = {
                "form": form, "asleep": p["totalSleep"] if "totalSleep" in p else p["asleep"]
                + sum(p.get(k, 0) for k in ("core", "deep", "rem")),
                "in_bed": p["inBed"], "bed": _hhmm(p["sleepStart"]),
                "wake": _hhmm(p["sleepEnd"]),
                "stages": {k: p[k] for k in ("core", "deep", "rem", "awake") if p.get(k)}}
            if p.get("core") and p.get("asleep"):  # the minutes the watch left unstaged
                out[p["sleepEnd"][:10]]["stages"]["asleep"] = p["asleep"]
            continue
        stages, asleep, in_bed = {}, 0.0, None
        for r in points:
            stage = {"In Bed": "in_bed"}.get(r["value"], r["value"].lower())
            span = (hf.epoch_of_text(r["endDate"]) - hf.epoch_of_text(r["startDate"])) / 3600
            if stage == "in_bed":
                in_bed = span
                continue
            stages[stage] = stages.get(stage, 0.0) + r["qty"]
            if stage != "awake":
                asleep += span
        last = max(points, key=lambda r: hf.epoch_of_text(r["endDate"]))
        first = min(points, key=lambda r: hf.epoch_of_text(r["startDate"]))
        out[last["endDate"][:10]] = {"form": form, "asleep": asleep, "in_bed": in_bed,
                                     "stages": stages, "bed": _hhmm(first["startDate"]),
                                     "wake": _hhmm(last["endDate"])}
    return out


def _hours_text(hours: float) -> str:
    minutes = int(hours * 60 + 0.5)
    return "%d min" % minutes if minutes < 60 else "%d h %02d min" % divmod(minutes, 60)


def test_read_10_4_sleep_in_four_forms_on_the_mornings_it_ended(session):
    truth = nights_truth()
    assert sorted(truth) == [d.isoformat() for d in SLEEP_DAYS]
    assert [truth[d]["form"] for d in sorted(truth)] == list(SLEEP_FORMS)
    s = session(timezone="Pacific/Auckland").sign_in(
        metric="sleep_analysis", range="custom", tz="local",
        **{"from": "2026-01-09", "to": "2026-01-18"})
    page = s.page
    shown = {b["date"]: b for b in buckets(page, "#chart .night")}
    assert sorted(shown) == sorted(truth)
    for date, night in truth.items():
        b = shown[date]
        assert float(b["asleep"]) == pytest.approx(night["asleep"], abs=1e-6)
        assert float(b["inBed"]) == pytest.approx(night["in_bed"], abs=1e-6)
        drawn = dict(page.eval_on_selector_all(
            '#chart .night[data-date="%s"] rect[data-stage]' % date,
            "rs => rs.map(r => [r.dataset.stage, parseFloat(r.dataset.hours)])"))
        if night["stages"]:
            # the stages add up to the hours asleep: the minutes the watch left unstaged
            # (form (b)'s "asleep") are the stage "asleep, no stage", nothing stacks above
            assert drawn == pytest.approx(night["stages"], abs=1e-6)
        else:  # form (a): no stage hours: the asleep hours are the bar, as sleep without a
            # stage (HealthKit's and HAE's plain "asleep", "asleep, no stage")
            assert drawn == pytest.approx({"asleep": night["asleep"]}, abs=1e-6)
        text = readout_of(page, '#chart .night[data-date="%s"]' % date)
        assert "asleep %s" % _hours_text(night["asleep"]) in text, text
        assert "in bed %s" % _hours_text(night["in_bed"]) in text, text
        assert "bed %s, wake %s" % (night["bed"], night["wake"]) in text, text
        for stage, hours in night["stages"].items():
            label = "asleep, no stage" if stage == "asleep" else stage
            assert "%s %s" % (label, _hours_text(hours)) in text, text
        assert " 0 min" not in text and "asleep –" not in text
    # The legend names each stage drawn once, by its label, and the hours in bed.
    drawn = {stage for night in truth.values() for stage in night["stages"]} | {"asleep"}
    legend = page.eval_on_selector_all("#chart .legend-item", "is => is.map(i => i.textContent)")
    assert sorted(legend) == sorted(["asleep, no stage" if stage == "asleep" else stage
                                     for stage in drawn] + ["in bed"]), legend
    # The 7-day view opens on the latest night.
    page = s.open(metric="sleep_analysis", range="7d", tz="local")
    assert sorted(b["date"] for b in buckets(page, "#chart .night")) == sorted(truth)[-7:]


def workouts_truth() -> list:
    """(local start, date, seconds, energy, distance) of every posted workout: version 2's
    duration, version 1's end minus start; energy as sent, in the units sent."""
    out = []
    for w in CORPUS.workouts:
        date, hour, offset = _stamp_parts(w["start"])
        seconds = (w["duration"] if "duration" in w
                   else hf.epoch_of_text(w["end"]) - hf.epoch_of_text(w["start"]))
        energy = w.get("activeEnergyBurned") or w.get("activeEnergy")
        out.append({"local": "%sT%s%s" % (date, w["start"][11:19], offset), "date": date,
                    "seconds": seconds, "energy": (energy["qty"], energy["units"]),
                    "distance": (w["distance"]["qty"], w["distance"]["units"])
                    if "distance" in w else None, "name": w["name"]})
    return out


def test_read_10_5_workouts_of_both_versions_listed_and_counted_in_minutes(session):
    truth = workouts_truth()
    s = session(timezone="Europe/Helsinki")
    asked = []
    s.page.on("request", lambda r: asked.append(r.url) if "/api/workouts" in r.url else None)
    page = s.sign_in(metric="workouts", range="custom", tz="local",
                     **{"from": "2025-11-20", "to": "2026-01-31"}).page
    assert len(asked) == 1 and "from=2025-11-20" in asked[0], asked  # the range at once
    cards = buckets(page, "#records li.workout")
    assert len(cards) == len(truth) == 60
    by_local = {c["local"]: c for c in cards}
    for w in truth:
        card = by_local[w["local"]]
        assert card["date"] == w["date"]
        assert float(card["durationS"]) == pytest.approx(w["seconds"])
        assert (float(card["energy"]), card["energyUnits"]) == (pytest.approx(w["energy"][0]),
                                                                w["energy"][1])
        if w["distance"]:
            assert (float(card["distance"]), card["distanceUnits"]) == (
                pytest.approx(w["distance"][0]), w["distance"][1])
    # The version 1 walks: 12 and 16 minutes (no duration field: end minus start).
    walks = page.eval_on_selector_all(
        '#records li.workout', "ls => ls.filter(l => l.textContent.includes('Outdoor Walk'))"
        ".map(l => l.textContent)")
    assert len(walks) == 2
    assert any("12 min" in t for t in walks) and any("16 min" in t for t in walks), walks
    assert all("kcal" in t and " mi" in t for t in walks), walks
    # Minutes per day, from the workouts' own durations.
    minutes = {}
    for w in truth:
        minutes[w["date"]] = minutes.get(w["date"], 0.0) + w["seconds"] / 60
    bars = buckets(page)
    assert floats(bars, "value") == pytest.approx(minutes)
    text = readout_of(page, '#chart .bucket[data-date="2026-01-20"]')
    assert "28 min of workouts (2 workouts)" in text, text


def test_read_10_6_ecg_list_and_trace(session):
    newest, oldest = CORPUS.ecg[1], CORPUS.ecg[0]
    s = session(timezone="Asia/Singapore").sign_in(
        metric="ecg", range="custom", tz="local", **{"from": "2026-01-24", "to": "2026-01-31"})
    page = s.page
    items = buckets(page, "#records li.ecg")
    assert [i["local"][:16] for i in items] == [
        "%sT%s" % (e["start"][:10], e["start"][11:16]) for e in (newest, oldest)]
    for item, body in zip(items, (newest, oldest)):
        assert int(item["samples"]) == len(body["voltageMeasurements"])
        assert float(item["frequency"]) == body["samplingFrequency"]
    listed = page.inner_text("#records")
    assert listed.lower().count(newest["classification"].lower()) == 2
    assert str(newest["averageHeartRate"]) in listed

    def trace():
        return page.eval_on_selector("#chart svg.ecg-trace", """svg => ({
            data: Object.assign({}, svg.dataset),
            points: Array.from(svg.querySelectorAll('polyline.trace'))
                .map(p => p.getAttribute('points').trim().split(/\\s+/).length)})""")

    shown = trace()
    volts = [v["voltage"] for v in newest["voltageMeasurements"]]
    assert sum(shown["points"]) == len(volts) == 7690
    assert float(shown["data"]["frequency"]) == newest["samplingFrequency"]
    assert float(shown["data"]["seconds"]) == pytest.approx(len(volts) / 512.6)
    assert (float(shown["data"]["min"]), float(shown["data"]["max"])) == pytest.approx(
        (min(volts), max(volts)))
    check_amplitude_axis(page, volts, newest["samplingFrequency"])
    page.click('#records li.ecg[data-local^="%s"] button' % oldest["start"][:10])
    page.wait_for_selector('#chart[data-state="ready"] svg.ecg-trace[data-samples="%d"]'
                           % len(oldest["voltageMeasurements"]))
    assert sum(trace()["points"]) == len(oldest["voltageMeasurements"]) == hf.ECG_SAMPLES
    assert "recording=" in page.url  # the recording shown is in the address


def check_amplitude_axis(page, volts: list, hz: float) -> None:
    """READ-10.17: each 10-second strip of the trace has an amplitude axis: round µV ticks,
    evenly spaced, within the recording's lowest and highest voltage, each written as the
    value it marks, on the scale the trace is drawn on (the strip's highest sample lies where
    the axis puts its voltage)."""
    strips = page.eval_on_selector("#chart svg.ecg-trace", r"""svg => {
        const axes = Array.from(svg.querySelectorAll('g.amplitude'));
        const lines = Array.from(svg.querySelectorAll('polyline.trace'));
        return {units: Array.from(svg.querySelectorAll('.amplitude-units'))
                  .map(t => t.textContent),
                strips: axes.map((g, k) => ({
                  ticks: Array.from(g.querySelectorAll('text[data-value]')).map(t => ({
                    text: t.textContent, value: parseFloat(t.dataset.value),
                    y: parseFloat(t.getAttribute('y')) - 4})),
                  first: parseInt(lines[k].dataset.first), count: parseInt(lines[k].dataset.count),
                  ys: lines[k].getAttribute('points').trim().split(/\s+/)
                    .map(p => parseFloat(p.split(',')[1]))}))};
    }""")
    low, high = min(volts), max(volts)
    assert strips["units"] == ["µV"]
    assert "µV against seconds" in page.inner_text("#chart .chart-head")
    assert len(strips["strips"]) == math.ceil(len(volts) / hz / 10 - 1e-9)
    for strip in strips["strips"]:
        ticks = strip["ticks"]
        values = [t["value"] for t in ticks]
        assert 2 <= len(values) <= 6, values
        assert all(low <= v <= high for v in values), (values, low, high)
        steps = {round(b - a, 6) for a, b in zip(values, values[1:])}
        assert len(steps) == 1, values
        step = steps.pop()
        mantissa = step / 10 ** math.floor(math.log10(step))
        assert round(mantissa, 6) in (1, 2, 2.5, 5), step
        assert (high - low) / 7 <= step <= (high - low) / 1.5, (step, low, high)
        assert all(abs(v / step - round(v / step)) < 1e-6 for v in values), values
        for t in ticks:
            assert float(t["text"].replace(",", "")) == pytest.approx(t["value"]), t
        # the scale: y falls as the voltage rises, linearly, as the trace is drawn
        (v0, y0), (v1, y1) = (values[0], ticks[0]["y"]), (values[-1], ticks[-1]["y"])
        assert y1 < y0
        per_volt = (y1 - y0) / (v1 - v0)
        mine = volts[strip["first"]:strip["first"] + strip["count"]]
        assert len(strip["ys"]) == len(mine)
        assert min(strip["ys"]) == pytest.approx(y0 + (max(mine) - v0) * per_volt, abs=0.15)
        assert max(strip["ys"]) == pytest.approx(y0 + (min(mine) - v0) * per_volt, abs=0.15)


def test_read_10_7_events_are_lists_with_their_local_times(session):
    s = session(timezone="Africa/Nairobi").sign_in(
        metric="state_of_mind", range="custom", tz="local",
        **{"from": "2026-01-24", "to": "2026-01-31"})
    page = s.page
    assert page.locator("#chart svg").count() == 0
    items = buckets(page, "#records li.event")
    # stateOfMind is written in UTC ("…Z"): its local time as written is UTC's
    expected = sorted(((m["start"][:10], m["start"][11:16], m) for m in CORPUS.moods),
                      key=lambda e: e[0] + e[1], reverse=True)
    assert [(i["date"], i["local"][11:16]) for i in items] == [e[:2] for e in expected]
    texts = page.eval_on_selector_all("#records li.event", "ls => ls.map(l => l.innerText)")
    for text, (_, clock, mood) in zip(texts, expected):
        assert clock in text
        assert mood["valenceClassification"].replace("_", " ") in text
        assert all(label in text for label in mood["labels"])
    days = page.eval_on_selector_all("#records section.day", "ds => ds.map(d => d.dataset.date)")
    assert days == sorted({e[0] for e in expected}, reverse=True)

    page = s.open(metric="symptoms/Headache", range="custom", tz="local",
                  **{"from": "2026-01-24", "to": "2026-01-31"})
    text = page.inner_text("#records")
    assert "Moderate" in text and "14:00" in text
    medication = page.eval_on_selector_all(
        "#catalog option", "os => os.map(o => o.value).filter(v => v.startsWith('medications/'))")
    assert medication
    page = s.open(metric=medication[0], range="custom", tz="local",
                  **{"from": "2026-01-24", "to": "2026-01-31"})
    dose = [m for m in CORPUS.medications if medication[0].endswith(
        m.get("nickname") or m["displayText"]) or medication[0].endswith(m["displayText"])][0]
    text = page.inner_text("#records")
    assert dose["status"] in text and "08:00" in text
    page = s.open(metric="heart_rate_notifications", range="custom", tz="local",
                  **{"from": "2026-01-24", "to": "2026-01-31"})
    note = CORPUS.notifications[0]
    text = page.inner_text("#records")
    assert note["heartNotification"].replace("_", " ") in text
    assert str(note["threshold"]) in text and note["start"][11:16] in text


def test_read_10_8_deliveries_paged_with_overwrites_and_unit_conflicts(session):
    s = session(timezone="America/Denver").sign_in()
    page = s.page
    page.click("#nav-metrics")  # the journal is under the metric view
    total = len(CORPUS.deliveries)
    assert total > 2 * JOURNAL_PAGE
    page.wait_for_function("() => document.querySelectorAll('#journal tbody tr').length === %d"
                           % JOURNAL_PAGE)
    while page.locator("#journal tbody tr").count() < total:
        shown = page.locator("#journal tbody tr").count()
        page.click("#journal-more")
        page.wait_for_function(
            "() => document.querySelectorAll('#journal tbody tr').length > %d" % shown)
    assert page.is_hidden("#journal-more")
    rows = buckets(page, "#journal tbody tr")
    assert [int(r["id"]) for r in rows] == list(range(total, 0, -1))  # newest first, once
    cells = page.eval_on_selector_all("#journal tbody tr", """rs => rs.map(r => Object.fromEntries(
        Array.from(r.cells).map(c => [c.dataset.label, c.textContent])))""")
    for row, cell in zip(rows, cells):
        posted = CORPUS.deliveries[int(row["id"]) - 1]
        assert cell["Automation"] == posted["automation"].name
        assert int(row["points"]) == posted["points"]
        assert cell["Points"] == "{:,}".format(posted["points"])
        assert int(row["overwrites"]) == posted["counters"].get("overwrites", 0)
        assert int(row["unitConflicts"]) == posted["counters"].get("unit_conflicts", 0)
    big = [c["Points"] for c in cells if len(c["Points"]) > 4]
    assert big and all(re.fullmatch(r"\d{1,3}(,\d{3})+", p) for p in big), big
    flagged = page.eval_on_selector_all("#journal td.flag", "ts => ts.map(t => t.dataset.label)")
    assert sorted(flagged) == ["Overwrites", "Unit conflicts"]
    assert "Backlog 0" in page.inner_text("#health")


def test_read_10_9_a_stale_reply_never_paints_over_a_newer_view(session):
    s = session(timezone="Asia/Tokyo").sign_in("#metric=heart_rate&range=7d&tz=local")
    page = s.page
    held = []
    page.route(lambda url: "/api/points" in url and "metric=heart_rate" in url,
               lambda route: held.append(route))  # answered only below, after the switch
    with page.expect_request(lambda r: "metric=heart_rate" in r.url and "bucket=day" in r.url):
        page.click('#range button[data-range="30d"]')
    page.select_option("#catalog", "step_count")
    page.wait_for_selector('#chart[data-state="ready"][data-metric="step_count"]')
    assert held  # the heart-rate reply is still held while steps were drawn
    steps = buckets(page)
    for route in held:  # the old reply arrives late (or not at all: it was aborted)
        try:
            route.continue_()
        except Exception:  # noqa: B902 - the page already gave the request up
            pass
    page.evaluate("fetch('/healthz').then(r => r.json())")  # a round trip after it
    assert page.get_attribute("#chart", "data-metric") == "step_count"
    assert buckets(page) == steps
    # Fast clicks: only the last range is drawn.
    for key in ("24h", "1y", "7d", "all", "30d"):
        page.click('#range button[data-range="%s"]' % key)
    page.wait_for_selector('#chart[data-state="ready"][data-range="30d"]')
    shown = buckets(page)
    assert len(shown) == 30 and shown[-1]["date"] == "2025-12-31"
    assert page.locator("#chart .chart-panel").count() == 1


def test_read_10_10_the_address_keeps_the_view_and_the_zone(session):
    s = session(timezone="Europe/Lisbon").sign_in()
    page = s.page
    zones = page.eval_on_selector_all("#zone option", "os => os.map(o => o.value)")
    assert zones == ["local", "Europe/Lisbon", "UTC"]  # the browser's zone from Intl
    page = s.open(metric="step_count", range="30d", tz="local")
    local = buckets(page)
    page.reload()
    s.wait({"metric": "step_count", "range": "30d", "tz": "local"})
    assert buckets(page) == local
    assert page.input_value("#zone") == "local"
    assert page.eval_on_selector('#range button[aria-pressed="true"]', "b => b.dataset.range") \
        == "30d"

    # In UTC, Sydney's midnights (13:00 or 14:00 UTC the day before) are UTC's days.
    with page.expect_request(lambda r: "/api/points" in r.url and "tz=UTC" in r.url
                             and "bucket=day" in r.url and "from=2025-" in r.url):
        page.select_option("#zone", "UTC")
    s.wait({"metric": "step_count", "range": "30d", "tz": "UTC"})
    assert "tz=UTC" in page.url
    utc = {}
    for p in CORPUS.days["Australia/Sydney"]["step_count"]:
        date = dt.datetime.fromtimestamp(hf.epoch_of_text(p["date"]),
                                         dt.timezone.utc).date().isoformat()
        utc[date] = utc.get(date, 0) + p["qty"]
    shown = buckets(page)
    assert shown[-1]["date"] == "2025-12-30"  # the latest point, 2025-12-30T13:00Z
    assert {b["date"]: float(b["value"]) for b in shown} == {
        b["date"]: utc[b["date"]] for b in shown}
    assert {b["date"] for b in shown} == {d for d in utc if "2025-12-01" <= d <= "2025-12-30"}

    # A custom range is in the address too, and survives a reload.
    page = s.open(metric="heart_rate", range="custom", tz="UTC",
                  **{"from": "2024-03-25", "to": "2024-04-02"})
    page.reload()
    s.wait({"metric": "heart_rate", "range": "custom", "from": "2024-03-25", "tz": "UTC"})
    assert (page.input_value("#from"), page.input_value("#to")) == ("2024-03-25", "2024-04-02")
    assert page.is_visible("#custom")
    # Changing a date in the form redraws and rewrites the address.
    page.fill("#to", "2024-04-09")
    page.dispatch_event("#to", "change")
    s.wait({"metric": "heart_rate", "range": "custom", "from": "2024-03-25", "tz": "UTC"})
    page.wait_for_function("() => location.hash.includes('to=2024-04-09')")
    assert len(buckets(page)) == 16


def test_read_10_11_gaps_stay_gaps_and_a_lone_bucket_shows(session):
    s = session(timezone="America/Chicago").sign_in(
        metric="heart_rate", range="custom", tz="local",
        **{"from": "2024-05-01", "to": "2024-05-31"})
    page = s.page
    dates = [b["date"] for b in buckets(page)]
    assert not set(dates) & GAPS and len(dates) == 31 - len(GAPS)
    path = page.get_attribute('#chart path.series[data-field="Avg"]', "d")
    assert path.count("M") == 2  # May 1-9 and 16-31; the lone 13th is a dot, not a line
    lone = page.locator('#chart .bucket[data-date="%s"] circle' % LONE_DAY)
    assert "lone" in lone.get_attribute("class")
    box = lone.bounding_box()
    assert box["width"] >= 6 and box["height"] >= 6
    assert page.locator("#chart rect.band").count() == 1  # the lone day's band
    page = s.open(metric="step_count", range="custom", tz="local",
                  **{"from": "2024-05-01", "to": "2024-05-31"})
    assert not {b["date"] for b in buckets(page)} & GAPS  # no bar, not a zero bar
    assert page.locator("#chart rect.bar").count() == 31 - len(GAPS)
    # A range holding one bucket draws it where it can be seen.
    for metric, shape in (("step_count", "rect.bar"), ("heart_rate", "circle.pt")):
        page = s.open(metric=metric, range="custom", tz="local",
                      **{"from": LONE_DAY, "to": LONE_DAY})
        assert len(buckets(page)) == 1
        box = page.locator("#chart .bucket " + shape).bounding_box()
        assert box["width"] >= 4 and box["height"] >= 1, box


def test_read_10_15_the_server_chooses_the_layer_and_the_page_names_it(session):
    """Steps are stored in ``days`` (three years) and ``minutes`` (New York's autumn DST
    days): without a layer picked the page asks /api/points for the layers the plan names
    (the one it chose, and for days the other that fills the days it lacks: no second
    choice on the server), and shows the one chosen; a layer picked is asked for alone,
    kept in the address and named."""
    s = session(timezone="Asia/Kolkata").sign_in()
    page = s.page
    asked = []
    page.on("request", lambda r: asked.append(query(r.url))
            if "/api/points" in r.url and "bucket=" in r.url else None)
    for first, last, layer, read in ((DST_DAY, DST_DAY, "minutes", "minutes"),
                                     ("2023-07-01", "2023-12-31", "days", "days,minutes")):
        asked.clear()
        page = s.open(metric="step_count", range="custom", tz="local",
                      **{"from": first, "to": last})
        assert asked and all(q["layer"] == read for q in asked), asked
        assert page.get_attribute("#chart", "data-layer") == layer
        assert "read from the %s layer" % layer in page.inner_text("#view-meta")
        assert page.eval_on_selector("#layer option[value='']", "o => o.textContent") \
            == "Best for the range: " + layer
        assert "layer=" not in page.url
        assert query(page.get_attribute("#csv", "href"))["layer"] == read
    # Picked: the days layer for the DST day (one bucket at its midnight), asked and named.
    asked.clear()
    page.select_option("#layer", "days")
    page.wait_for_function("() => location.hash.includes('layer=days')")
    s.wait({"metric": "step_count", "range": "custom", "from": "2023-07-01", "tz": "local"})
    assert page.get_attribute("#chart", "data-layer") == "days"
    assert asked and all(q.get("layer") == "days" for q in asked), asked
    assert query(page.get_attribute("#csv", "href"))["layer"] == "days"
    page = s.open(metric="step_count", range="custom", tz="local", layer="minutes",
                  **{"from": DST_DAY, "to": DST_DAY})
    assert page.get_attribute("#chart", "data-layer") == "minutes"
    assert page.input_value("#layer") == "minutes"


def test_read_10_16_a_bookmarked_view_outlives_signing_in(session, store):
    """A view opened from a bookmark before signing in, or left open while the session ends
    elsewhere, is the view shown once signed in, not the summary."""
    view = {"metric": "step_count", "range": "30d", "tz": "UTC"}
    s = session(timezone="Europe/Lisbon")
    page = s.page
    page.goto(store.base + "/#" + urllib.parse.urlencode(view))
    page.wait_for_selector("#token")
    sign_in(page)
    s.wait(view)
    assert page.is_hidden("#summary") and page.is_visible("#metric-view")
    assert query("?" + page.url.split("#", 1)[1]) == view
    shown = buckets(page)
    assert len(shown) == 30 and shown[-1]["date"] == "2025-12-30"  # as READ-10.10 finds

    # Signed out by another browser: the next view asked for is refused, the sign-in page
    # comes at that view's address, and signing in again shows it.
    other = session(timezone="Europe/Paris").sign_in()
    other.page.click("#signout-everywhere")
    other.page.wait_for_selector("#token")
    second = {"metric": "heart_rate", "range": "7d", "tz": "UTC"}
    page.evaluate("h => { window.location.hash = h; }", "#" + urllib.parse.urlencode(second))
    page.wait_for_selector("#token")
    assert query("?" + page.url.split("#", 1)[1]) == second
    sign_in(page)
    s.wait(second)
    assert page.is_hidden("#summary")
    # The refused request is the browser's one logged error.
    assert s.watch.errors and all("401" in e for e in s.watch.errors), s.watch.errors
    s.watch.errors.clear()


VIEWS = (
    ("steps", {"metric": "step_count", "range": "30d", "tz": "local"}),
    ("heart-rate", {"metric": "heart_rate", "range": "7d", "tz": "local"}),
    ("sleep", {"metric": "sleep_analysis", "range": "custom", "tz": "local",
               "from": "2026-01-09", "to": "2026-01-17"}),
    ("workouts", {"metric": "workouts", "range": "custom", "tz": "local",
                  "from": "2026-01-01", "to": "2026-01-31"}),
    ("ecg", {"metric": "ecg", "range": "30d", "tz": "local"}),
    ("events", {"metric": "state_of_mind", "range": "7d", "tz": "local"}),
)

def test_read_10_12_nothing_is_cut_off_on_a_phone_and_screenshots(session):
    phone = session(timezone="America/Chicago", width=360, height=780, phone=True)
    phone.sign_in("#" + urllib.parse.urlencode(VIEWS[0][1]))
    for name, params in VIEWS:
        page = phone.open(**params)
        if name == "ecg":
            page.wait_for_selector("#chart svg.ecg-trace")
        found = page.evaluate(OVERFLOW)
        assert found["scroll"] <= 360 and not found["out"], (name, found)
        box = page.locator("#chart svg").first.bounding_box() if name != "events" else None
        assert box is None or 300 <= box["width"] <= 360
        screenshot(page, "dashboard-phone-%s.png" % name)
    page.wait_for_selector("#journal tbody tr")
    found = page.evaluate(OVERFLOW)
    assert found["scroll"] <= 360 and not found["out"], ("journal", found)
    phone.open(**VIEWS[0][1])
    screenshot(page, "dashboard-phone.png", tracked=True)

    desktop = session(timezone="America/Chicago", width=1280, height=900)
    desktop.sign_in("#" + urllib.parse.urlencode(VIEWS[0][1]))
    page = desktop.page
    page.wait_for_selector("#journal tbody tr")
    screenshot(page, "dashboard.png", tracked=True)
    for name, params in VIEWS[1:]:
        page = desktop.open(**params)
        if name == "ecg":
            page.wait_for_selector("#chart svg.ecg-trace")
        screenshot(page, "dashboard-%s.png" % name)
    page.emulate_media(color_scheme="dark")
    screenshot(page, "dashboard-dark.png")


def test_read_17_1_day_data_on_short_ranges_is_drawn_in_days(session):
    """WHEN the Sydney phone's Days steps are shown for two dates and for 7 days
    THEN each date is one bar with that day's steps, never an hour, and the heading says the
    metric arrives once a day on the short range."""
    export = CORPUS.days["Australia/Sydney"]
    steps = {p["date"][:10]: p["qty"] for p in export["step_count"]}
    last = max(steps)
    first = (dt.date.fromisoformat(last) - dt.timedelta(days=1)).isoformat()
    s = session(timezone="America/Sao_Paulo").sign_in(
        metric="step_count", range="custom", tz="local", **{"from": first, "to": last})
    page = s.page
    assert page.get_attribute("#chart", "data-bucket") == "day"
    assert {b["date"]: float(b["value"]) for b in buckets(page)} == {
        first: steps[first], last: steps[last]}
    assert "arrives once a day" in page.text_content("#view-meta")
    page = s.open(metric="step_count", range="7d", tz="local")
    week = [(dt.date.fromisoformat(last) - dt.timedelta(days=n)).isoformat()
            for n in range(6, -1, -1)]
    assert page.get_attribute("#chart", "data-bucket") == "day"
    assert {b["date"]: float(b["value"]) for b in buckets(page)} == {d: steps[d] for d in week}


@pytest.fixture(scope="module")
def tokyo(browser, store):
    """One session signed in at Tokyo for the tests that only open views by their address
    (each checks the page's errors itself): one sign-in for them all, not one a test."""
    s = Session(browser, store, timezone="Asia/Tokyo")
    yield s.sign_in()
    s.close()


@pytest.mark.parametrize("metric, every", [
    ("step_count", "week"), ("heart_rate", "week"), ("sleep_analysis", "day"),
    ("workouts", "day")])
def test_read_10_1_every_range_draws_its_buckets(tokyo, metric, every):
    """24 h, 1 y and All end on the latest data too, in the bucket the server planned for
    their length (All: weeks for the three years of steps and heart rate, days for eight
    nights and two months of workouts). The latest steps and heart rate are the Sydney
    phone's Days exports: their 24 hours are one day, never an hour (READ-17)."""
    for key, bucket in (("24h", "day"), ("1y", "week"), ("all", every)):
        page = tokyo.open(metric=metric, range=key, tz="local")
        shown = buckets(page)
        assert shown, (metric, key)
        if metric != "workouts":  # workouts are counted from their list, per day or week
            assert page.get_attribute("#chart", "data-bucket") == bucket, (metric, key)
        if bucket == "week":
            weeks = [b["date"] for b in shown]
            assert all(dt.date.fromisoformat(d).weekday() == 0 for d in weeks), weeks
    assert tokyo.watch.errors == []


def axis_ticks(page) -> list:
    """(text, value) of the value axis' ticks."""
    return page.eval_on_selector_all("#chart .grid text.ylabel", "ts => ts.map(t =>"
                                     " [t.textContent, parseFloat(t.dataset.value)])")


def test_read_10_17_units_and_decimals_as_people_read_them(tokyo):
    """Pounds to a tenth (167.8 and 168.0 read differently), an axis whose ticks read as the
    values they mark, heart rate in bpm and steps as steps: the units the server shows, never
    HAE's ``count/min`` or ``count``. (The ECG's amplitude axis: READ-10.6's trace.)"""
    days = sorted(SCALE)
    s = tokyo
    page = s.open(metric="weight_body_mass", range="custom", tz="local",
                  **{"from": days[0].isoformat(), "to": days[-1].isoformat()})
    assert {b["date"]: float(b["value"]) for b in buckets(page)} == {
        d.isoformat(): lb for d, lb in SCALE.items()}
    assert page.inner_text("#chart .chart-head .units") == "lb"
    read = {}
    for day, lb in SCALE.items():
        read[day] = readout_of(page, '#chart .bucket[data-date="%s"]' % day.isoformat())
        assert read[day] == "%s: %s lb · 1 point" % (long_date(day), shown_number(lb, 1))
    assert read[days[0]].endswith(": 167.8 lb · 1 point")
    assert read[days[1]].endswith(": 168.0 lb · 1 point")
    ticks = axis_ticks(page)
    labels = [text for text, _ in ticks]
    assert len(set(labels)) == len(labels) >= 3, labels
    for text, value in ticks:
        assert float(text.replace(",", "")) == pytest.approx(value, abs=1e-9), (text, value)
    assert ticks[0][1] <= min(SCALE.values()) and ticks[-1][1] >= max(SCALE.values())
    summary = page.get_attribute("#chart", "data-summary")  # the readout before a focus
    mean = sum(SCALE.values()) / len(SCALE)
    assert summary == "Average %s lb · lowest 167.5 · highest 168.4" % shown_number(mean, 1)

    # heart rate in bpm: Berlin's days, Avg with its lowest and highest
    heart = {p["date"][:10]: p for p in CORPUS.days["Europe/Berlin"]["heart_rate"]}
    page = s.open(metric="heart_rate", range="custom", tz="local",
                  **{"from": "2024-05-01", "to": "2024-05-07"})
    assert page.inner_text("#chart .chart-head .units") == "bpm"
    for date in ("2024-05-01", "2024-05-07"):
        p = heart[date]
        text = readout_of(page, '#chart .bucket[data-date="%s"]' % date)
        assert text == "%s: %s bpm (lowest %s, highest %s) · 1 point" % (
            long_date(dt.date.fromisoformat(date)), shown_number(p["Avg"]),
            shown_number(p["Min"]), shown_number(p["Max"])), text
    # the band is each day's Min to Max, the fields heart rate's meaning names as its
    # bounds: its edges, read back through the value axis, are the body's figures
    days = ["2024-05-%02d" % d for d in range(1, 8)]
    ticks = page.eval_on_selector_all("#chart .ylabel", "ls => ls.map(l => [parseFloat("
                                      "l.dataset.value), parseFloat(l.getAttribute('y')) - 4])")
    (v0, y0), (v1, y1) = ticks[0], ticks[-1]
    edge = [v0 + (float(y) - y0) * (v1 - v0) / (y1 - y0) for y in re.findall(
        r"[ML]\s*[\d.]+ ([\d.]+)", page.get_attribute("#chart path.band", "d"))]
    assert edge == pytest.approx([heart[d]["Max"] for d in days]
                                 + [heart[d]["Min"] for d in reversed(days)], abs=0.1), edge
    legend = page.eval_on_selector_all("#chart .legend-item", "is => is.map(i => i.textContent)")
    assert legend == ["average per day", "lowest – highest"], legend  # no field's name
    page = s.open(metric="step_count", range="custom", tz="local",
                  **{"from": "2024-05-01", "to": "2024-05-07"})
    assert page.inner_text("#chart .chart-head .units") == "steps"
    assert page.get_attribute("#chart", "data-summary").startswith("Total ")
    assert " steps · " in page.get_attribute("#chart", "data-summary")
    text = page.inner_text("#metric-view")
    assert not re.search(r"\bcount\b|count/min", text), text
    assert s.watch.errors == []


WORDS = r"""() => {
  // every cell of the journal: whole on the screen, no word or number broken across lines,
  // each cell that does not wrap on one line (its label too: as tall as the ID's cell)
  const width = document.documentElement.clientWidth;
  const out = [];
  const rows = Array.from(document.querySelectorAll('#journal tbody tr'));
  for (const tr of rows) {
    const one = tr.cells[0].getBoundingClientRect().height;
    for (const td of tr.cells) {
      const r = td.getBoundingClientRect();
      const name = td.dataset.label + ' of #' + tr.dataset.id;
      if (!r.width) continue;  // an empty cell is not shown
      if (r.left < -0.5 || r.right > width + 0.5) out.push(name + ': past the screen');
      if (td.scrollWidth > td.clientWidth + 1) out.push(name + ': cut');
      const wraps = td.classList.contains('wide') || td.classList.contains('error');
      if (!wraps && Math.abs(r.height - one) > 1) out.push(name + ': ' + r.height + ' tall');
      for (const node of td.childNodes) {
        const text = node.nodeType === 3 ? node : node.firstChild;
        if (!text || text.nodeType !== 3) continue;
        const re = /\S+/g;
        let m;
        while ((m = re.exec(text.data))) {
          const range = document.createRange();
          range.setStart(text, m.index);
          range.setEnd(text, m.index + m[0].length);
          if (range.getClientRects().length > 1) out.push(name + ': "' + m[0] + '" broken');
        }
      }
    }
  }
  return {rows: rows.length, out: out.slice(0, 12)};
}"""


def test_read_10_18_a_phone_reads_the_journal_and_a_week_of_nights_whole(session):
    """At 360 px: a week of nights has a label under each night (weekday over day), none
    over another; no cell of the journal reaches past the screen, no word or number in it is
    broken across lines, and every cell that need not wrap is on one line, label and all."""
    phone = session(timezone="America/Chicago", width=360, height=780, phone=True)
    page = phone.sign_in("#" + urllib.parse.urlencode(
        {"metric": "sleep_analysis", "range": "7d", "tz": "local"})).page
    nights = sorted(b["date"] for b in buckets(page, "#chart .night"))
    assert len(nights) == 7
    labels = page.eval_on_selector_all("#chart .grid text.xlabel", """ts => ts.map(t => {
        const r = t.getBoundingClientRect();
        return {date: t.dataset.date, text: t.textContent, left: r.left, right: r.right}; })""")
    assert sorted(label["date"] for label in labels) == nights
    for label in labels:
        day = dt.date.fromisoformat(label["date"])
        assert label["text"] == day.strftime("%a") + str(day.day), label
        assert 0 <= label["left"] and label["right"] <= 360, label
    ordered = sorted(labels, key=lambda label: label["left"])
    assert all(a["right"] <= b["left"] for a, b in zip(ordered, ordered[1:])), ordered
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    page.locator("#chart").screenshot(path=str(ARTIFACTS / "dashboard-phone-week.png"))
    page.wait_for_selector("#journal tbody tr")
    page.click("#journal-more")  # two pages: every automation's name and size of body
    page.wait_for_function("() => document.querySelectorAll('#journal tbody tr').length > %d"
                           % JOURNAL_PAGE)
    found = page.evaluate(WORDS)
    top = page.evaluate("() => document.getElementById('journal-panel')"
                        ".getBoundingClientRect().top + window.scrollY")
    page.screenshot(path=str(ARTIFACTS / "dashboard-phone-journal.png"), full_page=True,
                    clip={"x": 0, "y": top, "width": 360, "height": 700})  # the first rows
    assert found["rows"] > JOURNAL_PAGE and not found["out"], found
    points = page.eval_on_selector_all("#journal td[data-label='Points']",
                                       "ts => ts.map(t => t.textContent)")
    assert any(len(p) > 4 for p in points), points  # grouped thousands among them
    found = page.evaluate(OVERFLOW)
    assert found["scroll"] <= 360 and not found["out"], found
