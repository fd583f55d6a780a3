"""A plain torchft HSDP training program: FSDP2 shards the model over the ranks of its replica
group, torchft's quorum joins the groups. Written the way torchtitan's fault-tolerant mode wires
the two, it knows nothing of ftharness (it must not import it) and reads everything a launcher
gives through the environment, torchrun's conventions included:

    REPLICA_GROUP_ID, NUM_REPLICA_GROUPS   this replica group and how many there are
    TORCHFT_LIGHTHOUSE                     the quorum service (Manager reads it)
    MASTER_ADDR, MASTER_PORT               this group's store, hosted by the launcher's agent
    TORCHELASTIC_USE_AGENT_STORE=True      so every rank's ``env://`` process group is a client
    RANK, WORLD_SIZE                       this rank within its group

The wiring:

* ``dist.init_process_group("gloo")`` from the environment: the group's own world (one per
  replica group), and over it a 1-D device mesh ``("dp_shard",)``;
* ``fully_shard`` on each layer and on the root: every rank holds 1/WORLD_SIZE of each
  parameter and of AdamW's state, as DTensors;
* a torchft ``Manager`` (rank and world size within the group) with a **synchronous quorum**
  (``use_async_quorum=False``): a heal is loaded on the training thread before the forward pass,
  never while FSDP2 has the parameters unsharded (torchft RFC 343, torchtitan issue 4753);
* each gradient shard averaged across the groups through ``manager.allreduce`` in FSDP2's
  all-reduce hook (torchtitan's ``replicate_pg`` hook does the same through
  ``ManagedProcessGroup``), and the optimizer step gated by ``should_commit``
  (``torchft.Optimizer``);
* the heal state is each rank's own shards (``model.state_dict()`` and the optimizer's state
  are sharded DTensors): rank r of a replacement loads rank r's shards from a healthy group.

Each rank prints, every 10 steps and after a heal, a checksum of its own shards:
``train_hsdp: group G rank R step S shards CHECKSUM``; every group's rank R prints the same
checksum at the same step when the heal put the right shards in place.

Usage: ``python train_hsdp.py STEPS [STEP_SECONDS [PG_TIMEOUT_S]]`` (STEP_SECONDS: extra time per
step, standing for a real model's compute; PG_TIMEOUT_S: the gloo process groups' timeout, 5 s
unless given). Synthetic data; it exits 0 once the Manager has committed STEPS steps. A missing
variable is an error (exit code 2). ``TRAIN_HSDP_ENV_DUMP=DIR``: first write this rank's whole
environment into DIR (``dump_env.py``: for comparing it with torchrun's).
"""

from __future__ import annotations

import os
import sys
import time
import zlib
from datetime import timedelta

REQUIRED = ("REPLICA_GROUP_ID", "NUM_REPLICA_GROUPS", "TORCHFT_LIGHTHOUSE", "MASTER_ADDR")


def main() -> int:
    missing = [k for k in REQUIRED if not os.environ.get(k)]
    if missing:
        print(f"train_hsdp: missing environment {', '.join(missing)}", file=sys.stderr)
        return 2
    steps = int(sys.argv[1]) if len(sys.argv) > 1 else 100
    step_seconds = float(sys.argv[2]) if len(sys.argv) > 2 else 0.0
    pg_timeout = timedelta(seconds=float(sys.argv[3]) if len(sys.argv) > 3 else 5.0)
    group = int(os.environ["REPLICA_GROUP_ID"])
    num_groups = int(os.environ["NUM_REPLICA_GROUPS"])
    if os.environ.get("TRAIN_HSDP_ENV_DUMP"):
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from dump_env import dump

        dump(os.environ["TRAIN_HSDP_ENV_DUMP"])

    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule, fully_shard
    from torchft import Manager, Optimizer, ProcessGroupGloo

    dist.init_process_group("gloo", timeout=pg_timeout)  # env://: the agent's store
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp_shard",))

    torch.manual_seed(0)  # every group starts from the same weights
    model = nn.Sequential(
        nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 8)
    )
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    inner = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def shards_checksum() -> int:
        crc = 0
        for p in model.parameters():
            crc = zlib.crc32(p.to_local().detach().numpy().tobytes(), crc)
        return crc

    def load_state_dict(state_dict: dict) -> None:
        model.load_state_dict(state_dict["model"])
        inner.load_state_dict(state_dict["optim"])
        print(f"train_hsdp: group {group} rank {rank} healed", flush=True)

    def state_dict() -> dict:
        return {"model": model.state_dict(), "optim": inner.state_dict()}

    manager = Manager(
        pg=ProcessGroupGloo(timeout=pg_timeout),
        min_replica_size=1,
        load_state_dict=load_state_dict,
        state_dict=state_dict,
        replica_id=f"train_hsdp_{group}",
        # heal on the training thread, never mid-forward (TRAIN_HSDP_ASYNC_QUORUM=1: torchft's
        # default, for a test that shows what goes wrong then)
        use_async_quorum=os.environ.get("TRAIN_HSDP_ASYNC_QUORUM") == "1",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=10),
    )

    def average_across_groups(shard: torch.Tensor) -> None:
        manager.allreduce(shard).wait()  # AVG over the participating groups, in place

    for m in model.modules():
        if isinstance(m, FSDPModule):
            # gloo's AVG reduce-scatter is not trusted (pytorch#162338): SUM, then FSDP divides
            m.set_force_sum_reduction_for_comms(True)
            m.set_all_reduce_hook(average_across_groups)
    optimizer = Optimizer(manager, inner)
    criterion = nn.CrossEntropyLoss()
    data = torch.Generator().manual_seed(1000 + 10 * group + rank)
    print(f"train_hsdp: group {group}/{num_groups} rank {rank}/{world} training to step {steps}")
    last = manager.current_step()
    while manager.current_step() < steps:
        inputs = torch.randn(16, 32, generator=data)
        labels = torch.randint(0, 8, (16,), generator=data)
        optimizer.zero_grad()  # the quorum, synchronous: a heal is loaded here
        if manager.current_step() > last + 1:
            print(
                f"train_hsdp: group {group} rank {rank} step {manager.current_step()} "
                f"shards {shards_checksum():08x} (healed)",
                flush=True,
            )
        loss = criterion(model(inputs), labels)
        time.sleep(step_seconds)
        loss.backward()  # FSDP2 reduce-scatters in the group, the hook averages across groups
        optimizer.step()  # commits only if every rank of every group saw a clean step
        last = manager.current_step()
        if last % 10 == 0:
            print(
                f"train_hsdp: group {group} rank {rank} step {last} shards "
                f"{shards_checksum():08x} loss {loss.item():.4f}",
                flush=True,
            )
    print(
        f"train_hsdp: group {group} rank {rank} done at step {manager.current_step()}", flush=True
    )
    # rank 0 serves the group's Manager: it shuts down only once every rank of the group has
    # had its answer to the last should_commit (else "transport error" in a slower rank)
    dist.barrier()
    manager.shutdown(wait=False)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
