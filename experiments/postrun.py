"""What a job leaves behind once it has stopped: live processes and ``/dev/shm`` segments.

``ftharness chaos`` takes a :class:`Before` snapshot before each policy's run and, once
``run_job`` has returned (the job stopped, its journal closed), calls :func:`check` and writes
the result to ``OUT/<policy>/postrun.json``. The ``no_orphans`` and ``no_shm_left``
hypotheses are judged from that file alone, so ``ftharness report DIR`` recomputes them later.

A process counts as the job's (an **orphan** if still alive) when either

* its pid is in a ``proc.start`` record (workers, warm spares, the quorum service) and it was
  created no later than that record's ``t`` (plus :data:`PID_SLACK_S`): a later process that
  reused the pid is somebody else's; or
* it descends from the runner process and did not exist before the run (the host agents,
  whose pids are not journalled, and anything they or the workers started that is still
  attached to the tree).

A **segment** counts as the run's when it is named as ``runtime/dataplane/snapshot.py`` names
snapshot files (``ftdp-PID-tTICKS-RANDOM``), was not there before the run, and PID is one of
the job's processes by the rule above (the start time in its name, clock ticks since boot, is
compared with the ``proc.start`` record). Other users' segments made meanwhile are not counted.

Zombies are not counted as alive (they hold no memory, only a process-table entry); the new
descendants of the runner that are zombies are listed apart, as ``zombies``.
Not guaranteed: a process whose parent died and that never appeared in a ``proc.start``
record is re-parented out of the runner's tree and is not seen.

File format (``postrun.json``)::

    {"policy", "run_start", "run_end", "checked_at", "waited_s", "journal_pids",
     "new_descendants_seen", "orphans": [{"pid", "name", "cmdline", "create_time", "source"}],
     "zombies": [same as orphans], "shm_dir", "shm_left": [name, ...]}
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

from runtime.journal import PROC_START

POSTRUN_FILE = "postrun.json"
SHM_DIR = "/dev/shm"
#: Snapshot file names: ftdp-PID-tSTARTTICKS-RANDOM (see runtime/dataplane/snapshot.py).
SEGMENT = re.compile(r"^ftdp-(\d+)-t(\d+)-[0-9a-f]+$")
#: A worker is forked a moment before its ``proc.start`` record is written.
PID_SLACK_S = 2.0
#: How long the check waits for processes already dying (a SIGKILL in flight) to go.
GRACE_S = 5.0

Record = Mapping[str, Any]


@dataclass(frozen=True, kw_only=True)
class Before:
    """What existed before the run: the runner's descendants and the ``/dev/shm`` names."""

    t: float
    descendants: frozenset[tuple[int, float]]
    shm: frozenset[str]


def _descendants() -> set[tuple[int, float]]:
    out = set()
    for p in psutil.Process().children(recursive=True):
        try:
            out.add((p.pid, p.create_time()))
        except psutil.NoSuchProcess:
            continue
    return out


def _shm_names(directory: str) -> set[str]:
    try:
        return set(os.listdir(directory))
    except OSError:
        return set()


def snapshot(shm_dir: str = SHM_DIR) -> Before:
    return Before(
        t=time.time(), descendants=frozenset(_descendants()), shm=frozenset(_shm_names(shm_dir))
    )


def journal_pids(records: Iterable[Record]) -> dict[int, float]:
    """pid -> the latest ``t`` of a ``proc.start`` record naming it (pure)."""
    out: dict[int, float] = {}
    for r in records:
        pid = r.get("pid")
        if r.get("event") == PROC_START and isinstance(pid, int) and not isinstance(pid, bool):
            out[pid] = max(out.get(pid, r["t"]), r["t"])
    return out


def is_journal_process(pid: int, created: float, pids: Mapping[int, float]) -> bool:
    """True if a process ``pid`` created at ``created`` (epoch seconds) is the one a
    ``proc.start`` record named, not a later process that reused its pid (pure)."""
    return pid in pids and created <= pids[pid] + PID_SLACK_S


def leftover_segments(
    before: Iterable[str], after: Iterable[str], pids: Mapping[int, float], boot_time: float
) -> list[str]:
    """The snapshot segments in ``after`` that were not in ``before`` and were made by one of
    the job's processes (pure; ``boot_time`` turns the start ticks in a name into seconds)."""
    tick = os.sysconf("SC_CLK_TCK")
    known = set(before)
    out = []
    for name in sorted(set(after) - known):
        m = SEGMENT.match(name)
        if m and is_journal_process(int(m.group(1)), boot_time + int(m.group(2)) / tick, pids):
            out.append(name)
    return out


def _alive(p: psutil.Process) -> bool:
    try:
        return p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _orphans(
    before: Before, pids: Mapping[int, float]
) -> tuple[list[dict[str, Any]], int, list[dict[str, Any]]]:
    """The job's processes alive now, how many new descendants were seen (alive or not), and
    the new descendants that are zombies (dead, not yet reaped by their parent)."""
    found: dict[int, dict[str, Any]] = {}
    zombies: list[dict[str, Any]] = []
    for pid in pids:
        try:
            p = psutil.Process(pid)
            created = p.create_time()
        except psutil.NoSuchProcess:
            continue
        if is_journal_process(pid, created, pids) and _alive(p):
            found[pid] = _describe(p, created, "proc.start")
    new = 0
    for pid, created in _descendants() - before.descendants:
        new += 1
        try:
            p = psutil.Process(pid)
        except psutil.NoSuchProcess:
            continue
        if pid in found:
            continue
        if _alive(p):
            found[pid] = _describe(p, created, "descendant of the runner")
        elif p.is_running():
            zombies.append(_describe(p, created, "descendant of the runner"))
    return sorted(found.values(), key=lambda o: o["pid"]), new, zombies


def _describe(p: psutil.Process, created: float, source: str) -> dict[str, Any]:
    name, cmdline = "?", ""
    with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied):
        name = p.name()
        cmdline = " ".join(p.cmdline())[:200]  # a zombie has a name but no command line
    return {
        "pid": p.pid,
        "name": name,
        "cmdline": cmdline,
        "create_time": created,
        "source": source,
    }


def check(
    before: Before,
    records: Sequence[Record],
    *,
    policy: str,
    run_end: float,
    shm_dir: str = SHM_DIR,
    grace_s: float = GRACE_S,
) -> dict[str, Any]:
    """Look for the job's live processes and new segments, waiting up to ``grace_s`` for
    processes already on their way out; the returned dict is what ``postrun.json`` holds."""
    pids = journal_pids(records)
    deadline = time.monotonic() + grace_s
    while True:
        orphans, new, zombies = _orphans(before, pids)
        if not orphans or time.monotonic() >= deadline:
            break
        time.sleep(0.2)
    checked_at = time.time()
    left = leftover_segments(before.shm, _shm_names(shm_dir), pids, psutil.boot_time())
    return {
        "policy": policy,
        "run_start": before.t,
        "run_end": run_end,
        "checked_at": checked_at,
        "waited_s": round(max(0.0, checked_at - run_end), 3),
        "journal_pids": len(pids),
        "new_descendants_seen": new,
        "orphans": orphans,
        "zombies": zombies,
        "shm_dir": shm_dir,
        "shm_left": left,
    }


def write(run_dir: str | Path, result: Mapping[str, Any]) -> Path:
    path = Path(run_dir) / POSTRUN_FILE
    path.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    return path


def load(out_dir: str | Path) -> dict[str, dict[str, Any]]:
    """policy -> its post-run check, from every ``postrun.json`` under ``out_dir`` (a file that
    does not parse is left out: the hypotheses then say no check was recorded)."""
    out: dict[str, dict[str, Any]] = {}
    for path in sorted(Path(out_dir).glob(f"**/{POSTRUN_FILE}")):
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        if isinstance(data, dict) and isinstance(data.get("policy"), str):
            out[data["policy"]] = data
    return out
