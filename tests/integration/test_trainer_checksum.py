"""The weights checksum is taken on sampled steps only, the same step numbers in every group."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from trainer_procs import lone_trainer

from harness.config import CheckpointConfig, JobConfig
from harness.rank.torchft_glue import Lighthouse
from harness.rank.trainer import CHECKSUM_EVERY


@pytest.mark.timeout(120)
def test_checksum_every_tenth_and_every_checkpoint_step(tmp_path: Path) -> None:
    cfg = JobConfig(name="sums", replicas=1, steps=25, checkpoint=CheckpointConfig(every_steps=4))
    events: list[tuple[str, dict[str, Any]]] = []
    lighthouse = Lighthouse.for_job(cfg)
    try:
        trainer = lone_trainer(
            cfg, lighthouse.address, lambda e, f: events.append((e, f)), tmp_path
        )
        try:
            trainer.train(steps=19)
            before = trainer.checksum()
            trainer.train(steps=20)
            at_20 = trainer.checksum()
        finally:
            trainer.close()
    finally:
        lighthouse.shutdown()
    commits = {f["step"]: f for e, f in events if e == "step.commit"}
    assert sorted(commits) == list(range(1, 21))
    sampled = {s for s, f in commits.items() if f["checksum"] is not None}
    assert CHECKSUM_EVERY == 10
    assert sampled == {4, 8, 10, 12, 16, 20}
    assert commits[20]["checksum"] == at_20 != before  # the state after that step's update
