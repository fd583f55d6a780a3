"""A plain, log-friendly progress display: one line per second while a job trains, and while
its steps abort (the aborted steps since the last commit and the last error, read from
``harness.job.stall``)."""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable
from typing import Protocol

from harness.config import JobConfig
from harness.job.recovery import CONTROLLER_CRASH
from runtime.journal import FAILURE, FAULT_INJECT, RECOVERY_PHASE, STEP_COMMIT, Record


def say(text: str) -> None:
    """One line for the user, on stderr (the journal is the record; this is the console)."""
    print(f"[ftharness] {text}", file=sys.stderr, flush=True)


class Recoveries(Protocol):
    """What the progress line counts of recoveries (``harness.job.recovery.RecoveryTracker``, or
    ``ftharness attach``'s count from a journal)."""

    completed: int

    @property
    def open_count(self) -> int: ...


class Progress:
    def __init__(
        self, cfg: JobConfig, tracker: Recoveries, *, quiet: bool = False, every_s: float = 1.0
    ):
        self.cfg = cfg
        self.tracker = tracker
        self.quiet = quiet
        self.every_s = every_s
        self._lock = threading.Lock()
        self._last_print = 0.0
        self._step = 0
        self._loss = float("nan")
        self._participants = 0
        self._t0 = time.monotonic()
        self._steps_at_t0 = 0
        #: ``summary() -> "N aborted (last: ...)" | None``: aborted steps since the last commit
        #: (``harness.job.stall.StallWatch.summary``); None: not shown.
        self.aborts: Callable[[], str | None] | None = None  # a stall's summary (harness.job.stall)

    def say(self, text: str) -> None:
        if not self.quiet:
            say(text)

    def on_record(self, r: Record) -> None:
        event = r.get("event")
        if event == STEP_COMMIT:
            with self._lock:
                if self._step == 0 and self._steps_at_t0 == 0:
                    # the rate counts from the first commit seen: after a takeover, the job's
                    # step is far above 0 and this controller has just started
                    self._steps_at_t0, self._t0 = max(0, r.get("step", 0) - 1), time.monotonic()
                if r.get("step", 0) >= self._step:
                    self._step = r["step"]
                    self._loss = r.get("loss", float("nan"))
                    self._participants = r.get("participants", 0)
            self._maybe_print()
        elif event == FAULT_INJECT:
            tgt = r.get("target") or {}
            where = ", ".join(f"{k} {v}" for k, v in tgt.items() if v is not None) or "service"
            if tgt.get("controller"):
                where = "the controller"
            self.say(f"fault {r.get('fault_id')}: {r.get('kind')} -> {where}")
        elif event == FAILURE and not r.get("fatal"):
            self.say(
                f"failure: {r.get('cause')} {r.get('signal') or ''} at "
                f"{r.get('proc')} (replica {r.get('replica')}): {r.get('detail')}"
            )
        elif event == RECOVERY_PHASE and r.get("phase") == "participating":
            what = f"replica {r.get('replica')} participating again"
            if r.get("cause") == CONTROLLER_CRASH:
                what = "the controller taken over, the groups committing again"
            elif r.get("replica") is None:
                what = "the quorum service back, the groups committing again"
            self.say(f"recovered: {what} ({r.get('recovery_id')})")

    def tick(self) -> None:
        """The line again, while nothing commits (steps abort): called about once a second."""
        self._maybe_print()

    def _maybe_print(self) -> None:
        now = time.monotonic()
        if self.quiet or now - self._last_print < self.every_s:
            return
        aborted = self.aborts() if self.aborts is not None else None
        with self._lock:
            self._last_print = now
            elapsed = now - self._t0
            rate = (self._step - self._steps_at_t0) / elapsed if elapsed >= 1.0 else None
            line = (
                f"step {self._step}/{self.cfg.steps} | loss {self._loss:.3f} | "
                f"groups {self._participants}/{self.cfg.replicas} | "
                + (f"{aborted} | " if aborted else "")
                + f"recoveries {self.tracker.completed} (open {self.tracker.open_count}) | "
                + (f"{rate:.1f} steps/s" if rate is not None else "starting")
            )
        print(f"[ftharness] {line}", file=sys.stderr, flush=True)

    def close(self) -> None:
        pass
