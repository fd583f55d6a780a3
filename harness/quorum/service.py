"""The quorum service, behind one interface: the job holds a :class:`QuorumService` and never asks
which one it is.

Two implementations, chosen by ``recovery.quorum`` in ``harness.quorum.backends`` (the one
place that reads it):

* ``"tree"`` (:class:`TreeQuorumService`, the default): ``harness.quorum.tree`` serving torchft's
  Lighthouse protocol from the controller's process. It admits only the incarnations the job
  starts (:meth:`QuorumService.admit` hands out each one's member id), fences a failed group the
  moment the supervision tree reports it (:meth:`QuorumService.fence`), and a crash of it is a
  restart in place that keeps its state (the quorum ids go on).
* ``"torchft"`` (:class:`LighthouseService`): torchft's own Lighthouse in a supervised worker
  process (``harness.quorum.lighthouse``), restarted on its port by its supervisor. It admits any
  id that reaches its port, fences by heartbeat timeout only, and numbers quorums from 1 again
  after a restart.

The job tells a service what it needs through :class:`QuorumEvents` and nothing else.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Protocol

from harness.config import JobConfig

if TYPE_CHECKING:
    from harness.quorum.tree import TreeQuorum
    from runtime.mesh import ActorMesh


class QuorumEvents(Protocol):
    """What a quorum service tells the job (called from the service's own threads)."""

    def quorum_ids_reset(self) -> None:
        """A restarted service is about to serve and numbers its quorums from the start again
        (a quorum tap in front of it must continue the ids it handed out)."""

    def quorum_restarted(self) -> None:
        """A service that crashed serves again (the recovery of the quorum service ends)."""

    def ask_for_quorum(self) -> None:
        """A new member waits in a round: every group that skips quorums (sparse quorum) must
        ask for one. Called with the service's lock held: it must not block."""


class QuorumService(Protocol):
    """Per-step membership for the job's replica groups. ``address`` is what the Managers get
    as their Lighthouse (``http://host:port``; empty until the service serves)."""

    @property
    def address(self) -> str: ...

    def start(self) -> None:
        """Serve, if the service lives in this process (a supervised one starts as the child
        :meth:`supervised_child` returns)."""

    def supervised_child(self) -> Callable[[], ActorMesh] | None:
        """The start function of the service's process, for the job's supervision tree to
        supervise (and restart), or None if it runs in this process."""

    def admit(self, replica: int, incarnation: int) -> str | None:
        """Incarnation ``incarnation`` of group ``replica`` is starting: the replica id its
        Managers must use (every older incarnation is refused from now on), or None if the
        service does not name its members."""

    def fence(self, replica: int, ids: Iterable[str] = ()) -> None:
        """Group ``replica`` is dead: drop it (and its Managers' ``ids`` that do not follow the
        service's naming) from membership now, so the survivors do not wait for it."""

    def job_restarted(self) -> None:
        """The whole job resumes from a checkpoint: committed steps may go back to it."""

    def mesh(self) -> ActorMesh | None:
        """The process a fault aimed at the quorum service targets (None: the controller's)."""

    def crash(self) -> None:
        """A fault: the service dies and comes back as it would after a real crash."""

    def shutdown(self) -> None:
        """Stop serving (the job is over). Idempotent."""


class TreeQuorumService:
    """``harness.quorum.tree.TreeQuorum`` in this process, as a :class:`QuorumService`."""

    def __init__(self, cfg: JobConfig, events: QuorumEvents) -> None:
        self.cfg = cfg
        self._events = events
        self._tree: TreeQuorum | None = None
        self._lock = threading.Lock()

    @property
    def tree(self) -> TreeQuorum:
        if self._tree is None:
            raise RuntimeError("the tree quorum has not started")
        return self._tree

    @property
    def address(self) -> str:
        return self._tree.address if self._tree is not None else ""

    def start(self, port: int = 0) -> None:
        from harness.quorum.tree import TreeQuorum

        cfg, t = self.cfg, self.cfg.timeouts
        old = self._tree  # a restart keeps the job's secret: the running members stay admitted
        self._tree = TreeQuorum(
            bind_host=cfg.bind_host,
            port=port,
            min_replicas=cfg.min_replica_size,
            join_timeout_s=t.lighthouse_join_timeout,
            heartbeat_timeout_s=t.lighthouse_heartbeat_timeout,
            max_step=cfg.steps // cfg.program.steps_per_quorum,  # Manager steps (syncs)
            # each waiting quorum request holds a server thread: room for every group's request
            # and heartbeat, with margin (the service's docstring)
            max_requests=max(64, 4 * cfg.replicas + 16),
            secret=old.secret if old is not None else None,
            incarnations=old.incarnations if old is not None else None,
            highest_step=old.highest_step if old is not None else -1,
            reported=old.reported if old is not None else None,
            quorum_id=old.quorum_id + 1 if old is not None else 0,
            on_newcomer=self._newcomer if cfg.quorum_every() > 1 else None,
            # every group in the first step (rule.QuorumOpts), bounded well inside a trainer's
            # own quorum timeout so that no request times out waiting for a group that is late
            first_quorum_replicas=cfg.replicas,
            first_quorum_timeout_s=t.quorum_timeout / 2,
        )

    def _newcomer(self, replica_id: str) -> None:
        self._events.ask_for_quorum()

    def supervised_child(self) -> None:
        return None

    def admit(self, replica: int, incarnation: int) -> str:
        return self.tree.admit(replica, incarnation)

    def fence(self, replica: int, ids: Iterable[str] = ()) -> None:
        self.tree.replica_failed(replica, ids)

    def job_restarted(self) -> None:
        self.tree.job_restarted()

    def mesh(self) -> None:
        return None

    def crash(self) -> None:
        """Lose every piece of state a crash loses and come back on the same port, as a
        restarted Lighthouse would; the job's secret, the admitted incarnations and the quorum
        ids go on (the controller holds them), so committed steps never go back."""
        with self._lock:
            port = int(self.tree.address.rsplit(":", 1)[1])
            self.tree.shutdown()
            self.start(port)
        self._events.quorum_restarted()

    def shutdown(self) -> None:
        if self._tree is not None:
            self._tree.shutdown()
