"""A self-contained HTML recovery dashboard, computed from a run's journal.

``write_dashboard(out_dir, records, summary)`` writes ``out_dir/dashboard.html``: one file with
inline CSS and inline SVG drawn here in Python, so it opens offline (no CDN, no script, no
network request of any kind). ``summary`` is :func:`dashboards.metrics.summarize` of the same
records; every number shown, and every recovery drawn on a timeline (its phases, its survivors'
stalls), comes from it, called by its label in ``dashboards/names.py``; the raw records only
draw the training activity, the faults and the series.

Panels carry stable ids and ``data-panel`` attributes (``goodput``, ``comparison``,
``timeline``, ``step-rate``, ``participants``, ``recovery-distribution``, ``recoveries``); the
per-policy ones also carry ``data-policy``. Everything taken from the journal is escaped.

Why this module is longer than 500 lines: the dashboard is drawn here as inline SVG with no library,
so it opens offline; each panel is one function and the drawing helpers they share sit beside them.
"""

from __future__ import annotations

import html
import itertools
import math
import time
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from dashboards import names as N
from dashboards.metrics import split_by_policy
from dashboards.quality import loss_panels
from runtime import journal as J

POLICY_COLORS = {"in_place": "#2b7bb9", "full_restart": "#d9534f"}
FALLBACK_COLORS = ("#6a51a3", "#31a354", "#e6550d", "#636363")
TRAIN_COLOR = "#9aa5b1"
_TIMES = "\u00d7"  # the multiplication sign, for ratios
PHASE_COLORS = {
    "detection": "#d62728",
    "stall": "#ff9f1c",
    "restart": "#1f77b4",
    "rejoin": "#2ca02c",
}
#: What each timeline bar is (the legend): a recovery figure of metrics.py by its label, or
#: the interval between two recovery phases by the phases' names.
PHASE_LABELS = {
    "detection": N.DETECTION.label,
    "stall": N.SURVIVOR_STALL.label,
    "restart": "replacement started \u2192 healed",
    "rejoin": "healed \u2192 participating",
}
METRIC_LABELS: dict[str, str] = {str(m.quantity): str(m.label) for m in N.RECOVERY_METRICS}

Record = Mapping[str, Any]


def _e(value: Any) -> str:
    """Escape anything from the journal for HTML text and attribute values."""
    return html.escape(str(value), quote=True)


def _fmt(value: Any, unit: str = "", digits: int = 2) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "\u2013"
    if isinstance(value, float | int):
        return f"{value:.{digits}f}{unit}"
    return _e(value)


def _pct(value: Any) -> str:
    return "\u2013" if not isinstance(value, int | float) else f"{100 * value:.1f}%"


def _color(policy: str, policies: Sequence[str]) -> str:
    if policy in POLICY_COLORS:
        return POLICY_COLORS[policy]
    return FALLBACK_COLORS[list(policies).index(policy) % len(FALLBACK_COLORS)]


# --- SVG helpers -------------------------------------------------------------------------------
class _Axes:
    """Maps data to pixels inside a chart with margins; draws axes and ticks."""

    def __init__(
        self,
        *,
        width: int,
        height: int,
        x0: float,
        x1: float,
        y0: float,
        y1: float,
        left: int = 48,
        right: int = 12,
        top: int = 10,
        bottom: int = 30,
    ) -> None:
        self.w, self.h = width, height
        self.left, self.right, self.top, self.bottom = left, right, top, bottom
        self.x0, self.x1 = x0, (x1 if x1 > x0 else x0 + 1.0)
        self.y0, self.y1 = y0, (y1 if y1 > y0 else y0 + 1.0)

    def x(self, v: float) -> float:
        span = self.w - self.left - self.right
        return self.left + (v - self.x0) / (self.x1 - self.x0) * span

    def y(self, v: float) -> float:
        span = self.h - self.top - self.bottom
        return self.h - self.bottom - (v - self.y0) / (self.y1 - self.y0) * span

    def frame(self, x_label: str, y_label: str, *, y_ticks: bool = True) -> list[str]:
        out = [
            f'<line class="axis" x1="{self.left}" y1="{self.h - self.bottom}" '
            f'x2="{self.w - self.right}" y2="{self.h - self.bottom}"/>',
            f'<line class="axis" x1="{self.left}" y1="{self.top}" x2="{self.left}" '
            f'y2="{self.h - self.bottom}"/>',
            f'<text class="label" x="{(self.left + self.w - self.right) / 2:.1f}" '
            f'y="{self.h - 2}" text-anchor="middle">{_e(x_label)}</text>',
            f'<text class="label" x="10" y="{(self.top + self.h - self.bottom) / 2:.1f}" '
            f'text-anchor="middle" transform="rotate(-90 10 '
            f'{(self.top + self.h - self.bottom) / 2:.1f})">{_e(y_label)}</text>',
        ]
        for v in _ticks(self.x0, self.x1):
            out.append(
                f'<text class="tick" x="{self.x(v):.1f}" y="{self.h - self.bottom + 12}" '
                f'text-anchor="middle">{_tick_label(v)}</text>'
            )
        if y_ticks:
            for v in _ticks(self.y0, self.y1, 4):
                out.append(
                    f'<line class="grid" x1="{self.left}" y1="{self.y(v):.1f}" '
                    f'x2="{self.w - self.right}" y2="{self.y(v):.1f}"/>'
                )
                out.append(
                    f'<text class="tick" x="{self.left - 4}" y="{self.y(v) + 3:.1f}" '
                    f'text-anchor="end">{_tick_label(v)}</text>'
                )
        return out


def _ticks(lo: float, hi: float, n: int = 6) -> list[float]:
    if hi <= lo:
        return [lo]
    raw = (hi - lo) / n
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw)
    first = math.ceil(lo / step) * step
    return [first + i * step for i in range(int((hi - first) / step) + 1)]


def _tick_label(v: float) -> str:
    return f"{v:.0f}" if abs(v - round(v)) < 1e-9 else f"{v:.2g}"


def _svg(width: int, height: int, body: Iterable[str], label: str) -> str:
    # 100% wide up to the drawing's own size, so text never scales above its font size
    return (
        f'<svg viewBox="0 0 {width} {height}" width="100%" style="max-width:{width}px" '
        f'role="img" '
        f'aria-label="{_e(label)}" preserveAspectRatio="xMinYMin meet">' + "".join(body) + "</svg>"
    )


# --- record helpers ------------------------------------------------------------------------------
def _group_commits(recs: Sequence[Record]) -> list[Record]:
    """One commit per replica group and step (rank 0's, or the rank-less record)."""
    return [r for r in recs if r.get("event") == J.STEP_COMMIT and r.get("rank") in (None, 0)]


def _replicas(recs: Sequence[Record]) -> list[Any]:
    seen = {
        r.get("replica")
        for r in recs
        if r.get("event") in (J.STEP_COMMIT, J.PROC_START, J.RECOVERY_PHASE)
        and r.get("replica") is not None
    }
    return sorted(seen, key=lambda v: (str(type(v)), v))


# --- panels --------------------------------------------------------------------------------------
def _panel(
    pid: str, kind: str, title: str, body: str, policy: str | None = None, note: str = ""
) -> str:
    pol = f' data-policy="{_e(policy)}"' if policy is not None else ""
    note_html = f'<p class="note">{note}</p>' if note else ""
    return (
        f'<section class="panel" id="{_e(pid)}" data-panel="{_e(kind)}"{pol}>'
        f"<h2>{_e(title)}</h2>{note_html}{body}</section>"
    )


def _goodput_panel(summary: Mapping[str, Any], policies: Sequence[str]) -> str:
    cards = []
    for p in policies:
        s = summary.get("policies", {}).get(p, {})
        faults = sum(int(f.get("count", 0)) for f in s.get("faults", {}).values())
        if s.get("goodput_basis") == "control":
            spread = s.get("goodput_spread") or {}
            base = (
                f"<dt>control samples/s</dt><dd>{_fmt(s.get('control_samples_per_s'), '', 1)}"
                f"</dd><dt>control's spread</dt><dd>{_pct(spread.get('min'))}-"
                f"{_pct(spread.get('max'))}</dd>"
            )
        else:
            base = (
                f"<dt>fault-free samples/s</dt>"
                f"<dd>{_fmt(s.get('baseline_samples_per_s'), '', 1)}</dd>"
            )
        data = s.get("data")
        if data:
            base += f"<dt>sequences skipped</dt><dd>{data['skipped']} of {data['due']}</dd>"
        cards.append(
            f'<div class="card" data-policy="{_e(p)}" style="border-color:{_color(p, policies)}">'
            f'<div class="policy">{_e(p)}</div>'
            f'<div class="big" data-value="goodput">{_pct(s.get("goodput"))}</div>'
            f'<div class="sub">goodput</div><dl>'
            f"<dt>samples/s</dt><dd>{_fmt(s.get('samples_per_s'), '', 1)}</dd>"
            f"{base}<dt>committed steps</dt><dd>{_fmt(s.get('committed_steps'), '', 0)}</dd>"
            f"<dt>duration</dt><dd>{_fmt(s.get('duration_s'), ' s', 1)}</dd>"
            f"<dt>faults</dt><dd>{faults}</dd></dl></div>"
        )
    return _panel(
        "panel-goodput",
        "goodput",
        "Goodput",
        f'<div class="cards">{"".join(cards)}</div>',
        note="Committed samples per second over the fault-free rate: the experiment's control "
        "run (the same job, no faults) where it has one, else this run's stretch before its "
        "first fault.",
    )


def _comparison_panel(summary: Mapping[str, Any], policies: Sequence[str]) -> str:
    rows: list[tuple[str, str, dict[str, float | None]]] = []
    for key in ("participate_s", "stall_s"):
        vals = {}
        for p in policies:
            all_faults = summary.get("policies", {}).get(p, {}).get("all_faults", {})
            vals[p] = (all_faults.get(key) or {}).get("mean")
        rows.append((key, f"mean {METRIC_LABELS[key]} (s)", vals))
    rows.append(
        (
            "goodput",
            "goodput",
            {p: summary.get("policies", {}).get(p, {}).get("goodput") for p in policies},
        )
    )
    width, bar_h, label_w = 720, 18, 190
    height = sum(len(policies) * (bar_h + 4) + 18 for _ in rows) + 10
    body, y = [], 16
    for key, label, vals in rows:
        top = max([v for v in vals.values() if isinstance(v, int | float)] + [1e-9])
        body.append(f'<text class="label" x="0" y="{y}">{_e(label)}</text>')
        y += 4
        for p in policies:
            v = vals.get(p)
            w = 0.0 if not isinstance(v, int | float) else (width - label_w - 80) * v / top
            text = _pct(v) if key == "goodput" else _fmt(v, " s")
            body.append(
                f'<g data-metric="{_e(key)}" data-policy="{_e(p)}">'
                f'<text class="tick" x="{label_w - 6}" y="{y + 13}" text-anchor="end">'
                f"{_e(p)}</text>"
                f'<rect x="{label_w}" y="{y}" width="{w:.1f}" height="{bar_h}" '
                f'fill="{_color(p, policies)}"><title>{_e(p)} {_e(label)}: {text}</title></rect>'
                f'<text class="tick" x="{label_w + w + 6:.1f}" y="{y + 13}">{text}</text></g>'
            )
            y += bar_h + 4
        y += 14
    comp = summary.get("comparison") or {}
    ratios = "".join(
        f'<li data-ratio="{_e(k)}">{_e(text)}: <b>{_fmt(comp.get(k), _TIMES)}</b></li>'
        for k, text in (
            ("participate_s_ratio", f"{N.PARTICIPATE.label}, full_restart / in_place"),
            ("stall_s_ratio", f"{N.SURVIVOR_STALL.label}, full_restart / in_place"),
            ("goodput_ratio", f"{N.GOODPUT.label}, full_restart / in_place"),
        )
        if comp.get(k) is not None
    )
    note = (
        "Means over each policy's recoveries of injected faults; ratios are full_restart / "
        "in_place (above 1: in-place recovers faster; below 1: in-place keeps more goodput)."
    )
    body_html = _svg(width, height, body, "policy comparison")
    if ratios:
        body_html += f'<ul class="ratios">{ratios}</ul>'
    return _panel(
        "panel-comparison", "comparison", "In-place vs full restart", body_html, note=note
    )


def _timeline_panel(
    policy: str,
    recs: Sequence[Record],
    policies: Sequence[str],
    recoveries: Sequence[Mapping[str, Any]],
) -> str:
    t0 = recs[0].get("t", 0.0)
    t_end = recs[-1].get("t", t0)
    replicas = _replicas(recs)
    row_h, width = 26, 1180
    height = 40 + row_h * max(1, len(replicas)) + 30
    ax = _Axes(width=width, height=height, x0=0.0, x1=t_end - t0, y0=0, y1=1, left=90, top=8)
    row_y = {rep: ax.top + 4 + i * row_h for i, rep in enumerate(replicas)}
    body = ax.frame("seconds since start", "", y_ticks=False)
    color = TRAIN_COLOR
    for rep, y in row_y.items():
        body.append(
            f'<text class="tick" x="{ax.left - 6}" y="{y + 14}" text-anchor="end">'
            f"group {_e(rep)}</text>"
        )
    # training activity: merge each group's consecutive commits into bars
    commits = _group_commits(recs)
    gaps = sorted(b.get("t", 0) - a.get("t", 0) for a, b in itertools.pairwise(commits))
    typical = gaps[len(gaps) // 2] if gaps else 1.0
    by_rep: dict[Any, list[float]] = defaultdict(list)
    for c in commits:
        by_rep[c.get("replica")].append(c.get("t", t0) - t0)
    for rep, ts in by_rep.items():
        if rep not in row_y:
            continue
        start = prev = ts[0]
        for t in [*ts[1:], None]:
            if t is None or t - prev > max(3 * typical, 0.25):
                body.append(
                    f'<rect class="train" x="{ax.x(start):.1f}" y="{row_y[rep] + 6}" '
                    f'width="{max(1.0, ax.x(prev) - ax.x(start)):.1f}" height="10" '
                    f'fill="{color}" opacity="0.6"><title>group {_e(rep)} committing '
                    f"{start:.1f} to {prev:.1f} s</title></rect>"
                )
                if t is not None:
                    start = t
            if t is not None:
                prev = t
    # recoveries, as summarize() reports them: phases, detection and each survivor's stall
    for rec in recoveries:
        rid, rep = rec.get("recovery_id"), rec.get("replica")
        ph = {k: v - t0 for k, v in (rec.get("phases") or {}).items()}
        y = row_y.get(rep, ax.top + 4)
        detected, detection = ph.get("detected"), rec.get("detection_s")
        segs = [
            ("detection", None if detection is None else detected - detection, detected),
            ("restart", ph.get("replacement_started"), ph.get("healed")),
            ("rejoin", ph.get("healed"), ph.get("participating")),
        ]
        for name, a, b in segs:
            if a is None or b is None:
                continue
            body.append(
                f'<rect class="phase" data-phase="{name}" data-recovery="{_e(rid)}" '
                f'x="{ax.x(a):.1f}" y="{y + 2}" width="{max(2.0, ax.x(b) - ax.x(a)):.1f}" '
                f'height="18" fill="{PHASE_COLORS[name]}" opacity="0.85"><title>recovery '
                f"{_e(rid)} group {_e(rep)}: {_e(PHASE_LABELS[name])} {b - a:.2f} s</title></rect>"
            )
        # a survivor's stall: the part of its longest gap between commits beyond its typical gap
        for gap in rec.get("survivor_gaps") or []:
            other, stall = gap.get("replica"), gap.get("stall_s") or 0.0
            if stall <= 0 or other not in row_y:
                continue
            until = gap["until"] - t0
            body.append(
                f'<rect class="phase" data-phase="stall" data-recovery="{_e(rid)}" '
                f'x="{ax.x(until - stall):.1f}" y="{row_y[other] + 2}" '
                f'width="{max(2.0, ax.x(until) - ax.x(until - stall)):.1f}" height="18" '
                f'fill="{PHASE_COLORS["stall"]}" opacity="0.8"><title>group {_e(other)}: '
                f"{N.SURVIVOR_STALL.label} {stall:.2f} s (recovery {_e(rid)}): no commit for "
                f"{gap['until'] - gap['since']:.2f} s, typical gap {gap['typical_gap_s']:.2f} s"
                "</title></rect>"
            )
    faults = {r.get("fault_id"): r for r in recs if r.get("event") == J.FAULT_INJECT}
    for fid, f in faults.items():
        target = f.get("target") if isinstance(f.get("target"), dict) else {}
        rep = f.get("replica", target.get("replica"))
        y = row_y.get(rep, ax.top + 4)
        x = ax.x(f.get("t", t0) - t0)
        body.append(
            f'<path class="fault" data-fault="{_e(fid)}" d="M{x:.1f},{y - 2} l-5,-8 h10 z" '
            f'fill="#000"><title>fault {_e(fid)}: {_e(f.get("kind"))} on group {_e(rep)} at '
            f"{f.get('t', t0) - t0:.2f} s</title></path>"
        )
    legend = (
        "".join(
            f'<span class="key"><i style="background:{c}"></i>{_e(n)}</span>'
            for n, c in (
                ("training", color),
                *((PHASE_LABELS[k], c) for k, c in PHASE_COLORS.items()),
            )
        )
        + '<span class="key"><i class="tri"></i>fault injected</span>'
    )
    return _panel(
        f"panel-timeline-{policy}",
        "timeline",
        f"Timeline: {policy}",
        _svg(width, height, body, f"timeline {policy}") + f'<div class="legend">{legend}</div>',
        policy=policy,
    )


def _step_rate_series(recs: Sequence[Record]) -> list[tuple[float, float]]:
    """Distinct steps committed per second, in windows of ~1/40 of the run (at least 0.5 s)."""
    commits = _group_commits(recs)
    if not commits:
        return []
    t0 = recs[0].get("t", 0.0)
    dur = max(recs[-1].get("t", t0) - t0, 1e-6)
    win = max(dur / 40, 0.5)
    buckets: dict[int, set[Any]] = defaultdict(set)
    for c in commits:
        buckets[int((c.get("t", t0) - t0) / win)].add(c.get("step"))
    n = int(dur / win) + 1
    return [((i + 0.5) * win, len(buckets.get(i, ())) / win) for i in range(n)]


def _participants_series(recs: Sequence[Record]) -> list[tuple[float, float]]:
    t0 = recs[0].get("t", 0.0)
    out = []
    for c in _group_commits(recs):
        p = c.get("participants")
        if p is not None:
            out.append((c.get("t", t0) - t0, float(p if isinstance(p, int | float) else len(p))))
    return out


def _series_panel(
    pid: str,
    kind: str,
    title: str,
    y_label: str,
    series: Mapping[str, list[tuple[float, float]]],
    policies: Sequence[str],
    *,
    step: bool = False,
    note: str = "",
) -> str:
    pts = [p for s in series.values() for p in s]
    width, height = 470, 220
    if not pts:
        return _panel(pid, kind, title, '<p class="empty">no committed steps</p>')
    ax = _Axes(
        width=width,
        height=height,
        x0=0.0,
        x1=max(x for x, _ in pts),
        y0=0.0,
        y1=max(y for _, y in pts) * 1.1 or 1.0,
    )
    body = ax.frame("seconds since start", y_label)
    for policy, s in series.items():
        if not s:
            continue
        coords = []
        for i, (x, y) in enumerate(s):
            if step and i:
                coords.append(f"{ax.x(x):.1f},{ax.y(s[i - 1][1]):.1f}")
            coords.append(f"{ax.x(x):.1f},{ax.y(y):.1f}")
        body.append(
            f'<polyline class="series" data-policy="{_e(policy)}" fill="none" stroke-width="2" '
            f'stroke="{_color(policy, policies)}" points="{" ".join(coords)}">'
            f"<title>{_e(policy)}</title></polyline>"
        )
    legend = "".join(
        f'<span class="key"><i style="background:{_color(p, policies)}"></i>{_e(p)}</span>'
        for p in series
    )
    return _panel(
        pid,
        kind,
        title,
        _svg(width, height, body, title) + f'<div class="legend">{legend}</div>',
        note=note,
    )


def _step_time_panel(by_policy: Mapping[str, Sequence[Record]]) -> str | None:
    """Each group's own step time (``compute_s``: no wait for others; median per 2 s), with
    the stragglers flagged and ejected (harness.job.silent) listed; None without any."""
    series: dict[str, list[tuple[float, float]]] = {}
    marks = []
    for policy, recs in by_policy.items():
        t0 = recs[0].get("t", 0.0) if recs else 0.0
        buckets: dict[tuple[Any, int], list[float]] = defaultdict(list)
        for r in recs:
            if r.get("event") == J.STRAGGLER and r.get("action") != "cleared":
                marks.append(
                    f"{policy} g{r.get('replica')} {r.get('action')} at "
                    f"{r.get('t', t0) - t0:.1f} s ({r.get('ratio')}x)"
                )
            elif r.get("compute_s") is not None:
                buckets[(r.get("replica"), int((r.get("t", t0) - t0) // 2))].append(r["compute_s"])
        for (replica, b), xs in sorted(buckets.items(), key=lambda kv: (str(kv[0][0]), kv[0][1])):
            series.setdefault(f"{policy} g{replica}", []).append(
                (2.0 * b + 1.0, sorted(xs)[len(xs) // 2])
            )
    if not series:
        return None
    note = "stragglers: " + "; ".join(marks) if marks else "no straggler flagged"
    return _series_panel(
        "panel-step-time",
        "step-time",
        "Step time per group",
        "s",
        series,
        list(series),
        note=_e(note),
    )


def _distribution_panel(summary: Mapping[str, Any], policies: Sequence[str]) -> str:
    """Strip plot: every recovery's detection, stall and participate time, per fault kind."""
    rows: list[tuple[str, str]] = []  # (kind, metric)
    points: dict[tuple[str, str], list[tuple[str, float, Any]]] = defaultdict(list)
    for p in policies:
        for r in summary.get("policies", {}).get(p, {}).get("recoveries", []):
            kind = str(r.get("kind") or "unknown")
            for m in METRIC_LABELS:
                v = r.get(m)
                if isinstance(v, int | float):
                    if (kind, m) not in rows:
                        rows.append((kind, m))
                    points[(kind, m)].append((p, float(v), r.get("recovery_id")))
    if not rows:
        return _panel(
            "panel-recovery-distribution",
            "recovery-distribution",
            "Recovery times by fault kind",
            '<p class="empty">no recoveries</p>',
        )
    rows.sort()
    row_h, width = 26, 1180
    height = 20 + row_h * len(rows) + 34
    top = max(v for pts in points.values() for _, v, _ in pts)
    ax = _Axes(width=width, height=height, x0=0.0, x1=top * 1.08 or 1.0, y0=0, y1=1, left=250)
    body = ax.frame("seconds", "", y_ticks=False)
    for i, (kind, m) in enumerate(rows):
        y = ax.top + 8 + i * row_h
        label = f"{kind} · {METRIC_LABELS[m]}"
        # a long kind is cut, the metric name kept; the full label shows on hover
        short_kind = kind if len(kind) <= 18 else kind[:17] + "\u2026"
        short = f"{short_kind} · {METRIC_LABELS[m]}"
        body.append(
            f'<text class="tick" x="{ax.left - 6}" y="{y + 4}" text-anchor="end">'
            f"<title>{_e(label)}</title>{_e(short)}</text>"
            f'<line class="grid" x1="{ax.left}" y1="{y}" x2="{width - ax.right}" '
            f'y2="{y}"/>'
        )
        for j, p in enumerate(policies):
            stats = (
                summary.get("policies", {}).get(p, {}).get("faults", {}).get(kind, {}).get(m) or {}
            )
            for q, dash in (("p50", ""), ("p95", ' stroke-dasharray="3,2"')):
                v = stats.get(q)
                if isinstance(v, int | float):
                    body.append(
                        f'<line class="quantile" data-q="{q}" x1="{ax.x(v):.1f}" '
                        f'y1="{y - 9 + 9 * j}" x2="{ax.x(v):.1f}" y2="{y + 9 * j}" '
                        f'stroke="{_color(p, policies)}" stroke-width="2"{dash}><title>{_e(p)} '
                        f"{_e(kind)} {METRIC_LABELS[m]} {q} {v:.2f} s</title></line>"
                    )
        for p, v, rid in points[(kind, m)]:
            j = policies.index(p)
            body.append(
                f'<circle class="dot" data-policy="{_e(p)}" cx="{ax.x(v):.1f}" '
                f'cy="{y - 4 + 9 * j}" r="4" fill="{_color(p, policies)}" opacity="0.8">'
                f"<title>{_e(p)} recovery {_e(rid)}: {METRIC_LABELS[m]} {v:.2f} s</title></circle>"
            )
    legend = "".join(
        f'<span class="key"><i style="background:{_color(p, policies)}"></i>{_e(p)}</span>'
        for p in policies
    )
    legend += '<span class="key">| p50 · ¦ p95</span>'
    return _panel(
        "panel-recovery-distribution",
        "recovery-distribution",
        "Recovery times by fault kind",
        _svg(width, height, body, "recovery time distribution")
        + f'<div class="legend">{legend}</div>',
    )


def _recoveries_panel(summary: Mapping[str, Any], policies: Sequence[str]) -> str:
    head = (
        "<tr><th>policy</th><th>recovery</th><th>fault</th><th>kind</th><th>group</th>"
        "<th>detection</th><th>stall</th><th>participate</th><th>steps lost</th></tr>"
    )
    rows = []
    for p in policies:
        for r in summary.get("policies", {}).get(p, {}).get("recoveries", []):
            rows.append(
                f'<tr data-policy="{_e(p)}"><td>{_e(p)}</td><td>{_e(r.get("recovery_id"))}</td>'
                f"<td>{_e(r.get('fault_id'))}</td><td>{_e(r.get('kind'))}</td>"
                f"<td>{_e(r.get('replica'))}</td><td>{_fmt(r.get('detection_s'), ' s')}</td>"
                f"<td>{_fmt(r.get('stall_s'), ' s')}</td>"
                f"<td>{_fmt(r.get('participate_s'), ' s')}</td>"
                f"<td>{_fmt(r.get('steps_lost'), '', 0)}</td></tr>"
            )
    body = f"<table>{head}{''.join(rows)}</table>" if rows else '<p class="empty">none</p>'
    return _panel("panel-recoveries", "recoveries", "Recoveries", body)


_CSS = """
body{font:14px/1.4 system-ui,-apple-system,Segoe UI,sans-serif;margin:0;background:#f5f6f8;
color:#222}
header{background:#1d2733;color:#fff;padding:14px 24px}
header h1{margin:0;font-size:20px} header p{margin:4px 0 0;color:#b8c2cc;font-size:13px}
main{display:grid;grid-template-columns:repeat(2,minmax(0,1fr));gap:16px;padding:16px 24px}
.panel{background:#fff;border-radius:6px;box-shadow:0 1px 3px rgba(0,0,0,.12);padding:12px 16px}
.panel.wide,.panel[data-panel=timeline],.panel[data-panel=recovery-distribution],
.panel[data-panel=recoveries],.panel[data-panel=goodput],.panel[data-panel=comparison]
{grid-column:1/-1}
h2{font-size:15px;margin:0 0 8px} .note{color:#666;font-size:12px;margin:0 0 8px}
.cards{display:flex;gap:16px;flex-wrap:wrap}
.card{border-left:5px solid;padding:6px 14px;min-width:220px;background:#fafbfc}
.card .policy{font-weight:600} .card .big{font-size:30px;font-weight:700}
.card .sub{color:#666;font-size:12px}
dl{display:grid;grid-template-columns:auto auto;gap:2px 12px;margin:8px 0 0;font-size:12px}
dt{color:#666} dd{margin:0;text-align:right;font-variant-numeric:tabular-nums}
svg text{font-size:11px;fill:#333} svg .label{font-size:12px;fill:#555}
svg .axis{stroke:#888} svg .grid{stroke:#eee}
.legend{font-size:12px;color:#444;margin-top:4px}
.key{margin-right:14px;white-space:nowrap}
.key i{display:inline-block;width:12px;height:12px;margin-right:4px;vertical-align:-2px}
.key i.tri{width:0;height:0;border-left:6px solid transparent;border-right:6px solid transparent;
border-top:10px solid #000;background:none}
table{border-collapse:collapse;width:100%;font-size:12px;font-variant-numeric:tabular-nums}
th,td{padding:4px 8px;border-bottom:1px solid #eee;text-align:left}
.ratios{margin:4px 0 0;font-size:13px} .empty{color:#888}
"""


def render_dashboard(records: Sequence[Record], summary: Mapping[str, Any]) -> str:
    """The dashboard as one HTML string (see the module docstring)."""
    by_policy = split_by_policy(records)
    policies = list(summary.get("policies", {}) or by_policy)
    for p in by_policy:
        if p not in policies:
            policies.append(p)
    jobs = sorted({str(r.get("job")) for r in records if r.get("job") is not None})
    panels = [_goodput_panel(summary, policies)]
    if len(policies) > 1 or summary.get("comparison"):
        panels.append(_comparison_panel(summary, policies))
    for p in policies:
        if by_policy.get(p):
            recoveries = summary.get("policies", {}).get(p, {}).get("recoveries", [])
            panels.append(_timeline_panel(p, by_policy[p], policies, recoveries))
    panels.append(
        _series_panel(
            "panel-step-rate",
            "step-rate",
            "Step rate",
            "steps / s",
            {p: _step_rate_series(by_policy[p]) for p in policies if by_policy.get(p)},
            policies,
        )
    )
    panels.append(
        _series_panel(
            "panel-participants",
            "participants",
            "Participating replica groups",
            "groups",
            {p: _participants_series(by_policy[p]) for p in policies if by_policy.get(p)},
            policies,
            step=True,
        )
    )
    step_time = _step_time_panel({p: by_policy[p] for p in policies if by_policy.get(p)})
    if step_time is not None:
        panels.append(step_time)
    # training and held-out loss by committed step (dashboards/quality.py)
    panels += loss_panels(records, {p: _color(p, policies) for p in policies})
    panels.append(_distribution_panel(summary, policies))
    panels.append(_recoveries_panel(summary, policies))
    title = f"ftharness recovery dashboard: {', '.join(jobs) or 'run'}"
    generated = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime())
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        # No network: forbid every fetch, allow only the inline style.
        '<meta http-equiv="Content-Security-Policy" content="default-src \'none\'; '
        "style-src 'unsafe-inline'; img-src data:\">"
        f"<title>{_e(title)}</title><style>{_CSS}</style></head><body>"
        f"<header><h1>{_e(title)}</h1><p>policies: {_e(', '.join(policies))} · "
        f"{len(records)} journal records · generated {generated}</p></header>"
        f"<main>{''.join(panels)}</main></body></html>\n"
    )


def write_dashboard(
    out_dir: str | Path, records: Sequence[Record], summary: Mapping[str, Any]
) -> Path:
    """Write ``out_dir/dashboard.html`` (creating ``out_dir``) and return its path."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "dashboard.html"
    path.write_text(render_dashboard(records, summary), encoding="utf-8")
    return path
