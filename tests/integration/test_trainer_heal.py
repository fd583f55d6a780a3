"""A killed replica group is replaced in place, heals from a peer and trains on, bitwise equal.

Real processes (``python -c`` running ``harness.trainer.run_trainer``), torchft's real Lighthouse
and Managers, gloo on CPU, a real SIGKILL. Everything is asserted from the per-process journals.
"""

from __future__ import annotations

import math
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
from h1_procs import commits, start_trainer

from harness.config import CheckpointConfig, JobConfig, config_to_dict
from harness.quorum import Lighthouse, host_store

KILL_AFTER = 8  # commits by the victim before it is killed


def _wait(procs: list[subprocess.Popen[bytes]], deadline: float) -> None:
    for p in procs:
        p.wait(timeout=max(1.0, deadline - time.monotonic()))


def _wait_for_commits(path: Path, n: int, procs: list[subprocess.Popen[bytes]], deadline: float):
    while len(commits(path)) < n:
        assert time.monotonic() < deadline, f"{path.name}: fewer than {n} commits in time"
        assert all(p.poll() is None for p in procs), "a trainer exited early; see *.log"
        time.sleep(0.1)


def _check_group(records: list[dict[str, Any]]) -> None:
    """Per group (all its incarnations, in time order): steps only grow, each data position is
    trained once and is the one for that step, losses are finite."""
    steps = [r["step"] for r in records]
    assert steps == sorted(steps) and len(set(steps)) == len(steps), f"step went back: {steps}"
    positions = [r["data_pos"] for r in records]
    assert len(set(positions)) == len(positions), f"a data position trained twice: {positions}"
    assert all(r["data_pos"] == r["step"] - 1 for r in records)
    assert all(math.isfinite(r["loss"]) for r in records)


def _run_kill_and_heal(tmp_path: Path, *, ranks: int) -> None:
    # Checkpoints every 10 steps: the replacement first resumes from one, then heals past it.
    cfg = JobConfig(
        name="heal", replicas=3, ranks=ranks, steps=60, checkpoint=CheckpointConfig(every_steps=10)
    )
    cfg_dict = config_to_dict(cfg)
    lighthouse = Lighthouse.for_job(cfg)
    stores = []
    deadline = time.monotonic() + 400

    def start_group(replica: int, tag: str) -> list[subprocess.Popen[bytes]]:
        store_addr = None
        if ranks > 1:  # the group's supervisor (here: the test) hosts its store
            store, store_addr = host_store(cfg.bind_host, cfg.timeouts)
            stores.append(store)
        return [
            start_trainer(
                cfg_dict,
                replica_id=replica,
                rank=rank,
                store_addr=store_addr,
                lighthouse_addr=lighthouse.address,
                journal_path=tmp_path / f"g{replica}{tag}_r{rank}.jsonl",
            )
            for rank in range(ranks)
        ]

    groups = {r: start_group(r, "") for r in range(3)}
    everyone = [p for ps in groups.values() for p in ps]
    try:
        victim = tmp_path / "g1_r0.jsonl"
        _wait_for_commits(victim, KILL_AFTER, everyone, deadline)
        t_kill = time.time()
        for p in groups[1]:
            os.killpg(p.pid, signal.SIGKILL)
        for p in groups[1]:
            p.wait(timeout=30)
        replacement = start_group(1, "b")
        _wait(groups[0] + groups[2] + replacement, deadline)
        codes = [p.returncode for p in groups[0] + groups[2] + replacement]
        assert codes == [0] * len(codes), f"exit codes {codes}; see {tmp_path}/*.log"
    finally:
        for p in everyone + locals().get("replacement", []):
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
        lighthouse.shutdown()

    for rank in range(ranks):
        g0, g2 = commits(tmp_path / f"g0_r{rank}.jsonl"), commits(tmp_path / f"g2_r{rank}.jsonl")
        before = commits(tmp_path / f"g1_r{rank}.jsonl")
        after = commits(tmp_path / f"g1b_r{rank}.jsonl")
        for records in (g0, g2, before + after):
            _check_group(records)
        assert after, "the replacement never committed a step"
        # The survivors kept committing while the victim was dead and its replacement not back.
        for survivor in (g0, g2):
            assert any(t_kill < r["t"] < after[0]["t"] for r in survivor)
        # The replacement healed: it resumed ahead of where the victim died, and participated.
        assert after[0]["step"] > before[-1]["step"]
        assert any(r["participants"] == 3 for r in after)
        # Bitwise equal weights and optimizer state at every common step, every group.
        by_step = {r["step"]: r["checksum"] for r in g0}
        for other in (g2, before, after):
            common = [r for r in other if r["step"] in by_step]
            assert common
            assert all(r["checksum"] == by_step[r["step"]] for r in common)
        back_s = after[0]["t"] - t_kill
        print(
            f"ranks={ranks} kill -> replacement's first commit: {back_s:.2f} s "
            f"(step {after[0]['step']}, victim died after step {before[-1]['step']})"
        )


@pytest.mark.timeout(420)
def test_killed_group_heals_in_place(tmp_path: Path) -> None:
    _run_kill_and_heal(tmp_path, ranks=1)


@pytest.mark.e2e
@pytest.mark.timeout(420)
def test_killed_two_rank_group_heals_in_place(tmp_path: Path) -> None:
    _run_kill_and_heal(tmp_path, ranks=2)
