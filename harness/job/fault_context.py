"""The fault injector's view of a running job (``faults.fault.FaultContext``), and nothing more.

Faults reach a job only through this adapter: which processes a target names, running a hook in
a worker, killing a host, keeping a host out for a cooldown, crashing the quorum service. It
reads the job's records and calls the job's own operations; it keeps no state of its own but
where the job's data stands (the last committed step's ``seq_due``, and the recent step rate,
for ``poison_data``).
"""

from __future__ import annotations

import math
import os
import signal
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any, Protocol

from faults.data import MAX_STEPS_AHEAD
from faults.fault import Target
from harness.config import JobConfig
from harness.job.groups import Groups
from harness.job.hosts import HostPool
from harness.job.recovery import RecoveryTracker
from harness.job.site import Site
from harness.quorum.service import QuorumService
from harness.rank.data import TokenStream
from harness.rank.token_data import make_stream
from runtime.controller import Controller
from runtime.journal import STEP_COMMIT, Journal, Record
from runtime.mesh import ActorMesh, ProcMesh

#: The fewest steps ahead ``poison_data`` aims when it aims by time.
MIN_STEPS_AHEAD = 3
#: How many of the job's latest new steps its step rate is read from.
RATE_WINDOW = 32


class RunningJob(Protocol):
    """What the adapter reads of a job (``harness.job.protocol.Job`` is one)."""

    cfg: JobConfig
    journal: Journal
    tracker: RecoveryTracker
    survivable: bool  # whether a new controller may take the job over

    @property
    def controller(self) -> Controller: ...

    def host_names(self) -> list[str]: ...

    def group_host(self, replica: int) -> str: ...

    def mesh_of(self, replica: int | None) -> ActorMesh | ProcMesh | None: ...

    @property
    def hosts(self) -> HostPool: ...

    @property
    def quorum(self) -> QuorumService: ...

    @property
    def groups_kind(self) -> Groups: ...

    site: Site  # where it runs: its test network (netns) or allocation (slurm), if any


class JobFaultContext:
    def __init__(self, job: RunningJob) -> None:
        self._job = job
        self.journal: Journal = job.journal
        self.replicas: int = job.cfg.replicas
        self.ranks: int = job.cfg.ranks
        self._due = 0  # every sequence below it was due by the last committed step
        self._progress: deque[tuple[float, int]] = deque(maxlen=RATE_WINDOW)  # (t, new step)
        self._stream: TokenStream | None = None
        job.journal.add_sink(self._on_record)

    def _on_record(self, r: Record) -> None:
        if r.get("event") != STEP_COMMIT:
            return
        if isinstance(r.get("seq_due"), int):
            self._due = max(self._due, r["seq_due"])
        step, t = r.get("step"), r.get("t")
        if not isinstance(step, int) or not isinstance(t, int | float):
            return
        if not self._progress or step > self._progress[-1][1]:  # the job's progress
            self._progress.append((float(t), step))

    def steps_in(self, seconds: float) -> int:
        """How many steps the job commits in ``seconds`` at its rate over its latest
        ``RATE_WINDOW`` new steps, rounded up (0 before it has committed two)."""
        if len(self._progress) < 2:
            return 0
        (t0, s0), (t1, s1) = self._progress[0], self._progress[-1]
        return math.ceil(seconds * (s1 - s0) / max(t1 - t0, 1e-6) - 1e-9)

    def poison_data(
        self, steps_ahead: int | None, effect: str = "unreadable", *, ahead_s: float = 1.0
    ) -> dict[str, Any]:
        if steps_ahead is None:
            steps_ahead = min(max(self.steps_in(ahead_s), MIN_STEPS_AHEAD), MAX_STEPS_AHEAD)
        data = self._job.cfg.data
        if self._stream is None:  # the map from a sequence to its data (a corpus chunk)
            n = self.replicas * self.ranks
            self._stream = make_stream(data, shard=0, num_shards=n, group_size=self.ranks)
        per_step = self.replicas * self.ranks * data.batch_size
        index = self._due + (steps_ahead - 1) * per_step
        key = self._stream.key(index)
        self._job.groups_kind.poison(key, effect)
        where = self._stream.where(key)
        return {"index": index, "key": key, "effect": effect, "steps_ahead": steps_ahead, **where}

    def break_device(self, replica: int) -> None:
        self._job.groups_kind.break_device(replica)

    @property
    def networked(self) -> bool:
        return self._job.site.network is not None

    @property
    def launcher(self) -> str:
        return self._job.cfg.launcher

    def hosts(self) -> list[str]:
        return self._job.host_names()

    def replica_host(self, replica: int) -> str:
        """Where the group runs now (its home host before it first started)."""
        return self._job.group_host(replica)

    def _proc_ids(self, target: Target) -> list[str]:
        mesh = self._job.mesh_of(target.replica)
        if mesh is not None and target.replica is not None and target.rank is not None:
            mesh = mesh.slice(rank=target.rank)
        return mesh.proc_ids if mesh is not None else []

    def pids(self, target: Target) -> list[int]:
        procs = self._job.controller.procs
        out = []
        for proc_id in self._proc_ids(target):
            rec = procs.get(proc_id)
            if rec is not None and rec.pid is not None:
                out.append(rec.pid)
        return out

    def run_in_worker(self, target: Target, func: Callable[..., Any], *args: Any) -> None:
        """``func(*args)`` in each worker of ``target``; in a program of the user's own, the
        program's hook keyed by ``func``'s wire name (``runtime.actor.wire_name``)."""
        for proc_id in self._proc_ids(target):
            self._job.groups_kind.run_in_worker(proc_id, func, *args)

    def kill_host(self, host: str) -> None:
        h = self._job.controller.hosts.get(host)
        if h is not None:
            h.kill()

    def set_host_cooldown(self, host: str, seconds: float) -> None:
        self._job.hosts.set_cooldown(host, seconds)

    def kill_quorum_service(self) -> None:
        self._job.quorum.crash()

    def committed_step(self) -> int:
        return self._job.tracker.committed_step

    def _network(self, what: str) -> Any:
        net = self._job.site.network
        if net is None:
            raise ValueError(f"{what} needs hosts with a network of their own (launcher = 'netns')")
        return net

    def partition_host(self, host: str) -> None:
        self._network("a network partition").partition(host)

    def reconnect_host(self, host: str) -> None:
        self._network("a network partition").heal(host)

    def impair_link(self, host: str, delay_ms: float, loss_pct: float) -> None:
        self._network("network delay or loss").impair(host, delay_ms, loss_pct)

    def clear_link(self, host: str) -> None:
        self._network("network delay or loss").clear(host)

    def _slurm(self, what: str) -> Any:
        launcher = self._job.site.slurm
        if launcher is None:
            raise ValueError(f"{what} needs launcher = 'slurm'")
        return launcher

    def controller_host(self) -> str:
        """The node (host) this process, the job's controller, runs on."""
        from harness.rundir import this_host

        return this_host()

    def fail_node(self, host: str) -> None:
        from runtime.launchers.slurm_testcluster import fail_node

        self._slurm("a node failure")
        if host == self.controller_host():
            self._fail_own_node(host)
        else:
            fail_node(host)

    def _fail_own_node(self, host: str) -> None:
        """Fail the node this controller runs on: only where a standby on another node takes
        the run over; the journal fsync'd first (the ``fault.inject`` before it is durable), then
        the node killed by a process outside it (one inside would freeze itself with the node:
        ``fail_node`` freezes every process of it first). Returns only if that failed."""
        from runtime.launchers.slurm_testcluster import fail_from_outside

        why = self.takeover
        if why is None and not self._standby_elsewhere():
            why = (
                "no standby on another node would take it over (keeper.json names no beat, or "
                f"none connected to it within {STANDBY_WAIT_S:g} s)"
            )
        if why is not None:
            raise ValueError(f"the loss of the controller's node {host} would end this job: {why}")
        self._job.journal.sync()
        print(
            f"[ftharness] controller_node_failure: failing this node, {host} (pid {os.getpid()})",
            file=sys.stderr,
            flush=True,
        )
        fail_from_outside(host)  # frozen and killed with the node; raises if it was not

    def _standby_elsewhere(self) -> bool:
        """Whether this run's keeper serves beats to a standby on another node, waiting up to
        :data:`STANDBY_WAIT_S` for the standby to connect (its job step starts with the run: a
        fault early in the run would otherwise kill the node before anyone watches it)."""
        from harness.rundir import KEEPER_FILE, read_json

        path = self._job.journal.path
        if path is None:
            return False
        deadline = time.monotonic() + STANDBY_WAIT_S
        while True:
            info = read_json(path.parent / KEEPER_FILE) or {}
            if not info.get("beat"):
                return False
            if info.get("watched"):
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.2)

    def cancel_step(self, host: str) -> None:
        self._slurm("scancel of a step").cancel_step(host)

    @property
    def takeover(self) -> str | None:
        """Why a new controller could not take this job over (None: it could)."""
        from harness.job.takeover import supported
        from harness.keeper.keeper import KEEPER_ENV

        why = supported(self._job.cfg)
        if why is None and not (self._job.survivable and KEEPER_ENV in os.environ):
            why = "its controller is the process that started it, not one run under a keeper"
        return why

    def kill_controller(self) -> None:
        """SIGKILL this process, the job's controller, from a thread of its own a moment later
        (the injector's records written, the fault returned)."""
        why = self.takeover
        if why is not None:
            raise ValueError(f"a controller crash would end this job: {why}")
        threading.Thread(target=_kill_self, daemon=True, name="controller-crash").start()

    def wedge_controller(self) -> None:
        """A thread takes the control plane's lock and keeps it: every supervision decision
        waits forever, while the process lives on (its keeper's beat stops with it)."""
        why = self.takeover
        if why is not None:
            raise ValueError(f"a wedged controller would end this job: {why}")
        lock = self._job.controller._lock  # the one lock of the control plane (runtime.controller)
        ready = threading.Event()

        def wedge() -> None:
            with lock:
                ready.set()
                say = "[ftharness] controller_crash: the controller wedged"
                print(say, file=sys.stderr, flush=True)
                threading.Event().wait()  # forever

        threading.Thread(target=wedge, daemon=True, name="controller-wedge").start()
        ready.wait(5.0)

    def heals_under_way(self) -> dict[int, int]:
        """Healing group -> its source group, once the source sends (``RecoveryTracker``)."""
        return self._job.tracker.heals_under_way()

    def checkpoints_under_way(self) -> dict[int, int]:
        """Writing group -> its checkpoint's step, until it is in place (``RecoveryTracker``)."""
        return self._job.tracker.checkpoints_under_way()

    def in_phase(self, phase: str) -> bool:
        """Whether the job is in ``phase`` now (``faults.controller``)."""
        job = self._job
        if phase == "quorum":  # a round is open: someone asked, nothing issued yet
            return job.quorum.round_open()
        if phase == "heal":  # a group is recovering (restarting, healing from a peer)
            return bool(job.tracker.open_replicas() - {None})
        if phase == "checkpoint":  # a checkpoint step just committed: its writers at work
            every = job.cfg.checkpoint.every_steps
            if not every:
                raise ValueError("phase 'checkpoint': this job writes no checkpoints")
            step = job.tracker.committed_step
            return step >= every and step % every <= 1
        raise ValueError(f"unknown phase {phase!r}")

    def healthy_replicas(self) -> list[int]:
        """Replica groups not in the middle of a recovery."""
        busy = self._job.tracker.open_replicas()
        return [r for r in range(self.replicas) if r not in busy]


#: How long the fault waits for the keeper's standby on another node to be connected.
STANDBY_WAIT_S = 60.0


def _kill_self() -> None:
    """SIGKILL this process, saying so first."""
    time.sleep(0.001)  # the injector's thread returns from the fault first
    print(
        f"[ftharness] controller_crash: SIGKILL to the controller (pid {os.getpid()})",
        file=sys.stderr,
        flush=True,
    )
    os.kill(os.getpid(), signal.SIGKILL)
