"""Run directories: one run per directory, private to its user.

A run directory holds one run's journal, checkpoints and worker logs, and every report is
computed from the journals found under it; a second run written into it would be mixed into the
first one's report (and would resume from its checkpoints). So:

* ``--out DIR`` names the directory exactly: it must not exist yet or be empty, else the command
  refuses before launching anything.
* Without ``--out`` the default ``runs/NAME`` is used if free; if an earlier run holds it, the
  next free ``runs/NAME-2``, ``runs/NAME-3``, ... is taken and the caller says which.

Directories are created ``0700`` (and an existing empty one chmod-ed to it): they hold the
weights, tracebacks and logs of the run.
"""

from __future__ import annotations

import os
from pathlib import Path

DEFAULT_ROOT = Path("runs")
# Enough for any sane number of reruns of one config; past it something is looping.
_MAX_SUFFIX = 10_000


class RunDirError(ValueError):
    """The run directory cannot be used; the message names it and says what to do."""


def make_private_dir(path: str | os.PathLike[str]) -> Path:
    """Create ``path`` (and missing parents) with the last component ``0700``. An existing empty
    directory is made ``0700`` too; one that already holds files keeps its mode (it is not ours
    to change: a caller of ``run_job`` may pass any folder)."""
    p = Path(path)
    try:
        p.mkdir(parents=True, mode=0o700)  # the umask can only take bits away
    except FileExistsError:
        if not p.is_dir():
            raise
        if _is_empty_dir(p):
            os.chmod(p, 0o700)
    return p


def _is_empty_dir(p: Path) -> bool:
    return p.is_dir() and not any(p.iterdir())


def choose_run_dir(out: str | os.PathLike[str] | None, name: str) -> tuple[Path, str | None]:
    """Create and return the directory for a new run, and a note for the user when it is not the
    one they might expect (None otherwise). ``out`` is the ``--out`` option (None: default).

    Raises :class:`RunDirError` if ``out`` already holds something."""
    if out is not None:
        p = Path(out)
        if p.exists() and not _is_empty_dir(p):
            what = "is not a directory" if not p.is_dir() else "already holds an earlier run"
            raise RunDirError(
                f"run directory {p} {what}; pass --out with a new directory, or remove {p}"
            )
        return make_private_dir(p), None
    DEFAULT_ROOT.mkdir(parents=True, exist_ok=True)
    for i in range(1, _MAX_SUFFIX):
        p = DEFAULT_ROOT / (name if i == 1 else f"{name}-{i}")
        try:
            p.mkdir(mode=0o700)  # atomic: two runs started at once never share one
        except FileExistsError:
            if not _is_empty_dir(p):
                continue
        make_private_dir(p)
        if i == 1:
            return p, None
        first = DEFAULT_ROOT / name
        return p, f"{first} holds an earlier run; this run writes to {p} (choose with --out)"
    raise RunDirError(
        f"{DEFAULT_ROOT / name} and its numbered successors up to -{_MAX_SUFFIX - 1} are all "
        "taken; pass --out with a new directory"
    )


def run_dir_for(command: str, out: str | os.PathLike[str] | None, name: str) -> Path | None:
    """:func:`choose_run_dir` for a command line: says on stderr which directory was taken when
    it is not the default, or why none can be (then returns None: exit 2)."""
    import sys

    try:
        path, note = choose_run_dir(out, name)
    except RunDirError as exc:
        print(f"ftharness {command}: {exc}", file=sys.stderr)
        return None
    if note:
        print(f"ftharness {command}: {note}", file=sys.stderr)
    return path
