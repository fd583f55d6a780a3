"""One incarnation of a program's replica group as the quorum tap sees it, and what the
program's groups need of their job (``harness.job.program.groups`` runs them)."""

from __future__ import annotations

import concurrent.futures as cf
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from harness.config import JobConfig
from harness.job.program.admission import GroupAdmission
from harness.job.recovery import RecoveryTracker
from harness.job.takeover import Plan
from harness.quorum.service import QuorumService
from runtime.controller import Controller
from runtime.journal import Journal


@dataclass
class ProgramGroup:
    """One incarnation of a program's replica group, as the tap sees it."""

    replica: int
    incarnation: int
    store: str
    procs: list[Any]  # ProcRecords, by rank
    started: float  # monotonic
    training: cf.Future
    member_id: str = ""  # its name at the quorum service (QuorumService.admit); "": none
    ids: set[str] = field(default_factory=set)  # its Managers' own ids, admitted by the tap
    last_step: int | None = None
    last: float | None = None  # monotonic time of the last request or answer
    waiting: int = 0
    participants: int = 1
    hung: bool = False
    long_gaps: int = 0  # consecutive requests close to the progress timeout (-1: told once)
    admission: GroupAdmission = field(default_factory=GroupAdmission)  # the tap's rule's
    gaps: deque = field(default_factory=lambda: deque(maxlen=8))  # answer to next request, s
    survived: tuple[int, float] | None = None  # (dead replica, monotonic t): watched since
    survived_asks: int = 0  # its requests since that death (watched until the second)
    # Adopted from a dead controller (harness.job.program.takeover) at ``last_step``, the
    # journal's: its next request at that step is the one the dead controller saw, asked
    # again (torchft's quorum retries), not an abort.
    resumed: bool = False


class ProgramJob(Protocol):
    """What the program's groups need of their job (``harness.job.protocol.Job`` is one)."""

    cfg: JobConfig
    run_dir: Path
    journal: Journal
    #: Whether a new controller may take the job over (its agents outlive this one).
    survivable: bool
    #: What this controller took over (``harness.job.takeover.Plan``), None for a fresh start.
    plan: Plan | None

    @property
    def controller(self) -> Controller: ...

    @property
    def quorum(self) -> QuorumService: ...

    def say(self, text: str) -> None: ...

    def finished(self) -> None:
        """Every group is done (every rank exited with code 0)."""

    def fail(self, reason: str) -> None:
        """The job cannot go on, for ``reason`` (a crash loop: ``harness.job.crash_loop``)."""

    @property
    def tracker(self) -> RecoveryTracker: ...
