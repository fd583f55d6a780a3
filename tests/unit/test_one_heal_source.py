"""Every rank of a group of several ranks heals from the group its rank 0 was given
(``harness.rank.healing.OneHealSource``): torchft's ManagerServer picks per group rank, as
the fake clients below do, and the wrapper makes rank 0's choice the group's, through a real
TCPStore."""

from __future__ import annotations

import threading
from datetime import timedelta

import pytest
from torch.distributed import PrefixStore, TCPStore
from torchft._torchft import QuorumResult

from harness.rank.healing import OneHealSource

IDS = ["replica_0.1.t.0", "replica_1.2.t.1", "replica_2.1.t.2"]


def result(*, src: int | None, dst: list[int], step: int = 12, quorum_id: int = 4) -> QuorumResult:
    q = QuorumResult()
    q.quorum_id = quorum_id
    q.max_step = step
    q.heal = src is not None
    q.recover_src_replica_rank = src
    q.recover_src_manager_address = "" if src is None else f"http://host:{9000 + src}"
    q.recover_dst_replica_ranks = dst
    q.replica_ids = IDS
    return q


class FakeClient:
    """A ManagerServer's answers to one group rank, in order."""

    def __init__(self, *answers: QuorumResult) -> None:
        self.answers = list(answers)
        self.committed: list[int] = []

    def _quorum(self, **kwargs: object) -> QuorumResult:
        return self.answers.pop(0)

    def should_commit(self, rank: int, step: int, ok: bool) -> bool:
        self.committed.append(step)
        return ok


@pytest.fixture
def store():
    server = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    port = server.port
    yield lambda: PrefixStore("harness/heal/g1", TCPStore("127.0.0.1", port, is_master=False))
    del server


def ask_both(rank0: OneHealSource, rank1: OneHealSource) -> tuple[QuorumResult, QuorumResult]:
    """Rank 1 asks first and waits for rank 0's answer, as it may in a real group."""
    out: dict[int, QuorumResult] = {}
    t = threading.Thread(target=lambda: out.__setitem__(1, rank1._quorum(group_rank=1)))
    t.start()
    out[0] = rank0._quorum(group_rank=0)
    t.join(10)
    return out[0], out[1]


def test_a_healing_groups_ranks_all_take_rank_zeros_source(store):
    # torchft: rank 0 of the healing group from group 0, rank 1 from group 2
    rank0 = OneHealSource(FakeClient(result(src=0, dst=[])), store(), 0, timedelta(seconds=5))
    rank1 = OneHealSource(FakeClient(result(src=2, dst=[])), store(), 1, timedelta(seconds=5))
    q0, q1 = ask_both(rank0, rank1)
    assert (q0.recover_src_replica_rank, q1.recover_src_replica_rank) == (0, 0)
    assert q1.recover_src_manager_address == "http://host:9000"
    assert rank0.source == rank1.source == IDS[0]


def test_every_rank_of_a_source_group_serves_rank_zeros_healers(store):
    # torchft: group 0's rank 0 serves healer 1, its rank 1 serves nobody (group 2's does)
    rank0 = OneHealSource(FakeClient(result(src=None, dst=[1])), store(), 0, timedelta(seconds=5))
    rank1 = OneHealSource(FakeClient(result(src=None, dst=[])), store(), 1, timedelta(seconds=5))
    q0, q1 = ask_both(rank0, rank1)
    assert q0.recover_dst_replica_ranks == q1.recover_dst_replica_ranks == [1]
    assert not q1.heal and rank1.source is None


def test_each_quorum_call_has_its_own_answer_and_old_ones_are_deleted(store):
    calls = [result(src=0, dst=[], step=5), result(src=None, dst=[2], step=6)]
    other = [result(src=2, dst=[], step=5), result(src=None, dst=[], step=6)]
    s0 = store()
    rank0 = OneHealSource(FakeClient(*calls), s0, 0, timedelta(seconds=5))
    rank1 = OneHealSource(FakeClient(*other), store(), 1, timedelta(seconds=5))
    first = ask_both(rank0, rank1)
    assert [q.recover_src_replica_rank for q in first] == [0, 0]
    second = ask_both(rank0, rank1)
    assert [q.recover_dst_replica_ranks for q in second] == [[2], [2]]
    assert s0.num_keys() >= 1 and not s0.check(["0/4/5"])  # the first answer is gone
    # everything else is torchft's own
    assert rank1.should_commit(1, 6, True) and rank1._client.committed == [6]


def test_a_rank_zero_that_never_answers_fails_the_quorum_in_time(store):
    rank1 = OneHealSource(FakeClient(result(src=2, dst=[])), store(), 1, timedelta(seconds=0.3))
    with pytest.raises(Exception, match=r"(?i)timeout|wait"):
        rank1._quorum(group_rank=1)


class StepClient(FakeClient):
    """Records the step each quorum request carried."""

    def __init__(self, *answers: QuorumResult) -> None:
        super().__init__(*answers)
        self.steps: list[object] = []

    def _quorum(self, **kwargs: object) -> QuorumResult:
        self.steps.append(kwargs.get("step"))
        return super()._quorum(**kwargs)


def test_every_rank_asks_with_the_groups_lowest_step(store):
    """A heal that failed on rank 0 (its source killed) and landed on rank 1 leaves them at
    steps 51 and 61; torchft's ManagerServer would give the quorum the step of whichever asked
    last. Both ask with 51, so the whole group heals again; the keys of a call go at the next."""
    c0 = StepClient(result(src=None, dst=[]), result(src=None, dst=[]))
    c1 = StepClient(result(src=None, dst=[]), result(src=None, dst=[]))
    s0 = store()
    rank0 = OneHealSource(c0, s0, 0, timedelta(seconds=5), world=2)
    rank1 = OneHealSource(c1, store(), 1, timedelta(seconds=5), world=2)
    out: dict[int, object] = {}
    t = threading.Thread(target=lambda: out.__setitem__(1, rank1._quorum(group_rank=1, step=61)))
    t.start()
    rank0._quorum(group_rank=0, step=51)
    t.join(10)
    assert c0.steps == c1.steps == [51]
    t = threading.Thread(target=lambda: out.__setitem__(1, rank1._quorum(group_rank=1, step=70)))
    t.start()
    rank0._quorum(group_rank=0, step=70)
    t.join(10)
    assert c0.steps == c1.steps == [51, 70]
    assert not s0.check(["step/0/0"]) and not s0.check(["step/0/1"])
