"""What a host agent runs once, before it forks any worker, so that a replacement does not pay
for it on the recovery path (``runtime.messages.AgentConfig.warmup``; a worker is a fork of the
agent's interpreter and inherits all of it).

* :func:`harness.rank.model.prebuild`: the initial model, built.
* :func:`warm_sharding`, for a job with sharded groups (``parallel.group = "fsdp"``): the first
  ``fully_shard`` and the first step over DTensors in a process are slow (lazy imports and
  first-use set-up in FSDP2 and DTensor): 0.49 s and 0.08 s in a cold process here (the tiny
  model, 2 ranks), 0.011 s and 0.053 s after this warm-up. A replacement paid that between its
  start and its first commit. Here it is paid once per agent, on a throwaway copy of the model
  over torch's ``fake`` process group (no threads, no sockets: safe to fork after), torn down
  before any fork.

The warm-up's group has **one** rank, never the job's shape, on purpose. DTensor caches each
op's sharding decision by its operands' specs, and a spec holds its device mesh; meshes compare
equal by shape and names, not by rank. Warmed over a fake group of the job's shape (as rank 0),
a forked rank 1 got rank 0's mesh back from those caches: its parameters' ``get_coordinate()``
said ``(0,)``, which DTensor and DCP use to place shards (seen here; a bench run of that version
also reported a weights mismatch). A one-rank mesh never equals a sharded group's
(``parallel.group = "fsdp"`` needs two ranks or more), so nothing cached here is handed to a real
rank; what stays warm is the rank-free part, most of the cost
(``tests/integration/test_warm_sharding.py`` checks both).
"""

from __future__ import annotations

import sys
from typing import Any

import torch

from harness.config import JobConfig
from runtime.actor import wire_name


def warm_sharding(cfg: dict[str, Any]) -> None:
    """Shard a throwaway copy of the job's model (``cfg``: ``config_to_dict`` of the job) over a
    fake group of one rank, as ``harness.rank.group_layout.Sharded`` does, and train one step on
    it with the job's optimizer (the module doc says why one rank). Leaves no process group
    behind."""
    import torch.distributed as dist

    try:  # registers the "fake" backend (torch's own, kept with its distributed tests)
        from torch.testing._internal.distributed.fake_pg import FakeStore
    except ImportError as exc:  # a torch without it: replacements pay as before
        print(f"ftharness: sharding not warmed before forks: {exc}", file=sys.stderr)
        return

    from harness.config import config_from_dict
    from harness.rank.group_layout import Asks, Sharded
    from harness.rank.model import _build, build_optimizer, loss_fn, model_blocks

    if dist.is_initialized():
        return  # not an agent before its forks: nothing to do
    job = config_from_dict(cfg)
    d = job.data
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # no OpenMP pool in a process that forks (model.prebuild)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=1)  # one: module doc
    try:
        net = _build(job.model, d.vocab_size, d.seed)  # not the prebuilt one: it stays untouched
        layout = Sharded(net, model_blocks(net), across=lambda t: None)
        opt = build_optimizer(net, job.optim)
        with torch.random.fork_rng(devices=[]):
            inputs = torch.randint(0, d.vocab_size, (d.batch_size, d.seq_len))
        opt.zero_grad(set_to_none=False)
        loss = loss_fn(net(inputs), inputs)
        layout.backward(loss, Asks())
        layout.average(net, contribute=True)
        opt.step()
    finally:
        dist.destroy_process_group()
        torch.set_num_threads(threads)


def warmup_calls(cfg: JobConfig) -> tuple[tuple[str, dict[str, Any]], ...]:
    """The host agents' warm-up calls for ``cfg`` (``AgentConfig.warmup``); none for a program
    (its own code builds its model)."""
    from harness.config import config_to_dict
    from harness.rank.model import prebuild_call

    if cfg.program.enabled:
        return ()
    calls = [prebuild_call(cfg)]
    if cfg.parallel.group == "fsdp":  # (a config with one rank is refused: config.py)
        calls.append((wire_name(warm_sharding), {"cfg": config_to_dict(cfg)}))
    return tuple(calls)
