"""The generated pages of the docs, written from the code so that they cannot drift from it.

``python -m experiments.docsgen`` writes

* ``docs/reference/configuration.md``: every key of a job config (the frozen dataclasses of
  ``harness/config.py`` and ``harness/program_config.py``) and of an experiment file
  (``experiments/spec.py``, with the schedules, targets and fault kinds of ``faults/``): its
  type, its default and its documentation, taken from the class docstrings and from the comments
  on and above each field;
* ``docs/BENCHMARKS.md``: from the saved bench runs (``experiments.bench.publish``).

``--check`` writes nothing and exits 1 if a page differs from what would be written (the docs
test does the same). Edit the code's docstrings and comments, never the generated pages.

Not guaranteed: a field documented nowhere (no docstring mention, no comment) gets an empty
description; the generator does not invent one.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import io
import json
import re
import sys
import textwrap
import tokenize
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

from experiments import module_index
from experiments import spec as experiment_spec
from experiments.bench import publish
from faults import fault as fault_module
from faults.fault import fault_class, fault_kinds
from faults.schedule import ScheduleSpec
from faults.targets import KeepAlive, TargetSpec
from harness import config as job_config
from harness.config import JobConfig

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
CONFIG_PAGE = Path("reference/configuration.md")

# -- reStructuredText docstrings and comments -> Markdown ---------------------------------------

_ROLE = re.compile(r":(?:class|func|meth|data|attr|mod|exc):`~?([^`]+)`")
_LITERAL = re.compile(r"``(.+?)``", re.DOTALL)


def _inline(text: str) -> str:
    """reST inline markup to Markdown; ``<`` and ``|`` escaped outside code spans."""
    text = _LITERAL.sub(r"`\1`", _ROLE.sub(r"`\1`", text))
    parts = text.split("`")
    for i in range(0, len(parts), 2):  # the even parts are outside code spans
        parts[i] = parts[i].replace("<", "&lt;").replace("|", "&#124;")
    return "`".join(parts)


def rst_to_md(doc: str) -> str:
    """A docstring (reST as this project writes it) as Markdown: inline literals and roles, and
    ``::`` literal blocks as fenced code."""
    out: list[str] = []
    prose: list[str] = []  # converted together: a literal may span lines

    def flush() -> None:
        if prose:
            out.extend(_inline("\n".join(prose)).split("\n"))
            prose.clear()

    lines = textwrap.dedent(doc).strip("\n").splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        i += 1
        if not line.rstrip().endswith("::"):
            prose.append(line)
            continue
        head = line.rstrip()[:-2].rstrip()
        if head:
            prose.append(head + ":")
        flush()
        block: list[str] = []
        while i < len(lines) and (not lines[i].strip() or lines[i].startswith((" ", "\t"))):
            block.append(lines[i])
            i += 1
        code = textwrap.dedent("\n".join(block)).strip("\n").splitlines()
        out += ["", "```", *code, "```", ""]
    flush()
    return "\n".join(out).strip() + "\n"


def _one_line(text: str) -> str:
    return _inline(" ".join(text.split()))


# -- what the source says about each field ------------------------------------------------------


def field_comments(cls: type) -> dict[str, str]:
    """Field name -> the comment block right above the field plus the comment on its line."""
    source = textwrap.dedent(inspect.getsource(cls))
    lines = source.splitlines()
    trailing: dict[int, str] = {}
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT and lines[tok.start[0] - 1][: tok.start[1]].strip():
            trailing[tok.start[0]] = tok.string.lstrip("#").strip()
    out: dict[str, str] = {}
    classdef = ast.parse(source).body[0]
    assert isinstance(classdef, ast.ClassDef)
    for node in classdef.body:
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        above: list[str] = []
        j = node.lineno - 2
        while j >= 0 and lines[j].strip().startswith("#"):
            above.insert(0, lines[j].strip().lstrip("#").strip())
            j -= 1
        parts = [" ".join(above), trailing.get(node.end_lineno or node.lineno, "")]
        out[node.target.id] = " ".join(p for p in parts if p)
    return out


def type_text(tp: Any) -> str:
    """An annotation as a TOML user reads it."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is Literal:
        return "one of " + ", ".join(f"`{json.dumps(a)}`" for a in args)
    if origin in (types.UnionType, typing.Union):
        rest = [type_text(a) for a in args if a is not type(None)]
        return " or ".join(rest) + (" (optional)" if type(None) in args else "")
    if origin is tuple:
        if len(args) == 2 and args[1] is Ellipsis:
            return f"list of {type_text(args[0])}"
        kinds = {type_text(a) for a in args}
        return f"list of {len(args)} {kinds.pop()}" if len(kinds) == 1 else "list"
    if origin in (frozenset, set, list):
        return f"list of {type_text(args[0])}"
    if origin in (dict, Mapping) or origin is getattr(typing, "Mapping", None):
        return f"table of {type_text(args[1])}"
    if dataclasses.is_dataclass(tp):
        return "table"
    names = {int: "integer", float: "number", str: "string", bool: "true or false", Path: "path"}
    return names.get(tp, getattr(tp, "__name__", str(tp)))


def toml_value(v: Any) -> str:
    """A default as it would be written in TOML (None: unset)."""
    if v is None:
        return "unset"
    if isinstance(v, bool):
        return "`true`" if v else "`false`"
    if isinstance(v, str | Path):
        return f"`{json.dumps(str(v))}`"
    if isinstance(v, int | float):
        return f"`{v!r}`"
    if isinstance(v, tuple | list | frozenset | set):
        items = sorted(v) if isinstance(v, frozenset | set) else list(v)
        return "`[" + ", ".join(toml_value(x).strip("`") for x in items) + "]`"
    if isinstance(v, Mapping):
        inner = ", ".join(f"{k} = {toml_value(x).strip('`')}" for k, x in v.items())
        return f"`{{ {inner} }}`" if inner else "`{}`"
    return f"`{v!r}`"


def default_of(f: dataclasses.Field[Any]) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return dataclasses.MISSING


def slug(heading: str) -> str:
    """The anchor of a heading, as Python-Markdown's toc (mkdocs) and GitHub both make it."""
    return re.sub(r"[-\s]+", "-", re.sub(r"[^\w\s-]", "", heading).strip().lower())


def _row(key: str, tp: Any, default: Any, doc: str) -> list[str]:
    if default is dataclasses.MISSING:
        shown = "required"
    elif dataclasses.is_dataclass(default):
        shown = f"[`[{key}]`](#{slug(f'[{key}]')})"
    else:
        shown = toml_value(default)
    return [f"`{key}`", type_text(tp), shown, _one_line(doc)]


def _table(rows: Sequence[Sequence[str]]) -> list[str]:
    """Rows of key, type, default and description; no description column if all are empty."""
    if not any(r[3] for r in rows):
        head = ["| key | type | default |", "|---|---|---|"]
        return [*head, *("| " + " | ".join(r[:3]) + " |" for r in rows), ""]
    head = ["| key | type | default | description |", "|---|---|---|---|"]
    return [*head, *("| " + " | ".join(r) + " |" for r in rows), ""]


def _class_doc(cls: type) -> list[str]:
    """The class docstring, then where the class is."""
    doc = inspect.getdoc(cls) or ""
    where = inspect.getsourcefile(cls)
    source = Path(where).resolve().relative_to(ROOT) if where else "?"
    intro = [rst_to_md(doc).rstrip("\n"), ""] if doc else []
    return [*intro, f"*`{cls.__name__}` in `{source}`.*", ""]


def dataclass_rows(
    cls: type, prefix: str, keys: Sequence[str] | None = None, skip: Sequence[str] = ()
) -> list[list[str]]:
    """One row per field of ``cls`` (or per name in ``keys``, each of which must be a field)."""
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    notes = field_comments(cls)
    names = list(keys) if keys is not None else [n for n in fields if n not in skip]
    rows = []
    for name in names:
        if name not in fields:
            raise ValueError(f"{cls.__name__} has no field {name!r}: the reference would drift")
        f = fields[name]
        rows.append(_row(prefix + name, hints[name], default_of(f), notes.get(name, "")))
    return rows


# -- the job config -----------------------------------------------------------------------------


def _job_sections() -> list[str]:
    hints = typing.get_type_hints(JobConfig)
    fields = dataclasses.fields(JobConfig)
    sections = [f for f in fields if dataclasses.is_dataclass(hints[f.name])]
    plain = [f.name for f in fields if f not in sections]
    rows = dataclass_rows(JobConfig, "", keys=plain)
    links = ", ".join(f"[`[{f.name}]`](#{slug(f.name)})" for f in sections)
    out = [
        "## Job config",
        "",
        rst_to_md(inspect.getdoc(job_config) or "").rstrip("\n"),
        "",
        "### Top level",
        "",
        *_class_doc(JobConfig),
        f"Sections: {links}.",
        "",
    ]
    out += _table(rows)
    for f in sections:
        cls = hints[f.name]
        out += [f"### [{f.name}]", "", *_class_doc(cls), *_table(dataclass_rows(cls, f.name + "."))]
        inner = typing.get_type_hints(cls)
        for g in dataclasses.fields(cls):  # a table inside a section: its own section after it
            if dataclasses.is_dataclass(inner[g.name]):
                key, sub = f"{f.name}.{g.name}", inner[g.name]
                out += [
                    f"### [{key}]",
                    "",
                    *_class_doc(sub),
                    *_table(dataclass_rows(sub, key + ".")),
                ]
    return out


# -- the experiment file ------------------------------------------------------------------------


def _example_comments(doc: str) -> dict[str, str]:
    """Top-level ``key = value  # comment`` lines of the example in a module docstring."""
    out = {}
    for line in doc.splitlines():
        stripped = line.strip()
        if stripped.startswith("["):
            break
        m = re.match(r"(\w+)\s*=.*?#\s*(.+)$", stripped)
        if m:
            out[m.group(1)] = m.group(2)
    return out


def _experiment_sections() -> list[str]:
    spec = experiment_spec
    doc = inspect.getdoc(spec) or ""
    example = _example_comments(doc)
    hints = typing.get_type_hints(spec.ExperimentSpec)
    fields = {f.name: f for f in dataclasses.fields(spec.ExperimentSpec)}
    notes = field_comments(spec.ExperimentSpec)
    sections = {"schedule", "faults", "targets", "hypotheses"}
    rows = []
    for key in spec.TOP_KEYS:
        if key in sections:
            rows.append([f"`{key}`", "table", f"[`[{key}]`](#{slug(key)})", ""])
            continue
        note = notes.get(key) or example.get(key, "")
        if key == "job":  # parsed into job_path (a file) or job_table (inline)
            rows.append([f"`{key}`", "string or table", "required", _one_line(note)])
            continue
        if key not in fields:
            raise ValueError(f"experiment key {key!r} has no ExperimentSpec field")
        rows.append(_row(key, hints[key], default_of(fields[key]), note))
    out = [
        "## Experiment file",
        "",
        rst_to_md(doc).rstrip("\n"),
        "",
        "*`experiments/spec.py`.*",
        "",
        "### Top level",
        "",
        "`duration_s` or `steps` (or both) is required.",
        "",
        *_table(rows),
        "### [schedule]",
        "",
        *_class_doc(ScheduleSpec),
        *_table(dataclass_rows(ScheduleSpec, "schedule.", keys=spec.SCHEDULE_KEYS)),
        "### [targets]",
        "",
        *_class_doc(TargetSpec),
        *_table(dataclass_rows(TargetSpec, "targets.", keys=spec.TARGETS_KEYS)),
        "### [targets.keep_alive]",
        "",
        *_class_doc(KeepAlive),
        *_table(dataclass_rows(KeepAlive, "targets.keep_alive.", keys=spec.KEEP_ALIVE_KEYS)),
    ]
    return out + _hypotheses() + _faults()


def _hypotheses() -> list[str]:
    spec = experiment_spec
    rows = dataclass_rows(spec.Hypotheses, "hypotheses.", keys=spec.BOOL_HYPOTHESES)
    policies = ", ".join(f"`{p}`" for p in spec.RECOVERY_POLICIES)
    for name, claim in spec.THRESHOLD_HYPOTHESES.items():
        kind = f"number, or a table of policy ({policies} or `*`) = number"
        rows.append([f"`hypotheses.{name}`", kind, "unset", _one_line(claim)])
    return ["### [hypotheses]", "", *_class_doc(spec.Hypotheses), *_table(rows)]


def _faults() -> list[str]:
    spec = experiment_spec
    # the project's own kinds: a test may register one of its own in the same interpreter
    kinds = [k for k in fault_kinds() if fault_class(k).__module__.startswith("faults.")]
    keys = ", ".join(f"`faults.{k}`" for k in spec.FAULTS_KEYS)
    out = [
        "### [faults]",
        "",
        *_class_doc(spec.FaultMix),
        f"Keys: {keys}. `faults.mix` is a table of fault kind = relative weight (a number > 0, "
        "required, at least one kind); `faults.options.KIND` a table of that kind's options "
        "below. The kinds are registered in `faults/` (`faults.fault.register`).",
        "",
        *_hold_s_doc(),
        "| kind | hits by default | needs | options |",
        "|---|---|---|---|",
    ]
    for kind in kinds:
        cls = fault_class(kind)
        needs = []
        if getattr(cls, "needs_network", False):
            needs.append('hosts with a network of their own (`launcher = "netns"`)')
        if getattr(cls, "needs_launcher", None):
            needs.append(f'`launcher = "{cls.needs_launcher}"`')
        if getattr(cls, "needs_takeover", False):
            needs.append("a job a new controller can take over ([controller](../controller.md))")
        options = ", ".join(f"`{f.name}`" for f in dataclasses.fields(cls))
        out.append(
            f"| [`{kind}`](#{slug(kind)}) | {cls.default_target} | "
            f"{'; '.join(needs) or DASH} | {options} |"
        )
    out.append("")
    for kind in kinds:
        cls = fault_class(kind)
        out += [f"#### {kind}", "", *_class_doc(cls)]
        out += _table(dataclass_rows(cls, f"faults.options.{kind}."))
    return out


DASH = "\u2013"


def _hold_s_doc() -> list[str]:
    """The paragraph of ``faults.fault``'s docstring about a kind's options and ``hold_s``."""
    paragraphs = (inspect.getdoc(fault_module) or "").split("\n\n")
    found = [p for p in paragraphs if "``hold_s``" in p]
    return [_one_line(found[0]), ""] if found else []


def config_reference() -> str:
    """The whole of docs/reference/configuration.md."""
    lines = [
        "# Configuration reference",
        "",
        "<!-- Generated by `python -m experiments.docsgen` from harness/config.py, "
        "harness/program_config.py, experiments/spec.py and faults/; do not edit by hand. -->",
        "",
        "Every key of a job config and of an experiment file, with its type and default, "
        "generated from the frozen dataclasses that parse them. In TOML a dotted key `a.b` is "
        "`b` under the table `[a]`; on the command line it is `--set a.b=value`.",
        "",
        *_job_sections(),
        *_experiment_sections(),
    ]
    while lines and not lines[-1]:
        lines.pop()
    return "\n".join(lines) + "\n"


def generated(docs: Path = DOCS) -> dict[Path, Callable[[], str]]:
    """Every generated page -> the function that makes its text."""
    return {
        docs / CONFIG_PAGE: config_reference,
        docs / publish.PAGE: lambda: publish.render(docs),
        docs / module_index.PAGE: lambda: module_index.render(_inline),
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m experiments.docsgen",
        description="Write the generated pages of docs/ (configuration, modules, benchmarks).",
    )
    parser.add_argument("--docs", type=Path, default=DOCS, help="the docs folder (default: docs/)")
    parser.add_argument("--check", action="store_true", help="exit 1 if a page is out of date")
    args = parser.parse_args(argv)
    stale = []
    for path, make in generated(args.docs).items():
        text = make()
        if args.check:
            if not path.exists() or path.read_text(encoding="utf-8") != text:
                stale.append(path)
            continue
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
        print(f"docsgen: wrote {path}", file=sys.stderr)
    for path in stale:
        print(
            f"docsgen: {path} is out of date: run `python -m experiments.docsgen`", file=sys.stderr
        )
    return 1 if stale else 0


if __name__ == "__main__":
    sys.exit(main())
