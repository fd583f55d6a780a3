"""How a job starts: fresh, or as a takeover of a dead controller's run. The job
(``harness.job.protocol.Job``) calls one of these at the same points of its start, never asking
which it holds.

* :class:`FreshStart`: the job begins (``job.start`` journalled), its hosts and quorum service
  start, every host checks that it reaches every other, then its groups start.
* :class:`TakeoverStart`: a new controller continues a run (``harness.job.takeover``): the
  recovery tracker continues from the journal, the quorum service serves its members where it
  was, the agents re-dial, running groups are adopted as they start, and whatever no group claims
  is stopped.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Protocol

from harness.job import takeover
from harness.job.preflight import check_network
from harness.job.takeover import GroupPlan, Plan, TakenOver
from runtime.journal import JOB_START, Record

if TYPE_CHECKING:
    from harness.job.groups import Groups
    from runtime.mesh import ActorMesh, ProcMesh


class Starting(TakenOver, Protocol):
    """What a start reads of the job it starts (``harness.job.protocol.Job`` is one)."""

    replicas: int
    cfg_dict: dict[str, Any]  # the config as the journal and every rank get it

    @property
    def groups_kind(self) -> Groups: ...


class JobStart(Protocol):
    """What :class:`~harness.job.protocol.Job` calls while it starts."""

    #: The dead controller's plan (a takeover), or None.
    plan: Plan | None
    #: The run's journal so far: the dead controller's records (a takeover), or none.
    history: list[Record]
    #: The groups the dead controller dropped (``TrainerGroups.drop``): never started again.
    dropped: frozenset[int]

    @property
    def resumes(self) -> bool:
        """Whether the quorum service continues from its durable state."""
        ...

    def adopt(self, job: Starting, replica: int) -> ActorMesh | ProcMesh | None:
        """The first start of ``replica``: the dead controller's group still running, adopted
        (``job.groups_kind.adopt``), or None: start it (another time, or it could not be)."""
        ...

    def first_incarnation(self, replica: int) -> int:
        """The incarnation a group this controller starts first is: 0, or past a group of the
        dead controller's that could not be adopted."""
        ...

    def before(self, job: Starting) -> None:
        """Once the controller exists, before anything else is built."""
        ...

    def bring_up(self, job: Starting) -> None:
        """Hosts and quorum service, once the kind of groups has started; before the tree."""
        ...

    def after_tree(self, job: Starting) -> None:
        """Once the supervision tree is built (and its groups started or adopted)."""
        ...


class FreshStart:
    plan: Plan | None = None
    resumes = False
    dropped: frozenset[int] = frozenset()

    def __init__(self) -> None:
        self.history: list[Record] = []

    def adopt(self, job: Starting, replica: int) -> ActorMesh | ProcMesh | None:
        return None

    def first_incarnation(self, replica: int) -> int:
        return 0

    def before(self, job: Starting) -> None:
        return None

    def bring_up(self, job: Starting) -> None:
        job.journal.emit(JOB_START, config=job.cfg_dict, replicas=job.replicas, ranks=job.ranks)
        job.hosts.start()
        job.quorum.start()
        job.relay_quorum()
        check_network(job)  # every host reaches every other, or no group starts

    def after_tree(self, job: Starting) -> None:
        return None


class TakeoverStart:
    resumes = True

    def __init__(self, plan: Plan) -> None:
        self.plan: Plan | None = plan
        self._plan = plan
        self.history = plan.records
        self.dropped = plan.dropped
        self._adopting: dict[int, GroupPlan] = dict(plan.groups)  # not yet started again
        self._incarnations: dict[int, int] = {}  # of a group that could not be adopted

    def adopt(self, job: Starting, replica: int) -> ActorMesh | ProcMesh | None:
        plan = self._adopting.pop(replica, None)
        if plan is None:
            return None
        adopted = job.groups_kind.adopt(job, plan)
        if adopted is None:
            self._incarnations[replica] = takeover.next_incarnation(job, plan)
        return adopted

    def first_incarnation(self, replica: int) -> int:
        return self._incarnations.get(replica, 0)

    def before(self, job: Starting) -> None:
        job.tracker.resume(self._plan.records)
        job.tracker.controller_replaced(time.time())

    def bring_up(self, job: Starting) -> None:
        takeover.reattach(job)  # the agents re-dial (or are lost), the quorum goes on

    def after_tree(self, job: Starting) -> None:
        takeover.release_unclaimed(job)


def job_start(plan: Plan | None) -> JobStart:
    """A takeover of ``plan``'s run, or (None) a fresh start."""
    return FreshStart() if plan is None else TakeoverStart(plan)
