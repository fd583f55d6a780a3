"""Supervisors: Erlang/OTP-style restart loops over children that are meshes or supervisors.

    job = controller.supervisor("job", SupervisorSpec(strategy=Strategy.ONE_FOR_ONE))
    group = job.add_supervisor("replica0", SupervisorSpec(strategy=Strategy.ONE_FOR_ALL))
    group.add_child("ranks", start=lambda: host.spawn_procs({"ranks": 2}).spawn(...))

A child's ``start`` callable spawns its processes (and usually its actors) and returns the mesh;
processes spawned inside it are owned by that child. A failure of an owned process reaches the
child's supervisor, on the controller's single supervision thread, in this order:

1. the supervisor's ``on_failure`` handler, if any, may absorb it (return True);
2. otherwise ``policy.decide`` picks restart-one, restart-all, drop or escalate;
3. escalation stops every child of this supervisor and hands an ESCALATED failure, chaining the
   original, to the parent; unhandled at the root, the controller stops the job.

Decisions are taken on the supervision thread, one failure at a time; a restart (stop, start)
then runs on the supervisor's own restart thread, so one group's slow or delayed restart never
delays another group's. Every restart bumps the child's ``generation``: reports about processes
of an older generation are ignored, and failures that arrive while a restart is in flight are
decided on when it has ended.

Restarting a child supervisor restarts its whole subtree with a fresh restart history.
"""

from __future__ import annotations

import queue
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from runtime.failure import Cause, Failure
from runtime.journal import SUPERVISOR
from runtime.plane import ControlPlane, Owner
from runtime.policy import Action, Decision, decide
from runtime.spec import Restart, SupervisorSpec

Handler = Callable[[Failure], bool | None]


@dataclass
class _Child:
    name: str
    restart: Restart
    start: Callable[[], Any] | None = None  # mesh children
    sup: Supervisor | None = None  # supervisor children
    instance: Any = None  # the running mesh
    restarts: int = 0
    generation: int = 0  # bumped by every restart decision; processes carry theirs (Owner)
    restarting: bool = False  # a restart is queued or running on the restart thread
    pending: list[Failure] = field(default_factory=list)  # arrived while restarting


class _RestartThread:
    """One daemon thread per supervisor that runs its restarts in order. Restarts are slow
    (stop with grace, a restart delay, waiting for a host, building actors) and must not hold
    up the controller's single supervision thread, where every decision is taken."""

    def __init__(self, name: str) -> None:
        self._jobs: queue.Queue[Callable[[], None]] = queue.Queue()
        threading.Thread(target=self._run, daemon=True, name=f"ftharness-restart-{name}").start()

    def submit(self, fn: Callable[[], None]) -> None:
        self._jobs.put(fn)

    def _run(self) -> None:
        while True:
            self._jobs.get()()


class Supervisor:
    def __init__(
        self,
        plane: ControlPlane,
        name: str,
        spec: SupervisorSpec,
        parent: Supervisor | None = None,
        on_failure: Handler | None = None,
        on_restart: Callable[[str, Any], None] | None = None,
    ) -> None:
        self.plane = plane
        self.name = name
        self.spec = spec
        self.parent = parent
        self.on_failure = on_failure
        self.on_restart = on_restart  # called with (child name, new instance) after a restart
        self.children: dict[str, _Child] = {}
        self.history: list[float] = []
        self.stopped = False
        self._restarter: _RestartThread | None = None

    @property
    def path(self) -> str:
        return self.name if self.parent is None else f"{self.parent.path}/{self.name}"

    # -- building the tree --------------------------------------------------------------------
    def add_child(
        self, name: str, start: Callable[[], Any], restart: Restart = Restart.PERMANENT
    ) -> Any:
        """Start a mesh child now and supervise it; returns what ``start`` returned."""
        if name in self.children:
            raise ValueError(f"supervisor {self.path} already has a child {name!r}")
        child = _Child(name, restart, start=start)
        self.children[name] = child
        self._start(child)
        return child.instance

    def add_supervisor(
        self,
        name: str,
        spec: SupervisorSpec,
        *,
        restart: Restart = Restart.PERMANENT,
        on_failure: Handler | None = None,
        on_restart: Callable[[str, Any], None] | None = None,
    ) -> Supervisor:
        if name in self.children:
            raise ValueError(f"supervisor {self.path} already has a child {name!r}")
        sup = Supervisor(self.plane, name, spec, self, on_failure, on_restart)
        self.children[name] = _Child(name, restart, sup=sup)
        return sup

    def child(self, name: str) -> Any:
        """The current instance of a mesh child (it changes on every restart)."""
        return self.children[name].instance

    def proc_ids(self) -> list[str]:
        out: list[str] = []
        for c in self.children.values():
            if c.sup is not None:
                out.extend(c.sup.proc_ids())
            elif c.instance is not None:
                out.extend(c.instance.proc_ids)
        return out

    # -- running ------------------------------------------------------------------------------
    def _start(self, child: _Child) -> None:
        if child.sup is not None:
            child.sup.history = []
            child.sup.stopped = False
            for c in child.sup.children.values():
                child.sup._start(c)
            return
        assert child.start is not None
        with self.plane.owning(Owner(self, child.name, child.generation)):
            child.instance = child.start()

    def _stop(self, child: _Child) -> None:
        if child.sup is not None:
            child.sup.stop()
            child.sup.stopped = False
            return
        if child.instance is not None:
            self.plane.stop_procs(child.instance.proc_ids, self.spec.grace_s)

    def stop(self) -> None:
        """Stop every child, last started first."""
        self.stopped = True
        for child in reversed(list(self.children.values())):
            self._stop(child)

    def hold(self) -> None:
        """Restart nothing from now on (the job is ending): this supervisor and every one below
        it ignore failures; their processes run until :meth:`stop`. A restart already under way
        starts no further child."""
        self.stopped = True
        for child in self.children.values():
            if child.sup is not None:
                child.sup.hold()

    def _journal(self, decision: Decision, failure: Failure) -> None:
        self.plane.emit(
            SUPERVISOR,
            supervisor=self.path,
            child=failure.child,
            decision=decision.action.value,
            reason=decision.reason,
            cause=failure.cause.value,
            **{k: v for k, v in failure.coords.items() if k in ("replica", "rank")},
        )

    def handle_failure(
        self, failure: Failure, child_name: str, generation: int | None = None
    ) -> None:
        """Apply the restart policy to one child's failure. Called on the controller's
        supervision thread, so decisions never race; the restart itself runs on this
        supervisor's restart thread. ``generation`` is the child's incarnation the failed
        process belonged to (None: a failure about the child as a whole)."""
        child = self.children.get(child_name)
        if self.stopped or child is None:
            return
        if generation is not None and generation != child.generation:
            return  # a late report about a process this child already replaced
        if child.restarting:
            child.pending.append(failure)  # decided on once the restart in flight has ended
            return
        failure = failure.with_child(f"{self.path}/{child_name}")
        if self.on_failure is not None and self.on_failure(failure):
            self._journal(Decision(Action.ABSORB, "absorbed by handler"), failure)
            return
        decision = decide(self.spec, child.restart, failure, self.history, time.monotonic())
        self._journal(decision, failure)
        if decision.action is Action.ESCALATE:
            self.stop()
            self._escalate(failure, decision.reason)
            return
        if decision.action is Action.DROP:
            self._stop(child)
            return
        self.history.append(time.monotonic())
        targets = list(self.children.values()) if decision.action is Action.RESTART_ALL else [child]
        for c in targets:
            c.generation += 1  # from now on, reports about the old processes are stale
            c.restarting = True
        if self._restarter is None:
            self._restarter = _RestartThread(self.path.replace("/", "."))
        self._restarter.submit(lambda: self._restart(targets, child, failure))

    def _restart(self, targets: list[_Child], failed: _Child, failure: Failure) -> None:
        """On the restart thread: stop the targets, start them again, then hand back what
        arrived meanwhile. A restart that raises is a failure of the failed child."""
        try:
            for c in reversed(targets):
                self._stop(c)
            for c in targets:
                if self.stopped:
                    return
                self._start(c)
                c.restarts += 1
                if self.on_restart is not None:
                    self.on_restart(c.name, c.instance)
        except Exception as exc:
            for c in targets:
                c.restarting, c.pending = False, []  # the restart's failure stands for them
            self.plane.deliver(
                Failure(
                    cause=Cause.EXCEPTION,
                    detail=f"restart of {self.path}/{failed.name} failed: {exc!r}",
                    traceback=traceback.format_exc(),
                    chained=failure,
                ),
                Owner(self, failed.name, failed.generation),
            )
            return
        for c in targets:
            c.restarting, pending, c.pending = False, c.pending, []
            for f in pending:
                self.plane.deliver(f, Owner(self, c.name, c.generation))

    def _escalate(self, failure: Failure, reason: str) -> None:
        up = Failure(
            cause=Cause.ESCALATED,
            detail=f"supervisor {self.path} gave up: {reason}",
            coords=failure.coords,
            host=failure.host,
            chained=failure,
            t_event=failure.t_event,
        )
        if self.parent is None:
            self.plane.deliver(up, None)
        else:
            self.parent.handle_failure(up, self.name)
