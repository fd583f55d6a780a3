"""Failures as values: what died, how, where and when. They always reach a supervisor."""

from __future__ import annotations

import enum
import os
import signal
import time
from dataclasses import dataclass, field, replace
from typing import Any


class Cause(enum.StrEnum):
    EXIT_CODE = "exit_code"  # the process exited on its own with a non-zero code
    CLEAN_EXIT = "clean_exit"  # the process exited with code 0 without being asked to
    SIGNAL = "signal"  # killed by a signal (SIGKILL, SIGSEGV, ...)
    MISSED_HEARTBEAT = "missed_heartbeat"  # alive but silent: a hang or a held GIL
    LOST_HOST = "lost_host"  # the host agent died or stopped heartbeating
    EXCEPTION = "exception"  # an actor raised in a way that kills the process
    ESCALATED = "escalated"  # a child supervisor gave up (restart intensity exceeded)


@dataclass(frozen=True, kw_only=True)
class Failure:
    """One failure, as delivered to the owning supervisor.

    ``t_detected`` is when the runtime knew (agent reaped it, heartbeat went overdue);
    ``t_event`` is the best estimate of when it happened (equal for exits, earlier for hangs).
    """

    cause: Cause
    detail: str
    proc: str | None = None  # proc id, e.g. "host0/p3"
    host: str | None = None
    pid: int | None = None
    coords: dict[str, int] = field(default_factory=dict)
    exit_code: int | None = None
    signal: str | None = None
    traceback: str | None = None
    t_event: float = field(default_factory=time.time)
    t_detected: float = field(default_factory=time.time)
    child: str | None = None  # the supervisor child it was routed to
    chained: Failure | None = None  # for ESCALATED: the failure that exhausted the intensity

    @property
    def abnormal(self) -> bool:
        return self.cause is not Cause.CLEAN_EXIT

    def with_child(self, child: str) -> Failure:
        return replace(self, child=child)

    def summary(self) -> str:
        where = " ".join(f"{k}={v}" for k, v in self.coords.items())
        parts = [self.cause.value]
        if self.signal:
            parts.append(self.signal)
        if self.exit_code is not None:
            parts.append(f"exit code {self.exit_code}")
        loc = f" at {self.proc}" if self.proc else ""
        loc += f" [{where}]" if where else ""
        loc += f" on {self.host}" if self.host else ""
        return f"{', '.join(parts)}{loc}: {self.detail}"

    def report(self) -> str:
        """A readable multi-line report, following the chain of escalations."""
        lines = [f"Failure: {self.summary()}"]
        if self.traceback:
            lines.append("Remote traceback:")
            lines.extend("  " + ln for ln in self.traceback.rstrip().splitlines())
        if self.chained is not None:
            lines.append("Caused by:")
            lines.extend("  " + ln for ln in self.chained.report().splitlines())
        return "\n".join(lines)

    def journal_fields(self) -> dict[str, Any]:
        return {
            "cause": self.cause.value,
            "detail": self.detail,
            "proc": self.proc,
            "host": self.host,
            "pid": self.pid,
            "coords": dict(self.coords),
            "exit_code": self.exit_code,
            "signal": self.signal,
            "traceback": self.traceback,
            "t_event": self.t_event,
            **{k: v for k, v in self.coords.items() if k in ("replica", "rank")},
        }


def decode_wait_status(status: int) -> tuple[Cause, int | None, str | None, str]:
    """Decode ``os.waitpid`` status into (cause, exit code, signal name, detail)."""
    if os.WIFSIGNALED(status):
        signum = os.WTERMSIG(status)
        name = (
            signal.Signals(signum).name
            if signum in signal.Signals._value2member_map_
            else str(signum)
        )
        core = " (core dumped)" if os.WCOREDUMP(status) else ""
        return Cause.SIGNAL, None, name, f"killed by {name}{core}"
    code = os.waitstatus_to_exitcode(status)
    if code == 0:
        return Cause.CLEAN_EXIT, 0, None, "exited with code 0"
    return Cause.EXIT_CODE, code, None, f"exited with code {code}"


class SupervisionError(RuntimeError):
    """Raised to the user when a failure reached the root of the tree unhandled."""

    def __init__(self, failure: Failure) -> None:
        self.failure = failure
        super().__init__(failure.report())
