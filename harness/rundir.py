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

import contextlib
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from harness.config import JobConfig, config_from_dict, config_to_dict
from runtime.journal import JOB_END, Record

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


# ---------------------------------------------------------------------------------------------
# The files a run's processes share (docs/controller.md): the controller runs in a process of its
# own under a keeper, and `ftharness attach | stop | status` find both through the run directory.

#: What the controller process needs to run the job: the config as resolved by ``ftharness run``
#: (overrides applied) and the run options (harness.job.launch).
JOB_FILE = "job.json"
#: The keeper's pid, uid and start (harness.keeper.keeper): whom ``ftharness stop`` signals.
KEEPER_FILE = "keeper.json"
#: The serving controller's address, epoch and pid (runtime.control_file).
CONTROLLER_FILE = "controller.json"
#: What a standby's keeper had to stop when the run ended (harness.keeper.standby_node).
LEFT_BEHIND_FILE = "left_behind.json"
#: A detached run's output (what the terminal shows for a run in the foreground).
CONSOLE_FILE = "console.log"


def write_json_atomic(path: str | os.PathLike[str], data: object) -> None:
    """Write ``data`` as JSON to ``path`` so that a reader sees the old file or the new one, never
    a part (a process killed mid-write, a power cut): ``runtime.control_file.write_atomic``."""
    from runtime.control_file import write_atomic

    write_atomic(path, (json.dumps(data, indent=1) + "\n").encode())


def read_json(path: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The JSON object in ``path``; None if there is no such file. ValueError (naming the file)
    if it is not a JSON object: written atomically, it is never torn, so it was edited."""
    try:
        text = Path(path).read_text()
    except FileNotFoundError:
        return None
    try:
        data = json.loads(text)
    except ValueError as exc:
        raise ValueError(f"{path} is not valid JSON ({exc})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path} does not hold a JSON object")
    return data


def find_run(name: str) -> Path:
    """The run directory ``name`` names: a directory path, or a run under ``runs/`` (as
    ``ftharness run`` chose it). RunDirError if there is none, or another user owns it: its
    processes are not ours to follow, stop or inspect (and its files are private anyway)."""
    p = Path(name)
    if not p.is_dir() and os.sep not in name and (DEFAULT_ROOT / name).is_dir():
        p = DEFAULT_ROOT / name
    if not p.is_dir():
        where = "" if os.sep in name else f" nor a run under {DEFAULT_ROOT}/"
        raise RunDirError(f"no run {name!r}: not a directory{where}")
    uid = p.stat().st_uid
    if uid != os.getuid():
        raise RunDirError(
            f"run {p} belongs to {_user(uid)}, not to you: only its owner may follow, stop or "
            "inspect it"
        )
    return p


def _user(uid: int) -> str:
    import pwd

    try:
        return f"user {pwd.getpwuid(uid).pw_name} (uid {uid})"
    except KeyError:
        return f"uid {uid}"


#: How far from its end a journal is searched for ``job.end``: the controller writes it last
#: (then closes the journal), so it is in the last records or nowhere.
_END_WINDOW = 1 << 20


def end_failed(run_dir: Path, reason: str) -> Record | None:
    """Write the run's ``job.end`` (status failed, ``reason``) where no controller will: the
    keeper's last word when none could be kept running (``attach``, ``status`` and a report
    then see a run that ended, with why, never one that vanished). Nothing if the journal has
    an end already; the record written otherwise."""
    from runtime.journal import Journal, read_journal

    path = run_dir / "journal.jsonl"
    if find_job_end(path) is not None:
        return None
    records = read_journal(path) if path.exists() else []
    start = next((r for r in records if r.get("event") == "job.start"), {})
    stamp = {k: start[k] for k in ("policy",) if k in start}
    journal = Journal(path, job=str(start.get("job", run_dir.name)), **stamp)
    try:
        return journal.emit(JOB_END, status="failed", reason=reason, **run_totals(records))
    finally:
        journal.close()


def run_totals(records: list[Record]) -> dict[str, Any]:
    """A failed ``job.end``'s ``steps`` (the highest committed) and ``seconds`` (since the
    journal's first record), from the journal's ``records``."""
    from runtime.journal import STEP_COMMIT

    steps = max((int(r["step"]) for r in records if r["event"] == STEP_COMMIT), default=0)
    return {"steps": steps, "seconds": time.time() - records[0]["t"] if records else 0.0}


def find_job_end(journal: Path) -> Record | None:
    """The journal's ``job.end`` record, or None (no such record, or no journal)."""
    try:
        with open(journal, "rb") as fh:
            size = fh.seek(0, os.SEEK_END)
            fh.seek(max(0, size - _END_WINDOW))
            tail = fh.read()
    except FileNotFoundError:
        return None
    for line in reversed(tail.splitlines()):
        if b'"' + JOB_END.encode() + b'"' not in line:
            continue
        with contextlib.suppress(ValueError, RecursionError):
            record = json.loads(line)
            if isinstance(record, dict) and record.get("event") == JOB_END:
                return record
    return None


def this_host() -> str:
    """The name of the machine this process runs on, as a run's files record it: the SLURM node's
    name in a job step or batch script, else the host name."""
    import socket

    return os.environ.get("SLURMD_NODENAME") or socket.gethostname()


#: The version of ``job.json``; a file of another version is refused, not guessed at.
JOB_FILE_VERSION = 1


def write_job_file(
    run_dir: Path,
    cfg: JobConfig,
    *,
    quiet: bool,
    source: str,
    hook: dict[str, Any] | None = None,
) -> None:
    """``RUN/job.json``: the config as ``ftharness run`` resolved it (overrides applied, the
    launcher and Prometheus port options among them) and the run options, written atomically.
    ``hook``: what each controller adds to the run (``controller_proc.make_hook``)."""
    data = {
        "version": JOB_FILE_VERSION,
        "source": source,
        "cwd": os.getcwd(),
        "quiet": quiet,
        "created": time.time(),
        "config": config_to_dict(cfg),
    }
    if hook is not None:
        data["hook"] = hook
    write_json_atomic(run_dir / JOB_FILE, data)


def read_job_file(run_dir: Path) -> tuple[JobConfig, dict[str, Any]]:
    """The config and the whole ``RUN/job.json``; ValueError or ConfigError saying what is wrong
    (a file that is missing, of another version, or whose config no longer validates)."""
    path = run_dir / JOB_FILE
    data = read_json(path)
    if data is None:
        raise ValueError(f"{path} does not exist: this is not a run `ftharness run` started")
    if data.get("version") != JOB_FILE_VERSION or not isinstance(data.get("config"), dict):
        raise ValueError(
            f"{path}: not a job file of this ftharness (version {data.get('version')!r}, "
            f"expected {JOB_FILE_VERSION})"
        )
    return config_from_dict(data["config"]), data


def job_file_or_say(run_dir: Path) -> tuple[JobConfig, dict[str, Any]] | None:
    """:func:`read_job_file`, or None once the reason is said on stderr (the caller exits 2)."""
    from harness.config import ConfigError

    try:
        return read_job_file(run_dir)
    except (ValueError, ConfigError, OSError) as exc:
        print(f"ftharness run: {exc}", file=sys.stderr)
        return None


def job_from_argv(prog: str, argv: list[str] | None) -> tuple[Path, JobConfig] | None:
    """``prog RUN``'s run directory and the config in its ``job.json``; None once what is wrong
    is said on stderr (the caller exits 2)."""
    import argparse

    parser = argparse.ArgumentParser(prog=prog)
    parser.add_argument("run_dir")
    run_dir = Path(parser.parse_args(argv).run_dir)
    read = job_file_or_say(run_dir)
    return None if read is None else (run_dir, read[0])
