"""A job's checkpoint folder, checked before anything launches and held while the job runs.

Two jobs writing one folder would prune and overwrite each other's checkpoints, and a job that
resumes from a folder of another model would crash in every worker (a crash loop, found only
after launch). So:

* :func:`hold` takes an exclusive ``flock`` on ``ROOT/.ftharness.lock`` for the job's life
  (the controller's process holds it; the kernel drops it when that process dies, so a
  controller that takes over a dead one's job takes it again) and writes who holds it;
* :func:`problem` says, before launch, why the folder cannot be this job's: another live job
  holds it, or its newest DCP checkpoint was written for another model (names or shapes of the
  model's entries differ: read from DCP's metadata through the allowlist of
  ``harness.rank.dcp_checkpoint``, against the job's model built on the meta device).
"""

from __future__ import annotations

import fcntl
import json
import os
from pathlib import Path
from typing import Any

from harness.config import JobConfig

LOCK_NAME = ".ftharness.lock"
#: The entries of a DCP checkpoint that are not the model's (torchtitan's names and ours).
_NOT_MODEL = ("optimizer.", "dataloader.", "train_state.", "lr_scheduler.", "ft_manager.")


class CheckpointDirHeld(RuntimeError):
    """Another live job holds the checkpoint folder."""


def checkpoint_root(cfg: JobConfig, run_dir: str | os.PathLike[str] | None) -> Path | None:
    """Where the job's checkpoints go (None: it writes none): ``checkpoint.dir``, else the run
    directory's ``checkpoints``."""
    if cfg.checkpoint.every_steps <= 0:
        return None
    root = cfg.checkpoint.dir or (str(Path(run_dir) / "checkpoints") if run_dir else None)
    return Path(root) if root else None


class Hold:
    """An exclusive hold on a checkpoint folder (:func:`hold`); :meth:`release` ends it."""

    def __init__(self, fd: int) -> None:
        self._fd: int | None = fd

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing drops the flock
            self._fd = None


def hold(root: Path, run_dir: str | os.PathLike[str]) -> Hold:
    """Hold ``root`` for this process (created private if missing); CheckpointDirHeld if
    another live process holds it."""
    root.mkdir(parents=True, exist_ok=True, mode=0o700)
    fd = os.open(root / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = _holder(fd)
        os.close(fd)
        raise CheckpointDirHeld(
            f"checkpoint.dir {root} is in use by another job ({holder}); two jobs in one "
            "checkpoint folder would overwrite and prune each other's checkpoints: give this "
            "job a checkpoint.dir of its own"
        ) from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps({"pid": os.getpid(), "run_dir": str(run_dir)}).encode(), 0)
    return Hold(fd)


def _holder(fd: int) -> str:
    try:
        who = json.loads(os.pread(fd, 4096, 0) or b"{}")
        return f"pid {who['pid']}, run {who['run_dir']}"
    except (ValueError, KeyError, TypeError):
        return "its holder did not say who it is"


def _held(root: Path) -> str | None:
    lock = root / LOCK_NAME
    if not lock.is_file():
        return None
    try:
        hold(root, "a check before launch").release()
    except CheckpointDirHeld as e:
        return str(e)
    return None


def problem(cfg: JobConfig, run_dir: str | os.PathLike[str] | None) -> str | None:
    """Why this job cannot use its checkpoint folder, or None (nothing there is fine)."""
    root = checkpoint_root(cfg, run_dir)
    if root is None or not root.is_dir():
        return None
    held = _held(root)
    if held is not None:
        return held
    if cfg.checkpoint.resolved_format(cfg.parallel.group) == "dcp":
        return _other_model(cfg, root)
    return None


def _other_model(cfg: JobConfig, root: Path) -> str | None:
    if not any(root.glob("step-*/.metadata")):
        return None  # nothing to resume from: no need to import torch
    from harness.rank import dcp_checkpoint

    steps = dcp_checkpoint.steps(root)
    if not steps:
        return None
    path = dcp_checkpoint.step_dir(root, steps[0])
    try:
        metadata = dcp_checkpoint.TrustedReader(path).read_metadata()
    except (dcp_checkpoint.CheckpointRefused, OSError) as e:
        return f"checkpoint.dir {root}: {path.name} cannot be read ({e})"
    saved = {
        k: tuple(getattr(m, "size", ()))
        for k, m in metadata.state_dict_metadata.items()
        if not k.startswith(_NOT_MODEL)
    }
    expected = _model_entries(cfg)
    missing = sorted(set(expected) - set(saved))
    extra = sorted(set(saved) - set(expected))
    shapes = sorted(k for k in set(saved) & set(expected) if saved[k] != expected[k])
    if not (missing or extra or shapes):
        return None
    said = []
    if missing:
        said.append(f"{len(missing)} of the model's entries missing (first: {missing[0]})")
    if extra:
        said.append(f"{len(extra)} entries this model has not (first: {extra[0]})")
    if shapes:
        k = shapes[0]
        said.append(
            f"{len(shapes)} of other shapes (first: {k} {saved[k]}, the model's {expected[k]})"
        )
    return (
        f"checkpoint.dir {root}: {path.name} was written for another model ({'; '.join(said)}); "
        f"this job's model is model.kind = {cfg.model.kind!r}: point checkpoint.dir elsewhere, "
        "or set the model it was written for"
    )


def _model_entries(cfg: JobConfig) -> dict[str, tuple[int, ...]]:
    """The job's model's state_dict entries and global shapes, built on the meta device (no
    memory, no initialisation)."""
    import torch

    from harness.rank.model import build_model

    with torch.device("meta"):
        model: Any = build_model(cfg.model, vocab_size=cfg.data.vocab_size, seed=cfg.data.seed)
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}
