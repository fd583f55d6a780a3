"""The built-in trainer's failures through the crash-loop rule (``harness.job.trainer_deaths``):
a failure that comes back the same way ends the job naming it; a fault, a stop or bad data never
counts. The failures are the values a group's supervisor receives, as the runtime builds them:
a restart that raised (its RemoteError's remote traceback inside), a rank's exception."""

from __future__ import annotations

import concurrent.futures as cf
import traceback

from harness.job.crash_loop import CrashLoop
from harness.job.trainer_deaths import TrainerDeaths
from runtime.actor import RemoteError
from runtime.failure import Cause, Failure
from runtime.journal import FAULT_INJECT, STEP_COMMIT
from runtime.proc_handle import HostLostError, ProcFailedError

REMOTE = """\
Traceback (most recent call last):
  File "/repo/runtime/worker.py", line 432, in _serve
    return getattr(target, msg.method)(*msg.args, **msg.kwargs)
  File "/repo/harness/rank/token_data.py", line 37, in _open
    return open_corpus(cfg.corpus, verify=False)
harness.corpus.tokenfile.CorpusError: /data/c: no manifest.json: not a prepared corpus (port {n})
"""


def _failed_restart(replica: int, t: float, exc: Exception) -> Failure:
    """What runtime.supervisor delivers when a restart raised ``exc`` (in its except clause:
    the traceback is the one being handled)."""
    return Failure(
        cause=Cause.EXCEPTION,
        detail=f"restart of job/replica{replica}/ranks failed: {exc!r}",
        traceback=traceback.format_exc(),
        child=f"job/replica{replica}/ranks",
        t_event=t,
    )


def _restart_failure(replica: int, n: int, t: float) -> Failure:
    try:
        raise RemoteError("CorpusError", f"/data/c: no manifest.json ({n})", REMOTE.format(n=n), {})
    except RemoteError as exc:
        return _failed_restart(replica, t, exc)


def _rank_failure(replica: int, t: float, exc_text: str, *, signal: str | None = None) -> Failure:
    tb = (
        "Traceback (most recent call last):\n"
        '  File "/repo/harness/rank/trainer.py", line 468, in _forward_backward\n'
        "    loss.backward()\n"
        f"{exc_text}\n"
    )
    return Failure(
        cause=Cause.SIGNAL if signal else Cause.EXCEPTION,
        detail="an actor raised",
        coords={"replica": replica, "rank": 0},
        exit_code=None if signal else 71,
        signal=signal,
        traceback=None if signal else tb,
        child=f"job/replica{replica}/ranks",
        t_event=t,
    )


class _Job:
    def __init__(self) -> None:
        self.said: list[str] = []
        self.failed: list[str] = []
        self.incarnations = {0: 0, 1: 0, 2: 0}
        self.journaled: list[dict] = []

    def deaths(self, tries: int = 3) -> TrainerDeaths:
        return TrainerDeaths(
            loop=CrashLoop(tries=tries, explained_s=10.0),
            incarnation=self.incarnations.get,
            say=self.said.append,
            fail=self.failed.append,
            emit=lambda event, **fields: self.journaled.append({"event": event, **fields}),
        )


def test_a_start_that_fails_the_same_way_three_times_ends_the_job_naming_the_cause():
    job = _Job()
    deaths = job.deaths()
    assert not deaths.seen(_restart_failure(1, 1, 100.0))
    assert not deaths.seen(_restart_failure(1, 2, 100.5))
    assert deaths.seen(_restart_failure(1, 3, 101.0))  # absorbed: not restarted again
    (reason,) = job.failed
    assert reason.startswith(
        "the trainer fails the same way every time, so ftharness stopped restarting it: 3 deaths "
        "in a row with harness.corpus.tokenfile.CorpusError: /data/c: no manifest.json"
    )
    assert "(last frame: token_data.py:37 in _open)" in reason
    assert "group 1 rank 0 while starting (building its trainers)" in reason
    assert job.said == reason.splitlines()


def test_a_rank_that_fails_the_same_way_after_the_same_step_ends_it_and_says_where():
    job = _Job()
    deaths = job.deaths()
    deaths.on_record({"event": STEP_COMMIT, "replica": 2, "step": 40})
    oom = "RuntimeError: [enforce fail at alloc_cpu.cpp:117] DefaultCPUAllocator: not enough memory"
    for i, t in enumerate((10.0, 12.0, 14.0)):
        job.incarnations[2] = i
        assert deaths.seen(_rank_failure(2, t, oom)) is (i == 2)
    assert "group 2 rank 0 after step 40" in job.failed[0]
    assert "trainer.py:468 in _forward_backward" in job.failed[0]
    # each failure journaled with what identifies it
    assert [r["event"] for r in job.journaled] == ["failure.signature"] * 3
    assert {
        (r["replica"], r["kind"], r["frame"], r["where"], r["counted"]) for r in job.journaled
    } == {(2, "RuntimeError", "trainer.py:468 in _forward_backward", "after step 40", True)}
    assert [r["incarnation"] for r in job.journaled] == [0, 1, 2]


def test_faults_stops_bad_data_and_mixed_causes_never_make_a_loop():
    job = _Job()
    deaths = job.deaths()
    oom = "RuntimeError: not enough memory"
    # an injected fault hit group 0: its failures in that incarnation are the fault's
    deaths.on_record({"event": FAULT_INJECT, "t": 0.0, "target": {"replica": 0}})
    for t in (20.0, 21.0, 22.0):
        assert not deaths.seen(_rank_failure(0, t, oom))
    # a stop from outside, and failures the data is to blame for
    for t in (30.0, 31.0, 32.0):
        assert not deaths.seen(_rank_failure(1, t, "", signal="SIGKILL"))
        bad = "harness.rank.data.BadData: UnreadableData on 1 sequence(s) of this batch"
        assert not deaths.seen(_rank_failure(1, t, bad))
    # two alike, then another: the run starts again
    job.incarnations[1] = 5
    assert not deaths.seen(_rank_failure(1, 40.0, oom))
    assert not deaths.seen(_rank_failure(1, 41.0, oom))
    assert not deaths.seen(_rank_failure(1, 42.0, "ValueError: something else"))
    assert not deaths.seen(_rank_failure(1, 43.0, oom))
    # alike but far apart: a rare race ridden through, not a loop
    assert not deaths.seen(_rank_failure(1, 200.0, oom))
    assert not deaths.seen(_rank_failure(1, 400.0, oom))
    assert job.failed == []
    why = [r["why"] for r in job.journaled if not r["counted"]]
    assert (
        why
        == ["an injected fault explains it"] * 3
        + [
            "a stop from outside, or no cause of its own",
            "the data is to blame (harness.job.poison)",
        ]
        * 3
    )


def _restart_on_a_lost_host(replica: int, t: float, error: type[Exception]) -> Failure:
    """A restart that raised because its host was lost as its trainers were being built (seen
    in CI: an allocation cancelled under the job), as the supervisor delivers it."""
    future: cf.Future[None] = cf.Future()
    future.set_exception(error("host n2 lost: agent connection closed (recv from peer failed)"))
    try:
        future.result()
    except Exception as exc:
        return _failed_restart(replica, t, exc)
    raise AssertionError("unreachable")


def test_restarts_that_fail_on_a_lost_host_never_make_a_loop():
    """A lost host fails every restart placed on it until the host table acts (replaces it, or
    ends the job: the allocation ended); those are the host's failures, not a crash loop of the
    trainer's. The same restarts failing with any other error are one."""
    job = _Job()
    deaths = job.deaths()
    for replica, t in ((0, 1.0), (1, 1.1), (0, 1.2), (1, 1.3)):
        assert not deaths.seen(_restart_on_a_lost_host(replica, t, HostLostError))
    assert job.failed == []
    assert {r["why"] for r in job.journaled} == {
        "its host was lost: the host's failure, not the trainer's"
    }
    job = _Job()
    deaths = job.deaths()
    seen = [
        deaths.seen(_restart_on_a_lost_host(r, t, ProcFailedError))
        for r, t in ((0, 1.0), (1, 1.1), (0, 1.2))
    ]
    assert seen == [False, False, True] and "ProcFailedError" in job.failed[0]


def test_a_takeover_takes_up_the_count_of_a_loop_under_way():
    """The dead controller counted two deaths of a loop; the controller that takes the job over
    reads them from its journal, and the third death ends the job (not three more)."""
    oom = "RuntimeError: [enforce fail at alloc_cpu.cpp:117] DefaultCPUAllocator: not enough memory"
    dead = _Job()
    before = dead.deaths()
    before.on_record({"event": STEP_COMMIT, "replica": 2, "step": 40})
    for i, t in enumerate((10.0, 12.0)):
        dead.incarnations[2] = i
        assert not before.seen(_rank_failure(2, t, oom))
    history = [
        {"event": STEP_COMMIT, "replica": 2, "step": 40, "t": 9.0},
        *({**r, "t": 10.0 + 2 * i} for i, r in enumerate(dead.journaled)),
    ]
    job = _Job()
    job.incarnations[2] = 2
    deaths = job.deaths()
    deaths.resume(history)
    assert job.journaled == []  # nothing journaled again
    assert deaths.seen(_rank_failure(2, 14.0, oom))
    assert "3 deaths in a row" in job.failed[0] and "group 2 rank 0 after step 40" in job.failed[0]

    # a fault injected after them (in the dead controller's journal) ended that run of repeats
    job = _Job()
    deaths = job.deaths()
    deaths.resume([*history, {"event": FAULT_INJECT, "t": 13.0, "target": {"replica": 0}}])
    assert not deaths.seen(_rank_failure(2, 30.0, oom)) and job.failed == []


def test_a_loop_of_one_group_while_the_others_commit_on_is_named_the_groups_own():
    """Group 2 dies the same way three times while group 0 commits on past its last step: the
    diagnosis says the cause is in group 2 alone. The same loop with no group moving on (the
    test above) says nothing of the kind: every group may be stuck on it."""
    oom = "RuntimeError: [enforce fail at alloc_cpu.cpp:117] DefaultCPUAllocator: not enough memory"
    job = _Job()
    deaths = job.deaths()
    deaths.on_record({"event": STEP_COMMIT, "replica": 2, "step": 40})
    for i, t in enumerate((10.0, 12.0, 14.0)):
        deaths.on_record({"event": STEP_COMMIT, "replica": 0, "step": 41 + 10 * i})
        job.incarnations[2] = i
        assert deaths.seen(_rank_failure(2, t, oom)) is (i == 2)
    lines = job.failed[0].splitlines()
    assert lines[0].startswith("the trainer fails the same way every time")
    assert lines[1] == (
        "only group 2 fails: group(s) 0 committed past its step 40 meanwhile, so the cause is in "
        "group 2 alone (its host, its device or its share of the data), not in the code or the "
        "corpus"
    )

    job = _Job()  # the same loop, but the others never moved past group 2's step
    deaths = job.deaths()
    deaths.on_record({"event": STEP_COMMIT, "replica": 2, "step": 40})
    deaths.on_record({"event": STEP_COMMIT, "replica": 0, "step": 40})
    for i, t in enumerate((10.0, 12.0, 14.0)):
        job.incarnations[2] = i
        deaths.seen(_rank_failure(2, t, oom))
    assert "only group" not in job.failed[0]


def test_a_loop_of_one_groups_own_drops_it_when_enough_groups_are_left_and_counting_goes_on():
    """The rule asks to drop the group (``drop(replica, why)``); where that is done the failure
    is absorbed and the job does not end, and a later loop is counted afresh. Where the drop is
    refused (too few groups left) the job ends as before. A fault that recurs (``recurs``: a
    broken device) explains no death: its deaths are the group's own."""
    oom = "RuntimeError: CUDA error: uncorrectable ECC error encountered"
    dropped: list[tuple[int, str]] = []
    job = _Job()
    deaths = job.deaths()
    deaths.drop = lambda replica, why: dropped.append((replica, why)) is None
    deaths.on_record({"event": STEP_COMMIT, "replica": 2, "step": 40})
    deaths.on_record({"event": FAULT_INJECT, "t": 9.0, "recurs": True, "target": {"replica": 2}})
    for i, t in enumerate((10.0, 12.0, 14.0)):
        deaths.on_record({"event": STEP_COMMIT, "replica": 0, "step": 41 + 10 * i})
        job.incarnations[2] = i
        assert deaths.seen(_rank_failure(2, t, oom)) is (i == 2)
    ((replica, why),) = dropped
    assert replica == 2 and "only group 2 fails" in why.splitlines()[1]
    assert job.failed == []  # the job goes on
    for i, t in enumerate((20.0, 22.0, 24.0)):  # a later loop of the job's: counted afresh
        assert deaths.seen(_rank_failure(0, t, oom.replace("ECC", "ABC"))) is (i == 2)
    assert len(job.failed) == 1 and "only group" not in job.failed[0]

    job = _Job()  # the drop refused: the job ends with the diagnosis
    deaths = job.deaths()
    deaths.drop = lambda replica, why: False
    deaths.on_record({"event": STEP_COMMIT, "replica": 2, "step": 40})
    for i, t in enumerate((10.0, 12.0, 14.0)):
        deaths.on_record({"event": STEP_COMMIT, "replica": 0, "step": 41 + 10 * i})
        job.incarnations[2] = i
        deaths.seen(_rank_failure(2, t, oom))
    assert "only group 2 fails" in job.failed[0]


def test_a_takeover_after_a_group_was_dropped_counts_afresh():
    """The dead controller's journal holds a whole loop, then group.dropped: the loop was acted
    on, so the controller that takes over counts from zero (it does not find that loop again
    and stop counting)."""
    oom = "RuntimeError: CUDA error: uncorrectable ECC error encountered"
    dead = _Job()
    before = dead.deaths()
    before.drop = lambda replica, why: True
    before.on_record({"event": STEP_COMMIT, "replica": 2, "step": 40})
    before.on_record({"event": STEP_COMMIT, "replica": 0, "step": 90})
    for i, t in enumerate((10.0, 12.0, 14.0)):
        dead.incarnations[2] = i
        before.seen(_rank_failure(2, t, oom))
    history = [
        {"event": STEP_COMMIT, "replica": 2, "step": 40, "t": 9.0},
        *({**r, "t": 10.0 + 2 * i} for i, r in enumerate(dead.journaled)),
        {"event": "group.dropped", "replica": 2, "t": 14.1},
    ]
    job = _Job()
    deaths = job.deaths()
    deaths.resume(history)
    other = "RuntimeError: boom"
    assert [deaths.seen(_rank_failure(1, t, other)) for t in (20.0, 21.0, 22.0)] == [
        False, False, True,
    ]  # fmt: skip


def test_a_dropped_groups_recovery_ends_with_the_drop_and_stays_ended(tmp_path) -> None:
    """``group.dropped``: the group never rejoins, so its open recovery ends there (phase
    ``dropped``), and a controller that takes over does not open it again."""
    from harness.job.recovery import RecoveryTracker
    from runtime.journal import GROUP_DROPPED, Journal, read_journal

    journal = Journal(tmp_path / "j.jsonl", job="t")
    tracker = RecoveryTracker(journal)
    tracker.failed_by_controller(1, "process_exit", 10.0)
    assert tracker.open_replicas() == {1}
    journal.emit(GROUP_DROPPED, t=12.0, replica=1, left=2, reason="only group 1 fails")
    assert tracker.open_replicas() == set()
    journal.close()
    records = read_journal(tmp_path / "j.jsonl")
    (end,) = [r for r in records if r["event"] == "recovery.phase" and r["phase"] == "dropped"]
    assert end["replica"] == 1 and end["t"] == 12.0
    successor = RecoveryTracker(Journal(tmp_path / "j2.jsonl", job="t"))
    successor.resume(records)
    assert successor.open_replicas() == set()
