"""Process faults: a real segfault inside the worker, SIGKILL, and SIGSTOP (a hang)."""

from __future__ import annotations

import os
import random
import signal
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
