"""A job's checkpoint folder is refused before launch when another live job holds it or when its
DCP checkpoint was written for another model (``harness.job.checkpoint_dir``); ``ftharness run``
says so and exits 2 with nothing started."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from harness.config import load_config
from harness.job import checkpoint_dir
from harness.rank import dcp_checkpoint
from harness.rank.model import build_model

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

_HOLDER = """
import sys
from pathlib import Path
from harness.job import checkpoint_dir
h = checkpoint_dir.hold(Path(sys.argv[1]), "/runs/first")
print("held", flush=True)
sys.stdin.read()
"""


def _cfg(tmp_path: Path, *overrides: str):
    toml = tmp_path / "job.toml"
    toml.write_text('name = "t"\n')
    return load_config(str(toml), [f"checkpoint.dir={tmp_path / 'ckpt'}", *overrides])


def test_a_folder_another_live_job_holds_is_refused(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLDER, str(root)],
        cwd=REPO,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        said = checkpoint_dir.problem(_cfg(tmp_path), None)
        assert said is not None and "in use by another job" in said
        assert f"pid {holder.pid}, run /runs/first" in said
        with pytest.raises(checkpoint_dir.CheckpointDirHeld):
            checkpoint_dir.hold(root, "/runs/second")
    finally:
        holder.communicate("", timeout=30)  # it exits: the kernel drops its lock
    assert checkpoint_dir.problem(_cfg(tmp_path), None) is None
    checkpoint_dir.hold(root, "/runs/second").release()


def _write_dcp(tmp_path: Path, cfg) -> None:
    model = build_model(cfg.model, vocab_size=cfg.data.vocab_size, seed=0)
    optim = torch.optim.AdamW(model.parameters())
    writer = dcp_checkpoint.Writer(tmp_path / "ckpt", None, rank=0)
    state = dcp_checkpoint.app_state(
        model, optim, dataloader={"position": 1}, train_state={"step": 1}
    )
    writer.save(10, state)
    writer.close()


def test_a_dcp_checkpoint_of_another_model_is_refused(tmp_path: Path) -> None:
    written = _cfg(tmp_path, "checkpoint.format=dcp", "model.dim=16")
    _write_dcp(tmp_path, written)
    assert checkpoint_dir.problem(written, None) is None  # the same model: fine
    wider = checkpoint_dir.problem(_cfg(tmp_path, "checkpoint.format=dcp", "model.dim=32"), None)
    assert wider is not None and "step-10 was written for another model" in wider
    assert "of other shapes (first: " in wider
    llama = _cfg(
        tmp_path, "checkpoint.format=dcp", "model.kind=llama3_debug", "data.vocab_size=2048"
    )
    said = checkpoint_dir.problem(llama, None)
    assert said is not None and "entries missing" in said and "model.kind = 'llama3_debug'" in said
    # A job writing torch.save files is not asked about DCP folders
    assert checkpoint_dir.problem(_cfg(tmp_path, "model.dim=32"), None) is None


def test_ftharness_run_refuses_before_anything_starts(tmp_path: Path) -> None:
    _write_dcp(tmp_path, _cfg(tmp_path, "checkpoint.format=dcp", "model.dim=16"))
    out = tmp_path / "runs"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "harness",
            "run",
            str(tmp_path / "job.toml"),
            "--out",
            str(out),
            "--set",
            f"checkpoint.dir={tmp_path / 'ckpt'}",
            "--set",
            "checkpoint.format=dcp",
            "--set",
            "model.dim=32",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    assert "was written for another model" in proc.stderr
    assert not out.exists()  # no run directory: nothing started
