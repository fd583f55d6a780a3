"""Actors used by the runtime's integration tests (importable inside worker processes)."""

from __future__ import annotations

import ctypes
import os
import signal
import threading
import time

from runtime.actor import Actor, endpoint


class Echo(Actor):
    def __init__(self, tag: str = "") -> None:
        self.tag = tag
        self.calls = 0

    @endpoint
    def ping(self, x: int = 0) -> dict:
        self.calls += 1
        return {"x": x, "coords": self.coords, "pid": os.getpid(), "tag": self.tag}

    @endpoint
    def noop(self) -> None:
        return None

    @endpoint
    def pid(self) -> int:
        return os.getpid()

    @endpoint
    def sleep(self, seconds: float) -> None:
        time.sleep(seconds)

    @endpoint
    def boom(self) -> None:
        raise ValueError("boom from the actor")

    @endpoint
    def die(self, how: str) -> None:
        if how == "sigkill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif how == "segfault":
            ctypes.string_at(0)  # a real null read: SIGSEGV
        elif how == "exit3":
            os._exit(3)

    @endpoint
    def hold_gil(self, seconds: float) -> None:
        """Hold the GIL inside a C call (PyDLL does not release it) from a background thread."""

        def hold() -> None:
            ctypes.PyDLL(None).sleep(int(seconds))

        threading.Thread(target=hold, daemon=True).start()
        time.sleep(0.05)

    @endpoint
    def spawn_child(self) -> int:
        """Start a grandchild process (to check that nothing outlives its supervisor)."""
        import subprocess

        return subprocess.Popen(["sleep", "300"]).pid


class Broken(Actor):
    def __init__(self) -> None:
        raise RuntimeError("constructor failed")


class Supervised(Actor):
    """An actor with a long-running supervised endpoint (like a training loop)."""

    @endpoint(supervised=True)
    def run(self, fail: bool) -> str:
        if fail:
            raise RuntimeError("the loop gave up")
        return "done"

    @endpoint
    def pid(self) -> int:
        return os.getpid()

    @endpoint
    def reply_of(self, nbytes: int) -> bytes:
        """A reply of ``nbytes`` (over the channel's frame limit when large)."""
        return b"x" * nbytes


class Chatter(Actor):
    """Emits a journal event per iteration, like a trainer per step, and counts iterations in a
    file so that a test can see progress without asking the controller."""

    @endpoint
    def chatter(self, path: str, seconds: float) -> int:
        n = 0
        deadline = time.monotonic() + seconds
        payload = "y" * 20000  # fills a stopped reader's socket buffers within a second
        while time.monotonic() < deadline:
            self.emit("test.chatter", n=n, payload=payload)
            n += 1
            if n % 50 == 0:  # whole or not at all: a reader must never see it truncated
                with open(path + ".tmp", "w") as f:
                    f.write(str(n))
                os.replace(path + ".tmp", path)
            time.sleep(0.001)
        return n


#: Set by :func:`warm` in a host agent before it forks (``ControllerSpec.warmup``).
WARMED: dict = {}


def warm(value: int) -> None:
    WARMED["value"] = value
    WARMED["pid"] = os.getpid()


class WarmReader(Actor):
    @endpoint
    def warmed(self) -> dict:
        return {**WARMED, "ppid": os.getppid()}
