"""Silent data corruption found and repaired while the job trains (harness.job.silent): a bit
flipped in one group's weights by the real ``bitflip`` fault, in real processes."""

from __future__ import annotations

import random
import threading
import time

import pytest
from e2e_helpers import events, tiny_cfg, wait_until

from faults.fault import Target, make_fault
from harness.job.launch import run_job
from harness.rank.trainer import CHECKSUM_EVERY

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]


def test_a_flipped_bit_is_found_within_a_checksum_period_and_healed_from_the_majority(tmp_path):
    """Two flips, in two positions (group 0, the one torchft's round-robin favours as a heal
    source at an even quorum, then group 2): each is detected at the next checksum step, its
    group alone is restarted, heals from a healthy group, and the replicas end bitwise equal."""
    cfg = tiny_cfg("steps=70", "checkpoint.every_steps=0", "recovery.quorum_every_steps=1")
    flip = make_fault("bitflip", where="weights", bit=22)  # a mantissa bit: finite, different

    def started(job):
        def flips():
            for replica, step in ((0, 12), (2, 41)):
                wait_until(lambda s=step: job.faults.committed_step() >= s, time.monotonic() + 60)
                flip.fire(job.faults, Target(replica=replica, rank=0), random.Random(replica))

        threading.Thread(target=flips, daemon=True).start()

    out = run_job(cfg, tmp_path, quiet=True, on_started=started, timeout=100)
    assert out["status"] == "ok", out["reason"]
    records = events(tmp_path)
    flipped = [r for r in records if r["event"] == "fault.bitflip"]
    alarms = [r for r in records if r["event"] == "silent.divergence"]
    assert [r["replica"] for r in flipped] == [0, 2]
    assert [(a["suspects"], a["action"], a["cause"]) for a in alarms] == [
        ([0], "heal", "checksum"),
        ([2], "heal", "checksum"),
    ]
    ends = [f["t"] for f in flipped[1:]] + [float("inf")]
    for f, a, end in zip(flipped, alarms, ends, strict=True):
        assert a["flip_step"] == f["step"] and 0 < a["latency_steps"] <= CHECKSUM_EVERY + 1
        # only the suspect failed; no heal between the flip and the suspect's death (a heal
        # then could have come from it), and the suspect's replacement healed after it
        window = [r for r in records if f["t"] <= r["t"] < end]
        failures = [r for r in window if r["event"] == "failure"]
        assert {r["replica"] for r in failures} == {f["replica"]}
        dead = min(r["t"] for r in failures)
        heals = [r for r in window if r["event"] == "trainer.healed"]
        assert not [r for r in heals if r["t"] < dead]
        assert any(r["replica"] == f["replica"] for r in heals)
    # replicas bitwise equal at every checksum step after the last repair
    last = alarms[-1]["step"]
    sums: dict[int, dict[int, str]] = {}
    for r in records:
        if r["event"] == "step.commit" and r.get("checksum") and r["step"] > last:
            sums.setdefault(r["step"], {})[r["replica"]] = r["checksum"]
    full = {s: v for s, v in sums.items() if len(v) == 3}
    assert full and all(len(set(v.values())) == 1 for v in full.values()), sums
    assert max(full) == 70


def test_a_flip_that_makes_the_loss_non_finite_heals_at_once_and_blames_no_data(tmp_path):
    """A high exponent bit: the group's loss turns non-finite. Every group checksums that step
    (the non-finite flag crosses the groups), the suspect's checksum differs from the others',
    so it is the replica that is healed, at that step, and no data is quarantined."""
    cfg = tiny_cfg("steps=40", "checkpoint.every_steps=0", "recovery.quorum_every_steps=1")
    flip = make_fault("bitflip", where="weights", bit=30)  # exponent MSB: a huge weight

    def started(job):
        def fire():
            wait_until(lambda: job.faults.committed_step() >= 12, time.monotonic() + 60)
            flip.fire(job.faults, Target(replica=1, rank=0), random.Random(1))  # an MLP weight

        threading.Thread(target=fire, daemon=True).start()

    out = run_job(cfg, tmp_path, quiet=True, on_started=started, timeout=100)
    assert out["status"] == "ok", out["reason"]
    records = events(tmp_path)
    (flipped,) = [r for r in records if r["event"] == "fault.bitflip"]
    assert flipped["replica"] == 1
    (alarm,) = [r for r in records if r["event"] == "silent.divergence"]
    assert (alarm["suspects"], alarm["action"], alarm["cause"]) == ([1], "heal", "nonfinite")
    assert alarm["latency_steps"] <= 2  # the step after the flip, not the next checksum step
    at_step = [r for r in records if r["event"] == "step.commit" and r["step"] == alarm["step"]]
    assert len({r["checksum"] for r in at_step}) == 2 and all(r["checksum"] for r in at_step)
    assert not [r for r in records if r["event"] == "data.quarantine"]
    assert any(r["event"] == "trainer.healed" and r["replica"] == 1 for r in records)
