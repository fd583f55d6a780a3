"""A step its group does not commit closes the rank's cross-group communicator, even when the
rank's own collectives succeeded; and the retry, after a quorum that changed nothing of this
rank's, averages the same pass's gradients again instead of running the pass again.

Why (seen in ``bench recovery``'s sharded row, about one kill in thirty): group A's rank 0
fails its allreduce as group C dies, while its rank 1's succeeds; group A aborts the step on
both ranks (``should_commit`` is the group's). Group B committed the step and, between sparse
quorums, starts its next allreduce on the same communicator, where it waits on A's rank 1,
which has gone to a quorum instead: B's rank 1 stalled for the whole process-group timeout
(5 s), and the quorum with it. Closed, the wait fails at once (the mechanism:
``tests/integration/test_communicator_close.py``).

A real Trainer (torchft Manager, Lighthouse, gloo); the failure of another rank of its group is
played by the group's answer to ``should_commit`` (torchft's manager server, which asks every
rank of the group) being no for one step."""

from __future__ import annotations

from typing import Any

import pytest
from trainer_procs import lone_trainer

from harness.config import CheckpointConfig, JobConfig
from harness.rank.torchft_glue import Lighthouse


@pytest.mark.timeout(120)
def test_an_aborted_step_closes_the_communicator_and_its_pass_is_averaged_again() -> None:
    cfg = JobConfig(name="abort", replicas=1, steps=50, checkpoint=CheckpointConfig(every_steps=0))
    lighthouse, control_lh = Lighthouse.for_job(cfg), Lighthouse.for_job(cfg)
    control = None
    events: list[tuple[str, dict[str, Any]]] = []
    trainer = lone_trainer(cfg, lighthouse.address, lambda e, f: events.append((e, f)))
    try:
        trainer.train(steps=3)  # between quorums now: the sparse quorum's steps
        gloo = trainer._pg  # torchft's wrapper; ._pg is its gloo process group while open
        assert gloo._pg is not None
        client = trainer.manager._client  # what asks the group's ranks (torchft's manager server)
        real = client.should_commit
        client.should_commit = lambda *a, **k: (real(*a, **k), False)[1]  # another rank said no
        committed, _ = trainer.train_step()
        assert not committed and trainer.manager.errored() is None  # its own collectives: fine
        assert gloo._pg is None, "the aborted step left its cross-group communicator open"
        client.should_commit = real
        committed, _ = trainer.train_step()  # a quorum, a fresh communicator: it commits
        assert committed and gloo._pg is not None
        # the control: a trainer whose group never said no, the same steps
        control = lone_trainer(cfg, control_lh.address, lambda e, f: None)
        control.train(steps=4)
        assert trainer.checksum() == control.checksum()
    finally:
        trainer.close()
        lighthouse.shutdown()
        if control is not None:
            control.close()
        control_lh.shutdown()
    aborts = [f for e, f in events if e == "step.abort"]
    commits = [f for e, f in events if e == "step.commit"]
    assert [a["reason"] for a in aborts] == ["not enough replicas"]
    assert [c["step"] for c in commits] == [1, 2, 3, 4]
    # the retry averaged the aborted attempt's pass again: no second forward/backward
    assert commits[-1]["quorum"] is True and commits[-1].get("pass_kept") is True
    assert not any(c.get("pass_kept") for c in commits[:-1])
