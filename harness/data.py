"""A deterministic synthetic token stream, sharded per replica group, seeded and resumable.

The stream is an infinite sequence of token sequences indexed by a global sequence number. Each
sequence follows a fixed affine rule ``next = (a * prev + b) mod vocab`` with 10% random tokens,
so a language model can learn it and the loss drops. Sequence ``i`` depends only on
``(seed, i)``: any process can produce any batch without reading the ones before it.

Sharding: at stream *position* ``p`` (one position = one step's batch), replica group ``shard``
of ``num_shards`` reads global sequences ``[(p * num_shards + shard) * batch_size, ... +
batch_size)``. Different groups never read the same sequence.

Resumption and healing: the position is the whole state (``state_dict``). The trainer advances it
only after a committed step, and a healed replacement loads it from the peer it healed from, so
its next batch is the one the healthy groups are about to train. Hence the invariant: *no stream
position is trained twice by the same group*, because positions only grow along a group's
committed steps and healing only moves a group forward (the peer is at or ahead of the step at
which the group died). An aborted step retries the same position; it trained nothing.
"""

from __future__ import annotations

from typing import Any

import torch

from harness.config import DataConfig

_NOISE = 0.1


class TokenStream:
    """One replica group's shard of the stream. Not thread-safe; owned by one trainer."""

    def __init__(self, cfg: DataConfig, *, shard: int, num_shards: int) -> None:
        if not 0 <= shard < num_shards:
            raise ValueError(f"shard {shard} must be in [0, {num_shards})")
        self.cfg = cfg
        self.shard = shard
        self.num_shards = num_shards
        self.position = 0
        g = torch.Generator().manual_seed(cfg.seed)
        # The rule is a property of the whole stream (same for every shard), so all groups learn
        # one distribution; an odd multiplier keeps the map a permutation for even vocabularies.
        self._a = int(torch.randint(1, cfg.vocab_size, (1,), generator=g)) | 1
        self._b = int(torch.randint(0, cfg.vocab_size, (1,), generator=g))

    def sequence(self, index: int) -> torch.Tensor:
        """Global sequence ``index``: ``seq_len + 1`` token ids (inputs plus the shifted target)."""
        v, n = self.cfg.vocab_size, self.cfg.seq_len + 1
        g = torch.Generator().manual_seed((self.cfg.seed * 1_000_003 + index) & (2**63 - 1))
        noise = torch.randint(0, v, (n,), generator=g)
        use_noise = torch.rand(n, generator=g) < _NOISE
        out = torch.empty(n, dtype=torch.long)
        tok = int(noise[0])
        for t in range(n):
            tok = int(noise[t]) if (t == 0 or use_noise[t]) else (self._a * tok + self._b) % v
            out[t] = tok
        return out

    def first_index(self, position: int) -> int:
        """Global index of the first sequence this shard reads at ``position``."""
        return (position * self.num_shards + self.shard) * self.cfg.batch_size

    def batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The batch at the current position as ``(inputs, targets)``, each ``(batch, seq_len)``.
        Does not advance: call :meth:`advance` once the step that trained it has committed."""
        start = self.first_index(self.position)
        seqs = torch.stack([self.sequence(start + j) for j in range(self.cfg.batch_size)])
        return seqs[:, :-1], seqs[:, 1:]

    def advance(self) -> None:
        self.position += 1

    def state_dict(self) -> dict[str, Any]:
        return {"position": self.position}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.position = int(state["position"])
