"""The folder tree is the architecture: imports point one way and never form a cycle.

``runtime`` <- ``faults`` <- ``harness`` <- ``experiments``; ``dashboards`` reads the journal and
the telemetry names. Every import counts, at module level, inside functions and under
``TYPE_CHECKING`` alike: a cycle through any of them is a tangle a newcomer has to untie.
"""

from __future__ import annotations

import ast
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
MAX_LINES = 650  # "no module over ~600 lines"


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
        if path.suffix == ".py" and (n := len(path.read_text().splitlines())) > MAX_LINES
    }
    assert big == {}
