"""The documents are tested like the code: specs, README and the CLI must agree.

- Every ``#### Scenario:`` in ``openspec/specs/*/spec.md`` ends with an ID in parentheses, and
  a test function under ``tests/`` carries that ID in its name (``(ING-1.1)`` → ``ing_1_1``,
  ``(INGEST-3.2)`` → ``ingest_3_2``).
- Every spec follows OpenSpec's structure rules: ``## Purpose`` and ``## Requirements``; each
  ``### Requirement:`` states SHALL or MUST in its first line (the line OpenSpec reads as the
  requirement's text) and has at least one ``#### Scenario:``; each scenario has WHEN and THEN
  bullets.
- The reference (``openspec/reference/*.md``, where a user looks things up) names every
  subcommand and ``--flag`` of ``healthlog.build_parser()`` and every ``HEALTHLOG_*``
  environment variable healthlog.py reads. README.md, the entry point a newcomer reads to the
  end, names every subcommand, links every reference document, and carries the quick-start
  commands that .ci/run runs.
- Every relative link in README.md, openspec/ and contrib/ stays inside the repository and
  reaches a file that exists, and a ``#section`` in it a heading of that file.

That contrib/README.md lists every file in contrib/ is checked in tests/test_build.py.
"""

from __future__ import annotations

import argparse
import ast
import functools
import re
from pathlib import Path

import pytest

import healthlog
from conftest import statements

ROOT = Path(__file__).resolve().parent.parent
TESTS = ROOT / "tests"
SPECS = sorted((ROOT / "openspec" / "specs").glob("*/spec.md"))
README = ROOT / "README.md"
REFERENCE = ROOT / "openspec" / "reference"

SCENARIO_ID = re.compile(r"\(([A-Z][A-Z0-9]*-\d+(?:\.\d+)+)\)\s*$")
NORMATIVE = re.compile(r"\b(SHALL|MUST)\b")


# ---------------------------------------------------------------------------------------------
# Reading specs and tests.

def spec_lines(path: Path) -> list[tuple[int, str]]:
    """(line number, text) of a spec, without the lines of fenced code blocks."""
    out, fence = [], None
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        marker = re.match(r"\s*(`{3,}|~{3,})", line)
        if fence is None and marker:
            fence = marker.group(1)
            continue
        if fence is not None:
            if marker and marker.group(1)[0] == fence[0] and len(marker.group(1)) >= len(fence):
                fence = None
            continue
        out.append((number, line))
    return out


def parse_spec(path: Path) -> dict:
    """Sections, requirements and scenarios of one spec.md, as plain dicts."""
    spec: dict = {"sections": {}, "requirements": [], "stray": []}
    section = requirement = scenario = None
    for number, line in spec_lines(path):
        header = re.match(r"(#{1,6})\s+(.*?)\s*$", line)
        if header:
            level, title = len(header.group(1)), header.group(2)
            if level <= 2:
                section = title
                spec["sections"].setdefault(title, [])
                requirement = scenario = None
            elif level == 3 and title.startswith("Requirement:"):
                requirement = {"title": title, "line": number, "body": [], "scenarios": []}
                spec["requirements"].append((section, requirement))
                scenario = None
            elif level == 4 and title.startswith("Scenario:") and requirement is not None:
                scenario = {"title": title, "line": number, "bullets": []}
                requirement["scenarios"].append(scenario)
            else:
                spec["stray"].append((number, line))
                scenario = None
            continue
        if scenario is not None:
            if line.strip():
                scenario["bullets"].append(line.strip())
        elif requirement is not None:
            if line.strip():
                requirement["body"].append(line.strip())
        elif section is not None and line.strip():
            spec["sections"][section].append(line.strip())
    return spec


def all_scenarios() -> list[tuple[Path, dict]]:
    return [(path, scenario) for path in SPECS
            for _, requirement in parse_spec(path)["requirements"]
            for scenario in requirement["scenarios"]]


def scenario_ids() -> list[str]:
    ids = []
    for _, scenario in all_scenarios():
        match = SCENARIO_ID.search(scenario["title"])
        if match:
            ids.append(match.group(1))
    return ids


@functools.lru_cache(maxsize=None)
def all_test_names() -> frozenset:
    """Names of every ``def test_…`` (functions and methods) in the .py files under tests/."""
    names = set()
    for path in sorted(TESTS.rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for node in statements(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) \
                    and node.name.startswith("test_"):
                names.add(node.name)
    return frozenset(names)


def id_slug(scenario_id: str) -> str:
    """``ING-1.1`` → ``ing_1_1``: how an ID is written inside a test function's name."""
    return re.sub(r"[-.]", "_", scenario_id.lower())


def names_carrying(scenario_id: str, names) -> list[str]:
    """Test names that carry the ID as whole ``_``-separated words (ing_1_1 ≠ ing_1_10)."""
    pattern = re.compile(r"(?:^|_)%s(?:_|$)" % re.escape(id_slug(scenario_id)))
    return sorted(name for name in names if pattern.search(name))


# ---------------------------------------------------------------------------------------------
# (a) every scenario has an ID, and a test named after it.

def test_there_is_at_least_one_spec():
    assert SPECS, "no openspec/specs/*/spec.md found"


def test_every_scenario_ends_with_an_id():
    missing = ["%s:%d: %s" % (path.relative_to(ROOT), scenario["line"], scenario["title"])
               for path, scenario in all_scenarios() if not SCENARIO_ID.search(scenario["title"])]
    assert not missing, "scenarios without an ID in parentheses at the end:\n" + "\n".join(missing)


def test_scenario_ids_are_unique():
    ids = scenario_ids()
    duplicates = sorted({i for i in ids if ids.count(i) > 1})
    assert not duplicates, "scenario IDs used more than once: %s" % ", ".join(duplicates)


def scenarios_without_a_test(ids, names) -> list[str]:
    """The IDs no name in ``names`` carries, sorted."""
    return sorted(i for i in set(ids) if not names_carrying(i, names))


def test_every_scenario_has_a_test_named_after_its_id():
    # One test for the whole coverage (not one item per ID), so that the count of collected
    # items counts tests. The seed IDs (ING-n.m, STO-n.m) are scenario headings too.
    ids = scenario_ids()
    assert ids, "no scenario IDs found in openspec/specs/*/spec.md"
    missing = scenarios_without_a_test(ids, all_test_names())
    assert not missing, "%d of %d scenario IDs have no test function under tests/ named after " \
        "them (ING-1.1 is written ing_1_1):\n  %s" % (
            len(missing), len(set(ids)),
            "\n  ".join("%s (%s)" % (i, id_slug(i)) for i in missing))


def test_id_matching_respects_word_boundaries():
    names = {"test_ing_1_10_x", "test_ingest_1_1_y", "test_ing_1_1", "test_zing_1_1_z"}
    assert names_carrying("ING-1.1", names) == ["test_ing_1_1"]
    assert names_carrying("INGEST-1.1", names) == ["test_ingest_1_1_y"]
    assert scenarios_without_a_test(["ING-1.1", "ING-1.2", "ING-1.10", "ING-1.1", "ING-1.11"],
                                    names) == ["ING-1.11", "ING-1.2"]


# ---------------------------------------------------------------------------------------------
# (b) OpenSpec structure rules.

@pytest.mark.parametrize("path", SPECS, ids=lambda p: p.parent.name)
def test_spec_follows_openspec_structure(path):
    spec = parse_spec(path)
    problems = []
    lines = path.read_text(encoding="utf-8").splitlines()
    if not lines or not re.match(r"# \S", lines[0]):
        problems.append("the first line must be the '# <name> Specification' title")
    for name in ("Purpose", "Requirements"):
        if name not in spec["sections"]:
            problems.append("missing '## %s'" % name)
    if "Purpose" in spec["sections"] and not spec["sections"]["Purpose"]:
        problems.append("'## Purpose' is empty")
    if not spec["requirements"]:
        problems.append("no '### Requirement:'")
    for section, requirement in spec["requirements"]:
        where = "line %d %r" % (requirement["line"], requirement["title"])
        if section != "Requirements":
            problems.append("%s is not under '## Requirements'" % where)
        if not requirement["body"] or not NORMATIVE.search(requirement["body"][0]):
            problems.append("%s: its first line must state SHALL or MUST" % where)
        if not requirement["scenarios"]:
            problems.append("%s has no '#### Scenario:'" % where)
        for scenario in requirement["scenarios"]:
            bullets = scenario["bullets"]
            for keyword in ("WHEN", "THEN"):
                if not any(b.startswith("- **%s**" % keyword) for b in bullets):
                    problems.append("line %d %r has no '- **%s**' bullet"
                                    % (scenario["line"], scenario["title"], keyword))
            for bullet in bullets:
                if not re.match(r"- \*\*(GIVEN|WHEN|THEN|AND)\*\* \S", bullet):
                    problems.append("line %d %r: not a GIVEN/WHEN/THEN/AND bullet: %r"
                                    % (scenario["line"], scenario["title"], bullet))
    for number, line in spec["stray"]:
        problems.append("line %d: heading outside the Requirement/Scenario structure: %r"
                        % (number, line))
    assert not problems, "%s:\n  " % path.relative_to(ROOT) + "\n  ".join(problems)


# ---------------------------------------------------------------------------------------------
# (c) The reference covers the CLI and the environment; README names the commands and links it.

def readme_text() -> str:
    return README.read_text(encoding="utf-8")


def reference_documents() -> list[Path]:
    return sorted(REFERENCE.glob("*.md"))


def reference_text() -> str:
    """Every reference document, one after the other."""
    return "\n".join(path.read_text(encoding="utf-8") for path in reference_documents())


def subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    found = {}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            found.update(action.choices)
    return found


def long_flags(parser: argparse.ArgumentParser) -> set[str]:
    """Every ``--flag`` of the parser and of all its subcommands (``--help`` included)."""
    flags = {s for action in parser._actions for s in action.option_strings if s.startswith("--")}
    for sub in subcommands(parser).values():
        flags |= long_flags(sub)
    return flags


def environment_variables() -> set[str]:
    """``HEALTHLOG_*`` names healthlog.py reads: from an environment mapping, or named as a
    quoted string (the settings that a table of flag, variable and parser reads in a loop)."""
    source = Path(healthlog.__file__).read_text(encoding="utf-8")
    return set(re.findall(r"""environ(?:\.get\(|\[)\s*["'](HEALTHLOG_[A-Z0-9_]+)["']""", source)) \
        | set(re.findall(r"""["'](HEALTHLOG_[A-Z0-9_]+)["']""", source))


def test_parser_introspection_finds_the_cli():
    parser = healthlog.build_parser()
    assert {"serve", "status"} <= set(subcommands(parser))
    assert {"--version", "--data", "--listen", "--token", "--json"} <= long_flags(parser)
    assert {"HEALTHLOG_DATA", "HEALTHLOG_LISTEN", "HEALTHLOG_TOKEN",
            "HEALTHLOG_NOTIFY", "HEALTHLOG_LATE_AFTER"} <= environment_variables()


def names_command(command: str, text: str) -> bool:
    return re.search(r"healthlog(?:\.pyz)? +%s\b" % re.escape(command), text) is not None


def test_there_is_a_reference():
    assert reference_documents(), "no openspec/reference/*.md found"


def test_readme_names_every_subcommand():
    readme = readme_text()
    missing = [command for command in sorted(subcommands(healthlog.build_parser()))
               if not names_command(command, readme)]
    assert not missing, "README.md never shows `healthlog.pyz <command>` for: " + ", ".join(
        missing)


def test_reference_documents_every_subcommand():
    reference = reference_text()
    missing = [command for command in sorted(subcommands(healthlog.build_parser()))
               if not names_command(command, reference)]
    assert not missing, "openspec/reference/ never shows `healthlog.pyz <command>` for: " + (
        ", ".join(missing))


def test_reference_documents_every_flag():
    reference = reference_text()
    missing = [flag for flag in sorted(long_flags(healthlog.build_parser()))
               if not re.search(r"(?<![\w-])%s(?![\w-])" % re.escape(flag), reference)]
    assert not missing, "openspec/reference/ does not mention: " + ", ".join(missing)


def test_reference_documents_every_environment_variable():
    reference = reference_text()
    missing = [name for name in sorted(environment_variables())
               if not re.search(r"\b%s\b" % name, reference)]
    assert not missing, "openspec/reference/ does not mention: " + ", ".join(missing)


@pytest.mark.parametrize("path", reference_documents(), ids=lambda p: p.name)
def test_readme_links_every_reference_document(path):
    target = path.relative_to(ROOT).as_posix()
    assert re.search(r"\]\(%s(?:#[^)]*)?\)" % re.escape(target), readme_text()), (
        "README.md does not link %s" % target)


# ---------------------------------------------------------------------------------------------
# (d) Links between the documents resolve, inside the repository.

DOCUMENTS = sorted({README, ROOT / "openspec" / "README.md", ROOT / "openspec" / "decisions.md",
                    *REFERENCE.glob("*.md"), *SPECS, *(ROOT / "contrib").rglob("*.md")})
LINK = re.compile(r"\]\(([^)\s]+)\)")


def heading_slugs(path: Path) -> set[str]:
    """The anchors GitHub gives the headings of a Markdown file (code blocks left out)."""
    slugs: set[str] = set()
    for _, line in spec_lines(path):
        header = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not header:
            continue
        slug = re.sub(r"[^\w\- ]", "", header.group(1).lower()).replace(" ", "-")
        candidate, n = slug, 0
        while candidate in slugs:
            n += 1
            candidate = "%s-%d" % (slug, n)
        slugs.add(candidate)
    return slugs


def document_links(path: Path) -> list[str]:
    return [target for _, line in spec_lines(path) for target in LINK.findall(line)
            if not re.match(r"[a-z][a-z0-9+.-]*:", target)]  # http:, https:, mailto: …


def link_problem(source: Path, target: str) -> str | None:
    where, _, anchor = target.partition("#")
    path = (source.parent / where).resolve() if where else source
    if path != ROOT and ROOT not in path.parents:
        return "points outside the repository"
    if not path.exists():
        return "no such file"
    if anchor and path.suffix == ".md" and anchor not in heading_slugs(path):
        return "no heading #%s in %s" % (anchor, path.relative_to(ROOT))
    return None


def test_link_checking_can_fail():
    document = ROOT / "openspec" / "example.md"  # never written: only its folder is used
    assert link_problem(document, "../README.md#quick-start") is None
    assert link_problem(document, "../README.md#no-such-section") is not None
    assert link_problem(document, "../../elsewhere/notes.md") == "points outside the repository"
    assert link_problem(document, "reference/no-such-file.md") == "no such file"


@pytest.mark.parametrize("path", DOCUMENTS, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_document_links_resolve_inside_the_repository(path):
    problems = ["%s: %s" % (target, problem) for target in document_links(path)
                for problem in [link_problem(path, target)] if problem]
    assert not problems, "%s:\n  " % path.relative_to(ROOT) + "\n  ".join(problems)


def test_readme_quick_start_is_what_ci_runs():
    readme = readme_text()
    ci_commands = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()
                   if line.strip().startswith("python3 -m venv")]
    assert ci_commands, ".ci/run no longer runs the README's test command"
    assert all("pytest" in command for command in ci_commands)
    for command in ci_commands:
        assert command in readme, "README.md does not show .ci/run's command: " + command
    assert "python3 build_zipapp.py && python3 dist/healthlog.pyz serve" in readme
