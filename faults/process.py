"""Process faults: a real segfault inside the worker, SIGKILL, and SIGSTOP (a hang)."""

from __future__ import annotations

import os
import random
import signal
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

import psutil

from faults import inworker
from faults.fault import FaultContext, Target, TargetKind, register


def signal_pids(pids: list[int], sig: int) -> list[int]:
    """Send ``sig`` to each pid that still exists; return the pids signalled. A pid that vanished
    in between (its supervisor reaped it) is skipped, not an error."""
    sent = []
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            continue
        sent.append(pid)
    return sent


@register("segfault")
@dataclass(frozen=True, kw_only=True)
class Segfault:
    """A null read through ctypes inside each target worker: the kernel delivers SIGSEGV.
    Heal: none (the supervisor restarts the group)."""

    default_target: ClassVar[TargetKind] = "rank"
    hold_s: float = 0.0

    def fire(self, ctx: FaultContext, target: Target, rng: random.Random) -> None:
        ctx.run_in_worker(target, inworker.segfault)

    def heal(self, ctx: FaultContext, target: Target) -> None:
        return None


@register("kill")
@dataclass(frozen=True, kw_only=True)
class Kill:
    """SIGKILL of each target worker process. Heal: none (the supervisor restarts the group)."""

    default_target: ClassVar[TargetKind] = "rank"
    hold_s: float = 0.0

    def fire(self, ctx: FaultContext, target: Target, rng: random.Random) -> None:
        pids = ctx.pids(target)
        if not pids:
            raise RuntimeError(f"kill: no worker process for {target.describe()}")
        signal_pids(pids, signal.SIGKILL)

    def heal(self, ctx: FaultContext, target: Target) -> None:
        return None


@register("hang")
@dataclass(frozen=True, kw_only=True)
class Hang:
    """SIGSTOP of each target worker: alive, silent, holding its sockets. Detected only by missed
    heartbeats. Heal after ``hold_s``: SIGCONT to any target process still stopped (the
    supervisor has usually killed and replaced it by then)."""

    default_target: ClassVar[TargetKind] = "rank"
    hold_s: float = 30.0

    def fire(self, ctx: FaultContext, target: Target, rng: random.Random) -> None:
        pids = ctx.pids(target)
        if not pids:
            raise RuntimeError(f"hang: no worker process for {target.describe()}")
        signal_pids(pids, signal.SIGSTOP)

    def heal(self, ctx: FaultContext, target: Target) -> None:
        stopped = []
        for pid in ctx.pids(target):
            try:
                if psutil.Process(pid).status() == psutil.STATUS_STOPPED:
                    stopped.append(pid)
            except psutil.NoSuchProcess:
                continue
        signal_pids(stopped, signal.SIGCONT)


class _KillWhileUnderWay:
    """What a kill aimed at a group in the middle of something shares: from the moment the fault
    falls due until it heals, every live group is slowed (``_slow_s`` seconds through
    ``_set_delay`` in its workers) so that the kill lands mid-way; it waits (up to ``wait_s``)
    for something under way (``_busy_groups``) and SIGKILLs every rank of those groups (the
    planned target is not used). Heal: the slowdown back to 0; the killed groups are restarted
    by their supervisors. A subclass names itself (``_kind``) and says what is slowed and what
    is under way."""

    default_target: ClassVar[TargetKind] = "replica"
    _kind: ClassVar[str]
    _set_delay: ClassVar[Callable[[float], None]]
    wait_s: float

    @property
    def _slow_s(self) -> float:
        raise NotImplementedError

    def _busy_groups(self, ctx: FaultContext) -> list[int]:
        raise NotImplementedError

    def _check(self) -> None:
        if not self.wait_s > 0:
            raise ValueError(f"{self._kind}: wait_s must be > 0, got {self.wait_s!r}")

    def _slow_every_group(self, ctx: FaultContext, seconds: float) -> None:
        for replica in range(ctx.replicas):
            try:
                ctx.run_in_worker(Target(replica=replica), type(self)._set_delay, seconds)
            except Exception:  # a group being restarted: its next incarnation goes at full speed
                continue

    def arm(self, ctx: FaultContext, rng: random.Random) -> None:
        if self._slow_s > 0:
            self._slow_every_group(ctx, self._slow_s)

    def ready(self, ctx: FaultContext, rng: random.Random) -> bool:
        return bool(self._busy_groups(ctx))

    def aim(self, ctx: FaultContext, planned: Target) -> list[Target]:
        return [Target(replica=g, host=ctx.replica_host(g)) for g in self._busy_groups(ctx)]

    def fire(self, ctx: FaultContext, target: Target, rng: random.Random) -> None:
        pids = ctx.pids(target)
        if not pids:
            raise RuntimeError(f"{self._kind}: no worker process for {target.describe()}")
        signal_pids(pids, signal.SIGKILL)

    def heal(self, ctx: FaultContext, target: Target) -> None:
        if self._slow_s > 0:
            self._slow_every_group(ctx, 0.0)


@register("heal_source_kill")
@dataclass(frozen=True, kw_only=True)
class HealSourceKill(_KillWhileUnderWay):
    """SIGKILL of every rank of the group a heal under way loads its state from, while it
    serves: the healing group must take the state from another group, or retry, without a
    restart of its own. It waits (up to ``wait_s``) for a heal whose source has begun to send
    (``trainer.heal_start`` of the healer, ``trainer.serve_start`` of the source: the quorum's
    process group configured) and aims at that source then (the planned target is not used). So
    that the kill lands while the source still serves, every live group serves heals
    ``slow_serve_s`` late from the moment the fault falls due until it heals
    (``faults.inworker.set_serve_delay``, built-in trainer only; 0: as fast as they can, the kill
    may land after the heal). Heal: the serving delay
    back to 0; the killed group is restarted by its supervisor."""

    _kind: ClassVar[str] = "heal_source_kill"
    _set_delay: ClassVar[Callable[[float], None]] = staticmethod(inworker.set_serve_delay)
    hold_s: float = 0.0
    wait_s: float = 60.0
    slow_serve_s: float = 2.0

    def __post_init__(self) -> None:
        self._check()
        if self.slow_serve_s < 0:
            raise ValueError(
                f"heal_source_kill: slow_serve_s must be >= 0, got {self.slow_serve_s!r}"
            )

    @property
    def _slow_s(self) -> float:
        return self.slow_serve_s

    def _busy_groups(self, ctx: FaultContext) -> list[int]:
        """The sources of the heals under way."""
        return sorted(set(ctx.heals_under_way().values()))


@register("checkpoint_kill")
@dataclass(frozen=True, kw_only=True)
class CheckpointKill(_KillWhileUnderWay):
    """SIGKILL of every rank of a group while it writes a checkpoint, before the checkpoint is in
    place: what was written must never be loaded, and the job goes on from the checkpoint
    before (``full_restart``, or every group lost) or from a peer (in place). It waits (up to
    ``wait_s``) for a write under way (``checkpoint.start`` of the writing group, not yet its
    ``checkpoint.save``) and aims at the writer then (the planned target is not used). So that
    the kill lands mid-write, every group's checkpoints wait ``slow_write_s`` before they are in
    place from the moment the fault falls due until it heals (DCP: every shard and the metadata
    written, the folder not yet renamed; ``faults.inworker.set_checkpoint_delay``, built-in
    trainer only). Heal: the delay back to 0; the killed group is restarted by its
    supervisor."""

    _kind: ClassVar[str] = "checkpoint_kill"
    _set_delay: ClassVar[Callable[[float], None]] = staticmethod(inworker.set_checkpoint_delay)
    hold_s: float = 0.0
    wait_s: float = 60.0
    slow_write_s: float = 2.0

    def __post_init__(self) -> None:
        self._check()
        if self.slow_write_s < 0:
            raise ValueError(
                f"checkpoint_kill: slow_write_s must be >= 0, got {self.slow_write_s!r}"
            )

    @property
    def _slow_s(self) -> float:
        return self.slow_write_s

    def _busy_groups(self, ctx: FaultContext) -> list[int]:
        """The groups writing a checkpoint now."""
        return sorted(ctx.checkpoints_under_way())
