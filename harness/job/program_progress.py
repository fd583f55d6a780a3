"""What a program's quorum requests say about its progress, and its log's tail: the pure part of
``harness.job.programs`` (kept apart so that module stays the supervision's I/O)."""

from __future__ import annotations

import os
from collections import deque
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
