"""The summary page in a real browser (READ-16): headless Chromium driven by Playwright
against a real in-process server on 127.0.0.1:0 holding bodies posted through /api/ingest
and folded, as tests/test_dashboard.py does for the metric view.

The phone is in America/New_York and its days cross the spring DST change (2025-03-09, a day
of 23 hours); the browser looks from Pacific/Auckland, a day ahead. The store holds, built
once for the module from tests/hae_factory.py's generators:

- a Days automation for 470 days (steps, energy, distance, exercise minutes, stand hours,
  heart rate, resting and walking heart rate, HRV, blood oxygen, weight in pounds, 167.8 lb
  on the DST day and 168.0 lb on the newest, …, and for the last ten days body mass index in
  HAE's ``count`` and water in ``fl_oz_us``): steps only up
  to 2025-02-18 (a Minutes automation has them from then on), exercise minutes only from
  2025-03-07 (too few days for a usual or a trend); steps and walking heart rate raised over
  the last 90 days (a trend up, better and worse), everything else left as drawn (no
  trend);
- minute steps from 2025-02-19 to the newest day, 2025-03-10;
- 24 nights of sleep in the four forms HAE has sent, blood pressure for a month, workouts of
  both versions in and out of the last seven days (one of 22 seconds), two symptoms on the
  newest day;
- nothing at all on 2025-03-04.

What a person sees is read off the page (every card, figure, sparkline mark, list item and
trend carries its numbers in data attributes) and compared with what this test computes
itself from the bodies it posted: day sums and means by the date written in each point, the
median of the 30 days before with at least 5 days, the latest body measurement, last night
by the rules of the sleep forms, the workouts of the 7 days with their durations, and the
trends' means by the rule the spec states; never with the API's reply.

Screenshots of the summary at 1280 px and 360 px go to contrib/screenshots/ (tracked: the
README shows them).
"""

import datetime as dt
import random
import re
import statistics
import urllib.parse
from pathlib import Path

import pytest

import hae_factory as hf
from conftest import Lazy
from dashboard_browser import OVERFLOW, Session, long_date, serving, shown_number
from read_helpers import USUAL_DAYS, approx, local_iso, usual_of

# Its service and browser live for the module: nothing may be left running after it.
pytestmark = pytest.mark.module_lifetime

ROOT = Path(__file__).resolve().parent.parent
SCREENSHOTS = ROOT / "contrib" / "screenshots"

ZONE = "America/New_York"
PHONE = hf.Phone(zone=hf.NEW_YORK, sources="single")
BROWSER_ZONE = "Pacific/Auckland"
NEWEST = dt.date(2025, 3, 10)
DST_DAY = dt.date(2025, 3, 9)
GAP = dt.date(2025, 3, 4)  # nothing recorded that day
FIRST = NEWEST - dt.timedelta(days=469)
MINUTES_FROM = dt.date(2025, 2, 19)  # steps come from a Minutes automation from here on
EXERCISE_FROM = dt.date(2025, 3, 7)  # a new watch: exercise minutes from here on
RISES = {"step_count": 5000, "walking_heart_rate_average": 12}  # over the last 90 days

SPARK_DAYS = 14
RECENT_DAYS, BASELINE_DAYS, MIN_RECENT, MIN_BASELINE = 90, 365, 30, 90

#: The summary's cards, by the spec (READ-15): which metric goes where.
ACTIVITY = ("step_count", "active_energy", "apple_exercise_time", "apple_stand_hour",
            "walking_running_distance")
HEART = ("resting_heart_rate", "heart_rate_variability", "walking_heart_rate_average")
BODY = ("weight_body_mass", "body_fat_percentage", "blood_pressure")
#: The stages of a night, deepest first, awake last (READ-12, READ-13).
STAGE_ORDER = ("deep", "core", "rem", "asleep", "awake")
OWN_CARDS = set(ACTIVITY + HEART + BODY) | {"heart_rate", "sleep_analysis", "workouts"}
#: What the meaning table (READ-13) says of the series posted here: summed or averaged per
#: day, and which way is better (None: no trend).
TOTALS = {"step_count", "active_energy", "apple_exercise_time", "apple_stand_hour",
          "walking_running_distance", "basal_energy_burned", "flights_climbed"}
BETTER = {"step_count": "up", "active_energy": "up", "apple_exercise_time": "up",
          "apple_stand_hour": "up", "walking_running_distance": "up", "flights_climbed": "up",
          "resting_heart_rate": "down", "walking_heart_rate_average": "down",
          "heart_rate_variability": "up", "blood_pressure": "down"}
WORKOUTS = (  # (version, name, local start, minutes)
    (2, "Running", dt.datetime(2025, 3, 10, 17, 30), 32),
    (1, "Outdoor Walk", dt.datetime(2025, 3, 8, 7, 5), 14),
    (2, "Yoga", dt.datetime(2025, 3, 6, 6, 45), 45),
    (1, "Outdoor Walk", dt.datetime(2025, 3, 3, 12, 0), 20),
    (2, "Outdoor Cycling", dt.datetime(2025, 2, 26, 18, 0), 50),
    (2, "Cooldown", dt.datetime(2025, 3, 9, 19, 0), 22 / 60),  # 22 seconds
)
#: Weights in pounds a tenth apart, on the days they were written (a Days automation's).
WEIGHTS = {DST_DAY: 167.8, NEWEST: 168.0}
#: Body mass index (HAE's units: ``count``) and water (``fl_oz_us``), the last ten days.
BMI = {NEWEST - dt.timedelta(days=k): round(23.2 - 0.05 * k, 2) for k in range(10)}
WATER = {NEWEST - dt.timedelta(days=k): round(16.9 + 2.3 * k, 1) for k in range(10)}

#: How a person reads the units (READ-16.6), by this test's own table: a count is what the
#: metric counts, or nothing where its name says it; per minute is bpm; the rest as sent.
COUNTS = {"step_count": "steps", "flights_climbed": "floors"}
SHOWN = {"count/min": "bpm", "fl_oz_us": "fl oz", "degC": "°C", "degF": "°F"}
#: At least these decimals (a person's weight changes by less than a pound a day).
DIGITS = {"weight_body_mass": 1, "body_mass_index": 1}


def shown_units(metric: str, units) -> str:
    if units == "count":
        return COUNTS.get(metric, "")
    return SHOWN.get(units, units or "")


def shown(metric: str, value: float, units) -> str:
    label = shown_units(metric, units)
    return shown_number(value, DIGITS.get(metric)) + (" " + label if label else "")


def day(text: str) -> dt.date:
    return dt.date.fromisoformat(text[:10])


class Corpus:
    """Every body posted, (automation, body bytes), and the points of each metric."""

    def __init__(self):
        self.deliveries = []
        self.points = {}  # metric -> [(point, units)]
        export = hf.days_export(seed=21, start=FIRST, end=NEWEST + dt.timedelta(days=1),
                                phone=PHONE, units={"weight_body_mass": "lb"})["data"]["metrics"]

        def midnight(on):
            return hf.zoned_stamp(ZONE, dt.datetime.combine(on, dt.time()))

        export += [hf.metric(name, [{"date": midnight(on), "qty": qty, "source": hf.OWNER_PHONE}
                                    for on, qty in sorted(values.items())], units)
                   for name, values, units in (("body_mass_index", BMI, "count"),
                                               ("dietary_water", WATER, "fl_oz_us"))]
        metrics = []
        for m in export:
            data = []
            for p in m["data"]:
                written = day(p["date"])
                if written == GAP or (m["name"] == "step_count" and written >= MINUTES_FROM) \
                        or (m["name"] == "apple_exercise_time" and written < EXERCISE_FROM) \
                        or (m["name"] == "weight_body_mass" and written in WEIGHTS):
                    continue
                if m["name"] in RISES and written > NEWEST - dt.timedelta(days=RECENT_DAYS):
                    p = dict(p, qty=p["qty"] + RISES[m["name"]])
                data.append(p)
            if m["name"] == "weight_body_mass":
                data = sorted(data + [{"date": midnight(on), "qty": qty,
                                       "source": hf.OWNER_PHONE}
                                      for on, qty in WEIGHTS.items()], key=lambda p: p["date"])
            metrics.append(hf.metric(m["name"], data, m["units"]))
            self.note(m["name"], data, m["units"])
        self.post(hf.Automation("Health days", "Days", "Previous 7 Days"),
                  hf.envelope(metrics=metrics))
        start, end = (hf.zoned_epoch(ZONE, dt.datetime.combine(d, dt.time()))
                      for d in (MINUTES_FROM, NEWEST + dt.timedelta(days=1)))
        steps = [p for p in hf.minute_steps(ZONE, start, end, every=240, seed=9)
                 if day(p["date"]) != GAP]
        self.note("step_count", steps, "count")
        self.post(hf.Automation("Health minutes", "Minutes", "Since Last Sync"),
                  hf.envelope(metrics=[hf.metric("step_count", steps, "count")]))
        pressure = [p for p in hf.metric_points(3, "blood_pressure", NEWEST - dt.timedelta(
            days=30), NEWEST + dt.timedelta(days=1), "Default", phone=PHONE)
            if day(p["date"]) != GAP]
        self.note("blood_pressure", pressure, "mmHg")
        self.post(hf.Automation("Blood pressure", "Default", "Since Last Sync"),
                  hf.envelope(metrics=[hf.metric("blood_pressure", pressure)]))
        # 24 nights to the newest morning, the four forms in turn (none on the empty day)
        self.nights = {}
        points = []
        for k in range(25):
            wake = NEWEST - dt.timedelta(days=24 - k)
            if wake == GAP:
                continue
            form = hf.NIGHT_FORMS[(k + 3) % 4]
            night = hf.sleep_night_points(form, ZONE, wake, seed=4)
            self.nights[wake] = (form, night)
            points += night
        self.post(hf.Automation("Sleep", "Default", "Previous 7 Days"),
                  hf.envelope(metrics=[hf.metric("sleep_analysis", points)]))
        rng = random.Random(12)
        self.workouts = [
            (hf.workout_v2 if version == 2 else hf.workout_v1)(
                40 + k, start, name=name, minutes=minutes, phone=PHONE, route_points=3,
                rng=rng)
            for k, (version, name, start, minutes) in enumerate(WORKOUTS)]
        self.symptoms = hf.symptoms(random.Random(5), dt.datetime(2025, 3, 10, 14, 0),
                                    phone=PHONE, count=2)
        self.post(hf.Automation("Workouts", "Default", "Since Last Sync"),
                  hf.envelope(workouts=self.workouts, symptoms=self.symptoms))

    def note(self, metric, points, units):
        self.points.setdefault(metric, []).extend((p, units) for p in points)

    def post(self, automation, body):
        self.deliveries.append((automation, hf.dumps_hae(body)))

    # -- the test's own figures -----------------------------------------------------------

    def day_values(self, metric) -> dict:
        """date -> (value, units): the day's sum (a total) or mean (an average) of the
        points whose written date it is."""
        out = {}
        main = "systolic" if metric == "blood_pressure" else "qty"  # the main field
        for p, units in self.points.get(metric, []):
            out.setdefault(day(p["date"]), []).append((p[main], units))
        return {d: ((sum if metric in TOTALS else statistics.mean)([v for v, _ in values]),
                    values[0][1]) for d, values in out.items()}

    def series(self, metric, on: dt.date):
        """(value, usual, spark {date: value}, units) of a series card, or None when the 30
        days before and the day hold nothing."""
        values = {d: v for d, (v, _) in self.day_values(metric).items()}
        window = [d for d in values if on - dt.timedelta(days=USUAL_DAYS) <= d <= on]
        if not window:
            return None
        units = {u for _, u in self.day_values(metric).values()}.pop()
        return (values.get(on), usual_of(values, on),
                {d: v for d, v in values.items()
                 if on - dt.timedelta(days=SPARK_DAYS - 1) <= d <= on}, units)

    def night(self, wake: dt.date):
        """Last night by the rules of its form: a summary is on the date of its sleepEnd,
        asleep is HAE's total (totalSleep, else asleep + core + deep + rem), its stages where
        the watch told some apart (with its unstaged "asleep" as one); stage records on the
        date of their last end, asleep the asleep segments (they do not overlap here), in
        bed the in-bed record, stages the records' qty; bed and wake the sleep's start and
        end (the first start and last end of the records)."""
        if wake not in self.nights:
            return None
        form, points = self.nights[wake]
        if form != "d":
            p = points[0]
            assert day(p["sleepEnd"]) == wake
            # HAE's own total: totalSleep when sent, else the unstaged "asleep" plus the
            # stages (its "asleep" beside stages is only what the watch left unstaged)
            asleep = p["totalSleep"] if "totalSleep" in p else p.get("asleep", 0) + sum(
                p.get(k, 0) for k in ("core", "deep", "rem"))
            stages = {k: p[k] for k in ("core", "deep", "rem", "awake") if p.get(k)}
            if p.get("core") and p.get("asleep"):  # what the watch left unstaged: a stage
                stages["asleep"] = p["asleep"]
            return {"asleep": asleep, "in_bed": p["inBed"], "start": local_iso(p["sleepStart"]),
                    "end": local_iso(p["sleepEnd"]), "stages": stages}
        stages, asleep, in_bed = {}, 0.0, None
        for r in points:
            span = (hf.epoch_of_text(r["endDate"]) - hf.epoch_of_text(r["startDate"])) / 3600
            if r["value"] == "In Bed":
                in_bed = span
                continue
            stage = r["value"].lower()
            stages[stage] = stages.get(stage, 0.0) + r["qty"]
            if stage != "awake":
                asleep += span
        first = min(points, key=lambda r: hf.epoch_of_text(r["startDate"]))
        last = max(points, key=lambda r: hf.epoch_of_text(r["endDate"]))
        assert day(last["endDate"]) == wake
        return {"asleep": asleep, "in_bed": in_bed, "start": local_iso(first["startDate"]),
                "end": local_iso(last["endDate"]), "stages": stages}

    def asleep_by_night(self) -> dict:
        return {wake: self.night(wake)["asleep"] for wake in self.nights}

    def latest(self, metric, on: dt.date):
        """(values, local time) of the last measurement written on or before the day."""
        found = [p for p, _ in self.points.get(metric, []) if day(p["date"]) <= on]
        if not found:
            return None
        p = max(found, key=lambda p: hf.epoch_of_text(p["date"]))
        return ({k: v for k, v in p.items() if k in ("qty", "systolic", "diastolic")},
                local_iso(p["date"]))

    def week_of_workouts(self, on: dt.date) -> dict:
        """local start -> (name, seconds, energy, energy units) of the workouts started on
        the 7 days ending on the day: version 2's duration, version 1's end - start; energy
        as sent (activeEnergyBurned, else activeEnergy)."""
        out = {}
        for w in self.workouts:
            if not on - dt.timedelta(days=6) <= day(w["start"]) <= on:
                continue
            seconds = (w["duration"] if "duration" in w
                       else hf.epoch_of_text(w["end"]) - hf.epoch_of_text(w["start"]))
            energy = w.get("activeEnergyBurned") or w["activeEnergy"]
            out[local_iso(w["start"])] = (w["name"], seconds, energy["qty"], energy["units"])
        return out

    def other(self, on: dt.date) -> dict:
        """metric -> (value, units) of everything else written on the day: a series' day
        value, a list's count."""
        out = {}
        for metric in self.points:
            if metric in OWN_CARDS:
                continue
            found = self.day_values(metric).get(on)
            if found is not None:
                out[metric] = found
        for s in self.symptoms:
            if day(s["start"]) == on:
                key = "symptoms/" + s["name"]
                out[key] = (out.get(key, (0, None))[0] + 1, None)
        return out

    def trends(self, on: dt.date) -> dict:
        """metric -> (recent mean, baseline mean, baseline sd, flagged, direction) for the
        series with a better direction and enough days, by the rule the spec states."""
        out = {}
        for metric, better in BETTER.items():
            values = {d: v for d, (v, _) in self.day_values(metric).items()}
            recent = [v for d, v in values.items()
                      if on - dt.timedelta(days=RECENT_DAYS) < d <= on]
            base = [v for d, v in values.items() if on - dt.timedelta(
                days=RECENT_DAYS + BASELINE_DAYS) < d <= on - dt.timedelta(days=RECENT_DAYS)]
            if len(recent) < MIN_RECENT or len(base) < MIN_BASELINE:
                continue
            mean_recent, mean_base = statistics.mean(recent), statistics.mean(base)
            spread = statistics.stdev(base)
            direction = "up" if mean_recent > mean_base else "down"
            out[metric] = (mean_recent, mean_base, spread, abs(mean_recent - mean_base) > spread,
                           direction, direction == better)
        return out


CORPUS = Lazy(Corpus)


# -- the module's service, browser and page ------------------------------------------------


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    # Received on the evening of the newest day, and judged then: the page's freshness line
    # is about the corpus (steps that moved from the Days to the Minutes automation), not
    # about the day the test runs.
    evening = hf.zoned_epoch(ZONE, dt.datetime.combine(NEWEST, dt.time(21, 0)))
    with serving(tmp_path_factory.mktemp("summary-page") / "data", CORPUS.deliveries,
                 clock=lambda: evening) as store:
        yield store


@pytest.fixture(scope="module")
def desktop(browser, store):
    """One signed-in browser for the module's desktop tests, in a zone a day ahead of the
    phone's; it must see no console error or CSP violation."""
    s = Session(browser, store, timezone=BROWSER_ZONE, width=1280, height=900)
    s.sign_in()
    yield s
    s.close()


CARDS = """() => Array.from(document.querySelectorAll('#cards .card')).map(c => ({
  data: Object.assign({}, c.dataset), group: c.closest('.card-group').dataset.group,
  href: c.getAttribute('href'), value: (c.querySelector('.card-value') || {}).textContent,
  usual: (c.querySelector('.card-usual') || {}).textContent,
  marks: Array.from(c.querySelectorAll('.spark-mark')).map(m => Object.assign({}, m.dataset)),
  paths: c.querySelectorAll('.spark-path').length,
  fields: Array.from(c.querySelectorAll('[data-field]')).map(f => Object.assign({}, f.dataset)),
  stages: Array.from(c.querySelectorAll('[data-stage]')).map(f => Object.assign({}, f.dataset)),
  items: Array.from(c.querySelectorAll('li')).map(li => Object.assign(
    {text: li.textContent}, li.dataset)),
}))"""


def show(page, on=None):
    """The summary of ``on`` (None: as a first visit opens it), drawn."""
    hash_ = "#view=summary" + ("&date=%s" % on.isoformat() if on else "")
    page.evaluate("""h => { if (location.hash === h) return;
        document.getElementById('summary').dataset.state = 'stale'; location.hash = h; }""",
                  hash_)
    return cards_on(page, on or NEWEST)


def cards_on(page, on):
    page.wait_for_selector('#summary[data-state="ready"][data-date="%s"]' % on.isoformat())
    return page.evaluate(CARDS)


def num(data, key):
    return float(data[key]) if key in data else None


def runs(dates) -> int:
    """Stretches of two days or more in a row: the sparkline's line segments."""
    dates, count, length = sorted(dates), 0, 0
    for k, d in enumerate(dates):
        length = length + 1 if k and (d - dates[k - 1]).days == 1 else 1
        count += length == 2
    return count


def check_day(cards: list, on: dt.date) -> None:
    """Every card of the summary of ``on`` against the test's own figures."""
    by = {}
    for c in cards:
        by.setdefault((c["group"], c["data"].get("metric")), []).append(c)
    seen = set()
    for group, metrics in (("activity", ACTIVITY), ("heart", HEART)):
        for metric in metrics:
            truth = CORPUS.series(metric, on)
            if truth is None:
                assert (group, metric) not in by, (metric, "a card without data")
                continue
            value, usual, spark, units = truth
            [card] = by[(group, metric)]
            seen.add((group, metric))
            data = card["data"]
            assert data["units"] == units and data["date"] == on.isoformat()
            assert num(data, "value") == approx(value), (metric, on)
            assert num(data, "usual") == approx(usual), (metric, on)
            if value is None:  # a day without data says so, never 0
                assert card["value"].strip() == "no data", card["value"]
            if usual is None:
                assert card["usual"].startswith("no usual yet"), card["usual"]
            marks = {day(m["date"]): float(m["value"]) for m in card["marks"]}
            assert marks == {d: approx(v) for d, v in spark.items()}, (metric, on)
            if metric not in TOTALS:  # a line, broken where a day has no value
                assert card["paths"] == runs(spark), (metric, card["paths"])
            assert urllib.parse.parse_qs(card["href"].lstrip("#")) == {
                "metric": [metric], "range": ["custom"], "tz": ["local"],
                "from": [(on - dt.timedelta(days=SPARK_DAYS - 1)).isoformat()],
                "to": [on.isoformat()]}
    # the day's heart rate: lowest Min, mean Avg, highest Max of its points
    heart = [p for p, _ in CORPUS.points["heart_rate"] if day(p["date"]) == on]
    ranges = [c for c in by.get(("heart", "heart_rate"), [])]
    if heart:
        [card] = ranges
        assert (num(card["data"], "min"), num(card["data"], "avg"), num(card["data"], "max")) \
            == (approx(min(p["Min"] for p in heart)),
                approx(statistics.mean(p["Avg"] for p in heart)),
                approx(max(p["Max"] for p in heart)))
        assert {f["field"]: float(f["value"]) for f in card["fields"]} == {
            "min": num(card["data"], "min"), "avg": num(card["data"], "avg"),
            "max": num(card["data"], "max")}
    else:
        assert not ranges
    assert {k for k in by if k[0] in ("activity", "heart") and k[1] != "heart_rate"} == seen
    # last night
    night = CORPUS.night(on)
    [sleep] = by[("sleep", "sleep_analysis")]
    data = sleep["data"]
    usual = usual_of(CORPUS.asleep_by_night(), on)
    assert num(data, "usual") == approx(usual)
    assert {day(m["date"]): float(m["value"]) for m in sleep["marks"]} == {
        d: approx(v) for d, v in CORPUS.asleep_by_night().items()
        if on - dt.timedelta(days=SPARK_DAYS - 1) <= d <= on}
    if night is None:
        assert "asleep" not in data and sleep["value"].strip() == "no data"
    else:
        assert (num(data, "asleep"), num(data, "inBed")) == (approx(night["asleep"]),
                                                            approx(night["in_bed"]))
        assert (data["sleepStart"], data["sleepEnd"]) == (night["start"], night["end"])
        assert {s["stage"]: float(s["hours"]) for s in sleep["stages"]} == {
            k: approx(v) for k, v in night["stages"].items()}
        # deepest first, awake last, each read by its name
        assert [s["stage"] for s in sleep["stages"]] == [
            k for k in STAGE_ORDER if k in night["stages"]]
        clock = {f["field"]: f for f in sleep["fields"]}
        assert clock["sleep_start"]["local"] == night["start"]
        assert clock["sleep_end"]["local"] == night["end"]
    # body: the latest measurement on or before the day, with its time
    for metric in BODY:
        truth = CORPUS.latest(metric, on)
        cards_of = by.get(("body", metric), [])
        if truth is None:
            assert not cards_of
            continue
        [card] = cards_of
        values, measured = truth
        assert card["data"]["measured"] == measured
        assert {f["field"]: float(f["value"]) for f in card["fields"]} == {
            k: approx(v) for k, v in values.items()}
    # the workouts of the 7 days
    week = CORPUS.week_of_workouts(on)
    found = by.get(("workouts", "workouts"), [])
    if not week:
        assert not found
    else:
        [card] = found
        shown = {i["local"]: (i["name"], float(i["durationS"]), float(i["energy"]),
                              i["energyUnits"]) for i in card["items"]}
        assert shown == {k: (n, approx(s), approx(e), u) for k, (n, s, e, u) in week.items()}
        assert float(card["data"]["seconds"]) == approx(sum(w[1] for w in week.values()))
    # everything else written that day
    other = CORPUS.other(on)
    found = by.get(("other", None), [])
    if not other:
        assert not found
    else:
        [card] = found
        shown = {i["metric"]: (float(i["value"]), i.get("units")) for i in card["items"]}
        assert shown == {k: (approx(v), u) for k, (v, u) in other.items()}


# -- the tests ---------------------------------------------------------------------------


def test_read_16_1_signed_in_the_summary_of_the_newest_day(desktop):
    page = desktop.page
    page.goto(desktop.store.base + "/")  # a first visit: no address
    cards = cards_on(page, NEWEST)
    assert page.is_hidden("#metric-view") and page.is_hidden("#journal-panel")
    assert urllib.parse.urlsplit(page.url).fragment == ""
    check_day(cards, NEWEST)
    groups = page.eval_on_selector_all("#cards .card-group", "gs => gs.map(g => g.dataset.group)")
    assert groups == ["activity", "sleep", "heart", "body", "workouts", "other"]
    titles = page.eval_on_selector_all("#cards .card-group > h3",
                                       "hs => hs.map(h => h.textContent)")
    assert titles == ["Activity", "Last night", "Heart", "Body", "Workouts", "Also recorded"]
    # every series the store holds for the day has its card, in the units stored
    assert {c["data"]["metric"] for c in cards if c["group"] == "activity"} == set(ACTIVITY)
    # a usual needs 5 days: exercise minutes have 3 before the day
    [exercise] = [c for c in cards if c["data"].get("metric") == "apple_exercise_time"]
    assert exercise["usual"] == "no usual yet (3 of the 5 days it needs)"
    # the rule of the usual is on the page, with its numbers
    rule = page.eval_on_selector("#usual-rule", "p => Object.assign({text: p.textContent},"
                                 " p.dataset)")
    assert (rule["days"], rule["minDays"]) == ("30", "5") and "median" in rule["text"]
    # numbers read as a person reads them: steps grouped, last night in hours and minutes
    [steps] = [c for c in cards if c["data"].get("metric") == "step_count"]
    assert steps["value"] == "{:,} steps".format(round(float(steps["data"]["value"])))
    assert page.is_disabled("#day-next")  # the newest day has no next


def test_read_16_1_an_empty_store_says_there_is_no_data_yet(browser, tmp_path):
    with serving(tmp_path / "data", []) as empty:
        s = Session(browser, empty, timezone=BROWSER_ZONE)
        try:
            page = s.sign_in().page
            assert page.locator("#cards .card").count() == 0
            assert page.inner_text("#cards") == \
                "No data yet. Point a Health Auto Export automation at /api/ingest."
            assert page.locator("#trends li.trend").count() == 0
            assert "latest day with data" not in page.inner_text("#summary-meta")
        finally:
            s.close()


def test_read_16_2_previous_and_next_day_and_a_day_without_data(desktop):
    page = desktop.page
    show(page)
    page.click("#day-prev")  # the spring DST day, 23 hours long in New York
    check_day(cards_on(page, DST_DAY), DST_DAY)
    assert "date=2025-03-09" in page.url
    page.reload()  # the day stays in the address
    check_day(cards_on(page, DST_DAY), DST_DAY)
    forms = {CORPUS.nights[DST_DAY][0]}
    for back in range(1, (DST_DAY - GAP).days):  # the nights of the other three forms
        page.click("#day-prev")
        on = DST_DAY - dt.timedelta(days=back)
        check_day(cards_on(page, on), on)
        forms.add(CORPUS.nights[on][0])
    assert forms == set(hf.NIGHT_FORMS)
    page.click("#day-prev")
    cards = cards_on(page, GAP)
    check_day(cards, GAP)
    series = [c for c in cards if c["group"] in ("activity", "heart")]
    assert series and all(c["value"].strip() == "no data" and "value" not in c["data"]
                          for c in series)
    assert not any(m["date"] == GAP.isoformat() for c in cards for m in c["marks"])
    page.click("#day-next")
    check_day(cards_on(page, GAP + dt.timedelta(days=1)), GAP + dt.timedelta(days=1))
    page.go_back()  # each day is a step of the browser's history
    cards_on(page, GAP)
    page.click("#day-latest")
    cards_on(page, NEWEST)
    assert page.is_disabled("#day-next")


def test_read_16_3_a_card_leads_to_its_metric_view(desktop):
    page = desktop.page
    show(page)
    from_ = NEWEST - dt.timedelta(days=SPARK_DAYS - 1)
    page.click('#cards .card[data-metric="step_count"]')
    page.wait_for_selector('#chart[data-state="ready"][data-metric="step_count"]'
                           '[data-range="custom"][data-from="%s"]' % from_.isoformat())
    assert page.is_hidden("#summary") and page.is_visible("#metric-view")
    assert (page.input_value("#from"), page.input_value("#to")) == (
        from_.isoformat(), NEWEST.isoformat())
    bars = page.eval_on_selector_all("#chart .bucket", "ns => ns.map(n => Object.assign({},"
                                     " n.dataset))")
    steps = {d: v for d, (v, _) in CORPUS.day_values("step_count").items()
             if from_ <= d <= NEWEST}
    assert {day(b["date"]): float(b["value"]) for b in bars} == {
        d: approx(v) for d, v in steps.items()}
    # last night's card leads to the nights of the same 14 days
    page.click("#nav-summary")
    cards_on(page, NEWEST)
    page.click('#cards .card[data-metric="sleep_analysis"]')
    page.wait_for_selector('#chart[data-state="ready"][data-metric="sleep_analysis"]'
                           '[data-from="%s"]' % from_.isoformat())
    nights = page.eval_on_selector_all("#chart .night", "ns => ns.map(n => [n.dataset.date,"
                                       " parseFloat(n.dataset.asleep)])")
    assert {day(d): v for d, v in nights} == {
        d: approx(v) for d, v in CORPUS.asleep_by_night().items() if from_ <= d <= NEWEST}
    page.go_back()
    cards_on(page, NEWEST)


def test_read_16_4_trends_against_the_tests_own_means(desktop):
    page = desktop.page
    show(page)
    shown = page.eval_on_selector_all("#trends li.trend", """ls => ls.map(l => Object.assign(
        {text: l.textContent, figures: Array.from(l.querySelectorAll('[data-field]')).map(
            f => Object.assign({}, f.dataset))}, l.dataset))""")
    truth = CORPUS.trends(NEWEST)
    assert {t["metric"] for t in shown} == set(truth)
    # built to trend: steps up (better) and walking heart rate up (worse); the rest flat
    assert truth["step_count"][3:] == (True, "up", True)
    assert truth["walking_heart_rate_average"][3:] == (True, "up", False)
    assert not any(t[3] for m, t in truth.items() if m not in RISES)
    assert "apple_exercise_time" not in truth and "blood_pressure" not in truth  # too few days
    for t in shown:
        recent, base, spread, flagged, direction, better = truth[t["metric"]]
        assert (float(t["recent"]), float(t["baseline"]), float(t["baselineSd"])) == (
            approx(recent), approx(base), approx(spread)), t["metric"]
        assert t["flagged"] == ("true" if flagged else "false"), t["metric"]
        assert t["direction"] == direction
        assert t["better"] == ("better" if better else "worse")
        figures = {f["field"]: float(f["value"]) for f in t["figures"]}
        assert figures == {"recent": approx(recent), "baseline": approx(base),
                           "baseline_sd": approx(spread)}
        units = {u for _, u in CORPUS.day_values(t["metric"]).values()}.pop()
        label = shown_units(t["metric"], units)  # "steps", "bpm", "kJ"
        assert t["units"] == units and (not label or t["text"].count(label) >= 3), t["text"]
        assert ("flagged" in t["text"]) == flagged
        assert ("▲ up" if direction == "up" else "▼ down") in t["text"]
    # flagged trends first
    flags = [t["flagged"] == "true" for t in shown]
    assert flags == sorted(flags, reverse=True)
    rule = page.eval_on_selector("#trend-rule", "p => Object.assign({text: p.textContent},"
                                 " p.dataset)")
    assert (rule["recentDays"], rule["baselineDays"], rule["minRecentDays"],
            rule["minBaselineDays"]) == ("90", "365", "30", "90")
    assert "last 90 days" in rule["text"] and "365 days before" in rule["text"]
    assert "standard deviation" in rule["text"]


def screenshot_summary(page, name: str) -> None:
    """The header and the summary, down to its end (at most two phone screens), into
    contrib/screenshots/."""
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    page.mouse.move(0, 0)  # no card hovered
    page.evaluate("() => window.scrollTo(0, 0)")
    box = page.locator("#summary").bounding_box()
    width = page.viewport_size["width"]
    height = box["y"] + box["height"] + 12
    if width < 600:
        height = min(height, 2 * page.viewport_size["height"])
    page.screenshot(path=str(SCREENSHOTS / name), full_page=True,
                    clip={"x": 0, "y": 0, "width": width, "height": height})


def test_read_16_5_one_column_on_a_phone_and_screenshots(browser, store, desktop):
    phone = Session(browser, store, timezone=BROWSER_ZONE, width=360, height=780, phone=True)
    try:
        page = phone.sign_in().page
        cards = cards_on(page, NEWEST)
        check_day(cards, NEWEST)
        found = page.evaluate(OVERFLOW)
        assert found["scroll"] <= 360 and not found["out"], found
        boxes = page.eval_on_selector_all("#cards .card", "cs => cs.map(c => {"
                                          " const r = c.getBoundingClientRect();"
                                          " return [r.left, r.width]; })")
        assert len({round(left) for left, _ in boxes}) == 1  # one column
        assert all(300 <= width <= 360 for _, width in boxes), boxes
        screenshot_summary(page, "summary-phone.png")
    finally:
        phone.close()
    page = desktop.page
    show(page)
    columns = page.eval_on_selector_all('#cards .card-group[data-group="activity"] .card',
                                        "cs => cs.map(c => c.getBoundingClientRect().left)")
    assert len({round(x) for x in columns}) > 1  # side by side on a desktop
    screenshot_summary(page, "summary.png")


def test_read_16_6_numbers_as_people_read_them(desktop):
    """Units as a person says them and decimals where a day's change is smaller than one
    unit, read off the cards and compared with this test's own formatting of its own
    figures: pounds to a tenth (167.8 and 168.0 read differently), bpm, steps, a body mass
    index without "count", water in fl oz, a 22-second workout in seconds, and a weight
    that arrives once a day dated without a clock."""
    page = desktop.page
    weights = {}
    for on in (DST_DAY, NEWEST):
        cards = show(page, on)
        by = {c["data"].get("metric"): c for c in cards if c["data"].get("metric")}
        weight = by["weight_body_mass"]
        assert [float(f["value"]) for f in weight["fields"]] == [WEIGHTS[on]]
        weights[on] = weight["value"].strip()
        assert weights[on] == shown("weight_body_mass", WEIGHTS[on], "lb")
        # a Days automation's weight: written at local midnight, its date without a clock
        assert weight["data"]["measured"].startswith(on.isoformat() + "T00:00:00")
        assert weight["usual"] == "measured " + long_date(on)
        # every series card's value and usual, in the units a person says
        for c in cards:
            metric, data = c["data"].get("metric"), c["data"]
            if c["group"] in ("activity", "heart") and "value" in data \
                    and metric != "heart_rate":
                assert c["value"].strip() == shown(metric, float(data["value"]),
                                                   data["units"]), (metric, c["value"])
                if "usual" in data:
                    assert c["usual"] == "usual " + shown(metric, float(data["usual"]),
                                                          data["units"]), c["usual"]
        assert by["resting_heart_rate"]["value"].strip().endswith(" bpm")
        assert by["heart_rate"]["usual"] == "bpm"  # the range card's units
        text = page.inner_text("#summary")
        assert not re.search(r"\bcount\b|count/min|fl_oz_us|degC", text), text
    assert weights == {DST_DAY: "167.8 lb", NEWEST: "168.0 lb"}
    # everything else recorded on the newest day: BMI without a unit, water in fl oz
    [other] = [c for c in cards if c["group"] == "other"]
    items = {i["metric"]: i["text"] for i in other["items"]}
    assert items["body_mass_index"] == "Body mass index" + shown_number(BMI[NEWEST], 1)
    assert items["body_mass_index"].endswith("23.2")
    assert items["dietary_water"] == "Water" + shown_number(WATER[NEWEST]) + " fl oz"
    # the 22-second workout in seconds, the others in minutes
    [workouts] = [c for c in cards if c["group"] == "workouts"]
    for item in workouts["items"]:
        seconds = float(item["durationS"])
        expected = ("%d s" % int(seconds + 0.5) if seconds < 59.5
                    else "%d min" % int(seconds / 60 + 0.5))
        assert expected in item["text"], (item["text"], seconds)
    assert any(float(i["durationS"]) < 60 for i in workouts["items"])
