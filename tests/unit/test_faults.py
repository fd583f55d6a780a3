"""Every fault kind fires against a hand-written FaultContext; signals hit real processes.

In-worker functions are only named here (their real effect is tested in
tests/integration/test_inworker_faults.py); the process, host and service faults act on real
``sleep`` children and are checked with psutil and exit statuses.
"""

from __future__ import annotations

import json
import random
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import psutil
import pytest

from faults import inworker
from faults.fault import (
    Target,
    fault_class,
    fault_kinds,
    fault_options,
    make_fault,
    register,
)
from faults.injector import Injector, due_faults
from faults.schedule import PlannedFault
from faults.targets import KeepAlive
from runtime.actor import wire_name
from runtime.journal import Journal, read_journal


def spawn() -> subprocess.Popen:
    return subprocess.Popen(["sleep", "60"])


def wait_status(pid: int, want: set[str], deadline_s: float = 10.0) -> str:
    """Poll until the process's status is one of ``want`` (signal delivery is asynchronous)."""
    end = time.monotonic() + deadline_s
    status = ""
    while time.monotonic() < end:
        status = psutil.Process(pid).status()
        if status in want:
            return status
        time.sleep(0.01)
    return status


class FakeContext:
    """The FaultContext a test needs: real child processes per (replica, rank), a host map, a
    real quorum-service process, and a log of every call."""

    def __init__(self, journal: Journal, replicas: int = 3, ranks: int = 1, hosts: int = 2):
        self.journal = journal
        self.replicas = replicas
        self.ranks = ranks
        self._hosts = [f"host{i}" for i in range(hosts)]
        self.workers = {(r, k): spawn() for r in range(replicas) for k in range(ranks)}
        self.service = spawn()
        self.calls: list[tuple[Any, ...]] = []
        self.step = 0
        self.heals: dict[int, int] = {}  # healing group -> its source
        self.writes: dict[int, int] = {}  # group writing a checkpoint -> its step

    def hosts(self) -> list[str]:
        return list(self._hosts)

    def replica_host(self, replica: int) -> str:
        return self._hosts[replica % len(self._hosts)]

    def pids(self, target: Target) -> list[int]:
        return [
            p.pid
            for (r, k), p in self.workers.items()
            if r == target.replica and target.rank in (None, k)
        ]

    def run_in_worker(self, target: Target, func: Callable[..., Any], *args: Any) -> None:
        wire_name(func)  # what the job's context ships: raises for what a worker cannot import
        self.calls.append(("run_in_worker", target, func, args))

    def kill_host(self, host: str) -> None:
        self.calls.append(("kill_host", host))
        for (r, _), p in self.workers.items():
            if self.replica_host(r) == host:
                p.kill()

    def set_host_cooldown(self, host: str, seconds: float) -> None:
        self.calls.append(("set_host_cooldown", host, seconds))

    def kill_quorum_service(self) -> None:
        self.calls.append(("kill_quorum_service",))
        self.service.kill()

    networked = True  # the network faults only record their calls here

    def partition_host(self, host: str) -> None:
        self.calls.append(("partition_host", host))

    def reconnect_host(self, host: str) -> None:
        self.calls.append(("reconnect_host", host))

    def impair_link(self, host: str, delay_ms: float, loss_pct: float) -> None:
        self.calls.append(("impair_link", host, delay_ms, loss_pct))

    def clear_link(self, host: str) -> None:
        self.calls.append(("clear_link", host))

    def fail_node(self, host: str) -> None:  # a SLURM node: every process on it dies
        self.calls.append(("fail_node", host))
        for (r, _), p in self.workers.items():
            if self.replica_host(r) == host:
                p.kill()

    def cancel_step(self, host: str) -> None:
        self.calls.append(("cancel_step", host))

    def committed_step(self) -> int:
        return self.step

    def heals_under_way(self) -> dict[int, int]:
        return dict(self.heals)

    def checkpoints_under_way(self) -> dict[int, int]:
        return dict(self.writes)

    def close(self) -> None:
        for p in [*self.workers.values(), self.service]:
            if p.poll() is None:
                try:
                    p.send_signal(signal.SIGCONT)  # in case a test left it stopped
                finally:
                    p.kill()
                    p.wait()


@pytest.fixture
def ctx(tmp_path):
    c = FakeContext(Journal(tmp_path / "journal.jsonl", job="test"))
    yield c
    c.close()
    c.journal.close()


RNG = random.Random(0)


def test_catalogue_is_complete():
    assert set(fault_kinds()) >= {
        "segfault", "kill", "collective_abort", "gil_deadlock", "hang", "host_eviction",
        "lighthouse_crash", "slow_rank",
    }  # fmt: skip
    assert fault_class("host_eviction").default_target == "host"
    assert fault_class("lighthouse_crash").default_target == "service"
    assert fault_class("kill").default_target == "rank"


def test_unknown_kind_and_option_are_named():
    with pytest.raises(KeyError, match=r"unknown fault kind 'oom'; known kinds: .*segfault"):
        fault_class("oom")
    with pytest.raises(ValueError, match=r"slow_rank.*no option 'delay'.*delay_s"):
        make_fault("slow_rank", delay=1)
    assert fault_options("slow_rank")["delay_s"] == 0.5


def test_a_name_cannot_be_registered_twice():
    with pytest.raises(ValueError, match="already registered"):

        @register("kill")
        @dataclass(frozen=True, kw_only=True)
        class OtherKill:
            default_target: ClassVar[str] = "rank"


def test_kill_sends_sigkill_to_the_target_rank_only(ctx):
    make_fault("kill").fire(ctx, Target(replica=1, rank=0), RNG)
    assert ctx.workers[(1, 0)].wait(timeout=10) == -9
    assert ctx.workers[(0, 0)].poll() is None and ctx.workers[(2, 0)].poll() is None


def test_hang_stops_and_heal_continues(ctx):
    fault = make_fault("hang")
    pid = ctx.workers[(2, 0)].pid
    fault.fire(ctx, Target(replica=2, rank=0), RNG)
    assert wait_status(pid, {psutil.STATUS_STOPPED}) == psutil.STATUS_STOPPED
    fault.heal(ctx, Target(replica=2, rank=0))
    assert wait_status(pid, {psutil.STATUS_SLEEPING, psutil.STATUS_RUNNING}) != "stopped"
    fault.heal(ctx, Target(replica=2, rank=0))  # healing twice is harmless


def test_hang_heal_tolerates_a_process_already_gone(ctx):
    fault = make_fault("hang")
    fault.fire(ctx, Target(replica=0, rank=0), RNG)
    ctx.workers[(0, 0)].kill()
    ctx.workers[(0, 0)].wait(timeout=10)
    fault.heal(ctx, Target(replica=0, rank=0))  # no exception


def test_host_eviction_sets_cooldown_then_kills_every_process_on_the_host(ctx):
    make_fault("host_eviction", cooldown_s=12.0).fire(ctx, Target(host="host0"), RNG)
    assert ctx.calls[:2] == [("set_host_cooldown", "host0", 12.0), ("kill_host", "host0")]
    assert ctx.workers[(0, 0)].wait(timeout=10) == -9  # replicas 0 and 2 live on host0
    assert ctx.workers[(2, 0)].wait(timeout=10) == -9
    assert ctx.workers[(1, 0)].poll() is None


def test_slurm_faults_act_on_their_node(ctx):
    make_fault("node_failure").fire(ctx, Target(host="host1"), RNG)
    assert ctx.calls == [("fail_node", "host1")]
    assert ctx.workers[(1, 0)].wait(timeout=10) == -9  # replica 1 lives on host1
    assert ctx.workers[(0, 0)].poll() is None
    make_fault("scancel_step").fire(ctx, Target(host="host0"), RNG)
    assert ctx.calls[-1] == ("cancel_step", "host0")
    with pytest.raises(ValueError, match="needs a host"):
        make_fault("scancel_step").fire(ctx, Target(replica=0), RNG)


def test_lighthouse_crash_kills_the_quorum_service(ctx):
    make_fault("lighthouse_crash").fire(ctx, Target(), RNG)
    assert ctx.service.wait(timeout=10) == -9
    assert all(p.poll() is None for p in ctx.workers.values())


@pytest.mark.parametrize(
    ("kind", "func", "args"),
    [
        ("segfault", inworker.segfault, ()),
        ("collective_abort", inworker.abort_collectives, ()),
        ("gil_deadlock", inworker.hold_gil, (3600.0,)),
        ("slow_rank", inworker.set_step_delay, (0.5,)),
    ],
)
def test_in_worker_faults_run_their_function(ctx, kind, func, args):
    target = Target(replica=1, rank=0)
    make_fault(kind).fire(ctx, target, RNG)
    assert ctx.calls == [("run_in_worker", target, func, args)]


def test_slow_rank_heal_resets_the_delay(ctx):
    target = Target(replica=1, rank=0)
    fault = make_fault("slow_rank", delay_s=2.0)
    fault.fire(ctx, target, RNG)
    fault.heal(ctx, target)
    assert [c[3] for c in ctx.calls] == [(2.0,), (0.0,)]


# -- the injector --------------------------------------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def events(ctx: FakeContext) -> list[dict]:
    return read_journal(ctx.journal.path)


@register("test_journal_probe")
@dataclass(frozen=True, kw_only=True)
class JournalProbe:
    """A kind registered by the test alone: the injector runs it without knowing it, and it
    records whether its fault.inject record was already on disk when it fired."""

    default_target: ClassVar[str] = "rank"
    hold_s: float = 0.0
    seen: ClassVar[list[bool]] = []

    def fire(self, ctx, target, rng) -> None:
        lines = ctx.journal.path.read_text().splitlines()
        JournalProbe.seen.append(json.loads(lines[-1])["event"] == "fault.inject")

    def heal(self, ctx, target) -> None:
        return None


def test_injector_logs_before_firing_and_walks_time_and_steps(ctx):
    clock = Clock()
    plan = [
        PlannedFault(
            fault_id="f000", kind="test_journal_probe", target=Target(replica=1, rank=0), at_s=5.0
        ),
        PlannedFault(fault_id="f001", kind="kill", target=Target(replica=2, rank=0), at_step=10),
    ]
    inj = Injector(plan, ctx, seed=3, clock=clock)
    inj.start()
    inj.poll()
    assert inj.fired == []
    clock.now = 5.0
    inj.poll()
    assert inj.fired == ["f000"] and JournalProbe.seen == [True]
    ctx.step = 9
    inj.poll()
    assert ctx.workers[(2, 0)].poll() is None
    ctx.step = 10
    inj.poll()
    assert ctx.workers[(2, 0)].wait(timeout=10) == -9
    inject = [e for e in events(ctx) if e["event"] == "fault.inject"]
    assert [(e["fault_id"], e["kind"], e["seed"]) for e in inject] == [
        ("f000", "test_journal_probe", 3),
        ("f001", "kill", 3),
    ]
    assert inject[1]["target"] == {"replica": 2, "rank": 0, "host": "host0"}
    assert inject[1]["step"] == 10
    assert inj.done


def test_injector_heals_after_hold_and_on_close(ctx):
    clock = Clock()
    plan = [
        PlannedFault(fault_id="f000", kind="hang", target=Target(replica=1, rank=0), at_s=0.0),
        PlannedFault(fault_id="f001", kind="hang", target=Target(replica=2, rank=0), at_s=1.0),
    ]
    inj = Injector(plan, ctx, seed=0, clock=clock, options={"hang": {"hold_s": 5.0}})
    inj.start()
    inj.poll()
    p1, p2 = ctx.workers[(1, 0)].pid, ctx.workers[(2, 0)].pid
    assert wait_status(p1, {"stopped"}) == "stopped"
    clock.now = 1.0
    inj.poll()
    assert wait_status(p2, {"stopped"}) == "stopped"
    clock.now = 5.0  # f000 has been held 5 s; f001 only 4 s
    inj.poll()
    assert wait_status(p1, {"sleeping", "running"}) != "stopped"
    assert psutil.Process(p2).status() == "stopped"
    inj.close()  # heals f001 early
    assert wait_status(p2, {"sleeping", "running"}) != "stopped"
    heals = [e["fault_id"] for e in events(ctx) if e["event"] == "fault.heal"]
    assert heals == ["f000", "f001"]


def test_injector_never_hits_keep_alive_or_the_last_healthy_group(ctx):
    plan = [
        PlannedFault(fault_id="f000", kind="kill", target=Target(replica=0, rank=0), at_s=0.0),
        PlannedFault(fault_id="f001", kind="host_eviction", target=Target(host="host0"), at_s=0.0),
        PlannedFault(fault_id="f002", kind="kill", target=Target(replica=1, rank=0), at_s=0.0),
    ]
    inj = Injector(
        plan, ctx, seed=0, keep_alive=KeepAlive(replicas=frozenset({0})), healthy=lambda: {1}
    )
    inj.poll()
    assert inj.fired == []
    assert [fid for fid, _ in inj.skipped] == ["f000", "f001", "f002"]
    assert "keep-alive" in inj.skipped[0][1] and "keep-alive replica [0]" in inj.skipped[1][1]
    assert "last healthy" in inj.skipped[2][1]
    assert all(p.poll() is None for p in ctx.workers.values())
    assert not [e for e in events(ctx) if e["event"] == "fault.inject"]


def test_a_heal_source_kill_waits_for_a_heal_and_kills_every_rank_of_its_source(tmp_path):
    """Due, it slows every group's serving (``arm``); it fires only once a heal is under way,
    at that heal's source (not its planned target), every rank of it; the ``fault.inject``
    names the source, so the source's recovery is linked to it; its heal restores the serving.
    One whose heal is over before it fires is skipped, not fired at its planned target."""
    ctx = FakeContext(Journal(tmp_path / "journal.jsonl", job="test"), ranks=2)
    try:
        clock = Clock()
        plan = [
            PlannedFault(fault_id="f000", kind="heal_source_kill", target=Target(replica=1),
                         at_s=1.0),
        ]  # fmt: skip
        options = {"heal_source_kill": {"slow_serve_s": 1.5, "wait_s": 10.0}}
        keep = KeepAlive(replicas=frozenset({0}))
        inj = Injector(plan, ctx, seed=0, clock=clock, options=options, keep_alive=keep)
        inj.start()
        clock.now = 1.0
        inj.poll()
        delays = [(c[1].replica, c[3]) for c in ctx.calls if c[0] == "run_in_worker"]
        assert delays == [(0, (1.5,)), (1, (1.5,)), (2, (1.5,))]
        assert all(c[2] is inworker.set_serve_delay for c in ctx.calls)
        clock.now = 3.0
        inj.poll()
        assert inj.fired == [] and all(p.poll() is None for p in ctx.workers.values())
        ctx.heals = {1: 0}  # group 1 heals from group 0, which is kept alive: not yet
        inj.poll()
        assert inj.fired == []
        ctx.heals = {1: 0, 0: 2}  # group 0 heals from group 2 too (which it may hit)
        inj.poll()
        assert inj.fired == ["f000"]
        assert ctx.workers[(2, 0)].wait(timeout=10) == -9
        assert ctx.workers[(2, 1)].wait(timeout=10) == -9
        assert all(ctx.workers[(r, k)].poll() is None for r in (0, 1) for k in (0, 1))
        assert inj.skipped == []
        (inject,) = [e for e in events(ctx) if e["event"] == "fault.inject"]
        assert inject["target"] == {"replica": 2, "rank": None, "host": "host0"}
        assert inject["ready"] is True
        inj.poll()  # hold_s 0: healed at once
        assert ctx.calls[-1][2:] == (inworker.set_serve_delay, (0.0,))
        assert inj.done

        late = Injector(
            [PlannedFault(fault_id="f001", kind="heal_source_kill", target=Target(replica=0),
                          at_s=0.0)],
            ctx, seed=0, clock=clock, options={"heal_source_kill": {"wait_s": 1.0}},
        )  # fmt: skip
        ctx.heals = {}
        late.start()
        late.poll()
        clock.now += 2.0  # its moment never came: no heal to aim at
        late.poll()
        assert late.fired == [] and [f for f, _ in late.skipped] == ["f001"]
        assert ctx.workers[(0, 0)].poll() is None
    finally:
        ctx.close()
        ctx.journal.close()


def test_a_checkpoint_kill_waits_for_a_write_and_kills_every_rank_of_its_writer(tmp_path):
    """Due, it slows every group's checkpoint writes (``arm``); it fires only once a write is
    under way, at the writing group (not its planned target), every rank of it; its heal
    restores the writes' speed."""
    ctx = FakeContext(Journal(tmp_path / "journal.jsonl", job="test"), ranks=2)
    try:
        clock = Clock()
        plan = [
            PlannedFault(fault_id="f000", kind="checkpoint_kill", target=Target(replica=0),
                         at_s=1.0),
        ]  # fmt: skip
        options = {"checkpoint_kill": {"slow_write_s": 3.0, "wait_s": 10.0}}
        inj = Injector(plan, ctx, seed=0, clock=clock, options=options)
        inj.start()
        clock.now = 1.0
        inj.poll()
        delays = [(c[1].replica, c[3]) for c in ctx.calls if c[0] == "run_in_worker"]
        assert delays == [(0, (3.0,)), (1, (3.0,)), (2, (3.0,))]
        assert all(c[2] is inworker.set_checkpoint_delay for c in ctx.calls)
        clock.now = 3.0
        inj.poll()
        assert inj.fired == []  # no write under way yet
        ctx.writes = {2: 50}
        inj.poll()
        assert inj.fired == ["f000"]
        assert ctx.workers[(2, 0)].wait(timeout=10) == -9
        assert ctx.workers[(2, 1)].wait(timeout=10) == -9
        assert all(ctx.workers[(r, k)].poll() is None for r in (0, 1) for k in (0, 1))
        (inject,) = [e for e in events(ctx) if e["event"] == "fault.inject"]
        assert inject["target"] == {"replica": 2, "rank": None, "host": "host0"}
        inj.poll()
        assert ctx.calls[-1][2:] == (inworker.set_checkpoint_delay, (0.0,))
        assert inj.done
    finally:
        ctx.close()
        ctx.journal.close()


def test_checkpoint_kill_options_are_checked():
    with pytest.raises(ValueError, match="wait_s"):
        make_fault("checkpoint_kill", wait_s=0)
    with pytest.raises(ValueError, match="slow_write_s"):
        make_fault("checkpoint_kill", slow_write_s=-1)


def test_heal_source_kill_options_are_checked():
    with pytest.raises(ValueError, match="wait_s"):
        make_fault("heal_source_kill", wait_s=0)
    with pytest.raises(ValueError, match="slow_serve_s"):
        make_fault("heal_source_kill", slow_serve_s=-1)


def test_a_fault_that_fails_to_fire_is_reported(ctx):
    ctx.workers[(1, 0)].kill()
    ctx.workers[(1, 0)].wait()
    ctx.workers.pop((1, 0))  # the harness knows no pid for the target any more
    plan = [PlannedFault(fault_id="f000", kind="kill", target=Target(replica=1, rank=0), at_s=0)]
    inj = Injector(plan, ctx, seed=0)
    inj.poll()
    kinds = [(e["event"], e.get("error", "")) for e in events(ctx)]
    assert kinds[0] == ("fault.plan", "")  # the plan first: a takeover resumes it
    assert kinds[1] == ("fault.inject", "")
    assert kinds[2][0] == "fault.heal" and "no worker process" in kinds[2][1]


def test_a_bad_fault_option_fails_before_anything_fires(ctx):
    plan = [PlannedFault(fault_id="f000", kind="hang", target=Target(replica=1), at_s=0)]
    with pytest.raises(ValueError, match="no option 'hold'"):
        Injector(plan, ctx, seed=0, options={"hang": {"hold": 1}})


def test_due_faults_keeps_plan_order():
    plan = [
        PlannedFault(fault_id="a", kind="kill", target=Target(replica=1), at_step=5),
        PlannedFault(fault_id="b", kind="kill", target=Target(replica=1), at_s=1.0),
    ]
    assert due_faults(plan, 0, elapsed_s=10.0, committed_step=4) == []  # b waits for a
    assert [f.fault_id for f in due_faults(plan, 0, 10.0, 5)] == ["a", "b"]
    assert [f.fault_id for f in due_faults(plan, 1, 0.5, 5)] == []


def test_network_faults_act_on_the_hosts_link_and_heal_it(tmp_path) -> None:
    journal = Journal(tmp_path / "j.jsonl", job="t")
    ctx = FakeContext(journal)
    try:
        host = Target(host="host1")
        rng = random.Random(0)
        part = make_fault("network_partition", hold_s=6.0)
        part.fire(ctx, host, rng)
        part.heal(ctx, host)
        make_fault("network_delay", delay_ms=50).fire(ctx, host, rng)
        make_fault("packet_loss", loss_pct=3).fire(ctx, host, rng)
        make_fault("packet_loss").heal(ctx, host)
        assert ctx.calls == [
            ("set_host_cooldown", "host1", 6.0),  # no new agent while it is cut off
            ("partition_host", "host1"),
            ("reconnect_host", "host1"),
            ("impair_link", "host1", 50, 0.0),
            ("impair_link", "host1", 0.0, 3),
            ("clear_link", "host1"),
        ]
        with pytest.raises(ValueError, match="needs a host target"):
            part.fire(ctx, Target(replica=0), rng)
    finally:
        ctx.close()
        journal.close()


def test_network_faults_need_hosts_with_their_own_network() -> None:
    from faults.schedule import ScheduleSpec, plan
    from faults.targets import TargetError, TargetSpec, Topology

    spec = ScheduleSpec(kind="at_steps", at_steps=(5,))
    with pytest.raises(TargetError, match="launcher = 'netns'"):
        plan(spec, {"network_partition": 1.0}, TargetSpec(), Topology.from_counts(2, 1, 2), seed=1)
    networked = Topology.from_counts(2, 1, 2, networked=True)
    (f,) = plan(spec, {"network_partition": 1.0}, TargetSpec(), networked, seed=1)
    assert f.target.host in ("host0", "host1")


def test_every_trainer_hook_the_in_worker_faults_call_is_on_the_trainer_actor():
    """An in-worker fault finds its hook on the worker's actors by name (``inworker._trainer``);
    one missing from ``TrainerActor`` fails inside the worker, where nobody waits for it (the
    serve delay of heal_source_kill did, unseen, until this test)."""
    import inspect
    import re

    from harness.rank.actors import TrainerActor

    called = set(re.findall(r'_trainer\("(\w+)"\)', inspect.getsource(inworker)))
    assert called >= {"set_serve_delay", "set_step_delay", "abort_collectives"}
    missing = sorted(m for m in called if not callable(getattr(TrainerActor, m, None)))
    assert not missing, f"TrainerActor lacks {missing}"
