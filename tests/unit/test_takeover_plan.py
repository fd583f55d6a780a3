"""What a new controller trusts in a run directory (``harness.job.takeover.read_run``): every
group start signed and numbered, the journal whole; anything else is refused with the reason."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from harness.config import load_config
from harness.job.takeover import TakeoverRefused, read_run, sign, supported
from runtime.journal import GROUP_DROPPED, GROUP_START, JOB_END, JOB_START, Journal

SECRET = b"k" * 32


def _group(journal: Journal, replica: int, seq: int, *, epoch: int = 1, inc: int = 0) -> None:
    fields = {
        "replica": replica,
        "incarnation": inc,
        "host": "host0",
        "procs": [f"host0/{replica}-{inc}"],
        "seq": seq,
        "epoch": epoch,
    }
    journal.emit(GROUP_START, **fields, mac=sign(SECRET, fields))


def _run(tmp_path: Path) -> Journal:
    journal = Journal(tmp_path / "journal.jsonl", job="t")
    journal.emit(JOB_START, config={}, replicas=2, ranks=1)
    _group(journal, 0, 1)
    _group(journal, 1, 2)
    journal.emit("step.commit", replica=0, rank=0, step=7)
    return journal


def test_the_latest_start_of_each_group_across_controllers_is_what_runs(tmp_path: Path) -> None:
    journal = _run(tmp_path)
    _group(journal, 1, 1, epoch=2, inc=1)  # the next controller numbers from 1 again
    journal.close()
    plan = read_run(tmp_path, SECRET, epoch=2)
    assert plan.epoch == 2 and plan.committed_step == 7
    assert {r: (g.incarnation, g.procs) for r, g in plan.groups.items()} == {
        0: (0, ("host0/0-0",)),
        1: (1, ("host0/1-1",)),
    }


def test_a_dropped_group_is_neither_adopted_nor_started_again(tmp_path: Path) -> None:
    """A group dropped for a crash loop of its own (harness.job.groups.TrainerGroups.drop) is
    in no plan to adopt; what is left of it stops with every process no group claims."""
    journal = _run(tmp_path)
    journal.emit(GROUP_DROPPED, replica=1, left=1, reason="only group 1 fails")
    journal.close()
    plan = read_run(tmp_path, SECRET, epoch=1)
    assert plan.dropped == {1} and list(plan.groups) == [0]

    from harness.job.start import job_start

    assert job_start(plan).dropped == {1} and job_start(None).dropped == frozenset()


def test_a_record_edited_by_hand_is_refused(tmp_path: Path) -> None:
    _run(tmp_path).close()
    path = tmp_path / "journal.jsonl"
    lines = path.read_text().splitlines()
    edited = [json.loads(x) for x in lines]
    edited[1]["procs"] = ["host0/999"]  # another process to adopt
    path.write_text("".join(json.dumps(r) + "\n" for r in edited))
    with pytest.raises(TakeoverRefused, match="signature does not match"):
        read_run(tmp_path, SECRET, epoch=1)
    with pytest.raises(TakeoverRefused, match="signature"):  # and a wrong secret the same
        read_run(tmp_path, b"x" * 32, epoch=1)


def test_a_missing_group_start_or_a_damaged_line_is_refused(tmp_path: Path) -> None:
    _run(tmp_path).close()
    path = tmp_path / "journal.jsonl"
    lines = path.read_text().splitlines(keepends=True)
    path.write_text(lines[0] + lines[2] + lines[3])  # the first group start is gone
    with pytest.raises(TakeoverRefused, match="numbered 2, expected 1"):
        read_run(tmp_path, SECRET, epoch=1)
    path.write_text("".join(lines) + '{"t": 1.0, "event": "step.co')  # torn
    with pytest.raises(TakeoverRefused, match="damaged"):
        read_run(tmp_path, SECRET, epoch=1)


def test_an_ended_job_or_no_job_is_refused(tmp_path: Path) -> None:
    with pytest.raises(TakeoverRefused, match="does not exist"):
        read_run(tmp_path, SECRET, epoch=1)
    journal = _run(tmp_path)
    journal.emit(JOB_END, status="ok", reason="done", steps=7)
    journal.close()
    with pytest.raises(TakeoverRefused, match="has ended"):
        read_run(tmp_path, SECRET, epoch=1)


def test_what_this_slice_cannot_take_over_is_said(tmp_path: Path) -> None:
    base = "experiments/tiny.toml"
    assert supported(load_config(base, [])) is None
    assert "torchft" in (supported(load_config(base, ['recovery.quorum="torchft"'])) or "")
    assert "grace" in (supported(load_config(base, ["recovery.controller_grace_s=0"])) or "")
