"""With the ``replay`` data policy no sequence is lost to a killed replica group.

Real processes (``harness.rank.trainer.run_trainer``), torchft's Lighthouse and Managers, gloo on
CPU,
a real SIGKILL of one group while the others train on, and its replacement healing from them.
The sequences trained are counted from the journals by ``dashboards.data_coverage``: with
``replay`` every sequence up to the last committed step is trained exactly once; with ``skip``
(today's default) the killed group's shard for the steps it missed is never trained.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import time
from pathlib import Path

import pytest
from trainer_procs import commits, start_trainer

from dashboards.data_coverage import coverage
from harness.config import CheckpointConfig, DataConfig, JobConfig, config_to_dict
from harness.corpus.job import resolve_data
from harness.corpus.prepare import PrepareOptions, prepare
from harness.rank.torchft_glue import Lighthouse
from runtime.journal import read_journal


def _wait_commits(path: Path, n: int, procs: list, deadline: float, participants: int) -> None:
    while len([r for r in commits(path) if r["participants"] >= participants]) < n:
        assert time.monotonic() < deadline, f"{path.name}: fewer than {n} commits in time"
        assert all(p.poll() is None for p in procs), "a trainer exited early; see *.log"
        time.sleep(0.05)


def _text_corpus(tmp_path: Path) -> str:
    """A real token file (``ftharness data prepare`` on a small text source made here)."""
    rng = random.Random(0)
    words = [
        "group",
        "heals",
        "from",
        "peer",
        "while",
        "others",
        "train",
        "on",
        "and",
        "nothing",
        "is",
        "lost",
        "twice",
    ]
    src = tmp_path / "text"
    src.mkdir()
    for i in range(12):
        (src / f"{i}.txt").write_text(" ".join(rng.choice(words) for _ in range(2000)))
    prepare(str(src), tmp_path / "corpus", PrepareOptions(vocab_size=300, heldout=0.2),
            say=lambda _m: None)  # fmt: skip
    return str(tmp_path / "corpus")


def _kill_one_group_and_replace(tmp_path: Path, policy: str) -> list[dict]:
    # replay on real text (a token file, held-out loss every 50 steps), skip on the synthetic
    # stream: both data kinds go through a kill and a heal
    data = DataConfig(policy=policy)
    if policy == "replay":
        data = DataConfig(
            policy=policy, kind="tokens", corpus=_text_corpus(tmp_path), eval_every=50
        )
    cfg = resolve_data(
        JobConfig(
            name="replay",
            replicas=3,
            steps=600,
            data=data,
            checkpoint=CheckpointConfig(every_steps=25),
        )
    )
    cfg_dict = config_to_dict(cfg)
    lighthouse = Lighthouse.for_job(cfg)
    deadline = time.monotonic() + 300

    def start(replica: int, tag: str) -> subprocess.Popen[bytes]:
        return start_trainer(
            cfg_dict,
            replica_id=replica,
            rank=0,
            store_addr=None,
            lighthouse_addr=lighthouse.address,
            journal_path=tmp_path / f"g{replica}{tag}.jsonl",
        )

    procs = [start(r, "") for r in range(3)]
    replacement = None
    try:
        _wait_commits(tmp_path / "g1.jsonl", 8, procs, deadline, participants=3)
        os.killpg(procs[1].pid, signal.SIGKILL)
        procs[1].wait(timeout=30)
        # the survivors train on without it for a while: its shard goes untrained meanwhile
        n0 = len(commits(tmp_path / "g0.jsonl"))
        _wait_commits(tmp_path / "g0.jsonl", n0 + 20, [procs[0], procs[2]], deadline, 1)
        replacement = start(1, "b")
        for p in (procs[0], procs[2], replacement):
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
        codes = [p.returncode for p in (procs[0], procs[2], replacement)]
        assert codes == [0, 0, 0], f"exit codes {codes}; see {tmp_path}/*.log"
    finally:
        for p in [*procs, replacement]:
            if p is not None and p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
        lighthouse.shutdown()
    back = commits(tmp_path / "g1b.jsonl")
    assert any(r["participants"] == 3 for r in back), "the replacement never trained with peers"
    assert any(r["participants"] == 2 for r in commits(tmp_path / "g0.jsonl"))
    return [r for f in sorted(tmp_path.glob("g*.jsonl")) for r in read_journal(f)]


@pytest.mark.timeout(360)
def test_replay_trains_every_sequence_exactly_once_despite_a_kill(tmp_path: Path) -> None:
    records = _kill_one_group_and_replace(tmp_path, "replay")
    (got,) = coverage(records).values()
    assert got["data_policy"] == "replay"
    # 600 steps, at least two groups in most (how long the three-group phase lasts depends on how
    # fast the replacement starts on a loaded machine)
    assert got["due"] >= 500 * 2 * DataConfig().batch_size
    assert (got["skipped"], got["trained_twice"]) == (0, 0), got
    # and the replicas still hold the same weights at every step they share
    sums: dict[int, set] = {}
    for r in records:
        if r["event"] == "step.commit" and r.get("checksum") is not None:
            sums.setdefault(r["step"], set()).add(r["checksum"])
    assert sums and all(len(s) == 1 for s in sums.values())
    # the held-out loss at step 0 and every 50 steps, once per step, and it fell
    evals = {r["step"]: r["heldout_loss"] for r in records if r["event"] == "eval"}
    assert set(range(0, 601, 50)) <= set(evals)
    assert len([r for r in records if r["event"] == "eval"]) == len(evals)
    assert evals[600] < 0.8 * evals[0]


@pytest.mark.timeout(360)
def test_skip_loses_the_killed_groups_shard(tmp_path: Path) -> None:
    records = _kill_one_group_and_replace(tmp_path, "skip")
    (got,) = coverage(records).values()
    assert got["data_policy"] == "skip"
    # at least the 20 steps the survivors trained alone, one batch each
    assert got["skipped"] >= 20 * DataConfig().batch_size, got
    assert got["trained_twice"] == 0
