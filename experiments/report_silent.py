"""Silent failures in the report, from the journal alone: the divergences the controller found
(``silent.divergence``, harness.job.silent) with their detection latency and repair, the
straggler events (``straggler``) and each group's step time over the run.

Figures, per divergence:

* ``latency_steps`` / ``latency_s``: from the ``fault.bitflip`` that caused it (when one was
  journaled) to the detection;
* ``heal_s``: detection to the suspect's ``healed`` phase (its replacement loaded a healthy
  peer's state), ``participating_s`` to its ``participating`` phase;
* ``committed_after_detection``: steps the suspect's condemned incarnation committed after the
  detection, before its processes died;
* ``heals_while_corrupted``: heals of any other group between the flip and the suspect's death,
  the only window in which a heal could have come from the corrupted group (an upper bound: the
  journal does not say which peer served a heal). 0 means no heal from a corrupted group.

A divergence that was healed does not make the run's ``replicas_equal_after_heal`` or
``loss_finite`` hypothesis fail: :func:`without_healed_divergence` drops the suspect's commit
records from the detected step until its replacement heals (or the job restarts, for a
rollback). One only observed (``recovery.divergence = "observe"``) still does, and so does one
that no injected corruption explains (no ``fault.bitflip`` before it: :func:`unexplained`): the
harness itself made the replicas differ, which a repair must not hide. Neither does a
non-finite loss the data was to blame for (action ``data``: the weights checked equal, the
sequences were quarantined): the suspect's commit records of that one step are dropped.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from typing import Any

from dashboards.metrics import split_by_policy
from runtime.journal import (
    BITFLIP,
    FAILURE,
    HEALED,
    JOB_RESTART,
    RECOVERY_PHASE,
    SILENT_DIVERGENCE,
    STEP_COMMIT,
    STRAGGLER,
)

Record = dict[str, Any]

#: Seconds per point of the per-group step-time series.
BUCKET_S = 2.0


def without_healed_divergence(records: Sequence[Record]) -> list[Record]:
    """``records`` less the commit records of diverged groups that were then repaired: from
    the divergence's step, until the group heals (or the job restarts)."""
    if not any(_repaired(r) or _data_to_blame(r) for r in records):
        return list(records)
    out: list[Record] = []
    excluded: dict[int, int] = {}  # replica -> from step
    flipped = False
    for r in records:  # journal order: an alarm comes after the commits that raised it
        event = r.get("event")
        flipped = flipped or event == BITFLIP
        if _data_to_blame(r):
            at = {(int(s), int(r["step"])) for s in r.get("suspects") or []}
            out = [c for c in out if not _at(c, at)]
        elif _repaired(r) and flipped:
            for s in r.get("suspects") or []:
                excluded[int(s)] = int(r["step"])
            out = [c for c in out if not _excluded(c, excluded)]
        elif event == JOB_RESTART:
            excluded.clear()
        elif event == HEALED and r.get("replica") is not None:
            excluded.pop(int(r["replica"]), None)
        if not _excluded(r, excluded):
            out.append(r)
    return out


def unexplained(records: Sequence[Record]) -> list[Record]:
    """The repaired divergences (action ``heal`` or ``rollback``) that no injected corruption
    explains: no ``fault.bitflip`` was journaled before them. Faults that kill, hang or slow a
    group leave its weights the others' (a heal copies a peer's); only a flip makes them differ,
    so a divergence without one is the harness's own bug (a heal that left tensors unloaded)."""
    out = []
    flipped = False
    for r in records:
        flipped = flipped or r.get("event") == BITFLIP
        if _repaired(r) and not flipped:
            out.append(r)
    return out


def _repaired(r: Record) -> bool:
    return r.get("event") == SILENT_DIVERGENCE and r.get("action") in ("heal", "rollback")


def _data_to_blame(r: Record) -> bool:
    return r.get("event") == SILENT_DIVERGENCE and r.get("action") == "data"


def _at(r: Record, at: set[tuple[int, int]]) -> bool:
    if r.get("event") != STEP_COMMIT or r.get("replica") is None:
        return False
    return (int(r["replica"]), int(r.get("step", 0))) in at


def _excluded(r: Record, excluded: dict[int, int]) -> bool:
    if r.get("event") != STEP_COMMIT or r.get("replica") not in excluded:
        return False
    return int(r.get("step", 0)) >= excluded[int(r["replica"])]


def silent_summary(records: Sequence[Record]) -> dict[str, Any]:
    """Per policy: ``divergences``, ``bitflips``, ``stragglers`` (events) and ``step_time``
    (replica -> [[seconds since start, median compute_s], ...])."""
    out = {}
    for policy, recs in split_by_policy(records).items():
        recs = sorted(recs, key=lambda r: r.get("t", 0.0))
        p = {
            "bitflips": [
                _pick(r, "t", "replica", "rank", "step", "tensor", "index", "bit")
                for r in recs
                if r.get("event") == BITFLIP
            ],
            "divergences": [
                _divergence(a, recs) for a in recs if a.get("event") == SILENT_DIVERGENCE
            ],
            "stragglers": [
                _pick(r, "t", "replica", "action", "ratio", "step", "group_s", "others_s")
                for r in recs
                if r.get("event") == STRAGGLER
            ],
            "step_time": _step_time(recs),
        }
        if p["bitflips"] or p["divergences"] or p["stragglers"]:
            out[policy] = p
    return out


def _pick(r: Record, *keys: str) -> dict[str, Any]:
    return {k: r.get(k) for k in keys}


def _divergence(a: Record, recs: list[Record]) -> dict[str, Any]:
    t = float(a["t"])
    d = _pick(a, "step", "cause", "action", "suspects", "majority", "latency_steps", "latency_s")
    d["t"] = t
    suspects = set(a.get("suspects") or [])
    phases: dict[str, float] = {}
    for r in recs:
        if (
            r.get("event") == RECOVERY_PHASE
            and r.get("replica") in suspects
            and r.get("cause") == "divergence"
            and r["t"] >= t - 1.0
        ):
            phases.setdefault(r["phase"], float(r["t"]))
    d["heal_s"] = round(phases["healed"] - t, 3) if "healed" in phases else None
    d["participating_s"] = (
        round(phases["participating"] - t, 3) if "participating" in phases else None
    )
    deaths = [
        float(r["t"])
        for r in recs
        if r.get("event") == FAILURE and r.get("replica") in suspects and r["t"] >= t
    ]
    dead = min(deaths, default=None)
    d["committed_after_detection"] = len(
        {
            r["step"]
            for r in recs
            if r.get("event") == STEP_COMMIT
            and r.get("replica") in suspects
            and r["step"] > a["step"]
            and t <= r["t"] <= (dead if dead is not None else t)
        }
    )
    t_flip = t - float(a["latency_s"]) if a.get("latency_s") is not None else None
    d["heals_while_corrupted"] = (
        None
        if t_flip is None or dead is None
        else sum(
            1
            for r in recs
            if r.get("event") == HEALED
            and r.get("replica") not in suspects
            and t_flip <= r["t"] <= dead
        )
    )
    return d


def _step_time(recs: list[Record]) -> dict[str, list[list[float]]]:
    if not recs:
        return {}
    t0 = float(recs[0]["t"])
    buckets: dict[tuple[int, int], list[float]] = defaultdict(list)
    for r in recs:
        if r.get("event") == STEP_COMMIT and r.get("compute_s") is not None:
            key = (int(r["replica"]), int((float(r["t"]) - t0) // BUCKET_S))
            buckets[key].append(float(r["compute_s"]))
    series: dict[str, list[list[float]]] = defaultdict(list)
    for (replica, b), xs in sorted(buckets.items()):
        xs.sort()
        series[str(replica)].append([b * BUCKET_S, round(xs[len(xs) // 2], 5)])
    return dict(series)


_COLUMNS = (
    "step",
    "cause",
    "action",
    "suspects",
    "majority",
    "latency_steps",
    "latency_s",
    "heal_s",
    "participating_s",
    "committed_after_detection",
    "heals_while_corrupted",
)


def render_silent(silent: dict[str, Any]) -> list[str]:
    """Markdown lines for the report (none when nothing silent happened)."""
    lines: list[str] = []
    for policy, p in silent.items():
        lines += [f"## Silent failures: `{policy}`", ""]
        if p["divergences"]:
            lines += [
                "| step | cause | action | suspects | majority | latency (steps) | latency (s) "
                "| heal after detection (s) | participating (s) | steps committed after "
                "detection | heals while corrupted |",
                "|---|---|---|---|---|---|---|---|---|---|---|",
            ]
            for d in p["divergences"]:
                cells = [d[k] for k in _COLUMNS]
                lines.append("| " + " | ".join("-" if c is None else str(c) for c in cells) + " |")
            lines.append("")
        if p["stragglers"]:
            lines += [
                "| replica | event | step | ratio | group (s) | others (s) |",
                "|---|---|---|---|---|---|",
            ]
            for e in p["stragglers"]:
                lines.append(
                    f"| {e['replica']} | {e['action']} | {e['step']} | {e['ratio']} | "
                    f"{e['group_s']} | {e['others_s']} |"
                )
            lines.append("")
    return lines
