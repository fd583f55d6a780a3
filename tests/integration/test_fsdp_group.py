"""Sharded replica groups (``parallel.group = "fsdp"``), numerically: two groups of two ranks,
real processes, FSDP2 over gloo on CPU (``fsdp_group_proc.py``).

What a user relies on: the gradient each rank steps with is the mean over every rank of every
group (gloo's AVG under FSDP2 is reported to sum, pytorch#162338: the layout forces SUM and
divides), each rank holds only its shard, and the state a heal carries (a rank's own shards)
loads into a fresh sharded copy bitwise, optimizer included, so the two then step identically;
and the asks a step carries (a sparse quorum's flag, a checkpoint asked for, a non-finite loss)
reach every rank of every group (quorum, non-finite) or of the asking group (checkpoint), riding
on the gradients' collectives.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import torch
from fsdp_group_proc import GROUPS, MODEL, RANKS, VOCAB, batch
from trainer_procs import REPO

from harness.rank.model import build_model, loss_fn


def _free_ports(n: int) -> int:
    """A base port with ``n`` free ports after it (probed; good enough on a test machine)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        if base + n >= 65535:
            continue
        try:
            for i in range(n):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", base + i))
        except OSError:
            continue
        return base
    raise RuntimeError("no free port range")


def _reference_grads() -> dict[str, torch.Tensor]:
    """The mean gradient over every rank's batch of every group, on one unsharded model."""
    model = build_model(MODEL, vocab_size=VOCAB, seed=0)
    for g in range(GROUPS):
        for r in range(RANKS):
            inputs, targets = batch(g, r)
            (loss_fn(model(inputs), targets) / (GROUPS * RANKS)).backward()
    return {n: p.grad for n, p in model.named_parameters()}


def test_sharded_groups_average_every_rank_of_every_group(tmp_path: Path) -> None:
    port = _free_ports(3)
    outs = {(g, r): tmp_path / f"g{g}r{r}.json" for g in range(GROUPS) for r in range(RANKS)}
    script = Path(__file__).with_name("fsdp_group_proc.py")
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), str(g), str(r), str(port), str(out)],
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for (g, r), out in outs.items()
    ]
    logs = [p.communicate(timeout=120)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), "\n".join(logs)

    want = _reference_grads()
    for (g, r), out in outs.items():
        got = json.loads(out.read_text())
        for name, ref in want.items():
            grad = torch.tensor(got["grads"][name])
            assert torch.allclose(grad, ref, atol=1e-6, rtol=1e-5), (
                f"group {g} rank {r} {name}: max error {(grad - ref).abs().max().item():.3g}"
            )
            first = -(-ref.shape[0] // RANKS)  # FSDP2 splits dim 0 as torch.chunk does
            rows = [first, ref.shape[0] - first][r]
            assert got["shards"][name] == [rows, *ref.shape[1:]], f"{name}: not this rank's shard"
        assert got["equal_after_load"], f"group {g} rank {r}: loaded shards differ"
        assert got["equal_after_step"], f"group {g} rank {r}: a step after the load differs"
        # Step 1: group 0's rank 1 asked for a quorum, group 1's rank 0 for a checkpoint,
        # group 1's rank 1 had a non-finite loss. Steps 2 (the model and its loaded copy, both
        # in group g's world): nobody asked.
        assert got["agreed"] == [[True, g == 1, True], [False] * 3, [False] * 3], (g, r)
