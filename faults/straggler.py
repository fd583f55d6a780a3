"""A straggler: one rank sleeps inside every step for a while."""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import ClassVar

from faults import inworker
from faults.fault import FaultContext, Target, TargetKind, register


@register("slow_rank")
@dataclass(frozen=True, kw_only=True)
class SlowRank:
    """Sets the trainer's step delay to ``delay_s`` for ``hold_s``; heal sets it back to 0. If the
    worker died meanwhile, its replacement starts with no delay; a heal that cannot reach it is
    recorded by the injector as ``fault.heal`` with ``error``."""

    default_target: ClassVar[TargetKind] = "rank"
    hold_s: float = 15.0
    delay_s: float = 0.5

    def fire(self, ctx: FaultContext, target: Target, rng: random.Random) -> None:
        ctx.run_in_worker(target, inworker.set_step_delay, self.delay_s)

    def heal(self, ctx: FaultContext, target: Target) -> None:
        ctx.run_in_worker(target, inworker.set_step_delay, 0.0)
