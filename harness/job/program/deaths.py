"""Each death of a program's rank: the tail of its log on the console, and its cause, read from
the log, fed to the crash-loop rule (``harness.job.crash_loop``); the injected faults, read from
the journal, explain theirs. A crash loop ends the job with its diagnosis: on the console, in
``job.end`` and so in the report.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from harness.job.crash_loop import CrashLoop, Death, diagnosis, read_death
from harness.job.program.env import LOG_HEADER, error_file, log_name
from harness.job.program.group import ProgramGroup, ProgramJob
from harness.job.program.progress import TAIL_LINES, ended_early, read_tail
from runtime.failure import Failure
from runtime.journal import FAULT_INJECT, HEALED, Record

#: How much of a rank's log is read for its traceback (the console shows its last TAIL_LINES).
LOG_LINES = 200


class DeathWatch:
    """Listens to the controller's failures and the journal's fault records of one job.
    ``group(replica)``: the group's current incarnation, or None; ``fail(reason)`` ends the job;
    ``say(line)`` tells the user; ``finished()``: a group's training ended (:meth:`after_finish`);
    ``overtaken(replica)`` closes the recovery a finished group's failure opened."""

    def __init__(
        self,
        *,
        cfg: Any,
        logs: Path,
        group: Callable[[int], ProgramGroup | None],
        say: Callable[[str], None],
        fail: Callable[[str], None],
        finished: Callable[[], None] = lambda: None,
        overtaken: Callable[[int], object] = lambda replica: None,
    ) -> None:
        self._loop = CrashLoop.for_job(cfg)
        self._logs = logs
        self._group = group
        self._say = say
        self._fail = fail
        self._every = cfg.program.steps_per_quorum
        self._steps = cfg.steps
        self._finished = finished
        self._overtaken = overtaken
        self._lock = threading.Lock()
        self._seen: set[tuple[int, int]] = set()  # (replica, incarnation): its first death only
        self._healed: dict[int, tuple[int, int]] = {}  # replica -> (incarnation, step) healed

    @classmethod
    def attach(
        cls,
        job: ProgramJob,
        group: Callable[[int], ProgramGroup | None],
        finished: Callable[[], None] = lambda: None,
    ) -> DeathWatch:
        """A watch of ``job``'s deaths and faults (``group``: as for the constructor;
        ``finished()``: a group's training ended, see :meth:`after_finish`)."""
        watch = cls(
            cfg=job.cfg, logs=Path(job.run_dir) / "logs", group=group, say=job.say, fail=job.fail,
            finished=finished, overtaken=job.tracker.overtaken,
        )  # fmt: skip
        job.journal.add_sink(watch.on_record)
        job.controller.add_failure_listener(watch.on_failure)
        return watch

    def after_finish(self, failure: Failure) -> bool:
        """Whether ``failure`` is a rank's of a group that had finished: another of its ranks
        exited with code 0 at the job's last step (torchft's rank 0 shuts its ManagerServer down
        as it exits, which fails a peer's last ``should_commit`` still in flight with a transport
        error). Then the group is done: its training ends, the recovery its failure opened is
        overtaken, and its supervisor restarts nothing (it absorbs the failure)."""
        replica = (failure.coords or {}).get("replica")
        g = self._group(replica) if isinstance(replica, int) else None
        if g is None or failure.proc not in {p.ref.proc_id for p in g.procs}:
            return False
        if not any(p.finished.done() for p in g.procs):
            return False
        if ended_early(g.last_step, self._steps, self._every) is not None:
            return False
        self._say(
            f"replica group {g.replica}: {failure.summary()}, after another of its ranks "
            "finished the job's last step: the group is done"
        )
        self._overtaken(g.replica)
        if not g.training.done():
            g.training.set_result(None)
            self._finished()
        return True

    def on_record(self, r: Record) -> None:
        event = r.get("event")
        if event == HEALED and isinstance(r.get("replica"), int):
            g = self._group(r["replica"])
            if g is not None:  # journalled in inner steps
                with self._lock:
                    self._healed[g.replica] = (g.incarnation, int(r.get("step", 0)))
        if event != FAULT_INJECT:
            return
        with self._lock:
            self._loop.fault_record(r, self._incarnation)

    def _incarnation(self, replica: int) -> int | None:
        g = self._group(replica)
        return g.incarnation if g else None

    def on_failure(self, failure: Failure) -> None:
        coords = failure.coords or {}
        replica, rank = coords.get("replica"), coords.get("rank")
        if not isinstance(replica, int) or not isinstance(rank, int):
            return
        log = self._logs / log_name(replica, rank)
        tail = read_tail(log, LOG_LINES)
        self._say(f"{log.stem}: {failure.summary()}; last lines of {log}:")
        for line in tail[-TAIL_LINES:]:
            self._say(f"{log.stem} | {line}")
        g = self._group(replica)
        if g is None or failure.proc not in {p.ref.proc_id for p in g.procs}:
            return  # an old incarnation's, a spare's
        with self._lock:
            if (replica, g.incarnation) in self._seen:
                return  # the rest of a group one death took down
            self._seen.add((replica, g.incarnation))
        read = read_death(
            _since_header(tail),
            signal=failure.signal,
            exit_code=failure.exit_code,
            error_file=error_file(self._logs, replica, rank),
        )
        if read is None:
            return
        what, kind, frame, lines = read
        death = Death(
            replica, rank, g.incarnation, what, kind, frame, self._where(g), time.time(), lines
        )
        with self._lock:
            loop = self._loop.died(death)
        if loop:
            text = diagnosis(loop)
            for line in text.splitlines():
                self._say(line)
            self._fail(text)

    def _where(self, g: ProgramGroup) -> str:
        if g.last_step is None:
            return "at start (before its first quorum)"
        step = g.last_step * self._every
        with self._lock:
            inc, healed = self._healed.get(g.replica, (-1, 0))
        if inc != g.incarnation:
            return f"at step {step}"
        return f"at step {step}, {step - healed} step(s) after its heal"


def _since_header(lines: list[str]) -> list[str]:
    """``lines`` of a rank's log after its last incarnation's header (all, if none is there)."""
    starts = [i for i, ln in enumerate(lines) if ln.startswith(LOG_HEADER)]
    return lines[starts[-1] + 1 :] if starts else lines
