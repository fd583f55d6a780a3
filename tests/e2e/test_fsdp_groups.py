"""Sharded replica groups in the built-in trainer (``parallel.group = "fsdp"``), end to end: real
worker processes under host agents, FSDP2 over gloo within each group, torchft across them, a
real SIGKILL of one rank of a sharded group."""

from __future__ import annotations

import os
import re
import signal

import pytest
from e2e_helpers import after_step, run_ok, tiny_cfg

from faults.fault import Target

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
        kill = lambda: os.kill(job.faults.pids(Target(replica=1, rank=1))[0], signal.SIGKILL)  # noqa: E731
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
    # every rank of the replacement loaded its own shards from a healthy group
    healed = {r["rank"] for r in records if r["event"] == "trainer.healed" and r["replica"] == 1}
    assert healed == {0, 1}
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


def test_every_rank_of_a_replacement_heals_from_one_source_group(tmp_path):
    """With two up-to-date groups torchft would send the replacement's rank 0 to one and rank 1
    to the other (its source is picked per group rank); every rank takes rank 0's instead
    (harness.rank.torchft_glue.OneHealSource), and every shard then equals that group's."""
    cfg = tiny_cfg("replicas=3", "ranks=2", "steps=30", "parallel.group=fsdp")

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
