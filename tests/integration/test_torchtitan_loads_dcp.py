"""torchtitan's own checkpoint loader reads a DCP checkpoint ftharness wrote: its
``CheckpointManager`` (``components/checkpointer/dcp.py``) finds the step folder, and loads the
model (torchtitan's llama3, fused QKV saved as wq/wk/wv), the optimizer (its
``OptimizersContainer``, flat FQN keys), the learning-rate scheduler and the train state into
torchtitan's own objects, bitwise. Not the dataloader: torchtitan's is its iterator's state, ours
a data position (``exclude_from_loading``, as torchtitan's fault-tolerant mode loads it apart)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from harness.config import ModelConfig
from harness.rank import dcp_checkpoint
from harness.rank.model import build_model, loss_fn

pytestmark = [
    pytest.mark.filterwarnings("ignore::UserWarning"),
    pytest.mark.timeout(300),
]

VOCAB = 256
LLAMA = ModelConfig(kind="llama3_debug")


class _TrainState:  # torchtitan's Trainer is the train_state Stateful: {"step", "ntokens_seen"}
    def __init__(self) -> None:
        self.step, self.ntokens_seen = 0, 0

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "ntokens_seen": self.ntokens_seen}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.step, self.ntokens_seen = sd["step"], sd["ntokens_seen"]


def test_torchtitans_checkpoint_manager_loads_what_ftharness_wrote(tmp_path: Path) -> None:
    from torchtitan.components.checkpoint import CheckpointManager
    from torchtitan.components.optimizer.lr_scheduler import LRSchedulersContainer
    from torchtitan.components.optimizer.optimizer import OptimizersContainer, ParamGroupConfig

    model = build_model(LLAMA, vocab_size=VOCAB, seed=0)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    tokens = torch.randint(0, VOCAB, (2, 17), generator=torch.Generator().manual_seed(0))
    for _ in range(2):
        loss_fn(model(tokens[:, :-1]), tokens[:, 1:]).backward()
        optim.step()
        optim.zero_grad()
    writer = dcp_checkpoint.Writer(tmp_path / "checkpoint", None, rank=0)
    writer.save(
        2,
        dcp_checkpoint.app_state(
            model,
            optim,
            dataloader={"position": 2, "consumed": 2},
            train_state={"step": 2, "ntokens_seen": 64},
        ),
    )
    writer.close()

    theirs = build_model(LLAMA, vocab_size=VOCAB, seed=5)
    optimizers = OptimizersContainer(
        OptimizersContainer.Config(
            param_groups=[
                ParamGroupConfig(
                    pattern=".*",
                    optimizer_name="AdamW",
                    optimizer_kwargs={"lr": 1e-3, "weight_decay": 0.1},
                )
            ],
            implementation="for-loop",
        ),
        model_parts=[theirs],
    )
    schedulers = LRSchedulersContainer(optimizers, lambda step: 1.0)
    train_state = _TrainState()
    manager = CheckpointManager(
        CheckpointManager.Config(
            enable=True, folder="checkpoint", exclude_from_loading=["dataloader"]
        ),
        dataloader=None,
        model_parts=[theirs],
        optimizers=optimizers,
        lr_schedulers=schedulers,
        states={"train_state": train_state},
        sd_adapter=None,
        base_folder=str(tmp_path),
    )
    assert manager.load() is True

    assert train_state.state_dict() == {"step": 2, "ntokens_seen": 64}
    assert schedulers.state_dict() == {"last_epoch": 2}
    mine = dict(model.named_parameters())
    for name, p in theirs.named_parameters():
        assert torch.equal(p, mine[name]), name
    by_name = {id(p): n for n, p in model.named_parameters()}
    ours = {by_name[id(p)]: optim.state[p] for g in optim.param_groups for p in g["params"]}
    loaded = {n: optimizers.optimizers[0].state[p] for n, p in theirs.named_parameters()}
    assert ours.keys() == loaded.keys()
    for name, state in ours.items():
        for key, value in state.items():
            assert torch.equal(loaded[name][key], value), (name, key)
