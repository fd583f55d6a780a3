"""What a program's quorum requests say about its progress, and its log's tail: the pure part of
``harness.job.program.groups`` (kept apart so that module stays the supervision's I/O)."""

from __future__ import annotations

import os
import statistics
from collections import deque
from collections.abc import Sequence
from pathlib import Path

#: Lines of a failed rank's log shown on the console.
TAIL_LINES = 20


def read_tail(path: str | Path, lines: int = TAIL_LINES) -> list[str]:
    """The last ``lines`` lines of a log (empty if it does not exist)."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 64 * 1024))
            text = f.read().decode("utf-8", "replace")
    except OSError:
        return []
    return list(deque(text.splitlines(), maxlen=lines))


# -- progress, from the quorum requests (pure) ------------------------------------------------


def step_events(last_step: int | None, step: int) -> list[str]:
    """What a group's quorum request at ``step`` says, given its previous one at ``last_step``
    (None: its first since it started): ``"healed"`` and/or ``"commit"``, ``"abort"``, or
    nothing (the first request only sets where the group starts)."""
    if last_step is None or step < last_step:
        return []
    if step == last_step:
        return ["abort"]  # asked again without committing: the step did not commit
    return ["healed", "commit"] if step > last_step + 1 else ["commit"]


def hung_for(
    *,
    now: float,
    started: float,
    last: float | None,
    waiting: int,
    start_s: float,
    progress_s: float,
) -> float | None:
    """How long a group has been silent past its limit (None: alive). A group with a request in
    flight waits on the quorum service, not on itself."""
    if waiting > 0:
        return None
    silent = now - (last if last is not None else started)
    limit = progress_s if last is not None else start_s
    return silent if silent > limit else None


def hung_detail(replica: int, silent: float, asked: bool, sync_every: int) -> str:
    """The failure detail of a group judged hung (``asked``: it made a quorum request before)."""
    what = "since its last quorum request" if asked else "since it started"
    detail = (
        f"replica group {replica} made no quorum request for {silent:.1f} s {what} "
        "(hung or stopped; program.progress_timeout_s / start_timeout_s)"
    )
    if not asked:
        return detail + (
            "; it never asked for one: a torchft program's Manager reads the quorum service's "
            "address from TORCHFT_LIGHTHOUSE"
        )
    if sync_every > 1:
        detail += (
            f"; it asks once per program.sync_every = {sync_every} inner steps: "
            "progress_timeout_s must cover that many steps and a sync"
        )
    return detail


# -- a survivor that never asks again after another group's death (pure) -------------------------

#: Gaps between a group's requests needed before it is held to ``program.survivor_grace_s`` (a
#: group that just started, or healed, has no pace yet: only the progress timeout applies to it).
SURVIVOR_PACE_GAPS = 3


def survivor_grace(gaps: Sequence[float], floor_s: float) -> float | None:
    """How long a survivor with these recent gaps between its quorum requests may stay silent
    after another group's death: ``floor_s`` (``program.survivor_grace_s``), or three of its
    gaps if longer (None: its pace is not known yet, or the rule is off)."""
    if len(gaps) < SURVIVOR_PACE_GAPS or floor_s <= 0:
        return None
    return max(floor_s, 3 * statistics.median(gaps))


def blocked_survivor(
    *,
    replica: int,
    survived: tuple[int, float] | None,
    last_step: int | None,
    gaps: Sequence[float],
    last: float | None,
    waiting: int,
    now: float,
    steps: int,
    sync_every: int,
    floor_s: float,
) -> tuple[float, str] | None:
    """(how long it has been silent, the failure detail) if group ``replica`` survived another
    group's death (``survived``: the dead replica, its monotonic time) and has asked for no
    quorum since, nor been answered (``last``), for longer than :func:`survivor_grace`; else
    None (why such a survivor is blocked: ``program.survivor_grace_s``). Not a group with a
    request in flight (it waits on the quorum service, not on a collective), nor one whose pace
    is unknown, nor one near the job's last step (``steps``, inner; it may finish and exit
    without asking again: a margin of one request)."""
    if survived is None or last_step is None or waiting > 0:
        return None
    if (last_step + 3) * sync_every > steps:
        return None  # its last two requests: the last commit is followed by none
    grace = survivor_grace(gaps, floor_s)
    if grace is None:
        return None
    dead, died = survived
    silent = now - max(died, last if last is not None else died)
    if silent <= grace:
        return None
    return silent, silent_survivor_detail(replica, dead, silent, grace)


def silent_survivor_detail(replica: int, dead: int, silent: float, grace: float) -> str:
    """The failure detail of a survivor that asked for no quorum after ``dead`` died."""
    return (
        f"replica group {replica} asked for no quorum for {silent:.1f} s after replica group "
        f"{dead} died (a survivor asks within {grace:.1f} s): one of its ranks is blocked in a "
        "collective with the dead group where nothing from outside reaches it (gloo lost the "
        "error of a send under way: runtime.sockets); restarting it instead of waiting out its "
        "process-group timeout"
    )


# -- semi-synchronous programs (``program.sync_every``; pure) -----------------------------------


def ended_early(last_step: int | None, steps: int, sync_every: int) -> str | None:
    """Why a group whose ranks all exited with code 0 stopped short of the job's last step, or
    None. ``last_step``: its last quorum request's Manager step (it then committed one more, and
    asked no more); ``steps``: the job's, in inner steps. A program whose Manager step counts
    syncs of more inner steps than ``sync_every`` says also shows up here: the message names the
    ``sync_every`` that would make the job's steps match, when one does."""
    syncs = 0 if last_step is None else last_step + 1  # committed syncs when it exited
    if syncs * sync_every >= steps:
        return None
    if last_step is None:
        return (
            "exited with code 0 without ever asking for a quorum (not a torchft program, or its "
            "Manager never started a quorum)"
        )
    why = (
        f"exited with code 0 after {syncs} quorum steps (= inner step {syncs * sync_every} with "
        f"program.sync_every = {sync_every}), before the job's last step {steps}"
    )
    if steps % syncs == 0 and steps // syncs != sync_every:
        why += (
            f"; if it syncs every {steps // syncs} inner steps (torchft's LocalSGD/DiLoCo "
            f"sync_every), set program.sync_every = {steps // syncs}"
        )
    return why


def past_last_step(step: int, steps: int, sync_every: int) -> str:
    """What a group asking for a quorum at Manager step ``step`` past the job's last step is
    told (the caller checked ``step * sync_every > steps``)."""
    if sync_every == 1:
        return f"asked for step {step}, past the job's last step {steps}"
    return (
        f"asked for quorum step {step} (= inner step {step * sync_every} with program.sync_every "
        f"= {sync_every}), past the job's last step {steps}; if it syncs less often than every "
        f"{sync_every} inner steps, lower program.sync_every"
    )


def gap_warning(gap_s: float, progress_s: float, sync_every: int) -> str | None:
    """A warning when a group's quorum requests came ``gap_s`` apart, more than half of
    ``program.progress_timeout_s`` (a longer gap would be taken for a hang), else None."""
    if gap_s <= progress_s / 2:
        return None
    per = f"once per {sync_every} inner steps (program.sync_every)" if sync_every > 1 else "a step"
    return (
        f"asked for quorums {gap_s:.1f} s apart ({per}): program.progress_timeout_s = "
        f"{progress_s} leaves less than twice that; a longer gap is taken for a hang"
    )
