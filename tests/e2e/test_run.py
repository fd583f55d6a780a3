"""End-to-end runs of resilient training on CPU: real processes, real faults, gloo."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pytest
from e2e_helpers import (
    after_step,
    events,
    kill_group,
    run_ok,
    tiny_cfg,
    train_on_then_stop,
    wait_until,
)

from faults import inworker
from faults.fault import Target
from harness.job.launch import run_job
from harness.rank.actors import stop_training

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]


@pytest.mark.parametrize(
    ("quorum", "spares", "every"),
    [("torchft", 0, 1), ("tree", 1, 1), ("tree", 1, 1000)],
    # the last: a sparse quorum that never comes due by itself (N > steps), so the replacement
    # can only be let in by the survivors' quorum flag (harness.rank.trainer, "Sparse quorum")
    ids=["torchft-lighthouse", "tree-quorum-with-a-spare", "sparse-quorum-asked-for"],
)
def test_killed_group_restarts_in_place_and_heals(tmp_path, quorum, spares, every):
    cfg = tiny_cfg(
        "steps=45",
        "checkpoint.every_steps=10",
        f"recovery.quorum={quorum}",
        f"recovery.spares_per_host={spares}",
        f"recovery.quorum_every_steps={every}",
    )
    killed = {}

    def started(job):
        def kill():
            killed["pid"] = job.faults.pids(Target(replica=1, rank=0))[0]
            killed["others"] = job.faults.pids(Target(replica=0)) + job.faults.pids(
                Target(replica=2)
            )
            os.kill(killed["pid"], signal.SIGKILL)

        after_step(job, 12, kill)

    records = run_ok(cfg, tmp_path, on_started=started)

    (failure,) = [r for r in records if r["event"] == "failure"]
    assert failure["signal"] == "SIGKILL" and failure["replica"] == 1
    # only group 1 was restarted: one new process, for replica 1
    started = [r for r in records if r["event"] == "proc.start" and r["t"] > failure["t"]]
    restarted = [r for r in started if "replica" in r]
    assert [r["replica"] for r in restarted] == [1]
    if spares:  # the replacement was the warm spare, and the pool was refilled
        assert restarted[0]["spare"] is True
        assert [r["spare"] for r in started if "idle" in r] == [True]
    # the replacement healed from a peer, then committed steps with the peers' checksums
    healed = [r for r in records if r["event"] == "trainer.healed" and r["t"] > failure["t"]]
    # A survivor may heal too, from the other survivor, without being restarted: one that left
    # the interrupted allreduce after the other had committed it, or (torchft's Lighthouse, on a
    # loaded machine) one dropped from a round for a late heartbeat. Seen in CI under load; the
    # restarts are checked below (only group 1's process is new).
    assert any(r["replica"] == 1 for r in healed), healed
    phases = [r["phase"] for r in records if r["event"] == "recovery.phase"]
    # It ends when the replacement takes part. The survivors may resume at that very quorum
    # (torchft's Lighthouse may hold their quorum until the replacement joins): then their phase
    # can be journaled just after it (seen in CI, 2 ms apart).
    assert phases[0] == "detected"
    assert set(phases[phases.index("participating") + 1 :]) <= {"survivors_resumed"}, phases
    assert set(phases) == {
        "detected",
        "survivors_resumed",
        "replacement_started",
        "healed",
        "participating",
    }
    commits = [r for r in records if r["event"] == "step.commit"]
    back = [r for r in commits if r["replica"] == 1 and r["t"] > failure["t"]]
    assert back, "the replacement never committed"
    peer = {r["step"]: r["checksum"] for r in commits if r["replica"] == 0}
    assert all(peer[r["step"]] == r["checksum"] for r in back if r["step"] in peer)
    # the survivors kept training in their original processes
    survivors_after = [r for r in commits if r["replica"] != 1 and r["t"] > failure["t"]]
    assert max(r["step"] for r in survivors_after) == 45
    assert not any(r["replica"] != 1 for r in restarted)
    asked = [r for r in commits if r["quorum"]]
    if every == 1:
        assert len(asked) == len(commits)
    else:  # a few per group: its first step and the groups starting after it, the failure's
        # aborted step, the replacement's (of 45 steps: every one under a per-step quorum)
        assert len(asked) <= 8 * 3, sorted((r["replica"], r["step"]) for r in asked)


def test_segfault_in_one_rank_restarts_only_its_group(tmp_path):
    cfg = tiny_cfg("replicas=2", "ranks=2", "steps=30", "checkpoint.every_steps=0")

    def started(job):
        after_step(
            job,
            8,
            lambda: job.faults.run_in_worker(Target(replica=0, rank=1), inworker.segfault),
        )

    records = run_ok(cfg, tmp_path, on_started=started)
    failures = [r for r in records if r["event"] == "failure"]
    # the segfault, and maybe its group's rank 0 first (its collective with rank 1 broke, and
    # under load its exception can reach the controller before the agent's exit notice)
    segv = [r for r in failures if r["signal"] == "SIGSEGV"]
    assert [(r["replica"], r["rank"]) for r in segv] == [(0, 1)], failures
    assert {r["replica"] for r in failures} == {0}
    decisions = [r for r in records if r["event"] == "supervisor"]
    assert [(d["supervisor"], d["decision"]) for d in decisions] == [
        ("job/replica0", "restart_all")
    ]
    restarted = [r for r in records if r["event"] == "proc.start" and r["t"] > failures[0]["t"]]
    # (a warm spare started to replace the one adopted has no replica)
    group = [r for r in restarted if r.get("replica") is not None]
    assert sorted((r["replica"], r["rank"]) for r in group) == [(0, 0), (0, 1)]


def test_restart_intensity_exhausted_stops_the_job_with_a_report(tmp_path):
    cfg = tiny_cfg("steps=4000", "recovery.max_restarts=1", "checkpoint.every_steps=0")

    def started(job):
        def kill_twice():
            import time

            for _ in range(2):
                pids = job.faults.pids(Target(replica=2, rank=0))
                os.kill(pids[0], signal.SIGKILL)
                deadline = time.monotonic() + 60
                while (
                    job.faults.pids(Target(replica=2, rank=0)) == pids
                    and time.monotonic() < deadline
                ):
                    time.sleep(0.05)
                time.sleep(0.5)

        after_step(job, 5, kill_twice)

    out = run_job(cfg, tmp_path, quiet=True, on_started=started, timeout=200)
    assert out["status"] == "failed"
    assert (
        "supervisor job/replica2 gave up: restart intensity exceeded: 1 restarts" in out["reason"]
    )
    assert "killed by SIGKILL" in out["reason"]
    end = events(tmp_path, "job.end")[-1]
    assert end["status"] == "failed"


def test_full_restart_resumes_from_checkpoint_losing_at_most_k_steps(tmp_path):
    k = 5
    cfg = tiny_cfg("steps=30", f"checkpoint.every_steps={k}", "recovery.policy=full_restart")

    def started(job):
        after_step(job, 13, lambda: kill_group(job, 1))

    records = run_ok(cfg, tmp_path, on_started=started)
    (restart,) = [r for r in records if r["event"] == "job.restart"]
    before = [r["step"] for r in records if r["event"] == "step.commit" and r["t"] < restart["t"]]
    loads = [r for r in records if r["event"] == "checkpoint.load" and r["t"] > restart["t"]]
    assert loads and {r["step"] for r in loads} == {loads[0]["step"]}
    resumed = loads[0]["step"]
    assert resumed % k == 0 and resumed >= 10
    first_after = min(
        r["step"] for r in records if r["event"] == "step.commit" and r["t"] > restart["t"]
    )
    assert first_after == resumed + 1
    assert max(before) - resumed <= k  # steps lost
    # every process was restarted, not just the failed group's
    after = [r for r in records if r["event"] == "proc.start" and r["t"] > restart["t"] - 5]
    assert {r.get("replica") for r in after if "replica" in r} == {0, 1, 2}


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("replicass=3", "unknown key 'replicass'"),
        ("replicas=0", "replicas"),
        ("timeouts.heartbeat_timeout=30", "heartbeat_timeout"),
    ],
)
def test_bad_config_fails_before_launch(override, message, tmp_path):
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "harness",
            "run",
            "experiments/tiny.toml",
            "--set",
            override,
            "--out",
            str(tmp_path / "run"),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    assert message in done.stderr
    assert not (tmp_path / "run").exists()  # nothing launched, nothing written


def test_heal_through_the_dataplane_transport(tmp_path):
    """A replacement pulls a peer's state one-sidedly over the data plane (shm on one host),
    through torchft's CheckpointTransport seam, and ends bitwise equal to its peers."""
    cfg = tiny_cfg("steps=40", "checkpoint.every_steps=0", "transport=dataplane")

    def started(job):
        after_step(job, 10, lambda: kill_group(job, 2))

    records = run_ok(cfg, tmp_path, on_started=started)
    (failure,) = [r for r in records if r["event"] == "failure"]
    healed = [r for r in records if r["event"] == "trainer.healed" and r["t"] > failure["t"]]
    assert healed and healed[0]["replica"] == 2 and healed[0]["transport"] == "dataplane"
    back = [
        r
        for r in records
        if r["event"] == "step.commit" and r["replica"] == 2 and r["t"] > failure["t"]
    ]
    assert back


def test_an_evicted_host_comes_back_in_the_background_and_takes_its_groups_again(tmp_path):
    """After a host eviction, the lost host's agent is restarted when its cooldown ends, by
    the job and off any restart path: a later restart of a group homed there finds it ready
    (the 8.8 s held-GIL restart was a group waiting for that agent to import torch)."""
    # steps: more than it can train while the host comes back (the stop event ends the run)
    cfg = tiny_cfg("steps=20000", "replicas=2", "hosts=2", "recovery.quorum=tree")
    seen: dict[str, object] = {}
    stop = threading.Event()

    def started(job):
        def evict():
            job.faults.set_host_cooldown("host1", 2.0)
            seen["old_agent"] = job.controller.hosts["host1"].pid
            job.faults.kill_host("host1")
            # group 1 (home host1) is restarted on host0 at once, without waiting for host1
            deadline = time.monotonic() + 60
            wait_until(lambda: job.group_host(1) == "host0", deadline)
            seen["moved_to"] = job.group_host(1)
            # host1's agent comes back by itself, though no group asked for it
            hosts = job.controller.hosts
            seen["back"] = wait_until(
                lambda: not hosts["host1"].lost and hosts["host1"].pid != seen["old_agent"],
                deadline,
            )
            # the group's next restart goes home, to the ready host
            kill_group(job, 1)
            wait_until(lambda: job.group_host(1) == "host1", deadline)
            seen["home_again"] = job.group_host(1)
            train_on_then_stop(job, 10, stop, deadline)

        after_step(job, 8, evict)

    records = run_ok(cfg, tmp_path, on_started=started, stop_event=stop)
    assert seen == {
        "old_agent": seen["old_agent"],
        "moved_to": "host0",
        "back": True,
        "home_again": "host1",
    }
    starts = [r for r in records if r["event"] == "proc.start" and r.get("replica") == 1]
    assert [r["host"] for r in starts] == ["host1", "host0", "host1"]


def test_a_journal_that_cannot_be_written_ends_the_run_with_a_clear_reason(tmp_path):
    """A full disk under the journal (its descriptor pointed at /dev/full mid-run: a real
    ENOSPC on the real write path) stops the run with a reason, instead of hanging it or
    killing controller threads."""
    from runtime.journal import Journal

    cfg = tiny_cfg("steps=100000", "replicas=2")
    journal = Journal(tmp_path / "journal.jsonl", job=cfg.name, policy="in_place")

    def started(job):
        def fill_disk():
            full = os.open("/dev/full", os.O_WRONLY)
            os.dup2(full, journal._fd)
            os.close(full)

        after_step(job, 5, fill_disk)

    out = run_job(cfg, tmp_path, journal=journal, quiet=True, on_started=started, timeout=120)
    journal.close()
    assert out["status"] == "failed"
    assert "could not be written" in out["reason"] and "No space left" in out["reason"]


def test_every_group_lost_at_once_resumes_from_the_last_checkpoint(tmp_path):
    """In place with no group left holding state (all killed together, as a host eviction that
    took the last groups does): no peer to heal from, so the job resumes from its checkpoint;
    the tree quorum must let committed steps go back to it instead of waiting forever for a
    member at the old highest step."""
    cfg = tiny_cfg("steps=120", "replicas=2", "checkpoint.every_steps=20")

    def kill_all() -> None:
        pids = [p for r in range(2) for p in job_ref[0].faults.pids(Target(replica=r, rank=0))]
        for pid in pids:
            os.kill(pid, signal.SIGKILL)

    job_ref: list = []

    def started(job):
        job_ref.append(job)
        after_step(job, 50, kill_all)

    records = run_ok(cfg, tmp_path, on_started=started, timeout=150)
    restarts = [r for r in records if r["event"] == "job.restart"]
    assert len(restarts) == 1 and "every replica group lost its state" in restarts[0]["reason"]
    loads = [r for r in records if r["event"] == "checkpoint.load"]
    assert loads and min(r["step"] for r in loads) >= 40
    # A group restarted while the other's death was not yet known to the quorum service is
    # told a peer holds state: it loads nothing and heals from the group that loaded.
    healed = {r["replica"] for r in records if r["event"] == "trainer.healed"}
    assert {r["replica"] for r in loads} | healed == {0, 1}
    assert max(r["step"] for r in records if r["event"] == "step.commit") == 120


def test_a_stopped_job_stops_every_group_after_the_same_step(tmp_path):
    """A job stopped mid-run (a chaos run's duration, a caller's stop) stops every group after
    one step, even when the stops reach the groups at different times (here groups 1 and 2
    0.2 s after group 0: a loaded controller). A group stopped a step before the others would
    leave them waiting in the next quorum until the join timeout, then committing a step
    without it (seen at the end of a quickstart run: 5 s of nothing, against its goodput)."""
    cfg = tiny_cfg("steps=100000")
    stop = threading.Event()

    def started(job):
        run_in_worker = job.controller.run_in_worker
        group_of = {p: g.replica for g in job.groups.values() for p in g.mesh.proc_ids}

        def late_for_others(pid, func, *args):
            if func is stop_training and group_of.get(pid) != 0:
                time.sleep(0.1)
            return run_in_worker(pid, func, *args)

        job.controller.run_in_worker = late_for_others
        after_step(job, 20, stop.set)

    records = run_ok(cfg, tmp_path, on_started=started, stop_event=stop)
    commits = [r for r in records if r["event"] == "step.commit"]
    last = {}
    for r in commits:
        last[r["replica"]] = max(last.get(r["replica"], 0), r["step"])
    assert len(set(last.values())) == 1, f"groups stopped after different steps: {last}"
    final = [r for r in commits if r["step"] == max(last.values())]
    assert sorted(r["participants"] for r in final) == [3, 3, 3], final
