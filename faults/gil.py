"""GIL deadlock: a thread in the worker holds the GIL inside a C call; the process is alive but
no Python code runs, so its heartbeat thread goes silent."""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import ClassVar

from faults import inworker
from faults.fault import FaultContext, Target, TargetKind, register


@register("gil_deadlock")
@dataclass(frozen=True, kw_only=True)
class GilDeadlock:
    """Runs ``faults.inworker.hold_gil(seconds)`` in each target worker. ``seconds`` is how long
    the GIL is held if nobody intervenes (the supervisor should kill the frozen worker long
    before). Heal: none; a frozen worker cannot be asked to let go."""

    default_target: ClassVar[TargetKind] = "rank"
    hold_s: float = 0.0
    seconds: float = 3600.0

    def fire(self, ctx: FaultContext, target: Target, rng: random.Random) -> None:
        ctx.run_in_worker(target, inworker.hold_gil, self.seconds)

    def heal(self, ctx: FaultContext, target: Target) -> None:
        return None
