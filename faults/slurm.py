"""SLURM faults: a node that dies, the controller's node that dies, and a node's job step
cancelled. Each needs the job's hosts to be SLURM nodes (``launcher = "slurm"``); the planner
rejects them before launch otherwise.

``node_failure`` and ``scancel_step`` target a host (a node); the recovery tracker links the
recoveries of every group that was on that node to the fault, as it does for a host eviction
(``harness.job.recovery``). ``controller_node_failure`` targets the controller, and the node it
runs on when the fault fires (the injector fills in the host: ``faults.injector``); the takeover's
recovery is linked to it, as to a ``controller_crash``, and so are those of the groups that were
on that node (``slurm.controller_node = "trains"``).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import ClassVar

from faults.fault import FaultContext, Target, TargetKind, register


def _node(target: Target, kind: str) -> str:
    if target.host is None:
        raise ValueError(f"{kind} needs a host (node) target")
    return target.host


@register("node_failure")
@dataclass(frozen=True, kw_only=True)
class NodeFailure:
    """The node's slurmd and every process of the node are killed at once (a power failure):
    the agent's connection drops, its groups restart on a spare node (or the others), and SLURM
    marks the node DOWN after its ``SlurmdTimeout`` and drops it from the job (``--no-kill``);
    from then on it is never chosen again. Acts on nodes that are network namespaces on this
    machine (``bin/test-cluster``). Heal: none (a failed node stays down until an operator
    returns it, ``bin/test-cluster revive NODE``)."""

    default_target: ClassVar[TargetKind] = "host"
    needs_launcher: ClassVar[str] = "slurm"
    hold_s: float = 0.0

    def fire(self, ctx: FaultContext, target: Target, rng: random.Random) -> None:
        ctx.fail_node(_node(target, "node_failure"))

    def heal(self, ctx: FaultContext, target: Target) -> None:
        return None


@register("controller_node_failure")
@dataclass(frozen=True, kw_only=True)
class ControllerNodeFailure:
    """The node the job's controller runs on fails as in ``node_failure`` (its slurmd and every
    process of the node killed at once): the keeper and the controller die with it, a standby
    on another node takes the run over (docs/controller.md, "SLURM: when the controller's node
    is lost"), and resumes the fault plan. With ``slurm.controller_node = "reserved"`` no group
    is lost; with ``"trains"`` the node's groups restart elsewhere too. The fault runs in the
    controller it kills: its ``fault.inject`` record is written and fsync'd first. Only a job a
    new controller can take over may be hit (the planner refuses others before anything
    starts). Heal: none (the node stays down until ``bin/test-cluster revive NODE``)."""

    default_target: ClassVar[TargetKind] = "controller"
    needs_launcher: ClassVar[str] = "slurm"
    needs_takeover: ClassVar[bool] = True
    #: The injector sets the target's host to the controller's node at fire time.
    on_controller_node: ClassVar[bool] = True
    hold_s: float = 0.0

    def fire(self, ctx: FaultContext, target: Target, rng: random.Random) -> None:
        ctx.fail_node(_node(target, "controller_node_failure"))

    def heal(self, ctx: FaultContext, target: Target) -> None:
        return None


@register("scancel_step")
@dataclass(frozen=True, kw_only=True)
class ScancelStep:
    """The node's agent step is cancelled with ``scancel`` (SIGTERM, then SIGKILL after
    ``KillWait``), as torchft's punisher cancels a replica group's job: the agent stops its
    workers and exits, its groups restart elsewhere, and a new step is started on the node
    (which is still up). Heal: none."""

    default_target: ClassVar[TargetKind] = "host"
    needs_launcher: ClassVar[str] = "slurm"
    hold_s: float = 0.0

    def fire(self, ctx: FaultContext, target: Target, rng: random.Random) -> None:
        ctx.cancel_step(_node(target, "scancel_step"))

    def heal(self, ctx: FaultContext, target: Target) -> None:
        return None
