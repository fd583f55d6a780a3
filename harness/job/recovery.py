"""Recovery phases, derived from what the tree and the trainers report, written to the journal.

One recovery per failed replica group (or per aborted step, or per quorum-service crash):

    detected            the failure value reached the controller (or a step aborted)
    survivors_resumed   another group committed a step after the detection
    replacement_started the group's new processes are up and its trainers constructed
    healed              torchft loaded a healthy peer's state into the replacement
    participating       the failed group committed a step again

``fault_id`` links a recovery to the ``fault.inject`` that most recently took its group down
within ``link_window_s``: a fault targeting that group, or the host the group failed on (a host
fault takes down every group on that host, so it explains each of their recoveries), or, for the
quorum service, a fault with no target; a program's survivor restarted because it asked for no
quorum after another group's death (cause ``blocked_survivor``, ``harness.job.program.progress``)
by the fault that explained that death; a takeover (cause ``controller_crash``, the job's root:
``replica`` null like the quorum service's) is explained by the latest fault on the controller
not yet linked (a ``controller_crash``, however long it waited for its phase, or a
``controller_node_failure``, which also explains the recoveries of the groups on the
controller's node, its target's host). A fault explains at most one
recovery per group: a later failure of the same group, after that recovery, is not its doing. A
failure nobody injected has ``fault_id`` null.

A controller that takes over (:meth:`RecoveryTracker.resume`) continues the recoveries its
predecessor left open, under their ids: their later phases (healed, participating) are written as
if nothing had happened to the root.
"""

from __future__ import annotations

import collections
import itertools
import math
import threading
from dataclasses import dataclass, field
from typing import Any

from harness.quorum.rule import parse_member_id
from runtime.failure import Failure
from runtime.journal import (
    CHECKPOINT_SAVE,
    CHECKPOINT_START,
    DROPPED,
    ENDINGS,
    FAULT_INJECT,
    GROUP_DROPPED,
    HEAL_START,
    HEALED,
    OVERTAKEN,
    RECOVERY_PHASE,
    SERVE_START,
    STEP_ABORT,
    STEP_COMMIT,
    Journal,
    Record,
)

#: Job.stop's stops reach the groups within this much of one another (a loaded controller).
STOP_SKEW_S = 0.5
#: The cause of a takeover's recovery, and the key it is open under (the job's root: no group).
CONTROLLER_CRASH = "controller_crash"
#: The cause of a program's survivor restarted for asking for no quorum after a death.
BLOCKED_SURVIVOR = "blocked_survivor"
#: The cause of a group restarted by a takeover that could not adopt it while it ran (a later
#: incarnation admitted, its training call gone): ``harness.job.takeover.not_adopted``.
NOT_ADOPTED = "not_adopted"


class _Unset:
    """No fault given: :meth:`RecoveryTracker._link` finds it."""


UNSET = _Unset()
ROOT = "controller"


@dataclass
class _Open:
    recovery_id: str
    replica: int | None
    fault_id: str | None
    cause: str
    t_detected: float
    phases: set[str] = field(default_factory=set)

    @property
    def key(self) -> int | str | None:
        return _key(self.cause, self.replica)


def _key(cause: str, replica: int | None) -> int | str | None:
    """Where a recovery is open: its group, None for the quorum service, ROOT for a takeover."""
    return ROOT if cause == CONTROLLER_CRASH else replica


class RecoveryTracker:
    def __init__(self, journal: Journal, link_window_s: float = 30.0) -> None:
        self.journal = journal
        self.link_window_s = link_window_s
        self._lock = threading.Lock()
        # Held across a commit's phases and each phase's check and journal write: commits reach
        # the tracker on the emitting groups' threads, so without it one thread could journal
        # ``participating`` while another, which had just claimed ``survivors_resumed``, had not
        # yet written it (seen once in CI: a recovery's last phase journaled was
        # ``survivors_resumed``).
        self._write_lock = threading.RLock()
        self._ids = itertools.count(1)
        self._open: dict[int | str | None, _Open] = {}  # by _Open.key
        # Groups whose processes failed and that have not participated since: they hold no
        # training state (a replacement starts from a peer's, or a checkpoint's).
        self._stateless: set[int] = set()
        self._faults: list[Record] = []
        # (fault_id, replica) pairs already explained: a fault explains one recovery per group
        # it took down, never a later one of the same group
        self._linked: set[tuple[str, int | None]] = set()
        self._fault_of: dict[int, str | None] = {}  # replica -> its latest recovery's fault
        # Heals under way: healing group -> its source group (``trainer.heal_start`` of its rank
        # 0, until its ``trainer.healed``, its next commit, or its or its source's failure), and
        # the groups serving one (``trainer.serve_start`` of rank 0, until its next commit)
        self._heals: dict[int, int] = {}
        self._serving: set[int] = set()
        # Checkpoint writes under way: writing group -> step (``checkpoint.start`` of its rank
        # 0, until its ``checkpoint.save`` or the group's failure)
        self._writes: dict[int, int] = {}
        self.committed_step = 0
        # (time, step) when each of the last few new highest steps was first committed
        self._highs: collections.deque[tuple[float, int]] = collections.deque(maxlen=32)
        self.completed = 0
        journal.add_sink(self.on_record)

    def stop_step(self, skew_s: float = STOP_SKEW_S) -> int:
        """The step to stop every group after, when stopping the job now: one that no group
        has passed when its stop arrives. Each quorum is a barrier, so a group stopped a step
        before the others leaves them waiting in the next quorum until the join timeout, then
        committing a step without it. Stops sent now reach the groups within ``skew_s`` of one
        another, so the step is that long ahead at the job's recent rate (and at least 2)."""
        highs = list(self._highs)
        ahead = 1
        if len(highs) >= 2 and highs[-1][0] > highs[0][0]:
            rate = (highs[-1][1] - highs[0][1]) / (highs[-1][0] - highs[0][0])
            ahead = max(1, math.ceil(rate * skew_s))
        return self.committed_step + 1 + ahead

    # -- inputs -------------------------------------------------------------------------------
    def on_failure(self, failure: Failure) -> None:
        if "idle" in failure.coords:
            # an idle warm spare: nothing waited on it, and without a replica it would be
            # taken for the quorum service (a recovery nothing would ever close)
            return
        replica = failure.coords.get("replica")
        if replica is not None:
            with self._lock:
                self._stateless.add(replica)
                self._heals = {h: s for h, s in self._heals.items() if replica not in (h, s)}
                self._serving.discard(replica)
                self._writes.pop(replica, None)
        self._begin(replica, failure.cause.value, failure.t_detected, failure.host)

    def failed_by_controller(self, replica: int, cause: str, t: float) -> None:
        """The controller itself fails ``replica`` (a diverged replica, an ejected straggler,
        ``harness.job.silent``): its recovery opens with ``cause`` before the kill's failure
        arrives, which then belongs to it."""
        self._begin(replica, cause, t, None)

    def failed_as_survivor(self, replica: int, dead: int, t: float) -> None:
        """The controller fails ``replica``, a survivor ``dead``'s death left blocked (it asked
        for no quorum since: ``harness.job.program.progress.blocked_survivor``): its recovery
        opens with cause ``blocked_survivor``, explained by the fault that explained ``dead``'s,
        before the kill's failure arrives, which then belongs to it."""
        with self._lock:
            fault_id = self._fault_of.get(dead)
        self._begin(replica, BLOCKED_SURVIVOR, t, None, fault_id=fault_id)

    def resume(self, records: list[Record]) -> None:
        """After a takeover: continue from the last controller's journal: its committed steps,
        its faults, and recovery ids above its own (``harness.job.takeover``), and the
        recoveries it left open, under their ids (the module docstring)."""
        for r in records:
            if r.get("event") in (FAULT_INJECT, STEP_COMMIT):
                self.on_record(r)
        numbers = [
            int(str(r.get("recovery_id", ""))[4:])
            for r in records
            if r.get("event") == RECOVERY_PHASE and str(r.get("recovery_id", ""))[4:].isdigit()
        ]
        self._ids = itertools.count(max(numbers, default=0) + 1)
        self.completed = completed(records)
        for rec in _still_open(records):
            with self._lock:
                self._open[rec.key] = rec
                if rec.fault_id is not None:
                    self._linked.add((rec.fault_id, rec.replica))
                if rec.replica is not None and rec.cause != "step_abort":
                    self._stateless.add(rec.replica)

    def controller_replaced(self, t_detected: float) -> None:
        """A new controller took over (``harness.job.takeover``): a recovery of the job's root,
        detected now; the new controller serves (``replacement_started``) at once, and its
        first commit after that is ``participating``. A takeover of a takeover that had not
        committed yet continues the first one's recovery."""
        self._begin(None, CONTROLLER_CRASH, t_detected, None)
        self._phase(ROOT, "replacement_started")

    def replacement_started(self, replica: int | None) -> None:
        self._phase(replica, "replacement_started")

    def on_record(self, r: Record) -> None:
        event = r.get("event")
        if event == FAULT_INJECT:
            with self._lock:
                self._faults.append(r)
        elif event == STEP_COMMIT:
            with self._write_lock:  # one commit at a time: its phases in order (see __init__)
                self._on_commit(r)
        elif event == STEP_ABORT and r.get("rank") == 0:
            # An aborted step is its own recovery only when a fault hit this group without
            # killing it (collective_abort); survivors of a peer's death abort a step too, and
            # that stall belongs to the peer's recovery. Only the latest fault can explain it:
            # an earlier one on this group that aborted nothing (a straggler) must not claim
            # the abort a later fault on another group causes here (seen in a soak).
            with self._lock:
                fault_id = self._link(r.get("replica"), None, r["t"], "step_abort")
                latest = self._faults[-1]["fault_id"] if self._faults else None
            if fault_id is not None and fault_id == latest:
                self._begin(r.get("replica"), "step_abort", r["t"], r.get("host"))
        elif event == HEAL_START and r.get("rank") == 0:
            source = parse_member_id(str(r.get("source") or ""))
            if source is not None:
                with self._lock:
                    self._heals[r["replica"]] = source.replica
        elif event == SERVE_START and r.get("rank") == 0:
            with self._lock:
                self._serving.add(r["replica"])
        elif event == HEALED and r.get("rank") == 0:
            with self._lock:
                self._heals.pop(r.get("replica", -1), None)
            self._phase(r.get("replica"), "healed")
        elif event == GROUP_DROPPED:  # never restarted: its recovery ends here
            self._end(int(r["replica"]), DROPPED, r["t"])
        elif event == CHECKPOINT_START and r.get("rank") == 0:
            with self._lock:
                self._writes[r["replica"]] = int(r.get("step", 0))
        elif event == CHECKPOINT_SAVE and r.get("rank") == 0:
            with self._lock:
                self._writes.pop(r.get("replica", -1), None)

    # -- bookkeeping --------------------------------------------------------------------------
    def _link(self, replica: int | None, host: str | None, t: float, cause: str) -> str | None:
        """The fault that explains a recovery of ``replica`` (failed on ``host``) at ``t`` for
        ``cause``, or None (see the module docstring)."""
        root = cause == CONTROLLER_CRASH
        for f in reversed(self._faults):
            if t - f["t"] > self.link_window_s and not root:
                break
            if (f["fault_id"], replica) in self._linked:
                continue
            tgt = f.get("target") or {}
            # a fault on the controller explains a takeover; one on its node (with a host:
            # controller_node_failure) also the groups that were on that node
            if bool(tgt.get("controller")) != root and (root or tgt.get("host") is None):
                continue
            if root:
                return f["fault_id"]
            if replica is not None and tgt.get("replica") == replica:
                return f["fault_id"]
            if tgt.get("replica") is None and host is not None and tgt.get("host") == host:
                return f["fault_id"]
            if replica is None and tgt.get("replica") is None and tgt.get("host") is None:
                return f["fault_id"]
        return None

    def _begin(
        self,
        replica: int | None,
        cause: str,
        t: float,
        host: str | None,
        fault_id: str | _Unset | None = UNSET,
    ) -> None:
        """Open a recovery, explained by ``fault_id`` if given (None: by no fault), else by
        :meth:`_link`."""
        with self._lock:
            key = _key(cause, replica)
            if key in self._open:
                return  # one recovery per group at a time; later failures belong to it
            if isinstance(fault_id, _Unset) or (fault_id, replica) in self._linked:
                fault_id = self._link(replica, host, t, cause)
            rec = _Open(f"rec-{next(self._ids)}", replica, fault_id, cause, t)
            if rec.fault_id is not None:
                self._linked.add((rec.fault_id, replica))
            if replica is not None:
                self._fault_of[replica] = rec.fault_id  # None too: an unplanned death
            self._open[key] = rec
        self._write(rec, "detected", t)

    def _phase(self, replica: int | str | None, phase: str, t: float | None = None) -> None:
        with self._lock:
            rec = self._open.get(replica)
            if rec is None or phase in rec.phases:
                return
        self._write(rec, phase, t)

    def _on_commit(self, r: Record) -> None:
        replica, t = r.get("replica"), r["t"]
        step = int(r.get("step", 0))
        if step > self.committed_step:
            self.committed_step = step
            self._highs.append((float(t), step))
        with self._lock:
            self._heals.pop(r.get("replica", -1), None)
            self._serving.discard(r.get("replica", -1))
            recs = list(self._open.values())
        for rec in recs:
            if t < rec.t_detected:
                continue
            # the quorum service or the controller: every group waited on it
            service = rec.replica is None
            if service and "replacement_started" not in rec.phases:
                continue  # a commit in flight before the crash does not count
            if rec.replica != replica and "survivors_resumed" not in rec.phases:
                self._write(rec, "survivors_resumed", t)
            ours = rec.replica == replica or service
            if ours and ("replacement_started" in rec.phases or rec.cause == "step_abort"):
                if int(r.get("participants", 1)) > 1:
                    # a joint commit: the survivors committed this step too, even if the
                    # replacement's record of it reached the journal before theirs
                    self._write(rec, "survivors_resumed", t)
                if service:
                    self._write(rec, "healed", t)  # nothing to heal: the groups kept their state
                self._write(rec, "participating", t)
                with self._lock:
                    self._open.pop(rec.key, None)
                    if rec.replica is not None:
                        self._stateless.discard(rec.replica)
                    self.completed += 1

    def _write(self, rec: _Open, phase: str, t: float | None) -> None:
        fields: dict[str, Any] = {
            "recovery_id": rec.recovery_id,
            "fault_id": rec.fault_id,
            "replica": rec.replica,
            "phase": phase,
            "cause": rec.cause,
        }
        with self._write_lock:  # phases reach the journal in the order they were claimed
            with self._lock:
                if phase in rec.phases:
                    return
                rec.phases.add(phase)
            self.journal.emit(RECOVERY_PHASE, t=t, **fields)

    def overtaken(self, replica: int) -> bool:
        """The job ended while ``replica`` was still rejoining (``runtime.journal.OVERTAKEN``):
        close its open recovery with that phase. Returns whether one was open."""
        with self._lock:
            self._stateless.discard(replica)
        return self._end(replica, OVERTAKEN)

    def _end(self, replica: int, phase: str, t: float | None = None) -> bool:
        """Close ``replica``'s open recovery with ``phase`` (one of ``ENDINGS``), if one is."""
        with self._lock:
            rec = self._open.pop(replica, None)
        if rec is None:
            return False
        self._write(rec, phase, t)
        return True

    def stateless_replicas(self) -> set[int]:
        """Groups whose processes failed and that have not committed a step since."""
        with self._lock:
            return set(self._stateless)

    def heals_under_way(self) -> dict[int, int]:
        """The groups healing from a peer now, each with its source group (the ``source`` of its
        rank 0's ``trainer.heal_start``), once that source has begun to send (its rank 0's
        ``trainer.serve_start``: the quorum's process group configured, the transfer begun)."""
        with self._lock:
            return {h: s for h, s in self._heals.items() if s in self._serving}

    def checkpoints_under_way(self) -> dict[int, int]:
        """The groups writing a checkpoint now, each with its step (its rank 0's
        ``checkpoint.start``, until its ``checkpoint.save``: the checkpoint in place)."""
        with self._lock:
            return dict(self._writes)

    def open_replicas(self) -> set[int | None]:
        """The groups recovering now (None: the quorum service)."""
        with self._lock:
            return {k for k in self._open if k != ROOT}  # type: ignore[misc]

    @property
    def open_count(self) -> int:
        with self._lock:
            return len(self._open)


def _still_open(records: list[Record]) -> list[_Open]:
    """The recoveries ``records`` (a dead controller's journal) left open: ``detected`` and not
    ``participating``, with the phases they reached."""
    by_id: dict[str, _Open] = {}
    closed: set[str] = set()
    for r in records:
        if r.get("event") != RECOVERY_PHASE:
            continue
        rid, phase = str(r.get("recovery_id")), str(r.get("phase"))
        if phase == "participating" or phase in ENDINGS:
            closed.add(rid)
        rec = by_id.get(rid)
        if rec is None and phase == "detected":
            rec = by_id[rid] = _Open(
                rid, r.get("replica"), r.get("fault_id"), str(r.get("cause")), float(r["t"])
            )
        if rec is not None:
            rec.phases.add(phase)
    return [rec for rid, rec in by_id.items() if rid not in closed]


def completed(records: list[Record]) -> int:
    """How many recoveries ``records`` (a journal) saw reach ``participating``."""
    return len(
        {
            r.get("recovery_id")
            for r in records
            if r.get("event") == RECOVERY_PHASE and r.get("phase") == "participating"
        }
    )
