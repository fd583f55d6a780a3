"""A host agent without a controller: what it keeps, how it finds the next one, what it says.

Opt-in (``runtime.agent.Boot.control_file`` and ``grace_s``, given by a controller constructed
with a control file): when the controller's connection ends, errs, or falls silent for
``controller_silence_s``, the agent does not stop its workers. For ``grace_s`` it

* keeps every worker running, watching their heartbeats and reaping them as before;
* keeps the frames it would have sent (exits, hangs, spawns: :class:`Survival`), in order and
  bounded, with those the dead connection had not sent whole (:class:`FrameQueue`), and drops
  its own heartbeats and preflight answers, which mean nothing to another controller;
* re-reads the run's control file (``runtime.control_file``) every :data:`RETRY_S` and dials
  the address there once it names an epoch above the one it served: a stopped old controller
  (SIGSTOP, a partition) keeps its epoch in the file until a new one replaces it, and is never
  dialled again.

On reconnecting it says who it is with an :class:`~runtime.messages.AgentReport` (its live
workers, the epoch it served, its address), gets the new controller's configuration, sends the
frames it kept, and tells each worker to re-dial too (:func:`tell_workers`, over the worker's
heartbeat socketpair). Past ``grace_s`` with no controller it stops everything and exits, as
its fencing does without survival: a run nobody controls must not hold its machines.

Why a dial blocks the agent's loop (at most :data:`DIAL_TIMEOUT_S`): the agent is one thread on
purpose (it forks), and a controller whose listener accepted us answers in milliseconds; heartbeats
queue in their sockets meanwhile and are read right after.
"""

from __future__ import annotations

import collections
import json
import logging
import os
import socket
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from runtime import channel
from runtime.control_file import ControlFileError, read_control
from runtime.messages import (
    AgentBeat,
    AgentConfig,
    AgentReport,
    HelloAgent,
    PreflightReply,
    ReportedWorker,
)

log = logging.getLogger("ftharness.agent")

#: Seconds between two looks at the control file while orphaned.
RETRY_S = 0.15
#: The longest one dial (connect, handshake, configuration) may block the agent's loop.
DIAL_TIMEOUT_S = 2.0
#: Frames kept while orphaned; past it the oldest are dropped (and counted). An exit or a hang
#: is one small frame: this is hours of a host's failures, far past any grace.
MAX_KEPT = 10_000
#: The first byte of "re-dial" on a worker's heartbeat socketpair (agent -> worker direction).
REDIAL = b"R"


class FrameQueue:
    """Frames for the controller, sealed, each with its message: the bytes go to the kernel as
    the socket takes them, and when the link dies the messages not sent whole are known, to
    be sent again on the next link (sealed anew: a new link has new keys)."""

    def __init__(self) -> None:
        self._frames: collections.deque[tuple[Any, memoryview]] = collections.deque()
        self.bytes = 0

    def __bool__(self) -> bool:
        return bool(self._frames)

    def push(self, msg: Any, frame: bytes) -> None:
        self._frames.append((msg, memoryview(frame)))
        self.bytes += len(frame)

    def send_some(self, sock: socket.socket) -> None:
        """Send until the socket would block; OSError (not BlockingIOError) if the link died."""
        while self._frames:
            msg, data = self._frames[0]
            try:
                n = sock.send(data)
            except BlockingIOError:
                return
            self.bytes -= n
            if n < len(data):
                self._frames[0] = (msg, data[n:])
                return
            self._frames.popleft()

    def take_unsent(self) -> list[Any]:
        """The messages not sent whole, in order; the queue is then empty."""
        msgs = [msg for msg, _ in self._frames]
        self._frames.clear()
        self.bytes = 0
        return msgs


class Survival:
    """The agent's state while it has no controller (see the module docstring)."""

    def __init__(self, control_file: str | os.PathLike[str], grace_s: float) -> None:
        self.control_file = Path(control_file)
        self.grace_s = grace_s
        self.lost_at: float | None = None
        self.kept: collections.deque[Any] = collections.deque()
        self.dropped = 0
        self.next_try = 0.0
        self._said: str | None = None  # the last reason a dial failed (said once per reason)

    @property
    def orphaned(self) -> bool:
        return self.lost_at is not None

    def lose(self, now: float, unsent: Iterable[Any]) -> None:
        """The controller is gone: keep what it did not get, and start the grace period."""
        self.lost_at, self.next_try = now, now
        for msg in unsent:
            self.keep(msg)

    def keep(self, msg: Any) -> None:
        if isinstance(msg, AgentBeat | PreflightReply):
            return  # meaningless to another controller
        self.kept.append(msg)
        if len(self.kept) > MAX_KEPT:
            self.kept.popleft()
            self.dropped += 1

    def expired(self, now: float) -> bool:
        """Past the grace period without a controller (said once, when it is)."""
        if self.lost_at is None or now - self.lost_at <= self.grace_s:
            return False
        log.warning("agent: no controller for %g s (controller_grace_s); stopping", self.grace_s)
        return True

    def due(self, now: float) -> bool:
        if self.lost_at is None or now < self.next_try:
            return False
        self.next_try = now + RETRY_S
        return True

    def dial(
        self, host: str, secret: bytes, served: int, report: AgentReport
    ) -> tuple[channel.Connection, AgentConfig, tuple[str, int]] | None:
        """One try: the controller the control file names, if its epoch is above ``served``,
        dialled, told who we are, and its configuration read; None if there is none yet or it
        did not answer (the next try comes :data:`RETRY_S` later)."""
        try:
            info = read_control(self.control_file)
        except (OSError, ControlFileError) as exc:
            self._say(f"cannot read {self.control_file}: {exc}")
            return None
        if info is None or info.epoch <= served:
            return None
        conn: channel.Connection | None = None
        try:
            conn = channel.connect(info.address, secret, DIAL_TIMEOUT_S)
            conn.send(HelloAgent(host, os.getpid(), report))
            conn.sock.settimeout(DIAL_TIMEOUT_S)
            cfg = conn.recv()
            conn.sock.settimeout(None)
        except (channel.ChannelError, OSError) as exc:
            if conn is not None:
                conn.close()
            self._say(f"epoch {info.epoch} at {info.address[0]}:{info.address[1]}: {exc}")
            return None
        if not isinstance(cfg, AgentConfig) or cfg.epoch <= served:
            why = cfg.reason if isinstance(cfg, channel.Refused) else f"answered {cfg!r:.80}"
            conn.close()
            self._say(f"epoch {info.epoch} at {info.address[0]}:{info.address[1]}: {why}")
            return None
        return conn, cfg, info.address

    def attached(self) -> list[Any]:
        """A controller took us back: the frames kept for it, in order."""
        if self.dropped:
            log.warning("agent: %d frame(s) dropped while no controller served", self.dropped)
        kept = list(self.kept)
        self.kept.clear()
        self.lost_at, self.dropped, self._said = None, 0, None
        return kept

    def _say(self, why: str) -> None:
        if why != self._said:
            log.warning("agent: no controller yet: %s", why)
            self._said = why


def report(workers: Iterable[Any], epoch: int, address: str, highest: int) -> AgentReport:
    """The agent's report of its live ``workers`` (``runtime.agent._Worker``: a program has no
    heartbeat socket; a spare is one whose coordinates are ``idle``)."""
    return AgentReport(
        tuple(
            ReportedWorker(w.proc_id, w.pid, dict(w.coords), "idle" in w.coords, w.hb is None)
            for w in workers
        ),
        epoch,
        address,
        highest,
    )


def proc_number(proc_id: str) -> int:
    """N of a process id ``host/pN`` (-1 for another form): the agent reports the highest it
    was asked to start, so that a new controller numbers past it."""
    number = proc_id.rpartition("/p")[2]
    return int(number) if number.isascii() and number.isdigit() else -1


def tell_workers(socks: Iterable[socket.socket], address: tuple[str, int], epoch: int) -> None:
    """Tell each worker (by its heartbeat socketpair) to drop its controller connection and
    dial the controller of ``epoch`` at ``address``: one line, ``R`` + JSON."""
    line = REDIAL + json.dumps({"host": address[0], "port": address[1], "epoch": epoch}).encode()
    for sock in socks:
        try:
            sock.send(line + b"\n")
        except OSError as exc:  # a worker exiting right now: its exit is reported anyway
            log.info("agent: could not tell a worker to re-dial: %s", exc)


def parse_redial(line: bytes) -> tuple[tuple[str, int], int] | None:
    """(address, epoch) of a re-dial line (see :func:`tell_workers`), or None if malformed."""
    if not line.startswith(REDIAL):
        return None
    try:
        body = json.loads(line[len(REDIAL) :])
        address = (str(body["host"]), int(body["port"]))
        epoch = int(body["epoch"])
    except (ValueError, KeyError, TypeError):
        return None
    return address, epoch
