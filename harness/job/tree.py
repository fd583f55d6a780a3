"""The job's supervision tree, per recovery policy, and the start of its replica groups: steps
3 to 5 of the job-level protocol (``harness.job.protocol``: stop, place, spawn).

The tree (``in_place``)::

    controller (root: an escalation here stops the job)
    └── job             one_for_one, gives up at the first escalation from below
        ├── quorum      one_for_one: a quorum service in a process of its own, if it has one
        │               (torchft's Lighthouse: restarted on its port; ``harness.quorum.service``)
        └── replica<r>  one_for_all over the group's ranks, restart intensity from the config
            └── ranks   a mesh {"rank": ranks} of TrainerActors on the group's host

Under ``full_restart`` (the baseline: what a SLURM or torchrun job gets) the job supervisor is
one_for_all over the quorum and one child holding every group, so any failure stops every
process and the whole job restarts from its last checkpoint, all groups at once, in fresh
interpreters that import torch again (``cold`` spawns). The host agents themselves stay up: the
baseline does not pay for node allocation, so the comparison favours it.
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import functools
import time
from typing import Protocol

from harness.job import takeover
from harness.job.replica_group import GroupTable, ReplicaGroup
from harness.job.silent import SilentWatch
from harness.job.start import JobStart, Starting
from runtime.host_handle import HostAgentHandle
from runtime.journal import JOB_RESTART
from runtime.mesh import ActorMesh, ProcMesh
from runtime.spec import Strategy, SupervisorSpec
from runtime.supervisor import Supervisor


class Spawning(Starting, Protocol):
    """What the tree reads of the job it supervises (``harness.job.protocol.Job`` is one)."""

    how: JobStart
    groups: GroupTable
    silent: SilentWatch | None


class GroupTree:
    """Builds ``job``'s supervision tree (:meth:`build`) and starts its groups, first and again
    (:meth:`start_groups`: the tree's children call it)."""

    def __init__(self, job: Spawning) -> None:
        self.job = job
        self._started = False  # a start of groups has completed: any later one is a restart

    def build(self) -> Supervisor:
        job = self.job
        r = job.cfg.recovery
        service = job.quorum.supervised_child()
        intensity = SupervisorSpec(max_restarts=r.max_restarts, within_s=r.within_s)
        group_spec = dataclasses.replace(intensity, strategy=Strategy.ONE_FOR_ALL, grace_s=0.5)
        # every group but those a dead controller dropped (a takeover: JobStart.dropped)
        live = [rep for rep in range(job.replicas) if rep not in job.how.dropped]
        absorbs = lambda failure: job.groups_kind.absorbs(failure)  # noqa: E731  (no fault: done)
        if r.policy == "full_restart":
            root = job.controller.supervisor("job", group_spec, on_failure=absorbs)
            if service is not None:
                root.add_child("quorum", service)
            # One child for all groups: a full restart brings them back together, in parallel.
            root.add_child("groups", lambda: self.start_groups(live))
            return root
        root = job.controller.supervisor("job", SupervisorSpec(max_restarts=0))
        if service is not None:
            root.add_supervisor("quorum", intensity).add_child("lighthouse", service)
        for rep in live:
            group = root.add_supervisor(f"replica{rep}", group_spec, on_failure=absorbs)
            group.add_child("ranks", functools.partial(self.start_groups, [rep]))
        return root

    def start_groups(self, replicas: list[int]) -> ActorMesh | ProcMesh:
        """Start replica groups (processes, trainers, then training) and return them stacked
        on a "replica" dimension. Several groups start together: their processes are all
        requested before any is awaited and their trainers are constructed in parallel.
        Runs on the supervisor's restart thread for a restart, so its waits (restart delay, a
        host to become ready) hold up only these groups. After a takeover, a group that still
        runs is adopted instead, the first time (``JobStart.adopt``, ``harness.job.start``)."""
        job = self.job
        if len(replicas) == 1 and (adopted := job.how.adopt(job, replicas[0])) is not None:
            return adopted

        cold = job.cfg.recovery.policy == "full_restart" and self._started
        if cold:
            # Every process after the first start is a fresh interpreter: the baseline pays
            # the imports a scheduler's restart pays (in_place forks warm ones).
            job.journal.emit(
                JOB_RESTART, reason="full_restart: every process restarted from the last checkpoint"
            )
            job.quorum.job_restarted()
        if job.silent is not None:
            job.silent.before_start(replicas)
        if job.cfg.recovery.restart_delay_s and replicas[0] in job.groups:
            time.sleep(job.cfg.recovery.restart_delay_s)
        hosts = {r: job.hosts.place(r) for r in replicas}
        incarnation = {
            r: g.incarnation + 1 if (g := job.groups.get(r)) else job.how.first_incarnation(r)
            for r in replicas
        }
        # A fresh store per incarnation (keys from a dead incarnation must not leak into it),
        # served on the group's host by its agent: it outlives this controller, as the group's
        # ranks do (runtime.group_store).
        stores = {r: job.controller.serve_store(hosts[r], r) for r in replicas}
        # Fence: the quorum service lets in only the incarnation it admitted last, so a stale
        # incarnation (a partitioned group that comes back) can never rejoin or serve weights.
        admitted = {r: job.quorum.admit(r, incarnation[r]) for r in replicas}
        member_ids = {r: m for r, m in admitted.items() if m is not None}
        mesh, training = job.groups_kind.start_groups(
            replicas, hosts, incarnation, stores, cold, member_ids=member_ids
        )
        self._record(replicas, hosts, incarnation, stores, mesh, training)
        self._started = True
        return mesh

    def _record(
        self,
        replicas: list[int],
        hosts: dict[int, HostAgentHandle],
        incarnation: dict[int, int],
        stores: dict[int, str],
        mesh: ActorMesh | ProcMesh,
        training: dict[int, cf.Future],
    ) -> None:
        """Each started group's record (its slice of ``mesh``, stacked on "replica"), journaled
        as a takeover reads it, then its ``replacement_started`` phase."""
        for i, r in enumerate(replicas):
            group = ReplicaGroup(
                replica=r,
                incarnation=incarnation[r],
                host=hosts[r].name,
                mesh=mesh.slice(replica=slice(i, i + 1)),
                store=stores[r],
                training=training[r],
            )
            takeover.journal_group(self.job, group, self.job.groups.started(group))
            self.job.tracker.replacement_started(r)
