"""The Grafana dashboard JSON: the structure Grafana expects, and only metric names the exporter
really emits (checked against a live scrape of the Prometheus exporter fed with a journal)."""

from __future__ import annotations

import json
import re
import urllib.request
from pathlib import Path

import pytest
from journal_scenario import scenario
from prometheus_client.parser import text_string_to_metric_families

from dashboards import grafana
from dashboards import names as N
from dashboards.telemetry import Telemetry

JSON_PATH = Path(grafana.__file__).with_name("grafana_dashboard.json")
PANEL_TYPES = {
    "timeseries",
    "stat",
    "bargauge",
    "heatmap",
    "histogram",
    "gauge",
    "table",
    "text",
    "row",
    "barchart",
    "state-timeline",
}
PROMQL_WORDS = {
    "sum",
    "avg",
    "max",
    "min",
    "count",
    "by",
    "without",
    "rate",
    "increase",
    "histogram_quantile",
    "le",
    "label_values",
    "irate",
    "on",
    "ignoring",
}


@pytest.fixture(scope="module")
def scrape() -> dict[str, set[str]]:
    """Series name -> label names, from a real scrape after feeding both policies' records."""
    tel = Telemetry("grafana-test", prometheus_port=0)
    try:
        for policy, t0 in (("in_place", 1.7e9), ("full_restart", 1.7e9 + 100)):
            for r in scenario(job="grafana-test", policy=policy, t0=t0):
                tel.sink(r)
            held_out = {"step": 0, "replica": 0, "rank": 0, "heldout_loss": 7.5}
            tel.sink(
                {"t": t0, "event": "eval", "job": "grafana-test", "policy": policy, **held_out}
            )
        host, port = tel.prometheus_address
        text = urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=10).read().decode()
    finally:
        tel.shutdown()
    series: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            series.setdefault(sample.name, set()).update(sample.labels)
    return series


def _exprs(dashboard: dict) -> list[str]:
    out = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    out += [v["definition"] for v in dashboard["templating"]["list"] if v.get("definition")]
    return out


def _metric_names(expr: str) -> set[str]:
    """Metric names in a PromQL expression: identifiers outside {...} and by (...) clauses."""
    bare = re.sub(r"\{[^}]*\}", "", expr)
    bare = re.sub(r"\b(by|without)\s*\([^)]*\)", "", bare)
    bare = re.sub(r"\[[^\]]*\]", "", bare)
    bare = re.sub(r"label_values\((\w+),\s*\w+\)", r"\1", bare)
    names = set(re.findall(r"[a-zA-Z_:][a-zA-Z0-9_:]*", bare)) - PROMQL_WORDS
    return {n for n in names if not n.startswith("__")}


def _label_names(expr: str) -> set[str]:
    labels = set()
    for inside in re.findall(r"\{([^}]*)\}", expr):
        labels |= set(re.findall(r"(\w+)\s*!?=~?", inside))
    for inside in re.findall(r"\b(?:by|without)\s*\(([^)]*)\)", expr):
        labels |= {x.strip() for x in inside.split(",") if x.strip()}
    labels |= set(re.findall(r"label_values\(\w+,\s*(\w+)\)", expr))
    return labels


def test_checked_in_json_is_the_generators_output():
    assert JSON_PATH.read_text() == grafana.render(), (
        "regenerate: python -m dashboards.grafana > dashboards/grafana_dashboard.json"
    )


def test_structure_grafana_expects():
    d = json.loads(JSON_PATH.read_text())
    assert isinstance(d["schemaVersion"], int) and d["schemaVersion"] >= 36
    assert d["uid"] and d["title"]
    variables = {v["name"]: v for v in d["templating"]["list"]}
    assert variables["DS_PROMETHEUS"]["type"] == "datasource"
    assert variables["DS_PROMETHEUS"]["query"] == "prometheus"
    ids = [p["id"] for p in d["panels"]]
    assert len(ids) == len(set(ids)) and len(ids) >= 10
    cells: set[tuple[int, int]] = set()
    for p in d["panels"]:
        assert p["type"] in PANEL_TYPES, p["type"]
        g = p["gridPos"]
        assert all(isinstance(g[k], int) for k in ("x", "y", "w", "h"))
        assert g["w"] > 0 and g["h"] > 0 and g["x"] + g["w"] <= 24
        mine = {
            (x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])
        }
        assert not (mine & cells), f"panel {p['id']} overlaps another"
        cells |= mine
        assert p["targets"], f"panel {p['id']} has no query"
        refs = [t["refId"] for t in p["targets"]]
        assert len(refs) == len(set(refs))
        for t in p["targets"] + [p]:
            assert t["datasource"] == {"type": "prometheus", "uid": "${DS_PROMETHEUS}"}
        for t in p["targets"]:
            assert t["expr"].count("(") == t["expr"].count(")")
    for name in ("job", "policy"):
        assert variables[name]["datasource"]["uid"] == "${DS_PROMETHEUS}"
    titles = " ".join(p["title"].lower() for p in d["panels"])
    for needle in (
        "goodput",
        "step rate",
        "participating",
        "fault",
        "recovery",
        "in-place vs full restart",
        "stall",
    ):
        assert needle in titles


def test_every_metric_and_label_referenced_is_exported(scrape):
    exported_labels = set().union(*scrape.values()) | {"le"}
    used = set()
    for expr in _exprs(grafana.build_dashboard()):
        names = _metric_names(expr)
        assert names, expr
        missing = names - set(scrape)
        assert not missing, f"{missing} in {expr!r} not among exported {sorted(scrape)}"
        used |= names
        assert _label_names(expr) <= exported_labels, expr
    # the dashboard covers the recovery metrics, not just a couple of them
    for m in (
        N.PARTICIPATE,
        N.SURVIVOR_STALL,
        N.DETECTION,
        N.GOODPUT,
        N.PARTICIPANTS,
        N.STEPS,
        N.FAULTS,
        N.FAILURES,
        N.STEP_DURATION,
    ):
        assert any(u.startswith(m.prom) for u in used), m.prom


def test_names_module_derives_what_the_exporter_emits(scrape):
    for m in N.ALL_METRICS:
        for series in N.prometheus_series(m):
            assert series in scrape, f"{m.otel} -> {series} not exported"
    assert {N.LABEL_JOB, N.LABEL_POLICY, N.LABEL_REPLICA} <= scrape[N.STEPS.prom]
    assert N.LABEL_FAULT_KIND in scrape[N.PARTICIPATE.prom + "_count"]


def test_only_names_from_names_py_and_each_figure_under_its_label():
    """Every series and label the dashboard queries is one names.py derives (no name spelled
    by hand), and a panel that shows a recovery figure's values calls it by its names.py label
    (the same label report.md and the HTML dashboard use)."""
    series = {s for m in N.ALL_METRICS for s in N.prometheus_series(m)}
    labels = {
        N.LABEL_JOB,
        N.LABEL_POLICY,
        N.LABEL_REPLICA,
        N.LABEL_FAULT_KIND,
        N.LABEL_CAUSE,
        "le",
    }
    d = grafana.build_dashboard()
    for expr in _exprs(d):
        assert _metric_names(expr) <= series, expr
        assert _label_names(expr) <= labels, expr
    for p in d["panels"]:
        text = " ".join([p["title"], *(t["legendFormat"] for t in p["targets"])]).lower()
        for m in N.RECOVERY_METRICS:
            if any(m.prom + "_bucket" in t["expr"] for t in p["targets"]):
                assert m.label in text, (p["title"], m.label)
    for m in N.RECOVERY_METRICS:
        assert m.quantity in ("detection_s", "stall_s", "participate_s") and m.label
