"""The controller: the root of the supervision tree, living in the user's Python process.

    with Controller() as c:
        host = c.spawn_host("host0")
        procs = host.spawn_procs({"replicas": 2, "ranks": 2})
        actors = procs.spawn("trainer", Trainer)
        print(actors.step.call().get())

It owns every listener and thread of the control plane:

* a listener that workers connect to (authenticated with the job secret) for endpoint calls;
* one connection per host agent, over which it spawns and stops workers and hears of exits,
  hangs and agent heartbeats;
* a monitor thread that declares a host lost when its agent stops heartbeating;
* one supervision thread that hands each failure, in order, to the supervisor owning the
  process (or to the root handler), so restart decisions never race each other.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import itertools
import json
import logging
import os
import queue
import select
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from runtime import channel, process
from runtime.actor import RemoteError
from runtime.failure import Cause, Failure, SupervisionError, decode_wait_status
from runtime.journal import FAILURE, PROC_START, Journal
from runtime.mesh import ProcMesh, ProcRef
from runtime.spec import ControllerSpec, SupervisorSpec
from runtime.states import ProcState, check_transition
from runtime.supervisor import Handler, Supervisor

log = logging.getLogger("ftharness.controller")


class ProcFailedError(RuntimeError):
    """A call could not complete because its process failed (the failure is attached)."""

    def __init__(self, message: str, failure: Failure | None = None) -> None:
        super().__init__(message)
        self.failure = failure


@dataclass(eq=False)  # identity: a record is one process, whatever its fields say
class _Proc:
    ref: ProcRef
    host: HostAgentHandle
    state: ProcState = ProcState.SPAWNING
    pid: int | None = None
    conn: channel.Connection | None = None
    ready: cf.Future = field(default_factory=cf.Future)
    owner: tuple[Supervisor, str] | None = None
    pending: set[int] = field(default_factory=set)
    spare: bool = False  # an idle warm spare, not yet adopted by any mesh


class HostAgentHandle:
    """A running host agent: spawn worker meshes on it, or kill it (host eviction)."""

    def __init__(self, controller: Controller, name: str) -> None:
        self.controller = controller
        self.name = name
        self.popen: subprocess.Popen | None = None
        self.conn: channel.Connection | None = None
        self.address: tuple[str, int] | None = None
        self.last_beat = time.monotonic()
        self.lost = False
        self._n = itertools.count()
        self.spares_wanted = 0
        self.spares: list[_Proc] = []  # connected, idle, ready to be adopted
        self.spares_starting = 0
        self.spare_log_dir: str | None = None

    @property
    def pid(self) -> int:
        assert self.popen is not None
        return self.popen.pid

    def spawn_procs(
        self,
        dims: Mapping[str, int],
        *,
        fixed: Mapping[str, int] | None = None,
        log_dir: str | None = None,
        cold: bool = False,
    ) -> ProcMesh:
        """Fork one worker per point of ``dims``; return when all are connected.

        ``fixed`` adds coordinates shared by all of them (e.g. ``{"replicas": 2}`` when one
        host holds one replica group); each process's ``coords`` are ``fixed`` plus its point.
        ``cold`` execs a fresh interpreter that imports the preload modules itself, as a
        scheduler's restart would, instead of forking the agent's warm one.
        """
        return self.controller._spawn_procs(self, dict(dims), dict(fixed or {}), log_dir, cold)

    def keep_spares(self, n: int, log_dir: str | None = None) -> None:
        """Keep ``n`` idle workers forked and connected on this host. A later (warm)
        ``spawn_procs`` adopts them instead of forking, and a used or dead spare is replaced
        in the background. Returns once the first ``n`` are ready."""
        if n < 0:
            raise ValueError(f"spares must be >= 0, got {n}")
        self.spares_wanted = n
        self.spare_log_dir = log_dir
        with self.controller._lock:
            surplus, self.spares = self.spares[n:], self.spares[:n]
        self.controller.stop_procs([r.ref.proc_id for r in surplus], grace_s=0.5)
        self.controller._replenish_spares(self, wait=True)

    def kill(self) -> None:
        """SIGKILL the agent and every process under it at once (a host eviction)."""
        if self.popen is not None:
            procs = process.tree(self.popen.pid)
            process.signal_all(procs, 9)


class Controller:
    def __init__(
        self,
        spec: ControllerSpec | None = None,
        *,
        journal: Journal | None = None,
        on_failure: Handler | None = None,
        secret: bytes | None = None,
    ) -> None:
        self.spec = spec or ControllerSpec()
        self.journal = journal
        self.on_failure = on_failure
        self.secret = secret or channel.new_secret()
        self.hosts: dict[str, HostAgentHandle] = {}
        self.procs: dict[str, _Proc] = {}
        self.failures: list[Failure] = []
        self.fatal: Failure | None = None
        self.fatal_event = threading.Event()
        self._failure_listeners: list[Callable[[Failure], None]] = []
        self._calls: dict[int, tuple[cf.Future, str]] = {}
        self._call_ids = itertools.count(1)
        self._lock = threading.RLock()
        self._queue: queue.Queue[tuple[Failure, _Proc | None] | None] = queue.Queue()
        self._owner = threading.local()
        self._closed = False
        self._listener = channel.listen(self.spec.bind_host, 0)
        self.address = self._listener.getsockname()[:2]
        # Agents are started from this one long-lived thread: PR_SET_PDEATHSIG fires when the
        # *thread* that forked a child exits, so a short-lived thread must never fork an agent.
        self._spawner = cf.ThreadPoolExecutor(1, thread_name_prefix="ftharness-spawner")
        for target, name in (
            (self._accept_loop, "accept"),
            (self._supervision_loop, "supervision"),
            (self._monitor_loop, "monitor"),
        ):
            threading.Thread(target=target, daemon=True, name=f"ftharness-{name}").start()

    def __enter__(self) -> Controller:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    # -- journal ------------------------------------------------------------------------------
    def _emit(self, event: str, **fields: Any) -> None:
        if self.journal is not None:
            self.journal.emit(event, **fields)

    # -- hosts --------------------------------------------------------------------------------
    def spawn_host(self, name: str | None = None) -> HostAgentHandle:
        """Start a host agent (a separate process); returns once it is connected and ready."""
        name = name or f"host{len(self.hosts)}"
        if name in self.hosts and not self.hosts[name].lost:
            raise ValueError(f"host {name!r} already exists")
        return self._spawner.submit(self._start_agent, name).result()

    def _start_agent(self, name: str) -> HostAgentHandle:
        h = HostAgentHandle(self, name)
        cfg = {
            "host": name,
            "secret": self.secret.hex(),
            "controller_host": self.address[0],
            "controller_port": self.address[1],
            "bind_host": self.spec.bind_host,
            "parent_pid": os.getpid(),
            "sys_path": [p for p in sys.path if p],
            "preload": list(self.spec.preload),
            "heartbeat_interval_s": self.spec.heartbeat.interval_s,
            "heartbeat_timeout_s": self.spec.heartbeat.timeout_s,
            "agent_heartbeat_interval_s": self.spec.agent_heartbeat.interval_s,
            "connect_timeout_s": self.spec.connect_timeout_s,
        }
        h.popen = subprocess.Popen(
            [sys.executable, "-m", "runtime.agent"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            cwd=os.getcwd(),
        )
        assert h.popen.stdin is not None and h.popen.stdout is not None
        h.popen.stdin.write((json.dumps(cfg) + "\n").encode())
        h.popen.stdin.close()
        port = self._read_port(h, timeout=self.spec.connect_timeout_s + 30.0)
        h.address = (self.spec.bind_host, port)
        h.conn = channel.connect(h.address, self.secret, self.spec.connect_timeout_s)
        h.conn.send(("hello_controller",))
        msg = h.conn.recv()
        if msg[0] != "agent_ready":
            raise channel.ChannelError(f"agent {name} answered {msg!r}")
        h.last_beat = time.monotonic()
        with self._lock:
            self.hosts[name] = h
        threading.Thread(
            target=self._agent_loop, args=(h,), daemon=True, name=f"ftharness-agent-{name}"
        ).start()
        return h

    @staticmethod
    def _read_port(h: HostAgentHandle, timeout: float) -> int:
        assert h.popen is not None and h.popen.stdout is not None
        ready, _, _ = select.select([h.popen.stdout], [], [], timeout)
        line = h.popen.stdout.readline().decode() if ready else ""
        if not line.startswith("PORT "):
            h.popen.kill()
            raise channel.ChannelError(
                f"host agent {h.name} did not start within {timeout} s (said {line!r})"
            )
        return int(line.split()[1])

    def _agent_loop(self, h: HostAgentHandle) -> None:
        assert h.conn is not None
        while True:
            try:
                msg = h.conn.recv()
            except channel.ChannelError as exc:
                self._host_lost(h, f"agent connection closed ({exc})")
                return
            kind = msg[0]
            if kind == "hb":
                h.last_beat = time.monotonic()
            elif kind == "spawned":
                _, proc_id, pid = msg
                with self._lock:
                    rec = self.procs.get(proc_id)
                if rec is not None:
                    rec.pid = pid
            elif kind == "exit":
                _, proc_id, pid, status, t = msg
                self._on_exit(proc_id, pid, status, t)
            elif kind == "hung":
                _, proc_id, pid, silent, t_last = msg
                self._on_hung(proc_id, pid, silent, t_last)

    def _host_lost(self, h: HostAgentHandle, why: str) -> None:
        with self._lock:
            if h.lost or self._closed:
                return
            h.lost = True
            victims = [p for p in self.procs.values() if p.host is h]
        h.kill()  # a frozen agent must not keep half its tree alive
        now = time.time()
        for rec in victims:
            self._fail(
                rec,
                Failure(cause=Cause.LOST_HOST, detail=f"host {h.name} lost: {why}", t_event=now),
            )

    # -- processes ----------------------------------------------------------------------------
    @contextlib.contextmanager
    def _owning(self, sup: Supervisor, child: str) -> Iterator[None]:
        prev = getattr(self._owner, "value", None)
        self._owner.value = (sup, child)
        try:
            yield
        finally:
            self._owner.value = prev

    def _spawn_procs(
        self,
        h: HostAgentHandle,
        dims: dict[str, int],
        fixed: dict[str, int],
        log_dir: str | None,
        cold: bool = False,
    ) -> ProcMesh:
        return self.spawn_many([(h, dims, fixed)], log_dir=log_dir, cold=cold)[0]

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
    ) -> tuple[dict[str, int], dict[tuple[int, ...], ProcRef], list[_Proc]]:
        if h.lost or h.conn is None:
            raise ProcFailedError(f"host {h.name} is lost")
        if not dims or any(n < 1 for n in dims.values()):
            raise ValueError(f"a mesh needs at least one dimension, each >= 1: {dims}")
        if set(dims) & set(fixed):
            raise ValueError(f"dims {list(dims)} and fixed {list(fixed)} overlap")
        owner = getattr(self._owner, "value", None)
        items: dict[tuple[int, ...], ProcRef] = {}
        recs: list[_Proc] = []
        adopted = False
        for point in itertools.product(*(range(n) for n in dims.values())):
            coords = {**fixed, **dict(zip(dims, point, strict=True))}
            taken = self._take_spare(h, coords, owner) if not (cold or spare) else None
            if taken is not None:
                items[point] = taken.ref
                recs.append(taken)
                adopted = True
                continue
            ref = ProcRef(f"{h.name}/p{next(h._n)}", h.name, coords)
            rec = _Proc(ref, h, owner=None if spare else owner, spare=spare)
            with self._lock:
                self.procs[ref.proc_id] = rec
            items[point] = ref
            recs.append(rec)
            log_path = (
                os.path.join(log_dir, ref.proc_id.replace("/", "_") + ".log") if log_dir else None
            )
            h.conn.send(("spawn", ref.proc_id, coords, log_path, cold))
        if adopted:
            self._spawner.submit(self._replenish_spares, h)
        return dims, items, recs

    # -- warm spares ---------------------------------------------------------------------------
    def _take_spare(self, h: HostAgentHandle, coords: dict[str, int], owner: Any) -> _Proc | None:
        """Adopt an idle spare for ``coords``: it gets the new coordinates (in the worker too,
        before any actor is built there) and its new owner."""
        while True:
            with self._lock:
                if not h.spares:
                    return None
                rec = h.spares.pop(0)
                if rec.state is not ProcState.RUNNING:
                    continue
                rec.ref = ProcRef(rec.ref.proc_id, h.name, coords)
                rec.owner, rec.spare = owner, False
            try:
                self._send_call(
                    rec.ref.proc_id, ("sys", "runtime.actor:set_coords", (coords,))
                ).result(timeout=self.spec.connect_timeout_s)
            except Exception:
                continue  # it died while idle; its failure is handled as a spare's
            self._emit(
                PROC_START, proc=rec.ref.proc_id, host=h.name, pid=rec.pid, spare=True, **coords
            )
            return rec

    def _replenish_spares(self, h: HostAgentHandle, wait: bool = False) -> None:
        with self._lock:
            missing = h.spares_wanted - len(h.spares) - h.spares_starting
            if missing <= 0 or h.lost or self._closed:
                return
            h.spares_starting += missing
        try:
            _, _, recs = self._request_procs(
                h, {"idle": missing}, {}, h.spare_log_dir, cold=False, spare=True
            )
        except Exception:
            with self._lock:
                h.spares_starting -= missing
            raise

        def ready(rec: _Proc, fut: cf.Future) -> None:
            with self._lock:
                h.spares_starting -= 1
                if fut.exception() is None and rec.state is ProcState.RUNNING:
                    h.spares.append(rec)

        for rec in recs:
            rec.ready.add_done_callback(lambda fut, rec=rec: ready(rec, fut))
        if wait:
            for rec in recs:
                with contextlib.suppress(Exception):
                    rec.ready.result(timeout=self.spec.spawn_timeout_s)

    def stop_proc(self, proc_id: str, grace_s: float | None = None) -> None:
        self.stop_procs([proc_id], grace_s, wait=False)

    def stop_procs(
        self, proc_ids: list[str], grace_s: float | None = None, wait: bool = True
    ) -> None:
        """SIGTERM -> grace -> SIGKILL each process tree; their exits are not failures."""
        grace = 2.0 if grace_s is None else grace_s
        waiting: list[_Proc] = []
        for proc_id in proc_ids:
            with self._lock:
                rec = self.procs.get(proc_id)
                if rec is None or rec.state in (ProcState.STOPPED, ProcState.STOPPING):
                    continue
                exited = rec.state is ProcState.FAILED and rec.conn is None
                rec.state = ProcState.STOPPING if not exited else ProcState.STOPPED
            if exited or rec.host.lost or rec.host.conn is None:
                continue
            with contextlib.suppress(channel.ChannelError):
                rec.host.conn.send(("stop", proc_id, grace))
            waiting.append(rec)
        if wait:
            deadline = time.monotonic() + grace + 5.0
            while time.monotonic() < deadline and any(
                r.state is ProcState.STOPPING and not r.host.lost for r in waiting
            ):
                time.sleep(0.005)

    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                sock, _ = self._listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve_worker, args=(sock,), daemon=True).start()

    def _serve_worker(self, sock: Any) -> None:
        try:
            channel.server_handshake(sock, self.secret, self.spec.connect_timeout_s)
        except channel.ChannelError as exc:
            log.warning("controller: dropping peer: %s", exc)
            sock.close()
            return
        conn = channel.Connection(sock, peer="worker")
        rec: _Proc | None = None
        try:
            hello = conn.recv()
            if not (isinstance(hello, tuple) and hello[0] == "hello_worker"):
                raise channel.FrameError(f"expected hello_worker, got {hello!r:.80}")
            with self._lock:
                rec = self.procs.get(hello[1])
            if rec is None:
                raise channel.FrameError(f"unknown worker {hello[1]!r}")
            rec.pid, rec.conn = hello[2], conn
            with self._lock:
                if rec.state is ProcState.SPAWNING:
                    rec.state = ProcState.RUNNING
            self._emit(
                PROC_START,
                proc=rec.ref.proc_id,
                host=rec.host.name,
                pid=rec.pid,
                spare=rec.spare,
                **rec.ref.coords,
            )
            rec.ready.set_result(rec.pid)
            while True:
                self._on_worker_message(rec, conn.recv())
        except channel.ChannelError as exc:
            if isinstance(exc, channel.FrameError):
                log.warning("controller: dropping worker connection: %s", exc)
            conn.close()
            if rec is not None:
                rec.conn = None
                lost = ProcFailedError(f"{rec.ref.proc_id}: connection lost")
                if rec.state is ProcState.RUNNING:
                    # The agent's exit report (with the signal or exit code) normally follows
                    # within milliseconds and fails the pending calls with the real cause.
                    timer = threading.Timer(2.0, self._fail_calls, (rec, lost))
                    timer.daemon = True
                    timer.start()
                else:
                    self._fail_calls(rec, lost)

    def _on_worker_message(self, rec: _Proc, msg: Any) -> None:
        kind = msg[0]
        if kind == "result":
            _, call_id, ok, value = msg
            with self._lock:
                entry = self._calls.pop(call_id, None)
                rec.pending.discard(call_id)
            if entry is None:
                return
            fut = entry[0]
            if ok:
                fut.set_result(value)
            else:
                exc_type, message, tb = value
                fut.set_exception(RemoteError(exc_type, message, tb, dict(rec.ref.coords)))
        elif kind == "event":
            _, event, fields = msg
            self._emit(event, host=rec.host.name, **fields)

    def _send_call(self, proc_id: str, body: tuple) -> cf.Future:
        fut: cf.Future = cf.Future()
        with self._lock:
            rec = self.procs.get(proc_id)
            if self.fatal is not None:
                fut.set_exception(SupervisionError(self.fatal))
                return fut
            if rec is None or rec.conn is None or rec.state is not ProcState.RUNNING:
                state = rec.state.value if rec else "unknown"
                fut.set_exception(ProcFailedError(f"{proc_id} is not running ({state})"))
                return fut
            call_id = next(self._call_ids)
            self._calls[call_id] = (fut, proc_id)
            rec.pending.add(call_id)
            conn = rec.conn
        try:
            conn.send((body[0], call_id, *body[1:]))
        except channel.ChannelError as exc:
            self._fail_calls(rec, ProcFailedError(f"{proc_id}: {exc}"))
        return fut

    def run_in_worker(self, proc_id: str, func: str, *args: Any) -> cf.Future:
        """Run ``"module:function"(*args)`` inside a worker on a fresh thread (not queued
        behind the actor's running endpoint). Used by the fault injector."""
        return self._send_call(proc_id, ("sys", func, args))

    def _fail_calls(self, rec: _Proc, exc: BaseException) -> None:
        with self._lock:
            ids, rec.pending = rec.pending, set()
            futs = [self._calls.pop(i)[0] for i in ids if i in self._calls]
        for f in futs:
            if not f.done():
                f.set_exception(exc)

    # -- failures -----------------------------------------------------------------------------
    def _on_exit(self, proc_id: str, pid: int, status: int, t: float) -> None:
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
        self._fail(
            rec,
            Failure(
                cause=cause, detail=detail, exit_code=code, signal=sig, t_event=t, t_detected=t
            ),
        )
        rec.conn = None

    def _on_hung(self, proc_id: str, pid: int, silent: float, t_last: float) -> None:
        with self._lock:
            rec = self.procs.get(proc_id)
        if rec is None:
            return
        failure = Failure(
            cause=Cause.MISSED_HEARTBEAT,
            detail=f"no heartbeat for {silent:.2f} s (hung, or a C call holds the GIL)",
            t_event=t_last,
        )
        if self._fail(rec, failure) and rec.host.conn is not None:
            # A hung process cannot recover: kill it now; its exit is then not a new failure.
            with contextlib.suppress(channel.ChannelError):
                rec.host.conn.send(("stop", proc_id, 0.0))

    def _fail(self, rec: _Proc, failure: Failure) -> bool:
        """Move ``rec`` to FAILED and queue the failure for its supervisor (once)."""
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
        if not rec.ready.done():
            rec.ready.set_exception(ProcFailedError(failure.summary(), failure))
        self._fail_calls(rec, ProcFailedError(failure.summary(), failure))
        self._emit(FAILURE, **failure.journal_fields(), t_detected=failure.t_detected)
        for fn in list(self._failure_listeners):
            try:
                fn(failure)
            except Exception:
                log.exception("failure listener raised")
        self._queue.put((failure, rec))
        return True

    def add_failure_listener(self, fn: Callable[[Failure], None]) -> None:
        """``fn(failure)`` is called for every process failure the moment it is known, on the
        thread that learnt it, before any supervisor acts: it must be quick and never block
        (e.g. tell the quorum service to drop a dead group)."""
        self._failure_listeners.append(fn)

    def _supervision_loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            failure, rec = item
            self.failures.append(failure)
            if rec is not None and rec.spare:
                with self._lock:
                    if rec in rec.host.spares:
                        rec.host.spares.remove(rec)
                self._spawner.submit(self._replenish_spares, rec.host)
                continue
            try:
                owner = rec.owner if rec is not None else None
                if owner is not None:
                    owner[0].handle_failure(failure, owner[1])
                else:
                    self._unhandled(failure)
            except Exception:
                log.exception("supervision of %s raised", failure.summary())

    def _unhandled(self, failure: Failure) -> None:
        """A failure reached the root: the root handler may absorb it, else the job stops."""
        if self.on_failure is not None and self.on_failure(failure):
            return
        with self._lock:
            if self.fatal is not None:
                return
            self.fatal = failure
            calls = [f for f, _ in self._calls.values()]
            self._calls.clear()
        self._emit(FAILURE, fatal=True, **failure.journal_fields())
        for f in calls:
            if not f.done():
                f.set_exception(SupervisionError(failure))
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
        hb = self.spec.agent_heartbeat
        while not self._closed:
            time.sleep(hb.interval_s / 2)
            now = time.monotonic()
            for h in list(self.hosts.values()):
                if not h.lost and now - h.last_beat > hb.timeout_s:
                    self._host_lost(h, f"no agent heartbeat for {now - h.last_beat:.2f} s")

    # -- shutdown -----------------------------------------------------------------------------
    def shutdown(self, grace_s: float = 2.0) -> None:
        """Stop every process and agent; nothing is left running after this returns."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for rec in self.procs.values():
                if rec.state in (ProcState.SPAWNING, ProcState.RUNNING, ProcState.FAILED):
                    rec.state = ProcState.STOPPING
        for h in list(self.hosts.values()):
            if h.conn is not None and not h.lost:
                with contextlib.suppress(channel.ChannelError):
                    h.conn.send(("shutdown", grace_s))
        for h in list(self.hosts.values()):
            if h.popen is None:
                continue
            try:
                h.popen.wait(timeout=grace_s + 3.0)
            except subprocess.TimeoutExpired:
                process.terminate_tree(h.popen.pid, 0.5)
                h.popen.wait(timeout=5.0)
            if h.conn is not None:
                h.conn.close()
        self._queue.put(None)
        with contextlib.suppress(OSError):
            self._listener.close()
        self._spawner.shutdown(wait=False)
