"""runtime.relay: real sockets and threads, an echo server upstream."""

from __future__ import annotations

import contextlib
import os
import socket
import threading
from collections.abc import Iterator

import pytest

from runtime.relay import RELAY_ENV, Relay, configure_relay, parse_address

WAIT_S = 5.0  # an upper bound for things that happen at once, never a measure of speed


class Echo:
    """A TCP echo server on loopback, one thread per connection; ``stop`` closes everything."""

    def __init__(self, tag: bytes = b"") -> None:
        self.tag = tag
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.conns: list[socket.socket] = []
        self.accepted = threading.Semaphore(0)
        threading.Thread(target=self._accept, daemon=True, name="test-echo").start()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.conns.append(conn)
            self.accepted.release()
            threading.Thread(target=self._echo, args=(conn,), daemon=True).start()

    def _echo(self, conn: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := conn.recv(4096):
                conn.sendall(self.tag + data)

    def stop(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()
        for c in self.conns:
            with contextlib.suppress(OSError):
                c.shutdown(socket.SHUT_RDWR)
            c.close()


@pytest.fixture
def echo() -> Iterator[Echo]:
    e = Echo()
    yield e
    e.stop()


@pytest.fixture
def relay() -> Iterator[Relay]:
    r = Relay()
    r.start()
    yield r
    r.close()


def dial(relay: Relay) -> socket.socket:
    host, port = relay.address.rsplit(":", 1)
    s = socket.create_connection((host, int(port)), timeout=WAIT_S)
    return s


def closed(s: socket.socket) -> bool:
    """True once the peer closed ``s`` (EOF or reset), waiting at most WAIT_S."""
    try:
        return s.recv(1) == b""
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def relay_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("ftharness-relay-")]


def test_parse_address() -> None:
    assert parse_address("http://10.0.0.1:29510") == ("10.0.0.1", 29510)
    assert parse_address("h:1") == ("h", 1)
    assert parse_address("http://[::1]:5/") == ("::1", 5)
    assert parse_address("") is None
    with pytest.raises(ValueError):
        parse_address("nohost")


def test_bytes_round_trip(relay: Relay, echo: Echo) -> None:
    relay.set_upstream(f"http://{echo.address}")
    assert relay.upstream == echo.address
    with dial(relay) as s:
        payload = os.urandom(300_000)
        threading.Thread(target=s.sendall, args=(payload,), daemon=True).start()
        got = b""
        while len(got) < len(payload):
            chunk = s.recv(1 << 16)
            assert chunk
            got += chunk
        assert got == payload
        relayed = relay.sockets()[1:]  # the listener, then the connection's two sockets
        assert len(relayed) == 2
        assert all(x.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) for x in relayed)


def test_no_upstream_closes_at_once(relay: Relay) -> None:
    with dial(relay) as s:
        assert closed(s)


def test_unreachable_upstream_closes(relay: Relay) -> None:
    dead = socket.create_server(("127.0.0.1", 0))
    port = dead.getsockname()[1]
    dead.close()  # nothing listens there now: the dial is refused
    relay.set_upstream(f"127.0.0.1:{port}")
    with dial(relay) as s:
        assert closed(s)


def test_upstream_dies_closes_downstream(relay: Relay, echo: Echo) -> None:
    relay.set_upstream(echo.address)
    with dial(relay) as s:
        s.sendall(b"ping")
        assert s.recv(16) == b"ping"
        echo.stop()
        assert closed(s)


def test_new_upstream_closes_old_connections(relay: Relay, echo: Echo) -> None:
    other = Echo(tag=b"new:")
    try:
        relay.set_upstream(echo.address)
        with dial(relay) as old:
            old.sendall(b"a")
            assert old.recv(16) == b"a"
            relay.set_upstream(echo.address)  # the same address: nothing happens
            old.sendall(b"b")
            assert old.recv(16) == b"b"
            relay.set_upstream(f"http://{other.address}")
            assert closed(old)
        with dial(relay) as new:
            new.sendall(b"c")
            assert new.recv(16) == b"new:c"
        relay.set_upstream("")
        with dial(relay) as none:
            assert closed(none)
    finally:
        other.stop()


def test_close_leaves_no_thread_or_socket(echo: Echo) -> None:
    before = relay_threads()
    r = Relay()
    r.start()
    r.set_upstream(echo.address)
    clients = [dial(r) for _ in range(3)]
    for c in clients:
        c.sendall(b"x")
        assert c.recv(4) == b"x"
    assert len(relay_threads()) == len(before) + 1 + 2 * len(clients)
    socks = r.sockets()
    assert len(socks) == 1 + 2 * len(clients)
    r.close()
    assert relay_threads() == before
    assert all(s.fileno() == -1 for s in socks)
    for c in clients:
        assert closed(c)
        c.close()
    with pytest.raises(OSError):
        dial(r)


def test_configure_relay_exports_its_address(monkeypatch: pytest.MonkeyPatch, echo: Echo) -> None:
    monkeypatch.setenv(RELAY_ENV, "http://127.0.0.1:1")  # inherited: undone after the test
    assert configure_relay(None, False, "") is None
    assert RELAY_ENV not in os.environ
    r = configure_relay(None, True, "")
    assert r is not None
    try:
        assert os.environ[RELAY_ENV] == f"http://{r.address}"
        assert r.upstream == ""
        assert configure_relay(r, True, f"http://{echo.address}") is r
        assert r.upstream == echo.address
        with dial(r) as s:
            s.sendall(b"hi")
            assert s.recv(4) == b"hi"
    finally:
        r.close()


def test_every_job_with_the_tree_quorum_relays_and_none_with_torchfts_lighthouse() -> None:
    from harness.config import JobConfig, RecoveryConfig
    from harness.job.site import wants_quorum_relay

    tree, lighthouse = RecoveryConfig(quorum="tree"), RecoveryConfig(quorum="torchft")
    for launcher in ("local", "netns", "external", "slurm"):
        assert wants_quorum_relay(JobConfig(launcher=launcher, recovery=tree))
        assert not wants_quorum_relay(JobConfig(launcher=launcher, recovery=lighthouse))
