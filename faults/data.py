"""Poison data: a sequence that fails the step of whichever group reads it, or gives it a
non-finite loss."""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import ClassVar, Literal

from faults.fault import FaultContext, Target, TargetKind, register
from runtime.journal import POISON_DATA

#: The most steps ahead a poisoned sequence may be (the run must still be reading by then).
MAX_STEPS_AHEAD = 1000
#: The most seconds ahead it may be aimed.
MAX_AHEAD_S = 600.0


@register("poison_data")
@dataclass(frozen=True, kw_only=True)
class PoisonData:
    """Make the data the job reads ``ahead_s`` seconds of its steps after its last committed step
    (that step's first sequence; at the step rate of its latest commits, at least 3 steps) bad,
    or ``steps_ahead`` steps after it where that is set. Aimed by time, the mark reaches every
    group before any reads that data, however fast the job steps. ``effect = "unreadable"``: a
    record a loader cannot decode, the step of whichever group reads it fails; the harness
    quarantines it once two groups have failed on it. ``"nonfinite"``: its loss is NaN, as a
    sequence that overflows the model's numerics gives; the harness quarantines it once the
    checksums show the weights of the group that met it equal to the others'
    (``harness.job.poison``). It stays bad for the rest of the run, in every group, a restarted
    one too; for a token file the bad data is a chunk of the corpus, met again at each epoch.
    Its target is the job: the data every group reads. The built-in trainer only. Heal: none."""

    default_target: ClassVar[TargetKind] = "service"
    hold_s: float = 0.0
    ahead_s: float = 1.0
    steps_ahead: int | None = None
    effect: Literal["unreadable", "nonfinite"] = "unreadable"

    def __post_init__(self) -> None:
        if self.steps_ahead is not None and not 1 <= self.steps_ahead <= MAX_STEPS_AHEAD:
            raise ValueError(
                f"poison_data: steps_ahead must be 1-{MAX_STEPS_AHEAD}, got {self.steps_ahead!r}"
            )
        if not 0 < self.ahead_s <= MAX_AHEAD_S:
            raise ValueError(
                f"poison_data: ahead_s must be above 0 and at most {MAX_AHEAD_S:g}, "
                f"got {self.ahead_s!r}"
            )

    def fire(self, ctx: FaultContext, target: Target, rng: random.Random) -> None:
        where = ctx.poison_data(self.steps_ahead, self.effect, ahead_s=self.ahead_s)
        ctx.journal.emit(POISON_DATA, **where)

    def heal(self, ctx: FaultContext, target: Target) -> None:
        return None
