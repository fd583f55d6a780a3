"""A real host agent's quorum relay (runtime.relay): its workers find it in their environment
and reach, through it, wherever the controller says the quorum service is."""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time
from dataclasses import replace

import psutil

from runtime.controller import Controller
from runtime.relay import RELAY_ENV, parse_address
from runtime.spec import ControllerSpec, HeartbeatSpec

FAST = ControllerSpec(
    heartbeat=HeartbeatSpec(interval_s=0.05, timeout_s=2.0),
    agent_heartbeat=HeartbeatSpec(interval_s=0.1, timeout_s=5.0),
    preload=(),
    call_timeout_s=20.0,
)


def relay_env() -> str | None:
    """In a worker: what it finds in ``$FTHARNESS_QUORUM_RELAY``."""
    return os.environ.get(RELAY_ENV)


def listening_ports() -> list[int]:
    """In a worker: the TCP ports it holds a listening socket on."""
    conns = psutil.Process().net_connections(kind="tcp")
    return [x.laddr.port for x in conns if x.status == psutil.CONN_LISTEN]


def through_relay(payload: bytes) -> bytes:
    """In a worker: ``payload`` sent through the relay, and what came back: the upstream's
    answer (tag and payload, which ends with a newline), or b"" (closed)."""
    addr = parse_address(os.environ[RELAY_ENV])
    assert addr is not None
    got = b""
    with socket.create_connection(addr, timeout=10) as s:
        s.sendall(payload + b"\n")
        while not got.endswith(b"\n") and (chunk := s.recv(4096)):
            got += chunk
    return got.rstrip(b"\n")


class TaggedEcho:
    """Answers each line of a connection with its tag and the line (the relay ends both sides
    of a connection together: no half-close)."""

    def __init__(self, tag: bytes) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.address = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.tag = tag
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn, contextlib.suppress(OSError):
            for line in conn.makefile("rb"):
                conn.sendall(self.tag + line)

    def close(self) -> None:
        self.sock.close()


def test_agent_relays_to_the_quorum_upstream_it_is_told() -> None:
    a, b = TaggedEcho(b"a:"), TaggedEcho(b"b:")
    c = Controller(replace(FAST, quorum_relay=True), on_failure=lambda f: True)
    try:
        c.set_quorum_upstream(a.address)  # before the agent dials in: in its AgentConfig
        host = c.spawn_host("h0")
        proc = host.spawn_procs({"r": 1}).proc_ids[0]
        env = c.run_in_worker(proc, relay_env).result(timeout=20)
        assert env is not None and env.startswith("http://127.0.0.1:")
        assert c.run_in_worker(proc, through_relay, b"x").result(timeout=20) == b"a:x"
        # a forked worker closed its copy of the relay's listener (runtime.relay.Relay.sockets)
        relay_port = parse_address(env)[1]  # type: ignore[index]
        assert relay_port not in c.run_in_worker(proc, listening_ports).result(timeout=20)
        c.set_quorum_upstream(b.address)  # a takeover's quorum elsewhere: QuorumUpstream
        deadline = time.monotonic() + 20
        while (got := c.run_in_worker(proc, through_relay, b"y").result(timeout=20)) != b"b:y":
            assert got == b"a:y" and time.monotonic() < deadline, got
            time.sleep(0.05)
        c.set_quorum_upstream("")  # nowhere: the connection is closed at once
        deadline = time.monotonic() + 20
        while (got := c.run_in_worker(proc, through_relay, b"z").result(timeout=20)) != b"":
            assert time.monotonic() < deadline, got
            time.sleep(0.05)
    finally:
        c.shutdown(grace_s=0.5)
        a.close()
        b.close()


def test_no_relay_unless_the_spec_asks() -> None:
    c = Controller(FAST, on_failure=lambda f: True)
    try:
        proc = c.spawn_host("h0").spawn_procs({"r": 1}).proc_ids[0]
        assert c.run_in_worker(proc, relay_env).result(timeout=20) is None
    finally:
        c.shutdown(grace_s=0.5)
