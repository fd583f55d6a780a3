"""A failure that comes back is the program's own, not a fault to ride through.

Restarting a replica group in place is right for a one-off fault (a killed process, a lost
host). A program that dies the same way every time (an import error, rank 0 hosting a store
that is already there, torchft's asynchronous quorum healing FSDP2 mid-pass, any bug) is
restarted again and again until the restart intensity gives up, and the cause is only in a
rank's log. This module tells the two apart from the deaths themselves:

* a death's **signature** is the exception type and the last frame of the traceback in the
  rank's log (or in its ``TORCHELASTIC_ERROR_FILE``), or, with no traceback, its signal or exit
  code; the message is shown but not compared (it holds ports, pids, addresses);
* deaths a fault explains never count: a death of the group an injected fault hit, and any
  death within ``explained_s`` of an injected fault (a survivor a peer's death took down), end
  the run of repeats; so do stops from outside (SIGKILL, SIGTERM, SIGINT: ftharness's own
  fencing of a hung group, a one_for_all stop) and deaths with no cause of their own;
* :data:`TRIES` deaths in a row, any groups, with one signature, within ``window_s`` of one
  another, are a crash loop: the job ends with a diagnosis (the exception, its last frame, the
  log lines that show it, where it died, and a hint where the cause is known: :data:`HINTS`).

Pure: ``harness.job.program.deaths`` feeds it the deaths and the injected faults.
"""

from __future__ import annotations

import json
import re
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

#: Deaths in a row with one signature that make a crash loop: the job ends at the third, so a
#: program that fails at start is tried at most three times.
TRIES = 3
#: ... each within this long of the one before (a crash loop restarts within seconds; a rare
#: race that recurs every few minutes is ridden through).
WINDOW_S = 60.0
#: Seconds past the collective timeout in which any group's death after an injected fault is
#: the fault's (a survivor a peer's death took down fails within its collective timeout).
EXPLAINED_SLACK_S = 5.0
#: Signals that are a stop from outside, not a death of the program's own.
STOP_SIGNALS = ("SIGKILL", "SIGTERM", "SIGINT")
#: Known causes, matched in the exception and the log lines shown: the hint printed with them.
HINTS: tuple[tuple[str, str], ...] = (
    (
        r"storage of size 0|setStorage|got mixed torch\.Tensor and DTensor",
        "a heal loaded or read while FSDP2 had the parameters unsharded: torchft's asynchronous "
        "quorum (its default) races with FSDP2 (torchft RFC 343, torchtitan issue 4753); build "
        "the Manager with use_async_quorum=False (torchtitan: its synchronous quorum mode), "
        "which loads a heal before the forward pass",
    ),
    (
        r"EADDRINUSE|Address already in use",
        "a rank tried to host a server on a port already taken: the group's store is served by "
        "its host agent at MASTER_ADDR:MASTER_PORT, so every rank must connect to it as a "
        "client (env:// does with TORCHELASTIC_USE_AGENT_STORE=True, which ftharness sets; a "
        "TCPStore(is_master=True) or a fixed port of the program's own does not)",
    ),
    (
        r"ModuleNotFoundError|ImportError",
        "a module the program imports is not importable by the interpreter ftharness runs it "
        "with (the one ftharness runs in, for 'python'): install it there, or put it on "
        "program.env.PYTHONPATH",
    ),
    (
        r"Torch not compiled with CUDA|No CUDA GPUs|CUDA driver|no NVIDIA driver|_cuda_\w+"
        r"|torch/cuda/__init__\.py",
        "the program needs a GPU this machine does not have (torchtitan's trainer sets its "
        "CUDA device first thing, even on a CPU-only machine)",
    ),
)

_FRAME = re.compile(r'^\s*File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<func>.+)$')


@dataclass(frozen=True)
class Death:
    """One rank's death, as the crash-loop rule sees it."""

    replica: int
    rank: int
    incarnation: int
    what: str  # the exception line ("OSError: [Errno 98] ..."), else "killed by SIGSEGV" ...
    kind: str  # compared: the exception type, else the signal or "exit code N"
    frame: str  # compared: the last frame ("train.py:12 in main"); "" without a traceback
    where: str  # "at start, before its first quorum", "at step 31, 1 step after its heal" ...
    t: float
    lines: tuple[str, ...] = ()  # the log lines that show it (the traceback's end)

    @property
    def signature(self) -> tuple[str, str]:
        return (self.kind, self.frame)


def read_death(
    lines: list[str], *, signal: str | None, exit_code: int | None, error_file: Path | None = None
) -> tuple[str, str, str, tuple[str, ...]] | None:
    """(what, kind, frame, lines) of a rank's death from its log's ``lines`` (this incarnation's
    only) or torch's ``@record`` error file, or None where the death is a stop from outside
    (:data:`STOP_SIGNALS`) or has no cause of its own (exit code 0 or unknown)."""
    if signal in STOP_SIGNALS:
        return None
    tb = _last_traceback(lines) or _error_file_traceback(error_file)
    if tb is not None:
        return tb
    if signal:
        return f"killed by {signal}", signal, "", tuple(lines[-5:])
    if exit_code:
        return f"exited with code {exit_code}", f"exit code {exit_code}", "", tuple(lines[-5:])
    return None


def _last_traceback(lines: list[str]) -> tuple[str, str, str, tuple[str, ...]] | None:
    starts = [i for i, ln in enumerate(lines) if ln.startswith("Traceback (most recent call last)")]
    if not starts:
        return None
    block = lines[starts[-1] :]
    frames = [(i, m) for i, ln in enumerate(block) if (m := _FRAME.match(ln))]
    if not frames:
        return None
    after = block[frames[-1][0] + 1 :]
    what = next((ln for ln in after if ln and not ln[0].isspace()), "")
    if not what:
        return None
    m = frames[-1][1]
    frame = f"{Path(m['file']).name}:{m['line']} in {m['func'].strip()}"
    kind = what.split(":", 1)[0].strip()
    end = block.index(what, frames[-1][0])
    return what.strip(), kind, frame, tuple(block[frames[-1][0] : end + 1])


def _error_file_traceback(path: Path | None) -> tuple[str, str, str, tuple[str, ...]] | None:
    """torch's ``@record`` error file (``TORCHELASTIC_ERROR_FILE``): its message and call stack."""
    if path is None:
        return None
    try:
        msg = json.loads(path.read_text())["message"]
        text = f"{msg['extraInfo']['py_callstack']}"
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return _last_traceback(text.splitlines())


def hint(death: Death) -> str | None:
    text = "\n".join((death.what, *death.lines))
    return next((h for pattern, h in HINTS if re.search(pattern, text)), None)


class CrashLoop:
    """The run of deaths with one signature (module doc). Not thread-safe: one caller."""

    def __init__(
        self, *, tries: int = TRIES, window_s: float = WINDOW_S, explained_s: float = 10.0
    ) -> None:
        self.tries = tries
        self.window_s = window_s
        self.explained_s = explained_s
        self._run: deque[Death] = deque(maxlen=tries)
        self._faults: list[float] = []  # when each injected fault fired
        self._hit: set[tuple[int, int]] = set()  # (replica, incarnation) an injected fault hit
        self.loop: list[Death] | None = None  # the crash loop found, once it is

    @classmethod
    def for_job(cls, cfg: Any) -> CrashLoop:
        """The rule with job ``cfg``'s bounds: ``recovery.deterministic_max`` tries, and the
        collective timeout (plus :data:`EXPLAINED_SLACK_S`) for a fault's consequences."""
        explained = cfg.timeouts.process_group_timeout + EXPLAINED_SLACK_S
        return cls(tries=cfg.recovery.deterministic_max, explained_s=explained)

    def fault_record(self, r: dict[str, Any], incarnation: Callable[[int], int | None]) -> None:
        """:meth:`fault` from a ``fault.inject`` journal record; ``incarnation(replica)``: the
        group's current one (None: none)."""
        target = r.get("target")
        replica = target.get("replica") if isinstance(target, dict) else None
        inc = incarnation(replica) if isinstance(replica, int) else None
        self.fault(float(r.get("t", time.time())), replica, inc)

    def fault(self, t: float, replica: int | None, incarnation: int | None) -> None:
        """A fault was injected at ``t``: into ``replica``'s ``incarnation`` (None: a host, a
        network, the quorum service)."""
        self._faults.append(t)
        if replica is not None and incarnation is not None:
            self._hit.add((replica, incarnation))
        self._run.clear()

    def explained(self, d: Death) -> bool:
        if (d.replica, d.incarnation) in self._hit:
            return True
        return any(t <= d.t <= t + self.explained_s for t in self._faults)

    def died(self, d: Death) -> list[Death] | None:
        """Count ``d``; the deaths that make a crash loop, the first time one completes (the
        job is ending then: later deaths are its groups stopping)."""
        if self.loop is not None:
            return None
        if self.explained(d):
            self._run.clear()
            return None
        return self.counted(d)

    def reset(self) -> None:
        """The loop found was acted on and the job goes on (its group dropped): count afresh."""
        self.loop = None
        self._run.clear()

    def counted(self, d: Death) -> list[Death] | None:
        """Count ``d`` as a death no fault explains (as :meth:`died` does once it has checked;
        a takeover replays the deaths its dead controller counted so)."""
        if self.loop is not None:
            return None
        if self._run and (
            self._run[-1].signature != d.signature or d.t - self._run[-1].t > self.window_s
        ):
            self._run.clear()
        self._run.append(d)
        if len(self._run) >= self.tries:
            self.loop = list(self._run)
        return self.loop


def diagnosis(deaths: list[Death], who: str = "the program") -> str:
    """What the user reads (console, ``job.end``, the report) about a crash loop of ``who``."""
    last = deaths[-1]
    where = ", ".join(
        (f"group {d.replica} rank {d.rank}" if d.replica >= 0 else "the groups") + f" {d.where}"
        for d in deaths
    )
    text = (
        f"{who} fails the same way every time, so ftharness stopped restarting it: "
        f"{len(deaths)} deaths in a row with {last.what}"
        + (f" (last frame: {last.frame})" if last.frame else "")
        + f": {where}"
    )
    if h := hint(last):
        text += f"\nhint: {h}"
    name = f"replica{last.replica}-rank{last.rank}"
    text += "".join(f"\n{name} | {ln}" for ln in last.lines)
    return text
