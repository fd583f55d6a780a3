"""The built-in trainer's failures, read by the crash-loop rule (``harness.job.crash_loop``):
the same classifier a program's deaths go through (``harness.job.program.deaths``).

A failure of the trainer that comes back the same way (a missing or changed corpus file, a bug
at a given step, an out-of-memory on every start) was restarted until the restart intensity
gave up, and the job ended on "restart intensity exceeded", the cause only in a traceback. Each
failure a replica group's supervisor receives is read here first (``TrainerGroups.absorbs``):

* a death of a running rank: its exception and last frame from the failure's traceback (the
  trainer's exception travels up as a value), else its signal or exit code; where: the group's
  last committed step;
* a restart that raised (the new incarnation's trainers could not be built): the remote
  exception inside it, "while starting".

Never counted: a stop from outside (SIGKILL, SIGTERM, SIGINT), a failure with no cause of its
own, a failure the data is to blame for (``BadData``: ``harness.job.poison`` quarantines the
data), a restart that failed because its host was lost (``HostLostError``), and whatever an
injected fault explains (:class:`harness.job.crash_loop.CrashLoop`).
``recovery.deterministic_max`` failures in a row with one signature, each within a minute of
the one before, end the job with the diagnosis: on the console, in ``job.end`` and the report.
A controller that takes a job over (``harness.job.takeover``) takes up the dead one's count from
its journal (:meth:`TrainerDeaths.resume`): a loop under way does not start again from zero.

A loop that is one group's own (``TrainerDeaths._alone``: every death that group's, none while
its trainers were being built, another group committing past it meanwhile) drops only that
group (``TrainerGroups.drop``: fenced, stopped, never restarted; ``group.dropped``) while at
least ``min_replica_size`` groups are left, and the job goes on; else it ends the job too.
"""

from __future__ import annotations

import itertools
import re
import threading
from collections.abc import Callable, Iterable

from harness.config import JobConfig
from harness.job.crash_loop import CrashLoop, Death, diagnosis, read_death
from runtime.failure import Cause, Failure
from runtime.journal import (
    FAILURE_SIGNATURE,
    FAULT_INJECT,
    GROUP_DROPPED,
    STEP_COMMIT,
    Journal,
    Record,
)

#: Exception types that say the data, not the trainer, failed (``harness.rank.data.BadData``).
DATA_FAULTS = ("BadData", "harness.rank.data.BadData")
#: Exception types that say the host, not the trainer, failed (``runtime.proc_handle``): a
#: restart that raised because its host was lost (an allocation cancelled, a node gone) is
#: the host table's to act on (``harness.job.hosts``), not a crash loop.
HOST_FAULTS = ("HostLostError",)

_REPLICA = re.compile(r"/replica(\d+)(/|$)")


class TrainerDeaths:
    """The rule above for one job (``loop``: ``CrashLoop.for_job``). ``incarnation(replica)``:
    the group's current incarnation (None: none yet); ``say(line)`` tells the user;
    ``fail(reason)`` ends the job; ``emit``: the journal's."""

    def __init__(
        self,
        *,
        loop: CrashLoop,
        incarnation: Callable[[int], int | None],
        say: Callable[[str], None],
        fail: Callable[[str], None],
        emit: Callable[..., object] = lambda event, **fields: None,
    ) -> None:
        self._emit = emit  # a journal's emit
        self._loop = loop
        self._incarnation = incarnation
        self._say = say
        self._fail = fail
        self._lock = threading.Lock()
        self._steps: dict[int, int] = {}  # replica -> its last committed step
        self._starts = itertools.count(1)  # a failed start stands for an incarnation of its own
        #: ``drop(replica, why)``: go on without a group whose crash loop is its own; False
        #: where the job cannot (too few groups left): it ends (``TrainerGroups.drop``)
        self.drop: Callable[[int, str], bool] = lambda replica, why: False

    @classmethod
    def attach(
        cls,
        cfg: JobConfig,
        journal: Journal,
        incarnation: Callable[[int], int | None],
        say: Callable[[str], None],
        fail: Callable[[str], None],
    ) -> TrainerDeaths:
        """The rule for job ``cfg``, fed by ``journal`` and journaling into it."""
        loop = CrashLoop.for_job(cfg)
        deaths = cls(loop=loop, incarnation=incarnation, say=say, fail=fail, emit=journal.emit)
        journal.add_sink(deaths.on_record)
        return deaths

    def on_record(self, r: Record) -> None:
        """A journal sink: committed steps (where a death was) and injected faults."""
        event = r.get("event")
        if event == STEP_COMMIT and isinstance(replica := r.get("replica"), int):
            with self._lock:
                self._steps[replica] = max(self._steps.get(replica, 0), int(r.get("step", 0)))
        elif event == FAULT_INJECT and not r.get("recurs"):  # a broken part is no one-off
            with self._lock:
                self._loop.fault_record(r, self._incarnation)

    def resume(self, records: Iterable[Record]) -> None:
        """Take up a dead controller's count from its journal: the groups' last steps, the
        injected faults (each ends a run of repeats) and the deaths it counted, in order;
        nothing is journaled again. A loop it had two deaths into ends the job at the next."""
        for r in records:
            event = r.get("event")
            if event == STEP_COMMIT:
                self.on_record(r)
            elif event == FAULT_INJECT and not r.get("recurs"):
                with self._lock:
                    self._loop.fault(float(r.get("t", 0.0)), None, None)
            elif event == GROUP_DROPPED:  # that loop was acted on: counted afresh after it
                with self._lock:
                    self._loop.reset()
            elif event == FAILURE_SIGNATURE and r.get("counted"):
                death = Death(
                    int(r.get("replica", -1)), int(r.get("rank", 0)), int(r.get("incarnation", -1)),
                    str(r.get("what", "")), str(r.get("kind", "")), str(r.get("frame", "")),
                    str(r.get("where", "")), float(r.get("t", 0.0)),
                )  # fmt: skip
                with self._lock:
                    self._loop.counted(death)

    def seen(self, failure: Failure) -> bool:
        """Count ``failure`` (one a group's supervisor received), journaling what identifies it
        (``failure.signature``: its signature, where, whether it counts and why not); True when
        it completed a crash loop: the job is ending, and the group must not be restarted."""
        death, why = self._death(failure)
        if death is None:
            self._emit(
                FAILURE_SIGNATURE, replica=failure.coords.get("replica"), counted=False, why=why
            )
            return False
        with self._lock:
            explained = self._loop.explained(death)
            loop = self._loop.died(death)
        self._emit(
            FAILURE_SIGNATURE,
            replica=death.replica,
            rank=death.rank,
            incarnation=death.incarnation,
            kind=death.kind,
            frame=death.frame,
            what=death.what[:300],
            where=death.where,
            counted=not explained,
            why="an injected fault explains it" if explained else None,
        )
        if not loop:
            return False
        text = diagnosis(loop, who="the trainer")
        if (alone := self._alone(loop)) is not None:
            first, _, rest = text.partition("\n")
            text = f"{first}\n{alone}" + (f"\n{rest}" if rest else "")
            if self.drop(loop[-1].replica, text):
                with self._lock:
                    self._loop.reset()
                return True  # absorbed: the group is not restarted, and the job goes on
        for line in text.splitlines():
            self._say(line)
        self._fail(text)
        return True

    def _alone(self, loop: list[Death]) -> str | None:
        """What tells a crash loop of one group's own apart from one of every group: each death
        is of that group, none while its trainers were being built, and meanwhile another group
        committed past that group's last step. The code and the data are every group's, so what
        fails in one group only is that group's (its host, its device, its share of the data);
        a bug or a corpus problem fails every group that meets it. None where it is not so."""
        replicas = {d.replica for d in loop}
        if len(replicas) != 1 or any(d.where.startswith("while starting") for d in loop):
            return None
        (replica,) = replicas
        with self._lock:
            mine = self._steps.get(replica, 0)
            past = sorted(r for r, step in self._steps.items() if r != replica and step > mine)
        if replica < 0 or not past:
            return None
        return (
            f"only group {replica} fails: group(s) {', '.join(map(str, past))} committed past its "
            f"step {mine} meanwhile, so the cause is in group {replica} alone (its host, its "
            "device or its share of the data), not in the code or the corpus"
        )

    def _death(self, failure: Failure) -> tuple[Death | None, str | None]:
        """The death ``failure`` is, or None and why it is none."""
        replica = failure.coords.get("replica")
        if replica is None:
            m = _REPLICA.search(failure.child or "")
            replica = int(m.group(1)) if m else -1  # full_restart: every group is one child
        starting = failure.cause is Cause.EXCEPTION and not failure.coords
        read = read_death(
            (failure.traceback or "").splitlines(),
            signal=failure.signal,
            exit_code=None if starting else failure.exit_code,
        )
        if read is None:
            return None, "a stop from outside, or no cause of its own"
        what, kind, frame, lines = read
        name = kind.rsplit(".", 1)[-1]
        if name in DATA_FAULTS:
            return None, "the data is to blame (harness.job.poison)"
        if name in HOST_FAULTS:
            return None, "its host was lost: the host's failure, not the trainer's"
        incarnation: int | None
        if starting:
            incarnation, where = -next(self._starts), "while starting (building its trainers)"
        else:
            incarnation = self._incarnation(replica) if replica >= 0 else None
            with self._lock:
                step = self._steps.get(replica)
            where = "before its first step" if step is None else f"after step {step}"
        rank = failure.coords.get("rank", 0)
        death = Death(
            replica, rank, -1 if incarnation is None else incarnation, what, kind, frame, where,
            failure.t_event, lines,
        )  # fmt: skip
        return death, None
