"""What a round costs the tree quorum as the job grows, counted rather than timed: N simulated
members (real gRPC clients in their own processes, ``experiments.bench.sim_members``) ask at
once, and the service must run the quorum rule and encode the reply a constant number of times
per round, not once per member (which made a round at 1024 groups cost seconds of CPU)."""

from __future__ import annotations

from typing import Any

import pytest

from experiments.bench.scale import _check
from experiments.bench.sim_members import Members
from harness.quorum import rule as quorum_rule
from harness.quorum import tree as tree_quorum
from harness.quorum.tree import TreeQuorum

N = 48


@pytest.mark.timeout(120)
def test_a_round_of_n_joins_computes_and_encodes_a_constant_number_of_times(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The periodic tick only every 30 s: what runs the rule during the round is the joins.
    tq = TreeQuorum(
        min_replicas=1, heartbeat_timeout_s=600.0, quorum_tick_s=30.0, max_requests=4 * N
    )
    members = None
    try:
        ids = [tq.admit(r) for r in range(N)]
        members = Members(tq.address, ids, procs=1)
        members.beat()
        members.start(1)
        _check(*members.collect(), members.ids, "first round")

        counts = {"compute": 0, "encode": 0}

        def counting(name: str, fn: Any) -> Any:
            def wrapper(*args: Any, **kw: Any) -> Any:
                counts[name] += 1
                return fn(*args, **kw)

            return wrapper

        monkeypatch.setattr(quorum_rule, "compute", counting("compute", quorum_rule.compute))
        monkeypatch.setattr(
            tree_quorum,
            "encode_quorum_response",
            counting("encode", tree_quorum.encode_quorum_response),
        )
        for step in (2, 3):
            members.start(step)
            _check(*members.collect(), members.ids, f"round {step}")
        # One compute and one encoding per round; a stray wake of the ticker may add a few.
        assert counts["encode"] == 2, counts
        assert counts["compute"] <= 6, counts
        assert tq.status()["members"] == sorted(members.ids)
    finally:
        if members is not None:
            members.close()
        tq.shutdown()
