"""Launching a resilient pretraining job on the supervision tree (``ftharness run``).

The tree of one job (``in_place`` policy)::

    controller (root: an escalation here stops the job)
    └── job             one_for_one, gives up at the first escalation from below
        ├── quorum      one_for_one: torchft's Lighthouse in a worker, restarted on its port
        └── replica<r>  one_for_all over the group's ranks, restart intensity from the config
            └── ranks   a mesh {"rank": ranks} of TrainerActors on the group's host

With ``recovery.quorum = "tree"`` there is no Lighthouse process: the quorum service
(harness.tree_quorum) runs in the controller and drops a group the moment its failure is known.

Under ``full_restart`` (the baseline: what a SLURM or torchrun job gets) the job supervisor is
one_for_all over the quorum and one child holding every group, so any failure stops every
process and the whole job restarts from its last checkpoint, all groups at once, in fresh
interpreters that import torch again (``cold`` spawns), as a scheduler's restart would. The
host agents themselves stay up: the baseline does not pay for node allocation or container
start, so the comparison favours it.

``Job`` also implements the fault injector's ``FaultContext`` (faults.fault): faults reach the
job only through it.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import sys
import threading
import time
from pathlib import Path
from typing import Any

from harness.config import ConfigError, JobConfig, config_to_dict, load_config
from harness.progress import Progress
from harness.recovery import RecoveryTracker
from runtime.controller import Controller, HostAgentHandle
from runtime.failure import Failure, SupervisionError
from runtime.journal import JOB_END, JOB_RESTART, JOB_START, Journal
from runtime.mesh import ActorMesh, ProcMesh
from runtime.spec import ControllerSpec, HeartbeatSpec, Strategy, SupervisorSpec


class Job:
    """One run of a job config under one recovery policy. ``start``, then ``wait``."""

    def __init__(
        self,
        cfg: JobConfig,
        run_dir: str | Path,
        journal: Journal,
        *,
        quiet: bool = False,
    ) -> None:
        self.cfg = cfg
        self.run_dir = Path(run_dir)
        self.journal = journal
        self.replicas = cfg.replicas
        self.ranks = cfg.ranks
        self.policy = cfg.recovery.policy
        if self.policy == "full_restart":
            # The baseline is a classic synchronous job: it trains only with every group, as
            # torchrun's rendezvous would (a lone group must not run ahead after a restart).
            cfg = dataclasses.replace(cfg, min_replica_size=cfg.replicas)
            self.cfg = cfg
        self.quiet = quiet
        self._cfg_dict = config_to_dict(cfg)
        self._groups: dict[int, ActorMesh] = {}
        self._group_host: dict[int, str] = {}
        self._stores: dict[int, Any] = {}
        self._train: dict[int, Any] = {}
        self._cooldown: dict[str, float] = {}
        self._lighthouse: ActorMesh | None = None
        self._lighthouse_port = 0
        self._lighthouse_addr = ""
        self._tree: Any = None
        self._started = False
        self._done = threading.Event()
        self._lock = threading.RLock()
        self.controller: Controller | None = None
        self.tracker = RecoveryTracker(journal)
        self.progress = Progress(cfg, self.tracker, quiet=quiet)
        journal.add_sink(self.progress.on_record)

    # -- start --------------------------------------------------------------------------------
    def start(self) -> None:
        t = self.cfg.timeouts
        spec = ControllerSpec(
            bind_host=self.cfg.bind_host,
            heartbeat=HeartbeatSpec(interval_s=t.heartbeat_interval, timeout_s=t.heartbeat_timeout),
            connect_timeout_s=t.connect_timeout,
            # Imported once per agent, before it forks: a replacement then starts without
            # paying for torch, torchft, the model code, or the dynamo import that the first
            # optimizer construction triggers (~1-3 s each on this machine).
            preload=("torch", "torch._dynamo", "harness.actors", *self._model_modules()),
        )
        self.controller = Controller(spec, journal=self.journal)
        self.controller.add_failure_listener(self.tracker.on_failure)
        (self.run_dir / "logs").mkdir(parents=True, exist_ok=True)
        self.journal.emit(
            JOB_START, config=self._cfg_dict, replicas=self.replicas, ranks=self.ranks
        )
        self.progress.say(f"starting {self.cfg.hosts} host agent(s) (each imports torch once)")
        for i in range(self.cfg.hosts):
            self._spawn_host(f"host{i}")
        r = self.cfg.recovery
        tree = r.quorum == "tree"
        if tree:
            self._start_tree_quorum()
        if self.policy == "full_restart":
            job = self.controller.supervisor(
                "job",
                SupervisorSpec(
                    strategy=Strategy.ONE_FOR_ALL,
                    max_restarts=r.max_restarts,
                    within_s=r.within_s,
                    grace_s=0.5,
                ),
            )
            if not tree:
                job.add_child("quorum", self._start_lighthouse)
            # One child for all groups: a full restart brings them back together, in parallel.
            job.add_child("groups", lambda: self._start_groups(list(range(self.replicas))))
        else:
            job = self.controller.supervisor("job", SupervisorSpec(max_restarts=0))
            if not tree:
                quorum = job.add_supervisor(
                    "quorum", SupervisorSpec(max_restarts=r.max_restarts, within_s=r.within_s)
                )
                quorum.add_child("lighthouse", self._start_lighthouse)
            for rep in range(self.replicas):
                group = job.add_supervisor(
                    f"replica{rep}",
                    SupervisorSpec(
                        strategy=Strategy.ONE_FOR_ALL,
                        max_restarts=r.max_restarts,
                        within_s=r.within_s,
                        grace_s=0.5,
                    ),
                )
                group.add_child("ranks", lambda rep=rep: self._start_group(rep))
        self.job_supervisor = job
        self._started = True
        self.progress.say(
            f"{self.replicas} replica group(s) x {self.ranks} rank(s) training ({self.policy})"
        )

    def _journal_restart(self) -> None:
        self.journal.emit(
            JOB_RESTART, reason="full_restart: every process restarted from the last checkpoint"
        )

    def _model_modules(self) -> tuple[str, ...]:
        """The model code to preload: torchtitan (~2 s to import) only for its model."""
        if self.cfg.model.kind == "llama3_debug":
            return ("torchtitan.models.llama3", "torchtitan.models.common.attention")
        return ()

    def _spawn_host(self, name: str) -> HostAgentHandle:
        """A host agent, with its warm spares (in-place recovery only: a full restart starts
        cold on purpose)."""
        assert self.controller is not None
        host = self.controller.spawn_host(name)
        n = self.cfg.recovery.spares_per_host
        if n and self.policy == "in_place":
            host.keep_spares(n, log_dir=str(self.run_dir / "logs"))
        return host

    def _cold_restart(self) -> bool:
        """Under full_restart, every process after the first start is a fresh interpreter:
        that baseline pays the imports a scheduler's restart pays (in_place forks warm ones)."""
        return self.policy == "full_restart" and self._started

    def _start_tree_quorum(self, port: int = 0) -> None:
        """Membership driven by the tree: a Lighthouse-protocol service in this process that
        drops a failed group the moment its failure value arrives (harness.tree_quorum)."""
        from harness.tree_quorum import TreeQuorum

        t = self.cfg.timeouts
        old = self._tree  # a restart keeps the job's secret: the running members stay admitted
        self._tree = TreeQuorum(
            bind_host=self.cfg.bind_host,
            port=port,
            min_replicas=self.cfg.min_replica_size,
            join_timeout_s=t.lighthouse_join_timeout,
            heartbeat_timeout_s=t.lighthouse_heartbeat_timeout,
            max_step=self.cfg.steps,
            secret=old.secret if old is not None else None,
            incarnations=old.incarnations if old is not None else None,
        )
        self._lighthouse_addr = self._tree.address
        if port == 0:
            assert self.controller is not None
            self.controller.add_failure_listener(self._tell_tree)

    def _tell_tree(self, failure: Failure) -> None:
        replica = failure.coords.get("replica")
        if replica is not None and self._tree is not None:
            self._tree.replica_failed(replica)

    def _start_lighthouse(self) -> ActorMesh:
        assert self.controller is not None
        host = self._place(0)
        mesh = host.spawn_procs({"service": 1}, log_dir=str(self.run_dir / "logs"))
        self._lighthouse = mesh.spawn(
            "lighthouse", _lighthouse_cls(), self._cfg_dict, self._lighthouse_port
        )
        self._lighthouse_addr = self._lighthouse.address.call_one().get(timeout=30)
        self._lighthouse_port = int(self._lighthouse_addr.rsplit(":", 1)[1])
        if self._started:
            self.tracker.replacement_started(None)  # a restarted Lighthouse is serving again
        return self._lighthouse

    def _start_group(self, replica: int) -> ActorMesh:
        return self._start_groups([replica])

    def _start_groups(self, replicas: list[int]) -> ActorMesh:
        """Start replica groups (processes, trainers, then training) and return them stacked
        on a "replica" dimension. Several groups start together: their processes are all
        requested before any is awaited and their trainers are constructed in parallel."""
        from harness.actors import TrainerActor
        from harness.quorum import host_store

        if self._cold_restart():
            self._journal_restart()
        if self.cfg.recovery.restart_delay_s and replicas[0] in self._groups:
            time.sleep(self.cfg.recovery.restart_delay_s)
        assert self.controller is not None
        hosts = {r: self._place(r) for r in replicas}
        # A fresh store per incarnation: keys from a dead incarnation must not leak into it.
        stores = {r: host_store(self.cfg.bind_host, self.cfg.timeouts) for r in replicas}
        # The tree quorum lets in only the incarnations it admitted; admitting fences the last.
        tree = self._tree
        member_ids = {r: tree.admit(r) for r in replicas} if tree is not None else {}
        meshes = self.controller.spawn_many(
            [(hosts[r], {"rank": self.ranks}, {"replica": r}) for r in replicas],
            log_dir=str(self.run_dir / "logs"),
            cold=self._cold_restart(),
        )
        actors = ProcMesh.stack(meshes, "replica").spawn(
            "trainer",
            TrainerActor,
            self._cfg_dict,
            {r: addr for r, (_, addr) in stores.items()},
            self._lighthouse_addr,
            str(self.run_dir),
            member_ids,
        )
        training = actors.train.call()
        for i, r in enumerate(replicas):
            with self._lock:
                self._stores[r] = stores[r][0]
                self._groups[r] = actors.slice(replica=slice(i, i + 1))
                self._group_host[r] = hosts[r].name
                self._train[r] = training.futures[(i, 0)]
            self.tracker.replacement_started(r)
            training.futures[(i, 0)].add_done_callback(lambda _: self._check_done())
        return actors

    def _place(self, replica: int) -> HostAgentHandle:
        """The host for a group: its home host (replica % hosts) if usable, else another.

        A host is unusable while lost or cooling down after an eviction; a lost host whose
        cooldown is over gets a fresh agent. With no usable host, wait for the first cooldown.
        """
        assert self.controller is not None
        names = [f"host{i}" for i in range(self.cfg.hosts)]
        home = names[replica % len(names)]
        order = [home] + [n for n in names if n != home]
        while True:
            now = time.monotonic()
            for name in order:
                if self._cooldown.get(name, 0.0) > now:
                    continue
                h = self.controller.hosts.get(name)
                if h is None or h.lost:
                    h = self._spawn_host(name)
                return h
            time.sleep(max(0.05, min(self._cooldown.values()) - now))

    # -- completion ---------------------------------------------------------------------------
    def _check_done(self) -> None:
        with self._lock:
            futs = list(self._train.values())
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
        assert self.controller is not None
        now = time.monotonic()
        deadline = None if timeout is None else now + timeout
        end = None if duration_s is None else now + duration_s
        status, reason = "ok", "trained to the last step"
        while not self._done.is_set():
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

    def stop(self) -> None:
        """Let trainers finish their step, then stop every process and agent."""
        if self.controller is None:
            return
        with self._lock:
            groups = list(self._groups.items())
        for _, actors in groups:
            for pid in actors.proc_ids:
                with contextlib.suppress(Exception):
                    self.controller.run_in_worker(pid, "harness.actors:stop_training")
        for rep, _ in groups:
            with contextlib.suppress(Exception):
                self._train[rep].result(timeout=10)
        with contextlib.suppress(Exception):
            self.job_supervisor.stop()
        self.controller.shutdown(grace_s=1.0)
        if self._tree is not None:
            self._tree.shutdown()
        self.progress.close()

    # -- FaultContext -------------------------------------------------------------------------
    def hosts(self) -> list[str]:
        return [f"host{i}" for i in range(self.cfg.hosts)]

    def replica_host(self, replica: int) -> str:
        return self._group_host.get(replica, f"host{replica % self.cfg.hosts}")

    def _procs(self, target: Any) -> list[str]:
        with self._lock:
            if target.replica is None:
                mesh = self._lighthouse
            else:
                mesh = self._groups.get(target.replica)
                if mesh is not None and target.rank is not None:
                    mesh = mesh.slice(rank=target.rank)
        return mesh.proc_ids if mesh is not None else []

    def pids(self, target: Any) -> list[int]:
        assert self.controller is not None
        out = []
        for proc_id in self._procs(target):
            rec = self.controller.procs.get(proc_id)
            if rec is not None and rec.pid is not None:
                out.append(rec.pid)
        return out

    def run_in_worker(self, target: Any, func: str, *args: Any) -> None:
        assert self.controller is not None
        for proc_id in self._procs(target):
            self.controller.run_in_worker(proc_id, func, *args)

    def kill_host(self, host: str) -> None:
        assert self.controller is not None
        h = self.controller.hosts.get(host)
        if h is not None:
            h.kill()

    def set_host_cooldown(self, host: str, seconds: float) -> None:
        self._cooldown[host] = time.monotonic() + seconds

    def kill_quorum_service(self) -> None:
        if self._tree is not None:
            # The in-controller service "crashes": it loses all its state and comes back on
            # the same port, as a restarted Lighthouse would.
            port = int(self._tree.address.rsplit(":", 1)[1])
            self._tree.shutdown()
            self._start_tree_quorum(port)
            self.tracker.replacement_started(None)
            return
        self._kill_lighthouse()

    def _kill_lighthouse(self) -> None:
        import os
        import signal

        from faults.fault import Target

        for pid in self.pids(Target()):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    def committed_step(self) -> int:
        return self.tracker.committed_step

    def healthy_replicas(self) -> list[int]:
        """Replica groups not in the middle of a recovery."""
        busy = self.tracker.open_replicas()
        return [r for r in range(self.replicas) if r not in busy]


def _lighthouse_cls() -> type:
    from harness.actors import LighthouseActor

    return LighthouseActor


def run_job(
    cfg: JobConfig,
    run_dir: str | Path,
    *,
    journal: Journal | None = None,
    quiet: bool = False,
    on_started: Any = None,
    timeout: float | None = None,
    duration_s: float | None = None,
    stop_event: threading.Event | None = None,
) -> dict[str, Any]:
    """Run ``cfg`` to completion (or failure) and return its outcome; the journal is written
    to ``run_dir/journal.jsonl`` unless one is given. ``on_started(job)`` runs once training
    is under way (the chaos runner starts its injector there) and may return a callable that
    is called before the job stops."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    own = journal is None
    journal = journal or Journal(
        run_dir / "journal.jsonl", job=cfg.name, policy=cfg.recovery.policy
    )
    job = Job(cfg, run_dir, journal, quiet=quiet)
    before_stop = None
    t0 = time.time()
    try:
        job.start()
        if on_started is not None:
            before_stop = on_started(job)
        outcome = job.wait(timeout, duration_s, stop_event)
    except SupervisionError as exc:
        outcome = {"status": "failed", "reason": exc.failure.report(), "steps": 0}
    except Exception as exc:
        outcome = {
            "status": "failed",
            "reason": f"{type(exc).__name__}: {exc}",
            "steps": job.tracker.committed_step,
        }
        raise
    finally:
        if before_stop is not None:
            before_stop()
        job.stop()
        outcome_ = locals().get("outcome") or {"status": "failed", "reason": "interrupted"}
        journal.emit(
            JOB_END,
            status=outcome_["status"],
            reason=outcome_["reason"],
            steps=job.tracker.committed_step,
            seconds=time.time() - t0,
        )
        if own:
            journal.close()
    outcome["recoveries"] = job.tracker.completed
    outcome["run_dir"] = str(run_dir)
    return outcome


def main(args: argparse.Namespace) -> int:
    overrides = list(args.overrides)
    if args.prometheus_port is not None:
        overrides.append(f"telemetry.prometheus_port={args.prometheus_port}")
    try:
        cfg = load_config(args.config, overrides)
    except (ConfigError, FileNotFoundError) as exc:
        print(f"ftharness run: {exc}", file=sys.stderr)
        return 2
    run_dir = Path(args.out or Path("runs") / cfg.name)
    journal = Journal(run_dir / "journal.jsonl", job=cfg.name, policy=cfg.recovery.policy)
    telemetry = attach_telemetry(cfg, journal, quiet=args.quiet)
    try:
        outcome = run_job(cfg, run_dir, journal=journal, quiet=args.quiet)
    finally:
        if telemetry is not None:
            telemetry.shutdown()
        journal.close()
    print(
        f"\n{cfg.name}: {outcome['status']} — {outcome['steps']} steps committed, "
        f"{outcome['recoveries']} recoveries; journal {run_dir / 'journal.jsonl'}"
    )
    if outcome["status"] != "ok":
        print(outcome["reason"], file=sys.stderr)
        return 1
    return 0


def attach_telemetry(cfg: JobConfig, journal: Journal, *, quiet: bool = False) -> Any:
    """OpenTelemetry from the journal, when the config asks for an exporter."""
    tc = cfg.telemetry
    if tc.prometheus_port is None and tc.otlp_endpoint is None:
        return None
    from dashboards.telemetry import Telemetry

    telemetry = Telemetry(
        cfg.name,
        prometheus_port=tc.prometheus_port,
        prometheus_host=cfg.bind_host,
        otlp_endpoint=tc.otlp_endpoint,
    )
    journal.add_sink(telemetry.sink)
    if telemetry.prometheus_address and not quiet:
        host, port = telemetry.prometheus_address
        print(f"Prometheus metrics on http://{host}:{port}/metrics", file=sys.stderr, flush=True)
    return telemetry
