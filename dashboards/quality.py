"""What the model learned, from the journal: held-out and training loss against committed steps.

One definition of each curve, used by the report's "unharmed" hypothesis
(``experiments/report_quality.py``) and drawn here for the HTML dashboard:

* **held-out loss** of a run at step ``s``: the ``heldout_loss`` of its ``eval`` record at ``s``
  (the same fixed held-out batches in every run; ``harness.rank.token_data``). A step evaluated
  twice (a full restart redoes steps after its checkpoint) counts the later record: that is the
  lineage the run went on with.
* **training loss** at step ``s``: the mean ``loss`` of the step's commit records (rank 0 of
  each group; the groups train different batches), smoothed by an exponential moving average
  over steps (:data:`SMOOTHING`); again the later record of a redone step.
* **faults** on the step axis: the committed step when each ``fault.inject`` was journaled.

Runs are named by policy, and the control's pieces ``control-1``, ``control-2``... (its
``control_run`` stamp).
"""

from __future__ import annotations

import html
from collections import defaultdict
from collections.abc import Mapping, Sequence
from typing import Any

from runtime import journal as J

Record = Mapping[str, Any]
CONTROL = "control"
#: Weight of a new step in the smoothed training loss (about the last 20 steps).
SMOOTHING = 0.05


def run_name(r: Record) -> str:
    policy = str(r.get("policy", "run"))
    if policy == CONTROL and r.get("control_run") is not None:
        return f"{CONTROL}-{r['control_run']}"
    return policy


def heldout_curves(records: Sequence[Record]) -> dict[str, dict[int, float]]:
    """Run name -> committed step -> held-out loss (see the module doc)."""
    out: dict[str, dict[int, float]] = defaultdict(dict)
    for r in sorted((r for r in records if r.get("event") == J.EVAL), key=lambda r: r["t"]):
        if r.get("heldout_loss") is not None and r.get("step") is not None:
            out[run_name(r)][int(r["step"])] = float(r["heldout_loss"])
    return {k: dict(sorted(v.items())) for k, v in out.items()}


def train_curves(records: Sequence[Record]) -> dict[str, list[tuple[int, float]]]:
    """Run name -> [(committed step, smoothed training loss)] (see the module doc)."""
    per: dict[str, dict[int, dict[Any, float]]] = defaultdict(lambda: defaultdict(dict))
    for r in sorted(records, key=lambda r: r.get("t", 0.0)):
        if r.get("event") == J.STEP_COMMIT and r.get("rank") in (None, 0):
            loss = r.get("loss")
            if loss is not None and r.get("step") is not None and loss == loss:  # not NaN
                per[run_name(r)][int(r["step"])][r.get("replica")] = float(loss)
    out = {}
    for name, steps in per.items():
        ema: float | None = None
        pts = []
        for step in sorted(steps):
            mean = sum(steps[step].values()) / len(steps[step])
            ema = mean if ema is None else ema + SMOOTHING * (mean - ema)
            pts.append((step, ema))
        out[name] = pts
    return out


def fault_steps(records: Sequence[Record]) -> dict[str, list[int]]:
    """Run name -> the committed step at each injected fault."""
    out: dict[str, list[int]] = defaultdict(list)
    step: dict[str, int] = defaultdict(int)
    for r in sorted(records, key=lambda r: r.get("t", 0.0)):
        name = run_name(r)
        if r.get("event") == J.STEP_COMMIT and r.get("step") is not None:
            step[name] = max(step[name], int(r["step"]))
        elif r.get("event") == J.FAULT_INJECT:
            out[name].append(step[name])
    return dict(out)


# --- the dashboard's panels (inline SVG, the classes of dashboards/html.py's CSS) -------------

_W, _H, _L, _R, _T, _B = 470, 230, 52, 12, 10, 30
#: The control's pieces: greys, dashed, so that the policies stand out against them.
_CONTROL_COLORS = ("#555555", "#8c8c8c", "#b0b0b0")


def _xy(pts: Sequence[tuple[float, float]], lim: tuple[float, float, float, float]) -> str:
    x0, x1, y0, y1 = lim
    sx = (_W - _L - _R) / ((x1 - x0) or 1.0)
    sy = (_H - _T - _B) / ((y1 - y0) or 1.0)
    return " ".join(f"{_L + (x - x0) * sx:.1f},{_H - _B - (y - y0) * sy:.1f}" for x, y in pts)


def _chart(
    series: Mapping[str, Sequence[tuple[float, float]]],
    colors: Mapping[str, str],
    faults: Mapping[str, Sequence[int]],
    y_label: str,
) -> str:
    pts = [p for s in series.values() for p in s]
    x1 = max(x for x, _ in pts) or 1.0
    ys = [y for _, y in pts]
    pad = (max(ys) - min(ys)) * 0.05 or 0.1
    lim = (0.0, float(x1), min(ys) - pad, max(ys) + pad)
    body = [
        f'<line class="axis" x1="{_L}" y1="{_H - _B}" x2="{_W - _R}" y2="{_H - _B}"/>',
        f'<line class="axis" x1="{_L}" y1="{_T}" x2="{_L}" y2="{_H - _B}"/>',
        f'<text class="label" x="{(_L + _W) / 2:.0f}" y="{_H - 2}" text-anchor="middle">'
        "committed step</text>",
        f'<text class="label" x="10" y="{_H / 2:.0f}" text-anchor="middle" '
        f'transform="rotate(-90 10 {_H / 2:.0f})">{html.escape(y_label)}</text>',
    ]
    for frac in (0.0, 0.5, 1.0):
        x = lim[1] * frac
        y = lim[2] + (lim[3] - lim[2]) * frac
        px = _xy([(x, lim[2])], lim).split(",")[0]
        qy = _xy([(0.0, y)], lim).split(",")[1]
        body.append(f'<text class="tick" x="{px}" y="{_H - _B + 12}" text-anchor="middle">'
                    f"{x:.0f}</text>")  # fmt: skip
        body.append(f'<text class="tick" x="{_L - 4}" y="{float(qy) + 3:.1f}" text-anchor="end">'
                    f"{y:.3g}</text>")  # fmt: skip
    for name, steps in faults.items():
        for s in steps:
            x = _xy([(s, lim[2])], lim).split(",")[0]
            body.append(
                f'<line class="fault" data-policy="{html.escape(name)}" x1="{x}" y1="{_T}" '
                f'x2="{x}" y2="{_H - _B}" stroke="{colors.get(name, "#999")}" stroke-width="1" '
                f'stroke-dasharray="2,3" opacity="0.6"><title>fault ({html.escape(name)}) at '
                f"step {s}</title></line>"
            )
    for name, s in series.items():
        if s:
            dash = ' stroke-dasharray="6,3"' if name.startswith(CONTROL) else ""
            body.append(
                f'<polyline class="series" data-policy="{html.escape(name)}" fill="none" '
                f'stroke-width="2" stroke="{colors.get(name, "#999")}"{dash} '
                f'points="{_xy(s, lim)}">'
                f"<title>{html.escape(name)}</title></polyline>"
            )
    legend = "".join(
        f'<span class="key"><i style="background:{colors.get(n, "#999")}"></i>'
        f"{html.escape(n)}</span>"
        for n in series
    )
    return (
        f'<svg viewBox="0 0 {_W} {_H}" width="100%" style="max-width:{_W}px" role="img" '
        f'aria-label="{html.escape(y_label)}">' + "".join(body) + "</svg>"
        f'<div class="legend">{legend}</div>'
    )


def loss_panels(records: Sequence[Record], colors: Mapping[str, str]) -> list[str]:
    """The dashboard's two loss panels (``data-panel`` ``training-loss`` and ``heldout-loss``),
    one line per run, the control's pieces in grey, faults as dashed lines on the step axis;
    ``colors``: policy -> colour. None without commits or evals respectively."""

    def color_of(name: str) -> str:
        if name.startswith(CONTROL):
            piece = name.rpartition("-")[2]
            return _CONTROL_COLORS[(int(piece) - 1 if piece.isdigit() else 0) % 3]
        return colors.get(name, "#999")

    faults = fault_steps(records)
    out = []
    for pid, title, series, note in (
        ("training-loss", "Training loss (smoothed) by committed step",
         train_curves(records), f"mean of the groups' losses, EMA weight {SMOOTHING}"),
        ("heldout-loss", "Held-out loss by committed step",
         {k: list(v.items()) for k, v in heldout_curves(records).items()},
         "the same fixed held-out batches in every run (data.eval_every)"),
    ):  # fmt: skip
        if not any(series.values()):
            continue
        cmap = {name: color_of(name) for name in series}
        out.append(
            f'<section class="panel" id="panel-{pid}" data-panel="{pid}"><h2>{title}</h2>'
            f'<p class="note">{html.escape(note)}; dashed: faults</p>'
            + _chart(series, cmap, faults, "loss")
            + "</section>"
        )
    return out
