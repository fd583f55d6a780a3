"""Is the model unharmed by training through failures? The held-out loss of each policy against
the control's, from the journal (curves: ``dashboards.quality``).

The hypothesis ``heldout_loss_within = x`` (or ``{ in_place = x }``): at every eval step that both
reached, a policy's held-out loss is within a relative ``tolerance`` of the control's, where
``tolerance = max(x, the control's own run-to-run spread)``. The control's value at a step is the
mean of its pieces (``control_runs``) that reached the step; its spread is the largest relative
difference between two of them at a step both reached ((max - min) / mean; none with one piece).
Which of the two set the tolerance is said in the result. A policy with no eval step in common
with the control fails: an unverifiable claim is not a passed one.

Why a relative tolerance: the loss of a language model is a log-likelihood, and a 1 % change of
it is what one would see from training a little longer or shorter; lost or doubled samples, a
heal from a stale or diverged peer, or a data position restored wrong move it by more (they
either throw away training or train on the wrong thing), and keep moving it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from dashboards.quality import CONTROL, heldout_curves

Record = Mapping[str, Any]


def _control(curves: Mapping[str, Mapping[int, float]]) -> tuple[dict[int, float], float | None]:
    """The control's mean held-out loss per step, and its spread (None with fewer than 2 pieces
    sharing a step)."""
    pieces = [c for name, c in curves.items() if name == CONTROL or name.startswith(CONTROL + "-")]
    steps = sorted({s for c in pieces for s in c})
    mean: dict[int, float] = {}
    spread: float | None = None
    for s in steps:
        vals = [c[s] for c in pieces if s in c]
        mean[s] = sum(vals) / len(vals)
        if len(vals) > 1 and mean[s] > 0:
            d = (max(vals) - min(vals)) / mean[s]
            spread = d if spread is None else max(spread, d)
    return mean, spread


def heldout_summary(records: Sequence[Record]) -> dict[str, Any] | None:
    """The held-out figures of an experiment (None: no run evaluated): per run its first and
    last eval, and per policy its largest relative gap to the control at a common step."""
    curves = heldout_curves(records)
    if not curves:
        return None
    control, spread = _control(curves)
    runs = {}
    for name, c in curves.items():
        (s0, l0), (s1, l1) = next(iter(c.items())), list(c.items())[-1]
        runs[name] = {
            "first": [s0, l0],
            "last": [s1, l1],
            "drop": (1.0 - l1 / l0) if l0 else None,
            "evals": len(c),
        }
    gaps = {}
    for name, c in curves.items():
        if name.startswith(CONTROL):
            continue
        common = [s for s in c if s in control]
        worst = max(common, key=lambda s: abs(c[s] - control[s]) / control[s], default=None)
        gaps[name] = {
            "common_steps": len(common),
            "max_gap": abs(c[worst] - control[worst]) / control[worst]
            if worst is not None
            else None,
            "at_step": worst,
            "last_common": ([common[-1], c[common[-1]], control[common[-1]]] if common else None),
        }
    first = next(iter(control.items()), None)
    last = list(control.items())[-1] if control else None
    return {
        "runs": runs,
        "control": {
            "first": list(first) if first else None,
            "last": list(last) if last else None,
            "drop": (1.0 - last[1] / first[1]) if first and last and first[1] else None,
            "spread": spread,
        },
        "policies": gaps,
    }


def heldout_hypothesis(bound: float, policy: str, summary: Mapping[str, Any] | None) -> dict:
    """The verdict of ``heldout_loss_within[policy]`` (see the module doc)."""
    label = f"heldout_loss_within[{policy}]"
    g = (summary or {}).get("policies", {}).get(policy)
    if g is None:
        return {"name": label, "passed": False, "detail": f"no held-out loss of {policy}"}
    if not g["common_steps"]:
        return {"name": label, "passed": False, "detail": "no eval step in common with control"}
    spread = summary["control"]["spread"] if summary else None
    tol, basis = bound, f"bound {bound:.3g}"
    if spread is not None and spread > bound:
        tol, basis = spread, f"the control's spread {spread:.3g} (> bound {bound:.3g})"
    ok = g["max_gap"] <= tol
    return {
        "name": label,
        "passed": ok,
        "detail": (
            f"largest gap to the control {100 * g['max_gap']:.2f} % at step {g['at_step']} over "
            f"{g['common_steps']} common eval steps (want <= {100 * tol:.2f} %: {basis})"
        ),
    }


def render_heldout(summary: Mapping[str, Any] | None) -> list[str]:
    """Markdown lines: each run's held-out loss at its first and last eval, and each policy's
    gap to the control."""
    if not summary:
        return []
    lines = [
        "## Held-out loss (is the model unharmed?)",
        "",
        "Mean loss on the same fixed held-out batches (documents never trained on), by committed "
        "step; gap: largest relative difference to the control at a step both evaluated.",
        "",
        "| run | first eval | last eval | drop | gap to control |",
        "|---|---|---|---|---|",
    ]
    for name, r in summary["runs"].items():
        g = summary["policies"].get(name)
        gap = "" if g is None or g["max_gap"] is None else f"{100 * g['max_gap']:.2f} %"
        if g is not None and g["at_step"] is not None:
            gap += f" (step {g['at_step']})"
        drop = "" if r["drop"] is None else f"{100 * r['drop']:.1f} %"
        lines.append(
            f"| {name} | {r['first'][1]:.4f} (step {r['first'][0]}) | "
            f"{r['last'][1]:.4f} (step {r['last'][0]}) | {drop} | {gap} |"
        )
    c = summary["control"]
    if c["spread"] is not None:
        lines += ["", f"- control's run-to-run spread: {100 * c['spread']:.2f} %"]
    lines.append("")
    return lines
