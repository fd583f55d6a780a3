"""The nodes of the SLURM test cluster (``bin/test-cluster``): network namespaces on this machine,
and the node failure the ``node_failure`` fault and the tests cause there, of another node
(:func:`fail_node`) or of the node the caller runs on (:func:`fail_from_outside`)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from runtime.launchers.slurm import SlurmError, _run, node_address

#: How long a node failed from outside may take before the caller is told it was not.
OUTSIDE_WAIT_S = 10.0
#: The names of the nodes' network namespaces (``bin/test-cluster``'s NS_PREFIX).
NODE_NS_PREFIX = "ftslurm-"
_ROOT = str(Path(__file__).resolve().parents[2])  # the project (for the helper's imports)
#: The killer run outside the node: mounts the cgroup v1 freezer (a node's mount namespace has
#: none: ``ip netns exec`` remounts /sys) and runs :data:`_FAIL_NODE` ($0 -c $1 $2).
_KILLER = (
    "mount -t tmpfs none /sys/fs/cgroup && mkdir -p /sys/fs/cgroup/freezer && "
    "mount -t cgroup -o freezer none /sys/fs/cgroup/freezer || true; "
    'exec "$0" -c "$1" "$2"'
)
_FAIL_NODE = (
    "import sys; from runtime.launchers.slurm_testcluster import fail_node; fail_node(sys.argv[1])"
)


def namespaces() -> list[str]:
    """The network namespaces on this machine (``ip netns list``)."""
    return [line.split()[0] for line in _run(["ip", "netns", "list"]).splitlines() if line.strip()]


def node_namespace(node: str) -> str:
    """The network namespace that holds ``node``'s address (nodes of ``bin/test-cluster``).
    SlurmError when the node is not a namespace on this machine (a real node: a node failure
    is then the operator's power switch, not ours)."""
    addr = node_address(node)
    for ns in namespaces():
        if f" {addr}/" in _run(["ip", "-n", ns, "-4", "-o", "addr", "show"]):
            return ns
    raise SlurmError(
        f"node {node} ({addr}) is not a network namespace on this machine: node_failure acts on "
        "the nodes of bin/test-cluster only"
    )


def fail_node(node: str) -> list[int]:
    """Kill ``node``'s slurmd and every process of the node (everything in its namespace), as
    a power failure would; SLURM marks it DOWN after ``SlurmdTimeout``. Returns the pids.

    A power failure stops everything at once. Killed one by one, the node's processes would see
    each other die and act on it (seen: a controller whose keeper died first stopped the run
    cleanly, and its ``srun`` clients passed SIGTERM on to another node's agent). SIGSTOP first
    is no better: once a stopped group's parent dies, the kernel sends the orphaned group SIGHUP
    and SIGCONT, and ``srun`` then cancels its step. So the processes are frozen (the cgroup v1
    freezer: no signal, nothing runs), killed while frozen, and thawed only to die."""
    ns = node_namespace(node)
    with _frozen(node) as freeze:
        listed: list[int] = []
        for _ in range(50):  # list until no new one appears (a fork between two listings)
            fresh = [p for p in _pids(ns) if p not in listed]
            if not fresh:
                break
            freeze(fresh)
            listed += fresh
        for pid in sorted(listed, reverse=True):  # without a freezer: children first
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    killed = list(listed)
    for _ in range(50):  # anything left (forked as the freezer was set up): killed too
        pids = _pids(ns)
        if not pids:
            break
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        killed += pids
        time.sleep(0.02)
    return killed


def _pids(ns: str) -> list[int]:
    return [int(p) for p in _run(["ip", "netns", "pids", ns]).split()]


@contextlib.contextmanager
def _frozen(node: str) -> Iterator[Callable[[list[int]], None]]:
    """A freezer cgroup for ``node``'s processes: the callable moves pids into it (frozen at
    once); on exit it is thawed (what was killed in it dies now) and removed. Without a cgroup
    v1 freezer, the callable does nothing."""
    root = Path("/sys/fs/cgroup/freezer")
    if not (root / "cgroup.procs").exists():
        yield lambda pids: None
        return
    group = root / f"ftharness-fail-{node}"
    group.mkdir(exist_ok=True)
    (group / "freezer.state").write_text("FROZEN")

    def freeze(pids: list[int]) -> None:
        for pid in pids:
            with contextlib.suppress(OSError):  # gone already
                (group / "cgroup.procs").write_text(str(pid))
        deadline = time.monotonic() + 2.0
        while (group / "freezer.state").read_text().strip() != "FROZEN":
            if time.monotonic() > deadline:
                break
            time.sleep(0.005)

    try:
        yield freeze
    finally:
        (group / "freezer.state").write_text("THAWED")
        deadline = time.monotonic() + 5.0
        while (group / "cgroup.procs").read_text().strip() and time.monotonic() < deadline:
            time.sleep(0.02)
        with contextlib.suppress(OSError):
            group.rmdir()


def fail_from_outside(node: str) -> None:
    """Fail ``node`` when the caller runs on it: by a process outside it (one inside would
    freeze itself with the node: :func:`fail_node` freezes every process of it first), in
    another node's network namespace (it reaches slurmctld, for ``scontrol``; the machine's own
    is out of a node's reach) and a mount namespace of its own (:data:`_KILLER`). The caller is
    frozen and killed with the node well before this returns; it returns only by raising:
    SlurmError where the node is not a test-cluster node, ValueError where there is no other
    node to act from or the killer failed or took more than :data:`OUTSIDE_WAIT_S`."""
    own = node_namespace(node)
    # Another node's, not any namespace: one that something else made (runtime.launchers.netns'
    # hosts, left over by a run that was killed) has no route to slurmctld (seen: the killer's
    # scontrol could not reach it, and the node was never failed).
    others = [ns for ns in namespaces() if ns != own and ns.startswith(NODE_NS_PREFIX)]
    if not others:
        raise ValueError(f"no network namespace but node {node}'s to fail it from")
    argv = [
        "nsenter", f"--net=/run/netns/{others[0]}", "--", "unshare", "--mount", "--",
        "sh", "-c", _KILLER, sys.executable, _FAIL_NODE, node,
    ]  # fmt: skip
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (_ROOT, env.get("PYTHONPATH", "")) if p)
    helper = subprocess.Popen(argv, stdin=subprocess.DEVNULL, start_new_session=True, env=env)
    try:
        code = helper.wait(timeout=OUTSIDE_WAIT_S)
    except subprocess.TimeoutExpired:
        raise ValueError(f"node {node} was not failed within {OUTSIDE_WAIT_S:g} s") from None
    raise ValueError(f"node {node} was not failed: its killer exited with status {code}")
