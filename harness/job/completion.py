"""When a run is over, and how it ended: the job's outcome, in one place.

A run ends normally when a group trains to the last step (the others are at most a step behind
and are asked to stop after the same step), when every group of a program of the user's own has
exited 0, when it has run for its duration, when its caller stops it, or when its caller says
it is over (:meth:`Completion.end`: a chaos run whose every fault fired and every recovery
closed, ``experiments.chaos_job``). It fails when a failure
reaches the root of the supervision tree, when its journal cannot be written (every report is
computed from the journal), when it exceeds its timeout, or when a watch of the job gives up on it
(:meth:`Completion.fail`: steps that only abort, ``harness.job.stall``; a SLURM allocation that
ended, or no host left to run on, ``harness.job.hosts``).
"""

from __future__ import annotations

import concurrent.futures as cf
import threading
import time
from collections.abc import Callable, Iterable

from runtime.failure import Failure


class Completion:
    """The job's end condition. Thread-safe; ``fatal()`` is the failure that stopped the job,
    if any (the controller's)."""

    def __init__(self, journal_path: str, fatal: Callable[[], Failure | None]) -> None:
        self._journal_path = journal_path
        self._fatal = fatal
        self._done = threading.Event()
        self._journal_error: OSError | None = None
        self._failed: str | None = None
        self._ended: str | None = None

    def journal_failed(self, exc: OSError) -> None:
        """The journal could not be written: the run ends (``Journal.on_error``)."""
        self._journal_error = exc
        self._done.set()

    def fail(self, reason: str) -> None:
        """The run cannot go on, for ``reason`` (what the user reads): it ends as failed. The
        first reason given stands."""
        if self._failed is None:
            self._failed = reason
        self._done.set()

    def end(self, reason: str) -> None:
        """The run is over, and ends well, for ``reason`` (what the user reads)."""
        if self._ended is None:
            self._ended = reason
        self._done.set()

    @property
    def given_up(self) -> str | None:
        """Why :meth:`fail` ended the run (None: it did not)."""
        return self._failed

    def groups_changed(self, training: Iterable[cf.Future]) -> None:
        """A group's training ended: once one reached the last step, the run is over."""
        if any(f.done() and f.exception() is None for f in training):
            self._done.set()

    def finished(self) -> None:
        """Every group is done."""
        self._done.set()

    def wait(
        self,
        timeout: float | None = None,
        duration_s: float | None = None,
        stop_event: threading.Event | None = None,
    ) -> tuple[str, str]:
        """Block until the run ends (module doc); return its status (``ok`` or ``failed``) and
        the reason."""
        now = time.monotonic()
        deadline = None if timeout is None else now + timeout
        end = None if duration_s is None else now + duration_s
        while True:
            if self._journal_error is not None:
                return "failed", (
                    f"the journal {self._journal_path} could not be written "
                    f"({self._journal_error}); the run stopped, since every report is computed "
                    "from it"
                )
            if self._failed is not None:
                return "failed", self._failed
            if self._done.is_set():
                return "ok", self._ended or "trained to the last step"
            fatal = self._fatal()
            if fatal is not None:
                return "failed", fatal.report()
            if end is not None and time.monotonic() > end:
                return "ok", f"ran for its duration ({duration_s:.1f} s under this controller)"
            if stop_event is not None and stop_event.is_set():
                return "ok", "stopped by its caller"
            if deadline is not None and time.monotonic() > deadline:
                return "failed", f"timed out after {timeout} s"
            self._done.wait(0.1)
