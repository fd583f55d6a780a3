"""torchft's own Lighthouse as the job's quorum service (``recovery.quorum = "torchft"``): a
supervised worker process that the job's tree restarts on the same port.

Not guaranteed: torchft's Lighthouse (Rust) admits any replica id that reaches its port (it binds an
address and nothing more can be asked of it), fences a dead group only by heartbeat
timeout, and numbers its quorums from 1 again after a restart (the job's quorum tap continues
them for a program: ``QuorumEvents.quorum_ids_reset``). ``recovery.quorum = "tree"`` admits
only the members the job started (``harness.quorum.tree``).
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import threading
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from harness.config import JobConfig, config_from_dict, config_to_dict
from harness.quorum.service import QuorumEvents
from runtime.actor import Actor, endpoint

if TYPE_CHECKING:
    from runtime.controller import Controller
    from runtime.host_handle import HostAgentHandle
    from runtime.mesh import ActorMesh


class LighthouseActor(Actor):
    """torchft's Lighthouse as a supervised process; a restart binds the same port.

    Not guaranteed: torchft's Lighthouse (Rust) admits any replica id that reaches its port; it
    binds an address and nothing more can be asked of it. ``recovery.quorum = "tree"``
    admits only the members the job started (``harness.quorum.tree``)."""

    def __init__(self, cfg: dict[str, Any], port: int) -> None:
        from harness.rank.torchft_glue import Lighthouse

        c = config_from_dict(cfg)
        self.lighthouse = Lighthouse(
            bind_host=_listen_address(c.bind_host),
            min_replicas=c.min_replica_size,
            timeouts=c.timeouts,
            port=port,
        )

    @endpoint
    def address(self) -> str:
        return self.lighthouse.address


def _listen_address(bind_host: str) -> str:
    """Where the Lighthouse listens: ``bind_host`` (the controller's address) where this host
    holds it, as local hosts do; else this host's advertised address, where the groups and the
    quorum tap reach it. A host with a network of its own (a namespace, another node) does not
    hold the controller's address: binding it failed there with EADDRNOTAVAIL, so
    ``quorum = "torchft"`` could not start on ``launcher = "netns"``."""
    from runtime.actor import host_address

    try:
        with socket.socket(socket.AF_INET6 if ":" in bind_host else socket.AF_INET) as s:
            s.bind((bind_host.strip("[]"), 0))
        return bind_host
    except OSError:
        return host_address(bind_host)


class LighthouseService:
    """torchft's Lighthouse in a process of its own, as a ``QuorumService``: the job's tree
    supervises :meth:`supervised_child`; each (re)start runs on ``place()``'s host and binds the
    first start's port again, so the Managers' address stays valid."""

    def __init__(
        self,
        cfg: JobConfig,
        events: QuorumEvents,
        *,
        place: Callable[[], HostAgentHandle],
        controller: Controller,
        log_dir: str,
    ) -> None:
        self.cfg = cfg
        self._controller = controller
        self._events = events
        self._place = place
        self._log_dir = log_dir
        self._lock = threading.Lock()
        self._mesh: ActorMesh | None = None
        self._port = 0
        self._address = ""
        self._starts = 0

    @property
    def address(self) -> str:
        return self._address

    def start(self) -> None:
        """Nothing here: the service starts as the job's supervised child."""

    def supervised_child(self) -> Callable[[], ActorMesh]:
        return self._start_process

    def _start_process(self) -> ActorMesh:
        restart = self._starts > 0
        if restart:
            self._events.quorum_ids_reset()  # before the new one serves
        host = self._place()
        procs = host.spawn_procs({"service": 1}, log_dir=self._log_dir)
        mesh = procs.spawn("lighthouse", LighthouseActor, config_to_dict(self.cfg), self._port)
        address = mesh.address.call_one().get(timeout=30)
        with self._lock:
            self._mesh, self._address = mesh, address
            self._port = int(address.rsplit(":", 1)[1])
            self._starts += 1
        if restart:
            self._events.quorum_restarted()
        return mesh

    def admit(self, replica: int, incarnation: int) -> None:
        return None  # torchft's Lighthouse lets in any id: the Managers name themselves

    def fence(self, replica: int, ids: Iterable[str] = ()) -> None:
        """Nothing to do: torchft's Lighthouse drops a dead group after its heartbeat timeout."""

    def job_restarted(self) -> None:
        """Nothing to do: torchft's Lighthouse keeps no committed step."""

    def mesh(self) -> ActorMesh | None:
        with self._lock:
            return self._mesh

    def crash(self) -> None:
        """SIGKILL the Lighthouse's process; its supervisor restarts it on the same port."""
        mesh = self.mesh()
        if mesh is not None:
            for proc_id in mesh.proc_ids:
                rec = self._controller.procs.get(proc_id)
                if rec is not None and rec.pid is not None:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(rec.pid, signal.SIGKILL)

    def shutdown(self) -> None:
        """Nothing here: the process stops with the job's tree."""

    def admitted(self) -> dict[int, int]:
        return {}  # torchft's Lighthouse takes any replica id

    def round_open(self) -> bool:
        return False  # not visible from outside the Lighthouse

    def live_step(self) -> int:
        return -1  # nor this: its members' steps are inside the Lighthouse
