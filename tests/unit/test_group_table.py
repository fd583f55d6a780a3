"""The job's table of replica groups (``harness.job.replica_group.GroupTable``)."""

from __future__ import annotations

import concurrent.futures as cf
from types import SimpleNamespace
from typing import Any

from harness.job.replica_group import GroupTable, ReplicaGroup


def _group(replica: int, incarnation: int, *procs: str) -> ReplicaGroup:
    mesh: Any = SimpleNamespace(proc_ids=list(procs))
    return ReplicaGroup(replica, incarnation, "h0", mesh, None, cf.Future())


def test_starts_are_numbered_and_an_adoption_is_not_a_start() -> None:
    table = GroupTable()
    assert table.started(_group(0, 0, "h0/p1")) == 1
    table.adopted(_group(1, 3, "h0/p2"))
    assert table.started(_group(0, 1, "h0/p3")) == 2  # a restart replaces the incarnation
    assert sorted(table) == [0, 1] and len(table) == 2
    assert table[0].incarnation == 1 and table.incarnation(1) == 3
    assert table.incarnation(2) is None and table.get(2) is None


def test_processes_of_one_group_or_of_all() -> None:
    table = GroupTable()
    table.started(_group(0, 0, "h0/p1", "h0/p2"))
    table.started(_group(1, 0, "h1/p1"))
    assert table.proc_ids(0) == ["h0/p1", "h0/p2"]
    assert table.proc_ids(5) == []  # never started
    assert sorted(table.proc_ids()) == ["h0/p1", "h0/p2", "h1/p1"]
    assert [g.replica for g in table.current()] == [0, 1]
