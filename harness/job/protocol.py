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
   recovery (phase ``detected``); with the tree quorum the dead group is dropped from
   membership at once (``TreeQuorum.replica_failed``), so the survivors' next quorum excludes it
   instead of waiting out a heartbeat timeout (torchft's Lighthouse fences by heartbeat
   timeout); and when a whole host is lost, every other host closes its connections to it
   (``runtime.host_registry``): a cut link closes nothing, and the survivors' collective with the
   lost
   group would otherwise wait out the process-group timeout. Every start of a group is a new
   incarnation that the tree quorum admits, fencing the older ones: a cut-off incarnation can
   never commit or serve weights.
3. **Stop.** The group's supervisor (``replica<r>``, one_for_all over its ranks; restart, or
   escalate past the restart intensity: ``runtime.policy``) stops its remaining ranks (SIGTERM,
   grace, SIGKILL) on its own restart thread.
4. **Place.** :meth:`Job._place`: the group's home host if ready, else the next ready one
   (``harness.job.placement``); lost hosts are respawned in the background, never on this path.
5. **Spawn.** :meth:`Job._start_groups` forks the group's ranks on that host (adopting warm
   spares where there are), with a fresh TCPStore (a new incarnation), and constructs their
   trainers; the tracker records ``replacement_started``. With ``[program]`` a program of the
   user's own takes the trainers' place (``harness.job.programs``: started by the agents as plain
   processes, its progress and liveness read from its quorum requests).
6. **Heal.** The new trainers join the next quorum; torchft sees they are behind and has them
   load a healthy peer's state over the configured transport (``healed``). Groups that skip
   quorums (``recovery.quorum_every_steps``) are asked for one (:meth:`Job._newcomer_waits`).
7. **Participate.** The group commits a step with the others (``participating``); the survivors
   never stopped committing (``survivors_resumed`` marks their first commit after detection).

Under ``full_restart`` (the baseline: what a SLURM or torchrun job gets) the job supervisor is
one_for_all over the quorum and one child holding every group, so any failure stops every
process and the whole job restarts from its last checkpoint, all groups at once, in fresh
interpreters that import torch again (``cold`` spawns). The host agents themselves stay up: the
baseline does not pay for node allocation, so the comparison favours it.

The tree (``in_place``)::

    controller (root: an escalation here stops the job)
    └── job             one_for_one, gives up at the first escalation from below
        ├── quorum      one_for_one: torchft's Lighthouse in a worker, restarted on its port
        └── replica<r>  one_for_all over the group's ranks, restart intensity from the config
            └── ranks   a mesh {"rank": ranks} of TrainerActors on the group's host

Faults reach the job only through :attr:`Job.faults` (``harness.job.fault_context``).
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import dataclasses
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harness.config import JobConfig, config_to_dict
from harness.job.fault_context import JobFaultContext
from harness.job.placement import HostState, place
from harness.job.progress import Progress
from harness.job.recovery import RecoveryTracker
from runtime.controller import Controller, HostAgentHandle
from runtime.dataplane.snapshot import reap_orphans
from runtime.failure import Cause, Failure
from runtime.journal import JOB_RESTART, JOB_START, Journal
from runtime.launchers import ExternalLauncher, Launcher, LocalLauncher
from runtime.launchers.netns import NetnsLauncher, TestNetwork
from runtime.mesh import ActorMesh, ProcMesh
from runtime.spec import ControllerSpec, HeartbeatSpec, Strategy, SupervisorSpec


@dataclass
class ReplicaGroup:
    """One replica group's current incarnation. Replaced whole by every restart."""

    replica: int
    incarnation: int
    host: str
    mesh: ActorMesh | ProcMesh  # the group's ranks, dims {"replica": 1, "rank": ranks}
    store: Any  # the group's TCPStore, served from this process while the group runs
    training: cf.Future  # rank 0's ``train`` call: done when the group stops training


class Job:
    """One run of a job config under one recovery policy. ``start``, then ``wait``, then
    ``stop``."""

    def __init__(
        self, cfg: JobConfig, run_dir: str | Path, journal: Journal, *, quiet: bool = False
    ) -> None:
        if cfg.recovery.policy == "full_restart":
            # The baseline is a classic synchronous job: it trains only with every group, as
            # torchrun's rendezvous would (a lone group must not run ahead after a restart).
            cfg = dataclasses.replace(cfg, min_replica_size=cfg.replicas)
        self.cfg = cfg
        self.run_dir = Path(run_dir)
        self.journal = journal
        self.replicas = cfg.replicas
        self.ranks = cfg.ranks
        self.policy = cfg.recovery.policy
        self.recovery_quorum = cfg.recovery.quorum
        self.groups: dict[int, ReplicaGroup] = {}
        self._cfg_dict = config_to_dict(cfg)
        self._controller: Controller | None = None
        self.network: TestNetwork | None = None  # with launcher = "netns"
        self.slurm: Any = None  # runtime.launchers.slurm.SlurmLauncher with launcher = "slurm"
        self._lock = threading.RLock()
        self._done = threading.Event()
        self._started = False
        self._stopping = False
        self._cooldown: dict[str, float] = {}  # host -> monotonic end of its cooldown
        self._respawning: set[str] = set()  # hosts whose agent is restarted in the background
        self._all_lost = False  # every group has lost its state (see _on_every_group_lost)
        self._host_change = threading.Condition(self._lock)
        self._tree: Any = None  # the tree quorum (in this process), or the Lighthouse below
        self._lighthouse: ActorMesh | None = None
        self._lighthouse_port = 0
        self.quorum_addr = ""
        self.tracker = RecoveryTracker(journal)
        self.progress = Progress(cfg, self.tracker, quiet=quiet)
        journal.add_sink(self.progress.on_record)
        self._journal_error: OSError | None = None  # ends the run: reports come from it
        journal.on_error(self._on_journal_error)
        self.faults = JobFaultContext(self)
        self.program: Any = None  # a program of the user's own: harness.job.programs.ProgramGroups

    @property
    def controller(self) -> Controller:
        if self._controller is None:
            raise RuntimeError("the job has not started")
        return self._controller

    # -- start: the tree per policy -------------------------------------------------------------
    def start(self) -> None:
        from harness.rank.model import model_modules, prebuild_call  # (model.py imports torch)

        launcher = self._make_launcher()
        t = self.cfg.timeouts
        spec = ControllerSpec(
            bind_host=self.cfg.bind_host,
            heartbeat=HeartbeatSpec(interval_s=t.heartbeat_interval, timeout_s=t.heartbeat_timeout),
            agent_heartbeat=HeartbeatSpec(
                interval_s=min(0.2, t.host_timeout / 5), timeout_s=t.host_timeout
            ),
            controller_silence_s=t.controller_silence,
            connect_timeout_s=t.connect_timeout,
            # Imported once per agent, before it forks, and the initial model built once
            # (harness.rank.model.prebuild): a replacement then does not pay for torch, torchft, the
            # model code, the first optimizer's dynamo import (~1-3 s each on this machine).
            preload=("torch", "torch._dynamo", "harness.rank.actors", *model_modules(self.cfg)),
            warmup=() if self.cfg.program.enabled else (prebuild_call(self.cfg),),
        )
        self._controller = Controller(spec, journal=self.journal, launcher=launcher)
        self._wire_failures()
        (self.run_dir / "logs").mkdir(parents=True, exist_ok=True)
        if self.cfg.program.enabled:
            from harness.job.programs import ProgramGroups

            self.program = ProgramGroups(self)
            self.program.start()
        self.journal.emit(
            JOB_START, config=self._cfg_dict, replicas=self.replicas, ranks=self.ranks
        )
        if self.cfg.launcher == "external":
            self._wait_for_external_hosts()
        else:
            n = len(self.host_names())
            self.progress.say(f"starting {n} host agent(s) (each imports torch once)")
            for name in self.host_names():
                self._spawn_host(name)
        if self.recovery_quorum == "tree":
            self._start_tree_quorum()
        self.job_supervisor = self._build_tree()
        self._started = True
        self.progress.say(
            f"{self.replicas} replica group(s) x {self.ranks} rank(s) training ({self.policy})"
        )

    def _make_launcher(self) -> Launcher:
        """Where the hosts come from (``cfg.launcher``). Test hosts in network namespaces get
        a network of their own, and the controller (and the stores and quorum it serves) binds
        that network's gateway address."""
        if self.cfg.launcher == "local":
            return LocalLauncher()
        if self.cfg.launcher == "external":
            return ExternalLauncher()
        if self.cfg.launcher == "slurm":
            from harness.job.slurm import make_launcher

            self.slurm, self.cfg = make_launcher(self.cfg, self.run_dir, self._on_node_gone)
            self._cfg_dict = config_to_dict(self.cfg)
            self.progress.say(
                f"SLURM job {self.slurm.alloc.job_id}: nodes {', '.join(self.slurm.active)}"
                + (f", spare {', '.join(sorted(self.slurm.spares))}" if self.slurm.spares else "")
                + f"; controller at {self.cfg.bind_host}"
            )
            return self.slurm
        self.network = net = TestNetwork(self.host_names()).up()
        self.cfg = dataclasses.replace(self.cfg, bind_host=net.gateway)
        self._cfg_dict = config_to_dict(self.cfg)
        self.progress.say(
            f"test hosts in network namespaces: {net.subnet}, controller at {net.gateway}"
        )
        return NetnsLauncher(self.network)

    def _build_tree(self) -> Any:
        r = self.cfg.recovery
        lighthouse = self.recovery_quorum != "tree"
        group_spec = SupervisorSpec(
            strategy=Strategy.ONE_FOR_ALL,
            max_restarts=r.max_restarts,
            within_s=r.within_s,
            grace_s=0.5,
        )
        if self.policy == "full_restart":
            job = self.controller.supervisor("job", group_spec)
            if lighthouse:
                job.add_child("quorum", self._start_lighthouse)
            # One child for all groups: a full restart brings them back together, in parallel.
            job.add_child("groups", lambda: self._start_groups(list(range(self.replicas))))
            return job
        job = self.controller.supervisor("job", SupervisorSpec(max_restarts=0))
        if lighthouse:
            quorum = job.add_supervisor(
                "quorum", SupervisorSpec(max_restarts=r.max_restarts, within_s=r.within_s)
            )
            quorum.add_child("lighthouse", self._start_lighthouse)
        for rep in range(self.replicas):
            group = job.add_supervisor(f"replica{rep}", group_spec)
            group.add_child("ranks", lambda rep=rep: self._start_groups([rep]))
        return job

    def _wire_failures(self) -> None:
        """Everything that reacts to a failure the moment it is known (detect and fence),
        before any supervisor acts. Listeners run on the thread that learnt of the failure."""
        self.controller.add_failure_listener(self.tracker.on_failure)
        if self.recovery_quorum == "tree":
            self.controller.add_failure_listener(self._fence_in_tree_quorum)
        self.controller.add_failure_listener(self._on_host_lost)
        self.controller.add_failure_listener(self._on_every_group_lost)

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
        if self._tree is not None:
            self._tree.job_restarted()

    def _fence_in_tree_quorum(self, failure: Failure) -> None:
        replica = failure.coords.get("replica")
        if replica is None or self._tree is None:
            return
        with self._lock:
            group = self.groups.get(replica)
        if group is not None and failure.proc not in group.mesh.proc_ids:
            return  # a late report about a replaced incarnation: fencing would drop its successor
        self._tree.replica_failed(replica, self.program.member_ids(replica) if self.program else ())

    # -- the quorum service ---------------------------------------------------------------------
    def _start_tree_quorum(self, port: int = 0) -> None:
        """Membership driven by the tree: a Lighthouse-protocol service in this process that
        drops a failed group the moment its failure value arrives (harness.quorum.tree)."""
        from harness.quorum.tree import TreeQuorum

        t = self.cfg.timeouts
        old = self._tree  # a restart keeps the job's secret: the running members stay admitted
        self._tree = TreeQuorum(
            bind_host=self.cfg.bind_host,
            port=port,
            min_replicas=self.cfg.min_replica_size,
            join_timeout_s=t.lighthouse_join_timeout,
            heartbeat_timeout_s=t.lighthouse_heartbeat_timeout,
            max_step=self.cfg.steps,
            # each waiting quorum request holds a server thread: room for every group's request
            # and heartbeat, with margin (the service's docstring)
            max_requests=max(64, 4 * self.replicas + 16),
            secret=old.secret if old is not None else None,
            incarnations=old.incarnations if old is not None else None,
            highest_step=old.highest_step if old is not None else -1,
            reported=old.reported if old is not None else None,
            quorum_id=old.quorum_id + 1 if old is not None else 0,
            # a program's Managers pick their own ids; the quorum tap admits them (by store)
            allow_hosts=[self.cfg.bind_host] if self.program is not None else None,
            on_newcomer=self._newcomer_waits if self.cfg.quorum_every() > 1 else None,
        )
        self.quorum_addr = self._tree.address

    def _newcomer_waits(self, replica_id: str) -> None:
        """Sparse quorum: a new member waits, so every trainer raises the quorum flag
        (harness.rank.trainer). Called under the tree quorum's lock: asks from a thread of its
        own."""
        ask = threading.Thread(target=self.in_every_trainer, args=("request_quorum",), daemon=True)
        ask.start()

    def restart_tree_quorum(self) -> None:
        """The in-controller service "crashes": it loses all its state and comes back on the
        same port, as a restarted Lighthouse would."""
        port = int(self._tree.address.rsplit(":", 1)[1])
        self._tree.shutdown()
        self._start_tree_quorum(port)
        self.tracker.replacement_started(None)

    def _start_lighthouse(self) -> ActorMesh:
        from harness.rank.actors import LighthouseActor

        if self._started and self.program is not None and self.program.tap is not None:
            self.program.tap.upstream_restarted()  # a new Lighthouse numbers from 1 again
        host = self._place(0)
        mesh = host.spawn_procs({"service": 1}, log_dir=str(self.run_dir / "logs"))
        self._lighthouse = mesh.spawn(
            "lighthouse", LighthouseActor, self._cfg_dict, self._lighthouse_port
        )
        self.quorum_addr = self._lighthouse.address.call_one().get(timeout=30)
        self._lighthouse_port = int(self.quorum_addr.rsplit(":", 1)[1])
        if self._started:
            self.tracker.replacement_started(None)  # a restarted Lighthouse is serving again
        return self._lighthouse

    # -- spawn: groups --------------------------------------------------------------------------
    def _start_groups(self, replicas: list[int]) -> ActorMesh:
        """Start replica groups (processes, trainers, then training) and return them stacked
        on a "replica" dimension. Several groups start together: their processes are all
        requested before any is awaited and their trainers are constructed in parallel.
        Runs on the supervisor's restart thread for a restart, so its waits (restart delay, a
        host to become ready) hold up only these groups."""
        from harness.rank.actors import TrainerActor
        from harness.rank.torchft_glue import host_store

        cold = self.policy == "full_restart" and self._started
        if cold:
            # Every process after the first start is a fresh interpreter: the baseline pays
            # the imports a scheduler's restart pays (in_place forks warm ones).
            self.journal.emit(
                JOB_RESTART, reason="full_restart: every process restarted from the last checkpoint"
            )
            if self._tree is not None:
                self._tree.job_restarted()
        if self.cfg.recovery.restart_delay_s and replicas[0] in self.groups:
            time.sleep(self.cfg.recovery.restart_delay_s)
        hosts = {r: self._place(r) for r in replicas}
        with self._lock:
            incarnation = {
                r: self.groups[r].incarnation + 1 if r in self.groups else 0 for r in replicas
            }
        # A fresh store per incarnation: keys from a dead incarnation must not leak into it.
        stores = {r: host_store(self.cfg.bind_host, self.cfg.timeouts) for r in replicas}
        # Fence: the tree quorum lets in only the incarnation it admitted last, so a stale
        # incarnation (a partitioned group that comes back) can never rejoin or serve weights.
        member_ids = (
            {r: self._tree.admit(r, incarnation[r]) for r in replicas} if self._tree else {}
        )
        if self.program is not None:
            return self._start_programs(replicas, hosts, incarnation, stores, cold)
        meshes = self.controller.spawn_many(
            [(hosts[r], {"rank": self.ranks}, {"replica": r}) for r in replicas],
            log_dir=str(self.run_dir / "logs"),
            cold=cold,
        )
        actors = ProcMesh.stack(meshes, "replica").spawn(
            "trainer",
            TrainerActor,
            self._cfg_dict,
            {r: addr for r, (_, addr) in stores.items()},
            self.quorum_addr,
            str(self.run_dir),
            member_ids,
        )
        call = actors.train.call()
        training = {r: call.futures[(i, 0)] for i, r in enumerate(replicas)}
        self._record_groups(replicas, hosts, incarnation, stores, actors, training)
        for future in training.values():
            future.add_done_callback(lambda _: self._check_done())
        return actors

    def _record_groups(
        self,
        replicas: list[int],
        hosts: dict[int, HostAgentHandle],
        incarnation: dict[int, int],
        stores: dict[int, Any],
        mesh: Any,
        training: dict[int, cf.Future],
    ) -> None:
        """Each started group's record (its slice of ``mesh``, stacked on "replica"), then its
        ``replacement_started`` phase."""
        for i, r in enumerate(replicas):
            with self._lock:
                self.groups[r] = ReplicaGroup(
                    replica=r,
                    incarnation=incarnation[r],
                    host=hosts[r].name,
                    mesh=mesh.slice(replica=slice(i, i + 1)),
                    store=stores[r][0],
                    training=training[r],
                )
            self.tracker.replacement_started(r)

    def _start_programs(
        self,
        replicas: list[int],
        hosts: dict[int, HostAgentHandle],
        incarnation: dict[int, int],
        stores: dict[int, Any],
        cold: bool,
    ) -> ProcMesh:
        """Spawn: a program of the user's own in place of trainer actors (harness.job.programs)."""
        procs, training = self.program.start_groups(replicas, hosts, incarnation, stores, cold)
        self._record_groups(replicas, hosts, incarnation, stores, procs, training)
        return procs

    # -- place: hosts ---------------------------------------------------------------------------
    def host_names(self) -> list[str]:
        if self.slurm is not None:  # node names: the active nodes, then the spares
            return list(self.slurm.nodes)
        return [f"host{i}" for i in range(self.cfg.hosts)]

    def group_host(self, replica: int) -> str:
        with self._lock:
            group = self.groups.get(replica)
        return group.host if group else self.host_names()[replica % self.cfg.hosts]

    def mesh_of(self, replica: int | None) -> ActorMesh | None:
        """The meshes faults target: a group's ranks, or (None) torchft's Lighthouse."""
        with self._lock:
            if replica is None:
                return self._lighthouse
            group = self.groups.get(replica)
            return group.mesh if group else None

    def _host_states(self) -> list[HostState]:
        hosts = self.controller.hosts
        return [
            HostState(
                name=n,
                up=n in hosts and not hosts[n].lost,
                cooling_until=self._cooldown.get(n, 0.0),
                respawning=n in self._respawning,
                spare=self.slurm is not None and n in self.slurm.spares,
                gone=self.slurm is not None and n in self.slurm.gone,
            )
            for n in self.host_names()
        ]

    def _on_node_gone(self, node: str, why: str) -> None:
        """SLURM shows a node down or drained, or it left the job: never place or respawn
        there again (the placement rule reads ``gone``)."""
        self.progress.say(f"{why}: no group goes there again")
        with self._host_change:
            self._host_change.notify_all()
        if self.cfg.slurm.replace == "new_job" and not self._stopping:
            from harness.job.slurm import replace_node

            threading.Thread(target=replace_node, args=(self, node), daemon=True).start()

    def _place(self, replica: int) -> HostAgentHandle:
        """The host for a group now (harness.job.placement's rule); waits if none is ready."""
        with self._host_change:
            while True:
                decision = place(replica, self._host_states(), time.monotonic())
                for name in decision.respawn:
                    self._respawn_host(name)
                if decision.host is not None:
                    return self.controller.hosts[decision.host]
                self._host_change.wait(decision.wait_s)

    def set_host_cooldown(self, host: str, seconds: float) -> None:
        """Keep ``host`` out for ``seconds``; its agent is restarted when the cooldown ends."""
        with self._lock:
            self._cooldown[host] = time.monotonic() + seconds
        timer = threading.Timer(seconds, self._respawn_if_lost, (host,))
        timer.daemon = True
        timer.start()

    def _on_host_lost(self, failure: Failure) -> None:
        """A lost host gets a fresh agent in the background once any cooldown is over, so the
        groups that come back to it later find it ready (and its warm spares forked)."""
        if failure.cause is Cause.LOST_HOST and failure.host is not None:
            with self._lock:
                left = self._cooldown.get(failure.host, 0.0) - time.monotonic()
            if left <= 0:
                self._respawn_if_lost(failure.host)

    def _respawn_if_lost(self, host: str) -> None:
        with self._lock:
            h = self.controller.hosts.get(host)
            if self._stopping or (h is not None and not h.lost):
                return
            if self._cooldown.get(host, 0.0) > time.monotonic():
                return
            self._respawn_host(host)

    def _respawn_host(self, name: str) -> None:
        """Start a fresh agent on ``name`` on a background thread (caller holds the lock)."""
        if name in self._respawning:
            return
        self._respawning.add(name)

        def run() -> None:
            try:
                self._spawn_host(name)
            except Exception as exc:
                self.progress.say(f"could not restart the agent of {name}: {exc}")
            finally:
                with self._host_change:
                    self._respawning.discard(name)
                    self._host_change.notify_all()

        threading.Thread(target=run, daemon=True, name=f"ftharness-respawn-{name}").start()

    def _wait_for_external_hosts(self) -> None:
        """Agents on other machines dial in with ``ftharness agent``; the secret they need is
        written to a file only this user can read."""
        secret = self.run_dir / "agent.secret"
        fd = os.open(secret, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(self.controller.secret.hex() + "\n")
        host, port = self.controller.address
        self.progress.say(
            f"waiting up to {self.cfg.timeouts.host_join:g} s for {self.cfg.hosts} host agent(s); "
            f"on each host I, with a copy of {secret} (mode 0600), run: ftharness agent "
            f"--controller {host}:{port} --secret-file {secret.name} --name hostI"
        )
        for h in self.controller.wait_for_hosts(self.host_names(), self.cfg.timeouts.host_join):
            self._keep_spares(h)

    def _keep_spares(self, host: HostAgentHandle) -> None:
        """Warm spares are forked workers for the built-in trainer; a program of the user's own
        is started as a process of its own (``program.warm`` forks it instead), so it has none."""
        n = self.cfg.recovery.spares_per_host
        if n and self.policy == "in_place" and not self.cfg.program.enabled:
            host.keep_spares(n, log_dir=str(self.run_dir / "logs"))

    def _spawn_host(self, name: str) -> HostAgentHandle:
        """A host agent, with its warm spares (in-place recovery only: a full restart starts
        cold on purpose)."""
        host = self.controller.spawn_host(name)
        self._keep_spares(host)
        return host

    # -- completion -----------------------------------------------------------------------------
    def _on_journal_error(self, exc: OSError) -> None:
        self._journal_error = exc
        self._done.set()

    def _check_done(self) -> None:
        with self._lock:
            futs = [g.training for g in self.groups.values()]
        if any(f.done() and f.exception() is None for f in futs):
            # One group reached the last step: the others are at most a step behind. Ask all
            # to stop after their current step rather than train on alone.
            self._done.set()

    def wait(
        self,
        timeout: float | None = None,
        duration_s: float | None = None,
        stop_event: threading.Event | None = None,
    ) -> dict[str, Any]:
        """Block until the job trains to its last step, runs for ``duration_s`` or sees
        ``stop_event`` set (normal ends), fails, or exceeds ``timeout`` (a failure); return the
        outcome."""
        now = time.monotonic()
        deadline = None if timeout is None else now + timeout
        end = None if duration_s is None else now + duration_s
        status, reason = "ok", "trained to the last step"
        while True:
            if self._journal_error is not None:
                err, status = self._journal_error, "failed"
                reason = f"the journal {self.journal.path} could not be written ({err}); the run"
                reason += " stopped, since every report is computed from it"
                break
            if self._done.is_set():
                break
            if self.controller.fatal_event.is_set():
                status, reason = "failed", self.controller.fatal.report()  # type: ignore[union-attr]
                break
            if end is not None and time.monotonic() > end:
                reason = f"ran for its duration of {duration_s:g} s"
                break
            if stop_event is not None and stop_event.is_set():
                reason = "stopped by its caller"
                break
            if deadline is not None and time.monotonic() > deadline:
                status, reason = "failed", f"timed out after {timeout} s"
                break
            self._done.wait(0.1)
        return {"status": status, "reason": reason, "steps": self.tracker.committed_step}

    def in_every_trainer(self, func: str, *args: Any) -> None:
        """Run ``harness.rank.actors:<func>(*args)`` in every rank, not waiting (a gone one:
        none)."""
        with self._lock:
            pids = [pid for g in self.groups.values() for pid in g.mesh.proc_ids]
        for pid in pids:
            with contextlib.suppress(Exception):
                self.controller.run_in_worker(pid, f"harness.rank.actors:{func}", *args)

    def stop(self) -> None:
        """Let trainers finish their step, then stop every process and agent."""
        if self._controller is None:
            if self.network is not None:
                self.network.down()
            return
        with self._lock:
            self._stopping = True
            groups = list(self.groups.values())
        if self.program is not None:
            self.program.stop()  # before waiting on the groups' training below
        self.in_every_trainer("stop_training", self.tracker.stop_step())  # one step for all
        for g in groups:
            with contextlib.suppress(Exception):
                g.training.result(timeout=10)
        with contextlib.suppress(Exception):
            self.job_supervisor.stop()
        self.controller.shutdown(grace_s=1.0)
        # Workers are stopped by signals, without cleanup: their data-plane snapshots in
        # /dev/shm outlive them. Every process of the job is gone now: remove what they left.
        reap_orphans()
        if self._tree is not None:
            self._tree.shutdown()
        if self.program is not None:
            self.program.close()  # the quorum tap, once no program can call it
        if self.network is not None:
            self.network.down()
        self.progress.close()
