"""The run journal: one JSON object per line, the single source every report is computed from.

Contract (read by dashboards/, experiments/report and the tests):

* Every record has ``t`` (wall-clock seconds, ``time.time()`` of the process that observed the
  event), ``event`` (one of the names below), ``job`` (the job name) and, where known, ``policy``
  (``"in_place"`` or ``"full_restart"``), ``replica``, ``rank``, ``host`` and ``step``.
* Records are appended and flushed one at a time, so a crash loses at most the line being written;
  readers skip a torn last line.
* Times from different processes on one host share a clock. Across hosts they are only as good as
  the hosts' clock sync: nothing here corrects for skew.

Event names and their extra fields:

========================  =====================================================================
``job.start``             ``config`` (dict), ``replicas``, ``ranks``
``job.end``               ``status`` (``"ok"`` | ``"failed"``), ``reason``, ``steps``
``job.restart``           ``reason``: the whole job restarted (full_restart policy); steps
                          committed after it may redo step numbers committed before it
``proc.start``            ``replica``, ``rank``, ``host``, ``pid``, ``spare`` (bool: an idle warm
                          spare started (coordinate ``idle``), or one adopted by a mesh (with
                          that mesh's coordinates))
``failure``               ``cause``, ``detail``, ``exit_code``, ``signal``, ``traceback``,
                          ``coords`` (dict), ``replica``, ``rank``, ``host``, ``pid``
``supervisor``            ``supervisor``, ``decision`` (restart_one|restart_all|escalate|absorb),
                          ``reason``
``step.commit``           ``replica``, ``rank``, ``step``, ``loss``, ``checksum`` (hex str of
                          params + optimizer state), ``step_time_s``, ``samples`` (sequences in
                          the step), ``tokens``, ``participants`` (replica groups in the quorum),
                          ``data_pos``
``step.abort``            ``replica``, ``rank``, ``step``, ``reason`` (should_commit said no)
``fault.inject``          ``fault_id``, ``kind``, ``target`` (dict: replica/rank/host), ``seed``,
                          logged *before* the fault fires
``fault.heal``            ``fault_id``, ``kind``
``recovery.phase``        ``recovery_id``, ``fault_id`` (or null), ``replica``, ``phase`` (one of
                          ``PHASES``), ``cause``
``checkpoint.save``       ``step``, ``path``, ``seconds``
``checkpoint.load``       ``step``, ``path``
========================  =====================================================================
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

JOB_START = "job.start"
JOB_END = "job.end"
JOB_RESTART = "job.restart"
PROC_START = "proc.start"
FAILURE = "failure"
SUPERVISOR = "supervisor"
STEP_COMMIT = "step.commit"
STEP_ABORT = "step.abort"
FAULT_INJECT = "fault.inject"
FAULT_HEAL = "fault.heal"
RECOVERY_PHASE = "recovery.phase"
CHECKPOINT_SAVE = "checkpoint.save"
CHECKPOINT_LOAD = "checkpoint.load"

#: Recovery phases in the order they happen for one recovery.
PHASES = ("detected", "survivors_resumed", "replacement_started", "healed", "participating")

Record = dict[str, Any]
Sink = Callable[[Record], None]


class Journal:
    """Append-only JSONL writer, safe to call from several threads.

    ``sinks`` get every record after it is written (telemetry exporters, progress displays);
    a sink that raises is dropped from the list rather than breaking the run.
    """

    def __init__(self, path: str | os.PathLike[str] | None, *, job: str, **stamp: Any) -> None:
        self.path = Path(path) if path is not None else None
        self.job = job
        self.stamp = dict(stamp)
        self._lock = threading.Lock()
        self._sinks: list[Sink] = []
        self._file = None
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 - held open

    def add_sink(self, sink: Sink) -> None:
        with self._lock:
            self._sinks.append(sink)

    def emit(self, event: str, *, t: float | None = None, **fields: Any) -> Record:
        record: Record = {"t": time.time() if t is None else t, "event": event, "job": self.job}
        record.update(self.stamp)
        record.update(fields)
        with self._lock:
            if self._file is not None:
                self._file.write(json.dumps(record, default=str) + "\n")
                self._file.flush()
            sinks = list(self._sinks)
        for sink in sinks:
            try:
                sink(record)
            except Exception:  # a broken exporter must not stop training
                with self._lock:
                    if sink in self._sinks:
                        self._sinks.remove(sink)
        return record

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None


def read_journal(path: str | os.PathLike[str]) -> list[Record]:
    """All records of a journal file (or of every ``*.jsonl`` in a directory), in time order.

    A torn last line (the writer crashed mid-write) is skipped.
    """
    p = Path(path)
    files = sorted(p.glob("**/*.jsonl")) if p.is_dir() else [p]
    records: list[Record] = []
    for f in files:
        records.extend(_read_lines(f))
    records.sort(key=lambda r: r.get("t", 0.0))
    return records


def _read_lines(path: Path) -> Iterator[Record]:
    with open(path, encoding="utf-8") as fh:
        for line in fh:
            line = line.strip()
            if not line:
                continue
            try:
                yield json.loads(line)
            except json.JSONDecodeError:
                continue
