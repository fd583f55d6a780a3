"""The quorum tap's rewriting of the Lighthouse protocol (harness/quorum/tap.py): a program's
Manager goes upstream under its incarnation's tagged id and comes back under its own, every
other byte as it was."""

from __future__ import annotations

from harness.quorum import rule, tap
from harness.quorum.wire import (
    decode_fields,
    decode_heartbeat_request,
    decode_quorum_request,
    decode_quorum_response,
    encode_field,
    encode_quorum_response,
)

SECRET = b"s" * 32


def _member(rid: str, step: int = 5) -> bytes:
    """A QuorumMember with the fields a Manager sends, an unknown field (99) and a fixed64."""
    return (
        encode_field(1, rid.encode())
        + encode_field(2, b"http://host:1234")
        + encode_field(3, b"127.0.0.1:2345")
        + encode_field(4, step)
        + encode_field(5, 2)
        + encode_field(7, b'{"k": 1}')
        + encode_field(99, b"future field")
        + (12 << 3 | 1).to_bytes(1, "little")
        + (7).to_bytes(8, "little")
    )


def test_upstream_id_is_tagged_and_fenced_with_its_group() -> None:
    tagged = rule.member_id(SECRET, 3, 2)
    up = tap.upstream_id(tagged, "train_ddp_3:uuid")
    assert up == f"{tagged}:train_ddp_3:uuid"
    parsed = rule.parse_member_id(up)
    assert parsed is not None and (parsed.replica, parsed.incarnation) == (3, 2)
    assert up.startswith(rule.ids_of_replica(3))  # TreeQuorum.replica_failed fences it
    assert tap.upstream_id("", "train_ddp_3:uuid") == "train_ddp_3:uuid"  # nobody to name it


def test_a_request_goes_up_renamed_and_otherwise_unchanged() -> None:
    raw = _member("train_ddp_0:u")
    request = encode_field(1, raw)
    up = tap.with_requester_id(request, "replica_0.0.x.0:train_ddp_0:u")
    member = decode_quorum_request(up)
    assert member.replica_id == "replica_0.0.x.0:train_ddp_0:u"
    before = [f for f in decode_fields(raw) if f[0] != 1]
    after = [f for f in decode_fields(member.raw) if f[0] != 1]
    assert before == after  # every other field, the unknown and fixed-width ones included
    assert tap.store_address(member.raw) == "127.0.0.1:2345"
    beat = tap._with_id(encode_field(1, b"train_ddp_0:u"), "T:train_ddp_0:u")
    assert decode_heartbeat_request(beat) == "T:train_ddp_0:u"


def test_a_reply_comes_back_with_each_program_member_under_its_own_id() -> None:
    a, b = rule.member_id(SECRET, 0, 0), rule.member_id(SECRET, 1, 4)
    up_a, up_b = f"{a}:train_ddp_0:u", f"{b}:train_ddp_1:v"
    quorum = rule.Quorum(
        quorum_id=9,
        members=(
            rule.Member(replica_id=up_a, step=5, raw=_member(up_a)),
            rule.Member(replica_id=up_b, step=6, raw=_member(up_b, 6)),
        ),
    )
    reply = encode_quorum_response(quorum, 1234.5)
    ids = {up_a: "train_ddp_0:u", up_b: "train_ddp_1:v"}
    down = tap.rewritten(reply, None, ids)
    qid, members = decode_quorum_response(down)
    assert qid == 9
    assert [(m.replica_id, m.step) for m in members] == [("train_ddp_0:u", 5), ("train_ddp_1:v", 6)]
    assert members[1].raw == _member("train_ddp_1:v", 6)  # byte for byte but the id
    # The rest of the reply (the creation time) is unchanged; renumbering changes only the id.
    assert (
        decode_fields(decode_fields(down)[0][2])[-1]
        == decode_fields(decode_fields(reply)[0][2])[-1]
    )
    again = tap.rewritten(reply, 12, ids)
    assert decode_quorum_response(again)[0] == 12
    assert decode_quorum_response(tap.rewritten(reply, 12, {})) == (
        12,
        decode_quorum_response(reply)[1],
    )
    # An id the tap does not know (none should appear) stays as the service sent it.
    only_a = tap.rewritten(reply, None, {up_a: "train_ddp_0:u"})
    assert [m.replica_id for m in decode_quorum_response(only_a)[1]] == ["train_ddp_0:u", up_b]
