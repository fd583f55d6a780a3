"""Stragglers: a replica group persistently slower than the others to reach the cross-group
collective. Pure: fed the commit records' ``compute_s`` (a rank's own forward/backward time in
the step, without any wait for other groups: ``harness.rank.trainer``), it returns events; the
controller side that journals and acts on them is ``harness.job.silent``.

The estimate (``recovery.stragglers``, ``harness.config.StragglerConfig``):

* a group's time for a step is the slowest of its ranks (the group reaches the collective when
  its last rank does);
* its estimate is the lower quartile over its last ``window`` committed steps, so a group is
  flagged only when more than three quarters of a window is slow. A straggler (a throttled
  device, a slow link, a ``slow_rank`` fault) is slow at every step; a process that another
  process's load deschedules now and then is slow at some, which moves its median (measured:
  3.2x on a 2-core machine shared with test suites, no fault) but not its lower quartile (1.6x);
* it is compared with the median of the other groups' estimates (each with a full window): the
  whole machine slowing down moves every group alike and flags nobody;
* flagged when ``ratio > factor``; back in bounds (``cleared``) once ``ratio < factor *
  hysteresis``; in between nothing changes, so a group near the threshold does not flap.

A new incarnation of a group (a restart: a process not seen before) starts an empty window: its
first steps (allocations, a heal) say nothing about its speed, and its predecessor's slowness is
not held against it. With ``eject``, a flagged group's current processes are condemned at once:
the records they send until they are killed are ignored.
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True, kw_only=True)
class StragglerEvent:
    replica: int
    action: Literal["flagged", "cleared"]
    step: int
    ratio: float
    group_s: float  # the group's estimate: lower quartile of its window's step times
    others_s: float  # the median of the other groups' estimates


class StragglerDetector:
    def __init__(
        self, *, factor: float, window: int, hysteresis: float, eject: bool = False
    ) -> None:
        self.factor = factor
        self.eject = eject
        self._condemned: set[str] = set()
        self.window = window
        self.hysteresis = hysteresis
        self._times: dict[int, deque[float]] = {}
        self._pending: dict[int, tuple[int, float]] = {}  # replica -> (step, slowest rank so far)
        self._procs: dict[tuple[int, int], str] = {}
        self.flagged: set[int] = set()

    def estimate(self, replica: int) -> float | None:
        times = self._times.get(replica)
        if times is None or len(times) < self.window:
            return None
        return statistics.quantiles(times, n=4, method="inclusive")[0]  # the lower quartile

    def forget(self, replica: int) -> None:
        """Start ``replica`` over (it was ejected, or restarted)."""
        self._times.pop(replica, None)
        self._pending.pop(replica, None)
        self.flagged.discard(replica)

    def on_commit(
        self, *, replica: int, rank: int, step: int, compute_s: float, proc: str | None = None
    ) -> list[StragglerEvent]:
        if proc is not None:
            if proc in self._condemned:
                return []
            known = self._procs.get((replica, rank))
            self._procs[(replica, rank)] = proc
            if known is not None and known != proc:
                self.forget(replica)  # a new incarnation
        pending = self._pending.get(replica)
        if pending is not None and pending[0] == step:
            self._pending[replica] = (step, max(pending[1], compute_s))
            return []
        self._pending[replica] = (step, compute_s)
        if pending is None:
            return []
        times = self._times.setdefault(replica, deque(maxlen=self.window))
        times.append(pending[1])  # the previous step is complete: every rank reported it
        return self._judge(replica, step)

    def _judge(self, replica: int, step: int) -> list[StragglerEvent]:
        mine = self.estimate(replica)
        others = [e for r in self._times if r != replica and (e := self.estimate(r)) is not None]
        if mine is None or not others:
            return []
        ref = statistics.median(others)
        if ref <= 0:
            return []
        ratio = mine / ref
        event = None
        if replica not in self.flagged and ratio > self.factor:
            self.flagged.add(replica)
            event = "flagged"
        elif replica in self.flagged and ratio < self.factor * self.hysteresis:
            self.flagged.discard(replica)
            event = "cleared"
        if event is None:
            return []
        if event == "flagged" and self.eject:
            self._condemned.update(p for (r, _), p in self._procs.items() if r == replica)
            self.forget(replica)
        return [
            StragglerEvent(
                replica=replica,
                action=event,  # type: ignore[arg-type]
                step=step,
                ratio=round(ratio, 3),
                group_s=round(mine, 5),
                others_s=round(ref, 5),
            )
        ]
