"""build_zipapp.py and the healthlog.pyz it writes.

Three layers: the builder's pure functions (pins, member filter), the archive's structure
(reproducible, every parent directory present, nothing compiled or stripped-but-present),
and the archive run by real interpreters from pyenv: 3.8 must be refused with one line,
3.9 and 3.13 must run it with no site-packages at all (-S), as on a bare NAS.

The pyenv interpreters are looked up under `$(pyenv root)/versions/3.X.Y/bin/python3`. When
one is missing the test is skipped, unless HEALTHLOG_REQUIRE_PYENV=1 (CI sets it), which
turns the skip into a failure so the pyz is never silently left untested on 3.9 and 3.13.

The `pyz` fixture and the pyenv lookup (find_python(), require_python()) are conftest.py's.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import stat
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

import build_zipapp
import healthlog
from conftest import LocalServer, require_python

SUPPORTED = ("3.9", "3.13")  # the oldest and newest Python the pyz promises (README)


# ---------------------------------------------------------------------------------------------
# Helpers: finding interpreters and running the pyz.

def pyz_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """This process's environment without PYTHON* variables (a PYTHONPATH from the test run
    must not help the pyz find anything), plus `extra`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    env.update(extra or {})
    return env


def run(argv: list, *, env: dict[str, str] | None = None, timeout: float = 60,
        **kwargs) -> subprocess.CompletedProcess:
    """Run `argv` to completion with pyz_env(env); stdout and stderr are captured as text."""
    if "input" not in kwargs:
        kwargs.setdefault("stdin", subprocess.DEVNULL)
    return subprocess.run([str(a) for a in argv], env=pyz_env(env), capture_output=True,
                          text=True, timeout=timeout, check=False, **kwargs)


def pyz_command(python, *args, pyz, site: bool = False) -> list[str]:
    """The argv that runs `pyz` with interpreter `python`; `-S` unless `site` is true, so
    that nothing installed on the host can stand in for what the pyz should carry."""
    flags = [] if site else ["-S"]
    return [str(python)] + flags + [str(pyz)] + [str(a) for a in args]


def run_pyz(python, *args, pyz, site: bool = False, **kwargs) -> subprocess.CompletedProcess:
    """Run `python [-S] pyz *args` to completion; stdout and stderr are captured as text.

    Keyword arguments go to run(): env= adds to a copy of this environment without PYTHON*
    variables, timeout= (default 60 s), and subprocess.run's own (cwd=..., input=...).
    For a server, start pyz_command(...) with subprocess.Popen(..., env=pyz_env(...)).
    """
    return run(pyz_command(python, *args, pyz=pyz, site=site), **kwargs)


def members(pyz: Path) -> list[zipfile.ZipInfo]:
    with zipfile.ZipFile(pyz) as archive:
        return archive.infolist()


def names(pyz: Path) -> list[str]:
    return [info.filename for info in members(pyz)]


def read_member(pyz: Path, name: str) -> bytes:
    with zipfile.ZipFile(pyz) as archive:
        return archive.read(name)


def dist_info(wheel: build_zipapp.Wheel) -> str:
    """The .dist-info folder name of `wheel`: its file name's first two fields."""
    return "-".join(wheel.filename.split("-")[:2]) + ".dist-info/"


# ---------------------------------------------------------------------------------------------
# The builder's own rules.

def test_pins_agree_with_pyproject():
    text = build_zipapp.PYPROJECT.read_text(encoding="utf-8")
    build_zipapp.check_pins(build_zipapp.read_dependencies(text))


def test_dependency_reader_agrees_with_tomllib():
    tomllib = pytest.importorskip("tomllib")
    text = build_zipapp.PYPROJECT.read_text(encoding="utf-8")
    assert build_zipapp.read_dependencies(text) == tomllib.loads(text)["project"]["dependencies"]


def test_dependency_reader_handles_comments_quotes_and_other_tables():
    text = ('[build-system]\nrequires = ["setuptools>=64"]\n\n[project]\nname = "x"\n'
            'dependencies = [\n  # a comment, with "quotes" ]\n  "a==1",  \'b-c==2.0\'\n'
            '  , "d[e]==3",]\n\n[project.optional-dependencies]\ntest = ["pytest"]\n')
    assert build_zipapp.read_dependencies(text) == ["a==1", "b-c==2.0", "d[e]==3"]


def test_pin_check_names_every_difference():
    wheels = [build_zipapp.Wheel("jaraco.functools", "4.4.0", "f.whl", "0" * 64),
              build_zipapp.Wheel("bottle", "0.13.4", "b.whl", "0" * 64)]
    build_zipapp.check_pins(["Jaraco_Functools==4.4.0", "bottle == 0.13.4"], wheels)
    with pytest.raises(build_zipapp.BuildError) as error:
        build_zipapp.check_pins(["jaraco.functools==4.6.0", "orjson==3.11.5"], wheels)
    message = str(error.value)
    assert "jaraco-functools: pyproject.toml 4.6.0, build_zipapp.py 4.4.0" in message
    assert "bottle: pyproject.toml (absent)" in message
    assert "orjson: pyproject.toml 3.11.5, build_zipapp.py (absent)" in message


@pytest.mark.parametrize("requirement",
                         ["bottle>=0.13", "bottle", "bottle==0.13.4; python_version>'3'"])
def test_pin_check_refuses_loose_requirements(requirement):
    with pytest.raises(build_zipapp.BuildError, match="not an exact pin"):
        build_zipapp.parse_pin(requirement)


def make_wheel(path: Path, files: dict[str, bytes]) -> Path:
    with zipfile.ZipFile(path, "w") as wheel:
        for name, data in files.items():
            wheel.writestr(name, data)
    return path


@pytest.mark.parametrize("compiled", ["fast/_speedups.so", "fast/libfast.so.1",
                                      "fast/_speedups.cp39-win_amd64.pyd",
                                      "fast/_speedups.DYLIB"])
def test_compiled_file_in_a_wheel_stops_the_build(tmp_path, compiled):
    wheel = make_wheel(tmp_path / "fast-1.0-py3-none-any.whl",
                       {"fast/__init__.py": b"", compiled: b"\x7fELF"})
    with pytest.raises(build_zipapp.BuildError, match="compiled file"):
        build_zipapp.wheel_entries(wheel)


def test_wheel_data_outside_scripts_stops_the_build(tmp_path):
    wheel = make_wheel(tmp_path / "odd-1.0-py3-none-any.whl",
                       {"odd-1.0.data/purelib/odd.py": b""})
    with pytest.raises(build_zipapp.BuildError, match="outside site-packages"):
        build_zipapp.wheel_entries(wheel)


def test_member_filter_keeps_code_metadata_and_licenses_only():
    keep = build_zipapp.keep_member
    for name in ["pkg/__init__.py", "pkg/sub/mod.py", "pkg/__main__.py",
                 "pkg-1.0.dist-info/METADATA", "pkg-1.0.dist-info/LICENSE.md",
                 "pkg-1.0.dist-info/COPYING", "pkg-1.0.dist-info/licenses/LICENSE",
                 "pkg-1.0.dist-info/licenses/vendored/NOTICE.txt"]:
        assert keep(name), name
    for name in ["pkg/__pycache__/mod.cpython-39.pyc", "pkg/mod.pyc", "pkg/mod.pyi",
                 "pkg/py.typed", "cheroot/test/test_core.py", "cheroot/testing.py",
                 "pkg-1.0.dist-info/RECORD", "pkg-1.0.dist-info/WHEEL",
                 "pkg-1.0.dist-info/INSTALLER", "pkg-1.0.dist-info/REQUESTED",
                 "pkg-1.0.dist-info/entry_points.txt", "pkg-1.0.dist-info/top_level.txt",
                 "pkg-1.0.dist-info/direct_url.json"]:
        assert not keep(name), name


def test_cached_wheels_are_not_downloaded_again(pyz, monkeypatch):
    def no_download(wheels, wheels_dir):
        raise AssertionError(f"downloaded {wheels} although cached")

    monkeypatch.setattr(build_zipapp, "download", no_download)
    paths = build_zipapp.fetch_wheels(build_zipapp.DEFAULT_WHEELS)
    assert [p.name for p in paths] == [w.filename for w in build_zipapp.WHEELS]


def test_downloaded_wheel_with_wrong_hash_stops_the_build(tmp_path, monkeypatch):
    wheel = build_zipapp.Wheel("fast", "1.0", "fast-1.0-py3-none-any.whl", "0" * 64)
    (tmp_path / wheel.filename).write_bytes(b"stale")

    def tampered_download(wheels, wheels_dir):
        assert not (wheels_dir / wheel.filename).exists()  # the wrong cached copy was dropped
        (wheels_dir / wheel.filename).write_bytes(b"not what was pinned")

    monkeypatch.setattr(build_zipapp, "download", tampered_download)
    with pytest.raises(build_zipapp.BuildError, match="sha256"):
        build_zipapp.fetch_wheels(tmp_path, [wheel])


class _Index(LocalServer):
    """A PEP 503 simple index on 127.0.0.1 for the builder to fetch from, in a thread:
    ``/simple/<project>/`` lists each wheel of ``files`` by its name; every path asked
    is remembered."""

    def __init__(self, root: Path, files: dict):
        import http.server

        for name, data in files.items():
            (root / "files").mkdir(parents=True, exist_ok=True)
            (root / "files" / name).write_bytes(data)
        for wheel in build_zipapp.WHEELS:
            page = root / "simple" / build_zipapp.normalize_name(wheel.name)
            page.mkdir(parents=True, exist_ok=True)
            (page / "index.html").write_text(
                '<html><body><a href="../../files/%s#sha256=%s">%s</a></body></html>'
                % (wheel.filename, wheel.sha256, wheel.filename))
        asked = self.asked = []

        class Handler(http.server.SimpleHTTPRequestHandler):
            def __init__(self, *args, **kwargs):
                super().__init__(*args, directory=str(root), **kwargs)

            def log_message(self, *args):
                asked.append(self.path)

        super().__init__(Handler, name="test-index")
        self.url = self.origin + "/simple/"


def build_without_pip(tmp_path: Path, index: _Index) -> subprocess.CompletedProcess:
    """``python3 -S -I build_zipapp.py`` (no site-packages: no pip) into empty caches, with
    pip's own settings pointing at ``index`` (and no find-links folder)."""
    env = dict(os.environ, PIP_INDEX_URL=index.url, PIP_FIND_LINKS="",
               PIP_CONFIG_FILE=os.devnull)
    return subprocess.run([sys.executable, "-S", "-I", str(build_zipapp.ROOT / "build_zipapp.py"),
                           "--wheels", str(tmp_path / "wheels"),
                           "--output", str(tmp_path / "out" / "healthlog.pyz")],
                          capture_output=True, text=True, env=env, timeout=120)


def test_without_pip_the_build_fetches_the_pinned_wheels_from_pips_index(pyz, tmp_path):
    """A Python without pip (Debian's and Raspberry Pi OS Lite's python3 without
    python3-pip, here `python3 -S -I`) builds the same archive from the index pip's
    settings name (PIP_INDEX_URL: a mirror keeps working), each wheel hash-checked."""
    files = {w.filename: (build_zipapp.DEFAULT_WHEELS / w.filename).read_bytes()
             for w in build_zipapp.WHEELS}
    index = _Index(tmp_path / "index", files)
    try:
        result = build_without_pip(tmp_path, index)
    finally:
        index.close()
    assert result.returncode == 0, result.stderr
    assert "no pip here" in result.stderr and index.url in result.stderr
    assert (tmp_path / "out" / "healthlog.pyz").read_bytes() == pyz.read_bytes()
    for wheel in build_zipapp.WHEELS:
        assert any(path.endswith(wheel.filename) for path in index.asked), index.asked
    assert sorted(p.name for p in (tmp_path / "wheels").iterdir()) == sorted(files)


def test_without_pip_a_wheel_that_is_not_the_pinned_one_stops_the_build(pyz, tmp_path):
    files = {w.filename: (build_zipapp.DEFAULT_WHEELS / w.filename).read_bytes()
             for w in build_zipapp.WHEELS}
    tampered = build_zipapp.WHEELS[1].filename
    files[tampered] = files[tampered] + b"x"
    index = _Index(tmp_path / "index", files)
    try:
        result = build_without_pip(tmp_path, index)
    finally:
        index.close()
    assert result.returncode != 0
    assert tampered in result.stderr and "sha256" in result.stderr
    assert not (tmp_path / "wheels" / tampered).exists()
    assert not list((tmp_path / "wheels").glob("*.part"))
    assert not (tmp_path / "out" / "healthlog.pyz").exists()


def test_without_pip_an_unreachable_index_says_what_to_do(tmp_path):
    index = _Index(tmp_path / "index", {})
    index.close()  # nothing listens there any more
    result = build_without_pip(tmp_path, index)
    assert result.returncode != 0
    [line] = [line for line in result.stderr.splitlines() if "cannot fetch" in line]
    assert "apt install python3-pip" in line and str(tmp_path / "wheels") in line


def test_pip_settings_follow_pip_environment_then_its_configuration(tmp_path):
    config = tmp_path / "pip.conf"
    config.write_text("[global]\nindex-url = https://mirror.example/simple\n"
                      "find-links = /srv/wheels\n[download]\nindex-url = https://dl.example/s\n")
    env = {"PIP_CONFIG_FILE": str(config), "HOME": str(tmp_path)}
    assert build_zipapp.pip_settings(env)[:2] == ("https://dl.example/s", ["/srv/wheels"])
    env["PIP_INDEX_URL"] = "https://env.example/simple"
    env["PIP_FIND_LINKS"] = "/a /b"
    assert build_zipapp.pip_settings(env)[:2] == ("https://env.example/simple", ["/a", "/b"])


def test_requirements_file_pins_versions_and_hashes():
    text = build_zipapp.requirements_text(build_zipapp.WHEELS)
    for wheel in build_zipapp.WHEELS:
        assert f"{wheel.name}=={wheel.version} --hash=sha256:{wheel.sha256}\n" in text


# ---------------------------------------------------------------------------------------------
# The archive.

def test_two_builds_are_byte_identical(pyz, tmp_path):
    # A copy of healthlog.py with another mtime and a build through the command line:
    # neither the file system nor the entry point may leak into the bytes.
    source = tmp_path / "healthlog.py"
    source.write_bytes(build_zipapp.SOURCE.read_bytes())
    os.utime(source, (1_700_000_000, 1_700_000_000))
    again = build_zipapp.build(tmp_path / "a" / "healthlog.pyz", source=source)
    assert again.read_bytes() == pyz.read_bytes()
    assert build_zipapp.main(["--output", str(tmp_path / "b.pyz")]) == 0
    assert (tmp_path / "b.pyz").read_bytes() == pyz.read_bytes()


def test_build_prints_path_size_and_sha256(tmp_path, capsys):
    output = tmp_path / "out.pyz"
    assert build_zipapp.main(["--output", str(output)]) == 0
    line = capsys.readouterr().out.strip()
    assert line.startswith(str(output))
    assert f"{output.stat().st_size} bytes" in line
    assert "sha256 " + build_zipapp.sha256_of(output) in line


@pytest.mark.parametrize("version", SUPPORTED)
def test_builds_on_other_pythons_are_byte_identical(pyz, tmp_path, version):
    python = require_python(version)
    output = tmp_path / "healthlog.pyz"
    result = run([python, "-S", build_zipapp.ROOT / "build_zipapp.py",
                  "--output", output, "--wheels", build_zipapp.DEFAULT_WHEELS], timeout=120)
    assert result.returncode == 0, result.stderr
    assert output.read_bytes() == pyz.read_bytes()


def test_archive_is_an_executable_zip_behind_a_shebang(pyz):
    assert pyz.read_bytes().startswith(b"#!/usr/bin/env python3\n")
    assert stat.S_IMODE(pyz.stat().st_mode) == 0o755
    assert zipfile.is_zipfile(pyz)
    with zipfile.ZipFile(pyz) as archive:
        assert archive.testzip() is None


def test_entries_are_sorted_with_fixed_times_and_modes(pyz):
    infos = members(pyz)
    assert [i.filename for i in infos] == sorted(i.filename for i in infos)
    for info in infos:
        assert info.date_time == (1980, 1, 1, 0, 0, 0), info.filename
        assert info.create_system == 3, info.filename
        if info.is_dir():
            assert info.external_attr == (stat.S_IFDIR | 0o755) << 16 | 0x10, info.filename
            assert info.file_size == 0
        else:
            assert info.external_attr == (stat.S_IFREG | 0o644) << 16, info.filename
            assert info.compress_type == zipfile.ZIP_DEFLATED, info.filename


def test_every_parent_directory_has_an_entry(pyz):
    # Without "jaraco/" zipimport (before 3.14) cannot import the namespace package.
    entries = set(names(pyz))
    for name in entries:
        parts = name.rstrip("/").split("/")[:-1]
        for depth in range(1, len(parts) + 1):
            assert "/".join(parts[:depth]) + "/" in entries, name
    assert {"jaraco/", "jaraco/functools/", "cheroot/", "cheroot/workers/"} <= entries


def test_archive_holds_no_compiled_or_stripped_files(pyz):
    for name in names(pyz):
        base = name.rstrip("/").split("/")[-1]
        assert not name.lower().endswith((".so", ".pyd", ".dylib", ".pyc", ".pyo", ".pyi")), name
        assert "__pycache__" not in name.split("/"), name
        assert base not in ("py.typed", "RECORD", "WHEEL", "INSTALLER", "REQUESTED",
                            "entry_points.txt", "top_level.txt", "direct_url.json"), name
        assert not name.startswith(("bin/", "cheroot/test/", "cheroot/testing.py")), name
        assert ".data/" not in name, name


def test_entry_point_and_program_are_present(pyz):
    assert read_member(pyz, "__main__.py") == build_zipapp.MAIN_PY
    assert read_member(pyz, "healthlog.py") == build_zipapp.SOURCE.read_bytes()


def test_every_dependency_keeps_its_metadata_and_license(pyz):
    entries = set(names(pyz))
    for wheel in build_zipapp.WHEELS:
        folder = dist_info(wheel)
        assert folder + "METADATA" in entries, wheel.name
        metadata = read_member(pyz, folder + "METADATA").decode("utf-8")
        assert f"\nVersion: {wheel.version}\n" in metadata, wheel.name
        licenses = [n for n in entries
                    if n.startswith(folder) and re.search(r"LICEN[CS]E", n) and not n.endswith("/")]
        assert licenses, f"{wheel.name} has no license file in the pyz"


def test_cheroot_test_suite_is_absent_and_the_server_present(pyz):
    entries = set(names(pyz))
    assert not any(n.startswith(("cheroot/test/", "cheroot/testing")) for n in entries)
    assert {"cheroot/server.py", "cheroot/wsgi.py", "cheroot/workers/threadpool.py",
            "bottle.py", "jaraco/functools/__init__.py", "more_itertools/more.py"} <= entries


# ---------------------------------------------------------------------------------------------
# The archive under real interpreters.

# Python 3.8 is the one a Synology NAS calls python3 and must be tested; older ones only show
# that __main__.py stays readable by whatever an old box has, and are tried when present.
@pytest.mark.parametrize("version,required", [("3.8", True), ("3.7", False), ("3.6", False),
                                              ("2.7", False)])
def test_old_python_is_refused_with_one_line(pyz, version, required):
    python = require_python(version, required)
    result = run_pyz(python, "--version", pyz=pyz)
    exact = run([python, "-c", "import sys; print(sys.version.split()[0])"]).stdout.strip()
    assert result.returncode == 2
    assert result.stdout == ""
    assert result.stderr == f"healthlog needs Python 3.9 or newer; this is Python {exact}\n"


def test_pyz_runs_on_the_python_running_the_tests(pyz):
    result = run_pyz(sys.executable, "--version", pyz=pyz)
    assert (result.returncode, result.stdout) == (0, f"healthlog {healthlog.__version__}\n")


@pytest.mark.parametrize("version", SUPPORTED)
def test_pyz_prints_its_version_with_nothing_installed(pyz, version):
    result = run_pyz(require_python(version), "--version", pyz=pyz)
    assert result.returncode == 0, result.stderr
    assert result.stdout == f"healthlog {healthlog.__version__}\n"
    assert "Traceback" not in result.stderr


# Imports the vendored packages from the pyz alone and reports where each came from.
IMPORT_CHECK = """\
import json, sys
sys.path.insert(0, sys.argv[1])
import bottle, cheroot.wsgi, jaraco.functools, more_itertools
from importlib import metadata
modules = {"bottle": bottle, "cheroot.wsgi": cheroot.wsgi,
           "jaraco.functools": jaraco.functools, "more_itertools": more_itertools}
print(json.dumps({
    "no_site": sys.flags.no_site,
    "files": {name: module.__file__ for name, module in modules.items()},
    "versions": {name: metadata.version(name) for name in sys.argv[2:]},
    "cheroot": cheroot.__version__,
}))
"""


@pytest.mark.parametrize("version", SUPPORTED)
def test_vendored_packages_import_from_the_pyz_alone(pyz, tmp_path, version):
    python = require_python(version)
    # Distribution names as the wheel files spell them: 3.9's importlib.metadata does not
    # normalize "jaraco.functools" to the folder's "jaraco_functools".
    pins = {w.filename.split("-")[0]: w.version for w in build_zipapp.WHEELS}
    result = run([python, "-S", "-c", IMPORT_CHECK, pyz, *pins], cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["no_site"] == 1
    for name, path in report["files"].items():
        assert path.startswith(str(pyz) + os.sep), (name, path)
    assert report["versions"] == pins
    assert report["cheroot"] == "11.1.2"  # read from the METADATA kept in the pyz


# ---------------------------------------------------------------------------------------------
# What ships beside the pyz: contrib/.

CONTRIB = build_zipapp.ROOT / "contrib"
UNIT = CONTRIB / "healthlog.service"
# The fold thread's join budget at shutdown (openspec/reference/commands-and-config.md:
# serve; ING-6).
FOLD_STOP_BUDGET_S = 10


def test_contrib_readme_indexes_every_file():
    readme = (CONTRIB / "README.md").read_text(encoding="utf-8")
    for path in sorted(CONTRIB.rglob("*")):
        if path.is_file():
            name = path.relative_to(CONTRIB).as_posix()
            assert f"`{name}`" in readme, f"contrib/README.md does not list {name}"


def unit_settings() -> dict[str, list[str]]:
    """The unit's Key=value lines (comments dropped), values by key in file order."""
    settings: dict[str, list[str]] = {}
    for line in UNIT.read_text(encoding="utf-8").splitlines():
        if "=" in line and not line.lstrip().startswith(("#", ";", "[")):
            key, value = line.split("=", 1)
            settings.setdefault(key.strip(), []).append(value.strip())
    return settings


def test_unit_runs_the_pyz_with_system_python_and_waits_for_a_clean_stop():
    settings = unit_settings()
    assert settings["ExecStart"] == [
        "/usr/bin/python3 /opt/healthlog/healthlog.pyz serve --data /var/lib/healthlog"]
    assert settings["Type"] == ["exec"]  # not notify: serve sends no READY=1
    assert settings["StateDirectory"] == ["healthlog"]
    assert settings["KillSignal"] == ["SIGTERM"]
    assert settings["Restart"] == ["on-failure"]
    assert int(settings["TimeoutStopSec"][0]) >= 2 * FOLD_STOP_BUDGET_S
    for hardening in ("NoNewPrivileges", "ProtectSystem", "ProtectHome", "PrivateTmp",
                      "RestrictAddressFamilies"):
        assert hardening in settings, hardening


def test_unit_passes_systemd_analyze_verify():
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze is not installed")
    result = run([analyze, "verify", UNIT])
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert "healthlog.service" not in output, output  # no warnings about the unit
