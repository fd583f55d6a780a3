"""The report's and dashboard's view of silent failures (experiments.report_silent,
dashboards.html), from a hand-written journal."""

from __future__ import annotations

from typing import Any

import pytest

from dashboards.html import render_dashboard
from experiments.report import _replicas_equal
from experiments.report_silent import (
    render_silent,
    silent_summary,
    unexplained,
    without_healed_divergence,
)

pytestmark = pytest.mark.timeout(30)


def _journal() -> list[dict[str, Any]]:
    base = {"job": "j", "policy": "in_place"}
    recs: list[dict[str, Any]] = [{"t": 0.0, "event": "job.start", **base}]

    def commit(t: float, r: int, step: int, checksum: str | None = None, **kw: Any) -> None:
        recs.append(
            {
                "t": t,
                "event": "step.commit",
                "replica": r,
                "rank": 0,
                "step": step,
                "checksum": checksum,
                "loss": 1.0,
                "compute_s": 0.02,
                **base,
                **kw,
            }
        )

    for r in range(3):
        commit(1.0, r, 10, "a")
    recs.append({"t": 1.2, "event": "fault.bitflip", "replica": 1, "rank": 0, "step": 12, **base})
    for r, c in enumerate("bxb"):
        commit(2.0, r, 20, c)
    recs.append(
        {
            "t": 2.1,
            "event": "silent.divergence",
            "step": 20,
            "suspects": [1],
            "majority": [0, 2],
            "cause": "checksum",
            "action": "heal",
            "latency_steps": 8,
            "latency_s": 0.9,
            **base,
        }
    )
    recs.append(
        {
            "t": 2.1,
            "event": "recovery.phase",
            "replica": 1,
            "phase": "detected",
            "cause": "divergence",
            **base,
        }
    )
    commit(2.15, 1, 21, None)  # the condemned incarnation, before it dies
    recs.append({"t": 2.2, "event": "failure", "replica": 1, **base})
    recs.append({"t": 2.8, "event": "trainer.healed", "replica": 1, "rank": 0, **base})
    recs.append(
        {
            "t": 2.8,
            "event": "recovery.phase",
            "replica": 1,
            "phase": "healed",
            "cause": "divergence",
            **base,
        }
    )
    for r in range(3):
        commit(3.0, r, 30, "c")
    recs.append(
        {
            "t": 3.5,
            "event": "straggler",
            "replica": 2,
            "action": "ejected",
            "ratio": 3.1,
            "step": 31,
            "group_s": 0.06,
            "others_s": 0.02,
            **base,
        }
    )
    return recs


def test_a_healed_divergence_is_reported_with_its_figures_and_does_not_fail_replicas_equal():
    recs = _journal()
    assert not _replicas_equal("in_place", recs)["passed"]  # the raw journal: step 20 differs
    assert _replicas_equal("in_place", without_healed_divergence(recs))["passed"]
    observed = [dict(r, action="observe") if r["event"] == "silent.divergence" else r for r in recs]
    assert not _replicas_equal("in_place", without_healed_divergence(observed))["passed"]
    (d,) = silent_summary(recs)["in_place"]["divergences"]
    assert (d["latency_steps"], d["heal_s"], d["committed_after_detection"]) == (8, 0.7, 1)
    assert d["heals_while_corrupted"] == 0
    text = "\n".join(render_silent(silent_summary(recs)))
    assert "| 20 | checksum | heal | [1] | [0, 2] | 8 | 0.9 | 0.7 |" in text
    assert "| 2 | ejected | 31 | 3.1 |" in text
    page = render_dashboard(recs, {"policies": {}})
    assert 'id="panel-step-time"' in page and "g2 ejected at 3.5 s" in page


def test_a_non_finite_loss_the_data_was_to_blame_for_leaves_only_that_step_out():
    from experiments.report import _loss_finite

    def commit(replica: int, step: int, loss: float) -> dict[str, Any]:
        return {"event": "step.commit", "policy": "in_place", "replica": replica, "step": step,
                "loss": loss, "t": float(step)}  # fmt: skip

    recs = [commit(0, 5, 2.0), commit(1, 5, float("nan")), commit(1, 6, 2.0)]
    assert not _loss_finite("in_place", without_healed_divergence(recs))["passed"]
    blamed = {"event": "silent.divergence", "policy": "in_place", "step": 5, "rank": 0,
              "cause": "nonfinite", "action": "data", "suspects": [1], "t": 5.5}  # fmt: skip
    kept = without_healed_divergence([*recs[:2], blamed, recs[2]])
    assert _loss_finite("in_place", kept)["passed"]
    assert [(r["replica"], r["step"]) for r in kept if r["event"] == "step.commit"] == [
        (0, 5),
        (1, 6),
    ]


def test_a_repaired_divergence_no_flip_explains_fails_replicas_equal():
    """A heal or a rollback the checksums asked for, with no ``fault.bitflip`` before it: the
    harness made the replicas differ (a heal that left tensors unloaded did so for a sharded
    llama3), and the repair must not hide that."""
    recs = [r for r in _journal() if r["event"] != "fault.bitflip"]
    assert [r["step"] for r in unexplained(recs)] == [20]
    assert unexplained(_journal()) == []
    result = _replicas_equal("in_place", without_healed_divergence(recs))
    assert not result["passed"]
    assert "no injected fault explains" in result["detail"] and "step 20" in result["detail"]
    # its commits stay in, too: the loss and checksum checks see the diverged step
    kept = without_healed_divergence(recs)
    assert sum(r["event"] == "step.commit" and r["step"] == 20 for r in kept) == 3
