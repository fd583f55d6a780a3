"""torchft's Lighthouse quorum rule (``harness.quorum.rule``) and the Lighthouse wire codec
(``harness.quorum.tree``): pure functions, no sockets.

The rule cases follow torchft's own ``src/lighthouse.rs`` tests (join timeout, heartbeats, fast
quorum, shrink_only) and add the supervision tree's input, ``drop_failed``.
"""

from __future__ import annotations

import dataclasses

import pytest

from harness.quorum import rule
from harness.quorum.wire import (
    WireError,
    decode_fields,
    decode_heartbeat_request,
    decode_quorum_request,
    encode_field,
    encode_quorum_response,
    encode_varint,
)

OPTS = rule.QuorumOpts(min_replicas=1, join_timeout_s=3600.0, heartbeat_timeout_s=5.0)
T = 1000.0  # an arbitrary monotonic "now"


def member(rid: str, **kw) -> rule.Member:
    return rule.Member(replica_id=rid, step=kw.pop("step", 1), world_size=1, **kw)


def joined(state: rule.QuorumState, *rids: str, now: float = T, **kw) -> rule.QuorumState:
    for rid in rids:
        state = rule.join(state, member(rid, **kw), now)
    return state


def with_quorum(*rids: str) -> rule.QuorumState:
    """A state whose last issued quorum is ``rids`` (all heartbeating at ``T``)."""
    state, quorum, _ = rule.tick(joined(rule.QuorumState(), *rids), T, OPTS)
    assert quorum is not None and quorum.replica_ids == tuple(sorted(rids))
    return state


def ids(members) -> list[str]:
    return [m.replica_id for m in members]


# --- torchft's rule ------------------------------------------------------------------------------


def test_nothing_joined_means_no_quorum() -> None:
    members, reason = rule.compute(rule.QuorumState(), T, OPTS)
    assert members is None
    assert "only have 0 participants, need min_replicas 1 [0/0 participants healthy]" in reason


def test_join_timeout_waits_for_healthy_stragglers_then_issues() -> None:
    state = joined(rule.QuorumState(), "a", "b")
    members, reason = rule.compute(state, T, OPTS)
    assert ids(members) == ["a", "b"], reason  # every healthy replica joined
    state = rule.heartbeat(state, "c", T)  # alive but not asking to join
    members, reason = rule.compute(state, T, OPTS)
    assert members is None and "join timeout" in reason
    # The straggler is waited for until join_timeout after the *first* join.
    later = T + OPTS.join_timeout_s
    for rid in ("a", "c"):
        state = rule.heartbeat(state, rid, later)  # a heartbeat does not restart a's join clock
    state = rule.join(state, member("b"), later)  # nor does b asking again
    members, reason = rule.compute(state, later - 0.001, OPTS)
    assert members is None and "join timeout" in reason
    members, reason = rule.compute(state, later, OPTS)
    assert ids(members) == ["a", "b"], reason


def test_the_first_quorum_waits_for_every_group_until_its_timeout() -> None:
    """The job's first step: a group whose Manager is not heartbeating yet is not a straggler to
    torchft's rule, so without the wait the first group to ask would train alone."""
    opts = dataclasses.replace(OPTS, first_quorum_replicas=3, first_quorum_timeout_s=5.0)
    state = joined(rule.QuorumState(), "a", step=0)
    members, reason = rule.compute(state, T, opts)
    assert members is None and "First quorum: 1 of 3" in reason
    assert rule.next_change(state, opts) == T + 5.0  # the ticker wakes when the wait ends
    members, _ = rule.compute(state, T, OPTS)
    assert ids(members) == ["a"]  # torchft's rule alone: a trains by itself
    state = joined(state, "b", "c", now=T + 1.0, step=0)
    members, reason = rule.compute(state, T + 1.0, opts)
    assert ids(members) == ["a", "b", "c"], reason  # all there: at once
    # a group that never comes is waited for only until the timeout
    late = joined(rule.QuorumState(), "a", "b", step=0)
    for rid in ("a", "b"):
        late = rule.heartbeat(late, rid, T + 4.0)  # alive, still waiting
    assert rule.compute(late, T + 4.9, opts)[0] is None
    assert ids(rule.compute(late, T + 5.0, opts)[0]) == ["a", "b"]


def test_the_first_quorum_wait_ends_with_the_first_quorum() -> None:
    """Mid-run (a quorum was issued, or members report steps past 0: a restarted quorum service)
    a missing group is torchft's business: no wait for it."""
    opts = dataclasses.replace(OPTS, first_quorum_replicas=3, first_quorum_timeout_s=5.0)
    state = rule.tick(joined(rule.QuorumState(), "a", "b", "c", step=0), T, opts)[0]
    state, _ = rule.drop_failed(joined(state, "a", "b", step=1), "c")  # c's group died
    members, reason = rule.compute(state, T, opts)
    assert ids(members) == ["a", "b"], reason
    restarted = joined(rule.QuorumState(highest_step=40), "a", step=41)
    assert ids(rule.compute(restarted, T, opts)[0]) == ["a"]


def test_expired_heartbeat_is_not_a_participant() -> None:
    state = joined(rule.QuorumState(), "a")
    members, reason = rule.compute(state, T, OPTS)
    assert ids(members) == ["a"] and "[1/1 participants healthy][1 heartbeating]" in reason
    stale = T + OPTS.heartbeat_timeout_s
    members, reason = rule.compute(state, stale, OPTS)
    assert members is None and "[0/1 participants healthy][0 heartbeating]" in reason
    state = rule.join(state, member("b"), stale)
    members, reason = rule.compute(state, stale, OPTS)
    assert ids(members) == ["b"], reason


def test_min_replicas() -> None:
    opts = rule.QuorumOpts(min_replicas=3, join_timeout_s=0.0, heartbeat_timeout_s=5.0)
    state = joined(rule.QuorumState(), "a", "b")
    members, reason = rule.compute(state, T, opts)
    assert members is None and "need min_replicas 3" in reason
    members, _ = rule.compute(rule.join(state, member("c"), T), T, opts)
    assert ids(members) == ["a", "b", "c"]


def test_split_brain_needs_more_than_half_of_the_healthy() -> None:
    opts = rule.QuorumOpts(min_replicas=1, join_timeout_s=0.0, heartbeat_timeout_s=5.0)
    state = joined(rule.QuorumState(), "a", "b")
    for rid in ("c", "d"):
        state = rule.heartbeat(state, rid, T)
    members, reason = rule.compute(state, T, opts)  # 2 of 4: not more than half
    assert members is None and "need at least half of 4 healthy workers" in reason
    members, reason = rule.compute(rule.join(state, member("c"), T), T, opts)  # 3 of 4
    assert ids(members) == ["a", "b", "c"], reason


def test_fast_quorum_when_the_previous_quorum_rejoined() -> None:
    state = with_quorum("a")
    state = rule.heartbeat(state, "b", T)  # healthy, not joined: the full rule would wait
    state = joined(state, "a")
    members, reason = rule.compute(state, T, OPTS)
    assert ids(members) == ["a"] and reason.startswith("Fast quorum found!")
    # A newcomer that joined in time rides along (the quorum grows without a wait).
    members, reason = rule.compute(rule.join(state, member("b"), T), T, OPTS)
    assert ids(members) == ["a", "b"] and reason.startswith("Fast quorum")


def test_no_fast_quorum_while_a_previous_member_is_missing() -> None:
    state = joined(with_quorum("a", "b", "c"), "a", "c")
    members, reason = rule.compute(state, T, OPTS)
    assert members is None and "waiting for 1 healthy but not participating" in reason


def test_shrink_only_keeps_only_previous_members() -> None:
    state = with_quorum("a", "b")
    state = rule.join(state, member("a", shrink_only=True), T)
    state = rule.join(state, member("c", shrink_only=True), T)
    state = rule.join(state, member("b"), T)
    members, reason = rule.compute(state, T, OPTS)
    assert ids(members) == ["a", "b"] and "[shrink_only=true]" in reason


def test_participants_are_sorted_and_cleared_after_issue() -> None:
    state = joined(rule.QuorumState(), "replica_2:x", "replica_0:y", "replica_1:z")
    state, quorum, _ = rule.tick(state, T, OPTS)
    assert quorum is not None
    assert quorum.replica_ids == ("replica_0:y", "replica_1:z", "replica_2:x")
    assert state.participants == {} and state.prev_quorum == quorum
    assert rule.tick(state, T, OPTS)[1] is None  # nobody asked again


def test_quorum_id_bumps_on_member_change_or_commit_failure_only() -> None:
    state = with_quorum("a", "b")
    assert state.quorum_id == 1
    state, q, _ = rule.tick(joined(state, "a", "b"), T, OPTS)
    assert q is not None and q.quorum_id == 1  # same members, clean: same id
    state, q, _ = rule.tick(joined(state, "a", "b", commit_failures=1), T, OPTS)
    assert q is not None and q.quorum_id == 2  # same members, a failed commit: new id
    state, q, _ = rule.tick(joined(state, "a", "b", "c"), T, OPTS)
    assert q is not None and q.quorum_id == 3  # grew


def test_join_keeps_the_raw_member_it_was_given() -> None:
    m = rule.Member(replica_id="a", step=7, raw=b"\x0a\x01a\x20\x07\xd2\x02\x03new")
    state = rule.join(rule.QuorumState(), m, T)
    _, q, _ = rule.tick(state, T, OPTS)
    assert q is not None and q.members == (m,)


# --- the supervision tree's input ----------------------------------------------------------------


def test_failed_replica_gives_the_survivors_a_fast_quorum_at_once() -> None:
    a, b, c = "replica_0:u1", "replica_1:u2", "replica_2:u3"
    state = joined(with_quorum(a, b, c), a, c)  # b died; a and c asked again
    assert rule.compute(state, T, OPTS)[0] is None  # torchft alone: wait for b's heartbeat
    state, dropped = rule.drop_failed(state, rule.ids_of_replica(1))
    assert dropped == {b}
    members, reason = rule.compute(state, T, OPTS)
    assert ids(members) == [a, c] and reason.startswith("Fast quorum")
    state, q, _ = rule.tick(state, T, OPTS)
    assert q is not None and q.quorum_id == 2  # the dead member left: a new id, a new pg


def test_failure_before_the_survivors_ask_still_bumps_the_id() -> None:
    a, b = "replica_0:u1", "replica_1:u2"
    state, _ = rule.drop_failed(with_quorum(a, b), "replica_1:")
    state, q, _ = rule.tick(joined(state, a), T, OPTS)  # a saw no commit failure
    assert q is not None and q.replica_ids == (a,) and q.quorum_id == 2


def test_failed_replica_is_fenced_but_its_replacement_joins() -> None:
    a, b, b2 = "replica_0:u1", "replica_1:u2", "replica_1:new"
    state, dropped = rule.drop_failed(joined(with_quorum(a, b), b), "replica_1:")
    assert dropped == {b} and b not in state.participants and b not in state.heartbeats
    # A late heartbeat or a zombie's request cannot bring the dead id back.
    state = rule.join(rule.heartbeat(state, b, T), member(b), T)
    assert b not in state.heartbeats and b not in state.participants
    # The replacement (fresh uuid) waits for the survivor, then both form a fast quorum.
    state = rule.join(state, member(b2), T)
    assert rule.compute(state, T, OPTS)[0] is None
    members, reason = rule.compute(rule.join(state, member(a), T), T, OPTS)
    assert ids(members) == [a, b2] and reason.startswith("Fast quorum")


def test_a_sparse_quorum_waits_for_live_members_past_the_join_timeout() -> None:
    # a trains alone and skips quorums (harness.rank.trainer); b and c start late and join a round.
    # torchft's rule issues {b, c} at the join timeout (2 of 3 heartbeating: a majority), and the
    # job has two copies of the model, both committing. Seen in a real run before this rule.
    a, b, c = "replica_0:u1", "replica_1:u2", "replica_2:u3"
    torchft = rule.QuorumOpts(min_replicas=1, join_timeout_s=5.0, heartbeat_timeout_s=60.0)
    sparse = dataclasses.replace(torchft, wait_for_members=True)
    state = joined(rule.heartbeat(with_quorum(a), a, T), b, c)
    late = T + 10.0  # past the join timeout; a still heartbeats
    state = rule.heartbeat(state, a, late)
    assert ids(rule.compute(state, late, torchft)[0]) == [b, c]
    members, reason = rule.compute(state, late, sparse)
    assert members is None and "Waiting for 1 live member(s) of the last quorum" in reason
    # a asked when told that someone waits: all three at once
    members, reason = rule.compute(rule.join(state, member(a), late), late, sparse)
    assert ids(members) == [a, b, c] and reason.startswith("Fast quorum")
    # a member that was fenced (dead) or stopped heartbeating (cut off) is not waited for
    fenced, _ = rule.drop_failed(state, rule.ids_of_replica(0))
    assert ids(rule.compute(fenced, late, sparse)[0]) == [b, c]
    stale = late + 61.0  # a's heartbeat expired; b and c beat on
    cut = rule.heartbeat(rule.heartbeat(state, b, stale), c, stale)
    assert ids(rule.compute(cut, stale, sparse)[0]) == [b, c]


def test_dropping_only_matches_that_replicas_prefix() -> None:
    state = with_quorum("replica_1:u", "replica_10:v", "replica_11:w")
    state, dropped = rule.drop_failed(state, rule.ids_of_replica(1))
    assert dropped == {"replica_1:u"}
    assert rule.drop_failed(state, rule.ids_of_replica(7))[1] == frozenset()


def test_all_previous_members_failed_falls_back_to_the_full_rule() -> None:
    opts = rule.QuorumOpts(min_replicas=2, join_timeout_s=3600.0, heartbeat_timeout_s=5.0)
    state, _ = rule.drop_failed(with_quorum("replica_0:a"), "replica_0:")
    members, reason = rule.compute(rule.join(state, member("replica_0:b"), T), T, opts)
    assert members is None and "need min_replicas 2" in reason


def test_pure_transitions_do_not_touch_the_input_state() -> None:
    before = with_quorum("replica_0:a", "replica_1:b")
    snapshot = (dict(before.heartbeats), dict(before.participants), before.fenced)
    rule.drop_failed(joined(before, "replica_0:a"), "replica_1:")
    rule.tick(joined(before, "replica_0:a"), T, OPTS)
    assert (dict(before.heartbeats), dict(before.participants), before.fenced) == snapshot


# --- the wire codec ------------------------------------------------------------------------------

# A real QuorumRequest captured from torchft-nightly 2026.10.26's ManagerServer (replica_7, step
# 0, world_size 1, commit_failures 3, reconfigure handle "HANDLE"; zero fields are omitted).
CAPTURED = bytes.fromhex(
    "0a650a2e7265706c6963615f373a30623230356163652d313738642d346234642d383466642d343830353763"
    "6665636331631216687474703a2f2f3132372e302e302e313a33393539351a0f3132372e302e302e313a3335"
    "373239280140034a0648414e444c45"
)


def test_decodes_a_captured_manager_request() -> None:
    m = decode_quorum_request(CAPTURED)
    assert m.replica_id == "replica_7:0b205ace-178d-4b4d-84fd-48057cfecc1c"
    assert (m.step, m.world_size, m.shrink_only, m.commit_failures) == (0, 1, False, 3)
    assert m.raw == CAPTURED[2:]  # the member, byte for byte


def test_member_fields_and_negative_step_round_trip() -> None:
    raw = (
        encode_field(1, b"replica_3:x")
        + encode_field(4, -5)
        + encode_field(5, 2)
        + encode_field(6, 1)
        + encode_field(8, 4)
        + encode_field(99, b"future field")
    )
    m = decode_quorum_request(encode_field(1, raw))
    assert (m.replica_id, m.step, m.world_size, m.shrink_only, m.commit_failures) == (
        "replica_3:x",
        -5,
        2,
        True,
        4,
    )


def test_response_carries_members_verbatim() -> None:
    a = decode_quorum_request(CAPTURED)
    b = rule.Member(replica_id="b", raw=encode_field(1, b"b") + encode_field(77, b"?"))
    buf = encode_quorum_response(rule.Quorum(quorum_id=9, members=(a, b)), created=12.5)
    [(n, _, quorum)] = decode_fields(buf)
    assert n == 1 and isinstance(quorum, bytes)
    fields = decode_fields(quorum)
    assert fields[0] == (1, 0, 9)
    assert [v for f, _, v in fields if f == 2] == [a.raw, b.raw]
    [stamp] = [v for f, _, v in fields if f == 3]
    assert decode_fields(stamp) == [(1, 0, 12), (2, 0, 500_000_000)]


def test_heartbeat_and_varints() -> None:
    assert decode_heartbeat_request(encode_field(1, b"replica_0:a")) == "replica_0:a"
    for v in (0, 1, 127, 128, 300, 2**63 - 1):
        assert decode_fields(encode_field(4, v)) == [(4, 0, v)]
    assert len(encode_varint(-1)) == 10


@pytest.mark.parametrize(
    "bad",
    [b"\x0a\x05ab", b"\x08", b"\x0b", b"\x08\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff", b""],
)
def test_malformed_requests_are_rejected(bad: bytes) -> None:
    with pytest.raises(WireError):
        decode_quorum_request(bad)


# --- admission: only members the job started ----------------------------------------------------

SECRET = b"the job's secret"


def test_member_ids_carry_a_tag_only_the_secret_makes() -> None:
    rid = rule.member_id(SECRET, 3, 7)
    assert rid.startswith("replica_3.7.") and rid.endswith(".3")  # torchft reads trailing digits
    parsed = rule.parse_member_id(rid + ":0b205ace-178d-4b4d-84fd-48057cfecc1c")
    assert parsed == rule.MemberId(replica=3, incarnation=7, tag=rule.member_tag(SECRET, 3, 7))
    assert rule.member_tag(b"another secret", 3, 7) != parsed.tag
    assert rule.parse_member_id("replica_3:uuid") is None
    # The replica number is said twice; both must agree.
    assert rule.parse_member_id(rid[:-1] + "4") is None


def test_refusal_lets_in_only_valid_tags_of_the_newest_incarnation() -> None:
    state = rule.QuorumState()
    good = rule.member_id(SECRET, 1, 0) + ":u"
    assert rule.refusal(state, good, SECRET) is None
    assert "no valid member tag" in rule.refusal(state, "replica_1:u", SECRET)
    forged = f"replica_1.0.{'0' * 16}.1:u"
    assert "wrong member tag" in rule.refusal(state, forged, SECRET)
    # A real tag copied onto another replica or incarnation is wrong there.
    tag = rule.parse_member_id(good).tag
    assert "wrong member tag" in rule.refusal(state, f"replica_2.0.{tag}.2:u", SECRET)
    assert "wrong member tag" in rule.refusal(state, f"replica_1.1.{tag}.1:u", SECRET)
    # A program's Manager forwarded by the quorum tap: its own id after the tag (tap.upstream_id).
    assert rule.refusal(state, rule.member_id(SECRET, 1, 0) + ":train_ddp_1:u", SECRET) is None
    # No untagged id gets in, whatever its address (there is no allow-list any more).
    assert "no valid member tag" in rule.refusal(state, "train_ddp_1:u", SECRET)
    assert rule.refusal(state, good, None) is not None  # no secret: nobody


def test_a_newer_incarnation_fences_the_older_one() -> None:
    old, new = rule.member_id(SECRET, 1, 0) + ":a", rule.member_id(SECRET, 1, 1) + ":b"
    other = rule.member_id(SECRET, 0, 0) + ":c"
    state = joined(rule.QuorumState(), old, other)
    state, dropped = rule.admit(state, 1, 1)
    assert dropped == {old} and old not in state.heartbeats and other in state.heartbeats
    assert "declared failed" in rule.refusal(state, old, SECRET)
    # Any id of the old incarnation, even one never seen (a restarted Manager of a zombie).
    unseen = rule.member_id(SECRET, 1, 0) + ":z"
    assert "replaced by incarnation 1" in rule.refusal(state, unseen, SECRET)
    assert rule.refusal(state, new, SECRET) is None
    assert rule.admit(state, 1, 0) == (state, frozenset())  # never backwards


def test_seeing_a_newer_incarnation_fences_the_older_one_too() -> None:
    # A restarted quorum service has not been told; the newer id's first request tells it.
    old, new = rule.member_id(SECRET, 1, 4) + ":a", rule.member_id(SECRET, 1, 5) + ":b"
    state = rule.heartbeat(joined(rule.QuorumState(), old), new, T)
    assert state.incarnations == {1: 5} and old not in state.participants
    assert rule.refusal(state, old, SECRET) is not None


def test_stale_heartbeats_are_pruned() -> None:
    state = rule.QuorumState()
    for ghost in ("ghost_a", "ghost_b", "ghost_c"):
        state = rule.heartbeat(state, ghost, T)
    later = T + OPTS.heartbeat_timeout_s
    state, quorum, _ = rule.tick(rule.join(state, member("a"), later), later, OPTS)
    assert dict(state.heartbeats) == {"a": later}
    assert quorum is not None and quorum.replica_ids == ("a",)


def test_absurd_steps_are_refused() -> None:
    opts = rule.QuorumOpts(max_step=100, max_step_lead=10)
    state = rule.QuorumState()
    assert "negative" in rule.step_refusal(state, member("a", step=-1), opts)
    assert "beyond the job's last step 100" in rule.step_refusal(state, member("a", step=101), opts)
    assert rule.step_refusal(state, member("a", step=50), opts) is None  # the first: any sane step
    state = rule.join(state, member("a", step=50), T)
    assert rule.step_refusal(state, member("b", step=60), opts) is None
    assert "more than 10 past" in rule.step_refusal(state, member("b", step=61), opts)
    default = rule.QuorumOpts()
    assert rule.step_refusal(state, member("b", step=10**12), default) is not None


# --- committed steps never go back ---------------------------------------------------------------


def test_a_quorum_of_members_behind_the_job_waits_for_a_member_at_its_step() -> None:
    """The soak's divergence: groups restarted from an old checkpoint (step 1400) must not meet
    without the group at the job's step (1567) and commit steps 1401.. again."""
    opts = rule.QuorumOpts(min_replicas=1, join_timeout_s=1.0, heartbeat_timeout_s=5.0)
    state = joined(rule.QuorumState(), "a", step=1567)
    state, quorum, _ = rule.tick(state, T, opts)
    assert quorum is not None
    state = joined(state, "b", "c", "d", step=1400, now=T + 1)
    state, quorum, reason = rule.tick(state, T + 3, opts)  # past the join timeout
    assert quorum is None
    assert "Waiting for a member at step 1567" in reason
    state = joined(state, "a", step=1567, now=T + 4)  # the group at the job's step asks
    state, quorum, _ = rule.tick(state, T + 4, opts)
    assert quorum is not None and ids(quorum.members) == ["a", "b", "c", "d"]


def test_a_whole_job_restart_may_commit_earlier_steps_again() -> None:
    opts = rule.QuorumOpts(min_replicas=1, join_timeout_s=1.0, heartbeat_timeout_s=5.0)
    state = rule.job_restarted(joined(rule.QuorumState(), "a", step=1567))
    state = joined(state, "b", "c", step=1400, now=T + 1)
    _, quorum, _ = rule.tick(state, T + 3, opts)
    assert quorum is not None and ids(quorum.members) == ["b", "c"]


def test_a_step_whose_only_holders_failed_is_not_waited_for() -> None:
    """The CI soak's livelock: right after a quorum-service restart one group committed a step
    alone, then died; the others, a step behind, waited for a member at that step forever. Once
    every member that reported the step is fenced, its state is gone: the others go on."""
    opts = rule.QuorumOpts(min_replicas=1, join_timeout_s=1.0, heartbeat_timeout_s=5.0)
    state = joined(rule.QuorumState(), "a", step=2357)
    state, quorum, _ = rule.tick(state, T, opts)
    assert quorum is not None
    state = joined(state, "b", "c", step=2356, now=T + 1)
    state, quorum, reason = rule.tick(state, T + 3, opts)
    assert quorum is None and "Waiting for a member at step 2357" in reason  # a is alive
    state, dropped = rule.drop_failed(state, "a")
    assert dropped == {"a"}
    state, quorum, _ = rule.tick(state, T + 4, opts)
    assert quorum is not None and ids(quorum.members) == ["b", "c"]


def test_next_change_is_when_time_alone_could_change_the_answer() -> None:
    opts = rule.QuorumOpts(min_replicas=1, join_timeout_s=30.0, heartbeat_timeout_s=5.0)
    assert rule.next_change(rule.QuorumState(), opts) is None  # no round open
    state = rule.heartbeat(rule.QuorumState(), "c", T - 2.0)  # a straggler that only beats
    assert rule.next_change(state, opts) is None
    state = joined(state, "a", "b", now=T)
    # c's heartbeat goes stale first (then the round of a and b is no longer waiting for it)
    assert rule.next_change(state, opts) == T - 2.0 + opts.heartbeat_timeout_s
    for rid in "abc":
        state = rule.heartbeat(state, rid, T + 100.0)
    assert rule.next_change(state, opts) == T + opts.join_timeout_s  # the join timeout first
    # Until then nothing changes on its own; at it, the round is issued without the straggler.
    members, _ = rule.compute(state, T + opts.join_timeout_s - 0.001, opts)
    assert members is None
    members, _ = rule.compute(state, T + opts.join_timeout_s, opts)
    assert ids(members) == ["a", "b"]


# --- a replacement that must heal joins after the survivors' first step --------------------------


def _after_death() -> tuple[rule.QuorumState, str, str, str]:
    """a, b, c trained to step 10 together; b died (fenced); b's replacement b2 (a warm spare,
    step 0: it must heal) asked before the survivors did."""
    a, b, b2, c = "replica_0:u1", "replica_1:u2", "replica_1:new", "replica_2:u3"
    state, quorum, _ = rule.tick(joined(rule.QuorumState(), a, b, c, step=10), T, OPTS)
    assert quorum is not None
    state, _ = rule.drop_failed(state, rule.ids_of_replica(1))
    return rule.join(state, member(b2, step=0), T), a, b2, c


def test_a_replacement_behind_waits_for_the_survivors_first_step_after_a_death() -> None:
    """bench multihost: a warm spare adopted 20 ms after the detection was in the survivors'
    first quorum, and the survivors resumed only after its cross-host heal (2.07 s)."""
    state, a, b2, c = _after_death()
    state = joined(state, a, c, step=10)
    members, reason = rule.compute(state, T, OPTS)
    assert ids(members) == [a, c] and reason.startswith("Fast quorum found!")
    assert "1 newcomer(s) behind" in reason
    state, quorum, _ = rule.tick(state, T, OPTS)
    assert quorum is not None and quorum.replica_ids == (a, c) and quorum.quorum_id == 2
    # It asks again (harness.quorum.tree does, for a request a quorum was issued without) and is
    # in the survivors' next round: deferred once, not left out of every fast quorum.
    state = joined(rule.join(state, member(b2, step=0), T + 1), a, c, step=11, now=T + 1)
    state, quorum, reason = rule.tick(state, T + 1, OPTS)
    assert quorum is not None and quorum.replica_ids == (a, b2, c) and quorum.quorum_id == 3
    assert "behind" not in reason


def test_a_newcomer_at_the_survivors_step_is_not_held_back() -> None:
    """A group coming back with its state (step 10, as the survivors) needs no heal."""
    state, a, b2, c = _after_death()
    state = rule.join(state, member(b2, step=10), T)
    members, reason = rule.compute(joined(state, a, c, step=10), T, OPTS)
    assert ids(members) == [a, b2, c] and "behind" not in reason


def test_a_newcomer_behind_rides_along_when_no_member_died() -> None:
    """A group that starts late (no fence since the last quorum) joins the next fast quorum as in
    torchft, and heals in it: nobody else's step is at stake twice."""
    a, b = "replica_0:u1", "replica_1:u2"
    state = joined(with_quorum(a), b, step=0)
    members, _ = rule.compute(joined(state, a, step=10), T, OPTS)
    assert ids(members) == [a, b]


def test_a_newcomer_is_not_deferred_below_min_replicas() -> None:
    state, a, b2, c = _after_death()
    opts = dataclasses.replace(OPTS, min_replicas=3)
    members, reason = rule.compute(joined(state, a, c, step=10), T, opts)
    assert ids(members) == [a, b2, c] and "behind" not in reason


def test_deferring_keeps_the_first_quorum_and_the_high_water_mark_as_they_were() -> None:
    # The job's first quorum (none issued): every participant, at any step, as before.
    state = joined(joined(rule.QuorumState(), "a", step=10), "b", step=0)
    assert ids(rule.compute(state, T, OPTS)[0]) == ["a", "b"]
    # Survivors behind a live member's step still wait for it (no step goes back).
    state, a, _, c = _after_death()
    x = "replica_3:x"  # alive (not fenced), reported step 12, not asking now
    state = dataclasses.replace(state, reported=rule._with(state.reported, x, 12))
    state = rule.heartbeat(joined(state, a, c, step=10), x, T)
    members, reason = rule.compute(state, T, OPTS)
    assert members is None and "Waiting for a member at step 12" in reason
