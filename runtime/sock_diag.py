"""One TCP socket of this network namespace, found by its exact address pair: netlink's
``sock_diag`` (``SOCK_DIAG_BY_FAMILY``, what ``ss`` uses), asked for that one socket.

Why not ``/proc/net/tcp``: reading it walks the kernel's whole connection table, 10 ms here with
a few hundred sockets, tens under load, and the group store's gate (``runtime.group_store``)
pays that for every connection it admits: every rank of a replacement connects to its group's
store several times while it starts, and every rank of every group once more at each
membership change (torchft rebuilds its communicator). An exact lookup is a hash lookup in the
kernel: tens of microseconds.

:func:`lookup` answers for the caller's own network namespace only; ``runtime.peer_process``
uses it where that is the namespace asked about and the server's address is exact, and reads
``/proc/<pid>/net/tcp{,6}`` otherwise (a wildcard server address, another namespace, a kernel
without ``sock_diag``).
"""

from __future__ import annotations

import errno
import ipaddress
import socket
import struct

NETLINK_SOCK_DIAG = 4
SOCK_DIAG_BY_FAMILY = 20
NLM_F_REQUEST = 1
NLMSG_ERROR = 2
INET_DIAG_NOCOOKIE = 0xFFFFFFFF
TCP_TIME_WAIT = 6  # a connection with no socket behind it (no owner, no inode)

_NLMSGHDR = struct.Struct("=IHHII")  # len, type, flags, seq, pid
_REQ = struct.Struct("=BBBBI")  # inet_diag_req_v2: family, protocol, ext, pad, states
_PORTS = struct.Struct(">HH")  # inet_diag_sockid: sport, dport (network order) ...
_TAIL = struct.Struct("=III")  # ... then src[16], dst[16], if, cookie[2]
# inet_diag_msg after the netlink header: family, state, timer, retrans, the 48-byte sockid,
# then expires, rqueue, wqueue, uid, inode
_MSG = struct.Struct("=BBBB48xIIIII")


def lookup(
    client_ip: str, client_port: int, server_ip: str, server_port: int
) -> list[tuple[int, int]] | None:
    """``(uid, inode)`` of the socket of this network namespace whose local end is
    ``client_ip:client_port`` and whose remote end is ``server_ip:server_port`` (exact
    addresses; an IPv4 pair is looked for among IPv6 sockets too, IPv4-mapped): ``[]`` if there
    is none (or only a TIME_WAIT entry), None if the kernel cannot be asked (then read
    ``/proc``). ``uid``: the user whose process made the socket."""
    client, server = ipaddress.ip_address(client_ip), ipaddress.ip_address(server_ip)
    if client.version != server.version:
        return []
    asks: list[tuple[int, bytes, bytes]] = []
    if isinstance(client, ipaddress.IPv4Address):
        asks.append((socket.AF_INET, client.packed + bytes(12), server.packed + bytes(12)))
        v6 = ipaddress.IPv6Address(f"::ffff:{client}"), ipaddress.IPv6Address(f"::ffff:{server}")
        asks.append((socket.AF_INET6, v6[0].packed, v6[1].packed))
    else:
        asks.append((socket.AF_INET6, client.packed, server.packed))
    try:
        with socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_SOCK_DIAG) as nl:
            for family, src, dst in asks:
                got = _ask(nl, family, client_port, src, server_port, dst)
                if got is None:
                    return None
                if got:  # one address pair, one socket (an IPv6 ask finds an IPv4 one too)
                    return sorted(set(got))
    except OSError:
        return None
    return []


def _ask(
    nl: socket.socket, family: int, sport: int, src: bytes, dport: int, dst: bytes
) -> list[tuple[int, int]] | None:
    """One exact request on ``nl``; its answer as :func:`lookup` gives it."""
    body = (
        _REQ.pack(family, socket.IPPROTO_TCP, 0, 0, 0xFFFFFFFF)
        + _PORTS.pack(sport, dport)
        + src
        + dst
        + _TAIL.pack(0, INET_DIAG_NOCOOKIE, INET_DIAG_NOCOOKIE)
    )
    nl.send(
        _NLMSGHDR.pack(_NLMSGHDR.size + len(body), SOCK_DIAG_BY_FAMILY, NLM_F_REQUEST, 1, 0) + body
    )
    data = nl.recv(8192)
    found: list[tuple[int, int]] = []
    offset = 0
    while offset + _NLMSGHDR.size <= len(data):
        length, kind, _, _, _ = _NLMSGHDR.unpack_from(data, offset)
        if length < _NLMSGHDR.size:
            return None
        payload = offset + _NLMSGHDR.size
        if kind == NLMSG_ERROR:
            (code,) = struct.unpack_from("=i", data, payload)
            if code == -errno.ENOENT:
                return found  # no such socket
            return None if code else found
        if kind == SOCK_DIAG_BY_FAMILY and payload + _MSG.size <= len(data):
            _, state, _, _, _, _, _, uid, inode = _MSG.unpack_from(data, payload)
            if state != TCP_TIME_WAIT:
                found.append((uid, inode))
        offset += (length + 3) & ~3
    return found


__all__ = ["lookup"]
