"""Sequences trained, skipped and trained twice, counted from step.commit records."""

from __future__ import annotations

from typing import Any

from dashboards.data_coverage import coverage


def _commit(step: int, replica: int, seqs: list[list[int]], due: int, **kw: Any) -> dict:
    return {
        "event": "step.commit",
        "t": float(step) + kw.pop("dt", 0.0),
        "policy": kw.pop("policy", "in_place"),
        "step": step,
        "replica": replica,
        "rank": 0,
        "seqs": seqs,
        "seq_due": due,
        "data_policy": kw.pop("data_policy", "skip"),
    }


def test_a_down_group_shard_is_skipped_under_skip() -> None:
    # 2 groups x batch 2: step s (position s-1) reads [4(s-1), 4(s-1)+2) and [4(s-1)+2, 4s)
    recs = []
    for step in range(1, 6):
        p = step - 1
        recs.append(_commit(step, 0, [[4 * p, 4 * p + 2]], 4 * step))
        if step not in (2, 3):  # group 1 down for steps 2 and 3
            recs.append(_commit(step, 1, [[4 * p + 2, 4 * p + 4]], 4 * step))
    got = coverage(recs)["in_place"]
    # steps 1-4 counted (5 is the last), due 16; group 1 missed 2 sequences at steps 2 and 3
    assert got == {
        "data_policy": "skip",
        "due": 16,
        "trained": 12,
        "skipped": 4,
        "trained_twice": 0,
        "skipped_fraction": 0.25,
    }


def test_replay_ranges_and_a_rollback_count_once() -> None:
    recs = [
        _commit(1, 0, [[0, 4]], 4, data_policy="replay", policy="full_restart"),
        _commit(2, 0, [[4, 8]], 8, data_policy="replay", policy="full_restart"),
        # after a restart from the step-1 checkpoint, step 2 again, then 3
        _commit(2, 0, [[4, 8]], 8, data_policy="replay", policy="full_restart", dt=10),
        _commit(3, 0, [[8, 12]], 12, data_policy="replay", policy="full_restart", dt=10),
        _commit(4, 1, [[12, 14]], 14, data_policy="replay", policy="full_restart", dt=10),
    ]
    got = coverage(recs)["full_restart"]
    assert (got["due"], got["skipped"], got["trained_twice"]) == (12, 0, 0)


def test_overlapping_steps_are_trained_twice_and_old_records_ignored() -> None:
    recs = [
        _commit(1, 0, [[0, 4]], 4),
        _commit(2, 0, [[2, 6]], 6),
        _commit(3, 0, [[6, 8]], 8),
        {"event": "step.commit", "step": 9, "replica": 0, "rank": 0, "policy": "in_place"},
    ]
    got = coverage(recs)["in_place"]
    assert (got["due"], got["skipped"], got["trained_twice"]) == (6, 0, 2)
    assert coverage([{"event": "step.commit", "step": 1}]) == {}
