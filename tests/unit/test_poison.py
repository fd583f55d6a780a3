"""Poison data (issue #50): the stream's quarantine and poison, and the controller's rule that
quarantines the data two different groups failed on (``harness.job.poison``)."""

from __future__ import annotations

import pytest
import torch

from harness.config import DataConfig
from harness.job.poison import DataMarks, describe
from harness.rank.actors import poison_data, quarantine_data
from harness.rank.data import IGNORE, TokenStream, UnreadableData, masked
from runtime.journal import DATA_QUARANTINE, DATA_SUSPECT, POISON_DATA, SILENT_DIVERGENCE, Journal


def _stream() -> TokenStream:
    return TokenStream(DataConfig(batch_size=4, seq_len=8, vocab_size=64), shard=0, num_shards=1)


def test_a_quarantined_sequence_trains_nothing_and_a_poisoned_one_cannot_be_read():
    s = _stream()
    clean_x, clean_y = s.batch()
    first = s.indices()
    assert first == [0, 1, 2, 3]
    s.poison(first[1])
    with pytest.raises(UnreadableData, match=r"sequence 1 .* cannot be decoded"):
        s.batch()
    s.quarantine([first[1]])  # quarantined: not read, so it no longer fails the batch
    x, y = s.batch()
    assert torch.equal(x[1], torch.zeros_like(x[1])) and bool((y[1] == IGNORE).all())
    assert torch.equal(x[[0, 2, 3]], clean_x[[0, 2, 3]])
    assert torch.equal(y[[0, 2, 3]], clean_y[[0, 2, 3]])
    assert torch.equal(s.batch()[0], x)  # nothing of the stream itself changed


def test_ids_outside_the_vocabulary_are_found_in_inputs_and_targets_but_not_a_quarantined_row():
    s = _stream()
    x, y = s.batch()
    assert s.outside_vocabulary(x, y) == []
    x, y = x.clone(), y.clone()
    x[0, 3] = 64
    y[2, -1] = 70
    x[3, 0] = -1
    assert s.outside_vocabulary(x, y) == [0, 2, 3]
    x2, y2 = masked(x, y, [0, 2, 3])
    assert s.outside_vocabulary(x2, y2) == []  # IGNORE is no id


class _Sent:
    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def __call__(self, func, *args) -> None:
        self.calls.append((func, *args))


def _suspect(journal: Journal, replica: int, key: int, step: int = 5) -> None:
    journal.emit(
        DATA_SUSPECT,
        replica=replica,
        rank=0,
        step=step,
        what="IndexError: index out of range in self",
        sequences=[{"index": key + 100, "key": key, "sequence": key}],
    )


def test_data_two_groups_failed_on_is_quarantined_once_and_sent_to_every_trainer():
    journal = Journal(None, job="t")
    seen: list[dict] = []
    said: list[str] = []
    sent = _Sent()
    marks = DataMarks(journal, said.append, sent)
    journal.add_sink(marks.on_record)
    journal.add_sink(seen.append)

    _suspect(journal, 0, 7)
    _suspect(journal, 0, 7, step=6)  # the same group again: a broken replica, maybe
    assert sent.calls == [] and marks.marks()["quarantined"] == []

    _suspect(journal, 1, 7, step=6)
    (q,) = [r for r in seen if r["event"] == DATA_QUARANTINE]
    assert q["key"] == 7 and q["groups"] == [0, 1] and q["steps"] == [5, 6]
    assert q["what"].startswith("IndexError")
    assert sent.calls == [(quarantine_data, [7])]
    assert said == [f"quarantined {describe(q)}"]
    assert "sequence 7: groups 0, 1 failed on it with IndexError" in said[0]
    assert marks.marks() == {"poisoned": [], "poisoned_nonfinite": [], "quarantined": [7]}

    _suspect(journal, 2, 7)  # a group that missed it: sent again, not journaled again
    assert len([r for r in seen if r["event"] == DATA_QUARANTINE]) == 1
    assert sent.calls[-1] == (quarantine_data, [7])

    marks.poison(9)
    assert sent.calls[-1] == (poison_data, 9, "unreadable")
    marks.poison(10, "nonfinite")
    assert sent.calls[-1] == (poison_data, 10, "nonfinite")
    assert marks.marks() == {"poisoned": [9], "poisoned_nonfinite": [10], "quarantined": [7]}


def test_a_corpus_chunk_is_described_by_its_document():
    text = describe(
        {"key": 3, "chunk": 3, "offset": 768, "document": 2, "in_document": 40, "groups": [0, 2],
         "what": "IndexError: x"}
    )  # fmt: skip
    assert text == (
        "chunk 3 of the corpus (offset 768, document 2, offset 40 in it): groups 0, 2 failed on "
        "it with IndexError: x"
    )


def test_a_ranks_own_quarantine_goes_to_every_group_once():
    journal = Journal(None, job="t")
    said: list[str] = []
    sent = _Sent()
    marks = DataMarks(journal, said.append, sent)
    journal.add_sink(marks.on_record)
    found = dict(
        replica=2, rank=0, index=40, key=11, sequence=11, groups=[2], steps=[9],
        found="vocabulary", what="token id 300 outside the vocabulary of 256",
    )  # fmt: skip
    journal.emit(DATA_QUARANTINE, **found)
    journal.emit(DATA_QUARANTINE, **{**found, "replica": 1, "groups": [1]})  # met again
    assert sent.calls == [(quarantine_data, [11])]
    assert said == [
        "quarantined sequence 11: token id 300 outside the vocabulary of 256, found by group 2 "
        "before its pass"
    ]
    assert marks.marks()["quarantined"] == [11]


def test_a_controller_that_takes_over_keeps_what_the_dead_one_marked():
    """The dead controller's journal, read by the next (a takeover): its quarantined and
    poisoned keys reach the groups started from then on, a suspicion from before counts toward
    the second group, and nothing is journaled, sent or said again."""
    before = Journal(None, job="t")
    old: list[dict] = []
    before.add_sink(old.append)
    dead = DataMarks(before, lambda _: None, _Sent())
    before.add_sink(dead.on_record)
    _suspect(before, 0, 7)
    _suspect(before, 1, 7)  # quarantined by the dead controller
    _suspect(before, 2, 8)  # one suspicion of 8
    before.emit(POISON_DATA, key=9, index=12, effect="unreadable")
    before.emit(POISON_DATA, key=10, index=13, effect="nonfinite")

    journal = Journal(None, job="t")
    seen: list[dict] = []
    journal.add_sink(seen.append)
    said: list[str] = []
    sent = _Sent()
    marks = DataMarks.attach(journal, said.append, sent)
    marks.resume(old)
    assert marks.marks() == {"poisoned": [9], "poisoned_nonfinite": [10], "quarantined": [7]}
    assert seen == [] and sent.calls == [] and said == []

    _suspect(journal, 0, 8)  # a second group on 8: quarantined now
    (q,) = [r for r in seen if r["event"] == DATA_QUARANTINE]
    assert q["key"] == 8 and q["groups"] == [0, 2]
    assert sent.calls == [(quarantine_data, [8])]


def test_a_nonfinite_loss_on_equal_weights_quarantines_what_the_group_named_at_once():
    """A rank's non-finite suspicion is no failure and does not count toward the second group;
    the checksums' verdict (``silent.divergence``, action ``data``) quarantines what it named."""
    journal = Journal(None, job="t")
    seen: list[dict] = []
    journal.add_sink(seen.append)
    said: list[str] = []
    sent = _Sent()
    marks = DataMarks.attach(journal, said.append, sent)
    for replica in (0, 1):  # two groups' non-finite losses: no quarantine without the verdict
        journal.emit(
            DATA_SUSPECT, replica=replica, rank=0, step=12, found="nonfinite",
            what="non-finite loss", sequences=[{"index": 40, "key": 40, "sequence": 40}],
        )  # fmt: skip
    assert sent.calls == [] and marks.marks()["quarantined"] == []
    journal.emit(SILENT_DIVERGENCE, step=12, rank=0, cause="nonfinite", action="heal",
                 suspects=[1], majority=[0, 2])  # fmt: skip
    assert sent.calls == []  # weights that differ: the group is healed, the data not blamed
    journal.emit(SILENT_DIVERGENCE, step=12, rank=0, cause="nonfinite", action="data",
                 suspects=[0], majority=[1, 2])  # fmt: skip
    (q,) = [r for r in seen if r["event"] == DATA_QUARANTINE]
    assert (q["key"], q["found"], q["groups"], q["steps"]) == (40, "nonfinite", [0], [12])
    assert sent.calls == [(quarantine_data, [40])]
    assert said == [f"quarantined {describe(q)}"]
    assert "sequence 40: group 0 met a non-finite loss, on weights every group's" in said[0]


def test_a_nonfinite_poison_makes_its_rows_nan_until_quarantined():
    s = _stream()
    logits = torch.zeros(4, 8, 64)
    assert s.poisoned_logits(None, logits) is logits
    s.poison(2, "nonfinite")
    s.batch()  # still readable
    out = s.poisoned_logits(None, logits)
    assert bool(out[2].isnan().all()) and bool(torch.isfinite(out[[0, 1, 3]]).all())
    s.quarantine([2])
    assert s.poisoned_logits(None, logits) is logits
    with pytest.raises(ValueError, match="poison effect"):
        s.poison(3, "slow")


class _Groups:
    def __init__(self) -> None:
        self.poisoned: list[tuple[int, str]] = []

    def poison(self, key: int, effect: str) -> None:
        self.poisoned.append((key, effect))


def _fault_context(replicas: int = 3, batch_size: int = 4):
    from types import SimpleNamespace

    from harness.job.fault_context import JobFaultContext

    data = DataConfig(batch_size=batch_size, seq_len=8, vocab_size=64)
    job = SimpleNamespace(
        journal=Journal(None, job="t"),
        cfg=SimpleNamespace(replicas=replicas, ranks=1, data=data),
        groups_kind=_Groups(),
    )
    return job, JobFaultContext(job)  # type: ignore[arg-type]


def test_poison_data_is_aimed_a_time_ahead_at_the_jobs_step_rate():
    job, ctx = _fault_context()
    per_step = 3 * 4
    # Before any rate: at least 3 steps past the last commit.
    assert ctx.poison_data(None)["steps_ahead"] == 3
    for step in range(1, 41):  # 50 steps a second, every group committing each step
        for replica in range(3):
            job.journal.emit(
                "step.commit",
                t=100 + step * 0.02,
                replica=replica,
                rank=0,
                step=step,
                seq_due=step * per_step,
            )
    assert ctx.steps_in(1.0) == 50
    where = ctx.poison_data(None, "nonfinite", ahead_s=1.0)
    assert where["steps_ahead"] == 50
    assert where["index"] == 40 * per_step + 49 * per_step
    assert job.groups_kind.poisoned[-1] == (where["key"], "nonfinite")
    assert ctx.poison_data(7)["index"] == 40 * per_step + 6 * per_step  # a fixed count wins


def test_poison_data_options_are_checked():
    from faults.fault import make_fault

    assert make_fault("poison_data", steps_ahead=20).steps_ahead == 20
    with pytest.raises(ValueError, match=r"option .steps_ahead. must be an integer"):
        make_fault("poison_data", steps_ahead="many")
    with pytest.raises(ValueError, match="ahead_s must be above 0"):
        make_fault("poison_data", ahead_s=0)
