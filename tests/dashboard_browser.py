"""The browser the dashboard's tests drive: Debian's /usr/bin/chromium through Playwright,
used as installed (Playwright never downloads a browser here), with flags for a closed
network. Shared by tests/test_dashboard.py and tests/test_dashboard_logic.py."""

import os
from pathlib import Path

import pytest

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                 "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync"]


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
        problem = "%s is missing (apt-get install chromium)" % CHROMIUM
    if problem is not None:
        if os.environ.get("HEALTHLOG_REQUIRE_BROWSER") == "1":
            pytest.fail(problem + "; HEALTHLOG_REQUIRE_BROWSER=1 demands the browser test")
        pytest.skip(problem)
    return sync_playwright


def launched():
    """A generator for a module-scoped fixture: one Chromium for the module."""
    sync_playwright = require_browser()
    with sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        try:
            yield chromium
        finally:
            chromium.close()
