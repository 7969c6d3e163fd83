"""Mutation test of the durable path (RELY-9.1). Run by hand, never by pytest (the name does
not match ``test_*.py``, so it is not collected):

    .venv/bin/python tests/mutate.py              # every mutant
    .venv/bin/python tests/mutate.py M1 M4        # some of them
    .venv/bin/python tests/mutate.py --list       # the table, without running anything

A mutant weakens one thing the durable path does: an fsync of a file or a folder, the flush
before an fsync, or the ``synchronous`` level of a connection an acknowledgement rests on. For
each: the repository (without .git, .venv and caches) is copied into a temporary directory, the
mutant is applied to the copy's healthlog.py (an exact replacement whose text must occur exactly
once, or the script stops), and the tests named for the mutant run there with pytest
(``-n 0``; a plugin checks that the tests import the mutated copy). Each test's outcome is read
from a JUnit XML report. A mutant is killed when every test named for it fails (the table
claims that each of them kills it) and, where the table says why (``expect``: the loss the
crash-state explorer must report), its failure says so. First the named tests run on an
unmutated copy and must pass, or their failing would prove nothing.

Prints a table (mutant, where, killing tests, killed). Exits 0 when every mutant is killed, 1
when one survives or a named test does not kill it, 2 when the run itself failed (a mutant that
no longer applies, a baseline failure, a test that did not run). The table is also in
openspec/specs/reliability/spec.md; tests/test_durable_path.py checks in the default run that
both agree and that every mutant still applies to healthlog.py.
"""

import argparse
import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parent.parent
TIMEOUT_S = 600

CRASH_INGEST = ("tests/test_crash_states.py::"
                "test_rely_2_1_every_crash_state_of_an_ingest_recovers_without_loss")
CRASH_REFUSED = ("tests/test_crash_states.py::test_rely_2_4_a_body_refused_after_its_meta_json"
                 "_leaves_no_meta_json_in_any_crash_state")
SERVE_LEVELS = ("tests/test_durable_path.py::"
                "test_rely_9_2_serve_ingests_through_full_connections_and_folds_through_a_normal_one")
IMPORT_LEVEL = "tests/test_durable_path.py::test_rely_9_3_import_journals_through_a_full_connection"

# What the explorer reports (tests/test_crash_states.py), for the mutants it finds by their effect.
ACKED_LOST = "acknowledged delivery 0 is journaled 0 times after serve"
TORN_BODY = "is not a body that was sent (torn?)"
META_LOST = "has no readable .meta.json"
BODY_MISSING = "points to a missing body"
META_KEPT = "a .meta.json without its body survives the crash"


class Mutant(NamedTuple):
    id: str
    where: str  # function (healthlog.py)
    change: str  # what the mutant does, in words
    old: str  # exact text in healthlog.py (must occur once)
    new: str
    tests: tuple = ()  # pytest node ids; each must fail under the mutant
    expect: tuple = ()  # (node id, text its failure must contain): it fails for this reason
    why: str = ""  # for an equivalent mutant: why no test can tell it apart


MUTANTS = [
    Mutant("M1", "Service.__init__", 'the ingest pool is opened with synchronous="NORMAL"',
           '        self.pool = ConnectionPool(config, synchronous="FULL")\n',
           '        self.pool = ConnectionPool(config, synchronous="NORMAL")\n',
           (CRASH_INGEST, SERVE_LEVELS), ((CRASH_INGEST, ACKED_LOST),)),
    Mutant("M2", "connect", "every connection is set to synchronous=NORMAL, whatever it asks",
           '        conn.execute("PRAGMA synchronous=%s" % ("FULL" if synchronous == "FULL"'
           ' else "NORMAL"))\n',
           '        conn.execute("PRAGMA synchronous=NORMAL")\n',
           (CRASH_INGEST, SERVE_LEVELS, IMPORT_LEVEL), ((CRASH_INGEST, ACKED_LOST),)),
    Mutant("M3", "Archive.receive", "the upload in DATA/tmp is not fsynced",
           "            try:\n                os.fsync(fd)\n            except OSError as exc:\n",
           "            try:\n                pass\n            except OSError as exc:\n",
           (CRASH_INGEST,), ((CRASH_INGEST, TORN_BODY),)),
    Mutant("M4", "write_durable", "no flush before the fsync (the data reaches the kernel at"
           " close, after the fsync)",
           "            handle.flush()\n            os.fsync(handle.fileno())\n",
           "            os.fsync(handle.fileno())\n",
           (CRASH_INGEST,), ((CRASH_INGEST, META_LOST),)),
    Mutant("M5", "write_durable", "the temp file (the .meta.json) is not fsynced",
           "            handle.flush()\n            os.fsync(handle.fileno())\n",
           "            handle.flush()\n",
           (CRASH_INGEST,), ((CRASH_INGEST, META_LOST),)),
    Mutant("M6", "write_durable", "the folder is not fsynced after the rename",
           "        raise\n    fsync_dir(path.parent)\n",
           "        raise\n",
           (CRASH_INGEST,), ((CRASH_INGEST, META_LOST),)),
    Mutant("M7", "makedirs_durable", "the parent of a new folder is not fsynced",
           "                directory.mkdir(mode=0o700)\n            fsync_dir(directory.parent)\n",
           "                directory.mkdir(mode=0o700)\n",
           (CRASH_INGEST,), ((CRASH_INGEST, BODY_MISSING),)),
    Mutant("M8", "Archive.commit", "the day folder is not fsynced after the body's rename (the"
           " commit point)",
           "            raise\n        fsync_dir(target_dir)\n        return",
           "            raise\n        return",
           (CRASH_INGEST,), ((CRASH_INGEST, BODY_MISSING),)),
    Mutant("M9", "Archive.commit", "the day folder is not fsynced after a refused body's"
           " .meta.json is removed",
           "                meta_path.unlink()\n                fsync_dir(target_dir)\n",
           "                meta_path.unlink()\n",
           (CRASH_REFUSED,), ((CRASH_REFUSED, META_KEPT),)),
    Mutant("M10", "fsync_dir", "no folder is ever fsynced (the one function all use)",
           "os.O_DIRECTORY)\n    try:\n        os.fsync(fd)\n",
           "os.O_DIRECTORY)\n    try:\n        pass\n",
           (CRASH_INGEST, CRASH_REFUSED), ((CRASH_REFUSED, META_KEPT),)),
    Mutant("M11", "run_import", 'import opens its connection with synchronous="NORMAL"',
           "    conn = open_database(config)\n    headers = ",
           '    conn = open_database(config, synchronous="NORMAL")\n    headers = ',
           (IMPORT_LEVEL,)),
    Mutant("M12", "open_database", 'the default level is "NORMAL" (import relies on it)',
           '                  synchronous: str = "FULL") -> sqlite3.Connection:\n'
           '    """Open (and on first use create)',
           '                  synchronous: str = "NORMAL") -> sqlite3.Connection:\n'
           '    """Open (and on first use create)',
           (IMPORT_LEVEL,)),
    Mutant("M13", "connect", 'every level but FULL becomes "OFF" (the fold thread\'s)',
           '("FULL" if synchronous == "FULL" else "NORMAL")',
           '("FULL" if synchronous == "FULL" else "OFF")',
           (SERVE_LEVELS,)),
]

EQUIVALENT = [
    Mutant("E1", "connect", 'the default level is "NORMAL"',
           'def connect(path: Path, *, busy_timeout_s: float = BUSY_TIMEOUT_S,\n'
           '            synchronous: str = "FULL")',
           'def connect(path: Path, *, busy_timeout_s: float = BUSY_TIMEOUT_S,\n'
           '            synchronous: str = "NORMAL")',
           why="every caller in healthlog.py passes a level"),
    Mutant("E2", "ConnectionPool.__init__", 'the default level is "NORMAL"',
           '    def __init__(self, config: Config, synchronous: str = "FULL"):\n'
           '        self._config = config\n        self._synchronous',
           '    def __init__(self, config: Config, synchronous: str = "NORMAL"):\n'
           '        self._config = config\n        self._synchronous',
           why="the one pool, Service's, passes its level"),
    Mutant("E3", "FoldWorker.connect", 'the fold thread asks for synchronous="OFF"',
           '        return connect(self._config.db_path, busy_timeout_s=self._config'
           '.busy_timeout_s,\n                       synchronous="NORMAL")',
           '        return connect(self._config.db_path, busy_timeout_s=self._config'
           '.busy_timeout_s,\n                       synchronous="OFF")',
           why="connect sets NORMAL for every level but FULL (M13 mutates that)"),
]

CHECK_PLUGIN = '''\
"""Loaded by tests/mutate.py with -p: the tests must import the mutated copy."""
import hashlib
import os


def pytest_sessionstart(session):
    import healthlog

    path = os.path.realpath(healthlog.__file__)
    want = os.path.realpath(os.environ["MUTATE_HEALTHLOG"])
    assert path == want, "the tests import %s, not the mutated %s" % (path, want)
    with open(path, "rb") as handle:
        digest = hashlib.sha256(handle.read()).hexdigest()
    assert digest == os.environ["MUTATE_SHA256"], "healthlog.py changed under the run"
'''

IGNORE = shutil.ignore_patterns(".git", ".venv", "venv", "__pycache__", ".pytest_cache",
                                ".hypothesis", ".ruff_cache", "build", "dist", "*.pyz")


class SetupError(Exception):
    """The run itself failed: nothing can be said about the mutant."""


def mutated_source(mutant: Mutant) -> str:
    source = (ROOT / "healthlog.py").read_text(encoding="utf-8")
    count = source.count(mutant.old)
    if count != 1:
        raise SetupError("%s (%s): its text occurs %d times in healthlog.py, not once:\n%s"
                         % (mutant.id, mutant.where, count, mutant.old))
    return source.replace(mutant.old, mutant.new)


def run_tests(source: str, tests: tuple, label: str) -> dict:
    """Run ``tests`` in a copy of the repository whose healthlog.py is ``source``; returns
    {node id: "passed" | "failed" | "skipped"}."""
    with tempfile.TemporaryDirectory(prefix="healthlog-mutant-") as scratch:
        copy = Path(scratch) / "repo"
        shutil.copytree(str(ROOT), str(copy), ignore=IGNORE)
        (copy / "healthlog.py").write_text(source, encoding="utf-8")
        (Path(scratch) / "_mutate_check.py").write_text(CHECK_PLUGIN, encoding="utf-8")
        report = Path(scratch) / "report.xml"
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(copy), scratch]),
                   MUTATE_HEALTHLOG=str(copy / "healthlog.py"),
                   MUTATE_SHA256=hashlib.sha256(source.encode("utf-8")).hexdigest())
        command = [sys.executable, "-m", "pytest", "-n", "0", "-q", "-p", "no:cacheprovider",
                   "-p", "_mutate_check", "--junitxml", str(report), *tests]
        try:
            proc = subprocess.run(command, cwd=str(copy), env=env, stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:
            raise SetupError("%s: the tests did not end within %d s"
                             % (label, TIMEOUT_S)) from None
        output = proc.stdout.decode("utf-8", "replace")
        if proc.returncode not in (0, 1) or not report.exists():
            raise SetupError("%s: pytest exited %d:\n%s" % (label, proc.returncode,
                                                           output[-3000:]))
        outcomes = {}
        for case in ET.parse(str(report)).getroot().iter("testcase"):
            failures = [child for child in case if child.tag in ("failure", "error")]
            outcome = ("failed" if failures else
                       "skipped" if any(child.tag == "skipped" for child in case) else "passed")
            message = " / ".join("%s\n%s" % (child.get("message", ""), child.text or "")
                                 for child in failures)
            name = case.get("name")
            if outcome == "failed" or name not in outcomes:
                outcomes[name] = (outcome, message)  # a failing teardown counts as well
    result = {}
    for node in tests:
        name = node.split("::")[1]
        if name not in outcomes:
            raise SetupError("%s: %s did not run:\n%s" % (label, node, output[-3000:]))
        result[node] = outcomes[name]
    return result


def short(node: str) -> str:
    """``tests/x.py::test_rely_2_1_...`` -> ``RELY-2.1``: the scenario the test carries."""
    match = re.match(r"test_([a-z]+)_(\d+)_(\d+)_", node.split("::")[1])
    return "%s-%s.%s" % (match.group(1).upper(), match.group(2), match.group(3))


def show_table(mutants: list, killed: dict, outcomes: dict) -> None:
    where = max([len("where (healthlog.py)")] + [len(m.where) for m in mutants + EQUIVALENT])
    tests = {m.id: ", ".join(short(node) for node in m.tests) or "none"
             for m in mutants + EQUIVALENT}
    width = max([len("killing tests")] + [len(text) for text in tests.values()])
    row = "%%-4s %%-%ds  %%-%ds  %%-6s  %%s" % (where, width)
    print("\n" + row % ("", "where (healthlog.py)", "killing tests", "killed", "change"))
    for m in mutants:
        state = {True: "yes", False: "NO"}.get(killed.get(m.id), "-")
        print(row % (m.id, m.where, tests[m.id], state, m.change))
        if killed.get(m.id) is False:
            for node, (outcome, message) in outcomes[m.id].items():
                print("       %s under the mutant: %s" % (node, outcome))
                for want in [text for at, text in m.expect if at == node and outcome == "failed"
                             and text not in message]:
                    print("         but not for the expected reason (%r)" % want)
    for m in EQUIVALENT:
        print(row % (m.id, m.where, tests[m.id], "-", "%s (equivalent: %s)" % (m.change, m.why)))
    print("\nkilling tests:")
    for node in sorted({node for m in mutants for node in m.tests}):
        print("  %s  %s" % (short(node), node))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("ids", nargs="*", help="mutants to run (default: all)")
    parser.add_argument("--list", action="store_true", help="show the table and exit")
    parser.add_argument("-v", "--verbose", action="store_true",
                        help="print each killing test's failure message")
    args = parser.parse_args(argv)
    unknown = set(args.ids) - {m.id for m in MUTANTS}
    if unknown:
        parser.error("no such mutant: %s" % ", ".join(sorted(unknown)))
    mutants = [m for m in MUTANTS if not args.ids or m.id in args.ids]
    if args.list:
        show_table(mutants, {}, {})
        return 0
    started = time.monotonic()
    killed, outcomes = {}, {}
    try:
        for m in mutants + EQUIVALENT:
            mutated_source(m)  # every mutant applies, before anything runs
        tests = tuple(sorted({node for m in mutants for node in m.tests}))
        print("baseline: %d tests on the unmutated copy ..." % len(tests), flush=True)
        baseline = run_tests((ROOT / "healthlog.py").read_text(encoding="utf-8"), tests,
                             "baseline")
        broken = [node for node, (outcome, _) in baseline.items() if outcome != "passed"]
        if broken:
            raise SetupError("baseline: these tests do not pass on the unmutated code: %s"
                             % broken)
        for m in mutants:
            print("%s %s: %s ..." % (m.id, m.where, m.change), flush=True)
            outcomes[m.id] = run_tests(mutated_source(m), m.tests, m.id)
            killed[m.id] = all(o == "failed" for o, _ in outcomes[m.id].values()) and all(
                text in outcomes[m.id][node][1] for node, text in m.expect)
            if args.verbose:
                for node, (outcome, message) in outcomes[m.id].items():
                    print("    %s %s: %s" % (short(node), outcome, message[:600]), flush=True)
    except SetupError as exc:
        show_table(mutants, killed, outcomes)
        print("\nERROR: %s" % exc, file=sys.stderr)
        return 2
    show_table(mutants, killed, outcomes)
    survivors = [m.id for m in mutants if not killed[m.id]]
    print("\n%d mutants, %d killed, %d survived%s; %d equivalent not run; %.0f s"
          % (len(mutants), len(mutants) - len(survivors), len(survivors),
             " (%s)" % ", ".join(survivors) if survivors else "", len(EQUIVALENT),
             time.monotonic() - started))
    return 1 if survivors else 0


if __name__ == "__main__":
    sys.exit(main())
