"""Test hosts with their own network, on one machine: a Linux network namespace per host.

:class:`TestNetwork` makes a bridge with the controller's address (``10.251.X.1/24``) and, per
host, a namespace with a veth pair whose inside end is ``eth0`` with the host's own address
(``10.251.X.11``, ``.12``, ...), ``lo`` up. Everything it creates carries one short prefix and
is removed by :meth:`TestNetwork.down` (also after a crash of an earlier run, by prefix).
:class:`NetnsLauncher` starts each host's agent inside its namespace, in UTS and mount
namespaces of its own, named as :data:`HOSTNAMES` says. By default (``"loopback"``) the hosts
look like real nodes whose name does not say where their peers reach them: every host is called
:data:`NODE_HOSTNAME`, and a private ``/etc/hosts`` (bind-mounted over the machine's, in the
agent's mount namespace only) maps that name to ``127.0.1.1``, as Debian's default
``/etc/hosts`` does. Anything that advertises ``gethostname()`` (torchft does, for its
process-group stores, its Manager and its HTTP checkpoint server) then sends its peers to
their own loopback: only addresses chosen as ``runtime.netaddr`` chooses them work.
``"address"`` names each host by its address (what this launcher did before: it hides such
bugs, and is kept to show the difference).

Network faults act on a host's link, as a switch would: :meth:`partition` takes the host-side
veth down (nothing in or out), :meth:`impair` adds delay (``tc netem``, where the kernel has
it: :func:`netem_available`) and packet loss (iptables' ``statistic`` match). Needs root
(CAP_NET_ADMIN), iproute2 and iptables; :func:`available` says why not otherwise.
Only addresses inside namespaces this module created are ever used.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from runtime.launchers import LocalLauncher

SUBNET_BASE = "10.251"  # 10.251.X.0/24, X chosen free at creation
PREFIX = "fth"
#: How test hosts are named: "loopback" (one shared name resolving to 127.0.1.1 on every host,
#: the default) or "address" (each host's address as its name).
HOSTNAMES = ("loopback", "address")
#: Every host's hostname in the "loopback" mode.
NODE_HOSTNAME = "ftharness-node"


class NetnsError(RuntimeError):
    """A namespace, link or qdisc operation failed (the command and its stderr are attached)."""


def _ip(*args: str, check: bool = True) -> str:
    return _run(["ip", *args], check=check)


def _run(cmd: list[str], check: bool = True) -> str:
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    if check and done.returncode != 0:
        raise NetnsError(f"{' '.join(cmd)}: {done.stderr.strip() or done.returncode}")
    return done.stdout


def available() -> tuple[bool, str]:
    """Whether test hosts can be made here, and if not, why."""
    if os.geteuid() != 0:
        return False, "network namespaces need root (CAP_NET_ADMIN)"
    for tool in ("ip", "tc", "unshare", "iptables"):
        if shutil.which(tool) is None:
            return False, f"{tool} (iproute2 / util-linux / iptables) is not installed"
    return True, ""


def netem_available() -> bool:
    """Whether the kernel has the netem qdisc (network delay needs it)."""
    probe = f"{PREFIX}probe{os.getpid() % 10000}"
    _run(["ip", "link", "add", probe, "type", "veth", "peer", "name", f"{probe}p"], check=False)
    try:
        done = subprocess.run(
            ["tc", "qdisc", "add", "dev", probe, "root", "netem", "delay", "1ms"],
            capture_output=True, timeout=30,
        )  # fmt: skip
        return done.returncode == 0
    finally:
        _run(["ip", "link", "del", probe], check=False)


@dataclass(frozen=True)
class TestHost:
    name: str
    netns: str
    address: str
    veth: str  # the host-side end, on the bridge


class TestNetwork:
    __test__ = False  # not a pytest test class

    def __init__(self, hosts: list[str]) -> None:
        ok, why = available()
        if not ok:
            raise NetnsError(why)
        self.tag = f"{PREFIX}{secrets.token_hex(2)}"  # e.g. fth3f9a; interface names <= 15 chars
        self.subnet = self._free_subnet()
        net = ipaddress.ip_network(self.subnet)
        self.gateway = str(net.network_address + 1)
        self.bridge = f"{self.tag}br"
        self.hosts = {
            name: TestHost(
                name, f"{self.tag}-{name}", str(net.network_address + 11 + i), f"{self.tag}v{i}"
            )
            for i, name in enumerate(hosts)
        }
        self._lock = threading.Lock()
        self.partitioned: set[str] = set()
        self._up = False
        self._etc: str | None = None  # a directory with the hosts' private /etc/hosts

    @property
    def hosts_file(self) -> str:
        """The ``/etc/hosts`` every host sees in the "loopback" mode (made on first use,
        removed by :meth:`down`): Debian's default for a machine named :data:`NODE_HOSTNAME`."""
        if self._etc is None:
            self._etc = tempfile.mkdtemp(prefix=f"{self.tag}-etc-")
            with open(os.path.join(self._etc, "hosts"), "w") as f:
                f.write(f"127.0.0.1\tlocalhost\n127.0.1.1\t{NODE_HOSTNAME}\n")
            os.chmod(self._etc, 0o755)  # readable by all, as /etc/hosts is
        return os.path.join(self._etc, "hosts")

    @staticmethod
    def _free_subnet() -> str:
        used = _ip("-4", "-o", "addr", "show")
        for x in range(1 + secrets.randbelow(200), 256):
            if f" {SUBNET_BASE}.{x}." not in used:
                return f"{SUBNET_BASE}.{x}.0/24"
        raise NetnsError(f"no free {SUBNET_BASE}.X.0/24 subnet")

    def up(self) -> TestNetwork:
        try:
            _ip("link", "add", self.bridge, "type", "bridge")
            _ip("addr", "add", f"{self.gateway}/24", "dev", self.bridge)
            _ip("link", "set", self.bridge, "up")
            for h in self.hosts.values():
                _ip("netns", "add", h.netns)
                _ip("link", "add", h.veth, "type", "veth", "peer", "name", f"{h.veth}p")
                _ip("link", "set", f"{h.veth}p", "netns", h.netns)
                _ip("link", "set", h.veth, "master", self.bridge)
                _ip("link", "set", h.veth, "up")
                _ip("-n", h.netns, "link", "set", f"{h.veth}p", "name", "eth0")
                _ip("-n", h.netns, "addr", "add", f"{h.address}/24", "dev", "eth0")
                _ip("-n", h.netns, "link", "set", "eth0", "up")
                _ip("-n", h.netns, "link", "set", "lo", "up")
        except Exception:
            self.down()
            raise
        self._up = True
        return self

    def pids(self, host: str) -> list[int]:
        out = _ip("netns", "pids", self.hosts[host].netns, check=False)
        return [int(p) for p in out.split()]

    def kill_all(self, host: str) -> None:
        """SIGKILL every process in the host's namespace."""
        for pid in self.pids(host):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    def partition(self, host: str) -> None:
        """Cut the host off: its link goes down, nothing reaches it or leaves it."""
        with self._lock:
            self.partitioned.add(host)
        _ip("link", "set", self.hosts[host].veth, "down")

    def heal(self, host: str) -> None:
        with self._lock:
            self.partitioned.discard(host)
        _ip("link", "set", self.hosts[host].veth, "up")

    def impair(self, host: str, delay_ms: float = 0.0, loss_pct: float = 0.0) -> None:
        """``delay_ms`` added each way (``tc netem`` on both ends of the host's link) and
        ``loss_pct`` of packets dropped each way (iptables' ``statistic`` match inside the
        host's namespace, which works on kernels without netem too)."""
        h = self.hosts[host]
        if delay_ms:
            if not netem_available():
                raise NetnsError(
                    "network delay needs the kernel's netem qdisc (CONFIG_NET_SCH_NETEM), "
                    f"which this kernel ({os.uname().release}) does not have"
                )
            netem = ["netem", "delay", f"{delay_ms:g}ms"]
            _run(["tc", "qdisc", "replace", "dev", h.veth, "root", *netem])
            _run(["ip", "netns", "exec", h.netns, "tc", "qdisc", "replace", "dev", "eth0",
                  "root", *netem])  # fmt: skip
        if loss_pct:
            drop = ["-m", "statistic", "--mode", "random", "--probability", f"{loss_pct / 100:g}"]
            for chain in ("INPUT", "OUTPUT"):
                _run(["ip", "netns", "exec", h.netns, "iptables", "-A", chain, *drop, "-j", "DROP"])

    def clear(self, host: str) -> None:
        h = self.hosts[host]
        _run(["tc", "qdisc", "del", "dev", h.veth, "root"], check=False)
        _run(["ip", "netns", "exec", h.netns, "tc", "qdisc", "del", "dev", "eth0", "root"],
             check=False)  # fmt: skip
        for chain in ("INPUT", "OUTPUT"):
            _run(["ip", "netns", "exec", h.netns, "iptables", "-F", chain], check=False)

    def down(self) -> None:
        """Kill everything inside, delete the namespaces (their veths go with them) and the
        bridge. Safe to call twice."""
        for h in self.hosts.values():
            with contextlib.suppress(Exception):
                self.kill_all(h.name)
            _ip("netns", "del", h.netns, check=False)
            _ip("link", "del", h.veth, check=False)
        _ip("link", "del", self.bridge, check=False)
        if self._etc is not None:
            shutil.rmtree(self._etc, ignore_errors=True)
            self._etc = None
        self._up = False

    def __enter__(self) -> TestNetwork:
        return self.up()

    def __exit__(self, *exc: object) -> None:
        self.down()


class NetnsLauncher(LocalLauncher):
    """Each host's agent inside its namespace, named as ``hostnames`` says (:data:`HOSTNAMES`).
    ``kill`` is out-of-band (every process of the namespace, and its link goes down until the
    host is started again), except while the host is partitioned: then it is unreachable, like
    a real host behind a cut link, and only the agent's own fencing stops its workers."""

    def __init__(
        self, net: TestNetwork, hostnames: Literal["loopback", "address"] = "loopback"
    ) -> None:
        super().__init__()
        if hostnames not in HOSTNAMES:
            raise ValueError(f"hostnames={hostnames!r}: expected one of {', '.join(HOSTNAMES)}")
        self.net = net
        self.hostnames = hostnames

    def command(self, name: str) -> list[str]:
        h = self.net.hosts[name]
        agent = [sys.executable, "-m", "runtime.agent"]
        if self.hostnames == "address":
            script = 'hostname "$1" && shift && exec "$@"'
            return ["ip", "netns", "exec", h.netns, "unshare", "--uts", "sh", "-c", script, "sh",
                    h.address, *agent]  # fmt: skip
        # unshare's mount namespace is private (no propagation): the bind mount is the agent's
        # and its children's only, and goes when the last of them exits.
        script = 'mount --bind "$1" /etc/hosts && hostname "$2" && shift 2 && exec "$@"'
        return ["ip", "netns", "exec", h.netns, "unshare", "--uts", "--mount", "sh", "-c", script,
                "sh", self.net.hosts_file, NODE_HOSTNAME, *agent]  # fmt: skip

    def start(self, name: str, boot: Mapping[str, Any]) -> None:
        if name not in self.net.partitioned:
            _ip("link", "set", self.net.hosts[name].veth, "up")
        super().start(name, boot)

    def kill(self, name: str) -> bool:
        if name in self.net.partitioned:
            return False
        self.net.kill_all(name)
        _ip("link", "set", self.net.hosts[name].veth, "down", check=False)
        return True
