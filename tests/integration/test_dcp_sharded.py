"""Sharded checkpoints in DCP format (``harness.rank.dcp_checkpoint``), with real processes: a
checkpoint written in the background by 4 FSDP2 shards loads onto 2 shards and into an
unsharded model, bitwise, optimizer state, data position and train state included; a writer
SIGKILLed mid-write leaves the previous checkpoint the newest."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_fsdp_group import _free_ports
from trainer_procs import REPO

from harness.rank import dcp_checkpoint

PROC = Path(__file__).with_name("dcp_proc.py")

pytestmark = pytest.mark.timeout(300)


def _group(mode: str, world: int, root: Path, out: Path, model: str = "tiny") -> None:
    port = _free_ports(1) if world else 0
    procs = [
        subprocess.Popen(
            [sys.executable, str(PROC), mode, *map(str, (world, r, port, root, out)), model],
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(max(world, 1))
    ]
    logs = [p.communicate(timeout=240)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), "\n".join(logs)


def _equal(a: object, b: object) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    return a == b


def test_a_checkpoint_of_4_shards_loads_onto_2_and_unsharded_bitwise(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    _group("save", 4, root, tmp_path / "saved.pt")
    assert dcp_checkpoint.steps(root) == [2]
    step = root / "step-2"
    assert sorted(p.name for p in step.iterdir()) == [
        ".metadata", "__0_0.distcp", "__1_0.distcp", "__2_0.distcp", "__3_0.distcp",
    ]  # fmt: skip
    assert not list(root.glob(".step-*"))  # nothing left in progress
    assert step.stat().st_mode & 0o077 == 0  # private
    saved = torch.load(tmp_path / "saved.pt")
    assert saved["optimizer"] and saved["train_state"] == {"step": 2, "ntokens_seen": 128}
    _group("load", 2, root, tmp_path / "two.pt")
    _group("load", 0, root, tmp_path / "one.pt")
    for name in ("two.pt", "one.pt"):
        loaded = torch.load(tmp_path / name)
        assert _equal(saved, loaded), name


def test_torchtitans_llama3_checkpoints_and_loads_unsharded_bitwise(tmp_path: Path) -> None:
    """torchtitan's model saves its fused QKV as wq/wk/wv (state-dict hooks): the checkpoint
    holds those names, as torchtitan's own would, and loads back into the fused layout."""
    root = tmp_path / "ckpt"
    _group("save", 2, root, tmp_path / "saved.pt", "llama3_debug")
    _group("load", 0, root, tmp_path / "one.pt", "llama3_debug")
    saved, loaded = torch.load(tmp_path / "saved.pt"), torch.load(tmp_path / "one.pt")
    assert _equal(saved, loaded)
    from torch.distributed.checkpoint import FileSystemReader

    keys = FileSystemReader(str(root / "step-2")).read_metadata().state_dict_metadata
    assert any(k.endswith(".wq.weight") for k in keys), sorted(keys)[:8]
    assert not any("wqkv" in k for k in keys if not k.startswith("optimizer"))
    # Split shard by shard (dcp_checkpoint.model_state), not gathered whole first: each of the
    # two ranks wrote its half of every wq/wk/wv.
    split = [k for k in keys if k.endswith((".wq.weight", ".wk.weight", ".wv.weight"))]
    assert split and all(len(keys[k].chunks) == 2 for k in split), {
        k: len(keys[k].chunks) for k in split
    }
