"""No silent stall: a job whose groups keep aborting steps and commit none ends, with a diagnosis.

A group that cannot rendezvous with its peers (the process group's store advertised at an address
they do not reach, a firewalled port, a dead NIC) does not die: every attempt at a step aborts
(``step.abort``, from the built-in trainer's ``should_commit`` or failed quorum, or from a
program's quorum requests, ``harness.job.program.groups``), nothing restarts, and the job would wait
forever. :class:`StallWatch` reads those records from the journal and:

* keeps the console honest: the progress line shows the aborted steps since the last commit and
  the last error (``harness.job.progress``), once a second even while nothing commits, and a
  warning says so once the stall passes half of ``timeouts.no_progress``;
* ends the job once it has committed no step for ``timeouts.no_progress`` seconds while its
  groups kept aborting: the job fails (``Completion.fail``: rc 1), with a diagnosis naming the
  endpoint most of the errors name (``host:port``, parsed from torch's ``DistNetworkError`` /
  ``DistStoreError`` messages) and the last error, journaled as ``job.stall`` and as the
  ``job.end`` reason.

Why end rather than restart the groups: every abort so far already was a retry with a fresh
communicator, so a restart retries the same path; the ones that a restart does fix (a dead or
hung process) are detected and restarted by supervision long before this fires.

What counts as a stall (pure: :func:`judge`): a *streak* of aborts with no commit between them,
each within ``no_progress / 2`` of the one before (a gap that long is a pause, a restart
waiting for a host, not an abort loop: the streak starts again). The stall is the time since the
streak's first abort, so a slow start-up (agents importing torch) never counts. Not detected
here: a job that hangs without aborting (supervision's heartbeats and a program's
``progress_timeout_s`` are for that).
"""

from __future__ import annotations

import re
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from runtime import netaddr
from runtime.journal import STEP_ABORT, STEP_COMMIT, Journal, Record

#: The journal event of a job ended by this watch: ``seconds`` (of the stall), ``aborts``,
#: ``replicas``, ``endpoint`` (``host:port`` or null), ``error`` (the last one), ``error_type``
#: (its exception type, e.g. ``DistNetworkError``, or null), ``diagnosis``.
JOB_STALL = "job.stall"

_ERROR = re.compile(r"\b(Dist\w*Error|[A-Z]\w*(?:Error|Exception|Timeout)|TimeoutError)\b")
# torch's socket errors name "(host, port)"; others "host:port" or "[v6]:port".
_ENDPOINTS = (
    re.compile(r"\(\s*([\w.\-]+|[0-9a-fA-F:]+),\s*(\d{1,5})\s*\)"),
    re.compile(r"\[([0-9a-fA-F:]+)\]:(\d{1,5})\b"),
    re.compile(r"(?<![\w.:-])((?:\d{1,3}\.){3}\d{1,3}|[A-Za-z][\w\-]*(?:\.[\w\-]+)*):(\d{2,5})\b"),
)


def endpoint(reason: str) -> str | None:
    """The ``host:port`` an error message names (torch's ``(host, port)``, ``host:port`` or
    ``[v6]:port``), None if it names none."""
    for pattern in _ENDPOINTS:
        m = pattern.search(reason)
        if m is not None:
            host, port = m.groups()
            return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    return None


def error_name(reason: str) -> str | None:
    """The exception type an abort's reason names (``DistStoreError``), None if none."""
    m = _ERROR.search(reason)
    return m.group(1) if m else None


def short_error(reason: str, limit: int = 120) -> str:
    """One line of an abort's reason, at most ``limit`` characters, for the console."""
    text = " ".join(reason.replace("\\n", " ").split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def brief(reason: str, limit: int = 100) -> str:
    """An abort's reason for the progress line: its error type and endpoint first (what the
    user needs when the line is cut), then its message."""
    name, ep = error_name(reason), endpoint(reason)
    m = re.fullmatch(r"\s*(?:[\w ]+:\s*)?\w+\(['\"](.*)['\"]\)\s*", reason, re.DOTALL)
    message = m.group(1) if m else reason
    head = " ".join(x for x in (name, ep) if x)
    return short_error(f"{head}: {message}" if head else message, limit)


def is_loopback(host_port: str) -> bool:
    """Whether the host of ``host_port`` is a loopback address or names this machine."""
    host = host_port.rsplit(":", 1)[0].strip("[]")
    return netaddr.is_loopback(host) or host == "localhost" or host.endswith(".localhost")


@dataclass
class Streak:
    """Aborted steps since the last commit (see the module doc); fields are read by the console."""

    first_t: float | None = None  # the streak's first abort (monotonic); None: no streak
    last_t: float = 0.0
    aborts: int = 0
    replicas: set[int] = field(default_factory=set)
    endpoints: Counter[str] = field(default_factory=Counter)
    last_reason: str = ""
    last_where: str = ""

    def add(self, now: float, gap_s: float, reason: str, where: str, replica: int | None) -> None:
        if self.first_t is None or now - self.last_t >= gap_s:  # a pause that long: a new one
            self.first_t, self.aborts, self.replicas, self.endpoints = now, 0, set(), Counter()
        self.last_t = now
        self.aborts += 1
        if replica is not None:
            self.replicas.add(replica)
        ep = endpoint(reason)
        if ep is not None:
            self.endpoints[ep] += 1
        self.last_reason, self.last_where = reason, where


@dataclass(frozen=True)
class Verdict:
    state: str  # "ok" | "warn" (past half the limit) | "stall" (past the limit)
    stalled_s: float


def judge(streak: Streak, now: float, limit_s: float) -> Verdict:
    """Pure: how long the job has aborted without committing, and whether that is a stall."""
    if streak.first_t is None or now - streak.last_t >= limit_s / 2:
        return Verdict("ok", 0.0)
    stalled = now - streak.first_t
    if stalled >= limit_s:
        return Verdict("stall", stalled)
    return Verdict("warn" if stalled >= limit_s / 2 else "ok", stalled)


def diagnosis(streak: Streak, stalled_s: float, limit_s: float) -> str:
    """What the user reads when the job ends: how long, how many aborts, where, what error."""
    groups = ", ".join(str(r) for r in sorted(streak.replicas)) or "?"
    text = (
        f"no step committed for {stalled_s:.0f} s (timeouts.no_progress = {limit_s:g}) while "
        f"replica groups {groups} kept aborting steps: {streak.aborts} aborted"
    )
    if streak.endpoints:
        ep, n = streak.endpoints.most_common(1)[0]
        text += f"; failing endpoint {ep} (named by {n} of them)"
        if is_loopback(ep):
            text += (
                ", a loopback address: with several hosts, one advertised an address (its "
                "hostname?) that resolves to itself, which its peers cannot reach"
            )
        else:
            text += (
                ": the groups cannot reach it (a wrong address advertised, a firewall, a cut link)"
            )
    else:
        text += (
            "; no endpoint named in the errors (a program of the user's own journals no error of "
            "its own: see its logs, logs/replica<r>-rank<k>.log in the run directory)"
        )
    text += f"; last error ({streak.last_where}): {short_error(streak.last_reason, 300)}"
    return text


class StallWatch:
    """The journal sink and the thread that apply :func:`judge` (module doc). ``say`` tells the
    user; ``fail(reason)`` ends the job as failed; ``tick`` runs about once a second while steps
    abort (the progress line)."""

    def __init__(
        self,
        limit_s: float,
        journal: Journal,
        *,
        say: Callable[[str], None],
        fail: Callable[[str], None],
        tick: Callable[[], None] | None = None,
        poll_s: float = 0.25,
    ) -> None:
        self.limit_s = limit_s
        self._journal = journal
        self._say, self._fail, self._tick = say, fail, tick
        self._poll_s = poll_s
        self._lock = threading.Lock()
        self.streak = Streak()
        self._warned_for: float | None = None  # the streak (its first_t) already warned about
        self._stopped = threading.Event()
        self._thread: threading.Thread | None = None
        journal.add_sink(self.on_record)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, daemon=True, name="ftharness-stall")
        self._thread.start()

    def close(self) -> None:
        self._stopped.set()

    def on_record(self, r: Record) -> None:
        event = r.get("event")
        if event == STEP_COMMIT:
            with self._lock:
                self.streak = Streak()
        elif event == STEP_ABORT and r.get("rank", 0) == 0:  # one per group's attempt
            where = f"replica {r.get('replica')}" + (f" on {r['host']}" if r.get("host") else "")
            with self._lock:
                self.streak.add(
                    time.monotonic(),
                    self.limit_s / 2,
                    str(r.get("reason") or "aborted"),
                    where,
                    r.get("replica"),
                )

    def summary(self) -> str | None:
        """``N aborted (last: ERROR)`` for the progress line, None when no step aborted since
        the last commit."""
        with self._lock:
            s = self.streak
            if not s.aborts:
                return None
            return f"{s.aborts} aborted (last: {brief(s.last_reason)})"

    def _run(self) -> None:
        while not self._stopped.wait(self._poll_s):
            now = time.monotonic()
            with self._lock:
                verdict = judge(self.streak, now, self.limit_s)
                streak, first = self.streak, self.streak.first_t
                aborting = self.streak.aborts > 0
            if aborting and self._tick is not None:
                self._tick()
            if verdict.state == "warn" and self._warned_for != first:
                self._warned_for = first
                self._say(
                    f"warning: no step committed for {verdict.stalled_s:.0f} s while groups keep "
                    f"aborting ({self.summary()}); the job ends at {self.limit_s:g} s "
                    "(timeouts.no_progress)"
                )
            elif verdict.state == "stall":
                self._end(streak, verdict.stalled_s)
                return

    def _end(self, streak: Streak, stalled_s: float) -> None:
        text = diagnosis(streak, stalled_s, self.limit_s)
        ep = streak.endpoints.most_common(1)[0][0] if streak.endpoints else None
        self._journal.emit(
            JOB_STALL,
            seconds=round(stalled_s, 3),
            aborts=streak.aborts,
            replicas=sorted(streak.replicas),
            endpoint=ep,
            error=short_error(streak.last_reason, 300),
            error_type=error_name(streak.last_reason),
            diagnosis=text,
        )
        self._say(f"stalled: {text}")
        self._fail(text)
