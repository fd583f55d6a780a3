"""The forward/backward pass that overlaps the quorum is redone when the quorum heals us.

Real Trainers (torchft Manager, Lighthouse, gloo), one group each. The heal is played by a
hand-written stand-in for ``_join_quorum`` that loads a peer's state from the quorum thread, as
torchft's synchronous quorum does, while the speculative pass is under way.
"""

from __future__ import annotations

import copy
import time
from pathlib import Path
from typing import Any

import pytest
from trainer_procs import lone_trainer

from harness.config import CheckpointConfig, JobConfig, RecoveryConfig
from harness.rank import trainer as trainer_mod
from harness.rank.torchft_glue import Lighthouse
from harness.rank.trainer import Trainer


def _trainer(cfg: JobConfig, lighthouse: Lighthouse, events: list) -> Trainer:
    return lone_trainer(cfg, lighthouse.address, lambda e, f: events.append((e, f)))


@pytest.mark.timeout(120)
def test_a_heal_during_the_overlapped_pass_redoes_it_on_the_healed_state(tmp_path: Path) -> None:
    assert trainer_mod.OVERLAP_QUORUM
    cfg = JobConfig(
        name="overlap",
        replicas=1,
        steps=50,
        checkpoint=CheckpointConfig(every_steps=0),
        recovery=RecoveryConfig(quorum_every_steps=1),  # a quorum (and so a pass) every step
    )
    lh_a, lh_b = Lighthouse.for_job(cfg), Lighthouse.for_job(cfg)
    ev_a: list[tuple[str, dict[str, Any]]] = []
    ev_b: list[tuple[str, dict[str, Any]]] = []
    a = _trainer(cfg, lh_a, ev_a)
    b = _trainer(cfg, lh_b, ev_b)
    try:
        a.train(steps=3)  # A has joined quorums: its next step overlaps the quorum
        b.train(steps=6)  # B, the "peer", is further on
        peer_state = copy.deepcopy(b.state_dict())
        real_join = a._join_quorum
        landed: list[float] = []

        def healing_join() -> bool:
            time.sleep(0.02)  # the speculative pass is under way (or done)
            a.load_state_dict(copy.deepcopy(peer_state))  # waits for the pass to end
            landed.append(time.perf_counter())
            return real_join()

        a._join_quorum = healing_join  # type: ignore[method-assign]
        committed, _ = a.train_step()
        assert committed and landed
        b.train_step()
    finally:
        a.close()
        b.close()
        lh_a.shutdown()
        lh_b.shutdown()
    last_a = [f for e, f in ev_a if e == "step.commit"][-1]
    last_b = [f for e, f in ev_b if e == "step.commit"][-1]
    # A trained the healed position's batch on the healed weights: the same step B took
    assert last_a["data_pos"] == last_b["data_pos"] == 6
    assert a.checksum() == b.checksum()
    assert last_a["loss"] == last_b["loss"]
