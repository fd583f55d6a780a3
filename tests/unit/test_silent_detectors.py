"""Silent failures, the pure parts: divergence by majority (harness.job.divergence), the
straggler detector (harness.job.stragglers) and the bitflip fault on a real tensor
(faults.bitflip)."""

from __future__ import annotations

import random
import struct
from typing import Any

import pytest
import torch

from faults import bitflip, inworker
from faults.fault import make_fault
from harness.job.divergence import Divergence, Verdict
from harness.job.stragglers import StragglerDetector

pytestmark = pytest.mark.timeout(30)


def _feed(d: Divergence, step: int, values: dict[int, Any], **kw: Any) -> list[Verdict]:
    out = []
    for r, v in values.items():
        loss, checksum = (v, None) if isinstance(v, float) else (1.0, v)
        got = d.on_commit(
            replica=r,
            rank=0,
            step=step,
            checksum=checksum,
            loss=loss,
            participants=len(values),
            proc=kw.get("procs", {}).get(r, f"p{r}"),
        )
        if got:
            out.append(got)
    return out


def test_the_minority_checksum_is_the_suspect_and_the_verdict_waits_for_every_group() -> None:
    d = Divergence()
    assert _feed(d, 10, {0: "a", 1: "a", 2: "a"}) == [] and d.last_agreed == 10
    assert d.on_commit(replica=1, rank=0, step=20, checksum="x", loss=1.0, participants=3) is None
    assert d.on_commit(replica=0, rank=0, step=20, checksum="b", loss=1.0, participants=3) is None
    v = d.on_commit(replica=2, rank=0, step=20, checksum="b", loss=1.0, participants=3)
    assert v is not None and (v.action, v.cause, v.suspects, v.majority) == (
        "heal",
        "checksum",
        (1,),
        (0, 2),
    )
    # the condemned incarnation keeps committing until it is killed: no second alarm from it
    assert _feed(d, 21, {0: 2.0, 1: float("nan"), 2: 2.0}) == []


def test_two_groups_that_differ_have_no_majority_and_roll_back_to_the_last_agreed_step() -> None:
    d = Divergence()
    _feed(d, 10, {0: "a", 1: "a"})
    (v,) = _feed(d, 20, {0: "b", 1: "c"})
    assert (v.action, v.suspects, v.majority, v.rollback_to) == ("rollback", (0, 1), (), 10)
    d2 = Divergence()  # three groups that all differ: no majority either
    (v,) = _feed(d2, 10, {0: "a", 1: "b", 2: "c"})
    assert v.action == "rollback" and v.rollback_to == 0


def test_a_non_finite_loss_in_one_group_is_a_suspect_but_everywhere_is_not_silent() -> None:
    d = Divergence()
    (v,) = _feed(d, 3, {0: 1.5, 1: float("inf")})  # two groups: the finite one is believed
    assert (v.cause, v.action, v.suspects, v.majority) == ("nonfinite", "heal", (1,), (0,))
    assert _feed(Divergence(), 3, {0: float("nan"), 1: float("nan"), 2: float("nan")}) == []
    # a step another rank index of the group reports is judged on its own
    d3 = Divergence()
    for r in range(3):
        d3.on_commit(replica=r, rank=0, step=10, checksum="a", loss=1.0, participants=3)
    got = [
        d3.on_commit(replica=r, rank=1, step=10, checksum=c, loss=1.0, participants=3)
        for r, c in enumerate("aab")
    ]
    assert got[-1] is not None and got[-1].suspects == (2,) and got[-1].rank == 1


def _times(
    det: StragglerDetector,
    steps: range,
    speed: dict[int, float],
    rng: random.Random,
    noise: tuple[float, float] = (0.6, 1.8),
) -> list[Any]:
    events = []
    for step in steps:
        for r, base in speed.items():
            for rank in range(2):
                t = base * rng.uniform(*noise)  # noisy: a loaded machine
                events += det.on_commit(replica=r, rank=rank, step=step, compute_s=t)
    return events


def test_noisy_but_equal_groups_are_never_flagged() -> None:
    det = StragglerDetector(factor=2.0, window=20, hysteresis=0.75)
    rng = random.Random(7)
    # with bursts: one group descheduled for a few steps now and then
    events = []
    for step in range(1, 2000):
        for r in range(3):
            slow = 5.0 if rng.random() < 0.05 else 1.0
            events += det.on_commit(
                replica=r, rank=0, step=step, compute_s=0.02 * slow * rng.uniform(0.5, 2.0)
            )
    assert events == []


def test_a_slow_group_is_flagged_once_and_cleared_below_the_hysteresis_band() -> None:
    det = StragglerDetector(factor=2.0, window=10, hysteresis=0.75)
    rng = random.Random(1)
    assert _times(det, range(1, 30), {0: 0.02, 1: 0.02, 2: 0.02}, rng) == []
    slow = _times(det, range(30, 60), {0: 0.02, 1: 0.07, 2: 0.02}, rng)
    assert [(e.replica, e.action) for e in slow] == [(1, "flagged")]
    assert 30 < slow[0].step <= 30 + 10  # persistent: more than half a window of slow steps
    # 1.75x: inside the band (between 1.5x and 2x) nothing changes, no flapping
    band = {0: 0.02, 1: 0.035, 2: 0.02}
    assert _times(det, range(60, 100), band, rng, noise=(0.9, 1.1)) == []
    back = _times(det, range(100, 130), {0: 0.02, 1: 0.02, 2: 0.02}, rng)
    assert [(e.replica, e.action) for e in back] == [(1, "cleared")]


def test_a_new_incarnation_starts_an_empty_window() -> None:
    det = StragglerDetector(factor=2.0, window=5, hysteresis=0.75)
    for step in range(1, 20):
        for r in range(3):
            det.on_commit(replica=r, rank=0, step=step, compute_s=0.01, proc=f"old{r}")
    assert det.estimate(1) == pytest.approx(0.01)
    det.on_commit(replica=1, rank=0, step=20, compute_s=5.0, proc="new1")
    assert det.estimate(1) is None


def test_bitflip_flips_the_seeded_bit_of_a_real_tensor_between_steps_and_journals_it() -> None:
    torch.manual_seed(0)
    tensors = {"model.w": torch.randn(64), "optim.0.exp_avg": torch.randn(16)}
    before = {k: t.clone() for k, t in tensors.items()}
    journal: list[tuple[str, dict[str, Any]]] = []

    class FakeTrainer:  # the trainer actor's hook, run as its training thread would
        pending: list[Any] = []

        def between_steps(self, fn: Any) -> None:
            self.pending.append(fn)

    trainer = FakeTrainer()
    old = inworker.actors_provider
    inworker.actors_provider = lambda: {"trainer": trainer}
    try:
        bitflip.flip_between_steps(1234, "weights", 30)
    finally:
        inworker.actors_provider = old
    assert torch.equal(tensors["model.w"], before["model.w"])  # nothing until between steps
    trainer.pending.pop()(tensors, 7, lambda e, f: journal.append((e, f)))
    ((event, hit),) = journal
    assert event == "fault.bitflip" and hit["tensor"] == "model.w" and hit["step"] == 7
    i, bit = hit["index"], hit["bit"]
    assert bit == 30
    changed = (tensors["model.w"] != before["model.w"]).nonzero().flatten().tolist()
    assert changed == [i] and torch.equal(tensors["optim.0.exp_avg"], before["optim.0.exp_avg"])
    (a,) = struct.unpack("<I", struct.pack("<f", before["model.w"][i].item()))
    (b,) = struct.unpack("<I", struct.pack("<f", tensors["model.w"][i].item()))
    assert a ^ b == 1 << 30 and hit["before"] == before["model.w"][i].item()
    # seeded: the same seed picks the same place, another seed (almost surely) another
    sizes = [("a", 1000, 4), ("b", 5000, 4)]
    assert bitflip.choose(sizes, 99) == bitflip.choose(sizes, 99)
    assert len({bitflip.choose(sizes, s) for s in range(20)}) > 15
    assert make_fault("bitflip", where="optimizer").where == "optimizer"  # type: ignore[attr-defined]


def test_a_non_finite_loss_on_weights_that_check_equal_is_the_datas_not_the_replicas() -> None:
    """Every group checksums a step with a non-finite loss (Asks.nonfinite): equal checksums
    blame the data and condemn nobody; differing ones heal the non-finite group."""
    d = Divergence()
    for r, loss in enumerate([2.0, float("nan"), 2.1]):
        got = d.on_commit(replica=r, rank=0, step=7, checksum="a", loss=loss, participants=3,
                          proc=f"p{r}")  # fmt: skip
    assert got is not None
    assert (got.cause, got.action, got.suspects, got.majority) == (
        "nonfinite",
        "data",
        (1,),
        (0, 2),
    )
    assert d.last_agreed == 7
    # not condemned: its next non-finite loss is judged again
    again = [
        d.on_commit(
            replica=r, rank=0, step=8, checksum="b", loss=loss, participants=3, proc=f"p{r}"
        )
        for r, loss in enumerate([2.0, float("nan"), 2.1])
    ]
    assert again[-1] is not None and again[-1].action == "data"
    d2 = Divergence()
    got2 = [
        d2.on_commit(replica=r, rank=0, step=7, checksum=c, loss=loss, participants=3)
        for r, (c, loss) in enumerate([("a", 2.0), ("x", float("nan")), ("a", 2.1)])
    ]
    assert got2[-1] is not None
    assert (got2[-1].cause, got2[-1].action, got2[-1].suspects) == ("nonfinite", "heal", (1,))
