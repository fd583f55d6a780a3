"""The fast path for a program of the user's own (issue #29 items 1-2): an unmodified torchft
program with torchft's default 60 s process-group timeout, started warm by default, loses a
group six times; no survivor waits out a timeout and every replacement is back in well under
a cold start.

Without the agents unblocking the survivors (runtime/sockets.py), about one kill in three
leaves a survivor blocked on another survivor until torchft's Manager timeout (10 s here,
``timeouts.manager_timeout``); with a cold start, a replacement takes 5-15 s on this machine.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from e2e_helpers import events, fault_recoveries, run_chaos

pytestmark = [pytest.mark.e2e]

ROOT = Path(__file__).resolve().parents[2]
PROGRAM = ROOT / "tests" / "programs" / "train_ddp.py"
STEPS = 120  # the last kill at step 85 leaves the replacement 35 steps to rejoin

EXPERIMENT = f"""
name = "program_fastpath"
seed = 5
policies = ["in_place"]
steps = {STEPS}
duration_s = 120

[job]
name = "program_fastpath"
replicas = 3
ranks = 1
hosts = 1
steps = {STEPS}
timeouts = {{ heartbeat_interval = 0.2, heartbeat_timeout = 2.0, process_group_timeout = 4.0 }}
recovery = {{ policy = "in_place", quorum = "tree", max_restarts = 20, within_s = 600.0 }}

[job.program]
command = ["python", {json.dumps(str(PROGRAM))}, "{STEPS}", "0", "60"]
progress_timeout_s = 30.0

[schedule]
kind = "at_steps"
at_steps = [10, 25, 40, 55, 70, 85]

[faults]
mix = {{ kill = 1 }}

[targets]
kind = "default"

[hypotheses]
every_fault_recovered = true
"""


@pytest.mark.timeout(150)
def test_survivors_never_wait_out_a_timeout_and_replacements_start_warm(tmp_path):
    (tmp_path / "exp.toml").write_text(EXPERIMENT)
    report, out = run_chaos(tmp_path, ROOT)
    assert "starts cold" not in out, out[-3000:]  # python SCRIPT: warm by default
    run = tmp_path / "run" / "in_place"
    recs = fault_recoveries(run, report["summary"]["policies"]["in_place"]["recoveries"])
    assert len(recs) == 6, recs
    for r in recs:
        assert r["stall_s"] is not None and r["stall_s"] < 5.0, (r, out[-3000:])
        assert r["participate_s"] is not None and r["participate_s"] < 8.0, r


@pytest.mark.timeout(120)
def test_a_program_asked_for_more_steps_than_the_job_ends_at_the_jobs_last_step(tmp_path):
    """Seen by a new user: the tree quorum refuses a step past the job's ``steps``; the groups
    that ask for one are done (not hung, not restarted in a loop) and the job ends ok."""
    argv = [
        sys.executable,
        "-m",
        "harness",
        "run",
        "experiments/tiny.toml",
        "--out",
        str(tmp_path / "run"),
        "--set",
        "replicas=2",
        "--set",
        "steps=20",
        "--set",
        "recovery.quorum=tree",
        "--set",
        f'program.command=["python", {json.dumps(str(PROGRAM))}, "40"]',
    ]
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=110)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-4000:]
    assert "past the job's last step 20: it is done" in out, out[-4000:]
    assert "ok" in out and "0 recoveries" in out, out[-2000:]


BLOCKED_STEPS = 300  # the wedged group's replacement rejoins long before the last step
WEDGED = 1  # train_ddp.py's TRAIN_DDP_WEDGE_GROUP

BLOCKED = f"""
name = "program_blocked_survivor"
seed = 1                              # the kill hits group 0 (the test checks)
policies = ["in_place"]
steps = {BLOCKED_STEPS}
duration_s = 120

[job]
name = "program_blocked_survivor"
replicas = 3
ranks = 1
hosts = 1
steps = {BLOCKED_STEPS}
timeouts = {{ heartbeat_interval = 0.2, heartbeat_timeout = 2.0, process_group_timeout = 4.0 }}
recovery = {{ policy = "in_place", quorum = "tree", max_restarts = 20, within_s = 600.0 }}

[job.program]
command = ["python", {json.dumps(str(PROGRAM))}, "{BLOCKED_STEPS}", "0", "60"]
env = {{ TRAIN_DDP_WEDGE_GROUP = "{WEDGED}" }}
progress_timeout_s = 60.0

[schedule]
kind = "at_steps"
at_steps = [30]

[faults]
mix = {{ kill = 1 }}

[targets]
kind = "replica"
replicas = [0]

[hypotheses]
every_fault_recovered = true
"""


@pytest.mark.timeout(150)
def test_a_survivor_that_never_asks_again_after_a_death_is_restarted_not_waited_for(tmp_path):
    """Group 0 is killed; group 1's rank then does what gloo leaves behind when it loses the
    error of a send to the dead group (runtime/sockets.py): it waits, with no connection left,
    and never asks for another quorum (train_ddp.py's TRAIN_DDP_WEDGE_GROUP stands for it:
    nothing from outside can wake it). It is failed after
    program.survivor_grace_s (2 s), not after the 60 s progress timeout or its
    60 s process-group timeout, and restarted; group 2 is not touched."""
    (tmp_path / "exp.toml").write_text(BLOCKED)
    report, out = run_chaos(tmp_path, ROOT)
    run = tmp_path / "run" / "in_place"
    assert f"train_ddp: group {WEDGED} wedged at step" in out, out[-3000:]
    injected = [r["target"]["replica"] for r in events(run, "fault.inject")]
    assert injected == [0], injected
    failures = [f for f in events(run, "failure") if not f.get("fatal")]
    assert [f["replica"] for f in failures] == [0, WEDGED], failures
    detail = failures[1]["detail"]
    assert f"replica group {WEDGED} asked for no quorum for" in detail, detail
    assert "after replica group 0 died" in detail, detail
    # both recoveries are the kill's: the wedged survivor's is explained by the death that left
    # it blocked
    recs = report["summary"]["policies"]["in_place"]["recoveries"]
    assert [(r["kind"], r["replica"], r["cause"]) for r in recs] == [
        ("kill", 0, "signal"),
        ("kill", WEDGED, "blocked_survivor"),
    ], recs
    assert all(r["participate_s"] is not None for r in recs), recs
