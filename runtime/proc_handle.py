"""A supervised worker process as the controller knows it, and the calls waiting on it."""

from __future__ import annotations

import concurrent.futures as cf
import itertools
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from runtime import channel
from runtime.failure import Failure
from runtime.mesh import ProcRef
from runtime.plane import Owner
from runtime.states import ProcState

if TYPE_CHECKING:
    from runtime.host_handle import HostAgentHandle


class ProcFailedError(RuntimeError):
    """A call could not complete because its process failed (the failure is attached)."""

    def __init__(self, message: str, failure: Failure | None = None) -> None:
        super().__init__(message)
        self.failure = failure


class HostLostError(ProcFailedError):
    """The same, because the host the process runs on (or was to run on) was lost: its agent
    is gone. The host's failure, not the process's own: a crash-loop rule counts none of these
    (``harness.job.trainer_deaths``)."""


@dataclass(eq=False)  # identity: a record is one process, whatever its fields say
class ProcRecord:
    ref: ProcRef
    host: HostAgentHandle
    state: ProcState = ProcState.SPAWNING
    pid: int | None = None
    conn: channel.Connection | None = None
    ready: cf.Future = field(default_factory=cf.Future)
    owner: Owner | None = None
    pending: set[int] = field(default_factory=set)  # ids of calls awaiting its reply
    spare: bool = False  # an idle warm spare, not yet adopted by any mesh
    last_error: tuple[str, str, str] | None = None  # the last error reply: a crash's cause
    program: bool = False  # a program of the user's own (runtime.program_proc), not a worker
    finished: cf.Future = field(default_factory=cf.Future)  # a program's clean exit (code 0)
    # A process a takeover controller inherited (runtime.takeover): its failures wait for an
    # owner (Controller.adopt); and the calls of the previous controller it has not answered
    # yet, call id -> (actor, method), as it said when it re-dialled.
    inherited: bool = False
    open_calls: dict[int, tuple[str, str]] = field(default_factory=dict)


class CallTable:
    """Futures of calls in flight, by call id and by process; thread-safe. Every future ends:
    with its reply, or with the process's failure, or with the job's."""

    def __init__(self, first: int = 1) -> None:
        self._lock = threading.Lock()
        self.first = first  # ids below it are a previous controller's (a takeover's epoch)
        self._ids = itertools.count(first)
        self._calls: dict[int, cf.Future] = {}
        # A previous controller's calls whose result came before anyone claimed it (claim)
        self._early: dict[int, cf.Future] = {}

    def open(self, rec: ProcRecord) -> tuple[int, cf.Future]:
        fut: cf.Future = cf.Future()
        with self._lock:
            call_id = next(self._ids)
            self._calls[call_id] = fut
            rec.pending.add(call_id)
        return call_id, fut

    def pop(self, rec: ProcRecord, call_id: int) -> cf.Future | None:
        with self._lock:
            rec.pending.discard(call_id)
            return self._calls.pop(call_id, None)

    def pop_or_keep(self, rec: ProcRecord, call_id: int) -> cf.Future | None:
        """The future a result for ``call_id`` completes: a call of ours, or one of a previous
        controller (below ``first``) that :meth:`claim` gets later, once; None for neither."""
        with self._lock:
            rec.pending.discard(call_id)
            fut = self._calls.pop(call_id, None)
            if fut is None and call_id < self.first:
                fut = self._early.setdefault(call_id, cf.Future())
            return fut

    def claim(self, rec: ProcRecord, call_id: int) -> cf.Future:
        """The future of call ``call_id`` a previous controller made to ``rec``: done at once
        if its result came already, else when it comes (or when ``rec`` fails)."""
        with self._lock:
            early = self._early.pop(call_id, None)
            if early is not None:
                return early
            fut = self._calls.setdefault(call_id, cf.Future())
            rec.pending.add(call_id)
            return fut

    def fail_for(self, rec: ProcRecord, exc: BaseException) -> None:
        """Fail every call waiting on ``rec``."""
        with self._lock:
            ids, rec.pending = rec.pending, set()
            futs = [self._calls.pop(i) for i in ids if i in self._calls]
        _fail(futs, exc)

    def fail_all(self, exc: BaseException) -> None:
        with self._lock:
            futs, self._calls = list(self._calls.values()), {}
        _fail(futs, exc)


def _fail(futs: list[Any], exc: BaseException) -> None:
    for f in futs:
        if not f.done():
            f.set_exception(exc)
