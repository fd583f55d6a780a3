"""What makes a heal whole in a group of several ranks: one source, one step, and a hook to slow
a source down.

torchft heals per group rank, and a sharded group's shards must all come from one group at one
step. :class:`OneHealSource` stands in front of a Manager's ManagerServer client and makes rank
0's quorum result the group's, and the group's lowest step the one every rank asks with;
:class:`SlowServe` stands around every checkpoint transport and says when a source begins to
send (and, as a fault hook, waits first). ``harness.rank.torchft_glue.make_manager`` installs
both; :func:`heal_client` and :func:`slow_serve` find them on a Manager.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from torch.distributed import PrefixStore
from torchft import Manager
from torchft.checkpointing.transport import CheckpointTransport


class OneHealSource:
    """A Manager's client of its group's ManagerServer (torchft's ``Manager._client``), made to
    give every rank of a group of several ranks one heal source: the one its rank 0 was given.

    torchft picks a heal source per group rank: rank r of the i-th group to heal gets
    ``up_to_date[(i + r) % n]`` of the ``n`` groups at the highest step (its ``manager.rs``,
    ``compute_quorum_results``), so with two up-to-date groups a replacement's ranks 0 and 1 heal
    from different groups. That is safe only while those groups hold the same bits, and a sharded
    group's shards must all come from one group at one step. So each quorum result of rank 0 is
    the group's: rank 0 writes its source and the groups it serves to the group's store, keyed by
    the quorum call's number, id and step (every rank of a group makes the same calls, and the
    group restarts as one), and every other rank takes them. Healing, rank r fetches its own
    rank's state from rank 0's source group (whose ManagerServer hands out the metadata of each
    of its ranks); as a source, rank r serves the same groups that rank 0 serves, so the source
    group's every rank publishes the step. A heal from a source that dies is an error torchft
    records: the step is not committed, and the next quorum, without the dead group, heals again.

    A group of one rank (``store`` None) keeps torchft's answers as they are. For every group:
    ``source``, the member id (``QuorumResult.replica_ids``) of the latest heal's source group;
    and ``on_heal(source, step)``, called as a heal begins (on torchft's quorum thread).
    """

    def __init__(
        self,
        client: Any,
        store: PrefixStore | None,
        rank: int,
        timeout: timedelta,
        world: int = 1,
    ) -> None:
        self._client = client
        self._store = store
        self._rank = rank
        self._world = world
        self._timeout = timeout
        self._calls = 0
        self._last_key: str | None = None
        self.source: str | None = None
        self.on_heal: Callable[[str | None, int], None] | None = None

    def __getattr__(self, name: str) -> Any:  # should_commit and the rest: torchft's own
        return getattr(self._client, name)

    def _quorum(self, **kwargs: Any) -> Any:
        n, self._calls = self._calls, self._calls + 1
        if self._store is not None and "step" in kwargs:
            kwargs["step"] = self._group_step(n, int(kwargs["step"]))
        quorum = self._client._quorum(**kwargs)
        if self._store is not None:
            self._agree(quorum, f"{n}/{quorum.quorum_id}/{quorum.max_step}")
        if quorum.heal:
            ids = list(quorum.replica_ids)
            src = quorum.recover_src_replica_rank
            self.source = ids[src] if src is not None and src < len(ids) else None
            if self.on_heal is not None:
                self.on_heal(self.source, quorum.max_step)
        return quorum

    def _group_step(self, n: int, step: int) -> int:
        """The lowest step among the group's ranks for quorum call ``n``: the step every rank
        asks with. torchft's ManagerServer gives the quorum service the step of whichever rank
        asked last, so a group whose heal failed on one rank (its source killed mid-heal) and
        landed on another went on as up to date, the first rank's shards left behind (seen in
        experiments/sharded.toml: its two ranks committed steps 51 and 61 together). At the
        lowest step the whole group heals again, from one source."""
        assert self._store is not None
        self._store.set(f"step/{n}/{self._rank}", str(step))
        keys = [f"step/{n}/{r}" for r in range(self._world)]
        self._store.wait(keys, self._timeout)
        lowest = min(int(self._store.get(k)) for k in keys)
        if n > 0:  # every rank read call n-1's keys before it asked for that quorum
            self._store.delete_key(f"step/{n - 1}/{self._rank}")
        return lowest

    def _agree(self, quorum: Any, key: str) -> None:
        """Make rank 0's source and destinations this rank's (rank 0 publishes them)."""
        assert self._store is not None
        if self._rank == 0:
            lead = {
                "src": quorum.recover_src_manager_address,
                "src_rank": quorum.recover_src_replica_rank,
                "dst": list(quorum.recover_dst_replica_ranks),
            }
            self._store.set(key, json.dumps(lead))
            # every rank read the previous one before it asked for this quorum, which the
            # ManagerServer answers only once all of the group's ranks have asked
            if self._last_key is not None:
                self._store.delete_key(self._last_key)
            self._last_key = key
        else:
            self._store.wait([key], self._timeout)
            lead = json.loads(self._store.get(key))
            quorum.recover_dst_replica_ranks = lead["dst"]
            if quorum.heal:  # the whole group is behind, or none of it
                quorum.recover_src_manager_address = lead["src"]
                quorum.recover_src_replica_rank = lead["src_rank"]


class SlowServe(CheckpointTransport[Any]):
    """A checkpoint transport that says when it begins to serve a heal (``on_serve``) and waits
    ``delay_s`` before it does (``send_checkpoint``); otherwise the one it wraps. The delay is a
    fault hook, a source behind a slow link
    (``faults.inworker.set_serve_delay``). The wait comes after the quorum's process group is
    configured, where a real transfer's time goes: a source killed during it dies with every
    connection made (its peers fail at once), not in the middle of the rendezvous."""

    def __init__(self, inner: CheckpointTransport[Any]) -> None:
        self._inner = inner
        self.delay_s = 0.0
        #: called as this rank begins to serve a heal (``step``, the healing ranks), before the
        #: delay: on torchft's quorum thread
        self.on_serve: Callable[[int, list[int]], None] | None = None

    def __getattr__(self, name: str) -> Any:  # a transport's own extras (the data plane's)
        return getattr(self._inner, name)

    def metadata(self) -> str:
        return self._inner.metadata()

    def send_checkpoint(
        self, dst_ranks: list[int], step: int, state_dict: Any, timeout: timedelta
    ) -> None:
        if self.on_serve is not None:
            self.on_serve(step, list(dst_ranks))
        if self.delay_s > 0:
            time.sleep(self.delay_s)
        self._inner.send_checkpoint(dst_ranks, step, state_dict, timeout)

    def recv_checkpoint(self, src_rank: int, metadata: str, step: int, timeout: timedelta) -> Any:
        return self._inner.recv_checkpoint(src_rank, metadata, step, timeout)

    def disallow_checkpoint(self) -> None:
        self._inner.disallow_checkpoint()

    def shutdown(self, wait: bool = True) -> None:
        self._inner.shutdown(wait)


def slow_serve(manager: Manager) -> SlowServe:
    """The :class:`SlowServe` :func:`make_manager` wrapped ``manager``'s transport in."""
    transport = manager._checkpoint_transport
    assert isinstance(transport, SlowServe), "not a Manager from make_manager"
    return transport


def heal_client(manager: Manager) -> OneHealSource:
    """The :class:`OneHealSource` that :func:`make_manager` put in front of ``manager``'s
    ManagerServer (torchft's private ``Manager._client``, torchft-nightly 2026.10.26)."""
    client = manager._client
    assert isinstance(client, OneHealSource), "not a Manager from make_manager"
    return client
