"""The suite's own structure: each test helper in one place.

A helper that two test files need lives once, in conftest.py (fixtures, and what test files
of every kind use) or in the helper module of its family (read_helpers.py, fold_helpers.py,
reindex_helpers.py, load_helpers.py, mcp_helpers.py, dashboard_browser.py, hae_factory.py,
workout_corpus.py); a test file never imports from another test file. These tests read the
files' syntax trees and fail on a second definition of a top-level name, on an import from a
test module, and on a ``healthlog.py`` run as a script where ``python -m healthlog`` (compiled
once for the whole run, tests/conftest.py) would do.
"""

import ast
import functools
import re
from pathlib import Path

from conftest import statements

TESTS = Path(__file__).resolve().parent

SCRIPTS = {p.name for p in TESTS.glob("bench*.py")} | {"mutate.py"}
"""Programs run by hand (benchmarks, the mutation test), not part of the suite: each is a
program of its own (its ``main``, its own setup), not collected by pytest."""

MODULE_DATA = {
    "store": "the module's data posted once and served (a module fixture, found by pytest by"
             " name in the module that uses it), built by read_helpers.serve_corpus or"
             " dashboard_browser.serving",
    "corpus": "the module's bodies, or the fixture that holds them",
    "Corpus": "what the module posts and what it must read back: its own data",
    "build_corpus": "the function that builds the module's Corpus, once (conftest.Lazy)",
}
"""Names that each test module defines for its own data, on purpose: the data must differ
from module to module, the one name says the same role in each, and the building is shared.
Allowed in test_*.py files only, never in a helper module."""

PENDING: dict = {}
"""Duplicates in files this change could not edit, with the files and why."""

PENDING_IMPORTS: dict = {}
"""Imports from a test module in files this change could not edit."""

SCRIPT_RUNS = {
    "test_serve.py": "ING-15.1 starts serve as `python3 healthlog.py`, the one test of the"
                     " file run as a script",
}
"""Files that may start ``healthlog.py`` as a script, and why."""


def suite_files() -> list:
    return sorted(p for p in TESTS.glob("*.py") if p.name not in SCRIPTS)


@functools.lru_cache(maxsize=None)
def syntax_tree(path: Path) -> ast.Module:
    """A suite file parsed once for all the tests here (they only read the trees)."""
    return ast.parse(path.read_text(encoding="utf-8"))


def helpers_defined(path: Path) -> list:
    """The functions and classes a file defines at its top level, test functions and
    test classes left out (pytest collects those per file)."""
    tree = syntax_tree(path)
    return [node.name for node in tree.body
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
            and not node.name.startswith(("test_", "Test"))]


def definitions() -> dict:
    """Top-level name -> the suite files that define it."""
    found: dict = {}
    for path in suite_files():
        for name in helpers_defined(path):
            found.setdefault(name, set()).add(path.name)
    return found


def test_every_helper_is_defined_in_one_file():
    twice = {}
    for name, files in definitions().items():
        if len(files) < 2:
            continue
        if name in MODULE_DATA and all(f.startswith("test_") for f in files):
            continue
        if name in PENDING and files <= PENDING[name][0]:
            continue
        twice[name] = sorted(files)
    assert twice == {}, (
        "a helper defined in more than one test file: keep one (conftest.py or the family's"
        " helper module) and import it, or give each its own name: %s" % twice)


def test_the_allow_lists_name_only_what_exists():
    found = definitions()
    for name in MODULE_DATA:
        assert name in found, "MODULE_DATA names %r, which no test file defines" % name
    for name, (files, _) in PENDING.items():
        assert found.get(name, set()) >= files, (name, files, found.get(name))
    for (importer, module) in PENDING_IMPORTS:
        assert module in imported_test_modules(TESTS / importer), (importer, module)
    for name in SCRIPT_RUNS:
        assert script_runs(TESTS / name), name


def imported_test_modules(path: Path) -> set:
    """The test modules (test_*) a file imports from."""
    out = set()
    for node in statements(syntax_tree(path)):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("test_"):
            out.add(node.module)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.startswith("test_"))
    return out


def test_no_test_file_imports_from_another():
    found = {(path.name, module) for path in suite_files()
             for module in imported_test_modules(path)}
    assert sorted(found - set(PENDING_IMPORTS)) == [], (
        "a test file imports from another test file: move the helper to conftest.py or the"
        " family's helper module")


_SCRIPT_RUN = re.compile(r"sys\.executable,\s*str\(ROOT\s*/\s*\"healthlog\.py\"\)")


def script_runs(path: Path) -> list:
    return _SCRIPT_RUN.findall(path.read_text(encoding="utf-8"))


def test_healthlog_runs_as_a_module_compiled_once():
    """``python healthlog.py`` compiles the 15,000-line file at every start (0.3 s of CPU;
    CI sets PYTHONDONTWRITEBYTECODE); ``python -m healthlog`` imports the copy conftest.py
    compiled once (conftest.run_cli)."""
    found = sorted(path.name for path in suite_files() if script_runs(path))
    assert set(found) <= set(SCRIPT_RUNS), found
