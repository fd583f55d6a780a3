"""Network faults on a host's link: a partition, added delay, lost packets. Each needs hosts
with a network of their own (``launcher = "netns"``); the experiment spec rejects them before
launch otherwise."""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import ClassVar

from faults.fault import FaultContext, Target, TargetKind, register


def _host(target: Target, kind: str) -> str:
    if target.host is None:
        raise ValueError(f"{kind} needs a host target")
    return target.host


@register("network_partition")
@dataclass(frozen=True, kw_only=True)
class NetworkPartition:
    """Cuts a host off from every other (its link goes down) for ``hold_s``. Its groups are
    declared lost after the host timeout and restarted elsewhere; its agent fences itself once
    the controller has been silent for ``timeouts.controller_silence``; the quorum admits only
    the groups' new incarnations, so the cut-off ones can never commit or serve weights again.
    The host is kept out (a cooldown) until the partition heals. Heal: the link comes back."""

    default_target: ClassVar[TargetKind] = "host"
    needs_network: ClassVar[bool] = True
    hold_s: float = 8.0

    def fire(self, ctx: FaultContext, target: Target, rng: random.Random) -> None:
        host = _host(target, "network_partition")
        ctx.set_host_cooldown(host, self.hold_s)  # no new agent there while it is cut off
        ctx.partition_host(host)

    def heal(self, ctx: FaultContext, target: Target) -> None:
        ctx.reconnect_host(_host(target, "network_partition"))


@register("network_delay")
@dataclass(frozen=True, kw_only=True)
class NetworkDelay:
    """``delay_ms`` more latency each way on a host's link for ``hold_s``. Heal: removed."""

    default_target: ClassVar[TargetKind] = "host"
    needs_network: ClassVar[bool] = True
    hold_s: float = 10.0
    delay_ms: float = 50.0

    def fire(self, ctx: FaultContext, target: Target, rng: random.Random) -> None:
        ctx.impair_link(_host(target, "network_delay"), self.delay_ms, 0.0)

    def heal(self, ctx: FaultContext, target: Target) -> None:
        ctx.clear_link(_host(target, "network_delay"))


@register("packet_loss")
@dataclass(frozen=True, kw_only=True)
class PacketLoss:
    """``loss_pct`` of packets dropped each way on a host's link for ``hold_s``. Heal:
    removed."""

    default_target: ClassVar[TargetKind] = "host"
    needs_network: ClassVar[bool] = True
    hold_s: float = 10.0
    loss_pct: float = 5.0

    def fire(self, ctx: FaultContext, target: Target, rng: random.Random) -> None:
        ctx.impair_link(_host(target, "packet_loss"), 0.0, self.loss_pct)

    def heal(self, ctx: FaultContext, target: Target) -> None:
        ctx.clear_link(_host(target, "packet_loss"))
