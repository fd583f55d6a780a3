"""Benchmark figures published from the benches' own output, never typed by hand.

Every ``ftharness bench NAME`` prints a JSON object as its last line. This tool keeps one saved
run per bench and renders ``docs/BENCHMARKS.md`` from the saved runs::

    python -m experiments.bench.publish record NAME -- ARGS...   # run, show, save, render
    python -m experiments.bench.publish record NAME --as LABEL -- ARGS...  # a second saved run
    python -m experiments.bench.publish render [--check]         # docs/BENCHMARKS.md again

``record`` runs ``ftharness bench NAME ARGS...`` (as ``python -m harness``, with this
interpreter), shows its output as it runs, and saves ``docs/benchmarks/NAME.json`` =
``{command, machine, date, loadavg, duration_s, git, result}``: the machine (cores, memory, CPU
model, Python, torch and torchft versions, GPUs or none), the load average before and after, and
``result``, the parsed last line. A bench that exits non-zero or whose last line is not a JSON
object is not saved. Then it renders the page.

``render`` writes one section per saved run: the bench's one-line summary (the first sentence of
its module docstring, which also defines every figure), the command, the machine, the date, and
the figures as tables. The rendering is generic: scalars go into a key/value table, a list of
objects or an object of objects becomes one table (transposed when it has many more columns than
rows), and a ``{median, min, max, p95}`` object is one cell. Re-recording a bench replaces its
file; its history is git's (``git log -p docs/benchmarks/NAME.json``).

Not guaranteed: the figures are one run on one machine at one load; the page says which.
"""

from __future__ import annotations

import argparse
import ast
import datetime
import importlib.metadata
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
BENCH_DIR = Path(__file__).resolve().parent
PAGE = "BENCHMARKS.md"
SAVED = "benchmarks"
#: Keys of a summary-statistics object shown as one cell: "median (min-max, p95 x)".
STATS_KEYS = frozenset({"median", "p50", "mean", "p95", "p99", "min", "max", "n"})
#: A table with more columns than this (and than rows) is transposed: figures become rows.
MAX_COLUMNS = 7
#: Ranges and missing figures: an en dash.
DASH = "\u2013"


# -- recording ----------------------------------------------------------------------------------


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _read(path: str) -> str:
    try:
        return Path(path).read_text(encoding="utf-8", errors="replace")
    except OSError:
        return ""


def _gpus() -> list[str]:
    """``name, memory`` of each NVIDIA GPU (nvidia-smi), or an empty list."""
    if shutil.which("nvidia-smi") is None:
        return []
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return [line.strip() for line in out.splitlines() if line.strip()]


def machine() -> dict[str, Any]:
    """What the figures were measured on (read without importing torch)."""
    meminfo = [line.split() for line in _read("/proc/meminfo").splitlines()]
    mem_kb = next((int(f[1]) for f in meminfo if f[:1] == ["MemTotal:"] and len(f) > 1), 0)
    cpuinfo = [line.partition(":") for line in _read("/proc/cpuinfo").splitlines()]
    cpu = next(
        (value.strip() for key, _, value in cpuinfo if key.strip() == "model name"),
        platform.processor() or platform.machine(),
    )
    torchft = _version("torchft-nightly") or _version("torchft")
    return {
        "cores": os.cpu_count(),
        "memory_gib": round(mem_kb / 2**20, 1),
        "cpu": cpu,
        "os": f"{platform.system()} {platform.release()}",
        "python": platform.python_version(),
        "torch": _version("torch"),
        "torchft": torchft,
        "gpus": _gpus(),
    }


def _git() -> dict[str, Any] | None:
    """The commit measured, and whether the working tree had changes on top of it."""
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
            timeout=10, check=True,
        ).stdout.strip()  # fmt: skip
        status = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
            capture_output=True, text=True, timeout=10, check=True,
        ).stdout  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return None
    return {"commit": commit, "dirty": bool(status.strip())}


def _loadavg() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def run_streaming(argv: Sequence[str], out: Callable[[str], None]) -> tuple[int, str]:
    """Run ``argv``, passing each stdout line to ``out`` as it comes (stderr goes straight to
    ours); return the exit code and the last non-blank stdout line."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    last = ""
    with subprocess.Popen(
        list(argv), stdout=subprocess.PIPE, text=True, bufsize=1, env=env, cwd=ROOT
    ) as proc:
        assert proc.stdout is not None
        for line in proc.stdout:
            out(line)
            if line.strip():
                last = line.strip()
    return proc.returncode, last


class RecordError(RuntimeError):
    """A bench run that must not be published (failed, or no JSON object as its last line)."""


def record(
    name: str,
    args: Sequence[str],
    *,
    docs: Path = DOCS,
    argv: Sequence[str] | None = None,
    out: Callable[[str], None] = sys.stdout.write,
    save_as: str | None = None,
) -> Path:
    """Run bench ``name`` with ``args``, save ``docs/benchmarks/NAME.json`` (``SAVE_AS.json``
    when given: a second saved run of one bench, such as a subset of its rows at full size
    beside its quick run) and return its path. ``argv`` replaces the command actually run (tests
    run a stand-in bench); the saved ``command`` is always the ``ftharness bench`` one. Raises
    :class:`RecordError`."""
    for label in (name, save_as or name):
        if not label.replace("_", "").isalnum():
            raise RecordError(f"bench name {label!r}: letters, digits and _ only")
    command = ["ftharness", "bench", name, *args]
    run = list(argv) if argv is not None else [sys.executable, "-m", "harness", *command[1:]]
    load_before, started = _loadavg(), time.monotonic()
    date = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    rc, last = run_streaming(run, out)
    duration = round(time.monotonic() - started, 1)
    if rc != 0:
        raise RecordError(f"{' '.join(command)} exited with {rc}: not saved")
    try:
        result = json.loads(last)
    except json.JSONDecodeError:
        result = None
    if not isinstance(result, dict):
        raise RecordError(
            f"{' '.join(command)}: its last line is not a JSON object: {last[:200]!r}"
        )
    saved = {
        "bench": name,
        "command": " ".join(command),
        "machine": machine(),
        "date": date,
        "loadavg": {"before": load_before, "after": _loadavg()},
        "duration_s": duration,
        "git": _git(),
        "result": result,
    }
    path = docs / SAVED / f"{save_as or name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(saved, indent=2) + "\n", encoding="utf-8")
    return path


# -- rendering ----------------------------------------------------------------------------------


def bench_summaries(bench_dir: Path = BENCH_DIR) -> dict[str, str]:
    """Every bench by name -> the first sentence of its module docstring, for the modules whose
    docstring starts ``\\`\\`ftharness bench NAME\\`\\`: ...`` (read, not imported)."""
    out = {}
    for path in sorted(bench_dir.glob("*.py")):
        doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"))) or ""
        prefix = f"``ftharness bench {path.stem}``"
        if not doc.startswith(prefix):
            continue
        first = " ".join(doc[len(prefix) :].split("\n\n", 1)[0].split()).lstrip(":— -")
        sentence = first.split(". ", 1)[0].rstrip(".")
        out[path.stem] = sentence[:1].upper() + sentence[1:] + "."
    return out


def _num(v: float) -> str:
    if v == 0:
        return "0"
    a = abs(v)
    if a >= 1e4:
        return f"{v:.0f}"
    if a >= 100:
        return f"{v:.1f}"
    return f"{v:.4g}"


def _is_stats(v: Any) -> bool:
    return (
        isinstance(v, dict)
        and bool(v)
        and set(v) <= STATS_KEYS
        and bool(set(v) & {"median", "p50", "mean"})
        and all(x is None or isinstance(x, int | float) for x in v.values())
    )


def _is_cell(v: Any) -> bool:
    if v is None or isinstance(v, bool | int | float | str):
        return True
    if isinstance(v, list):
        return all(x is None or isinstance(x, bool | int | float | str) for x in v)
    return _is_stats(v)


def cell(v: Any) -> str:
    """One table cell: numbers rounded for reading, stats as ``median (min-max, p95 x)``."""
    if v is None:
        return DASH
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        return _num(v)
    if isinstance(v, str):
        return v.replace("|", "&#124;").replace("<", "&lt;").replace("\n", " ")
    if isinstance(v, list):
        return ", ".join(cell(x) for x in v) or DASH
    if _is_stats(v):
        mid = next(v[k] for k in ("median", "p50", "mean") if k in v)
        extra = []
        if v.get("min") is not None and v.get("max") is not None:
            extra.append(f"{cell(v['min'])}{DASH}{cell(v['max'])}")
        elif v.get("max") is not None:
            extra.append(f"max {cell(v['max'])}")
        for k in ("p95", "p99", "n"):
            if v.get(k) is not None:
                extra.append(f"{k} {cell(v[k])}")
        return cell(mid) + (f" ({', '.join(extra)})" if extra else "")
    return f"{len(v)} items"  # a nested structure too deep for one cell


def _flatten(row: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in row.items():
        if isinstance(v, dict) and not _is_stats(v) and v:
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    head = [h.replace("|", "&#124;") for h in header]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return [*lines, ""]


def _rows_table(
    labels: Sequence[str], rows: Sequence[dict[str, Any]], *, label_column: bool
) -> list[str]:
    """A table of rows (flattened objects) named by ``labels``: one row each, under a label
    column if ``label_column``; transposed (one row per figure, one column per label) when there
    are many more figures than rows."""
    flat = [_flatten(r) for r in rows]
    columns: list[str] = []
    for r in flat:
        columns += [k for k in r if k not in columns]
    if len(columns) > MAX_COLUMNS and len(columns) > len(rows):
        body = [[f"`{c}`", *(cell(r.get(c)) for r in flat)] for c in columns]
        return _table(["", *labels], body)
    if not label_column:
        return _table(columns, [[cell(r.get(c)) for c in columns] for r in flat])
    body = [[lab, *(cell(r.get(c)) for c in columns)] for lab, r in zip(labels, flat, strict=True)]
    return _table(["", *columns], body)


def _list_labels(rows: Sequence[dict[str, Any]]) -> list[str]:
    """Names for a list's rows: its first key and value (``groups 8``), else 1, 2, ..."""
    first = next(iter(rows[0]), None)
    if first is not None and all(next(iter(r), None) == first and _is_cell(r[first]) for r in rows):
        return [f"{first} {cell(r[first])}" for r in rows]
    return [str(i + 1) for i in range(len(rows))]


def _is_rowset(v: Any) -> bool:
    """An object of objects, each a row: it holds at least one plain value."""
    return isinstance(v, dict) and bool(v) and all(_is_row(r) for r in v.values())


def _is_row(r: Any) -> bool:
    return isinstance(r, dict) and not _is_stats(r) and any(_is_cell(x) for x in r.values())


def _is_rowlist(v: Any) -> bool:
    return isinstance(v, list) and bool(v) and all(isinstance(r, dict) for r in v)


def render_value(path: str, value: dict[str, Any]) -> list[str]:
    """Markdown for one object of a bench's result: its plain values as a key/value table under
    a bold label (its path in the result; none at the top), then each nested part likewise."""
    lines: list[str] = []
    plain = [(k, v) for k, v in value.items() if _is_cell(v)]
    if plain:
        label = [f"**`{path}`**", ""] if path else []
        lines += label + _table(["figure", "value"], [[f"`{k}`", cell(v)] for k, v in plain])
    for k, v in value.items():
        if _is_cell(v):
            continue
        where = f"{path}.{k}" if path else k
        if _is_rowlist(v):
            lines += [f"**`{where}`**", "", *_rows_table(_list_labels(v), v, label_column=False)]
        elif _is_rowset(v):
            lines += [
                f"**`{where}`**",
                "",
                *_rows_table([f"`{x}`" for x in v], list(v.values()), label_column=True),
            ]
        elif isinstance(v, dict) and v:
            lines += render_value(where, v)
        else:  # an empty part, or lists of lists: shown as they are
            lines += [f"**`{where}`**: `{json.dumps(v)}`", ""]
    return lines


def _machine_line(m: dict[str, Any]) -> str:
    gpus = "; ".join(m.get("gpus") or []) or "no GPU"
    versions = ", ".join(
        f"{k} {m[k]}" for k in ("python", "torch", "torchft") if m.get(k) is not None
    )
    return (
        f"{m.get('cores')} cores, {m.get('memory_gib')} GiB, {m.get('cpu')}, {gpus}; "
        f"{m.get('os')}; {versions}"
    )


def render_bench(name: str, saved: dict[str, Any], summary: str | None) -> list[str]:
    """One saved run's section of the page (``name``: the file's; the bench's is ``bench``)."""
    bench = saved.get("bench", name)
    load = saved.get("loadavg") or {}
    git = saved.get("git") or {}
    commit = f"`{git['commit']}`" + (" with local changes" if git.get("dirty") else "")
    lines = [
        f"## {name}",
        "",
        (summary or "A bench of this repository.")
        + f" Every figure is defined in the docstring of `experiments/bench/{bench}.py`.",
        "",
        f"- Command: `{saved.get('command')}`",
        f"- Machine: {_machine_line(saved.get('machine') or {})}",
        f"- Date: {saved.get('date')}, for {cell(saved.get('duration_s'))} s; load average (1, 5, "
        f"15 min) {cell(load.get('before'))} before, {cell(load.get('after'))} after",
    ]
    if git.get("commit"):
        lines.append(f"- Code: commit {commit}")
    lines.append("")
    return lines + render_value("", saved.get("result") or {})


def render(docs: Path = DOCS, bench_dir: Path = BENCH_DIR) -> str:
    """The whole of BENCHMARKS.md from every file in ``docs/benchmarks/``."""
    summaries = bench_summaries(bench_dir)
    files = sorted((docs / SAVED).glob("*.json"))
    saved = {p.stem: json.loads(p.read_text(encoding="utf-8")) for p in files}
    benches = {data.get("bench", n) for n, data in saved.items()}
    missing = [n for n in summaries if n not in benches]
    lines = [
        "# Benchmarks",
        "",
        "<!-- Generated by `python -m experiments.bench.publish render` from "
        "docs/benchmarks/*.json; do not edit by hand. -->",
        "",
        "Each section is the last recorded run of one `ftharness bench`, with the machine it ran "
        "on. Record a bench again with `python -m experiments.bench.publish record NAME -- "
        "ARGS...`; git keeps the earlier runs (`git log -p docs/benchmarks/`). A cell "
        f"`a (b{DASH}c, p95 d)` is a median `a` with its minimum `b`, maximum `c` and 95th "
        f"percentile `d`; `{DASH}` is a figure not measured.",
        "",
    ]
    if saved:
        lines += ["Recorded: " + ", ".join(f"[{n}](#{n})" for n in saved) + ".", ""]
    if missing:
        lines += ["Not recorded yet: " + ", ".join(f"`{n}`" for n in missing) + ".", ""]
    for name, data in saved.items():
        lines += render_bench(name, data, summaries.get(data.get("bench", name)))
    while lines and not lines[-1]:
        lines.pop()
    return "\n".join(lines) + "\n"


def write_page(docs: Path = DOCS) -> Path:
    path = docs / PAGE
    path.write_text(render(docs), encoding="utf-8")
    return path


# -- command line -------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    bench_args: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, bench_args = argv[:i], argv[i + 1 :]
    parser = argparse.ArgumentParser(
        prog="python -m experiments.bench.publish",
        description="Record a bench's JSON result with its machine, and render docs/BENCHMARKS.md.",
    )
    parser.add_argument("--docs", type=Path, default=DOCS, help="the docs folder (default: docs/)")
    sub = parser.add_subparsers(dest="command", required=True)
    rec = sub.add_parser(
        "record", help="run `ftharness bench NAME ARGS...` (ARGS after --), save it"
    )
    rec.add_argument("name", help="the bench, e.g. recovery")
    rec.add_argument(
        "--as",
        dest="save_as",
        metavar="LABEL",
        help="save as docs/benchmarks/LABEL.json, beside the bench's own saved run (e.g. a "
        "subset of its rows at full size: recovery_sharded)",
    )
    ren = sub.add_parser("render", help="write BENCHMARKS.md from the saved runs")
    ren.add_argument("--check", action="store_true", help="exit 1 if the page is out of date")
    args = parser.parse_args(argv)
    if args.command == "record":
        try:
            path = record(args.name, bench_args, docs=args.docs, save_as=args.save_as)
        except RecordError as e:
            print(f"publish: {e}", file=sys.stderr)
            return 1
        print(f"publish: saved {path}; wrote {write_page(args.docs)}", file=sys.stderr)
        return 0
    if bench_args:
        parser.error("arguments after -- are for record only")
    if args.check:
        page = args.docs / PAGE
        current = page.read_text(encoding="utf-8") if page.exists() else ""
        if current != render(args.docs):
            print(
                f"publish: {page} is out of date: run `python -m experiments.bench.publish render`",
                file=sys.stderr,
            )
            return 1
        return 0
    print(f"publish: wrote {write_page(args.docs)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
