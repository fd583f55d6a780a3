"""The "model unharmed" hypothesis and the loss curves, from journal records made here."""

from __future__ import annotations

import json

import pytest

from dashboards.html import render_dashboard
from dashboards.metrics import summarize
from dashboards.quality import SMOOTHING, fault_steps, heldout_curves, train_curves
from experiments.report import write_report
from experiments.report_quality import heldout_hypothesis, heldout_summary, render_heldout
from experiments.spec import parse_hypotheses


def _run(policy, losses, *, t0=0.0, control_run=None, steps=(0, 50, 100, 150)):
    stamp = {"job": "q", "policy": policy}
    if control_run is not None:
        stamp["control_run"] = control_run
    out = [{"t": t0, "event": "job.start", **stamp, "config": {}, "replicas": 2, "ranks": 1}]
    for i, (step, loss) in enumerate(zip(steps, losses, strict=True)):
        t = t0 + 1 + i
        out.append({"t": t, "event": "eval", **stamp, "replica": 0, "rank": 0, "step": step,
                    "heldout_loss": loss})  # fmt: skip
        if step:
            for replica in (0, 1):
                commit = {"replica": replica, "rank": 0, "step": step, "loss": loss + replica}
                out.append({"t": t - 0.5, "event": "step.commit", **stamp, **commit, "samples": 8})
    out.append({"t": t0 + 9, "event": "job.end", **stamp, "status": "ok", "reason": "", "steps": 0})
    return out


CONTROL = [
    *_run("control", [8.0, 6.0, 5.0, 4.5], control_run=1),
    *_run("control", [8.0, 6.01, 5.0], control_run=2, t0=20, steps=(0, 50, 100)),
]


def test_a_policy_within_tolerance_passes_and_one_outside_fails():
    records = [*CONTROL, *_run("in_place", [8.0, 6.0, 5.04, 4.5], t0=40)]
    s = heldout_summary(records)
    assert s["control"]["spread"] == pytest.approx(0.01 / 6.005)
    assert s["control"]["drop"] == pytest.approx(1 - 4.5 / 8.0)
    g = s["policies"]["in_place"]
    assert g["common_steps"] == 4 and g["at_step"] == 100
    assert g["max_gap"] == pytest.approx(0.04 / 5.0)
    ok = heldout_hypothesis(0.01, "in_place", s)
    assert ok["passed"] and "0.80 %" in ok["detail"] and "bound 0.01" in ok["detail"]
    bad = heldout_hypothesis(0.005, "in_place", s)
    assert not bad["passed"] and "step 100" in bad["detail"]


def test_the_controls_spread_widens_the_tolerance_when_larger_and_says_so():
    noisy = [*CONTROL[:-1], *_run("control", [8.0, 6.3, 5.0], control_run=2, t0=20,
                                  steps=(0, 50, 100))]  # fmt: skip
    records = [*noisy, *_run("in_place", [8.0, 6.2, 5.0, 4.5], t0=40)]
    s = heldout_summary(records)
    r = heldout_hypothesis(0.01, "in_place", s)
    assert r["passed"] and "the control's spread" in r["detail"]


def test_no_common_step_or_no_eval_is_not_a_pass():
    records = [*CONTROL, *_run("in_place", [7.0], t0=40, steps=(75,))]
    s = heldout_summary(records)
    assert not heldout_hypothesis(0.01, "in_place", s)["passed"]
    assert not heldout_hypothesis(0.01, "full_restart", s)["passed"]
    assert heldout_summary([r for r in records if r["event"] != "eval"]) is None


def test_a_redone_step_counts_its_later_evaluation():
    run = _run("full_restart", [8.0, 6.0, 5.0, 4.5], t0=40)
    run.append({"t": 60, "event": "eval", "job": "q", "policy": "full_restart", "replica": 0,
                "rank": 0, "step": 100, "heldout_loss": 5.2})  # fmt: skip
    assert heldout_curves(run)["full_restart"][100] == 5.2


def test_training_curve_is_the_groups_mean_smoothed_and_faults_sit_on_the_step_axis():
    run = _run("in_place", [8.0, 6.0, 5.0, 4.5], t0=40)
    run.append({"t": 42.7, "event": "fault.inject", "job": "q", "policy": "in_place",
                "fault_id": "f1", "kind": "kill"})  # fmt: skip
    (pts,) = train_curves(run).values()
    assert pts[0] == (50, 6.5)  # mean of the two groups (6.0 and 7.0)
    assert pts[1] == (100, pytest.approx(6.5 + SMOOTHING * (5.5 - 6.5)))
    assert fault_steps(run) == {"in_place": [100]}


def test_the_report_and_the_dashboard_show_it(tmp_path):
    records = [*CONTROL, *_run("in_place", [8.0, 6.0, 5.04, 4.5], t0=40)]
    hyps = parse_hypotheses({"heldout_loss_within": {"in_place": 0.01}})
    report = write_report(tmp_path, records, hyps)
    (result,) = [h for h in report["hypotheses"] if h["name"].startswith("heldout")]
    assert result["passed"]
    md = (tmp_path / "report.md").read_text()
    assert "## Held-out loss" in md and "| in_place | 8.0000 (step 0) | 4.5000 (step 150)" in md
    assert json.loads((tmp_path / "report.json").read_text())["summary"]["heldout"]
    lines = render_heldout(report["summary"]["heldout"])
    assert any(line.startswith("| control-1 |") for line in lines)
    page = render_dashboard(records, summarize(records))
    assert 'data-panel="heldout-loss"' in page and 'data-panel="training-loss"' in page
    assert page.count('class="series" data-policy="control-') == 4  # 2 pieces x 2 panels
