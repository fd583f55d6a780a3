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


def _failed_run(tmp_path: Path, command: list[str], *sets: str, timeout: float) -> tuple[Path, str]:
    """``ftharness run`` of a 2 groups x 2 ranks job of ``command`` (in ``tmp_path``), which
    must fail; its run directory and console output."""
    run = tmp_path / "run"
    overrides = ["replicas=2", "ranks=2", f"program.command={json.dumps(command)}",
                 f"program.cwd={json.dumps(str(tmp_path))}", *sets]  # fmt: skip
    done = subprocess.run(
        [sys.executable, "-m", "harness", "run", "experiments/tiny.toml", "--out", str(run),
         *(a for o in overrides for a in ("--set", o))],
        cwd=ROOT, capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip
    out = done.stdout + done.stderr
    assert done.returncode != 0, out[-4000:]
    return run, out


@pytest.mark.timeout(180)
def test_a_program_that_fails_at_every_start_ends_the_job_with_its_cause(tmp_path):
    run, out = _failed_run(tmp_path, ["python", str(PROGRAM)], timeout=150)
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


@pytest.mark.timeout(240)
def test_torchtitan_with_two_ranks_a_group_gets_as_far_as_its_cuda_device_on_a_cpu(tmp_path):
    """torchtitan's fault-tolerant trainer with ``ranks = 2``, as a user would run it: its
    command line and torchrun's environment take it into ``Trainer.__init__``, which sets its
    CUDA device before anything else (torchtitan/experiments/torchft/trainer.py); on a CPU-only
    machine that is where it stops, named, in a few tries."""
    pytest.importorskip("torchtitan")
    command = [
        "python", "-m", "torchtitan.train", "--module", "torchft.llama3",
        "--config", "llama3_torchft_debugmodel",
    ]  # fmt: skip
    # in tmp_path: torchtitan writes ./outputs/structured_logs where it runs
    run, _ = _failed_run(tmp_path, command, "program.kind=torchtitan", timeout=210)
    (end,) = events(run, "job.end")
    assert "the program fails the same way every time" in end["reason"], end
    assert "hint: the program needs a GPU this machine does not have" in end["reason"]
    # it got past the command line and the environment, into the trainer
    log = "".join(f.read_text() for f in sorted((run / "logs").glob("replica*-rank*.log")))
    assert "torchtitan/experiments/torchft/trainer.py" in log and "set_device" in log, log[-3000:]
    tries = Counter(p["replica"] for p in events(run, "proc.start") if p["rank"] == 0)
    assert max(tries.values()) <= 3, tries
