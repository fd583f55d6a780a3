"""The controller_node_failure fault's rules: its target (the controller's node, filled in at
fire time), the experiments that may plan it, the record made durable before the node goes,
the plan a new controller resumes, and the recoveries linked to it. The node failing for real
(a SLURM test cluster, a standby on another node taking over) is
tests/e2e/test_slurm_controller_node.py."""

from __future__ import annotations

import json
import os
import random
import subprocess
import threading
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from test_controller_crash_rules import write_experiment

from experiments.spec import ExperimentError, load_experiment
from faults.fault import Target, fault_class
from faults.injector import Injector
from faults.schedule import PlannedFault
from faults.targets import TargetSpec, Topology, select_target
from harness.config import load_config
from harness.job import fault_context
from harness.job.fault_context import JobFaultContext
from harness.job.recovery import RecoveryTracker
from runtime.failure import Cause, Failure
from runtime.journal import FAULT_HEAL, FAULT_INJECT, RECOVERY_PHASE, Journal, read_journal
from runtime.launchers import slurm_testcluster as testcluster

ROOT = Path(__file__).parents[2]
KIND = "controller_node_failure"
SLURM = ("launcher=slurm", "hosts=2", "replicas=2", "recovery.quorum=tree")


def _experiment(tmp_path: Path, *overrides: str) -> Path:
    return write_experiment(tmp_path, *overrides, mix=f"{KIND} = 1", at_s=10)


def test_it_targets_the_controller_and_needs_slurm_and_a_takeover():
    cls = fault_class(KIND)
    assert cls.default_target == "controller" and cls.needs_launcher == "slurm"
    assert cls.needs_takeover and cls.on_controller_node
    t = select_target("controller", TargetSpec(), Topology.from_counts(2, 1, 3), random.Random(0))
    assert t == Target(controller=True)  # the node is the controller's when the fault fires
    assert Target(controller=True, host="n1").describe() == "the controller's node n1"


@pytest.mark.parametrize("node", ["reserved", "trains"])
def test_a_slurm_experiment_plans_it_and_runs_its_controller_under_a_keeper(tmp_path, node):
    spec = load_experiment(_experiment(tmp_path, *SLURM, f"slurm.controller_node={node}"))
    assert spec.kills_controller and spec.controller_kinds == [KIND]
    plan = spec.plan()
    assert [(f.kind, f.target, f.at_s) for f in plan] == [(KIND, Target(controller=True), 10.0)]


def test_it_is_refused_where_the_run_could_not_survive_it(tmp_path):
    with pytest.raises(ExperimentError) as err:  # not SLURM nodes
        load_experiment(_experiment(tmp_path, "recovery.quorum=tree"))
    assert f"{KIND} acts on the job's slurm nodes" in str(err.value)
    for override, why in [
        ("recovery.quorum=torchft", "only the tree quorum"),
        ("recovery.controller_grace_s=0", "died with their controller"),
    ]:
        with pytest.raises(ExperimentError) as err:
            load_experiment(_experiment(tmp_path, *SLURM, override))
        assert f"faults.mix.{KIND}" in str(err.value) and why in str(err.value)
        assert "kills the job's controller" in str(err.value)
    p = _experiment(tmp_path, *SLURM)
    p.write_text(p.read_text().replace('policies = ["in_place"]', 'policies = ["full_restart"]'))
    with pytest.raises(ExperimentError, match="full_restart"):
        load_experiment(p)


# -- the injector: the controller's node at fire time, the plan resumed -----------------------


class Ctx:
    replicas, ranks, networked = 2, 1, False

    def __init__(self, journal: Journal, node: str) -> None:
        self.journal = journal
        self.node = node
        self.calls: list[tuple[str, str]] = []

    def replica_host(self, replica: int) -> str:
        return f"n{replica + 2}"  # controller_node = "reserved": n1 trains no group

    def controller_host(self) -> str:
        return self.node

    def fail_node(self, host: str) -> None:
        self.calls.append(("fail_node", host))

    def committed_step(self) -> int:
        return 7


def test_it_fails_the_node_the_controller_runs_on_and_the_next_controller_heals_it(tmp_path):
    plan = [
        PlannedFault(fault_id="f000", kind=KIND, target=Target(controller=True), at_s=1.0),
        PlannedFault(fault_id="f001", kind=KIND, target=Target(controller=True), at_s=5.0),
    ]
    now = [100.0]
    held = {KIND: {"hold_s": 2.0}}  # its heal (nothing to do) after the node is gone
    first = Injector(plan, Ctx(Journal(tmp_path / "j.jsonl", job="t"), "n1"), seed=1,
                     options=held, clock=lambda: now[0])  # fmt: skip
    first.start()
    now[0] = 101.5
    first.poll()
    assert first.ctx.calls == [("fail_node", "n1")]  # type: ignore[attr-defined]
    first.ctx.journal.close()  # the node is gone, with this controller: no fault.heal from it
    records = read_journal(tmp_path / "j.jsonl")
    (inject,) = [r for r in records if r["event"] == FAULT_INJECT]
    assert inject["target"] == {"replica": None, "rank": None, "host": "n1", "controller": True}
    assert not [r for r in records if r["event"] == FAULT_HEAL]

    # the standby's controller, on n3: the plan resumed, f000 healed, f001 fails n3 in its turn
    ctx2 = Ctx(Journal(tmp_path / "j.jsonl", job="t"), "n3")
    second = Injector(plan, ctx2, seed=1, options=held, clock=lambda: now[0])
    now[0] = 100.0  # its clock as its start's: the wall clock barely moved in this test
    second.resume(records)
    second.poll()
    assert ctx2.calls == []
    now[0] = 103.5
    second.poll()  # f000's heal
    now[0] = 105.5
    second.poll()
    assert ctx2.calls == [("fail_node", "n3")]
    ctx2.journal.close()
    records = read_journal(tmp_path / "j.jsonl")
    injects = [(r["fault_id"], r["target"]["host"]) for r in records if r["event"] == FAULT_INJECT]
    assert injects == [("f000", "n1"), ("f001", "n3")]
    assert [r["fault_id"] for r in records if r["event"] == FAULT_HEAL] == ["f000"]


# -- the recoveries linked to it --------------------------------------------------------------


def _tracker() -> tuple[Journal, RecoveryTracker, list[dict[str, Any]]]:
    journal = Journal(None, job="unit")
    phases: list[dict[str, Any]] = []
    journal.add_sink(lambda r: phases.append(r) if r["event"] == RECOVERY_PHASE else None)
    return journal, RecoveryTracker(journal), phases


def _lost_host(replica: int, host: str, t: float) -> Failure:
    return Failure(
        cause=Cause.LOST_HOST,
        detail="agent gone",
        coords={"replica": replica, "rank": 0},
        host=host,
        t_event=t,
        t_detected=t,
    )


def _detected(phases: list[dict[str, Any]]) -> dict[Any, Any]:
    return {(r["cause"], r["replica"]): r["fault_id"] for r in phases if r["phase"] == "detected"}


def test_the_takeover_and_the_groups_on_the_lost_node_are_linked_to_it():
    """controller_node = "trains": n1 ran the controller and group 0; group 1 on n2 dies of
    something else. The takeover and group 0's recovery are the fault's, group 1's is not."""
    journal, tracker, phases = _tracker()
    target = {"replica": None, "rank": None, "host": "n1", "controller": True}
    journal.emit(FAULT_INJECT, t=100.0, fault_id="f000", kind=KIND, target=target)
    tracker.controller_replaced(t_detected=106.0)
    tracker.on_failure(_lost_host(0, "n1", 110.0))
    tracker.on_failure(_lost_host(1, "n2", 111.0))
    assert _detected(phases) == {
        ("controller_crash", None): "f000",
        ("lost_host", 0): "f000",
        ("lost_host", 1): None,
    }


def test_a_controller_crash_explains_no_group_and_the_node_fault_is_resumed():
    """A controller_crash (no host) still explains the takeover alone; a new controller's
    tracker, resumed from the journal, links its takeover to the node failure before it."""
    journal, tracker, phases = _tracker()
    crash = {"replica": None, "rank": None, "host": None, "controller": True}
    journal.emit(FAULT_INJECT, t=100.0, fault_id="f000", kind="controller_crash", target=crash)
    tracker.on_failure(_lost_host(0, "n1", 101.0))
    assert _detected(phases) == {("lost_host", 0): None}

    records = [
        {"t": 200.0, "event": FAULT_INJECT, "fault_id": "f001", "kind": KIND,
         "target": {"replica": None, "rank": None, "host": "n1", "controller": True}},
    ]  # fmt: skip
    _, tracker2, phases2 = _tracker()
    tracker2.resume(records)
    tracker2.controller_replaced(t_detected=260.0)  # a takeover is linked however late
    assert _detected(phases2) == {("controller_crash", None): "f001"}


# -- the job's side: refused unless a standby takes over, the journal fsync'd first ------------


def _job(tmp_path: Path, *, survivable: bool) -> Any:
    cfg = load_config(str(ROOT / "experiments" / "tiny.toml"), list(SLURM))
    journal = Journal(tmp_path / "journal.jsonl", job="t")
    return SimpleNamespace(
        cfg=cfg, journal=journal, site=SimpleNamespace(slurm=object()), survivable=survivable
    )


def test_the_controllers_own_node_is_failed_only_with_a_standby_elsewhere(tmp_path, monkeypatch):
    from harness.keeper.keeper import KEEPER_ENV

    monkeypatch.setenv("SLURMD_NODENAME", "n1")
    started: list[list[str]] = []
    synced: list[int] = []

    class Killer:  # the node's killer: in the test, it fails and exits at once
        def __init__(self, argv: list[str], **kw: Any) -> None:
            started.append(argv)

        def wait(self, timeout: float) -> int:
            return 1

    monkeypatch.setattr(subprocess, "Popen", Killer)
    # a namespace that is no node's comes first (a killed run's leftover): never chosen
    names = ["fth1234-host0", "ftslurm-n2", "ftslurm-n1"]
    monkeypatch.setattr(testcluster, "namespaces", lambda: names)
    monkeypatch.setattr(testcluster, "node_namespace", lambda node: f"ftslurm-{node}")
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(fd), real_fsync(fd)))

    ctx = JobFaultContext(_job(tmp_path, survivable=False))
    assert ctx.controller_host() == "n1"
    with pytest.raises(ValueError, match="not one run under a keeper"):
        ctx.fail_node("n1")
    monkeypatch.setenv(KEEPER_ENV, "1")
    ctx = JobFaultContext(_job(tmp_path, survivable=True))
    with pytest.raises(ValueError, match="no standby on another node"):
        ctx.fail_node("n1")
    assert started == [] and synced == []

    # beats served, but no standby connected yet (its job step still starting): waited for
    keeper = tmp_path / "keeper.json"
    keeper.write_text(json.dumps({"host": "n1", "beat": "10.0.0.1:4000", "watched": False}))
    monkeypatch.setattr(fault_context, "STANDBY_WAIT_S", 0.3)
    with pytest.raises(ValueError, match=r"none connected to it within 0\.3 s"):
        ctx.fail_node("n1")
    assert started == [] and synced == []
    monkeypatch.setattr(fault_context, "STANDBY_WAIT_S", 30.0)
    watched = {"host": "n1", "beat": "10.0.0.1:4000", "watched": True}
    threading.Timer(0.3, lambda: keeper.write_text(json.dumps(watched))).start()
    ctx.journal.emit(FAULT_INJECT, fault_id="f000", kind=KIND, target={"host": "n1"})
    with pytest.raises(ValueError, match="its killer exited with status 1"):
        ctx.fail_node("n1")  # a killer that fails: the fault did not fire, and says so
    assert len(synced) == 1  # the journal, before the node goes
    (argv,) = started
    assert argv[:2] == ["nsenter", "--net=/run/netns/ftslurm-n2"] and argv[-1] == "n1"
    ctx.journal.close()
