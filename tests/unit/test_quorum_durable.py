"""The tree quorum's state file (``harness.quorum.durable``): what it keeps, what it refuses, and
the quorum-id lease that keeps a resumed service's ids above every id issued before. No sockets
(the resume itself, with real torchft clients and trainers: tests/integration/
test_tree_quorum_resume.py)."""

from __future__ import annotations

import json
import random
import stat
from pathlib import Path
from typing import Any

import pytest

from harness.quorum import durable, rule
from harness.quorum.durable import LEASE_BLOCK, QuorumSnapshot, QuorumStateError, next_lease

SECRET = bytes(range(32))


def snapshot(**kw: Any) -> QuorumSnapshot:
    fields: dict[str, Any] = {
        "host": "127.0.0.1",
        "port": 29510,
        "secret": SECRET,
        "incarnations": {0: 2, 1: 0, 12: 5},
        "fenced": frozenset({rule.member_id(SECRET, 0, 1) + ":dead"}),
        "quorum_id_lease": 301,
        "last_quorum": (rule.member_id(SECRET, 0, 2) + ":a", rule.member_id(SECRET, 1, 0) + ":b"),
        "highest_step": 41,
        "reported": {
            rule.member_id(SECRET, 0, 2) + ":a": 41,
            rule.member_id(SECRET, 1, 0) + ":b": 40,
        },
    }
    fields.update(kw)
    return QuorumSnapshot(**fields)


def test_a_saved_state_reads_back_whole_and_private(tmp_path: Path) -> None:
    path = tmp_path / "quorum.json"
    s = snapshot()
    durable.save(path, s)
    assert durable.load(path) == s
    assert stat.S_IMODE(path.stat().st_mode) == 0o600  # it holds the secret
    assert [p.name for p in tmp_path.iterdir()] == ["quorum.json"]  # no temporary file left
    doc = json.loads(path.read_text())
    assert doc["member_ids"]["0"] == rule.member_id(SECRET, 0, 2)  # for a reader
    # A second save replaces the first whole.
    durable.save(path, snapshot(quorum_id_lease=401, reported={}))
    assert durable.load(path).quorum_id_lease == 401


def _edited(tmp_path: Path, edit: Any, *, keep_digest: bool = False) -> Path:
    """A saved file with ``edit(doc)`` applied (the digest recomputed unless ``keep_digest``:
    so each check is reached, not only the digest's)."""
    path = tmp_path / "quorum.json"
    durable.save(path, snapshot())
    doc = json.loads(path.read_text())
    edit(doc)
    if not keep_digest and "digest" in doc:
        doc["digest"] = durable._digest(doc)
    path.write_text(json.dumps(doc))
    return path


@pytest.mark.parametrize(
    ("edit", "problem"),
    [
        (lambda d: d.pop("quorum_id_lease"), "missing key(s) quorum_id_lease"),
        (lambda d: d.pop("secret") and d.pop("port"), "missing key(s) port, secret"),
        (lambda d: d.update(extra=1), "unknown key(s) extra"),
        (lambda d: d.update(format="ftharness.tree-quorum.v0"), "format is"),
        (lambda d: d.update(port="29510"), "port must be an integer"),
        (lambda d: d.update(port=0), "port must be an integer in [1, 65535]"),
        (lambda d: d.update(quorum_id_lease=True), "quorum_id_lease must be an integer"),
        (lambda d: d.update(quorum_id_lease=2.5), "quorum_id_lease must be an integer"),
        (lambda d: d.update(highest_step=-2), "highest_step must be an integer in [-1"),
        (lambda d: d.update(host=""), "host must be a non-empty string"),
        (lambda d: d.update(secret="xyz"), "secret is not a lower-case hex string"),
        (lambda d: d.update(secret="ab" * 8 + "AB"), "secret is not a lower-case hex string"),
        (lambda d: d["incarnations"].update({"0": -1}), "incarnations['0'] must be a non-neg"),
        (lambda d: d["incarnations"].update({"x": 1}), "'x' is not a replica group number"),
        (lambda d: d["incarnations"].update({"0": 3}), "member_ids do not follow"),
        (lambda d: d.update(secret="ab" * 32), "member_ids do not follow"),
        (lambda d: d.update(reported=[1, 2]), "reported must be an object"),
        (lambda d: d["reported"].update(x="1"), "reported['x'] must be a non-negative integer"),
        (lambda d: d.update(fenced="replica_0"), "fenced must be a list of non-empty strings"),
        (lambda d: d.update(last_quorum=["a", "a"]), "last_quorum lists a member twice"),
        (lambda d: d.update(saved="yesterday"), "saved must be a time in seconds"),
    ],
)
def test_a_hand_edited_or_broken_file_is_refused_with_its_problem(
    tmp_path: Path, edit: Any, problem: str
) -> None:
    path = _edited(tmp_path, edit)
    with pytest.raises(QuorumStateError) as err:
        durable.load(path)
    assert problem in err.value.problem
    assert str(path) in str(err.value) and "refusing to resume" in str(err.value)


def test_a_plausible_hand_edit_is_caught_by_the_digest(tmp_path: Path) -> None:
    # A lower lease is well-typed, and would reuse quorum ids: only the digest can tell.
    path = _edited(tmp_path, lambda d: d.update(quorum_id_lease=2), keep_digest=True)
    with pytest.raises(QuorumStateError, match="digest does not match"):
        durable.load(path)


def test_a_torn_truncated_or_missing_file_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "quorum.json"
    durable.save(path, snapshot())
    whole = path.read_bytes()
    for cut in (0, 1, len(whole) // 3, len(whole) // 2, len(whole) - 3):
        path.write_bytes(whole[:cut])
        with pytest.raises(QuorumStateError, match="not valid JSON, torn or truncated"):
            durable.load(path)
    path.write_bytes(whole[:100] + b"\xff\xfe" + whole[102:])
    with pytest.raises(QuorumStateError, match="not valid JSON"):
        durable.load(path)
    path.write_text("[1, 2]")
    with pytest.raises(QuorumStateError, match="not a JSON object but list"):
        durable.load(path)
    with pytest.raises(QuorumStateError, match="cannot be read"):
        durable.load(tmp_path / "absent.json")


def test_the_lease_is_raised_in_blocks_only_when_an_id_reaches_it() -> None:
    assert next_lease(1, 1) == 1 + LEASE_BLOCK
    assert next_lease(50, 101) is None  # covered: no write
    assert next_lease(100, 101) is None
    assert next_lease(101, 101) == 101 + LEASE_BLOCK
    assert next_lease(7, 1, block=3) == 10


def test_no_quorum_id_is_reused_across_many_resumes() -> None:
    """A service numbers quorums as the tree does (a new id when membership changes), raises
    its durable lease before an id reaches it, and dies at random moments: between any two
    steps, even between raising the lease and issuing the id. Each resume starts from the file's
    lease. Over many lives no id is issued twice or goes back, and the file is written about
    once per block of ids."""
    rng = random.Random(26)
    disk_lease = 1  # what a fresh service writes before it serves
    issued: list[int] = []
    writes = 0
    for _life in range(150):
        lease = quorum_id = disk_lease  # a resume: quorum_id = the saved lease
        for _ in range(rng.randrange(0, 200)):
            candidate = quorum_id + rng.choice((0, 1))  # 0: the same members, the same id
            if new := next_lease(candidate, lease, block=17):
                if rng.random() < 0.02:
                    break  # died before the lease was durable: nothing issued
                lease = disk_lease = new
                writes += 1
                if rng.random() < 0.02:
                    break  # died after the write, before issuing
            quorum_id = candidate
            if not issued or candidate != issued[-1]:
                issued.append(candidate)  # a new id handed out (a repeat is the same quorum)
            else:
                assert issued.count(candidate) == 1
    assert issued == sorted(issued) and len(set(issued)) == len(issued)
    assert writes <= len(issued) // 17 + 150 + 1


def test_the_writer_never_replaces_a_newer_snapshot_and_can_be_dropped(tmp_path: Path) -> None:
    path = tmp_path / "quorum.json"
    latest: list[QuorumSnapshot] = []
    writer = durable.StateWriter(path, lambda: latest[-1] if latest else None, interval_s=0.01)
    try:
        old = snapshot(quorum_id_lease=401, seq=durable.next_seq())
        new = snapshot(quorum_id_lease=501, seq=durable.next_seq())
        writer.save(new)
        writer.save(old)  # taken earlier, written later (a background write racing a lease)
        assert durable.load(path).quorum_id_lease == 501
        latest.append(snapshot(quorum_id_lease=601, seq=durable.next_seq()))
        writer.changed()  # the background thread writes it soon
        for _ in range(500):
            if durable.load(path).quorum_id_lease == 601:
                break
            writer._stop.wait(0.01)
        assert durable.load(path).quorum_id_lease == 601
    finally:
        latest.append(snapshot(quorum_id_lease=701, seq=durable.next_seq()))
        writer.close(flush=False)  # a start that failed: the file stays as it was
    assert durable.load(path).quorum_id_lease == 601


def test_admitting_a_new_incarnation_fences_ids_known_only_by_their_steps() -> None:
    """A resumed service knows its members by their saved steps alone (no heartbeats yet, no
    pending joins): admitting a group's next incarnation, or declaring it failed, must still
    fence them, or a dead member's saved step would hold every quorum up."""
    old = rule.member_id(SECRET, 0, 0) + ":u"
    other = rule.member_id(SECRET, 1, 0) + ":v"
    state = rule.QuorumState(reported=rule._frozen({old: 40, other: 41}))
    state, dropped = rule.admit(state, 0, 1)
    assert dropped == {old} and old in state.fenced and dict(state.reported) == {other: 41}
    state, dropped = rule.drop_failed(state, rule.ids_of_replica(1))
    assert dropped == {other} and not state.reported
