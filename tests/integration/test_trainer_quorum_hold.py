"""A replacement's hold: the groups that run meet at every step until it has joined them.

A real Trainer (torchft's Manager and Lighthouse, gloo) under a sparse quorum (every 10 steps);
``request_quorum(hold_s, groups)`` is what the controller calls in every running trainer as it
starts a replacement (``harness.job.groups.TrainerGroups``). Asserted from the trainer's own
``step.commit`` records: which steps joined a quorum.
"""

from __future__ import annotations

from typing import Any

import pytest
from trainer_procs import lone_trainer

from harness.config import CheckpointConfig, JobConfig, RecoveryConfig
from harness.rank.torchft_glue import Lighthouse


def _quorum_steps(events: list[tuple[str, dict[str, Any]]], after: int) -> list[int]:
    """The steps after ``after`` that joined a quorum, from the trainer's commit records."""
    commits = [f for e, f in events if e == "step.commit"]
    return [f["step"] for f in commits if f["quorum"] and f["step"] > after]


@pytest.mark.timeout(120)
def test_a_hold_asks_for_a_quorum_at_every_step_until_enough_groups_meet() -> None:
    cfg = JobConfig(
        name="hold",
        replicas=1,
        steps=100,
        checkpoint=CheckpointConfig(every_steps=0),
        recovery=RecoveryConfig(quorum_every_steps=10),
    )
    lighthouse = Lighthouse.for_job(cfg)
    events: list[tuple[str, dict[str, Any]]] = []
    trainer = lone_trainer(cfg, lighthouse.address, lambda e, f: events.append((e, f)))
    try:
        trainer.train(steps=15)
        assert _quorum_steps(events, 0) == [1, 11]  # sparse: its first step, then every 10

        # A replacement is starting and this group is alone in its quorum: every step from the
        # one after the ask (the flag rides that step's allreduce) joins a quorum.
        trainer.request_quorum(hold_s=600, groups=2)
        trainer.train(steps=25)
        assert _quorum_steps(events, 15) == list(range(17, 26))

        # The hold ends with the first commit of a quorum of enough groups (here one) after it
        # was asked: step 26 (asked for at step 25, under the first hold) and step 27 (the
        # ask's own flag), then the sparse period again.
        trainer.request_quorum(hold_s=600, groups=1)
        trainer.train(steps=45)
        assert _quorum_steps(events, 25) == [26, 27, 31, 41]

        # A hold that runs out stops asking (the replacement never came): the ask itself still
        # counts once, as a plain ask does.
        trainer.request_quorum(hold_s=1e-9, groups=2)
        trainer.train(steps=60)
        assert _quorum_steps(events, 45) == [47, 51]
    finally:
        trainer.close()
        lighthouse.shutdown()
