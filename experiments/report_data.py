"""Failures that come back, in the report, from the journal alone: poison data
(``harness.job.poison``: per policy, the data the ``poison_data`` fault made bad,
``fault.poison_data``; the sequences groups failed on, ``data.suspect``; those quarantined,
``data.quarantine``, each with its document and offset for a token file) and the replica groups
dropped for a crash loop of their own (``group.dropped``, ``harness.job.trainer_deaths``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from dashboards.metrics import split_by_policy
from runtime.journal import DATA_QUARANTINE, DATA_SUSPECT, GROUP_DROPPED, POISON_DATA, Record

_WHERE = ("key", "index", "chunk", "offset", "document", "in_document")


#: How a quarantined sequence was found, for the report's table.
HOW_FOUND = {"vocabulary": "its ids", "nonfinite": "a non-finite loss on equal weights"}


def data_summary(records: Sequence[Record]) -> dict[str, Any]:
    """Per policy with any of it: ``poisoned`` and ``quarantined`` (where each is; the groups
    and steps that failed on a quarantined one and how) and ``suspected`` (failures of a group
    blamed on its data)."""
    out: dict[str, Any] = {}
    for policy, recs in split_by_policy(records).items():
        poisoned = [_where(r) for r in recs if r.get("event") == POISON_DATA]
        quarantined = [
            {
                **_where(r),
                "groups": r.get("groups"),
                "steps": r.get("steps"),
                "what": r.get("what"),
                "found": r.get("found", "groups"),
            }
            for r in recs
            if r.get("event") == DATA_QUARANTINE
        ]
        suspected = sum(
            1 for r in recs if r.get("event") == DATA_SUSPECT and r.get("found") != "nonfinite"
        )
        nonfinite = sum(
            1 for r in recs if r.get("event") == DATA_SUSPECT and r.get("found") == "nonfinite"
        )
        if poisoned or quarantined or suspected or nonfinite:
            out[policy] = {
                "poisoned": poisoned,
                "quarantined": quarantined,
                "sequences_quarantined": len(quarantined),
                "suspected": suspected,
                "nonfinite": nonfinite,
            }
    return out


def _where(r: Record) -> dict[str, Any]:
    return {k: r[k] for k in _WHERE if k in r}


def render_data(summary: dict[str, Any]) -> list[str]:
    """Markdown lines for the report (none when no data was bad)."""
    lines: list[str] = []
    for policy, p in summary.items():
        lines += [
            f"## Poison data: `{policy}`",
            "",
            f"- sequences quarantined: {p['sequences_quarantined']}; failures blamed on data: "
            f"{p['suspected']}; non-finite losses blamed on data: {p.get('nonfinite', 0)}; "
            f"made bad by a fault: {len(p['poisoned'])}",
            "",
        ]
        if p["quarantined"]:
            lines += [
                "| data | document | offset in it | found by | groups | at steps | error |",
                "|---|---|---|---|---|---|---|",
            ]
            for q in p["quarantined"]:
                data = f"chunk {q['key']}" if "chunk" in q else f"sequence {q['key']}"
                groups = ", ".join(str(g) for g in q.get("groups") or ())
                steps = ", ".join(str(s) for s in q.get("steps") or ())
                what = str(q.get("what") or "").replace("|", "/")[:120]
                how = HOW_FOUND.get(q["found"], "2 groups failing")
                lines.append(
                    f"| {data} | {q.get('document', '-')} | {q.get('in_document', '-')} | "
                    f"{how} | {groups} | {steps} | {what} |"
                )
            lines.append("")
    return lines


def dropped_summary(records: Sequence[Record]) -> dict[str, Any]:
    """Per policy with any: the groups dropped (``replica``, ``t``, ``left``, ``reason``: the
    crash loop's diagnosis, its signature and log lines)."""
    out: dict[str, Any] = {}
    for policy, recs in split_by_policy(records).items():
        dropped = [
            {k: r.get(k) for k in ("replica", "t", "left", "reason")}
            for r in recs
            if r.get("event") == GROUP_DROPPED
        ]
        if dropped:
            out[policy] = dropped
    return out


def render_dropped(summary: dict[str, Any]) -> list[str]:
    """Markdown lines for the report (none when no group was dropped)."""
    lines: list[str] = []
    for policy, dropped in summary.items():
        lines += [f"## Groups dropped: `{policy}`", ""]
        for d in dropped:
            lines += [f"- group {d['replica']} ({d['left']} left to train on):", "", "```"]
            lines += [*str(d.get("reason") or "").splitlines(), "```", ""]
    return lines
