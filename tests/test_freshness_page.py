"""The summary page's freshness in a real browser (FRESH-6.5, 6.6): headless Chromium driven
by Playwright against a real in-process server on 127.0.0.1:0 whose clock the test sets
(``Config.clock``), holding bodies posted through /api/ingest and folded.

The phone is in Europe/Berlin; the browser looks from Asia/Tokyo. Ten days, the last one
today by the server's clock, of one Minutes automation delivering every evening and one Days
automation (steps) every evening:

- heart rate every quarter hour from 08:00 to 20:00 (12 hours a day), but none on the fourth
  day and only 09:00-12:00 (3 hours) on the seventh;
- blood oxygen every hour up to the eighth day, then none while the automation delivers:
  stale, the line at the top;
- the Days automation's steps every day but the fourth.

What the page shows (the line's text, every calendar cell's date, hours and state, the gaps
listed) is read off the page and compared with what this test computes from the points it
posted: the hours written in them per date, the median of the days before today, the
spec's thin, missing and stale rules.
"""

import datetime as dt
import statistics
from pathlib import Path

import pytest

import hae_factory as hf
from conftest import Clock
from dashboard_browser import OVERFLOW, Session, serving

# Its service and browser live for the module: nothing may be left running after it.
pytestmark = pytest.mark.module_lifetime

PHONE = hf.Phone(zone=hf.BERLIN, sources="single")
DAYS = [dt.date(2025, 5, 24) + dt.timedelta(days=k) for k in range(10)]
TODAY = DAYS[-1]
MISSING, THIN = DAYS[3], DAYS[6]
SPO2_UNTIL = DAYS[7]
MINUTES = hf.Automation("Minutes", "Minutes", "Since Last Sync")
DAILY = hf.Automation("Daily totals", "Days", "Today")
HOUR = 3600
ARTIFACTS = Path(__file__).resolve().parent / "artifacts"  # screenshots to look at


def point(name: str, at: float) -> dict:
    fields = {"Min": 58, "Avg": hf.CANARY_QTY, "Max": 91} if name == "heart_rate" \
        else {"qty": hf.CANARY_QTY}
    return dict({"date": PHONE.time(at)}, **fields, source=hf.OWNER_WATCH)


class Corpus:
    """Every delivery (automation, received at, body), and the points of each metric."""

    def __init__(self):
        self.deliveries = []
        self.points = {}
        for day in DAYS:
            midnight = hf.local_midnight(hf.BERLIN, day)
            hours = () if day == MISSING else range(9, 12) if day == THIN else range(8, 20)
            metrics = {"heart_rate": [point("heart_rate", midnight + h * HOUR + q * 900)
                                      for h in hours for q in range(4)]}
            if day <= SPO2_UNTIL:
                metrics["blood_oxygen_saturation"] = [
                    point("blood_oxygen_saturation", midnight + h * HOUR) for h in range(8, 20)]
            self.add(MINUTES, midnight + 21 * HOUR, metrics)
            if day != MISSING:
                self.add(DAILY, midnight + 21 * HOUR + 300,
                         {"step_count": [point("step_count", midnight)]})
        self.now = hf.local_midnight(hf.BERLIN, TODAY) + 21 * HOUR + 1800

    def add(self, automation, at, metrics):
        body = hf.dumps_hae(hf.envelope(metrics=[hf.metric(name, points)
                                                 for name, points in metrics.items() if points]))
        self.deliveries.append((automation, at, body))
        for name, points in metrics.items():
            self.points.setdefault(name, []).extend(points)

    def hours(self, metric: str) -> dict:
        """Local date -> the local hours written in the metric's points."""
        found = {}
        for p in self.points[metric]:
            found.setdefault(p["date"][:10], set()).add(p["date"][11:13])
        return found


CORPUS = Corpus()


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """Each delivery received at its time, folded; then the clock set to when the page is
    read."""
    clock = Clock(0)
    with serving(tmp_path_factory.mktemp("freshness-page") / "data",
                 [(automation, body, at) for automation, at, body in CORPUS.deliveries],
                 clock=clock) as running:
        clock.now = CORPUS.now
        yield running


@pytest.fixture(scope="module")
def desktop_page(browser, store):
    """One signed-in browser for the desktop tests, nine hours ahead of the phone; it must
    see no console error or CSP violation."""
    session = Session(browser, store, timezone="Asia/Tokyo")
    coverage_ready(session.sign_in().page)
    yield session.page
    session.close()


CELLS = """() => Array.from(document.querySelectorAll('#coverage .cov-row[data-metric]'))
  .map(r => ({metric: r.dataset.metric, layer: r.dataset.layer, kind: r.dataset.kind,
              cells: Array.from(r.querySelectorAll('.cov-cell')).map(c => ({
                date: c.dataset.date, value: c.dataset.value, state: c.dataset.state,
                cls: c.className, title: c.title}))}))"""

GAPS = """() => Array.from(document.querySelectorAll('#coverage-gaps li')).map(g => ({
  automation: g.dataset.automation, from: g.dataset.from, to: g.dataset.to,
  text: g.textContent}))"""


def expected_states(counts: list, daily: bool = True) -> list:
    """The spec's rule for a row, from the test's own counts (the last day is today)."""
    usual = statistics.median([c for c in counts[:-1] if c])
    out = []
    for i, count in enumerate(counts):
        if i == len(counts) - 1:
            out.append("today")
        elif not count:
            out.append("missing" if daily else "quiet")
        else:
            out.append("thin" if count < usual / 2 else "ok")
    return out


def coverage_ready(page):
    page.wait_for_selector('#summary[data-state="ready"]')
    page.wait_for_selector('#coverage[data-state="ready"]')
    return page


def test_fresh_6_5_the_summary_page_says_what_is_stale_with_the_action(desktop_page):
    page = desktop_page
    items = page.eval_on_selector_all(
        "#attention .attention-item", "xs => xs.map(x => ({data: Object.assign({},"
        " x.dataset), text: x.querySelector('.attention-text').textContent,"
        " action: x.querySelector('.attention-action').textContent}))")
    newest = max(p["date"] for p in CORPUS.points["blood_oxygen_saturation"])
    assert newest == "2025-05-31 19:00:00 +0200"
    [item] = items
    assert item["data"] == {"kind": "metric", "state": "stale",
                            "subject": "blood_oxygen_saturation/minutes",
                            "since": "2025-05-31T19:00:00+02:00"}
    assert item["text"] == ("Blood oxygen (minutes): nothing since Sat 2025-05-31 19:00"
                            " +02:00 while 'Minutes' keeps delivering.")
    assert "open the automation 'Minutes', tap Manual Export and export 2025-05-31 to" \
           " %s" % TODAY in item["action"]
    assert "re-send is always safe" in item["action"]
    # It is the first thing in the summary.
    first = page.evaluate("() => document.querySelector('#summary').firstElementChild.id")
    assert first == "attention"
    assert page.is_visible("#attention")
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "freshness.png"), full_page=True)


def test_fresh_6_6_the_calendar_shows_the_missing_and_the_thin_days(desktop_page):
    page = desktop_page
    rows = {(r["metric"], r["layer"]): r for r in page.evaluate(CELLS)}
    dates = [d.isoformat() for d in DAYS]
    # Heart rate: hours per date as written in the points, and the rule's states.
    hr = rows[("heart_rate", "minutes")]
    shown = hr["cells"][-len(DAYS):]
    assert [c["date"] for c in shown] == dates
    earlier = hr["cells"][:-len(DAYS)]  # the four weeks start before the first point
    assert {c["state"] for c in earlier} == {"before"}
    counts = [len(CORPUS.hours("heart_rate").get(date, ())) for date in dates]
    assert counts[3] == 0 and counts[6] == 3 and counts[0] == 12
    assert [int(c["value"]) for c in shown] == counts
    assert [c["state"] for c in shown] == expected_states(counts)
    assert shown[3]["state"] == "missing" and shown[6]["state"] == "thin"
    assert "missing" in shown[3]["cls"] and "thin" in shown[6]["cls"]
    assert "3 hours with data (thin)" in shown[6]["title"]
    # Blood oxygen: every hour up to its last day, then missing while delivered.
    spo2 = rows[("blood_oxygen_saturation", "minutes")]["cells"][-len(DAYS):]
    spo2_counts = [len(CORPUS.hours("blood_oxygen_saturation").get(date, ()))
                   for date in dates]
    assert [int(c["value"]) for c in spo2] == spo2_counts
    assert [c["state"] for c in spo2] == expected_states(spo2_counts)
    # Steps of the Days automation: present or not.
    steps = rows[("step_count", "days")]
    assert steps["kind"] == "present"
    assert [c["value"] == "true" for c in steps["cells"][-len(DAYS):]] == [
        day != MISSING for day in DAYS]
    assert steps["cells"][-len(DAYS):][3]["state"] == "missing"
    # Each run of missing or thin days, per automation, with what fills it.
    gaps = {(g["automation"], g["from"], g["to"]): g["text"] for g in page.evaluate(GAPS)}
    assert set(gaps) == {("Minutes", str(MISSING), str(MISSING)),
                         ("Minutes", str(THIN), str(THIN)),
                         ("Minutes", str(DAYS[8]), str(DAYS[8])),
                         ("Daily totals", str(MISSING), str(MISSING))}
    text = gaps[("Minutes", str(MISSING), str(MISSING))]
    assert "Heart rate (minutes)" in text and "Blood oxygen" not in text
    assert "open the automation 'Minutes', tap Manual Export and export %s." % MISSING in text
    assert "Blood oxygen (minutes)" in gaps[("Minutes", str(DAYS[8]), str(DAYS[8]))]
    assert "Steps (days)" in gaps[("Daily totals", str(MISSING), str(MISSING))]
    assert "'Daily totals'" in gaps[("Daily totals", str(MISSING), str(MISSING))]


def test_fresh_6_6_the_calendar_fits_a_phone(browser, store):
    session = Session(browser, store, timezone="Asia/Tokyo", width=360, height=780, phone=True)
    try:
        page = coverage_ready(session.sign_in().page)
        found = page.evaluate(OVERFLOW)
        assert found["scroll"] <= 360 and not found["out"], found
        widths = page.eval_on_selector_all(
            "#coverage .cov-row[data-metric] .cov-cell",
            "cs => cs.map(c => c.getBoundingClientRect().width)")
        assert widths and min(widths) >= 5, widths  # a cell per day, still to be seen
        ARTIFACTS.mkdir(exist_ok=True)
        page.screenshot(path=str(ARTIFACTS / "freshness-phone.png"), full_page=True)
    finally:
        session.close()
