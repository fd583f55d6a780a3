"""A broken device: one replica group fails every step from now on, in every incarnation, as a
group on a GPU with an uncorrectable memory error would. Not a one-off fault: the crash-loop
rule (``harness.job.trainer_deaths``) is meant to see its deaths, tell that they are the group's
own and go on without the group."""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any, ClassVar

from faults.fault import FaultContext, Target, TargetKind, register


@register("broken_device")
@dataclass(frozen=True, kw_only=True)
class BrokenDevice:
    """Every rank of the target group, and of each group restarted in its place, raises
    ``RuntimeError: CUDA error: uncorrectable ECC error encountered`` at its next step. Its
    ``fault.inject`` record says ``recurs = true``: unlike every other kind, the deaths it
    causes are not explained away as a fault's, so they make a crash loop, which is the group's
    own (the others commit on): the group is dropped, the job goes on while at least
    ``min_replica_size`` groups are left. The built-in trainer only. Heal: none."""

    default_target: ClassVar[TargetKind] = "replica"
    #: Its failures come back: it drops a group rather than being ridden through (the soaks,
    #: which recover from every fault, leave it out).
    recurs: ClassVar[bool] = True
    hold_s: float = 0.0

    def inject_fields(self, rng: random.Random) -> dict[str, Any]:
        return {"recurs": True}

    def fire(self, ctx: FaultContext, target: Target, rng: random.Random) -> None:
        if target.replica is None:
            raise ValueError("broken_device: its target is a replica group")
        ctx.break_device(target.replica)

    def heal(self, ctx: FaultContext, target: Target) -> None:
        return None
