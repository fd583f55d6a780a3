"""Schedules and target selection are pure and seeded: same seed -> same plan."""

from __future__ import annotations

import dataclasses
import itertools
import random
import statistics

import pytest

from faults.fault import Target
from faults.schedule import ScheduleError, ScheduleSpec, describe_plan, fault_times, plan
from faults.targets import (
    KeepAlive,
    TargetError,
    TargetSpec,
    Topology,
    protected_reason,
    resolve_kind,
    select_target,
)

TOPO = Topology.from_counts(4, 2, 2)  # replicas 0,2 on host0; 1,3 on host1
MIX = {"segfault": 1, "kill": 2, "host_eviction": 1, "gil_deadlock": 1, "lighthouse_crash": 1}
EVERY_20_30 = ScheduleSpec(kind="interval", interval_s=20, jitter_s=10, start_s=15)


def make(seed: int, **kw):
    return plan(
        kw.get("schedule", EVERY_20_30),
        kw.get("mix", MIX),
        kw.get("targets", TargetSpec(keep_alive=KeepAlive(replicas=frozenset({0})))),
        kw.get("topology", TOPO),
        seed=seed,
        horizon_s=kw.get("horizon_s", 600.0),
    )


def test_same_seed_same_plan_and_another_seed_another():
    a, b = make(7), make(7)
    assert a == b
    assert describe_plan(a) == describe_plan(b)
    assert make(8) != a
    assert len({f.fault_id for f in a}) == len(a) > 10


def test_interval_with_jitter_stays_in_its_window():
    times = [f.at_s for f in make(1)]
    assert 15 <= times[0] <= 25
    gaps = [b - a for a, b in itertools.pairwise(times)]
    assert all(20 <= g <= 30 for g in gaps)
    assert max(times) < 600


def test_poisson_has_the_requested_mean():
    spec = ScheduleSpec(kind="poisson", mean_s=30.0)
    times = fault_times(spec, random.Random("x"), horizon_s=60_000)
    gaps = [b - a for a, b in zip([0.0, *times], times, strict=False)]
    assert statistics.fmean(gaps) == pytest.approx(30.0, rel=0.1)
    assert len(set(gaps)) == len(gaps)  # not a fixed interval


def test_explicit_steps_and_times():
    at_steps = make(1, schedule=ScheduleSpec(kind="at_steps", at_steps=(40, 10, 25)))
    assert [(f.at_step, f.at_s) for f in at_steps] == [(10, None), (25, None), (40, None)]
    at_times = make(1, schedule=ScheduleSpec(kind="at_times", at_times=(5.0, 700.0, 1.0)))
    assert [f.at_s for f in at_times] == [1.0, 5.0]  # 700 s is past the horizon


def test_max_faults_caps_the_plan():
    capped = dataclasses.replace(EVERY_20_30, max_faults=3)
    assert len(make(1, schedule=capped)) == 3


def test_changing_the_mix_does_not_move_the_times():
    a = [f.at_s for f in make(5)]
    b = [f.at_s for f in make(5, mix={"kill": 1})]
    assert a == b


@pytest.mark.parametrize("seed", range(20))
def test_keep_alive_is_never_planned(seed):
    for f in make(seed):
        assert f.target.replica != 0
        if f.kind == "host_eviction":
            assert f.target.host == "host1"  # host0 runs keep-alive replica 0
            assert f.target.replica is None
        if f.kind == "lighthouse_crash":
            assert f.target == Target()


def test_target_kinds():
    spec = TargetSpec(kind="replica")
    rng = random.Random(0)
    t = select_target(resolve_kind("rank", "replica"), spec, TOPO, rng)
    assert t.replica is not None and t.rank is None and t.host == TOPO.replica_hosts[t.replica]
    ranks = {select_target("rank", TargetSpec(), TOPO, rng).rank for _ in range(50)}
    assert ranks == {0, 1}
    assert resolve_kind("host", "rank") == "host"  # an eviction always hits a host
    assert resolve_kind("service", "replica") == "service"


def test_candidates_narrow_the_draw():
    spec = TargetSpec(replicas=(3,))
    rng = random.Random(0)
    assert {select_target("rank", spec, TOPO, rng).replica for _ in range(20)} == {3}


def test_nothing_eligible_is_an_error():
    all_kept = TargetSpec(keep_alive=KeepAlive(replicas=frozenset(range(4))))
    with pytest.raises(TargetError, match="no replica group can be hit"):
        select_target("rank", all_kept, TOPO, random.Random(0))
    both_hosts_guarded = TargetSpec(keep_alive=KeepAlive(replicas=frozenset({0, 1})))
    with pytest.raises(TargetError, match="no host can be evicted"):
        select_target("host", both_hosts_guarded, TOPO, random.Random(0))


def test_bad_schedules_are_rejected():
    with pytest.raises(ScheduleError, match="interval_s"):
        ScheduleSpec(kind="interval", interval_s=-5)
    with pytest.raises(ScheduleError, match="mean_s"):
        ScheduleSpec(kind="poisson")
    with pytest.raises(ScheduleError, match="at_steps"):
        ScheduleSpec(kind="at_steps", at_steps=())
    with pytest.raises(ScheduleError, match="horizon"):
        plan(EVERY_20_30, MIX, TargetSpec(), TOPO, seed=0, horizon_s=None)
    with pytest.raises(ScheduleError, match="weight > 0"):
        plan(EVERY_20_30, {}, TargetSpec(), TOPO, seed=0, horizon_s=60)


def test_protected_reason_uses_live_placement():
    keep = KeepAlive(replicas=frozenset({0}), hosts=frozenset({"host9"}))

    def moved(r: int) -> str:  # after an eviction, replica 3 was re-placed on host9
        return "host9" if r == 3 else TOPO.replica_hosts[r]

    assert protected_reason(Target(replica=3), keep, replica_host=moved, replicas=4)
    assert protected_reason(Target(replica=1), keep, replica_host=moved, replicas=4) is None
    assert protected_reason(Target(), keep, replica_host=moved, replicas=4) is None
    healthy_only_1 = protected_reason(
        Target(replica=1), keep, replica_host=moved, replicas=4, healthy={1}
    )
    assert healthy_only_1 and "last healthy" in healthy_only_1
