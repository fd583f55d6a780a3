"""Which address a host advertises to its peers, and which interface carries it.

Every address ftharness or torchft gives a peer on another host is the host agent's advertised
address (``AgentReady.address``), never the machine's hostname: on real clusters a node's
hostname often resolves to loopback (Debian's ``/etc/hosts`` maps it to ``127.0.1.1``), or to a
management network while training traffic goes over the fabric. The address is chosen once,
by the agent, before it forks anything (:func:`choose`):

* ``--advertise ADDR`` (``ftharness agent``): that address, as given;
* else the job's ``network.interface`` (a name, as ``GLOO_SOCKET_IFNAME`` takes) or
  ``network.cidr`` (e.g. ``10.0.0.0/8``): the address this host holds on that interface or in
  that network. One that matches nothing here is an error naming the host and what it has
  (:class:`NoAddress`);
* else the local address of the agent's connection to the controller: the interface that
  routes to the job's network.

The agent's workers and programs get it as ``runtime.actor.host_address()`` and in their
environment: :func:`worker_env` (``GLOO_SOCKET_IFNAME`` and ``NCCL_SOCKET_IFNAME``, the
interface holding the address, so collectives between hosts go over the same network; NCCL
reads its variable only where it runs, on GPU hosts) and ``FTHARNESS_ADVERTISE`` (the address,
for the patch applied to a user's own torchft program: ``harness/rank/program_site``).
"""

from __future__ import annotations

import ipaddress
import os
import socket

import psutil

#: A program's environment: the address its host advertises (read by harness/rank/program_site).
ADVERTISE_ENV = "FTHARNESS_ADVERTISE"


class NoAddress(RuntimeError):
    """The configured interface or network matches nothing on this host (the message names the
    host, the setting and the addresses the host has)."""


def boot_and_netns() -> tuple[str | None, int | None]:
    """This machine's kernel boot id (a new one at every reboot) and this process's network
    namespace (its inode), each None where it cannot be read: together, where a process runs as
    far as loopback and shared memory go (``runtime.preflight.place_identity``,
    ``runtime.dataplane.handle.host_id``)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot: str | None = f.read().strip()
    except OSError:
        boot = None
    try:
        netns: int | None = os.stat("/proc/self/ns/net").st_ino
    except OSError:
        netns = None
    return boot, netns


def is_loopback(address: str) -> bool:
    """Whether ``address`` (an IP literal, brackets allowed) is a loopback address
    (``127.0.0.0/8``, ``::1``); a name or anything else is not."""
    try:
        return ipaddress.ip_address(address.strip("[]")).is_loopback
    except ValueError:
        return False


def addresses() -> dict[str, list[str]]:
    """This host's interfaces and their IP addresses (IPv4 first), interfaces that are down
    included (psutil does not say)."""
    out: dict[str, list[str]] = {}
    for name, addrs in psutil.net_if_addrs().items():
        v4 = [a.address for a in addrs if a.family == socket.AF_INET]
        v6 = [a.address.split("%", 1)[0] for a in addrs if a.family == socket.AF_INET6]
        if v4 or v6:
            out[name] = v4 + v6
    return out


def interface_of(address: str) -> str | None:
    """The interface holding ``address`` (for ``GLOO_SOCKET_IFNAME``); None on loopback or when
    no interface holds it (an ``--advertise`` address behind a NAT, say)."""
    if is_loopback(address):
        return None
    for name, addrs in addresses().items():
        if address in addrs:
            return name
    return None


def _describe(have: dict[str, list[str]]) -> str:
    return "; ".join(f"{n} {' '.join(a)}" for n, a in sorted(have.items())) or "none"


def choose(
    *,
    host: str,
    default: str,
    advertise: str | None = None,
    interface: str = "",
    cidr: str = "",
    have: dict[str, list[str]] | None = None,
) -> str:
    """The address host ``host`` advertises (see the module docstring for the order);
    ``default``: the local address of its connection to the controller; ``have``: its
    interfaces (None: :func:`addresses`). NoAddress when ``interface``/``cidr`` match nothing."""
    if advertise:
        return advertise
    if not interface and not cidr:
        return default
    have = addresses() if have is None else have
    if interface:
        found = have.get(interface, [])
        if not found:
            raise NoAddress(
                f"host {host}: network.interface = {interface!r}: "
                + ("the interface has no IP address" if interface in have else "no such interface")
                + f" on this host (it has: {_describe(have)})"
            )
        # The connection's own address where it is on that interface (an interface with
        # several addresses), else its first (IPv4 first).
        return default if default in found else found[0]
    net = ipaddress.ip_network(cidr, strict=False)
    matches = [a for addrs in have.values() for a in addrs if ipaddress.ip_address(a) in net]
    if not matches:
        raise NoAddress(
            f"host {host}: network.cidr = {cidr!r}: no address of this host is in it "
            f"(it has: {_describe(have)})"
        )
    return default if default in matches else matches[0]


def worker_env(address: str) -> dict[str, str]:
    """What the agent adds to its workers' and programs' environment for ``address``."""
    env = {ADVERTISE_ENV: address}
    ifname = interface_of(address)
    if ifname:  # collectives between hosts use the advertised network
        env["GLOO_SOCKET_IFNAME"] = ifname
        env["NCCL_SOCKET_IFNAME"] = ifname
    return env
