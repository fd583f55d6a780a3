"""The job's record of one replica group's current incarnation (:class:`ReplicaGroup`): what
the job (``harness.job.protocol``), its kinds of groups (``harness.job.groups``,
``harness.job.program.groups``) and a takeover (``harness.job.takeover``) all hold of a group."""

from __future__ import annotations

import concurrent.futures as cf
from dataclasses import dataclass

from runtime.mesh import ActorMesh, ProcMesh


@dataclass
class ReplicaGroup:
    """One replica group's current incarnation. Replaced whole by every restart."""

    replica: int
    incarnation: int
    host: str
    mesh: ActorMesh | ProcMesh  # the group's ranks, dims {"replica": 1, "rank": ranks}
    store: str | None  # its TCPStore's host:port (runtime.group_store); None: adopted
    training: cf.Future  # rank 0's ``train`` call: done when the group stops training
