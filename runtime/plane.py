"""What meshes and supervisors may ask of the control plane, and nothing more.

``runtime.controller.Controller`` implements :class:`ControlPlane`; meshes (``runtime.mesh``) and
supervisors (``runtime.supervisor``) hold one and never reach into the controller's internals.
Keeping this interface in its own module keeps the imports one-way: controller -> mesh,
supervisor -> plane, with no cycle.
"""

from __future__ import annotations

import concurrent.futures as cf
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Protocol

from runtime.failure import Failure
from runtime.messages import Request
from runtime.spec import ControllerSpec


class FailureHandler(Protocol):
    """A supervisor, as the controller's supervision thread sees it."""

    def handle_failure(self, failure: Failure, child: str, generation: int | None) -> None: ...


@dataclass(frozen=True, eq=False)
class Owner:
    """Who supervises a process: a supervisor's child, in the incarnation (``generation``) it was
    started in. A failure of a process from an older generation is a late report about a child
    that was already restarted, and is ignored."""

    supervisor: FailureHandler
    child: str
    generation: int


class ControlPlane(Protocol):
    spec: ControllerSpec

    def request(self, proc_id: str, kind: type[Request], **fields: Any) -> cf.Future:
        """Send ``kind(call_id=..., **fields)`` to a worker; the future gets its Result."""
        ...

    def owning(self, owner: Owner) -> AbstractContextManager[None]:
        """Processes spawned by this thread inside the block are owned by ``owner``."""
        ...

    def deliver(self, failure: Failure, owner: Owner | None) -> None:
        """Queue ``failure`` for ``owner`` (None: the root) on the supervision thread."""
        ...

    def stop_procs(self, proc_ids: list[str], grace_s: float | None = None) -> None: ...

    def stop_proc(self, proc_id: str, grace_s: float | None = None) -> None: ...

    def emit(self, event: str, **fields: Any) -> None:
        """Write a journal record (if the controller has a journal)."""
        ...
