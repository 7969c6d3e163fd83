"""ESLint on the dashboard's script (healthlog.APP_JS, READ-10): the rules and the ES2017
syntax limit are in tests/eslint.config.mjs.

The script lives in healthlog.py as a string; the test hands it to ESLint after as many empty
lines as come before it in healthlog.py, so that each finding names healthlog.py's own line.
One ESLint run lints every source the tests need (the script, the script with a planted
mistake, the snippets the config must refuse), each in a file of its own: a start of node and
ESLint costs about a second of CPU, and the suite once paid it six times.
ESLint comes from the npm registry, pinned to ESLINT_VERSION: .ci/run installs it outside the
clone and names it in HEALTHLOG_ESLINT. Without node or ESLint the tests are skipped, unless
HEALTHLOG_REQUIRE_ESLINT=1 (.ci/run sets it), which makes that a failure.
"""

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

import healthlog

ESLINT_VERSION = "9.39.2"
"""The ESLint .ci/run installs (npm install eslint@9.39.2): a newer release may add checks."""
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


def lint_all(sources: dict, folder: Path) -> dict:
    """ESLint's messages for each of ``sources`` (a file name → its text), from one run over
    files written in ``folder``: {name: [message, ...]}, a message as ESLint's JSON format
    gives it (``line``, ``ruleId``, ``message``, ``fatal`` for a parsing error)."""
    for name, source in sources.items():
        (folder / name).write_text(source, encoding="utf-8")
    result = subprocess.run(
        [eslint(), "--config", str(CONFIG), "--no-warn-ignored", "--format", "json"]
        + sorted(sources), cwd=str(folder), capture_output=True, text=True, timeout=120)
    assert result.returncode in (0, 1), result.stderr  # 2: ESLint itself failed
    found = {Path(entry["filePath"]).name: entry["messages"]
             for entry in json.loads(result.stdout)}
    assert sorted(found) == sorted(sources), result.stdout
    return found


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


SNIPPETS = {
    "later-syntax.js": ("'use strict';\nconst a = { ...{ b: 1 } };\nwindow.x = a;\n",
                        "Parsing error"),
    "inner-html.js": ("'use strict';\ndocument.body.innerHTML = window.name;\n",
                      "no-restricted-properties"),
    "unused.js": ("'use strict';\nconst unused = 1;\n", "no-unused-vars"),
    "undefined.js": ("'use strict';\nwindow.y = undefinedThing;\n", "no-undef"),
}
"""What the config must refuse: a file name → (its text, the rule, or a parsing error)."""


def planted_line() -> tuple:
    """(the line of healthlog.py that holds the script's first ``'use strict';``, the
    script as in the module with an unused name planted on that line)."""
    lines = Path(healthlog.__file__).read_text(encoding="utf-8").splitlines()
    first, source = script_as_in_module()
    line = next(n for n, text in enumerate(lines, 1) if n > first and text == "'use strict';")
    padded = source.splitlines()
    assert padded[line - 1] == "'use strict';"
    padded[line - 1] = "'use strict'; const plantedUnused = 1;"
    return line, "\n".join(padded) + "\n"


@pytest.fixture(scope="module")
def linted(tmp_path_factory) -> dict:
    """ESLint's messages for the script, the planted script and each snippet (one run)."""
    sources = {"app.js": script_as_in_module()[1], "planted.js": planted_line()[1]}
    sources.update((name, text) for name, (text, _) in SNIPPETS.items())
    return lint_all(sources, tmp_path_factory.mktemp("eslint"))


def as_text(messages: list) -> str:
    return "\n".join("%s:%s %s %s" % (m.get("line"), m.get("column"), m.get("ruleId"),
                                      m.get("message")) for m in messages)


def test_read_10_13_the_dashboard_script_passes_eslint(linted):
    assert linted["app.js"] == [], "line numbers are healthlog.py's:\n" + as_text(linted["app.js"])


def test_read_10_13_a_finding_names_the_line_of_healthlog_py(linted):
    """A mistake planted on the script's first ``'use strict';`` is reported at the line
    that statement has in healthlog.py."""
    line = planted_line()[0]
    assert [(m["line"], m["ruleId"]) for m in linted["planted.js"]
            if "plantedUnused" in m["message"]] == [(line, "no-unused-vars")], (
        as_text(linted["planted.js"]))


@pytest.mark.parametrize("name", sorted(SNIPPETS))
def test_read_10_13_the_config_catches_what_it_names(linted, name):
    """The config is in force: later syntax, innerHTML, unused and undefined names fail."""
    rule = SNIPPETS[name][1]
    messages = linted[name]
    assert any(m.get("severity") == 2 and (
        m.get("ruleId") == rule or (m.get("fatal") and m["message"].startswith(rule)))
        for m in messages), as_text(messages)
