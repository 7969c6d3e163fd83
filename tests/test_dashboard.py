"""The dashboard in a real browser: headless Chromium driven by Playwright against a real
in-process server that holds a generated week of data (steps, heart rate, sleep stages,
workouts), posted through /api/ingest and folded.

The browser is Debian's ``chromium`` (/usr/bin/chromium), used as installed: Playwright
never downloads one here. Without it, or without the playwright package, the test is
skipped, unless HEALTHLOG_REQUIRE_BROWSER=1 (CI sets it), which makes that a failure.
Screenshots (a 1280 px and a 390 px phone viewport) go to tests/artifacts/, which git
ignores.
"""

import datetime as dt
import json
import os
import time
import urllib.parse
from pathlib import Path

import pytest

import hae_factory as hf
from conftest import TOKEN, Client, db_rows, wait_for

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                 "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync"]
ARTIFACTS = Path(__file__).resolve().parent / "artifacts"
#: The phone zone of hae_factory's data; the browser runs in it too, so the page's tz
#: parameter is a real offset, not +00:00.
TIMEZONE = "America/Los_Angeles"
WAIT_MS = 15_000

CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:;"
       " connect-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'")


def require_browser():
    """Playwright's sync_playwright, or skip; a failure instead when CI demands the browser."""
    problem = None
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        sync_playwright = None
        problem = "the playwright package is not installed (pip install -e '.[test]')"
    if problem is None and not os.access(str(CHROMIUM), os.X_OK):
        problem = "%s is missing (apt-get install chromium)" % CHROMIUM
    if problem is not None:
        if os.environ.get("HEALTHLOG_REQUIRE_BROWSER") == "1":
            pytest.fail(problem + "; HEALTHLOG_REQUIRE_BROWSER=1 demands the browser test")
        pytest.skip(problem)
    return sync_playwright


# -- the data --------------------------------------------------------------------------


def corpus(now: int) -> list:
    """(automation, body) of every delivery: the last 7 days of step_count and heart_rate
    minutes (one delivery per day), the sleep stage segments of the nights in them, and
    two version-2 workouts (short routes: the list needs no thousands of route points)."""
    metrics = hf.Automation("Health Metrics", "Minutes", "Since Last Sync")
    out = []
    for day in range(7):
        start = now - (7 - day) * 86400
        payload = hf.metrics_payload(day, ("step_count", "heart_rate"), start=start,
                                     end=start + 86400, grouping="Minutes")
        out.append((metrics, hf.dumps_hae(payload)))
    nights = hf.sleep_segments(7, start=now - 7 * 86400, end=now)
    out.append((hf.Automation("Sleep", "Default"),
                hf.dumps_hae(hf.envelope(metrics=[hf.metric("sleep_analysis", nights)]))))
    workouts = [
        hf.workout_v2(8, start=now - 2 * 86400 - 5 * 3600, name="Running", minutes=32,
                      route_points=30),
        hf.workout_v2(9, start=now - 4 * 86400 - 3 * 3600, name="Yoga", minutes=45,
                      route_points=0),
    ]
    out.append((hf.Automation("Workouts", "Default"),
                hf.dumps_hae(hf.envelope(workouts=workouts))))
    return out


@pytest.fixture
def served(start_service, data_dir):
    """A running service holding the folded corpus: (base URL, number of deliveries)."""
    service = start_service()
    host, port = service.address
    client = Client(host, port)
    deliveries = corpus(int(time.time()) // 60 * 60)
    for automation, body in deliveries:
        status, answer = client.ingest(body, headers=hf.headers_for(automation), token=True)
        assert status == 200, answer

    def folded():
        rows = db_rows(data_dir)
        return len(rows) == len(deliveries) and all(
            r["parse_status"] != "pending" for r in rows) and rows

    rows = wait_for(folded)
    assert [r["parse_status"] for r in rows] == ["parsed"] * len(deliveries), rows
    return "http://%s:%d" % (host, port), len(deliveries)


@pytest.fixture
def browser():
    sync_playwright = require_browser()
    with sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        try:
            yield chromium
        finally:
            chromium.close()


# -- helpers ---------------------------------------------------------------------------


class Watch:
    """Console errors, uncaught exceptions and CSP violations of one browser context."""

    def __init__(self, context):
        self.errors = []
        context.expose_function("healthlogCspViolation", self._violation)
        context.add_init_script(
            "document.addEventListener('securitypolicyviolation', function (e) {"
            " window.healthlogCspViolation(e.violatedDirective + ' ' + e.blockedURI); });")

    def _violation(self, text):
        self.errors.append("CSP violation: " + text)

    def page(self, context):
        page = context.new_page()
        page.set_default_timeout(WAIT_MS)
        page.on("console", lambda m: self.errors.append("console: " + m.text)
                if m.type == "error" else None)
        page.on("pageerror", lambda e: self.errors.append("exception: %s" % e))
        return page


def query(url: str) -> dict:
    return {k: v[0] for k, v in urllib.parse.parse_qs(urllib.parse.urlsplit(url).query).items()}


def is_chart_request(metric: str):
    def match(response):
        q = query(response.url)
        return "/api/points" in response.url and q.get("metric") == metric and "bucket" in q
    return match


def wait_chart(page, metric: str, range_key: str) -> None:
    page.wait_for_selector('#chart[data-state="ready"][data-metric="%s"][data-range="%s"]'
                           % (metric, range_key))


def choose(page, metric: str, range_key: str):
    """Pick ``metric`` in the catalog; the chart's /api/points response once drawn."""
    value = page.get_attribute('#catalog option[data-metric="%s"]' % metric, "value")
    with page.expect_response(is_chart_request(metric)) as answer:
        page.select_option("#catalog", value)
    wait_chart(page, metric, range_key)
    return answer.value


def click_range(page, metric: str, range_key: str):
    with page.expect_response(is_chart_request(metric)) as answer:
        page.click('#range button[data-range="%s"]' % range_key)
    wait_chart(page, metric, range_key)
    return answer.value


def series_paths(page) -> list:
    return page.eval_on_selector_all("#chart svg path.series",
                                     "ps => ps.map(p => p.getAttribute('d'))")


def expected_series(body: dict) -> int:
    """One line per run and numeric field; heart rate's Min and Max make the band instead."""
    count = 0
    for run in body["runs"]:
        fields = {f for bucket in run["buckets"] for f in bucket.get("fields", {})}
        if {"Min", "Avg", "Max"} <= fields:
            fields -= {"Min", "Max"}
        count += len(fields)
    return count


def tz_text(page) -> str:
    minutes = page.evaluate("-new Date().getTimezoneOffset()")
    return "%s%02d:%02d" % ("-" if minutes < 0 else "+", abs(minutes) // 60, abs(minutes) % 60)


def assert_security_headers(headers: dict) -> None:
    assert headers["content-security-policy"] == CSP
    assert headers["x-content-type-options"] == "nosniff"
    assert headers["referrer-policy"] == "no-referrer"
    assert headers["x-frame-options"] == "DENY"


def sign_in(page, token: str = TOKEN) -> None:
    page.fill("#token", token)
    page.click('form[action="/login"] button[type="submit"]')


# -- the test --------------------------------------------------------------------------


def test_read_10_1_the_dashboard_in_a_real_browser(served, browser):
    base, delivered = served
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    context = browser.new_context(viewport={"width": 1280, "height": 900},
                                  timezone_id=TIMEZONE, locale="en-US")
    watch = Watch(context)
    page = watch.page(context)

    # Signed out: the sign-in form, with the security headers.
    first = page.goto(base + "/")
    assert first.status == 200
    assert_security_headers(first.headers)
    assert page.get_attribute('form[action="/login"]', "method").lower() == "post"
    assert page.get_attribute("#token", "type") == "password"
    assert page.locator("#catalog").count() == 0
    assert page.inner_text(".notice").strip() == ""

    # A wrong token: 401, the form again with a message (the browser logs the 401 itself).
    with page.expect_response(lambda r: r.url.endswith("/login")) as answer:
        sign_in(page, "not-the-token")
    assert answer.value.status == 401
    assert page.locator("#token").count() == 1
    assert page.inner_text(".notice").strip()
    assert all("401" in e for e in watch.errors), watch.errors
    watch.errors.clear()

    # Signed in: the dashboard opens on step_count over 7 days, hourly buckets in the
    # browser's offset.
    with page.expect_response(is_chart_request("step_count")) as answer:
        sign_in(page)
    wait_chart(page, "step_count", "7d")
    steps = answer.value
    assert steps.status == 200
    q = query(steps.url)
    assert (q["layer"], q["bucket"], q["tz"]) == ("minutes", "hour", tz_text(page))
    assert q["tz"] in ("-08:00", "-07:00")
    page_again = page.request.get(base + "/")
    assert_security_headers(page_again.headers)
    assert "/static/app.js" in page_again.text()
    assert page.eval_on_selector("#catalog", "s => s.selectedOptions[0].dataset.metric") == \
        "step_count"
    groups = page.eval_on_selector_all("#catalog optgroup", "gs => gs.map(g => g.label)")
    assert groups == ["Activity", "Heart", "Sleep", "Workouts"]
    body = steps.json()
    assert expected_series(body) == 1  # one run in count, one numeric field (qty)
    paths = series_paths(page)
    assert len(paths) == 1 and paths[0].startswith("M") and len(paths[0]) > 50, paths
    assert page.locator("#chart svg").first.get_attribute("viewBox").startswith("0 0 ")

    # Heart rate: the Avg line inside the Min-Max band.
    heart = choose(page, "heart_rate", "7d")
    assert query(heart.url)["bucket"] == "hour"
    assert len(series_paths(page)) == expected_series(heart.json()) == 1
    assert page.locator("#chart path.band").count() >= 1
    assert page.get_attribute("#chart path.band", "d").startswith("M")

    # Another range: 24 h keeps hourly buckets, 30 d asks for days and draws anew.
    before = series_paths(page)
    day = click_range(page, "heart_rate", "24h")
    assert query(day.url)["bucket"] == "hour"
    month = click_range(page, "heart_rate", "30d")
    assert query(month.url)["bucket"] == "day"
    after = series_paths(page)
    assert len(after) == expected_series(month.json()) == 1
    assert after != before

    # Sleep: stage hours per night as stacked bars, per day whatever the range.
    sleep = choose(page, "sleep_analysis", "30d")
    q = query(sleep.url)
    assert (q["layer"], q["bucket"]) == ("record", "day")
    nights = sum(len(run["buckets"]) for run in sleep.json()["runs"])
    assert nights >= 6
    assert page.locator("#chart rect.stage").count() >= nights * 3
    assert page.locator("#chart path.series").count() == 0

    # The CSV link asks for exactly what the chart shows, in CSV.
    href = page.get_attribute("#csv", "href")
    assert query(href).pop("format") == "csv"
    shown = query(sleep.url)
    assert {k: v for k, v in query(href).items() if k != "format"} == shown
    csv = page.request.get(base + href)
    assert csv.status == 200
    assert csv.headers["content-type"].startswith("text/csv")
    lines = csv.text().splitlines()
    assert lines[0].startswith("start,") and len(lines) == nights + 1, lines[:3]

    # Workouts in the range, the journal and the service state.
    page.wait_for_function("document.querySelectorAll('#workouts tbody tr').length === 2")
    workouts = page.inner_text("#workouts")
    assert "Running" in workouts and "Yoga" in workouts and "0:32" in workouts
    page.wait_for_function("document.querySelectorAll('#journal tbody tr').length > 0")
    assert page.locator("#journal tbody tr").count() == delivered
    journal = page.inner_text("#journal")
    assert "parsed" in journal and "Health Metrics" in journal
    health = page.inner_text("#health")
    assert "Backlog 0" in health and "last fold" in health

    page.screenshot(path=str(ARTIFACTS / "dashboard.png"), full_page=True)

    # Signing out: the form again, and the API refuses the browser.
    page.click("#signout")
    page.wait_for_selector("#token")
    refused = page.request.get(base + "/api/catalog")
    assert refused.status == 401
    assert json.loads(refused.text())["error"]["code"] == "unauthorized"
    assert watch.errors == []
    context.close()

    # A phone: 390 px wide, nothing wider than the screen.
    phone = browser.new_context(viewport={"width": 390, "height": 844}, is_mobile=True,
                                has_touch=True, device_scale_factor=2, timezone_id=TIMEZONE,
                                locale="en-US")
    watch = Watch(phone)
    page = watch.page(phone)
    page.goto(base + "/")
    sign_in(page)
    wait_chart(page, "step_count", "7d")
    page.wait_for_function("document.querySelectorAll('#journal tbody tr').length > 0")
    page.wait_for_function("document.querySelectorAll('#workouts tbody tr').length === 2")
    assert page.evaluate("document.documentElement.scrollWidth") <= 390
    box = page.locator("#chart svg").first.bounding_box()
    assert 300 <= box["width"] <= 390
    page.screenshot(path=str(ARTIFACTS / "dashboard-phone.png"), full_page=True)
    assert watch.errors == []
    phone.close()


def test_corpus_is_dated_in_the_last_week():
    """The 7 d range shows the corpus: every delivery lies within the last 7 days."""
    now = int(time.time()) // 60 * 60
    for _, body in corpus(now):
        data = json.loads(body)["data"]
        for metric in data.get("metrics", []):
            for point in metric["data"]:
                stamp = point.get("date") or point.get("startDate")
                when = dt.datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S %z").timestamp()
                assert now - 8 * 86400 <= when <= now
        for workout in data.get("workouts", []):
            when = dt.datetime.strptime(workout["start"], "%Y-%m-%d %H:%M:%S %z").timestamp()
            assert now - 7 * 86400 <= when <= now
