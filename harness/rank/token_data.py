"""The token-file data kind (``data.kind = "tokens"``), and the held-out batches.

:class:`TokenFileStream` is :class:`harness.rank.data.TokenStream` with real text: everything
about positions, shards, the ``skip`` and ``replay`` policies, resumption and healing is the
base class's, which depends only on how a global sequence index maps to tokens. Here that map is:
the training split cut into ``C = (train_tokens - 1) // seq_len`` chunks of ``seq_len + 1`` tokens
(inputs and the shifted targets, consecutive chunks sharing one token, as nanoGPT reads its
``train.bin``), and sequence ``i`` is chunk ``perm_e[i mod C]`` of epoch ``e = i // C``, where
``perm_e`` is a permutation drawn from ``(seed, e)``. So sequence ``i`` still depends only on
``(seed, i)`` (any process reads any batch without the ones before it), the first ``C`` indices
read every chunk of the split exactly once (so ``replay``'s "every sequence exactly once" holds
for the text too), and the order is shuffled (a batch does not hold neighbouring lines of one
file).

:class:`HeldOut`: ``eval_batches`` batches of the held-out split (documents never trained on),
chunks spread evenly over it, fixed by the corpus and the config alone: every run, policy and
control evaluates the same ones.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import torch

from harness.config import DataConfig
from harness.corpus.tokenfile import Corpus, CorpusError, open_corpus
from harness.rank.data import TokenStream
from harness.rank.model import loss_fn


def _open(cfg: DataConfig) -> Corpus:
    if cfg.corpus is None:  # resolve_data (harness.corpus.job) sets it before workers start
        raise CorpusError('data.kind = "tokens" needs data.corpus resolved (harness.corpus.job)')
    # The CLI process checked the checksums; a worker checks the sizes only.
    return open_corpus(cfg.corpus, verify=False)


class TokenFileStream(TokenStream):
    """One replica group's shard of a token file's training split (see the module doc)."""

    def __init__(
        self,
        cfg: DataConfig,
        *,
        shard: int,
        num_shards: int,
        group_size: int = 1,
        corpus: Corpus | None = None,
    ) -> None:
        super().__init__(cfg, shard=shard, num_shards=num_shards, group_size=group_size)
        self.corpus = corpus or _open(cfg)
        self._tokens = self.corpus.split("train")
        self.chunks = (len(self._tokens) - 1) // cfg.seq_len
        if self.chunks < 1:
            raise CorpusError(
                f"data.seq_len = {cfg.seq_len} is longer than the corpus {self.corpus.path}"
            )
        self._span = np.arange(cfg.seq_len + 1, dtype=np.int64)
        self._perms: dict[int, np.ndarray] = {}

    def _perm(self, epoch: int) -> np.ndarray:
        perm = self._perms.get(epoch)
        if perm is None:
            g = torch.Generator().manual_seed((self.cfg.seed * 1_000_003 + epoch) & (2**63 - 1))
            perm = torch.randperm(self.chunks, generator=g).numpy()
            self._perms = {epoch: perm}  # one epoch at a time (batches cross a boundary rarely)
        return perm

    def chunk_of(self, index: int) -> int:
        """The chunk of the training split that global sequence ``index`` reads."""
        epoch, j = divmod(index, self.chunks)
        return int(self._perm(epoch)[j])

    def _rows(self, first: int, n: int) -> torch.Tensor:
        starts = np.asarray([self.chunk_of(first + k) for k in range(n)], dtype=np.int64)
        rows = np.asarray(self._tokens[starts[:, None] * self.cfg.seq_len + self._span], np.int64)
        return torch.from_numpy(rows)

    def sequence(self, index: int) -> torch.Tensor:
        return self._rows(index, 1)[0]

    def _sequences(self, start: int, n: int) -> torch.Tensor:
        return self._rows(start, n)

    def key(self, index: int) -> int:
        """The chunk: bad data in the corpus is met again at each epoch, under another index."""
        return self.chunk_of(index)

    def where(self, key: int) -> dict[str, Any]:
        """The chunk's offset in the training split, and its document and offset in that."""
        offset = key * self.cfg.seq_len
        index = self.corpus.index
        doc = int(np.searchsorted(index, offset, side="right")) - 1
        return {
            "chunk": key,
            "offset": offset,
            "document": doc,
            "in_document": offset - int(index[doc]),
        }


def make_stream(
    cfg: DataConfig, *, shard: int, num_shards: int, group_size: int = 1
) -> TokenStream:
    """The data stream ``cfg.kind`` names."""
    if cfg.kind == "tokens":
        return TokenFileStream(cfg, shard=shard, num_shards=num_shards, group_size=group_size)
    return TokenStream(cfg, shard=shard, num_shards=num_shards, group_size=group_size)


class HeldOut:
    """The fixed held-out batches of a config, and a model's mean loss on them."""

    def __init__(self, cfg: DataConfig, corpus: Corpus | None = None) -> None:
        corpus = corpus or _open(cfg)
        held = corpus.split("heldout")
        count = max(0, len(held) - 1) // cfg.seq_len
        n = cfg.eval_batches * cfg.batch_size
        if count < n:
            raise CorpusError(
                f"{n} held-out sequences wanted, the held-out split of {corpus.path} has {count}"
            )
        chunks = np.linspace(0, count - 1, n).round().astype(np.int64)
        span = np.arange(cfg.seq_len + 1, dtype=np.int64)
        rows = torch.from_numpy(np.asarray(held[chunks[:, None] * cfg.seq_len + span], np.int64))
        self.batches = [
            (b[:, :-1], b[:, 1:]) for b in rows.reshape(cfg.eval_batches, cfg.batch_size, -1)
        ]

    @property
    def tokens(self) -> int:
        return sum(int(x.numel()) for x, _ in self.batches)

    def record(self, model: torch.nn.Module, *, step: int, replica: int, rank: int) -> dict:
        """The fields of an ``eval`` journal record for ``model`` at committed step ``step``."""
        t0 = time.perf_counter()
        loss = self.loss(model)
        return {
            "replica": replica,
            "rank": rank,
            "step": step,
            "heldout_loss": loss,
            "sequences": len(self.batches) * int(self.batches[0][0].shape[0]),
            "tokens": self.tokens,
            "seconds": time.perf_counter() - t0,
        }

    def loss(self, model: torch.nn.Module) -> float:
        """Mean next-token loss over the held-out batches; no gradient, the model untouched."""
        with torch.no_grad():
            losses = [float(loss_fn(model(x), y)) for x, y in self.batches]
        return sum(losses) / len(losses)
