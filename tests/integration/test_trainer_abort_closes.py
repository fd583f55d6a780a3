"""A step its group does not commit closes the rank's cross-group communicator, even when the
rank's own collectives succeeded.

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
def test_a_step_the_group_aborts_closes_the_communicator_and_the_next_quorum_rebuilds_it() -> None:
    cfg = JobConfig(name="abort", replicas=1, steps=50, checkpoint=CheckpointConfig(every_steps=0))
    lighthouse = Lighthouse.for_job(cfg)
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
    finally:
        trainer.close()
        lighthouse.shutdown()
    aborts = [f for e, f in events if e == "step.abort"]
    commits = [f["step"] for e, f in events if e == "step.commit"]
    assert [a["reason"] for a in aborts] == ["not enough replicas"]
    assert commits == [1, 2, 3, 4]
    assert [f["quorum"] for e, f in events if e == "step.commit"][-1] is True
