"""The folder tree is the architecture: imports point one way and never form a cycle.

``runtime`` <- ``faults`` <- ``harness`` <- ``experiments``; ``dashboards`` reads the journal and
the telemetry names. Every import counts, at module level, inside functions and under
``TYPE_CHECKING`` alike: a cycle through any of them is a tangle a newcomer has to untie. So do
calls wired by a ``"module:function"`` string (what a worker or an agent imports by name): in
``runtime``, ``faults`` and ``harness`` such a string must name a function that exists, in a
package the writer may import. The CLI's subcommands are entry points (``pyproject.toml``), each
of which must name a real function too.
"""

from __future__ import annotations

import ast
import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("runtime", "faults", "harness", "experiments", "dashboards")
# What each package may import (besides itself).
ALLOWED = {
    "runtime": set(),
    "faults": {"runtime"},
    "dashboards": {"runtime"},
    "harness": {"runtime", "faults", "dashboards"},
    "experiments": {"runtime", "faults", "harness", "dashboards"},
}
MAX_LINES = 500  # "no module over 500 lines without a reason written at its top"
#: How a long module says why it is long: in its module docstring.
LONG_REASON = "Why this module is longer than 500 lines:"


def _modules() -> dict[str, Path]:
    """Every module of the project by dotted name; C extensions (built from ``NAME.c``) too."""
    out = {}
    for pkg in PACKAGES:
        for path in [*(ROOT / pkg).rglob("*.py"), *(ROOT / pkg).rglob("*.c")]:
            parts = path.relative_to(ROOT).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            out[name] = path
    return out


def _imports(path: Path, name: str, modules: dict[str, Path]) -> set[str]:
    """Project modules imported anywhere in the file (resolved to the longest known name)."""
    tree = ast.parse(path.read_text())
    is_pkg = path.name == "__init__.py"
    found: set[str] = set()

    def resolve(target: str) -> None:
        while target and target not in modules:
            target = target.rpartition(".")[0]
        if target and target != name:
            found.add(target)

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                resolve(alias.name)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = name.split(".") if is_pkg else name.split(".")[:-1]
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            for alias in node.names:
                full = f"{base}.{alias.name}"
                resolve(full if full in modules else base)
    return found


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {
        name: _imports(path, name, modules) if path.suffix == ".py" else set()
        for name, path in modules.items()
    }


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycles() -> None:
    assert _cycles(_graph()) == []


def test_cycle_detector_finds_a_cycle() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_imports_point_one_way() -> None:
    wrong = []
    for name, deps in _graph().items():
        pkg = name.split(".")[0]
        for dep in deps:
            other = dep.split(".")[0]
            if other != pkg and other not in ALLOWED[pkg]:
                wrong.append(f"{name} imports {dep}")
    assert wrong == []


def test_modules_stay_small() -> None:
    big = {
        name: n
        for name, path in _modules().items()
        if path.suffix == ".py"
        and (n := len((text := path.read_text()).splitlines())) > MAX_LINES
        and LONG_REASON not in (ast.get_docstring(ast.parse(text)) or "")
    }
    assert big == {}, f"over {MAX_LINES} lines with no '{LONG_REASON}' in the module docstring"


# -- calls wired by strings ---------------------------------------------------------------------

#: Where a ``"module:function"`` string must point one way and name something real.
WIRED = ("runtime", "faults", "harness")
_DOTTED = r"[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*"
_WIRE = re.compile(rf"({_DOTTED}):({_DOTTED})")
_WIRE_PREFIX = re.compile(rf"({_DOTTED}):")


def _wire_strings(tree: ast.AST) -> list[tuple[int, str, str | None]]:
    """``(line, module, qualname)`` of every string that is a whole ``"module:qualname"``, and of
    every f-string that starts with ``"module:"`` (qualname None: computed at run time)."""
    found: list[tuple[int, str, str | None]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            if m := _WIRE.fullmatch(node.value):
                found.append((node.lineno, m.group(1), m.group(2)))
        elif isinstance(node, ast.JoinedStr) and node.values:
            head = node.values[0]
            m = _WIRE_PREFIX.match(head.value) if isinstance(head, ast.Constant) else None
            if m and m.end() == len(head.value):  # "pkg.mod:{name}", not "report: {text}"
                found.append((node.lineno, m.group(1), None))
    return found


def _defines(path: Path, qualname: str) -> bool:
    """Whether the module at ``path`` defines ``qualname`` (a top-level name, or a name in a
    class's body for ``Class.attr``), read from its source without importing it."""
    if path.suffix != ".py":
        return True  # a C extension: its names are not in a source we can read
    body: list[ast.stmt] = ast.parse(path.read_text()).body
    for part in qualname.split("."):
        names: dict[str, ast.stmt] = {}
        for node in body:
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                names[node.name] = node
            elif isinstance(node, ast.Assign | ast.AnnAssign):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                names.update({t.id: node for t in targets if isinstance(t, ast.Name)})
            elif isinstance(node, ast.Import | ast.ImportFrom):
                names.update({(a.asname or a.name).split(".")[0]: node for a in node.names})
        node = names.get(part)
        if node is None:
            return False
        body = node.body if isinstance(node, ast.ClassDef) else []
    return True


def _wire_problems(name: str, tree: ast.AST, modules: dict[str, Path]) -> list[str]:
    """What is wrong with the string-wired calls in module ``name``: a module of a package it may
    not import, one that does not exist, or a function the module does not define. Only names in
    the project's packages are checked: another's (``"os:getpid"``) is not part of the layering,
    and cannot be told apart from a string that is not a wire name (``"HOST:PORT"``)."""
    pkg = name.split(".")[0]
    wrong = []
    for line, module, qualname in _wire_strings(tree):
        top = module.split(".")[0]
        where = f"{name}:{line} {module}:{qualname or '{...}'}"
        if top not in PACKAGES:
            continue
        if top != pkg and top not in ALLOWED[pkg]:
            wrong.append(f"{where}: {pkg} may not name {top}")
        if module not in modules:
            wrong.append(f"{where}: no module {module}")
        elif qualname is not None and not _defines(modules[module], qualname):
            wrong.append(f"{where}: {module} has no {qualname}")
    return wrong


def test_string_wired_calls_point_one_way_and_name_real_functions() -> None:
    modules = _modules()
    wrong = []
    for name, path in modules.items():
        if name.split(".")[0] in WIRED and path.suffix == ".py":
            wrong += _wire_problems(name, ast.parse(path.read_text()), modules)
    assert wrong == []


def test_the_string_check_finds_each_kind_of_wrong_wire() -> None:
    source = """
ok = "faults.inworker:segfault"
up = "experiments.runner:main"
typo = "faults.inworker:segfaul"
gone = "faults.no_such_module:f"
computed = f"experiments.bench.{name}:main"
late = f"harness.rank.actors:{name}"
not_a_wire = ("HOST:PORT", f"report: {text}", "os:getpid")
"""
    modules = _modules()
    wrong = _wire_problems("faults.example", ast.parse(source), modules)
    assert [w.split(" ", 1)[1] for w in wrong] == [
        "experiments.runner:main: faults may not name experiments",
        "faults.inworker:segfaul: faults.inworker has no segfaul",
        "faults.no_such_module:f: no module faults.no_such_module",
        "harness.rank.actors:{...}: faults may not name harness",
    ], wrong


def test_cli_entry_points_name_real_functions_for_every_subcommand() -> None:
    """``harness/cli.py`` declares the subcommands and benches; ``pyproject.toml`` says what
    implements each. Both lists must agree, and each implementation must exist."""
    from harness import cli

    groups = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["entry-points"]
    commands, benches = groups[cli.COMMANDS_GROUP], groups[cli.BENCH_GROUP]
    sub = next(a for a in cli.build_parser()._actions if a.dest == "command")
    assert set(commands) == set(sub.choices) - {"bench"}
    assert set(benches) == set(cli._BENCH_HELP)
    modules = _modules()
    missing = []
    for value in [*commands.values(), *benches.values()]:
        module, _, func = value.partition(":")
        if module not in modules or not _defines(modules[module], func):
            missing.append(value)
    assert missing == []
