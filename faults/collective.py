"""Collective abort: the trainer's communicator is aborted mid-collective; the process lives but
its step fails, so recovery should not need a process restart."""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import ClassVar

from faults import inworker
from faults.fault import FaultContext, Target, TargetKind, register


@register("collective_abort")
@dataclass(frozen=True, kw_only=True)
class CollectiveAbort:
    """Runs ``trainer.abort_collectives()`` in each target worker (torchft's process-group abort
    on gloo; NCCL's communicator abort on GPU). Heal: none (the trainer reconfigures its process
    group at the next quorum)."""

    default_target: ClassVar[TargetKind] = "rank"
    hold_s: float = 0.0

    def fire(self, ctx: FaultContext, target: Target, rng: random.Random) -> None:
        ctx.run_in_worker(target, inworker.abort_collectives)

    def heal(self, ctx: FaultContext, target: Target) -> None:
        return None
