"""One rank of a group that writes or loads a DCP checkpoint, for ``test_dcp_sharded.py``:
``python dcp_proc.py save|load WORLD RANK PORT ROOT OUT [MODEL]`` (MODEL: tiny, the default, or
llama3_debug, torchtitan's, whose fused QKV saves as wq/wk/wv through state-dict hooks).

``save``: WORLD ranks shard the tiny model with FSDP2 (``harness.rank.group_layout.Sharded``,
on a world rendezvoused at PORT), train two steps, and write checkpoint step 2 under ROOT in the
background (``harness.rank.dcp_checkpoint.Writer``, on a gloo group of its own, as torchtitan's
checkpointer has). ``load``: WORLD ranks (0: one process, the model not sharded, no process
group) load step 2 into a fresh model and optimizer. Either way rank 0 then writes the full
state (gathered, FQN-keyed) to OUT with ``torch.save``, for the test to compare bitwise.
"""

from __future__ import annotations

import sys
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed import TCPStore
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
)

from harness.config import ModelConfig
from harness.rank import dcp_checkpoint
from harness.rank.group_layout import Sharded, init_group_world
from harness.rank.model import build_model, loss_fn, model_blocks

VOCAB = 64
MODELS = {
    "tiny": ModelConfig(kind="tiny", dim=16, layers=2, heads=2),
    "llama3_debug": ModelConfig(kind="llama3_debug"),
}
TIMEOUT = timedelta(seconds=60)
FULL = StateDictOptions(full_state_dict=True, cpu_offload=True, flatten_optimizer_state_dict=True)


def _full_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer whole (gathered: a collective), by its attribute name."""
    from torch.distributed.tensor import DTensor

    named = [*model.named_parameters(), *model.named_buffers()]
    return {
        n: (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone() for n, t in named
    }


def main() -> None:
    mode, world, rank, port = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    root, out = sys.argv[5], sys.argv[6]
    config = MODELS[sys.argv[7] if len(sys.argv) > 7 else "tiny"]
    torch.set_num_threads(1)
    model = build_model(config, vocab_size=VOCAB, seed=0 if mode == "save" else 7)
    pg = None
    if world:
        store = TCPStore("127.0.0.1", port, world, rank == 0, timeout=TIMEOUT)
        init_group_world(store, rank, world, TIMEOUT)
        Sharded(model, model_blocks(model), lambda t: None)
        pg = dist.new_group(backend="gloo")
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    if mode == "save":
        g = torch.Generator().manual_seed(rank)
        for _ in range(2):
            tokens = torch.randint(0, VOCAB, (2, 9), generator=g)
            loss_fn(model(tokens[:, :-1]), tokens[:, 1:]).backward()
            optim.step()
            optim.zero_grad()
        state = dcp_checkpoint.app_state(
            model, optim, dataloader={"position": 2, "consumed": 8},
            train_state={"step": 2, "ntokens_seen": 2 * 2 * 8 * max(world, 1)},
        )  # fmt: skip
        writer = dcp_checkpoint.Writer(root, pg, rank=rank)
        writer.save(2, state)
        writer.close()
        extra = {"dataloader": state["dataloader"], "train_state": state["train_state"]}
    else:
        state = dcp_checkpoint.app_state(
            model, optim, dataloader={"position": 0, "consumed": 0},
            train_state={"step": 0, "ntokens_seen": 0},
        )  # fmt: skip
        dcp_checkpoint.load(root, 2, state, pg)
        dcp_checkpoint.apply(model, optim, state)
        extra = {"dataloader": state["dataloader"], "train_state": state["train_state"]}
    full = {
        "model": _full_tensors(model),
        "optimizer": get_optimizer_state_dict(model, optim, options=FULL),
        **extra,
    }
    if rank == 0:
        torch.save(full, out)
    if world:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
