"""Sharded replica groups in the built-in trainer (``parallel.group = "fsdp"``), end to end: real
worker processes under host agents, FSDP2 over gloo within each group, torchft across them, a
real SIGKILL of one rank of a sharded group."""

from __future__ import annotations

import os
import re
import signal
import threading
import time
from pathlib import Path

import pytest
from e2e_helpers import after_step, events, kill_group, run_chaos, run_ok, tiny_cfg, wait_until

from faults import inworker
from faults.fault import Target
from runtime.journal import HEAL_START, HEALED, read_journal

REPO = Path(__file__).parents[2]

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]


@pytest.mark.parametrize("transport", ["torchft_http", "dataplane"])
def test_a_killed_rank_restarts_its_sharded_group_which_heals_shard_by_shard(tmp_path, transport):
    cfg = tiny_cfg(
        "replicas=2",
        "ranks=2",
        "steps=40",
        "parallel.group=fsdp",
        "checkpoint.every_steps=10",
        f"transport={transport}",
    )

    def started(job):
        def kill():
            # Once step 10's checkpoint is on disk, so the replacement has one to skip (a DCP
            # write can outlast two steps: seen in CI, saved 20 ms after a kill at step 12).
            wait_until(lambda: events(tmp_path, "checkpoint.save"), time.monotonic() + 60)
            os.kill(job.faults.pids(Target(replica=1, rank=1))[0], signal.SIGKILL)

        after_step(job, 12, kill)

    records = run_ok(cfg, tmp_path, on_started=started)  # checksums agree per (step, rank)

    killed = [r for r in records if r["event"] == "failure" and r.get("signal") == "SIGKILL"]
    assert [(r["replica"], r["rank"]) for r in killed] == [(1, 1)]
    t_fail = killed[0]["t"]
    decisions = [(r["supervisor"], r["decision"]) for r in records if r["event"] == "supervisor"]
    assert decisions == [("job/replica1", "restart_all")]  # the whole group: one_for_all
    started_after = [
        (r["replica"], r["rank"])
        for r in records
        if r["event"] == "proc.start" and r["t"] > t_fail and r.get("replica") is not None
    ]
    assert sorted(started_after) == [(1, 0), (1, 1)]
    # every rank of the replacement loaded its own shards from a healthy group, and no
    # checkpoint first (its peer held the state: Trainer's peers_hold_state)
    healed = {r["rank"] for r in records if r["event"] == "trainer.healed" and r["replica"] == 1}
    assert healed == {0, 1}
    saved = [r["step"] for r in records if r["event"] == "checkpoint.save" and r["t"] < t_fail]
    assert saved, "no checkpoint on disk when the rank was killed: nothing to skip"
    assert not [r for r in records if r["event"] == "checkpoint.load" and r["t"] > t_fail]
    # each replacement rank journaled its start, part by part, with no checkpoint load in it
    starts = [r for r in records if r["event"] == "trainer.start" and r["t"] > t_fail]
    assert sorted((r["replica"], r["rank"]) for r in starts) == [(1, 0), (1, 1)]
    for r in starts:
        assert list(r["parts"]) == ["model", "layout", "optimizer", "manager", "checkpoint"]
        assert r["seconds"] == pytest.approx(sum(r["parts"].values()), abs=1e-3)
    commits = [r for r in records if r["event"] == "step.commit" and r["checksum"]]
    by_step: dict[tuple[int, int], set[str]] = {}
    for r in commits:
        by_step.setdefault((r["step"], r["rank"]), set()).add(r["checksum"])
    after = [r for r in commits if r["replica"] == 1 and r["t"] > t_fail]
    assert after, "the replacement committed no checksummed step"
    for r in after:  # compared with group 0's same rank: equal (run_ok checked it), and present
        assert len(by_step[(r["step"], r["rank"])]) == 1
    # sharded for real: at a step, rank 0's shards are not rank 1's
    both = [s for (s, rank) in by_step if rank == 0 and (s, 1) in by_step]
    assert both and all(by_step[(s, 0)] != by_step[(s, 1)] for s in both)
    assert max(r["step"] for r in records if r["event"] == "step.commit") == 40


@pytest.mark.parametrize("transport", ["torchft_http", "torchft_pg"])
def test_every_rank_of_a_replacement_heals_from_one_source_group(tmp_path, transport):
    """With two up-to-date groups torchft would send the replacement's rank 0 to one and rank 1
    to the other (its source is picked per group rank); every rank takes rank 0's instead
    (harness.rank.healing.OneHealSource), and every shard then equals that group's. With
    torchft's process-group transport too: a source sends to the healers its own quorum result
    names, so sources and healers are rewritten alike."""
    cfg = tiny_cfg(
        "replicas=3", "ranks=2", "steps=30", "parallel.group=fsdp", f"transport={transport}"
    )

    def started(job):
        kill = lambda: os.kill(job.faults.pids(Target(replica=1, rank=0))[0], signal.SIGKILL)  # noqa: E731
        after_step(job, 10, kill)

    records = run_ok(cfg, tmp_path, on_started=started)  # checksums agree per (step, rank)

    (failure,) = [r for r in records if r["event"] == "failure" and r.get("signal") == "SIGKILL"]
    healed = [
        r
        for r in records
        if r["event"] == "trainer.healed" and r["replica"] == 1 and r["t"] > failure["t"]
    ]
    assert {r["rank"] for r in healed} == {0, 1}, healed
    sources = {r["source"] for r in healed}
    assert len(sources) == 1 and None not in sources, healed
    (source,) = sources
    assert re.match(r"replica_([02])\.", source), source  # a healthy group, not itself
    first = min(r["step"] for r in records if r["event"] == "step.commit" and r["replica"] == 1
                and r["t"] > failure["t"])  # fmt: skip
    by_rank = {
        (r["replica"], r["rank"]): r["checksum"]
        for r in records
        if r["event"] == "step.commit" and r["step"] == first and r["checksum"]
    }
    assert all(by_rank.get((1, k)) in (None, by_rank.get((0, k))) for k in (0, 1)), by_rank


def mid_heal_job():
    """3 sharded groups x 2 ranks over the data plane, for the kills during a heal."""
    return tiny_cfg(
        "replicas=3", "ranks=2", "steps=40", "parallel.group=fsdp", "transport=dataplane"
    )


def mid_heal(action):
    """An ``on_started`` that has groups 0 and 2 serve heals slowly (3 s:
    ``faults.inworker.set_serve_delay``) after step 10, SIGKILLs group 1, and calls
    ``action(job, record)`` on its own thread at the replacement's first ``trainer.heal_start``
    (rank 0's): while that heal is under way."""

    def started(job):
        armed: dict[str, bool] = {}

        def slow_sources_then_kill():
            for g in (0, 2):
                job.faults.run_in_worker(Target(replica=g), inworker.set_serve_delay, 3.0)
            armed["killed"] = True
            kill_group(job, 1)

        def on_record(r):
            ours = r["event"] == HEAL_START and (r["replica"], r["rank"]) == (1, 0)
            if ours and armed.pop("killed", False):
                threading.Thread(target=action, args=(job, r)).start()

        job.journal.add_sink(on_record)
        after_step(job, 10, slow_sources_then_kill)

    return started


def test_a_heal_source_killed_mid_heal_is_replaced_by_another_group(tmp_path):
    """The sources serve slowly (``faults.inworker.set_serve_delay``), so the replacement is still
    healing when its source group is SIGKILLed: that heal fails, the step is not committed, and the
    next quorum heals the replacement from the other healthy group; every shard ends equal."""
    seen: dict[str, object] = {}

    def kill_source(job, r):
        seen["source"] = source = r["source"]
        kill_group(job, int(re.match(r"replica_(\d+)\.", source).group(1)))

    records = run_ok(mid_heal_job(), tmp_path, on_started=mid_heal(kill_source))

    assert "source" in seen, "the replacement never began a heal"
    first = int(re.match(r"replica_(\d+)\.", seen["source"]).group(1))
    killed = [r for r in records if r["event"] == "failure" and r.get("signal") == "SIGKILL"]
    assert {r["replica"] for r in killed} == {1, first}
    t_source_killed = max(r["t"] for r in killed if r["replica"] == first)
    healed = [r for r in records if r["event"] == HEALED and r["replica"] == 1]
    # the heal that was under way did not land; a later one came from a live group: the other
    # healthy one, or the killed one's replacement once it had healed (a new member id)
    assert not [r for r in healed if r["source"] == seen["source"]], healed
    later = [r for r in healed if r["t"] > t_source_killed]
    assert {r["rank"] for r in later} == {0, 1}, healed
    assert len({r["source"] for r in later}) == 1, later
    # retried in place: the replacement was not restarted again
    again = [r for r in records if r["event"] == "proc.start" and r.get("replica") == 1]
    assert len(again) == 2 * 2, [(r["t"], r["rank"]) for r in again]
    assert max(r["step"] for r in records if r["event"] == "step.commit") == 40


def test_a_replacement_killed_mid_heal_restarts_and_heals_while_its_source_trains_on(tmp_path):
    """The other side of a heal under way: the replacement itself SIGKILLed between its
    ``heal_start`` and ``healed`` (its sources serve slowly). No crash elsewhere: the source and
    the third group keep their processes and commit on, the replacement's next incarnation heals,
    and every shard ends equal (run_ok compares them per step and rank)."""
    seen: dict[str, object] = {}

    def kill_replacement(job, r):
        seen["heal"] = r["t"]
        kill_group(job, 1)

    records = run_ok(mid_heal_job(), tmp_path, on_started=mid_heal(kill_replacement))

    assert "heal" in seen, "the replacement never began a heal"
    killed = [r for r in records if r["event"] == "failure" and r.get("signal") == "SIGKILL"]
    assert [r["replica"] for r in killed] == [1, 1]
    # only group 1 was ever restarted: three incarnations of its two ranks, the others' first
    starts = [r for r in records if r["event"] == "proc.start" and r.get("replica") is not None]
    assert sorted((r["replica"], r["rank"]) for r in starts if r["replica"] != 1) == [
        (0, 0), (0, 1), (2, 0), (2, 1)
    ]  # fmt: skip
    assert len([r for r in starts if r["replica"] == 1]) == 3 * 2
    healed = [r for r in records if r["event"] == HEALED and r["replica"] == 1]
    assert {r["rank"] for r in healed if r["t"] > seen["heal"]} == {0, 1}, healed
    assert max(r["step"] for r in records if r["event"] == "step.commit") == 40


HEAL_SOURCE_KILL = """
name = "heal-source-kill"
seed = 9                              # a plan of: the kill, then the heal_source_kill
duration_s = 40                 # an upper bound: settle_s ends it once the faults are over
settle_s = 5
policies = ["in_place"]

[job]
name = "heal-source-kill"
replicas = 3
ranks = 2
steps = 1000000
parallel = { group = "fsdp" }
transport = "dataplane"
checkpoint = { every_steps = 0 }

[schedule]
kind = "at_times"
at_times = [5, 5]

[faults]
mix = { kill = 1, heal_source_kill = 1 }

[faults.options.heal_source_kill]
slow_serve_s = 2.0
wait_s = 15

[targets]
kind = "rank"
replicas = [1]                        # the kill's; the heal_source_kill aims when it fires

[hypotheses]
committed_steps_rise = true
replicas_equal_after_heal = true
every_fault_recovered = true
journal_complete = true
no_orphans = true
no_shm_left = true
"""


def test_a_chaos_run_kills_the_source_of_a_heal_under_way_and_the_heal_goes_on(tmp_path):
    """``heal_source_kill`` in ``ftharness chaos``: it waits for the killed group's heal, kills
    every rank of the group that heal loads from (its ``fault.inject`` names it, and its
    recovery is linked to the fault), and the healing group takes its shards from a live group
    with no restart of its own; every hypothesis holds."""
    (tmp_path / "exp.toml").write_text(HEAL_SOURCE_KILL)
    run_chaos(tmp_path, REPO, timeout=200)  # exits 0, every hypothesis holds
    records = read_journal(tmp_path / "run" / "in_place")
    injects = {r["kind"]: r for r in records if r["event"] == "fault.inject"}
    assert set(injects) == {"kill", "heal_source_kill"}, injects
    shot = injects["heal_source_kill"]
    starts = [
        r for r in records
        if r["event"] == HEAL_START and r["replica"] == 1 and r["rank"] == 0 and r["t"] <= shot["t"]
    ]  # fmt: skip
    assert starts, "no heal of the killed group was under way when the fault fired"
    source = starts[-1]["source"]
    target = int(re.match(r"replica_(\d+)\.", source).group(1))
    assert shot["target"]["replica"] == target != 1 and shot["target"]["rank"] is None
    killed = {
        (r["replica"], r["rank"])
        for r in records
        if r["event"] == "failure" and r.get("signal") == "SIGKILL" and r["t"] >= shot["t"]
    }
    assert (target, 0) in killed or (target, 1) in killed, killed
    # mid-heal: the heal from the killed source never landed; a later one did, with no restart
    healed = [r for r in records if r["event"] == HEALED and r["replica"] == 1]
    assert healed and all(r["source"] != source for r in healed), healed
    assert {r["rank"] for r in healed if r["t"] > shot["t"]} == {0, 1}
    again = [r for r in records if r["event"] == "proc.start" and r.get("replica") == 1]
    assert len(again) == 2 * 2, [(r["t"], r["rank"]) for r in again]
    linked = {
        r["fault_id"] for r in records if r["event"] == "recovery.phase" and r["replica"] == target
    }
    assert shot["fault_id"] in linked


ALL_RANKS = {(0, 0), (0, 1), (1, 0), (1, 1)}


def _resumed(records: list[dict], since: float, step: int) -> set[tuple[int, int]]:
    """The (replica, rank)s that, after ``since`` (every group lost), loaded checkpoint ``step``
    or healed at it from a group that loaded it. Both are a resume from ``step``: the groups'
    deaths are seen tens of ms apart, and a group whose death is seen first restarts while the
    other still looks alive, so it loads nothing and heals from that one once it has loaded
    (``Trainer``'s ``peers_hold_state``; seen in CI, the deaths 28-33 ms apart)."""
    events = ("checkpoint.load", "trainer.heal_start")
    return {
        (r["replica"], r["rank"])
        for r in records
        if r["event"] in events and r["t"] > since and r["step"] == step
    }


@pytest.mark.parametrize("group", ["fsdp", "replicate"])
def test_a_group_resumes_from_a_step_every_rank_has(tmp_path, group):
    """Every group lost at once, and rank 1's newest checkpoint did not land (its write was
    under way): the job resumes from checkpoints, and every rank of each group loads the newest
    step that all its ranks have, older than rank 0's newest. Each rank loading its own newest
    would leave a group's ranks a step apart, committing different steps together
    (check_invariants: ranks_apart). Sharded or not: a replicated group's ranks too hold one
    data position each."""
    cfg = tiny_cfg(
        "replicas=2", "ranks=2", "steps=70", f"parallel.group={group}",
        "checkpoint.every_steps=10", "checkpoint.keep=3", "checkpoint.format=torch",
    )  # fmt: skip
    ckpts = tmp_path / "checkpoints"
    dropped: list[int] = []

    def kill_all_and_drop_rank1s_newest(job) -> None:
        for replica, rank in ((0, 0), (0, 1), (1, 0), (1, 1)):
            for pid in job.faults.pids(Target(replica=replica, rank=rank)):
                os.kill(pid, signal.SIGKILL)
        # At once: the restarted ranks look for checkpoints within tenths of a second. (No write
        # is under way: the next checkpoint step is 5 steps off.)
        manifests = sorted(ckpts.glob("replica_*_rank_1/step_*.json"))
        newest = max(int(m.stem.split("_")[1]) for m in manifests)
        for m in manifests:
            if int(m.stem.split("_")[1]) == newest:
                m.unlink()  # the manifest is renamed in last: without it the write never landed
        dropped.append(newest)

    records = run_ok(
        cfg, tmp_path, timeout=180,
        on_started=lambda job: after_step(job, 45, lambda: kill_all_and_drop_rank1s_newest(job)),
    )  # fmt: skip
    restarts = [r for r in records if r["event"] == "job.restart"]
    assert len(restarts) == 1, restarts
    loads = [r for r in records if r["event"] == "checkpoint.load"]
    assert _resumed(records, restarts[0]["t"], dropped[0] - 10) == ALL_RANKS
    assert loads and {r["step"] for r in loads} == {dropped[0] - 10}, (dropped, loads)
    assert max(r["step"] for r in records if r["event"] == "step.commit") == 70


def test_a_sharded_job_resumes_from_its_dcp_checkpoints_then_a_job_of_another_shape_does(tmp_path):
    """Sharded groups write DCP checkpoints (the default for them): step-N folders, every rank's
    shards, written in the background by one group. Every group lost at once: the job resumes
    from the newest one. Then a new job of another shape (unsharded, one rank per group) starts
    from the same folder: DCP reshards on load, and it goes on from the step the first ended."""
    first = tmp_path / "first"
    first.mkdir()
    cfg = tiny_cfg(
        "replicas=2", "ranks=2", "steps=60", "parallel.group=fsdp", "checkpoint.every_steps=10"
    )

    def kill_all(job) -> None:
        for replica, rank in ((0, 0), (0, 1), (1, 0), (1, 1)):
            for pid in job.faults.pids(Target(replica=replica, rank=rank)):
                os.kill(pid, signal.SIGKILL)

    records = run_ok(
        cfg, first, timeout=180, on_started=lambda job: after_step(job, 35, lambda: kill_all(job))
    )
    saves = [r for r in records if r["event"] == "checkpoint.save"]
    assert saves and all(r["format"] == "dcp" and r["rank"] == 0 for r in saves)
    assert all(r["blocked_s"] is not None and r["seconds"] >= r["blocked_s"] for r in saves)
    ckpts = first / "checkpoints"
    newest = max(int(p.name.split("-")[1]) for p in ckpts.glob("step-*"))
    assert newest == 60
    assert sorted(p.name for p in (ckpts / "step-60").iterdir()) == [
        ".metadata", "__0_0.distcp", "__1_0.distcp",
    ]  # fmt: skip
    assert not list(ckpts.glob(".step-*"))
    restart = [r for r in records if r["event"] == "job.restart"]
    assert len(restart) == 1
    loads = [r for r in records if r["event"] == "checkpoint.load"]
    assert len({r["step"] for r in loads}) == 1 and loads[0]["step"] >= 30
    assert _resumed(records, restart[0]["t"], loads[0]["step"]) == ALL_RANKS
    assert all(r["format"] == "dcp" for r in loads)

    second = tmp_path / "second"
    second.mkdir()
    cfg = tiny_cfg(
        "replicas=2", "ranks=1", "steps=70", "checkpoint.every_steps=10",
        "checkpoint.format=dcp", f"checkpoint.dir={ckpts}",
    )  # fmt: skip
    records = run_ok(cfg, second, timeout=120)
    loads = sorted((r for r in records if r["event"] == "checkpoint.load"), key=lambda r: r["t"])
    assert {r["replica"] for r in loads} == {0, 1} and all(r["format"] == "dcp" for r in loads)
    # The first group loads the first job's last step; a group that starts after the other has
    # trained on to the next checkpoint (10 tiny steps: a few tenths of a second) loads that one.
    # (At a job's start a group loads even beside one that holds state: only a replacement heals
    # instead, ``peers_hold_state``; the other group may be done before it joins.)
    assert loads[0]["step"] == 60 and all(r["step"] in (60, 70) for r in loads)
    commits = sorted(r["step"] for r in records if r["event"] == "step.commit")
    assert commits[0] == 61 and commits[-1] == 70


def test_every_group_killed_mid_dcp_write_resumes_from_the_checkpoint_before(tmp_path):
    """A background DCP write under way (its .step-N.tmp folder on disk, not yet renamed) when
    every group is SIGKILLed: the job resumes from the newest complete step-M, M < N, and
    nothing of step N is loaded. The writers are frozen (SIGSTOP) the moment the folder
    appears, so the test knows the kill came mid-write; if the rename won the race, they go on
    and the next checkpoint is tried."""
    cfg = tiny_cfg(
        "replicas=2", "ranks=2", "steps=80", "parallel.group=fsdp", "checkpoint.every_steps=10",
        "checkpoint.keep=3",
    )  # fmt: skip
    ckpts = tmp_path / "checkpoints"
    killed_mid: list[int] = []
    targets = [Target(replica=g, rank=r) for g in range(2) for r in range(2)]

    def kill_mid_write(job) -> None:
        deadline = time.monotonic() + 120
        while not killed_mid and time.monotonic() < deadline:
            tmp = list(ckpts.glob(".step-*.tmp")) if ckpts.is_dir() else []
            if not tmp or job.faults.committed_step() < 25:
                time.sleep(0.002)
                continue
            pids = [pid for t in targets for pid in job.faults.pids(t)]
            for pid in pids:
                os.kill(pid, signal.SIGSTOP)
            step = int(tmp[0].name.split("-")[1].split(".")[0])
            if tmp[0].exists() and not (ckpts / f"step-{step}").exists():
                for pid in pids:
                    os.kill(pid, signal.SIGKILL)
                killed_mid.append(step)
                return
            for pid in pids:  # the write finished meanwhile: go on, try the next one
                os.kill(pid, signal.SIGCONT)
            time.sleep(0.5)

    def started(job) -> None:
        threading.Thread(target=kill_mid_write, args=(job,), daemon=True).start()

    records = run_ok(cfg, tmp_path, timeout=180, on_started=started)
    assert killed_mid, "no DCP write was caught under way"
    (n,) = killed_mid
    restarts = [r for r in records if r["event"] == "job.restart"]
    assert len(restarts) == 1, restarts
    t_restart = restarts[0]["t"]
    loads = [r for r in records if r["event"] == "checkpoint.load" and r["t"] > t_restart]
    assert _resumed(records, t_restart, n - 10) == ALL_RANKS
    assert loads and {r["step"] for r in loads} == {n - 10}, (n, loads)
    assert max(r["step"] for r in records if r["event"] == "step.commit") == 80
    assert (ckpts / "step-80" / ".metadata").is_file()
    assert not list(ckpts.glob(".step-*"))  # the half-written one was written again, in place


CHECKPOINT_KILL = """
name = "checkpoint-kill"
seed = 3
duration_s = 40                 # an upper bound: settle_s ends it once the faults are over
settle_s = 5
policies = ["full_restart"]

[job]
name = "checkpoint-kill"
replicas = 2
ranks = 2
steps = 1000000
parallel = { group = "fsdp" }         # DCP checkpoints
checkpoint = { every_steps = 20 }

[schedule]
kind = "at_times"
at_times = [6]

[faults]
mix = { checkpoint_kill = 1 }

[faults.options.checkpoint_kill]
slow_write_s = 3.0
wait_s = 15

[hypotheses]
committed_steps_rise = true
replicas_equal_after_heal = true
every_fault_recovered = true
journal_complete = true
no_orphans = true
"""


def test_a_chaos_run_kills_a_group_mid_checkpoint_and_the_job_resumes_from_the_one_before(
    tmp_path,
):
    """``checkpoint_kill`` in ``ftharness chaos``, under ``full_restart``: it waits for a DCP
    write under way (slowed: every shard and the metadata written, the folder not yet renamed),
    kills every rank of the writing group; the job restarts whole and every rank loads the
    checkpoint before, never the one being written; every hypothesis holds."""
    (tmp_path / "exp.toml").write_text(CHECKPOINT_KILL)
    run_chaos(tmp_path, REPO, timeout=200)
    records = read_journal(tmp_path / "run" / "full_restart")
    (shot,) = [r for r in records if r["event"] == "fault.inject"]
    assert shot["kind"] == "checkpoint_kill" and shot["ready"] is True
    starts = [
        r for r in records
        if r["event"] == "checkpoint.start" and r["t"] <= shot["t"]
        and r["replica"] == shot["target"]["replica"]
    ]  # fmt: skip
    killed_step = starts[-1]["step"]
    saved = {r["step"] for r in records if r["event"] == "checkpoint.save" and r["t"] <= shot["t"]}
    assert killed_step not in saved  # the write was under way: not in place
    loads = [r for r in records if r["event"] == "checkpoint.load" and r["t"] > shot["t"]]
    assert loads and {r["step"] for r in loads} == {killed_step - 20}, (killed_step, loads)
