"""The connectivity preflight, the controller's side: one round over every live host agent.

:func:`run_matrix` has every agent listen (``runtime.preflight``), hands each one every other
agent's (address, port) and the controller's services, collects the reports and closes the
listeners, in three messages per agent and about one probe timeout in all: the probes run in
parallel on every agent at once. The answer is one :class:`Cell` per (prober, target) pair, plus
a cell for an agent that could not listen at its own advertised address or did not answer.
Judging the matrix (stop the job or not, what to say) is the caller's (``harness.job.preflight``).

A round of one host (``subject``: an agent that joined later, a lost host's new agent or a
replacement node) has every host listen as well, but only ``subject`` probes every other host and
the services, and every other host probes only ``subject``: the paths to and from it, not the
matrix of the hosts already checked.

:class:`PreflightBoard` is where the controller's agent threads put the agents' answers
(``Controller.on_agent_message``); only the round in progress is kept, so rounds run one at a
time (:attr:`PreflightBoard.round`: a second one waits for the first; an agent holds one round's
listener and probes at a time too).
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from runtime import channel
from runtime.host_handle import HostAgentHandle
from runtime.messages import (
    PreflightClose,
    PreflightListen,
    PreflightListening,
    PreflightProbe,
    PreflightReply,
    PreflightReport,
    PreflightTarget,
)
from runtime.preflight import Outcome, place_identity

#: How long an agent may take to answer a command, besides the probes' own timeout: the agent's
#: loop turns every few milliseconds, but a loaded machine (torch imports in every core) is slow.
ANSWER_SLACK_S = 3.0


@dataclass(frozen=True)
class Cell:
    """One path of the matrix: ``src`` (a host) reaching ``dst`` (a host or a controller service)
    at ``address``:``port``; ``outcome`` a :class:`runtime.preflight.Outcome` value."""

    src: str
    dst: str
    address: str
    port: int
    outcome: str
    detail: str
    seconds: float

    @property
    def ok(self) -> bool:
        return self.outcome == Outcome.OK.value


class PreflightBoard:
    """The agents' preflight answers for the round in progress (thread-safe)."""

    def __init__(self) -> None:
        self.round = threading.Lock()  # held by the round in progress (rounds run one at a time)
        self._cond = threading.Condition()
        self._nonce = b""
        self._replies: dict[tuple[type, str], PreflightReply] = {}

    def begin(self, nonce: bytes) -> None:
        with self._cond:
            self._nonce, self._replies = nonce, {}

    def end(self) -> None:
        with self._cond:
            self._nonce, self._replies = b"", {}

    def deliver(self, host: str, msg: PreflightReply) -> None:
        """An agent's answer (on its serving thread); one of another round is dropped. Keyed by
        the connection's host, not what the message says."""
        with self._cond:
            if self._nonce and msg.nonce == self._nonce:
                self._replies[(type(msg), host)] = msg
                self._cond.notify_all()

    def collect(self, kind: type, hosts: Sequence[str], deadline: float) -> dict[str, Any]:
        """``kind`` answers from ``hosts``, waiting until all are in or ``time.monotonic()``
        passes ``deadline``: host -> answer, for those that answered."""
        with self._cond:
            while True:
                got = {h: self._replies[(kind, h)] for h in hosts if (kind, h) in self._replies}
                left = deadline - time.monotonic()
                if len(got) == len(hosts) or left <= 0:
                    return got
                self._cond.wait(left)


def _send(h: HostAgentHandle, msg: Any) -> bool:
    if h.conn is None or h.lost:
        return False
    try:
        h.conn.send(msg)
    except channel.ChannelError:
        return False
    return True


def run_matrix(
    board: PreflightBoard,
    hosts: Sequence[HostAgentHandle],
    services: Sequence[tuple[str, str, int]],
    timeout_s: float,
    *,
    subject: str | None = None,
) -> list[Cell]:
    """One preflight round: every host in ``hosts`` probes every other one and every service
    (name, address, port) of the controller, each probe within ``timeout_s``; with ``subject``
    (one of ``hosts``), only the paths from and to it (module doc). Returns within about
    ``timeout_s`` + 2 x :data:`ANSWER_SLACK_S` of its start, whatever the agents do (after a
    round already in progress, which it waits for)."""
    with board.round:
        return _round(board, hosts, services, timeout_s, subject)


def _round(
    board: PreflightBoard,
    hosts: Sequence[HostAgentHandle],
    services: Sequence[tuple[str, str, int]],
    timeout_s: float,
    subject: str | None,
) -> list[Cell]:
    nonce = os.urandom(16)
    names = [h.name for h in hosts]

    def probes(src: str, targets: list[PreflightTarget]) -> tuple[PreflightTarget, ...]:
        if subject is None or src == subject:  # the whole matrix, or the joining host's
            return tuple(t for t in targets if t.name != src)
        return tuple(t for t in targets if t.name == subject)  # the others: only to it

    board.begin(nonce)
    try:
        window = timeout_s + 3 * ANSWER_SLACK_S  # the listeners' backstop if we never close them
        sent = [h for h in hosts if _send(h, PreflightListen(nonce, timeout_s, window))]
        listening: dict[str, PreflightListening] = board.collect(
            PreflightListening, [h.name for h in sent], time.monotonic() + ANSWER_SLACK_S
        )
        here = place_identity()
        targets = [
            PreflightTarget(h.name, h.address, lst.port, lst.place, True, lst.bound)
            for h in hosts
            if (lst := listening.get(h.name)) is not None and lst.port
        ] + [PreflightTarget(name, addr, port, here, False) for name, addr, port in services]
        probing = [
            h
            for h in hosts
            if h.name in listening
            and _send(h, PreflightProbe(nonce, probes(h.name, targets), timeout_s))
        ]
        reports: dict[str, PreflightReport] = board.collect(
            PreflightReport,
            [h.name for h in probing],
            time.monotonic() + timeout_s + ANSWER_SLACK_S,
        )
    finally:
        for h in hosts:
            with contextlib.suppress(Exception):
                _send(h, PreflightClose(nonce))
        board.end()
    return _cells(names, {h.name: h.address for h in hosts}, listening, reports)


def _cells(
    names: list[str],
    addresses: dict[str, str],
    listening: dict[str, PreflightListening],
    reports: dict[str, PreflightReport],
) -> list[Cell]:
    cells: list[Cell] = []
    for src in names:
        lst = listening.get(src)
        if lst is None or src not in reports:
            step = "its listener" if lst is None else "its probes"
            cells.append(
                Cell(src, "*", addresses[src], 0, Outcome.NO_ANSWER.value,
                     f"the agent did not report on {step} in time", 0.0)
            )  # fmt: skip
        if lst is not None and not lst.port:
            cells.append(
                Cell(src, src, addresses[src], 0, Outcome.NOT_LISTENING.value, lst.error, 0.0)
            )
        for r in reports[src].results if src in reports else ():
            cells.append(Cell(src, r.target, r.address, r.port, r.outcome, r.detail, r.seconds))
    return cells
