"""Every message of the control channel, typed, in one place.

Three links carry them (``runtime.channel`` frames each message as one pickle, after the
authenticated handshake):

* controller -> host agent: :class:`HelloController`, :class:`Spawn`, :class:`StopProc`,
  :class:`Shutdown`;
* host agent -> controller: :class:`AgentReady`, :class:`Spawned`, :class:`Exited`,
  :class:`Hung`, :class:`AgentBeat`;
* controller <-> worker: :class:`HelloWorker` (worker -> controller, first frame),
  :class:`SpawnActor`, :class:`CallEndpoint` and :class:`SysCall` (requests, each with a
  ``call_id``), and back :class:`Result` and :class:`Event` (a journal record).

Receivers dispatch with ``match`` on the type; anything else is a malformed message (the receiver
drops that peer, see ``runtime.channel.FrameError``). Messages are frozen dataclasses: adding a
field is adding it here, with its meaning.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# -- controller -> host agent -------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class HelloController:
    """The controller's first frame on an agent connection: the agent answers AgentReady."""


@dataclass(frozen=True, slots=True)
class Spawn:
    """Fork a worker (``cold``: exec a fresh interpreter instead) with these coordinates."""

    proc_id: str
    coords: dict[str, int]
    log_path: str | None
    cold: bool = False


@dataclass(frozen=True, slots=True)
class StopProc:
    """SIGTERM the worker's process tree, SIGKILL after ``grace_s`` (0: at once)."""

    proc_id: str
    grace_s: float


@dataclass(frozen=True, slots=True)
class Shutdown:
    """Stop every worker (with ``grace_s``) and exit."""

    grace_s: float


# -- host agent -> controller -------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class AgentReady:
    host: str
    pid: int


@dataclass(frozen=True, slots=True)
class Spawned:
    proc_id: str
    pid: int


@dataclass(frozen=True, slots=True)
class Exited:
    """The agent reaped the worker; ``status`` is the raw ``waitpid`` status, ``t`` wall time."""

    proc_id: str
    pid: int
    status: int
    t: float


@dataclass(frozen=True, slots=True)
class Hung:
    """The worker sent no heartbeat for ``silent_s``; its last one was at wall time ``t_last``."""

    proc_id: str
    pid: int
    silent_s: float
    t_last: float


@dataclass(frozen=True, slots=True)
class AgentBeat:
    t: float


# -- controller <-> worker ----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class HelloWorker:
    proc_id: str
    pid: int


@dataclass(frozen=True, slots=True)
class SpawnActor:
    """Construct ``cls(*args, **kwargs)`` as actor ``name`` on the worker's main thread."""

    call_id: int
    name: str
    cls: type
    args: tuple[Any, ...]
    kwargs: dict[str, Any]


@dataclass(frozen=True, slots=True)
class CallEndpoint:
    """Call endpoint ``method`` of actor ``actor``, in order, on the worker's main thread."""

    call_id: int
    actor: str
    method: str
    args: tuple[Any, ...]
    kwargs: dict[str, Any]


@dataclass(frozen=True, slots=True)
class SysCall:
    """Run ``"module:function"(*args)`` on a fresh thread of the worker (fault hooks, stop)."""

    call_id: int
    func: str
    args: tuple[Any, ...]


Request = SpawnActor | CallEndpoint | SysCall


@dataclass(frozen=True, slots=True)
class Result:
    """The reply to a request: ``value`` or, if not ``ok``, (exception type, message, traceback)."""

    call_id: int
    ok: bool
    value: Any


@dataclass(frozen=True, slots=True)
class Event:
    """A journal record from an actor (``runtime.journal`` names the events)."""

    event: str
    fields: dict[str, Any]
