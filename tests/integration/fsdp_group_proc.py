"""One rank of a sharded replica group, for ``test_fsdp_group.py``: ``python fsdp_group_proc.py
GROUP RANK PORT OUT``. Two groups of two ranks; group G's world rendezvouses on a store at
PORT + G (its rank 0 hosts it), and "across the groups" is a plain gloo group of rank R of both
groups on a store at PORT + 2 (group 0 hosts it), averaging as torchft's Manager does.

It takes one step of the tiny model under ``harness.rank.group_layout.Sharded`` on its own batch
and writes to OUT (JSON): the full averaged gradient of every parameter (gathered within the
group), its local shard shapes, what a fresh sharded copy that loaded this rank's
``state_dict`` holds after the same step, and the asks the layout agreed on in each step (group 0's
rank 1 asks for a quorum, group 1's rank 0 for a checkpoint and group 1's rank 1 says its loss was
not finite in the first; nobody in the second).
"""

from __future__ import annotations

import io
import json
import sys
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed import PrefixStore, TCPStore

from harness.config import ModelConfig
from harness.rank.group_layout import Asks, Sharded, init_group_world
from harness.rank.model import build_model, loss_fn, model_blocks

GROUPS, RANKS, VOCAB, SEQ, BATCH = 2, 2, 64, 8, 2
MODEL = ModelConfig(kind="tiny", dim=16, layers=2, heads=2)
TIMEOUT = timedelta(seconds=30)


def batch(group: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + 10 * group + rank)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def main() -> None:
    group, rank, port, out = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    torch.set_num_threads(1)
    store = TCPStore("127.0.0.1", port + group, RANKS, rank == 0, timeout=TIMEOUT)
    init_group_world(store, rank, RANKS, TIMEOUT)
    cross_store = TCPStore("127.0.0.1", port + 2, GROUPS * RANKS, group == 0 and rank == 0)
    cross = dist.ProcessGroupGloo(PrefixStore(f"cross/{rank}", cross_store), group, GROUPS, TIMEOUT)

    def across(t: torch.Tensor) -> None:  # torchft's Manager.allreduce: SUM, / participants
        cross.allreduce([t]).wait()  # type: ignore[attr-defined]
        t /= GROUPS

    def sharded() -> tuple[torch.nn.Module, torch.optim.Optimizer, Sharded]:
        model = build_model(MODEL, vocab_size=VOCAB, seed=0)
        layout = Sharded(model, model_blocks(model), across)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-2), layout

    model, optim, layout = sharded()
    inputs, targets = batch(group, rank)
    asks = Asks(
        quorum=(group, rank) == (0, 1),
        checkpoint=(group, rank) == (1, 0),
        nonfinite=(group, rank) == (1, 1),
    )
    layout.backward(loss_fn(model(inputs), targets), asks)
    agreed = [layout.average(model, contribute=True)]
    grads = {n: p.grad.full_tensor().tolist() for n, p in model.named_parameters()}
    shards = {n: list(layout.local(p).shape) for n, p in model.named_parameters()}
    optim.step()

    # A fresh copy loads this rank's state (a heal's path, through bytes as a transport or a
    # checkpoint carries it: plain tensors, so weights_only loads it), then both take the same
    # next step.
    buf = io.BytesIO()
    torch.save(layout.state_dict(model, optim), buf)
    buf.seek(0)
    copy, copy_optim, copy_layout = sharded()
    copy_layout.load_state_dict(copy, copy_optim, torch.load(buf, weights_only=True))
    equal_after_load = all(
        torch.equal(layout.local(a), copy_layout.local(b))
        for a, b in zip(model.parameters(), copy.parameters(), strict=True)
    )
    for m, o, lay in ((model, optim, layout), (copy, copy_optim, copy_layout)):
        o.zero_grad()
        lay.backward(
            loss_fn(m(inputs), targets), Asks(quorum=False, checkpoint=False, nonfinite=False)
        )
        agreed.append(lay.average(m, contribute=True))
        o.step()
    equal_after_step = all(
        torch.equal(layout.local(a), copy_layout.local(b))
        for a, b in zip(model.parameters(), copy.parameters(), strict=True)
    )
    with open(out, "w") as f:
        json.dump(
            {
                "grads": grads,
                "shards": shards,
                "equal_after_load": equal_after_load,
                "equal_after_step": equal_after_step,
                "agreed": [[a.quorum, a.checkpoint, a.nonfinite] for a in agreed],
            },
            f,
        )
    dist.barrier()


if __name__ == "__main__":
    main()
