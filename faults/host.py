"""Host eviction: a whole host lost at once and kept out for a cooldown."""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import ClassVar

from faults.fault import FaultContext, Target, TargetKind, register


@register("host_eviction")
@dataclass(frozen=True, kw_only=True)
class HostEviction:
    """Kills the host agent and its whole process tree, and keeps the host out for
    ``cooldown_s``; its groups are re-placed elsewhere or the job runs degraded, as configured.
    Heal: none (the cooldown expires by itself)."""

    default_target: ClassVar[TargetKind] = "host"
    hold_s: float = 0.0
    cooldown_s: float = 30.0

    def fire(self, ctx: FaultContext, target: Target, rng: random.Random) -> None:
        if target.host is None:
            raise ValueError("host_eviction needs a host target")
        # Cooldown first: otherwise the controller may respawn the agent on this very host in
        # the moment between the kill and the cooldown.
        ctx.set_host_cooldown(target.host, self.cooldown_s)
        ctx.kill_host(target.host)

    def heal(self, ctx: FaultContext, target: Target) -> None:
        return None
