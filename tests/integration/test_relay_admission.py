"""The quorum relay vouches for its clients (``runtime.relay.from_this_tree``): a connection
from a process of the relay's own tree (here: a child of the process running the relay, as a
program is a child of its host agent) is forwarded; one from any other process of the machine
(here: this test, the relay's parent) is closed before anything reaches the upstream."""

from __future__ import annotations

import socket
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

RELAY = textwrap.dedent(
    """
    import subprocess, sys
    sys.path.insert(0, {root!r})
    from runtime.relay import Relay, from_this_tree
    relay = Relay("127.0.0.1", admit=from_this_tree)
    port = relay.start()
    relay.set_upstream("127.0.0.1:{upstream}")
    print(port, flush=True)
    sys.stdin.readline()  # the test's stranger has tried: now our own child
    child = (
        "import socket, sys; s = socket.create_connection(('127.0.0.1', int(sys.argv[1])));"
        "s.sendall(b'ours'); print(s.recv(16).decode(), flush=True)"
    )
    out = subprocess.run([sys.executable, "-c", child, str(port)], capture_output=True, text=True,
                         timeout=30)
    print("child:", out.stdout.strip(), out.stderr.strip()[-300:], flush=True)
    relay.close()
    """
)


def _echo_server() -> tuple[socket.socket, list[bytes]]:
    """An upstream that echoes what it gets and records it."""
    srv = socket.create_server(("127.0.0.1", 0))
    got: list[bytes] = []

    def serve() -> None:
        while True:
            try:
                conn, _ = srv.accept()
            except OSError:
                return
            with conn:
                data = conn.recv(16)
                got.append(data)
                conn.sendall(data)

    threading.Thread(target=serve, daemon=True).start()
    return srv, got


def test_the_relay_forwards_its_own_trees_connections_and_closes_a_strangers():
    srv, got = _echo_server()
    script = RELAY.format(root=str(ROOT), upstream=srv.getsockname()[1])
    proc = subprocess.Popen(
        [sys.executable, "-c", script],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        assert proc.stdout is not None and proc.stdin is not None
        port = int(proc.stdout.readline())
        # this process is the relay's parent, not of its tree: closed, nothing forwarded
        stranger = socket.create_connection(("127.0.0.1", port), timeout=10)
        stranger.sendall(b"stranger")
        assert stranger.recv(16) == b""
        stranger.close()
        proc.stdin.write("go\n")
        proc.stdin.flush()
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
        srv.close()
    assert "child: ours" in out, out
    assert got == [b"ours"], got  # the stranger's bytes never reached the upstream
