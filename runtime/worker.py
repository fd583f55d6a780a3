"""The worker process: hosts actors, heartbeats from a Python thread, dies with its parents.

A worker is forked by its host agent (which has already imported torch), so it is ready in
milliseconds. Threads:

* main thread — runs actor constructors and endpoints, one message at a time;
* receiver — reads the controller connection; runs system calls (``sys`` messages, used by the
  fault injector) on their own threads so they are not queued behind a long endpoint;
* heartbeat — writes a byte to the agent every interval. It is a Python thread on purpose: if a
  C call holds the GIL, the heartbeats stop and the agent reports the worker as hung.

The worker exits when the controller connection or the agent heartbeat pipe closes, and the
kernel kills it when the agent dies (PR_SET_PDEATHSIG), so it never outlives its supervisors.

With survival on (``grace_s`` > 0: its agent outlives a lost controller, ``runtime.orphan``) a
lost controller connection does not end the worker: what it sends (results, journal events) is
kept, in order, until its agent says where the next controller is (a line on the heartbeat
socketpair); it then drops the old connection (even one still open: a stopped old controller),
dials the new one, says which calls it has not answered (``HelloWorker.open_calls``) and waits
for its ``Welcome``: a controller whose epoch is below the highest seen is dropped. Then it sends
again the events it had sent that the journal lacks (numbered, ``runtime.resend``: a dead
controller loses what it never read), then what it kept. Past ``grace_s`` with no controller it
exits as before.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
import queue
import socket
import sys
import threading
import time
import traceback
from dataclasses import replace
from typing import Any

from runtime import actor as actor_mod
from runtime.channel import ChannelError, Connection, FrameError, connect, encode
from runtime.messages import (
    WORKER_STARTED,
    CallEndpoint,
    Event,
    HelloWorker,
    Result,
    SpawnActor,
    SysCall,
    Welcome,
)
from runtime.orphan import parse_redial
from runtime.resend import Retained, first_welcome

log = logging.getLogger(__name__)

EXIT_ORPHANED = 70  # the controller or agent went away
EXIT_ACTOR_CRASHED = 71  # a supervised endpoint raised (see runtime.actor.endpoint)
#: Bytes of journal events kept while no controller is connected; past it new events are
#: dropped (results never are): minutes of a training loop's events, far past any grace.
MAX_KEPT_BYTES = 64 << 20


def _heartbeat_loop(sock: socket.socket, interval_s: float) -> None:
    while True:
        try:
            sock.send(b".")
        except OSError:
            os._exit(EXIT_ORPHANED)  # the agent is gone
        time.sleep(interval_s)


def _error_payload(exc: BaseException) -> tuple[str, str, str]:
    return type(exc).__name__, str(exc), traceback.format_exc()


def worker_main(
    *,
    proc_id: str,
    coords: dict[str, int],
    controller_addr: tuple[str, int],
    secret: bytes,
    heartbeat_sock: socket.socket,
    heartbeat_interval_s: float,
    connect_timeout_s: float,
    host_address: str = "127.0.0.1",
    start_heartbeat: bool = True,
    grace_s: float = 0.0,
    epoch: int = 0,
) -> None:
    """Serve actors until told to stop; never returns normally (the caller ``os._exit``s)."""
    if start_heartbeat:
        threading.Thread(
            target=_heartbeat_loop,
            args=(heartbeat_sock, heartbeat_interval_s),
            daemon=True,
            name="ftharness-heartbeat",
        ).start()

    global _link
    link = _link = _Link(grace_s, epoch)
    running: dict[int, tuple[str, str]] = {}  # call id -> (actor, method): not answered yet
    outbox = _Outbox(link, running)
    ctx = actor_mod.WorkerContext(proc_id, coords, outbox.put, host_address)
    actor_mod._set_context(ctx)
    inbox: queue.Queue[SpawnActor | CallEndpoint] = queue.Queue()

    def reply(call_id: int, ok: bool, value: Any) -> None:
        try:
            outbox.put(Result(call_id, ok, value), call_id)
        except Exception as exc:  # the value did not pickle, or is over the frame limit
            outbox.put(Result(call_id, False, ("UnsendableResult", repr(exc)[:2000], "")), call_id)

    def run_sys(call: SysCall) -> None:
        try:
            reply(call.call_id, True, actor_mod.resolve(call.func)(*call.args))
        except Exception as exc:
            reply(call.call_id, False, _error_payload(exc))

    def receive(conn: Connection) -> None:
        while True:
            try:
                msg = conn.recv()
            except ChannelError as exc:
                if isinstance(exc, FrameError):
                    log.error("worker %s: bad frame from the controller: %s", proc_id, exc)
                link.lost(conn)  # exits, unless the worker survives its controller
                return
            if not link.is_current(conn):
                return  # a connection this worker left: obey nothing more from it
            match msg:
                case Welcome(epoch):
                    if not link.welcome(conn, epoch):
                        return
                case SysCall():
                    with link.lock:
                        running[msg.call_id] = ("", msg.func)
                    threading.Thread(target=run_sys, args=(msg,), daemon=True).start()
                case SpawnActor() | CallEndpoint():
                    with link.lock:
                        running[msg.call_id] = _endpoint(msg)
                    inbox.put(msg)
                case _:
                    # A bug on the controller's side, never silent: say so, and refuse it.
                    log.error("worker %s: malformed message %r", proc_id, msg)
                    call_id = getattr(msg, "call_id", None)
                    if isinstance(call_id, int):
                        reply(call_id, False, ("ValueError", f"malformed message {msg!r:.80}", ""))

    def dial(address: tuple[str, int], hello: HelloWorker, redial: bool = False) -> None:
        conn: Connection | None = None
        try:
            conn = connect(address, secret, connect_timeout_s)
            conn.send(hello)  # the first frame, before anything the outbox kept
            # Re-dialling, nothing else is sent before the Welcome: it says which of the events
            # sent before the journal lacks, and those go first (runtime.resend).
            welcome = first_welcome(conn, 2 * connect_timeout_s) if redial else None
        except ChannelError as exc:
            if conn is not None:
                conn.close()
            if not link.survive:
                raise
            log.warning("worker %s: cannot reach the controller at %s: %s", proc_id, address, exc)
            link.lost(None)
            return
        if welcome is not None and not link.welcome(conn, welcome.epoch):
            conn.close()
            return
        link.attach(conn, welcome.resend_after if welcome is not None else -1)
        if welcome is not None:
            outbox.resend_now()
        threading.Thread(
            target=receive, args=(conn,), daemon=True, name="ftharness-receiver"
        ).start()

    def redial(address: tuple[str, int], epoch: int) -> None:
        """The agent says the controller of ``epoch`` serves now: leave ours, dial that one."""
        served = link.epoch
        if not link.leave_for(epoch):
            return
        with link.lock:
            calls = tuple((cid, actor, method) for cid, (actor, method) in running.items())
        hello = HelloWorker(proc_id, os.getpid(), max(served, 1), dict(ctx.coords), calls)
        dial(address, hello, redial=True)

    dial(controller_addr, HelloWorker(proc_id, os.getpid()))
    if link.survive:
        threading.Thread(
            target=_agent_lines, args=(heartbeat_sock, redial), daemon=True, name="ftharness-agent"
        ).start()

    while True:
        msg = inbox.get()
        try:
            reply(msg.call_id, True, _serve(ctx, proc_id, msg))
        except Exception as exc:
            reply(msg.call_id, False, _error_payload(exc))
            if isinstance(msg, CallEndpoint) and _supervised(ctx, msg):
                # Let it crash: the error went to the caller, and the process exits so that its
                # supervisor gets a failure value (cause "exception") with this traceback.
                sys.stderr.write(traceback.format_exc())
                sys.stderr.flush()
                outbox.flush(connect_timeout_s)
                os._exit(EXIT_ACTOR_CRASHED)


def _endpoint(msg: SpawnActor | CallEndpoint) -> tuple[str, str]:
    if isinstance(msg, SpawnActor):
        return msg.name, "__init__"
    return msg.actor, msg.method


def _agent_lines(sock: socket.socket, redial: Any) -> None:
    """Read what the agent says on the heartbeat socketpair: re-dial lines (runtime.orphan)."""
    buf = b""
    while True:
        try:
            data = sock.recv(4096)
        except OSError:
            data = b""
        if not data:
            os._exit(EXIT_ORPHANED)  # the agent is gone
        buf += data
        while b"\n" in buf:
            line, buf = buf.split(b"\n", 1)
            parsed = parse_redial(line)
            if parsed is None:
                log.error("worker: malformed line from the agent: %r", line[:80])
                continue
            try:
                redial(*parsed)
            except Exception:  # never this thread: the next line may work
                log.exception("worker: re-dialling %s failed", parsed[0])


#: This process's link to its controller, once :func:`worker_main` runs (None in any other).
_link: _Link | None = None


def controller_survivable() -> bool:
    """Whether this worker outlives a lost controller (``grace_s`` > 0: its job can be taken
    over by a new controller, whose quorum service then restarts under the trainer)."""
    return _link is not None and _link.survive


class _Link:
    """The worker's connection to the controller it obeys, and the highest epoch it has seen.

    Without survival a lost connection ends the worker (:meth:`lost` exits), as it always did.
    With it, :meth:`lost` starts the grace period instead; :meth:`attach` ends it."""

    def __init__(self, grace_s: float, epoch: int) -> None:
        self.lock = threading.Condition()
        self.conn: Connection | None = None
        self.epoch = epoch
        self.grace_s = grace_s
        self.survive = grace_s > 0
        self.lost_at: float | None = None
        self.resend_after = -1  # the current connection's Welcome.resend_after

    def is_current(self, conn: Connection) -> bool:
        with self.lock:
            return self.conn is conn

    def attach(self, conn: Connection, resend_after: int = -1) -> None:
        with self.lock:
            self.conn, self.lost_at, self.resend_after = conn, None, resend_after
            self.lock.notify_all()

    def welcome(self, conn: Connection, epoch: int) -> bool:
        """The controller's epoch: False (and the connection dropped) if below one seen."""
        with self.lock:
            if epoch >= self.epoch:
                self.epoch = epoch
                return True
        log.error("worker: a controller of epoch %d after one of %d: dropped", epoch, self.epoch)
        self.lost(conn)
        return False

    def leave_for(self, epoch: int) -> bool:
        """Drop the current connection for a controller of ``epoch``; False if that is no
        newer than the one served now (nothing changes)."""
        with self.lock:
            old = self.conn
            if old is not None and epoch <= self.epoch:
                return False
            self.epoch = max(self.epoch, epoch)
        if old is not None:
            self.lost(old)
        return True

    def lost(self, conn: Connection | None) -> None:
        """``conn`` (None: the first dial) failed or was left: exit, or keep going for grace_s."""
        if not self.survive:
            os._exit(EXIT_ORPHANED)  # the controller is gone: do not outlive it
        with self.lock:
            if conn is not None and conn is not self.conn:
                return
            self.conn = None
            if self.lost_at is None:
                self.lost_at = time.monotonic()
                timer = threading.Timer(self.grace_s, self._expire, (self.lost_at,))
                timer.daemon = True
                timer.start()
        if conn is not None:
            with contextlib.suppress(OSError):
                conn.sock.shutdown(socket.SHUT_RDWR)  # wakes a send blocked on a stopped peer
            conn.close()

    def _expire(self, lost_at: float) -> None:
        with self.lock:
            if self.lost_at == lost_at and self.conn is None:
                log.error(
                    "worker: no controller for %g s (controller_grace_s): exiting", self.grace_s
                )
                os._exit(EXIT_ORPHANED)

    def wait(self) -> tuple[Connection, int]:
        """The connection to send on, waiting while there is none, and its resend mark."""
        with self.lock:
            while self.conn is None:
                self.lock.wait()
            return self.conn, self.resend_after


class _Outbox:
    """Everything the worker sends, in order, through one sender thread. ``put`` encodes on the
    caller's thread (so an unpicklable or oversized message is the caller's error) and never
    blocks on the socket: a stopped (SIGSTOPped) controller must not stop training, which
    emits a journal event every step. If the controller is gone, the worker exits, or, with
    survival on, the frames wait for the next controller (events beyond MAX_KEPT_BYTES are
    dropped). A call stays open (``running``) until its result is sent.

    Events are numbered (``Event.seq``) in the order they are queued, so sent in that order;
    with survival on, those sent are kept (``runtime.resend.Retained``), and on a new
    connection the ones past its ``resend_after`` go first, while queued ones at or below it
    are not sent (the journal has them)."""

    def __init__(self, link: _Link, running: dict[int, tuple[str, str]]) -> None:
        self._link = link
        self._running = running
        self._frames: queue.SimpleQueue[tuple[bytes | None, int | None, int] | threading.Event] = (
            queue.SimpleQueue()
        )
        self._queued = 0  # bytes put and not sent yet
        self.dropped = 0
        self._order = threading.Lock()  # events are numbered in the order they are queued
        self._seq = 0  # the last event's number
        self._retained = Retained()  # the sender thread's alone
        self._conn: Connection | None = None  # the last connection the sender used
        threading.Thread(target=self._run, daemon=True, name="ftharness-sender").start()

    def put(self, message: Any, call_id: int | None = None) -> None:
        if not isinstance(message, Event):
            self._enqueue(encode(message), call_id, 0)
            return
        with self._order:
            seq = self._seq + 1
            if self._enqueue(encode(replace(message, seq=seq)), None, seq):
                self._seq = seq

    def _enqueue(self, data: bytes, call_id: int | None, seq: int) -> bool:
        with self._link.lock:
            if seq and self._queued > MAX_KEPT_BYTES:
                self.dropped += 1
                return False
            self._queued += len(data)
        self._frames.put((data, call_id, seq))
        return True

    def flush(self, timeout_s: float) -> None:
        """Wait until everything put so far has been handed to the kernel."""
        sent = threading.Event()
        self._frames.put(sent)
        sent.wait(timeout_s)

    def resend_now(self) -> None:
        """A new connection is attached: send it what it lacks without waiting for a frame."""
        self._frames.put((None, None, 0))

    def _deliver(self, data: bytes | None, seq: int) -> None:
        while True:
            conn, mark = self._link.wait()
            try:
                if conn is not self._conn:  # a new controller: first what it lacks
                    for payload in self._retained.after(mark) if mark >= 0 else ():
                        conn.send_encoded(payload)
                    self._conn = conn
                if data is not None and not 0 < seq <= mark:  # else the journal has it
                    conn.send_encoded(data)
                    if seq and self._link.survive:
                        self._retained.keep(seq, data)
                return
            except ChannelError:
                self._link.lost(conn)  # exits, unless the worker survives its controller

    def _run(self) -> None:
        while True:
            item = self._frames.get()
            if isinstance(item, threading.Event):
                item.set()
                continue
            data, call_id, seq = item
            self._deliver(data, seq)
            with self._link.lock:
                self._queued -= len(data or b"")
                if call_id is not None:
                    self._running.pop(call_id, None)


def _serve(ctx: actor_mod.WorkerContext, proc_id: str, msg: SpawnActor | CallEndpoint) -> Any:
    """Run one request on the main thread; its return value is the reply."""
    if isinstance(msg, SpawnActor):
        cls = msg.cls
        if not (isinstance(cls, type) and issubclass(cls, actor_mod.Actor)):
            raise TypeError(f"{cls!r} is not an Actor subclass")
        instance = cls.__new__(cls)
        instance.actor_name = msg.name
        ctx.actors[msg.name] = instance
        try:
            cls.__init__(instance, *msg.args, **msg.kwargs)  # what instance.__init__ would call
        except BaseException:
            del ctx.actors[msg.name]
            raise
        return None
    target = ctx.actors.get(msg.actor)
    if target is None:
        raise LookupError(f"no actor named {msg.actor!r} in {proc_id}")
    if msg.method not in actor_mod.endpoints_of(type(target)):
        raise AttributeError(f"{type(target).__name__}.{msg.method} is not an endpoint")
    return getattr(target, msg.method)(*msg.args, **msg.kwargs)


def _supervised(ctx: actor_mod.WorkerContext, msg: CallEndpoint) -> bool:
    target = ctx.actors.get(msg.actor)
    return target is not None and actor_mod.is_supervised(type(target), msg.method)


def main() -> None:
    """A cold worker (``python -m runtime.worker``): exec'd by the agent with its config on
    stdin; imports its preload modules itself, then serves like a forked worker."""
    import json

    cfg = json.loads(sys.stdin.readline())
    for path in reversed(cfg["sys_path"]):
        if path not in sys.path:
            sys.path.insert(0, path)
    hb = socket.socket(fileno=cfg["heartbeat_fd"])
    threading.Thread(
        target=_heartbeat_loop, args=(hb, cfg["heartbeat_interval_s"]), daemon=True
    ).start()  # beat while the imports run: a slow import is not a hang
    for mod in cfg["preload"]:
        importlib.import_module(mod)
    hb.send(WORKER_STARTED)
    worker_main(
        proc_id=cfg["proc_id"],
        coords=cfg["coords"],
        controller_addr=tuple(cfg["controller"]),
        secret=bytes.fromhex(cfg["secret"]),
        heartbeat_sock=hb,
        heartbeat_interval_s=cfg["heartbeat_interval_s"],
        connect_timeout_s=cfg["connect_timeout_s"],
        host_address=cfg["host_address"],
        start_heartbeat=False,
        grace_s=float(cfg.get("grace_s", 0.0)),
        epoch=int(cfg.get("epoch", 0)),
    )


if __name__ == "__main__":
    main()
