"""Experiment files: parsed and validated completely before anything launches.

An experiment (TOML) says: which job, when faults fire, which faults, what they may hit, the
seed, how long, under which recovery policies, and which steady-state hypotheses must hold::

    name = "quickstart"          # names runs/NAME: letters, digits, _ - . (no / or ..)
    seed = 7
    duration_s = 60              # per policy (or steps = N, or both: whichever comes first)
    settle_s = 5                 # or end a faulted run once its faults are over (see below)
    policies = ["control", "in_place", "full_restart"]   # control: the same job, no faults
    control_runs = 2             # the control in this many pieces, interleaved with the policies
    job = "tiny.toml"            # relative to this file; or an inline [job] table
    overrides = ["model.dim=64"] # applied to the job config

    [schedule]                   # kind = interval | poisson | at_steps | at_times
    kind = "interval"
    interval_s = 20
    jitter_s = 10
    start_s = 10

    [faults]
    mix = { segfault = 1, kill = 1 }           # kind -> relative weight
    [faults.options.host_eviction]              # per-kind options (see faults.fault_options)
    cooldown_s = 20

    [targets]                    # kind = default | rank | replica | host
    kind = "default"
    keep_alive = { replicas = [0] }

    [hypotheses]                 # what each claims: see Hypotheses
    loss_finite = true
    every_fault_recovered = true
    goodput_min = { in_place = 0.6 }            # a number applies to every policy

The ``control`` policy is the yardstick of goodput: the same job (the ``in_place`` config), same
seed, no faults, for the same total time, split into ``control_runs`` pieces that run between the
other policies (control, in_place, control, full_restart, ...), so the control sees the machine
as the policies saw it; the spread of its pieces is the noise of the goodput figure
(dashboards/metrics.py). Hypotheses judge the policies, not the control.

Every error is an :class:`ExperimentError` naming the file, the key, the value and what is
allowed. The job config is validated through ``harness.config.load_config`` (its replicas, ranks
and hosts are what targets are checked against).

Why this module is longer than 500 lines: an experiment file's every key is declared and checked
here, before anything launches (hypotheses, schedule, runs, inline jobs), so a malformed file gets
one message naming the key; the configuration reference is generated from it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

from faults.fault import UnknownFault, fault_class, fault_kinds, make_fault
from faults.schedule import (
    SCHEDULE_KINDS,
    PlannedFault,
    ScheduleError,
    ScheduleSpec,
    plan,
    schedule_problems,
)
from faults.targets import REQUESTED_KINDS, KeepAlive, TargetError, TargetSpec, Topology
from harness.config import MAX_SECONDS, NAME_PATTERN, config_from_table, load_config
from harness.tomlfile import read_toml

#: The recovery policies an experiment compares (harness.config RecoveryConfig.policy).
RECOVERY_POLICIES: tuple[str, ...] = ("in_place", "full_restart")
#: The fault-free control run: goodput's baseline (see the module docstring).
CONTROL = "control"
POLICIES: tuple[str, ...] = (*RECOVERY_POLICIES, CONTROL)

TOP_KEYS = (
    "name", "description", "seed", "duration_s", "steps", "settle_s", "policies", "control_runs",
    "job", "overrides", "schedule", "faults", "targets", "hypotheses",
)  # fmt: skip
SCHEDULE_KEYS = (
    "kind", "interval_s", "jitter_s", "mean_s", "start_s", "at_steps", "at_times", "max_faults",
)  # fmt: skip
FAULTS_KEYS = ("mix", "options")
TARGETS_KEYS = ("kind", "replicas", "hosts", "keep_alive")
KEEP_ALIVE_KEYS = ("replicas", "hosts", "last_healthy")
BOOL_HYPOTHESES = (
    "loss_finite", "committed_steps_rise", "replicas_equal_after_heal", "every_fault_recovered",
    "no_orphans", "no_shm_left", "journal_complete",
)  # fmt: skip
#: Threshold hypotheses: name -> (summary figure it bounds, "min" or "max").
THRESHOLD_HYPOTHESES = {
    "goodput_min": "goodput >= x",
    "recovery_p95_max_s": "p95 of fault -> replacement participating <= x s",
    "detection_p95_max_s": "p95 of fault -> detected <= x s",
    "stall_p95_max_s": "p95 of survivor stall <= x s",
    "steps_lost_max": "steps lost over the whole run <= x",
    "skipped_max": "sequences of the data stream never trained (below the last step) <= x",
    "heldout_loss_within": "held-out loss within x (relative) of the control's at every common "
    "eval step, or of the control's run-to-run spread if larger (experiments/report_quality.py)",
}


class ExperimentError(ValueError):
    """An experiment file that must not run; the message says where and what is allowed."""


@dataclass(frozen=True, kw_only=True)
class Hypotheses:
    """Steady-state hypotheses. Thresholds map a policy (or ``"*"``: every policy) to a bound.
    They judge the recovery policies; the fault-free ``control`` run is the yardstick, not judged.

    What each flag claims (judged per policy by experiments/report.py):

    * ``every_fault_recovered``: every injected fault fired, every recovery it caused reached
      ``participating``, and each group it hit committed a step after its heal.
    * ``no_orphans`` / ``no_shm_left``: once the job stopped, none of its processes is alive
      and none of its ``/dev/shm`` snapshot segments remains (``postrun.json``, written by
      ``ftharness chaos``; see experiments/postrun.py).
    * ``journal_complete``: no journal line was skipped, the run has its ``job.start`` and
      ``job.end``, every ``fault.inject`` has its ``fault.heal``, and every recovery that
      started either reached ``participating`` or was open when the job ended.
    """

    loss_finite: bool = False
    committed_steps_rise: bool = False
    replicas_equal_after_heal: bool = False
    every_fault_recovered: bool = False
    no_orphans: bool = False
    no_shm_left: bool = False
    journal_complete: bool = False
    thresholds: Mapping[str, Mapping[str, float]] = field(
        default_factory=lambda: MappingProxyType({})
    )

    def bound(self, name: str, policy: str) -> float | None:
        """The bound of threshold ``name`` for ``policy``, or None if not set."""
        per = self.thresholds.get(name, {})
        return per.get(policy, per.get("*"))

    @property
    def empty(self) -> bool:
        return not (any(getattr(self, k) for k in BOOL_HYPOTHESES) or self.thresholds)


@dataclass(frozen=True, kw_only=True)
class FaultMix:
    """Fault kinds with relative weights, and per-kind options."""

    weights: Mapping[str, float]
    options: Mapping[str, Mapping[str, Any]] = field(default_factory=lambda: MappingProxyType({}))


@dataclass(frozen=True)
class Run:
    """One job run of an experiment: its policy, its folder under the experiment's run
    directory, how long it runs (None: until its steps), and which control piece it is."""

    policy: str
    folder: str
    duration_s: float | None
    control_run: int | None = None


@dataclass(frozen=True, kw_only=True)
class ExperimentSpec:
    """A validated experiment. ``job_path`` (absolute) or ``job_table`` (inline) names the job."""

    name: str
    source: Path | None
    description: str = ""
    seed: int = 0
    duration_s: float | None = None
    steps: int | None = None
    # End a faulted run this many seconds after its last planned fault fired (and healed) and
    # every recovery closed, if that comes before duration_s or steps; its report then covers the
    # faults and their recoveries and no idle stretch after them. Longer than the job's failure
    # detection (timeouts.heartbeat_timeout and host_timeout, and controller_silence if the mix
    # kills the controller), so a failure the last fault causes is seen first. Unset: every run
    # runs for duration_s or steps.
    settle_s: float | None = None
    policies: tuple[str, ...] = ("in_place",)
    control_runs: int = 2
    job_path: Path | None = None
    job_table: Mapping[str, Any] | None = None
    overrides: tuple[str, ...] = ()
    topology: Topology
    schedule: ScheduleSpec
    faults: FaultMix
    targets: TargetSpec
    hypotheses: Hypotheses = field(default_factory=Hypotheses)

    def job_overrides(self, policy: str) -> tuple[str, ...]:
        """Overrides for the job config of one policy's run (the experiment's own, its steps,
        and the recovery policy)."""
        extra = [f"steps={self.steps}"] if self.steps is not None else []
        recovery = "in_place" if policy == CONTROL else policy
        return (*self.overrides, *extra, f"recovery.policy={recovery}")

    def job_config(self, policy: str) -> Any:
        """The job config one policy's run runs with (``harness.config.JobConfig``)."""
        overrides = list(self.job_overrides(policy))
        if self.job_path is not None:
            return load_config(str(self.job_path), overrides)
        assert self.job_table is not None
        return config_from_table(self.job_table, overrides)

    @property
    def controller_kinds(self) -> list[str]:
        """The kinds of the mix that kill the job's controller (``controller_crash``)."""
        return [k for k in self.faults.weights if getattr(fault_class(k), "needs_takeover", False)]

    @property
    def kills_controller(self) -> bool:
        """Whether the plan may kill the job's controller: then each run runs under a keeper,
        its controller in a process of its own (experiments/runner.py)."""
        return bool(self.controller_kinds)

    def runs(self) -> list[Run]:
        """The runs in the order they happen: each recovery policy once for ``duration_s``; the
        control (if named) in ``control_runs`` pieces of ``duration_s / control_runs``, one
        before each recovery policy in turn and any left over at the end."""
        policies = [p for p in self.policies if p != CONTROL]
        if CONTROL not in self.policies:
            return [Run(p, p, self.duration_s) for p in policies]
        n = self.control_runs
        piece = None if self.duration_s is None else self.duration_s / n
        controls = [Run(CONTROL, f"{CONTROL}-{i + 1}", piece, i + 1) for i in range(n)]
        out: list[Run] = []
        for p in policies:
            if controls:
                out.append(controls.pop(0))
            out.append(Run(p, p, self.duration_s))
        return out + controls

    def injector(self, plan: list[PlannedFault], ctx: Any) -> Any:
        """A ``faults.injector.Injector`` walking ``plan`` through the job's fault context
        ``ctx``, with the experiment's seed, fault options and keep-alive set."""
        from faults.injector import Injector

        return Injector(
            plan,
            ctx,
            seed=self.seed,
            options=self.faults.options,
            keep_alive=self.targets.keep_alive,
            healthy=getattr(ctx, "healthy_replicas", None),
        )

    def plan(self, topology: Topology | None = None) -> list[PlannedFault]:
        """The fault plan (pure: same spec and topology -> same plan). Pass the live topology
        (``Topology.from_context(ctx)``) once the job runs; the default is the planned one."""
        return plan(
            self.schedule,
            self.faults.weights,
            self.targets,
            topology or self.topology,
            seed=self.seed,
            horizon_s=self.duration_s,
        )


# ---------------------------------------------------------------------------------------------


class _Where:
    """Builds error messages that name the file and the key."""

    def __init__(self, source: Path | None) -> None:
        self.source = str(source) if source is not None else "<experiment>"

    def error(self, key: str, problem: str) -> ExperimentError:
        return ExperimentError(f"{self.source}: {key}: {problem}")

    def unknown(self, table: Mapping[str, Any], allowed: tuple[str, ...], prefix: str) -> None:
        for key in table:
            if key not in allowed:
                raise self.error(prefix + key, f"unknown key; allowed: {', '.join(allowed)}")

    def table(self, data: Mapping[str, Any], key: str, prefix: str = "") -> dict[str, Any]:
        value = data.get(key, {})
        if not isinstance(value, dict):
            raise self.error(prefix + key, f"must be a table, got {value!r}")
        return value


def _number(
    w: _Where, key: str, value: Any, *, positive: bool = False, seconds: bool = False
) -> float:
    """The one place an experiment's numbers are read: finite, >= 0 (or > 0), and, for a
    duration (``seconds``), at most ``MAX_SECONDS``."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise w.error(key, f"must be a number, got {value!r}")
    if not math.isfinite(value):
        raise w.error(key, f"got {value!r}; must be a finite number")
    if seconds and value > MAX_SECONDS:
        raise w.error(
            key, f"got {value!r}; must be <= {MAX_SECONDS:g} seconds (a week) or the run never ends"
        )
    if positive and value <= 0:
        raise w.error(key, f"got {value!r}; must be > 0")
    if value < 0:
        raise w.error(key, f"got {value!r}; must be >= 0")
    return float(value)


def _int_list(w: _Where, key: str, value: Any) -> tuple[int, ...]:
    if not isinstance(value, list) or not all(
        isinstance(x, int) and not isinstance(x, bool) for x in value
    ):
        raise w.error(key, f"must be a list of integers, got {value!r}")
    return tuple(value)


def load_experiment(path: str | Path, extra_overrides: tuple[str, ...] = ()) -> ExperimentSpec:
    """Read and validate an experiment file, with ``extra_overrides`` after its own job
    overrides (the command line's). Raises ExperimentError; launches nothing."""
    p = Path(path)
    if not p.exists():
        raise ExperimentError(f"{p}: no such experiment file")
    data = read_toml(p, "experiment file", ExperimentError)  # and every other way to be unreadable
    overrides = data.get("overrides", [])
    if extra_overrides and isinstance(overrides, list):
        data["overrides"] = [*overrides, *extra_overrides]
    return parse_experiment(data, source=p.resolve())


def parse_experiment(data: Mapping[str, Any], *, source: Path | None = None) -> ExperimentSpec:
    """Validate already-parsed TOML data (``source`` is for messages and relative job paths)."""
    w = _Where(source)
    w.unknown(data, TOP_KEYS, "")

    name = data.get("name")
    if not isinstance(name, str) or not name.strip():
        raise w.error("name", "required: a non-empty string")
    if not NAME_PATTERN.match(name):
        raise w.error(
            "name",
            f"got {name!r}; must be 1-64 letters, digits, '_', '-' or '.', starting with a "
            "letter or digit (it names the experiment directory, runs/NAME)",
        )
    seed = data.get("seed", 0)
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise w.error("seed", f"must be an integer, got {seed!r}")

    duration_s = data.get("duration_s")
    if duration_s is not None:
        duration_s = _number(w, "duration_s", duration_s, positive=True, seconds=True)
    steps = data.get("steps")
    if steps is not None and (not isinstance(steps, int) or isinstance(steps, bool) or steps < 1):
        raise w.error("steps", f"got {steps!r}; must be an integer >= 1")
    if duration_s is None and steps is None:
        raise w.error("duration_s", "set duration_s (seconds per policy) or steps (or both)")

    settle_s = data.get("settle_s")
    if settle_s is not None:
        settle_s = _number(w, "settle_s", settle_s, positive=True, seconds=True)
    policies = _policies(w, data.get("policies", ["in_place"]))
    control_runs = data.get("control_runs", 2)
    if (
        not isinstance(control_runs, int)
        or isinstance(control_runs, bool)
        or not 1 <= control_runs <= 16
    ):
        raise w.error("control_runs", f"got {control_runs!r}; must be an integer in 1..16")
    overrides = data.get("overrides", [])
    if not isinstance(overrides, list) or not all(isinstance(o, str) for o in overrides):
        raise w.error("overrides", f"must be a list of 'key=value' strings, got {overrides!r}")

    job_path, job_table, topology = _job(w, data.get("job"), tuple(overrides), source)
    schedule = _schedule(w, w.table(data, "schedule"))
    if (
        schedule.kind in ("interval", "poisson")
        and duration_s is None
        and schedule.max_faults is None
    ):
        raise w.error(
            "schedule.kind",
            f"a {schedule.kind} schedule needs duration_s or schedule.max_faults to end",
        )
    faults = _faults(w, w.table(data, "faults"))
    targets = _targets(w, w.table(data, "targets"), topology)
    hypotheses = parse_hypotheses(w.table(data, "hypotheses"), source=source)

    spec = ExperimentSpec(
        name=name,
        source=source,
        description=str(data.get("description", "")),
        seed=seed,
        duration_s=duration_s,
        steps=steps,
        settle_s=settle_s,
        policies=policies,
        control_runs=control_runs,
        job_path=job_path,
        job_table=job_table,
        overrides=tuple(overrides),
        topology=topology,
        schedule=schedule,
        faults=faults,
        targets=targets,
        hypotheses=hypotheses,
    )
    # A dry run of the planner: every fault kind must find a legal target in this topology.
    try:
        spec.plan()
    except (TargetError, ScheduleError) as e:
        raise w.error("targets", str(e)) from None
    _check_takeover(w, spec)
    _check_settle(w, spec)
    return spec


def _check_settle(w: _Where, spec: ExperimentSpec) -> None:
    """``settle_s`` outlasts the job's failure detection: a run that ended sooner could end
    between the last fault and the failure it causes."""
    if spec.settle_s is None:
        return
    t = spec.job_config(spec.policies[0]).timeouts
    limits = {
        "timeouts.heartbeat_timeout": t.heartbeat_timeout,
        "timeouts.host_timeout": t.host_timeout,
    }
    if spec.kills_controller:  # a wedged controller is seen by its silence
        limits["timeouts.controller_silence"] = t.controller_silence
    detect = max(limits.values())
    if spec.settle_s <= detect:
        raise w.error(
            "settle_s",
            f"got {spec.settle_s:g}; must be longer than the job's failure detection "
            f"({detect:g} s: {', '.join(limits)}), or a failure the last fault causes could be "
            "seen only after the run ended",
        )


def _check_takeover(w: _Where, spec: ExperimentSpec) -> None:
    """A fault that kills the controller needs, in every run that can plan it, a job that a new
    controller can take over (``harness.job.takeover.supported``): said now, not mid-run."""
    if not spec.kills_controller:
        return
    from harness.job.takeover import supported

    for policy in spec.policies:
        if policy == CONTROL:
            continue
        why = supported(spec.job_config(policy))
        if why is not None:
            raise w.error(
                f"faults.mix.{spec.controller_kinds[0]}",
                f"it kills the job's controller, and in the {policy!r} run a new controller "
                f"could not take the job over: {why}",
            )


def _policies(w: _Where, value: Any) -> tuple[str, ...]:
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not value:
        raise w.error("policies", f"must be a non-empty list of {list(POLICIES)}, got {value!r}")
    for p in value:
        if p not in POLICIES:
            raise w.error("policies", f"unknown policy {p!r}; allowed: {', '.join(POLICIES)}")
    if len(set(value)) != len(value):
        raise w.error("policies", f"{value!r} names a policy twice")
    if value == [CONTROL]:
        raise w.error(
            "policies",
            f"{CONTROL!r} is the fault-free baseline of the other policies: name one of "
            f"{', '.join(RECOVERY_POLICIES)} too",
        )
    return tuple(value)


def _job(
    w: _Where, value: Any, overrides: tuple[str, ...], source: Path | None
) -> tuple[Path | None, Mapping[str, Any] | None, Topology]:
    if value is None:
        raise w.error("job", "required: a job config path (relative to this file) or a [job] table")
    if isinstance(value, str):
        path = Path(value)
        if not path.is_absolute() and source is not None:
            path = source.parent / path
        if not path.is_file():
            raise w.error("job", f"{value!r}: no such file ({path})")
        try:
            cfg = load_config(str(path), list(overrides))
        except ValueError as e:
            raise w.error("job", f"{value!r}: {e}") from None
        return path, None, _topology_of(cfg)
    if isinstance(value, dict):
        try:  # the overrides as `ftharness run --set` applies them, with the same errors
            cfg = config_from_table(value, overrides)
        except ValueError as e:
            raise w.error("job", str(e)) from None
        # The table as written: the runner applies the overrides (ExperimentSpec.job_overrides)
        return None, MappingProxyType(dict(value)), _topology_of(cfg)
    raise w.error("job", f"must be a path string or a table, got {value!r}")


def _topology_of(cfg: Any) -> Topology:
    def get(name: str, default: int) -> int:
        if isinstance(cfg, Mapping):
            return int(cfg.get(name, default))
        return int(getattr(cfg, name, default))

    launcher = cfg.get("launcher", "local") if isinstance(cfg, Mapping) else cfg.launcher
    hosts = get("hosts", 1)
    if launcher == "slurm":  # the allocation's nodes: hosts, then the spare nodes
        section = cfg.get("slurm", {}) if isinstance(cfg, Mapping) else vars(cfg.slurm)
        hosts += int(section.get("spare_nodes", 0))
    return Topology.from_counts(
        get("replicas", 3),
        get("ranks", 1),
        hosts,
        networked=launcher == "netns",
        launcher=launcher,
    )


def _schedule(w: _Where, t: dict[str, Any]) -> ScheduleSpec:
    w.unknown(t, SCHEDULE_KEYS, "schedule.")
    kind = t.get("kind", "interval")
    if kind not in SCHEDULE_KINDS:
        raise w.error("schedule.kind", f"{kind!r}; allowed: {', '.join(SCHEDULE_KINDS)}")
    kw: dict[str, Any] = {"kind": kind}
    for key in ("interval_s", "jitter_s", "mean_s", "start_s"):
        if key in t:
            kw[key] = _number(
                w,
                f"schedule.{key}",
                t[key],
                positive=key in ("interval_s", "mean_s"),
                seconds=True,
            )
    if "at_steps" in t:
        kw["at_steps"] = _int_list(w, "schedule.at_steps", t["at_steps"])
    if "at_times" in t:
        v = t["at_times"]
        if not isinstance(v, list):
            raise w.error("schedule.at_times", f"must be a list of seconds, got {v!r}")
        kw["at_times"] = tuple(_number(w, "schedule.at_times", x, seconds=True) for x in v)
    if "max_faults" in t:
        m = t["max_faults"]
        if not isinstance(m, int) or isinstance(m, bool) or m < 0:
            raise w.error("schedule.max_faults", f"got {m!r}; must be an integer >= 0")
        kw["max_faults"] = m
    problems = schedule_problems(_as_probe(kw))
    if problems:  # each problem starts with its key: report it under schedule.KEY
        raise w.error(f"schedule.{problems[0].split(' ', 1)[0]}", problems[0])
    return ScheduleSpec(**kw)


def _as_probe(kw: dict[str, Any]) -> Any:
    """A stand-in with ScheduleSpec's fields, for reporting problems without raising first."""
    from types import SimpleNamespace

    defaults = {
        "kind": "interval", "interval_s": None, "jitter_s": 0.0, "mean_s": None,
        "start_s": 0.0, "at_steps": (), "at_times": (), "max_faults": None,
    }  # fmt: skip
    return SimpleNamespace(**{**defaults, **kw})


def _faults(w: _Where, t: dict[str, Any]) -> FaultMix:
    w.unknown(t, FAULTS_KEYS, "faults.")
    known = fault_kinds()
    mix = t.get("mix")
    if not isinstance(mix, dict) or not mix:
        raise w.error(
            "faults.mix",
            f"required: a non-empty table of kind = weight; kinds: {', '.join(known)}",
        )
    weights: dict[str, float] = {}
    for kind, weight in mix.items():
        if kind not in known:
            raise w.error(f"faults.mix.{kind}", f"unknown fault kind; allowed: {', '.join(known)}")
        weights[kind] = _number(w, f"faults.mix.{kind}", weight, positive=True)
    options = w.table(t, "options", "faults.")
    opts: dict[str, Mapping[str, Any]] = {}
    for kind, o in options.items():
        if kind not in known:
            raise w.error(
                f"faults.options.{kind}", f"unknown fault kind; allowed: {', '.join(known)}"
            )
        if not isinstance(o, dict):
            raise w.error(f"faults.options.{kind}", f"must be a table, got {o!r}")
        try:
            make_fault(kind, **o)
        except (ValueError, TypeError, UnknownFault) as e:
            raise w.error(f"faults.options.{kind}", str(e)) from None
        for key, value in o.items():
            if isinstance(value, int | float) and not isinstance(value, bool):
                _number(w, f"faults.options.{kind}.{key}", value, seconds=key.endswith("_s"))
        opts[kind] = MappingProxyType(dict(o))
    return FaultMix(weights=MappingProxyType(weights), options=MappingProxyType(opts))


def _replicas_in_range(w: _Where, key: str, value: Any, topo: Topology) -> tuple[int, ...]:
    replicas = _int_list(w, key, value)
    for r in replicas:
        if not 0 <= r < topo.replicas:
            raise w.error(
                key,
                f"replica {r} of {topo.replicas}: the job's replica groups are "
                f"0..{topo.replicas - 1}",
            )
    return replicas


def _hosts_in_range(w: _Where, key: str, value: Any, topo: Topology) -> tuple[str, ...]:
    if not isinstance(value, list):
        raise w.error(key, f"must be a list of host names or indices, got {value!r}")
    out = []
    for h in value:
        if isinstance(h, int) and not isinstance(h, bool) and 0 <= h < len(topo.hosts):
            out.append(topo.hosts[h])
        elif isinstance(h, str) and h in topo.hosts:
            out.append(h)
        else:
            raise w.error(key, f"host {h!r} is not one of the job's hosts {list(topo.hosts)}")
    return tuple(out)


def _targets(w: _Where, t: dict[str, Any], topo: Topology) -> TargetSpec:
    w.unknown(t, TARGETS_KEYS, "targets.")
    kind = t.get("kind", "default")
    if kind not in REQUESTED_KINDS:
        raise w.error("targets.kind", f"{kind!r}; allowed: {', '.join(REQUESTED_KINDS)}")
    replicas = (
        _replicas_in_range(w, "targets.replicas", t["replicas"], topo) if "replicas" in t else None
    )
    hosts = _hosts_in_range(w, "targets.hosts", t["hosts"], topo) if "hosts" in t else None
    ka = w.table(t, "keep_alive", "targets.")
    w.unknown(ka, KEEP_ALIVE_KEYS, "targets.keep_alive.")
    last_healthy = ka.get("last_healthy", True)
    if not isinstance(last_healthy, bool):
        raise w.error(
            "targets.keep_alive.last_healthy", f"must be true or false, got {last_healthy!r}"
        )
    keep_alive = KeepAlive(
        replicas=frozenset(
            _replicas_in_range(w, "targets.keep_alive.replicas", ka.get("replicas", []), topo)
        ),
        hosts=frozenset(_hosts_in_range(w, "targets.keep_alive.hosts", ka.get("hosts", []), topo)),
        last_healthy=last_healthy,
    )
    return TargetSpec(kind=kind, replicas=replicas, hosts=hosts, keep_alive=keep_alive)


def parse_hypotheses(t: Mapping[str, Any], *, source: Path | None = None) -> Hypotheses:
    """Validate a ``[hypotheses]`` table (also used by ``ftharness report`` on a saved copy)."""
    w = _Where(source)
    allowed = (*BOOL_HYPOTHESES, *THRESHOLD_HYPOTHESES)
    w.unknown(t, allowed, "hypotheses.")
    flags = {}
    for key in BOOL_HYPOTHESES:
        v = t.get(key, False)
        if not isinstance(v, bool):
            raise w.error(f"hypotheses.{key}", f"must be true or false, got {v!r}")
        flags[key] = v
    thresholds: dict[str, Mapping[str, float]] = {}
    for key in THRESHOLD_HYPOTHESES:
        if key not in t:
            continue
        v = t[key]
        per = v if isinstance(v, dict) else {"*": v}
        for policy, bound in per.items():
            if policy != "*" and policy not in POLICIES:
                raise w.error(
                    f"hypotheses.{key}.{policy}",
                    f"unknown policy; allowed: {', '.join(POLICIES)} (or a plain number for all)",
                )
            _number(w, f"hypotheses.{key}", bound)
        thresholds[key] = MappingProxyType({p: float(b) for p, b in per.items()})
    return Hypotheses(**flags, thresholds=MappingProxyType(thresholds))
