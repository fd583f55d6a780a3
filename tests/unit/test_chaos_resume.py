"""``ftharness chaos --resume``: an experiment whose ``ftharness chaos`` process died with its
node (its run finished by a standby on another node, ``harness.keeper.standby_node``) is finished
from its directory: runs that ended are kept, the rest run, then the experiment's report. And
the standby's command for it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from harness.keeper.standby_node import _finish_command

ROOT = Path(__file__).resolve().parents[2]

EXPERIMENT = f"""name = "resumed"
seed = 1
duration_s = 30
policies = ["in_place"]
job = "{ROOT / "experiments" / "tiny.toml"}"
[schedule]
kind = "at_times"
at_times = [10]
[faults]
mix = {{ kill = 1 }}
[hypotheses]
committed_steps_rise = true
journal_complete = true
no_orphans = true
"""


def _ended_run(run: Path) -> None:
    """A run a standby finished: a sound journal with its job.end, no postrun.json."""
    run.mkdir(parents=True)
    stamp = {"job": "resumed", "policy": "in_place"}
    fault = {"fault_id": "f0", "kind": "kill", **stamp}
    commit = {"event": "step.commit", "replica": 0, "rank": 0, "loss": 2.0, "samples": 8}
    lines = [
        {"t": 1.0, "event": "job.start", "config": {}, **stamp},
        *({"t": 1.0 + s / 10, "step": s, **commit, **stamp} for s in range(1, 30)),
        {"t": 2.0, "event": "fault.inject", "target": {"replica": 1}, **fault},
        {"t": 2.1, "event": "fault.heal", **fault},
        {"t": 5.0, "event": "job.end", "status": "ok", "reason": "ran for its duration",
         "steps": 29, **stamp},
    ]  # fmt: skip
    (run / "journal.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))


def _chaos(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "harness", "chaos", *args],
        capture_output=True, text=True, timeout=120, cwd=ROOT,
    )  # fmt: skip


def test_resume_keeps_an_ended_run_checks_what_it_left_and_writes_the_report(tmp_path: Path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "experiment.toml").write_text(EXPERIMENT)
    _ended_run(out / "in_place")
    done = _chaos(str(out / "experiment.toml"), "--out", str(out), "--resume", "--quiet")
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "in_place: ok (ran for its duration), 29 steps, 1 faults fired" in done.stdout
    assert "=== resumed: in_place ===" not in done.stderr  # not run again
    checked = json.loads((out / "in_place" / "postrun.json").read_text())
    assert checked["orphans"] == [] and checked["policy"] == "in_place"
    report = json.loads((out / "report.json").read_text())
    assert {h["name"]: h["passed"] for h in report["hypotheses"]} == {
        "committed_steps_rise[in_place]": True,
        "journal_complete[in_place]": True,
        "no_orphans[in_place]": True,
    }


def test_resume_needs_a_directory_an_earlier_chaos_started(tmp_path: Path):
    (tmp_path / "exp.toml").write_text(EXPERIMENT)
    done = _chaos(str(tmp_path / "exp.toml"), "--out", str(tmp_path / "nothing"), "--resume")
    assert done.returncode == 2 and "--resume needs --out naming an experiment" in done.stderr
    assert not (tmp_path / "nothing").exists()


def test_the_standby_finishes_a_chaos_experiment_and_reports_a_plain_run(tmp_path: Path):
    run = tmp_path / "in_place"
    run.mkdir()
    (run / "job.json").write_text(json.dumps({"config": {}}))
    assert _finish_command(run)[-2:] == ["report", str(run)]
    hook = {"args": {"experiment": "/x/exp.toml", "overrides": ["launcher=slurm"]}}
    (run / "job.json").write_text(json.dumps({"config": {}, "hook": hook}))
    assert _finish_command(run)[-2:] == ["report", str(run)]  # no experiment directory
    (tmp_path / "experiment.toml").write_text(EXPERIMENT)
    assert _finish_command(run)[3:] == [
        "chaos", "/x/exp.toml", "--out", str(tmp_path), "--resume", "--quiet",
        "--launcher", "slurm",
    ]  # fmt: skip
