"""A program rank's death after its group finished is the group's end, not a fault to recover
from (``harness.job.program.deaths.DeathWatch.after_finish``)."""

from __future__ import annotations

import concurrent.futures as cf
import json
from pathlib import Path
from types import SimpleNamespace

from harness.config import load_config
from harness.job.program.deaths import DeathWatch
from harness.job.program.group import ProgramGroup
from runtime.failure import Cause, Failure


def _rank(proc_id: str, exited_0: bool) -> SimpleNamespace:
    finished: cf.Future = cf.Future()
    if exited_0:
        finished.set_result(1.0)
    return SimpleNamespace(ref=SimpleNamespace(proc_id=proc_id), finished=finished)


def _watch(tmp_path: Path, *, rank0_exited: bool, last_step: int | None):
    cfg = load_config(
        "experiments/tiny.toml",
        [f"program.command={json.dumps(['python', 't.py'])}", "steps=100", "ranks=2"],
    )
    g = ProgramGroup(
        replica=0, incarnation=0, store="h:1", started=0.0, training=cf.Future(),
        procs=[_rank("h/p0", rank0_exited), _rank("h/p1", False)],
    )  # fmt: skip
    g.last_step = last_step
    seen: dict[str, list] = {"said": [], "overtaken": [], "finished": []}
    watch = DeathWatch(
        cfg=cfg, logs=tmp_path, group={0: g}.get, say=seen["said"].append, fail=print,
        finished=lambda: seen["finished"].append(True), overtaken=seen["overtaken"].append,
    )  # fmt: skip
    failure = Failure(
        cause=Cause.EXIT_CODE, detail="exited with code 1", proc="h/p1",
        coords={"replica": 0, "rank": 1}, exit_code=1,
    )  # fmt: skip
    return watch, g, failure, seen


def test_a_rank_failing_after_its_rank_0_finished_the_last_step_ends_its_group(tmp_path):
    watch, g, failure, seen = _watch(tmp_path, rank0_exited=True, last_step=99)
    assert watch.after_finish(failure)
    assert g.training.done() and seen["overtaken"] == [0] and seen["finished"] == [True]
    assert "after another of its ranks finished the job's last step" in seen["said"][0]


def test_before_the_last_step_or_with_no_rank_finished_it_is_a_fault(tmp_path):
    watch, g, failure, seen = _watch(tmp_path, rank0_exited=True, last_step=50)
    assert not watch.after_finish(failure) and not g.training.done()
    watch, g, failure, seen = _watch(tmp_path, rank0_exited=False, last_step=99)
    assert not watch.after_finish(failure) and not seen["overtaken"]
