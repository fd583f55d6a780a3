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

Who may connect (issue #49, finding 3). torch's TCPStore has no authentication, and any user of
the machine can read its port: a stranger could read a group's keys (its tagged quorum id), set
them (a ``manager_addr`` pointing a heal at itself) or fill the store. So the store is served in
two processes:

* the **gate** (the agent's child): it holds the listening socket on the agent's address and
  admits a connection only if its client socket belongs to the job's own user (the owner the
  kernel records per socket, ``runtime.peer_process.connection_uids``): the store's ranks are
  any of the job's processes on this host (a group's ranks, and every group's ranks for the
  cross-group rendezvous torchft does in the store of one of them). A connection from an
  address that is not this host's (another machine, another network namespace) cannot be looked
  up here and is let in, as before: the store's exposure to the network is the cluster's.
  An admitted connection is handed on as a descriptor;
* the **store** (the gate's child): a TCPStore on 127.0.0.1 of a network namespace of its own
  (``unshare``; a user namespace too when not root), where no one else can connect, splicing
  each admitted connection to it.

Where no network namespace can be made (user namespaces disabled, ``/proc`` of another pid
namespace), the gate serves the TCPStore on the listening socket itself, open as before, and
says so in the agent's log.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import ipaddress
import os
import signal
import socket
import struct
import sys
import threading
import time
from datetime import timedelta
from typing import Any

import psutil

from runtime import peer_process, proctree

#: How long the gate waits for its store to say it serves.
READY_S = 60.0
#: At most one line about refused connections per this many seconds (a flood stays one line).
REFUSAL_LOG_S = 10.0

_CLONE_NEWUSER = 0x10000000
_CLONE_NEWNET = 0x40000000
_SIOCGIFFLAGS = 0x8913
_SIOCSIFFLAGS = 0x8914
_IFF_UP = 0x1
_IFREQ = "16sH22x"  # struct ifreq: the name, then ifr_flags


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
            _serve(sock, host, timedelta(seconds=timeout_s))
        except BaseException as exc:  # the agent's log says why a group's store is missing
            print(f"ftharness: the group store on {host}:{port} failed: {exc!r}", file=sys.stderr)
        finally:
            os._exit(1)  # it serves until killed: any end is a failure
    sock.close()
    # host:port, split at the last colon by its users (MASTER_ADDR, MASTER_PORT): no brackets
    return pid, f"{host}:{port}"


def _serve(sock: socket.socket, host: str, timeout: timedelta) -> None:
    """The gate's life: start the private store and admit connections to it, or, where that
    cannot be, serve the store on ``sock`` itself (module doc). Returns only by raising."""
    try:
        hand = _private_store(timeout)
    except PrivateStoreUnavailable as exc:
        print(
            f"ftharness: the group store on {host}:{sock.getsockname()[1]} is open to every user "
            f"of this machine: {exc}",
            file=sys.stderr,
            flush=True,
        )
        _store = bound_store(host, timeout, sock)
        while True:
            signal.pause()
    _admit(sock, hand, os.getuid())


class PrivateStoreUnavailable(RuntimeError):
    """The store cannot be served where only the gate reaches it (why, in words)."""


def _private_store(timeout: timedelta) -> socket.socket:
    """Fork the store process (module doc); once it serves, return the socket to hand it
    connections on. It dies with the gate; the gate fails when it cannot hand it one."""
    if os.readlink("/proc/self") != str(os.getpid()):
        raise PrivateStoreUnavailable("/proc is another pid namespace's: no socket can be checked")
    ours, theirs = socket.socketpair()
    gate = os.getpid()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the store; tests/integration/test_group_store.py uses it
        try:
            keep = theirs.fileno()
            os.closerange(3, keep)  # the gate's listening socket among them
            os.closerange(keep + 1, _max_fd())
            _enter_private_network()
            proctree.die_with_parent(gate)  # after unshare: a new user namespace clears it
            inner = listener("127.0.0.1")
            port = inner.getsockname()[1]
            _store = bound_store("127.0.0.1", timeout, inner)
            theirs.sendall(b"ok\n")
            _splice_all(theirs, port)
        except BaseException as exc:
            with contextlib.suppress(OSError):
                theirs.sendall(f"{exc}\n".encode())
        finally:
            os._exit(1)
    theirs.close()
    ours.settimeout(READY_S)
    try:
        line = ours.makefile("rb").readline().decode(errors="replace").strip()
    except OSError as exc:
        line = f"it did not answer: {exc}"
    ours.settimeout(None)
    if line != "ok":
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        ours.close()
        raise PrivateStoreUnavailable(f"no network namespace of its own ({line or 'no answer'})")
    return ours


def _enter_private_network() -> None:
    """Move this process into a network namespace of its own (and a user namespace of its own
    when not root, mapping only our ids), with its loopback up."""
    libc = ctypes.CDLL(None, use_errno=True)
    uid, gid = os.getuid(), os.getgid()
    flags = _CLONE_NEWNET if uid == 0 else _CLONE_NEWNET | _CLONE_NEWUSER
    if libc.unshare(flags) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"unshare: {os.strerror(err)}")
    if uid != 0:
        for name, text in (
            ("setgroups", "deny"),
            ("uid_map", f"{uid} {uid} 1"),
            ("gid_map", f"{gid} {gid} 1"),
        ):
            with open(f"/proc/self/{name}", "w") as f:
                f.write(text)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        got = fcntl.ioctl(s, _SIOCGIFFLAGS, struct.pack(_IFREQ, b"lo", 0))
        up = struct.unpack(_IFREQ, got)[1] | _IFF_UP
        fcntl.ioctl(s, _SIOCSIFFLAGS, struct.pack(_IFREQ, b"lo", up))


def _admit(public: socket.socket, hand: socket.socket, uid: int) -> None:
    """The gate's loop: each connection to ``public`` whose client is ``uid``'s (or not on this
    host) is handed to the store over ``hand``; any other is closed unanswered."""
    refused, logged = 0, 0.0
    while True:
        conn, _ = public.accept()
        with conn:
            why = refusal(conn, uid)
            if why is None:
                socket.send_fds(hand, [b"c"], [conn.fileno()])
                continue
        refused += 1
        if time.monotonic() - logged >= REFUSAL_LOG_S:
            print(
                f"ftharness: group store: refused {why} ({refused} so far)",
                file=sys.stderr,
                flush=True,
            )
            logged = time.monotonic()


def refusal(conn: socket.socket, uid: int) -> str | None:
    """Why the connection ``conn`` (accepted here) may not reach the store, or None."""
    try:
        client = peer_process.endpoint(conn.getpeername())
        server = peer_process.endpoint(conn.getsockname())
    except (OSError, ValueError):
        return "a connection with no address (closed at once)"
    if not _of_this_host(client.ip):
        return None  # another machine's, or another namespace's: not ours to look up
    owners = peer_process.connection_uids(os.getpid(), client, server)
    if owners == {uid}:
        return None
    return (
        f"a connection from {client.ip}:{client.port} whose socket is "
        f"{'of no process here' if not owners else 'user ' + ','.join(map(str, sorted(owners)))}'s"
        f", not the job's (user {uid})"
    )


def _of_this_host(ip: str) -> bool:
    """Whether ``ip`` is an address of this network namespace (loopback or an interface's)."""
    if ipaddress.ip_address(ip).is_loopback:
        return True
    for addrs in psutil.net_if_addrs().values():
        for a in addrs:
            if a.family in (socket.AF_INET, socket.AF_INET6):
                with contextlib.suppress(ValueError):
                    if peer_process.normal_ip(a.address) == ip:
                        return True
    return False


def _splice_all(hand: socket.socket, port: int) -> None:
    """The store's loop: splice each connection handed over ``hand`` to the store on
    127.0.0.1:``port``, until the gate goes."""
    while True:
        msg, fds, _, _ = socket.recv_fds(hand, 1, 4)
        if not msg:
            return
        for fd in fds:
            outer = socket.socket(fileno=fd)
            try:
                inner = socket.create_connection(("127.0.0.1", port))
            except OSError:
                outer.close()
                continue
            for s in (outer, inner):
                with contextlib.suppress(OSError):
                    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            threading.Thread(target=_pump, args=(outer, inner), daemon=True).start()
            threading.Thread(target=_pump, args=(inner, outer), daemon=True).start()


def _pump(src: socket.socket, dst: socket.socket) -> None:
    """Copy ``src`` to ``dst`` until either ends; then end both (a store client never half
    closes)."""
    try:
        while data := src.recv(1 << 16):
            dst.sendall(data)
    except OSError:
        pass
    for s in (src, dst):
        with contextlib.suppress(OSError):
            s.shutdown(socket.SHUT_RDWR)
    with contextlib.suppress(OSError):
        src.close()


def _max_fd() -> int:
    try:
        return os.sysconf("SC_OPEN_MAX")
    except (ValueError, OSError):
        return 65536
