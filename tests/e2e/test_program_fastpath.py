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
from e2e_helpers import run_chaos

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
    recs = report["summary"]["policies"]["in_place"]["recoveries"]
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
