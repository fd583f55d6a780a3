"""A quorum service that speaks torchft's Lighthouse gRPC protocol and also listens to the
supervision tree.

Unmodified torchft Managers use it as their ``lighthouse_addr``: it serves
``/torchft.LighthouseService/Quorum`` (a long poll: the reply comes once a quorum that includes
the requester is issued) and ``/torchft.LighthouseService/Heartbeat``, and decides with
torchft's own rule (``harness.quorum.rule``). The difference from torchft's Lighthouse is
:meth:`TreeQuorum.replica_failed`: the controller calls it as soon as its supervision tree
learns that a replica group died, and the survivors get their quorum at once instead of after
the heartbeat timeout.

Wire format and the gRPC server: ``harness.quorum.wire`` (shared with the tap).

Who gets in (torchft's Lighthouse lets in anyone who can reach its port): only members this
job started. The service holds the job's secret; :meth:`TreeQuorum.admit` names
an incarnation of a replica group (``harness.quorum.rule.member_id``: the Manager's
``replica_id`` carries an HMAC tag of the group and incarnation), and a heartbeat or quorum
request whose id has no valid tag, or belongs to an incarnation older than the newest admitted
or seen, is refused with PERMISSION_DENIED: there is no other way in (a program's own Managers,
which pick their ids themselves, reach it through ``harness.quorum.tap``, which forwards them
under the tagged id of their incarnation). So a heal source (the participant torchft picks at
the highest step) is always a member the job started.
A quorum request with an absurd step (negative, past ``max_step``, or far past every member's)
is refused with OUT_OF_RANGE. Heartbeats older than the heartbeat timeout are pruned.

Not guaranteed: the tag is a bearer token sent in clear over insecure gRPC, so anyone who can
read the job's traffic can replay it (the listener should bind a private address); it only
authenticates the quorum protocol, not torchft's ManagerServer or checkpoint servers (see
``harness.rank.torchft_glue``). Threads only (a gRPC thread pool and one ticker thread); no torch
import.
A request whose deadline passes before a quorum includes it fails with DEADLINE_EXCEEDED and
its join stays pending until the next quorum, as in torchft.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from typing import Any

import grpc

from harness.quorum import rule
from harness.quorum.durable import Continuation, QuorumSnapshot, next_lease, next_seq
from harness.quorum.wire import (
    WireError,
    decode_heartbeat_request,
    decode_quorum_request,
    encode_quorum_response,
    lighthouse_server,
)

log = logging.getLogger(__name__)

# --- the service ---------------------------------------------------------------------------------


class TreeQuorum:
    """torchft's Lighthouse rule behind torchft's Lighthouse protocol, plus
    :meth:`replica_failed`. Starts serving on construction; stop with :meth:`shutdown`.

    ``address`` (``http://host:port``) is what Managers get as ``lighthouse_addr``. Every method
    is thread-safe. ``max_requests`` bounds concurrent RPCs (each waiting quorum request holds a
    thread): keep it above twice the number of replica groups.

    Admission (module doc): :attr:`secret` is the job's (a fresh random one; a restarted service
    ``continues`` from the old one's (:class:`Continuation`), so the running members stay
    admitted and committed steps still never go back).
    Only tagged ids are let in. ``max_step``: the job's last
    step (a higher one is absurd); ``max_step_lead``: how far past the highest step seen a
    member may claim to be. ``on_newcomer(replica_id)``: called (lock held: it must not block)
    when a member that was not in the last quorum joins a round, so the controller can have the
    members that skip quorums ask for one (sparse quorum, ``harness.rank.trainer``); with it, live
    members of the last quorum are waited for past the join timeout (``QuorumOpts``).

    Durable state (``harness.quorum.durable``, which says why each piece is enough):
    :meth:`snapshot` takes it; ``on_change()`` (lock held: it must not block) is called when it
    changed (an admission, a fence, an issued quorum); ``on_lease(snapshot)`` (lock held) must
    make the snapshot durable before the quorum id that reached ``quorum_id_lease`` is issued
    (if it raises, the quorum is not issued and the next tick tries again). A service resumed
    from saved state (``Continuation.resumed``, with the saved ``fenced``, ``last_quorum`` and
    ``quorum_id`` = the saved lease) issues no quorum until every member it knows a step of
    (``reported``) has joined and said its step, been fenced, or, past the join timeout, shown
    no sign of life (no heartbeat): those saved steps are no more than lower bounds.
    """

    def __init__(
        self,
        *,
        bind_host: str = "127.0.0.1",
        port: int = 0,
        min_replicas: int = 1,
        join_timeout_s: float = 60.0,
        heartbeat_timeout_s: float = 5.0,
        quorum_tick_s: float = 0.01,
        max_requests: int = 64,
        max_step: int | None = None,
        max_step_lead: int | None = 1_000_000,
        on_newcomer: Callable[[str], None] | None = None,
        first_quorum_replicas: int = 0,
        first_quorum_timeout_s: float = 0.0,
        continues: Continuation | None = None,
        on_lease: Callable[[QuorumSnapshot], None] | None = None,
        on_change: Callable[[], None] | None = None,
        caller_refusal: Callable[[str], str | None] | None = None,
    ) -> None:
        # Why a connection (gRPC's peer string) may not call at all, or None; None: any may
        # (``harness.job.quorum_callers``: only the job's own processes). Asked without the lock.
        self._caller_refusal = caller_refusal
        self.opts = rule.QuorumOpts(
            min_replicas=min_replicas,
            join_timeout_s=join_timeout_s,
            heartbeat_timeout_s=heartbeat_timeout_s,
            max_step=max_step,
            max_step_lead=max_step_lead,
            wait_for_members=on_newcomer is not None,
            first_quorum_replicas=first_quorum_replicas,
            first_quorum_timeout_s=first_quorum_timeout_s,
        )
        was = continues if continues is not None else Continuation(secrets.token_bytes(32))
        #: The job's secret: whoever holds it can name members (keep it in the controller).
        self.secret = was.secret
        self._tick_s = quorum_tick_s
        self._on_newcomer = on_newcomer
        lock = threading.RLock()
        self._cond = threading.Condition(lock)  # guards everything below; waiters: long polls
        # The ticker waits on its own condition (same lock), so issuing a quorum wakes only the
        # long polls, and a join wakes the ticker only when it opens a round.
        self._ticker_wake = threading.Condition(lock)
        self.ticks = 0  # how many times the ticker ran the rule (a test counts them)
        # A restarted service continues the quorum ids: torchft keys each quorum's rendezvous
        # in the group stores by its id, and a reused id would meet the old quorum's addresses.
        prev = rule.Quorum(
            quorum_id=was.quorum_id,
            members=tuple(rule.Member(replica_id=r) for r in was.last_quorum),
        )
        self._state = rule.QuorumState(
            highest_step=was.highest_step,
            reported=rule._frozen(dict(was.reported)),
            quorum_id=was.quorum_id,
            fenced=frozenset(was.fenced),
            prev_quorum=prev if was.last_quorum else None,
        )
        for replica, incarnation in was.incarnations.items():
            self._state, _ = rule.admit(self._state, replica, incarnation)
        # Durable state (class doc): every id issued is below the lease the file holds.
        self._lease = was.quorum_id_lease
        self._on_lease = on_lease
        self._on_change = on_change
        self._lease_failing = False
        # After a resume: members whose saved step is only a lower bound, and until when one
        # that shows no sign of life still holds the quorum up.
        self._unheard = set(self._state.reported) if was.resumed else set()
        self._unheard_until = time.monotonic() + join_timeout_s
        self._veto_wake: float | None = None  # when the ticker must look at them again
        # Issued quorums, newest last, with a sequence number so a waiter sees each one once,
        # and the reply, encoded once for all its N participants (each reply lists all N).
        self._issued: deque[tuple[int, rule.Quorum, bytes]] = deque(maxlen=256)
        self._seq = 0
        self._reason = ""
        self._closed = False

        self._bind_host = bind_host
        self.address = f"http://{bind_host}:{port}"  # a resumed service's requests come at once
        self._server, self.address = lighthouse_server(
            bind_host=bind_host,
            port=port,
            quorum=self._quorum,
            heartbeat=self._heartbeat,
            max_workers=max_requests,
            name="tree-quorum",
        )
        self._ticker = threading.Thread(
            target=self._run_ticker, name="tree-quorum-tick", daemon=True
        )
        self._ticker.start()

    # --- inputs from the controller --------------------------------------------------------
    @property
    def reported(self) -> dict[str, int]:
        """Each live member's last reported step (a restarted service keeps them)."""
        with self._cond:
            return dict(self._state.reported)

    @property
    def quorum_id(self) -> int:
        """The id of the last quorum issued (a restarted service continues from it)."""
        with self._cond:
            return self._state.quorum_id

    @property
    def highest_step(self) -> int:
        """The highest step any admitted member has reported (a restarted service keeps it)."""
        with self._cond:
            return self._state.highest_step

    def job_restarted(self) -> None:
        """The whole job restarts from a checkpoint: committing earlier steps again is meant."""
        with self._cond:
            self._state = rule.job_restarted(self._state)
            self._unheard.clear()
            self._changed()

    def admit(self, replica: int, incarnation: int | None = None) -> str:
        """Incarnation ``incarnation`` (default: the next one) of group ``replica`` is starting:
        return the ``replica_id`` its Managers must use. Every older incarnation of the group is
        fenced from now on (its requests are refused). Call it before starting the group."""
        with self._cond:
            if incarnation is None:
                incarnation = self._state.incarnations.get(replica, -1) + 1
            self._state, dropped = rule.admit(self._state, replica, incarnation)
            if dropped:
                log.info(
                    "tree quorum: replica %d incarnation %d fenced %s",
                    replica,
                    incarnation,
                    sorted(dropped),
                )
            self._forget_unheard_locked()
            self._changed()
            self._tick_locked()
            self._cond.notify_all()  # fenced waiters end
        return rule.member_id(self.secret, replica, incarnation)

    @property
    def incarnations(self) -> dict[int, int]:
        """Each replica group's newest incarnation admitted or seen."""
        with self._cond:
            return dict(self._state.incarnations)

    def replica_failed(self, replica: int, ids: Iterable[str] = ()) -> list[str]:
        """Replica group ``replica`` is dead (the supervision tree saw it): fence all its torchft
        ids and re-run the rule at once, so the survivors' pending quorum is issued without it.
        Returns the ids fenced (empty if the group had not registered yet). Call it before
        starting the group's replacement (whose Manager gets a fresh id). ``ids``: the group's
        ids that do not follow our naming (a program's own Managers',
        ``harness.job.program.groups``)."""
        with self._cond:
            prefixes = rule.ids_of_replica(replica) + tuple(ids)
            self._state, dropped = rule.drop_failed(self._state, prefixes)
            if dropped:
                log.info("tree quorum: replica %d failed, fenced %s", replica, sorted(dropped))
            self._forget_unheard_locked()
            self._changed()
            self._tick_locked()
            self._cond.notify_all()  # wake the dead group's own waiters so they end
        return sorted(dropped)

    def status(self) -> dict[str, Any]:
        """A snapshot: ``quorum_id``, ``members`` (ids of the last quorum), ``heartbeating``
        (healthy ids now), ``participants`` (pending), ``fenced``, ``reason`` (last decision)."""
        with self._cond:
            s = self._state
            now = time.monotonic()
            return {
                "quorum_id": s.quorum_id,
                "members": list(s.prev_quorum.replica_ids) if s.prev_quorum else [],
                "heartbeating": sorted(rule.healthy_replicas(s, now, self.opts)),
                "participants": sorted(s.participants),
                "fenced": sorted(s.fenced),
                "reason": self._reason,
            }

    def last_quorum(self) -> rule.Quorum | None:
        """The last quorum issued, each member as it sent itself (``Member.raw``), or None."""
        with self._cond:
            return self._issued[-1][1] if self._issued else None

    def snapshot(self) -> QuorumSnapshot:
        """The durable part of the state (``harness.quorum.durable``)."""
        with self._cond:
            s = self._state
            prev = s.prev_quorum.replica_ids if s.prev_quorum is not None else ()
            return QuorumSnapshot(
                host=self._bind_host,
                port=int(self.address.rsplit(":", 1)[1]),
                secret=self.secret,
                incarnations=dict(s.incarnations),
                fenced=s.fenced,
                quorum_id_lease=self._lease,
                last_quorum=prev,
                highest_step=s.highest_step,
                reported=dict(s.reported),
                seq=next_seq(),
            )

    @property
    def quorum_id_lease(self) -> int:
        """Every quorum id issued is below this (and it is durable, given ``on_lease``)."""
        with self._cond:
            return self._lease

    def shutdown(self) -> None:
        """Stop serving; waiting quorum requests end with UNAVAILABLE. Idempotent."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
            self._ticker_wake.notify()
        self._server.stop(grace=None).wait(5)
        self._ticker.join(timeout=5)

    # --- the rule, driven --------------------------------------------------------------------

    def _changed(self) -> None:
        if self._on_change is not None:
            self._on_change()

    def _tick_locked(self) -> None:
        now = time.monotonic()
        self._veto_wake = None
        if self._unheard and self._state.participants:
            self._state = rule.prune(self._state, now, self.opts)
            if self._wait_unheard_locked(now):
                return
        state, quorum, reason = rule.tick(self._state, now, self.opts)
        if reason != self._reason:
            log.debug("tree quorum: %s", reason)
            self._reason = reason
        if quorum is not None and not self._lease_locked(quorum.quorum_id):
            return  # not durable: not issued (the next tick tries again)
        self._state = state
        if quorum is not None:
            self._changed()
            self._seq += 1
            self._issued.append((self._seq, quorum, encode_quorum_response(quorum, time.time())))
            log.info("tree quorum %d: %s", quorum.quorum_id, list(quorum.replica_ids))
            self._cond.notify_all()

    def _lease_locked(self, quorum_id: int) -> bool:
        """Make the lease cover ``quorum_id`` before it is issued; False if that failed."""
        if self._on_lease is None:
            return True
        lease = next_lease(quorum_id, self._lease)
        if lease is None:
            return True
        old, self._lease = self._lease, lease
        try:
            self._on_lease(self.snapshot())
        except Exception as e:
            self._lease = old
            if not self._lease_failing:
                log.error("tree quorum: cannot save quorum id lease %d, not issuing: %s", lease, e)
            self._lease_failing = True
            return False
        self._lease_failing = False
        return True

    def _forget_unheard_locked(self) -> None:
        """Members fenced (or forgotten by a job restart) hold nothing up any more."""
        if self._unheard:
            self._unheard.intersection_update(self._state.reported)

    def _wait_unheard_locked(self, now: float) -> bool:
        """Whether members the service knew before its resume still hold the quorum up (class
        doc): those that neither joined nor were fenced and, past the join timeout, heartbeat."""
        self._forget_unheard_locked()
        if self._unheard and now >= self._unheard_until:
            self._unheard &= rule.healthy_replicas(self._state, now, self.opts)
        if not self._unheard:
            return False
        # What time alone changes now: the join timeout passing, then an unheard member's
        # heartbeat going stale (the ticker sleeps until then, it does not poll).
        beats = self._state.heartbeats
        stale = min((beats[r] for r in self._unheard if r in beats), default=now)
        self._veto_wake = (
            self._unheard_until
            if now < self._unheard_until
            else stale + self.opts.heartbeat_timeout_s
        )
        self._reason = (
            f"Waiting for {len(self._unheard)} member(s) known before the resume to report "
            "their steps (they may have committed past the saved ones)"
        )
        return True

    def _run_ticker(self) -> None:
        # Stragglers and heartbeat expiry are time-driven: while a round is open, re-run the
        # rule when time alone could change its answer (rule.next_change: a heartbeat going
        # stale, the join timeout passing), at most every tick. Joins, fences and admissions
        # run the rule themselves. With no round open the ticker sleeps until a join opens one
        # (a stale heartbeat is pruned by the next round's first tick): steady training does
        # not wake it a hundred times a second.
        while True:
            with self._cond:
                if self._closed:
                    return
                self._tick_locked()
                self.ticks += 1
                wake_at = self._veto_wake or rule.next_change(self._state, self.opts)
                timeout = None if wake_at is None else max(self._tick_s, wake_at - time.monotonic())
                self._ticker_wake.wait(timeout)

    # --- gRPC handlers -----------------------------------------------------------------------

    def _refusal(self, replica_id: str, context: grpc.ServicerContext) -> str | None:
        """Why this caller may not take part (called with the lock held), or None."""
        return rule.refusal(self._state, replica_id, self.secret)

    def _check_caller(self, context: grpc.ServicerContext) -> None:
        """Abort a call whose connection is no one's the job admits (before anything of it is
        decoded, and without the lock: the look may read /proc)."""
        if self._caller_refusal is None:
            return
        refused = self._caller_refusal(context.peer())
        if refused is not None:
            context.abort(grpc.StatusCode.PERMISSION_DENIED, refused)

    def _heartbeat(self, request: bytes, context: grpc.ServicerContext) -> bytes:
        self._check_caller(context)
        try:
            replica_id = decode_heartbeat_request(request)
        except (WireError, UnicodeDecodeError) as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        with self._cond:
            refused = self._refusal(replica_id, context)
            if refused is None:
                self._state = rule.heartbeat(self._state, replica_id, time.monotonic())
        if refused is not None:
            context.abort(grpc.StatusCode.PERMISSION_DENIED, refused)
        return b""

    def _quorum(self, request: bytes, context: grpc.ServicerContext) -> bytes:
        self._check_caller(context)
        try:
            member = decode_quorum_request(request)
        except (WireError, UnicodeDecodeError) as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        rid = member.replica_id
        remaining = context.time_remaining()
        deadline = time.monotonic() + (remaining if remaining is not None else 3600.0)
        # A cancelled or timed-out call wakes its waiter instead of holding a thread.
        context.add_callback(self._notify)
        with self._cond:
            if rid in self._state.fenced:
                context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"{rid} was declared failed")
            refused = self._refusal(rid, context)
            if refused is not None:
                log.warning("tree quorum: refused %r from %s: %s", rid, context.peer(), refused)
                context.abort(grpc.StatusCode.PERMISSION_DENIED, refused)
            refused = rule.step_refusal(self._state, member, self.opts)
            if refused is not None:
                log.warning("tree quorum: refused %r from %s: %s", rid, context.peer(), refused)
                context.abort(grpc.StatusCode.OUT_OF_RANGE, refused)
            seen = self._seq
            self._join_locked(member)
            while True:
                for seq, quorum, reply in self._issued_after(seen):
                    seen = seq
                    if rid in quorum.id_set:
                        return reply
                    # Issued without us (we joined too late for it): ask again for the next one.
                    self._join_locked(member)
                if self._closed:
                    context.abort(grpc.StatusCode.UNAVAILABLE, "tree quorum shut down")
                if rid in self._state.fenced:
                    context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"{rid} was declared failed")
                refused = self._refusal(rid, context)  # a newer incarnation was admitted
                if refused is not None:
                    context.abort(grpc.StatusCode.PERMISSION_DENIED, refused)
                if not context.is_active():
                    return b""  # the caller is gone; nobody reads this
                left = deadline - time.monotonic()
                if left <= 0:
                    context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, "no quorum in time")
                self._cond.wait(left)

    def _join_locked(self, member: rule.Member) -> None:
        """Record ``member``'s join (lock held); decide at once if it may complete the round,
        and wake the ticker if it opened one."""
        opens_round = not self._state.participants
        prev = self._state.prev_quorum
        if self._on_newcomer and prev is not None and member.replica_id not in prev.id_set:
            self._on_newcomer(member.replica_id)
        self._state = rule.join(self._state, member, time.monotonic())
        heard = bool(self._unheard) and member.replica_id in self._unheard
        if heard:
            self._unheard.discard(member.replica_id)
        if rule.may_complete(self._state) or (heard and not self._unheard):
            self._tick_locked()
        if opens_round and self._state.participants:
            self._ticker_wake.notify()

    def _issued_after(self, seen: int) -> list[tuple[int, rule.Quorum, bytes]]:
        """The quorums issued after sequence number ``seen``, oldest first (lock held): the
        newest few, without copying the whole history for each of N woken waiters."""
        new = min(self._seq - seen, len(self._issued))
        return [self._issued[i] for i in range(len(self._issued) - new, len(self._issued))]

    def _notify(self) -> None:
        with self._cond:
            self._cond.notify_all()
