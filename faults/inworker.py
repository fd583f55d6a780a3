"""Functions that run *inside* a worker process (via ``FaultContext.run_in_worker``).

They run on a thread that is not the training thread. A fault passes the function itself
(``ctx.run_in_worker(target, inworker.segfault)``); only its name (``runtime.actor.wire_name``,
``"faults.inworker:segfault"``) travels over the channel, and the worker imports it. A user's
program with ``program.hooks`` runs copies of these keyed by those names
(``harness/rank/program_hooks/sitecustomize.py``; a test keeps the keys and the names equal).

The trainer is found through ``runtime.actor.current_actors()``; :data:`actors_provider` is the
one seam where a test worker without the runtime installs its own lookup.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import threading
import time
from collections.abc import Callable
from typing import Any


def _runtime_actors() -> dict[str, object]:
    from runtime.actor import current_actors  # the worker side of the runtime

    return current_actors()


#: Returns the actors hosted by this worker process (name -> actor).
actors_provider: Callable[[], dict[str, object]] = _runtime_actors


def _trainer(method: str) -> Any:
    """The first actor of this worker that has ``method``; raises if there is none, so a fault
    aimed at a worker without a trainer is reported rather than silently skipped."""
    actors = actors_provider()
    for actor in actors.values():
        if callable(getattr(actor, method, None)):
            return actor
    raise RuntimeError(f"no actor in this worker has {method}(); actors: {sorted(actors)}")


def segfault() -> None:
    """Read address 0 through ctypes: a real SIGSEGV raised by the CPU in this process, exactly
    what a crashing C extension produces (not a signal sent from outside). Never returns."""
    ctypes.string_at(0)


def hold_gil(seconds: float = 3600.0, after_s: float = 0.2) -> None:
    """Start a daemon thread that, after ``after_s`` (so the caller can return and acknowledge),
    takes the GIL and keeps it for ``seconds`` inside a C call: libc ``sleep`` through
    ``ctypes.PyDLL``, which, unlike ``ctypes.CDLL``, does not release the GIL around the call.
    Every other Python thread, heartbeat included, stops; the process stays alive."""
    libc = ctypes.PyDLL(ctypes.util.find_library("c") or None)
    libc.sleep.argtypes = [ctypes.c_uint]
    whole = max(1, int(seconds))

    def hold() -> None:
        time.sleep(after_s)  # releases the GIL: lets the caller finish first
        libc.sleep(whole)

    threading.Thread(target=hold, name="ftharness-gil-deadlock", daemon=True).start()


def abort_collectives() -> None:
    """Abort the trainer's communicator (the torchft process group) mid-step: the process lives,
    its current collective fails."""
    _trainer("abort_collectives").abort_collectives()


def set_serve_delay(seconds: float) -> None:
    """Make the trainer sleep ``seconds`` before it serves each heal, as a heal source behind a
    slow link would (0 restores it). The built-in trainer's only: a program has no hook for it."""
    _trainer("set_serve_delay").set_serve_delay(float(seconds))


def set_checkpoint_delay(seconds: float) -> None:
    """Make each checkpoint the trainer writes wait ``seconds`` before it is in place, as on a
    slow disk (0 restores it). The built-in trainer's only."""
    _trainer("set_checkpoint_delay").set_checkpoint_delay(float(seconds))


def set_step_delay(seconds: float) -> None:
    """Make the trainer sleep ``seconds`` inside each step (0 restores normal speed)."""
    _trainer("set_step_delay").set_step_delay(float(seconds))


def between_steps(fn: Callable[..., Any]) -> None:
    """Run ``fn(tensors, step, emit)`` once on the trainer's training thread, between two steps
    (never inside an optimizer step): ``tensors`` names its state (``model.*`` weights,
    ``optim.*`` optimizer state), ``emit(event, fields)`` journals from the worker."""
    _trainer("between_steps").between_steps(fn)
