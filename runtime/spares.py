"""Warm spares: idle workers kept forked and connected on a host, adopted by a mesh instead of
forking, and replaced in the background once used or dead.

A pool knows only its records and three callables the controller gives it, so that it holds
no reference to the controller's internals:

* ``fork(n, log_dir)``: request ``n`` idle workers on the host; returns their records at once
  (each with a ``ready`` future that resolves when it has connected);
* ``adopt(rec, coords, owner)``: give an idle worker its mesh coordinates and owner; False if it
  died while idle;
* ``stop(recs)``: stop surplus workers.

Not guaranteed: a spare is a forked copy of the agent's warm interpreter; it has imported the
preload modules, but nothing else (no model is built until an actor is spawned on it).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from typing import Any

from runtime.states import ProcState


class SparePool:
    def __init__(
        self,
        fork: Callable[[int, str | None], list[Any]],
        adopt: Callable[[Any, dict[str, int], Any], bool],
        stop: Callable[[list[Any]], None],
        *,
        spawn_timeout_s: float,
    ) -> None:
        self._fork, self._adopt, self._stop = fork, adopt, stop
        self._spawn_timeout_s = spawn_timeout_s
        self._lock = threading.Lock()
        self.wanted = 0
        self.idle: list[Any] = []  # connected, idle, ready to be adopted
        self.starting = 0
        self.log_dir: str | None = None
        self.closed = False

    def keep(self, n: int, log_dir: str | None = None) -> None:
        """Keep ``n`` idle workers; returns once the first ``n`` are ready."""
        if n < 0:
            raise ValueError(f"spares must be >= 0, got {n}")
        with self._lock:
            self.wanted, self.log_dir = n, log_dir
            surplus, self.idle = self.idle[n:], self.idle[:n]
        self._stop(surplus)
        self.replenish(wait=True)

    def take(self, coords: dict[str, int], owner: Any) -> Any | None:
        """An idle worker adopted for ``coords`` and ``owner``, or None if none is left."""
        while True:
            with self._lock:
                if not self.idle:
                    return None
                rec = self.idle.pop(0)
            if rec.state is ProcState.RUNNING and self._adopt(rec, coords, owner):
                return rec

    def add_idle(self, rec: Any) -> None:
        """An idle worker this pool did not fork (a takeover inherited it): adoptable too."""
        with self._lock:
            if rec not in self.idle:
                self.idle.append(rec)

    def forget(self, rec: Any) -> None:
        """An idle spare failed: it is no longer available."""
        with self._lock, contextlib.suppress(ValueError):
            self.idle.remove(rec)

    def replenish(self, wait: bool = False) -> None:
        """Fork what is missing (in the caller's thread; the controller calls this from its
        spawner thread, never on a restart's critical path)."""
        with self._lock:
            missing = self.wanted - len(self.idle) - self.starting
            if missing <= 0 or self.closed:
                return
            self.starting += missing
        try:
            recs = self._fork(missing, self.log_dir)
        except Exception:
            with self._lock:
                self.starting -= missing
            raise
        for rec in recs:
            rec.ready.add_done_callback(lambda fut, rec=rec: self._ready(rec, fut))
        if wait:
            for rec in recs:
                with contextlib.suppress(Exception):
                    rec.ready.result(timeout=self._spawn_timeout_s)

    def _ready(self, rec: Any, fut: Any) -> None:
        with self._lock:
            self.starting -= 1
            if fut.exception() is None and rec.state is ProcState.RUNNING:
                self.idle.append(rec)
