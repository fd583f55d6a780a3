"""Kinds of replica group (:class:`Groups`), and the built-in trainer's (:class:`TrainerGroups`):
each replica group's ranks forked on its host (warm spares adopted where there are), a
``TrainerActor`` built in each, and training started at once; after a takeover, a group still
training adopted as it runs.

A program of the user's own takes this module's place (``harness.job.program.groups``); both are
a kind of replica group (:class:`Groups`), so the job never asks which it holds.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, Protocol

from harness.config import config_from_dict
from harness.job import takeover
from harness.job.poison import DataMarks
from harness.job.replica_group import ReplicaGroup
from harness.job.takeover import GroupPlan, TakenOver
from harness.job.trainer_deaths import TrainerDeaths
from harness.quorum.service import QuorumService
from runtime.controller import Controller
from runtime.failure import Failure
from runtime.host_handle import HostAgentHandle
from runtime.journal import CONTROLLER_TAKEOVER, GROUP_DROPPED, Journal
from runtime.mesh import ActorMesh, ProcMesh


class Groups(Protocol):
    """A kind of replica group: what the job (``harness.job.protocol.Job``) calls, never asking
    which kind it holds. :class:`TrainerGroups` (the built-in trainer) and
    ``harness.job.program.groups.ProgramGroups`` (a program of the user's own) are the two."""

    def start(self) -> None:
        """Once, before any group starts (a program's quorum tap, its watches)."""
        ...

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

    def adopt(self, job: TakenOver, plan: GroupPlan) -> ActorMesh | ProcMesh | None:
        """After a takeover: adopt the group ``plan`` says runs, as it runs (``job.adopted``);
        None if it cannot be (the caller restarts it)."""
        ...

    def member_ids(self, replica: int) -> tuple[str, ...]:
        """The ids ``replica``'s current incarnation is known by upstream of the quorum service
        (fenced with it), beyond the one the service admitted; () for none."""
        ...

    def absorbs(self, failure: Failure) -> bool:
        """Whether ``failure`` is no fault to recover from (its group had finished): its
        supervisor then restarts nothing."""
        ...

    def quorum_upstream(self) -> str | None:
        """The address the groups' quorum calls must reach (a program's quorum tap), or None:
        the quorum service's own."""
        ...

    def quorum_ids_reset(self) -> None:
        """The quorum service numbers its quorums from the start again."""
        ...

    def poison(self, key: int, effect: str = "unreadable") -> None:
        """The ``poison_data`` fault: the data of ``key`` crashes every step that reads it
        (or, ``effect = "nonfinite"``, gives it a non-finite loss)
        (``harness.job.poison``); ValueError where the kind cannot (a program's data is its
        own)."""
        ...

    def break_device(self, replica: int) -> None:
        """The ``broken_device`` fault: group ``replica`` fails every step from now on, in every
        incarnation; ValueError where the kind cannot (a program's devices are its own)."""
        ...

    def run_in_worker(self, proc_id: str, func: Callable[..., Any], *args: Any) -> None:
        """An in-process fault: ``func(*args)`` (a function of ``harness.rank.actors``) in the
        worker ``proc_id``; in a program of the user's own, the program's hook keyed by
        ``func``'s wire name (``runtime.actor.wire_name``)."""
        ...

    def stop(self) -> None:
        """The job is stopping: every group's training ends (before the job waits on it)."""
        ...

    def close(self) -> None:
        """After every process is stopped."""
        ...


class TrainerGroups:
    """The built-in trainer's groups (:class:`Groups`); ``on_done()`` runs whenever a group's
    training ends; ``members(replica)``: the processes of the group's current incarnation."""

    def __init__(
        self,
        controller: Controller,
        cfg_dict: dict[str, Any],
        run_dir: Path,
        quorum: QuorumService,
        on_done: Callable[[], None],
        data: DataMarks,
        deaths: TrainerDeaths,
        members: Callable[[int], list[str]],
        journal: Journal,
        say: Callable[[str], None],
        dropped: Iterable[int] = (),
    ) -> None:
        self.controller = controller
        self.cfg_dict = cfg_dict
        self.cfg = config_from_dict(cfg_dict)
        self.run_dir = run_dir
        self.quorum = quorum
        self.on_done = on_done
        self.data = data  # poisoned and quarantined data (harness.job.poison)
        self.deaths = deaths  # failures that come back the same way (harness.job.trainer_deaths)
        deaths.drop = self.drop  # a crash loop of one group's own drops that group
        self.members = members
        self.journal = journal
        self.say = say
        self.broken: frozenset[int] = frozenset()  # groups with a broken device (faults.device)
        self.dropped: set[int] = set(dropped)  # (a takeover: those its predecessor dropped)

    def drop(self, replica: int, why: str) -> bool:
        """Go on without group ``replica``, whose failures are its own (``why``, the crash
        loop's diagnosis): it is fenced out of the quorum, what is left of it stopped, and it is
        never restarted. False (nothing done) where fewer than ``min_replica_size`` groups
        would be left: the job ends instead."""
        left = self.cfg_dict["replicas"] - len(self.dropped) - 1
        if left < self.cfg_dict["min_replica_size"]:
            return False
        self.dropped.add(replica)
        self.quorum.fence(replica)
        procs = [p for p in self.members(replica) if p in self.controller.procs]
        self.controller.stop_procs(procs, grace_s=0.5, wait=False)
        self.journal.emit(GROUP_DROPPED, replica=replica, left=left, reason=why)
        self.say(f"group {replica} dropped, {left} group(s) train on: {why.splitlines()[0]}")
        return True

    def break_device(self, replica: int) -> None:
        from harness.rank.actors import break_device

        self.broken = self.broken | {replica}  # its next incarnations too (a new set: a spawn
        # on another thread may be reading the old one)
        for proc in self.members(replica):
            self.run_in_worker(proc, break_device)

    def start(self) -> None:
        return None

    def poison(self, key: int, effect: str = "unreadable") -> None:
        self.data.poison(key, effect)

    def adopt(self, job: TakenOver, plan: GroupPlan) -> ActorMesh | None:
        """Its processes (every rank alive on its host, each with its running ``train`` call)
        become this controller's, and its record the job's (``harness.job.takeover``). None
        if any rank is gone: what is left of it is stopped (``takeover.not_adopted``)."""
        from harness.rank.actors import TrainerActor
        from runtime.mesh import ActorRef, ProcRef
        from runtime.states import ProcState

        c = job.controller
        recs = [c.procs.get(p) for p in plan.procs]
        calls = [
            c.open_calls(p) if r is not None else {} for p, r in zip(plan.procs, recs, strict=True)
        ]
        alive = all(r is not None and r.state is ProcState.RUNNING for r in recs)
        firsts = [
            next((i for i, ep in cs.items() if ep == ("trainer", "train")), None) for cs in calls
        ]
        training_calls = [i for i in firsts if i is not None]  # each rank's, if it trains
        if not alive or len(training_calls) != len(plan.procs) or len(plan.procs) != job.ranks:
            takeover.not_adopted(job, plan, "a rank of the group is gone")
            return None
        c.adopt(list(plan.procs))
        refs: dict[tuple[int, ...], ActorRef] = {
            (0, rank): ActorRef(
                ProcRef(p, plan.host, {"replica": plan.replica, "rank": rank}), "trainer"
            )
            for rank, p in enumerate(plan.procs)
        }
        mesh = ActorMesh(c, TrainerActor, {"replica": 1, "rank": job.ranks}, refs)
        futures = [c.open_call(p, i) for p, i in zip(plan.procs, training_calls, strict=True)]
        training = futures[0]  # rank 0's, as for a group this controller started
        training.add_done_callback(lambda _: self.on_done())
        job.adopted(ReplicaGroup(plan.replica, plan.incarnation, plan.host, mesh, None, training))
        job.journal.emit(
            CONTROLLER_TAKEOVER, replica=plan.replica, adopted=True, procs=list(plan.procs)
        )
        return mesh

    def member_ids(self, replica: int) -> tuple[str, ...]:
        return ()  # its trainers ask the quorum service under the id it admitted

    def absorbs(self, failure: Failure) -> bool:
        if failure.coords.get("replica") in self.dropped:
            return True  # what is left of a dropped group, stopping
        return self.deaths.seen(failure)  # a crash loop: the job ends or the group is dropped

    def quorum_upstream(self) -> str | None:
        return None

    def quorum_ids_reset(self) -> None:
        return None

    def run_in_worker(self, proc_id: str, func: Callable[..., Any], *args: Any) -> None:
        self.controller.run_in_worker(proc_id, func, *args)

    def stop(self) -> None:
        return None  # the job stops its trainers after a step (harness.rank.actors)

    def close(self) -> None:
        return None

    def _hold_quorum(self, starting: list[int]) -> None:
        """Have the groups that run meet at every step until the replacements ``starting``
        have joined them (``Trainer.request_quorum``'s hold), asked before the replacements
        are forked: a replacement's join is then taken in at the next step, instead of raising
        a sparse quorum's flag once it arrives, which takes one or two steps to be honoured.
        Not waited for; a group that does not get it still meets the replacement that way."""
        from harness.rank.actors import request_quorum

        cfg = self.cfg
        if cfg.quorum_every() <= 1:
            return  # they meet at every step anyway
        groups = cfg.replicas - len(self.dropped)
        for r in range(cfg.replicas):
            if r in starting or r in self.dropped:
                continue
            for proc in self.members(r):
                with contextlib.suppress(Exception):
                    self.controller.run_in_worker(
                        proc, request_quorum, cfg.timeouts.quorum_timeout, groups
                    )

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
        # Replacements (not a group's first incarnation) beside live groups that hold committed
        # state load no checkpoint: they heal from those groups (Trainer's peers_hold_state). Not
        # at a job's start, where the group that started first may finish before the other
        # joins it (a run resumed near its last step).
        replacing = all(incarnation[r] > 0 for r in replicas)
        peers_hold_state = replacing and self.quorum.live_step() > 0
        if replacing:
            self._hold_quorum(replicas)
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
            self.data.marks(),
            sorted(self.broken),
            peers_hold_state,
        )
        call = actors.train.call()
        training = {r: call.futures[(i, 0)] for i, r in enumerate(replicas)}
        for future in training.values():
            future.add_done_callback(lambda _: self.on_done())
        return actors, training
