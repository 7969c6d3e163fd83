"""contrib/healthlog.service: a unit systemd accepts, and examples in it that can be pasted.

systemd has no comments after a value: a ``#`` after a setting's value is part of the value.
``Environment=A=1   # note`` still sets ``A`` but logs "Invalid environment assignment,
ignoring" for ``#`` and every word after it, and ``MemoryMax=400M   # note`` is ignored as a
whole ("Invalid memory limit"). So the unit, and every setting its comments show for a
drop-in, keeps comments on lines of their own. ``systemd-analyze verify`` checks the unit
together with the drop-in example from its header; the remaining checks need no systemd.

The unit's other promises (ExecStart, Type, stop timeout, hardening) are checked in
tests/test_build.py.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
UNIT = ROOT / "contrib" / "healthlog.service"

#: A comment line that shows a unit setting, e.g. ``#   Environment=HEALTHLOG_TOKEN=...``.
SETTING_IN_COMMENT = re.compile(r"^#\s*([A-Z][A-Za-z]+)=(.*)$")


def unit_lines() -> list[str]:
    return UNIT.read_text(encoding="utf-8").splitlines()


def drop_in_example() -> list[str]:
    """The drop-in shown under "Settings:" in the unit's header, without the ``#   `` prefix."""
    lines = unit_lines()
    start = next(i for i, line in enumerate(lines) if line.startswith("# Settings:"))
    example = []
    for line in lines[start + 1:]:
        if not line.startswith("#   "):
            break
        example.append(line[len("#   "):])
    return example


def verify(unit: Path) -> tuple[subprocess.CompletedProcess, list[str]]:
    """Run ``systemd-analyze verify`` on a unit; return the result and its complaints about the
    unit's own lines.

    systemd's parser reports every problem in a unit file or a drop-in as
    ``<path>:<line>: <message>`` (an invalid assignment, an unknown key or section, a value
    it cannot parse), so a line of the output that starts with the unit's path (or the path
    of one of its drop-ins) is a syntax error in it. Messages about other units on the host
    do not count.
    """
    analyze = shutil.which("systemd-analyze")
    assert analyze is not None
    environment = dict(os.environ, SYSTEMD_COLORS="0", SYSTEMD_PAGER="", LC_ALL="C")
    result = subprocess.run([analyze, "verify", "--man=no", str(unit)], cwd=unit.parent,
                            capture_output=True, text=True, timeout=120, env=environment)
    located = re.compile(r"%s(?:\.d/[^:]+)?:\d+: " % re.escape(str(unit)))
    complaints = [line for line in (result.stdout + result.stderr).splitlines()
                  if located.match(line) or "Invalid environment assignment" in line]
    return result, complaints


def installable_copy(directory: Path, text: str, drop_in: list[str]) -> Path:
    """The unit in ``directory``, its drop-in beside it in ``healthlog.service.d/``.

    verify refuses an ExecStart whose program does not exist ("Command … is not
    executable"), and a test host need not have /usr/bin/python3: the copy runs this
    interpreter instead, with the same arguments. The pyz path in the arguments and the
    ``healthlog`` user need not exist; verify checks neither.
    """
    text, count = re.subn(r"^ExecStart=\S+", lambda _: "ExecStart=" + sys.executable, text,
                          flags=re.MULTILINE)
    assert count == 1, "the unit should have exactly one ExecStart= line"
    unit = directory / "healthlog.service"
    unit.write_text(text, encoding="utf-8")
    (directory / "healthlog.service.d").mkdir()
    (directory / "healthlog.service.d" / "example.conf").write_text(
        "\n".join(drop_in) + "\n", encoding="utf-8")
    return unit


needs_systemd_analyze = pytest.mark.skipif(
    shutil.which("systemd-analyze") is None,
    reason="systemd-analyze is not on PATH (it comes with systemd)")


def test_drop_in_example_sets_the_environment_in_a_service_section():
    example = drop_in_example()
    assert example and example[0] == "[Service]", example
    keys = [line.split("=", 2)[1] for line in example if line.startswith("Environment=")]
    assert keys == ["HEALTHLOG_LISTEN", "HEALTHLOG_TOKEN"], example


def test_settings_shown_in_comments_carry_no_trailing_comment():
    environment_lines = [line for line in unit_lines() if line.startswith("#   Environment=")]
    assert environment_lines, "the unit's header no longer shows an Environment= drop-in"
    offenders = ["line %d: %s" % (number, line) for number, line in enumerate(unit_lines(), 1)
                 if SETTING_IN_COMMENT.match(line) and "#" in SETTING_IN_COMMENT.match(line)[2]]
    assert not offenders, ("a setting shown in a comment has a trailing `# …`, which systemd "
                           "would read as part of its value:\n" + "\n".join(offenders))


def test_settings_in_the_unit_carry_no_trailing_comment():
    offenders = ["line %d: %s" % (number, line) for number, line in enumerate(unit_lines(), 1)
                 if not line.lstrip().startswith(("#", ";", "[")) and "#" in line]
    assert not offenders, "\n".join(offenders)


@needs_systemd_analyze
def test_unit_and_its_drop_in_example_pass_systemd_analyze_verify(tmp_path):
    unit = installable_copy(tmp_path, UNIT.read_text(encoding="utf-8"), drop_in_example())
    result, complaints = verify(unit)
    output = result.stdout + result.stderr
    assert not complaints, "systemd-analyze verify found errors in the unit:\n" + output
    assert result.returncode == 0, output


@needs_systemd_analyze
def test_verify_would_report_a_trailing_comment_in_the_drop_in(tmp_path):
    # The check above can only pass for the right reason if this systemd still reports the
    # mistake it guards against: the drop-in example as it was once written.
    unit = installable_copy(tmp_path, UNIT.read_text(encoding="utf-8"), [
        "[Service]",
        "Environment=HEALTHLOG_LISTEN=0.0.0.0:8765   # address:port to listen on",
    ])
    _, complaints = verify(unit)
    assert complaints, "systemd-analyze verify no longer reports a trailing comment"
    assert all("example.conf:2: " in line for line in complaints), complaints
