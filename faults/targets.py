"""Target selection, kept apart from faults: which rank, group or host a fault hits.

Everything here is pure: the same topology, spec and ``random.Random`` state give the same
target. A keep-alive set is never hit: its replica groups, its hosts, and any host that runs a
keep-alive group. "Never the last healthy group" depends on the live state, so it is checked by
the injector at fire time with :func:`protected_reason`.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import Literal

from faults.fault import FaultContext, Target, TargetKind

#: What an experiment may ask for; ``default`` lets each fault kind choose its own.
RequestedKind = Literal["default", "rank", "replica", "host"]
REQUESTED_KINDS: tuple[str, ...] = ("default", "rank", "replica", "host")


class TargetError(ValueError):
    """No legal target exists (everything is keep-alive, or a named replica/host is absent)."""


@dataclass(frozen=True, kw_only=True)
class Topology:
    """The job's shape as the planner sees it: replica group ``r`` runs on ``replica_hosts[r]``."""

    replicas: int
    ranks: int
    hosts: tuple[str, ...]
    replica_hosts: tuple[str, ...]
    networked: bool = False  # each host has a link of its own (network faults can act on it)
    launcher: str = "local"  # the job's launcher (SLURM faults need "slurm")

    def __post_init__(self) -> None:
        if self.replicas < 1 or self.ranks < 1 or not self.hosts:
            raise TargetError("a topology needs >= 1 replica, >= 1 rank and >= 1 host")
        if len(self.replica_hosts) != self.replicas:
            raise TargetError("replica_hosts must name one host per replica group")

    @classmethod
    def from_counts(
        cls,
        replicas: int,
        ranks: int,
        hosts: int,
        networked: bool = False,
        launcher: str = "local",
    ) -> Topology:
        """Hosts named ``host0..hostN-1``, groups placed round-robin (the harness's default
        placement). Use :meth:`from_context` once the job runs."""
        names = tuple(f"host{i}" for i in range(max(1, hosts)))
        return cls(
            replicas=replicas,
            ranks=ranks,
            hosts=names,
            replica_hosts=tuple(names[r % len(names)] for r in range(replicas)),
            networked=networked,
            launcher=launcher,
        )

    @classmethod
    def from_context(cls, ctx: FaultContext) -> Topology:
        return cls(
            replicas=ctx.replicas,
            ranks=ctx.ranks,
            hosts=tuple(ctx.hosts()),
            replica_hosts=tuple(ctx.replica_host(r) for r in range(ctx.replicas)),
            networked=ctx.networked,
            launcher=getattr(ctx, "launcher", "local"),
        )


@dataclass(frozen=True, kw_only=True)
class KeepAlive:
    """Never hit: these replica groups, these hosts (and so no host that runs one of these groups),
    and, when ``last_healthy``, the last group still healthy."""

    replicas: frozenset[int] = frozenset()
    hosts: frozenset[str] = frozenset()
    last_healthy: bool = True


@dataclass(frozen=True, kw_only=True)
class TargetSpec:
    """How targets are drawn. ``replicas``/``hosts`` narrow the candidates (None = all)."""

    kind: RequestedKind = "default"
    replicas: tuple[int, ...] | None = None
    hosts: tuple[str, ...] | None = None
    keep_alive: KeepAlive = field(default_factory=KeepAlive)


def resolve_kind(fault_default: TargetKind, requested: str) -> TargetKind:
    """The target kind a fault gets. Host, service and controller faults always hit their own
    kind (a host eviction cannot hit a rank); process faults take the experiment's choice."""
    if fault_default in ("host", "service", "controller") or requested == "default":
        return fault_default
    if requested not in ("rank", "replica"):
        raise TargetError(f"target kind {requested!r} cannot apply to a {fault_default} fault")
    return requested  # type: ignore[return-value]


def eligible_replicas(spec: TargetSpec, topo: Topology) -> list[int]:
    pool = range(topo.replicas) if spec.replicas is None else spec.replicas
    return [
        r
        for r in sorted(set(pool))
        if 0 <= r < topo.replicas
        and r not in spec.keep_alive.replicas
        and topo.replica_hosts[r] not in spec.keep_alive.hosts
    ]


def eligible_hosts(spec: TargetSpec, topo: Topology) -> list[str]:
    pool = topo.hosts if spec.hosts is None else spec.hosts
    guarded = {topo.replica_hosts[r] for r in spec.keep_alive.replicas if r < topo.replicas}
    return [
        h
        for h in sorted(set(pool))
        if h in topo.hosts and h not in spec.keep_alive.hosts and h not in guarded
    ]


def select_target(kind: TargetKind, spec: TargetSpec, topo: Topology, rng: random.Random) -> Target:
    """Draw one target of ``kind``; raises TargetError when nothing is eligible."""
    if kind == "service":
        return Target()
    if kind == "controller":
        return Target(controller=True)
    if kind == "host":
        hosts = eligible_hosts(spec, topo)
        if not hosts:
            raise TargetError(
                f"no host can be evicted: hosts {list(topo.hosts)}, keep-alive replicas "
                f"{sorted(spec.keep_alive.replicas)} live on "
                f"{sorted({topo.replica_hosts[r] for r in spec.keep_alive.replicas})}"
            )
        return Target(host=rng.choice(hosts))
    replicas = eligible_replicas(spec, topo)
    if not replicas:
        raise TargetError(
            f"no replica group can be hit: {topo.replicas} groups, keep-alive "
            f"{sorted(spec.keep_alive.replicas)}, candidates {spec.replicas}"
        )
    replica = rng.choice(replicas)
    rank = rng.randrange(topo.ranks) if kind == "rank" else None
    return Target(replica=replica, rank=rank, host=topo.replica_hosts[replica])


def protected_reason(
    target: Target,
    keep_alive: KeepAlive,
    *,
    replica_host: Callable[[int], str],
    replicas: int,
    healthy: Collection[int] | None = None,
) -> str | None:
    """Why ``target`` must not be hit right now (None if it may). Checked at fire time against
    the live placement (a group may have moved hosts since the plan) and, when ``healthy`` is
    known, the rule that the last healthy group is never hit."""
    if target.replica is not None:
        if target.replica in keep_alive.replicas:
            return f"replica {target.replica} is keep-alive"
        host = replica_host(target.replica)
        if host in keep_alive.hosts:
            return f"replica {target.replica} runs on keep-alive host {host}"
        hit = {target.replica}
    elif target.host is not None:
        if target.host in keep_alive.hosts:
            return f"host {target.host} is keep-alive"
        hit = {r for r in range(replicas) if replica_host(r) == target.host}
        guarded = hit & keep_alive.replicas
        if guarded:
            return f"host {target.host} runs keep-alive replica {sorted(guarded)}"
    else:
        return None  # the quorum service or the controller: losing it loses no group
    if keep_alive.last_healthy and healthy is not None and not (set(healthy) - hit):
        return f"{target.describe()} would take down the last healthy group(s) {sorted(healthy)}"
    return None
