"""The controller_crash fault's rules: its target, the experiments that may plan it, the injector
a new controller resumes, the recoveries it continues, and the phases a crash waits for. The
crash itself (a real SIGKILL of a real controller, taken over) is tests/e2e/test_soak.py and
tests/e2e/test_controller_crash.py."""

from __future__ import annotations

import random
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import pytest

from experiments.spec import ExperimentError, load_experiment
from faults.controller import PHASES
from faults.fault import Target, make_fault, register
from faults.injector import Injector, plan_record
from faults.schedule import PlannedFault
from faults.targets import TargetSpec, Topology, select_target
from harness.job.recovery import RecoveryTracker
from runtime.journal import FAULT_HEAL, FAULT_INJECT, Journal, read_journal

ROOT = Path(__file__).parents[2]


def test_the_controller_is_a_target_of_its_own_kind():
    t = select_target("controller", TargetSpec(), Topology.from_counts(3, 1, 1), random.Random(0))
    assert t == Target(controller=True)
    assert t.describe() == "the controller"
    assert t.as_dict() == {"replica": None, "rank": None, "host": None, "controller": True}
    assert Target.from_dict(t.as_dict()) == t
    assert "controller" not in Target().as_dict()  # other faults' records are unchanged


def write_experiment(
    tmp_path: Path, *overrides: str, mix: str = "controller_crash = 1", at_s: int = 5
) -> Path:
    """An experiment of one fault at ``at_s`` on experiments/tiny.toml with ``overrides``
    (also tests/unit/test_controller_node_failure.py's)."""
    p = tmp_path / "experiment.toml"
    p.write_text(
        f"""name = "cc"
duration_s = 30
policies = ["in_place"]
job = "{ROOT / "experiments" / "tiny.toml"}"
overrides = {list(overrides)!r}
[schedule]
kind = "at_times"
at_times = [{at_s}]
[faults]
mix = {{ {mix} }}
""".replace("'", '"')
    )
    return p


_experiment = write_experiment


def test_an_experiment_may_kill_the_controller_only_of_a_job_a_new_one_can_take_over(tmp_path):
    spec = load_experiment(_experiment(tmp_path))
    assert spec.kills_controller
    assert spec.plan()[0].target == Target(controller=True)
    assert not load_experiment(_experiment(tmp_path, mix="kill = 1")).kills_controller
    for override, why in [
        ("recovery.quorum=torchft", "only the tree quorum"),
        ("launcher=netns", 'only "local" and "slurm" jobs'),
        ("recovery.controller_grace_s=0", "died with their controller"),
    ]:
        with pytest.raises(ExperimentError) as err:
            load_experiment(_experiment(tmp_path, override))
        assert "faults.mix.controller_crash" in str(err.value) and why in str(err.value)


def test_a_full_restart_run_cannot_plan_a_controller_crash(tmp_path):
    p = _experiment(tmp_path)
    p.write_text(p.read_text().replace('policies = ["in_place"]', 'policies = ["full_restart"]'))
    with pytest.raises(ExperimentError, match="full_restart"):
        load_experiment(p)


def test_the_crash_options_are_checked_and_a_random_phase_is_seeded():
    with pytest.raises(ValueError, match="phase 'later'"):
        make_fault("controller_crash", phase="later")
    with pytest.raises(ValueError, match="wait_s"):
        make_fault("controller_crash", wait_s=0)
    with pytest.raises(ValueError, match="how 'freeze'"):
        make_fault("controller_crash", how="freeze")
    killed: list[str] = []

    class Ctx:
        def __init__(self, now: str) -> None:
            self.now = now

        def in_phase(self, phase: str) -> bool:
            return phase == self.now

        def kill_controller(self) -> None:
            killed.append(self.now)

    fault = make_fault("controller_crash", phase="random")
    drawn = [fault.inject_fields(random.Random(f"5:f{i:03d}"))["phase"] for i in range(12)]
    again = [fault.inject_fields(random.Random(f"5:f{i:03d}"))["phase"] for i in range(12)]
    assert drawn == again and set(drawn) <= set(PHASES) and len(set(drawn)) > 1
    heal = make_fault("controller_crash", phase="heal")
    assert not heal.ready(Ctx("quorum"), random.Random(0))  # type: ignore[arg-type]
    assert heal.ready(Ctx("heal"), random.Random(0))  # type: ignore[arg-type]
    assert make_fault("controller_crash").ready(Ctx("none"), random.Random(0))  # type: ignore[arg-type]
    heal.fire(Ctx("heal"), Target(controller=True), random.Random(0))  # type: ignore[arg-type]
    assert killed == ["heal"]


def test_the_injector_waits_for_a_faults_moment_and_records_it(tmp_path):
    """A crash waits for its phase (recorded on its ``fault.inject``), the faults after it do
    not wait for it, and one whose moment never comes fires after its ``wait_s``."""
    moment = [False]

    class Ctx2(Ctx):
        def in_phase(self, phase: str) -> bool:
            return moment[0]

        def kill_controller(self) -> None:
            self.calls.append(("kill", None))

    plan = [
        PlannedFault(fault_id="f000", kind="controller_crash", target=Target(controller=True),
                     at_s=1.0),
        PlannedFault(fault_id="f001", kind="test_resume_probe", target=Target(replica=1), at_s=1.0),
        PlannedFault(fault_id="f002", kind="controller_crash", target=Target(controller=True),
                     at_s=3.0),
    ]  # fmt: skip
    now = [0.0]
    ctx = Ctx2(Journal(tmp_path / "j.jsonl", job="t"))
    options = {"controller_crash": {"phase": "quorum", "wait_s": 5.0}}
    injector = Injector(plan, ctx, seed=1, clock=lambda: now[0], options=options)
    injector.start()
    now[0] = 1.5
    injector.poll()
    assert ctx.calls == [("fire", 1), ("heal", 1)]  # f000 waits for a quorum; f001 does not
    now[0] = 2.5
    moment[0] = True
    injector.poll()
    assert ctx.calls[2:] == [("kill", None)]
    moment[0] = False
    now[0] = 3.1
    injector.poll()  # f002 waits from now...
    assert ctx.calls[-1] == ("kill", None) and len(ctx.calls) == 3
    now[0] = 8.2
    injector.poll()  # ...and fires without its moment after wait_s
    assert ctx.calls[-1] == ("kill", None)
    ctx.journal.close()
    injects = [r for r in read_journal(tmp_path / "j.jsonl") if r["event"] == FAULT_INJECT]
    seen = [(r["fault_id"], r.get("phase"), r.get("ready"), r.get("waited_s")) for r in injects]
    assert seen == [
        ("f001", None, None, None), ("f000", "quorum", True, 1.0), ("f002", "quorum", False, 5.1)
    ]  # fmt: skip


# -- the injector a new controller resumes ----------------------------------------------------


@register("test_resume_probe")
@dataclass(frozen=True, kw_only=True)
class ResumeProbe:
    default_target: ClassVar[str] = "replica"
    hold_s: float = 0.0

    def fire(self, ctx: Any, target: Target, rng: random.Random) -> None:
        ctx.calls.append(("fire", target.replica))

    def heal(self, ctx: Any, target: Target) -> None:
        ctx.calls.append(("heal", target.replica))


class Ctx:
    replicas, ranks, networked = 3, 1, False

    def __init__(self, journal: Journal) -> None:
        self.journal = journal
        self.calls: list[tuple[str, Any]] = []

    def replica_host(self, replica: int) -> str:
        return "host0"

    def committed_step(self) -> int:
        return 0


def test_a_resumed_injector_fires_nothing_twice_and_heals_what_the_dead_one_held(tmp_path):
    plan = [
        PlannedFault(fault_id=f"f{i:03d}", kind="test_resume_probe", target=Target(replica=i % 3),
                     at_s=float(i))
        for i in range(5)
    ]  # fmt: skip
    now = [100.0]
    held = {"test_resume_probe": {"hold_s": 50.0}}
    ctx1 = Ctx(Journal(tmp_path / "j.jsonl", job="t"))
    first = Injector(plan, ctx1, seed=1, options=held, clock=lambda: now[0])
    first.start()
    now[0] = 102.5
    first.poll()  # f000, f001, f002 fired and held (50 s)
    assert first.fired == ["f000", "f001", "f002"]
    first.ctx.journal.emit(FAULT_HEAL, fault_id="f000", kind="test_resume_probe")  # one healed
    first.ctx.journal.close()
    records = read_journal(tmp_path / "j.jsonl")
    started, planned = plan_record(records) or (0.0, [])
    assert planned == plan and started == records[0]["t"]

    ctx = Ctx(Journal(tmp_path / "j2.jsonl", job="t"))
    later = [500.0]
    second = Injector(planned, ctx, seed=1, options=held, clock=lambda: later[0])
    second.resume(records)  # its clock: the first one's, a moment ago
    assert second.fired == ["f000", "f001", "f002"] and not second.done
    second.poll()
    assert ctx.calls == []  # nothing fired again, nothing due yet
    later[0] += 3.5
    second.poll()
    assert ctx.calls == [("fire", 0)]  # f003, on the first injector's clock
    second.close()  # heals what is held: the dead injector's f001 and f002, and f003
    assert sorted(r for c, r in ctx.calls if c == "heal") == [0, 1, 2]
    ctx.journal.close()
    journal = read_journal(tmp_path / "j2.jsonl")
    assert sorted(r["fault_id"] for r in journal if r["event"] == FAULT_HEAL) == [
        "f001",
        "f002",
        "f003",
    ]
    assert [r["fault_id"] for r in journal if r["event"] == FAULT_INJECT] == ["f003"]


def test_a_resume_without_a_plan_in_the_journal_is_refused(tmp_path):
    injector = Injector([], Ctx(Journal(tmp_path / "j.jsonl", job="t")), seed=1)
    with pytest.raises(ValueError, match=r"fault\.plan"):
        injector.resume([])


# -- the recoveries a new controller continues ------------------------------------------------


def _phase(t: float, rid: str, phase: str, replica: Any, cause: str, fault_id: Any = None):
    return {"t": t, "event": "recovery.phase", "recovery_id": rid, "phase": phase,
            "replica": replica, "cause": cause, "fault_id": fault_id}  # fmt: skip


def test_a_new_controller_continues_the_recoveries_its_predecessor_left_open(tmp_path):
    journal = Journal(tmp_path / "j.jsonl", job="t")
    tracker = RecoveryTracker(journal)
    lighthouse = {"t": 10.0, "event": FAULT_INJECT, "fault_id": "f000", "kind": "lighthouse_crash",
                  "target": {"replica": None, "rank": None, "host": None}}  # fmt: skip
    crash = {"t": 11.0, "event": FAULT_INJECT, "fault_id": "f001", "kind": "controller_crash",
             "target": {"replica": None, "host": None, "controller": True}}  # fmt: skip
    records = [
        lighthouse,
        crash,
        _phase(10.5, "rec-1", "detected", 1, "process_exit"),
        _phase(10.9, "rec-1", "replacement_started", 1, "process_exit"),
        _phase(10.2, "rec-2", "detected", 2, "process_exit"),
        _phase(10.8, "rec-2", "participating", 2, "process_exit"),
    ]
    tracker.resume(records)
    assert tracker.open_replicas() == {1}  # rec-1 continues; rec-2 had ended
    tracker.controller_replaced(40.0)  # late: a crash that waited for its phase
    journal.emit("step.commit", t=41.0, replica=1, step=7)
    journal.close()
    out = [r for r in read_journal(tmp_path / "j.jsonl") if r["event"] == "recovery.phase"]
    by_id = {(r["recovery_id"], r["phase"]): r for r in out}
    assert ("rec-1", "participating") in by_id  # under its old id
    root = [r for r in out if r["cause"] == "controller_crash"]
    assert {r["phase"] for r in root} >= {"detected", "replacement_started", "participating"}
    assert {r["fault_id"] for r in root} == {"f001"} and root[0]["recovery_id"] == "rec-3"
    assert not tracker.open_replicas() and tracker.open_count == 0


# -- an inherited idle spare is the new controller's ------------------------------------------


def test_an_inherited_idle_spare_back_in_its_pool_has_its_failures_delivered():
    """A soak found it: an idle spare inherited from a dead controller went back to its host's
    pool still marked inherited, so once a group took it, its failure was held for an adoption
    that never came, and the group was never restarted."""
    from runtime.messages import AgentReport, HelloWorker, ReportedWorker
    from runtime.proc_handle import CallTable
    from runtime.takeover import Inheritance

    pooled: list[Any] = []

    class Pool:
        def add_idle(self, rec: Any) -> None:
            pooled.append(rec)

    class Host:
        name = "host0"
        pool = Pool()

    procs: dict[str, Any] = {}
    inh = Inheritance(procs, threading.RLock(), CallTable())
    spare = ReportedWorker("host0/p2", 4242, {"idle": 0}, spare=True)
    ranked = ReportedWorker("host0/p0", 4243, {"replica": 0, "rank": 0})
    inh.on_report(Host(), AgentReport((spare, ranked), epoch=1, address="127.0.0.1"))  # type: ignore[arg-type]
    inh.on_worker(procs["host0/p2"], HelloWorker("host0/p2", 4242, 1, {"idle": 0}))
    inh.on_worker(procs["host0/p0"], HelloWorker("host0/p0", 4243, 1, {"replica": 0, "rank": 0}))
    assert pooled == [procs["host0/p2"]]
    assert not inh.hold(procs["host0/p2"], object())  # type: ignore[arg-type]  # delivered
    assert inh.hold(procs["host0/p0"], object())  # type: ignore[arg-type]  # held until adopted
    assert inh.unclaimed() == ["host0/p0"]
