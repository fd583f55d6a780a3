"""Unblocking the survivors of a dead replica group from outside their processes.

Why: when a replica group dies mid-allreduce, only the ranks exchanging with it fail at once.
gloo's ring passes data survivor to survivor, so one survivor can stay blocked receiving from
another that already left the collective with its connection open, until its process-group
timeout (torchft's default: 60 s). The built-in trainer destroys its failed communicator itself
(``harness.rank.torchft_glue.close_communicator``); a program of the user's own does not.

How: the host agent, which started every rank of its host and runs as the same user, reads
each surviving rank's TCP sockets from ``/proc`` (:func:`snapshot`), picks those of the failed
cross-group communicator (:func:`communicator_links`, pure), takes a duplicate of each with
``pidfd_getfd(2)`` (Linux >= 5.6; the rank is not stopped or signalled) and shuts it down
(:func:`shut_down`): the blocked receive on the other end, and on this end, fails at once with
"Connection closed by peer", which torchft's Manager records as a failed step like any other.
The socket itself stays open in the rank (only its traffic ends), so no descriptor of the
program is closed behind its back.

Which sockets: a connection between two processes of *different* replica groups, taken at the
moment the death was seen, so a communicator the survivors rebuild afterwards (new sockets,
new inodes) is never touched; a socket is shut down only if the descriptor still names the
same socket (inode). Not touched: connections to anything that is not a rank (the quorum
service, the group's store, ftharness's own channels), connections inside one group, and the
rendezvous store a torchft process group hosts in one of the ranks (a TCPStore server: its
listener has a connection from its own process, which gloo's never has). Across hosts each
side's agent acts on the connections its ranks *accepted* from another host (every TCP
connection has exactly one accepting end), so no agent needs the others' view.

Not guaranteed: a heal transfer between two survivors in flight at that moment (torchft's
checkpoint HTTP server is also a connection between groups) fails and is retried at the next
quorum. NCCL: shutting down NCCL's bootstrap or proxy sockets from outside does not abort a
kernel already running on the GPU; a NCCL program needs ``ncclCommAbort`` in-process (torchft's
``ProcessGroupNCCL.abort``, reachable through ``program.hooks``), which this module cannot do.
Nor can it wake a rank that gloo itself left waiting with no socket (issue #29): a gloo send
already queued on a connection when it fails (the peer died just before, or its socket buffer was
full) is never told of the failure (gloo's tcp ``Pair::signalException`` fails the pending
operations but not an unbound buffer's send in its write queue; ``Pair::write`` drops
ECONNRESET/EPIPE silently), so the rank's collective waits out the process group's timeout with
every gloo connection of it already closed: the survivor whose send to the dead group was under
way, about one kill in 130 under CPU load. The other groups go on without it after the
quorum's join timeout; only killing that rank ends its wait sooner, which the controller does
for a program (``harness.job.program.progress.blocked_survivor``: a survivor that asks for no
quorum within 2 s of a death is restarted).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import platform
import socket
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

#: pidfd_getfd(2)'s syscall number (the same on every architecture since 5.6, but checked).
SYS_PIDFD_GETFD = {"x86_64": 438, "aarch64": 438}.get(platform.machine())
_LISTEN = "0A"
_ESTABLISHED = "01"
_libc = ctypes.CDLL(None, use_errno=True)

Endpoint = tuple[str, int]  # (address as the kernel prints it, normalised; port)


@dataclass(frozen=True, slots=True)
class Conn:
    """One TCP socket of a process: its descriptor, inode and endpoints."""

    fd: int
    inode: int
    local: Endpoint
    remote: Endpoint
    listening: bool


def _addr(hex_addr: str) -> Endpoint:
    host, port = hex_addr.split(":")
    raw = bytes.fromhex(host)
    if len(raw) == 4:
        ip = socket.inet_ntop(socket.AF_INET, raw[::-1])
    else:  # four little-endian 32-bit words
        words = b"".join(raw[i : i + 4][::-1] for i in range(0, 16, 4))
        ip = socket.inet_ntop(socket.AF_INET6, words)
        if ip.startswith("::ffff:") and "." in ip:
            ip = ip[len("::ffff:") :]  # an IPv4 peer of a dual-stack socket
    return ip, int(port, 16)


def socket_fds(pids: Iterable[int]) -> dict[int, dict[int, int]]:
    """pid -> {socket inode: descriptor} for each of ``pids`` (gone or unreadable: left out).
    Cheap (no socket table is read): what is taken at the moment of a death, so that a socket
    opened afterwards is never a candidate."""
    out: dict[int, dict[int, int]] = {}
    for pid in pids:
        base = f"/proc/{pid}/fd"
        try:
            names = os.listdir(base)
        except OSError:
            continue
        inodes = out[pid] = {}
        for name in names:
            with contextlib.suppress(OSError):
                link = os.readlink(f"{base}/{name}")
                if link.startswith("socket:["):
                    inodes[int(link[8:-1])] = int(name)
    return out


def snapshot(fds: Mapping[int, Mapping[int, int]]) -> dict[int, list[Conn]]:
    """Each process's established or listening TCP sockets among ``fds`` (:func:`socket_fds`),
    from its network namespace's tables (``/proc/PID/net/tcp{,6}``)."""
    owner = {ino: pid for pid, inodes in fds.items() for ino in inodes}
    out: dict[int, list[Conn]] = {pid: [] for pid in fds}
    seen_ns: set[int] = set()
    for pid in fds:
        try:
            netns = os.stat(f"/proc/{pid}/ns/net").st_ino
        except OSError:
            continue
        if netns in seen_ns:
            continue
        seen_ns.add(netns)
        for table in ("tcp", "tcp6"):
            with contextlib.suppress(OSError), open(f"/proc/{pid}/net/{table}") as f:
                next(f)
                for line in f:
                    p = line.split()
                    ino = int(p[9])
                    who = owner.get(ino)
                    if who is None or p[3] not in (_LISTEN, _ESTABLISHED):
                        continue
                    c = Conn(fds[who][ino], ino, _addr(p[1]), _addr(p[2]), p[3] == _LISTEN)
                    out[who].append(c)
    return out


def _is_loopback(ip: str) -> bool:
    return ip.startswith("127.") or ip == "::1"


def store_ports(conns: list[Conn]) -> set[int]:
    """The ports of a process's listeners that the process itself is connected to: a TCPStore
    server (its master always holds a client of its own). gloo's listener never is."""
    listening = {c.local[1] for c in conns if c.listening}
    pairs = {(c.local, c.remote) for c in conns if not c.listening}
    return {
        local[1] for local, remote in pairs if local[1] in listening and (remote, local) in pairs
    }


def communicator_links(
    snap: Mapping[int, list[Conn]], group_of: Mapping[int, int], survivors: Iterable[int]
) -> dict[int, list[Conn]]:
    """The sockets to shut down in each of ``survivors`` (pids): its established connections
    to a process of another group on this host (either end), or accepted from another host,
    leaving out TCPStore servers' connections (:func:`store_ports`). ``snap``: every rank of
    this host (:func:`snapshot`); ``group_of``: pid -> replica group."""
    owner: dict[Endpoint, int] = {}  # an established socket's local endpoint -> its pid
    stores: dict[int, set[int]] = {}
    for pid, conns in snap.items():
        stores[pid] = store_ports(conns)
        for c in conns:
            if not c.listening:
                owner[c.local] = pid
    out: dict[int, list[Conn]] = {}
    for pid in survivors:
        conns = snap.get(pid, [])
        listening = {c.local[1] for c in conns if c.listening}
        picked = []
        for c in conns:
            if c.listening or c.local[1] in stores[pid]:
                continue
            other = owner.get(c.remote)
            if other is not None:  # both ends on this host
                if other == pid or group_of.get(other, group_of[pid]) == group_of[pid]:
                    continue
                if c.remote[1] in stores[other]:
                    continue
                picked.append(c)
            elif c.local[1] in listening and not _is_loopback(c.remote[0]):
                picked.append(c)  # accepted from another host: only this end is ours
        out[pid] = picked
    return out


def pidfd_getfd_supported() -> bool:
    return SYS_PIDFD_GETFD is not None and hasattr(os, "pidfd_open")


def shut_down(pid: int, conns: Iterable[Conn]) -> int:
    """Shut down (both directions) each of ``conns`` of process ``pid`` through a duplicate of
    its descriptor; skip one whose descriptor no longer names the same socket. Returns how many
    were shut down. Raises OSError if ``pid`` cannot be reached (gone: ESRCH; not allowed:
    EPERM)."""
    if not pidfd_getfd_supported():
        raise OSError(errno.ENOSYS, "pidfd_getfd is not available here")
    pidfd = os.pidfd_open(pid)
    done = 0
    try:
        for c in conns:
            fd = _libc.syscall(SYS_PIDFD_GETFD, pidfd, c.fd, 0)
            if fd < 0:
                err = ctypes.get_errno()
                if err == errno.EBADF:
                    continue  # closed meanwhile
                raise OSError(err, f"pidfd_getfd({pid}, {c.fd}): {os.strerror(err)}")
            try:
                if os.fstat(fd).st_ino != c.inode:
                    continue  # the number was reused for another socket
                with contextlib.suppress(OSError):  # ENOTCONN: it closed meanwhile
                    s = socket.socket(fileno=fd)
                    try:
                        s.shutdown(socket.SHUT_RDWR)
                        done += 1
                    finally:
                        s.detach()
            finally:
                os.close(fd)
    finally:
        os.close(pidfd)
    return done


def unblock_survivors(
    fds: Mapping[int, Mapping[int, int]], group_of: Mapping[int, int], dead: int
) -> dict[int, int]:
    """Replica group ``dead`` died (or is being fenced): shut down, in every other group's rank
    of this host, the connections of its failed communicator (:func:`communicator_links`).
    ``fds``: :func:`socket_fds` of every live rank of this host (``dead``'s remaining ranks
    included) taken when the death was seen; ``group_of``: pid -> group. Returns pid ->
    sockets shut down; a rank that cannot be read or reached is skipped."""
    snap = snapshot(fds)
    survivors = [pid for pid in snap if group_of.get(pid, dead) != dead]
    done: dict[int, int] = {}
    for pid, conns in communicator_links(snap, group_of, survivors).items():
        if conns:
            with contextlib.suppress(OSError):
                done[pid] = shut_down(pid, conns)
    return done
