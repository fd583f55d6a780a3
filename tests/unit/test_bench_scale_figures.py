"""Pure parts of ``ftharness bench scale`` and ``bench recovery``: the figures' arithmetic, the
reply checks, the simulated member's wire bytes, and the tree quorum rule's cheap guard
(``quorum_rule.may_complete``) that keeps a round of N joins from computing the rule N times."""

from __future__ import annotations

import argparse
import random

import pytest

from experiments.bench.recovery import _stall_steps, _stats, default_reps
from experiments.bench.scale import _check, _ms
from experiments.bench.sim_members import Reply, digest, member_bytes, quorum_members
from harness.quorum import rule
from harness.quorum.wire import decode_member, encode_quorum_response


def test_ms_reports_p50_p95_max_in_milliseconds() -> None:
    xs = [i / 1000 for i in range(1, 101)]  # 1..100 ms
    assert _ms(xs) == {"p50": 50.5, "p95": 95.05, "max": 100.0}


def _quorum(ids: list[str]) -> bytes:
    members = tuple(rule.Member(replica_id=i, raw=member_bytes(i, k, 3)) for k, i in enumerate(ids))
    return encode_quorum_response(rule.Quorum(quorum_id=7, members=members), 1.5)


def test_a_simulated_member_sends_what_a_manager_sends_and_the_reply_decodes() -> None:
    m = decode_member(member_bytes("replica_3.0.00112233445566ff.3:u", 3, 42))
    assert (m.replica_id, m.step, m.world_size) == ("replica_3.0.00112233445566ff.3:u", 42, 1)
    assert quorum_members(_quorum(["a", "b"])) == (7, ["a", "b"])


def _replies(body: bytes, n: int) -> list[Reply]:
    return [Reply(r, 0.0, 0.001, None, len(body), digest(body)) for r in range(n)]


def test_check_accepts_one_full_quorum_and_refuses_the_rest() -> None:
    body = _quorum(["a", "b"])
    _check(_replies(body, 2), body, ["b", "a"], "ok")
    with pytest.raises(RuntimeError, match="expected 3"):
        _check(_replies(body, 3), body, ["a", "b", "c"], "short quorum")
    other = _replies(_quorum(["a"]), 1)
    with pytest.raises(RuntimeError, match="different quorums"):
        _check(_replies(body, 1) + other, body, ["a", "b"], "split")
    failed = [Reply(0, 0.0, 1.0, "DEADLINE_EXCEEDED", 0, 0)]
    with pytest.raises(RuntimeError, match="no quorum"):
        _check(failed, None, ["a"], "timeout")


def test_recovery_figures_carry_p95_beside_median_min_max() -> None:
    s = _stats([float(x) for x in range(1, 11)] + [None])  # type: ignore[list-item]
    assert s == {"median": 5.5, "p95": 9.55, "min": 1.0, "max": 10.0}
    assert _stats([None]) is None  # type: ignore[list-item]


def test_a_stall_in_steps_is_the_most_stalled_survivors_in_its_own_typical_gaps() -> None:
    gaps = [
        {"replica": 1, "typical_gap_s": 0.1, "stall_s": 0.12},  # 1.2 of its steps
        {"replica": 2, "typical_gap_s": 0.02, "stall_s": 0.05},  # 2.5 of its own: less time
        {"replica": 3, "typical_gap_s": 0.0, "stall_s": 1.0},  # no typical gap: not counted
    ]
    assert _stall_steps({"survivor_gaps": gaps}) == pytest.approx(1.2)
    assert _stall_steps({"survivor_gaps": []}) is None and _stall_steps({}) is None


def test_recovery_kills_ten_times_per_configuration_by_default() -> None:
    ns = argparse.Namespace
    assert default_reps(ns(reps=None, quick=False)) == 10
    assert default_reps(ns(reps=None, quick=True)) == 3
    assert default_reps(ns(reps=4, quick=False)) == 4


# --- the rule's guard ------------------------------------------------------------------------


def _member(rid: str) -> rule.Member:
    return rule.Member(replica_id=rid, step=1)


@pytest.mark.parametrize("seed", range(40))
def test_a_join_that_may_not_complete_a_quorum_never_does(seed: int) -> None:
    """Random rounds of joins in random order, with deaths the tree reports between them.
    Whenever may_complete says no, tick at the same instant issues nothing; the join that
    completes a round is always let through."""
    rng = random.Random(seed)
    opts = rule.QuorumOpts(min_replicas=1, join_timeout_s=60.0, heartbeat_timeout_s=5.0)
    s = rule.QuorumState()
    ids = [f"replica_{i}:x" for i in range(rng.randint(2, 9))]
    now = 0.0
    for rid in ids:
        s = rule.heartbeat(s, rid, now)
    for _ in range(4):  # rounds
        now += 1.0
        alive = [i for i in ids if i not in s.fenced]
        if len(alive) > 1 and rng.random() < 0.4:  # a death the tree reports
            s, _ = rule.drop_failed(s, rng.choice(alive))
        alive = [i for i in ids if i not in s.fenced]
        joining = rng.sample(alive, len(alive))
        issued = None
        for k, rid in enumerate(joining):
            s = rule.join(s, _member(rid), now)
            s2, q, _ = rule.tick(s, now, opts)
            if not rule.may_complete(s):
                assert q is None, (seed, k, rid)
            if q is not None:
                issued, s = q, s2
        assert issued is not None and set(issued.replica_ids) == set(alive)


def test_one_round_of_joins_lets_one_join_through() -> None:
    """The steady state: N members of the previous quorum join; only the last may complete."""
    opts = rule.QuorumOpts(min_replicas=1)
    s = rule.QuorumState()
    ids = [f"replica_{i}:x" for i in range(50)]
    for rid in ids:
        s = rule.join(s, _member(rid), 0.0)
    s, q, _ = rule.tick(s, 0.0, opts)
    assert q is not None
    through = []
    for rid in ids:
        s = rule.join(s, _member(rid), 1.0)
        through.append(rule.may_complete(s))
    assert through == [False] * 49 + [True]
    s, _ = rule.drop_failed(s, ids[0])
    s, q, _ = rule.tick(s, 1.0, opts)  # the survivors' fast quorum, with one fenced
    assert q is not None and len(q.members) == 49
    for rid in ids[1:-1]:
        s = rule.join(s, _member(rid), 2.0)
        assert not rule.may_complete(s)
    s = rule.join(s, _member(ids[-1]), 2.0)
    assert rule.may_complete(s)
