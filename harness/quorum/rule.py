"""The quorum rule of torchft's Lighthouse, as pure functions, plus one new input: a replica group
declared failed by the supervision tree.

This is ``quorum_compute`` and ``_quorum_tick`` of torchft's ``src/lighthouse.rs``, kept rule for
rule (the service around it, ``harness.quorum.tree``, only does I/O):

* **healthy** replicas: those with a heartbeat (a quorum request counts as one) younger than
  ``heartbeat_timeout_s``; **healthy participants**: requesters that are healthy.
* **fast quorum**: when every member of the previous quorum is a healthy participant, issue at
  once with all healthy participants (with ``shrink_only``, only those of the previous quorum).
* otherwise a quorum needs ``>= min_replicas`` healthy participants **and** more than half of the
  healthy replicas (no split brain), and waits for healthy-but-not-joined stragglers until
  ``join_timeout_s`` after the earliest join.
* not in torchft: with ``wait_for_members`` (a sparse quorum) a live member of the previous
  quorum (heartbeating, not fenced) is waited for past the join timeout.
* not in torchft: the survivors' first fast quorum after a fence leaves out newcomers behind
  their step (replacements that must heal): they join the next round (:func:`_defer_healers`).
* participants are sorted by ``replica_id``; the quorum id is bumped when the member ids differ
  from the previous quorum's, or when a member reports ``commit_failures > 0``; the pending
  participants are cleared once a quorum is issued.

The new input, :func:`drop_failed`: the supervision tree learns of a group's death in
milliseconds, long before its heartbeats go stale. Every replica id of that group (torchft ids
look like ``"replica_{r}:{uuid}"``, or ``"replica_{r}.{incarnation}.{tag}.{r}:{uuid}"`` when
tagged, below) is then *fenced*: removed from the heartbeats and the pending
participants, ignored in the previous quorum (so the survivors alone make a fast quorum), and
never admitted again (a late heartbeat or a zombie's request cannot revive it). A replacement
process gets a fresh uuid from its Manager, so it is a new id and joins normally. The previous
quorum is kept as issued for the quorum-id comparison, so the survivors' first quorum after a
death always gets a new id (torchft then rebuilds the process group without the dead group).

Admission (new, not in torchft: its Lighthouse lets anyone in). Our Managers are named
``member_id(secret, r, incarnation)`` = ``"replica_{r}.{incarnation}.{tag}.{r}"``, where ``tag``
is the first 16 hex digits of HMAC-SHA256(secret, ``"{r}.{incarnation}"``) and only the job (the
controller) holds the secret. torchft's Manager appends ``":{uuid4}"`` before the id reaches the
quorum protocol; the trailing ``.{r}`` is there because torchft derives a group's global rank
from the trailing digits of the id it was given. :func:`refusal` says why an id is not let in:
no valid tag (without exception: a program's own Managers get tagged names from
``harness.quorum.tap``), a fenced id, or an *older incarnation* of a replica whose newer
incarnation was admitted (:func:`admit`) or has been seen. :func:`step_refusal` refuses absurd
steps: negative, beyond ``max_step`` (the job's last step), or more than ``max_step_lead`` past
the highest step any admitted member has reported. Heartbeats older than the heartbeat timeout
are pruned on every :func:`tick`, so the state stays bounded by the live members.

Everything here is a pure function of (state, time, options); times are ``time.monotonic()``
seconds. Not guaranteed: nothing here knows about wall-clock time or I/O.

Why this module is longer than 500 lines: it is torchft's rule kept rule for rule, plus what this
project adds to its decision (fencing, admission, steps that never go back, deferred healers),
all pure functions of one state; each addition sits next to the rule it amends.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import re
from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass, field, replace
from functools import cached_property
from types import MappingProxyType


@dataclass(frozen=True, kw_only=True)
class QuorumOpts:
    """The Lighthouse's options (``LighthouseOpt``), in seconds."""

    min_replicas: int = 1
    join_timeout_s: float = 60.0
    heartbeat_timeout_s: float = 5.0
    #: Refuse a step above this (the job's last step); None: no absolute bound.
    max_step: int | None = None
    #: Refuse a step more than this above the highest step any admitted member has reported
    #: (the first member after a start is bounded only by ``max_step``); None: no bound.
    max_step_lead: int | None = 1_000_000
    #: Sparse quorum (``harness.rank.trainer``): members of the last quorum that still heartbeat and
    #: are not fenced are waited for past the join timeout. They ask for a quorum only every N
    #: steps or when told that someone waits; a quorum issued without them would let a newcomer
    #: train on its own while they go on without it (two copies of the model, both committing).
    wait_for_members: bool = False
    #: Not in torchft: the job's first quorum waits for this many participants (0: off), up to
    #: ``first_quorum_timeout_s`` after the earliest join. Without it the first group to ask
    #: trains alone for a few steps (a group not heartbeating yet is no straggler to the rule).
    first_quorum_replicas: int = 0
    first_quorum_timeout_s: float = 0.0


def _first_quorum_wait(state: QuorumState, opts: QuorumOpts) -> bool:
    """At the job's first quorum (none issued, every member at step 0), some group missing."""
    first = state.prev_quorum is None and state.highest_step <= 0
    return first and len(state.participants) < opts.first_quorum_replicas  # 0: never


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

    @cached_property
    def replica_ids(self) -> tuple[str, ...]:
        return tuple(m.replica_id for m in self.members)

    @cached_property
    def id_set(self) -> frozenset[str]:
        """The members' ids as a set (each of N waiters asks "am I in it?": O(1), not O(N))."""
        return frozenset(self.replica_ids)


def _frozen(d: Mapping) -> Mapping:
    return MappingProxyType(dict(d))


def _with(m: Mapping, key: Hashable, value: object) -> Mapping:
    """``m`` plus ``key: value``, as a new read-only mapping. One C-level dict copy: unpacking
    a read-only view (``{**m}``) goes key by key through the mapping protocol, several times
    slower, and every join pays it once per known member."""
    d = m.copy() if isinstance(m, MappingProxyType) else dict(m)
    d[key] = value
    return MappingProxyType(d)


@dataclass(frozen=True, kw_only=True)
class QuorumState:
    """The Lighthouse's state (``State`` in lighthouse.rs) plus the fenced ids. Immutable: every
    transition returns a new state."""

    heartbeats: Mapping[str, float] = field(default_factory=lambda: _frozen({}))
    participants: Mapping[str, Joined] = field(default_factory=lambda: _frozen({}))
    prev_quorum: Quorum | None = None
    quorum_id: int = 0
    fenced: frozenset[str] = frozenset()
    #: replica group -> its newest incarnation admitted or seen (older ones are refused)
    incarnations: Mapping[int, int] = field(default_factory=lambda: _frozen({}))
    #: the highest step an admitted member has reported; -1 before any
    highest_step: int = -1
    #: each live (not fenced) member's last reported step: the steps whose state still exists
    reported: Mapping[str, int] = field(default_factory=lambda: _frozen({}))


# --- member ids and admission --------------------------------------------------------------------

_MEMBER_ID = re.compile(r"replica_(\d+)\.(\d+)\.([0-9a-f]{16})\.(\d+)(?::.*)?", re.DOTALL)


@dataclass(frozen=True, kw_only=True)
class MemberId:
    """What a tagged replica id says: its group, the group's incarnation, and the tag."""

    replica: int
    incarnation: int
    tag: str


@functools.lru_cache(maxsize=4096)
def member_tag(secret: bytes, replica: int, incarnation: int) -> str:
    """The tag only the holder of ``secret`` can compute for this incarnation of a group.
    Cached: every quorum request and heartbeat is checked against it (an HMAC each time was
    ~7% of the controller's Python time at tiny step rates), and few incarnations exist."""
    mac = hmac.new(secret, f"{replica}.{incarnation}".encode(), hashlib.sha256)
    return mac.hexdigest()[:16]


def member_id(secret: bytes, replica: int, incarnation: int) -> str:
    """The ``replica_id`` to give the Manager of incarnation ``incarnation`` of group
    ``replica`` (see the module doc for why it ends in the replica number)."""
    return f"replica_{replica}.{incarnation}.{member_tag(secret, replica, incarnation)}.{replica}"


def parse_member_id(replica_id: str) -> MemberId | None:
    """The tagged form of ``replica_id`` (with or without torchft's ``:uuid``), or None."""
    m = _MEMBER_ID.fullmatch(replica_id)
    if m is None or m.group(1) != m.group(4):
        return None
    return MemberId(replica=int(m.group(1)), incarnation=int(m.group(2)), tag=m.group(3))


def refusal(state: QuorumState, replica_id: str, secret: bytes | None) -> str | None:
    """Why ``replica_id`` may not heartbeat or join, or None if it may. ``secret``: the job's
    (None: no tag can be checked, so every id is refused)."""
    if replica_id in state.fenced:
        return f"{replica_id} was declared failed"
    parsed = parse_member_id(replica_id)
    if parsed is None or secret is None:
        return f"{replica_id!r} carries no valid member tag: not a member this job started"
    expected = member_tag(secret, parsed.replica, parsed.incarnation)
    if not hmac.compare_digest(parsed.tag, expected):
        return f"{replica_id!r}: wrong member tag"
    newest = state.incarnations.get(parsed.replica, -1)
    if parsed.incarnation < newest:
        return (
            f"{replica_id!r} is incarnation {parsed.incarnation} of replica {parsed.replica}, "
            f"which was replaced by incarnation {newest}"
        )
    return None


def step_refusal(state: QuorumState, member: Member, opts: QuorumOpts) -> str | None:
    """Why ``member``'s step is absurd, or None. An absurd step would make every other member
    heal from it (torchft heals from the highest step in the quorum)."""
    step = member.step
    if step < 0:
        return f"step {step} is negative"
    if opts.max_step is not None and step > opts.max_step:
        return f"step {step} is beyond the job's last step {opts.max_step}"
    if (
        opts.max_step_lead is not None
        and state.highest_step >= 0
        and step > state.highest_step + opts.max_step_lead
    ):
        return (
            f"step {step} is more than {opts.max_step_lead} past the highest step reported "
            f"by any member ({state.highest_step})"
        )
    return None


# --- inputs --------------------------------------------------------------------------------------


def heartbeat(state: QuorumState, replica_id: str, now: float) -> QuorumState:
    """Record a heartbeat from ``replica_id`` (ignored if it is fenced). The caller has checked
    :func:`refusal`; a tagged id of a newer incarnation fences the older ones."""
    if replica_id in state.fenced:
        return state
    state = _note_incarnation(state, replica_id)
    return replace(state, heartbeats=_with(state.heartbeats, replica_id, now))


def join(state: QuorumState, member: Member, now: float) -> QuorumState:
    """``member`` asks to join the next quorum: an implicit heartbeat plus a pending participant
    (a repeated request replaces the earlier one and its join time). Ignored if fenced."""
    rid = member.replica_id
    if rid in state.fenced:
        return state
    state = _note_incarnation(state, rid)
    return replace(
        state,
        heartbeats=_with(state.heartbeats, rid, now),
        participants=_with(state.participants, rid, Joined(joined=now, member=member)),
        highest_step=max(state.highest_step, member.step),
        reported=_with(state.reported, rid, member.step),
    )


def _note_incarnation(state: QuorumState, replica_id: str) -> QuorumState:
    parsed = parse_member_id(replica_id)
    if parsed is None or parsed.incarnation <= state.incarnations.get(parsed.replica, -1):
        return state
    return admit(state, parsed.replica, parsed.incarnation)[0]


def admit(state: QuorumState, replica: int, incarnation: int) -> tuple[QuorumState, frozenset[str]]:
    """Incarnation ``incarnation`` of group ``replica`` is the current one: every known id of an
    older incarnation (or an untagged id) of that group is fenced. Returns the new state and
    the ids fenced. An older ``incarnation`` than the current one changes nothing."""
    if incarnation <= state.incarnations.get(replica, -1):
        return state, frozenset()

    def older(rid: str) -> bool:
        parsed = parse_member_id(rid)
        if parsed is None:
            return rid.startswith(ids_of_replica(replica))
        return parsed.replica == replica and parsed.incarnation < incarnation

    state = replace(state, incarnations=_with(state.incarnations, replica, incarnation))
    return _fence(state, older)


def ids_of_replica(replica: int) -> tuple[str, ...]:
    """The id prefixes of every Manager of our replica group ``replica``: untagged
    (``replica_{r}:{uuid}``) and tagged (``replica_{r}.{incarnation}.{tag}.{r}:{uuid}``)."""
    return (f"replica_{replica}:", f"replica_{replica}.")


def drop_failed(
    state: QuorumState, prefix: str | tuple[str, ...]
) -> tuple[QuorumState, frozenset[str]]:
    """The supervision tree says the group whose ids start with ``prefix`` (one, or any of a
    tuple) is dead: fence every known id with that prefix (heartbeats, pending participants,
    previous quorum). Returns the new state and the ids fenced by this call (empty if none were
    known)."""
    return _fence(state, lambda rid: rid.startswith(prefix))


def _fence(state: QuorumState, match: Callable[[str], bool]) -> tuple[QuorumState, frozenset[str]]:
    known = set(state.heartbeats) | set(state.participants) | set(state.reported)
    if state.prev_quorum is not None:
        known |= set(state.prev_quorum.replica_ids)
    dropped = frozenset(rid for rid in known if match(rid))
    if not dropped:
        return state, dropped
    new = replace(
        state,
        heartbeats=_frozen({k: v for k, v in state.heartbeats.items() if k not in dropped}),
        participants=_frozen({k: v for k, v in state.participants.items() if k not in dropped}),
        reported=_frozen({k: v for k, v in state.reported.items() if k not in dropped}),
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
    behind = _behind(state, candidates)
    if behind is not None:
        return None, f"{behind} {meta}"
    if prev_ids:
        if shrink_only:
            candidates = [m for m in candidates if m.replica_id in prev_ids]
        if all(rid in participants for rid in prev_ids):
            members, deferred = _defer_healers(state, prev_ids, candidates, opts)
            later = f" ({deferred} newcomer(s) behind: the next round)" if deferred else ""
            return tuple(members), f"Fast quorum found!{later} {meta}"

    first_joined = min((j.joined for j in participants.values()), default=now)
    if _first_quorum_wait(state, opts) and now - first_joined < opts.first_quorum_timeout_s:
        return None, (
            f"First quorum: {len(participants)} of {opts.first_quorum_replicas} replica groups "
            f"joined, waiting for the others {meta}"
        )
    if opts.wait_for_members:
        missing = [rid for rid in prev_ids if rid in healthy and rid not in participants]
        if missing:
            return None, f"Waiting for {len(missing)} live member(s) of the last quorum {meta}"
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
    if len(participants) != len(healthy) and now - first_joined < opts.join_timeout_s:
        return None, (
            f"Valid quorum with {len(participants)} participants, waiting for "
            f"{len(healthy) - len(participants)} healthy but not participating stragglers due "
            f"to join timeout {meta}"
        )
    return tuple(candidates), f"Valid quorum found {meta}"


def _defer_healers(
    state: QuorumState, prev_ids: list[str], candidates: list[Member], opts: QuorumOpts
) -> tuple[list[Member], int]:
    """The fast quorum's members, and how many newcomers were left for the next round.

    Not in torchft. In the survivors' first quorum after a fence (a member of the last quorum
    was declared failed since it was issued), a newcomer behind the survivors' step (a
    replacement that must heal first) is left out: the survivors commit a step without it and
    it joins the next round (then heals). Otherwise the survivors' first step after the fault
    waits for the heal too, a cross-host one adding its whole transfer to the stall (seen in
    ``bench multihost``: a warm spare adopted 20 ms after the detection met the survivors in
    their first quorum, and they resumed 1.1 s later, after its heal). A newcomer at the
    survivors' step (a group coming back with its state) is not held back. The next round's
    previous quorum is the survivors', none fenced, so the newcomer is in it: it is deferred
    once per fence. Nothing is deferred when that would leave fewer than ``min_replicas``."""
    prev = state.prev_quorum
    if prev is None or len(prev_ids) == len(prev.replica_ids):
        return candidates, 0  # no member of the last quorum failed since
    kept = set(prev_ids)
    top = max((m.step for m in candidates if m.replica_id in kept), default=-1)
    members = [m for m in candidates if m.replica_id in kept or m.step >= top]
    if len(members) == len(candidates) or len(members) < opts.min_replicas:
        return candidates, 0
    return members, len(candidates) - len(members)


def _behind(state: QuorumState, candidates: list[Member]) -> str | None:
    """Why no quorum of ``candidates`` may be issued because they are all behind the job, or
    None. A member reports the steps it has committed; a quorum whose most advanced member is
    behind the highest step ever reported would commit again, with other weights, steps the job
    already committed (seen in a soak: three groups restarted from an old checkpoint met
    without the one healthy group and re-committed 160 steps). So the quorum waits for a member
    at the job's step to take part, which torchft then heals the others from. A whole-job
    restart from a checkpoint (``full_restart``) resets this mark (:func:`job_restarted`).

    Only state that still exists is waited for: the mark is the highest step a live (not
    fenced) member has reported. When every member that held a step has been declared failed,
    that step is lost for good, and waiting for it would stall the job forever (seen in the CI
    soak: a group committed a step alone right after a quorum-service restart, then died)."""
    if not candidates:
        return None
    top = max(m.step for m in candidates)
    mark = max(state.reported.values(), default=-1)
    if top >= mark:
        return None
    return (
        f"Waiting for a member at step {mark}: the participants are at most at step {top}, "
        "and a quorum of them would commit again steps the job already committed"
    )


def job_restarted(state: QuorumState) -> QuorumState:
    """The whole job restarted from a checkpoint (every process new): steps before the
    checkpoint are committed again on purpose, so the high-water mark starts over."""
    return replace(
        state, highest_step=-1, reported=_frozen({}), participants=_frozen({}), prev_quorum=None
    )


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


def prune(state: QuorumState, now: float, opts: QuorumOpts) -> QuorumState:
    """Forget heartbeats older than the heartbeat timeout (they count for nothing in
    :func:`compute`; keeping them would let the state grow with every id ever seen)."""
    stale = [rid for rid, t in state.heartbeats.items() if now - t >= opts.heartbeat_timeout_s]
    if not stale:
        return state
    keep = {rid: t for rid, t in state.heartbeats.items() if rid not in stale}
    return replace(state, heartbeats=_frozen(keep))


def next_change(state: QuorumState, opts: QuorumOpts) -> float | None:
    """When time alone could next change what :func:`compute` says (no join, fence or
    admission in between): the oldest heartbeat going stale, or the join timeout passing after
    the earliest join; None when no round is open (then nothing is time-driven). A service
    sleeps until then instead of re-running the rule on a fixed period: a round stays open
    most of a step while the groups arrive, and nothing in it changes on its own before this."""
    if not state.participants:
        return None
    first_joined = min(j.joined for j in state.participants.values())
    oldest_beat = min(state.heartbeats.values(), default=None)
    join_deadline = first_joined + opts.join_timeout_s
    if _first_quorum_wait(state, opts):
        join_deadline = min(join_deadline, first_joined + opts.first_quorum_timeout_s)
    if oldest_beat is None:
        return join_deadline
    return min(join_deadline, oldest_beat + opts.heartbeat_timeout_s)


def may_complete(state: QuorumState) -> bool:
    """Whether the join just recorded may have completed a quorum, in O(fenced) instead of
    :func:`compute`'s O(N log N): a service runs :func:`tick` at once when True, and leaves
    the rest to its periodic tick (so a round of N joins costs one compute, not N).

    True whenever the join completed a fast quorum (which needs every live member of the
    previous quorum among the participants, so at least that many participants) or brought in
    the last healthy replica (at least as many participants as heartbeats; stale heartbeats
    are pruned on every tick). Not covered, left to the periodic tick: a join that gives the
    participants their majority after the join timeout has passed, and whatever time alone
    changes (a heartbeat going stale since the last tick, the join timeout passing)."""
    n = len(state.participants)
    if n >= len(state.heartbeats):
        return True
    prev = state.prev_quorum
    if prev is None:
        return False
    live = len(prev.members) - sum(1 for rid in state.fenced if rid in prev.id_set)
    return 0 < live <= n


def tick(
    state: QuorumState, now: float, opts: QuorumOpts
) -> tuple[QuorumState, Quorum | None, str]:
    """``_quorum_tick``: prune stale heartbeats, compute, and issue if a quorum is met. Returns
    the new state, the issued quorum (or None) and the reason."""
    state = prune(state, now, opts)
    if not state.participants:  # nothing to decide (compute would say so, in O(N log N))
        return state, None, "New quorum not ready, no participants"
    members, reason = compute(state, now, opts)
    if members is None:
        return state, None, reason
    new, quorum = issue(state, members)
    return new, quorum, reason
