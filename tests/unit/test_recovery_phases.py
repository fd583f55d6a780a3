"""Recovery phases derived from the journal (harness/job/recovery.py), fed records in the orders a
real job can write them."""

from __future__ import annotations

from harness.job.recovery import HEALED, RecoveryTracker
from runtime.failure import Cause, Failure
from runtime.journal import (
    CHECKPOINT_SAVE,
    CHECKPOINT_START,
    FAULT_INJECT,
    HEAL_START,
    RECOVERY_PHASE,
    SERVE_START,
    STEP_ABORT,
    STEP_COMMIT,
    Journal,
)


def _tracker() -> tuple[Journal, RecoveryTracker, list[dict]]:
    journal = Journal(None, job="unit")
    phases: list[dict] = []
    journal.add_sink(lambda r: phases.append(r) if r["event"] == RECOVERY_PHASE else None)
    return journal, RecoveryTracker(journal), phases


def _kill_group_1(journal: Journal, tracker: RecoveryTracker) -> None:
    tracker.on_failure(
        Failure(
            cause=Cause.SIGNAL,
            detail="SIGKILL",
            coords={"replica": 1, "rank": 0},
            t_event=100.0,
            t_detected=100.0,
        )
    )
    tracker.replacement_started(1)
    journal.emit(HEALED, t=100.4, replica=1, rank=0)


def _commit(journal: Journal, replica: int, step: int, t: float, participants: int) -> None:
    journal.emit(STEP_COMMIT, t=t, replica=replica, rank=0, step=step, participants=participants)


def test_survivors_commit_first_then_the_replacement() -> None:
    journal, tracker, phases = _tracker()
    _kill_group_1(journal, tracker)
    _commit(journal, 0, 13, 100.2, 2)
    _commit(journal, 1, 14, 100.5, 3)
    got = {p["phase"]: p["t"] for p in phases}
    assert got["survivors_resumed"] == 100.2 and got["participating"] == 100.5
    assert tracker.open_count == 0


def test_a_joint_commit_logged_by_the_replacement_first_still_shows_the_survivors() -> None:
    # A warm spare can rejoin before the survivors commit anything alone: the first commit
    # after the failure is a joint one, and the replacement's record may come first.
    journal, tracker, phases = _tracker()
    _kill_group_1(journal, tracker)
    _commit(journal, 1, 13, 100.5, 3)
    _commit(journal, 0, 13, 100.5, 3)
    assert [p["phase"] for p in phases] == [
        "detected",
        "replacement_started",
        "healed",
        "survivors_resumed",
        "participating",
    ]
    assert {p["phase"]: p["t"] for p in phases}["survivors_resumed"] == 100.5


def test_a_replacement_committing_alone_does_not_count_as_the_survivors() -> None:
    journal, tracker, phases = _tracker()
    _kill_group_1(journal, tracker)
    _commit(journal, 1, 13, 100.5, 1)
    assert "survivors_resumed" not in [p["phase"] for p in phases]


def _lost(tracker: RecoveryTracker, replica: int, host: str, t: float) -> None:
    tracker.on_failure(
        Failure(
            cause=Cause.LOST_HOST,
            detail=f"host {host} lost",
            host=host,
            coords={"replica": replica, "rank": 0},
            t_event=t,
            t_detected=t,
        )
    )


def test_a_host_eviction_explains_the_recovery_of_every_group_on_that_host() -> None:
    # 4 groups on 2 hosts (group % 2): evicting host1 takes down groups 1 and 3 at once.
    journal, tracker, phases = _tracker()
    journal.emit(
        FAULT_INJECT, t=100.0, fault_id="f007", kind="host_eviction", target={"host": "host1"}
    )
    _lost(tracker, 1, "host1", 100.1)
    _lost(tracker, 3, "host1", 100.1)
    _lost(tracker, 0, "host0", 100.2)  # a group on the other host is not the eviction's doing
    detected = {p["replica"]: p["fault_id"] for p in phases if p["phase"] == "detected"}
    assert detected == {1: "f007", 3: "f007", 0: None}
    for replica in (0, 1, 3):
        tracker.replacement_started(replica)
    for replica in (0, 1, 3):
        _commit(journal, replica, 14, 104.0, 4)
    assert tracker.open_count == 0
    # Group 1 fails again within the link window, after its recovery: not the eviction either.
    _lost(tracker, 1, "host1", 110.0)
    (again,) = [p for p in phases if p["phase"] == "detected" and p["t"] == 110.0]
    assert again["fault_id"] is None


def test_a_replica_fault_explains_only_its_group_and_only_once() -> None:
    journal, tracker, phases = _tracker()
    journal.emit(
        FAULT_INJECT, t=99.9, fault_id="f001", kind="kill", target={"replica": 1, "host": "h1"}
    )
    _kill_group_1(journal, tracker)
    _lost(tracker, 2, "h1", 100.1)  # another group on the same host: not a replica fault's doing
    _commit(journal, 1, 14, 100.5, 2)
    _kill_group_1(journal, tracker)  # group 1 again, after its recovery closed
    linked = [(p["replica"], p["fault_id"]) for p in phases if p["phase"] == "detected"]
    assert linked == [(1, "f001"), (2, None), (1, None)]


def test_an_idle_spare_lost_with_its_host_is_not_a_recovery() -> None:
    journal, tracker, phases = _tracker()
    journal.emit(
        FAULT_INJECT, t=100.0, fault_id="f007", kind="host_eviction", target={"host": "host1"}
    )
    tracker.on_failure(
        Failure(
            cause=Cause.LOST_HOST,
            detail="host host1 lost",
            host="host1",
            coords={"idle": 0},
            t_event=100.1,
            t_detected=100.1,
        )
    )
    _lost(tracker, 1, "host1", 100.1)
    assert [(p["replica"], p["fault_id"]) for p in phases] == [(1, "f007")]
    assert tracker.open_replicas() == {1}


def test_a_step_abort_is_explained_only_by_the_latest_fault() -> None:
    # A straggler on group 2 aborts nothing; then host1 is evicted and group 2, a survivor,
    # aborts its step: that is the eviction's doing, not a recovery of the straggler's.
    journal, tracker, phases = _tracker()
    target = {"replica": 2, "rank": 0, "host": "host0"}
    journal.emit(FAULT_INJECT, t=100.0, fault_id="f010", kind="slow_rank", target=target)
    journal.emit(
        FAULT_INJECT, t=106.7, fault_id="f011", kind="host_eviction", target={"host": "host1"}
    )
    _lost(tracker, 1, "host1", 106.7)
    journal.emit(STEP_ABORT, t=106.73, replica=2, rank=0, step=5)
    assert {p["replica"] for p in phases} == {1}
    # a collective abort on group 2 is the latest fault: its abort is its recovery
    journal.emit(FAULT_INJECT, t=120.0, fault_id="f012", kind="collective_abort", target=target)
    journal.emit(STEP_ABORT, t=120.01, replica=2, rank=0, step=9)
    detected = [(p["replica"], p["fault_id"]) for p in phases if p["phase"] == "detected"]
    assert detected == [(1, "f011"), (2, "f012")]


def test_the_stop_step_is_ahead_by_the_skew_at_the_recent_rate() -> None:
    journal, tracker, _ = _tracker()
    assert tracker.stop_step() == 2  # nothing committed yet: at least two ahead
    for step in range(1, 21):  # 20 steps a second: 10 in the default 0.5 s of skew
        for replica in range(3):
            journal.emit(STEP_COMMIT, t=100.0 + step / 20, replica=replica, rank=0, step=step)
    assert tracker.committed_step == 20
    assert tracker.stop_step() == 20 + 1 + 10
    assert tracker.stop_step(skew_s=0.01) == 20 + 1 + 1  # never less than two ahead


def test_a_survivor_restarted_for_asking_for_no_quorum_is_explained_by_the_deaths_fault() -> None:
    """A program's survivor that a death left blocked (harness.job.program.progress): its
    recovery has cause blocked_survivor and the fault of the death, and the controller's kill of
    it that follows belongs to it."""
    journal, tracker, phases = _tracker()
    journal.emit(FAULT_INJECT, t=99.9, fault_id="f0", kind="kill", target={"replica": 1})
    _kill_group_1(journal, tracker)
    tracker.failed_as_survivor(2, dead=1, t=102.1)
    tracker.on_failure(
        Failure(
            cause=Cause.MISSED_HEARTBEAT,
            detail="replica group 2 asked for no quorum for 2.1 s after replica group 1 died",
            coords={"replica": 2, "rank": 0},
            t_event=102.1,
            t_detected=102.1,
        )
    )
    detected = [p for p in phases if p["phase"] == "detected"]
    assert [(p["replica"], p["fault_id"], p["cause"]) for p in detected] == [
        (1, "f0", "signal"),
        (2, "f0", "blocked_survivor"),
    ]
    # a later death of the same group that no fault explains does not borrow its old fault
    tracker.on_record({"event": STEP_COMMIT, "t": 103.0, "replica": 1, "rank": 0, "step": 20,
                       "participants": 3})  # fmt: skip
    tracker.on_failure(
        Failure(
            cause=Cause.SIGNAL,
            detail="SIGKILL",
            coords={"replica": 1, "rank": 0},
            t_event=200.0,
            t_detected=200.0,
        )
    )
    tracker.failed_as_survivor(0, dead=1, t=202.1)
    assert [p["fault_id"] for p in phases if p["phase"] == "detected"][-1] is None
    # a death no fault explains leaves its blocked survivor unexplained too
    journal, tracker, phases = _tracker()
    _kill_group_1(journal, tracker)
    tracker.failed_as_survivor(2, dead=1, t=102.1)
    assert [p["fault_id"] for p in phases if p["phase"] == "detected"] == [None, None]


def test_a_heal_is_under_way_from_its_start_to_its_end_or_its_sources_death() -> None:
    """``heals_under_way`` (what ``heal_source_kill`` aims by): a group's rank 0 began a heal
    from a tagged source whose rank 0 began to send, and neither its ``trainer.healed``, its next
    commit, nor its own or its source's failure came since (nor the source's commit)."""
    journal, tracker, _ = _tracker()
    source = "replica_2.1.0123456789abcdef.2"
    journal.emit(HEAL_START, replica=1, rank=1, source=source, step=5)  # not rank 0's
    assert tracker.heals_under_way() == {}
    journal.emit(HEAL_START, replica=1, rank=0, source=source, step=5)
    journal.emit(HEAL_START, replica=0, rank=0, source="not-a-member-id", step=5)
    assert tracker.heals_under_way() == {}  # its source has not begun to send
    journal.emit(SERVE_START, replica=2, rank=1, step=5, to=[1])  # not rank 0's
    assert tracker.heals_under_way() == {}
    journal.emit(SERVE_START, replica=2, rank=0, step=5, to=[1])
    assert tracker.heals_under_way() == {1: 2}
    journal.emit(HEALED, replica=1, rank=0)
    assert tracker.heals_under_way() == {}
    journal.emit(HEAL_START, replica=1, rank=0, source=source, step=6)
    _commit(journal, 1, 7, 101.0, 3)
    assert tracker.heals_under_way() == {}
    journal.emit(HEAL_START, replica=1, rank=0, source=source, step=8)
    assert tracker.heals_under_way() == {1: 2}
    _commit(journal, 2, 8, 101.5, 3)  # the source committed since: it serves no more
    assert tracker.heals_under_way() == {}
    journal.emit(SERVE_START, replica=2, rank=0, step=8, to=[1])
    tracker.on_failure(
        Failure(cause=Cause.SIGNAL, detail="SIGKILL", coords={"replica": 2, "rank": 0},
                t_event=102.0, t_detected=102.0)
    )  # fmt: skip
    assert tracker.heals_under_way() == {}  # its source died: that heal cannot go on


def test_a_checkpoint_write_is_under_way_from_its_start_to_its_save_or_its_groups_death() -> None:
    """``checkpoints_under_way`` (what ``checkpoint_kill`` aims by): the writing group's rank 0
    journaled ``checkpoint.start`` and neither its ``checkpoint.save`` nor its failure came
    since."""
    journal, tracker, _ = _tracker()
    journal.emit(CHECKPOINT_START, replica=1, rank=1, step=50)  # not rank 0's
    assert tracker.checkpoints_under_way() == {}
    journal.emit(CHECKPOINT_START, replica=1, rank=0, step=50)
    assert tracker.checkpoints_under_way() == {1: 50}
    journal.emit(CHECKPOINT_SAVE, replica=1, rank=1, step=50, path="p")  # rank 1's file only
    assert tracker.checkpoints_under_way() == {1: 50}
    journal.emit(CHECKPOINT_SAVE, replica=1, rank=0, step=50, path="p")
    assert tracker.checkpoints_under_way() == {}
    journal.emit(CHECKPOINT_START, replica=0, rank=0, step=100)
    tracker.on_failure(
        Failure(cause=Cause.SIGNAL, detail="SIGKILL", coords={"replica": 0, "rank": 1},
                t_event=102.0, t_detected=102.0)
    )  # fmt: skip
    assert tracker.checkpoints_under_way() == {}  # its writer died: the write never lands
