"""experiments.report: hypotheses judged from a hand-written journal, the written report, and
``ftharness report`` run as a user runs it (exit status 1 when a hypothesis fails)."""

from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
from test_metrics import write_full_restart, write_in_place  # the hand-written journal

from dashboards.metrics import summarize
from experiments.report import evaluate_hypotheses, render_markdown, write_report
from experiments.spec import Hypotheses
from runtime.journal import Journal, read_journal

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def run_dir(tmp_path):
    a = Journal(tmp_path / "in_place.jsonl", job="t", policy="in_place")
    write_in_place(a)
    a.close()
    b = Journal(tmp_path / "full_restart.jsonl", job="t", policy="full_restart")
    write_full_restart(b)
    b.close()
    return tmp_path


def by_name(results):
    return {r["name"]: r for r in results}


def test_hypotheses_pass_and_fail_on_the_numbers(run_dir):
    records = read_journal(run_dir)
    hyp = Hypotheses(
        loss_finite=True,
        committed_steps_rise=True,
        replicas_equal_after_heal=True,
        thresholds={
            "goodput_min": {"in_place": 0.75, "full_restart": 0.6},  # 0.784 and 0.583
            "recovery_p95_max_s": {"*": 3.0},  # 2.7 and 3.5
            "steps_lost_max": {"full_restart": 2},  # 2
        },
    )
    res = by_name(evaluate_hypotheses(hyp, summarize(records), records))
    for policy in ("in_place", "full_restart"):
        assert res[f"loss_finite[{policy}]"]["passed"]
        assert res[f"committed_steps_rise[{policy}]"]["passed"]
        assert res[f"replicas_equal_after_heal[{policy}]"]["passed"]
    assert res["goodput_min[in_place]"]["passed"]
    assert not res["goodput_min[full_restart]"]["passed"]
    assert "0.583" in res["goodput_min[full_restart]"]["detail"]
    assert res["recovery_p95_max_s[in_place]"]["passed"]
    assert not res["recovery_p95_max_s[full_restart]"]["passed"]
    assert "3.5" in res["recovery_p95_max_s[full_restart]"]["detail"]
    assert res["steps_lost_max[full_restart]"]["passed"]


def test_a_nan_loss_a_checksum_mismatch_and_no_progress_fail(tmp_path):
    j = Journal(tmp_path / "j.jsonl", job="t")
    for step, loss in [(1, 2.0), (2, math.nan)]:
        j.emit("step.commit", t=float(step), replica=0, rank=0, step=step, loss=loss, checksum="a")
        j.emit(
            "step.commit",
            t=float(step),
            replica=1,
            rank=0,
            step=step,
            loss=loss,
            checksum="a" if step == 1 else "b",
        )
    j.emit(
        "fault.inject",
        t=2.5,
        fault_id="f000",
        kind="kill",
        target={"replica": 1, "rank": 0, "host": "h"},
        seed=0,
    )
    j.close()
    records = read_journal(tmp_path / "j.jsonl")
    hyp = Hypotheses(loss_finite=True, committed_steps_rise=True, replicas_equal_after_heal=True)
    res = by_name(evaluate_hypotheses(hyp, summarize(records), records))
    assert not res["loss_finite[in_place]"]["passed"]
    assert "step 2 loss nan" in res["loss_finite[in_place]"]["detail"]
    assert not res["replicas_equal_after_heal[in_place]"]["passed"]
    assert "step 2" in res["replicas_equal_after_heal[in_place]"]["detail"]
    assert not res["committed_steps_rise[in_place]"]["passed"]
    assert "f000 (kill)" in res["committed_steps_rise[in_place]"]["detail"]


def test_write_report_files(run_dir):
    report = write_report(run_dir, read_journal(run_dir), Hypotheses(loss_finite=True))
    assert report["passed"]
    on_disk = json.loads((run_dir / "report.json").read_text())
    assert on_disk["summary"]["policies"]["in_place"]["faults"]["kill"]["count"] == 1
    assert on_disk["summary"]["comparison"]["stall_s_ratio"] == pytest.approx(2.0)
    md = (run_dir / "report.md").read_text()
    assert (
        "| kill | 1 | 1 | 0.20 / 0.20 / 0.20 | 1.50 / 1.50 / 1.50 | 2.70 / 2.70 / 2.70 | 0 |" in md
    )
    assert "survivor stall: x2" in md
    assert render_markdown(report["summary"], []) in md or "Hypotheses" in md


def ftharness_report(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "harness", "report", *args],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
    )  # fmt: skip


@pytest.mark.timeout(120)
def test_cli_exit_status_follows_the_hypotheses(run_dir, tmp_path):
    (run_dir / "experiment.toml").write_text(
        "[hypotheses]\nloss_finite = true\ngoodput_min = { in_place = 0.5 }\n"
    )
    ok = ftharness_report(str(run_dir), "--json")
    assert ok.returncode == 0, ok.stderr
    out = json.loads(ok.stdout)
    assert out["passed"] and out["summary"]["policies"]["in_place"]["committed_steps"] == 8

    (run_dir / "experiment.toml").write_text("[hypotheses]\ngoodput_min = 0.9\n")
    failed = ftharness_report(str(run_dir))
    assert failed.returncode == 1, failed.stderr
    assert "goodput_min[full_restart]" in failed.stdout and "FAILED" in failed.stdout
    assert (run_dir / "report.md").is_file()

    empty = tmp_path / "empty"
    empty.mkdir()
    nothing = ftharness_report(str(empty))
    assert nothing.returncode == 2 and "no journal records" in nothing.stderr


@pytest.mark.timeout(120)
def test_cli_html_writes_the_dashboard(run_dir):
    done = ftharness_report(str(run_dir), "--html")
    assert done.returncode == 0, done.stderr
    if importlib.util.find_spec("dashboards.html") is None:
        assert "HTML dashboard unavailable" in done.stderr
    else:
        assert (run_dir / "dashboard.html").stat().st_size > 0
        assert "dashboard.html" in done.stdout
