"""The quorum tap's admission rule for a program's replica group (harness/job/program/admission.py)
on real sockets and processes: a call is the group's only if rank 0 (or a process it started)
holds its connection; on another machine, the weaker fallback by address."""

from __future__ import annotations

import concurrent.futures as cf
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest

from harness.job.program import admission as pa
from runtime import peer_process as pp

pytestmark = [
    pytest.mark.timeout(60),
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads Linux /proc"),
]

CLIENT = """
import socket, sys, time
s = socket.create_connection((sys.argv[1], int(sys.argv[2])))
print(*s.getsockname()[:2], flush=True)
time.sleep(60)
"""


@dataclass
class Conn:
    sock: socket.socket


@dataclass
class Host:
    pid: int
    conn: Conn | None
    address: str


@dataclass
class Rec:
    host: Host
    ready: cf.Future = field(default_factory=cf.Future)


@pytest.fixture
def tap() -> Iterator[socket.socket]:
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen()
    yield srv
    srv.close()


@pytest.fixture
def agent(tap: socket.socket) -> Iterator[Host]:
    """A host agent that is this process: it holds its end of its connection to "the
    controller" (here: the tap's listener, in this process too)."""
    sock = socket.create_connection(tap.getsockname())
    controller_end, _ = tap.accept()
    yield Host(os.getpid(), Conn(controller_end), "127.0.0.1")
    sock.close()
    controller_end.close()


def _client(tap: socket.socket) -> tuple[subprocess.Popen, str]:
    """A child process connected to the tap; its gRPC-style peer string."""
    host, port = tap.getsockname()
    proc = subprocess.Popen(
        [sys.executable, "-c", CLIENT, host, str(port)], stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None
    ip, cport = proc.stdout.readline().split()
    return proc, f"ipv4:{ip}:{cport}"


def _refusal(state: pa.GroupAdmission, rec: Rec, peer: str, tap: socket.socket, **kw: Any):
    kw.setdefault("binds", True)
    return pa.refusal(
        state,
        replica=0,
        rank0=rec,
        peer=peer,
        tap=pp.endpoint(tap.getsockname()),
        spawn_timeout_s=5,
        **kw,
    )


def test_a_local_group_admits_the_connections_of_its_rank_0_only(tap, agent) -> None:
    assert pa.host_is_local(agent) is True
    rank0, peer = _client(tap)
    stranger, stranger_peer = _client(tap)
    try:
        rec = Rec(agent)
        rec.ready.set_result(rank0.pid)
        state = pa.GroupAdmission()
        assert _refusal(state, rec, peer, tap) is None
        assert state.local is True and peer in state.verified
        assert _refusal(state, rec, peer, tap, binds=False) is None  # a heartbeat: the same
        # A stranger's connection (a sibling process: not rank 0 nor started by it).
        why = _refusal(state, rec, stranger_peer, tap)
        assert why is not None and "not held by replica group 0's rank 0" in why
        assert stranger_peer in state.refused
        # ... remembered for a while, so a flood on one connection costs one look at /proc.
        t = time.perf_counter()
        assert _refusal(state, rec, stranger_peer, tap) == why
        assert time.perf_counter() - t < 0.005
        # A connection the host agent (this process) holds itself: its quorum relay's, which
        # lets through only its own tree's processes (runtime.relay). Admitted when it binds an
        # id (a quorum request names its group by its store), not for a heartbeat of an id not
        # bound yet (which group would it be?), and remembered as relayed.
        me = socket.create_connection(tap.getsockname())
        try:
            relayed = f"ipv4:127.0.0.1:{me.getsockname()[1]}"
            assert "must ask for a quorum first" in _refusal(state, rec, relayed, tap, binds=False)
            assert _refusal(state, rec, relayed, tap) is None
            assert state.relayed(relayed, agent.pid) and relayed in state.verified
            assert not state.relayed(peer, agent.pid)  # rank 0's own connection
            assert "must ask for a quorum first" in _refusal(state, rec, relayed, tap, binds=False)
        finally:
            me.close()
        assert "not a TCP connection" in _refusal(state, rec, "unix:/tmp/x", tap)
        # Rank 0 gone: its verified connection is no longer held (one readlink tells).
        rank0.kill()
        rank0.wait()
        time.sleep(0.05)
        assert _refusal(state, rec, peer, tap) is not None
    finally:
        for p in (rank0, stranger):
            p.kill()
            p.wait()


def test_a_relayed_connection_is_the_relays_while_a_fresh_fork_holds_a_copy(tap, agent) -> None:
    """The host agent forks a group's rank 0 while its relay holds connections to the tap: the
    child holds copies of them until it closes them. A heartbeat relayed then, for a Manager
    of another group, must not count as this rank 0's own (seen in CI: it bound group 0's
    Manager to group 1, and both groups' Managers were refused from then on)."""
    me = socket.create_connection(tap.getsockname())  # the relay's end (the agent: this process)
    relayed = f"ipv4:127.0.0.1:{me.getsockname()[1]}"
    child = subprocess.Popen(  # group 1's rank 0, just forked: a copy of the relay's end
        [sys.executable, "-c", "import time; time.sleep(60)"], pass_fds=[me.fileno()]
    )
    try:
        rec = Rec(agent)
        rec.ready.set_result(child.pid)
        assert pp.holders(child.pid, pp.parse_peer(relayed), pp.endpoint(tap.getsockname()))
        state = pa.GroupAdmission()
        why = _refusal(state, rec, relayed, tap, binds=False)
        assert why is not None and "must ask for a quorum first" in why
        assert state.relayed(relayed, agent.pid)
        assert _refusal(state, rec, relayed, tap) is None  # a quorum request: by its store
    finally:
        child.kill()
        child.wait()
        me.close()


def test_rank_0_must_be_a_child_of_its_host_agent(tap, agent) -> None:
    """A pid that is no descendant of the agent (a recycled number, a stranger) proves nothing."""
    rank0, peer = _client(tap)
    try:
        rec = Rec(Host(rank0.pid, agent.conn, agent.address))  # "agent" = rank 0 itself
        rec.ready.set_result(os.getpid())  # ... and "rank 0" = this process, its parent
        why = _refusal(pa.GroupAdmission(local=True), rec, peer, tap)
        assert why is not None and "no process of its host agent" in why
    finally:
        rank0.kill()
        rank0.wait()


def test_a_group_on_another_machine_falls_back_to_its_host_address(tap) -> None:
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    sock = socket.create_connection(tap.getsockname())
    controller_end, _ = tap.accept()
    try:
        # The agent's pid as another machine reported it: here an unrelated process, which does
        # not hold the agent's connection. So the host is not this machine.
        remote = Host(sleeper.pid, Conn(controller_end), "127.0.0.1")
        assert pa.host_is_local(remote) is False
        rec = Rec(remote)
        rec.ready.set_result(12345)
        peer = f"ipv4:127.0.0.1:{sock.getsockname()[1]}"
        assert _refusal(pa.GroupAdmission(), rec, peer, tap) is None  # from the host's address
        why = _refusal(pa.GroupAdmission(), rec, peer, tap, binds=False)
        assert why is not None and "ask for a quorum first" in why  # an unknown id's heartbeat
        other = Rec(Host(sleeper.pid, Conn(controller_end), "127.0.0.2"))
        why = _refusal(pa.GroupAdmission(), other, peer, tap)
        assert why is not None and "is not replica group 0's host (127.0.0.2)" in why
        # An agent that is not connected: nothing can be decided yet.
        gone = Rec(Host(sleeper.pid, None, "127.0.0.1"))
        assert pa.host_is_local(gone.host) is None
        state = pa.GroupAdmission()
        assert "not connected" in _refusal(state, gone, peer, tap)
        assert state.local is None
    finally:
        sock.close()
        controller_end.close()
        sleeper.kill()
        sleeper.wait()


def test_the_observer_binds_each_manager_to_its_group_and_forgets_replaced_incarnations(
    tap, agent
) -> None:
    """``ProgramGroups.admit`` (the tap's observer) over the rule: a heartbeat before any
    quorum request finds its group by the process it comes from; a quorum request by its store;
    a replaced incarnation's ids, another group's id, a stranger: refused."""
    from types import SimpleNamespace

    from harness.config import JobConfig
    from harness.job.program.groups import ProgramGroups
    from harness.quorum.tap import Admission

    job = SimpleNamespace(
        survivable=False,
        plan=None,
        cfg=JobConfig(name="admission"),
        controller=SimpleNamespace(spec=SimpleNamespace(spawn_timeout_s=5)),
    )
    groups = ProgramGroups(job)
    groups.tap = SimpleNamespace(bind_host="127.0.0.1", port=tap.getsockname()[1])
    procs = [_client(tap) for _ in range(3)]
    try:
        (p0, peer0), (p1, peer1), (_, peer_s) = procs
        recs = [Rec(agent), Rec(agent)]
        for rec, p in zip(recs, (p0, p1), strict=True):
            rec.ready.set_result(p.pid)
        groups._register(0, 0, "127.0.0.1:1000", [recs[0]], "T0")
        groups._register(1, 0, "127.0.0.1:1001", [recs[1]], "T1")

        assert groups.admit("a:u", peer0, None) == Admission(0, 0, "T0")  # heartbeat first
        assert groups.admit("a:u", peer0, "127.0.0.1:1000") == Admission(0, 0, "T0")
        assert groups.admit("b:v", peer1, "127.0.0.1:1001") == Admission(1, 0, "T1")
        assert groups.member_ids(0) == ("T0:a:u",)
        assert "no current replica group's" in groups.admit("a:u", peer0, "127.0.0.1:9")
        assert "Manager of replica group 0" in groups.admit("a:u", peer1, "127.0.0.1:1001")
        # A stranger: with a made-up id, with a group's store, with a Manager's own id.
        for rid, store in (("x:y", None), ("x:y", "127.0.0.1:1000"), ("a:u", "127.0.0.1:1000")):
            assert isinstance(groups.admit(rid, peer_s, store), str)
        assert isinstance(groups.admit("a:u", peer_s, None), str)
        # Group 0's next incarnation (same process here): the old ids are refused for good.
        groups._register(0, 1, "127.0.0.1:1002", [recs[0]], "T0b")
        assert "replaced incarnation" in groups.admit("a:u", peer0, "127.0.0.1:1002")
        assert groups.admit("a:w", peer0, "127.0.0.1:1002") == Admission(0, 1, "T0b")
        assert groups.member_ids(0) == ("T0b:a:w",)
    finally:
        for p, _ in procs:
            p.kill()
            p.wait()
