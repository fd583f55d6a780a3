"""The soak's CI version (experiments/soak_ci.toml): 12 faults of every kind in ~2 minutes,
run through the CLI as a user runs it. Every hypothesis of the report holds, the soak's own
(every fault recovered, journal complete, no orphan process, no /dev/shm segment left) among
them, and ``ftharness report`` recomputes the same verdicts from the run directory alone."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from faults.fault import fault_class, fault_kinds
from runtime.journal import FAULT_INJECT, read_journal

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

REPO = Path(__file__).parents[2]
SOAK_HYPOTHESES = ("every_fault_recovered", "journal_complete", "no_orphans", "no_shm_left")


def test_soak_ci_loses_nothing_and_leaves_nothing_behind(tmp_path):
    out = tmp_path / "run"
    argv = [sys.executable, "-m", "harness", "chaos", "experiments/soak_ci.toml", "--out"]
    done = subprocess.run(
        [*argv, str(out), "--quiet"], capture_output=True, text=True, timeout=560, cwd=REPO
    )
    report = json.loads((out / "report.json").read_text())
    results = {h["name"]: h for h in report["hypotheses"]}
    failed = {n: h["detail"] for n, h in results.items() if not h["passed"]}
    assert not failed, failed
    for name in SOAK_HYPOTHESES:  # each present, and true
        h = results.get(f"{name}[in_place]")
        assert h is not None and h["passed"], (name, h)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]

    injected = [r for r in read_journal(out) if r["event"] == FAULT_INJECT]
    # replica 0 is keep-alive and always healthy, so no planned fault is skipped
    assert len(injected) == 12, [r["fault_id"] for r in injected]
    # every catalogue kind a job on local hosts can take (network faults need their own links)
    local = {
        k
        for k in fault_kinds()
        if fault_class(k).__module__.startswith("faults.")
        and not getattr(fault_class(k), "needs_network", False)
        and not getattr(fault_class(k), "needs_launcher", None)  # SLURM faults: launcher slurm
        # the soaks keep group 0 alive, and torchft heals a group from the lowest up-to-date
        # one, and the group at participating rank 0 writes the checkpoints: group 0, nearly
        # always (experiments/sharded.toml kills heal sources, test_fsdp_groups.py writers)
        and k not in ("heal_source_kill", "checkpoint_kill")
        # bad data fails whichever group reads it, group 0 too (experiments/poison.toml)
        and k != "poison_data"
        # a broken device drops its group: a failure that recurs, not one to ride through
        and not getattr(fault_class(k), "recurs", False)
    }
    assert {r["kind"] for r in injected} == local
    assert (out / "in_place" / "postrun.json").is_file()

    # the report is recomputed from the run directory alone, to the same verdicts
    again = subprocess.run(
        [sys.executable, "-m", "harness", "report", str(out), "--json"],
        capture_output=True, text=True, timeout=120, cwd=REPO,
    )  # fmt: skip
    assert again.returncode == 0, again.stderr
    recomputed = {h["name"]: h["passed"] for h in json.loads(again.stdout)["hypotheses"]}
    assert recomputed == {n: h["passed"] for n, h in results.items()}
