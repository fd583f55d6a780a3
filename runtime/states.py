"""Explicit states of supervised processes and the only legal transitions between them."""

from __future__ import annotations

import enum


class ProcState(enum.StrEnum):
    SPAWNING = "spawning"  # asked of the agent, not yet connected
    RUNNING = "running"  # connected and serving calls
    STOPPING = "stopping"  # a supervisor asked it to stop; its exit is not a failure
    STOPPED = "stopped"  # exited after being asked to
    FAILED = "failed"  # exited or hung on its own; a failure value was delivered
    EXITED = "exited"  # a program of the user's own finished (exit code 0): not a failure


_LEGAL: dict[ProcState, frozenset[ProcState]] = {
    ProcState.SPAWNING: frozenset(
        {ProcState.RUNNING, ProcState.STOPPING, ProcState.FAILED, ProcState.EXITED}
    ),
    ProcState.RUNNING: frozenset({ProcState.STOPPING, ProcState.FAILED, ProcState.EXITED}),
    ProcState.STOPPING: frozenset({ProcState.STOPPED}),
    ProcState.STOPPED: frozenset(),
    ProcState.FAILED: frozenset({ProcState.STOPPING}),  # a hung proc is failed, then killed
    ProcState.EXITED: frozenset(),
}


class IllegalTransition(RuntimeError):
    pass


def check_transition(old: ProcState, new: ProcState) -> bool:
    """True if ``old -> new`` is legal; False if it is a repeat that should be ignored.

    A second report of the same end (e.g. the agent's exit report after the controller already
    saw the connection drop) is not an error: the first one wins.
    """
    if new in _LEGAL[old]:
        return True
    if old in (
        ProcState.FAILED,
        ProcState.STOPPED,
        ProcState.STOPPING,
        ProcState.EXITED,
    ) and new in (
        ProcState.FAILED,
        ProcState.STOPPED,
    ):
        return False
    raise IllegalTransition(f"{old.value} -> {new.value}")
