"""Recovery and goodput figures, computed only from journal records: the one definition of each.

Every surface shows these figures and no other: ``experiments/report.py`` and the HTML dashboard
read :func:`summarize`; the OpenTelemetry sink (``dashboards/telemetry.py``) folds the records it
is streamed through the same :class:`Throughput` and :class:`RunState` and calls the same
:func:`recovery_figures` as each recovery closes, and the Grafana dashboard reads those metrics,
whose names and descriptions are in ``dashboards/names.py``. A figure is computed only from the
records up to the moment it is final (a recovery's from the records up to its ``participating``
phase), which is what lets the live sink and the offline summary give the same number.

``summarize(records)`` returns::

    {"policies": {policy: {
        "committed_steps", "duration_s", "samples_per_s", "baseline_samples_per_s", "goodput",
        "goodput_basis", "control_samples_per_s", "goodput_spread": {"min", "max"},
        "goodput_above_control", "data": {"data_policy", "due", "skipped", ...} | None,
        "faults": {kind: {"count", "recovered", "no_recovery",
                          "detection_s": {"mean", "p50", "p95"}, "stall_s": {...},
                          "participate_s": {...}, "steps_lost"}},
        "all_faults": {"detection_s": {...}, "stall_s": {...}, "participate_s": {...}},
        "recoveries": [{"recovery_id", "fault_id", "kind", "replica", "cause", "detection_s",
                        "stall_s", "participate_s", "steps_lost", "phases": {phase: t}, "derived",
                        "survivor_gaps": [{"replica", "since", "until", "typical_gap_s",
                                           "stall_s"}]}]}},
     "comparison": {"participate_s_ratio", "stall_s_ratio", "goodput_ratio"}}  # both policies only

Definitions (t is each record's ``t``; a record without ``policy`` counts as ``"in_place"``):

* **policy run**: the records of one policy. ``duration_s`` = last ``job.end`` - first
  ``job.start`` (first/last record when those are missing). ``committed_steps`` = the largest
  committed step.
* **committed samples**: the ``samples`` of ``step.commit`` records (1 when absent) that make new
  progress: a commit counts unless its (replica, rank) already committed that step or a later
  one, so a step redone after a restart counts once (at its first commit) and lost work lowers
  the rate.
* **samples_per_s**: committed samples with first-commit < t <= last-commit, divided by
  (last-commit - first-commit). Start-up before the first commit is excluded from both rates.
* **baseline_samples_per_s**: the same rate over the fault-free stretch first-commit < t <= the
  last commit at or before the first ``fault.inject`` (the whole run if no fault fired). None if
  that stretch holds fewer than two commit times.
* **control run**: the records of policy ``control`` (experiments/spec.py): the same job with no
  faults, run in pieces (``control_run`` = 1, 2, ...) interleaved with the policies.
  A run's **steady rate** is its samples_per_s over the commits from ``STEADY_WARMUP_S`` after its
  first commit on (a control piece is shorter than a policy run: with warm-up in both, the
  shorter one would look slower). ``control_samples_per_s`` = the mean of the control pieces'
  steady rates; its spread = their min and max.
* **goodput** = the policy's steady rate (``steady_samples_per_s``) / control_samples_per_s when
  the experiment has a control run (``goodput_basis`` = ``"control"``), with ``goodput_spread`` =
  that rate / the control's max and / its min: the control's own noise. Without a control it
  is samples_per_s / baseline_samples_per_s (``goodput_basis`` = ``"in_run"``; the fault-free
  stretch includes warm-up, so this one can exceed 1). ``goodput_above_control``: the whole
  spread is above 1: a disturbed control, or groups sharing CPUs that ran faster while one of
  them was down (this 2-core machine; not where every group has its own devices). Live (the
  telemetry gauge) it is the in-run goodput of the records so far. The control's own summary
  has no goodput.
* **data**: which sequences of the stream the policy trained and skipped
  (``dashboards.data_coverage``; None for the control and for journals without that field).
* **fault of a recovery**: its ``fault_id`` (``harness/job/recovery.py`` links it). One fault can
  explain several recoveries: a host fault takes down every group on that host, and each group's
  recovery carries the fault's id and gets its own figures. A recovery no fault explains
  (a spontaneous failure) has kind ``"unplanned"`` (``names.KIND_UNPLANNED``). A recovery's
  **cause** is its tracker's (``harness/job/recovery.py``: the failure's cause, ``step_abort``,
  ``blocked_survivor`` for a program's survivor a death left blocked...; None when derived).
* **origin** of a recovery: its fault's ``fault.inject`` t; for an unplanned recovery, its first
  phase (``detected``) t.
* **detection_s** = the recovery's ``detected`` t - its fault's ``fault.inject`` t (None when
  unplanned). **participate_s** (time to participate) = ``participating`` t - origin: until the
  failed group commits a step again. Durations are floored at 0 (clocks across hosts are not
  corrected for skew).
* **failed groups** of a fault: its target replica; for a host fault (a target with a host and
  no replica), every group whose last ``step.commit``/``proc.start`` at or before the fault ran
  on that host; and the group of every recovery it explains. An unplanned recovery's failed group
  is its own. Every other group is a **survivor**.
* **stall_s** (survivor stall): for each survivor with at least two commits at or before the
  origin: its *typical gap*, the median of its last ``TYPICAL_GAPS`` gaps between consecutive
  commits ending at or before the origin; and its *longest gap*, the longest of its gaps between
  consecutive commits that end after the origin, among its commits up to the ``participating`` t,
  a gap still open at ``participating`` counting up to it. Its stall = longest - typical, floored
  at 0; the recovery's stall_s is the largest over survivors (each one is in ``survivor_gaps``).
  None without a ``participating`` phase or a survivor. A group's commits are those of its rank 0
  (a record without a rank counts as rank 0).
* **steps_lost** (per fault): for each group, with m = the smallest step it committed after the
  fault (and before the next fault), first at t_m, and M = the largest step it committed before
  t_m: max(0, M - m + 1); the fault's figure is the largest over the groups. A step is lost when
  a group commits it again, not when one group commits before the fault a step another commits
  after it. In place: 0. Full restart: the steps since the checkpoint. A semi-synchronous
  program's commits (``sync_every`` on the record: each covers that many inner steps, its step
  counts inner steps) use ``+ sync_every`` for ``+ 1``: a sync done again costs its inner steps.
  Every recovery of a fault shows its fault's figure; a kind's ``steps_lost`` is the sum over its
  faults (a fault counted once however many groups it took down).
* **per kind**: ``count`` = faults of that kind; ``recovered`` = those whose every recovery reached
  ``participating``; ``overtaken`` = those with a recovery the job's end overtook
  (``OVERTAKEN``); ``dropped`` = those with a recovery that ended in its group's drop
  (``DROPPED``: a crash loop of the group's own); detection_s, stall_s and participate_s =
  mean/p50/p95 over the kind's recoveries (one value per recovery, so a host fault that took
  down two groups adds two).
  ``all_faults``: the same over every recovery a fault explains (unplanned ones excluded).
* A fault with no ``recovery.phase`` records but ``failure`` records after it gets **derived**
  recoveries, one per failed group (the target replica, or every group that failed on the target
  host, not its idle spares; for an untargeted fault, the first failure only): detected = that
  group's first failure
  t; participating = its first commit after its next ``proc.start``.
* **comparison**: ratios full_restart / in_place of the ``all_faults`` mean participate_s and mean
  stall_s, and of the goodput; None where either side is missing or the denominator is 0.

Not guaranteed: clocks across hosts are not corrected for skew (see runtime.journal). The live
sink sees records in arrival order; a record that arrives after a recovery closed but carries an
earlier t is in the summary's figure and not in the live one.

Why this module is longer than 500 lines: it is the one definition of every recovery and goodput
figure (the design's rule); the figures share the same folds (:class:`Throughput`,
:class:`RunState`), so splitting them would separate definitions that must change together.
"""

from __future__ import annotations

import bisect
import itertools
import math
import statistics
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from dashboards.data_coverage import coverage
from dashboards.names import KIND_UNPLANNED
from runtime.journal import (
    ENDINGS,
    FAILURE,
    FAULT_INJECT,
    JOB_END,
    JOB_START,
    PHASES,
    PROC_START,
    RECOVERY_PHASE,
    STEP_COMMIT,
)

Record = Mapping[str, Any]
DEFAULT_POLICY = "in_place"
#: The fault-free control run's policy name (experiments/spec.py runs it).
CONTROL = "control"
#: Seconds after a run's first commit left out of the rates goodput-against-control compares.
STEADY_WARMUP_S = 5.0
#: How many of a survivor's gaps before the origin set its typical gap (see stall_s).
TYPICAL_GAPS = 50
#: The figures of one recovery, as computed by :func:`recovery_figures`.
RECOVERY_FIGURES = ("detection_s", "stall_s", "participate_s")


# -- small pure helpers -------------------------------------------------------------------------


def percentile(values: Sequence[float], q: float) -> float | None:
    """Linear-interpolated percentile (numpy's default), q in [0, 100]; None if empty."""
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def stats(values: Iterable[float | None]) -> dict[str, float | None]:
    """mean, p50 and p95 of the non-None values (all None if there are none)."""
    xs = [v for v in values if v is not None]
    return {
        "mean": statistics.fmean(xs) if xs else None,
        "p50": percentile(xs, 50),
        "p95": percentile(xs, 95),
    }


def _ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b == 0:
        return None
    return a / b


def _elapsed(since: float | None, until: float | None) -> float | None:
    """until - since, floored at 0 (clock skew across hosts); None if either is missing."""
    if since is None or until is None:
        return None
    return max(0.0, until - since)


def policy_of(record: Record) -> str:
    return record.get("policy") or DEFAULT_POLICY


def split_by_policy(records: Iterable[Record]) -> dict[str, list[Record]]:
    """Records per policy, each list in time order."""
    out: dict[str, list[Record]] = defaultdict(list)
    for r in records:
        out[policy_of(r)].append(r)
    return {p: sorted(rs, key=lambda r: r.get("t", 0.0)) for p, rs in out.items()}


def _of(records: Iterable[Record], event: str) -> list[Record]:
    return [r for r in records if r.get("event") == event]


# -- throughput ---------------------------------------------------------------------------------


class Throughput:
    """samples_per_s, baseline_samples_per_s and goodput of one policy run (module docstring),
    folded one record at a time in time order: :func:`throughput` folds a whole run, the
    telemetry sink each record as it arrives. Memory: one entry per (replica, rank)."""

    def __init__(self) -> None:
        self.first_t: float | None = None  # the first commit: opens both windows
        self.last_t: float | None = None
        self.samples = 0.0
        self.first_fault_t: float | None = None
        self.base_end: float | None = None  # the last commit at or before the first fault
        self.base_samples = 0.0
        self._top: dict[tuple[Any, Any], Any] = {}  # (replica, rank) -> highest step committed

    def fault(self, t: float) -> None:
        if self.first_fault_t is None or t < self.first_fault_t:
            self.first_fault_t = t

    def commit(self, t: float, replica: Any, rank: Any, step: Any, samples: float) -> None:
        key = (replica, rank)
        top = self._top.get(key)
        new = step is None or top is None or step > top
        if new and step is not None:
            self._top[key] = step
        if self.first_t is None:
            self.first_t = t
        if self.last_t is None or t > self.last_t:
            self.last_t = t
        counted = new and t > self.first_t
        if counted:
            self.samples += samples
        if self.first_fault_t is None or t <= self.first_fault_t:
            if self.base_end is None or t > self.base_end:
                self.base_end = t
            if counted:
                self.base_samples += samples

    def add(self, r: Record) -> None:
        """Fold one journal record (events other than commits and faults are ignored)."""
        event = r.get("event")
        if event == STEP_COMMIT:
            samples = r.get("samples", 1)
            self.commit(
                float(r.get("t", 0.0)),
                r.get("replica"),
                r.get("rank"),
                r.get("step"),
                float(1 if samples is None else samples),
            )
        elif event == FAULT_INJECT:
            self.fault(float(r.get("t", 0.0)))

    def figures(self) -> dict[str, float | None]:
        first, last, base_end = self.first_t, self.last_t, self.base_end
        run = self.samples / span if (span := _elapsed(first, last)) else None
        base = None
        if first is not None and base_end is not None and base_end > first:
            base = self.base_samples / (base_end - first)
        return {"samples_per_s": run, "baseline_samples_per_s": base, "goodput": _ratio(run, base)}


def steady_rate(records: Iterable[Record], warmup_s: float | None = None) -> float | None:
    """Committed samples per second after the first ``warmup_s`` (default
    :data:`STEADY_WARMUP_S`) seconds from the first commit, to the last commit: the rate that
    goodput against a control run compares, so that runs of different lengths carry the same
    warm-up (none)."""
    warm = STEADY_WARMUP_S if warmup_s is None else warmup_s
    commits = sorted(
        (r for r in records if r.get("event") == STEP_COMMIT), key=lambda r: r.get("t", 0.0)
    )
    if not commits:
        return None
    start = float(commits[0].get("t", 0.0)) + warm
    fold = Throughput()
    for r in commits:
        if float(r.get("t", 0.0)) >= start:
            fold.add(r)
    return fold.figures()["samples_per_s"]


def throughput(records: Iterable[Record]) -> dict[str, float | None]:
    """samples_per_s, baseline_samples_per_s and goodput of one policy run."""
    fold = Throughput()
    for r in sorted(records, key=lambda r: r.get("t", 0.0)):
        fold.add(r)
    return fold.figures()


# -- per-recovery figures ------------------------------------------------------------------------


class RunState:
    """What a recovery's figures read from the records before it, folded one record at a time
    in time order: each group's commit times (its rank 0's) and the host each group last ran on.
    Memory: one float per commit of each group's rank 0."""

    def __init__(self) -> None:
        self.times: dict[Any, list[float]] = defaultdict(list)
        self.hosts: dict[Any, Any] = {}

    def add(self, r: Record) -> None:
        """Fold one journal record (events other than commits and process starts are ignored)."""
        event = r.get("event")
        if event not in (STEP_COMMIT, PROC_START):
            return
        replica, host, t = r.get("replica"), r.get("host"), float(r.get("t", 0.0))
        if replica is not None and host is not None:
            self.hosts[replica] = host
        if event == STEP_COMMIT and not r.get("rank"):
            ts = self.times[replica]
            if ts and t < ts[-1]:
                bisect.insort(ts, t)  # a record that arrived late
            else:
                ts.append(t)

    def groups_on(self, host: Any) -> set[Any]:
        """The groups whose latest commit or process start was on ``host``."""
        return {g for g, h in self.hosts.items() if h == host}


def host_fault(fault: Record | None) -> Any:
    """The host a fault took down (a target with a host and no replica), else None."""
    target = (fault or {}).get("target") or {}
    return target.get("host") if target.get("replica") is None else None


def failed_groups(
    fault: Record | None, groups_on_host: Iterable[Any], recovery_replicas: Iterable[Any]
) -> set[Any]:
    """The groups a fault took down (module docstring, "failed groups"): its target replica,
    ``groups_on_host`` (:meth:`RunState.groups_on` its host at the fault, for a host fault) and
    the groups of the recoveries it explains (for an unplanned recovery: just its group)."""
    out = set(recovery_replicas)
    target = (fault or {}).get("target") or {}
    if target.get("replica") is not None:
        out.add(target["replica"])
    if host_fault(fault) is not None:
        out |= set(groups_on_host)
    return out


def survivor_gaps(
    times_by_group: Mapping[Any, Sequence[float]], failed: set[Any], start: float, end: float
) -> list[dict[str, Any]]:
    """Each survivor's longest gap and typical gap for a recovery from ``start`` (its origin) to
    ``end`` (its ``participating`` t); see the module docstring (stall_s). Reads only commit
    times up to ``end``."""
    out: list[dict[str, Any]] = []
    if end < start:
        return out  # clock skew put the recovery's end before its origin
    for group, ts in times_by_group.items():
        if group in failed:
            continue
        i = bisect.bisect_right(ts, start)  # ts[:i]: the commits at or before the origin
        before = ts[max(0, i - TYPICAL_GAPS - 1) : i]
        if len(before) < 2:
            continue  # no usual gap to compare with
        typical = statistics.median(b - a for a, b in itertools.pairwise(before))
        seq = list(ts[i - 1 : bisect.bisect_right(ts, end)])
        if seq[-1] < end:
            seq.append(end)  # a gap still open when the failed group participates again
        if len(seq) < 2:
            continue
        since, until = max(itertools.pairwise(seq), key=lambda ab: ab[1] - ab[0])
        out.append(
            {
                "replica": group,
                "since": since,
                "until": until,
                "typical_gap_s": typical,
                "stall_s": max(0.0, until - since - typical),
            }
        )
    return out


def recovery_figures(
    *,
    fault_t: float | None,
    phases: Mapping[str, float],
    times_by_group: Mapping[Any, Sequence[float]],
    failed: set[Any],
) -> dict[str, Any]:
    """detection_s, participate_s, stall_s and survivor_gaps of one recovery (module docstring).

    ``fault_t``: its fault's ``fault.inject`` t, None when unplanned; ``phases``: phase -> its
    first t; ``failed``: :func:`failed_groups`. Final once ``participating`` is in ``phases``:
    it reads nothing later than that."""
    origin = fault_t if fault_t is not None else min(phases.values(), default=None)
    participating = phases.get("participating")
    gaps = (
        survivor_gaps(times_by_group, failed, origin, participating)
        if origin is not None and participating is not None
        else []
    )
    return {
        "detection_s": _elapsed(fault_t, phases.get("detected")),
        "participate_s": _elapsed(origin, participating),
        "stall_s": max((g["stall_s"] for g in gaps), default=None),
        "survivor_gaps": gaps,
    }


def steps_lost(records: Sequence[Record], fault_t: float, next_fault_t: float | None) -> int:
    """See the module docstring (steps_lost)."""
    by_group: dict[Any, list[Record]] = defaultdict(list)
    for r in _of(records, STEP_COMMIT):
        by_group[r.get("replica")].append(r)
    lost = 0
    for commits in by_group.values():
        after = [
            r
            for r in commits
            if r["t"] > fault_t and (next_fault_t is None or r["t"] < next_fault_t)
        ]
        if not after:
            continue
        m = min(r["step"] for r in after)
        t_m = min(r["t"] for r in after if r["step"] == m)
        before = [r["step"] for r in commits if r["t"] < t_m]
        if not before:
            continue
        # a commit covers one step, or a semi-synchronous program's sync_every inner steps
        width = int(next(r for r in after if r["step"] == m).get("sync_every") or 1)
        lost = max(lost, max(before) - m + width)
    return lost


def _phases(records: Sequence[Record]) -> dict[str, dict[str, Any]]:
    """recovery_id -> {"fault_id", "replica", "cause", "phases": {phase: first t}}."""
    out: dict[str, dict[str, Any]] = {}
    for r in _of(records, RECOVERY_PHASE):
        rid = str(r.get("recovery_id"))
        rec = out.setdefault(rid, {"fault_id": None, "replica": None, "cause": None, "phases": {}})
        for key in ("fault_id", "replica", "cause"):
            if rec[key] is None and r.get(key) is not None:
                rec[key] = r[key]
        phase = r.get("phase")
        if phase not in rec["phases"] or r["t"] < rec["phases"][phase]:
            rec["phases"][phase] = r["t"]
    for rec in out.values():  # phases in protocol order
        rec["phases"] = {
            p: rec["phases"][p]
            for p in sorted(rec["phases"], key=lambda p: PHASES.index(p) if p in PHASES else 99)
        }
    return out


def _derived(records: Sequence[Record], fault: Record, until: float | None) -> list[dict[str, Any]]:
    """Recoveries read off ``failure``/``proc.start``/``step.commit`` for a fault that has no
    ``recovery.phase`` records, one per group it took down (see the module docstring)."""
    target = fault.get("target") or {}
    host = host_fault(fault)
    t0 = fault["t"]

    def hit(r: Record) -> bool:
        if r["t"] < t0 or (until is not None and r["t"] >= until):
            return False
        if target.get("replica") is not None:
            return r.get("replica") == target["replica"]
        if host is not None:  # a group on it; an idle warm spare lost with the host is none
            return r.get("host") == host and r.get("replica") is not None
        return True

    first_failure: dict[Any, Record] = {}
    for r in _of(records, FAILURE):
        if hit(r) and r.get("replica") not in first_failure:
            first_failure[r.get("replica")] = r
            if host is None and target.get("replica") is None:
                break  # an untargeted fault: its first failure only
    out = []
    for replica, failure in first_failure.items():
        phases = {"detected": failure["t"]}
        starts = [
            r["t"] for r in _of(records, PROC_START)
            if r["t"] >= failure["t"] and r.get("replica") == replica
        ]  # fmt: skip
        if starts:
            phases["replacement_started"] = starts[0]
            back = [
                r["t"] for r in _of(records, STEP_COMMIT)
                if r["t"] > starts[0] and r.get("replica") == replica
            ]  # fmt: skip
            if back:
                phases["participating"] = back[0]
        out.append({"fault_id": fault.get("fault_id"), "replica": replica, "phases": phases})
    return out


def recoveries(records: Sequence[Record]) -> list[dict[str, Any]]:
    """Every recovery of one policy run with its figures (see the module docstring)."""
    records = sorted(records, key=lambda r: r.get("t", 0.0))
    state = RunState()
    on_host: dict[Any, set[Any]] = {}  # fault_id -> the groups on its host when it fired
    for r in records:
        state.add(r)
        if r.get("event") == FAULT_INJECT:
            host = host_fault(r)
            on_host[r.get("fault_id")] = state.groups_on(host) if host is not None else set()
    faults = _of(records, FAULT_INJECT)
    by_id = {f.get("fault_id"): f for f in faults}
    next_t = {
        f.get("fault_id"): (faults[i + 1]["t"] if i + 1 < len(faults) else None)
        for i, f in enumerate(faults)
    }
    raw = [{"recovery_id": rid, **rec, "derived": False} for rid, rec in _phases(records).items()]
    covered = {r["fault_id"] for r in raw}
    for f in faults:
        if f.get("fault_id") not in covered:
            for d in _derived(records, f, next_t[f.get("fault_id")]):
                rid = f"derived-{f.get('fault_id')}-{d['replica']}"
                raw.append({"recovery_id": rid, **d, "derived": True})

    explained: dict[Any, set[Any]] = defaultdict(set)  # fault_id -> its recoveries' groups
    for rec in raw:
        explained[rec["fault_id"]].add(rec["replica"])
    lost_by_fault = {
        f.get("fault_id"): steps_lost(records, f["t"], next_t[f.get("fault_id")]) for f in faults
    }
    out = []
    for rec in raw:
        fault = by_id.get(rec["fault_id"])
        if fault is not None:
            fid = rec["fault_id"]
            failed = failed_groups(fault, on_host.get(fid, set()), explained[fid])
        else:
            failed = failed_groups(None, (), [rec["replica"]])
        figures = recovery_figures(
            fault_t=fault["t"] if fault is not None else None,
            phases=rec["phases"],
            times_by_group=state.times,
            failed=failed,
        )
        out.append(
            {
                "recovery_id": rec["recovery_id"],
                "fault_id": rec["fault_id"],
                "kind": fault["kind"] if fault is not None else KIND_UNPLANNED,
                "replica": rec["replica"],
                "cause": rec.get("cause"),
                **figures,
                "steps_lost": lost_by_fault[rec["fault_id"]] if fault is not None else None,
                "phases": rec["phases"],
                "derived": rec["derived"],
            }
        )
    out.sort(key=lambda e: min(e["phases"].values()) if e["phases"] else 0.0)
    return out


# -- the summary -------------------------------------------------------------------------------


def _figure_stats(recs: Sequence[Mapping[str, Any]]) -> dict[str, dict[str, float | None]]:
    return {key: stats(r[key] for r in recs) for key in RECOVERY_FIGURES}


def summarize_policy(records: Sequence[Record]) -> dict[str, Any]:
    """The figures of one policy run (records of that policy only)."""
    starts = [r["t"] for r in _of(records, JOB_START)]
    ends = [r["t"] for r in _of(records, JOB_END)]
    t_first = min((r["t"] for r in records), default=0.0)
    t_last = max((r["t"] for r in records), default=0.0)
    duration = (max(ends) if ends else t_last) - (min(starts) if starts else t_first)
    steps = [r["step"] for r in _of(records, STEP_COMMIT) if r.get("step") is not None]

    recs = recoveries(records)
    faults = _of(records, FAULT_INJECT)
    lost_by_fault = {r["fault_id"]: r["steps_lost"] for r in recs if r["steps_lost"] is not None}
    by_kind: dict[str, dict[str, Any]] = {}
    for kind in sorted({f["kind"] for f in faults}):
        mine = [r for r in recs if r["kind"] == kind and r["fault_id"] is not None]
        ids = [f.get("fault_id") for f in faults if f["kind"] == kind]
        recovered = [
            i for i in ids
            if (of := [r for r in mine if r["fault_id"] == i])
            and all(r["participate_s"] is not None for r in of)
        ]  # fmt: skip
        # per ending of runtime.journal.ENDINGS, the faults with a recovery that ended so:
        # "overtaken" (its group still rejoining when the job ended), "dropped" (its group
        # dropped for a crash loop of its own)
        ended = {
            e: sum(1 for i in ids if any(r["fault_id"] == i and e in r["phases"] for r in mine))
            for e in ENDINGS
        }
        by_kind[kind] = {
            "count": len(ids),
            "recovered": len(recovered),
            # faults that took down no group (the report's every_fault_recovered judges them)
            "no_recovery": sum(1 for i in ids if not any(r["fault_id"] == i for r in mine)),
            **ended,
            **_figure_stats(mine),
            "steps_lost": sum(lost_by_fault.get(i, 0) or 0 for i in ids),
        }
    data = coverage(records)
    return {
        "committed_steps": max(steps, default=0),
        "duration_s": duration,
        **throughput(records),
        "goodput_basis": "in_run",
        "control_samples_per_s": None,
        "goodput_spread": None,
        "goodput_above_control": None,
        "data": next(iter(data.values()), None),
        "faults": by_kind,
        "all_faults": _figure_stats([r for r in recs if r["fault_id"] is not None]),
        "recoveries": recs,
    }


def summarize_control(records: Sequence[Record]) -> dict[str, Any]:
    """The control run's summary: its pieces' rates, their mean and spread, no goodput."""
    pieces: dict[Any, list[Record]] = defaultdict(list)
    for r in records:
        pieces[r.get("control_run", 1)].append(r)
    ordered = [rs for _, rs in sorted(pieces.items(), key=lambda kv: str(kv[0]))]
    parts = [summarize_policy(rs) for rs in ordered]
    rates = [x for x in (steady_rate(rs) for rs in ordered) if x is not None]
    out = summarize_policy(records)
    out.update(
        committed_steps=max((p["committed_steps"] for p in parts), default=0),
        duration_s=sum(p["duration_s"] for p in parts),
        samples_per_s=statistics.fmean(rates) if rates else None,
        baseline_samples_per_s=None,
        goodput=None,
        goodput_basis=None,
        data=None,
        control_runs=rates,
        control_spread={"min": min(rates), "max": max(rates)} if rates else None,
    )
    return out


def _against_control(
    p: dict[str, Any], records: Sequence[Record], control: Mapping[str, Any]
) -> None:
    """Goodput of policy summary ``p`` against the control run (module docstring)."""
    rate, spread = control["samples_per_s"], control["control_spread"]
    if rate is None or spread is None:
        return
    run = steady_rate(records)
    p["steady_samples_per_s"] = run
    p["goodput_basis"] = "control"
    p["control_samples_per_s"] = rate
    p["goodput"] = _ratio(run, rate)
    lo, hi = _ratio(run, spread["max"]), _ratio(run, spread["min"])
    p["goodput_spread"] = {"min": lo, "max": hi}
    p["goodput_above_control"] = lo is not None and lo > 1.0


def summarize(records: Sequence[Record]) -> dict[str, Any]:
    """The whole summary (shape and definitions: see the module docstring)."""
    by_policy = split_by_policy(records)
    policies = {
        p: summarize_control(rs) if p == CONTROL else summarize_policy(rs)
        for p, rs in by_policy.items()
    }
    if CONTROL in policies:
        for name, p in policies.items():
            if name != CONTROL:
                _against_control(p, by_policy[name], policies[CONTROL])
    out: dict[str, Any] = {"policies": policies}
    if "in_place" in policies and "full_restart" in policies:
        ip, fr = policies["in_place"], policies["full_restart"]

        def mean_of(summary: dict[str, Any], key: str) -> float | None:
            return summary["all_faults"][key]["mean"]

        out["comparison"] = {
            "participate_s_ratio": _ratio(
                mean_of(fr, "participate_s"), mean_of(ip, "participate_s")
            ),
            "stall_s_ratio": _ratio(mean_of(fr, "stall_s"), mean_of(ip, "stall_s")),
            "goodput_ratio": _ratio(fr["goodput"], ip["goodput"]),
        }
    return out
