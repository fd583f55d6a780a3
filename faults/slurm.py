"""SLURM faults: a node that dies, and a node's job step cancelled. Each needs the job's hosts to
be SLURM nodes (``launcher = "slurm"``); the planner rejects them before launch otherwise.

Both target a host (a node); the recovery tracker links the recoveries of every group that was on
that node to the fault, as it does for a host eviction (``harness.job.recovery``).
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
