"""Hosts: a host agent as the controller sees it, and how a local one is started.

A host is an agent process (``runtime.agent``) plus the authenticated connection the controller
holds to it. Today every agent is started here as a child process of the controller
(:func:`start_local_agent`, the embedded default); where hosts come from is the seam later
launchers (network namespaces, SLURM) plug into.
"""

from __future__ import annotations

import itertools
import json
import os
import select
import subprocess
import sys
import time
from collections.abc import Mapping
from typing import Any, Protocol

from runtime import channel, process
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

    def __init__(self, spawner: _Spawner, name: str, pool: SparePool) -> None:
        self._spawner = spawner
        self.name = name
        self.popen: subprocess.Popen | None = None
        self.conn: channel.Connection | None = None
        self.address: tuple[str, int] | None = None
        self.last_beat = time.monotonic()
        self.lost = False
        self.pool = pool
        self._n = itertools.count()

    def next_proc_id(self) -> str:
        return f"{self.name}/p{next(self._n)}"

    @property
    def pid(self) -> int:
        assert self.popen is not None
        return self.popen.pid

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

    def kill(self) -> None:
        """SIGKILL the agent and every process under it at once (a host eviction)."""
        if self.popen is not None:
            process.signal_all(process.tree(self.popen.pid), 9)


def start_local_agent(
    name: str, cfg: Mapping[str, Any], startup_timeout_s: float
) -> tuple[subprocess.Popen, int]:
    """Start ``python -m runtime.agent`` as a child process. Its configuration, the job secret
    included, goes in on stdin (never argv, which other users can read); the agent answers
    ``PORT <n>`` on stdout once it listens. Returns the process and the port."""
    popen = subprocess.Popen(
        [sys.executable, "-m", "runtime.agent"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        cwd=os.getcwd(),
    )
    assert popen.stdin is not None and popen.stdout is not None
    popen.stdin.write((json.dumps({**cfg, "host": name}) + "\n").encode())
    popen.stdin.close()
    ready, _, _ = select.select([popen.stdout], [], [], startup_timeout_s)
    line = popen.stdout.readline().decode() if ready else ""
    if not line.startswith("PORT "):
        popen.kill()
        raise channel.ChannelError(
            f"host agent {name} did not start within {startup_timeout_s} s (said {line!r})"
        )
    return popen, int(line.split()[1])
