"""Both models build deterministically on CPU and train a step (forward, backward, AdamW)."""

from __future__ import annotations

import math

import pytest
import torch

from harness.config import ModelConfig
from harness.rank.model import LLAMA3_DEBUG_VOCAB, build_model, loss_fn


def _step(model: torch.nn.Module, vocab: int) -> float:
    tokens = torch.randint(0, vocab, (2, 33), generator=torch.Generator().manual_seed(0))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loss = loss_fn(model(tokens[:, :-1]), tokens[:, 1:])
    loss.backward()
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)
    opt.step()
    return loss.item()


def test_tiny_is_deterministic_and_trains() -> None:
    a = build_model(ModelConfig(kind="tiny"), vocab_size=256, seed=1)
    b = build_model(ModelConfig(kind="tiny"), vocab_size=256, seed=1)
    c = build_model(ModelConfig(kind="tiny"), vocab_size=256, seed=2)
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters(), strict=True))
    assert not torch.equal(next(a.parameters()), next(c.parameters()))
    n = sum(p.numel() for p in a.parameters())
    assert 50_000 < n < 2_000_000
    assert math.isfinite(_step(a, 256))


def test_tiny_does_not_import_torchtitan() -> None:
    import subprocess
    import sys

    code = (
        "import sys; from harness.config import ModelConfig; from harness.rank.model import "
        "build_model; build_model(ModelConfig(), vocab_size=64, seed=0); "
        "print('torchtitan' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


@pytest.mark.timeout(180)
def test_llama3_debug_builds_and_trains_on_cpu() -> None:
    a = build_model(ModelConfig(kind="llama3_debug"), vocab_size=LLAMA3_DEBUG_VOCAB, seed=0)
    b = build_model(ModelConfig(kind="llama3_debug"), vocab_size=LLAMA3_DEBUG_VOCAB, seed=0)
    assert 6_000_000 < sum(p.numel() for p in a.parameters()) < 6_500_000
    assert all(p.dtype == torch.float32 and p.device.type == "cpu" for p in a.parameters())
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters(), strict=True))
    assert math.isfinite(_step(a, LLAMA3_DEBUG_VOCAB))


def test_llama3_debug_takes_a_tokenizers_vocab() -> None:
    """data.kind = "tokens": the embedding and the head are resized to the tokenizer's."""
    m = build_model(ModelConfig(kind="llama3_debug"), vocab_size=300, seed=0)
    assert m(torch.zeros(1, 4, dtype=torch.long)).shape == (1, 4, 300)
    assert math.isfinite(_step(m, 300))


@pytest.mark.parametrize("kind", ["tiny", "llama3_debug"])
def test_a_prebuilt_model_is_what_build_model_builds_and_is_handed_out_once(kind):
    import dataclasses

    from harness.rank import model as model_module

    cfg = ModelConfig(kind=kind)
    vocab = 2048 if kind == "llama3_debug" else 256
    model_module.prebuild(dataclasses.asdict(cfg), vocab_size=vocab, seed=3)
    first = build_model(cfg, vocab_size=vocab, seed=3)
    second = build_model(cfg, vocab_size=vocab, seed=3)  # nothing prebuilt left: built now
    assert first is not second
    for (n1, a), (n2, b) in zip(
        first.state_dict().items(), second.state_dict().items(), strict=True
    ):
        assert n1 == n2 and torch.equal(a, b), n1
    assert not model_module._prebuilt
