"""The token-file data kind on a real prepared corpus: exactly once under ``replay`` through a
kill, an aborted step and a heal; exact resumption; disjoint shards under ``skip``; the fixed
held-out batches. Streams are driven as the trainer drives them (batch at the quorum slot,
advance on commit, a replacement loads a peer's state); rows are checked by their tokens."""

from __future__ import annotations

import random
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch

from harness.config import DataConfig, ModelConfig
from harness.corpus.prepare import PrepareOptions, prepare
from harness.corpus.tokenfile import open_corpus
from harness.rank.model import build_model
from harness.rank.token_data import HeldOut, TokenFileStream, make_stream

WORDS = [
    "a",
    "replica",
    "group",
    "trains",
    "while",
    "another",
    "heals",
    "from",
    "its",
    "peer",
    "and",
    "nothing",
    "is",
    "lost",
]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("corpus")
    rng = random.Random(1)
    (root / "src").mkdir()
    for i in range(20):
        words = " ".join(rng.choice(WORDS) for _ in range(300))
        (root / "src" / f"d{i}.txt").write_text(f"# doc {i}\n{words}\n")
    prepare(str(root / "src"), root / "out", PrepareOptions(vocab_size=280, heldout=0.2),
            say=lambda _m: None)  # fmt: skip
    return root / "out"


def _cfg(corpus: Path, policy: str = "replay", **kw) -> DataConfig:
    base = {"seq_len": 16, "batch_size": 2, "eval_every": 5, "eval_batches": 2}
    return DataConfig(kind="tokens", corpus=str(corpus), policy=policy, **(base | kw))


def _rows_of_chunks(corpus: Path, seq_len: int, chunks: list[int]) -> Counter:
    train = open_corpus(corpus).split("train")
    return Counter(
        bytes(np.asarray(train[c * seq_len : c * seq_len + seq_len + 1])) for c in chunks
    )


def test_replay_trains_every_chunk_of_the_text_exactly_once_through_a_kill_and_a_heal(corpus):
    cfg = _cfg(corpus)
    streams = {g: TokenFileStream(cfg, shard=g, num_shards=3) for g in range(3)}
    chunks = streams[0].chunks
    per_step = cfg.batch_size  # sequences per group and step
    trained: Counter = Counter()
    up, step = [0, 1, 2], 0
    while streams[0].due(len(up)) <= chunks:  # the whole first epoch, not past it
        read = {}
        for slot, g in enumerate(up):
            x, y = streams[g].batch(slot)
            assert torch.equal(x[:, 1:], y[:, :-1])  # targets: the inputs shifted by one
            read[g] = torch.cat([x, y[:, -1:]], dim=1)
        step += 1
        if step == 7:  # a collective failed: nobody commits, the same batches are read again
            continue
        for g in up:
            trained.update(bytes(r.numpy().astype(np.uint16)) for r in read[g])
            streams[g].advance(len(up))
        if step == 10:  # group 1 is killed; the survivors take up its share
            up = [0, 2]
            del streams[1]
        if step == 20:  # its replacement heals from a peer and joins (quorum order by id)
            streams[1] = TokenFileStream(cfg, shard=1, num_shards=3)
            streams[1].load_state_dict(streams[2].state_dict())
            up = [0, 1, 2]
    done = streams[0].consumed * per_step  # sequences the job has committed
    assert done > chunks - 3 * per_step and step > 30
    # every sequence index below `done` trained once: each a distinct chunk of the split (the
    # first epoch is a permutation), read from the file as the trainer read it
    firsts = [streams[0].chunk_of(i) for i in range(done)]
    assert len(set(firsts)) == done
    assert trained == _rows_of_chunks(corpus, cfg.seq_len, firsts)
    assert sorted(streams[0].chunk_of(i) for i in range(chunks)) == list(range(chunks))


def test_positions_resume_exactly_and_the_order_is_a_shuffle_fixed_by_the_seed(corpus):
    cfg = _cfg(corpus)
    a = TokenFileStream(cfg, shard=0, num_shards=2)
    a.advance(2)
    a.advance(1)
    b = TokenFileStream(cfg, shard=0, num_shards=2)
    b.load_state_dict(a.state_dict())
    assert all(torch.equal(p, q) for p, q in zip(a.batch(1), b.batch(1), strict=True))
    order = [a.chunk_of(i) for i in range(20)]
    assert order != sorted(order)  # shuffled
    assert order == [TokenFileStream(cfg, shard=1, num_shards=2).chunk_of(i) for i in range(20)]
    other = TokenFileStream(_cfg(corpus, seed=5), shard=0, num_shards=2)
    assert order != [other.chunk_of(i) for i in range(20)]
    # past the first epoch, another permutation of the same chunks
    c = a.chunks
    assert sorted(a.chunk_of(c + i) for i in range(c)) == list(range(c))


def test_skip_shards_read_disjoint_sequences(corpus):
    cfg = _cfg(corpus, policy="skip")
    streams = [make_stream(cfg, shard=g, num_shards=3) for g in range(3)]
    assert all(isinstance(s, TokenFileStream) for s in streams)
    seen: list[int] = []
    for _ in range(5):
        for s in streams:
            first = s.first_index(s.position)
            seen += [s.chunk_of(first + k) for k in range(cfg.batch_size)]
            s.advance()
    assert len(seen) == len(set(seen)) == 5 * 3 * cfg.batch_size


def test_held_out_batches_are_fixed_held_out_text_and_evaluating_changes_nothing(corpus):
    cfg = _cfg(corpus)
    held = open_corpus(corpus).split("heldout")
    a = HeldOut(cfg)
    b = HeldOut(_cfg(corpus, policy="skip", seed=9))  # not the seed's or the policy's
    assert len(a.batches) == cfg.eval_batches
    text = bytes(np.asarray(held))
    for (x, y), (x2, y2) in zip(a.batches, b.batches, strict=True):
        assert torch.equal(x, x2) and torch.equal(y, y2)
        for row in torch.cat([x, y[:, -1:]], dim=1):
            assert bytes(row.numpy().astype(np.uint16)) in text  # from the held-out split
    model = build_model(ModelConfig(), vocab_size=open_corpus(corpus).vocab_size, seed=0)
    before = [p.detach().clone() for p in model.parameters()]
    rec = a.record(model, step=5, replica=0, rank=0)
    assert 0 < rec["heldout_loss"] < 10 and rec["tokens"] == 2 * 2 * 16
    assert all(torch.equal(p, q) for p, q in zip(before, model.parameters(), strict=True))
    assert all(p.grad is None for p in model.parameters())
