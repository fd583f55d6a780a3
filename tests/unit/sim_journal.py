"""A simulated run shaped like experiments/monarch_case_study.toml, journalled through the real
``Journal`` and ``RecoveryTracker``: 4 replica groups x 2 ranks on 2 hosts (group g on host
g % 2), a step every 0.1 s, and the fault mix of the case study on a fixed schedule: a kill, a
host eviction that takes down two groups at once, a collective abort, a quorum-service crash,
and a spontaneous crash no fault explains. The recovery phases in it are the tracker's own.

The training itself is simulated (when groups commit, how long survivors stall), so the
journal is as a real run writes it but needs no processes: ``simulate(policy)`` returns its
records in the order the journal's sinks saw them (which is time order).
"""

from __future__ import annotations

import time as _time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import runtime.journal as journal_module
from harness.job.recovery import HEALED, RecoveryTracker
from runtime.failure import Cause, Failure
from runtime.journal import (
    CHECKPOINT_LOAD,
    FAILURE,
    FAULT_INJECT,
    JOB_END,
    JOB_RESTART,
    JOB_START,
    PROC_START,
    STEP_ABORT,
    STEP_COMMIT,
    Journal,
)

REPLICAS, RANKS, HOSTS = 4, 2, 2
STEP_S = 0.1
ROUND_S = 0.01  # the spread of one round's commits (group after group, rank after rank)
CHECKPOINT_EVERY = 25
T0 = 1_000.0
#: (fault_id, kind, target, at): the plan both policies run.
PLAN = (
    ("f000", "kill", {"replica": 2, "rank": 0, "host": "host0"}, T0 + 3.05),
    ("f001", "host_eviction", {"replica": None, "rank": None, "host": "host1"}, T0 + 9.05),
    ("f002", "collective_abort", {"replica": 0, "rank": None, "host": "host0"}, T0 + 15.05),
    ("f003", "lighthouse_crash", {"replica": None, "rank": None, "host": None}, T0 + 20.05),
)
UNPLANNED_AT = T0 + 26.05  # group 2 crashes on its own
END = T0 + 32.0


class _Clock:
    """Stands in for the ``time`` module inside runtime.journal: records the tracker writes
    without a time (``replacement_started``) get the simulated now."""

    def __init__(self) -> None:
        self.now = T0

    def time(self) -> float:
        return self.now


@contextmanager
def _simulated_clock(clock: _Clock) -> Iterator[None]:
    journal_module.time = clock  # type: ignore[assignment]
    try:
        yield
    finally:
        journal_module.time = _time


class _Run:
    def __init__(self, policy: str) -> None:
        self.policy = policy
        self.clock = _Clock()
        self.records: list[dict[str, Any]] = []
        self.journal = Journal(None, job="sim", policy=policy)
        self.journal.add_sink(self.records.append)
        self.tracker = RecoveryTracker(self.journal)
        self.host = {g: f"host{g % HOSTS}" for g in range(REPLICAS)}
        self.back_at: dict[int, float] = {}  # a down group -> when it commits again
        self.next_round = T0 + 0.5
        self.step = 0
        self.pid = 100

    # -- time ---------------------------------------------------------------------------------
    def emit(self, event: str, at: float, **fields: Any) -> None:
        self.clock.now = at
        self.journal.emit(event, t=at, **fields)

    def advance(self, to: float) -> None:
        """Commit every round that ends before ``to``, then set the clock to ``to``."""
        while self.next_round + ROUND_S <= to:
            self._round(self.next_round)
            self.next_round += STEP_S
        if self.next_round < to:
            self.next_round = to  # a round would straddle ``to``: it starts after instead
        self.clock.now = to

    def _round(self, at: float) -> None:
        up = [g for g in range(REPLICAS) if self.back_at.get(g, 0.0) <= at]
        for g in up:
            self.back_at.pop(g, None)
            for rank in range(RANKS):
                # each group's ranks commit a few ms apart, group after group
                self.emit(
                    STEP_COMMIT,
                    at + 0.002 * g + 0.0005 * rank,
                    replica=g,
                    rank=rank,
                    host=self.host[g],
                    step=self.step,
                    loss=2.0,
                    checksum=f"{self.step:08x}",
                    step_time_s=STEP_S,
                    samples=4,
                    participants=len(up),
                )
        self.step += 1

    # -- what the harness does ----------------------------------------------------------------
    def start(self, groups: list[int], at: float) -> None:
        for g in groups:
            for rank in range(RANKS):
                self.pid += 1
                self.emit(PROC_START, at, replica=g, rank=rank, host=self.host[g], pid=self.pid)
        for g in groups:
            self.tracker.replacement_started(g)

    def fail(self, group: int | None, at: float, cause: Cause = Cause.SIGNAL) -> None:
        coords = {"service": 0} if group is None else {"replica": group, "rank": 0}
        host = "host0" if group is None else self.host[group]
        failure = Failure(
            cause=cause, detail="simulated", host=host, coords=coords, t_event=at, t_detected=at
        )
        self.emit(FAILURE, at, **failure.journal_fields())
        self.tracker.on_failure(failure)

    def full_restart(self, at: float) -> None:
        """Every group stops, restarts and reloads the last checkpoint (steps since are lost)."""
        self.emit(JOB_RESTART, at, reason="full_restart policy")
        for g in range(REPLICAS):
            self.back_at[g] = at + 3.0
        self.start(list(range(REPLICAS)), at + 1.0)
        self.step = (self.step // CHECKPOINT_EVERY) * CHECKPOINT_EVERY
        self.emit(CHECKPOINT_LOAD, at + 2.8, step=self.step, path="ckpt")
        self.next_round = at + 3.0

    def replace_in_place(self, groups: list[int], at: float, stall_s: float) -> None:
        """The failed groups restart and heal from a peer; the survivors stall ``stall_s``."""
        for g in groups:
            self.back_at[g] = at + 2.2
        self.next_round = max(self.next_round, at + stall_s)
        self.advance(at + 0.6)
        self.start(groups, at + 0.6)
        self.advance(at + 1.9)
        for g in groups:
            self.emit(HEALED, at + 1.9, replica=g, rank=0, host=self.host[g])


def simulate(policy: str) -> list[dict[str, Any]]:
    """The records of one policy's run, in the order the journal's sinks received them."""
    run = _Run(policy)
    with _simulated_clock(run.clock):
        run.emit(JOB_START, T0, config={}, replicas=REPLICAS, ranks=RANKS)
        run.start(list(range(REPLICAS)), T0 + 0.01)
        for fault_id, kind, target, at in PLAN:
            run.advance(at)
            run.emit(FAULT_INJECT, at, fault_id=fault_id, kind=kind, target=target, seed=25)
            if kind == "kill":
                run.back_at[2] = at + 10.0  # dead: commits nothing until replaced
                run.advance(at + 0.05)
                run.fail(2, at + 0.05)
                if policy == "full_restart":
                    run.full_restart(at + 0.1)
                else:
                    run.replace_in_place([2], at + 0.05, stall_s=0.8)
            elif kind == "host_eviction":
                for g in (1, 3):
                    run.back_at[g] = at + 10.0  # down until replaced
                run.advance(at + 0.3)  # the agent's heartbeat goes overdue
                for g in (1, 3):
                    run.fail(g, at + 0.3, Cause.LOST_HOST)
                if policy == "full_restart":
                    for g in (1, 3):
                        run.host[g] = "host0"  # host1 is cooling down
                    run.full_restart(at + 0.35)
                else:
                    for g in (1, 3):
                        run.host[g] = "host0"
                    run.replace_in_place([1, 3], at + 0.3, stall_s=1.5)
            elif kind == "collective_abort":
                run.back_at[0] = at + 0.4  # the aborted step, and the next one's quorum
                run.advance(at + 0.04)
                run.emit(STEP_ABORT, at + 0.04, replica=0, rank=0, step=run.step, reason="abort")
            else:  # lighthouse_crash: every group waits for the restarted quorum service
                run.next_round = max(run.next_round, at + 1.5)
                run.advance(at + 0.1)
                run.fail(None, at + 0.1)
                run.advance(at + 1.3)
                run.tracker.replacement_started(None)
        run.back_at[2] = UNPLANNED_AT + 10.0
        run.advance(UNPLANNED_AT)
        run.fail(2, UNPLANNED_AT, Cause.SIGNAL)
        if policy == "full_restart":
            run.full_restart(UNPLANNED_AT + 0.05)
        else:
            run.replace_in_place([2], UNPLANNED_AT, stall_s=0.7)
        run.advance(END)
        run.emit(JOB_END, END, status="ok", reason="", steps=run.step)
    return run.records
