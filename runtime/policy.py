"""Pure restart decisions: (spec, restart type, failure, restart history, now) -> decision.

No I/O here; supervisor.py applies the decision.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

from runtime.failure import Failure
from runtime.spec import Restart, Strategy, SupervisorSpec


class Action(enum.StrEnum):
    RESTART_ONE = "restart_one"
    RESTART_ALL = "restart_all"
    ESCALATE = "escalate"
    DROP = "drop"  # do not restart this child (temporary, or transient after a clean exit)
    ABSORB = "absorb"  # a handler took it


@dataclass(frozen=True)
class Decision:
    action: Action
    reason: str


def recent(history: Sequence[float], now: float, within_s: float) -> int:
    """How many restarts in ``history`` fall inside the intensity window ending at ``now``."""
    return sum(1 for t in history if now - t <= within_s)


def decide(
    spec: SupervisorSpec,
    restart: Restart,
    failure: Failure,
    history: Sequence[float],
    now: float,
) -> Decision:
    """What a supervisor does about one child's failure.

    Restart intensity: if restarting would make more than ``max_restarts`` restarts within
    ``within_s`` seconds, the supervisor gives up and escalates to its parent.
    """
    if restart is Restart.TEMPORARY:
        return Decision(Action.DROP, "temporary child: never restarted")
    if restart is Restart.TRANSIENT and not failure.abnormal:
        return Decision(Action.DROP, "transient child exited normally")
    n = recent(history, now, spec.within_s)
    if n >= spec.max_restarts:
        return Decision(
            Action.ESCALATE,
            f"restart intensity exceeded: {n} restarts within {spec.within_s:g} s "
            f"(max {spec.max_restarts})",
        )
    if spec.strategy is Strategy.ONE_FOR_ALL:
        return Decision(Action.RESTART_ALL, f"one_for_all: restart {n + 1}/{spec.max_restarts}")
    return Decision(Action.RESTART_ONE, f"one_for_one: restart {n + 1}/{spec.max_restarts}")


def host_restart(
    history: Sequence[float], now: float, max_restarts: int, within_s: float
) -> Decision:
    """Whether a lost host's agent is started again (``RESTART_ONE``) or the host is given up
    (``ESCALATE``): restart intensity for hosts, as :func:`decide` has for a supervisor's
    children. ``history``: when the restarts of this host's agent since the last one that
    succeeded began (an agent that never dials in is the case this bound exists for)."""
    n = recent(history, now, within_s)
    if n >= max_restarts:
        return Decision(
            Action.ESCALATE,
            f"host restart intensity exceeded: {n} restarts within {within_s:g} s "
            f"(recovery.host_max_restarts = {max_restarts})",
        )
    return Decision(Action.RESTART_ONE, f"host restart {n + 1}/{max_restarts}")
