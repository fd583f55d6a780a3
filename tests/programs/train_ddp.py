"""A plain torchft training program, written the way torchft's own ``train_ddp.py`` is: it
knows nothing of ftharness (it must not import it) and reads everything a torchft launcher
gives through the environment.

    REPLICA_GROUP_ID, NUM_REPLICA_GROUPS   this replica group and how many there are
    TORCHFT_LIGHTHOUSE                     the quorum service (Manager reads it)
    MASTER_ADDR, MASTER_PORT               this group's store (Manager reads them)
    RANK, WORLD_SIZE                       this rank within its group (Manager reads them)

Usage: ``python train_ddp.py STEPS [STEP_SECONDS [PG_TIMEOUT_S]]`` (STEP_SECONDS: extra time per
step, standing for a real model's compute, so faults land mid-run on a fast machine;
PG_TIMEOUT_S: the gloo process group's timeout, 5 s unless given; torchft's default is 60 s).
Synthetic data, gloo, DistributedDataParallel and torchft's OptimizerWrapper; it exits 0 once the
Manager has committed STEPS steps.
A missing variable is an error (exit code 2) rather than a silent default: a program started
without its launcher's environment must not train on its own as replica group 0.

For a test only, ``TRAIN_DDP_WEDGE_GROUP=<r>`` makes group r's first incarnation, at its first
step that fails or has fewer groups than the one before (another group died), close its process
group and wait forever without asking for another quorum: what gloo leaves behind when it
loses the error of a send to the dead group (see ftharness's runtime/sockets.py). A replacement
(one that healed) never does it.
"""

from __future__ import annotations

import os
import sys
import time
from datetime import timedelta

REQUIRED = ("REPLICA_GROUP_ID", "NUM_REPLICA_GROUPS", "TORCHFT_LIGHTHOUSE", "MASTER_ADDR")


def main() -> int:
    missing = [k for k in REQUIRED if not os.environ.get(k)]
    if missing:
        print(f"train_ddp: missing environment {', '.join(missing)}", file=sys.stderr)
        return 2
    steps = int(sys.argv[1]) if len(sys.argv) > 1 else 100
    step_seconds = float(sys.argv[2]) if len(sys.argv) > 2 else 0.0
    pg_timeout = float(sys.argv[3]) if len(sys.argv) > 3 else 5.0
    replica_group = int(os.environ["REPLICA_GROUP_ID"])
    num_groups = int(os.environ["NUM_REPLICA_GROUPS"])

    import torch
    from torch import nn, optim
    from torchft import DistributedDataParallel, Manager, Optimizer, ProcessGroupGloo

    torch.manual_seed(0)  # every group starts from the same weights
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 8))
    inner = optim.AdamW(model.parameters(), lr=1e-3)

    def load_state_dict(state_dict: dict) -> None:
        model.load_state_dict(state_dict["model"])
        inner.load_state_dict(state_dict["optim"])

    def state_dict() -> dict:
        return {"model": model.state_dict(), "optim": inner.state_dict()}

    pg = ProcessGroupGloo(timeout=timedelta(seconds=pg_timeout))
    manager = Manager(
        pg=pg,
        min_replica_size=1,
        load_state_dict=load_state_dict,
        state_dict=state_dict,
        replica_id=f"train_ddp_{replica_group}",
        timeout=timedelta(seconds=10),
    )
    ddp = DistributedDataParallel(manager, model)
    optimizer = Optimizer(manager, inner)
    criterion = nn.CrossEntropyLoss()
    data = torch.Generator().manual_seed(1000 + replica_group)
    print(f"train_ddp: group {replica_group}/{num_groups} training to step {steps}", flush=True)
    wedge = os.environ.get("TRAIN_DDP_WEDGE_GROUP") == str(replica_group)
    last, groups = manager.current_step(), 0
    while manager.current_step() < steps:
        inputs = torch.randn(16, 32, generator=data)
        labels = torch.randint(0, 8, (16,), generator=data)
        optimizer.zero_grad()  # starts the quorum
        loss = criterion(ddp(inputs), labels)
        time.sleep(step_seconds)
        loss.backward()  # gradients are averaged across the participating groups
        optimizer.step()  # commits only if every rank of every group saw a clean step
        wedge = wedge and manager.current_step() <= last + 1  # a healed replacement never wedges
        last = manager.current_step()
        shrunk, groups = manager.num_participants() < groups, manager.num_participants()
        if wedge and (manager.errored() is not None or shrunk):
            print(f"train_ddp: group {replica_group} wedged at step {last}", flush=True)
            pg.abort()
            while True:
                time.sleep(3600)
        if manager.current_step() % 10 == 0:
            print(f"[{manager.current_step()}] loss = {loss.item():.4f}", flush=True)
    print(f"train_ddp: group {replica_group} done at step {manager.current_step()}", flush=True)
    wait_for_the_group()
    manager.shutdown(wait=False)
    return 0


def wait_for_the_group(timeout_s: float = 30.0) -> None:
    """Rank 0 serves its group's torchft Manager: had it shut down the moment its own last
    ``should_commit`` was answered, another rank's answer to the same call could still be on its
    way, and that rank fail with "transport error" (seen once in CI). So every rank counts
    itself done in the group's store, under this incarnation's replica id (torchft's rank 0
    writes a fresh one at each start), and rank 0 waits for them all: ``timeout_s`` at most, as
    a rank that died instead is its launcher's to restart."""
    from torch.distributed import TCPStore

    store = TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        is_master=False,
        wait_for_workers=False,
        timeout=timedelta(seconds=timeout_s),
    )
    key = f"train_ddp/done/{store.get('replica_id').decode()}"
    done = store.add(key, 1)
    deadline = time.monotonic() + timeout_s
    world = int(os.environ.get("WORLD_SIZE", "1"))
    while os.environ.get("RANK", "0") == "0" and done < world and time.monotonic() < deadline:
        time.sleep(0.05)
        done = store.add(key, 0)


if __name__ == "__main__":
    sys.exit(main())
