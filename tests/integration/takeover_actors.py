"""Actors of the controller takeover tests (importable inside worker processes)."""

from __future__ import annotations

import os
import time

from runtime.actor import Actor, current_context, endpoint


class Ticker(Actor):
    """A stand-in for a training loop: one journal event every ``interval_s`` for ``seconds``,
    then a value; it runs on while its controller is replaced."""

    @endpoint
    def run(self, seconds: float, interval_s: float) -> dict:
        ctx = current_context()
        ticks = 0
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            ctx.emit("tick", {"i": ticks, "pid": os.getpid(), "proc": ctx.proc_id})
            ticks += 1
            time.sleep(interval_s)
        return {"ticks": ticks, "pid": os.getpid()}

    @endpoint
    def pid(self) -> int:
        return os.getpid()


def obey(path: str, epoch: int) -> int:
    """A command of a controller, run in a worker: one line per command obeyed (the test counts
    those an old controller got obeyed after it was replaced)."""
    with open(path, "a") as fh:
        fh.write(f"{epoch} {time.time():.6f} {os.getpid()}\n")
    return os.getpid()
