"""Which process holds the other end of a TCP connection to us, on this machine (Linux /proc).

The quorum tap (``harness.quorum.tap``) admits a request of a program's Manager only if the
connection it came on belongs to the process the job started for that replica group
(``harness.job.program.groups``): an address or a port proves nothing, since any local user can
connect from the same address and read every listening port. This module answers that
question, and nothing else:

* :func:`parse_peer`: the client end of a connection as gRPC names it
  (``ipv4:127.0.0.1:54321``, ``ipv6:[::1]:54321``).
* :func:`holders`: given a process id (the root), the client end and the server end of a
  connection, the socket(s) of that connection and the descriptors under which the root or one
  of its descendants holds them, or None. The connection is looked up in
  ``/proc/<root>/net/tcp`` and ``tcp6`` (read *through the root's pid*, so the table is that of
  the root's network namespace: this works for processes in other network namespaces on this
  machine, such as the netns test hosts and the SLURM test cluster), and each socket inode
  among the ``socket:[inode]`` links of ``/proc/<pid>/fd/*`` of the root and its descendants.
  Every socket of the table that matches must be held (a second, foreign socket with the same
  client end, possible only when the server address is a wildcard, fails the check).
* :meth:`Holder.still_holds`: the cheap re-check (one ``readlink``) that a verified descriptor
  still refers to the same socket, so a caller verifies a connection once and re-checks it per
  request in microseconds. While that descriptor is open, its socket keeps the connection's
  address pair, so no other socket can present the same client end to the same server.
* :func:`connection_uids`: the user that made the client's socket, for a connection from this
  network namespace (the group store's gate, ``runtime.group_store``: a store admits its own
  user's processes, and its ranks may be any of the job's processes on this host).
* :func:`descends_from`: whether a pid is a descendant of another (the program's rank 0 of its
  host agent: a pid on this machine names the process the agent started, not a stranger that
  got a recycled or coinciding number).

Costs: finding a connection's socket is one exact lookup in the kernel (``runtime.sock_diag``,
tens of microseconds) where the root is in this network namespace and the server's address is
exact; otherwise a read of the namespace's whole TCP table (10 ms with a few hundred sockets;
more on a busy host). :func:`holders` also lists the root's descendants (every process on the
machine); callers cache its answer (:meth:`Holder.still_holds`).

Not guaranteed: Linux only (elsewhere every answer is None: nothing is proven); it needs
permission to read the root's ``fd`` directory (the same user, or root); it proves which
*process* holds the socket, not which code in it sent the request (a process the job started
is trusted with everything that process can do). Pids of processes on another machine, or in
another pid namespace, mean nothing here: the caller must know that the root is a process of
this machine (``harness.job.program.groups`` proves that its host agent is, by the agent's own
control connection, with this same check).
"""

from __future__ import annotations

import ipaddress
import os
import socket
import struct
import urllib.parse
from collections.abc import Iterable
from dataclasses import dataclass

import psutil

from runtime import sock_diag

#: /proc/net/tcp{,6} state of a connection that no longer has a socket behind it.
_TIME_WAIT = "06"


@dataclass(frozen=True)
class Endpoint:
    """One end of a TCP connection. ``ip`` is normalized (an IPv4-mapped IPv6 address is written
    as IPv4); an empty ``ip`` (only for a server end) matches any address."""

    ip: str
    port: int


@dataclass(frozen=True)
class Holder:
    """A socket (by inode) that process ``pid`` holds as descriptor ``fd``."""

    pid: int
    fd: int
    inode: int

    def still_holds(self) -> bool:
        """Whether ``pid``'s descriptor ``fd`` still refers to this socket (one ``readlink``)."""
        try:
            return os.readlink(f"/proc/{self.pid}/fd/{self.fd}") == f"socket:[{self.inode}]"
        except OSError:
            return False


def normal_ip(ip: str) -> str:
    """``ip`` without a scope, an IPv4-mapped IPv6 address as IPv4; raises ValueError."""
    addr = ipaddress.ip_address(ip.split("%", 1)[0])
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        addr = addr.ipv4_mapped
    return str(addr)


def parse_peer(peer: str) -> Endpoint | None:
    """The client end in a gRPC peer string (``ipv4:1.2.3.4:5``, ``ipv6:[::1]:5``, the brackets
    possibly percent-encoded); None for anything else (a Unix socket, a malformed string)."""
    kind, _, rest = peer.partition(":")
    if kind not in ("ipv4", "ipv6"):
        return None
    host, _, port = urllib.parse.unquote(rest).rpartition(":")
    try:
        return Endpoint(normal_ip(host.strip("[]")), int(port))
    except ValueError:
        return None


def endpoint(address: tuple[object, ...] | list[object]) -> Endpoint:
    """An :class:`Endpoint` from a socket address (``sock.getpeername()``, ``getsockname()``)."""
    return Endpoint(normal_ip(str(address[0])), int(str(address[1])))


def server_endpoint(host: str, port: int) -> Endpoint:
    """The server end of connections to a listener bound to ``host:port``: a wildcard or a name
    (which may stand for several addresses) matches any address."""
    try:
        ip = normal_ip(host.strip("[]"))
    except ValueError:
        return Endpoint("", port)
    return Endpoint("" if ipaddress.ip_address(ip).is_unspecified else ip, port)


def _words(packed: bytes) -> str:
    """16 address bytes as /proc/net/tcp6 writes them: four 32-bit words in host byte order."""
    return "".join(f"{w:08X}" for w in struct.unpack("=4I", packed))


def _hex(ep: Endpoint) -> tuple[str | None, str | None]:
    """``ep``'s address as /proc/net/tcp and /proc/net/tcp6 write it (each 32-bit word in host
    byte order), or None for a table that cannot hold it; an empty ip gives ("", "")."""
    if not ep.ip:
        return "", ""
    addr = ipaddress.ip_address(ep.ip)
    if isinstance(addr, ipaddress.IPv4Address):
        mapped = socket.inet_pton(socket.AF_INET6, f"::ffff:{ep.ip}")
        return f"{struct.unpack('=I', addr.packed)[0]:08X}", _words(mapped)
    return None, _words(addr.packed)


def _rows(pid: int, client: Endpoint, server: Endpoint) -> list[list[str]] | None:
    """The rows of ``pid``'s ``/proc/<pid>/net/tcp{,6}`` whose local end is ``client`` and whose
    remote end is ``server`` (an empty ``server.ip``: any address on that port), TIME_WAIT left
    out (no socket behind it), each split in fields; None if the tables cannot be read."""
    rows: list[list[str]] = []
    read_any = False
    local_hex, remote_hex = _hex(client), _hex(server)
    for i, table in enumerate(("tcp", "tcp6")):
        local, remote = local_hex[i], remote_hex[i]
        if local is None or remote is None:
            continue  # an IPv6 client never appears in the IPv4 table
        want_local = f"{local}:{client.port:04X}"
        want_port = f":{server.port:04X}"
        try:
            with open(f"/proc/{pid}/net/{table}") as f:
                lines = f.read().splitlines()[1:]
        except OSError:
            continue
        read_any = True
        for line in lines:
            fields = line.split()
            if len(fields) < 10 or fields[1] != want_local or fields[3] == _TIME_WAIT:
                continue
            if not fields[2].endswith(want_port) or (remote and fields[2] != remote + want_port):
                continue
            rows.append(fields)
    return rows if read_any else None


def _sockets(pid: int, client: Endpoint, server: Endpoint) -> list[tuple[int, int]] | None:
    """``(uid, inode)`` of each socket in ``pid``'s network namespace whose local end is
    ``client`` and whose remote end is ``server`` (see :func:`_rows`); None if the tables
    cannot be read. Asked of the kernel for the one address pair where that can be
    (``runtime.sock_diag``: ``pid`` in this namespace, an exact server address), else read from
    ``/proc``."""
    if server.ip and _in_this_netns(pid):
        found = sock_diag.lookup(client.ip, client.port, server.ip, server.port)
        if found is not None:
            return found
    rows = _rows(pid, client, server)
    if rows is None:
        return None
    return [(int(fields[7]), int(fields[9])) for fields in rows]


def _in_this_netns(pid: int) -> bool:
    try:
        theirs, ours = os.stat(f"/proc/{pid}/ns/net"), os.stat("/proc/self/ns/net")
    except OSError:
        return False
    return (theirs.st_dev, theirs.st_ino) == (ours.st_dev, ours.st_ino)


def connection_inodes(pid: int, client: Endpoint, server: Endpoint) -> set[int] | None:
    """The inodes of the sockets in ``pid``'s network namespace whose local end is ``client``
    and whose remote end is ``server`` (see :func:`_rows`); None if the tables cannot be read."""
    found = _sockets(pid, client, server)
    if found is None:
        return None
    return {inode for _, inode in found if inode}


def connection_uids(pid: int, client: Endpoint, server: Endpoint) -> set[int] | None:
    """The owners (uids) of the sockets in ``pid``'s network namespace whose local end is
    ``client`` and whose remote end is ``server``: the user whose process made each socket, as
    the kernel recorded it (one lookup; no process is looked at). None if the tables cannot be
    read; empty if no such socket is in this namespace."""
    found = _sockets(pid, client, server)
    if found is None:
        return None
    return {uid for uid, _ in found}


def process_tree(root: int) -> list[int]:
    """``root`` and every live descendant (empty if ``root`` does not exist)."""
    try:
        proc = psutil.Process(root)
        return [root, *(p.pid for p in proc.children(recursive=True))]
    except psutil.Error:
        return []


def descends_from(pid: int, ancestor: int) -> bool:
    """Whether process ``pid`` exists here and ``ancestor`` is its parent or an earlier one."""
    try:
        return any(p.pid == ancestor for p in psutil.Process(pid).parents())
    except psutil.Error:
        return False


def _find_fds(pids: Iterable[int], inodes: set[int]) -> dict[int, Holder]:
    """For each of ``inodes``, a descriptor of one of ``pids`` that refers to it."""
    want = {f"socket:[{inode}]": inode for inode in inodes}
    found: dict[int, Holder] = {}
    for pid in pids:
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                inode = want.get(os.readlink(f"/proc/{pid}/fd/{fd}"))
            except OSError:
                continue
            if inode is not None and inode not in found:
                found[inode] = Holder(pid, int(fd), inode)
                if len(found) == len(want):
                    return found
    return found


def holders(root: int, client: Endpoint, server: Endpoint) -> tuple[Holder, ...] | None:
    """The sockets of the connection from ``client`` to ``server``, each as a descriptor that
    ``root`` or one of its descendants holds; None unless every such socket is held by them
    (none found, a foreign one among them, or ``/proc`` not readable). See the module doc."""
    inodes = connection_inodes(root, client, server)
    if not inodes:
        return None
    found = _find_fds(process_tree(root), inodes)
    if len(found) != len(inodes):
        return None
    return tuple(found[i] for i in sorted(inodes))


def held_by(pid: int, held: Iterable[Holder]) -> tuple[Holder, ...] | None:
    """The sockets of ``held`` as descriptors of process ``pid`` itself (not its descendants);
    None unless it holds every one of them."""
    inodes = {h.inode for h in held}
    found = _find_fds([pid], inodes)
    if not inodes or len(found) != len(inodes):
        return None
    return tuple(found[i] for i in sorted(inodes))


def still_held(held: Iterable[Holder]) -> bool:
    """Whether every one of ``held`` is still held (:meth:`Holder.still_holds`)."""
    return all(h.still_holds() for h in held)
