"""A hand-written fake of the controller (``runtime.controller.Controller``) for testing the
job-level protocol (``harness.job.protocol.Job``) without processes.

It keeps what the real one keeps about processes (a record per rank: host, coordinates, owner,
its ``train`` call) and does what the real one does with a failure: the failure listeners run at
once on the reporting thread, then the owning supervisor decides on a supervision thread of its
own. The supervisors are the real ``runtime.supervisor.Supervisor``. Nothing is spawned: a
"process" is a record, an actor call is a future the test completes, and :meth:`kill` plays a
worker's death as its host agent would report it.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import itertools
import queue
import secrets
import threading
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from runtime.actor import wire_name
from runtime.failure import Cause, Failure
from runtime.journal import FAILURE, Journal
from runtime.launchers import Launcher
from runtime.mesh import ProcMesh, ProcRef
from runtime.messages import CallEndpoint, SpawnActor
from runtime.plane import Owner
from runtime.spec import ControllerSpec, SupervisorSpec
from runtime.supervisor import Supervisor


@dataclass
class FakeHost:
    name: str
    lost: bool = False
    spares: int = 0

    def keep_spares(self, n: int, log_dir: str | None = None) -> None:
        self.spares = n


@dataclass
class FakeProc:
    proc_id: str
    host: str
    coords: dict[str, int]
    owner: Owner | None
    cold: bool
    pid: int | None = None
    stopped: bool = False
    actors: dict[str, tuple[type, tuple[Any, ...]]] = field(default_factory=dict)
    calls: dict[str, cf.Future] = field(default_factory=dict)


class FakeController:
    """The job's control plane, faked (module doc). Same constructor as the real one."""

    def __init__(
        self, spec: ControllerSpec, *, journal: Journal, launcher: Launcher | None = None
    ) -> None:
        self.spec = spec
        self.journal = journal
        self.secret = secrets.token_bytes(32)
        self.epoch = 1  # a fresh start's (no takeover)
        self.address = ("127.0.0.1", 0)
        self.hosts: dict[str, FakeHost] = {}
        self.procs: dict[str, FakeProc] = {}
        self.stores: list[tuple[str, int]] = []  # (host, replica) of every store served
        self.quorum_upstream = ""
        self.worker_calls: list[tuple[str, str, tuple[Any, ...]]] = []
        self.fatal: Failure | None = None
        self.fatal_event = threading.Event()
        self.closed = False
        self._listeners: list[Callable[[Failure], None]] = []
        self._owner = threading.local()
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self._queue: queue.Queue[tuple[Failure, Owner | None] | None] = queue.Queue()
        threading.Thread(target=self._supervise, daemon=True, name="fake-supervision").start()

    # -- hosts ----------------------------------------------------------------------------------
    def spawn_host(self, name: str) -> FakeHost:
        host = self.hosts[name] = FakeHost(name)
        return host

    def wait_for_hosts(self, names: list[str], timeout_s: float) -> list[FakeHost]:
        return [self.spawn_host(n) for n in names]

    def lose_host(self, name: str) -> None:
        """The host's agent is gone: every process on it fails with ``lost_host``."""
        self.hosts[name].lost = True
        for proc in [p for p in self.procs.values() if p.host == name and not p.stopped]:
            self.kill(proc.proc_id, cause=Cause.LOST_HOST)

    def set_quorum_upstream(self, address: str) -> None:
        """Where every host's quorum relay forwards (the fake ranks dial no relay)."""
        self.quorum_upstream = address

    def serve_store(self, host: FakeHost, replica: int) -> str:
        """A group's store on ``host`` (no server: the fake ranks never dial it)."""
        assert not host.lost, f"a store on lost host {host.name}"
        self.stores.append((host.name, replica))
        return f"127.0.0.1:{20000 + len(self.stores)}"

    # -- processes ------------------------------------------------------------------------------
    @contextlib.contextmanager
    def owning(self, owner: Owner) -> Iterator[None]:
        prev = getattr(self._owner, "value", None)
        self._owner.value = owner
        try:
            yield
        finally:
            self._owner.value = prev

    def spawn_many(
        self,
        requests: list[tuple[FakeHost, Mapping[str, int], Mapping[str, int]]],
        *,
        log_dir: str | None = None,
        cold: bool = False,
    ) -> list[ProcMesh]:
        meshes = []
        for host, dims, fixed in requests:
            assert not host.lost, f"placed on lost host {host.name}"
            items = {}
            for point in itertools.product(*(range(n) for n in dims.values())):
                coords = {**fixed, **dict(zip(dims, point, strict=True))}
                proc_id = f"{host.name}/p{next(self._ids)}"
                with self._lock:
                    self.procs[proc_id] = FakeProc(
                        proc_id, host.name, coords, getattr(self._owner, "value", None), cold
                    )
                items[point] = ProcRef(proc_id, host.name, coords)
            meshes.append(ProcMesh(self, dict(dims), items))  # type: ignore[arg-type]
        return meshes

    def request(self, proc_id: str, kind: type, **fields: Any) -> cf.Future:
        proc = self.procs[proc_id]
        future: cf.Future = cf.Future()
        if kind is SpawnActor:
            proc.actors[fields["name"]] = (fields["cls"], tuple(fields["args"]))
            future.set_result(None)
        elif kind is CallEndpoint:
            proc.calls[fields["method"]] = future  # the test decides how the call ends
        else:
            future.set_result(None)
        return future

    def run_in_worker(self, proc_id: str, func: Any, *args: Any) -> cf.Future:
        name = func if isinstance(func, str) else wire_name(func)
        self.worker_calls.append((proc_id, name, args))
        done: cf.Future = cf.Future()
        done.set_result(None)
        return done

    def stop_procs(self, proc_ids: list[str], grace_s: float | None = None) -> None:
        for proc_id in proc_ids:
            self.stop_proc(proc_id, grace_s)

    def stop_proc(self, proc_id: str, grace_s: float | None = None) -> None:
        proc = self.procs[proc_id]
        proc.stopped = True
        for call in proc.calls.values():
            if not call.done():
                call.set_exception(RuntimeError(f"{proc_id} stopped"))

    def live(self, replica: int) -> list[FakeProc]:
        """The group's processes that are not stopped, oldest first."""
        with self._lock:
            procs = list(self.procs.values())
        return [p for p in procs if p.coords.get("replica") == replica and not p.stopped]

    # -- failures -------------------------------------------------------------------------------
    def add_failure_listener(self, fn: Callable[[Failure], None]) -> None:
        self._listeners.append(fn)

    def kill(self, proc_id: str, cause: Cause = Cause.SIGNAL) -> Failure:
        """The process died, as its agent reports it: listeners now, its supervisor next."""
        proc = self.procs[proc_id]
        proc.stopped = True
        failure = Failure(
            cause=cause,
            detail=f"{proc_id} died ({cause.value})",
            proc=proc_id,
            host=proc.host,
            coords=dict(proc.coords),
            signal="SIGKILL" if cause is Cause.SIGNAL else None,
        )
        self.emit(FAILURE, **failure.journal_fields())
        for fn in list(self._listeners):
            fn(failure)
        for call in proc.calls.values():
            if not call.done():
                call.set_exception(RuntimeError(f"{proc_id} died"))
        self._queue.put((failure, proc.owner))
        return failure

    def report_hung(self, proc_id: str, silent_s: float, t_last: float, detail: str) -> None:
        """As the real one: a failure (missed heartbeat) and the process is killed."""
        if not self.procs[proc_id].stopped:
            self.kill(proc_id, cause=Cause.MISSED_HEARTBEAT)

    def deliver(self, failure: Failure, owner: Owner | None) -> None:
        self._queue.put((failure, owner))

    def _supervise(self) -> None:
        while (item := self._queue.get()) is not None:
            failure, owner = item
            if owner is not None:
                owner.supervisor.handle_failure(failure, owner.child, owner.generation)
            elif self.fatal is None:
                self.fatal = failure
                self.fatal_event.set()

    def supervisor(self, name: str, spec: SupervisorSpec | None = None, **kw: Any) -> Supervisor:
        return Supervisor(self, name, spec or SupervisorSpec(), None, **kw)  # type: ignore[arg-type]

    def emit(self, event: str, **fields: Any) -> None:
        self.journal.emit(event, **fields)

    def shutdown(self, grace_s: float = 2.0) -> None:
        self.closed = True
        self.stop_procs([p.proc_id for p in self.procs.values() if not p.stopped])
        self._queue.put(None)
