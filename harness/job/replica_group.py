"""The job's record of one replica group's current incarnation (:class:`ReplicaGroup`), and its
table of them (:class:`GroupTable`): what the job (``harness.job.protocol``), its kinds of
groups (``harness.job.groups``, ``harness.job.program.groups``) and a takeover
(``harness.job.takeover``) all hold of a group."""

from __future__ import annotations

import concurrent.futures as cf
import threading
from collections.abc import Iterator, Mapping
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


class GroupTable(Mapping[int, ReplicaGroup]):
    """Every replica group's current incarnation, by replica: read from any thread (a failure
    listener, a supervisor's restart thread, the silent-failure watch), each read a consistent
    one. Written only by the job, when a group starts or is adopted."""

    def __init__(self) -> None:
        self._groups: dict[int, ReplicaGroup] = {}
        self._lock = threading.Lock()
        self._starts = 0  # this controller's group starts, numbered (their journal records)

    def started(self, group: ReplicaGroup) -> int:
        """``group`` started (a new incarnation): record it, and return the start's number."""
        with self._lock:
            self._groups[group.replica] = group
            self._starts += 1
            return self._starts

    def adopted(self, group: ReplicaGroup) -> None:
        """``group`` runs, adopted as it runs by a takeover (no start of this controller's)."""
        with self._lock:
            self._groups[group.replica] = group

    def __getitem__(self, replica: int) -> ReplicaGroup:
        with self._lock:
            return self._groups[replica]

    def __iter__(self) -> Iterator[int]:
        with self._lock:
            return iter(list(self._groups))

    def __len__(self) -> int:
        with self._lock:
            return len(self._groups)

    def current(self) -> list[ReplicaGroup]:
        """A copy of every group's current incarnation."""
        with self._lock:
            return list(self._groups.values())

    def incarnation(self, replica: int) -> int | None:
        group = self.get(replica)
        return group.incarnation if group is not None else None

    def proc_ids(self, replica: int | None = None) -> list[str]:
        """The processes of ``replica``'s ranks (none if it never started), or of every group's."""
        groups = self.current() if replica is None else [g for g in [self.get(replica)] if g]
        return [pid for g in groups for pid in g.mesh.proc_ids]
