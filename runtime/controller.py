"""The controller: the root of the supervision tree, living in the user's Python process.

    with Controller() as c:
        host = c.spawn_host("host0")
        procs = host.spawn_procs({"replicas": 2, "ranks": 2})
        actors = procs.spawn("trainer", Trainer)
        print(actors.step.call().get())

It owns every listener and thread of the control plane:

* a listener that workers and agents dial in to (``runtime.listener``: job secret, bounded);
* one connection per host agent, over which it spawns and stops workers and hears of exits,
  hangs and agent heartbeats;
* a monitor thread that declares a host lost when its agent stops heartbeating;
* one supervision thread that hands each failure, in order, to the supervisor owning the
  process (or to the root handler), so restart decisions never race each other.

With a control file (``runtime.control_file``) the controller can be replaced: it writes its
address and epoch there once it serves, its agents and workers outlive it for
``spec.controller_grace_s`` (``runtime.orphan``), and a takeover controller (``takeover=True``,
the next epoch) inherits them (``runtime.takeover``), given the journal's last event of each
process (``event_marks``): its workers send again what the dead one never read (``runtime.resend``).
A controller that finds a newer epoch in the file exits before it acts on anything
(``runtime.takeover.Succession``).

Why this module is longer than 500 lines: it owns the control plane's one locked table of processes,
calls and hosts; the listener, the host registry and the call table are modules of their own
(``runtime.listener``, ``runtime.host_registry``, ``runtime.proc_handle``), and what remains here
reads and writes that table under its lock, which splitting would spread across files.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import itertools
import logging
import os
import queue
import threading
import time
import traceback
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import replace
from typing import Any

from runtime import channel
from runtime.actor import RemoteError, set_coords, wire_name
from runtime.failure import Cause, Failure, SupervisionError, decode_wait_status
from runtime.host_handle import HostAgentHandle
from runtime.host_registry import HostTable
from runtime.journal import FAILURE, PROC_START, Journal
from runtime.launchers import Launcher, LocalLauncher
from runtime.listener import Listener
from runtime.mesh import ProcMesh, ProcRef
from runtime.messages import (
    AgentReport,
    Event,
    Exited,
    HelloAgent,
    HelloWorker,
    Hung,
    PreflightReply,
    Request,
    Result,
    ServeStore,
    Spawn,
    Spawned,
    SpawnProgram,
    StopProc,
    StoreServed,
    SysCall,
    Welcome,
)
from runtime.plane import Owner
from runtime.preflight_matrix import PreflightBoard
from runtime.proc_handle import CallTable, HostLostError, ProcFailedError, ProcRecord
from runtime.resend import EVENT_SEQ, Marks
from runtime.spares import SparePool
from runtime.spec import ControllerSpec, SupervisorSpec
from runtime.states import ProcState, check_transition
from runtime.supervisor import Handler, Supervisor
from runtime.takeover import Inheritance, Succession
from runtime.worker import EXIT_ACTOR_CRASHED

log = logging.getLogger("ftharness.controller")

#: The monitor (heartbeats, lost hosts) is stuck once it has not run for this many agent
#: heartbeat timeouts: a host's loss would go unjudged meanwhile (Controller.stuck).
MONITOR_STUCK_BEATS = 3
#: One failure's supervision may take a spawn (``spec.spawn_timeout_s``) and a host start; past
#: the spawn timeout plus this, the supervision thread is stuck (Controller.stuck).
SUPERVISION_STUCK_S = 60.0

__all__ = ["Controller", "HostAgentHandle", "HostLostError", "ProcFailedError", "ProcRecord"]


class Controller:
    def __init__(
        self,
        spec: ControllerSpec | None = None,
        *,
        journal: Journal | None = None,
        on_failure: Handler | None = None,
        secret: bytes | None = None,
        launcher: Launcher | None = None,
        control_file: str | os.PathLike[str] | None = None,
        epoch: int | None = None,
        takeover: bool = False,
        event_marks: Mapping[str, int] | None = None,
    ) -> None:
        self.spec = spec or ControllerSpec()
        self.succession = Succession(control_file, epoch, takeover, self.spec.controller_grace_s)
        self.epoch = self.succession.epoch
        if journal is not None and journal.fence is None:
            journal.fence = self.succession.fence  # a replaced controller never appends
        self.launcher: Launcher = launcher or LocalLauncher()
        self.journal = journal
        self.on_failure = on_failure
        self.secret = secret or channel.new_secret()
        self.host_table = HostTable(self)
        self.hosts = self.host_table.hosts  # by name
        self.procs: dict[str, ProcRecord] = {}
        self._stores: dict[tuple[str, int], cf.Future] = {}  # (host, replica) -> its address
        self.failures: list[Failure] = []
        self.fatal: Failure | None = None
        self.fatal_event = threading.Event()
        self._failure_listeners: list[Callable[[Failure], None]] = []
        self._calls = CallTable(first=((self.epoch - 1) << 32) + 1)  # ids unique across epochs
        self.preflight = PreflightBoard()  # the agents' answers (runtime.preflight_matrix)
        self._lock = threading.RLock()
        self.inherited = Inheritance(self.procs, self._lock, self._calls)  # runtime.takeover
        self.event_marks = Marks(event_marks)  # per process, its last event journaled
        # (failure, its owner or None for the root, the failed process if any)
        self._queue: queue.Queue[tuple[Failure, Owner | None, ProcRecord | None] | None] = (
            queue.Queue()
        )
        self._owner = threading.local()
        self.closed = False
        # Liveness of the two duties that block no lock while stuck (see stuck()): when the
        # monitor last ran, and since when the supervision thread handles one failure.
        self._monitor_ran = time.monotonic()
        self._supervising_since: float | None = None
        # Handshakes run on the listener's one thread, bounded in number and each by one
        # deadline; only an authenticated peer gets a thread (_serve_peer).
        sock, spec = channel.listen(self.spec.bind_host, 0), self.spec
        self.listener = Listener(
            sock, self.secret, self._serve_peer,
            timeout_s=spec.connect_timeout_s, max_pending=spec.max_pending_handshakes,
        )  # fmt: skip
        self.address = self.listener.address
        # Agents are started from this one long-lived thread: PR_SET_PDEATHSIG fires when the
        # *thread* that forked a child exits, so a short-lived thread must never fork an agent.
        self._spawner = cf.ThreadPoolExecutor(1, thread_name_prefix="ftharness-spawner")
        for target, name in (
            (self.listener.run, "accept"),
            (self._supervision_loop, "supervision"),
            (self._monitor_loop, "monitor"),
        ):
            self._thread(target, name)
        self.succession.announce(self.address)  # serving: agents may find us now

    def _thread(self, target: Callable[..., None], name: str, *args: Any) -> None:
        """A long-lived control-plane thread (see :meth:`_guarded`)."""
        threading.Thread(
            target=self.guarded, args=(target, name, *args), daemon=True, name=f"ftharness-{name}"
        ).start()

    def guarded(self, target: Callable[..., None], name: str, *args: Any) -> None:
        """Run a long-lived duty. None may die silently: an uncaught exception in one is a
        failure value at the root (the job stops with its traceback), since the duty (reaping,
        heartbeats, supervision) would otherwise stop unnoticed."""
        try:
            target(*args)
        except BaseException as exc:
            if self.closed:
                return
            log.exception("controller thread %s died", name)
            self._stop_job(
                Failure(
                    cause=Cause.EXCEPTION,
                    detail=f"controller thread {name} died: {exc!r}",
                    traceback=traceback.format_exc(),
                )
            )

    def __enter__(self) -> Controller:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    # -- journal ------------------------------------------------------------------------------
    def responsive(self, timeout_s: float) -> bool:
        """Whether the control plane answers: :meth:`stuck` finds nothing."""
        return self.stuck(timeout_s) is None

    def stuck(self, timeout_s: float) -> str | None:
        """Why the control plane is stuck now, or None. Its keeper's beat depends on it
        (``harness.job.controller_proc``): a stuck controller is replaced.

        - the lock cannot be taken within ``timeout_s``: a deadlock, or a thread wedged holding
          it, stops every supervision decision;
        - the monitor (host heartbeats, lost hosts) has not run for ``MONITOR_STUCK_BEATS``
          agent heartbeat timeouts: blocked without the lock, hosts would never be judged lost;
        - one failure has been in the supervision thread's hands for longer than a spawn and
          a host start could take (``SUPERVISION_STUCK_S`` past the spawn timeout): every
          later failure waits behind it."""
        if not self._lock.acquire(timeout=timeout_s):
            return f"its control plane's lock was not free within {timeout_s:g} s"
        self._lock.release()
        now, hb = time.monotonic(), self.spec.agent_heartbeat
        quiet = now - self._monitor_ran
        if not self.closed and quiet > MONITOR_STUCK_BEATS * hb.timeout_s:
            return f"its monitor (host heartbeats and checks) has not run for {quiet:.1f} s"
        since = self._supervising_since
        limit = self.spec.spawn_timeout_s + SUPERVISION_STUCK_S
        if since is not None and now - since > limit:
            return f"its supervision thread has been handling one failure for {now - since:.1f} s"
        return None

    def emit(self, event: str, **fields: Any) -> None:
        """Write a journal record (if the controller has a journal)."""
        if self.journal is not None:
            self.journal.emit(event, **fields)

    # -- hosts --------------------------------------------------------------------------------
    def spawn_host(self, name: str | None = None) -> HostAgentHandle:
        """Start a host agent through the launcher; returns once it has dialled in, preloaded
        and is ready."""
        name = name or f"host{len(self.hosts)}"
        if name in self.hosts and not self.hosts[name].lost:
            raise ValueError(f"host {name!r} already exists")
        return self._spawner.submit(self.host_table.start, name).result()

    def wait_for_hosts(self, names: list[str], timeout_s: float) -> list[HostAgentHandle]:
        """Block until agents started elsewhere (``ftharness agent``) have dialled in;
        ChannelError naming the missing ones after ``timeout_s``."""
        return self.host_table.wait_for(names, timeout_s)

    def make_spare_pool(self, host: Callable[[], HostAgentHandle]) -> SparePool:
        def fork(n: int, log_dir: str | None) -> list[ProcRecord]:
            h = host()
            if h.lost or self.closed:
                return []
            return self._request_procs(h, {"idle": n}, {}, log_dir, cold=False, spare=True)[2]

        return SparePool(
            fork,
            self._adopt_spare,
            lambda recs: self.stop_procs([r.ref.proc_id for r in recs], grace_s=0.5),
            spawn_timeout_s=self.spec.spawn_timeout_s,
        )

    def on_agent_message(self, h: HostAgentHandle, msg: Any) -> None:
        match msg:
            case Spawned(proc_id, pid):
                with self._lock:
                    rec = self.procs.get(proc_id)
                if rec is not None:
                    rec.pid = pid
                    if rec.program:
                        self._program_running(rec)
            case Exited(proc_id, _pid, status, t):
                self._on_exit(proc_id, status, t)
            case Hung(proc_id, _pid, silent_s, t_last):
                self._on_hung(proc_id, silent_s, t_last)
            case StoreServed(replica, address, error):
                with self._lock:
                    fut = self._stores.pop((h.name, replica), None)
                if fut is not None and address:
                    fut.set_result(address)
                elif fut is not None:
                    fut.set_exception(ProcFailedError(f"host {h.name}: {error}"))
            case PreflightReply():
                self.preflight.deliver(h.name, msg)
            case _:
                raise channel.FrameError(f"agent {h.name} sent {msg!r:.80}")

    def on_agent_report(self, h: HostAgentHandle, report: AgentReport) -> None:
        self.inherited.on_report(h, report)

    def set_quorum_upstream(self, address: str) -> None:
        """With ``spec.quorum_relay``: the quorum service serves at ``address`` now; every
        host's relay forwards there (``runtime.relay``), agents that dial in later included."""
        self.host_table.set_quorum_upstream(address)

    # -- a takeover's inheritance (runtime.takeover.Inheritance says what each does) ------------
    def reattach(self, names: Iterable[str], timeout_s: float) -> dict[str, AgentReport]:
        return self.inherited.reattach(names, timeout_s)

    def open_calls(self, proc_id: str) -> dict[int, tuple[str, str]]:
        return self.inherited.open_calls(proc_id)

    def open_call(self, proc_id: str, call_id: int) -> cf.Future:
        return self.inherited.open_call(proc_id, call_id)

    def adopt(self, proc_ids: Iterable[str], owner: Owner | None = None) -> None:
        """Inherited processes get ``owner`` (default: the one this thread spawns for, see
        :meth:`owning`; none: the root), and their failures held until now go to it."""
        if owner is None:
            owner = getattr(self._owner, "value", None)
        for item in self.inherited.adopt(proc_ids, owner):
            self._queue.put(item)

    def on_host_lost(self, h: HostAgentHandle, why: str) -> None:
        """``h`` was declared lost (by the host table): every process on it failed."""
        with self._lock:
            victims = [p for p in self.procs.values() if p.host is h]
            stores = [f for (name, _), f in self._stores.items() if name == h.name]
        for fut in stores:
            with contextlib.suppress(cf.InvalidStateError):
                fut.set_exception(HostLostError(f"host {h.name} lost: {why}"))
        now = time.time()
        for rec in victims:
            self._fail(
                rec,
                Failure(cause=Cause.LOST_HOST, detail=f"host {h.name} lost: {why}", t_event=now),
            )

    # -- processes ----------------------------------------------------------------------------
    @contextlib.contextmanager
    def owning(self, owner: Owner) -> Iterator[None]:
        """Processes spawned by this thread inside the block are owned by ``owner``."""
        prev = getattr(self._owner, "value", None)
        self._owner.value = owner
        try:
            yield
        finally:
            self._owner.value = prev

    def spawn_many(
        self,
        requests: list[tuple[HostAgentHandle, Mapping[str, int], Mapping[str, int]]],
        *,
        log_dir: str | None = None,
        cold: bool = False,
    ) -> list[ProcMesh]:
        """Spawn several meshes at once, (host, dims, fixed) each: every fork is requested
        before any is awaited, so cold starts on one or many hosts overlap."""
        pending = [self._request_procs(h, dict(d), dict(f), log_dir, cold) for h, d, f in requests]
        deadline = time.monotonic() + self.spec.spawn_timeout_s
        for _, _, recs in pending:
            for rec in recs:
                try:
                    rec.ready.result(timeout=max(0.0, deadline - time.monotonic()))
                except cf.TimeoutError:
                    raise ProcFailedError(
                        f"{rec.ref.proc_id} did not connect within {self.spec.spawn_timeout_s} s"
                    ) from None
        return [ProcMesh(self, dims, items) for dims, items, _ in pending]

    def _request_procs(
        self,
        h: HostAgentHandle,
        dims: dict[str, int],
        fixed: dict[str, int],
        log_dir: str | None,
        cold: bool,
        spare: bool = False,
    ) -> tuple[dict[str, int], dict[tuple[int, ...], ProcRef], list[ProcRecord]]:
        if h.lost or h.conn is None:
            raise HostLostError(f"host {h.name} is lost")
        if not dims or any(n < 1 for n in dims.values()):
            raise ValueError(f"a mesh needs at least one dimension, each >= 1: {dims}")
        if set(dims) & set(fixed):
            raise ValueError(f"dims {list(dims)} and fixed {list(fixed)} overlap")
        owner = getattr(self._owner, "value", None)
        items: dict[tuple[int, ...], ProcRef] = {}
        recs: list[ProcRecord] = []
        adopted = False
        for point in itertools.product(*(range(n) for n in dims.values())):
            coords = {**fixed, **dict(zip(dims, point, strict=True))}
            taken = h.pool.take(coords, owner) if not (cold or spare) else None
            if taken is not None:
                items[point] = taken.ref
                recs.append(taken)
                adopted = True
                continue
            ref = ProcRef(h.next_proc_id(), h.name, coords)
            rec = ProcRecord(ref, h, owner=None if spare else owner, spare=spare)
            with self._lock:
                self.procs[ref.proc_id] = rec
            items[point] = ref
            recs.append(rec)
            log_path = (
                os.path.join(log_dir, ref.proc_id.replace("/", "_") + ".log") if log_dir else None
            )
            h.conn.send(Spawn(ref.proc_id, coords, log_path, cold))
        if adopted:
            self._spawner.submit(h.pool.replenish)
        return dims, items, recs

    def serve_store(self, h: HostAgentHandle, replica: int) -> str:
        """A fresh store for replica group ``replica``'s next incarnation, served on ``h`` by its
        agent (``runtime.group_store``; the group's last one there ends): its ``host:port``.
        ProcFailedError if ``h`` is lost or cannot serve one."""
        if h.lost or h.conn is None:
            raise HostLostError(f"host {h.name} is lost")
        fut: cf.Future[str] = cf.Future()
        with self._lock:
            self._stores[(h.name, replica)] = fut
        h.conn.send(ServeStore(replica))
        try:
            return fut.result(timeout=self.spec.spawn_timeout_s)
        except cf.TimeoutError:
            raise ProcFailedError(
                f"host {h.name} did not serve replica group {replica}'s store within "
                f"{self.spec.spawn_timeout_s:g} s"
            ) from None
        finally:
            with self._lock:
                if self._stores.get((h.name, replica)) is fut:
                    del self._stores[(h.name, replica)]

    # -- programs of the user's own (runtime/program_proc.py runs them on the host) ------------
    def spawn_program(self, h: HostAgentHandle, msg: SpawnProgram) -> ProcRecord:
        """Start ``msg``'s program on ``h`` (its ``proc_id`` is assigned here) as a supervised
        process, owned like a spawned mesh's: an exit or a signal is a failure, exit code 0 is
        not (``rec.finished``). Running once its agent reports the pid (``rec.ready``)."""
        if h.lost or h.conn is None:
            raise HostLostError(f"host {h.name} is lost")
        ref = ProcRef(h.next_proc_id(), h.name, dict(msg.coords))
        rec = ProcRecord(ref, h, owner=getattr(self._owner, "value", None), program=True)
        with self._lock:
            self.procs[ref.proc_id] = rec
        h.conn.send(replace(msg, proc_id=ref.proc_id))
        return rec

    def _program_running(self, rec: ProcRecord) -> None:
        with self._lock:
            if rec.state is not ProcState.SPAWNING:
                return
            rec.state = ProcState.RUNNING
        self.emit(
            PROC_START, proc=rec.ref.proc_id, host=rec.host.name, pid=rec.pid, **rec.ref.coords
        )
        rec.ready.set_result(rec.pid)

    # -- warm spares ---------------------------------------------------------------------------
    def _adopt_spare(self, rec: ProcRecord, coords: dict[str, int], owner: Owner | None) -> bool:
        """An idle spare takes a mesh's coordinates (in the worker too, before any actor is
        built there) and its new owner; False if it died while idle."""
        with self._lock:
            rec.ref = ProcRef(rec.ref.proc_id, rec.host.name, coords)
            rec.owner, rec.spare = owner, False
        try:
            self.request(
                rec.ref.proc_id, SysCall, func=wire_name(set_coords), args=(coords,)
            ).result(timeout=self.spec.connect_timeout_s)
        except Exception:
            return False  # it died while idle; its failure is handled as a spare's
        self.emit(
            PROC_START, proc=rec.ref.proc_id, host=rec.host.name, pid=rec.pid, spare=True, **coords
        )
        return True

    def stop_proc(self, proc_id: str, grace_s: float | None = None) -> None:
        self.stop_procs([proc_id], grace_s, wait=False)

    def stop_procs(
        self, proc_ids: list[str], grace_s: float | None = None, wait: bool = True
    ) -> None:
        """SIGTERM -> grace -> SIGKILL each process tree; their exits are not failures."""
        self.succession.check("stopping processes")
        grace = 2.0 if grace_s is None else grace_s
        waiting: list[ProcRecord] = []
        for proc_id in proc_ids:
            with self._lock:
                rec = self.procs.get(proc_id)
                if rec is None or rec.state in (
                    ProcState.STOPPED,
                    ProcState.STOPPING,
                    ProcState.EXITED,
                ):
                    continue
                exited = rec.state is ProcState.FAILED and rec.conn is None
                rec.state = ProcState.STOPPING if not exited else ProcState.STOPPED
            if exited or rec.host.lost or rec.host.conn is None:
                continue
            with contextlib.suppress(channel.ChannelError):
                rec.host.conn.send(StopProc(proc_id, grace))
            waiting.append(rec)
        if wait:
            deadline = time.monotonic() + grace + 5.0
            while time.monotonic() < deadline and any(
                r.state is ProcState.STOPPING and not r.host.lost for r in waiting
            ):
                time.sleep(0.005)

    def _serve_peer(self, sock: Any, keys: tuple[bytes, bytes]) -> None:
        """An authenticated connection to the listener, on its own thread: a worker, or a host
        agent dialling in."""
        conn = channel.Connection(sock, peer="peer", keys=keys)
        rec: ProcRecord | None = None
        try:
            sock.settimeout(self.spec.connect_timeout_s)  # the first frame, or drop it
            hello = conn.recv()
            sock.settimeout(None)
            if isinstance(hello, HelloAgent):
                self.host_table.adopt(conn, hello)  # serves the agent on this thread
                return
            if not isinstance(hello, HelloWorker):
                raise channel.FrameError(f"expected HelloWorker or HelloAgent, got {hello!r:.80}")
            with self._lock:
                rec = self.procs.get(hello.proc_id)
            redial = hello.epoch_seen > 0  # a worker of a previous controller (runtime.takeover)
            if rec is None and redial:
                rec = self.inherited.wait_record(hello.proc_id, self.spec.connect_timeout_s)
            if rec is None:
                raise channel.FrameError(f"unknown worker {hello.proc_id!r}")
            conn.send(Welcome(self.epoch, self.event_marks.mark(hello.proc_id)))
            rec.pid, rec.conn = hello.pid, conn
            if redial:
                self.inherited.on_worker(rec, hello)
            else:
                with self._lock:
                    if rec.state is ProcState.SPAWNING:
                        rec.state = ProcState.RUNNING
                self.emit(
                    PROC_START, proc=rec.ref.proc_id, host=rec.host.name, pid=rec.pid,
                    spare=rec.spare, **rec.ref.coords,
                )  # fmt: skip
                rec.ready.set_result(rec.pid)
            while True:
                msg = conn.recv()
                try:
                    self._on_worker_message(rec, msg)
                except channel.FrameError:
                    raise
                except Exception:  # a bug here must not silently cut the worker off
                    log.exception("controller: handling %r from %s", msg, rec.ref.proc_id)
        except (channel.ChannelError, OSError) as exc:
            if not isinstance(exc, channel.ChannelError) or isinstance(exc, channel.FrameError):
                log.warning("controller: dropping connection: %s", exc)
            conn.close()
            if rec is not None and rec.conn is conn:
                rec.conn = None
                lost = ProcFailedError(f"{rec.ref.proc_id}: connection lost")
                if rec.state is ProcState.RUNNING:
                    # The agent's exit report (with the signal or exit code) normally follows
                    # within milliseconds and fails the pending calls with the real cause.
                    timer = threading.Timer(2.0, self._calls.fail_for, (rec, lost))
                    timer.daemon = True
                    timer.start()
                else:
                    self._calls.fail_for(rec, lost)

    def _on_worker_message(self, rec: ProcRecord, msg: Any) -> None:
        match msg:
            case Result(call_id, ok, value):
                if not ok:
                    rec.last_error = value
                fut = self._calls.pop_or_keep(rec, call_id)
                if fut is None:
                    return
                if ok:
                    fut.set_result(value)
                else:
                    exc_type, message, tb = value
                    fut.set_exception(RemoteError(exc_type, message, tb, dict(rec.ref.coords)))
            case Event(event, fields, seq):
                if self.event_marks.admit(rec.ref.proc_id, seq):  # never twice (runtime.resend)
                    numbered = {EVENT_SEQ: seq} if seq else {}
                    where = {"host": rec.host.name, "proc": rec.ref.proc_id}
                    self.emit(event, **{**fields, **numbered, **where})
            case _:
                raise channel.FrameError(f"malformed message {msg!r:.80}")

    def request(self, proc_id: str, kind: type[Request], **fields: Any) -> cf.Future:
        """Send ``kind(call_id=..., **fields)`` to a worker; the future gets its result (or a
        RemoteError, or ProcFailedError if the process fails first)."""
        self.succession.check("sending a request")
        with self._lock:
            rec = self.procs.get(proc_id)
            refused: BaseException | None = None
            if self.fatal is not None:
                refused = SupervisionError(self.fatal)
            elif rec is None or rec.conn is None or rec.state is not ProcState.RUNNING:
                state = rec.state.value if rec else "unknown"
                refused = ProcFailedError(f"{proc_id} is not running ({state})")
            else:
                call_id, fut = self._calls.open(rec)
                conn = rec.conn
        if refused is not None:
            fut = cf.Future()
            fut.set_exception(refused)
            return fut
        assert rec is not None  # not refused: it was found RUNNING, under the lock, above
        try:
            conn.send(kind(call_id=call_id, **fields))
        except channel.ChannelError as exc:
            self._calls.fail_for(rec, ProcFailedError(f"{proc_id}: {exc}"))
        except Exception as exc:  # did not pickle, or over the frame limit: the caller's error
            self._calls.pop(rec, call_id)
            fut.set_exception(exc)
        return fut

    def run_in_worker(self, proc_id: str, func: Callable[..., Any], *args: Any) -> cf.Future:
        """Run ``func(*args)`` inside a worker on a fresh thread (not queued behind the actor's
        running endpoint). Used by the fault injector and the job's system calls.

        ``func`` is the function itself, a module-level one: only its name travels, and the
        worker imports it. :func:`runtime.actor.wire_name` raises here, in the caller, for what
        a worker cannot import (a lambda, a nested function, a bound method: ``ValueError`` or
        ``TypeError``) and for a string (``TypeError``: pass the function, not its name). The
        future holds the function's result, or the error it raised."""
        return self.request(proc_id, SysCall, func=wire_name(func), args=args)

    # -- failures -----------------------------------------------------------------------------
    def _on_exit(self, proc_id: str, status: int, t: float) -> None:
        with self._lock:
            rec = self.procs.get(proc_id)
        if rec is None:
            return
        cause, code, sig, detail = decode_wait_status(status)
        with self._lock:
            if rec.state is ProcState.STOPPING:
                rec.state = ProcState.STOPPED
                rec.conn = None
                return
            if (
                rec.program
                and cause is Cause.CLEAN_EXIT
                and check_transition(rec.state, ProcState.EXITED)
            ):
                rec.state = ProcState.EXITED  # a program that finished: not a failure
                rec.finished.set_result(t)
                return
        tb = None
        if code == EXIT_ACTOR_CRASHED and rec.last_error is not None:
            exc_type, message, tb = rec.last_error
            cause, detail = Cause.EXCEPTION, f"an actor raised {exc_type}: {message}"
        self._fail(
            rec,
            Failure(
                cause=cause,
                detail=detail,
                exit_code=code,
                signal=sig,
                traceback=tb,
                t_event=t,
                t_detected=t,
            ),
        )
        rec.conn = None

    def report_hung(self, proc_id: str, silent_s: float, t_last: float, detail: str) -> None:
        """``proc_id`` is hung by a liveness signal other than its heartbeat (a program's
        progress): a failure like a missed heartbeat, and the process is killed."""
        self._on_hung(proc_id, silent_s, t_last, detail)

    def _on_hung(
        self, proc_id: str, silent_s: float, t_last: float, detail: str | None = None
    ) -> None:
        with self._lock:
            rec = self.procs.get(proc_id)
        if rec is None:
            return
        failure = Failure(
            cause=Cause.MISSED_HEARTBEAT,
            detail=detail or f"no heartbeat for {silent_s:.2f} s (hung, or a C call holds the GIL)",
            t_event=t_last,
        )
        if self._fail(rec, failure) and rec.host.conn is not None:
            # A hung process cannot recover: kill it now; its exit is then not a new failure.
            with contextlib.suppress(channel.ChannelError):
                rec.host.conn.send(StopProc(proc_id, 0.0))

    def _fail(self, rec: ProcRecord, failure: Failure) -> bool:
        """Move ``rec`` to FAILED and queue the failure for its owner (once; an inherited
        process's waits for :meth:`adopt`)."""
        self.succession.check("handling a failure")
        with self._lock:
            if not check_transition(rec.state, ProcState.FAILED):
                return False
            rec.state = ProcState.FAILED
        failure = replace(
            failure,
            proc=rec.ref.proc_id,
            host=rec.host.name,
            pid=rec.pid,
            coords=dict(rec.ref.coords),
            t_detected=time.time(),
        )
        error = HostLostError if failure.cause is Cause.LOST_HOST else ProcFailedError
        if not rec.ready.done():
            rec.ready.set_exception(error(failure.summary(), failure))
        self._calls.fail_for(rec, error(failure.summary(), failure))
        self.emit(FAILURE, **failure.journal_fields(), t_detected=failure.t_detected)
        for fn in list(self._failure_listeners):
            try:
                fn(failure)
            except Exception:
                log.exception("failure listener raised")
        if not self.inherited.hold(rec, failure):
            self._queue.put((failure, rec.owner, rec))
        return True

    def add_failure_listener(self, fn: Callable[[Failure], None]) -> None:
        """``fn(failure)`` is called for every process failure the moment it is known, on the
        thread that learnt it, before any supervisor acts: it must be quick and never block
        (e.g. tell the quorum service to drop a dead group)."""
        self._failure_listeners.append(fn)

    def deliver(self, failure: Failure, owner: Owner | None) -> None:
        """Queue ``failure`` for ``owner`` (None: the root) on the supervision thread."""
        self._queue.put((failure, owner, None))

    def _supervision_loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            failure, owner, rec = item
            if rec is not None:
                self.failures.append(failure)
            if rec is not None and rec.spare:
                rec.host.pool.forget(rec)
                self._spawner.submit(rec.host.pool.replenish)
                continue
            self._supervising_since = time.monotonic()
            try:
                if owner is not None:
                    owner.supervisor.handle_failure(failure, owner.child, owner.generation)
                else:
                    self._unhandled(failure)
            except Exception:
                log.exception("supervision of %s raised", failure.summary())
            finally:
                self._supervising_since = None

    def _unhandled(self, failure: Failure) -> None:
        """A failure reached the root: the root handler may absorb it, else the job stops."""
        if self.on_failure is not None and self.on_failure(failure):
            return
        self._stop_job(failure)

    def _stop_job(self, failure: Failure) -> None:
        """The job cannot go on: record ``failure`` as fatal, fail every call, wake waiters."""
        with self._lock:
            if self.fatal is not None:
                return
            self.fatal = failure
        self._calls.fail_all(SupervisionError(failure))
        self.emit(FAILURE, fatal=True, **failure.journal_fields())
        self.fatal_event.set()

    def supervisor(
        self,
        name: str,
        spec: SupervisorSpec | None = None,
        *,
        on_failure: Handler | None = None,
        on_restart: Callable[[str, Any], None] | None = None,
    ) -> Supervisor:
        """A top-level supervisor; its escalations reach the root (this controller)."""
        return Supervisor(self, name, spec or SupervisorSpec(), None, on_failure, on_restart)

    def wait(self, timeout: float | None = None) -> None:
        """Block until a failure reaches the root unhandled; raise it as SupervisionError."""
        if self.fatal_event.wait(timeout):
            assert self.fatal is not None
            raise SupervisionError(self.fatal)

    def raise_if_failed(self) -> None:
        if self.fatal is not None:
            raise SupervisionError(self.fatal)

    def _monitor_loop(self) -> None:
        while not self.closed:
            self._monitor_ran = time.monotonic()
            time.sleep(self.spec.agent_heartbeat.interval_s / 2)
            self.succession.check("checking its hosts")
            self.host_table.beat_and_check()

    # -- shutdown -----------------------------------------------------------------------------
    def shutdown(self, grace_s: float = 2.0) -> None:
        """Stop every process and agent; nothing is left running after this returns."""
        self.succession.check("shutting the run down")  # a replaced controller's agents are not its
        with self._lock:
            if self.closed:
                return
            self.closed = True
            for rec in self.procs.values():
                if rec.state in (ProcState.SPAWNING, ProcState.RUNNING, ProcState.FAILED):
                    rec.state = ProcState.STOPPING
        self.host_table.shutdown(grace_s)
        self._queue.put(None)
        self.listener.close()
        self._spawner.shutdown(wait=False)
