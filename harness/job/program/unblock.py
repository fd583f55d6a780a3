"""Telling the other hosts that a program's replica group died, so that their agents unblock
its survivors there (``runtime.sockets`` has the mechanism and why it is needed).

The agent of the dead group's host acts on its own the moment it reaps the rank (or is told to
stop it), before the controller hears of it. A survivor on another host is unblocked by its own
agent when this module's failure listener sends it ``UnblockPeers``: once per incarnation of a
group (a group of several ranks fails several times: only the first is its death; a later
message could reach a communicator the survivors rebuilt meanwhile).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from typing import Any

from runtime.failure import Failure
from runtime.messages import UnblockPeers


class RemoteUnblock:
    """A controller failure listener (``Controller.add_failure_listener``). ``incarnation``:
    (replica, proc id) -> the incarnation of the program group that proc belongs to, or None
    (not a current program rank)."""

    def __init__(self, controller: Any, incarnation: Callable[[int, str], int | None]) -> None:
        self._controller = controller
        self._incarnation = incarnation
        self._done: set[tuple[int, int]] = set()
        self._lock = threading.Lock()

    def __call__(self, failure: Failure) -> None:
        replica = (failure.coords or {}).get("replica")
        if replica is None or failure.proc is None:
            return
        inc = self._incarnation(replica, failure.proc)
        with self._lock:
            if inc is None or (replica, inc) in self._done:
                return
            self._done.add((replica, inc))
        for host in list(self._controller.hosts.values()):
            if host.name == failure.host or host.lost or host.conn is None:
                continue  # its own host's agent did it already
            with contextlib.suppress(Exception):  # a lost host: nothing to unblock there
                host.conn.send(UnblockPeers(replica))
