"""The browser the dashboard's tests drive: Debian's /usr/bin/chromium-headless-shell through
Playwright, used as installed (Playwright never downloads a browser here), with flags for a
closed network; and what the page's browser tests share: a store built once per module from
bodies posted through /api/ingest, the watch on console errors and CSP violations, signing
in, and the check that nothing reaches past a phone's screen. Used by the page's browser
tests: tests/test_dashboard.py, test_dashboard_logic.py, test_freshness_page.py,
test_sleep_nights.py, test_summary_page.py and test_workout_page.py."""

import contextlib
import datetime as dt
import os
import urllib.parse
from decimal import ROUND_HALF_UP, Decimal
from pathlib import Path

import pytest

import hae_factory as hf
import healthlog
from conftest import TOKEN, db_rows, wait_for
from read_helpers import Store

CHROMIUM = Path("/usr/bin/chromium-headless-shell")
"""Debian's ``chromium-headless-shell``: the browser Playwright itself runs for a headless
Chromium, built from the same sources as Debian's ``chromium`` (the same Blink and V8) with
no window around the page. The whole ``chromium`` in headless mode opens a window for each
browser context, whose address bar keeps its popup page ready in a renderer of its own, and
keeps a spare renderer for the next context: for four contexts it started 20 processes (12
with flags that turn both off), the shell 9; the six browser files took 57 s of CPU with
it, flags and all, and 49 s with the shell, the same tests passing and the screenshots the
same bytes (openspec/reference/building-and-testing.md)."""
CHROMIUM_ARGS = ["--disable-gpu", "--disable-quic"]
"""Added to Playwright's own flags (headless, no sandbox, no first run, no background
networking, component update or sync): no GPU process, and no QUIC to try on a closed
network."""
WAIT_MS = 20_000
"""How long the page may take to show what a test waits for (a ceiling, not a pause)."""


def require_browser():
    """Playwright's sync_playwright, or skip; a failure instead when CI demands the browser
    (HEALTHLOG_REQUIRE_BROWSER=1)."""
    problem = None
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        sync_playwright = None
        problem = "the playwright package is not installed (pip install -e '.[test]')"
    if problem is None and not os.access(str(CHROMIUM), os.X_OK):
        problem = "%s is missing (apt-get install chromium-headless-shell)" % CHROMIUM
    if problem is not None:
        if os.environ.get("HEALTHLOG_REQUIRE_BROWSER") == "1":
            pytest.fail(problem + "; HEALTHLOG_REQUIRE_BROWSER=1 demands the browser test")
        pytest.skip(problem)
    return sync_playwright


def launched():
    """A generator for a module-scoped fixture: one Chromium for the module, launched with
    :data:`CHROMIUM_ARGS`."""
    sync_playwright = require_browser()
    with sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        try:
            yield chromium
        finally:
            chromium.close()


# -- a store for the module ----------------------------------------------------------------


@contextlib.contextmanager
def serving(data_dir: Path, deliveries, clock=None, **overrides):
    """A real Service on 127.0.0.1:0 (as conftest's ``start_service`` starts one, here for a
    module) holding ``deliveries`` — (hf.Automation, body bytes) pairs, or (hf.Automation,
    body bytes, received at) with ``clock`` (conftest's Clock, the service's clock) set to
    each one's time before it is posted — posted through /api/ingest in that order with the
    automation's headers, folded, every one parsed: a read_helpers Store (its ``corpus``
    None). ``clock`` also judges freshness; ``overrides``: more of its Config."""
    deliveries = list(deliveries)
    # busy_timeout_s as serve's own: an ingest may wait for the fold's write of the last
    # delivery, and a busy machine can hold that thread longer than half a second
    values = dict(data_dir=data_dir, host="127.0.0.1", port=0, token=TOKEN, busy_timeout_s=10.0,
                  http_timeout_s=5.0, stop_budget_s=5.0, log_level="DEBUG")
    if clock is not None:
        values["clock"] = clock
    values.update(overrides)
    service = healthlog.Service(healthlog.Config(**values), announce=lambda token: None)
    service.start()
    try:
        store = Store(data_dir, service.address, None)
        for automation, body, *received in deliveries:
            if received:
                clock.now = received[0]
            status, answer = store.client.ingest(body, headers=hf.headers_for(automation),
                                                 token=True)
            assert status == 200, answer

        def folded():
            rows = db_rows(data_dir)
            done = len(rows) == len(deliveries) and all(
                r["parse_status"] != "pending" for r in rows)
            return (rows,) if done else None  # a tuple: true for an empty store too

        [rows] = wait_for(folded, timeout=120, what="the deliveries folded")
        assert [r["parse_status"] for r in rows] == ["parsed"] * len(rows), rows
        yield store
    finally:
        assert service.stop(), "the service did not stop within its budget"


# -- the page ------------------------------------------------------------------------------


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


class Session:
    """A signed-in browser context in ``timezone`` and its page."""

    def __init__(self, browser, store, timezone="Asia/Tokyo", width=1280, height=900,
                 phone=False):
        options = dict(viewport={"width": width, "height": height}, timezone_id=timezone,
                       locale="en-US")
        if phone:
            options.update(is_mobile=True, has_touch=True, device_scale_factor=2)
        self.context = browser.new_context(**options)
        self.watch = Watch(self.context)
        self.page = self.watch.page(self.context)
        self.store = store
        self.timezone = timezone

    def sign_in(self, hash_="", **view):
        """Sign in through the form, as a person does: at / (the summary answers, a first
        visit's page), or at a view's address as a bookmark holds it (a metric view's or a
        workout's; ``hash_``, or the view's parameters as ``view``): the form comes at that
        address, and signing in draws that view (READ-10.16) without the summary first."""
        if view:
            hash_ = "#" + urllib.parse.urlencode(view)
        page = self.page
        page.goto(self.store.base + "/" + hash_)
        sign_in(page)
        if hash_:
            self.wait(dict(urllib.parse.parse_qsl(hash_.lstrip("#"))))
        else:
            page.wait_for_selector('#summary[data-state="ready"]')  # a first visit's page
        return self

    def open(self, **params):
        """Show a metric view through the address, as a bookmark would; wait until it is
        drawn."""
        hash_ = "#" + urllib.parse.urlencode(params)
        self.page.evaluate("h => { window.location.hash = h; }", hash_)
        return self.wait(params)

    def wait(self, params):
        if params.get("view") == "workout":  # a workout's page (#view=workout&id=…)
            self.page.wait_for_selector('#workout-view[data-state="ready"][data-id="%s"]'
                                        % params["id"])
            return self.page
        selector = '#chart[data-state="ready"][data-metric="%s"]' % params["metric"]
        for key in ("range", "from", "tz"):
            if key in params:
                selector += '[data-%s="%s"]' % (key, params[key])
        self.page.wait_for_selector(selector, state="attached")
        return self.page

    def close(self):
        errors = list(self.watch.errors)
        self.context.close()
        assert errors == [], errors


def sign_in(page, token: str = TOKEN) -> None:
    page.fill("#token", token)
    page.click('form[action="/login"] button[type="submit"]')


OVERFLOW = """() => {
  const width = document.documentElement.clientWidth;
  const out = [];
  for (const e of document.querySelectorAll('body *')) {
    if (e.closest('svg') && e.tagName.toLowerCase() !== 'svg') continue;
    const r = e.getBoundingClientRect();
    if (r.width && (r.right > width + 0.5 || r.left < -0.5)) {
      out.push(e.tagName + '#' + e.id + '.' + e.className + ' ' + r.left + '..' + r.right);
    }
    if (e.scrollWidth > e.clientWidth + 1 && getComputedStyle(e).overflowX !== 'visible'
        && e.clientWidth) {
      out.push('scrolls: ' + e.tagName + '#' + e.id + '.' + e.className);
    }
  }
  return {scroll: document.documentElement.scrollWidth, width: width, out: out.slice(0, 8)};
}"""
"""Elements that reach past the screen's width, or scroll sideways, and the page's width."""


# -- numbers and dates as the page writes them (en-US), by the tests' own rules --------------


def shown_number(value: float, digits=None) -> str:
    """A number as a person reads it on the page: grouped, rounded half up (as Intl rounds
    the exact value), at most 0, 1 or 2 decimals by its size, and at least ``digits`` (the
    meaning's, where a person's changes are smaller than one unit)."""
    least = digits or 0
    most = max(least, 0 if abs(value) >= 100 else 1 if abs(value) >= 10 else 2)
    text = "{:,f}".format(Decimal(value).quantize(Decimal(1).scaleb(-most), ROUND_HALF_UP))
    if "." in text:
        whole, part = text.split(".")
        part = part.rstrip("0").ljust(least, "0")
        text = whole + ("." + part if part else "")
    return text


def long_date(on: dt.date) -> str:
    """``Mon, Mar 10, 2025``."""
    return "%s, %s %d, %d" % (on.strftime("%a"), on.strftime("%b"), on.day, on.year)
