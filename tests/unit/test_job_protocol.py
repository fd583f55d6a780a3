"""The job-level recovery protocol (``harness.job.protocol.Job``) step by step, without processes:
detect -> fence -> stop -> place -> spawn -> heal -> participate, on a fake control plane
(``tests/unit/fake_plane.py``) with the real supervisors, the real placement rule, the real
recovery tracker and the real tree quorum (a gRPC server in this process)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from harness.config import JobConfig, RecoveryConfig, StragglerConfig, config_to_dict
from harness.job.protocol import Job
from harness.job.site import Site, prepare_site
from harness.quorum import rule
from harness.rank.actors import TrainerActor, stop_training
from runtime.journal import (
    BITFLIP,
    FAILURE,
    HEALED,
    JOB_RESTART,
    JOB_START,
    RECOVERY_PHASE,
    SILENT_DIVERGENCE,
    STEP_COMMIT,
    STRAGGLER,
    Journal,
)
from tests.unit.fake_plane import FakeController, FakeProc

pytestmark = pytest.mark.timeout(60)


def _until(what: Callable[[], Any], timeout: float = 10.0) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = what()
        if value:
            return value
        time.sleep(0.01)
    raise AssertionError("timed out waiting")


class Run:
    """A started job on the fake plane, with its journal and the protocol's steps as seen."""

    def __init__(self, cfg: JobConfig, tmp: Path) -> None:
        self.records: list[dict[str, Any]] = []
        self.steps: list[tuple[str, Any]] = []  # (step, detail), in the order they happened
        self.closed = False
        self.journal = Journal(tmp / "journal.jsonl", job="t")
        self.journal.add_sink(self.records.append)
        self.site: Site = prepare_site(cfg, tmp)
        self.job = Job(self.site, tmp, self.journal, quiet=True, make_controller=self._plane)
        self.job.start()
        self._spy_quorum()

    def _plane(self, spec: Any, **kw: Any) -> FakeController:
        self.plane = FakeController(spec, **kw)
        run = self  # the protocol's stop and spawn steps, recorded in order
        orig_stop, orig_spawn = self.plane.stop_proc, self.plane.spawn_many

        def stop_proc(proc_id: str, grace_s: float | None = None) -> None:
            if not run.plane.procs[proc_id].stopped:
                run.steps.append(("stop", proc_id))
            orig_stop(proc_id, grace_s)

        def spawn_many(requests: Any, **kw: Any) -> Any:
            for host, _, fixed in requests:
                run.steps.append(("spawn", (fixed["replica"], host.name, kw.get("cold", False))))
            return orig_spawn(requests, **kw)

        self.plane.stop_proc = stop_proc  # type: ignore[method-assign]
        self.plane.spawn_many = spawn_many  # type: ignore[method-assign]
        return self.plane

    def _spy_quorum(self) -> None:
        q = self.job.quorum
        fence, admit = q.fence, q.admit

        def spy_fence(replica: int, ids: Any = ()) -> None:
            self.steps.append(("fence", replica))
            fence(replica, ids)

        def spy_admit(replica: int, incarnation: int) -> Any:
            self.steps.append(("admit", (replica, incarnation)))
            return admit(replica, incarnation)

        q.fence, q.admit = spy_fence, spy_admit  # type: ignore[method-assign]

    def ranks_of(self, replica: int) -> list[FakeProc]:
        return self.plane.live(replica)

    def trainer_args(self, proc: FakeProc) -> tuple[Any, ...]:
        cls, args = proc.actors["trainer"]
        assert cls is TrainerActor
        return args

    def commit(self, step: int, replicas: list[int], **extra: Any) -> None:
        """What the trainers journal when they commit ``step`` together."""
        for r in replicas:
            self.journal.emit(
                STEP_COMMIT, replica=r, rank=0, step=step, participants=len(replicas), **extra
            )

    def events(self, name: str) -> list[dict[str, Any]]:
        return [r for r in self.records if r["event"] == name]

    def phases(self, replica: int) -> list[str]:
        return [r["phase"] for r in self.events(RECOVERY_PHASE) if r["replica"] == replica]

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        for p in list(self.plane.procs.values()):  # let stop() find every group finished
            call = p.calls.get("train")
            if call is not None and not call.done():
                call.set_result(None)
        self.job.stop()
        self.journal.close()


@pytest.fixture
def start(tmp_path: Path) -> Iterator[Callable[..., Run]]:
    runs: list[Run] = []

    def make(**overrides: Any) -> Run:
        cfg = JobConfig(replicas=3, ranks=2, hosts=2, steps=1000, **overrides)
        runs.append(Run(cfg, tmp_path))
        return runs[-1]

    yield make
    for run in runs:
        run.close()


def test_a_killed_rank_goes_through_every_step_of_the_protocol_and_only_its_group_restarts(
    start: Callable[..., Run],
) -> None:
    run = start()
    job, plane = run.job, run.plane
    assert [p.host for r in range(3) for p in run.ranks_of(r)] == ["host0"] * 2 + ["host1"] * 2 + [
        "host0"
    ] * 2  # replica r at home on host r % hosts
    first = {r: [p.proc_id for p in run.ranks_of(r)] for r in range(3)}
    old_id = run.trainer_args(run.ranks_of(1)[0])[4][1]
    assert rule.parse_member_id(old_id) is not None  # the tree names each incarnation
    run.commit(1, [0, 1, 2])
    run.steps.clear()

    plane.kill(first[1][1])  # rank 1 of group 1 dies (a SIGKILL, as its agent reports it)

    def replaced() -> bool:  # the new ranks exist, train, and the phase is journaled
        new = run.ranks_of(1)
        return (
            len(new) == 2
            and new[0].proc_id not in first[1]
            and all("train" in p.calls for p in new)
            and "replacement_started" in run.phases(1)
        )

    _until(replaced)
    # detect -> fence -> stop -> place + spawn (its home host, forked warm) -> admit
    assert run.steps[:2] == [("fence", 1), ("stop", first[1][0])]
    assert run.steps[2:4] == [("admit", (1, 1)), ("spawn", (1, "host1", False))] or run.steps[
        2:4
    ] == [("spawn", (1, "host1", False)), ("admit", (1, 1))]
    assert [r["replica"] for r in run.events(FAILURE)] == [1]
    assert run.phases(1)[:1] == ["detected"]
    # the replacement is incarnation 1, with a new member id; the survivors were not touched
    new = run.ranks_of(1)
    new_id = run.trainer_args(new[0])[4][1]
    assert new_id != old_id and rule.parse_member_id(new_id).incarnation == 1  # type: ignore[union-attr]
    assert job.groups[1].incarnation == 1 and job.groups[0].incarnation == 0
    assert {r: [p.proc_id for p in run.ranks_of(r)] for r in (0, 2)} == {
        r: first[r] for r in (0, 2)
    }
    assert all("train" in p.calls for p in new)  # training started at once
    assert run.phases(1) == ["detected", "replacement_started"]

    # survivors commit on; the replacement heals from a peer, then commits with them
    run.commit(2, [0, 2])
    run.journal.emit(HEALED, replica=1, rank=0, step=2)
    run.commit(3, [0, 1, 2])
    assert run.phases(1) == [
        "detected",
        "replacement_started",
        "survivors_resumed",
        "healed",
        "participating",
    ]
    assert job.tracker.completed == 1
    # the old incarnation is fenced: the quorum refuses its id from now on
    tq = job.quorum.tree  # type: ignore[attr-defined]
    assert tq.incarnations[1] == 1


def test_a_lost_host_in_cooldown_sends_its_group_to_another_host(
    start: Callable[..., Run],
) -> None:
    run = start()
    run.job.hosts.set_cooldown("host1", 60.0)  # e.g. a host fault holding it out
    before = [p.proc_id for p in run.ranks_of(1)]
    run.plane.lose_host("host1")  # replica 1 lived there
    _until(lambda: run.ranks_of(1) and run.ranks_of(1)[0].proc_id not in before)
    assert {p.host for p in run.ranks_of(1)} == {"host0"}
    assert ("spawn", (1, "host0", False)) in run.steps


def test_full_restart_restarts_every_group_cold_and_the_config_is_never_rewritten(
    start: Callable[..., Run],
) -> None:
    run = start(recovery=RecoveryConfig(policy="full_restart"))
    cfg = run.job.cfg
    assert cfg is run.site.cfg and cfg.min_replica_size == 3  # resolved before the start
    assert cfg.recovery.spares_per_host == 0  # a full restart starts cold on purpose
    assert run.events(JOB_START)[0]["config"] == config_to_dict(cfg)
    first = {p.proc_id for r in range(3) for p in run.ranks_of(r)}
    run.steps.clear()
    run.plane.kill(run.ranks_of(2)[0].proc_id)

    def all_new() -> bool:
        return all(run.ranks_of(r) and run.ranks_of(r)[0].proc_id not in first for r in range(3))

    _until(all_new)
    spawns = [s for s in run.steps if s[0] == "spawn"]
    assert sorted(s[1][0] for s in spawns) == [0, 1, 2] and all(s[1][2] for s in spawns)  # cold
    assert len(run.events(JOB_RESTART)) == 1
    assert run.job.cfg is cfg


def test_past_its_restart_intensity_a_group_escalates_and_the_job_fails_with_a_report(
    start: Callable[..., Run],
) -> None:
    run = start(recovery=RecoveryConfig(max_restarts=1, within_s=600.0))
    run.plane.kill(run.ranks_of(0)[0].proc_id)
    _until(lambda: run.ranks_of(0) and run.job.groups[0].incarnation == 1)
    run.plane.kill(run.ranks_of(0)[0].proc_id)
    outcome = run.job.wait(timeout=10)
    assert outcome["status"] == "failed"
    assert "replica0" in outcome["reason"] and "gave up" in outcome["reason"]


def test_stop_asks_every_rank_to_stop_after_the_same_step(start: Callable[..., Run]) -> None:
    run = start()
    run.commit(7, [0, 1, 2])
    done = threading.Thread(target=run.close)
    done.start()
    done.join(20)
    stops = [c for c in run.plane.worker_calls if c[1].endswith(":stop_training")]
    assert len(stops) == 6 and len({c[2] for c in stops}) == 1  # one step for all
    assert stops[0][1] == f"{stop_training.__module__}:{stop_training.__qualname__}"
    assert stops[0][2][0] >= 8


# -- silent failures (harness.job.silent): the controller fails a group nobody saw die ------------
def _commit_with(run: Run, step: int, values: dict[int, Any], **extra: Any) -> None:
    for r, v in values.items():
        for rank in range(run.job.ranks):
            run.journal.emit(
                STEP_COMMIT,
                replica=r,
                rank=rank,
                step=step,
                participants=len(values),
                checksum=v,
                loss=1.0,
                **extra,
            )


def test_a_diverged_group_is_fenced_killed_and_restarted_to_heal_from_the_majority(
    start: Callable[..., Run],
) -> None:
    run = start()
    first = {r: [p.proc_id for p in run.ranks_of(r)] for r in range(3)}
    _commit_with(run, 10, {0: "a", 1: "a", 2: "a"})
    run.journal.emit(BITFLIP, replica=1, rank=0, step=12, tensor="model.w", index=3, bit=5)
    run.steps.clear()
    _commit_with(run, 20, {0: "b", 1: "x", 2: "b"})

    _until(lambda: len(run.ranks_of(1)) == 2 and run.ranks_of(1)[0].proc_id not in first[1])
    (alarm,) = run.events(SILENT_DIVERGENCE)
    assert (alarm["suspects"], alarm["majority"], alarm["action"]) == ([1], [0, 2], "heal")
    assert alarm["latency_steps"] == 8 and alarm["latency_s"] >= 0
    assert run.steps[0] == ("fence", 1)  # out of the quorum before its processes die
    assert run.job.groups[1].incarnation == 1 and run.job.groups[0].incarnation == 0
    assert {r: [p.proc_id for p in run.ranks_of(r)] for r in (0, 2)} == {
        r: first[r] for r in (0, 2)
    }
    recs = [r for r in run.events(RECOVERY_PHASE) if r["replica"] == 1]
    assert recs[0]["phase"] == "detected" and recs[0]["cause"] == "divergence"
    assert len({r["recovery_id"] for r in recs}) == 1  # the kill's failures joined it


def test_two_groups_that_differ_both_go_back_to_the_last_agreed_checkpoint(
    tmp_path: Path,
) -> None:
    run = Run(JobConfig(replicas=2, ranks=1, hosts=1, steps=1000), tmp_path)
    try:
        ckpts = tmp_path / "checkpoints" / "replica_0_rank_0"
        ckpts.mkdir(parents=True)
        for step in (10, 20):
            (ckpts / f"step_{step:08d}.json").write_text("{}")
            (ckpts / f"step_{step:08d}.pt").write_text("")
        first = {r: [p.proc_id for p in run.ranks_of(r)] for r in range(2)}
        _commit_with(run, 10, {0: "a", 1: "a"})
        _commit_with(run, 20, {0: "b", 1: "c"})
        _until(
            lambda: all(
                run.ranks_of(r) and run.ranks_of(r)[0].proc_id not in first[r] for r in range(2)
            )
        )
        (alarm,) = run.events(SILENT_DIVERGENCE)
        assert (alarm["action"], alarm["suspects"], alarm["rollback_to"]) == (
            "rollback",
            [0, 1],
            10,
        )
        assert sorted(p.name for p in ckpts.iterdir()) == ["step_00000010.json", "step_00000010.pt"]
        assert (tmp_path / "checkpoints" / "quarantine" / "replica_0_rank_0").is_dir()
        _until(lambda: run.events(JOB_RESTART))  # no group holds state: resume from checkpoint
        # once both restarted, checkpoints written from then on are no longer quarantined
        _until(lambda: run.job.silent is not None and run.job.silent._rollback_after is None)
    finally:
        run.close()


def test_an_ejected_straggler_leaves_and_comes_back_as_a_new_incarnation(
    start: Callable[..., Run],
) -> None:
    run = start(recovery=RecoveryConfig(stragglers=StragglerConfig(policy="eject", window=5)))
    first = [p.proc_id for p in run.ranks_of(2)]
    for step in range(1, 12):
        for r in range(3):
            for rank in range(2):
                proc = run.ranks_of(r)[rank].proc_id if run.ranks_of(r) else None
                slow = 0.1 if proc == first[1] else 0.01  # rank 1 of group 2, until restarted
                run.journal.emit(
                    STEP_COMMIT,
                    replica=r,
                    rank=rank,
                    step=step,
                    participants=3,
                    compute_s=slow,
                    proc=proc,
                )
    _until(lambda: run.ranks_of(2) and run.ranks_of(2)[0].proc_id not in first)
    assert [e["action"] for e in run.events(STRAGGLER)] == ["flagged", "ejected"]
    assert run.events(STRAGGLER)[0]["replica"] == 2 and run.job.groups[2].incarnation == 1
    assert run.job.groups[0].incarnation == 0 and run.job.groups[1].incarnation == 0
    causes = [r["cause"] for r in run.events(RECOVERY_PHASE) if r["replica"] == 2]
    assert causes[0] == "straggler"
