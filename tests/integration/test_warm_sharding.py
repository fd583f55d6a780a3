"""A host agent warms FSDP2 and DTensor before it forks (``harness.rank.warm``): only a job with
sharded groups asks for it, it leaves no process group and no RNG change behind, a process
warmed that way trains bitwise like a cold one, and a rank other than 0 forked from it keeps its
own place in the mesh (a warm-up over a group of the job's shape handed rank 1 rank 0's mesh).

Each run is a fresh interpreter (a process group is process-wide): warm or not, then one sharded
step over a real one-rank gloo group, printing a hash of the weights after it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from harness.config import load_config
from harness.rank.warm import warmup_calls

REPO = Path(__file__).resolve().parents[2]

#: What both runs start with: an agent's preloads, the job, and (argv[1] == "warm") the agent's
#: warm-up calls after the model's prebuild, run as the agent runs them (runtime.agent).
PREAMBLE = """
import json, sys
import torch, torch.distributed as dist, xxhash
import harness.rank.actors  # what an agent preloads
from torch.testing._internal.distributed.fake_pg import FakeStore
from harness.config import load_config
from harness.rank.group_layout import Asks, Sharded
from harness.rank.model import build_model, build_optimizer, loss_fn, model_blocks
from harness.rank.warm import warmup_calls
from runtime.actor import resolve

cfg = load_config("experiments/tiny.toml", ["ranks=2", "parallel.group=fsdp"])
rng = torch.get_rng_state()
if sys.argv[1] == "warm":
    for target, kwargs in warmup_calls(cfg)[1:]:
        resolve(target)(**kwargs)
"""

STEP = (
    PREAMBLE
    + """
left = {"pg": dist.is_initialized(), "rng_same": bool(torch.equal(rng, torch.get_rng_state()))}
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
model = build_model(cfg.model, vocab_size=cfg.data.vocab_size, seed=0)
layout = Sharded(model, model_blocks(model), across=lambda t: None)
opt = build_optimizer(model, cfg.optim)
torch.manual_seed(1)
x = torch.randint(0, cfg.data.vocab_size, (cfg.data.batch_size, cfg.data.seq_len))
for _ in range(2):
    opt.zero_grad(set_to_none=False)
    layout.backward(loss_fn(model(x), x), Asks())
    layout.average(model, contribute=True)
    opt.step()
h = xxhash.xxh3_64()
for p in model.parameters():
    h.update(p.detach().full_tensor().contiguous().numpy().tobytes())
dist.destroy_process_group()
print(json.dumps({**left, "weights": h.hexdigest()}))
"""
)

RANK_1 = (
    PREAMBLE
    + """
dist.init_process_group("fake", store=FakeStore(), rank=1, world_size=2)
model = build_model(cfg.model, vocab_size=cfg.data.vocab_size, seed=0)
full = {k: v.detach().clone() for k, v in model.named_parameters()}
layout = Sharded(model, model_blocks(model), across=lambda t: None)
own = all(
    torch.equal(p.to_local(), torch.chunk(full[k], 2)[1]) for k, p in model.named_parameters()
)
x = torch.randint(0, cfg.data.vocab_size, (cfg.data.batch_size, cfg.data.seq_len))
layout.backward(loss_fn(model(x), x), Asks())
coords = {p.device_mesh.get_coordinate() for p in model.parameters()}
coords |= {p.grad.device_mesh.get_coordinate() for p in model.parameters()}
print(json.dumps({"coords": sorted(map(list, coords)), "own_shards": own}))
"""
)


def _run(mode: str, code: str = STEP) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", code, mode],
        cwd=REPO, capture_output=True, text=True, timeout=240, check=True,
    )  # fmt: skip
    return json.loads(out.stdout.strip().splitlines()[-1])


def _calls(*overrides: str) -> list[str]:
    return [name for name, _ in warmup_calls(load_config("experiments/tiny.toml", overrides))]


def test_only_sharded_jobs_warm_sharding() -> None:
    prebuild, warm = "harness.rank.model:prebuild", "harness.rank.warm:warm_sharding"
    assert _calls() == [prebuild]
    assert _calls("ranks=2") == [prebuild]
    assert _calls("ranks=2", "parallel.group=fsdp") == [prebuild, warm]


@pytest.mark.timeout(300)
def test_a_warmed_process_trains_bitwise_like_a_cold_one() -> None:
    cold, warm = _run("cold"), _run("warm")
    assert warm["pg"] is False and warm["rng_same"] is True  # nothing left behind
    assert warm["weights"] == cold["weights"]


@pytest.mark.timeout(300)
def test_a_rank_forked_from_a_warmed_process_keeps_its_place_in_the_mesh() -> None:
    out = _run("warm", RANK_1)
    assert out == {"coords": [[1]], "own_shards": True}
