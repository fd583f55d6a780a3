"""A checkpoint step does not wait for its checkpoint to reach the disk.

A real Trainer (torchft Manager, Lighthouse, gloo, one group) writing real files; only
``checkpoint.write`` is wrapped, to hold a write until the test lets it go (or to fail it).
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
from trainer_procs import lone_trainer

from harness.config import CheckpointConfig, JobConfig
from harness.rank import checkpoint
from harness.rank.torchft_glue import Lighthouse
from harness.rank.trainer import Trainer

Log = list[tuple[str, dict[str, Any]]]


@pytest.fixture
def lighthouse():
    lh = Lighthouse.for_job(JobConfig(name="ckpt-writer", replicas=1))
    yield lh
    lh.shutdown()


def _trainer(tmp_path: Path, lighthouse: Lighthouse, log: Log) -> Trainer:
    cfg = JobConfig(
        name="ckpt-writer", replicas=1, steps=20, checkpoint=CheckpointConfig(every_steps=4)
    )
    return lone_trainer(cfg, lighthouse.address, lambda e, f: log.append((e, f)), tmp_path)


def _held_write(monkeypatch: pytest.MonkeyPatch) -> tuple[threading.Event, threading.Event]:
    """Make ``checkpoint.write`` wait for ``release`` (after setting ``started``)."""
    started, release = threading.Event(), threading.Event()
    real = checkpoint.write

    def held(*args: Any, **kwargs: Any) -> Path:
        started.set()
        assert release.wait(120), "the test never released the write"
        return real(*args, **kwargs)

    monkeypatch.setattr(checkpoint, "write", held)
    return started, release


@pytest.mark.timeout(180)
def test_training_goes_on_while_the_checkpoint_is_written(
    tmp_path: Path, lighthouse: Lighthouse, monkeypatch: pytest.MonkeyPatch
) -> None:
    started, release = _held_write(monkeypatch)
    log: Log = []
    folder = tmp_path / "checkpoints" / "replica_0_rank_0"
    trainer = _trainer(tmp_path, lighthouse, log)
    try:
        while trainer.manager.current_step() < 7:
            trainer.train_step()  # the write of step 4 is handed over at step 4, and held
        assert started.is_set()
        committed = [f["step"] for e, f in log if e == "step.commit"]
        assert committed == [1, 2, 3, 4, 5, 6, 7]  # committed on while step 4's write waits
        assert not [e for e, _ in log if e == "checkpoint.save"]  # not durable: not reported
        assert checkpoint.load_latest(folder) is None
        release.set()
        trainer.train(steps=7)  # no step left to train: returns once the write has landed
        (saved,) = [(i, f) for i, (e, f) in enumerate(log) if e == "checkpoint.save"]
        index, fields = saved
        assert index == len(log) - 1  # reported after the later commits, once durable
        assert fields["step"] == 4 and fields["path"] == str(folder / "step_00000004.json")
        assert set(fields) == {"replica", "rank", "step", "path", "seconds", "blocked_s"}
        step, state = checkpoint.load_latest(folder)
        assert step == 4 and state["manager"]["step"] == 4
        assert state["data"]["position"] == 4  # not the position training went on to
    finally:
        release.set()
        trainer.close()


@pytest.mark.timeout(180)
def test_train_returns_only_once_the_last_checkpoint_is_durable(
    tmp_path: Path, lighthouse: Lighthouse, monkeypatch: pytest.MonkeyPatch
) -> None:
    _, release = _held_write(monkeypatch)
    log: Log = []
    trainer = _trainer(tmp_path, lighthouse, log)
    last_commit = threading.Event()

    def emit(event: str, fields: dict[str, Any]) -> None:
        log.append((event, fields))
        if event == "step.commit" and fields["step"] == 8:
            last_commit.set()

    trainer._emit = emit
    result: list[Any] = []
    thread = threading.Thread(target=lambda: result.append(trainer.train(steps=8)))
    try:
        thread.start()
        assert last_commit.wait(120)
        # Step 8's checkpoint is handed over and held: train() has nothing left but to wait.
        # (A bounded wait can only miss a train() that returns early, never fail a correct one.)
        thread.join(timeout=1.0)
        assert thread.is_alive() and not result
        release.set()
        thread.join(timeout=120)
        assert result and result[0]["step"] == 8
        assert [f["step"] for e, f in log if e == "checkpoint.save"] == [4, 8]
        assert checkpoint.load_latest(tmp_path / "checkpoints" / "replica_0_rank_0")[0] == 8
    finally:
        release.set()
        thread.join(timeout=120)
        trainer.close()


@pytest.mark.timeout(180)
def test_a_failed_write_is_raised_on_the_training_thread(
    tmp_path: Path, lighthouse: Lighthouse, monkeypatch: pytest.MonkeyPatch
) -> None:
    def enospc(folder: Path, step: int, payload: bytes, *, keep: int) -> Path:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(checkpoint, "write", enospc)
    log: Log = []
    trainer = _trainer(tmp_path, lighthouse, log)
    try:
        with pytest.raises(OSError, match="No space left"):
            trainer.train(steps=6)  # step 4's write failed: raised as train() ends
        assert trainer.manager.current_step() == 6
        with pytest.raises(OSError, match="No space left"):
            trainer.train(steps=20)  # step 8's write fails: raised at the next checkpoint, 12
        assert trainer.manager.current_step() == 12
        assert not [e for e, _ in log if e == "checkpoint.save"]
    finally:
        trainer.close()  # both errors were raised already: nothing left to raise
