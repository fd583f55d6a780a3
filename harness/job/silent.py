"""Silent failures, acted on by the controller: a diverged replica (``harness.job.divergence``)
and a straggler (``harness.job.stragglers``), judged from the commit records as they reach the
journal, and the I/O around those pure decisions.

* **A non-finite loss on equal weights** (every group's checksum of the step agrees): the data
  is to blame, not the replica; journaled (``silent.divergence``, action ``data``), nobody is
  failed, and ``harness.job.poison`` quarantines the sequences the group named.
* **A diverged group** (the minority of a step's checksums, or a non-finite loss while others'
  are finite and the checksums differ) is failed by the controller: its recovery opens with
  cause ``divergence``, the quorum service fences it (the tree quorum drops it from membership
  at once), and its processes are killed as a hung worker's are. Its supervisor restarts it in
  place and the replacement heals from a group at the quorum's highest step: never from the
  suspect, whose processes are gone before any heal (both quorum backends pick heal sources
  among the quorum's members at its max step, torchft's Lighthouse round-robin whatever their
  weights: a dead incarnation is no member). Its checkpoints from the detection step on are
  quarantined.
* **No majority** (two groups that differ, or three that all differ): ``rollback``. Every
  checkpoint after the last step whose checksums agreed is quarantined and every group is
  failed; with no group left holding state the job resumes from its last (agreed) checkpoint
  (``Job._on_every_group_lost``), or from step 0 without one.
* **A straggler** is journaled (``straggler``: ``flagged``, ``cleared``); under ``eject`` a
  flagged group is failed the same way (cause ``straggler``), leaves the quorum, is restarted
  in place (a warm spare when there is one) and rejoins with the next quorum, its step times
  judged afresh. A slowness bound to the process ends with it; one bound to the host shows again
  in the new incarnation's window and ejects it again. Each ejection is a restart, counted
  against the group's restart intensity.

State kept here is derived from the journal (the commit records), as the design asks of the
controller: a controller rebuilt from the journal reaches the same decisions.
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import shutil
import time
from pathlib import Path
from typing import Any, Protocol

from harness.config import JobConfig
from harness.job.divergence import Divergence, Verdict
from harness.job.groups import Groups
from harness.job.recovery import RecoveryTracker
from harness.job.replica_group import GroupTable
from harness.job.stragglers import StragglerDetector, StragglerEvent
from harness.quorum.service import QuorumService
from runtime.controller import Controller
from runtime.journal import (
    BITFLIP,
    FAULT_INJECT,
    JOB_RESTART,
    SILENT_DIVERGENCE,
    STEP_COMMIT,
    STRAGGLER,
    Journal,
    Record,
)

log = logging.getLogger(__name__)


class Job(Protocol):
    """What this module uses of ``harness.job.protocol.Job`` (which imports this module)."""

    cfg: JobConfig
    journal: Journal
    tracker: RecoveryTracker
    groups: GroupTable
    replicas: int
    run_dir: Path

    @property
    def controller(self) -> Controller: ...

    @property
    def groups_kind(self) -> Groups: ...

    @property
    def quorum(self) -> QuorumService: ...

    def say(self, text: str) -> None: ...


class SilentWatch:
    """Wired into a :class:`~harness.job.protocol.Job` as a journal sink. Decisions are made on the
    journal's thread (cheap); acting on them (fence, kill, quarantine) on a thread of its own."""

    def __init__(self, job: Job) -> None:
        self.job = job
        r = job.cfg.recovery
        self.mode = r.divergence
        s = r.stragglers
        self.policy = s.policy
        self.divergence = Divergence()
        self.stragglers = StragglerDetector(
            factor=s.factor, window=s.window, hysteresis=s.hysteresis, eject=s.policy == "eject"
        )
        self._flips: dict[int, list[Record]] = {}
        self._injected: dict[int, str | None] = {}  # replica -> its last bitflip's fault_id
        self._rollback_after: int | None = None  # quarantine checkpoints past this step
        self._rollback_pending: set[int] = set()  # groups not restarted since the rollback
        self._act = cf.ThreadPoolExecutor(1, thread_name_prefix="harness-silent")
        job.journal.add_sink(self.on_record)

    def close(self) -> None:
        self._act.shutdown(wait=True)

    # -- evidence -------------------------------------------------------------------------------
    def on_record(self, r: Record) -> None:
        event = r.get("event")
        if event == FAULT_INJECT and r.get("kind") == "bitflip":
            replica = (r.get("target") or {}).get("replica")
            if replica is not None:
                self._injected[int(replica)] = r.get("fault_id")
        elif event == BITFLIP and r.get("replica") is not None:
            replica = int(r["replica"])
            self._flips.setdefault(replica, []).append(
                {**r, "fault_id": self._injected.get(replica)}
            )
        elif event == JOB_RESTART:
            self.divergence.restart()
        elif event == STEP_COMMIT and r.get("replica") is not None:
            self._on_commit(r)

    def _on_commit(self, r: Record) -> None:
        replica, rank, step = int(r["replica"]), int(r.get("rank") or 0), int(r["step"])
        proc = r.get("proc")
        loss = r.get("loss")
        verdict = self.divergence.on_commit(
            replica=replica,
            rank=rank,
            step=step,
            checksum=r.get("checksum"),
            loss=None if loss is None else float(loss),
            participants=int(r.get("participants") or 1),
            proc=proc,
        )
        if verdict is not None:
            self._act.submit(self._guarded, self._diverged, verdict, time.time())
        if r.get("compute_s") is not None:
            for e in self.stragglers.on_commit(
                replica=replica, rank=rank, step=step, compute_s=float(r["compute_s"]), proc=proc
            ):
                self._act.submit(self._guarded, self._straggler, e)

    # -- actions --------------------------------------------------------------------------------
    def _guarded(self, fn: Any, *args: Any) -> None:
        try:
            fn(*args)
        except Exception:
            log.exception("silent-failure action failed")

    def _diverged(self, v: Verdict, t: float) -> None:
        if v.action == "data":
            self._data_to_blame(v)
            return
        action = v.action if self.mode == "heal" else "observe"
        flip = self._earliest_flip(v.suspects, t)
        self.job.journal.emit(
            SILENT_DIVERGENCE,
            step=v.step,
            rank=v.rank,
            cause=v.cause,
            action=action,
            suspects=list(v.suspects),
            majority=list(v.majority),
            rollback_to=v.rollback_to,
            values={str(k): x for k, x in v.values.items()},
            fault_id=flip.get("fault_id") if flip else None,
            flip_step=flip.get("step") if flip else None,
            latency_steps=v.step - int(flip["step"]) if flip else None,
            latency_s=round(t - float(flip["t"]), 4) if flip else None,
        )
        if action == "observe":
            return
        self.job.say(
            f"replica(s) {list(v.suspects)} diverged at step {v.step} ({v.cause}): {action}"
        )
        if action == "rollback":
            self._rollback_after = v.rollback_to or 0
            self._rollback_pending = set(v.suspects)
            self.quarantine(list(range(self.job.replicas)), self._rollback_after)
        else:
            self.quarantine(list(v.suspects), v.step - 1)
        for replica in v.suspects:
            self.fail_group(
                replica, "divergence", f"silent divergence at step {v.step} ({v.cause})"
            )

    def _data_to_blame(self, v: Verdict) -> None:
        """A non-finite loss on weights every group's checksum shows equal: the data is to
        blame, nobody is condemned; ``harness.job.poison`` quarantines the sequences the
        suspects named (from this record)."""
        self.job.journal.emit(
            SILENT_DIVERGENCE,
            step=v.step,
            rank=v.rank,
            cause=v.cause,
            action="data",
            suspects=list(v.suspects),
            majority=list(v.majority),
            rollback_to=None,
            values={str(k): x for k, x in v.values.items()},
        )
        self.job.say(
            f"replica(s) {list(v.suspects)} had a non-finite loss at step {v.step} on weights "
            "equal to the others': the data is to blame, not the replica"
        )

    def _earliest_flip(self, suspects: tuple[int, ...], t: float) -> Record | None:
        found = [f for r in suspects for f in self._flips.pop(r, []) if float(f["t"]) <= t]
        return min(found, key=lambda f: float(f["t"])) if found else None

    def _straggler(self, e: StragglerEvent) -> None:
        fields: dict[str, Any] = {
            "replica": e.replica,
            "step": e.step,
            "ratio": e.ratio,
            "group_s": e.group_s,
            "others_s": e.others_s,
            "straggler_policy": self.policy,
        }
        self.job.journal.emit(STRAGGLER, action=e.action, **fields)
        if e.action != "flagged" or self.policy != "eject":
            return
        self.job.say(f"replica {e.replica} is a straggler ({e.ratio:.1f}x): ejected")
        self.job.journal.emit(STRAGGLER, action="ejected", **fields)
        self.fail_group(e.replica, "straggler", f"straggler: {e.ratio:.2f}x the other groups")

    def fail_group(self, replica: int, cause: str, detail: str) -> None:
        """Fail the group's current incarnation: recovery opened with ``cause``, the group
        fenced out of the quorum, its processes killed (its supervisor restarts it in place)."""
        job = self.job
        group = job.groups.get(replica)
        if group is None:
            return
        now = time.time()
        job.tracker.failed_by_controller(replica, cause, now)
        job.quorum.fence(replica, job.groups_kind.member_ids(replica))
        for proc_id in group.mesh.proc_ids:
            job.controller.report_hung(proc_id, 0.0, now, detail)

    # -- checkpoints ----------------------------------------------------------------------------
    def before_start(self, replicas: list[int]) -> None:
        """Called before groups start: a rollback's quarantine again, in case a checkpoint
        write in flight when it was decided has landed since (its writer is dead now)."""
        if self._rollback_after is not None:
            self.quarantine(list(range(self.job.replicas)), self._rollback_after)
            self._rollback_pending -= set(replicas)
            if not self._rollback_pending:  # every group restarted: later checkpoints are good
                self._rollback_after = None

    def quarantine(self, replicas: list[int], after_step: int) -> list[str]:
        """Move the checkpoints of ``replicas`` for steps after ``after_step`` out of the resume
        path (``<checkpoints>/quarantine/``); return the moved manifests."""
        root = self.checkpoint_root()
        if root is None or not root.is_dir():
            return []
        moved = []
        for replica in replicas:
            for folder in root.glob(f"replica_{replica}_rank_*"):
                for manifest in sorted(folder.glob("step_*.json")):
                    try:
                        step = int(manifest.stem.split("_")[1])
                    except ValueError:
                        continue
                    if step <= after_step:
                        continue
                    dest = root / "quarantine" / folder.name
                    dest.mkdir(parents=True, exist_ok=True)
                    for f in (manifest, manifest.with_suffix(".pt")):  # manifest first
                        if f.exists():
                            shutil.move(str(f), str(dest / f.name))
                    moved.append(str(manifest))
        return moved

    def checkpoint_root(self) -> Path | None:
        c = self.job.cfg.checkpoint
        if c.every_steps <= 0:
            return None
        return Path(c.dir) if c.dir else self.job.run_dir / "checkpoints"
