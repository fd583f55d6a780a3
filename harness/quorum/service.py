"""The quorum service, behind one interface: the job holds a :class:`QuorumService` and never asks
which one it is.

Two implementations, chosen by ``recovery.quorum`` in ``harness.quorum.backends`` (the one
place that reads it):

* ``"tree"`` (:class:`TreeQuorumService`, the default): ``harness.quorum.tree`` serving torchft's
  Lighthouse protocol from the controller's process. It admits only the incarnations the job
  starts (:meth:`QuorumService.admit` hands out each one's member id), fences a failed group the
  moment the supervision tree reports it (:meth:`QuorumService.fence`), and a crash of it is a
  restart in place that keeps its state (the quorum ids go on). Given a state file it also
  survives its controller: a new controller resumes it from the file, on a fresh port that the
  hosts' relays are pointed at, and the running Managers go on (:class:`TreeQuorumService`,
  ``harness.quorum.durable``).
* ``"torchft"`` (:class:`LighthouseService`): torchft's own Lighthouse in a supervised worker
  process (``harness.quorum.lighthouse``), restarted on its port by its supervisor. It admits any
  id that reaches its port, fences by heartbeat timeout only, and numbers quorums from 1 again
  after a restart.

The job tells a service what it needs through :class:`QuorumEvents` and nothing else.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from harness.config import JobConfig
from harness.quorum import durable
from harness.quorum.durable import Continuation

if TYPE_CHECKING:
    from harness.quorum.tree import TreeQuorum
    from runtime.mesh import ActorMesh

log = logging.getLogger(__name__)


class QuorumEvents(Protocol):
    """What a quorum service tells the job (called from the service's own threads)."""

    def quorum_ids_reset(self) -> None:
        """A restarted service is about to serve and numbers its quorums from the start again
        (a quorum tap in front of it must continue the ids it handed out)."""

    def quorum_restarted(self) -> None:
        """A service that crashed serves again, at :attr:`QuorumService.address` (the recovery
        of the quorum service ends; the hosts' relays must forward there from now on)."""

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

    def admitted(self) -> dict[int, int]:
        """Each group's newest incarnation the service admitted (empty: it does not name its
        members). A takeover restarts a group past it (``harness.job.takeover``)."""

    def round_open(self) -> bool:
        """Whether a quorum is forming now: a member asked and the round is not decided
        (False where the service cannot tell). ``controller_crash`` can wait for it."""

    def live_step(self) -> int:
        """The highest step a live (not fenced) member has reported: committed state that still
        exists, which a group started now is healed to before it trains (the service issues no
        quorum behind it, ``harness.quorum.rule``). -1: none, or a service that cannot tell."""


class TreeQuorumService:
    """``harness.quorum.tree.TreeQuorum`` in this process, as a :class:`QuorumService`.

    With ``state_path`` (a run's ``quorum.json``) it keeps there, durably, what a new controller
    needs to serve the same members again (``harness.quorum.durable`` says what, and
    why that is enough): an admission is durable before :meth:`admit` returns, the quorum-id
    lease before an id that reaches it is issued (one fsync per block of ids), the rest (the
    last quorum, the members' steps) follows from a background thread within
    ``durable.StateWriter``'s interval, so issuing a quorum waits for no disk.

    With ``resume=True`` (or :meth:`resume`) it serves what that file saved instead of starting
    anew. The file is read and checked at construction: a torn, truncated or hand-edited one
    raises :class:`~harness.quorum.durable.QuorumStateError` (naming the file and the problem)
    and nothing of it is adopted. :meth:`start` then binds a fresh port (never the saved one:
    anyone on the machine may have taken it since; the Managers reach the service through
    their hosts' relays, which the job points at the new address) and keeps the secret, the
    admitted incarnations and the fenced ids: the running Managers' next requests reach it
    and are let in, a stale incarnation is still refused. Its quorum ids continue
    from the saved lease, above every id issued before. And no step goes back: a Manager may
    have committed steps past the last one it reported (between quorums, after the last save),
    so the saved steps are lower bounds only, and the resumed service issues no quorum until
    every member it knew has joined and reported its step, or been fenced, or, past the join
    timeout, shown no sign of life (``Continuation.resumed``). Then a quorum's highest step,
    the one torchft heals everyone to, is never below a step any live member has committed.
    """

    def __init__(
        self,
        cfg: JobConfig,
        events: QuorumEvents,
        state_path: Path | None = None,
        *,
        resume: bool = False,
        caller_refusal: Callable[[str], str | None] | None = None,
    ) -> None:
        if resume and state_path is None:
            raise ValueError("resuming a tree quorum needs its state_path")
        self.cfg = cfg
        self._events = events
        self._tree: TreeQuorum | None = None
        self._lock = threading.Lock()
        self.state_path = None if state_path is None else Path(state_path)
        self._saved = durable.load(state_path) if resume and state_path is not None else None
        self._writer: durable.StateWriter | None = None
        # who may call at all (``harness.job.quorum_callers``); None: any connection
        self._caller_refusal = caller_refusal

    @classmethod
    def resume(cls, cfg: JobConfig, events: QuorumEvents, state_path: Path) -> TreeQuorumService:
        """The service saved at ``state_path``, serving again (class doc)."""
        service = cls(cfg, events, state_path, resume=True)
        service.start()
        return service

    @property
    def tree(self) -> TreeQuorum:
        if self._tree is None:
            raise RuntimeError("the tree quorum has not started")
        return self._tree

    @property
    def address(self) -> str:
        return self._tree.address if self._tree is not None else ""

    def start(self) -> None:
        old = self._tree  # a restart keeps the job's secret: the running members stay admitted
        fresh_writer = self.state_path is not None and self._writer is None
        if self.state_path is not None and self._writer is None:
            self._writer = durable.StateWriter(self.state_path, self._snapshot)
        host, state = self.cfg.bind_host, None
        if old is not None:
            state = Continuation(
                secret=old.secret,
                incarnations=old.incarnations,
                highest_step=old.highest_step,
                reported=old.reported,
                quorum_id=old.quorum_id + 1,
                quorum_id_lease=old.quorum_id_lease,
            )
        elif self._saved is not None:
            # Managers reach the service through their host agent's relay (runtime.relay,
            # harness.job.site.wants_quorum_relay), which each agent points at this service's
            # address once it serves: any free port will do. Not the saved one: between two
            # controllers anyone on the machine may have bound it, and would have been the
            # job's quorum (issue #49). The saved host if it is one of this machine's (a
            # netns job's gateway), else bind_host (SLURM: the last controller's node is lost).
            saved = self._saved
            if saved.host != host and _can_bind(saved.host):
                host = saved.host
            state = Continuation(
                secret=saved.secret,
                incarnations=saved.incarnations,
                fenced=saved.fenced,
                highest_step=saved.highest_step,
                reported=saved.reported,
                last_quorum=saved.last_quorum,
                quorum_id=saved.quorum_id_lease,  # above every id issued before
                quorum_id_lease=saved.quorum_id_lease,
                resumed=True,
            )
        try:
            self._tree = self._bind(host, state)
        except BaseException:
            if fresh_writer and self._writer is not None:
                self._writer.close(flush=False)  # nothing served: the file stays as it was
                self._writer = None
            raise
        if self._writer is not None:
            self._writer.flush()  # the file names this service before anyone learns its address

    def _bind(self, host: str, state: Continuation | None) -> TreeQuorum:
        """A TreeQuorum on a free port of ``host``, continuing from ``state`` (None: fresh)."""
        from harness.quorum.tree import TreeQuorum

        cfg, t, writer = self.cfg, self.cfg.timeouts, self._writer
        return TreeQuorum(
            bind_host=host,
            port=0,
            min_replicas=cfg.min_replica_size,
            join_timeout_s=t.lighthouse_join_timeout,
            heartbeat_timeout_s=t.lighthouse_heartbeat_timeout,
            max_step=cfg.steps // cfg.program.steps_per_quorum,  # Manager steps (syncs)
            # each waiting quorum request holds a server thread: room for every group's
            # request and heartbeat, with margin (the service's docstring)
            max_requests=max(64, 4 * cfg.replicas + 16),
            on_newcomer=self._newcomer if cfg.quorum_every() > 1 else None,
            # every group in the first step (rule.QuorumOpts), bounded well inside a
            # trainer's own quorum timeout so that no request times out waiting for a group
            # that is late
            first_quorum_replicas=cfg.replicas,
            first_quorum_timeout_s=t.quorum_timeout / 2,
            on_lease=writer.save if writer is not None else None,
            on_change=writer.changed if writer is not None else None,
            caller_refusal=self._caller_refusal,
            continues=state,
        )

    def _snapshot(self) -> durable.QuorumSnapshot | None:
        tree = self._tree
        return tree.snapshot() if tree is not None else None

    def _newcomer(self, replica_id: str) -> None:
        self._events.ask_for_quorum()

    def supervised_child(self) -> None:
        return None

    def admit(self, replica: int, incarnation: int) -> str:
        member = self.tree.admit(replica, incarnation)
        self._save()  # durable before the group starts: a resume must not let the old one in
        return member

    def fence(self, replica: int, ids: Iterable[str] = ()) -> None:
        self.tree.replica_failed(replica, ids)
        self._save()

    def job_restarted(self) -> None:
        self.tree.job_restarted()
        self._save()

    def _save(self) -> None:
        if self._writer is not None:
            self._writer.flush()

    def mesh(self) -> None:
        return None

    def crash(self) -> None:
        """Lose every piece of state a crash loses and come back, as a restarted Lighthouse
        would; the job's secret, the admitted incarnations and the quorum ids go on (the
        controller holds them), so committed steps never go back. On a fresh port: the job
        points the hosts' relays at it (``QuorumEvents.quorum_restarted``), and the old port,
        free for a moment, is nobody's to take over."""
        with self._lock:
            self.tree.shutdown()
            self.start()
        self._events.quorum_restarted()

    def shutdown(self) -> None:
        if self._tree is not None:
            self._tree.shutdown()
        if self._writer is not None:
            self._writer.close()

    def admitted(self) -> dict[int, int]:
        return self.tree.incarnations

    def round_open(self) -> bool:
        return bool(self.tree.status()["participants"])

    def live_step(self) -> int:
        return max(self.tree.reported.values(), default=-1)


def _can_bind(host: str) -> bool:
    """Whether a socket can bind ``host`` now: it is an address of this machine (of this network
    namespace)."""
    import socket

    try:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((host, 0))
        return True
    except OSError:
        return False
