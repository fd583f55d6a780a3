"""Frozen, keyword-only specs of the supervision tree, kept apart from running instances.

Every duration is in seconds and named for what it bounds. ``check()`` validates a spec when it
is built, so an impossible one fails before anything launches.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any


class SpecError(ValueError):
    """A spec that cannot work, with a message saying which value and why."""


class Strategy(enum.StrEnum):
    """What a supervisor restarts when one child fails (Erlang/OTP names)."""

    ONE_FOR_ONE = "one_for_one"  # only the failed child
    ONE_FOR_ALL = "one_for_all"  # every child: they share fate (e.g. one process group)


class Restart(enum.StrEnum):
    """When a child is restarted (Erlang/OTP restart types)."""

    PERMANENT = "permanent"  # always
    TRANSIENT = "transient"  # only after an abnormal exit (non-zero code, signal, hang, lost host)
    TEMPORARY = "temporary"  # never; the failure is recorded and the child dropped


@dataclass(frozen=True, kw_only=True)
class HeartbeatSpec:
    """Liveness of workers (sent from a Python thread) and of host agents."""

    interval_s: float = 0.1
    timeout_s: float = 1.0

    def __post_init__(self) -> None:
        if self.interval_s <= 0:
            raise SpecError(f"heartbeat interval_s must be > 0, got {self.interval_s}")
        if self.timeout_s <= self.interval_s:
            raise SpecError(
                f"heartbeat timeout_s ({self.timeout_s}) must be larger than interval_s "
                f"({self.interval_s}): otherwise a healthy worker is declared hung between beats"
            )


@dataclass(frozen=True, kw_only=True)
class SupervisorSpec:
    """A supervisor's strategy, restart intensity and shutdown grace."""

    strategy: Strategy = Strategy.ONE_FOR_ONE
    max_restarts: int = 3  # at most this many restarts ...
    within_s: float = 60.0  # ... within this window, else escalate to the parent
    grace_s: float = 2.0  # SIGTERM, wait this long, then SIGKILL the process tree

    def __post_init__(self) -> None:
        if self.max_restarts < 0:
            raise SpecError(f"max_restarts must be >= 0, got {self.max_restarts}")
        if self.within_s <= 0:
            raise SpecError(f"within_s must be > 0, got {self.within_s}")
        if self.grace_s < 0:
            raise SpecError(f"grace_s must be >= 0, got {self.grace_s}")


@dataclass(frozen=True, kw_only=True)
class ControllerSpec:
    """The root of the tree: where it listens and how long its calls may take."""

    bind_host: str = "127.0.0.1"
    heartbeat: HeartbeatSpec = HeartbeatSpec()
    agent_heartbeat: HeartbeatSpec = HeartbeatSpec(interval_s=0.2, timeout_s=3.0)
    connect_timeout_s: float = 10.0  # handshakes (each one whole), agent start-up
    # Handshakes in flight on the controller's listener; one more drops the oldest pending one
    # (runtime/listener.py says why): bounds what unauthenticated connections can hold.
    max_pending_handshakes: int = 256
    call_timeout_s: float = 60.0  # default for an endpoint call's .get()
    spawn_timeout_s: float = 60.0  # a worker up and connected after the agent forks it
    preload: tuple[str, ...] = ("torch",)  # imported once by each agent, before it forks workers
    # ("module:function", kwargs) called once by each agent after its preload, before it forks
    # workers (runtime.messages.AgentConfig.warmup)
    warmup: tuple[tuple[str, dict[str, Any]], ...] = ()
    # Where agents advertise their address: an interface name or a CIDR (runtime.netaddr.choose)
    network_interface: str = ""
    network_cidr: str = ""
    # An agent that hears nothing from the controller this long fences itself (stops its
    # workers, exits): a partitioned host must not train on alone.
    controller_silence_s: float = 10.0
    # With a control file (runtime.control_file): how long agents and workers carry on without
    # a controller, waiting for a new one to take over (runtime.orphan); 0: they stop with it.
    controller_grace_s: float = 60.0
    # Each agent runs a relay to the quorum service (runtime.relay): the service may come back
    # at another address after a takeover (Controller.set_quorum_upstream says where it is).
    quorum_relay: bool = False

    def __post_init__(self) -> None:
        if self.connect_timeout_s <= 0 or self.call_timeout_s <= 0 or self.spawn_timeout_s <= 0:
            raise SpecError("controller timeouts must be > 0")
        if self.max_pending_handshakes < 1:
            raise SpecError(
                f"max_pending_handshakes must be >= 1, got {self.max_pending_handshakes}"
            )
        if not 0 <= self.controller_grace_s <= 7 * 24 * 3600.0:  # False for NaN too
            raise SpecError(
                f"controller_grace_s must be >= 0 and at most a week, got {self.controller_grace_s}"
            )
        if self.controller_silence_s <= self.agent_heartbeat.interval_s:
            raise SpecError(
                f"controller_silence_s ({self.controller_silence_s}) must be larger than the "
                f"interval the controller beats at ({self.agent_heartbeat.interval_s}): "
                "otherwise every agent fences itself between two beats"
            )
