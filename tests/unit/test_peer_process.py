"""runtime/peer_process.py on real sockets: which process holds the client end of a TCP
connection to a listener of this process."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from runtime import peer_process as pp
from runtime import sock_diag

pytestmark = [
    pytest.mark.timeout(60),
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads Linux /proc"),
]

# A client in a child process: connects to argv[1]:argv[2], prints its own end, then sleeps
# (optionally from a grandchild that holds the socket: argv[3] == "grandchild").
CLIENT = """
import os, socket, sys, time
s = socket.create_connection((sys.argv[1], int(sys.argv[2])))
if sys.argv[3] == "grandchild" and os.fork():
    s.close()
    time.sleep(60)
print(*s.getsockname()[:2], os.getpid(), flush=True)
time.sleep(60)
"""


@pytest.fixture
def listener() -> Iterator[socket.socket]:
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen()
    yield srv
    srv.close()


def _client(
    srv: socket.socket, how: str = "child", user: tuple[str, ...] = ()
) -> tuple[subprocess.Popen, pp.Endpoint, int]:
    host, port = srv.getsockname()
    proc = subprocess.Popen(
        [*user, sys.executable, "-c", CLIENT, host, str(port), how],
        stdout=subprocess.PIPE,
        text=True,
        cwd="/",
    )
    assert proc.stdout is not None
    ip, cport, holder = proc.stdout.readline().split()
    return proc, pp.Endpoint(ip, int(cport)), int(holder)


def _stop(proc: subprocess.Popen) -> None:
    proc.kill()
    proc.wait()


def test_parse_peer() -> None:
    assert pp.parse_peer("ipv4:127.0.0.1:54321") == pp.Endpoint("127.0.0.1", 54321)
    assert pp.parse_peer("ipv6:[::1]:5") == pp.Endpoint("::1", 5)
    assert pp.parse_peer("ipv6:%5B::ffff:10.0.0.1%5D:7") == pp.Endpoint("10.0.0.1", 7)
    assert pp.parse_peer("ipv6:[fe80::1%25eth0]:7") == pp.Endpoint("fe80::1", 7)
    for bad in ("unix:/tmp/x", "ipv4:nonsense", "ipv4:1.2.3.4:port", ""):
        assert pp.parse_peer(bad) is None
    assert pp.server_endpoint("0.0.0.0", 9) == pp.Endpoint("", 9)
    assert pp.server_endpoint("localhost", 9) == pp.Endpoint("", 9)
    assert pp.server_endpoint("127.0.0.1", 9) == pp.Endpoint("127.0.0.1", 9)


def test_the_process_holding_the_client_end_is_found_and_no_other(listener) -> None:
    server = pp.endpoint(listener.getsockname())
    proc, client, holder = _client(listener)
    try:
        assert holder == proc.pid
        held = pp.holders(proc.pid, client, server)
        assert held is not None and [h.pid for h in held] == [proc.pid]
        assert pp.still_held(held)
        # This process is the client's parent: its tree holds the client end too.
        conn, _ = listener.accept()
        assert pp.holders(os.getpid(), client, server) is not None
        # A sibling connected from another port holds its own connection, not this one.
        other, other_end, _ = _client(listener)
        try:
            assert pp.holders(other.pid, client, server) is None
            assert pp.holders(proc.pid, other_end, server) is None
            assert pp.holders(other.pid, other_end, server) is not None
        finally:
            _stop(other)
        # A wildcard server address matches on the port alone; a wrong port matches nothing.
        assert pp.holders(proc.pid, client, pp.Endpoint("", server.port)) is not None
        assert pp.holders(proc.pid, client, pp.Endpoint(server.ip, server.port + 1)) is None
        conn.close()
    finally:
        _stop(proc)
    # Once the process is gone, its descriptor no longer holds the socket.
    assert not pp.still_held(held)
    assert pp.holders(proc.pid, client, server) is None


def test_a_socket_held_by_a_descendant_counts_for_its_ancestor(listener) -> None:
    server = pp.endpoint(listener.getsockname())
    proc, client, holder = _client(listener, "grandchild")
    try:
        assert holder != proc.pid and pp.descends_from(holder, proc.pid)
        held = pp.holders(proc.pid, client, server)
        assert held is not None and [h.pid for h in held] == [holder]
        assert pp.holders(holder, client, server) is not None
        # Descent goes one way.
        assert not pp.descends_from(proc.pid, holder)
    finally:
        _stop(proc)
        os.kill(holder, 9)


def test_a_socket_of_this_process_is_not_held_by_a_stranger(listener) -> None:
    """The other way round: a client socket this test opens is found under this process and
    refused for any other root."""
    server = pp.endpoint(listener.getsockname())
    sock = socket.create_connection(listener.getsockname())
    try:
        client = pp.endpoint(sock.getsockname())
        mine = pp.holders(os.getpid(), client, server)
        assert mine is not None and mine[0].fd == sock.fileno()
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        try:
            assert pp.holders(child.pid, client, server) is None
        finally:
            _stop(child)
    finally:
        sock.close()
    time.sleep(0.05)
    assert not pp.still_held(mine)


@pytest.mark.skipif(not socket.has_ipv6, reason="no IPv6")
def test_ipv6_loopback() -> None:
    try:
        srv = socket.socket(socket.AF_INET6)
        srv.bind(("::1", 0))
    except OSError:
        pytest.skip("no ::1 here")
    srv.listen()
    try:
        sock = socket.create_connection(srv.getsockname()[:2])
        try:
            client, server = pp.endpoint(sock.getsockname()), pp.endpoint(srv.getsockname())
            assert pp.holders(os.getpid(), client, server) is not None
            assert pp.parse_peer(f"ipv6:[::1]:{client.port}") == client
        finally:
            sock.close()
    finally:
        srv.close()


def test_nothing_is_proven_for_a_process_that_does_not_exist() -> None:
    assert pp.holders(2**22 + 12345, pp.Endpoint("127.0.0.1", 1), pp.Endpoint("", 2)) is None
    assert not pp.descends_from(2**22 + 12345, 1)


AS_NOBODY = ("setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups")


@pytest.mark.parametrize("user", ["me", "nobody"])
def test_the_kernels_exact_lookup_finds_what_the_tcp_table_says(listener, user) -> None:
    """``runtime.sock_diag`` (what the checks ask where they can) finds the client's socket and
    its owner as a read of ``/proc/net/tcp`` does, another user's socket as that user's, and
    nothing for an address pair no socket has."""
    if user == "nobody" and os.geteuid() != 0:
        pytest.skip("needs root, to be another user")
    server = pp.endpoint(listener.getsockname())
    proc, client, _ = _client(listener, user=AS_NOBODY if user == "nobody" else ())
    try:
        found = sock_diag.lookup(client.ip, client.port, server.ip, server.port)
        rows = pp._rows(proc.pid, client, server)
        assert rows is not None and found == [(int(r[7]), int(r[9])) for r in rows]
        uid = 65534 if user == "nobody" else os.getuid()
        assert len(found) == 1 and found[0][0] == uid and found[0][1] > 0
        assert pp.connection_uids(os.getpid(), client, server) == {uid}
        assert sock_diag.lookup(client.ip, client.port + 1, server.ip, server.port) == []
    finally:
        _stop(proc)
