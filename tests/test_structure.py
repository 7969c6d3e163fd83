"""healthlog.py reads top-down: its sections, in the order of their banners, use only what
the sections above them (or they themselves) define, and the module docstring's map lists
the same sections in the same order.

A *section* starts at a banner (a comment line of ``=`` signs, a title line, another line
of ``=`` signs). A *reference* is any module-level name read by a top-level statement, at
import time (a decorator, a default value, a class body) or at call time (inside a function
or method), that is not bound locally where it is read; annotations are not references
(the module has ``from __future__ import annotations``). The last section holds the page's
HTML, CSS and script as string constants: data that the web app reads, kept last so that
the program reads without it; it may be referred to from above, and must define nothing but
constants (and end with the ``__main__`` guard).

The Cheroot adapter (``_make_server_classes``) is the only code that relies on Cheroot's
internals; ``CHEROOT_INTERNALS`` names them, and each is checked when the server is built.
"""

import ast
import builtins
import functools
import io
import re
import tokenize
import types

import pytest

import healthlog
from conftest import ROOT

SOURCE = (ROOT / "healthlog.py").read_text()
BANNER = re.compile(r"^# =+\n# (.+)\n# =+$", re.M)


@functools.lru_cache(maxsize=1)
def module_tree() -> ast.Module:
    """healthlog.py parsed once for all the tests here (a parse is half a second of CPU);
    they only read the tree."""
    return ast.parse(SOURCE)


def sections() -> list:
    """[(first line, title)] of every banner, in file order (lines are 1-based)."""
    return [(SOURCE.count("\n", 0, m.start()) + 3, m.group(1)) for m in BANNER.finditer(SOURCE)]


def section_index(line: int, starts: list) -> int:
    index = -1
    for number, (first, _) in enumerate(starts):
        if first <= line:
            index = number
    return index


def top_level_names(node: ast.stmt) -> list:
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return [node.name]
    targets = []
    if isinstance(node, ast.Assign):
        targets = node.targets
    elif isinstance(node, (ast.AnnAssign, ast.AugAssign)):
        targets = [node.target]
    return [n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)]


class References(ast.NodeVisitor):
    """The module-level names a top-level statement reads, with the line of each read;
    names bound in a function (parameters, assignments, loop and ``with`` targets,
    imports, nested definitions, comprehension variables) are that function's own."""

    def __init__(self, module_names: set):
        self.module_names = module_names
        self.scopes: list = []
        self.found: list = []

    # Annotations are strings at run time: skip them.
    def visit_arg(self, node: ast.arg) -> None:
        pass

    def visit_AnnAssign(self, node: ast.AnnAssign) -> None:
        if node.value is not None:
            self.visit(node.value)
        self.visit(node.target)

    def _function(self, node) -> None:
        for decorator in node.decorator_list:
            self.visit(decorator)
        for default in node.args.defaults + [d for d in node.args.kw_defaults if d]:
            self.visit(default)
        self.scopes.append(bound_in(node))
        for statement in node.body:
            self.visit(statement)
        self.scopes.pop()

    visit_FunctionDef = visit_AsyncFunctionDef = _function

    def visit_Lambda(self, node: ast.Lambda) -> None:
        self.scopes.append(bound_in(node))
        self.visit(node.body)
        self.scopes.pop()

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        for expression in node.decorator_list + node.bases + [k.value for k in node.keywords]:
            self.visit(expression)
        for statement in node.body:
            self.visit(statement)

    def visit_Name(self, node: ast.Name) -> None:
        if (isinstance(node.ctx, ast.Load) and node.id in self.module_names
                and not any(node.id in scope for scope in self.scopes)):
            self.found.append((node.id, node.lineno))


def bound_in(function) -> set:
    """The names a function (or lambda) binds, anywhere in its body."""
    names = set()
    arguments = function.args
    for arg in (arguments.posonlyargs + arguments.args + arguments.kwonlyargs
                + [a for a in (arguments.vararg, arguments.kwarg) if a]):
        names.add(arg.arg)
    body = function.body if isinstance(function.body, list) else [function.body]
    globals_: set = set()
    for statement in body:
        for node in ast.walk(statement):
            if isinstance(node, ast.Name) and isinstance(node.ctx, (ast.Store, ast.Del)):
                names.add(node.id)
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                names.update((a.asname or a.name).split(".")[0] for a in node.names)
            elif isinstance(node, ast.ExceptHandler) and node.name:
                names.add(node.name)
            elif isinstance(node, ast.Global):
                globals_.update(node.names)
    return names - globals_


def forward_references() -> list:
    """(reader, section, name, its section, line) for every name read above its section."""
    starts = sections()
    tree = module_tree()
    home: dict = {}
    for node in tree.body:
        for name in top_level_names(node):
            home.setdefault(name, section_index(node.lineno, starts))
    data_section = len(starts) - 1
    out = []
    for node in tree.body:
        here = section_index(node.lineno, starts)
        visitor = References(set(home) - set(dir(builtins)))
        visitor.visit(node)
        for name, line in visitor.found:
            there = home[name]
            if there > here and there != data_section:
                out.append((getattr(node, "name", "line %d" % node.lineno), starts[here][1],
                            name, starts[there][1], line))
    return out


def test_every_section_uses_only_what_is_defined_above_it():
    found = forward_references()
    assert not found, "names read above the section that defines them:\n" + "\n".join(
        "  %s (line %d, in '%s') reads %s from the later section '%s'"
        % (reader, line, section, name, there) for reader, section, name, there, line in found)


UNITS = {"US"}
"""Numbers that are units (microseconds in a second), not tunings: they may stay in their
section however many read them."""


@functools.lru_cache(maxsize=1)
def numeric_constants() -> dict:
    """{name: its section} of every module-level UPPER_CASE name bound to a number, or a
    tuple of numbers, that the module computes without calling anything of its own."""
    starts = sections()
    out = {}
    for node in module_tree().body:
        if not isinstance(node, (ast.Assign, ast.AnnAssign)) or node.value is None:
            continue
        try:
            value = eval(compile(ast.Expression(node.value), "constant", "eval"), {})
        except Exception:  # it reads a name: not a plain number
            continue
        values = value if isinstance(value, tuple) else (value,)
        if values and all(type(v) in (int, float) for v in values):
            for name in top_level_names(node):
                if re.fullmatch(r"_?[A-Z][A-Z0-9_]*", name):
                    out[name] = section_index(node.lineno, starts)
    return out


def test_a_number_two_sections_read_is_in_the_constants_section():
    """The module map's promise: section 1 holds every tunable number that two sections
    read; one that a single section reads stands in that section."""
    starts, constants = sections(), numeric_constants()
    assert {"FOLD_ATTEMPTS_MAX", "GZIP_LEVEL", "SESSION_MAX_AGE_S"} <= set(constants)
    readers: dict = {}
    for node in module_tree().body:
        visitor = References(set(constants))
        visitor.visit(node)
        for name, line in visitor.found:
            readers.setdefault(name, set()).add(section_index(line, starts))
    misplaced = sorted("%s (in '%s', read in %s)" % (
        name, starts[home][1], ", ".join("'%s'" % starts[s][1] for s in sorted(readers[name])))
        for name, home in constants.items()
        if home != 0 and name not in UNITS and readers.get(name, set()) - {home})
    assert not misplaced, "move to the Constants section:\n  " + "\n  ".join(misplaced)


SHARED_NUMBERS = "# Read by more than one section below"


def test_the_constants_said_to_be_shared_are_read_by_two_sections():
    """Section 1 holds serve's defaults and limits first, then, after the comment that
    says so, the numbers that more than one section reads: each of those is."""
    starts = sections()
    first_shared = SOURCE.count("\n", 0, SOURCE.index(SHARED_NUMBERS)) + 1
    tree = module_tree()
    constants = numeric_constants()
    shared = {name for node in tree.body
              if node.lineno > first_shared and section_index(node.lineno, starts) == 0
              for name in top_level_names(node) if name in constants}
    assert {"GZIP_LEVEL", "FOLD_ATTEMPTS_MAX", "MAX_OFFSET_S"} <= shared
    readers: dict = {}
    for node in tree.body:
        visitor = References(shared)
        visitor.visit(node)
        for name, line in visitor.found:
            readers.setdefault(name, set()).add(section_index(line, starts))
    alone = sorted(name for name in shared if len(readers.get(name, ())) < 2)
    assert not alone, "read by one section only (move to its part): %s" % alone


def test_the_last_section_is_data_only():
    """Constants, then the ``if __name__ == "__main__"`` guard, which must come after
    every definition (running the module calls main() there)."""
    starts = sections()
    tree = module_tree()
    last = [node for node in tree.body if node.lineno >= starts[-1][0]]
    assert last, "the page assets section is empty"
    guard = last.pop()
    assert isinstance(guard, ast.If) and ast.unparse(guard.test) == "__name__ == '__main__'"
    for node in last:
        assert isinstance(node, (ast.Assign, ast.AnnAssign)) or (
            isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)), (
            "line %d: the last section (%s) holds constants only" % (node.lineno, starts[-1][1]))


def test_the_docstring_map_lists_the_sections_in_order():
    """The module docstring's map names each section by the title's words before the
    colon, in banner order."""
    docstring = ast.get_docstring(module_tree())
    map_text = docstring.split("Sections, top-down", 1)[1]
    listed = re.findall(r"^\s*\d+\.\s+(.+?)\s+[-—]", map_text, re.M)
    titles = [title.split(":", 1)[0] for _, title in sections()]
    assert listed == titles


# -- Names ------------------------------------------------------------------------------


def module_level_names(tree: ast.Module) -> set:
    """Every name the module binds at its top level: definitions, assignments, imports
    (``field as _field`` binds ``_field``), and those bound inside a top-level ``if`` or
    ``try`` (an optional import and its fallback)."""
    names = set()
    for node in tree.body:
        names.update(top_level_names(node))
        for inner in ast.walk(node) if isinstance(node, (ast.If, ast.Try)) else [node]:
            if isinstance(inner, (ast.Import, ast.ImportFrom)):
                names.update((a.asname or a.name).split(".")[0] for a in inner.names)
            elif isinstance(node, (ast.If, ast.Try)) and isinstance(inner, ast.Name) and (
                    isinstance(inner.ctx, ast.Store)):
                names.add(inner.id)
    return names


class Hiding(ast.NodeVisitor):
    """The local bindings that hide a module-level name: in every function and lambda,
    its parameters, assignment targets (plain, augmented, annotated, ``:=``), ``for``,
    ``with`` and ``except`` targets, nested definitions; and every comprehension's
    variables, wherever it stands.  A class body's names are attributes, read through
    ``self`` or the class, and hide nothing; an ``import`` inside a function binds the
    very module the module's own import does."""

    def __init__(self, module_names: set):
        self.module_names = module_names
        self.functions: list = []
        self.found: list = []

    def _hides(self, name: str, line: int, how: str) -> None:
        if name in self.module_names and not (
                self.functions and name in self.functions[-1][1]):
            where = self.functions[-1][0] if self.functions else "a comprehension"
            self.found.append((line, name, how, where))

    def _function(self, node) -> None:
        for expression in (getattr(node, "decorator_list", []) + node.args.defaults
                           + [d for d in node.args.kw_defaults if d]):
            self.visit(expression)
        if self.functions and not isinstance(node, ast.Lambda):
            self._hides(node.name, node.lineno, "nested definition")
        declared = {name for inner in ast.walk(node) if isinstance(inner, ast.Global)
                    for name in inner.names}
        self.functions.append((getattr(node, "name", "lambda"), declared))
        arguments = node.args
        for arg in (arguments.posonlyargs + arguments.args + arguments.kwonlyargs
                    + [a for a in (arguments.vararg, arguments.kwarg) if a]):
            self._hides(arg.arg, arg.lineno, "parameter")
        for statement in node.body if isinstance(node.body, list) else [node.body]:
            self.visit(statement)
        self.functions.pop()

    visit_FunctionDef = visit_AsyncFunctionDef = visit_Lambda = _function

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        if self.functions:
            self._hides(node.name, node.lineno, "nested definition")
        outer, self.functions = self.functions, []  # a class body binds attributes
        self.generic_visit(node)
        self.functions = outer

    def visit_Name(self, node: ast.Name) -> None:
        if self.functions and isinstance(node.ctx, (ast.Store, ast.Del)):
            self._hides(node.id, node.lineno, "assignment")

    def visit_ExceptHandler(self, node: ast.ExceptHandler) -> None:
        if node.name and self.functions:
            self._hides(node.name, node.lineno, "except target")
        self.generic_visit(node)

    def visit_comprehension(self, node: ast.comprehension) -> None:
        for name in ast.walk(node.target):
            if isinstance(name, ast.Name):
                self._hides(name.id, name.lineno, "comprehension variable")
        self.visit(node.iter)
        for condition in node.ifs:
            self.visit(condition)


def hidden_names(source: str) -> list:
    return hidden_in(ast.parse(source))


def hidden_in(tree: ast.Module) -> list:
    visitor = Hiding(module_level_names(tree))
    visitor.visit(tree)
    return sorted(visitor.found)


def test_no_local_name_hides_a_module_level_one():
    """A reader who meets ``deliveries`` or ``field`` inside a function finds the module's
    function or import of that name, not a local that hides it."""
    found = hidden_in(module_tree())
    assert not found, "local names that hide module-level ones:\n" + "\n".join(
        "  line %d: %s (%s, in %s)" % entry for entry in found)


@pytest.mark.parametrize("code, name", [
    ("def deliveries(): pass\ndef f(deliveries): pass", "deliveries"),
    ("def deliveries(): pass\ndef f():\n    deliveries = 1", "deliveries"),
    ("X = 1\ndef f():\n    for X in (): pass", "X"),
    ("X = 1\ndef f():\n    return [1 for X in ()]", "X"),
    ("X = 1\nY = [X for X in ()]", "X"),
    ("import io\ndef f():\n    with open('x') as io: pass", "io"),
    ("from dataclasses import field\ndef f():\n    try: pass\n    except Exception as field:"
     " pass", "field"),
    ("X = 1\ndef f():\n    g = lambda X: X", "X"),
    ("X = 1\ndef f():\n    def X(): pass", "X"),
    ("try:\n    import orjson as J\nexcept ImportError:\n    J = None\ndef f(J): pass", "J"),
])
def test_the_hiding_check_sees_each_kind_of_binding(code, name):
    assert [entry[1] for entry in hidden_names(code)] == [name]


@pytest.mark.parametrize("code", [
    "X = 1\nclass C:\n    X = 2",  # an attribute
    "import json\ndef f():\n    import json",  # the same module
    "X = 1\ndef f():\n    global X\n    X = 2",  # the module's own name
    "def f(x):\n    y = x",
])
def test_the_hiding_check_leaves_what_hides_nothing(code):
    assert hidden_names(code) == []


def test_each_module_level_name_is_defined_once():
    """One name, one definition: a second ``def`` of a name silently replaces the first
    for every caller, however far apart the two stand."""
    seen: dict = {}
    for node in module_tree().body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef,
                             ast.Assign, ast.AnnAssign)):
            for name in top_level_names(node):
                seen.setdefault(name, []).append(node.lineno)
    twice = {name: lines for name, lines in seen.items() if len(lines) > 1}
    assert not twice, "defined more than once (name: lines): %s" % twice


def backslash_continuations(source: str) -> list:
    """Lines of ``source`` that go on to the next after a backslash, outside strings."""
    in_strings = set()
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if tokenize.tok_name[token.type] in ("STRING", "FSTRING_MIDDLE", "TSTRING_MIDDLE"):
            in_strings.update(range(token.start[0], token.end[0]))
    return [number for number, line in enumerate(source.splitlines(), 1)
            if line.endswith("\\") and number not in in_strings]


def test_lines_continue_inside_brackets_never_after_a_backslash():
    assert backslash_continuations("x = 1 + \\\n    2\n") == [1]
    assert backslash_continuations('x = """a \\\nb"""\ny = (1 +\n     2)\n') == []
    for name in ("healthlog.py", "build_zipapp.py"):
        found = backslash_continuations((ROOT / name).read_text())
        assert not found, "%s: a backslash continues lines %s" % (name, found)


# -- The Cheroot adapter ----------------------------------------------------------------


def test_the_installed_cheroot_has_what_the_adapter_relies_on():
    from cheroot import makefile, server, wsgi

    assert healthlog.cheroot_missing(makefile, server, wsgi) == []


def _without(which: str) -> tuple:
    """(makefile, server, wsgi) as Cheroot's, but for the one internal named ``which``."""
    from cheroot import makefile, server, wsgi

    fake = {"makefile": dict(vars(makefile)), "server": dict(vars(server)),
            "wsgi": dict(vars(wsgi))}

    def plain_init(self):
        self.other = None

    if which == "has_data":
        fake["makefile"]["StreamReader"] = type("StreamReader", (io.BufferedReader,), {})
    elif which == "base":
        fake["makefile"]["StreamReader"] = type("StreamReader", (object,),
                                                {"has_data": lambda self: False})
    elif which == "connection":
        fake["server"]["HTTPConnection"] = type("HTTPConnection", (), {"__init__": plain_init,
                                                                       "rbufsize": 8192})
    elif which == "request":
        fake["server"]["HTTPRequest"] = type("HTTPRequest", (), {"__init__": plain_init})
    elif which == "server":
        fake["wsgi"]["Server"] = type("Server", (), {"prepare": lambda self: None})
    elif which == "gateway":
        fake["server"]["Gateway"] = type("Gateway", (), {"__init__": plain_init})
    return tuple(types.SimpleNamespace(**fake[name]) for name in ("makefile", "server", "wsgi"))


@pytest.mark.parametrize("which, entry", [
    ("has_data", 0), ("base", 1), ("connection", 2), ("request", 3), ("server", 4),
    ("gateway", 5)])
def test_each_cheroot_internal_is_checked(which, entry):
    missing = healthlog.cheroot_missing(*_without(which))
    assert missing == [healthlog.CHEROOT_INTERNALS[entry][0]]


def test_a_cheroot_without_them_stops_serve_naming_the_adapter(monkeypatch):
    from cheroot import makefile

    monkeypatch.setattr(makefile, "StreamReader",
                        type("StreamReader", (io.BufferedReader,), {}))
    with pytest.raises(healthlog.ConfigError) as raised:
        healthlog._make_server_classes()
    message = str(raised.value)
    assert "Cheroot adapter (_make_server_classes)" in message
    assert "makefile.StreamReader.has_data" in message and "cheroot==11.1.2" in message
