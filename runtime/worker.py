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
"""

from __future__ import annotations

import importlib
import logging
import os
import queue
import socket
import sys
import threading
import time
import traceback
from typing import Any

from runtime import actor as actor_mod
from runtime.channel import ChannelError, Connection, FrameError, connect, encode
from runtime.messages import (
    WORKER_STARTED,
    CallEndpoint,
    HelloWorker,
    Result,
    SpawnActor,
    SysCall,
)

log = logging.getLogger(__name__)

EXIT_ORPHANED = 70  # the controller or agent went away
EXIT_ACTOR_CRASHED = 71  # a supervised endpoint raised (see runtime.actor.endpoint)


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
) -> None:
    """Serve actors until told to stop; never returns normally (the caller ``os._exit``s)."""
    if start_heartbeat:
        threading.Thread(
            target=_heartbeat_loop,
            args=(heartbeat_sock, heartbeat_interval_s),
            daemon=True,
            name="ftharness-heartbeat",
        ).start()

    conn = connect(controller_addr, secret, connect_timeout_s)
    outbox = _Outbox(conn)
    ctx = actor_mod.WorkerContext(proc_id, coords, outbox.put, host_address)
    actor_mod._set_context(ctx)
    inbox: queue.Queue[SpawnActor | CallEndpoint] = queue.Queue()

    def reply(call_id: int, ok: bool, value: Any) -> None:
        try:
            outbox.put(Result(call_id, ok, value))
        except Exception as exc:  # the value did not pickle, or is over the frame limit
            outbox.put(Result(call_id, False, ("UnsendableResult", repr(exc)[:2000], "")))

    def run_sys(call: SysCall) -> None:
        try:
            reply(call.call_id, True, actor_mod.resolve(call.func)(*call.args))
        except Exception as exc:
            reply(call.call_id, False, _error_payload(exc))

    def receive() -> None:
        while True:
            try:
                msg = conn.recv()
            except ChannelError as exc:
                if isinstance(exc, FrameError):
                    log.error("worker %s: bad frame from the controller: %s", proc_id, exc)
                os._exit(EXIT_ORPHANED)  # the controller is gone: do not outlive it
            match msg:
                case SysCall():
                    threading.Thread(target=run_sys, args=(msg,), daemon=True).start()
                case SpawnActor() | CallEndpoint():
                    inbox.put(msg)
                case _:
                    # A bug on the controller's side, never silent: say so, and refuse it.
                    log.error("worker %s: malformed message %r", proc_id, msg)
                    call_id = getattr(msg, "call_id", None)
                    if isinstance(call_id, int):
                        reply(call_id, False, ("ValueError", f"malformed message {msg!r:.80}", ""))

    threading.Thread(target=receive, daemon=True, name="ftharness-receiver").start()
    outbox.put(HelloWorker(proc_id, os.getpid()))

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


class _Outbox:
    """Everything the worker sends, in order, through one sender thread. ``put`` encodes on the
    caller's thread (so an unpicklable or oversized message is the caller's error) and never
    blocks on the socket: a stopped (SIGSTOPped) controller must not stop training, which
    emits a journal event every step. If the controller is gone, the worker exits."""

    def __init__(self, conn: Connection) -> None:
        self._conn = conn
        self._frames: queue.SimpleQueue[bytes | threading.Event] = queue.SimpleQueue()
        threading.Thread(target=self._run, daemon=True, name="ftharness-sender").start()

    def put(self, message: Any) -> None:
        self._frames.put(encode(message))

    def flush(self, timeout_s: float) -> None:
        """Wait until everything put so far has been handed to the kernel."""
        sent = threading.Event()
        self._frames.put(sent)
        sent.wait(timeout_s)

    def _run(self) -> None:
        while True:
            data = self._frames.get()
            if isinstance(data, threading.Event):
                data.set()
                continue
            try:
                self._conn.send_encoded(data)
            except ChannelError:
                os._exit(EXIT_ORPHANED)  # the controller is gone: do not outlive it


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
    )


if __name__ == "__main__":
    main()
