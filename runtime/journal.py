"""The run journal: one JSON object per line, the single source every report is computed from.

Contract (read by dashboards/, experiments/report and the tests):

* Every record has ``t`` (wall-clock seconds, ``time.time()`` of the process that observed the
  event), ``event`` (one of the names below), ``job`` (the job name) and, where known, ``policy``
  (``"in_place"`` or ``"full_restart"``), ``replica``, ``rank``, ``host`` and ``step``.
* Records are appended and flushed one at a time, so a crash loses at most the line being written;
  readers skip a torn last line.
* Events from a worker carry ``proc`` and ``host``, stamped by the controller, and ``eseq``
  (1, 2, ... per worker process): a controller that takes over has a worker resend the events
  numbered past the highest the journal holds (``runtime.resend``).
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
                          params + optimizer state on sampled steps, every 10th and checkpoint
                          steps; null otherwise), ``step_time_s``, ``compute_s`` (the rank's
                          own forward/backward time, no wait for others), ``samples``
                          (sequences in the step), ``tokens``, ``participants`` (replica
                          groups in the quorum),
                          ``data_pos``, ``data_policy`` (``skip`` | ``replay``), ``seqs`` and
                          ``seq_due`` (sequences trained and due, dashboards.data_coverage),
                          ``quorum`` (whether the step asked for a quorum: every step, or
                          some with a sparse quorum, harness.rank.trainer), ``proc`` (the worker
                          process, stamped by the controller)
``step.abort``            ``replica``, ``rank``, ``step``, ``reason`` (should_commit said no)
``fault.inject``          ``fault_id``, ``kind``, ``target`` (dict: replica/rank/host), ``seed``,
                          logged *before* the fault fires
``fault.heal``            ``fault_id``, ``kind``
``fault.plan``            ``seed``, ``faults`` (the injector's whole plan: ``fault_id``, ``kind``,
                          ``target``, ``at_s``, ``at_step`` each), written as it starts: a
                          controller that takes over resumes it (faults/injector.py)
``recovery.phase``        ``recovery_id``, ``fault_id`` (or null), ``replica``, ``phase`` (one of
                          ``PHASES``, or one of ``ENDINGS``: it ends the recovery, see there),
                          ``cause``
``checkpoint.save``       ``step``, ``path``, ``seconds`` (serialize + write), ``blocked_s`` (the
                          training thread's share); logged once the checkpoint is durable
``checkpoint.load``       ``step``, ``path``
``eval``                  ``replica``, ``rank``, ``step`` (committed steps of the weights
                          evaluated), ``heldout_loss`` (mean over the fixed held-out batches),
                          ``sequences``, ``tokens``, ``seconds`` (harness/rank/token_data.py)
``trainer.healed``        ``replica``, ``rank``, ``data_pos``, ``transport``: torchft loaded a
                          healthy peer's state into this rank mid-run
``trainer.start``         ``replica``, ``rank``, ``seconds`` (the trainer's construction in its
                          process, a fork or a spare: all its parts), ``parts`` (the seconds of
                          each, in order: ``model``, ``layout`` (the group's world, and FSDP2
                          where sharded), ``optimizer`` (and the data stream), ``manager``
                          (torchft's), ``checkpoint`` (a DCP writer), ``resume`` (a checkpoint
                          load; absent when skipped))
``fault.bitflip``         ``replica``, ``rank``, ``step`` (committed steps when it hit),
                          ``tensor``, ``index``, ``bit``, ``before``, ``after``, ``seed``: one
                          bit flipped in this rank's state between steps (faults/bitflip.py)
``silent.divergence``     ``suspects`` (replicas), ``majority``, ``step``, ``cause``
                          (``checksum`` | ``nonfinite``), ``action`` (``heal`` | ``rollback`` |
                          ``observe``), ``latency_steps``, ``latency_s`` (since the bitflip, if
                          one was journaled), ``fault_id`` (its ``fault.inject``, if any),
                          ``rollback_to`` (harness/job/silent.py)
``straggler``             ``replica``, ``action`` (``flagged`` | ``cleared`` | ``ejected``),
                          ``ratio``, ``group_s``, ``others_s``, ``step``
``group.start``           ``replica``, ``incarnation``, ``host``, ``procs`` (proc ids by rank),
                          ``seq`` (1, 2, ... per controller), ``epoch`` (the controller's),
                          ``mac`` (HMAC of those fields with the job secret): a replica group
                          started; what a new controller adopts (harness/job/takeover.py)
``controller.takeover``   ``epoch``, ``pid``, ``hosts`` (agents that re-attached), ``lost``,
                          ``reattach_s``, ``groups``; then one per group: ``replica``,
                          ``adopted`` (bool), ``procs`` or ``reason``
``preflight``             ``status`` (``ok`` | ``failed`` | ``skipped``), ``reason``, ``seconds``
                          (the matrix's wall time), ``hosts``, ``paths``, ``failed`` (paths),
                          ``matrix`` (one dict per path: ``src``, ``dst``, ``address``,
                          ``port``, ``outcome``, ``detail``, ``seconds``), written before any
                          group starts (harness/job/preflight.py); with ``host``: the round of
                          an agent that joined later (that host; ``failed``: it is kept out)
========================  =====================================================================
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import sys
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
CHECKPOINT_START = "checkpoint.start"
CHECKPOINT_SAVE = "checkpoint.save"
CHECKPOINT_LOAD = "checkpoint.load"
EVAL = "eval"
HEAL_START = "trainer.heal_start"
SERVE_START = "trainer.serve_start"
HEALED = "trainer.healed"
TRAINER_START = "trainer.start"
BITFLIP = "fault.bitflip"
SILENT_DIVERGENCE = "silent.divergence"
STRAGGLER = "straggler"
PREFLIGHT = "preflight"
GROUP_START = "group.start"
CONTROLLER_TAKEOVER = "controller.takeover"
FAULT_PLAN = "fault.plan"
DATA_SUSPECT = "data.suspect"  # a pass raised, and these sequences are its cause (a rank)
FAILURE_SIGNATURE = "failure.signature"  # what identifies a group's failure, and if it counts
POISON_DATA = "fault.poison_data"  # where the poison_data fault made the data bad
DATA_QUARANTINE = "data.quarantine"  # two groups failed on a sequence: every group skips it
GROUP_DROPPED = "group.dropped"  # a crash loop of one group's own: the job goes on without it

#: Recovery phases in the order they happen for one recovery.
PHASES = ("detected", "survivors_resumed", "replacement_started", "healed", "participating")
#: The phase that ends a recovery instead of ``participating``: every other group finished the
#: job's last step while this one was still rejoining, so no peer was left to heal it from and
#: the job ended (harness.job.program.groups). Not a failure to recover: there was nothing to
#: rejoin.
OVERTAKEN = "overtaken"
#: The phase that ends the recovery of a group dropped for a crash loop of its own
#: (``group.dropped``, harness.job.groups.TrainerGroups.drop): it is never restarted, and the
#: other groups train on without it.
DROPPED = "dropped"
#: The phases that end a recovery without its group participating again.
ENDINGS = (OVERTAKEN, DROPPED)

Record = dict[str, Any]
Sink = Callable[[Record], None]


class Journal:
    """Append-only JSONL writer, safe to call from several threads.

    ``sinks`` get every record after it is written (telemetry exporters, progress displays);
    a sink that raises is dropped from the list rather than breaking the run.

    ``fence`` (``runtime.control_file.EpochFence``) is asked before every record: once it says
    False, a newer controller has taken the run over, and this process exits at once (status
    75) without writing: a replaced controller that comes back must not append to the journal
    its successor continues.

    Failure contract: :meth:`emit` never raises because the disk did (a full disk, an I/O
    error): the record is lost, the first such error is kept in :attr:`error`, said once on
    stderr, and passed to every :meth:`on_error` listener (the job subscribes and ends with a
    clear message). Later records are still tried (space may come back), and :attr:`lost` counts
    those that did not reach the file. Opening the file can still raise: that happens before
    anything runs.

    Each record is one ``write(2)`` on an ``O_APPEND`` descriptor, so a crash or a short write
    tears at most that line. On open, a torn last line left by an earlier writer is ended with a
    newline (readers skip it), so the first new record starts on a line of its own; a torn line
    of our own is ended the same way before the next record. The file is created ``0600``.
    """

    def __init__(
        self,
        path: str | os.PathLike[str] | None,
        *,
        job: str,
        fence: Callable[[], bool] | None = None,
        **stamp: Any,
    ) -> None:
        self.path = Path(path) if path is not None else None
        self.job = job
        self.fence = fence
        self.stamp = dict(stamp)
        self.error: OSError | None = None
        self.lost = 0
        self._lock = threading.Lock()
        self._sinks: list[Sink] = []
        self._error_listeners: list[Callable[[OSError], None]] = []
        self._fd: int | None = None
        self._torn = False  # the file ends mid-line: end it before the next record
        if self.path is not None:
            # 0700 applies to the last folder only; the run directory above it is made private
            # by whoever creates it (harness.rundir).
            self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
            self._torn = _ends_mid_line(self.path)

    def sync(self) -> None:
        """fsync what was written so far: it survives the loss of this machine (a fault that
        fails the controller's own node makes its record durable first)."""
        with self._lock:
            if self._fd is not None:
                os.fsync(self._fd)

    def add_sink(self, sink: Sink) -> None:
        with self._lock:
            self._sinks.append(sink)

    def on_error(self, listener: Callable[[OSError], None]) -> None:
        """Call ``listener(exc)`` once, from the emitting thread, when a write first fails (at
        once if one already has). A listener that raises is ignored."""
        with self._lock:
            error = self.error
            if error is None:
                self._error_listeners.append(listener)
        if error is not None:
            _call_quietly(listener, error)

    def emit(self, event: str, *, t: float | None = None, **fields: Any) -> Record:
        record: Record = {"t": time.time() if t is None else t, "event": event, "job": self.job}
        record.update(self.stamp)
        record.update(fields)
        first_error: OSError | None = None
        with self._lock:
            if self.fence is not None and not self.fence():
                _fenced_out(self.path, event)
            if self._fd is not None:
                line = (json.dumps(record, default=str) + "\n").encode()
                try:
                    self._write(line)
                except OSError as exc:
                    self.lost += 1
                    if self.error is None:
                        self.error = first_error = exc
            sinks = list(self._sinks)
            listeners = self._error_listeners if first_error is not None else []
            if first_error is not None:
                self._error_listeners = []
        if first_error is not None:
            self._say_error(first_error, event)
            for listener in listeners:
                _call_quietly(listener, first_error)
        for sink in sinks:
            try:
                sink(record)
            except Exception:  # a broken exporter must not stop training
                with self._lock:
                    if sink in self._sinks:
                        self._sinks.remove(sink)
        return record

    def _write(self, line: bytes) -> None:
        """Write one record (under the lock). If only part of it reaches the file (a disk that
        fills mid-write), ``_torn`` is set so the next record first ends the torn line."""
        assert self._fd is not None
        data = memoryview(b"\n" + line if self._torn else line)
        written = 0
        try:
            while written < len(data):
                written += os.write(self._fd, data[written:])  # EINTR is retried by Python
        finally:
            if written:
                self._torn = written < len(data)

    def _say_error(self, exc: OSError, event: str) -> None:
        with contextlib.suppress(OSError, ValueError):  # stderr gone too: the error is kept
            print(
                f"ftharness: journal {self.path}: write failed ({exc}); the {event!r} record and "
                "any later one that fails are lost, so reports from this journal will be "
                "incomplete",
                file=sys.stderr,
                flush=True,
            )

    def close(self) -> None:
        with self._lock:
            if self._fd is not None:
                fd, self._fd = self._fd, None
                try:
                    os.close(fd)
                except OSError as exc:
                    if self.error is None:
                        self.error = exc


def _fenced_out(path: Path | None, event: str) -> None:
    """This process's controller was replaced (a takeover): it must never append to the run's
    journal again, nor do anything else; say so and exit at once, before writing ``event``."""
    with contextlib.suppress(OSError, ValueError):
        print(
            f"ftharness: journal {path}: a newer controller serves this run; this one "
            f"(pid {os.getpid()}) exits without writing {event!r}",
            file=sys.stderr,
            flush=True,
        )
    os._exit(EXIT_FENCED)


#: The exit status of a replaced controller (EX_TEMPFAIL; runtime.control_file.EXIT_SUPERSEDED).
EXIT_FENCED = 75


def _call_quietly(listener: Callable[[OSError], None], exc: OSError) -> None:
    with contextlib.suppress(Exception):  # a broken listener must not break the emitter
        listener(exc)


def _ends_mid_line(path: Path) -> bool:
    """True if ``path`` is non-empty and its last byte is not a newline (a torn record)."""
    try:
        with open(path, "rb") as fh:
            if fh.seek(0, os.SEEK_END) == 0:
                return False
            fh.seek(-1, os.SEEK_END)
            return fh.read(1) != b"\n"
    except OSError:
        return False


def read_journal(
    path: str | os.PathLike[str], *, problems: list[str] | None = None
) -> list[Record]:
    """All records of a journal file (or of every ``*.jsonl`` in a directory), in time order.

    Only records every reader can rely on are returned: JSON objects with a finite number ``t``
    and a string ``event``, whose known fields have the types the writers give them
    (:data:`_FIELDS`, :data:`_REQUIRED`). Anything else (a torn line from a crash mid-write, a
    line that is not an object, a record without ``t``, a ``step.commit`` whose ``step`` is not
    an integer, a line nested too deeply to parse) is skipped; pass ``problems`` to get one line
    per skipped record (``file:line: why``). Never raises for a file's contents, only for a path
    that cannot be read.
    """
    p = Path(path)
    # A directory that happens to be named *.jsonl holds no records of its own.
    files = sorted(f for f in p.glob("**/*.jsonl") if f.is_file()) if p.is_dir() else [p]
    records: list[Record] = []
    for f in files:
        records.extend(_read_lines(f, problems))
    records.sort(key=lambda r: r["t"])
    return records


def _read_lines(path: Path, problems: list[str] | None) -> Iterator[Record]:
    with open(path, "rb") as fh:
        for number, raw in enumerate(fh, 1):
            raw = raw.strip()
            if not raw:
                continue
            why = None
            try:
                record = json.loads(raw)  # bytes: a torn multi-byte character is an error here
            except ValueError:  # JSONDecodeError, UnicodeDecodeError, an int of 4300+ digits
                why = "not valid JSON (a torn write?)"
            except RecursionError:  # a line of [[[[...]]]]: no writer nests records this deep
                why = "nested too deeply to read"
            else:
                why = _problem(record)
            if why is None:
                yield record
            elif problems is not None:
                problems.append(f"{path}:{number}: {why}")


def _problem(record: Any) -> str | None:
    if not isinstance(record, dict):
        return f"not a JSON object: {type(record).__name__}"
    t = record.get("t")
    if isinstance(t, bool) or not isinstance(t, int | float) or not math.isfinite(t):
        return f"no finite time 't' (got {_short(t)})"
    if not isinstance(record.get("event"), str):
        return f"no string 'event' (got {_short(record.get('event'))})"
    for key in _REQUIRED.get(record["event"], ()):
        if record.get(key) is None:
            return f"{record['event']} without {key!r}"
    why = _field_problem(record, "")
    if why is None and record.get("seqs") is not None and record.get("seq_due") is None:
        why = "'seqs' without 'seq_due'"  # data_coverage reads them as a pair
    return why


# -- the fields readers compute with ------------------------------------------------------------
# Readers (dashboards/metrics.py, the report, the HTML dashboard) use these fields as numbers,
# dict keys and sort keys; a record whose field has another type (a hand-edited or corrupt
# journal: no writer produces one) would crash every report, so it is skipped like a torn line.
# None (JSON null) is allowed wherever a field is allowed, as writers write null for "not known".


def _is_int(v: Any) -> bool:
    # 64-bit, as every writer's are: a larger one raises OverflowError where readers call float().
    return isinstance(v, int) and not isinstance(v, bool) and -(2**63) <= v < 2**63


def _is_number(v: Any) -> bool:
    return _is_int(v) or isinstance(v, float)


def _is_ranges(v: Any) -> bool:
    """``seqs``: ``[[first, end), ...]`` ranges of sequence numbers, each at most
    :data:`_MAX_RANGE` long (data_coverage expands them into sets: a range of 10**12 would hang
    the report)."""
    return isinstance(v, list) and all(
        isinstance(r, list)
        and len(r) == 2
        and all(_is_int(x) for x in r)
        and 0 <= r[1] - r[0] <= _MAX_RANGE
        for r in v
    )


#: Sequences one commit record may name: one step of one rank, far above any real batch.
_MAX_RANGE = 1 << 24
_STR = (lambda v: isinstance(v, str), "a string")
_INT = (_is_int, "an integer")
_NUMBER = (_is_number, "a number")
_ID = (lambda v: isinstance(v, str) or _is_int(v), "a string or an integer")
#: field -> (check, what it must be), wherever the field appears (``target`` is checked with the
#: same table). Fields not named here are not checked.
_FIELDS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "job": _STR,
    "policy": _STR,
    "replica": _INT,
    "rank": _INT,
    "host": _ID,  # a host agent's name; a standalone trainer writes 0
    "step": _INT,
    "pid": _INT,
    "fault_id": _ID,
    "recovery_id": _ID,
    "kind": _STR,
    "phase": _STR,
    "cause": _STR,
    "checksum": _ID,
    "loss": _NUMBER,
    "samples": _NUMBER,
    "tokens": _NUMBER,
    "step_time_s": _NUMBER,
    "seq_due": _INT,
    "data_policy": _STR,
    "seqs": (_is_ranges, f"a list of [first, end] integer ranges of <= {_MAX_RANGE}"),
    "participants": (
        lambda v: _is_int(v) or (isinstance(v, list) and all(_is_int(x) for x in v)),
        "an integer or a list of integers",
    ),
    "target": (lambda v: isinstance(v, dict), "a table of replica, rank, host"),
}
#: Fields an event's readers index directly (``r["step"]``): the record is useless without them.
_REQUIRED: dict[str, tuple[str, ...]] = {STEP_COMMIT: ("step",), FAULT_INJECT: ("kind",)}


def _field_problem(record: dict[str, Any], prefix: str) -> str | None:
    for key, (ok, what) in _FIELDS.items():
        value = record.get(key)
        if value is None:
            continue
        if not ok(value):
            return f"'{prefix}{key}' must be {what} (got {_short(value)})"
        if key == "target" and not prefix:  # one level: a target holds no target
            inner = _field_problem(value, "target.")
            if inner is not None:
                return inner
    return None


def _short(value: Any) -> str:
    """A bounded description for a message: repr of a huge or deeply nested value is slow, or
    raises RecursionError."""
    if isinstance(value, list | dict):
        return f"a {type(value).__name__} of {len(value)}"
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."
