"""The quorum rule of torchft's Lighthouse, as pure functions, plus one new input: a replica group
declared failed by the supervision tree.

This is ``quorum_compute`` and ``_quorum_tick`` of torchft's ``src/lighthouse.rs``, kept rule for
rule (the service around it, ``harness.tree_quorum``, only does I/O):

* **healthy** replicas: those with a heartbeat (a quorum request counts as one) younger than
  ``heartbeat_timeout_s``; **healthy participants**: requesters that are healthy.
* **fast quorum**: when every member of the previous quorum is a healthy participant, issue at
  once with all healthy participants (with ``shrink_only``, only those of the previous quorum).
* otherwise a quorum needs ``>= min_replicas`` healthy participants **and** more than half of the
  healthy replicas (no split brain), and waits for healthy-but-not-joined stragglers until
  ``join_timeout_s`` after the earliest join.
* participants are sorted by ``replica_id``; the quorum id is bumped when the member ids differ
  from the previous quorum's, or when a member reports ``commit_failures > 0``; the pending
  participants are cleared once a quorum is issued.

The new input, :func:`drop_failed`: the supervision tree learns of a group's death in
milliseconds, long before its heartbeats go stale. Every replica id of that group (torchft ids
look like ``"replica_{r}:{uuid}"``) is then *fenced*: removed from the heartbeats and the pending
participants, ignored in the previous quorum (so the survivors alone make a fast quorum), and
never admitted again (a late heartbeat or a zombie's request cannot revive it). A replacement
process gets a fresh uuid from its Manager, so it is a new id and joins normally. The previous
quorum is kept as issued for the quorum-id comparison, so the survivors' first quorum after a
death always gets a new id (torchft then rebuilds the process group without the dead group).

Everything here is a pure function of (state, time, options); times are ``time.monotonic()``
seconds. Not guaranteed: nothing here knows about wall-clock time or I/O.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType


@dataclass(frozen=True, kw_only=True)
class QuorumOpts:
    """The Lighthouse's options (``LighthouseOpt``), in seconds."""

    min_replicas: int = 1
    join_timeout_s: float = 60.0
    heartbeat_timeout_s: float = 5.0


@dataclass(frozen=True, kw_only=True)
class Member:
    """One requester's ``QuorumMember``: the fields the rule reads, and ``raw``, the exact bytes it
    sent (passed back to every participant unchanged, so fields this code does not know
    survive)."""

    replica_id: str
    step: int = 0
    world_size: int = 0
    shrink_only: bool = False
    commit_failures: int = 0
    raw: bytes = b""


@dataclass(frozen=True, kw_only=True)
class Joined:
    """A pending participant: when it (last) asked to join, and what it sent."""

    joined: float
    member: Member


@dataclass(frozen=True, kw_only=True)
class Quorum:
    """An issued quorum: its id and participants (sorted by replica id)."""

    quorum_id: int
    members: tuple[Member, ...]

    @property
    def replica_ids(self) -> tuple[str, ...]:
        return tuple(m.replica_id for m in self.members)


def _frozen(d: Mapping) -> Mapping:
    return MappingProxyType(dict(d))


@dataclass(frozen=True, kw_only=True)
class QuorumState:
    """The Lighthouse's state (``State`` in lighthouse.rs) plus the fenced ids. Immutable: every
    transition returns a new state."""

    heartbeats: Mapping[str, float] = field(default_factory=lambda: _frozen({}))
    participants: Mapping[str, Joined] = field(default_factory=lambda: _frozen({}))
    prev_quorum: Quorum | None = None
    quorum_id: int = 0
    fenced: frozenset[str] = frozenset()


# --- inputs --------------------------------------------------------------------------------------


def heartbeat(state: QuorumState, replica_id: str, now: float) -> QuorumState:
    """Record a heartbeat from ``replica_id`` (ignored if it is fenced)."""
    if replica_id in state.fenced:
        return state
    return replace(state, heartbeats=_frozen({**state.heartbeats, replica_id: now}))


def join(state: QuorumState, member: Member, now: float) -> QuorumState:
    """``member`` asks to join the next quorum: an implicit heartbeat plus a pending participant
    (a repeated request replaces the earlier one and its join time). Ignored if fenced."""
    rid = member.replica_id
    if rid in state.fenced:
        return state
    return replace(
        state,
        heartbeats=_frozen({**state.heartbeats, rid: now}),
        participants=_frozen({**state.participants, rid: Joined(joined=now, member=member)}),
    )


def ids_of_replica(replica: int) -> str:
    """The id prefix torchft gives every Manager of our replica group ``replica``."""
    return f"replica_{replica}:"


def drop_failed(state: QuorumState, prefix: str) -> tuple[QuorumState, frozenset[str]]:
    """The supervision tree says the group whose ids start with ``prefix`` is dead: fence every
    known id with that prefix (heartbeats, pending participants, previous quorum). Returns the new
    state and the ids fenced by this call (empty if none were known)."""
    known = set(state.heartbeats) | set(state.participants)
    if state.prev_quorum is not None:
        known |= set(state.prev_quorum.replica_ids)
    dropped = frozenset(rid for rid in known if rid.startswith(prefix))
    if not dropped:
        return state, dropped
    new = replace(
        state,
        heartbeats=_frozen({k: v for k, v in state.heartbeats.items() if k not in dropped}),
        participants=_frozen({k: v for k, v in state.participants.items() if k not in dropped}),
        fenced=state.fenced | dropped,
    )
    return new, dropped


# --- the decision --------------------------------------------------------------------------------


def healthy_replicas(state: QuorumState, now: float, opts: QuorumOpts) -> frozenset[str]:
    """Replica ids whose last heartbeat is younger than the heartbeat timeout."""
    return frozenset(
        rid for rid, t in state.heartbeats.items() if now - t < opts.heartbeat_timeout_s
    )


def compute(
    state: QuorumState, now: float, opts: QuorumOpts
) -> tuple[tuple[Member, ...] | None, str]:
    """``quorum_compute``: the members of the quorum to issue now (sorted by replica id), or None
    to keep waiting; and the reason, for logs."""
    healthy = healthy_replicas(state, now, opts)
    participants = {rid: j for rid, j in state.participants.items() if rid in healthy}
    candidates = sorted((j.member for j in participants.values()), key=lambda m: m.replica_id)
    shrink_only = any(j.member.shrink_only for j in participants.values())
    meta = (
        f"[{len(participants)}/{len(state.participants)} participants healthy]"
        f"[{len(healthy)} heartbeating][shrink_only={str(shrink_only).lower()}]"
    )

    # The previous quorum without the fenced (dead) members. If all of them are fenced there is
    # nothing left to be fast about; fall through to the full rule (lighthouse.rs never sees an
    # empty previous quorum, and "all of nobody joined" must not issue a quorum by itself).
    prev_ids = (
        [rid for rid in state.prev_quorum.replica_ids if rid not in state.fenced]
        if state.prev_quorum is not None
        else []
    )
    if prev_ids:
        if shrink_only:
            candidates = [m for m in candidates if m.replica_id in prev_ids]
        if all(rid in participants for rid in prev_ids):
            return tuple(candidates), f"Fast quorum found! {meta}"

    if len(participants) < opts.min_replicas:
        return None, (
            f"New quorum not ready, only have {len(participants)} participants, need "
            f"min_replicas {opts.min_replicas} {meta}"
        )
    # Avoid split brain: more than half of the replicas known to be alive must have joined.
    if len(participants) <= len(healthy) // 2:
        return None, (
            f"New quorum not ready, only have {len(participants)} participants, need at least "
            f"half of {len(healthy)} healthy workers {meta}"
        )
    first_joined = min((j.joined for j in participants.values()), default=now)
    if len(participants) != len(healthy) and now - first_joined < opts.join_timeout_s:
        return None, (
            f"Valid quorum with {len(participants)} participants, waiting for "
            f"{len(healthy) - len(participants)} healthy but not participating stragglers due "
            f"to join timeout {meta}"
        )
    return tuple(candidates), f"Valid quorum found {meta}"


def issue(state: QuorumState, members: tuple[Member, ...]) -> tuple[QuorumState, Quorum]:
    """Issue ``members`` (from :func:`compute`) as the next quorum: bump the id if the member ids
    changed or a member reports commit failures, remember it, clear the pending participants."""
    changed = state.prev_quorum is None or state.prev_quorum.replica_ids != tuple(
        m.replica_id for m in members
    )
    failures = any(m.commit_failures > 0 for m in members)
    quorum_id = state.quorum_id + 1 if changed or failures else state.quorum_id
    quorum = Quorum(quorum_id=quorum_id, members=members)
    new = replace(state, quorum_id=quorum_id, prev_quorum=quorum, participants=_frozen({}))
    return new, quorum


def tick(
    state: QuorumState, now: float, opts: QuorumOpts
) -> tuple[QuorumState, Quorum | None, str]:
    """``_quorum_tick``: compute, and issue if a quorum is met. Returns the new state, the issued
    quorum (or None) and the reason."""
    members, reason = compute(state, now, opts)
    if members is None:
        return state, None, reason
    new, quorum = issue(state, members)
    return new, quorum, reason
