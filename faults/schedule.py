"""Fault schedules: pure and seeded. Same spec, topology and seed -> the same plan.

A plan is a list of :class:`PlannedFault`: when (seconds since the injector started, or a
committed step), which kind, which target, and a stable ``fault_id``. Times, kinds and targets
are drawn from three independent random streams derived from the seed, so adding a fault kind to
the mix does not move the fault times.
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from faults.fault import Target, fault_class
from faults.targets import TargetError, TargetSpec, Topology, resolve_kind, select_target

ScheduleKind = Literal["interval", "poisson", "at_steps", "at_times"]
SCHEDULE_KINDS: tuple[str, ...] = ("interval", "poisson", "at_steps", "at_times")


class ScheduleError(ValueError):
    """A schedule that cannot produce a plan."""


@dataclass(frozen=True, kw_only=True)
class ScheduleSpec:
    """When faults fire.

    * ``interval``: the first at ``start_s``, then every ``interval_s`` plus a uniform draw in
      ``[0, jitter_s]`` (``interval_s = 20, jitter_s = 10``: one every 20-30 s).
    * ``poisson``: exponential gaps with mean ``mean_s``, starting after ``start_s``.
    * ``at_steps`` / ``at_times``: exactly these committed steps / seconds.

    Time-based plans end at the horizon given to :func:`plan`; ``max_faults`` caps any plan.
    """

    kind: ScheduleKind = "interval"
    interval_s: float | None = None
    jitter_s: float = 0.0
    mean_s: float | None = None
    start_s: float = 0.0
    at_steps: tuple[int, ...] = ()
    at_times: tuple[float, ...] = ()
    max_faults: int | None = None

    def __post_init__(self) -> None:
        for problem in schedule_problems(self):
            raise ScheduleError(problem)


def schedule_problems(s: ScheduleSpec) -> list[str]:
    """What is wrong with ``s`` (empty if nothing), each naming the key."""
    out = []
    if s.kind not in SCHEDULE_KINDS:
        out.append(f"kind = {s.kind!r}: allowed: {', '.join(SCHEDULE_KINDS)}")
    if s.kind == "interval" and (s.interval_s is None or s.interval_s <= 0):
        out.append(f"interval_s = {s.interval_s!r}: an interval schedule needs interval_s > 0")
    if s.kind == "poisson" and (s.mean_s is None or s.mean_s <= 0):
        out.append(f"mean_s = {s.mean_s!r}: a poisson schedule needs mean_s > 0")
    if s.kind == "at_steps" and (not s.at_steps or any(x < 0 for x in s.at_steps)):
        out.append(f"at_steps = {list(s.at_steps)!r}: needs a non-empty list of steps >= 0")
    if s.kind == "at_times" and (not s.at_times or any(x < 0 for x in s.at_times)):
        out.append(f"at_times = {list(s.at_times)!r}: needs a non-empty list of seconds >= 0")
    if s.jitter_s < 0:
        out.append(f"jitter_s = {s.jitter_s!r}: must be >= 0")
    if s.start_s < 0:
        out.append(f"start_s = {s.start_s!r}: must be >= 0")
    if s.max_faults is not None and s.max_faults < 0:
        out.append(f"max_faults = {s.max_faults!r}: must be >= 0")
    return out


@dataclass(frozen=True, kw_only=True)
class PlannedFault:
    """One planned fault. Exactly one of ``at_s`` and ``at_step`` is set."""

    fault_id: str
    kind: str
    target: Target
    at_s: float | None = None
    at_step: int | None = None

    def when(self) -> str:
        return f"t+{self.at_s:.1f}s" if self.at_s is not None else f"step {self.at_step}"

    def as_dict(self) -> dict[str, Any]:
        """As a ``fault.plan`` record lists it."""
        return {
            "fault_id": self.fault_id,
            "kind": self.kind,
            "target": self.target.as_dict(),
            "at_s": self.at_s,
            "at_step": self.at_step,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> PlannedFault:
        return cls(
            fault_id=str(data["fault_id"]),
            kind=str(data["kind"]),
            target=Target.from_dict(data.get("target") or {}),
            at_s=data.get("at_s"),
            at_step=data.get("at_step"),
        )


def fault_times(spec: ScheduleSpec, rng: random.Random, horizon_s: float | None) -> list[float]:
    """Seconds since start for time-based schedules (pure)."""
    cap = spec.max_faults if spec.max_faults is not None else 10_000
    if spec.kind == "at_times":
        times = sorted(spec.at_times)
        return [t for t in times if horizon_s is None or t < horizon_s][:cap]
    if horizon_s is None and spec.max_faults is None:
        raise ScheduleError(f"a {spec.kind} schedule needs a horizon (duration_s) or max_faults")
    times: list[float] = []
    t = spec.start_s
    first = True
    while len(times) < cap:
        if spec.kind == "interval":
            assert spec.interval_s is not None
            if not first:
                t += spec.interval_s
            t += rng.uniform(0.0, spec.jitter_s) if spec.jitter_s else 0.0
        else:
            assert spec.mean_s is not None
            t += rng.expovariate(1.0 / spec.mean_s)
        first = False
        if horizon_s is not None and t >= horizon_s:
            break
        times.append(round(t, 6))
    return times


def plan(
    spec: ScheduleSpec,
    mix: Mapping[str, float],
    targets: TargetSpec,
    topology: Topology,
    *,
    seed: int,
    horizon_s: float | None = None,
) -> list[PlannedFault]:
    """The whole plan, in firing order. ``mix`` maps fault kind -> relative weight (> 0)."""
    if not mix or any(w <= 0 for w in mix.values()):
        raise ScheduleError(f"the fault mix needs at least one kind with weight > 0: {dict(mix)}")
    kinds = sorted(mix)  # sorted: the plan must not depend on dict order
    weights = [mix[k] for k in kinds]
    time_rng = random.Random(f"{seed}:times")
    kind_rng = random.Random(f"{seed}:kinds")
    target_rng = random.Random(f"{seed}:targets")

    if spec.kind == "at_steps":
        cap = spec.max_faults if spec.max_faults is not None else len(spec.at_steps)
        slots: list[tuple[float | None, int | None]] = [
            (None, s) for s in sorted(spec.at_steps)[:cap]
        ]
    else:
        slots = [(t, None) for t in fault_times(spec, time_rng, horizon_s)]

    for kind in kinds:
        if getattr(fault_class(kind), "needs_network", False) and not topology.networked:
            raise TargetError(
                f"{kind} needs hosts with a network of their own: set the job's "
                "launcher = 'netns' (test hosts in network namespaces; root only)"
            )
        needed = getattr(fault_class(kind), "needs_launcher", None)
        if needed is not None and topology.launcher != needed:
            raise TargetError(
                f"{kind} acts on the job's {needed} nodes: it needs launcher = {needed!r} "
                f"(this job's launcher is {topology.launcher!r})"
            )
    out = []
    for i, (at_s, at_step) in enumerate(slots):
        kind = kind_rng.choices(kinds, weights)[0]
        target_kind = resolve_kind(fault_class(kind).default_target, targets.kind)
        target = select_target(target_kind, targets, topology, target_rng)
        out.append(
            PlannedFault(fault_id=f"f{i:03d}", kind=kind, target=target, at_s=at_s, at_step=at_step)
        )
    return out


def describe_plan(faults: list[PlannedFault]) -> str:
    """One line per fault, for logs and dry runs."""
    return "\n".join(
        f"{f.fault_id}  {f.when():>12}  {f.kind:<16} {f.target.describe()}" for f in faults
    )
