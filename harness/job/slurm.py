"""A job on SLURM: its hosts from the allocation, and SLURM's time-limit signal.

* :func:`make_launcher`: ``launcher = "slurm"`` — the allocation (``runtime.launchers.slurm``), the
address
  the controller binds (one the nodes reach), and the job's host count (allocated nodes minus
  ``slurm.spare_nodes``).
* :class:`TimeLimit`: the batch script asks SLURM for a signal before the time limit
  (``#SBATCH --signal=B:USR1@120``); on SIGUSR1 the controller asks every replica group to
  checkpoint at its next committed step, waits for that checkpoint (at most ``save_timeout_s``),
  and then stops the job the normal way: the run ends ``ok`` with the reason "stopped by its
  caller", the journal says why (``slurm.time_limit``), and the report is written from it.
  SIGTERM (what SLURM sends every process of a job it ends: ``scancel``, a time limit without
  ``--signal``) ends the run at once instead, failed, with that reason: nothing is waited for,
  since SLURM kills what is left after its ``KillWait``. (An allocation that ends under a
  controller that SLURM does not signal, as ``salloc``'s command, is seen by the launcher:
  ``runtime.launchers.slurm``, ``harness.job.hosts``.)

Not guaranteed: a checkpoint needs ``checkpoint.every_steps > 0`` (a checkpoint folder); without
one the job only stops cleanly. A step that takes longer than the time left is not waited for
past ``save_timeout_s``.
"""

from __future__ import annotations

import dataclasses
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from harness.config import JobConfig
from harness.job.completion import Completion
from runtime.journal import CHECKPOINT_SAVE, Journal, Record
from runtime.launchers.slurm import (
    Allocation,
    SlurmLauncher,
    allocation_from_env,
    controller_address,
)

TIME_LIMIT = "slurm.time_limit"


class StoppableJob(Protocol):
    """What the time limit needs of a running job (``harness.job.protocol.Job`` is one)."""

    cfg: JobConfig
    journal: Journal
    completion: Completion

    def say(self, text: str) -> None: ...

    def in_every_trainer(self, func: Callable[..., Any], *args: Any) -> None: ...


def make_launcher(
    cfg: JobConfig, run_dir: str | Path, on_gone: Callable[[str, str], None] | None = None
) -> tuple[SlurmLauncher, JobConfig]:
    """The launcher and the config as it runs here (SlurmError outside an allocation)."""
    alloc = allocation_from_env()
    launcher = SlurmLauncher(
        alloc,
        run_dir,
        spare_nodes=cfg.slurm.spare_nodes,
        poll_s=cfg.slurm.poll_s,
        on_gone=on_gone,
        reserved=reserved_node(cfg, alloc),
    )
    bind = cfg.bind_host
    if bind in ("127.0.0.1", "localhost"):  # the default: the nodes could not reach it
        bind = controller_address(alloc)
    return launcher, dataclasses.replace(cfg, bind_host=bind, hosts=len(launcher.active))


def reserved_node(cfg: JobConfig, alloc: Allocation) -> str | None:
    """The node that runs only the controller (``slurm.controller_node = "reserved"``): the
    allocation's first, where SLURM runs the batch script. None when the controller runs
    outside the allocation (``salloc``'s command on a login node): no node is its own then."""
    if cfg.slurm.controller_node != "reserved" or alloc.this_node is None:
        return None
    return alloc.nodes[0]


def check_allocation(cfg: JobConfig) -> str | None:
    """What is wrong with running ``cfg`` here, before anything launches (None: nothing)."""
    if cfg.launcher != "slurm":
        return None
    from runtime.launchers.slurm import SlurmError, agent_nodes

    try:
        alloc = allocation_from_env()
        agent_nodes(alloc, cfg.slurm.spare_nodes, reserved_node(cfg, alloc))
    except SlurmError as exc:
        return str(exc)
    return None


class TimeLimit:
    """SIGUSR1 -> checkpoint at the next committed step -> stop (see the module docstring).
    Construct it on the main thread (signal handlers are installed there)."""

    def __init__(
        self,
        signum: int = signal.SIGUSR1,
        save_timeout_s: float = 90.0,
        end_signum: int = signal.SIGTERM,
    ) -> None:
        self.stop_event = threading.Event()
        self.signalled = threading.Event()
        self.ended: str | None = None  # why SLURM is ending the job (SIGTERM)
        self.save_timeout_s = save_timeout_s
        self._job: StoppableJob | None = None
        self._signum, self._end_signum = signum, end_signum
        self._previous = signal.signal(signum, self._on_signal)
        self._previous_end = signal.signal(end_signum, self._on_end)

    def on_started(self, job: StoppableJob) -> None:
        self._job = job
        if self.ended is not None:  # SLURM's SIGTERM came while the job was starting
            job.completion.fail(self.ended)
        elif self.signalled.is_set():  # the signal came while the job was starting
            self._start_thread()

    def restore(self) -> None:
        signal.signal(self._signum, self._previous)
        signal.signal(self._end_signum, self._previous_end)

    def _on_end(self, signum: int, frame: Any) -> None:
        if self.ended is not None:
            return
        self.ended = (
            f"{signal.Signals(signum).name}: SLURM is ending the job (scancel, or its time limit "
            "without --signal); the run stops now, and the last checkpoint written is the one to "
            "resume from"
        )
        self.signalled.set()  # no checkpoint on a later SIGUSR1; a chaos run runs no more policies
        if self._job is not None:
            self._job.completion.fail(self.ended)
        self.stop_event.set()  # a job still starting stops as soon as it has started

    def _on_signal(self, signum: int, frame: Any) -> None:
        if self.signalled.is_set():
            return
        self.signalled.set()
        if self._job is not None:
            self._start_thread()
        # else: on_started acts on it; a job that never starts never needs a checkpoint

    def _start_thread(self) -> None:
        threading.Thread(target=self._checkpoint_then_stop, daemon=True).start()

    def _checkpoint_then_stop(self) -> None:
        job = self._job
        assert job is not None  # started only once the job is known
        try:
            job.say("SLURM time limit near (SIGUSR1): checkpointing, then stopping")
            saved = checkpoint_now(job, self.save_timeout_s)
            job.journal.emit(TIME_LIMIT, checkpoint_step=saved)
        finally:
            self.stop_event.set()


def checkpoint_now(job: StoppableJob, timeout_s: float) -> int | None:
    """Ask every group to write a checkpoint at its next committed step; return that step once
    one is saved, None if checkpoints are off or none came within ``timeout_s``."""
    from harness.rank.actors import checkpoint_next_step  # (imports torch)

    if job.cfg.checkpoint.every_steps <= 0:
        return None
    t0 = time.time()
    saved: list[int] = []
    done = threading.Event()

    def sink(r: Record) -> None:
        if r.get("event") == CHECKPOINT_SAVE and r["t"] >= t0:
            saved.append(int(r["step"]))
            done.set()

    job.journal.add_sink(sink)
    job.in_every_trainer(checkpoint_next_step)  # a group being restarted: the others do
    done.wait(timeout_s)
    return saved[0] if saved else None
