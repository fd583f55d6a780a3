"""A replica group's store served by its host agent (``runtime.group_store``), through a real
controller and agent: it serves what the group's ranks write in it, lives in a child of the agent
(not in the controller), is replaced whole by the group's next store, outlives the death of a
worker of its host, and ends with its agent; and no other user of the machine reaches it (issue
#49, finding 3), whether the job runs as root or not."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

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


AS_NOBODY = ["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups"]
as_root_only = pytest.mark.skipif(os.geteuid() != 0, reason="needs root, to be another user")

#: torch's own store client, run as another user: what it reads of ``manager_addr``, or why not.
STRANGER = """
import json, sys
from datetime import timedelta
from torch.distributed import TCPStore
host, port = sys.argv[1].rsplit(":", 1)
try:
    s = TCPStore(host, int(port), is_master=False, wait_for_workers=False,
                 timeout=timedelta(seconds=3))
    s.set("manager_addr", "stranger:1")
    print(json.dumps({"got": s.get("manager_addr").decode()}))
except Exception as exc:
    print(json.dumps({"refused": repr(exc)[:300]}))
"""


def _as_nobody(script: str, *args: str, **kw) -> subprocess.Popen:
    return subprocess.Popen(
        [*AS_NOBODY, sys.executable, "-c", script, *args],
        stdout=subprocess.PIPE,
        text=True,
        **kw,
    )


def _netns(pid: int) -> str:
    return os.readlink(f"/proc/{pid}/ns/net")


@as_root_only
def test_another_user_cannot_reach_a_groups_store_and_the_job_still_can(ctl):
    host = ctl.spawn_host("h0")
    address = ctl.serve_store(host, 0)
    _client(address).set("manager_addr", "h0:1234")

    out, _ = _as_nobody(STRANGER, address, cwd="/").communicate(timeout=60)
    said = json.loads(out.strip().splitlines()[-1])
    assert "refused" in said, said  # on the old store: {"got": "stranger:1"}
    assert _client(address).get("manager_addr") == b"h0:1234"  # nothing of the stranger's

    # the store itself lives where no one else connects: a network namespace of its own
    gate = _server_pid(address)
    (store,) = psutil.Process(gate).children()
    assert _netns(store.pid) != _netns(gate) == _netns(host.pid)


NOBODYS_AGENT = """
import json, os, sys, time
from datetime import timedelta
sys.path.insert(0, sys.argv[1])
from runtime.group_store import serve_in_child
from torch.distributed import TCPStore
pid, address = serve_in_child("127.0.0.1", 10)
host, port = address.rsplit(":", 1)
s = TCPStore(host, int(port), is_master=False, wait_for_workers=False,
             timeout=timedelta(seconds=10))
s.set("manager_addr", "mine:1")
print(json.dumps({"address": address, "store": pid, "read": s.get("manager_addr").decode()}),
      flush=True)
sys.stdin.readline()
"""


@as_root_only
def test_a_store_served_for_a_job_that_is_not_root_admits_that_user_only():
    repo = str(Path(__file__).resolve().parents[2])
    agent = subprocess.Popen(
        [*AS_NOBODY, sys.executable, "-c", NOBODYS_AGENT, repo],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd="/",
    )
    try:
        said = json.loads(agent.stdout.readline())
        assert said["read"] == "mine:1"  # its own user's client is served
        (store,) = psutil.Process(said["store"]).children()
        assert _netns(store.pid) != _netns(os.getpid())  # a user namespace made it possible
        with pytest.raises(Exception, match=r"(?i)timed out|connection|reset|closed|broken pipe"):
            _client_quick(said["address"]).get("manager_addr")  # root is not the job's user
    finally:
        agent.stdin.close()
        agent.wait(timeout=30)


def _client_quick(address: str) -> TCPStore:
    host, port = address.rsplit(":", 1)
    return TCPStore(
        host, int(port), is_master=False, wait_for_workers=False, timeout=timedelta(seconds=3)
    )
