"""Hosts: a host agent as the controller sees it.

A host is an agent process (``runtime.agent``) that dialled in to the controller, plus that
authenticated connection. Where hosts come from is ``runtime.launchers``.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Mapping
from typing import Any, Protocol

from runtime import channel
from runtime.launchers import Launcher
from runtime.mesh import ProcMesh
from runtime.spares import SparePool


class _Spawner(Protocol):
    def spawn_many(
        self,
        requests: list[tuple[HostAgentHandle, Mapping[str, int], Mapping[str, int]]],
        *,
        log_dir: str | None = None,
        cold: bool = False,
    ) -> list[ProcMesh]: ...


class HostAgentHandle:
    """A running host agent: spawn worker meshes on it, keep warm spares, or kill it (a host
    eviction). ``lost`` is set once, when the controller declares the host lost."""

    def __init__(self, spawner: _Spawner, name: str, pool: SparePool, launcher: Launcher) -> None:
        self._spawner = spawner
        self._launcher = launcher
        self.name = name
        self.pid = 0  # the agent's pid on its own machine
        self.conn: channel.Connection | None = None
        self.address = ""  # where other hosts reach this one
        self.last_beat = time.monotonic()
        self.lost = False
        self.pool = pool
        self.proc_numbers = itertools.count()

    def next_proc_id(self) -> str:
        return f"{self.name}/p{next(self.proc_numbers)}"

    @property
    def spares(self) -> list[Any]:
        """The idle warm spares (process records) of this host."""
        return list(self.pool.idle)

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
        return self._spawner.spawn_many(
            [(self, dict(dims), dict(fixed or {}))], log_dir=log_dir, cold=cold
        )[0]

    def keep_spares(self, n: int, log_dir: str | None = None) -> None:
        """Keep ``n`` idle workers forked and connected on this host. A later (warm)
        ``spawn_procs`` adopts them instead of forking, and a used or dead spare is replaced
        in the background. Returns once the first ``n`` are ready."""
        self.pool.keep(n, log_dir)

    def kill(self) -> bool:
        """Take the whole host down at once (a host eviction), through its launcher; False if
        the launcher cannot reach it (its agent then fences itself, see runtime.agent)."""
        return self._launcher.kill(self.name)
