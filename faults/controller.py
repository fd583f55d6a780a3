"""The controller itself dies, or wedges: ``controller_crash``.

The job's root is a process too (``harness.job.controller_proc``), run under a keeper that hands
the run to a new controller when it dies (``harness.keeper.keeper``, ``harness.job.takeover``,
docs/controller.md). This fault SIGKILLs it (``how = "kill"``), with no warning and nothing
flushed beyond what the journal already holds, or wedges it (``how = "wedge"``: a thread takes
the control plane's lock and never gives it back, a deadlock the process does not notice; its
beat to the keeper stops, and the keeper kills it after ``timeouts.controller_silence``), at a
seeded moment or at a chosen phase of the job:

* ``any``: at once;
* ``quorum``: while a quorum is forming (a member has asked and the round is not decided);
* ``heal``: while another group recovers (a recovery is open: restarting, healing from a peer);
* ``checkpoint``: as a checkpoint is being written (the first commit of a checkpoint step);
* ``random``: one of the four, drawn from the fault's seeded generator (said on stderr).

The injector waits for the phase before it writes ``fault.inject`` (``ready``: asked every 2 ms),
so the record's time is the kill's and a report's detection and stall times are measured from
it; the record says the phase (``phase``), how long it waited (``waited_s``) and whether the
phase came (``ready``). A phase not reached within ``wait_s`` kills it anyway. The fault runs in
the controller it kills: the ``fault.inject`` record is written first, and the new controller's
injector, resumed from the journal, writes the ``fault.heal`` and fires the rest of the plan
(``faults.injector.Injector.resume``). Only a job a new controller can take over may be hit
(the planner refuses others before anything starts).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import ClassVar

from faults.fault import FaultContext, Target, TargetKind, register

#: The moments a controller crash can wait for (module docstring).
PHASES = ("any", "quorum", "heal", "checkpoint")
#: ``phase`` may also be this: one of PHASES drawn per fault.
RANDOM = "random"
#: How the controller is hit (module docstring).
HOW = ("kill", "wedge")


@register("controller_crash")
@dataclass(frozen=True, kw_only=True)
class ControllerCrash:
    """SIGKILLs the job's controller at ``phase`` (module docstring); a standby controller takes
    the job over, nothing restarted. Heal: none (the next controller records it)."""

    default_target: ClassVar[TargetKind] = "controller"
    needs_takeover: ClassVar[bool] = True
    hold_s: float = 0.0
    phase: str = "any"
    wait_s: float = 30.0
    how: str = "kill"

    def __post_init__(self) -> None:
        if self.phase not in (*PHASES, RANDOM):
            raise ValueError(
                f"controller_crash: phase {self.phase!r} is not one of "
                f"{', '.join((*PHASES, RANDOM))}"
            )
        if self.how not in HOW:
            raise ValueError(f"controller_crash: how {self.how!r} is not one of {', '.join(HOW)}")
        if not self.wait_s > 0:
            raise ValueError(f"controller_crash: wait_s must be > 0, got {self.wait_s!r}")

    def _phase(self, rng: random.Random) -> str:
        return rng.choice(PHASES) if self.phase == RANDOM else self.phase

    def ready(self, ctx: FaultContext, rng: random.Random) -> bool:
        """Whether the job is in the phase to die in (the injector asks until ``wait_s``)."""
        phase = self._phase(rng)
        return phase == "any" or ctx.in_phase(phase)

    def inject_fields(self, rng: random.Random) -> dict[str, str]:
        return {"phase": self._phase(rng), "how": self.how}

    def fire(self, ctx: FaultContext, target: Target, rng: random.Random) -> None:
        if self.how == "wedge":
            ctx.wedge_controller()
        else:
            ctx.kill_controller()

    def heal(self, ctx: FaultContext, target: Target) -> None:
        return None
