"""A replica group's store (torch's TCPStore: ``MASTER_ADDR``/``MASTER_PORT``), served on the
group's host by a process of the host agent's, as torchrun's agent serves its workers' store.

Why the agent and not the controller: a group's ranks keep their store's address for life, and
a program may use the store long after it started (``torch.distributed``'s ``env://`` process
groups, torchtitan's device meshes, NCCL's lazily created communicators, which exchange their ids
through it). The controller can die and be replaced (``docs/controller.md``); the agent and its
workers outlive it, so a store there outlives it too. It also puts the store next to the ranks
that use it, not across the network on the controller's node.

How: the agent (single-threaded: it forks its workers) binds a listening socket on a free port
of its address, forks a child that serves a TCPStore on that very socket (torch's
``master_listen_fd``: torch's server would otherwise listen on every interface) and answers
with ``host:port`` at once. The child holds nothing else of the agent's, dies with the agent
(PR_SET_PDEATHSIG) and is killed when the agent serves the group's next incarnation a fresh
store (keys of a dead incarnation must not leak into the next one).
"""

from __future__ import annotations

import os
import signal
import socket
import sys
from datetime import timedelta
from typing import Any

from runtime import proctree


def bound_store(host: str, timeout: timedelta | None, sock: socket.socket | None = None) -> Any:
    """A TCPStore server listening on ``host`` only: on ``sock`` (bound and listening), else on
    a free port (``timeout``: None for torch's default).

    torch's TCPStore server listens on every interface whatever ``host_name`` says; handed a
    socket already bound (``master_listen_fd``), it listens on that one. The store owns the
    descriptor from then on (libuv closes it with the store)."""
    from torch.distributed import TCPStore

    if sock is None:
        sock = listener(host)
    extra: dict[str, Any] = {} if timeout is None else {"timeout": timeout}
    try:
        store = TCPStore(
            host_name=host,
            port=sock.getsockname()[1],
            is_master=True,
            wait_for_workers=False,
            master_listen_fd=sock.fileno(),
            use_libuv=True,
            **extra,
        )
    except BaseException:
        sock.close()
        raise
    sock.detach()
    return store


def listener(host: str) -> socket.socket:
    """A TCP socket listening on a free port of ``host``."""
    family, kind, proto, _, addr = socket.getaddrinfo(
        host, 0, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.bind(addr)
        sock.listen(socket.SOMAXCONN)
    except BaseException:
        sock.close()
        raise
    return sock


def serve_in_child(host: str, timeout_s: float) -> tuple[int, str]:
    """Fork a process serving a TCPStore on a free port of ``host``; return its pid and the
    store's ``host:port``. The caller reaps it (and must not count it among its workers)."""
    sock = listener(host)
    port = sock.getsockname()[1]
    parent = os.getpid()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child; tests/integration/test_group_store.py watches it
        try:
            os.setsid()  # no terminal's signals
            for sig in (signal.SIGCHLD, signal.SIGTERM, signal.SIGINT, signal.SIGPIPE):
                signal.signal(sig, signal.SIG_DFL)
            signal.set_wakeup_fd(-1)
            proctree.die_with_parent(parent)
            keep = sock.fileno()
            os.closerange(3, keep)  # the agent's connections, heartbeats and wakeup pipe
            os.closerange(keep + 1, _max_fd())
            _store = bound_store(host, timedelta(seconds=timeout_s), sock)
            while True:
                signal.pause()
        except BaseException as exc:  # the agent's log says why a group's store is missing
            print(f"ftharness: the group store on {host}:{port} failed: {exc!r}", file=sys.stderr)
        finally:
            os._exit(1)  # it serves until killed: any end is a failure
    sock.close()
    # host:port, split at the last colon by its users (MASTER_ADDR, MASTER_PORT): no brackets
    return pid, f"{host}:{port}"


def _max_fd() -> int:
    try:
        return os.sysconf("SC_OPEN_MAX")
    except (ValueError, OSError):
        return 65536
