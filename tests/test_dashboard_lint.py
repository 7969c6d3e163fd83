"""ESLint on the dashboard's script (healthlog.APP_JS, READ-10): the rules and the ES2017
syntax limit are in tests/eslint.config.mjs.

The script lives in healthlog.py as a string; the test hands it to ESLint on standard input,
after as many empty lines as come before it in healthlog.py, so that each finding names
healthlog.py's own line.
ESLint comes from the npm registry, pinned to ESLINT_VERSION: .ci/run installs it outside the
clone and names it in HEALTHLOG_ESLINT. Without node or ESLint the tests are skipped, unless
HEALTHLOG_REQUIRE_ESLINT=1 (.ci/run sets it), which makes that a failure.
"""

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

import healthlog

ESLINT_VERSION = "9.39.2"
"""The ESLint .ci/run installs (npm install eslint@9.39.2): a newer release may add checks."""
ROOT = Path(__file__).resolve().parent.parent
CONFIG = Path(__file__).resolve().parent / "eslint.config.mjs"


def eslint() -> str:
    """The eslint executable, or skip; a failure instead when CI demands it."""
    found = os.environ.get("HEALTHLOG_ESLINT") or shutil.which("eslint")
    problem = None
    if not shutil.which("node"):
        problem = "node is not installed (apt-get install nodejs npm)"
    elif not found or not os.access(found, os.X_OK):
        problem = ("eslint is not installed (npm install --prefix DIR eslint@%s, then"
                   " HEALTHLOG_ESLINT=DIR/node_modules/.bin/eslint)" % ESLINT_VERSION)
    if problem is not None:
        if os.environ.get("HEALTHLOG_REQUIRE_ESLINT") == "1":
            pytest.fail(problem + "; HEALTHLOG_REQUIRE_ESLINT=1 demands the lint")
        pytest.skip(problem)
    return found


def lint(source: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [eslint(), "--config", str(CONFIG), "--no-warn-ignored", "--stdin",
         "--stdin-filename", "app.js"], input=source, cwd=str(ROOT), capture_output=True,
        text=True, timeout=120)


def script_as_in_module() -> tuple:
    """(healthlog.py's line where APP_JS begins, the script after that many empty lines
    less one): ESLint's line numbers are then healthlog.py's."""
    lines = Path(healthlog.__file__).read_text(encoding="utf-8").splitlines()
    first = next(n for n, line in enumerate(lines, 1) if line.startswith('APP_JS = r"""'))
    return first, "\n" * (first - 1) + healthlog.APP_JS


def test_read_10_13_eslint_is_the_pinned_version():
    version = subprocess.run([eslint(), "--version"], capture_output=True, text=True,
                             timeout=60).stdout.strip()
    assert version == "v" + ESLINT_VERSION


def test_read_10_13_the_dashboard_script_passes_eslint():
    result = lint(script_as_in_module()[1])
    assert result.returncode == 0, "line numbers are healthlog.py's:\n" + result.stdout + (
        result.stderr)


def test_read_10_13_a_finding_names_the_line_of_healthlog_py():
    """A mistake planted on the script's first ``'use strict';`` is reported at the line
    that statement has in healthlog.py."""
    lines = Path(healthlog.__file__).read_text(encoding="utf-8").splitlines()
    first, source = script_as_in_module()
    line = next(n for n, text in enumerate(lines, 1) if n > first and text == "'use strict';")
    padded = source.splitlines()
    assert padded[line - 1] == "'use strict';"
    padded[line - 1] = "'use strict'; const plantedUnused = 1;"
    result = lint("\n".join(padded) + "\n")
    assert result.returncode == 1
    assert re.search(r"^\s*%d:\d+\s+error\s.*plantedUnused" % line, result.stdout, re.M), (
        result.stdout)


@pytest.mark.parametrize("snippet, rule", [
    ("'use strict';\nconst a = { ...{ b: 1 } };\nwindow.x = a;\n", "Parsing error"),
    ("'use strict';\ndocument.body.innerHTML = window.name;\n", "no-restricted-properties"),
    ("'use strict';\nconst unused = 1;\n", "no-unused-vars"),
    ("'use strict';\nwindow.y = undefinedThing;\n", "no-undef"),
])
def test_read_10_13_the_config_catches_what_it_names(snippet, rule):
    """The config is in force: later syntax, innerHTML, unused and undefined names fail."""
    result = lint(snippet)
    assert result.returncode == 1 and rule in result.stdout, result.stdout + result.stderr
