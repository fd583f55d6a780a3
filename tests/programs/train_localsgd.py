"""A plain torchft LocalSGD program (semi-synchronous training), written the way torchft's own
examples are: it knows nothing of ftharness (it must not import it) and reads everything a
torchft launcher gives through the environment (see ``train_ddp.py`` for the variables).

Usage: ``python train_localsgd.py STEPS SYNC_EVERY [STEP_SECONDS [PG_TIMEOUT_S]]``. STEPS: inner
steps to train (a multiple of SYNC_EVERY); SYNC_EVERY: inner steps between two syncs, each a
quorum and an average of the parameters across the replica groups (``torchft.local_sgd.
LocalSGD``); STEP_SECONDS: extra time per inner step, standing for a real model's compute;
PG_TIMEOUT_S: the gloo process group's timeout (torchft's default, 60 s, unless given).

The Manager runs with a synchronous quorum (``use_async_quorum=False``), so a replica group that
joins heals from a peer before its first sync. Its step counts syncs, so the program trains
until ``manager.current_step() == STEPS // SYNC_EVERY``. After every committed sync it prints
``sync S checksum H``: H is a digest of the parameters, which every group that committed sync S
holds the same (the average). A failed sync leaves the local parameters and is retried at the
same manager step after the next SYNC_EVERY inner steps.
"""

from __future__ import annotations

import hashlib
import os
import sys
import time
from datetime import timedelta

REQUIRED = ("REPLICA_GROUP_ID", "NUM_REPLICA_GROUPS", "TORCHFT_LIGHTHOUSE", "MASTER_ADDR")


def checksum(tensors: list) -> str:
    """A digest of ``tensors``' bytes, in order (equal only for bitwise-equal values)."""
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().contiguous().cpu().numpy().tobytes())
    return h.hexdigest()[:16]


def main() -> int:
    missing = [k for k in REQUIRED if not os.environ.get(k)]
    if missing or len(sys.argv) < 3:
        print(
            f"train_localsgd: missing environment {', '.join(missing)} or arguments; usage: "
            "train_localsgd.py STEPS SYNC_EVERY [STEP_SECONDS [PG_TIMEOUT_S]]",
            file=sys.stderr,
        )
        return 2
    steps, sync_every = int(sys.argv[1]), int(sys.argv[2])
    step_seconds = float(sys.argv[3]) if len(sys.argv) > 3 else 0.0
    pg_timeout = float(sys.argv[4]) if len(sys.argv) > 4 else 60.0
    if sync_every < 1 or steps % sync_every:
        print(
            f"train_localsgd: STEPS ({steps}) must be a multiple of SYNC_EVERY ({sync_every})",
            file=sys.stderr,
        )
        return 2
    syncs = steps // sync_every
    replica_group = int(os.environ["REPLICA_GROUP_ID"])

    import torch
    from torch import nn, optim
    from torchft import Manager, ProcessGroupGloo
    from torchft.local_sgd import LocalSGD

    # one intra-op thread: the groups share a few cores here (torch's default, a thread per core
    # in every process, oversubscribes them and makes each tiny step many times slower)
    torch.set_num_threads(1)
    torch.manual_seed(0)  # every group starts from the same weights
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 8))
    inner = optim.AdamW(model.parameters(), lr=1e-3)

    def load_state_dict(state_dict: dict) -> None:
        model.load_state_dict(state_dict["model"])
        inner.load_state_dict(state_dict["optim"])

    def state_dict() -> dict:
        return {"model": model.state_dict(), "optim": inner.state_dict()}

    manager = Manager(
        pg=ProcessGroupGloo(timeout=timedelta(seconds=pg_timeout)),
        min_replica_size=1,
        load_state_dict=load_state_dict,
        state_dict=state_dict,
        replica_id=f"train_localsgd_{replica_group}",
        use_async_quorum=False,
        timeout=timedelta(seconds=10),
    )
    criterion = nn.CrossEntropyLoss()
    data = torch.Generator().manual_seed(1000 + replica_group)
    print(
        f"train_localsgd: group {replica_group} training {steps} inner steps, "
        f"a sync every {sync_every}",
        flush=True,
    )
    last = manager.current_step()
    with LocalSGD(manager, model, inner, sync_every=sync_every):
        while manager.current_step() < syncs:
            inputs = torch.randn(16, 32, generator=data)
            labels = torch.randint(0, 8, (16,), generator=data)
            inner.zero_grad()
            loss = criterion(model(inputs), labels)
            time.sleep(step_seconds)
            loss.backward()
            inner.step()  # every sync_every-th call: a quorum, the average, the commit
            if manager.current_step() != last:
                last = manager.current_step()
                print(
                    f"sync {last} checksum {checksum(list(model.parameters()))} "
                    f"loss {loss.item():.4f}",
                    flush=True,
                )
    print(
        f"train_localsgd: group {replica_group} done at sync {manager.current_step()}", flush=True
    )
    manager.shutdown(wait=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
