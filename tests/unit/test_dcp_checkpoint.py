"""DCP checkpoints (``harness.rank.dcp_checkpoint``) in one process: complete folders only, a
writer SIGKILLed mid-write leaves the previous checkpoint the newest, a write error reaches the
caller, and a planted checkpoint that would run code is refused, not run. (Sharded, resharded:
``tests/integration/test_dcp_sharded.py``.)"""

from __future__ import annotations

import os
import pickle
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from harness.config import ModelConfig
from harness.rank import dcp_checkpoint
from harness.rank.model import build_model, loss_fn

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _trained(seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = build_model(
        ModelConfig(kind="tiny", dim=16, layers=2, heads=2), vocab_size=64, seed=seed
    )
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    tokens = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(seed))
    loss_fn(model(tokens[:, :-1]), tokens[:, 1:]).backward()
    optim.step()
    return model, optim


def _state(model: torch.nn.Module, optim: torch.optim.Optimizer, step: int) -> dict:
    return dcp_checkpoint.app_state(
        model, optim, dataloader={"position": step, "consumed": 3 * step},
        train_state={"step": step, "ntokens_seen": 16 * step},
    )  # fmt: skip


def test_save_in_the_background_then_load_into_a_fresh_model(tmp_path: Path) -> None:
    model, optim = _trained()
    durable: list[int] = []
    writer = dcp_checkpoint.Writer(
        tmp_path, None, rank=0, keep=2, on_durable=lambda s, p: durable.append(s)
    )
    for step in (10, 20, 30):
        writer.save(step, _state(model, optim, step))
    writer.close()
    assert durable == [10, 20, 30]
    assert dcp_checkpoint.steps(tmp_path) == [30, 20]  # keep=2 pruned 10
    assert not (tmp_path / "step-10").exists()

    fresh, fresh_optim = (
        build_model(ModelConfig(kind="tiny", dim=16, layers=2, heads=2), vocab_size=64, seed=9),
        None,
    )
    fresh_optim = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    state = _state(fresh, fresh_optim, 0)
    dcp_checkpoint.load(tmp_path, 20, state)
    dcp_checkpoint.apply(fresh, fresh_optim, state)
    assert state["train_state"] == {"step": 20, "ntokens_seen": 320}
    assert state["dataloader"] == {"position": 20, "consumed": 60}
    for (k, a), b in zip(model.state_dict().items(), fresh.state_dict().values(), strict=True):
        assert torch.equal(a, b), k
    mine, theirs = optim.state_dict()["state"], fresh_optim.state_dict()["state"]
    assert all(torch.equal(mine[i][k], theirs[i][k]) for i in mine for k in mine[i])


def test_only_complete_step_folders_count(tmp_path: Path) -> None:
    assert dcp_checkpoint.steps(tmp_path / "none") == []
    (tmp_path / "step-5").mkdir()  # no .metadata: a torchtitan loader skips it too
    (tmp_path / ".step-9.tmp").mkdir()
    (tmp_path / ".step-9.tmp" / ".metadata").write_bytes(b"")
    (tmp_path / "step-x").mkdir()
    (tmp_path / "step-7").mkdir()
    (tmp_path / "step-7" / ".metadata").write_bytes(b"")
    assert dcp_checkpoint.steps(tmp_path) == [7]


_KILLED_WRITER = """
import sys, warnings, torch
warnings.simplefilter("ignore")
from harness.rank import dcp_checkpoint
w = dcp_checkpoint.Writer(sys.argv[1], None, rank=0)
w.save(1, {"x": torch.full((1000,), 1.0), "train_state": {"step": 1}})
w.wait()
w.save(2, {"x": torch.full((64_000_000,), 2.0), "train_state": {"step": 2}})
w.wait_staged()
print("staged", flush=True)
w.wait()
print("written", flush=True)
"""


def test_a_writer_killed_mid_write_leaves_the_previous_checkpoint_newest(tmp_path: Path) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-c", _KILLED_WRITER, str(tmp_path)],
        cwd=REPO, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "staged"
    deadline = time.monotonic() + 30
    while not (tmp_path / ".step-2.tmp").is_dir() and time.monotonic() < deadline:
        time.sleep(0.001)  # the write's folder: planned, being written
    os.kill(proc.pid, signal.SIGKILL)  # 256 MB being written and fsynced
    proc.wait(timeout=30)
    assert dcp_checkpoint.steps(tmp_path) == [1]
    assert (tmp_path / ".step-2.tmp").is_dir()  # the write was under way
    state = {"x": torch.zeros(1000), "train_state": {"step": 0}}
    dcp_checkpoint.load(tmp_path, 1, state)
    assert state["train_state"] == {"step": 1} and bool((state["x"] == 1.0).all())
    # The step written again over the crashed attempt's leftovers
    writer = dcp_checkpoint.Writer(tmp_path, None, rank=0)
    writer.save(2, {"x": torch.full((1000,), 3.0), "train_state": {"step": 2}})
    writer.close()
    assert dcp_checkpoint.steps(tmp_path) == [2, 1]
    assert not (tmp_path / ".step-2.tmp").exists()
    state = {"x": torch.zeros(1000), "train_state": {"step": 0}}
    dcp_checkpoint.load(tmp_path, 2, state)
    assert bool((state["x"] == 3.0).all())


def test_a_failed_background_write_is_raised_by_the_next_save(tmp_path: Path) -> None:
    writer = dcp_checkpoint.Writer(tmp_path, None, rank=0)
    (tmp_path / ".step-1.tmp").write_text("a file where the write's folder goes")
    writer.save(1, {"x": torch.ones(4)})  # returns: the write fails in the background
    with pytest.raises(CheckpointException, match="File exists"):
        writer.save(2, {"x": torch.ones(4)})
    writer.wait()  # raised once
    assert dcp_checkpoint.steps(tmp_path) == []


class _RunsCode:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple:
        return (os.system, (f"touch {self.marker}",))


def test_planted_metadata_that_would_run_code_is_refused(tmp_path: Path) -> None:
    writer = dcp_checkpoint.Writer(tmp_path, None, rank=0)
    writer.save(3, {"x": torch.ones(4)})
    writer.close()
    marker = tmp_path / "ran"
    (tmp_path / "step-3" / ".metadata").write_bytes(pickle.dumps(_RunsCode(marker)))
    with pytest.raises(dcp_checkpoint.CheckpointRefused, match=r"(posix|os)\.system"):
        dcp_checkpoint.load(tmp_path, 3, {"x": torch.zeros(4)})
    assert not marker.exists()


def test_a_planted_value_that_would_run_code_is_refused(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    # Planted with DCP's own save (a Writer's staging copy would deep-copy, i.e. run, it).
    dcp.save({"x": torch.ones(4), "extra": _RunsCode(marker)}, checkpoint_id=tmp_path / "step-4")
    assert not marker.exists()
    with pytest.raises(dcp_checkpoint.CheckpointRefused, match="extra"):
        dcp_checkpoint.load(tmp_path, 4, {"x": torch.zeros(4), "extra": None})
    assert not marker.exists()


def test_a_write_left_behind_is_removed_once_older_than_every_checkpoint_kept(
    tmp_path: Path,
) -> None:
    (tmp_path / ".step-5.tmp").mkdir(parents=True)  # a writer that died with its group
    (tmp_path / ".step-25.tmp").mkdir()  # maybe another group's write, still under way
    writer = dcp_checkpoint.Writer(tmp_path, None, rank=0, keep=2)
    for step in (10, 20):
        writer.save(step, {"x": torch.full((4,), float(step))})
        writer.wait()
    assert not (tmp_path / ".step-5.tmp").exists()
    assert (tmp_path / ".step-25.tmp").exists()
    writer.save(30, {"x": torch.ones(4)})
    writer.close()
    assert dcp_checkpoint.steps(tmp_path) == [30, 20]
    assert (tmp_path / ".step-25.tmp").exists()  # younger than step 20: left alone
