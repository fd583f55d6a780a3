"""experiments.report: hypotheses judged from a hand-written journal, the written report, and
``ftharness report`` run as a user runs it (exit status 1 when a hypothesis fails)."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from test_metrics import write_full_restart, write_in_place  # the hand-written journal

from dashboards.metrics import summarize
from experiments.report import evaluate_hypotheses, render_markdown, write_report
from experiments.spec import Hypotheses
from runtime.journal import Journal, read_journal

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def run_dir(tmp_path):
    a = Journal(tmp_path / "in_place.jsonl", job="t", policy="in_place")
    write_in_place(a)
    a.close()
    b = Journal(tmp_path / "full_restart.jsonl", job="t", policy="full_restart")
    write_full_restart(b)
    b.close()
    return tmp_path


def by_name(results):
    return {r["name"]: r for r in results}


def test_hypotheses_pass_and_fail_on_the_numbers(run_dir):
    records = read_journal(run_dir)
    hyp = Hypotheses(
        loss_finite=True,
        committed_steps_rise=True,
        replicas_equal_after_heal=True,
        thresholds={
            "goodput_min": {"in_place": 0.75, "full_restart": 0.6},  # 0.784 and 0.583
            "recovery_p95_max_s": {"*": 3.0},  # 2.7 and 3.5
            "steps_lost_max": {"full_restart": 2},  # 2
        },
    )
    res = by_name(evaluate_hypotheses(hyp, summarize(records), records))
    for policy in ("in_place", "full_restart"):
        assert res[f"loss_finite[{policy}]"]["passed"]
        assert res[f"committed_steps_rise[{policy}]"]["passed"]
        assert res[f"replicas_equal_after_heal[{policy}]"]["passed"]
    assert res["goodput_min[in_place]"]["passed"]
    assert not res["goodput_min[full_restart]"]["passed"]
    assert "0.583" in res["goodput_min[full_restart]"]["detail"]
    assert res["recovery_p95_max_s[in_place]"]["passed"]
    assert not res["recovery_p95_max_s[full_restart]"]["passed"]
    assert "3.5" in res["recovery_p95_max_s[full_restart]"]["detail"]
    assert res["steps_lost_max[full_restart]"]["passed"]


def test_a_nan_loss_a_checksum_mismatch_and_no_progress_fail(tmp_path):
    j = Journal(tmp_path / "j.jsonl", job="t")
    for step, loss in [(1, 2.0), (2, math.nan)]:
        j.emit("step.commit", t=float(step), replica=0, rank=0, step=step, loss=loss, checksum="a")
        j.emit(
            "step.commit",
            t=float(step),
            replica=1,
            rank=0,
            step=step,
            loss=loss,
            checksum="a" if step == 1 else "b",
        )
    j.emit(
        "fault.inject",
        t=2.5,
        fault_id="f000",
        kind="kill",
        target={"replica": 1, "rank": 0, "host": "h"},
        seed=0,
    )
    j.close()
    records = read_journal(tmp_path / "j.jsonl")
    hyp = Hypotheses(loss_finite=True, committed_steps_rise=True, replicas_equal_after_heal=True)
    res = by_name(evaluate_hypotheses(hyp, summarize(records), records))
    assert not res["loss_finite[in_place]"]["passed"]
    assert "step 2 loss nan" in res["loss_finite[in_place]"]["detail"]
    assert not res["replicas_equal_after_heal[in_place]"]["passed"]
    assert "step 2" in res["replicas_equal_after_heal[in_place]"]["detail"]
    assert not res["committed_steps_rise[in_place]"]["passed"]
    assert "f000 (kill)" in res["committed_steps_rise[in_place]"]["detail"]


def _sharded_commits(j: Journal, rank1_steps: list[int]) -> None:
    """Group 0's two ranks (processes p1, p2, then p3, p4 after a restart) and group 1's; the
    checksums agree, so only the steps can tell."""
    for i, step in enumerate([5, 6, 7, 8]):
        restart = i >= 2
        for replica in (0, 1):
            for rank in (0, 1):
                own = rank1_steps[i] if (replica, rank) == (0, 1) else step
                proc = f"h/p{2 * replica + rank + (4 if restart else 0)}"
                j.emit("step.commit", t=float(i), replica=replica, rank=rank, step=own,
                       loss=1.0, checksum=f"c{step}{rank}", proc=proc)  # fmt: skip
    j.emit("step.commit", t=9.0, replica=0, rank=0, step=9, loss=1.0, checksum=None, proc="h/p4")


def test_ranks_of_a_group_committing_different_steps_together_fail_replicas_equal(tmp_path):
    """A heal that landed on one rank of a sharded group and failed on the other left them
    at different steps, committing together (seen before the group asked with its lowest
    step: harness.rank.healing.OneHealSource): replicas_equal_after_heal says so. A rank
    whose process died before journaling its last commit is no such case."""
    hyp = Hypotheses(replicas_equal_after_heal=True)
    results = {}
    for name, rank1 in [("apart", [5, 6, 17, 18]), ("together", [5, 6, 7, 8])]:
        j = Journal(tmp_path / f"{name}.jsonl", job="t")
        _sharded_commits(j, rank1)
        j.close()
        records = read_journal(tmp_path / f"{name}.jsonl")
        results[name] = by_name(evaluate_hypotheses(hyp, summarize(records), records))
    apart = results["apart"]["replicas_equal_after_heal[in_place]"]
    assert not apart["passed"]
    assert "replica 0 committed different steps together (process 2, commit 1)" in apart["detail"]
    assert "{0: 7, 1: 17}" in apart["detail"]
    assert results["together"]["replicas_equal_after_heal[in_place]"]["passed"]


def test_write_report_files(run_dir):
    report = write_report(run_dir, read_journal(run_dir), Hypotheses(loss_finite=True))
    assert report["passed"]
    on_disk = json.loads((run_dir / "report.json").read_text())
    assert on_disk["summary"]["policies"]["in_place"]["faults"]["kill"]["count"] == 1
    assert on_disk["summary"]["comparison"]["stall_s_ratio"] == pytest.approx(2.0)
    md = (run_dir / "report.md").read_text()
    assert (
        "| kill | 1 | 1 | 0.20 / 0.20 / 0.20 | 1.50 / 1.50 / 1.50 | 2.70 / 2.70 / 2.70 | 0 |" in md
    )
    assert "survivor stall: x2" in md
    assert render_markdown(report["summary"], []) in md or "Hypotheses" in md


def ftharness_report(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "harness", "report", *args],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
    )  # fmt: skip


@pytest.mark.timeout(120)
def test_cli_exit_status_follows_the_hypotheses(run_dir, tmp_path):
    (run_dir / "experiment.toml").write_text(
        "[hypotheses]\nloss_finite = true\ngoodput_min = { in_place = 0.5 }\n"
    )
    ok = ftharness_report(str(run_dir), "--json")
    assert ok.returncode == 0, ok.stderr
    out = json.loads(ok.stdout)
    assert out["passed"] and out["summary"]["policies"]["in_place"]["committed_steps"] == 8

    (run_dir / "experiment.toml").write_text("[hypotheses]\ngoodput_min = 0.9\n")
    failed = ftharness_report(str(run_dir))
    assert failed.returncode == 1, failed.stderr
    assert "goodput_min[full_restart]" in failed.stdout and "FAILED" in failed.stdout
    assert (run_dir / "report.md").is_file()

    empty = tmp_path / "empty"
    empty.mkdir()
    nothing = ftharness_report(str(empty))
    assert nothing.returncode == 2 and "no journal records" in nothing.stderr


@pytest.mark.timeout(120)
def test_cli_html_writes_the_dashboard(run_dir):
    done = ftharness_report(str(run_dir), "--html")
    assert done.returncode == 0, done.stderr
    if importlib.util.find_spec("dashboards.html") is None:
        assert "HTML dashboard unavailable" in done.stderr
    else:
        assert (run_dir / "dashboard.html").stat().st_size > 0
        assert "dashboard.html" in done.stdout


# -- the soak hypotheses: every fault recovered, journal complete, nothing left behind ----------

SOAK = Hypotheses(
    every_fault_recovered=True, journal_complete=True, no_orphans=True, no_shm_left=True
)


def soak_journal(path: Path, *, drop: tuple[str, ...] = ()) -> Path:
    """A small in-place run as the chaos runner journals it: three groups, a kill of group 1
    (recovered through rec-1) and a slow rank on group 2 (no failure: its group keeps
    committing). ``drop`` leaves out records by a name below, to make a journal show a problem."""
    j = Journal(path, job="soak", policy="in_place")
    j.emit("job.start", t=100.0, config={}, replicas=3, ranks=1)
    for g in range(3):
        j.emit("proc.start", t=100.1, replica=g, rank=0, host="host0", pid=4000 + g)

    def commit(t: float, step: int, groups: tuple[int, ...] = (0, 1, 2)) -> None:
        for g in groups:
            j.emit("step.commit", t=t, replica=g, rank=0, step=step, loss=2.0, checksum=f"{step}")

    for step in range(1, 4):
        commit(100.0 + step, step)
    j.emit("fault.inject", t=103.5, fault_id="f000", kind="kill", target={"replica": 1}, seed=0)
    j.emit("fault.heal", t=103.5, fault_id="f000", kind="kill")
    j.emit("recovery.phase", t=103.6, recovery_id="rec-1", fault_id="f000", replica=1,
           phase="detected", cause="signal")  # fmt: skip
    commit(104.0, 4, (0, 2))
    j.emit("proc.start", t=104.5, replica=1, rank=0, host="host0", pid=4003)
    j.emit("recovery.phase", t=104.5, recovery_id="rec-1", fault_id="f000", replica=1,
           phase="replacement_started", cause="signal")  # fmt: skip
    if "participating" not in drop:
        j.emit("recovery.phase", t=105.0, recovery_id="rec-1", fault_id="f000", replica=1,
               phase="participating", cause="signal")  # fmt: skip
        commit(105.0, 5)
    else:
        commit(105.0, 5, (0, 2))
        if "overtaken" in drop:  # the others finished while group 1 rejoined
            j.emit("recovery.phase", t=107.5, recovery_id="rec-1", fault_id="f000", replica=1,
                   phase="overtaken", cause="signal")  # fmt: skip
        if "dropped" in drop:  # group 1 dropped for a crash loop of its own
            j.emit("recovery.phase", t=105.5, recovery_id="rec-1", fault_id="f000", replica=1,
                   phase="dropped", cause="signal")  # fmt: skip
    j.emit("fault.inject", t=105.5, fault_id="f001", kind="slow_rank", target={"replica": 2},
           seed=0)  # fmt: skip
    if "heal" not in drop:
        j.emit("fault.heal", t=106.5, fault_id="f001", kind="slow_rank")
    commit(107.0, 6, (0, 2) if "participating" in drop else (0, 1, 2))
    if "job.end" not in drop:
        j.emit("job.end", t=108.0, status="ok", reason="duration reached", steps=6)
    j.close()
    return path


def soak_results(run_dir: Path, postrun: dict | None = None) -> dict:
    """The soak hypotheses judged as ``ftharness report`` judges them (journal + postrun)."""
    problems: list[str] = []
    records = read_journal(run_dir, problems=problems)
    post = {"in_place": postrun} if postrun is not None else {}
    summary = summarize(records)
    return by_name(
        evaluate_hypotheses(SOAK, summary, records, journal_problems=problems, postrun=post)
    )


CLEAN = {"policy": "in_place", "waited_s": 0.1, "journal_pids": 4, "new_descendants_seen": 2,
         "orphans": [], "shm_dir": "/dev/shm", "shm_left": []}  # fmt: skip


def test_a_clean_soak_passes_every_soak_hypothesis(tmp_path):
    soak_journal(tmp_path / "in_place" / "journal.jsonl")
    res = soak_results(tmp_path, CLEAN)
    assert all(r["passed"] for r in res.values()), res
    detail = res["every_fault_recovered[in_place]"]["detail"]
    assert "all 2 faults recovered: 1 through recoveries" in detail
    assert "1 caused no recovery and the group(s) they hit committed after the heal: f001" in (
        detail
    )


def test_a_fault_without_recovery_fails_every_fault_recovered(tmp_path):
    soak_journal(tmp_path / "j.jsonl", drop=("participating",))
    res = soak_results(tmp_path, CLEAN)
    r = res["every_fault_recovered[in_place]"]
    assert not r["passed"]
    assert "f000 (kill)" in r["detail"]
    assert "rec-1 of replica 1 never reached participating" in r["detail"]
    assert "(last phase: replacement_started)" in r["detail"]
    assert "replica 1 committed no step after the heal" in r["detail"]
    assert len(r["problems"]) == 2  # every problem, in report.json
    # the journal itself is complete: the job ended while rec-1 was open, and it says so
    j = res["journal_complete[in_place]"]
    assert j["passed"] and "open when the job ended: rec-1 (replica 1" in j["detail"]


def test_a_quorum_service_crash_without_tracked_phases_is_judged_by_the_commits(tmp_path):
    # The tracker wrote no phases for this crash (one service recovery was still open), so the
    # summary derives one from the failure record; the service has no group of its own to be
    # seen participating, so the groups committing after the heal are what counts.
    path = soak_journal(tmp_path / "j.jsonl")
    j = Journal(path, job="soak", policy="in_place")  # appends
    service = {"replica": None, "rank": None, "host": None}
    j.emit("fault.inject", t=107.2, fault_id="f002", kind="lighthouse_crash", target=service)
    j.emit("fault.heal", t=107.2, fault_id="f002", kind="lighthouse_crash")
    j.emit("failure", t=107.3, cause="signal", detail="killed by SIGKILL", pid=4100)
    j.emit("proc.start", t=107.4, host="host0", pid=4101, spare=False)
    j.emit("step.commit", t=107.9, replica=0, rank=0, step=7, loss=2.0, checksum="7")
    j.close()
    records = read_journal(path)
    derived = [r for r in summarize(records)["policies"]["in_place"]["recoveries"]
               if r["fault_id"] == "f002"]  # fmt: skip
    assert [r["derived"] for r in derived] == [True] and derived[0]["participate_s"] is None
    r = soak_results(tmp_path, CLEAN)["every_fault_recovered[in_place]"]
    assert r["passed"], r
    assert "all 3 faults recovered: 2 through recoveries" in r["detail"]  # f002: derived


def test_a_fault_that_did_not_fire_is_not_recovered(tmp_path):
    path = soak_journal(tmp_path / "j.jsonl")
    j = Journal(path, job="soak", policy="in_place")  # appends
    j.emit("fault.inject", t=107.5, fault_id="f002", kind="kill", target={"replica": 2})
    error = "fire failed: RuntimeError('kill: no worker process')"
    j.emit("fault.heal", t=107.5, fault_id="f002", kind="kill", error=error)
    j.close()
    r = soak_results(tmp_path, CLEAN)["every_fault_recovered[in_place]"]
    assert not r["passed"] and "f002 (kill) at t+7.5 s did not fire: fire failed" in r["detail"]


def test_a_torn_journal_an_unhealed_fault_and_no_job_end_fail_journal_complete(tmp_path):
    path = soak_journal(tmp_path / "in_place" / "journal.jsonl", drop=("heal", "job.end"))
    with open(path, "a") as fh:
        fh.write('{"t": 109.0, "event": "step.com')  # a crash mid-write
    j = soak_results(tmp_path, CLEAN)["journal_complete[in_place]"]
    assert not j["passed"]
    assert "1 line(s) skipped" in j["detail"] and "journal.jsonl:" in j["detail"]
    assert "no job.end record" in j["detail"]
    assert "fault.inject without fault.heal: f001 (slow_rank)" in j["detail"]


def test_no_post_run_check_recorded_fails_rather_than_passes(tmp_path):
    soak_journal(tmp_path / "j.jsonl")
    res = soak_results(tmp_path, None)
    for name in ("no_orphans[in_place]", "no_shm_left[in_place]"):
        assert not res[name]["passed"] and "no post-run check recorded" in res[name]["detail"]


@pytest.fixture
def sleeper():
    """A real process, killed at the end of the test."""
    p = subprocess.Popen(["sleep", "60"])
    yield p
    p.kill()
    p.wait()


def test_a_live_journalled_worker_is_an_orphan(tmp_path, sleeper):
    from experiments import postrun

    before = postrun.snapshot(str(tmp_path))
    # the sleeper stands for a worker the journal says the job started (after the sleeper
    # itself was created: a worker is forked before its proc.start record is written)
    records = [{"t": time.time(), "event": "proc.start", "replica": 1, "pid": sleeper.pid}]
    check = postrun.check(
        before, records, policy="in_place", run_end=time.time(), shm_dir=str(tmp_path),
        grace_s=0.3,
    )  # fmt: skip
    assert [o["pid"] for o in check["orphans"]] == [sleeper.pid]
    postrun.write(tmp_path, check)
    soak_journal(tmp_path / "j.jsonl")
    r = soak_results(tmp_path, postrun.load(tmp_path)["in_place"])["no_orphans[in_place]"]
    assert not r["passed"]
    assert f"pid {sleeper.pid} (sleep: sleep 60; proc.start)" in r["detail"]


def test_a_reused_pid_is_not_an_orphan_but_a_new_descendant_is(tmp_path, sleeper):
    from experiments import postrun

    created = psutil.Process(sleeper.pid).create_time()
    # a proc.start record from well before the process with that pid was created: another
    # process that had the pid then, not this one
    records = [{"t": created - 60, "event": "proc.start", "replica": 1, "pid": sleeper.pid}]
    before = postrun.snapshot(str(tmp_path))  # the sleeper existed before this "run"
    check = postrun.check(before, records, policy="in_place", run_end=time.time(),
                          shm_dir=str(tmp_path), grace_s=0.3)  # fmt: skip
    assert check["orphans"] == []
    late = subprocess.Popen(["sleep", "61"])  # started during the "run", not journalled
    try:
        check = postrun.check(before, records, policy="in_place", run_end=time.time(),
                              shm_dir=str(tmp_path), grace_s=0.3)  # fmt: skip
        assert [(o["pid"], o["source"]) for o in check["orphans"]] == [
            (late.pid, "descendant of the runner")
        ]
    finally:
        late.kill()
        late.wait()
    # once it is gone (and reaped) the same check finds nothing
    check = postrun.check(before, records, policy="in_place", run_end=time.time(),
                          shm_dir=str(tmp_path), grace_s=0.3)  # fmt: skip
    assert check["orphans"] == []


def test_an_unreaped_child_is_a_zombie_not_an_orphan(tmp_path):
    from experiments import postrun

    before = postrun.snapshot(str(tmp_path))
    child = subprocess.Popen(["sleep", "62"])
    try:
        os.kill(child.pid, 9)
        while psutil.Process(child.pid).status() != psutil.STATUS_ZOMBIE:
            time.sleep(0.01)
        check = postrun.check(before, [], policy="in_place", run_end=time.time(),
                              shm_dir=str(tmp_path), grace_s=0.3)  # fmt: skip
    finally:
        child.wait()
    assert check["orphans"] == [] and [z["pid"] for z in check["zombies"]] == [child.pid]
    soak_journal(tmp_path / "j.jsonl")
    r = soak_results(tmp_path, check)["no_orphans[in_place]"]
    assert r["passed"] and f"not reaped: 1 zombie(s): pid {child.pid} (sleep" in r["detail"]


def _ticks(pid: int) -> int:
    stat = Path(f"/proc/{pid}/stat").read_bytes()
    return int(stat[stat.rfind(b")") + 2 :].split()[19])


def test_a_segment_of_a_job_process_left_in_shm_fails_no_shm_left(tmp_path, sleeper):
    from experiments import postrun

    shm = tmp_path / "shm"
    shm.mkdir()
    (shm / "ftdp-1-t1-aaaa").write_bytes(b"x")  # there before the run: not ours
    before = postrun.snapshot(str(shm))
    ours = f"ftdp-{sleeper.pid}-t{_ticks(sleeper.pid)}-0123abcd"
    (shm / ours).write_bytes(b"x")
    (shm / f"ftdp-{os.getpid()}-t{_ticks(os.getpid())}-beef").write_bytes(b"x")  # not the job's
    (shm / "unrelated").write_bytes(b"x")
    records = [{"t": time.time(), "event": "proc.start", "replica": 1, "pid": sleeper.pid}]
    sleeper.kill()
    sleeper.wait()  # the worker is gone; its segment is not
    check = postrun.check(before, records, policy="in_place", run_end=time.time(),
                          shm_dir=str(shm), grace_s=0.3)  # fmt: skip
    assert check["orphans"] == [] and check["shm_left"] == [ours]
    soak_journal(tmp_path / "j.jsonl")
    res = soak_results(tmp_path, check)
    assert res["no_orphans[in_place]"]["passed"]
    r = res["no_shm_left[in_place]"]
    assert not r["passed"] and f"left in {shm}: {ours}" in r["detail"]
    (shm / ours).unlink()
    check = postrun.check(before, records, policy="in_place", run_end=time.time(),
                          shm_dir=str(shm), grace_s=0.3)  # fmt: skip
    assert soak_results(tmp_path, check)["no_shm_left[in_place]"]["passed"]


@pytest.mark.timeout(120)
def test_cli_report_recomputes_the_post_run_hypotheses(tmp_path):
    run = tmp_path / "run"
    soak_journal(run / "in_place" / "journal.jsonl")
    (run / "experiment.toml").write_text("[hypotheses]\nno_orphans = true\nno_shm_left = true\n")
    orphan = {"pid": 4242, "name": "python", "cmdline": "python -m runtime.agent",
              "create_time": 100.0, "source": "descendant of the runner"}  # fmt: skip
    (run / "in_place" / "postrun.json").write_text(json.dumps({**CLEAN, "orphans": [orphan]}))
    done = ftharness_report(str(run))
    assert done.returncode == 1, done.stderr
    md = (run / "report.md").read_text()
    assert "❌ | no_orphans[in_place] | 1 process(es) still alive" in md
    assert "pid 4242 (python: python -m runtime.agent" in md
    assert "✅ | no_shm_left[in_place]" in md


def test_the_control_run_is_the_goodput_yardstick_and_is_not_judged(run_dir):
    # A fault-free control piece, committing faster than in_place's fault-free stretch.
    from test_metrics import commit

    c = Journal(run_dir / "control-1.jsonl", job="t", policy="control", control_run=1)
    c.emit("job.start", t=300.0, config={}, replicas=3, ranks=1)
    for step in range(1, 31):
        for r in range(3):
            commit(c, 300.0 + step * 0.5, r, step)
    c.emit("job.end", t=316.0, status="ok", reason="", steps=30)
    c.close()
    records = read_journal(run_dir)
    summary = summarize(records)
    hyp = Hypotheses(loss_finite=True, thresholds={"goodput_min": {"*": 0.1}})
    res = by_name(evaluate_hypotheses(hyp, summary, records))
    assert not [name for name in res if "[control]" in name]
    assert set(res) == {
        "loss_finite[in_place]", "loss_finite[full_restart]",
        "goodput_min[in_place]", "goodput_min[full_restart]",
    }  # fmt: skip
    ip = summary["policies"]["in_place"]
    assert ip["goodput_basis"] == "control"
    text = render_markdown(summary, list(res.values()))
    assert "fault-free control: committed samples/s" in text
    assert "control's spread" in text


def test_skipped_sequences_are_reported_and_bounded(tmp_path):
    from test_metrics import commit

    j = Journal(tmp_path / "j.jsonl", job="t", policy="in_place")
    j.emit("job.start", t=0.0, config={}, replicas=1, ranks=1)
    # steps 1..4 train 8 sequences each, but step 3's range was skipped by a heal jump
    for step in range(1, 5):
        first = (step - 1) * 8 if step != 3 else 24
        seqs = [[first, first + 8]] if step != 3 else []
        commit(j, float(step), 0, step, seqs=seqs, seq_due=step * 8, data_policy="skip")
    j.emit("job.end", t=5.0, status="ok", reason="", steps=4)
    j.close()
    records = read_journal(tmp_path)
    summary = summarize(records)
    assert summary["policies"]["in_place"]["data"]["skipped"] == 8
    hyp = Hypotheses(thresholds={"skipped_max": {"in_place": 0}})
    (res,) = evaluate_hypotheses(hyp, summary, records)
    assert not res["passed"] and "skipped = 8" in res["detail"]
    assert "8 of 24 sequences due were never trained" in render_markdown(summary, [res])


@pytest.mark.parametrize(
    "ending, said",
    [
        # the other groups finished the job's last step while group 1 rejoined: nothing was
        # left to rejoin (the job layer journals ``overtaken``)
        ("overtaken", "overtaken by the job's end"),
        # group 1 was dropped for a crash loop of its own (``group.dropped``): it never rejoins
        ("dropped", "ended in the group's drop"),
    ],
)
def test_a_recovery_that_ends_without_rejoining_is_not_a_failure_to_recover(
    tmp_path, ending: str, said: str
):
    """A recovery that ends with one of ``runtime.journal.ENDINGS`` instead of
    ``participating``: the report says how it ended, and nothing is left open."""
    soak_journal(tmp_path / "j.jsonl", drop=("participating", ending))
    res = soak_results(tmp_path, CLEAN)
    r = res["every_fault_recovered[in_place]"]
    assert r["passed"], r
    assert f"1 {said}" in r["detail"] and "f000 (kill) of replica 1" in r["detail"]
    j = res["journal_complete[in_place]"]
    assert j["passed"] and "open when the job ended" not in j["detail"], j
    summary = summarize(read_journal(tmp_path))
    kill = summary["policies"]["in_place"]["faults"]["kill"]
    assert (kill["recovered"], kill[ending]) == (0, 1)
    assert f"(1 {said})" in render_markdown(summary, list(res.values()))
