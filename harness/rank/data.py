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

Two data policies (``DataConfig.policy``) say what becomes of a down group's sequences:

* ``skip`` (above): while a group is down its shard is not trained, and once healed it jumps to
  its peers' position: those sequences are never trained (``dashboards.data_coverage`` counts
  them from the journal).
* ``replay``: the stream is one queue of group batches, and ``consumed`` (how many the job has
  committed) is part of the state every group holds and heals. At each step the ``P``
  participating groups take group batches ``consumed .. consumed + P - 1``, one each in quorum
  order (torchft's participating rank); rank ``r`` of a group reads its ``r``-th part. When the
  step commits, ``consumed += P``. So the survivors take up the batches a down group would have
  read, and nothing is skipped or trained twice: every committed step trains the next ``P``
  unread batches (all participants' gradients are in the averaged update, even one whose group
  dies after the allreduce), and ``consumed`` only moves with commits and heals from a peer at
  the quorum's max step. With every group up, ``replay`` reads exactly what ``skip`` reads.
  Not guaranteed: a group left out of a quorum while alive (a split brain) would train the same
  batches as the quorum; the join timeout (``harness.config``) is what prevents that.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from harness.config import DataConfig

_NOISE = 0.1
#: A target the loss leaves out (``torch.nn.functional.cross_entropy``'s ``ignore_index``).
IGNORE = -100


class BadData(RuntimeError):
    """A step failed on data a rank blamed (``data.suspect``): the failure is the data's, not
    the trainer's (``harness.job.poison``, ``harness.job.trainer_deaths``)."""


class UnreadableData(RuntimeError):
    """A sequence that cannot be read (the ``poison_data`` fault's; a real loader's decoding
    error is whatever it raises)."""


def masked(
    inputs: torch.Tensor, targets: torch.Tensor, rows: list[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """``inputs`` and ``targets`` with ``rows`` trained on nothing: ids 0 in, :data:`IGNORE`
    out (copies: a batch's two are views of one tensor)."""
    if not rows:
        return inputs, targets
    inputs, targets = inputs.clone(), targets.clone()
    for j in rows:
        inputs[j] = 0
        targets[j] = IGNORE
    return inputs, targets


#: What the ``poison_data`` fault makes a sequence do (:meth:`TokenStream.poison`).
POISON_EFFECTS = ("unreadable", "nonfinite")


class TokenStream:
    """One replica group's shard of the stream. Not thread-safe; owned by one trainer."""

    def __init__(
        self, cfg: DataConfig, *, shard: int, num_shards: int, group_size: int = 1
    ) -> None:
        """``shard = replica * group_size + rank`` of ``num_shards = replicas * group_size``;
        ``group_size``: ranks per replica group (``replay`` splits a group batch among them)."""
        if not 0 <= shard < num_shards:
            raise ValueError(f"shard {shard} must be in [0, {num_shards})")
        if group_size < 1 or num_shards % group_size:
            raise ValueError(f"group_size {group_size} must divide num_shards {num_shards}")
        self.cfg = cfg
        self.shard = shard
        self.num_shards = num_shards
        self.group_size = group_size
        self.rank = shard % group_size
        self.position = 0  # committed steps (both policies)
        self.consumed = 0  # group batches the job has committed (``replay``)
        self.quarantined: set[int] = set()  # keys every group skips (:meth:`quarantine`)
        self.poisoned: set[int] = set()  # keys that cannot be read (:meth:`poison`)
        self.poisoned_nonfinite: set[int] = set()  # keys whose loss is not finite (:meth:`poison`)
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
        """Global index of the first sequence this shard reads at ``position`` (``skip``)."""
        return (position * self.num_shards + self.shard) * self.cfg.batch_size

    def _first(self, slot: int | None) -> int:
        if self.cfg.policy == "skip":
            return self.first_index(self.position)
        if slot is None:
            raise ValueError("the replay policy needs this group's slot in the step's quorum")
        return ((self.consumed + slot) * self.group_size + self.rank) * self.cfg.batch_size

    def batch(self, slot: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The batch to train now as ``(inputs, targets)``, each ``(batch, seq_len)``. ``slot``:
        this group's rank among the step's participants (``replay`` only). Does not advance:
        call :meth:`advance` once the step that trained it has committed.

        A quarantined sequence (:meth:`quarantine`) keeps its row, as ids 0 with every target
        :data:`IGNORE` (no loss, no gradient; the batch keeps its shape on every rank). A
        poisoned one (:meth:`poison`) cannot be read: :class:`UnreadableData` is raised, as a
        loader's decoding error would be."""
        start = self._first(slot)
        n = self.cfg.batch_size
        for index in range(start, start + n):
            self.check_readable(index)
        seqs = self._sequences(start, n)
        return self._screened(start, seqs[:, :-1], seqs[:, 1:])

    def _sequences(self, start: int, n: int) -> torch.Tensor:
        return torch.stack([self.sequence(start + j) for j in range(n)])

    def indices(self, slot: int | None = None) -> list[int]:
        """The global indices of the sequences :meth:`batch` reads, in its rows' order."""
        start = self._first(slot)
        return list(range(start, start + self.cfg.batch_size))

    # --- poison data (issue #50): data every group skips, and the fault that makes it bad ----

    def key(self, index: int) -> int:
        """What identifies global sequence ``index``'s data (the same data is the same key):
        the index itself here; a chunk of the corpus for a token file, read again each epoch."""
        return index

    def where(self, key: int) -> dict[str, Any]:
        """Where the data of ``key`` comes from, for the journal and the report."""
        return {"sequence": key}

    def quarantine(self, keys: Iterable[int]) -> None:
        """Skip the data of ``keys`` from now on (called from another thread: a set's update
        is atomic, and :meth:`batch` reads each key once)."""
        self.quarantined.update(int(k) for k in keys)

    def poison(self, key: int, effect: str = "unreadable") -> None:
        """The ``poison_data`` fault: the data of ``key`` cannot be read from now on
        (``effect = "unreadable"``), or its loss is not finite (``"nonfinite"``: as a sequence
        that overflows the model's numerics would; :meth:`poisoned_logits`)."""
        if effect not in POISON_EFFECTS:
            raise ValueError(f"poison effect must be one of {POISON_EFFECTS}, got {effect!r}")
        (self.poisoned if effect == "unreadable" else self.poisoned_nonfinite).add(int(key))

    def poisoned_logits(self, slot: int | None, logits: torch.Tensor) -> torch.Tensor:
        """``logits`` (batch, seq_len, vocab) of the batch :meth:`batch` read, NaN in the rows
        whose data is poisoned ``"nonfinite"`` (and not quarantined); ``logits`` itself if none
        is."""
        if not self.poisoned_nonfinite:
            return logits
        keys = [self.key(i) for i in self.indices(slot)]
        rows = [k in self.poisoned_nonfinite and k not in self.quarantined for k in keys]
        if not any(rows):
            return logits
        mask = torch.tensor(rows, device=logits.device).view(-1, 1, 1)
        return logits.masked_fill(mask, float("nan"))

    def check_readable(self, index: int) -> None:
        """Raise :class:`UnreadableData` if sequence ``index`` cannot be read (and is not
        quarantined: a quarantined one is not read)."""
        key = self.key(index)
        if key in self.poisoned and key not in self.quarantined:
            raise UnreadableData(f"sequence {index} (data {key}) cannot be decoded (poison_data)")

    def outside_vocabulary(self, inputs: torch.Tensor, targets: torch.Tensor) -> list[int]:
        """The rows of a batch holding an id the model has no embedding or output for (a
        corrupted shard's: the embedding would raise, or the loss read out of bounds)."""
        v = self.cfg.vocab_size
        bad = (inputs < 0) | (inputs >= v)
        bad_t = (targets >= v) | ((targets < 0) & (targets != IGNORE))
        return [int(r) for r in torch.nonzero(bad.any(dim=1) | bad_t.any(dim=1)).flatten()]

    def _screened(
        self, start: int, inputs: torch.Tensor, targets: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.quarantined:
            return inputs, targets
        skip = [j for j in range(inputs.shape[0]) if self.key(start + j) in self.quarantined]
        return masked(inputs, targets, skip)

    def trained_ranges(self, slot: int | None, participants: int) -> list[tuple[int, int]]:
        """The global sequences ``[first, end)`` a step committed now has trained, as far as
        this rank knows: its own batch (``skip``), or the whole step's (``replay``: the next
        ``participants`` group batches, every participant's gradient being in the update).
        Call before :meth:`advance`."""
        b = self.cfg.batch_size
        if self.cfg.policy == "skip":
            first = self._first(slot)
            return [(first, first + b)]
        per_group = self.group_size * b
        return [(self.consumed * per_group, (self.consumed + participants) * per_group)]

    def due(self, participants: int) -> int:
        """Every sequence below this index should have been trained once the step now being
        committed has (what the job would have read with no failure, or, for ``replay``, what
        it has handed out). Call before :meth:`advance`."""
        if self.cfg.policy == "skip":
            return (self.position + 1) * self.num_shards * self.cfg.batch_size
        return (self.consumed + participants) * self.group_size * self.cfg.batch_size

    def advance(self, participants: int | None = None) -> None:
        """A step committed with ``participants`` groups (``replay`` needs it)."""
        self.position += 1
        if self.cfg.policy == "skip":
            self.consumed += self.num_shards // self.group_size  # what the job handed out
        elif participants is None:
            raise ValueError("the replay policy advances by the step's participants")
        else:
            self.consumed += participants

    def state_dict(self) -> dict[str, Any]:
        return {"position": self.position, "consumed": self.consumed}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.position = int(state["position"])
        # A state saved before ``consumed`` existed: every group took part in every step.
        groups = self.num_shards // self.group_size
        self.consumed = int(state.get("consumed", self.position * groups))
