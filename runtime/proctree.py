"""Process-tree plumbing: parent-death signals, subreaping and SIGTERM -> grace -> SIGKILL.

Guarantee kept here together with agent.py and worker.py: no process outlives its supervisor.
Each link of the tree (controller -> agent -> worker) is tied twice: the kernel sends SIGKILL
to the child when its parent dies (``PR_SET_PDEATHSIG``), and the child also exits when its
control connection to the parent closes.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import time

import psutil

PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36

_libc = ctypes.CDLL(None, use_errno=True)


def die_with_parent(expected_parent: int, sig: int = signal.SIGKILL) -> None:
    """Ask the kernel to send ``sig`` when our parent dies; exit now if it already has."""
    if _libc.prctl(PR_SET_PDEATHSIG, sig, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if os.getppid() != expected_parent:  # the parent died before prctl took effect
        os._exit(1)


def become_subreaper() -> None:
    """Orphaned descendants are re-parented to us (not init), so we can reap and kill them."""
    _libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)


def tree(pid: int) -> list[psutil.Process]:
    """``pid`` and all its descendants that exist now (the root first)."""
    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.Error:
        return []


def signal_all(procs: list[psutil.Process], sig: int) -> None:
    for p in procs:
        with contextlib.suppress(psutil.Error):
            p.send_signal(sig)


def terminate_tree(pid: int, grace_s: float) -> None:
    """SIGTERM ``pid`` and its descendants, wait up to ``grace_s``, then SIGKILL what is left.

    Do not use on your own children that another loop reaps (the agent's workers): psutil's
    wait would steal their exit status. The agent uses ``signal_all`` plus a timer instead.
    """
    procs = tree(pid)
    signal_all(procs, signal.SIGTERM)
    _, alive = psutil.wait_procs(procs, timeout=grace_s)
    signal_all(alive, signal.SIGKILL)
    psutil.wait_procs(alive, timeout=5.0)


def reap_within(pid: int, timeout_s: float, poll_s: float = 0.02) -> bool:
    """Reap child ``pid`` if it exits within ``timeout_s`` (polled every ``poll_s``); whether it
    did. A pid that is no child of ours (any more) counts as reaped: a loop of ours that waits
    for any child (a subreaper's) may have reaped it first, and waiting on would wait out
    ``timeout_s`` for nothing."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if os.waitpid(pid, os.WNOHANG)[0] == pid:
                return True
        except ChildProcessError:
            return True
        time.sleep(poll_s)
    return False
