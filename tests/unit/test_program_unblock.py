"""The controller's half of unblocking a program's survivors (harness/job/program/unblock.py):
every other live host's agent is told once per death of a group incarnation."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from harness.job.program.unblock import RemoteUnblock
from runtime.failure import Cause, Failure
from runtime.messages import UnblockPeers


@dataclass
class FakeConn:
    sent: list[Any] = field(default_factory=list)

    def send(self, msg: Any) -> None:
        self.sent.append(msg)


@dataclass
class FakeHost:
    name: str
    lost: bool = False
    conn: FakeConn = field(default_factory=FakeConn)


class FakeController:
    def __init__(self, *names: str) -> None:
        self.hosts = {n: FakeHost(n) for n in names}


def failure(proc: str, host: str, replica: int, rank: int = 0) -> Failure:
    return Failure(
        cause=Cause.SIGNAL,
        detail="SIGKILL",
        proc=proc,
        host=host,
        coords={"replica": replica, "rank": rank},
    )


def test_other_live_hosts_are_told_once_per_group_death():
    c = FakeController("h0", "h1", "h2")
    c.hosts["h2"].lost = True
    incarnations = {("h0/p1", 1): 3, ("h0/p2", 1): 3}  # replica 1, incarnation 3: two ranks
    listener = RemoteUnblock(c, lambda r, p: incarnations.get((p, r)))
    listener(failure("h0/p1", "h0", replica=1))
    listener(failure("h0/p2", "h0", replica=1, rank=1))  # the same death: not again
    assert c.hosts["h1"].conn.sent == [UnblockPeers(1)]
    assert c.hosts["h0"].conn.sent == []  # its own agent did it when it reaped the rank
    assert c.hosts["h2"].conn.sent == []  # lost
    # the next incarnation's death is a new one
    incarnations[("h0/p9", 1)] = 4
    listener(failure("h0/p9", "h0", replica=1))
    assert c.hosts["h1"].conn.sent == [UnblockPeers(1), UnblockPeers(1)]


def test_a_failure_that_is_no_current_program_rank_is_ignored():
    c = FakeController("h0", "h1")
    listener = RemoteUnblock(c, lambda r, p: None)
    listener(failure("h0/p1", "h0", replica=0))
    listener(Failure(cause=Cause.SIGNAL, detail="x", proc="h0/p2", host="h0"))  # no coordinates
    assert c.hosts["h1"].conn.sent == []
