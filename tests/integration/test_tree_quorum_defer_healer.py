"""The tree quorum over gRPC, with torchft's own client: a replacement that must heal and asked
before the survivors is left out of their first quorum after the death, and is in their next
one (``harness.quorum.rule._defer_healers``; its request is kept waiting, not failed)."""

from __future__ import annotations

import threading
import time
from datetime import timedelta
from typing import Any

import pytest

from harness.quorum.tree import TreeQuorum


def _ask(addr: str, rid: str, out: dict[str, Any], step: int) -> None:
    from torchft._torchft import LighthouseClient

    try:
        client = LighthouseClient(addr=addr, connect_timeout=timedelta(seconds=5))
        out[rid] = client.quorum(
            replica_id=rid, timeout=timedelta(seconds=10), step=step, world_size=1
        )
    except Exception as e:
        out[rid] = e


def _ask_all(addr: str, steps: dict[str, int]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    threads = [threading.Thread(target=_ask, args=(addr, r, out, s)) for r, s in steps.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def _ids(q: Any) -> list[str]:
    assert not isinstance(q, Exception), q
    return [m.replica_id for m in q.participants]


@pytest.mark.timeout(60)
def test_a_replacement_behind_joins_the_round_after_the_survivors_first() -> None:
    from torchft._torchft import LighthouseClient

    tq = TreeQuorum(min_replicas=1, join_timeout_s=60.0, heartbeat_timeout_s=60.0)
    try:
        a, b, c = (tq.admit(r) + f":{u}" for r, u in enumerate(("aa", "bb", "cc")))
        client = LighthouseClient(addr=tq.address, connect_timeout=timedelta(seconds=5))
        for rid in (a, b, c):  # all three heartbeat first: the first quorum waits for them
            client.heartbeat(rid)
        first = _ask_all(tq.address, {a: 10, b: 10, c: 10})
        assert _ids(first[a]) == [a, b, c]

        tq.replica_failed(1)
        b2 = tq.admit(1) + ":new"  # a warm spare, at step 0: it must heal
        healer: dict[str, Any] = {}
        joiner = threading.Thread(target=_ask, args=(tq.address, b2, healer, 0))
        joiner.start()
        deadline = time.monotonic() + 10
        while tq.status()["participants"] != [b2] and time.monotonic() < deadline:
            time.sleep(0.01)
        assert tq.status()["participants"] == [b2]

        survivors = _ask_all(tq.address, {a: 10, c: 10})
        assert _ids(survivors[a]) == _ids(survivors[c]) == [a, c]
        assert survivors[a].quorum_id == first[a].quorum_id + 1
        assert joiner.is_alive()  # still waiting, not failed
        deadline = time.monotonic() + 10
        while tq.status()["participants"] != [b2] and time.monotonic() < deadline:
            time.sleep(0.01)  # it asked again for the next round

        again = _ask_all(tq.address, {a: 11, c: 11})
        joiner.join(10)
        assert _ids(again[a]) == _ids(healer[b2]) == [a, b2, c]
        assert healer[b2].quorum_id == survivors[a].quorum_id + 1
    finally:
        tq.shutdown()
