"""Quorum service crash (torchft's Lighthouse or the tree's quorum service)."""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import ClassVar

from faults.fault import FaultContext, Target, TargetKind, register


@register("lighthouse_crash")
@dataclass(frozen=True, kw_only=True)
class LighthouseCrash:
    """Kills the quorum service; its supervisor (the controller) restarts it. Heal: none."""

    default_target: ClassVar[TargetKind] = "service"
    hold_s: float = 0.0

    def fire(self, ctx: FaultContext, target: Target, rng: random.Random) -> None:
        ctx.kill_quorum_service()

    def heal(self, ctx: FaultContext, target: Target) -> None:
        return None
