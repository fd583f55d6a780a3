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

import importlib
import inspect
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


def wire_name(fn: Callable[..., Any]) -> str:
    """The name a worker finds ``fn`` by: ``"module:qualname"`` (``"faults.inworker:segfault"``).

    The controller ships this name, not the code, and the worker imports the module and follows
    the qualname (:func:`resolve`), so callers pass the function itself and a reader can find
    them. Contract: ``resolve(wire_name(fn)) is fn`` in this process; ``fn`` must therefore be a
    module-level function (or a static/class attribute reached by a dotted qualname, or a
    builtin such as ``os.getpid``). Refused with ``TypeError``: a string (pass the function, not
    its name), a bound method (its instance does not travel), or something that is not a
    function. Refused with ``ValueError``: a lambda, a function nested in another (a decorator's
    wrapper among them), one defined in ``__main__`` (a worker's ``__main__`` is another
    program), or one its name does not lead back to (rebound, or claiming another's name). Not
    guaranteed: that the worker's interpreter can import the module (its ``sys.path`` is the
    job's), or that the arguments pickle.
    """
    if isinstance(fn, str):
        raise TypeError(f"wire_name({fn!r}): pass the function itself, not its name")
    if inspect.ismethod(fn):
        raise TypeError(
            f"wire_name({fn!r}): a bound method cannot run in a worker (its instance does not "
            "travel); pass a module-level function"
        )
    module = getattr(fn, "__module__", None)
    qualname = getattr(fn, "__qualname__", None)
    if not callable(fn) or not isinstance(module, str) or not isinstance(qualname, str):
        raise TypeError(
            f"wire_name({fn!r}): not a function with a module and a qualified name; pass a "
            "module-level function"
        )
    if "<lambda>" in qualname:
        raise ValueError(f"wire_name: a lambda in {module} has no name a worker can import")
    if "<locals>" in qualname:
        raise ValueError(
            f"wire_name: {module}:{qualname} is nested in a function; a worker can import only "
            "module-level functions"
        )
    if module == "__main__":
        raise ValueError(
            f"wire_name: __main__:{qualname} is defined in the main script; a worker's __main__ "
            "is another program: move it into an importable module"
        )
    name = f"{module}:{qualname}"
    try:
        found = resolve(name)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"wire_name: {name} does not lead back to {fn!r}: {exc}") from exc
    if found is not fn:
        raise ValueError(
            f"wire_name: {name} names {found!r}, not {fn!r} (rebound, or wrapped without "
            "functools.wraps)"
        )
    return name


def resolve(name: str) -> Any:
    """The object a wire name (``"module:qualname"``, see :func:`wire_name`) names: imports the
    module, follows the dotted qualname. Raises ``ImportError`` or ``AttributeError``; a name
    without ``:`` is a ``ValueError``."""
    module, sep, qualname = name.partition(":")
    if not sep or not module or not qualname:
        raise ValueError(f"{name!r} is not a wire name (module:qualname)")
    obj: Any = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


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
