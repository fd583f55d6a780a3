"""dashboards.metrics recomputed from a small hand-written journal; every expected number below
was worked out by hand from the records (the arithmetic is in the comments)."""

from __future__ import annotations

import pytest
from sim_journal import T0, simulate

from dashboards.metrics import percentile, stats, summarize
from runtime.journal import Journal, read_journal

S = 4  # samples per commit


def commit(j: Journal, t: float, replica: int, step: int, **kw) -> None:
    j.emit(
        "step.commit",
        t=t,
        replica=replica,
        rank=0,
        step=step,
        loss=2.0,
        checksum=f"c{step}",
        samples=S,
        step_time_s=0.1,
        **kw,
    )


def write_in_place(j: Journal) -> None:
    """No ``policy`` field: counts as in_place. 3 groups, one commit per second; replica 2 is
    killed at 105.5 and participates again at 108.2."""
    j.emit("job.start", t=100.0, config={}, replicas=3, ranks=1)
    for step in range(1, 6):
        for r in range(3):
            commit(j, 100.0 + step, r, step)
    j.emit(
        "fault.inject",
        t=105.5,
        fault_id="f000",
        kind="kill",
        target={"replica": 2, "rank": 0, "host": "host0"},
        seed=1,
        step=5,
    )
    for phase, t in [
        ("detected", 105.7),
        ("survivors_resumed", 106.0),
        ("replacement_started", 106.1),
        ("healed", 107.0),
        ("participating", 108.2),
    ]:
        j.emit(
            "recovery.phase",
            t=t,
            recovery_id="r1",
            fault_id="f000",
            replica=2,
            phase=phase,
            cause="signal",
        )
    commit(j, 107.0, 1, 6)
    commit(j, 107.5, 0, 6)
    for r in range(3):
        commit(j, 108.5, r, 7)
        commit(j, 109.5, r, 8)
    j.emit("job.end", t=110.0, status="ok", reason="", steps=8)


def write_full_restart(j: Journal) -> None:
    """2 groups; replica 1 killed at 206.5; everything restarts from the step-4 checkpoint and
    steps 5 and 6 are committed again from 210."""
    j.emit("job.start", t=200.0, config={}, replicas=2, ranks=1)
    for step in range(1, 7):
        for r in range(2):
            commit(j, 200.0 + step, r, step)
    j.emit(
        "fault.inject",
        t=206.5,
        fault_id="f000",
        kind="kill",
        target={"replica": 1, "rank": 0, "host": "host1"},
        seed=1,
        step=6,
    )
    for phase, t in [
        ("detected", 206.6),
        ("replacement_started", 207.0),
        ("healed", 209.0),
        ("participating", 210.0),
    ]:
        j.emit(
            "recovery.phase",
            t=t,
            recovery_id="r2",
            fault_id="f000",
            replica=1,
            phase=phase,
            cause="signal",
        )
    j.emit("checkpoint.load", t=209.0, step=4, path="ckpt")
    for step in range(5, 9):
        for r in range(2):
            commit(j, 205.0 + step, r, step)
    j.emit("job.end", t=214.0, status="ok", reason="", steps=8)


@pytest.fixture
def records(tmp_path):
    a = Journal(tmp_path / "in_place" / "journal.jsonl", job="t")
    write_in_place(a)
    a.close()
    b = Journal(tmp_path / "full_restart" / "journal.jsonl", job="t", policy="full_restart")
    write_full_restart(b)
    b.close()
    return read_journal(tmp_path)  # both files, merged in time order


def test_in_place_figures(records):
    p = summarize(records)["policies"]["in_place"]
    assert p["committed_steps"] == 8
    assert p["duration_s"] == pytest.approx(10.0)  # job.end 110 - job.start 100
    # Commits after the first (t=101) up to the last (109.5): steps 2-5 x 3 groups = 12, step 6
    # x 2 (replica 2 was down), steps 7-8 x 3 = 6 -> 20 commits x 4 samples / 8.5 s.
    assert p["samples_per_s"] == pytest.approx(80 / 8.5)
    # Fault-free stretch (101, 105]: steps 2-5 x 3 groups = 12 x 4 / 4 s.
    assert p["baseline_samples_per_s"] == pytest.approx(12.0)
    assert p["goodput"] == pytest.approx(80 / 8.5 / 12.0)  # 0.784

    (rec,) = p["recoveries"]
    assert rec["recovery_id"] == "r1" and rec["fault_id"] == "f000" and rec["kind"] == "kill"
    assert rec["replica"] == 2 and not rec["derived"]
    assert rec["detection_s"] == pytest.approx(0.2)  # 105.7 - 105.5
    assert rec["participate_s"] == pytest.approx(2.7)  # 108.2 - 105.5
    # Replica 0's gaps 1,1,1,1,2.5,1,1 (median 1); the 105 -> 107.5 gap overlaps the window:
    # 2.5 - 1 = 1.5. Replica 1: 105 -> 107 = 2 - 1 = 1.0. The largest: 1.5.
    assert rec["stall_s"] == pytest.approx(1.5)
    # First step after the fault: 6 at 107.0; largest before: 5 -> 5 - 6 + 1 = 0.
    assert rec["steps_lost"] == 0
    assert list(rec["phases"]) == [
        "detected",
        "survivors_resumed",
        "replacement_started",
        "healed",
        "participating",
    ]

    kill = p["faults"]["kill"]
    assert kill["count"] == 1 and kill["recovered"] == 1 and kill["steps_lost"] == 0
    assert kill["detection_s"]["mean"] == pytest.approx(0.2)
    assert kill["stall_s"]["p95"] == pytest.approx(1.5)


def test_full_restart_figures(records):
    p = summarize(records)["policies"]["full_restart"]
    assert p["committed_steps"] == 8
    assert p["duration_s"] == pytest.approx(14.0)
    # Redone steps count once: steps 2-4 at 202-204 and 5-8 at 210-213, x 2 groups = 14 commits
    # x 4 samples over 201 -> 213 = 12 s.
    assert p["samples_per_s"] == pytest.approx(56 / 12)
    # Before the fault: (201, 206] holds steps 2-6 x 2 = 10 commits x 4 / 5 s.
    assert p["baseline_samples_per_s"] == pytest.approx(8.0)
    assert p["goodput"] == pytest.approx(56 / 12 / 8.0)  # 0.583

    (rec,) = p["recoveries"]
    assert rec["detection_s"] == pytest.approx(0.1)
    assert rec["participate_s"] == pytest.approx(3.5)
    # Replica 0 (the survivor, restarted with everyone): gap 206 -> 210 = 4, median 1 -> 3.
    assert rec["stall_s"] == pytest.approx(3.0)
    # Smallest step after the fault: 5 (at 210); largest before 210: 6 -> 6 - 5 + 1 = 2.
    assert rec["steps_lost"] == 2
    assert p["faults"]["kill"]["steps_lost"] == 2


def test_comparison_ratios(records):
    comp = summarize(records)["comparison"]
    assert comp["participate_s_ratio"] == pytest.approx(3.5 / 2.7)
    assert comp["stall_s_ratio"] == pytest.approx(3.0 / 1.5)
    assert comp["goodput_ratio"] == pytest.approx((56 / 12 / 8.0) / (80 / 8.5 / 12.0))


def test_no_comparison_with_one_policy(tmp_path):
    j = Journal(tmp_path / "j.jsonl", job="t")
    write_in_place(j)
    j.close()
    assert "comparison" not in summarize(read_journal(tmp_path / "j.jsonl"))


def test_derived_recovery_without_phase_records(tmp_path):
    """A harness that logs only failure / proc.start / step.commit still gets figures."""
    j = Journal(tmp_path / "j.jsonl", job="t")
    for step in range(1, 4):
        commit(j, 10.0 + step, 0, step)
        commit(j, 10.0 + step, 1, step)
    j.emit(
        "fault.inject",
        t=13.2,
        fault_id="f000",
        kind="segfault",
        target={"replica": 1, "rank": 0, "host": "h"},
        seed=0,
    )
    j.emit("failure", t=13.5, replica=1, rank=0, cause="signal", signal=11)
    j.emit("proc.start", t=14.0, replica=1, rank=0, host="h", pid=1, spare=False)
    commit(j, 14.0, 0, 4)
    commit(j, 15.0, 0, 5)
    commit(j, 15.0, 1, 5)
    j.close()
    (rec,) = summarize(read_journal(tmp_path / "j.jsonl"))["policies"]["in_place"]["recoveries"]
    assert rec["derived"] and rec["kind"] == "segfault"
    assert rec["detection_s"] == pytest.approx(0.3)  # failure 13.5 - fault 13.2
    assert rec["participate_s"] == pytest.approx(1.8)  # replica 1's commit at 15.0 - 13.2
    # Replica 0's gaps are all 1 s: no stall.
    assert rec["stall_s"] == pytest.approx(0.0)


def test_unrecovered_fault_is_counted_but_not_recovered(tmp_path):
    j = Journal(tmp_path / "j.jsonl", job="t")
    commit(j, 1.0, 0, 1)
    j.emit(
        "fault.inject",
        t=1.5,
        fault_id="f000",
        kind="slow_rank",
        target={"replica": 0, "rank": 0, "host": "h"},
        seed=0,
    )
    commit(j, 2.0, 0, 2)
    j.close()
    kinds = summarize(read_journal(tmp_path / "j.jsonl"))["policies"]["in_place"]["faults"]
    assert kinds["slow_rank"]["count"] == 1
    assert kinds["slow_rank"]["recovered"] == 0
    assert kinds["slow_rank"]["participate_s"] == {"mean": None, "p50": None, "p95": None}


def test_percentiles():
    assert percentile([], 50) is None
    assert percentile([3.0], 95) == 3.0
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == pytest.approx(2.5)
    assert percentile(list(range(1, 21)), 95) == pytest.approx(19.05)  # numpy's linear rule
    assert stats([None, 1.0, 3.0]) == {"mean": 2.0, "p50": 2.0, "p95": pytest.approx(2.9)}


def _recoveries(records, policy):
    return summarize(records)["policies"][policy]


@pytest.mark.parametrize("policy", ["in_place", "full_restart"])
def test_a_host_eviction_that_fails_two_groups_gives_both_recoveries_its_figures(policy):
    """The case study's journal shape: evicting host1 takes down groups 1 and 3 at once (the
    phase records are the real RecoveryTracker's, see sim_journal)."""
    p = _recoveries(simulate(policy), policy)
    assert [r["kind"] for r in p["recoveries"]] == [
        "kill",
        "host_eviction",
        "host_eviction",
        "collective_abort",
        "lighthouse_crash",
        "unplanned",  # group 2 crashing on its own, 23 s after the kill of group 2
    ]
    evicted = [r for r in p["recoveries"] if r["kind"] == "host_eviction"]
    assert [(r["fault_id"], r["replica"]) for r in evicted] == [("f001", 1), ("f001", 3)]
    fault_t = T0 + 9.05
    for r in evicted:
        # both groups were detected when host1's agent went overdue, 0.3 s after the eviction
        assert r["detection_s"] == pytest.approx(0.3)
        assert r["participate_s"] == pytest.approx(r["phases"]["participating"] - fault_t)
        assert r["participate_s"] > r["detection_s"]
        # the survivors are groups 0 and 2 only: both evicted groups count as failed
        assert {g["replica"] for g in r["survivor_gaps"]} == {0, 2}
        assert r["stall_s"] is not None and r["stall_s"] > 0
    kind = p["faults"]["host_eviction"]
    assert kind["count"] == 1 and kind["recovered"] == 1
    # one value per recovery in the kind's figures, the fault's steps lost counted once
    assert kind["detection_s"]["mean"] == pytest.approx(0.3)
    assert kind["participate_s"]["mean"] == pytest.approx(
        (evicted[0]["participate_s"] + evicted[1]["participate_s"]) / 2
    )
    assert evicted[0]["steps_lost"] == evicted[1]["steps_lost"] == kind["steps_lost"]
    if policy == "in_place":
        # survivors commit until the eviction is detected (last at +0.25), then wait for the
        # quorum until 1.5 s after the detection: a 1.55 s gap against their usual 0.1 s
        assert evicted[0]["stall_s"] == pytest.approx(1.45, abs=1e-6)
        assert kind["steps_lost"] == 0
    else:
        # every group restarted from the step-50 checkpoint; step 56 had been committed
        assert kind["steps_lost"] == 7
        assert sum(k["steps_lost"] for k in p["faults"].values()) == 1 + 7
    unplanned = p["recoveries"][-1]
    assert unplanned["fault_id"] is None and unplanned["detection_s"] is None
    # no fault to start from: the time to participate counts from the detection
    assert unplanned["participate_s"] == pytest.approx(
        unplanned["phases"]["participating"] - unplanned["phases"]["detected"]
    )
    # the comparison is over the recoveries of injected faults only
    assert len([r for r in p["recoveries"] if r["fault_id"] is not None]) == 5
    assert p["all_faults"]["participate_s"]["mean"] == pytest.approx(
        sum(r["participate_s"] for r in p["recoveries"][:5]) / 5
    )


def test_derived_recoveries_of_a_host_fault_one_per_group(tmp_path):
    """A journal without recovery phases: the host fault still explains both groups' failures."""
    j = Journal(tmp_path / "j.jsonl", job="t")
    for step in range(1, 4):
        for r in range(3):
            commit(j, 10.0 + step, r, step, host=f"h{r % 2}")
    j.emit(
        "fault.inject",
        t=13.2,
        fault_id="f000",
        kind="host_eviction",
        target={"replica": None, "rank": None, "host": "h0"},
        seed=0,
    )
    for r in (0, 2):
        j.emit("failure", t=13.5, replica=r, rank=0, host="h0", cause="lost_host")
    for r in (0, 2):
        j.emit("proc.start", t=14.0, replica=r, rank=0, host="h1", pid=1, spare=False)
    commit(j, 14.0, 1, 4, host="h1")
    for r in range(3):
        commit(j, 15.0, r, 5, host="h1")
    j.close()
    p = summarize(read_journal(tmp_path / "j.jsonl"))["policies"]["in_place"]
    recs = p["recoveries"]
    assert [(r["fault_id"], r["kind"], r["replica"], r["derived"]) for r in recs] == [
        ("f000", "host_eviction", 0, True),
        ("f000", "host_eviction", 2, True),
    ]
    for r in recs:
        assert r["detection_s"] == pytest.approx(0.3)  # failure 13.5 - fault 13.2
        assert r["participate_s"] == pytest.approx(1.8)  # its commit at 15.0 - 13.2
        # the survivor is group 1 only: gap 13 -> 14 = its usual 1 s, no stall
        assert [g["replica"] for g in r["survivor_gaps"]] == [1]
        assert r["stall_s"] == pytest.approx(0.0)
    assert p["faults"]["host_eviction"]["recovered"] == 1


def test_a_host_fault_that_took_down_only_an_idle_spare_has_no_recovery(tmp_path):
    """Seen in a soak with warm spares: every group had moved off host1, whose eviction killed
    only its idle spare. That is no group's recovery (it was listed as one with no figures)."""
    j = Journal(tmp_path / "j.jsonl", job="t")
    for step in range(1, 4):
        for r in range(2):
            commit(j, 10.0 + step, r, step, host="h0")
    target = {"replica": None, "rank": None, "host": "h1"}
    j.emit("fault.inject", t=13.2, fault_id="f000", kind="host_eviction", target=target, seed=0)
    j.emit("failure", t=13.3, host="h1", cause="lost_host", coords={"idle": 0}, pid=9)
    for r in range(2):
        commit(j, 14.0, r, 4, host="h0")
    j.close()
    p = summarize(read_journal(tmp_path / "j.jsonl"))["policies"]["in_place"]
    assert p["recoveries"] == []
    kind = p["faults"]["host_eviction"]
    assert (kind["count"], kind["recovered"], kind["no_recovery"]) == (1, 0, 1)


# -- goodput against a fault-free control run ---------------------------------------------------


def _steady(j: Journal, t0: float, steps: int, gap: float, replicas: int = 2) -> None:
    """A fault-free run: every ``gap`` s each replica commits the next step (S samples)."""
    j.emit("job.start", t=t0, config={}, replicas=replicas, ranks=1)
    for step in range(1, steps + 1):
        for r in range(replicas):
            commit(j, t0 + step * gap, r, step)
    j.emit("job.end", t=t0 + steps * gap + 0.5, status="ok", reason="", steps=steps)


def _control_and_in_place(tmp_path, gaps: tuple[float, float], run_gap: float) -> dict:
    for i, gap in enumerate(gaps, 1):
        c = Journal(tmp_path / f"control-{i}" / "journal.jsonl", job="t", policy="control",
                    control_run=i)  # fmt: skip
        _steady(c, 1000.0 * i, 60, gap)
        c.close()
    a = Journal(tmp_path / "in_place" / "journal.jsonl", job="t", policy="in_place")
    _steady(a, 5000.0, 60, run_gap)
    a.close()
    return summarize(read_journal(tmp_path))


def test_goodput_is_measured_against_the_control_runs_with_their_spread(tmp_path):
    # control pieces commit 2 x S samples per 0.5 s and per 0.4 s: 4 S and 5 S samples/s;
    # in_place commits 2 x S per 0.5 s: 4 S samples/s, against the control's mean of 4.5 S.
    s = _control_and_in_place(tmp_path, (0.5, 0.4), 0.5)
    control, ip = s["policies"]["control"], s["policies"]["in_place"]
    assert control["control_runs"] == pytest.approx([4.0 * S, 5.0 * S])
    assert control["samples_per_s"] == pytest.approx(4.5 * S)
    assert control["goodput"] is None  # the yardstick has none of its own
    assert control["committed_steps"] == 60  # per piece, not the pieces added up
    assert ip["goodput_basis"] == "control"
    assert ip["control_samples_per_s"] == pytest.approx(4.5 * S)
    assert ip["goodput"] == pytest.approx(4.0 / 4.5)
    assert ip["goodput_spread"] == pytest.approx({"min": 0.8, "max": 1.0})
    assert ip["goodput_above_control"] is False


def test_goodput_above_the_whole_control_spread_is_flagged(tmp_path):
    s = _control_and_in_place(tmp_path, (0.5, 0.4), 0.25)  # 8 samples/s: faster than any piece
    ip = s["policies"]["in_place"]
    assert ip["goodput"] == pytest.approx(8.0 / 4.5)
    assert ip["goodput_above_control"] is True


def test_without_a_control_goodput_is_against_the_runs_own_fault_free_stretch(records):
    ip = summarize(records)["policies"]["in_place"]
    assert ip["goodput_basis"] == "in_run"
    assert ip["goodput_spread"] is None
    assert ip["goodput"] == pytest.approx(ip["samples_per_s"] / ip["baseline_samples_per_s"])


def test_the_steady_rate_leaves_out_the_warm_up(tmp_path):
    from dashboards.metrics import STEADY_WARMUP_S, steady_rate

    j = Journal(tmp_path / "j.jsonl", job="t", policy="control")
    t, step = 0.0, 0
    while t < 30.0:  # 1 step/s while warming up, then 4 steps/s
        t += 1.0 if t < STEADY_WARMUP_S else 0.25
        step += 1
        commit(j, t, 0, step)
    j.close()
    records = read_journal(tmp_path)
    assert steady_rate(records) == pytest.approx(4 * S)
    assert steady_rate(records, warmup_s=0.0) < 4 * S  # the warm-up pulls the plain rate down
