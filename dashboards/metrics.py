"""Recovery and goodput figures, computed only from journal records (pure functions).

``summarize(records)`` returns::

    {"policies": {policy: {
        "committed_steps", "duration_s", "samples_per_s", "baseline_samples_per_s", "goodput",
        "faults": {kind: {"count", "recovered", "detection_s": {"mean", "p50", "p95"},
                          "stall_s": {...}, "participate_s": {...}, "steps_lost"}},
        "recoveries": [{"recovery_id", "fault_id", "kind", "replica", "detection_s", "stall_s",
                        "participate_s", "steps_lost", "phases": {phase: t}, "derived"}]}},
     "comparison": {"participate_s_ratio", "stall_s_ratio", "goodput_ratio"}}  # both policies only

Definitions (t is each record's ``t``; a record without ``policy`` counts as ``"in_place"``):

* **policy run**: the records of one policy. ``duration_s`` = last ``job.end`` - first
  ``job.start`` (first/last record when those are missing). ``committed_steps`` = the largest
  committed step.
* **committed samples**: the ``samples`` of ``step.commit`` records (1 when absent), counting one
  commit per (replica, rank, step): a step redone after a full restart counts once, at its last
  commit, so lost work lowers the rate.
* **samples_per_s**: committed samples with first-commit < t <= last-commit, divided by
  (last-commit - first-commit). Start-up before the first commit is excluded from both rates.
* **baseline_samples_per_s**: the same rate (every commit: none is redone yet) over the
  fault-free stretch first-commit < t <= the last commit before the first ``fault.inject``
  (the whole run if no fault fired). None if that stretch holds fewer than two commit times.
* **goodput** = samples_per_s / baseline_samples_per_s.
* **detection_s** = the recovery's ``detected`` phase t - its fault's ``fault.inject`` t
  (matched by ``fault_id``). **participate_s** = ``participating`` t - ``fault.inject`` t.
* **stall_s** (survivor stall): for each healthy group (one not failed in this fault), the
  largest gap between its consecutive commits that overlaps [fault t, participating t], minus that
  group's median gap between consecutive commits over the policy run, floored at 0; the largest
  over healthy groups. None without a participating time or a healthy group.
* **steps_lost** (per fault): with m = the smallest step committed after the fault (and before the
  next fault), first committed at t_m, and M = the largest step committed before t_m:
  max(0, M - m + 1). In place: 0. Full restart: the steps since the checkpoint. A kind's
  ``steps_lost`` is the sum over its faults.
* A fault with no ``recovery.phase`` records but a ``failure`` after it gets a **derived**
  recovery: detected = that failure's t; participating = the failed replica's first commit after
  its next ``proc.start``. Recoveries with no fault (spontaneous failures) have kind
  ``"unplanned"`` and no fault-relative figures.
* **comparison**: ratios full_restart / in_place of the mean participate_s, the mean stall_s and
  the goodput; None where either side is missing or the denominator is 0.

Not guaranteed: clocks across hosts are not corrected for skew (see runtime.journal).
"""

from __future__ import annotations

import itertools
import math
import statistics
from collections import defaultdict
from collections.abc import Iterable, Sequence
from typing import Any

from runtime.journal import (
    FAILURE,
    FAULT_INJECT,
    JOB_END,
    JOB_START,
    PHASES,
    PROC_START,
    RECOVERY_PHASE,
    STEP_COMMIT,
)

Record = dict[str, Any]
DEFAULT_POLICY = "in_place"


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


def committed(records: Sequence[Record]) -> list[Record]:
    """One commit per (replica, rank, step): the last one (a redone step replaces the first)."""
    last: dict[tuple[Any, Any, Any], Record] = {}
    for r in _of(records, STEP_COMMIT):
        last[(r.get("replica"), r.get("rank"), r.get("step"))] = r
    return sorted(last.values(), key=lambda r: r["t"])


def rate(commits: Sequence[Record], start: float, end: float) -> float | None:
    """Committed samples per second with start < t <= end; None for an empty window."""
    if end <= start:
        return None
    samples = sum(r.get("samples", 1) for r in commits if start < r["t"] <= end)
    return samples / (end - start)


def throughput(records: Sequence[Record]) -> dict[str, float | None]:
    """samples_per_s, baseline_samples_per_s and goodput of one policy run."""
    commits = committed(records)
    all_commits = _of(records, STEP_COMMIT)
    if not commits:
        return {"samples_per_s": None, "baseline_samples_per_s": None, "goodput": None}
    first = min(r["t"] for r in all_commits)
    last = max(r["t"] for r in all_commits)
    faults = _of(records, FAULT_INJECT)
    if faults:
        first_fault = min(f["t"] for f in faults)
        before = [r["t"] for r in all_commits if r["t"] <= first_fault]
        base_end = max(before) if before else first
    else:
        base_end = last
    run = rate(commits, first, last)
    # Before the first fault nothing has been redone yet, so every commit there counts as is.
    base = rate(all_commits, first, base_end)
    return {"samples_per_s": run, "baseline_samples_per_s": base, "goodput": _ratio(run, base)}


# -- per-recovery figures ------------------------------------------------------------------------


def group_commit_times(records: Sequence[Record]) -> dict[int, list[float]]:
    """Per replica group, the times of its commits in time order, read from the group's lowest
    rank (every rank of a group commits the same steps). A step redone after a restart appears
    again: the gap before it is the stall."""
    commits = _of(records, STEP_COMMIT)
    low: dict[int, int] = {}
    for r in commits:
        g, rank = r.get("replica"), r.get("rank") or 0
        low[g] = min(low.get(g, rank), rank)
    out: dict[int, list[float]] = defaultdict(list)
    for r in commits:
        if (r.get("rank") or 0) == low[r.get("replica")]:
            out[r.get("replica")].append(r["t"])
    return {g: sorted(ts) for g, ts in out.items()}


def survivor_stall(
    times_by_group: dict[int, list[float]], failed: set[int], start: float, end: float
) -> float | None:
    """See the module docstring (stall_s)."""
    best: float | None = None
    for group, ts in times_by_group.items():
        if group in failed or len(ts) < 2:
            continue
        gaps = [b - a for a, b in itertools.pairwise(ts)]
        window = [b - a for a, b in itertools.pairwise(ts) if b > start and a < end]
        if not window:
            continue
        stall = max(0.0, max(window) - statistics.median(gaps))
        best = stall if best is None else max(best, stall)
    return best


def steps_lost(records: Sequence[Record], fault_t: float, next_fault_t: float | None) -> int:
    """See the module docstring (steps_lost)."""
    commits = _of(records, STEP_COMMIT)
    after = [
        r for r in commits if r["t"] > fault_t and (next_fault_t is None or r["t"] < next_fault_t)
    ]
    if not after:
        return 0
    m = min(r["step"] for r in after)
    t_m = min(r["t"] for r in after if r["step"] == m)
    before = [r["step"] for r in commits if r["t"] < t_m]
    if not before:
        return 0
    return max(0, max(before) - m + 1)


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


def _derived(
    records: Sequence[Record], fault: Record, until: float | None
) -> dict[str, Any] | None:
    """A recovery read off ``failure``/``proc.start``/``step.commit`` for a fault that has no
    ``recovery.phase`` records (see the module docstring)."""
    target = fault.get("target") or {}
    t0 = fault["t"]

    def inside(r: Record) -> bool:
        return r["t"] >= t0 and (until is None or r["t"] < until)

    failures = [
        r for r in _of(records, FAILURE)
        if inside(r) and (target.get("replica") is None or r.get("replica") == target["replica"])
    ]  # fmt: skip
    if not failures:
        return None
    failure = failures[0]
    replica = failure.get("replica")
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
    return {"fault_id": fault.get("fault_id"), "replica": replica, "phases": phases}


def recoveries(records: Sequence[Record]) -> list[dict[str, Any]]:
    """Every recovery of one policy run with its figures (see the module docstring)."""
    faults = sorted(_of(records, FAULT_INJECT), key=lambda r: r["t"])
    by_id = {f.get("fault_id"): f for f in faults}
    next_t = {
        f.get("fault_id"): (faults[i + 1]["t"] if i + 1 < len(faults) else None)
        for i, f in enumerate(faults)
    }
    raw = [{"recovery_id": rid, **rec, "derived": False} for rid, rec in _phases(records).items()]
    covered = {r["fault_id"] for r in raw}
    for f in faults:
        if f.get("fault_id") not in covered:
            d = _derived(records, f, next_t[f.get("fault_id")])
            if d is not None:
                raw.append({"recovery_id": f"derived-{f.get('fault_id')}", **d, "derived": True})

    # Every group a fault took down, so none of them counts as a survivor of that fault.
    failed: dict[Any, set[int]] = defaultdict(set)
    for rec in raw:
        if rec["replica"] is not None:
            failed[rec["fault_id"]].add(rec["replica"])
    for fid, f in by_id.items():
        replica = (f.get("target") or {}).get("replica")
        if replica is not None:
            failed[fid].add(replica)

    times = group_commit_times(records)
    lost_by_fault = {
        f.get("fault_id"): steps_lost(records, f["t"], next_t[f.get("fault_id")]) for f in faults
    }
    out = []
    for rec in raw:
        fault = by_id.get(rec["fault_id"])
        ph = rec["phases"]
        entry: dict[str, Any] = {
            "recovery_id": rec["recovery_id"],
            "fault_id": rec["fault_id"],
            "kind": fault["kind"] if fault else "unplanned",
            "replica": rec["replica"],
            "detection_s": None,
            "stall_s": None,
            "participate_s": None,
            "steps_lost": None,
            "phases": ph,
            "derived": rec["derived"],
        }
        if fault is not None:
            t0 = fault["t"]
            if "detected" in ph:
                entry["detection_s"] = ph["detected"] - t0
            if "participating" in ph:
                entry["participate_s"] = ph["participating"] - t0
                entry["stall_s"] = survivor_stall(
                    times, failed[rec["fault_id"]], t0, ph["participating"]
                )
            entry["steps_lost"] = lost_by_fault[rec["fault_id"]]
        out.append(entry)
    out.sort(key=lambda e: min(e["phases"].values()) if e["phases"] else 0.0)
    return out


# -- the summary -------------------------------------------------------------------------------


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
        mine = [r for r in recs if r["kind"] == kind]
        ids = [f.get("fault_id") for f in faults if f["kind"] == kind]
        by_kind[kind] = {
            "count": len(ids),
            "recovered": len({r["fault_id"] for r in mine if r["participate_s"] is not None}),
            "detection_s": stats(r["detection_s"] for r in mine),
            "stall_s": stats(r["stall_s"] for r in mine),
            "participate_s": stats(r["participate_s"] for r in mine),
            "steps_lost": sum(lost_by_fault.get(i, 0) or 0 for i in ids),
        }
    return {
        "committed_steps": max(steps, default=0),
        "duration_s": duration,
        **throughput(records),
        "faults": by_kind,
        "recoveries": recs,
    }


def summarize(records: Sequence[Record]) -> dict[str, Any]:
    """The whole summary (shape and definitions: see the module docstring)."""
    policies = {p: summarize_policy(rs) for p, rs in split_by_policy(records).items()}
    out: dict[str, Any] = {"policies": policies}
    if "in_place" in policies and "full_restart" in policies:
        ip, fr = policies["in_place"], policies["full_restart"]

        def mean_of(summary: dict[str, Any], key: str) -> float | None:
            return stats(r[key] for r in summary["recoveries"])["mean"]

        out["comparison"] = {
            "participate_s_ratio": _ratio(
                mean_of(fr, "participate_s"), mean_of(ip, "participate_s")
            ),
            "stall_s_ratio": _ratio(mean_of(fr, "stall_s"), mean_of(ip, "stall_s")),
            "goodput_ratio": _ratio(fr["goodput"], ip["goodput"]),
        }
    return out
