"""The preflight's agent side (``runtime.preflight.AgentPreflight``) on real sockets, in this
process: two agents' preflights on one selector loop, as the agent drives them, probing each other,
a plain service, a closed port, a port that never answers and an address that is loopback
elsewhere; and the listener's hardening: a stranger without the job's token gets no byte, one
that says nothing is dropped at its deadline, and after the round nothing listens any more."""

from __future__ import annotations

import contextlib
import os
import selectors
import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from runtime.controller import Controller
from runtime.messages import (
    PreflightClose,
    PreflightListen,
    PreflightListening,
    PreflightProbe,
    PreflightReport,
    PreflightTarget,
)
from runtime.preflight import AgentPreflight, Outcome, ask_token, place_identity
from runtime.spec import ControllerSpec

pytestmark = pytest.mark.timeout(30)

SECRET = bytes(range(32))
NONCE = b"n" * 16


class Loop:
    """Preflights of several agents on one selector, pumped the way ``runtime.agent`` does."""

    def __init__(self) -> None:
        self.sel = selectors.DefaultSelector()
        self.sent: list[Any] = []
        self.agents: dict[str, AgentPreflight] = {}

    def agent(self, name: str, address: str = "127.0.0.1") -> AgentPreflight:
        self.agents[name] = AgentPreflight(name, address, SECRET, self.sel, self.sent.append)
        return self.agents[name]

    def pump(self, until: Callable[[], bool], timeout: float = 5.0) -> None:
        deadline = time.monotonic() + timeout
        while not until():
            assert time.monotonic() < deadline, "the preflight did not finish"
            for key, mask in self.sel.select(0.01):
                kind, obj = key.data
                assert kind == "preflight"
                obj.on_event(key.fileobj, mask)
            for a in self.agents.values():
                a.tick(time.monotonic())

    def replies(self, kind: type[Any]) -> dict[str, Any]:
        return {m.host: m for m in self.sent if isinstance(m, kind)}


@pytest.fixture
def loop() -> Iterator[Loop]:
    lp = Loop()
    yield lp
    for a in lp.agents.values():
        a.close()
    lp.sel.close()


def _listen(loop: Loop, *names: str, timeout_s: float = 1.0) -> dict[str, PreflightListening]:
    for n in names:
        loop.agent(n).handle(PreflightListen(NONCE, timeout_s, 30.0))
    got = loop.replies(PreflightListening)
    assert all(got[n].port and not got[n].error for n in names), got
    assert all(got[n].bound == "127.0.0.1" for n in names)  # its advertised address, no wildcard
    return got


def test_agents_probe_each_other_and_each_outcome_is_named(loop: Loop) -> None:
    here = place_identity()
    ports = _listen(loop, "h0", "h1")
    service = socket.create_server(("127.0.0.1", 0))  # a controller service: accepting is enough
    mute = socket.create_server(("127.0.0.1", 0))  # accepts (the kernel does), never answers
    closed = socket.socket()  # bound, not listening: the port stays ours, and refuses
    closed.bind(("127.0.0.1", 0))
    closed_port = closed.getsockname()[1]
    try:
        targets = (
            PreflightTarget("h0", "127.0.0.1", ports["h0"].port, here, True),
            PreflightTarget("controller", "127.0.0.1", service.getsockname()[1], here, False),
            PreflightTarget("gone", "127.0.0.1", closed_port, here, True),
            PreflightTarget("mute", "127.0.0.1", mute.getsockname()[1], here, True),
            # h0's listener under another host's name: the token is h2's, h0 does not answer
            PreflightTarget("h2", "127.0.0.1", ports["h0"].port, here, True),
            PreflightTarget("far", "127.0.0.1", 9, "another-machine/net:1", True),
            # a name that resolves to loopback where the target runs (Debian's 127.0.1.1)
            PreflightTarget("deb", "192.0.2.1", 9, "another-machine/net:1", True, "127.0.1.1"),
        )
        t0 = time.monotonic()
        loop.agents["h1"].handle(PreflightProbe(NONCE, targets, 0.5))
        loop.pump(lambda: "h1" in loop.replies(PreflightReport))
        took = time.monotonic() - t0
    finally:
        service.close()
        mute.close()
        closed.close()
    report = loop.replies(PreflightReport)["h1"]
    outcome = {r.target: Outcome(r.outcome) for r in report.results}
    assert outcome == {
        "h0": Outcome.OK,
        "controller": Outcome.OK,
        "gone": Outcome.REFUSED,
        "mute": Outcome.TIMED_OUT,
        "h2": Outcome.WRONG_PEER,
        "far": Outcome.LOOPBACK,
        "deb": Outcome.LOOPBACK,
    }, report
    detail = {r.target: r.detail for r in report.results}
    assert "ECONNREFUSED" in detail["gone"] and "answer" in detail["mute"]
    assert "resolves to 127.0.1.1 (loopback) on deb" in detail["deb"]
    assert 0.4 < took < 2.0  # the probes ran in parallel: one timeout, not the sum
    assert loop.agents["h0"].strangers == 1  # the probe with h2's token


def test_the_listener_answers_only_the_token_and_closes_after_the_round(loop: Loop) -> None:
    port = _listen(loop, "h0", timeout_s=0.3)["h0"].port
    h0 = loop.agents["h0"]

    def exchange(payload: bytes) -> bytes:
        """Send ``payload`` to the listener and read its answer, on a thread of its own while
        this one pumps the loop."""
        out: list[bytes] = []

        def client() -> None:
            with socket.create_connection(("127.0.0.1", port), timeout=2) as s:
                if payload:
                    s.sendall(payload)
                s.settimeout(2)
                out.append(s.recv(64))

        t = threading.Thread(target=client, daemon=True)
        t.start()
        loop.pump(lambda: not t.is_alive(), timeout=3)
        return out[0]

    assert exchange(bytes(32)) == b""  # a stranger: closed without a byte
    assert h0.strangers == 1
    assert exchange(b"") == b""  # says nothing: dropped at its deadline (0.3 s)
    assert h0.strangers == 2
    good = exchange(ask_token(SECRET, NONCE, "h0"))
    assert len(good) == 32 and good != ask_token(SECRET, NONCE, "h0")
    assert h0.strangers == 2
    h0.handle(PreflightClose(b"another round"))  # not this round's: ignored
    assert h0.listener is not None
    h0.handle(PreflightClose(NONCE))
    assert h0.listener is None and h0.sockets() == []
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", port), timeout=2).close()


def test_an_agent_that_cannot_listen_at_its_address_says_why(loop: Loop) -> None:
    loop.agent("h0", address="192.0.2.77").handle(PreflightListen(NONCE, 1.0, 30.0))  # not ours
    reply = loop.replies(PreflightListening)["h0"]
    assert reply.port == 0 and "EADDRNOTAVAIL" in reply.error, reply


def test_the_listen_window_closes_the_listener_without_the_controller(loop: Loop) -> None:
    loop.agent("h0").handle(PreflightListen(NONCE, 1.0, 0.2))
    loop.pump(lambda: loop.agents["h0"].listener is None, timeout=3)


def _listening_inode(port: int) -> str:
    with open("/proc/net/tcp") as f:
        for line in f.readlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and int(fields[1].split(":")[1], 16) == port:
                return fields[9]
    raise AssertionError(f"nothing listens on port {port}")


def _socket_inodes(pid: int) -> set[str]:
    out = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(OSError):
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
            if link.startswith("socket:["):
                out.add(link[8:-1])
    return out


def test_a_worker_forked_during_the_preflight_does_not_hold_its_listener() -> None:
    """A real agent: its listener is its own (a worker forked meanwhile closed its copy), and
    once the round is closed nothing listens on that port any more."""
    with Controller(ControllerSpec(preload=())) as c:
        h = c.spawn_host("h0")
        assert h.conn is not None
        nonce = b"r" * 16
        c.preflight.begin(nonce)
        h.conn.send(PreflightListen(nonce, 1.0, 30.0))
        got = c.preflight.collect(PreflightListening, ["h0"], time.monotonic() + 5)
        port = got["h0"].port
        h.spawn_procs({"rank": 1})
        (worker,) = [r.pid for r in c.procs.values() if r.pid is not None]
        inode = _listening_inode(port)
        assert inode in _socket_inodes(h.pid) and inode not in _socket_inodes(worker)
        h.conn.send(PreflightClose(nonce))
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
            except ConnectionRefusedError:
                break
            time.sleep(0.02)
        else:
            raise AssertionError("the preflight listener is still open after the round")
