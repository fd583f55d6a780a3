"""A controller that takes over a run: what it inherits from the one before, and how.

A takeover controller (``Controller(..., control_file=, takeover=True)``) starts no agent. The
agents of the run re-dial it on their own (``runtime.orphan``), each with a report of its live
workers; :meth:`Inheritance.on_report` turns each report into records, one per process, as
running as they are (state RUNNING, the same pid and coordinates, no owner yet). Then each
worker re-dials as its agent tells it (:meth:`Inheritance.on_worker`), with its current
coordinates and the calls of the previous controller it has not answered: the caller finds its
running calls there (``Controller.open_calls``) and gets their results (``open_call``). Nothing is
restarted, and no process or call id of the previous controller is reused: process numbers
continue past the highest an agent ever started, and call ids live in the epoch's own range
(``runtime.proc_handle.CallTable``).

What happens to an inherited process before someone owns it: a failure (an exit the agent kept
while no controller served) is held, not handed to the root, until :meth:`Inheritance.adopt`
gives it an owner; the caller decides then, with the job's knowledge of which group it belongs
to, what the failure means.

What the dead controller never read: the events its workers had handed to the kernel. The new
one starts with the journal's last event of each process (:func:`event_marks`, the
``Controller``'s ``event_marks``) and each worker sends again those past it (``runtime.resend``).
"""

from __future__ import annotations

import concurrent.futures as cf
import os
import threading
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from runtime.control_file import EpochFence, read_control, write_control
from runtime.failure import Failure
from runtime.mesh import ProcRef
from runtime.messages import AgentReport, HelloWorker
from runtime.plane import Owner
from runtime.proc_handle import CallTable, ProcFailedError, ProcRecord
from runtime.resend import EVENT_SEQ
from runtime.states import ProcState

if TYPE_CHECKING:
    from runtime.host_handle import HostAgentHandle


def event_marks(records: Iterable[Mapping[str, Any]]) -> dict[str, int]:
    """Per process (``proc``), the highest worker event number (``eseq``) in the journal's
    ``records``: what a takeover controller's workers need not send again."""
    marks: dict[str, int] = {}
    for r in records:
        seq, proc = r.get(EVENT_SEQ), r.get("proc")
        if isinstance(seq, int) and not isinstance(seq, bool) and isinstance(proc, str):
            marks[proc] = max(marks.get(proc, 0), seq)
    return marks


class Succession:
    """A controller's place in its run's line of controllers: its epoch, the control file it
    announces itself in, and the fence that ends it once a newer one took over. Without a
    control file it is the only controller the run will have: epoch 1, nothing to check."""

    def __init__(
        self,
        control_file: str | os.PathLike[str] | None,
        epoch: int | None,
        takeover: bool,
        grace_s: float,
    ) -> None:
        self.path = Path(control_file) if control_file is not None else None
        self.takeover = takeover
        self.grace_s = grace_s
        self.epoch = _epoch(self.path, epoch, takeover)
        self.fence = EpochFence(self.path, self.epoch) if self.path is not None else None

    def announce(self, address: tuple[str, int]) -> None:
        """Serving: say where, so that agents (ours, or a predecessor's) find us."""
        if self.path is not None:
            write_control(self.path, address, self.epoch)

    def check(self, what: str) -> None:
        """Exit at once (status 75) if a newer controller took this run over: called before
        anything that acts on a host or a process, so that a stopped old controller that
        resumes obeys nothing of its own (``runtime.control_file.EpochFence``)."""
        if self.fence is not None:
            self.fence.exit_if_replaced(what)

    def boot_settings(self) -> dict[str, Any]:
        """What agents get in their boot settings to outlive this controller (none without a
        control file, or with a grace of 0: they die with it, as ever)."""
        if self.path is None or self.grace_s <= 0:
            return {}
        return {"control_file": str(self.path), "grace_s": self.grace_s}


def _epoch(path: Path | None, epoch: int | None, takeover: bool) -> int:
    """The epoch: ``epoch`` if given, else 1, or the control file's + 1 for a takeover.
    ValueError for a takeover without a control file, or an epoch that is not above the file's
    (another controller took the run over already)."""
    if path is None:
        if takeover:
            raise ValueError("a takeover controller needs the run's control file")
        return 1 if epoch is None else epoch
    info = read_control(path)
    current = info.epoch if info is not None else 0
    if epoch is None:
        epoch = current + 1 if takeover else 1
    if epoch < 1 or (takeover and epoch <= current):
        raise ValueError(
            f"controller epoch {epoch} is not above {current}, the epoch {path} names: another "
            "controller took this run over already"
        )
    return epoch


class Inheritance:
    """What a controller inherited from its predecessor: agent reports, processes, calls."""

    def __init__(
        self, procs: dict[str, ProcRecord], lock: threading.RLock, calls: CallTable
    ) -> None:
        self._procs = procs  # the controller's table, under its lock
        self._lock = lock
        self._calls = calls
        self._changed = threading.Condition(lock)
        self.reports: dict[str, AgentReport] = {}  # by host name
        self._held: dict[str, list[tuple[Failure, ProcRecord]]] = {}  # by proc id

    def on_report(self, h: HostAgentHandle, report: AgentReport) -> None:
        """Host ``h``'s agent re-dialled with ``report``: its processes, as they run."""
        with self._changed:
            for w in report.workers:
                if w.proc_id in self._procs:
                    continue  # reported twice (an agent that re-dialled again)
                ref = ProcRef(w.proc_id, h.name, dict(w.coords))
                rec = ProcRecord(ref, h, ProcState.RUNNING, pid=w.pid, spare=w.spare,
                                 program=w.program, inherited=True)  # fmt: skip
                rec.ready.set_result(w.pid)
                self._procs[w.proc_id] = rec
            self.reports[h.name] = report
            self._changed.notify_all()

    def on_worker(self, rec: ProcRecord, hello: HelloWorker) -> None:
        """An inherited worker re-dialled: its coordinates now and its unanswered calls."""
        with self._changed:
            if hello.coords is not None:
                rec.ref = ProcRef(rec.ref.proc_id, rec.ref.host, dict(hello.coords))
                rec.spare = "idle" in hello.coords
            rec.open_calls = {cid: (actor, method) for cid, actor, method in hello.open_calls}
            self._changed.notify_all()
        if rec.spare and rec.state is ProcState.RUNNING:
            # An idle spare again, for the next warm start: this controller's now, as a spare it
            # started would be. Left "inherited", a failure after a group took it would be held
            # for an adoption that never comes, and the group never restarted (seen in a soak).
            with self._changed:
                rec.inherited = False
            rec.host.pool.add_idle(rec)

    def open_calls(self, proc_id: str) -> dict[int, tuple[str, str]]:
        """The calls a previous controller made to ``proc_id`` that it has not answered yet
        (call id -> (actor, method)), as it said when it re-dialled; empty if none."""
        with self._lock:
            rec = self._procs.get(proc_id)
            return dict(rec.open_calls) if rec is not None else {}

    def open_call(self, proc_id: str, call_id: int) -> cf.Future:
        """The future of call ``call_id`` a previous controller made to ``proc_id``: its
        result (kept if it came first), or ProcFailedError if the process fails first."""
        with self._lock:
            rec = self._procs.get(proc_id)
            running = rec is not None and rec.state is ProcState.RUNNING
        if rec is None or not running:
            fut: cf.Future = cf.Future()
            state = rec.state.value if rec is not None else "unknown"
            fut.set_exception(ProcFailedError(f"{proc_id} is not running ({state})"))
            return fut
        return self._calls.claim(rec, call_id)

    def wait_record(self, proc_id: str, timeout_s: float) -> ProcRecord | None:
        """The record of ``proc_id``, waiting for its agent's report (a worker may re-dial a
        moment before the controller has read its agent's report)."""
        deadline = time.monotonic() + timeout_s
        with self._changed:
            while proc_id not in self._procs:
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self._changed.wait(left)
            return self._procs[proc_id]

    def reattach(self, names: Iterable[str], timeout_s: float) -> dict[str, AgentReport]:
        """Wait until the named hosts' agents re-dialled and each of their live workers too,
        for at most ``timeout_s``; the reports of the hosts that did (a host missing from it
        is lost: its agent never came back)."""
        names = list(names)
        deadline = time.monotonic() + timeout_s
        with self._changed:
            while not self._all_back(names):
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._changed.wait(min(left, 0.05))
            return {n: self.reports[n] for n in names if n in self.reports}

    def _all_back(self, names: list[str]) -> bool:
        if any(n not in self.reports for n in names):
            return False
        for n in names:
            for w in self.reports[n].workers:
                rec = self._procs.get(w.proc_id)
                if (
                    rec is not None
                    and not rec.program
                    and rec.state is ProcState.RUNNING
                    and rec.conn is None
                ):
                    return False  # alive, and not re-dialled yet
        return True

    def notify(self) -> None:
        """Something ``reattach`` waits on changed (a worker connected, a process failed)."""
        with self._changed:
            self._changed.notify_all()

    def unclaimed(self) -> list[str]:
        """The inherited processes still running that nobody adopted (idle spares aside: they
        went back to their host's pool)."""
        with self._lock:
            return [
                p
                for p, r in self._procs.items()
                if r.inherited and r.owner is None and not r.spare and r.state is ProcState.RUNNING
            ]

    def hold(self, rec: ProcRecord, failure: Failure) -> bool:
        """Keep ``failure`` until ``rec`` is adopted; False if ``rec`` has an owner already."""
        with self._changed:
            if not rec.inherited:
                return False
            self._held.setdefault(rec.ref.proc_id, []).append((failure, rec))
            self._changed.notify_all()
            return True

    def adopt(
        self, proc_ids: Iterable[str], owner: Owner | None
    ) -> list[tuple[Failure, Owner | None, ProcRecord]]:
        """Give inherited processes their owner; the failures held for them, to deliver."""
        out: list[tuple[Failure, Owner | None, ProcRecord]] = []
        with self._changed:
            for proc_id in proc_ids:
                rec = self._procs.get(proc_id)
                if rec is None:
                    raise KeyError(f"no process {proc_id!r} to adopt")
                rec.owner, rec.inherited = owner, False
                out += [(f, owner, r) for f, r in self._held.pop(proc_id, [])]
        return out
