"""A provisionable Grafana dashboard over the Prometheus metrics the telemetry exports.

``build_dashboard()`` returns the dashboard model; ``dashboards/grafana_dashboard.json`` is its
output, checked in so users can provision it (drop it in a dashboards provider folder) or import
it, and regenerated with ``python -m dashboards.grafana > dashboards/grafana_dashboard.json``.
A test keeps the file equal to the generator's output.

The datasource is the templated variable ``DS_PROMETHEUS`` (type ``datasource``), so the same
JSON works when provisioned and when imported; ``job`` and ``policy`` variables filter by the
``ftharness_job`` / ``ftharness_policy`` labels. Every metric and label name comes from
``dashboards/names.py``, and a test checks each one against a real scrape of the exporter.
The panels mirror the HTML dashboard: goodput, step rate, participating groups, faults and
recoveries over time, recovery-time distributions per fault kind, in-place vs full_restart.
A recovery figure is called by its ``label`` from names.py and described by its description
there (the definitions are ``dashboards/metrics.py``'s, which the telemetry computes).
"""

from __future__ import annotations

import json
import sys
from typing import Any

from dashboards import names as N

UID = "ftharness-recovery"
SCHEMA_VERSION = 39
DATASOURCE = {"type": "prometheus", "uid": "${DS_PROMETHEUS}"}
_SEL = f'{N.LABEL_JOB}=~"$job", {N.LABEL_POLICY}=~"$policy"'
#: Only recoveries an injected fault explains: the like-for-like policy comparison.
_PLANNED = f'{N.LABEL_FAULT_KIND}!="{N.KIND_UNPLANNED}"'


def _sel(metric: str, extra: str = "") -> str:
    return f"{metric}{{{_SEL}{', ' + extra if extra else ''}}}"


def _title(m: N.MetricName) -> str:
    assert m.label is not None
    return m.label[0].upper() + m.label[1:]


def _target(
    expr: str, legend: str, ref: str = "A", *, instant: bool = False, fmt: str = "time_series"
) -> dict[str, Any]:
    return {
        "datasource": DATASOURCE,
        "refId": ref,
        "expr": expr,
        "legendFormat": legend,
        "instant": instant,
        "range": not instant,
        "format": fmt,
    }


def _quantile(
    q: float, metric: N.MetricName, by: str, window: str = "$__range", extra: str = ""
) -> str:
    return (
        f"histogram_quantile({q}, sum by (le, {by}) "
        f"(increase({_sel(metric.prom + '_bucket', extra)}[{window}])))"
    )


def _panel(
    pid: int,
    ptype: str,
    title: str,
    grid: tuple[int, int, int, int],
    targets: list[dict[str, Any]],
    *,
    unit: str = "short",
    description: str = "",
    options: dict[str, Any] | None = None,
    custom: dict[str, Any] | None = None,
) -> dict[str, Any]:
    x, y, w, h = grid
    return {
        "id": pid,
        "type": ptype,
        "title": title,
        "description": description,
        "datasource": DATASOURCE,
        "gridPos": {"x": x, "y": y, "w": w, "h": h},
        "targets": targets,
        "fieldConfig": {"defaults": {"unit": unit, "custom": custom or {}}, "overrides": []},
        "options": options or {},
    }


def build_dashboard() -> dict[str, Any]:
    """The dashboard model (a JSON-serialisable dict), deterministic for a given names.py."""
    pol = N.LABEL_POLICY
    kind = N.LABEL_FAULT_KIND
    stat_opts = {
        "reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
        "colorMode": "value",
        "graphMode": "area",
        "textMode": "value_and_name",
    }
    bar_opts = {
        "orientation": "horizontal",
        "displayMode": "gradient",
        "showUnfilled": True,
        "reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
    }
    participate, stall, detection = N.PARTICIPATE, N.SURVIVOR_STALL, N.DETECTION
    ts = {"drawStyle": "line", "lineWidth": 2, "fillOpacity": 10, "showPoints": "never"}
    bars = {"drawStyle": "bars", "fillOpacity": 80, "lineWidth": 1, "showPoints": "never"}
    panels = [
        _panel(
            1,
            "stat",
            "Goodput",
            (0, 0, 6, 5),
            [_target(f"avg by ({pol}) ({_sel(N.GOODPUT.prom)})", f"{{{{{pol}}}}}")],
            unit="percentunit",
            options=stat_opts,
            description=N.GOODPUT.description,
        ),
        _panel(
            2,
            "stat",
            "Committed steps",
            (6, 0, 6, 5),
            [_target(f"max by ({pol}) ({_sel(N.LAST_STEP.prom)})", f"{{{{{pol}}}}}")],
            options=stat_opts,
        ),
        _panel(
            3,
            "stat",
            "Faults injected",
            (12, 0, 6, 5),
            [_target(f"sum by ({pol}) ({_sel(N.FAULTS.prom)})", f"{{{{{pol}}}}}")],
            options=stat_opts,
        ),
        _panel(
            4,
            "stat",
            "Participating replica groups",
            (18, 0, 6, 5),
            [_target(f"max by ({pol}) ({_sel(N.PARTICIPANTS.prom)})", f"{{{{{pol}}}}}")],
            options=stat_opts,
        ),
        _panel(
            5,
            "timeseries",
            "Step rate",
            (0, 5, 12, 8),
            [
                _target(
                    f"sum by ({pol}) (rate({_sel(N.STEPS.prom)}[$__rate_interval])) / "
                    f"count by ({pol}) ({_sel(N.STEPS.prom)})",
                    f"{{{{{pol}}}}}",
                )
            ],
            unit="short",
            custom=ts,
            description="Committed steps per second, averaged over replica groups.",
        ),
        _panel(
            6,
            "timeseries",
            "Participating replica groups over time",
            (12, 5, 12, 8),
            [_target(f"max by ({pol}) ({_sel(N.PARTICIPANTS.prom)})", f"{{{{{pol}}}}}")],
            custom={**ts, "lineInterpolation": "stepAfter"},
        ),
        _panel(
            7,
            "timeseries",
            "Faults and recoveries over time",
            (0, 13, 24, 7),
            [
                _target(
                    f"sum by ({kind}) (increase({_sel(N.FAULTS.prom)}[$__rate_interval]))",
                    f"fault {{{{{kind}}}}}",
                    "A",
                ),
                _target(
                    f"sum by ({N.LABEL_CAUSE}) "
                    f"(increase({_sel(N.FAILURES.prom)}[$__rate_interval]))",
                    f"failure {{{{{N.LABEL_CAUSE}}}}}",
                    "B",
                ),
                _target(
                    f"sum by ({kind}) (increase("
                    f"{_sel(participate.prom + '_count')}[$__rate_interval]))",
                    f"recovered {{{{{kind}}}}}",
                    "C",
                ),
            ],
            custom=bars,
            description=(
                "Faults injected, failures detected and recoveries completed (the failed "
                "group committing again)."
            ),
        ),
        _panel(
            8,
            "bargauge",
            f"{_title(participate)} by fault kind (p50, p95)",
            (0, 20, 12, 8),
            [
                _target(
                    _quantile(0.5, participate, f"{kind}, {pol}"),
                    f"p50 {{{{{kind}}}}} {{{{{pol}}}}}",
                    "A",
                    instant=True,
                ),
                _target(
                    _quantile(0.95, participate, f"{kind}, {pol}"),
                    f"p95 {{{{{kind}}}}} {{{{{pol}}}}}",
                    "B",
                    instant=True,
                ),
            ],
            unit="s",
            options=bar_opts,
            description=participate.description + ".",
        ),
        _panel(
            9,
            "bargauge",
            f"{_title(stall)} and {detection.label} by fault kind (p50)",
            (12, 20, 12, 8),
            [
                _target(
                    _quantile(0.5, stall, f"{kind}, {pol}"),
                    f"{stall.label} {{{{{kind}}}}} {{{{{pol}}}}}",
                    "A",
                    instant=True,
                ),
                _target(
                    _quantile(0.5, detection, f"{kind}, {pol}"),
                    f"{detection.label} {{{{{kind}}}}} {{{{{pol}}}}}",
                    "B",
                    instant=True,
                ),
            ],
            unit="s",
            options=bar_opts,
            description=f"{stall.description}. {detection.description}.",
        ),
        _panel(
            10,
            "heatmap",
            f"{_title(participate)} per recovery (distribution)",
            (0, 28, 12, 8),
            [
                _target(
                    f"sum by (le) (increase("
                    f"{_sel(participate.prom + '_bucket')}[$__rate_interval]))",
                    "{{le}}",
                    fmt="heatmap",
                )
            ],
            unit="s",
            options={
                "calculate": False,
                "yAxis": {"unit": "s"},
                "cellGap": 1,
                "color": {"scheme": "Oranges"},
            },
            description=participate.description + ".",
        ),
        _panel(
            11,
            "bargauge",
            "In-place vs full restart",
            (12, 28, 12, 8),
            [
                _target(
                    _quantile(0.5, participate, pol, extra=_PLANNED),
                    f"{participate.label} p50 {{{{{pol}}}}}",
                    "A",
                    instant=True,
                ),
                _target(
                    _quantile(0.5, stall, pol, extra=_PLANNED),
                    f"{stall.label} p50 {{{{{pol}}}}}",
                    "B",
                    instant=True,
                ),
            ],
            unit="s",
            options=bar_opts,
            description=(
                "Median recovery times per policy over the dashboard range, over the recoveries "
                "of injected faults (as report.md's comparison)."
            ),
        ),
        _panel(
            12,
            "timeseries",
            "Step time (p50, p95)",
            (0, 36, 12, 8),
            [
                _target(
                    _quantile(0.5, N.STEP_DURATION, pol, "$__rate_interval"),
                    f"p50 {{{{{pol}}}}}",
                    "A",
                ),
                _target(
                    _quantile(0.95, N.STEP_DURATION, pol, "$__rate_interval"),
                    f"p95 {{{{{pol}}}}}",
                    "B",
                ),
            ],
            unit="s",
            custom=ts,
        ),
        _panel(
            13,
            "bargauge",
            "Failures by cause",
            (12, 36, 12, 8),
            [
                _target(
                    f"sum by ({N.LABEL_CAUSE}) (increase({_sel(N.FAILURES.prom)}[$__range]))",
                    f"{{{{{N.LABEL_CAUSE}}}}}",
                    instant=True,
                )
            ],
            options=bar_opts,
        ),
        _panel(
            14,
            "timeseries",
            "Goodput over time",
            (0, 44, 24, 7),
            [_target(f"avg by ({pol}) ({_sel(N.GOODPUT.prom)})", f"{{{{{pol}}}}}")],
            unit="percentunit",
            custom=ts,
        ),
        _panel(
            15,
            "timeseries",
            "Held-out loss",
            (0, 51, 24, 7),
            [_target(f"min by ({pol}) ({_sel(N.HELDOUT_LOSS.prom)})", f"{{{{{pol}}}}}")],
            custom=ts,
            description=N.HELDOUT_LOSS.description + ' (data.kind = "tokens").',
        ),
    ]

    def query_var(name: str, label: str, metric: str, multi: bool) -> dict[str, Any]:
        return {
            "name": name,
            "label": name,
            "type": "query",
            "datasource": DATASOURCE,
            "query": {"query": f"label_values({metric}, {label})", "refId": f"{name}-var"},
            "definition": f"label_values({metric}, {label})",
            "refresh": 2,
            "multi": multi,
            "includeAll": True,
            "allValue": ".*",
            "current": {"text": "All", "value": "$__all"},
            "sort": 1,
        }

    return {
        "uid": UID,
        "title": "ftharness recovery",
        "description": "Fault injection and recovery of an ftharness training job.",
        "tags": ["ftharness", "fault-tolerance", "training"],
        "schemaVersion": SCHEMA_VERSION,
        "version": 1,
        "editable": True,
        "graphTooltip": 1,
        "refresh": "5s",
        "time": {"from": "now-30m", "to": "now"},
        "timepicker": {},
        "timezone": "browser",
        "annotations": {"list": []},
        "links": [],
        "templating": {
            "list": [
                {
                    "name": "DS_PROMETHEUS",
                    "label": "Prometheus",
                    "type": "datasource",
                    "query": "prometheus",
                    "current": {},
                    "hide": 0,
                    "refresh": 1,
                    "regex": "",
                },
                query_var("job", N.LABEL_JOB, N.STEPS.prom, False),
                query_var("policy", N.LABEL_POLICY, N.STEPS.prom, True),
            ]
        },
        "panels": panels,
    }


def render() -> str:
    """The dashboard as the exact text of ``grafana_dashboard.json``."""
    return json.dumps(build_dashboard(), indent=2, sort_keys=True) + "\n"


if __name__ == "__main__":
    sys.stdout.write(render())
