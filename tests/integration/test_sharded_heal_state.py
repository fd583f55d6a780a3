"""What a sharded rank exports for a heal and loads from one (``Sharded.state_dict`` and
``load_state_dict``) is the state it trains: after loading a peer's export, every parameter
shard, buffer and optimizer shard is bitwise the peer's, and the next step of both is the same.

torchtitan's llama3 is the case that matters: its ``state_dict`` hook splits each layer's fused
``attention.qkv_linear.wqkv.weight`` into ``wq``/``wk``/``wv``, tensors made for the state dict,
not views of the parameter, so a heal that copied into ``model.state_dict()``'s tensors left the
healed group's attention weights its own (the checksum then named it diverged at the next check).

Each case is a fresh interpreter (a process group is process-wide): a real one-rank gloo world
(the loaded model trains a step after), and rank 1 of a two-rank world on the fake backend (real
half shards, no step)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

CODE = """
import io, json, sys
import torch, torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore
from harness.config import load_config
from experiments.bench.models import MODELS
from harness.rank.group_layout import Asks, Sharded
from harness.rank.model import build_model, build_optimizer, loss_fn, model_blocks

model_name, world = sys.argv[1], int(sys.argv[2])
torch.set_num_threads(1)
cfg = load_config("experiments/tiny.toml", [*MODELS[model_name], "ranks=2", "parallel.group=fsdp"])
if world == 1:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
else:
    dist.init_process_group("fake", store=FakeStore(), rank=1, world_size=world)
x = torch.randint(0, cfg.data.vocab_size, (cfg.data.batch_size, cfg.data.seq_len),
                  generator=torch.Generator().manual_seed(3))

def rank(seed):
    model = build_model(cfg.model, vocab_size=cfg.data.vocab_size, seed=seed)
    layout = Sharded(model, model_blocks(model), across=lambda t: None)
    opt = build_optimizer(model, cfg.optim)
    if world == 1:  # a step, so that the optimizer has state to heal
        step(model, layout, opt)
    return model, layout, opt

def step(model, layout, opt):
    opt.zero_grad(set_to_none=False)
    layout.backward(loss_fn(model(x), x), Asks())
    layout.average(model, contribute=True)
    opt.step()

def shards(model, layout, opt):
    out = {f"param.{k}": layout.local(p.detach()).clone() for k, p in model.named_parameters()}
    out |= {f"buffer.{k}": b.clone() for k, b in model.named_buffers()}
    for i, s in opt.state_dict()["state"].items():
        for key, v in s.items():
            out[f"optim.{i}.{key}"] = layout.local(v).clone()
    return out

source, target = rank(0), rank(1)
before = shards(*target)
buf = io.BytesIO()  # as a transport carries it: the target must not share the source's tensors
torch.save(source[1].state_dict(source[0], source[2]), buf)
buf.seek(0)
state = torch.load(buf, weights_only=False)
target[1].load_state_dict(target[0], target[2], state)
want, got = shards(*source), shards(*target)
result = {
    "names": len(want),
    "differ": sorted(k for k in want if not torch.equal(want[k], got.get(k))),
    "missing": sorted(set(want) - set(got)),
    "were_apart": sum(not torch.equal(want[k], before[k]) for k in want if k in before),
}
if world == 1:
    step(*source), step(*target)
    result["next_step_equal"] = all(
        torch.equal(a, b) for a, b in zip(source[0].parameters(), target[0].parameters())
    )
dist.destroy_process_group()
print(json.dumps(result))
"""


def _run(model: str, world: int) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", CODE, model, str(world)],
        cwd=REPO, capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-4000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.timeout(300)
@pytest.mark.parametrize("model", ["tiny", "llama3_debug"])
@pytest.mark.parametrize("world", [1, 2])
def test_a_loaded_shard_export_is_bitwise_the_source_state(model: str, world: int) -> None:
    out = _run(model, world)
    assert out["missing"] == [] and out["differ"] == []
    assert out["were_apart"] > 0  # the two ranks started apart: the load did something
    if world == 1:
        assert out["next_step_equal"] is True
