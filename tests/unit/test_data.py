"""The synthetic stream is deterministic, sharded without overlap, and resumes exactly."""

from __future__ import annotations

import pytest
import torch

from harness.config import DataConfig
from harness.rank.data import TokenStream

CFG = DataConfig(seed=3, seq_len=16, batch_size=4, vocab_size=64)


def _batches(stream: TokenStream, n: int) -> list[torch.Tensor]:
    out = []
    for _ in range(n):
        out.append(stream.batch()[0].clone())
        stream.advance()
    return out


def test_same_seed_same_stream_other_seed_differs() -> None:
    a = _batches(TokenStream(CFG, shard=1, num_shards=3), 3)
    b = _batches(TokenStream(CFG, shard=1, num_shards=3), 3)
    assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    other = DataConfig(seed=4, seq_len=16, batch_size=4, vocab_size=64)
    c = _batches(TokenStream(other, shard=1, num_shards=3), 1)
    assert not torch.equal(a[0], c[0])


def test_targets_are_inputs_shifted() -> None:
    inputs, targets = TokenStream(CFG, shard=0, num_shards=1).batch()
    assert inputs.shape == targets.shape == (4, 16)
    assert torch.equal(inputs[:, 1:], targets[:, :-1])


def test_shards_never_read_the_same_sequence() -> None:
    seen: set[int] = set()
    for shard in range(3):
        s = TokenStream(CFG, shard=shard, num_shards=3)
        for pos in range(5):
            first = s.first_index(pos)
            idx = set(range(first, first + CFG.batch_size))
            assert not idx & seen
            seen |= idx


def test_batch_does_not_advance_and_resume_is_exact() -> None:
    s = TokenStream(CFG, shard=2, num_shards=3)
    assert torch.equal(s.batch()[0], s.batch()[0])  # an aborted step retries the same batch
    _batches(s, 5)
    state = s.state_dict()
    expected = _batches(s, 2)
    resumed = TokenStream(CFG, shard=2, num_shards=3)
    resumed.load_state_dict(state)
    assert resumed.position == 5
    assert all(torch.equal(x, y) for x, y in zip(_batches(resumed, 2), expected, strict=True))


def test_stream_is_learnable() -> None:
    """Most next tokens follow one affine rule: a model can beat the uniform loss."""
    s = TokenStream(CFG, shard=0, num_shards=1)
    seq = s.sequence(0)
    follows = sum(int(seq[t + 1]) == (s._a * int(seq[t]) + s._b) % 64 for t in range(16))
    assert follows >= 10


REPLAY = DataConfig(seed=3, seq_len=16, batch_size=4, vocab_size=64, policy="replay")


def _first_seq(stream: TokenStream, slot: int | None) -> int:
    """The global index of the first sequence in the stream's current batch, read back."""
    got = stream.batch(slot)[0][0]
    start = stream._first(slot)
    assert torch.equal(got, stream.sequence(start)[:-1])
    return start


def test_replay_with_every_group_up_reads_what_skip_reads() -> None:
    skip = [TokenStream(CFG, shard=s, num_shards=6, group_size=2) for s in range(6)]
    replay = [TokenStream(REPLAY, shard=s, num_shards=6, group_size=2) for s in range(6)]
    for _ in range(4):
        for s in range(6):
            # every group up: its slot in the quorum is its replica index
            assert torch.equal(skip[s].batch()[0], replay[s].batch(slot=s // 2)[0])
        for st in skip + replay:
            st.advance(participants=3)


def _simulate(policy: DataConfig, membership: list[list[int]]) -> tuple[list[int], int]:
    """Groups (1 rank each) commit one step per entry of ``membership`` (the groups up at
    that step); a group that comes back heals its data state from a live peer. Returns every
    sequence trained (with repeats) and the due frontier."""
    n = 3
    streams = {g: TokenStream(policy, shard=g, num_shards=n) for g in range(n)}
    trained: list[int] = []
    due = 0
    up_before = set(range(n))
    for up in membership:
        peer = min(g for g in up if g in up_before)
        for g in set(up) - up_before:  # back: heal from a peer that was up
            streams[g] = TokenStream(policy, shard=g, num_shards=n)
            streams[g].load_state_dict(streams[peer].state_dict())
        for slot, g in enumerate(sorted(up)):
            first = streams[g]._first(slot if policy.policy == "replay" else None)
            trained += range(first, first + policy.batch_size)
        due = streams[peer].due(len(up))
        for g in up:
            streams[g].advance(participants=len(up))
        up_before = set(up)
    return trained, due


def test_replay_trains_every_sequence_once_through_failures_skip_loses_some() -> None:
    membership = [[0, 1, 2]] * 3 + [[0, 2]] * 4 + [[0, 1, 2]] * 2 + [[1]] * 2 + [[0, 1, 2]] * 3
    trained, due = _simulate(REPLAY, membership)
    assert sorted(trained) == list(range(due))  # each sequence below the frontier exactly once
    trained, due = _simulate(CFG, membership)
    assert len(set(trained)) == len(trained)  # skip never trains twice either...
    assert len(set(range(due)) - set(trained)) == (4 * 1 + 2 * 2) * CFG.batch_size  # ...but skips


def test_replay_needs_the_slot_and_old_states_resume() -> None:
    s = TokenStream(REPLAY, shard=1, num_shards=3)
    with pytest.raises(ValueError, match="slot"):
        s.batch()
    with pytest.raises(ValueError, match="participants"):
        s.advance()
    s.load_state_dict({"position": 5})  # saved before ``consumed`` existed
    assert s.consumed == 15
    assert _first_seq(s, 2) == (15 + 2) * REPLAY.batch_size
