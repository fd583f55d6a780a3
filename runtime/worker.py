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
import threading
import time
import traceback
from typing import Any

from runtime import actor as actor_mod
from runtime.channel import ChannelError, connect

log = logging.getLogger(__name__)

EXIT_ORPHANED = 70  # the controller or agent went away


def _resolve(path: str) -> Any:
    module, _, attr = path.partition(":")
    obj: Any = importlib.import_module(module)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


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
    ctx = actor_mod.WorkerContext(proc_id, coords, conn.send)
    actor_mod._set_context(ctx)
    inbox: queue.Queue[Any] = queue.Queue()

    def reply(call_id: int, ok: bool, value: Any) -> None:
        try:
            conn.send(("result", call_id, ok, value))
        except ChannelError:
            os._exit(EXIT_ORPHANED)
        except Exception as exc:  # the value did not pickle
            conn.send(("result", call_id, False, ("PicklingError", repr(exc), "")))

    def run_sys(call_id: int, func: str, args: tuple[Any, ...]) -> None:
        try:
            reply(call_id, True, _resolve(func)(*args))
        except Exception as exc:
            reply(call_id, False, _error_payload(exc))

    def receive() -> None:
        while True:
            try:
                msg = conn.recv()
            except ChannelError:
                os._exit(EXIT_ORPHANED)  # the controller is gone: do not outlive it
            kind = msg[0]
            if kind == "sys":
                _, call_id, func, args = msg
                threading.Thread(target=run_sys, args=(call_id, func, args), daemon=True).start()
            elif kind == "stop":
                os._exit(0)
            else:
                inbox.put(msg)

    threading.Thread(target=receive, daemon=True, name="ftharness-receiver").start()
    conn.send(("hello_worker", proc_id, os.getpid()))

    while True:
        msg = inbox.get()
        kind, call_id = msg[0], msg[1]
        try:
            if kind == "spawn_actor":
                _, _, name, cls, args, kwargs = msg
                if not (isinstance(cls, type) and issubclass(cls, actor_mod.Actor)):
                    raise TypeError(f"{cls!r} is not an Actor subclass")
                instance = cls.__new__(cls)
                instance.actor_name = name
                ctx.actors[name] = instance
                try:
                    instance.__init__(*args, **kwargs)
                except BaseException:
                    del ctx.actors[name]
                    raise
                reply(call_id, True, None)
            elif kind == "call":
                _, _, name, method, args, kwargs = msg
                target = ctx.actors.get(name)
                if target is None:
                    raise LookupError(f"no actor named {name!r} in {proc_id}")
                if method not in actor_mod.endpoints_of(type(target)):
                    raise AttributeError(f"{type(target).__name__}.{method} is not an endpoint")
                reply(call_id, True, getattr(target, method)(*args, **kwargs))
            else:
                raise ValueError(f"unknown message kind {kind!r}")
        except Exception as exc:
            reply(call_id, False, _error_payload(exc))


def main() -> None:
    """A cold worker (``python -m runtime.worker``): exec'd by the agent with its config on
    stdin; imports its preload modules itself, then serves like a forked worker."""
    import json
    import sys

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
    worker_main(
        proc_id=cfg["proc_id"],
        coords=cfg["coords"],
        controller_addr=tuple(cfg["controller"]),
        secret=bytes.fromhex(cfg["secret"]),
        heartbeat_sock=hb,
        heartbeat_interval_s=cfg["heartbeat_interval_s"],
        connect_timeout_s=cfg["connect_timeout_s"],
        start_heartbeat=False,
    )


if __name__ == "__main__":
    main()
