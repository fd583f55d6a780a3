"""Actors: user classes hosted inside worker processes, called through declared endpoints.

    class Trainer(Actor):
        @endpoint
        def step(self, n: int) -> float: ...

An actor handles one message at a time on its worker's main thread, in arrival order. Only
methods marked ``@endpoint`` can be called remotely. An exception in an endpoint goes back to
the caller as a ``RemoteError`` carrying the remote traceback and the actor's coordinates; the
process keeps serving. An endpoint marked ``@endpoint(supervised=True)`` (a long-running one such
as a training loop, whose caller only waits for it) is different: an exception escaping it also
ends its process, so that the supervisor owning the process gets a failure value (cause
``exception``, with the traceback) and its restart policy decides, as in Erlang or Monarch.
Process death, hangs and lost hosts are not exceptions: they are failures delivered to the
supervisor that owns the process.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar, overload

from runtime.messages import Event

F = TypeVar("F", bound=Callable[..., Any])

_ENDPOINT_ATTR = "__ftharness_endpoint__"
_SUPERVISED = "supervised"


@overload
def endpoint(fn: F, /) -> F: ...


@overload
def endpoint(*, supervised: bool = False) -> Callable[[F], F]: ...


def endpoint(fn: F | None = None, /, *, supervised: bool = False) -> Any:
    """Mark an actor method as callable from the controller (``@endpoint``), or as one whose
    uncaught exception is a failure of its process (``@endpoint(supervised=True)``)."""

    def mark(f: F) -> F:
        setattr(f, _ENDPOINT_ATTR, _SUPERVISED if supervised else True)
        return f

    return mark(fn) if fn is not None else mark


def endpoints_of(cls: type) -> frozenset[str]:
    return frozenset(
        name for name in dir(cls) if getattr(getattr(cls, name, None), _ENDPOINT_ATTR, False)
    )


def is_supervised(cls: type, name: str) -> bool:
    return getattr(getattr(cls, name, None), _ENDPOINT_ATTR, None) == _SUPERVISED


class WorkerContext:
    """What an actor can reach in its process: its coordinates, the controller link, and its
    host's address (where other hosts reach this process's listeners)."""

    def __init__(
        self,
        proc_id: str,
        coords: dict[str, int],
        send: Callable[[Any], None],
        host_address: str = "127.0.0.1",
    ) -> None:
        self.proc_id = proc_id
        self.host_address = host_address
        self.coords = dict(coords)
        self._send = send
        self.actors: dict[str, Actor] = {}
        self.lock = threading.Lock()

    def emit(self, event: str, fields: dict[str, Any]) -> None:
        """Send a journal record, stamped with the time it happened here (``t``): it may reach
        the controller much later (a slow or cut network), and order is by event time."""
        self._send(Event(event, {"t": time.time(), **fields}))


_context: WorkerContext | None = None


def _set_context(ctx: WorkerContext | None) -> None:
    global _context
    _context = ctx


def current_context() -> WorkerContext:
    if _context is None:
        raise RuntimeError("not inside an ftharness worker process")
    return _context


def set_coords(coords: dict[str, int]) -> None:
    """System call: a warm spare adopted by a mesh takes that mesh's coordinates."""
    current_context().coords = dict(coords)


def host_address(default: str = "127.0.0.1") -> str:
    """The address other hosts reach this worker's host at (``default`` outside a worker)."""
    return _context.host_address if _context is not None else default


def current_actors() -> dict[str, Actor]:
    """The actors hosted by this worker process, by name (empty outside a worker)."""
    return dict(_context.actors) if _context is not None else {}


class Actor:
    """Base class of actors. Subclasses declare endpoints with ``@endpoint``."""

    actor_name: str = ""

    @property
    def coords(self) -> dict[str, int]:
        return current_context().coords

    @property
    def proc_id(self) -> str:
        return current_context().proc_id

    def emit(self, event: str, **fields: Any) -> None:
        """Send a journal event to the controller (fire and forget, stamped with coordinates)."""
        merged = {**current_context().coords, **fields}
        current_context().emit(event, merged)


class RemoteError(Exception):
    """An endpoint raised. Carries the remote exception type, traceback and coordinates."""

    def __init__(
        self, exc_type: str, message: str, remote_traceback: str, coords: dict[str, int]
    ) -> None:
        self.exc_type = exc_type
        self.message = message
        self.remote_traceback = remote_traceback
        self.coords = dict(coords)
        where = " ".join(f"{k}={v}" for k, v in coords.items())
        super().__init__(
            f"{exc_type}: {message} (in actor at [{where}])\nRemote traceback:\n{remote_traceback}"
        )

    def __reduce__(self):  # keep the fields across pickling
        return (
            RemoteError,
            (self.exc_type, self.message, self.remote_traceback, self.coords),
        )
