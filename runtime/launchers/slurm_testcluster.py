"""The nodes of the SLURM test cluster (``bin/test-cluster``): network namespaces on this machine,
and the node failure the ``node_failure`` fault and the tests cause there."""

from __future__ import annotations

import contextlib
import os

from runtime.launchers.slurm import SlurmError, _run, node_address


def node_namespace(node: str) -> str:
    """The network namespace that holds ``node``'s address (nodes of ``bin/test-cluster``).
    SlurmError when the node is not a namespace on this machine (a real node: a node failure
    is then the operator's power switch, not ours)."""
    addr = node_address(node)
    for line in _run(["ip", "netns", "list"]).splitlines():
        ns = line.split()[0] if line.strip() else ""
        if ns and f" {addr}/" in _run(["ip", "-n", ns, "-4", "-o", "addr", "show"]):
            return ns
    raise SlurmError(
        f"node {node} ({addr}) is not a network namespace on this machine: node_failure acts on "
        "the nodes of bin/test-cluster only"
    )


def fail_node(node: str) -> list[int]:
    """Kill ``node``'s slurmd and every process of the node (everything in its namespace), as
    a power failure would; SLURM marks it DOWN after ``SlurmdTimeout``. Returns the pids."""
    import signal

    ns = node_namespace(node)
    killed: list[int] = []
    # A power failure stops everything at once. Killed one by one, the node's processes would
    # see each other die and act on it: a controller whose keeper died first stops the run
    # cleanly, and its srun clients pass SIGTERM on to the steps on other nodes (seen: the
    # agent of another node killed). So every process is stopped (SIGSTOP) first, listed until
    # no new one appears (a fork between two listings), and only then killed.
    stopped: set[int] = set()
    for _ in range(50):
        pids = [int(p) for p in _run(["ip", "netns", "pids", ns]).split()]
        fresh = [p for p in pids if p not in stopped]
        if not fresh:
            break
        for pid in fresh:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGSTOP)
            stopped.add(pid)
    # ... then killed, listing and killing until nothing is left (a process forked between
    # listing and killing would otherwise hold the node's sockets open).
    for _ in range(50):
        pids = [int(p) for p in _run(["ip", "netns", "pids", ns]).split()]
        if not pids:
            break
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        killed += pids
    return killed
