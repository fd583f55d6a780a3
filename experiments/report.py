"""The experiment report: hypotheses checked and figures rendered, computed only from the journal.

``ftharness report RUN_DIR [--html] [--json]`` recomputes everything from the journal file(s)
under RUN_DIR; the hypotheses come from ``RUN_DIR/experiment.toml`` (the runner saves a copy of
the experiment there) when it exists. Exit status: 0 all hypotheses hold (or none were set),
1 one failed, 2 no journal.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tomllib
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from dashboards import names as N
from dashboards.metrics import split_by_policy, summarize
from experiments.spec import ExperimentError, Hypotheses, parse_hypotheses
from runtime.journal import FAULT_INJECT, JOB_RESTART, STEP_COMMIT, read_journal

Record = dict[str, Any]
Result = dict[str, Any]

# threshold name -> (what it reads from a policy summary, "min" | "max", unit)
_THRESHOLDS = {
    "goodput_min": ("goodput", "min", ""),
    "recovery_p95_max_s": ("participate_s", "max", " s"),
    "detection_p95_max_s": ("detection_s", "max", " s"),
    "stall_p95_max_s": ("stall_s", "max", " s"),
    "steps_lost_max": ("steps_lost", "max", " steps"),
}


# -- hypotheses ---------------------------------------------------------------------------------


def _loss_finite(policy: str, records: Sequence[Record]) -> Result:
    bad = [
        r for r in records
        if r.get("event") == STEP_COMMIT and r.get("loss") is not None
        and not math.isfinite(float(r["loss"]))
    ]  # fmt: skip
    n = sum(1 for r in records if r.get("event") == STEP_COMMIT and r.get("loss") is not None)
    if n == 0:
        return _result(f"loss_finite[{policy}]", False, "no committed step reported a loss")
    if bad:
        b = bad[0]
        return _result(
            f"loss_finite[{policy}]", False,
            f"{len(bad)} of {n} committed losses not finite; first: replica {b.get('replica')} "
            f"step {b.get('step')} loss {b.get('loss')}",
        )  # fmt: skip
    return _result(f"loss_finite[{policy}]", True, f"all {n} committed losses finite")


def _steps_rise(policy: str, records: Sequence[Record]) -> Result:
    commits = [r for r in records if r.get("event") == STEP_COMMIT]
    faults = [r for r in records if r.get("event") == FAULT_INJECT]
    name = f"committed_steps_rise[{policy}]"
    if not commits:
        return _result(name, False, "no step was committed")
    stuck = []
    for f in faults:
        before = max((c["step"] for c in commits if c["t"] <= f["t"]), default=-1)
        if not any(c["step"] > before for c in commits if c["t"] > f["t"]):
            stuck.append(f"{f.get('fault_id')} ({f.get('kind')}) at step {before}")
    if stuck:
        return _result(name, False, "no progress after " + ", ".join(stuck))
    top = max(c["step"] for c in commits)
    return _result(name, True, f"progress after all {len(faults)} faults; reached step {top}")


def _replicas_equal(policy: str, records: Sequence[Record]) -> Result:
    # The checksum each replica committed for each (incarnation, step, rank). A whole-job
    # restart (job.restart) starts a new incarnation: a step redone after it is compared with
    # the other replicas' redone step, never with a commit from before the restart.
    last: dict[tuple[Any, Any, Any], dict[Any, str]] = defaultdict(dict)
    incarnation = 0
    for r in records:
        if r.get("event") == JOB_RESTART:
            incarnation += 1
        elif r.get("event") == STEP_COMMIT and r.get("checksum") is not None:
            last[(incarnation, r.get("step"), r.get("rank"))][r.get("replica")] = r["checksum"]
    name = f"replicas_equal_after_heal[{policy}]"
    compared = {k: v for k, v in last.items() if len(v) >= 2}
    if not compared:
        return _result(name, False, "no step was committed with a checksum by two replicas")
    bad = sorted(
        (k for k, v in compared.items() if len(set(v.values())) > 1),
        key=lambda k: (k[0], k[1] is None, k[1]),
    )
    if bad:
        _, step, rank = bad[0]
        return _result(
            name, False,
            f"{len(bad)} of {len(compared)} steps differ across replicas; first: step {step} "
            f"rank {rank}: {compared[bad[0]]}",
        )  # fmt: skip
    return _result(name, True, f"checksums equal across replicas at all {len(compared)} steps")


def _threshold(name: str, bound: float, policy: str, summary: dict[str, Any]) -> Result:
    label = f"{name}[{policy}]"
    p = summary["policies"].get(policy)
    if p is None:
        return _result(label, False, f"policy {policy} did not run")
    key, sense, unit = _THRESHOLDS[name]
    if key == "goodput":
        value = p["goodput"]
    elif key == "steps_lost":
        value = sum(k["steps_lost"] for k in p["faults"].values())
    else:  # over the recoveries of injected faults, as the comparison
        value = p["all_faults"][key]["p95"]
    if value is None:
        return _result(label, False, f"no {key} measured")
    ok = value >= bound if sense == "min" else value <= bound
    op = ">=" if sense == "min" else "<="
    shown = f"p95 {key}" if name.endswith("p95_max_s") else key
    return _result(label, ok, f"{shown} = {value:.3g}{unit} (want {op} {bound:g}{unit})")


def _result(name: str, passed: bool, detail: str) -> Result:
    return {"name": name, "passed": bool(passed), "detail": detail}


def evaluate_hypotheses(
    spec_hypotheses: Hypotheses | None, summary: dict[str, Any], records: Sequence[Record]
) -> list[Result]:
    """Check each hypothesis per policy; a hypothesis with nothing to check against fails (an
    unverifiable claim is not a passed one)."""
    if spec_hypotheses is None:
        return []
    by_policy = split_by_policy(records)
    out: list[Result] = []
    for policy, recs in by_policy.items():
        if spec_hypotheses.loss_finite:
            out.append(_loss_finite(policy, recs))
        if spec_hypotheses.committed_steps_rise:
            out.append(_steps_rise(policy, recs))
        if spec_hypotheses.replicas_equal_after_heal:
            out.append(_replicas_equal(policy, recs))
    for name, per in spec_hypotheses.thresholds.items():
        policies = list(by_policy) if "*" in per else []
        policies += [p for p in per if p != "*" and p not in policies]
        for policy in policies:
            bound = spec_hypotheses.bound(name, policy)
            assert bound is not None
            out.append(_threshold(name, bound, policy, summary))
    return out


# -- rendering ----------------------------------------------------------------------------------

#: The recovery figures' column headings: their labels in dashboards/names.py, in that order.
_LABELS = " | ".join(str(m.label) for m in N.RECOVERY_METRICS)


def _f(x: Any, unit: str = "") -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        return f"{x:.3g}{unit}"
    return f"{x}{unit}"


def _stat(s: dict[str, Any]) -> str:
    if s["mean"] is None:
        return "-"
    return f"{s['mean']:.2f} / {s['p50']:.2f} / {s['p95']:.2f}"


def render_markdown(summary: dict[str, Any], hypotheses_results: Sequence[Result]) -> str:
    """The report as Markdown: hypotheses, then per policy the throughput, a per-fault-kind table
    and every recovery, then the comparison."""
    lines = ["# Chaos experiment report", ""]
    if hypotheses_results:
        ok = all(h["passed"] for h in hypotheses_results)
        lines += [f"## Hypotheses: {'all passed' if ok else 'FAILED'}", ""]
        lines += ["| | hypothesis | detail |", "|---|---|---|"]
        for h in hypotheses_results:
            lines.append(f"| {'✅' if h['passed'] else '❌'} | {h['name']} | {h['detail']} |")
        lines.append("")
    for policy, p in summary["policies"].items():
        lines += [
            f"## Policy `{policy}`",
            "",
            f"- committed steps: {p['committed_steps']}; duration {_f(p['duration_s'], ' s')}",
            f"- committed samples/s: {_f(p['samples_per_s'])}; fault-free baseline: "
            f"{_f(p['baseline_samples_per_s'])}; **goodput {_f(p['goodput'])}**",
            "",
        ]
        if p["faults"]:
            lines += [
                "Times in seconds, mean / p50 / p95 over the recoveries (a fault that took down "
                "several groups has one recovery per group; definitions: dashboards/metrics.py).",
                "",
                f"| fault | count | recovered | {_LABELS} | steps lost |",
                "|---|---|---|---|---|---|---|",
            ]
            for kind, k in p["faults"].items():
                lines.append(
                    f"| {kind} | {k['count']} | {k['recovered']} | "
                    + " | ".join(_stat(k[str(m.quantity)]) for m in N.RECOVERY_METRICS)
                    + f" | {k['steps_lost']} |"
                )
            lines.append("")
        if p["recoveries"]:
            lines += [
                f"| recovery | fault | kind | replica | {_LABELS} | steps lost |",
                "|---|---|---|---|---|---|---|---|",
            ]
            for r in p["recoveries"]:
                rid = r["recovery_id"] + (" (derived)" if r.get("derived") else "")
                lines.append(
                    f"| {rid} | {_f(r['fault_id'])} | {r['kind']} | {_f(r['replica'])} | "
                    + " | ".join(_f(r[str(m.quantity)], " s") for m in N.RECOVERY_METRICS)
                    + f" | {_f(r['steps_lost'])} |"
                )
            lines.append("")
    comp = summary.get("comparison")
    if comp:
        lines += [
            "## in_place vs full_restart (full_restart ÷ in_place)",
            "",
            f"- {N.PARTICIPATE.label}: x{_f(comp['participate_s_ratio'])}",
            f"- {N.SURVIVOR_STALL.label}: x{_f(comp['stall_s_ratio'])}",
            f"- {N.GOODPUT.label}: x{_f(comp['goodput_ratio'])}",
            "",
        ]
    lines.append("Computed from the run's journal only (definitions: dashboards/metrics.py).")
    return "\n".join(lines) + "\n"


def write_report(
    out_dir: str | Path, records: Sequence[Record], hypotheses: Hypotheses | None
) -> dict[str, Any]:
    """Write ``report.md`` and ``report.json`` into ``out_dir``; return the report
    ``{"summary", "hypotheses", "passed"}``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    summary = summarize(records)
    results = evaluate_hypotheses(hypotheses, summary, records)
    report = {
        "summary": summary,
        "hypotheses": results,
        "passed": all(h["passed"] for h in results),
    }
    (out / "report.json").write_text(json.dumps(report, indent=2, default=str) + "\n")
    (out / "report.md").write_text(render_markdown(summary, results), encoding="utf-8")
    return report


# -- the CLI ------------------------------------------------------------------------------------


def load_run_hypotheses(run_dir: Path) -> Hypotheses | None:
    """The ``[hypotheses]`` of the experiment copy saved in ``run_dir`` (None if absent)."""
    path = run_dir / "experiment.toml"
    if not path.is_file():
        return None
    data = tomllib.loads(path.read_text(encoding="utf-8"))
    return parse_hypotheses(data.get("hypotheses", {}), source=path)


def main(args: argparse.Namespace) -> int:
    """``ftharness report RUN_DIR [--html] [--json]``."""
    target = Path(args.run_dir)
    if not target.exists():
        print(f"ftharness report: {target} does not exist", file=sys.stderr)
        return 2
    out_dir = target if target.is_dir() else target.parent
    records = read_journal(target)
    if not records:
        print(f"ftharness report: no journal records under {target}", file=sys.stderr)
        return 2
    try:
        hypotheses = load_run_hypotheses(out_dir)
    except (ExperimentError, tomllib.TOMLDecodeError) as e:
        print(f"ftharness report: {e}", file=sys.stderr)
        return 2
    report = write_report(out_dir, records, hypotheses)
    if getattr(args, "json", False):
        print(json.dumps(report, indent=2, default=str))
    else:
        print(render_markdown(report["summary"], report["hypotheses"]), end="")
        print(f"wrote {out_dir / 'report.md'} and {out_dir / 'report.json'}")
    if getattr(args, "html", False):
        from dashboards.html import write_dashboard

        path = write_dashboard(out_dir, records, report["summary"])
        if not getattr(args, "json", False):
            print(f"wrote {path or out_dir / 'dashboard.html'}")
    return 0 if report["passed"] else 1
