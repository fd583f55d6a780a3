"""ftharness's opt-in hook inside a program of the user's own (``program.hooks = true``).

ftharness puts this directory first on the program's ``PYTHONPATH``, so Python imports this
``sitecustomize`` at start-up, before the program: the program's code is unchanged. It only
installs a SIGUSR2 handler. To run an in-process fault, ftharness writes
``$FTHARNESS_HOOK_DIR/<pid>.json`` (``{"func": "faults.inworker:NAME", "args": [...]}``) and
sends SIGUSR2 to the rank; the handler (Python runs it on the main thread between two
bytecodes) reads it and runs the fault on a thread of its own. The faults mirror
``faults.inworker`` for a trainer ftharness did not write: ``segfault`` (a real SIGSEGV from a
null read), ``hold_gil`` (a thread holds the GIL in a C call), ``abort_collectives`` (every
torchft Manager in the process reports an error and aborts its process group),
``set_step_delay`` (every Manager's ``start_quorum`` sleeps first).

Imports nothing but the standard library at start-up (torchft only when a fault needs it), and
nothing of ftharness. Not guaranteed: a program that handles SIGUSR2 itself, or ships its own
``sitecustomize`` (this one shadows it), cannot take these faults; a main thread blocked in a
long C call runs the handler only when the call returns.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import json
import os
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

_delay = [0.0]


def _segfault() -> None:
    ctypes.string_at(0)


def _hold_gil(seconds: float = 3600.0, after_s: float = 0.2) -> None:
    libc = ctypes.PyDLL(ctypes.util.find_library("c") or None)
    libc.sleep.argtypes = [ctypes.c_uint]
    time.sleep(after_s)
    libc.sleep(max(1, int(seconds)))


def _managers() -> list[Any]:
    from torchft.manager import Manager

    return [o for o in gc.get_objects() if isinstance(o, Manager)]


def _abort_collectives() -> None:
    for m in _managers():
        m.report_error(RuntimeError("collectives aborted by fault injection (ftharness hook)"))
        m._pg.abort()


def _set_step_delay(seconds: float) -> None:
    from torchft.manager import Manager

    _delay[0] = float(seconds)
    if not getattr(Manager.start_quorum, "_ftharness", False):
        original = Manager.start_quorum

        def start_quorum(self: Any, *args: Any, **kwargs: Any) -> Any:
            if _delay[0] > 0:
                time.sleep(_delay[0])
            return original(self, *args, **kwargs)

        start_quorum._ftharness = True  # type: ignore[attr-defined]
        Manager.start_quorum = start_quorum


FAULTS: dict[str, Callable[..., None]] = {
    "faults.inworker:segfault": _segfault,
    "faults.inworker:hold_gil": _hold_gil,
    "faults.inworker:abort_collectives": _abort_collectives,
    "faults.inworker:set_step_delay": _set_step_delay,
}


def _on_signal(signum: int, frame: Any) -> None:
    path = os.path.join(os.environ["FTHARNESS_HOOK_DIR"], f"{os.getpid()}.json")
    try:
        with open(path, encoding="utf-8") as f:
            cmd = json.load(f)
        os.unlink(path)
        fn = FAULTS[cmd["func"]]
    except (OSError, ValueError, KeyError) as exc:
        print(f"ftharness hook: cannot run {path}: {exc!r}", flush=True)
        return
    args = cmd.get("args", [])
    threading.Thread(target=fn, args=args, name="ftharness-hook", daemon=True).start()


if os.environ.get("FTHARNESS_HOOK_DIR") and threading.current_thread() is threading.main_thread():
    signal.signal(signal.SIGUSR2, _on_signal)
