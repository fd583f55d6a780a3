"""Replica groups: the job's record of each (:class:`ReplicaGroup`), and spawn for the built-in
trainer: each replica group's ranks forked on its host (warm spares
adopted where there are), a ``TrainerActor`` built in each, and training started at once.

A program of the user's own takes this module's place (``harness.job.programs``); both start
groups through the same call (:class:`GroupStarter`), so the job never asks which it holds.
"""

from __future__ import annotations

import concurrent.futures as cf
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from harness.quorum.service import QuorumService
from runtime.controller import Controller
from runtime.host_handle import HostAgentHandle
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


class GroupStarter(Protocol):
    def start_groups(
        self,
        replicas: list[int],
        hosts: dict[int, HostAgentHandle],
        incarnation: dict[int, int],
        stores: dict[int, str],
        cold: bool = False,
        member_ids: dict[int, str] | None = None,
    ) -> tuple[ActorMesh | ProcMesh, dict[int, cf.Future]]:
        """Start every rank of ``replicas`` (incarnation ``incarnation[r]`` of group ``r`` on
        ``hosts[r]``, with its fresh store at ``stores[r]`` (``host:port``) and, if the quorum
        service names its members, the replica id ``member_ids[r]``); return them as one mesh
        {"replica", "rank"} and each group's training future (done when the group stops
        training). ``cold``: fresh interpreters (a full restart pays the imports a scheduler's
        restart pays)."""
        ...


class TrainerGroups:
    """The built-in trainer's groups (:class:`GroupStarter`); ``on_done()`` runs whenever a
    group's training ends."""

    def __init__(
        self,
        controller: Controller,
        cfg_dict: dict[str, Any],
        run_dir: Path,
        quorum: QuorumService,
        on_done: Callable[[], None],
    ) -> None:
        self.controller = controller
        self.cfg_dict = cfg_dict
        self.run_dir = run_dir
        self.quorum = quorum
        self.on_done = on_done

    def start_groups(
        self,
        replicas: list[int],
        hosts: dict[int, HostAgentHandle],
        incarnation: dict[int, int],
        stores: dict[int, str],
        cold: bool = False,
        member_ids: dict[int, str] | None = None,
    ) -> tuple[ActorMesh, dict[int, cf.Future]]:
        # Every fork is requested before any is awaited, and the trainers of several groups
        # are constructed in parallel (a full restart brings them all back at once).
        from harness.rank.actors import TrainerActor

        ranks = self.cfg_dict["ranks"]
        meshes = self.controller.spawn_many(
            [(hosts[r], {"rank": ranks}, {"replica": r}) for r in replicas],
            log_dir=str(self.run_dir / "logs"),
            cold=cold,
        )
        actors = ProcMesh.stack(meshes, "replica").spawn(
            "trainer",
            TrainerActor,
            self.cfg_dict,
            stores,
            self.quorum.address,
            str(self.run_dir),
            member_ids or {},
        )
        call = actors.train.call()
        training = {r: call.futures[(i, 0)] for i, r in enumerate(replicas)}
        for future in training.values():
            future.add_done_callback(lambda _: self.on_done())
        return actors, training
