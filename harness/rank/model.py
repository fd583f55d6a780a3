"""The models: a tiny plain-torch causal LM for fast tests, and torchtitan's llama3 debug model.

Nothing here knows about fault tolerance: a model is built deterministically from a seed, takes
token ids ``(B, L)`` and returns logits ``(B, L, vocab)``. torchtitan is imported only inside
:func:`_build_llama3_debug`, so importing this module (and training ``tiny``) stays fast.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F
from torch import nn

from harness.config import JobConfig, ModelConfig, OptimConfig
from runtime.actor import wire_name

#: The llama3 debug model's vocabulary (torchtitan's ``debugmodel``); data must match it.
LLAMA3_DEBUG_VOCAB = 2048
#: The tiny model's context length bound (positional embedding table size).
TINY_MAX_SEQ = 1024


class _Block(nn.Module):
    """Pre-norm transformer block: causal self-attention then an MLP."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.ln2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.ln2(x))


class TinyLM(nn.Module):
    """A small GPT-style causal LM (a few hundred K parameters at the defaults)."""

    def __init__(self, *, vocab_size: int, dim: int, layers: int, heads: int) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab_size, dim)
        self.pos = nn.Embedding(TINY_MAX_SEQ, dim)
        self.blocks = nn.ModuleList(_Block(dim, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab_size, bias=False)
        for name, p in self.named_parameters():
            if name.endswith("weight") and p.dim() == 2:
                nn.init.normal_(p, std=0.02 / (math.sqrt(2 * layers) if "proj" in name else 1))
            elif name.endswith("bias"):
                nn.init.zeros_(p)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        t = tokens.shape[1]
        x = self.tok(tokens) + self.pos(torch.arange(t, device=tokens.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def _build_llama3_debug(vocab_size: int = LLAMA3_DEBUG_VOCAB) -> nn.Module:
    """torchtitan's llama3 ``debugmodel`` (dim 256, 6 layers, vocab 2048) in float32 on CPU,
    its embedding and output head resized to ``vocab_size`` (a tokenizer's, ``data.kind =
    "tokens"``) when that is not 2048.

    Built on the meta device, materialised with ``to_empty`` and initialised by torchtitan's own
    ``init_states``. Flex attention has no CPU backward, so every layer's inner attention is
    swapped for torchtitan's plain causal ``ScaledDotProductAttention``.
    """
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.llama3 import model_registry

    cfg = model_registry("debugmodel").model
    if vocab_size != cfg.vocab_size:
        cfg = dataclasses.replace(
            cfg,
            vocab_size=vocab_size,
            tok_embeddings=dataclasses.replace(cfg.tok_embeddings, num_embeddings=vocab_size),
            lm_head=dataclasses.replace(cfg.lm_head, out_features=vocab_size),
        )
    with torch.device("meta"):
        model = cfg.build()
    for layer in model.layers.values():
        layer.attention.inner_attention = ScaledDotProductAttention(
            ScaledDotProductAttention.Config()
        )
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_states(buffer_device=torch.device("cpu"))
    return model.float()


#: A model built ahead of need by :func:`prebuild`, keyed by its build arguments.
_prebuilt: dict[tuple[ModelConfig, int, int], nn.Module] = {}


def prebuild(model: dict, vocab_size: int, seed: int) -> None:
    """Build a model now and keep it for the next :func:`build_model` with the same arguments.

    Host agents call it once before they fork (``runtime.messages.AgentConfig.warmup``): every
    worker forked afterwards, a replacement among them, then finds its initial model already
    built (its own copy-on-write copy) instead of paying for construction and initialisation
    on the recovery path (0.2-0.35 s for the llama3 debug model here)."""
    cfg = ModelConfig(**model)
    # One thread: an OpenMP pool started in the agent would not survive its forks (GNU libgomp
    # is not fork-safe), and each worker sets its own thread count.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        _prebuilt[(cfg, vocab_size, seed)] = _build(cfg, vocab_size, seed)
    finally:
        torch.set_num_threads(threads)


def prebuild_call(cfg: JobConfig) -> tuple[str, dict]:
    """The host agents' warm-up call (``AgentConfig.warmup``) that prebuilds ``cfg``'s model."""
    return (
        wire_name(prebuild),
        {
            "model": dataclasses.asdict(cfg.model),
            "vocab_size": cfg.data.vocab_size,
            "seed": cfg.data.seed,
        },
    )


def model_modules(cfg: JobConfig) -> tuple[str, ...]:
    """The model code host agents preload: torchtitan (~2 s to import) only for its model."""
    if cfg.model.kind == "llama3_debug":
        return ("torchtitan.models.llama3", "torchtitan.models.common.attention")
    return ()


def build_model(cfg: ModelConfig, *, vocab_size: int, seed: int) -> nn.Module:
    """Build the model named by ``cfg.kind`` with weights drawn from ``seed``: the same arguments
    give bitwise-identical parameters in every process. ``vocab_size`` must be the data's (the
    llama3 debug model's own is 2048; another resizes its embedding and head). A model
    :func:`prebuild` made with these arguments is handed out once (it is what this call would
    build: nothing has touched it since)."""
    model = _prebuilt.pop((cfg, vocab_size, seed), None)
    return model if model is not None else _build(cfg, vocab_size, seed)


def _build(cfg: ModelConfig, vocab_size: int, seed: int) -> nn.Module:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        if cfg.kind == "tiny":
            return TinyLM(vocab_size=vocab_size, dim=cfg.dim, layers=cfg.layers, heads=cfg.heads)
        if cfg.kind == "llama3_debug":
            return _build_llama3_debug(vocab_size)
    raise ValueError(f"model.kind = {cfg.kind!r}: must be 'tiny' or 'llama3_debug'")


def build_optimizer(model: nn.Module, optim: OptimConfig) -> torch.optim.AdamW:
    """The job's optimizer over ``model``'s parameters (built after a sharded group has sharded
    them): AdamW with ``optim``'s hyperparameters. One place, so that the trainer, the host
    agents' warm-up (``harness.rank.warm``) and the overhead bench's plain-torch baseline train
    with the same one."""
    return torch.optim.AdamW(
        model.parameters(), lr=optim.lr, betas=optim.betas, weight_decay=optim.weight_decay,
        eps=optim.eps,
    )  # fmt: skip


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy; ``logits`` (B, L, V), ``targets`` (B, L)."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))


def model_blocks(model: nn.Module) -> list[nn.Module]:
    """The model's transformer blocks, in order: FSDP2's unit of sharding
    (``harness.rank.group_layout.Sharded`` wraps each, then the root)."""
    if isinstance(model, TinyLM):
        return list(model.blocks)
    layers = getattr(model, "layers", None)  # torchtitan's llama3: a ModuleDict of blocks
    if isinstance(layers, nn.ModuleDict):
        return list(layers.values())
    raise ValueError(f"{type(model).__name__}: no transformer blocks to shard")
