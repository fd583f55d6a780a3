"""A program with a bug of its own is named, not restarted in a loop: tests/programs/
fails_at_start.py fails the same way at every start; the job ends after a few tries with the
exception, its last frame and a hint on the console and in ``job.end``. (That an injected fault
is never taken for the program's own is shown by every chaos test of a program: a false crash
loop would end those jobs.)"""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
from e2e_helpers import events

pytestmark = [pytest.mark.e2e]

ROOT = Path(__file__).resolve().parents[2]
PROGRAM = ROOT / "tests" / "programs" / "fails_at_start.py"


@pytest.mark.timeout(180)
def test_a_program_that_fails_at_every_start_ends_the_job_with_its_cause(tmp_path):
    run = tmp_path / "run"
    done = subprocess.run(
        [
            sys.executable, "-m", "harness", "run", "experiments/tiny.toml", "--out", str(run),
            "--set", "replicas=2", "--set", "ranks=2",
            "--set", f"program.command={json.dumps(['python', str(PROGRAM)])}",
        ],
        cwd=ROOT, capture_output=True, text=True, timeout=150,
    )  # fmt: skip
    out = done.stdout + done.stderr
    assert done.returncode != 0, out[-4000:]
    said = "the program fails the same way every time, so ftharness stopped restarting it"
    assert said in out, out[-4000:]
    assert "ModuleNotFoundError: No module named 'model_code_that_is_not_installed'" in out
    assert "last frame: fails_at_start.py:12 in main" in out
    assert "hint: a module the program imports is not importable" in out
    (end,) = events(run, "job.end")
    assert end["status"] == "failed" and said in end["reason"], end
    assert "at start (before its first quorum)" in end["reason"]
    # each group was tried at most three times (restart intensity would allow 10)
    tries = Counter(p["replica"] for p in events(run, "proc.start") if p["rank"] == 0)
    assert tries and max(tries.values()) <= 3, tries
    assert "restart intensity exceeded" not in end["reason"]
