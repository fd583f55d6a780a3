"""The job-level recovery protocol, in one place (as torchft keeps the rank-level one in
``manager.py``; the per-step protocol of one rank is ``harness/rank/trainer.py``).

A job is replica groups of trainer ranks, each group a :class:`ReplicaGroup` record (replica,
host, mesh, store, training future, incarnation), supervised as a tree built per recovery policy.
What happens after a group dies, step by step, and where:

1. **Detect.** The group's host agent reaps the dead worker (an exit, a signal: milliseconds) or
   misses its heartbeats (a hang, a held GIL: the heartbeat timeout), or the controller loses the
   whole agent (a host eviction). ``runtime.controller`` turns it into a ``Failure`` value, writes
   ``failure`` to the journal and calls the failure listeners wired in :meth:`Job._wire_failures`.
   A supervised endpoint (``train``) that raises ends its process too, so an exception is
   detected the same way.
2. **Fence.** In those listeners, before any supervisor acts: the recovery tracker opens a
   recovery (phase ``detected``); the quorum service drops the dead group from membership
   (``QuorumService.fence``: the tree quorum at once, so the survivors' next quorum excludes it
   instead of waiting out a heartbeat timeout; torchft's Lighthouse by heartbeat timeout); and
   when a whole host is lost, every other host closes its connections to it
   (``runtime.host_registry``): a cut link closes nothing, and the survivors' collective with
   the lost group would otherwise wait out the process-group timeout. Every start of a group is
   a new incarnation that the quorum service admits (``QuorumService.admit``), fencing the
   older ones: a cut-off incarnation can never commit or serve weights.
3. **Stop.** The group's supervisor (``replica<r>``, one_for_all over its ranks; restart, or
   escalate past the restart intensity: ``runtime.policy``) stops its remaining ranks (SIGTERM,
   grace, SIGKILL) on its own restart thread.
4. **Place.** ``HostPool.place`` (``harness.job.hosts``): the group's home host if ready, else
   the next ready one (``harness.job.placement``); lost hosts are respawned in the background,
   never on this path.
5. **Spawn.** ``GroupTree.start_groups`` (``harness.job.tree``) forks the group's ranks on that
   host (adopting warm spares where there are), with a fresh TCPStore (a new incarnation), and
   constructs their trainers; the tracker records ``replacement_started``. With ``[program]`` a
   program of the user's own takes the trainers' place (``harness.job.program.groups``: started
   by the agents as plain processes, its progress and liveness read from its quorum requests).
6. **Heal.** The new trainers join the next quorum; torchft sees they are behind and has them
   load a healthy peer's state over the configured transport (``healed``). Groups that skip
   quorums (``recovery.quorum_every_steps``) are asked for one (:meth:`Job.ask_for_quorum`).
   A group failed by the controller itself (a diverged replica, an ejected straggler:
   ``harness.job.silent``) goes through the same steps from 2 on.
7. **Participate.** The group commits a step with the others (``participating``); the survivors
   never stopped committing (``survivors_resumed`` marks their first commit after detection).

Under ``full_restart`` (the baseline: what a SLURM or torchrun job gets) any failure restarts
every group from the last checkpoint instead. The supervision tree per policy, and the spawn of
groups in it: ``harness.job.tree``.

The job's config is resolved before it starts (``harness.job.site``) and never rewritten.
Faults reach the job only through :attr:`Job.faults` (``harness.job.fault_context``).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from harness.config import config_to_dict
from harness.job import takeover
from harness.job.completion import Completion
from harness.job.fault_context import JobFaultContext
from harness.job.groups import Groups, TrainerGroups
from harness.job.hosts import HostPool
from harness.job.poison import DataMarks
from harness.job.progress import Progress
from harness.job.recovery import RecoveryTracker
from harness.job.replica_group import GroupTable, ReplicaGroup
from harness.job.silent import SilentWatch
from harness.job.site import Site, controller_spec, wants_quorum_relay
from harness.job.stall import StallWatch
from harness.job.start import job_start
from harness.job.takeover import Plan
from harness.job.trainer_deaths import TrainerDeaths
from harness.job.tree import GroupTree
from harness.quorum.backends import make_quorum_service
from harness.quorum.service import QuorumService
from runtime.controller import Controller
from runtime.dataplane.snapshot import reap_orphans
from runtime.failure import Failure
from runtime.journal import JOB_RESTART, Journal
from runtime.mesh import ActorMesh, ProcMesh
from runtime.supervisor import Supervisor

T = TypeVar("T")


def _started(part: T | None) -> T:
    if part is None:
        raise RuntimeError("the job has not started")
    return part


class Job:
    """One run of a job on its prepared site (``harness.job.site``) under one recovery policy.
    ``start``, then ``wait``, then ``stop``. ``site.cfg`` is the config as it runs: read, never
    rewritten. ``make_controller(spec, journal=, launcher=)`` builds the control plane (a test
    passes a fake one)."""

    def __init__(
        self,
        site: Site,
        run_dir: str | Path,
        journal: Journal,
        *,
        quiet: bool = False,
        make_controller: Callable[..., Controller] = Controller,
        survivable: bool = False,
        plan: Plan | None = None,
    ) -> None:
        self.site = site
        self.cfg = cfg = site.cfg
        self.cfg_dict = config_to_dict(cfg)  # as the journal and every rank get it
        self.run_dir = Path(run_dir)
        self.journal = journal
        self.replicas = cfg.replicas
        self.ranks = cfg.ranks
        self.policy = cfg.recovery.policy
        self.groups = GroupTable()  # every group's current incarnation
        self._make_controller = make_controller
        self._controller: Controller | None = None
        self._hosts: HostPool | None = None
        self._quorum: QuorumService | None = None
        self._lock = threading.Lock()  # guards _all_lost
        self._all_lost = False  # every group has lost its state (see _on_every_group_lost)
        self.tracker = RecoveryTracker(journal)
        self.progress = Progress(cfg, self.tracker, quiet=quiet)
        journal.add_sink(self.progress.on_record)
        self.completion = Completion(str(journal.path), lambda: self.controller.fatal)
        journal.on_error(self.completion.journal_failed)  # ends the run: reports come from it
        # Steps that only abort end the run with a diagnosis (harness.job.stall).
        self.stall = StallWatch(
            cfg.timeouts.no_progress,
            journal,
            say=self.say,
            fail=self.completion.fail,
            tick=self.progress.tick,
        )
        self.progress.aborts = self.stall.summary
        self.faults = JobFaultContext(self)
        # the kind of replica group (harness.job.groups.Groups): the built-in trainer's, or a
        # program of the user's own (harness.job.program.groups.ProgramGroups)
        self._kind: Groups | None = None
        self.job_supervisor: Supervisor | None = None
        self.silent: SilentWatch | None = None
        # The controller can die and be replaced (harness.job.takeover): ``plan`` is what a new
        # controller found in the run directory; ``survivable`` lets agents outlive this one.
        self.how = job_start(plan)  # fresh, or a takeover (harness.job.start)
        self.plan = plan
        self.survivable = survivable or plan is not None

    @property
    def controller(self) -> Controller:
        return _started(self._controller)

    @property
    def hosts(self) -> HostPool:
        return _started(self._hosts)

    @property
    def quorum(self) -> QuorumService:
        return _started(self._quorum)

    def say(self, text: str) -> None:  # (one line to the user, not journalled)
        self.progress.say(text)

    # -- start: the tree per policy -------------------------------------------------------------
    def start(self) -> None:
        spec, launcher = controller_spec(self.cfg), self.site.launcher
        survival = takeover.controller_kwargs(self) if self.survivable else {}
        self._controller = self._make_controller(
            spec, journal=self.journal, launcher=launcher, **survival
        )
        self.how.before(self)
        self._hosts = HostPool(
            self.site, self.controller, self.run_dir, self.say, fail=self.completion.fail
        )
        self._quorum = make_quorum_service(
            self.cfg,
            self,
            place=lambda: self.hosts.place(0),
            controller=self.controller,
            log_dir=str(self.run_dir / "logs"),
            # durable, so that a new controller serves the same members where they are
            state_path=self.run_dir / "quorum.json" if self.survivable else None,
            resume=self.how.resumes,
        )
        self._wire_failures()
        self.silent = SilentWatch(self)  # diverged replicas and stragglers (harness.job.silent)
        (self.run_dir / "logs").mkdir(parents=True, exist_ok=True)
        self._kind = self._make_groups()
        self._kind.start()
        self.how.bring_up(self)
        self.job_supervisor = GroupTree(self).build()
        self.how.after_tree(self)
        self.stall.start()
        self.say(
            f"{self.replicas} replica group(s) x {self.ranks} rank(s) training ({self.policy})"
        )

    def _make_groups(self) -> Groups:
        """The kind of replica group this job runs: the one place that asks."""
        if not self.cfg.program.enabled:
            data = DataMarks.attach(self.journal, self.say, self.in_every_trainer)
            data.resume(self.how.history)  # what a dead controller had marked (a takeover)
            incarnation = self.groups.incarnation
            deaths = TrainerDeaths.attach(self.cfg, self.journal, incarnation, self.say, self.fail)
            deaths.resume(self.how.history)  # a crash loop the dead controller was counting
            return TrainerGroups(
                self.controller, self.cfg_dict, self.run_dir, self.quorum, self._check_done,
                data=data, deaths=deaths, members=self.groups.proc_ids, journal=self.journal,
                say=self.say, dropped=self.how.dropped,
            )  # fmt: skip
        from harness.job.program.groups import ProgramGroups

        return ProgramGroups(self)

    @property
    def groups_kind(self) -> Groups:
        return _started(self._kind)

    def relay_quorum(self) -> None:
        """Once the quorum service serves: every host's relay forwards to it (where the job
        has them: :func:`harness.job.site.wants_quorum_relay`; agents that dial in later learn
        it when they do). A takeover's quorum may serve at another address than its
        predecessor's."""
        if wants_quorum_relay(self.cfg):  # a program's calls go through its quorum tap
            upstream = self.groups_kind.quorum_upstream() or self.quorum.address
            self.controller.set_quorum_upstream(upstream)

    # -- detect and fence -----------------------------------------------------------------------
    def _wire_failures(self) -> None:
        """Everything that reacts to a failure the moment it is known (detect and fence),
        before any supervisor acts. Listeners run on the thread that learnt of the failure."""
        self.controller.add_failure_listener(self.tracker.on_failure)
        self.controller.add_failure_listener(self._fence)
        self.controller.add_failure_listener(self.hosts.on_failure)
        self.controller.add_failure_listener(self._on_every_group_lost)

    def _fence(self, failure: Failure) -> None:
        replica = failure.coords.get("replica")
        if replica is None:
            return
        group = self.groups.get(replica)
        if group is not None and failure.proc not in group.mesh.proc_ids:
            return  # a late report about a replaced incarnation: fencing would drop its successor
        self.quorum.fence(replica, self.groups_kind.member_ids(replica))

    def _on_every_group_lost(self, failure: Failure) -> None:
        """In place, when no group holds training state any more (every one failed, or was
        replaced and has not committed since: a host eviction that took the last groups, say),
        there is no peer to heal from: the job resumes from its last checkpoint, as a full
        restart does, and its committed steps may go back to it. Said once per such event."""
        if self.policy != "in_place" or failure.coords.get("replica") is None:
            return
        everyone = set(range(self.replicas))
        with self._lock:
            if not everyone <= self.tracker.stateless_replicas():
                self._all_lost = False  # some group holds state (again)
                return
            if self._all_lost:
                return
            self._all_lost = True
        self.journal.emit(
            JOB_RESTART,
            reason="in_place: every replica group lost its state at once; no peer to heal "
            "from, the job resumes from its last checkpoint",
        )
        self.quorum.job_restarted()

    # -- the quorum service's events (harness.quorum.service.QuorumEvents) ---------------------
    def quorum_ids_reset(self) -> None:
        self.groups_kind.quorum_ids_reset()  # a program's tap continues the ids it handed out

    def quorum_restarted(self) -> None:
        self.relay_quorum()  # it serves on a fresh port
        self.tracker.replacement_started(None)  # the quorum service's recovery

    def ask_for_quorum(self) -> None:
        """Sparse quorum: a new member waits, so every trainer raises its quorum flag
        (``harness.rank.trainer``). Called under the quorum service's lock: asks from a thread
        of its own."""
        from harness.rank.actors import request_quorum

        threading.Thread(target=self.in_every_trainer, args=(request_quorum,), daemon=True).start()

    def adopted(self, group: ReplicaGroup) -> None:
        """A takeover adopted ``group`` as it runs (``harness.job.takeover.TakenOver``)."""
        self.groups.adopted(group)

    # -- what faults and reports read -----------------------------------------------------------
    def host_names(self) -> list[str]:
        return self.site.host_names()

    def group_host(self, replica: int) -> str:
        group = self.groups.get(replica)
        return group.host if group else self.host_names()[replica % self.cfg.hosts]

    def mesh_of(self, replica: int | None) -> ActorMesh | ProcMesh | None:
        """The meshes faults target: a group's ranks, or (None) the quorum service's process."""
        if replica is None:
            return self.quorum.mesh()
        group = self.groups.get(replica)
        return group.mesh if group else None

    # -- completion (harness.job.completion) ----------------------------------------------------
    def _check_done(self) -> None:
        self.completion.groups_changed([g.training for g in self.groups.current()])

    def finished(self) -> None:
        """Every group is done (a program of the user's own exited 0 in every rank)."""
        self.completion.finished()

    def end(self, reason: str) -> None:
        """The job is over, and ends well, for ``reason`` (what its caller decided)."""
        self.completion.end(reason)

    def fail(self, reason: str) -> None:
        """The job cannot go on, for ``reason``: it ends as failed, and no group is restarted
        meanwhile (a crash loop's restarts take tens of milliseconds each)."""
        self.completion.fail(reason)
        if self.job_supervisor is not None:
            self.job_supervisor.hold()

    def wait(
        self,
        timeout: float | None = None,
        duration_s: float | None = None,
        stop_event: threading.Event | None = None,
    ) -> dict[str, Any]:
        """Block until the job trains to its last step, runs for ``duration_s`` or sees
        ``stop_event`` set (normal ends), fails, or exceeds ``timeout`` (a failure); return the
        outcome."""
        status, reason = self.completion.wait(timeout, duration_s, stop_event)
        return {"status": status, "reason": reason, "steps": self.tracker.committed_step}

    def in_every_trainer(self, func: Callable[..., Any], *args: Any) -> None:
        """Run ``func(*args)`` (a function of ``harness.rank.actors``) in every rank, not
        waiting (a gone one: none)."""
        for pid in self.groups.proc_ids():
            with contextlib.suppress(Exception):
                self.controller.run_in_worker(pid, func, *args)

    def stop(self) -> None:
        """Let trainers finish their step, then stop every process and agent."""
        from harness.rank.actors import stop_training

        self.stall.close()
        if self._controller is None:
            self.site.close()
            return
        groups = self.groups.current()
        self.hosts.close()
        if self._kind is not None:
            self._kind.stop()  # before waiting on the groups' training below
        self.in_every_trainer(stop_training, self.tracker.stop_step())  # one step for all
        # Given up on (steps that only abort, an allocation gone): no step will finish.
        patience = 0.0 if self.completion.given_up else 10.0
        for g in groups:
            with contextlib.suppress(Exception):
                g.training.result(timeout=patience)
        if self.job_supervisor is not None:
            with contextlib.suppress(Exception):
                self.job_supervisor.stop()
        self.controller.shutdown(grace_s=1.0)
        if self.silent is not None:
            self.silent.close()
        # Workers are stopped by signals, without cleanup: their data-plane snapshots in
        # /dev/shm outlive them. Every process of the job is gone now: remove what they left.
        reap_orphans()
        if self._quorum is not None:
            self._quorum.shutdown()
        if self._kind is not None:
            self._kind.close()  # a program's quorum tap, once no program can call it
        self.site.close()
        self.progress.close()
