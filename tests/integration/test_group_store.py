"""A replica group's store served by its host agent (``runtime.group_store``), through a real
controller and agent: it serves what the group's ranks write in it, lives in a child of the agent
(not in the controller), is replaced whole by the group's next store, outlives the death of a
worker of its host, and ends with its agent."""

from __future__ import annotations

import os
import signal
from datetime import timedelta

import psutil
import pytest
import runtime_actors
from test_runtime import FAST, wait_for
from torch.distributed import TCPStore

from runtime.controller import Controller


@pytest.fixture
def ctl():
    c = Controller(FAST, on_failure=lambda f: True)
    yield c
    c.shutdown(grace_s=0.5)


def _client(address: str) -> TCPStore:
    host, port = address.rsplit(":", 1)
    return TCPStore(
        host, int(port), is_master=False, wait_for_workers=False, timeout=timedelta(seconds=10)
    )


def _server_pid(address: str) -> int:
    port = int(address.rsplit(":", 1)[1])
    pids = [
        c.pid
        for c in psutil.net_connections("tcp")
        if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port
    ]
    assert len(pids) == 1, (address, pids)
    return pids[0]


def test_a_groups_store_is_served_by_its_agent_and_replaced_by_the_next_one(ctl):
    host = ctl.spawn_host("h0")
    first = ctl.serve_store(host, 0)
    assert first.startswith("127.0.0.1:"), first  # the agent's address
    client = _client(first)
    client.set("manager_addr", "h0:1234")
    assert _client(first).get("manager_addr") == b"h0:1234"
    pid = _server_pid(first)
    assert pid != os.getpid() and psutil.Process(pid).ppid() == host.pid

    # another group's store on the same host is its own
    other = ctl.serve_store(host, 1)
    assert other != first and _client(other).num_keys() == 0

    # a worker of the host dies: the agent reaps it and kills its orphans, not the stores
    mesh = host.spawn_procs({"rank": 1})
    echo = mesh.spawn("e", runtime_actors.Echo)
    victim = echo.pid.call_one().get(timeout=30)
    os.kill(victim, signal.SIGKILL)
    wait_for(lambda: not psutil.pid_exists(victim) or psutil.Process(victim).status() == "zombie")
    assert _client(first).get("manager_addr") == b"h0:1234"

    # the group's next incarnation gets a fresh store; the last one's process ends
    second = ctl.serve_store(host, 0)
    assert second != first
    wait_for(lambda: not psutil.pid_exists(pid))
    assert not _client(second).check(["manager_addr"])
    assert _client(other).num_keys() == 0 and _server_pid(other)  # group 1's serves on


def test_a_store_ends_with_its_agent():
    c = Controller(FAST, on_failure=lambda f: True)
    try:
        host = c.spawn_host("h0")
        pid = _server_pid(c.serve_store(host, 0))
    finally:
        c.shutdown(grace_s=0.5)
    wait_for(lambda: not psutil.pid_exists(pid))
